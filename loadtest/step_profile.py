"""Where a single stream's time goes: each model-runner step timed by its kind, and the packed matmuls inside.

    python -m loadtest.step_profile [--speculative-config JSON] [--concurrency 1]
    python -m loadtest.step_profile --decode-batch 64 --context 512 [--dtype auto] [--kv-cache-dtype fp8]

Runs the speculative benchmark's grounded workload (loadtest/spec_workload.jsonl) in waves of
`--concurrency` through LLM.generate, with and without the given speculative config (default: without),
and prints, per kind of step (rows it ran: 1 = a decode, 5 = a verification of 4 drafts, "prefill" = more
than 16 rows), the step count and median time; then the packed GEMMs' time per step, split into the
decoder layers and the lm_head (where the native stack, models/native_stack.py, runs a step's layers, its
time instead: PAGEDSERVE_NATIVE_STACK=0 splits them). The rest of a step is attention, norms, rope,
sampling and Python. This is the profile behind the #8 / #16 notes: with it, a change to the hot path shows
where it moved the time.

With --decode-batch B: B distinct prompts of --context tokens are prefilled, then 10 steps that each decode
exactly B tokens are timed (loadtest/roofline.py's decode measurement), split into the linear layers
(lm_head included), attention (the backend's forward and KV writes), sampling (lm_head, argmax) and the
rest (norms, rope, residuals, step inputs, Python). #16 asks for attention at most 25% at B = 64, 512.

With --workload-split: the bench's offline row (the shared workload, all requests at once; `--dtype float32` for
its exact-mode twin), its steps' time by row count, each bucket split into parts as above: which kind of step,
and which part of it, the bench's wall time goes to.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

from gpu_worker import model_runner
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.layers.linear import Linear
from gpu_worker.models.native_stack import NativeStack
from gpu_worker.quantization import packed
from loadtest.spec_bench import grounded_llm, run_waves

PREFILL_ROWS = 16      # steps above this many rows count as prefills


class StepTimer:
    """Wraps ModelRunner.execute and PackedWeight._kernel_call (the vector kernels, fp32 or int8
    activations, and the AVX2 panels) for the life of the object (in-process
    engine only), recording wall time by step kind and GEMM time by (rows, layers | lm_head)."""

    def __init__(self) -> None:
        self.steps: dict[Any, list[float]] = defaultdict(list)
        self.gemm: dict[tuple[int, str], float] = defaultdict(float)
        self.gemm_calls: dict[tuple[int, str], int] = defaultdict(int)
        self.vocab = -1                 # the lm_head's output features, once the model is known
        self.stack: dict[int, float] = defaultdict(float)       # native stack time by step rows
        self._execute, self._gemm = model_runner.ModelRunner.execute, packed.PackedWeight._kernel_call
        self._stack = NativeStack.run

        def execute(runner, sched):
            t0 = time.perf_counter()
            out = self._execute(runner, sched)
            rows = sched.total_num_tokens
            self.steps["prefill" if rows > PREFILL_ROWS else rows].append(time.perf_counter() - t0)
            return out

        def gemm(weight, fn, x, bias, *extra):
            t0 = time.perf_counter()
            y = self._gemm(weight, fn, x, bias, *extra)
            key = (x.shape[0], "lm_head" if weight.shape[0] == self.vocab else "layers")
            self.gemm[key] += time.perf_counter() - t0
            self.gemm_calls[key] += 1
            return y

        def stack(st, x, *args):
            t0 = time.perf_counter()
            out = self._stack(st, x, *args)
            if out is not None:
                self.stack[x.shape[0]] += time.perf_counter() - t0
            return out

        model_runner.ModelRunner.execute, packed.PackedWeight._kernel_call = execute, gemm
        NativeStack.run = stack

    def clear(self) -> None:
        for d in (self.steps, self.gemm, self.gemm_calls, self.stack):
            d.clear()

    def restore(self) -> None:
        model_runner.ModelRunner.execute, packed.PackedWeight._kernel_call = self._execute, self._gemm
        NativeStack.run = self._stack

    def report(self) -> str:
        lines = []
        for kind, ts in sorted(self.steps.items(), key=lambda kv: str(kv[0])):
            lines.append(f"  step rows {kind!s:>7}: {len(ts):4} steps, median {statistics.median(ts) * 1e3:7.2f} ms, "
                         f"total {sum(ts):6.2f} s")
        for rows, t in sorted(self.stack.items()):
            steps = len(self.steps.get(rows if rows <= PREFILL_ROWS else "prefill", [])) or 1
            lines.append(f"  native stack rows {rows:2}: {t / steps * 1e3:6.2f} ms a step, every layer (its GEMMs "
                         f"are not timed apart: PAGEDSERVE_NATIVE_STACK=0 runs the layers)")
        for (rows, part), t in sorted(self.gemm.items()):
            steps = len(self.steps.get(rows, [])) or 1
            lines.append(f"  packed GEMM rows {rows:2} {part:7}: {t / steps * 1e3:6.2f} ms a step "
                         f"({self.gemm_calls[(rows, part)]} calls)")
        return "\n".join(lines)


class PartTimer:
    """Wraps the parts of a step (in-process engine only) and sums each one's time over the steps, keyed by
    `key(rows)` (steps whose key is None are not counted); a part called inside another (the lm_head inside
    sampling) counts in both."""
    PARTS = {"linear": (Linear, "forward"), "attention": (TorchAttentionBackend, "forward"),
             "kv write": (TorchAttentionBackend, "write_kv"), "sampling": (model_runner.ModelRunner, "_sample"),
             "native stack": (NativeStack, "run")}

    def __init__(self, key: Callable[[int], int | None]) -> None:
        self.steps: dict[int, int] = defaultdict(int)
        self.step_s: dict[int, float] = defaultdict(float)
        self.totals: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._now: dict[str, float] = defaultdict(float)
        self._orig = {name: getattr(cls, attr) for name, (cls, attr) in self.PARTS.items()}
        self._execute = model_runner.ModelRunner.execute
        for name, (cls, attr) in self.PARTS.items():
            setattr(cls, attr, self._timed(name, self._orig[name]))

        def execute(runner, sched):
            self._now.clear()
            t0 = time.perf_counter()
            out = self._execute(runner, sched)
            k = key(sched.total_num_tokens)
            if k is not None:
                self.steps[k] += 1
                self.step_s[k] += time.perf_counter() - t0
                for part, v in self._now.items():
                    self.totals[k][part] += v
            return out
        model_runner.ModelRunner.execute = execute

    def _timed(self, name: str, fn):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._now[name] += time.perf_counter() - t0
        return wrapped

    def restore(self) -> None:
        for name, (cls, attr) in self.PARTS.items():
            setattr(cls, attr, self._orig[name])
        model_runner.ModelRunner.execute = self._execute

    def report(self, k: int, label: str) -> str:
        n, step_s = max(self.steps[k], 1), self.step_s[k] or 1.0
        lines = [f"  step: {step_s / n * 1e3:7.1f} ms ({self.steps[k]} steps of {label})"]
        for part, v in self.totals[k].items():
            lines.append(f"  {part:10}: {v / n * 1e3:7.1f} ms  {v / step_s:6.1%}")
        return "\n".join(lines)


def decode_profile(batch: int, context: int, dtype: str, kv_cache_dtype: str = "auto") -> str:
    from loadtest import pagedserve_runs, roofline
    timer = PartTimer(lambda rows: rows if rows == batch else None)
    make = roofline.make_llm
    try:
        kv_gib = max(2.0, 1.5 * batch * (context + 2 * batch + batch * context // 128) * 46e3 / 2**30)
        roofline.make_llm = lambda threads, model: pagedserve_runs.make_llm(threads, model, dtype=dtype,
                                                                           kv_cache_memory=kv_gib,
                                                                           kv_cache_dtype=kv_cache_dtype)
        tok_s, ctx = roofline.decode_tokens_per_s(batch=batch, steps=10, prompt_len=context)
    finally:
        roofline.make_llm = make
        timer.restore()
    return (f"decode at batch {batch}, context {ctx:.0f}, --dtype {dtype}, --kv-cache-dtype {kv_cache_dtype}: "
            f"{tok_s:.1f} tok/s\n" + timer.report(batch, f"{batch} rows"))


ROW_BUCKETS = (1, 16, 24, 40, 64, 256, 512, 1 << 30)     # upper ends: steps of 1, 2-16, 17-24, ...


def bucket(rows: int) -> int:
    """The upper end of ROW_BUCKETS' bucket that a step of `rows` rows falls in."""
    return next(b for b in ROW_BUCKETS if rows <= b)


