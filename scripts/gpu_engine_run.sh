#!/usr/bin/env bash
# One device call for the engine: GPU tests, then the benchmark. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print(torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_engine_gpu.py -s 2>&1 | tail -25 | tee "$OUT/engine_gpu_tests.txt"
fi
timeout ${BENCH_TIMEOUT:-330} python3 scripts/bench_engine.py --out "$OUT/engine_h200.json" "$@" 2>&1 | grep -v Warning | tee "$OUT/bench.log" | tail -60
