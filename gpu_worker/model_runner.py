"""Runs one scheduled step: applies the step's deltas to its per-request state, builds the flat
input tensors and attention metadata, runs the model on the paged KV cache and samples.

The runner holds each request's tokens and block table, so after a request's first step the scheduler
only sends what changed (new blocks, how many tokens to run); tokens it samples are appended here.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from common.config import EngineConfig, ModelConfig
from common.model_source import ModelSource
from common.protocol import Logprob, ModelRunnerOutput, NewRequestData, SchedulerOutput
from common.sampling_params import SamplingParams
from gpu_worker.attention import AttentionMetadata, get_backend
from gpu_worker.layers.linear import set_linear_method
from gpu_worker.models import build_model
from gpu_worker.sampler import SamplingBatch, prompt_logprobs, sample
from gpu_worker.weight_loader import load_weights

log = logging.getLogger("pagedserve.worker")

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


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


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None


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
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- KV cache sizing ---------------------------------------------------------------------
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
        req = NewRequestData("__profile__", [0] * n, n, SamplingParams(max_tokens=1, temperature=0),
                             list(range(num_blocks)), 0, n)
        self.execute(SchedulerOutput(step_id=-1, new_reqs=[req]))
        self.requests.pop(req.req_id)
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
        self._apply_deltas(sched)
        scheduled = [(r.req_id, r.num_new_tokens) for r in sched.new_reqs] + \
                    [(r.req_id, r.num_new_tokens) for r in sched.cached_reqs]
        out = ModelRunnerOutput(step_id=sched.step_id)
        if not scheduled:
            return out
        inputs = self._prepare_inputs(scheduled)
        hidden = self.model(inputs["input_ids"], inputs["positions"], self.kv_caches, inputs["meta"], self.backend)
        sample_rows, sample_reqs = inputs["sample_rows"], inputs["sample_reqs"]
        if sample_reqs:
            logits = self.model.compute_logits(hidden[sample_rows]).float()
            batch = self._sampling_batch([self.requests[r] for r in sample_reqs], logits.shape[-1])
            ids, lps = sample(logits, batch)
            ids_list = ids.tolist()
            for k, req_id in enumerate(sample_reqs):
                st = self.requests[req_id]
                st.token_ids.append(ids_list[k])
                out.req_ids.append(req_id)
                out.sampled_token_ids.append([ids_list[k]])
                out.logprobs.append(self._trim(lps[k], st.params.logprobs) if lps and st.params.logprobs is not None
                                    else None)
        for req_id, (rows, next_ids) in inputs["prompt_lp"].items():
            k = self.requests[req_id].params.prompt_logprobs
            recs: list[Logprob | None] = prompt_logprobs(self.model.compute_logits(hidden[rows]).float(), next_ids, k)
            if inputs["first_chunk"].get(req_id):
                recs = [None] + recs
            out.prompt_logprobs[req_id] = recs
        return out

    @staticmethod
    def _trim(recs: list[Logprob], k: int) -> list[Logprob]:
        return [(c, r, ti[:k], tv[:k]) for c, r, ti, tv in recs]

    def _apply_deltas(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        if sched.blocks_to_swap_out:
            self._copy_blocks(self.kv_caches, self.host_caches, sched.blocks_to_swap_out)
        if sched.blocks_to_copy:
            self._copy_blocks(self.kv_caches, self.kv_caches, sched.blocks_to_copy)
        if sched.blocks_to_swap_in:
            self._copy_blocks(self.host_caches, self.kv_caches, sched.blocks_to_swap_in)
        for r in sched.new_reqs:
            self.requests[r.req_id] = self._new_state(r)
        for r in sched.cached_reqs:
            st = self.requests[r.req_id]
            del st.block_ids[r.blocks_from:]
            st.block_ids.extend(r.block_ids)
            st.num_computed_tokens = r.num_computed_tokens

    def _new_state(self, r: NewRequestData) -> RequestState:
        gen = None
        if r.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(r.seed & 0xFFFF_FFFF_FFFF_FFFF)
        return RequestState(r.req_id, list(r.token_ids), r.num_prompt_tokens, r.sampling_params, list(r.block_ids),
                            r.num_computed_tokens, gen)

    @staticmethod
    def _copy_blocks(src_caches, dst_caches, pairs) -> None:
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches):
            s_idx, d_idx = src.to(sk.device), dst.to(dk.device)
            dk.index_copy_(0, d_idx, sk.index_select(0, s_idx).to(dk.device, non_blocking=True))
            dv.index_copy_(0, d_idx, sv.index_select(0, s_idx).to(dv.device, non_blocking=True))

    def _prepare_inputs(self, scheduled: list[tuple[str, int]]) -> dict:
        dev = self.device
        tokens: list[int] = []
        ctx_lens, q_lens, tables = [], [], []
        sample_reqs, prompt_lp, first_chunk = [], {}, {}
        for req_id, n in scheduled:
            st = self.requests[req_id]
            start = st.num_computed_tokens
            tokens.extend(st.token_ids[start:start + n])
            ctx_lens.append(start)
            q_lens.append(n)
            tables.append(st.block_ids)
            if start + n >= len(st.token_ids):
                sample_reqs.append(req_id)
            if st.params.prompt_logprobs is not None and start < st.num_prompt_tokens - 1:
                prompt_lp[req_id] = (start, min(start + n, st.num_prompt_tokens - 1))
                first_chunk[req_id] = start == 0
            st.num_computed_tokens = start + n
        num_seqs = len(scheduled)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
        qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
        torch.cumsum(q_lens_t, 0, out=qsl[1:])
        ctx_t = torch.tensor(ctx_lens, dtype=torch.int32)
        seq_lens = ctx_t + q_lens_t
        max_blocks = max(len(t) for t in tables)
        bt = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs), q_lens_t.long())
        positions = torch.arange(len(tokens)) - qsl[:-1].long()[seq_idx] + ctx_t.long()[seq_idx]
        slots = bt[seq_idx, positions // self.block_size].long() * self.block_size + positions % self.block_size
        sample_rows = qsl[1:].long() - 1
        row_of = {req_id: i for i, (req_id, _) in enumerate(scheduled)}
        rows = sample_rows[[row_of[r] for r in sample_reqs]] if sample_reqs else sample_rows[:0]
        lp_inputs = {}
        for req_id, (lo, hi) in prompt_lp.items():
            st = self.requests[req_id]
            base = int(qsl[row_of[req_id]]) - ctx_lens[row_of[req_id]]
            lp_inputs[req_id] = (torch.arange(base + lo, base + hi, device=dev),
                                 torch.tensor(st.token_ids[lo + 1:hi + 1], device=dev))
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev), query_start_loc=qsl.to(dev), seq_lens=seq_lens.to(dev),
            context_lens=ctx_t.to(dev), block_tables=bt.to(dev), block_size=self.block_size,
            max_query_len=max(q_lens), max_seq_len=int(seq_lens.max()), query_lens_list=q_lens,
            seq_lens_list=seq_lens.tolist())
        self.backend.prepare(meta)
        return {"input_ids": torch.tensor(tokens, device=dev), "positions": positions.to(dev), "meta": meta,
                "sample_rows": rows.to(dev), "sample_reqs": sample_reqs, "prompt_lp": lp_inputs,
                "first_chunk": first_chunk}

    def _sampling_batch(self, states: list[RequestState], vocab: int) -> SamplingBatch:
        """Per-row parameter tensors; optional parts are built only when some row uses them."""
        dev = self.device
        ps = [s.params for s in states]
        temp = torch.tensor([0.0 if p.greedy else p.temperature for p in ps], device=dev)
        b = SamplingBatch(temperature=temp, all_greedy=all(p.greedy for p in ps))
        if not b.all_greedy:
            if any(p.top_k > 0 for p in ps):
                b.top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in ps], device=dev)
            if any(p.top_p < 1.0 for p in ps):
                b.top_p = torch.tensor([p.top_p for p in ps], device=dev)
            if any(p.min_p > 0 for p in ps):
                b.min_p = torch.tensor([p.min_p for p in ps], device=dev)
            b.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None and not ps[i].greedy}
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in ps):
            counts = torch.zeros(len(ps), vocab, device=dev)
            prompt = torch.zeros(len(ps), vocab, dtype=torch.bool, device=dev)
            for i, s in enumerate(states):
                out = s.token_ids[s.num_prompt_tokens:]
                if out:
                    counts[i].index_add_(0, torch.tensor(out, device=dev), torch.ones(len(out), device=dev))
                prompt[i, torch.tensor(s.token_ids[:s.num_prompt_tokens], device=dev)] = True
            b.output_counts, b.prompt_mask = counts, prompt
            b.presence = torch.tensor([p.presence_penalty for p in ps], device=dev)
            b.frequency = torch.tensor([p.frequency_penalty for p in ps], device=dev)
            b.repetition = torch.tensor([p.repetition_penalty for p in ps], device=dev)
        if any(p.logit_bias for p in ps):
            coords = [(i, t, v) for i, p in enumerate(ps) for t, v in (p.logit_bias or {}).items()]
            b.bias_rows = torch.tensor([c[0] for c in coords], device=dev)
            b.bias_cols = torch.tensor([c[1] for c in coords], device=dev)
            b.bias_vals = torch.tensor([c[2] for c in coords], device=dev)
        bans = [(i, t) for i, s in enumerate(states)
                if len(s.token_ids) - s.num_prompt_tokens < s.params.min_tokens
                for t in set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else self.eos_ids)]
        if bans:
            b.ban_rows = torch.tensor([x[0] for x in bans], device=dev)
            b.ban_cols = torch.tensor([x[1] for x in bans], device=dev)
        lp = [p.logprobs for p in ps if p.logprobs is not None]
        b.max_logprobs = max(lp) if lp else -1
        return b

