"""The `pagedserve` command: `serve` runs the whole service on this machine; `scheduler`, `worker` and
`router` run one part each (as docker-compose does)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from common.chat_template import load_chat_template
from common.config import (DTYPES, HASH_ALGOS, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATION_ALIASES,
                           QUANTIZATION_METHODS, EngineConfig)
from common.lora import check_lora_config
from common.model_source import ModelNotFound, ModelSource
from common.sampling_params import SamplingParams
from common.speculative import SpeculativeConfig
from common.tp_layout import check_config
from pagedserve.cli_args import add_config_args, config_flags, config_from_args
from pagedserve.engine_processes import EngineProcesses, Topology, usable_cpus, wait_all
from pagedserve.vllm_flags import add_compat_args, check_compat
from router.config import API_KEY_ENV, DEFAULT_FRONTEND, RouterConfig
from router.tool_parsers import PARSERS

DEFAULT_WORKERS = "tcp://127.0.0.1:5558"
DEFAULT_LOG_LEVEL = "INFO"
MODEL_HELP = ("nothing for SmolLM2-135M-Instruct, a Hugging Face folder, a .gguf file, or a hub id (org/name) "
              "in the local Hugging Face cache; also as --model")
_ENGINE_HELP = {
    "tokenizer": "the tokenizer's folder or hub id, when it is not the model's",
    "revision": "hub ids: the branch, tag or commit (from the local cache)",
    "download_dir": "hub ids: the Hugging Face cache folder to look in",
    "dtype": f"weights and activations: {', '.join(DTYPES)} (auto: bfloat16 on CUDA; on a CPU with AMX-BF16 or "
             "AVX512-BF16, bf16 matmuls with fp32 activations; float32 on other CPUs)",
    "max_model_len": "longest prompt + output, e.g. 4096, 32k or 32K (auto: the model's)",
    "load_format": f"{', '.join(LOAD_FORMATS)} (dummy: random weights)",
    "kv_cache_memory": "GiB of memory for the KV cache on CPU",
    "swap_space": "GiB of host memory for swapped-out KV blocks (0 disables swapping)",
    "num_gpu_blocks": "fix the number of KV blocks instead of sizing from memory",
    "quantization": "auto (the checkpoint's own: GGUF blocks, AWQ, GPTQ or FP8), none (fp32 reference), int8, fp8 "
                    "(weights quantized at load), gguf, awq, gptq (also awq_marlin, gptq_marlin)",
    "calculate_kv_scales": "with an fp8 KV cache: each layer's k/v scales from the first forward pass's K and V "
                           "(largest magnitude at the format's largest value), not 1.0 or the checkpoint's",
    "kv_cache_rotation": "with an fp8 KV cache: store every head's K and V rotated by an orthogonal (Hadamard) "
                         "matrix, the query rotated alike and the output back, and every key less its layer's "
                         "mean: the same attention, less fp8 rounding error (off: --no-kv-cache-rotation)",
    "kv_cache_dtype": "KV cache entries: auto (the model dtype; bfloat16 where --dtype auto runs bf16 matmuls), float32, bfloat16, float16, fp8 (= fp8_e4m3), "
                      "fp8_e5m2",
    "prefix_caching_hash_algo": "prefix-cache block digests: sha256 (sha256_cbor is the same chain here) or blake2b "
                                "(keyed with a random per-process key); a hit also compares the block's tokens",
    "enable_lora": "serve LoRA adapters: requests choose one by its name in \"model\"",
    "max_loras": "adapters resident on the workers at once; a step never mixes more",
    "max_lora_rank": "the largest adapter rank accepted (the adapter slots are sized for it)",
    "max_cpu_loras": "adapters the workers keep in host memory (default: --max-loras)",
    "lora_modules": "adapters to serve from start-up: name=path, or JSON {\"name\", \"path\", \"base_model_name\"}",
}
_ROUTER_HELP = {
    "frontend_address": "the scheduler's frontend address",
    "served_model_name": "the model ids clients may send (responses echo the one sent; default: the model's name)",
    "api_key": f"require 'Authorization: Bearer KEY' (one of these keys) on /v1/* (default: ${API_KEY_ENV} or "
               "$VLLM_API_KEY)",
    "chat_template": "the chat template: a file, or the Jinja template itself (default: the tokenizer's)",
    "response_role": "the role chat completions answer with",
    "generation_config": "request defaults: auto (the model's generation_config.json), vllm (none), or a folder",
    "override_generation_config": "JSON object over those defaults, e.g. '{\"temperature\": 0.5}'",
    "allowed_origins": "CORS: allowed origins, as a JSON list or comma-separated",
    "allowed_methods": "CORS: allowed methods",
    "allowed_headers": "CORS: allowed headers",
    "allow_credentials": "CORS: allow credentials",
    "disable_fastapi_docs": "do not serve /docs and /openapi.json",
    "max_body_bytes": "largest request body accepted (413 above it)",
    "shutdown_timeout": "seconds in-flight requests get to finish on SIGTERM before they are aborted",
    "access_log": "log one line per HTTP request",
    "enable_auto_tool_choice": "\"tool_choice\": \"auto\" (the default when a request has tools): the model's calls "
                               "are read with --tool-call-parser",
    "tool_call_parser": "how the model writes tool calls: hermes (<tool_call> JSON, Qwen/SmolLM/Hermes) or "
                        "llama3_json",
}
def add_log_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default=DEFAULT_LOG_LEVEL)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, positional or as vLLM's --model."""
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p, EngineConfig, _ENGINE_HELP)
    add_log_level_arg(p)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(EngineConfig, args)


