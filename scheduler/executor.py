"""How the engine core reaches its model runner(s): the Executor protocol, and its ZeroMQ implementation
for worker processes (serving). The in-process one (offline API, tests) lives in pagedserve/, the only
package allowed to join the scheduler and the worker in one process."""
from __future__ import annotations

import time
from typing import Protocol

import zmq

from common.protocol import (STARTUP_TIMEOUT_S, STEP_TIMEOUT_S, Hello, ModelRunnerOutput, SchedulerOutput,
                             WorkerInfo, WorkerInit, WorkerReady, decode, encode)


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
        self.num_workers = num_workers
        self.step_timeout = step_timeout
        self.startup_timeout = startup_timeout
        self.identities: list[bytes] = []
        self.submitted: list[float] = []   # submit times of the steps in flight, oldest first

    def initialize(self, eos_token_ids: list[int]) -> WorkerInfo:
        deadline = time.monotonic() + self.startup_timeout
        # a worker (re)connected to us says Hello; anything else is left over from the scheduler before us
        while len(self.identities) < self.num_workers:
            ident, msg = self._recv(deadline)
            if isinstance(decode(msg), Hello) and ident not in self.identities:
                self.identities.append(ident)
        self.identities.sort()
        for ident in self.identities:
            self.sock.send_multipart([ident, encode(WorkerInit(eos_token_ids))])
        infos: dict[int, WorkerInfo] = {}
        while len(infos) < self.num_workers:
            _, msg = self._recv(deadline)
            m = decode(msg)
            if isinstance(m, WorkerReady):
                infos[m.rank] = m.info
        return infos[0]

    def _recv(self, deadline: float) -> tuple[bytes, bytes]:
        while True:
            self._check_disconnect()
            if self.sock.poll(200):
                return tuple(self.sock.recv_multipart())  # type: ignore[return-value]
            if time.monotonic() > deadline:
                raise WorkerDied("workers did not start in time")

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
