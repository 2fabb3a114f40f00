#!/usr/bin/env bash
# shellcheck disable=SC2016 # (file-wide) the stand-ins' bodies are literal, expanded when they run
# tools/stage-scripts-test.sh — checks of the scripts tools/test.sh's python, engines and cuda
# stages run (tools/python/core-test.sh, tools/python/engine-test.sh, tools/gpu/check.sh), in
# seconds, with stand-ins: each script is copied into a scratch tree whose wheel builder,
# engine environments, nvcc, cargo and run-all.sh are stand-ins, so nothing is built, installed
# or measured (tools/test.sh's lint stage runs it; alone: `tools/stage-scripts-test.sh`, no root):
# 1. Ctrl-C (SIGINT to the script's process group, under setsid as at a terminal) while a step
#    under timeout runs (a process group of its own, which the terminal's SIGINT misses) stops
#    the step and ends the script with 130 within seconds, nothing of it left running: the
#    wheel build (inside a command substitution), the venv's python, the engine environment
#    (tools/lib/process.sh's interruptible_timeout); SIGTERM likewise with 143;
# 2. tools/gpu/check.sh with GPU_CHECK_REQUIRE_PREFILL=1 takes only the pythons it is given and
#    the pinned vLLM environment (engine-env.sh vllm --existing, which checks it is complete),
#    never any vllm-* directory under the cache: with only an unpinned one there, it fails
#    saying the prefill step was not rehearsed; without the requirement it may still use one;
# 3. tools/python/wheel.sh holds target/wheel.lock and its venv's lock only while it runs: a
#    process left running detached (an sccache server a RUSTC_WRAPPER starts) by its build
#    keeps neither, nor does one left by its check of a venv when it fails there;
# 4. tools/python/engine-env.sh holds its engine's lock only while it runs: a process the
#    environment's build (its pip installs) leaves running detached does not keep it.
set -uo pipefail
# What the scripts under test read from the environment, set by each check where it matters and
# otherwise unset: the caller's (tools/gpu/check.sh's docs have one export GPU_CHECK_PYTHON on a
# GPU machine) would change which pythons check.sh tries and break the checks below.
unset GPU_CHECK_PYTHON GPU_CHECK_PREFILL_PYTHON GPU_CHECK_REQUIRE_PREFILL TUTTI_PYTHON TUTTI_ENV_CACHE \
    ENGINE_TEST_LIST STAND_IN_HANG
HERE=$(dirname "$(readlink -f "$0")")
# shellcheck source=tools/lib/process.sh
. "$HERE/lib/process.sh"
# shellcheck source=tools/lib/sitting.sh
. "$HERE/lib/sitting.sh"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
failures=0
check() {
    local what=$1 expected=$2 got=$3
    if [ "$got" = "$expected" ]; then
        echo "stage-scripts-test: ok: $what" >&2
    else
        echo "stage-scripts-test: FAILED: $what: expected $expected, got $got" >&2
        failures=$((failures + 1))
    fi
}

# The scratch tree: the scripts under test and what they source, copied; everything they call,
# a stand-in. A stand-in that hangs (STAND_IN_HANG names it) runs `sleep 60` in its place.
repo=$WORK/repo
mkdir -p "$repo/tools/python" "$repo/tools/gpu" "$repo/tools/lib" "$repo/python/tests-engines" "$repo/target/wheels" \
    "$WORK/bin" "$repo/.tools/cuda-wheels-13.2.86/nvidia/cu13/bin" "$WORK/venv/bin"
cp "$HERE/python/core-test.sh" "$HERE/python/engine-test.sh" "$repo/tools/python/"
cp "$HERE/gpu/check.sh" "$repo/tools/gpu/"
cp "$HERE/lib/process.sh" "$repo/tools/lib/"
touch "$repo/python/requirements-test.txt" "$repo/python/tests-engines/test_vllm_stand_in.py" \
    "$repo/python/tests-engines/test_sglang_stand_in.py" "$repo/target/wheels/tutti-0.0.0-cp39-abi3-linux_x86_64.whl"
