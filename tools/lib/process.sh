# shellcheck shell=bash
# tools/lib/process.sh — bounded steps that Ctrl-C still stops, and a look at a session's
# processes (tools/python/core-test.sh, tools/python/engine-test.sh, tools/gpu/check.sh,
# tools/lib/dpkg.sh and through it tools/vm/lib.sh and tools/check-bindings.sh, tools/test.sh's
# run_stage, and the tests of scripts: tools/bench-scripts-test.sh, tools/stage-scripts-test.sh,
# tools/vm/harness-test.sh). Sourced, not run; defines functions only.
#
#   interruptible_timeout SECONDS COMMAND [ARG...]
#       `timeout -k 30 SECONDS COMMAND ARG...`, whose status it returns (124 or 137 when the
#       limit expired), except that SIGINT, SIGTERM or SIGHUP to the calling shell stops COMMAND
#       (TERM to timeout, which passes it to its process group and KILLs the group 30 s later)
#       and then ends the calling shell with 130, 143 or 129 (its EXIT trap runs). COMMAND keeps
#       the caller's standard input. The caller's own INT, TERM and HUP traps are put back after.
#   timeout_interruptibly SECONDS COMMAND [ARG...]
#       the same, except that after a signal it returns (130, 143 or 129) instead of ending the
#       shell, with `_interrupted` set to INT, TERM or HUP (empty otherwise), for a caller that
#       has something to undo first (tools/lib/dpkg.sh: its policy-rc.d), and then ends itself
#       with interrupted_exit.
#   interrupted_exit WHAT
#       after timeout_interruptibly: when it was interrupted, says so on stderr (WHAT stopped)
#       and ends the shell with 130, 143 or 129; otherwise returns 0.
#   session_pids SID
#       prints the pids (one a line) of the processes of session SID still running (a zombie,
#       state Z, has ended: its parent has not reaped it yet, or an init that does not reap keeps
#       it, as tools/test.sh's kill_tree counts it); fails, saying so, when /proc cannot be read
#       (a check that nothing is left must not pass without looking).
#   proc_stat FILE
#       sets the array proc_fields to the fields of FILE (a /proc/PID/stat) that follow the
#       command name: [0] the state (stat's field 3), [1] the parent, [2] the process group,
#       [3] the session, [19] the start time (field 22); fails when FILE cannot be read (the
#       process has gone; reading to the end of the file is no failure, under set -e either).
#       tools/test.sh's tree_find, tree_snapshot, tree_running, kill_tree and bounded use it
#       too.
#
# Why interruptible_timeout: GNU timeout puts itself and COMMAND in a process group of their
# own, so the terminal's Ctrl-C (SIGINT to the foreground group, the script's) never reaches
# COMMAND; bash, waiting in the foreground for a child that did not die of the signal, takes it
# for handled and goes on to the next step. Run in the background, the wait is interruptible
# and the trap passes the signal on (as tools/vm/lib.sh's QEMU boot and tools/compare-lmcache.sh's
# rounds do). Background commands of a shell without job control start with SIGINT ignored:
# only the trap answers it.

interruptible_timeout() {
    local status=0
    timeout_interruptibly "$@" || status=$?
    interrupted_exit "$2"
    return "$status"
}

timeout_interruptibly() {
    local limit=$1 status saved
    shift
    saved=$(trap -p INT TERM HUP)
    _interrupted='' _timeout_pid=''
    # Trapped before timeout starts, so that no signal finds it started and untrapped. Each kill
    # ends in `|| :`: one that fails (timeout reaped already, its pid not yet cleared) would be a
    # trap action's last status, which under the caller's set -e ends the shell with 1, not
    # with 130, 143 or 129.
    trap '_interrupted=INT; [ -z "$_timeout_pid" ] || kill -TERM "$_timeout_pid" 2> /dev/null || :' INT
    trap '_interrupted=TERM; [ -z "$_timeout_pid" ] || kill -TERM "$_timeout_pid" 2> /dev/null || :' TERM
    trap '_interrupted=HUP; [ -z "$_timeout_pid" ] || kill -TERM "$_timeout_pid" 2> /dev/null || :' HUP
    # <&0: a background command's standard input would otherwise be /dev/null.
    timeout -k 30 "$limit" "$@" <&0 &
    _timeout_pid=$!
    [ -z "$_interrupted" ] || kill -TERM "$_timeout_pid" 2> /dev/null || :
    # A trapped signal ends the wait early: waited for again until timeout itself has ended
    # (within its -k 30 after the TERM).
    while :; do
        status=0
        wait "$_timeout_pid" || status=$?
        kill -0 "$_timeout_pid" 2> /dev/null || break
    done
    _timeout_pid=
    trap - INT TERM HUP
    eval "$saved"
    case $_interrupted in
        INT) return 130 ;;
        TERM) return 143 ;;
        HUP) return 129 ;;
    esac
    return "$status"
}

interrupted_exit() {
    case ${_interrupted:-} in
        # `|| :`: after a hangup standard error may be the hung-up terminal (EIO).
        INT) echo "$0: interrupted (SIGINT): '$1' stopped" >&2 || :; exit 130 ;;
        TERM) echo "$0: interrupted (SIGTERM): '$1' stopped" >&2 || :; exit 143 ;;
        HUP) echo "$0: interrupted (SIGHUP): '$1' stopped" >&2 || :; exit 129 ;;
    esac
    return 0
}

# The command name (field 2, in parentheses) is the executable's name as it was given: any
# bytes but NUL, spaces, parentheses and newlines included (a file named $'x\n) S 1 2' run).
# So the whole file is read (a line-wise read would stop inside the name and leave the fields
# after it out) and split after the last ") ", which the kernel writes after the name (no field
# after it holds one). Callers read ${proc_fields[N]:-}: a stat of a shape not foreseen must
# not end them under set -u, and declare proc_fields local.
proc_stat() {
    local line=''
    # -d '': to the end of the file; read then returns 1 although it read everything (`|| :`:
    # a caller under set -e, or a command substitution with inherit_errexit, would end there).
    { IFS= read -r -d '' line || :; } 2> /dev/null < "$1"
    [ -n "$line" ] || return 1
    read -r -a proc_fields <<< "${line##*") "}"
}

# /proc, not pgrep: procps is not on every fresh machine. Field 6 of stat is the session (the
# fields after the command, which may hold spaces and parentheses, start at field 3); field 3 is
# the state.
session_pids() {
    local sid=$1 stat proc_fields=()
    if ! proc_stat /proc/self/stat; then
        echo "$0: cannot read /proc: cannot tell which processes session $sid has" >&2
        return 1
    fi
    for stat in /proc/[0-9]*/stat; do
        proc_stat "$stat" || continue
        [ "${proc_fields[3]:-}" = "$sid" ] && [ "${proc_fields[0]:-}" != Z ] || continue
        stat=${stat#/proc/}
        echo "${stat%/stat}"
    done
}
