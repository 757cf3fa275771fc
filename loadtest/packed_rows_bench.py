"""Where the native packed kernel should hand a step to the bf16 expansion (--dtype auto on bf16 hardware).

    python -m loadtest.packed_rows_bench [--rows 1,4,8,9,12,16,24,32,64] [--step-batches 9,12,16,24,32]
                                         [--e2e-limits 8,32] [--repeats 2]

1. The default model's 120 packed decoder products at each row count: the native kernel
   (PackedWeight._native_gemm) against the bf16 expansion (low_precision_linear on PackedWeight.expanded),
   median of 7 passes, in ms. Where native stops winning is AMX_NATIVE_MAX_ROWS
   (gpu_worker/quantization/packed.py). ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 shows a CPU with AVX512-BF16
   but no AMX.
2. Whole decode steps: --step-batches B sequences of 120-token prompts decode 24 tokens, with the native
   limit at each of --e2e-limits in turn (3 rounds, alternated); median step time of the steps that
   decode exactly B tokens. An empty list skips a section.
3. End to end: the shared workload's 96 requests submitted at once (max_num_seqs 64, as the bench's
   offline row) with each native row limit of --e2e-limits set on every packed weight, arms alternated
   --repeats times in one engine with prefix caching off (a second pass would find every prompt cached),
   output tok/s each; outputs of the arms are compared token for token.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu_worker.kernels import native
from gpu_worker.layers.linear import low_precision_linear
from gpu_worker.quantization.packed import PackedWeight
from loadtest import pagedserve_runs
from loadtest.workload import load_workload


def packed_weights(llm) -> list[PackedWeight]:
    """Every packed weight of the in-process engine's model, each once (a tied table is one)."""
    seen: dict[int, PackedWeight] = {}
    for mod in llm.engine.executor.runner.model.modules():
        for v in vars(mod).values():
            if isinstance(v, PackedWeight):
                seen[id(v)] = v
    return list(seen.values())


def median_ms(fn, repeats: int = 7) -> float:
    """fn's median wall time in ms over `repeats` calls, after one warm-up call."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def sweep(weights: list[PackedWeight], rows_list: list[int]) -> None:
    layers = [w for w in weights if w.expanded is not None and w.shape[0] < 40000]     # not the lm_head
    if not layers:
        print("no bf16 expansion here (no bf16 hardware, or --dtype float32): nothing to compare")
        return
    lib, g = native.library(), torch.Generator().manual_seed(0)
    print(f"{'rows':>5} {'native ms':>10} {'bf16 ms':>8}   ({len(layers)} decoder products)")
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g) for k in {w.shape[1] for w in layers}}
        nat = median_ms(lambda: [w._native_gemm(lib, xs[w.shape[1]], None) for w in layers])
        low = median_ms(lambda: [low_precision_linear(xs[w.shape[1]], w.expanded, None) for w in layers])
        print(f"{rows:>5} {nat:>10.2f} {low:>8.2f}")


def decode_steps(llm, weights: list[PackedWeight], batches: list[int], limits: list[int]) -> None:
    from gpu_worker import model_runner
    times: list[float] = []
    execute, want = model_runner.ModelRunner.execute, {"rows": 0}

    def timed(runner, sched):
        t0 = time.perf_counter()
        out = execute(runner, sched)
        if sched.total_num_tokens == want["rows"] and not sched.new_seqs:
            times.append(time.perf_counter() - t0)
        return out
    model_runner.ModelRunner.execute = timed
    g = torch.Generator().manual_seed(1)
    try:
        for b in batches:
            prompts = [{"prompt_token_ids": torch.randint(1000, 40000, (120,), generator=g).tolist()} for _ in range(b)]
            per: dict[int, list[float]] = {n: [] for n in limits}
            for _ in range(3):
                for n in limits:
                    for w in weights:
                        w.native_max_rows = n
                    times.clear()
                    want["rows"] = b
                    llm.generate(prompts, pagedserve_runs.greedy(24), use_tqdm=False)
                    per[n].append(statistics.median(times))
            print(f"  batch {b:>3}: " + ", ".join(f"native up to {n} rows {statistics.median(per[n]) * 1e3:6.2f} ms"
                                               for n in limits))
    finally:
        model_runner.ModelRunner.execute = execute


def end_to_end(llm, weights: list[PackedWeight], limits: list[int], repeats: int) -> None:
    def limit(n: int):
        def setup() -> None:
            for w in weights:
                w.native_max_rows = n
        return setup
    pagedserve_runs.alternate_arms(llm, load_workload(), {f"native up to {n} rows": limit(n) for n in limits},
                                   repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]    # noqa: E731
    p.add_argument("--rows", type=ints, default=[1, 4, 8, 9, 12, 16, 24, 32, 64])
    p.add_argument("--step-batches", type=ints, default=[9, 12, 16, 24, 32])
    p.add_argument("--e2e-limits", type=ints, default=[8, 32])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    llm = pagedserve_runs.make_llm(max_num_seqs=64, enable_prefix_caching=False)
    weights = packed_weights(llm)
    if args.rows:
        sweep(weights, args.rows)
    if args.step_batches and args.e2e_limits:
        decode_steps(llm, weights, args.step_batches, args.e2e_limits)
    if args.e2e_limits and args.repeats:
        end_to_end(llm, weights, args.e2e_limits, args.repeats)


if __name__ == "__main__":
    main()
