"""Beam search: a request's beams as one group, and the choice of each step's continuations.

Every live beam samples once per step; the worker returns its top-K tokens with their logprobs
(K = 2 x width, more with several stop tokens, as Hugging Face keeps). A beam that has its candidates is
parked until its siblings have theirs too; then `select` ranks every (beam, token) pair by cumulative
logprob, the rules of HF's `generate(num_beams=width, do_sample=False)`:

    all beams' candidates, best first ─ top K ─┬─► a stop token, or the length limit, within the first
                                                │   `width`: a finished hypothesis, scored
                                                │   cum_logprob / generated_len ** length_penalty
                                                └─► any other, the first `width`: next step's beams

`early_stopping` (True, False or "never") decides, as in HF, when finished hypotheses can no longer be
beaten. The scheduler does the block work: a beam with several continuations is forked (its children
share all its blocks, and the first write into a shared block copies it), one with none is freed.
Beams emit nothing while they search; the finished hypotheses, best first, are the request's choices.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from common.protocol import Logprob
from common.sampling_params import SamplingParams
from scheduler.sequence import Sequence


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (a stop token included) and its score."""
    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str
    stop_reason: int | None
    logprobs: list[Logprob] | None


@dataclass
class Continuation:
    """One of the next step's beams: `beam` followed by `token`."""
    beam: Sequence
    token: int
    cum_logprob: float
    record: Logprob


def num_candidates(width: int, num_stop_ids: int) -> int:
    """Candidates kept per step, as HF: enough that `width` beams survive even when the best ones stop."""
    return max(2, 1 + num_stop_ids) * width


def worker_params(sp: SamplingParams, k: int) -> SamplingParams:
    """What the beams' worker rows run with: greedy, returning the top-k logprobs that hold the candidates."""
    return dataclasses.replace(sp, temperature=0.0, beam_candidates=k)


