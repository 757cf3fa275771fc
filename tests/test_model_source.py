"""--model resolution and architecture parsing: clear errors for what is missing or unsupported."""
from __future__ import annotations

import json
import math

import pytest

from common.model_config import ModelConfig
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


def test_sliding_windows_are_per_layer_and_do_not_cap_the_context():
    six = {**TINY, "num_hidden_layers": 6}
    mistral = ModelConfig.from_hf_config({"model_type": "mistral", **six, "sliding_window": 4096})
    assert mistral.windows == [4096] * 6 and mistral.max_context == 32768
    assert ModelConfig.from_hf_config({"model_type": "mistral", **six, "sliding_window": None}).windows == [None] * 6
    qwen = {"model_type": "qwen2", **six, "sliding_window": 4096, "use_sliding_window": False}
    assert ModelConfig.from_hf_config(qwen).windows == [None] * 6
    assert ModelConfig.from_hf_config({**qwen, "use_sliding_window": True, "max_window_layers": 4}).windows == \
        [None] * 4 + [4096] * 2           # HF's Qwen: the layers from max_window_layers on
    assert ModelConfig.from_hf_config({**qwen, "use_sliding_window": None}).windows == [None] * 6
    # the family rules where a config has no layer_types, and layer_types where it has them
    assert ModelConfig.from_hf_config({"model_type": "gemma2", **six, "sliding_window": 8}).windows == [8, None] * 3
    assert ModelConfig.from_hf_config({"model_type": "gemma3_text", **six, "sliding_window": 8,
                                       "sliding_window_pattern": 3}).windows == [8, 8, None] * 2
    given = ["full_attention", "sliding_attention"] * 3
    assert ModelConfig.from_hf_config({"model_type": "qwen3", **six, "sliding_window": 8,
                                       "layer_types": given}).windows == [None, 8] * 3
    with pytest.raises(ValueError, match="layer_types must be 6"):
        ModelConfig.from_hf_config({"model_type": "qwen3", **six, "sliding_window": 8, "layer_types": given[:5]})


def test_moe_phi3_and_gemma_fields_are_read():
    qwen_moe = ModelConfig.from_hf_config({"model_type": "qwen2_moe", **{**TINY, "num_hidden_layers": 4},
                                           "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
                                           "shared_expert_intermediate_size": 6, "decoder_sparse_step": 2,
                                           "mlp_only_layers": [3]})
    assert [qwen_moe.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert (qwen_moe.num_experts, qwen_moe.norm_topk_prob, qwen_moe.qkv_bias) == (8, False, True)
    mixtral = ModelConfig.from_hf_config({"model_type": "mixtral", **TINY, "num_local_experts": 4,
                                          "num_experts_per_tok": 2})
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 8
    phi3 = ModelConfig.from_hf_config({"model_type": "phi3", **TINY, "partial_rotary_factor": 0.5,
                                       "original_max_position_embeddings": 4096, "rope_scaling": {
                                           "type": "su", "long_factor": [2.0, 2.0], "short_factor": [1.0, 1.0]}})
    assert phi3.rotary_dim == 2 and phi3.rope_scaling["rope_type"] == "longrope"
    assert phi3.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(8) / math.log(4096)) ** 0.5)
    gemma3 = ModelConfig.from_hf_config({"model_type": "gemma3_text", **TINY, "sliding_window": 4, "head_dim": 4,
                                         "query_pre_attn_scalar": 16, "rope_parameters": {
                                             "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert (gemma3.rope_theta, gemma3.local_rope_theta, gemma3.attn_scale) == (1e6, 1e4, 0.25)
    assert gemma3.tie_word_embeddings and gemma3.qk_norm


def test_llama3_rope_scaling_and_qwen_flags_are_read():
    llama3 = ModelConfig.from_hf_config({"model_type": "llama", **TINY, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "rope_theta": 500000.0})
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.rope_theta == 500000.0
    assert ModelConfig.from_hf_config({"model_type": "qwen2", **TINY}).qkv_bias
    assert ModelConfig.from_hf_config({"model_type": "qwen3", **TINY, "head_dim": 16}).qk_norm


def test_gguf_metadata_follows_llama_cpp_where_the_file_is_silent():
    from common.gguf_config import hf_config

    def config(arch, fields, tensors=()):
        base = {f"{arch}.attention.head_count": 8, f"{arch}.embedding_length": 512, f"{arch}.block_count": 12,
                f"{arch}.feed_forward_length": 64, f"{arch}.vocab_size": 10, **fields}
        return ModelConfig.from_hf_config(hf_config(arch, lambda k, d=None: base.get(k, d),
                                                    {"output.weight", *tensors}, lambda name: [1.0, 2.0]))
    gemma3 = config("gemma3", {"gemma3.attention.sliding_window": 16, "gemma3.attention.key_length": 32})
    assert gemma3.windows == ([16] * 5 + [None]) * 2          # llama.cpp's fixed pattern of 6
    assert (gemma3.local_rope_theta, gemma3.attn_scale, gemma3.hidden_act) == (10000.0, 32 ** -0.5, "gelu_pytorch_tanh")
    big = config("gemma2", {"gemma2.block_count": 46, "gemma2.attention.sliding_window": 16,
                            "gemma2.attention.key_length": 32})
    assert big.attn_scale == (512 // 8) ** -0.5 and big.windows[:4] == [16, None, 16, None]   # 27B: hidden / heads
    mixtral = config("llama", {"llama.expert_count": 8, "llama.expert_used_count": 2},
                     [f"blk.{i}.ffn_gate_inp.weight" for i in range(12)])
    assert (mixtral.arch, mixtral.num_experts, mixtral.dense_layers, mixtral.norm_topk_prob) == ("mixtral", 8, [], True)
    phi3 = config("phi3", {"phi3.rope.dimension_count": 32, "phi3.context_length": 4096,
                           "phi3.rope.scaling.original_context_length": 1024},
                  ["rope_factors_long.weight", "rope_factors_short.weight"])
    assert phi3.rotary_dim == 32 and phi3.rope_scaling["long_factor"] == [1.0, 2.0]
    assert phi3.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(4) / math.log(1024)) ** 0.5)
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        config("gpt2", {})
