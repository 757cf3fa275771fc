"""Runs one scheduled step: applies the step's deltas to its per-sequence state, builds the step's
inputs (step_inputs.py), runs the model on the paged KV cache and samples (sampler.py).

The runner holds each sequence's tokens and block table, so after a sequence's first step the scheduler
only sends what changed (new blocks, how many tokens to run); tokens it samples are appended here.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from common.config import DTYPES, EngineConfig
from common.kv_layout import KVCacheLayout
from common.model_config import ModelConfig
from common.model_source import ModelSource
from common.protocol import Logprob, ModelRunnerOutput, NewSequenceData, SchedulerOutput, WorkerInfo
from common.sampling_params import SamplingParams
from common.speculative import SpeculativeConfig
from common.tp_layout import check_config, head_shard
from gpu_worker import cpu_precision
from gpu_worker.attention import (FP8_DTYPES, allocate_kv_cache, get_backend, index_copy_rows, kv_block_bytes,
                                  resolve_kv_cache_dtype)
from gpu_worker.kernels import native
from gpu_worker.layers.kv_rotation import CALIBRATION_TEXT, KV_SCALE_HEADROOM, kv_rotation
from gpu_worker.lora import LoRAManager
from gpu_worker.parallel import tp
from gpu_worker.quantization.packed import GEMM_MAX_ROWS, I16_VECTOR_MAX_ROWS, PackedWeight
from gpu_worker.sampler import build_sampling_batch, draw, logprob_records, prompt_logprobs
from gpu_worker.spec_decode import Proposer, build_proposer
from gpu_worker.spec_decode.proposer import CachePair, fit_drafts
from gpu_worker.spec_decode.rejection import verify
from gpu_worker.step_inputs import PromptLogprobRows, SequenceState, StepInputs, build_step_inputs
from gpu_worker.weight_loader import load_model, weight_bytes

if TYPE_CHECKING:      # imported on the first constrained sequence (xgrammar loads with it)
    from gpu_worker.structured_output import StructuredOutputManager

log = logging.getLogger("pagedserve.worker")
PER_HOST_FLAGS = ("num_threads", "download_dir")     # may differ between the hosts of one group

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


assert set(_DTYPES) | {"auto"} == set(DTYPES)      # the CLI's choices are these


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None):
        self.config = config
        self.source = source or ModelSource.from_config(config, config.load_format != "dummy")
        self.model_config: ModelConfig = self.source.model_config()
        self.kv_config = self._check_tensor_parallel(config)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.max_model_len = min(config.max_model_len or self.model_config.max_context, self.model_config.max_context)
        torch.manual_seed(config.seed)
        self.matmul_dtype = cpu_precision.matmul_dtype(config.dtype, self.device)
        # auto: the model's dtype, or bf16 under --dtype auto on the CPU (half the bytes each attention reads)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, cpu_precision.kv_cache_dtype(
            config.dtype, self.device) or self.matmul_dtype or self.dtype)
        if self.device.type == "cpu" and self.kv_dtype == torch.bfloat16 and native.attention_isa() == native.AMX:
            log.info("bf16 KV cache: decode and verify attention on AMX-BF16 tiles (queries and weights rounded "
                     "to bf16; PAGEDSERVE_CPU_ISA=avx512 keeps them fp32)")
        t0 = time.perf_counter()
        self.int16_activations = cpu_precision.int16_activations(config.dtype, self.device)
        spec = SpeculativeConfig.parse(config.speculative_config)
        # Speculation keeps every step up to GEMM_MAX_ROWS on the vector kernel, so that a verification
        # step's rows match plain decoding's bit for bit; without it, larger steps take the panels sooner.
        vector_rows = None if spec else I16_VECTOR_MAX_ROWS.get(native.cpu_isa())
        self.model = load_model(self.source, self.model_config, self.dtype, self.device, self.max_model_len,
                                config.quantization, config.load_format, self.matmul_dtype, self.int16_activations,
                                vector_rows)
        log.info("loaded %s (%s, %s) in %.1fs", self.source.name, self.model_config.arch, self.dtype,
                 time.perf_counter() - t0)
        self.lora = LoRAManager(self.model, self.model_config.num_layers, config.max_loras, config.max_lora_rank,
                                config.max_cpu_loras or config.max_loras, self.device, self.dtype) \
            if config.enable_lora else None
        if self.matmul_dtype == torch.bfloat16 and self.lora is None and hasattr(self.model, "narrow_activations"):
            narrowed = self.model.narrow_activations()
            log.info("%d norms give large steps' bf16 products their input in bf16", narrowed)
        self.backend = get_backend(config.attention_backend, self.device)
        self.block_size = config.block_size
        self.kv_layout = KVCacheLayout.for_windows(self.model_config.windows)
        if self.kv_layout.windowed and self._long_rope_after is not None:
            raise ValueError("a model with both LongRoPE and sliding windows is not supported: the switch to "
                             "the long factors recomputes keys that the windows have already released")
        self.eos_ids: set[int] = set(self.model_config.eos_token_ids)   # the engine adds the tokenizer's
        self.seqs: dict[str, SequenceState] = {}
        if spec is not None and spec.method == "draft_model" and self.kv_layout.windowed:
            raise ValueError("a draft model reads the target's whole block table, and this model's sliding "
                             "windows release the blocks behind them; use the ngram method")
        self.proposer: Proposer | None = build_proposer(spec, self) if spec else None
        self._rotate_fp8_kv()
        self.spec_disable_by_batch_size = spec.disable_by_batch_size if spec else None
        self.spec_max_rows = self._spec_max_rows()
        self._structured: StructuredOutputManager | None = None        # on the first constrained sequence
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []     # one pair per cache slot of a group
        self.layer_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: its slot's pair
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _check_tensor_parallel(self, config: EngineConfig) -> ModelConfig:
        """Refuse what this rank's group cannot run, and say which heads its KV cache holds: the model
        config with this rank's KV heads (common/tp_layout.py)."""
        g, mc = tp(), self.model_config
        check_config(replace(config, tensor_parallel_size=g.size), mc, self.source.quantization_config())
        return replace(mc, num_kv_heads=head_shard(mc.num_heads, mc.num_kv_heads, g.size, g.rank).num_kv_heads)

    # ---- start-up ----------------------------------------------------------------------------
    def initialize(self, eos_token_ids: list[int]) -> WorkerInfo:
        """Size and allocate the KV cache (after a profiling pass on GPU) and say what was allocated."""
        self.eos_ids |= set(eos_token_ids)
        num_blocks, num_host = self.profile_num_blocks()
        self._centre_fp8_kv()
        self.init_kv_cache(num_blocks, num_host)
        if self.config.calculate_kv_scales:
            self._calibrate_kv_scales_on_first_step()
        return WorkerInfo(num_blocks=num_blocks, num_host_blocks=num_host, max_model_len=self.max_model_len,
                          vocab_size=self.model_config.vocab_size, block_bytes=self.block_bytes(),
                          weight_bytes=weight_bytes(self.model), num_layers=self.model_config.num_layers,
                          lora_targets=self.lora.targets if self.lora else {},
                          max_loras=self.lora.max_loras if self.lora else 0,
                          max_lora_rank=self.lora.max_rank if self.lora else 0,
                          prefix_caching=self._prefix_caching_safe(),
                          kv_group_windows=self.kv_layout.group_windows, long_rope_after=self._long_rope_after,
                          engine_flags={k: v for k, v in self.config.to_dict().items() if k not in PER_HOST_FLAGS})

    def reset(self) -> None:
        """Forget the old scheduler session before a new one initializes: its sequence ids, block ids and
        adapter keys mean nothing to a restarted scheduler (the weights and the loaded model stay)."""
        self.seqs.clear()
        if self.lora is not None:
            self.lora.reset()

    @property
    def _long_rope_after(self) -> int | None:
        """LongRoPE's pretraining length where a context can pass it, else None."""
        after = self.model.rope.long_after
        return after if after is not None and after < self.max_model_len else None

    def _prefix_caching_safe(self) -> bool:
        """LongRoPE keys are rotated by their sequence's length (short and long factors), so a block of the
        same tokens differs between sequences; windowed layers release a sequence's old blocks. Such
        models run without prefix caching."""
        long_after = self._long_rope_after
        why = "LongRoPE rotates a sequence's keys differently once it is longer than %d tokens" % long_after \
            if long_after is not None else \
            "sliding-window layers release blocks behind their window" if self.kv_layout.windowed else None
        if why and self.config.enable_prefix_caching:
            log.info("prefix caching is off: %s", why)
        return why is None

    def _rotate_fp8_kv(self) -> None:
        """An fp8 cache holds every head's q, k and v rotated (layers/kv_rotation.py): the same scores and
        outputs, less rounding error. Not where a checkpoint gave the scales: they were measured unrotated."""
        if self.kv_dtype not in FP8_DTYPES or not self.config.kv_cache_rotation:
            return
        layers = [m for m in self._attention_modules() if hasattr(m, "kv_rotation")]
        rotations: dict[int, torch.Tensor] = {}              # one matrix per head size, shared by the layers
        for m in layers:
            if self.config.calculate_kv_scales or (m.k_scale, m.v_scale) == (1.0, 1.0):
                if m.head_dim not in rotations:
                    rotations[m.head_dim] = kv_rotation(m.head_dim, self.device)
                m.kv_rotation = rotations[m.head_dim]
        log.info("fp8 KV cache: %d of %d attention layers rotate q, k and v", sum(m.kv_rotation is not None
                                                                                  for m in layers), len(layers))

    def _calibrate_kv_scales_on_first_step(self) -> None:
        """Every attention layer (draft model's included) takes its fp8 scales from the first real step,
        after the profiling pass, so no entry is written with other scales."""
        if self.kv_dtype not in FP8_DTYPES:
            log.warning("--calculate-kv-scales has no effect: the KV cache is %s, not fp8", self.kv_dtype)
            return
        fmax = float(torch.finfo(self.kv_dtype).max)
        for m in self._attention_modules():
            if hasattr(m, "kv_calibration_max"):
                m.kv_calibration_max = fmax

    def _attention_modules(self):
        """Every module of the target model and of a draft model (whose cache has the same dtype)."""
        models = [self.model] + ([self.proposer.model] if hasattr(self.proposer, "model") else [])
        return (m for model in models for m in model.modules())

    def block_bytes(self) -> int:
        own = kv_block_bytes(self.kv_config, self.block_size, self.kv_dtype, self.kv_layout.group_size)
        return own + (self.proposer.block_bytes(self.block_size) if self.proposer else 0)

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
        """One full-budget step, so profiling sees the peak activation memory: as sequences of at most
        max_model_len tokens (positions past it are outside the rope tables)."""
        n = self.config.max_num_batched_tokens
        self._throwaway_step([[0] * min(self.max_model_len, n - start) for start in range(0, n, self.max_model_len)])

    def _centre_fp8_kv(self) -> None:
        """Each rotated layer's centres and gains from one pass over a fixed text (layers/kv_rotation.py),
        before the cache holds anything. Every rank runs it (its collectives), each for its own heads."""
        layers = [m for m in self.model.modules() if getattr(m, "kv_rotation", None) is not None]
        if not layers:
            return
        fmax = float(torch.finfo(self.kv_dtype).max)
        for m in layers:
            m.kv_centres_calibration = True
            if (m.k_scale, m.v_scale) == (1.0, 1.0):      # no checkpoint scales: the same pass sets them
                m.kv_calibration_max = fmax / KV_SCALE_HEADROOM
        ids = self.source.load_tokenizer().encode(CALIBRATION_TEXT)[:self.max_model_len]
        self._throwaway_step([ids])
        log.info("fp8 KV cache: keys and values centred in %d layers", sum(m.kv_centres is not None for m in layers))

    def _throwaway_step(self, prompts: list[list[int]]) -> None:
        """Prefill `prompts` in one step on a cache of their own, then forget them and that cache."""
        saved = self.kv_caches, self.layer_caches, self.host_caches
        per_seq = [-(-len(p) // self.block_size) for p in prompts]
        self.init_kv_cache(sum(per_seq), 0)
        seqs, first = [], 0
        for i, (p, nb) in enumerate(zip(prompts, per_seq)):
            table = [b for b in range(first, first + nb) for _ in range(self.kv_layout.num_groups)]
            seqs.append(NewSequenceData(f"__throwaway{i}__", p, len(p), SamplingParams(max_tokens=1, temperature=0),
                                        table, 0, len(p)))
            first += nb
        self.execute(SchedulerOutput(step_id=-1, new_seqs=seqs))
        for seq in seqs:
            self.seqs.pop(seq.seq_id)
        self.kv_caches, self.layer_caches, self.host_caches = saved

    def init_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        self.kv_caches, self.host_caches = allocate_kv_cache(self.kv_config, num_blocks, num_host_blocks,
                                                             self.block_size, self.kv_dtype, self.device,
                                                             self.kv_layout.group_size)
        self.layer_caches = [self.kv_caches[slot] for slot in self.kv_layout.layer_slot]
        if self.proposer is not None:
            self.proposer.init_cache(num_blocks, num_host_blocks)

    def _cache_pairs(self) -> list[CachePair]:
        """Every (device, host) cache under the scheduler's block ids: the target's and a draft model's."""
        return [(self.kv_caches, self.host_caches)] + (self.proposer.caches() if self.proposer else [])

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's deltas, run the scheduled tokens and sample; the only state change after the
        forward pass is appending each sequence's sampled token."""
        out = ModelRunnerOutput(step_id=sched.step_id)
        self._apply_deltas(sched, out)
        scheduled = [(r.seq_id, r.num_new_tokens) for r in sched.new_seqs] + \
                    [(r.seq_id, r.num_new_tokens) for r in sched.cached_seqs]
        if self.lora is not None:     # each adapter's rows in one run (lora/delta.py); outputs name their sequence
            scheduled.sort(key=lambda s: self.seqs[s[0]].lora_id)
        if not scheduled:
            return out
        inputs = build_step_inputs(self.seqs, scheduled, self.block_size, self.device, self.kv_layout.num_groups)
        out.deferred_seq_ids = self._grammars_compiling(inputs.sample_seq_ids)
        self._start_grammar_masks(inputs, out.deferred_seq_ids)
        prepared = [self.backend.prepare(m) for m in inputs.attn_groups]
        attn = [prepared[g] for g in self.kv_layout.layer_group]       # each layer's group's metadata
        hidden = self._forward(inputs, attn)
        if inputs.sample_seq_ids:
            self._sample(hidden, inputs, out)
        for seq_id, lp_rows in inputs.prompt_logprobs.items():
            out.prompt_logprobs[seq_id] = self._prompt_logprobs(hidden, seq_id, lp_rows)
        if self.proposer is not None:
            self._speculate(scheduled, out.seq_ids, out)
        return out

    def _forward(self, inputs: StepInputs, attn) -> torch.Tensor:
        """The target model over the step's rows, each under its sequence's adapter slot."""
        if self.lora is None:
            return self.model(inputs.input_ids, inputs.positions, self.layer_caches, attn, self.backend, inputs.seq_ends)
        self.lora.begin_step(inputs.lora_ids)
        try:
            return self.model(inputs.input_ids, inputs.positions, self.layer_caches, attn, self.backend, inputs.seq_ends)
        finally:
            self.lora.end_step()

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs, out: ModelRunnerOutput) -> None:
        """Sample every logits row; a sequence with k drafts keeps what the verifier (spec_decode/rejection.py)
        accepts of them, and one token of the target's after them."""
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        seqs = [self.seqs[s] for s in inputs.sample_seq_ids]
        constrained = self._structured is not None and any(st.grammar is not None for st in seqs)
        if constrained:       # before every other logits processor
            self._structured.apply(logits)
        batch = build_sampling_batch(inputs.sampling_states(self.seqs), logits.shape[-1], self.eos_ids, self.device)
        samples = draw(logits, batch)
        ids_list, keeps = verify(samples, seqs, inputs.num_samples)
        lps = logprob_records(samples, ids_list, batch.max_logprobs)
        row = 0
        for st, k, keep in zip(seqs, inputs.num_samples, keeps):
            if st.seq_id in out.deferred_seq_ids:
                row += k
                continue
            st.token_ids.extend(ids_list[row:row + keep])
            if st.grammar is not None:
                self._structured.accept(st, ids_list[row:row + keep])
            out.seq_ids.append(st.seq_id)
            out.sampled_token_ids.append(ids_list[row:row + keep])
            want = st.params.num_top_logprobs
            out.logprobs.append([r for recs in lps[row:row + keep] for r in self._trim(recs, want)]
                                if lps and want is not None else None)
            row += k

    def _grammars_compiling(self, sampling: list[str]) -> list[str]:
        """Sequences that skip this step's sample because their grammar still compiles. Not under tensor
        parallelism: every rank must sample the same sequences, and each compiles on its own clock."""
        if self._structured is None or tp().size > 1:
            return []
        return [s for s in sampling if self._structured.still_compiling(self.seqs[s])]

    def _start_grammar_masks(self, inputs: StepInputs, deferred: list[str]) -> None:
        """Constrained rows' bitmask, filled in the manager's thread while the forward pass runs."""
        if self._structured is None:
            return
        items, row = [], 0
        for seq_id, k in zip(inputs.sample_seq_ids, inputs.num_samples):
            st = self.seqs[seq_id]
            if st.grammar is not None and seq_id not in deferred:
                items.append((st, row, st.spec_token_ids[:k - 1]))
            row += k
        if items:
            self._structured.start_masks(items, row)

    def _grammar_for(self, st: SequenceState) -> None:
        if self._structured is None:
            from gpu_worker.structured_output import StructuredOutputManager
            from gpu_worker.structured_output.xgrammar_backend import XGrammarBackend
            self._structured = StructuredOutputManager(lambda: XGrammarBackend(
                self.source.load_tokenizer(), self.model_config.vocab_size, sorted(self.eos_ids)))
        self._structured.add(st)

    def _spec_max_rows(self) -> int | None:
        """With packed weights on the CPU, the rows a step may reach with drafts: as far as the packed
        kernel runs them (GEMM_MAX_ROWS), extra rows cost little; beyond, the fp32 GEMM's cost grows with
        every row, and drafts that are partly rejected cost more than they save. None: no cap (GPU, or
        plain weights)."""
        packed = any(isinstance(getattr(m, "packed", None), PackedWeight) for m in self.model.modules())
        if self.device.type != "cpu" or not native.available() or not packed:
            return None
        return GEMM_MAX_ROWS[native.cpu_isa()]

    def _speculate(self, scheduled: list[tuple[str, int]], sampled: list[str], out: ModelRunnerOutput) -> None:
        """Show the proposer the step, and collect drafts for the next step of every sequence that just
        sampled, unless the batch is at disable_by_batch_size (the scheduler would drop them); on the CPU
        cut so that the next step's rows stay within spec_max_rows."""
        states = [self.seqs[s] for s, _ in scheduled]
        done = set(sampled)
        self.proposer.observe(states, [len(st.token_ids) if st.seq_id in done else st.num_computed_tokens + n
                                       for st, (_, n) in zip(states, scheduled)])
        limit = self.spec_disable_by_batch_size
        if not sampled or (limit is not None and len(sampled) >= limit):
            return
        budget = None if self.spec_max_rows is None else self.spec_max_rows - len(sampled)
        if budget is not None and budget <= 0:
            return
        seqs = [self.seqs[s] for s in sampled]
        drafts = self.proposer.propose(seqs)
        keep = [len(d.token_ids) for d in drafts]
        if budget is not None:
            keep = fit_drafts(keep, budget)
        for st, d, n in zip(seqs, drafts, keep):
            if st.grammar is not None:     # drafts the grammar forbids would only be rejected
                n = min(n, self._structured.valid_drafts(st, d.token_ids[:n]))
            st.draft_probs = d.probs
            if n:
                out.spec_token_ids[st.seq_id] = d.token_ids[:n]

    def _prompt_logprobs(self, hidden: torch.Tensor, seq_id: str, lp: PromptLogprobRows) -> list[Logprob | None]:
        k = self.seqs[seq_id].params.prompt_logprobs
        recs: list[Logprob | None] = prompt_logprobs(self.model.compute_logits(hidden[lp.rows]).float(),
                                                     lp.next_ids, k)
        return [None] + recs if lp.first_chunk else recs

    @staticmethod
    def _trim(recs: list[Logprob], k: int) -> list[Logprob]:
        return [(c, r, ti[:k], tv[:k]) for c, r, ti, tv in recs]

    def _apply_deltas(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        for seq_id in sched.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        if sched.blocks_to_swap_out:
            self._move_blocks(sched.blocks_to_swap_out, "device", "host")
        if sched.blocks_to_copy:
            self._move_blocks(sched.blocks_to_copy, "device", "device")
        if sched.blocks_to_swap_in:
            self._move_blocks(sched.blocks_to_swap_in, "host", "device")
        if sched.lora_loads:
            if self.lora is None:
                raise RuntimeError("the scheduler sent LoRA adapters to a worker started without --enable-lora")
            out.lora_errors = self.lora.load(sched.lora_loads)
        for r in sched.new_seqs:
            st = self.seqs[r.seq_id] = SequenceState.from_new(r, self.device)
            if r.sampling_params.structured_outputs is not None:
                self._grammar_for(st)
        for r in sched.cached_seqs:
            st = self.seqs[r.seq_id]
            del st.block_ids[r.blocks_from:]
            st.block_ids.extend(r.block_ids)
            st.num_computed_tokens = r.num_computed_tokens
            st.spec_token_ids = sched.spec_token_ids.get(r.seq_id, [])
        for seq_id, token in sched.replaced_token_ids.items():     # beam search chose another continuation
            self.seqs[seq_id].token_ids[-1] = token

    def _move_blocks(self, pairs: list[tuple[int, int]], src: str, dst: str) -> None:
        """Copy blocks between "device" and "host" caches of every cache pair."""
        for dev, host in self._cache_pairs():
            caches = {"device": dev, "host": host}
            self._copy_blocks(caches[src], caches[dst], pairs)

    @staticmethod
    def _copy_blocks(src_caches, dst_caches, pairs) -> None:
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches):
            s_idx, d_idx = src.to(sk.device), dst.to(dk.device)
            index_copy_rows(dk, d_idx, sk.index_select(0, s_idx).to(dk.device, non_blocking=True))
            index_copy_rows(dv, d_idx, sv.index_select(0, s_idx).to(dv.device, non_blocking=True))
