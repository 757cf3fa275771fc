"""A GGUF matrix as the loader reads it (`--quantization gguf`, the default for a GGUF model).

The loader hands each quantized matrix over as a GGUFTensor; PackedLinearMethod takes it apart into
integer values and group scales (gguf_blocks) and keeps them packed, so a decode step reads ~0.6-1.2
bytes per weight instead of fp32's 4. `--quantization none` on the same file expands everything to fp32
at load and is the reference.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from gpu_worker.quantization.gguf_blocks import decode
from gpu_worker.quantization.packed import GroupQuant, QuantizedTensor


class GGUFTensor(QuantizedTensor):
    """One GGUF matrix as raw block bytes, one row of blocks per output feature."""

    def __init__(self, raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]):
        self.raw, self.qtype, self.shape = raw, qtype, shape

    def __getitem__(self, rows: slice) -> "GGUFTensor":
        """Rows lo:hi (a shard of a fused matrix, such as Phi-3's attn_qkv): whole rows of blocks."""
        raw = self.raw[rows]
        return GGUFTensor(raw, self.qtype, (raw.shape[0], self.shape[1]))

    def groups(self) -> GroupQuant:
        return decode(self.raw, self.qtype, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        return torch.from_numpy(np.array(gguf_dequantize(self.raw, self.qtype), np.float32).reshape(self.shape))
