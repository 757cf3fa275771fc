"""Issue #11: tensor parallelism over torch.distributed (gloo on this CPU). The split arithmetic, the
shard reads of each checkpoint format, the start-up checks, and greedy output of TP=2 equal to TP=1 on the
tiny Llama, Qwen2 (bias), Qwen3 (q/k norm), a GQA model with fewer KV heads than ranks and the default
model (its 3 KV-head groups split 1 + 2), under prefix caching, chunked prefill and preemption."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq
from gguf import GGMLQuantizationType as T

from common.protocol import Hello, encode
from common.tp_layout import check_tensor_parallel, even_split, head_shard, vocab_rows
from gpu_worker.quantization.gguf import GGUFTensor, unpermute_rope
from gpu_worker.weight_loader import weight_bytes
from pagedserve import LLM, SamplingParams
from scheduler.executor import WorkerDied, ZmqExecutor
from tests.gguf_files import gguf_tensor


# ---- the split ----------------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("heads,kv,size", [(4, 2, 2), (9, 3, 2), (9, 3, 3), (8, 8, 3), (4, 1, 2), (8, 2, 4),
                                           (16, 4, 8), (32, 8, 4)])
def test_every_query_head_is_on_one_rank_with_the_kv_head_it_reads(heads: int, kv: int, size: int) -> None:
    check_tensor_parallel("llama", heads, kv, size)
    per_group = heads // kv
    owners = []
    for rank in range(size):
        p = head_shard(heads, kv, size, rank)
        assert p.num_heads >= 1 and p.num_kv_heads >= 1
        assert p.num_heads // p.num_kv_heads == per_group or kv < size    # each rank keeps the GQA ratio
        for q in range(p.q_start, p.q_start + p.num_heads):
            assert p.kv_start <= q // per_group < p.kv_start + p.num_kv_heads, (rank, q, p)
            owners.append(q)
    assert sorted(owners) == list(range(heads))


@pytest.mark.unit
def test_splits_cover_everything_on_block_boundaries() -> None:
    assert even_split(1536, 2, 32) == [(0, 768), (768, 1536)]
    assert even_split(3, 2) == [(0, 1), (1, 3)]
    for n, parts, align in [(1536, 3, 32), (100, 3, 32), (5, 4, 1)]:
        cuts = even_split(n, parts, align)
        assert cuts[0][0] == 0 and cuts[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
        assert all(lo % align == 0 for lo, _ in cuts)
    assert [vocab_rows(49155, 2, r) for r in range(2)] == [(0, 24578), (24578, 49156)]   # last one padded


@pytest.mark.unit
@pytest.mark.parametrize("args,kw,message", [
    (("llama", 4, 2, 8), {}, "exceeds the model's 4 attention heads"),
    (("llama", 4, 2, 3), {}, "cannot split 4 query heads over 2 KV heads"),
    (("llama", 6, 2, 4), {}, "cannot split 6 query heads over 2 KV heads"),
    (("mixtral", 4, 2, 2), {}, "mixtral models"),
    (("llama", 4, 2, 2), {"lora": True}, "--enable-lora"),
    (("llama", 4, 2, 2), {"draft_model": True}, "draft model"),
    (("llama", 4, 2, 2), {"prequantized": "awq"}, "awq checkpoints"),
])
def test_what_cannot_be_split_is_one_clear_error(args, kw, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(*args, **kw)
    check_tensor_parallel(args[0] if args[0] != "mixtral" else "llama", 9, 3, 2)    # 2 + 1 groups: fine


# ---- shard reads ------------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("qtype,cols", [(T.Q4_1, (64, 192)), (T.Q8_0, (0, 96)), (T.Q4_K, (256, 512)),
                                        (T.Q4_K, (96, 320)), (T.Q6_K, (128, 256))])
def test_a_gguf_shard_reads_only_its_blocks_and_equals_the_slice_of_the_whole(qtype, cols) -> None:
    whole = gguf_tensor(qtype, 8, 512, seed=3)
    full = whole.dequantize()
    part = whole[2:6, cols[0]:cols[1]]
    got = part.dequantize() if isinstance(part, GGUFTensor) else part
    assert torch.equal(got, full[2:6, cols[0]:cols[1]])
    block = 32 if qtype in (T.Q4_1, T.Q8_0) else 256
    assert isinstance(part, GGUFTensor) == (cols[0] % block == 0 and cols[1] % block == 0)   # else dequantized
    if isinstance(part, GGUFTensor):
        assert np.shares_memory(part.stored, whole.stored)     # a view of the file's bytes, not a copy


@pytest.mark.unit
def test_a_shard_of_whole_rope_heads_is_unpermuted_like_the_whole() -> None:
    """llama.cpp interleaves each q/k head's rows; a rank's heads read from the stored (interleaved) bytes
    give the same rows as the whole tensor put back in HF's order."""
    stored = gguf_tensor(T.Q8_0, 16, 64, seed=5)
    whole = GGUFTensor(stored.stored, T.Q8_0, (16, 64), rope_heads=4)
    assert torch.equal(whole[4:12].dequantize(), whole.dequantize()[4:12])
    assert np.array_equal(whole.raw, unpermute_rope(stored.stored, 4))
    with pytest.raises(ValueError, match="cut a rope head"):
        whole[2:6]


