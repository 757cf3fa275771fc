"""Speculative decoding benchmark: output tok/s with and without n-gram speculation, measured in the same run.

    python -m loadtest.spec_bench [--repeats 2] [--concurrency 1,8,64] [--json FILE]

Workloads:
  * grounded — loadtest/spec_workload.jsonl: rewrite or edit code, quote a passage, continue a list (the
    output repeats spans of the prompt, where prompt lookup pays); chat-templated, greedy, stopping at EOS
    or max_tokens. Concurrency c runs the requests in waves of c through LLM.generate (c = 1: one at a
    time, the single-stream case);
  * shared — the shared 96-request workload (greedy, ignore_eos) submitted at once with max_num_seqs 64, so
    64 run and the queue refills them (concurrency 64): the batch where speculation must cost nothing
    (``--shared``).
The two arms are two engines side by side that run each wave in turn (which first alternates), so the
machine's drift falls on both alike. Both give identical greedy outputs (asserted), so the ratio compares
the same work; the exception is a row of more than 8 sequences in `--dtype auto` (the shared row), which
is not batch-invariant (see main): there the lengths are asserted equal and the `differ` column counts
the outputs that changed.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from gpu_worker.kernels import native
from gpu_worker.quantization.packed import AMX_NATIVE_MAX_ROWS, I16_VECTOR_MAX_ROWS
from loadtest.workload import load_workload
from pagedserve import LLM, SamplingParams

WORKLOAD = Path(__file__).with_name("spec_workload.jsonl")
# k drafts make a verifying step of k + 1 rows; the packed kernel runs rows in tiles of 7 on AVX-512 and 5
# on AVX2 (gpu_worker/kernels/qgemm.cpp), and a step past one tile reads every weight twice, so k fills
# one tile: 6 on AVX-512, 4 on AVX2. Lookup from 1 token: a one-token match drafts one token
# (gpu_worker/spec_decode/ngram.py), so the matches that a 2-token minimum misses cost one row, not k
# (results/spec_bench_2026-12-05b.txt; loadtest/spec_replay.py compares the rules).
def row_tile() -> int:
    """Rows the packed kernel runs in one pass here (tile_rows in gpu_worker/kernels/qgemm.cpp)."""
    return 7 if native.cpu_isa() >= 2 else 5


def default_ngram() -> dict:
    k = row_tile() - 1
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 8}


def grounded_prompts(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    rows = [json.loads(line) for line in WORKLOAD.read_text().splitlines() if line.strip()]
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for r in rows]
    return prompts, [SamplingParams(temperature=0, max_tokens=r["max_tokens"]) for r in rows]


def run_waves(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], c: int) -> tuple[float, list]:
    """Wall seconds and outputs, running the requests in waves of c."""
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), c):
        outs += llm.generate(prompts[i:i + c], params[i:i + c], use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def grounded_llm(spec: dict | None, threads: int | None = None, quantization: str | None = None,
                 dtype: str = "auto"):
    """The default model's engine (with `spec`, or none), the grounded prompts and their parameters,
    after one warm-up request."""
    # max_num_seqs 64, for the shared row: at most 64 in flight, the queue refilling them (concurrency 64)
    quant = {"quantization": quantization} if quantization else {}
    llm = LLM(None, kv_cache_memory=1.0, swap_space=0, num_threads=threads, speculative_config=spec,
              max_num_seqs=64, dtype=dtype, **quant)
    prompts, params = grounded_prompts(llm)
    run_waves(llm, prompts[:1], [SamplingParams(temperature=0, max_tokens=8)], 1)        # warm-up
    return llm, prompts, params


def measure(spec: dict | None, args: argparse.Namespace, rep: int = 0) -> dict[str, tuple[dict, dict]]:
    """Each row's (without, with) speculation. Two engines stand side by side and run every wave in turn,
    which of them first alternating (from `rep` on), so that the machine's drift from wave to wave falls
    on both arms alike: timing whole arms one after the other moved the c=1 ratio by +-6% between repeats."""
    (base, prompts, params), (speculating, _, _) = (grounded_llm(s, args.threads, args.quantization, args.dtype)
                                                    for s in (None, spec))
    engines = [base, speculating]
    rows = {f"grounded-c{c}": paired(engines, prompts, params, c, rep) for c in args.concurrency}
    if args.shared:
        reqs = load_workload()
        sp = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
        rows["shared-c64"] = paired(engines, [r.prompt_token_ids for r in reqs], sp, len(reqs), rep)
    for llm in engines:
        llm.shutdown()
    return rows


def paired(engines: list[LLM], prompts: list[list[int]], params: list[SamplingParams], c: int,
           start: int) -> tuple[dict, dict]:
    """The rows of both engines over the requests in waves of c, each wave run by both in turn."""
    walls, outs = [0.0, 0.0], [[], []]
    before = _spec_counts(engines[1])
    for w, i in enumerate(range(0, len(prompts), c)):
        for arm in ((0, 1) if (w + start) % 2 == 0 else (1, 0)):
            wall, tokens = run_waves(engines[arm], prompts[i:i + c], params[i:i + c], c)
            walls[arm] += wall
            outs[arm] += tokens
    return _row(walls[0], outs[0], (0, 0, 0), (0, 0, 0)), _row(walls[1], outs[1], before, _spec_counts(engines[1]))


def _spec_counts(llm: LLM) -> tuple[int, int, int]:
    st = llm.stats
    return st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens


def _row(wall: float, tokens: list[list[int]], before: tuple[int, int, int], after: tuple[int, int, int]) -> dict:
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before))
    n = sum(len(t) for t in tokens)
    return {"wall_s": wall, "tokens": n, "tok_s": n / wall, "outputs": tokens, "drafts": drafts,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--shared", action="store_true", help="also the shared 96-request workload at once")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantization", default=None, help="e.g. none: the default model's weights expanded to fp32")
    ngram = default_ngram()
    p.add_argument("--speculative-config", type=json.loads, default=ngram,
                   help=f"JSON (default here {json.dumps(ngram)})")
    p.add_argument("--dtype", default="auto", help="the engine's --dtype (float32: the exact, batch-invariant mode)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    # Rows are bit-identical with and without drafts only where a token's result does not depend on its
    # step's other rows: fp32. In `--dtype auto` a step beyond the packed vector kernel's rows runs another
    # kernel (bf16 hardware: the bf16 GEMM beyond GEMM_MAX_ROWS; without it the int16 panels, which
    # without speculation take steps from I16_VECTOR_MAX_ROWS + 1 rows), and speculation changes which
    # tokens share such steps, so the shared row may differ there (same lengths, counted in `differ`).
    # Up to this many sequences both arms' decodes and verifications stay on the vector kernel, so the
    # default grounded rows (c1, c8) are asserted identical.
    invariant = args.dtype == "float32"
    exact_up_to = min(AMX_NATIVE_MAX_ROWS, *I16_VECTOR_MAX_ROWS.values())
    results = []
    for rep in range(args.repeats):          # the machine is shared and noisy: repeat the rows
        for name, (b, s) in measure(args.speculative_config, args, rep).items():
            differ = sum(x != y for x, y in zip(b["outputs"], s["outputs"]))
            assert [len(x) for x in b["outputs"]] == [len(y) for y in s["outputs"]], f"{name}: lengths differ"
            concurrency = int(name.rsplit("-c", 1)[1])
            assert differ == 0 or not (invariant or concurrency <= exact_up_to), \
                f"{name}: outputs differ with speculation"
            results.append({"repeat": rep, "row": name, "base_tok_s": b["tok_s"], "spec_tok_s": s["tok_s"],
                            "speedup": s["tok_s"] / b["tok_s"], "tokens": b["tokens"], "differ": differ,
                            "acceptance_rate": s["acceptance_rate"], "mean_accepted_length": s["mean_accepted_length"]})
    print(f"{'row':<14} {'rep':>3} {'tokens':>6} {'base tok/s':>10} {'ngram tok/s':>11} {'speed-up':>8} "
          f"{'accept':>7} {'mean len':>8} {'differ':>6}")
    for r in results:
        acc = f"{r['acceptance_rate']:.1%}" if r["acceptance_rate"] is not None else "-"
        mal = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
        print(f"{r['row']:<14} {r['repeat']:>3} {r['tokens']:>6} {r['base_tok_s']:>10.1f} {r['spec_tok_s']:>11.1f} "
              f"{r['speedup']:>7.2f}x {acc:>7} {mal:>8} {r['differ']:>6}")
    if args.json:
        args.json.write_text(json.dumps({"config": args.speculative_config, "dtype": args.dtype, "results": results},
                                        indent=1))


if __name__ == "__main__":
    main()
