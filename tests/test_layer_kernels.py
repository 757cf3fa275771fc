"""The native kernels for a decoder layer's glue (rms_norm.cpp's residual add, rope.cpp, silu_mul.cpp,
kv_write.cpp) against the torch ops they replace, on every instruction-set level: the same floats where
the ops only round (the add, the rotation, the cache's conversion), within a few ulp where the kernel
computes e^x its own way (silu). And each falls back to torch for what it does not take."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.attention import cpu_attention
from gpu_worker.kernels import native
from gpu_worker.layers.activation import gated
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.unit

ISAS = list(native.ISA_LEVELS)


@pytest.fixture(autouse=True)
def _built():
    assert native.available(), "the native kernels did not build; scripts/setup.sh builds them"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_add_norm_is_the_add_then_the_norm(isa, rows, force_isa):
    force_isa(isa)
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5, torch.float32)
    norm.weight.data.normal_()
    x, d = torch.randn(rows, 576) * 3, torch.randn(rows, 576)
    total, y = norm.add_forward(x, d)
    assert torch.equal(total, x + d)
    assert torch.equal(y, norm(x + d))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_bf16_norm_outputs_are_the_fp32_outputs_rounded_as_torch_rounds(isa, rows, force_isa):
    """narrow_above: steps above it get the norm in bf16, the fp32 result rounded once, as the next
    matmul's own conversion would; the residual add takes a bf16 delta (a bf16 product) exactly."""
    force_isa(isa)
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5, torch.float32)
    norm.weight.data.normal_()
    x, d = torch.randn(rows, 576) * 3, torch.randn(rows, 576)
    want_y, (want_total, want_added) = norm(x), norm.add_forward(x, d)
    norm.narrow_above = 4
    narrow = rows > 4
    y = norm(x)
    assert y.dtype == (torch.bfloat16 if narrow else torch.float32)
    assert torch.equal(y, want_y.to(y.dtype))
    for delta in (d, d.bfloat16()):
        total, added = norm.add_forward(x, delta)
        assert torch.equal(total, x + delta.float())
        want = want_added if delta is d else norm.add_forward(x, delta.float())[1]
        assert added.dtype == y.dtype and torch.equal(added, want.to(y.dtype))


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_rounding_is_torchs_on_ties_specials_and_subnormals(isa, force_isa):
    """A row of ones with eps 0 normalizes to itself, so the output is the weight rounded by the kernel:
    ties to even either way, infinities, NaN, -0, subnormals and the largest floats, against torch."""
    force_isa(isa)
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x3F80_8001, 0xBF808000, 0x7F7FFFFF, 0xFF7FFFFF,
                         0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x00808000, 0x7FC00000, 0x7F800001],
                        dtype=torch.int64).to(torch.int32)
    special = bits.view(torch.float32)
    w = torch.cat([special, torch.randn(64 - len(special))])
    norm = RMSNorm(64, 0.0, torch.float32)
    norm.weight.data.copy_(w)
    norm.narrow_above = 0
    y = norm(torch.ones(3, 64))
    want = w.to(torch.bfloat16).expand(3, 64)
    nan = want.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_add_norm_falls_back_off_its_kernel():
    """bf16 rows (not the kernel's) get torch's add and norm; the inputs are never written."""
    norm = RMSNorm(64, 1e-6, torch.bfloat16)
    x, d = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    x0 = x.clone()
    total, y = norm.add_forward(x, d)
    assert torch.equal(total, x0 + d) and torch.equal(y, norm(x0 + d)) and torch.equal(x, x0)


