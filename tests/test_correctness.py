"""Greedy outputs equal Hugging Face transformers token for token, on every architecture and under every
engine configuration that changes how the work is split (prefix caching, token budget, block size,
batch size, preemption by recompute and by swap)."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.conftest import TINY_ARCHS
from tests.hf_reference import compare_greedy, hf_greedy

pytestmark = pytest.mark.slow

MAX_NEW = 12
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "In a small river town, the history of the mill began with a flood",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Paris is the capital of",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23",
    "Once upon a time there was a king who had three daughters, and the youngest of them was so beautiful that "
    "the sun itself was astonished whenever it shone upon her face.",
    "你好，世界！今天天气很好。",
    "a",
]


def prompt_ids(tokenizer) -> list[list[int]]:
    """Distinct prompts plus ones sharing long prefixes (prefix-cache hits) and exact repeats."""
    base = [tokenizer.encode(t) for t in TEXTS]
    shared = base[5]
    extra = [shared + tokenizer.encode(" She lived in a castle."), shared + tokenizer.encode(" The king was old."),
             list(shared), list(base[4])]
    return base + extra


def run_greedy(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW, logprobs: int | None = None):
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=logprobs)
    return llm.generate(prompts, sp, use_tqdm=False)


class Reference:
    """HF greedy results per distinct prompt, computed once."""

    def __init__(self, folder):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.cache: dict[tuple[int, ...], object] = {}

    def __call__(self, ids: list[int], max_new: int = MAX_NEW):
        key = (*ids, -max_new)
        if key not in self.cache:
            self.cache[key] = hf_greedy(self.model, ids, max_new, None)
        return self.cache[key]


def assert_matches(outputs, prompts, ref: Reference, logprob_tol: float | None = None) -> int:
    flips = 0
    for out, ids in zip(outputs, prompts):
        c = out.outputs[0]
        lps = [rec[0] for rec in c.logprobs] if c.logprobs else None
        cmp = compare_greedy(c.token_ids, lps, ref(ids))
        flips += cmp.flips
        if logprob_tol is not None:
            assert cmp.max_logprob_err < logprob_tol, f"logprob error {cmp.max_logprob_err}"
    return flips


@pytest.fixture(scope="module")
def llama_case(tiny_model, default_tokenizer):
    folder = tiny_model("llama")
    return folder, Reference(folder), prompt_ids(default_tokenizer)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_architectures_match_hf(arch, tiny_model, default_tokenizer):
    folder = tiny_model(arch)
    ref = Reference(folder)
    prompts = prompt_ids(default_tokenizer)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=0.02, swap_space=0)
    outs = run_greedy(llm, prompts, logprobs=1)
    flips = assert_matches(outs, prompts, ref, logprob_tol=1e-4)
    assert flips == 0, "fp32 tiny models should match exactly"


ENGINE_VARIANTS = {
    "prefix-caching-off": dict(enable_prefix_caching=False),
    "prefix-caching-on": dict(enable_prefix_caching=True),
    "budget-1": dict(max_num_batched_tokens=1),
    "budget-4": dict(max_num_batched_tokens=4),
    "budget-16": dict(max_num_batched_tokens=16),
    "block-8": dict(block_size=8),
    "block-16": dict(block_size=16),
    "block-32": dict(block_size=32),
}


@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
def test_engine_variants_match_hf(variant, llama_case):
    folder, ref, prompts = llama_case
    kwargs = dict(dtype="float32", kv_cache_memory=0.02, swap_space=0) | ENGINE_VARIANTS[variant]
    if variant == "budget-1":
        prompts = prompts[:3]          # one token per step: keep it short
    llm = LLM(str(folder), **kwargs)
    outs = run_greedy(llm, prompts)
    assert assert_matches(outs, prompts, ref) == 0
    if variant == "prefix-caching-on":
        # the repeated and prefix-sharing prompts found cached blocks; run it again: all of it is cached
        assert llm.stats.prefix_cache_hits > 0
        again = run_greedy(llm, prompts)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
        assert all(o.num_cached_tokens >= (len(p) - 1) // 16 * 16 for o, p in zip(again, prompts))
    if variant == "prefix-caching-off":
        assert llm.stats.prefix_cache_hits == 0


def test_batch_of_one_and_of_64_match_hf(llama_case):
    folder, ref, prompts = llama_case
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=0.05, swap_space=0)
    singles = [run_greedy(llm, [p])[0] for p in prompts[:4]]
    assert assert_matches(singles, prompts[:4], ref) == 0
    batch = (prompts * 6)[:64]
    outs = run_greedy(llm, batch)
    assert len(outs) == 64
    assert assert_matches(outs, batch, ref) == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_exact(mode, llama_case):
    folder, ref, prompts = llama_case
    # every sequence needs up to 4 blocks of 16; 12 blocks cannot hold the whole batch at once
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks=12, swap_space=0.001 if mode == "swap" else 0,
              enable_prefix_caching=False)
    outs = run_greedy(llm, prompts)
    assert assert_matches(outs, prompts, ref) == 0
    st = llm.stats
    assert st.num_preemptions > 0
    if mode == "swap":
        assert st.num_swap_preemptions > 0
    else:
        assert st.num_recompute_preemptions > 0 and st.num_swap_preemptions == 0
    assert llm.engine.scheduler.kv.num_free_blocks == 12


def test_default_model_matches_hf(default_tokenizer):
    """SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32) against transformers' own GGUF loader."""
    from transformers import AutoModelForCausalLM

    from common.model_source import ModelSource
    src = ModelSource.resolve(None)
    hf = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name,
                                              dtype=torch.float32).eval()
    texts = ["The history of the printing press", "My favourite recipe for apple pie is", "The planets of the solar system are",
             "Python is a programming language that", "Once upon a time, in a land far away,",
             "The three primary colors are", "To be or not to be,", "Machine learning is"]
    prompts = [default_tokenizer.encode(t) for t in texts]
    llm = LLM(dtype="float32", kv_cache_memory=0.1, swap_space=0)
    sp = SamplingParams(temperature=0.0, max_tokens=32, logprobs=1)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    flips = 0
    for out, ids in zip(outs, prompts):
        c = out.outputs[0]
        ref = hf_greedy(hf, ids, 32, default_tokenizer.eos_token_id)
        cmp = compare_greedy(c.token_ids, [r[0] for r in c.logprobs], ref)
        flips += cmp.flips
        assert cmp.max_logprob_err < 1e-4   # measured: at most 1.0e-5
    assert flips <= 1, f"{flips} near-tie flips in 8 prompts"


@pytest.mark.parametrize("variant", [dict(max_num_batched_tokens=8, block_size=8),
                                     dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                              "prompt_lookup_min": 1, "prompt_lookup_max": 3})],
                         ids=["chunked", "ngram-drafts"])
def test_phi3_sequences_crossing_long_rope_match_hf(variant, tiny_model, default_tokenizer):
    """The tiny Phi-3's pretraining length is 24: prompts below, across and above it, generating past it,
    so the switch to the long factors (and the recompute HF does there) happens mid-generation, under
    chunked prefill and under speculation."""
    folder = tiny_model("phi3")
    ref = Reference(folder)
    prompts = prompt_ids(default_tokenizer)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=0.02, swap_space=0, **variant)
    assert llm.engine.scheduler.config.long_rope_after == 24
    assert not llm.engine.scheduler.kv.enable_caching
    assert sum(len(p) <= 24 < len(p) + MAX_NEW for p in prompts) >= 2     # some cross while generating
    assert assert_matches(run_greedy(llm, prompts, logprobs=1), prompts, ref, logprob_tol=1e-4) == 0
