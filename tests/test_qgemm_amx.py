"""The packed-weight matmul on AMX tiles (gpu_worker/kernels/qgemm_amx.cpp) against torch: each weight and
input rounded to bf16 as the bf16 copy holds them, the products summed in fp32, for every packed format,
group size and step shape the kernel splits its work by (up to 16 rows, 17-32, more; feature counts that
are not multiples of its blocks), with the weights expanded at each call or once beforehand (the tile
layout --dtype auto holds); and which steps --dtype auto hands it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.kernels import native
from gpu_worker.layers.linear import Linear
from gpu_worker.quantization import linear_method, packed, packed_linear
from gpu_worker.quantization.packed import AMX_NATIVE_MAX_ROWS, FP8_BITS, GroupQuant, PackedWeight

pytestmark = pytest.mark.unit
needs_tiles = pytest.mark.skipif(not (native.available() and native.amx_ready()),
                                 reason="this CPU has no AMX-BF16 tiles (or the OS withholds them)")


def packed_weight(fmt: str, n: int, k: int, group: int, seed: int) -> PackedWeight:
    rng = np.random.default_rng(seed)
    if fmt == "fp8":
        values = torch.from_numpy(rng.normal(0, 40, (n, k)).astype(np.float32)).to(torch.float8_e4m3fn)
        scale = torch.from_numpy(rng.uniform(0.5, 1.5, (n, k // group)).astype(np.float32))
        return PackedWeight(values.view(torch.uint8), scale, torch.zeros_like(scale), FP8_BITS, group)
    lo, hi = (0, 15) if fmt == "q4" else (-128, 127)
    q = rng.integers(lo, hi + 1, (n, k))
    scale = rng.uniform(0.001, 0.02, (n, k // group)).astype(np.float32)
    offset = rng.uniform(-0.1, 0.0, (n, k // group)).astype(np.float32)
    return PackedWeight.from_groups(GroupQuant(q, scale, offset, group))


def reference(pw: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.bfloat16().double() @ pw.dequantize().bfloat16().double().T
    return (y if bias is None else y + bias.double()).float()


@needs_tiles
@pytest.mark.parametrize("fmt,group", [("q4", 32), ("q4", 16), ("q4", 64), ("q8", 32), ("fp8", 64)])
@pytest.mark.parametrize("n", [40, 96, 112])
def test_tiles_give_the_bf16_products_summed_in_fp32(fmt, group, n):
    pw = packed_weight(fmt, n, 192, group, seed=n + group)
    gen = torch.Generator().manual_seed(n)
    bias = torch.randn(n, generator=gen)
    lib = native.library()
    tiles = pw._expand_for_tiles(lib)
    for rows in (1, 9, 16, 17, 32, 33, 50, 64):
        x = torch.randn(rows, 192, generator=gen)
        for b, pre in ((None, None), (bias, None), (None, tiles), (bias, tiles)):
            pw.tiles = pre
            got = pw._tiles_gemm(lib, x, b)
            want = reference(pw, x, b)
            # the bf16 roundings are the reference's own: what is left is fp32 summation order
            scale = (x.bfloat16().float().abs() @ pw.dequantize().bfloat16().float().abs().T).max()
            assert (got - want).abs().max() <= 1e-5 * scale, (rows, b is None, pre is None)


@needs_tiles
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(monkeypatch):
    """Nor on whether the weights were expanded beforehand, nor on a step's split into calls."""
    pw = packed_weight("q4", 100, 256, 32, seed=1)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    lib = native.library()
    full = pw._tiles_gemm(lib, x, None)
    for rows in (1, 5, 16, 17, 40):
        assert torch.equal(pw._tiles_gemm(lib, x[-rows:].contiguous(), None), full[-rows:]), rows
    pw.tiles = pw._expand_for_tiles(lib)
    assert torch.equal(pw._tiles_gemm(lib, x, None), full)
    monkeypatch.setattr(packed, "AMX_TILE_CALL_ROWS", 24)       # calls of 24, 24 and 16 rows
    assert torch.equal(pw._tiles_gemm(lib, x, None), full)


@needs_tiles
def test_a_k_the_tiles_cannot_take_is_refused():
    lib = native.library()
    x, q, y = torch.zeros(1, 48), torch.zeros(16, 24, dtype=torch.uint8), torch.zeros(1, 16)
    s = torch.ones(16, 3)
    assert lib.psq_gemm_amx(x.data_ptr(), 1, 48, q.data_ptr(), s.data_ptr(), s.data_ptr(), 16, 16, 4, None,
                            y.data_ptr(), None) == -1


@needs_tiles
def test_auto_hands_the_tiles_every_step_beyond_the_vector_kernel(monkeypatch):
    """On AMX, steps of up to AMX_NATIVE_MAX_ROWS rows stay on the vector kernel (its fp32 products, so
    speculative verification reproduces decoding), then the tiles, on their own bf16 copy and no oneDNN
    copy: which one ran is seen by which computation the numbers equal."""
    monkeypatch.setattr(packed_linear, "bf16_hardware", lambda: "amx_bf16")
    layer = Linear(128, 64, method=linear_method("gguf"))
    layer.packed = packed_weight("q4", 64, 128, 32, seed=5)
    x = torch.randn(600, 128, generator=torch.Generator().manual_seed(6))
    lib = native.library()
    exact = layer.packed._native_gemm(lib, x, None)
    tiled = layer.packed._tiles_gemm(lib, x, None)        # expanding at the call
    layer.method.use_matmul_dtype(layer, torch.bfloat16)
    assert layer.packed.tiles is not None and layer.packed.expanded is None
    for rows in (1, AMX_NATIVE_MAX_ROWS, AMX_NATIVE_MAX_ROWS + 1, 40, 128, 600):
        got = layer(x[:rows])
        assert torch.equal(got, (exact if rows <= AMX_NATIVE_MAX_ROWS else tiled)[:rows]), rows


def test_without_amx_or_outside_bf16_the_tiles_stay_off(monkeypatch):
    pw = packed_weight("q4", 64, 128, 32, seed=7)
    pw.keep_expanded(torch.float16, 8, tiles=True)
    assert pw.tiles is None and pw.expanded.dtype == torch.float16
    monkeypatch.setattr(native, "uses_amx", lambda: False)
    pw = packed_weight("q4", 64, 128, 32, seed=7)
    pw.keep_expanded(torch.bfloat16, 8, tiles=True)
    assert pw.tiles is None and pw.expanded is not None
