"""The `pagedserve` command: `serve` runs the whole service on this machine; `scheduler`, `worker` and
`router` run one part each (as docker-compose does)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from typing import Any, TypeVar

from common.config import KV_CACHE_DTYPES, QUANTIZATION_ALIASES, QUANTIZATION_METHODS, EngineConfig
from common.lora import check_lora_config
from common.speculative import SpeculativeConfig
from pagedserve.engine_processes import EngineProcesses, wait_all
from router.config import API_KEY_ENV, DEFAULT_FRONTEND, RouterConfig

DEFAULT_WORKERS = "tcp://127.0.0.1:5558"
DEFAULT_LOG_LEVEL = "INFO"
_ENGINE_HELP = {
    "model": "model: nothing for SmolLM2-135M-Instruct, a Hugging Face folder, or a .gguf file",
    "kv_cache_memory": "GiB of memory for the KV cache on CPU",
    "swap_space": "GiB of host memory for swapped-out KV blocks (0 disables swapping)",
    "num_gpu_blocks": "fix the number of KV blocks instead of sizing from memory",
    "quantization": "auto (the checkpoint's own: GGUF blocks, AWQ, GPTQ or FP8), none (fp32 reference), int8, fp8 "
                    "(weights quantized at load), gguf, awq, gptq (also awq_marlin, gptq_marlin)",
    "calculate_kv_scales": "with an fp8 KV cache: each layer's k/v scales from the first forward pass's K and V "
                           "(largest magnitude at the format's largest value), not 1.0 or the checkpoint's",
    "kv_cache_dtype": "KV cache entries: auto (the model dtype), float32, bfloat16, float16, fp8 (= fp8_e4m3), "
                      "fp8_e5m2",
    "enable_lora": "serve LoRA adapters: requests choose one by its name in \"model\"",
    "max_loras": "adapters resident on the workers at once; a step never mixes more",
    "max_lora_rank": "the largest adapter rank accepted (the adapter slots are sized for it)",
    "max_cpu_loras": "adapters the workers keep in host memory (default: --max-loras)",
    "lora_modules": "adapters to serve from start-up: name=path, or JSON {\"name\", \"path\", \"base_model_name\"}",
}
_ROUTER_HELP = {
    "frontend_address": "the scheduler's frontend address",
    "served_model_name": "the model id clients send and see (default: the model's name)",
    "api_key": f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV})",
    "max_body_bytes": "largest request body accepted (413 above it)",
    "shutdown_timeout": "seconds in-flight requests get to finish on SIGTERM before they are aborted",
    "access_log": "log one line per HTTP request",
}
_FLAG_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float, "str | None": str}
Config = TypeVar("Config")


# ---- config dataclasses <-> flags ------------------------------------------------------------------
def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def add_config_args(p: argparse.ArgumentParser, config_cls: type, helps: dict[str, str], *,
                    skip: tuple[str, ...] = ("model",)) -> None:
    """One flag per field of a config dataclass, so the CLI and the config cannot drift apart. A bool field
    becomes --x/--no-x; a field's metadata may rename its flag ("flag") or default it from the environment
    ("env"). `skip`: fields a subcommand spells itself (the positional model) or sets itself."""
    for f in dataclasses.fields(config_cls):
        if f.name in skip:
            continue
        default = os.environ.get(f.metadata["env"], f.default) if "env" in f.metadata else f.default
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": helps.get(f.name)}
        if f.type in ("bool", bool):
            p.add_argument(_flag(f), action=argparse.BooleanOptionalAction, **kw)
        elif str(f.type).startswith("list[str]"):
            p.add_argument(_flag(f), nargs="+", type=str, **kw)
        else:
            p.add_argument(_flag(f), type=_FLAG_TYPES.get(str(f.type), str), **kw)


def config_from_args(config_cls: type[Config], args: argparse.Namespace, **overrides: Any) -> Config:
    """The config dataclass from parsed flags (see add_config_args); `overrides` for fields the subcommand
    sets itself rather than from a flag."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if f.name not in overrides}
    return config_cls(**values, **overrides)


