"""The token embedding table, kept either as fp32 rows or packed like a quantized Linear.

GGUF files usually store token_embd quantized (Q8_0, Q6_K, ...), and with tied embeddings the same table
is the output projection, so it stays packed once and serves both: a lookup expands only the rows of
the step's tokens, and the lm_head shares the packed table (Linear.tie)."""
from __future__ import annotations

import torch
from torch import nn

from gpu_worker.quantization.packed import PackedWeight, QuantizedTensor


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)
        self.packed: PackedWeight | None = None

    def load(self, param: str, tensor: torch.Tensor | QuantizedTensor, shard: str = "") -> None:
        if tuple(tensor.shape) != tuple(self.weight.shape):
            raise ValueError(f"shape mismatch for the embedding: checkpoint {tuple(tensor.shape)}, "
                             f"model {tuple(self.weight.shape)}")
        if isinstance(tensor, QuantizedTensor):
            self.packed = tensor.pack(self.weight.device)
            self._dtype = self.weight.dtype
            del self.weight               # the fp32 table was never written, so it never took memory
        else:
            self.weight.data.copy_(tensor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.dequantize(ids.reshape(-1)).to(self._dtype).reshape(*ids.shape, -1)
        return nn.functional.embedding(ids, self.weight)
