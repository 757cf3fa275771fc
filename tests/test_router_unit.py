"""Router without an engine: request validation (the bad-input matrix) with the default model's real tokenizer,
then the HTTP layer (shapes, SSE, errors, auth, aborts, drain) through aiohttp's test client against a scripted
fake EngineClient."""
from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.model_source import ModelSource
from common.protocol import EngineOutput, EngineRequest, Stats, encode
from common.sampling_params import MAX_N, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS, SamplingParams
from pagedserve import cli
from router.app import build_app, drain
from router.config import API_KEY_ENV, VLLM_API_KEY_ENV, RouterConfig
from router.engine_client import EngineRejected
from router.openai_protocol import (APIError, ModelInfo, decode_json_body, parse_chat_request,
                                    parse_completion_request)

pytestmark = pytest.mark.unit

MODEL = "test-model"
MAX_LEN = 256


@pytest.fixture(scope="module")
def tok():
    return ModelSource.resolve(None).load_tokenizer()


@pytest.fixture(scope="module")
def info(tok) -> ModelInfo:
    return ModelInfo(MODEL, len(tok), MAX_LEN)


def completion(tok, info, **body):
    return parse_completion_request({"model": MODEL, "prompt": "Hello", **body}, tok, info)


def chat(tok, info, **body):
    return parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body}, tok, info)


def api_error(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **kwargs)
    return e.value


# ---- JSON body -------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [b"{", b"", b"[1, 2]", b'"text"', b"null", b'{"seed": NaN}', b"\xff\xfe"])
def test_bad_json_bodies_are_400(raw):
    e = api_error(decode_json_body, raw, "application/json")
    assert e.status == 400 and e.type == "invalid_request_error"


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_content_type_must_be_json(ctype):
    assert api_error(decode_json_body, b"{}", ctype).status == 400


def test_integers_beyond_64_bits_reach_validation(tok, info):
    body = decode_json_body(b'{"prompt": "x", "seed": 123456789012345678901234567890}', "application/json")
    e = api_error(parse_completion_request, body, tok, info)
    assert (e.status, e.param) == (400, "seed")


# ---- model -----------------------------------------------------------------------------------------
def test_unknown_model_is_404(tok, info):
    e = api_error(completion, tok, info, model="gpt-9")
    assert (e.status, e.param, e.code) == (404, "model", "model_not_found")
    assert api_error(chat, tok, info, model="gpt-9").status == 404


def test_missing_model_is_accepted(tok, info):
    parsed = parse_completion_request({"prompt": "Hello"}, tok, info)
    assert parsed.prompts[0].token_ids == tok.encode("Hello")


# ---- the bad-input matrix, both APIs ---------------------------------------------------------------
BAD = [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", "16"), ("max_tokens", 1.5),
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("presence_penalty", -2.5), ("frequency_penalty", 3), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("repetition_penalty", 2.5),
    ("n", 0), ("n", MAX_N + 1), ("n", True),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", "42"),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)), ("stop", "x" * (MAX_STOP_STRING_LEN + 1)), ("stop", [""]),
    ("stop", [1, 2]), ("stop", {"a": 1}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [10**9]), ("stop_token_ids", "2"),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", {"99999999": 1}),
    ("logit_bias", {"5": 101}), ("logit_bias", {"5": "x"}), ("logit_bias", [1]),
    ("min_tokens", -1), ("min_tokens", 10**6),
    ("stream", "yes"), ("ignore_eos", 1), ("skip_special_tokens", "no"),
    ("include_stop_str_in_output", 0), ("user", 5),
]


