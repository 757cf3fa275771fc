"""The scheduler's counters: what the Stats heartbeat, the metrics and the logs report."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from common.protocol import ITERATION_TOKEN_BUCKETS


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    prefix_cache_queries: int = 0        # prompt tokens looked up
    prefix_cache_hits: int = 0           # prompt tokens found
    prompt_tokens: int = 0               # prompt tokens computed
    generation_tokens: int = 0
    admission_rejections: int = 0
    num_steps: int = 0                   # steps that ran something
    num_step_seqs: int = 0               # sequences over those steps: / num_steps = the mean batch
    spec_num_drafts: int = 0             # steps of a sequence that verified drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)   # [i]: steps that accepted draft i
    finished: dict[str, int] = field(default_factory=dict)
    # steps by tokens scheduled, per bucket of ITERATION_TOKEN_BUCKETS (+Inf last), and their total
    iteration_tokens: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    iteration_tokens_sum: int = 0

    def observe_step(self, num_seqs: int, num_tokens: int) -> None:
        self.num_steps += 1
        self.num_step_seqs += num_seqs
        self.iteration_tokens[bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.iteration_tokens_sum += num_tokens
