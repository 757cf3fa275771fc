"""The scheduler process: receives requests from router replicas, steps the engine core against the
worker processes, and sends each replica the new tokens of its own requests.

While a step runs on the workers this loop keeps serving the routers (adds, aborts, heartbeats), so a
new request or a disconnect is seen within one step.
"""
from __future__ import annotations

import logging
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path

import zmq

from common.config import EngineConfig
from common.lora import LoRAError
from common.model_source import ModelSource, eos_token_ids
from common.process import die_with_parent, freeze_startup_heap
from common.protocol import (CLIENT_TTL_S, HEARTBEAT_S, AbortRequests, Ack, EngineOutput, EngineOutputs,
                             EngineRequest, Hello, LoadLoRA, SchedulerOutput, Stats, UnloadLoRA, decode, encode)
from common.sampling_params import SamplingParams
from scheduler.engine_core import EngineCore
from scheduler.executor import WorkerDied, ZmqExecutor
from scheduler.admission import RequestRejected

log = logging.getLogger("pagedserve.scheduler")

STATS_LOG_S = 10.0
PIPELINE_DEPTH = 2


class SchedulerProcess:
    def __init__(self, config: EngineConfig, frontend: str, workers: str, num_workers: int = 1,
                 ready_file: str | None = None):
        self.ready_file = ready_file
        self.exit_code = 0
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind(frontend)
        self.clients: dict[bytes, float] = {}        # router identity -> last heard
        self.owner: dict[str, bytes] = {}            # request id -> router identity
        self.dead: str | None = None
        self.broken: str | None = None                 # SIGUSR1: another process of the group died
        self.ready = False
        self.stopping = False
        self.inflight: list[SchedulerOutput] = []
        self.last_heartbeat = self.last_log = 0.0
        self.last_counts = (0, 0, time.monotonic())
        source = ModelSource.from_config(config, config.load_format != "dummy")
        eos = eos_token_ids(source.model_config(), source.load_tokenizer())
        self.executor = ZmqExecutor(self.ctx, workers, num_workers)
        self.core = EngineCore(config, self.executor, eos)
        self.sched = self.core.scheduler

    # ---- main loop ---------------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGUSR1, lambda *_: self._group_broken())
        self._warm_up()
        while not self.stopping:
            try:
                self._drain_frontend(timeout_ms=0 if self._busy() else int(HEARTBEAT_S * 1000))
                if not self.dead:
                    if not self.stopping:     # a worker stopping with us is no failure
                        self.executor.check_alive()
                    self._advance()
            except WorkerDied as e:
                self._die(str(e))
            self._heartbeat()
        if self.broken and not self.dead:
            self._die(self.broken)
        self._shutdown()

    def _group_broken(self) -> None:
        """`pagedserve serve`'s word (SIGUSR1) that another process of this tensor-parallel group died and
        the group restarts whole: what runs fails as on a dead engine, with an error each stream shows,
        instead of ending as aborted as on a graceful stop (SIGTERM). It may come before this process
        sees the rank go."""
        self.broken = "a tensor-parallel rank exited; the engine restarts whole"
        self.stopping = True

    def _busy(self) -> bool:
        return bool(self.inflight) or (not self.dead and self.sched.has_unfinished())

    def _advance(self) -> None:
        """Keep two steps in flight: step N+1 is scheduled and queued on the workers while step N computes
        (the worker already holds N's samples), then N's result is collected, serving routers meanwhile."""
        while len(self.inflight) < PIPELINE_DEPTH and self.sched.has_unfinished():
            sched = self.sched.schedule()
            if sched.is_empty:
                break
            self.executor.submit(sched)
            self.inflight.append(sched)
        if not self.inflight:
            return
        result = self.executor.poll_result(timeout_ms=1)
        while result is None:
            self._drain_frontend(timeout_ms=0)
            self._heartbeat()
            if self.stopping or self.dead:
                return
            result = self.executor.poll_result(timeout_ms=5)
        sched = self.inflight.pop(0)
        assert result.step_id == sched.step_id, "workers answer steps in order"
        self._route(self.core.update_from_output(sched, result))

    def _warm_up(self) -> None:
        """One tiny request through the whole path before /ready turns green."""
        t0 = time.perf_counter()
        self.core.add_request(EngineRequest("__warmup__", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0,
                                                                                       ignore_eos=True)))
        while self.core.has_unfinished():
            self.core.step()
        self.ready = True
        if self.ready_file:
            Path(self.ready_file).touch()     # tells the supervisor (pagedserve serve) this engine came up
        log.info("warm-up done in %.2fs; ready", time.perf_counter() - t0)

    # ---- routers -----------------------------------------------------------------------------
    def _drain_frontend(self, timeout_ms: int) -> None:
        if not self.front.poll(timeout_ms):
            return
        while True:
            try:
                ident, data = self.front.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.clients[ident] = time.monotonic()
            self._handle(ident, decode(data))

    def _handle(self, ident: bytes, msg) -> None:
        if isinstance(msg, EngineRequest):
            ack = Ack(msg.request_id)
            if self.dead or self.stopping or not self.ready:
                ack.code, ack.error = 503, self.dead or "the engine is not ready"
            else:
                try:
                    msg.arrival_time = time.monotonic()   # router clocks are not ours
                    self.core.add_request(msg)
                    self.owner[msg.request_id] = ident
                except RequestRejected as e:
                    ack.code, ack.error, ack.param = e.code, str(e), e.param
            self._send(ident, ack)
        elif isinstance(msg, AbortRequests):
            outs = self.core.abort(list(msg.request_ids), msg.indexes)   # per choice where given
            self._route(outs)
        elif isinstance(msg, (LoadLoRA, UnloadLoRA)):
            self._send(ident, self._lora_control(msg))
        elif isinstance(msg, Hello):
            pass

    def _lora_control(self, msg: LoadLoRA | UnloadLoRA) -> Ack:
        """Load or unload an adapter. On success every router gets fresh Stats before this one gets its Ack,
        so its /v1/models already shows the change when its HTTP call returns."""
        ack = Ack(msg.request_id)
        if self.dead or self.stopping:
            ack.code, ack.error = 503, self.dead or "the engine is stopping"
            return ack
        try:
            if isinstance(msg, LoadLoRA):
                adapter = self.core.load_lora(msg.lora)
                log.info("LoRA adapter %r (rank %d) loaded from %s", adapter.name, adapter.info.rank, adapter.path)
            else:
                self.core.unload_lora(msg.lora_name)
                log.info("LoRA adapter %r unloaded", msg.lora_name)
        except LoRAError as e:
            ack.code, ack.error, ack.param = e.code, str(e), e.param
            return ack
        self._broadcast_stats(time.monotonic())
        return ack

    def _route(self, outputs: list[EngineOutput]) -> None:
        by_client: dict[bytes, list[EngineOutput]] = defaultdict(list)
        for eo in outputs:
            ident = self.owner.get(eo.request_id)
            if ident is not None:
                by_client[ident].append(eo)
        for ident, outs in by_client.items():
            self._send(ident, EngineOutputs(outs))
        for eo in outputs:
            if eo.request_id not in self.sched.groups:
                self.owner.pop(eo.request_id, None)

    def _send(self, ident: bytes, msg) -> None:
        try:
            self.front.send_multipart([ident, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            log.warning("dropping a message for an unreachable router %r", ident)

    # ---- health and stats --------------------------------------------------------------------
    def _die(self, reason: str) -> None:
        """A worker is gone: fail every request at once, tell the routers (their /health turns 503), and
        exit non-zero. The block pool mirrors caches that no longer exist, so the way back is a fresh
        engine: the other ranks are told to stop too (a tensor-parallel group cannot heal a missing rank),
        and `pagedserve serve` (or docker's restart policy) starts each process again. A scheduler that is
        restarted alone finds its workers without this: they say Hello to it (gpu_worker/worker.py)."""
        log.error("engine dead: %s; exiting for a restart", reason)
        self.dead = reason
        self.inflight = []
        ids = list(self.sched.groups)
        self.sched.abort_requests(ids)
        self._route([EngineOutput(rid, -1, [], finish_reason="error", error=f"engine failure: {reason}")
                     for rid in ids])
        self._broadcast_stats(time.monotonic())
        self.stopping, self.exit_code = True, 1

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self.last_heartbeat < HEARTBEAT_S:
            return
        self._broadcast_stats(now)
        if now - self.last_log >= STATS_LOG_S:
            self._log_stats(now)

    def _broadcast_stats(self, now: float) -> None:
        """Stats to every router heard from lately (forgetting the others)."""
        self.last_heartbeat = now
        stats = Stats(self.ready and not self.stopping, self.dead, self.core.max_model_len, self.values())
        for ident, seen in list(self.clients.items()):
            if now - seen > CLIENT_TTL_S:
                del self.clients[ident]
            else:
                self._send(ident, stats)

    def values(self) -> dict:
        st = self.sched.stats
        return {**self.sched.snapshot(), "num_preemptions": st.num_preemptions,
                "prompt_tokens": st.prompt_tokens, "generation_tokens": st.generation_tokens,
                "prefix_cache_queries": st.prefix_cache_queries, "prefix_cache_hits": st.prefix_cache_hits,
                "admission_rejections": st.admission_rejections, "finished": dict(st.finished),
                "num_steps": st.num_steps, "num_step_seqs": st.num_step_seqs,
                "num_requests": self.sched.num_unfinished_requests,
                "spec_num_drafts": st.spec_num_drafts, "spec_num_draft_tokens": st.spec_num_draft_tokens,
                "spec_num_accepted_tokens": st.spec_num_accepted_tokens,
                "spec_accepted_per_pos": list(st.spec_accepted_per_pos),
                "iteration_tokens": list(st.iteration_tokens), "iteration_tokens_sum": st.iteration_tokens_sum,
                **self._lora_values()}

    def _lora_values(self) -> dict:
        """For /v1/models and the lora metrics: adapters served, those running and waiting, requests each."""
        loras = self.core.loras
        if not loras.enabled:
            return {}
        return {"max_lora": self.sched.config.max_loras,
                "lora_adapters": [[a.name, a.path, a.parent] for a in loras.by_name.values()],
                "lora_running": _adapter_names(self.sched.running),
                "lora_waiting": _adapter_names([*self.sched.waiting, *self.sched.swapped]),
                "lora_requests": dict(loras.requests)}

    def _log_stats(self, now: float) -> None:
        st = self.sched.stats
        p0, g0, t0 = self.last_counts
        dt = max(now - t0, 1e-6)
        snap = self.sched.snapshot()
        hit = st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else 0.0
        log.info("prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d, swapped %d | KV cache %.1f%% | "
                 "prefix-cache hit rate %.1f%% | preemptions %d", (st.prompt_tokens - p0) / dt,
                 (st.generation_tokens - g0) / dt, snap["running"], snap["waiting"], snap["swapped"],
                 100 * snap["kv_cache_usage"], 100 * hit, st.num_preemptions)
        if st.spec_num_drafts:
            log.info("speculative decoding: mean acceptance length %.2f, draft acceptance rate %.1f%%",
                     1 + st.spec_num_accepted_tokens / st.spec_num_drafts,
                     100 * st.spec_num_accepted_tokens / max(st.spec_num_draft_tokens, 1))
        self.last_counts = (st.prompt_tokens, st.generation_tokens, now)
        self.last_log = now

    def _shutdown(self) -> None:
        log.info("scheduler stopping")
        ids = list(self.sched.groups)
        if ids:
            self._route(self.sched.abort_requests(ids))
        self.executor.shutdown()
        self.front.close(linger=1000)     # what was just routed (errors, aborts) still reaches the routers
        self.ctx.term()


def _adapter_names(seqs) -> list[str]:
    return sorted({s.lora.name for s in seqs if s.lora is not None})


def run_scheduler(config: EngineConfig, frontend: str, workers: str, num_workers: int = 1,
                  ready_file: str | None = None) -> None:
    """Runs until SIGTERM (exit 0) or a worker's death (exit 1, after failing every request)."""
    die_with_parent()
    proc = SchedulerProcess(config, frontend, workers, num_workers, ready_file)
    freeze_startup_heap()
    proc.run()
    sys.exit(proc.exit_code)
