#!/usr/bin/env bash
# tools/test.sh — every test suite of the project, from a fresh clone on a fresh Debian machine.
#
# It installs what the suites need (Debian packages, Python wheels; idempotent, as root) and runs:
#   rust        tutti-bench checked to build without protoc (the README's first command), then
#               cargo test --workspace (unit tests, the software-controller conformance suite,
#               rings, executors, object store, scheduler simulator assertions)
#   lint        rust-version checked (tools/check-msrv.sh), cargo clippy -D warnings, cargo fmt --check
#   bindings    gio_abi.h → Rust bindings regenerated with bindgen and diffed (tools/check-bindings.sh,
#               after tools/check-bindings-test.sh tests its libclang detection)
#   fuzz        the cargo-fuzz targets build (running them needs nightly: see fuzz/README.md)
#   benches     criterion benchmarks compile, and the driver's run once each (measuring is `cargo bench`)
#   cluster     the cluster registry (crates/cluster), `tutti cluster status` and tuttid processes as
#               cluster nodes against real etcd servers (Debian's etcd-server, installed here)
#               that the tests start on loopback
#               ports: one member, and three where members are killed; every process stopped
#   python      the tutti wheel built (maturin, abi3) into a venv under ~/.cache/tutti (keyed by the
#               pinned python/requirements-test.txt), installed into a fresh venv and imported, and
#               the core tests (python/tests, pytest) against it, with daemons of their own
#               (tools/python/core-test.sh)
#   engines     the vLLM connector and offloading tier and the SGLang HiCache backend against the
#               pinned engines' real classes (vLLM 0.32.0, SGLang 0.5.23; environments cached under
#               ~/.cache/tutti, keyed by the pins: tools/python/engine-env.sh), with tuttid daemons
#               of their own (tools/python/engine-test.sh)
#   cuda        CUDA kernels compiled with nvcc from the CUDA 13 wheels, `cuda` feature built
#               (tools/cuda-build.sh; no GPU needed to compile); the GPU scripts' programs
#               compiled, their timeline logic tested and the python and prefill steps of
#               tools/gpu/run-all.sh rehearsed without a GPU (tools/gpu/check.sh; after engines,
#               whose vLLM environment has the torch and transformers the prefill rehearsal needs)
#   vm          the conformance suite against two QEMU NVMe controllers through VFIO in a Linux guest,
#               and the object-store round trip over both (tools/vm-test.sh)
#
# Building the workspace needs `protoc` (etcd-client's build script generates etcd's gRPC API):
# stages that build it first run tools/check-protoc.sh, which compiles a file that imports
# protobuf's well-known types, and install Debian's protobuf-compiler and libprotobuf-dev when
# that fails. tutti-bench (and the Python package) use tutti-daemon without its `cluster`
# feature and the workspace's default-members leave out tuttid, tutti and tutti-cluster, so
# `cargo run --release --bin tutti-bench` builds without protoc (the rust stage checks it);
# tuttid needs it.
#
# Stages run in that order; a failing stage does not stop the later ones, and the script exits
# non-zero if any failed. Every command of a stage (apt-get and rustup included) runs under a time
# limit (generous: a cold build on two cores included), so one hung test fails its stage instead
# of hanging CI. The scripts a stage runs (tools/python/*.sh, tools/vm-test.sh, ...) bound their
# own steps with `timeout` as well; each such `timeout` moves into a process group of its own,
# which an outer `timeout`'s signal misses, so those scripts run through `bounded` below: in a
# session of their own, all of which is killed when the script ends or its limit expires.
#
# usage: tools/test.sh [STAGE...]      e.g. tools/test.sh cluster python   (default: all, in order)
#        TUTTI_STAGES="rust lint" tools/test.sh   (the same selection from the environment)
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."

ALL_STAGES="rust lint bindings fuzz benches cluster python engines cuda vm"
case "${1:-}" in
    -h | --help)
        sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
