"""Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama-family attention (Qwen3's q/k norms and Qwen2's qkv bias
come from the config) with routed-expert MLPs (layers/moe.py) in the layers the config makes sparse."""
from __future__ import annotations

import torch
from torch import nn

from common.model_config import ModelConfig
from gpu_worker.layers.moe import SparseMoE
from gpu_worker.models.llama import MLP, LlamaForCausalLM


class MoEForCausalLM(LlamaForCausalLM):
    def make_mlp(self, c: ModelConfig, dtype: torch.dtype, layer: int) -> nn.Module:
        if not c.is_moe_layer(layer):
            return MLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype)
        shared = MLP(c.hidden_size, c.shared_expert_intermediate_size, c.hidden_act, dtype) \
            if c.shared_expert_intermediate_size else None
        return SparseMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                         c.norm_topk_prob, c.hidden_act, dtype, fp32_weights=c.arch == "mixtral",
                         shared_expert=shared)
