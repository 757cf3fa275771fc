"""Pure-torch paged attention: the CPU backend and the reference the Triton kernels are tested against.

Decodes (one query token), and short query runs behind a context (speculative verification), run
through the native CPU kernel when it is built (cpu_attention: in place, one call per layer). Without it
decodes run as padded batched SDPA calls over K/V gathered block by block through the block tables,
grouped by length so a few long sequences do not pad every short one. Prefill chunks run one SDPA call
each (there are few per step); a fresh prefill with no cached context attends to its own new K/V
directly, with no gather. Index tensors are built once per step in prepare().

A windowed layer (sliding-window attention) masks the keys more than `window - 1` positions behind each
query (the masks are built once per step and window); soft-capped scores (Gemma 2) are computed
explicitly, since SDPA cannot cap them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gpu_worker.attention import (FP8_DTYPES, AttentionMetadata, cache_scale, cpu_attention, index_copy_rows, read_rows,
                                  to_cache)

# decodes whose lengths differ by more than this factor go to separate SDPA calls
_DECODE_GROUP_SPREAD = 2.0


def _decode_groups(lengths: list[int], order: list[int]) -> list[list[int]]:
    """Split decodes (sorted by length) into groups whose longest is at most SPREAD x their shortest."""
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] <= _DECODE_GROUP_SPREAD * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class DecodeGroup:
    """Decodes of similar length, run as one padded SDPA call."""
    rows: torch.Tensor          # [Bd] their query rows
    blocks: torch.Tensor        # [Bd, nb] block ids to gather, padded to the longest
    mask: torch.Tensor          # [Bd, 1, 1, nb * block_size] valid key positions
    seq_lens: torch.Tensor      # [Bd, 1, 1, 1] each decode's length (its query sits at length - 1)
    all_rows: bool = False      # the step's only work, rows 0..Bd-1 in order: no gather or scatter of rows
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)   # window -> mask

    def mask_for(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        if window not in self.windowed:
            pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.windowed[window] = self.mask & (pos > self.seq_lens - 1 - window)
        return self.windowed[window]


@dataclass
class PrefillChunk:
    """A sequence running several tokens: a fresh prefill (no cached context) or a chunk behind context."""
    rows: slice
    length: int                           # context + new tokens
    blocks: torch.Tensor | None = None    # block ids holding its keys; None for a fresh prefill
    mask: torch.Tensor | None = None      # [n, length] causal mask by absolute position
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)   # window -> mask

    def mask_for(self, window: int | None, dev: torch.device) -> torch.Tensor | None:
        """The mask of queries over keys by absolute position; None: plain causal over its own keys."""
        if window is None:
            return self.mask
        if window not in self.windowed:
            n = self.rows.stop - self.rows.start
            qpos = torch.arange(self.length - n, self.length, device=dev)[:, None]
            kpos = torch.arange(self.length, device=dev)[None, :]
            self.windowed[window] = (kpos <= qpos) & (kpos > qpos - window)
        return self.windowed[window]


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    native: cpu_attention.NativeRuns | None = None      # set: these sequences run in the native kernel


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, native: bool | None = None) -> None:
        """`native`: use the CPU attention kernel (None: when it is built and the cache is on the CPU)."""
        self.native = native
        # Scratch for gathered K/V, reused by every layer: a fresh multi-MB tensor per call costs more in
        # page faults than the copy itself (index_select into it is ~2.5x faster than a fresh gather).
        self._scratch: dict[str, torch.Tensor] = {}

    def _gather(self, name: str, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """cache[blocks] for blocks [..., nb] -> [..., nb, block_size, Hkv, D], into reused scratch."""
        n = blocks.numel()
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < n or buf.dtype != cache.dtype or buf.shape[1:] != cache.shape[1:]:
            buf = self._scratch[name] = torch.empty((max(n, 64), *cache.shape[1:]), dtype=cache.dtype,
                                                    device=cache.device)
        out = buf[:n]
        torch.index_select(cache, 0, blocks.reshape(-1), out=out)
        return out.view(*blocks.shape, *cache.shape[1:])

    def prepare(self, meta: AttentionMetadata) -> TorchAttentionMetadata:
        ql, sl = meta.query_lens_list, meta.seq_lens_list
        starts = meta.query_start_loc.tolist()
        if self.native is None:
            self.native = cpu_attention.usable(meta.block_tables.device)
        if self.native:
            runs = [i for i, q in enumerate(ql) if cpu_attention.takes(q, sl[i])]
            if runs:
                prefills = [self._prefill(meta, i, starts[i]) for i, q in enumerate(ql)
                            if not cpu_attention.takes(q, sl[i])]
                nr = cpu_attention.prepare(meta.block_tables, meta.seq_lens, meta.query_start_loc, ql, runs,
                                           every_row=len(runs) == len(ql))
                return TorchAttentionMetadata(meta.slot_mapping, [], prefills, nr)
        prefills = [self._prefill(meta, i, starts[i]) for i, q in enumerate(ql) if q != 1]
        decodes = [i for i, q in enumerate(ql) if q == 1]
        decodes.sort(key=lambda i: sl[i])
        groups = [self._decode_group(meta, g) for g in _decode_groups(sl, decodes)]
        if len(groups) == 1 and decodes == list(range(len(ql))):
            groups[0].all_rows = True      # e.g. every step of a single stream
        return TorchAttentionMetadata(meta.slot_mapping, groups, prefills)

    @staticmethod
    def _prefill(meta: AttentionMetadata, i: int, start: int) -> PrefillChunk:
        q, length = meta.query_lens_list[i], meta.seq_lens_list[i]
        ctx = length - q
        if not ctx:
            return PrefillChunk(slice(start, start + q), length)
        dev = meta.block_tables.device
        qpos = torch.arange(ctx, length, device=dev)
        return PrefillChunk(slice(start, start + q), length,
                            blocks=meta.block_tables[i, :-(-length // meta.block_size)].long(),
                            mask=torch.arange(length, device=dev)[None, :] <= qpos[:, None])

    @staticmethod
    def _decode_group(meta: AttentionMetadata, idx_list: list[int]) -> DecodeGroup:
        dev = meta.block_tables.device
        idx = torch.tensor(idx_list, device=dev)
        num_blocks = -(-max(meta.seq_lens_list[i] for i in idx_list) // meta.block_size)
        pos = torch.arange(num_blocks * meta.block_size, device=dev)
        lens = meta.seq_lens[idx].to(pos.dtype)[:, None, None, None]
        return DecodeGroup(rows=meta.query_start_loc[idx].long(),
                           blocks=meta.block_tables[idx, :num_blocks].long(),
                           mask=pos < lens, seq_lens=lens)

    def write_kv(self, key, value, k_cache, v_cache, meta: TorchAttentionMetadata, k_scale: float = 1.0,
                 v_scale: float = 1.0, k_feedback: torch.Tensor | None = None) -> None:
        if cpu_attention.write_kv(key, value, k_cache, v_cache, meta.slot_mapping):
            return
        nh, hd = k_cache.shape[-2:]
        index_copy_rows(k_cache.view(-1, nh, hd), meta.slot_mapping, to_cache(key, k_cache.dtype, k_scale, k_feedback))
        index_copy_rows(v_cache.view(-1, nh, hd), meta.slot_mapping, to_cache(value, v_cache.dtype, v_scale))

    def forward(self, query, key, value, k_cache, v_cache, meta: TorchAttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0, window: int | None = None,
                softcap: float | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Hq, D]; `key`/`value` [T, Hkv, D] are read directly by fresh prefills (no gather).
        K and V are read as the cache holds them (for fp8, divided by the layer's scales): the scales
        multiply the softmax scale and the output, so every path sees the same values. `window`: each
        query sees only its last `window` keys; `softcap`: scores become tanh(s / cap) * cap; `sink`
        [2, Hkv, D] fp32: added to every sequence's position-0 key and value as the cache holds them (an
        fp8 cache stores that entry around a centre of its own, layers/kv_rotation.py)."""
        if k_cache.dtype in FP8_DTYPES and meta.prefills:    # the bytes write_kv stored, as later steps read them
            nh, hd = k_cache.shape[-2:]
            key = read_rows(k_cache.view(-1, nh, hd), meta.slot_mapping).to(query.dtype)
            value = read_rows(v_cache.view(-1, nh, hd), meta.slot_mapping).to(query.dtype)
        scale = scale * cache_scale(k_cache.dtype, k_scale)
        v_scale = cache_scale(v_cache.dtype, v_scale)
        nr, how = meta.native, (scale, window, softcap, sink)
        if nr is not None and nr.rows is None:
            out = cpu_attention.attend(query, k_cache, v_cache, nr, *how)
        elif len(meta.decodes) == 1 and meta.decodes[0].all_rows:
            out = self._decode(query, k_cache, v_cache, meta.decodes[0], *how)
        else:
            out = torch.empty_like(query)
            if nr is not None:
                out[nr.rows] = cpu_attention.attend(query, k_cache, v_cache, nr, *how)
            for g in meta.decodes:
                out[g.rows] = self._decode(query, k_cache, v_cache, g, *how)
            for p in meta.prefills:
                out[p.rows] = self._prefill_attention(query, key, value, k_cache, v_cache, p, *how)
        return out if v_scale == 1.0 else out * v_scale

    def _decode(self, query, k_cache, v_cache, g: DecodeGroup, scale: float, window: int | None,
                softcap: float | None, sink: torch.Tensor | None) -> torch.Tensor:
        nh, hd = k_cache.shape[-2:]
        bd, length = g.blocks.shape[0], g.blocks.shape[1] * k_cache.shape[1]
        q = (query if g.all_rows else query[g.rows]).unsqueeze(2)              # [Bd, Hq, 1, D]
        # gathering whole blocks copies contiguous chunks: much cheaper than a gather per slot
        k = self._gather("k", k_cache, g.blocks).view(bd, length, nh, hd).transpose(1, 2)   # [Bd, Hkv, L, D]
        v = self._gather("v", v_cache, g.blocks).view(bd, length, nh, hd).transpose(1, 2)
        k, v = _with_sink(k.to(q.dtype), v.to(q.dtype), sink, 2)
        o = _attend(q, k, v, g.mask_for(window), scale, softcap)
        return o.squeeze(2)

    def _prefill_attention(self, query, key, value, k_cache, v_cache, p: PrefillChunk, scale: float,
                           window: int | None, softcap: float | None, sink: torch.Tensor | None) -> torch.Tensor:
        nh, hd = k_cache.shape[-2:]
        plain = self.native and softcap is None and sink is None       # (a sink comes with fp8 caches only)
        dt = cpu_attention.prefill_dtype(k_cache.dtype, query) if plain else query.dtype
        q = query[p.rows].transpose(0, 1).unsqueeze(0).to(dt)                  # [1, Hq, n, D]: 4-D is SDPA's fast path
        mask = p.mask_for(window, q.device)
        if p.blocks is None:                                                   # fresh: no cached context
            k, v = key[p.rows], value[p.rows]
            if sink is not None:                                               # not the step's own tensors
                k, v = _with_sink(k.clone(), v.clone(), sink, 0)
        else:     # behind a window, only the blocks from the one holding the first query's first key
            n, bs = p.rows.stop - p.rows.start, k_cache.shape[1]
            lo = 0 if window is None else max(0, p.length - n - window + 1) // bs
            k = self._gather("k", k_cache, p.blocks[lo:]).view(-1, nh, hd)[:p.length - lo * bs]
            v = self._gather("v", v_cache, p.blocks[lo:]).view(-1, nh, hd)[:p.length - lo * bs]
            k, v = _with_sink(k.to(q.dtype), v.to(q.dtype), sink if lo == 0 else None, 0)
            mask = mask[:, lo * bs:]
        o = _attend(q, k.transpose(0, 1).unsqueeze(0).to(q.dtype), v.transpose(0, 1).unsqueeze(0).to(q.dtype), mask,
                    scale, softcap)
        return o.squeeze(0).transpose(0, 1).to(query.dtype)


def _with_sink(k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None,
               dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v (copies of the cache's entries, position 0 at index 0 of `dim`) with the sink added there."""
    if sink is not None:
        k.select(dim, 0).add_(sink[0].to(k.dtype))
        v.select(dim, 0).add_(sink[1].to(v.dtype))
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None) -> torch.Tensor:
    """Attention of q [B, Hq, n, D] over k, v [B, Hkv, L, D] with a boolean mask broadcast to [B, *, n, L]
    (None: causal, n == L). SDPA unless the scores are soft-capped: then explicitly, the softmax in fp32."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    if mask is None:
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v
