"""End-to-end tests of `pagedserve serve` over real HTTP: the OpenAI SDK, raw SSE shapes, the bad-input
matrix, back-pressure (429), an abort storm, two router replicas, a killed worker and a graceful SIGTERM.

Three servers are started once for the module (starting one costs tens of seconds on a small machine):
  * `default_server`: the default model (SmolLM2) with a small max_model_len, a small body limit and an API
    key; tests that look at real text (detokenization, stop strings, prefix caching) run here.
  * `queue_server`: the tiny random-weight model with one running and one waiting slot; the 429 test.
  * `replica_server`: the tiny model behind two router replicas; the abort storm and 64 concurrent streams.
The two tests that stop or break a server get one of their own, configured as above (`draining_server`
for SIGTERM, `doomed_replica_server` for kill -9), so no test depends on which others ran before it.
Every test sets up the state it checks (requests it sends itself), so each one passes when run alone.
Waiting is always for a condition, polled until a deadline (`wait_until`), never a fixed sleep.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from common.protocol import HEARTBEAT_S
from tests.server_utils import Server, async_wait_until, run_server, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

API_KEY = "sk-e2e-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
MAX_BODY_BYTES = 64 * 1024
# One torch thread per worker: with two cores shared by the worker, the scheduler, the routers and this test
# process (and whatever else runs), a second OpenMP thread makes every step wait on a descheduled peer.
SMALL_KV = ("--kv-cache-memory", "0.2", "--swap-space", "0.05", "--num-threads", "1")
METRIC_NAMES = ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
                "prompt_tokens_total", "generation_tokens_total", "request_success_total",
                "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                "admission_rejections_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
                "e2e_request_latency_seconds", "request_queue_time_seconds")


# ---- servers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="module")
def default_server(log_dir):
    with run_server(*SMALL_KV, "--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes", str(MAX_BODY_BYTES),
                    log_dir=log_dir, api_key=API_KEY) as s:
        yield s


def run_queue_server(log_dir: Path, tiny_model):
    """The tiny model with one running and one waiting slot."""
    return run_server(str(tiny_model("llama")), *SMALL_KV, "--max-num-seqs", "1", "--max-waiting-requests", "1",
                      "--shutdown-timeout", "10", log_dir=log_dir)


@contextmanager
def run_replica_server(log_dir: Path, tiny_model):
    """The tiny model behind two router replicas, both ready."""
    with run_server(str(tiny_model("llama")), *SMALL_KV, "--router-replicas", "2", log_dir=log_dir) as s:
        # /ready answered by one replica says nothing of the other (the kernel spreads connections over
        # both): wait for a run of 20 fresh connections that all find a ready replica
        streak = 0

        def twenty_ready_in_a_row() -> bool:
            nonlocal streak
            streak = streak + 1 if request(s, "GET", "/ready", timeout=5)[0] == 200 else 0
            return streak >= 20
        wait_until(twenty_ready_in_a_row, 60, "the second router replica to become ready", interval=0.02)
        yield s


def tiny_server_fixture(name: str, start, scope: str):
    """A fixture `name` yielding the server `start(log_dir, tiny_model)` runs; scope "function" gives each test
    that asks for it a server of its own."""
    def fixture(log_dir, tiny_model):
        with start(log_dir, tiny_model) as s:
            yield s
    return pytest.fixture(fixture, scope=scope, name=name)


queue_server = tiny_server_fixture("queue_server", run_queue_server, "module")
replica_server = tiny_server_fixture("replica_server", run_replica_server, "module")
# The SIGTERM test stops its server and the kill -9 test breaks its: each gets one of its own.
draining_server = tiny_server_fixture("draining_server", run_queue_server, "function")
doomed_replica_server = tiny_server_fixture("doomed_replica_server", run_replica_server, "function")


@pytest.fixture(scope="module")
def model_name(default_server) -> str:
    status, _, body = request(default_server, "GET", "/v1/models", headers=AUTH)
    assert status == 200, body
    return json.loads(body)["data"][0]["id"]


@pytest.fixture(scope="module")
def sdk(default_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=180)


# ---- plain HTTP helpers ----------------------------------------------------------------------------
def request(server: Server, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
            headers: dict[str, str] | None = None, content_type: str | None = "application/json",
            timeout: float = 180) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request over http.client; returns (status, headers, the whole body as bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = dict(headers or {})
        if data is not None and content_type is not None:
            hdrs["Content-Type"] = content_type
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def post_json(server: Server, path: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, _, data = request(server, "POST", path, body, headers=headers)
    return status, json.loads(data)


def parse_sse(raw: bytes) -> list[dict]:
    """Every event of a finished stream, checking the framing: `data: <json>\\n\\n` events, then exactly one
    `data: [DONE]` at the very end."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    out = []
    for ev in events[:-2]:
        assert ev.startswith(b"data: "), ev[:200]
        assert ev[6:] != b"[DONE]"
        out.append(json.loads(ev[6:]))
    return out