def workload_split(dtype: str = "auto") -> str:
    """The shared workload offline (loadtest.bench's offline row, or its `--dtype float32` twin), each
    step's wall time summed by its row-count bucket, and each bucket's parts (linear, attention, ...):
    which kind of step, and which part of it, the bench's wall time goes to."""
    from loadtest import pagedserve_runs
    from loadtest.workload import default_workload_path, load_workload
    parts = PartTimer(bucket)
    try:
        t0 = time.perf_counter()
        pagedserve_runs.run_offline(load_workload(default_workload_path()), dtype=dtype)
        wall = time.perf_counter() - t0
    finally:
        parts.restore()
    lines = [f"offline run of the shared workload (--dtype {dtype}): {wall:.1f} s with loading, "
             f"{sum(parts.step_s.values()):.2f} s in model-runner steps"]
    lo = 1
    for b in ROW_BUCKETS:
        if parts.steps.get(b):
            span = f"{lo}-{b}" if b < 1 << 30 else f"{lo}+"
            lines.append(f"rows {span}: {parts.step_s[b]:6.2f} s\n" + parts.report(b, f"{span} rows"))
        lo = b + 1
    return "\n".join(lines)


def profile(spec: dict | None, concurrency: int) -> str:
    timer = StepTimer()
    try:
        llm, prompts, params = grounded_llm(spec)
        timer.vocab = llm.source.model_config().vocab_size
        timer.clear()
        wall, tokens = run_waves(llm, prompts, params, concurrency)
        n = sum(len(t) for t in tokens)
        in_steps = sum(sum(ts) for ts in timer.steps.values())
        head = (f"{'speculative ' + json.dumps(spec) if spec else 'no speculation'}, concurrency {concurrency}: "
                f"{n} tokens in {wall:.2f} s = {n / wall:.1f} tok/s; {in_steps:.2f} s in model-runner steps")
        return head + "\n" + timer.report()
    finally:
        timer.restore()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speculative-config", type=json.loads, default=None)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--decode-batch", type=int, default=None, help="profile decode steps of this many sequences")
    p.add_argument("--context", type=int, default=512, help="--decode-batch: prompt tokens per sequence")
    p.add_argument("--dtype", default="auto", help="--decode-batch / --workload-split: the engine's --dtype")
    p.add_argument("--kv-cache-dtype", default="auto", help="--decode-batch: the engine's --kv-cache-dtype")
    p.add_argument("--workload-split", action="store_true",
                   help="the bench's offline row: step time and its parts by row count")
    args = p.parse_args()
    if args.workload_split:
        print(workload_split(args.dtype))
    elif args.decode_batch:
        print(decode_profile(args.decode_batch, args.context, args.dtype, args.kv_cache_dtype))
    else:
        print(profile(args.speculative_config, args.concurrency))


if __name__ == "__main__":
    main()
