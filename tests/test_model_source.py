"""--model resolution and architecture parsing: clear errors for what is missing or unsupported."""
from __future__ import annotations

import json

import pytest

from common.config import ModelConfig
from common.model_source import DEFAULT_MODEL, ModelNotFound, ModelSource

pytestmark = pytest.mark.unit

TINY = dict(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
            max_position_embeddings=32768)


def test_default_model_is_the_smollm2_gguf():
    src = ModelSource.resolve(None)
    assert src.kind == "gguf" and src.name == DEFAULT_MODEL and src.path.is_file()
    mc = src.model_config()
    assert (mc.arch, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.tie_word_embeddings) == ("llama", 30, 9, 3, True)


def test_missing_model_names_what_was_expected(tmp_path):
    with pytest.raises(ModelNotFound, match="not found or not supported; expected nothing"):
        ModelSource.resolve(str(tmp_path / "nope"))


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json"):
        ModelSource.resolve(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **TINY}))
    with pytest.raises(ModelNotFound, match=r"no \*.safetensors"):
        ModelSource.resolve(str(tmp_path))
    assert ModelSource.resolve(str(tmp_path), require_weights=False).kind == "hf"


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_hf_config({"model_type": "gpt2", **TINY})


def test_sliding_window_caps_the_context_instead_of_changing_outputs():
    assert ModelConfig.from_hf_config({"model_type": "mistral", **TINY, "sliding_window": 4096}).max_context == 4096
    assert ModelConfig.from_hf_config({"model_type": "mistral", **TINY, "sliding_window": None}).max_context == 32768
    qwen = {"model_type": "qwen2", **TINY, "sliding_window": 4096, "use_sliding_window": False}
    assert ModelConfig.from_hf_config(qwen).max_context == 32768


def test_llama3_rope_scaling_and_qwen_flags_are_read():
    llama3 = ModelConfig.from_hf_config({"model_type": "llama", **TINY, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "rope_theta": 500000.0})
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.rope_theta == 500000.0
    assert ModelConfig.from_hf_config({"model_type": "qwen2", **TINY}).qkv_bias
    assert ModelConfig.from_hf_config({"model_type": "qwen3", **TINY, "head_dim": 16}).qk_norm