stand_in() { # NAME PATH BODY: a bash script at PATH running BODY, or sleep 60 if STAND_IN_HANG=NAME
    printf '#!/usr/bin/env bash\n[ "${STAND_IN_HANG:-}" != %s ] || exec sleep 60\n%s\n' "$1" "$3" > "$2"
    chmod +x "$2"
}
stand_in wheel "$repo/tools/python/wheel.sh" "echo $WORK/venv"
stand_in python "$WORK/venv/bin/python" 'exit 0'
stand_in python "$WORK/bin/python" 'exit 0'
stand_in cargo "$WORK/bin/cargo" 'exit 0'
# engine-env.sh: no pinned environment (--existing finds none).
stand_in engine-env "$repo/tools/python/engine-env.sh" 'exit 1'
# run-all.sh: every step passes; the prefill step's JSON holds one consistent row.
stand_in run-all "$repo/tools/gpu/run-all.sh" 'mkdir -p "$OUT" && echo "$1: PASS" > "$OUT/summary.txt"
echo "{\"results\": [{\"host_wait_ms\": 0, \"exposed_io_ms\": 1, \"tutti_ttft_ms\": 3, \"resident_ttft_ms\": 2}]}" > "$OUT/prefill-ttft.json"'
# nvcc: the "program" it writes answers --json-self-test with one case measured, one not.
stand_in nvcc "$repo/.tools/cuda-wheels-13.2.86/nvidia/cu13/bin/nvcc" \
    'while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
