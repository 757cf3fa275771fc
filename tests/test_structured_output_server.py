"""Issue #12 over HTTP, through the openai SDK: response_format json_schema answers (streamed and not)
that validate, vLLM's guided_* fields on both routes, and a malformed schema as a 400 naming the problem;
beam search (use_beam_search with n) equal to the offline LLM.beam_search on the same fp32 model. One
server for all of them (CI time)."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.server_utils import run_server

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "required": ["city", "population"], "additionalProperties": False, "properties": {
    "city": {"type": "string", "maxLength": 30}, "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
    "rivers": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 20}}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Describe Paris as JSON."}]


@pytest.fixture(scope="module")
def sdk(tmp_path_factory):
    with run_server("--kv-cache-memory", "0.2", "--swap-space", "0.05", "--dtype", "float32",
                    log_dir=tmp_path_factory.mktemp("so-logs")) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120)
        client.model_id = client.models.list().data[0].id
        yield client


def test_a_json_schema_answer_validates_streamed_and_not(sdk) -> None:
    kw = dict(model=sdk.model_id, messages=MESSAGES, response_format=RESPONSE_FORMAT, max_tokens=150, temperature=0)
    whole = sdk.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in sdk.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == whole.choices[0].message.content


def test_json_object_and_the_guided_fields_on_both_routes(sdk) -> None:
    # any object: nothing bounds its length, so greedy (a sampled one may nest until max_tokens)
    out = sdk.chat.completions.create(model=sdk.model_id, messages=MESSAGES, response_format={"type": "json_object"},
                                      max_tokens=150, temperature=0)
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].message.content), dict)
    out = sdk.completions.create(model=sdk.model_id, prompt="The capital of France is", max_tokens=10, n=3,
                                 temperature=1.0, seed=2, extra_body={"guided_choice": ["Paris", "Lyon", "Nice"]})
    assert all(c.text in ("Paris", "Lyon", "Nice") for c in out.choices), out
    out = sdk.chat.completions.create(model=sdk.model_id, messages=MESSAGES, max_tokens=20, temperature=1.0, seed=3,
                                      extra_body={"guided_regex": r"[0-9]{2}\.[0-9]{2}"})
    assert re.fullmatch(r"[0-9]{2}\.[0-9]{2}", out.choices[0].message.content), out


def test_a_malformed_schema_is_a_400_with_the_compilers_message(sdk) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "strng"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=sdk.model_id, messages=MESSAGES, response_format=bad, max_tokens=5)
    err = e.value.body
    assert err["param"] == "response_format" and 'Unsupported type "strng"' in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=sdk.model_id, prompt="x", max_tokens=5,
                               extra_body={"guided_regex": "(", "guided_choice": ["a"]})
    assert "only one structured output constraint" in e.value.body["message"]


def test_beam_search_over_http_equals_the_offline_search(sdk) -> None:
    """n beams, best first, streamed and not, equal to LLM.beam_search on the same fp32 engine; a
    field that would change the ranking is a 400 naming it."""
    from pagedserve import LLM, BeamSearchParams
    prompt = "The capital of France is"
    body = {"use_beam_search": True, "length_penalty": 0.8}
    r = sdk.completions.create(model=sdk.model_id, prompt=prompt, n=3, max_tokens=10, extra_body=body)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    streamed = ["", "", ""]
    for chunk in sdk.completions.create(model=sdk.model_id, prompt=prompt, n=3, max_tokens=10, stream=True,
                                        extra_body=body):
        for c in chunk.choices:
            streamed[c.index] += c.text
    llm = LLM(dtype="float32", kv_cache_memory=0.1)
    offline = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.8))[0]
    llm.shutdown()
    assert texts == streamed == [s.text[len(prompt):] for s in offline.sequences]
    assert len(set(texts)) == 3
    chat = sdk.chat.completions.create(model=sdk.model_id, messages=MESSAGES, n=2, max_tokens=8, extra_body=body)
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=sdk.model_id, prompt=prompt, n=2, max_tokens=4, top_p=0.5, extra_body=body)
    assert e.value.body["param"] == "top_p" and "beam search" in e.value.body["message"]
