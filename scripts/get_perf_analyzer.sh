#!/usr/bin/env bash
# Fetch Triton's perf_analyzer, the load tool issue 6 says must work against gpuloom unmodified, into
# DIR (default .perf_analyzer): DIR/perf_analyzer is a wrapper that runs it.
#
#   bash scripts/get_perf_analyzer.sh [DIR]
#   .perf_analyzer/perf_analyzer -m tiny_mlp -u localhost:8000 --concurrency-range 1:4
#
# The binary ships in tritonclient's manylinux wheel (tritonclient-*.data/data/bin/perf_analyzer; pip
# installs the pure-Python wheel without it). It links two libraries a plain machine lacks: libb64
# (Debian's libb64-0d, fetched with apt-get download: no root, nothing installed) and libcudart.so.12
# (the nvidia-cuda-runtime-cu12 wheel; loaded at start, unused against a server over the network).
# tritonclient 2.50 is the newest whose binary runs on glibc 2.36 (2.55's needs 2.38);
# PERF_ANALYZER_TRITONCLIENT picks another. Exits non-zero, saying why, if a piece cannot be fetched.
set -euo pipefail
DIR=${1:-.perf_analyzer}
VERSION=${PERF_ANALYZER_TRITONCLIENT:-2.50.0}
PY=${PYTHON:-python3}
mkdir -p "$DIR/lib" "$DIR/bin"
DIR=$(cd "$DIR" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 -d "$work" \
  "tritonclient==$VERSION" 2>/dev/null \
  || { echo "get_perf_analyzer: could not download tritonclient==$VERSION's manylinux wheel" >&2; exit 1; }
"$PY" -m zipfile -e "$work"/tritonclient-*manylinux1_x86_64.whl "$work/tc"
cp "$work"/tc/tritonclient-*.data/data/bin/perf_analyzer "$DIR/bin/perf_analyzer"
chmod +x "$DIR/bin/perf_analyzer"

"$PY" -m pip download -q --no-deps -d "$work" nvidia-cuda-runtime-cu12 2>/dev/null \
  || { echo "get_perf_analyzer: could not download nvidia-cuda-runtime-cu12 (for libcudart.so.12)" >&2; exit 1; }
"$PY" -m zipfile -e "$work"/nvidia_cuda_runtime_cu12-*.whl "$work/cudart"
cp "$work"/cudart/nvidia/cuda_runtime/lib/libcudart.so.12 "$DIR/lib/"

if ! ldconfig -p 2>/dev/null | grep -q "libb64.so.0d"; then
  (cd "$work" && apt-get download libb64-0d > /dev/null 2>&1) \
    || { echo "get_perf_analyzer: could not fetch libb64-0d (apt-get download libb64-0d)" >&2; exit 1; }
  dpkg-deb -x "$work"/libb64-0d_*.deb "$work/b64"
  cp "$work"/b64/usr/lib/x86_64-linux-gnu/libb64.so.0d "$DIR/lib/"
fi

cat > "$DIR/perf_analyzer" <<EOF
#!/bin/sh
# Triton's perf_analyzer (tritonclient $VERSION) with the libraries scripts/get_perf_analyzer.sh fetched
LD_LIBRARY_PATH="$DIR/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$DIR/bin/perf_analyzer" "\$@"
EOF
chmod +x "$DIR/perf_analyzer"
if ! "$DIR/perf_analyzer" --version > /dev/null 2>&1; then
  echo "get_perf_analyzer: $DIR/perf_analyzer does not run here:" >&2
  "$DIR/perf_analyzer" --version 2>&1 | head -3 >&2
  exit 1
fi
echo "$DIR/perf_analyzer"
