"""What structured output costs: output tok/s of 16 concurrent requests under a JSON schema against the same
requests unconstrained, in the same run, alternated `--repeat` times (issue #12: at most 10%).

    python -m loadtest.structured_bench [--model M] [--concurrency 16] [--tokens 64] [--repeat 3] [--out FILE]

The schema asks for an array of at least 40 objects, so no output completes within --tokens and every
token is sampled under a mask: the figure is the per-token cost (the masks, filled during the forward
pass, and their application), not a shorter output. The default model, default flags.
"""
from __future__ import annotations

import argparse
import time

from loadtest.report import print_and_save
from pagedserve import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "required": ["id", "name", "tags"], "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000}, "name": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["new", "sale", "used", "rare"]}}}}}


def run(llm: LLM, prompts: list[str], tokens: int, constrained: bool) -> float:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=tokens, ignore_eos=True, structured_outputs=so)
              for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == tokens * len(prompts), "every request runs to --tokens"
    return n / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(args.model)
    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"List products of shop {i} as a JSON array."}], tokenize=False,
        add_generation_prompt=True) for i in range(args.concurrency)]
    run(llm, prompts, 8, True)             # warm-up: compiles the schema, fills the caches
    rows: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for _ in range(args.repeat):
        rows["unconstrained"].append(round(run(llm, prompts, args.tokens, False), 1))
        rows["json_schema"].append(round(run(llm, prompts, args.tokens, True), 1))
    best = {k: max(v) for k, v in rows.items()}
    result = {"concurrency": args.concurrency, "tokens": args.tokens, "output_tok_s": rows,
              "cost_of_best": round(1 - best["json_schema"] / best["unconstrained"], 3),
              "cost_of_median": round(1 - sorted(rows["json_schema"])[len(rows["json_schema"]) // 2]
                                      / sorted(rows["unconstrained"])[len(rows["unconstrained"]) // 2], 3)}
    print_and_save(result, args.out)


if __name__ == "__main__":
    main()
