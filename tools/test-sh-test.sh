#!/usr/bin/env bash
# tools/test-sh-test.sh — checks of tools/test.sh's own machinery, with its functions sourced
# (`. tools/test.sh lint`: no stage of it runs) and stand-in stages (tools/test.sh's lint stage
# runs it; alone: `tools/test-sh-test.sh`; the policy-rc.d check as root only):
# 1. a stage that ends with a process of its still running is a FAIL that says how many it
#    leaked (they are stopped), not a PASS: one whose command name holds a newline and ") S 1 2"
#    (a stat line that a line-wise read would cut short) too, and one in a session of its own
#    whose parent, a member of the stage's session, ends during the grace (stopped by a SIGTERM
#    to the script then, too: on_signal); so is one whose script run through `bounded` exits 0
#    leaving a process in bounded's session (stopped by a SIGTERM to the script during bounded's
#    grace too), or that exits 124 of its own (an inner `timeout`'s) before bounded's limit; a
#    stage that leaves nothing, or only a process that ends within the grace after the stage (or
#    after its bounded script), is a PASS;
# 2. a policy-rc.d that a script of a stage (an owner of its own, as vm-test.sh and
#    check-bindings.sh are) put in place and was KILLed holding is removed when the stage ends,
#    the original it kept aside put back (at paths of the test's own);
# 3. loop_devices_work, stopped while its file system is mounted, leaves nothing mounted or
#    attached (as root where loop devices work);
# 4. the cluster stage runs every `cargo test` with TUTTI_REQUIRE_ETCD=1 (a stand-in cargo);
# 5. once a stage's shell has been reaped, its pid is only a session id to kill_tree and
#    tree_snapshot: a process that took the pid since (pid reuse), and its children, are left
#    alone.
# (0. tools/lib/process.sh under set -e: proc_stat's read, interruptible_timeout's traps.)
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/.." || exit 1
# shellcheck source=tools/test.sh
. tools/test.sh lint > /dev/null
set +e
run_dir=$(mktemp -d)
trap 'rm -rf "$run_dir"' EXIT
# Not canonical on purpose (as with TMPDIR=/tmp//x/..): the loop check below must compare the
# kernel's canonical paths (mountinfo, backing_file), and loop_devices_work's undo find its mount
# all the same. (Removed by run_dir: rm refuses a path ending in "/.".)
run_tmp=$run_dir//.
failures=0
check() {
    local what=$1 expected=$2 got=$3
    if [ "$got" = "$expected" ]; then
        echo "test-sh-test: ok: $what" >&2
    else
        echo "test-sh-test: FAILED: $what: expected $expected, got $got" >&2
        failures=$((failures + 1))
    fi
}
POLICY_RC_D=$run_tmp/policy-rc.d POLICY_RC_D_SAVED=$run_tmp/policy-rc.d.tutti-saved POLICY_RC_D_LOCK=$run_tmp/policy.lock

