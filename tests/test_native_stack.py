"""models/native_stack.py: a plain model's decoder layers in one native call per decode or verification step
give the layered path's floats, and every model or step it does not take falls back to the layers."""
from __future__ import annotations

import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as T

from gpu_worker.cpu_precision import bf16_hardware
from gpu_worker.kernels import native
from gpu_worker.models import native_stack
from gpu_worker.models.native_stack import NativeStack
from gpu_worker.quantization.packed import VECTOR_I16

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library did not build")


def _gguf(tiny_model, tmp_path, arch: str, qtype: T = T.Q4_1):
    from tests.gguf_files import from_hf_model
    folder = shutil.copytree(tiny_model(arch), tmp_path / arch)      # from_hf_model rewrites its folder
    return from_hf_model(folder, tmp_path / f"{arch}.gguf", {}, default=qtype), folder


def _awq(tiny_model, tmp_path, arch: str):
    from loadtest.quant_checkpoints import write_quantized
    folder = tmp_path / f"{arch}-awq"
    write_quantized(tiny_model(arch), folder, tmp_path / f"{arch}-ref", "awq")
    return folder


def _llm(path, folder, **kw):
    from pagedserve import LLM
    args = dict(tokenizer=str(folder), dtype="float32", kv_cache_memory=0.05, swap_space=0,
                enable_prefix_caching=False)
    return LLM(str(path), **(args | kw))


class StackCalls:
    """Counts the steps the stack ran (returned outputs for) and those it passed to the layers."""

    def __init__(self, monkeypatch) -> None:
        self.ran, self.passed = [], []
        run = NativeStack.run

        def counted(stack, x, *a):
            out = run(stack, x, *a)
            (self.passed if out is None else self.ran).append(x.shape[0])
            return out
        monkeypatch.setattr(NativeStack, "run", counted)


def _outputs(llm, prompts, sp):
    return [(o.outputs[0].token_ids, [r[0] for r in o.outputs[0].logprobs])
            for o in llm.generate(prompts, sp, use_tqdm=False)]


def _same_with_and_without(llm, prompts, sp, calls: StackCalls) -> None:
    model = llm.engine.executor.runner.model
    fused = _outputs(llm, prompts, sp)
    assert model.native_decoder() is not None and calls.ran, "the stack ran no step"
    model._native_stack = None                     # the layered path from here on
    layered = _outputs(llm, prompts, sp)
    for (ft, fl), (lt, ll) in zip(fused, layered):
        assert ft == lt
        assert fl == ll          # the sampled tokens' logprobs, bit for bit, not close


