# tools/lib/dpkg.sh — what the scripts that install Debian packages share (tools/test.sh,
# tools/vm/lib.sh, tools/check-bindings.sh). Sourced, not run; defines functions and variables
# only.
#
#   dpkg_configure_pending     `dpkg --configure -a` (finishing an interrupted dpkg run, without
#                              which every apt-get install fails) with service starts forbidden;
#                              an etcd-server it configured is disabled and stopped after
#   forbid_service_starts / restore_own_policy_rc_d / clean_stale_policy_rc_d
#                              the policy-rc.d hook below
#   etcd_half_installed / disable_etcd_service
#   dpkg_installed PKG...      those of the packages dpkg lists as installed (to be reinstalled
#                              when a check that uses their files fails)
#   dpkg_damaged_depends PKG...  their installed dependencies (two levels) with files missing
#                              (reinstalled with them: the files are often a dependency's)
#
# Every `dpkg --configure -a` of these scripts goes through dpkg_configure_pending: an install of
# etcd-server that was interrupted (unpacked, not configured) is configured by the next one, and
# its post-install enables the service on port 2379 and starts it. Run bare, by whichever script
# installed something first, that left Debian's etcd enabled and running, and tools/test.sh's
# cluster stage, finding etcd installed, never disabled it.

# timeout_interruptibly and interrupted_exit (dpkg_configure_pending's bounded dpkg, which Ctrl-C
# still stops), and interruptible_timeout for the scripts that source this file.
# shellcheck source=tools/lib/process.sh
. "$(dirname "${BASH_SOURCE[0]}")/process.sh"