@pytest.mark.parametrize("param,value", BAD, ids=[f"{p}={v!r}"[:40] for p, v in BAD])
@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_bad_parameter_is_400_naming_it(tok, info, parse, param, value):
    e = api_error(parse, tok, info, **{param: value})
    assert e.status == 400 and e.type == "invalid_request_error"
    assert e.param == param, e.message
    assert e.body()["error"]["message"]


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_stream_options_need_stream(tok, info, parse):
    e = api_error(parse, tok, info, stream_options={"include_usage": True})
    assert (e.status, e.param) == (400, "stream_options")
    assert parse(tok, info, stream=True, stream_options={"include_usage": True}).include_usage


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_valid_extremes_are_accepted(tok, info, parse):
    p = parse(tok, info, temperature=0, top_p=1, n=MAX_N, seed=2**63 - 1, presence_penalty=-2,
              frequency_penalty=2, repetition_penalty=2, stop=["x"] * MAX_STOP_STRINGS, top_k=0,
              logit_bias={"0": -100, str(len(tok) - 1): 100}, stop_token_ids=[0, len(tok) - 1], min_tokens=1)
    sp = p.params
    assert sp.n == MAX_N and sp.seed == 2**63 - 1 and sp.top_k == -1 and sp.greedy
    assert sp.logit_bias == {0: -100.0, len(tok) - 1: 100.0}


def test_null_means_default(tok, info):
    p = completion(tok, info, temperature=None, max_tokens=None, stop=None, n=None, logprobs=None)
    assert (p.params.temperature, p.params.max_tokens, p.params.stop, p.params.n) == (1.0, 16, [], 1)


# ---- completions prompts ---------------------------------------------------------------------------
def test_prompt_forms(tok, info):
    ids = tok.encode("Hello world")
    assert [p.token_ids for p in completion(tok, info, prompt="Hello world").prompts] == [ids]
    assert [p.text for p in completion(tok, info, prompt=["a", "b"]).prompts] == ["a", "b"]
    assert [p.token_ids for p in completion(tok, info, prompt=ids).prompts] == [ids]
    assert [p.token_ids for p in completion(tok, info, prompt=[ids, [1, 2]]).prompts] == [ids, [1, 2]]
    assert completion(tok, info, prompt=ids).prompts[0].text is None


@pytest.mark.parametrize("prompt", ["", [], [[]], ["ok", ""], None])
def test_empty_or_missing_prompt_is_400(tok, info, prompt):
    e = api_error(completion, tok, info, prompt=prompt)
    assert (e.status, e.param) == (400, "prompt")


@pytest.mark.parametrize("prompt", [[1, "a"], [True], 5, {"text": "x"}, [[1], 2], [[1.5]]])
def test_malformed_prompt_is_400(tok, info, prompt):
    assert api_error(completion, tok, info, prompt=prompt).status == 400


@pytest.mark.parametrize("bad_id", [-1, "vocab"])
def test_token_ids_outside_vocabulary_are_400(tok, info, bad_id):
    bad_id = len(tok) if bad_id == "vocab" else bad_id
    for prompt in ([1, bad_id], [[1], [bad_id]]):
        e = api_error(completion, tok, info, prompt=prompt)
        assert (e.status, e.param) == (400, "prompt") and str(bad_id) in e.message


def test_completions_defaults(tok, info):
    p = completion(tok, info)
    assert p.params.max_tokens == 16 and not p.chat and not p.stream and p.logprobs is None
    assert p.prompts[0].token_ids == tok.encode("Hello")


def test_echo_with_logprobs_asks_for_prompt_logprobs(tok, info):
    p = completion(tok, info, echo=True, logprobs=2)
    assert (p.echo, p.logprobs, p.params.logprobs, p.params.prompt_logprobs) == (True, 2, 2, 2)
    assert completion(tok, info, logprobs=0).params.prompt_logprobs is None
    assert api_error(completion, tok, info, logprobs=21).param == "logprobs"
    assert api_error(completion, tok, info, logprobs=True).param == "logprobs"


def test_suffix_is_rejected(tok, info):
    assert api_error(completion, tok, info, suffix="x").param == "suffix"


# ---- context length --------------------------------------------------------------------------------
def test_prompt_over_max_model_len_names_both_numbers(tok, info):
    ids = [1] * (MAX_LEN + 5)
    e = api_error(completion, tok, info, prompt=ids)
    assert e.status == 400 and str(MAX_LEN) in e.message and str(MAX_LEN + 5) in e.message


