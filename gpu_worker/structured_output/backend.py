"""The interface a grammar library plugs in behind (one file each; xgrammar_backend.py is the one we ship,
chosen by loadtest/grammar_bench.py). The manager (manager.py) only ever talks to these two types."""
from __future__ import annotations

from typing import Any, Protocol

import torch


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar."""

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (and no change) if the grammar does not allow it."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask row `row` (bit set: allowed)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (drafts tried ahead of verification)."""

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing further is constrained."""


class GrammarBackend(Protocol):
    def compile(self, kind: str, text: str, strict_whitespace: bool = False) -> Any:
        """A compiled grammar (common/structured_output.py's kinds), shareable by any number of matchers.
        Slow (milliseconds to seconds): the manager calls it off the step's path, once per text."""

    def matcher(self, compiled: Any) -> GrammarMatcher: ...

    def allocate_bitmask(self, rows: int) -> torch.Tensor: ...

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set the disallowed logits of `rows` to -inf, in place (bitmask row r masks logits row r)."""