# Debian's policy-rc.d hook: while ours is in place (exit 101), package scripts start no service
# (invoke-rc.d and deb-systemd-invoke both ask it). One that was there before is kept aside
# (policy-rc.d.tutti-saved, next to it) and put back after. Ours is recognised by its marker
# line, which names its owner (the pid of the script that put it there, that process's start
# time and the boot id: a reused pid or a reboot is not mistaken for the owner) and whether it
# kept an original aside. One whose owner is gone (a run killed with SIGKILL, a reboot) is
# removed, its original put back, at the start and the end of every tools/test.sh run as root,
# after each of its stages (a script a stage ran, vm-test.sh or check-bindings.sh, may have been
# KILLed holding one) and before ours goes in; one whose owner still runs is waited for, and
# never removed by anyone but its owner.
# Every change of these files is made under a lock (flock), so two runs cannot interleave them.
# The marker keeps its first wording (tools/test.sh's), so that files earlier runs left are
# still recognised.
POLICY_RC_D=/usr/sbin/policy-rc.d
POLICY_RC_D_SAVED=$POLICY_RC_D.tutti-saved
POLICY_RC_D_LOCK=/run/lock/tutti-policy-rc.d.lock
POLICY_RC_D_MARK="# tools/test.sh: no service is started while it installs packages"
# The owner: the script that sourced this file (tools/test.sh hands its own to its stages'
# shells; a script a stage runs is an owner of its own).
main_pid=$$
boot_id() { cat /proc/sys/kernel/random/boot_id 2> /dev/null || echo unknown; }
# process_start PID: the process's start time (stat's field 22), or nothing if it is gone. A
# zombie (stat's field 3: Z) is gone: a script KILLed whose parent was killed with it may wait
# long for an init that reaps, and its policy-rc.d must not be taken for a live run's meanwhile.
# The whole file, split after the last ") ": the command name before it may hold spaces,
# parentheses and newlines, where a line-wise read would stop (as tools/lib/process.sh's
# proc_stat does).
process_start() {
    local line='' fields=()
    # -d '': to the end of the file; read then returns 1 although it read everything (`|| :`:
    # the scripts that source this file run under set -e, which would end them there).
    # A process gone (the redirection fails) prints nothing, its status 0 all the same.
    { IFS= read -r -d '' line || :; } 2> /dev/null < "/proc/$1/stat" || return 0
    [ -n "$line" ] || return 0
    read -r -a fields <<< "${line##*") "}"
    [ "${fields[0]:-}" = Z ] || echo "${fields[19]:-}"
}
policy_owner() { echo "$main_pid $(process_start "$main_pid") $(boot_id)"; }
# policy_rc_d_state sets `policy_state` to none, foreign (not ours), mine (this run's), live
# (another run's, whose owner still runs) or stale (its owner gone; the first format, without an
# owner, too), and `policy_saved` to whether the marked one kept an original aside.
policy_state= policy_saved=0
policy_rc_d_state() {
    local line pid start boot
    policy_saved=0
    [ -e "$POLICY_RC_D" ] || { policy_state=none && return 0; }
    line=$(grep -m1 -F "$POLICY_RC_D_MARK" "$POLICY_RC_D" 2> /dev/null) || { policy_state=foreign && return 0; }
    # "MARK (owner PID START BOOT_ID, saved 0|1)"
    read -r pid start boot policy_saved <<< "$(echo "${line#"$POLICY_RC_D_MARK"}" | sed -n 's/^ (owner \([0-9]*\) \([0-9]*\) \([^ ,]*\), saved \([01]\))$/\1 \2 \3 \4/p')"
    if [ -z "${pid:-}" ]; then
        # The first format, without an owner: what it kept aside is wherever the copy is.
        [ ! -e "$POLICY_RC_D_SAVED" ] || policy_saved=1
        policy_state=stale
    elif [ "$pid $start $boot" = "$(policy_owner)" ]; then
        policy_state=mine
    elif [ "$boot" = "$(boot_id)" ] && [ -n "$start" ] && [ "$(process_start "$pid")" = "$start" ]; then
        policy_state=live
    else
        policy_state=stale
    fi
}
# Puts back what the marked policy-rc.d kept aside (policy_saved, from policy_rc_d_state), or
# removes it; a kept copy it did not make is stale, and removed.
put_back_policy_rc_d() {
    if [ "$policy_saved" = 1 ] && [ -e "$POLICY_RC_D_SAVED" ]; then
        mv -f "$POLICY_RC_D_SAVED" "$POLICY_RC_D"
    else
        rm -f "$POLICY_RC_D" "$POLICY_RC_D_SAVED"
    fi
}
# Runs "$@" holding the lock (waiting up to a minute for it; then without it, saying so).
with_policy_lock() {
    local rc
    mkdir -p "${POLICY_RC_D_LOCK%/*}" 2> /dev/null
    {
        flock -w 60 9 || echo "$0: $POLICY_RC_D_LOCK still held after 60 s: going on without it" >&2
        "$@"
        rc=$?
    } 9> "$POLICY_RC_D_LOCK"
    return "$rc"
}
# A marked policy-rc.d whose owner is gone is removed (its original put back); a kept copy that
# no marked policy-rc.d accounts for (a run killed between copying and installing) is removed.
clean_stale_policy_rc_d_locked() {
    policy_rc_d_state
    case $policy_state in
        stale)
            if [ "$policy_saved" = 1 ]; then
                echo "$0: $POLICY_RC_D was an earlier run's that did not finish: the one it kept aside put back" >&2
            else
                echo "$0: $POLICY_RC_D was an earlier run's that did not finish: removed" >&2
            fi
            put_back_policy_rc_d
            ;;
        none | foreign) rm -f "$POLICY_RC_D_SAVED" ;;
    esac
}
clean_stale_policy_rc_d() { [ "$(id -u)" -ne 0 ] || with_policy_lock clean_stale_policy_rc_d_locked; }
# Status 2: another run's is in place (to be waited for).
forbid_service_starts_locked() {
    local saved=0
    clean_stale_policy_rc_d_locked
    policy_rc_d_state
    case $policy_state in
        live) return 2 ;;
        mine) return 0 ;;
        foreign) cp -p "$POLICY_RC_D" "$POLICY_RC_D_SAVED" && saved=1 || return 1 ;;
    esac
    printf '#!/bin/sh\n%s (owner %s, saved %s)\nexit 101\n' "$POLICY_RC_D_MARK" "$(policy_owner)" "$saved" > "$POLICY_RC_D.tutti-new" &&
        chmod 755 "$POLICY_RC_D.tutti-new" && mv -f "$POLICY_RC_D.tutti-new" "$POLICY_RC_D"
}
forbid_service_starts() {
    local rc waited=0
    while :; do
        with_policy_lock forbid_service_starts_locked
        rc=$?
        [ "$rc" = 2 ] || return "$rc"
        if [ "$waited" -ge 1800 ]; then
            echo "$0: another run's $POLICY_RC_D is still in place after $waited s" >&2
            return 1
        fi
        [ "$waited" -gt 0 ] || echo "$0: another run is installing packages with $POLICY_RC_D in place: waiting for it"
        sleep 5
        waited=$((waited + 5))
    done
}
# Ours (this run's) is removed, whichever process of the run asks; another run's never.
restore_own_policy_rc_d_locked() {
    policy_rc_d_state
    [ "$policy_state" != mine ] || put_back_policy_rc_d
}
restore_own_policy_rc_d() {
    [ "$(id -u)" -eq 0 ] && [ -e "$POLICY_RC_D" ] || return 0
    with_policy_lock restore_own_policy_rc_d_locked
}