def test_prompt_plus_max_tokens_over_max_model_len_names_both_numbers(tok, info):
    ids = [1] * 200
    e = api_error(completion, tok, info, prompt=ids, max_tokens=100)
    assert (e.status, e.param) == (400, "max_tokens")
    assert str(MAX_LEN) in e.message and "300" in e.message and "200" in e.message
    assert completion(tok, info, prompt=ids, max_tokens=MAX_LEN - 200).params.max_tokens == MAX_LEN - 200
    # the completions default (16) counts too
    assert api_error(completion, tok, info, prompt=[1] * (MAX_LEN - 10)).status == 400


def test_chat_over_max_model_len(tok, info):
    e = api_error(chat, tok, info, messages=[{"role": "user", "content": "word " * MAX_LEN}])
    assert e.status == 400 and e.param == "messages" and str(MAX_LEN) in e.message
    e = api_error(chat, tok, info, max_tokens=MAX_LEN)
    assert e.status == 400 and e.param == "max_tokens"


# ---- chat ------------------------------------------------------------------------------------------
def test_chat_prompt_is_the_template_encoded_without_special_tokens(tok, info):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    p = chat(tok, info, messages=msgs)
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert p.chat and p.prompts[0].text == text
    assert p.prompts[0].token_ids == tok.encode(text, add_special_tokens=False)
    assert p.params.max_tokens == MAX_LEN - len(p.prompts[0].token_ids)     # default: the rest of the context


def test_chat_content_parts_and_roles(tok, info):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    p = chat(tok, info, messages=[{"role": "developer", "content": "sys"}, {"role": "user", "content": parts},
                                  {"role": "assistant", "content": None, "tool_calls": []},
                                  {"role": "tool", "content": "42", "tool_call_id": "t1"},
                                  {"role": "user", "content": "ok"}])
    assert "Hello\nthere" in p.prompts[0].text and "sys" in p.prompts[0].text


def test_max_completion_tokens_wins(tok, info):
    assert chat(tok, info, max_completion_tokens=7, max_tokens=9).params.max_tokens == 7
    assert api_error(chat, tok, info, max_completion_tokens=0).param == "max_completion_tokens"


@pytest.mark.parametrize("messages", [
    [], None, "hi", [{"content": "no role"}], [{"role": "robot", "content": "x"}], ["hi"],
    [{"role": "user", "content": 5}], [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
])
def test_bad_messages_are_400(tok, info, messages):
    e = api_error(chat, tok, info, messages=messages)
    assert (e.status, e.param) == (400, "messages")


def test_chat_logprobs(tok, info):
    assert chat(tok, info).logprobs is None
    p = chat(tok, info, logprobs=True)
    assert (p.logprobs, p.params.logprobs) == (0, 0)
    assert chat(tok, info, logprobs=True, top_logprobs=5).params.logprobs == 5
    assert api_error(chat, tok, info, logprobs=True, top_logprobs=21).param == "top_logprobs"
    assert api_error(chat, tok, info, logprobs=True, top_logprobs=-1).param == "top_logprobs"
    assert api_error(chat, tok, info, top_logprobs=2).param == "top_logprobs"
    assert api_error(chat, tok, info, logprobs=1).param == "logprobs"


# ---- fuzz: any JSON object is either a valid engine request or a 4xx --------------------------------
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                                st.dictionaries(st.text(max_size=5), kids, max_size=4)),
                           max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "top_logprobs",
          "echo", "ignore_eos", "min_tokens", "stream", "stream_options", "user"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                 "content": st.one_of(st.text(max_size=20), JSON_VALUES)})


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6),
       prompt=st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 60000), max_size=5)),
       messages=st.lists(MESSAGE, max_size=3))
def test_fuzzed_bodies_parse_or_fail_cleanly(tok, info, body, prompt, messages):
    for parse, base in ((parse_completion_request, {"prompt": prompt}), (parse_chat_request, {"messages": messages})):
        try:
            parsed = parse({**base, **body}, tok, info)
        except APIError as e:
            assert 400 <= e.status < 500 and e.message
            continue
        for p in parsed.prompts:
            assert 0 < len(p.token_ids) and all(0 <= t < len(tok) for t in p.token_ids)
            assert len(p.token_ids) + parsed.params.max_tokens <= MAX_LEN
            encode(EngineRequest("r", p.token_ids, parsed.params))        # it crosses the wire


