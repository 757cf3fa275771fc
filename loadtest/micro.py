"""Microbenchmarks of the parts around the model, each isolated so the model's compute cannot hide them:

  * scheduler — schedule() + update_from_output() per step with 256 running sequences, against a fake
    runner that answers instantly (the scheduler's own CPU cost per step, which bounds steps/s);
  * ipc       — msgpack encode/decode and size of one steady-state step's messages for 256 decodes
    (SchedulerOutput to the worker, ModelRunnerOutput back, EngineOutputs to the router);
  * router    — wall time per streamed token through the whole server versus the offline engine on the same
    tiny random-weight model, at concurrency 16, so the difference is the serving path's overhead.
"""
from __future__ import annotations

import asyncio
import gc
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import EngineConfig
from common.model_source import ModelSource
from common.protocol import (EngineOutputs, EngineRequest, ModelRunnerOutput, SchedulerOutput, decode,
                             encode)
from common.sampling_params import SamplingParams
from loadtest.workload import BenchRequest

SAMPLED_TOKEN = 1000   # what the fake runner "samples": an ordinary token (EOS is ignored anyway)


class FakeRunner:
    """Answers a SchedulerOutput the way the model runner does, without a model: it tracks each request's
    token count and computed tokens, and samples one token for every request whose prompt is done."""

    def __init__(self) -> None:
        self.state: dict[str, list[int]] = {}   # seq_id -> [tokens known, tokens computed]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_seq_ids:
            self.state.pop(rid, None)
        out = ModelRunnerOutput(so.step_id)
        stepped = []
        for r in so.new_seqs:
            self.state[r.seq_id] = [len(r.token_ids), r.num_computed_tokens + r.num_new_tokens]
            stepped.append(r.seq_id)
        for c in so.cached_seqs:
            self.state[c.seq_id][1] = c.num_computed_tokens + c.num_new_tokens
            stepped.append(c.seq_id)
        for rid in stepped:
            st = self.state[rid]
            if st[1] >= st[0]:
                out.seq_ids.append(rid)
                out.sampled_token_ids.append([SAMPLED_TOKEN])
                st[0] += 1
        return out


def _scheduler(num_seqs: int, prompt_len: int, max_tokens: int):
    from scheduler.config import SchedulerConfig
    from scheduler.scheduler import Scheduler
    ec = EngineConfig()   # the engine's defaults: token budget, prefix caching, block size
    blocks = num_seqs * (-(-(prompt_len + max_tokens) // ec.block_size)) + 16
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=ec.max_num_batched_tokens, max_num_seqs=max(num_seqs, 1),
                                      max_model_len=prompt_len + max_tokens + 1, block_size=ec.block_size,
                                      num_blocks=blocks, enable_prefix_caching=ec.enable_prefix_caching),
                      eos_token_ids=[2])
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_seqs):   # distinct prompts: no prefix sharing
        ids = [(i * prompt_len + k) % 40000 + 100 for k in range(prompt_len)]
        sched.add_request(EngineRequest(f"s{i}", ids, sp))
    return sched


@dataclass
class StepSample:
    sched: SchedulerOutput
    result: ModelRunnerOutput
    outputs: EngineOutputs


def scheduler_step_cost(num_seqs: int = 256, steps: int = 200, prompt_len: int = 32) -> tuple[dict[str, Any], StepSample]:
    """Per-step scheduler CPU time once all `num_seqs` are decoding; also returns one steady-state step's
    messages for the IPC benchmark."""
    sched = _scheduler(num_seqs, prompt_len, steps + 64)
    runner = FakeRunner()
    while True:   # prefill everything (chunked by the token budget)
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
        if not sched.waiting and all(r.output_token_ids for r in sched.running):
            break
    t_sched, t_update = [], []
    sample = None
    for _ in range(steps):
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        res = runner.execute(so)
        t2 = time.perf_counter()
        outs = sched.update_from_output(so, res)
        t3 = time.perf_counter()
        if len(res.seq_ids) != num_seqs:
            raise RuntimeError(f"a steady-state step sampled {len(res.seq_ids)} sequences, expected {num_seqs}")
        t_sched.append(t1 - t0)
        t_update.append(t3 - t2)
        sample = StepSample(so, res, EngineOutputs(outs))
    total = [a + b for a, b in zip(t_sched, t_update)]
    return {
        "num_seqs": num_seqs, "steps": steps,
        "schedule_ms_mean": statistics.fmean(t_sched) * 1e3,
        "update_ms_mean": statistics.fmean(t_update) * 1e3,
        "step_ms_mean": statistics.fmean(total) * 1e3,
        "step_ms_p50": statistics.median(total) * 1e3,
        "step_ms_max": max(total) * 1e3,
        "us_per_seq": statistics.fmean(total) / num_seqs * 1e6,
        "max_steps_per_s": 1.0 / statistics.fmean(total),
    }, sample


