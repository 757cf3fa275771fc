"""Builds and loads the C++ CPU kernels (qgemm.cpp: quantized matmuls; qgemm_panel.cpp: the same for
many rows on AVX2; qgemm_amx.cpp: the same on AMX tiles; paged_attention.cpp: attention on the paged KV
cache; fp8_round.cpp: keys into an fp8 cache; and a decoder layer's glue, each one pass instead of several
torch ops: rms_norm.cpp (with the residual add before it), rope.cpp, silu_mul.cpp, kv_write.cpp;
decoder_stack.cpp: a plain model's layers calling them in one call a step) and says which instruction set
they may use.

The library is plain C ABI loaded with ctypes, so it needs no torch headers and builds in seconds with
the system g++ during scripts/setup.sh (`python -m gpu_worker.kernels.native`). It links OpenMP by
soname, which resolves to the libgomp torch has already loaded, so both share one thread pool and
torch.set_num_threads governs the kernels too. When the library is missing or fails to load, callers
fall back to pure torch (`available()` is False) and one warning says so.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCES = tuple(HERE / f for f in ("qgemm.cpp", "qgemm_panel.cpp", "qgemm_i16.cpp", "qgemm_panel_i16.cpp",
                                   "qgemm_amx.cpp", "paged_attention.cpp", "rms_norm.cpp", "fp8_round.cpp",
                                   "rope.cpp", "silu_mul.cpp", "kv_write.cpp", "decoder_stack.cpp"))
HEADERS = (HERE / "fp8.h", HERE / "qweights.h", HERE / "amx.h", HERE / "vec8.h", HERE / "kv_prefetch.h",
           HERE / "quantize_i16.h")
LIBRARY = HERE / "_build" / "libpsq.so"
ABI_VERSION = 17
ISA_LEVELS = {"portable": 0, "avx2": 1, "avx512": 2}     # the levels every kernel has
AMX = 3    # above avx512, the attention kernel's own: AMX-BF16 tiles for bf16 caches (attention_isa)
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-Wno-psabi"]


def build(force: bool = False) -> Path:
    """Compile the library if it is missing or older than its source; returns its path."""
    if not force and not _stale():
        return LIBRARY
    LIBRARY.parent.mkdir(exist_ok=True)
    tmp = LIBRARY.with_suffix(f".{os.getpid()}.tmp")
    compile_library(SOURCES, tmp)
    tmp.replace(LIBRARY)     # atomic: a concurrently starting worker never loads half a file
    return LIBRARY


def compile_library(sources: Sequence[Path], out: Path) -> None:
    """Compile `sources` into the shared library `out` as the project's library is built (the A/B tools in
    loadtest/ build other trees' kernels with it)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) found")
    subprocess.run([cxx, *_FLAGS, *map(str, sources), "-o", str(out)], check=True)


def _stale() -> bool:
    return not LIBRARY.is_file() or LIBRARY.stat().st_mtime < max(s.stat().st_mtime for s in SOURCES + HEADERS)


_isa: int | None = None
_attention_isa: int | None = None


def cpu_isa() -> int:
    """The best level this CPU runs, from torch's own run-time detection, capped by PAGEDSERVE_CPU_ISA
    (portable | avx2 | avx512) so tests can exercise every path on one machine. Read once: every kernel
    call asks (~150 a decode step), and the environment lookup cost more than some of the kernels;
    `reread_isa_cap()` after changing the variable."""
    global _isa
    if _isa is None:
        _isa = _isa_level(os.environ.get("PAGEDSERVE_CPU_ISA", ""))
    return _isa


def attention_isa() -> int:
    """The attention kernel's level: AMX where the CPU has AMX-BF16, the OS grants this process the tiles
    and PAGEDSERVE_CPU_ISA is unset or `amx`; otherwise cpu_isa(). Read once, like cpu_isa()."""
    global _attention_isa
    if _attention_isa is None:
        forced = os.environ.get("PAGEDSERVE_CPU_ISA", "").strip().lower()
        _attention_isa = AMX if cpu_isa() == ISA_LEVELS["avx512"] and forced in ("", "amx") and amx_ready() \
            else cpu_isa()
    return _attention_isa


def uses_amx() -> bool:
    """Whether the kernels that have an AMX-BF16 form (attention on a bf16 cache, the packed matmul in
    --dtype auto) use it here: attention_isa() is AMX."""
    return attention_isa() == AMX


