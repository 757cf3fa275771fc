"""Tiny random-weight models saved as Hugging Face folders: the one builder the tests (correctness against
HF, offline API, servers) and the microbenchmarks (serving overhead without model cost) all use."""
from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_model(folder: Path, arch: str, tokenizer, seed: int = 0, widen: bool = True, **overrides) -> Path:
    """Save a random-weight model of `arch` (with the default tokenizer) as a Hugging Face folder: the one
    builder every test uses. `widen` spreads the weights so greedy choices are rarely near-ties; without
    it the logits stay nearly flat (HF's own init). `overrides` replace config fields."""
    import transformers as tf
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False)
    common.update(overrides)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif arch == "llama3":   # small original context so the scaling changes the low frequencies
        cfg = tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        cls = tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(**{"sliding_window": None, **common})
        cls = tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**{**common, "tie_word_embeddings": True})
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32)
        cls = tf.Qwen3ForCausalLM
    elif arch == "phi3":     # LongRoPE with a short pretraining length (prompts cross it) and partial rotary
        rot = int(16 * 0.75) // 2
        cfg = tf.Phi3Config(**common, original_max_position_embeddings=24, pad_token_id=None, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(rot)], "long_factor": [1.0 + 2.0 * i for i in range(rot)]})
        cls = tf.Phi3ForCausalLM
    elif arch == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        cls = tf.MixtralForCausalLM
    elif arch == "qwen2_moe":   # a dense layer too, a shared expert, unnormalized top-k
        cfg = tf.Qwen2MoeConfig(**{**common, "num_hidden_layers": 3}, num_experts=6, num_experts_per_tok=2,
                                moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1])
        cls = tf.Qwen2MoeForCausalLM
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                head_dim=32, norm_topk_prob=True)
        cls = tf.Qwen3MoeForCausalLM
    elif arch == "gemma2":      # window 8: most prompts are longer; soft-capped attention and logits
        cfg = tf.Gemma2Config(**{**common, "num_hidden_layers": 3, "tie_word_embeddings": True}, head_dim=16,
                              sliding_window=8, query_pre_attn_scalar=16)
        cls = tf.Gemma2ForCausalLM
    elif arch == "gemma3":      # windowed layers around a full one, local and global rope bases
        cfg = tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 3, "tie_word_embeddings": True}, head_dim=16,
                                  sliding_window=8, query_pre_attn_scalar=16,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
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
