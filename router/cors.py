"""CORS, with vLLM's flags and defaults (--allowed-origins/--allowed-methods/--allowed-headers '["*"]',
--allow-credentials off) and the behaviour of the Starlette middleware vLLM uses, so a browser app that
talks to vLLM talks to us unchanged.

A preflight (OPTIONS with Origin and Access-Control-Request-Method) is answered here, before routing and
auth: browsers send it without credentials. Every other response to a request with an allowed Origin
gets the Access-Control-Allow-* headers through the app's on_response_prepare signal, which streamed
(SSE) and error responses pass through too.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from router.openai_protocol import APIError

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
PREFLIGHT_MAX_AGE = "600"
# Headers a browser may always send (the CORS-safelisted request headers)
_SAFELISTED = {"accept", "accept-language", "content-language", "content-type"}


@dataclass(frozen=True)
class CORSConfig:
    allow_origins: list[str] = field(default_factory=lambda: ["*"])
    allow_methods: list[str] = field(default_factory=lambda: ["*"])
    allow_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allow_origins or origin in self.allow_origins

    def allow_origin_value(self, origin: str) -> str:
        """'*' only when any origin is allowed and no credentials are: browsers refuse '*' with credentials."""
        return "*" if "*" in self.allow_origins and not self.allow_credentials else origin


def cors_middleware(cfg: CORSConfig) -> Callable:
    @web.middleware
    async def cors(request: web.Request, handler: Callable) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and origin and "Access-Control-Request-Method" in request.headers:
            return preflight(cfg, request, origin)
        return await handler(request)
    return cors


def preflight(cfg: CORSConfig, request: web.Request, origin: str) -> web.Response:
    method = request.headers["Access-Control-Request-Method"].upper()
    wanted = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
    if not cfg.origin_allowed(origin):
        raise APIError(400, f"CORS origin {origin!r} is not allowed (--allowed-origins)", code="cors_disallowed")
    allowed_methods = ALL_METHODS if "*" in cfg.allow_methods else [m.upper() for m in cfg.allow_methods]
    if method not in allowed_methods:
        raise APIError(400, f"CORS method {method} is not allowed (--allowed-methods)", code="cors_disallowed")
    allowed_headers = {h.lower() for h in cfg.allow_headers}
    if "*" not in allowed_headers and any(h.lower() not in allowed_headers | _SAFELISTED for h in wanted):
        raise APIError(400, f"CORS headers {', '.join(wanted)} are not all allowed (--allowed-headers)",
                       code="cors_disallowed")
    headers = {"Access-Control-Allow-Origin": cfg.allow_origin_value(origin),
               "Access-Control-Allow-Methods": ", ".join(allowed_methods),
               "Access-Control-Max-Age": PREFLIGHT_MAX_AGE}
    if wanted:
        headers["Access-Control-Allow-Headers"] = ", ".join(wanted) if "*" in allowed_headers else \
            ", ".join(sorted(allowed_headers | _SAFELISTED))
    if cfg.allow_credentials:
        headers["Access-Control-Allow-Credentials"] = "true"
    if headers["Access-Control-Allow-Origin"] != "*":
        headers["Vary"] = "Origin"
    return web.Response(status=200, text="OK", headers=headers)


def add_response_headers(cfg: CORSConfig) -> Callable:
    """An on_response_prepare callback: the Allow-Origin headers on every answer to an allowed Origin."""
    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if not origin or not cfg.origin_allowed(origin) or "Access-Control-Allow-Origin" in response.headers:
            return
        response.headers["Access-Control-Allow-Origin"] = cfg.allow_origin_value(origin)
        if cfg.allow_credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"
        if response.headers["Access-Control-Allow-Origin"] != "*":
            response.headers.add("Vary", "Origin")
    return on_prepare
