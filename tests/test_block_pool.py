"""BlockPool and KVCacheManager: reference counts, LRU eviction of cached blocks, chained prefix hashes,
copy-on-write after a fork, swap bookkeeping, and hypothesis-driven random operation sequences that
check the pool's accounting (and the KV content a block holds) after every step."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from common.sampling_params import SamplingParams
from scheduler.block_pool import BlockPool
from scheduler.kv_cache_manager import KVCacheManager, cdiv
from scheduler import block_hash
from scheduler.block_hash import BlockHasher
from scheduler.sequence import Sequence

pytestmark = pytest.mark.unit


def make_req(seq_id: str, tokens: list[int], prompt_logprobs: int | None = None) -> Sequence:
    sp = SamplingParams(max_tokens=64, prompt_logprobs=prompt_logprobs)
    return Sequence(seq_id=seq_id, request_id=seq_id, index=0, prompt_token_ids=list(tokens), sampling_params=sp,
                   max_tokens=64, eos_token_ids=frozenset())


def compute(kv: KVCacheManager, req: Sequence, n: int,
            hits: list[int] | None = None) -> tuple[list[tuple[int, int]], int]:
    """Allocate room for n more tokens (taking prefix hits if given), mark them computed, register full blocks."""
    if hits:
        req.num_computed_tokens = len(hits) * kv.block_size
    alloc = kv.allocate_slots(req, n, hits or [])
    assert alloc is not None
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)
    return alloc


def free_order(pool: BlockPool) -> list[int]:
    return pool.free_block_ids()


# ---- BlockPool -------------------------------------------------------------------------------------
def test_pool_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_takes_free_blocks_in_order_with_ref_count_one() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert [pool.ref_count(b) for b in range(pool.num_blocks)] == [1, 1, 0, 0]
    assert pool.num_free == 2
    assert pool.usage == pytest.approx(0.5)


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(MemoryError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert [pool.ref_count(b) for b in range(pool.num_blocks)] == [1, 1, 0]


def test_free_returns_block_and_double_free_raises() -> None:
    pool = BlockPool(2)
    (bid,) = pool.allocate(1)
    pool.free([bid])
    assert pool.ref_count(bid) == 0
    assert pool.num_free == 2
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([bid])
    assert pool.ref_count(bid) == 0
    with pytest.raises(RuntimeError):
        pool.free([1])  # never allocated


def test_incref_shares_a_block_until_every_reference_is_dropped() -> None:
    pool = BlockPool(2)
    (bid,) = pool.allocate(1)
    pool.incref([bid])
    assert pool.ref_count(bid) == 2
    pool.free([bid])
    assert pool.ref_count(bid) == 1
    assert not pool.is_free(bid)
    pool.free([bid])
    assert pool.is_free(bid)


def test_freed_cached_block_stays_findable_until_reallocated() -> None:
    pool = BlockPool(2)
    (bid,) = pool.allocate(1)
    pool.cache_block(bid, 1234)
    pool.free([bid])
    assert pool.lookup(1234) == bid
    assert pool.block_hash(bid) == 1234
    pool.allocate(1)                   # takes the never-used block first (it was freed earlier)
    assert pool.lookup(1234) == bid
    assert pool.allocate(1) == [bid]   # now the cached block is evicted
    assert pool.lookup(1234) is None
    assert pool.block_hash(bid) is None


def test_eviction_takes_least_recently_freed_block_first() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(4)
    for bid in ids:
        pool.cache_block(bid, 100 + bid)
    for bid in (2, 0, 3, 1):
        pool.free([bid])
    assert free_order(pool) == [2, 0, 3, 1]
    assert pool.allocate(1) == [2]
    assert pool.lookup(102) is None
    assert [pool.lookup(100 + b) for b in (0, 1, 3)] == [0, 1, 3]
    assert pool.allocate(2) == [0, 3]
    assert pool.lookup(101) == 1


def test_prefix_hit_revives_a_free_block_and_refreeing_moves_it_to_the_back() -> None:
    pool = BlockPool(3)
    ids = pool.allocate(3)
    for bid in ids:
        pool.cache_block(bid, 100 + bid)
    pool.free([0, 1, 2])
    pool.incref([pool.lookup(100)])      # a prefix hit takes block 0 out of the free queue
    assert pool.ref_count(0) == 1
    assert free_order(pool) == [1, 2]
    pool.free([0])                       # most recently freed: evicted last
    assert free_order(pool) == [1, 2, 0]
    assert pool.allocate(2) == [1, 2]
    assert pool.lookup(100) == 0


def test_cache_block_first_writer_wins_and_evicting_a_duplicate_keeps_the_original() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, 7)
    pool.cache_block(b, 7)               # same content computed twice
    assert pool.lookup(7) == a
    pool.cache_block(a, 8)               # an already hashed block keeps its hash
    assert pool.block_hash(a) == 7
    pool.free([b])
    pool.allocate(1)                     # block 2 (freed at start)
    assert pool.allocate(1) == [b]       # evicting the duplicate must not drop the original's entry
    assert pool.lookup(7) == a


def test_pool_without_caching_never_finds_anything() -> None:
    pool = BlockPool(2, enable_caching=False)
    (bid,) = pool.allocate(1)
    pool.cache_block(bid, 5)
    assert pool.lookup(5) is None
    pool.free([bid])
    assert pool.block_hash(bid) is None


def test_reset_prefix_cache_forgets_every_hash() -> None:
    pool = BlockPool(2)
    (bid,) = pool.allocate(1)
    pool.cache_block(bid, 5)
    pool.reset_prefix_cache()
    assert pool.lookup(5) is None
    assert pool.block_hash(bid) is None


# ---- KVCacheManager: allocation and freeing --------------------------------------------------------
def test_allocate_slots_grows_the_table_one_block_per_block_size_tokens() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_req("a", list(range(10)))
    copies, first = compute(kv, req, 10)
    assert (copies, first) == ([], 0)
    assert kv.table("a") == [0, 1, 2]
    req.output_token_ids += [50, 51]
    assert compute(kv, req, 2) == ([], 3)          # positions 10, 11 still fit block 2
    assert kv.table("a") == [0, 1, 2]
    req.output_token_ids += [52]
    assert compute(kv, req, 1) == ([], 3)          # position 12 opens block 3
    assert kv.table("a") == [0, 1, 2, 3]
    kv.check_invariants()


def test_allocate_slots_returns_none_when_the_pool_is_too_small() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = make_req("a", list(range(12)))
    assert kv.allocate_slots(req, 12) is None
    assert "a" not in kv.on_device()                    # no empty table left behind
    assert kv.num_free_blocks == 2
    assert kv.allocate_slots(req, 8) is not None   # a chunk that fits
    assert kv.allocate_slots(make_req("b", [1]), 1) is None
    kv.check_invariants()


def test_free_returns_a_sequence_tail_first_so_its_tail_is_evicted_first() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7])
    compute(kv, a, 6)
    assert kv.table("a") == [0, 1, 2]
    kv.free(a)
    assert free_order(kv.pool) == [2, 1, 0]
    c = make_req("c", [50, 51])
    compute(kv, c, 2)
    assert kv.table("c") == [2]                    # the tail is reused first
    b = make_req("b", [1, 2, 3, 4, 9])
    assert kv.get_computed_blocks(b) == [0, 1]     # the head of the freed sequence is still cached
    compute(kv, make_req("d", [60, 61]), 2)
    assert kv.get_computed_blocks(b) == [0]
    kv.free(a)                                     # freeing an already freed sequence is a no-op
    kv.check_invariants()


# ---- KVCacheManager: prefix caching ------------------------------------------------------------------
def test_identical_prefix_hits_all_full_blocks_and_shares_them() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 113))                 # 13 tokens: 3 full blocks + 1
    a = make_req("a", prompt)
    compute(kv, a, 13)
    b = make_req("b", prompt)
    hits = kv.get_computed_blocks(b)
    assert hits == kv.table("a")[:3]
    compute(kv, b, 1, hits)                        # only the last token is computed
    assert b.num_computed_tokens == 13
    assert kv.table("b")[:3] == kv.table("a")[:3]
    assert kv.table("b")[3] != kv.table("a")[3]
    assert [kv.pool.ref_count(i) for i in kv.table("a")] == [2, 2, 2, 1]
    kv.check_invariants()


def test_full_prompt_cache_hit_still_leaves_the_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(8))                        # exactly two full blocks
    compute(kv, make_req("a", prompt), 8)
    assert len(kv.pool.cached_block_ids()) == 2
    b = make_req("b", prompt)
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 1                          # the block holding the last token is never a hit
    assert b.num_tokens - len(hits) * 4 >= 1
    one_more = make_req("c", prompt + [99])
    assert len(kv.get_computed_blocks(one_more)) == 2


def test_chained_hashes_a_different_earlier_block_changes_every_later_hash() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(kv, a, 9)
    b = make_req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])   # block 1 holds the same tokens, block 0 differs
    assert kv.get_computed_blocks(b) == []
    ha, hb = a.full_block_hashes(4, 8, kv.hasher), b.full_block_hashes(4, 8, kv.hasher)
    assert ha[1] != hb[1] and ha[1].digest != hb[1].digest
    hasher = BlockHasher("sha256")
    assert ha[0] == hasher(b"", [1, 2, 3, 4])
    assert ha[1] == hasher(ha[0].digest, [5, 6, 7, 8])
    c = make_req("c", [1, 2, 3, 4, 0, 6, 7, 8, 9])   # differs in block 1 only: block 0 still hits
    assert kv.get_computed_blocks(c) == kv.table("a")[:1]


def test_prefix_hits_on_freed_blocks_revive_them_and_count_against_free_space() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(9))
    a = make_req("a", prompt)
    compute(kv, a, 9)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_req("b", prompt + list(range(50, 58)))   # 17 tokens: 2 hits + 3 new blocks > 4
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2
    b.num_computed_tokens = 8
    assert kv.allocate_slots(b, 9, hits) is None      # the revived hits need room too
    assert "b" not in kv.on_device() and kv.num_free_blocks == 4
    assert all(kv.pool.ref_count(h) == 0 for h in hits)
    b.num_computed_tokens = 0
    c = make_req("c", prompt + [50, 51, 52])          # 12 tokens: 2 hits + 1 new
    hits = kv.get_computed_blocks(c)
    compute(kv, c, 4, hits)
    assert kv.table("c")[:2] == hits
    assert [kv.pool.ref_count(h) for h in hits] == [1, 1]
    assert kv.num_free_blocks == 1
    kv.check_invariants()


def test_no_prefix_hits_when_caching_is_disabled_or_prompt_logprobs_are_asked() -> None:
    prompt = list(range(9))
    off = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    compute(off, make_req("a", prompt), 9)
    assert off.get_computed_blocks(make_req("b", prompt)) == []
    on = KVCacheManager(num_blocks=8, block_size=4)
    compute(on, make_req("a", prompt), 9)
    assert on.get_computed_blocks(make_req("b", prompt, prompt_logprobs=1)) == []
    assert len(on.get_computed_blocks(make_req("c", prompt))) == 2


def test_only_full_computed_blocks_are_registered() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(11)))
    compute(kv, a, 6)                               # chunked prefill: block 1 half written
    assert kv.pool.cached_block_ids() == {kv.table("a")[0]}
    compute(kv, a, 5)
    assert kv.pool.cached_block_ids() == set(kv.table("a")[:2])


# ---- KVCacheManager: fork and copy-on-write ------------------------------------------------------------
def fork_after_prefill(kv: KVCacheManager, prompt_len: int) -> tuple[Sequence, Sequence]:
    """A parent whose prompt is computed and first token sampled, and the sibling forked from it, which
    recomputes the last prompt token to sample its own."""
    parent = make_req("p", list(range(prompt_len)))
    compute(kv, parent, prompt_len)
    parent.output_token_ids.append(40)
    child = make_req("p#1", list(range(prompt_len)))
    child.num_computed_tokens = prompt_len - 1
    kv.fork(parent, child)
    return parent, child


def test_fork_shares_every_block_and_copies_on_the_first_write() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = fork_after_prefill(kv, 6)
    b0, b1 = kv.table("p")
    assert kv.table("p#1") == [b0, b1]
    assert kv.pool.ref_count(b0) == kv.pool.ref_count(b1) == 2
    kv.check_invariants()

    copies, first = kv.allocate_slots(child, 1)    # writes position 5, inside shared block 1
    (src, dst), = copies
    assert src == b1 and first == 1
    assert kv.table("p#1") == [b0, dst]
    assert kv.pool.ref_count(b1) == 1 and kv.pool.ref_count(dst) == 1
    assert kv.pool.ref_count(b0) == 2           # the untouched block stays shared

    assert kv.allocate_slots(parent, 1) == ([], 2)   # block 1 is the parent's alone now: no copy
    assert kv.table("p") == [b0, b1]
    kv.check_invariants()
    kv.free(child)
    kv.free(parent)
    assert kv.num_free_blocks == 8


def test_copy_on_write_of_a_full_cached_block_is_reregistered_without_stealing_the_hash() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = fork_after_prefill(kv, 8)
    (src, dst), = kv.allocate_slots(child, 1)[0]
    child.num_computed_tokens = 8
    kv.cache_full_blocks(child)
    assert kv.pool.block_hash(dst) == kv.pool.block_hash(src)
    assert kv.pool.lookup(kv.pool.block_hash(src)) == src
    kv.check_invariants()


def test_copy_on_write_fails_cleanly_without_a_free_block() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    parent = make_req("p", list(range(6)))
    compute(kv, parent, 6)
    child = make_req("p#1", list(range(6)))
    child.num_computed_tokens = 5
    kv.fork(parent, child)
    before = list(kv.table("p#1"))
    assert kv.allocate_slots(child, 1) is None
    assert kv.table("p#1") == before
    kv.check_invariants()


# ---- KVCacheManager: swapping ------------------------------------------------------------------------
def test_swap_out_and_in_bookkeeping() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, num_host_blocks=3)
    req = make_req("a", list(range(7)))
    compute(kv, req, 7)
    dev = kv.table("a")
    assert kv.can_swap_out(req)
    pairs = kv.swap_out(req)
    assert [d for d, _ in pairs] == dev
    host = [h for _, h in pairs]
    assert kv.host_table("a") == host and len(set(host)) == 2
    assert "a" not in kv.on_device()
    assert kv.num_free_blocks == 6 and kv.num_free_host_blocks == 1
    kv.check_invariants()

    assert kv.can_swap_in(req, 1)
    back = kv.swap_in(req)
    assert [h for h, _ in back] == host            # host blocks come back in table order
    assert kv.table("a") == [d for _, d in back]
    assert "a" not in kv.swapped_out() and kv.num_free_host_blocks == 3
    assert kv.num_free_blocks == 4
    req.output_token_ids.append(1)
    assert kv.allocate_slots(req, 1) == ([], 2)    # position 7 still fits block 1
    kv.check_invariants()


def test_swap_needs_room_on_both_sides() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=1)
    req = make_req("a", list(range(7)))
    compute(kv, req, 7)
    assert not kv.can_swap_out(req)                # 2 device blocks, 1 host block
    kv2 = KVCacheManager(num_blocks=3, block_size=4, num_host_blocks=4)
    a = make_req("a", list(range(8)))
    compute(kv2, a, 8)
    kv2.swap_out(a)
    other = make_req("b", list(range(100, 108)))
    compute(kv2, other, 8)
    assert not kv2.can_swap_in(a, 1)               # needs 2 (+1 for position 8) of 1 free
    kv2.free(other)
    assert kv2.can_swap_in(a, 1)
    assert not kv2.can_swap_in(a, 9)               # 17 tokens need 5 blocks


def test_freeing_a_swapped_sequence_returns_its_host_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=4)
    req = make_req("a", list(range(9)))
    compute(kv, req, 9)
    kv.swap_out(req)
    assert kv.num_free_host_blocks == 1
    kv.free(req)
    assert kv.num_free_host_blocks == 4 and kv.num_free_blocks == 4
    kv.check_invariants()


def test_swapping_out_a_forked_child_leaves_the_parent_blocks_alone() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=4)
    parent = make_req("p", list(range(6)))
    compute(kv, parent, 6)
    child = make_req("p#1", list(range(6)))
    child.num_computed_tokens = 5
    kv.fork(parent, child)
    pairs = kv.swap_out(child)
    assert [d for d, _ in pairs] == kv.table("p")
    assert all(kv.pool.ref_count(b) == 1 for b in kv.table("p"))
    back = kv.swap_in(child)
    assert not set(d for _, d in back) & set(kv.table("p"))   # the child comes back with its own blocks
    kv.check_invariants()


def test_a_new_token_inside_a_cached_block_copies_it_first() -> None:
    """A fork of a fork holds a cached full block [1, 2, 3, 4] but only its first three tokens, then
    samples 1000 at position 3: writing that in place would make the prefix cache hand [1, 2, 3, 1000]
    to the next prompt [1, 2, 3, 4, ...] (found by the property test below). The block is copied; a
    sequence rewriting the same tokens (a fork recomputing its last one) is not."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    parent = make_req("p", [1, 2, 3, 4, 5, 6])
    compute(kv, parent, 4)
    cached = kv.table("p")[0]
    child = make_req("p#1", [1, 2, 3, 4])
    child.num_computed_tokens = 3
    kv.fork(parent, child)
    kv.free(parent)
    copies, _ = kv.allocate_slots(child, 1)          # the same token 4 at position 3: no copy
    assert copies == [] and kv.table("p#1")[0] == cached
    grandchild = make_req("p#1#1", [1, 2, 3])
    grandchild.num_computed_tokens = 2
    kv.fork(child, grandchild)
    kv.free(child)
    copies, first = compute(kv, grandchild, 1)     # it lacks token 4, so it cannot keep the cached block
    assert copies == [(cached, kv.table("p#1#1")[0])] and first == 0
    grandchild.output_token_ids.append(1000)
    assert kv.allocate_slots(grandchild, 1) == ([], 1)   # its own copy now: written in place
    assert kv.get_computed_blocks(make_req("q", [1, 2, 3, 4, 5, 6])) == [cached]
    kv.check_invariants()


