"""LoRA as a Linear method: it wraps the layer's own method (plain, int8, fp8 or packed), so an adapter
works over any quantization, and adds the step's per-token LoRA delta to what that method computes.

The layer carries the slots' stacked matrices (layout in delta.py); a layer no resident adapter adapts
skips the delta, so the modules an adapter does not touch compute exactly what the base model does.
"""
from __future__ import annotations

import torch
from torch import nn

from gpu_worker.layers.linear import Linear, LinearMethod
from gpu_worker.lora.delta import LoRABatch, add_lora


class LoRAStep:
    """The one object every adapted layer reads the current step's adapter assignment from (set by the
    manager around the model's forward pass; None outside it and for steps without adapters)."""
    batch: LoRABatch | None = None


class LoRALinearMethod(LinearMethod):
    def __init__(self, base: LinearMethod, step: LoRAStep):
        self.base, self.step = base, step
        self.quantizes_lm_head = base.quantizes_lm_head

    def attach(self, layer: Linear, num_slots: int, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate the layer's slots, all empty."""
        ranges = list(layer.shard_ranges.values())
        layer.lora_a = torch.zeros(num_slots, len(ranges), rank, layer.in_features, device=device, dtype=dtype)
        layer.lora_b = [torch.zeros(num_slots, rank, hi - lo, device=device, dtype=dtype) for lo, hi in ranges]
        layer.lora_filled = set()       # slots whose adapter adapts this layer

    def fill_slot(self, layer: Linear, slot: int, shards: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's (A [r, in], scaled B^T [r, out]) per shard into `slot`; shards it does not
        adapt stay zero."""
        layer.lora_a[slot].zero_()
        for b in layer.lora_b:
            b[slot].zero_()
        for j, shard in enumerate(layer.shard_ranges):
            if shard in shards:
                a, bt = shards[shard]
                layer.lora_a[slot, j, :a.shape[0]].copy_(a)
                layer.lora_b[j][slot, :bt.shape[0]].copy_(bt)
        (layer.lora_filled.add if shards else layer.lora_filled.discard)(slot)

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        self.base.create_weights(layer, dtype)

    def load_weight(self, layer: Linear, param: str, tensor: torch.Tensor, shard: str) -> None:
        self.base.load_weight(layer, param, tensor, shard)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.base.process_weights_after_loading(layer)

    def tie(self, layer: Linear, embedding: nn.Module) -> None:
        self.base.tie(layer, embedding)

    def use_matmul_dtype(self, layer: Linear, dtype: torch.dtype) -> None:
        self.base.use_matmul_dtype(layer, dtype)

    def use_int16_activations(self, layer: Linear, vector_rows: int | None = None) -> None:
        self.base.use_int16_activations(layer, vector_rows)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = self.base.apply(layer, x)
        batch = self.step.batch
        if batch is None or not layer.lora_filled:
            return y
        return add_lora(y, x, layer.lora_a, layer.lora_b, list(layer.shard_ranges.values()), batch)
