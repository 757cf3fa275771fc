"""The soak's locust scenario (issue #14), driven by `python -m loadtest.soak`; alone:

    locust -f loadtest/soak_locustfile.py --headless -u 32 -r 32 -t 600s --host http://127.0.0.1:8000

`SoakUser` mixes streaming and non-streaming requests on both generation routes, cancels 10% mid-stream,
sends 5% malformed bodies (each must be a 400 with an OpenAI error body), and counts 429s apart (not
failures), waiting for their Retry-After before its next request as the OpenAI SDK would. Any 5xx, or any status other than the ones expected, is a failure named "HTTP <status>". The
workload and the other settings are loadtest/locustfile.py's (LOADTEST_WORKLOAD, LOADTEST_MAX_TOKENS, ...).
"""
from __future__ import annotations

import http.client
import itertools
import json
import random
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from locust import task  # first: locust monkey-patches the socket and ssl modules

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # `locust -f` does not put the repo on the path
from loadtest.locustfile import (MODEL, WORKLOAD, StreamShapeError, _Client, _next,  # noqa: E402
                                 fire)


# malformed bodies of the soak: each must be answered 400 with an OpenAI error body
MALFORMED: tuple[bytes, ...] = (b"{not json", b"[]", b'{"prompt": 5}', b'{"messages": [{"role": {}}]}',
                                b'{"prompt": "x", "max_tokens": -1}', b'{"prompt": "x", "n": 1000}',
                                b'{"messages": "hi"}', b'{"prompt": "x", "temperature": "hot"}')


class SoakUser(_Client):
    """The soak's client: 45% non-streaming, 40% streaming, 10% streams cancelled after two text chunks, 5%
    malformed bodies; completions and chat alternate. Every user draws from its own seeded generator."""
    _users = itertools.count()
    backoff_on_429 = True

    def on_start(self) -> None:
        super().on_start()
        self.rng = random.Random(next(self._users))

    @task
    def one(self) -> None:
        r = WORKLOAD[next(_next) % len(WORKLOAD)]
        chat = self.rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body: dict[str, Any] = {"messages": r.messages} if chat else {"prompt": r.prompt_token_ids}
        body.update(max_tokens=r.max_tokens, temperature=0, ignore_eos=True, **({"model": MODEL} if MODEL else {}))
        roll = self.rng.random()
        if roll < 0.05:
            self._expect(path, "MALFORMED", lambda: self.session.post(
                self.host + path, data=self.rng.choice(MALFORMED), headers={"Content-Type": "application/json"},
                timeout=60), 400)
        elif roll < 0.15:
            self._cancelled(path, body)
        elif roll < 0.55:
            self._stream(path, body, r.max_tokens)
        else:
            self._expect(path, "FULL", lambda: self.session.post(self.host + path, json=body, timeout=600), 200,
                         r.max_tokens)

    def _expect(self, path: str, kind: str, send, status: int, tokens: int | None = None) -> None:
        t0 = time.perf_counter()
        exc: Exception | None = None
        try:
            resp = send()
            if resp.status_code == 429:
                self.shed(path, t0, resp.headers.get("Retry-After"))
                return
            if resp.status_code != status:
                raise StreamShapeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            data = resp.json()
            if status == 400 and set(data.get("error", {})) != {"message", "type", "param", "code"}:
                raise StreamShapeError(f"a 400 without an OpenAI error body: {resp.text[:200]}")
            if tokens is not None and data["usage"]["completion_tokens"] != tokens:
                raise StreamShapeError(f"usage.completion_tokens {data['usage']['completion_tokens']} != {tokens}")
        except Exception as e:   # noqa: BLE001 - reported to locust
            exc = e
        fire(kind, path, (time.perf_counter() - t0) * 1e3, 0, exc)

    def _cancelled(self, path: str, body: dict[str, Any]) -> None:
        """Stream on a connection of its own, and hang up after the second chunk with text: the server must
        abort the request and free its blocks (the soak reads its abort count and KV usage after)."""
        t0 = time.perf_counter()
        exc: Exception | None = None
        url = urllib.parse.urlsplit(self.host)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
        try:
            conn.request("POST", path, json.dumps({**body, "stream": True}),
                         {"Content-Type": "application/json", **dict(self.session.headers)})
            resp = conn.getresponse()
            if resp.status == 429:
                self.shed(path, t0, resp.getheader("Retry-After"))
                return
            if resp.status != 200:
                raise StreamShapeError(f"HTTP {resp.status}: {resp.read(200)!r}")
            seen = 0
            while seen < 2 and (line := resp.readline()):
                if line.startswith(b"data: {") and b'"error"' in line:
                    raise StreamShapeError(f"error event: {line[:200]!r}")
                seen += line.startswith(b"data: {")
        except Exception as e:   # noqa: BLE001
            exc = e
        finally:
            conn.close()
        fire("CANCEL", path, (time.perf_counter() - t0) * 1e3, 0, exc)
