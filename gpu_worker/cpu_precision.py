"""`--dtype auto` on the CPU: which precision the matmuls run in, from what this CPU's hardware does fast.

On a CPU with bf16 matrix hardware (AMX-BF16 tiles, or AVX512-BF16 dot products), oneDNN runs a bf16
GEMM at 2-4x fp32's rate once a step has a few rows: SmolLM2-135M's 121 products took 85 ms in fp32 and
35 ms in bf16 at 64 rows, 577 ms and 133 ms at 512, on a 2-core Sapphire Rapids Xeon (the roofline line
of `python -m loadtest.bench` measures the ceiling in the dtype chosen here). Elsewhere (AVX2 only)
bf16 is emulated and slower than fp32, so fp32 stays.

The fast mode keeps activations, norms, rope, softmax and sampling in fp32 (elementwise bf16 on the CPU
is slower: a single-stream decode step took 15.1 ms all-bf16 against 13.1 ms in fp32; the elementwise
parts run as native one-pass kernels now, gpu_worker/kernels/native.py) and gives the
matmuls bf16 weights: plain weights are held in bf16, and packed (GGUF, AWQ, GPTQ) weights keep their
packed copy for the native kernel's small steps and gain a bf16 expansion for steps beyond it (more
memory: 2 bytes a weight): on AMX in the tile kernel's own layout (kernels/qgemm_amx.cpp), elsewhere
prepacked in oneDNN's (gpu_worker/layers/linear.py: prepack_bf16);
the KV cache's auto dtype becomes bf16. In the steps oneDNN's bf16 copies run (the tiles take fp32 in
and give fp32 out), the decoder layers' norms, the products and SwiGLU hand each other bf16 rather than
converting at each product: the same floats, a pass over the step's activations fewer (models/llama.py:
narrow_activations). `--dtype float32` turns all of it off: the exact mode that the
HF-equality tests use. Its quality against fp32 is measured by loadtest/quality.py (top-1 agreement
99.33% on the shared workload, mean KL 0.00021 nats, 2026-12-06 after the AMX tile GEMM). A token's result depends on which rows shared its steps (as on a GPU):
greedy outputs are not batch-invariant in this mode.

PAGEDSERVE_CPU_BF16=0 turns the detection off, =1 forces it on (tests run the mode on any CPU).

Without bf16 hardware, `--dtype auto` instead rounds the activations of the packed (GGUF, AWQ, GPTQ)
products of decode-sized steps (the native vector kernel's, up to packed.GEMM_MAX_ROWS rows) to int16,
per run of 32 values, and multiplies integers (kernels/qgemm_i16.cpp): on AVX2, expanding each weight
to a float was what bound those products (a single stream's decode step: 14.75 -> 9.03 ms on a 2-core
Zen3; the kernel's header says why int16 and not llama.cpp's int8). Everything else stays fp32 but the
KV cache, which is bf16 under `--dtype auto` on any CPU (kv_cache_dtype). Each row is computed alone, so
speculative verification reproduces decoding.
loadtest/quality.py measures it against fp32 ("steps of 8 rows"). PAGEDSERVE_CPU_INT16=0 turns it off,
=1 forces it on (tests run it under a bf16 CPU's auto too).
"""
from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BF16_FLAGS = ("amx_bf16", "avx512_bf16")       # /proc/cpuinfo names, best first


@lru_cache(maxsize=4)
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    try:
        text = Path(path).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def bf16_hardware(flags: frozenset[str] | None = None) -> str | None:
    """The CPU feature that makes bf16 matmuls fast here ("amx_bf16", "avx512_bf16"), or None, from
    /proc/cpuinfo's flags (or `flags`); the environment's PAGEDSERVE_CPU_BF16 overrides (0: None,
    1: "forced")."""
    forced = _forced("PAGEDSERVE_CPU_BF16")
    if forced is not None:
        return "forced" if forced else None
    flags = cpu_flags() if flags is None else flags
    return next((f for f in BF16_FLAGS if f in flags), None)


def _forced(variable: str) -> bool | None:
    """An on/off override from the environment, None where unset."""
    value = os.environ.get(variable, "").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    if value in ("1", "on", "true", "yes"):
        return True
    if value:
        raise ValueError(f"{variable}={value!r}; expected 0 or 1")
    return None


def matmul_dtype(dtype_name: str, device: torch.device) -> torch.dtype | None:
    """The dtype the matmuls of an fp32 model run in: bf16 for `--dtype auto` on a CPU with bf16
    hardware, otherwise None (the model's own dtype everywhere)."""
    if dtype_name != "auto" or device.type != "cpu":
        return None
    feature = bf16_hardware()
    if feature is None:
        log.info("cpu %s without bf16 matrix hardware: --dtype auto runs fp32", torch.backends.cpu.get_cpu_capability())
        return None
    log.info("cpu %s with %s: --dtype auto runs the matmuls in bf16, activations in fp32 (--dtype float32 for "
             "fp32 throughout)", torch.backends.cpu.get_cpu_capability(), feature)
    return torch.bfloat16


def kv_cache_dtype(dtype_name: str, device: torch.device) -> torch.dtype | None:
    """What `--kv-cache-dtype auto` means under `--dtype auto` on the CPU: bf16 whatever the matmuls run
    in, else None (the model's dtype). A decode batch's attention streams every cached key and value once a
    layer; bf16 halves those bytes, and on AVX2 the kernel widens them in registers (64 decodes over 553
    keys on a Zen3: 2.9-3.3 ms a layer call on fp32, 1.8-2.1 ms on bf16). The cache holds twice the
    tokens too. `--kv-cache-dtype float32` keeps fp32; loadtest/quality.py measures both."""
    return torch.bfloat16 if dtype_name == "auto" and device.type == "cpu" else None


def int16_activations(dtype_name: str, device: torch.device) -> bool:
    """Whether packed products of decode-sized steps take int16 activations: `--dtype auto` on a CPU
    without bf16 hardware (PAGEDSERVE_CPU_INT16 overrides); the kernel needs AVX2 (PackedWeight.kernel_for
    checks it at each step, so a lower PAGEDSERVE_CPU_ISA cap runs fp32)."""
    if dtype_name != "auto" or device.type != "cpu":
        return False
    forced = _forced("PAGEDSERVE_CPU_INT16")
    on = bf16_hardware() is None if forced is None else forced
    if on:
        log.info("--dtype auto: packed products of up to a few dozen rows round activations to int16 per 32 "
                 "values; PAGEDSERVE_CPU_INT16=0 or --dtype float32 keeps them fp32")
    return on
