"""The router process: load the tokenizer, connect to the scheduler, serve HTTP until SIGTERM/SIGINT, drain.

Kept apart from router/app.py so the app stays buildable in-process (tests, embedding) without sockets,
signal handlers or a model on disk; everything this module needs to know comes in one RouterConfig.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
from typing import Any

from aiohttp import web

from common.chat_template import load_chat_template
from common.model_source import ModelSource
from common.process import freeze_startup_heap
from common.protocol import HEARTBEAT_S
from router.app import ABORT_GRACE_S, STATE, build_app, drain
from router.config import RouterConfig, runtime_lora_updating_allowed
from router.cors import CORSConfig
from router.engine_client import EngineClient

log = logging.getLogger("pagedserve.router")


def run_router(config: RouterConfig) -> None:
    """Serve until SIGTERM/SIGINT, then drain. Uses uvloop when installed."""
    try:
        import uvloop
    except ImportError:       # only the import: an ImportError raised while serving must not restart it
        asyncio.run(_serve(config))
    else:
        uvloop.run(_serve(config))


async def _serve(config: RouterConfig) -> None:
    source, tokenizer, vocab_size = await _load_model(config)
    if config.chat_template is not None:
        tokenizer.chat_template = load_chat_template(config.chat_template)
    defaults = source.generation_defaults(config.generation_config, json.loads(config.override_generation_config or "{}"))
    if defaults:
        log.info("request defaults from the generation config: %s", defaults)
    names = config.served_model_name or [source.name]
    client = EngineClient(config.frontend_address)
    await client.start()
    # A replica joining a running engine binds the shared port only once it has heard the scheduler: the
    # kernel hands it connections at once, and until the first Stats it would answer them 503 "starting"
    # while its siblings serve. An engine still starting sends nothing for a while: bind anyway.
    await client.wait_for_stats(3 * HEARTBEAT_S)
    cors = CORSConfig(config.allowed_origins, config.allowed_methods, config.allowed_headers, config.allow_credentials)
    app = build_app(client, tokenizer, names[0], aliases=tuple(names[1:]), api_key=config.api_key,
                    max_body_bytes=config.max_body_bytes, vocab_size=vocab_size, model_root=str(source.path),
                    max_model_len=client.max_model_len,     # known once the engine's Stats arrived
                    allow_lora_updates=runtime_lora_updating_allowed(), sampling_defaults=defaults,
                    response_role=config.response_role, cors=cors, docs=not config.disable_fastapi_docs,
                    auto_tool_choice=config.enable_auto_tool_choice, tool_call_parser=config.tool_call_parser)
    runner = await _start_site(app, config)
    freeze_startup_heap()
    log.info("router %s serving %s on http://%s:%s", client.client_id, app[STATE].model_name, config.host,
             config.port)
    stop = _stop_on_signals()
    try:
        await stop.wait()
        log.info("shutting down: draining in-flight requests")
        await drain(app, config.shutdown_timeout)
    finally:
        await runner.cleanup()
        await client.close()


async def _load_model(config: RouterConfig) -> tuple[ModelSource, Any, int]:
    """The model's source, tokenizer and vocabulary size; the weights stay with the workers."""
    loop = asyncio.get_running_loop()
    source = ModelSource.from_config(config)
    tokenizer = await loop.run_in_executor(None, source.load_tokenizer)
    vocab_size = (await loop.run_in_executor(None, source.model_config)).vocab_size
    return source, tokenizer, vocab_size


async def _start_site(app: web.Application, config: RouterConfig) -> web.AppRunner:
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True,
                           access_log=log if config.access_log else None, shutdown_timeout=ABORT_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_port=True)
    await site.start()
    return runner


def _stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
