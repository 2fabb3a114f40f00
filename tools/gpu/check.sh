#!/usr/bin/env bash
# tools/gpu/check.sh — what of the GPU scripts can be checked without a GPU (tools/test.sh's cuda
# stage runs it after tools/cuda-build.sh, which installs the pinned nvcc wheels it uses):
#   1. tools/gpu/*.cu compile and link for sm_90 with warnings as errors (nvcc 13.2 from the wheels);
#   2. the GPU scripts' unit tests (tools/gpu/test_*.py, standard library only; test_timeline.py
#      runs the runbook's simulate recipe with a tutti-profile built here);
#   3. with GPU_CHECK_PYTHON=PATH (a python with PyTorch, e.g. target/gpu-venv/bin/python; never
#      installed by this script): the slack step of run-all.sh rehearsed on the CPU,
#      slack-profile.py --device cpu --tiny → CSV → `tutti-profile import` → `check`, and the
#      runbook's merge of a later session's --input-first CSV (import → check);
#   4. the python step of run-all.sh rehearsed without a GPU (the wheel, tuttid --device-memory
#      memfd, tools/gpu/python-cuda-check.py --device stand-in);
#   5. the prefill step of run-all.sh rehearsed on the CPU (tools/gpu/prefill-ttft.py --device cpu
#      --tiny: the wheel, tuttid --device-memory memfd, a tiny transformers model; ~20 s; then
#      again with --dtype bf16, the GPU run's dtype, ~15 s) with a
#      python that has torch and transformers: GPU_CHECK_PREFILL_PYTHON, else GPU_CHECK_PYTHON, else
#      the vLLM engines environment (tools/python/engine-env.sh vllm --existing: the pinned one under
#      ${TUTTI_ENV_CACHE:-~/.cache/tutti}/engines), else any vllm-* one there; skipped, saying so,
#      without one, unless GPU_CHECK_REQUIRE_PREFILL=1 (tools/test.sh sets it when its engines stage
#      ran before: that stage builds the environment), which makes a missing one a failure and
#      takes only the pythons named and the pinned environment (never another vllm-* one).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
# shellcheck source=tools/lib/process.sh
. tools/lib/process.sh
TARGET=$(realpath -m "${CARGO_TARGET_DIR:-target}") # cargo's, as cargo resolves it from here
WHEELS="$ROOT/.tools/cuda-wheels-13.2.86/nvidia/cu13"
OUT="$ROOT/target/gpu-check"
mkdir -p "$OUT"

[[ -x "$WHEELS/bin/nvcc" ]] || { echo "gpu-check: no nvcc at $WHEELS/bin (run tools/cuda-build.sh first)" >&2; exit 1; }
for program in green-contexts h2d-bandwidth; do
  "$WHEELS/bin/nvcc" -std=c++17 -O2 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror -I "$WHEELS/include" \
    -arch=sm_90 -o "$OUT/$program" "tools/gpu/$program.cu" -ldl
  echo "gpu-check: tools/gpu/$program.cu compiled for sm_90, warnings as errors"
done
# green-contexts' JSON case writer, run before any CUDA call: a case not measured (no timing) must
# still be JSON that json.load takes (glibc prints a division by zero as `inf`, which it refuses).
"$OUT/green-contexts" --json-self-test "$OUT/green-json-self-test.json"
python3 - "$OUT/green-json-self-test.json" <<'PY'
import json, math, sys
measured, unmeasured = json.load(open(sys.argv[1]))["cases"]
assert math.isfinite(measured["tflops"]) and measured["tflops"] > 0, measured
assert unmeasured["error"] and unmeasured["tflops"] is None and unmeasured["slowdown_percent"] is None, unmeasured
PY
echo "gpu-check: green-contexts' JSON of a case not measured parses"