def assert_error(status: int, body: Any, expected_status: int, param: str | None = None) -> dict:
    assert status == expected_status, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for every sample line."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric(samples: dict[str, float], name: str) -> float:
    """The sum over all label sets of one metric."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def scrape(server: Server, headers: dict[str, str] | None = None) -> dict[str, float]:
    status, _, body = request(server, "GET", "/metrics", headers=headers, timeout=10)
    assert status == 200
    return metric_samples(body.decode())


def wait_idle(server: Server, headers: dict[str, str] | None = None, timeout: float = 15.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds KV blocks. The gauges are the scheduler's last
    heartbeat (every 0.5 s), so one idle scrape may predate the work just sent: idle must hold for three
    heartbeats."""
    idle_since: float | None = None
    m: dict[str, float] = {}

    def idle_for_three_heartbeats() -> dict[str, float] | None:
        nonlocal idle_since, m
        m = scrape(server, headers)
        idle = all(metric(m, "pagedserve:" + g) == 0 for g in ("num_requests_running", "num_requests_waiting",
                                                               "num_requests_swapped", "kv_cache_usage_perc"))
        now = time.monotonic()
        if not idle:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= 3 * HEARTBEAT_S:
            return m
        return None
    return wait_until(idle_for_three_heartbeats, timeout, lambda: "the server to be idle: " + str(
        {k: v for k, v in m.items() if "num_requests" in k or "kv_cache" in k}), interval=0.1)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_all_exit(pids: list[int], timeout: float = 5.0) -> None:
    """Every one of `pids` (serve's children, after serve itself exited) is gone within `timeout`."""
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout,
               lambda: f"processes left after serve exited: {[p for p in pids if pid_alive(p)]}", interval=0.1)


def terminate_and_check(server: Server, timeout: float = 60.0) -> int:
    """SIGTERM the supervisor as a user would, and check that it exits and leaves no child behind."""
    children = server.children()
    assert children, "serve has no children"
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(timeout)
    assert_all_exit(children)
    return rc


def healthy_generation(server: Server, headers: dict[str, str] | None = None, max_tokens: int = 2) -> None:
    status, body = post_json(server, "/v1/completions", {"prompt": "Hello there", "max_tokens": max_tokens,
                                                         "temperature": 0}, headers)
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


# ---- 1. the official OpenAI SDK ------------------------------------------------------------------
def _collect_completion_stream(stream) -> tuple[dict[int, str], dict[int, str], dict[int, list]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    tokens: dict[int, list] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
            if c.finish_reason is not None:
                assert c.index not in reasons
                reasons[c.index] = c.finish_reason
    return texts, reasons, tokens


@pytest.mark.timeout(420)
def test_sdk_completions(sdk, model_name):
    args = dict(model=model_name, prompt="The capital of France is", max_tokens=8, n=2, logprobs=2, stop=["."])
    full = sdk.completions.create(**args, temperature=0)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert sorted(c.index for c in full.choices) == [0, 1]
    for c in full.choices:
        assert "." not in c.text
        assert c.finish_reason in ("stop", "length")
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)      # 2 asked + the sampled one
        assert lp.text_offset == sorted(lp.text_offset)
    assert full.choices[0].text == full.choices[1].text            # greedy: both choices agree
    # greedy " Paris." stops on "."
    assert full.choices[0].finish_reason == "stop" and full.choices[0].text.strip() == "Paris", full.choices[0]
    assert full.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in full.choices)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    texts, reasons, tokens = _collect_completion_stream(sdk.completions.create(**args, temperature=0, stream=True))
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == {c.index: c.finish_reason for c in full.choices}
    assert tokens == {c.index: c.logprobs.tokens for c in full.choices}

    seeded = dict(model=model_name, prompt="Once upon a time", max_tokens=8, n=2, temperature=1.0, seed=1234)
    a = sdk.completions.create(**seeded)
    b = sdk.completions.create(**seeded)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    texts, _, _ = _collect_completion_stream(sdk.completions.create(**seeded, stream=True))
    assert texts == {c.index: c.text for c in a.choices}


