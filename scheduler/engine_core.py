"""The engine core: one scheduler plus an executor, stepped in a loop by the offline API or by the
scheduler process. It turns requests into per-sequence outputs and knows nothing of text."""
from __future__ import annotations

import logging

from common.config import EngineConfig
from common.lora import LoRAError, LoRARequest, check_lora_config, parse_lora_module
from common.protocol import EngineOutput, EngineRequest, ModelRunnerOutput, SchedulerOutput, WorkerInfo
from scheduler.admission import RequestRejected
from scheduler.executor import Executor
from scheduler.config import SchedulerConfig
from scheduler.lora_registry import LoRAAdapter, LoRARegistry
from scheduler.scheduler import Scheduler

log = logging.getLogger("pagedserve.engine")


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, eos_token_ids: list[int]):
        self.config = config
        self.executor = executor
        check_lora_config(config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
                          config.lora_modules)
        info = executor.initialize(eos_token_ids)
        _check_workers_lora(config, info)
        self.max_model_len = info.max_model_len
        self.num_blocks = info.num_blocks
        self.scheduler = Scheduler(SchedulerConfig.from_engine(config, info), eos_token_ids)
        self.weight_bytes = info.weight_bytes
        self.loras = LoRARegistry(config.enable_lora, info.lora_targets, info.num_layers, config.max_lora_rank)
        for spec in config.lora_modules or []:
            adapter = self.loras.load(parse_lora_module(spec))
            log.info("LoRA adapter %r (rank %d) from %s", adapter.name, adapter.info.rank, adapter.path)
        log.info("model weights: %.1f MiB per worker", info.weight_bytes / (1 << 20))
        groups = len(info.kv_group_windows)     # a block id holds one group's layers (common/kv_layout.py)
        log.info("KV cache: %d blocks of %d tokens in %d layer group(s) (%.2f GiB), %d host blocks for swap; "
                 "%.1f concurrent requests at max_model_len %d (more where windows release blocks)", info.num_blocks,
                 config.block_size, groups, info.num_blocks * info.block_bytes / (1 << 30), info.num_host_blocks,
                 info.num_blocks * config.block_size / groups / self.max_model_len, self.max_model_len)

    def add_request(self, req: EngineRequest) -> None:
        try:
            adapter = self.loras.resolve(req.lora_request)
        except LoRAError as e:
            raise RequestRejected(str(e), e.code, "model" if e.param == "lora_name" else e.param) from None
        self.scheduler.add_request(req, adapter)
        if adapter is not None:
            self.loras.count_request(adapter)

    def load_lora(self, req: LoRARequest) -> LoRAAdapter:
        """Serve a new adapter from now on (LoRAError if it cannot be)."""
        return self.loras.load(req)

    def unload_lora(self, name: str) -> None:
        self.loras.unload(name)

    def abort(self, request_ids: list[str], indexes: list[int] | None = None) -> list[EngineOutput]:
        """Abort whole requests, or (with indexes, -1 = all) single choices of them."""
        return self.scheduler.abort_requests(request_ids, indexes)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        """One synchronous step (the offline API, the warm-up). With no step in flight an empty schedule
        while requests remain can never change by itself: that is a scheduler bug, raised, not a hang."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError(f"the scheduler can run none of its unfinished requests "
                                   f"({self.scheduler.snapshot()})")
            return []
        return self.update_from_output(sched, self.executor.execute(sched))

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineOutput]:
        """The scheduler's outputs for a step's result; an adapter a worker could not load is no longer
        served (its name answers 404 until it is loaded again)."""
        for key, error in result.lora_errors.items():
            adapter = self.loras.drop_key(key)
            log.error("LoRA adapter %r is no longer served: %s", adapter.name if adapter else key, error)
        return self.scheduler.update_from_output(sched, result)

    def shutdown(self) -> None:
        self.executor.shutdown()


def _check_workers_lora(config: EngineConfig, info: WorkerInfo) -> None:
    """Scheduler and workers started with different LoRA flags (separate processes) would fail every step
    that uses an adapter: refuse to start instead."""
    want = (config.max_loras, config.max_lora_rank) if config.enable_lora else (0, 0)
    got = (info.max_loras, info.max_lora_rank)
    if want != got:
        raise RuntimeError(f"the workers run with LoRA (max_loras, max_lora_rank) = {got} but the scheduler with "
                           f"{want}: start every process with the same --enable-lora/--max-loras/--max-lora-rank")