# A tutti-profile for test_timeline.py's AfterwardsRecipe (the runbook's simulate recipe, run on a
# synthetic H200 table); without one that test only checks the recipe's text.
cargo build --locked -p tutti-profile
GPU_CHECK_TUTTI_PROFILE="$TARGET/debug/tutti-profile" python3 -m unittest discover -s tools/gpu -p 'test_*.py'

if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
  bin="$OUT/python-bin"
  mkdir -p "$bin"
  printf '#!/bin/sh\nexec %q "$@"\n' "$GPU_CHECK_PYTHON" >"$bin/python3"
  chmod +x "$bin/python3"
  # Its own tutti-profile: one copied into target/gpu-carry would sit there under the carry's
  # COMMIT and ABI, which describe another build.
  cargo build --release --locked -p tutti-profile
  rm -rf "$OUT/rehearsal"
  PATH="$bin:$PATH" OUT="$OUT/rehearsal" RUN_ALL_SLACK_DEVICE_ARGS="--device cpu --tiny" RUN_ALL_GPU_PRESET=h100 \
    RUN_ALL_TUTTI_PROFILE="$TARGET/release/tutti-profile" tools/gpu/run-all.sh slack
  echo "gpu-check: slack step rehearsed on the CPU: $OUT/rehearsal"
  # A PARTIAL grid finished by a later session's --input-first run (docs/gio-uring.md): two tiny
  # runs merged by the runbook's recipe keep both provenance blocks and import as one table.
  merge="$OUT/merge-rehearsal"
  rm -rf "$merge"
  mkdir -p "$merge"
  "$GPU_CHECK_PYTHON" tools/gpu/slack-profile.py --device cpu --tiny --input-count 1 --out-csv "$merge/slack-timeline.csv" >"$merge/log" 2>&1
  "$GPU_CHECK_PYTHON" tools/gpu/slack-profile.py --device cpu --tiny --input-first 2 --out-csv "$merge/second.csv" >>"$merge/log" 2>&1
  (cd "$merge" && grep -v '^phase,' second.csv >>slack-timeline.csv)
  [[ $(grep -c '^# grid: ' "$merge/slack-timeline.csv") -eq 2 ]] ||
    { echo "gpu-check: FAILED: the merged CSV lost a provenance block ($merge)" >&2; exit 1; }
  "$TARGET/release/tutti-profile" import --timeline "$merge/slack-timeline.csv" --model llama3-8b --gpu h100 \
    --io-sms 8 --io-sm-granularity 8 --io-sm-minimum 8 --out "$merge/table.json" 2>>"$merge/log"
  "$TARGET/release/tutti-profile" check "$merge/table.json" >>"$merge/log" 2>&1
  echo "gpu-check: a later session's --input-first rows merged with both provenance blocks, imported and checked: $merge"
fi
# The python step rehearsed without a GPU: the wheel and a tuttid built here, the stand-in for GPU
# memory (tuttid --device-memory memfd), the python stage's venv (numpy) as the interpreter.
venv=$(tools/python/wheel.sh | tail -n 1)
cargo build --locked -p tuttid --bin tuttid
rm -rf "$OUT/python-rehearsal"
OUT="$OUT/python-rehearsal" RUN_ALL_PYTHON_DEVICE=stand-in RUN_ALL_PYTHON="$venv/bin/python" \
  RUN_ALL_TUTTID="$TARGET/debug/tuttid" RUN_ALL_WHEEL="$(ls "$ROOT"/target/wheels/tutti-*-abi3-*.whl)" \
  tools/gpu/run-all.sh python
grep -q '^python: PASS' "$OUT/python-rehearsal/summary.txt"
echo "gpu-check: python step rehearsed with the stand-in: $OUT/python-rehearsal"
prefill_python=""
engine_python=""
# Bounded, and stopped by Ctrl-C (interruptible_timeout: a bare `timeout` is a process group of
# its own, which the terminal's SIGINT misses).
# An interrupt ends the command substitution with 130 (143, 129), which `&&` would take for
# "no environment": passed on as the script's status instead.
status=0
engine_env=$(interruptible_timeout 600 tools/python/engine-env.sh vllm --existing 2>/dev/null | tail -n 1) || status=$?
case $status in
  0) engine_python="$engine_env/bin/python" ;;
  129 | 130 | 143) exit "$status" ;;
