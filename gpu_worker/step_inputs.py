"""The worker's per-sequence state, and the flat input tensors of one step built from it.

    SchedulerOutput ──apply deltas──► SequenceState (per sequence) ──build_step_inputs──► StepInputs
                                                                    (pure: reads state, changes nothing)

A step runs `num_new_tokens` tokens of every scheduled sequence, concatenated without padding. Row r of
the flat batch is token `positions[r]` of its sequence; its key/value is written to cache slot
`slot_mapping[r]`. A sequence that reaches the end of its known tokens samples: from its last row, or,
with k draft tokens appended (speculative decoding), from each of its last k + 1 rows, so the verifier
sees the target model's choice after every draft:

    known tokens  t0 t1 t2 | drafts d0 d1      scheduled: t2 d0 d1  (num_new_tokens = 3)
    logits rows            ^t2   ^d0  ^d1  ──► 3 samples: after t2, after d0, after d1
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from common.protocol import NewSequenceData
from common.sampling_params import SamplingParams
from gpu_worker.attention import AttentionMetadata


@dataclass
class SequenceState:
    seq_id: str
    token_ids: list[int]                 # prompt + outputs known to the worker (its own samples included)
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    lora_id: int = 0
    seed: int | None = None
    spec_token_ids: list[int] = field(default_factory=list)   # drafts to verify this step
    draft_probs: torch.Tensor | None = None   # [k, V] what the drafts were drawn from; None: deterministic
    proposer_state: Any = None                # a proposer's own per-sequence bookkeeping
    grammar: Any = None                       # structured output: structured_output/manager.GrammarState

    @classmethod
    def from_new(cls, r: NewSequenceData, device: torch.device) -> "SequenceState":
        gen = None
        if r.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(r.seed & 0xFFFF_FFFF_FFFF_FFFF)
        return cls(r.seq_id, list(r.token_ids), r.num_prompt_tokens, r.sampling_params, list(r.block_ids),
                   r.num_computed_tokens, gen, r.lora_id, r.seed)

    def draw_generator(self) -> torch.Generator | None:
        """The generator for this sequence's next draw, seeded from (seed, output index): draw k of a
        seeded request is the same alone, in any batch, and after a preemption, which drops this state
        and rebuilds it from the seed (a generator carried along would restart from draw 0)."""
        if self.generator is not None and self.seed is not None:
            self.generator.manual_seed(self._mixed_seed(0, 0))
        return self.generator

    def generator_for(self, offset: int, salt: int) -> torch.Generator | None:
        """A fresh generator for the draw at output index num_output_tokens + offset in stream `salt`;
        None for an unseeded sequence (which draws from the global generator)."""
        if self.generator is None or self.seed is None:
            return None
        gen = torch.Generator(device=self.generator.device)
        gen.manual_seed(self._mixed_seed(offset, salt))
        return gen

    def _mixed_seed(self, offset: int, salt: int) -> int:
        index = self.num_output_tokens + offset
        return (self.seed * 0x9E3779B97F4A7C15 + index + salt * 0xD1B54A32D192ED03) & 0xFFFF_FFFF_FFFF_FFFF

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class PromptLogprobRows:
    """Rows whose logits predict the next prompt token, for a sequence that asked for prompt logprobs."""
    rows: torch.Tensor          # [m] rows of the flat batch
    next_ids: torch.Tensor      # [m] the prompt tokens those rows predict
    first_chunk: bool           # the chunk starts at position 0, whose token nothing predicts


@dataclass
class StepInputs:
    input_ids: torch.Tensor                 # [T]
    positions: torch.Tensor                 # [T]
    seq_ends: torch.Tensor                  # [T] its sequence's known tokens (drafts not counted): LongRoPE's choice
    attn_groups: list[AttentionMetadata]    # per KV group (common/kv_layout.py): the same rows, its own tables
    logits_indices: torch.Tensor            # [R] rows to compute logits on and sample from
    sample_seq_ids: list[str]               # sequences that sample this step, in row order
    num_samples: list[int]                  # logits rows per sampling sequence: 1, or k + 1 with k drafts
    prompt_logprobs: dict[str, PromptLogprobRows]
    lora_ids: torch.Tensor | None = None    # [T] adapter key per row, on the CPU; None when all run the base model

    @property
    def attn(self) -> AttentionMetadata:
        """The metadata of a model with one KV group (every model without sliding windows)."""
        assert len(self.attn_groups) == 1, "this model's layers read several KV groups: use attn_groups"
        return self.attn_groups[0]

    def sampling_states(self, states: dict[str, SequenceState]) -> list[SequenceState]:
        """The state behind each logits row. A sequence with drafts owns k + 1 consecutive rows; row j sees
        the first j drafts as already generated, so penalties, min_tokens and a seed's draw (seeded by output
        index) apply as they would then."""
        rows = []
        for seq_id, k in zip(self.sample_seq_ids, self.num_samples):
            st = states[seq_id]
            rows.append(st)
            rows += [row_state(st, st.spec_token_ids[:j]) for j in range(1, k)]
        return rows


def row_state(st: SequenceState, ahead: list[int]) -> SequenceState:
    """The state a logits row samples from when `ahead` tokens follow st's known ones: penalties,
    min_tokens and a seed's draw (seeded by output index) apply as they would then. The state itself
    where nothing of that differs."""
    if ahead and (_reads_history(st) or st.generator is not None):
        return replace(st, token_ids=st.token_ids + ahead, generator=_fresh(st.generator))
    return st


def _fresh(gen: torch.Generator | None) -> torch.Generator | None:
    """A generator of its own for a draft row: each row is seeded for its own output index."""
    return None if gen is None else torch.Generator(device=gen.device)


def _reads_history(st: SequenceState) -> bool:
    """Whether sampling looks at the generated tokens: penalties, or min_tokens not reached yet (a row
    further ahead may be past it, where the end-of-sequence ban lifts)."""
    p = st.params
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                or st.num_output_tokens < p.min_tokens)


def build_step_inputs(states: dict[str, SequenceState], scheduled: list[tuple[str, int]], block_size: int,
                      device: torch.device, num_groups: int = 1) -> StepInputs:
    """Flat inputs for `scheduled` (seq_id, num_new_tokens) pairs, in that order; `num_groups`: the KV
    groups interleaved in each block table (common/kv_layout.py)."""
    tokens: list[int] = []
    ctx_lens, q_lens, tables, lora, known_lens = [], [], [], [], []
    sample_ids, num_samples = [], []
    for seq_id, n in scheduled:
        st = states[seq_id]
        start = st.num_computed_tokens
        known_lens.append(len(st.token_ids))
        known = st.token_ids + st.spec_token_ids if st.spec_token_ids else st.token_ids
        tokens.extend(known[start:start + n])
        ctx_lens.append(start)
        q_lens.append(n)
        tables.append(st.block_ids)
        lora.append(st.lora_id)
        if start + n >= len(st.token_ids) + len(st.spec_token_ids):
            sample_ids.append(seq_id)
            num_samples.append(1 + len(st.spec_token_ids))
    groups = [_attention_metadata(ctx_lens, q_lens, [t[g::num_groups] for t in tables], block_size)
              for g in range(num_groups)]
    qsl = groups[0][1]
    row = {seq_id: i for i, (seq_id, _) in enumerate(scheduled)}
    ends = qsl[1:].tolist()
    logits_rows = [ends[row[s]] - k + j for s, k in zip(sample_ids, num_samples) for j in range(k)]
    seq_idx = torch.repeat_interleave(torch.arange(len(scheduled)), torch.tensor(q_lens))
    positions = _row_positions(groups[0][0], qsl, seq_idx)
    for meta, _ in groups:               # the same positions in every group, in its own blocks
        _fill_slots(meta, positions, seq_idx)
    return StepInputs(
        input_ids=torch.tensor(tokens, device=device),
        positions=positions.to(device),
        seq_ends=torch.tensor(known_lens)[seq_idx].to(device),
        attn_groups=[_to(meta, device) for meta, _ in groups],
        logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=device),
        sample_seq_ids=sample_ids, num_samples=num_samples,
        prompt_logprobs=_prompt_logprob_rows(states, scheduled, qsl, device),
        lora_ids=torch.tensor(lora)[seq_idx] if any(lora) else None)


def decode_inputs(tables: list[list[int]], positions: list[int], token_ids: list[int], block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids, positions, metadata) of one token per sequence at `positions`: a draft model's
    autoregressive steps, which run outside the scheduled batch."""
    meta, qsl = _attention_metadata(positions, [1] * len(positions), tables, block_size)
    seq_idx = torch.arange(len(positions))
    pos = _row_positions(meta, qsl, seq_idx)
    _fill_slots(meta, pos, seq_idx)
    return torch.tensor(token_ids, device=device), pos.to(device), _to(meta, device)


