#!/usr/bin/env bash
# tools/bench-scripts-test.sh — checks of the benchmark scripts that run in seconds, without
# measuring, building or booting anything (tools/test.sh's lint stage runs it; alone:
# `tools/bench-scripts-test.sh`, no root):
# 1. tools/compare.sh's run order (COMPARE_DRY_RUN=1): over its default runs (2 x tools) every
#    tool follows at least two different tools, on every row where two tools run and overall
#    (a turning cycle kept fio right after emu on every KV retrieve; the disk may still be
#    writing back what the previous tool wrote);
# 2. every fio measurement of compare.sh draws other offsets each run (--randrepeat=0), as
#    tutti-bench does;
# 3. COMPARE_ROWS=kv-store alone still runs tutti-bench's KV run (its store phase is the figure);
# 4. COMPARE_FILE naming a device node is refused (exit 2) and left alone, and COMPARE_KEEP=1
#    reuses a file of the right size that an earlier COMPARE_KEEP=1 run laid out (its record
#    beside it), not any file whose blocks are allocated (a fallocate'd file reads zeroes from
#    unwritten extents without touching the disk);
# 5. tools/compare-lmcache.sh (a stand-in Python, nothing installed): a COMPARE_LMCACHE_SITE it did
#    not install, where LMCache does not import, is refused (exit 2) and left as it was (it was
#    deleted once pip had installed a fresh copy); a site lock another run holds is waited for
#    within COMPARE_LOCK_WAIT_S, then exit 2; the tutti-bench it measures is the executable
#    cargo's JSON names (CARGO_TARGET_DIR, build.target-dir), not a fixed target/release path;
#    a round whose tool never returns ends after COMPARE_ROUND_TIMEOUT_S with exit 2, its
#    process group killed; Ctrl-C (SIGINT to the script's process group, under setsid as at a
#    terminal) stops the running round, whose group timeout made its own, and ends the sitting
#    with exit 130, a hangup (SIGHUP) likewise with exit 129; a round SIGKILLed before its bound (status 137, as timeout's own KILL gives)
#    is said to be killed, not to have timed out;
# 6. tools/vm-bench.sh's guest commands (TUTTI_BENCH_COMMANDS_ONLY, nothing built or booted):
#    on every write row the kernel's fio and every tutti-bench run write unstamped buffers
#    (--scramble_buffers=0; fio's default stamps every 512 B of each write, slow under TCG),
#    so that ours/kernel compares the same work;
# 3b. compare.sh measuring with stand-ins (a fio that writes a fixed report, a tutti-bench whose
#    third call fails): a failed measurement is named, no goal is judged on the runs left, and
#    the script exits non-zero;
# 3c. COMPARE_FIO_HUGE=1 reserves as many huge pages as fio's largest buffer set takes (fio
#    rounds depth x bs plus a page up to 2 MiB, then shmget rounds again after another page:
#    128 x 1 MiB takes 66, 32 x 1 MiB 18), and, where fio is installed, as many as fio's own
#    shmget request (fio --debug=mem, the null engine: no file, no I/O);
# 7. python/bench's unit tests (stdlib only, no binding): layer_overhead.py's tutti-bench round
#    runs the Python store's slot size and layers in flight and takes the same median;
#    vllm_load.py's round order lets each setting follow two different ones over its default
#    rounds. (tools/python/bench's tests run in the python stage: tools/python/core-test.sh.)
set -uo pipefail
HERE=$(dirname "$(readlink -f "$0")")
# session_pids: a session's processes from /proc (pgrep is not on every fresh machine, and a
# missing one would make every "nothing left" check pass without looking).
# shellcheck source=tools/lib/process.sh
. "$HERE/lib/process.sh"
# shellcheck source=tools/lib/sitting.sh
. "$HERE/lib/sitting.sh"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
failures=0
check() {
    local what=$1 expected=$2 got=$3
    if [ "$got" = "$expected" ]; then
        echo "bench-scripts-test: ok: $what" >&2
    else
        echo "bench-scripts-test: FAILED: $what: expected $expected, got $got" >&2
        failures=$((failures + 1))
    fi
}

