"""Runs one scheduled step: applies the step's deltas to its per-sequence state, builds the step's
inputs (step_inputs.py), runs the model on the paged KV cache and samples (sampler.py).

The runner holds each sequence's tokens and block table, so after a sequence's first step the scheduler
only sends what changed (new blocks, how many tokens to run); tokens it samples are appended here.
"""
from __future__ import annotations

import logging
import time

import torch

from common.config import EngineConfig, ModelConfig
from common.model_source import ModelSource
from common.protocol import Logprob, ModelRunnerOutput, NewSequenceData, SchedulerOutput, WorkerInfo
from common.sampling_params import SamplingParams
from common.speculative import SpeculativeConfig
from gpu_worker.attention import get_backend
from gpu_worker.layers.linear import set_linear_method
from gpu_worker.models import build_model
from gpu_worker.sampler import build_sampling_batch, prompt_logprobs, sample
from gpu_worker.spec_decode import Proposer, build_proposer
from gpu_worker.step_inputs import PromptLogprobRows, SequenceState, StepInputs, build_step_inputs
from gpu_worker.weight_loader import load_weights

log = logging.getLogger("pagedserve.worker")

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def accepted_drafts(drafts: list[int], target: list[int]) -> int:
    """How many leading drafts the target's own choices at those positions confirm."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto, float32, bfloat16 or float16")
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None):
        self.config = config
        self.source = source or ModelSource.resolve(config.model, config.load_format != "dummy")
        self.model_config: ModelConfig = self.source.model_config()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.max_model_len = min(config.max_model_len or self.model_config.max_context, self.model_config.max_context)
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        with torch.device(self.device):
            self.model = build_model(self.model_config, self.dtype, self.max_model_len)
            set_linear_method(self.model, config.quantization)
            load_weights(self.model, self.source, config.load_format)
        self.model.eval()
        log.info("loaded %s (%s, %s) in %.1fs", self.source.name, self.model_config.arch, self.dtype,
                 time.perf_counter() - t0)
        self.backend = get_backend(config.attention_backend, self.device)
        self.block_size = config.block_size
        self.eos_ids: set[int] = set(self.model_config.eos_token_ids)   # the engine adds the tokenizer's
        self.seqs: dict[str, SequenceState] = {}
        spec = SpeculativeConfig.parse(config.speculative_config)
        self.proposer: Proposer | None = build_proposer(spec) if spec else None
        self.spec_disable_by_batch_size = spec.disable_by_batch_size if spec else None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- start-up ----------------------------------------------------------------------------
    def initialize(self, eos_token_ids: list[int]) -> WorkerInfo:
        """Size and allocate the KV cache (after a profiling pass on GPU) and say what was allocated."""
        self.eos_ids |= set(eos_token_ids)
        num_blocks, num_host = self.profile_num_blocks()
        self.init_kv_cache(num_blocks, num_host)
        return WorkerInfo(num_blocks=num_blocks, num_host_blocks=num_host, max_model_len=self.max_model_len,
                          vocab_size=self.model_config.vocab_size, block_bytes=self.block_bytes())

    def block_bytes(self) -> int:
        mc = self.model_config
        return self.block_size * mc.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8)

    def profile_num_blocks(self) -> tuple[int, int]:
        """Blocks that fit the memory budget on device, and on the host for swapping."""
        c = self.config
        if c.num_gpu_blocks:
            num = c.num_gpu_blocks
        elif self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self._dummy_forward()
            free, total = torch.cuda.mem_get_info()
            budget = total * c.gpu_memory_utilization - torch.cuda.max_memory_allocated()
            num = int(budget // self.block_bytes())
        else:
            num = int(c.kv_cache_memory * (1 << 30) // self.block_bytes())
        host = int(c.swap_space * (1 << 30) // self.block_bytes())
        if num < 1:
            raise RuntimeError("no memory is left for the KV cache; lower the model size or raise the budget")
        return num, host

    def _dummy_forward(self) -> None:
        """One full-budget step on a throwaway cache, so profiling sees the peak activation memory."""
        n = self.config.max_num_batched_tokens
        saved = self.kv_caches
        num_blocks = max(1, -(-n // self.block_size))
        self.init_kv_cache(num_blocks, 0)
        seq = NewSequenceData("__profile__", [0] * n, n, SamplingParams(max_tokens=1, temperature=0),
                              list(range(num_blocks)), 0, n)
        self.execute(SchedulerOutput(step_id=-1, new_seqs=[seq]))
        self.seqs.pop(seq.seq_id)
        self.kv_caches = saved

    def init_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        mc = self.model_config
        shape = (num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(mc.num_layers)]
        hshape = (num_host_blocks, *shape[1:])
        pin = self.device.type == "cuda"
        self.host_caches = [(torch.zeros(hshape, dtype=self.dtype, pin_memory=pin),
                             torch.zeros(hshape, dtype=self.dtype, pin_memory=pin))
                            for _ in range(mc.num_layers)] if num_host_blocks else []

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's deltas, run the scheduled tokens and sample; the only state change after the
        forward pass is appending each sequence's sampled token."""
        self._apply_deltas(sched)
        scheduled = [(r.seq_id, r.num_new_tokens) for r in sched.new_seqs] + \
                    [(r.seq_id, r.num_new_tokens) for r in sched.cached_seqs]
        out = ModelRunnerOutput(step_id=sched.step_id)
        if not scheduled:
            return out
        inputs = build_step_inputs(self.seqs, scheduled, self.block_size, self.device)
        attn = self.backend.prepare(inputs.attn)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, attn, self.backend)
        if inputs.sample_seq_ids:
            self._sample(hidden, inputs, out)
        for seq_id, lp_rows in inputs.prompt_logprobs.items():
            out.prompt_logprobs[seq_id] = self._prompt_logprobs(hidden, seq_id, lp_rows)
        return out

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs, out: ModelRunnerOutput) -> None:
        """Sample every logits row; a sequence with k drafts keeps the target's tokens up to and including
        the first that differs from its draft.

        Row j's logits already condition on drafts 0..j-1, which equal the kept tokens whenever row j is
        reached, so each kept token is drawn from exactly the target distribution. For a proposer whose
        drafts are deterministic (n-gram: q is one-hot), this *is* rejection sampling: draft j survives
        with probability p_j(d_j) = min(1, p/q), and a rejected position yields a sample of p_j given that it
        is not d_j, i.e. norm(max(0, p_j - q_j)). Greedy rows are the special case p = one-hot. A proposer
        with a spread-out q (a draft model) needs the general test, which is not here yet."""
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        batch = build_sampling_batch(inputs.sampling_states(self.seqs), logits.shape[-1], self.eos_ids, self.device)
        ids, lps = sample(logits, batch)
        ids_list, row = ids.tolist(), 0
        for seq_id, k in zip(inputs.sample_seq_ids, inputs.num_samples):
            st = self.seqs[seq_id]
            keep = 1 + accepted_drafts(st.spec_token_ids, ids_list[row:row + k - 1])
            st.token_ids.extend(ids_list[row:row + keep])
            out.seq_ids.append(seq_id)
            out.sampled_token_ids.append(ids_list[row:row + keep])
            want = st.params.logprobs
            out.logprobs.append([r for recs in lps[row:row + keep] for r in self._trim(recs, want)]
                                if lps and want is not None else None)
            row += k
        limit = self.spec_disable_by_batch_size
        if self.proposer is not None and (limit is None or len(inputs.sample_seq_ids) < limit):
            self._propose(inputs.sample_seq_ids, out)   # at or above the limit the scheduler drops them anyway

    def _propose(self, seq_ids: list[str], out: ModelRunnerOutput) -> None:
        """Drafts for the next step of every sequence that just sampled."""
        seqs = [self.seqs[s] for s in seq_ids]
        for st, drafts in zip(seqs, self.proposer.propose(seqs)):
            if drafts:
                out.spec_token_ids[st.seq_id] = drafts

    def _prompt_logprobs(self, hidden: torch.Tensor, seq_id: str, lp: PromptLogprobRows) -> list[Logprob | None]:
        k = self.seqs[seq_id].params.prompt_logprobs
        recs: list[Logprob | None] = prompt_logprobs(self.model.compute_logits(hidden[lp.rows]).float(),
                                                     lp.next_ids, k)
        return [None] + recs if lp.first_chunk else recs

    @staticmethod
    def _trim(recs: list[Logprob], k: int) -> list[Logprob]:
        return [(c, r, ti[:k], tv[:k]) for c, r, ti, tv in recs]

    def _apply_deltas(self, sched: SchedulerOutput) -> None:
        for seq_id in sched.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        if sched.blocks_to_swap_out:
            self._copy_blocks(self.kv_caches, self.host_caches, sched.blocks_to_swap_out)
        if sched.blocks_to_copy:
            self._copy_blocks(self.kv_caches, self.kv_caches, sched.blocks_to_copy)
        if sched.blocks_to_swap_in:
            self._copy_blocks(self.host_caches, self.kv_caches, sched.blocks_to_swap_in)
        for r in sched.new_seqs:
            self.seqs[r.seq_id] = SequenceState.from_new(r, self.device)
        for r in sched.cached_seqs:
            st = self.seqs[r.seq_id]
            del st.block_ids[r.blocks_from:]
            st.block_ids.extend(r.block_ids)
            st.num_computed_tokens = r.num_computed_tokens
            st.spec_token_ids = sched.spec_token_ids.get(r.seq_id, [])

    @staticmethod
    def _copy_blocks(src_caches, dst_caches, pairs) -> None:
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches):
            s_idx, d_idx = src.to(sk.device), dst.to(dk.device)
            dk.index_copy_(0, d_idx, sk.index_select(0, s_idx).to(dk.device, non_blocking=True))
            dv.index_copy_(0, d_idx, sv.index_select(0, s_idx).to(dv.device, non_blocking=True))