# ---- RouterConfig <-> the CLI ----------------------------------------------------------------------
def test_router_flags_are_router_config_fields(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(VLLM_API_KEY_ENV, raising=False)
    assert cli.router_config(cli.build_parser().parse_args(["router"])) == RouterConfig()
    argv = ["router", "m", "--connect", "tcp://s:1", "--host", "0.0.0.0", "--port", "9", "--served-model-name", "x",
            "y", "--api-key", "k", "--max-body-bytes", "7", "--shutdown-timeout", "2.5", "--access-log",
            "--allowed-origins", '["https://a.example"]', "--allowed-methods", "GET,POST"]
    assert cli.router_config(cli.build_parser().parse_args(argv)) == RouterConfig(
        model="m", frontend_address="tcp://s:1", host="0.0.0.0", port=9, served_model_name=["x", "y"],
        api_key=["k"], max_body_bytes=7, shutdown_timeout=2.5, access_log=True,
        allowed_origins=["https://a.example"], allowed_methods=["GET", "POST"])


def test_api_key_defaults_from_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.setenv(VLLM_API_KEY_ENV, "from-vllm-env")            # vLLM's variable, when ours is unset
    assert cli.router_config(cli.build_parser().parse_args(["router"])).api_key == ["from-vllm-env"]
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert cli.router_config(cli.build_parser().parse_args(["router"])).api_key == ["from-env"]
    monkeypatch.setenv(API_KEY_ENV, '["a", "b"]')
    assert cli.router_config(cli.build_parser().parse_args(["router"])).api_key == ["a", "b"]
    assert cli.router_config(cli.build_parser().parse_args(["router", "--api-key", "k"])).api_key == ["k"]


def test_serve_hands_its_router_config_to_child_routers(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = cli.build_parser().parse_args(["serve", "m", "--port", "8001", "--served-model-name", "x", "x2",
                                          "--api-key", "s3cret", "other", "--max-body-bytes", "7", "--access-log",
                                          "--allowed-origins", '["https://a.example"]', "--tokenizer", "t"])
    config = cli.router_config(args, frontend_address="ipc:///tmp/f.ipc")
    flags = cli.router_flags(config, args.log_level)
    env = cli.router_env(config)[API_KEY_ENV]
    assert "s3cret" not in " ".join(flags) and json.loads(env) == ["s3cret", "other"]     # not on argv
    monkeypatch.setenv(API_KEY_ENV, env)
    child = cli.build_parser().parse_args(["router", "m", *flags])
    assert cli.router_config(child) == config and child.log_level == args.log_level


# ==== HTTP layer against a scripted engine ==========================================================
REPLY = " Hello there, friend. The end."


class FakeEngine:
    """Stands in for EngineClient: emits REPLY's tokens one step at a time for every choice, honouring
    max_tokens, per-choice aborts (finish "abort") and whole-request aborts (queue dropped)."""

    def __init__(self, tok, *, ready: bool = True, step_s: float = 0.0):
        self.tok, self.step_s = tok, step_s
        self.reply = tok.encode(REPLY)
        self.stats = Stats(ready, None, MAX_LEN, {"running": 3, "waiting": 1, "kv_cache_usage": 0.25,
                                                  "prompt_tokens": 100, "generation_tokens": 50})
        self.dead_reason: str | None = None
        self.client_id = "fake"
        self.queues: dict[str, asyncio.Queue] = {}
        self.aborted: dict[str, set[int]] = {}
        self.abort_calls: list[tuple[str, int]] = []
        self.added: list[tuple[str, list[int], SamplingParams]] = []
        self.reject: EngineRejected | None = None
        self.fail_after: int | None = None       # steps, then an index -1 "error" output
        self.tasks: list[asyncio.Task] = []
        self.loras: list[str | None] = []         # per added request: the adapter name it asked for

    @property
    def ready(self) -> bool:
        return self.stats.ready

    @property
    def max_model_len(self) -> int:
        return self.stats.max_model_len

    async def add(self, rid: str, ids: list[int], params: SamplingParams, timeout: float = 30.0,
                  lora=None) -> asyncio.Queue:
        if self.reject:
            raise self.reject
        self.added.append((rid, ids, params))
        self.loras.append(lora.lora_name if lora else None)
        q = self.queues[rid] = asyncio.Queue()
        self.aborted[rid] = set()
        self.tasks.append(asyncio.create_task(self._run(rid, len(ids), params, q)))
        return q

    async def _run(self, rid: str, n_prompt: int, params: SamplingParams, q: asyncio.Queue) -> None:
        done: set[int] = set()
        for step in range(params.max_tokens):
            await asyncio.sleep(self.step_s)
            if self.fail_after is not None and step == self.fail_after:
                q.put_nowait(EngineOutput(rid, -1, [], finish_reason="error", error="engine failure: boom"))
                return
            for i in range(params.n):
                if i in done:
                    continue
                if i in self.aborted[rid]:
                    done.add(i)
                    q.put_nowait(EngineOutput(rid, i, [], finish_reason="abort"))
                    continue
                tok = self.reply[step % len(self.reply)]
                last = step == params.max_tokens - 1
                lps = [(-0.5, 1, [tok, 11][:params.logprobs], [-0.5, -1.5][:params.logprobs])] \
                    if params.logprobs is not None else None
                plps = None
                if step == 0 and params.prompt_logprobs:
                    plps = [None] + [(-2.0, 3, [7], [-1.0])] * (n_prompt - 1)
                q.put_nowait(EngineOutput(rid, i, [tok], finish_reason="length" if last else None, logprobs=lps,
                                          prompt_logprobs=plps, num_prompt_tokens=n_prompt,
                                          num_cached_tokens=4 if step == 0 else 0,
                                          queue_time=0.01 if step == 0 else None))
                if last:
                    done.add(i)
            if len(done) == params.n:
                return

    async def abort(self, rid: str, index: int = -1) -> None:
        self.abort_calls.append((rid, index))
        if index < 0:
            self.queues.pop(rid, None)
        self.aborted.setdefault(rid, set()).add(index)

    def release(self, rid: str) -> None:
        self.queues.pop(rid, None)


def run_http(tok, scenario, *, engine: FakeEngine | None = None, **app_kwargs: Any) -> FakeEngine:
    """Build an app around a FakeEngine, start aiohttp's test server, run `scenario(client, engine, app)`."""
    engine = engine or FakeEngine(tok)

    async def main() -> None:
        app = build_app(engine, tok, MODEL, vocab_size=len(tok), **app_kwargs)
        auth = {"Authorization": f"Bearer {app_kwargs['api_key']}"} if app_kwargs.get("api_key") else {}
        async with TestClient(TestServer(app)) as client:
            if engine.ready:                     # warm-up runs in the background at startup
                await until(lambda: is_ready(client, auth), "the router is ready after its warm-up")
            await scenario(client, engine, app)
        for t in engine.tasks:
            t.cancel()
    asyncio.run(main())
    return engine


async def until(cond: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = 5.0) -> None:
    """Poll `cond` (a predicate, or a coroutine function) every few ms until it holds; fail the test, saying
    `what` it waited for, if it does not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        ok = cond()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting until {what}")
        await asyncio.sleep(0.005)


async def is_ready(client, headers: dict[str, str] | None = None) -> bool:
    async with client.get("/ready", headers=headers or {}) as r:
        return r.status == 200


async def post(client, path: str, body: dict, **kw):
    return await client.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json"}, **kw)


async def sse(resp) -> list[Any]:
    """The stream's events: decoded JSON objects, and the string "[DONE]"."""
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    raw = (await resp.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e == "data: [DONE]" else orjson.loads(e[6:]) for e in events]


def reply_text(tok, n_tokens: int) -> str:
    ids = tok.encode(REPLY)
    return tok.decode([ids[i % len(ids)] for i in range(n_tokens)])


def test_completion_response_shape(tok):
    async def scenario(client, engine, app):
        r = await post(client, "/v1/completions", {"model": MODEL, "prompt": "Hi there", "max_tokens": 5})
        assert r.status == 200
        body = await r.json()
        assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
        assert isinstance(body["created"], int)
        assert body["choices"] == [{"index": 0, "text": reply_text(tok, 5), "logprobs": None,
                                    "finish_reason": "length"}]
        n_prompt = len(tok.encode("Hi there"))
        assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 5, "total_tokens": n_prompt + 5,
                                 "prompt_tokens_details": {"cached_tokens": 4}}
        assert engine.added[0][2].max_tokens == 5
    run_http(tok, scenario)


def test_chat_response_shape_and_multiple_choices(tok):
    async def scenario(client, engine, app):
        r = await post(client, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2})
        body = await r.json()
        assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
        assert [c["index"] for c in body["choices"]] == [0, 1]
        for c in body["choices"]:
            assert c["message"] == {"role": "assistant", "content": reply_text(tok, 4)}
            assert c["finish_reason"] == "length" and c["logprobs"] is None
        assert body["usage"]["completion_tokens"] == 8
    run_http(tok, scenario)


