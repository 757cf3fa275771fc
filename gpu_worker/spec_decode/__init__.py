"""Speculative decoding in the worker: proposers guess the next tokens of each sequence after a step, the
scheduler sends the guesses back as the next step's drafts, and the runner verifies them in one pass.

A proposer is one file behind the `Proposer` protocol (proposer.py); `build_proposer` picks it."""
from __future__ import annotations

from common.speculative import SpeculativeConfig
from gpu_worker.spec_decode.proposer import Proposer


def build_proposer(config: SpeculativeConfig, runner) -> Proposer:
    """The proposer for `config`, with what it needs of the target's runner (device, dtype, limits)."""
    if config.method == "ngram":
        from gpu_worker.spec_decode.ngram import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens)
    if config.method == "draft_model":
        from gpu_worker.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer(config, runner.config, runner.model_config.vocab_size, runner.device, runner.dtype,
                                  runner.max_model_len, runner.block_size, runner.eos_ids)
    raise ValueError(f"no proposer for speculative method {config.method!r}")
