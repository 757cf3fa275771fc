"""OpenAI's wire shapes: JSON and error bodies, the two logprob formats, the completion and chat response
shapes, and server-sent-event framing.

Everything here is a pure function of a `Generation`'s state (router/generation.py), so rendering can change
(or a third API shape be added) without touching the engine loop or the HTTP plumbing (router/app.py).
Both APIs expose the same four members (`parse`, `preamble`, `stream_choice`, `full_choice`) so the handlers
treat them alike.
"""
from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from common.detokenizer import token_texts
from common.output_processor import Choice, ChoiceDelta
from common.protocol import Logprob
from router.generation import Generation, SubRequest
from router.openai_protocol import APIError, parse_chat_request, parse_completion_request
from router.tools import new_call_id, openai_calls, stream_deltas

MIN_LOGPROB = -9999.0           # -inf is not JSON; vLLM clamps the same way
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_EVENT = b"data: [DONE]\n\n"


# ---- JSON bodies and errors ------------------------------------------------------------------------
def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json", headers=headers)


def error_response(e: APIError) -> web.Response:
    return json_response(e.body(), e.status, e.headers)


def error_event(e: APIError) -> bytes:
    """An error inside a stream whose status line has already gone out."""
    return b"data: " + orjson.dumps(e.body()) + b"\n\n"


# ---- logprobs in OpenAI's two formats --------------------------------------------------------------
def _lp(v: float | None) -> float | None:
    return None if v is None else max(float(v), MIN_LOGPROB)


def _texts(tokenizer: Any, ids: list[int], lps: list[Logprob | None], top_n: int) -> tuple[list[str], list[list[str]]]:
    """Token texts of the chosen ids and of each position's top ids, in one batch_decode."""
    tops = [list(lp[2][:top_n]) if lp is not None else [] for lp in lps]
    flat = token_texts(tokenizer, ids + [t for ts in tops for t in ts]) if ids else []
    chosen, rest, k = flat[:len(ids)], flat[len(ids):], 0
    top_texts = []
    for ts in tops:
        top_texts.append(rest[k:k + len(ts)])
        k += len(ts)
    return chosen, top_texts


def _pad(lps: list[Logprob | None] | None, n: int) -> list[Logprob | None]:
    lps = list(lps or [])[:n]
    return lps + [None] * (n - len(lps))


def completion_logprobs(tokenizer: Any, ids: list[int], lps: list[Logprob | None] | None, top_n: int,
                        offset: int) -> tuple[dict[str, Any], int]:
    """{tokens, token_logprobs, top_logprobs, text_offset}; returns it and the offset after the last token."""
    lps = _pad(lps, len(ids))
    chosen, top_texts = _texts(tokenizer, ids, lps, top_n)
    token_lps, top_lps, offsets = [], [], []
    for text, lp, tops in zip(chosen, lps, top_texts):
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            token_lps.append(None)
            top_lps.append(None)
            continue
        token_lps.append(_lp(lp[0]))
        d = {t: _lp(v) for t, v in zip(tops, lp[3])}
        d.setdefault(text, _lp(lp[0]))      # the sampled token is always reported, as in vLLM
        top_lps.append(d)
    return {"tokens": chosen, "token_logprobs": token_lps, "top_logprobs": top_lps, "text_offset": offsets}, offset


def chat_logprobs(tokenizer: Any, ids: list[int], lps: list[Logprob | None] | None, top_n: int) -> dict[str, Any]:
    lps = _pad(lps, len(ids))
    chosen, top_texts = _texts(tokenizer, ids, lps, top_n)

    def entry(text: str, lp: float | None) -> dict[str, Any]:
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode())}

    content = []
    for text, lp, tops in zip(chosen, lps, top_texts):
        e = entry(text, lp[0] if lp is not None else None)
        e["top_logprobs"] = [entry(t, v) for t, v in zip(tops, lp[3])] if lp is not None else []
        content.append(e)
    return {"content": content}


