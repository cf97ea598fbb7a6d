#!/usr/bin/env bash
# One device call (session 34): the fusion GPU tests, then cl_auto vs cl_auto_fused on the given models.
# Usage: OUT=dir MODELS=a,b DTYPES=float32 TAG=run102 [TESTS=0] [TEST_FILTER=...] [VARIANTS=...] bash scripts/gpu_engine_fused.sh
# (every setting is read from the environment)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. CUDA_DEVICE_MAX_CONNECTIONS=32
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 150 tests/test_engine_gpu.py \
    -k "${TEST_FILTER:-fus or default_compile}" 2>&1 | tail -25 | tee "$OUT/engine_gpu_tests.txt"
fi
timeout "${BENCH_TIMEOUT:-380}" python3 scripts/bench_engine.py --dtypes "${DTYPES:-float32}" --batches 1,8 \
  --variants "${VARIANTS:-eager,gpuloom,gpuloom_cl_auto,gpuloom_cl_auto_fused}" --no-lower-bound \
  --model-timeout "${MODEL_TIMEOUT:-150}" --models "$MODELS" --out "$OUT/${TAG:-run}_fused.json" 2>&1 \
  | grep -v -e Warning -e "cls.__new__" | tee "$OUT/${TAG:-run}_fused.log" | tail -40
