"""A/B of one packed-matmul kernel between a git revision and the working tree, call by call in one process.

    python -m loadtest.qgemm_ab [--rev HEAD] [--kernel psq_gemm_panel_i16] [--rows 12,64,512] [--rounds 8]

Why: on this shared machine whole runs move by 10-30%, and even qgemm_bench's rounds (all 120 products of
one build, then of the other) moved 0.85-1.4x between builds that were the same. Here both builds' libraries
are loaded side by side and every product is run by both in turn, the order flipped each round, so a
slow spell costs both alike; a build against itself reads 0.99-1.01x. Outputs are compared bit for bit
first (a scheduling change must not move a float). SmolLM2-135M's 120 products as in qgemm_bench.
"""
from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from pathlib import Path

import torch

from gpu_worker.kernels import native
from gpu_worker.quantization.packed import PackedWeight
from loadtest.attention_ab import checkout
from loadtest.qgemm_bench import SHAPES, layers

# kernel -> takes an isa argument last (psq_gemm)
KERNELS = {"psq_gemm": True, "psq_gemm_i16": False, "psq_gemm_panel": False, "psq_gemm_panel_i16": False}


def build(tree: Path, out: Path, kernel: str) -> ctypes.CDLL:
    """The library from `tree`'s kernel sources, with `kernel`'s argument types set."""
    native.compile_library([tree / s.relative_to(native.HERE.parents[1]) for s in native.SOURCES], out)
    lib = ctypes.CDLL(str(out))
    p, i = ctypes.c_void_p, ctypes.c_int
    fn = getattr(lib, kernel)
    fn.argtypes = [p, i, i, p, p, p, i, i, i, p, p] + ([i] if KERNELS[kernel] else [])
    return lib


def compare(libs: list[ctypes.CDLL], kernel: str, weights: list[PackedWeight], rows: int, rounds: int) -> str:
    extra = [native.cpu_isa()] if KERNELS[kernel] else []
    xs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
    outs = [{n: torch.empty(rows, n) for n in {n for n, _ in SHAPES}} for _ in libs]

    def run(j: int, w: PackedWeight) -> torch.Tensor:
        q, scale, offset, n, group, bits = w._call
        x, y = xs[w.shape[1]], outs[j][n]
        getattr(libs[j], kernel)(x.data_ptr(), rows, x.shape[1], q, scale, offset, n, group, bits, None,
                                 y.data_ptr(), *extra)
        return y

    for w in weights[:4]:
        if not torch.equal(run(0, w), run(1, w).clone()):
            return f"rows {rows}: the builds' outputs differ ({w.shape})"
    totals, per_round = [0.0, 0.0], []
    for r in range(rounds):
        spent = [0.0, 0.0]
        for w in weights:
            for j in ((0, 1) if r % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                run(j, w)
                spent[j] += time.perf_counter() - t0
        totals = [a + b for a, b in zip(totals, spent)]
        per_round.append(spent[0] / spent[1])
    return (f"rows {rows:4d}: rev {totals[0] / rounds * 1e3:7.1f} ms, tree {totals[1] / rounds * 1e3:7.1f} ms, "
            f"rev/tree {totals[0] / totals[1]:.3f} (rounds {min(per_round):.3f}-{max(per_round):.3f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--kernel", default="psq_gemm_panel_i16", choices=list(KERNELS))
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[12, 64, 512])
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    root = native.HERE.parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        rev_tree = checkout(args.rev, Path(tmp) / "rev")
        libs = [build(rev_tree, Path(tmp) / "rev.so", args.kernel), build(root, Path(tmp) / "tree.so", args.kernel)]
        weights = layers()
        print(f"{args.kernel}: {args.rev} against the working tree, {torch.get_num_threads()} threads, "
              f"all {len(weights)} products a round, {args.rounds} rounds")
        for rows in args.rows:
            print(compare(libs, args.kernel, weights, rows, args.rounds), flush=True)


if __name__ == "__main__":
    main()
