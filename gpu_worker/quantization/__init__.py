"""The Linear methods, one file each, chosen by `--quantization` (vLLM's names).

`auto` (the default) keeps a GGUF file's quantized blocks (`gguf`) and runs anything else unquantized
(`none`); `none` on a GGUF expands it to fp32 at load, the reference path.
"""
from __future__ import annotations

from torch import nn

from common.config import QUANTIZATION_METHODS
from gpu_worker.layers.linear import Linear, LinearMethod
from gpu_worker.quantization.gguf import GGUFLinearMethod
from gpu_worker.quantization.int8 import Int8LinearMethod

METHODS: dict[str, type[LinearMethod]] = {"none": LinearMethod, "int8": Int8LinearMethod, "gguf": GGUFLinearMethod}
assert set(METHODS) | {"auto"} == set(QUANTIZATION_METHODS)


def resolve_quantization(requested: str, source_kind: str) -> str:
    """The method a model from a source of `source_kind` ("gguf" or "hf") runs with."""
    if requested == "auto":
        return "gguf" if source_kind == "gguf" else "none"
    if requested not in METHODS:
        raise ValueError(f"unknown quantization {requested!r}; expected one of {', '.join(QUANTIZATION_METHODS)}")
    if requested == "gguf" and source_kind != "gguf":
        raise ValueError("quantization 'gguf' needs a .gguf model file")
    return requested


def linear_method(name: str) -> LinearMethod:
    if name not in METHODS:
        raise ValueError(f"unknown quantization {name!r}; expected one of {', '.join(QUANTIZATION_METHODS)}")
    return METHODS[name]()


def set_linear_method(model: nn.Module, name: str) -> None:
    """Give every Linear of `model` the named method (before its weights are loaded and processed)."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.method = linear_method(name)
            m.method.create_weights(m, m.weight.dtype)
