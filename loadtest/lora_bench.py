"""Multi-LoRA benchmark: the default model serving the shared workload at concurrency 64 with its requests
spread over 4 adapters of rank 16 (every projection adapted), against the same engine serving the base
model alone, measured in the same run with the arms alternated.

    python -m loadtest.lora_bench [--repeats 3] [--json FILE]

Arms, each its own offline engine (max_num_seqs 64, prefix caching off, the GGUF blocks kept), all built
once in this process and then run in turn, the order alternated every repeat: the machine's speed drifts
over minutes, and engines started in separate processes were seen to differ by 20% for no reason of theirs.
  * base — LoRA off;
  * lora4 — --enable-lora --max-loras 4 --max-lora-rank 16, request i under adapter i % 4;
  * lora-idle — LoRA on with the 4 adapters resident, every request on the base model (the cost of
    having LoRA on when a step uses none).
Rows: output tok/s of the 96 requests submitted at once (greedy, ignore_eos, each its max_tokens).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common.model_source import ModelSource
from loadtest.lora_adapters import ALL_TARGETS, build_adapter
from loadtest.workload import load_workload
from pagedserve import LLM, LoRARequest, SamplingParams

ARMS = ("base", "lora4", "lora-idle")
NUM_ADAPTERS, RANK = 4, 16


def make_adapters(folder: Path) -> list[LoRARequest]:
    """4 random rank-16 adapters of the default model (shapes from its config; weights are random)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    src = ModelSource.resolve(None)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(src.path.parent), gguf_file=src.path.name))
    return [LoRARequest(f"bench-{i}", i + 1, str(build_adapter(hf, folder / f"a{i}", RANK, ALL_TARGETS, seed=i,
                                                                  std=0.02)))
            for i in range(NUM_ADAPTERS)]


def make_engine(arm: str, adapters: list[LoRARequest], threads: int | None) -> LLM:
    lora = arm != "base"
    llm = LLM(dtype="float32", kv_cache_memory=1.0, swap_space=0, num_threads=threads, max_num_seqs=64,
              enable_prefix_caching=False, enable_lora=lora, max_loras=NUM_ADAPTERS, max_lora_rank=RANK)
    warm = [[100 + i] * 8 for i in range(NUM_ADAPTERS)]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                 lora_request=adapters if lora else None)        # lora-idle: the adapters are resident
    return llm


def measure(llm: LLM, arm: str, adapters: list[LoRARequest]) -> float:
    reqs = load_workload()
    sps = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    per_request = [adapters[i % NUM_ADAPTERS] for i in range(len(reqs))] if arm == "lora4" else None
    t0 = time.perf_counter()
    llm.generate([r.prompt_token_ids for r in reqs], sps, use_tqdm=False, lora_request=per_request)
    return sum(r.max_tokens for r in reqs) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    arms = tuple(args.arms.split(","))
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        adapters = make_adapters(Path(tmp))
        engines = {arm: make_engine(arm, adapters, args.threads) for arm in arms}
        results: list[dict[str, Any]] = []
        for rep in range(args.repeats):
            order = arms if rep % 2 == 0 else arms[::-1]      # alternate: the machine is shared and noisy
            got = {arm: measure(engines[arm], arm, adapters) for arm in order}
            row = {"repeat": rep, **{f"{a}_tok_s": got[a] for a in arms}}
            row.update({f"{a}_vs_base": got[a] / got["base"] for a in arms if a != "base" and "base" in got})
            results.append(row)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    summary = {k: statistics.median(r[k] for r in results) for k in results[0] if k != "repeat"}
    print("median:", " ".join(f"{k}={v:.3f}" for k, v in summary.items()))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "median": summary}, indent=1))


if __name__ == "__main__":
    main()
