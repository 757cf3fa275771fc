"""The offline API's executor for a tensor-parallel group: the ranks run as worker processes of this
machine (one process cannot hold two ranks of a torch.distributed group), reached over the same ZeroMQ
executor the scheduler process uses; the engine core stays in the caller's process."""
from __future__ import annotations

import zmq

from common.config import EngineConfig
from common.protocol import ModelRunnerOutput, SchedulerOutput, WorkerInfo
from pagedserve.cli_args import config_flags
from pagedserve.engine_processes import EngineProcesses
from scheduler.executor import ZmqExecutor


class WorkerGroupExecutor:
    def __init__(self, config: EngineConfig, log_level: str = "WARNING"):
        self.procs = EngineProcesses.create()
        self.ctx = zmq.Context()
        self.executor = ZmqExecutor(self.ctx, self.procs.workers, config.tensor_parallel_size)
        try:
            self.procs.spawn_workers(config.model, ["--log-level", log_level, *config_flags(config)],
                                     config.num_threads, config.tensor_parallel_size)
        except BaseException:
            self.shutdown()
            raise

    @property
    def infos(self) -> dict[int, WorkerInfo]:
        """Each rank's own report (its weight bytes, its KV blocks)."""
        return self.executor.infos

    def initialize(self, eos_token_ids: list[int]) -> WorkerInfo:
        return self.executor.initialize(eos_token_ids)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.executor.execute(sched)

    def shutdown(self) -> None:
        if self.ctx.closed:
            return
        self.executor.shutdown()
        self.procs.stop()
        self.ctx.term()
