"""The Triton fp8 key rounding against round_with_feedback_reference and torch's own fp8 cast, byte for byte.

Without a GPU the kernel runs in the Triton interpreter (TRITON_INTERPRET=1), set before the kernel is
jitted (the module jits lazily on first launch and reads the mode then).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from gpu_worker.attention.fp8_feedback import feedback_matrix, round_with_feedback_reference  # noqa: E402
from gpu_worker.kernels.triton_fp8_round import round_with_feedback_triton  # noqa: E402
from gpu_worker.kernels.triton_jit import interpret_mode  # noqa: E402

pytestmark = pytest.mark.unit

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# dtype -> (std that saturates, std mostly in the subnormal range)
SCALES = {torch.float8_e4m3fn: (1000.0, 1e-3), torch.float8_e5m2: (1e5, 1e-5)}


@pytest.fixture(autouse=True)
def _interpreter_on_cpu() -> None:
    """Guard against another test module having reset TRITON_INTERPRET after this one was imported."""
    if DEVICE.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        assert interpret_mode()


def keys(t: int, h: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """[t, h, d] keys at several magnitudes along t: ordinary, saturating, subnormal; zeros of both signs."""
    big, tiny = SCALES[dtype]
    std = torch.tensor([2.0, big, tiny, 2.0, 2.0] * (t // 5 + 1))[:t, None, None]
    x = torch.randn(t, h, d, generator=gen) * std
    zero = torch.rand(t, h, d, generator=gen) < 0.2
    neg = torch.rand(t, h, d, generator=gen) < 0.5
    x[zero] = torch.where(neg, -0.0, 0.0)[zero]
    x[min(3, t - 1)] = torch.where(neg[min(3, t - 1)], -0.0, 0.0)        # a row of zeros only
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("h", [1, 3])
def test_same_bytes_as_reference(dtype: torch.dtype, d: int, h: int) -> None:
    gen = torch.Generator().manual_seed(1000 * d + 10 * h + DTYPES.index(dtype))
    q = torch.randn(h, 4 * d, d, generator=gen) * torch.linspace(0.2, 3.0, d)    # uneven channel scales
    a = feedback_matrix(q.transpose(1, 2) @ q / q.shape[1])
    assert (a != 0).any() and torch.equal(a, a.triu(1))
    t = 5 if DEVICE.type == "cpu" else 500
    x = keys(t, h, d, dtype, gen)
    want = round_with_feedback_reference(x, a, dtype).view(torch.uint8)
    got = round_with_feedback_triton(x.to(DEVICE), a.to(DEVICE), dtype)
    assert got.dtype == dtype and got.shape == x.shape
    got = got.cpu().view(torch.uint8)
    if DEVICE.type == "cpu":
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} bytes differ"
    else:
        # the launch turns FMA contraction off, but a compiler that fused the multiply and subtract anyway
        # would move a rare byte (and the error would carry along its row)
        same = (got == want).float().mean().item()
        assert same >= 0.999, f"only {same:.4%} of bytes equal"


def sweep(dtype: torch.dtype) -> torch.Tensor:
    """Every finite fp8 value, every midpoint between neighbours (ties), the floats just either side of
    each midpoint, values past the largest, fp32 subnormals; both signs."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    v = codes[codes.isfinite() & (codes >= 0)].unique()         # sorted, +0.0 .. top
    top = torch.finfo(dtype).max
    mid = (v[1:] + v[:-1]) / 2                                   # exact in fp32
    inf = torch.full_like(mid, float("inf"))
    extra = torch.tensor([top * 1.03, top * 1.0625, top * 1.07, top * 2, 1e30, float("inf"), 1e-40, 1e-45])
    pos = torch.cat([v, mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf), extra])
    return torch.cat([pos, -pos])


@pytest.mark.parametrize("dtype", DTYPES, ids=["e4m3fn", "e5m2"])
def test_rounding_matches_torch_cast(dtype: torch.dtype) -> None:
    d, h = 64, 1
    vals = sweep(dtype)
    n = -(-vals.numel() // d) * d
    x = torch.cat([vals, torch.zeros(n - vals.numel())]).reshape(-1, h, d)
    top = torch.finfo(dtype).max
    want = x.clamp(-top, top).to(dtype).view(torch.uint8)
    a = torch.zeros(h, d, d)
    got = round_with_feedback_triton(x.to(DEVICE), a.to(DEVICE), dtype).cpu().view(torch.uint8)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, [(x[tuple(i)].item(), got[tuple(i)].item(), want[tuple(i)].item()) for i in bad[:8]]
    assert torch.equal(round_with_feedback_reference(x, a, dtype).view(torch.uint8), want)
