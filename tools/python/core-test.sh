#!/usr/bin/env bash
# The python stage of tools/test.sh: builds and installs the tutti wheel (tools/python/wheel.sh),
# checks that it installs into a fresh venv and imports there (the issue's "pip install of the
# built wheel gives a working import tutti"), builds tuttid for the tests' daemons, and runs the
# core tests (python/tests) against the installed wheel. Each step is bounded by `timeout`
# (tools/test.sh bounds the whole script, and kills what an expired limit leaves running),
# through interruptible_timeout (tools/lib/process.sh): run alone, Ctrl-C stops the step and the
# script (130), which a bare `timeout` (a process group of its own) would not let it reach.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
# shellcheck source=tools/lib/process.sh
. tools/lib/process.sh
target_dir=$(realpath -m "${CARGO_TARGET_DIR:-target}") # cargo's, as cargo resolves it from here

venv=$(interruptible_timeout 1800 tools/python/wheel.sh | tail -n 1)
fresh=$(mktemp -d)
trap 'rm -rf "$fresh"' EXIT
# A copy taken under wheel.sh's lock (another build in this clone may replace the wheel).
(
    flock -w 1800 8 || { echo "core-test.sh: target/wheel.lock is still held after 30 minutes" >&2; exit 1; }
    cp target/wheels/tutti-*-abi3-*.whl "$fresh/"
) 8>target/wheel.lock
wheel=$(ls "$fresh"/tutti-*-abi3-*.whl)
interruptible_timeout 300 "${TUTTI_PYTHON:-python3}" -m venv "$fresh/venv"
# No index: the wheel has no dependencies, so nothing but the wheel itself is needed.
interruptible_timeout 300 "$fresh/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index "$wheel"
(cd / && interruptible_timeout 60 "$fresh/venv/bin/python" -c "
import tutti
geometry = tutti.ModelGeometry(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2, block_tokens=16)
with tutti.Store.open('emu:mem:16m', geometry, format=True) as store:
    store.allocate_kv(4, 'paged')
    assert store.lookup(list(range(64))) == 0
print('core-test.sh: import tutti in a fresh venv: ok (', tutti.__file__, ')')
")

interruptible_timeout 1800 cargo build --locked -p tuttid --bin tuttid
export TUTTI_TUTTID="$target_dir/debug/tuttid"
# The wheel just built, installed into a site of this run's own (target/python-site is
# reinstalled by any later wheel.sh of this clone, under the tests' child processes that import
# from it), with the venv's pytest.
interruptible_timeout 300 "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$fresh/site" "$wheel"
PYTHONPATH="$fresh/site" interruptible_timeout 1200 "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests
# The benchmark tables' own checks (tools/compare-lmcache.sh's verdicts on what a run measured).
interruptible_timeout 120 "$venv/bin/python" -m pytest -q -p no:cacheprovider tools/python/bench