# The stand-in stages.
stage_leaks() {
    sleep 60 > /dev/null 2>&1 &
    echo $! > "$run_tmp/leaked.pid"
}
# A copy of sleep whose command name (stat's field 2) holds a newline and a fake ") S 1 2". The
# kernel takes the command name from the file run, so the copy has that name; its argv[0] stays
# "sleep": a multicall sleep (uutils' coreutils, busybox) dispatches on argv[0] and would end at
# once under any other. Its command name is written down (checked below) once it has exec'd
# (until then it is the shell's).
stage_leaks_newline() {
    local name="$run_tmp/nl"$'\n'") S 1 2" pid comm tenths
    (exec -a sleep "$name" 60) > /dev/null 2>&1 &
    pid=$!
    echo "$pid" > "$run_tmp/leaked-newline.pid"
    # Waited for by the name itself (the file's name, under the kernel's 15 bytes): "not the
    # shell's any more" was read through a command substitution, whose own process is cat.
    for ((tenths = 0; tenths < 50; tenths++)); do
        comm=$(cat "/proc/$pid/comm" 2> /dev/null)
        [ "$comm" = "nl"$'\n'") S 1 2" ] && break
        sleep 0.1
    done
    printf '%s' "$comm" > "$run_tmp/leaked-newline.comm"
}
# A member of the stage's session that starts a process in a session of its own (setsid, not
# forking: the child is no group leader) and ends 2 s after starting it, in the 3 s grace:
# afterwards the sleep is reachable neither by the stage's session nor by a parent. (2 s, not
# less: the stage's end must still find the member there on a loaded machine, or the sleep is
# out of reach before it looks; under 3 s: a stage end that followed only the session and
# parents would still miss the sleep, and fail this check.)
# stage_leaks_setsid [PREFIX]: the sleep's pid in PREFIX.pid, the member's in PREFIX.member.
stage_leaks_setsid() {
    local prefix=${1:-$run_tmp/leaked-setsid}
    # shellcheck disable=SC2016 # expanded by the inner shell
    bash -c 'echo $$ > "$0.member"; setsid sleep 60 > /dev/null 2>&1 & echo $! > "$0.pid"; sleep 2' "$prefix" &
    # Until the inner shell has started the sleep (the stage's end must find it there).
    for ((tenths = 0; tenths < 50; tenths++)); do [ -s "$prefix.pid" ] && break; sleep 0.1; done
}
# A script run through `bounded` (as the python, engines, cuda, vm and bindings stages run theirs)
# that exits 0 leaving a process in its session: bounded's own session, which the stage's end
# never sees (bounded KILLs it first). A FAIL all the same, that says it leaked.
printf '#!/usr/bin/env bash\nsleep 60 > /dev/null 2>&1 &\necho $! > %q\nexit 0\n' "$run_tmp/bounded-leaked.pid" > "$run_tmp/leaky.sh"
# One whose process ends within the grace (as one already on its way out): not leaked.
printf '#!/usr/bin/env bash\nsleep 0.5 > /dev/null 2>&1 &\nexit 0\n' > "$run_tmp/ending.sh"
chmod +x "$run_tmp/leaky.sh" "$run_tmp/ending.sh"
stage_bounded_leaks() { bounded 10 "$run_tmp/leaky.sh"; }
stage_bounded_ending() { bounded 10 "$run_tmp/ending.sh"; }
stage_clean() { return 0; }
# Leaves a process that is already on its way out (as a SIGKILLed child freeing its memory, or
# a helper that exits once its parent's pipe closes): it ends within the grace, not leaked.
stage_ending() { sleep 0.5 > /dev/null 2>&1 & }
# A script of its own: forbids service starts (its own policy-rc.d) and is KILLed holding it.
stage_policy_killed() {
    # shellcheck disable=SC2016 # expanded by the script
    bash -c '. tools/lib/dpkg.sh && POLICY_RC_D=$1 POLICY_RC_D_SAVED=$2 POLICY_RC_D_LOCK=$3 &&
        forbid_service_starts && kill -KILL $$' policy-script "$POLICY_RC_D" "$POLICY_RC_D_SAVED" "$POLICY_RC_D_LOCK"
    grep -q 'exit 101' "$POLICY_RC_D" # the script did put it there
}
cp "$(command -v sleep)" "$run_tmp/nl"$'\n'") S 1 2"
write_stage_functions
# ended PID: whether PID has ended (a zombie has), signalling nothing.
ended() {
    local state
    state=$(sed -E 's/^.*\) ([A-Z]).*$/\1/' "/proc/$1/stat" 2> /dev/null | tail -1)
    [ -z "$state" ] || [ "$state" = Z ]
}
# stopped PID: "stopped" when PID has ended (a zombie has: init reaps it when it gets to it);
# a process still running is KILLed (what a failed check left) and named.
stopped() {
    if ended "$1"; then
        echo stopped
    else
        kill -KILL "$1" 2> /dev/null
        echo "running ($1)"
    fi
}

# 0. proc_stat called plainly by a script under set -e with inherit_errexit: its whole-file
#    read, which returns 1 at the end of the file, must not end it.
# shellcheck disable=SC2016 # expanded by the inner shell
check "proc_stat under set -e and inherit_errexit: the state of a running process" "state=R" \
    "$(bash -c 'set -euo pipefail; shopt -s inherit_errexit; . tools/lib/process.sh; proc_stat /proc/self/stat; echo "state=${proc_fields[0]:-}"' 2>&1)"
