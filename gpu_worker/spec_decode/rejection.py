"""Verification of drafts: which of a sequence's k drafts it keeps, and the token after them, so that what
it emits is distributed exactly as the target model's own samples.

A sequence with k drafts owns k + 1 logits rows; row j conditions on drafts 0..j-1 and holds the target's
distribution p_j (after every sampling parameter) and its own sample from it.

* Deterministic drafts (n-gram lookup, or a draft model's argmax for a greedy request: q is one-hot):
  keep the target's samples through the first that differs from its draft. Draft j survives with
  probability p_j(d_j) = min(1, p/q), and a rejected position yields a sample of p_j given that it is not
  d_j, i.e. norm(max(0, p_j - q_j)): this *is* rejection sampling, with the target's own draws.
* Drafts drawn from a spread-out q_j (a draft model sampling): accept d_j with probability
  min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from norm(max(0, p_j - q_j)) and stop; if all
  k survive, the target's sample of row k is the bonus token (Leviathan et al., 2023).

Seeded sequences draw the acceptance test and the residual from a stream of their own (salt VERIFY_SALT)
seeded by output index, so a seeded request gives the same output in any batch.
"""
from __future__ import annotations

import torch

from gpu_worker.sampler import Samples, row_argmax
from gpu_worker.step_inputs import SequenceState

VERIFY_SALT = 2


def accepted_drafts(drafts: list, target: list) -> int:
    """How many leading drafts the target's own choices at those positions confirm (the common prefix)."""
    n = 0
    while n < len(drafts) and n < len(target) and drafts[n] == target[n]:
        n += 1
    return n


def verify(samples: Samples, seqs: list[SequenceState], num_rows: list[int]) -> tuple[list[int], list[int]]:
    """The token kept at every row (rows past a sequence's last kept one are don't-cares) and how many
    tokens each sequence keeps (1 + its accepted drafts)."""
    starts = _row_starts(num_rows)
    spread = [(st, row) for st, row in zip(seqs, starts) if st.spec_token_ids and st.draft_probs is not None]
    ids = samples.ids
    accepted: dict[str, list[bool]] = {}
    if spread:
        ids, accepted = _rejection_sample(samples, spread)
    kept_ids = ids.tolist()
    keep = []
    for st, row, k in zip(seqs, starts, num_rows):
        acc = accepted.get(st.seq_id)
        n = accepted_drafts(acc, [True] * len(acc)) if acc is not None else \
            accepted_drafts(st.spec_token_ids, kept_ids[row:row + k - 1])
        keep.append(1 + n)
    return kept_ids, keep


def _rejection_sample(s: Samples, spread: list[tuple[SequenceState, int]]) -> tuple[torch.Tensor, dict[str, list[bool]]]:
    """Accept or reject every drawn draft in one batch of tensor ops; returns row ids with accepted
    drafts and, at rejected rows, residual samples written in, and each sequence's accept flags."""
    assert s.probs is not None, "drafts drawn from a distribution belong to sampled (non-greedy) rows"
    rows = torch.tensor([row + j for st, row in spread for j in range(len(st.spec_token_ids))],
                        device=s.ids.device)
    drafts = torch.tensor([t for st, _ in spread for t in st.spec_token_ids], device=s.ids.device)
    p = s.probs[rows]
    q = torch.cat([st.draft_probs[:len(st.spec_token_ids)] for st, _ in spread]).to(p)
    u, noise = _draws(spread, p)
    p_d, q_d = p.gather(1, drafts[:, None])[:, 0], q.gather(1, drafts[:, None])[:, 0]
    accept = u * q_d <= p_d
    residual = (p - q).clamp_min_(0)
    empty = residual.sum(-1, keepdim=True) <= 0        # p == q up to rounding: rejection is (nearly) impossible
    residual = torch.where(empty, p, residual)
    fixed = row_argmax(residual / noise)
    ids = s.ids.clone()
    ids[rows] = torch.where(accept, drafts, fixed)
    flags, out, i = accept.tolist(), {}, 0
    for st, _ in spread:
        n = len(st.spec_token_ids)
        out[st.seq_id], i = flags[i:i + n], i + n
    return ids, out


def _draws(spread: list[tuple[SequenceState, int]], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms for the acceptance tests and Exp(1) noise for residual draws (exponential race), from
    each seeded sequence's own stream and the global generator otherwise."""
    u = torch.rand(like.shape[0], device=like.device)
    noise = torch.empty_like(like).exponential_()
    i = 0
    for st, _ in spread:
        for j in range(len(st.spec_token_ids)):
            gen = st.generator_for(j, VERIFY_SALT)
            if gen is not None:
                u[i] = torch.rand(1, generator=gen, device=like.device)[0]
                noise[i].exponential_(generator=gen)
            i += 1
    return u, noise


def _row_starts(num_rows: list[int]) -> list[int]:
    starts, row = [], 0
    for k in num_rows:
        starts.append(row)
        row += k
    return starts
