"""vLLM's run-time adapter endpoints, `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter {"lora_name"}`, and the adapters' cards in /v1/models.

The scheduler owns the adapters, so every router replica forwards these and sees the result in the
scheduler's Stats (which it broadcasts before it answers, so /v1/models on this replica already lists
an adapter when its load returns).
"""
from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from common.lora import LoRARequest
from router.config import RUNTIME_LORA_ENV
from router.engine_client import EngineClient, EngineDead, EngineRejected
from router.openai_protocol import APIError, bad, decode_json_body


def adapter_cards(client: EngineClient, base_name: str, created: int) -> list[dict[str, Any]]:
    values = client.stats.values if client.stats else {}
    return [{"id": name, "object": "model", "created": created, "owned_by": "pagedserve", "root": path,
             "parent": parent or base_name, "max_model_len": client.max_model_len}
            for name, path, parent in values.get("lora_adapters", [])]


def add_lora_routes(app: web.Application, client_of: Any, allowed: bool) -> None:
    """`client_of(request)` -> the app's EngineClient. Unless `allowed` (RUNTIME_LORA_ENV is set) both
    endpoints answer 404 saying how to turn them on, as vLLM leaves them out."""
    async def load(request: web.Request) -> web.Response:
        _require(allowed)
        body = await _body(request, {"lora_name", "lora_path"})
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        await _forward(client_of(request).load_lora(_control_id(), LoRARequest(name, 0, path)))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: web.Request) -> web.Response:
        _require(allowed)
        body = await _body(request, {"lora_name", "lora_int_id"})
        name = _field(body, "lora_name")
        await _forward(client_of(request).unload_lora(_control_id(), name))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)


def _require(allowed: bool) -> None:
    if not allowed:
        raise APIError(404, f"loading and unloading LoRA adapters at run time is off; start the server with "
                            f"{RUNTIME_LORA_ENV}=True in its environment (as vLLM) to allow it")


async def _body(request: web.Request, known: set[str]) -> dict[str, Any]:
    body = decode_json_body(await request.read(), request.content_type)
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad(f"unknown field(s) {', '.join(unknown)}; expected {', '.join(sorted(known))}", unknown[0])
    return body


def _field(body: dict[str, Any], name: str) -> str:
    v = body.get(name)
    if not isinstance(v, str) or not v:
        raise bad(f"'{name}' is required and must be a non-empty string", name)
    return v


def _control_id() -> str:
    return f"lora-{uuid.uuid4().hex}"


async def _forward(call: Any) -> None:
    try:
        await call
    except EngineRejected as e:
        raise APIError(e.code, e.message, param=e.param) from None
    except (EngineDead, TimeoutError) as e:
        raise APIError(503, f"the engine is unavailable: {e or 'no answer'}", code="engine_unavailable") from None
