"""kernels/qgemm_i16.cpp and qgemm_panel_i16.cpp: the packed matmuls with int16 activations (--dtype auto's
steps on a CPU without bf16 hardware: the vector kernel up to decode sizes, the panel kernel beyond) against
a torch reference of the same rounding, each row independent of the step's others, and PackedWeight's
choice of them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from gpu_worker import cpu_precision
from gpu_worker.kernels import native
from gpu_worker.quantization.packed import PANELS_I16, VECTOR, VECTOR_I16, GroupQuant, PackedWeight
from tests.gguf_files import gguf_tensor

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not native.available(), reason="the native library did not build")]


def needs_avx2() -> None:
    if native.cpu_isa() < native.ISA_LEVELS["avx2"]:
        pytest.skip("this CPU has no avx2")


def reference(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in fp64: x rounded to int16 per run of 32 (step max|x| / 32767, to
    nearest even), times the integer values, scaled per group, plus offset * the exact sum of x."""
    m, k = x.shape
    runs = x.reshape(m, k // 32, 32)
    amax = runs.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros(()))     # fp32, as the kernel
    xq = torch.round(runs * inv).double()
    step = (amax / 32767.0).double()
    xr = (xq * step).reshape(m, k)                        # the rounded activations, exactly
    v = pw.values().double()
    n, g = v.shape[0], pw.group
    scale = pw.scale.double().repeat_interleave(g, 1)
    offset = pw.offset.double().repeat_interleave(g, 1)
    y = xr @ (scale * v).t() + x.double() @ offset.t()
    return y if bias is None else y + bias.double()