# An install of etcd-server that was interrupted (unpacked, not configured, or in between): its
# binary may run, but the next `dpkg --configure -a` would enable and start the service.
etcd_half_installed() {
    local status
    status=$(dpkg-query -W -f='${Status}' etcd-server 2> /dev/null) || return 1
    case $status in "" | "install ok installed" | *" not-installed" | *" config-files") return 1 ;; esac
}
# etcd-server's post-install enables its service on port 2379 and starts it (with systemd, or
# its init.d script without): the project never uses it (its tests start their own members on
# free ports), so wherever one of these scripts installed or configured it, it is disabled, and
# stopped should it run regardless.
disable_etcd_service() {
    [ "$(id -u)" -eq 0 ] || return 0
    if [ -d /run/systemd/system ] && command -v systemctl > /dev/null 2>&1; then
        systemctl disable --now etcd > /dev/null 2>&1 || true
    elif [ -x /etc/init.d/etcd ]; then
        update-rc.d etcd disable > /dev/null 2>&1 || true
        /etc/init.d/etcd status > /dev/null 2>&1 && { /etc/init.d/etcd stop > /dev/null 2>&1 || true; }
    fi
    return 0
}

# dpkg_configure_pending [LOG]: `dpkg --configure -a` (bounded; its output to LOG, default
# /dev/null) with service starts forbidden, unless this process already forbade them (then they
# stay forbidden after); an etcd-server it found half-installed is disabled (and stopped) after.
# As root only (dpkg needs it); never fails: what it could not finish, the apt-get after reports.
# SIGINT, SIGTERM or SIGHUP while dpkg runs (a bare `timeout` puts it in a process group of its
# own, which the terminal's Ctrl-C misses, and the script went on) stops it, puts the
# policy-rc.d back (unless it was the caller's already) and ends the script with 130, 143 or 129.
dpkg_configure_pending() {
    local log=${1:-/dev/null} etcd_pending=0 ours=0
    [ "$(id -u)" -eq 0 ] || return 0
    ! etcd_half_installed || etcd_pending=1
    with_policy_lock policy_rc_d_state
    if [ "$policy_state" = mine ]; then
        ours=1
    elif ! forbid_service_starts; then
        echo "$0: cannot put $POLICY_RC_D in place: not running 'dpkg --configure -a'" >&2
        return 0
    fi
    timeout_interruptibly 600 dpkg --configure -a >> "$log" 2>&1 || true
    [ "$ours" = 1 ] || restore_own_policy_rc_d
    interrupted_exit "dpkg --configure -a"
    if [ "$etcd_pending" = 1 ]; then
        echo "$0: etcd-server was half-installed (an interrupted install): configured with service starts forbidden, its service disabled" >&2
        disable_etcd_service
    fi
    return 0
}

# dpkg_installed PKG...: prints (one a line) those of the packages dpkg lists as installed.
# Such a package whose files are gone (deleted by hand, a broken image) is what a check that uses
# the files finds missing while `apt-get install PKG` does nothing ("already the newest
# version"): the callers reinstall it (`apt-get install --reinstall`) instead.
dpkg_installed() {
    local package
    for package in "$@"; do
        [ "$(dpkg-query -W -f='${Status}' "$package" 2> /dev/null)" != "install ok installed" ] || echo "$package"
    done
    return 0
}

