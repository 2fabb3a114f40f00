#!/usr/bin/env bash
# tools/gpu/run-gpu-tests.sh — the GPU test of gio-uring (crates/gio-uring/tests/gpu.rs) in one call
# on a machine with a GPU, writing results and versions under $OUT.
#
# usage, in the repository root:
#   tools/gpu/run-gpu-tests.sh --prepare   on the development machine (cargo, network): builds the
#                                          kernels and the test binary into target/gpu-carry/
#   tools/gpu/run-gpu-tests.sh             on the GPU machine: versions, kernels, rule checks, then
#                                          the GPU test once per DMA mode in GIO_GPU_TEST_MODES
#
# What it assumes of the GPU machine (the lent device: CUDA toolkit with nvcc, a driver, PyTorch;
# no network; only the working tree travels, 64 MiB at most): cargo and rustc are NOT there. The
# test binary is therefore built here by --prepare and carried: target/ is ignored by git, so the
# remote call must name `target/gpu-carry` in its `carry` list. If cargo does exist there, the
# carried binary is still preferred; only without one is it built in place (a failed build then
# says so). The kernels are compiled there with its own nvcc
# (tools/cuda-build.sh with GIO_NVCC), else the carried target/gpu-carry/kernels are used; if
# that build fails (its nvcc warns where --prepare's did not, say), the carried kernels are used
# and summary.txt says so in a NOTE line. Then the driver must load the chosen kernels
# (tools/gpu/cuda-attrs.py --load-probe, cuModuleLoadData): kernels built here that it refuses
# give way to carried ones it loads (a NOTE line); if none loads (the carried ones need a CUDA
# 13.x driver) the kernels FAIL and the GPU test is not run. The carried binary links glibc
# dynamically: it needs a glibc no older than the build machine's.
#
# Time: GIO_GPU_TESTS_BUDGET_S (default 600) bounds the whole script; each GPU test run gets what
# is left of it (at most GIO_GPU_TEST_LIMIT_S, default 90 s; it needs under 30) under
# `timeout --foreground`, which stays in the caller's process
# group: a caller's `timeout` (run-all.sh's, with a budget above this one) also reaches the test
# binary, so its persistent kernel never outlives the call.
#
# DMA modes: GIO_GPU_TEST_MODES (default "staged"), passed to the test as GIO_DMA_MODE. The test
# exercises staged mode only today; a p2p-style mode (the emulator DMAs straight into host memory
# mapped into the GPU) is not written yet, and a mode the test does not know fails loudly.
#
# Results in $OUT (default target/gpu-results): versions.txt (with torch's version and
# tools/gpu/cuda-attrs.py's attributes), kernels.log, kernel-load.txt (the load probe),
# kernel-dir.txt (the kernels used), gpu-MODE.log per mode, summary.txt. With
# GIO_GPU_TESTS_LIVE_LOG=FILE (run-all.sh's run.log) each of those is also appended to FILE as it
# is written, so a kill keeps it, and versions.txt leaves out torch and the attributes, which
# run-all.sh's header recorded. nvcc: on PATH, else /usr/local/cuda/bin/nvcc. Scripts run through bash (exec bits may not
# survive the copy; the carried binary is chmod +x'ed). Exit status: non-zero if any step failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
CARRY="$ROOT/target/gpu-carry"

# Builds the gpu test binary (extra cargo flags: $@) and prints its path as cargo names it
# (tools/lib/cargo-executables.py: CARGO_TARGET_DIR or build.target-dir move it); rustc's errors
# go to stderr, rendered. Fails, printing nothing, when no binary was built.
build_gpu_test() {
  cargo test -p gio-uring --features cuda --locked --test gpu --no-run "$@" \
    --message-format=json-render-diagnostics |
    python3 "$ROOT/tools/lib/cargo-executables.py" "run-gpu-tests: the gpu test" gpu
}

if [[ "${1:-}" == "--prepare" ]]; then
  set -e
  mkdir -p "$CARRY"
  GIO_SKIP_CARGO=1 bash tools/cuda-build.sh "$CARRY/kernels"
  # Release: a debug test binary with its dependencies is tens of MiB; the carry limit is 64 MiB.
  binary=$(build_gpu_test --release)
  [[ -n "$binary" ]] || { echo "run-gpu-tests: no gpu test binary was built" >&2; exit 1; }
  cp "$binary" "$CARRY/gpu-test"
  strip "$CARRY/gpu-test" || true
  du -sh "$CARRY"
  echo "run-gpu-tests: carry target/gpu-carry (and run this script without --prepare there)"
  exit 0
fi

