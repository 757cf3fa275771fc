"""`--dtype auto` on a CPU with bf16 matrix hardware (gpu_worker/cpu_precision.py): the detection, the
bf16 weights each Linear method keeps, and the engine's mode end to end against fp32. The mode is forced
on with PAGEDSERVE_CPU_BF16=1 so that these run on any CPU (bf16 matmuls are emulated without the
hardware: slower, the same numbers)."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from gpu_worker import cpu_precision
from gpu_worker.layers.linear import Linear, low_precision_linear, prepack_bf16
from gpu_worker.quantization.packed import GEMM_MAX_ROWS
from gpu_worker.kernels import native
from tests.gguf_files import gguf_tensor

CPU = torch.device("cpu")


@pytest.mark.unit
def test_the_feature_comes_from_the_cpu_flags_and_the_environment_overrides(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    monkeypatch.delenv("PAGEDSERVE_CPU_BF16", raising=False)
    assert cpu_precision.cpu_flags(str(info)) >= {"avx512_bf16", "amx_bf16"}
    assert cpu_precision.bf16_hardware(frozenset({"avx2", "avx512_bf16", "amx_bf16"})) == "amx_bf16"
    assert cpu_precision.bf16_hardware(frozenset({"avx2", "avx512_bf16"})) == "avx512_bf16"
    assert cpu_precision.bf16_hardware(frozenset({"avx2", "fma"})) is None          # Zen 3
    assert cpu_precision.cpu_flags(str(tmp_path / "missing")) == frozenset()
    monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "0")
    assert cpu_precision.bf16_hardware(frozenset({"amx_bf16"})) is None
    monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "1")
    assert cpu_precision.bf16_hardware(frozenset()) == "forced"
    monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "maybe")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_BF16"):
        cpu_precision.bf16_hardware(frozenset())


@pytest.mark.unit
def test_only_auto_on_the_cpu_gets_bf16_matmuls(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "1")
    assert cpu_precision.matmul_dtype("auto", CPU) == torch.bfloat16
    assert cpu_precision.matmul_dtype("float32", CPU) is None           # the exact mode
    assert cpu_precision.matmul_dtype("bfloat16", CPU) is None          # bf16 throughout: the model's dtype
    assert cpu_precision.matmul_dtype("auto", torch.device("cuda")) is None
    monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "0")
    assert cpu_precision.matmul_dtype("auto", CPU) is None


@pytest.mark.unit
def test_auto_on_the_cpu_gets_a_bf16_kv_cache_with_or_without_bf16_hardware(monkeypatch):
    for forced in ("0", "1"):
        monkeypatch.setenv("PAGEDSERVE_CPU_BF16", forced)
        assert cpu_precision.kv_cache_dtype("auto", CPU) == torch.bfloat16
    assert cpu_precision.kv_cache_dtype("float32", CPU) is None          # the exact mode: the model's dtype
    assert cpu_precision.kv_cache_dtype("auto", torch.device("cuda")) is None


@pytest.mark.slow
def test_the_engine_resolves_kv_cache_auto_to_bf16_under_dtype_auto_on_a_cpu_without_bf16_hardware(tiny_model,
                                                                                                  monkeypatch):
    """--kv-cache-dtype auto: bf16 under --dtype auto (fp32 matmuls here), fp32 under --dtype float32;
    an explicit --kv-cache-dtype float32 wins over auto's choice."""
    from pagedserve import LLM
    monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "0")
    folder = str(tiny_model("llama"))
    got = {}
    for dtype, kv in (("auto", "auto"), ("float32", "auto"), ("auto", "float32")):
        llm = LLM(folder, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=0.02, swap_space=0)
        try:
            runner = llm.engine.executor.runner
            got[dtype, kv] = (runner.matmul_dtype, runner.kv_dtype)
        finally:
            llm.engine.shutdown()
    assert got == {("auto", "auto"): (None, torch.bfloat16), ("float32", "auto"): (None, torch.float32),
                   ("auto", "float32"): (None, torch.float32)}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.unit
