"""Tiny random-weight models saved as Hugging Face folders: the one builder the tests (correctness against
HF, offline API, servers) and the microbenchmarks (serving overhead without model cost) all use."""
from __future__ import annotations

from pathlib import Path

import torch


def _phi3(head_dim: int) -> tuple[dict, str]:
    """LongRoPE with a short pretraining length (prompts cross it) and partial rotary."""
    rot = int(head_dim * 0.75) // 2
    return dict(original_max_position_embeddings=24, pad_token_id=None, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(rot)], "long_factor": [1.0 + 2.0 * i for i in range(rot)]}), \
        "Phi3ForCausalLM"


# arch -> (head_dim -> (config fields beyond the common ones, the HF model class))
_ARCHS = {
    "llama": lambda d: (dict(rope_theta=10000.0), "LlamaForCausalLM"),
    # small original context so the scaling changes the low frequencies
    "llama3": lambda d: (dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}), "LlamaForCausalLM"),
    "mistral": lambda d: (dict(sliding_window=None), "MistralForCausalLM"),
    "qwen2": lambda d: (dict(tie_word_embeddings=True), "Qwen2ForCausalLM"),
    "qwen3": lambda d: (dict(head_dim=2 * d), "Qwen3ForCausalLM"),
    "phi3": _phi3,
    "mixtral": lambda d: (dict(num_local_experts=4, num_experts_per_tok=2), "MixtralForCausalLM"),
    # a dense layer too, a shared expert, unnormalized top-k
    "qwen2_moe": lambda d: (dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=2 * d,
                                 shared_expert_intermediate_size=3 * d, mlp_only_layers=[1]), "Qwen2MoeForCausalLM"),
    "qwen3_moe": lambda d: (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=2 * d, head_dim=2 * d,
                                 norm_topk_prob=True), "Qwen3MoeForCausalLM"),
    # window 8: most prompts are longer; soft-capped attention and logits
    "gemma2": lambda d: (dict(num_hidden_layers=3, tie_word_embeddings=True, head_dim=d, sliding_window=8,
                              query_pre_attn_scalar=d), "Gemma2ForCausalLM"),
    # windowed layers around a full one, local and global rope bases
    "gemma3": lambda d: (dict(num_hidden_layers=3, tie_word_embeddings=True, head_dim=d, sliding_window=8,
                              query_pre_attn_scalar=d,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                         "Gemma3ForCausalLM"),
}


def build_tiny_model(folder: Path, arch: str, tokenizer, seed: int = 0, widen: bool = True, **overrides) -> Path:
    """Save a random-weight model of `arch` (with the default tokenizer) as a Hugging Face folder: the one
    builder every test uses. `widen` spreads the weights so greedy choices are rarely near-ties; without
    it the logits stay nearly flat (HF's own init). `overrides` replace config fields."""
    import transformers as tf
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False)
    if arch not in _ARCHS:
        raise ValueError(f"no tiny builder for {arch!r}; expected one of {', '.join(_ARCHS)}")
    head_dim = overrides.get("hidden_size", 64) // overrides.get("num_attention_heads", 4)
    extra, cls = _ARCHS[arch](head_dim)
    cfg = getattr(tf, cls.replace("ForCausalLM", "Config").replace("Gemma3Config", "Gemma3TextConfig"))(
        **{**common, **extra, **overrides})
    cls = getattr(tf, cls)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():   # random init is tiny; widen it so logits are not all near-ties
        for name, p in model.named_parameters() if widen else ():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "bias" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
