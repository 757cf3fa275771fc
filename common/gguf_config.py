"""A GGUF file's metadata as the Hugging Face config.json it stands for, in llama.cpp's conventions.

Translating to HF's keys (rather than building a ModelConfig directly) lets one parser,
ModelConfig.from_hf_config, own every architecture rule (layer types, rope scaling, expert layers).
Where llama.cpp fixes a fact in code instead of the file (Gemma 3's window pattern of 6 and its local
rope base of 10000, the 27B Gemmas' attention scale), it is fixed the same way here.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

# general.architecture -> model_type (Mixtral is written as "llama" with experts)
GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
              "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma2": "gemma2", "gemma3": "gemma3_text"}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}     # llama.cpp scales their queries by hidden / heads


def hf_config(arch: str, field: Callable[[str, Any], Any], tensor_names: set[str],
              tensor: Callable[[str], list[float]]) -> dict[str, Any]:
    """`field(key, default)` reads a metadata key, `tensor(name)` a small fp32 tensor's values."""
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; expected one of {', '.join(GGUF_ARCHS)}")
    g = lambda key, default=None: field(f"{arch}.{key}", default)  # noqa: E731
    heads, hidden = int(g("attention.head_count")), int(g("embedding_length"))
    head_dim = int(g("attention.key_length", hidden // heads))
    layers = int(g("block_count"))
    eos = field("tokenizer.ggml.eos_token_id", None)
    experts = int(g("expert_count", 0) or 0)
    cfg: dict[str, Any] = {
        "model_type": "mixtral" if arch == "llama" and experts else GGUF_ARCHS[arch],
        "vocab_size": int(g("vocab_size") or len(field("tokenizer.ggml.tokens", []))),
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)), "head_dim": head_dim,
        "intermediate_size": int(g("feed_forward_length", 0) or 0),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "eos_token_id": int(eos) if eos is not None else None,
        "bos_token_id": field("tokenizer.ggml.bos_token_id", None),
        "sliding_window": g("attention.sliding_window"),
    }
    scaling = g("rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    if experts:
        cfg.update(num_local_experts=experts, num_experts_per_tok=int(g("expert_used_count")),
                   moe_intermediate_size=int(g("expert_feed_forward_length", cfg["intermediate_size"])),
                   shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length", 0) or 0),
                   norm_topk_prob=bool(g("expert_weights_norm", arch != "qwen2moe")),
                   # a layer without a router is dense (Qwen2-MoE's mlp_only_layers)
                   mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names])
    if arch == "phi3":
        _phi3(cfg, g, tensor_names, tensor, head_dim)
    if arch in _GEMMA_27B_LAYERS:
        _gemma(cfg, arch, g, hidden, heads, head_dim, layers)
    return cfg


def _phi3(cfg: dict[str, Any], g, tensor_names: set[str], tensor, head_dim: int) -> None:
    cfg["partial_rotary_factor"] = int(g("rope.dimension_count", head_dim)) / head_dim
    if "rope_factors_long.weight" in tensor_names:
        cfg["original_max_position_embeddings"] = int(g("rope.scaling.original_context_length"))
        cfg["rope_scaling"] = {"rope_type": "longrope", "long_factor": tensor("rope_factors_long.weight"),
                               "short_factor": tensor("rope_factors_short.weight"),
                               "attention_factor": g("rope.scaling.attn_factor")}


def _gemma(cfg: dict[str, Any], arch: str, g, hidden: int, heads: int, head_dim: int, layers: int) -> None:
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["query_pre_attn_scalar"] = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    cfg["attn_logit_softcapping"] = g("attn_logit_softcapping")
    cfg["final_logit_softcapping"] = g("final_logit_softcapping")
    pattern = g("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):          # per layer: true where the layer is windowed
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:                                  # llama.cpp: layer i is windowed unless i % n == n - 1
        cfg["layer_types"] = ["full_attention" if i % pattern == pattern - 1 else "sliding_attention"
                              for i in range(layers)]
    if arch == "gemma3":
        cfg["rope_local_base_freq"] = float(g("rope.freq_base_swa", 10000.0))
