"""The router's connection to the scheduler process: send requests and aborts, receive each request's
outputs on its own queue, and track the scheduler's heartbeat for readiness.

One DEALER socket per router replica; the scheduler routes outputs back by the replica's identity, so
a replica only ever receives its own requests' tokens.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import zmq
import zmq.asyncio

from common.lora import LoRARequest
from common.protocol import (DEAD_AFTER_S, HEARTBEAT_S, AbortRequests, Ack, EngineOutput, EngineOutputs, EngineRequest,
                             Hello, LoadLoRA, Stats, UnloadLoRA, decode, encode)
from common.sampling_params import SamplingParams

log = logging.getLogger("pagedserve.router")


class EngineRejected(Exception):
    def __init__(self, code: int, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class EngineDead(Exception):
    pass


class EngineClient:
    def __init__(self, address: str, client_id: str | None = None):
        self.address = address
        self.client_id = client_id or f"router-{uuid.uuid4().hex[:8]}"
        self.ctx = zmq.asyncio.Context.instance()
        self.sock: zmq.asyncio.Socket | None = None
        self.queues: dict[str, asyncio.Queue[EngineOutput]] = {}
        self.acks: dict[str, asyncio.Future[Ack]] = {}
        self.stats: Stats | None = None
        self.stats_time = 0.0
        self._heard = asyncio.Event()      # set by the first Stats
        self._tasks: list[asyncio.Task] = []
        self._failed: str | None = None

    async def start(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.client_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.address)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop())]

    async def wait_for_stats(self, timeout: float) -> bool:
        """Wait until the scheduler has answered once (False after `timeout`: it is not up yet)."""
        try:
            await asyncio.wait_for(self._heard.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.sock is not None:
            self.sock.close(0)

    # ---- state -------------------------------------------------------------------------------
    @property
    def dead_reason(self) -> str | None:
        if self.stats is not None and self.stats.dead:
            return self.stats.dead
        if self.stats is not None and time.monotonic() - self.stats_time > DEAD_AFTER_S:
            return f"the scheduler has not answered for {time.monotonic() - self.stats_time:.1f}s"
        return None

    @property
    def ready(self) -> bool:
        return self.stats is not None and self.stats.ready and self.dead_reason is None

    @property
    def max_model_len(self) -> int | None:
        return self.stats.max_model_len if self.stats else None

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    # ---- requests ----------------------------------------------------------------------------
    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  timeout: float = 30.0, lora: LoRARequest | None = None) -> asyncio.Queue[EngineOutput]:
        """Submit a request (under the adapter `lora`: by name, or with its folder to load it on first
        use); returns its output queue once the scheduler has accepted it."""
        q: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self.queues[request_id] = q
        try:
            await self._acked(request_id, EngineRequest(request_id, prompt_token_ids, params, time.monotonic(),
                                                        self.client_id, lora), timeout)
        except BaseException:
            self.queues.pop(request_id, None)
            raise
        return q

    async def load_lora(self, request_id: str, lora: LoRARequest, timeout: float = 60.0) -> None:
        """Have the scheduler serve a new adapter; EngineRejected says why it will not."""
        await self._acked(request_id, LoadLoRA(request_id, lora), timeout)

    async def unload_lora(self, request_id: str, name: str, timeout: float = 30.0) -> None:
        await self._acked(request_id, UnloadLoRA(request_id, name), timeout)

    async def _acked(self, request_id: str, msg: object, timeout: float) -> None:
        """Send `msg` and wait for the scheduler's Ack of `request_id`; EngineRejected unless it is a 200."""
        reason = self.dead_reason
        if reason:
            raise EngineDead(reason)
        fut: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        self.acks[request_id] = fut
        try:
            await self.sock.send(encode(msg))
            # not asyncio.wait_for: before Python 3.12 it swallows a cancellation that lands in the same loop
            # iteration as the ack, so a client that hung up right then would never abort its request
            async with asyncio.timeout(timeout):
                ack = await fut
        finally:
            self.acks.pop(request_id, None)
        if ack.code != 200:
            raise EngineRejected(ack.code, ack.error or "rejected", ack.param)

    async def abort(self, request_id: str, index: int = -1, keep_queue: bool = False) -> None:
        """Abort a request (or one choice); `keep_queue`: its queue stays to receive the "abort" outputs the
        scheduler answers with, for a caller still reading it."""
        if index < 0 and not keep_queue:
            self.queues.pop(request_id, None)
        await self.sock.send(encode(AbortRequests([request_id], [index])))

    def release(self, request_id: str) -> None:
        """Forget a finished request's queue."""
        self.queues.pop(request_id, None)

    # ---- loops -------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            msg = decode(await self.sock.recv())
            if isinstance(msg, EngineOutputs):
                for eo in msg.outputs:
                    q = self.queues.get(eo.request_id)
                    if q is not None:
                        q.put_nowait(eo)
            elif isinstance(msg, Ack):
                fut = self.acks.get(msg.request_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, Stats):
                self.stats, self.stats_time = msg, time.monotonic()
                self._heard.set()
                if msg.dead:
                    self.fail_all(msg.dead)

    async def _heartbeat_loop(self) -> None:
        while True:
            await self.sock.send(encode(Hello(self.client_id)))
            reason = self.dead_reason
            if reason and self.queues:
                self.fail_all(reason)
            await asyncio.sleep(HEARTBEAT_S)

    def fail_all(self, reason: str) -> None:
        """End every open request with an error output so no client waits forever."""
        for rid, q in list(self.queues.items()):
            q.put_nowait(EngineOutput(rid, -1, [], finish_reason="error", error=f"engine failure: {reason}"))
        self.queues.clear()
        for fut in self.acks.values():
            if not fut.done():
                fut.set_exception(EngineDead(reason))
