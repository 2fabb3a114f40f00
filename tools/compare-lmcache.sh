#!/usr/bin/env bash
# tutti's KV path against LMCache's local disk tier, same KV, same filesystem (issue 16 item 4).
# A benchmark, not a test (tools/test.sh does not run it). Goal: tutti >= 1.0x LMCache on store
# and on retrieve.
#
#   tools/compare-lmcache.sh            # 6 rounds
#   COMPARE_ROUNDS=2 tools/compare-lmcache.sh
#
# Each round runs, in an order that alternates from round to round:
#   lmcache  tools/python/bench/lmcache_disk.py: LMCache 0.5.6's own engine (LMCacheEngine's
#            store/retrieve, its local disk backend with O_DIRECT, 256-token chunks, its CPU tier
#            off) storing and retrieving a 4096-token Llama-3.1-8B prompt's KV (512 MiB) held in
#            CPU tensors shaped like vLLM's paged KV; only the GPU connector is ours (CPU
#            copies). Page cache dropped before the retrieve; the retrieve must read the bytes
#            from the block layer and every byte is compared.
#   tutti    tutti-bench with no workload arguments (the default KV run: the same prompt stored
#            and retrieved layer by layer through the software NVMe controller over a pool file,
#            every byte compared), its pool file in the same directory, JSON output.
# Then prints per-round and median GB/s, ratios tutti/LMCache, load averages and versions
# (definitions in the output and in docs/tutti-bench.md, "Comparison with LMCache's disk tier").
#
# LMCache lives outside the clone: the engines environment of tools/python/engine-env.sh vllm
# (its torch, numpy and the rest of LMCache's imports) plus LMCache's wheel and the three small
# packages that environment lacks, installed with `pip --target` into
# ${TUTTI_ENV_CACHE:-~/.cache/tutti}/lmcache-0.5.6/site. Whether it is there is decided by
# importing what the driver uses at the pinned version, never by a stamp.
#
# Environment (all optional):
#   COMPARE_ROUNDS      rounds; medians reported                      (default 6)
#   COMPARE_DIRECTORY   filesystem both tools write to                (default /var/tmp)
#   COMPARE_BENCH       tutti-bench binary                 (default: built every run with cargo
#                       --release --locked, the binary cargo reports, wherever CARGO_TARGET_DIR
#                       or cargo's build.target-dir put it; its path is printed with the table)
#   COMPARE_STRACE      1: one more round of each tool under `strace -f -C` (syscall summary
#                       and the read/write calls of >= 1 MiB; not part of the figures)
#   COMPARE_OUT         keep the per-round JSON reports in this directory
#   COMPARE_LMCACHE_SITE  LMCache's site directory          (default: under the cache, above);
#                       a directory there that this script did not install (no marker file
#                       .tutti-compare-lmcache in it) is never replaced: refused when LMCache
#                       does not import from it
#   COMPARE_PYTHON      the Python to run LMCache with, instead of the vLLM engines environment
#                       (tools/bench-scripts-test.sh uses it)
#   COMPARE_LOCK_WAIT_S seconds to wait for another run installing into the site (default 1800)
#   COMPARE_ROUND_TIMEOUT_S  seconds one tool's round (or strace round) may take before it is
#                       stopped (TERM, KILL 30 s later) and the run fails (default 900; a round
#                       takes seconds: LMCache's store and retrieve calls and its disk workers
#                       have no bound of their own)
#
# Exit status: 0 done; 2 LMCache missing and not installable, a tool failing, or a check failing
# (the reason on stderr); 130 (143, 129) interrupted by SIGINT, Ctrl-C (SIGTERM; SIGHUP, a
# dropped SSH session or closed terminal): the running round is stopped first.
set -euo pipefail

ROUNDS=${COMPARE_ROUNDS:-6}
DIRECTORY=${COMPARE_DIRECTORY:-/var/tmp}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BENCH=${COMPARE_BENCH:-}
LMCACHE_VERSION=0.5.6
LMCACHE_ROOT=${TUTTI_ENV_CACHE:-$HOME/.cache/tutti}/lmcache-$LMCACHE_VERSION
SITE=${COMPARE_LMCACHE_SITE:-$LMCACHE_ROOT/site}
# Written into the site after an install: only a directory holding it is this script's to replace.
SITE_MARKER=.tutti-compare-lmcache
LOCK_WAIT_S=${COMPARE_LOCK_WAIT_S:-1800}
ROUND_TIMEOUT_S=${COMPARE_ROUND_TIMEOUT_S:-900}
# LMCache's wheel and what the vLLM environment lacks of its imports (found by importing
# lmcache.v1.cache_engine until nothing was missing), at the versions that resolved 2026-11-24.
PINS=("lmcache==$LMCACHE_VERSION" aiofile==3.12.3 caio==0.12.10 sortedcontainers==2.4.0)
DRIVER=$ROOT/tools/python/bench/lmcache_disk.py
TABLE=$ROOT/tools/python/bench/lmcache_table.py
LMCACHE_DIRECTORY=$DIRECTORY/tutti-compare-lmcache

