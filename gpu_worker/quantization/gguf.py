"""GGUF weights kept in their quantized blocks (`--quantization gguf`, the default for a GGUF model).

The loader hands each quantized matrix over as a GGUFTensor; this method takes the shards of a fused
layer apart into integer values and group scales (gguf_blocks) and keeps them packed (PackedWeight),
so a decode step reads ~0.6-1.2 bytes per weight instead of fp32's 4. `--quantization none` on the same
file expands everything to fp32 at load and is the reference.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from gpu_worker.layers.linear import Linear, LinearMethod
from gpu_worker.quantization.gguf_blocks import decode
from gpu_worker.quantization.packed import GroupQuant, PackedWeight, QuantizedTensor

log = logging.getLogger(__name__)


class GGUFTensor(QuantizedTensor):
    """One GGUF matrix as raw block bytes, one row of blocks per output feature."""

    def __init__(self, raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]):
        self.raw, self.qtype, self.shape = raw, qtype, shape

    def groups(self) -> GroupQuant:
        return decode(self.raw, self.qtype, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        return torch.from_numpy(np.array(gguf_dequantize(self.raw, self.qtype), np.float32).reshape(self.shape))


class GGUFLinearMethod(LinearMethod):
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        super().create_weights(layer, dtype)     # untouched unless a shard arrives unquantized
        layer.packed = None
        layer.pending_shards = {}

    def load_weight(self, layer: Linear, param: str, tensor, shard: str) -> None:
        if param == "weight" and isinstance(tensor, QuantizedTensor):
            self.shard_rows(layer, param, shard, tuple(tensor.shape), (layer.in_features,))
            layer.pending_shards[shard] = tensor
        else:
            super().load_weight(layer, param, tensor, shard)

    def process_weights_after_loading(self, layer: Linear) -> None:
        pending, layer.pending_shards = layer.pending_shards, {}
        if not pending:
            return
        if len(pending) == len(layer.shard_ranges):
            try:
                gq = GroupQuant.concat([pending[s].groups() for s in layer.shard_ranges])
                layer.packed = PackedWeight.from_groups(gq, layer.weight.device)
                del layer.weight
                return
            except ValueError as e:
                log.info("a %s layer stays fp32: %s", tuple(layer.weight.shape), e)
        for shard, tensor in pending.items():      # some shards plain, or a shape the kernel cannot take
            super().load_weight(layer, "weight", tensor.dequantize(), shard)

    def tie(self, layer: Linear, embedding: torch.nn.Module) -> None:
        if getattr(embedding, "packed", None) is None:
            return super().tie(layer, embedding)
        layer.packed = embedding.packed
        if "weight" in layer._parameters:
            del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed is None:
            return super().apply(layer, x)
        return layer.packed.matmul(x, layer.bias)
