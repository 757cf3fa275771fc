"""The native CPU attention kernel (gpu_worker/kernels/paged_attention.cpp) against the torch backend's SDPA
path and a direct fp64 computation, on every cache dtype and instruction-set level this CPU has, in mixed
steps: decodes, short query runs behind a context (speculative verification), prefills."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.attention import to_cache
from gpu_worker.attention import cpu_attention
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.kernels import native
from tests.attention_cases import dense_reference, make_meta, rand

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
ISAS = [isa for isa, level in native.ISA_LEVELS.items() if level <= native.cpu_isa()] + \
    (["amx"] if native.cpu_isa() == native.ISA_LEVELS["avx512"] and native.amx_ready() else [])


def tolerance(isa: str, kv_dtype: torch.dtype, head_dim: int, tight: float = 2e-5) -> dict:
    """assert_close's tolerances: `tight`, except where AMX tiles run a bf16 cache, which round queries and
    weights to bf16 (test_amx_tiles_round_queries_and_weights_to_bf16_and_nothing_else checks that tightly)."""
    loose = isa == "amx" and kv_dtype == torch.bfloat16 and head_dim in (32, 64, 128)
    return {"atol": 1e-2, "rtol": 1e-2} if loose else {"atol": tight, "rtol": tight}


def step(seqs, hq, hkv, head_dim, block_size, kv_dtype, gen: torch.Generator, scale: float):
    """(meta, k_cache, v_cache, query, key, value) of a random step: the caches hold random entries divided
    by `scale` in `kv_dtype`, and the step's own key/value are what its slots hold."""
    num_blocks = sum((c + q + block_size - 1) // block_size for c, q in seqs) + 3
    meta = make_meta(seqs, block_size, num_blocks, gen, CPU)
    k_cache, v_cache = (to_cache(rand((num_blocks, block_size, hkv, head_dim), torch.float32, gen, CPU), kv_dtype,
                                 scale) for _ in range(2))
    query = rand((sum(q for _, q in seqs), hq, head_dim), torch.float32, gen, CPU)
    key, value = (c.view(-1, hkv, head_dim)[meta.slot_mapping].float() for c in (k_cache, v_cache))
    return meta, k_cache, v_cache, query, key, value


def run(seqs, hq, hkv, head_dim, block_size, kv_dtype, native_on: bool, seed: int = 0, **how) -> torch.Tensor:
    meta, k_cache, v_cache, query, key, value = step(seqs, hq, hkv, head_dim, block_size, kv_dtype,
                                                     torch.Generator().manual_seed(seed), 0.5)
    backend = TorchAttentionBackend(native=native_on)
    prepared = backend.prepare(meta)
    assert (prepared.native is not None) == (native_on and any(cpu_attention.takes(q, c + q) for c, q in seqs))
    return backend.forward(query, key, value, k_cache, v_cache, prepared, head_dim ** -0.5, 0.5, 0.5, **how)


@pytest.mark.skipif(not native.available(), reason="the native kernels are not built")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("seqs", [[(20, 1), (0, 1), (33, 1), (5, 1)], [(20, 1), (0, 19), (13, 7), (5, 1), (40, 1)],
                                  [(20, 5), (0, 1), (70, 9), (13, 16), (5, 17), (0, 3)]],
                         ids=["decodes-only", "mixed", "verify-runs"])
def test_native_decode_matches_sdpa(seqs, kv_dtype, isa, force_isa):
    force_isa(isa)
    for hq, hkv, d in ((4, 2, 64), (9, 3, 64), (8, 1, 32), (4, 4, 20), (2, 1, 128)):
        got = run(seqs, hq, hkv, d, 16, kv_dtype, True)
        want = run(seqs, hq, hkv, d, 16, kv_dtype, False)
        torch.testing.assert_close(got, want, **tolerance(isa, kv_dtype, d))


@pytest.mark.skipif(not native.available(), reason="the native kernels are not built")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window,softcap", [(7, None), (None, 4.0), (7, 4.0)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=lambda d: str(d).split(".")[-1])
def test_native_decode_window_and_softcap_match_sdpa(window, softcap, kv_dtype, isa, force_isa):
    force_isa(isa)
    seqs = [(20, 1), (0, 1), (33, 1), (5, 1), (6, 1), (30, 6), (3, 9)]
    got = run(seqs, 4, 2, 64, 16, kv_dtype, True, window=window, softcap=softcap)
    want = run(seqs, 4, 2, 64, 16, kv_dtype, False, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, **tolerance(isa, kv_dtype, 64))


@pytest.mark.skipif(not native.available(), reason="the native kernels are not built")
def test_native_decode_is_used_by_default_on_the_cpu():
    assert TorchAttentionBackend().prepare(make_meta([(3, 1)], 16, 4, torch.Generator(), CPU)).native is not None


@pytest.mark.skipif(not native.available(), reason="the native kernels are not built")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window,softcap", [(None, None), (45, None), (40, 3.0)])
@pytest.mark.parametrize("head_dim", [64, 16, 20])
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("seqs", [[(100, 4), (0, 1), (64, 1), (37, 16), (200, 1), (31, 2)], [(700, 1)], [(650, 5)],
                                  [(250, 16), (380, 16)]],
                         ids=["batch", "long-decode", "long-run", "runs-across-chunks"])
def test_native_runs_across_chunks_match_fp64(seqs, block_size, window, softcap, head_dim, isa, force_isa):
    """Contexts of several blocks of 8 or 32, windows that start anywhere, query runs of 1..16 tokens:
    against the attention written out per token in fp64. Long sequences split their keys into chunks (128
    keys), merged; a run across a chunk boundary has rows that see nothing of the later one."""
    force_isa(isa)
    gen = torch.Generator().manual_seed(3)
    num_blocks = sum((c + q + block_size - 1) // block_size for c, q in seqs) + 4
    meta = make_meta(seqs, block_size, num_blocks, gen, CPU)
    k_cache, v_cache = (rand((num_blocks, block_size, 2, head_dim), torch.float32, gen, CPU) for _ in range(2))
    query = rand((sum(q for _, q in seqs), 6, head_dim), torch.float32, gen, CPU)
    nr = cpu_attention.prepare(meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.query_lens_list,
                               list(range(len(seqs))), every_row=True)
    got = cpu_attention.attend(query, k_cache, v_cache, nr, head_dim ** -0.5, window, softcap)
    want = dense_reference(query, k_cache, v_cache, meta, head_dim ** -0.5, window, softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 3.0)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("native_on", [True, False], ids=["native", "sdpa"])
def test_a_sink_is_added_to_position_0_on_every_path(native_on, kv_dtype, window, softcap, isa, force_isa):
    """An fp8 cache stores position 0 around a centre of its own and the readers add the difference
    (layers/kv_rotation.py): decodes, runs behind a context, fresh prefills and a chunk behind a context of
    20 keys (SDPA's gather path), against fp64 with the sink added to each sequence's first entry."""
    if native_on and not native.available():
        pytest.skip("the native kernels are not built")
    force_isa(isa)
    seqs = [(20, 1), (0, 1), (33, 1), (0, 9), (13, 5), (20, 18), (300, 1)]
    gen = torch.Generator().manual_seed(11)
    hkv, d = 2, 64
    meta, k_cache, v_cache, query, key, value = step(seqs, 6, hkv, d, 16, kv_dtype, gen, 1.0)
    sink = 3.0 * rand((2, hkv, d), torch.float32, gen, CPU)
    backend = TorchAttentionBackend(native=native_on)
    got = backend.forward(query, key, value, k_cache, v_cache, backend.prepare(meta), d ** -0.5, window=window,
                          softcap=softcap, sink=sink)
    want = dense_reference(query, k_cache.float(), v_cache.float(), meta, d ** -0.5, window, softcap, sink)
    torch.testing.assert_close(got, want, **tolerance(isa if native_on else "", kv_dtype, d))
    plain = dense_reference(query, k_cache.float(), v_cache.float(), meta, d ** -0.5, window, softcap)
    assert (got - plain).abs().max() > 0.1          # the sink moved the outputs of rows that see position 0


def _attend_at(k_cache, v_cache, query_rows, tables, lens, runs, window):
    """Kernel output for sequences with block tables `tables`, lengths `lens` and `runs` query tokens each."""
    q_start = torch.zeros(len(runs) + 1, dtype=torch.int32)
    q_start[1:] = torch.tensor(runs).cumsum(0)
    nr = cpu_attention.NativeRuns(None, tables, torch.tensor(lens, dtype=torch.int32), q_start)
    return cpu_attention.attend(query_rows, k_cache, v_cache, nr, 0.125, window)


@pytest.mark.skipif(not native.available(), reason="the native kernels are not built")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("head_dim", [64, 16])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tokens_attention_is_bit_identical_alone_among_drafts_and_in_any_batch(window, head_dim, kv_dtype, isa,
                                                                                 force_isa):
    """Greedy speculation is exact only if a token's attention does not depend on how it is run: decoded
    alone, as one of a verification run of 5, or beside 7 other sequences (which changes how the kernel
    shares its work between threads, and reads all kv heads of a key together). Positions around the
    chunk boundaries (multiples of 128 keys) and in the middle of 4-key groups."""
    force_isa(isa)
    gen = torch.Generator().manual_seed(5)
    hkv, hq, bs = 3, 9, 16
    k_cache, v_cache = (rand((400, bs, hkv, head_dim), torch.float32, gen, CPU).to(kv_dtype) for _ in range(2))
    table = torch.randperm(400, generator=gen)[:48].to(torch.int32)            # 768 keys
    others = torch.randperm(400, generator=gen)[:48 * 7].to(torch.int32).view(7, 48)
    queries = rand((768, hq, head_dim), torch.float32, gen, CPU)               # the query of each position
    for pos in (31, 32, 127, 128, 255, 256, 301, 511, 512, 702):
        alone = _attend_at(k_cache, v_cache, queries[pos:pos + 1], table[None], [pos + 1], [1], window)
        for j in range(5):                                                      # pos as run row j of 5
            run = _attend_at(k_cache, v_cache, queries[pos - j:pos - j + 5], table[None], [pos - j + 5], [5], window)
            assert torch.equal(run[j], alone[0]), (pos, j)
        tables = torch.cat([table[None], others])
        q = torch.cat([queries[pos:pos + 1], rand((7, hq, head_dim), torch.float32, gen, CPU)])
        batch = _attend_at(k_cache, v_cache, q, tables, [pos + 1] + [500] * 7, [1] * 8, window)
        assert torch.equal(batch[0], alone[0]), pos


def _rounded_like_tiles(query, k_cache, v_cache, meta, scale: float, window: int | None) -> torch.Tensor:
    """Attention as the AMX path defines it, in fp64 otherwise: each query times `scale` rounded to bf16;
    per chunk of keys (by position) the weights e^(s - the chunk's max) rounded to bf16 before they
    multiply the values, their sum taken unrounded; chunks merged by e^(max - overall max)."""
    bf = lambda x: x.to(torch.bfloat16).double()              # noqa: E731
    chunk = native.library().psq_attention_chunk()
    hkv, d = k_cache.shape[-2:]
    group = query.shape[1] // hkv
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for i, (ctx, length) in enumerate(zip(meta.context_lens.tolist(), meta.seq_lens_list)):
        pos = torch.arange(length)
        slots = meta.block_tables[i, pos // meta.block_size].long() * meta.block_size + pos % meta.block_size
        k = k_cache.reshape(-1, hkv, d)[slots].double().repeat_interleave(group, dim=1)     # [L, Hq, D]
        v = v_cache.reshape(-1, hkv, d)[slots].double().repeat_interleave(group, dim=1)
        for j, row in enumerate(range(starts[i], starts[i + 1])):
            p = ctx + j
            lo = 0 if window is None else max(0, p - window + 1)
            s = torch.einsum("hd,thd->ht", bf(query[row].double() * scale), k[:p + 1])
            parts = []
            for c0 in range(0, p + 1, chunk):
                a, b = max(c0, lo), min(c0 + chunk, p + 1)
                if a >= b:
                    continue
                m = s[:, a:b].max(-1, keepdim=True).values
                e = (s[:, a:b] - m).exp()
                parts.append((m, e.sum(-1, keepdim=True), torch.einsum("ht,thd->hd", bf(e), v[a:b])))
            top = torch.stack([m for m, _, _ in parts]).max(0).values
            w = [(m - top).exp() for m, _, _ in parts]
            out[row] = (sum(acc * x for (_, _, acc), x in zip(parts, w)) /
                        sum(l * x for (_, l, _), x in zip(parts, w))).to(query.dtype)
    return out


@pytest.mark.skipif("amx" not in ISAS, reason="this CPU has no AMX-BF16 tiles the process may use")
@pytest.mark.parametrize("window", [None, 45])
@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (4, 1, 32), (2, 2, 128), (18, 1, 64)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_amx_tiles_round_queries_and_weights_to_bf16_and_nothing_else(block_size, hq, hkv, head_dim, window,
                                                                      force_isa):
    """The tile path on a bf16 cache against its definition: mixed decodes, runs of 2..16 query rows
    (18 query heads over one kv head: 288 rows, more than one 16-row pass), contexts across key
    chunks, block sizes whose 16-key tiles are and are not runs of one block. Against the plain fp64
    attention the mean error is about 3e-4; against this definition it is about 1e-7, except where a
    weight lies at a bf16 rounding boundary and the fp32 and fp64 sums round it apart: one bf16 step of
    one weight, at most about 3e-4 here."""
    force_isa("amx")
    gen = torch.Generator().manual_seed(7)
    seqs = [(100, 4), (0, 1), (64, 1), (37, 16), (300, 1), (31, 2), (250, 16), (13, 7)]
    num_blocks = sum((c + q + block_size - 1) // block_size for c, q in seqs) + 4
    meta = make_meta(seqs, block_size, num_blocks, gen, CPU)
    k_cache, v_cache = (rand((num_blocks, block_size, hkv, head_dim), torch.float32, gen, CPU).to(torch.bfloat16)
                        for _ in range(2))
    query = rand((sum(q for _, q in seqs), hq, head_dim), torch.float32, gen, CPU)
    nr = cpu_attention.prepare(meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.query_lens_list,
                               list(range(len(seqs))), every_row=True)
    got = cpu_attention.attend(query, k_cache, v_cache, nr, head_dim ** -0.5, window)
    want = _rounded_like_tiles(query, k_cache, v_cache, meta, head_dim ** -0.5, window)
    plain = dense_reference(query, k_cache.float(), v_cache.float(), meta, head_dim ** -0.5, window)
    err, plain_err = (got - want).abs(), (got - plain).abs()
    assert err.mean() < 1e-6 < 1e-4 < plain_err.mean(), (err.mean(), plain_err.mean())
    assert err.max() < 1e-3


@pytest.mark.skipif(not native.available(), reason="the native kernels are not built")
@pytest.mark.parametrize("case", ["amx", "avx512", "fp32-cache", "head-20", "torch-only"])
def test_prefills_run_in_bf16_exactly_where_the_tiles_run_a_bf16_cache(case, monkeypatch, force_isa):
    """cpu_attention.prefill_dtype: with AMX, a bf16 cache and a head size the tiles take, a prefill's SDPA
    (a fresh prompt, and a chunk behind a context) runs on bf16 queries, keys and values: within bf16's
    error of fp64, and visibly off fp32's. Everywhere else it stays in fp32 (the vector loops' ISA, the
    exact mode's fp32 cache, other head sizes, the pure-torch backend). AMX is simulated where the CPU
    lacks it (bf16 SDPA runs anywhere); the step has no decodes, so the kernel itself never runs."""
    if case == "avx512":
        force_isa("avx512")
    else:
        monkeypatch.setattr(native, "attention_isa", lambda: native.AMX)
    d = 20 if case == "head-20" else 64
    kv_dtype = torch.float32 if case == "fp32-cache" else torch.bfloat16
    seqs = [(0, 40), (50, 30)]
    meta, k_cache, v_cache, query, key, value = step(seqs, 6, 2, d, 16, kv_dtype, torch.Generator().manual_seed(5), 1.0)
    backend = TorchAttentionBackend(native=case != "torch-only")
    got = backend.forward(query, key, value, k_cache, v_cache, backend.prepare(meta), d ** -0.5)
    want = dense_reference(query, k_cache.float(), v_cache.float(), meta, d ** -0.5)
    if case == "amx":
        assert 1e-4 < (got.double() - want.double()).abs().max().item() < 2e-2
    else:
        torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=2e-5)
