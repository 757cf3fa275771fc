"""Model implementations over a flattened batch of tokens: one file per family, found here by model_type."""
from __future__ import annotations

from common.model_config import ModelConfig

# model_type -> (module, class). Phi-3 is the Llama layout once its fused qkv / gate_up checkpoint
# tensors are cut into shards (layers/linear.py) and its LongRoPE and partial rotary are in the rope.
_ARCHS = {"llama": ("llama", "LlamaForCausalLM"), "mistral": ("llama", "LlamaForCausalLM"),
          "qwen2": ("llama", "LlamaForCausalLM"), "qwen3": ("llama", "LlamaForCausalLM"),
          "phi3": ("llama", "LlamaForCausalLM"),
          "mixtral": ("mixture_of_experts", "MoEForCausalLM"), "qwen2_moe": ("mixture_of_experts", "MoEForCausalLM"),
          "qwen3_moe": ("mixture_of_experts", "MoEForCausalLM"),
          "gemma2": ("gemma", "GemmaForCausalLM"), "gemma3_text": ("gemma", "GemmaForCausalLM")}


def build_model(config: ModelConfig, dtype, max_positions: int):
    import importlib
    if config.arch not in _ARCHS:
        raise ValueError(f"unsupported architecture {config.arch!r}")
    module, cls = _ARCHS[config.arch]
    return getattr(importlib.import_module(f"gpu_worker.models.{module}"), cls)(config, dtype, max_positions)
