#!/usr/bin/env bash
# One of a session's device calls, its work picked by the GPU it lands on (sessions 57-62: most
# `nvidia-h200` calls ran on H100s). See docs/reports/runtime.md's next-call list for the predictions.
#   OUT=$OUT bash scripts/device_call.sh 1     (then 2, then 3 while the machine is warm)
# H200: 1 = issue 6's mix6 over HTTP (x0.75, x1), the batch-1 overhead and branch overlap by width;
#       2 = mix6's edge (dstack, dstack without the batch hold, triton; six loads); 3 = the yield option
#       over HTTP (0/1/0/1).
# Other GPUs: 1 = the overload's nexus and gslice after the fake-device host probe (gated on a fast host:
#       HOST_MAX_LOOP_US=3000); 2 = the yield option over HTTP (0/1/0/1, mix6 x1); 3 = mix6's dstack and
#       triton at x1 and x1.0625 with the yield option off then on (in process).
set -uo pipefail
export PYTHONPATH=. CUDA_DEVICE_MAX_CONNECTIONS=32
call=${1:?usage: device_call.sh 1|2|3}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu, call $call"
run() { bash scripts/gpu_runtime_session.sh; }
yield_http() {
  STEPS=serve T_SERVE=${1:-480} HOST_MAX_LOOP_US=3500 \
  SERVE_CMD="for y in 0 1 0 1; do GPULOOM_YIELD_ANSWERS=\$y python3 scripts/serve_e2e.py examples/mix6.yaml --duration 5 --loop-cpu --scale 1 --http-workers 8 --out \$OUT/serve/y\${y}_\$(date +%s).json; done" run
}
case "$gpu:$call" in
  *H200*:1) STEPS="serve overhead diag" T_SERVE=170 OVERHEAD_POINTS=full T_OVERHEAD=130 T_DIAG=120 HOST_MAX_LOOP_US=3500 \
      SERVE_CMD="python3 scripts/serve_e2e.py examples/mix6.yaml --duration 5 --loop-cpu --scale 0.75,1 --http-workers 8 --out \$OUT/serve/e2e_h200.json" \
      DIAG_CMD="for w in 128 512 2048; do python3 scripts/diag_branch_overlap.py --branches 1,2,4,8 --rounds 2 --width \$w --reduce stack --out \$OUT/diag/w\$w.json; done" run ;;
  *H200*:2) STEPS=bench BENCH=examples/mix6.yaml T_BENCH=540 HOST_MAX_LOOP_US=3500 \
      BENCH_ARGS="--policy dstack,dstack:batch_overhead_ms=0,triton --scale 0.8125,0.875,1,1.0625,1.125,1.1875 --duration 6 --warmup 4 --max-batch 16 --share-device" run ;;
  *H200*:3) yield_http 540 ;;
  *:1) STEPS="diag bench" T_DIAG=40 T_BENCH=160 BENCH=examples/overload.yaml HOST_MAX_LOOP_US=3000 \
      DIAG_CMD="python3 scripts/diag_overload_fake.py --policy nexus --legs 1,1 --leg-env GPULOOM_YIELD_ANSWERS --duration 3 --out \$OUT/diag/fake_probe.json" \
      BENCH_ARGS="--policy nexus,gslice --scale 1 --duration 5 --warmup 3 --max-batch 16 --contention h100-fast-host" run ;;
  *:2) yield_http 540 ;;
  *:3) STEPS=bench BENCH=examples/mix6.yaml T_BENCH=200 HOST_MAX_LOOP_US=3500 \
      BENCH_ARGS="--policy dstack,triton --scale 1,1.0625 --duration 6 --warmup 4 --max-batch 16 --share-device" \
      BENCH_ENVS="GPULOOM_YIELD_ANSWERS=0 GPULOOM_YIELD_ANSWERS=1" run ;;
  *) echo "unknown call $call" ;;
esac
