#!/usr/bin/env bash
# Side-by-side comparison of fio (ioengine=io_uring, direct=1) with tutti-bench on the kernel
# path (uring:) and on the software NVMe controller (emu:), identical parameters, same file.
# A benchmark, not a test: it prints figures and ratios to fio; goals (issue 7):
#   uring: >= 0.95x fio on every row;  emu: >= 0.9x fio on the 128 KiB and 1 MiB rows.
#
# Environment (all optional):
#   COMPARE_FILE     test file on the local disk   (default /var/tmp/tutti-compare.img)
#   COMPARE_SIZE     its size, fio syntax          (default 4g)
#   COMPARE_RUNTIME  seconds per measurement       (default 10)
#   COMPARE_RUNS     repetitions; medians reported (default 3)
#   COMPARE_IODEPTH  queue depth of every row      (default 32)
#   COMPARE_KEEP     1 keeps the test file         (default: removed at the end)
#   COMPARE_SETTLE   seconds of pause (after a sync) before each measurement (default 2)
#   COMPARE_ROWS     subset of rows, e.g. "randread-4k read-1m"
#   COMPARE_QD1      1 adds fio at queue depth 1 as a reference column: the software controller
#                    (emu:) serialises backing-store writes, so its writes are compared with this
set -euo pipefail

FILE=${COMPARE_FILE:-/var/tmp/tutti-compare.img}
SIZE=${COMPARE_SIZE:-4g}
RUNTIME=${COMPARE_RUNTIME:-10}
RUNS=${COMPARE_RUNS:-3}
IODEPTH=${COMPARE_IODEPTH:-32}
SETTLE=${COMPARE_SETTLE:-2}
ROWS=${COMPARE_ROWS:-"randread-4k read-128k read-1m write-128k write-1m"}
TOOLS="fio uring emu"
[ "${COMPARE_QD1:-0}" = 1 ] && TOOLS="fio uring emu fioqd1"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target-bench}
BENCH=$CARGO_TARGET_DIR/release/tutti-bench
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"; [ "${COMPARE_KEEP:-0}" = 1 ] || rm -f "$FILE"' EXIT

say() { printf '%s\n' "$*" >&2; }

# fio, installed once (idempotent: nothing happens when it is already there).
if ! command -v fio >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    say "installing fio with apt-get"
    $SUDO apt-get install -y fio >/dev/null 2>&1 || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y fio >/dev/null; }
fi
command -v python3 >/dev/null || { say "python3 is needed to read the JSON results"; exit 1; }

say "building tutti-bench (release)"
(cd "$ROOT" && cargo build --release --bin tutti-bench --quiet)

# One file for everyone, written in full so that every read hits allocated blocks.
say "laying out $FILE ($SIZE)"
rm -f "$FILE"
fio --name=layout --filename="$FILE" --size="$SIZE" --rw=write --bs=1m --iodepth=32 \
    --ioengine=io_uring --direct=1 --output=/dev/null

row_params() { # name -> "rw bs"
    case $1 in
        randread-4k) echo "randread 4k" ;;
        read-128k) echo "read 128k" ;;
        read-1m) echo "read 1m" ;;
        write-128k) echo "write 128k" ;;
        write-1m) echo "write 1m" ;;
        *) say "unknown row $1"; exit 2 ;;
    esac
}

# run TOOL ROW RUN -> writes the JSON result to $WORK/TOOL-ROW-RUN.json
run() {
    local tool=$1 row=$2 index=$3 rw bs out
    read -r rw bs <<<"$(row_params "$row")"
    out=$WORK/$tool-$row-$index.json
    case $tool in
        fio|fioqd1)
            local depth=$IODEPTH
            [ "$tool" = fioqd1 ] && depth=1
            fio --name=job --filename="$FILE" --size="$SIZE" --rw="$rw" --bs="$bs" --iodepth="$depth" \
                --numjobs=1 --ioengine=io_uring --direct=1 --time_based --runtime="$RUNTIME" \
                --output-format=json --output="$out" ;;
        uring|emu)
            "$BENCH" --device "$tool:$FILE" --size="$SIZE" --rw="$rw" --bs="$bs" --iodepth="$IODEPTH" \
                --numjobs=1 --time_based --runtime="$RUNTIME" --output-format=json >"$out" 2>"$WORK/stderr" \
                || { say "tutti-bench $tool $row failed: $(cat "$WORK/stderr")"; echo '{}' >"$out"; } ;;
    esac
}

