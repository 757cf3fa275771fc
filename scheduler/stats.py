"""The scheduler's counters: what the Stats heartbeat, the metrics and the logs report."""
from __future__ import annotations

from dataclasses import dataclass, field


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
