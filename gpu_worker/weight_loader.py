"""Loads checkpoint tensors into our modules. The checkpoint-name -> (module, param, shard) mapping
lives here and only here; GGUF names are first translated to Hugging Face names (gguf_tensors.py)."""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from common.config import LOAD_FORMATS
from common.model_config import ModelConfig
from common.model_source import ModelSource
from gpu_worker.gguf_tensors import iter_gguf
from gpu_worker.layers.embedding import VocabEmbedding
from gpu_worker.layers.linear import Linear, materialize
from gpu_worker.parallel import tp
from gpu_worker.quantization import resolve_quantization, set_linear_method
from gpu_worker.quantization.checkpoint import CheckpointFormat, read_checkpoint_format
from gpu_worker.quantization.packed import QuantizedTensor

log = logging.getLogger(__name__)

# (checkpoint name, our module, parameter, shard) for the projections we fuse
_HF_RULES: list[tuple[re.Pattern, str, str, str]] = [
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)"),
     r"layers.\1.self_attn.qkv_proj", r"\3", r"\2"),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.weight"), r"layers.\1.mlp.gate_up_proj", "weight", r"\2"),
    # mixture of experts: each expert's matrices into the stacked experts (layers/moe.py), Mixtral's names too
    (re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w[123]|(?:gate|up|down)_proj)\.weight"),
     r"layers.\1.mlp.experts", r"\3", r"\2"),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.((?:gate|up|down)_proj)"), r"layers.\1.mlp.experts", r"\2", "*"),
    (re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight"), r"layers.\1.mlp.gate", "weight", ""),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up)_proj\.weight"),
     r"layers.\1.mlp.shared_expert.gate_up_proj", "weight", r"\2"),
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


def _safetensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else sorted(p.name for p in folder.glob("*.safetensors"))
    return [folder / n for n in names]


def safetensor_names(folder: Path) -> list[str]:
    from safetensors import safe_open
    names: list[str] = []
    for path in _safetensor_files(folder):
        with safe_open(str(path), framework="pt") as f:
            names += list(f.keys())
    return names


class LazySlice:
    """A safetensors tensor not read yet: a tensor-parallel rank reads only the rows or columns of its
    shard (Linear._own_part), so no rank ever holds a whole sharded matrix."""

    def __init__(self, view):
        self.view = view
        self.shape = tuple(view.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self.view[index]

    def materialize(self) -> torch.Tensor:
        return self.view[:]


def iter_safetensors(folder: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | LazySlice]]:
    from safetensors import safe_open
    for path in _safetensor_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                yield key, LazySlice(f.get_slice(key)) if lazy else f.get_tensor(key)


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
               max_positions: int, quantization: str, load_format: str,
               matmul_dtype: torch.dtype | None = None, int16_activations: bool = False,
               int16_vector_rows: int | None = None) -> torch.nn.Module:
    """Build the model on `device`, choose its Linear method and fill its weights: the target and a
    draft model are made the same way. `matmul_dtype` (gpu_worker/cpu_precision.py): the dtype every
    Linear's matmuls run in, where it is not `dtype`; `int16_activations`: decode-sized packed products
    round their input to int16 (the same module), on the vector kernel up to `int16_vector_rows` rows
    where given (PackedWeight.int16_vector_rows)."""
    from gpu_worker.models import build_model
    fmt = read_checkpoint_format(source.quantization_config())
    method = resolve_quantization(quantization, "gguf" if source.kind == "gguf" else fmt and fmt.method)
    with torch.device(device):
        model = build_model(model_config, dtype, max_positions)
        set_linear_method(model, method)
        load_weights(model, source, load_format, keep_quantized=method == "gguf", fmt=fmt)
        for m in model.modules():
            if isinstance(m, Linear):
                if matmul_dtype is not None and matmul_dtype != dtype:
                    m.method.use_matmul_dtype(m, matmul_dtype)
                if int16_activations:
                    m.method.use_int16_activations(m, int16_vector_rows)
    log.info("model weights resident: %.1f MiB (%s)", weight_bytes(model) / (1 << 20), method)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and packed weight, each storage counted once (tied tables are shared)."""
    seen: dict[int, int] = {}
    for m in model.modules():
        tensors = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        packed = getattr(m, "packed", None)
        if packed is not None:
            tensors += packed.tensors
        for t in tensors:       # a prepacked (mkldnn) tensor has no data pointer; it is its own storage
            seen[id(t) if t.is_mkldnn else t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def load_weights(model: torch.nn.Module, source: ModelSource, load_format: str = "auto",
                 keep_quantized: bool = False, fmt: CheckpointFormat | None = None) -> None:
    """Fill `model` from `source`; a quantized checkpoint's `fmt` reassembles its layers' parts."""
    if load_format == "dummy":
        init_dummy_weights(model)
        return
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {', '.join(LOAD_FORMATS)}")
    source.check_load_format(load_format)
    if source.kind == "gguf":
        tensors = iter_gguf(source, keep_quantized, lazy=tp().size > 1)
    else:
        tensors = iter_safetensors(source.path, lazy=tp().size > 1 and fmt is None)
        if fmt is not None:
            tensors = fmt.assemble(safetensor_names(source.path), tensors)
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
        if not isinstance(module, (Linear, VocabEmbedding)):     # only these two read a shard of it
            tensor = materialize(tensor)
        if hasattr(module, "load"):
            try:
                module.load(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        else:
            if isinstance(tensor, QuantizedTensor):
                tensor = tensor.dequantize()
            target = getattr(module, param)
            if target.shape != tensor.shape:
                raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(target.shape)}")
            target.data.copy_(tensor)
        parts = module.loaded_parts(param, shard) if hasattr(module, "loaded_parts") else [(param, shard)]
        loaded.update((module_path, p, s) for p, s in parts)
    model.tie_weights()
    _check_complete(model, loaded)
    for m in model.modules():
        if hasattr(m, "method"):
            m.method.process_weights_after_loading(m)


def _checkpoint_parts(module: torch.nn.Module) -> list[tuple[str, str]]:
    """Every (param, shard) of `module` that a checkpoint must fill: a fused Linear's shards, a module's
    own list where it has one (the experts), else each parameter whole."""
    if hasattr(module, "checkpoint_parts"):
        return module.checkpoint_parts()
    shards = getattr(module, "shard_ranges", None) or {"": None}
    return [(pname, shard) for pname, _ in module.named_parameters(recurse=False) for shard in shards]


def _check_complete(model: torch.nn.Module, loaded: set[tuple[str, str, str]]) -> None:
    missing = []
    for path, module in model.named_modules():
        if path == "lm_head" and model.config.tie_word_embeddings:
            continue
        for pname, shard in _checkpoint_parts(module):
            if (path, pname, shard) not in loaded:
                missing.append(f"{path}.{pname}{'[' + shard + ']' if shard else ''}")
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
