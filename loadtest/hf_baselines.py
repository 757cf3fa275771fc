"""Hugging Face transformers baselines: the reference the pagedserve rows are compared against.

Three ways of serving the same requests with plain transformers, all greedy and EOS-free so every request
produces exactly its max_tokens:
  * hf-1      — `generate` one request at a time: what "no serving engine" costs (ratio 1.0).
  * hf-static — `generate` on static, left-padded batches of 16 in workload order: the batch runs until its
                longest request is done, which is the real price of static batching; only each request's
                own max_tokens count as output.
  * hf-cb     — transformers' own continuous batching manager (`generate_batch`'s machinery), with each
                request's own max_new_tokens.

EOS is removed by clearing `generation_config.eos_token_id` (not with min_new_tokens, which would only mask
EOS logits and change the greedy tokens). Per-token times come from a StoppingCriteria that never stops but
stamps the clock each time generate appends a token.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from loadtest.report import RequestTiming, SystemResult
from loadtest.workload import BenchRequest

PAD_ID = 0
STATIC_BATCH = 16


def load_hf_model(device: str = "cpu"):
    """The default model (SmolLM2-135M-Instruct GGUF, dequantized) in fp32, as pagedserve runs it."""
    from transformers import AutoModelForCausalLM

    from common.model_source import ModelSource
    src = ModelSource.resolve(None)
    model = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32)
    model.to(device).eval()
    model.generation_config.eos_token_id = None   # run exactly max_new_tokens, never stop early
    model.generation_config.pad_token_id = PAD_ID
    return model


def release_memory() -> None:
    """After the caller dropped its model reference: collect it now, before the next system loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class TokenClock:
    """A StoppingCriteria that never stops: it records when each generated token (step) appeared.

    generate calls stopping criteria once per step, right after the step's tokens are appended, so the
    k-th stamp is the time token k of every sequence in the batch became available."""

    def __init__(self, device: torch.device):
        self.times: list[float] = []
        self.sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.sync()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _generate(model, batch: list[BenchRequest], max_new: int) -> tuple[float, list[float], torch.Tensor]:
    """Left-pad `batch`, run greedy generate for max_new tokens; return (submit time, step times, output)."""
    from transformers import StoppingCriteriaList
    dev = model.device
    width = max(r.prompt_tokens for r in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - r.prompt_tokens:] = torch.tensor(r.prompt_token_ids)
        mask[i, width - r.prompt_tokens:] = 1
    clock = TokenClock(dev)
    submitted = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=PAD_ID, stopping_criteria=StoppingCriteriaList([clock]))
    if out.shape[1] != width + max_new or len(clock.times) != max_new:
        raise RuntimeError(f"generate produced {out.shape[1] - width} tokens ({len(clock.times)} steps), "
                           f"expected {max_new}")
    return submitted, clock.times, out


def warmup(model) -> None:
    """One short generate, so lazy initialisation is not billed to the first measured request."""
    _generate(model, [BenchRequest("warmup", list(range(100, 116)), 4)], 4)


def run_hf_sequential(model, reqs: list[BenchRequest]) -> SystemResult:
    res = SystemResult("hf-1", notes=["transformers generate, one request at a time"])
    warmup(model)
    t0 = time.perf_counter()
    for r in reqs:
        submitted, times, _ = _generate(model, [r], r.max_tokens)
        res.timings.append(RequestTiming(r.id, submitted, times, r.max_tokens))
    res.wall_s = time.perf_counter() - t0
    return res


def run_hf_static(model, reqs: list[BenchRequest], batch_size: int = STATIC_BATCH) -> SystemResult:
    res = SystemResult(f"hf-static{batch_size}")
    warmup(model)
    wasted = 0
    t0 = time.perf_counter()
    for start in range(0, len(reqs), batch_size):
        batch = reqs[start:start + batch_size]
        longest = max(r.max_tokens for r in batch)
        submitted, times, _ = _generate(model, batch, longest)
        for r in batch:
            res.timings.append(RequestTiming(r.id, submitted, times[:r.max_tokens], r.max_tokens))
            wasted += longest - r.max_tokens
    res.wall_s = time.perf_counter() - t0
    res.notes.append(f"left-padded batches of {batch_size} in workload order; each batch runs to its longest "
                     f"request: {wasted} generated tokens past their request's max_tokens are not counted")
    return res


def run_hf_continuous(model, reqs: list[BenchRequest], timeout_s: float = 3600.0) -> SystemResult:
    """transformers' continuous batching. `generate_batch` takes one max_new_tokens for all inputs, so this
    drives the same manager it uses and adds each request with its own max_new_tokens."""
    if not hasattr(model, "continuous_batching_context_manager"):
        return SystemResult.failed("hf-cb", "this transformers has no continuous batching (generate_batch)")
    from transformers import GenerationConfig
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs), eos_token_id=None,
                           pad_token_id=PAD_ID)
    res = SystemResult("hf-cb", notes=["transformers continuous batching manager (generate_batch's), per-request "
                                       "max_new_tokens, token times from record_timestamps"])
    # The manager is sized for the workload at hand, so warm it up inside the same context.
    hints = None
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        hints = WorkloadHints(max_prompt_length=max(r.prompt_tokens for r in reqs),
                              max_generated_length=max(r.max_tokens for r in reqs), num_requests=len(reqs))
    except Exception:   # older/newer layouts: run without hints
        pass
    kwargs = {"workload_hints": hints} if hints is not None else {}
    with model.continuous_batching_context_manager(generation_config=gen, block=True, timeout=30, **kwargs) as mgr:
        _cb_drain(mgr, [("warmup", list(range(100, 116)), 4)], 120.0)
        submitted: dict[str, float] = {}
        t0 = time.perf_counter()
        for r in reqs:
            submitted[r.id] = time.perf_counter()
            mgr.add_request(list(r.prompt_token_ids), request_id=r.id, max_new_tokens=r.max_tokens,
                            record_timestamps=True)
        outs = _cb_collect(mgr, set(submitted), timeout_s)
        res.wall_s = time.perf_counter() - t0
    for r in reqs:
        o = outs[r.id]
        if o.error is not None:
            raise RuntimeError(f"request {r.id} failed: {o.error}")
        if len(o.generated_tokens) != r.max_tokens:
            raise RuntimeError(f"request {r.id} produced {len(o.generated_tokens)} tokens, expected {r.max_tokens}")
        res.timings.append(RequestTiming(r.id, submitted[r.id], list(o.timestamps or []), r.max_tokens))
    return res


def _cb_drain(mgr, items: list[tuple[str, list[int], int]], timeout_s: float) -> None:
    for rid, ids, n in items:
        mgr.add_request(ids, request_id=rid, max_new_tokens=n)
    _cb_collect(mgr, {i[0] for i in items}, timeout_s)


def _cb_collect(mgr, ids: set[str], timeout_s: float) -> dict:
    outs = {}
    deadline = time.monotonic() + timeout_s
    while len(outs) < len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"continuous batching finished {len(outs)}/{len(ids)} requests in {timeout_s:.0f}s")
        o = mgr.get_result(timeout=1)
        if o is None:
            if not mgr.is_running():
                raise RuntimeError("the continuous batching thread stopped")
            continue
        if o.request_id in ids and o.is_finished():
            outs[o.request_id] = o
    return outs
