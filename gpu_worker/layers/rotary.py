"""Rotary position embeddings (half-rotation style, as in HF Llama; the rotation runs in the model dtype as HF does), with the cos/sin table
computed once for every position up to max_model_len and gathered once per step (RotaryEmbedding.at).

Partial rotary (Phi-3 family) rotates the first `rotary_dim` features of each head and passes the rest.
LongRoPE (Phi-3) keeps two tables, short factors and long, and picks per sequence per step as HF does for
its one sequence: the long table once the sequence, with this step's tokens, is longer than the
pretraining length (keys already cached keep the rotation they were written with, as in HF)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from gpu_worker.kernels import native


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # float32 throughout, as Hugging Face computes it, so fp32 runs match it bit for bit
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: llama3, linear, longrope)")
    return inv


def _longrope_inv_freq(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    ext = torch.tensor(factors, dtype=torch.float32)
    if ext.numel() != head_dim // 2:
        raise ValueError(f"longrope factors: {ext.numel()} given, {head_dim // 2} expected (rotary_dim / 2)")
    return 1.0 / (ext * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict | None, dtype: torch.dtype):
        super().__init__()
        self.max_positions = max_positions
        self.long_after: int | None = None      # LongRoPE: sequences longer than this use the long table
        if (scaling or {}).get("rope_type") == "longrope":
            self.long_after = scaling["original_max_position_embeddings"]
            invs = [_longrope_inv_freq(rotary_dim, theta, scaling[k]) for k in ("short_factor", "long_factor")]
            mscale = scaling["attention_factor"]
        else:
            invs, mscale = [_inv_freq(rotary_dim, theta, scaling)], 1.0
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.cat([torch.outer(t, inv) for inv in invs])      # [tables * max_positions, rotary_dim / 2]
        freqs = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", freqs.cos() * mscale, persistent=False)
        self.register_buffer("sin", freqs.sin() * mscale, persistent=False)
        self.dtype = dtype

    def at(self, positions: torch.Tensor, dtype: torch.dtype, seq_ends: torch.Tensor | None = None) -> "Rotation":
        """The rotation of this step's positions, gathered once and applied in every layer. `seq_ends`
        [T]: the length each row's sequence reaches this step (LongRoPE's choice; default position + 1)."""
        rows = positions
        if self.long_after is not None:
            ends = positions + 1 if seq_ends is None else seq_ends
            rows = positions + (ends > self.long_after).to(positions.dtype) * self.max_positions
        cos = self.cos[rows].unsqueeze(1).to(dtype)
        sin = self.sin[rows].unsqueeze(1).to(dtype)
        half = sin.shape[-1] // 2
        return Rotation(cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1), positions == 0)


@dataclass
class Rotation:
    cos: torch.Tensor     # [T, 1, D]
    sin: torch.Tensor     # [T, 1, D], first half negated: x*cos + swap_halves(x)*sin is HF's rotation
    first: torch.Tensor   # [T] bool: rows at position 0 (an fp8 cache centres them apart, kv_rotation.py)

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D]. (-x2)*sin and x2*(-sin) are the same float, so this matches
        HF's q*cos + rotate_half(q)*sin bit for bit in four ops instead of seven."""
        return self._rotate(q), self._rotate(k)

    def apply_(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """apply(), in place where the native kernel takes q and k (fp32 on the CPU, each row's heads
        side by side, as views into the fused qkv projection's output are): the same floats in one call
        instead of eight ops. Returns the rotated q and k (new tensors where it falls back)."""
        cos, sin = self.cos, self.sin
        lib = native.library_for(q)
        if lib is None or not all(t.dtype == torch.float32 for t in (q, k, cos, sin)) or \
                not (_heads_side_by_side(q) and _heads_side_by_side(k) and cos.is_contiguous() and sin.is_contiguous()):
            return self.apply(q, k)
        rc = lib.psq_rope(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1], q.shape[0],
                          q.shape[2], cos.data_ptr(), sin.data_ptr(), cos.shape[-1], native.cpu_isa())
        return (q, k) if rc == 0 else self.apply(q, k)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        rot = self.cos.shape[-1]
        if rot != x.shape[-1]:           # partial rotary: the tail of each head passes through
            return torch.cat((self._rotate(x[..., :rot]), x[..., rot:]), dim=-1)
        half = rot // 2
        return x * self.cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * self.sin


def _heads_side_by_side(x: torch.Tensor) -> bool:
    """x [T, H, D] whose rows may be apart but whose heads and entries are contiguous within a row."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