def test_chat_stream(tok):
    async def scenario(client, engine, app):
        r = await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 6, "n": 2, "stream": True,
                                                        "stream_options": {"include_usage": True}})
        events = await sse(r)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert len({(c["id"], c["created"]) for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
        assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
        usage = chunks[-1]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
        for index in (0, 1):
            mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            assert "".join(c["delta"].get("content", "") for c in mine) == reply_text(tok, 6)
            assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
            assert mine[-1]["finish_reason"] == "length"
        assert all(c["usage"] is None for c in chunks[:-1])
    run_http(tok, scenario)


def test_completion_stream_with_echo_and_logprobs(tok):
    async def scenario(client, engine, app):
        r = await post(client, "/v1/completions", {"prompt": "Hi there", "max_tokens": 3, "stream": True,
                                                   "echo": True, "logprobs": 1})
        events = await sse(r)
        chunks = [e["choices"][0] for e in events[:-1]]
        text = "".join(c["text"] for c in chunks)
        assert text == "Hi there" + reply_text(tok, 3)
        tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
        offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
        n_prompt = len(tok.encode("Hi there"))
        assert len(tokens) == n_prompt + 3 and offsets[0] == 0 and offsets == sorted(offsets)
        lps = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
        assert lps[0] is None and lps[1] == -2.0 and lps[-1] == -0.5
        assert chunks[-1]["finish_reason"] == "length" and "usage" not in events[0]
        assert "\"usage\"" not in str(events[0])
    run_http(tok, scenario)


def test_logprob_formats_non_stream(tok):
    async def scenario(client, engine, app):
        r = await post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": 2})
        lp = (await r.json())["choices"][0]["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert lp["token_logprobs"] == [-0.5, -0.5] and lp["text_offset"][0] == 0
        assert len(lp["top_logprobs"][0]) == 2 and lp["tokens"][0] in lp["top_logprobs"][0]
        r = await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 2, "logprobs": True, "top_logprobs": 2})
        content = (await r.json())["choices"][0]["logprobs"]["content"]
        assert len(content) == 2
        e = content[0]
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["bytes"] == list(e["token"].encode()) and e["logprob"] == -0.5
        assert [t["logprob"] for t in e["top_logprobs"]] == [-0.5, -1.5]
    run_http(tok, scenario)


def test_batch_of_prompts_numbers_choices_prompt_major(tok):
    async def scenario(client, engine, app):
        r = await post(client, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "stream": True})
        events = await sse(r)
        finishes = sorted(e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"])
        assert finishes == [0, 1, 2, 3] and len(engine.added) == 2
        r = await post(client, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
        assert [c["index"] for c in (await r.json())["choices"]] == [0, 1, 2, 3]
    run_http(tok, scenario)


def test_stop_string_ends_choice_and_aborts_it_in_the_engine(tok):
    async def scenario(client, engine, app):
        r = await post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 20, "stop": [","]})
        body = await r.json()
        assert body["choices"][0]["text"] == " Hello there"
        assert body["choices"][0]["finish_reason"] == "stop"
        assert engine.abort_calls == [(body["id"], 0)]
    run_http(tok, scenario)


