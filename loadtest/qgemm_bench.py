"""Kernel microbenchmark: the packed-weight matmul against the fp32 GEMM on the same weights.

    python -m loadtest.qgemm_bench [--rows 1,4,8,16,32,64] [--repeats 5]

The weights are SmolLM2-135M's 30 layers of projections (qkv 960x576, o 576x576, gate+up 3072x576, down
576x1536) with random 4-bit values, 120 distinct matrices (~80 MB packed, ~425 MB as fp32), so neither
side runs from cache: a decode step's conditions. For each row count it times all 120 products in turn,
alternated per repeat: torch's fp32 GEMM on resident fp32 weights, the native kernel (`direct`), the
expansion into fp32 followed by the fp32 GEMM (`expand+gemm`), on AVX2 the panel kernel
(qgemm_panel.cpp, `panels`), and where AVX2 runs, the vector kernel with int16 activations (qgemm_i16.cpp,
`int16`: --dtype auto's decode steps without bf16 hardware) and the panel kernel with int16 activations
(qgemm_panel_i16.cpp, `panels-i16`: --dtype auto's larger steps there). The crossover of `direct` and the
others is where GEMM_MAX_ROWS belongs, that of `panels` and `expand+gemm` PANEL_MAX_ROWS.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gpu_worker.kernels import native
from gpu_worker.quantization.packed import GroupQuant, PackedWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def layers(num_layers: int = 30) -> list[PackedWeight]:
    rng = np.random.default_rng(0)
    return [PackedWeight.from_groups(GroupQuant(rng.integers(0, 16, (n, k)), rng.random((n, k // 32), dtype=np.float32),
                                                rng.random((n, k // 32), dtype=np.float32), 32))
            for _ in range(num_layers) for n, k in SHAPES]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    lib = native.library()
    if lib is None:
        raise SystemExit("the native kernels are not built: run scripts/setup.sh")
    packed = layers()
    dense = [w.dequantize() for w in packed]
    ways = {"fp32": lambda i, x: torch.nn.functional.linear(x, dense[i]),
            "direct": lambda i, x: packed[i]._native_gemm(lib, x, None),
            "expand+gemm": lambda i, x: torch.nn.functional.linear(x, packed[i]._dequantize_fast(lib, scratch=True))}
    if native.cpu_isa() == native.ISA_LEVELS["avx2"]:
        ways["panels"] = lambda i, x: packed[i]._panel_gemm(lib, x, None)
    if native.cpu_isa() >= native.ISA_LEVELS["avx2"]:
        ways["int16"] = lambda i, x: packed[i]._i16_gemm(lib, x, None)
        ways["panels-i16"] = lambda i, x: packed[i]._panel_i16_gemm(lib, x, None)
    print(f"isa level {native.cpu_isa()}, {torch.get_num_threads()} threads; ms for all {len(packed)} products")
    print(f"{'rows':>5} " + " ".join(f"{w:>12}" for w in ways) + f" {'direct x':>9}")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(args.repeats):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                for i, w in enumerate(packed):
                    fn(i, xs[w.shape[1]])
                times[name].append(time.perf_counter() - t0)
        med = {w: statistics.median(t) * 1e3 for w, t in times.items()}
        print(f"{rows:>5} " + " ".join(f"{med[w]:>12.2f}" for w in ways) + f" {med['fp32'] / med['direct']:>8.2f}x")


if __name__ == "__main__":
    main()
