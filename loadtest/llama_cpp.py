"""llama.cpp's `llama-server` as a benchmark row: built once from the llama-cpp-python sdist on the package
index, cached outside the repository, and run on the same GGUF and workload as pagedserve.

    python -m loadtest.llama_cpp build      # about 8 minutes on 2 Xeon cores; later calls find the cache

The build uses the instruction sets this CPU reports (AVX2, AVX-512 and its VNNI / BF16 parts), never AMX:
llama.cpp's AMX path died with SIGILL on our Xeon VMs (the issue's measurement), and -march=native would
switch it on. The binary lives in $PAGEDSERVE_CACHE/llama-server/<version>-<isa>/ (default
~/.cache/pagedserve), so a machine of another CPU kind builds its own. Without a compiler, cmake or the
sdist, `binary()` is None and the benchmark prints the row as n/a.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from loadtest.http_client import http_row
from loadtest.report import LLAMA_CPP, SystemResult, short_error
from loadtest.server import ServerProcess
from loadtest.workload import BenchRequest

VERSION = "0.3.36"            # llama-cpp-python, whose sdist vendors llama.cpp's sources
ISA_FLAGS = {                 # cpuinfo flag -> ggml cmake option
    "avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
    "avx512f": "GGML_AVX512", "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
    "avx512vbmi": "GGML_AVX512_VBMI", "avx_vnni": "GGML_AVX_VNNI",
}


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cmake_options(flags: set[str]) -> list[str]:
    """ggml's instruction-set options from the CPU's flags (GGML_NATIVE off, so nothing else, AMX off)."""
    opts = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    opts += [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in ISA_FLAGS.items()]
    return opts


def isa_tag(flags: set[str]) -> str:
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "generic"


def cache_dir() -> Path:
    root = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))
    return root / "llama-server" / f"{VERSION}-{isa_tag(cpu_flags())}"


def binary() -> Path | None:
    """The cached llama-server, or None when it has not been built on this machine kind."""
    path = cache_dir() / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build(jobs: int | None = None) -> Path:
    """Download the sdist from the package index, build llama-server, cache it; returns its path."""
    if (found := binary()) is not None:
        return found
    for tool in ("cmake", "g++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-server needs {tool}")
    out = cache_dir()
    with tempfile.TemporaryDirectory(prefix="llama-cpp-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build_dir = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF", *cmake_options(cpu_flags())],
                       check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j",
                        str(jobs or os.cpu_count() or 2)], check=True)
        built = next(build_dir.rglob("llama-server"))
        out.mkdir(parents=True, exist_ok=True)
        tmp_bin = out / "llama-server.tmp"
        shutil.copy2(built, tmp_bin)
        tmp_bin.replace(out / "llama-server")
    return out / "llama-server"


class LlamaServer(ServerProcess):
    """llama-server on a GGUF: `slots` parallel sequences (-np) of `ctx_per_slot` tokens each, `threads`
    threads. A fresh server per row, so no prompt is cached from an earlier row; within a row a slot reuses
    the prefix its last prompt shares with the next (llama-server's `cache_prompt`, on by default), as
    pagedserve's prefix cache does."""
    ready_path = "/health"
    log_prefix = "llama-server-bench-"

    def __init__(self, gguf: Path, slots: int, ctx_per_slot: int, threads: int, startup_timeout: float = 300.0):
        found = binary()
        if found is None:
            raise RuntimeError("llama-server is not built on this machine: python -m loadtest.llama_cpp build")
        self.bin, self.gguf, self.slots, self.ctx, self.threads = found, gguf, slots, ctx_per_slot, threads
        super().__init__(startup_timeout)

    def command(self, port: int) -> list[str]:
        return [str(self.bin), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(self.threads), "-tb", str(self.threads), "-np", str(self.slots),
                "-c", str(self.slots * self.ctx), "--no-webui"]


def run_rows(reqs: list[BenchRequest], concurrencies: list[int], threads: int,
             warmup: BenchRequest) -> list[SystemResult]:
    """One row per concurrency on the default GGUF, each on a fresh llama-server with as many slots as
    clients, every slot long enough for the workload's longest request; n/a rows when it is not built, the
    model is missing or the server fails."""
    from common.model_source import default_gguf_path
    ctx = max(len(r.prompt_token_ids) + r.max_tokens for r in reqs + [warmup]) + 8
    rows = []
    for c in concurrencies:
        name = f"{LLAMA_CPP}-c{c}"
        server = f"llama-server {VERSION} ({isa_tag(cpu_flags())}), {threads} threads"
        try:
            with LlamaServer(default_gguf_path(), c, ctx, threads) as srv:
                rows.append(asyncio.run(http_row(name, srv.url, reqs, c, warmup, False, server, keep_alive=False)))
        except Exception as e:   # noqa: BLE001 - an unbuilt or failing server is an n/a row, not the end
            rows.append(SystemResult.failed(name, short_error(e)))
    return rows


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        raise SystemExit("usage: python -m loadtest.llama_cpp build")
    print(build())
