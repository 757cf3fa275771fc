"""One linear layer type for every projection, so sharding, quantization and LoRA plug in at one place.

A `Linear` owns its parameters and delegates the matmul to a `LinearMethod`. Fused projections (QKV,
gate+up) are a single Linear whose output is the concatenation of named shards; the weight loader
fills each shard by name, so tensor-parallel slicing later only changes `shard_ranges`.
"""
from __future__ import annotations

import torch
from torch import nn


class LinearMethod:
    """Unquantized weights: y = x W^T + b. Quantized and LoRA methods subclass this."""

    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype),
                                    requires_grad=False)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Hook for repacking (quantize, transpose for a faster kernel) once the weights are in."""

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.weight, layer.bias)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_shards: dict[str, int] | int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, method: LinearMethod | None = None):
        super().__init__()
        shards = {"": out_shards} if isinstance(out_shards, int) else dict(out_shards)
        self.in_features = in_features
        self.out_features = sum(shards.values())
        self.shard_ranges: dict[str, tuple[int, int]] = {}
        off = 0
        for name, size in shards.items():
            self.shard_ranges[name] = (off, off + size)
            off += size
        self.method = method or LinearMethod()
        self.method.create_weights(self, dtype)
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False) if bias else None

    def load(self, param: str, tensor: torch.Tensor, shard: str = "") -> None:
        """Copy a checkpoint tensor into `param` ("weight" or "bias"), into the rows of `shard`."""
        target = getattr(self, param)
        lo, hi = self.shard_ranges[shard]
        if tuple(tensor.shape) != (hi - lo, *target.shape[1:]):
            raise ValueError(f"shape mismatch for {param}[{shard or 'all'}]: checkpoint {tuple(tensor.shape)}, "
                             f"expected {(hi - lo, *target.shape[1:])}")
        target.data[lo:hi].copy_(tensor)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return [y[..., lo:hi] for lo, hi in self.shard_ranges.values()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class Int8LinearMethod(LinearMethod):
    """int8 weights (one scale per output channel) times int8 activations (one scale per token, taken at
    each call) with int32 accumulation (torch._int_mm), rescaled to the run dtype.

    On this AVX2 CPU the int8 product runs at several times fp32's rate, so large steps (prefill) gain
    most; per-token activation scales keep outlier tokens from degrading the others. An opt-in speed mode
    (`--quantization int8`), never the reference for correctness tests.
    """

    def process_weights_after_loading(self, layer: "Linear") -> None:
        w = layer.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        layer.w_int8 = (w / scale[:, None]).round().to(torch.int8).t()     # [in, out], column-major rows
        layer.w_scale = scale

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xf = x.reshape(-1, x.shape[-1]).float()
        xs = (xf.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-8)
        xq = (xf / xs).round_().to(torch.int8)
        y = torch._int_mm(xq, layer.w_int8).float() * xs * layer.w_scale
        if layer.bias is not None:
            y = y + layer.bias.float()
        return y.to(x.dtype).reshape(*lead, -1)


QUANT_METHODS: dict[str, type[LinearMethod]] = {"none": LinearMethod, "int8": Int8LinearMethod}


def linear_method(name: str) -> LinearMethod:
    if name not in QUANT_METHODS:
        raise ValueError(f"unknown quantization {name!r}; expected one of {', '.join(QUANT_METHODS)}")
    return QUANT_METHODS[name]()


def set_linear_method(model: nn.Module, name: str) -> None:
    """Give every Linear of `model` the named method (before its weights are loaded and processed)."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.method = linear_method(name)