# dpkg_damaged_depends PKG...: prints (one a line) the installed packages among the Depends
# and Pre-Depends of PKG, and among theirs (two levels: a metapackage, then the versioned package
# it names, which holds the files: gcc -> cpp -> cpp-12 has cc1, g++ -> g++-12 ->
# libstdc++-12-dev), of which `dpkg --verify` finds files missing (conffiles aside: a reinstall
# does not put those back). Reinstalling PKG alone puts back none of their files. Each installed
# instance is verified by its own name (libc6:amd64 and libc6:i386 on a multiarch host: the bare
# name is ambiguous to dpkg --verify, which then fails), and a missing file that dpkg's
# path-exclude settings leave out (slim images drop /usr/share/doc and the like; a reinstall
# leaves them out again) does not count. Safe under set -e (the VM scripts run with it): a
# failing dpkg --verify (a timeout) counts as nothing found, not as the end of the list.
dpkg_damaged_depends() {
    local level package dep instance status verified path
    local -A seen=()
    local current=("$@") next=() filters=()
    dpkg_path_filters
    for package in "$@"; do seen[$package]=1; done
    for level in 1 2; do
        next=()
        for package in "${current[@]}"; do
            # One alternative a line, its version and architecture qualifiers dropped.
            for dep in $(dpkg-query -W -f='${Depends},${Pre-Depends}\n' "$package" 2> /dev/null |
                tr ',|' '\n\n' | sed -E 's/\(.*\)//; s/:[a-z0-9]+//; s/[[:space:]]//g'); do
                [ -z "${seen[$dep]:-}" ] || continue
                seen[$dep]=1
                # Each installed instance (one a line: its name, architecture-qualified where
                # several may be installed, and its status).
                while read -r instance status; do
                    [ "$status" = "install ok installed" ] || continue
                    next+=("$instance")
                    # Captured, not piped into grep -q: under pipefail, grep leaving early would
                    # make dpkg's SIGPIPE the pipeline's status.
                    verified=$(timeout -k 10 300 dpkg --verify "$instance" 2> /dev/null) || true
                    while read -r path; do
                        if ! dpkg_path_excluded "$path"; then
                            echo "$instance"
                            break
                        fi
                    done < <(sed -nE 's/^missing +(\/.*)$/\1/p' <<< "$verified")
                done < <(dpkg-query -W -f='${binary:Package} ${Status}\n' "$dep" 2> /dev/null || true)
            done
        done
        current=("${next[@]}")
    done
    return 0
}

# dpkg_path_filters: fills the caller's filters array with dpkg's path-exclude and path-include
# options, in the order dpkg reads them ("x PATTERN" or "i PATTERN"): the files of
# /etc/dpkg/dpkg.cfg.d in name order (the glob's, in the environment's collation, as dpkg's
# alphasort; only names of letters, digits, _ and -: dpkg skips foo.dpkg-old and editors'
# backups), then /etc/dpkg/dpkg.cfg, then ~/.dpkg.cfg; /etc under DPKG_CONFIG_ROOT when set,
# for tests.
dpkg_path_filters() {
    local file line name value root=${DPKG_CONFIG_ROOT:-}
    filters=()
    for file in "$root"/etc/dpkg/dpkg.cfg.d/* "$root"/etc/dpkg/dpkg.cfg "${HOME:-/nonexistent}/.dpkg.cfg"; do
        [ -f "$file" ] && [ -r "$file" ] || continue
        case $file in
            "$root"/etc/dpkg/dpkg.cfg.d/*) [[ $(basename "$file") =~ ^[A-Za-z0-9_-]+$ ]] || continue ;;
        esac
        while IFS= read -r line || [ -n "$line" ]; do
            line=${line#"${line%%[![:space:]]*}"}
            # As dpkg parses an option line: the name (letters, digits, -), one character
            # after it, at most one =, spaces, then the value (its trailing spaces dropped, and
            # its quotes when it starts and ends with the same " or '; unbalanced: an error to
            # dpkg, skipped here).
            name=${line%%[!A-Za-z0-9-]*}
            value=${line:${#name}+1}
            value=${value#=}
            value=${value#"${value%%[![:space:]]*}"}
            value=${value%"${value##*[![:space:]]}"}
            case $value in
                \"*) [[ ${#value} -ge 2 && $value == *\" ]] && value=${value:1:${#value}-2} || continue ;;
                \'*) [[ ${#value} -ge 2 && $value == *\' ]] && value=${value:1:${#value}-2} || continue ;;
            esac
            case $name in
                path-exclude) filters+=("x $value") ;;
                path-include) filters+=("i $value") ;;
            esac
        done < "$file"
    done
    return 0
}

# dpkg_path_excluded PATH: PATH is one dpkg leaves out on this machine: the last of the caller's
# filters to match it is a path-exclude, as dpkg decides (matched with fnmatch without
# FNM_PATHNAME, so `*` crosses slashes, as in [[ == ]]).
dpkg_path_excluded() {
    local filter excluded=1
    for filter in "${filters[@]}"; do
        # shellcheck disable=SC2053 # a glob pattern on purpose
        if [[ $1 == ${filter:2} ]]; then
            [ "${filter:0:1}" = x ] && excluded=0 || excluded=1
        fi
    done
    return "$excluded"
}