def add_router_args(p: argparse.ArgumentParser, *, skip: tuple[str, ...] | set[str] = ("model",)) -> None:
    add_config_args(p, RouterConfig, _ROUTER_HELP, skip=skip)


# Fields both configs have (the model's location): `serve` takes them once, as engine flags
_SHARED = {f.name for f in dataclasses.fields(EngineConfig)} & {f.name for f in dataclasses.fields(RouterConfig)}


def router_config(args: argparse.Namespace, **overrides: Any) -> RouterConfig:
    return config_from_args(RouterConfig, args, **overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="scheduler, workers and routers on this machine")
    add_model_args(serve)
    add_engine_args(serve)
    add_router_args(serve, skip=_SHARED | {"frontend_address"})     # serve picks the address itself
    serve.add_argument("--router-replicas", "--api-server-count", type=int, default=1,
                       help="HTTP router processes sharing the port")
    add_compat_args(serve)
    add_topology_args(serve)

    sched = sub.add_parser("scheduler", help="the scheduler process alone")
    add_model_args(sched)
    add_engine_args(sched)
    sched.add_argument("--frontend", default=DEFAULT_FRONTEND, help="address routers connect to")
    sched.add_argument("--workers", default=DEFAULT_WORKERS, help="address workers connect to")
    sched.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)   # serve's supervisor watches it

    worker = sub.add_parser("worker", help="one worker process alone")
    add_model_args(worker)
    add_engine_args(worker)
    worker.add_argument("--connect", "--scheduler-addr", default=DEFAULT_WORKERS,
                        help="the scheduler's worker address (serve's --scheduler-addr)")
    worker.add_argument("--rank", type=int, default=0, help="this worker's tensor-parallel rank")
    worker.add_argument("--world-size", dest="tensor_parallel_size", type=int, default=argparse.SUPPRESS,
                        help="the tensor-parallel group's size (= --tensor-parallel-size)")
    worker.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                        help="rank 0's TCP store, where the group's ranks meet (torch.distributed)")

    router = sub.add_parser("router", help="one HTTP router replica alone")
    add_model_args(router)
    add_router_args(router)
    add_log_level_arg(router)
    return parser


