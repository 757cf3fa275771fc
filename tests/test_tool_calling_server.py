"""Issue #12, tool calling through the openai SDK on the default model: required and named calls always
parse with valid arguments, streamed calls accumulate to the non-streamed ones, and a whole round trip
(call, tool result, answer) works."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server_utils import run_server

pytestmark = pytest.mark.e2e

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "current weather in a city",
                                      "parameters": {"type": "object", "required": ["city", "unit"],
                                                     "additionalProperties": False, "properties": {
                                                         "city": {"type": "string", "maxLength": 30},
                                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "add", "description": "add two integers",
                                      "parameters": {"type": "object", "required": ["a", "b"],
                                                     "additionalProperties": False, "properties": {
                                                         "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                         "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASKS = ["What is the weather in Paris?", "How warm is it in Tokyo right now?", "Is it raining in London?",
        "Weather for Cairo in fahrenheit, please.", "What is 2 plus 3?", "Add 40 and 2.", "Sum of -5 and 9?",
        "What's 100 + 250?", "Tell me the weather in Lima.", "Compute 7 plus 8."]


@pytest.fixture(scope="module")
def sdk(tmp_path_factory):
    with run_server("--kv-cache-memory", "0.2", "--swap-space", "0.05", "--dtype", "float32",
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                    log_dir=tmp_path_factory.mktemp("tools-logs")) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120)
        client.model_id = client.models.list().data[0].id
        yield client


def _check_calls(message) -> list[tuple[str, dict]]:
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_always_parse_with_valid_arguments(sdk, choice: str) -> None:
    for i, ask in enumerate(ASKS):
        name = "add" if "plus" in ask or "Add" in ask or "+" in ask or "Sum" in ask else "get_weather"
        tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": name}}
        # one call each: a 135M model asked for "any number" of calls may repeat them until max_tokens
        out = sdk.chat.completions.create(model=sdk.model_id, messages=[{"role": "user", "content": ask}],
                                          tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
                                          temperature=0.7, seed=i, parallel_tool_calls=False)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls", c
        calls = _check_calls(c.message)
        if choice == "named":
            assert [n for n, _ in calls] == [name]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_streamed_calls_accumulate_to_the_non_streamed_ones(sdk, choice) -> None:
    """Named: the arguments stream as they are generated (many fragments); required: in one piece."""
    kw = dict(model=sdk.model_id, messages=[{"role": "user", "content": ASKS[0]}], tools=TOOLS,
              tool_choice=choice, max_tokens=120, temperature=0, parallel_tool_calls=False)
    whole = sdk.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    fragments = 0
    finish = None
    for chunk in sdk.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:        # as the SDK's docs accumulate them
                acc = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    acc["id"] = tc.id
                if tc.function and tc.function.name:
                    acc["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    acc["arguments"] += tc.function.arguments
                    fragments += 1
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())
    assert fragments > 3 if isinstance(choice, dict) else fragments == len(calls)


def test_a_round_trip_call_result_and_answer(sdk) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = sdk.chat.completions.create(model=sdk.model_id, messages=messages, tools=TOOLS,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        max_tokens=80, temperature=0).choices[0]
    (name, args), = _check_calls(first.message)
    call = first.message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, **args})}]
    final = sdk.chat.completions.create(model=sdk.model_id, messages=messages, tools=TOOLS, tool_choice="none",
                                        max_tokens=40, temperature=0).choices[0]
    assert final.message.content and not final.message.tool_calls and final.finish_reason in ("stop", "length")