OUT="${OUT:-$ROOT/target/gpu-results}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
failed=0
record() { echo "$1" | tee -a "$SUMMARY"; }
LIVE="${GIO_GPU_TESTS_LIVE_LOG:-/dev/null}"
# live NAME: a file of $OUT, written from stdin and appended to $LIVE as it comes.
live() { echo "===== run-gpu-tests: $1 ($(date -u +%H:%M:%S))" >>"$LIVE"; tee "$OUT/$1" >>"$LIVE"; }
NVCC_PATH=$(command -v nvcc 2>/dev/null) || { [[ -f /usr/local/cuda/bin/nvcc ]] && NVCC_PATH=/usr/local/cuda/bin/nvcc; } || NVCC_PATH=""

{
  echo "== date"; date -u
  echo "== uname"; uname -a
  echo "== nvidia-smi"; timeout -k 5 30 nvidia-smi 2>&1 || echo "nvidia-smi failed"
  echo "== gpu"; timeout -k 5 30 nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv 2>&1
  echo "== nvcc"; if [[ -n "$NVCC_PATH" ]]; then echo "$NVCC_PATH"; "$NVCC_PATH" --version 2>&1; else echo "not found (PATH, /usr/local/cuda/bin)"; fi
  # Under run-all.sh (the only caller that sets GIO_GPU_TESTS_LIVE_LOG) its header has recorded
  # torch's version and the CUDA attributes in summary.txt (and run.log) already: torch's import
  # costs 10-20 s of the tests step on the GPU machine, so neither probe is repeated there.
  if [[ -n "${GIO_GPU_TESTS_LIVE_LOG:-}" ]]; then
    echo "== torch, cuda attributes: in run-all.sh's summary.txt header and run.log"
  else
    echo "== torch"; timeout -k 5 60 python3 -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>&1
  fi
  echo "== cargo"; command -v cargo && cargo --version 2>&1 || echo "no cargo"
  echo "== glibc"; ldd --version 2>&1 | head -n 1
  echo "== LD_LIBRARY_PATH ${LD_LIBRARY_PATH-<unset>}"
  [[ -n "${GIO_GPU_TESTS_LIVE_LOG:-}" ]] ||
    { echo "== cuda attributes (tools/gpu/cuda-attrs.py)"; timeout -k 5 30 python3 tools/gpu/cuda-attrs.py 2>&1; }
} 2>&1 | live versions.txt

BUDGET_S=${GIO_GPU_TESTS_BUDGET_S:-600}
# One GPU test run needs under 30 s (two passes of a few layers on the software controller); a
# hung kernel is stopped at this limit, so that run-all.sh's later steps keep their time.
TEST_LIMIT_S=${GIO_GPU_TEST_LIMIT_S:-90}

# Kernels and the shared-rule checks (C, C++, CUDA C++), with this machine's nvcc if it has one.
KERNEL_DIR="$ROOT/target/kernels"
if [[ -n "$NVCC_PATH" ]]; then
  # No --foreground here: `timeout` then signals its whole process group, nvcc included (with it,
  # only the bash of cuda-build.sh died, and an nvcc left running held the log pipe open past the
  # limit). The build needs no terminal. In a group of its own it is out of reach of a caller's
  # timeout, so its limit is what is left of this script's budget (less the GPU test's room),
  # at most half of it.
  build_limit_s=$((BUDGET_S / 2))
  left_s=$((BUDGET_S - SECONDS - 20))
  ((left_s < build_limit_s)) && build_limit_s=$left_s
  ((build_limit_s < 5)) && build_limit_s=5
  GIO_NVCC="$NVCC_PATH" GIO_SKIP_CARGO=1 timeout -k 5 "$build_limit_s" \
    bash tools/cuda-build.sh "$KERNEL_DIR" 2>&1 | live kernels.log
  if [[ ${PIPESTATUS[0]} -eq 0 ]]; then
    record "PASS kernels built here with $NVCC_PATH"
  elif [[ -f "$CARRY/kernels/$(bash tools/cuda-build.sh --image-stem).sm_90.cubin" ]]; then
    KERNEL_DIR="$CARRY/kernels"
    record "NOTE kernels: building here with $NVCC_PATH failed (see kernels.log); the GPU test uses the carried kernels (target/gpu-carry/kernels, built by --prepare)"
  else
    record "FAIL kernels (see kernels.log; no carried kernels to fall back on)"; failed=1
  fi
elif [[ -d "$CARRY/kernels" ]]; then
  KERNEL_DIR="$CARRY/kernels"
  record "NOTE no nvcc here: using the carried kernels"
else
  record "FAIL no nvcc and no carried kernels"; failed=1
fi

