"""Admission checks: can this request ever be served as asked, and is there room in the queue for it?

Pure functions of the request, the configuration and the queue's size, so the scheduler's loop holds
no validation and every rule can be tested alone. Each refusal carries an HTTP status and the
offending parameter, which the router turns into an OpenAI error.
"""
from __future__ import annotations

from common.protocol import EngineRequest
from scheduler.config import SchedulerConfig
from common.kv_layout import max_blocks_held


class RequestRejected(ValueError):
    """The request can never be served as asked; `code` is an HTTP status for the router."""

    def __init__(self, message: str, code: int = 400, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


def validate_request(er: EngineRequest, c: SchedulerConfig, num_waiting: int = 0, waiting_tokens: int = 0) -> int:
    """Raise RequestRejected for a request that cannot be served (400) or does not fit the waiting queue
    (429); otherwise return its effective max_tokens."""
    sp = er.sampling_params
    n_prompt = len(er.prompt_token_ids)
    if n_prompt == 0:
        raise RequestRejected("the prompt is empty", 400, "prompt")
    _check_token_ids(er, c.vocab_size)
    if sp.n > c.max_num_seqs:
        raise RequestRejected(f"n ({sp.n}) exceeds max_num_seqs ({c.max_num_seqs}), the most sequences that "
                              f"can run at once", 400, "n")
    max_tokens = _check_length(n_prompt, sp.max_tokens, c)
    if sp.use_beam_search:
        _check_beam_search(sp.n, n_prompt + max_tokens, c)
    if num_waiting >= c.max_waiting_requests or waiting_tokens + n_prompt > c.max_waiting_tokens:
        raise RequestRejected("the server is overloaded: the waiting queue is full", 429)
    return max_tokens


def _check_length(n_prompt: int, asked: int | None, c: SchedulerConfig) -> int:
    if n_prompt >= c.max_model_len:
        raise RequestRejected(f"the prompt has {n_prompt} tokens, but this model's maximum context length "
                              f"(max_model_len) is {c.max_model_len}; at least one token must be left to generate",
                              400, "prompt")
    max_tokens = asked if asked is not None else c.max_model_len - n_prompt
    if n_prompt + max_tokens > c.max_model_len:
        raise RequestRejected(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = {n_prompt + max_tokens} "
                              f"exceeds max_model_len {c.max_model_len}", 400, "max_tokens")
    need = max_blocks_held(c.kv_group_windows, n_prompt + max_tokens, c.block_size, c.max_num_batched_tokens)
    if need > c.num_blocks:
        raise RequestRejected(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks but "
                              f"the cache holds only {c.num_blocks} blocks of {c.block_size} tokens "
                              f"({c.num_blocks * c.block_size // len(c.kv_group_windows)} tokens per layer)", 400,
                              "max_tokens")
    return max_tokens


def _check_beam_search(width: int, length: int, c: SchedulerConfig) -> None:
    """Beams share blocks while they agree, but in the worst case each holds its own: all of them must fit
    at once, or a search could wait forever for room that its own parked beams hold."""
    if c.speculative:
        raise RequestRejected("beam search is not supported with speculative decoding", 400, "use_beam_search")
    need = width * max_blocks_held(c.kv_group_windows, length, c.block_size, c.max_num_batched_tokens)
    if need > c.num_blocks:
        raise RequestRejected(f"beam search with {width} beams of up to {length} tokens may need {need} KV blocks but "
                              f"the cache holds only {c.num_blocks}: use fewer beams or a smaller max_tokens", 400, "n")


def _check_token_ids(er: EngineRequest, vocab_size: int | None) -> None:
    """Out-of-vocabulary ids would fail the whole batch's step on the worker: refuse them here."""
    if vocab_size is None:
        return
    sp = er.sampling_params
    for param, ids in (("prompt", er.prompt_token_ids), ("stop_token_ids", sp.stop_token_ids),
                       ("logit_bias", list(sp.logit_bias or ()))):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"token id {bad} in {param} is outside the vocabulary [0, {vocab_size})", 400, param)
