#!/usr/bin/env bash
# Side-by-side comparison of fio (ioengine=io_uring, direct=1) with tutti-bench on the kernel
# path (uring:) and on the software NVMe controller (emu:), identical parameters, same file;
# writes unstamped on both sides (--scramble_buffers=0, see UNSTAMPED; before 2026-12-01 fio
# stamped every 512 B of each write, its default, and the write/kv-store ratios compared
# different work).
# A benchmark, not a test: it prints figures and ratios to fio; goals (issues 7 and 16):
#   uring: >= 0.95x fio on every row;  emu: >= 0.9x fio at 4 KiB, >= 0.95x on the 128 KiB and
#   1 MiB rows.
# KV rows (issue 16 item 4): tutti-bench's KV workload (llama3-8b, 16-token blocks, K blocks
# per slot, 16 by default) on the software controller over the same file, against fio moving the
# same bytes with the same I/O size and queue depth; goals: retrieve >= 0.95x fio, store >= 0.9x.
#   kv-retrieve  tutti-bench --device emu:FILE --workload=kv --prompt-tokens=$COMPARE_KV_TOKENS
#                --blocks-per-slot=K --hit-rate=1 --verify: the retrieve phase's GB/s over its
#                layers' time
#   kv-store     the same run's populate phase (store_layer + wait per layer, before commit)
#   fio          --rw=randread (randwrite) --bs=K*64k --iodepth=<see below> --offset=1m
#                --size=<prompt's KV bytes> --ioengine=io_uring --direct=1, one pass (not time
#                based): exactly the pool's slots that run uses (slots 0..n/K-1 from the data
#                region at 1 MiB), each I/O once, in random order. A slot holds its K blocks
#                layer-major, so a layer of a slot (K and V of K blocks, 32 KiB each) is one
#                K*64 KiB command on the pool; tutti-bench keeps two layers in flight (each
#                n/K commands, n blocks) and the software controller at most 128 transfers in
#                flight to the file (its 16 MiB bound holds bounced transfers only; these go
#                straight from engine memory), so tutti's depth at the file is
#                min(2 * n/K, 128): fio at that depth (32 for K=16, 128 for K=1). Before
#                2026-11-28 the bound held every transfer and the depth was 16 MiB / command.
#
# Environment (all optional):
#   COMPARE_FILE     test file on the local disk   (default /var/tmp/tutti-compare.img)
#   COMPARE_SIZE     its size, fio syntax          (default 4g)
#   COMPARE_RUNTIME  seconds per measurement       (default 10)
#   COMPARE_RUNS     repetitions; medians reported (default 2 x the tools: 6, 8 or 10, so that
#                    each tool follows each of its neighbours, see the loop)
#   COMPARE_IODEPTH  queue depth of every row      (default 32)
#   COMPARE_KEEP     1 keeps the test file, and reuses one of the right size an earlier
#                    COMPARE_KEEP=1 run laid out and left, which FILE.tutti-compare records
#                    (default: laid out anew, removed at the end)
#   COMPARE_SETTLE   seconds of pause (after a sync) before each measurement (default 2)
#   COMPARE_ROWS     subset of rows, e.g. "randread-4k read-1m" (kv-store alone still runs
#                    tutti-bench's KV run, whose store phase is its figure)
#   COMPARE_QD1      1 adds fio at queue depth 1 as a reference column: the software controller
#                    (emu:) serialises backing-store writes, so its writes are compared with this
#   COMPARE_FIO_HUGE 1 adds fio with its buffers in 2 MiB huge pages (--mem=shmhuge
#                    --hugepage-size=2m) as a
#                    reference column, with emu's ratio to it: the software controller's host
#                    memory asks for transparent huge pages (nvme-driver's HostMemory), fio's
#                    default malloc'd buffers are 4 KiB pages, and on a disk with few segments
#                    per request that alone decides large transfers. Needs root: it reserves as
#                    many more huge pages (vm.nr_hugepages) as fio's largest buffer set takes
#                    (see huge_pages_needed; 18 by default, 66 at 128 x 1 MiB) and gives them
#                    back at exit
#   COMPARE_BENCH    a tutti-bench binary to use instead of building one (e.g. an older build
#                    for a before/after comparison in one sitting)
#   COMPARE_KV_TOKENS   prompt of the KV rows, tokens (default 4096: 256 blocks, 512 MiB)
#   COMPARE_KV_BLOCKS_PER_SLOT  K of the KV rows (default 16: a slot of 256 tokens)
#   COMPARE_KV_IODEPTH  fio's queue depth on the KV rows (default min(128, 2 * n/K), see above)
#   COMPARE_KV_REPEAT   KV rows: passes per measurement, the median kept (default 3: one pass
#                       of 512 MiB takes ~0.5 s, which this disk's swings dominate)
#   COMPARE_DRY_RUN  1: print the run order ("run I/R: ROW TOOL after PREVIOUS") and each
#                    measurement's command, then exit: nothing installed, built, written or
#                    measured (tools/bench-scripts-test.sh checks the order with it)
# A tutti-bench run that fails (its error goes to stderr) leaves its run without a figure, a KV
# run without one when any of its passes failed (a --verify mismatch included): its row then says
# which runs are missing, its goals read INCOMPLETE rather than judged on the runs left, and the
# script exits 1 after the summary (a fio failure stops it at once).
set -euo pipefail

