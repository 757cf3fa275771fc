"""A/B of the CPU paged-attention kernel inside the engine: a git revision against the working tree.

    PAGEDSERVE_NATIVE_STACK=0 python -m loadtest.attention_engine_ab [--rev HEAD] [--batch 64] [--context 512]

Why: attention_ab times the kernel on caches of its own, and three changes that won there lost or tied when
step_profile runs of the two builds were compared, because whole steps on this shared machine moved by
10% between runs. Here both builds (attention_ab.build) serve one step_profile decode run, and
the kernel's calls alternate between them, so both see the same caches, the same steps and the same
neighbours. Prints each build's median call time over the calls of `--batch` rows. The two builds' outputs
differ in the last bits when the change moves the arithmetic, so the run's later tokens may differ.
PAGEDSERVE_NATIVE_STACK=0 is needed: the native decoder stack calls the kernel from C++.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from gpu_worker.kernels import native
from loadtest import step_profile
from loadtest.attention_ab import build, checkout


class Alternating:
    """Stands in for the library's psq_paged_attention: call i runs build i % len(kernels), timed."""

    def __init__(self, kernels: list, rows: int) -> None:
        self.kernels, self.rows, self.calls = kernels, rows, 0
        self.times: list[list[float]] = [[] for _ in kernels]

    def __call__(self, *args):
        which = self.calls % len(self.kernels)
        self.calls += 1
        t0 = time.perf_counter()
        rc = self.kernels[which](*args)
        if args[8] == self.rows:                     # B: the decode steps, not the prefills before them
            self.times[which].append(time.perf_counter() - t0)
        return rc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    args = p.parse_args()
    if os.environ.get("PAGEDSERVE_NATIVE_STACK") != "0":
        p.error("set PAGEDSERVE_NATIVE_STACK=0: the native decoder stack calls the kernel from C++")
    lib = native.library()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        builds = {args.rev: build(checkout(args.rev, tmp_path / "rev"), tmp_path / "a.so"),
                  "working tree": build(Path.cwd(), tmp_path / "b.so")}
        alternating = Alternating([b.psq_paged_attention for b in builds.values()], args.batch)
        lib.psq_paged_attention = alternating
        print(step_profile.decode_profile(args.batch, args.context, "auto"))
    a, b = (statistics.median(t) * 1e3 for t in alternating.times)
    print(f"attention kernel in the engine, batch {args.batch}: {args.rev} {a:.3f} ms, working tree {b:.3f} ms a "
          f"call ({a / b:.3f}x), {len(alternating.times[0])} and {len(alternating.times[1])} calls")


if __name__ == "__main__":
    main()
