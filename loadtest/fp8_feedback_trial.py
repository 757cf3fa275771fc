"""A trial, not a feature: error-feedback rounding of an fp8 KV cache, measured on quant_report's metric.

    python -m loadtest.fp8_feedback_trial [--round k|v|kv|none] [--damp 0.01] [--only TEXT] [--requests 96]

Plain fp8 rounding takes each element to its nearest e4m3 value on its own. A key's score error is q.e (e:
its rounding error), so what matters is e' Sigma_q e with Sigma_q = E q q' (the queries of its kv head in
the cache basis, gains and rotation applied, measured on the start-up calibration text). Rounding the
channels of each key in turn and spreading each channel's error over the channels not yet rounded, the
way GPTQ rounds a weight row against its Hessian (U = the upper Cholesky factor of Sigma_q^-1), lowers
that weighted error. For values the trial uses o_proj's Gram (W_h' W_h, summed over the kv head's query
heads, in the cache basis): the output error of the attention layer.

This patches the running engine in-process (the torch backend's to_cache, KVCentres) and rounds with a
Python loop over the head's channels, so it is far too slow for serving: it only measures what the
rounding would buy. A serving version needs the same recurrence in the native kernel's write path and a
Triton kernel for CUDA. Results: loadtest/results/fp8_kv_feedback_2026-12-05.txt.
"""
from __future__ import annotations

import argparse
import sys

import torch

import gpu_worker.attention as attention
import gpu_worker.attention.torch_backend as torch_backend
import gpu_worker.models.llama as llama
from gpu_worker.layers.kv_rotation import KVCentres

STATE: dict = {}


def upper_inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """U with U'U = (H + damp * mean diag * I)^-1, per leading index: GPTQ's form of the inverse Hessian."""
    h = h.double()
    h = h + damp * h.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * torch.eye(h.shape[-1], dtype=h.dtype)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()


def feedback_round(x: torch.Tensor, u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, H, D] (already divided by the layer's scale) rounded to `dtype` channel by channel, each
    channel's error carried into the later ones through u [H, D, D]."""
    top = torch.finfo(dtype).max
    w = x.float().transpose(0, 1).contiguous()
    out = torch.empty_like(w)
    for i in range(w.shape[-1]):
        wi = w[:, :, i].clamp(-top, top)
        qi = wi.to(dtype).float()
        out[:, :, i] = qi
        w[:, :, i + 1:] -= ((wi - qi) / u[:, i, i][:, None])[:, :, None] * u[:, None, i, i + 1:]
    return out.transpose(0, 1).clamp(-top, top).to(dtype)


def patch(mode: str, damp: float) -> None:
    measure, apply, forward, to_cache = KVCentres.measure, KVCentres.apply, llama.Attention.forward, attention.to_cache

    def measure_keeping_queries(q, k, v, shift_keys=True):
        c = measure(q, k, v, shift_keys)
        c.trial_queries = q.float().clone()
        return c

    def apply_noting_tensors(self, q, k, v, first, r):
        qo, ko, vo = apply(self, q, k, v, first, r)
        if not hasattr(self, "trial_u"):
            self.trial_u = hessians(self, STATE["layer"], q.shape[1], k.shape[1], r.float(), damp)
        STATE.update(k=ko.data_ptr(), v=vo.data_ptr(), centres=self)
        return qo, ko, vo

    def forward_noting_layer(self, *args, **kwargs):
        STATE["layer"] = self
        return forward(self, *args, **kwargs)

    def to_cache_with_feedback(x, dtype, scale):
        c = STATE.get("centres")
        which = {STATE.get("k"): "k", STATE.get("v"): "v"}.get(x.data_ptr())
        if dtype not in attention.FP8_DTYPES or c is None or which is None or which not in mode:
            return to_cache(x, dtype, scale)
        return feedback_round(x if scale == 1.0 else x / scale, c.trial_u[which], dtype)

    KVCentres.measure = staticmethod(measure_keeping_queries)
    KVCentres.apply = apply_noting_tensors
    llama.Attention.forward = forward_noting_layer
    torch_backend.to_cache = to_cache_with_feedback


def hessians(c: KVCentres, layer, num_heads: int, num_kv: int, r: torch.Tensor, damp: float) -> dict:
    """Per kv head, in the cache basis: keys against the calibration queries' second moment, values
    against o_proj's Gram."""
    q_gain = c._for(num_heads, torch.float32)[0]
    q = ((c.trial_queries * q_gain) @ r).reshape(c.trial_queries.shape[0], num_kv, -1, r.shape[0])
    w = layer.o_proj.weight.float().reshape(-1, num_heads, r.shape[0]).permute(1, 2, 0)   # [Hq, D, hidden]
    gram = (w @ w.transpose(1, 2)).reshape(num_kv, -1, r.shape[0], r.shape[0]).sum(1)
    return {"k": upper_inverse_cholesky(torch.einsum("tgad,tgae->gde", q, q), damp),
            "v": upper_inverse_cholesky(r.T @ gram @ r, damp)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--round", choices=["k", "v", "kv", "none"], default="k", help="which cache gets feedback")
    p.add_argument("--damp", type=float, default=0.01, help="added to the Hessian's diagonal, times its mean")
    p.add_argument("--only", default="fp8 KV cache (e4m3)", help="quant_report's method filter")
    p.add_argument("--requests", type=int, default=96)
    args = p.parse_args()
    patch(args.round, args.damp)
    import loadtest.quant_report as quant_report
    sys.argv = ["quant_report", "--only", args.only, "--requests", str(args.requests)]
    quant_report.main()


if __name__ == "__main__":
    main()
