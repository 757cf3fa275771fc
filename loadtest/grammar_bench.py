"""Which grammar library: compile time and per-token mask time of llguidance and xgrammar on one nested
JSON schema with the default model's tokenizer, on this CPU (issue #12 asks for the choice by measurement).

    pip install llguidance     # (in the loadtest extra)
    python -m loadtest.grammar_bench [--repeat 2]

Each library walks the same JSON document token by token: before every token it fills the next-token mask,
then accepts the token. The first pass pays the caches. Result: results/grammar_bench_2026-12-03.txt.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

SCHEMA = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
    "address": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
DOCUMENT = {"name": "Alice Smith", "age": 31, "tags": ["a", "c"], "address": {"city": "Paris", "zip": "75001"}}


def _walk(fill: Callable[[], None], accept: Callable[[int], bool], ids: list[int]) -> dict[str, float]:
    times = []
    for t in ids:
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        assert accept(t), f"the schema refused token {t}"
    return {"mask_us_mean": round(sum(times) / len(times) * 1e6, 1), "mask_us_max": round(max(times) * 1e6, 1)}


def llguidance_row(tok: Any, ids: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    t_tok = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lltok, grammar)
    t_compile = time.perf_counter() - t0
    mask = lt.allocate_token_bitmask(1, len(tok))
    return {"tokenizer_s": round(t_tok, 3), "compile_ms": round(t_compile * 1e3, 2),
            **_walk(lambda: lt.fill_next_token_bitmask(m, mask, 0), m.consume_token, ids)}


def xgrammar_row(tok: Any, ids: list[int]) -> dict[str, float]:
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    t_tok = time.perf_counter() - t0
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t_compile = time.perf_counter() - t0
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, len(tok))
    return {"tokenizer_s": round(t_tok, 3), "compile_ms": round(t_compile * 1e3, 2),
            **_walk(lambda: m.fill_next_token_bitmask(mask, 0), m.accept_token, ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    from common.model_source import ModelSource
    tok = ModelSource.resolve(None).load_tokenizer()
    ids = tok.encode(json.dumps(DOCUMENT))
    print(f"{len(ids)} tokens of JSON, vocabulary {len(tok)}")
    for name, row in (("llguidance", llguidance_row), ("xgrammar", xgrammar_row)):
        for i in range(args.repeat):
            try:
                print(name, i, row(tok, ids))
            except ImportError as e:
                print(name, "not installed:", e)
                break


if __name__ == "__main__":
    main()
