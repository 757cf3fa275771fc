"""AWQ (GEMM), GPTQ (v1/v2) and FP8 checkpoints written at test time (loadtest/quant_checkpoints.py) load
packed and give greedy output identical to HF transformers running their dequantized weights in fp32;
malformed checkpoints fail with one error naming the tensor."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.quantization.awq import AWQFormat
from gpu_worker.quantization.checkpoint import read_checkpoint_format
from gpu_worker.quantization.fp8 import FP8Format
from gpu_worker.kernels import native
from gpu_worker.quantization.gptq import GPTQFormat
from gpu_worker.quantization.packed import FP8_BITS, PackedWeight
from loadtest.tiny_model import build_tiny_model
from pagedserve import LLM
from loadtest.quant_checkpoints import (dequantized, fp8_parts, pack_awq, pack_gptq, quantize,
                                        write_fp8_per_channel_reference, write_quantized)
from tests.test_correctness import Reference, prompt_ids, run_greedy

PREFIX = "model.layers.0.mlp.up_proj"
GPTQ_CASES = {   # (bits, group, sym, desc_act, v2)
    "sym-g128": (4, 128, True, False, False), "asym-g32": (4, 32, False, False, False),
    "sym-actorder-g64": (4, 64, True, True, False), "asym-actorder-g32": (4, 32, False, True, False),
    "asym-rowgroup-v2": (4, -1, False, False, True), "8bit-actorder-g32": (8, 32, False, True, False),
}


def weights(n: int = 64, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1


@pytest.mark.unit
@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_gemm_unpacks_to_the_writers_weights(group):
    w = weights()
    q, zeros, scales, g_idx = quantize(w, group, 4, False, None)
    t = AWQFormat(group).build(PREFIX, pack_awq(q, zeros, scales))
    want = dequantized(q, zeros, scales, g_idx)
    assert torch.equal(t.dequantize(), want)
    x = torch.randn(3, w.shape[1])
    torch.testing.assert_close(t.pack().matmul(x), x @ want.T, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("case", GPTQ_CASES)
def test_gptq_unpacks_to_the_writers_weights(case):
    bits, group, sym, desc_act, v2 = GPTQ_CASES[case]
    w = weights()
    perm = np.random.default_rng(1).permutation(w.shape[1]) if desc_act else None
    q, zeros, scales, g_idx = quantize(w, group if group > 0 else w.shape[1], bits, sym, perm)
    fmt = GPTQFormat.from_config({"bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
                                  "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    t = fmt.build(PREFIX, pack_gptq(q, zeros, scales, g_idx, bits, v2))
    want = dequantized(q, zeros, scales, g_idx)
    assert torch.equal(t.dequantize(), want)
    packed = t.pack()
    assert (packed.perm is not None) == desc_act and packed.bits == (4 if bits == 4 else 8)
    for rows in (1, 5, 40):               # the native kernel's sizes and the expand-and-GEMM path
        x = torch.randn(rows, w.shape[1])
        torch.testing.assert_close(packed.matmul(x), x @ want.T, rtol=1e-5, atol=1e-4)


@pytest.mark.unit
def test_fp8_block_and_tensor_scales_dequantize():
    w = weights()
    for block in (None, [32, 64]):
        parts, want = fp8_parts(w, block)
        t = FP8Format(tuple(block) if block else None).build(PREFIX, parts)
        assert torch.equal(t.dequantize(), want)


@pytest.mark.unit
@pytest.mark.parametrize("isa", list(native.ISA_LEVELS))
def test_fp8_weights_in_the_native_kernel(isa, force_isa):
    """e4m3 bytes (subnormals and both signs included) times group scales, as the kernel expands them at
    each instruction-set level, against torch's own fp8 conversion; one row, a decode tile, the GEMM path."""
    assert native.available(), "the native kernels did not build; scripts/setup.sh builds them"
    force_isa(isa)
    gen = torch.Generator().manual_seed(3)
    values = (torch.randn(48, 192, generator=gen) * 40).to(torch.float8_e4m3fn)
    values[0, :32] = torch.tensor([2.0 ** -9 * i for i in range(-16, 16)]).to(torch.float8_e4m3fn)  # subnormals
    scale = torch.rand(48, 3, generator=gen) + 0.5
    pw = PackedWeight(values.view(torch.uint8), scale, torch.zeros_like(scale), FP8_BITS, 64)
    want = (values.float().view(48, 3, 64) * scale[:, :, None]).view(48, 192)
    assert torch.equal(pw.dequantize(), want)
    for rows in (1, 5, 40):
        x = torch.randn(rows, 192, generator=gen)
        # terms reach ~10^3, so float sums in another order differ by ~10^-4 (the scalar path)
        torch.testing.assert_close(pw.matmul(x), x @ want.T, rtol=1e-5, atol=1e-3)


