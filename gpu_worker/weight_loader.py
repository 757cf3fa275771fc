"""Loads checkpoint tensors into our modules. The checkpoint-name -> (module, param, shard) mapping
lives here and only here; GGUF names are first translated to Hugging Face names."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from common.config import ModelConfig
from common.model_source import ModelSource

# (checkpoint name, our module, parameter, shard) for the projections we fuse
_HF_RULES: list[tuple[re.Pattern, str, str, str]] = [
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)"),
     r"layers.\1.self_attn.qkv_proj", r"\3", r"\2"),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.weight"), r"layers.\1.mlp.gate_up_proj", "weight", r"\2"),
]

_GGUF_TO_HF: list[tuple[re.Pattern, str]] = [
    (re.compile(r"token_embd\.weight"), "model.embed_tokens.weight"),
    (re.compile(r"output_norm\.weight"), "model.norm.weight"),
    (re.compile(r"output\.weight"), "lm_head.weight"),
    (re.compile(r"blk\.(\d+)\.attn_norm\.weight"), r"model.layers.\1.input_layernorm.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_norm\.weight"), r"model.layers.\1.post_attention_layernorm.weight"),
    (re.compile(r"blk\.(\d+)\.attn_([qkv])\.(weight|bias)"), r"model.layers.\1.self_attn.\2_proj.\3"),
    (re.compile(r"blk\.(\d+)\.attn_output\.weight"), r"model.layers.\1.self_attn.o_proj.weight"),
    (re.compile(r"blk\.(\d+)\.attn_([qk])_norm\.weight"), r"model.layers.\1.self_attn.\2_norm.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight"), r"model.layers.\1.mlp.\2_proj.weight"),
]


def hf_to_param(name: str) -> tuple[str, str, str]:
    """Map a Hugging Face tensor name to (our module path, parameter, shard of a fused layer)."""
    for pat, module, param, shard in _HF_RULES:
        m = pat.fullmatch(name)
        if m:
            return m.expand(module), m.expand(param), m.expand(shard)
    path = name.removeprefix("model.")
    module, _, param = path.rpartition(".")
    return module, param, ""


def gguf_to_hf(name: str) -> str | None:
    for pat, repl in _GGUF_TO_HF:
        m = pat.fullmatch(name)
        if m:
            return m.expand(repl)
    return None


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp interleaves q/k rows for its rope; undo it to get back HF's half-rotation layout."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else sorted(p.name for p in folder.glob("*.safetensors"))
    for fname in files:
        with safe_open(str(folder / fname), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def iter_gguf(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize
    reader = source.gguf_reader
    mc = source.model_config()
    for t in reader.tensors:
        name = gguf_to_hf(t.name)
        if name is None:
            continue
        arr = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if mc.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = _unpermute_rope(arr, mc.num_heads)
        elif mc.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = _unpermute_rope(arr, mc.num_kv_heads)
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32))  # a copy: F32 tensors are read-only memmaps


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes (norms at 1): measures a model shape without its checkpoint."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()


def load_model(source: ModelSource, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, quantization: str, load_format: str) -> torch.nn.Module:
    """Build the model on `device`, choose its Linear method and fill its weights: the target and a
    draft model are made the same way."""
    from gpu_worker.layers.linear import set_linear_method
    from gpu_worker.models import build_model
    with torch.device(device):
        model = build_model(model_config, dtype, max_positions)
        set_linear_method(model, quantization)
        load_weights(model, source, load_format)
    return model.eval()


def load_weights(model: torch.nn.Module, source: ModelSource, load_format: str = "auto") -> None:
    if load_format == "dummy":
        init_dummy_weights(model)
        return
    if load_format != "auto":
        raise ValueError(f"unknown load_format {load_format!r}; expected auto or dummy")
    tensors = iter_gguf(source) if source.kind == "gguf" else iter_safetensors(source.path)
    modules = dict(model.named_modules())
    loaded = set()
    for name, tensor in tensors:
        if "rotary_emb" in name:
            continue
        module_path, param, shard = hf_to_param(name)
        module = modules.get(module_path)
        if module is None:
            if module_path == "lm_head" and model.config.tie_word_embeddings:
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        if hasattr(module, "load"):
            module.load(param, tensor, shard)
        else:
            target = getattr(module, param)
            if target.shape != tensor.shape:
                raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(target.shape)}")
            target.data.copy_(tensor)
        loaded.add((module_path, param, shard))
    model.tie_weights()
    for m in model.modules():
        if hasattr(m, "method"):
            m.method.process_weights_after_loading(m)
    _check_complete(model, loaded)


def _check_complete(model: torch.nn.Module, loaded: set[tuple[str, str, str]]) -> None:
    missing = []
    for path, module in model.named_modules():
        shards = getattr(module, "shard_ranges", None)
        for pname, _ in module.named_parameters(recurse=False):
            if path == "lm_head" and model.config.tie_word_embeddings:
                continue
            for shard in (shards if shards is not None else {"": None}):
                if (path, pname, shard) not in loaded:
                    missing.append(f"{path}.{pname}{'[' + shard + ']' if shard else ''}")
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
