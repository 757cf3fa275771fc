"""The LoRA delta of one step's flat batch, where every token may run under a different adapter slot.

Layout of one adapted layer with J output shards (q/k/v, gate/up, or one), S slots and rank R:

    a:      [J, S, R, in]       shard j's A matrix of the adapter in slot s (rows past its rank are 0)
    bs[j]:  [S, R, out_j]       shard j's B^T, already scaled by alpha / r (or alpha / sqrt(r))

On CUDA a gather kernel reads each token's own slot (kernels/triton_lora.py). On CPU, where a step
has few tokens and GEMMs are what the hardware does well, the same sum is three dense ops per shard
over all S*R columns at once: h = x @ A_all^T, zeroed outside each token's slot by a mask built once a
step, then y += h @ B_all. Their cost grows with S*R, which --max-loras and --max-lora-rank bound.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LoRABatch:
    """One step's adapter of every token: `slots` [T] (-1: the base model) and, for the CPU path, `mask`
    [T, S*R], 1 where a column of h belongs to the token's slot."""
    slots: torch.Tensor
    mask: torch.Tensor | None

    @classmethod
    def build(cls, slots: torch.Tensor, num_slots: int, rank: int, dtype: torch.dtype) -> "LoRABatch":
        if slots.device.type == "cuda":
            return cls(slots, None)
        cols = torch.arange(num_slots, device=slots.device).repeat_interleave(rank)
        return cls(slots, (slots[:, None] == cols[None, :]).to(dtype))


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
                   ranges: list[tuple[int, int]], mask: torch.Tensor) -> torch.Tensor:
    """y[:, lo_j:hi_j] += each token's LoRA delta of shard j, in place (dense masked form)."""
    num_shards, num_slots, rank, k = a.shape
    cols = num_slots * rank
    h = F.linear(x, a.view(num_shards * cols, k)).view(-1, num_shards, cols) * mask[:, None, :]
    for j, ((lo, hi), b) in enumerate(zip(ranges, bs)):
        y[:, lo:hi].addmm_(h[:, j], b.view(cols, hi - lo))
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
             ranges: list[tuple[int, int]], batch: LoRABatch) -> torch.Tensor:
    if batch.mask is None:
        from gpu_worker.kernels import triton_lora      # imports triton: only where it runs
        return triton_lora.add_lora(y, x, a, bs, ranges, batch.slots)
    return add_lora_torch(y, x, a, bs, ranges, batch.mask)
