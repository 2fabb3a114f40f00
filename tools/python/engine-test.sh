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
#    and runs that engine's tests with the environment's interpreter.
# Every step is bounded by `timeout`.
#
# usage: tools/python/engine-test.sh [vllm] [sglang]   (default: both)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
target_dir=$(realpath -m "${CARGO_TARGET_DIR:-target}") # cargo's, as cargo resolves it from here

engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(vllm sglang)
if [ ! -x tools/python/wheel.sh ] || [ ! -f python/requirements-test.txt ]; then
    echo "engine-test.sh: the python stage's wheel builder (tools/python/wheel.sh, python/requirements-test.txt) is missing" >&2
    exit 1
fi
timeout 1800 tools/python/wheel.sh > /dev/null
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# A copy taken under wheel.sh's lock: another build in this clone may replace the wheel while
# these tests run.
(
    flock -w 1800 8 || { echo "engine-test.sh: target/wheel.lock is still held after 30 minutes" >&2; exit 1; }
    cp target/wheels/tutti-*-abi3-*.whl "$scratch/"
) 8>target/wheel.lock
wheel=$(ls "$scratch"/tutti-*-abi3-*.whl)
timeout 1800 cargo build --locked -p tuttid --bin tuttid
export TUTTI_TUTTID="$target_dir/debug/tuttid"

for engine in "${engines[@]}"; do
    case $engine in
    vllm) tests=(python/tests-engines/test_vllm_connector.py python/tests-engines/test_vllm_tier.py) ;;
    sglang) tests=(python/tests-engines/test_sglang_backend.py) ;;
    *)
        echo "engine-test.sh: unknown engine '$engine' (known: vllm sglang)" >&2
        exit 2
        ;;
    esac
    env_dir=$(timeout 3600 tools/python/engine-env.sh "$engine" | tail -n 1)
    python="$env_dir/bin/python"
    # pytest comes with the environment (engine-env.sh installs it at the python stage's pin,
    # under its lock): nothing is installed into the shared environment here.
    site="$scratch/$engine-site"
    timeout 300 "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$site" "$wheel"
    # What the tests import is the wheel just installed, with the engine of the environment.
    (cd / && PYTHONPATH="$site" timeout 300 "$python" -c "
import sys, tutti, tutti.$engine
assert tutti.__file__.startswith('$site/'), tutti.__file__
print('engine-test.sh: $engine: tutti from', tutti.__file__, file=sys.stderr)
")
    echo "engine-test.sh: $engine tests in $env_dir" >&2
    PYTHONPATH="$site" timeout 2400 "$python" -m pytest -q -p no:cacheprovider "${tests[@]}"
done
