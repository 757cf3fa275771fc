"""A worker process: one per tensor-parallel rank. It announces itself to the scheduler, joins its
tensor-parallel group, loads its shard of the model, and then executes each step it receives; every rank
samples the same tokens (gpu_worker/parallel.py) and rank 0 returns them. A rank whose step fails in a
group of several exits: a group that lost a member's collective cannot go on, and the supervisor
restarts the engine whole."""
from __future__ import annotations

import logging
import signal
import sys
import traceback

import zmq

from common.config import EngineConfig
from common.process import die_with_parent, freeze_startup_heap
from common.protocol import STARTUP_TIMEOUT_S, Hello, ModelRunnerOutput, SchedulerOutput, WorkerInit, WorkerReady, decode, encode

log = logging.getLogger("pagedserve.worker")


def run_worker(config: EngineConfig, address: str, rank: int = 0, dist_init_addr: str | None = None) -> None:
    from gpu_worker.model_runner import ModelRunner, resolve_device   # torch loads after the cheap set-up
    from gpu_worker.parallel import init_tensor_parallel, shutdown_tensor_parallel
    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # exit cleanly, closing the socket
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker_identity(rank))
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
    sock.connect(address)
    sock.send(encode(Hello(f"worker-{rank}")))   # queued until connected: the scheduler sees who is here
    log.info("worker %d connecting to %s", rank, address)
    try:
        size = config.tensor_parallel_size
        if size > 1 and not dist_init_addr:
            raise SystemExit("a worker of a tensor-parallel group needs --dist-init-addr HOST:PORT")
        init_tensor_parallel(rank, size, dist_init_addr or "", resolve_device(config.device), STARTUP_TIMEOUT_S)
        runner = ModelRunner(config)
        freeze_startup_heap()
        if not serve_steps(sock, monitor, runner, rank, size):
            sys.exit(1)        # without tearing the group down: a peer is gone, a barrier would wait for it
        shutdown_tensor_parallel()
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()


def worker_identity(rank: int) -> bytes:
    """The name a rank's socket has at the scheduler (executor.py reads the rank back from it)."""
    return f"worker-{rank}".encode()


def serve_steps(sock: zmq.Socket, monitor: zmq.Socket, runner, rank: int, group_size: int = 1) -> bool:
    """Answer the scheduler until it says stop (None): True. Every (re)connection to a scheduler gets a
    Hello, so a scheduler that restarted alone finds this worker again; its WorkerInit starts a new
    session, in which nothing of the old one (sequences, adapters, cache contents) exists. False: a
    step failed in a group of several ranks, which this rank leaves (module docstring)."""
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
            if out.error and group_size > 1:
                return False
        elif isinstance(msg, WorkerInit):
            if sessions:
                log.info("worker %d: a new scheduler session; forgetting the old one's state", rank)
                runner.reset()
            sessions += 1
            sock.send(encode(WorkerReady(rank, runner.initialize(msg.eos_token_ids))))
        elif msg is None:   # shutdown
            return True
