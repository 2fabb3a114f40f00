#!/usr/bin/env bash
# tools/vm/harness-test.sh — checks the VM harness's boot logic (tools/vm/lib.sh: vm_boot) without
# QEMU: a stand-in "QEMU" script plays the guest. Run by tools/vm-test.sh before it boots, and
# alone: `tools/vm/harness-test.sh` (about 40 s, no root, no downloads).
#
# Cases:
# 1. back to back: run A reports its result and exits at once; run B starts right away in the
#    same TUTTI_VM_DIR and takes longer than A's exit grace. A's exit watchdog must not stop B
#    (it once read the shared pid file when it fired, and so killed the next run's QEMU).
# 2. a guest that reports its result but never exits is stopped by the watchdog after the grace
#    period, and its reported status still counts; a guest that exits within it leaves nothing of
#    the watchdog running (tools/test.sh's vm stage fails a script that leaves a process behind).
# 3. the per-step summary (vm_step_summary) tells passed, failed, optional-failed and unfinished
#    commands apart.
# 4. a line the guest prints in two parts, further apart than the console read's 2 s timeout,
#    is logged as one line.
# 5. a guest command killed by a signal (status above 127: 143 for timeout's TERM, 137 for the
#    OOM killer) is reported as such: /init can only pass 0..127 to isa-debug-exit, so QEMU exits
#    255 and the host takes the status the guest printed.
# 6. tools/vm/tuttid-stage.sh (the guest's tuttid step) with stand-in tuttid and tuttid-client:
#    a daemon that ignores SIGTERM fails the step within its exit bound (TUTTID_STAGE_EXIT_S),
#    naming it, instead of waiting for ever; one that drains and exits 0 passes. Needs python3
#    (the stand-in binds a Unix socket); skipped without it.
# 7. vm_extract_vmlinux takes a vmlinux only whole: synthetic bzImages (zeros, an ELF compressed
#    with xz or zstd, the 4-byte size a kernel build appends, trailing bytes) are extracted byte
#    for byte; a stream cut short, and a whole stream of an ELF cut in half (a vmlinux written to
#    a full disk), are refused. Needs xz, zstd and python3 (vm_install_host_tools installs them);
#    skipped without.
# 8. Ctrl-C (SIGINT to the harness's process group, under setsid as at a terminal) while a host
#    package step hangs (stand-ins: apt-get install, apt-get download, and as root dpkg
#    --configure -a; each under `timeout`, a process group of its own that the terminal's SIGINT
#    misses) ends the harness with 130 within seconds, saying so on its standard error (not only
#    in the step's log), nothing of it left running, no policy-rc.d left in place.
# 9. a QEMU that crashes (SIGSEGV) before the guest reports is booted again once, by default:
#    a crash then a clean run passes, saying so and keeping the crashed run's log; two crashes
#    fail with 125; a guest that exits without a result and without a crash is not booted again.
set -euo pipefail
HERE=$(dirname "$(readlink -f "$0")")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export TUTTI_VM_DIR=$WORK/vm
mkdir -p "$TUTTI_VM_DIR/logs"
# shellcheck source=tools/vm/lib.sh
. "$HERE/lib.sh"
# session_pids (what a boot left running).
# shellcheck source=tools/lib/process.sh
. "$HERE/../lib/process.sh"
# sitting, sitting_ends, sitting_sleeps (case 8).
# shellcheck source=tools/lib/sitting.sh
. "$HERE/../lib/sitting.sh"

