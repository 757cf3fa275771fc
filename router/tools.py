"""A chat request's tools: what `tools` / `tool_choice` ask, the constraint that enforces a required or
named call, and the calls read back from a finished choice in OpenAI's shape.

- `"none"` (or no tools): plain chat; the tools are not rendered.
- `"auto"`: the tools reach the chat template and `--tool-call-parser` reads whatever calls the model
  wrote (needs `--enable-auto-tool-choice`, as in vLLM).
- `"required"`: the output is constrained to a JSON array of `{"name", "parameters"}` objects, one schema
  per tool, so it always parses into at least one call with valid arguments (vLLM's way); with
  `"parallel_tool_calls": false`, into exactly one.
- a named function: the output is constrained to that function's parameters schema; it is the arguments.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from common.structured_output import StructuredOutputsParams
from router.api_error import bad
from router.tool_parsers import PARSERS, Extracted, ToolCall

ANY_OBJECT = {"type": "object"}


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]]       # the `function` objects
    mode: str                         # auto | required | named
    name: str | None = None           # the named function
    parallel: bool = True             # OpenAI's parallel_tool_calls: False allows one call only

    def parameters(self, name: str) -> dict[str, Any]:
        f = next(f for f in self.tools if f["name"] == name)
        return f.get("parameters") or ANY_OBJECT

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=self.parameters(self.name))
        if self.mode == "required":
            one = {"maxItems": 1} if not self.parallel else {}
            return StructuredOutputsParams(json={"type": "array", "minItems": 1, **one, "items": {"anyOf": [
                {"type": "object", "required": ["name", "parameters"], "properties": {
                    "name": {"const": f["name"]}, "parameters": f.get("parameters") or ANY_OBJECT}}
                for f in self.tools]}})
        return None

    def extract(self, text: str, parser: str | None) -> Extracted:
        if self.mode == "named":
            return Extracted(None, [ToolCall(self.name, text)])
        if self.mode == "required":
            try:
                calls = [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):     # cut short by max_tokens: no call to report
                return Extracted(text, [])
            return Extracted(None, calls)
        return PARSERS[parser]().extract(text)


def parse_tools(body: dict[str, Any], auto_enabled: bool, parser: str | None) -> ToolRequest | None:
    """The request's ToolRequest, None for plain chat; malformed or unsupported asks are 400s."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
        raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                  "\"parameters\": {...}}}", "tools")
    functions = [t["function"] for t in tools]
    names = [f["name"] for f in functions]
    if choice is None:
        choice = "auto" if auto_enabled else "none"     # vLLM: auto only where the server enables it
    if choice == "none":
        return None
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise bad('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                      "tool_choice")
        return ToolRequest(functions, "auto")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice == "required":
        return ToolRequest(functions, "required", parallel=parallel is not False)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})", "tool_choice")
        return ToolRequest(functions, "named", name)
    raise bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
              "\"function\": {\"name\": ...}}", "tool_choice")


def _is_tool(t: Any) -> bool:
    f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    return isinstance(f, dict) and isinstance(f.get("name"), str) and bool(f["name"]) and \
        isinstance(f.get("parameters", {}), dict)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls`: each with its own id."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def stream_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The deltas that stream `calls` as OpenAI does: per call, its id, type and name with empty
    arguments, then the arguments."""
    out = []
    for i, c in enumerate(calls):
        out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                    "function": {"name": c["function"]["name"], "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
    return out
