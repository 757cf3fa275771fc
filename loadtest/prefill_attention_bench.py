"""Prefill attention on the CPU in fp32 against bf16 (--dtype auto with a bf16 cache on AMX, where
gpu_worker/attention/cpu_attention.py's prefill_dtype rounds a prefill's queries, keys and values to bf16
for torch's SDPA).

    python -m loadtest.prefill_attention_bench [--lens 64,128,256,512] [--ttft 128,256,512] [--repeats 3]

1. SDPA alone, SmolLM2's heads (9 query heads over 3 kv heads of 64): a fresh causal prefill of L tokens,
   and a chunk of 64 queries behind a context of L keys (masked), ms per layer call (median of 20), and
   the largest difference of the bf16 output from fp32.
2. Time to first token: 6 random prompts of each --ttft length, each a one-token request alone, both
   arms alternated over 3 rounds; median ms.
3. End to end: the shared workload's 96 requests at once (max_num_seqs 64, prefix caching off, the
   default model in --dtype auto), prefill attention in bf16 against fp32, arms alternated --repeats
   times in one engine (loadtest/pagedserve_runs.py: alternate_arms). --repeats 0 skips it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from gpu_worker.attention import cpu_attention
from loadtest import pagedserve_runs
from loadtest.packed_rows_bench import median_ms
from loadtest.workload import load_workload

HQ, HKV, D, CHUNK = 9, 3, 64, 64


def _sdpa(q, k, v, mask, dtype):
    o = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask,
                                       is_causal=mask is None, enable_gqa=True)
    return o.float()


def sdpa_rows(lens: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    print(f"{'L':>5} {'fresh fp32':>10} {'bf16':>7} {'ratio':>6} {'max diff':>9} | "
          f"{'chunk fp32':>10} {'bf16':>7} {'ratio':>6}   (ms per layer call)")
    for n in lens:
        # [1, H, L, D] views of [L, H, D] tensors, as the backend hands them to SDPA
        q, k, v = (torch.randn(n, h, D, generator=g).transpose(0, 1).unsqueeze(0) for h in (HQ, HKV, HKV))
        qc = torch.randn(CHUNK, HQ, D, generator=g).transpose(0, 1).unsqueeze(0)
        mask = torch.arange(n)[None, :] <= torch.arange(n - CHUNK, n)[:, None] if n >= CHUNK else None
        f32 = median_ms(lambda: _sdpa(q, k, v, None, torch.float32), 20)
        b16 = median_ms(lambda: _sdpa(q, k, v, None, torch.bfloat16), 20)
        diff = (_sdpa(q, k, v, None, torch.bfloat16) - _sdpa(q, k, v, None, torch.float32)).abs().max().item()
        line = f"{n:>5} {f32:>10.3f} {b16:>7.3f} {f32 / b16:>5.2f}x {diff:>9.2e} | "
        if mask is not None:
            c32 = median_ms(lambda: _sdpa(qc, k, v, mask, torch.float32), 20)
            c16 = median_ms(lambda: _sdpa(qc, k, v, mask, torch.bfloat16), 20)
            line += f"{c32:>10.3f} {c16:>7.3f} {c32 / c16:>5.2f}x"
        print(line)


CHOSEN = cpu_attention.prefill_dtype


def arm(on: bool):
    """Set-up of one arm: prefill attention as prefill_dtype chooses, or in the query's dtype (fp32)."""
    def setup() -> None:
        cpu_attention.prefill_dtype = CHOSEN if on else (lambda cache_dtype, query: query.dtype)
    return setup


def first_token(llm, lens: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    for n in lens:
        prompts = [{"prompt_token_ids": torch.randint(1000, 40000, (n,), generator=g).tolist()} for _ in range(6)]
        ms: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(3):
            for on in (True, False):
                arm(on)()
                for p in prompts:
                    t0 = time.perf_counter()
                    llm.generate([p], pagedserve_runs.greedy(1), use_tqdm=False)
                    ms[on].append((time.perf_counter() - t0) * 1e3)
        a, b = statistics.median(ms[True]), statistics.median(ms[False])
        print(f"  prompt of {n}: first token {a:.1f} ms as chosen, {b:.1f} ms in fp32 ({b / a:.2f}x)")


def end_to_end(llm, repeats: int) -> None:
    pagedserve_runs.alternate_arms(llm, load_workload(), {"prefill attention as chosen": arm(True),
                                                          "prefill attention fp32": arm(False)}, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", type=lambda s: [int(x) for x in s.split(",") if x], default=[64, 128, 256, 512])
    p.add_argument("--ttft", type=lambda s: [int(x) for x in s.split(",") if x], default=[128, 256, 512])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.lens:
        sdpa_rows(args.lens)
    if not (args.ttft or args.repeats):
        return
    llm = pagedserve_runs.make_llm(max_num_seqs=64, enable_prefix_caching=False)
    try:
        if args.ttft:
            first_token(llm, args.ttft)
        if args.repeats:
            end_to_end(llm, args.repeats)
    finally:
        cpu_attention.prefill_dtype = CHOSEN


if __name__ == "__main__":
    main()
