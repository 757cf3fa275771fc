"""The LoRA delta of one step's flat batch, where every token may run under a different adapter slot.

Layout of one adapted layer with J output shards (q/k/v, gate/up, or one), S slots and rank R:

    a:      [S, J, R, in]       shard j's A matrix of the adapter in slot s (rows past its rank are 0)
    bs[j]:  [S, R, out_j]       shard j's B^T, already scaled by alpha / r (or alpha / sqrt(r))

On CUDA a gather kernel reads each token's own slot (kernels/triton_lora.py). On CPU the rows come in
runs of one slot (SGMV-style: the model runner orders a step's sequences by adapter, so each adapter's
rows are one run), and each run is two GEMMs on views of x and y, with no gather, no scatter and no
work for slots the run does not use: h = x[run] @ A[s]^T for all J shards at once, then
y[run, shard j] += h_j @ B_j[s].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

Run = tuple[int, int, int]          # (slot, first row, end row)


@dataclass
class LoRABatch:
    """One step's adapter of every token: `slots` [T] int32 on the device (-1: the base model) and, for
    the CPU path, `runs`, the maximal runs of consecutive rows under one adapter."""
    slots: torch.Tensor
    runs: list[Run] | None

    @classmethod
    def build(cls, slots: torch.Tensor, device: torch.device) -> "LoRABatch":
        """From per-row slots on the CPU."""
        if device.type == "cuda":
            return cls(slots.to(device=device, dtype=torch.int32), None)
        values, counts = torch.unique_consecutive(slots, return_counts=True)
        runs, row = [], 0
        for s, n in zip(values.tolist(), counts.tolist()):
            if s >= 0:
                runs.append((s, row, row + n))
            row += n
        return cls(slots, runs)


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
                   ranges: list[tuple[int, int]], runs: list[Run]) -> torch.Tensor:
    """y[:, lo_j:hi_j] += each row's LoRA delta of shard j, in place, one run of rows at a time."""
    num_slots, num_shards, rank, k = a.shape
    for slot, r0, r1 in runs:
        h = F.linear(x[r0:r1], a[slot].view(num_shards * rank, k))
        for j, ((lo, hi), b) in enumerate(zip(ranges, bs)):
            y[r0:r1, lo:hi].addmm_(h[:, j * rank:(j + 1) * rank], b[slot])
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
             ranges: list[tuple[int, int]], batch: LoRABatch) -> torch.Tensor:
    if batch.runs is None:
        from gpu_worker.kernels import triton_lora      # imports triton: only where it runs
        return triton_lora.add_lora(y, x, a, bs, ranges, batch.slots)
    return add_lora_torch(y, x, a, bs, ranges, batch.runs)
