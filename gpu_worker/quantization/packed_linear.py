"""The Linear method for every checkpoint whose weights arrive already quantized in groups: GGUF blocks,
AWQ (GEMM) and GPTQ (v1/v2). The loader hands each matrix over as a QuantizedTensor; this method takes
the shards of a fused layer apart into integer values with group scales and offsets, and keeps them
packed (PackedWeight), so the matmul reads 0.5-1 byte per weight instead of fp32's 4.

A layer whose shards cannot share one packing (a K the kernel cannot take, GPTQ act-order shards with
different input orders) is expanded to fp32 at load, with one log line; `--quantization none` expands
every layer and is the reference.
"""
from __future__ import annotations

import logging

import torch

from gpu_worker.cpu_precision import bf16_hardware
from gpu_worker.layers.linear import Linear, LinearMethod
from gpu_worker.quantization.packed import AMX_NATIVE_MAX_ROWS, GroupQuant, PackedWeight, QuantizedTensor

log = logging.getLogger(__name__)


class PackedLinearMethod(LinearMethod):
    keeps: type[QuantizedTensor] = QuantizedTensor     # checkpoint tensors this method keeps as they come

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        super().create_weights(layer, dtype)     # untouched unless a shard arrives unquantized
        layer.packed = None
        layer.pending_shards = {}

    def load_weight(self, layer: Linear, param: str, tensor, shard: str) -> None:
        if param == "weight" and isinstance(tensor, self.keeps):
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

    def use_matmul_dtype(self, layer: Linear, dtype: torch.dtype) -> None:
        if layer.packed is not None:
            amx = dtype == torch.bfloat16 and bf16_hardware() == "amx_bf16"
            if amx:
                layer.packed.keep_expanded(dtype, AMX_NATIVE_MAX_ROWS, tiles=True)
            else:
                layer.packed.keep_expanded(dtype)
        elif "weight" in layer._parameters:      # a layer that stayed plain
            super().use_matmul_dtype(layer, dtype)

    def use_int16_activations(self, layer: Linear, vector_rows: int | None = None) -> None:
        if layer.packed is not None:
            layer.packed.int16_activations = True
            layer.packed.int16_vector_rows = vector_rows

    def bf16_input_rows(self, layer: Linear) -> int | None:
        """The steps the bf16 copy runs (PackedWeight.copy_rows), unless the product is then summed across
        ranks (row parallel), where the sum stays in fp32."""
        if layer.packed is None or layer.reduce or layer.packed.expanded is None or \
                layer.packed.expanded.dtype != torch.bfloat16:
            return None
        return layer.packed.copy_rows()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed is None:
            return super().apply(layer, x)
        return layer.packed.matmul(x, layer.bias)
