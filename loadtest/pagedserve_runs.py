"""pagedserve rows: the offline engine stepped in-process, and the full server driven over HTTP.

offline — every request is added to the engine at once and the engine is stepped by hand (rather than
  through `LLM.generate`) so that each token's arrival can be stamped; every output still goes through a
  RequestTracker (incremental detokenization), exactly the work `LLM.generate` does per token.
http-cN — a fresh `pagedserve serve` per concurrency level (a warm prefix cache left over from the previous
  level would hand the next one free prefills), driven by N closed-loop streaming clients.
"""
from __future__ import annotations

import asyncio
import gc
import statistics
import time
from typing import Any, Callable

from common.output_processor import RequestTracker
from common.protocol import EngineRequest
from common.sampling_params import SamplingParams
from loadtest.http_client import http_row
from loadtest.report import RequestTiming, SystemResult, short_error
from loadtest.server import PagedServeServer
from loadtest.workload import BenchRequest

# The engine settings every pagedserve row uses (the CPU configuration); the dtype is the default
# (auto) unless a row names one.
ENGINE_KWARGS: dict[str, Any] = {"kv_cache_memory": 2, "swap_space": 0}
WARMUP = BenchRequest("warmup", list(range(100, 116)), 4)   # token ids absent from the workload's prompts


def engine_kwargs(threads: int | None = None, quantization: str = "auto", dtype: str = "auto") -> dict[str, Any]:
    kw = dict(ENGINE_KWARGS)
    if threads:
        kw["num_threads"] = threads
    if quantization != "auto":
        kw["quantization"] = quantization
    if dtype != "auto":
        kw["dtype"] = dtype
    return kw


def row_name(base: str, quantization: str, dtype: str = "auto") -> str:
    return "-".join([base] + [x for x in (quantization, dtype) if x != "auto"])


def server_flags(threads: int | None = None, quantization: str = "auto", dtype: str = "auto") -> list[str]:
    """ENGINE_KWARGS as `pagedserve serve` flags, so both rows run the same engine configuration."""
    flags = []
    for k, v in engine_kwargs(threads, quantization, dtype).items():
        flags += ["--" + k.replace("_", "-"), str(v)]
    return flags


def make_llm(threads: int | None = None, model: str | None = None, quantization: str = "auto", dtype: str = "auto",
             **overrides: Any):
    from pagedserve import LLM
    return LLM(model, **{**engine_kwargs(threads, quantization, dtype), **overrides})


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def drive_engine(llm, reqs: list[BenchRequest], prefix: str,
                 tokens: dict[int, list[int]] | None = None) -> tuple[float, list[RequestTiming]]:
    """Add all of `reqs` at once, step until every one is finished; return (wall s, timings). `tokens`,
    when given, receives each request's generated ids under its index in `reqs`."""
    engine = llm.engine
    trackers: dict[str, tuple[BenchRequest, RequestTracker]] = {}
    submitted: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        rid = f"{prefix}-{i}"
        sp = greedy(r.max_tokens)
        submitted[rid] = time.perf_counter()
        engine.add_request(EngineRequest(rid, list(r.prompt_token_ids), sp))
        trackers[rid] = (r, RequestTracker(rid, r.prompt_token_ids, sp, llm.tokenizer))
        times[rid] = []
    pending = set(trackers)
    while pending:
        outs = engine.step()
        now = time.perf_counter()
        for eo in outs:
            tr = trackers[eo.request_id][1]
            tr.process(eo)
            times[eo.request_id].extend([now] * len(eo.new_token_ids))
            if tokens is not None:
                tokens.setdefault(int(eo.request_id.rsplit("-", 1)[1]), []).extend(eo.new_token_ids)
            if tr.finished:
                pending.discard(eo.request_id)
        if pending and not engine.has_unfinished():
            raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
    wall = time.perf_counter() - t0
    timings = []
    for rid, (r, tr) in trackers.items():
        n = tr.num_generated_tokens
        if n != r.max_tokens:
            raise RuntimeError(f"request {r.id} produced {n} tokens, expected {r.max_tokens}")
        timings.append(RequestTiming(r.id, submitted[rid], times[rid], n))
    return wall, timings


def alternate_arms(llm, reqs: list[BenchRequest], arms: dict[str, Callable[[], None]], repeats: int) -> None:
    """A/B in one engine: `reqs` submitted at once, once per arm per repeat, the arms alternated; each arm's
    callable sets it up before its run. Prefix caching must be off (a second pass would find every prompt
    cached). Prints each run's output tok/s, then each arm's median against the last arm's and how many
    outputs it shares with that arm's first run token for token."""
    drive_engine(llm, [WARMUP], "warmup")
    out_tokens = sum(r.max_tokens for r in reqs)
    rates: dict[str, list[float]] = {name: [] for name in arms}
    outputs: dict[str, dict[int, list[int]]] = {}
    for rep in range(repeats):
        for k, (name, setup) in enumerate(arms.items()):
            setup()
            got: dict[int, list[int]] = {}
            wall, _ = drive_engine(llm, reqs, f"ab{rep}.{k}", got)
            rates[name].append(out_tokens / wall)
            outputs.setdefault(name, got)
            print(f"  repeat {rep}, {name}: {out_tokens / wall:6.1f} tok/s ({wall:.2f} s)", flush=True)
    base = list(arms)[-1]
    for name in arms:
        same = sum(outputs[name][i] == outputs[base][i] for i in outputs[base])
        ratio = statistics.median(rates[name]) / statistics.median(rates[base])
        print(f"{name}: median {statistics.median(rates[name]):6.1f} tok/s, {ratio:.3f}x {base}; "
              f"{same}/{len(outputs[base])} outputs identical to it")


def run_offline(reqs: list[BenchRequest], threads: int | None = None, model: str | None = None,
                quantization: str = "auto", dtype: str = "auto") -> SystemResult:
    res = SystemResult(row_name("offline", quantization, dtype), is_pagedserve=True,
                       notes=["pagedserve engine in-process, all requests added at t=0, stepped by hand"])
    llm = make_llm(threads, model, quantization, dtype)
    try:
        drive_engine(llm, [WARMUP], "warmup")
        res.wall_s, res.timings = drive_engine(llm, reqs, "bench")
        st = llm.stats
        res.notes.append(f"preemptions {st.num_preemptions}, prefix-cache hits {st.prefix_cache_hits}/"
                         f"{st.prefix_cache_queries} prompt tokens")
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
    return res


def run_http(reqs: list[BenchRequest], concurrencies: list[int], threads: int | None = None,
             model: str | None = None, quantization: str = "auto", dtype: str = "auto") -> list[SystemResult]:
    """One row per concurrency level; a level whose server fails prints as n/a and the next one still runs."""
    rows = []
    for c in concurrencies:
        name = row_name(f"http-c{c}", quantization, dtype)
        try:
            with PagedServeServer(server_flags(threads, quantization, dtype), model=model) as srv:
                rows.append(asyncio.run(http_row(name, srv.url, reqs, c, WARMUP, True,
                                                 "pagedserve serve")))
        except Exception as e:   # noqa: BLE001 - a broken server must not take the other rows down
            rows.append(SystemResult.failed(name, short_error(e), is_pagedserve=True))
    return rows