# 0b. interruptible_timeout's traps under set -e: a kill in a trap that fails (its `timeout`
#     already gone; stood in for by a kill that signals, then fails) must not end the script
#     with 1 instead of 143.
# shellcheck disable=SC2016 # expanded by the inner shell
check "interruptible_timeout under set -e, SIGTERM, its trap's kill failing: exit 143" 143 \
    "$(bash -c 'set -euo pipefail; . tools/lib/process.sh; kill() { builtin kill "$@"; return 1; }
        (sleep 0.5; builtin kill -TERM $$) & interruptible_timeout 10 sleep 5; echo went on' > /dev/null 2>&1; echo $?)"

# 1. Leaks.
run_stage leaks stage_leaks > "$run_tmp/leaks.out" 2>&1
check "a stage that leaves a process running: a FAIL that says it leaked 1" yes \
    "$(printf '%s\n' "${summary[@]}" | grep -q '^FAIL leaks (.*leaked 1 process' && echo yes || echo "no: ${summary[*]}")"
run_stage clean stage_clean > "$run_tmp/clean.out" 2>&1
check "a stage that leaves nothing: a PASS" yes "$(printf '%s\n' "${summary[@]}" | grep -q '^PASS clean ' && echo yes || echo "no: ${summary[*]}")"
run_stage ending stage_ending > "$run_tmp/ending.out" 2>&1
check "a stage that leaves a process ending within a second: a PASS" yes \
    "$(printf '%s\n' "${summary[@]}" | grep -q '^PASS ending ' && echo yes || echo "no: ${summary[*]}")"
check "the leaked process stopped" stopped "$(stopped "$(cat "$run_tmp/leaked.pid")")"
run_stage leaks-newline stage_leaks_newline > "$run_tmp/leaks-newline.out" 2>&1
check "a stage that leaves a process whose name holds a newline and ') S 1 2': a FAIL that says it leaked 1" yes \
    "$(printf '%s\n' "${summary[@]}" | grep -q '^FAIL leaks-newline (.*leaked 1 process' && echo yes || echo "no: ${summary[*]}")"
check "the leaked process's command name holds the newline and ') S 1 2'" "nl"$'\n'") S 1 2" "$(cat "$run_tmp/leaked-newline.comm")"
check "the process whose name holds a newline stopped" stopped "$(stopped "$(cat "$run_tmp/leaked-newline.pid")")"
run_stage leaks-setsid stage_leaks_setsid > "$run_tmp/leaks-setsid.out" 2>&1
check "a stage whose member, ending in the grace, leaves a process in a session of its own: a FAIL that says it leaked 1" yes \
    "$(printf '%s\n' "${summary[@]}" | grep -q '^FAIL leaks-setsid (.*leaked 1 process' && echo yes || echo "no: ${summary[*]}")"
check "the process in a session of its own stopped" stopped "$(stopped "$(cat "$run_tmp/leaked-setsid.pid")")"
run_stage bounded-leaks stage_bounded_leaks > "$run_tmp/bounded-leaks.out" 2>&1
check "a script run through bounded that exits 0 leaving a process: a FAIL that says it leaked 1" yes \
    "$(printf '%s\n' "${summary[@]}" | grep -q '^FAIL bounded-leaks (.*leaked 1 process' && echo yes || echo "no: ${summary[*]}")"
check "bounded names what it left running" yes \
    "$(grep -q "^  $(cat "$run_tmp/bounded-leaked.pid") sleep 60" "$run_tmp/bounded-leaks.out" && echo yes || echo "no: $(cat "$run_tmp/bounded-leaks.out")")"
check "the process the script left stopped" stopped "$(stopped "$(cat "$run_tmp/bounded-leaked.pid")")"
run_stage bounded-ending stage_bounded_ending > "$run_tmp/bounded-ending.out" 2>&1
check "a script run through bounded whose process ends within a second: a PASS" yes \
    "$(printf '%s\n' "${summary[@]}" | grep -q '^PASS bounded-ending ' && echo yes || echo "no: ${summary[*]}: $(cat "$run_tmp/bounded-ending.out")")"
