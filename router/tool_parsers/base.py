"""The interface a tool-call parser implements (`--tool-call-parser NAME`, one file per format): it finds
the calls a model wrote in its own format in the finished text of a choice."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str          # a JSON object's text, as OpenAI sends `function.arguments`


@dataclass
class Extracted:
    content: str | None     # the text outside the calls (None: there is none)
    calls: list[ToolCall]


class ToolParser:
    name = ""

    def extract(self, text: str) -> Extracted:
        raise NotImplementedError


def call_from(obj: Any, args_key: str) -> ToolCall | None:
    """A {"name": ..., args_key: {...}} object as a ToolCall; None if it is not shaped so."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None
