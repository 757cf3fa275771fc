"""Issue #12, "no silent drops": a field we do not implement is a 400 when honouring it would change the
answer, and any other unknown field is named in one warning per request."""
from __future__ import annotations

import logging

import pytest

from router.api_error import APIError
from router.request_fields import check_fields

pytestmark = pytest.mark.unit
TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("extra,param", [
    ({"functions": [{"name": "f"}]}, "functions"), ({"function_call": "auto"}, "function_call"),
    ({"best_of": 2}, "best_of"), ({"best_of": 3, "n": 2}, "best_of"),
])
def test_what_would_change_the_answer_is_refused(route: str, extra: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        check_fields({"prompt": "x", **extra}, route)
    assert e.value.status == 400 and e.value.param == param and "not supported" in e.value.message


@pytest.mark.parametrize("extra,param", [({"tools": TOOL}, "tools"), ({"tool_choice": "required"}, "tool_choice")])
def test_tools_are_for_chat(extra: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        check_fields({"prompt": "x", **extra}, "completions")
    assert e.value.param == param and "/v1/chat/completions" in e.value.message
    check_fields({"messages": [], **extra}, "chat")


def test_the_rest_is_ignored_aloud(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedserve.router"):
        body = {"messages": [], "store": True, "metadata": {}, "use_beam_search": False, "best_of": 1,
                "tools": TOOL, "tool_choice": "none", "temperature": 0.5}
        assert check_fields(body, "chat", "req-1") == ["best_of", "metadata", "store"]
    assert "request req-1: ignoring fields that are not supported: best_of, metadata, store" \
        in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedserve.router"):
        assert check_fields({"prompt": "x", "max_tokens": 3, "guided_regex": "a"}, "completions") == []
    assert caplog.text == ""


def test_beam_search_fields_reach_the_sampling_params() -> None:
    from dataclasses import replace

    from common.model_source import ModelSource
    from router.openai_protocol import ModelInfo, parse_chat_request, parse_completion_request
    tok = ModelSource.resolve(None).load_tokenizer()
    info = ModelInfo("m", len(tok), 256, sampling_defaults={"temperature": 0.2, "top_p": 0.9})
    p = parse_completion_request({"prompt": "Hi", "use_beam_search": True, "n": 3, "length_penalty": 0.5,
                                  "early_stopping": "never"}, tok, info).params
    assert (p.use_beam_search, p.n, p.length_penalty, p.early_stopping) == (True, 3, 0.5, "never")
    assert p.top_p == 1.0, "the generation config's sampling defaults do not apply to beam search"
    assert parse_completion_request({"prompt": "Hi"}, tok, info).params.top_p == 0.9
    for body, param in (({"early_stopping": "soon"}, "early_stopping"), ({"top_p": 0.5}, "top_p"),
                        ({"stop": ["."]}, "stop"), ({"response_format": {"type": "json_object"}}, "structured_outputs")):
        with pytest.raises(APIError) as e:
            parse_chat_request({"messages": [{"role": "user", "content": "Hi"}], "use_beam_search": True, "n": 2,
                                **body}, tok, replace(info, sampling_defaults={}))
        assert e.value.status == 400 and e.value.param == param, (body, e.value.param)
