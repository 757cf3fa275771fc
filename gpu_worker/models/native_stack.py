"""A Llama model's decoder layers in one native call per step (kernels/decoder_stack.cpp), where the model
and the step are the plain case the layered path would run through the native kernels anyway.

Why: a single stream's decode step ran its 30 layers as ~300 kernel calls from Python, each wrapped in
module dispatch, checks, tensor allocation and ctypes marshalling: 9-10 ms of a 18-32 ms step, around
kernels that take a few microseconds at one row. The native stack calls the same kernels in the same
order on the same values, so its floats are the layered path's (tests/test_native_stack.py), and it only
moves the loop into C.

Which models: every layer a plain DecoderLayer (Attention without q/k norms, soft-capping or an fp8
rotation; an MLP with SwiGLU), every projection packed (GGUF, AWQ, GPTQ without act-order) under the
plain packed method (no LoRA, no fp8 method), one tensor-parallel rank, a plain rope table (no LongRoPE).
Which steps: fp32 activations on the CPU, an fp32 or bf16 cache, every sequence run by the attention
kernel (decodes, speculative verification: no prefill chunk), one KV group, and a row count whose every
product one native kernel runs (PackedWeight.kernel_for: the vector kernel, with int16 activations or
not, the AMX tiles or the AVX2 panels). Anything else takes the layered path. PAGEDSERVE_NATIVE_STACK=0
turns it off (A/B runs, loadtest/step_profile.py).
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from gpu_worker.attention.cpu_attention import KV_DTYPE_CODES
from gpu_worker.kernels import native
from gpu_worker.layers.activation import native_swiglu
from gpu_worker.parallel import tp
from gpu_worker.quantization.packed import AMX_TILE_CALL_ROWS, PANELS, PANELS_I16, TILES, VECTOR, VECTOR_I16, PackedWeight
from gpu_worker.quantization.packed_linear import PackedLinearMethod

p, i32, f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
CACHE_CODES = (KV_DTYPE_CODES[torch.float32], KV_DTYPE_CODES[torch.bfloat16])   # what psq_kv_write takes
KERNELS = {VECTOR: 0, TILES: 1, PANELS: 2, VECTOR_I16: 3, PANELS_I16: 4}     # StackStep.kernel


class StackWeight(ctypes.Structure):
    _fields_ = [("q", p), ("scale", p), ("offset", p), ("bias", p), ("tiles", p),
                ("n", i32), ("k", i32), ("group", i32), ("bits", i32)]


class StackLayer(ctypes.Structure):
    _fields_ = [("input_norm", p), ("post_norm", p), ("qkv", StackWeight), ("o", StackWeight),
                ("gate_up", StackWeight), ("down", StackWeight), ("k_cache", p), ("v_cache", p), ("window", i32)]


class StackStep(ctypes.Structure):
    _fields_ = [("rows", i32), ("hidden", i32), ("q_heads", i32), ("kv_heads", i32), ("head_dim", i32),
                ("inter", i32), ("rot", i32), ("eps", f32), ("scale", f32), ("cos", p), ("sin", p), ("slots", p),
                ("tables", p), ("lens", p), ("q_start", p), ("seqs", i32), ("max_blocks", i32),
                ("block_size", i32), ("kv_dtype", i32), ("kernel", i32), ("tile_call_rows", i32), ("isa", i32),
                ("attention_isa", i32), ("x", p), ("residual", p), ("out", p), ("scratch", p)]


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_NATIVE_STACK", "1").strip().lower() not in ("0", "false", "no", "off")


class NativeStack:
    """The native form of one model's decoder layers: their weights' pointers, laid out once."""

    def __init__(self, model: Any, weights: list[list[PackedWeight]], norms_below: int | None) -> None:
        self.model = model
        self.weights = weights                   # per layer: qkv, o, gate_up, down (kept alive with the model)
        self.norms_below = norms_below           # rows above this: a norm would hand on bf16 (layered path)
        first = model.layers[0]
        attn = first.self_attn
        self.shape = (model.config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                      weights[0][2].shape[0] // 2)
        self.eps, self.scale = first.input_layernorm.eps, attn.scale
        self.layers = (StackLayer * len(weights))(*(self._layer(layer, w) for layer, w in zip(model.layers, weights)))
        self._caches: list | None = None         # the kv_caches list the layers' cache pointers were set from
        self._kernels: dict[int, int | None] = {}         # rows -> _kernel(rows), at the ISA level below
        self._kernel_isa = -1
        self._scratch = torch.empty(0, dtype=torch.float32)

    @staticmethod
    def _layer(layer, w: list[PackedWeight]) -> StackLayer:
        mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        return StackLayer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                          *(_weight(pw, m.bias) for pw, m in zip(w, mods)), None, None, layer.self_attn.window or 0)

    def _kernel(self, rows: int) -> int | None:
        """The native kernel every product of a step of `rows` rows takes (PackedWeight.kernel_for), as
        decoder_stack.cpp numbers them, or None where they differ or one would take torch's GEMM."""
        isa = native.cpu_isa()
        if self._kernel_isa != isa:
            self._kernels, self._kernel_isa = {}, isa
        if rows not in self._kernels:
            kinds = {pw.kernel_for(rows) for ws in self.weights for pw in ws}
            self._kernels[rows] = KERNELS.get(kinds.pop()) if len(kinds) == 1 else None
        return self._kernels[rows]

    def run(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: Any,
            seq_ends: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's output, the residual stream) as the layered loop returns them, or None where
        this step is not one the stack takes (nothing was computed)."""
        nr = _native_runs(meta)
        rows = x.shape[0]
        if nr is None or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or \
                (self.norms_below is not None and rows > self.norms_below):
            return None
        k0 = kv_caches[0][0]
        code = KV_DTYPE_CODES.get(k0.dtype)
        kernel = self._kernel(rows)
        if code not in CACHE_CODES or not k0.is_contiguous() or kernel is None or not _slots_ok(meta):
            return None
        self._set_caches(kv_caches)
        rot = self.model.rope.at(positions, x.dtype, seq_ends)
        lib = native.library()
        hidden, hq, hkv, d, inter = self.shape
        need = lib.psq_stack_scratch(rows, hidden, hq, hkv, d, inter)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        residual, out = torch.empty_like(x), torch.empty_like(x)
        slots = _first(meta).slot_mapping
        step = StackStep(rows, hidden, hq, hkv, d, inter, rot.cos.shape[-1], self.eps, self.scale,
                         rot.cos.data_ptr(), rot.sin.data_ptr(), slots.data_ptr(), nr.tables.data_ptr(),
                         nr.lens.data_ptr(), nr.q_start.data_ptr(), nr.lens.shape[0], nr.tables.shape[1],
                         k0.shape[1], code, kernel, AMX_TILE_CALL_ROWS, native.cpu_isa(), native.attention_isa(),
                         x.data_ptr(), residual.data_ptr(), out.data_ptr(), self._scratch.data_ptr())
        rc = lib.psq_decoder_stack(ctypes.byref(step), self.layers, len(self.layers))
        if rc:
            raise RuntimeError(f"the native decoder stack refused layer {rc // 4}'s shapes (call {rc % 4})")
        return out, residual

    def _set_caches(self, kv_caches: list) -> None:
        if kv_caches is self._caches and self.layers[0].k_cache == kv_caches[0][0].data_ptr():
            return
        for layer, (k, v) in zip(self.layers, kv_caches):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
        self._caches = kv_caches


def _weight(pw: PackedWeight, bias: torch.Tensor | None) -> StackWeight:
    n, k = pw.shape
    return StackWeight(pw.q.data_ptr(), pw.scale.data_ptr(), pw.offset.data_ptr(),
                       None if bias is None else bias.data_ptr(), None if pw.tiles is None else pw.tiles.data_ptr(),
                       n, k, pw.group, pw.bits)


def _first(meta: Any) -> Any:
    return meta[0] if isinstance(meta, list) else meta


def _native_runs(meta: Any):
    """The step's NativeRuns where the attention kernel runs every row of it in order, for every layer
    alike (one KV group); else None."""
    m = _first(meta)
    if isinstance(meta, list) and any(other is not m for other in meta):
        return None
    nr = getattr(m, "native", None)
    return nr if nr is not None and nr.rows is None and not m.prefills and not m.decodes else None


def _slots_ok(meta: Any) -> bool:
    s = _first(meta).slot_mapping
    return s.dtype == torch.int64 and s.is_contiguous() and s.device.type == "cpu"


def build(model: Any) -> NativeStack | None:
    """The model's native stack, or None where some layer is not the plain case (module docstring)."""
    from gpu_worker.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
    if not enabled() or native.library() is None or tp().size > 1 or \
            type(model).rotations is not LlamaForCausalLM.rotations or model.rope.long_after is not None:
        return None
    weights = []
    for layer in model.layers:
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP:
            return None
        a, m = layer.self_attn, layer.mlp
        if a.q_norm is not None or a.softcap is not None or a.kv_rotation is not None or \
                not native_swiglu(m.act_and_mul) or a.num_heads % a.num_kv_heads or a.head_dim > 512:
            return None
        w = [_packed(lin) for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(pw is None for pw in w) or any(n.gemma or n.weight.dtype != torch.float32 for n in norms):
            return None
        weights.append(w)
    hidden = model.config.hidden_size
    fits = all(_shapes_fit(hidden, layer.self_attn, w) for layer, w in zip(model.layers, weights))
    if not weights or not fits or len({tuple(pw.shape for pw in w) for w in weights}) != 1 or \
            len({(layer.input_layernorm.eps, layer.self_attn.scale) for layer in model.layers}) != 1:
        return None
    below = [n.narrow_above for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
             if n.narrow_above is not None]
    return NativeStack(model, weights, min(below) if below else None)


def _shapes_fit(hidden: int, attn, w: list[PackedWeight]) -> bool:
    """The four products' shapes are those decoder_stack.cpp sizes its buffers by (the same in every
    layer, checked by the caller)."""
    qd, kvd = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    inter = w[2].shape[0] // 2
    return [pw.shape for pw in w] == [(qd + 2 * kvd, hidden), (hidden, qd), (2 * inter, hidden), (hidden, inter)]


def _packed(linear) -> PackedWeight | None:
    """The linear's packed weight where its product is PackedWeight.matmul's on the CPU and nothing else."""
    pw = getattr(linear, "packed", None)
    method = type(linear.method)
    if pw is None or not issubclass(method, PackedLinearMethod) or method.apply is not PackedLinearMethod.apply or \
            linear.reduce or pw.perm is not None or pw.q.device.type != "cpu" or \
            (linear.bias is not None and linear.bias.dtype != torch.float32):
        return None
    return pw