printf "#!/bin/sh\necho %s > \"\$2\"\n" "'"'"'{\"cases\": [{\"tflops\": 1.0}, {\"error\": \"x\", \"tflops\": null, \"slowdown_percent\": null}]}'"'"'" > "$out"
chmod +x "$out"'
printf 'import unittest\n\nclass StandIn(unittest.TestCase):\n    def test_nothing(self):\n        pass\n' > "$repo/tools/gpu/test_stand_in.py"

# sitting SCRIPT ERR ENV...: SCRIPT in the background as the leader of a session (and process
# group) of its own, as at a terminal; its pid, the session's id, in $sitting. SIGINT as at a
# terminal too: this shell starts background jobs with it ignored, and bash cannot trap a signal
# ignored when it starts.
sitting() {
    local script=$1 err=$2
    shift 2
    setsid env --default-signal=INT PATH="$WORK/bin:$PATH" "$@" "$script" > /dev/null 2> "$err" &
    sitting=$!
}
# hanging_step: waits (up to 10 s) until the stand-in's sleep runs in the sitting's session, and
# one second more.
hanging_step() {
    sitting_sleeps || :
    sleep 1
}

# 1. Interrupted steps.
interrupt() { # WHAT SIGNAL CODE SCRIPT ENV...: the script stopped by SIGNAL to its group while a step hangs
    local what=$1 signal=$2 code=$3
    shift 3
    sitting "$@"
    hanging_step
    kill -"$signal" -- "-$sitting"
    sitting_ends 10
    check "$what: SIG$signal (to its process group) in a hanging step: exit $code within 10 s (the step's stand-in sleeps 60 s)" "$code" "$ended"
    check "$what: SIG$signal: nothing left of it running" "" "$left"
}
interrupt "core-test.sh, the wheel build" INT 130 "$repo/tools/python/core-test.sh" "$WORK/core-wheel.err" STAND_IN_HANG=wheel
interrupt "core-test.sh, the fresh venv" INT 130 "$repo/tools/python/core-test.sh" "$WORK/core-venv.err" \
    STAND_IN_HANG=python TUTTI_PYTHON="$WORK/bin/python"
interrupt "core-test.sh, the fresh venv" TERM 143 "$repo/tools/python/core-test.sh" "$WORK/core-term.err" \
    STAND_IN_HANG=python TUTTI_PYTHON="$WORK/bin/python"
check "core-test.sh: the interrupt is said" 1 "$(grep -c 'interrupted (SIGINT)' "$WORK/core-venv.err")"
interrupt "engine-test.sh, the wheel build" INT 130 "$repo/tools/python/engine-test.sh" "$WORK/engine-wheel.err" STAND_IN_HANG=wheel
interrupt "engine-test.sh, the engine environment" INT 130 "$repo/tools/python/engine-test.sh" "$WORK/engine-env.err" \
    STAND_IN_HANG=engine-env
interrupt "gpu/check.sh, the vLLM environment" INT 130 "$repo/tools/gpu/check.sh" "$WORK/check-env.err" STAND_IN_HANG=engine-env

# 2. The prefill rehearsal's python, with only an unpinned environment in the cache.
cache=$WORK/cache
mkdir -p "$cache/engines/vllm-0.0.0-aaaaaaaaaaaa/bin"
stand_in none "$cache/engines/vllm-0.0.0-aaaaaaaaaaaa/bin/python" 'exit 0'
PATH="$WORK/bin:$PATH" TUTTI_ENV_CACHE=$cache GPU_CHECK_REQUIRE_PREFILL=1 "$repo/tools/gpu/check.sh" > "$WORK/required.out" 2>&1
check "gpu/check.sh GPU_CHECK_REQUIRE_PREFILL=1, only an unpinned vllm-* environment: exit 1" 1 "$?"
check "gpu/check.sh GPU_CHECK_REQUIRE_PREFILL=1: the failure says the prefill step was not rehearsed" 1 \
    "$(grep -c 'FAILED: prefill step not rehearsed' "$WORK/required.out")"
check "gpu/check.sh GPU_CHECK_REQUIRE_PREFILL=1: the unpinned environment not used" 0 \
    "$(grep -c 'prefill step rehearsed on the CPU with' "$WORK/required.out")"
PATH="$WORK/bin:$PATH" TUTTI_ENV_CACHE=$cache "$repo/tools/gpu/check.sh" > "$WORK/optional.out" 2>&1
check "gpu/check.sh without the requirement: a vllm-* environment of the cache still serves" "0 1" \
    "$? $(grep -c "prefill step rehearsed on the CPU with $cache/engines/vllm-0.0.0-aaaaaaaaaaaa/bin/python" "$WORK/optional.out")"

# 3. wheel.sh's lock, and a build that leaves a detached process (in a session of its own, as a
#    compiler cache's server): the stand-in maturin starts one, then writes the wheel. The venv
#    (under a HOME of the test's own) is the stand-ins' and passes wheel.sh's checks.
wheel_repo=$WORK/wheel-repo
mkdir -p "$wheel_repo/tools/python" "$wheel_repo/python" "$WORK/home"
cp "$HERE/python/wheel.sh" "$wheel_repo/tools/python/"
echo pytest==0.0.0 > "$wheel_repo/python/requirements-test.txt"
venv=$WORK/home/.cache/tutti/py-core-cpython-311-$(sha256sum "$wheel_repo/python/requirements-test.txt" | cut -c1-12)
mkdir -p "$venv/bin"
stand_in none "$WORK/bin/python-tag" 'echo cpython-311'
stand_in none "$venv/bin/python" 'exit 0'
stand_in none "$venv/bin/maturin" '[ "$1" != --version ] || exit 0
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
setsid sleep 60 < /dev/null > /dev/null 2>&1 &
echo $! > "'"$WORK/detached.pid"'"
mkdir -p "$out" && touch "$out/tutti-0.0.0-cp39-abi3-linux_x86_64.whl"'
HOME=$WORK/home TUTTI_PYTHON=$WORK/bin/python-tag "$wheel_repo/tools/python/wheel.sh" > "$WORK/wheel.out" 2>&1
check "wheel.sh with stand-ins: exit 0, the venv on its last line" "0 $venv" "$? $(tail -n 1 "$WORK/wheel.out")"
check "wheel.sh: target/wheel.lock free once it has exited, though its build left a detached process" free \
    "$(flock -n "$wheel_repo/target/wheel.lock" true && echo free || echo "held: $(cat "$WORK/wheel.out")")"
kill -KILL "$(cat "$WORK/detached.pid" 2> /dev/null)" 2> /dev/null
# The venv's lock: wheel.sh unlocks it (flock -u, which frees it for every copy of the fd) once
# the venv is ready, so only an exit while it holds it can leave it held: under another HOME, a
# venv whose check (its python, leaving a detached process) fails, and which the stand-in
# interpreter cannot make again (wheel.sh fails).
venv2=$WORK/home2/.cache/tutti/${venv#"$WORK/home/.cache/tutti/"}
mkdir -p "$venv2/bin"
stand_in none "$venv2/bin/python" 'setsid sleep 60 < /dev/null > /dev/null 2>&1 &
echo $! > "'"$WORK/detached-venv.pid"'"
exit 1'
wheel_status=0
HOME=$WORK/home2 TUTTI_PYTHON=$WORK/bin/python-tag "$wheel_repo/tools/python/wheel.sh" > "$WORK/wheel-venv.out" 2>&1 || wheel_status=$?
check "wheel.sh with a venv whose check fails and cannot be made: fails, its check having left a detached process" "failed yes" \
    "$([ "$wheel_status" != 0 ] && echo failed || echo passed) $([ -s "$WORK/detached-venv.pid" ] && echo yes || echo no)"
check "wheel.sh: its venv's lock free once it has exited, though its check left a detached process" free \
    "$(flock -n "$venv2.lock" true && echo free || echo held)"
kill -KILL "$(cat "$WORK/detached-venv.pid" 2> /dev/null)" 2> /dev/null

# 4. engine-env.sh's lock, and an environment's build that leaves a detached process. The
#    interpreter is a stand-in whose `-m venv DIR` makes an environment of stand-ins: its pip
#    installs (the first starts a detached sleep) mark it installed, and its python's checks
#    (-c) pass once it is.
env_repo=$WORK/env-repo
mkdir -p "$env_repo/tools/python" "$env_repo/tools/lib" "$env_repo/python/constraints"
cp "$HERE/python/engine-env.sh" "$env_repo/tools/python/"
cp "$HERE/lib/prune.sh" "$env_repo/tools/lib/"
echo pytest==0.0.0 > "$env_repo/python/requirements-test.txt"
: > "$env_repo/python/constraints/vllm.txt"
stand_in none "$WORK/env-python" 'dir=$(dirname "$0")/..
if [ "$1 ${2:-}" = "-m pip" ]; then
    if [ "${3:-}" = install ] && [ ! -e "$dir/installed" ]; then
        setsid sleep 60 < /dev/null > /dev/null 2>&1 &
        echo $! > "'"$WORK/detached-env.pid"'"
        touch "$dir/installed"
    fi
    exit 0
fi
[ "$1" = -c ] && [ -e "$dir/installed" ]'
stand_in none "$WORK/bin/python-env" 'case $1 in
-c) echo 3.11 ;;
-m) mkdir -p "$3/bin" && cp "'"$WORK/env-python"'" "$3/bin/python" ;;
esac'
TUTTI_ENV_CACHE=$WORK/env-cache TUTTI_ENGINE_PYTHON=$WORK/bin/python-env "$env_repo/tools/python/engine-env.sh" vllm > "$WORK/env.out" 2>&1
check "engine-env.sh with stand-ins: exit 0, an environment of the cache on its last line" "0 yes" \
    "$? $(case $(tail -n 1 "$WORK/env.out") in "$WORK/env-cache/engines/vllm-"*) echo yes ;; *) echo "no: $(cat "$WORK/env.out")" ;; esac)"
check "engine-env.sh: its build ran (and left a detached process)" yes "$([ -s "$WORK/detached-env.pid" ] && echo yes || echo no)"
check "engine-env.sh: its lock free once it has exited, though its build left a detached process" free \
    "$(flock -n "$WORK/env-cache/engines/.vllm.lock" true && echo free || echo held)"
kill -KILL "$(cat "$WORK/detached-env.pid" 2> /dev/null)" 2> /dev/null

if [ "$failures" -gt 0 ]; then
    echo "stage-scripts-test: $failures check(s) failed" >&2
    exit 1
fi
echo "stage-scripts-test: all checks passed" >&2
