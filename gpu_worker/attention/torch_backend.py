"""Pure-torch paged attention: the CPU backend and the reference the Triton kernels are tested against.

Decodes (one query token) run as padded batched SDPA calls over K/V gathered block by block through the
block tables; decodes are grouped by length so a few long sequences do not pad every short one. Prefill
chunks run one SDPA call each (there are few per step); a fresh prefill with no cached context attends
to its own new K/V directly, with no gather. Index tensors are built once per step in prepare().
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.attention import AttentionMetadata

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


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
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

    def prepare(self, meta: AttentionMetadata) -> None:
        ql, sl, bs = meta.query_lens_list, meta.seq_lens_list, meta.block_size
        dev = meta.block_tables.device
        decodes = sorted((i for i, q in enumerate(ql) if q == 1), key=lambda i: sl[i])
        meta.extra["decodes"] = [self._decode_group(meta, g) for g in _decode_groups(sl, decodes)]
        meta.extra["prefills"] = []
        starts = meta.query_start_loc.tolist()
        for i, q in enumerate(ql):
            if q == 1:
                continue
            ctx = sl[i] - q
            entry = {"rows": slice(starts[i], starts[i] + q), "fresh": ctx == 0, "len": sl[i]}
            if ctx:
                entry["blocks"] = meta.block_tables[i, :-(-sl[i] // bs)].long()
                qpos = torch.arange(ctx, sl[i], device=dev)
                entry["mask"] = torch.arange(sl[i], device=dev)[None, :] <= qpos[:, None]
            meta.extra["prefills"].append(entry)

    @staticmethod
    def _decode_group(meta: AttentionMetadata, idx_list: list[int]) -> dict:
        dev = meta.block_tables.device
        idx = torch.tensor(idx_list, device=dev)
        num_blocks = -(-max(meta.seq_lens_list[i] for i in idx_list) // meta.block_size)
        pos = torch.arange(num_blocks * meta.block_size, device=dev)
        return {"rows": meta.query_start_loc[idx].long(),
                "blocks": meta.block_tables[idx, :num_blocks].long(),                     # [Bd, nb]
                "mask": (pos[None, :] < meta.seq_lens[idx][:, None].to(pos.dtype))[:, None, None, :]}

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        nh, hd = k_cache.shape[-2:]
        k_cache.view(-1, nh, hd).index_copy_(0, meta.slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, nh, hd).index_copy_(0, meta.slot_mapping, value.to(v_cache.dtype))

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Hq, D]; `key`/`value` are this step's new K/V [T, Hkv, D] (used by fresh prefills)."""
        if "prefills" not in meta.extra:
            self.prepare(meta)
        nh, hd = k_cache.shape[-2:]
        out = torch.empty_like(query)
        for g in meta.extra["decodes"]:
            rows, blocks = g["rows"], g["blocks"]
            bd, length = blocks.shape[0], blocks.shape[1] * k_cache.shape[1]
            q = query[rows].unsqueeze(2)                                       # [Bd, Hq, 1, D]
            # gathering whole blocks copies contiguous chunks: much cheaper than a gather per slot
            k = self._gather("k", k_cache, blocks).view(bd, length, nh, hd).transpose(1, 2)   # [Bd, Hkv, L, D]
            v = self._gather("v", v_cache, blocks).view(bd, length, nh, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=g["mask"],
                                               scale=scale, enable_gqa=True)
            out[rows] = o.squeeze(2)
        for p in meta.extra["prefills"]:
            rows = p["rows"]
            q = query[rows].transpose(0, 1).unsqueeze(0)                       # [1, Hq, n, D]: 4-D is SDPA's fast path
            if p["fresh"]:
                k, v = (key[rows], value[rows]) if key is not None else \
                    (t.view(-1, nh, hd)[meta.slot_mapping[rows]] for t in (k_cache, v_cache))
                o = F.scaled_dot_product_attention(q, k.transpose(0, 1).unsqueeze(0).to(q.dtype),
                                                   v.transpose(0, 1).unsqueeze(0).to(q.dtype), is_causal=True,
                                                   scale=scale, enable_gqa=True)
            else:
                k = self._gather("k", k_cache, p["blocks"]).view(-1, nh, hd)[:p["len"]].transpose(0, 1).unsqueeze(0)
                v = self._gather("v", v_cache, p["blocks"]).view(-1, nh, hd)[:p["len"]].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=p["mask"],
                                                   scale=scale, enable_gqa=True)
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out
