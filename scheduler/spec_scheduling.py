"""The scheduler's speculative-decoding half: lookahead slots, and drafts taken into a step and settled
after it (the proposers themselves run in the workers: gpu_worker/spec_decode/).

A mixin of `Scheduler` (scheduler.py), kept apart as beam_scheduling.py is. It uses the scheduler's
config, its running queue and its stats.

    known tokens  t0 t1 t2 | drafts d0 d1 | lookahead (a draft model's own drafts' KV)
    step computes          t2 d0 d1          the worker samples after t2, d0 and d1
    settled: d0 accepted, d1 rejected ──► num_computed_tokens rolls back by 1; d1's slot is overwritten
"""
from __future__ import annotations

from scheduler.sequence import Sequence


class SpecScheduling:
    def _lookahead(self, seq: Sequence, n: int) -> int:
        """Extra KV slots for a step that samples: a draft model writes its drafts' KV past the step's
        tokens while proposing (none for the n-gram proposer). Never past the context limit or the
        sequence's longest possible length, which admission made sure fits the pool."""
        k = self.config.spec_lookahead_slots
        end = seq.num_computed_tokens + n
        if not k or end < seq.num_tokens:
            return 0
        return max(0, min(k, self.config.max_model_len - end, seq.num_prompt_tokens + seq.max_tokens - end))

    def _take_drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts a decoding sequence verifies this step, within the budget, max_tokens and the context
        (the step also samples one token of its own after them); none when the batch is too large to pay."""
        drafts, seq.spec_token_ids = seq.spec_token_ids, []
        limit = self.config.spec_disable_by_batch_size
        if not drafts or (limit is not None and len(self.running) >= limit):
            return []
        room = min(budget, seq.max_tokens - len(seq.output_token_ids), self.config.max_model_len - seq.num_tokens) - 1
        after = self.config.long_rope_after
        if after is not None and seq.num_tokens <= after:   # drafts stay short of LongRoPE's switch, which
            room = min(room, after - seq.num_tokens)         # recomputes the sequence once its tokens pass it
        return drafts[:max(room, 0)]

    def _settle_drafts(self, seq: Sequence, num_sampled: int) -> None:
        """Roll back the lookahead slots of rejected drafts: their KV is overwritten by the next step, and
        since only known tokens are ever hashed, no cached block holds them."""
        drafts, seq.num_inflight_drafts = seq.num_inflight_drafts, 0
        if not drafts:
            return
        accepted = num_sampled - 1
        st = self.stats
        st.spec_num_accepted_tokens += accepted
        st.spec_accepted_per_pos += [0] * (drafts - len(st.spec_accepted_per_pos))
        for i in range(accepted):
            st.spec_accepted_per_pos[i] += 1
        if seq.num_computed_tokens:          # 0: preempted by recompute meanwhile, nothing to roll back
            seq.num_computed_tokens -= drafts - accepted