# ---- start-up -----------------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_scheduler_names_the_ranks_that_never_came(tmp_path) -> None:
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/w.ipc"
    ex = ZmqExecutor(ctx, addr, num_workers=3, startup_timeout=1.0)
    rank0 = ctx.socket(zmq.DEALER)
    rank0.setsockopt(zmq.IDENTITY, b"worker-0")
    rank0.connect(addr)
    rank0.send(encode(Hello("worker-0")))
    try:
        with pytest.raises(WorkerDied, match=r"ranks 1, 2 of 3 never connected"):
            ex.initialize([])
    finally:
        rank0.close(0)
        ex.shutdown()
        ctx.term()


@pytest.mark.unit
def test_the_cli_refuses_groups_it_cannot_run(capsys, tiny_model, monkeypatch) -> None:
    from pagedserve import cli
    folder = str(tiny_model("llama"))                        # 4 heads, 2 KV heads
    monkeypatch.setattr(cli, "usable_cpus", lambda: 2)       # as this machine, whatever runs the test
    monkeypatch.setattr(cli, "_cuda", lambda: 0)

    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as e:
            cli.parse_args(cli.build_parser(), list(argv))
        assert e.value.code == 2
        return capsys.readouterr().err
    assert "cannot split 4 query heads over 2 KV heads" in refused("serve", folder, "-tp", "3")
    assert "needs 4 CPU cores on this machine for its ranks; 2 are available" in refused("serve", folder, "-tp", "4")
    assert "--scheduler-addr tcp://" in refused("serve", folder, "-tp", "2", "--local-ranks", "1")
    assert "--dist-init-addr" in refused("serve", folder, "-tp", "2", "--local-ranks", "1",
                                         "--scheduler-addr", "tcp://10.9.0.1:5570")
    assert "--dist-init-addr" in refused("worker", folder, "--world-size", "2", "--rank", "1")
    assert "outside a group of 2" in refused("worker", folder, "--world-size", "2", "--rank", "2",
                                             "--dist-init-addr", "10.9.0.1:29500")


# ---- TP=2 equals TP=1 -----------------------------------------------------------------------------------
MAX_NEW = 10
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of", "def fibonacci(n):\n",
         "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20",
         "Once upon a time there was a king who had three daughters, and the youngest of them was so beautiful"]
# a small cache (preemption), a small token budget (chunked prefill) and prefix caching (shared prompts)
PRESSURE = dict(dtype="float32", num_gpu_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


def _prompts(tokenizer) -> list[list[int]]:
    base = [tokenizer.encode(t) for t in TEXTS]
    return base + [base[4] + tokenizer.encode(" She lived in a castle."), list(base[4])]


def _greedy(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], object]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def _replicated_bytes(model: torch.nn.Module) -> int:
    """What every rank holds whole: the norms' weights and the rope tables (not Linear, not the embedding)."""
    from gpu_worker.layers.embedding import VocabEmbedding
    from gpu_worker.layers.linear import Linear
    return sum(t.numel() * t.element_size() for m in model.modules() if not isinstance(m, (Linear, VocabEmbedding))
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])


def _kv_proj_bytes(model: torch.nn.Module) -> int:
    """The K and V rows of every fused QKV projection held as plain weights."""
    out = 0
    for m in model.modules():
        if "weight" in getattr(getattr(m, "qkv_proj", None), "_parameters", {}):
            w = m.qkv_proj.weight
            rows = sum(hi - lo for s, (lo, hi) in m.qkv_proj.shard_ranges.items() if s in "kv")
            out += rows * w.shape[1] * w.element_size()
    return out


def _tp_pair(model: str | None, prompts: list[list[int]], **kw):
    one = LLM(model, **kw)
    want, _ = _greedy(one, prompts)
    ours = one.engine.executor.runner.model
    tp1_bytes = weight_bytes(ours), _replicated_bytes(ours), _kv_proj_bytes(ours)
    two = LLM(model, tensor_parallel_size=2, **kw)
    try:
        got, outs = _greedy(two, prompts)
        stats = two.stats
        infos = dict(two.engine.executor.infos)
    finally:
        two.shutdown()
    return want, got, outs, stats, infos, tp1_bytes


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {}),
                                            ("llama", {"num_key_value_heads": 1})],
                         ids=["llama", "qwen2-bias", "qwen3-qk-norm", "gqa-1-kv-head"])