say() { printf '%s\n' "$*" >&2; }
DRY_RUN=${COMPARE_DRY_RUN:-0}
[[ $DRY_RUN =~ ^[01]$ ]] || { say "COMPARE_DRY_RUN=$DRY_RUN: 0 or 1"; exit 2; }
FILE=${COMPARE_FILE:-/var/tmp/tutti-compare.img}
SIZE=${COMPARE_SIZE:-4g}
RUNTIME=${COMPARE_RUNTIME:-10}
IODEPTH=${COMPARE_IODEPTH:-32}
SETTLE=${COMPARE_SETTLE:-2}
ROWS=${COMPARE_ROWS:-"randread-4k read-128k read-1m write-128k write-1m kv-retrieve kv-store"}
for row in $ROWS; do
    case $row in
        randread-4k | read-128k | read-1m | write-128k | write-1m | kv-retrieve | kv-store) ;;
        *) say "COMPARE_ROWS: unknown row '$row'"; exit 2 ;;
    esac
done
KV_TOKENS=${COMPARE_KV_TOKENS:-4096}
KV_K=${COMPARE_KV_BLOCKS_PER_SLOT:-16}
KV_BS_KIB=$((64 * KV_K))
KV_BLOCKS=$((KV_TOKENS / 16))
KV_DEPTH_DEFAULT=$((2 * ((KV_BLOCKS + KV_K - 1) / KV_K)))
[ "$KV_DEPTH_DEFAULT" -gt 128 ] && KV_DEPTH_DEFAULT=128
[ "$KV_DEPTH_DEFAULT" -lt 1 ] && KV_DEPTH_DEFAULT=1
KV_IODEPTH=${COMPARE_KV_IODEPTH:-$KV_DEPTH_DEFAULT}
KV_REPEAT=${COMPARE_KV_REPEAT:-3}
# llama3-8b: 128 KiB of KV per token; 16-token blocks.
KV_BYTES=$((KV_TOKENS / 16 * 16 * 131072))
TOOLS="fio uring emu"
[ "${COMPARE_QD1:-0}" = 1 ] && TOOLS="$TOOLS fioqd1"
[ "${COMPARE_FIO_HUGE:-0}" = 1 ] && TOOLS="$TOOLS fiohuge"
read -r -a TOOL_LIST <<<"$TOOLS"
# Two passes over the tools' orders, forwards then backwards (see the loop).
RUNS=${COMPARE_RUNS:-$((2 * ${#TOOL_LIST[@]}))}
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || { say "COMPARE_RUNS=$RUNS: a positive whole number"; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target-bench}
BENCH=${COMPARE_BENCH:-$CARGO_TARGET_DIR/release/tutti-bench}
# The test file is written over and removed: only ever a regular file (a device node or
# anything else at that path is refused, never written or removed).
if [ -e "$FILE" ] && { [ -L "$FILE" ] || [ ! -f "$FILE" ]; }; then
    say "COMPARE_FILE=$FILE exists and is not a regular file: refusing to write over or remove it"
    exit 2
fi
# fio's spellings of a power-of-two size (4g, 4G, 4gib, 4GiB, 4gb): numfmt takes the bare suffix.
SIZE_IEC=${SIZE^^}
SIZE_IEC=${SIZE_IEC%B}
SIZE_IEC=${SIZE_IEC%I}
SIZE_BYTES=$(numfmt --from=iec "$SIZE_IEC" 2>/dev/null) || { say "COMPARE_SIZE=$SIZE: a size such as 4g"; exit 2; }
WORK=$(mktemp -d)
HUGE_PAGES_BEFORE=""
# Set once this run has laid out (or reused) the file: until then it is not this run's to remove.
FILE_OURS=0
# The record that this script laid the file out: its size, device, inode and mtime, written
# after the layout and again at exit when the file is kept (the write rows move the mtime). A
# file is reused only when it matches: one that merely has its blocks allocated may be a
# fallocate'd one, whose unwritten extents read as zeroes without reaching the disk.
LAYOUT_RECORD=$FILE.tutti-compare
file_identity() { stat -c '%s %d %i %y' "$FILE"; }
cleanup() {
    rm -rf "$WORK"
    if [ "$FILE_OURS" = 1 ] && [ -f "$FILE" ] && [ ! -L "$FILE" ]; then
        if [ "${COMPARE_KEEP:-0}" = 1 ]; then
            [ ! -f "$LAYOUT_RECORD" ] || [ -L "$LAYOUT_RECORD" ] || file_identity > "$LAYOUT_RECORD"
        else
            rm -f "$FILE" "$LAYOUT_RECORD"
        fi
    fi
    [ -z "$HUGE_PAGES_BEFORE" ] || echo "$HUGE_PAGES_BEFORE" > /proc/sys/vm/nr_hugepages
}
trap cleanup EXIT

# fio's memory options for a fio column: 2 MiB huge pages for "fiohuge" (the size the script
# reserves and counts in, whatever fio's default huge page on the architecture), its default
# malloc otherwise.
fio_memory() { if [ "$1" = fiohuge ]; then echo --mem=shmhuge --hugepage-size=2m; else echo --mem=malloc; fi; }

row_params() { # name -> "rw bs"
    case $1 in
        randread-4k) echo "randread 4k" ;;
        read-128k) echo "read 128k" ;;
        read-1m) echo "read 1m" ;;
        write-128k) echo "write 128k" ;;
        write-1m) echo "write 1m" ;;
        kv-retrieve) echo "randread ${KV_BS_KIB}k" ;;
        kv-store) echo "randwrite ${KV_BS_KIB}k" ;;
    esac
}

