"""Scheduler behaviour, driven without a model: a fake runner mirrors what the real worker does with a
SchedulerOutput (per-request token lists and block tables, the swap/copy operations, one sampled token
for every request that reaches the end of its known tokens) and also simulates the KV cache, one
(position, token) record per slot. In every step, once the step's writes are done (as in each attention
layer, which writes the whole step's K/V before any read), it checks that each scheduled request reads
its own tokens back through its block table, so prefix caching (including hits on blocks filled in the
same step), copy-on-write and preemption by recompute and by swap are all checked for KV correctness,
not only for bookkeeping."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.lora import AdapterInfo
from common.protocol import EngineOutput, EngineRequest, ModelRunnerOutput, SchedulerOutput
from common.sampling_params import SamplingParams
from scheduler.sequence import Status
from scheduler.admission import RequestRejected
from scheduler.config import SchedulerConfig
from scheduler.lora_registry import LoRAAdapter
from scheduler.scheduler import Scheduler

pytestmark = pytest.mark.unit

EOS = 2
SlotRecord = tuple[int, int, int, int]   # (position, token, adapter key, KV group) written into one KV slot


def default_token(seq_id: str, position: int) -> int:
    """The fake model's deterministic sample for the token at `position`: never EOS or a small id."""
    return 100 + zlib.crc32(f"{seq_id}@{position}".encode()) % 900


@dataclass
class WorkerState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    lora_id: int = 0


def fake_adapter(key: int) -> LoRAAdapter:
    return LoRAAdapter(f"adapter-{key}", key, f"/adapters/{key}", None, AdapterInfo(8, 1.0, ()))