def add_topology_args(p: argparse.ArgumentParser) -> None:
    """Where serve's tensor-parallel ranks live. By default every rank runs here and every socket is IPC
    or loopback; these flags open the control plane to other hosts, which must be on a private network:
    the worker socket has no authentication."""
    p.add_argument("--local-ranks", type=int, default=None,
                   help="tensor-parallel ranks started on this machine (0 .. N-1; default: all); the others "
                        "join with `pagedserve worker --rank R --world-size TP --scheduler-addr ... "
                        "--dist-init-addr ...` on other hosts")
    p.add_argument("--scheduler-addr", default=None, metavar="tcp://IP:PORT",
                   help="where the scheduler listens for workers (default: an IPC socket of this machine)")
    p.add_argument("--dist-init-addr", default=None, metavar="IP:PORT",
                   help="rank 0's torch.distributed TCP store (default: 127.0.0.1 and a free port)")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Parse and validate every flag before any process starts: a bad value exits 2 at once, naming the
    flag. Returns the arguments and the notices for vLLM flags that mean nothing here."""
    args = parser.parse_args(argv)
    flag = getattr(args, "model_flag", None)
    if flag is not None:
        if args.model is not None and args.model != flag:
            parser.error(f"the model is given twice: {args.model!r} and --model {flag!r}")
        args.model = flag
    notices = check_compat(parser, args)
    check_engine_args(parser, args)
    source = _resolve_model(parser, args)       # once: the engine's and the router's checks share it
    if hasattr(args, "load_format"):
        try:
            source.check_load_format(args.load_format)
        except ValueError as e:
            parser.error(str(e))
    _check_lora_args(parser, args)
    _check_speculative_args(parser, args)
    _check_tensor_parallel_args(parser, args, source)
    check_router_args(parser, args, source)
    return args, notices


def check_engine_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Values that would only fail in a child process fail here, at once, naming the flag (exit 2)."""
    if getattr(args, "max_body_bytes", 1) <= 0:
        parser.error("--max-body-bytes must be positive")
    if not hasattr(args, "quantization"):
        return
    _choice(parser, "--dtype", args.dtype, DTYPES)
    _choice(parser, "--quantization", args.quantization, (*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES))
    _choice(parser, "--kv-cache-dtype", args.kv_cache_dtype, KV_CACHE_DTYPES)
    _choice(parser, "--load-format", args.load_format, LOAD_FORMATS)
    _choice(parser, "--device", args.device, ("auto", "cpu", "cuda"))
    _choice(parser, "--attention-backend", args.attention_backend, ("auto", "torch", "triton"))
    _choice(parser, "--prefix-caching-hash-algo", args.prefix_caching_hash_algo, HASH_ALGOS)
    for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "block_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_model_len is not None and args.max_model_len < 1:
        parser.error(f"--max-model-len must be at least 1 (or auto), got {args.max_model_len}")
    if args.block_size & (args.block_size - 1):
        parser.error(f"--block-size must be a power of two, got {args.block_size}")
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    for name in ("kv_cache_memory", "swap_space"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")


def _check_tensor_parallel_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                                source: ModelSource) -> None:
    """A group the model cannot be split into, more local ranks than cores or GPUs, or remote ranks that
    could not reach this machine: exit 2 now, not as a hang in the ranks."""
    size = getattr(args, "tensor_parallel_size", 1)
    if size == 1:
        return
    try:
        check_config(args, source.model_config(), source.quantization_config())
    except ValueError as e:
        parser.error(str(e))
    if args.command == "worker":
        if not 0 <= args.rank < size:
            parser.error(f"--rank {args.rank} is outside a group of {size}")
        if not args.dist_init_addr:
            parser.error("a worker of a tensor-parallel group needs --dist-init-addr HOST:PORT")
        return
    if args.command != "serve":
        return
    local = size if args.local_ranks is None else args.local_ranks
    if not 1 <= local <= size:
        parser.error(f"--local-ranks must be in 1..{size}, got {local}")
    have, what = (usable_cpus(), "CPU cores") if args.device == "cpu" or not _cuda() else (_cuda(), "GPUs")
    if local > have:
        parser.error(f"--tensor-parallel-size {size} needs {local} {what} on this machine for its ranks; "
                     f"{have} are available")
    if local < size:
        if not (args.scheduler_addr or "").startswith("tcp://"):
            parser.error("ranks on other hosts need --scheduler-addr tcp://IP:PORT that they can reach")
        if not args.dist_init_addr or args.dist_init_addr.startswith(("127.", "localhost")):
            parser.error("ranks on other hosts need --dist-init-addr IP:PORT of this machine that they can reach")


def _cuda() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_speculative_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if getattr(args, "speculative_config", None) is not None:
        try:
            spec = SpeculativeConfig.parse(args.speculative_config)
            if spec is not None:
                spec.check_draft(getattr(args, "model", None))
        except ValueError as e:    # json.JSONDecodeError is one
            parser.error(f"--speculative-config: {e}")