# huge_pages_needed: 2 MiB pages for the largest buffer set fio allocates on the chosen rows. fio
# sizes a job's buffers as iodepth x bs, adds a page's mask for direct I/O and rounds up to the
# huge page (init_io_u_buffers); allocate_io_mem then adds the page's mask again and shmget's
# size is rounded up to the huge page once more (alloc_mem_shm), so the request is one page
# more than a single rounding: 32 x 1 MiB takes 18 pages, 128 x 1 MiB 66, 32 x 4 KiB 2 (fio-3.33
# with --debug=mem logs "shmget 37748736" for 32 x 1 MiB; tools/bench-scripts-test.sh compares
# this count with fio's own request where fio is installed). A fixed 64 before 2026-12-01, then
# one page short on every row until the second rounding was counted: shmget refused, and set -e
# threw the sitting away. fio's huge page is told (--hugepage-size=2m, see fio_memory): its
# default is 4 MiB on some architectures (aarch64).
huge_pages_needed() {
    local row rw bs bytes depth pages need=0 page_mask
    page_mask=$(($(getconf PAGESIZE) - 1))
    for row in $ROWS; do
        read -r rw bs <<<"$(row_params "$row")"
        bytes=$(numfmt --from=iec "${bs^^}")
        depth=$IODEPTH
        case $row in kv-*) depth=$KV_IODEPTH ;; esac
        pages=$(((depth * bytes + page_mask + 2097151) / 2097152 + 1))
        [ "$pages" -le "$need" ] || need=$pages
    done
    echo "$need"
}

