"""vLLM's extra HTTP surface, in-process against a scripted engine: /tokenize and /detokenize,
/openapi.json and /docs, CORS, /ping, several served model names, generation_config defaults and the
response role."""
from __future__ import annotations

import pytest
from openapi_spec_validator import validate

from router.cors import CORSConfig
from tests.test_router_unit import MODEL, post, run_http, sse

pytestmark = pytest.mark.unit
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def tok(default_tokenizer):
    return default_tokenizer


def test_tokenize_then_detokenize_round_trips(tok):
    async def scenario(client, engine, app):
        r = await post(client, "/tokenize", {"model": MODEL, "prompt": "Hello, paged world!", "return_token_strs": True})
        body = await r.json()
        assert r.status == 200 and body["tokens"] == tok.encode("Hello, paged world!")
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
        assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
        r = await post(client, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
        assert (await r.json())["prompt"] == "Hello, paged world!"
        chat = await (await post(client, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})).json()
        rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
        assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False)
        for bad in ({"tokens": [len(tok) + 5]}, {"prompt": "a", "messages": []}, {"prompt": 3}):
            path = "/detokenize" if "tokens" in bad else "/tokenize"
            r = await post(client, path, bad)
            assert r.status == 400 and (await r.json())["error"]["message"]
        r = await post(client, "/tokenize", {"model": "other", "prompt": "a"})
        assert r.status == 404
    run_http(tok, scenario)


def test_openapi_document_validates_and_names_served_paths(tok):
    async def scenario(client, engine, app):
        doc = await (await client.get("/openapi.json")).json()
        validate(doc)                               # OpenAPI 3.1, by openapi-spec-validator
        routed = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
        assert set(doc["paths"]) <= routed, set(doc["paths"]) - routed
        # and every route is described (issue #14: the fuzzer covers what the document names), but the docs
        # and the LoRA updates, which answer 404 unless runtime updates are on (and are documented then)
        undocumented = {"/openapi.json", "/docs", "/redoc", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
        assert routed - undocumented <= set(doc["paths"]), routed - set(doc["paths"])
        assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(doc["paths"])
        props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
        assert {"messages", "temperature", "max_completion_tokens", "stream_options"} <= set(props)
        r = await client.get("/docs")
        assert r.status == 200 and "swagger-ui" in await r.text()
        r = await client.get("/redoc")
        assert r.status == 200 and 'spec-url="/openapi.json"' in await r.text()
    run_http(tok, scenario)

    async def no_docs(client, engine, app):
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert (await client.get(path)).status == 404, path
    run_http(tok, no_docs, docs=False)


def test_a_browser_preflight_passes_and_responses_carry_cors_headers(tok):
    async def scenario(client, engine, app):
        pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
        r = await client.options("/v1/chat/completions", headers=pre)
        assert r.status == 200
        assert r.headers["Access-Control-Allow-Origin"] == "*"
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        r = await client.post("/v1/completions", data=b'{"prompt": "Hi", "max_tokens": 2, "stream": true}',
                              headers={"Content-Type": "application/json", "Origin": ORIGIN, "Authorization": "Bearer k"})
        assert r.headers["Access-Control-Allow-Origin"] == "*" and (await sse(r))[-1] == "[DONE]"
        r = await client.get("/v1/models", headers={"Origin": ORIGIN})         # a 401 carries them too
        assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == "*"
    run_http(tok, scenario, api_key="k")      # the preflight carries no key and still passes

    async def restricted(client, engine, app):
        ok = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        r = await client.options("/v1/completions", headers=ok)
        assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert r.headers["Access-Control-Allow-Credentials"] == "true" and r.headers["Vary"] == "Origin"
        for headers in ({**ok, "Origin": "https://evil.example"}, {**ok, "Access-Control-Request-Method": "DELETE"}):
            r = await client.options("/v1/completions", headers=headers)
            assert r.status == 400 and (await r.json())["error"]["code"] == "cors_disallowed"
        r = await client.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in r.headers
    run_http(tok, restricted, cors=CORSConfig([ORIGIN], ["GET", "POST"], ["content-type"], True))


def test_ping_answers_until_the_engine_dies(tok):
    async def scenario(client, engine, app):
        assert (await client.get("/ping")).status == 200 and (await client.post("/ping")).status == 200
        engine.dead_reason = "worker exited"
        r = await client.get("/ping")
        assert r.status == 503 and "worker exited" in (await r.json())["error"]["message"]
    run_http(tok, scenario)


def test_every_served_model_name_is_accepted_and_echoed(tok):
    async def scenario(client, engine, app):
        ids = [c["id"] for c in (await (await client.get("/v1/models")).json())["data"]]
        assert ids == [MODEL, "alias-2"]
        r = await post(client, "/v1/completions", {"model": "alias-2", "prompt": "Hi", "max_tokens": 2})
        assert r.status == 200 and (await r.json())["model"] == "alias-2"          # echoed, as vLLM does
        r = await post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert (await r.json())["model"] == MODEL                                   # silent: the first name
        assert (await post(client, "/v1/completions", {"model": "alias-3", "prompt": "Hi"})).status == 404
    run_http(tok, scenario, aliases=("alias-2",))


def test_generation_config_defaults_apply_where_the_request_is_silent(tok):
    defaults = {"temperature": 0.25, "top_k": 7, "repetition_penalty": 1.1, "max_tokens": 3}

    async def scenario(client, engine, app):
        await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
        await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                    "temperature": 0.9, "max_tokens": 5})
        await post(client, "/v1/completions", {"prompt": "Hi"})
        silent, explicit, completion = (p for _, _, p in engine.added)
        assert (silent.temperature, silent.top_k, silent.repetition_penalty, silent.max_tokens) == (0.25, 7, 1.1, 3)
        # the request's own values win, but max_new_tokens caps every request, as in vLLM
        assert (explicit.temperature, explicit.max_tokens, explicit.top_k) == (0.9, 3, 7)
        assert completion.temperature == 0.25 and completion.max_tokens == 3
    run_http(tok, scenario, sampling_defaults=defaults)