esac
if [ $# -gt 0 ]; then
    STAGES="$*"
else
    STAGES=${TUTTI_STAGES:-$ALL_STAGES}
fi
# Every name is checked before any stage runs: a typo fails at once, not after an hour of stages.
for stage in $STAGES; do
    case " $ALL_STAGES " in
        *" $stage "*) ;;
        *)
            echo "tools/test.sh: unknown stage '$stage' (known: $ALL_STAGES)" >&2
            exit 2
            ;;
    esac
done
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
export DEBIAN_FRONTEND=noninteractive

passed=0
failed=0
failed_names=()
summary=()

# Free space on the file system the builds go to, in GiB. A full run from a fresh clone writes
# about 14 GiB (the cargo target directory, the VM images, the wheels); running out shows up as
# a confusing failure in whichever stage is writing, so the figure is printed with every stage.
free_gibibytes() { df --output=avail -B1G "${CARGO_TARGET_DIR:-target}" 2> /dev/null | tail -1 | tr -d ' ' || true; }
mkdir -p "${CARGO_TARGET_DIR:-target}"
if [ -n "$(free_gibibytes)" ] && [ "$(free_gibibytes)" -lt 16 ]; then
    echo "tools/test.sh: warning: only $(free_gibibytes) GiB free here; a full run needs about 14 GiB" >&2
fi

run_stage() {
    local name=$1
    shift
    local started=$SECONDS
    echo
    echo "===== stage: $name ====="
    if "$@"; then
        passed=$((passed + 1))
        summary+=("PASS $name ($((SECONDS - started)) s, $(free_gibibytes) GiB free after)")
    else
        failed=$((failed + 1))
        failed_names+=("$name")
        summary+=("FAIL $name ($((SECONDS - started)) s, $(free_gibibytes) GiB free after)")
    fi
}

# bounded SECONDS COMMAND [ARG...]: runs COMMAND (a program or script, not a shell function)
# under `timeout -k 30 SECONDS`, in a session of its own (setsid), and when it has ended, by
# itself or by its limit, kills whatever is still running in that session: the inner `timeout`s
# of the scripts and their children (pip, pytest, tuttid, QEMU), which sit in process groups of
# their own that the outer `timeout` does not signal. Returns COMMAND's status (124 or 137 when
# the limit expired).
bounded() {
    local limit=$1 sidfile sid rc stat line fields
    shift
    sidfile=$(mktemp) || return 1
    # `timeout`'s child is not a process-group leader, so setsid makes it a session leader without
    # forking: the session id is the pid the child writes before exec'ing.
    timeout -k 30 "$limit" bash -c 'echo $$ > "$0" && exec setsid "$@"' "$sidfile" "$@"
    rc=$?
    sid=$(cat "$sidfile" 2> /dev/null)
    rm -f "$sidfile"
    if [ -n "$sid" ]; then
        # /proc, not pkill: procps is not on every fresh machine. Field 6 of stat is the session.
        for stat in /proc/[0-9]*/stat; do
            read -r line 2> /dev/null < "$stat" || continue
            read -r -a fields <<< "${line##*") "}"
            [ "${fields[3]:-}" = "$sid" ] || continue
            stat=${stat#/proc/}
            kill -KILL "${stat%/stat}" 2> /dev/null
        done
    fi
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "tools/test.sh: '$*' ran past its ${limit} s limit: stopped, with everything it started" >&2
    return "$rc"
}

# Installs Debian packages unless `check` already succeeds; then `check` must succeed. An
# earlier dpkg run that was interrupted makes every apt-get install fail until it is finished,
# so it is finished first.
ensure_installed() {
    local check=$1
    shift
    if ! eval "$check" > /dev/null 2>&1; then
        if [ "$(id -u)" -ne 0 ]; then
            echo "tools/test.sh: needs $* (run as root to install them, or install them)" >&2
            return 1
        fi
        echo "tools/test.sh: installing $* (because '$check' fails)"
        timeout -k 30 600 dpkg --configure -a > /dev/null || true
        timeout -k 30 900 apt-get update -q > /dev/null &&
            timeout -k 30 1800 apt-get install -y -q --no-install-recommends "$@" > /dev/null || return 1
    fi
    eval "$check" > /dev/null 2>&1 || { echo "tools/test.sh: '$check' still fails after installing $*" >&2; return 1; }
}

