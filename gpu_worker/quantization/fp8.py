"""FP8 weights (`--quantization fp8`): float8_e4m3fn values with fp32 scales, one byte per weight.

Two ways in: an unquantized checkpoint is quantized at load with one scale per output channel (vLLM's
dynamic fp8), and an FP8 checkpoint (`quant_method: fp8`: `weight` in float8_e4m3fn with `weight_scale`
per tensor or per channel, or `weight_scale_inv` per [bn, bk] block) loads as it is. On the CPU the
native kernel expands the e4m3 bytes in registers (a PackedWeight with FP8_BITS); elsewhere, without fp8
math, the matmul upcasts the weights one tile of output rows at a time, so the copy in the run dtype
never exists whole. The activations stay in the run dtype (weight-only, as vLLM runs fp8 on GPUs without
fp8 units), so a checkpoint's `input_scale` is read and not applied, with one log line.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.kernels import native
from gpu_worker.layers.linear import Linear
from gpu_worker.quantization.checkpoint import CheckpointFormat, expect_dtype, expect_shape
from gpu_worker.quantization.packed import FP8_BITS, PackedWeight, QuantizedTensor
from gpu_worker.quantization.packed_linear import PackedLinearMethod

log = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)      # 448
TILE_BYTES = 4 << 20                       # fp32 bytes of one upcast tile of weights


class Fp8Tensor(QuantizedTensor):
    """w = values * scale[n, k // group]: fp8 values [N, K], fp32 scales [N, K // group]."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor):
        self.values, self.scale = values, scale.float()
        self.shape = tuple(values.shape)
        self.group = values.shape[1] // scale.shape[1]

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Fp8Tensor":
        """One scale per output channel, so each row's largest weight lands on fp8's largest value."""
        scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return cls((w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale)

    def regroup(self, group: int) -> torch.Tensor:
        return self.scale.repeat_interleave(self.group // group, dim=1)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        return (self.values.float().view(n, -1, self.group) * self.scale[:, :, None]).view(n, k)


@dataclass
class FP8Format(CheckpointFormat):
    block: tuple[int, int] | None       # weight_block_size [bn, bk]: scales per block, else per tensor/channel
    method = "fp8"
    markers = ("weight_scale", "weight_scale_inv")
    parts = ("weight", "weight_scale", "weight_scale_inv", "input_scale")

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "FP8Format":
        block = cfg.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) <= 0):
            raise ValueError(f"fp8 weight_block_size {block}: expected [rows, columns]")
        return cls(tuple(int(b) for b in block) if block else None)

    def build(self, prefix: str, parts: dict[str, torch.Tensor]) -> Fp8Tensor:
        if "weight" not in parts:
            raise ValueError(f"checkpoint layer {prefix!r} has fp8 scales but no weight")
        w = parts["weight"]
        expect_dtype(f"{prefix}.weight", w, (FP8,))
        n, k = w.shape
        if "input_scale" in parts:
            log.info("fp8 input_scale of %s read and not applied: weights are upcast, activations stay unquantized", prefix)
        if self.block is not None:
            bn, bk = self.block
            s = parts.get("weight_scale_inv", parts.get("weight_scale"))
            expect_shape(f"{prefix}.weight_scale_inv", s, (-(-n // bn), -(-k // bk)), f"[{bn}, {bk}] blocks of {n}x{k}")
            if k % bk:
                raise ValueError(f"checkpoint tensor {prefix + '.weight'!r}: {k} columns are not whole blocks of {bk}")
            return Fp8Tensor(w, s.float().repeat_interleave(bn, dim=0)[:n])
        s = parts.get("weight_scale")
        if s is None:
            raise ValueError(f"checkpoint layer {prefix!r} has weight_scale_inv but no weight_block_size in its config")
        if s.numel() not in (1, n):
            raise ValueError(f"checkpoint tensor {prefix + '.weight_scale'!r} has shape {tuple(s.shape)}, expected "
                             f"one scale or {n} (per output channel)")
        return Fp8Tensor(w, s.float().reshape(-1, 1).expand(n, 1).contiguous())


class Fp8LinearMethod(PackedLinearMethod):
    """Shards that arrive as Fp8Tensor are kept; plain ones are quantized per channel after loading."""
    keeps = Fp8Tensor
    quantizes_lm_head = False        # vLLM keeps the output projection in the run dtype

    def process_weights_after_loading(self, layer: Linear) -> None:
        shards, layer.pending_shards = layer.pending_shards, {}
        parts = [shards.get(s) or Fp8Tensor.quantize(layer.weight.data[lo:hi])
                 for s, (lo, hi) in layer.shard_ranges.items()]
        group = min(p.group for p in parts)
        device = layer.weight.device
        del layer.weight
        values, scale = torch.cat([p.values for p in parts]).to(device), torch.cat([p.regroup(group) for p in parts])
        pow2 = group & -group                 # the native kernel's groups are powers of two
        if device.type == "cpu" and native.library() is not None and pow2 >= 16 and values.shape[1] % 32 == 0:
            scale = scale.repeat_interleave(group // pow2, dim=1).contiguous()
            layer.packed = PackedWeight(values.view(torch.uint8), scale, torch.zeros_like(scale), FP8_BITS, pow2)
            return
        layer.register_buffer("w_fp8", values, persistent=False)
        layer.register_buffer("w_scale", scale.to(device), persistent=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed is not None:          # the CPU: the native kernel expands e4m3 in registers
            return layer.packed.matmul(x, layer.bias)
        w8, scale = layer.w_fp8, layer.w_scale
        (n, k), lead = w8.shape, x.shape[:-1]
        group = k // scale.shape[1]
        x2 = x.reshape(-1, k)
        tile = max(1, TILE_BYTES // (4 * k))
        outs = []
        for r0 in range(0, n, tile):        # a few tiles a layer: bookkeeping, not per element
            r1 = min(n, r0 + tile)
            w = (w8[r0:r1].to(x.dtype).view(r1 - r0, -1, group) * scale[r0:r1, :, None].to(x.dtype)).view(r1 - r0, k)
            outs.append(torch.nn.functional.linear(x2, w))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*lead, n)