def test_engine_rejection_429_has_retry_after(tok):
    engine = FakeEngine(tok)
    engine.reject = EngineRejected(429, "the server is overloaded: the waiting queue is full")

    async def scenario(client, engine, app):
        r = await post(client, "/v1/completions", {"prompt": "Hi"})
        assert r.status == 429 and r.headers["Retry-After"]
        err = (await r.json())["error"]
        assert set(err) == {"message", "type", "param", "code"} and "overloaded" in err["message"]
        metrics = await (await client.get("/metrics")).text()
        assert 'pagedserve:router_admission_rejections_total{model_name="test-model"} 1.0' in metrics
        engine.reject = EngineRejected(400, "the prompt is empty", "prompt")
        r = await post(client, "/v1/completions", {"prompt": "Hi"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
    run_http(tok, scenario, engine=engine)


def test_engine_failure_mid_request(tok):
    engine = FakeEngine(tok)
    engine.fail_after = 2

    async def scenario(client, engine, app):
        r = await post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 10, "stream": True})
        events = await sse(r)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert events[-2]["error"]["type"] == "server_error" and "boom" in events[-2]["error"]["message"]
        r = await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
        assert r.status == 503 and "boom" in (await r.json())["error"]["message"]
    run_http(tok, scenario, engine=engine)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_http_errors_are_openai_shaped(tok, path):
    async def scenario(client, engine, app):
        async def err(resp, status):
            assert resp.status == status, await resp.text()
            body = await resp.json()
            assert set(body["error"]) == {"message", "type", "param", "code"}
            return body["error"]
        await err(await client.post(path, data=b"{not json", headers={"Content-Type": "application/json"}), 400)
        await err(await client.post(path, data=b"{}", headers={"Content-Type": "text/plain"}), 400)
        await err(await post(client, path, {"model": "nope", "prompt": "x", "messages": []}), 404)
        await err(await post(client, path, {"prompt": "x", "messages": [{"role": "user", "content": "x"}],
                                            "temperature": 9}), 400)
        await err(await client.post(path, data=b"x" * 5000, headers={"Content-Type": "application/json"}), 413)
        await err(await client.get(path), 405)
        await err(await client.get("/v1/nothing"), 404)
        assert engine.added == []
    run_http(tok, scenario, max_body_bytes=4096)


