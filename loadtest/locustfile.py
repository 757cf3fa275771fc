"""Locust load test for a running pagedserve server: streaming /v1/completions and /v1/chat/completions.

    locust -f loadtest/locustfile.py --headless -u 16 -r 4 -t 60s --host http://127.0.0.1:8000

Each simulated user replays the shared benchmark workload (round robin, deterministic), half as raw-token
completions and half as chat, always streaming with usage. Besides locust's own per-request row, it
reports custom metrics through `events.request.fire`, so they show up in locust's tables and CSVs:

  TTFT    <endpoint>   time to the first chunk carrying text, ms
  ITL     <endpoint>   every gap between consecutive text chunks, ms
  TOKENS  <endpoint>   completion tokens per request (the "response time" columns hold token counts)
  429     <endpoint>   requests the server shed with 429 (counted apart: not failures, not in latency rows)

A request fails if the stream is malformed: chunk ids that differ, a choice with no or several
finish_reasons, no `data: [DONE]` at the end, or data after it, or no usage chunk.

The soak's client mix is loadtest/soak_locustfile.py, built on this file's `_Client`.

Environment: LOADTEST_WORKLOAD (path; default the shared workload, else the packaged soak_workload.jsonl), LOADTEST_MAX_TOKENS (cap max_tokens),
LOADTEST_IGNORE_EOS (default 1: produce exactly max_tokens), LOADTEST_MODEL (model name to send),
LOADTEST_API_KEY (bearer token), LOADTEST_ENDPOINTS (comma list: completions,chat).
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from locust import User, between, events, task  # first: locust monkey-patches the socket and ssl modules

import requests  # noqa: I001

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # `locust -f` does not put the repo on the path
from loadtest.workload import PACKAGED_WORKLOAD, default_workload_path, load_workload  # noqa: E402

_cap = os.environ.get("LOADTEST_MAX_TOKENS")
_path = os.environ.get("LOADTEST_WORKLOAD") or (default_workload_path() if default_workload_path().exists()
                                                 else PACKAGED_WORKLOAD)
WORKLOAD = load_workload(_path, max_tokens_cap=int(_cap) if _cap else None)
IGNORE_EOS = os.environ.get("LOADTEST_IGNORE_EOS", "1") not in ("0", "false", "no")
MODEL = os.environ.get("LOADTEST_MODEL")
API_KEY = os.environ.get("LOADTEST_API_KEY")
ENDPOINTS = set((os.environ.get("LOADTEST_ENDPOINTS") or "completions,chat").split(","))
_next = itertools.count()   # gevent runs users in one thread: a plain counter is enough


class StreamShapeError(Exception):
    pass


class _Client(User):
    """What both users share: a requests session (with the API key) and the checked, timed stream."""
    abstract = True
    wait_time = between(0, 0.1)

    def on_start(self) -> None:
        self.session = requests.Session()
        if API_KEY:
            self.session.headers["Authorization"] = f"Bearer {API_KEY}"

    backoff_on_429 = False     # sleep for the 429's Retry-After, as the OpenAI SDK does, before the next request

    def on_stop(self) -> None:
        self.session.close()

    def shed(self, path: str, t0: float, retry_after: str | None) -> None:
        """A request shed with 429: counted apart (not a failure, not latency), then the back-off if any."""
        fire("429", path, (time.perf_counter() - t0) * 1e3, 0)
        if self.backoff_on_429:
            time.sleep(float(retry_after or 1))    # gevent's sleep: only this user waits

    def _stream(self, path: str, body: dict[str, Any], max_tokens: int) -> None:
        body = {**body, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if IGNORE_EOS:
            body["ignore_eos"] = True
        if MODEL:
            body["model"] = MODEL
        name = path
        t0 = time.perf_counter()
        nbytes = 0
        exc: Exception | None = None
        stats: StreamStats | None = None
        try:
            with self.session.post(self.host + path, json=body, stream=True, timeout=600) as resp:
                if resp.status_code == 429:
                    self.shed(name, t0, resp.headers.get("Retry-After"))
                    return
                if resp.status_code != 200:
                    raise StreamShapeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                stats = StreamStats(chat=path.endswith("chat/completions"))
                # chunk_size=None: hand over each HTTP chunk as it arrives, not after 512 bytes
                for line in resp.iter_lines(chunk_size=None):
                    nbytes += len(line) + 1
                    stats.feed(line, time.perf_counter())
                stats.finish()
                if IGNORE_EOS and stats.completion_tokens != max_tokens:
                    raise StreamShapeError(f"usage.completion_tokens {stats.completion_tokens} != max_tokens "
                                           f"{max_tokens} with ignore_eos")
        except Exception as e:   # noqa: BLE001 - every failure is reported to locust, none kills the user
            exc = e
        total_ms = (time.perf_counter() - t0) * 1e3
        fire("POST", name, total_ms, nbytes, exc)
        if exc is None and stats is not None:
            if stats.times:
                fire("TTFT", name, (stats.times[0] - t0) * 1e3, 0)
                for a, b in zip(stats.times, stats.times[1:]):
                    fire("ITL", name, (b - a) * 1e3, 0)
            fire("TOKENS", name, stats.completion_tokens or 0, stats.completion_tokens or 0)


class StreamingUser(_Client):
    """A client that streams and times every chunk itself (so it owns the events it reports)."""

    @task
    def completion(self) -> None:
        if "completions" in ENDPOINTS:
            r = WORKLOAD[next(_next) % len(WORKLOAD)]
            self._stream("/v1/completions", {"prompt": r.prompt_token_ids}, r.max_tokens)

    @task
    def chat(self) -> None:
        if "chat" in ENDPOINTS:
            r = WORKLOAD[next(_next) % len(WORKLOAD)]
            self._stream("/v1/chat/completions", {"messages": r.messages}, r.max_tokens)


def fire(request_type: str, name: str, response_time: float, length: int, exc: Exception | None = None) -> None:
    events.request.fire(request_type=request_type, name=name, response_time=response_time,
                        response_length=length, exception=exc, context={})


class StreamStats:
    """Parses an SSE stream line by line and checks its shape as it goes."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.times: list[float] = []     # arrival of each chunk that carries text
        self.ids: set[str] = set()
        self.finishes: dict[int, int] = {}
        self.seen: set[int] = set()
        self.done = False
        self.completion_tokens: int | None = None

    def feed(self, line: bytes, now: float) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if self.done:
            raise StreamShapeError("data after [DONE]")
        if data == b"[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise StreamShapeError(f"error event: {chunk['error']}")
        self.ids.add(chunk.get("id"))
        if chunk.get("usage"):
            self.completion_tokens = chunk["usage"].get("completion_tokens")
        has_text = False
        for ch in chunk.get("choices") or []:
            i = ch.get("index", 0)
            self.seen.add(i)
            text = (ch.get("delta") or {}).get("content") if self.chat else ch.get("text")
            has_text = has_text or bool(text)
            if ch.get("finish_reason") is not None:
                self.finishes[i] = self.finishes.get(i, 0) + 1
        if has_text:
            self.times.append(now)

    def finish(self) -> None:
        if not self.done:
            raise StreamShapeError("the stream did not end with data: [DONE]")
        if len(self.ids) != 1:
            raise StreamShapeError(f"{len(self.ids)} different ids across chunks")
        bad = [i for i in self.seen if self.finishes.get(i, 0) != 1]
        if bad or not self.seen:
            raise StreamShapeError(f"choices {bad or 'none'} did not get exactly one finish_reason")
        if self.completion_tokens is None:
            raise StreamShapeError("no usage chunk although include_usage was asked")
