"""A/B of the CPU paged-attention kernel between a git revision and the working tree, in one process.

    python -m loadtest.attention_ab [--rev HEAD] [--kv-dtype bfloat16] [--batch 64] [--len 553] [--run 1]
                                    [--isa 1] [--layers 30] [--repeats 7]

Why: the machine is shared and noisy (10-30% between runs), so a kernel change is judged by building
paged_attention.cpp from both trees into two libraries and alternating their calls, each timing a
step's worth of layer calls (one cache per layer, streamed from memory as in the engine). Prints both
medians, their ratio and the largest output difference (0 where the change keeps the arithmetic).
SmolLM2-135M's shape: 9 query heads over 3 kv heads of 64, blocks of 16 in random order.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from gpu_worker.kernels import native

HQ, HKV, D, BLOCK = 9, 3, 64, 16
KERNEL = "gpu_worker/kernels/paged_attention.cpp"
CODES = {"float32": 0, "bfloat16": 1, "float16": 2}


def build(tree: Path, out: Path) -> ctypes.CDLL:
    native.compile_library([tree / KERNEL], out)
    lib = ctypes.CDLL(str(out))
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.psq_paged_attention.argtypes = [p, p, p, i, p, i, p, p, i, i, i, i, i, f, p, i, f, p, i]
    return lib


def checkout(rev: str, into: Path) -> Path:
    """The revision's kernel sources (the .cpp and its headers) under `into`."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    folder = Path(KERNEL).parent
    (into / folder).mkdir(parents=True)
    names = subprocess.check_output(["git", "ls-tree", "--name-only", rev, f"{folder}/"], text=True, cwd=root)
    for name in names.split():
        if name.endswith((".cpp", ".h")):
            (into / name).write_bytes(subprocess.check_output(["git", "show", f"{rev}:{name}"], cwd=root))
    return into


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--kv-dtype", default="bfloat16", choices=list(CODES))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--len", type=int, default=553, help="keys per sequence (553: 512 of prompt and output)")
    p.add_argument("--run", type=int, default=1, help="query tokens per sequence (1: decodes)")
    p.add_argument("--isa", type=int, default=native.cpu_isa(), help="0 portable, 1 AVX2, 2 AVX-512, 3 AMX")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        libs = {args.rev: build(checkout(args.rev, tmp_path / "rev"), tmp_path / "a.so"),
                "working tree": build(Path.cwd(), tmp_path / "b.so")}
        g = torch.Generator().manual_seed(0)
        per_seq = -(-args.len // BLOCK)
        blocks = args.batch * per_seq + 2
        tables = torch.randperm(blocks, generator=g)[:args.batch * per_seq].view(args.batch, per_seq)
        tables = tables.to(torch.int32).contiguous()
        lens = torch.full((args.batch,), args.len, dtype=torch.int32)
        starts = (torch.arange(args.batch + 1) * args.run).to(torch.int32)
        dtype = getattr(torch, args.kv_dtype)
        caches = [tuple(torch.randn(blocks, BLOCK, HKV, D, generator=g).to(dtype) for _ in range(2))
                  for _ in range(args.layers)]
        q = torch.randn(args.batch * args.run, HQ, D, generator=g)
        outs = {name: torch.empty_like(q) for name in libs}

        def step(name: str) -> float:
            lib, out = libs[name], outs[name]
            t0 = time.perf_counter()
            for k, v in caches:
                rc = lib.psq_paged_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), CODES[args.kv_dtype],
                                             tables.data_ptr(), per_seq, lens.data_ptr(), starts.data_ptr(),
                                             args.batch, HQ, HKV, D, BLOCK, D ** -0.5, out.data_ptr(), 0, 0.0,
                                             None, args.isa)
                assert rc == 0
            return (time.perf_counter() - t0) / len(caches) * 1e3

        times: dict[str, list[float]] = {name: [] for name in libs}
        for name in libs:
            step(name)                                  # warm-up
        for _ in range(args.repeats):
            for name in libs:
                times[name].append(step(name))
        a, b = (statistics.median(t) for t in times.values())
        diff = (outs[args.rev] - outs["working tree"]).abs().max().item()
        print(f"{args.kv_dtype} cache, isa {args.isa}, batch {args.batch}, {args.len} keys, run {args.run}: "
              f"{args.rev} {a:.3f} ms, working tree {b:.3f} ms a layer call ({a / b:.2f}x); max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
