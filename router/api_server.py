"""The OpenAI-compatible HTTP front end: aiohttp handlers, streaming, auth, readiness and graceful drain.

One router replica serves /v1/completions and /v1/chat/completions by turning each HTTP request into one
engine request per prompt (n choices each), feeding the engine's token outputs through a RequestTracker
(incremental detokenization and stop strings), and rendering the result in OpenAI's shapes. Both APIs
share one generation loop (`Generation`) and differ only in how a choice is rendered (`CompletionAPI`,
`ChatAPI`), so streaming, aborts, usage and metrics behave identically.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from common.detokenizer import token_texts
from common.output_processor import Choice, ChoiceDelta, RequestTracker
from common.protocol import EngineOutput, Logprob
from router.engine_client import EngineClient, EngineDead, EngineRejected
from router.metrics import RequestTimer, RouterMetrics
from router.openai_protocol import (APIError, ModelInfo, ParsedRequest, PromptInput, decode_json_body,
                                    parse_chat_request, parse_completion_request, render_chat)

log = logging.getLogger("pagedserve.router")

# Bodies above this are parsed and tokenized in a worker thread; below it the thread hop costs more than
# it saves. (The Rust tokenizer releases the GIL, so the event loop keeps streaming meanwhile.)
OFFLOAD_BYTES = 4096
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
MIN_LOGPROB = -9999.0           # -inf is not JSON; vLLM clamps the same way
RETRY_AFTER_S = "1"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_EVENT = b"data: [DONE]\n\n"
ABORT_GRACE_S = 5.0             # after the drain timeout's aborts, how long finishing requests get


# ---- per-app state ---------------------------------------------------------------------------------
@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Any
    model_name: str
    model_root: str
    vocab_size: int
    metrics: RouterMetrics
    max_model_len: int | None = None     # used only until the scheduler's Stats tell the real one
    created: int = field(default_factory=lambda: int(time.time()))
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "tokenize"))
    draining: bool = False
    warm: bool = False
    inflight: dict[str, int] = field(default_factory=dict)      # engine request id -> n
    background: set[asyncio.Task] = field(default_factory=set)

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.model_name, self.vocab_size, self.client.max_model_len or self.max_model_len or 0)

    def not_ready_reason(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if not self.warm:
            return "the router is warming up"
        if (dead := self.client.dead_reason) is not None:
            return f"the engine is unavailable: {dead}"
        if not self.client.ready:
            return "the engine is starting"
        return None

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Fire and forget, keeping a reference; used where the caller is being cancelled."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


STATE = web.AppKey("state", ServerState)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json", headers=headers)


def error_response(e: APIError) -> web.Response:
    return json_response(e.body(), e.status, e.headers)


# ---- one HTTP request's engine work ----------------------------------------------------------------
class EngineFailure(Exception):
    """The engine failed the request after it was accepted (e.g. the scheduler died)."""


@dataclass
class SubRequest:
    """One prompt of the HTTP request: one engine request with n choices, numbered from `first_index`."""
    request_id: str
    prompt: PromptInput
    tracker: RequestTracker
    timer: RequestTimer
    first_index: int
    queue: asyncio.Queue[EngineOutput] | None = None


@dataclass
class ChoiceStream:
    """Streaming bookkeeping of one choice."""
    started: bool = False       # completions: the echoed prompt has gone out
    text_offset: int = 0        # completions logprobs: where the next token starts in the choice's text


class Generation:
    """Runs one HTTP request on the engine and yields its choices' deltas as they arrive."""

    def __init__(self, st: ServerState, parsed: ParsedRequest, id_prefix: str):
        self.st, self.parsed = st, parsed
        self.id = f"{id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        n = parsed.params.n
        multi = len(parsed.prompts) > 1
        rids = [f"{self.id}-{i}" for i in range(len(parsed.prompts))] if multi else [self.id]
        self.subs = [SubRequest(rid, p, RequestTracker(rid, p.token_ids, parsed.params, st.tokenizer),
                                st.metrics.timer(), i * n)
                     for i, (rid, p) in enumerate(zip(rids, parsed.prompts))]
        self.by_id = {s.request_id: s for s in self.subs}
        self.streams = [ChoiceStream() for _ in range(len(self.subs) * n)]
        self._pumps: list[asyncio.Task] = []

    @property
    def finished(self) -> bool:
        return all(s.tracker.finished for s in self.subs)

    async def start(self) -> None:
        """Submit every prompt; map engine rejections to HTTP errors (before any response byte is sent)."""
        client, params = self.st.client, self.parsed.params
        try:
            for s in self.subs:
                self.st.inflight[s.request_id] = params.n
                s.queue = await client.add(s.request_id, s.prompt.token_ids, params)
        except BaseException as e:
            self.abort()
            if isinstance(e, EngineRejected):
                if e.code == 429:
                    self.st.metrics.rejected()
                    raise APIError(429, e.message, param=e.param, code="rate_limit_exceeded",
                                   headers={"Retry-After": RETRY_AFTER_S}) from None
                raise APIError(e.code, e.message, param=e.param) from None
            if isinstance(e, (EngineDead, asyncio.TimeoutError)):
                raise APIError(503, f"the engine is unavailable: {e or 'no answer'}",
                               code="engine_unavailable") from None
            raise

    async def deltas(self) -> AsyncIterator[list[tuple[SubRequest, ChoiceDelta]]]:
        """Batches of (sub-request, delta): everything that arrived since the last batch, so a burst of
        outputs costs one socket write."""
        source = self._merged_queue()
        while not self.finished:
            outputs = [await source.get()]
            while not source.empty():
                outputs.append(source.get_nowait())
            now = time.monotonic()
            batch, stopped = [], []
            for eo in outputs:
                item = self._apply(eo, now)
                if item is not None:
                    batch.append(item)
                    if item[1].abort_engine:
                        stopped.append((item[0].request_id, item[1].index))
            for rid, index in stopped:       # a stop string ended the choice; free its blocks
                await self.st.client.abort(rid, index)
            yield batch

    def _merged_queue(self) -> asyncio.Queue[EngineOutput]:
        if len(self.subs) == 1:
            return self.subs[0].queue
        merged: asyncio.Queue[EngineOutput] = asyncio.Queue()

        async def pump(q: asyncio.Queue[EngineOutput]) -> None:
            while True:
                merged.put_nowait(await q.get())

        self._pumps = [asyncio.create_task(pump(s.queue)) for s in self.subs]
        return merged

    def _apply(self, eo: EngineOutput, now: float) -> tuple[SubRequest, ChoiceDelta] | None:
        s = self.by_id.get(eo.request_id)
        if s is None or s.tracker.finished:
            return None
        if eo.index < 0 or eo.finish_reason == "error":
            raise EngineFailure(eo.error or "the engine failed while generating")
        s.timer.on_output(eo, now)
        delta = s.tracker.process(eo)
        if delta is None:
            return None
        if delta.finish_reason is not None:
            s.timer.on_choice_finished(delta.finish_reason)
            if s.tracker.finished:
                s.timer.on_request_finished(now)
                self._forget(s)
        return s, delta

    def _forget(self, s: SubRequest) -> None:
        self.st.inflight.pop(s.request_id, None)
        self.st.client.release(s.request_id)

    def abort(self) -> None:
        """Free the engine's work for every unfinished prompt (client gone, error). Safe under cancellation."""
        for s in self.subs:
            if s.request_id not in self.st.inflight:
                continue
            if s.queue is not None:       # accepted: its unfinished choices end as aborted
                for c in s.tracker.choices:
                    if c.finish_reason is None:
                        s.timer.on_choice_finished("abort")
            self._forget(s)
            self.st.spawn(self.st.client.abort(s.request_id))

    def close(self) -> None:
        for t in self._pumps:
            t.cancel()

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(s.prompt.token_ids) for s in self.subs)
        completion = sum(s.tracker.num_generated_tokens for s in self.subs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(s.tracker.num_cached_tokens for s in self.subs)}}

    def choices(self) -> list[tuple[SubRequest, Choice]]:
        return [(s, c) for s in self.subs for c in s.tracker.choices]


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

    def preamble(self, g: Generation) -> list[dict[str, Any]]:
        """The role goes first, in a delta of its own per choice, as OpenAI streams it."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(g.streams))]

    def stream_choice(self, g: Generation, s: SubRequest, d: ChoiceDelta) -> dict[str, Any] | None:
        logprobs = self._logprobs(g, d.token_ids, d.logprobs)
        if not d.text and not (logprobs and logprobs["content"]) and d.finish_reason is None:
            return None
        return {"index": s.first_index + d.index, "delta": {"content": d.text} if d.text else {},
                "logprobs": logprobs, "finish_reason": d.finish_reason}

    def full_choice(self, g: Generation, s: SubRequest, c: Choice) -> dict[str, Any]:
        return {"index": s.first_index + c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(g, c.token_ids, c.logprobs), "finish_reason": c.finish_reason}

    @staticmethod
    def _logprobs(g: Generation, ids: list[int], lps: list[Logprob] | None) -> dict[str, Any] | None:
        if g.parsed.logprobs is None:
            return None
        return chat_logprobs(g.st.tokenizer, ids, lps, g.parsed.logprobs)


API = CompletionAPI | ChatAPI


class SSEEncoder:
    """Chunk events with the constant part (id, object, created, model) encoded once per request."""

    def __init__(self, g: Generation, api: API):
        head = orjson.dumps({"id": g.id, "object": api.chunk_object, "created": g.created, "model": g.st.model_name})
        self.head = b"data: " + head[:-1] + b',"choices":['
        self.tail = b'],"usage":null}\n\n' if g.parsed.include_usage else b"]}\n\n"

    def chunks(self, choices: list[dict[str, Any]]) -> bytes:
        return b"".join(self.head + orjson.dumps(c) + self.tail for c in choices)

    def usage(self, usage: dict[str, Any]) -> bytes:
        return self.head + b'],"usage":' + orjson.dumps(usage) + b"}\n\n"


def error_event(e: APIError) -> bytes:
    return b"data: " + orjson.dumps(e.body()) + b"\n\n"


# ---- generation handlers ---------------------------------------------------------------------------
def generation_handler(api: API) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        st = request.app[STATE]
        if (reason := st.not_ready_reason()) is not None:
            raise APIError(503, reason, code="not_ready")
        raw = await request.read()
        body = decode_json_body(raw, request.content_type)
        info = st.model_info()
        if len(raw) > OFFLOAD_BYTES:
            parsed = await asyncio.get_running_loop().run_in_executor(st.executor, api.parse, body, st.tokenizer, info)
        else:
            parsed = api.parse(body, st.tokenizer, info)
        g = Generation(st, parsed, api.id_prefix)
        try:
            await g.start()
            if parsed.stream:
                return await stream_response(request, g, api)
            return await full_response(g, api)
        except BaseException:         # above all CancelledError: the client went away (handler cancellation)
            g.abort()                 # and the scheduler must free the blocks
            raise
        finally:
            g.close()
    return handler


async def full_response(g: Generation, api: API) -> web.Response:
    try:
        async for _ in g.deltas():
            pass
    except EngineFailure as e:
        raise APIError(503, str(e), code="engine_failure") from None
    return json_response({"id": g.id, "object": api.object, "created": g.created, "model": g.st.model_name,
                          "choices": [api.full_choice(g, s, c) for s, c in g.choices()], "usage": g.usage()})


async def stream_response(request: web.Request, g: Generation, api: API) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    enc = SSEEncoder(g, api)
    if preamble := api.preamble(g):
        await resp.write(enc.chunks(preamble))
    try:
        async for batch in g.deltas():
            chunks = [c for s, d in batch if (c := api.stream_choice(g, s, d)) is not None]
            if chunks:
                await resp.write(enc.chunks(chunks))
        if g.parsed.include_usage:
            await resp.write(enc.usage(g.usage()))
    except EngineFailure as e:
        g.abort()
        await resp.write(error_event(APIError(503, str(e), code="engine_failure")))
    except ConnectionResetError:    # the client went away mid-stream; nothing left to tell it
        g.abort()
        return resp
    except Exception as e:          # the status line is gone; report in-band, never leave the stream hanging
        log.exception("error while streaming %s", g.id)
        g.abort()
        await resp.write(error_event(APIError(500, f"internal error: {type(e).__name__}")))
    await resp.write(DONE_EVENT)
    await resp.write_eof()
    return resp


# ---- other endpoints -------------------------------------------------------------------------------
async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    card = {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "pagedserve",
            "root": st.model_root, "max_model_len": st.model_info().max_model_len or None}
    return json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    reason = request.app[STATE].not_ready_reason()
    if reason is None:
        return json_response({"status": "ready"})
    return json_response({"status": "unavailable", "reason": reason}, 503)


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": package_version()})


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version
    try:
        return dist_version("pagedserve")
    except PackageNotFoundError:
        return "unknown"


# ---- middlewares -----------------------------------------------------------------------------------
@web.middleware
async def errors_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Every error leaves as OpenAI's error object; only a bug is a 500."""
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return error_response(APIError(e.status, e.text or e.reason, headers=headers))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}"))


