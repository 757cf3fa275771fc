"""Every message that crosses a process boundary, defined once, with its msgpack wire form.

Flow is one way: router -> scheduler (EngineRequest, AbortRequests), scheduler -> workers
(SchedulerOutput: new sequences once, then only deltas), workers -> scheduler (ModelRunnerOutput),
scheduler -> routers (EngineOutputs).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from common.lora import LoRARequest
from common.sampling_params import SamplingParams

# ---- liveness: every process reads these from here, so the two ends of a heartbeat cannot disagree ----
HEARTBEAT_S = 0.5          # routers send Hello and the scheduler broadcasts Stats this often
DEAD_AFTER_S = 3.0         # a router calls the scheduler dead after this long without Stats
CLIENT_TTL_S = 10.0        # the scheduler forgets a router it has not heard from for this long
STEP_TIMEOUT_S = 600.0     # a worker step longer than this is treated as a dead worker
STARTUP_TIMEOUT_S = 600.0  # workers must load the model and say ready within this

# One logprob record for one position: (chosen token's logprob, chosen token's rank, top ids, top logprobs).
Logprob = tuple[float, int, list[int], list[float]]


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    client_id: str = ""
    lora_request: LoRARequest | None = None     # the adapter to run under (HTTP: its name alone)


@dataclass
class LoadLoRA:
    """Router -> scheduler: serve this adapter from now on (answered with an Ack of `request_id`)."""
    request_id: str
    lora: LoRARequest


@dataclass
class UnloadLoRA:
    """Router -> scheduler: stop accepting requests for this adapter; those running finish under it."""
    request_id: str
    lora_name: str


@dataclass
class AbortRequests:
    """Abort whole requests, or with `indexes` (one per id, -1 = all) single choices of them."""
    request_ids: list[str]
    indexes: list[int] | None = None


@dataclass
class NewSequenceData:
    """A sequence the worker has not seen (or has dropped, after a preemption)."""
    seq_id: str
    token_ids: list[int]          # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int           # tokens to run this step
    seed: int | None = None
    lora_id: int = 0              # the adapter's key (SchedulerOutput.lora_loads says its slot); 0: none


@dataclass
class CachedSequenceData:
    """Delta for a sequence the worker already holds: its block table from `blocks_from` on is replaced by
    `block_ids` (appended blocks, or a copy-on-write replacement)."""
    seq_id: str
    blocks_from: int
    block_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int


# vllm:iteration_tokens_total's buckets (tokens per engine step, as vLLM v1 fixes them); the scheduler
# counts steps per bucket (Stats "iteration_tokens", +Inf last) and the routers expose the histogram
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class SchedulerOutput:
    step_id: int
    new_seqs: list[NewSequenceData] = field(default_factory=list)
    cached_seqs: list[CachedSequenceData] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)   # drop state (finished, aborted or preempted)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)       # (src, dst) device blocks
    # Draft tokens to verify after the known ones (speculative decoding), only for sequences that have
    # some: the worker runs them in the same pass and samples at each of the k + 1 positions; the
    # sequence's num_new_tokens counts them.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # (slot, adapter key, folder): load the adapter into that slot before this step runs (it replaces the
    # slot's previous adapter, which no sequence of this step uses)
    lora_loads: list[tuple[int, int, str]] = field(default_factory=list)
    # Beam search picks each beam's next token from the candidates after the step that sampled it, so the
    # worker's own sample (its top-1) may not be it: seq_id -> the token that replaces the worker's last one
    replaced_token_ids: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.new_seqs) + sum(r.num_new_tokens for r in self.cached_seqs)

    @property
    def is_empty(self) -> bool:
        return not (self.new_seqs or self.cached_seqs or self.finished_seq_ids or self.blocks_to_swap_out
                    or self.blocks_to_swap_in or self.blocks_to_copy or self.lora_loads)


@dataclass
class ModelRunnerOutput:
    step_id: int
    seq_ids: list[str] = field(default_factory=list)              # sequences that sampled this step
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[Logprob] | None] = field(default_factory=list)
    prompt_logprobs: dict[str, list[Logprob | None]] = field(default_factory=dict)   # seq_id -> records
    # sampled_token_ids[i] holds 1 token, or 1 + the accepted drafts of a step that verified some.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)   # seq_id -> drafts for its next step
    lora_errors: dict[int, str] = field(default_factory=dict)   # adapter key -> why this worker could not load it
    # sequences due to sample whose grammar was still compiling: they sampled nothing, and their last token
    # runs again in a later step (the batch did not wait for the compiler)
    deferred_seq_ids: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class EngineOutput:
    """New tokens of one sequence (choice `index` of request `request_id`) produced by one step."""
    request_id: str
    index: int
    new_token_ids: list[int]
    finish_reason: str | None = None       # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    queue_time: float | None = None        # seconds from arrival to first scheduling, on the first output
    cumulative_logprob: float | None = None    # beam search: the finished beam's sum of token logprobs


@dataclass
class EngineOutputs:
    outputs: list[EngineOutput]


@dataclass
class Hello:
    """A router announcing itself (and, repeated, that it is alive)."""
    client_id: str


@dataclass
class Ack:
    """The scheduler's answer to each EngineRequest: accepted (code 200) or rejected with an HTTP code."""
    request_id: str
    code: int = 200
    error: str | None = None
    param: str | None = None


