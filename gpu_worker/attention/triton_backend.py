"""Triton paged attention: one kernel launch per layer for a mixed batch of decodes, chunks and prefills.

Why one kernel: a step mixes decodes (1 query token), prefill chunks (many query tokens behind cached
context) and fresh prefills (no context). Dispatching each kind separately costs several launches per
layer and Python work proportional to the number of sequences. Instead the batch is cut into *tiles*
of at most BLOCK_Q query tokens of a single sequence; every tile runs the same code path: walk the
sequence's block table, compute scores against the cached keys, mask causally by absolute position,
online softmax in fp32, accumulate P @ V. A decode is simply a tile with one valid token.

GQA: a program handles one KV head and all the `G = Hq // Hkv` query heads that share it, so the key/value
tiles are loaded once per group. The G heads of the BLOCK_Q tokens are packed into the M dimension of
the score matrix (row m = token m // G, head m % G), which also fills tl.dot's minimum of 16 rows for
decodes when G > 1.

The key loop runs over TILE_N key positions at a time, independent of the cache block size: the block id
of every key is gathered from the block table, so block sizes below tl.dot's 16-column minimum (e.g. 8)
and non-power-of-two block sizes work.

Tile bookkeeping (which sequence and which query offset each tile handles) depends only on the step,
so it is computed once, on the host from the metadata's Python lists, and cached in the step's
TritonAttentionMetadata;
every layer's forward then only launches the kernel.

Triton is imported lazily-safe (the module imports on machines without Triton or a GPU), and the
kernels are jitted on first use: `triton.jit` picks the interpreter or the compiler from
TRITON_INTERPRET at decoration time, so deferring it lets CPU tests enable the interpreter even if this
module was imported earlier.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_worker.attention import AttentionMetadata, cache_scale, to_cache

from gpu_worker.kernels.triton_jit import jitted, tl

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------------
# Kernel bodies. They are plain functions here and wrapped with triton.jit in _kernels(); see the
# module docstring for why the wrapping is deferred.
# --------------------------------------------------------------------------------------------------

def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    num_kv_heads, head_dim, block_size,
    HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    """One program per new token: scatter its [Hkv, D] key and value rows into the cache slot."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    # The slot is broadcast to the tile so the validity test is a block mask (a scalar & block mask is
    # rejected by the interpreter). Negative slots mark padding tokens, which own no cache slot.
    slot = tl.load(slot_ptr + t).to(tl.int64) + tl.zeros([HEADS_PAD, HEAD_PAD], dtype=tl.int64)
    valid = slot >= 0
    safe = tl.where(valid, slot, 0)
    blk = safe // block_size
    off = safe % block_size
    mask = (h < num_kv_heads) & (d < head_dim) & valid
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kco + h * stride_kch + d * stride_kcd,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vco + h * stride_vch + d * stride_vcd,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, context_lens_ptr,
    tile_seq_ptr, tile_qoff_ptr,
    sink_ptr,                       # with SINK: [2, Hkv, head_dim] fp32 added to position 0's key and value
    qk_scale,                       # softmax scale * k scale * log2(e): the softmax runs in base 2 (exp2)
    v_scale,                        # the layer's v scale (1.0 unless the cache is fp8)
    window,                         # > 0: each query sees its last `window` keys only (sliding window)
    softcap,                        # with SOFTCAP: scores become softcap * tanh(score / softcap)
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    stride_bt,
    head_dim, block_size,
    G: tl.constexpr,                # query heads per KV head
    BLOCK_Q: tl.constexpr,          # query tokens per tile
    BLOCK_M: tl.constexpr,          # power of two >= BLOCK_Q * G (rows of the score tile)
    TILE_N: tl.constexpr,           # key positions per inner iteration
    HEAD_PAD: tl.constexpr,         # head_dim padded to a power of two (>= 16)
    IEEE_FP32: tl.constexpr,        # fp32 inputs: force "ieee" dots so fp32 stays fp32 (no tf32 rounding)
    SOFTCAP: tl.constexpr,          # soft-capped scores (Gemma 2)
    SINK: tl.constexpr,             # an fp8 cache's position 0 is centred apart (layers/kv_rotation.py)
):
    """Program (tile, kv_head): attention of BLOCK_Q query tokens x G heads of one sequence."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q_off = tl.load(tile_qoff_ptr + tile)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = tl.load(context_lens_ptr + seq)

    m = tl.arange(0, BLOCK_M)
    tok = q_off + m // G                       # query index within this sequence's rows
    head = kvh * G + m % G                     # query head of row m
    row_ok = (m < BLOCK_Q * G) & (tok < q_len)
    q_pos = ctx_len + tok                      # absolute position: the causal limit of row m
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < head_dim

    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Finite initial max: fully masked rows (padding rows) then give exp2(-inf - finite) = 0, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    # Keys beyond the last valid query of this tile are never visible: stop there.
    kv_end = tl.minimum(seq_len, ctx_len + tl.minimum(q_off + BLOCK_Q, q_len))
    # With a window, keys before the first query's window are never visible either: start there.
    kv_start = 0
    if window > 0:
        kv_start = tl.maximum(ctx_len + q_off - window + 1, 0)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    n = tl.arange(0, TILE_N)
    if SINK:
        sink_k = tl.load(sink_ptr + kvh * head_dim + d, mask=d_ok, other=0.0)
        sink_v = tl.load(sink_ptr + (tl.num_programs(1) + kvh) * head_dim + d, mask=d_ok, other=0.0)
    for start in range(kv_start, kv_end, TILE_N):
        k_pos = start + n
        k_ok = k_pos < kv_end
        blk = tl.load(bt_row + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        off = (k_pos % block_size).to(tl.int64)
        kv_mask = k_ok[None, :] & d_ok[:, None]
        # K loaded transposed: [HEAD_PAD, TILE_N].
        k = tl.load(k_cache_ptr + blk[None, :] * stride_kcb + off[None, :] * stride_kco
                    + kvh * stride_kch + d[:, None] * stride_kcd, mask=kv_mask, other=0.0)
        if SINK:
            k = k.to(tl.float32) + tl.where(k_pos[None, :] == 0, sink_k[:, None], 0.0)
        if IEEE_FP32:
            s = tl.dot(q, k.to(q.dtype), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        if SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates cleanly at +-1 (exp overflows to inf, or to 0)
            # (log2(e) written out: a compiled kernel reads no plain Python globals, the interpreter does)
            x = s * (qk_scale / 1.4426950408889634 / softcap)
            s = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (softcap * 1.4426950408889634)
        else:
            s = s * qk_scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if window > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + blk[:, None] * stride_vcb + off[:, None] * stride_vco
                    + kvh * stride_vch + d[None, :] * stride_vcd, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if SINK:
            v = v.to(tl.float32) + tl.where(k_pos[:, None] == 0, sink_v[None, :], 0.0)
        if IEEE_FP32:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None] * v_scale
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _kernels() -> tuple[Any, Any]:
    """(write_kv kernel, attention kernel), jitted for the current TRITON_INTERPRET mode."""
    user = "the triton attention backend"
    return jitted(_write_kv_kernel, user), jitted(_paged_attention_kernel, user)


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _head_pad(head_dim: int) -> int:
    # tl.dot needs an inner dimension of at least 16; arange needs a power of two. Padding lanes are masked.
    if head_dim > 256:
        raise ValueError(f"triton attention supports head_dim <= 256, got {head_dim}")
    return max(16, _next_pow2(head_dim))


def _tile_shape(group: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M) for G query heads per KV head: ~16 score rows per tile, at least G."""
    block_m = max(16, _next_pow2(group))
    return max(1, block_m // group), block_m


@dataclass
class TritonAttentionMetadata:
    """The step's common metadata plus its query tilings, one per BLOCK_Q, built on first use."""
    base: AttentionMetadata
    _tilings: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tiles(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tile_seq, tile_qoff) int32 on the metadata's device, built on the host from Python lists so
        the grid size is known without a device sync."""
        hit = self._tilings.get(block_q)
        if hit is None:
            hit = self._tilings[block_q] = _tiling(self.base, block_q)
        return hit


def _tiling(meta: AttentionMetadata, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    qlens = torch.tensor(meta.query_lens_list, dtype=torch.int64)
    counts = (qlens + block_q - 1) // block_q                     # tiles per sequence (0 if no query)
    tile_seq = torch.repeat_interleave(torch.arange(len(qlens)), counts)
    first = torch.cumsum(counts, 0) - counts                      # index of each sequence's first tile
    tile_qoff = (torch.arange(int(counts.sum())) - first[tile_seq]) * block_q
    dev = meta.block_tables.device
    return (tile_seq.to(torch.int32).to(dev, non_blocking=True),
            tile_qoff.to(torch.int32).to(dev, non_blocking=True))


class TritonAttentionBackend:
    """Paged attention with one Triton launch per layer for the whole mixed batch (CUDA; or CPU under
    TRITON_INTERPRET=1 for tests)."""

    name = "triton"

    def __init__(self, tile_n: int = 32) -> None:
        if tile_n < 16 or tile_n & (tile_n - 1):
            raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
        self.tile_n = tile_n

    # ---------------------------------------------------------------------------------- bookkeeping
    def prepare(self, meta: AttentionMetadata) -> TritonAttentionMetadata:
        """The step's metadata with the tiling for BLOCK_Q = 16 (no GQA) precomputed.

        The tiling depends on BLOCK_Q, which depends on Hq // Hkv, known only when forward sees the
        query. Tilings are therefore cached per BLOCK_Q in the returned metadata: the one for G = 1 is
        built here, any other on the first layer's forward, and all later layers of the step reuse it.
        """
        tm = TritonAttentionMetadata(meta)
        tm.tiles(16)
        return tm

    # ---------------------------------------------------------------------------------- kernels
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tm: TritonAttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0,
                 k_feedback: torch.Tensor | None = None) -> None:
        """Scatter this step's key/value [T, Hkv, D] into the caches at meta.slot_mapping (slots < 0 skipped)."""
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        write_kernel, _ = _kernels()
        nkv, hd = k_cache.shape[-2:]
        if key.shape[1:] != (nkv, hd) or value.shape[1:] != (nkv, hd):
            raise ValueError(f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not match cache heads "
                             f"{nkv} x {hd}")
        # converted (scaled, saturated, rounded) by torch, so both backends store the same bytes; the
        # kernel then only scatters (Triton's interpreter also rounds fp8 wrongly at a binade's edge)
        key, value = to_cache(key, k_cache.dtype, k_scale, k_feedback), to_cache(value, v_cache.dtype, v_scale)
        write_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, tm.base.slot_mapping,
            *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
            nkv, hd, k_cache.shape[1],
            HEADS_PAD=_next_pow2(nkv), HEAD_PAD=_next_pow2(hd),
        )

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, tm: TritonAttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0, window: int | None = None, softcap: float | None = None,
                sink: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Hq, D] -> [T, Hq, D]. Reads K/V only from the cache (write_kv must have run for this
        step's tokens); the step's own `key`/`value` are not needed. `window`, `softcap` and `sink` as in
        the torch backend."""
        meta = tm.base
        _, attn_kernel = _kernels()
        num_tokens, num_q_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[-2]
        if k_cache.shape[-1] != head_dim:
            raise ValueError(f"query head_dim {head_dim} != cache head_dim {k_cache.shape[-1]}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        out = torch.empty_like(query)
        if num_tokens == 0:
            return out
        group = num_q_heads // num_kv_heads
        block_q, block_m = _tile_shape(group)
        tile_seq, tile_qoff = tm.tiles(block_q)
        if tile_seq.numel() == 0:
            return out
        attn_kernel[(tile_seq.numel(), num_kv_heads)](
            out, query, k_cache, v_cache,
            meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.context_lens,
            tile_seq, tile_qoff,
            query if sink is None else sink.to(query.device, torch.float32).contiguous(),
            float(scale) * cache_scale(k_cache.dtype, k_scale) * _LOG2E, cache_scale(v_cache.dtype, v_scale),
            int(window or 0), float(softcap or 1.0),
            *query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
            meta.block_tables.stride(0),
            head_dim, meta.block_size,
            G=group, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=self.tile_n,
            HEAD_PAD=_head_pad(head_dim), IEEE_FP32=query.dtype == torch.float32, SOFTCAP=softcap is not None,
            SINK=sink is not None,
        )
        return out
