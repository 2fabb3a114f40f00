#!/usr/bin/env bash
# Creates (or reuses) the Python environment for one inference engine's tests and prints its
# directory on stdout.
#
#   tools/python/engine-env.sh vllm|sglang
#
# The environments are large (vLLM's is ~8 GB), so they live OUTSIDE the clone, under
# ${TUTTI_ENV_CACHE:-~/.cache/tutti}/engines/, in a folder named after the pinned versions and a
# hash of the whole pin list: every clone (a CI run's fresh one too) reuses one copy, and a change
# of pins builds a new folder instead of mutating the old one. Whether an environment is complete
# is decided by importing what the tests load (the engine's base classes, at the pinned version,
# and pytest at the python stage's pin) and by finding every file each installed distribution's
# RECORD lists, never by a stamp alone: a half-finished install (an interrupted pip, a full disk)
# is detected and finished on the next call (a venv whose pip does not run, e.g. one interrupted in ensurepip,
# is made again). Concurrent callers serialise on a lock file (waiting at most
# TUTTI_ENV_LOCK_WAIT_S, default 3000 s).
#
#   tools/python/engine-env.sh vllm|sglang --existing
#
# prints the directory only if the environment is complete, and exits 1 (building nothing)
# otherwise.
#
# Each pin change leaves the old environment behind; under the lock, this engine's other
# environments unused for TUTTI_ENV_PRUNE_DAYS days (default 14; 0 keeps them all) are removed
# (tools/lib/prune.sh: every call that prints an environment marks it used).
set -euo pipefail

engine="${1:-}"
existing=0
case "${2:-}" in
"") ;;
--existing) existing=1 ;;
*)
    echo "usage: $0 vllm|sglang [--existing]" >&2
    exit 2
    ;;
esac
python="${TUTTI_ENGINE_PYTHON:-python3}"
cache_root="${TUTTI_ENV_CACHE:-$HOME/.cache/tutti}/engines"

# Pins. The engine's own version is the one the connectors are tested with
# (python/tutti/vllm/__init__.py and python/tutti/sglang.py name the same versions in their
# version check).
case "$engine" in
vllm)
    version="0.32.0"
    # vLLM brings its full dependency set (torch with CUDA libraries included: no CPU-only torch
    # wheel exists for Linux on the registry, and the CUDA build imports on a CPU machine).
    pins=("vllm==$version")
    no_deps=()
    check="import vllm, torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
assert vllm.__version__ == '$version', vllm.__version__"
    ;;
sglang)
    version="0.5.23"
    # SGLang's full dependency set is its GPU serving stack (flashinfer, deep-gemm, ...); its
    # HiCache storage interface and MHA host memory pool need torch and the small packages below
    # (found by importing `sglang.srt.mem_cache.hicache_storage` and
    # `sglang.srt.mem_cache.pool_host.mha` until nothing was missing). So SGLang is installed
    # without dependencies and these are pinned here: torch, transformers, tokenizers,
    # sentencepiece, compressed-tensors and apache-tvm-ffi at SGLang 0.5.23's own pins, the
    # others at the versions that resolved on 2026-11-24.
    pins=(
        torch==2.14.1 torchvision==0.29.1 numpy==2.4.6 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1
        requests==2.34.2 packaging==26.3 pillow==13.0.0 starlette==1.10.0 msgspec==0.22.0
        pydantic==2.14.3 pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1 aiohttp==3.14.5 dill==0.4.1
        transformers==5.19.0 tokenizers==0.23.2 sentencepiece==0.2.1 compressed-tensors==0.18.0
        apache-tvm-ffi==0.1.11 gguf==0.19.0
    )
    no_deps=("sglang==$version")
    check="import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.version import __version__
assert __version__ == '$version', __version__
assert torch.__version__.startswith('2.14.1'), torch.__version__"
    ;;
*)
    echo "usage: $0 vllm|sglang [--existing]" >&2
    exit 2
    ;;
esac

