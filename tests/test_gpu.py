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


def test_fp8_kv_cache_on_cuda_agrees_between_backends(tiny_model, default_tokenizer):
    """Compiled Triton kernels read an fp8 cache (native conversions) as the torch backend does."""
    assert torch.cuda.is_available(), "this test is for a machine with a GPU"
    prompts = [default_tokenizer.encode(t) for t in ("The quick brown fox", "Once upon a time in a land far away")]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for backend in ("triton", "torch"):
        llm = LLM(str(tiny_model("llama")), dtype="float32", device="cuda", attention_backend=backend,
                  num_gpu_blocks=256, kv_cache_dtype="fp8")
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs["triton"] == outs["torch"]


def test_gguf_kept_quantized_on_cuda(tmp_path):
    """Off the CPU the packed weights expand in torch: the same weights as the fp32 expansion."""
    assert torch.cuda.is_available(), "this test is for a machine with a GPU"
    from common.model_source import ModelSource
    from gpu_worker.weight_loader import load_model
    from tests.test_gguf_quant import write_tiny_gguf
    source = ModelSource.resolve(str(write_tiny_gguf(tmp_path / "tiny.gguf")))
    models = {q: load_model(source, source.model_config(), torch.float32, torch.device("cuda"), 128, q, "auto")
              for q in ("gguf", "none")}
    ref = dict(models["none"].named_modules())
    packed = [(n, m) for n, m in models["gguf"].named_modules() if getattr(m, "packed", None) is not None]
    assert len(packed) == 10
    for name, m in packed:
        assert torch.equal(m.packed.dequantize(), ref[name].weight), name
        x = torch.randn(3, m.packed.shape[1], device="cuda")
        torch.testing.assert_close(m.packed.matmul(x), x @ ref[name].weight.t(), atol=1e-4, rtol=1e-4)


def test_beam_search_on_cuda_equals_hugging_face(tmp_path, default_tokenizer):
    """Beam search through the Triton backend (forks sharing blocks, copy-on-write copies on the GPU)
    gives Hugging Face's beams on the same GPU, k = 2 and 4, under every length-penalty setting."""
    assert torch.cuda.is_available(), "this test is for a machine with a GPU"
    from transformers import AutoModelForCausalLM
    from loadtest.tiny_model import build_tiny_model
    from tests.test_beam_search import EOS, SETTINGS, assert_same_beams
    folder = build_tiny_model(tmp_path, "llama", default_tokenizer, eos_token_id=EOS)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    llm = LLM(str(folder), dtype="float32", device="cuda", attention_backend="triton", num_gpu_blocks=512, block_size=4)
    stopped = sum(assert_same_beams(llm, hf, k, 14, lp, es) for k in (2, 4) for lp, es in SETTINGS)
    assert stopped > 0
    llm.engine.scheduler.kv.check_all_free()
