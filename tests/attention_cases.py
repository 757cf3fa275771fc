"""Attention test cases shared by the backend tests: step metadata over a randomly laid-out paged cache."""
from __future__ import annotations

import torch

from gpu_worker.attention import AttentionMetadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_meta(seqs: list[tuple[int, int]], block_size: int, num_blocks: int,
              gen: torch.Generator, device: torch.device = DEVICE) -> AttentionMetadata:
    """Metadata for sequences given as (context_len, query_len), with blocks drawn from a random
    permutation of the cache so block tables are non-contiguous and unordered."""
    ctx = [c for c, _ in seqs]
    ql = [q for _, q in seqs]
    sl = [c + q for c, q in seqs]
    nblk = [(s + block_size - 1) // block_size for s in sl]
    assert sum(nblk) <= num_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(nblk)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[used:used + n]
        used += n
    slots = []
    for i, (c, s) in enumerate(zip(ctx, sl)):
        pos = torch.arange(c, s)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(ql), 0)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(sl, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        block_size=block_size,
        max_query_len=max(ql),
        max_seq_len=max(sl),
        query_lens_list=ql,
        seq_lens_list=sl,
    )


def rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: torch.device = DEVICE) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
