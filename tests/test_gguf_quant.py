"""GGUF weights kept quantized: every supported block type taken apart exactly as gguf-py expands it,
the native kernel (each instruction-set path) and the torch fallback against an fp64 reference, fused
layers of mixed types, and the tied embedding / lm_head sharing one packed table."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from gpu_worker.kernels import native
from gpu_worker.layers.embedding import VocabEmbedding
from gpu_worker.layers.linear import Linear
from gpu_worker.quantization import linear_method, resolve_quantization
from gpu_worker.quantization.gguf import GGUFTensor
from gpu_worker.quantization.gguf_blocks import SUPPORTED
from gpu_worker.quantization.packed import GEMM_MAX_ROWS, PANEL_MAX_ROWS, PANELS, VECTOR, GroupQuant, PackedWeight
from tests.gguf_files import gguf_tensor

pytestmark = pytest.mark.unit

def ref_weights(t: GGUFTensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(t.raw, t.qtype).astype(np.float32).reshape(t.shape))


@pytest.mark.parametrize("qtype", sorted(SUPPORTED, key=lambda q: q.name), ids=lambda q: q.name)
def test_blocks_expand_exactly_as_gguf_does(qtype, force_isa):
    t = gguf_tensor(qtype, 24, 512)
    pw = t.pack()
    want = ref_weights(t)
    assert torch.equal(pw.dequantize(), want)
    assert pw.bits == (4 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 8)
    assert native.available(), "the native kernels did not build; scripts/setup.sh builds them"
    for isa in native.ISA_LEVELS:          # levels above this CPU's are capped to what it has
        force_isa(isa)
        assert torch.equal(pw._dequantize_fast(native.library()), want), isa
    rows = torch.tensor([3, 0, 23, 3])
    assert torch.equal(pw.dequantize(rows), want[rows])


def isa_levels() -> list[str]:
    return ["portable", "avx2", "avx512"]


@pytest.mark.parametrize("isa", isa_levels())
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K, T.Q4_K, T.Q5_0], ids=lambda q: q.name)
def test_native_matmul_matches_fp64_reference(isa, qtype, force_isa):
    if not native.available():
        pytest.fail("the native kernels did not build; scripts/setup.sh builds them")
    force_isa(isa)
    if native.cpu_isa() < native.ISA_LEVELS[isa]:
        pytest.skip(f"this CPU has no {isa}")
    t = gguf_tensor(qtype, 40, 256, seed=1)
    pw, w = t.pack(), ref_weights(t).double()
    bias = torch.randn(40)
    for rows in (1, 3, 4, 5, 9, 16):     # all tile remainders, within the native GEMM's range
        x = torch.randn(rows, 256)
        got = pw.matmul(x, bias)
        want = x.double() @ w.t() + bias.double()
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-6, (rows, err)     # fp32 rounding of a different summation order


@pytest.mark.parametrize("isa", isa_levels())
def test_a_rows_result_does_not_depend_on_the_step_size(isa, force_isa):
    """Speculative verification runs k+1 rows where plain decoding runs one: every row of the native GEMM
    must come out bit-identical whatever the row count and whichever tile it lands in."""
    if not native.available():
        pytest.fail("the native kernels did not build; scripts/setup.sh builds them")
    force_isa(isa)
    if native.cpu_isa() < native.ISA_LEVELS[isa]:
        pytest.skip(f"this CPU has no {isa}")
    # 96: a K with an odd run count; Q6_K: groups of 16 (two scales a run)
    most = GEMM_MAX_ROWS[native.cpu_isa()]
    for qtype, k in ((T.Q4_1, 96), (T.Q8_0, 256), (T.Q4_K, 256), (T.Q6_K, 256)):
        pw = gguf_tensor(qtype, 24, k, seed=3).pack()
        x = torch.randn(most, k)
        alone = torch.cat([pw.matmul(x[i:i + 1]) for i in range(most)])
        for rows in sorted({2, 4, 5, 7, 8, 9, 16, 21, 33, most} & set(range(2, most + 1))):
            assert torch.equal(pw.matmul(x[:rows]), alone[:rows]), (qtype.name, rows)


@pytest.mark.parametrize("isa", isa_levels())
def test_four_bit_groups_of_sixteen(isa, force_isa):
    """4-bit values in groups of 16 (no GGUF type has them; an AWQ/GPTQ checkpoint may): each run of 32
    spans two groups, so the AVX-512 path expands it from two tables. Against fp64, and bit-identical
    across step sizes."""
    if not native.available():
        pytest.fail("the native kernels did not build; scripts/setup.sh builds them")
    force_isa(isa)
    if native.cpu_isa() < native.ISA_LEVELS[isa]:
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(5)
    n, k = 24, 96
    gq = GroupQuant(rng.integers(0, 16, (n, k)), rng.standard_normal((n, k // 16)).astype(np.float32),
                    rng.standard_normal((n, k // 16)).astype(np.float32), 16)
    pw = PackedWeight.from_groups(gq)
    assert (pw.bits, pw.group) == (4, 16)
    w = torch.from_numpy(gq.q * np.repeat(gq.scale, 16, axis=1).astype(np.float64)
                         + np.repeat(gq.offset, 16, axis=1))
    x = torch.randn(9, k)
    got = pw.matmul(x)
    want = x.double() @ w.t()
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-6
    assert torch.equal(torch.cat([pw.matmul(x[i:i + 1]) for i in range(9)]), got)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K, T.Q4_K], ids=lambda q: q.name)
def test_the_avx2_panels_take_the_steps_beyond_the_vector_kernel(qtype, force_isa):
    """kernels/qgemm_panel.cpp: steps of GEMM_MAX_ROWS + 1 to PANEL_MAX_ROWS rows on AVX2, against fp64 with
    a bias, for every row tail (16-row tiles, 8-row vectors) and a feature count that leaves a block of
    four; a row's result is the same whatever the step's size."""
    if not native.available():
        pytest.fail("the native kernels did not build; scripts/setup.sh builds them")
    force_isa("avx2")
    if native.cpu_isa() < native.ISA_LEVELS["avx2"]:
        pytest.skip("this CPU has no avx2")
    t = gguf_tensor(qtype, 40, 256, seed=4)
    pw, w = t.pack(), ref_weights(t).double()
    bias = torch.randn(40)
    x = torch.randn(PANEL_MAX_ROWS, 256)
    full = pw.matmul(x, bias)
    want = x.double() @ w.t() + bias.double()
    assert ((full.double() - want).abs().max() / want.abs().max()).item() < 1e-6
    first = GEMM_MAX_ROWS[native.cpu_isa()] + 1
    for rows in (first, 47, 48, 49, 57, 64, 100, PANEL_MAX_ROWS):
        assert pw.kernel_for(rows) == PANELS
        assert torch.equal(pw.matmul(x[:rows], bias), full[:rows]), rows
    assert pw.kernel_for(first - 1) == VECTOR and pw.kernel_for(PANEL_MAX_ROWS + 1) is None
    force_isa("portable")
    assert pw.kernel_for(first) is None               # portable code, as AVX-512 (unmeasured there): BLAS


def test_large_steps_and_the_torch_fallback_agree(monkeypatch):
    t = gguf_tensor(T.Q4_1, 64, 128, seed=2)
    pw, w = t.pack(), ref_weights(t)
    rows = max(GEMM_MAX_ROWS.values()) + 1
    x = torch.randn(rows, 128)                   # above GEMM_MAX_ROWS: expanded weights, BLAS GEMM
    want = x @ w.t()
    assert torch.allclose(pw.matmul(x), want, atol=1e-5)
    monkeypatch.setattr(native, "library", lambda: None)
    for rows in (1, rows):
        assert torch.allclose(pw.matmul(x[:rows]), want[:rows], atol=1e-5)


def test_a_fused_layer_of_mixed_types_keeps_every_shard():
    """Q4_K_M files mix types inside one fused projection (q/k in Q4_K, v in Q6_K): the shards are
    regrouped onto the finest grouping and widened to 8 bits together."""
    layer = Linear(256, {"q": 32, "k": 16, "v": 16}, bias=True, method=linear_method("gguf"))
    shards = {"q": gguf_tensor(T.Q4_K, 32, 256, 3), "k": gguf_tensor(T.Q4_0, 16, 256, 4),
              "v": gguf_tensor(T.Q6_K, 16, 256, 5)}
    for name, t in shards.items():
        layer.load("weight", t, name)
    layer.bias.data.normal_()
    layer.method.process_weights_after_loading(layer)
    assert layer.packed is not None and layer.packed.bits == 8 and layer.packed.group == 16
    assert "weight" not in dict(layer.named_parameters())
    w = torch.cat([ref_weights(shards[s]) for s in ("q", "k", "v")])
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    want = x.double() @ w.double().t() + layer.bias.double()
    # relative to the largest output: random k-quant blocks have scales of any magnitude
    assert ((layer(x).double() - want).abs().max() / want.abs().max()).item() < 1e-6


def test_a_plain_shard_in_a_quantized_layer_expands_the_layer():
    layer = Linear(64, {"gate": 8, "up": 8}, method=linear_method("gguf"))
    q = gguf_tensor(T.Q8_0, 8, 64, 6)
    plain = torch.randn(8, 64)
    layer.load("weight", q, "gate")
    layer.load("weight", plain, "up")
    layer.method.process_weights_after_loading(layer)
    assert layer.packed is None
    assert torch.equal(layer.weight, torch.cat([ref_weights(q), plain]))


def test_tied_embedding_and_lm_head_share_one_packed_table():
    emb = VocabEmbedding(96, 64, torch.float32)
    t = gguf_tensor(T.Q8_0, 96, 64, 7)
    emb.load("weight", t)
    head = Linear(64, 96, method=linear_method("gguf"))
    head.method.tie(head, emb)
    assert head.packed is emb.packed
    w = ref_weights(t)
    ids = torch.tensor([[5, 0], [95, 5]])
    assert torch.equal(emb(ids), w[ids])
    h = torch.randn(3, 64)
    assert torch.allclose(head(h), h @ w.t(), atol=1e-5)


def test_groups_that_are_not_powers_of_two_are_regrouped():
    rng = np.random.default_rng(8)
    gq = GroupQuant(rng.integers(0, 16, (4, 96)), rng.random((4, 2), dtype=np.float32),
                    rng.random((4, 2), dtype=np.float32), 48)
    pw = PackedWeight.from_groups(gq)
    assert pw.group == 16
    want = torch.from_numpy(np.repeat(gq.scale, 48, 1) * gq.q + np.repeat(gq.offset, 48, 1)).float()
    assert torch.allclose(pw.dequantize(), want)


def test_quantization_names_resolve_like_vllm():
    assert resolve_quantization("auto", "gguf") == "gguf"
    assert resolve_quantization("auto", None) == "none"
    assert resolve_quantization("auto", "awq") == "awq"
    assert resolve_quantization("gptq_marlin", "gptq") == "gptq"
    assert resolve_quantization("none", "gguf") == "none"
    assert resolve_quantization("fp8", None) == "fp8"
    with pytest.raises(ValueError, match="needs a GGUF checkpoint; this one is unquantized"):
        resolve_quantization("gguf", None)
    with pytest.raises(ValueError, match="needs an AWQ checkpoint; this one is GPTQ-quantized"):
        resolve_quantization("awq", "gptq")
    with pytest.raises(ValueError, match="unknown quantization 'fp4'"):
        resolve_quantization("fp4", "gguf")



def test_an_unknown_method_fails_the_cli_at_once(capsys):
    from pagedserve.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--quantization", "fp4"])
    assert exc.value.code == 2
    assert "--quantization 'fp4': expected one of auto, none, int8, fp8, gguf, awq, gptq" in capsys.readouterr().err


def test_gguf_on_a_safetensors_model_is_one_clear_error(tiny_model):
    from pagedserve import LLM
    with pytest.raises(ValueError, match="quantization 'gguf' needs a GGUF checkpoint; this one is unquantized"):
        LLM(str(tiny_model("llama")), dtype="float32", kv_cache_memory=0.01, swap_space=0, quantization="gguf")


TINY_TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q4_0, "attn_v": T.Q6_K, "attn_output": T.Q5_K, "ffn_gate": T.Q4_1,
              "ffn_up": T.Q5_0, "ffn_down": T.Q5_1}
TINY_SHAPES = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
               "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}


def write_tiny_gguf(path, shapes=TINY_SHAPES, types=TINY_TYPES):
    """A tiny llama GGUF (2 layers, hidden 256: k-quants need 256 inputs) whose matrices use every kept
    type, with an untied output."""
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, 2), (w.add_embedding_length, 256), (w.add_feed_forward_length, 512),
                       (w.add_head_count, 4), (w.add_head_count_kv, 2), (w.add_context_length, 128),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0), (w.add_vocab_size, 96)]:
        add(value)
    rng = np.random.default_rng(9)
    for name, qtype, shape in [("token_embd.weight", T.Q8_0, (96, 256)), ("output.weight", T.Q6_K, (96, 256))]:
        w.add_tensor(name, gguf_tensor(qtype, *shape, seed=len(name)).raw, raw_dtype=qtype)
    w.add_tensor("output_norm.weight", rng.random(256, dtype=np.float32))
    for layer in range(2):
        for part, qtype in types.items():
            t = gguf_tensor(qtype, *shapes[part], seed=layer * 10 + len(part))
            w.add_tensor(f"blk.{layer}.{part}.weight", t.raw, raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight", rng.random(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_tiny(path, quantization):
    from common.model_source import ModelSource
    from gpu_worker.weight_loader import load_model
    source = ModelSource.resolve(str(path))
    return load_model(source, source.model_config(), torch.float32, torch.device("cpu"), 128, quantization, "auto")


def test_a_gguf_file_of_every_type_loads_packed_to_the_same_weights(tmp_path):
    """The packed model's weights expand bit for bit to `--quantization none`'s, through the loader's row
    unpermute of q/k, the fused qkv and gate_up shards of mixed types, and the untied output."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    packed_model, ref = load_tiny(path, "gguf"), load_tiny(path, "none")
    ref_modules = dict(ref.named_modules())
    checked = 0
    for name, m in packed_model.named_modules():
        if getattr(m, "packed", None) is not None:
            assert torch.equal(m.packed.dequantize(), ref_modules[name].weight), name
            checked += 1
    assert checked == 2 * 4 + 2          # qkv, o, gate_up, down per layer; the embedding and the output


def test_a_malformed_gguf_tensor_is_one_error_naming_it(tmp_path):
    path = write_tiny_gguf(tmp_path / "bad.gguf", {**TINY_SHAPES, "attn_k": (64, 256)})
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.0.self_attn.k_proj.weight': "
                                         r"shape mismatch for weight\[k\]: checkpoint \(64, 256\), expected \(128, 256\)"):
        load_tiny(path, "gguf")


def test_a_type_we_do_not_keep_is_expanded_at_load_with_one_log_line(tmp_path, caplog):
    path = write_tiny_gguf(tmp_path / "q2k.gguf", types={**TINY_TYPES, "ffn_down": T.Q2_K})
    with caplog.at_level("INFO", logger="gpu_worker.gguf_tensors"):
        model, ref = load_tiny(path, "gguf"), load_tiny(path, "none")
    lines = [r.getMessage() for r in caplog.records if "not kept quantized" in r.getMessage()]
    assert lines == ["GGUF tensors of type Q2_K are not kept quantized: expanded to fp32 at load"]
    down = model.layers[0].mlp.down_proj
    assert down.packed is None and torch.equal(down.weight, ref.layers[0].mlp.down_proj.weight)
    assert model.layers[0].mlp.gate_up_proj.packed is not None
