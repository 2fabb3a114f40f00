#!/usr/bin/env bash
# tools/test.sh — every test suite of the project, from a fresh clone on a fresh Debian machine.
#
# It installs what the suites need (Debian packages, Python wheels; idempotent, as root) and runs:
#   rust        tutti-bench checked to build without protoc (the README's first command), then
#               cargo test --workspace (unit tests, the software-controller conformance suite,
#               rings, executors, object store, scheduler simulator assertions), and the doc tests
#               (cargo test --doc: --all-targets leaves them out)
#   lint        rust-version checked (tools/check-msrv.sh), the engine cache's pruning
#               (tools/lib/prune-test.sh), the package-repair helper (tools/lib/dpkg-test.sh),
#               the benchmark scripts (tools/bench-scripts-test.sh) and the python, engines and
#               cuda stages' scripts with stand-ins (tools/stage-scripts-test.sh), this script's
#               own stage machinery (tools/test-sh-test.sh),
#               cargo clippy -D warnings, cargo fmt --check, cargo doc with rustdoc's warnings
#               as errors (broken or private intra-doc links)
#   bindings    gio_abi.h → Rust bindings regenerated with bindgen and diffed (tools/check-bindings.sh,
#               after tools/check-bindings-test.sh tests its libclang detection)
#   fuzz        the cargo-fuzz targets build (running them needs nightly: see fuzz/README.md)
#   benches     criterion benchmarks compile, and the driver's run once each (measuring is `cargo bench`)
#   cluster     the cluster registry (crates/cluster), `tutti cluster status` and tuttid processes as
#               cluster nodes against real etcd servers (Debian's etcd-server, installed here)
#               that the tests start on loopback
#               ports: one member, and three where members are killed; every process stopped
#   python      the tutti wheel built (maturin, abi3) into a venv under ~/.cache/tutti (keyed by the
#               interpreter's tag and the pinned python/requirements-test.txt), installed into a fresh venv and imported, and
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
# It does not install Rust: rustc and cargo at the workspace's rust-version or newer, with clippy
# and rustfmt, must be on PATH (checked; rustup's downloads are not among the hosts CI reaches).
# A C compiler and linker (gcc, libc6-dev) are installed, checked by compiling a program.
#
# Stages run in that order; a failing stage does not stop the later ones, and the script exits
# non-zero if any failed. A stage whose processes still run 3 s after it ends is a FAIL ("leaked N
# process(es)" in the summary), whatever its status, and they are stopped; so is one that ran a
# script through `bounded` (below) whose processes still ran 3 s after that script ended. Each stage runs in a
# session of its own, so a signal sent to this script's process group (a cancelled CI job, a closed
# terminal) reaches this script and not the stage: SIGINT, SIGTERM or SIGHUP stops the running stage
# with everything it started (its session, and whatever left it for a group or session of its own),
# prints the summary so far and exits 130, 143 or 129. Every command of a stage (apt-get and rustup
# included) runs under a time limit (generous: a cold build on two cores included), so one hung test
# fails its stage instead of hanging CI. The scripts a stage runs (tools/python/*.sh,
# tools/vm-test.sh, ...) bound their own steps with `timeout` as well; each such `timeout` moves
# into a process group of its own, which an outer `timeout`'s signal misses, so those scripts run
# through `bounded` below: in a session of their own, all of which is killed when the script ends or
# its limit expires (and named as leaked when the script ended by itself).
#
# usage: tools/test.sh [STAGE...]      e.g. tools/test.sh cluster python   (default: all; any
#                                     selection runs in the order above, each stage once)
#        TUTTI_STAGES="rust lint" tools/test.sh   (the same selection from the environment)
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
# The policy-rc.d hook and dpkg_configure_pending, shared with tools/vm/lib.sh and
# tools/check-bindings.sh.
# shellcheck source=tools/lib/dpkg.sh
. tools/lib/dpkg.sh
# session_pids (run_stage's grace for what a stage leaves ending), proc_stat (the look at /proc
# of tree_find, tree_snapshot, tree_running, kill_tree and bounded).
# shellcheck source=tools/lib/process.sh
. tools/lib/process.sh

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
# An empty selection (`tools/test.sh ""`, a blank TUTTI_STAGES) is an error too, not a pass.
if [ -z "${STAGES//[[:space:]]/}" ]; then
    echo "tools/test.sh: no stage selected (known: $ALL_STAGES)" >&2
    exit 2
fi
for stage in $STAGES; do
    case " $ALL_STAGES " in
        *" $stage "*) ;;
        *)
            echo "tools/test.sh: unknown stage '$stage' (known: $ALL_STAGES)" >&2
            exit 2
            ;;
    esac
done
# The names one space apart (TUTTI_STAGES may hold tabs or newlines), for the `case " $STAGES "`
# matches below and in the stages.
read -r -d '' -a selected <<< "$STAGES"
STAGES=${selected[*]}
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# Incremental compilation keeps per-crate query caches that a run from a fresh clone never
# reuses, and they grow with every rebuild (26 GiB in one developer's target/debug beside 12 GiB of
# build output); a CI run with about 10 GiB free ran out of disk in its last two stages. A
# developer iterating on one crate can set CARGO_INCREMENTAL=1.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
export DEBIAN_FRONTEND=noninteractive

passed=0
failed=0
failed_names=()
summary=()