@dataclass(eq=False)
class BeamGroup:
    """The SequenceGroup of a beam-search request (sequence_group.py's counterpart for beams)."""
    parent: Sequence
    width: int
    stop_ids: frozenset[int]
    length_penalty: float
    early_stopping: bool | str
    num_logprobs: int | None                       # what the client asked per token (None: none)
    beams: list[Sequence] = field(default_factory=list)
    cum: dict[str, float] = field(default_factory=dict)              # seq_id -> cumulative logprob
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)   # seq_id -> its tokens' records
    candidates: dict[str, Logprob] = field(default_factory=dict)      # seq_id -> this step's top-K
    finished: list[Hypothesis] = field(default_factory=list)         # best first, at most `width`
    improvable: bool = True      # HF's early-stop heuristic: running beams may still beat the finished
    done: bool = False
    selected: bool = False       # the first selection happened (the parent no longer brings the others)

    @classmethod
    def create(cls, parent: Sequence, eos_token_ids: frozenset[int]) -> "BeamGroup":
        sp = parent.sampling_params
        stops = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else eos_token_ids)
        group = cls(parent, sp.n, stops, sp.length_penalty, sp.early_stopping, sp.logprobs, beams=[parent])
        group.cum[parent.seq_id] = 0.0
        group.logprobs[parent.seq_id] = []
        parent.sampling_params = worker_params(sp, group.num_candidates)
        return group

    ##### Public API #####
    @property
    def request_id(self) -> str:
        return self.parent.request_id

    @property
    def num_candidates(self) -> int:
        return num_candidates(self.width, len(self.stop_ids))

    def num_seqs_brought(self, seq: Sequence) -> int:
        """Before the first selection the one beam stands for all `width` it will become."""
        return self.width if not self.selected else 1

    def record(self, seq: Sequence, candidates: Logprob) -> bool:
        """Keep a beam's sampled candidates; True once every live beam has its own."""
        self.candidates[seq.seq_id] = candidates
        return len(self.candidates) == len(self.beams)

    def forget(self, seq: Sequence) -> None:
        """A beam leaves the search (dropped, or the whole request ends)."""
        self.beams.remove(seq)
        for d in (self.cum, self.logprobs, self.candidates):
            d.pop(seq.seq_id, None)

    def select(self) -> list[Continuation]:
        """One step of beam search over the recorded candidates: returns the next beams (best first) and
        updates the finished hypotheses and `done`. Needs every live beam recorded."""
        gen_len = len(self.beams[0].output_token_ids) + 1
        pool = sorted(((self.cum[b.seq_id] + lp, order, b, tok, rank)
                       for order, b in enumerate(self.beams)
                       for rank, (tok, lp) in enumerate(zip(*self.candidates[b.seq_id][2:4]))),
                      key=lambda c: (-c[0], c[1], c[4]))[:self.num_candidates]
        full = len(self.finished) == self.width and self.early_stopping is True
        running: list[Continuation] = []
        for i, (cum, _, beam, tok, rank) in enumerate(pool):
            cont = Continuation(beam, tok, cum, self._record(beam, rank))
            if self._stops(beam, tok, gen_len):
                if i < self.width and not full and self.improvable:
                    self.finished.append(self._hypothesis(cont, gen_len))
            elif len(running) < self.width:
                running.append(cont)
        self.finished = sorted(self.finished, key=lambda h: -h.score)[:self.width]
        self._update_heuristic(running, gen_len)
        self.done = not running or not self.improvable or (len(self.finished) == self.width
                                                           and self.early_stopping is True)
        if self.done and len(self.finished) < self.width:      # every choice gets an answer
            self.finished += [self._hypothesis(c, gen_len, "length") for c in running[:self.width - len(self.finished)]]
        self.candidates.clear()
        self.selected = True
        return [] if self.done else running

    def adopt(self, child: Sequence, cont: Continuation) -> None:
        """A forked beam takes its parent's score and records, plus the continuation's."""
        self.beams.append(child)
        self._advance(child.seq_id, cont, list(self.logprobs[cont.beam.seq_id]))

    def advance(self, cont: Continuation) -> None:
        """The beam itself continues with the continuation's token."""
        self._advance(cont.beam.seq_id, cont, self.logprobs[cont.beam.seq_id])

    ##### Internal Helper Functions #####
    def _advance(self, seq_id: str, cont: Continuation, records: list[Logprob]) -> None:
        self.cum[seq_id] = cont.cum_logprob
        self.logprobs[seq_id] = records + [cont.record] if self.num_logprobs is not None else records

    def _stops(self, beam: Sequence, tok: int, gen_len: int) -> bool:
        return tok in self.stop_ids or gen_len >= beam.max_tokens

    def _record(self, beam: Sequence, rank: int) -> Logprob:
        _, _, ids, lps = self.candidates[beam.seq_id]
        n = self.num_logprobs or 0
        return lps[rank], rank + 1, ids[:n], lps[:n]

    def _hypothesis(self, c: Continuation, gen_len: int, reason: str | None = None) -> Hypothesis:
        stop = c.token in self.stop_ids and reason is None
        return Hypothesis(c.beam.output_token_ids + [c.token], c.cum_logprob,
                          c.cum_logprob / gen_len ** self.length_penalty, "stop" if stop else "length",
                          c.token if stop and c.token in c.beam.sampling_params.stop_token_ids else None,
                          self.logprobs[c.beam.seq_id] + [c.record] if self.num_logprobs is not None else None)

    def _update_heuristic(self, running: list[Continuation], gen_len: int) -> None:
        """HF's `_check_early_stop_heuristic`: once `width` hypotheses are finished, stop when the best
        running beam, at its most hopeful length, cannot beat the worst of them."""
        if not (running and self.improvable and len(self.finished) == self.width):
            return
        best_len = running[0].beam.max_tokens if self.early_stopping == "never" and self.length_penalty > 0 \
            else gen_len
        self.improvable = running[0].cum_logprob / best_len ** self.length_penalty > self.finished[-1].score
