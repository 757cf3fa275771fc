"""Roofline: how close pagedserve's batched decode comes to what this machine's GEMMs can do.

Decode at batch B is, to first order, one pass of B token rows through every weight matrix of the model.
So the ceiling is measured the same way, in the same run and on the same threads: x[B, in] @ W^T for each
of the model's weight shapes (q, k, v, o, gate, up, down per layer, and lm_head), with a distinct W per
layer so that weights stream from memory as they do in the model, timed over whole passes. Dividing the
engine's measured decode FLOP/s by that gives the fraction of the ceiling it reaches; what is missing is
attention, norms, sampling, scheduling and Python.
"""
from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from common.model_config import ModelConfig
from common.model_source import ModelSource
from loadtest.pagedserve_runs import greedy, make_llm

# SmolLM2-135M's shapes, used only if the model's config cannot be read.
FALLBACK = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, intermediate_size=1536)


def model_config(model: str | None = None) -> ModelConfig:
    try:
        return ModelSource.resolve(model).model_config()
    except Exception:   # noqa: BLE001 - the roofline still means something with the documented shapes
        return FALLBACK


def weight_shapes(mc: ModelConfig) -> list[tuple[str, int, int, int]]:
    """(name, out_features, in_features, how many) of every matrix a decode token is multiplied by."""
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    h, i, n = mc.hidden_size, mc.intermediate_size, mc.num_layers
    return [("q", q, h, n), ("k", kv, h, n), ("v", kv, h, n), ("o", h, q, n),
            ("gate", i, h, n), ("up", i, h, n), ("down", h, i, n), ("lm_head", mc.vocab_size, h, 1)]


def params_per_token(mc: ModelConfig) -> int:
    """Parameters a token touches: every linear layer incl. lm_head (the embedding is a lookup, not a GEMM)."""
    return sum(o * i * c for _, o, i, c in weight_shapes(mc))


def flops_per_token(mc: ModelConfig, context: float = 0.0) -> float:
    """2 x parameters touched, plus attention's QK^T and PV over `context` cached tokens (2 x 2 x heads x
    head_dim x context per layer)."""
    attn = 4.0 * mc.num_layers * mc.num_heads * mc.head_dim * context
    return 2.0 * params_per_token(mc) + attn


def gemm_ceiling_gflops(mc: ModelConfig, batch: int = 64, passes: int = 5, device: str = "cpu",
                        dtype: torch.dtype = torch.float32) -> float:
    """Sustained GFLOP/s of x[batch, in] @ W^T in `dtype` over the model's whole per-token weight set."""
    dev = torch.device(device)
    torch.manual_seed(0)
    mats = [(torch.randn(o, i, device=dev) * 0.02).to(dtype) for _, o, i, c in weight_shapes(mc) for _ in range(c)]
    xs = {i: torch.randn(batch, i, device=dev).to(dtype) for i in {m.shape[1] for m in mats}}
    flops = 2.0 * batch * sum(m.numel() for m in mats)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    with torch.inference_mode():
        _gemm_pass(mats, xs)   # warm-up: allocator, kernels, page faults on the weights
        sync()
        t0 = time.perf_counter()
        for _ in range(passes):
            _gemm_pass(mats, xs)
        sync()
        elapsed = time.perf_counter() - t0
    del mats, xs
    gc.collect()
    return flops * passes / elapsed / 1e9


def _gemm_pass(mats: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> None:
    for w in mats:
        torch.matmul(xs[w.shape[1]], w.t())


def decode_tokens_per_s(batch: int = 64, steps: int = 20, prompt_len: int = 16, threads: int | None = None,
                        model: str | None = None) -> tuple[float, float]:
    """pagedserve's pure-decode throughput at `batch` running sequences: (tokens/s, mean context length).

    Distinct short prompts (no prefix sharing) are added and stepped until every sequence has its first
    token; then `steps` steps are timed, each of which must decode exactly one token for all `batch`."""
    from common.protocol import EngineRequest
    llm = make_llm(threads, model)
    try:
        engine = llm.engine
        # The first sequence decodes while the others' prompts are still being prefilled (one budget of
        # tokens a step); it must not finish before the timed steps are over.
        max_tokens = steps + 2 * batch + batch * prompt_len // 128
        for b in range(batch):
            ids = [100 + (b * prompt_len + k) % 40000 for k in range(prompt_len)]
            engine.add_request(EngineRequest(f"roof-{b}", ids, greedy(max_tokens)))
        started: set[str] = set()
        while len(started) < batch:
            for eo in engine.step():
                if eo.new_token_ids:
                    started.add(eo.request_id)
            if not engine.has_unfinished():
                raise RuntimeError("decode measurement requests finished early")
        running = engine.scheduler.running
        generated = sum(len(r.output_token_ids) for r in running) / max(len(running), 1)
        t0 = time.perf_counter()
        for _ in range(steps):
            outs = engine.step()
            if len(outs) != batch or any(len(o.new_token_ids) != 1 for o in outs):
                raise RuntimeError(f"a timed step decoded {sum(len(o.new_token_ids) for o in outs)} tokens, "
                                   f"expected {batch}")
        elapsed = time.perf_counter() - t0
        context = prompt_len + generated + steps / 2
        return batch * steps / elapsed, context
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()


@dataclass
class Roofline:
    gemm_gflops: float
    params_per_token: int
    flops_per_token: float
    decode_tok_s: float
    decode_context: float
    fraction_of_gemm: float
    batch: int
    gemm_dtype: str = "float32"

    def line(self) -> str:
        return (f"roofline: {self.gemm_dtype} GEMM ceiling {self.gemm_gflops:.1f} GFLOP/s at M={self.batch} over the model's "
                f"weights; {self.flops_per_token / 1e6:.0f} MFLOP/token ({self.params_per_token / 1e6:.1f}M "
                f"params touched + attention at context {self.decode_context:.0f}); pagedserve decode at batch "
                f"{self.batch}: {self.decode_tok_s:.1f} tok/s = {self.decode_tok_s * self.flops_per_token / 1e9:.1f} "
                f"GFLOP/s = {self.fraction_of_gemm:.0%} of the GEMM ceiling "
                f"(ceiling {self.gemm_gflops * 1e9 / self.flops_per_token:.0f} tok/s)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(batch: int = 64, decode_steps: int = 20, gemm_passes: int = 5, threads: int | None = None,
            model: str | None = None, device: str = "cpu") -> Roofline:
    """The ceiling is taken in the dtype the engine's matmuls run in by default (bf16 on CUDA, and on a
    CPU where gpu_worker/cpu_precision.py finds bf16 hardware)."""
    from gpu_worker.cpu_precision import matmul_dtype
    mc = model_config(model)
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else matmul_dtype("auto", dev) or torch.float32
    gflops = gemm_ceiling_gflops(mc, batch, gemm_passes, device, dtype)
    tok_s, ctx = decode_tokens_per_s(batch, decode_steps, threads=threads, model=model)
    fpt = flops_per_token(mc, ctx)
    return Roofline(gflops, params_per_token(mc), fpt, tok_s, ctx, tok_s * fpt / (gflops * 1e9), batch,
                    str(dtype).replace("torch.", ""))
