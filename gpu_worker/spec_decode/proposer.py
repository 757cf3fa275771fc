"""The proposer interface: after a step, guess up to k next tokens for each sequence that may speculate.

A proposer is one file: subclass `Proposer` and implement `propose`. One that runs a model of its own
(a draft model) also overrides the cache hooks: the runner sizes, allocates, swaps and copies its KV
cache with the target's, under the same block ids, and shows it every step's tokens through `observe`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.step_inputs import SequenceState

CachePair = tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class Drafts:
    token_ids: list[int]
    probs: torch.Tensor | None = None   # [len(token_ids), V]: the distribution each was drawn from; None: deterministic


def fit_drafts(lengths: list[int], budget: int) -> list[int]:
    """How many of each sequence's drafts to keep so that they add at most `budget` rows to the step:
    every sequence keeps up to the same count (the largest that fits), and what is left goes one more
    each to the first ones. The early drafts are the likeliest accepted, so cutting all evenly loses the
    fewest tokens."""
    if sum(lengths) <= budget:
        return lengths
    if budget <= 0:
        return [0] * len(lengths)
    cap = max(c for c in range(max(lengths) + 1) if sum(min(n, c) for n in lengths) <= budget)
    keep = [min(n, cap) for n in lengths]
    left = budget - sum(keep)
    for i, n in enumerate(lengths):
        if left and n > keep[i]:
            keep[i] += 1
            left -= 1
    return keep


class Proposer:
    num_speculative_tokens: int

    def propose(self, seqs: list[SequenceState]) -> list[Drafts]:
        """Drafts per sequence (possibly empty, at most num_speculative_tokens), continuing its token_ids."""
        raise NotImplementedError

    # ---- for proposers with a KV cache of their own --------------------------------------------
    def block_bytes(self, block_size: int) -> int:
        """Bytes of this proposer's cache per block, added to the target's when the cache is sized."""
        return 0

    def init_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        """Allocate the cache: one block per target block, same ids."""

    def caches(self) -> list[CachePair]:
        """(device caches, host caches) that swap and copy-on-write move together with the target's."""
        return []

    def observe(self, seqs: list[SequenceState], ends: list[int]) -> None:
        """The step just computed sequence i's tokens up to ends[i] (its new sample included, for one
        that sampled): catch up on them."""