# A script whose own inner `timeout 1` gives it 124 (the status of an expired limit), exiting
# at once leaving a process: bounded's limit (30 s) has not expired, so a leak, not a limit.
printf '#!/usr/bin/env bash\nsleep 60 > /dev/null 2>&1 &\necho $! > %q\ntimeout 1 sleep 5\nexit $?\n' \
    "$run_tmp/inner124-leaked.pid" > "$run_tmp/inner124.sh"
chmod +x "$run_tmp/inner124.sh"
stage_bounded_inner124() { bounded 30 "$run_tmp/inner124.sh"; }
write_stage_functions
run_stage bounded-inner124 stage_bounded_inner124 > "$run_tmp/bounded-inner124.out" 2>&1
check "a script run through bounded that exits 124 (an inner timeout's) leaving a process: a FAIL that says it leaked 1" yes \
    "$(printf '%s\n' "${summary[@]}" | grep -q '^FAIL bounded-inner124 (.*leaked 1 process' && echo yes || echo "no: ${summary[*]}: $(cat "$run_tmp/bounded-inner124.out")")"
check "a script that exits 124 within bounded's limit: not said to have run past it" 0 \
    "$(grep -c 'ran past its 30 s limit' "$run_tmp/bounded-inner124.out")"
check "a script that exits 124 within bounded's limit: what it left stopped" stopped \
    "$(pid=$(cat "$run_tmp/inner124-leaked.pid" 2> /dev/null) && [ -n "$pid" ] && stopped "$pid" || echo "no pid written")"
# The same stage, and a SIGTERM to this script (on_signal, as tools/test.sh traps it) once the
# member has ended, in the grace: on_signal stops what run_stage's snapshot found too.
(
    trap 'on_signal TERM 143' TERM
    run_stage signalled-setsid stage_leaks_setsid "$run_tmp/signalled-setsid"
) > "$run_tmp/signalled-setsid.out" 2>&1 &
runner=$!
for ((tenths = 0; tenths < 100; tenths++)); do
    [ -s "$run_tmp/signalled-setsid.member" ] && ended "$(cat "$run_tmp/signalled-setsid.member")" && break
    sleep 0.1
done
kill -TERM "$runner"
wait "$runner"
check "a SIGTERM in the grace after a member ended: the stage INTERRUPTED" yes \
    "$(grep -q '^INTERRUPTED signalled-setsid (SIGTERM)' "$run_tmp/signalled-setsid.out" && echo yes || echo "no: $(cat "$run_tmp/signalled-setsid.out")")"
check "a SIGTERM in the grace after a member ended: its process in a session of its own stopped" stopped \
    "$(stopped "$(cat "$run_tmp/signalled-setsid.pid")")"
# A SIGTERM to this script while bounded gives the script it ran (exited, leaving a process in
# bounded's session) its 3 s grace: the stage's shell (bounded's) dies of on_signal's TERM before
# bounded's own KILL, so on_signal must reach bounded's session itself.
printf '#!/usr/bin/env bash\nsleep 60 > /dev/null 2>&1 &\necho $! > %q\nexit 0\n' "$run_tmp/grace-leaked.pid" > "$run_tmp/grace-leaky.sh"
chmod +x "$run_tmp/grace-leaky.sh"
stage_bounded_grace() { bounded 10 "$run_tmp/grace-leaky.sh"; }
write_stage_functions
(
    trap 'on_signal TERM 143' TERM
    run_stage signalled-bounded stage_bounded_grace
) > "$run_tmp/signalled-bounded.out" 2>&1 &
runner=$!
for ((tenths = 0; tenths < 50; tenths++)); do [ -s "$run_tmp/grace-leaked.pid" ] && break; sleep 0.1; done
sleep 1 # the script has exited: bounded is in its grace
kill -TERM "$runner"
wait "$runner"
check "a SIGTERM in bounded's grace: the stage INTERRUPTED" yes \
    "$(grep -q '^INTERRUPTED signalled-bounded (SIGTERM)' "$run_tmp/signalled-bounded.out" && echo yes || echo "no: $(cat "$run_tmp/signalled-bounded.out")")"
