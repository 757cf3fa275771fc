"""One linear layer type for every projection, so sharding, quantization and LoRA plug in at one place.

A `Linear` owns its parameters and delegates the matmul to a `LinearMethod`. Fused projections (QKV,
gate+up) are a single Linear whose output is the concatenation of named shards; the weight loader
fills each shard by name. Tensor parallelism only changes which part of each checkpoint tensor a rank
keeps: `rows` (column parallel: this rank's rows of each shard) and `cols` (row parallel: its input
columns, whose partial products forward sums over the ranks).
"""
from __future__ import annotations

import torch
from torch import nn

from gpu_worker.parallel import all_reduce, tp


class LinearMethod:
    """Unquantized weights: y = x W^T + b. Quantized and LoRA methods subclass this."""
    quantizes_lm_head = True     # False: the output projection keeps the plain method (vLLM's fp8 does)

    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype),
                                    requires_grad=False)

    def load_weight(self, layer: "Linear", param: str, tensor: torch.Tensor, shard: str) -> None:
        """Copy a checkpoint tensor into `param` ("weight" or "bias"), into the rows of `shard`.
        Methods whose checkpoints carry packed weights take those here instead."""
        if not isinstance(tensor, torch.Tensor):     # a QuantizedTensor (quantization/packed.py)
            tensor = tensor.dequantize()
        target = getattr(layer, param)
        lo, hi = self.shard_rows(layer, param, shard, tuple(tensor.shape), tuple(target.shape[1:]))
        target.data[lo:hi].copy_(tensor)

    @staticmethod
    def shard_rows(layer: "Linear", param: str, shard: str, got: tuple[int, ...],
                   row_shape: tuple[int, ...]) -> tuple[int, int]:
        """The rows of `shard`, after checking a checkpoint tensor of shape `got` fits them."""
        lo, hi = layer.shard_ranges[shard]
        if got != (hi - lo, *row_shape):
            raise ValueError(f"shape mismatch for {param}[{shard or 'all'}]: checkpoint {got}, "
                             f"expected {(hi - lo, *row_shape)}")
        return lo, hi

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Hook for repacking (quantize, transpose for a faster kernel) once the weights are in."""

    def tie(self, layer: "Linear", embedding: nn.Module) -> None:
        """Share the input embedding's table as this (output) layer's weight."""
        layer.weight = embedding.weight

    def use_matmul_dtype(self, layer: "Linear", dtype: torch.dtype) -> None:
        """Run this layer's matmuls with `dtype` weights while activations keep theirs (gpu_worker/
        cpu_precision.py: bf16 on a CPU with bf16 matrix hardware). Plain weights are held in `dtype`
        from here on; methods with weights of their own override this."""
        w = layer.weight
        if w.dtype != dtype:
            layer.weight = nn.Parameter(w.detach().to(dtype), requires_grad=False)

    def use_int16_activations(self, layer: "Linear", vector_rows: int | None = None) -> None:
        """Let this layer's decode-sized products round their input to int16 (gpu_worker/cpu_precision.py:
        --dtype auto on a CPU without bf16 hardware), the vector kernel taking steps of up to `vector_rows`
        rows where given (PackedWeight.int16_vector_rows). Only packed weights have a kernel for it: plain
        ones stay as they are."""

    def bf16_input_rows(self, layer: "Linear") -> int | None:
        """Steps of more rows than this may give this layer a bf16 input, which its product then takes as
        it is and gives back in bf16 (fp32 with a bias), the values of converting inside; None (here):
        the input stays in the run dtype (layers/norm.py's narrow_above)."""
        return None

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if layer.weight.dtype != x.dtype:
            return low_precision_linear(x, layer.weight, layer.bias)
        return torch.nn.functional.linear(x, layer.weight, layer.bias)


def low_precision_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias) with a weight held in lower precision than the run dtype (plain, or prepacked
    by prepack_bf16): x is rounded to the weight's dtype for the product, which comes back in x's dtype,
    or with a bias in fp32 at least, where the bias is added."""
    low = x.to(weight.dtype)
    if weight.is_mkldnn:
        y = torch.ops.mkldnn._linear_pointwise(low, weight, None, "none", [], "")
    else:
        y = torch.nn.functional.linear(low, weight)
    if bias is None:
        return y.to(x.dtype)
    out = torch.promote_types(x.dtype, torch.float32)
    return y.to(out) + bias.to(out)


# The row count oneDNN lays a prepacked weight out for (the default token budget); its products equalled
# the plain weight's at 33-64 rows, and at 348-512 came in another summation order for some shapes.
PREPACK_ROWS = 512


def prepack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight in oneDNN's blocked layout, made once, for low_precision_linear: on a plain weight
    oneDNN reorders it at every call: SmolLM2's 120 decoder products ran 1.32-1.39x faster prepacked at
    33-64 rows (a batch of decodes), 1.00x at 348 and 0.94x at 512 (prefill chunks; 2-core Xeon, torch
    2.13, loadtest/bf16_prepack_bench.py). Any other weight, or a torch without oneDNN bf16, gets the weight
    back as it is. The result is opaque: only low_precision_linear reads it."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2 or \
            not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PREPACK_ROWS)


class Linear(nn.Module):
    """`out_shards` and `in_features` are the checkpoint's sizes. Under tensor parallelism `rows` gives,
    per shard, the rows [lo, hi) of that shard's checkpoint tensor this rank holds, and `cols` the input
    columns [lo, hi) it holds; the layer's own sizes (shard_ranges, in_features) are those of its part."""

    def __init__(self, in_features: int, out_shards: dict[str, int] | int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, method: LinearMethod | None = None,
                 rows: dict[str, tuple[int, int]] | None = None, cols: tuple[int, int] | None = None):
        super().__init__()
        full = {"": out_shards} if isinstance(out_shards, int) else dict(out_shards)
        self.rows = rows or {}
        self.cols = cols
        self.reduce = cols is not None and cols != (0, in_features)     # partial sums: all-reduced
        self.in_features = in_features if cols is None else cols[1] - cols[0]
        self.checkpoint_ranges = _ranges(full)                 # a fused checkpoint's rows of each shard
        self.shard_ranges = _ranges({n: (self.rows[n][1] - self.rows[n][0]) if n in self.rows else size
                                     for n, size in full.items()})
        self.out_features = sum(hi - lo for lo, hi in self.shard_ranges.values())
        self.method = method or LinearMethod()
        self.method.create_weights(self, dtype)
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False) if bias else None

    def load(self, param: str, tensor: torch.Tensor, shard: str = "") -> None:
        """Shard "" of a fused layer is a checkpoint that fuses it too (Phi-3's qkv_proj and
        gate_up_proj): its rows are cut into the shards, so each loads as if it came on its own."""
        if shard or "" in self.shard_ranges:
            self.method.load_weight(self, param, self._own_part(param, tensor, shard), shard)
            return
        if not hasattr(tensor, "__getitem__"):
            raise ValueError(f"fused {param}: a {type(tensor).__name__} checkpoint tensor cannot be cut into "
                             f"the shards {', '.join(self.shard_ranges)}")
        rows = self.checkpoint_ranges
        total = sum(hi - lo for lo, hi in rows.values())
        if tensor.shape[0] != total:
            raise ValueError(f"fused {param}: checkpoint has {tensor.shape[0]} rows, expected {total} "
                             f"({' + '.join(f'{n} {hi - lo}' for n, (lo, hi) in rows.items())})")
        for name, (lo, hi) in rows.items():
            self.method.load_weight(self, param, self._own_part(param, tensor[lo:hi], name), name)

    def _own_part(self, param: str, tensor, shard: str):
        """This rank's part of a checkpoint tensor of `shard`: its rows, then its input columns. A
        row-parallel bias is added once, by rank 0 (the others hold zeros)."""
        if shard in self.rows:
            lo, hi = self.rows[shard]
            tensor = tensor[lo:hi]
        if self.reduce and len(tensor.shape) == 2:
            tensor = tensor[:, self.cols[0]:self.cols[1]]
        tensor = materialize(tensor)
        if self.reduce and param == "bias" and tp().rank != 0:
            tensor = torch.zeros_like(tensor)
        return tensor

    def loaded_parts(self, param: str, shard: str) -> list[tuple[str, str]]:
        """The (param, shard) pairs that load(param, _, shard) filled."""
        if shard or "" in self.shard_ranges:
            return [(param, shard)]
        return [(param, name) for name in self.shard_ranges]

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return [y[..., lo:hi] for lo, hi in self.shard_ranges.values()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return all_reduce(y) if self.reduce else y


def _ranges(sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    out, off = {}, 0
    for name, size in sizes.items():
        out[name] = (off, off + size)
        off += size
    return out


def materialize(tensor):
    """A checkpoint tensor read lazily (weight_loader.LazySlice) read now; anything else as it is."""
    return tensor.materialize() if hasattr(tensor, "materialize") else tensor