# Free space on the file system the builds go to, in GiB. A full run on a fresh machine writes
# about 30 GiB: the engines' environments under ~/.cache/tutti (15 GiB measured with du on a
# machine that had run everything), pip's download cache, the cargo target directory (about
# 9 GiB after one full run; more as builds accumulate), target-vm and the VM images, the CUDA
# wheels (.tools, 0.3 GiB). Running out shows up as a confusing failure in whichever stage is
# writing, so the figure is printed with every stage.
free_gibibytes() { df --output=avail -B1G "${CARGO_TARGET_DIR:-target}" 2> /dev/null | tail -1 | tr -d ' ' || true; }
mkdir -p "${CARGO_TARGET_DIR:-target}"
if [ -n "$(free_gibibytes)" ] && [ "$(free_gibibytes)" -lt 32 ]; then
    echo "tools/test.sh: warning: only $(free_gibibytes) GiB free here; a full run from a fresh machine needs about 30 GiB" >&2
fi

print_summary() {
    echo
    echo "===== summary ====="
    [ ${#summary[@]} -eq 0 ] || printf '%s\n' "${summary[@]}"
    echo "stages: $passed passed, $failed failed"
    [ "$failed" -eq 0 ] || echo "failed stages: ${failed_names[*]}"
}

# tree_find (kill_tree's and tree_snapshot's): adds to the caller's associative arrays pids,
# pgids and sids every process whose parent is in pids or whose group or session is in pgids or
# sids, and puts the groups and sessions of the processes in pids (but this script's own) in
# pgids and sids, until a pass finds nothing new: the members of a group or session found on
# one pass may have children of their own.
tree_find() {
    local stat pid ppid pgid sid changed=1 own_pgid own_sid proc_fields=()
    proc_stat /proc/$$/stat
    own_pgid=${proc_fields[2]:-} own_sid=${proc_fields[3]:-}
    while [ "$changed" = 1 ]; do
        changed=0
        for stat in /proc/[0-9]*/stat; do
            proc_stat "$stat" || continue
            pid=${stat#/proc/} pid=${pid%/stat}
            ppid=${proc_fields[1]:-} pgid=${proc_fields[2]:-} sid=${proc_fields[3]:-}
            [ "$pid" != $$ ] || continue
            if [ -n "${pids[$ppid]:-}" ] || [ -n "${pgids[$pgid]:-}" ] || [ -n "${sids[$sid]:-}" ]; then
                [ -n "${pids[$pid]:-}" ] || { pids[$pid]=1 changed=1; }
            fi
            if [ -n "${pids[$pid]:-}" ]; then
                [ "$pgid" = "$own_pgid" ] || [ -n "${pgids[$pgid]:-}" ] || { pgids[$pgid]=1 changed=1; }
                [ "$sid" = "$own_sid" ] || [ -n "${sids[$sid]:-}" ] || { sids[$sid]=1 changed=1; }
            fi
        done
    done
}
# bounded_sessions: the session ids of the scripts `bounded` runs, each written down in a file
# $run_tmp/bounded-sid.* from before the script starts until bounded has emptied its session
# (kill_tree's, for on_signal and run_stage); an empty file (the id not written yet: the script
# is still below bounded, found through parents) is skipped.
bounded_sessions() {
    local file sid
    for file in "${run_tmp:-/nonexistent}"/bounded-sid.*; do
        read -r sid 2> /dev/null < "$file" || continue
        [[ "$sid" =~ ^[0-9]+$ ]] && echo "$sid"
    done
    return 0
}
# tree_snapshot SID [reaped]: prints "PID START" (START: stat's field 22, the start time) for
# every process besides SID that kill_tree SID [SNAPSHOT [reaped]] would find now, signalling
# none (zombies, which have ended, left out).
tree_snapshot() {
    local root=$1 pid proc_fields=()
    local -A pids=() pgids=() sids=()
    sids[$root]=1
    [ "${2:-}" = reaped ] || pids[$root]=1
    tree_find
    for pid in "${!pids[@]}"; do
        [ "$pid" != "$root" ] && proc_stat "/proc/$pid/stat" && [ "${proc_fields[0]:-}" != Z ] || continue
        echo "$pid ${proc_fields[19]:-}"
    done
}
# tree_running SNAPSHOT: prints the pids of SNAPSHOT's processes still running: not zombies,
# and started when the snapshot says (a pid reused since by another process is not theirs).
tree_running() {
    local pid start proc_fields=()
    while read -r pid start; do
        if [ -n "$start" ] && proc_stat "/proc/$pid/stat" && [ "${proc_fields[19]:-}" = "$start" ] &&
            [ "${proc_fields[0]:-}" != Z ]; then
            echo "$pid"
        fi
    done <<< "$1"
}

# proc_describe PID: "PID COMMAND" (its command line, or its name when that is empty: a kernel
# thread, a process exiting) on one line (a name may hold a newline: written as ?), for the
# reports of what a stage or a script left running; fails when the process has gone.
proc_describe() {
    local line
    line=$(tr '\0' ' ' 2> /dev/null < "/proc/$1/cmdline")
    [ -n "$line" ] || read -r line 2> /dev/null < "/proc/$1/comm" || return 1
    line=${line% }
    echo "$1 ${line//$'\n'/?}"
}

# kill_tree SID [SNAPSHOT]: kills every process of session SID (a stage's: its leader, SID, is
# the stage's shell; members handed to init are found by the session, not by parent links),
# every process below them, and every process in the process groups and sessions those belong
# to (the `timeout`s' groups, `bounded`'s sessions: processes there may already have been
# handed to init), except this script's own group and session; and the processes of SNAPSHOT
# (tree_snapshot's, taken earlier) that still run, with all that is below them and in their
# groups and sessions: one found then only through a parent that has ended since (a process in
# a session of its own, setsid, handed to init) is still reached. SIGTERM first, then, for what
# is still there after a few seconds, SIGKILL. /proc, not pkill: procps is not on every fresh
# machine.
# `killed` is set to what it found running besides SID itself ("PID COMMAND" each; zombies,
# which have ended, left out).
# With `reaped` (run_stage, once its wait has reaped the stage's shell), SID is a session id
# only: the pid may have gone to another process since, which is neither signalled nor followed
# to its children (the stage shell's own went to init when it ended, and are found by the
# session or the snapshot). A session id is not reused while a process of the session lives.
# The sessions `bounded` has written down (bounded_sessions) are killed as well: a script that
# ended leaving processes there (handed to init) is linked to nothing else while bounded waits
# out its grace, and bounded, in the stage's shell, dies of the stage's TERM before its KILL.
killed=()
kill_tree() {
    local root=$1 snapshot=${2:-} signal round line pid sid proc_fields=() changed
    local -A pids=() pgids=() sids=()
    killed=()
    sids[$root]=1
    for sid in $(bounded_sessions); do sids[$sid]=1; done
    [ "${3:-}" = reaped ] || pids[$root]=1
    for pid in $(tree_running "$snapshot"); do pids[$pid]=1; done
    for signal in TERM KILL; do
        tree_find
        if [ "$signal" = TERM ]; then
            for pid in "${!pids[@]}"; do
                [ "$pid" != "$root" ] || continue
                # A zombie has ended (an init that does not reap keeps it): not left running.
                proc_stat "/proc/$pid/stat" || continue
                [ "${proc_fields[0]:-}" != Z ] || continue
                line=$(proc_describe "$pid") && killed+=("$line")
            done
        fi
        for pid in "${!pids[@]}"; do kill -"$signal" "$pid" 2> /dev/null; done
        [ "$signal" = KILL ] && break
        # A few seconds for them to end (a zombie has ended: its parent has not reaped it yet).
        for round in 1 2 3 4 5 6 7 8 9 10; do
            changed=0
            for pid in "${!pids[@]}"; do
                proc_stat "/proc/$pid/stat" || continue
                [ "${proc_fields[0]:-}" = Z ] || { changed=1 && break; }
            done
            [ "$changed" = 1 ] || break
            sleep 0.5
        done
    done
    # (Reaped already: the pid may be another child's of this script now, not to be waited for.)
    [ "${3:-}" = reaped ] || wait "$root" 2> /dev/null
    return 0
}

# A signal (CI cancelling the job, Ctrl-C, a closed terminal) stops the running stage and
# everything it started at once, prints the summary so far and exits 128+signal. The stage runs
# in a session of its own (run_stage), which a signal to this script's group or session does
# not reach: were the stage's shell in this script's group, such a signal would kill it at once
# (a child shell does not keep this script's traps), its `timeout`s (in groups of their own,
# which the signal misses) would be handed to init, and nothing would lead to them any more;
# the stage's session still holds them. The stage runs in the background with `wait`, which a
# trapped signal interrupts (a foreground command would delay the trap until it ended).
# stage_snapshot: run_stage's tree_snapshot of the stage that has ended, kept while its grace
# and kill_tree run, so that on_signal, stopping it then, still reaches what only the snapshot
# leads to (a process in a session of its own whose parent ended in the grace).
# stage_reaped: "reaped" once run_stage's wait has reaped the stage's shell (kill_tree's third
# argument: its pid is a session id only from then on).
stage_pid=
stage_snapshot=
stage_reaped=
current_stage=
on_signal() {
    local signal=$1 code=$2
    trap '' INT TERM HUP
    echo >&2
    echo "tools/test.sh: SIG$signal: stopping${current_stage:+ stage $current_stage and} everything it started" >&2
    [ -z "$stage_pid" ] || kill_tree "$stage_pid" "$stage_snapshot" "$stage_reaped"
    # (Emptied by that kill_tree: the stage's bounded, killed, cannot remove its file itself.)
    rm -f "$run_tmp"/bounded-sid.*
    [ -z "$current_stage" ] || {
        failed=$((failed + 1))
        failed_names+=("$current_stage")
        summary+=("INTERRUPTED $current_stage (SIG$signal)")
    }
    restore_own_policy_rc_d
    print_summary
    exit "$code"
}
run_stage() {
    local name=$1 rc
    shift
    local started=$SECONDS
    echo
    echo "===== stage: $name ====="
    current_stage=$name
    # In a session of its own (see on_signal): `setsid` makes the background child (never a
    # process-group leader here: this script runs without job control) a session leader without
    # forking, so the session id is $! (-w: had it to fork, it would wait and pass the status on;
    # kill_tree would find the forked child below $! then). The stage's shell is a new bash that
    # reads this script's functions and the variables they use from $run_tmp/functions.sh.
    # stdin is /dev/null, as for any background command; stdout and stderr are this script's.
    stage_snapshot=
    stage_reaped=
    rm -f "$run_tmp/bounded-leaked"
    setsid -w bash -c 'set -uo pipefail && . "$1" && shift && "$@"' "tools/test.sh:$name" \
        "$run_tmp/functions.sh" "$@" < /dev/null &
    stage_pid=$!
    wait "$stage_pid"
    rc=$?
    stage_reaped=reaped
    # A member already on its way out (a SIGKILLed child still freeing its memory, a helper that
    # exits once its parent's pipe closes) is not a leak: up to 3 s for the session's running
    # members, and what kill_tree would find now, to end; only what still runs after is counted
    # below. (Zombies have ended.) What kill_tree finds now is kept first: a member ending in
    # the grace may leave a child in a session of its own (setsid), handed to init, that only
    # its parent led to. (Global: on_signal passes it to its kill_tree as well.)
    local tenths
    stage_snapshot=$(tree_snapshot "$stage_pid" reaped)
    for ((tenths = 0; tenths < 30; tenths++)); do
        [ -n "$(session_pids "$stage_pid" 2> /dev/null)" ] || [ -n "$(tree_running "$stage_snapshot")" ] || break
        sleep 0.1
    done
    # What the stage left running (a crashed test's etcd or tuttid, handed to init; its `timeout`s'
    # groups) is still in its session, or was found before the grace: stopped now, not left to
    # the next stage or the machine. (Something that left for a session of its own, `setsid`,
    # and whose parent was gone already when the stage ended, is out of reach: `bounded` stops
    # those of the scripts it runs while it still can find them.)
    kill_tree "$stage_pid" "$stage_snapshot" reaped
    # A bounded of the stage killed before its end (by something else than this script) left
    # its session's file: that session was emptied by the kill_tree above.
    rm -f "$run_tmp"/bounded-sid.*
    # A policy-rc.d that a script of the stage put in place and was KILLed holding (vm-test.sh,
    # check-bindings.sh: owners of their own) would forbid service starts on this machine until
    # the next run: removed now that its owner is gone (never a live run's).
    clean_stale_policy_rc_d
    # A stage that left processes running fails, whatever its status: a test that leaks a
    # daemon (or a script that does not stop what it started) must not go green.
    # What the scripts it ran through `bounded` left (bounded stopped them, and said which, when
    # each script ended) counts the same: one line each in $run_tmp/bounded-leaked.
    local leaked="" count
    count=$((${#killed[@]} + $(cat "$run_tmp/bounded-leaked" 2> /dev/null | wc -l)))
    rm -f "$run_tmp/bounded-leaked"
    if [ ${#killed[@]} -gt 0 ]; then
        echo "tools/test.sh: stage $name left ${#killed[@]} process(es) running, stopped now:" >&2
        printf '  %.200s\n' "${killed[@]}" >&2
    fi
    [ "$count" = 0 ] || leaked=", leaked $count process(es) still running at its end"
    stage_pid= current_stage=
    stage_snapshot=
    stage_reaped=
    if [ "$rc" = 0 ] && [ -z "$leaked" ]; then
        passed=$((passed + 1))
        summary+=("PASS $name ($((SECONDS - started)) s, $(free_gibibytes) GiB free after)")
    else
        failed=$((failed + 1))
        failed_names+=("$name")
        summary+=("FAIL $name ($((SECONDS - started)) s, $(free_gibibytes) GiB free after$leaked)")
    fi
}

# bounded SECONDS COMMAND [ARG...]: runs COMMAND (a program or script, not a shell function)
# under `timeout -k 30 SECONDS`, in a session of its own (setsid), and when it has ended, by
# itself or by its limit, kills whatever is still running in that session: the inner `timeout`s
# of the scripts and their children (pip, pytest, tuttid, QEMU), which sit in process groups of
# their own that the outer `timeout` does not signal. Returns COMMAND's status (124 or 137 when
# the limit expired; a 124 or 137 before the limit is COMMAND's own, an inner `timeout`'s, and
# is no expiry), except that a COMMAND that ended by itself and left processes running in
# its session is a leak, as run_stage counts one: up to 3 s for them to end (run_stage's
# grace), then what still runs is listed on stderr (and a line each in $run_tmp/bounded-leaked,
# which run_stage counts), stopped, and the status is 1 if it was 0. The stage's own end never
# sees them: they are in bounded's session, which is emptied here. The session's id stays
# written down in $run_tmp/bounded-sid.* (bounded_sessions) until then: a signal that stops
# the stage meanwhile (on_signal) kills this shell before it empties the session, and what the
# script left there, handed to init, is reached through that id alone.
bounded() {
    local limit=$1 sidfile sid rc pid pids tenths pass remaining=() line started expired='' proc_fields=()
    shift
    sidfile=$(mktemp -p "$run_tmp" bounded-sid.XXXXXX) || return 1
    started=$SECONDS
    # `timeout`'s child is not a process-group leader, so setsid makes it a session leader without
    # forking: the session id is the pid the child writes before exec'ing.
    timeout -k 30 "$limit" bash -c 'echo $$ > "$0" && exec setsid "$@"' "$sidfile" "$@"
    rc=$?
    sid=$(cat "$sidfile" 2> /dev/null)
    # 124 or 137 is the limit's only once it has passed: a script may end with an inner
    # `timeout`'s 124 (or a KILLed child's 137) of its own, within its limit, and what it left
    # is a leak as after any other status. (SECONDS counts whole seconds, the difference of two
    # readings at least the whole seconds between them: never under the limit once it passed.)
    if { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && [ $((SECONDS - started)) -ge "$limit" ]; then
        expired=1
    fi
    if [ -n "$sid" ] && [ -z "$expired" ]; then
        for ((tenths = 0; tenths < 30; tenths++)); do
            [ -n "$(session_pids "$sid" 2> /dev/null)" ] || break
            sleep 0.1
        done
        # Without `2> /dev/null`: a /proc that cannot be read is said, and fails the script (a
        # check that nothing is left must not pass without looking).
        if ! pids=$(session_pids "$sid"); then
            [ "$rc" != 0 ] || rc=1
        fi
        for pid in $pids; do
            # A zombie has ended, as kill_tree counts it (session_pids left those out; one may
            # have ended since).
            proc_stat "/proc/$pid/stat" && [ "${proc_fields[0]:-}" != Z ] || continue
            line=$(proc_describe "$pid") && remaining+=("$line")
        done
        if [ ${#remaining[@]} -gt 0 ]; then
            echo "tools/test.sh: '$*' ended leaving ${#remaining[@]} process(es) running in its session (leaked), stopped now:" >&2
            printf '  %.200s\n' "${remaining[@]}" >&2
            printf '%s\n' "${remaining[@]%% *}" >> "$run_tmp/bounded-leaked"
            [ "$rc" != 0 ] || rc=1
        fi
    fi
    if [ -n "$sid" ]; then
        # session_pids reads /proc, not pkill: procps is not on every fresh machine. Again until
        # none is left (a few passes at most): a member forking as it is killed would leave its
        # child in the session.
        for ((pass = 0; pass < 5; pass++)); do
            pids=$(session_pids "$sid" 2> /dev/null)
            [ -n "$pids" ] || break
            for pid in $pids; do
                kill -KILL "$pid" 2> /dev/null
            done
            sleep 0.1
        done
    fi
    rm -f "$sidfile"
    [ -z "$expired" ] || echo "tools/test.sh: '$*' ran past its ${limit} s limit: stopped, with everything it started" >&2
    return "$rc"
}

# Installs Debian packages unless `check` already succeeds (reinstalls those dpkg lists as
# installed: files of theirs are gone, or of their dependencies: dpkg_damaged_depends); then
# `check` must succeed. An
# earlier dpkg run that was interrupted makes every apt-get install fail until it is finished,
# so it is finished first (dpkg_configure_pending: with service starts forbidden).
ensure_installed() {
    local check=$1
    shift
    if ! eval "$check" > /dev/null 2>&1; then
        if [ "$(id -u)" -ne 0 ]; then
            echo "tools/test.sh: needs $* (run as root to install them, or install them)" >&2
            return 1
        fi
        echo "tools/test.sh: installing $* (because '$check' fails)"
        dpkg_configure_pending
        # A package dpkg lists as installed while the check fails has lost files: a plain install
        # would do nothing (and fail the check on every run), so it is reinstalled.
        # The files the check needs are often not the named package's but a dependency's (cc1 is
        # cpp-12's, ensurepip python3.11-venv's, protoc's library libprotoc32's): those of its
        # installed dependencies that miss files are reinstalled with it.
        local reinstall=() installed damaged=()
        installed=$(dpkg_installed "$@")
        if [ -n "$installed" ]; then
            # shellcheck disable=SC2086 # one package a word
            mapfile -t damaged < <(dpkg_damaged_depends $installed)
            echo "tools/test.sh: reinstalling ${installed//$'\n'/ }${damaged[*]:+ and their dependencies ${damaged[*]} (files missing)} (dpkg lists it installed, but '$check' fails)"
            reinstall=(--reinstall)
        fi
        # DPkg::Lock::Timeout: another apt-get running (a second clone's test.sh, unattended
        # upgrades) is waited for, up to 10 minutes, instead of failing at once.
        timeout -k 30 900 apt-get -o DPkg::Lock::Timeout=600 update -q > /dev/null &&
            timeout -k 30 1800 apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${reinstall[@]}" "$@" "${damaged[@]}" > /dev/null || return 1
    fi
    eval "$check" > /dev/null 2>&1 || { echo "tools/test.sh: '$check' still fails after installing $*" >&2; return 1; }
}

ensure_protoc() { ensure_installed tools/check-protoc.sh protobuf-compiler libprotobuf-dev; }

# rustc links through `cc` (and build scripts compile C with it): a machine with rustup only
# fails every cargo build with "linker `cc` not found". Checked by compiling, linking and running
# a C program, not by finding a file.
cc_links() {
    local dir rc
    dir=$(mktemp -d) || return 1
    printf 'int main(void) { return 0; }\n' > "$dir/check.c"
    timeout -k 10 120 cc -o "$dir/check" "$dir/check.c" && "$dir/check"
    rc=$?
    rm -rf "$dir"
    return "$rc"
}
ensure_cc() { ensure_installed cc_links gcc libc6-dev; }

# The Rust toolchain is not installed here (rustup's downloads come from static.rust-lang.org):
# it must be on PATH, at least at the workspace's rust-version (Cargo.toml).
ensure_rust() {
    local need have
    need=$(sed -n 's/^rust-version *= *"\([0-9.]*\)".*/\1/p' Cargo.toml | head -1)
    have=$(rustc --version 2> /dev/null | sed -n 's/^rustc \([0-9][0-9.]*\).*/\1/p')
    if [ -z "$have" ] || ! cargo --version > /dev/null 2>&1; then
        echo "tools/test.sh: no working rustc and cargo on PATH: install a Rust toolchain (rustup), version ${need:-?} or newer" >&2
        return 1
    fi
    if [ -n "$need" ] && [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
        echo "tools/test.sh: rustc $have is older than the workspace's rust-version $need (Cargo.toml): install a newer toolchain" >&2
        return 1
    fi
}
# What every stage that runs cargo needs first.
ensure_build() { ensure_rust && ensure_cc; }

# cargo_tests_ran LIMIT CARGO-TEST-ARGS...: `cargo test` under `timeout`, its output shown and
# kept, failing also when its "test result: ok. N passed" lines add up to no test at all: a name
# filter that matches nothing (after a rename) would otherwise pass silently.
cargo_tests_ran() {
    local limit=$1 log rc count
    shift
    log=$(mktemp -p "$run_tmp") || return 1
    timeout -k 30 "$limit" cargo test "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    count=$(awk '/^test result: ok\. [0-9]+ passed/ { n += $4 } END { print n + 0 }' "$log")
    rm -f "$log"
    [ "$rc" = 0 ] || return "$rc"
    if [ "$count" -eq 0 ]; then
        echo "tools/test.sh: 'cargo test $*' ran no test (does its filter still match any?)" >&2
        return 1
    fi
    echo "tools/test.sh: 'cargo test $*': $count passed"
}

# What the scripts call but a fresh Debian lacks, checked by using it (stock bookworm has no
# python3-venv nor python3-pip, and may have no python3 or g++ at all). The python checked is
# the one the scripts run: PATH's python3 (a pyenv shim where there is one), or TUTTI_PYTHON /
# TUTTI_ENGINE_PYTHON.
ensure_python3() { ensure_installed 'python3 --version' python3; }
# g++ compiles and links a C++ program that uses the standard library (libstdc++'s headers and
# library are g++-12's dependencies), as cc_links does for C: a g++ that runs may still lack them.
gxx_links() {
    local dir rc
    dir=$(mktemp -d) || return 1
    printf '#include <string>\n#include <iostream>\nint main() { std::string s("ok"); std::cout << s.size() - 2; return 0; }\n' > "$dir/check.cc"
    timeout -k 10 120 g++ -o "$dir/check" "$dir/check.cc" && "$dir/check" > /dev/null
    rc=$?
    rm -rf "$dir"
    return "$rc"
}
ensure_gxx() { ensure_installed gxx_links g++; }
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

# The policy-rc.d hook (forbid_service_starts, restore_own_policy_rc_d, clean_stale_policy_rc_d)
# and dpkg_configure_pending are tools/lib/dpkg.sh's (sourced at the top).

# The etcd binary the cluster tests run (by PATH), checked by running it, not by dpkg's state.
# etcd-server's post-install enables its service on port 2379 and starts it: the tests never
# use it, so it is installed with service starts forbidden, and disabled (and stopped, should it
# run regardless) after (disable_etcd_service, tools/lib/dpkg.sh). An install of etcd-server
# that was interrupted (unpacked, not configured) is finished here the same way; any other
# `dpkg --configure -a` (ensure_installed's, vm/lib.sh's, check-bindings.sh's) goes through
# dpkg_configure_pending, which does the same.
etcd_runs() { [[ "$(etcd --version 2> /dev/null)" == "etcd Version: 3."* ]]; }
ensure_etcd() {
    local rc=0
    # Not `etcd --version | grep -q`: grep leaving early kills etcd with SIGPIPE, which pipefail reports.
    if { ! etcd_runs || etcd_half_installed; } && [ "$(id -u)" -eq 0 ]; then
        forbid_service_starts || return 1
        if etcd_half_installed; then dpkg_configure_pending; fi
        ensure_installed etcd_runs etcd-server || rc=1
        restore_own_policy_rc_d
        disable_etcd_service
        [ "$rc" = 0 ] || return 1
    fi
    ensure_installed etcd_runs etcd-server || return 1
    echo "etcd: $(command -v etcd) ($(etcd --version | head -1))"
}

# Whether this machine can do what the loop-device test of tools/tutti/tests/cli.rs does: attach
# a file to a loop device, make an ext4 file system on it and mount it. Root with losetup is not
# enough: an unprivileged container (root inside) has no usable /dev/loop-control, or may refuse
# the mount. Tried for real on a small file; everything undone after.
# The trial runs in a subshell whose EXIT trap undoes it (loop_devices_undo), and which a TERM,
# INT or HUP ends through that trap: an interrupt of tools/test.sh or the stage's limit (kill_tree
# TERMs every process of the stage at once) between the mount and the detach would otherwise
# leave the file system mounted and the loop device attached for good.
# The undo has what kill_tree gives: it SIGKILLs whatever of the session still runs 5 s after
# its TERM, the undo's umount and losetup -d included. Unmounting and detaching an idle 8 MiB
# file system takes a fraction of that (test-sh-test.sh: well under a second); a KILL in the
# middle of it (a hung umount) would leave the mount and the loop device behind, under
# $run_tmp, for `umount` and `losetup -d` by hand (`losetup --list` shows the file).
loop_devices_work() {
    local dir
    [ "$(id -u)" -eq 0 ] && [ -c /dev/loop-control ] && command -v losetup > /dev/null 2>&1 &&
        command -v mkfs.ext4 > /dev/null 2>&1 && command -v mount > /dev/null 2>&1 || return 1
    dir=$(mktemp -d -p "$run_tmp") || return 1
    (
        # shellcheck disable=SC2064 # this trial's directory, fixed now
        trap "loop_devices_undo '$dir'" EXIT
        trap 'exit 143' TERM
        trap 'exit 130' INT
        trap 'exit 129' HUP
        mkdir "$dir/mnt" && truncate -s 8M "$dir/disk.img" || exit 1
        node=$(timeout -k 5 30 losetup --find --show "$dir/disk.img" 2> /dev/null) && [ -n "$node" ] || exit 1
        timeout -k 5 60 mkfs.ext4 -q -F "$node" > /dev/null 2>&1 && timeout -k 5 30 mount "$node" "$dir/mnt" > /dev/null 2>&1
    )
}
# loop_devices_undo DIR: unmounts DIR/mnt (if mounted), detaches every loop device on
# DIR/disk.img (found by the file: one attached by a losetup that was interrupted before it
# printed the device's name counts too) and removes DIR.
loop_devices_undo() {
    local dir=$1 node
    # mountpoint, not a look for " $dir/mnt " in mountinfo: the kernel writes the canonical path
    # there (and a space as \040), which a TMPDIR not canonical (/tmp//x/.., a symlink) or with a
    # space never matches: the file system was left mounted.
    ! mountpoint -q "$dir/mnt" 2> /dev/null || timeout -k 5 30 umount "$dir/mnt" > /dev/null 2>&1
    for node in $(losetup --list -n -O NAME -j "$dir/disk.img" 2> /dev/null); do
        timeout -k 5 30 losetup -d "$node" > /dev/null 2>&1
    done
    rm -rf "$dir"
}

stage_rust() {
    ensure_build || return 1
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
    # TUTTI_REQUIRE_LOOP=1 where this machine can attach, format and mount a loop device (CI:
    # root, /dev/loop-control; mkfs.ext4 installed first where missing): the loop-device test of
    # tools/tutti/tests/cli.rs then fails instead of passing as skipped when it cannot.
    local require_loop=0
    if [ "$(id -u)" -eq 0 ] && [ -c /dev/loop-control ] && command -v losetup > /dev/null 2>&1; then
        ensure_installed 'mkfs.ext4 -V' e2fsprogs || echo "tools/test.sh: no mkfs.ext4: the loop-device test may skip" >&2
    fi
    if loop_devices_work; then
        require_loop=1
    else
        echo "tools/test.sh: no loop device can be attached, formatted and mounted here: the loop-device test may skip (TUTTI_REQUIRE_LOOP=0)"
    fi
    # --all-targets runs no doc tests (cargo leaves them out of it): they run after, by
    # themselves: the compile_fail ones pin what code outside a crate must not be able to do
    # (gio-uring's QueueMemory.region), the others are the crates' documented examples
    # (nvme-emu's). Their count is checked, as a run of none would pass.
    ensure_protoc || return 1
    local rc=0
    TUTTI_REQUIRE_URING=1 TUTTI_REQUIRE_LOOP=$require_loop \
        timeout -k 30 2700 cargo test --workspace --all-targets --locked --no-fail-fast 2>&1 || rc=$?
    cargo_tests_ran 1800 --workspace --doc --locked --no-fail-fast || rc=1
    return "$rc"
}

stage_lint() {
    ensure_build || return 1
    # Checked by running each tool, not by rustup's list: a toolchain may have one without the
    # other. rustup downloads them from static.rust-lang.org, which a CI machine limited to the
    # package registries cannot reach: then the toolchain must come with them.
    if ! cargo clippy --version > /dev/null 2>&1 || ! cargo fmt --version > /dev/null 2>&1; then
        timeout -k 30 900 rustup component add clippy rustfmt
        if ! cargo clippy --version > /dev/null 2>&1 || ! cargo fmt --version > /dev/null 2>&1; then
            echo "tools/test.sh: lint needs clippy and rustfmt, and 'rustup component add clippy rustfmt' did not provide them (it downloads from static.rust-lang.org): preinstall a toolchain with clippy and rustfmt" >&2
            return 1
        fi
    fi
    # clippy's incompatible_msrv lint checks std APIs against rust-version; check-msrv.sh checks
    # that every package declares it and that no locked dependency needs a newer compiler.
    # tools/lib/prune-test.sh: the cache pruning engine-env.sh does (no build, a second).
    ensure_protoc && ensure_python3 && bounded 900 tools/check-msrv.sh && bounded 60 tools/lib/prune-test.sh && bounded 60 tools/lib/dpkg-test.sh && bounded 180 tools/bench-scripts-test.sh &&
        bounded 180 tools/stage-scripts-test.sh && bounded 120 tools/test-sh-test.sh &&
        timeout -k 30 1800 cargo clippy --workspace --all-targets --locked -- -D warnings &&
        timeout -k 30 300 cargo fmt --all -- --check &&
        RUSTDOCFLAGS="-D warnings" timeout -k 30 900 cargo doc --workspace --no-deps --locked
}

stage_bindings() { ensure_build && bounded 300 tools/check-bindings-test.sh && bounded 1200 tools/check-bindings.sh; }
# cuda-build.sh installs the nvcc wheels with `python3 -m pip`, compiles the ABI header with
# gcc and g++ and builds tuttid (protoc); check.sh runs python3, builds tuttid and makes the
# python stage's venv (tools/python/wheel.sh: python3-venv). After the engines stage, check.sh
# must rehearse the prefill step with the vLLM environment (GPU_CHECK_REQUIRE_PREFILL=1): a
# missing one fails the stage.
stage_cuda() {
    ensure_build && ensure_protoc && ensure_pip && ensure_gxx && ensure_venv || return 1
    local require_prefill=0
    case " $STAGES " in *" engines "*) require_prefill=1 ;; esac
    bounded 1200 tools/cuda-build.sh && GPU_CHECK_REQUIRE_PREFILL=$require_prefill bounded 1200 tools/gpu/check.sh
}

stage_fuzz() {
    # The fuzz crate has its own workspace; `cargo fuzz run` needs nightly, building it does not.
    # libfuzzer-sys compiles libFuzzer's C++ sources.
    ensure_build && ensure_gxx || return 1
    (cd fuzz && timeout -k 30 1800 cargo check --bins --locked 2>&1)
}

stage_benches() {
    ensure_build && ensure_protoc && timeout -k 30 1800 cargo bench --workspace --no-run --locked 2>&1 &&
        # Criterion's --test runs each benchmark once: the driver benches' set-up (a software
        # controller, and for the one-CPU placement the pinned threads) and their bounded
        # waits run on every CI run, not only when someone measures.
        timeout -k 30 300 cargo bench --locked -p tutti-benches --bench driver_overhead --bench command_build -- --test 2>&1
}

# TUTTI_REQUIRE_ETCD=1 (for each cargo test, the daemon's too: cargo_tests_ran passes its
# environment on): a test that finds no etcd fails instead of skipping. Each test bounds
# its own waits; `timeout` bounds the whole stage should one hang regardless. tuttid's cluster
# tests are one file per theme (tools/tuttid/tests/cluster_*.rs): the glob runs them all, and
# cargo fails should it match none; the daemon's `--lib cluster` is a name filter, which would
# pass matching nothing, so its count is checked.
stage_cluster() {
    ensure_build && ensure_protoc && ensure_etcd || return 1
    TUTTI_REQUIRE_ETCD=1 timeout -k 30 900 cargo test --locked -p tutti-cluster --all-targets 2>&1 &&
        TUTTI_REQUIRE_ETCD=1 timeout -k 30 600 cargo test --locked -p tutti --test cluster 2>&1 &&
        TUTTI_REQUIRE_ETCD=1 cargo_tests_ran 600 --locked -p tutti-daemon --features cluster --lib cluster &&
        TUTTI_REQUIRE_ETCD=1 timeout -k 30 600 cargo test --locked -p tuttid --test 'cluster_*' 2>&1
}

# Two controllers: the suite runs on each, and the object-store round trip stripes one pool over
# both through one VFIO container (VfioDevice::open_many).
# The wheel build, the venv (first run: a few pip downloads) and the tests are bounded inside the
# script; `bounded` bounds the whole stage, inner steps included.
stage_python() { ensure_build && ensure_protoc && ensure_venv "${TUTTI_PYTHON:-python3}" && bounded 1500 tools/python/core-test.sh; }
# The engines' environments are large (vLLM's ~8 GB): built once per pin set, reused after.
stage_engines() { ensure_build && ensure_protoc && ensure_venv "${TUTTI_ENGINE_PYTHON:-python3}" && bounded 2700 tools/python/engine-test.sh; }

# Two guests of about 4 minutes each under TCG; a cold machine also installs QEMU, downloads the
# guest kernel and builds the static binaries first.
stage_vm() { ensure_build && ensure_protoc && TUTTI_VM_NVME_COUNT=${TUTTI_VM_NVME_COUNT:-2} bounded 2400 tools/vm-test.sh; }

# What a stage's shell (run_stage) starts from: the variables the functions read, and the
# functions. A variable missing here fails the stage loudly (set -u), not silently.
write_stage_functions() {
    { declare -p STAGES run_tmp main_pid POLICY_RC_D POLICY_RC_D_SAVED POLICY_RC_D_LOCK POLICY_RC_D_MARK policy_state policy_saved && declare -f; } > "$run_tmp/functions.sh"
}

# Sourced (`. tools/test.sh STAGE`, by tools/test-sh-test.sh): the functions only, no stage run.
# (The cd at the top goes by $0, the sourcing script's: it must sit in tools/ as well.)
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
    return 0
fi

# Scratch files of this run (bounded's session ids); removed on exit, however the run ends. The
# handlers are set here, once every function they call is defined.
run_tmp=$(mktemp -d) || exit 1
trap 'restore_own_policy_rc_d; clean_stale_policy_rc_d; rm -rf "$run_tmp"' EXIT
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM
trap 'on_signal HUP 129' HUP

write_stage_functions || exit 1

# A policy-rc.d that an earlier run left (killed before it could put it back) would stop every
# service restart on this machine's package upgrades from now on: removed whether or not a
# stage installs anything.
clean_stale_policy_rc_d

# In ALL_STAGES' order whatever the order given (and each once): a stage may depend on an
# earlier one (cuda's prefill rehearsal needs the engines stage's vLLM environment, which it
# requires when engines is selected), so `tools/test.sh cuda engines` runs engines first.
for stage in $ALL_STAGES; do
    case " $STAGES " in *" $stage "*) run_stage "$stage" "stage_$stage" ;; esac
done

print_summary
[ "$failed" -eq 0 ] || exit 1
