"""Quantization benchmark: the default model with its GGUF blocks kept (`gguf`) against the same file
expanded to fp32 (`none`, the reference), measured in the same run with the arms alternated.

    python -m loadtest.quant_bench [--repeats 3] [--json FILE]

Rows, per arm:
  * c1 — the first 8 requests of the shared workload one at a time (greedy, ignore_eos, 64 new tokens):
    output tok/s, prompt included; and decode tok/s, the 63 tokens after the first of each request
    (each prompt is also run for 1 token, and prefix caching is off, so the difference is decode alone):
    the single-stream decode speed, which reads every weight once per token;
  * c64 — the shared 96-request workload submitted at once with max_num_seqs 64.
Also the weight bytes each worker holds and how many c1 outputs the two arms share token for token.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from loadtest.workload import load_workload
from pagedserve import LLM, SamplingParams

ARMS = ("gguf", "none")


def measure(quant: str, threads: int | None, model: str | None = None, **engine: Any) -> dict[str, Any]:
    """The c1 and c64 rows of one engine configuration (the default model unless `model`)."""
    llm = LLM(model, quantization=quant, dtype="float32", kv_cache_memory=1.0, swap_space=0, num_threads=threads,
              max_num_seqs=64, enable_prefix_caching=False, **engine)
    reqs = load_workload()
    llm.generate([reqs[0].prompt_token_ids], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    row: dict[str, Any] = {"weight_bytes": llm.engine.weight_bytes}
    sp1 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1)
    wall = first_wall = 0.0
    outs = []
    for r in reqs[:8]:
        t0 = time.perf_counter()
        llm.generate([r.prompt_token_ids], first, use_tqdm=False)
        t1 = time.perf_counter()
        outs += llm.generate([r.prompt_token_ids], sp1, use_tqdm=False)
        first_wall, wall = first_wall + t1 - t0, wall + time.perf_counter() - t1
    row["c1_tok_s"], row["c1_outputs"] = 8 * 64 / wall, [o.outputs[0].token_ids for o in outs]
    row["c1_decode_tok_s"] = 8 * 63 / (wall - first_wall)
    sps = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    llm.generate([r.prompt_token_ids for r in reqs], sps, use_tqdm=False)
    row["c64_tok_s"] = sum(r.max_tokens for r in reqs) / (time.perf_counter() - t0)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    results = []
    for rep in range(args.repeats):
        order = ARMS if rep % 2 == 0 else ARMS[::-1]      # alternate: the machine is shared and noisy
        got = {q: measure(q, args.threads) for q in order}
        kept, ref = got["gguf"], got["none"]
        same = sum(a == b for a, b in zip(kept["c1_outputs"], ref["c1_outputs"]))
        results.append({"repeat": rep, "gguf_weight_mib": kept["weight_bytes"] / 2**20,
                        "none_weight_mib": ref["weight_bytes"] / 2**20,
                        "weight_ratio": kept["weight_bytes"] / ref["weight_bytes"],
                        **{f"{q}_{c}_tok_s": got[q][f"{c}_tok_s"] for q in ARMS for c in ("c1", "c1_decode", "c64")},
                        "c1_speedup": kept["c1_tok_s"] / ref["c1_tok_s"],
                        "c1_decode_speedup": kept["c1_decode_tok_s"] / ref["c1_decode_tok_s"],
                        "c64_speedup": kept["c64_tok_s"] / ref["c64_tok_s"], "c1_identical_of_8": same})
    print(f"{'rep':>3} {'weights':>8} {'c1 gguf':>8} {'c1 fp32':>8} {'c1 x':>6} {'dec gguf':>8} {'dec fp32':>8} "
          f"{'dec x':>6} {'c64 gguf':>9} {'c64 fp32':>9} {'c64 x':>6} {'same':>5}")
    for r in results:
        print(f"{r['repeat']:>3} {r['weight_ratio']:>8.1%} {r['gguf_c1_tok_s']:>8.1f} {r['none_c1_tok_s']:>8.1f} "
              f"{r['c1_speedup']:>5.2f}x {r['gguf_c1_decode_tok_s']:>8.1f} {r['none_c1_decode_tok_s']:>8.1f} "
              f"{r['c1_decode_speedup']:>5.2f}x {r['gguf_c64_tok_s']:>9.1f} {r['none_c64_tok_s']:>9.1f} "
              f"{r['c64_speedup']:>5.2f}x {r['c1_identical_of_8']:>5}")
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=1))


if __name__ == "__main__":
    main()
