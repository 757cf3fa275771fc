"""Tool-call parsers by --tool-call-parser name (vLLM's names)."""
from router.tool_parsers.base import Extracted, ToolCall, ToolParser
from router.tool_parsers.hermes import HermesParser
from router.tool_parsers.llama3_json import Llama3JsonParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}

__all__ = ["PARSERS", "Extracted", "ToolCall", "ToolParser"]
