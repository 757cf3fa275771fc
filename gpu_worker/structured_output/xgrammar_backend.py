"""GrammarBackend on xgrammar, vLLM's default structured-output library: JSON schema, regex and EBNF
compiled against the model's tokenizer, a CPU kernel for the masks (3-5 us a token for a nested schema on
this Xeon against llguidance's 31-63 us: loadtest/results/grammar_bench_2026-12-03.txt)."""
from __future__ import annotations

from typing import Any

import torch
import xgrammar as xgr

from common.structured_output import grammar_of


class XGrammarMatcher:
    def __init__(self, compiled: Any):
        self.m = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()


class XGrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # the manager caches compiled grammars by text (bounded): xgrammar's own cache would hold them twice
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, text: str, strict_whitespace: bool = False) -> Any:
        return self.compiler.compile_grammar(grammar_of(xgr, kind, text, strict_whitespace))

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
