"""N-gram prompt lookup: find the sequence's last n tokens earlier in its own prompt and output, and propose
what followed them there. No model: it pays off where outputs repeat spans of the input (editing code,
quoting, continuing lists).

The longest suffix (prompt_lookup_max down to prompt_lookup_min) that occurs earlier wins; among its
occurrences the most recent one, whose continuation is most likely to be the current one.

A match of n tokens drafts at most n + 1 (and at most num_speculative_tokens): a short match is weak
evidence that the output is copying, and every draft is a row the verifying step pays for whether it is
accepted or not. On the grounded benchmark's greedy outputs, replayed through the proposer with a draft
row costing 0.07-0.13 of a decode step (the range measured on 2 Xeon cores), this rule with lookup 1..8
and k = 6 needs 3-4% less step time than k drafts from every match with lookup 2..5 and k = 5, and
more than drafting k from every match with lookup 1..8 (loadtest/results/spec_bench_2026-12-05b.txt).
"""
from __future__ import annotations

import numpy as np

from gpu_worker.spec_decode.proposer import Drafts, Proposer
from gpu_worker.step_inputs import SequenceState


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int):
        self.min_n, self.max_n = min_n, max_n
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, seqs: list[SequenceState]) -> list[Drafts]:
        return [Drafts(propose_ngram(s.token_ids, self.min_n, self.max_n, self.num_speculative_tokens))
                for s in seqs]


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to min(k, n + 1) tokens that followed the latest earlier occurrence of the longest matching
    suffix, n tokens long.

    One pass finds where the last token occurred before; each further round keeps those of them whose
    match also reaches one token further back, so a step costs one scan of the sequence plus rounds over
    ever fewer candidates, not a scan per n (a quarter of the time at 500 tokens and lookup 1..8)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    last = len(tokens) - 1
    ends = np.flatnonzero(tokens[:last] == tokens[last]) if last > 0 else tokens[:0]   # where matches end
    n = 1
    while ends.size and n < max_n:
        longer = ends[ends >= n]
        longer = longer[tokens[longer - n] == tokens[last - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if not ends.size or n < min_n:
        return []
    start = int(ends[-1]) + 1
    return tokens[start:start + min(k, n + 1)].tolist()
