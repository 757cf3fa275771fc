"""Batched sampling: every request's parameters become per-row tensors, so one step samples the whole
batch with a handful of tensor ops whatever the mix of greedy, seeded, penalised and top-p requests.

Order, as in vLLM: logprobs are taken from the raw logits; then logit_bias, min_tokens masking and
penalties; then greedy argmax, or temperature, top-k, top-p, min-p and a draw. Draws use the
exponential-race trick (argmax of p / q with q ~ Exp(1)); a seeded request draws q from its own
generator, so its sample is the same alone or in any batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.protocol import Logprob
from gpu_worker.step_inputs import SequenceState


@dataclass
class SamplingBatch:
    temperature: torch.Tensor                # [B] float; 0 rows are greedy
    top_k: torch.Tensor | None = None        # [B] long; vocab size where off
    top_p: torch.Tensor | None = None        # [B] float
    min_p: torch.Tensor | None = None        # [B] float
    all_greedy: bool = False
    generators: dict[int, torch.Generator] = field(default_factory=dict)   # row -> seeded generator
    presence: torch.Tensor | None = None     # [B]
    frequency: torch.Tensor | None = None    # [B]
    repetition: torch.Tensor | None = None   # [B]
    output_counts: torch.Tensor | None = None   # [B, V] counts of generated tokens
    prompt_mask: torch.Tensor | None = None     # [B, V] bool, prompt tokens (repetition penalty)
    bias_rows: torch.Tensor | None = None       # logit_bias as coordinates and values
    bias_cols: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    ban_rows: torch.Tensor | None = None        # min_tokens: (row, token) pairs forced to -inf
    ban_cols: torch.Tensor | None = None
    max_logprobs: int = -1                      # -1: nobody asked


def build_sampling_batch(states: list[SequenceState], vocab: int, eos_ids: set[int],
                         device: torch.device) -> SamplingBatch:
    """Per-row parameter tensors for the rows' sequences; optional parts are built only when some row uses
    them, so an all-greedy batch costs one small tensor."""
    ps = [s.params for s in states]
    temp = torch.tensor([0.0 if p.greedy else p.temperature for p in ps], device=device)
    b = SamplingBatch(temperature=temp, all_greedy=all(p.greedy for p in ps))
    if not b.all_greedy:
        _add_filters(b, states, vocab, device)
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in ps):
        _add_penalties(b, states, vocab, device)
    if any(p.logit_bias for p in ps):
        coords = [(i, t, v) for i, p in enumerate(ps) for t, v in (p.logit_bias or {}).items()]
        b.bias_rows, b.bias_cols, b.bias_vals = (torch.tensor(c, device=device) for c in zip(*coords))
    bans = [(i, t) for i, s in enumerate(states) if s.num_output_tokens < s.params.min_tokens
            for t in set(s.params.stop_token_ids) | eos_ids]    # ignore_eos or not, as vLLM and HF's min_new_tokens
    if bans:
        b.ban_rows, b.ban_cols = (torch.tensor(c, device=device) for c in zip(*bans))
    lp = [p.num_top_logprobs for p in ps if p.num_top_logprobs is not None]
    b.max_logprobs = max(lp) if lp else -1
    return b


def _add_filters(b: SamplingBatch, states: list[SequenceState], vocab: int, device: torch.device) -> None:
    ps = [s.params for s in states]
    if any(p.top_k > 0 for p in ps):
        b.top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in ps], device=device)
    if any(p.top_p < 1.0 for p in ps):
        b.top_p = torch.tensor([p.top_p for p in ps], device=device)
    if any(p.min_p > 0 for p in ps):
        b.min_p = torch.tensor([p.min_p for p in ps], device=device)
    b.generators = {i: s.draw_generator() for i, s in enumerate(states) if s.generator is not None and not ps[i].greedy}


def _add_penalties(b: SamplingBatch, states: list[SequenceState], vocab: int, device: torch.device) -> None:
    ps = [s.params for s in states]
    counts = torch.zeros(len(ps), vocab, device=device)
    prompt = torch.zeros(len(ps), vocab, dtype=torch.bool, device=device)
    for i, s in enumerate(states):
        out = s.token_ids[s.num_prompt_tokens:]
        if out:
            counts[i].index_add_(0, torch.tensor(out, device=device), torch.ones(len(out), device=device))
        prompt[i, torch.tensor(s.token_ids[:s.num_prompt_tokens], device=device)] = True
    b.output_counts, b.prompt_mask = counts, prompt
    b.presence = torch.tensor([p.presence_penalty for p in ps], device=device)
    b.frequency = torch.tensor([p.frequency_penalty for p in ps], device=device)
    b.repetition = torch.tensor([p.repetition_penalty for p in ps], device=device)


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.bias_rows is not None:
        logits.index_put_((b.bias_rows, b.bias_cols), b.bias_vals, accumulate=True)
    if b.ban_rows is not None:
        logits[b.ban_rows, b.ban_cols] = float("-inf")
    if b.repetition is not None:
        seen = b.prompt_mask | (b.output_counts > 0)
        rep = b.repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if b.frequency is not None:
        logits = logits - b.frequency[:, None] * b.output_counts - b.presence[:, None] * (b.output_counts > 0)
    return logits


def _filter(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """top-k, then top-p over the sorted distribution, then min-p; masked entries become -inf."""
    if b.top_k is not None or b.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if b.top_k is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device)
            mask |= ranks[None, :] >= b.top_k[:, None]
            sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        if b.top_p is not None:
            probs = sorted_logits.softmax(-1)
            before = probs.cumsum(-1) - probs               # mass strictly above this token
            mask |= before > b.top_p[:, None]
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(mask, float("-inf")))
    if b.min_p is not None:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < b.min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


@dataclass
class Samples:
    ids: torch.Tensor                         # [B] the drawn (or greedy) token of every row
    probs: torch.Tensor | None = None         # [B, V] the distribution each row drew from; None if all greedy
    raw_logprobs: torch.Tensor | None = None  # [B, V] log-softmax of the raw logits, when some row wants logprobs


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over the last dim: max's indices, the same first maximum as argmax's (NaN
    included), in a third of argmax's CPU time on vocabulary rows (torch 2.13, 2 Xeon cores: 116 against
    332 us for 7 x 49152), a cost every speculative row pays."""
    return x.max(-1).indices


