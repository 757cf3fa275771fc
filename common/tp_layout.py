"""Which part of a model each tensor-parallel rank holds: its attention heads, its slice of the MLP and
of the vocabulary. Pure arithmetic on the model's shape, shared by the start-up check (pagedserve/) and
the layers that load and run their shard (gpu_worker/), so the two can never disagree.

Heads are split by GQA group: a rank takes whole groups (a KV head with the query heads that read it),
so every rank keeps the model's query-per-KV ratio and the attention kernels stay unchanged. Groups that
do not divide evenly are spread as evenly as they go (SmolLM2-135M's 3 groups over 2 ranks: 2 + 1).
With fewer KV heads than ranks, each KV head is replicated on the ranks that share its group, which
needs the ranks to be a multiple of the KV heads and to divide the query heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANT_ALIGN = 32       # a shard boundary inside a row falls on a GGUF / group-quantization block


@dataclass(frozen=True)
class HeadShard:
    """Rank r's query heads [q_start, q_start + num_heads) and KV heads [kv_start, kv_start + num_kv_heads)."""
    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def even_split(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """[lo, hi) ranges that cover 0..n in `parts` pieces of multiples of `align` (the last takes the rest),
    as even as the alignment allows."""
    units = -(-n // align)
    cuts = [min(n, (units * i // parts) * align) for i in range(parts + 1)]
    cuts[-1] = n
    return list(zip(cuts[:-1], cuts[1:]))


def head_shard(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    if size == 1:
        return HeadShard(0, num_heads, 0, num_kv_heads)
    per_group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        lo, hi = even_split(num_kv_heads, size)[rank]
        return HeadShard(lo * per_group, (hi - lo) * per_group, lo, hi - lo)
    per_rank = num_heads // size
    return HeadShard(rank * per_rank, per_rank, rank * num_kv_heads // size, 1)


def vocab_rows(vocab_size: int, size: int, rank: int) -> tuple[int, int]:
    """Rank r's rows of the embedding and lm_head: equal slices of ceil(V / N) rows, so the logits
    gather has equal parts; the last slice's rows past V are padding (zero weights, logits dropped)."""
    per = -(-vocab_size // size)
    return rank * per, (rank + 1) * per


def check_tensor_parallel(arch: str, num_heads: int, num_kv_heads: int, size: int, *, lora: bool = False,
                          draft_model: bool = False, prequantized: str | None = None) -> None:
    """What a tensor-parallel size cannot split or does not support yet, as one clear error (ValueError)."""
    if size == 1:
        return
    flag = f"--tensor-parallel-size {size}"
    if size > num_heads:
        raise ValueError(f"{flag} exceeds the model's {num_heads} attention heads")
    if num_kv_heads < size and (size % num_kv_heads or num_heads % size):
        raise ValueError(f"{flag} cannot split {num_heads} query heads over {num_kv_heads} KV heads: with fewer "
                         f"KV heads than ranks, the ranks must be a multiple of the KV heads and divide the "
                         f"query heads")
    unsupported = [why for cond, why in [
        (arch in TP_UNSUPPORTED_ARCHS, f"{arch} models (the experts are not sharded)"),
        (lora, "--enable-lora (the adapters' slots are not sharded)"),
        (draft_model, "a draft model for speculative decoding (use the ngram method)"),
        (prequantized is not None, f"{prequantized} checkpoints (their packed groups are not sharded; GGUF "
                                   f"files and --quantization int8/fp8 are)"),
    ] if cond]
    if unsupported:
        raise ValueError(f"tensor parallelism does not support {unsupported[0]} yet; run with "
                         f"--tensor-parallel-size 1")


TP_UNSUPPORTED_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def check_config(config: Any, mc: Any, quantization_config: dict | None) -> None:
    """check_tensor_parallel for an engine configuration (EngineConfig, or parsed flags with its fields)
    and its model: the CLI, the offline API and each worker ask the same question this way."""
    from common.speculative import SpeculativeConfig
    spec = SpeculativeConfig.parse(config.speculative_config)
    check_tensor_parallel(mc.arch, mc.num_heads, mc.num_kv_heads, config.tensor_parallel_size,
                          lora=config.enable_lora, draft_model=spec is not None and spec.method == "draft_model",
                          prequantized=quantization_config.get("quant_method", "quantized")
                          if quantization_config else None)
