# shellcheck shell=bash
# A "sitting": a script under test run in a session (and process group) of its own, as at a
# terminal, whose pid (the session's id) a test keeps in $sitting; what tools/bench-scripts-test.sh
# and tools/stage-scripts-test.sh share to interrupt one and see what it leaves behind. Needs
# tools/lib/process.sh (session_pids) sourced first.

# sitting_ends BOUND_S: $ended, the sitting's exit status once it ends within BOUND_S seconds, or
# "running"; then $left, whatever is left in its session (its steps' own process groups
# included; "unknown" when /proc cannot be read), which is killed.
sitting_ends() {
    local tenths
    for ((tenths = 0; tenths < $1 * 10; tenths++)); do
        kill -0 "$sitting" 2> /dev/null || break
        sleep 0.1
    done
    ended=running
    if ! kill -0 "$sitting" 2> /dev/null; then
        wait "$sitting"
        ended=$?
    fi
    left=$(session_pids "$sitting" | tr '\n' ' ') || left=unknown
    # shellcheck disable=SC2086 # the pids are words
    [ -z "$left" ] || [ "$left" = unknown ] || kill -KILL $left 2> /dev/null
    [ "$ended" != running ] || wait "$sitting" 2> /dev/null
}

# sitting_sleeps: waits (up to 10 s) until a process named sleep (a stand-in's step) runs in the
# sitting's session; status 1 if none came.
sitting_sleeps() {
    local tenths pid
    for ((tenths = 0; tenths < 100; tenths++)); do
        for pid in $(session_pids "$sitting"); do
            [ "$(cat "/proc/$pid/comm" 2> /dev/null)" != sleep ] || return 0
        done
        sleep 0.1
    done
    return 1
}
