"""The executor that runs the model runner in this very process (offline API, tests).

It lives here, not in scheduler/, because it joins the two halves: the scheduler package never imports
the worker package, and pagedserve/ is the one place that composes them."""
from __future__ import annotations

from common.config import EngineConfig
from common.model_source import ModelSource
from common.protocol import ModelRunnerOutput, SchedulerOutput, WorkerInfo
from gpu_worker.model_runner import ModelRunner


class InprocExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None):
        self.runner = ModelRunner(config, source)

    def initialize(self, eos_token_ids: list[int]) -> WorkerInfo:
        return self.runner.initialize(eos_token_ids)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)

    def shutdown(self) -> None:
        pass
