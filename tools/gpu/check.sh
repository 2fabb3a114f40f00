#!/usr/bin/env bash
# tools/gpu/check.sh — what of the GPU scripts can be checked without a GPU (tools/test.sh's cuda
# stage runs it after tools/cuda-build.sh, which installs the pinned nvcc wheels it uses):
#   1. tools/gpu/*.cu compile and link for sm_90 with warnings as errors (nvcc 13.2 from the wheels);
#   2. the timeline logic's unit tests (tools/gpu/test_timeline.py, standard library only);
#   3. with GPU_CHECK_PYTHON=PATH (a python with PyTorch, e.g. target/gpu-venv/bin/python; never
#      installed by this script): the slack step of run-all.sh rehearsed on the CPU,
#      slack-profile.py --device cpu --tiny → CSV → `tutti-profile import` → `check`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
WHEELS="$ROOT/.tools/cuda-wheels-13.2.86/nvidia/cu13"
OUT="$ROOT/target/gpu-check"
mkdir -p "$OUT"

[[ -x "$WHEELS/bin/nvcc" ]] || { echo "gpu-check: no nvcc at $WHEELS/bin (run tools/cuda-build.sh first)" >&2; exit 1; }
for program in green-contexts h2d-bandwidth; do
  "$WHEELS/bin/nvcc" -std=c++17 -O2 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror -I "$WHEELS/include" \
    -arch=sm_90 -o "$OUT/$program" "tools/gpu/$program.cu" -ldl
  echo "gpu-check: tools/gpu/$program.cu compiled for sm_90, warnings as errors"
done

python3 -m unittest discover -s tools/gpu -p 'test_*.py'

if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
  bin="$OUT/python-bin"
  mkdir -p "$bin"
  printf '#!/bin/sh\nexec %q "$@"\n' "$GPU_CHECK_PYTHON" >"$bin/python3"
  chmod +x "$bin/python3"
  mkdir -p target/gpu-carry
  cargo build --release --locked -p tutti-profile
  cp target/release/tutti-profile target/gpu-carry/tutti-profile
  strip target/gpu-carry/tutti-profile
  rm -rf "$OUT/rehearsal"
  PATH="$bin:$PATH" OUT="$OUT/rehearsal" RUN_ALL_SLACK_DEVICE_ARGS="--device cpu --tiny" RUN_ALL_GPU_PRESET=h100 \
    tools/gpu/run-all.sh slack
  echo "gpu-check: slack step rehearsed on the CPU: $OUT/rehearsal"
fi
echo "gpu-check: OK"