def ipc_cost(sample: StepSample, repeats: int = 300) -> dict[str, Any]:
    """Bytes and encode/decode time per step for each message of one steady-state step."""
    out: dict[str, Any] = {"num_seqs": len(sample.result.seq_ids)}
    total_us = 0.0
    total_bytes = 0
    for name, msg in (("scheduler_output", sample.sched), ("runner_output", sample.result),
                      ("engine_outputs", sample.outputs)):
        data = encode(msg)
        t0 = time.perf_counter()
        for _ in range(repeats):
            encode(msg)
        t1 = time.perf_counter()
        for _ in range(repeats):
            decode(data)
        t2 = time.perf_counter()
        enc, dec = (t1 - t0) / repeats * 1e6, (t2 - t1) / repeats * 1e6
        out[name] = {"bytes": len(data), "encode_us": enc, "decode_us": dec}
        total_us += enc + dec
        total_bytes += len(data)
    out["total_bytes_per_step"] = total_bytes
    out["total_us_per_step"] = total_us
    return out


def router_overhead(reqs: list[BenchRequest], concurrency: int = 16, threads: int | None = None) -> dict[str, Any]:
    """Wall time per streamed token: the server at `concurrency` vs offline LLM.generate, same tiny model."""
    from loadtest.http_client import run_closed_loop
    from loadtest.pagedserve_runs import greedy, make_llm, server_flags
    from loadtest.server import PagedServeServer
    from loadtest.tiny_model import build_tiny_model
    tokens = sum(r.max_tokens for r in reqs)
    with tempfile.TemporaryDirectory(prefix="pagedserve-tiny-") as tmp:
        folder = build_tiny_model(Path(tmp), "llama", ModelSource.resolve(None).load_tokenizer(), widen=False)
        llm = make_llm(threads, str(folder), kv_cache_memory=0.5)
        try:
            llm.generate([list(range(100, 116))], [greedy(4)], use_tqdm=False)
            t0 = time.perf_counter()
            outs = llm.generate([r.prompt_token_ids for r in reqs], [greedy(r.max_tokens) for r in reqs],
                                use_tqdm=False)
            offline_s = time.perf_counter() - t0
            if sum(len(o.outputs[0].token_ids) for o in outs) != tokens:
                raise RuntimeError("offline run produced the wrong number of tokens")
        finally:
            llm.engine.shutdown()
            del llm
            gc.collect()
        with PagedServeServer(server_flags(threads), model=str(folder)) as srv:
            asyncio.run(run_closed_loop(srv.url, reqs[:1], 1))   # warm-up
            load = asyncio.run(run_closed_loop(srv.url, reqs, concurrency))
    problems = [p for r in load.results for p in r.problems]
    if problems:
        raise RuntimeError(f"{len(problems)} stream check failures, first: {problems[0]}")
    offline_us, http_us = offline_s / tokens * 1e6, load.wall_s / tokens * 1e6
    return {"concurrency": concurrency, "requests": len(reqs), "tokens": tokens,
            "offline_us_per_token": offline_us, "http_us_per_token": http_us,
            "overhead_us_per_token": http_us - offline_us, "http_over_offline": http_us / offline_us}


def run_all(reqs: list[BenchRequest], quick: bool = False, threads: int | None = None) -> dict[str, Any]:
    """Every microbenchmark; one that fails reports its error instead of stopping the others."""
    results: dict[str, Any] = {}
    try:
        results["scheduler"], sample = scheduler_step_cost(steps=30 if quick else 200)
        results["ipc"] = ipc_cost(sample, repeats=50 if quick else 300)
    except Exception as e:   # noqa: BLE001
        results["scheduler"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        results["router"] = router_overhead(reqs, 16, threads)
    except Exception as e:   # noqa: BLE001
        results["router"] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return results


def _failed(name: str, row: dict[str, Any]) -> str | None:
    return f"  {name}: n/a ({row['error']})" if "error" in row else None


def format_micro(m: dict[str, Any]) -> str:
    lines = ["microbenchmarks:"]
    s = m.get("scheduler", {})
    if failed := _failed("scheduler", s):
        lines.append(failed)
    elif s:
        lines.append(f"  scheduler @ {s['num_seqs']} running: {s['step_ms_mean']:.2f} ms/step "
                     f"(schedule {s['schedule_ms_mean']:.2f} + update {s['update_ms_mean']:.2f}; p50 "
                     f"{s['step_ms_p50']:.2f}, max {s['step_ms_max']:.2f}) = {s['us_per_seq']:.1f} us/seq, "
                     f"at most {s['max_steps_per_s']:.0f} steps/s")
    i = m.get("ipc")
    if i:
        parts = ", ".join(f"{k} {i[k]['bytes']} B ({i[k]['encode_us']:.0f}+{i[k]['decode_us']:.0f} us)"
                          for k in ("scheduler_output", "runner_output", "engine_outputs"))
        lines.append(f"  ipc @ {i['num_seqs']} decodes: {i['total_bytes_per_step']} B/step, "
                     f"{i['total_us_per_step']:.0f} us encode+decode per step; {parts}")
    r = m.get("router", {})
    if failed := _failed("router", r):
        lines.append(failed)
    elif r:
        lines.append(f"  router (tiny model, concurrency {r['concurrency']}, {r['tokens']} tokens): "
                     f"{r['http_us_per_token']:.0f} us/token over HTTP vs {r['offline_us_per_token']:.0f} offline = "
                     f"{r['overhead_us_per_token']:+.0f} us/token ({r['http_over_offline']:.2f}x)")
    return "\n".join(lines)