# The stand-in QEMU: writes its pid file like QEMU's -pidfile, prints what the guest's /init
# prints, and exits as isa-debug-exit makes QEMU exit ((rc << 1) | 1, rc capped at 127 as /init
# caps it). FAKE_RUN_S: guest run time before the result; FAKE_HANG_S: time it then stays up;
# FAKE_RC: the status the guest reports (default 0). FAKE_CRASHES: a file holding how many runs
# are still to crash (SIGSEGV before the result; each crash takes one off). FAKE_NO_RESULT: exit
# with that status without a result.
cat > "$WORK/fake-qemu" << 'FAKE'
#!/usr/bin/env bash
pidfile=""
while [ $# -gt 0 ]; do
    [ "$1" = -pidfile ] && pidfile=$2
    shift
done
[ -n "$pidfile" ] && echo $$ > "$pidfile"
echo "TUTTI_VM: init started at uptime 0.1s"
if [ -n "${FAKE_CRASHES:-}" ] && [ "$(cat "$FAKE_CRASHES")" -gt 0 ]; then
    echo $(($(cat "$FAKE_CRASHES") - 1)) > "$FAKE_CRASHES"
    ulimit -c 0
    kill -SEGV $$
fi
[ -n "${FAKE_NO_RESULT:-}" ] && exit "$FAKE_NO_RESULT"
sleep "${FAKE_RUN_S:-0}"
[ -n "${FAKE_LINES:-}" ] && printf '%s\n' "$FAKE_LINES"
# FAKE_SPLIT="A|B": prints A, pauses past the harness's read timeout, then B and a newline.
[ -n "${FAKE_SPLIT:-}" ] && { printf '%s' "${FAKE_SPLIT%%|*}"; sleep 3; printf '%s\n' "${FAKE_SPLIT#*|}"; }
rc=${FAKE_RC:-0}
echo "TUTTI_VM_RESULT rc=$rc"
# `exec`, so that stopping this pid ends the output as stopping QEMU does.
[ "${FAKE_HANG_S:-0}" -gt 0 ] && exec sleep "$FAKE_HANG_S"
[ "$rc" -gt 127 ] && rc=127
exit $(((rc << 1) | 1))
FAKE
chmod +x "$WORK/fake-qemu"
export TUTTI_VM_QEMU=$WORK/fake-qemu TUTTI_VM_EXIT_GRACE_S=2 TUTTI_VM_BOOT_RETRIES=0
VM_VMLINUX=/dev/null
VM_NVME_ARGS=()
failures=0
check() {
    local what=$1 expected=$2 got=$3
    if [ "$got" = "$expected" ]; then
        vm_log "harness-test: ok: $what"
    else
        vm_log "harness-test: FAILED: $what: expected $expected, got $got"
        failures=$((failures + 1))
    fi
}

# 1. Back to back.
FAKE_RUN_S=0 FAKE_HANG_S=0 vm_boot /dev/null "$WORK/a.log" 2> "$WORK/a.err"
check "first run passes" 0 "$VM_GUEST_RC"
FAKE_RUN_S=$((TUTTI_VM_EXIT_GRACE_S + 2)) FAKE_HANG_S=0 vm_boot /dev/null "$WORK/b.log" 2> "$WORK/b.err"
check "a run started right after another passes (the first run's watchdog leaves it alone)" 0 "$VM_GUEST_RC"
check "no watchdog fired in the second run" no "$([ -f "$WORK/b.log.watchdog" ] && echo yes || echo no)"

# 2. A guest that hangs on its way out.
FAKE_RUN_S=0 FAKE_HANG_S=30 vm_boot /dev/null "$WORK/c.log" 2> "$WORK/c.err"
check "a guest hanging after its result is stopped and its result counts" 0 "$VM_GUEST_RC"
check "the watchdog fired for it" yes "$([ -f "$WORK/c.log.watchdog" ] && echo yes || echo no)"
check "within the grace period (+ slack)" yes "$(awk -v s="$VM_WALL_S" -v g="$TUTTI_VM_EXIT_GRACE_S" 'BEGIN { print (s < g + 8) ? "yes" : "no" }')"
check "no pid files left behind" 0 "$(find "$TUTTI_VM_DIR" -name 'qemu.*.pid' | wc -l)"
# A guest that exits a second after it reports (the watchdog is running by then), with a grace
# far longer: nothing of the boot (its exit watchdog included) still runs once vm_boot has
# returned. In a session of its own
# (setsid execs: a foreground command of this script leads no group), whose id is the pid the
# shell writes, looked at once it has ended.
# shellcheck disable=SC2016 # expanded by the inner shell
FAKE_HANG_S=1 TUTTI_VM_EXIT_GRACE_S=60 setsid -w bash -c 'echo $$ > "$1" && . "$2" && VM_VMLINUX=/dev/null VM_NVME_ARGS=() && vm_boot /dev/null "$3"' \
    boot "$WORK/h.sid" "$HERE/lib.sh" "$WORK/h.log" 2> "$WORK/h.err" < /dev/null || true
left=$(session_pids "$(cat "$WORK/h.sid")" | tr '\n' ' ')
check "a guest that exits within its grace: nothing of its boot left running (its exit watchdog stopped)" "" "$left"
# shellcheck disable=SC2086 # the pids are words
[ -z "$left" ] || kill -KILL $left 2> /dev/null || true

# 3. Step summary.
FAKE_LINES='TUTTI_VM: command 1 started at 1.0s: nvme-conformance --device vfio:0000:00:04.0
TUTTI_VM: command 1 finished: rc=0 after 2.5s
TUTTI_VM: command 2 started at 3.5s: objstore-roundtrip --device vfio:0000:00:04.0
TUTTI_VM: command 2 finished: rc=1 after 0.4s
TUTTI_VM_OPTIONAL_FAILED command=2 rc=1: objstore-roundtrip --device vfio:0000:00:04.0
TUTTI_VM: command 3 started at 4.0s: false
TUTTI_VM: command 3 finished: rc=1 after 0.0s
TUTTI_VM: command 4 started at 4.1s: sleep 1000' vm_boot /dev/null "$WORK/d.log" 2> "$WORK/d.err"
summary=$(vm_step_summary "$WORK/d.log")
check "step 1 passed" 1 "$(grep -c 'step 1: PASS .*nvme-conformance' <<< "$summary")"
check "step 2 failed, allowed" 1 "$(grep -c 'step 2: FAIL (optional: allowed) *rc=1 .*objstore-roundtrip' <<< "$summary")"
check "step 3 failed" 1 "$(grep -c 'step 3: FAIL  *rc=1 .*false' <<< "$summary")"
check "step 4 never finished" 1 "$(grep -c 'step 4: NO RESULT .*sleep 1000' <<< "$summary")"

# 4. A line split by a pause.
FAKE_SPLIT='JSON_BEGIN ours rand|read-4k-qd1' vm_boot /dev/null "$WORK/e.log" 2> "$WORK/e.err"
check "a line printed in two parts is logged whole" 1 "$(grep -c '^\[guest  *[0-9.]*s\] JSON_BEGIN ours randread-4k-qd1$' "$WORK/e.log")"

# 5. A command killed by a signal.
FAKE_RC=143 vm_boot /dev/null "$WORK/f.log" 2> "$WORK/f.err"
check "a guest status above 127 (QEMU exits 255) is taken as reported" 143 "$VM_GUEST_RC"
FAKE_RC=3 vm_boot /dev/null "$WORK/g.log" 2> "$WORK/g.err"
check "a guest status below 128 is taken as reported" 3 "$VM_GUEST_RC"

# 9. QEMU crashes. (TUTTI_VM_BOOT_RETRIES is 0 above; 1 is the default.)
echo 1 > "$WORK/crashes"
FAKE_CRASHES=$WORK/crashes TUTTI_VM_BOOT_RETRIES=1 vm_boot /dev/null "$WORK/i.log" 2> "$WORK/i.err"
check "a QEMU crash, then a clean boot: the guest's result" 0 "$VM_GUEST_RC"
check "the crash is said, with its signal" 1 "$(grep -c 'QEMU itself crashed (QEMU status 139: signal 11).*attempt 1 of 2' "$WORK/i.err")"
check "the crashed run's console log is kept" yes "$([ -s "$WORK/i.log.crashed.0" ] && echo yes || echo no)"
echo 2 > "$WORK/crashes"
FAKE_CRASHES=$WORK/crashes TUTTI_VM_BOOT_RETRIES=1 vm_boot /dev/null "$WORK/j.log" 2> "$WORK/j.err"
check "a QEMU that crashes on every boot fails (no result)" 125 "$VM_GUEST_RC"
check "booted twice" 2 "$(grep -c 'QEMU itself crashed' "$WORK/j.err")"
FAKE_NO_RESULT=3 TUTTI_VM_BOOT_RETRIES=1 vm_boot /dev/null "$WORK/k.log" 2> "$WORK/k.err"
check "a guest that ends without a result, QEMU not crashed: no result, not booted again" "125 1" "$VM_GUEST_RC $(grep -c 'qemu: ' "$WORK/k.err")"

# 6. tuttid-stage.sh's wait for the daemon after SIGTERM.
if command -v python3 > /dev/null; then
    mkdir -p "$WORK/stage-bin"
    cat > "$WORK/stage-bin/tuttid" << 'FAKE'
#!/bin/sh
# The stand-in daemon: listens on --socket; on SIGTERM removes it and exits 0, or with
# FAKE_TUTTID_STUCK=1 ignores SIGTERM. `tuttid --status SOCKET` succeeds.
[ "$1" = --status ] && exit 0
socket=
while [ $# -gt 0 ]; do [ "$1" = --socket ] && socket=$2; shift; done
exec python3 -c '
import os, signal, socket, sys, time
def stop(*_):
    os.unlink(sys.argv[1])
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("FAKE_TUTTID_STUCK") == "1" else stop)
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen()
time.sleep(30)
' "$socket"
FAKE
    printf '#!/bin/sh\nexit 0\n' > "$WORK/stage-bin/tuttid-client"
    chmod +x "$WORK/stage-bin/tuttid" "$WORK/stage-bin/tuttid-client"
    stage_shell=sh
    command -v busybox > /dev/null && stage_shell="busybox sh" # the guest's shell
    export TUTTID_STAGE_SOCKET=$WORK/tuttid.sock
    started=$SECONDS
    # shellcheck disable=SC2086 # "busybox sh" is two words
    PATH=$WORK/stage-bin:$PATH FAKE_TUTTID_STUCK=1 TUTTID_STAGE_EXIT_S=1 timeout 20 $stage_shell "$HERE/tuttid-stage.sh" --device vfio:x > "$WORK/stage-stuck.err" 2>&1 && status=0 || status=$?
    check "tuttid-stage: a daemon ignoring SIGTERM fails the step" 1 "$status"
    check "tuttid-stage: within its exit bound (+ slack)" yes "$([ $((SECONDS - started)) -lt 10 ] && echo yes || echo no)"
    check "tuttid-stage: the failure says so" 1 "$(grep -c 'tuttid did not exit within 1 s of SIGTERM' "$WORK/stage-stuck.err")"
    rm -f "$TUTTID_STAGE_SOCKET"
    # shellcheck disable=SC2086
    PATH=$WORK/stage-bin:$PATH FAKE_TUTTID_STUCK=0 TUTTID_STAGE_EXIT_S=5 timeout 20 $stage_shell "$HERE/tuttid-stage.sh" --device vfio:x > "$WORK/stage-ok.err" 2>&1 && status=0 || status=$?
    check "tuttid-stage: a daemon that drains and exits 0 passes" 0 "$status"
    rm -f "$TUTTID_STAGE_SOCKET"
else
    vm_log "harness-test: no python3: the tuttid-stage checks are skipped"
fi

# 7. vm_extract_vmlinux: whole streams of whole ELFs only.
if command -v xz > /dev/null && command -v zstd > /dev/null && command -v python3 > /dev/null; then
    elf=$WORK/elf
    cp "$BASH" "$elf" # an ELF executable at hand (python3 on PATH may be a wrapper script)
    head -c $(($(stat -c %s "$elf") / 2)) "$elf" > "$WORK/elf-cut"
    # bzimage NAME COMPRESSOR ELF [CUT_BYTES]: what a bzImage looks like around its payload.
    bzimage() {
        local name=$1 compress=$2 payload=$3 cut=${4:-0} length size
        $compress < "$payload" > "$WORK/payload"
        length=$(stat -c %s "$WORK/payload")
        size=$(stat -c %s "$payload")
        {
            head -c 4096 /dev/zero
            head -c $((length - cut)) "$WORK/payload"
            if [ "$cut" = 0 ]; then
                python3 -c 'import struct, sys; sys.stdout.buffer.write(struct.pack("<I", int(sys.argv[1]) & 0xffffffff))' "$size"
                head -c 3000 /dev/zero | tr '\0' 'A'
            fi
        } > "$WORK/$name"
    }
    # extracted NAME: "whole" (the ELF byte for byte), "refused", or "differs".
    extracted() {
        rm -f "$WORK/vmlinux-out"
        # In a subshell: a refusal is vm_die, which exits.
        if (vm_extract_vmlinux "$WORK/$1" "$WORK/vmlinux-out") 2>> "$WORK/extract.err"; then
            cmp -s "$WORK/vmlinux-out" "$elf" && echo whole || echo differs
        else
            echo refused
        fi
    }
    for compressor in 'xz -c --check=crc32' 'zstd -19 -qc'; do
        tool=${compressor%% *}
        bzimage "$tool-whole" "$compressor" "$elf"
        bzimage "$tool-cut" "$compressor" "$elf" 5000
        bzimage "$tool-of-cut-elf" "$compressor" "$WORK/elf-cut"
        check "vmlinux: a whole $tool stream of a whole ELF is extracted" whole "$(extracted "$tool-whole")"
        check "vmlinux: a $tool stream cut short is refused" refused "$(extracted "$tool-cut")"
        check "vmlinux: a whole $tool stream of a truncated ELF is refused" refused "$(extracted "$tool-of-cut-elf")"
    done
else
    vm_log "harness-test: no xz, zstd or python3: the vmlinux extraction checks are skipped"
fi

# 8. Ctrl-C in a host package step. The stand-ins: QEMU missing (so its package is installed),
#    dpkg and dpkg-query that know nothing, and HANG (apt-get, or dpkg's --configure) that runs
#    sleep 60 in its place. policy-rc.d and its lock are the test's own (dpkg_configure_pending
#    puts one in place as root). STEP runs with lib.sh sourced, in a session of its own.
mkdir -p "$WORK/host-bin" "$WORK/policy" "$TUTTI_VM_DIR/debs"
printf '#!/bin/sh\nexit 1\n' > "$WORK/host-bin/qemu-system-x86_64"
printf '#!/bin/sh\nexit 1\n' > "$WORK/host-bin/dpkg-query"
# shellcheck disable=SC2016 # expanded by the stand-in
printf '#!/bin/sh\n[ "${HANG:-}" != apt-get ] || exec sleep 60\nexit 1\n' > "$WORK/host-bin/apt-get"
# shellcheck disable=SC2016 # expanded by the stand-in
printf '#!/bin/sh\n[ "${HANG:-} $1" != "dpkg --configure" ] || exec sleep 60\nexit 0\n' > "$WORK/host-bin/dpkg"
chmod +x "$WORK/host-bin"/*
interrupted_step() { # WHAT HANG STEP [ENV...]
    local what=$1 hang=$2 step=$3
    shift 3
    # shellcheck disable=SC2016 # expanded by the inner shell
    setsid env --default-signal=INT PATH="$WORK/host-bin:$PATH" HANG="$hang" TUTTI_VM_SKIP_APT=0 "$@" bash -c \
        'set -euo pipefail && . "$1" && POLICY_RC_D=$2/policy-rc.d POLICY_RC_D_SAVED=$2/saved POLICY_RC_D_LOCK=$2/lock && "$3"' \
        step "$HERE/lib.sh" "$WORK/policy" "$step" < /dev/null > /dev/null 2> "$WORK/step-$hang-$step.err" &
    sitting=$!
    # (A step that never started would end at once: the checks after would pass without it.)
    check "$what: the stand-in's step started" yes "$(sitting_sleeps && echo yes || echo no)"
    sleep 1
    kill -INT -- "-$sitting"
    # (sitting_ends's `wait` returns the step's status: not to be taken for this script's failure.)
    set +e
    sitting_ends 10
    set -e
    check "$what: SIGINT in it: exit 130 within 10 s (the stand-in sleeps 60 s)" 130 "$ended"
    check "$what: SIGINT: nothing left of it running" "" "$left"
    check "$what: SIGINT: said on the script's standard error (not only in its log)" 1 \
        "$(grep -c "interrupted (SIGINT): '.*' stopped" "$WORK/step-$hang-$step.err")"
    check "$what: SIGINT: no policy-rc.d left in place" no "$([ -e "$WORK/policy/policy-rc.d" ] && echo yes || echo no)"
}
interrupted_step "vm_install_host_tools, apt-get install" apt-get vm_install_host_tools
interrupted_step "vm_prepare_kernel, apt-get download" apt-get vm_prepare_kernel TUTTI_VM_KERNEL_PACKAGE=linux-image-test
if [ "$(id -u)" -eq 0 ]; then
    interrupted_step "vm_install_host_tools, dpkg --configure -a" dpkg vm_install_host_tools
else
    vm_log "harness-test: not root: the dpkg --configure -a interrupt check is skipped"
fi

if [ "$failures" -gt 0 ]; then
    for log in "$WORK"/*.err; do sed "s|^|$(basename "$log"): |" "$log" >&2; done
    vm_log "harness-test: $failures check(s) failed"
    exit 1
fi
vm_log "harness-test: all checks passed"
