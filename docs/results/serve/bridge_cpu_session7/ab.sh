#!/bin/bash
# usage: ab.sh TAG REPS -- args...   alternates baseline (/tmp/bb/base) and candidate (/work/wt-bridge), one run each
TAG=$1; REPS=$2; shift 3
P=/work/main/.venv/bin/python
for i in $(seq 1 $REPS); do
  (cd /tmp/bb/base && $P scripts/diag_bridge_cost.py --repeat 1 "$@" --out /tmp/bb/${TAG}_base_$i.json >/dev/null)
  (cd /work/wt-bridge && $P scripts/diag_bridge_cost.py --repeat 1 "$@" --out /tmp/bb/${TAG}_new_$i.json >/dev/null)
done
$P - "$TAG" "$REPS" <<'PY'
import json, statistics, sys
tag, reps = sys.argv[1], int(sys.argv[2])
for side in ("base", "new"):
    runs = [json.load(open(f"/tmp/bb/{tag}_{side}_{i}.json"))["runs"][0] for i in range(1, reps + 1)]
    print(tag, side, {k: (round(statistics.median(r[k] for r in runs), 2), min(r[k] for r in runs), max(r[k] for r in runs))
                      for k in runs[0] if k not in ("requests", "bridge_cpu_s_per_s")})
PY
