"""Start `pagedserve` processes for tests on 127.0.0.1 with free ports, and always stop them; and the one way
the end-to-end tests wait for something: poll the condition itself until a deadline (`wait_until`)."""
from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Mapping

from pagedserve.engine_processes import free_port

REPO = Path(__file__).resolve().parent.parent
LOG_TAIL = 3000            # characters of a log shown when a process fails


# ---- waiting ---------------------------------------------------------------------------------------
def _polls(timeout: float, what: str | Callable[[], str]) -> Iterator[None]:
    """One turn per poll until `timeout` seconds have passed, then an AssertionError naming `what`
    (a string, or a callable evaluated only then, e.g. to show the last value seen or a log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        yield
    yield                  # a last look, at or past the deadline
    raise AssertionError(f"not within {timeout:g}s: {what() if callable(what) else what}")


def wait_until(cond: Callable[[], Any], timeout: float, what: str | Callable[[], str],
               interval: float = 0.05) -> Any:
    """Call `cond` every `interval` seconds until it returns something truthy, and return that; after
    `timeout` seconds fail with `what`, the condition that never held. `cond` may raise to fail at once."""
    for _ in _polls(timeout, what):
        if value := cond():
            return value
        time.sleep(interval)


async def async_wait_until(cond: Callable[[], Any | Awaitable[Any]], timeout: float,
                           what: str | Callable[[], str], interval: float = 0.05) -> Any:
    """`wait_until` inside an event loop: `cond` may be a coroutine function, and the loop keeps running."""
    for _ in _polls(timeout, what):
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(interval)


# ---- probes ----------------------------------------------------------------------------------------
def listens(port: int) -> bool:
    """Whether a socket listens on 127.0.0.1:`port`, read from /proc/net/tcp. Nothing connects to it: a
    ZeroMQ socket counts a peer that connects and goes away (the scheduler takes it for a dead worker)."""
    local, listen_state = f"0100007F:{port:04X}", "0A"
    with open("/proc/net/tcp") as f:
        return any(row[1] == local and row[3] == listen_state for row in (line.split() for line in f))


def is_ready(base_url: str, headers: dict[str, str] | None = None) -> bool:
    """One GET of `/ready` on a fresh connection: True on 200."""
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{base_url}/ready", headers=headers or {}),
                                    timeout=2) as r:
            return r.status == 200
    except OSError:        # refused, reset, or an HTTP error status (HTTPError is an OSError)
        return False


def assert_running(procs: Mapping[str, subprocess.Popen], logs: Callable[[], str]) -> bool:
    """True while every process runs; an AssertionError with `logs()` as soon as one has exited."""
    exited = {name: p.returncode for name, p in procs.items() if p.poll() is not None}
    assert not exited, f"exited (name: return code): {exited}\n{logs()}"
    return True


def wait_ready(base_url: str, procs: Mapping[str, subprocess.Popen], timeout: float,
               logs: Callable[[], str], headers: dict[str, str] | None = None) -> None:
    """Wait until `/ready` answers 200, failing at once if any of `procs` exits first."""
    wait_until(lambda: assert_running(procs, logs) and is_ready(base_url, headers), timeout,
               lambda: f"{base_url}/ready answering 200\n{logs()}", interval=0.3)


# ---- processes -------------------------------------------------------------------------------------
def spawn(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`pagedserve ARGS`, i.e. `python -m pagedserve.cli ARGS` with this interpreter from the repo root
    (so the checkout's code runs), its output in `log_path`; `env` is added to this process's environment."""
    with open(log_path, "wb") as logf:
        return subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *args], stdout=logf,
                                stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})})


class Server:
    """A running `pagedserve serve`; `.url` is its base URL, `.proc` the supervisor process."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path):
        self.proc, self.port, self.log_path = proc, port, log_path
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self) -> str:
        return self.log()[-LOG_TAIL:]

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
def run_server(*args: str, log_dir: Path, ready_timeout: float = 180.0, env: dict | None = None,
               api_key: str | None = None):
    """`pagedserve serve ARGS` on 127.0.0.1 and a free port, ready (with `api_key`, its /ready is asked
    with the key: it answers 401 without), and stopped on exit whatever happened."""
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    key_args = ("--api-key", api_key) if api_key else ()
    proc = spawn(["serve", *args, *key_args, "--host", "127.0.0.1", "--port", str(port)], log_path, env)
    server = Server(proc, port, log_path)
    try:
        wait_ready(server.url, {"serve": proc}, ready_timeout, server.log_tail,
                   {"Authorization": f"Bearer {api_key}"} if api_key else None)
        yield server
    finally:
        server.stop()