# predecessor_shortfalls: reads "ROW TOOL after PREVIOUS" lines and prints, one a line, each
# "ROW TOOL" (and "all TOOL") that follows fewer than two different tools, where its row runs
# at least two tools.
predecessor_shortfalls() {
    awk '$3 == "after" && $4 != "none" { seen[$1 " " $2 " " $4] = 1; seen["all " $2 " " $4] = 1; tools[$1 " " $2] = 1; tools["all " $2] = 1; row_tools[$1 "," $2] = 1; row_tools["all," $2] = 1 }
        END {
            for (key in seen) { split(key, p, " "); count[p[1] " " p[2]]++ }
            for (key in row_tools) { split(key, p, ","); per_row[p[1]]++ }
            for (key in tools) { split(key, p, " "); if (per_row[p[1]] >= 2 && count[key] < 2) print key }
        }' | sort
}
compare_order() { # ENV... -> "ROW TOOL after PREVIOUS" lines of a dry run
    env "$@" COMPARE_DRY_RUN=1 COMPARE_FILE="$WORK/none.img" "$HERE/compare.sh" 2> /dev/null |
        sed -n 's|^run [0-9]*/[0-9]*: ||p'
}

# 1. The order.
for tools in "" "COMPARE_QD1=1" "COMPARE_QD1=1 COMPARE_FIO_HUGE=1"; do
    # shellcheck disable=SC2086 # word splitting of the settings is meant
    order=$(compare_order $tools)
    check "compare.sh ${tools:-defaults}: a dry run lists measurements" yes "$([ -n "$order" ] && echo yes || echo no)"
    check "compare.sh ${tools:-defaults}: every tool follows >= 2 different tools, per row and overall" "" "$(predecessor_shortfalls <<< "$order" | tr '\n' ';')"
done

# 2. fio's offsets.
commands=$(COMPARE_DRY_RUN=1 COMPARE_QD1=1 COMPARE_FIO_HUGE=1 COMPARE_FILE="$WORK/none.img" "$HERE/compare.sh" 2> /dev/null | grep '^ *fio ')
check "compare.sh: fio measurements listed" yes "$([ -n "$commands" ] && echo yes || echo no)"
check "compare.sh: every fio measurement has --randrepeat=0" 0 "$(grep -vc -- '--randrepeat=0' <<< "$commands")"
# 2b. Writes unstamped on both sides (fio's default stamps every 512 B of a write, tutti-bench's
# every 4 KiB and its KV store nothing): every fio and tutti-bench write has --scramble_buffers=0.
all_commands=$(COMPARE_DRY_RUN=1 COMPARE_QD1=1 COMPARE_FIO_HUGE=1 COMPARE_FILE="$WORK/none.img" "$HERE/compare.sh" 2> /dev/null | grep -E '^ +[^ ]*(fio|tutti-bench) ')
writes=$(grep -E -e '--rw=(rand)?write ' <<< "$all_commands")
check "compare.sh: write measurements of fio and of tutti-bench listed" yes \
    "$(grep -q '^ *fio ' <<< "$writes" && grep -q 'tutti-bench ' <<< "$writes" && echo yes || echo no)"
check "compare.sh: every write measurement is unstamped (--scramble_buffers=0)" 0 "$(grep -vc -- '--scramble_buffers=0' <<< "$writes")"

# 3. kv-store alone.
check "compare.sh COMPARE_ROWS=kv-store: tutti-bench's KV run still runs" yes \
    "$(compare_order COMPARE_ROWS=kv-store | grep -q '^kv-store emu ' && echo yes || echo no)"

