"""Turns the engine's per-sequence token outputs into per-choice text deltas, applying stop strings.

Shared by the offline API and the router: each owns one RequestTracker per request. A stop string ends
one choice here, and the caller aborts that sequence in the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.detokenizer import IncrementalDetokenizer
from common.protocol import EngineOutput, Logprob
from common.sampling_params import SamplingParams


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None
    stop_reason: int | str | None
    abort_engine: bool = False     # a stop string ended it; the engine still runs the sequence


@dataclass
class Choice:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None     # beam search: the finished beam's score before length penalty

    @property
    def text(self) -> str:
        return self.detok.output_text


class RequestTracker:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.choices = [Choice(i, IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                         skip_special_tokens=params.skip_special_tokens,
                                                         stop=params.stop,
                                                         include_stop_str_in_output=params.include_stop_str_in_output))
                        for i in range(params.n)]
        # the worker reports nothing for a one-token prompt, whose only position has no logprob
        self.prompt_logprobs: list[Logprob | None] = [None] if len(prompt_token_ids) == 1 else []
        self.num_cached_tokens = 0
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def process(self, eo: EngineOutput) -> ChoiceDelta | None:
        """Apply one engine output; None if that choice had already finished (e.g. on a stop string)."""
        c = self.choices[eo.index]
        if eo.prompt_logprobs:
            if eo.prompt_logprobs[0] is None:   # a first chunk: the prompt was (re)computed from its start,
                self.prompt_logprobs = []       # as after a preemption by recompute
            self.prompt_logprobs.extend(eo.prompt_logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, eo.num_cached_tokens)
        if eo.error:
            self.error = eo.error
        if eo.cumulative_logprob is not None:
            c.cumulative_logprob = eo.cumulative_logprob
        if c.finish_reason is not None:
            return None
        tokens = eo.new_token_ids
        lps = eo.logprobs
        text = c.detok.update(tokens) if tokens else ""
        abort = False
        if c.detok.stop_reason is not None:
            c.finish_reason, c.stop_reason, abort = "stop", c.detok.stop_reason, eo.finish_reason is None
        elif eo.finish_reason is not None:
            c.finish_reason, c.stop_reason = eo.finish_reason, eo.stop_reason
            text += c.detok.finish()
        c.token_ids.extend(tokens)
        if lps:
            c.logprobs.extend(lps)
        return ChoiceDelta(eo.index, text, tokens, lps, c.finish_reason, c.stop_reason, abort)