# ---- property tests -------------------------------------------------------------------------------
BS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7, 7, 7, 7, 7], []]


@dataclass
class Seq:
    req: Sequence
    state: str = "waiting"                 # waiting | running | swapped
    children: int = 0


class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions (with prefix hits), chunked steps, decodes, forks, frees, recompute and swap
    preemptions and swap-ins, through KVCacheManager. Besides the pool accounting, it keeps what each
    device and host block holds ((position, token) per slot) and checks that every sequence reads its
    own tokens back through its block table: prefix hits, copy-on-write and swapping must all preserve
    the KV content."""

    @initialize(num_blocks=st.integers(2, 14), num_host=st.integers(0, 10), caching=st.booleans(),
                prompts=st.lists(st.tuples(st.integers(0, len(PREFIXES) - 1),
                                           st.lists(st.integers(20, 23), max_size=9)), min_size=2, max_size=8))
    def setup(self, num_blocks: int, num_host: int, caching: bool, prompts: list[tuple[int, list[int]]]) -> None:
        self.kv = KVCacheManager(num_blocks, BS, enable_caching=caching, num_host_blocks=num_host)
        self.seqs: list[Seq] = []
        self.dev: dict[int, dict[int, tuple[int, int]]] = {}
        self.host: dict[int, dict[int, tuple[int, int]]] = {}
        self.next_id = 0
        self.next_token = 1000
        for prefix, tail in prompts:
            self.add(prefix, tail)

    # -- helpers --
    def _pick(self, i: int, state: str) -> Seq | None:
        cands = [s for s in self.seqs if s.state == state]
        return cands[i % len(cands)] if cands else None

    def _write(self, req: Sequence, start: int, n: int) -> None:
        table = self.kv.table(req.seq_id)
        tokens = req.all_token_ids
        for pos in range(start, start + n):
            self.dev.setdefault(table[pos // BS], {})[pos % BS] = (pos, tokens[pos])

    def _check_reads(self, req: Sequence) -> None:
        table = self.kv.table(req.seq_id)
        tokens = req.all_token_ids
        for pos in range(req.num_computed_tokens):
            got = self.dev.get(table[pos // BS], {}).get(pos % BS)
            assert got == (pos, tokens[pos]), f"{req.seq_id} reads {got} at position {pos}"

    def _run(self, seq: Seq, n: int, hits: list[int] | None = None) -> bool:
        """Allocate and compute n tokens of seq; sample one if it reaches its end. False if no room."""
        req = seq.req
        alloc = self.kv.allocate_slots(req, n, hits or [])
        if alloc is None:
            if hits:
                req.num_computed_tokens = 0
            return False
        for src, dst in alloc[0]:
            event("copy-on-write")
            self.dev[dst] = dict(self.dev.get(src, {}))
        self._check_reads(req)
        start = req.num_computed_tokens
        self._write(req, start, n)
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(self.next_token)
            self.next_token += 1
        self.kv.cache_full_blocks(req)
        return True

    # -- rules --
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), tail=st.lists(st.integers(20, 23), max_size=9))
    def add(self, prefix: int, tail: list[int]) -> None:
        tokens = PREFIXES[prefix] + tail
        if not tokens:
            tokens = [42]
        self.seqs.append(Seq(make_req(f"r{self.next_id}", tokens)))
        self.next_id += 1

    @rule(i=st.integers(0, 50), chunk=st.integers(1, 12))
    def admit(self, i: int, chunk: int) -> None:
        seq = self._pick(i, "waiting")
        if seq is None:
            return
        req = seq.req
        hits = self.kv.get_computed_blocks(req)
        if not self.kv.enable_caching:
            assert hits == []
        assert len(hits) * BS < req.num_tokens
        req.num_computed_tokens = len(hits) * BS
        if hits:
            event("prefix hit")
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        if self._run(seq, n, hits):
            seq.state = "running"

    @rule(i=st.integers(0, 50), chunk=st.integers(1, 12))
    def step(self, i: int, chunk: int) -> None:
        seq = self._pick(i, "running")
        if seq is None:
            return
        n = min(chunk, seq.req.num_tokens - seq.req.num_computed_tokens)
        self._run(seq, n)

    @rule(i=st.integers(0, 50), run_child=st.booleans())
    def fork(self, i: int, run_child: bool) -> None:
        cands = [s for s in self.seqs if s.state == "running" and s.req.num_computed_tokens >= 1]
        if not cands:
            event("fork: no candidate")
            return
        event("fork")
        parent = cands[i % len(cands)]
        parent.children += 1
        # like the scheduler's n > 1 fork: the child holds the parent's computed tokens and recomputes the
        # last one to sample its own continuation
        tokens = parent.req.all_token_ids[:parent.req.num_computed_tokens]
        child = make_req(f"{parent.req.seq_id}#{parent.children}", tokens)
        child.num_computed_tokens = len(tokens) - 1
        self.kv.fork(parent.req, child)
        self.seqs.append(Seq(child, "running"))
        if run_child:
            self._run(self.seqs[-1], 1)    # writes into the shared last block: copy-on-write

    @rule(i=st.integers(0, 50))
    def finish_or_abort(self, i: int) -> None:
        if not self.seqs:
            return
        seq = self.seqs.pop(i % len(self.seqs))
        self.kv.free(seq.req)

    @rule(i=st.integers(0, 50))
    def preempt_recompute(self, i: int) -> None:
        seq = self._pick(i, "running")
        if seq is None:
            return
        self.kv.free(seq.req)
        seq.req.num_computed_tokens = 0
        seq.state = "waiting"

    @rule(i=st.integers(0, 50))
    def preempt_swap(self, i: int) -> None:
        seq = self._pick(i, "running")
        if seq is None or not self.kv.can_swap_out(seq.req):
            return
        for d, h in self.kv.swap_out(seq.req):
            self.host[h] = dict(self.dev.get(d, {}))
        seq.state = "swapped"
        event("swap out")

    @rule(i=st.integers(0, 50), chunk=st.integers(1, 12))
    def swap_in(self, i: int, chunk: int) -> None:
        seq = self._pick(i, "swapped")
        if seq is None:
            return
        req = seq.req
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        if not self.kv.can_swap_in(req, n):
            return
        for h, d in self.kv.swap_in(req):
            self.dev[d] = dict(self.host.get(h, {}))
        seq.state = "running"
        event("swap in")
        assert self._run(seq, n), "can_swap_in promised room for the step"

    # -- checks --
    @invariant()
    def accounting_holds(self) -> None:
        self.kv.check_invariants()
        on_device = {s.req.seq_id for s in self.seqs if s.state == "running"}
        assert self.kv.on_device() == on_device
        assert self.kv.swapped_out() == {s.req.seq_id for s in self.seqs if s.state == "swapped"}
        for s in self.seqs:
            if s.state == "running":
                assert len(self.kv.table(s.req.seq_id)) >= cdiv(s.req.num_computed_tokens, BS)
                self._check_reads(s.req)

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self) -> None:
        for bid in self.kv.pool.cached_block_ids():   # (hash index consistency: check_invariants)
            assert len(self.dev.get(bid, {})) == BS, "a block was registered before it was full"

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for seq in self.seqs:
            self.kv.free(seq.req)
        self.kv.check_all_free()


KVCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestKVCacheManagerProperties = KVCacheMachine.TestCase


# ---- cache keys (issue #14): a digest collision must never share KV ---------------------------------

def _colliding(monkeypatch) -> None:
    """Every block digest becomes the same 32 bytes: the worst collision an attacker could craft."""
    monkeypatch.setattr(block_hash, "_digest_fn", lambda algo: (lambda data: b"\x00" * 32))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "blake2b"])
def test_every_hash_algo_hits_the_same_tokens_and_misses_others(algo: str) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, hash_algo=algo)
    a = make_req("a", list(range(9)))
    compute(kv, a, 9)
    assert kv.get_computed_blocks(make_req("same", list(range(9)))) == kv.table("a")[:2]
    assert kv.get_computed_blocks(make_req("other", [9, *range(1, 9)])) == []


def test_colliding_digests_never_share_blocks_and_the_same_tokens_still_hit(monkeypatch) -> None:
    _colliding(monkeypatch)
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(kv, a, 9)
    b = make_req("b", [4, 3, 2, 1, 8, 7, 6, 5, 9])      # every block's digest equals a's
    assert b.full_block_hashes(4, 8, kv.hasher)[0].digest == a.full_block_hashes(4, 8, kv.hasher)[0].digest
    assert kv.get_computed_blocks(b) == []
    compute(kv, b, 9)                                     # b's own blocks are cached beside a's
    assert set(kv.table("b")[:2]).isdisjoint(kv.table("a"))
    assert kv.get_computed_blocks(make_req("a2", a.prompt_token_ids)) == kv.table("a")[:2]
    assert kv.get_computed_blocks(make_req("b2", b.prompt_token_ids)) == kv.table("b")[:2]
    # same tokens in block 1 behind a different block 0: the parent digest is compared too
    c = make_req("c", [1, 2, 3, 4, 8, 7, 6, 5, 9])
    assert kv.get_computed_blocks(c) == kv.table("a")[:1]


def test_a_collision_under_another_adapter_does_not_share(monkeypatch) -> None:
    _colliding(monkeypatch)
    hasher = BlockHasher()
    base, lora = hasher(hasher.root(None), [1, 2, 3, 4]), hasher(hasher.root(7), [1, 2, 3, 4])
    assert base.digest == lora.digest and base != lora      # the roots differ, so the keys do


def test_the_digest_is_sha256_over_parent_and_tokens() -> None:
    import hashlib
    from array import array
    h = BlockHasher("sha256")(b"", [5, 6])
    assert h.digest == hashlib.sha256(b"\x00" + array("q", [5, 6]).tobytes()).digest()
    a, b = BlockHasher("blake2b"), BlockHasher("blake2b")
    assert a(b"", [5, 6]).digest != b(b"", [5, 6]).digest   # keyed per hasher (per process)


def test_a_forked_choices_continuation_is_found_behind_the_shared_prompt() -> None:
    """n > 1: a choice's own blocks chain to the prompt's cached keys, so a later request continuing that
    choice hits the prompt and the choice's block (the identity walk of get_computed_blocks)."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    parent = make_req("p", [1, 2, 3, 4, 5, 6, 7, 8])
    compute(kv, parent, 8)
    child = make_req("p#1", parent.prompt_token_ids)
    kv.fork(parent, child)
    child.num_computed_tokens = 8
    child.output_token_ids = [9, 10, 11, 12]
    compute(kv, child, 4)
    later = make_req("later", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert kv.get_computed_blocks(later) == kv.table("p#1")[:3]


def test_a_fork_holding_a_shorter_prefix_does_not_take_the_parent_s_key_for_a_block_it_lacks() -> None:
    """The parent's prompt [1..8] has a key for [1, 2, 3, 4]; a child forked after three tokens holds
    [1, 2, 3] and samples 1000 at position 3. If it took the parent's key for block 0, its block
    [1, 2, 3, 1000] would be cached as [1, 2, 3, 4] and served to the next [1..8] prompt (found by the
    property test on CI)."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    parent = make_req("p", list(range(1, 9)))
    assert kv.get_computed_blocks(parent) == []        # hashes the parent's prompt blocks
    compute(kv, parent, 3)
    child = make_req("p#1", [1, 2, 3])
    child.num_computed_tokens = 2
    kv.fork(parent, child)
    compute(kv, child, 1)
    child.output_token_ids.append(1000)
    compute(kv, child, 1)
    kv.cache_full_blocks(child)
    kv.free(parent)
    kv.free(child)
    assert kv.get_computed_blocks(make_req("q", list(range(1, 9)))) == []
    assert kv.get_computed_blocks(make_req("q2", [1, 2, 3, 1000, 5])) != []
    kv.check_invariants()
