"""The token embedding table, kept either as fp32 rows or packed like a quantized Linear.

GGUF files usually store token_embd quantized (Q8_0, Q6_K, ...), and with tied embeddings the same table
is the output projection, so it stays packed once and serves both: a lookup expands only the rows of
the step's tokens, and the lm_head shares the packed table (Linear.tie).

Under tensor parallelism each rank holds its rows of the vocabulary (common/tp_layout.vocab_rows): a
lookup fills the rows of the ids it holds, zeros the others, and the ranks' results are summed; the
lm_head holds the same rows, and its logits are gathered before sampling (gather_logits)."""
from __future__ import annotations

import torch
from torch import nn

from common.tp_layout import vocab_rows
from gpu_worker.layers.linear import materialize
from gpu_worker.parallel import all_gather, all_reduce, tp
from gpu_worker.quantization.packed import PackedWeight, QuantizedTensor


def vocab_part(vocab_size: int) -> tuple[int, int]:
    """This rank's rows [lo, hi) of the vocabulary (hi capped at the vocabulary: no padding rows held)."""
    g = tp()
    lo, hi = vocab_rows(vocab_size, g.size, g.rank)
    return min(lo, vocab_size), min(hi, vocab_size)


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's logits columns side by side: equal parts (the short last one padded), then cut to
    the vocabulary."""
    g = tp()
    if g.size == 1:
        return local
    per = vocab_rows(vocab_size, g.size, 0)[1]
    if local.shape[-1] < per:
        local = torch.nn.functional.pad(local, (0, per - local.shape[-1]))
    return all_gather(local)[..., :vocab_size]


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.lo, self.hi = vocab_part(num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, embedding_dim, dtype=dtype), requires_grad=False)
        self.packed: PackedWeight | None = None

    def load(self, param: str, tensor: torch.Tensor | QuantizedTensor, shard: str = "") -> None:
        want = (self.num_embeddings, self.weight.shape[1])
        if tuple(tensor.shape) != want:
            raise ValueError(f"shape mismatch for the embedding: checkpoint {tuple(tensor.shape)}, model {want}")
        if (self.lo, self.hi) != (0, self.num_embeddings):
            tensor = tensor[self.lo:self.hi]
        tensor = materialize(tensor)
        if isinstance(tensor, QuantizedTensor):
            self.packed = tensor.pack(self.weight.device)
            self._dtype = self.weight.dtype
            del self.weight               # the fp32 table was never written, so it never took memory
        else:
            self.weight.data.copy_(tensor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp().size == 1:
            return self._lookup(ids)
        local = ids - self.lo
        outside = (local < 0) | (local >= self.hi - self.lo)
        rows = self._lookup(local.masked_fill(outside, 0))
        return all_reduce(rows.masked_fill_(outside[..., None], 0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.dequantize(ids.reshape(-1)).to(self._dtype).reshape(*ids.shape, -1)
        return nn.functional.embedding(ids, self.weight)
