#!/usr/bin/env bash
# gpuloom serve on a GPU as a new user starts it: the example repository (no shipped profiles, so
# each model is profiled at load and cached), load on each model, the repository index, SIGTERM;
# then the same again, the profiles now from the cache. Everything under $OUT/serve_smoke/.
#   OUT=out bash scripts/gpu_serve_smoke.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. CUDA_DEVICE_MAX_CONNECTIONS=32
D=${OUT:-out}/serve_smoke; mkdir -p "$D"
for round in 1 2; do
  echo "=== round $round $(date +%T)"
  t0=$(date +%s%N)
  python3 -m gpuloom.cli serve examples/repository --http-port 8123 --no-grpc --profile-cache "$D/cache" \
    > "$D/serve_$round.out" 2> "$D/serve_$round.err" &
  pid=$!
  for _ in $(seq 1 240); do grep -q "gpuloom serving" "$D/serve_$round.err" && break; sleep 0.5; done
  echo "started in $(( ($(date +%s%N) - t0) / 1000000 )) ms"; grep -E "warning|error|serving|profiled|earlier load" "$D/serve_$round.err" | cut -c1-240
  for m in tiny_mlp tiny_cnn mobilenet_v3_small; do
    echo "load $m from $(date +%T.%3N)"
    python3 -m gpuloom.cli load 127.0.0.1:8123 --model "$m" --rate 100 --duration 4 --json > "$D/load_${round}_$m.json" 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: d.get(k) for k in ('sent','ok','slo_attainment','p50_ms','p99_ms','errors')})" "$D/load_${round}_$m.json" "$m" 2>&1 | cut -c1-300
  done
  curl -s -X POST 127.0.0.1:8123/v2/repository/index > "$D/index_$round.json"; cat "$D/index_$round.json"; echo
  kill -TERM $pid; wait $pid; echo "serve exit $?"
  grep -E "layout|re-plan|WARNING|ERROR" "$D/serve_$round.err" | cut -c1-240  # what served where, and when
done
ls -R "$D/cache" | tail -5
# which graphs each cached profile timed: a model gpuloom's kernels change says engine:fuse_epilogues=true
python3 -c "import json,pathlib,sys; [print(f.name, json.loads(f.read_text()).get('runner')) for f in sorted(pathlib.Path(sys.argv[1]).rglob('*.json'))]" "$D/cache"
# the second start must take every profile from the cache: one file per model, none measured again
# (run 156: a model with gpuloom's kernels was measured again under a new fingerprint every start)
n=$(find "$D/cache" -name '*.json' | wc -l); again=$(grep -c "profiled in" "$D/serve_2.err")
echo "profile cache: $n file(s) for 3 models; profiled again at the second start: $again" \
  "($([ "$n" = 3 ] && [ "$again" = 0 ] && echo ok || echo NOT ok))"
