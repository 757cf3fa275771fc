"""The asyncio API: `AsyncLLMEngine(model=...)` and `async for out in engine.generate(prompt, params, id)`.

It starts the same scheduler and worker processes as `pagedserve serve` and talks to the scheduler over the
routers' ZeroMQ protocol (router/engine_client.py), so a forward pass never blocks the event loop and
concurrent `generate` calls are batched together by the scheduler. Tokenizing, detokenizing and stop
strings run here, in the caller's process, as a router does them.

    async with AsyncLLMEngine() as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
            print(out.outputs[0].text)
"""
from __future__ import annotations

import asyncio
import atexit
import uuid
from collections.abc import AsyncIterator
from dataclasses import fields
from typing import Any

from common.config import EngineConfig
from common.lora import LoRARequest
from common.model_source import ModelSource, eos_token_ids
from common.output_processor import RequestTracker
from common.protocol import STARTUP_TIMEOUT_S, EngineOutput
from common.structured_output import check as check_structured_output
from common.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.cli_args import config_flags
from pagedserve.prompts import PromptType, prompt_input
from pagedserve.engine_processes import EngineProcesses
from pagedserve.llm import CompletionOutput, RequestOutput, engine_config, request_output
from router.engine_client import EngineClient, EngineDead, EngineRejected



class EngineDeadError(RuntimeError):
    """The engine's processes died or stopped answering; no request can finish."""


class AsyncLLMEngine:
    def __init__(self, model: str | None = None, *, log_level: str = "WARNING", **kwargs: Any):
        self.config = engine_config(model, kwargs, "AsyncLLMEngine")
        source = ModelSource.from_config(self.config, self.config.load_format != "dummy")
        self.tokenizer = source.load_tokenizer()
        self.eos_token_ids = eos_token_ids(source.model_config(), self.tokenizer)
        self._procs = EngineProcesses.start(model, ["--log-level", log_level, *config_flags(self.config)],
                                            self.config.num_threads, self.config.tensor_parallel_size)
        atexit.register(self._procs.stop)
        self._client: EngineClient | None = None
        self._starting: asyncio.Lock | None = None
        self._closed = False

    @classmethod
    def from_engine_args(cls, config: EngineConfig, **kwargs: Any) -> "AsyncLLMEngine":
        """From a filled EngineConfig (vLLM's from_engine_args)."""
        values = {f.name: getattr(config, f.name) for f in fields(EngineConfig) if f.name != "model"}
        return cls(config.model, **values, **kwargs)

    # ---- life cycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> "AsyncLLMEngine":
        await self._ready()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    async def _ready(self, timeout: float = STARTUP_TIMEOUT_S) -> EngineClient:
        """The scheduler client, connected and the engine ready (the first call waits for the model load)."""
        if self._client is not None and self._client.ready:
            return self._client
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self._client is None:
                self._client = EngineClient(self._procs.frontend, f"async-{uuid.uuid4().hex[:8]}")
                await self._client.start()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while not self._client.ready:
                self._raise_if_dead(starting=True)
                if self._client.stats is not None and self._client.stats.dead:
                    raise EngineDeadError(self._client.stats.dead)
                if loop.time() > deadline:
                    raise EngineDeadError(f"the engine was not ready within {timeout:.0f}s")
                await asyncio.sleep(0.05)     # polling readiness at start-up only, never per token
        return self._client

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine is dead."""
        self._raise_if_dead()

    def _raise_if_dead(self, starting: bool = False) -> None:
        reason = self._procs.exited()
        if reason is None and self._client is not None and not starting:
            reason = self._client.dead_reason
        if reason is not None or self._closed:
            raise EngineDeadError(reason or "the engine was shut down")

    async def shutdown(self) -> None:
        """Stop every process this engine started; open streams end with EngineDeadError."""
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            self._client.fail_all("the engine was shut down")
            await self._client.close()
        await asyncio.get_running_loop().run_in_executor(None, self._procs.stop)
        atexit.unregister(self._procs.stop)

    # ---- requests ------------------------------------------------------------------------------
    async def get_tokenizer(self):
        return self.tokenizer

    def encode_prompt(self, prompt: PromptType) -> list[int]:
        """Token ids of a string, a token-id list, or {"prompt": str} / {"prompt_token_ids": [...]}."""
        return prompt_input(prompt, self.tokenizer)[0]

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's RequestOutputs (cumulative, or as sampling_params.output_kind says); the last
        has finished=True. Leaving the loop early (break, cancellation, an exception) aborts the request.
        `lora_request`: the adapter to run under (loaded on first use; the engine needs enable_lora)."""
        sp = sampling_params or SamplingParams()
        ids, text = prompt_input(prompt, self.tokenizer)
        if sp.structured_outputs is not None:
            check_structured_output(sp.structured_outputs)
        rid = request_id or uuid.uuid4().hex
        client = await self._ready()
        self._raise_if_dead()
        try:
            queue = await client.add(rid, ids, sp, lora=lora_request)
        except EngineDead as e:
            raise EngineDeadError(str(e)) from None
        except EngineRejected as e:
            if e.code == 503:       # the scheduler is up but its engine is dead
                raise EngineDeadError(e.message) from None
            raise ValueError(f"request {rid!r} rejected ({e.code}): {e.message}") from None
        tracker = RequestTracker(rid, ids, sp, self.tokenizer)
        done = False
        try:
            while not tracker.finished:
                eo = await queue.get()
                if eo.error:
                    raise EngineDeadError(eo.error)
                delta = tracker.process(eo)
                if delta is not None and delta.abort_engine:      # a stop string ended this choice
                    await client.abort(rid, eo.index)
                if sp.output_kind is RequestOutputKind.FINAL_ONLY and not tracker.finished:
                    continue
                yield self._output(tracker, text, eo, delta)
            done = True
        finally:
            if not done and not self._closed:
                try:
                    await client.abort(rid)
                except Exception:   # the socket is gone with the engine: nothing left to free
                    pass
            client.release(rid)

    async def abort(self, request_id: str) -> None:
        """Abort a request from outside its loop: its stream ends with finish_reason "abort" (and nothing
        happens for a request that has already finished)."""
        client = await self._ready()
        await client.abort(request_id, keep_queue=True)

    async def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None,
                   request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """generate() over the tokenizer's chat template with the generation prompt added."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        async for out in self.generate({"prompt_token_ids": ids}, sampling_params, request_id):
            out.prompt = text
            yield out

    @staticmethod
    def _output(tr: RequestTracker, prompt: str | None, eo: EngineOutput, delta) -> RequestOutput:
        out = request_output(tr, prompt)
        out.finished = tr.finished
        if tr.params.output_kind is RequestOutputKind.DELTA:
            c = out.outputs[eo.index]
            new = delta.token_ids if delta is not None else []
            out.outputs = [CompletionOutput(c.index, delta.text if delta else "", list(new),
                                            list(delta.logprobs or []) if delta and c.logprobs is not None else None,
                                            c.finish_reason, c.stop_reason)]
        return out


AsyncLLM = AsyncLLMEngine   # vLLM v1's name
