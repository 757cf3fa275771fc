"""The Triton quantized GEMM against the torch reference x @ PackedWeight.dequantize().T (+ bias).

Without a GPU the kernel runs in the Triton interpreter (TRITON_INTERPRET=1). The env var must be set
before the kernel is jitted; the module jits lazily on first launch and reads the mode then, so setting it
here works even if triton (or the module) was imported earlier in the session.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from gpu_worker.kernels.triton_jit import interpret_mode  # noqa: E402
from gpu_worker.kernels.triton_qgemm import packed_matmul  # noqa: E402
from gpu_worker.quantization.packed import GroupQuant, PackedWeight  # noqa: E402

pytestmark = pytest.mark.unit

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N = 72      # not a multiple of the kernel's BLOCK_N (64): the last column tile is partly masked


@pytest.fixture(autouse=True)
def _interpreter_on_cpu() -> None:
    """Guard against another test module having reset TRITON_INTERPRET after this one was imported."""
    if DEVICE.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        assert interpret_mode()


def make_weight(bits: int, n: int, k: int, group: int, seed: int) -> PackedWeight:
    """A PackedWeight packed by from_groups itself, so the test exercises the real layout."""
    rng = np.random.default_rng(seed)
    lo, hi = (0, 15) if bits == 4 else (-128, 127)
    q = rng.integers(lo, hi + 1, size=(n, k))
    q[0, :2] = lo, hi                  # both ends of the range, so from_groups picks `bits`
    scale = rng.uniform(0.005, 0.05, size=(n, k // group)).astype(np.float32)
    offset = rng.normal(0.0, 0.1, size=(n, k // group)).astype(np.float32)
    pw = PackedWeight.from_groups(GroupQuant(q, scale, offset, group), DEVICE)
    assert (pw.bits, pw.group) == (bits, group)
    return pw


def run(pw: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return packed_matmul(x, pw.q, pw.scale, pw.offset, pw.bits, pw.group, bias)


def reference(pw: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ pw.dequantize().double().T
    return y if bias is None else y + bias.double()


# K=96 runs the kernel's BLOCK_K=32 path, 64 and 256 its BLOCK_K=64 one; group 128 (and 32 at K=96) reads
# one scale per chunk, the smaller groups one per k.
CASES = [(bits, group, k) for bits in (4, 8) for group in (16, 32, 128) for k in (64, 96, 256) if k % group == 0]


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("bits,group,k", CASES, ids=[f"q{b}-g{g}-k{k}" for b, g, k in CASES])
def test_matches_dequantized_matmul_fp32(bits: int, group: int, k: int, m: int, with_bias: bool) -> None:
    pw = make_weight(bits, N, k, group, seed=bits * 1000 + group + k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(DEVICE) if with_bias else None
    y = run(pw, x, bias)
    assert y.shape == (m, N) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), reference(pw, x, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_several_row_tiles(bits: int) -> None:
    """More rows than one BLOCK_M tile, so programs along M start at rows other than 0."""
    pw = make_weight(bits, N, 96, 16, seed=5)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(70, 96, generator=gen).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(DEVICE)
    torch.testing.assert_close(run(pw, x, bias).double(), reference(pw, x, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_half_inputs_return_their_dtype(bits: int, dtype: torch.dtype) -> None:
    """Half inputs: the tile is rounded to x's dtype before the dot, so only a looser match is expected."""
    if DEVICE.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bfloat16 tl.dot is checked compiled on CUDA only (numpy has no bfloat16)")
    pw = make_weight(bits, N, 256, 32, seed=7)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(17, 256, generator=gen).to(device=DEVICE, dtype=dtype)
    bias = torch.randn(N, generator=gen).to(device=DEVICE, dtype=dtype)
    y = run(pw, x, bias)
    assert y.dtype == dtype
    ref = reference(pw, x, bias)
    tol = 3e-2 * ref.abs().max().item()
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=2e-2)


def test_rejects_a_layout_it_cannot_read() -> None:
    pw = make_weight(4, N, 64, 32, seed=1)
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="8-bit packing"):
        packed_matmul(x, pw.q, pw.scale, pw.offset, 8, 32)
    with pytest.raises(ValueError, match="scale"):
        packed_matmul(x, pw.q, pw.scale, pw.offset, 4, 16)
    with pytest.raises(ValueError, match="bias"):
        packed_matmul(x, pw.q, pw.scale, pw.offset, 4, 32, torch.zeros(N + 1, device=DEVICE))


def test_empty_batch() -> None:
    pw = make_weight(8, N, 64, 16, seed=2)
    y = run(pw, torch.zeros(0, 64, device=DEVICE), None)
    assert y.shape == (0, N)
