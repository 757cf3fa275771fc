"""Layers whose fast forms must stay bit-identical to the reference formulas (HF's), which the
HF-comparison tests rely on."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fused_rmsnorm_is_the_unfused_formula(rows):
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5, torch.float32)
    norm.weight.data.normal_()
    x = torch.randn(rows, 576) * 3
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(norm(x), norm.weight * xf)


def test_rotation_is_hf_rotate_half_bit_for_bit():
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 512, 10000.0, None, torch.float32)
    pos = torch.tensor([0, 5, 511, 77])
    q, k = torch.randn(4, 9, 64), torch.randn(4, 3, 64)
    cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)

    def rotate_half(x):
        return torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    got_q, got_k = rope.at(pos, torch.float32).apply(q, k)
    assert torch.equal(got_q, q * cos + rotate_half(q) * sin)
    assert torch.equal(got_k, k * cos + rotate_half(k) * sin)