def i16(pw: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return pw._i16_gemm(native.library(), x.contiguous(), bias)


def panel_i16(pw: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return pw._panel_i16_gemm(native.library(), x.contiguous(), bias)


# The vector kernel's rows (every remainder of its 5-row tiles) and the panel kernel's (of its 4-row tiles,
# up to a prefill chunk's size); N = 37 features leaves the panels' last block of 16 five short.
KERNELS = {"vector": (i16, (1, 4, 5, 6, 11, 40)), "panels": (panel_i16, (1, 3, 4, 5, 6, 7, 41, 130))}


def packed(lo: int, hi: int, group: int, n: int = 37, k: int = 224, seed: int = 0) -> PackedWeight:
    rng = np.random.default_rng(seed)
    return PackedWeight.from_groups(GroupQuant(rng.integers(lo, hi, (n, k)), rng.random((n, k // group), np.float32),
                                               rng.standard_normal((n, k // group), np.float32), group))


# 4-bit (unsigned nibbles) and 8-bit (signed) values; groups of 16 keep a run's halves apart; K = 224 is
# seven runs, so the kernel's run pairs end on a single one.
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("lo,hi,group", [(0, 16, 32), (0, 16, 16), (0, 16, 32 * 7), (-128, 128, 32), (-32, 32, 16)])
def test_matches_the_reference_rounding(lo, hi, group, kernel):
    needs_avx2()
    pw = packed(lo, hi, group)
    assert pw.bits == (4 if hi == 16 else 8)
    bias = torch.randn(pw.shape[0])
    fn, row_counts = KERNELS[kernel]
    for rows in row_counts:
        x = torch.randn(rows, pw.shape[1]) * torch.rand(rows, 1) * 10
        got, want = fn(pw, x, bias).double(), reference(x, pw, bias)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), rows
        exact = x.double() @ pw.dequantize().double().t() + bias.double()
        assert (got - exact).abs().max() <= 2e-4 * exact.abs().max(), rows      # int16's rounding is small


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_row_is_computed_alone(kernel):
    """A row's result is the same bits whatever rows share its step (speculative verification's k + 1 rows
    against decoding's one; a sequence's prefill chunk against the same tokens in another step)."""
    needs_avx2()
    fn = KERNELS[kernel][0]
    pw = packed(0, 16, 32, n=64, k=576)
    x = torch.randn(13, 576)
    x[4] *= 1000.0                                 # a row of another scale next to the others
    full = fn(pw, x)
    for r in range(13):
        assert torch.equal(fn(pw, x[r:r + 1]), full[r:r + 1]), r
    assert torch.equal(fn(pw, x[2:9]), full[2:9])


@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_runs_and_an_outlier(kernel):
    """An all-zero run rounds to zeros (no 0/0), so a zero row gives the bias alone; one huge value in a run
    costs only that run its resolution."""
    needs_avx2()
    pw = packed(0, 16, 32, n=8, k=128)
    bias = torch.randn(8)
    x = torch.zeros(2, 128)
    x[1, 40] = 1e6
    x[1, 64:] = torch.randn(64)
    got = KERNELS[kernel][0](pw, x, bias)
    assert torch.equal(got[0], bias)
    want = reference(x, pw, bias)
    assert (got[1].double() - want[1]).abs().max() <= 1e-5 * want[1].abs().max()


def test_gguf_blocks_through_the_matmul(force_isa):
    """GGUF tensors with the flag set: Q4_1 and Q8_0 (SmolLM2's) and Q6_K (groups of 16) go through the
    vector kernel at decode sizes, beyond them the int16 panels; fp8 weights and the portable level keep
    fp32."""
    force_isa("avx2")
    needs_avx2()
    for qtype in (T.Q4_1, T.Q8_0, T.Q6_K):
        pw = gguf_tensor(qtype, 40, 256, seed=2).pack()
        pw.int16_activations = True
        assert pw.kernel_for(1) == pw.kernel_for(pw.max_native_rows()) == VECTOR_I16
        assert pw.kernel_for(pw.max_native_rows() + 1) == pw.kernel_for(4096) == PANELS_I16
        x = torch.randn(3, 256)
        assert torch.equal(pw.matmul(x), i16(pw, x))
        x = torch.randn(pw.max_native_rows() + 9, 256)
        assert torch.equal(pw.matmul(x), panel_i16(pw, x))
    pw.int16_vector_rows = 8          # no speculation (model_runner): the panels from 9 rows
    assert pw.kernel_for(8) == VECTOR_I16 and pw.kernel_for(9) == PANELS_I16
    x = torch.randn(9, 256)
    assert torch.equal(pw.matmul(x), panel_i16(pw, x))
    force_isa("portable")
    assert pw.kernel_for(1) == pw.kernel_for(9) == VECTOR
    pw.int16_activations = False
    force_isa("avx2")
    assert pw.kernel_for(1) == VECTOR


@pytest.mark.parametrize("name", ["psq_gemm_i16", "psq_gemm_panel_i16"])
def test_fp8_weights_are_refused_by_the_kernels(name):
    needs_avx2()
    pw = packed(0, 16, 32, n=4, k=64)
    q, scale, offset, n, group, _ = pw._call
    y = torch.zeros(1, n)
    x = torch.randn(1, 64)
    fn = getattr(native.library(), name)
    assert fn(x.data_ptr(), 1, 64, q, scale, offset, n, group, 9, None, y.data_ptr()) == 1
    assert not y.any()


def test_rows_of_part_runs_are_refused_by_the_panels():
    """K = 48 is one and a half runs of 32 (PackedWeight never makes one; the kernel checks anyway)."""
    needs_avx2()
    pw = packed(0, 16, 16, n=4, k=64)
    q, scale, offset, n, group, bits = pw._call
    x, y = torch.randn(1, 48), torch.zeros(1, n)
    assert native.library().psq_gemm_panel_i16(x.data_ptr(), 1, 48, q, scale, offset, n, group, bits, None,
                                               y.data_ptr()) == 1
    assert not y.any()


def test_auto_takes_it_only_without_bf16_hardware(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("PAGEDSERVE_CPU_INT16", raising=False)
    monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "0")
    assert cpu_precision.int16_activations("auto", cpu)
    assert not cpu_precision.int16_activations("float32", cpu)
    assert not cpu_precision.int16_activations("auto", torch.device("cuda"))
    monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "1")
    assert not cpu_precision.int16_activations("auto", cpu)
    monkeypatch.setenv("PAGEDSERVE_CPU_INT16", "1")
    assert cpu_precision.int16_activations("auto", cpu)
    monkeypatch.setenv("PAGEDSERVE_CPU_INT16", "0")
    monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "0")
    assert not cpu_precision.int16_activations("auto", cpu)
    monkeypatch.setenv("PAGEDSERVE_CPU_INT16", "maybe")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_INT16"):
        cpu_precision.int16_activations("auto", cpu)