say() { printf '%s\n' "$*" >&2; }
die() { say "compare-lmcache: $*"; exit 2; }

[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "COMPARE_ROUNDS must be a positive integer, not '$ROUNDS'"
[[ $LOCK_WAIT_S =~ ^[0-9]+$ ]] || die "COMPARE_LOCK_WAIT_S must be a whole number of seconds, not '$LOCK_WAIT_S'"
[[ $ROUND_TIMEOUT_S =~ ^[1-9][0-9]*$ ]] || die "COMPARE_ROUND_TIMEOUT_S must be a positive whole number of seconds, not '$ROUND_TIMEOUT_S'"
[[ -d $DIRECTORY && -w $DIRECTORY ]] || die "COMPARE_DIRECTORY $DIRECTORY is not a writable directory"
[[ -w /proc/sys/vm/drop_caches ]] || say "compare-lmcache: /proc/sys/vm/drop_caches is not writable: the driver falls back to posix_fadvise(DONTNEED) per file"

WORK=$(mktemp -d)
cleanup() { rm -rf "$WORK" "$LMCACHE_DIRECTORY"; }
trap cleanup EXIT
# LMCache's metrics directory (it defaults to /tmp/lmcache_prometheus and leaves it behind).
export PROMETHEUS_MULTIPROC_DIR=$WORK/prometheus

# --- LMCache's Python environment (idempotent) -------------------------------------------------
if [[ -n ${COMPARE_PYTHON:-} ]]; then
    PYTHON=$COMPARE_PYTHON
else
    env_dir=$("$ROOT/tools/python/engine-env.sh" vllm) || die "the vLLM engines environment (tools/python/engine-env.sh vllm) could not be installed"
    PYTHON=$env_dir/bin/python
fi
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
CHECK="import lmcache, numpy, torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
assert lmcache.__version__ == '$LMCACHE_VERSION', lmcache.__version__"
lmcache_loads() { PYTHONPATH=$SITE "$PYTHON" -c "$CHECK" >"$WORK/check.log" 2>&1; }

mkdir -p "$(dirname "$SITE")"
exec 9>"$SITE.lock"
# Another run may be installing (pip, minutes): waited for, within a bound.
flock -w "$LOCK_WAIT_S" 9 || die "$SITE.lock is still held after ${LOCK_WAIT_S}s (another compare-lmcache run installing LMCache?); COMPARE_LOCK_WAIT_S sets the wait"
if ! lmcache_loads; then
    # The site is replaced only if this script installed it (its marker inside): anything else
    # at that path, a user's site-packages say, is never deleted.
    if [[ -e $SITE || -L $SITE ]] && { [[ -L $SITE ]] || [[ ! -f $SITE/$SITE_MARKER ]]; }; then
        die "LMCache $LMCACHE_VERSION does not import from $SITE, which this script did not install (no $SITE_MARKER in it): not replacing it; remove it or point COMPARE_LMCACHE_SITE elsewhere ($(tail -n 1 "$WORK/check.log"))"
    fi
    say "compare-lmcache: installing LMCache $LMCACHE_VERSION into $SITE"
    rm -rf "$SITE.partial"
    "$PYTHON" -m pip install --quiet --no-deps --target "$SITE.partial" "${PINS[@]}" >&2 \
        || { rm -rf "$SITE.partial"; die "LMCache $LMCACHE_VERSION is not installed and pip could not install ${PINS[*]} (see above)"; }
    rm -rf "$SITE"
    mv "$SITE.partial" "$SITE"
    echo "installed by tools/compare-lmcache.sh: replaced when LMCache does not import from it" > "$SITE/$SITE_MARKER"
    lmcache_loads || die "LMCache was installed into $SITE but does not import: $(tail -n 3 "$WORK/check.log")"
fi
flock -u 9

# --- tutti-bench ---------------------------------------------------------------------------------
# Built every run unless COMPARE_BENCH names a binary (cargo is incremental: seconds when nothing
# changed), so a binary left by an older checkout is never what gets measured. The path is the
# one cargo reports for the build (CARGO_TARGET_DIR and build.target-dir move it; a fixed
# target/release/ could name a stale binary). rustc's diagnostics go to stderr, rendered, not into the JSON.
if [[ -z $BENCH ]]; then
    say "compare-lmcache: building tutti-bench (release)"
    (cd "$ROOT" && cargo build --release --locked --bin tutti-bench --message-format=json-render-diagnostics --quiet >"$WORK/cargo.json") \
        || die "building tutti-bench failed"
    BENCH=$(python3 "$ROOT/tools/lib/cargo-executables.py" compare-lmcache tutti-bench <"$WORK/cargo.json") \
        || die "cargo reported no tutti-bench executable for the build"
fi
[[ -x $BENCH ]] || die "no tutti-bench binary at $BENCH"

drop_page_cache() {
    sync
    if [[ -w /proc/sys/vm/drop_caches ]]; then echo 1 >/proc/sys/vm/drop_caches; fi
}

# bounded COMMAND...: runs it under the round's bound (every wait bounded: a stuck LMCache disk
# worker or a retrieve that never returns would otherwise hang the sitting). timeout puts the
# command in a process group of its own, which it kills whole at the bound (the driver's threads,
# strace and its tracees), so the terminal's Ctrl-C, sent to this script's group, no longer
# reaches the round, and bash, waiting in the foreground for a child that did not die of it,
# would go on to the next round. So timeout runs in the background, the wait for it is
# interruptible, and an INT, TERM or HUP to this script is passed on to it as TERM (timeout
# relays it to its group, and KILLs the group 30 s later if it is still there): the round stops,
# INTERRUPTED names the signal, and run_tool ends the sitting (130 for INT, 143 for TERM, 129
# for HUP: a dropped SSH session or closed terminal signals this script's group, not the
# round's, which would otherwise run on into the directory the cleanup removed).
INTERRUPTED=
ROUND_PID=
# Whole seconds the last bounded command ran (SECONDS counts whole seconds, and for a whole
# bound floor(end) - floor(start) >= the bound whenever the command ran that long).
ROUND_ELAPSED=0
bounded() {
    local status=0 started=$SECONDS
    # Trapped before the round starts, so that no interrupt finds it started and untrapped.
    trap 'INTERRUPTED=INT; [[ -z $ROUND_PID ]] || kill -TERM "$ROUND_PID" 2>/dev/null' INT
    trap 'INTERRUPTED=TERM; [[ -z $ROUND_PID ]] || kill -TERM "$ROUND_PID" 2>/dev/null' TERM
    trap 'INTERRUPTED=HUP; [[ -z $ROUND_PID ]] || kill -TERM "$ROUND_PID" 2>/dev/null' HUP
    timeout -k 30 "$ROUND_TIMEOUT_S" "$@" &
    ROUND_PID=$!
    [[ -z $INTERRUPTED ]] || kill -TERM "$ROUND_PID" 2>/dev/null
    # A trapped signal ends the wait early; wait again until timeout itself has ended (within
    # the -k 30 after the TERM it was sent).
    while :; do
        status=0
        wait "$ROUND_PID" || status=$?
        kill -0 "$ROUND_PID" 2>/dev/null || break
    done
    ROUND_PID=
    ROUND_ELAPSED=$((SECONDS - started))
    trap - INT TERM HUP
    return "$status"
}
# stop_if_interrupted: ends the sitting when bounded was interrupted.
stop_if_interrupted() {
    case $INTERRUPTED in
        # `|| :`: after a hangup standard error may be the hung-up terminal (EIO), and set -e
        # would end the sitting with status 1 instead of the signal's.
        INT) say "compare-lmcache: interrupted (SIGINT): the round was stopped" || :; exit 130 ;;
        TERM) say "compare-lmcache: interrupted (SIGTERM): the round was stopped" || :; exit 143 ;;
        HUP) say "compare-lmcache: interrupted (SIGHUP): the round was stopped" || :; exit 129 ;;
    esac
}
# timed_out STATUS: whether timeout(1) stopped the command (124: TERM, 137: its KILL 30 s later)
# after the bound. A status alone does not say: timeout passes on a command's death by a signal
# as 128 + the signal, so 137 is also a command SIGKILLed by the kernel's OOM killer or by
# a person, and 124 a command that exited 124; only a command that ran its whole bound timed out.
timed_out() { [[ ($1 == 124 || $1 == 137) && $ROUND_ELAPSED -ge $ROUND_TIMEOUT_S ]]; }
# killed_by_sigkill STATUS: a SIGKILL before the bound (see timed_out).
killed_by_sigkill() { [[ $1 == 137 ]] && ! timed_out "$1"; }

