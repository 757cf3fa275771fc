"""Starts, restarts and stops the engine's processes on this machine: the scheduler and one worker per
tensor-parallel rank, connected over IPC sockets in a private folder. `pagedserve serve` adds routers in
front of them and calls `restart_exited` to heal the engine; AsyncLLMEngine talks to the scheduler itself
and reports a dead engine instead (as vLLM's does)."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

log = logging.getLogger("pagedserve")

BACKOFF_FIRST_S = 1.0       # the first restart's delay; each further one doubles it, up to BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_S = 60.0      # a child that ran this long since its last restart starts from BACKOFF_FIRST_S
STOP_GRACE_S = 5.0          # a whole-engine restart: how long the other children get to exit on SIGTERM


@dataclass
class Backoff:
    """Delays between restarts of one child: 1, 2, 4 .. 30 s, back to 1 s after a long enough run."""
    failures: int = 0
    last_start: float = field(default_factory=time.monotonic)

    def next_delay(self, now: float) -> float:
        if now - self.last_start >= BACKOFF_RESET_S:
            self.failures = 0
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** self.failures)
        self.failures += 1
        return delay


@dataclass
class EngineProcesses:
    run_dir: str
    frontend: str                                   # the scheduler's address for routers and clients
    workers: str = ""                               # the scheduler's address for the workers
    procs: list[subprocess.Popen] = field(default_factory=list)
    num_engine: int = 0                             # procs[:num_engine]: the scheduler and the workers
    commands: list[tuple[list[str], dict | None]] = field(default_factory=list)   # how procs[i] was started
    backoff: dict[int, Backoff] = field(default_factory=dict)
    restart_at: dict[int, float] = field(default_factory=dict)   # engine child index -> when to start it again
    restarts: int = 0
    whole_engine: bool = False                      # tensor parallelism: restart every engine child together
    kill_at: float | None = None                    # while the engine stops whole: when survivors get SIGKILL

    @classmethod
    def start(cls, model: str | None, flags: list[str], num_threads: int | None, tensor_parallel_size: int,
              topology: "Topology | None" = None) -> "EngineProcesses":
        """`flags`: engine flags for both kinds of process (cli.engine_flags / config_flags)."""
        eng = cls.create(topology)
        eng.spawn(["scheduler", *([model] if model else []), *flags, "--frontend", eng.frontend,
                   "--workers", eng.workers, "--ready-file", eng.ready_file], {"OMP_NUM_THREADS": "1"})
        eng.spawn_workers(model, flags, num_threads, tensor_parallel_size, topology)
        return eng

    @classmethod
    def create(cls, topology: "Topology | None" = None) -> "EngineProcesses":
        run_dir = tempfile.mkdtemp(prefix="pagedserve-")
        workers = topology.scheduler_addr if topology and topology.scheduler_addr else f"ipc://{run_dir}/workers.ipc"
        return cls(run_dir, f"ipc://{run_dir}/frontend.ipc", workers)

    def spawn_workers(self, model: str | None, flags: list[str], num_threads: int | None,
                      tensor_parallel_size: int, topology: "Topology | None" = None) -> None:
        """This machine's ranks, 0 .. local_ranks-1, each with its share of the cores unless num_threads
        says otherwise (the offline API with tensor parallelism calls this alone)."""
        topology = topology or Topology()
        local = topology.local_ranks if topology.local_ranks is not None else tensor_parallel_size
        group = ["--dist-init-addr", topology.dist_init_addr or f"127.0.0.1:{free_port()}"] \
            if tensor_parallel_size > 1 else []
        threads = num_threads or (max(1, usable_cpus() // max(1, local)) if tensor_parallel_size > 1 else None)
        self.whole_engine = tensor_parallel_size > 1
        for rank in range(local):
            self.spawn(["worker", *([model] if model else []), *flags, "--connect", self.workers,
                        "--rank", str(rank), *group], {"OMP_NUM_THREADS": str(threads)} if threads else None)
        self.num_engine = len(self.procs)

    def spawn(self, cli_args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """`pagedserve CLI_ARGS` as a child, stopped with the others. The parent has resolved the model
        (a hub id is in the local cache by then), so children never contact the hub (HF_HUB_OFFLINE)."""
        p = self._popen(cli_args, env)
        self.procs.append(p)
        self.commands.append((cli_args, env))
        return p

    @staticmethod
    def _popen(cli_args: list[str], env: dict[str, str] | None) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *cli_args],
                                env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})

    @property
    def ready_file(self) -> str:
        """The scheduler touches it after each warm-up: the engine has served at least once."""
        return os.path.join(self.run_dir, "ready")

    @property
    def came_up(self) -> bool:
        return os.path.exists(self.ready_file)

    def restart_exited(self, now: float | None = None) -> str | None:
        """One supervision pass: an engine child that exited is started again after its back-off. A
        child that exits before the engine ever came up (a bad checkpoint, a bad flag) is not retried:
        the reason is returned and the service should stop. With tensor parallelism the engine restarts
        whole: a torch.distributed group cannot take a new member, so the first exit stops every other
        engine child (SIGTERM, then SIGKILL after STOP_GRACE_S: a rank may sit in a collective), and
        none starts again before all have exited."""
        now = time.monotonic() if now is None else now
        engine = self.procs[:self.num_engine]
        for i, p in enumerate(engine):
            if p.poll() is None or i in self.restart_at:
                continue
            if not self.came_up:
                return f"the engine's {_role(p)} process exited with code {p.returncode} during start-up"
            delay = self.backoff.setdefault(i, Backoff()).next_delay(now)
            self.restart_at[i] = now + delay
            log.error("the engine's %s process exited with code %d; restarting it in %.0fs", _role(p),
                      p.returncode, delay)
            if self.whole_engine and self.kill_at is None:
                self._stop_engine(now)
        if self.kill_at is not None:
            if len(self.restart_at) < len(engine):
                if now >= self.kill_at:
                    for p in engine:
                        if p.poll() is None:
                            p.kill()
                return None
            self.kill_at = None                     # every old process is gone: the group can form again
        for i, at in list(self.restart_at.items()):
            if now >= at:
                del self.restart_at[i]
                self.procs[i] = self._popen(*self.commands[i])
                self.backoff[i].last_start = now
                self.restarts += 1
        return None

    def _stop_engine(self, now: float) -> None:
        """SIGTERM for the ranks; SIGUSR1 for the scheduler, which then fails its requests with an engine
        error (scheduler_process.py) rather than ending them as aborted, as a graceful stop does."""
        log.error("tensor-parallel engine: stopping its other processes to restart the group whole")
        for p in self.procs[:self.num_engine]:
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1 if p is self.scheduler else signal.SIGTERM)
        self.kill_at = now + STOP_GRACE_S

    @property
    def scheduler(self) -> subprocess.Popen:
        return self.procs[0]

    def exited(self) -> str | None:
        """Which engine child (scheduler or worker) has exited, if one has: the engine is dead then."""
        for p in self.procs[:self.num_engine]:
            if p.poll() is not None:
                return f"the engine's {_role(p)} process exited with code {p.returncode}"
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every child still running, kill what outlives `timeout`, remove the socket folder."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        wait_all(self.procs, timeout)
        shutil.rmtree(self.run_dir, ignore_errors=True)


@dataclass
class Topology:
    """Where the ranks of a tensor-parallel group live. Defaults: all on this machine, every socket on
    IPC or loopback. `local_ranks` < the group's size leaves the other ranks to `pagedserve worker` on
    other hosts, which reach the scheduler at `scheduler_addr` (tcp://IP:PORT) and rank 0's TCP store at
    `dist_init_addr` (IP:PORT)."""
    local_ranks: int | None = None
    scheduler_addr: str | None = None
    dist_init_addr: str | None = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _role(p: subprocess.Popen) -> str:
    """scheduler, worker or router: the subcommand it was started with."""
    return p.args[3]