# The test runner, at the python stage's pin (python/requirements-test.txt), is installed here,
# under the lock, like the pins: engine-test.sh runs it with the environment's interpreter and
# never installs into the shared environment itself. The constraints below pin pytest too (their
# hash is in the environment's key), so the two must agree: pip fails loudly if they do not.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=tools/lib/prune.sh
. "$repo/tools/lib/prune.sh"
# The pin's line without a trailing comment, spaces or a CR (`pytest==9.2.0  # runner`).
test_pin="$(sed -n 's/\r$//; s/[[:space:]]*#.*$//; s/[[:space:]]*$//; /^pytest==/{p;q}' "$repo/python/requirements-test.txt")"
[[ "$test_pin" =~ ^pytest==[0-9A-Za-z.+!-]+$ ]] || {
    echo "engine-env: no pytest==VERSION pin in $repo/python/requirements-test.txt (found '$test_pin')" >&2
    exit 1
}
check="$check
import pytest
assert 'pytest==' + pytest.__version__ == '$test_pin', pytest.__version__"

# Every package the environment holds, the engine's dependencies and pip included, is held at
# the version in python/constraints/$engine.txt (pip's -c): the pins above name what the tests
# need, the constraints keep what those leave open from moving with each release. The file's
# hash is part of the environment's name, so a change of it builds a new one.
constraints="$repo/python/constraints/$engine.txt"
[[ -f "$constraints" ]] || {
    echo "engine-env: $constraints is missing" >&2
    exit 1
}
constraints_hash="$(sha256sum "$constraints" | cut -c1-12)"
key_text="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])') ${pins[*]} --no-deps ${no_deps[*]} -c $engine.txt@$constraints_hash"
key_hash="$(printf '%s' "$key_text" | sha256sum | cut -c1-12)"
env_dir="$cache_root/$engine-$version-$key_hash"

# Every file that the RECORD of every distribution installed in the environment lists is there
# (a pip interrupted while unpacking leaves a distribution whose modules import but whose other
# files are missing; ~85,000 files for vLLM's, about a second). Each incomplete distribution is
# printed as NAME==VERSION on stdout (what it misses on stderr), and the status is 1 if any.
records_whole='
import importlib.metadata as metadata, os, sys
bad = 0
for dist in metadata.distributions():
    name, files = dist.metadata["Name"], dist.files
    missing = "has no RECORD" if files is None else next(("is missing %s" % f for f in files if not os.path.exists(f.locate())), None)
    if missing is not None:
        bad = 1
        print("%s==%s" % (name, dist.version))
        print("engine-env: %s %s %s" % (name, dist.version, missing), file=sys.stderr)
sys.exit(bad)
'
records_ok() { "$env_dir/bin/python" -c "$records_whole" >/dev/null 2>&1; }
complete() {
    [[ -x "$env_dir/bin/python" ]] && "$env_dir/bin/python" -c "$check" >/dev/null 2>&1 && records_ok
}
pip_runs() { [[ -x "$env_dir/bin/python" ]] && "$env_dir/bin/python" -m pip --version >/dev/null 2>&1; }

# An environment whose distributions miss files: `pip install NAME==VERSION` would find each
# "already satisfied" and put nothing back, so each is reinstalled from scratch (--force-reinstall
# --no-deps, at the version installed); if files are still missing after that (a distribution
# without a RECORD cannot even be uninstalled), the environment, a cache, is removed and built
# again from nothing.
repair_records() {
    local incomplete
    pip_runs || return 0
    incomplete="$("$env_dir/bin/python" -c "$records_whole" 2>/dev/null)" && return 0
    if [[ -n "$incomplete" ]]; then
        echo "engine-env: reinstalling distributions whose files are missing: $(echo $incomplete)" >&2
        # shellcheck disable=SC2086 # one NAME==VERSION a word
        "$env_dir/bin/python" -m pip install --quiet --force-reinstall --no-deps $incomplete >&2 || true
    fi
    records_ok && return 0
    "$env_dir/bin/python" -c "$records_whole" >/dev/null || true
    echo "engine-env: files are still missing: removing $env_dir to build it again from nothing" >&2
    rm -rf "$env_dir"
}

