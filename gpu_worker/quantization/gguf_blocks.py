"""GGUF block formats taken apart into integer values and per-group fp32 scale and offset.

Every supported type is, per group of G weights, w = scale * q + offset with small non-negative
integers q (signed only for Q8_0). Scales are formed exactly as gguf-py forms them (an f16 times a small
integer, which is exact in fp32), so one fused multiply-add gives back gguf's dequantized values bit for
bit; tests check this against `gguf.quants.dequantize` for each type.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from gpu_worker.quantization.packed import GroupQuant

QK_K = 256


def _f16(b: np.ndarray) -> np.ndarray:
    return b.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Low nibbles of each run of `run` bytes, then their high nibbles (the order GGUF uses)."""
    nb = qs.shape[0]
    x = qs.reshape(nb, -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (x & 15).reshape(nb, -1).astype(np.int16)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of a little-endian 32-bit word per block, as the fifth bit of value i (Q5_0, Q5_1)."""
    words = qh.copy().view(np.uint32).reshape(-1, 1)
    return ((words >> np.arange(count, dtype=np.uint32).reshape(1, count)) & 1).astype(np.int16)


def _q4_0(b):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:], 16), d, -8 * d, 32


def _q4_1(b):
    return _nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4]), 32


def _q5_0(b):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 6:], 16) | (_high_bits(b[:, 2:6], 32) << 4), d, -16 * d, 32


def _q5_1(b):
    return _nibbles(b[:, 8:], 16) | (_high_bits(b[:, 4:8], 32) << 4), _f16(b[:, :2]), _f16(b[:, 2:4]), 32


def _q8_0(b):
    d = _f16(b[:, :2])
    return b[:, 2:].copy().view(np.int8).astype(np.int16), d, np.zeros_like(d), 32


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: d * sc and dmin * m for the eight 6-bit packed sub-block pairs."""
    nb = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(nb, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 2) & 48)], axis=-1).astype(np.float32)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 2) & 48)], axis=-1).astype(np.float32)
    return d * sc, -(dmin * mn)


def _q4_k(b):
    scale, offset = _k_scales(b)
    return _nibbles(b[:, 16:], 32), scale, offset, 32


def _q5_k(b):
    nb = b.shape[0]
    scale, offset = _k_scales(b)
    qh = b[:, 16:48].reshape(nb, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    high = (qh & 1).reshape(nb, -1).astype(np.int16)
    return _nibbles(b[:, 48:], 32) | (high << 4), scale, offset, 32


def _q6_k(b):
    nb = b.shape[0]
    ql = _nibbles(b[:, :128], 64).reshape(nb, -1, 32)
    qh = b[:, 128:192].reshape(nb, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (ql | ((qh & 3).reshape(nb, -1, 32).astype(np.int16) << 4)).reshape(nb, QK_K)
    scale = _f16(b[:, 208:210]) * b[:, 192:208].copy().view(np.int8).astype(np.float32)
    return q, scale, -32 * scale, 16


_DECODERS = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
             T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}
SUPPORTED = frozenset(_DECODERS)


def decode(raw: np.ndarray, qtype: T, k: int) -> GroupQuant:
    """Take apart the raw block bytes of a [rows, k] tensor (`raw` is uint8 [rows, bytes per row])."""
    if qtype not in _DECODERS:
        raise ValueError(f"GGUF type {qtype.name} is not kept quantized")
    block, nbytes = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows * (k // block), nbytes)
    q, scale, offset, group = _DECODERS[qtype](blocks)
    return GroupQuant(q.reshape(rows, k), np.ascontiguousarray(scale, np.float32).reshape(rows, k // group),
                      np.ascontiguousarray(offset, np.float32).reshape(rows, k // group), group)