check "a SIGTERM in bounded's grace: what the script left stopped" stopped \
    "$(pid=$(cat "$run_tmp/grace-leaked.pid" 2> /dev/null) && [ -n "$pid" ] && stopped "$pid" || echo "no pid written")"

# 2. A policy-rc.d left by a KILLed script of a stage.
if [ "$(id -u)" -eq 0 ]; then
    echo original > "$POLICY_RC_D"
    run_stage policy stage_policy_killed > "$run_tmp/policy.out" 2>&1
    check "the stage's script put its policy-rc.d in place" yes \
        "$(printf '%s\n' "${summary[@]}" | grep -q '^PASS policy ' && echo yes || echo "no: $(cat "$run_tmp/policy.out")")"
    check "a policy-rc.d whose owner (a script of the stage) was KILLed: the original back when the stage ends" original \
        "$(cat "$POLICY_RC_D" 2> /dev/null)"
else
    echo "test-sh-test: not root: the policy-rc.d check skipped" >&2
fi

# 3. loop_devices_work stopped as an interrupt or an expired limit stops a stage (kill_tree: TERM
#    to every process of the stage's session at once) while its file system is mounted: nothing
#    of it left mounted or attached. (Only where loop_devices_work, tried for real first,
#    succeeds: root, losetup, mkfs.ext4 and mount there, and a loop device that attaches, formats
#    and mounts. Elsewhere the stand-in's mount would never be reached, and the check would wait
#    30 s and fail. In the check its mount is a stand-in that mounts, then hangs.)
if loop_devices_work; then
    mkdir -p "$run_tmp/bin"
    # The mount point written once the real mount has returned: written before, the poll below
    # could look while the mount was still under way and find nothing mounted.
    # shellcheck disable=SC2016 # expanded by the stand-in
    printf '#!/usr/bin/env bash\n%q "$@" || exit\necho "$2" > %q\nexec sleep 60\n' "$(command -v mount)" "$run_tmp/mounted" > "$run_tmp/bin/mount"
    chmod +x "$run_tmp/bin/mount"
    # shellcheck disable=SC2016 # expanded by the stage's shell
    PATH="$run_tmp/bin:$PATH" setsid -w bash -c '. "$1" && loop_devices_work' loop "$run_tmp/functions.sh" < /dev/null > /dev/null 2>&1 &
    loop=$!
    for ((tenths = 0; tenths < 300; tenths++)); do [ -s "$run_tmp/mounted" ] && break; sleep 0.1; done
    mnt=$(cat "$run_tmp/mounted" 2> /dev/null)
    check "loop_devices_work: its file system mounted (the stand-in mount ran)" yes "$([ -n "$mnt" ] && mountpoint -q "$mnt" && echo yes || echo no)"
    # The paths as the kernel writes them (mountinfo, backing_file: canonical), resolved now
    # while they exist: with a TMPDIR not canonical (/tmp//x/.., a symlink) the strings
    # compared below would never match, and the check could never fail.
    dir=$(readlink -f "${mnt%/mnt}" 2> /dev/null)
    mnt=${dir:-/nonexistent}/mnt image=${dir:-/nonexistent}/disk.img
    # The loop device, recorded now: the undo removes the image, after which `losetup -j` on
    # it lists nothing, whether or not a device is still attached to the deleted file.
    nodes=$(losetup --list -n -O NAME -j "$image" 2> /dev/null)
    check "loop_devices_work: a loop device attached to its file" yes "$([ -n "$nodes" ] && echo yes || echo no)"
    # The device held open (as udev's blkid probe holds it after the umount, on a machine with
    # udev) from before the stop until half a second after: the kernel defers the detach of a
    # device still open until its last close (losetup -d succeeds), so a working undo must
    # not be judged by a single look right after kill_tree.
    node=${nodes%%$'\n'*}
    [ -z "$node" ] || exec 9< "$node"
    kill_tree "$loop"
    # The copy of fd 9 that the background sleep inherits is the last: closed as it ends.
    [ -z "$node" ] || { sleep 0.5 & }
    exec 9<&-
    # Still attached: the device's backing_file names the image (with " (deleted)" once it
    # is removed); a device detached has none, or one of another user's that took it since.
    # Looked at for up to 3 s, until none is (a deferred detach done).
    still_attached() {
        local node
        attached=
        for node in $nodes; do
            case $(cat "/sys/block/${node#/dev/}/loop/backing_file" 2> /dev/null) in
                "$image" | "$image (deleted)") attached+="$node " ;;
            esac
        done
        [ -n "$attached" ]
    }
    # The mount looked at the same way (a loaded machine may let the undo's umount land a moment
    # after the processes kill_tree waited for have gone).
    for ((tenths = 0; tenths < 30; tenths++)); do
        left=$(grep -c " $mnt " /proc/self/mountinfo)
        still_attached || [ "$left" != 0 ] || break
        sleep 0.1
    done
    check "loop_devices_work stopped while mounted: nothing left mounted, no loop device left on its file" "0 " "$left $attached"
    # What a failure left, undone.
    [ "$left" = 0 ] || umount "$mnt"
    for node in $attached; do losetup -d "$node"; done
