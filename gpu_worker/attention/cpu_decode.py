"""Decode attention through the native CPU kernel (gpu_worker/kernels/paged_attention.cpp).

The torch backend's decodes otherwise gather each sequence's blocks into a copy and run a padded SDPA
per length group, per layer: at a few sequences those fixed costs are most of the attention time. The
kernel reads K/V in place through the block tables, in one call per layer for every decode of the step,
and reads every cache dtype the engine allocates (fp32, bf16, fp16, fp8 e4m3/e5m2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.kernels import native

KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3,
                  torch.float8_e5m2: 4}


@dataclass
class NativeDecodes:
    rows: torch.Tensor | None       # query rows of the decodes; None: every row of the step, in order
    tables: torch.Tensor            # int32 [Bd, max_blocks] their block tables
    lens: torch.Tensor              # int32 [Bd] tokens each attends to, its own included


def usable(device: torch.device) -> bool:
    return device.type == "cpu" and native.library() is not None


def prepare(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
            decodes: list[int], every_row: bool) -> NativeDecodes:
    idx = None if every_row else torch.tensor(decodes, dtype=torch.long)
    tables = block_tables if idx is None else block_tables[idx]
    lens = seq_lens if idx is None else seq_lens[idx]
    return NativeDecodes(None if idx is None else query_start_loc[idx].long(),
                         tables.to(torch.int32).contiguous(), lens.to(torch.int32).contiguous())


def decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, nd: NativeDecodes,
           scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention output [Bd, Hq, D] (in query's dtype) of the decode rows, from the cache as it is stored;
    `window` limits each to its last keys, `softcap` caps the scores (the kernel's header says how)."""
    q = query if nd.rows is None else query[nd.rows]
    q32 = q.float().contiguous()
    bd, hq, d = q32.shape
    out = torch.empty_like(q32)
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    rc = native.library().psq_paged_decode(
        q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), KV_DTYPE_CODES[k_cache.dtype], nd.tables.data_ptr(),
        nd.tables.shape[1], nd.lens.data_ptr(), bd, hq, hkv, d, bs, scale, out.data_ptr(), window or 0, softcap or 0.0,
        native.cpu_isa())
    if rc != 0:
        raise ValueError(f"the native decode kernel cannot take {hq} query heads over {hkv} kv heads")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