@pytest.mark.timeout(300)
def test_sdk_chat(sdk, model_name):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    args = dict(model=model_name, messages=messages, max_tokens=8, n=2, logprobs=True, top_logprobs=2,
                stop=["France"])
    full = sdk.chat.completions.create(**args, temperature=0)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert sorted(c.index for c in full.choices) == [0, 1]
    for c in full.choices:
        assert c.message.role == "assistant"
        assert "France" not in c.message.content
        assert c.finish_reason in ("stop", "length")
        content = c.logprobs.content
        assert content and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
        assert all(bytes(e.bytes) == e.token.encode() for e in content)
    assert full.choices[0].message.content == full.choices[1].message.content
    assert full.choices[0].finish_reason == "stop", full.choices[0]   # greedy: "The capital of France ..."
    assert full.usage.completion_tokens == sum(len(c.logprobs.content) for c in full.choices)

    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    roles: dict[int, str] = {}
    ntok: dict[int, int] = {}
    for chunk in sdk.chat.completions.create(**args, temperature=0, stream=True):
        assert chunk.object == "chat.completion.chunk" and chunk.id.startswith("chatcmpl-")
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.logprobs is not None and c.logprobs.content:
                ntok[c.index] = ntok.get(c.index, 0) + len(c.logprobs.content)
            if c.finish_reason is not None:
                assert c.index not in reasons
                reasons[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {c.index: c.message.content for c in full.choices}
    assert reasons == {c.index: c.finish_reason for c in full.choices}
    assert ntok == {c.index: len(c.logprobs.content) for c in full.choices}

    seeded = dict(model=model_name, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8,
                  n=2, temperature=1.0, seed=99)
    a = sdk.chat.completions.create(**seeded)
    b = sdk.chat.completions.create(**seeded)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_sdk_errors_are_typed(sdk, model_name):
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="no-such-model", prompt="Hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], temperature=3)
    assert e.value.status_code == 400 and e.value.response.json()["error"]["param"] == "temperature"
    bad_key = openai.OpenAI(base_url=sdk.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    assert [m.id for m in sdk.models.list()] == [model_name]


# ---- 2. raw SSE chunk shapes -----------------------------------------------------------------------
def _check_stream(events: list[dict], obj: str, n: int, chat: bool) -> tuple[dict, dict[int, int]]:
    """Shared shape checks; returns the usage chunk's usage and the token count seen per choice."""
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] is not None, last
    ids = {e["id"] for e in events}
    created = {e["created"] for e in events}
    assert len(ids) == 1 and len(created) == 1, (ids, created)
    finished: dict[int, str] = {}
    seen_first: set[int] = set()
    ntok = {i: 0 for i in range(n)}
    for e in chunks:
        assert e["object"] == obj and "usage" in e and e["usage"] is None, e
        assert len(e["choices"]) >= 1
        for c in e["choices"]:
            i = c["index"]
            assert 0 <= i < n and i not in finished, (i, finished)
            if chat:
                if i not in seen_first:
                    assert c["delta"].get("role") == "assistant", c   # the first delta carries the role
                    seen_first.add(i)
                else:
                    assert "role" not in c["delta"], c
                if c["logprobs"] is not None:
                    ntok[i] += len(c["logprobs"]["content"])
            elif c["logprobs"] is not None:
                ntok[i] += len(c["logprobs"]["tokens"])
            if c["finish_reason"] is not None:
                finished[i] = c["finish_reason"]
    assert set(finished) == set(range(n)), finished
    return last["usage"], ntok


def test_raw_sse_chat_shapes(default_server, default_tokenizer):
    messages = [{"role": "user", "content": "Name three colors."}]
    body = {"messages": messages, "max_tokens": 6, "n": 2, "temperature": 0.8, "seed": 7, "logprobs": True,
            "stream": True, "stream_options": {"include_usage": True}}
    status, headers, raw = request(default_server, "POST", "/v1/chat/completions", body, headers=AUTH)
    assert status == 200, raw
    assert headers["content-type"].startswith("text/event-stream")
    events = parse_sse(raw)
    usage, ntok = _check_stream(events, "chat.completion.chunk", 2, chat=True)
    prompt_len = len(default_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                           return_dict=False))
    assert usage["prompt_tokens"] == prompt_len
    assert usage["completion_tokens"] == sum(ntok.values()) and all(1 <= v <= 6 for v in ntok.values())
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_raw_sse_completion_shapes(default_server, default_tokenizer):
    prompt = "List: apples, pears,"
    body = {"prompt": prompt, "max_tokens": 5, "n": 2, "temperature": 0.8, "seed": 3, "logprobs": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    status, _, raw = request(default_server, "POST", "/v1/completions", body, headers=AUTH)
    assert status == 200, raw
    events = parse_sse(raw)
    usage, ntok = _check_stream(events, "text_completion", 2, chat=False)
    assert usage["prompt_tokens"] == len(default_tokenizer.encode(prompt))
    assert usage["completion_tokens"] == sum(ntok.values())

    # without stream_options there is no usage chunk and no usage field
    status, _, raw = request(default_server, "POST", "/v1/completions",
                             {"prompt": prompt, "max_tokens": 3, "stream": True}, headers=AUTH)
    assert status == 200
    events = parse_sse(raw)
    assert events and all(e["choices"] and "usage" not in e for e in events)
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]


