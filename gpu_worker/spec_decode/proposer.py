"""The proposer interface: after a step, guess up to k next tokens for each sequence that may speculate."""
from __future__ import annotations

from typing import Protocol

from gpu_worker.step_inputs import SequenceState


class Proposer(Protocol):
    num_speculative_tokens: int

    def propose(self, seqs: list[SequenceState]) -> list[list[int]]:
        """Drafts per sequence (possibly empty, at most num_speculative_tokens), continuing its token_ids."""
