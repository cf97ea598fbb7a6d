#!/usr/bin/env bash
# One device call for the runtime (issue 5): GPU tests, the runtime checks, then a bench.
#   STEPS="tests check overhead bench" BENCH="examples/light3.yaml" bash scripts/gpu_runtime_session.sh
#   STEPS="bench engine serve" ENGINE_CMD="python3 scripts/bench_engine.py ... --out \$OUT/engine/x.json" \
#     SERVE_CMD="python3 scripts/serve_e2e.py ..." bash scripts/gpu_runtime_session.sh
#   STEPS="tests diag bench" TESTS="tests/test_exec_backend_gpu.py" DIAG_CMD="python3 scripts/diag_wake.py --out \$OUT/diag/w.json" ...
#   BENCH_ARGS_light3="--scale 8,9 ..." ...   (a workload's own arguments instead of BENCH_ARGS)
#   OVERHEAD_ARGS="--overhead-outputs copies,views" ...   (more arguments for the overhead check)
#   OVERHEAD_POINTS=full ...   (the overhead check's 3 s points instead of --quick's 1.5 s: run 158)
#   BENCH_PREFIX="taskset -c 0-1" ...   (runs the bench under that command: here, on two CPU cores)
#   BENCH_ENVS="- CUDA_DEVICE_MAX_CONNECTIONS=32 -" ...   (one bench process per entry, "-" = as is: an
#     A/B/A of a process-wide setting; outputs bench/<workload>_<i>.json)
#   BENCH_EXTRA="-|--engine fuse_epilogues=true|-" ...   (one bench process per "|"-separated entry of
#     more bench arguments, "-" = none: an A/B/A of gpuloom bench's options; with BENCH_ENVS, every pair)
#   HOST_MAX_LOOP_US=3500 ...   (skips the steps in HOST_GATED, default "bench serve", when the host's
#     Python loop probe -- the bench's "python loop" figure, median of 9 -- reads slower: on slower hosts
#     the in-process load generator fell behind at overload and light3 held nothing (runs 188-192), so
#     those points answered nothing; the other steps run either way)
# Every step has its own time limit and log; results land under $OUT (one tarball of the
# small files plus the JSONs), so a step that fails or runs out of time leaves the others.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. PYTHONFAULTHANDLER=1
OUT=${OUT:-out}; mkdir -p "$OUT/logs" "$OUT/diag" "$OUT/engine" "$OUT/serve"  # scripts may write straight into them
STEPS=${STEPS:-"tests check overhead"}
T_TESTS=${T_TESTS:-150} T_CHECK=${T_CHECK:-240} T_OVERHEAD=${T_OVERHEAD:-120} T_BENCH=${T_BENCH:-300}
BENCH=${BENCH:-examples/light3.yaml}
TESTS=${TESTS:-"tests/test_exec_backend_gpu.py tests/test_gpu_partition.py tests/test_engine_gpu.py"}
BENCH_ARGS=${BENCH_ARGS:-"--sweep --duration 3 --steps 4"}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/logs/gpu.txt"
python3 -c "import torch; print(torch.__version__, torch.version.cuda)" | tee -a "$OUT/logs/gpu.txt"
# the GPU's clocks, power and clock-event reasons every second of the call (summed up in gpu.txt at
# the end; the raw samples go into the tarball): was a slow machine's GPU held back? (runs 57-58)
MON=$(mktemp -d)/gpu_monitor.csv
MON_FIELDS=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$MON_FIELDS --format=csv,noheader -c 1 > /dev/null 2>&1 \
  || MON_FIELDS=${MON_FIELDS%,clocks_event_reasons.active},clocks_throttle_reasons.active
nvidia-smi --query-gpu=$MON_FIELDS --format=csv,noheader -c 1 > /dev/null 2>&1 \
  || MON_FIELDS=${MON_FIELDS%,clocks_throttle_reasons.active}
nvidia-smi --query-gpu=$MON_FIELDS --format=csv,noheader -l 1 > "$MON" 2>&1 &
MON_PID=$!
probe_us=""
if [ -n "${HOST_MAX_LOOP_US:-}" ]; then
  probe_us=$(python3 -c "from gpuloom.bench.machine import python_loop_us; print(round(python_loop_us(9)))")
  echo "python loop probe ${probe_us} us (steps ${HOST_GATED:-bench serve} need <= ${HOST_MAX_LOOP_US})" | tee -a "$OUT/logs/gpu.txt"