# ---- 3. the bad-input matrix -----------------------------------------------------------------------
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]
BAD_INPUTS = [
    # (id, path, body or raw bytes, content type, status, param)
    ("bad-json", CMPL, b'{"prompt": "Hi",', "application/json", 400, None),
    ("non-object", CMPL, b'["Hi"]', "application/json", 400, None),
    ("non-object-chat", CHAT, b'"Hi"', "application/json", 400, None),
    ("wrong-content-type", CMPL, b'{"prompt": "Hi"}', "text/plain", 400, None),
    ("max-tokens-0", CMPL, {"prompt": "Hi", "max_tokens": 0}, None, 400, "max_tokens"),
    ("max-tokens-0-chat", CHAT, {"messages": MSGS, "max_tokens": 0}, None, 400, "max_tokens"),
    ("temperature-3", CMPL, {"prompt": "Hi", "temperature": 3}, None, 400, "temperature"),
    ("top-p-0", CMPL, {"prompt": "Hi", "top_p": 0}, None, 400, "top_p"),
    ("top-p-1.5", CHAT, {"messages": MSGS, "top_p": 1.5}, None, 400, "top_p"),
    ("presence-penalty-5", CMPL, {"prompt": "Hi", "presence_penalty": 5}, None, 400, "presence_penalty"),
    ("top-logprobs-50", CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 50}, None, 400, "top_logprobs"),
    ("logprobs-50", CMPL, {"prompt": "Hi", "logprobs": 50}, None, 400, "logprobs"),
    ("n-above-cap", CMPL, {"prompt": "Hi", "n": 17}, None, 400, "n"),
    ("too-many-stops", CMPL, {"prompt": "Hi", "stop": [f"s{i}" for i in range(17)]}, None, 400, "stop"),
    ("too-long-stop", CHAT, {"messages": MSGS, "stop": "x" * 257}, None, 400, "stop"),
    ("seed-2**64", CMPL, b'{"prompt": "Hi", "seed": 18446744073709551616}', "application/json", 400, "seed"),
    ("empty-prompt", CMPL, {"prompt": ""}, None, 400, "prompt"),
    ("empty-messages", CHAT, {"messages": []}, None, 400, "messages"),
    ("token-id-out-of-vocab", CMPL, {"prompt": [1, 2, 10**7]}, None, 400, "prompt"),
    ("negative-token-id", CMPL, {"prompt": [-1]}, None, 400, "prompt"),
    ("stream-options-without-stream", CMPL, {"prompt": "Hi", "stream_options": {"include_usage": True}}, None, 400,
     "stream_options"),
    ("unknown-model", CMPL, {"prompt": "Hi", "model": "gpt-9"}, None, 404, "model"),
    ("unknown-model-chat", CHAT, {"messages": MSGS, "model": "gpt-9"}, None, 404, "model"),
    ("body-too-large", CMPL, {"prompt": "x" * (MAX_BODY_BYTES + 1000)}, None, 413, None),
]


def check_bad_input(server: Server, case: tuple) -> None:
    """Send one BAD_INPUTS case and check that it is refused with its status and a typed error."""
    _, path, body, ctype, expected, param = case
    if isinstance(body, bytes):
        status, _, data = request(server, "POST", path, raw=body, content_type=ctype, headers=AUTH)
    else:
        status, _, data = request(server, "POST", path, body, headers=AUTH)
    assert status != 500
    assert_error(status, json.loads(data), expected, param)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(default_server, case):
    check_bad_input(default_server, case)


def test_prompt_over_max_model_len_names_both_numbers(default_server):
    n = MAX_MODEL_LEN + 44
    status, body = post_json(default_server, CMPL, {"prompt": [42] * n, "max_tokens": 1}, AUTH)
    msg = assert_error(status, body, 400, "prompt")["message"]
    assert str(MAX_MODEL_LEN) in msg and str(n) in msg, msg

    text = "hello " * (MAX_MODEL_LEN + 10)
    status, body = post_json(default_server, CHAT, {"messages": [{"role": "user", "content": text}]}, AUTH)
    msg = assert_error(status, body, 400, "messages")["message"]
    assert str(MAX_MODEL_LEN) in msg and re.search(r"\d{3,}", msg.replace(str(MAX_MODEL_LEN), "")), msg


def test_prompt_plus_max_tokens_over_max_model_len_names_both_numbers(default_server):
    prompt_len, max_tokens = 200, 100
    status, body = post_json(default_server, CMPL, {"prompt": [42] * prompt_len, "max_tokens": max_tokens}, AUTH)
    msg = assert_error(status, body, 400, "max_tokens")["message"]
    assert str(MAX_MODEL_LEN) in msg and str(prompt_len + max_tokens) in msg, msg
    assert str(prompt_len) in msg and str(max_tokens) in msg, msg


def test_api_key(default_server):
    """The key guards /v1/*, as vLLM's does; health, metrics and tokenize stay open."""
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path, body in (("POST", CMPL, {"prompt": "Hi", "max_tokens": 1}), ("GET", "/v1/models", None)):
            status, hdrs, data = request(default_server, method, path, body, headers=headers)
            assert_error(status, json.loads(data), 401)
            assert hdrs.get("www-authenticate") == "Bearer"
    status, _, data = request(default_server, "GET", "/health")
    assert status == 200 and json.loads(data)["status"] == "ok"
    assert request(default_server, "GET", "/metrics")[0] == 200
    healthy_generation(default_server, AUTH)


def test_server_healthy_after_bad_inputs(default_server):
    for case in BAD_INPUTS:      # the whole matrix, here, whether or not test_bad_input ran before
        check_bad_input(default_server, case)
    status, _, data = request(default_server, "GET", "/ready", headers=AUTH)
    assert status == 200, data
    healthy_generation(default_server, AUTH)
    assert "Traceback" not in default_server.log()


