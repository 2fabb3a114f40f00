#!/bin/sh
# tuttid-stage.sh --device vfio:BDF [--device ...] — the VM stage's tuttid step, run inside the
# guest (busybox sh) by tools/vm-test.sh: tuttid formats a small pool over the controllers
# (through VFIO; clients' doorbells go through its relay, as BAR0 stays with it), then four
# tuttid-client processes, one after another: ranks 0 and 1 of TP 2 each store a prompt of 4
# blocks of 256 KiB, then each retrieves it into other blocks and checks every byte (2 MiB
# stored, 2 MiB checked); then SIGTERM, and the daemon must drain and exit 0. Every wait is
# bounded (the exit after SIGTERM by TUTTID_STAGE_EXIT_S, default 120 s); any failure kills the
# daemon and exits non-zero. --overwrite: the disks are the
# harness's scratch images, and what the earlier commands left on them (conformance's integrity
# data if objstore-roundtrip failed) is no reason to refuse; tuttid reads a vfio: namespace's
# head before a format and refuses anything but a tutti pool without it.
set -eu
socket=${TUTTID_STAGE_SOCKET:-/tmp/tuttid.sock} # another path: tools/vm/harness-test.sh
tuttid "$@" --socket "$socket" --lock-dir /tmp/tuttid-locks --metrics off --format --overwrite \
    --layers 4 --kv-heads 8 --head-dim 128 --slots 64 &
daemon=$!
fail() {
    echo "tuttid-stage: $*" >&2
    kill -KILL "$daemon" 2> /dev/null || true
    exit 1
}
tries=0
while [ ! -S "$socket" ]; do
    kill -0 "$daemon" 2> /dev/null || fail "tuttid exited before listening"
    tries=$((tries + 1))
    [ "$tries" -le 1200 ] || fail "tuttid did not listen within 120 s"
    sleep 0.1
done
for role in store retrieve; do
    for rank in 0 1; do
        tuttid-client "$role" --socket "$socket" --seed 11 --blocks 4 --rank "$rank" --world 2 --timeout-seconds 120 ||
            fail "tuttid-client $role rank $rank of 2 failed"
    done
done
tuttid --status "$socket" || fail "tuttid --status failed"
kill -TERM "$daemon"
# The drain is bounded (tuttid retries a refused queue deletion for ~21 s), but a daemon that
# never exits must fail the step, not hang it until the guest's command timeout: its exit is
# polled against a deadline (a process that has exited but is not reaped yet is a zombie, which
# kill -0 still finds), and only then reaped.
exit_s=${TUTTID_STAGE_EXIT_S:-120}
tries=0
while kill -0 "$daemon" 2> /dev/null &&
    [ "$(sed -n 's/^[0-9]* (.*) \([A-Za-z]\) .*/\1/p' "/proc/$daemon/stat" 2> /dev/null)" != Z ]; do
    tries=$((tries + 1))
    [ "$tries" -le $((exit_s * 10)) ] || fail "tuttid did not exit within $exit_s s of SIGTERM"
    sleep 0.1
done
status=0
wait "$daemon" || status=$?
[ "$status" = 0 ] || fail "tuttid exited with status $status after SIGTERM"
[ ! -e "$socket" ] || fail "tuttid left its socket behind"
echo "tuttid-stage: PASS"
