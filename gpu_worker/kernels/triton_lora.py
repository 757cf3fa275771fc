"""Triton kernels for the mixed-adapter LoRA delta (BGMV, as punica names it): every token t of the flat
batch adds B[slot_t] @ (A[slot_t] @ x_t) to its output, gathering its own adapter's matrices, so one
launch serves a batch that mixes adapters and the base model (slot -1: nothing added).

    shrink:  h[t, j, :] = A[slot_t, j] @ x[t]                   A: [S, J, R, K]  (J shards of a fused layer)
    expand:  y[t, lo_j:hi_j] += h[t, j, :] @ B_j[slot_t]        B_j: [S, R, N_j]

The torch path (gpu_worker/lora/delta.py) computes the same over runs of rows; the tests run these
kernels under TRITON_INTERPRET=1 against it. Imported only on CUDA (see kernels/triton_jit.py).
"""
from __future__ import annotations

import torch

from gpu_worker.kernels.triton_jit import jitted, tl, triton

BLOCK_K = 64
BLOCK_N = 64


def _shrink_kernel(x_ptr, a_ptr, slot_ptr, h_ptr, K, R, stride_xt, stride_as, stride_aj, stride_ar,
                   stride_ht, stride_hj, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (token t, shard j): h[t, j] = A[slot_t, j] @ x[t] in fp32 (zeros for slot -1)."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.load(slot_ptr + t)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if s >= 0:
        a_rows = a_ptr + s.to(tl.int64) * stride_as + j * stride_aj + rr[:, None] * stride_ar
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + t.to(tl.int64) * stride_xt + rk, mask=rk < K, other=0.0).to(tl.float32)
            a = tl.load(a_rows + rk[None, :], mask=(rr[:, None] < R) & (rk[None, :] < K), other=0.0)
            acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
    tl.store(h_ptr + t.to(tl.int64) * stride_ht + j * stride_hj + rr, acc, mask=rr < R)


def _expand_kernel(h_ptr, b_ptr, slot_ptr, y_ptr, N, R, col0, stride_ht, stride_bs, stride_br, stride_yt,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (token t, n tile): y[t, col0 + n] += h[t] @ B[slot_t][:, n] (nothing for slot -1)."""
    t = tl.program_id(0)
    s = tl.load(slot_ptr + t)
    if s >= 0:
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + t.to(tl.int64) * stride_ht + rr, mask=rr < R, other=0.0)
        b = tl.load(b_ptr + s.to(tl.int64) * stride_bs + rr[:, None] * stride_br + rn[None, :],
                    mask=(rr[:, None] < R) & (rn[None, :] < N), other=0.0)
        delta = tl.sum(h[:, None] * b.to(tl.float32), axis=0)
        y_at = y_ptr + t.to(tl.int64) * stride_yt + col0 + rn
        y = tl.load(y_at, mask=rn < N, other=0.0)
        tl.store(y_at, (y.to(tl.float32) + delta).to(y.dtype), mask=rn < N)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
             ranges: list[tuple[int, int]], slots: torch.Tensor) -> torch.Tensor:
    """y[:, lo_j:hi_j] += per-token LoRA delta of shard j, in place; `slots` [T] int32 (-1: none)."""
    _, num_shards, rank, k = a.shape
    t = x.shape[0]
    x, slots = x.contiguous(), slots.to(torch.int32)
    assert y.stride(1) == 1 and a.stride(3) == 1 and all(b.stride(2) == 1 for b in bs), "rows must be contiguous"
    h = torch.empty(t, num_shards, rank, device=x.device, dtype=torch.float32)
    block_r = max(16, triton.next_power_of_2(rank))
    jitted(_shrink_kernel, "the LoRA kernels")[(t, num_shards)](
        x, a, slots, h, k, rank, x.stride(0), a.stride(0), a.stride(1), a.stride(2),
        h.stride(0), h.stride(1), BLOCK_R=block_r, BLOCK_K=BLOCK_K)
    expand = jitted(_expand_kernel, "the LoRA kernels")
    for j, ((lo, hi), b) in enumerate(zip(ranges, bs)):
        hj = h[:, j]
        expand[(t, triton.cdiv(hi - lo, BLOCK_N))](
            hj, b, slots, y, hi - lo, rank, lo, hj.stride(0), b.stride(0), b.stride(1), y.stride(0),
            BLOCK_R=block_r, BLOCK_N=BLOCK_N)
    return y
