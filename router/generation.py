"""One HTTP request's work on the engine: submit its prompts, merge their output queues, and turn engine
outputs into per-choice deltas.

This is the part both OpenAI APIs share, so it knows nothing about response shapes (router/openai_render.py)
or HTTP (router/app.py): one loop means streaming, aborts, usage and metrics behave identically for
/v1/completions and /v1/chat/completions. Engine-side refusals become `APIError`s here because they happen
before any response byte is sent; failures after that surface as `EngineFailure` for the caller to render.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.output_processor import Choice, ChoiceDelta, RequestTracker
from common.protocol import EngineOutput
from router.engine_client import EngineDead, EngineRejected
from router.metrics import RequestTimer
from router.openai_protocol import APIError, ParsedRequest, PromptInput

if TYPE_CHECKING:                      # the app owns the state; importing it at run time would be a cycle
    from router.app import ServerState

RETRY_AFTER_S = "1"                    # the Retry-After of a 429 (the scheduler's waiting queue is full)


class EngineFailure(Exception):
    """The engine failed the request after it was accepted (e.g. the scheduler died)."""


@dataclass
class SubRequest:
    """One prompt of the HTTP request: one engine request with n choices, numbered from `first_index`."""
    request_id: str
    prompt: PromptInput
    tracker: RequestTracker
    timer: RequestTimer
    first_index: int
    queue: asyncio.Queue[EngineOutput] | None = None


@dataclass
class ChoiceStream:
    """Streaming bookkeeping of one choice."""
    started: bool = False       # completions: the echoed prompt has gone out
    text_offset: int = 0        # completions logprobs: where the next token starts in the choice's text
    tool_call_id: str | None = None   # chat with a named tool_choice: the call being streamed


class Generation:
    """Runs one HTTP request on the engine and yields its choices' deltas as they arrive."""

    def __init__(self, st: ServerState, parsed: ParsedRequest, id_prefix: str) -> None:
        self.st, self.parsed = st, parsed
        self.id = f"{id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        n = parsed.params.n
        multi = len(parsed.prompts) > 1
        rids = [f"{self.id}-{i}" for i in range(len(parsed.prompts))] if multi else [self.id]
        self.subs = [SubRequest(rid, p, RequestTracker(rid, p.token_ids, parsed.params, st.tokenizer),
                                st.metrics.timer(), i * n)
                     for i, (rid, p) in enumerate(zip(rids, parsed.prompts))]
        self.by_id = {s.request_id: s for s in self.subs}
        self.streams = [ChoiceStream() for _ in range(len(self.subs) * n)]
        self._pumps: list[asyncio.Task] = []

    @property
    def model_name(self) -> str:
        """The `model` responses carry: the adapter's name, or the served model's."""
        return self.parsed.lora_name or self.parsed.model_name or self.st.model_name

    @property
    def finished(self) -> bool:
        return all(s.tracker.finished for s in self.subs)

    async def start(self) -> None:
        """Submit every prompt; map engine rejections to HTTP errors (before any response byte is sent)."""
        client, params = self.st.client, self.parsed.params
        try:
            for s in self.subs:
                self.st.inflight[s.request_id] = params.n
                s.queue = await client.add(s.request_id, s.prompt.token_ids, params, lora=self.parsed.lora)
        except BaseException as e:
            self.abort()
            if (api_error := self._refusal(e)) is not None:
                raise api_error from None
            raise

    def _refusal(self, e: BaseException) -> APIError | None:
        """The HTTP error for an engine that refused or could not take the request; None for anything else."""
        if isinstance(e, EngineRejected):
            if e.code == 429:
                self.st.metrics.rejected()
                return APIError(429, e.message, param=e.param, code="rate_limit_exceeded",
                                headers={"Retry-After": RETRY_AFTER_S})
            return APIError(e.code, e.message, param=e.param,
                            code="model_not_found" if (e.code, e.param) == (404, "model") else None)
        if isinstance(e, (EngineDead, asyncio.TimeoutError)):
            return APIError(503, f"the engine is unavailable: {e or 'no answer'}", code="engine_unavailable")
        return None

    async def deltas(self) -> AsyncIterator[list[tuple[SubRequest, ChoiceDelta]]]:
        """Batches of (sub-request, delta): everything that arrived since the last batch, so a burst of
        outputs costs one socket write."""
        source = self._merged_queue()
        while not self.finished:
            outputs = [await source.get()]
            while not source.empty():
                outputs.append(source.get_nowait())
            now = time.monotonic()
            batch, stopped = [], []
            for eo in outputs:
                item = self._apply(eo, now)
                if item is not None:
                    batch.append(item)
                    if item[1].abort_engine:
                        stopped.append((item[0].request_id, item[1].index))
            for rid, index in stopped:       # a stop string ended the choice; free its blocks
                await self.st.client.abort(rid, index)
            yield batch

    def _merged_queue(self) -> asyncio.Queue[EngineOutput]:
        if len(self.subs) == 1:
            return self.subs[0].queue
        merged: asyncio.Queue[EngineOutput] = asyncio.Queue()

        async def pump(q: asyncio.Queue[EngineOutput]) -> None:
            while True:
                merged.put_nowait(await q.get())

        self._pumps = [asyncio.create_task(pump(s.queue)) for s in self.subs]
        return merged

    def _apply(self, eo: EngineOutput, now: float) -> tuple[SubRequest, ChoiceDelta] | None:
        s = self.by_id.get(eo.request_id)
        if s is None or s.tracker.finished:
            return None
        if eo.index < 0 or eo.finish_reason == "error":
            raise EngineFailure(eo.error or "the engine failed while generating")
        s.timer.on_output(eo, now)
        delta = s.tracker.process(eo)
        if delta is None:
            return None
        if delta.finish_reason is not None:
            s.timer.on_choice_finished(delta.finish_reason)
            if s.tracker.finished:
                s.timer.on_request_finished(now, s.tracker)
                self._forget(s)
        return s, delta

    def _forget(self, s: SubRequest) -> None:
        self.st.inflight.pop(s.request_id, None)
        self.st.client.release(s.request_id)

    def abort(self) -> None:
        """Free the engine's work for every unfinished prompt (client gone, error). Safe under cancellation."""
        for s in self.subs:
            if s.request_id not in self.st.inflight:
                continue
            if s.queue is not None:       # accepted: its unfinished choices end as aborted
                for c in s.tracker.choices:
                    if c.finish_reason is None:
                        s.timer.on_choice_finished("abort")
            self._forget(s)
            self.st.spawn(self.st.client.abort(s.request_id))

    def close(self) -> None:
        for t in self._pumps:
            t.cancel()

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(s.prompt.token_ids) for s in self.subs)
        completion = sum(s.tracker.num_generated_tokens for s in self.subs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(s.tracker.num_cached_tokens for s in self.subs)}}

    def choices(self) -> list[tuple[SubRequest, Choice]]:
        return [(s, c) for s in self.subs for c in s.tracker.choices]
