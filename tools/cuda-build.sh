#!/usr/bin/env bash
# Compile the gio_uring CUDA kernels without a GPU, check the shared ABI header from C, C++ and CUDA,
# and build the `cuda` feature of gio-uring and of tuttid (GPU memory through CUDA IPC: the
# tutti-cuda-ipc crate, the daemon's import, tuttid-gpu-check), lint it, and run its tests that
# need no GPU (no driver -> typed errors; tuttid-gpu-check's processes with the memfd stand-in).
#
# usage: tools/cuda-build.sh [OUT_DIR]        (default: target/kernels)
#        tools/cuda-build.sh --image-stem     print what the kernel images' names start with
#                                             (gio_io_kernel.vN, N the ABI version) and exit
#   GIO_SKIP_CARGO=1   skip the cargo builds, lints and tests
#   GIO_NVCC=PATH      use this nvcc (an installed toolkit) instead of installing the pinned wheels
#
# nvcc comes from NVIDIA's CUDA 13 Python wheels, installed once (idempotently) with pip into
# .tools/cuda-wheels (gitignored); whether they are there is decided by running nvcc and reading
# the installed wheels' versions and RECORDs, not by a stamp (an interrupted install is made again). Every wheel is pinned, including the two that nvcc pulls in
# (crt, nvvm): an unpinned dependency resolves to the newest release and mixes toolkit versions.
# The cu12 wheels ship no nvcc, so the cu13 ones are required. No GPU or driver is needed here.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The kernel images' names carry the ABI version they are built from (gio_io_kernel.v3.sm_90.cubin,
# gio_io_kernel.v3.compute_80.ptx): gio-uring looks only for its own version
# (gpu::KernelImage::locate) and names an older image it finds instead, so a kernel directory left
# from an older build is refused rather than run. The one place the scripts derive the version:
# GIO_ABI_VERSION in kernels/gio_abi.h (tools/gpu/*.sh ask --image-stem).
ABI_VERSION="$(sed -n 's/^#define GIO_ABI_VERSION \([0-9][0-9]*\)u$/\1/p' "$ROOT/kernels/gio_abi.h")"
[[ "$ABI_VERSION" =~ ^[0-9]+$ ]] || { echo "cuda-build: no '#define GIO_ABI_VERSION <n>u' line in kernels/gio_abi.h" >&2; exit 1; }
IMAGE_STEM="gio_io_kernel.v$ABI_VERSION"
if [[ "${1:-}" == "--image-stem" ]]; then
  echo "$IMAGE_STEM"
  exit 0
fi

OUT="${1:-$ROOT/target/kernels}"
CUDA_WHEEL_VERSION="13.2.86"
WHEELS_DIR="$ROOT/.tools/cuda-wheels-$CUDA_WHEEL_VERSION"
PACKAGES=(
  "nvidia-cuda-nvcc==$CUDA_WHEEL_VERSION"
  "nvidia-cuda-runtime==$CUDA_WHEEL_VERSION"
  "nvidia-cuda-cccl==$CUDA_WHEEL_VERSION"
  "nvidia-cuda-crt==$CUDA_WHEEL_VERSION"
  "nvidia-nvvm==$CUDA_WHEEL_VERSION"
)

# The pinned wheels are installed (each exactly once, at its pin), every file their RECORDs list
# is there (what nvcc runs besides itself, nvvm's cicc, and the headers, which `nvcc --version`
# does not touch: a tree damaged after its install), and their nvcc runs.
wheels_installed() {
  "$WHEELS_DIR/nvidia/cu13/bin/nvcc" --version >/dev/null 2>&1 || return 1
  python3 - "$WHEELS_DIR" "${PACKAGES[@]}" <<'PY'
import importlib.metadata as metadata, os, sys
path = [sys.argv[1]]
for pin in sys.argv[2:]:
    name, version = pin.split("==")
    found = list(metadata.distributions(name=name, path=path))
    if [dist.version for dist in found] != [version]:
        sys.exit(f"cuda-build: {name} {[dist.version for dist in found]} in {path[0]}, {version} pinned")
    files = found[0].files
    missing = "has no RECORD" if files is None else next((f"is missing {f}" for f in files if not os.path.exists(f.locate())), None)
    if missing is not None:
        sys.exit(f"cuda-build: {name} {version} in {path[0]} {missing}")
PY
}

