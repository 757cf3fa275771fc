"""Layers whose fast forms must stay bit-identical to the reference formulas (HF's), or within a few ulp
where a native kernel sums in its own order; the HF-comparison tests rely on it."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import native
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_fused_rmsnorm_is_the_unfused_formula(rows, kernel, monkeypatch, force_isa):
    """torch's fused op is the formula bit for bit; the native kernel sums in another order (within
    a few ulp), on each instruction-set level."""
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5, torch.float32)
    norm.weight.data.normal_()
    x = torch.randn(rows, 576) * 3
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    if kernel == "torch":
        monkeypatch.setattr(native, "library", lambda: None)
        assert torch.equal(norm(x), want)
        return
    assert native.available(), "the native kernels did not build; scripts/setup.sh builds them"
    for isa in native.ISA_LEVELS:
        force_isa(isa)
        torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-6)


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
