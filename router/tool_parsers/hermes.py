"""Hermes / Qwen / SmolLM style: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
from __future__ import annotations

import json
import re

from router.tool_parsers.base import Extracted, ToolParser, call_from

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesParser(ToolParser):
    name = "hermes"

    def extract(self, text: str) -> Extracted:
        calls = []
        for m in _CALL.finditer(text):
            try:
                call = call_from(json.loads(m.group(1)), "arguments")
            except ValueError:
                call = None
            if call is None:            # not a call after all: the text stays content
                return Extracted(text, [])
            calls.append(call)
        if not calls:
            return Extracted(text, [])
        content = _CALL.sub("", text).strip()
        return Extracted(content or None, calls)