def draw(logits: torch.Tensor, b: SamplingBatch) -> Samples:
    """logits [B, V] float32 -> one token per row, keeping the distributions it came from: rejection
    sampling of drafts compares them with the draft's."""
    raw_logprobs = logits.log_softmax(-1) if b.max_logprobs >= 0 else None
    logits = apply_penalties(logits, b)
    greedy_ids = row_argmax(logits)
    if b.all_greedy:
        return Samples(greedy_ids, None, raw_logprobs)
    temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
    probs = _filter(logits / temp[:, None], b).softmax(-1)
    q = torch.empty_like(probs).exponential_()
    for row, gen in b.generators.items():
        q[row].exponential_(generator=gen)
    ids = torch.where(b.temperature > 0, row_argmax(probs / q), greedy_ids)
    return Samples(ids, probs, raw_logprobs)


def sample(logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, list[list[Logprob]] | None]:
    """logits [B, V] float32 -> sampled ids [B], and per-row logprob records if any row asked."""
    s = draw(logits, b)
    return s.ids, logprob_records(s, s.ids, b.max_logprobs)


def logprob_records(s: Samples, ids: torch.Tensor | list[int], k: int) -> list[list[Logprob]] | None:
    """Logprob records of the tokens finally kept per row (a draft's verifier may keep others than drawn);
    None, at no cost, when no row asked."""
    if s.raw_logprobs is None:
        return None
    return _logprobs(s.raw_logprobs, torch.as_tensor(ids, device=s.raw_logprobs.device), k)


def _logprobs(lp: torch.Tensor, ids: torch.Tensor, k: int) -> list[list[Logprob]]:
    chosen = lp.gather(-1, ids[:, None]).squeeze(-1)
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    top_v, top_i = lp.topk(max(k, 0), dim=-1) if k > 0 else (lp[:, :0], ids[:, None][:, :0])
    return [[(c, r, ti, tv)] for c, r, ti, tv in
            zip(chosen.tolist(), ranks.tolist(), top_i.tolist(), top_v.tolist())]


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> list[Logprob]:
    """Logprob records of the actual next prompt tokens given each prompt position's logits."""
    lp = logits.log_softmax(-1)
    return [rec[0] for rec in _logprobs(lp, next_ids, k)]