# 3b. A failed tutti-bench run.
mkdir -p "$WORK/stand-ins"
fio_report='{"jobs":[{"read":{"bw_bytes":1000000000,"iops":1000},"write":{"bw_bytes":1000000000,"iops":1000}}]}'
cat > "$WORK/stand-ins/fio" << FAKE
#!/usr/bin/env bash
# fio: --version answers, the layout writes the file, a measurement writes a fixed report to --output.
[ "\$1" = --version ] && { echo fio-3.33; exit 0; }
[ "\$1" = --name=layout ] && { head -c 1048576 /dev/zero > "\${2#--filename=}"; exit 0; }
for arg; do case \$arg in --output=*) [ "\${arg#--output=}" = /dev/null ] || echo '$fio_report' > "\${arg#--output=}" ;; esac; done
FAKE
cat > "$WORK/stand-ins/tutti-bench" << FAKE
#!/usr/bin/env bash
# tutti-bench: the third measurement fails, the others print fio's report.
[ "\$1" = --help ] && exit 0
calls=\$(( \$(cat "$WORK/stand-ins/calls" 2> /dev/null || echo 0) + 1 ))
echo "\$calls" > "$WORK/stand-ins/calls"
[ "\$calls" = 3 ] && { echo "verify: mismatch" >&2; exit 1; }
echo '$fio_report'
FAKE
chmod +x "$WORK/stand-ins/fio" "$WORK/stand-ins/tutti-bench"
PATH="$WORK/stand-ins:$PATH" COMPARE_BENCH="$WORK/stand-ins/tutti-bench" COMPARE_FILE="$WORK/measured.img" COMPARE_SETTLE=0 \
    COMPARE_RUNTIME=1 COMPARE_SIZE=1m COMPARE_ROWS=read-1m COMPARE_RUNS=2 "$HERE/compare.sh" > "$WORK/measured.out" 2> "$WORK/measured.err"
check "compare.sh, a tutti-bench run failed: exit 1" 1 "$?"
check "compare.sh, a tutti-bench run failed: its stand-in ran 4 times" 4 "$(cat "$WORK/stand-ins/calls" 2> /dev/null)"
# Run 2's order is uring emu fio (the cycle turned one place): uring's run 2 is the third call.
row=$(grep '^read-1m ' "$WORK/measured.out")
check "compare.sh, a tutti-bench run failed: the row says which run is missing" 1 "$(grep -c 'uring run 2 missing' <<< "$row")"
check "compare.sh, a tutti-bench run failed: no goal judged on the runs left" "uring>=0.95 INCOMPLETE, emu>=0.95 met" \
    "$(grep -oE 'uring>=0\.95 [A-Za-z]+, emu>=0\.95 [A-Za-z]+' <<< "$row")"
check "compare.sh, a tutti-bench run failed: the header says so" 1 "$(grep -c '^parameters: .*1 measurement(s) missing' "$WORK/measured.out")"

