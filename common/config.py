"""Engine configuration: the flags a user sets (the model's own facts are in common/model_config.py)."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

# auto: the checkpoint's own quantization (a GGUF's blocks, an AWQ/GPTQ/FP8 folder's quantization_config),
# else none; int8: dynamic int8 matmuls (a CPU speed mode for large steps); fp8: fp8 weights quantized at load.
QUANTIZATION_METHODS = ("auto", "none", "int8", "fp8", "gguf", "awq", "gptq")
# vLLM's kernel-specific names for the same checkpoints
QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "fp8_marlin": "fp8"}
# auto: the model's dtype; fp8 is fp8_e4m3 (vLLM's names). fp8 entries hold 2x bf16's tokens per byte.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
# --dtype: vLLM's names (half = float16, float = float32) and the short forms; auto is fp32 on the CPU,
# bf16 on CUDA
DTYPES = ("auto", "float32", "float", "fp32", "bfloat16", "bf16", "float16", "half", "fp16")
# vLLM's --prefix-caching-hash-algo names (scheduler/block_hash.py): sha256_cbor is the same chain here (no KV
# events leave the process), blake2b is keyed with a random per-process key
HASH_ALGOS = ("sha256", "sha256_cbor", "blake2b")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")    # dummy: random weights (benchmarks of shapes)


def env_flag(name: str) -> bool:
    """An on/off environment variable, read as vLLM and huggingface_hub read theirs."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_SIZE_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """An integer flag as vLLM reads one: plain ("32768"), decimal units ("32k" = 32,000, "25.6k"), or
    binary units ("32K" = 32,768; whole numbers only, as vLLM)."""
    t = str(text).strip().replace("_", "")
    unit = _SIZE_UNITS.get(t[-1:]) if t else None
    try:
        if unit is None:
            return int(t)
        number = Decimal(t[:-1])
    except (ValueError, InvalidOperation):
        raise ValueError(f"{text!r} is not an integer or a size such as 32k or 32K") from None
    value = number * unit
    if value != value.to_integral_value() or (t[-1].isupper() and number != number.to_integral_value()):
        raise ValueError(f"{text!r} is not a whole number of tokens")
    return int(value)


@dataclass
class EngineConfig:
    """Every tunable of the engine; the CLI flags map one-to-one onto these fields."""
    model: str | None = None
    tokenizer: str | None = None          # a different folder or hub id for the tokenizer (vLLM's --tokenizer)
    revision: str | None = None           # hub ids: the branch, tag or commit to take from the local cache
    download_dir: str | None = None       # hub ids: the cache folder (default: huggingface_hub's)
    generation_config: str = "auto"       # request defaults: auto (the model's), vllm (none), or a folder
    dtype: str = "auto"
    quantization: str = field(default="auto", metadata={"aliases": ("-q",)})   # QUANTIZATION_METHODS
    kv_cache_dtype: str = "auto"          # one of KV_CACHE_DTYPES
    calculate_kv_scales: bool = False     # fp8 KV: per-layer k/v scales from the first forward pass (vLLM's flag)
    kv_cache_rotation: bool = True        # fp8 KV: q, k, v rotated by a Hadamard matrix, keys centred (less rounding error)
    load_format: str = "auto"             # one of LOAD_FORMATS
    device: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    max_model_len: int | None = field(default=None, metadata={"auto": True})   # None: the model's own
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    kv_cache_memory: float = 2.0          # GiB, CPU
    gpu_memory_utilization: float = 0.9
    # overrides the memory budget (tests); vLLM's name too
    num_gpu_blocks: int | None = field(default=None, metadata={"aliases": ("--num-gpu-blocks-override",)})
    swap_space: float = 1.0               # GiB of host memory for swapped-out blocks
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"   # sha256, sha256_cbor (the same here) or blake2b (keyed per process)
    seed: int = 0
    num_threads: int | None = None
    tensor_parallel_size: int = field(default=1, metadata={"aliases": ("-tp",)})
    max_waiting_requests: int = 4096
    max_waiting_tokens: int = 1 << 22
    speculative_config: str | dict | None = None   # JSON object (CLI) or dict (LLM): see common/speculative.py
    enable_lora: bool = False
    max_loras: int = 1                    # adapters resident on the workers at once; a step never mixes more
    max_lora_rank: int = 16               # the largest rank an adapter may have (slots are sized for it)
    max_cpu_loras: int | None = None      # adapters the workers keep in host memory (default: max_loras)
    lora_modules: list[str] | None = None  # adapters served from start-up: name=path or JSON (common/lora.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