# run_tool TOOL ROUND: one measurement, its JSON report in $WORK/TOOL-ROUND.json.
run_tool() {
    local tool=$1 round=$2 out=$WORK/$1-$2.json status=0 name
    drop_page_cache
    case $tool in
        lmcache)
            name=LMCache
            PYTHONPATH=$SITE bounded "$PYTHON" "$DRIVER" --directory "$LMCACHE_DIRECTORY" >"$out" 2>"$WORK/stderr" || status=$? ;;
        tutti)
            name=tutti-bench
            bounded "$BENCH" --directory "$DIRECTORY" --output-format=json >"$out" 2>"$WORK/stderr" || status=$? ;;
    esac
    stop_if_interrupted
    [[ $status == 0 ]] && return
    timed_out "$status" && die "$name round $round timed out after ${ROUND_TIMEOUT_S}s (COMPARE_ROUND_TIMEOUT_S): $(grep -v ' LMCache WARNING' "$WORK/stderr" | tail -n 5)"
    killed_by_sigkill "$status" && die "$name round $round was killed (SIGKILL, status 137) after ${ROUND_ELAPSED}s, before its ${ROUND_TIMEOUT_S}s bound: the kernel's OOM killer (see dmesg) or a person: $(grep -v ' LMCache WARNING' "$WORK/stderr" | tail -n 5)"
    die "$name round $round failed: $(grep -v ' LMCache WARNING' "$WORK/stderr" | tail -n 5)"
}