@pytest.mark.unit
def test_malformed_parts_name_the_tensor():
    w = weights()
    q, zeros, scales, g_idx = quantize(w, 32, 4, False, None)
    parts = pack_awq(q, zeros, scales)
    with pytest.raises(ValueError, match=rf"'{PREFIX}.qzeros' has shape \(4, 8\), expected \(8, 8\)"):
        AWQFormat(32).build(PREFIX, {**parts, "qzeros": parts["qzeros"][:4]})
    with pytest.raises(ValueError, match=rf"'{PREFIX}.scales' is torch.int32"):
        AWQFormat(32).build(PREFIX, {**parts, "scales": parts["scales"].int()})
    gparts = pack_gptq(q, zeros, scales, g_idx, 4, False)
    with pytest.raises(ValueError, match=rf"'{PREFIX}.g_idx' names groups 0..8, expected 0..7"):
        bad = gparts["g_idx"].clone()
        bad[-1] = 8
        GPTQFormat(4, 32, False, 1).build(PREFIX, {**gparts, "g_idx": bad})
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        read_checkpoint_format({"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="only 4-bit GEMM"):
        read_checkpoint_format({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"})


@pytest.mark.unit
def test_assembly_waits_for_every_listed_part():
    q, zeros, scales, g_idx = quantize(weights(), 32, 4, True, None)
    parts = pack_gptq(q, zeros, scales, g_idx, 4, False)
    stream = [(f"{PREFIX}.scales", parts["scales"]), ("model.norm.weight", torch.ones(4)),
              (f"{PREFIX}.qzeros", parts["qzeros"]), (f"{PREFIX}.g_idx", parts["g_idx"]),
              (f"{PREFIX}.qweight", parts["qweight"])]
    fmt = GPTQFormat(4, 32, False, 1)
    out = list(fmt.assemble([n for n, _ in stream], iter(stream)))
    assert [n for n, _ in out] == ["model.norm.weight", f"{PREFIX}.weight"]
    assert torch.equal(out[1][1].dequantize(), dequantized(q, zeros, scales, g_idx))
    with pytest.raises(ValueError, match=r"\['qweight'\] of model.layers.0.mlp.up_proj were listed but never read"):
        list(fmt.assemble([n for n, _ in stream], iter(stream[:-1])))


# ---- whole models against HF ---------------------------------------------------------------------
CHECKPOINTS = {
    **{f"awq-g{g}": dict(method="awq", group=g) for g in (32, 64, 128)},
    **{f"gptq-{name}": dict(method="gptq", bits=b, group=g, sym=s, desc_act=d, v2=v)
       for name, (b, g, s, d, v) in GPTQ_CASES.items()},
    "gptq-actorder-unshared": dict(method="gptq", group=32, desc_act=True, shared_order=False),
    "fp8-tensor": dict(method="fp8"),
    "fp8-block": dict(method="fp8", fp8_block=[32, 64]),
}


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, default_tokenizer):
    """Inputs of 128 and 256 features, so groups of 32, 64 and 128 all fit."""
    return build_tiny_model(tmp_path_factory.mktemp("quant-base"), "qwen2", default_tokenizer,
                            hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_quantized_checkpoint_matches_hf_on_its_dequantized_weights(name, base_model, tmp_path, default_tokenizer):
    opts = CHECKPOINTS[name]
    write_quantized(base_model, tmp_path / "q", tmp_path / "ref", **opts)
    llm = LLM(str(tmp_path / "q"), dtype="float32", kv_cache_memory=0.02, swap_space=0)
    method = opts["method"]
    model = llm.engine.executor.runner.model
    kept = [path for path, m in model.named_modules()
            if getattr(m, "packed", None) is not None or hasattr(m, "w_fp8")]
    # act-order shards with different input orders cannot share one packing: those layers expand to fp32
    per_layer = ["self_attn.o_proj", "mlp.down_proj"] if opts.get("shared_order") is False else \
        ["self_attn.qkv_proj", "mlp.gate_up_proj", "self_attn.o_proj", "mlp.down_proj"]
    assert sorted(kept) == sorted(f"layers.{i}.{p}" for i in range(2) for p in per_layer)
    ref = Reference(tmp_path / "ref")
    prompts = prompt_ids(default_tokenizer)
    for out, ids in zip(run_greedy(llm, prompts, max_new=16), prompts):
        assert out.outputs[0].token_ids == ref(ids, 16).token_ids, f"{method}: {out.outputs[0].token_ids}"


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["shape", "missing"])
def test_a_malformed_checkpoint_is_one_error_naming_the_tensor(damage, base_model, tmp_path):
    from safetensors.torch import load_file, save_file
    write_quantized(base_model, tmp_path / "q", tmp_path / "ref", method="awq", group=32)
    path = tmp_path / "q" / "model.safetensors"
    state = load_file(str(path))
    name = "model.layers.1.self_attn.k_proj.qzeros"
    if damage == "shape":
        state[name] = state[name][:2]
        match = rf"'{name}' has shape \(2, 8\), expected \(4, 8\)"
    else:
        del state[name]
        match = "checkpoint layer 'model.layers.1.self_attn.k_proj' has no qzeros"
    save_file(state, str(path))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "q"), dtype="float32", kv_cache_memory=0.02, swap_space=0)


@pytest.mark.slow
def test_fp8_at_load_and_an_expanded_awq_match_hf(base_model, tmp_path, default_tokenizer):
    """`--quantization fp8` on an unquantized model equals HF on per-channel fp8 weights; `none` on an AWQ
    checkpoint expands it to fp32 (no layer stays packed) and still equals HF on its dequantized weights."""
    prompts = prompt_ids(default_tokenizer)
    write_fp8_per_channel_reference(base_model, tmp_path / "fp8-ref")
    write_quantized(base_model, tmp_path / "awq", tmp_path / "awq-ref", method="awq", group=64)
    for folder, quant, ref in ((base_model, "fp8", "fp8-ref"), (tmp_path / "awq", "none", "awq-ref")):
        llm = LLM(str(folder), dtype="float32", kv_cache_memory=0.02, swap_space=0, quantization=quant)
        modules = list(llm.engine.executor.runner.model.modules())
        fp8 = [m for m in modules if hasattr(m, "w_fp8") or getattr(getattr(m, "packed", None), "bits", 0) == FP8_BITS]
        assert len(fp8) == (8 if quant == "fp8" else 0)
        assert all(getattr(m, "packed", None) is None for m in modules if m not in fp8)
        reference = Reference(tmp_path / ref)
        for out, ids in zip(run_greedy(llm, prompts, max_new=16), prompts):
            assert out.outputs[0].token_ids == reference(ids, 16).token_ids, quant


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["awq-g64", "gptq-asym-actorder-g32", "gptq-8bit-actorder-g32"])
def test_quantized_checkpoint_on_cuda_matches_hf(name, base_model, tmp_path, default_tokenizer):
    """On CUDA the packed layers run the Triton GEMM (fp32 in IEEE precision): HF's greedy tokens exactly."""
    assert torch.cuda.is_available(), "this test is for a machine with a GPU"
    write_quantized(base_model, tmp_path / "q", tmp_path / "ref", **CHECKPOINTS[name])
    llm = LLM(str(tmp_path / "q"), dtype="float32", device="cuda", attention_backend="triton", num_gpu_blocks=256)
    ref = Reference(tmp_path / "ref")
    prompts = prompt_ids(default_tokenizer)
    for out, ids in zip(run_greedy(llm, prompts, max_new=16), prompts):
        assert out.outputs[0].token_ids == ref(ids, 16).token_ids
