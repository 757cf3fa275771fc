"""bf16 matmuls with the weight plain against prepacked in oneDNN's layout (gpu_worker/layers/linear.py's
prepack_bf16), over SmolLM2-135M's 120 decoder products with distinct weights (so each streams from
memory, as in a step), at row counts of the steps that run them: a batch of 64 decodes, prefill chunks.

    python -m loadtest.bf16_prepack_bench [--rows 33,64,348,512] [--repeats 7]

Prints ms for all 120 products, median of --repeats with the arms alternated, and whether the products
were bit-identical.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu_worker.layers.linear import low_precision_linear, prepack_bf16

# (out, in) of SmolLM2-135M's fused QKV, o_proj, fused gate_up and down_proj; 30 layers of each
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def timed(weights: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for w in weights:
        low_precision_linear(xs[w.shape[1]], w, None)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[33, 64, 348, 512])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(n, k, generator=g).bfloat16() for _ in range(LAYERS) for n, k in SHAPES]
    packed = [prepack_bf16(w) for w in plain]
    if not packed[0].is_mkldnn:
        print("oneDNN bf16 is not available here: prepack_bf16 keeps weights plain")
        return
    print(f"{'rows':>5} {'plain ms':>9} {'prepacked ms':>12} {'ratio':>6}  identical")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, k in SHAPES}}
        same = all(torch.equal(low_precision_linear(xs[w.shape[1]], w, None),
                               low_precision_linear(xs[w.shape[1]], pw, None)) for w, pw in zip(plain[:4], packed[:4]))
        a, b = [], []
        for _ in range(args.repeats):
            a.append(timed(plain, xs))
            b.append(timed(packed, xs))
        pa, pb = statistics.median(a), statistics.median(b)
        print(f"{rows:>5} {pa:>9.2f} {pb:>12.2f} {pa / pb:>5.2f}x  {same}")


if __name__ == "__main__":
    main()