# ---- 9. models, health, version, metrics, prefix caching ---------------------------------------------
def test_models_health_version(default_server, model_name):
    status, _, data = request(default_server, "GET", "/v1/models", headers=AUTH)
    assert status == 200
    body = json.loads(data)
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert card["id"] == model_name == "SmolLM2-135M-Instruct"
    assert card["object"] == "model" and card["root"] and card["max_model_len"] == MAX_MODEL_LEN
    status, _, data = request(default_server, "GET", "/version", headers=AUTH)
    assert status == 200 and isinstance(json.loads(data)["version"], str)
    status, _, _ = request(default_server, "GET", "/health")
    assert status == 200


def test_prefix_cache_hits_are_reported(default_server, default_tokenizer):
    prompt = ("The quick brown fox jumps over the lazy dog while the farmer counts his sheep in the field; "
              "the sun sets slowly behind the hills and the wind carries the smell of rain across the valley. ") * 2
    n_prompt = len(default_tokenizer.encode(prompt))
    assert n_prompt >= 3 * 16
    before = scrape(default_server, AUTH)
    first_status, first = post_json(default_server, CMPL, {"prompt": prompt, "max_tokens": 1}, AUTH)
    second_status, second = post_json(default_server, CMPL, {"prompt": prompt, "max_tokens": 1}, AUTH)
    assert first_status == second_status == 200
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == n_prompt
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 3 * 16 <= cached < n_prompt and cached % 16 == 0, second["usage"]
    hits = 0.0

    def hits_counted() -> bool:      # the counters come with the scheduler's next heartbeat
        nonlocal hits
        hits = (metric(scrape(default_server, AUTH), "pagedserve:prefix_cache_hits_total")
                - metric(before, "pagedserve:prefix_cache_hits_total"))
        return hits >= cached
    wait_until(hits_counted, 5, lambda: f"prefix_cache_hits_total to grow by {cached}, not {hits}", interval=0.2)


def test_metrics_names(default_server):
    # a request of its own that finishes by length, so that every series below has samples
    status, body = post_json(default_server, CMPL, {"prompt": "Count: one, two,", "max_tokens": 2,
                                                    "ignore_eos": True, "temperature": 0}, AUTH)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    samples: dict[str, float] = {}

    def engine_counters_arrived() -> bool:   # the token counters come with the scheduler's next heartbeat
        nonlocal samples
        status, headers, data = request(default_server, "GET", "/metrics", headers=AUTH)
        assert status == 200 and headers["content-type"].startswith("text/plain")
        samples = metric_samples(data.decode())
        return (metric(samples, "pagedserve:generation_tokens_total") > 0
                and metric(samples, "pagedserve:prompt_tokens_total") > 0)
    wait_until(engine_counters_arrived, 5, "generation_tokens_total and prompt_tokens_total above 0")
    for name in METRIC_NAMES:
        full = "pagedserve:" + name
        assert any(re.match(re.escape(full) + r"(_bucket|_sum|_count)?\{", k) for k in samples), full
    assert metric(samples, "pagedserve:generation_tokens_total") > 0
    assert metric(samples, "pagedserve:prompt_tokens_total") > 0
    assert samples.get('pagedserve:request_success_total{finished_reason="length",model_name="SmolLM2-135M-Instruct"}',
                       0) > 0
    assert metric(samples, "pagedserve:time_to_first_token_seconds_count") > 0
    assert metric(samples, "pagedserve:e2e_request_latency_seconds_count") > 0


# ---- 10. detokenization and stop strings over HTTP -------------------------------------------------
ZH_PROMPT = ("Repeat after me.\nInput: 你好🙂世界\nOutput: 你好🙂世界\nInput: 我喜欢🍎苹果\nOutput: 我喜欢🍎苹果\n"
             "Input: 谢谢🎉朋友\nOutput:")


def _stream_text(server: Server, path: str, body: dict) -> tuple[str, list[str], str]:
    status, _, raw = request(server, "POST", path, {**body, "stream": True}, headers=AUTH)
    assert status == 200, raw
    deltas, reasons = [], []
    for e in parse_sse(raw):
        for c in e["choices"]:
            deltas.append(c["text"] if "text" in c else c["delta"].get("content", ""))
            if c["finish_reason"]:
                reasons.append(c["finish_reason"])
    assert len(reasons) == 1
    return "".join(deltas), deltas, reasons[0]


@pytest.mark.parametrize("prompt,max_tokens", [(ZH_PROMPT, 16), ("🙂🙂🙂 你好 🙂🙂🙂 你好 🙂🙂🙂 你好", 16)],
                         ids=["chinese-emoji", "ends-mid-character"])
def test_multibyte_stream_equals_full_text(default_server, prompt, max_tokens):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    status, full = post_json(default_server, CMPL, body, AUTH)
    assert status == 200, full
    text = full["choices"][0]["text"]
    streamed, deltas, reason = _stream_text(default_server, CMPL, body)
    assert streamed == text, (deltas, text)
    assert reason == full["choices"][0]["finish_reason"]
    assert not any("\ufffd" in d for d in deltas[:-1]), deltas       # no half characters mid-stream
    if prompt == ZH_PROMPT:
        assert re.search(r"[\u4e00-\u9fff]", text) and re.search(r"[\U0001F300-\U0001FAFF]", text), text


