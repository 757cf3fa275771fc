"""A user's request as a group of n sequences (its choices), and the rules of their life together.

Choice 0, the parent, computes the prompt alone; the other n-1 choices are "unborn" until the parent's
prompt is done, and are then forked from it so that they share its KV blocks (copy-on-write):

    add_request ──► parent prefills ──► first sample arrives ──► fork(): choices 1..n-1 are born
                     (unborn: 1..n-1)                             sharing the parent's blocks

Aborting one choice ends only that choice; aborting the unforked parent ends the unborn with it (they
could never be born). The group is finished when no choice can produce anything more. Beam search
will grow its beams here too, which is why this bookkeeping is kept out of the scheduler's loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import Sequence, Status, seq_id_of


@dataclass(eq=False)
class SequenceGroup:
    parent: Sequence
    children: list[Sequence] = field(default_factory=list)   # born choices other than the parent
    unborn: set[int] = field(default_factory=set)            # choice indexes not forked (nor aborted) yet

    @classmethod
    def create(cls, parent: Sequence, n: int) -> "SequenceGroup":
        if n > 1:
            parent.kv_keep_from = parent.num_prompt_tokens - 1
        return cls(parent, unborn=set(range(1, n)))

    ##### Public API #####
    @property
    def request_id(self) -> str:
        return self.parent.request_id

    @property
    def seqs(self) -> list[Sequence]:
        """The born sequences, parent first."""
        return [self.parent, *self.children]

    @property
    def pending_fork(self) -> bool:
        return bool(self.unborn) and not self.parent.is_finished

    def num_seqs_brought(self, seq: Sequence) -> int:
        """Sequences that start running when `seq` does: the unforked parent brings its unborn choices."""
        return 1 + (len(self.unborn) if seq is self.parent else 0)

    def fork(self, share_blocks: bool) -> list[Sequence]:
        """Give birth to every unborn choice, as a copy of the parent's prompt state. With share_blocks the
        children start running on the parent's computed prompt (all but its last token, which each child
        recomputes into a block of its own); otherwise (the parent was preempted meanwhile and holds no
        blocks) they wait and compute the prompt themselves."""
        born = [self._child(i, share_blocks) for i in sorted(self.unborn)]
        self.unborn.clear()
        self.parent.kv_keep_from = None
        self.children.extend(born)
        return born

    def abort(self, index: int) -> tuple[list[int], list[Sequence]]:
        """End choice `index` (-1: every choice). Returns the unborn indexes dropped and the live sequences
        the scheduler must finish."""
        if index == 0 and self.pending_fork:
            index = -1
        dropped = sorted(i for i in self.unborn if index in (-1, i))
        self.unborn.difference_update(dropped)
        if not self.unborn:
            self.parent.kv_keep_from = None
        live = [s for s in self.seqs if index in (-1, s.index) and not s.is_finished]
        return dropped, live

    @property
    def is_finished(self) -> bool:
        """No choice can produce output any more: every born one finished, and no unborn one can be born."""
        return all(s.is_finished for s in self.seqs) and (not self.unborn or self.parent.is_finished)

    ##### Internal Helper Functions #####
    def _child(self, i: int, shared: bool) -> Sequence:
        p, sp = self.parent, self.parent.sampling_params
        return Sequence(seq_id=seq_id_of(p.request_id, i), request_id=p.request_id, index=i,
                        prompt_token_ids=p.prompt_token_ids, sampling_params=sp, max_tokens=p.max_tokens,
                        eos_token_ids=p.eos_token_ids, client_id=p.client_id, arrival_time=p.arrival_time,
                        seed=None if sp.seed is None else sp.seed + i,
                        num_computed_tokens=p.num_prompt_tokens - 1 if shared else 0,
                        num_cached_tokens=p.num_cached_tokens, lora=p.lora,
                        status=Status.RUNNING if shared else Status.WAITING)