def reread_isa_cap() -> None:
    global _isa, _attention_isa
    _isa = _attention_isa = None


@lru_cache(maxsize=8)
def _isa_level(forced: str) -> int:
    cap = torch.backends.cpu.get_cpu_capability().upper()
    best = 2 if cap.startswith("AVX512") else 1 if cap.startswith("AVX2") else 0
    forced = forced.strip().lower()
    if forced:
        if forced not in ISA_LEVELS and forced != "amx":
            raise ValueError(f"PAGEDSERVE_CPU_ISA={forced!r}; expected one of {', '.join(ISA_LEVELS)}, amx")
        best = min(best, ISA_LEVELS.get(forced, best))
    return best


@lru_cache(maxsize=1)
def amx_ready() -> bool:
    """Whether this CPU has AMX-BF16 tiles and this process may use them (the library asks the OS)."""
    lib = library()
    return bool(lib is not None and lib.psq_amx_ready())


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (with one warning) when they cannot be had."""
    try:
        if _stale():
            build()
        lib = ctypes.CDLL(str(LIBRARY))
        if lib.psq_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{LIBRARY} has ABI {lib.psq_abi_version()}, expected {ABI_VERSION}")
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        log.warning("native CPU kernels unavailable (%s); quantized matmuls use the slower torch path", e)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.psq_gemm.argtypes = [p, i, i, p, p, p, i, i, i, p, p, i]
    lib.psq_gemm.restype = None
    lib.psq_gemm_panel.argtypes = [p, i, i, p, p, p, i, i, i, p, p]
    lib.psq_gemm_panel.restype = None
    lib.psq_gemm_i16.argtypes = [p, i, i, p, p, p, i, i, i, p, p]
    lib.psq_gemm_i16.restype = i
    lib.psq_gemm_panel_i16.argtypes = [p, i, i, p, p, p, i, i, i, p, p]
    lib.psq_gemm_panel_i16.restype = i
    lib.psq_dequantize.argtypes = [p, p, p, i, i, i, i, p, i]
    lib.psq_dequantize.restype = None
    lib.psq_gemm_amx.argtypes = [p, i, i, p, p, p, i, i, i, p, p, p]
    lib.psq_gemm_amx.restype = i
    lib.psq_expand_amx.argtypes = [p, p, p, i, i, i, i, p]
    lib.psq_expand_amx.restype = i
    f = ctypes.c_float
    lib.psq_paged_attention.argtypes = [p, p, p, i, p, i, p, p, i, i, i, i, i, f, p, i, f, p, i]
    lib.psq_paged_attention.restype = i
    lib.psq_rms_norm.argtypes = [p, i, i, p, f, p, i, i]
    lib.psq_rms_norm.restype = None
    lib.psq_add_rms_norm.argtypes = [p, p, i, i, i, p, f, p, p, i, i]
    lib.psq_add_rms_norm.restype = None
    ll = ctypes.c_int64
    lib.psq_rope.argtypes = [p, ll, i, p, ll, i, i, i, p, p, i, i]
    lib.psq_rope.restype = i
    lib.psq_silu_mul.argtypes = [p, i, i, ll, p, i, i]
    lib.psq_silu_mul.restype = None
    lib.psq_kv_write.argtypes = [p, ll, p, ll, i, i, p, p, p, i, i]
    lib.psq_kv_write.restype = i
    lib.psq_fp8_round_feedback.argtypes = [p, p, p, i, i, i, f, i, i]
    lib.psq_fp8_round_feedback.restype = i
    lib.psq_stack_scratch.argtypes = [i, i, i, i, i, i]
    lib.psq_stack_scratch.restype = ll
    lib.psq_decoder_stack.argtypes = [p, p, i]
    lib.psq_decoder_stack.restype = i
    lib.psq_amx_ready.argtypes = []
    lib.psq_amx_ready.restype = i
    lib.psq_attention_chunk.argtypes = []
    lib.psq_attention_chunk.restype = i
    return lib


def available() -> bool:
    return library() is not None


def library_for(t) -> ctypes.CDLL | None:
    """The kernels for work on tensor `t`: None unless it lives on the CPU (they read host memory)."""
    return library() if t.device.type == "cpu" else None


if __name__ == "__main__":
    path = build(force="--force" in sys.argv)
    print(f"native kernels ready: {path} (cpu isa level {cpu_isa()}, attention {attention_isa()})")