ensure_protoc() { ensure_installed tools/check-protoc.sh protobuf-compiler libprotobuf-dev; }

# What the scripts call but a fresh Debian lacks, checked by using it (stock bookworm has no
# python3-venv nor python3-pip, and may have no python3 or g++ at all). The python checked is
# the one the scripts run: PATH's python3 (a pyenv shim where there is one), or TUTTI_PYTHON /
# TUTTI_ENGINE_PYTHON.
ensure_python3() { ensure_installed 'python3 --version' python3; }
ensure_gxx() { ensure_installed 'g++ --version' g++; }
ensure_pip() { ensure_python3 && ensure_installed 'python3 -m pip --version' python3-pip; }
# Makes a venv and asks its pip for its version: what wheel.sh and engine-env.sh do first.
python_makes_venvs() {
    local dir rc
    dir=$(mktemp -d) || return 1
    timeout -k 10 300 "$1" -m venv "$dir/venv" && timeout -k 10 120 "$dir/venv/bin/python" -m pip --version
    rc=$?
    rm -rf "$dir"
    return "$rc"
}
ensure_venv() { ensure_python3 && ensure_installed "python_makes_venvs '${1:-python3}'" python3-venv; }

# The etcd binary the cluster tests run (by PATH), checked by running it, not by dpkg's state.
# Installing etcd-server on a machine with systemd also enables its service on port 2379: the
# tests never use it (they start their own members on free ports), so it is stopped again.
ensure_etcd() {
    local installed_here=0
    command -v etcd > /dev/null 2>&1 || installed_here=1
    # Not `etcd --version | grep -q`: grep leaving early kills etcd with SIGPIPE, which pipefail reports.
    ensure_installed '[[ "$(etcd --version 2> /dev/null)" == "etcd Version: 3."* ]]' etcd-server || return 1
    if [ "$installed_here" = 1 ] && command -v systemctl > /dev/null 2>&1 && systemctl is-active -q etcd 2> /dev/null; then
        systemctl disable --now etcd > /dev/null 2>&1 || true
    fi
    echo "etcd: $(command -v etcd) ($(etcd --version | head -1))"
}

stage_rust() {
    # The README's first command must build on a machine without protoc (the workspace's
    # default-members leave out the etcd client's users): with PROTOC pointing nowhere, any
    # build script that runs protoc fails this check, installed protoc or not.
    PROTOC=/nonexistent/protoc timeout -k 30 1800 cargo check --locked --bin tutti-bench 2>&1 || {
        echo "the README's 'cargo run --release --bin tutti-bench' needs protoc again (see Cargo.toml's default-members)"
        return 1
    }
    # TUTTI_REQUIRE_URING=1: a test that finds no io_uring (tutti_uring::available) fails instead
    # of passing as skipped, so a CI machine without it cannot make the ring tests vanish.
    # --no-fail-fast: a failing test binary does not hide the failures of the ones after it.
    ensure_protoc && TUTTI_REQUIRE_URING=1 timeout -k 30 2700 cargo test --workspace --all-targets --locked --no-fail-fast 2>&1
}

stage_lint() {
    # Checked by running each tool, not by rustup's list: a toolchain may have one without the other.
    if ! cargo clippy --version > /dev/null 2>&1 || ! cargo fmt --version > /dev/null 2>&1; then
        timeout -k 30 900 rustup component add clippy rustfmt || return 1
    fi
    # clippy's incompatible_msrv lint checks std APIs against rust-version; check-msrv.sh checks
    # that every package declares it and that no locked dependency needs a newer compiler.
    ensure_protoc && ensure_python3 && bounded 900 tools/check-msrv.sh &&
        timeout -k 30 1800 cargo clippy --workspace --all-targets --locked -- -D warnings &&
        timeout -k 30 300 cargo fmt --all -- --check
}

