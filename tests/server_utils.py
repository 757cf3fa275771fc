"""Start `pagedserve` processes for tests on 127.0.0.1 with free ports, and always stop them."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base_url}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{base_url} not ready after {timeout}s")


class Server:
    """A running `pagedserve serve`; `.url` is its base URL, `.proc` the supervisor process."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path):
        self.proc, self.port, self.log_path = proc, port, log_path
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        """PIDs of the processes `serve` started (scheduler, workers, routers)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def stop(self, timeout: float = 30.0) -> int | None:
        pids = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in pids:   # never leave a child behind, whatever happened
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.returncode


@contextmanager
def run_server(*args: str, log_dir: Path, ready_timeout: float = 180.0, env: dict | None = None):
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, **(env or {})})
    server = Server(proc, port, log_path)
    try:
        wait_ready(server.url, ready_timeout, proc)
        yield server
    finally:
        server.stop()