if [ "${COMPARE_FIO_HUGE:-0}" = 1 ]; then
    HUGE_PAGES_NEEDED=$(huge_pages_needed)
    if [ "$DRY_RUN" = 1 ]; then
        say "would reserve $HUGE_PAGES_NEEDED huge pages (2 MiB) for fio's buffers"
    else
        [ "$(id -u)" = 0 ] || { say "COMPARE_FIO_HUGE=1 reserves huge pages: run as root"; exit 2; }
        # vm.nr_hugepages and shmget's SHM_HUGETLB use the default huge page, which must be the
        # 2 MiB one counted in.
        huge_kib=$(awk '/^Hugepagesize:/ {print $2}' /proc/meminfo)
        [ "$huge_kib" = 2048 ] || { say "COMPARE_FIO_HUGE=1 counts 2 MiB huge pages; this kernel's default is ${huge_kib:-unknown} kB"; exit 2; }
        HUGE_PAGES_BEFORE=$(cat /proc/sys/vm/nr_hugepages)
        echo $((HUGE_PAGES_BEFORE + HUGE_PAGES_NEEDED)) > /proc/sys/vm/nr_hugepages
        free_pages=$(awk '/^HugePages_Free:/ {print $2}' /proc/meminfo)
        [ "${free_pages:-0}" -ge "$HUGE_PAGES_NEEDED" ] ||
            { say "only ${free_pages:-0} huge pages free after reserving $HUGE_PAGES_NEEDED more"; exit 1; }
    fi
fi

# fio, installed once (idempotent: nothing happens when it is already there).
if [ "$DRY_RUN" = 0 ] && ! command -v fio >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    say "installing fio with apt-get"
    # As root (through sudo when not root), by the one helper that keeps a half-installed
    # etcd-server from being configured with its service started (tools/lib/dpkg.sh).
    # shellcheck disable=SC2016 # expanded by that shell
    $SUDO bash -c '. "$1" && dpkg_configure_pending' compare.sh "$(dirname "$(readlink -f "$0")")/lib/dpkg.sh" || true
    $SUDO timeout -k 30 900 apt-get install -y fio >/dev/null 2>&1 ||
        { $SUDO timeout -k 30 600 apt-get update >/dev/null && $SUDO timeout -k 30 900 apt-get install -y fio >/dev/null; } ||
        { say "apt-get install fio failed"; exit 1; }
fi
[ "$DRY_RUN" = 1 ] || command -v python3 >/dev/null || { say "python3 is needed to read the JSON results"; exit 1; }

if [ -z "${COMPARE_BENCH:-}" ] && [ "$DRY_RUN" = 0 ]; then
    say "building tutti-bench (release)"
    (cd "$ROOT" && cargo build --release --bin tutti-bench --quiet)