stage_bindings() { bounded 300 tools/check-bindings-test.sh && bounded 1200 tools/check-bindings.sh; }
# cuda-build.sh installs the nvcc wheels with `python3 -m pip` and compiles the ABI header with
# gcc and g++; check.sh runs python3. After the engines stage, check.sh must rehearse the prefill
# step with the vLLM environment (GPU_CHECK_REQUIRE_PREFILL=1): a missing one fails the stage.
stage_cuda() {
    ensure_pip && ensure_gxx || return 1
    local require_prefill=0
    case " $STAGES " in *" engines "*) require_prefill=1 ;; esac
    bounded 1200 tools/cuda-build.sh && GPU_CHECK_REQUIRE_PREFILL=$require_prefill bounded 1200 tools/gpu/check.sh
}

stage_fuzz() {
    # The fuzz crate has its own workspace; `cargo fuzz run` needs nightly, building it does not.
    # libfuzzer-sys compiles libFuzzer's C++ sources.
    ensure_gxx || return 1
    (cd fuzz && timeout -k 30 1800 cargo check --bins --locked 2>&1)
}

stage_benches() {
    ensure_protoc && timeout -k 30 1800 cargo bench --workspace --no-run --locked 2>&1 &&
        # Criterion's --test runs each benchmark once: the driver benches' set-up (a software
        # controller, and for the one-CPU placement the pinned threads) and their bounded
        # waits run on every CI run, not only when someone measures.
        timeout -k 30 300 cargo bench --locked -p tutti-benches --bench driver_overhead --bench command_build -- --test 2>&1
}

# TUTTI_REQUIRE_ETCD=1: a test that finds no etcd fails instead of skipping. Each test bounds
# its own waits; `timeout` bounds the whole stage should one hang regardless. tuttid's cluster
# tests are one file per theme (tools/tuttid/tests/cluster_*.rs): the glob runs them all, and
# cargo fails should it match none.
stage_cluster() {
    ensure_protoc && ensure_etcd || return 1
    TUTTI_REQUIRE_ETCD=1 timeout -k 30 900 cargo test --locked -p tutti-cluster --all-targets 2>&1 &&
        TUTTI_REQUIRE_ETCD=1 timeout -k 30 600 cargo test --locked -p tutti --test cluster 2>&1 &&
        timeout -k 30 600 cargo test --locked -p tutti-daemon --features cluster --lib cluster 2>&1 &&
        TUTTI_REQUIRE_ETCD=1 timeout -k 30 600 cargo test --locked -p tuttid --test 'cluster_*' 2>&1
}

# Two controllers: the suite runs on each, and the object-store round trip stripes one pool over
# both through one VFIO container (VfioDevice::open_many).
# The wheel build, the venv (first run: a few pip downloads) and the tests are bounded inside the
# script; `bounded` bounds the whole stage, inner steps included.
stage_python() { ensure_protoc && ensure_venv "${TUTTI_PYTHON:-python3}" && bounded 1500 tools/python/core-test.sh; }
# The engines' environments are large (vLLM's ~8 GB): built once per pin set, reused after.
stage_engines() { ensure_protoc && ensure_venv "${TUTTI_ENGINE_PYTHON:-python3}" && bounded 2700 tools/python/engine-test.sh; }

# Two guests of about 4 minutes each under TCG; a cold machine also installs QEMU, downloads the
# guest kernel and builds the static binaries first.
stage_vm() { ensure_protoc && TUTTI_VM_NVME_COUNT=${TUTTI_VM_NVME_COUNT:-2} bounded 2400 tools/vm-test.sh; }

for stage in $STAGES; do
    run_stage "$stage" "stage_$stage"
done

echo
echo "===== summary ====="
printf '%s\n' "${summary[@]}"
echo "stages: $passed passed, $failed failed"
if [ "$failed" -gt 0 ]; then
    echo "failed stages: ${failed_names[*]}"
    exit 1
fi