def auth_middleware(api_key: str) -> Callable:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Callable) -> web.StreamResponse:
        if request.path != "/health":
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                raise APIError(401, "Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return check


# ---- app -------------------------------------------------------------------------------------------
def build_app(client: EngineClient, tokenizer: Any, model_name: str, *, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, vocab_size: int, model_root: str | None = None,
              max_model_len: int | None = None) -> web.Application:
    """The router's aiohttp app. The caller owns `client` (starts and closes it); `max_model_len` is only a
    fallback for before the scheduler's first Stats, which carry the real value."""
    middlewares = [errors_middleware] + ([auth_middleware(api_key)] if api_key else [])
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[STATE] = ServerState(client=client, tokenizer=tokenizer, model_name=model_name,
                             model_root=model_root or model_name, vocab_size=vocab_size,
                             metrics=RouterMetrics(client, model_name), max_model_len=max_model_len)
    app.router.add_post("/v1/completions", generation_handler(CompletionAPI()))
    app.router.add_post("/v1/chat/completions", generation_handler(ChatAPI()))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.on_startup.append(_start_warmup)
    app.on_cleanup.append(_cleanup)
    return app


async def _start_warmup(app: web.Application) -> None:
    st = app[STATE]
    st.spawn(_warmup(st))


async def _warmup(st: ServerState) -> None:
    """Pay the tokenizer's and the chat template's first-call costs before declaring the replica ready."""
    def work() -> None:
        st.tokenizer.encode("warm up")
        try:
            render_chat([{"role": "user", "content": "warm up"}], st.tokenizer)
        except APIError:
            pass                      # no chat template: /v1/chat/completions will say so
    try:
        await asyncio.get_running_loop().run_in_executor(st.executor, work)
    except Exception:
        log.exception("router warm-up failed")
    st.warm = True


async def _cleanup(app: web.Application) -> None:
    st = app[STATE]
    for t in list(st.background):
        t.cancel()
    st.executor.shutdown(wait=False, cancel_futures=True)


async def drain(app: web.Application, timeout: float) -> None:
    """Graceful stop: refuse new work (503), let in-flight requests finish for up to `timeout` seconds,
    then abort the rest choice by choice so they end normally with finish_reason "abort"."""
    st = app[STATE]
    st.draining = True
    deadline = time.monotonic() + timeout
    while st.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not st.inflight:
        return
    log.warning("aborting %d requests still running after %.0fs", len(st.inflight), timeout)
    for rid, n in list(st.inflight.items()):
        for i in range(n):            # per choice: the queue stays open to carry the "abort" finish
            await st.client.abort(rid, i)
    deadline = time.monotonic() + ABORT_GRACE_S
    while st.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


# ---- process entry ---------------------------------------------------------------------------------
def run_router(args: argparse.Namespace) -> None:
    """Serve until SIGTERM/SIGINT, then drain. Uses uvloop when installed."""
    try:
        import uvloop
        uvloop.run(_serve(args))
    except ImportError:
        asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> None:
    from common.model_source import ModelSource
    loop = asyncio.get_running_loop()
    source = ModelSource.resolve(args.model)
    tokenizer = await loop.run_in_executor(None, source.load_tokenizer)
    vocab_size = (await loop.run_in_executor(None, source.model_config)).vocab_size
    client = EngineClient(args.engine_address)
    await client.start()
    api_key = getattr(args, "api_key", None) or os.environ.get("PAGEDSERVE_API_KEY") or None
    app = build_app(client, tokenizer, getattr(args, "served_model_name", None) or source.name,
                    api_key=api_key, max_body_bytes=getattr(args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES,
                    vocab_size=vocab_size, model_root=str(source.path))
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True,
                           access_log=log if getattr(args, "access_log", False) else None,
                           shutdown_timeout=ABORT_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_port=True)
    await site.start()
    log.info("router %s serving %s on http://%s:%s", client.client_id, app[STATE].model_name, args.host, args.port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("shutting down: draining in-flight requests")
        await drain(app, float(getattr(args, "shutdown_timeout", 30.0)))
    finally:
        await runner.cleanup()
        await client.close()
