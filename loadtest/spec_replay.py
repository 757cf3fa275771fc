"""Replays n-gram drafting over fixed greedy outputs, to compare drafting rules without the noise of timing.

    python -m loadtest.spec_replay [--row-cost 0.07,0.10,0.13] [--tile-cost 0.15]

The grounded workload (loadtest/spec_workload.jsonl) is decoded once without speculation; greedy output
does not depend on speculation, so every rule then sees the same tokens. For each position the proposer
drafts from the prompt and the output so far, the longest accepted prefix plus the target's own token
advance the position, and the step is charged by its rows: 1 + row_cost * (rows - 1) decode steps, plus
tile_cost for each further pass of the packed kernel's row tile (7 rows on AVX-512, 5 on AVX2). A draft
row measured 0.06-0.07 of a decode step on a loaded 2-core Xeon and 0.11 on a quiet one; the second
tile about 0.15 more (results/spec_bench_2026-12-05b.txt).

Printed per rule: decode steps, acceptance, and output tokens per decode-step of cost (the speed-up of
the decode phase; prefill, the same in both arms, brings the measured end-to-end ratio below it).
"""
from __future__ import annotations

import argparse

import numpy as np

from gpu_worker.spec_decode.ngram import draft_limit, longest_match
from loadtest.spec_bench import grounded_llm, row_tile, run_waves

# (name, k, lookup min, lookup max, drafts after an n-token match)
EVERY, OURS, N_PLUS_1 = (lambda n, k: k), draft_limit, (lambda n, k: min(k, n + 1))
RULES = [("k4 2..5, k from every match", 4, 2, 5, EVERY), ("k5 2..5, k from every match", 5, 2, 5, EVERY),
         ("k5 1..8, k from every match", 5, 1, 8, EVERY), ("k6 1..8, k from every match", 6, 1, 8, EVERY),
         ("k5 1..8, 1 after a 1-match", 5, 1, 8, OURS), ("k6 1..8, 1 after a 1-match", 6, 1, 8, OURS),
         ("k8 1..8, 1 after a 1-match", 8, 1, 8, OURS), ("k6 1..8, n + 1 after n", 6, 1, 8, N_PLUS_1),
         ("k5 2..5, n + 1 after n", 5, 2, 5, N_PLUS_1)]


def replay(prompts: list[list[int]], outputs: list[list[int]], k: int, min_n: int, max_n: int, limit,
           row_cost: float, tile_cost: float, tile: int) -> tuple[float, int, float]:
    """(tokens per unit of step cost, steps, acceptance) of one rule over every request."""
    cost, steps, drafted, accepted = 0.0, 0, 0, 0
    for prompt, out in zip(prompts, outputs):
        tokens, i = np.asarray(prompt + out, dtype=np.int64), 0
        while i < len(out):
            context = tokens[:len(prompt) + i]
            start, n = longest_match(context, min_n, max_n)
            draft = context[start:start + limit(n, k)] if n else context[:0]
            truth = tokens[len(prompt) + i:len(prompt) + i + len(draft)]
            a = int(np.cumprod(draft[:len(truth)] == truth).sum())
            rows = len(draft) + 1
            cost += 1 + row_cost * (rows - 1) + tile_cost * ((rows - 1) // tile)
            steps, drafted, accepted, i = steps + 1, drafted + len(draft), accepted + a, i + a + 1
    return sum(len(o) for o in outputs) / cost, steps, accepted / max(drafted, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row-cost", type=lambda s: [float(x) for x in s.split(",")], default=[0.07, 0.10, 0.13])
    p.add_argument("--tile-cost", type=float, default=0.15)
    args = p.parse_args()
    llm, prompts, params = grounded_llm(None)
    _, outputs = run_waves(llm, prompts, params, 1)
    tile = row_tile()
    print(f"{sum(len(o) for o in outputs)} output tokens over {len(prompts)} requests; row tile {tile}")
    print(f"{'rule':<31} {'steps':>5} {'accept':>7} " + " ".join(f"{'row ' + str(c):>9}" for c in args.row_cost))
    for name, k, lo, hi, limit in RULES:
        runs = [replay(prompts, outputs, k, lo, hi, limit, c, args.tile_cost, tile) for c in args.row_cost]
        print(f"{name:<31} {runs[0][1]:>5} {runs[0][2]:>7.1%} " + " ".join(f"{r[0]:>8.3f}x" for r in runs))


if __name__ == "__main__":
    main()
