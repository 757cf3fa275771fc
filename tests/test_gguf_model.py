"""The default model (Q4_1 layers, Q8_0 embedding) served with its GGUF blocks kept, against the same
file expanded to fp32 (`--quantization none`), the reference; on each instruction-set path the CPU has."""
from __future__ import annotations

import pytest

from gpu_worker.kernels import native
from pagedserve import LLM, SamplingParams
from tests.hf_reference import assert_mostly_identical

pytestmark = pytest.mark.slow

ENGINE_CORE_TEXTS = ["The history of the printing press", "My favourite recipe for apple pie is",
                     "The planets of the solar system are", "Python is a programming language that",
                     "Once upon a time, in a land far away,", "The three primary colors are", "To be or not to be,",
                     "Machine learning is"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=32, logprobs=5, ignore_eos=True)


def run(default_tokenizer, quantization: str):
    llm = LLM(quantization=quantization, dtype="float32", kv_cache_memory=0.1, swap_space=0)
    prompts = [default_tokenizer.encode(t) for t in ENGINE_CORE_TEXTS]
    return llm.engine.weight_bytes, llm.generate(prompts, PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(default_tokenizer):
    return run(default_tokenizer, "none")


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_default_gguf_kept_quantized_is_small_and_agrees(default_tokenizer, reference, isa, force_isa):
    """At most 35% of the fp32 bytes, and greedy output identical on at least 75% of prompts over 32
    tokens, with the first divergence a near-tie (our token in the reference's top-5)."""
    force_isa(isa)
    if native.cpu_isa() < native.ISA_LEVELS[isa]:
        pytest.skip(f"this CPU has no {isa}")
    kept_bytes, kept = run(default_tokenizer, "gguf")
    ref_bytes, ref = reference
    assert kept_bytes <= 0.35 * ref_bytes, f"{kept_bytes / ref_bytes:.1%} of the fp32 bytes"
    assert_mostly_identical(kept, ref, 0.75)