def test_a_plain_layer_holds_bf16_weights_and_keeps_fp32_activations():
    torch.manual_seed(0)
    layer = Linear(96, {"a": 40, "b": 24}, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(5, 96)
    want = layer(x)
    layer.method.use_matmul_dtype(layer, torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    got = layer(x)
    assert got.dtype == torch.float32
    err = _rel_err(got, want)
    assert 1e-5 < err < 2e-2, err          # bf16 rounding of x and W: visible, small


@pytest.mark.unit
def test_packed_weights_keep_the_kernel_for_small_steps_and_bf16_beyond():
    pw = gguf_tensor(T.Q4_1, 64, 128, seed=2).pack()
    rows = max(GEMM_MAX_ROWS.values()) + 8
    x = torch.randn(rows, 128)
    before = pw.matmul(x)
    small = pw.matmul(x[:4])
    pw.keep_expanded(torch.bfloat16)
    assert pw.expanded is not None and pw.expanded.dtype == torch.bfloat16
    assert any(t is pw.expanded for t in pw.tensors)      # counted as resident weights
    if native.available():
        assert torch.equal(pw.matmul(x[:4]), small)      # the native kernel's steps are untouched
    got = pw.matmul(x)
    assert got.dtype == torch.float32
    err = _rel_err(got, before)
    assert 1e-5 < err < 2e-2, err


@pytest.mark.unit
@pytest.mark.parametrize("feature", ["amx_bf16", "avx512_bf16", "forced"])
def test_with_amx_the_bf16_expansion_takes_every_step_beyond_eight_rows(feature, monkeypatch):
    """On AMX tiles bf16 weights (the tile kernel, then the copy: tests/test_qgemm_amx.py) beat the native
    kernel from 9 rows (AMX_NATIVE_MAX_ROWS); with AVX512-BF16 dot products alone they do not, and the
    kernel keeps GEMM_MAX_ROWS. Which path ran is seen in the numbers: the kernel's fp32 products equal the
    packed weight's own, bf16 weights' do not."""
    from gpu_worker.quantization import packed_linear
    from gpu_worker.quantization.packed import AMX_NATIVE_MAX_ROWS
    from gpu_worker.quantization import linear_method
    monkeypatch.setattr(packed_linear, "bf16_hardware", lambda: feature)
    layer = Linear(128, 64, method=linear_method("gguf"))
    layer.packed = gguf_tensor(T.Q4_1, 64, 128, seed=5).pack()
    x = torch.randn(GEMM_MAX_ROWS[native.cpu_isa()], 128)
    exact = [layer.packed.matmul(x[:n]) for n in range(1, x.shape[0] + 1)]    # the kernel (or torch's fp32)
    layer.method.use_matmul_dtype(layer, torch.bfloat16)
    last = AMX_NATIVE_MAX_ROWS if feature == "amx_bf16" else GEMM_MAX_ROWS[native.cpu_isa()]
    assert layer.packed.max_native_rows() == min(last, GEMM_MAX_ROWS[native.cpu_isa()])
    if not native.available():
        return
    for n in range(1, x.shape[0] + 1):
        got = layer(x[:n])
        if n <= last:
            assert torch.equal(got, exact[n - 1]), n
        else:
            assert 1e-5 < _rel_err(got, exact[n - 1]) < 2e-2, n


@pytest.mark.unit
def test_a_prepacked_bf16_weight_gives_the_plain_weights_products():
    """Prepacking changes where oneDNN finds the weight, not the product: at row counts on both sides of
    the packed kernel's limit, and with a bias, the result is the plain bf16 weight's within fp32
    accumulation order; other dtypes come back untouched, and the resident-bytes count sees it."""
    from gpu_worker.weight_loader import weight_bytes
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 160, generator=g).bfloat16()
    bias = torch.randn(96, generator=g)
    packed = prepack_bf16(w)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert packed is w
        return
    assert packed.is_mkldnn and packed.dtype == torch.bfloat16 and packed.shape == w.shape
    for rows in (1, 7, 33, 300):
        x = torch.randn(rows, 160, generator=g)
        want = low_precision_linear(x, w, bias)
        got = low_precision_linear(x, packed, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, 96)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    fp32 = torch.randn(8, 8)
    assert prepack_bf16(fp32) is fp32
    layer = torch.nn.Module()
    layer.packed = type("P", (), {"tensors": (packed,)})()
    assert weight_bytes(layer) == 96 * 160 * 2


@pytest.mark.slow
def test_the_engine_in_bf16_matmul_mode_stays_close_to_fp32(tiny_model, monkeypatch):
    """LLM with --dtype auto and the mode forced on: bf16 matmuls and a bf16 KV cache; prompt and sampled
    logprobs stay within bf16's error of the fp32 engine's, over prefills of more than GEMM_MAX_ROWS rows."""
    from pagedserve import LLM, SamplingParams
    monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "1")
    folder = str(tiny_model("llama"))
    prompts = [[(7 * i + 3 * j) % 900 + 10 for j in range(60 + 9 * i)] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    runs = {}
    for dtype in ("auto", "float32"):
        llm = LLM(folder, dtype=dtype, kv_cache_memory=0.05, swap_space=0)
        runner = llm.engine.executor.runner
        runs[dtype] = (runner.matmul_dtype, runner.kv_dtype, llm.generate(prompts, sp, use_tqdm=False))
        llm.engine.shutdown()
    assert runs["auto"][:2] == (torch.bfloat16, torch.bfloat16)
    assert runs["float32"][:2] == (None, torch.float32)
    diffs = []
    for fast, exact in zip(runs["auto"][2], runs["float32"][2]):
        a = [rec[0] for rec in fast.prompt_logprobs[1:]]          # each prompt token's logprob
        b = [rec[0] for rec in exact.prompt_logprobs[1:]]
        assert a != b                               # the mode is on: bf16 rounding shows
        diffs += [abs(x - y) for x, y in zip(a, b)]
    # a random tiny model's logprobs span ~7 nats; wrong weights or a misread cache move them by whole nats
    assert max(diffs) < 0.25 and sum(diffs) / len(diffs) < 0.02, (max(diffs), sum(diffs) / len(diffs))


@pytest.mark.slow
def test_large_steps_with_bf16_activations_give_the_same_floats(tiny_model, tmp_path, monkeypatch):
    """models/llama.py narrow_activations: in steps the bf16 copies run, the norms, the MLP's activation
    and the products hand each other bf16 instead of converting at every product; the prompt logprobs
    and tokens of a prefill larger than the packed kernels' steps are bit for bit those of converting."""
    from pagedserve import LLM, SamplingParams
    from gpu_worker.layers.norm import RMSNorm
    from tests.gguf_files import from_hf_model
    import shutil
    monkeypatch.setenv("PAGEDSERVE_CPU_BF16", "1")
    folder = shutil.copytree(tiny_model("llama"), tmp_path / "llama")   # from_hf_model rewrites its folder
    path = from_hf_model(folder, tmp_path / "model.gguf", {}, default=T.Q4_1)
    llm = LLM(str(path), tokenizer=str(folder), dtype="auto", kv_cache_memory=0.05, swap_space=0,
              enable_prefix_caching=False)
    try:
        model = llm.engine.executor.runner.model
        norms = [m for m in model.modules() if isinstance(m, RMSNorm) and m.narrow_above is not None]
        if not native.available():
            assert not norms
            return
        assert len(norms) == 2 * len(model.layers)        # each layer's two, not the final norm
        seen = []
        out_dtype = RMSNorm._out_dtype
        monkeypatch.setattr(RMSNorm, "_out_dtype", lambda self, rows: seen.append(out_dtype(self, rows)) or seen[-1])
        prompts = [[(11 * j) % 900 + 10 for j in range(300)], [(5 * j) % 700 + 20 for j in range(17)]]
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=0)
        narrowed = llm.generate(prompts, sp, use_tqdm=False)
        assert torch.bfloat16 in seen and torch.float32 in seen    # the prefill narrowed, the decodes not
        for m in norms:
            m.narrow_above = None
        plain = llm.generate(prompts, sp, use_tqdm=False)
        for a, b in zip(narrowed, plain):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert [r[0] for r in a.prompt_logprobs[1:]] == [r[0] for r in b.prompt_logprobs[1:]]
            assert [r[0] for r in a.outputs[0].logprobs] == [r[0] for r in b.outputs[0].logprobs]
    finally:
        llm.engine.shutdown()
