"""N-gram prompt lookup: find the sequence's last n tokens earlier in its own prompt and output, and propose
what followed them there. No model: it pays off where outputs repeat spans of the input (editing code,
quoting, continuing lists).

The longest suffix (prompt_lookup_max down to prompt_lookup_min) that occurs earlier wins; among its
occurrences the most recent one, whose continuation is most likely to be the current one.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

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
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # windows starting at 0 .. len - n - 1: every earlier occurrence, none overlapping the suffix start
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
