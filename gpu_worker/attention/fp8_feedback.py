"""Error-feedback rounding of keys into an fp8 cache: each key is rounded channel by channel, and each
channel's rounding error is carried into the channels not yet rounded, so that the score errors q.e
stay small for the queries that will read it, not each element's error on its own.

Nearest rounding minimises |e| per element. What attention feels is q.e, whose mean square over the
queries is e' Sigma_q e with Sigma_q = E q q' (the kv head's queries as the cache basis holds them: gains
and rotation applied, layers/kv_rotation.py). GPTQ rounds a weight row against its layer's Hessian the
same way: with U the upper Cholesky factor of Sigma_q^-1, rounding channel i adds its error e_i times
U[i, j] / U[i, i] to each later channel j. Sigma_q comes from the same start-up calibration pass that
sets the centres (KVCentres.measure), so the rounding is fixed per layer and head, and a key is written
the same bytes whichever step, batch or backend writes it.

Measured over the shared workload's 10,178 prompt positions (e4m3 against an fp32 cache): top-1 96.7%
-> 97.3%, mean KL 0.0014 -> 0.0011 (loadtest/results/fp8_kv_feedback_2026-12-05.txt). Values gain
nothing from the same treatment against o_proj's Gram (measured there too), so they round to nearest.

Three implementations, the same bytes: the loop below (the reference, and the fallback), the native CPU
kernel (kernels/fp8_round.cpp) and a Triton kernel for CUDA (kernels/triton_fp8_round.py).
"""
from __future__ import annotations

import torch

from gpu_worker.attention import cpu_attention
from gpu_worker.kernels import native

DAMP = 0.01     # added to Sigma_q's diagonal, times its mean: GPTQ's damping (0.01 and 0.1 measured alike)


def feedback_matrix(sigma: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """[H, D, D] fp32 from Sigma_q [H, D, D]: entry [h, i, j] (j > i, zero elsewhere) is what channel j
    takes of channel i's rounding error, U[i, j] / U[i, i] with U'U = (Sigma_q + damp)^-1."""
    h = sigma.double()
    h = h + damp * h.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * torch.eye(h.shape[-1], dtype=h.dtype,
                                                                                       device=h.device)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    return (u / u.diagonal(dim1=-2, dim2=-1)[..., None]).triu(1).float().contiguous()


def round_with_feedback_reference(x: torch.Tensor, a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, H, D] fp32, already divided by the layer's scale, rounded to the fp8 `dtype` against
    a [H, D, D] (feedback_matrix): channel i is saturated at the format's largest value and rounded to
    nearest-even, and its error (wi - qi) times a[h, i, j] is subtracted from every later channel j. The
    kernels do exactly these float32 operations in this order, so all give the same bytes."""
    top = torch.finfo(dtype).max
    w = x.float().clone()
    out = torch.empty_like(w)
    for i in range(w.shape[-1]):
        wi = w[:, :, i].clamp(-top, top)
        qi = wi.to(dtype).float()
        out[:, :, i] = qi
        if i + 1 < w.shape[-1]:
            w[:, :, i + 1:] -= (wi - qi)[:, :, None] * a[None, :, i, i + 1:]
    return out.to(dtype)


def round_with_feedback(x: torch.Tensor, a: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x [T, H, D] as an fp8 cache of `dtype` stores it (divided by the layer's `scale`), rounded with
    error feedback against a [H, D, D]: the native kernel on a CPU, Triton on CUDA, else the reference."""
    x = x.float().contiguous()
    d = x.shape[-1]
    if x.device.type == "cuda" and d & (d - 1) == 0:       # the kernel takes power-of-two heads
        from gpu_worker.kernels.triton_fp8_round import round_with_feedback_triton
        return round_with_feedback_triton(x if scale == 1.0 else x / scale, a, dtype)
    lib = native.library_for(x)
    if lib is None:
        return round_with_feedback_reference(x if scale == 1.0 else x / scale, a, dtype)
    t, h = x.shape[:2]
    out = torch.empty((t, h, d), dtype=torch.uint8)
    if lib.psq_fp8_round_feedback(x.data_ptr(), a.contiguous().data_ptr(), out.data_ptr(), t, h, d, scale,
                                  cpu_attention.KV_DTYPE_CODES[dtype], native.cpu_isa()) != 0:
        raise ValueError(f"the native fp8 rounding cannot take head size {d} into {dtype}")
    return out.view(dtype)