fi
for s in $STEPS; do
  echo "=== $s $(date +%T)"
  if [ -n "$probe_us" ] && [ "$probe_us" -gt "$HOST_MAX_LOOP_US" ] && [[ " ${HOST_GATED:-bench serve} " == *" $s "* ]]; then
    echo "skipped $s: this host's Python loop probe ${probe_us} us is over HOST_MAX_LOOP_US=${HOST_MAX_LOOP_US}" \
      | tee -a "$OUT/logs/gpu.txt"
    continue
  fi
  case $s in
    tests) # the whole log with -s (tests print their timings as they go): a step that runs out of time
           # keeps what the tests printed, which a failure summary at the end would lose (run 150)
           timeout "$T_TESTS" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 120 --durations=12 -s $TESTS \
             > "$OUT/logs/gpu_tests.txt" 2>&1; tail -25 "$OUT/logs/gpu_tests.txt" ;;
    diag) timeout "${T_DIAG:-60}" bash -c "$DIAG_CMD" > "$OUT/logs/diag.txt" 2>&1; tail -20 "$OUT/logs/diag.txt" ;;
    check) timeout "$T_CHECK" python3 scripts/gpu_runtime_check.py --out "$OUT/check" \
             --only serve,disjoint,failure,memory,loadwhile > "$OUT/logs/check.txt" 2>&1
           tail -c 3000 "$OUT/logs/check.txt" ;;
    overhead) quick=--quick; [ "${OVERHEAD_POINTS:-quick}" = full ] && quick=""
             timeout "$T_OVERHEAD" python3 scripts/gpu_runtime_check.py --out "$OUT/overhead" $quick \
             --only overhead ${OVERHEAD_ARGS:-} > "$OUT/logs/overhead.txt" 2>&1; tail -c 2000 "$OUT/logs/overhead.txt" ;;
    bench) for w in $BENCH; do n=$(basename "$w" .yaml); i=0
             own="BENCH_ARGS_$n"; args=${!own:-$BENCH_ARGS}
             IFS='|' read -ra extras <<< "${BENCH_EXTRA:--}"
             for e in ${BENCH_ENVS:--}; do  # one bench process per entry: "-" as is, or NAME=VALUE[,NAME=VALUE]
              for x in "${extras[@]}"; do  # ... and per entry of BENCH_EXTRA: "-" none, or more arguments
               tag=$n; [ -n "${BENCH_ENVS:-}${BENCH_EXTRA:-}" ] && tag="${n}_$i"
               envs=(); [ "$e" != "-" ] && IFS=, read -ra envs <<< "$e"
               more=""; [ "$x" != "-" ] && more=$x
               echo "--- bench $tag: ${e} ${x}"
               timeout "$T_BENCH" env ${envs[@]+"${envs[@]}"} ${BENCH_PREFIX:-} python3 -m gpuloom.cli bench "$w" $args $more \
                 --out "$OUT/bench/$tag.json" > "$OUT/logs/bench_$tag.txt" 2>&1; tail -25 "$OUT/logs/bench_$tag.txt"
               i=$((i + 1)); done; done; done ;;
    engine) timeout "${T_ENGINE:-240}" bash -c "$ENGINE_CMD" > "$OUT/logs/engine.txt" 2>&1; tail -30 "$OUT/logs/engine.txt" ;;
    serve) timeout "${T_SERVE:-150}" bash -c "$SERVE_CMD" > "$OUT/logs/serve.txt" 2>&1; tail -30 "$OUT/logs/serve.txt" ;;
    *) echo "unknown step $s" ;;
  esac
done
kill "$MON_PID" 2>/dev/null; wait "$MON_PID" 2>/dev/null
python3 scripts/gpu_monitor_summary.py "$MON" | tee -a "$OUT/logs/gpu.txt"
tar czf "$OUT/session.tgz" -C "$OUT" logs $(cd "$OUT" && ls -d check overhead bench engine serve diag 2>/dev/null) \
  -C "$(dirname "$MON")" gpu_monitor.csv
echo "=== done $(date +%T)"
