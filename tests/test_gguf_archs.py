"""GGUF files of every architecture beyond Llama (Phi-3, Mixtral, Qwen2/3-MoE, Gemma 2/3), written at test
time as llama.cpp's converter writes them, with k-quant matrices (Q4_K, Q5_K, Q6_K) beside Q8_0: loaded
expanded (`--quantization none`) they equal HF greedy on the same weights; kept packed they agree with it
up to near-ties (the packed matmul rounds differently)."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

from loadtest.tiny_model import build_tiny_model
from pagedserve import LLM, SamplingParams
from tests.gguf_files import from_hf_model
from tests.hf_reference import compare_greedy
from tests.test_correctness import Reference

pytestmark = pytest.mark.slow

# k-quants need 256 inputs per row: hidden 256 (head_dim 64), the MLPs' and experts' widths 256n
SIZES = dict(hidden_size=256, intermediate_size=512)
ARCH_SIZES = {"qwen2_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=256),
              "qwen3_moe": dict(moe_intermediate_size=256)}
QTYPES = {"attn_q": T.Q4_K, "attn_k": T.Q6_K, "attn_v": T.Q5_K, "attn_qkv": T.Q4_K, "attn_output": T.Q6_K,
          "ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q5_K, "ffn_down_exps": T.Q6_K, "ffn_gate": T.Q5_K,
          "ffn_up": T.Q4_K, "ffn_down": T.Q6_K}
ARCHS = ["phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3"]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of",
         "Once upon a time there was a king who had three daughters, and the youngest of them was so beautiful"]


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory, default_tokenizer):
    cases = {}

    def get(arch: str):
        if arch not in cases:
            folder = build_tiny_model(tmp_path_factory.mktemp(f"gguf-{arch}"), arch, default_tokenizer,
                                      **SIZES, **ARCH_SIZES.get(arch, {}))
            path = from_hf_model(folder, folder / "model.gguf", QTYPES)
            cases[arch] = folder, path, Reference(folder), [default_tokenizer.encode(t) for t in TEXTS]
        return cases[arch]
    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_expanded_equals_hf(arch, gguf_case):
    folder, path, ref, prompts = gguf_case(arch)
    llm = LLM(str(path), tokenizer=str(folder), quantization="none", dtype="float32", kv_cache_memory=0.05,
              swap_space=0)
    assert llm.engine.scheduler.config.max_model_len == 1024
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    for out, ids in zip(outs, prompts):
        c = out.outputs[0]
        cmp = compare_greedy(c.token_ids, [r[0] for r in c.logprobs], ref(ids, 10))
        assert cmp.flips == 0 and cmp.max_logprob_err < 1e-3, (arch, cmp)


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_kept_packed_agrees_with_hf(arch, gguf_case):
    folder, path, ref, prompts = gguf_case(arch)
    llm = LLM(str(path), tokenizer=str(folder), quantization="gguf", dtype="float32", kv_cache_memory=0.05,
              swap_space=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    exact = 0
    for out, ids in zip(outs, prompts):
        c = out.outputs[0]
        exact += compare_greedy(c.token_ids, [r[0] for r in c.logprobs], ref(ids, 10)).exact   # near-tie rule
    assert exact >= 2, f"{exact} of {len(prompts)} prompts identical"
