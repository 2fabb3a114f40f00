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
#    reuses a laid-out file of the right size.
set -uo pipefail
HERE=$(dirname "$(readlink -f "$0")")
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

# 3. kv-store alone.
check "compare.sh COMPARE_ROWS=kv-store: tutti-bench's KV run still runs" yes \
    "$(compare_order COMPARE_ROWS=kv-store | grep -q '^kv-store emu ' && echo yes || echo no)"

# 4. The test file.
COMPARE_DRY_RUN=1 COMPARE_FILE=/dev/null "$HERE/compare.sh" > /dev/null 2>&1
check "compare.sh COMPARE_FILE=/dev/null: refused" 2 "$?"
check "compare.sh COMPARE_FILE=/dev/null: left a character device" yes "$([ -c /dev/null ] && echo yes || echo no)"
fallocate -l 1M "$WORK/kept.img" 2> /dev/null || head -c 1048576 /dev/zero > "$WORK/kept.img"
check "compare.sh COMPARE_KEEP=1: a laid-out file of the size is reused" 1 \
    "$(COMPARE_DRY_RUN=1 COMPARE_KEEP=1 COMPARE_SIZE=1m COMPARE_FILE="$WORK/kept.img" "$HERE/compare.sh" 2>&1 > /dev/null | grep -c '^reusing ')"
check "compare.sh COMPARE_KEEP=1: one of another size is laid out anew" 1 \
    "$(COMPARE_DRY_RUN=1 COMPARE_KEEP=1 COMPARE_SIZE=2m COMPARE_FILE="$WORK/kept.img" "$HERE/compare.sh" 2>&1 > /dev/null | grep -c '^would lay out ')"

if [ "$failures" -gt 0 ]; then
    echo "bench-scripts-test: $failures check(s) failed" >&2
    exit 1
fi
echo "bench-scripts-test: all checks passed" >&2