def config_flags(config: Any, *, skip: tuple[str, ...] = ("model",)) -> list[str]:
    """The fields of a config dataclass that differ from their defaults, as flags for a child process."""
    out: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in skip or value == f.default:
            continue
        flag = _flag(f)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return out


def add_log_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default=DEFAULT_LOG_LEVEL)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p, EngineConfig, _ENGINE_HELP)
    add_log_level_arg(p)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(EngineConfig, args)


def add_router_args(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = ("model",)) -> None:
    add_config_args(p, RouterConfig, _ROUTER_HELP, skip=skip)


def router_config(args: argparse.Namespace, **overrides: Any) -> RouterConfig:
    return config_from_args(RouterConfig, args, **overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="scheduler, workers and routers on this machine")
    serve.add_argument("model", nargs="?", default=None)
    add_engine_args(serve)
    add_router_args(serve, skip=("model", "frontend_address"))     # serve picks the address itself
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
    add_router_args(router)
    add_log_level_arg(router)
    return parser


def check_engine_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Values that would only fail in a child process fail here, at once, naming the flag (exit 2)."""
    if getattr(args, "max_body_bytes", 1) <= 0:
        parser.error("--max-body-bytes must be positive")
    quant = getattr(args, "quantization", "auto")
    if quant not in QUANTIZATION_METHODS and quant not in QUANTIZATION_ALIASES:
        parser.error(f"--quantization {quant!r}: expected one of {', '.join(QUANTIZATION_METHODS)}")
    kv = getattr(args, "kv_cache_dtype", "auto")
    if kv not in KV_CACHE_DTYPES:
        parser.error(f"--kv-cache-dtype {kv!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    _check_lora_args(parser, args)
    if getattr(args, "speculative_config", None) is not None:
        try:
            spec = SpeculativeConfig.parse(args.speculative_config)
            if spec is not None:
                spec.check_draft(getattr(args, "model", None))
        except ValueError as e:    # json.JSONDecodeError is one
            parser.error(f"--speculative-config: {e}")


def _check_lora_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not hasattr(args, "enable_lora"):
        return
    try:
        check_lora_config(args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras, args.lora_modules)
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> None:
    from common.process import setup_logging
    parser = build_parser()
    args = parser.parse_args(argv)
    check_engine_args(parser, args)
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
        run_router(router_config(args))
    else:
        sys.exit(serve(args))


def serve(args: argparse.Namespace) -> int:
    """Start every part as a child process; Ctrl-C or SIGTERM drains the routers, then stops the rest."""
    engine = EngineProcesses.start(args.model, engine_flags(args), args.num_threads, args.tensor_parallel_size)
    rc = router_config(args, frontend_address=engine.frontend)
    model = [args.model] if args.model else []
    routers = [engine.spawn(["router", *model, *router_flags(rc, args.log_level)], router_env(rc))
               for _ in range(args.router_replicas)]
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while stop["signal"] is None and all(r.poll() is None for r in routers) and engine.scheduler.poll() is None:
            time.sleep(0.2)
        for r in routers:   # routers first: they drain in-flight requests
            if r.poll() is None:
                r.send_signal(signal.SIGTERM)
        wait_all(routers, rc.shutdown_timeout + 10)
    finally:
        engine.stop()
    return 0


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags that differ from their defaults, re-emitted for the scheduler and workers."""
    return ["--log-level", args.log_level, *config_flags(engine_config(args))]


def router_flags(config: RouterConfig, log_level: str) -> list[str]:
    """The router flags that differ from their defaults, re-emitted for each child router; never the API
    key, which goes in the environment (router_env) so that `ps` does not show it."""
    return ["--log-level", log_level, *config_flags(config, skip=("model", "api_key"))]


def router_env(config: RouterConfig) -> dict[str, str]:
    return {API_KEY_ENV: config.api_key or "", "OMP_NUM_THREADS": "1"}


if __name__ == "__main__":
    main()
