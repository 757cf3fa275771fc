"""Shared fixtures: the default model's tokenizer and tiny random-weight models built at test time, and the
rule that every test carries exactly one tier marker."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.model_source import ModelSource

TINY_ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")   # llama3: Llama with Llama 3 rope scaling
TIERS = ("unit", "slow", "e2e", "gpu")


@pytest.hookimpl(tryfirst=True)     # before -m deselects anything: an unmarked test must not just vanish
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test belongs to exactly one tier, so `-m unit` (or slow, e2e, gpu) selects a whole, known set."""
    wrong = [f"{item.nodeid}: {tiers or 'no tier'}" for item in items
             if len(tiers := [t for t in TIERS if item.get_closest_marker(t)]) != 1]
    if wrong:
        raise pytest.UsageError("tests need exactly one of the markers " + ", ".join(TIERS) + ":\n" + "\n".join(wrong))


@pytest.fixture(scope="session")
def default_tokenizer():
    return ModelSource.resolve(None).load_tokenizer()


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
        cfg = tf.MistralConfig(**common, sliding_window=None)
        cls = tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**{**common, "tie_word_embeddings": True})
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32)
        cls = tf.Qwen3ForCausalLM
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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_tokenizer):
    """tiny_model(arch) -> folder path; each architecture is built once per session."""
    cache: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, default_tokenizer)
        return cache[arch]
    return get
