"""CUDA checks, run by scripts/gpu_check.sh on a lent GPU (`pytest -m gpu`); deselected elsewhere.

The engine with the Triton backend must give Hugging Face's greedy tokens on the GPU: exactly in fp32,
and in bf16 with the near-tie rule (a flipped token must be in HF's top-5 there)."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.hf_reference import compare_greedy, hf_greedy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,exact", [("float32", True), ("bfloat16", False)])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_engine_matches_hf_on_cuda(arch, dtype, exact, tiny_model, default_tokenizer):
    assert torch.cuda.is_available(), "this test is for a machine with a GPU"
    from transformers import AutoModelForCausalLM
    folder = tiny_model(arch)
    tdtype = getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=tdtype).cuda().eval()
    prompts = [default_tokenizer.encode(t) for t in ("The quick brown fox", "Once upon a time in a land far away",
                                                     "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17")]
    llm = LLM(str(folder), dtype=dtype, device="cuda", attention_backend="triton", num_gpu_blocks=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    flips = 0
    for out, ids in zip(outs, prompts):
        ref = hf_greedy(hf, ids, 16, None)
        flips += compare_greedy(out.outputs[0].token_ids, None, ref).flips
    if exact:
        assert flips == 0
    else:
        assert flips <= 1
