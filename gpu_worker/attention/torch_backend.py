"""Pure-torch paged attention: the CPU backend and the reference the Triton kernels are tested against.

Decodes (one query token) of the whole batch run as one padded SDPA call over K/V gathered block by
block through the block tables; prefill chunks run one SDPA call each (there are few per step). A fresh prefill with no
cached context attends to its own K/V directly, with no gather.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.attention import AttentionMetadata


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table[positions // block_size].long() * block_size + positions % block_size


class TorchAttentionBackend:
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        ql, sl = meta.query_lens_list, meta.seq_lens_list
        dev = meta.block_tables.device
        decodes = [i for i, q in enumerate(ql) if q == 1]
        extra = meta.extra
        if decodes:
            idx = torch.tensor(decodes, device=dev)
            max_len = max(sl[i] for i in decodes)
            num_blocks = -(-max_len // meta.block_size)
            pos = torch.arange(num_blocks * meta.block_size, device=dev)
            extra["decode_rows"] = meta.query_start_loc[idx].long()
            extra["decode_blocks"] = meta.block_tables[idx, :num_blocks].long()          # [Bd, nb]
            extra["decode_mask"] = (pos[None, :] < meta.seq_lens[idx][:, None].to(pos.dtype))[:, None, None, :]
        extra["prefills"] = []
        for i, q in enumerate(ql):
            if q == 1:
                continue
            start = int(meta.query_start_loc[i])
            ctx = sl[i] - q
            entry = {"rows": slice(start, start + q), "fresh": ctx == 0}
            if ctx:
                pos = torch.arange(sl[i], device=dev)
                entry["slots"] = _slots(meta.block_tables[i], pos, meta.block_size)
                qpos = torch.arange(ctx, sl[i], device=dev)
                entry["mask"] = pos[None, :] <= qpos[:, None]
            extra["prefills"].append(entry)

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
        kf, vf = k_cache.view(-1, nh, hd), v_cache.view(-1, nh, hd)
        out = torch.empty_like(query)
        ex = meta.extra
        if "decode_rows" in ex:
            rows, blocks = ex["decode_rows"], ex["decode_blocks"]
            bd, length = blocks.shape[0], blocks.shape[1] * k_cache.shape[1]
            q = query[rows].unsqueeze(2)                                      # [Bd, Hq, 1, D]
            # gathering whole blocks copies contiguous chunks: much cheaper than a gather per slot
            k = k_cache[blocks].view(bd, length, nh, hd).transpose(1, 2)     # [Bd, Hkv, L, D]
            v = v_cache[blocks].view(bd, length, nh, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=ex["decode_mask"],
                                               scale=scale, enable_gqa=True)
            out[rows] = o.squeeze(2)
        for p in ex["prefills"]:
            q = query[p["rows"]].transpose(0, 1)                              # [Hq, n, D]
            if p["fresh"] and key is not None:
                k, v = key[p["rows"]].transpose(0, 1), value[p["rows"]].transpose(0, 1)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                if p["fresh"]:
                    n = q.shape[1]
                    pos = torch.arange(n, device=q.device)
                    p["slots"] = meta.slot_mapping[p["rows"]]
                    p["mask"] = pos[None, :] <= pos[:, None]
                k = kf[p["slots"]].transpose(0, 1).to(q.dtype)
                v = vf[p["slots"]].transpose(0, 1).to(q.dtype)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=p["mask"], scale=scale, enable_gqa=True)
            out[p["rows"]] = o.transpose(0, 1)
        return out
