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
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from gpu_worker.quantization.gguf_blocks import decode
from gpu_worker.quantization.packed import GroupQuant, QuantizedTensor


class GGUFTensor(QuantizedTensor):
    """One GGUF matrix as raw block bytes, one row of blocks per output feature. `rope_heads`: llama.cpp
    interleaved each of that many heads' rows for its rope; they are put back in HF's order when the
    blocks are read, so a slice of whole heads (a tensor-parallel shard) reads only its own bytes."""

    def __init__(self, raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int],
                 rope_heads: int | None = None):
        self.stored, self.qtype, self.shape, self.rope_heads = raw, qtype, shape, rope_heads

    @property
    def raw(self) -> np.ndarray:
        if self.rope_heads is None:
            return self.stored
        return unpermute_rope(self.stored, self.rope_heads)

    def __getitem__(self, index: slice | tuple[slice, slice]) -> "QuantizedTensor | torch.Tensor":
        """Rows lo:hi (a shard of a fused matrix such as Phi-3's attn_qkv, or a rank's rows), then columns:
        whole blocks stay quantized; columns that cut a block (k-quants' 256) come back dequantized."""
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        lo, hi, _ = rows.indices(self.shape[0])
        heads = self.rope_heads
        if heads is not None:
            per_head = self.shape[0] // heads
            if lo % per_head or hi % per_head:
                raise ValueError(f"rows {lo}:{hi} cut a rope head of {per_head} rows")
            heads = (hi - lo) // per_head
        part = GGUFTensor(self.stored[lo:hi], self.qtype, (hi - lo, self.shape[1]), heads)
        c0, c1, _ = cols.indices(self.shape[1])
        return part if (c0, c1) == (0, self.shape[1]) else part._columns(c0, c1)

    def _columns(self, lo: int, hi: int) -> "QuantizedTensor | torch.Tensor":
        block, nbytes = GGML_QUANT_SIZES[self.qtype]
        if lo % block == 0 and hi % block == 0:
            raw = self.stored[:, lo // block * nbytes:hi // block * nbytes]
            return GGUFTensor(raw, self.qtype, (self.shape[0], hi - lo), self.rope_heads)
        b0, b1 = lo // block, -(-hi // block)
        covering = GGUFTensor(self.stored[:, b0 * nbytes:b1 * nbytes], self.qtype,
                              (self.shape[0], (b1 - b0) * block), self.rope_heads)
        return covering.dequantize()[:, lo - b0 * block:hi - b0 * block].contiguous()

    def groups(self) -> GroupQuant:
        return decode(self.raw, self.qtype, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        return torch.from_numpy(np.array(gguf_dequantize(self.raw, self.qtype), np.float32).reshape(self.shape))


class ExpandedOnRead:
    """A GGUF matrix that the layers take in fp32 (a type not kept packed, or `--quantization none`), read
    lazily: a tensor-parallel rank expands only its own slice of the file (weight_loader.LazySlice's kin)."""

    def __init__(self, tensor: GGUFTensor):
        self.tensor, self.shape = tensor, tensor.shape

    def __getitem__(self, index) -> torch.Tensor:
        part = self.tensor[index]
        return part.dequantize() if isinstance(part, GGUFTensor) else part

    def materialize(self) -> torch.Tensor:
        return self.tensor.dequantize()


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp interleaves q/k rows for its rope; undo it to get back HF's half-rotation layout."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