PROMPTS = [[(7 * j) % 500 + 11 for j in range(40)], [(3 * j) % 800 + 5 for j in range(9)],
           [(13 * j) % 300 + 40 for j in range(130)]]


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["portable", "avx2", "native"])
@pytest.mark.parametrize("kv", ["auto", "bfloat16"])
def test_decode_steps_through_the_stack_give_the_layered_floats(tiny_model, tmp_path, monkeypatch, force_isa,
                                                                 isa, kv):
    from pagedserve import SamplingParams
    if isa != "native":
        force_isa(isa)
    calls = StackCalls(monkeypatch)
    path, folder = _gguf(tiny_model, tmp_path, "llama")
    llm = _llm(path, folder, kv_cache_dtype=kv)
    try:
        sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in (12, 5, 8)]
        _same_with_and_without(llm, PROMPTS, sp, calls)
        assert {3, 2, 1} <= set(calls.ran)       # batches of three decodes, then two, then the last alone
        assert max(calls.passed) > 16                # the prefills took the layers
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_the_default_dtype_takes_the_stack_with_the_same_floats(tiny_model, tmp_path, monkeypatch):
    """--dtype auto, 12 decodes a step: on AMX the tile kernel on its held bf16 copy (kernel 1) with a bf16
    cache, on AVX2 int16 activations (without speculation the panels from I16_VECTOR_MAX_ROWS on); the
    stack's floats are the layers' either way."""
    from pagedserve import SamplingParams
    calls = StackCalls(monkeypatch)
    path, folder = _gguf(tiny_model, tmp_path, "llama")
    llm = _llm(path, folder, dtype="auto")
    try:
        prompts = [[(7 * i + 5 * j) % 600 + 13 for j in range(5 + i)] for i in range(12)]
        sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
        _same_with_and_without(llm, prompts, sp, calls)
        assert 12 in calls.ran, calls.ran
        down = llm.engine.executor.runner.model.layers[0].mlp.down_proj.packed
        assert (down.tiles is not None) == native.uses_amx()       # the AMX path where this CPU has it
        if bf16_hardware() is None:
            from gpu_worker.quantization.packed import I16_VECTOR_MAX_ROWS, PANELS_I16
            vector_rows = I16_VECTOR_MAX_ROWS.get(native.cpu_isa())
            assert down.int16_vector_rows == vector_rows
            assert down.kernel_for(12) == (VECTOR_I16 if vector_rows is None or vector_rows >= 12 else PANELS_I16)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_a_batch_beyond_the_vector_kernel_takes_the_panels_in_the_stack(tiny_model, tmp_path, monkeypatch,
                                                                        force_isa, dtype):
    """48 decodes a step on AVX2: every product on the panel kernel (PackedWeight.kernel_for), fp32 or,
    with --dtype auto's int16 activations (forced, so a CPU with bf16 hardware runs them too), the int16
    panels; inside the stack as in the layers. The prompts' prefill steps (above 40 rows) take them too."""
    from pagedserve import SamplingParams
    from gpu_worker.quantization.packed import PANELS, PANELS_I16
    force_isa("avx2")
    if native.cpu_isa() < native.ISA_LEVELS["avx2"]:
        pytest.skip("this CPU has no avx2")
    if dtype == "auto":
        monkeypatch.setenv("PAGEDSERVE_CPU_INT16", "1")
        monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "0")
    calls = StackCalls(monkeypatch)
    path, folder = _gguf(tiny_model, tmp_path, "llama")
    llm = _llm(path, folder, max_num_seqs=64, dtype=dtype)
    try:
        prompts = [[(5 * i + 3 * j) % 700 + 9 for j in range(6 + i % 5)] for i in range(48)]
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
        _same_with_and_without(llm, prompts, sp, calls)
        assert 48 in calls.ran, calls.ran
        want = PANELS_I16 if dtype == "auto" else PANELS
        assert llm.engine.executor.runner.model.layers[0].mlp.down_proj.packed.kernel_for(48) == want
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_verification_steps_and_qkv_bias_take_the_stack_too(tiny_model, tmp_path, monkeypatch):
    """Qwen2 (a bias on the qkv projection) as an AWQ checkpoint, with n-gram speculation: steps of k + 1
    rows a sequence."""
    from pagedserve import SamplingParams
    calls = StackCalls(monkeypatch)
    folder = _awq(tiny_model, tmp_path, "qwen2")
    llm = _llm(folder, folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 3})
    try:
        loop = [[17, 23, 29, 31] * 12, [5, 6, 7] * 15 + [8]]
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
        _same_with_and_without(llm, loop, sp, calls)
        assert max(calls.ran) > 2, calls.ran       # more rows than sequences: drafts verified in it
        attn = llm.engine.executor.runner.model.layers[0].self_attn
        assert attn.qkv_proj.bias is not None and attn.qkv_proj.packed is not None
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_int16_activations_in_the_stack_and_in_verification(tiny_model, tmp_path, monkeypatch):
    """--dtype auto's int16 activations (forced, so that a CPU with bf16 hardware runs them too): the
    stack's floats are the layers', and n-gram verification gives plain decoding's tokens and logprobs."""
    from pagedserve import SamplingParams
    if native.cpu_isa() < native.ISA_LEVELS["avx2"]:
        pytest.skip("this CPU has no avx2")
    monkeypatch.setenv("PAGEDSERVE_CPU_INT16", "1")
    monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "0")
    path, folder = _gguf(tiny_model, tmp_path, "llama")
    loop = [[17, 23, 29, 31] * 12, [5, 6, 7] * 15 + [8]]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    plain = _llm(path, folder, dtype="auto")
    try:
        assert plain.engine.executor.runner.model.layers[0].self_attn.qkv_proj.packed.kernel_for(1) == VECTOR_I16
        decoded = _outputs(plain, loop, sp)
    finally:
        plain.engine.shutdown()
    calls = StackCalls(monkeypatch)
    llm = _llm(path, folder, dtype="auto", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                             "prompt_lookup_max": 3})
    try:
        assert _outputs(llm, loop, sp) == decoded
        # speculation keeps every step up to GEMM_MAX_ROWS on the vector kernel
        assert llm.engine.executor.runner.model.layers[0].mlp.down_proj.packed.int16_vector_rows is None
        assert llm.stats.spec_num_draft_tokens > 0     # (SmolLM2 accepts them: test_spec_decode's default model)
        _same_with_and_without(llm, loop, sp, calls)
        assert max(calls.ran) > 2, calls.ran       # more rows than sequences: drafts verified in it
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_models_and_steps_it_does_not_take_run_the_layers(tiny_model, tmp_path, monkeypatch):
    """q/k norms (Qwen3) and an fp8 cache: no stack, or no step through it."""
    from pagedserve import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    folder = _awq(tiny_model, tmp_path, "qwen3")
    llm = _llm(folder, folder)
    try:
        llm.generate(PROMPTS[:1], sp, use_tqdm=False)
        assert llm.engine.executor.runner.model.native_decoder() is None
    finally:
        llm.engine.shutdown()
    calls = StackCalls(monkeypatch)
    path, folder = _gguf(tiny_model, tmp_path, "llama")
    llm = _llm(path, folder, kv_cache_dtype="fp8")
    try:
        llm.generate(PROMPTS[:2], sp, use_tqdm=False)
        assert not calls.ran           # the fp8 rotation (layers/kv_rotation.py) keeps the layers: no stack
        assert llm.engine.executor.runner.model.native_decoder() is None
    finally:
        llm.engine.shutdown()
    llm = _llm(path, folder, kv_cache_dtype="fp8", kv_cache_rotation=False)
    try:
        llm.generate(PROMPTS[:2], sp, use_tqdm=False)
        assert calls.passed and not calls.ran      # a stack, but no fp8 cache step goes through it
    finally:
        llm.engine.shutdown()


@pytest.mark.unit
def test_the_switch_and_the_plain_unquantized_model(monkeypatch, tiny_model):
    """PAGEDSERVE_NATIVE_STACK=0 builds none; fp32 weights (no packed products) build none either."""
    from common.config import EngineConfig
    from gpu_worker.model_runner import ModelRunner
    runner = ModelRunner(EngineConfig(model=str(tiny_model("llama")), dtype="float32", kv_cache_memory=0.05))
    assert native_stack.build(runner.model) is None         # its projections are plain fp32 weights
    monkeypatch.setenv("PAGEDSERVE_NATIVE_STACK", "0")
    assert not native_stack.enabled()
    monkeypatch.setenv("PAGEDSERVE_NATIVE_STACK", "1")
    assert native_stack.enabled()
