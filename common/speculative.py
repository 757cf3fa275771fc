"""Speculative decoding's configuration, in vLLM's form: `--speculative-config '{"method": "ngram", ...}'`
or `LLM(speculative_config={...})`. Parsed and checked once, so a bad value fails at start-up with one
clear message instead of in a worker."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2          # n-gram: shortest suffix that may match
    prompt_lookup_max: int = 5          # n-gram: longest suffix tried first
    model: str | None = None            # draft_model: the draft's folder or file
    disable_by_batch_size: int | None = None   # no drafts in a step with at least this many running

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> "SpeculativeConfig | None":
        """None, a JSON object string or a dict -> a checked config; raises ValueError naming the problem."""
        if value is None or value == "":
            return None
        raw = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(raw, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        raw.setdefault("method", "draft_model" if raw.get("model") else None)
        if raw["method"] not in SPEC_METHODS:
            raise ValueError(f"speculative_config: unknown method {raw['method']!r}; expected one of "
                             f"{', '.join(SPEC_METHODS)} (or a \"model\" for a draft model)")
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        cfg = cls(**raw)
        cfg._check()
        return cfg

    @property
    def lookahead_slots(self) -> int:
        """KV slots a sequence needs past the tokens a step computes: a draft model writes the KV of its
        own drafts there while proposing, before the target sees them."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    def check_vocab(self, target_vocab: int, draft_vocab: int) -> None:
        if target_vocab != draft_vocab:
            raise ValueError(f"speculative_config: the draft model {self.model!r} has a vocabulary of {draft_vocab} "
                             f"tokens, the target {target_vocab}; a draft must share the target's tokenizer")

    def check_draft(self, target_model: str | None) -> None:
        """Read both models' configurations and check that the draft can draft for the target (start-up
        checks in the CLI, before any process loads weights)."""
        if self.model is None:
            return
        from common.model_source import ModelSource
        try:
            draft = ModelSource.resolve(self.model, False).model_config()
        except ValueError as e:
            raise ValueError(f"speculative_config: draft model: {e}") from None
        try:
            target = ModelSource.resolve(target_model, False).model_config()
        except ValueError:
            return       # the target's own error is reported where it is loaded, naming --model
        self.check_vocab(target.vocab_size, draft.vocab_size)

    def _check(self) -> None:
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                                 f"prompt_lookup_max ({self.prompt_lookup_max})")
            if self.model is not None:
                raise ValueError("speculative_config: method ngram takes no model")
        elif self.model is None:
            raise ValueError("speculative_config: method draft_model needs a \"model\"")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config: disable_by_batch_size must be >= 1")
