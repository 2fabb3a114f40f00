#!/usr/bin/env bash
# Builds the tutti wheel (abi3, `maturin build --release`) into target/wheels and installs it
# into the python stage's venv, which it creates or reuses: ~/.cache/tutti/py-core-KEY, KEY = the
# hash of python/requirements-test.txt (the pins), so a change of pins makes a new venv and a
# rerun reuses the old one. Idempotent; the venv is checked by what it imports, not by a stamp.
#
# usage: tools/python/wheel.sh   (prints the venv's path on its last line)
# Environment: TUTTI_PYTHON (the interpreter the venv is made from; default python3).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."

requirements=python/requirements-test.txt
key=$(sha256sum "$requirements" | cut -c1-12)
venv="${HOME}/.cache/tutti/py-core-${key}"
python=${TUTTI_PYTHON:-python3}

# The pins, as NAME==VERSION lines.
pins=$(grep -E '^[A-Za-z0-9_.-]+==' "$requirements")

venv_ok() {
    [ -x "$venv/bin/python" ] || return 1
    "$venv/bin/python" - "$pins" <<'PY' || return 1
import importlib.metadata as metadata, sys
for line in sys.argv[1].split():
    name, version = line.split("==")
    if metadata.version(name) != version:
        sys.exit(f"{name} {metadata.version(name)} installed, {version} pinned")
import numpy, pytest  # what the tests import
PY
    "$venv/bin/maturin" --version >/dev/null
}

if ! venv_ok 2>/dev/null; then
    echo "wheel.sh: creating $venv" >&2
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
    venv_ok || { echo "wheel.sh: the venv at $venv does not import what it should" >&2; exit 1; }
fi

rm -f target/wheels/tutti-*.whl
(cd python && "$venv/bin/maturin" build --release --locked --quiet -o ../target/wheels) >&2
wheel=$(ls target/wheels/tutti-*-abi3-*.whl)
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheel" >&2
# What the venv imports is the wheel just built (not the source tree's python/tutti).
(cd / && "$venv/bin/python" -c "
import tutti, tutti._tutti, sys
assert '/site-packages/tutti/' in tutti.__file__, tutti.__file__
print('wheel.sh: tutti', tutti.__version__, 'from', tutti._tutti.__file__, file=sys.stderr)
")
echo "$venv"
