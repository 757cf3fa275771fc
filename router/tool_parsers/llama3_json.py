"""Llama 3.1/3.2 JSON style: the reply is (after an optional `<|python_tag|>`) one call
`{"name": ..., "parameters": {...}}`, or several separated by `;`."""
from __future__ import annotations

import json

from router.tool_parsers.base import Extracted, ToolParser, call_from

_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def extract(self, text: str) -> Extracted:
        body = text.strip()
        body = body[len(_TAG):].strip() if body.startswith(_TAG) else body
        if not body.startswith("{"):
            return Extracted(text, [])
        calls, decoder, pos = [], json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return Extracted(text, [])
            call = call_from(obj, "parameters")
            if call is None:
                return Extracted(text, [])
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return Extracted(None, calls)
