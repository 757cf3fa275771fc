#!/usr/bin/env bash
# The one prepared device call: GPU tests, then the GPU benchmark. Prepare once on the CPU machine with
# scripts/prepare_gpu_carry.sh, then run through the device tool:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu"], timeout_s=590)
# Results land in $OUT (gpu_tests.log, gpu_bench.log, gpu_bench.json).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/tmp/pscache PAGEDSERVE_TEST_TOKENIZER=$PWD/.gpu/tokenizer
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
# test_triton_attention.py, _qgemm.py, _lora.py and _fp8_round.py are unit-tier (interpreted on CPU); here they run compiled.
timeout 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or unit" tests/test_gpu.py tests/test_triton_attention.py tests/test_triton_qgemm.py tests/test_triton_lora.py tests/test_triton_fp8_round.py \
    tests/test_awq_gptq_fp8.py \
    -o addopts="" 2>&1 | tee "$OUT/gpu_tests.log"
timeout 300 python3 -m loadtest.gpu_bench --tokenizer .gpu/tokenizer --workload .gpu/workload.jsonl \
    --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log"
