"""Which kernel should run a packed (GGUF) step of each size in --dtype auto on bf16 hardware.

    python -m loadtest.packed_rows_bench [--rows 1,4,8,9,12,16,24,32,64,96,128,256,512]
                                         [--step-batches 9,12,16,24,32] [--e2e-limits 8,16] [--repeats 2]

1. The default model's 120 packed decoder products, and the lm_head, at each row count: the native vector
   kernel (PackedWeight._native_gemm), oneDNN's bf16 GEMM on a prepacked bf16 copy (low_precision_linear;
   made here where the model holds the tiles' copy instead) and, on AMX, the tile kernel
   (PackedWeight._tiles_gemm) expanding the weights at each call ("tiles") and reading its copy ("tiles
   held"), median of 7 passes, in ms. Where native stops winning is AMX_NATIVE_MAX_ROWS
   (gpu_worker/quantization/packed.py). ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 shows a CPU with AVX512-BF16
   but no AMX.
2. Whole decode steps: --step-batches B sequences of 120-token prompts decode 24 tokens, under each arm of
   --e2e-limits in turn (3 rounds, alternated); median step time of the steps that decode exactly B
   tokens. An empty list skips a section.
3. End to end: the shared workload's 96 requests submitted at once (max_num_seqs 64, as the bench's
   offline row) under each arm of --e2e-limits set on every packed weight, arms alternated --repeats times
   in one engine with prefix caching off (a second pass would find every prompt cached), output tok/s
   each; outputs of the arms are compared token for token.
An arm N runs steps of up to N rows on the native kernel, the rest on the tiles (AMX) or the bf16 copy.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu_worker.kernels import native
from gpu_worker.layers.linear import low_precision_linear, prepack_bf16
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
    lib, g = native.library(), torch.Generator().manual_seed(0)
    expanded = [w for w in weights if w.expanded is not None or w.tiles is not None]
    if not expanded:
        print("no bf16 expansion here (no bf16 hardware, or --dtype float32): nothing to compare")
        return
    layers = [w for w in expanded if w.shape[0] < 40000]
    copies = {id(w): w.expanded if w.expanded is not None else prepack_bf16(w._dequantize_fast(lib).bfloat16())
              for w in expanded}
    kernels = {"native": lambda w, x: w._native_gemm(lib, x, None),
               "bf16": lambda w, x: low_precision_linear(x, copies[id(w)], None)}
    if native.uses_amx():
        def tiles(w: PackedWeight, x: torch.Tensor, held: bool) -> torch.Tensor:
            kept, w.tiles = w.tiles, (w.tiles if w.tiles is not None else w._expand_for_tiles(lib)) if held else None
            try:
                return w._tiles_gemm(lib, x, None)
            finally:
                w.tiles = kept
        kernels["tiles"] = lambda w, x: tiles(w, x, False)
        kernels["held"] = lambda w, x: tiles(w, x, True)
    parts = {f"{len(layers)} decoder products": layers, "lm_head": [w for w in expanded if w.shape[0] >= 40000]}
    parts = {name: ws for name, ws in parts.items() if ws}
    print(f"{'rows':>5} " + " | ".join(" ".join(f"{k:>7}" for k in kernels) + f"  ({name}, ms)" for name in parts))
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g) for k in {w.shape[1] for w in expanded}}
        cells = [" ".join(f"{median_ms(lambda: [fn(w, xs[w.shape[1]]) for w in ws]):>7.2f}" for fn in kernels.values())
                 for ws in parts.values()]
        print(f"{rows:>5} " + " | ".join(c + " " * (len(name) + 7) for c, name in zip(cells, parts)))


def set_limits(weights: list[PackedWeight], arm: int) -> None:
    for w in weights:
        w.native_max_rows = arm


def arm_name(arm: int) -> str:
    return f"native to {arm} rows"


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
                    set_limits(weights, n)
                    times.clear()
                    want["rows"] = b
                    llm.generate(prompts, pagedserve_runs.greedy(24), use_tqdm=False)
                    per[n].append(statistics.median(times))
            print(f"  batch {b:>3}: " + ", ".join(f"{arm_name(n)} {statistics.median(per[n]) * 1e3:6.2f} ms"
                                               for n in limits))
    finally:
        model_runner.ModelRunner.execute = execute


def end_to_end(llm, weights: list[PackedWeight], limits: list[int], repeats: int) -> None:
    arms = {arm_name(n): (lambda n=n: set_limits(weights, n)) for n in limits}
    pagedserve_runs.alternate_arms(llm, load_workload(), arms, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]    # noqa: E731
    p.add_argument("--rows", type=ints, default=[1, 4, 8, 9, 12, 16, 24, 32, 64, 96, 128, 256, 512])
    p.add_argument("--step-batches", type=ints, default=[9, 12, 16, 24, 32])
    p.add_argument("--e2e-limits", type=ints, default=[8, 16])
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
