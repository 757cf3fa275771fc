"""Paged attention through the native CPU kernel (gpu_worker/kernels/paged_attention.cpp), for decodes
and for short query runs behind a context (speculative verification, small prefill chunks).

The torch backend otherwise gathers each sequence's blocks into a copy and runs a masked SDPA, per
layer: at a few sequences those fixed costs are most of the attention time. The kernel reads K/V in
place through the block tables, in one call per layer for every such sequence of the step, and reads
every cache dtype the engine allocates (fp32, bf16, fp16, fp8 e4m3/e5m2). A bf16 cache on a CPU with
AMX-BF16 runs on the tiles (native.attention_isa): 1.46-1.72x for verification runs of 7 tokens, the same
as the vector loops for decodes (loadtest/results/attention_amx_2026-12-05.txt).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.kernels import native

KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3,
                  torch.float8_e5m2: 4}
# Query runs up to this long, behind a context, go to the kernel: it reads each key tile once for every
# row of a sequence, so a speculative step's k + 1 rows cost little more than one decode. Longer chunks
# are prefill work, where SDPA's batched matmuls win.
MAX_QUERY_LEN = 16
AMX_HEAD_DIMS = (32, 64, 128)     # head sizes the kernel runs on AMX tiles (takes_amx in paged_attention.cpp)


@dataclass
class NativeRuns:
    rows: torch.Tensor | None       # the step's query rows of these sequences; None: every row, in order
    tables: torch.Tensor            # int32 [B, max_blocks] their block tables
    lens: torch.Tensor              # int32 [B] tokens each attends to, its new ones included
    q_start: torch.Tensor           # int32 [B + 1] where each one's rows start among `rows`


def prefill_dtype(cache_dtype: torch.dtype, query: torch.Tensor) -> torch.dtype:
    """The dtype a prefill's SDPA runs in. Where the bf16 tiles run decodes (AMX, a bf16 cache, fp32
    queries of a head size the tiles take: --dtype auto), prefills round queries, keys and values to bf16
    too, and torch's flash kernel runs them on AMX: 2.1-2.4x faster at 256-512 tokens, the same at 64
    (loadtest/results/prefill_bf16_2026-12-06.txt). Elsewhere the query's own dtype (the fp32 exact mode
    stays exact)."""
    if cache_dtype == torch.bfloat16 and query.dtype == torch.float32 and query.shape[-1] in AMX_HEAD_DIMS \
            and usable(query.device) and native.attention_isa() == native.AMX:
        return torch.bfloat16
    return query.dtype


def usable(device: torch.device) -> bool:
    return device.type == "cpu" and native.library() is not None


def takes(query_len: int, seq_len: int) -> bool:
    """Whether the kernel runs this sequence's attention: a decode, or a short run behind a context."""
    return query_len == 1 or (query_len <= MAX_QUERY_LEN and seq_len > query_len)


def prepare(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
            query_lens: list[int], seqs: list[int], every_row: bool) -> NativeRuns:
    counts = [query_lens[i] for i in seqs]
    q_start = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    q_start[1:] = torch.tensor(counts, dtype=torch.int32).cumsum(0)
    if every_row:
        return NativeRuns(None, block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
                          q_start)
    idx = torch.tensor(seqs, dtype=torch.long)
    starts = query_start_loc[idx].long()
    if all(c == 1 for c in counts):
        rows = starts
    else:
        rows = torch.repeat_interleave(starts - q_start[:-1].long(), torch.tensor(counts)) + \
            torch.arange(int(q_start[-1]))
    return NativeRuns(rows, block_tables[idx].to(torch.int32).contiguous(), seq_lens[idx].to(torch.int32).contiguous(),
                      q_start)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> bool:
    """Key and value rows [T, Hkv, D] into the fp32 or bf16 cache's `slots` in one native call
    (kv_write.cpp: the conversions and index_copy_ of torch's four ops, the same bytes); False where it
    does not take them (another dtype, fp32 rows whose heads are not side by side, no library)."""
    lib = native.library_for(k_cache)
    code = KV_DTYPE_CODES.get(k_cache.dtype)
    if lib is None or code not in (0, 1) or v_cache.dtype != k_cache.dtype or slots.dtype != torch.int64 or \
            not slots.is_contiguous() or not all(_rows_of_heads(t, k_cache) for t in (key, value)):
        return False
    n = key.shape[1] * key.shape[2]
    return lib.psq_kv_write(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), key.shape[0], n,
                            slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), code, native.cpu_isa()) == 0


def _rows_of_heads(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """x fp32 [T, Hkv, D] matching the cache's heads, each row's entries contiguous."""
    return x.dtype == torch.float32 and x.dim() == 3 and tuple(x.shape[1:]) == tuple(cache.shape[-2:]) and \
        x.stride(2) == 1 and x.stride(1) == x.shape[2] and cache.is_contiguous()


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, nr: NativeRuns,
           scale: float, window: int | None = None, softcap: float | None = None,
           sink: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output [rows, Hq, D] (in query's dtype) of the kernel's rows, from the cache as it is
    stored; `window` limits each to its last keys, `softcap` caps the scores (the kernel's header says how),
    `sink` [2, Hkv, D] is added to position 0's key and value (TorchAttentionBackend.forward)."""
    q = query if nr.rows is None else query[nr.rows]
    q32 = q.float().contiguous()
    rows, hq, d = q32.shape
    out = torch.empty_like(q32)
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    rc = native.library().psq_paged_attention(
        q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), KV_DTYPE_CODES[k_cache.dtype], nr.tables.data_ptr(),
        nr.tables.shape[1], nr.lens.data_ptr(), nr.q_start.data_ptr(), nr.lens.shape[0], hq, hkv, d, bs, scale,
        out.data_ptr(), window or 0, softcap or 0.0, None if sink is None else sink.data_ptr(), native.attention_isa())
    if rc != 0:
        raise ValueError(f"the native attention kernel cannot take {hq} query heads over {hkv} kv heads")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
