"""The router's aiohttp application: per-app state, the route handlers, the error and auth middlewares,
warm-up and graceful drain.

This is the HTTP layer alone: each generation request becomes a `Generation` (router/generation.py) rendered
by one of the two API shapes (router/openai_render.py); the process around it (sockets, signals, loading the
tokenizer) is router/serve.py. `build_app` takes plain values, so tests build an app around a fake engine
client without a process, a model or a config object.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from router.api_error import RETRY_AFTER_S
from router.config import RouterConfig
from router.cors import CORSConfig, add_response_headers, cors_middleware
from router.engine_client import EngineClient
from router.generation import EngineFailure, Generation
from router.lora_endpoints import adapter_cards, add_lora_routes
from router.metrics import RouterMetrics
from router.openai_protocol import APIError, ModelInfo, ParsedRequest, decode_json_body, render_chat
from router.openai_render import (API, DONE_EVENT, SSE_HEADERS, ChatAPI, CompletionAPI, SSEEncoder, error_event,
                                  error_response, json_response)
from router.openapi import add_docs_routes, openapi_document
from router.tokenize_endpoints import add_tokenize_routes

log = logging.getLogger("pagedserve.router")

# Bodies above this are parsed and tokenized in a worker thread; below it the thread hop costs more than
# it saves. (The Rust tokenizer releases the GIL, so the event loop keeps streaming meanwhile.)
OFFLOAD_BYTES = 4096
ABORT_GRACE_S = 5.0             # after the drain timeout's aborts, how long finishing requests get


# ---- per-app state ---------------------------------------------------------------------------------
@dataclass
class ServerState:
    """What every handler of one app shares: the engine connection, the tokenizer, readiness, and the
    in-flight requests that drain waits for. One per app (not module globals), so tests run many apps."""
    client: EngineClient
    tokenizer: Any
    model_name: str
    model_root: str
    vocab_size: int
    metrics: RouterMetrics
    max_model_len: int | None = None     # used only until the scheduler's Stats tell the real one
    aliases: tuple[str, ...] = ()        # the other --served-model-name names
    sampling_defaults: dict[str, Any] = field(default_factory=dict)   # generation_config.json's
    auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "tokenize"))
    draining: bool = False
    warm: bool = False
    inflight: dict[str, int] = field(default_factory=dict)      # engine request id -> n
    background: set[asyncio.Task] = field(default_factory=set)

    def model_info(self) -> ModelInfo:
        lora = bool(self.client.stats and self.client.stats.values.get("max_lora"))
        return ModelInfo(self.model_name, self.vocab_size, self.client.max_model_len or self.max_model_len or 0, lora,
                         self.aliases, self.sampling_defaults, self.auto_tool_choice, self.tool_call_parser)

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


# ---- generation handlers ---------------------------------------------------------------------------
def generation_handler(api: API) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        st = request.app[STATE]
        if (reason := st.not_ready_reason()) is not None:
            raise APIError(503, reason, code="not_ready")
        parsed = await _parse(request, st, api)
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


async def _parse(request: web.Request, st: ServerState, api: API) -> ParsedRequest:
    """Decode, validate and tokenize the body; a large one off the event loop."""
    raw = await request.read()
    body = decode_json_body(raw, request.content_type)
    info = st.model_info()
    if len(raw) > OFFLOAD_BYTES:
        return await asyncio.get_running_loop().run_in_executor(st.executor, api.parse, body, st.tokenizer, info)
    return api.parse(body, st.tokenizer, info)


async def full_response(g: Generation, api: API) -> web.Response:
    try:
        async for _ in g.deltas():
            pass
    except EngineFailure as e:
        raise APIError(503, str(e), code="engine_failure") from None
    return json_response({"id": g.id, "object": api.object, "created": g.created, "model": g.model_name,
                          "choices": [api.full_choice(g, s, c) for s, c in g.choices()], "usage": g.usage()})


async def stream_response(request: web.Request, g: Generation, api: API) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    enc = SSEEncoder(g, api)
    if preamble := api.preamble(g):
        await resp.write(enc.chunks(preamble))
    try:
        async for batch in g.deltas():
            chunks = [c for s, d in batch for c in _listed(api.stream_choice(g, s, d))]
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
    cards = [{"id": name, "object": "model", "created": st.created, "owned_by": "pagedserve", "root": st.model_root,
              "parent": None, "max_model_len": st.model_info().max_model_len or None}
             for name in (st.model_name, *st.aliases)]
    return json_response({"object": "list", "data": cards + adapter_cards(st.client, st.model_name, st.created)})


async def health(request: web.Request) -> web.Response:
    """Liveness, as vLLM's /health and SageMaker's /ping: 200 while starting, warming up or draining, 503
    (with Retry-After) once the engine is dead or its scheduler has stopped answering, so a supervisor or
    a load balancer sees the death and the restart. /ready covers warm-up too."""
    dead = request.app[STATE].client.dead_reason
    if dead is not None:
        raise APIError(503, f"the engine is unavailable: {dead}", code="engine_dead")
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    reason = request.app[STATE].not_ready_reason()
    if reason is None:
        return json_response({"status": "ready"})
    return json_response({"status": "unavailable", "reason": reason}, 503, {"Retry-After": str(RETRY_AFTER_S)})


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


def auth_middleware(api_keys: list[str]) -> Callable:
    """vLLM's rule: any of the keys, on the /v1 routes (health, metrics and tokenize stay open)."""
    expected = [f"Bearer {key}".encode() for key in api_keys]

    @web.middleware
    async def check(request: web.Request, handler: Callable) -> web.StreamResponse:
        if request.path.startswith("/v1/") and request.method != "OPTIONS":
            got = request.headers.get("Authorization", "").encode()
            # every key compared, so the time taken does not tell which prefix matched
            if not any([hmac.compare_digest(got, e) for e in expected]):
                raise APIError(401, "Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return check


def _listed(chunk: dict | list | None) -> list:
    """stream_choice gives one chunk, none, or several (a choice's tool calls)."""
    return [] if chunk is None else chunk if isinstance(chunk, list) else [chunk]


# ---- app -------------------------------------------------------------------------------------------
def build_app(client: EngineClient, tokenizer: Any, model_name: str, *, api_key: str | list[str] | None = None,
              max_body_bytes: int = RouterConfig.max_body_bytes, vocab_size: int, model_root: str | None = None,
              max_model_len: int | None = None, allow_lora_updates: bool = False, aliases: tuple[str, ...] = (),
              sampling_defaults: dict[str, Any] | None = None, response_role: str = "assistant",
              cors: CORSConfig | None = CORSConfig(), docs: bool = True, auto_tool_choice: bool = False,
              tool_call_parser: str | None = None) -> web.Application:
    """The router's aiohttp app. The caller owns `client` (starts and closes it); `max_model_len` is only a
    fallback for before the scheduler's first Stats, which carry the real value. `api_key`: one key or
    several; `cors`: None for no CORS headers at all."""
    keys = [api_key] if isinstance(api_key, str) else [k for k in api_key or [] if k]
    middlewares = [errors_middleware] + ([cors_middleware(cors)] if cors else []) + \
        ([auth_middleware(keys)] if keys else [])
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    if cors:
        app.on_response_prepare.append(add_response_headers(cors))
    app[STATE] = ServerState(client=client, tokenizer=tokenizer, model_name=model_name,
                             model_root=model_root or model_name, vocab_size=vocab_size,
                             metrics=RouterMetrics(client, model_name, max_model_len or 1 << 17),
                             max_model_len=max_model_len,
                             aliases=tuple(aliases), sampling_defaults=dict(sampling_defaults or {}),
                             auto_tool_choice=auto_tool_choice, tool_call_parser=tool_call_parser)
    app.router.add_post("/v1/completions", generation_handler(CompletionAPI()))
    app.router.add_post("/v1/chat/completions", generation_handler(ChatAPI(response_role)))
    app.router.add_get("/v1/models", models)
    add_lora_routes(app, lambda request: request.app[STATE].client, allow_lora_updates)
    add_tokenize_routes(app, lambda request: request.app[STATE])
    if docs:
        add_docs_routes(app, openapi_document(package_version(), allow_lora_updates, bool(keys)))
    app.router.add_route("*", "/ping", health)
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
    if await _until_idle(st, timeout):
        return
    log.warning("aborting %d requests still running after %.0fs", len(st.inflight), timeout)
    for rid, n in list(st.inflight.items()):
        for i in range(n):            # per choice: the queue stays open to carry the "abort" finish
            await st.client.abort(rid, i)
    await _until_idle(st, ABORT_GRACE_S)


async def _until_idle(st: ServerState, timeout: float) -> bool:
    """Wait up to `timeout` seconds for every in-flight request to finish; True if they all did."""
    deadline = time.monotonic() + timeout
    while st.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not st.inflight