if [[ -n "${GIO_NVCC:-}" ]]; then
  # A machine with a CUDA toolkit installed (the GPU test machine, which has no network): use it.
  NVCC="$GIO_NVCC"
  CUDA_HOME="$(cd "$(dirname "$NVCC")/.." && pwd)"
elif ! wheels_installed; then
  echo "cuda-build: installing ${PACKAGES[*]} into $WHEELS_DIR"
  # Into a directory of its own, moved into place whole once pip has finished: an interrupted
  # install leaves only WHEELS_DIR.partial (removed by the next one), never a partial WHEELS_DIR.
  rm -rf "$WHEELS_DIR" "$WHEELS_DIR.partial"
  python3 -m pip install --disable-pip-version-check --quiet --no-deps \
    --target "$WHEELS_DIR.partial" "${PACKAGES[@]}"
  mv "$WHEELS_DIR.partial" "$WHEELS_DIR"
  wheels_installed || { echo "cuda-build: the wheels installed into $WHEELS_DIR are not what is pinned (see above)" >&2; exit 1; }
fi

if [[ -z "${GIO_NVCC:-}" ]]; then
  CUDA_HOME="$WHEELS_DIR/nvidia/cu13"
  NVCC="$CUDA_HOME/bin/nvcc"
fi
[[ -x "$NVCC" ]] || { echo "cuda-build: nvcc not found at $NVCC" >&2; exit 1; }
export PATH="$CUDA_HOME/bin:$PATH"
"$NVCC" --version | tail -n 2

KERNELS="$ROOT/kernels"
mkdir -p "$OUT"
# Written last, when every kernel and check below has passed: tools/gpu/run-all.sh uses a kernel
# directory built on the GPU machine only with it (else the carried one).
rm -f "$OUT/kernels-ok.txt"
# -Werror all-warnings turns nvcc's own warnings into errors; -Xcompiler passes the host side,
# and --Werror also covers ptxas/nvlink diagnostics ("cross-execution-space-call", "deprecated").
NVCC_FLAGS=(-std=c++17 -O3 -lineinfo -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror
            -I "$KERNELS" -I "$CUDA_HOME/include")

# Images of other ABI versions (or from before names carried one) are removed: a directory holds
# one version's kernels.
rm -f "$OUT"/gio_io_kernel.*.cubin "$OUT"/gio_io_kernel.*.ptx
for arch in 80 90; do
  "$NVCC" "${NVCC_FLAGS[@]}" -cubin -arch="sm_$arch" \
    -o "$OUT/$IMAGE_STEM.sm_$arch.cubin" "$KERNELS/gio_io_kernel.cu"
done
# PTX for the lowest architecture we support: the driver JIT-compiles it for newer GPUs.
"$NVCC" "${NVCC_FLAGS[@]}" -ptx -arch=compute_80 -o "$OUT/$IMAGE_STEM.compute_80.ptx" \
  "$KERNELS/gio_io_kernel.cu"
# Each image carries its version for the host to check at load time (gio_abi_version, read with
# cuModuleGetGlobal). Whole-program mode emits it without .visible (a local symbol of the cubin).
grep -Eq "^(\.visible )?\.global \.align 4 \.u32 gio_abi_version = $ABI_VERSION;\$" "$OUT/$IMAGE_STEM.compute_80.ptx" || {
  echo "cuda-build: $IMAGE_STEM.compute_80.ptx lacks the global gio_abi_version = $ABI_VERSION" >&2
  exit 1
}
for arch in 80 90; do
  grep -qa gio_abi_version "$OUT/$IMAGE_STEM.sm_$arch.cubin" || { echo "cuda-build: $IMAGE_STEM.sm_$arch.cubin has no gio_abi_version symbol" >&2; exit 1; }
