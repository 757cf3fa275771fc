"""Triton GEMM on a weight kept group-quantized (PackedWeight's layout): y = x @ W^T (+ bias).

Why: on CUDA, PackedWeight.matmul otherwise expands the whole weight to fp32 in torch on every call, which
reads and writes 4-8x the packed bytes and allocates a full fp32 matrix per layer per step. Here each
program expands only the [BLOCK_K, BLOCK_N] tile it is about to multiply, in registers, straight from the
packed bytes and per-group scale/offset: the dequantized weight never exists in memory.

Layout (see PackedWeight.from_groups / values): 4-bit values come in runs of 32 along K, byte j of a run
holding value j (low nibble) and value j + 16 (high nibble); 8-bit values are int8. The element at input
index k is read from byte (k // 32) * 16 + k % 16 with shift (k & 16) >> 2, so any BLOCK_K that is a
multiple of 32 unpacks with one gather; w = scale[k // group] * q + offset[k // group]. `perm` is the
caller's (it permutes x's columns first). The kernel is jitted on first use for the current
TRITON_INTERPRET mode, as in gpu_worker/attention/triton_backend.py, so CPU tests can use the interpreter.
"""
from __future__ import annotations

from typing import Any

import torch

from gpu_worker.kernels.triton_jit import jitted, tl, triton

BLOCK_N = 64


def _qgemm_kernel(
    x_ptr, q_ptr, scale_ptr, offset_ptr, bias_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_on, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (m tile, n tile): accumulate x[rm, :] @ W[rn, :]^T over K in fp32, one BLOCK_K chunk a step."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + rn.to(tl.int64)[None, :] * stride_qn
    s_rows = scale_ptr + rn.to(tl.int64)[None, :] * stride_sn
    o_rows = offset_ptr + rn.to(tl.int64)[None, :] * stride_on
    w_mask = n_ok[None, :]
    x_mask = m_ok[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):     # K is a multiple of BLOCK_K (host-checked): no K mask
        k = k0 + rk
        x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
        if BITS == 4:
            byte = tl.load(q_rows + ((k // 32) * 16 + k % 16)[:, None], mask=w_mask, other=0).to(tl.int32)
            v = ((byte >> ((k & 16) >> 2)[:, None]) & 15).to(tl.float32)
        else:
            v = tl.load(q_rows + k[:, None], mask=w_mask, other=0).to(tl.float32)
        if GROUP >= BLOCK_K:            # the whole chunk lies in one group: one scale per column
            g = k0 // GROUP
            s = tl.load(s_rows + g, mask=n_ok[None, :], other=0.0)
            o = tl.load(o_rows + g, mask=n_ok[None, :], other=0.0)
        else:
            g = (k // GROUP)[:, None]
            s = tl.load(s_rows + g, mask=w_mask, other=0.0)
            o = tl.load(o_rows + g, mask=w_mask, other=0.0)
        w = (v * s + o).to(x.dtype)     # [BLOCK_K, BLOCK_N]
        if IEEE_FP32:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn[None, :], mask=n_ok[None, :], other=0.0).to(tl.float32)
    y_mask = m_ok[:, None] & n_ok[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def _kernel() -> Any:
    return jitted(_qgemm_kernel, "the triton quantized matmul")


def _check(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
           group: int) -> tuple[int, int, int]:
    """(M, N, K), or ValueError: a wrong layout would otherwise read out of bounds or give garbage."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be 2-D float32/float16/bfloat16, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    n = q.shape[0]
    want = {4: (torch.uint8, k // 2), 8: (torch.int8, k)}.get(bits)
    if want is None or q.dtype != want[0] or tuple(q.shape) != (n, want[1]):
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} is not a {bits}-bit packing of K={k}")
    if k % 32 or group < 16 or group & (group - 1) or k % group:
        raise ValueError(f"need K a multiple of 32 and of a power-of-two group >= 16, got K={k}, group {group}")
    for name, t in (("scale", scale), ("offset", offset)):
        if tuple(t.shape) != (n, k // group) or t.dtype != torch.float32 or t.stride(1) != 1:
            raise ValueError(f"{name} must be float32 [{n}, {k // group}] with unit column stride")
    if q.stride(1) != 1:
        raise ValueError("q must have unit column stride")
    return m, n, k


def packed_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                  group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype, accumulated in fp32, W given as PackedWeight's
    q / scale / offset (x's columns already in the stored order: the caller applies `perm`)."""
    m, n, k = _check(x, q, scale, offset, bits, group)
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    kernel = _kernel()
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m = 16 if m <= 16 else 64       # decode steps are a handful of rows; tl.dot needs >= 16
    block_k = 64 if k % 64 == 0 else 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    kernel[grid](
        x, q, scale, offset, scale if bias is None else bias.contiguous(), y,
        m, n, k,
        x.stride(0), q.stride(0), scale.stride(0), offset.stride(0), y.stride(0),
        BITS=bits, GROUP=group, HAS_BIAS=bias is not None, IEEE_FP32=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
    )
    return y
