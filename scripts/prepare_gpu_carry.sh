#!/usr/bin/env bash
# Gathers what the GPU machine lacks into ignored folders that the device call carries: wheels of the
# packages its image does not have (.whl) and the default tokenizer plus the shared workload (.gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info && touch .git/info/exclude
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude || echo /.gpu/ >> .git/info/exclude
mkdir -p .whl .gpu
for pkg in pyzmq orjson gguf; do
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$pkg"
done
.venv/bin/python - <<'PY'
from common.model_source import ModelSource
ModelSource.resolve(None).load_tokenizer().save_pretrained(".gpu/tokenizer")
PY
cp ../shared/bench/workload.jsonl .gpu/workload.jsonl
du -sh .whl .gpu
