"""Rotary position embeddings (half-rotation style, as in HF Llama; the rotation runs in the model dtype as HF does), with the cos/sin table
computed once for every position up to max_model_len and gathered once per step (RotaryEmbedding.at)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


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
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: llama3, linear)")
    return inv


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, dtype: torch.dtype):
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        freqs = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.dtype = dtype

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> "Rotation":
        """The rotation of this step's positions, gathered once and applied in every layer."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        half = sin.shape[-1] // 2
        return Rotation(cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))


@dataclass
class Rotation:
    cos: torch.Tensor     # [T, 1, D]
    sin: torch.Tensor     # [T, 1, D], first half negated: x*cos + swap_halves(x)*sin is HF's rotation

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D]. (-x2)*sin and x2*(-sin) are the same float, so this matches
        HF's q*cos + rotate_half(q)*sin bit for bit in four ops instead of seven."""
        return self._rotate(q), self._rotate(k)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * self.cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * self.sin