# Marks the environment used and, under the lock, removes this engine's long-unused others.
ready() {
    mark_used "$env_dir"
    if ((!existing)); then
        prune_unused "$cache_root" "$engine-[0-9][0-9A-Za-z.+]*-[0-9a-f]{12}" "${env_dir##*/}" "${TUTTI_ENV_PRUNE_DAYS:-14}"
    fi
    echo "$env_dir"
    exit 0
}

if ((existing)); then
    if complete; then
        ready
    fi
    echo "engine-env: no complete $engine environment at $env_dir" >&2
    exit 1
fi

# The lock (fd 9) is closed for every command run while it is held (`9>&-` on the functions
# and checks below; the shell itself keeps it): a flock belongs to the open file, which a child
# inherits with the fd, so a process a pip build leaves running detached (a compiler cache's
# server started by a source build) would hold this engine's lock for as long as it runs, and
# every later engine-env.sh of the machine would wait TUTTI_ENV_LOCK_WAIT_S for it and fail.
# (ready prunes under the lock and starts nothing that outlives it.)
mkdir -p "$cache_root"
exec 9>"$cache_root/.$engine.lock"
lock_wait_s=${TUTTI_ENV_LOCK_WAIT_S:-3000}
flock -w "$lock_wait_s" 9 || {
    echo "engine-env: $cache_root/.$engine.lock is still held by another build after $lock_wait_s s" >&2
    exit 1
}

if complete 9>&-; then
    ready
fi

echo "engine-env: building $env_dir ($key_text)" >&2
# What an earlier build installed is kept (vLLM's is gigabytes), its incomplete distributions
# reinstalled (repair_records), unless the venv itself is broken: `python -m venv` writes
# bin/python before ensurepip installs pip, so an interrupted creation leaves a python without
# pip, which no rerun could repair.
repair_records 9>&-
if complete 9>&-; then
    ready
fi
# pip at the constraints' version: upgraded only when it is not (asking the index on every
# rebuild would need the network for nothing).
pip_pin="$(sed -n 's/[[:space:]]*#.*$//; s/[[:space:]]*$//; /^pip==/{p;q}' "$constraints")"
build_env() {
    if ! pip_runs; then
        rm -rf "$env_dir"
        "$python" -m venv "$env_dir"
    fi
    if [[ -z "$pip_pin" || "pip==$("$env_dir/bin/python" -c 'import pip; print(pip.__version__)')" != "$pip_pin" ]]; then
        "$env_dir/bin/python" -m pip install --quiet -c "$constraints" --upgrade pip >&2
    fi
    if ((${#pins[@]})); then
        "$env_dir/bin/python" -m pip install --quiet -c "$constraints" "${pins[@]}" >&2
    fi
    if ((${#no_deps[@]})); then
        "$env_dir/bin/python" -m pip install --quiet -c "$constraints" --no-deps "${no_deps[@]}" >&2
    fi
    "$env_dir/bin/python" -m pip install --quiet -c "$constraints" "$test_pin" >&2
    printf '%s\n' "$key_text" >"$env_dir/tutti-env-pins.txt"
}
build_env 9>&-
# Files a distribution lists missing right after the install (a RECORD pip wrote wrong, a full
# disk): reinstalled, and if that does not do, the environment built once more from nothing.
repair_records 9>&-
[[ -d "$env_dir" ]] || build_env 9>&-

if ! "$env_dir/bin/python" -c "$check" >&2 9>&-; then
    echo "engine-env: $env_dir was installed but does not load what the tests need (see above)" >&2
    exit 1
fi
if ! "$env_dir/bin/python" -c "$records_whole" >&2 9>&-; then
    echo "engine-env: $env_dir was installed but files its distributions list are missing (see above)" >&2
    exit 1
fi
ready
