#!/usr/bin/env bash
# A server's start (ServeCore.load_all on the example repository) with the graph cache cold (an empty
# directory) or warm (filled by an earlier start), A B B A in separate processes, after one start
# that fills the profile cache and the warm graph cache. JSON lines in $OUT/start_graph_cache_ab.jsonl.
#   OUT=out bash scripts/gpu_start_graph_cache_ab.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. CUDA_DEVICE_MAX_CONNECTIONS=32
D=${OUT:-out}; mkdir -p "$D"; P=$(mktemp -d); W=$(mktemp -d)
GPULOOM_GRAPH_CACHE=$W python3 scripts/diag_start_time.py --variant all --profile-cache "$P" > "$D/start_fill.json"
for v in cold warm warm cold; do
  if [ "$v" = cold ]; then G=$(mktemp -d); else G=$W; fi
  GPULOOM_GRAPH_CACHE=$G python3 scripts/diag_start_time.py --variant all --profile-cache "$P" \
    | sed "s/^{/{\"graph_cache\": \"$v\", /" | tee -a "$D/start_graph_cache_ab.jsonl"
done