# ---- the two APIs' shapes --------------------------------------------------------------------------
class CompletionAPI:
    id_prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"
    parse = staticmethod(parse_completion_request)

    def preamble(self, g: Generation) -> list[dict[str, Any]]:
        return []

    def stream_choice(self, g: Generation, s: SubRequest, d: ChoiceDelta) -> dict[str, Any] | None:
        index = s.first_index + d.index
        cs = g.streams[index]
        text, ids, lps = d.text, d.token_ids, d.logprobs
        if not cs.started:
            cs.started = True
            if g.parsed.echo:
                text = self._echo_text(g, s) + text
                ids, lps = self._with_prompt(g, s, ids, lps)
        logprobs = None
        if g.parsed.logprobs is not None:
            logprobs, cs.text_offset = completion_logprobs(g.st.tokenizer, ids, lps, g.parsed.logprobs,
                                                           cs.text_offset)
        if not text and d.finish_reason is None and not (logprobs and ids):
            return None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}

    def full_choice(self, g: Generation, s: SubRequest, c: Choice) -> dict[str, Any]:
        text, ids, lps = c.text, c.token_ids, c.logprobs
        if g.parsed.echo:
            text = self._echo_text(g, s) + text
            ids, lps = self._with_prompt(g, s, ids, lps)
        logprobs = None
        if g.parsed.logprobs is not None:
            logprobs = completion_logprobs(g.st.tokenizer, ids, lps, g.parsed.logprobs, 0)[0]
        return {"index": s.first_index + c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    @staticmethod
    def _echo_text(g: Generation, s: SubRequest) -> str:
        if s.prompt.text is not None:
            return s.prompt.text
        return g.st.tokenizer.decode(s.prompt.token_ids)

    @staticmethod
    def _with_prompt(g: Generation, s: SubRequest, ids: list[int], lps: list[Logprob] | None
                     ) -> tuple[list[int], list[Logprob | None]]:
        """Prompt tokens (with their logprobs, the first one None) ahead of the generated ones."""
        p = s.prompt.token_ids
        plps = list(s.tracker.prompt_logprobs[:len(p)])
        plps = [None] * (len(p) - len(plps)) + plps        # an engine may omit the first position's None
        return p + list(ids), plps + _pad(lps, len(ids))


class ChatAPI:
    id_prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"
    parse = staticmethod(parse_chat_request)

    def __init__(self, response_role: str = "assistant") -> None:
        self.role = response_role           # --response-role

    def preamble(self, g: Generation) -> list[dict[str, Any]]:
        """The role goes first, in a delta of its own per choice, as OpenAI streams it."""
        return [{"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(g.streams))]

    def stream_choice(self, g: Generation, s: SubRequest, d: ChoiceDelta) -> dict[str, Any] | list | None:
        if g.parsed.tools is not None:
            return self._stream_tools(g, s, d)
        logprobs = self._logprobs(g, d.token_ids, d.logprobs)
        if not d.text and not (logprobs and logprobs["content"]) and d.finish_reason is None:
            return None
        return {"index": s.first_index + d.index, "delta": {"content": d.text} if d.text else {},
                "logprobs": logprobs, "finish_reason": d.finish_reason}

    def full_choice(self, g: Generation, s: SubRequest, c: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": c.text}
        finish = c.finish_reason
        if g.parsed.tools is not None:
            message, finish = self._tool_message(g, c.text, finish)
        return {"index": s.first_index + c.index, "message": message,
                "logprobs": self._logprobs(g, c.token_ids, c.logprobs), "finish_reason": finish}

    def _tool_message(self, g: Generation, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The message of a finished choice that may call tools, and its finish_reason."""
        found = g.parsed.tools.extract(text, g.st.tool_call_parser)
        message: dict[str, Any] = {"role": self.role, "content": found.content}
        if found.calls:
            message["tool_calls"] = openai_calls(found.calls)
            finish = "tool_calls" if finish == "stop" else finish
        return message, finish

    def _stream_tools(self, g: Generation, s: SubRequest, d: ChoiceDelta) -> list[dict[str, Any]] | None:
        """A named tool_choice streams its one call as the text comes (the text is its arguments). Otherwise
        a choice's text is held back until it ends (a call can only be read whole): then its content, and
        each call as OpenAI streams it (id, type and name, then the arguments), go out."""
        if g.parsed.tools.mode == "named":
            return self._stream_named(g, s, d)
        if d.finish_reason is None:
            return None
        choice = next(c for c in s.tracker.choices if c.index == d.index)
        message, finish = self._tool_message(g, choice.text, d.finish_reason)
        index = s.first_index + d.index
        deltas = ([{"content": message["content"]}] if message["content"] else []) + \
            stream_deltas(message.get("tool_calls", []))
        out = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas]
        return out + [{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}]

    @staticmethod
    def _stream_named(g: Generation, s: SubRequest, d: ChoiceDelta) -> list[dict[str, Any]]:
        index = s.first_index + d.index
        cs = g.streams[index]
        deltas = []
        if cs.tool_call_id is None:
            cs.tool_call_id = new_call_id()
            deltas.append({"tool_calls": [{"index": 0, "id": cs.tool_call_id, "type": "function",
                                           "function": {"name": g.parsed.tools.name, "arguments": ""}}]})
        if d.text:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": d.text}}]})
        out = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas]
        if d.finish_reason is not None:
            finish = "tool_calls" if d.finish_reason == "stop" else d.finish_reason
            out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish})
        return out

    @staticmethod
    def _logprobs(g: Generation, ids: list[int], lps: list[Logprob] | None) -> dict[str, Any] | None:
        if g.parsed.logprobs is None:
            return None
        return chat_logprobs(g.st.tokenizer, ids, lps, g.parsed.logprobs)


API = CompletionAPI | ChatAPI


class SSEEncoder:
    """Chunk events with the constant part (id, object, created, model) encoded once per request."""

    def __init__(self, g: Generation, api: API) -> None:
        head = orjson.dumps({"id": g.id, "object": api.chunk_object, "created": g.created, "model": g.model_name})
        self.head = b"data: " + head[:-1] + b',"choices":['
        self.tail = b'],"usage":null}\n\n' if g.parsed.include_usage else b"]}\n\n"

    def chunks(self, choices: list[dict[str, Any]]) -> bytes:
        return b"".join(self.head + orjson.dumps(c) + self.tail for c in choices)

    def usage(self, usage: dict[str, Any]) -> bytes:
        return self.head + b'],"usage":' + orjson.dumps(usage) + b"}\n\n"