def test_the_response_role(tok):
    async def scenario(client, engine, app):
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        full = await (await post(client, "/v1/chat/completions", body)).json()
        assert full["choices"][0]["message"]["role"] == "bot"
        events = await sse(await post(client, "/v1/chat/completions", {**body, "stream": True}))
        assert events[0]["choices"][0]["delta"]["role"] == "bot"
    run_http(tok, scenario, response_role="bot")


def test_iteration_tokens_fall_in_vllms_buckets():
    from common.protocol import ITERATION_TOKEN_BUCKETS
    from router.metrics import EngineStatsCollector
    from scheduler.stats import SchedulerStats
    st = SchedulerStats()
    for tokens in (1, 8, 9, 512, 20000):
        st.observe_step(1, tokens)
    index = {b: i for i, b in enumerate(ITERATION_TOKEN_BUCKETS)}
    assert st.iteration_tokens[index[1]] == 1 and st.iteration_tokens[index[8]] == 1
    assert st.iteration_tokens[index[16]] == 1 and st.iteration_tokens[index[512]] == 1
    assert st.iteration_tokens[-1] == 1 and st.iteration_tokens_sum == 1 + 8 + 9 + 512 + 20000

    class Client:
        stats = type("S", (), {"values": {"iteration_tokens": st.iteration_tokens,
                                          "iteration_tokens_sum": st.iteration_tokens_sum}})()
    fam = next(f for f in EngineStatsCollector(Client(), "m").collect() if f.name == "vllm:iteration_tokens_total")
    buckets = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    assert (buckets["1.0"], buckets["16.0"], buckets["16384.0"], buckets["+Inf"]) == (1, 3, 4, 5)
