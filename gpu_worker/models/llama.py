"""The Llama family (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm) over a flat batch, and
the base the other architectures' files extend (Phi-3, the MoE models, Gemma).

Inputs are the new tokens of every scheduled sequence concatenated into one [num_tokens] vector with
their positions; attention reads and writes the paged KV cache through the backend and the step's
metadata, so the model itself never sees sequences or padding. A layer with a sliding window passes it
to the backend, which masks keys outside it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from common.model_config import ModelConfig
from common.tp_layout import QUANT_ALIGN, even_split, head_shard
from gpu_worker.attention import AttentionBackend, cache_scale
from gpu_worker.layers.activation import exact_on_bf16, gated
from gpu_worker.layers.embedding import VocabEmbedding, gather_logits, vocab_part
from gpu_worker.layers.kv_rotation import KVCentres
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding, Rotation
from gpu_worker.models import native_stack
from gpu_worker.parallel import tp


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, layer: int, gemma_norm: bool = False):
        super().__init__()
        d, g = c.head_dim, tp()
        part = head_shard(c.num_heads, c.num_kv_heads, g.size, g.rank)    # this rank's heads
        self.num_heads, self.num_kv_heads, self.head_dim = part.num_heads, part.num_kv_heads, d
        self.scale = c.attn_scale
        self.window = c.layer_window(layer)
        self.softcap = c.attn_logit_softcapping
        q_rows, kv_rows = _rows(part.q_start, part.num_heads, d), _rows(part.kv_start, part.num_kv_heads, d)
        self.qkv_proj = Linear(c.hidden_size, {"q": c.num_heads * d, "k": c.num_kv_heads * d, "v": c.num_kv_heads * d},
                               bias=c.qkv_bias, dtype=dtype,
                               rows={"q": q_rows, "k": kv_rows, "v": kv_rows} if g.size > 1 else None)
        self.o_proj = Linear(c.num_heads * d, c.hidden_size, dtype=dtype, cols=q_rows if g.size > 1 else None)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, gemma_norm) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, gemma_norm) if c.qk_norm else None
        self.k_scale = self.v_scale = 1.0      # what an fp8 KV cache divides K and V by
        self.kv_calibration_max: float | None = None   # set: take the scales from the next forward pass
        self.kv_rotation: torch.Tensor | None = None   # fp8 caches: layers/kv_rotation.py
        self.kv_centres: KVCentres | None = None       # fp8 caches: centres and gains (same module)
        self.kv_centres_calibration = False           # set: measure kv_centres in the next forward pass
        self._kv_sink: torch.Tensor | None = None      # kv_centres.sink() at the current scales

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
        self._kv_sink = None
        self.k_scale = max(float(k.abs().amax()), 1e-6) / fmax
        self.v_scale = max(float(v.abs().amax()), 1e-6) / fmax

    def forward(self, x: torch.Tensor, rot: Rotation,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: Any,
                backend: AttentionBackend) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if qkv.dtype != rot.cos.dtype:    # a large step's bf16 product (narrow_activations): rope runs in fp32
            qkv = qkv.to(rot.cos.dtype)
        q, k, v = self.qkv_proj.split(qkv)
        t = x.shape[0]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rot.apply_(q, k)      # in place into the qkv output where the native kernel takes them
        r, c = self.kv_rotation, self.kv_centres
        if r is not None:         # the same orthogonal R on q, k and v: the scores and the output are unchanged
            if self.kv_centres_calibration:
                self.kv_centres_calibration = False
                c = self.kv_centres = KVCentres.measure(q, k, v, r, shift_keys=self.softcap is None)
            if c is not None:     # centred, position 0 around its own centres, keys balanced against queries
                q, k, v = c.apply(q, k, v, rot.first, r)
            else:
                q, k, v = q @ r, k @ r, v @ r
        k_cache, v_cache = kv_cache
        if self.kv_calibration_max is not None:
            self._calibrate_kv_scales(k, v)
        if c is not None and self._kv_sink is None:
            self._kv_sink = c.sink(r, cache_scale(k_cache.dtype, self.k_scale), cache_scale(v_cache.dtype, self.v_scale))
        backend.write_kv(k, v, k_cache, v_cache, meta, self.k_scale, self.v_scale,
                         None if c is None else c.key_feedback)
        o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, self.k_scale, self.v_scale,
                            window=self.window, softcap=self.softcap, sink=self._kv_sink)
        if r is not None:
            o = o.reshape(t, self.num_heads, self.head_dim) @ r.T
            if c is not None:
                o = c.restore(o)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype):
        super().__init__()
        g = tp()
        part = even_split(intermediate, g.size, QUANT_ALIGN)[g.rank] if g.size > 1 else None
        self.gate_up_proj = Linear(hidden, {"gate": intermediate, "up": intermediate}, dtype=dtype,
                                   rows={"gate": part, "up": part} if part else None)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, cols=part)
        self.act_and_mul = gated(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self.act_and_mul(gate, up))

    def bf16_input_rows(self) -> int | None:
        """Steps above this many rows may run the whole MLP in bf16 (input, gate_up's product, the
        activation, down's product), the values of converting at each product; None: never."""
        a, b = (m.method.bf16_input_rows(m) for m in (self.gate_up_proj, self.down_proj))
        return None if a is None or b is None or not exact_on_bf16(self.act_and_mul) else max(a, b)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, layer: int, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Attention(c, dtype, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = mlp

    def forward(self, x, rot, kv_cache, meta, backend, residual=None):
        """Returns (the MLP's output, the residual stream it adds to): the layer's output is their sum,
        which the next norm computes in the same pass as itself (RMSNorm.add_forward), as vLLM's layers
        do. `residual` None: x is the whole stream (the first layer)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_forward(residual, x)
        h = self.self_attn(h, rot, kv_cache, meta, backend)
        residual, h = self.post_attention_layernorm.add_forward(residual, h)
        return self.mlp(h), residual

    def narrow_activations(self) -> int:
        """Let each norm give its sublayer bf16 in the steps where every product it feeds runs on a bf16
        copy (layers/norm.py): the qkv projection, and a plain MLP all through. Returns how many norms."""
        self.input_layernorm.narrow_above = self.self_attn.qkv_proj.method.bf16_input_rows(self.self_attn.qkv_proj)
        mlp = self.mlp.bf16_input_rows() if isinstance(self.mlp, MLP) else None
        self.post_attention_layernorm.narrow_above = mlp
        return (self.input_layernorm.narrow_above is not None) + (mlp is not None)


class LlamaForCausalLM(nn.Module):
    """Subclasses change the parts through make_layer / make_mlp / rotations / embed, not the loop."""
    _native_stack: native_stack.NativeStack | None | bool = False     # False: not built yet (native_stack.build, lazily)

    def __init__(self, c: ModelConfig, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.config = c
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, dtype)
        self.rope = RotaryEmbedding(c.rotary_dim, max_positions, c.rope_theta, c.rope_scaling, dtype)
        self.layers = nn.ModuleList(self.make_layer(c, dtype, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        vocab = vocab_part(c.vocab_size)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, dtype=dtype,
                              rows={"": vocab} if vocab != (0, c.vocab_size) else None)

    def make_layer(self, c: ModelConfig, dtype: torch.dtype, layer: int) -> nn.Module:
        return DecoderLayer(c, dtype, layer, self.make_mlp(c, dtype, layer))

    def make_mlp(self, c: ModelConfig, dtype: torch.dtype, layer: int) -> nn.Module:
        return MLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype)

    def narrow_activations(self) -> int:
        """Large steps run the decoder layers' matmul inputs and outputs in bf16 where they can
        (DecoderLayer.narrow_activations; other layer kinds keep fp32). Returns the norms narrowed."""
        return sum(layer.narrow_activations() for layer in self.layers if isinstance(layer, DecoderLayer))

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.method.tie(self.lm_head, self.embed_tokens)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def rotations(self, positions: torch.Tensor, dtype: torch.dtype, seq_ends: torch.Tensor | None) -> list[Rotation]:
        """Each layer's rotation of this step's positions (one shared table here)."""
        return [self.rope.at(positions, dtype, seq_ends)] * self.config.num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any,
                backend: AttentionBackend, seq_ends: torch.Tensor | None = None) -> torch.Tensor:
        """`meta` is what backend.prepare() returned for this step, or a list of them per layer (a model
        whose layers read different KV groups, common/kv_layout.py); the model only passes it along.
        `seq_ends` [T]: each row's sequence's known length this step (LongRoPE reads it)."""
        x, residual = self.embed(input_ids), None
        stack = self.native_decoder()
        done = stack.run(x, positions, kv_caches, meta, seq_ends) if stack is not None else None
        if done is not None:
            return self.norm.add_forward(done[1], done[0])[1]
        metas = meta if isinstance(meta, list) else [meta] * len(self.layers)
        for layer, rot, kv, m in zip(self.layers, self.rotations(positions, x.dtype, seq_ends), kv_caches, metas):
            x, residual = layer(x, rot, kv, m, backend, residual)    # the stream is x + residual
        return self.norm(x) if residual is None else self.norm.add_forward(residual, x)[1]

    def native_decoder(self) -> native_stack.NativeStack | None:
        """The decoder layers as one native call (models/native_stack.py), built at the first step: by then
        the runner has set up what decides it (LoRA, narrowed norms, fp8 rotations)."""
        if self._native_stack is False:
            self._native_stack = native_stack.build(self)
        return self._native_stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head(hidden), self.config.vocab_size)


def _rows(first_head: int, num_heads: int, head_dim: int) -> tuple[int, int]:
    return first_head * head_dim, (first_head + num_heads) * head_dim
