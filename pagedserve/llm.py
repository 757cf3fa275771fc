"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))` and `.chat(messages)`.

It runs the same engine core as the server, with the model runner in this process (with tensor
parallelism, the ranks in worker processes: worker_executor.py).
"""
from __future__ import annotations

import atexit
import itertools
import logging
from dataclasses import dataclass, fields
from typing import Any

from common.chat_template import load_chat_template
from common.config import EngineConfig
from common.lora import LoRARequest
from common.model_source import ModelSource, eos_token_ids
from common.output_processor import RequestTracker
from common.protocol import EngineRequest, Logprob
from common.sampling_params import BeamSearchParams, SamplingParams
from common.structured_output import check as check_structured_output
from common.tp_layout import check_config
from scheduler.engine_core import EngineCore
from pagedserve.inproc_executor import InprocExecutor
from pagedserve.worker_executor import WorkerGroupExecutor
from pagedserve.prompts import PromptType, prompt_input, prompt_list

log = logging.getLogger("pagedserve")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None     # beam search (vLLM's field); None otherwise


@dataclass
class BeamSearchSequence:
    """One beam of `LLM.beam_search`, as vLLM's: `tokens` and `text` include the prompt."""
    tokens: list[int]
    logprobs: list[Logprob]
    cum_logprob: float
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]     # best first (length-penalised score)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[Logprob | None] | None
    num_cached_tokens: int
    finished: bool = True


def engine_config(model: str | None, options: dict[str, Any], api: str) -> EngineConfig:
    """EngineConfig from an API's keyword options, naming any that are not engine options."""
    unknown = set(options) - {f.name for f in fields(EngineConfig)}
    if unknown:
        raise TypeError(f"unknown {api} options: {', '.join(sorted(unknown))}")
    return EngineConfig(model=model, **options)


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        self.config = engine_config(model, kwargs, "LLM")
        self.source = ModelSource.from_config(self.config, self.config.load_format != "dummy")
        self.tokenizer = self.source.load_tokenizer()
        self.eos_token_ids = eos_token_ids(self.source.model_config(), self.tokenizer)
        self.sampling_defaults = self.source.generation_defaults(self.config.generation_config)
        if self.config.tensor_parallel_size == 1:
            executor = InprocExecutor(self.config, self.source)
        else:
            check_config(self.config, self.source.model_config(), self.source.quantization_config())
            executor = WorkerGroupExecutor(self.config)
            atexit.register(executor.shutdown)
        self.engine = EngineCore(self.config, executor, self.eos_token_ids)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine (with tensor parallelism: its worker processes). Also done at exit."""
        self.engine.shutdown()

    @property
    def stats(self):
        return self.engine.scheduler.stats

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses when given none: the generation config's defaults (vLLM's method)."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`prompts`: strings, token-id lists, or vLLM's {"prompt": ...} / {"prompt_token_ids": [...]} dicts.
        `lora_request`: the adapter every prompt runs under, or one per prompt (None: the base model)."""
        prompts = prompt_list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("give one lora_request, or one per prompt")
        trackers: dict[str, tuple[RequestTracker, str | None]] = {}
        order = []
        try:
            for prompt, sp, lora in zip(prompts, params, loras):
                ids, text = prompt_input(prompt, self.tokenizer)
                if sp.structured_outputs is not None:
                    check_structured_output(sp.structured_outputs)     # a bad schema: ValueError, here
                rid = str(next(self._ids))
                self.engine.add_request(EngineRequest(rid, ids, sp, lora_request=lora))
                trackers[rid] = (RequestTracker(rid, ids, sp, self.tokenizer), text)
                order.append(rid)
        except Exception:   # one bad prompt refuses the call; nothing of it stays in the engine
            self.engine.abort(order)
            raise
        self._run(trackers, use_tqdm)
        return [request_output(*trackers[rid]) for rid in order]

    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: per prompt, `params.beam_width` finished beams, best first. The beams
        run in the engine as one group each, sharing their blocks (scheduler/beam_search.py)."""
        outs = self.generate(prompts, params.to_sampling_params(), use_tqdm, lora_request)
        return [BeamSearchOutput([BeamSearchSequence(o.prompt_token_ids + c.token_ids, c.logprobs or [],
                                                     c.cumulative_logprob, self._prompt_text(o) + c.text,
                                                     c.finish_reason, c.stop_reason) for c in o.outputs])
                for o in outs]

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """vLLM's arguments: `chat_template` (a file or the Jinja text, instead of the tokenizer's), `tools`
        (OpenAI's tool objects, rendered by the template; the calls are not parsed offline, as in vLLM)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        template = load_chat_template(chat_template) if chat_template is not None else None
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      chat_template=template, tools=tools) for c in convs]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outs = self.generate(ids, sampling_params, use_tqdm, lora_request)
        for o, p in zip(outs, prompts):
            o.prompt = p
        return outs

    def _run(self, trackers: dict[str, tuple[RequestTracker, str | None]], use_tqdm: bool) -> None:
        pending = set(trackers)
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(pending), desc="Processed prompts", dynamic_ncols=True)
        while pending:
            aborts = []
            for eo in self.engine.step():
                tr = trackers[eo.request_id][0]
                delta = tr.process(eo)
                if delta is not None and delta.abort_engine:
                    aborts.append((eo.request_id, eo.index))
                if tr.finished and eo.request_id in pending:
                    pending.discard(eo.request_id)
                    if bar:
                        bar.update(1)
            if aborts:
                self.engine.abort([a[0] for a in aborts], [a[1] for a in aborts])
            if pending and not self.engine.has_unfinished():
                raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
        if bar:
            bar.close()


def request_output(tr: RequestTracker, prompt: str | None) -> RequestOutput:
    """A request's output so far, as vLLM's RequestOutput (the offline and the asyncio API share it)."""
    outs = [CompletionOutput(c.index, c.text, list(c.token_ids), list(c.logprobs) if tr.params.logprobs is not None else None,
                             c.finish_reason, c.stop_reason, c.cumulative_logprob) for c in tr.choices]
    return RequestOutput(tr.request_id, prompt, tr.prompt_token_ids, outs,
                         list(tr.prompt_logprobs) if tr.params.prompt_logprobs is not None else None,
                         tr.num_cached_tokens)
