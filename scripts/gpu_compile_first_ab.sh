#!/usr/bin/env bash
# A model's first compile in a process, service-style: cuDNN autotuning against heuristics, A B B A in
# separate processes, then autotuning with CUDA_MODULE_LOADING=EAGER (every kernel loaded when its
# library loads, not at its first launch). Each process compiles mobilenet_v3_small then resnet50,
# each twice (scripts/diag_compile_phases.py). JSON lines in $OUT/compile_first_ab.jsonl.
#   OUT=out bash scripts/gpu_compile_first_ab.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. CUDA_DEVICE_MAX_CONNECTIONS=32
D=${OUT:-out}; mkdir -p "$D"
run() {  # $1: cudnn mode, $2: CUDA_MODULE_LOADING
  GPULOOM_GRAPH_CACHE=$(mktemp -d) CUDA_MODULE_LOADING=$2 python3 scripts/diag_compile_phases.py --service \
    --cudnn "$1" --models mobilenet_v3_small:64,resnet50 2>&1 | grep '^{' \
    | sed "s/^{/{\"module_loading\": \"$2\", /" | tee -a "$D/compile_first_ab.jsonl"
}
for v in autotune heuristics heuristics autotune; do run $v LAZY; done
run autotune EAGER
