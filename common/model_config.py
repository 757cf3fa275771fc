"""Architecture facts of a decoder-only model, read once from its Hugging Face config.json.

One flat dataclass serves every architecture we run: the Llama family (Llama, Mistral, Qwen2, Qwen3),
Phi-3, the mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) and Gemma 2/3. Each model file
reads only the fields it needs; the per-layer questions (is layer i windowed, is its MLP routed) are
answered here so that every model asks them the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe",
                   "gemma2", "gemma3_text")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0     # Phi-3 family: only the first fraction of each head rotates
    sliding_window: int | None = None      # keys a windowed layer's query sees, itself included
    layer_types: list[str] | None = None   # per layer SLIDING or FULL; None: every layer full
    # mixture of experts (Mixtral, Qwen MoE): 0 experts is a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True            # renormalize the top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE: an always-on expert behind a sigmoid gate
    dense_layers: list[int] = field(default_factory=list)   # layers whose MLP is dense in a MoE model
    # Gemma
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None   # attention scale is this ** -0.5 (default head_dim)
    local_rope_theta: float | None = None        # Gemma 3: windowed layers rotate with their own base

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = cfg.get("model_type", "")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model_type {arch!r}; expected one of {', '.join(SUPPORTED_ARCHS)}")
        rope = _rope_parameters(cfg)
        full_rope = rope.get(FULL, rope)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        n = cfg["num_hidden_layers"]
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=n,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(full_rope.get("rope_theta") or 10000.0),
            rope_scaling=_scaling(full_rope, cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.startswith("gemma"))),
            qkv_bias=arch in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            bos_token_id=cfg.get("bos_token_id"),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            partial_rotary_factor=float(full_rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
            sliding_window=cfg.get("sliding_window") or None,
            layer_types=_layer_types(cfg, arch, n),
            num_experts=experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", arch == "mixtral")),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
            dense_layers=_dense_layers(cfg, n) if experts else [],
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            local_rope_theta=_local_theta(cfg, rope),
        )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None where it attends to the whole context."""
        if self.layer_types is None or self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    @property
    def windows(self) -> list[int | None]:
        return [self.layer_window(i) for i in range(self.num_layers)]

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps rope settings in `rope_parameters` (per layer type for Gemma 3); older
    configs have rope_theta and rope_scaling at the top level."""
    rope = dict(cfg.get("rope_parameters") or {})
    if not rope:
        rope = dict(cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta"))
    return rope


def _scaling(rope: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The rope scaling of full-attention layers, or None for plain rope. LongRoPE (Phi-3) also takes the
    pretraining length and the attention factor that scales cos/sin."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        return None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = "longrope" if kind == "su" else kind
    if scaling["rope_type"] == "longrope":
        orig = scaling.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        factor = scaling.get("factor") or cfg.get("max_position_embeddings", orig) / orig
        scaling["original_max_position_embeddings"] = orig
        if scaling.get("attention_factor") is None:
            scaling["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return scaling


def _local_theta(cfg: dict[str, Any], rope: dict[str, Any]) -> float | None:
    if SLIDING in rope:
        local = rope[SLIDING]
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling {local['rope_type']!r} on windowed layers is not supported")
        return float(local["rope_theta"])
    return cfg.get("rope_local_base_freq")


def _layer_types(cfg: dict[str, Any], arch: str, n: int) -> list[str] | None:
    """Which layers are windowed: the config's layer_types where it has them, else each family's rule
    (Gemma 2 alternates, Gemma 3 has one full layer in every `sliding_window_pattern`; Mistral, Mixtral
    and Phi-3 window every layer when sliding_window is set; Qwen the layers from max_window_layers on,
    with use_sliding_window)."""
    window = cfg.get("sliding_window")
    if not window or window >= cfg.get("max_position_embeddings", window + 1):
        return None      # no window, or one no context reaches (Phi-3-128k's): full attention
    types = cfg.get("layer_types")
    if types:
        if len(types) != n or set(types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must be {n} of {SLIDING!r} / {FULL!r}, got {types}")
        return list(types) if SLIDING in types else None
    if arch.startswith("qwen"):          # HF: with use_sliding_window, the layers from max_window_layers on
        if not cfg.get("use_sliding_window", False):
            return None
        first = cfg.get("max_window_layers", 0)
        return [SLIDING if i >= first else FULL for i in range(n)] if first < n else None
    if cfg.get("use_sliding_window", True) is False:
        return None
    if arch == "gemma2":
        return [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    if arch == "gemma3_text":
        p = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        return [FULL if (i + 1) % p == 0 else SLIDING for i in range(n)]
    return [SLIDING] * n


def _dense_layers(cfg: dict[str, Any], n: int) -> list[int]:
    """Layers of a MoE model whose MLP is dense: mlp_only_layers, and those off the decoder_sparse_step."""
    step = cfg.get("decoder_sparse_step") or 1
    only = set(cfg.get("mlp_only_layers") or [])
    return [i for i in range(n) if i in only or (i + 1) % step != 0]
