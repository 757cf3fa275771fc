"""Model implementations over a flattened batch of tokens."""
from __future__ import annotations

from common.config import ModelConfig


def build_model(config: ModelConfig, dtype, max_positions: int):
    from gpu_worker.models.llama import LlamaForCausalLM
    if config.arch in ("llama", "mistral", "qwen2", "qwen3"):
        return LlamaForCausalLM(config, dtype, max_positions)
    raise ValueError(f"unsupported architecture {config.arch!r}")