def _straddling_stop(tokens: list[str], text: str) -> str:
    """A stop string from the middle of one output token to the middle of the token two further on."""
    while tokens and not text.startswith("".join(tokens)):   # e.g. chat logprobs list the final <|im_end|>
        tokens = tokens[:-1]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    k = next(i for i in range(1, len(tokens) - 2) if len(tokens[i]) >= 2 and len(tokens[i + 2]) >= 2)
    return text[offsets[k] + len(tokens[k]) // 2: offsets[k + 2] + (len(tokens[k + 2]) + 1) // 2]


@pytest.mark.parametrize("path", [CMPL, CHAT], ids=["completions", "chat"])
def test_multi_token_stop_string_never_leaks(default_server, default_tokenizer, path):
    base = ({"prompt": "The capital of France is"} if path == CMPL
            else {"messages": [{"role": "user", "content": "What is the capital of France?"}]})
    base = {**base, "max_tokens": 16, "temperature": 0}
    status, full = post_json(default_server, path, {**base, **({"logprobs": 0} if path == CMPL else
                                                                 {"logprobs": True})}, AUTH)
    assert status == 200, full
    c = full["choices"][0]
    if path == CMPL:
        text, tokens = c["text"], c["logprobs"]["tokens"]
    else:
        text, tokens = c["message"]["content"], [e["token"] for e in c["logprobs"]["content"]]
    stop = _straddling_stop(tokens, text)
    assert len(default_tokenizer.encode(stop)) >= 2, stop
    expected = text[:text.index(stop)]

    status, resp = post_json(default_server, path, {**base, "stop": [stop]}, AUTH)
    assert status == 200, resp
    c = resp["choices"][0]
    out = c["text"] if path == CMPL else c["message"]["content"]
    assert out == expected and c["finish_reason"] == "stop", (out, expected, stop)
    streamed, deltas, reason = _stream_text(default_server, path, {**base, "stop": [stop]})
    assert streamed == expected and reason == "stop", (deltas, expected, stop)
    # no delta ever showed the beginning of the stop string past the expected text
    assert all(not d or expected.startswith("".join(deltas[:i + 1])) for i, d in enumerate(deltas)), deltas


# ---- 4. back-pressure: 429 with Retry-After ------------------------------------------------------------
async def _flood(url: str, n: int) -> list[tuple[int, dict, Any]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def one(i: int):
            async with session.post(f"{url}/v1/completions", json={"prompt": f"Request {i}", "max_tokens": 16,
                                                                   "temperature": 0}) as r:
                return r.status, dict(r.headers), await r.json()
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_429_when_the_queue_is_full(queue_server):
    results = asyncio.run(_flood(queue_server.url, 24))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
    for status, headers, body in results:
        if status == 429:
            assert headers.get("Retry-After", "").isdigit(), headers
            err = assert_error(status, body, 429)
            assert err["type"] == "rate_limit_error"
        else:
            assert body["choices"][0]["finish_reason"] in ("length", "stop")
    # the scheduler's counters arrive with its next heartbeat
    wait_until(lambda: metric(scrape(queue_server), "pagedserve:admission_rejections_total")
               >= statuses.count(429), 5, "admission_rejections_total counting the 429s", interval=0.1)
    wait_idle(queue_server)
    healthy_generation(queue_server)


# ---- 8. SIGTERM drains in-flight requests --------------------------------------------------------------
async def _drain_scenario(server: Server, max_tokens: int) -> dict[str, Any]:
    """A streaming request running and a non-streaming one waiting (the server has one slot of each), then
    SIGTERM, then new requests until both have finished."""
    url = server.url
    out: dict[str, Any] = {"new": []}
    body = {"prompt": "Drain me", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def streamed(started: asyncio.Event):
            async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as r:
                chunks = [await r.content.readline()]
                started.set()                # a first token: it is running
                return r.status, b"".join(chunks) + await r.read()

        async def full():
            async with session.post(f"{url}/v1/completions", json=body) as r:
                return r.status, await r.json()

        started = asyncio.Event()
        running = asyncio.create_task(streamed(started))
        await asyncio.wait_for(started.wait(), 30)
        waiting = asyncio.create_task(full())

        async def queued() -> bool:
            assert not waiting.done(), waiting.result()      # it must wait for the slot, not finish or fail
            return metric(await asyncio.to_thread(scrape, server), "pagedserve:num_requests_waiting") >= 1
        await async_wait_until(queued, 10, "the second request waiting in the queue")
        assert not running.done(), "the first request finished before SIGTERM; make it longer"
        server.proc.send_signal(signal.SIGTERM)
        out["sigterm_at"] = time.monotonic()

        async def draining() -> bool:
            """The supervisor polls every 0.2 s before it tells the routers: until then a new request would
            still be admitted (and get a 429, the queue being full). /ready changes nothing on the server."""
            try:
                async with session.get(f"{url}/ready") as r:
                    return r.status == 503
            except aiohttp.ClientConnectionError:
                return True                  # the router no longer accepts connections: past the drain's start
        await async_wait_until(draining, 10, "the router to report draining on /ready after SIGTERM")

        async def both_done_or_a_late_request() -> bool:
            if running.done() and waiting.done():
                return True
            try:
                async with session.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 1}) as r:
                    out["new"].append((r.status, await r.json()))
            except aiohttp.ClientConnectionError:
                out["new"].append(("refused", None))
            return False
        # the drain lets them run for --shutdown-timeout (10 s), then aborts them and gives them 5 s more
        await async_wait_until(both_done_or_a_late_request, 60, "both in-flight requests finishing in the drain",
                               interval=0.1)
        out["done_at"] = time.monotonic()
        out["stream"], out["full"] = running.result(), waiting.result()
    return out


@pytest.mark.timeout(180)
def test_sigterm_drains_in_flight_requests(draining_server):
    wait_idle(draining_server)
    children = draining_server.children()
    max_tokens = 1000      # the tiny model's context is 1024
    out = asyncio.run(_drain_scenario(draining_server, max_tokens))
    past_timeout = out["done_at"] - out["sigterm_at"] > 10
    status, body = out["full"]
    assert status == 200, body
    c = body["choices"][0]
    assert c["finish_reason"] == "length" or (past_timeout and c["finish_reason"] == "abort"), c
    if c["finish_reason"] == "length":
        assert body["usage"]["completion_tokens"] == max_tokens
    status, raw = out["stream"]
    assert status == 200
    events = parse_sse(raw)
    reasons = [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]]
    assert reasons == ["length"] or (past_timeout and reasons == ["abort"]), reasons
    assert out["new"], "no request was sent during the drain"
    for status, body in out["new"]:
        assert status in (503, "refused"), (status, body)
        if status == 503:
            assert_error(status, body, 503)
    assert any(s == 503 for s, _ in out["new"]), out["new"]
    rc = draining_server.proc.wait(60)
    assert rc == 0, draining_server.log_tail()
    assert_all_exit(children)


