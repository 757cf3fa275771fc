"""The one error shape every route answers with: OpenAI's `{"error": {message, type, param, code}}`."""
from __future__ import annotations

from typing import Any


RETRY_AFTER_S = 5      # a restarted engine is usually serving again within a few seconds


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}` with `status`."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or default_error_type(status)
        self.headers = headers or {}
        if status == 503:       # the engine is starting, restarting or draining: worth a retry soon
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def default_error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
