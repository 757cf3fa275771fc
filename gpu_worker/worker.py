"""A worker process: one per tensor-parallel rank. It connects to the scheduler, loads the model, and
then executes each step it receives; rank 0 returns the sampled tokens."""
from __future__ import annotations

import logging
import signal
import sys
import traceback

import zmq

from common.config import EngineConfig
from common.process import die_with_parent
from common.protocol import Hello, ModelRunnerOutput, SchedulerOutput, WorkerInit, WorkerReady, decode, encode

log = logging.getLogger("pagedserve.worker")


def run_worker(config: EngineConfig, address: str, rank: int = 0) -> None:
    from gpu_worker.model_runner import ModelRunner   # torch loads after the signal set-up below is cheap
    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # exit cleanly, closing the socket
    runner = ModelRunner(config)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"worker-{rank}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
    sock.connect(address)
    log.info("worker %d connecting to %s", rank, address)
    try:
        serve_steps(sock, monitor, runner, rank)
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()


def serve_steps(sock: zmq.Socket, monitor: zmq.Socket, runner, rank: int) -> None:
    """Answer the scheduler until it says stop (None). Every (re)connection to a scheduler gets a Hello,
    so a scheduler that restarted alone finds this worker again; its WorkerInit starts a new session, in
    which nothing of the old one (sequences, adapters, cache contents) exists."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    sessions = 0
    while True:
        ready = dict(poller.poll())
        if monitor in ready:
            monitor.recv_multipart()
            sock.send(encode(Hello(f"worker-{rank}")))
            log.info("worker %d connected to a scheduler", rank)
        if sock not in ready:
            continue
        msg = decode(sock.recv())
        if isinstance(msg, SchedulerOutput):
            try:
                out = runner.execute(msg)
            except Exception:   # report, so the scheduler fails requests instead of waiting forever
                log.exception("step %d failed", msg.step_id)
                out = ModelRunnerOutput(step_id=msg.step_id, error=traceback.format_exc(limit=5))
            if rank == 0:
                sock.send(encode(out))
        elif isinstance(msg, WorkerInit):
            if sessions:
                log.info("worker %d: a new scheduler session; forgetting the old one's state", rank)
                runner.reset()
            sessions += 1
            sock.send(encode(WorkerReady(rank, runner.initialize(msg.eos_token_ids))))
        elif msg is None:   # shutdown
            return
