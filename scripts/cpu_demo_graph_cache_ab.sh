#!/usr/bin/env bash
# The README's main job (`gpuloom`, the engine demo) with the graph cache off and warm, A B B A, on
# whatever machine runs it (the build VM: no GPU). Prints each run's wall time and compile column.
#   bash scripts/cpu_demo_graph_cache_ab.sh > out/demo_graph_cache_ab.txt
set -uo pipefail
G=$(mktemp -d)
GPULOOM_GRAPH_CACHE=$G gpuloom > /dev/null 2>&1  # fills the warm cache
for v in off warm warm off; do
  if [ "$v" = off ]; then C=0; else C=$G; fi
  t0=$(date +%s%N)
  out=$(GPULOOM_GRAPH_CACHE=$C gpuloom 2>&1)
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  echo "graph cache $v: ${ms} ms"
  echo "$out" | grep -E "^│" | awk -F'│' '{printf "  %s compile %s s\n", $2, $10}'
done
rm -rf "$G"
