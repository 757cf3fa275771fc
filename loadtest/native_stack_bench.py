"""A/B of the native decoder stack and the AVX2 panel kernel against the layered path, in one engine.

    python -m loadtest.native_stack_bench [--repeats 2]

The shared workload, all requests submitted at once (loadtest/pagedserve_runs.py: alternate_arms), run
alternately with the decoder layers called from Python and every step beyond the vector kernel's rows on
the fp32 expansion and torch's GEMM (`layers+expand`: the path before models/native_stack.py and
kernels/qgemm_panel.cpp), and with both (`stack+panels`). Prints each run's output tok/s, the medians'
ratio, and how many outputs match token for token (greedy: the two paths' floats differ only in the
panel steps' summation order). The panels only run on AVX2; elsewhere the arms differ by the stack alone.
"""
from __future__ import annotations

import argparse

from gpu_worker.quantization import packed
from loadtest import pagedserve_runs
from loadtest.workload import load_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    llm = pagedserve_runs.make_llm(enable_prefix_caching=False)
    model, panel_rows = llm.engine.executor.runner.model, packed.PANEL_MAX_ROWS

    def layered() -> None:
        model._native_stack = None           # the layers from Python
        packed.PANEL_MAX_ROWS = 0            # no panel step

    def fused() -> None:
        model._native_stack = False          # built again at the next step
        packed.PANEL_MAX_ROWS = panel_rows

    try:
        pagedserve_runs.alternate_arms(llm, load_workload(), {"layers+expand": layered, "stack+panels": fused},
                                       args.repeats)
    finally:
        packed.PANEL_MAX_ROWS = panel_rows
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
