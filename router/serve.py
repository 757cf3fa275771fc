"""The router process: load the tokenizer, connect to the scheduler, serve HTTP until SIGTERM/SIGINT, drain.

Kept apart from router/app.py so the app stays buildable in-process (tests, embedding) without sockets,
signal handlers or a model on disk.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from aiohttp import web

from router.app import ABORT_GRACE_S, DEFAULT_MAX_BODY_BYTES, STATE, build_app, drain
from router.engine_client import EngineClient

log = logging.getLogger("pagedserve.router")


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
