"""Issue #11 end to end: `pagedserve serve --tensor-parallel-size 2` on one machine, and a group whose
two ranks live on two hosts (network namespaces joined by a veth pair). A rank killed with -9 makes the
engine report dead within 5 s, ends the open streams with an error event, and leaves no process of the
old group behind; on one machine the supervisor then starts the group again, whole."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams
from tests.server_utils import REPO, run_server, wait_until
from tests.test_server_e2e import _roles, _streams_then_kill, parse_sse, pid_alive, request

pytestmark = pytest.mark.e2e

ENGINE = ("--dtype", "float32", "--kv-cache-memory", "0.2", "--swap-space", "0.05", "--num-threads", "1")
PROMPTS = ["The quick brown fox", "Paris is the capital of", "1, 2, 3, 4, 5"]
MAX_NEW = 8


def _tp1_texts(folder: str) -> list[str]:
    llm = LLM(folder, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _completion_body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.mark.timeout(300)
def test_a_killed_rank_is_reported_within_5s_and_the_group_restarts_whole(tmp_path, tiny_model) -> None:
    folder = str(tiny_model("llama"))
    want = _tp1_texts(folder)
    with run_server(folder, *ENGINE, "--tensor-parallel-size", "2", log_dir=tmp_path) as server:
        for prompt, text in zip(PROMPTS, want):
            status, _, body = request(server, "POST", "/v1/completions", _completion_body(prompt))
            assert status == 200 and json.loads(body)["choices"][0]["text"] == text, body
        before = _roles(server)
        assert len(before["worker"]) == 2 and len(before["scheduler"]) == 1, before
        rank1 = next(p for p in before["worker"] if "--rank 1" in Path(f"/proc/{p}/cmdline").read_bytes()
                     .replace(b"\0", b" ").decode())
        killed_at, results = asyncio.run(_streams_then_kill(server.url, 4, rank1))
        health = []
        wait_until(lambda: health.append(request(server, "GET", "/health", timeout=5)[0]) or health[-1] == 503,
                   5 - (time.monotonic() - killed_at), "/health to report the dead engine within 5 s", interval=0.05)
        print(f"\ndead reported {time.monotonic() - killed_at:.2f}s after kill -9 of rank 1")
        for status, raw in results:
            assert status == 503 or "engine failure" in parse_sse(raw)[-1]["error"]["message"], raw[-300:]
        old = before["worker"] + before["scheduler"]
        wait_until(lambda: not any(pid_alive(p) for p in old), 15, "every process of the old group to exit")

        def served() -> bool:
            status, _, body = request(server, "POST", "/v1/completions", _completion_body(PROMPTS[1]), timeout=60)
            assert status in (200, 503), body        # the engine is restarting: nothing else is acceptable
            return status == 200 and json.loads(body)["choices"][0]["text"] == want[1]
        wait_until(served, 60, "the restarted group to serve the same text", interval=0.2)
        after = _roles(server)
        assert len(after["worker"]) == 2 and not set(after["worker"]) & set(before["worker"]), (before, after)
        assert "restart the group whole" in server.log()


# ---- two hosts ------------------------------------------------------------------------------------------
HEAD, REMOTE = "10.213.0.1", "10.213.0.2"     # the veth pair's ends: no other address is used
CLIENT = r"""
import json, sys, urllib.error, urllib.request
method, url = sys.argv[1], sys.argv[2]
data = sys.argv[3].encode() if len(sys.argv) > 3 else None
req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        print(json.dumps([r.status, r.read().decode()]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, e.read().decode()]))
except OSError as e:
    print(json.dumps([0, str(e)]))
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def two_hosts():
    """Two network namespaces joined by a veth pair, HEAD and REMOTE on its ends; always removed."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("the two-host test needs root and iproute2 (ip netns), which these machines have")
    tag = f"{os.getpid() % 100000}"
    a, b = f"psa{tag}", f"psb{tag}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", f"pva{tag}", "type", "veth", "peer", "name", f"pvb{tag}")
        for ns, dev, addr in ((a, f"pva{tag}", HEAD), (b, f"pvb{tag}", REMOTE)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _in_ns(ns: str, args: list[str], log_path: Path) -> subprocess.Popen:
    """`pagedserve ARGS` inside namespace `ns` (ip netns exec execs it: the pid is the engine's own)."""
    with open(log_path, "wb") as logf:
        return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "pagedserve.cli", *args],
                                stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)


def _http(ns: str, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    args = ["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, method, f"http://127.0.0.1:8000{path}"]
    out = subprocess.run(args + ([json.dumps(body)] if body else []), capture_output=True, text=True, timeout=90)
    return tuple(json.loads(out.stdout))


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.mark.timeout(300)
def test_two_ranks_on_two_hosts_match_tp1_and_a_killed_remote_rank_kills_the_engine(tmp_path, tiny_model) -> None:
    folder = str(tiny_model("llama"))
    want = _tp1_texts(folder)
    group = ["--scheduler-addr", f"tcp://{HEAD}:5570", "--dist-init-addr", f"{HEAD}:29500"]
    with two_hosts() as (a, b):
        head = _in_ns(a, ["serve", folder, *ENGINE, "-tp", "2", "--local-ranks", "1", *group,
                          "--host", "127.0.0.1", "--port", "8000"], tmp_path / "head.log")
        remote = _in_ns(b, ["worker", folder, *ENGINE, "--world-size", "2", "--rank", "1", *group],
                        tmp_path / "remote.log")
        logs = lambda: (tmp_path / "head.log").read_text()[-3000:] + (tmp_path / "remote.log").read_text()[-2000:]  # noqa: E731
        try:
            wait_until(lambda: _http(a, "GET", "/ready")[0] == 200 or head.poll() is not None, 180,
                       lambda: f"the two-host engine to become ready:\n{logs()}", interval=0.2)
            assert head.poll() is None, logs()
            for prompt, text in zip(PROMPTS, want):
                status, body = _http(a, "POST", "/v1/completions", _completion_body(prompt))
                assert status == 200 and json.loads(body)["choices"][0]["text"] == text, body
            assert "rank 1 of 2 joined the gloo group" in (tmp_path / "remote.log").read_text()
            local_engine = [int(x) for x in subprocess.run(["pgrep", "-P", str(head.pid), "-f", "scheduler|worker"],
                                                            capture_output=True, text=True).stdout.split()]
            assert len(local_engine) == 2, local_engine           # the scheduler and rank 0
            remote.kill()
            killed_at = time.monotonic()
            wait_until(lambda: _http(a, "GET", "/health")[0] == 503, 5, lambda: f"dead within 5 s:\n{logs()}",
                       interval=0.05)
            print(f"\ntwo hosts: dead reported {time.monotonic() - killed_at:.2f}s after kill -9 of the remote rank")
            status, body = _http(a, "POST", "/v1/completions", _completion_body(PROMPTS[0]))
            assert status == 503, body
            assert "engine dead: a worker process disconnected" in (tmp_path / "head.log").read_text()
            wait_until(lambda: not any(pid_alive(p) for p in local_engine), 15,
                       "the head's rank 0 and scheduler to exit (no rank left waiting in a collective)")
        finally:
            _stop([head, remote])