# ---- 5. abort storm ----------------------------------------------------------------------------------
async def _abort_storm(url: str, n_stream: int, n_full: int) -> dict[str, int]:
    body = {"prompt": "Tell me everything", "max_tokens": 800, "ignore_eos": True, "temperature": 0}
    counts: dict = {"cut": 0, "timed_out": 0, "other": 0, "answers": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        async def cut(i: int):
            resp = await session.post(f"{url}/v1/completions", json={**body, "stream": True, "seed": i},
                                      timeout=aiohttp.ClientTimeout(total=120))
            try:
                assert resp.status == 200, await resp.text()
                got = 0
                while got < 3:                      # a few chunks, then hang up mid-stream
                    line = await resp.content.readline()
                    assert line, "stream ended early"
                    got += line.startswith(b"data: ")
                counts["cut"] += 1
            finally:
                resp.close()

        async def timeout(i: int):
            try:
                async with session.post(f"{url}/v1/completions", json={**body, "seed": i},
                                        timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                    counts["answers"].append((r.status, (await r.read())[:200]))   # what came back, for the message
                counts["other"] += 1
            except asyncio.TimeoutError:
                counts["timed_out"] += 1

        await asyncio.gather(*(cut(i) for i in range(n_stream)), *(timeout(i) for i in range(n_full)))
    return counts


@pytest.mark.timeout(240)
def test_abort_storm_frees_everything(replica_server):
    before = metric(scrape(replica_server), "pagedserve:generation_tokens_total")
    counts = asyncio.run(_abort_storm(replica_server.url, 50, 50))
    answers = counts.pop("answers")
    assert counts == {"cut": 50, "timed_out": 50, "other": 0}, (counts, answers[:5], replica_server.log_tail())
    m = wait_idle(replica_server, timeout=10)      # a few heartbeats, not the 800 tokens' worth of steps
    generated = metric(m, "pagedserve:generation_tokens_total") - before
    assert 0 < generated < 100 * 800 / 2, generated  # the aborted requests stopped early
    assert metric(m, "pagedserve:num_blocks") > 0
    healthy_generation(replica_server, max_tokens=8)
    assert "Traceback" not in replica_server.log()


# ---- 6. two router replicas, 64 concurrent streams ---------------------------------------------------
def _word_tokens(tokenizer, count: int) -> list[tuple[int, str]]:
    """Token ids whose text is a lone lower-case word with a leading space, e.g. ' apple'."""
    out, seen = [], set()
    for tid in range(1000, len(tokenizer)):
        word = tokenizer.decode([tid])
        if re.fullmatch(r" [a-z]{4,9}", word) and word not in seen and tokenizer.encode(word * 2) == [tid, tid]:
            seen.add(word)
            out.append((tid, word))
            if len(out) == count:
                return out
    raise AssertionError("not enough word tokens")


async def _many_streams(url: str, words: list[tuple[int, str]], max_tokens: int) -> list[tuple[int, bytes]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=180)) as session:
        async def one(i: int, tid: int):
            body = {"prompt": f"Stream number {i}:", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "logit_bias": {str(tid): 100}, "stream": True, "stream_options": {"include_usage": True}}
            async with session.post(f"{url}/v1/completions", json=body) as r:
                return r.status, await r.read()
        return await asyncio.gather(*(one(i, tid) for i, (tid, _) in enumerate(words)))


@pytest.mark.timeout(240)
def test_two_replicas_carry_64_streams(replica_server, default_tokenizer):
    assert len(replica_server.children()) == 4      # scheduler, worker, two routers
    words = _word_tokens(default_tokenizer, 64)
    max_tokens = 24
    results = asyncio.run(_many_streams(replica_server.url, words, max_tokens))
    ids = set()
    for (status, raw), (_, word) in zip(results, words):
        assert status == 200, raw
        events = parse_sse(raw)
        *chunks, last = events
        ids.add(events[0]["id"])
        text = "".join(c["text"] for e in chunks for c in e["choices"])
        assert text == word * max_tokens, (word, text)   # its own token only: no other stream's tokens
        reasons = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
        assert reasons == ["length"]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == max_tokens
    assert len(ids) == 64
    wait_idle(replica_server)


# ---- 7. kill -9 on the worker or the scheduler: the engine heals ----------------------------------------
async def _streams_then_kill(url: str, n: int, pid: int) -> tuple[float, list[tuple[int, bytes]]]:
    """Open n endless streams, kill -9 `pid` once all have started; (the kill's time, each stream's result)."""
    body = {"prompt": "Never ending", "max_tokens": 1000, "ignore_eos": True, "temperature": 0, "stream": True}
    started = [asyncio.Event() for _ in range(n)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def one(i: int):
            async with session.post(f"{url}/v1/completions", json={**body, "seed": i}) as r:
                if r.status != 200:
                    started[i].set()
                    return r.status, await r.read()
                chunks = []
                while line := await r.content.readline():
                    chunks.append(line)
                    if line.startswith(b"data: "):
                        started[i].set()
                return r.status, b"".join(chunks)

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        os.kill(pid, signal.SIGKILL)
        return time.monotonic(), await asyncio.gather(*tasks)


def _roles(server: Server) -> dict[str, list[int]]:
    """serve's live children by subcommand: scheduler, worker, router."""
    out: dict[str, list[int]] = {}
    for pid in server.children():
        if pid_alive(pid):
            role = next((r for r in ("scheduler", "worker", "router") if f" {r} " in f" {_cmdline(pid)} "), "?")
            out.setdefault(role, []).append(pid)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", ["worker", "scheduler"])
def test_a_killed_engine_process_is_restarted_and_serves_again(doomed_replica_server, victim):
    """Issue #14: kill -9 of the worker (or the scheduler) under load. Every open stream ends with an error
    event; /health turns 503 (with Retry-After); within 30 s the same client is served again, by one new
    process of each killed kind (no process left over, the routers untouched), and the new engine's KV
    usage returns to 0 after the load."""
    server = doomed_replica_server
    wait_idle(server)
    before = _roles(server)
    assert [len(before.get(r, [])) for r in ("scheduler", "worker", "router")] == [1, 1, 2], before
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    model = sdk.models.list().data[0].id
    assert sdk.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"
    killed_at, results = asyncio.run(_streams_then_kill(server.url, 6, before[victim][0]))
    for status, raw in results:
        if status != 200:
            assert status == 503, (status, raw)
            continue
        last = parse_sse(raw)[-1]
        assert "error" in last and set(last["error"]) == {"message", "type", "param", "code"}, last
        assert "engine failure" in last["error"]["message"], last
    health: list[tuple[int, dict]] = []
    wait_until(lambda: health.append(request(server, "GET", "/health", timeout=5)[:2]) or health[-1][0] == 503,
               30, "/health to report the dead engine", interval=0.05)
    assert health[-1][1].get("retry-after") == "5", health[-1]

    def served() -> bool:
        try:
            return sdk.completions.create(model=model, prompt="Hi again", max_tokens=4).usage.completion_tokens == 4
        except openai.APIStatusError as e:
            assert e.status_code == 503, e      # the engine is restarting: nothing else is acceptable
            return False
    wait_until(served, 30 - (time.monotonic() - killed_at), "the restarted engine to serve", interval=0.2)
    assert time.monotonic() - killed_at < 30
    print(f"\n{victim}: served again {time.monotonic() - killed_at:.1f}s after kill -9")
    after = _roles(server)
    assert after["router"] == before["router"], (before, after)
    assert len(after["scheduler"]) == 1 and len(after["worker"]) == 1, after
    assert before[victim][0] not in after[victim] and not pid_alive(before[victim][0])
    log = server.log()
    assert f"the engine's {victim} process exited with code -9; restarting it" in log, server.log_tail()
    if victim == "worker":       # the scheduler failed the streams and exited 1 for a fresh start
        assert "the engine's scheduler process exited with code 1; restarting it" in log, server.log_tail()
        assert after["scheduler"] != before["scheduler"]
    else:                        # the worker stayed up and found the new scheduler by itself
        assert after["worker"] == before["worker"], (before, after)
        assert "a new scheduler session" in log, server.log_tail()
    for _ in range(2):                               # both replicas reach the new scheduler
        assert sdk.completions.create(model=model, prompt="And again", max_tokens=3).usage.completion_tokens == 3
    wait_idle(server)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""