else
    echo "test-sh-test: loop_devices_work fails here (not root, no losetup, mkfs.ext4 or mount, or no loop device that attaches, formats and mounts): the loop-device check skipped" >&2
fi

# 4. The cluster stage's cargo tests, each with TUTTI_REQUIRE_ETCD=1 (without it a test that finds
#    no etcd skips, and the stage passes testing nothing), through a stand-in cargo that writes
#    down what it was run with and passes one test; the installs (ensure_*) stood in for too.
mkdir -p "$run_tmp/cargo-bin"
# shellcheck disable=SC2016 # expanded by the stand-in
printf '#!/usr/bin/env bash\necho "${TUTTI_REQUIRE_ETCD:-unset} $*" >> %q\necho "test result: ok. 1 passed; 0 failed"\n' \
    "$run_tmp/cargo.log" > "$run_tmp/cargo-bin/cargo"
chmod +x "$run_tmp/cargo-bin/cargo"
(
    ensure_build() { :; }
    ensure_protoc() { :; }
    ensure_etcd() { :; }
    PATH="$run_tmp/cargo-bin:$PATH" stage_cluster
) > "$run_tmp/cluster.out" 2>&1
check "the cluster stage with a stand-in cargo passes" 0 "$?"
check "the cluster stage: 4 cargo tests, every one with TUTTI_REQUIRE_ETCD=1" "4 0" \
    "$(grep -c ' test ' "$run_tmp/cargo.log") $(grep ' test ' "$run_tmp/cargo.log" | grep -vc '^1 ')"

# 5. A reaped stage shell's pid, taken by another process since: stood in for by a live process
#    of this script's session with a child (the reuse itself cannot be made to happen), passed
#    as kill_tree's and tree_snapshot's root once reaped, as run_stage passes the stage's pid
#    after its wait.
bash -c 'sleep 60 & wait' > /dev/null 2>&1 &
reuser=$!
for ((tenths = 0; tenths < 50; tenths++)); do
    grep -qs "^PPid:[[:space:]]*$reuser$" /proc/[0-9]*/status && break
    sleep 0.1
done
check "tree_snapshot of a reaped stage's pid: not the children of the process that has it now" "" \
    "$(tree_snapshot "$reuser" reaped)"
kill_tree "$reuser" "" reaped > /dev/null 2>&1
check "kill_tree of a reaped stage's pid: the process that has it now left alone" running "$(ended "$reuser" && echo ended || echo running)"
check "kill_tree of a reaped stage's pid: nothing reported killed" 0 "${#killed[@]}"
kill_tree "$reuser" > /dev/null 2>&1 # (its child too)

if [ "$failures" -gt 0 ]; then
    echo "test-sh-test: $failures check(s) failed" >&2
    exit 1
fi
echo "test-sh-test: all checks passed" >&2