def test_api_keys_guard_the_v1_routes_as_vllm_does(tok):
    """Any of several keys opens /v1/*; health, readiness, metrics, version and tokenize stay open, as in vLLM."""
    async def scenario(client, engine, app):
        for path in ("/health", "/ready", "/metrics", "/version", "/ping"):
            assert (await client.get(path)).status == 200, path
        assert (await post(client, "/tokenize", {"prompt": "Hi"})).status == 200
        for key in ("s3cret", "other"):
            r = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer s3cre"}):
            assert (await client.get("/v1/models", headers=headers)).status == 401
        r = await post(client, "/v1/completions", {"prompt": "Hi"})
        assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        r = await client.post("/v1/completions", data=b'{"prompt": "Hi"}',
                              headers={"Content-Type": "application/json", "Authorization": "Bearer other"})
        assert r.status == 200
    run_http(tok, scenario, api_key=["s3cret", "other"])


def test_models_version_metrics(tok):
    async def scenario(client, engine, app):
        card = (await (await client.get("/v1/models")).json())["data"][0]
        assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == MAX_LEN
        assert {"created", "owned_by", "root"} <= set(card)
        assert "version" in await (await client.get("/version")).json()
        await post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
        text = await (await client.get("/metrics")).text()
        for line in ['pagedserve:num_requests_running{model_name="test-model"} 3.0',
                     'pagedserve:kv_cache_usage_perc{model_name="test-model"} 0.25',
                     'pagedserve:prompt_tokens_total{model_name="test-model"} 100.0',
                     'pagedserve:request_success_total{finished_reason="length",model_name="test-model"} 1.0',
                     'pagedserve:time_to_first_token_seconds_count{model_name="test-model"} 1.0',
                     'pagedserve:inter_token_latency_seconds_count{model_name="test-model"} 2.0',
                     'pagedserve:request_queue_time_seconds_count{model_name="test-model"} 1.0',
                     'pagedserve:e2e_request_latency_seconds_count{model_name="test-model"} 1.0']:
            assert line in text, line
    run_http(tok, scenario)