@dataclass
class WorkerInit:
    """Scheduler -> worker after it connects: finish start-up (size and allocate the KV cache)."""
    eos_token_ids: list[int]


@dataclass
class WorkerInfo:
    """What only a worker knows once its model is loaded and its KV cache allocated."""
    num_blocks: int
    num_host_blocks: int
    max_model_len: int
    vocab_size: int
    block_bytes: int
    weight_bytes: int = 0        # parameters and packed weights resident on this worker
    num_layers: int = 0
    lora_targets: dict[str, tuple[int, int]] = field(default_factory=dict)   # with --enable-lora: common/lora.py
    max_loras: int = 0           # adapter slots (0: LoRA off on this worker)
    max_lora_rank: int = 0
    # False where equal prefixes must not share blocks: LongRoPE rotates keys by the sequence's length,
    # and a windowed layer's blocks leave the table as the sequence grows
    prefix_caching: bool = True
    kv_group_windows: tuple = (None,)    # common/kv_layout.py: each KV group's window (None: full)
    # LongRoPE (Phi-3): the pretraining length past which a sequence's keys use the long factors, when
    # max_model_len exceeds it; the scheduler recomputes a sequence that crosses it (scheduler.py)
    long_rope_after: int | None = None
    # the engine flags this rank runs with (less the per-host ones): the ranks of a group must agree
    engine_flags: dict[str, Any] = field(default_factory=dict)


@dataclass
class WorkerReady:
    """Worker -> scheduler: start-up done."""
    rank: int
    info: WorkerInfo


@dataclass
class Stats:
    """Broadcast by the scheduler every heartbeat: readiness, queue gauges and cumulative counters."""
    ready: bool
    dead: str | None
    max_model_len: int
    values: dict[str, Any]


# ---- wire form -------------------------------------------------------------------------------------
_TYPES: list[type] = [EngineRequest, AbortRequests, NewSequenceData, CachedSequenceData, SchedulerOutput,
                      ModelRunnerOutput, EngineOutput, EngineOutputs, SamplingParams, Hello, Ack, Stats,
                      WorkerInit, WorkerInfo, WorkerReady, LoRARequest, LoadLoRA, UnloadLoRA]
_TAG = {t: i for i, t in enumerate(_TYPES)}
_FIELDS = {t: [f.name for f in dataclasses.fields(t)] for t in _TYPES}


def _default(obj: Any) -> Any:
    t = type(obj)
    if t in _TAG:
        if t is SamplingParams:
            return msgpack.ExtType(_TAG[t], msgpack.packb(obj.to_dict(), default=_default))
        return msgpack.ExtType(_TAG[t], msgpack.packb([getattr(obj, n) for n in _FIELDS[t]], default=_default))
    raise TypeError(f"cannot encode {t.__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    t = _TYPES[code]
    values = msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False)
    if t is SamplingParams:
        return SamplingParams.from_dict(values)
    obj = t.__new__(t)
    obj.__dict__.update(zip(_FIELDS[t], values))
    return obj


def encode(msg: Any) -> bytes:
    return msgpack.packb(msg, default=_default)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False)
