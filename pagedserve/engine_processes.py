"""Starts and stops the engine's processes on this machine: the scheduler and one worker per tensor-parallel
rank, connected over IPC sockets in a private folder. `pagedserve serve` adds routers in front of them;
AsyncLLMEngine talks to the scheduler itself."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field


@dataclass
class EngineProcesses:
    run_dir: str
    frontend: str                                   # the scheduler's address for routers and clients
    procs: list[subprocess.Popen] = field(default_factory=list)
    num_engine: int = 0                             # procs[:num_engine]: the scheduler and the workers

    @classmethod
    def start(cls, model: str | None, flags: list[str], num_threads: int | None,
              tensor_parallel_size: int) -> "EngineProcesses":
        """`flags`: engine flags for both kinds of process (cli.engine_flags / config_flags)."""
        run_dir = tempfile.mkdtemp(prefix="pagedserve-")
        eng = cls(run_dir, f"ipc://{run_dir}/frontend.ipc")
        workers = f"ipc://{run_dir}/workers.ipc"
        args = [model] if model else []
        eng.spawn(["scheduler", *args, *flags, "--frontend", eng.frontend, "--workers", workers],
                  {"OMP_NUM_THREADS": "1"})
        for rank in range(tensor_parallel_size):
            eng.spawn(["worker", *args, *flags, "--connect", workers, "--rank", str(rank)],
                      {"OMP_NUM_THREADS": str(num_threads)} if num_threads else None)
        eng.num_engine = len(eng.procs)
        return eng

    def spawn(self, cli_args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """`pagedserve CLI_ARGS` as a child, stopped with the others. The parent has resolved the model
        (a hub id is in the local cache by then), so children never contact the hub (HF_HUB_OFFLINE)."""
        p = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *cli_args],
                             env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        self.procs.append(p)
        return p

    @property
    def scheduler(self) -> subprocess.Popen:
        return self.procs[0]

    def exited(self) -> str | None:
        """Which engine child (scheduler or worker) has exited, if one has: the engine is dead then."""
        for p in self.procs[:self.num_engine]:
            if p.poll() is not None:
                return f"the engine's {p.args[3]} process exited with code {p.returncode}"
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every child still running, kill what outlives `timeout`, remove the socket folder."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        wait_all(self.procs, timeout)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
