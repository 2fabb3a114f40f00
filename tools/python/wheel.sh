#!/usr/bin/env bash
# Builds the tutti wheel (abi3, `maturin build --release`) into target/wheels, creates or reuses
# the python stage's venv (the pinned test tools: ~/.cache/tutti/py-core-TAG-KEY, TAG = the
# interpreter's sys.implementation.cache_tag, e.g. cpython-311, KEY = the hash of
# python/requirements-test.txt, so a change of pins or of TUTTI_PYTHON's version makes a new venv
# and a rerun reuses the old one), and installs the wheel into this clone's target/python-site, never into the venv: the
# venv is shared by every clone on the machine, and one clone's wheel there would be what another
# clone's tests import. Run the tests with PYTHONPATH=target/python-site and the venv's python.
# Idempotent; the venv is checked by what it imports (and by its pip), not by a stamp, and is made
# under a lock, so concurrent clones neither build it twice nor use it half made.
#
# usage: tools/python/wheel.sh   (prints the venv's path on its last line)
# Environment: TUTTI_PYTHON (the interpreter the venv is made from; default python3).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."

requirements=python/requirements-test.txt
python=${TUTTI_PYTHON:-python3}
# The interpreter is part of the key: keyed by the pins alone, a venv made from another python
# (another TUTTI_PYTHON, an upgraded python3) passed venv_ok and was used instead of one of this
# interpreter.
tag=$("$python" -c 'import sys; print(sys.implementation.cache_tag)') ||
    { echo "wheel.sh: $python (TUTTI_PYTHON, default python3) did not run" >&2; exit 1; }
[[ "$tag" =~ ^[A-Za-z0-9_.-]+$ ]] ||
    { echo "wheel.sh: $python gave '$tag' as its sys.implementation.cache_tag; expected e.g. cpython-311" >&2; exit 1; }
key=$(sha256sum "$requirements" | cut -c1-12)
venv="${HOME}/.cache/tutti/py-core-${tag}-${key}"
site="$PWD/target/python-site"

# The pins, as NAME==VERSION lines.
pins=$(grep -E '^[A-Za-z0-9_.-]+==' "$requirements")

# Every check ends in `|| return 1`: venv_ok is called under `if !` and `||`, where set -e is off
# and only a function's last status would count (a venv without bin/maturin passed).
venv_ok() {
    [ -x "$venv/bin/python" ] || return 1
    # The pins at their versions, what the tests import, and every file each installed
    # distribution's RECORD lists (as engine-env.sh checks its environments: a pip interrupted
    # while unpacking leaves modules that import beside files that are missing).
    "$venv/bin/python" - "$pins" <<'PY' || return 1
import importlib.metadata as metadata, os, sys
for line in sys.argv[1].split():
    name, version = line.split("==")
    if metadata.version(name) != version:
        sys.exit(f"{name} {metadata.version(name)} installed, {version} pinned")
for dist in metadata.distributions():
    files = dist.files
    if files is None:
        sys.exit(f"{dist.metadata['Name']} {dist.version} has no RECORD")
    for file in files:
        if not os.path.exists(file.locate()):
            sys.exit(f"{dist.metadata['Name']} {dist.version} is missing {file}")
import numpy, pytest  # what the tests import
PY
    "$venv/bin/maturin" --version >/dev/null || return 1
    # `python -m venv` writes bin/python before ensurepip installs pip: a venv whose creation was
    # interrupted has a python and no pip.
    "$venv/bin/python" -m pip --version >/dev/null || return 1
}

# The locks (fd 9 here, fd 8 below) are closed for every command run while they are held
# (`9>&-`, `8>&-`): a flock belongs to the open file, which a child inherits with the fd, so a
# child that outlives this script (a compiler cache's server that maturin's cargo starts
# detached, sccache through RUSTC_WRAPPER) would hold the lock for as long as it runs, and
# every later wheel.sh, core-test.sh and engine-test.sh of this clone would wait 30 minutes for
# it and fail.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock -w 1200 9 || { echo "wheel.sh: $venv.lock is still held by another run after 20 minutes" >&2; exit 1; }
if ! venv_ok 2>/dev/null 9>&-; then
    echo "wheel.sh: creating $venv" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv" 9>&-
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements" 9>&-
    venv_ok 9>&- || { echo "wheel.sh: the venv at $venv does not import what it should" >&2; exit 1; }
fi
flock -u 9
exec 9>&-

# One build at a time in this clone: a second run's `rm` and maturin's write of the same wheel
# name would leave each a broken or missing wheel (two test runs of one clone at once). Held
# until the site is installed and checked; engine-test.sh copies the wheel under it too.
mkdir -p target
exec 8>target/wheel.lock
flock -w 1800 8 || { echo "wheel.sh: target/wheel.lock is still held by another build after 30 minutes" >&2; exit 1; }
rm -f target/wheels/tutti-*.whl
(cd python && "$venv/bin/maturin" build --release --locked --quiet -o ../target/wheels) >&2 8>&-
wheel=$(ls target/wheels/tutti-*-abi3-*.whl)
rm -rf "$site"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$site" "$wheel" >&2 8>&-
# What the venv imports with the site first on its path is the wheel just built (not the source
# tree's python/tutti, nor a tutti an older wheel.sh installed into the venv itself).
(cd / && PYTHONPATH="$site" "$venv/bin/python" -c "
import tutti, tutti._tutti, sys
assert tutti.__file__.startswith('$site/'), tutti.__file__
print('wheel.sh: tutti', tutti.__version__, 'from', tutti._tutti.__file__, file=sys.stderr)
") 8>&-
echo "$venv"