def test_tp2_greedy_equals_tp1_under_caching_chunking_and_preemption(arch, overrides, default_tokenizer,
                                                                        tmp_path) -> None:
    from loadtest.tiny_model import build_tiny_model
    folder = str(build_tiny_model(tmp_path, arch, default_tokenizer, **overrides))
    prompts = _prompts(default_tokenizer)
    want, got, outs, stats, infos, tp1_bytes = _tp_pair(folder, prompts, **PRESSURE)
    assert got == want
    assert stats.num_preemptions > 0, "the cache was meant to be too small for the batch"
    assert any(o.num_cached_tokens > 0 for o in outs), "the shared prompts were meant to hit the prefix cache"
    # from the ranks' own reports: each holds exactly half of every sharded matrix (the embedding and the
    # lm_head by vocabulary rows) plus what is replicated (norms, rope tables; with 1 KV head for 2 ranks
    # also the K and V projections)
    total, replicated, kv = tp1_bytes
    if overrides:
        replicated += kv
    for rank in (0, 1):
        assert infos[rank].weight_bytes == (total - replicated) // 2 + replicated, (rank, infos[rank], tp1_bytes)
    assert replicated < 0.2 * total


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("quantization", ["auto", "none"])      # its Q4_1 blocks packed; expanded to fp32
def test_tp2_on_the_default_model_equals_tp1_with_its_groups_split_one_and_two(default_tokenizer,
                                                                                quantization: str) -> None:
    """SmolLM2-135M has 9 query heads over 3 KV heads: rank 0 takes one group (3 heads), rank 1 two; each
    rank's KV cache holds only its heads (a block of rank 1 is twice rank 0's). Its Q4_1 blocks stay packed
    on both ranks, or (`none`) each rank expands only its slices of the file."""
    prompts = _prompts(default_tokenizer)
    want, got, outs, stats, infos, tp1_bytes = _tp_pair(None, prompts, quantization=quantization, **PRESSURE)
    assert got == want
    assert stats.num_preemptions > 0 and any(o.num_cached_tokens > 0 for o in outs)
    assert infos[1].block_bytes == 2 * infos[0].block_bytes            # 1 KV head against 2
    total, replicated, _ = tp1_bytes
    sharded = [infos[r].weight_bytes - replicated for r in (0, 1)]
    assert sum(sharded) == total - replicated                          # every sharded byte on one rank only
    assert 0.4 < sharded[0] / (total - replicated) < 0.5 < sharded[1] / (total - replicated) < 0.6


@pytest.mark.unit
@pytest.mark.parametrize("dtype_1", ["float32", "bfloat16"])
def test_the_engine_runs_on_the_smallest_rank_and_refuses_ranks_with_other_flags(tmp_path, dtype_1: str) -> None:
    """Ranks report their own KV blocks (8 and 4 here): the engine gets the smaller. A rank started by hand
    on another host with another --dtype would compute garbage with the others: refused, naming the flag."""
    from common.protocol import WorkerInfo, WorkerInit, WorkerReady, decode
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/w.ipc"
    ex = ZmqExecutor(ctx, addr, num_workers=2, startup_timeout=5.0)
    ranks = []
    for rank, dtype in ((0, "float32"), (1, dtype_1)):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, f"worker-{rank}".encode())
        s.connect(addr)
        s.send(encode(Hello(f"worker-{rank}")))
        ranks.append((rank, dtype, s))
    try:
        import threading

        def answer() -> None:
            for rank, dtype, s in ranks:
                assert isinstance(decode(s.recv()), WorkerInit)
                s.send(encode(WorkerReady(rank, WorkerInfo(8 >> rank, 0, 64, 100, 1024,
                                                           engine_flags={"dtype": dtype}))))
        t = threading.Thread(target=answer)
        t.start()
        if dtype_1 == "float32":
            assert ex.initialize([]).num_blocks == 4
        else:
            with pytest.raises(WorkerDied, match=r"rank 1 runs with other engine flags than rank 0: dtype "
                                                 r"'bfloat16' \(rank 0: 'float32'\)"):
                ex.initialize([])
        t.join(10)
    finally:
        for *_, s in ranks:
            s.close(0)
        ex.shutdown()
        ctx.term()


@pytest.mark.unit
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q4_1, T.Q6_K])
def test_a_gguf_matrix_expanded_on_read_gives_the_slices_of_the_whole(qtype) -> None:
    """`--quantization none` on a GGUF (and types not kept packed): a rank expands only its rows/columns."""
    from gpu_worker.quantization.gguf import ExpandedOnRead
    if qtype in (T.F32, T.F16):
        values = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
        raw = values.astype(np.float16 if qtype == T.F16 else np.float32).view(np.uint8)
        whole = GGUFTensor(raw, qtype, (8, 512))
    else:
        whole = gguf_tensor(qtype, 8, 512, seed=2)
    lazy = ExpandedOnRead(whole)
    full = lazy.materialize()
    assert torch.equal(lazy[2:6], full[2:6])
    assert torch.equal(lazy[:, 96:320], full[:, 96:320])
    assert torch.equal(lazy[4:8, 256:512], full[4:8, 256:512])