load_start=$(cut -d' ' -f1-3 /proc/loadavg)
for round in $(seq 1 "$ROUNDS"); do
    # Interleaved, the order swapped every round: drift on a shared machine and a virtual disk
    # still writing back the previous tool's bytes do not always fall on the same tool.
    order=(lmcache tutti)
    ((round % 2 == 0)) && order=(tutti lmcache)
    before=$(cut -d' ' -f1 /proc/loadavg)
    for tool in "${order[@]}"; do
        say "round $round/$ROUNDS: $tool"
        run_tool "$tool" "$round"
    done
    echo "$before-$(cut -d' ' -f1 /proc/loadavg)" >"$WORK/load-$round.txt"
done
load_end=$(cut -d' ' -f1-3 /proc/loadavg)

machine="$(nproc) cores, $(uname -r), $(df -T "$DIRECTORY" | awk 'NR==2 {print $2" on "$1}') at $DIRECTORY"
"$PYTHON" "$TABLE" "$WORK" "$ROUNDS" "$machine" "$load_start" "$load_end" "tutti-bench $BENCH" || exit 2

if [[ ${COMPARE_STRACE:-0} == 1 ]]; then
    command -v strace >/dev/null || die "COMPARE_STRACE=1 needs strace (apt-get install strace)"
    for tool in lmcache tutti; do
        drop_page_cache
        say "strace round: $tool"
        # -C: every call (to find the data path's big transfers) and the summary at the end.
        status=0
        case $tool in
            lmcache) PYTHONPATH=$SITE bounded strace -f -C -o "$WORK/strace-$tool.txt" "$PYTHON" "$DRIVER" --directory "$LMCACHE_DIRECTORY" >/dev/null 2>&1 ;;
            tutti) bounded strace -f -C -o "$WORK/strace-$tool.txt" "$BENCH" --directory "$DIRECTORY" --output-format=json >/dev/null 2>&1 ;;
        esac || status=$?
        stop_if_interrupted
        timed_out "$status" && die "the strace round of $tool timed out after ${ROUND_TIMEOUT_S}s (COMPARE_ROUND_TIMEOUT_S)"
        killed_by_sigkill "$status" && die "the strace round of $tool was killed (SIGKILL, status 137) after ${ROUND_ELAPSED}s, before its ${ROUND_TIMEOUT_S}s bound: the kernel's OOM killer (see dmesg) or a person"
        [[ $status == 0 ]] || die "the strace round of $tool failed"
        echo
        "$PYTHON" "$TABLE" --strace "$tool" "$WORK/strace-$tool.txt"
    done
fi

if [[ -n ${COMPARE_OUT:-} ]]; then
    mkdir -p "$COMPARE_OUT"
    cp "$WORK"/*.json "$WORK"/*.txt "$COMPARE_OUT"/
fi
