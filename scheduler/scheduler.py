"""Continuous-batching scheduler: decides, each step, which sequences run how many tokens.

Running sequences go first (decodes and unfinished prefill chunks), then swapped ones come back, then
waiting ones are admitted, all within one token budget. When blocks run out the newest running
sequence is preempted: swapped to host memory if there is room, else freed and recomputed later.
"""
from __future__ import annotations

import itertools
import time
from collections import deque

from common.protocol import (CachedSequenceData, EngineOutput, EngineRequest, ModelRunnerOutput,
                             NewSequenceData, SchedulerOutput)
from scheduler.admission import RequestRejected, validate_request
from scheduler.beam_scheduling import BeamScheduling
from scheduler.spec_scheduling import SpecScheduling
from scheduler.beam_search import BeamGroup
from scheduler.config import SchedulerConfig
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.lora_registry import LoRAAdapter
from scheduler.lora_slots import LoRASlots
from scheduler.sequence import Sequence, Status
from scheduler.sequence_group import SequenceGroup
from scheduler.stats import SchedulerStats


class Scheduler(BeamScheduling, SpecScheduling):
    def __init__(self, config: SchedulerConfig, eos_token_ids: list[int] | None = None):
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 config.num_host_blocks, config.kv_group_windows, config.prefix_caching_hash_algo)
        self.eos_token_ids = frozenset(eos_token_ids or [])
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []      # beams that sampled, waiting for their siblings (beam_scheduling.py)
        self.swapped: deque[Sequence] = deque()
        self.seqs: dict[str, Sequence] = {}                 # seq_id -> live sequence
        self.groups: dict[str, SequenceGroup | BeamGroup] = {}   # request_id -> its choices (or beams)
        self.stats = SchedulerStats()
        self._to_drop: list[str] = []                       # worker state to free at the next step
        self.lora_slots = LoRASlots(config.max_loras)
        self._step_loras: list[LoRAAdapter] = []            # adapters of the step being scheduled
        self._step_ids = itertools.count()
        self._beam_ids = itertools.count(1)

    # ---- admission -----------------------------------------------------------------------------
    def add_request(self, er: EngineRequest, lora: LoRAAdapter | None = None) -> None:
        """Queue a request as its first sequence (its other choices are forked after its prefill), under
        `lora` (the engine core resolved er.lora_request to it)."""
        if er.request_id in self.groups:
            raise RequestRejected(f"request id {er.request_id!r} is already in use", 400)
        try:
            max_tokens = validate_request(er, self.config, len(self.waiting),
                                          sum(s.num_tokens for s in self.waiting))
        except RequestRejected as e:
            if e.code == 429:
                self.stats.admission_rejections += 1
            raise
        sp = er.sampling_params
        seq = Sequence(seq_id=er.request_id, request_id=er.request_id, index=0,
                       prompt_token_ids=list(er.prompt_token_ids), sampling_params=sp, max_tokens=max_tokens,
                       eos_token_ids=self.eos_token_ids, client_id=er.client_id, seed=sp.seed,
                       arrival_time=er.arrival_time or time.monotonic(), lora=lora)
        group = BeamGroup.create(seq, self.eos_token_ids) if sp.use_beam_search else SequenceGroup.create(seq, sp.n)
        if isinstance(group, BeamGroup) and group.num_candidates > (self.config.vocab_size or group.num_candidates):
            raise RequestRejected(f"{sp.n} beams keep {group.num_candidates} candidates a step, more than the "
                                  f"vocabulary's {self.config.vocab_size} tokens", 400, "n")
        self.seqs[seq.seq_id] = seq
        self.groups[er.request_id] = group
        self.waiting.append(seq)

    def abort_requests(self, request_ids: list[str], indexes: list[int] | None = None) -> list[EngineOutput]:
        """Finish every choice of these requests (or only choice indexes[k] of request k, where that is not
        -1) at once and free what they hold."""
        outs = []
        for k, rid in enumerate(request_ids):
            group = self.groups.get(rid)
            if group is None:
                continue
            if isinstance(group, BeamGroup):     # a beam is no choice of its own: any index ends them all
                self._end_beams(group)
                outs += [EngineOutput(rid, i, [], finish_reason="abort") for i in range(group.width)]
                continue
            dropped, live = group.abort(indexes[k] if indexes else -1)
            for seq in live:
                seq.finish_reason = "abort"
                self._finish(seq)
            outs += [EngineOutput(rid, i, [], finish_reason="abort") for i in sorted(dropped + [s.index for s in live])]
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.groups)

    def group(self, request_id: str) -> SequenceGroup | None:
        """The live group of a request (None once every choice has finished)."""
        return self.groups.get(request_id)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step_id=next(self._step_ids), finished_seq_ids=self._to_drop)
        self._to_drop = []
        self._step_loras = []
        budget = self.config.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._crosses_long_rope(seq):
                seq.num_computed_tokens = 0          # its keys again, with the long factors (see below)
            n = min(seq.num_tokens_to_compute, budget)
            if n <= 0 or self._waits_for_sample(seq):   # its last token (or the drafts after it) in flight
                i += 1
                continue
            drafts = self._take_drafts(seq, budget) if n == 1 else []
            n += len(drafts)                     # lookahead slots: the drafts are computed with the token
            slots = n + self._lookahead(seq, n)
            alloc = self.kv.allocate_slots(seq, slots)
            while alloc is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is seq:
                    break
                alloc = self.kv.allocate_slots(seq, slots)
            if alloc is None:
                break
            self._emit(seq, n, alloc, out, drafts)
            budget -= n
            i += 1

        lora_keys = {s.lora.key for q in (self.running, self.parked) for s in q if s.lora} if self.config.max_loras \
            else set()
        if not preempted:
            budget = self._swap_in(out, budget, lora_keys)
        if not preempted and not self.swapped:
            self._admit(out, budget, lora_keys)
        if self.parked and not (out.new_seqs or out.cached_seqs):
            self._unpark_if_stuck(out)
        if self._step_loras:
            out.lora_loads = self.lora_slots.place(self._step_loras)
        if out.new_seqs or out.cached_seqs:
            self.stats.observe_step(len(out.new_seqs) + len(out.cached_seqs), out.total_num_tokens)
        return out

    def _swap_in(self, out: SchedulerOutput, budget: int, lora_keys: set[int]) -> int:
        num_seqs = self._num_running_seqs()
        while self.swapped and budget > 0 and self._may_start(self.swapped[0], num_seqs):
            seq = self.swapped[0]
            if not self.lora_slots.admits(seq.lora, lora_keys):
                break                        # back once the running adapters leave it a slot
            n = min(seq.num_tokens_to_compute, budget)
            slots = n + self._lookahead(seq, n)
            if not self.kv.can_swap_in(seq, slots):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.kv.swap_in(seq))
            alloc = self.kv.allocate_slots(seq, slots)
            assert alloc is not None
            num_seqs += self._start_running(seq, n, alloc, out)
            budget -= n
        return budget

    def _admit(self, out: SchedulerOutput, budget: int, lora_keys: set[int]) -> None:
        """Start waiting sequences in order; one whose adapter cannot have a slot beside the running ones'
        keeps its place, and only base-model sequences behind it may start."""
        num_seqs = self._num_running_seqs()
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and self._may_start(self.waiting[0], num_seqs):
            seq = self.waiting[0]
            if seq.lora is not None and (skipped or not self.lora_slots.admits(seq.lora, lora_keys)):
                skipped.append(self.waiting.popleft())   # behind a skipped one, no adapter starts: the
                continue                                 # running adapters drain and its turn comes
            hits = self.kv.get_computed_blocks(seq)
            num_hit = len(hits) * self.config.block_size
            seq.num_computed_tokens = num_hit
            n = min(seq.num_tokens - num_hit, budget)
            alloc = self.kv.allocate_slots(seq, n + self._lookahead(seq, n), hits)
            if alloc is None:
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_hit
                self.stats.prefix_cache_queries += seq.num_prompt_tokens
                self.stats.prefix_cache_hits += num_hit
            num_seqs += self._start_running(seq, n, alloc, out)
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _start_running(self, seq: Sequence, n: int, alloc: tuple[list[tuple[int, int]], int],
                       out: SchedulerOutput) -> int:
        """Move a waiting or swapped-in sequence into the running queue; returns the sequences it adds."""
        seq.status = Status.RUNNING
        self.running.append(seq)
        self._emit(seq, n, alloc, out)
        return self._num_seqs(seq)

    def _num_running_seqs(self) -> int:
        return sum(self._num_seqs(s) for s in self.running) + len(self.parked)

    def _may_start(self, seq: Sequence, num_running: int) -> bool:
        """Its in-flight sample is back, and it (with the unborn choices it brings) fits max_num_seqs."""
        return not seq.num_pending and num_running + self._num_seqs(seq) <= self.config.max_num_seqs

    def _num_seqs(self, seq: Sequence) -> int:
        """Running sequences seq is or will become: an unforked parent brings its unborn siblings."""
        if seq.index or seq.sampling_params.n == 1:    # per step for every running sequence: skip the lookup
            return 1
        return self.groups[seq.request_id].num_seqs_brought(seq)

    def _waits_for_sample(self, seq: Sequence) -> bool:
        """A sequence whose sample is still in flight waits for it, rather than run one token ahead on the
        worker's copy, where what comes next is decided here: the drafts proposed after it (speculation;
        pipelining would otherwise always schedule it before its drafts arrive), the beams chosen from its
        candidates (beam search), or whether a constrained sequence's first sample happened at all (the
        worker skips it while the grammar still compiles: gpu_worker/structured_output/manager.py)."""
        sp = seq.sampling_params
        return seq.num_pending > 0 and (self.config.speculative or sp.use_beam_search or (
            sp.structured_outputs is not None and not seq.output_token_ids))

    def _crosses_long_rope(self, seq: Sequence) -> bool:
        """LongRoPE (Phi-3) rotates a sequence longer than the pretraining length with its long factors,
        and HF then runs the whole sequence again, so that every key is rotated that way. A sequence
        that has grown past the length with keys computed short is therefore recomputed from its start:
        into its own blocks (copy-on-write where shared), in budget-sized chunks like any prefill."""
        after = self.config.long_rope_after
        return after is not None and not seq.rope_long and seq.num_tokens > after and seq.num_computed_tokens > 0

    def _emit(self, seq: Sequence, n: int, alloc: tuple[list[tuple[int, int]], int], out: SchedulerOutput,
              drafts: list[int] = ()) -> None:
        """Record that seq runs n tokens this step, as a new sequence or as a delta for the worker."""
        if drafts:
            out.spec_token_ids[seq.seq_id] = drafts
            seq.num_inflight_drafts = len(drafts)
            self.stats.spec_num_drafts += 1
            self.stats.spec_num_draft_tokens += len(drafts)
        copies, first_changed = alloc
        out.blocks_to_copy.extend(copies)
        if self.config.long_rope_after is not None and seq.num_tokens > self.config.long_rope_after:
            seq.rope_long = True             # from now on its keys are computed with the long factors
        if seq.lora is not None:
            self._step_loras.append(seq.lora)
        table = self.kv.table(seq.seq_id)
        if not seq.on_worker:
            out.new_seqs.append(NewSequenceData(seq.seq_id, seq.all_token_ids, seq.num_prompt_tokens,
                                                seq.sampling_params, list(table), seq.num_computed_tokens, n,
                                                seq.seed, seq.lora.key if seq.lora else 0))
            seq.on_worker = True
        else:
            start = min(first_changed, seq.worker_num_blocks)
            out.cached_seqs.append(CachedSequenceData(seq.seq_id, start, table[start:], seq.num_computed_tokens, n))
            if seq.replaced_last:
                out.replaced_token_ids[seq.seq_id] = seq.output_token_ids[-1]
        seq.replaced_last = False
        seq.worker_num_blocks = len(table)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            self.stats.prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
        seq.num_computed_tokens += n
        if seq.num_computed_tokens >= seq.num_tokens + seq.num_pending:
            seq.num_pending += 1        # this step samples its next token
        # Blocks this step fills are findable at once: a later sequence in this same step may hit them,
        # which is safe because every layer writes the step's K/V before any of its attention reads.
        self.kv.cache_full_blocks(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput, behind: bool = False) -> None:
        """Swap seq out, or free it to be recomputed: next in line, or `behind` every waiting sequence."""
        self.stats.num_preemptions += 1
        seq.num_preemptions += 1
        seq.spec_token_ids = []
        if seq.on_worker:
            out.finished_seq_ids.append(seq.seq_id)
        seq.on_worker = False
        seq.worker_num_blocks = 0
        # beams are recomputed: a beam swapped out while its sample is in flight would come back with
        # nothing to compute, its candidates dropped (see _beam_sampled)
        if self.kv.num_host_blocks and self.kv.can_swap_out(seq) and not seq.sampling_params.use_beam_search:
            out.blocks_to_swap_out.extend(self.kv.swap_out(seq))
            seq.status = Status.SWAPPED
            self.swapped.append(seq)
            self.stats.num_swap_preemptions += 1
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = Status.WAITING
            if behind:
                self.waiting.append(seq)
            else:
                self.waiting.appendleft(seq)
            self.stats.num_recompute_preemptions += 1

    # ---- results -------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineOutput]:
        """Append sampled tokens, apply stop conditions, fork n > 1 siblings, and report per sequence."""
        outs = [eo for key, error in result.lora_errors.items() for eo in self.fail_adapter(key, error)]
        self._defer_samples(result.deferred_seq_ids)
        max_len = self.config.max_model_len
        for k, seq_id in enumerate(result.seq_ids):
            seq = self._sample_back(seq_id)
            if seq is None:
                continue
            if seq.sampling_params.use_beam_search:
                outs += self._beam_sampled(seq, result, k)
                continue
            sampled = result.sampled_token_ids[k]
            self._settle_drafts(seq, len(sampled))
            new, stopped = self._append(seq, sampled, max_len)
            if not stopped and not seq.num_pending:
                seq.spec_token_ids = result.spec_token_ids.get(seq_id, [])
            eo = EngineOutput(seq.request_id, seq.index, new,
                              logprobs=result.logprobs[k][:len(new)] if result.logprobs and result.logprobs[k] else None,
                              num_prompt_tokens=seq.num_prompt_tokens,
                              num_cached_tokens=max(seq.num_cached_tokens, 0))
            if len(seq.output_token_ids) == len(new) and seq.first_scheduled_time is not None:
                eo.queue_time = max(0.0, seq.first_scheduled_time - seq.arrival_time)
            if seq_id in result.prompt_logprobs:
                eo.prompt_logprobs = result.prompt_logprobs[seq_id]
            if stopped:
                eo.finish_reason, eo.stop_reason = seq.finish_reason, seq.stop_reason
                self._finish(seq)
            outs.append(eo)
        for seq_id, plp in result.prompt_logprobs.items():   # chunks that did not sample yet
            seq = self.seqs.get(seq_id)
            if seq is not None and seq_id not in result.seq_ids and self._reports_prompt_logprobs(seq):
                outs.append(EngineOutput(seq.request_id, seq.index, [], prompt_logprobs=plp,
                                         num_prompt_tokens=seq.num_prompt_tokens))
        return outs

    def _sample_back(self, seq_id: str) -> Sequence | None:
        """The sequence whose in-flight sample a step's result answers (None: it finished or was aborted
        while the step ran). A sequence preempted meanwhile keeps its token: it was computed correctly."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.is_finished or seq.num_pending == 0:
            return None
        seq.num_pending -= 1
        return seq

    def _defer_samples(self, seq_ids: list[str]) -> None:
        """Sequences whose grammar was still compiling sampled nothing: their last token runs again (the
        same KV into the same slot) in a later step, which samples then."""
        for seq_id in seq_ids:
            seq = self._sample_back(seq_id)
            if seq is not None and seq.num_computed_tokens:          # 0: preempted by recompute meanwhile
                seq.num_computed_tokens -= 1
                self.stats.prompt_tokens -= 1    # counted again when it runs again

    def fail_adapter(self, key: int, error: str) -> list[EngineOutput]:
        """A worker could not load adapter `key`: end every request under it with `error` (the rest of the
        batch ran normally) and forget its slot."""
        self.lora_slots.forget(key)
        rids = sorted({s.request_id for s in self.seqs.values() if s.lora is not None and s.lora.key == key})
        return [EngineOutput(o.request_id, o.index, [], finish_reason="error", error=error)
                for o in self.abort_requests(rids)]

    def _append(self, seq: Sequence, sampled: list[int], max_len: int) -> tuple[list[int], bool]:
        """Append sampled tokens one by one until a stop condition holds; the rest are dropped."""
        for i, tok in enumerate(sampled):
            seq.output_token_ids.append(tok)
            self.stats.generation_tokens += 1
            if seq.index == 0 and seq.sampling_params.n > 1 and (group := self.groups[seq.request_id]).pending_fork:
                self._fork(group)
            if seq.check_stop(max_len):
                return sampled[:i + 1], True
        return sampled, False

    def _fork(self, group: SequenceGroup) -> None:
        """Start the other choices of an n > 1 request once its prompt is computed. They share the parent's
        blocks; a parent preempted meanwhile holds none, so its siblings recompute the prompt instead."""
        parent = group.parent
        shared = parent.status is Status.RUNNING
        after = self.config.long_rope_after
        for child in group.fork(share_blocks=shared):
            self.seqs[child.seq_id] = child
            child.rope_long = shared and after is not None and parent.num_prompt_tokens > after   # the shared keys
            if shared:
                self.kv.fork(parent, child)
                self.running.append(child)
            else:
                self.waiting.appendleft(child)

    def _finish(self, seq: Sequence) -> None:
        self._release(seq)
        reason = seq.finish_reason or "abort"
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        self._forget_if_done(self.groups[seq.request_id])

    def _release(self, seq: Sequence) -> None:
        """Take a sequence out of its queue and free what it holds here and on the worker."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.SWAPPED:
            self.swapped.remove(seq)
        elif seq.status is Status.PARKED:
            self.parked.remove(seq)
        seq.status = Status.FINISHED
        self.kv.free(seq)
        if seq.on_worker:
            self._to_drop.append(seq.seq_id)
            seq.on_worker = False
        del self.seqs[seq.seq_id]

    def _forget_if_done(self, group: SequenceGroup) -> None:
        if group.is_finished:
            self.groups.pop(group.request_id, None)

    # ---- observability -------------------------------------------------------------------------
    def snapshot(self) -> dict[str, float]:
        return {"running": len(self.running), "waiting": len(self.waiting), "swapped": len(self.swapped),
                "parked": len(self.parked),
                "kv_cache_usage": self.kv.pool.usage, "num_free_blocks": self.kv.num_free_blocks,
                "num_blocks": self.kv.pool.num_blocks}
