"""Kernel microbenchmark: CPU paged attention, the native kernel against the torch backend's SDPA path.

    python -m loadtest.attention_bench [--lens 128,512,2048] [--runs 1,5,9] [--batch 1,8] [--repeats 5]
                                       [--kv-dtype float32] [--layers 30]

SmolLM2-135M's attention shape (9 query heads over 3 kv heads of 64), a cache (fp32 unless --kv-dtype; one per
layer with --layers) in blocks of 16
laid out in random order. Each row is one layer's attention for `batch` sequences of `len` keys, each
running `run` query tokens (1: decodes; 5 and 9: verifying 4 and 8 drafted tokens). Times are medians of
alternated repeats; the torch path is what runs without the native library (and the reference its tests
compare against).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.kernels import native
from tests.attention_cases import make_meta, rand

HQ, HKV, D, BLOCK = 9, 3, 64, 16


def case(length: int, run: int, batch: int, kv_dtype: torch.dtype = torch.float32, layers: int = 1):
    """(meta, query, caches): `layers` (k, v) cache pairs, as a step's layers each have their own."""
    gen = torch.Generator().manual_seed(0)
    seqs = [(length - run, run)] * batch
    num_blocks = batch * (-(-length // BLOCK)) + 2
    meta = make_meta(seqs, BLOCK, num_blocks, gen, torch.device("cpu"))
    caches = [tuple(rand((num_blocks, BLOCK, HKV, D), torch.float32, gen).to(kv_dtype) for _ in range(2))
              for _ in range(layers)]
    query = rand((batch * run, HQ, D), torch.float32, gen)
    return meta, query, caches


def time_calls(backend: TorchAttentionBackend, meta, query, caches, calls: int) -> float:
    prepared = backend.prepare(meta)         # once per step, as the model runner does; layers reuse it
    key = value = torch.empty(0)
    t0 = time.perf_counter()
    for i in range(calls):
        k_cache, v_cache = caches[i % len(caches)]
        backend.forward(query, key, value, k_cache, v_cache, prepared, D ** -0.5)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]       # noqa: E731
    p.add_argument("--lens", type=ints, default=[128, 512, 2048])
    p.add_argument("--runs", type=ints, default=[1, 5, 9])
    p.add_argument("--batch", type=ints, default=[1, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--calls", type=int, default=30, help="layer calls per timing (a 30-layer step)")
    p.add_argument("--layers", type=int, default=1,
                   help="distinct caches the calls cycle through: 30 streams a decode step's caches from memory, "
                        "as the engine does; 1 keeps a large batch's cache in the last-level cache")
    args = p.parse_args()
    if not native.available():
        raise SystemExit("the native kernels are not built: run scripts/setup.sh")
    print(f"isa level {native.cpu_isa()}, {torch.get_num_threads()} threads, {args.kv_dtype} cache; ms per layer call")
    print(f"{'batch':>5} {'len':>5} {'run':>4} {'native':>8} {'torch':>8} {'native x':>9}")
    for batch in args.batch:
        for length in args.lens:
            for run in args.runs:
                c = case(length, run, batch, getattr(torch, args.kv_dtype), args.layers)
                ways = {"native": TorchAttentionBackend(native=True), "torch": TorchAttentionBackend(native=False)}
                times: dict[str, list[float]] = {w: [] for w in ways}
                for _ in range(args.repeats):
                    for name, backend in ways.items():
                        times[name].append(time_calls(backend, *c, args.calls))
                med = {w: statistics.median(t) * 1e3 for w, t in times.items()}
                print(f"{batch:>5} {length:>5} {run:>4} {med['native']:>8.3f} {med['torch']:>8.3f} "
                      f"{med['torch'] / med['native']:>8.2f}x")


if __name__ == "__main__":
    main()
