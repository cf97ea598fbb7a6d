#!/usr/bin/env bash
# A server's start, its models loaded one at a time ("each") or with one layout ("all"), A B B A in
# separate processes after one run that fills the profile cache. JSON lines in $OUT/start_ab.jsonl.
#   OUT=out bash scripts/gpu_start_ab.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. CUDA_DEVICE_MAX_CONNECTIONS=32
D=${OUT:-out}; mkdir -p "$D"; C=$(mktemp -d)
python3 scripts/diag_start_time.py --variant all --profile-cache "$C" > "$D/start_warm.json"
for v in each all all each; do python3 scripts/diag_start_time.py --variant $v --profile-cache "$C" | tee -a "$D/start_ab.jsonl"; done
