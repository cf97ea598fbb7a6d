#!/usr/bin/env bash
# One device call (sessions 34, 36): GPU tests, then the fused default beside other variants on the given models.
# Usage: OUT=dir MODELS=a,b DTYPES=float32 TAG=run102 [TESTS=0] [TEST_FILES=...] [TEST_FILTER=...] [VARIANTS=...]
#        [BATCHES=1,8] [TC_BATCHES=8] [MODEL_TIMEOUT=150] [BENCH_TIMEOUT=380] [AFTER_CMD=...] bash scripts/gpu_engine_fused.sh
# (every setting is read from the environment; MODELS empty skips the bench; AFTER_CMD runs last, in bash)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. CUDA_DEVICE_MAX_CONNECTIONS=32
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  for f in ${TEST_FILES:-tests/test_engine_gpu.py}; do
    n=$(basename "$f" .py); filter=(); [ "$f" = tests/test_engine_gpu.py ] && filter=(-k "${TEST_FILTER:-fus or default_compile}")
    echo "=== $n $(date +%T)"
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 150 "$f" "${filter[@]}" 2>&1 \
      | tail -40 | tee "$OUT/${n}.txt" | tail -15
  done
fi
if [ -n "${MODELS:-}" ]; then
  echo "=== bench $(date +%T)"
  timeout "${BENCH_TIMEOUT:-380}" python3 scripts/bench_engine.py --dtypes "${DTYPES:-float32}" --batches "${BATCHES:-1,8}" \
    --torch-compile-batches "${TC_BATCHES:-1,8}" \
    --variants "${VARIANTS:-eager,gpuloom,gpuloom_cl_auto,gpuloom_cl_auto_fused}" --no-lower-bound \
    --model-timeout "${MODEL_TIMEOUT:-150}" --models "$MODELS" --out "$OUT/${TAG:-run}_fused.json" 2>&1 \
    | grep -v -e Warning -e "cls.__new__" | tee "$OUT/${TAG:-run}_fused.log" | tail -40
fi
if [ -n "${AFTER_CMD:-}" ]; then echo "=== after $(date +%T)"; timeout "${AFTER_TIMEOUT:-120}" bash -c "$AFTER_CMD" 2>&1 | tail -40; fi
