"""How the engine core reaches its model runner(s): the Executor protocol, and its ZeroMQ implementation
for worker processes (serving). The in-process one (offline API, tests) lives in pagedserve/, the only
package allowed to join the scheduler and the worker in one process."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Protocol

import zmq

from common.protocol import (STARTUP_TIMEOUT_S, STEP_TIMEOUT_S, Hello, ModelRunnerOutput, SchedulerOutput,
                             WorkerInfo, WorkerInit, WorkerReady, decode, encode)

log = logging.getLogger("pagedserve.scheduler")


class Executor(Protocol):
    """What the engine core needs of the model runners, wherever they run."""

    def initialize(self, eos_token_ids: list[int]) -> WorkerInfo:
        """Load the model, size and allocate the KV cache, and say what was allocated."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class WorkerDied(RuntimeError):
    pass


class ZmqExecutor:
    """Worker processes over ZeroMQ. Each step is sent to every rank; rank 0 answers. A worker that
    disconnects (killed, crashed) or exceeds `step_timeout` raises WorkerDied instead of hanging."""

    def __init__(self, ctx, address: str, num_workers: int = 1, step_timeout: float = STEP_TIMEOUT_S,
                 startup_timeout: float = STARTUP_TIMEOUT_S):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.bind(address)
        if address.startswith("tcp://") and not address[6:].startswith(("127.", "localhost", "[::1]")):
            log.warning("the workers' socket listens on %s: it has no authentication, so anyone who reaches "
                        "it can drive the workers; keep it on a private network", address)
        self.num_workers = num_workers
        self.step_timeout = step_timeout
        self.startup_timeout = startup_timeout
        self.identities: list[bytes] = []
        self.infos: dict[int, WorkerInfo] = {}   # each rank's own report
        self.submitted: list[float] = []   # submit times of the steps in flight, oldest first

    def initialize(self, eos_token_ids: list[int]) -> WorkerInfo:
        """Wait for every rank's Hello, then its WorkerReady. The ranks' KV caches may differ (a rank with
        fewer KV heads fits more blocks, common/tp_layout.py): the engine gets the smallest."""
        deadline = time.monotonic() + self.startup_timeout
        # a worker (re)connected to us says Hello; anything else is left over from the scheduler before us
        while len(self.identities) < self.num_workers:
            ident, msg = self._recv(deadline, "connected")
            if isinstance(decode(msg), Hello) and ident not in self.identities:
                self.identities.append(ident)
        self.identities.sort()
        for ident in self.identities:
            self.sock.send_multipart([ident, encode(WorkerInit(eos_token_ids))])
        self.infos = {}
        while len(self.infos) < self.num_workers:
            _, msg = self._recv(deadline, "loaded the model")
            m = decode(msg)
            if isinstance(m, WorkerReady):
                self.infos[m.rank] = m.info
        if self.num_workers > 1:
            self._check_same_flags()
            for rank, info in sorted(self.infos.items()):
                log.info("rank %d: %.1f MiB of weights, %d KV blocks", rank, info.weight_bytes / (1 << 20),
                         info.num_blocks)
        return replace(self.infos[0], num_blocks=min(i.num_blocks for i in self.infos.values()),
                       num_host_blocks=min(i.num_host_blocks for i in self.infos.values()))

    def _check_same_flags(self) -> None:
        """Ranks started by hand on other hosts with other engine flags would compute garbage together."""
        want = self.infos[0].engine_flags
        for rank, info in sorted(self.infos.items()):
            diff = sorted(k for k in set(want) | set(info.engine_flags) if want.get(k) != info.engine_flags.get(k))
            if diff:
                raise WorkerDied(f"rank {rank} runs with other engine flags than rank 0: "
                                 + ", ".join(f"{k} {info.engine_flags.get(k)!r} (rank 0: {want.get(k)!r})"
                                             for k in diff) + "; start every rank with the same flags")

    def _recv(self, deadline: float, waiting_for: str) -> tuple[bytes, bytes]:
        while True:
            self._check_disconnect()
            if self.sock.poll(200):
                return tuple(self.sock.recv_multipart())  # type: ignore[return-value]
            if time.monotonic() > deadline:
                raise WorkerDied(f"workers did not start in time ({self.startup_timeout:.0f}s): "
                                 f"{self._missing(waiting_for)}")

    def _missing(self, waiting_for: str) -> str:
        """Which ranks the start-up is waiting for, by name."""
        done = set(self.infos) if waiting_for == "loaded the model" else \
            {int(i.split(b"-")[-1]) for i in self.identities if i.split(b"-")[-1].isdigit()}
        missing = [r for r in range(self.num_workers) if r not in done]
        return f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {self.num_workers} " \
               f"never {waiting_for}"

    def check_alive(self) -> None:
        """Raise WorkerDied if a worker disconnected, also while no step is in flight (an idle engine
        must report a dead rank too)."""
        self._check_disconnect()

    def _check_disconnect(self) -> None:
        if self.monitor.poll(0):
            self.monitor.recv_multipart()
            raise WorkerDied("a worker process disconnected")

    def submit(self, sched: SchedulerOutput) -> None:
        data = encode(sched)
        try:
            for ident in self.identities:
                self.sock.send_multipart([ident, data])
        except zmq.ZMQError as e:
            raise WorkerDied(f"cannot reach a worker: {e}") from e
        self.submitted.append(time.monotonic())

    def poll_result(self, timeout_ms: int) -> ModelRunnerOutput | None:
        """The pending step's result, or None if it is not there within timeout_ms."""
        self._check_disconnect()
        if not self.sock.poll(timeout_ms):
            if self.submitted and time.monotonic() - self.submitted[0] > self.step_timeout:
                raise WorkerDied(f"a step took longer than {self.step_timeout:.0f}s")
            return None
        _, msg = self.sock.recv_multipart()
        out = decode(msg)
        if not isinstance(out, ModelRunnerOutput):    # a Hello repeated by a worker's reconnection
            return None
        self.submitted.pop(0)
        if out.error:
            raise WorkerDied(f"the worker failed a step: {out.error.strip().splitlines()[-1]}")
        return out

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(sched)
        while True:
            out = self.poll_result(200)
            if out is not None:
                return out

    def shutdown(self) -> None:
        for ident in self.identities:
            try:
                self.sock.send_multipart([ident, encode(None)], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
