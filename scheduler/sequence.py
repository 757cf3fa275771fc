"""The scheduler's view of one sequence: tokens, progress and status.

A user's request (`request_id`) with n > 1 becomes n sequences that share the prompt's KV blocks; choice
i of request R is the sequence with seq_id R (i = 0) or R#i. The group they form lives in
sequence_group.py; this module knows one sequence only."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from common.sampling_params import SamplingParams
from scheduler.block_hash import BlockHash, BlockHasher
from scheduler.lora_registry import LoRAAdapter


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    PARKED = "parked"        # a beam that sampled, waiting for its siblings' samples (beam_search.py)
    FINISHED = "finished"


def seq_id_of(request_id: str, index: int) -> str:
    """Choice 0 keeps the request's id, so a request with n = 1 has one id everywhere."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request_id: str
    index: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    client_id: str = ""
    seed: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0                 # tokens sampled by a step still in flight (async scheduling)
    spec_token_ids: list[int] = field(default_factory=list)   # drafts proposed for the next step
    num_inflight_drafts: int = 0         # drafts the step in flight verifies (its lookahead slots)
    num_cached_tokens: int = -1          # prefix-cache hit at first admission (-1: not admitted yet)
    status: Status = Status.WAITING
    on_worker: bool = False              # the worker holds this sequence's state
    worker_num_blocks: int = 0           # length of the block table the worker holds
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    first_scheduled_time: float | None = None
    lora: LoRAAdapter | None = None      # the adapter it runs under; None: the base model
    # the earliest token whose sliding windows must keep their blocks: an n > 1 parent keeps its last
    # prompt token's, from which the choices not yet forked start (None: the token being computed)
    kv_keep_from: int | None = None
    rope_long: bool = False              # LongRoPE: its cached keys were computed with the long factors
    replaced_last: bool = False          # beam search replaced its last token after the worker sampled it

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Known tokens plus in-flight samples, minus what the cache holds: the worker knows the in-flight
        samples already, so a decode can be scheduled before its previous token is back here."""
        if len(self.output_token_ids) + self.num_pending >= self.max_tokens:
            return 0    # the in-flight sample is its last one
        return self.num_tokens + self.num_pending - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def full_block_hashes(self, block_size: int, num_tokens: int, hasher: BlockHasher) -> list[BlockHash]:
        """Hashes of the full blocks within the first num_tokens tokens, extended incrementally. The chain
        starts from the adapter's root, so blocks computed under different adapters (or none) are never
        shared, and blocks under the same one are."""
        want = num_tokens // block_size
        if len(self.block_hashes) < want:
            tokens = self.all_token_ids
            parent = (self.block_hashes[-1] if self.block_hashes
                      else hasher.root(None if self.lora is None else self.lora.key))
            for b in range(len(self.block_hashes), want):
                parent = hasher(parent, tokens[b * block_size:(b + 1) * block_size])
                self.block_hashes.append(parent)
        return self.block_hashes[:want]

    def adopt_cached_keys(self, stored: list[BlockHash]) -> None:
        """Take the prefix cache's own key objects for the blocks it served, so that the blocks this
        sequence caches next link to them by identity (block_hash.py) and later walks can pass through."""
        n = len(stored)
        self.block_hashes[:n] = stored
        if len(self.block_hashes) > n:
            self.block_hashes[n].parent_key = stored[-1]

    def check_stop(self, max_model_len: int) -> bool:
        """Apply stop conditions that need no text (stop strings are the detokenizer's job)."""
        sp = self.sampling_params
        n_out = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.finish_reason, self.stop_reason = "stop", None
                return True
            if last in sp.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", last
                return True
        if n_out >= self.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = "length"
            return True
        return False
