#!/usr/bin/env bash
# Tests tools/lib/dpkg.sh's dpkg_damaged_depends against stand-in dpkg and dpkg-query (no
# package is touched): under set -e, as the VM scripts run it; with a package installed for two
# architectures (dpkg --verify refuses the bare name); with a verify that fails (a timeout); and
# with dpkg's path-exclude/path-include settings of a slim image (files left out on purpose are
# not damage; a re-included one is), read and applied in dpkg's order. As root, also its
# policy-rc.d hook at paths of the test's own: a live owner's is kept, a KILLed owner's (a zombie
# not yet reaped) removed with the original put back.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() {
    echo "dpkg-test: $*" >&2
    exit 1
}
mkdir -p "$work/bin" "$work/root/etc/dpkg/dpkg.cfg.d"
# gcc depends on cpp (-> cpp-12, which lost cc1), libc6 (installed for amd64 and i386: only a
# changelog is missing from the amd64 one), libgcc-s1 (its verify times out) and docsonly (its
# copyright is missing).
cat > "$work/bin/dpkg-query" << 'STAND_IN'
#!/usr/bin/env bash
case "$2" in
    *Depends*)
        case $3 in
            gcc) echo "cpp (= 4:12.2.0-3), libc6 (>= 2.34), libgcc-s1:any, docsonly," ;;
            cpp) echo "cpp-12 (>= 12.2.0)," ;;
            *) echo "," ;;
        esac ;;
    *binary:Package*)
        case $3 in
            libc6) printf 'libc6:amd64 install ok installed\nlibc6:i386 install ok installed\n' ;;
            libgcc-s1) echo "libgcc-s1:amd64 install ok installed" ;;
            *) echo "$3 install ok installed" ;;
        esac ;;
esac
STAND_IN
cat > "$work/bin/dpkg" << 'STAND_IN'
#!/usr/bin/env bash
[ "$1" = --verify ] || exit 1
case "$2" in
    libc6) echo "dpkg: error: ambiguous package name 'libc6' with more than one installed instance" >&2; exit 2 ;;
    libc6:amd64) echo "missing     /usr/share/doc/libc6/changelog.Debian.gz" ;;
    libc6:i386) echo "??5??????   /usr/lib/i386-linux-gnu/libc.so.6" ;;
    libgcc-s1:amd64) exit 124 ;;
    cpp-12) printf 'missing     /usr/share/doc/cpp-12/changelog.gz\nmissing     /usr/lib/gcc/x86_64-linux-gnu/12/cc1\n' ;;
    docsonly) echo "missing     /usr/share/doc/docsonly/copyright" ;;
esac
exit 0
STAND_IN
chmod +x "$work/bin/dpkg" "$work/bin/dpkg-query"
damaged() {
    # shellcheck disable=SC2030,SC2031 # PATH for this subshell only
    (
        set -euo pipefail
        export PATH="$work/bin:$PATH"
        # shellcheck source=tools/lib/dpkg.sh
        . tools/lib/dpkg.sh
        mapfile -t found < <(dpkg_damaged_depends gcc)
        echo "${found[*]}"
    )
}
got="$(DPKG_CONFIG_ROOT="$work/root" HOME="$work/home" damaged)"
[[ "$got" == "libc6:amd64 docsonly cpp-12" ]] || fail "no path-exclude: expected 'libc6:amd64 docsonly cpp-12', got '$got'"
printf '# a slim image\npath-exclude /usr/share/doc/*\n  path-include=/usr/share/doc/*/copyright\n' > "$work/root/etc/dpkg/dpkg.cfg.d/excludes"
got="$(DPKG_CONFIG_ROOT="$work/root" HOME="$work/home" damaged)"
[[ "$got" == "docsonly cpp-12" ]] || fail "docs excluded, copyright included: expected 'docsonly cpp-12', got '$got'"
# As dpkg decides: the last filter to match wins, the files of dpkg.cfg.d in name order, names
# other than letters, digits, _ and - skipped (a leftover .dpkg-old), `NAME = "VALUE"` accepted.
rm "$work/root/etc/dpkg/dpkg.cfg.d/excludes"
printf 'path-include=/usr/share/doc/*/copyright\n' > "$work/root/etc/dpkg/dpkg.cfg.d/00-keep"
printf 'path-exclude = "/usr/share/doc/*"\n' > "$work/root/etc/dpkg/dpkg.cfg.d/excludes"
printf 'path-include=/usr/share/doc/*\n' > "$work/root/etc/dpkg/dpkg.cfg.d/excludes.dpkg-old"
got="$(DPKG_CONFIG_ROOT="$work/root" HOME="$work/home" damaged)"
[[ "$got" == "cpp-12" ]] || fail "an include before a broader exclude: expected 'cpp-12', got '$got'"
printf 'path-include /usr/share/doc/docsonly/*\n' > "$work/root/etc/dpkg/dpkg.cfg"
got="$(DPKG_CONFIG_ROOT="$work/root" HOME="$work/home" damaged)"
[[ "$got" == "docsonly cpp-12" ]] || fail "dpkg.cfg read after dpkg.cfg.d: expected 'docsonly cpp-12', got '$got'"
# Single quotes are dropped as double ones; only one separator, then at most one =, is taken
# (`path-exclude  =/x` excludes the pattern `=/x`, which matches nothing); ~/.dpkg.cfg is read
# last.
rm "$work/root/etc/dpkg/dpkg.cfg" "$work/root/etc/dpkg/dpkg.cfg.d/"*
printf "path-exclude='/usr/share/doc/*'\\npath-exclude  =/usr/lib/*\\n" > "$work/root/etc/dpkg/dpkg.cfg.d/excludes"
got="$(DPKG_CONFIG_ROOT="$work/root" HOME="$work/home" damaged)"
[[ "$got" == "cpp-12" ]] || fail "single quotes, two separators: expected 'cpp-12', got '$got'"
mkdir -p "$work/home"
printf 'path-include=/usr/share/doc/docsonly/*\n' > "$work/home/.dpkg.cfg"
got="$(DPKG_CONFIG_ROOT="$work/root" HOME="$work/home" damaged)"
[[ "$got" == "docsonly cpp-12" ]] || fail "~/.dpkg.cfg read last: expected 'docsonly cpp-12', got '$got'"

