"""`pagedserve serve`'s supervision of the engine (pagedserve/engine_processes.py): the back-off between
restarts, no retries for a child that dies before the engine ever came up, and a restart with the child's
own command once it has. Real child processes, stand-ins for the scheduler and the workers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.engine_processes import BACKOFF_MAX_S, BACKOFF_RESET_S, Backoff, EngineProcesses

pytestmark = pytest.mark.unit


def test_backoff_doubles_up_to_its_cap_and_resets_after_a_long_run() -> None:
    b = Backoff(last_start=0.0)
    assert [b.next_delay(1.0) for _ in range(7)] == [1, 2, 4, 8, 16, BACKOFF_MAX_S, BACKOFF_MAX_S]
    b.last_start = 100.0
    assert b.next_delay(100.0 + BACKOFF_RESET_S) == 1


def _engine(tmp_path: Path, monkeypatch, exit_code: int) -> tuple[EngineProcesses, list[list[str]]]:
    """An engine of one child, `python -c 'exit(code)'` under the role name 'scheduler'; every start
    (the first and the restarts) is recorded."""
    started: list[list[str]] = []

    def popen(cli_args, env):
        started.append(cli_args)
        p = subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({exit_code})", *cli_args])
        p.wait()
        return p
    monkeypatch.setattr(EngineProcesses, "_popen", staticmethod(popen))
    eng = EngineProcesses(str(tmp_path), "ipc://unused")
    eng.spawn(["scheduler", "--frontend", "x"])
    eng.num_engine = 1
    return eng, started


def test_a_child_that_dies_before_the_engine_came_up_stops_the_service(tmp_path, monkeypatch) -> None:
    eng, started = _engine(tmp_path, monkeypatch, 3)
    why = eng.restart_exited(now=0.0)
    assert why == "the engine's scheduler process exited with code 3 during start-up"
    assert eng.restart_exited(now=100.0) == why and len(started) == 1      # never retried


def test_after_the_engine_came_up_a_dead_child_is_restarted_after_its_backoff(tmp_path, monkeypatch) -> None:
    eng, started = _engine(tmp_path, monkeypatch, 1)
    Path(eng.ready_file).touch()                 # what the scheduler does after its warm-up
    first = eng.procs[0]
    assert eng.restart_exited(now=10.0) is None and eng.restart_at == {0: 11.0}
    assert eng.restart_exited(now=10.9) is None and eng.procs[0] is first       # still backing off
    assert eng.restart_exited(now=11.0) is None and eng.procs[0] is not first
    assert started == [["scheduler", "--frontend", "x"]] * 2 and eng.restarts == 1
    assert eng.restart_exited(now=11.5) is None and eng.restart_at == {0: 13.5}   # died again: 2 s


CHILD = """
import signal, sys, pathlib
out = pathlib.Path(sys.argv[1])
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, lambda s, _: (out.write_text(signal.Signals(s).name), sys.exit(0)))
out.write_text("ready")
if sys.argv[2] == "die":
    sys.exit(1)
while True:
    signal.pause()
"""


def test_a_tensor_parallel_group_stops_whole_and_tells_its_scheduler_why(tmp_path, monkeypatch) -> None:
    """A rank exits: the other rank gets SIGTERM, and the scheduler SIGUSR1, on which it fails its
    requests with an engine error rather than ending them as aborted (scheduler_process.py)."""
    from tests.server_utils import wait_until

    def popen(cli_args, env):
        return subprocess.Popen([sys.executable, "-c", CHILD, *cli_args])
    monkeypatch.setattr(EngineProcesses, "_popen", staticmethod(popen))
    eng = EngineProcesses(str(tmp_path), "ipc://unused")
    files = [tmp_path / f"{name}.txt" for name in ("scheduler", "rank0", "rank1")]
    for f, mode in zip(files, ("wait", "wait", "die")):
        eng.spawn([str(f), mode])
    eng.num_engine, eng.whole_engine = 3, True
    Path(eng.ready_file).touch()
    wait_until(lambda: all(f.exists() for f in files) and eng.procs[2].poll() is not None, 30,
               "the children to install their handlers and rank 1 to exit")
    assert eng.restart_exited(now=10.0) is None
    for p in eng.procs[:2]:
        p.wait(timeout=30)
    assert [f.read_text() for f in files] == ["SIGUSR1", "SIGTERM", "ready"]
