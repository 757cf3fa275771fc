"""The Linear methods, one file each, chosen by `--quantization` (vLLM's names).

`auto` (the default) follows the checkpoint: a GGUF file keeps its quantized blocks (`gguf`), a Hugging
Face folder whose config.json has a `quantization_config` keeps its AWQ, GPTQ or FP8 weights, and
anything else runs unquantized (`none`). `none` on a quantized checkpoint expands it to fp32 at load,
the reference path; `int8` and `fp8` quantize an unquantized (or expanded) checkpoint at load.
"""
from __future__ import annotations

from torch import nn

from common.config import QUANTIZATION_ALIASES, QUANTIZATION_METHODS
from gpu_worker.layers.linear import Linear, LinearMethod
from gpu_worker.quantization.fp8 import Fp8LinearMethod
from gpu_worker.quantization.int8 import Int8LinearMethod
from gpu_worker.quantization.packed_linear import PackedLinearMethod

METHODS: dict[str, type[LinearMethod]] = {"none": LinearMethod, "int8": Int8LinearMethod, "fp8": Fp8LinearMethod,
                                          "gguf": PackedLinearMethod, "awq": PackedLinearMethod,
                                          "gptq": PackedLinearMethod}
KEPT_AS_STORED = ("gguf", "awq", "gptq")     # methods that only keep a checkpoint's own quantization
assert set(METHODS) | {"auto"} == set(QUANTIZATION_METHODS)


def resolve_quantization(requested: str, checkpoint: str | None) -> str:
    """The method a model runs with, given the checkpoint's own quantization (None, "gguf", "awq",
    "gptq" or "fp8")."""
    requested = QUANTIZATION_ALIASES.get(requested, requested)
    if requested == "auto":
        return checkpoint or "none"
    if requested not in METHODS:
        raise ValueError(f"unknown quantization {requested!r}; expected one of {', '.join(QUANTIZATION_METHODS)}")
    if requested in KEPT_AS_STORED and requested != checkpoint:
        article = "an" if requested == "awq" else "a"
        stored = f"{checkpoint.upper()}-quantized" if checkpoint else "unquantized"
        raise ValueError(f"quantization {requested!r} needs {article} {requested.upper()} checkpoint; this one is {stored}")
    return requested


def linear_method(name: str) -> LinearMethod:
    if name not in METHODS:
        raise ValueError(f"unknown quantization {name!r}; expected one of {', '.join(QUANTIZATION_METHODS)}")
    return METHODS[name]()


def set_linear_method(model: nn.Module, name: str) -> None:
    """Give every Linear of `model` the named method (before its weights are loaded and processed); the
    output projection keeps the plain method where the method says so."""
    for path, m in model.named_modules():
        if isinstance(m, Linear):
            method = linear_method(name)
            if path == "lm_head" and not method.quantizes_lm_head:
                continue
            m.method = method
            m.method.create_weights(m, m.weight.dtype)
