"""Start and stop a server process for the benchmark (`pagedserve serve`, llama.cpp's `llama-server`), the
router microbenchmark and locust checks.

The server runs as a child in its own process group (it starts a scheduler, worker and router of its own),
so a server that does not shut down on SIGTERM can be killed as a whole group and never outlives the run.
Its log goes to a file whose tail is shown when start-up fails, since the benchmark otherwise keeps going.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from loadtest.workload import REPO_ROOT
from pagedserve.engine_processes import free_port


class ServerFailed(RuntimeError):
    pass


class ServerProcess:
    """`with Server(...) as srv: srv.url ...` — a server on 127.0.0.1 at a free port, started, ready (its
    `ready_path` answers 200), and always stopped. Subclasses say how to start it (`command`)."""
    ready_path = "/ready"
    log_prefix = "server-bench-"

    def __init__(self, startup_timeout: float = 600.0, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = self.command(self.port)
        self.startup_timeout = startup_timeout
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.log_path = Path(tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")[1])

    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"server exited with code {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as r:
                    if r.status == 200:
                        self.ready = True
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise ServerFailed(f"server not ready after {self.startup_timeout:.0f}s: {self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the server drains and stops its children), then SIGKILL the whole group."""
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:   # whatever is left of the group (the serve process's children), by its id
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if p.poll() is None:
            p.wait(5)
        self.proc = None
        if self.ready:
            self.log_path.unlink(missing_ok=True)   # keep the log only when start-up failed

    def log_tail(self) -> str:
        """The log's last line (a traceback's exception line), and where the whole log is."""
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return f"{lines[-1][:300] if lines else 'no output'} (log: {self.log_path})"


class PagedServeServer(ServerProcess):
    """`pagedserve serve` with the given engine flags."""
    log_prefix = "pagedserve-bench-"

    def __init__(self, engine_flags: list[str] | None = None, model: str | None = None,
                 startup_timeout: float = 600.0, env: dict[str, str] | None = None):
        self.engine_flags, self.model = engine_flags or [], model
        super().__init__(startup_timeout, env)

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "pagedserve.cli", "serve", *([self.model] if self.model else []),
                "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout", "5", "--log-level", "WARNING",
                *self.engine_flags]
