"""Structured output in the worker: each constrained sequence's grammar matcher, and the step's token
bitmask.

Matchers live here, beside the sampler, because the worker knows every sampled token the moment it is
drawn (the scheduler learns them a step later under pipelined scheduling). The sequence of events:
- a sequence arrives: its grammar is compiled in the compile thread, once per distinct text (cached), while
  its prompt is prefilled; a sequence rebuilt after a preemption replays its outputs into a new matcher;
- a step starts: the mask thread fills the bitmask of every constrained row (a sequence with drafts has
  one row per draft position: the drafts are tried against the grammar and rolled back) while the forward
  pass runs;
- sampling: the mask is applied to the logits before anything else touches them, and each sequence's
  kept tokens advance its matcher.
Every tensor-parallel rank runs the same matchers on the same tokens, so their masks agree.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gpu_worker.structured_output.backend import GrammarBackend, GrammarMatcher

log = logging.getLogger("pagedserve.worker")
MAX_CACHED = 256          # compiled grammars kept for reuse, least recently used dropped first


@dataclass
class GrammarState:
    """One sequence's grammar: compiling (a future) until its first mask is needed."""
    compiled: Future
    replay: list[int] = field(default_factory=list)     # outputs it already has (rebuilt after preemption)
    matcher: GrammarMatcher | None = None


class StructuredOutputManager:
    def __init__(self, make_backend: Callable[[], GrammarBackend]):
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._compiled: dict[tuple[str, str, bool], Future] = {}
        self._pending: Future | None = None

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:       # the tokenizer's vocabulary is indexed once, on first use
            self._backend = self._make_backend()
        return self._backend

    def add(self, st: Any) -> None:
        """Start compiling `st`'s grammar (a SequenceState with structured_outputs in its params). The
        cache keeps the MAX_CACHED most recently used texts (a sequence holds its own grammar)."""
        key = st.params.structured_outputs.key
        compiled = self._compiled.pop(key, None) or self._compile_pool.submit(lambda: self.backend.compile(*key))
        self._compiled[key] = compiled                       # most recent last
        if len(self._compiled) > MAX_CACHED:
            del self._compiled[next(iter(self._compiled))]
        st.grammar = GrammarState(compiled, st.token_ids[st.num_prompt_tokens:])

    @staticmethod
    def still_compiling(st: Any) -> bool:
        """A sequence about to sample its first token whose grammar is not compiled yet: it skips this
        step's sample instead of holding up the whole batch (the scheduler waits for every constrained
        sequence's first sample, so nothing was scheduled past it)."""
        g = st.grammar
        return g is not None and g.matcher is None and not g.compiled.done() and st.num_output_tokens == 0

    def _matcher(self, st: Any) -> GrammarMatcher:
        g = st.grammar
        if g.matcher is None:
            g.matcher = self.backend.matcher(g.compiled.result())     # waits while it still compiles
            for t in g.replay:
                g.matcher.accept(t)
        return g.matcher

    # ---- one step ------------------------------------------------------------------------------
    def start_masks(self, rows: list[tuple[Any, int, list[int]]], num_rows: int) -> None:
        """Fill the bitmask of (sequence, its first logits row, its drafts) in the mask thread."""
        self._pending = self._mask_pool.submit(self._fill, rows, num_rows)

    def apply(self, logits: torch.Tensor) -> None:
        """Mask this step's logits (after start_masks; none started: every constrained row of the step skips
        its sample); disallowed tokens become -inf."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        bitmask, rows = pending.result()
        if rows:
            self.backend.apply_bitmask(logits, bitmask, rows)

    def _fill(self, items: list[tuple[Any, int, list[int]]], num_rows: int) -> tuple[torch.Tensor, list[int]]:
        bitmask = self.backend.allocate_bitmask(num_rows)
        rows: list[int] = []
        for st, row, drafts in items:
            m = self._matcher(st)
            if m.is_terminated():          # complete (ignore_eos runs on past it): no constraint left
                continue
            m.fill_bitmask(bitmask, row)
            rows.append(row)
            tried = 0
            for j, token in enumerate(drafts):
                if not m.accept(token):     # the verifier rejects it (its row is masked); later rows go unread
                    break
                tried += 1
                if not m.is_terminated():
                    m.fill_bitmask(bitmask, row + 1 + j)
                    rows.append(row + 1 + j)
            m.rollback(tried)
        return bitmask, rows

    def accept(self, st: Any, tokens: list[int]) -> None:
        """The tokens the sequence kept this step (sampled from masked logits, so the grammar allows them)."""
        m = self._matcher(st)
        for t in tokens:
            if m.is_terminated():
                return
            if not m.accept(t):
                log.warning("%s: token %d is outside its grammar", st.seq_id, t)
                return

    def valid_drafts(self, st: Any, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows (the others would only be rejected)."""
        m = self._matcher(st)
        n = 0
        for t in drafts:
            if m.is_terminated() or not m.accept(t):
                break
            n += 1
        m.rollback(n)
        return n
