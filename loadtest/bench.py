"""`python -m loadtest.bench`: every system on the same deterministic workload, one table.

Rows (choose with --systems): hf1 (transformers generate, one at a time: the 1.0 baseline), hfstatic
(static batches of 16), hfcb (transformers continuous batching), offline (pagedserve engine in-process),
http (pagedserve serve at each --http-concurrency), llamacpp (llama.cpp's llama-server on the same GGUF at
each --http-concurrency, n/a until `python -m loadtest.llama_cpp build` has run on this machine kind). After
the table: a roofline line (the GEMM ceiling vs pagedserve's decode at batch 64) unless --no-roofline, the
fast modes' quality against fp32 (loadtest/quality.py) unless --no-quality, and microbenchmarks with --micro.

Systems run one after another in this process, each freeing its model before the next loads, so that no
two compete for the CPU; the machine's load average is recorded because on a shared box it moves numbers.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

from loadtest.report import SystemResult, format_table, with_ratios, write_json
from loadtest.workload import (QUICK_LIMIT, QUICK_MAX_TOKENS, BenchRequest, default_workload_path, describe,
                               load_workload)

ALL_SYSTEMS = ("hf1", "hfstatic", "hfcb", "offline", "http", "llamacpp")
HF_SYSTEMS = {"hf1", "hfstatic", "hfcb"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=None, help=f"workload JSONL (default {default_workload_path()})")
    p.add_argument("--quick", action="store_true",
                   help=f"first {QUICK_LIMIT} requests, max_tokens capped at {QUICK_MAX_TOKENS}, shorter roofline/micro")
    p.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="cap every request's max_tokens")
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"comma list of {', '.join(ALL_SYSTEMS)}")
    p.add_argument("--http-concurrency", default="1,16,64", help="comma list of client concurrencies")
    p.add_argument("--quantization", default="auto",
                   help="comma list of pagedserve linear methods to run (auto = the GGUF kept quantized, none = fp32, "
                        "int8); one row set each")
    p.add_argument("--dtype", default="auto",
                   help="comma list of pagedserve --dtype values, each a set of rows (e.g. auto,float32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the pagedserve rows' token budget a step (default: the engine's, 512)")
    p.add_argument("--quality", action=argparse.BooleanOptionalAction, default=True,
                   help="after the table, the default mode's top-1 agreement and KL against fp32 (loadtest/quality.py)")
    p.add_argument("--static-batch", type=int, default=16, help="batch size of the hfstatic row")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for every system (HF rows, offline, the server's worker); default: torch's")
    p.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the GEMM ceiling and pagedserve's batch-64 decode rate")
    p.add_argument("--decode-steps", type=int, default=None, help="timed decode steps for the roofline (default 20)")
    p.add_argument("--micro", action="store_true", help="also run the scheduler / IPC / router microbenchmarks")
    p.add_argument("--json", default=None, help="write every result to this JSON file")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in ALL_SYSTEMS]
    if bad:
        p.error(f"unknown system(s) {', '.join(bad)}; expected {', '.join(ALL_SYSTEMS)}")
    args.http_concurrency = [int(c) for c in args.http_concurrency.split(",") if c.strip()]
    if args.quick:
        args.limit = args.limit or QUICK_LIMIT
        args.max_tokens_cap = args.max_tokens_cap or QUICK_MAX_TOKENS
    return args


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_guarded(name: str, fn: Callable[..., SystemResult], *args: Any, is_pagedserve: bool = False) -> SystemResult:
    """Run one row, fn(*args); an exception becomes an n/a row instead of ending the benchmark."""
    progress(f"running {name}")
    t0 = time.perf_counter()
    try:
        res = fn(*args)
    except Exception as e:   # noqa: BLE001
        logging.getLogger("loadtest").debug("row %s failed", name, exc_info=True)
        res = SystemResult.failed(name, f"{type(e).__name__}: {str(e)[:300]}", is_pagedserve)
    progress(f"{name} done in {time.perf_counter() - t0:.0f}s" + (f" (n/a: {res.error})" if res.error else ""))
    return res


def report_failures(rows: list[SystemResult]) -> list[SystemResult]:
    """Say at once which of a set of server rows could not run (the table comes only at the end)."""
    for r in rows:
        if r.error:
            progress(f"{r.system} n/a: {r.error}")
    return rows


def run_hf_rows(args: argparse.Namespace, reqs: list[BenchRequest], device: str) -> list[SystemResult]:
    from loadtest import hf_baselines as hf
    wanted = [s for s in ("hf1", "hfstatic", "hfcb") if s in args.systems]
    progress("loading the HF model")
    try:
        model = hf.load_hf_model(device)
    except Exception as e:   # noqa: BLE001
        return [SystemResult.failed(s, f"cannot load the HF model: {type(e).__name__}: {e}") for s in wanted]
    rows = []
    try:
        for s in wanted:
            if s == "hf1":
                rows.append(run_guarded("hf-1", hf.run_hf_sequential, model, reqs))
            elif s == "hfstatic":
                rows.append(run_guarded(f"hf-static{args.static_batch}", hf.run_hf_static, model, reqs,
                                        args.static_batch))
            else:
                rows.append(run_guarded("hf-cb", hf.run_hf_continuous, model, reqs))
    finally:
        del model
        hf.release_memory()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reqs = load_workload(args.workload, args.limit, args.max_tokens_cap)
    env = {"device": device, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
           "torch": torch.__version__, "python": platform.python_version(), "loadavg_start": os.getloadavg()}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    header = (f"workload: {describe(reqs)} from {args.workload or default_workload_path()}; greedy, ignore_eos\n"
              f"machine: {device}, {env['cpus']} CPUs, torch {env['torch']} with {env['torch_threads']} threads, "
              f"load average at start {env['loadavg_start'][0]:.2f}")
    progress(header.replace("\n", "; "))

    from loadtest import pagedserve_runs as ps
    if args.max_num_batched_tokens:
        ps.ENGINE_KWARGS["max_num_batched_tokens"] = args.max_num_batched_tokens
    rows: list[SystemResult] = []
    if HF_SYSTEMS & set(args.systems):
        rows += run_hf_rows(args, reqs, device)
    for quant in args.quantization.split(","):
        for dtype in args.dtype.split(","):
            if "offline" in args.systems:
                rows.append(run_guarded(ps.row_name("offline", quant, dtype), ps.run_offline, reqs, args.threads, None,
                                        quant, dtype, is_pagedserve=True))
            if "http" in args.systems:
                progress(f"running http at concurrency {args.http_concurrency} ({quant}, dtype {dtype})")
                rows += report_failures(ps.run_http(reqs, args.http_concurrency, args.threads, None, quant, dtype))
    if "llamacpp" in args.systems:
        from loadtest import llama_cpp
        progress(f"running llama-server at concurrency {args.http_concurrency}")
        threads = args.threads or torch.get_num_threads()
        rows += report_failures(llama_cpp.run_rows(reqs, args.http_concurrency, threads, ps.WARMUP))

    roof: dict[str, Any] | None = None
    roof_line = ""
    if args.roofline:
        from loadtest import roofline
        progress("measuring the roofline")
        steps = args.decode_steps or (5 if args.quick else 20)
        try:
            r = roofline.measure(decode_steps=steps, gemm_passes=2 if args.quick else 5, threads=args.threads,
                                 device=device)
            roof, roof_line = r.to_dict(), r.line()
        except Exception as e:   # noqa: BLE001
            roof, roof_line = {"error": str(e)}, f"roofline: n/a ({type(e).__name__}: {e})"

    quality: dict[str, Any] | None = None
    quality_text = ""
    if args.quality:
        from loadtest import quality as q
        progress("measuring the fast modes' quality against fp32")
        try:
            quality = q.measure(8 if args.quick else 32, 16 if args.quick else 64)
            quality_text = q.table(quality)
        except Exception as e:   # noqa: BLE001
            quality, quality_text = {"error": str(e)}, f"quality: n/a ({type(e).__name__}: {e})"

    micro_res: dict[str, Any] | None = None
    micro_text = ""
    if args.micro:
        from loadtest import micro
        progress("running microbenchmarks")
        micro_res = micro.run_all(reqs, args.quick, args.threads)
        micro_text = micro.format_micro(micro_res)

    env["loadavg_end"] = os.getloadavg()
    sums = with_ratios(rows)
    print(header)
    print(format_table(sums))
    if roof_line:
        print(roof_line)
    if quality_text:
        print(quality_text)
    if micro_text:
        print(micro_text)
    if env["loadavg_end"][0] > (env["cpus"] or 1):
        print(f"note: load average {env['loadavg_end'][0]:.1f} on {env['cpus']} CPUs at the end: other work was "
              f"running, so these figures are noisy")
    if args.json:
        write_json(args.json, _finite({"workload": {"path": str(args.workload or default_workload_path()),
                                                    "description": describe(reqs), "limit": args.limit,
                                                    "max_tokens_cap": args.max_tokens_cap},
                                       "environment": env, "rows": sums, "roofline": roof, "quality": quality,
                                       "micro": micro_res}))
        progress(f"wrote {args.json}")
    return 0


def _finite(o: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


if __name__ == "__main__":
    sys.exit(main())