# 3c. Huge pages for fio's buffers.
huge_pages() { # ENV... -> the pages the dry run reserves, kept with its commands for fio's check
    env "$@" COMPARE_DRY_RUN=1 COMPARE_FIO_HUGE=1 COMPARE_FILE="$WORK/none.img" "$HERE/compare.sh" 2>&1 \
        > "$WORK/huge-commands.${*// /_}" | sed -n 's/^would reserve \([0-9]*\) huge pages.*/\1/p' |
        tee "$WORK/huge-pages.${*// /_}"
}
# fio rounds depth x bs plus a page's mask up to 2 MiB, then adds the mask again and shmget
# rounds up once more: one page more than a single rounding (fio-3.33 asks shmget for 36 MiB for
# 32 x 1 MiB).
check "compare.sh COMPARE_FIO_HUGE=1: 32 x 1 MiB, the largest buffer set by default, takes 18 pages" 18 "$(huge_pages)"
check "compare.sh COMPARE_FIO_HUGE=1 COMPARE_IODEPTH=128: 128 x 1 MiB takes 66 pages" 66 "$(huge_pages COMPARE_IODEPTH=128)"
check "compare.sh COMPARE_FIO_HUGE=1 COMPARE_KV_TOKENS=16384: the KV rows' 128 x 1 MiB take 66 pages" 66 "$(huge_pages COMPARE_KV_TOKENS=16384)"
check "compare.sh COMPARE_FIO_HUGE=1 COMPARE_ROWS=randread-4k: 32 x 4 KiB take 2 pages" 2 "$(huge_pages COMPARE_ROWS=randread-4k)"
# Against fio's own request, where fio is installed: the largest buffer set (depth x bs) of the
# dry run's huge-page fio commands, with their --bs, --iodepth, --direct, --mem and
# --hugepage-size as the script writes them, goes to fio with --debug=mem and the null engine,
# which opens no file and does no I/O (fio's request grows with depth x bs: the largest set
# decides). fio has no way to report its buffer size without asking for it: it logs
# "shmget SIZE" and calls shmget, which fails at once without free huge pages (or without root),
# and otherwise holds them for the instant a null job of one I/O takes. That request, in 2 MiB
# pages, must be the count the dry run reserves.
fio_huge_pages() { # ENV... (as huge_pages was given) -> the 2 MiB pages fio's shmget asks for
    local options size
    options=$(awk '$1 == "fio" && / --mem=shmhuge/ {
            line = ""; bytes = 0; depth = 0
            for (i = 2; i <= NF; i++) {
                if ($i ~ /^--(bs|iodepth|direct|mem|hugepage-size)=/) line = line " " $i
                if ($i ~ /^--bs=[0-9]+[kKmM]$/) { bytes = substr($i, 6) + 0; bytes *= ($i ~ /[mM]$/) ? 1048576 : 1024 }
                if ($i ~ /^--iodepth=/) depth = substr($i, 11) + 0
            }
            if (bytes * depth > largest) { largest = bytes * depth; chosen = line }
        } END { print chosen }' "$WORK/huge-commands.${*// /_}")
    [ -n "$options" ] || { echo "no huge-page fio command with --bs=NUMBER[k|m] and --iodepth in the dry run"; return; }
    # shellcheck disable=SC2086 # the options are words
    size=$(timeout 30 fio --debug=mem --name=probe --ioengine=null --rw=read --size=1m $options 2>&1 |
        sed -n 's/^mem .* shmget \([0-9]*\),.*/\1/p' | head -n 1)
    [ -n "$size" ] || { echo "fio logged no shmget for:$options"; return; }
    echo $((size / 2097152))
}
if command -v fio > /dev/null 2>&1; then
    for settings in "" COMPARE_IODEPTH=128 COMPARE_KV_TOKENS=16384 COMPARE_ROWS=randread-4k; do
        # shellcheck disable=SC2086 # word splitting of the settings is meant
        check "compare.sh COMPARE_FIO_HUGE=1 ${settings:-defaults}: the pages reserved are fio's own shmget request ($(fio --version))" \
            "$(fio_huge_pages $settings)" "$(cat "$WORK/huge-pages.${settings// /_}")"
    done
else
    echo "bench-scripts-test: skipped: compare.sh's huge pages against fio's shmget (no fio installed)" >&2
fi

# 4. The test file.
COMPARE_DRY_RUN=1 COMPARE_FILE=/dev/null "$HERE/compare.sh" > /dev/null 2>&1
check "compare.sh COMPARE_FILE=/dev/null: refused" 2 "$?"
check "compare.sh COMPARE_FILE=/dev/null: left a character device" yes "$([ -c /dev/null ] && echo yes || echo no)"
fallocate -l 1M "$WORK/kept.img" 2> /dev/null || head -c 1048576 /dev/zero > "$WORK/kept.img"
check "compare.sh COMPARE_KEEP=1: a file of the size it did not lay out (fallocate'd) is laid out anew" 1 \
    "$(COMPARE_DRY_RUN=1 COMPARE_KEEP=1 COMPARE_SIZE=1m COMPARE_FILE="$WORK/kept.img" "$HERE/compare.sh" 2>&1 > /dev/null | grep -c '^would lay out ')"
rm -f "$WORK/kept.img"
echo 100 > "$WORK/stand-ins/calls" # past the stand-in tutti-bench's failing call
PATH="$WORK/stand-ins:$PATH" COMPARE_BENCH="$WORK/stand-ins/tutti-bench" COMPARE_FILE="$WORK/kept.img" COMPARE_KEEP=1 COMPARE_SETTLE=0 \
    COMPARE_RUNTIME=1 COMPARE_SIZE=1m COMPARE_ROWS=read-1m COMPARE_RUNS=1 "$HERE/compare.sh" > /dev/null 2> "$WORK/kept.err"
check "compare.sh COMPARE_KEEP=1, stand-in tools: laid out, measured, kept" 0 "$?"
check "compare.sh COMPARE_KEEP=1: the file it laid out and kept is reused" 1 \
    "$(COMPARE_DRY_RUN=1 COMPARE_KEEP=1 COMPARE_SIZE=1m COMPARE_FILE="$WORK/kept.img" "$HERE/compare.sh" 2>&1 > /dev/null | grep -c '^reusing ')"
check "compare.sh COMPARE_KEEP=1: one of another size is laid out anew" 1 \
    "$(COMPARE_DRY_RUN=1 COMPARE_KEEP=1 COMPARE_SIZE=2m COMPARE_FILE="$WORK/kept.img" "$HERE/compare.sh" 2>&1 > /dev/null | grep -c '^would lay out ')"
check "compare.sh COMPARE_SIZE=1MiB (fio's spelling): the same size, reused" 1 \
    "$(COMPARE_DRY_RUN=1 COMPARE_KEEP=1 COMPARE_SIZE=1MiB COMPARE_FILE="$WORK/kept.img" "$HERE/compare.sh" 2>&1 > /dev/null | grep -c '^reusing ')"

# 5. compare-lmcache.sh's LMCache site and tutti-bench binary. The stand-in Python: `-c` (the
# import check) fails; `-m pip install ... --target DIR` makes DIR as pip would.
mkdir -p "$WORK/bin"
cat > "$WORK/bin/python" << 'FAKE'
#!/usr/bin/env bash
case $1 in
    -c) exit 1 ;;
    -m) while [ $# -gt 0 ]; do [ "$1" = --target ] && mkdir -p "$2/lmcache"; shift; done; exit 0 ;;
esac
exit 0
FAKE
chmod +x "$WORK/bin/python"
lmcache() { env COMPARE_PYTHON="$WORK/bin/python" COMPARE_DIRECTORY="$WORK" COMPARE_BENCH=/bin/true "$@" "$HERE/compare-lmcache.sh"; }
mkdir -p "$WORK/user-site/numpy"
lmcache COMPARE_LMCACHE_SITE="$WORK/user-site" > /dev/null 2> "$WORK/site.err"
check "compare-lmcache.sh: a site it did not install, LMCache not importing: refused" 2 "$?"
check "compare-lmcache.sh: that site left as it was" yes "$([ -d "$WORK/user-site/numpy" ] && echo yes || echo no)"
check "compare-lmcache.sh: the refusal names the site" 1 "$(grep -c "not replacing it" "$WORK/site.err")"
(flock 9 && exec sleep 30) 9> "$WORK/locked-site.lock" &
holder=$!
sleep 0.3
started=$SECONDS
lmcache COMPARE_LMCACHE_SITE="$WORK/locked-site" COMPARE_LOCK_WAIT_S=1 > /dev/null 2> "$WORK/lock.err"
check "compare-lmcache.sh: a site lock held by another run: exit 2" 2 "$?"
check "compare-lmcache.sh: after the bound (well under the holder's 30 s)" yes "$([ $((SECONDS - started)) -lt 10 ] && echo yes || echo no)"
check "compare-lmcache.sh: the error says the lock is held" 1 "$(grep -c 'still held after 1s' "$WORK/lock.err")"
kill "$holder" 2> /dev/null
wait "$holder" 2> /dev/null
# A round that hangs: the stand-in passes the import check, then the driver never returns.
cat > "$WORK/bin/python-hangs" << 'FAKE'
#!/usr/bin/env bash
case $1 in -c | -m) exit 0 ;; esac
exec sleep 60
FAKE
chmod +x "$WORK/bin/python-hangs"
# sitting ERR ENV...: compare-lmcache.sh with the hanging stand-in, in the background as the leader
# of a session (and process group) of its own, as at a terminal (setsid execs: a background job
# of this script leads no group); its pid, the session's id, in $sitting. SIGINT as at a terminal
# too: this shell starts background jobs with it ignored, and bash cannot trap a signal ignored
# when it starts.
sitting() {
    local err=$1
    shift
    setsid env --default-signal=INT COMPARE_PYTHON="$WORK/bin/python-hangs" COMPARE_DIRECTORY="$WORK" COMPARE_BENCH=/bin/true \
        COMPARE_ROUNDS=1 "$@" "$HERE/compare-lmcache.sh" > /dev/null 2> "$err" &
    sitting=$!
}
# round_runs: waits (up to 10 s) until the round runs: its stand-in's sleep, in the sitting's
# session.
round_runs() { sitting_sleeps || :; }
# The look itself: a process left in a session is seen (without it, every "nothing left" below
# would pass without looking).
# (Looked at until it is seen, up to 5 s: the background child runs setsid only once started.)
setsid sleep 30 < /dev/null > /dev/null 2>&1 &
sitting=$!
for ((tenths = 0; tenths < 50; tenths++)); do
    [ -z "$(session_pids "$sitting")" ] || break
    sleep 0.1