def test_not_ready_is_503_but_alive(tok):
    async def scenario(client, engine, app):
        assert (await client.get("/health")).status == 200
        r = await client.get("/ready")
        assert r.status == 503 and (await r.json())["reason"]
        assert (await post(client, "/v1/completions", {"prompt": "Hi"})).status == 503
        engine.stats.ready = True
        await until(lambda: is_ready(client), "/ready answers 200 once the engine is ready")
        assert (await client.get("/ready")).status == 200
    run_http(tok, scenario, engine=FakeEngine(tok, ready=False))


def test_client_disconnect_aborts_the_request(tok):
    async def scenario(client, engine, app):
        r = await post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 200, "stream": True})
        await r.content.readline()
        r.close()
        await until(lambda: any(i == -1 for _, i in engine.abort_calls), "the stream's request is aborted")
        assert [i for _, i in engine.abort_calls] == [-1]
        # a non-streaming request whose client goes away is cancelled and aborted too
        task = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 200}))
        await until(lambda: len(engine.added) == 2, "the non-streaming request reaches the engine")
        task.cancel()
        await until(lambda: len(engine.abort_calls) == 2, "the non-streaming request is aborted")
        assert [i for _, i in engine.abort_calls] == [-1, -1]
    run_http(tok, scenario, engine=FakeEngine(tok, step_s=0.01))


def test_drain_refuses_new_work_then_aborts_stragglers(tok):
    async def scenario(client, engine, app):
        slow = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 200, "n": 2}))
        await until(lambda: len(engine.added) == 1, "the request is running in the engine")
        await drain(app, timeout=0.1)
        r = await slow
        body = await r.json()
        assert [c["finish_reason"] for c in body["choices"]] == ["abort", "abort"]
        assert (await client.get("/ready")).status == 503
        assert (await post(client, "/v1/completions", {"prompt": "Hi"})).status == 503
        assert (await client.get("/health")).status == 200
    run_http(tok, scenario, engine=FakeEngine(tok, step_s=0.01))


def test_health_is_503_with_retry_after_once_the_engine_is_dead(tok):
    """Issue #14: liveness follows the engine, so a supervisor and a load balancer see a death."""
    async def scenario(client, engine, app):
        assert (await client.get("/health")).status == 200
        engine.dead_reason = "a worker process disconnected"
        r = await client.get("/health")
        assert r.status == 503 and r.headers["Retry-After"] == "5"
        assert "a worker process disconnected" in (await r.json())["error"]["message"]
        r = await post(client, "/v1/completions", {"prompt": "Hi"})
        assert r.status == 503 and r.headers["Retry-After"] == "5"
        assert (await r.json())["error"]["code"] == "not_ready"
        r = await client.get("/ready")
        assert r.status == 503 and r.headers["Retry-After"] == "5"
        engine.dead_reason = None          # the restarted engine answers again
        assert (await client.get("/health")).status == 200
    run_http(tok, scenario)


@pytest.mark.parametrize("message", [{"role": {}}, {"role": ["user"]}, {"role": "user", "content": "x", "name": {}},
                                     {"role": "tool", "content": "x", "tool_call_id": 7},
                                     {"role": "assistant", "content": None, "tool_calls": "call"}])
def test_malformed_chat_messages_are_400s_not_500s(message):
    """Found by the schemathesis run (tests/test_api_fuzz.py): an unhashable role was a TypeError (500)."""
    from router.api_error import APIError
    from router.chat_messages import parse_messages
    with pytest.raises(APIError) as e:
        parse_messages([message])
    assert e.value.status == 400 and e.value.param == "messages"
