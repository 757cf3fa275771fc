"""The scheduler's beam-search half: the queues and blocks of beams, where beam_search.py decides.

A mixin of `Scheduler` (scheduler.py), kept in its own module so that each stays one screenful of ideas.
It uses the scheduler's queues (running, waiting, swapped, parked), its sequences and groups, the KV cache manager, the
stats, `_beam_ids` (a counter naming forks) and `_release` (take a sequence out of its queue and free its
blocks and worker state).

A beam's life: it samples (its top-K candidates come back) and is parked, holding its blocks, until its
siblings have sampled too; then the group selects. Each continuation either is the beam itself, moving on
with the chosen token (the worker is told it replaces its own sample), or a fork of it that shares all its
blocks (copy-on-write). A beam without a continuation is freed; when the search ends every beam is freed
and the finished hypotheses become the request's choices.
"""
from __future__ import annotations

import dataclasses

from common.protocol import EngineOutput, ModelRunnerOutput, SchedulerOutput
from scheduler.beam_search import BeamGroup, Continuation
from scheduler.sequence import Sequence, Status


class BeamScheduling:
    def _beam_sampled(self, seq: Sequence, result: ModelRunnerOutput, k: int) -> list[EngineOutput]:
        """Park a beam that sampled; once all its siblings have, pick the next beams."""
        outs = []
        if seq.seq_id in result.prompt_logprobs and self._reports_prompt_logprobs(seq):
            outs.append(EngineOutput(seq.request_id, 0, [], prompt_logprobs=result.prompt_logprobs[seq.seq_id],
                                     num_prompt_tokens=seq.num_prompt_tokens))
        if seq.status is not Status.RUNNING:    # preempted while sampling: it recomputes and samples again
            return outs
        self.running.remove(seq)
        seq.status = Status.PARKED
        self.parked.append(seq)
        group = self.groups[seq.request_id]
        if group.record(seq, result.logprobs[k][0]):
            outs += self._next_beams(group)
        return outs

    def _next_beams(self, group: BeamGroup) -> list[EngineOutput]:
        """Forks first (a child copies its beam's tokens before the beam moves on), then the beams that
        continue themselves; beams without a continuation are freed."""
        conts = group.select()
        if group.done:
            return self._beam_outputs(group)
        first: dict[str, Continuation] = {}
        for c in conts:
            if c.beam.seq_id in first:
                self._fork_beam(group, c)
            else:
                first[c.beam.seq_id] = c
        for beam in [b for b in group.beams if b.status is Status.PARKED and b.seq_id not in first]:
            group.forget(beam)
            self._release(beam)
        for c in first.values():
            self.parked.remove(c.beam)
            group.advance(c)
            c.beam.output_token_ids.append(c.token)
            c.beam.replaced_last = True       # the worker appended its own top-1 sample
            c.beam.status = Status.RUNNING
            self.running.append(c.beam)
        return []

    def _fork_beam(self, group: BeamGroup, c: Continuation) -> None:
        p = c.beam
        child = dataclasses.replace(p, seq_id=f"{p.request_id}#beam{next(self._beam_ids)}",
                                    output_token_ids=p.output_token_ids + [c.token], spec_token_ids=[],
                                    block_hashes=list(p.block_hashes), status=Status.RUNNING, on_worker=False,
                                    worker_num_blocks=0, replaced_last=False)
        self.kv.fork(p, child)
        self.seqs[child.seq_id] = child
        group.adopt(child, c)
        self.running.append(child)

    def _beam_outputs(self, group: BeamGroup) -> list[EngineOutput]:
        """The search ended: its finished hypotheses, best first, are the request's choices."""
        self._end_beams(group)
        p = group.parent
        outs = [EngineOutput(p.request_id, i, h.token_ids, h.finish_reason, h.stop_reason, h.logprobs,
                             num_prompt_tokens=p.num_prompt_tokens, num_cached_tokens=max(p.num_cached_tokens, 0),
                             cumulative_logprob=h.cum_logprob) for i, h in enumerate(group.finished)]
        if outs and p.first_scheduled_time is not None:
            outs[0].queue_time = max(0.0, p.first_scheduled_time - p.arrival_time)
        for h in group.finished:
            self.stats.generation_tokens += len(h.token_ids)
            self.stats.finished[h.finish_reason] = self.stats.finished.get(h.finish_reason, 0) + 1
        return outs

    def _end_beams(self, group: BeamGroup) -> None:
        for beam in list(group.beams):
            group.forget(beam)
            self._release(beam)
        group.done = True
        self.groups.pop(group.request_id, None)

    def _reports_prompt_logprobs(self, seq: Sequence) -> bool:
        """A request's prompt logprobs come from its first prefill; a beam that computes the prompt again
        later (preempted, or unparked) reports nothing, or the choices' records would mix."""
        group = self.groups.get(seq.request_id)
        return not (isinstance(group, BeamGroup) and group.selected)

    def _unpark_if_stuck(self, out: SchedulerOutput) -> None:
        """Nothing could run this step while parked beams hold blocks: the sequence that should start next
        (swapped back in first, else admitted) may need those blocks while their own siblings wait behind
        it. If it could start but for blocks, the parked beams of other requests give them up and queue
        behind it to compute again (admission made sure that one request's beams alone fit the cache)."""
        head = self.swapped[0] if self.swapped else self.waiting[0] if self.waiting else None
        if head is None or head.num_pending or any(s.num_pending for s in self.running):
            return          # a sample in flight will change things: nothing is stuck yet
        keep = self.groups.get(head.request_id)
        for beam in [b for b in self.parked if self.groups[b.request_id] is not keep]:
            self.groups[beam.request_id].candidates.pop(beam.seq_id, None)
            self.parked.remove(beam)
            self._preempt(beam, out, behind=True)