done
sitting_ends 0
check "session_pids: a process still running in a session is seen" "$sitting " "$left"
# A zombie (ended, its parent not reaping it: here the `true` whose parent exec'd sleep) is not
# running: not listed (as kill_tree of tools/test.sh counts it as ended).
setsid sh -c 'true & exec sleep 30' < /dev/null > /dev/null 2>&1 &
sitting=$!
zombie=
for ((tenths = 0; tenths < 50; tenths++)); do
    for stat in /proc/[0-9]*/stat; do
        read -r line 2> /dev/null < "$stat" || continue
        read -r -a fields <<< "${line##*") "}"
        [ "${fields[3]:-}" = "$sitting" ] && [ "${fields[0]}" = Z ] || continue
        zombie=${stat#/proc/} zombie=${zombie%/stat}
        break 2
    done
    sleep 0.1
done
sitting_ends 0
check "session_pids: a zombie of a session ($zombie) is not listed, the process still running is" "yes $sitting " \
    "$([ -n "$zombie" ] && echo yes || echo "no zombie seen") $left"
sitting "$WORK/hang.err" COMPARE_LMCACHE_SITE="$WORK/hang-site" COMPARE_ROUND_TIMEOUT_S=1
sitting_ends 15
check "compare-lmcache.sh: a round that never returns: exit 2 after the round's bound (well under the stand-in's 60 s)" 2 "$ended"
check "compare-lmcache.sh: the error names the tool and says it timed out" 1 "$(grep -c 'LMCache round 1 timed out after 1s' "$WORK/hang.err")"
check "compare-lmcache.sh: the timed-out round's process group killed, nothing left of the sitting" "" "$left"
# Ctrl-C: the terminal sends SIGINT to the script's process group, which the round under
# timeout (a group of its own) is not in: the round must be stopped and the sitting end (130),
# not the interrupt swallowed and the next round run.
sitting "$WORK/interrupt.err" COMPARE_LMCACHE_SITE="$WORK/hang-site" COMPARE_ROUND_TIMEOUT_S=60
round_runs
kill -INT -- "-$sitting"
sitting_ends 10
check "compare-lmcache.sh: Ctrl-C (SIGINT to its process group) in a round: exit 130 within 10 s (the round's bound is 60 s)" 130 "$ended"
check "compare-lmcache.sh: Ctrl-C: the round stopped, nothing left of the sitting" "" "$left"
check "compare-lmcache.sh: Ctrl-C: the error says the sitting was interrupted" 1 "$(grep -c 'interrupted' "$WORK/interrupt.err")"
# A hangup (an SSH session dropped, a terminal closed): SIGHUP goes to the script's process group
# (the shell's killpg of its jobs, the kernel's to the foreground group), not to the round's: the
# round must be stopped as for Ctrl-C, not left running into the directory the cleanup removed.
sitting "$WORK/hangup.err" COMPARE_LMCACHE_SITE="$WORK/hang-site" COMPARE_ROUND_TIMEOUT_S=60
round_runs
kill -HUP -- "-$sitting"
sitting_ends 10
check "compare-lmcache.sh: a hangup (SIGHUP to its process group) in a round: exit 129 within 10 s" 129 "$ended"
check "compare-lmcache.sh: a hangup: the round stopped, nothing left of the sitting" "" "$left"
# A round whose tool is SIGKILLed before the bound (the OOM killer, say): timeout passes the death
# on as 137, the status its own KILL gives, but the round did not time out.
cat > "$WORK/bin/python-killed" << 'FAKE'
#!/usr/bin/env bash
case $1 in -c | -m) exit 0 ;; esac
kill -KILL $$
FAKE
chmod +x "$WORK/bin/python-killed"
lmcache COMPARE_PYTHON="$WORK/bin/python-killed" COMPARE_LMCACHE_SITE="$WORK/hang-site" COMPARE_ROUNDS=1 COMPARE_ROUND_TIMEOUT_S=60 \
    > /dev/null 2> "$WORK/killed.err"