def _choice(parser: argparse.ArgumentParser, flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        parser.error(f"{flag} {value!r}: expected one of {', '.join(choices)}")


def _resolve_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelSource:
    """The model (and tokenizer) must resolve here, not in a child: a typo exits 2 at once."""
    try:
        return ModelSource.from_config(args, getattr(args, "load_format", "auto") != "dummy")
    except ModelNotFound as e:
        parser.error(f"--model: {e}" if not str(e).startswith("--") else str(e))


def check_router_args(parser: argparse.ArgumentParser, args: argparse.Namespace, source: ModelSource) -> None:
    if not hasattr(args, "response_role"):
        return
    if args.chat_template is not None:
        try:
            load_chat_template(args.chat_template)
        except ValueError as e:
            parser.error(f"--chat-template: {e}")
    try:
        override = json.loads(args.override_generation_config or "{}")
        if not isinstance(override, dict):
            raise ValueError("expected a JSON object")
        defaults = source.generation_defaults(args.generation_config, override)   # a folder without one: refused
        SamplingParams(**defaults)             # a wrong type or range fails here, not on every request
    except (ValueError, TypeError) as e:
        parser.error(f"--generation-config / --override-generation-config: {e}")
    if args.tool_call_parser is not None and args.tool_call_parser not in PARSERS:
        parser.error(f"--tool-call-parser {args.tool_call_parser!r}: expected one of {', '.join(PARSERS)}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    names = args.served_model_name or []
    if not all(names):
        parser.error("--served-model-name: names must not be empty")
    # `--served-model-name a MODEL` takes MODEL as a second name and would serve the default model
    swallowed = [n for n in names if args.model is None and Path(n).expanduser().exists()]
    if swallowed:
        parser.error(f"--served-model-name took {swallowed[0]!r}, which is a path: give the model first "
                     f"(serve MODEL --served-model-name ...) or as --model")


def _check_lora_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not hasattr(args, "enable_lora"):
        return
    try:
        check_lora_config(args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras, args.lora_modules)
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> None:
    from common.process import setup_logging
    args, notices = parse_args(build_parser(), argv)
    setup_logging(args.log_level)
    for line in notices:
        logging.getLogger("pagedserve").warning("%s", line)
    if args.command == "scheduler":
        from scheduler.scheduler_process import run_scheduler
        run_scheduler(engine_config(args), args.frontend, args.workers, args.tensor_parallel_size, args.ready_file)
    elif args.command == "worker":
        from gpu_worker.worker import run_worker
        run_worker(engine_config(args), args.connect, args.rank, args.dist_init_addr)
    elif args.command == "router":
        from common.process import die_with_parent
        from router.serve import run_router
        die_with_parent()
        run_router(router_config(args))
    else:
        sys.exit(serve(args))


def serve(args: argparse.Namespace) -> int:
    """Start every part as a child process and keep the engine alive: a scheduler or worker that exits
    after the engine came up is restarted with back-off (the routers answer 503 meanwhile, and serve
    again once the new engine is ready). Ctrl-C or SIGTERM drains the routers, then stops the rest."""
    engine = EngineProcesses.start(args.model, engine_flags(args), args.num_threads, args.tensor_parallel_size,
                                   Topology(args.local_ranks, args.scheduler_addr, args.dist_init_addr))
    rc = router_config(args, frontend_address=engine.frontend)
    model = [args.model] if args.model else []
    routers = [engine.spawn(["router", *model, *router_flags(rc, args.log_level)], router_env(rc))
               for _ in range(args.router_replicas)]
    stop = {"signal": None}
    failed = False

    def on_signal(signum, _frame):
        stop["signal"] = signum
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        # an engine child that dies during start-up (a bad checkpoint) or a router's exit ends the service
        why = None
        while stop["signal"] is None and why is None:
            why = engine.restart_exited() or next((f"a router exited with code {r.returncode}"
                                                   for r in routers if r.poll() is not None), None)
            time.sleep(0.2)
        if why is not None:
            logging.getLogger("pagedserve").error("%s; stopping", why)
            failed = True
        for r in routers:   # routers first: they drain in-flight requests
            if r.poll() is None:
                r.send_signal(signal.SIGTERM)
        wait_all(routers, rc.shutdown_timeout + 10)
    finally:
        engine.stop()
    return 1 if failed else 0


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags that differ from their defaults, re-emitted for the scheduler and workers."""
    return ["--log-level", args.log_level, *config_flags(engine_config(args))]


def router_flags(config: RouterConfig, log_level: str) -> list[str]:
    """The router flags that differ from their defaults, re-emitted for each child router; never the API
    key, which goes in the environment (router_env) so that `ps` does not show it."""
    return ["--log-level", log_level, *config_flags(config, skip=("model", "api_key"))]


def router_env(config: RouterConfig) -> dict[str, str]:
    return {API_KEY_ENV: json.dumps(config.api_key or []), "OMP_NUM_THREADS": "1"}


if __name__ == "__main__":
    main()
