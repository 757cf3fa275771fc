"""The engine core: one scheduler plus an executor, stepped in a loop by the offline API or by the
scheduler process. It turns requests into per-sequence outputs and knows nothing of text."""
from __future__ import annotations

import logging

from common.config import EngineConfig
from common.protocol import EngineOutput, EngineRequest
from scheduler.executor import Executor
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler

log = logging.getLogger("pagedserve.engine")


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, eos_token_ids: list[int]):
        self.config = config
        self.executor = executor
        info = executor.initialize(eos_token_ids)
        self.max_model_len = info.max_model_len
        self.num_blocks = info.num_blocks
        self.scheduler = Scheduler(SchedulerConfig.from_engine(config, info), eos_token_ids)
        self.weight_bytes = info.weight_bytes
        log.info("model weights: %.1f MiB per worker", info.weight_bytes / (1 << 20))
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB), %d host blocks for swap; %.1f concurrent requests "
                 "at max_model_len %d", info.num_blocks, config.block_size,
                 info.num_blocks * info.block_bytes / (1 << 30), info.num_host_blocks,
                 info.num_blocks * config.block_size / self.max_model_len, self.max_model_len)

    def add_request(self, req: EngineRequest) -> None:
        self.scheduler.add_request(req)

    def abort(self, request_ids: list[str], indexes: list[int] | None = None) -> list[EngineOutput]:
        """Abort whole requests, or (with indexes, -1 = all) single choices of them."""
        return self.scheduler.abort_requests(request_ids, indexes)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        result = self.executor.execute(sched)
        return self.scheduler.update_from_output(sched, result)

    def shutdown(self) -> None:
        self.executor.shutdown()