esac
candidates=("${GPU_CHECK_PREFILL_PYTHON:-}" "${GPU_CHECK_PYTHON:-}" "$engine_python")
# Any vllm-* environment of the cache only when the rehearsal is optional: such a directory may be
# an older pin's, or one whose build was interrupted, which engine-env.sh's checks of the pinned
# one (--existing) would refuse; a required rehearsal must not pass on it.
[[ "${GPU_CHECK_REQUIRE_PREFILL:-0}" == 1 ]] ||
  candidates+=("${TUTTI_ENV_CACHE:-$HOME/.cache/tutti}"/engines/vllm-*/bin/python)
for candidate in "${candidates[@]}"; do
  if [[ -n "$candidate" && -x "$candidate" ]] && "$candidate" -c "import torch, transformers" 2>/dev/null; then
    prefill_python=$candidate
    break
  fi
done
if [[ -n "$prefill_python" ]]; then
  rm -rf "$OUT/prefill-rehearsal"
  OUT="$OUT/prefill-rehearsal" RUN_ALL_PREFILL_DEVICE_ARGS="--device cpu --tiny" RUN_ALL_PYTHON="$prefill_python" \
    RUN_ALL_TUTTID="$TARGET/debug/tuttid" RUN_ALL_WHEEL="$(ls "$ROOT"/target/wheels/tutti-*-abi3-*.whl)" \
    tools/gpu/run-all.sh prefill
  grep -q '^prefill: PASS' "$OUT/prefill-rehearsal/summary.txt"
  # The I/O's exposed cost is the TTFT difference, and no host-side wait is reported as the bubble.
  python3 - "$OUT/prefill-rehearsal/prefill-ttft.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
assert rows, "no hit rate measured"
for row in rows:
    assert "bubble_ms" not in row and "host_wait_ms" in row, row
    assert abs(row["exposed_io_ms"] - (row["tutti_ttft_ms"] - row["resident_ttft_ms"])) < 1e-6, row
PY
  echo "gpu-check: prefill step rehearsed on the CPU with $prefill_python: $OUT/prefill-rehearsal"
  # Again in bf16, the GPU run's dtype (--tiny defaults to float32): the model's parameters, the
  # KV memory and the logits tolerance of that dtype are checked before the one GPU session (~15 s).
  rm -rf "$OUT/prefill-rehearsal-bf16"
  OUT="$OUT/prefill-rehearsal-bf16" RUN_ALL_PREFILL_DEVICE_ARGS="--device cpu --tiny --dtype bf16" RUN_ALL_PYTHON="$prefill_python" \
    RUN_ALL_TUTTID="$TARGET/debug/tuttid" RUN_ALL_WHEEL="$(ls "$ROOT"/target/wheels/tutti-*-abi3-*.whl)" \
    tools/gpu/run-all.sh prefill
  # PASS only where prefill-ttft.py passed: its parameters checked bf16, logits and bytes compared.
  grep -q '^prefill: PASS' "$OUT/prefill-rehearsal-bf16/summary.txt"
  echo "gpu-check: prefill step rehearsed on the CPU in bf16: $OUT/prefill-rehearsal-bf16"
elif [[ "${GPU_CHECK_REQUIRE_PREFILL:-0}" == 1 ]]; then
  echo "gpu-check: FAILED: prefill step not rehearsed: no python with torch and transformers, and no complete vLLM environment (tools/python/engine-env.sh vllm; GPU_CHECK_REQUIRE_PREFILL=1)" >&2
  exit 1
else
  echo "gpu-check: prefill step NOT rehearsed: no python with torch and transformers (set GPU_CHECK_PREFILL_PYTHON, or build tools/python/engine-env.sh vllm)"
fi
echo "gpu-check: OK"