load_start=$(cut -d' ' -f1-3 /proc/loadavg)
for index in $(seq 1 "$RUNS"); do
    for row in $ROWS; do
        # Tools interleaved within a run, so that drift on a shared machine hits all of them,
        # and the order rotated from run to run: a virtual disk may still be writing back what
        # the previous tool wrote, which would always penalise the same tool.
        read -r -a order <<<"$TOOLS"
        for ((k = 0; k < ${#order[@]}; k++)); do
            tool=${order[$(((k + index - 1) % ${#order[@]}))]}
            say "run $index/$RUNS: $row $tool"
            sync
            sleep "$SETTLE"
            run "$tool" "$row" "$index"
        done
    done
done

load_end=$(cut -d' ' -f1-3 /proc/loadavg)
uname_line="$(nproc) cores, $(uname -r), $(df -T "$(dirname "$FILE")" | awk 'NR==2 {print $2" on "$1}'), fio $(fio --version)"
python3 - "$WORK" "$RUNS" "$ROWS" "$IODEPTH" "$RUNTIME" "$SIZE" "$uname_line" "$load_start" "$load_end" "$TOOLS" <<'EOF'
import json, statistics, sys
work, runs, rows, iodepth, runtime, size, machine, load_start, load_end, tools = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), *sys.argv[4:]
tools = tools.split()

def figure(tool, row, index):
    """IOPS for the 4 KiB row, MB/s for the others; None when the run produced nothing."""
    try:
        job = json.load(open(f"{work}/{tool}-{row}-{index}.json"))["jobs"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    side = job["write"] if row.startswith("write") else job["read"]
    return side["iops"] if row.endswith("4k") else side["bw_bytes"] / 1e6

def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None

def show(value, digits=0):
    return "-" if value is None else f"{value:,.{digits}f}"

print(f"machine: {machine}; load average {load_start} at start, {load_end} at end")
print(f"parameters: iodepth={iodepth} numjobs=1 runtime={runtime}s size={size} direct I/O; medians of {runs} runs; ratio = median of per-run ratios to fio")
qd1 = "fioqd1" in tools
print(f"{'row':<12} {'unit':<5} {'fio':>10} {'uring':>10} {'ratio':>6} {'emu':>10} {'ratio':>6}" + (f" {'fio qd1':>10}" if qd1 else "") + "  goals")
for row in rows:
    fio = [figure("fio", row, i) for i in range(1, runs + 1)]
    cells = []
    for tool in ("uring", "emu"):
        values = [figure(tool, row, i) for i in range(1, runs + 1)]
        ratios = [v / f for v, f in zip(values, fio) if v is not None and f]
        cells.append((median(values), median(ratios)))
    (uring, uring_ratio), (emu, emu_ratio) = cells
    goals = ["uring>=0.95 " + ("met" if uring_ratio is not None and uring_ratio >= 0.95 else "MISSED")]
    if not row.endswith("4k"):
        goals.append("emu>=0.9 " + ("met" if emu_ratio is not None and emu_ratio >= 0.9 else "MISSED"))
    unit = "IOPS" if row.endswith("4k") else "MB/s"
    print(f"{row:<12} {unit:<5} {show(median(fio)):>10} {show(uring):>10} {show(uring_ratio, 2):>6} {show(emu):>10} {show(emu_ratio, 2):>6}" + (f" {show(median([figure('fioqd1', row, i) for i in range(1, runs + 1)])):>10}" if qd1 else "") + f"  {', '.join(goals)}")
print()
print("per run (the spread is the machine's noise):")
for row in rows:
    for tool in tools:
        values = [figure(tool, row, i) for i in range(1, runs + 1)]
        name = "fio qd1" if tool == "fioqd1" else tool
        print(f"  {row:<12} {name:<8} " + "  ".join(show(v) for v in values))
EOF
