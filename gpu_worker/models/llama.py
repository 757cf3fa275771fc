"""The Llama family (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm) over a flat batch.

Inputs are the new tokens of every scheduled sequence concatenated into one [num_tokens] vector with
their positions; attention reads and writes the paged KV cache through the backend and the step's
metadata, so the model itself never sees sequences or padding.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.config import ModelConfig
from gpu_worker.attention import AttentionBackend
from gpu_worker.layers.embedding import VocabEmbedding
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding, Rotation


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim ** -0.5
        self.qkv_proj = Linear(c.hidden_size, {"q": c.num_heads * c.head_dim, "k": c.num_kv_heads * c.head_dim,
                                               "v": c.num_kv_heads * c.head_dim}, bias=c.qkv_bias, dtype=dtype)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, dtype=dtype)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.k_scale = self.v_scale = 1.0      # what an fp8 KV cache divides K and V by
        self.kv_calibration_max: float | None = None   # set: take the scales from the next forward pass

    def load(self, param: str, tensor: torch.Tensor, shard: str = "") -> None:
        """The checkpoint's own tensors of this module are the fp8 KV cache scales (`self_attn.k_scale`,
        `self_attn.v_scale`, as FP8 checkpoints name them): one number each."""
        if param not in ("k_scale", "v_scale") or tensor.numel() != 1:
            raise ValueError(f"expected a one-element k_scale or v_scale, got {param} of shape {tuple(tensor.shape)}")
        setattr(self, param, float(tensor.reshape(-1)[0]))

    def _calibrate_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """`--calculate-kv-scales`: once, before anything is written with them, the scales that put this
        batch's largest |K| and |V| at the cache format's largest value (vLLM computes them from its first
        forward pass too), so small entries are not lost to fp8's subnormals."""
        fmax, self.kv_calibration_max = self.kv_calibration_max, None
        self.k_scale = max(float(k.abs().amax()), 1e-6) / fmax
        self.v_scale = max(float(v.abs().amax()), 1e-6) / fmax

    def forward(self, x: torch.Tensor, rot: Rotation,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: Any,
                backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        t = x.shape[0]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rot.apply(q, k)
        k_cache, v_cache = kv_cache
        if self.kv_calibration_max is not None:
            self._calibrate_kv_scales(k, v)
        backend.write_kv(k, v, k_cache, v_cache, meta, self.k_scale, self.v_scale)
        o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, self.k_scale, self.v_scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = Linear(c.hidden_size, {"gate": c.intermediate_size, "up": c.intermediate_size},
                                   dtype=dtype)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Attention(c, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = MLP(c, dtype)

    def forward(self, x, rot, kv_cache, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), rot, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.config = c
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, dtype)
        self.rope = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling, dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, dtype) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, dtype=dtype)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.method.tie(self.lm_head, self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any,
                backend: AttentionBackend) -> torch.Tensor:
        """`meta` is what backend.prepare() returned for this step; the model only passes it along."""
        x = self.embed_tokens(input_ids)
        rot = self.rope.at(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, rot, kv, meta, backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