# Whether the driver loads the chosen kernels (tools/gpu/cuda-attrs.py --load-probe: the image the
# runtime picks, through cuModuleLoadData): an nvcc newer than the driver builds images it
# refuses, and the carried ones (nvcc 13.2, --prepare's wheels) need a CUDA 13.x driver. The
# first directory, of those built here and carried, whose image loads is used; where the probe
# cannot run (no libcuda, cuInit failing) the choice above stands.
KERNELS_LOAD=yes
if [[ $failed -eq 0 ]]; then
  candidates=("$KERNEL_DIR")
  [[ "$KERNEL_DIR" != "$CARRY/kernels" && -d "$CARRY/kernels" ]] && candidates+=("$CARRY/kernels")
  probe=$(timeout -k 5 30 python3 tools/gpu/cuda-attrs.py --load-probe "$(bash tools/cuda-build.sh --image-stem)" "${candidates[@]}" 2>&1)
  echo "$probe" | live kernel-load.txt >/dev/null
  driver=$(sed -n 's/^driverApiVersion=//p' <<<"$probe" | head -n 1)
  loads=""
  for candidate in "${candidates[@]}"; do
    grep -qxF "load $candidate=ok" <<<"$(sed 's/ (.*//' <<<"$probe")" && { loads=$candidate; break; }
  done
  if [[ -n "$loads" && "$loads" != "$KERNEL_DIR" ]]; then
    record "NOTE kernels: $KERNEL_DIR does not load on this driver (CUDA ${driver:-unknown}: $(grep -F "load $KERNEL_DIR=" <<<"$probe" | head -n 1)); the GPU test uses $loads"
    KERNEL_DIR=$loads
  elif [[ -z "$loads" ]] && grep -q '^load .*=FAILED' <<<"$probe"; then
    record "FAIL kernels: no kernel image loads on this driver (CUDA ${driver:-unknown}; the carried ones, nvcc 13.2, need a 13.x driver): $(grep '^load ' <<<"$probe" | paste -sd ';' -)"
    failed=1
    KERNELS_LOAD=no
  elif [[ -z "$loads" ]]; then
    echo "run-gpu-tests: kernel load probe inconclusive: $(paste -sd ';' - <<<"$probe")" >>"$LIVE"
  fi
  # For run-all.sh's bandwidth step, which runs the same kernels.
  [[ "$KERNELS_LOAD" == yes ]] && echo "$KERNEL_DIR" >"$OUT/kernel-dir.txt"
fi

# The test binary: the carried one (--prepare's release build), else built here if cargo exists.
BINARY=""
if [[ -f "$CARRY/gpu-test" ]]; then
  chmod +x "$CARRY/gpu-test" 2>/dev/null
  BINARY="$CARRY/gpu-test"
elif command -v cargo >/dev/null 2>&1; then
  BINARY=$(build_gpu_test 2> >(live build.log >&2))
  if [[ -z "$BINARY" ]]; then
    record "NOTE no carried gpu test binary, and building it here with cargo failed (see build.log)"
  fi
fi
if [[ -z "$BINARY" ]]; then
  record "FAIL no gpu test binary (carry target/gpu-carry made by --prepare)"
  exit 1
fi

for mode in ${GIO_GPU_TEST_MODES:-staged}; do
  if [[ "$KERNELS_LOAD" == no ]]; then
    record "FAIL gpu test, DMA mode $mode: not run, no kernel image loads on this driver (above)"; failed=1
    continue
  fi
  started=$SECONDS
  limit=$((BUDGET_S - SECONDS - 10))
  ((limit > TEST_LIMIT_S)) && limit=$TEST_LIMIT_S
  if ((limit < 20)); then
    record "FAIL gpu test, DMA mode $mode: not run, ${limit} s of GIO_GPU_TESTS_BUDGET_S ($BUDGET_S s) left"; failed=1
    continue
  fi
  GIO_DMA_MODE="$mode" GIO_KERNEL_DIR="$KERNEL_DIR" timeout --foreground -k 5 "$limit" "$BINARY" 2>&1 | live "gpu-$mode.log"
  rc=${PIPESTATUS[0]}
  ((rc == 124 || rc == 137)) && echo "run-gpu-tests: the GPU test ran past its limit of $limit s and was stopped" | tee -a "$OUT/gpu-$mode.log" >>"$LIVE"
  if [[ $rc -eq 0 ]] && grep -q "gpu test: passed" "$OUT/gpu-$mode.log"; then
    record "PASS gpu test, DMA mode $mode ($((SECONDS - started)) s)"
  elif grep -q "gpu test skipped" "$OUT/gpu-$mode.log"; then
    record "FAIL gpu test skipped on a GPU machine, DMA mode $mode: $(grep 'skipped' "$OUT/gpu-$mode.log")"; failed=1
  else
    record "FAIL gpu test, DMA mode $mode (exit $rc; see gpu-$mode.log)"; failed=1
  fi
done
exit $failed
