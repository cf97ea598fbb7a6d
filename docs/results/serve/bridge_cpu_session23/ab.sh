#!/bin/bash
# usage: ab.sh TAG REPS -- args...   alternates baseline (BASE, a checkout of the commit before) and
# candidate (NEW), one diag_bridge_cost.py run each, JSON to OUT; then prints medians (min, max).
TAG=$1; REPS=$2; shift 3
BASE=${BASE:-/tmp/base}; NEW=${NEW:-/work/main}; OUT=${OUT:-$NEW/docs/results/serve/bridge_cpu_session23}
P=${P:-/work/main/.venv/bin/python}
for i in $(seq 1 $REPS); do
  (cd $BASE && $P scripts/diag_bridge_cost.py --repeat 1 "$@" --out $OUT/${TAG}_base_$i.json >/dev/null)
  (cd $NEW && $P scripts/diag_bridge_cost.py --repeat 1 "$@" --out $OUT/${TAG}_new_$i.json >/dev/null)
done
$P - "$TAG" "$REPS" "$OUT" <<'PY'
import json, statistics, sys
tag, reps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for side in ("base", "new"):
    runs = [json.load(open(f"{out}/{tag}_{side}_{i}.json"))["runs"][0] for i in range(1, reps + 1)]
    print(tag, side, {k: (round(statistics.median(r[k] for r in runs), 2), round(min(r[k] for r in runs), 2),
                          round(max(r[k] for r in runs), 2))
                      for k in runs[0] if isinstance(runs[0][k], (int, float))})
PY
