"""Fuzzing the HTTP API (issue #14): schemathesis over the server's own /openapi.json, and hypothesis
throwing random JSON at both generation routes. A real `pagedserve serve` on the tiny random model.

Pass criteria: no 5xx ever; every response conforms to the document (status code, content type, body
schema); every 4xx carries an OpenAI error body; and the server still generates afterwards. The short
form runs here (PAGEDSERVE_FUZZ_EXAMPLES per operation, default 20); `python -m loadtest.fuzz` runs the
long one against any server.
"""
from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from router.app import package_version
from router.openapi import openapi_document
from tests.server_utils import run_server
from tests.test_server_e2e import SMALL_KV, request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "20"))
STATUSES: Counter = Counter()      # (path, status) -> responses, for the depth check at the end
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
GENERATION = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, tiny_model):
    # a short context keeps every fuzzed generation short; n and max_tokens stay within their limits
    with run_server(str(tiny_model("llama")), *SMALL_KV, "--max-model-len", "96", "--max-num-seqs", "32",
                    log_dir=tmp_path_factory.mktemp("fuzz-logs")) as s:
        yield s


# The document the server serves, built as the router builds it (schemathesis's lazy fixture loader does
# not run under pytest 9); the first test checks that the server serves exactly this document.
DOCUMENT = openapi_document(package_version(), lora_updates=False, api_keys=False)
schema = schemathesis.openapi.from_dict(DOCUMENT)


def test_the_server_serves_the_document_fuzzed_here(fuzz_server):
    status, _, data = request(fuzz_server, "GET", "/openapi.json")
    assert status == 200 and json.loads(data) == DOCUMENT


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis_finds_no_5xx_and_no_response_off_the_schema(case, fuzz_server):
    if isinstance(case.body, dict):
        case.body.pop("model", None)       # a random model name is a 404 before anything else is read
        for name in [n for n in CONSTRAINTS if n in case.body][1:]:
            del case.body[name]            # two structured-output constraints are a 400 before the rest too
    response = case.call_and_validate(base_url=fuzz_server.url, checks=CHECKS, timeout=60)
    STATUSES[case.path, response.status_code] += 1
    if 400 <= response.status_code < 500:
        _assert_openai_error(response.json())


CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")


# ---- random JSON at the generation routes -----------------------------------------------------------
_SCALARS = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=40)
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12),
                                                                                             inner, max_size=4),
                     max_leaves=12)
_FIELDS = ("prompt", "messages", "max_tokens", "n", "temperature", "top_p", "top_k", "stop", "stream",
           "logprobs", "top_logprobs", "echo", "seed", "logit_bias", "stream_options", "min_tokens", "tools",
           "response_format", "max_completion_tokens", "stop_token_ids", "ignore_eos", "user",
           "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# bodies that use the real field names with random values reach far deeper than random keys do
_BODIES = _JSON | st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=8)


@given(path=st.sampled_from(GENERATION), body=_BODIES)
@settings(max_examples=4 * EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_random_json_gets_a_2xx_or_a_4xx_with_an_openai_error(fuzz_server, path, body):
    status, headers, data = request(fuzz_server, "POST", path, raw=json.dumps(body, allow_nan=True).encode(),
                                    timeout=60)
    assert status < 500, (status, body, data[:500])
    if status >= 400:
        _assert_openai_error(json.loads(data))


def test_the_server_still_serves_after_the_fuzzing(fuzz_server):
    status, _, data = request(fuzz_server, "POST", "/v1/completions",
                              {"prompt": "still here", "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 3, data
    # the fuzzing reached generation, not only the validation in front of it (when the module ran whole)
    if STATUSES:
        assert all(STATUSES[path, 200] >= EXAMPLES // 4 for path in GENERATION), sorted(STATUSES.items())


def _assert_openai_error(body: dict) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
