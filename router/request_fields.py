"""Which request fields a generation route takes, which it refuses, and which it ignores aloud.

The fields a route reads are its request schema's properties (router/openapi.py, the document served
at /openapi.json), so the two cannot drift apart. Fields of the OpenAI and vLLM APIs that we do not
implement are a 400 when they would change the answer (the deprecated function-calling fields, best_of): a
client asking for one must not get an answer as if it had been honoured. Anything else is ignored, named in one warning
line per request (README, "Request fields").
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from router.api_error import bad
from router.openapi import SCHEMAS

log = logging.getLogger("pagedserve.router")

# field -> (is the value one that would change the answer?, why it is refused)
_REFUSED: dict[str, tuple[Callable[[Any, dict], bool], str]] = {
    "functions": (lambda v, body: bool(v), "the deprecated 'functions' are not supported; use 'tools'"),
    "function_call": (lambda v, body: v not in (None, "none"), "the deprecated 'function_call' is not supported; "
                                                              "use 'tool_choice'"),
    "best_of": (lambda v, body: v is not None and v != body.get("n", 1),
                "'best_of' is not supported (as in vLLM's V1 engine); use n"),
}
# read outside the sampling fields, or accepted as a no-op by design
_ALSO_READ = {"model", "suffix", "tools", "tool_choice", "parallel_tool_calls"}
_SCHEMA = {"completions": "CompletionRequest", "chat": "ChatCompletionRequest"}


def check_fields(body: dict, route: str, request_id: str | None = None) -> list[str]:
    """Raise a 400 APIError for a refused field in use; return (and log) the names ignored."""
    for name, (in_use, why) in _REFUSED.items():
        if name in body and in_use(body[name], body):
            raise bad(why, name)
    if route == "completions":
        for name in ("tools", "tool_choice"):
            if body.get(name) not in (None, "none", []):
                raise bad(f"'{name}' is for /v1/chat/completions", name)
    known = set(SCHEMAS[_SCHEMA[route]]["properties"]) | _ALSO_READ
    ignored = sorted(k for k in body if k not in known)
    if ignored:
        log.warning("request %s: ignoring fields that are not supported: %s", request_id or "-", ", ".join(ignored))
    return ignored