fi
# The KV rows format the file fio laid out: a build that refuses foreign contents is told to
# overwrite them; older builds (COMPARE_BENCH, "the commit before") have neither the check nor
# the option.
KV_OVERWRITE=
# Writes unstamped on both sides: fio's default (scramble_buffers=1) stamps every 512 B of each
# write, tutti-bench's stamp is 8 bytes per 4 KiB and its KV store stamps nothing, so a stamped
# fio did more work per write than the tool it was compared with (tools/vm-bench.sh turns the
# stamp off the same way). fio takes --scramble_buffers=0 on every measurement (reads ignore it);
# tutti-bench's write rows when it has the option (older builds neither stamp nor have it).
UNSTAMPED=
if [ "$DRY_RUN" = 1 ]; then
    KV_OVERWRITE=--overwrite
    UNSTAMPED=--scramble_buffers=0
else
    "$BENCH" --help 2>/dev/null | grep -q -- --overwrite && KV_OVERWRITE=--overwrite
    "$BENCH" --help 2>/dev/null | grep -q -- --scramble_buffers && UNSTAMPED=--scramble_buffers=0
fi

# One file for everyone, written in full so that every read hits written blocks. With
# COMPARE_KEEP=1 a file an earlier COMPARE_KEEP=1 run laid out and kept (its LAYOUT_RECORD
# matches), of this size and allocated in full, is reused.
if [ "${COMPARE_KEEP:-0}" = 1 ] && [ -f "$FILE" ] && [ "$(stat -c %s "$FILE")" = "$SIZE_BYTES" ] &&
    [ $(($(stat -c '%b * %B' "$FILE"))) -ge "$SIZE_BYTES" ] &&
    [ -f "$LAYOUT_RECORD" ] && [ ! -L "$LAYOUT_RECORD" ] && [ "$(cat "$LAYOUT_RECORD")" = "$(file_identity)" ]; then
    say "reusing $FILE ($SIZE, laid out by an earlier COMPARE_KEEP=1 run)"
elif [ "$DRY_RUN" = 1 ]; then
    say "would lay out $FILE ($SIZE)"
else
    say "laying out $FILE ($SIZE)"
    rm -f "$FILE" "$LAYOUT_RECORD"
    FILE_OURS=1
    fio --name=layout --filename="$FILE" --size="$SIZE" --rw=write --bs=1m --iodepth=32 \
        --ioengine=io_uring --direct=1 --output=/dev/null
    file_identity > "$LAYOUT_RECORD"
fi
[ "$DRY_RUN" = 1 ] || FILE_OURS=1

# measure COMMAND...: runs it, or prints it with COMPARE_DRY_RUN=1.
measure() {
    if [ "$DRY_RUN" = 1 ]; then printf '    %s\n' "$*"; else "$@"; fi
}

# run TOOL ROW RUN -> writes the JSON result to $WORK/TOOL-ROW-RUN.json
run() {
    local tool=$1 row=$2 index=$3 rw bs out
    read -r rw bs <<<"$(row_params "$row")"
    out=$WORK/$tool-$row-$index.json
    case $row in kv-*) run_kv "$tool" "$row" "$index" "$rw" "$bs" "$out"; return ;; esac
    case $tool in
        fio|fioqd1|fiohuge)
            local depth=$IODEPTH memory
            [ "$tool" = fioqd1 ] && depth=1
            read -r -a memory <<<"$(fio_memory "$tool")"
            # --randrepeat=0: other offsets every run, as tutti-bench (seeded from the clock)
            # and vm-bench's fio rows; fio's default replays the same ones.
            measure fio --name=job --filename="$FILE" --size="$SIZE" --rw="$rw" --bs="$bs" --iodepth="$depth" \
                --numjobs=1 --ioengine=io_uring --direct=1 --time_based --runtime="$RUNTIME" "${memory[@]}" \
                --randrepeat=0 --scramble_buffers=0 --output-format=json --output="$out" ;;
        uring|emu)
            local unstamped=()
            case $rw in *write) [ -z "$UNSTAMPED" ] || unstamped=("$UNSTAMPED") ;; esac
            [ "$DRY_RUN" = 0 ] || { measure "$BENCH" --device "$tool:$FILE" --size="$SIZE" --rw="$rw" --bs="$bs" --iodepth="$IODEPTH" \
                --numjobs=1 --time_based --runtime="$RUNTIME" --output-format=json "${unstamped[@]}"; return; }
            "$BENCH" --device "$tool:$FILE" --size="$SIZE" --rw="$rw" --bs="$bs" --iodepth="$IODEPTH" \
                --numjobs=1 --time_based --runtime="$RUNTIME" --output-format=json "${unstamped[@]}" >"$out" 2>"$WORK/stderr" \
                || { say "tutti-bench $tool $row failed: $(cat "$WORK/stderr")"; echo '{}' >"$out"; } ;;
    esac
}