check "compare-lmcache.sh: a round SIGKILLed at once: exit 2" 2 "$?"
check "compare-lmcache.sh: a round SIGKILLed at once: said killed, not timed out" "1 0" \
    "$(grep -c 'LMCache round 1 was killed (SIGKILL' "$WORK/killed.err") $(grep -c 'timed out' "$WORK/killed.err")"
# tools/lib/cargo-executables.py, which compare-lmcache.sh (and the GPU runbook) read cargo's JSON
# with, on a build whose target directory moved.
cargo_json='{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"tutti_bench"},"executable":null}
{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"tutti-bench"},"executable":"/elsewhere/release/tutti-bench"}
{"reason":"build-finished","success":true}'
check "cargo-executables.py: the binary is the one cargo reports" /elsewhere/release/tutti-bench \
    "$(python3 "$HERE/lib/cargo-executables.py" test tutti-bench <<< "$cargo_json" 2> /dev/null)"
check "cargo-executables.py: no executable reported: a failure" 1 \
    "$(python3 "$HERE/lib/cargo-executables.py" test tutti-bench <<< '{"reason":"build-finished","success":true}' > /dev/null 2>&1; echo $?)"
check "cargo-executables.py: a build that failed: a failure" 1 \
    "$(python3 "$HERE/lib/cargo-executables.py" test tutti-bench <<< "${cargo_json%\"success\":true\}}\"success\":false}" > /dev/null 2>&1; echo $?)"

