"""Issue #12, tool calling: the request's tools and tool_choice, the constraints that enforce required and
named calls, and the parsers that read calls from a model's text."""
from __future__ import annotations

import json

import pytest

from router.api_error import APIError
from router.tool_parsers import PARSERS
from router.tools import parse_tools, stream_deltas, openai_calls

pytestmark = pytest.mark.unit
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_hermes_reads_calls_and_leaves_the_rest_as_content() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    got = PARSERS["hermes"]().extract(text)
    assert got.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", {"city": "Paris"}),
                                                                      ("get_time", {})]
    assert PARSERS["hermes"]().extract("no calls here").calls == []
    broken = "<tool_call>{not json</tool_call>"
    assert PARSERS["hermes"]().extract(broken).content == broken     # not a call: nothing is lost


def test_llama3_json_reads_one_or_several_calls() -> None:
    p = PARSERS["llama3_json"]()
    got = p.extract('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {}}')
    assert got.content is None and [c.name for c in got.calls] == ["get_weather", "get_time"]
    assert p.extract("The weather is fine.").calls == []
    assert p.extract('{"answer": 42}').content == '{"answer": 42}'


@pytest.mark.parametrize("choice,mode", [("required", "required"),
                                         ({"type": "function", "function": {"name": "get_time"}}, "named"),
                                         ("auto", "auto"), (None, "auto")])
def test_tool_choice_modes_and_their_constraints(choice, mode: str) -> None:
    body = {"tools": [WEATHER, TIME], **({"tool_choice": choice} if choice is not None else {})}
    tr = parse_tools(body, auto_enabled=True, parser="hermes")
    assert tr.mode == mode
    so = tr.constraint()
    if mode == "named":
        assert json.loads(so.text) == {"type": "object", "properties": {}}
    elif mode == "required":
        schema = json.loads(so.text)
        assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
        got = tr.extract('[{"name": "get_weather", "parameters": {"city": "Rome"}}]', None)
        assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", {"city": "Rome"})]
    else:
        assert so is None


@pytest.mark.parametrize("body,message", [
    ({"tools": [WEATHER], "tool_choice": "auto"}, "requires --enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "'tool_choice' needs 'tools'"),
    ({"tools": [{"type": "function", "function": {}}]}, "'tools' must be a list"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "'tool_choice' must be"),
])
def test_malformed_tool_requests_are_400s(body, message: str) -> None:
    with pytest.raises(APIError) as e:
        parse_tools(body, auto_enabled=False, parser=None)
    assert e.value.status == 400 and message in e.value.message
    assert parse_tools({"tools": [WEATHER]}, auto_enabled=False, parser=None) is None   # default: none


def test_streamed_calls_go_name_first_then_arguments() -> None:
    from router.tool_parsers import ToolCall
    calls = openai_calls([ToolCall("get_weather", '{"city": "Paris"}')])
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert stream_deltas(calls) == [
        {"tool_calls": [{"index": 0, "id": calls[0]["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}]