# run_kv TOOL ROW RUN RW BS OUT: a KV row. fio moves the pool's bytes (see the top); tutti-bench
# runs the KV workload once for both KV rows (store, then retrieve) and each row reads its phase.
# KV_REPEAT passes each, their JSON kept as OUT.1, OUT.2, ...
run_kv() {
    local tool=$1 row=$2 index=$3 rw=$4 bs=$5 out=$6 pass
    for pass in $(seq 1 "$KV_REPEAT"); do
        case $tool in
            fio|fioqd1|fiohuge)
                local depth=$KV_IODEPTH memory
                [ "$tool" = fioqd1 ] && depth=1
                read -r -a memory <<<"$(fio_memory "$tool")"
                measure fio --name=job --filename="$FILE" --offset=1m --size="$KV_BYTES" --rw="$rw" --bs="$bs" --iodepth="$depth" \
                    --numjobs=1 --ioengine=io_uring --direct=1 "${memory[@]}" --randrepeat=0 --scramble_buffers=0 --output-format=json --output="$out.$pass" ;;
            emu)
                [ "$DRY_RUN" = 0 ] || { measure "$BENCH" --device "emu:$FILE" --workload=kv --prompt-tokens="$KV_TOKENS" --blocks-per-slot="$KV_K" --hit-rate=1 --verify $KV_OVERWRITE \
                    --output-format=json; continue; }
                "$BENCH" --device "emu:$FILE" --workload=kv --prompt-tokens="$KV_TOKENS" --blocks-per-slot="$KV_K" --hit-rate=1 --verify $KV_OVERWRITE \
                    --output-format=json >"$out.$pass" 2>"$WORK/stderr" \
                    || { say "tutti-bench kv failed: $(cat "$WORK/stderr")"; echo '{}' >"$out.$pass"; } ;;
        esac
        [ "$pass" = "$KV_REPEAT" ] || [ "$DRY_RUN" = 1 ] || { sync; sleep "$SETTLE"; }
    done
}

# One KV run of tutti-bench measures both KV rows (its store, then its retrieve): it runs on the
# kv-retrieve row, or on kv-store's when kv-retrieve is not chosen.
KV_EMU_ROW=kv-store
[[ " $ROWS " == *" kv-retrieve "* ]] && KV_EMU_ROW=kv-retrieve

