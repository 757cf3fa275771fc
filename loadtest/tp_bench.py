"""TP=1 against TP=2 on this machine: decode step time at a few batch sizes and the time of a long prefill,
the offline engine on the default model, each row measured `--repeat` times (issue #11's closing figure).

    python -m loadtest.tp_bench [--model M] [--dtype auto] [--batches 1 16 64] [--repeat 2] [--out FILE]

On a machine with few cores the ranks split the cores (1 each on 2 cores), so each rank's matmuls run on
half the threads while every layer adds two all-reduces over gloo (TCP on loopback): TP=2 is expected to be
slower here; the benchmark says by how much, and where (it also times one gloo all-reduce of a step's
hidden states: 2 per layer, plus the embedding's and the logits gather, are 62 a step on the default model).
"""
from __future__ import annotations

import argparse
import time

from loadtest.report import print_and_save
from pagedserve import LLM, SamplingParams

DECODE_TOKENS = 32
PREFILL_TOKENS = 512


def _decode_step_ms(llm: LLM, batch: int) -> float:
    """Mean wall time of one decode step with `batch` sequences (prefill excluded by a 1-token run)."""
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(batch)]
    warm = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS + 1, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, warm, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(prompts, full, use_tqdm=False)
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / DECODE_TOKENS * 1000


def _prefill_ms(llm: LLM) -> float:
    prompt = [[(7 * i) % 20000 + 50 for i in range(PREFILL_TOKENS)]]
    t0 = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return (time.perf_counter() - t0) * 1000


def _allreduce_rank(rank: int, port: int, rows: list[int], out) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for n in rows:
        x = torch.ones(n, HIDDEN)
        for _ in range(50):
            dist.all_reduce(x)
        t0 = time.perf_counter()
        for _ in range(COLLECTIVES):
            dist.all_reduce(x)
        if rank == 0:
            out[n] = round((time.perf_counter() - t0) / COLLECTIVES * 1e6, 1)
    dist.destroy_process_group()


HIDDEN = 576          # the default model's hidden size: what each row-parallel all-reduce carries per row
COLLECTIVES = 1000


def allreduce_us(rows: list[int]) -> dict[int, float]:
    """Microseconds per gloo all-reduce of [rows, HIDDEN] fp32 between two processes on loopback."""
    import torch.multiprocessing as mp
    from pagedserve.engine_processes import free_port
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_allreduce_rank, args=(free_port(), rows, out), nprocs=2)
        return dict(out)


def measure(model: str | None, tp: int, dtype: str, batches: list[int], repeat: int) -> dict:
    llm = LLM(model, dtype=dtype, tensor_parallel_size=tp, enable_prefix_caching=False,
              max_num_batched_tokens=PREFILL_TOKENS)
    _decode_step_ms(llm, 1)      # warm-up
    rows = {f"decode_step_ms_b{b}": [round(_decode_step_ms(llm, b), 2) for _ in range(repeat)] for b in batches}
    rows[f"prefill_{PREFILL_TOKENS}_ms"] = [round(_prefill_ms(llm), 1) for _ in range(repeat)]
    if tp > 1:
        llm.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"model": args.model or "default", "dtype": args.dtype}
    for tp in (1, 2):
        result[f"tp{tp}"] = measure(args.model, tp, args.dtype, args.batches, args.repeat)
    result["gloo_allreduce_us_by_rows"] = allreduce_us(args.batches)
    for key in result["tp1"]:
        result.setdefault("tp2_over_tp1", {})[key] = round(min(result["tp2"][key]) / min(result["tp1"][key]), 2)
    print_and_save(result, args.out)


if __name__ == "__main__":
    main()
