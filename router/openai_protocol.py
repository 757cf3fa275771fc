"""OpenAI request bodies -> (prompt token ids, SamplingParams, response options), validated at the edge.

Everything a client can get wrong is caught here and raised as an APIError carrying the HTTP status and
the OpenAI error fields, so the server never answers bad input with a 500 and the engine never sees a
request it would have to reject for a reason the router could have known.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from common import structured_output
from common.lora import LoRARequest
from common.sampling_params import MAX_TOP_LOGPROBS, ParamError, SamplingParams
from router.api_error import APIError, bad
from router.chat_messages import parse_messages, render_chat
from router.request_fields import check_fields
from router.tools import ToolRequest, parse_tools

# A completions call may carry a batch of prompts; each becomes an engine request of its own.
MAX_PROMPTS = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model."""
    name: str
    vocab_size: int
    max_model_len: int
    lora_enabled: bool = False     # other model names are adapter names, for the scheduler to resolve
    aliases: tuple[str, ...] = ()  # --served-model-name's other names: the base model too
    # generation_config.json's defaults (SamplingParams names), for fields a request leaves out
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    auto_tool_choice: bool = False   # --enable-auto-tool-choice
    tool_call_parser: str | None = None


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None        # the prompt as the client wrote it (or the rendered chat prompt); None for ids


@dataclass
class ParsedRequest:
    chat: bool
    prompts: list[PromptInput]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    # completions: `logprobs` (top count); chat: `top_logprobs` when `logprobs` is true; None: no logprobs
    logprobs: int | None = None
    user: str | None = None
    lora_name: str | None = None    # the adapter `model` names; None: the base model
    model_name: str | None = None   # `model` as the client sent it: responses echo it, as vLLM's do
    tools: ToolRequest | None = None   # chat with tool_choice auto, required or named (router/tools.py)

    @property
    def lora(self) -> LoRARequest | None:
        return LoRARequest(self.lora_name) if self.lora_name else None


# ---- JSON body -------------------------------------------------------------------------------------
def decode_json_body(raw: bytes, content_type: str) -> dict[str, Any]:
    """The body as a JSON object. orjson first; the stdlib only to tell huge integers from bad JSON."""
    if content_type != "application/json":
        raise bad(f"Content-Type must be application/json, got {content_type or 'none'!r}")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:   # orjson turns integers beyond 64 bits into floats but rejects nothing else json accepts...
            body = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:   # ...except NaN/Infinity, which we reject too
            raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


