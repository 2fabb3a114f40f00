#!/usr/bin/env bash
# The engines stage of tools/test.sh: the vLLM connector and tier and the SGLang backend against
# the pinned engines' real classes (python/tests-engines, pytest).
#
# 1. builds the tutti wheel with the python stage's builder (tools/python/wheel.sh: maturin,
#    abi3, into target/wheels);
# 2. builds tuttid (the tests start their own daemons on emu: devices and stop them);
# 3. per engine, creates or reuses its environment under ~/.cache/tutti (tools/python/engine-env.sh:
#    keyed by the pins, checked by importing the engine's base classes and pytest, which it installs
#    at the python stage's pin under its lock), installs the wheel into a
#    per-run directory on PYTHONPATH (the shared environment is never given this clone's tutti),
#    and runs that engine's tests (python/tests-engines/test_ENGINE_*.py: every file named after
#    it; a test_*.py named after neither engine fails the stage) with the environment's
#    interpreter.
# Every step is bounded by `timeout`, through interruptible_timeout (tools/lib/process.sh): run
# alone, Ctrl-C stops the step and the script (130), which a bare `timeout` (a process group of
# its own) would not let it reach.
#
# usage: tools/python/engine-test.sh [vllm] [sglang]   (default: both)
#        ENGINE_TEST_LIST=1 tools/python/engine-test.sh   (prints the files each engine would run)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
# shellcheck source=tools/lib/process.sh
. tools/lib/process.sh
target_dir=$(realpath -m "${CARGO_TARGET_DIR:-target}") # cargo's, as cargo resolves it from here

engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(vllm sglang)
for engine in "${engines[@]}"; do
    case $engine in
    vllm | sglang) ;;
    *)
        echo "engine-test.sh: unknown engine '$engine' (known: vllm sglang)" >&2
        exit 2
        ;;
    esac
done
# Each engine's tests are its files by name (test_vllm_*.py, test_sglang_*.py), not a list kept
# here: a listed set missed test_vllm_sessions.py, which CI then never ran. A test file that is
# neither engine's would be run by no one: it fails the stage at once, before any build.
shopt -s nullglob
unowned=()
for file in python/tests-engines/test_*.py; do
    case ${file##*/} in
    test_vllm_*.py | test_sglang_*.py) ;;
    *) unowned+=("$file") ;;
    esac
done
if [ ${#unowned[@]} -gt 0 ]; then
    echo "engine-test.sh: ${unowned[*]}: neither test_vllm_*.py nor test_sglang_*.py, so no engine's run would include it: rename it after its engine" >&2
    exit 1
fi
for engine in "${engines[@]}"; do
    tests=(python/tests-engines/test_"$engine"_*.py)
    if [ ${#tests[@]} -eq 0 ]; then
        echo "engine-test.sh: no python/tests-engines/test_${engine}_*.py: $engine's tests are gone" >&2
        exit 1
    fi
    # ENGINE_TEST_LIST=1: each engine's test files printed, nothing built or run.
    [ "${ENGINE_TEST_LIST:-0}" != 1 ] || echo "$engine: ${tests[*]}"
done
shopt -u nullglob # (a wheel glob below that matched nothing would make `ls` list the directory)
[ "${ENGINE_TEST_LIST:-0}" != 1 ] || exit 0
if [ ! -x tools/python/wheel.sh ] || [ ! -f python/requirements-test.txt ]; then
    echo "engine-test.sh: the python stage's wheel builder (tools/python/wheel.sh, python/requirements-test.txt) is missing" >&2
    exit 1
fi
interruptible_timeout 1800 tools/python/wheel.sh > /dev/null
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# A copy taken under wheel.sh's lock: another build in this clone may replace the wheel while
# these tests run.
(
    flock -w 1800 8 || { echo "engine-test.sh: target/wheel.lock is still held after 30 minutes" >&2; exit 1; }
    cp target/wheels/tutti-*-abi3-*.whl "$scratch/"
) 8>target/wheel.lock
wheel=$(ls "$scratch"/tutti-*-abi3-*.whl)
interruptible_timeout 1800 cargo build --locked -p tuttid --bin tuttid
export TUTTI_TUTTID="$target_dir/debug/tuttid"

for engine in "${engines[@]}"; do
    tests=(python/tests-engines/test_"$engine"_*.py)
    env_dir=$(interruptible_timeout 3600 tools/python/engine-env.sh "$engine" | tail -n 1)
    python="$env_dir/bin/python"
    # pytest comes with the environment (engine-env.sh installs it at the python stage's pin,
    # under its lock): nothing is installed into the shared environment here.
    site="$scratch/$engine-site"
    interruptible_timeout 300 "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$site" "$wheel"
    # What the tests import is the wheel just installed, with the engine of the environment.
    (cd / && PYTHONPATH="$site" interruptible_timeout 300 "$python" -c "
import sys, tutti, tutti.$engine
assert tutti.__file__.startswith('$site/'), tutti.__file__
print('engine-test.sh: $engine: tutti from', tutti.__file__, file=sys.stderr)
")
    echo "engine-test.sh: $engine tests in $env_dir" >&2
    PYTHONPATH="$site" interruptible_timeout 2400 "$python" -m pytest -q -p no:cacheprovider "${tests[@]}"
done