done

# The ABI header must be valid C11 (gcc), C++ (g++) and CUDA C++ (nvcc), and its static asserts
# hold in all three.
gcc -std=c11 -Wall -Wextra -Werror -pedantic -I "$KERNELS" -o "$OUT/abi_check_c" \
  "$KERNELS/tests/abi_check.c"
"$OUT/abi_check_c"
g++ -std=c++17 -Wall -Wextra -Werror -pedantic -x c++ -I "$KERNELS" -o "$OUT/abi_check_cxx" \
  "$KERNELS/tests/abi_check.c"
"$OUT/abi_check_cxx"
"$NVCC" "${NVCC_FLAGS[@]}" -x cu -arch=sm_80 -c -o "$OUT/abi_check_cu.o" \
  "$KERNELS/tests/abi_check.c"
# The shared rules (GIO_RULE functions) hold when compiled as C and as C++, and compile as CUDA C++
# host+device code; crates/gio-uring/tests/gpu_rules.rs runs the C build from `cargo test`.
gcc -std=c11 -Wall -Wextra -Werror -pedantic -I "$KERNELS" -o "$OUT/rules_check_c" \
  "$KERNELS/tests/rules_check.c"
"$OUT/rules_check_c"
g++ -std=c++17 -Wall -Wextra -Werror -pedantic -x c++ -I "$KERNELS" -o "$OUT/rules_check_cxx" \
  "$KERNELS/tests/rules_check.c"
"$OUT/rules_check_cxx"
"$NVCC" "${NVCC_FLAGS[@]}" -x cu -arch=sm_80 -c -o "$OUT/rules_check_cu.o" \
  "$KERNELS/tests/rules_check.c"

ls -l "$OUT/$IMAGE_STEM".*
"$NVCC" --version | tail -n 1 >"$OUT/kernels-ok.txt"
echo "cuda-build: kernels OK -> $OUT"

if [[ "${GIO_SKIP_CARGO:-0}" != "1" ]]; then
  (cd "$ROOT" && cargo build --locked -p gio-uring --features cuda)
  echo "cuda-build: cargo build --locked -p gio-uring --features cuda OK"
  # The GPU executor's pure logic (launch planning, retirement, the queue-pair reset rules) and
  # the plan test need no GPU: run them, since the rust stage builds without the feature.
  (cd "$ROOT" && cargo test --locked -p gio-uring --features cuda --lib --test gpu_plan --test gpu)
  echo "cuda-build: gio-uring's unit tests and gpu_plan with the cuda feature (no GPU) OK"
  # The lint stage builds without features: the CUDA IPC code is linted here.
  CUDA_IPC_FEATURES=(-p tutti-cuda-ipc -p tutti-daemon -p tuttid --features tutti-cuda-ipc/cuda,tutti-daemon/cuda,tuttid/cuda)
  (cd "$ROOT" && cargo clippy --locked "${CUDA_IPC_FEATURES[@]}" --all-targets -- -D warnings)
  (cd "$ROOT" && cargo test --locked -p tutti-cuda-ipc --features cuda)
  # `gpu_memory` is a name filter, which would pass matching nothing: its tests are counted.
  log="$(mktemp)"
  (cd "$ROOT" && cargo test --locked -p tutti-daemon --features cuda --lib gpu_memory 2>&1) | tee "$log"
  count=$(awk '/^test result: ok\. [0-9]+ passed/ { n += $4 } END { print n + 0 }' "$log")
  rm -f "$log"
  [[ "$count" -gt 0 ]] || { echo "cuda-build: 'cargo test -p tutti-daemon --features cuda --lib gpu_memory' ran no test (does the filter still match?)" >&2; exit 1; }
  echo "cuda-build: tutti-daemon's gpu_memory tests with the cuda feature: $count passed"
  (cd "$ROOT" && cargo test --locked -p tuttid --features cuda --test gpu_check)
  echo "cuda-build: tutti-cuda-ipc, tutti-daemon and tuttid with the cuda feature: built, linted, tested (no GPU) OK"
fi
