"""The `pagedserve` command: `serve` runs the whole service on this machine; `scheduler`, `worker` and
`router` run one part each (as docker-compose does)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from common.config import EngineConfig

DEFAULT_FRONTEND = "tcp://127.0.0.1:5557"
DEFAULT_WORKERS = "tcp://127.0.0.1:5558"
_ENGINE_HELP = {
    "model": "model: nothing for SmolLM2-135M-Instruct, a Hugging Face folder, or a .gguf file",
    "kv_cache_memory": "GiB of memory for the KV cache on CPU",
    "swap_space": "GiB of host memory for swapped-out KV blocks (0 disables swapping)",
    "num_gpu_blocks": "fix the number of KV blocks instead of sizing from memory",
}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, so the CLI and the config cannot drift apart."""
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "model":
            continue
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=_ENGINE_HELP.get(f.name))
        else:
            kind = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float,
                    "str | None": str}.get(str(f.type), str)
            p.add_argument(flag, type=kind, default=f.default, help=_ENGINE_HELP.get(f.name))
    p.add_argument("--log-level", default="INFO")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
    p.add_argument("--max-body-bytes", type=int, default=16 << 20)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="scheduler, workers and routers on this machine")
    serve.add_argument("model", nargs="?", default=None)
    add_engine_args(serve)
    add_router_args(serve)
    serve.add_argument("--router-replicas", type=int, default=1)

    sched = sub.add_parser("scheduler", help="the scheduler process alone")
    sched.add_argument("model", nargs="?", default=None)
    add_engine_args(sched)
    sched.add_argument("--frontend", default=DEFAULT_FRONTEND, help="address routers connect to")
    sched.add_argument("--workers", default=DEFAULT_WORKERS, help="address workers connect to")

    worker = sub.add_parser("worker", help="one worker process alone")
    worker.add_argument("model", nargs="?", default=None)
    add_engine_args(worker)
    worker.add_argument("--connect", default=DEFAULT_WORKERS, help="the scheduler's worker address")
    worker.add_argument("--rank", type=int, default=0)

    router = sub.add_parser("router", help="one HTTP router replica alone")
    router.add_argument("model", nargs="?", default=None)
    router.add_argument("--connect", default=DEFAULT_FRONTEND, help="the scheduler's frontend address")
    add_router_args(router)
    router.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> None:
    from common.process import setup_logging
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    if args.command == "scheduler":
        from scheduler.scheduler_process import run_scheduler
        run_scheduler(engine_config(args), args.frontend, args.workers, args.tensor_parallel_size)
    elif args.command == "worker":
        from gpu_worker.worker import run_worker
        run_worker(engine_config(args), args.connect, args.rank)
    elif args.command == "router":
        from common.process import die_with_parent
        from router.serve import run_router
        die_with_parent()
        args.engine_address = args.connect
        run_router(args)
    else:
        sys.exit(serve(args))


def serve(args: argparse.Namespace) -> int:
    """Start every part as a child process; Ctrl-C or SIGTERM drains the routers, then stops the rest."""
    run_dir = tempfile.mkdtemp(prefix="pagedserve-")
    frontend, workers = f"ipc://{run_dir}/frontend.ipc", f"ipc://{run_dir}/workers.ipc"
    flags = engine_flags(args)
    model = [args.model] if args.model else []
    exe = [sys.executable, "-m", "pagedserve.cli"]
    children: list[subprocess.Popen] = []
    threads = args.num_threads

    def spawn(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        p = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
        children.append(p)
        return p

    spawn(exe + ["scheduler", *model, *flags, "--frontend", frontend, "--workers", workers],
          {"OMP_NUM_THREADS": "1"})
    for rank in range(args.tensor_parallel_size):
        spawn(exe + ["worker", *model, *flags, "--connect", workers, "--rank", str(rank)],
              {"OMP_NUM_THREADS": str(threads)} if threads else None)
    router_flags = ["--host", args.host, "--port", str(args.port), "--connect", frontend,
                    "--max-body-bytes", str(args.max_body_bytes), "--shutdown-timeout", str(args.shutdown_timeout),
                    "--log-level", args.log_level]
    if args.served_model_name:
        router_flags += ["--served-model-name", args.served_model_name]
    routers = [spawn(exe + ["router", *model, *router_flags], {"PAGEDSERVE_API_KEY": args.api_key or "",
                                                                 "OMP_NUM_THREADS": "1"})
               for _ in range(args.router_replicas)]
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while stop["signal"] is None and all(r.poll() is None for r in routers) and children[0].poll() is None:
            time.sleep(0.2)
        for r in routers:   # routers first: they drain in-flight requests
            if r.poll() is None:
                r.send_signal(signal.SIGTERM)
        _wait(routers, args.shutdown_timeout + 10)
    finally:
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        _wait(children, 10)
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _wait(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags that differ from their defaults, re-emitted for the scheduler and workers."""
    out = ["--log-level", args.log_level]
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name)
        if f.name == "model" or value == f.default:
            continue
        flag = f.name.replace("_", "-")
        out += ([f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)])
    return out


if __name__ == "__main__":
    main()
