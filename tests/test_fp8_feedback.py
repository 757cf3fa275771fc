"""Error-feedback rounding of keys into an fp8 cache (gpu_worker/attention/fp8_feedback.py): the native
kernel gives the reference loop's bytes, the rounding lowers the score error it is built for, and a
model's calibration pass sets it up per layer and kv head."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.attention import FP8_DTYPES, to_cache
from gpu_worker.attention.fp8_feedback import feedback_matrix, round_with_feedback, round_with_feedback_reference
from gpu_worker.kernels import native
from gpu_worker.layers.kv_rotation import KVCentres, kv_rotation

pytestmark = pytest.mark.unit


def _queries(gen: torch.Generator, n: int, heads: int, d: int) -> torch.Tensor:
    """Queries with their energy in a few channels and a common direction, as trained models' are (the
    same distribution for every call with the same heads and d)."""
    spread = torch.rand(heads, d, generator=torch.Generator().manual_seed(heads * d)) ** 4 * 4 + 0.05
    return torch.randn(n, heads, d, generator=gen) * spread + spread.flip(-1)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


ISAS = [isa for isa, level in native.ISA_LEVELS.items() if level <= native.cpu_isa()]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("d", [32, 64, 128])
def test_native_kernel_gives_the_reference_bytes(dtype: torch.dtype, d: int, isa: str, force_isa) -> None:
    """Every magnitude the cache meets: ordinary keys, saturating ones, fp8 subnormals, signed zeros, and a
    layer scale (which the kernel divides by itself); blocks of 16 rows a head and a partial last block (37
    rows), and a lone row, on every instruction-set level this CPU has."""
    assert native.available(), "scripts/setup.sh builds the native kernels"
    force_isa(isa)
    gen = torch.Generator().manual_seed(d)
    q = _queries(gen, 300, 3, d)
    a = feedback_matrix(torch.einsum("thd,the->hde", q, q))
    for std, rows in ((2.0, 37), (3000.0, 19), (1e-3, 19), (0.05, 1)):
        x = torch.randn(rows, 3, d, generator=gen) * std
        x[0, 0, :4], x[0, 1, :4] = 0.0, -0.0
        for scale in (1.0, 0.37):
            ref = round_with_feedback_reference(x / scale if scale != 1.0 else x, a, dtype)
            assert torch.equal(_bytes(round_with_feedback(x, a, dtype, scale)), _bytes(ref)), (std, scale)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_without_feedback_it_is_nearest_rounding(dtype: torch.dtype) -> None:
    """A zero matrix carries nothing: the kernel's own rounding is torch's nearest-even cast, ties included."""
    top = torch.finfo(dtype).max
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, torch.nextafter(mids, values[1:]), torch.nextafter(mids, values[:-1]),
                   torch.tensor([top * 1.5, -top * 3])])
    x = x[: x.numel() // 8 * 8].reshape(-1, 2, 4)
    got = round_with_feedback(x, torch.zeros(2, 4, 4), dtype, 1.0)
    assert torch.equal(_bytes(got), _bytes(to_cache(x, dtype, 1.0)))
    assert torch.equal(_bytes(round_with_feedback_reference(x, torch.zeros(2, 4, 4), dtype)), _bytes(got))


def test_feedback_lowers_the_score_error_for_the_queries_it_was_measured_on() -> None:
    """The point of it: over held-out queries from the same distribution, the mean squared score error
    (q.e)^2 of rounded keys is well under nearest rounding's, though each element's error is larger."""
    gen = torch.Generator().manual_seed(3)
    d, heads = 64, 2
    calibration, held_out = _queries(gen, 2000, heads, d), _queries(gen, 2000, heads, d)
    a = feedback_matrix(torch.einsum("thd,the->hde", calibration, calibration))
    keys = torch.randn(500, heads, d, generator=gen) * 20
    dtype = torch.float8_e4m3fn
    nearest = to_cache(keys, dtype, 1.0).float() - keys
    fed_back = round_with_feedback(keys, a, dtype, 1.0).float() - keys
    score_error = lambda e: torch.einsum("qhd,khd->qkh", held_out, e).pow(2).mean()    # noqa: E731
    assert score_error(fed_back) < 0.7 * score_error(nearest), (score_error(fed_back), score_error(nearest))
    assert fed_back.pow(2).mean() > nearest.pow(2).mean()


def test_calibration_sets_a_strictly_upper_feedback_matrix_per_kv_head() -> None:
    """KVCentres.measure with the rotation gives [Hkv, D, D] (nothing on or below the diagonal: a channel
    never feeds itself or an earlier one); without it, keys round to nearest."""
    gen = torch.Generator().manual_seed(4)
    t, hq, hkv, d = 40, 6, 2, 32
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv))
    c = KVCentres.measure(q, k, v, kv_rotation(d, torch.device("cpu")))
    assert c.key_feedback is not None and c.key_feedback.shape == (hkv, d, d)
    assert not c.key_feedback.tril().any() and c.key_feedback.triu(1).abs().sum() > 0
    assert KVCentres.measure(q, k, v).key_feedback is None
