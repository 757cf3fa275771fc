"""Paged attention over a flattened batch.

The KV cache of one layer is a pair of tensors shaped [num_blocks, block_size, num_kv_heads, head_dim].
A step runs `num_tokens` new tokens of `num_seqs` sequences concatenated (no padding). Sequence i owns
query rows query_start_loc[i]:query_start_loc[i+1]; those tokens sit at positions
context_lens[i] .. seq_lens[i]-1 and attend causally to every cached position < their own + 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from common.config import KV_CACHE_DTYPES
from common.model_config import ModelConfig


@dataclass
class AttentionMetadata:
    """The step's layout, common to every backend; each backend's prepare() derives its own typed
    metadata from it once per step."""
    slot_mapping: torch.Tensor      # [num_tokens] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32: context + new tokens
    context_lens: torch.Tensor      # [num_seqs] int32: tokens already in the cache before this step
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32, padded with 0
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_lens_list: list[int]
    seq_lens_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


M = TypeVar("M")   # a backend's own per-step metadata


class AttentionBackend(Protocol[M]):
    """One file per backend. The model calls, in every layer: write_kv(), then forward(), with the metadata
    that prepare() returned once for the step."""
    name: str

    def prepare(self, meta: AttentionMetadata) -> M:
        """Precompute per-step index tensors once so each layer's forward only does tensor work."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: M, k_scale: float = 1.0, v_scale: float = 1.0, k_feedback: torch.Tensor | None = None) -> None:
        """Scatter this step's key/value [T, Hkv, D] into the layer's cache (to_cache: an fp8 cache holds
        them divided by the layer's scales, keys rounded against `k_feedback` where given)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: M, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0, window: int | None = None, softcap: float | None = None,
                sink: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output [T, Hq, D] of the step's queries over the cache (already holding this step's
        K/V); `key`/`value` are the step's new K/V, which a backend may read directly where it helps,
        but only as the cache would give them back. `sink` [2, Hkv, D]: added to every sequence's
        position-0 key and value as read (layers/kv_rotation.py)."""


KVCaches = list[tuple[torch.Tensor, torch.Tensor]]   # per layer (key cache, value cache)

_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
assert set(_KV_DTYPES) | {"auto"} == set(KV_CACHE_DTYPES)      # the CLI's choices are these


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return model_dtype
    if name not in _KV_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; expected auto or one of {', '.join(_KV_DTYPES)}")
    return _KV_DTYPES[name]


def cache_scale(dtype: torch.dtype, scale: float) -> float:
    """The layer's k or v scale where a cache of `dtype` holds values divided by it (fp8), else 1."""
    return float(scale) if dtype in FP8_DTYPES else 1.0


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float, feedback: torch.Tensor | None = None) -> torch.Tensor:
    """K or V as a cache of `dtype` stores it: fp8 divided by the layer's scale and saturated at the
    format's largest value (a plain cast turns e4m3's overflow into NaN); rounded to nearest, or for keys
    with a `feedback` matrix [Hkv, D, D] against the queries' second moment (fp8_feedback.py)."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    if feedback is not None:
        from gpu_worker.attention.fp8_feedback import round_with_feedback
        return round_with_feedback(x, feedback, dtype, scale)
    top = torch.finfo(dtype).max
    return (x if scale == 1.0 else x / scale).clamp(-top, top).to(dtype)


def index_copy_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst.index_copy_(0, index, src) for any cache dtype (torch's CPU kernel has no fp8: move bytes)."""
    if dst.dtype in FP8_DTYPES:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(0, index, src)


def read_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """src.index_select(0, index) for any cache dtype (index_copy_rows's reverse)."""
    if src.dtype in FP8_DTYPES:
        return src.view(torch.uint8).index_select(0, index).view(src.dtype)
    return src.index_select(0, index)


def kv_block_bytes(mc: ModelConfig, block_size: int, dtype: torch.dtype, num_caches: int | None = None) -> int:
    """Bytes of one block id of this model's KV cache: keys and values of `num_caches` layers (every
    layer; with KV groups, common/kv_layout.py, the layers of one group)."""
    layers = num_caches or mc.num_layers
    return block_size * 2 * layers * mc.num_kv_heads * mc.head_dim * (torch.finfo(dtype).bits // 8)


def allocate_kv_cache(mc: ModelConfig, num_blocks: int, num_host_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, num_caches: int | None = None) -> tuple[KVCaches, KVCaches]:
    """Zeroed device caches and host caches (pinned on GPU machines, for swapping) in the layout above:
    one pair per layer, or `num_caches` pairs that the KV groups' layers share (kv_layout.py)."""
    n = num_caches or mc.num_layers
    shape = (num_blocks, block_size, mc.num_kv_heads, mc.head_dim)
    dev = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
           for _ in range(n)]
    hshape = (num_host_blocks, *shape[1:])
    pin = device.type == "cuda"
    host = [(torch.zeros(hshape, dtype=dtype, pin_memory=pin), torch.zeros(hshape, dtype=dtype, pin_memory=pin))
            for _ in range(n)] if num_host_blocks else []
    return dev, host


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from gpu_worker.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        from gpu_worker.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected auto, torch or triton")