def _qkv_views(rows: int, hq: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model has them: [T, H, D] views into one fused projection output."""
    qkv = torch.randn(rows, (hq + 2 * hkv) * d) * 2
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    return q.reshape(rows, hq, d), k.reshape(rows, hkv, d), v.reshape(rows, hkv, d)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (96, 96), (80, 40), (40, 40)])
def test_rope_in_place_is_the_torch_rotation_bit_for_bit(isa, head_dim, rotary_dim, force_isa):
    """Full and partial rotary, head sizes off the vector widths, on views with rows apart (qkv output)."""
    force_isa(isa)
    torch.manual_seed(head_dim + rotary_dim)
    rope = RotaryEmbedding(rotary_dim, 4096, 10000.0, None, torch.float32)
    pos = torch.tensor([0, 1, 17, 4095, 300, 9, 2048])
    q, k, v = _qkv_views(len(pos), 9, 3, head_dim)
    rot = rope.at(pos, torch.float32)
    want_q, want_k = rot.apply(q, k)
    v0, base = v.clone(), q._base
    got_q, got_k = rot.apply_(q, k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr(), "not in place"
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(v, v0) and q._base is base


def test_rope_falls_back_for_what_the_kernel_does_not_take():
    """bf16 tensors, and heads not side by side in a row, get the out-of-place torch rotation."""
    rope = RotaryEmbedding(64, 64, 10000.0, None, torch.float32)
    pos = torch.arange(5)
    rot = rope.at(pos, torch.float32)
    q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    qt, kt = q.transpose(0, 1).contiguous().transpose(0, 1), k        # heads apart: stride(1) != D
    want = rot.apply(qt, kt)
    got = rot.apply_(qt, kt)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    rot16 = rope.at(pos, torch.bfloat16)
    q16, k16 = q.bfloat16(), k.bfloat16()
    got16, want16 = rot16.apply_(q16.clone(), k16.clone()), rot16.apply(q16, k16)
    assert torch.equal(got16[0], want16[0]) and torch.equal(got16[1], want16[1])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 13), (130, 200)])
def test_silu_mul_is_within_a_few_ulp_of_torch(isa, rows, inter, force_isa):
    """The fused gate_up output's halves; the tail past the last 8 entries (13, 200) takes the same path.
    Values up to +-100 reach the exponential's clamps (silu's 0 and g)."""
    force_isa(isa)
    torch.manual_seed(rows * inter)
    gate_up = torch.randn(rows, 2 * inter) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.split(inter, dim=1)
    got = gated("silu")(gate, up)
    want = F.silu(gate) * up
    torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)
    assert got.shape == (rows, inter) and got.is_contiguous()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 13), (130, 200)])
def test_bf16_silu_mul_is_the_fp32_kernel_on_the_widened_halves_rounded_once(isa, rows, inter, force_isa):
    """A bf16 product's halves in, bf16 out (a large step's MLP, layers/norm.py): bit for bit the fp32
    kernel's result on the same values, rounded as torch rounds, tails included."""
    force_isa(isa)
    torch.manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter) * 4).bfloat16()
    got = gated("silu")(*gate_up.split(inter, dim=1))
    want = gated("silu")(*gate_up.float().split(inter, dim=1)).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inter)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_silu_mul_falls_back_and_other_activations_stay_torch():
    torch.manual_seed(0)
    gate, up = torch.randn(4, 8), torch.randn(4, 8)       # separate tensors: not halves of one row
    assert torch.equal(gated("silu")(gate, up), F.silu(gate) * up)
    gelu = gated("gelu_pytorch_tanh")
    assert torch.equal(gelu(gate, up), F.gelu(gate, approximate="tanh") * up)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kv_write_stores_what_index_copy_stores(isa, cache_dtype, force_isa):
    """Rows from qkv views into scattered slots, bit for bit as to(dtype) + index_copy_ store them,
    rounding ties and infinities included; the other slots are untouched."""
    force_isa(isa)
    torch.manual_seed(1)
    blocks, bs, hkv, d = 6, 16, 3, 64
    k, v = _qkv_views(9, 9, hkv, d)[1:]
    k[0, 0, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 3e38])
    slots = torch.tensor([5, 0, 95, 17, 16, 40, 41, 63, 2])
    want_k = torch.randn(blocks, bs, hkv, d).to(cache_dtype)
    want_v = torch.randn(blocks, bs, hkv, d).to(cache_dtype)
    got_k, got_v = want_k.clone(), want_v.clone()
    want_k.view(-1, hkv, d).index_copy_(0, slots, k.to(cache_dtype))
    want_v.view(-1, hkv, d).index_copy_(0, slots, v.to(cache_dtype))
    assert cpu_attention.write_kv(k, v, got_k, got_v, slots)
    nan = want_k.isnan()
    assert torch.equal(got_k.isnan(), nan) and nan.sum() == 1     # NaN stays NaN (torch's own bits vary by path)
    bits = torch.int16 if cache_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got_k.view(bits)[~nan], want_k.view(bits)[~nan])
    assert torch.equal(got_v, want_v)


def test_kv_write_leaves_other_caches_to_torch():
    """fp8 and fp16 caches, and bf16 rows, are not the kernel's: it says so and writes nothing."""
    k = v = torch.randn(2, 3, 64)
    slots = torch.tensor([0, 1])
    for dtype in (torch.float8_e4m3fn, torch.float16):
        cache = torch.zeros(1, 16, 3, 64, dtype=dtype)
        assert not cpu_attention.write_kv(k, v, cache, cache.clone(), slots)
        assert not cache.view(torch.uint8).any()
    cache = torch.zeros(1, 16, 3, 64, dtype=torch.bfloat16)
    assert not cpu_attention.write_kv(k.bfloat16(), v.bfloat16(), cache, cache.clone(), slots)
