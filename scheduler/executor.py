"""How the engine core reaches its model runner(s): in this process (offline API, tests) or over
ZeroMQ to worker processes (serving). Both answer the same three calls."""
from __future__ import annotations

from typing import Any, Protocol

from common.config import EngineConfig
from common.protocol import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    def initialize(self, eos_token_ids: list[int]) -> dict[str, Any]:
        """Load the model, size and allocate the KV cache; return num_blocks, num_host_blocks, max_model_len."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class InprocExecutor:
    def __init__(self, config: EngineConfig, source=None):
        from gpu_worker.model_runner import ModelRunner  # the scheduler package itself stays tensor-free
        self.runner = ModelRunner(config, source)

    def initialize(self, eos_token_ids: list[int]) -> dict[str, Any]:
        return initialize_runner(self.runner, eos_token_ids)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)

    def shutdown(self) -> None:
        pass


def initialize_runner(runner, eos_token_ids: list[int]) -> dict[str, Any]:
    runner.eos_ids |= set(eos_token_ids)
    num_blocks, num_host = runner.profile_num_blocks()
    runner.init_kv_cache(num_blocks, num_host)
    return {"num_blocks": num_blocks, "num_host_blocks": num_host, "max_model_len": runner.max_model_len,
            "block_bytes": runner.block_bytes()}
