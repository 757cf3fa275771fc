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


def dense_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None,
                    sink: torch.Tensor | None = None) -> torch.Tensor:
    """Attention written out per query token from the definition: the keys at positions
    max(0, p - window + 1) .. p of its sequence, scores soft-capped, softmax in fp64; `sink` [2, Hkv, D]
    added to position 0's key and value."""
    hkv, d = k_cache.shape[-2:]
    group = query.shape[1] // hkv
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for i, (ctx, length) in enumerate(zip(meta.context_lens.tolist(), meta.seq_lens_list)):
        slots = [int(meta.block_tables[i, t // meta.block_size]) * meta.block_size + t % meta.block_size
                 for t in range(length)]
        k = k_cache.reshape(-1, hkv, d)[slots].double().repeat_interleave(group, dim=1)   # [L, Hq, D]
        v = v_cache.reshape(-1, hkv, d)[slots].double().repeat_interleave(group, dim=1)
        if sink is not None:
            k[0] += sink[0].double().to(k.device).repeat_interleave(group, 0)
            v[0] += sink[1].double().to(v.device).repeat_interleave(group, 0)
        for j, row in enumerate(range(starts[i], starts[i + 1])):
            p = ctx + j
            lo = 0 if window is None else max(0, p - window + 1)
            s = torch.einsum("hd,thd->ht", query[row].double(), k[lo:p + 1]) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[row] = torch.einsum("ht,thd->hd", s.softmax(-1), v[lo:p + 1]).to(query.dtype)
    return out
