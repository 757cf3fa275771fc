"""TritonAttentionBackend against the torch reference backend.

Without a GPU the Triton kernels run in the Triton interpreter (TRITON_INTERPRET=1). The env var must be
set before the kernels are jitted; the backend jits lazily on first launch and reads the mode then, so
setting it here works even if triton (or the backend module) was imported earlier in the session.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from gpu_worker.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from gpu_worker.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from gpu_worker.kernels.triton_jit import interpret_mode  # noqa: E402
from tests.attention_cases import dense_reference, make_meta, rand  # noqa: E402

pytestmark = pytest.mark.unit

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}

# Mixed batch: decodes (incl. one at position 0), chunks with cached context (incl. one spanning
# several query tiles and one with context not aligned to the block size), fresh prefills.
MIXED = [(20, 1), (0, 19), (13, 7), (5, 1), (0, 1), (33, 17), (0, 3), (8, 8)]


@pytest.fixture(autouse=True)
def _interpreter_on_cpu() -> None:
    """Guard against another test module having reset TRITON_INTERPRET after this one was imported."""
    if DEVICE.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        assert interpret_mode()


def run_both(seqs: list[tuple[int, int]], hq: int, hkv: int, head_dim: int, block_size: int,
             dtype: torch.dtype, seed: int = 0, **how) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a batch over a randomly filled cache (no write): Triton vs torch outputs."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum((c + q + block_size - 1) // block_size for c, q in seqs) + 3
    meta = make_meta(seqs, block_size, num_blocks, gen)
    k_cache = rand((num_blocks, block_size, hkv, head_dim), dtype, gen)
    v_cache = rand((num_blocks, block_size, hkv, head_dim), dtype, gen)
    query = rand((sum(q for _, q in seqs), hq, head_dim), dtype, gen)
    scale = head_dim ** -0.5
    tri, ref = TritonAttentionBackend(), TorchAttentionBackend(native=False)   # the SDPA reference
    # the step's own K/V, as if write_kv had just put them at their slots (torch reads them for fresh prefills)
    key, value = (c.view(-1, hkv, head_dim)[meta.slot_mapping] for c in (k_cache, v_cache))
    out = tri.forward(query, key, value, k_cache, v_cache, tri.prepare(meta), scale, **how)
    expected = ref.forward(query, key, value, k_cache, v_cache, ref.prepare(meta), scale, **how)
    return out, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1)])
def test_forward_mixed_batch_matches_torch(hq: int, hkv: int, block_size: int, dtype: torch.dtype) -> None:
    out, expected = run_both(MIXED, hq, hkv, 64, block_size, dtype)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("window,softcap", [(None, None), (6, 5.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_forward_with_a_sink_matches_torch(dtype, window, softcap) -> None:
    """Position 0's key and value plus the sink (an fp8 cache's own centre for it, layers/kv_rotation.py)."""
    sink = 3.0 * torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    gen = torch.Generator().manual_seed(9)
    meta = make_meta(MIXED, 8, 64, gen)
    k_cache, v_cache = (rand((64, 8, 2, 32), torch.float32, gen).to(dtype) for _ in range(2))
    query = rand((sum(q for _, q in MIXED), 4, 32), torch.float32, gen)
    tri = TritonAttentionBackend()
    key, value = (c.view(-1, 2, 32)[meta.slot_mapping] for c in (k_cache, v_cache))
    out = tri.forward(query, key, value, k_cache, v_cache, tri.prepare(meta), 32 ** -0.5, window=window,
                      softcap=softcap, sink=sink)
    want = dense_reference(query, k_cache.float(), v_cache.float(), meta, 32 ** -0.5, window, softcap, sink)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    plain = dense_reference(query, k_cache.float(), v_cache.float(), meta, 32 ** -0.5, window, softcap)
    assert (out - plain).abs().max() > 0.1


@pytest.mark.parametrize("window,softcap", [(6, None), (1, None), (None, 5.0), (6, 5.0)])
def test_forward_window_and_softcap_match_torch(window, softcap) -> None:
    """Sliding windows (shorter than some chunks' query tiles, and 1) and Gemma 2's soft-capping."""
    out, expected = run_both(MIXED, 4, 2, 32, 8, torch.float32, seed=7, window=window, softcap=softcap)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("head_dim", [128, 80], ids=["d128", "d80-non-pow2"])
def test_forward_head_dims(head_dim: int) -> None:
    out, expected = run_both([(9, 1), (0, 6), (11, 5)], 2, 1, head_dim, 16, torch.float32, seed=1)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("hq,hkv", [(6, 2), (3, 3)], ids=["gqa-g3", "mha"])
def test_forward_odd_group_sizes(hq: int, hkv: int) -> None:
    # G = 3 packs 5 tokens x 3 heads into 16 score rows (one padding row); G = 1 is plain MHA.
    out, expected = run_both([(4, 1), (0, 12), (7, 9)], hq, hkv, 32, 8, torch.float32, seed=2)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_forward_decode_only_and_tiles_cached() -> None:
    gen = torch.Generator().manual_seed(3)
    meta = make_meta([(7, 1), (30, 1), (0, 1)], 8, 12, gen)
    tile_seq, tile_qoff = TritonAttentionBackend().prepare(meta).tiles(16)
    assert tile_seq.tolist() == [0, 1, 2] and tile_qoff.tolist() == [0, 0, 0]
    out, expected = run_both([(7, 1), (30, 1), (0, 1)], 4, 4, 16, 8, torch.float32, seed=3)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_tile_bookkeeping() -> None:
    gen = torch.Generator().manual_seed(4)
    meta = make_meta([(0, 17), (5, 1), (2, 16)], 16, 8, gen)
    tm = TritonAttentionBackend().prepare(meta)
    tile_seq, tile_qoff = tm.tiles(8)
    assert tile_seq.tolist() == [0, 0, 0, 1, 2, 2]
    assert tile_qoff.tolist() == [0, 8, 16, 0, 0, 8]
    assert tm.tiles(8)[0] is tile_seq                        # cached for the rest of the step's layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_write_kv_matches_torch(block_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    meta = make_meta(MIXED, block_size, 40, gen)
    t = len(meta.slot_mapping)
    key, value = rand((t, 3, 24), dtype, gen), rand((t, 3, 24), dtype, gen)
    k0, v0 = rand((40, block_size, 3, 24), dtype, gen), rand((40, block_size, 3, 24), dtype, gen)
    kt, vt, kr, vr = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    TritonAttentionBackend().write_kv(key, value, kt, vt, TritonAttentionBackend().prepare(meta))
    TorchAttentionBackend().write_kv(key, value, kr, vr, TorchAttentionBackend().prepare(meta))
    assert torch.equal(kt, kr) and torch.equal(vt, vr)
    assert not torch.equal(kt, k0)


def test_write_kv_skips_padding_slots() -> None:
    gen = torch.Generator().manual_seed(6)
    meta = make_meta([(3, 4)], 8, 4, gen)
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((2,), -1, device=DEVICE)])  # 2 padding tokens
    key, value = rand((6, 2, 16), torch.float32, gen), rand((6, 2, 16), torch.float32, gen)
    k_cache, v_cache = torch.zeros(4, 8, 2, 16, device=DEVICE), torch.zeros(4, 8, 2, 16, device=DEVICE)
    TritonAttentionBackend().write_kv(key, value, k_cache, v_cache, TritonAttentionBackend().prepare(meta))
    slots = meta.slot_mapping[:4]
    assert torch.equal(k_cache.view(-1, 2, 16)[slots], key[:4])
    assert torch.equal(v_cache.view(-1, 2, 16)[slots], value[:4])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 4      # nothing else written, no wrap to slot -1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_write_then_forward_matches_torch(dtype: torch.dtype) -> None:
    """Full layer step: each backend writes this step's K/V into its own cache copy, then attends.
    The torch backend uses key/value directly for fresh prefills; Triton reads everything from the cache."""
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d, bs = 4, 2, 32, 8
    meta = make_meta(MIXED, bs, 24, gen)
    t = len(meta.slot_mapping)
    query, key, value = rand((t, hq, d), dtype, gen), rand((t, hkv, d), dtype, gen), rand((t, hkv, d), dtype, gen)
    k0, v0 = rand((24, bs, hkv, d), dtype, gen), rand((24, bs, hkv, d), dtype, gen)
    kt, vt, kr, vr = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    tri, ref = TritonAttentionBackend(), TorchAttentionBackend(native=False)   # the SDPA reference
    tm, rm = tri.prepare(meta), ref.prepare(meta)
    tri.write_kv(key, value, kt, vt, tm)
    ref.write_kv(key, value, kr, vr, rm)
    out = tri.forward(query, key, value, kt, vt, tm, 0.2)
    expected = ref.forward(query, key, value, kr, vr, rm, 0.2)
    assert torch.equal(kt, kr) and torch.equal(vt, vr)
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_rejects_bad_shapes() -> None:
    gen = torch.Generator().manual_seed(8)
    meta = make_meta([(0, 2)], 8, 2, gen)
    backend = TritonAttentionBackend()
    tm = backend.prepare(meta)
    cache = torch.zeros(2, 8, 2, 16, device=DEVICE)
    kv = torch.zeros(2, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        backend.forward(torch.zeros(2, 3, 16, device=DEVICE), kv, kv, cache, cache, tm, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        backend.forward(torch.zeros(2, 2, 32, device=DEVICE), kv, kv, cache, cache, tm, 1.0)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.25, 3.0)], ids=["unscaled", "scaled"])
def test_fp8_cache_write_then_forward_matches_torch(kv_dtype: torch.dtype, scales: tuple[float, float]) -> None:
    """An fp8 cache with per-layer k/v scales: both backends store the same bytes, and their outputs agree
    with each other and with fp32 attention over the values the cache gives back (scale * stored)."""
    gen = torch.Generator().manual_seed(9)
    hq, hkv, d, bs = 4, 2, 32, 8
    ks, vs = scales
    meta = make_meta(MIXED, bs, 24, gen)
    t = len(meta.slot_mapping)
    query, key, value = (rand((t, h, d), torch.float32, gen) for h in (hq, hkv, hkv))
    k0, v0 = (rand((24, bs, hkv, d), torch.float32, gen).to(kv_dtype) for _ in range(2))
    kt, vt, kr, vr = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    tri, ref = TritonAttentionBackend(), TorchAttentionBackend(native=False)   # the SDPA reference
    tm, rm = tri.prepare(meta), ref.prepare(meta)
    tri.write_kv(key, value, kt, vt, tm, ks, vs)
    ref.write_kv(key, value, kr, vr, rm, ks, vs)
    assert torch.equal(kt.view(torch.uint8), kr.view(torch.uint8)) and torch.equal(vt.view(torch.uint8), vr.view(torch.uint8))
    out = tri.forward(query, key, value, kt, vt, tm, 0.2, ks, vs)
    got = ref.forward(query, key, value, kr, vr, rm, 0.2, ks, vs)
    torch.testing.assert_close(out, got, **TOL[torch.float32])
    # the fp32 reference over what the cache holds: fresh prefills too read their K/V back through fp8
    kf, vf = kr.float() * ks, vr.float() * vs
    back_k = kf.view(-1, hkv, d)[meta.slot_mapping]
    back_v = vf.view(-1, hkv, d)[meta.slot_mapping]
    want = ref.forward(query, back_k, back_v, kf, vf, ref.prepare(meta), 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    exact_k, exact_v = kf.clone(), vf.clone()            # fp32 caches hold this step's K/V unrounded
    ref.write_kv(key, value, exact_k, exact_v, rm)
    exact = ref.forward(query, key, value, exact_k, exact_v, rm, 0.2)
    assert (got - exact).abs().max() > 1e-3, "the fp8 cache must really round"


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_cache_saturates_rather_than_overflowing(kv_dtype: torch.dtype) -> None:
    from gpu_worker.attention import to_cache
    top = torch.finfo(kv_dtype).max
    x = torch.tensor([1e6, -1e6, 3.0, 2 * top])
    assert to_cache(x, kv_dtype, 1.0).float().tolist() == [top, -top, 3.0, top]
    assert to_cache(x, kv_dtype, 4.0).float().tolist()[2] == 0.75