def _attention_metadata(ctx_lens: list[int], q_lens: list[int], tables: list[list[int]],
                        block_size: int) -> tuple[AttentionMetadata, torch.Tensor]:
    num_seqs = len(q_lens)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    torch.cumsum(q_lens_t, 0, out=qsl[1:])
    ctx_t = torch.tensor(ctx_lens, dtype=torch.int32)
    seq_lens = ctx_t + q_lens_t
    bt = torch.zeros(num_seqs, max(len(t) for t in tables), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), query_start_loc=qsl, seq_lens=seq_lens,
        context_lens=ctx_t, block_tables=bt, block_size=block_size, max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()), query_lens_list=q_lens, seq_lens_list=seq_lens.tolist())
    return meta, qsl


def _row_positions(meta: AttentionMetadata, qsl: torch.Tensor, seq_idx: torch.Tensor) -> torch.Tensor:
    """Each row's position in its sequence."""
    rows = torch.arange(len(seq_idx))
    return rows - qsl[:-1].long()[seq_idx] + meta.context_lens.long()[seq_idx]


def _fill_slots(meta: AttentionMetadata, positions: torch.Tensor, seq_idx: torch.Tensor) -> None:
    """The slot mapping, which follows from the positions and the block tables."""
    bs = meta.block_size
    blocks = meta.block_tables[seq_idx, positions // bs].long()
    if len(blocks) and int(blocks.min()) < 0:
        raise RuntimeError("a token's KV slot lies in a block its window released")    # the scheduler's bug
    meta.slot_mapping = blocks * bs + positions % bs
    # released entries (NULL_BLOCK) lie outside every window from now on: read as block 0, always masked
    meta.block_tables.clamp_(min=0)


def _to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "context_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).to(device))
    return meta


def _prompt_logprob_rows(states: dict[str, SequenceState], scheduled: list[tuple[str, int]], qsl: torch.Tensor,
                         device: torch.device) -> dict[str, PromptLogprobRows]:
    out = {}
    for i, (seq_id, n) in enumerate(scheduled):
        st = states[seq_id]
        start = st.num_computed_tokens
        if st.params.prompt_logprobs is None or start >= st.num_prompt_tokens - 1:
            continue
        hi = min(start + n, st.num_prompt_tokens - 1)
        base = int(qsl[i]) - start
        out[seq_id] = PromptLogprobRows(torch.arange(base + start, base + hi, device=device),
                                        torch.tensor(st.token_ids[start + 1:hi + 1], device=device), start == 0)
    return out
