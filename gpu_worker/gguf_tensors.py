"""A GGUF file's tensors under Hugging Face names and in HF's conventions, for the weight loader.

llama.cpp's converter renames every tensor and changes a few values; this undoes both, so the rest of
the loader sees a Hugging Face checkpoint:
- Llama-architecture files (Llama, Mistral, Mixtral) interleave the q/k rows for llama.cpp's rope;
- Gemma files store norm weights plus one (Gemma scales by 1 + w);
- Phi-3's ffn_up is the fused gate_up_proj; Gemma's ffn_norm is the pre-feed-forward norm;
- experts come stacked ([E, ...] per matrix), under `mlp.experts.{gate,up,down}_proj` (layers/moe.py);
- Qwen2-MoE's shared-expert gate is a vector where HF keeps a one-row matrix.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import numpy as np
import torch

from common.model_source import ModelSource
from gpu_worker.quantization.gguf import ExpandedOnRead, GGUFTensor, unpermute_rope
from gpu_worker.quantization.gguf_blocks import SUPPORTED as GGUF_SUPPORTED

log = logging.getLogger(__name__)

_L = r"blk\.(\d+)\."
_GGUF_TO_HF: list[tuple[re.Pattern, str]] = [(re.compile(p), r) for p, r in [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (_L + r"attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (_L + r"ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (_L + r"post_attention_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (_L + r"post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
    (_L + r"attn_([qkv])\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
    (_L + r"attn_qkv\.weight", r"model.layers.\1.self_attn.qkv_proj.weight"),
    (_L + r"attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (_L + r"attn_([qk])_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
    (_L + r"ffn_(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
    (_L + r"ffn_gate_inp\.weight", r"model.layers.\1.mlp.gate.weight"),
    (_L + r"ffn_(gate|up|down)_exps\.weight", r"model.layers.\1.mlp.experts.\2_proj"),
    (_L + r"ffn_(gate|up|down)_shexp\.weight", r"model.layers.\1.mlp.shared_expert.\2_proj.weight"),
    (_L + r"ffn_gate_inp_shexp\.weight", r"model.layers.\1.mlp.shared_expert_gate.weight"),
]]
# where an architecture's file means something else by a name, its rules come first
_ARCH_RULES: dict[str, list[tuple[re.Pattern, str]]] = {
    "phi3": [(re.compile(_L + r"ffn_up\.weight"), r"model.layers.\1.mlp.gate_up_proj.weight")],
    "gemma2": [(re.compile(_L + r"ffn_norm\.weight"), r"model.layers.\1.pre_feedforward_layernorm.weight")],
}
_ARCH_RULES["gemma3"] = _ARCH_RULES["gemma2"]


def gguf_to_hf(name: str, arch: str = "llama") -> str | None:
    for pat, repl in _ARCH_RULES.get(arch, []) + _GGUF_TO_HF:
        m = pat.fullmatch(name)
        if m:
            return m.expand(repl)
    return None


def _rope_heads(arch: str, source: ModelSource, name: str) -> int | None:
    """Heads whose rows llama.cpp interleaved for this tensor (Llama-architecture files), or None."""
    if arch != "llama":
        return None
    mc = source.model_config()
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return mc.num_heads
    return mc.num_kv_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else None


def _to_hf_values(arch: str, name: str, arr: np.ndarray) -> np.ndarray:
    if arch.startswith("gemma") and name.endswith("norm.weight"):
        return arr - 1.0
    if name.endswith("shared_expert_gate.weight") and arr.ndim == 1:
        return arr.reshape(1, -1)
    return arr


def iter_gguf(source: ModelSource, keep_quantized: bool = False,
              lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFTensor | ExpandedOnRead]]:
    """HF-named tensors of a GGUF file: fp32, or with `keep_quantized` the matrices of a supported
    quantized type as GGUFTensor (raw blocks, rows already in HF order). `lazy` (tensor parallelism): the
    other matrices as ExpandedOnRead, so that a rank expands only its slice."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize
    arch = source.gguf_field("general.architecture")
    expanded: set[str] = set()
    for t in source.gguf_reader.tensors:
        name = gguf_to_hf(t.name, arch)
        if name is None:
            continue
        heads = _rope_heads(arch, source, name)
        matrix = GGUFTensor(t.data.view(np.uint8).reshape(int(t.shape[1]), -1), t.tensor_type,
                            (int(t.shape[1]), int(t.shape[0])), heads) if len(t.shape) == 2 else None
        if keep_quantized and t.tensor_type in GGUF_SUPPORTED and matrix is not None:
            yield name, matrix
            continue
        if keep_quantized and t.tensor_type not in (T.F32, T.F16, T.BF16):
            expanded.add(f"{t.tensor_type.name}{' experts' if len(t.shape) == 3 else ''}")
        if lazy and matrix is not None:
            yield name, ExpandedOnRead(matrix)
            continue
        arr = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if heads is not None:
            arr = unpermute_rope(arr, heads)
        # a copy: F32 tensors are read-only memmaps
        yield name, torch.from_numpy(np.array(_to_hf_values(arch, name, arr), dtype=np.float32))
    if expanded:
        log.info("GGUF tensors of type %s are not kept quantized: expanded to fp32 at load", ", ".join(sorted(expanded)))
