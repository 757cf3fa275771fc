"""The scheduler's configuration: the engine flags it acts on, plus the facts only the workers know
(cache size, context limit, vocabulary), joined once at start-up."""
from __future__ import annotations

from dataclasses import dataclass

from common.config import EngineConfig
from common.protocol import WorkerInfo
from common.speculative import SpeculativeConfig


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_model_len: int = 2048
    vocab_size: int | None = None
    block_size: int = 16
    num_blocks: int = 1024
    num_host_blocks: int = 0
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"    # scheduler/block_hash.py
    max_waiting_requests: int = 4096
    max_waiting_tokens: int = 1 << 22
    speculative: bool = False                   # drafts may arrive from the workers' proposer
    spec_disable_by_batch_size: int | None = None
    spec_lookahead_slots: int = 0               # KV slots past a sampling step's tokens, for a draft model's drafts
    max_loras: int = 0                          # adapter slots on the workers; 0: LoRA is off
    kv_group_windows: tuple = (None,)           # common/kv_layout.py: the block table's groups
    long_rope_after: int | None = None          # WorkerInfo.long_rope_after

    @classmethod
    def from_engine(cls, engine: EngineConfig, worker: WorkerInfo) -> "SchedulerConfig":
        spec = SpeculativeConfig.parse(engine.speculative_config)
        return cls(max_num_batched_tokens=engine.max_num_batched_tokens, max_num_seqs=engine.max_num_seqs,
                   max_model_len=worker.max_model_len, vocab_size=worker.vocab_size,
                   block_size=engine.block_size, num_blocks=worker.num_blocks,
                   num_host_blocks=worker.num_host_blocks,
                   enable_prefix_caching=engine.enable_prefix_caching and worker.prefix_caching,
                   prefix_caching_hash_algo=engine.prefix_caching_hash_algo,
                   max_waiting_requests=engine.max_waiting_requests,
                   max_waiting_tokens=engine.max_waiting_tokens, speculative=spec is not None,
                   spec_disable_by_batch_size=spec.disable_by_batch_size if spec else None,
                   spec_lookahead_slots=spec.lookahead_slots if spec else 0,
                   max_loras=worker.max_loras, kv_group_windows=tuple(worker.kv_group_windows),
                   long_rope_after=worker.long_rope_after)
