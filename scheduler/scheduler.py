"""Continuous-batching scheduler: decides, each step, which sequences run how many tokens.

Running sequences go first (decodes and unfinished prefill chunks), then swapped ones come back, then
waiting ones are admitted, all within one token budget. When blocks run out the newest running
sequence is preempted: swapped to host memory if there is room, else freed and recomputed later.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from common.protocol import (CachedRequestData, EngineOutput, EngineRequest, ModelRunnerOutput,
                             NewRequestData, SchedulerOutput)
from scheduler.kv_cache_manager import KVCacheManager, cdiv
from scheduler.request import Request, Status


class RequestRejected(ValueError):
    """The request can never be served as asked; `code` is an HTTP status for the router."""

    def __init__(self, message: str, code: int = 400, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_model_len: int = 2048
    vocab_size: int | None = None
    block_size: int = 16
    num_blocks: int = 1024
    num_host_blocks: int = 0
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 4096
    max_waiting_tokens: int = 1 << 22


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    prefix_cache_queries: int = 0        # prompt tokens looked up
    prefix_cache_hits: int = 0           # prompt tokens found
    prompt_tokens: int = 0               # prompt tokens computed
    generation_tokens: int = 0
    admission_rejections: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_token_ids: list[int] | None = None):
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 config.num_host_blocks)
        self.eos_token_ids = frozenset(eos_token_ids or [])
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}              # req_id -> sequence
        self.groups: dict[str, list[Request | None]] = {}   # request_id -> its n sequences
        self.stats = SchedulerStats()
        self._to_drop: list[str] = []                       # worker state to free at the next step
        self._step_ids = itertools.count()

    # ---- admission -----------------------------------------------------------------------------
    def add_request(self, er: EngineRequest) -> None:
        c = self.config
        sp = er.sampling_params
        n_prompt = len(er.prompt_token_ids)
        if er.request_id in self.groups:
            raise RequestRejected(f"request id {er.request_id!r} is already in use", 400)
        if n_prompt == 0:
            raise RequestRejected("the prompt is empty", 400, "prompt")
        self._check_token_ids(er)
        if sp.n > c.max_num_seqs:
            raise RequestRejected(f"n ({sp.n}) exceeds max_num_seqs ({c.max_num_seqs}), the most sequences that "
                                  f"can run at once", 400, "n")
        if n_prompt >= c.max_model_len:
            raise RequestRejected(f"the prompt has {n_prompt} tokens, but this model's maximum context length "
                                  f"(max_model_len) is {c.max_model_len}; at least one token must be left to generate",
                                  400, "prompt")
        max_tokens = sp.max_tokens if sp.max_tokens is not None else c.max_model_len - n_prompt
        if n_prompt + max_tokens > c.max_model_len:
            raise RequestRejected(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = {n_prompt + max_tokens} "
                                  f"exceeds max_model_len {c.max_model_len}", 400, "max_tokens")
        need = cdiv(n_prompt + max_tokens, c.block_size)
        if need > c.num_blocks:
            raise RequestRejected(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks but "
                                  f"the cache holds only {c.num_blocks} blocks of {c.block_size} tokens "
                                  f"({c.num_blocks * c.block_size} tokens)", 400, "max_tokens")
        if len(self.waiting) >= c.max_waiting_requests or \
                sum(r.num_tokens for r in self.waiting) + n_prompt > c.max_waiting_tokens:
            self.stats.admission_rejections += 1
            raise RequestRejected("the server is overloaded: the waiting queue is full", 429)
        req = Request(req_id=er.request_id, request_id=er.request_id, index=0,
                      prompt_token_ids=list(er.prompt_token_ids), sampling_params=sp, max_tokens=max_tokens,
                      eos_token_ids=self.eos_token_ids, client_id=er.client_id, seed=sp.seed,
                      arrival_time=er.arrival_time or time.monotonic(), pending_fork=sp.n > 1)
        self.requests[req.req_id] = req
        self.groups[er.request_id] = [req] + [None] * (sp.n - 1)
        self.waiting.append(req)

    def _check_token_ids(self, er: EngineRequest) -> None:
        """Out-of-vocabulary ids would fail the whole batch's step on the worker: refuse them here."""
        v = self.config.vocab_size
        if v is None:
            return
        sp = er.sampling_params
        for param, ids in (("prompt", er.prompt_token_ids), ("stop_token_ids", sp.stop_token_ids),
                           ("logit_bias", list(sp.logit_bias or ()))):
            bad = next((t for t in ids if not 0 <= t < v), None)
            if bad is not None:
                raise RequestRejected(f"token id {bad} in {param} is outside the vocabulary [0, {v})", 400, param)

    def abort_requests(self, request_ids: list[str], indexes: list[int] | None = None) -> list[EngineOutput]:
        """Finish every sequence of these requests (or only choice indexes[k] of request k, where that is not
        -1) at once and free what they hold."""
        outs = []
        for k, rid in enumerate(request_ids):
            group = self.groups.get(rid)
            if group is None:
                continue
            only = indexes[k] if indexes else -1
            if only == 0 and group[0].pending_fork:
                only = -1   # the unforked parent takes its unborn choices with it: report them too
            for i, seq in enumerate(group):
                if only >= 0 and i != only:
                    continue
                if seq is None:   # unborn: a finished stand-in keeps the fork from creating it later
                    group[i] = Request(req_id=f"{rid}#{i}", request_id=rid, index=i, prompt_token_ids=[],
                                       sampling_params=group[0].sampling_params, max_tokens=0,
                                       eos_token_ids=self.eos_token_ids, status=Status.FINISHED,
                                       finish_reason="abort")
                    outs.append(EngineOutput(rid, i, [], finish_reason="abort"))
                elif not seq.is_finished:
                    seq.finish_reason = "abort"
                    self._finish(seq)
                    outs.append(EngineOutput(rid, i, [], finish_reason="abort"))
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step_id=next(self._step_ids), finished_req_ids=self._to_drop)
        self._to_drop = []
        budget = self.config.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens_to_compute, budget)
            if n <= 0:   # its last token is still in flight
                i += 1
                continue
            alloc = self.kv.allocate_slots(req, n)
            while alloc is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
                alloc = self.kv.allocate_slots(req, n)
            if alloc is None:
                break
            self._emit(req, n, alloc, out)
            budget -= n
            i += 1

        if not preempted:
            budget = self._swap_in(out, budget)
        if not preempted and not self.swapped:
            self._admit(out, budget)
        return out

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        num_seqs = sum(self._num_seqs(r) for r in self.running)
        while self.swapped and budget > 0:
            req = self.swapped[0]
            if req.num_pending or num_seqs + self._num_seqs(req) > self.config.max_num_seqs:
                break
            n = min(req.num_tokens_to_compute, budget)
            if not self.kv.can_swap_in(req, n):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.kv.swap_in(req))
            alloc = self.kv.allocate_slots(req, n)
            assert alloc is not None
            num_seqs += self._start_running(req, n, alloc, out)
            budget -= n
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        num_seqs = sum(self._num_seqs(r) for r in self.running)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if req.num_pending or num_seqs + self._num_seqs(req) > self.config.max_num_seqs:
                break
            hits = self.kv.get_computed_blocks(req)
            num_hit = len(hits) * self.config.block_size
            req.num_computed_tokens = num_hit
            n = min(req.num_tokens - num_hit, budget)
            alloc = self.kv.allocate_slots(req, n, hits)
            if alloc is None:
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                self.stats.prefix_cache_queries += req.num_prompt_tokens
                self.stats.prefix_cache_hits += num_hit
            num_seqs += self._start_running(req, n, alloc, out)
            budget -= n

    def _start_running(self, req: Request, n: int, alloc: tuple[list[tuple[int, int]], int],
                       out: SchedulerOutput) -> int:
        """Move a waiting or swapped-in request into the running queue; returns the sequences it adds."""
        req.status = Status.RUNNING
        self.running.append(req)
        self._emit(req, n, alloc, out)
        return self._num_seqs(req)

    def _num_seqs(self, req: Request) -> int:
        """Running sequences req is or will become: an unforked parent brings its unborn siblings."""
        return 1 + (sum(s is None for s in self.groups[req.request_id]) if req.pending_fork else 0)

    def _emit(self, req: Request, n: int, alloc: tuple[list[tuple[int, int]], int], out: SchedulerOutput) -> None:
        """Record that req runs n tokens this step, as a new request or as a delta for the worker."""
        copies, first_changed = alloc
        out.blocks_to_copy.extend(copies)
        table = self.kv.table(req.req_id)
        if not req.on_worker:
            out.new_reqs.append(NewRequestData(req.req_id, req.all_token_ids, req.num_prompt_tokens,
                                               req.sampling_params, list(table), req.num_computed_tokens, n,
                                               req.seed))
            req.on_worker = True
        else:
            start = min(first_changed, req.worker_num_blocks)
            out.cached_reqs.append(CachedRequestData(req.req_id, start, table[start:], req.num_computed_tokens, n))
        req.worker_num_blocks = len(table)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        if req.num_computed_tokens < req.num_prompt_tokens:
            self.stats.prompt_tokens += min(n, req.num_prompt_tokens - req.num_computed_tokens)
        req.num_computed_tokens += n
        if req.num_computed_tokens >= req.num_tokens + req.num_pending:
            req.num_pending += 1        # this step samples its next token
        # Blocks this step fills are findable at once: a later request in this same step may hit them,
        # which is safe because every layer writes the step's K/V before any of its attention reads.
        self.kv.cache_full_blocks(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.stats.num_preemptions += 1
        req.num_preemptions += 1
        if req.on_worker:
            out.finished_req_ids.append(req.req_id)
        req.on_worker = False
        req.worker_num_blocks = 0
        if self.kv.num_host_blocks and self.kv.can_swap_out(req):
            out.blocks_to_swap_out.extend(self.kv.swap_out(req))
            req.status = Status.SWAPPED
            self.swapped.append(req)
            self.stats.num_swap_preemptions += 1
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = Status.WAITING
            self.waiting.appendleft(req)
            self.stats.num_recompute_preemptions += 1

    # ---- results -------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineOutput]:
        """Append sampled tokens, apply stop conditions, fork n > 1 siblings, and report per sequence."""
        outs = []
        max_len = self.config.max_model_len
        for k, req_id in enumerate(result.req_ids):
            req = self.requests.get(req_id)
            if req is None or req.is_finished or req.num_pending == 0:
                continue  # finished or aborted while the step ran
            req.num_pending -= 1    # a sequence preempted meanwhile keeps its token: it was computed correctly
            new = result.sampled_token_ids[k]
            req.output_token_ids.extend(new)
            self.stats.generation_tokens += len(new)
            if req.pending_fork:
                self._fork(req)
            stopped = req.check_stop(max_len)
            eo = EngineOutput(req.request_id, req.index, new,
                              logprobs=result.logprobs[k] if result.logprobs else None,
                              num_prompt_tokens=req.num_prompt_tokens,
                              num_cached_tokens=max(req.num_cached_tokens, 0))
            if len(req.output_token_ids) == len(new) and req.first_scheduled_time is not None:
                eo.queue_time = max(0.0, req.first_scheduled_time - req.arrival_time)
            if req_id in result.prompt_logprobs:
                eo.prompt_logprobs = result.prompt_logprobs[req_id]
            if stopped:
                eo.finish_reason, eo.stop_reason = req.finish_reason, req.stop_reason
                self._finish(req)
            outs.append(eo)
        for req_id, plp in result.prompt_logprobs.items():   # chunks that did not sample yet
            req = self.requests.get(req_id)
            if req is not None and req_id not in result.req_ids:
                outs.append(EngineOutput(req.request_id, req.index, [], prompt_logprobs=plp,
                                         num_prompt_tokens=req.num_prompt_tokens))
        return outs

    def _fork(self, parent: Request) -> None:
        """Create the siblings of an n > 1 request once its prompt is computed. They share the parent's
        blocks; a parent preempted meanwhile holds none, so its siblings recompute the prompt instead."""
        parent.pending_fork = False
        group = self.groups[parent.request_id]
        sp = parent.sampling_params
        shared = parent.status is Status.RUNNING
        for i in range(1, len(group)):
            if group[i] is not None:   # aborted before it was born
                continue
            child = Request(req_id=f"{parent.request_id}#{i}", request_id=parent.request_id, index=i,
                            prompt_token_ids=parent.prompt_token_ids, sampling_params=sp,
                            max_tokens=parent.max_tokens, eos_token_ids=parent.eos_token_ids,
                            client_id=parent.client_id, arrival_time=parent.arrival_time,
                            seed=None if sp.seed is None else sp.seed + i,
                            num_computed_tokens=parent.num_prompt_tokens - 1 if shared else 0,
                            num_cached_tokens=parent.num_cached_tokens,
                            status=Status.RUNNING if shared else Status.WAITING)
            self.requests[child.req_id] = child
            group[i] = child
            if shared:
                self.kv.fork(parent, child)
                self.running.append(child)
            else:
                self.waiting.appendleft(child)

    def _finish(self, req: Request) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.SWAPPED:
            self.swapped.remove(req)
        req.status = Status.FINISHED
        self.kv.free(req)
        if req.on_worker:
            self._to_drop.append(req.req_id)
            req.on_worker = False
        self.stats.finished[req.finish_reason or "abort"] = self.stats.finished.get(req.finish_reason or "abort", 0) + 1
        del self.requests[req.req_id]
        group = self.groups.get(req.request_id)
        # a parent finishing before its fork takes its unborn siblings with it
        if group is not None and (req.pending_fork or all(s is not None and s.is_finished for s in group)):
            del self.groups[req.request_id]

    # ---- observability -------------------------------------------------------------------------
    def snapshot(self) -> dict[str, float]:
        return {"running": len(self.running), "waiting": len(self.waiting), "swapped": len(self.swapped),
                "kv_cache_usage": self.kv.pool.usage, "num_free_blocks": self.kv.num_free_blocks,
                "num_blocks": self.kv.pool.num_blocks}
