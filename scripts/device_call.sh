#!/usr/bin/env bash
# One of a session's device calls, its work picked by the GPU it lands on (sessions 57-65: most
# `nvidia-h200` calls ran on H100s, or none started). See docs/reports/runtime.md's next-call list for the predictions.
#   OUT=$OUT bash scripts/device_call.sh 1     (then 2, then 3 while the machine is warm)
#   OUT=$OUT bash scripts/device_call.sh http_clients     (or any work below by its name)
# H200: 1 = h200_http: issue 6's mix6 over HTTP (x0.75, x1) and the batch-1 overhead (with
#       H200_STEPS="serve overhead diag", branch overlap by width too); 2 = h200_edge: mix6's edge
#       (dstack, dstack without the batch hold, triton; six loads); 3 = branch overlap by width.
# Other GPUs: 1 = http_ab (mix6 x1 over HTTP, the return allowance x the early answer) where the
#       Python loop probe reads <= 3 ms (runs 210-213 on slower hosts settled nothing), else the
#       overload; 2 = h200_edge's work (mix6's edge with the yield default); 3 = overload: the
#       overload's nexus and gslice after the fake-device host probe (more held-out points for the
#       per-drop time read off the loop's CPU). http_clients (run 209), yield_http and mix6_yield
#       (runs 205-206) stay callable by name. The overload's bench needs a probe <= 5 ms (run 214).
#       intake_window (by name): mix6 x1 over HTTP, the loop's intake window 0 / 1 ms x the GIL switch interval off / 1 ms, 3 rounds.
set -uo pipefail
export PYTHONPATH=. CUDA_DEVICE_MAX_CONNECTIONS=32
call=${1:?usage: device_call.sh 1|2|3|WORK (h200_http, h200_edge, branch_width, http_clients, overload, yield_http, mix6_yield, http_ab, intake_window)}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu, call $call"
run() { bash scripts/gpu_runtime_session.sh; }
yield_http() {
  STEPS=serve T_SERVE=${1:-480} HOST_MAX_LOOP_US=3500 \
  SERVE_CMD="for y in 0 1 0 1; do GPULOOM_YIELD_ANSWERS=\$y python3 scripts/serve_e2e.py examples/mix6.yaml --duration 5 --loop-cpu --scale 1 --http-workers 8 --out \$OUT/serve/y\${y}_\$(date +%s).json; done" run
}
probe=$(python3 -c "from gpuloom.bench.machine import python_loop_us; print(round(python_loop_us(9)))")
echo "python loop probe $probe us"
work=$call
case "$gpu:$call" in
  *H200*:1) work=h200_http ;; *H200*:2) work=h200_edge ;; *H200*:3) work=branch_width ;;
  *:1) if [ "$probe" -le 3000 ]; then work=http_ab; else work=overload; fi ;;  # http_ab says something on fast hosts only
  *:2) work=h200_edge ;; *:3) work=overload ;;
esac
echo "work: $work"
case "$work" in
  h200_http) STEPS=${H200_STEPS:-"serve overhead"} T_SERVE=170 OVERHEAD_POINTS=full T_OVERHEAD=130 T_DIAG=120 HOST_MAX_LOOP_US=3500 \
      SERVE_CMD="python3 scripts/serve_e2e.py examples/mix6.yaml --duration 5 --loop-cpu --scale 0.75,1 --http-workers 8 --out \$OUT/serve/e2e_h200.json" \
      DIAG_CMD="for w in 128 512 2048; do python3 scripts/diag_branch_overlap.py --branches 1,2,4,8 --rounds 2 --width \$w --reduce stack --out \$OUT/diag/w\$w.json; done" run ;;
  h200_edge) STEPS=bench BENCH=examples/mix6.yaml T_BENCH=540 HOST_MAX_LOOP_US=3500 \
      BENCH_ARGS="--policy dstack,dstack:batch_overhead_ms=0,triton --scale 0.8125,0.875,1,1.0625,1.125,1.1875 --duration 6 --warmup 4 --max-batch 16 --share-device" run ;;
  overload) STEPS="diag bench" T_DIAG=40 T_BENCH=160 BENCH=examples/overload.yaml HOST_MAX_LOOP_US=5000 \
      DIAG_CMD="python3 scripts/diag_overload_fake.py --policy nexus --legs 1,1 --leg-env GPULOOM_YIELD_ANSWERS --duration 3 --out \$OUT/diag/fake_probe.json" \
      BENCH_ARGS="--policy nexus,gslice --scale 1 --duration 5 --warmup 3 --max-batch 16 --contention h100-fast-host" run ;;
  yield_http) yield_http 540 ;;
  branch_width) STEPS=diag T_DIAG=120 \
      DIAG_CMD="for w in 128 512 2048; do python3 scripts/diag_branch_overlap.py --branches 1,2,4,8 --rounds 2 --width \$w --reduce stack --out \$OUT/diag/w\$w.json; done" run ;;
  http_clients) STEPS=serve T_SERVE=480 HOST_MAX_LOOP_US=6000 \
      SERVE_CMD="for c in 3 6 3 6; do python3 scripts/serve_e2e.py examples/mix6.yaml --duration 5 --loop-cpu --scale 1 --http-workers 8 --clients \$c --out \$OUT/serve/c\${c}_\$(date +%s).json; done" run ;;
  http_ab) STEPS=serve T_SERVE=570 HOST_MAX_LOOP_US=6000 \
      SERVE_CMD="python3 scripts/serve_e2e.py examples/mix6.yaml --duration 5 --loop-cpu --scale 1 --http-workers 8 --return-allowance off,auto --early-answer off,on --rounds 3 --out \$OUT/serve/http_ab.json" run ;;
  intake_window) STEPS=serve T_SERVE=570 HOST_MAX_LOOP_US=6500 \
      SERVE_CMD="python3 scripts/serve_e2e.py examples/mix6.yaml --duration 5 --loop-cpu --scale 1 --http-workers 8 --intake-window-ms 0,1 --switch-interval-ms off,1 --rounds 3 --out \$OUT/serve/intake_window.json" run ;;
  mix6_yield) STEPS=bench BENCH=examples/mix6.yaml T_BENCH=200 HOST_MAX_LOOP_US=3500 \
      BENCH_ARGS="--policy dstack,triton --scale 1,1.0625 --duration 6 --warmup 4 --max-batch 16 --share-device" \
      BENCH_ENVS="GPULOOM_YIELD_ANSWERS=0 GPULOOM_YIELD_ANSWERS=1" run ;;
  *) echo "unknown call or work: $call" ;;
esac
