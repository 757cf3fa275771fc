"""A streaming OpenAI-completions client that times every chunk, and a closed-loop driver at fixed concurrency.

Timing is taken at chunk arrival in the client, so the HTTP rows include everything a user sees: the
router, the IPC hops, SSE framing and the network stack. Each stream is checked as it is read (one id for
every chunk, one finish_reason per choice, `[DONE]` last, usage.completion_tokens == max_tokens) so that a
fast but wrong server cannot post a good number.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from loadtest.report import RequestTiming, SystemResult
from loadtest.workload import BenchRequest


class StreamError(RuntimeError):
    pass


@dataclass
class StreamResult:
    timing: RequestTiming
    chunks: int = 0
    completion_tokens: int | None = None
    problems: list[str] = field(default_factory=list)


def completion_body(r: BenchRequest) -> dict:
    return {"prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def stream_completion(session: aiohttp.ClientSession, base_url: str, r: BenchRequest) -> StreamResult:
    """POST one streaming completion; one timestamp per content chunk (a chunk carrying a choice)."""
    submitted = time.perf_counter()
    times: list[float] = []
    ids: set[str] = set()
    finishes = 0
    usage = None
    done = False
    chunks = 0
    async with session.post(base_url + "/v1/completions", json=completion_body(r)) as resp:
        if resp.status != 200:
            raise StreamError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            now = time.perf_counter()
            if done:
                raise StreamError("data after [DONE]")
            chunk = json.loads(data)
            if "error" in chunk:
                raise StreamError(f"error in stream: {chunk['error']}")
            chunks += 1
            ids.add(chunk.get("id"))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices") or []:
                if ch.get("finish_reason") is not None:
                    finishes += 1
                    if not ch.get("text"):
                        continue   # a finish-only chunk carries no token
                times.append(now)
    res = StreamResult(RequestTiming(r.id, submitted, times, r.max_tokens), chunks)
    res.completion_tokens = usage.get("completion_tokens") if usage else None
    if not done:
        res.problems.append("no [DONE]")
    if len(ids) != 1:
        res.problems.append(f"{len(ids)} distinct ids across chunks")
    if finishes != 1:
        res.problems.append(f"{finishes} finish_reasons")
    if res.completion_tokens != r.max_tokens:
        res.problems.append(f"usage.completion_tokens {res.completion_tokens} != max_tokens {r.max_tokens}")
    return res


@dataclass
class LoadResult:
    wall_s: float
    results: list[StreamResult]


async def run_closed_loop(base_url: str, reqs: list[BenchRequest], concurrency: int,
                          timeout_s: float = 3600.0, keep_alive: bool = True) -> LoadResult:
    """`concurrency` clients, each sending its next request (in workload order) as soon as its last ends.
    keep_alive=False: a new connection per request (llama-server closes one after a stream, and a reused
    one fails to send)."""
    order = iter(range(len(reqs)))
    out: list[StreamResult | None] = [None] * len(reqs)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_read=timeout_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=not keep_alive)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client() -> None:
            for i in order:   # one shared iterator: every request is taken exactly once, in order
                out[i] = await stream_completion(session, base_url, reqs[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(min(concurrency, len(reqs)))))
        wall = time.perf_counter() - t0
    return LoadResult(wall, [r for r in out if r is not None])


async def http_row(name: str, url: str, reqs: list[BenchRequest], concurrency: int, warmup: BenchRequest,
                   is_pagedserve: bool, server: str, keep_alive: bool = True) -> SystemResult:
    """One benchmark row: a warm-up request, then the workload by `concurrency` closed-loop clients; a
    stream that fails its checks makes the row n/a."""
    async with aiohttp.ClientSession() as s:
        await stream_completion(s, url, warmup)
    load = await run_closed_loop(url, reqs, concurrency, keep_alive=keep_alive)
    res = SystemResult(name, wall_s=load.wall_s, timings=[r.timing for r in load.results],
                       is_pagedserve=is_pagedserve)
    res.notes.append(f"{server}, {concurrency} closed-loop streaming clients, /v1/completions")
    problems = [f"{r.timing.request_id}: {p}" for r in load.results for p in r.problems]
    if problems:
        res.error = f"{len(problems)} stream check failures, first: {problems[0]}"
        return res
    chunks = sum(r.chunks for r in load.results)
    tokens = sum(r.timing.output_tokens for r in load.results)
    stamped = sum(len(r.timing.token_times) for r in load.results)
    if stamped != tokens:
        res.notes.append(f"{stamped} token chunks for {tokens} tokens ({chunks} SSE events): ITL is per chunk")
    return res
