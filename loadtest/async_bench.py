"""AsyncLLMEngine against the offline LLM.generate on the shared workload, measured in the same run.

    python -m loadtest.async_bench [--repeats 2] [--concurrency 64] [--json FILE]

The offline arm submits all requests at once with max_num_seqs = concurrency; the asyncio arm keeps
`concurrency` generate() streams open, starting the next request as one finishes. Both are greedy with
ignore_eos, so they produce the same tokens (asserted) and the ratio compares the same work. The arms
alternate (the machine is shared and noisy).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from loadtest.workload import load_workload
from pagedserve import LLM, AsyncLLMEngine, SamplingParams


def offline(reqs, params, c: int) -> tuple[float, list[list[int]]]:
    llm = LLM(None, kv_cache_memory=1.0, swap_space=0, max_num_seqs=c)
    llm.generate(reqs[0].prompt_token_ids, SamplingParams(max_tokens=4), use_tqdm=False)      # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


async def streamed(reqs, params, c: int) -> tuple[float, list[list[int]]]:
    async with AsyncLLMEngine(kv_cache_memory=1.0, swap_space=0, max_num_seqs=c) as engine:
        async for _ in engine.generate(reqs[0].prompt_token_ids, SamplingParams(max_tokens=4)):   # warm-up
            pass
        gate = asyncio.Semaphore(c)

        async def one(i: int) -> list[int]:
            async with gate:
                last = None
                async for last in engine.generate(reqs[i].prompt_token_ids, params[i], f"b{i}"):
                    pass
                return last.outputs[0].token_ids
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(len(reqs))))
        return time.perf_counter() - t0, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    reqs = load_workload()
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    rows = []
    for rep in range(args.repeats):
        t_off, a = offline(reqs, params, args.concurrency)
        t_async, b = asyncio.run(streamed(reqs, params, args.concurrency))
        assert a == b, "the asyncio engine's tokens differ from LLM.generate's"
        n = sum(len(t) for t in a)
        rows.append({"repeat": rep, "tokens": n, "offline_tok_s": n / t_off, "async_tok_s": n / t_async,
                     "ratio": t_off / t_async})
        print(f"repeat {rep}: {n} tokens, LLM.generate {n / t_off:.1f} tok/s, AsyncLLMEngine x{args.concurrency} "
              f"{n / t_async:.1f} tok/s, ratio {t_off / t_async:.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"concurrency": args.concurrency, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