# 6. vm-bench's write rows.
for settings in "" "TUTTI_BENCH_SHADOW=1 TUTTI_BENCH_PIN=0 TUTTI_BENCH_REPEAT=2"; do
    # shellcheck disable=SC2086 # word splitting of the settings is meant
    env $settings TUTTI_VM_DIR="$WORK/vm" TUTTI_BENCH_COMMANDS_ONLY="$WORK/commands" "$HERE/vm-bench.sh" 2> "$WORK/vm-bench.err"
    check "vm-bench.sh ${settings:-defaults}: the guest commands are written without booting" 0 "$?"
    writes=$(grep -E '^echo JSON_BEGIN [a-z]+ seqwrite-' "$WORK/commands")
    check "vm-bench.sh ${settings:-defaults}: write rows of the kernel and of tutti-bench listed" yes \
        "$(grep -q ' kernel seqwrite-' <<< "$writes" && grep -q 'tutti-bench --workload=raw' <<< "$writes" && echo yes || echo no)"
    check "vm-bench.sh ${settings:-defaults}: every write row's run is unstamped" "" \
        "$(grep -v -e ' --scramble_buffers=0 ' -e 'unstamped=--scramble_buffers=0;' <<< "$writes" | cut -d';' -f1 | tr '\n' ';')"
done

# 7. python/bench's tests.
python3 -m unittest discover -s "$HERE/../python/bench" -p 'test_*.py' > "$WORK/python-bench.out" 2>&1
status=$?
check "python/bench unit tests pass" 0 "$status"
[ "$status" = 0 ] || cat "$WORK/python-bench.out" >&2

if [ "$failures" -gt 0 ]; then
    echo "bench-scripts-test: $failures check(s) failed" >&2
    exit 1
fi
echo "bench-scripts-test: all checks passed" >&2
