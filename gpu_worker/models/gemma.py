"""Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's differences.

- the embedding is scaled by sqrt(hidden_size);
- RMSNorm scales by (1 + weight) (layers/norm.py, gemma=True), and each sublayer has a norm before and after;
- GeGLU MLP (tanh-approximated GELU), from the config's hidden_activation;
- attention scaled by query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps the attention logits and the
  final logits (tanh(x / cap) * cap); Gemma 3 normalizes q and k instead;
- windowed layers (every other in Gemma 2; five of six in Gemma 3) see the last sliding_window keys,
  and in Gemma 3 rotate with their own base (local_rope_theta), the full layers with the global one.
"""
from __future__ import annotations

import torch
from torch import nn

from common.model_config import ModelConfig
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import Rotation, RotaryEmbedding
from gpu_worker.models.llama import MLP, Attention, LlamaForCausalLM


class GemmaDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, layer: int):
        super().__init__()
        norm = lambda: RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, gemma=True)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Attention(c, dtype, layer, gemma_norm=True)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype)

    def forward(self, x, rot, kv_cache, meta, backend, residual=None):
        """(the layer's output, None): the whole stream, as the model's loop takes it (DecoderLayer)."""
        if residual is not None:
            x = x + residual
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rot, kv_cache, meta, backend))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), None


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, max_positions: int):
        super().__init__(c, dtype, max_positions)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, gemma=True)
        self.local_rope = RotaryEmbedding(c.rotary_dim, max_positions, c.local_rope_theta, None, dtype) \
            if c.local_rope_theta is not None else None

    def make_layer(self, c: ModelConfig, dtype: torch.dtype, layer: int) -> nn.Module:
        return GemmaDecoderLayer(c, dtype, layer)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)

    def rotations(self, positions: torch.Tensor, dtype: torch.dtype, seq_ends: torch.Tensor | None) -> list[Rotation]:
        glob = self.rope.at(positions, dtype, seq_ends)
        if self.local_rope is None:
            return [glob] * self.config.num_layers
        local = self.local_rope.at(positions, dtype)
        return [glob if w is None else local for w in self.config.windows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