load_start=$(cut -d' ' -f1-3 /proc/loadavg)
previous=none
for index in $(seq 1 "$RUNS"); do
    # Tools interleaved within a run, so that drift on a shared machine hits all of them, and
    # their order changed from run to run: a virtual disk may still be writing back what the
    # previous tool wrote, which must not always penalise the same tool. Turning a cycle alone
    # keeps each tool's neighbours (fio always ran right after emu): it turns one place per row
    # and per run, and runs backwards in every second group of as many runs as there are tools,
    # so over 2 x tools runs each tool follows each of its two neighbours on every row
    # (tools/vm-bench.sh orders its drivers the same way).
    rotate=$((index - 1))
    cycle=("${TOOL_LIST[@]}")
    if [ $(((rotate / ${#TOOL_LIST[@]}) % 2)) = 1 ]; then
        cycle=()
        for ((k = ${#TOOL_LIST[@]} - 1; k >= 0; k--)); do cycle+=("${TOOL_LIST[k]}"); done
    fi
    row_index=0
    for row in $ROWS; do
        shift_by=$(((row_index + rotate) % ${#cycle[@]}))
        order=("${cycle[@]:shift_by}" "${cycle[@]:0:shift_by}")
        row_index=$((row_index + 1))
        for tool in "${order[@]}"; do
            case $row in kv-*) [ "$tool" = uring ] && continue ;; esac # no KV workload on the kernel path
            run_row=$row
            if [ "$tool" = emu ]; then
                case $row in kv-*) [ "$row" = "$KV_EMU_ROW" ] || continue; run_row=kv-retrieve ;; esac
            fi
            say "run $index/$RUNS: $row $tool"
            if [ "$DRY_RUN" = 1 ]; then
                echo "run $index/$RUNS: $row $tool after $previous"
            else
                sync
                sleep "$SETTLE"
            fi
            previous=$tool
            run "$tool" "$run_row" "$index"
        done
    done
done
[ "$DRY_RUN" = 0 ] || exit 0

load_end=$(cut -d' ' -f1-3 /proc/loadavg)
uname_line="$(nproc) cores, $(uname -r), $(df -T "$(dirname "$FILE")" | awk 'NR==2 {print $2" on "$1}'), fio $(fio --version)"
python3 - "$WORK" "$RUNS" "$ROWS" "$IODEPTH" "$RUNTIME" "$SIZE" "$uname_line" "$load_start" "$load_end" "$TOOLS" "$KV_REPEAT" "$KV_IODEPTH" "$KV_TOKENS" "$KV_K" "$KV_BS_KIB" <<'EOF'
import json, statistics, sys
work, runs, rows, iodepth, runtime, size, machine, load_start, load_end, tools, kv_repeat, kv_iodepth, kv_tokens, kv_k, kv_bs_kib = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), *sys.argv[4:]
tools = tools.split()
kv_repeat = int(kv_repeat)

def one_figure(tool, row, path):
    try:
        report = json.load(open(path))
        if row.startswith("kv-") and tool == "emu":
            # tutti-bench's KV JSON: the phase's bytes over its layers' time.
            wanted = "retrieve" if row == "kv-retrieve" else "store"
            return next(p for p in report["phases"] if p["phase"].startswith(wanted))["bw_bytes"] / 1e6
        job = report["jobs"][0]
    except (OSError, ValueError, KeyError, IndexError, StopIteration):
        return None
    side = job["write"] if row.startswith("write") or row == "kv-store" else job["read"]
    return side["iops"] if row.endswith("4k") else side["bw_bytes"] / 1e6

def figure(tool, row, index):
    """IOPS for the 4 KiB row, MB/s for the others (KV rows: the median of the passes); None
    when the run produced nothing, or on a KV row when any of its passes did (a failed pass,
    a --verify mismatch among them, must not be outvoted by the others)."""
    if not row.startswith("kv-"):
        return one_figure(tool, row, f"{work}/{tool}-{row}-{index}.json")
    source = "kv-retrieve" if tool == "emu" else row  # one tutti-bench run gives both KV rows
    values = [one_figure(tool, row, f"{work}/{tool}-{source}-{index}.json.{p}") for p in range(1, kv_repeat + 1)]
    return None if None in values else statistics.median(values)

def tools_of(row):
    return [tool for tool in tools if not (row.startswith("kv-") and tool == "uring")]

# Every measurement that produced no figure, by (row, tool): a goal is judged only on complete
# rows, and the script fails, so that a crash or a verify failure is not a "-" in a listing.
figures = {(row, tool): [figure(tool, row, i) for i in range(1, runs + 1)] for row in rows for tool in tools_of(row)}
missing = {key: [i + 1 for i, v in enumerate(values) if v is None] for key, values in figures.items()}
missing = {key: indices for key, indices in missing.items() if indices}
missing_total = sum(len(indices) for indices in missing.values())

def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None

def show(value, digits=0):
    return "-" if value is None else f"{value:,.{digits}f}"

print(f"machine: {machine}; load average {load_start} at start, {load_end} at end")
print(f"parameters: iodepth={iodepth} numjobs=1 runtime={runtime}s size={size} direct I/O; medians of {runs} runs; ratio = median of per-run ratios to fio"
      + (f"; {missing_total} measurement(s) missing (INCOMPLETE rows, see stderr for the failures)" if missing_total else ""))
if any(row.startswith("kv-") for row in rows):
    print(f"kv rows: llama3-8b, {kv_tokens} tokens, {kv_k} blocks per slot, {kv_bs_kib} KiB per command; fio randread/randwrite bs={kv_bs_kib}k iodepth={kv_iodepth} over the same bytes, one pass; each run's figure the median of {kv_repeat} passes")
qd1 = "fioqd1" in tools
huge = "fiohuge" in tools
print(f"{'row':<12} {'unit':<5} {'fio':>10} {'uring':>10} {'ratio':>6} {'emu':>10} {'ratio':>6}" + (f" {'fio qd1':>10}" if qd1 else "")
      + (f" {'fio huge':>10} {'emu/huge':>8}" if huge else "") + "  goals")
for row in rows:
    values = {tool: figures.get((row, tool), [None] * runs) for tool in ("fio", "uring", "emu")}
    fio = values["fio"]

    def judged(tool, goal, ratio):
        if missing.get((row, tool)) or missing.get((row, "fio")):
            return f"{tool}>={goal} INCOMPLETE"
        return f"{tool}>={goal} " + ("met" if ratio is not None and ratio >= goal else "MISSED")
    cells = []
    for tool in ("uring", "emu"):
        ratios = [v / f for v, f in zip(values[tool], fio) if v is not None and f]
        cells.append((median(values[tool]), median(ratios)))
    (uring, uring_ratio), (emu, emu_ratio) = cells
    # Issue 16's bars: uring >= 0.95 everywhere; emu >= 0.9 at 4 KiB, >= 0.95 on large blocks;
    # KV retrieve >= 0.95, store >= 0.9.
    goals = [judged("uring", 0.95, uring_ratio)]
    if row.startswith("kv-"):
        goal = 0.95 if row == "kv-retrieve" else 0.9
        goals = [judged("emu", goal, emu_ratio)]
    else:
        goal = 0.9 if row.endswith("4k") else 0.95
        goals.append(judged("emu", goal, emu_ratio))
    goals += [f"{tool} run{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))} missing"
              for (missing_row, tool), indices in missing.items() if missing_row == row]
    huge_cells = ""
    if huge:
        huge_values = figures[(row, "fiohuge")]
        huge_ratio = median([e / h for e, h in zip(values["emu"], huge_values) if e is not None and h])
        huge_cells = f" {show(median(huge_values)):>10} {show(huge_ratio, 2):>8}"
    unit = "IOPS" if row.endswith("4k") else "MB/s"
    print(f"{row:<12} {unit:<5} {show(median(fio)):>10} {show(uring):>10} {show(uring_ratio, 2):>6} {show(emu):>10} {show(emu_ratio, 2):>6}" + (f" {show(median(figures[(row, 'fioqd1')])):>10}" if qd1 else "") + huge_cells + f"  {', '.join(goals)}")
print()
print("per run (the spread is the machine's noise):")
for row in rows:
    for tool in tools_of(row):
        values = figures[(row, tool)]
        name = {"fioqd1": "fio qd1", "fiohuge": "fio huge"}.get(tool, tool)
        print(f"  {row:<12} {name:<8} " + "  ".join(show(v) for v in values))
if missing_total:
    print(f"compare.sh: {missing_total} measurement(s) produced no figure; the goals of their rows are not judged", file=sys.stderr)
    sys.exit(1)
EOF
