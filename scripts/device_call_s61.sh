#!/usr/bin/env bash
# Sixty-first session's first device call: what the GPU it lands on is for (see reports/runtime.md's
# next calls). An H200: issue 6's own measurement (mix6 over HTTP at x0.75 and x1) and the batch-1
# dispatch overhead. Any other GPU: the overload's nexus with GPULOOM_YIELD_ANSWERS 0 then 1, after a
# fake-device host probe of the loop's CPU per request. (Sized for about 250 s: what was left of the
# session's device time after its failed starts.)
export PYTHONPATH=. CUDA_DEVICE_MAX_CONNECTIONS=32 HOST_MAX_LOOP_US=3500
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu"
if [[ "$gpu" == *H200* ]]; then
  STEPS="serve overhead" T_SERVE=160 OVERHEAD_POINTS=full T_OVERHEAD=110 \
  SERVE_CMD="python3 scripts/serve_e2e.py examples/mix6.yaml --duration 5 --loop-cpu --scale 0.75,1 --http-workers 8 --out \$OUT/serve/e2e_h200_0.json" \
    bash scripts/gpu_runtime_session.sh
else
  STEPS="diag bench" T_DIAG=40 T_BENCH=110 BENCH=examples/overload.yaml \
  DIAG_CMD="python3 scripts/diag_overload_fake.py --policy nexus --legs 1,1 --leg-env GPULOOM_YIELD_ANSWERS --duration 3 --out \$OUT/diag/fake_probe.json" \
  BENCH_ARGS="--policy nexus --scale 1 --duration 5 --warmup 3 --max-batch 16 --contention h100-fast-host" \
  BENCH_ENVS="GPULOOM_YIELD_ANSWERS=0 GPULOOM_YIELD_ANSWERS=1" \
    bash scripts/gpu_runtime_session.sh
fi