class FakeRunner:
    """The worker's side of the protocol, with the KV cache reduced to what each slot was written with."""

    def __init__(self, scheduler: Scheduler, script: dict[str, list[int]] | None = None, num_drafts: int = 0):
        self.scheduler = scheduler
        self.num_drafts = num_drafts       # > 0: propose this many drafts after every sample
        self.bs = scheduler.config.block_size
        self.windows = scheduler.config.kv_group_windows    # the table's KV groups (common/kv_layout.py)
        self.script = script or {}         # seq_id -> tokens to sample, in order, before default_token
        self.reqs: dict[str, WorkerState] = {}
        self.dev: dict[int, dict[int, SlotRecord]] = {}
        self.host: dict[int, dict[int, SlotRecord]] = {}
        self.num_kv_checks = 0
        self.num_lookahead_checks = 0
        self.tables_seen: list[tuple[int, ...]] = []
        self.lora_slots: dict[int, int] = {}   # slot -> adapter key, as the scheduler's loads filled them
        self.reqs_lora: dict[str, int] = {}    # seq_id -> its adapter key, kept after it finishes

    def sample(self, seq_id: str, st: WorkerState, index: int | None = None) -> int:
        """The fake model's choice for token `index` (default: the next one) of the sequence."""
        index = len(st.token_ids) if index is None else index
        k = index - st.num_prompt_tokens
        scripted = self.script.get(seq_id, [])
        return scripted[k] if k < len(scripted) else default_token(seq_id, index)

    def propose(self, seq_id: str, st: WorkerState) -> list[int]:
        """Drafts as a proposer would guess them: the fake model's real next tokens, except that some are
        deliberately wrong, so both acceptance and rollback happen."""
        drafts = []
        for j in range(self.num_drafts):
            index = len(st.token_ids) + j
            wrong = zlib.crc32(f"{seq_id}#{index}".encode()) % 3 == 0
            drafts.append(7 if wrong else self.sample(seq_id, st, index))
        return drafts

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for seq_id in sched.finished_seq_ids:
            self.reqs.pop(seq_id, None)
        for d, h in sched.blocks_to_swap_out:
            self.host[h] = dict(self.dev.get(d, {}))
        for s, d in sched.blocks_to_copy:
            self.dev[d] = dict(self.dev.get(s, {}))
        for h, d in sched.blocks_to_swap_in:
            self.dev[d] = dict(self.host.get(h, {}))
        for r in sched.new_seqs:
            assert r.seq_id not in self.reqs, f"{r.seq_id} sent as new while the worker holds it"
            assert r.num_prompt_tokens <= len(r.token_ids)
            assert r.seq_id not in sched.spec_token_ids, "drafts for a sequence the worker does not hold"
            self.reqs[r.seq_id] = WorkerState(list(r.token_ids), r.num_prompt_tokens, list(r.block_ids),
                                              r.num_computed_tokens, r.lora_id)
            self.reqs_lora[r.seq_id] = r.lora_id
        for r in sched.cached_seqs:
            st = self.reqs[r.seq_id]
            recompute = self.scheduler.config.long_rope_after is not None and r.num_computed_tokens == 0
            assert st.num_computed_tokens == r.num_computed_tokens or recompute, \
                f"{r.seq_id}: worker and scheduler disagree"
            st.num_computed_tokens = r.num_computed_tokens
            assert 0 <= r.blocks_from <= len(st.block_ids)
            del st.block_ids[r.blocks_from:]
            st.block_ids.extend(r.block_ids)

        scheduled = [(r.seq_id, r.num_new_tokens) for r in sched.new_seqs + sched.cached_seqs]
        assert len({rid for rid, _ in scheduled}) == len(scheduled), "a request scheduled twice in one step"
        self.check_lora_slots(sched, [self.reqs[seq_id].lora_id for seq_id, _ in scheduled])
        drafts = {seq_id: sched.spec_token_ids.get(seq_id, []) for seq_id, _ in scheduled}
        for seq_id, n in scheduled:
            st = self.reqs[seq_id]
            table = self.scheduler.kv.table(seq_id)
            self.tables_seen.append(tuple(table))
            # a released entry (-1) need not reach the worker: nothing reads it again
            assert len(st.block_ids) == len(table) and all(b in (w, -1) for w, b in zip(st.block_ids, table)), \
                f"{seq_id}: worker block table is stale"
            assert n >= 1 and st.num_computed_tokens + n <= len(st.token_ids) + len(drafts[seq_id])
            assert not drafts[seq_id] or st.num_computed_tokens + n == len(st.token_ids) + len(drafts[seq_id])
            assert len(st.block_ids) // len(self.windows) * self.bs >= st.num_computed_tokens + n, \
                f"{seq_id}: no slot to write"
            self.check_lookahead(seq_id, st, n)

        # Like every attention layer: the whole step's K/V is written first, then each request reads its
        # context and its new tokens back (a request may hit blocks another one fills in this same step).
        for seq_id, n in scheduled:
            st = self.reqs[seq_id]
            known = st.token_ids + drafts[seq_id]
            for g in range(len(self.windows)):
                table = st.block_ids[g::len(self.windows)]
                for pos in range(st.num_computed_tokens, st.num_computed_tokens + n):
                    self.dev.setdefault(table[pos // self.bs], {})[pos % self.bs] = (pos, known[pos], st.lora_id, g)
        for seq_id, n in scheduled:
            st = self.reqs[seq_id]
            self.check_context(seq_id, st, st.num_computed_tokens + n, st.token_ids + drafts[seq_id])

        out = ModelRunnerOutput(step_id=sched.step_id)
        for seq_id, n in scheduled:
            st = self.reqs[seq_id]
            if st.num_computed_tokens + n < len(st.token_ids):
                st.num_computed_tokens += n    # a prefill chunk short of the end samples nothing
                continue
            kept = []
            for d in drafts[seq_id] + [None]:    # greedy verification: keep through the first mismatch
                kept.append(self.sample(seq_id, st, len(st.token_ids) + len(kept)))
                if kept[-1] != d:
                    break
            st.token_ids += kept
            st.num_computed_tokens = len(st.token_ids) - 1
            out.seq_ids.append(seq_id)
            out.sampled_token_ids.append(kept)
            if self.num_drafts:
                out.spec_token_ids[seq_id] = self.propose(seq_id, st)
        return out

    def check_lookahead(self, seq_id: str, st: WorkerState, n: int) -> None:
        """A step that samples has the configured lookahead slots past its tokens (a draft model writes its
        drafts there), up to the longest the sequence can become."""
        k, end = self.scheduler.config.spec_lookahead_slots, st.num_computed_tokens + n
        seq = self.scheduler.seqs.get(seq_id)
        if k and seq is not None and end >= len(st.token_ids):
            want = min(end + k, seq.num_prompt_tokens + seq.max_tokens, self.scheduler.config.max_model_len)
            have = len(st.block_ids) // len(self.windows)
            assert have * self.bs >= want, f"{seq_id}: {have} blocks, no lookahead to {want}"
            self.num_lookahead_checks += 1

    def check_lora_slots(self, sched: SchedulerOutput, keys: list[int]) -> None:
        """Every adapter of the step sits in a slot once the step's loads are applied; a load never
        replaces an adapter this step uses, and there are never more slots than max_loras."""
        max_loras = self.scheduler.config.max_loras
        used = set(keys) - {0}
        for slot, key, _ in sched.lora_loads:
            assert 0 <= slot < max_loras, f"slot {slot} of max_loras {max_loras}"
            assert self.lora_slots.get(slot) not in used, f"slot {slot} refilled while this step uses its adapter"
            self.lora_slots[slot] = key
        assert used <= set(self.lora_slots.values()), f"adapters {used - set(self.lora_slots.values())} have no slot"

    def check_context(self, seq_id: str, st: WorkerState, end: int, tokens: list[int]) -> None:
        """Every position the request attends to (its context and this step's tokens) holds its own token,
        in each KV group: all of them for full attention, from the window of the step's first token on
        for a windowed group (the blocks before it may be released)."""
        for g, window in enumerate(self.windows):
            table = st.block_ids[g::len(self.windows)]
            first = 0 if window is None else max(0, st.num_computed_tokens - window + 1)
            for pos in range(first, end):
                got = self.dev.get(table[pos // self.bs], {}).get(pos % self.bs)
                want = (pos, tokens[pos], st.lora_id, g)
                assert got == want, f"{seq_id}: group {g} KV at position {pos} holds {got}, expected {want}"
        self.num_kv_checks += 1


def check_scheduler_state(s: Scheduler) -> None:
    s.kv.check_invariants()
    c = s.config
    for r in s.running:            # a windowed group holds the window behind a step plus the step, no more
        for held, w in zip(s.kv.blocks_held(r.seq_id), c.kv_group_windows):
            if w is not None:
                bound = -(-(w - 1 + c.max_num_batched_tokens + c.spec_lookahead_slots) // c.block_size) + 1
                assert held <= bound, f"{r.seq_id}: {held} blocks in a window-{w} group, bound {bound}"
    on_device, swapped_out = s.kv.on_device(), s.kv.swapped_out()
    for r in s.running:
        assert r.status is Status.RUNNING and r.seq_id in on_device
    for r in s.swapped:
        assert r.status is Status.SWAPPED and r.seq_id in swapped_out and r.seq_id not in on_device
    for r in s.waiting:
        assert r.status is Status.WAITING and r.seq_id not in on_device and r.seq_id not in swapped_out
    live = [r.seq_id for r in list(s.running) + list(s.swapped) + list(s.waiting)]
    assert len(live) == len(set(live))
    assert on_device <= set(live) and swapped_out <= set(live)
    assert len(s.running) <= s.config.max_num_seqs


@dataclass
class SeqResult:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0


class Harness:
    """A scheduler, its fake runner, and the outputs collected per (request_id, index)."""

    def __init__(self, script: dict[str, list[int]] | None = None, eos: list[int] | None = None,
                 pipelined: bool = False, num_drafts: int = 0, **config):
        self.sched = Scheduler(SchedulerConfig(speculative=num_drafts > 0, **config), [EOS] if eos is None else eos)
        self.runner = FakeRunner(self.sched, script, num_drafts)
        self.results: dict[tuple[str, int], SeqResult] = {}
        self.steps: list[SchedulerOutput] = []
        # pipelined: like the scheduler process, step N+1 is scheduled (and run, in order) before N's results
        self.in_flight_after_step = 1 if pipelined else 0
        self.inflight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []

    def add(self, request_id: str, prompt: list[int], lora: LoRAAdapter | None = None, **sp) -> None:
        sp.setdefault("max_tokens", 8)
        self.sched.add_request(EngineRequest(request_id, prompt, SamplingParams(**sp)), lora)

    def collect(self, outs: list[EngineOutput]) -> None:
        for o in outs:
            r = self.results.setdefault((o.request_id, o.index), SeqResult())
            assert r.finish_reason is None, f"{o.request_id}/{o.index} got output after finishing"
            r.tokens += o.new_token_ids
            r.num_cached_tokens, r.num_prompt_tokens = o.num_cached_tokens, o.num_prompt_tokens
            if o.finish_reason is not None:
                r.finish_reason, r.stop_reason = o.finish_reason, o.stop_reason

    def step(self) -> SchedulerOutput:
        sched = self.sched.schedule()
        c = self.sched.config
        assert sched.total_num_tokens <= c.max_num_batched_tokens
        assert len(sched.new_seqs) + len(sched.cached_seqs) <= c.max_num_seqs
        self.steps.append(sched)
        self.inflight.append((sched, self.runner.execute(sched)))
        while len(self.inflight) > self.in_flight_after_step:
            self.collect(self.sched.update_from_output(*self.inflight.pop(0)))
            check_scheduler_state(self.sched)
        return sched

    @staticmethod
    def step_seq_ids(sched: SchedulerOutput) -> list[str]:
        return [r.seq_id for r in sched.new_seqs + sched.cached_seqs]

    def flush(self) -> None:
        while self.inflight:
            self.collect(self.sched.update_from_output(*self.inflight.pop(0)))

    def abort(self, request_ids: list[str], indexes: list[int] | None = None) -> None:
        self.collect(self.sched.abort_requests(request_ids, indexes))
        check_scheduler_state(self.sched)

    def run(self, max_steps: int = 2000) -> dict[tuple[str, int], SeqResult]:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished(), "the scheduler made no progress"
        self.flush()
        self.step()   # flushes the last finished ids to the worker
        self.flush()
        self.assert_all_free()
        assert not self.runner.reqs, f"worker still holds {sorted(self.runner.reqs)}"
        return self.results

    def assert_all_free(self) -> None:
        self.sched.kv.check_all_free()
        assert not self.sched.has_unfinished() and self.sched.num_unfinished_requests == 0


def prompt(seed: int, n: int) -> list[int]:
    return [10 + zlib.crc32(f"{seed}:{i}".encode()) % 80 for i in range(n)]


def scheduled_tokens(sched: SchedulerOutput) -> dict[str, int]:
    return {r.seq_id: r.num_new_tokens for r in sched.new_seqs + sched.cached_seqs}


def expected_tokens(seq_id: str, prompt_len: int, n: int) -> list[int]:
    return [default_token(seq_id, prompt_len + k) for k in range(n)]


# ---- budget and ordering ---------------------------------------------------------------------------
def test_token_budget_and_max_num_seqs_are_respected_every_step() -> None:
    h = Harness(max_num_batched_tokens=20, max_num_seqs=3, block_size=4, num_blocks=64)
    for i in range(7):
        h.add(f"r{i}", prompt(i, 5 + 3 * i), max_tokens=4 + i)
    while h.sched.has_unfinished():
        sched = h.step()
        assert sched.total_num_tokens <= 20
        assert len(scheduled_tokens(sched)) <= 3
        assert len(h.sched.running) <= 3
    results = h.run()
    assert max(s.total_num_tokens for s in h.steps) == 20    # the budget was actually the limit
    for i in range(7):
        assert results[(f"r{i}", 0)].tokens == expected_tokens(f"r{i}", 5 + 3 * i, 4 + i)
        assert results[(f"r{i}", 0)].finish_reason == "length"


def test_running_requests_are_served_before_waiting_ones() -> None:
    h = Harness(max_num_batched_tokens=4, block_size=4, num_blocks=32)
    h.add("a", prompt(0, 12), max_tokens=3)
    assert scheduled_tokens(h.step()) == {"a": 4}
    h.add("b", prompt(1, 6), max_tokens=2)
    assert scheduled_tokens(h.step()) == {"a": 4}            # the running chunk takes the whole budget
    assert [r.seq_id for r in h.sched.waiting] == ["b"]
    assert scheduled_tokens(h.step()) == {"a": 4}
    s = h.step()                                             # a decodes, b gets what is left
    assert scheduled_tokens(s) == {"a": 1, "b": 3}
    assert [r.seq_id for r in s.cached_seqs] == ["a"] and [r.seq_id for r in s.new_seqs] == ["b"]
    results = h.run()
    assert results[("a", 0)].tokens == expected_tokens("a", 12, 3)
    assert results[("b", 0)].tokens == expected_tokens("b", 6, 2)


def test_chunked_prefill_splits_a_long_prompt_while_decodes_keep_running() -> None:
    h = Harness(max_num_batched_tokens=16, block_size=4, num_blocks=64)
    h.add("dec", prompt(0, 5), max_tokens=12)
    h.step()                                                 # dec's prefill
    h.add("long", prompt(1, 50), max_tokens=2)
    chunks = []
    while not h.results.get(("long", 0)):
        s = h.step()
        got = scheduled_tokens(s)
        assert got["dec"] == 1, "the decode must run in every step of the long prefill"
        chunks.append(got["long"])
        assert s.total_num_tokens == min(16, 1 + 50 - sum(chunks[:-1]))
    assert chunks == [15, 15, 15, 5]                         # no sample before the last chunk
    assert len(h.results[("dec", 0)].tokens) == 5
    results = h.run()
    assert results[("long", 0)].tokens == expected_tokens("long", 50, 2)
    assert results[("dec", 0)].tokens == expected_tokens("dec", 5, 12)


def test_mixed_prefill_and_decode_in_one_step() -> None:
    h = Harness(max_num_batched_tokens=64, block_size=4, num_blocks=64)
    h.add("a", prompt(0, 7), max_tokens=4)
    h.step()
    h.add("b", prompt(1, 9), max_tokens=4)
    s = h.step()
    assert [(r.seq_id, r.num_new_tokens, r.num_computed_tokens) for r in s.cached_seqs] == [("a", 1, 7)]
    assert [(r.seq_id, r.num_new_tokens, r.num_computed_tokens) for r in s.new_seqs] == [("b", 9, 0)]
    assert s.new_seqs[0].token_ids == prompt(1, 9) and len(s.new_seqs[0].block_ids) == 3
    assert s.cached_seqs[0].blocks_from == 2 and len(s.cached_seqs[0].block_ids) == 0   # position 7 fits block 1
    s = h.step()
    assert s.cached_seqs[0].seq_id == "a" and s.cached_seqs[0].blocks_from == 2
    assert len(s.cached_seqs[0].block_ids) == 1              # position 8 opens block 2
    h.run()


# ---- preemption ------------------------------------------------------------------------------------
def reference_outputs(requests: list[tuple[str, list[int], dict]]) -> dict[tuple[str, int], SeqResult]:
    """What the workload produces with room to spare: no preemption, nothing shared under pressure."""
    h = Harness(max_num_batched_tokens=256, block_size=4, num_blocks=512, max_loras=3)
    for rid, p, sp in requests:
        h.add(rid, p, **sp)
    return h.run()


def grow_until_preempted(h: Harness) -> SchedulerOutput:
    for _ in range(200):
        s = h.step()
        if s.finished_seq_ids and h.sched.stats.num_preemptions:
            return s
    raise AssertionError("no preemption happened")


PREEMPT_WORKLOAD = [(f"r{i}", prompt(i, 6), {"max_tokens": 14}) for i in range(3)]


def test_preemption_by_recompute_takes_the_newest_running_request() -> None:
    h = Harness(max_num_batched_tokens=64, block_size=4, num_blocks=12)
    for rid, p, sp in PREEMPT_WORKLOAD:
        h.add(rid, p, **sp)
    s = grow_until_preempted(h)
    assert s.finished_seq_ids == ["r2"]                      # newest running one goes first
    assert not s.blocks_to_swap_out
    (victim,) = [r for r in h.sched.waiting if r.seq_id == "r2"]
    assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
    assert "r2" not in h.sched.kv.on_device()
    assert h.sched.waiting[0] is victim                      # it goes back to the front of the queue
    stats = h.sched.stats
    assert stats.num_recompute_preemptions == stats.num_preemptions >= 1
    assert stats.num_swap_preemptions == 0
    results = h.run()
    assert results == reference_outputs(PREEMPT_WORKLOAD)    # same tokens as with room to spare
    assert all(r.finish_reason == "length" and len(r.tokens) == 14 for r in results.values())


def test_preemption_by_swap_when_host_blocks_allow() -> None:
    h = Harness(max_num_batched_tokens=64, block_size=4, num_blocks=12, num_host_blocks=16)
    for rid, p, sp in PREEMPT_WORKLOAD:
        h.add(rid, p, **sp)
    s = grow_until_preempted(h)
    assert s.finished_seq_ids == ["r2"]
    victim = h.sched.swapped[0]
    assert victim.seq_id == "r2" and victim.status is Status.SWAPPED
    assert victim.num_computed_tokens > 0                    # its progress is kept on the host
    assert len(s.blocks_to_swap_out) == len(h.sched.kv.host_table("r2"))
    stats = h.sched.stats
    assert stats.num_swap_preemptions == stats.num_preemptions >= 1
    assert stats.num_recompute_preemptions == 0
    results = h.run()
    swap_ins = [s for s in h.steps if s.blocks_to_swap_in]
    assert swap_ins, "the swapped request never came back"
    assert any(r.seq_id == "r2" for r in swap_ins[0].new_seqs)   # resent in full after the swap-in
    assert results == reference_outputs(PREEMPT_WORKLOAD)
    assert h.runner.num_kv_checks > 0


def test_swap_falls_back_to_recompute_when_the_host_is_too_small() -> None:
    h = Harness(max_num_batched_tokens=64, block_size=4, num_blocks=12, num_host_blocks=1)
    for rid, p, sp in PREEMPT_WORKLOAD:
        h.add(rid, p, **sp)
    s = grow_until_preempted(h)
    assert not s.blocks_to_swap_out and not h.sched.swapped
    assert h.sched.stats.num_recompute_preemptions >= 1 and h.sched.stats.num_swap_preemptions == 0
    assert h.run() == reference_outputs(PREEMPT_WORKLOAD)


def test_preempted_requests_with_chunked_prefill_and_prefix_hits_complete_correctly() -> None:
    shared = prompt(99, 16)
    work = [(f"r{i}", shared + prompt(i, 3 + i), {"max_tokens": 10}) for i in range(5)]
    for host in (0, 20):
        h = Harness(max_num_batched_tokens=10, block_size=4, num_blocks=16, num_host_blocks=host)
        for rid, p, sp in work:
            h.add(rid, p, **sp)
        results = h.run()
        assert h.sched.stats.num_preemptions > 0
        assert (h.sched.stats.num_swap_preemptions > 0) == (host > 0)
        assert results == reference_outputs(work)


# ---- admission limits --------------------------------------------------------------------------------
def test_request_that_can_never_fit_is_rejected_with_both_numbers() -> None:
    s = Scheduler(SchedulerConfig(block_size=4, num_blocks=4, max_model_len=64))
    with pytest.raises(RequestRejected) as exc:
        s.add_request(EngineRequest("big", list(range(10)), SamplingParams(max_tokens=10)))
    msg = str(exc.value)
    assert "5 KV blocks" in msg and "only 4 blocks" in msg
    assert exc.value.code == 400 and exc.value.param == "max_tokens"
    s.add_request(EngineRequest("fits", list(range(10)), SamplingParams(max_tokens=6)))   # exactly 4 blocks
    assert [r.seq_id for r in s.waiting] == ["fits"]
    assert s.group("big") is None


def test_prompt_at_or_over_max_model_len_is_rejected() -> None:
    s = Scheduler(SchedulerConfig(block_size=4, num_blocks=64, max_model_len=32))
    for n in (32, 40):
        with pytest.raises(RequestRejected) as exc:
            s.add_request(EngineRequest(f"p{n}", list(range(n)), SamplingParams(max_tokens=None)))
        assert exc.value.param == "prompt" and str(n) in str(exc.value) and "32" in str(exc.value)
    with pytest.raises(RequestRejected) as exc:
        s.add_request(EngineRequest("sum", list(range(30)), SamplingParams(max_tokens=3)))
    assert exc.value.param == "max_tokens"
    with pytest.raises(RequestRejected):
        s.add_request(EngineRequest("empty", [], SamplingParams()))
    s.add_request(EngineRequest("ok", list(range(31)), SamplingParams(max_tokens=None)))
    assert s.group("ok").parent.max_tokens == 1
    with pytest.raises(RequestRejected, match="already in use"):
        s.add_request(EngineRequest("ok", [1], SamplingParams()))
    assert not s.running and len(s.waiting) == 1


def test_generation_stops_at_max_model_len() -> None:
    h = Harness(block_size=4, num_blocks=64, max_model_len=20)
    h.add("a", prompt(0, 15), max_tokens=None, ignore_eos=True)
    r = h.run()[("a", 0)]
    assert len(r.tokens) == 5 and r.finish_reason == "length"


def test_n_above_max_num_seqs_is_rejected() -> None:
    s = Scheduler(SchedulerConfig(block_size=4, num_blocks=64, max_num_seqs=2))
    with pytest.raises(RequestRejected) as exc:
        s.add_request(EngineRequest("n3", [1, 2, 3], SamplingParams(n=3)))
    assert exc.value.param == "n" and "3" in str(exc.value) and "2" in str(exc.value)
    s.add_request(EngineRequest("n2", [1, 2, 3], SamplingParams(n=2)))


def test_unforked_choices_count_against_max_num_seqs() -> None:
    h = Harness(max_num_batched_tokens=4, max_num_seqs=3, block_size=4, num_blocks=64)
    h.add("n", prompt(0, 10), max_tokens=4, n=3)
    h.add("x", prompt(1, 3), max_tokens=2)
    for _ in range(3):                                       # n's chunked prefill: x must not sneak in
        s = h.step()
        assert "x" not in scheduled_tokens(s)
    assert len(h.sched.running) == 3 and [r.seq_id for r in h.sched.waiting] == ["x"]
    results = h.run()
    assert results[("x", 0)].tokens == expected_tokens("x", 3, 2)
    assert results[("n", 2)].tokens == expected_tokens("n#2", 10, 4)


def test_waiting_queue_limit_rejects_with_429() -> None:
    s = Scheduler(SchedulerConfig(block_size=4, num_blocks=64, max_waiting_requests=2))
    for i in range(2):
        s.add_request(EngineRequest(f"r{i}", [1, 2], SamplingParams()))
    with pytest.raises(RequestRejected) as exc:
        s.add_request(EngineRequest("r2", [1, 2], SamplingParams()))
    assert exc.value.code == 429 and s.stats.admission_rejections == 1


# ---- abort -------------------------------------------------------------------------------------------
def test_abort_frees_blocks_of_waiting_running_swapped_and_forked_requests_immediately() -> None:
    h = Harness(max_num_batched_tokens=64, block_size=4, num_blocks=16, num_host_blocks=16)
    h.add("n3", prompt(0, 6), max_tokens=40, n=3)
    h.step()
    assert not h.sched.group("n3").unborn                    # forked after its prefill
    for i in range(3):
        h.add(f"r{i}", prompt(i + 1, 6), max_tokens=40)
    for _ in range(30):
        if h.sched.swapped:
            break
        h.step()
    assert [r.seq_id for r in h.sched.swapped] == ["r2"]    # the newest running request was swapped out
    assert h.sched.stats.num_swap_preemptions == 1
    h.add("w", prompt(9, 5), max_tokens=4)
    h.step()
    assert [r.seq_id for r in h.sched.waiting] == ["w"]     # nothing is admitted while a request is swapped
    running = [r.seq_id for r in h.sched.running]
    assert running[:4] == ["n3", "n3#1", "n3#2", "r0"]
    assert h.sched.swapped[0].seq_id == "r2"
    assert h.sched.kv.num_free_blocks < 16 and h.sched.kv.num_free_host_blocks < 16

    h.abort(["n3", "r0", "r1", "r2", "w", "unknown"])
    assert {k: r.finish_reason for k, r in h.results.items() if r.finish_reason} == {
        ("n3", 0): "abort", ("n3", 1): "abort", ("n3", 2): "abort", ("r0", 0): "abort", ("r1", 0): "abort",
        ("r2", 0): "abort", ("w", 0): "abort"}
    h.assert_all_free()                                      # at once, before the worker hears of it
    assert not h.sched.has_unfinished() and h.sched.stats.finished == {"abort": 7}
    s = h.step()
    assert sorted(s.finished_seq_ids) == sorted(running)     # r2 and w are not on the worker any more
    assert not h.runner.reqs
    h.abort(["n3"])                                          # aborting a finished request is a no-op
    assert h.sched.stats.finished == {"abort": 7}


def test_abort_of_a_waiting_request_never_reaches_the_worker() -> None:
    h = Harness(max_num_batched_tokens=8, block_size=4, num_blocks=32)
    h.add("a", prompt(0, 8), max_tokens=2)
    h.add("b", prompt(1, 8), max_tokens=2)
    h.abort(["b"])
    assert [r.seq_id for r in h.sched.waiting] == ["a"]
    assert h.results[("b", 0)].finish_reason == "abort"
    s = h.step()
    assert "b" not in s.finished_seq_ids and "b" not in scheduled_tokens(s)
    h.run()


def test_abort_of_one_choice_leaves_the_other_choices_running() -> None:
    h = Harness(block_size=4, num_blocks=64)
    h.add("n", prompt(0, 6), max_tokens=6, n=3)
    h.step()
    h.abort(["n"], [1])
    results = h.run()
    assert results[("n", 1)].finish_reason == "abort"
    assert results[("n", 0)].tokens == expected_tokens("n", 6, 6)
    assert results[("n", 2)].tokens == expected_tokens("n#2", 6, 6)


def test_abort_of_an_unborn_choice_keeps_it_from_being_forked() -> None:
    h = Harness(max_num_batched_tokens=4, block_size=4, num_blocks=64)
    h.add("n", prompt(0, 6), max_tokens=3, n=3)
    h.step()                                                 # first prefill chunk: not forked yet
    assert h.sched.group("n").unborn == {1, 2}
    h.abort(["n"], [1])
    assert h.results[("n", 1)].finish_reason == "abort"
    results = h.run()                                        # collect() fails on output after a finish
    assert results[("n", 1)].tokens == []
    assert results[("n", 0)].tokens == expected_tokens("n", 6, 3)
    assert results[("n", 2)].tokens == expected_tokens("n#2", 6, 3)
    assert not any(r.seq_id == "n#1" for step in h.steps for r in step.new_seqs)


def test_abort_of_an_unforked_parent_reports_every_choice() -> None:
    h = Harness(max_num_batched_tokens=4, block_size=4, num_blocks=64)
    h.add("n", prompt(0, 6), max_tokens=3, n=3)
    h.step()
    h.abort(["n"], [0])                                      # the unborn choices cannot outlive their parent
    assert [h.results[("n", i)].finish_reason for i in range(3)] == ["abort"] * 3
    h.abort(["n"], [1])                                      # already reported: nothing more
    h.run()


# ---- n > 1: fork and copy-on-write -------------------------------------------------------------------
def test_forked_choices_share_prompt_blocks_and_copy_on_first_write() -> None:
    h = Harness(block_size=4, num_blocks=64)
    h.add("n", prompt(0, 10), max_tokens=5, n=3)
    first = h.step()
    assert [r.seq_id for r in first.new_seqs] == ["n"]       # one prefill for all three choices
    kv = h.sched.kv
    table = list(kv.table("n"))
    assert len(table) == 3
    assert kv.table("n#1") == table and kv.table("n#2") == table
    assert [kv.pool.ref_count(b) for b in table] == [3, 3, 3]
    s = h.step()
    assert s.blocks_to_copy, "writing into the shared partial block must copy it first"
    assert all(src == table[2] for src, _ in s.blocks_to_copy)
    children = {r.seq_id: r for r in s.new_seqs}
    assert set(children) == {"n#1", "n#2"}
    assert all(r.num_computed_tokens == 9 and r.num_new_tokens == 1 for r in children.values())
    assert [kv.pool.ref_count(b) for b in table[:2]] == [3, 3]   # the full prompt blocks stay shared
    tails = {kv.table(rid)[2] for rid in ("n", "n#1", "n#2")}
    assert len(tails) == 3                                    # one private copy of the partial block each
    results = h.run()
    assert results[("n", 0)].tokens == expected_tokens("n", 10, 5)
    assert results[("n", 1)].tokens == expected_tokens("n#1", 10, 5)
    assert results[("n", 2)].tokens == expected_tokens("n#2", 10, 5)
    assert len({tuple(r.tokens) for r in results.values()}) == 3
    assert all(r.finish_reason == "length" for r in results.values())


def test_fork_of_a_block_aligned_prompt_copies_the_last_prompt_block() -> None:
    h = Harness(block_size=4, num_blocks=64)
    h.add("n", prompt(0, 8), max_tokens=3, n=2)
    h.step()
    s = h.step()
    assert len(s.blocks_to_copy) == 1                         # the child rewrites position 7
    results = h.run()
    assert results[("n", 1)].tokens == expected_tokens("n#1", 8, 3)


def test_forked_choices_under_memory_pressure_complete_correctly() -> None:
    work = [("n", prompt(0, 9), {"max_tokens": 12, "n": 4}), ("m", prompt(1, 7), {"max_tokens": 10, "n": 2})]
    for host in (0, 32):
        h = Harness(max_num_batched_tokens=32, block_size=4, num_blocks=10, num_host_blocks=host)
        for rid, p, sp in work:
            h.add(rid, p, **sp)
        results = h.run()
        assert h.sched.stats.num_preemptions > 0
        assert results == reference_outputs(work)


# ---- stop conditions ---------------------------------------------------------------------------------
def test_eos_stops_unless_ignore_eos() -> None:
    script = {"a": [50, 51, EOS, 53], "b": [50, 51, EOS, 53]}
    h = Harness(script=script, block_size=4, num_blocks=64)
    h.add("a", prompt(0, 5), max_tokens=8)
    h.add("b", prompt(0, 5), max_tokens=8, ignore_eos=True)
    results = h.run()
    assert results[("a", 0)].tokens == [50, 51, EOS]
    assert (results[("a", 0)].finish_reason, results[("a", 0)].stop_reason) == ("stop", None)
    assert results[("b", 0)].tokens[:4] == [50, 51, EOS, 53] and len(results[("b", 0)].tokens) == 8
    assert results[("b", 0)].finish_reason == "length"


def test_stop_token_ids_stop_with_the_token_as_stop_reason() -> None:
    h = Harness(script={"a": [50, 77, 51]}, block_size=4, num_blocks=64)
    h.add("a", prompt(0, 5), max_tokens=8, stop_token_ids=[77, 78])
    r = h.run()[("a", 0)]
    assert r.tokens == [50, 77] and r.finish_reason == "stop" and r.stop_reason == 77


def test_max_tokens_finishes_with_length() -> None:
    h = Harness(block_size=4, num_blocks=64)
    h.add("a", prompt(0, 5), max_tokens=3)
    h.add("one", prompt(1, 5), max_tokens=1)
    results = h.run()
    assert results[("a", 0)].tokens == expected_tokens("a", 5, 3)
    assert (results[("a", 0)].finish_reason, results[("a", 0)].stop_reason) == ("length", None)
    assert len(results[("one", 0)].tokens) == 1 and results[("one", 0)].finish_reason == "length"
    assert h.sched.stats.finished == {"length": 2}


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached() -> None:
    script = {"a": [EOS, 77, 50, EOS, 51], "b": [EOS, 77, 50, 77]}
    h = Harness(script=script, block_size=4, num_blocks=64)
    h.add("a", prompt(0, 5), max_tokens=10, min_tokens=3)
    h.add("b", prompt(0, 5), max_tokens=10, min_tokens=3, stop_token_ids=[77])
    results = h.run()
    assert results[("a", 0)].tokens == [EOS, 77, 50, EOS] and results[("a", 0)].finish_reason == "stop"
    assert results[("b", 0)].tokens == [EOS, 77, 50, 77] and results[("b", 0)].stop_reason == 77


def test_eos_stops_each_forked_choice_on_its_own() -> None:
    h = Harness(script={"n": [50, EOS], "n#1": [60, 61, 62, EOS]}, block_size=4, num_blocks=64)
    h.add("n", prompt(0, 6), max_tokens=6, n=3)
    results = h.run()
    assert results[("n", 0)].tokens == [50, EOS] and results[("n", 0)].finish_reason == "stop"
    assert results[("n", 1)].tokens == [60, 61, 62, EOS] and results[("n", 1)].finish_reason == "stop"
    assert results[("n", 2)].tokens == expected_tokens("n#2", 6, 6)
    assert results[("n", 2)].finish_reason == "length"


# ---- prefix caching ----------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_identical_prompt_hits_every_full_block_only_with_prefix_caching(caching: bool) -> None:
    h = Harness(block_size=4, num_blocks=64, enable_prefix_caching=caching)
    p = prompt(0, 18)                                         # 4 full blocks + 2 tokens
    h.add("a", p, max_tokens=3)
    h.run()
    h.add("b", p, max_tokens=3)
    s = h.step()
    (new,) = s.new_seqs
    assert new.num_computed_tokens == (16 if caching else 0)
    assert new.num_new_tokens == 18 - new.num_computed_tokens
    results = h.run()
    assert results[("b", 0)].num_cached_tokens == (16 if caching else 0)
    assert results[("a", 0)].num_cached_tokens == 0
    assert results[("b", 0)].tokens == expected_tokens("b", 18, 3)
    assert h.sched.stats.prefix_cache_queries == 36
    assert h.sched.stats.prefix_cache_hits == (16 if caching else 0)
    assert h.sched.stats.prompt_tokens == 36 - h.sched.stats.prefix_cache_hits


def test_prefix_hit_while_the_first_request_still_runs_shares_its_blocks() -> None:
    h = Harness(block_size=4, num_blocks=64)
    p = prompt(0, 12)
    h.add("a", p, max_tokens=6)
    h.step()
    h.add("b", p + [5, 6], max_tokens=3)
    s = h.step()
    (new,) = s.new_seqs
    assert new.num_computed_tokens == 12 and new.block_ids[:3] == h.sched.kv.table("a")[:3]
    assert [h.sched.kv.pool.ref_count(b) for b in new.block_ids[:3]] == [2, 2, 2]
    results = h.run()
    assert results[("b", 0)].tokens == expected_tokens("b", 14, 3)
    assert results[("a", 0)].tokens == expected_tokens("a", 12, 6)


def test_block_aligned_identical_prompt_still_computes_its_last_token() -> None:
    h = Harness(block_size=4, num_blocks=64)
    p = prompt(0, 16)
    h.add("a", p, max_tokens=2)
    h.run()
    h.add("b", p, max_tokens=2)
    (new,) = h.step().new_seqs
    assert new.num_computed_tokens == 12 and new.num_new_tokens == 4
    assert h.run()[("b", 0)].tokens == expected_tokens("b", 16, 2)


def test_generated_tokens_are_cached_too() -> None:
    h = Harness(block_size=4, num_blocks=64)
    h.add("a", prompt(0, 6), max_tokens=7, ignore_eos=True)
    r = h.run()[("a", 0)]
    h.add("b", prompt(0, 6) + r.tokens[:6], max_tokens=2)
    (new,) = h.step().new_seqs
    assert new.num_computed_tokens == 8                       # blocks 0-1 hold prompt + generated tokens
    h.run()


# ---- randomized ----------------------------------------------------------------------------------------
request_strategy = st.tuples(
    st.integers(0, 2),                     # which shared prefix
    st.integers(1, 14),                    # own prompt tokens
    st.integers(1, 24),                    # max_tokens
    st.integers(1, 3),                     # n
    st.integers(0, 8),                     # step at which it arrives
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request_strategy, min_size=2, max_size=7),
       num_blocks=st.integers(6, 16), num_host_blocks=st.sampled_from([0, 4, 32]),
       budget=st.integers(4, 40), max_num_seqs=st.integers(1, 8), caching=st.booleans(),
       aborts=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6), st.integers(-1, 2)), max_size=3),
       pipelined=st.booleans(), num_drafts=st.sampled_from([0, 1, 3]), lookahead=st.booleans(),
       max_loras=st.sampled_from([0, 1, 2]), windows=st.sampled_from([(None,), (None,), (6,), (None, 5), (5, None, 9)]))
def test_random_workloads_keep_blocks_consistent_and_outputs_correct(
        reqs: list[tuple[int, int, int, int, int]], num_blocks: int, num_host_blocks: int, budget: int,
        max_num_seqs: int, caching: bool, aborts: list[tuple[int, int, int]], pipelined: bool,
        num_drafts: int, lookahead: bool, max_loras: int, windows: tuple) -> None:
    """pipelined: step N+1 is scheduled before step N's samples are back, as the scheduler process does.
    num_drafts: the worker proposes drafts (some wrong) after every sample, verified in the next step;
    lookahead: with a draft model's lookahead slots for them. max_loras > 0: requests run under three
    adapters or none (the KV records carry the adapter, so a block shared across adapters fails).
    windows: the block table's KV groups (sliding windows release blocks; the runner checks each group)."""
    run_random_workload(reqs, num_blocks, num_host_blocks, budget, max_num_seqs, caching, aborts, pipelined,
                        num_drafts, lookahead, max_loras, windows)


def run_random_workload(reqs: list[tuple[int, int, int, int, int]], num_blocks: int, num_host_blocks: int,
                        budget: int, max_num_seqs: int, caching: bool, aborts: list[tuple[int, int, int]],
                        pipelined: bool, num_drafts: int = 0, lookahead: bool = False, max_loras: int = 0,
                        windows: tuple = (None,)) -> None:
    bs = 4
    prefixes = [prompt(1000, 8), prompt(1001, 5), []]
    adapters = {k: fake_adapter(k) for k in (1, 2, 3)}
    work = []
    for i, (pre, own, max_tokens, n, _) in enumerate(reqs):
        p = prefixes[pre] + prompt(i, own)
        max_tokens = min(max_tokens, num_blocks * bs - len(p))
        sp = {"max_tokens": max_tokens, "n": min(n, max_num_seqs), "ignore_eos": True}
        if max_loras and i % 4:
            sp["lora"] = adapters[i % 4]
        work.append((f"q{i}", p, sp))
    num_blocks, num_host_blocks = num_blocks * len(windows), num_host_blocks * len(windows)   # the same tokens
    h = Harness(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, block_size=bs, num_blocks=num_blocks,
                num_host_blocks=num_host_blocks, enable_prefix_caching=caching, max_model_len=4096,
                pipelined=pipelined, num_drafts=num_drafts, spec_lookahead_slots=num_drafts if lookahead else 0,
                max_loras=max_loras, kv_group_windows=windows)
    arrivals = sorted((r[4], i) for i, r in enumerate(reqs))
    aborted: set[tuple[str, int]] = set()
    step = 0
    while arrivals or h.sched.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            _, i = arrivals.pop(0)
            rid, p, sp = work[i]
            h.add(rid, p, **sp)
        for at, k, idx in aborts:
            rid = work[k % len(work)][0]
            if at == step and h.sched.group(rid) is not None:
                n = work[k % len(work)][2]["n"]
                idx = idx if idx < n else -1
                if idx == 0 and h.sched.group(rid).pending_fork:
                    idx = -1                  # choice 0 before the fork takes the unborn choices with it
                h.abort([rid], [idx])
                aborted |= {(rid, i) for i in range(n) if idx in (-1, i)}
        h.step()
        step += 1
        assert step < 3000, "no progress"
    h.run()
    stats = h.sched.stats
    for what, happened in [("swap preemption", stats.num_swap_preemptions), ("prefix hit", stats.prefix_cache_hits),
                           ("recompute preemption", stats.num_recompute_preemptions), ("abort", aborted),
                           ("copy-on-write", any(x.blocks_to_copy for x in h.steps)),
                           ("drafts verified", stats.spec_num_drafts),
                           ("drafts accepted", stats.spec_num_accepted_tokens),
                           ("drafts rejected", stats.spec_num_draft_tokens - stats.spec_num_accepted_tokens),
                           ("lookahead slots checked", h.runner.num_lookahead_checks),
                           ("adapter slot refilled", h.sched.lora_slots.num_loads > max_loras),
                           ("window released a block", any(-1 in t for t in h.runner.tables_seen))]:
        if happened:
            event(what)
    reference = reference_outputs(work)
    assert set(h.results) == set(reference)
    for key, ref in reference.items():
        got = h.results[key]
        if key in aborted:   # aborted, or finished before the abort came
            assert got.finish_reason in ("abort", "length"), key
            assert got.tokens == ref.tokens[:len(got.tokens)], key
        else:
            assert got.tokens == ref.tokens, key
            assert got.finish_reason == ref.finish_reason == "length", key


def test_a_sequence_crossing_long_rope_is_recomputed_once_in_budget_chunks() -> None:
    """LongRoPE: a sequence whose keys were computed short and that grows past the pretraining length
    is computed again from its start, in chunks of the budget; one longer from the start never is, and
    drafts never carry a short sequence past the length."""
    h = Harness(block_size=4, num_blocks=64, max_num_batched_tokens=8, long_rope_after=12, num_drafts=3)
    h.add("short", prompt(1, 10), max_tokens=8, ignore_eos=True)
    h.add("long", prompt(2, 20), max_tokens=4, ignore_eos=True)
    res = h.run()
    assert res[("short", 0)].tokens == expected_tokens("short", 10, 8)
    assert res[("long", 0)].tokens == expected_tokens("long", 20, 4)
    runs = [(r.seq_id, r.num_computed_tokens, r.num_new_tokens) for x in h.steps for r in x.new_seqs + x.cached_seqs]
    started, resets = set(), []
    for seq_id, computed, n in runs:        # a run from 0 after the sequence had computed tokens
        if computed == 0 and seq_id in started:
            resets.append((seq_id, n))
        started.add(seq_id)
    assert [s for s, _ in resets] == ["short"] and all(n <= 8 for _, n in resets)
    chunks = [n for seq_id, computed, n in runs if seq_id == "short"]
    assert sum(chunks[chunks.index(resets[0][1]):]) >= 13       # the recompute covers the whole sequence
    tokens_at = {}
    for x in h.steps:
        for r in x.cached_seqs:
            if r.seq_id == "short" and r.num_computed_tokens + 1 <= 12 and r.seq_id in x.spec_token_ids:
                tokens_at[r.num_computed_tokens] = len(x.spec_token_ids[r.seq_id])
    assert all(computed + 1 + k <= 12 for computed, k in tokens_at.items()), tokens_at


def test_drafts_are_verified_and_rolled_back_and_switch_off_in_large_batches() -> None:
    """With drafts from the worker, outputs stay the fake model's own tokens; with disable_by_batch_size 3 no
    step carries drafts while 3 or more run, and drafts flow again once fewer do."""
    h = Harness(block_size=4, num_blocks=64, num_drafts=3, spec_disable_by_batch_size=3)
    lengths = {"a": 4, "b": 8, "c": 30}
    for rid, n in lengths.items():
        h.add(rid, prompt(ord(rid), 5), max_tokens=n, ignore_eos=True)
    running_at_step = []
    for _ in range(200):
        if not h.sched.has_unfinished():
            break
        running_at_step.append(len(h.sched.running))
        h.step()
    results = h.run()
    for rid, n in lengths.items():
        assert results[(rid, 0)].tokens == expected_tokens(rid, 5, n)
    with_drafts = [bool(s.spec_token_ids) for s in h.steps[:len(running_at_step)]]
    assert not any(d for d, r in zip(with_drafts, running_at_step) if r >= 3)
    assert any(with_drafts), "drafts never flowed once the batch was small"
    st = h.sched.stats
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens    # both acceptance and rollback