# process_start called plainly by a script under set -e with inherit_errexit (command
# substitutions keep -e): its whole-file read, which returns 1 at the end of the file, must not
# end it (nor empty what it prints); nor must a process gone (pid 4194304: above the largest
# pid_max), which prints nothing.
# shellcheck disable=SC2016 # expanded by the inner shell
got=$(bash -c 'set -euo pipefail; shopt -s inherit_errexit; . tools/lib/dpkg.sh; start=$(process_start $$); gone=$(process_start 4194304); echo "start=$start gone=$gone"' 2>&1) || true
[[ "$got" =~ ^start=[0-9]+\ gone=$ ]] || fail "process_start under set -e and inherit_errexit: expected 'start=<start time> gone=', got '$got'"

# The policy-rc.d hook, at paths of the test's own (as root only: clean_stale_policy_rc_d does
# nothing otherwise). An owner KILLed whose parent has not reaped it yet (a zombie: a stage's
# script whose shell was killed with it, handed to an init that does not reap) is gone: its
# policy-rc.d is removed and the one it kept aside put back; a live owner's is kept.
if [ "$(id -u)" -eq 0 ]; then
    policy() { # COMMAND...: with tools/lib/dpkg.sh sourced and its paths under $work/policy
        (
            # shellcheck source=tools/lib/dpkg.sh
            . tools/lib/dpkg.sh
            POLICY_RC_D=$work/policy/policy-rc.d POLICY_RC_D_SAVED=$work/policy/policy-rc.d.tutti-saved
            POLICY_RC_D_LOCK=$work/policy/lock
            "$@"
        )
    }
    mkdir -p "$work/policy"
    echo original > "$work/policy/policy-rc.d"
    # The owner's parent execs sleep, which never reaps it.
    # shellcheck disable=SC2016 # expanded by the inner shells
    bash -c 'bash -c "$1" & echo $! > "$2"; exec sleep 30' policy-parent \
        "cd '$PWD' && work='$work' && $(declare -f policy) && policy forbid_service_starts && touch '$work/policy/ready' && exec sleep 30" \
        "$work/policy/owner" &
    parent=$!
    for ((tenths = 0; tenths < 100; tenths++)); do [ -e "$work/policy/ready" ] && break; sleep 0.1; done
    owner=$(cat "$work/policy/owner")
    policy clean_stale_policy_rc_d 2> /dev/null
    grep -q 'exit 101' "$work/policy/policy-rc.d" || fail "a live owner's policy-rc.d was removed"
    kill -KILL "$owner"
    for ((tenths = 0; tenths < 50; tenths++)); do
        [ "$(sed -E 's/^.*\) ([A-Z]).*$/\1/' "/proc/$owner/stat" 2> /dev/null)" = Z ] && break
        sleep 0.1
    done
    policy clean_stale_policy_rc_d 2> /dev/null
    got=$(cat "$work/policy/policy-rc.d" 2> /dev/null)
    kill -KILL "$parent" 2> /dev/null
    wait "$parent" 2> /dev/null || true
    [ "$got" = original ] || fail "an owner KILLed (not yet reaped): expected its policy-rc.d gone and the original back, got '$got'"
else
    echo "dpkg-test: not root: the policy-rc.d checks skipped"
fi
echo "dpkg-test: passed"
