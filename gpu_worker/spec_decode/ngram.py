"""N-gram prompt lookup: find the sequence's last n tokens earlier in its own prompt and output, and propose
what followed them there. No model: it pays off where outputs repeat spans of the input (editing code,
quoting, continuing lists).

The longest suffix (prompt_lookup_max down to prompt_lookup_min) that occurs earlier wins; among its
occurrences the most recent one, whose continuation is most likely to be the current one.

A one-token match drafts one token (longer matches up to num_speculative_tokens, as in vLLM): with
prompt_lookup_min 1 it finds a continuation where a 2-token minimum finds none, but a lone token is weak
evidence that the output is copying, and each draft is a row the verifying step pays for whether it is
accepted or not. Replayed over the grounded benchmark's greedy outputs (loadtest/spec_replay.py), with a
draft row costing 0.10 of a decode step, k = 6 and lookup 1..8 then need 4.5% less step time than k drafts
from every match, and 2.7% less than vLLM's usual lookup 2..5 with k = 5
(loadtest/results/spec_bench_2026-12-05b.txt). Lookups from 2 tokens are unchanged.
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
    """The tokens that followed the latest earlier occurrence of the longest matching suffix, n tokens
    long: up to k of them, one after a one-token match."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    start, n = longest_match(tokens, min_n, max_n)
    return tokens[start:start + draft_limit(n, k)].tolist() if n else []


def draft_limit(n: int, k: int) -> int:
    """How many tokens an n-token match drafts (see the module's docstring)."""
    return 1 if n == 1 else k


def longest_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """(where the continuation starts, n) for the latest earlier occurrence of the longest suffix of
    `tokens` of min_n..max_n tokens; (0, 0) when none occurs.

    One pass finds where the last token occurred before; each further round keeps those of them whose
    match also reaches one token further back, so a step costs one scan of the sequence plus rounds over
    ever fewer candidates, not a scan per n (12 against 252 us at 500 tokens and lookup 1..8)."""
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
        return 0, 0
    return int(ends[-1]) + 1, n