# ---- typed field access ----------------------------------------------------------------------------
# JSON null means "not given", as OpenAI's SDKs send it for unset fields.
def _int(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():     # 16.0, or an integer too large for orjson
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer, got {v!r}", name)
    return v


def _float(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"'{name}' must be a number, got {v!r}", name)
    return float(v)


def bool_field(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {v!r}", name)
    return v


def _str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad(f"'{name}' must be a string, got {type(v).__name__}", name)
    return v


def _or(v: Any, default: Any) -> Any:
    return default if v is None else v


# ---- shared checks ---------------------------------------------------------------------------------
def check_model(body: dict, model: ModelInfo) -> str | None:
    """The adapter `model` names, or None for the base model. With LoRA on, any other name is passed on as
    an adapter name: the scheduler holds the adapters (loaded at run time through any router replica) and
    answers 404 for a name it does not know."""
    name = _str(body, "model")
    if name is None or name == model.name or name in model.aliases:
        return None
    if model.lora_enabled:
        return name
    raise APIError(404, f"The model `{name}` does not exist. This server serves `{model.name}`.",
                   param="model", code="model_not_found")


def token_ids(v: Any, model: ModelInfo, param: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad(f"'{param}' must be a list of integer token ids", param)
    bad_ids = [t for t in v if not 0 <= t < model.vocab_size]
    if bad_ids:
        raise bad(f"token id {bad_ids[0]} in '{param}' is outside the vocabulary [0, {model.vocab_size})", param)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise bad("'stop' must be a string or a list of strings", "stop")


def _logit_bias(body: dict, model: ModelInfo) -> dict[int, float] | None:
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    out = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except ValueError:
            raise bad(f"logit_bias key {k!r} is not a token id", "logit_bias") from None
        if not 0 <= tid < model.vocab_size:
            raise bad(f"logit_bias token id {tid} is outside the vocabulary [0, {model.vocab_size})", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise bad(f"logit_bias value for {k!r} must be a number", "logit_bias")
        out[tid] = float(b)
    return out


def _stream_options(body: dict, stream: bool) -> bool:
    """Whether a final usage chunk was asked for."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return bool(bool_field(opts, "include_usage"))


def _max_tokens(body: dict, names: tuple[str, ...]) -> int | None:
    for name in names:
        v = _int(body, name)
        if v is not None:
            if v < 1:
                raise bad(f"'{name}' must be at least 1, got {v}", name)
            return v
    return None


def check_length(prompt_len: int, max_tokens: int | None, model: ModelInfo, prompt_param: str) -> int:
    """Reject prompts that cannot fit; return the effective max_tokens (the rest of the context if None)."""
    limit = model.max_model_len
    what = "messages" if prompt_param == "messages" else "prompt"
    if prompt_len >= limit:
        raise bad(f"This model's maximum context length is {limit} tokens, but the {what} has {prompt_len} tokens "
                  f"and at least one token must be left for the completion. Please shorten the {what}.", prompt_param)
    if max_tokens is None:
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise bad(f"This model's maximum context length is {limit} tokens. However, you requested "
                  f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in the completion). "
                  f"Please reduce the length of the {what} or completion.", "max_tokens")
    return max_tokens


def _capped(max_tokens: int, model: ModelInfo) -> int:
    """The generation config's max_new_tokens caps every request, as vLLM applies it."""
    cap = model.sampling_defaults.get("max_tokens")
    return max_tokens if cap is None else min(max_tokens, int(cap))


def _sampling_params(body: dict, model: ModelInfo, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None, tools: ToolRequest | None = None) -> SamplingParams:
    """Everything both APIs share; range checks are SamplingParams' own, reported with their param."""
    top_k = _int(body, "top_k")
    kwargs = dict(
        n=_int(body, "n"), temperature=_float(body, "temperature"), top_p=_float(body, "top_p"),
        # 0 also means "off" in vLLM's and HF's APIs; beyond the vocabulary it is off too (and stays msgpack-able)
        top_k=-1 if top_k == 0 or (top_k is not None and top_k >= model.vocab_size) else top_k,
        min_p=_float(body, "min_p"), seed=_int(body, "seed"),
        presence_penalty=_float(body, "presence_penalty"), frequency_penalty=_float(body, "frequency_penalty"),
        repetition_penalty=_float(body, "repetition_penalty"),
        stop_token_ids=token_ids(body["stop_token_ids"], model, "stop_token_ids")
        if body.get("stop_token_ids") is not None else None,
        include_stop_str_in_output=bool_field(body, "include_stop_str_in_output"),
        skip_special_tokens=bool_field(body, "skip_special_tokens"), ignore_eos=bool_field(body, "ignore_eos"),
        min_tokens=_int(body, "min_tokens"), use_beam_search=bool_field(body, "use_beam_search"),
        length_penalty=_float(body, "length_penalty"), early_stopping=_early_stopping(body),
    )
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    for k, v in model.sampling_defaults.items():       # where the request is silent, as vLLM applies them
        # (beam search ranks by the model's own distribution: no sampling default applies to it)
        if k != "max_tokens" and k not in kwargs and not kwargs.get("use_beam_search"):
            kwargs[k] = -1 if k == "top_k" and (v == 0 or v >= model.vocab_size) else v
    try:
        structured = structured_output.from_request(body)
        forced = tools.constraint() if tools else None
        if forced is not None:
            if structured is not None:
                raise ParamError("a required or named tool_choice cannot be combined with another structured "
                                 "output constraint", "tool_choice")
            structured = forced
        if structured is not None:
            structured_output.check(structured)
        return SamplingParams(max_tokens=max_tokens, stop=_stop(body), logit_bias=_logit_bias(body, model),
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured_outputs=structured,
                              **kwargs)
    except ParamError as e:
        raise bad(str(e), e.param) from None


def _early_stopping(body: dict) -> bool | str | None:
    v = body.get("early_stopping")
    if v is None or v == "never" or isinstance(v, bool):
        return v
    raise bad(f"'early_stopping' must be true, false or \"never\", got {v!r}", "early_stopping")


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool(bool_field(body, "stream"))
    return stream, _stream_options(body, stream)


# ---- /v1/completions -------------------------------------------------------------------------------
def parse_completion_request(body: dict, tokenizer: Any, model: ModelInfo) -> ParsedRequest:
    lora_name = check_model(body, model)
    check_fields(body, "completions")
    if body.get("suffix") is not None:
        raise bad("'suffix' is not supported", "suffix")
    stream, include_usage = _stream_flags(body)
    echo = bool(bool_field(body, "echo"))
    logprobs = _int(body, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad(f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", "logprobs")
    max_tokens = _or(_max_tokens(body, ("max_tokens",)), COMPLETIONS_DEFAULT_MAX_TOKENS)
    prompts = [_tokenize_prompt(p, tokenizer, model) for p in _split_prompts(body.get("prompt"))]
    for p in prompts:
        check_length(len(p.token_ids), max_tokens, model, "prompt")
    max_tokens = _capped(max_tokens, model)
    # echo with logprobs reports the prompt's logprobs too, as OpenAI does
    params = _sampling_params(body, model, max_tokens, logprobs, logprobs if echo and logprobs is not None else None)
    return ParsedRequest(False, prompts, params, stream, include_usage, echo, logprobs, _str(body, "user"), lora_name,
                         _str(body, "model"))


def _split_prompts(v: Any) -> list[str | list[int]]:
    """The four prompt forms: a string, strings, token ids, lists of token ids."""
    if isinstance(v, str):
        prompts: list = [v]
    elif isinstance(v, list) and v and all(isinstance(p, int) and not isinstance(p, bool) for p in v):
        prompts = [v]
    elif isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        prompts = v
    elif v is None:
        raise bad("'prompt' is required", "prompt")
    elif isinstance(v, list) and not v:
        raise bad("'prompt' must not be empty", "prompt")
    else:
        raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of lists of "
                  "token ids", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"at most {MAX_PROMPTS} prompts are allowed per request, got {len(prompts)}", "prompt")
    return prompts


def encode(tokenizer: Any, text: str, param: str, **kwargs: Any) -> list[int]:
    """Tokenize client text; what the tokenizer cannot take (e.g. lone UTF-16 surrogates) is a 400."""
    try:
        return tokenizer.encode(text, **kwargs)
    except Exception as e:
        raise bad(f"the {param} could not be tokenized: {e}", param) from None


def _tokenize_prompt(p: str | list[int], tokenizer: Any, model: ModelInfo) -> PromptInput:
    if isinstance(p, str):
        ids = encode(tokenizer, p, "prompt") if p else []
        text = p
    else:
        ids, text = token_ids(p, model, "prompt"), None
    if not ids:
        raise bad("the prompt must not be empty", "prompt")
    return PromptInput(list(ids), text)


# ---- /v1/chat/completions --------------------------------------------------------------------------
def parse_chat_request(body: dict, tokenizer: Any, model: ModelInfo) -> ParsedRequest:
    lora_name = check_model(body, model)
    check_fields(body, "chat")
    stream, include_usage = _stream_flags(body)
    want_logprobs = bool(bool_field(body, "logprobs"))
    top = _int(body, "top_logprobs")
    if top is not None:
        if not want_logprobs:
            raise bad("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    logprobs = _or(top, 0) if want_logprobs else None
    requested = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    tools = parse_tools(body, model.auto_tool_choice, model.tool_call_parser)
    text = render_chat(parse_messages(body.get("messages")), tokenizer, tools=tools.tools if tools else None)
    ids = encode(tokenizer, text, "messages", add_special_tokens=False)
    if not ids:
        raise bad("the rendered chat prompt is empty", "messages")
    max_tokens = _capped(check_length(len(ids), requested, model, "messages"), model)
    params = _sampling_params(body, model, max_tokens, logprobs, None, tools)
    return ParsedRequest(True, [PromptInput(ids, text)], params, stream, include_usage, False, logprobs,
                         _str(body, "user"), lora_name, _str(body, "model"), tools)
