#!/usr/bin/env bash
# tools/vm-bench.sh — side-by-side benchmark in the VM of tools/vm-test.sh: the guest kernel's
# nvme driver driven by fio against our userspace driver driven by tutti-bench, on the same QEMU
# NVMe controller. A benchmark command, not a test: it prints a table and fails only if a run
# fails. Numbers under TCG describe the emulator, not an SSD: compare the two drivers only.
#
# Rows (issue 3 §5): 4 KiB random read at QD 1 and QD 32; 128 KiB and 1 MiB sequential read and
# write. For each row: the guest kernel's nvme driver under fio (io_uring, O_DIRECT), then — after
# `tutti bind` moved the controller to vfio-pci — our userspace driver under tutti-bench with the
# same parameters (CPU executor, polled, through the emulated IOMMU). Columns: IOPS, bandwidth,
# p50/p99 completion latency, and ours/kernel (IOPS, which for equal block sizes is also the
# bandwidth ratio). The goal is >= 1.0 on every row; the table says MISSED where it is not.
#
# Environment: everything tools/vm-test.sh takes for the VM (TUTTI_VM_DIR, TUTTI_VM_NVME_ARGS,
# TUTTI_VM_NS_ARGS, TUTTI_VM_DISK_MIB, TUTTI_VM_MEM, TUTTI_VM_SMP, TUTTI_VM_TIMEOUT_S,
# TUTTI_VM_IOMMU_PT), plus
#   TUTTI_BENCH_RUNTIME_S    seconds per row and driver (default 8; fio adds a 1 s ramp)
#   TUTTI_BENCH_SIZE_MIB     span of the device each job touches (default 512)
#   TUTTI_BENCH_OURS=0       kernel rows only (no static tutti-bench build)
#   TUTTI_BENCH_ROWS=A,B     only these rows (names as printed: randread-4k-qd1, randread-4k-qd32,
#                            seqread-128k, seqread-1m, seqwrite-128k, seqwrite-1m; default all)
#   TUTTI_BENCH_GUEST_CLOCK  tsc (default: the guest kernel is told its TSC is reliable, so a clock
#                            read is an instruction, not a system call and an emulated HPET access
#                            under QEMU's big lock) or kernel (the guest kernel's choice: hpet
#                            under TCG here)
#   TUTTI_VM_DRIVE_ARGS      the emulated controller's backing file options (default here
#                            cache=unsafe,aio=io_uring: the host's page cache, no thread-pool hop
#                            per I/O; tools/vm-test.sh's default is cache=unsafe alone)
#   TUTTI_BENCH_BEFORE=PATH  also run this tutti-bench binary (static, e.g. built from an older
#                            commit with the same target: see docs/vfio.md) in the same boot,
#                            back to back with ours on each row (order rotating), and print
#                            ours/before per row
#   TUTTI_BENCH_SPDK=DIR     also run SPDK's spdk_nvme_perf (polled, one core) from an SPDK tree
#                            built outside this repository with shared libraries (DIR/build/bin,
#                            DIR/build/lib; docs/vfio.md, "Against SPDK"), on the same controller
#                            after `tutti bind`, in the rotation with ours, and print ours/spdk
#                            per row. The namespace is then exactly the span (perf reads all of
#                            it), so both touch the same filled bytes.
#   TUTTI_BENCH_PIN=CPU      also run ours with --cpus_allowed=CPU (SPDK's perf pins itself to the
#                            guest's CPU 0 with -c 0x1) as driver "pinned", in the same rotation;
#                            its rows get the same ratio columns as ours
#   TUTTI_BENCH_SHADOW=1     also run ours with --shadow-doorbells (Doorbell Buffer Config, which
#                            QEMU's controller offers) as driver "shadow", in the same rotation;
#                            its rows get the same ratio columns as ours
#   TUTTI_BENCH_ROTATE=N     start each row's driver order N places further on (default 0), and
#                            run the drivers' cycle backwards when N / drivers is odd. The order
#                            rotates from row to row but is the same in every boot, so one driver
#                            always follows another on a given row (an unpinned job's rate
#                            seemed to depend on which process ran before it); over
#                            boots with N = 0 .. 2 × drivers − 1 every driver takes every place
#                            on every row and follows each of two neighbours
#   TUTTI_BENCH_COMMANDS_ONLY=FILE  write the guest's command list to FILE and stop: nothing
#                            installed, built or booted (tools/bench-scripts-test.sh checks it)
#   TUTTI_BENCH_REPEAT=K     run the drivers' rows K times in one boot (default 1; the kernel's
#                            rows once), pass P as if TUTTI_BENCH_ROTATE were N + P − 1; with
#                            K > 1 the table shows medians over the passes and the ratio columns
#                            the median of each pass's ratio, and a second table lists every
#                            pass's ratio (a row alone, repeated back to back, is then measured
#                            without the other rows before it)
# The first controller (/dev/nvme0n1, then vfio:0000:00:04.0 in the guest) is benchmarked.
set -euo pipefail
# shellcheck source=tools/vm/lib.sh
. "$(dirname "$(readlink -f "$0")")/vm/lib.sh"

RUNTIME_S=${TUTTI_BENCH_RUNTIME_S:-8}
SIZE_MIB=${TUTTI_BENCH_SIZE_MIB:-512}
ROTATE=${TUTTI_BENCH_ROTATE:-0}
[[ "$ROTATE" =~ ^(0|[1-9][0-9]{0,3})$ ]] || vm_die "TUTTI_BENCH_ROTATE=$ROTATE is not a small whole number"
REPEAT=${TUTTI_BENCH_REPEAT:-1}
[[ "$REPEAT" =~ ^[1-9][0-9]?$ ]] || vm_die "TUTTI_BENCH_REPEAT=$REPEAT: a number of passes from 1 to 99"
OURS=${TUTTI_BENCH_OURS:-1}
[ "$REPEAT" = 1 ] || [ "$OURS" = 1 ] || vm_die "TUTTI_BENCH_REPEAT repeats our rows (the kernel's run once): drop TUTTI_BENCH_OURS=0"
BEFORE=${TUTTI_BENCH_BEFORE:-}
if [ -n "$BEFORE" ]; then
    [ "$OURS" = 1 ] || vm_die "TUTTI_BENCH_BEFORE compares with our rows: drop TUTTI_BENCH_OURS=0"
    [ -x "$BEFORE" ] || vm_die "TUTTI_BENCH_BEFORE=$BEFORE is not an executable file"
    # The guest has no libc: a dynamically linked binary would fail there, after the kernel rows.
    if ! file -L "$BEFORE" | grep -q 'statically linked\|static-pie linked'; then
        vm_die "TUTTI_BENCH_BEFORE=$BEFORE is not statically linked (build it with RUSTFLAGS=\"-C target-feature=+crt-static\" --target x86_64-unknown-linux-gnu)"
    fi
fi
SHADOW=${TUTTI_BENCH_SHADOW:-0}
case $SHADOW in
    0) ;;
    1) [ "$OURS" = 1 ] || vm_die "TUTTI_BENCH_SHADOW runs ours with shadow doorbells: drop TUTTI_BENCH_OURS=0" ;;
    *) vm_die "TUTTI_BENCH_SHADOW=$SHADOW: 0 or 1" ;;
esac
PIN=${TUTTI_BENCH_PIN:-}
if [ -n "$PIN" ]; then
    [ "$OURS" = 1 ] || vm_die "TUTTI_BENCH_PIN runs ours pinned: drop TUTTI_BENCH_OURS=0"
    [[ $PIN =~ ^[0-9]+$ ]] || vm_die "TUTTI_BENCH_PIN=$PIN: one guest CPU number, e.g. 0"
fi
SPDK_DIR=${TUTTI_BENCH_SPDK:-}
if [ -n "$SPDK_DIR" ]; then
    [ "$OURS" = 1 ] || vm_die "TUTTI_BENCH_SPDK compares with our rows (and needs tutti bind): drop TUTTI_BENCH_OURS=0"
    [ -x "$SPDK_DIR/build/bin/spdk_nvme_perf" ] || vm_die "TUTTI_BENCH_SPDK=$SPDK_DIR has no build/bin/spdk_nvme_perf"
    [ -d "$SPDK_DIR/build/lib" ] || vm_die "TUTTI_BENCH_SPDK=$SPDK_DIR has no build/lib (configure SPDK --with-shared)"
    export TUTTI_VM_DISK_MIB=${TUTTI_VM_DISK_MIB:-$SIZE_MIB}
fi
export TUTTI_VM_DISK_MIB=${TUTTI_VM_DISK_MIB:-$((SIZE_MIB + 64))}
# Both settings take emulator costs off every driver's rows alike (docs/vfio.md, "vm-bench"): with
# the guest kernel's own choices a 4 KiB read at QD 32 measured mostly QEMU's HPET and thread pool.
case ${TUTTI_BENCH_GUEST_CLOCK:-tsc} in
    tsc) export TUTTI_VM_APPEND="clocksource=tsc tsc=reliable ${TUTTI_VM_APPEND:-}" ;;
    kernel) ;;
    *) vm_die "TUTTI_BENCH_GUEST_CLOCK=${TUTTI_BENCH_GUEST_CLOCK}: tsc or kernel" ;;
esac
export TUTTI_VM_DRIVE_ARGS=${TUTTI_VM_DRIVE_ARGS:-cache=unsafe,aio=io_uring}
export TUTTI_VM_NVME_COUNT=1
# Six rows, each run by two or three drivers (with a 1 s ramp for fio), under TCG.
SECONDS_PER_RUNTIME_S=40
[ -n "$BEFORE" ] && SECONDS_PER_RUNTIME_S=60
[ -n "$SPDK_DIR" ] && SECONDS_PER_RUNTIME_S=$((SECONDS_PER_RUNTIME_S + 20))
[ "$SHADOW" = 1 ] && SECONDS_PER_RUNTIME_S=$((SECONDS_PER_RUNTIME_S + 20))
[ -n "$PIN" ] && SECONDS_PER_RUNTIME_S=$((SECONDS_PER_RUNTIME_S + 20))
export TUTTI_VM_TIMEOUT_S=${TUTTI_VM_TIMEOUT_S:-$((RUNTIME_S * SECONDS_PER_RUNTIME_S * REPEAT + 180))}

# One run per row and driver; each JSON document (fio's schema; tutti-bench writes the same) is
# framed by markers so the host can cut it out of the console. tutti-bench's progress display
# (stderr) is shown only when a run fails.
ROWS=(randread-4k-qd1:randread:4k:1 randread-4k-qd32:randread:4k:32 seqread-128k:read:128k:32
    seqread-1m:read:1m:8 seqwrite-128k:write:128k:32 seqwrite-1m:write:1m:8)
if [ -n "${TUTTI_BENCH_ROWS:-}" ]; then
    chosen=()
    IFS=, read -r -a wanted <<< "$TUTTI_BENCH_ROWS"
    for name in "${wanted[@]}"; do
        match=
        for spec in "${ROWS[@]}"; do [ "${spec%%:*}" = "$name" ] && match=$spec; done
        [ -n "$match" ] || vm_die "TUTTI_BENCH_ROWS: no row named '$name' (rows: $(printf '%s ' "${ROWS[@]%%:*}"))"
        chosen+=("$match")
    done
    ROWS=("${chosen[@]}")
fi
# TUTTI_BENCH_COMMANDS_ONLY=FILE: the guest's commands go to FILE and the script stops there.
COMMANDS=${TUTTI_BENCH_COMMANDS_ONLY:-$VM_DIR/commands.bench}
mkdir -p "$(dirname "$COMMANDS")"
# The guest's clock source says what a clock read costs there (tsc: no system call).
# shellcheck disable=SC2016 # expanded by the guest's shell
printf '%s\n' 'echo "guest clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource)"' > "$COMMANDS"
# Fill the span once so reads return written data rather than the image's holes.
printf '%s\n' "/usr/bin/fio --name=fill --filename=/dev/nvme0n1 --ioengine=io_uring --direct=1 --rw=write --bs=1M --iodepth=16 --size=${SIZE_MIB}M --output-format=terse > /dev/null" >> "$COMMANDS"
# --scramble_buffers=0: the kernel's writes, as ours below and SPDK's perf, do not stamp each
# buffer (fio's default stamps every 512 B of each write, costly under TCG); until 2026-11-30
# they did, so earlier ours/kernel write ratios compared different work.
for spec in "${ROWS[@]}"; do
    IFS=: read -r name rw block depth <<< "$spec"
    printf '%s\n' "echo JSON_BEGIN kernel $name; /usr/bin/fio --name=$name --filename=/dev/nvme0n1 --ioengine=io_uring --direct=1 --rw=$rw --bs=$block --iodepth=$depth --numjobs=1 --size=${SIZE_MIB}M --time_based --ramp_time=1 --runtime=$RUNTIME_S --randrepeat=0 --norandommap --scramble_buffers=0 --output-format=json | sed 's/^/JSON /'; echo JSON_END" >> "$COMMANDS"
done
# label:command of each driver after the kernel's rows (none with TUTTI_BENCH_OURS=0).
DRIVERS=()
if [ "$OURS" = 1 ]; then
    # shellcheck disable=SC2016 # $TUTTI_BDF0 is expanded by the guest's shell
    printf '%s\n' 'tutti bind $TUTTI_BDF0' >> "$COMMANDS"
    # SPDK's DPDK environment wants hugetlbfs mounted and a writable /var/run.
    [ -n "$SPDK_DIR" ] && printf '%s\n' 'mkdir -p /dev/hugepages /var/run /var/tmp && mount -t hugetlbfs nodev /dev/hugepages && mount -t tmpfs tmpfs /var/run' >> "$COMMANDS"
    # With a "before" binary or SPDK, the drivers run back to back on each row, in the same
    # boot; the order rotates from row to row, so that none always follows another.
    DRIVERS+=("ours:tutti-bench")
    [ -n "$BEFORE" ] && DRIVERS+=("before:tutti-bench-before")
    [ -n "$SPDK_DIR" ] && DRIVERS+=("spdk:spdk_nvme_perf")
    [ "$SHADOW" = 1 ] && DRIVERS+=("shadow:tutti-bench --shadow-doorbells")
    [ -n "$PIN" ] && DRIVERS+=("pinned:tutti-bench --cpus_allowed=$PIN")
    for ((pass = 1; pass <= REPEAT; pass++)); do
        rotate=$((ROTATE + pass - 1))
        cycle=("${DRIVERS[@]}")
        if [ $(((rotate / ${#DRIVERS[@]}) % 2)) = 1 ]; then
            cycle=()
            for ((index = ${#DRIVERS[@]} - 1; index >= 0; index--)); do cycle+=("${DRIVERS[index]}"); done
        fi
        row_index=0
        for spec in "${ROWS[@]}"; do
            IFS=: read -r name rw block depth <<< "$spec"
            shift_by=$(((row_index + rotate) % ${#cycle[@]}))
            order=("${cycle[@]:shift_by}" "${cycle[@]:0:shift_by}")
            row_index=$((row_index + 1))
            for driver in "${order[@]}"; do
                label=${driver%%:*} binary=${driver#*:}
                if [ "$label" = spdk ]; then
                    bytes=$(numfmt --from=iec "${block^^}")
                    # Its report goes to the console as PERF lines; the summary reads the Total line.
                    printf '%s\n' "echo JSON_BEGIN spdk $name $pass; LD_LIBRARY_PATH=$(printf %q "$SPDK_DIR/build/lib") /usr/bin/spdk_nvme_perf -r 'trtype:PCIe traddr:'\$TUTTI_BDF0 -q $depth -o $bytes -w $rw -t $RUNTIME_S -c 0x1 -s 128 --iova-mode pa > /tmp/perf.txt 2>&1; status=\$?; sed 's/^/PERF /' /tmp/perf.txt; echo JSON_END; exit \$status" >> "$COMMANDS"
                    continue
                fi
                # Writes as SPDK's perf writes (its buffers unchanged from I/O to I/O): a build
                # that stamps each write (--scramble_buffers, fio's default) is told not to;
                # older builds ("before") have neither the stamp nor the option.
                printf '%s\n' "echo JSON_BEGIN $label $name $pass; unstamped=; $binary --help 2>/dev/null | grep -q -- --scramble_buffers && unstamped=--scramble_buffers=0; $binary --workload=raw --device vfio:\$TUTTI_BDF0 --rw=$rw --bs=$block --iodepth=$depth --numjobs=1 --size=${SIZE_MIB}M --time_based --runtime=${RUNTIME_S}s --output-format=json \$unstamped > /tmp/result.json 2> /tmp/stderr.txt; status=\$?; [ \$status = 0 ] || cat /tmp/stderr.txt; sed 's/^/JSON /' /tmp/result.json; echo JSON_END; exit \$status" >> "$COMMANDS"
            done
        done
    done
fi
[ -z "${TUTTI_BENCH_COMMANDS_ONLY:-}" ] || exit 0

mkdir -p "$VM_DIR"/{debs,logs,kernel}
vm_install_host_tools
command -v fio > /dev/null || {
    [ "${TUTTI_VM_SKIP_APT:-0}" = 1 ] && vm_die "fio is missing (TUTTI_VM_SKIP_APT=1)"
    vm_log "installing fio"
    export DEBIAN_FRONTEND=noninteractive
    dpkg_configure_pending "$VM_DIR/logs/apt-fio.log" # tools/lib/dpkg.sh, through vm/lib.sh
    timeout -k 30 900 apt-get install -y -qq --no-install-recommends fio >> "$VM_DIR/logs/apt-fio.log" 2>&1 ||
        { timeout -k 30 600 apt-get update -qq >> "$VM_DIR/logs/apt-fio.log" 2>&1 &&
            timeout -k 30 900 apt-get install -y -qq --no-install-recommends fio >> "$VM_DIR/logs/apt-fio.log" 2>&1; } ||
        vm_die "apt-get install fio failed; see $VM_DIR/logs/apt-fio.log"
}
command -v python3 > /dev/null || vm_die "python3 is needed to summarise the JSON results"
vm_prepare_kernel
vm_nvme_args

BINARIES=()
if [ "$OURS" = 1 ]; then
    vm_log "building static guest binaries (tutti-bench, tutti) into $VM_TARGET_DIR"
    vm_cargo_static -p tutti-bench --bin tutti-bench -p tutti --bin tutti > "$VM_DIR/logs/build-bench.log" 2>&1 ||
        { tail -n 30 "$VM_DIR/logs/build-bench.log" >&2; vm_die "static build of tutti-bench/tutti failed (log: $VM_DIR/logs/build-bench.log)"; }
    BINARIES=("$VM_BIN_DIR/tutti-bench" "$VM_BIN_DIR/tutti")
fi

# copy_with_libraries BINARY DEST [LIBRARY_PATH]: BINARY at $EXTRA/DEST, and every shared library
# it loads (resolved with LD_LIBRARY_PATH=LIBRARY_PATH) at its host path, plus the dynamic
# loader; the guest then runs it with the same LD_LIBRARY_PATH.
copy_with_libraries() {
    local binary=$1 dest=$2 library_path=${3:-} libraries
    mkdir -p "$EXTRA$(dirname "$dest")"
    cp -L "$binary" "$EXTRA$dest"
    libraries=$(LD_LIBRARY_PATH=$library_path ldd "$binary")
    if grep -q '=> not found' <<< "$libraries"; then
        vm_die "$binary needs libraries not found here: $(grep '=> not found' <<< "$libraries" | awk '{ print $1 }' | tr '\n' ' ')"
    fi
    awk '/=> \// { print $3 } /^\t\/.*ld-linux/ { print $1 }' <<< "$libraries" | while read -r library; do
        mkdir -p "$EXTRA$(dirname "$library")"
        cp -L "$library" "$EXTRA$library"
    done
    # The binary names its interpreter /lib64/ld-linux-x86-64.so.2: make sure that path resolves.
    [ -e "$EXTRA/lib64/ld-linux-x86-64.so.2" ] || { mkdir -p "$EXTRA/lib64" && cp -L /lib64/ld-linux-x86-64.so.2 "$EXTRA/lib64/"; }
}
EXTRA=$(mktemp -d "$VM_DIR/fio-root.XXXXXX")
trap 'rm -rf "$EXTRA"' EXIT
# Debian's fio links librados, libgfapi, ... directly.
copy_with_libraries "$(command -v fio)" /usr/bin/fio
if [ -n "$SPDK_DIR" ]; then
    # perf with SPDK's own libraries and those it loads (DPDK, ISA-L, OpenSSL, whose
    # configuration file it reads at start).
    copy_with_libraries "$SPDK_DIR/build/bin/spdk_nvme_perf" /usr/bin/spdk_nvme_perf "$SPDK_DIR/build/lib"
    if [ -f /usr/lib/ssl/openssl.cnf ]; then
        mkdir -p "$EXTRA/usr/lib/ssl" && cp -L /usr/lib/ssl/openssl.cnf "$EXTRA/usr/lib/ssl/"
    fi
fi
if [ -n "$BEFORE" ]; then
    mkdir -p "$EXTRA/bin"
    install -m 755 "$BEFORE" "$EXTRA/bin/tutti-bench-before"
    strip --strip-debug "$EXTRA/bin/tutti-bench-before"
fi

CONF=$VM_DIR/conf.bench
HUGEPAGES=128
[ -n "$SPDK_DIR" ] && HUGEPAGES=256
printf '%s\n' LOAD_NVME=1 BIND=0 "HUGEPAGES=$HUGEPAGES" "COMMAND_TIMEOUT_S=$((RUNTIME_S * 4 + 120))" SHELL_AFTER=0 > "$CONF"
INITRD=$VM_DIR/initramfs-bench.cpio
vm_build_initramfs "$INITRD" "$COMMANDS" "$CONF" "$EXTRA" -- "${BINARIES[@]}"
vm_log "backing file options: $TUTTI_VM_DRIVE_ARGS; extra guest kernel arguments: ${TUTTI_VM_APPEND:-none}"
vm_log "initramfs $(du -h "$INITRD" | cut -f1) (fio and its libraries included); guest commands:"
sed 's/^/    /' "$COMMANDS" >&2

LOG=$VM_DIR/logs/vm-bench.log
vm_boot "$INITRD" "$LOG"
vm_log "guest booted to init in ${VM_BOOT_S:-?}s; VM run ${VM_WALL_S}s; log: $LOG"
[ "$VM_GUEST_RC" = 0 ] || vm_die "a benchmark run failed in the guest (status $VM_GUEST_RC)"

LABELS=$(IFS=,; echo "${DRIVERS[*]%%:*}")
python3 - "$LOG" "$LABELS" "$REPEAT" "${ROWS[@]%%:*}" << 'SUMMARY'
import json, re, statistics, sys

results, current, lines = {}, None, []
for raw in open(sys.argv[1], errors="replace"):
    text = re.sub(r"^\[guest +[0-9.]+s\] ", "", raw.rstrip("\n"))
    if text.startswith("JSON_BEGIN "):
        # "JSON_BEGIN driver row [pass]": the kernel's rows run once and carry no pass.
        fields = text.split()[1:4]
        current, lines = (fields[0], fields[1], int(fields[2]) if len(fields) > 2 else 1), []
    elif text.startswith("JSON_END") and current:
        if current[0] == "spdk":
            # perf's summary: "Total : IOPS MiB/s average min max" (latencies in us).
            total = [line for line in lines if line.startswith("Total ")]
            try:
                iops, mibs, average = (float(value) for value in total[-1].split(":", 1)[1].split()[:3])
                results[current] = (iops, mibs, average)
            except (IndexError, ValueError):
                print(f"no Total line from spdk_nvme_perf for {current[1]} (pass {current[2]})", file=sys.stderr)
        else:
            try:
                results[current] = json.loads("\n".join(lines))
            except ValueError:
                print(f"unreadable JSON for {current[0]} {current[1]} (pass {current[2]})", file=sys.stderr)
        current = None
    elif current and text.startswith("JSON "):
        lines.append(text[len("JSON "):])
    elif current and text.startswith("PERF "):
        lines.append(text[len("PERF "):])

def figures(driver, row, run):
    """(IOPS, MiB/s, p50 us, p99 us) of the row's main direction in pass `run` (the kernel's: 1),
    or None (perf: no percentiles)."""
    if driver == "spdk":
        found = results.get((driver, row, run))
        return None if found is None else (found[0], found[1], None, None)
    try:
        job = results[(driver, row, run)]["jobs"][0]
    except (KeyError, IndexError):
        return None
    side = job["write"] if row.startswith("seqwrite") else job["read"]
    percentiles = side.get("clat_ns", {}).get("percentile", {})
    def at(wanted):
        return next((value for key, value in percentiles.items() if float(key) == wanted), 0) / 1000
    return side["iops"], side["bw_bytes"] / 2**20, at(50.0), at(99.0)

passes = int(sys.argv[3])
rows = sys.argv[4:]
labels = [label for label in sys.argv[2].split(",") if label]
# Every driver after the kernel's rows, in the order the rows print them.
order = ("ours", "shadow", "pinned", "before", "spdk")
drivers = ("kernel",) + tuple(label for label in order if label in labels)
with_before, with_spdk = "before" in labels, "spdk" in labels
# Our drivers: their rows carry the ours/before and ours/spdk columns.
ours_drivers = ("ours", "shadow", "pinned")
legend = {
    "ours": "ours = tutti-bench through VFIO (CPU executor, polled). Emulator numbers, not an SSD's.",
    "before": "before = TUTTI_BENCH_BEFORE's tutti-bench, back to back with ours on each row (same boot, order rotating).",
    "spdk": "spdk = TUTTI_BENCH_SPDK's spdk_nvme_perf (polled, one core; it reports no percentiles), in the same rotation.",
    "shadow": "shadow = ours with --shadow-doorbells (Doorbell Buffer Config), in the same rotation; its ratio columns are shadow/before, shadow/spdk.",
    "pinned": "pinned = ours with --cpus_allowed (one guest CPU, as perf pins itself), in the same rotation; its ratio columns are pinned/before, pinned/spdk.",
}
print()
print("QEMU NVMe under TCG, one controller: kernel = guest nvme driver + fio io_uring O_DIRECT;")
for driver in drivers[1:]:
    print(legend[driver])
header = f"{'row':<17} {'driver':<7} {'IOPS':>9} {'MiB/s':>8} {'p50 us':>9} {'p99 us':>9}  {'x/kernel':<14}"
if passes > 1:
    print(f"{passes} passes of every driver's rows (the kernel's once): figures are medians over the passes,")
    print("ratios the median of each pass's ratio (both drivers in the same pass); every pass's below.")
print(header + ("  ours/before" if with_before else "") + ("  ours/spdk" if with_spdk else ""))

def median(values):
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None

def pass_ratios(row, driver, other):
    """driver/other IOPS in each pass where both ran (None where either is missing)."""
    ratios = []
    for run in range(1, passes + 1):
        mine, theirs = figures(driver, row, run), figures(other, row, run)
        ratios.append(mine[0] / theirs[0] if mine and theirs and theirs[0] else None)
    return ratios

missing = 0
comparisons = []
for row in rows:
    found = {}
    for driver in drivers:
        runs = [figures(driver, row, run) for run in range(1, 2 if driver == "kernel" else passes + 1)]
        missing += sum(1 for data in runs if data is None)
        runs = [data for data in runs if data is not None]
        found[driver] = tuple(median(data[index] for data in runs) for index in range(4)) if runs else None
    kernel = found["kernel"]
    for driver in drivers:
        data = found[driver]
        if data is None:
            print(f"{row:<17} {driver:<7} {'-':>9} {'-':>8} {'-':>9} {'-':>9}")
            continue
        ratio = ""
        if driver != "kernel" and kernel and kernel[0]:
            value = data[0] / kernel[0]
            ratio = f"{value:.2f} {'met' if value >= 1.0 else 'MISSED'}"
        versus = []
        for other, wanted in (("before", with_before), ("spdk", with_spdk)):
            if not wanted:
                continue
            shown = ""
            if driver in ours_drivers:
                ratios = pass_ratios(row, driver, other)
                middle = median(ratios)
                if middle is not None:
                    shown = f"{middle:.2f}"
                    comparisons.append((row, f"{driver}/{other}", ratios))
            versus.append(f"{shown:<11}")
        p50, p99 = ("-" if value is None else f"{value:.1f}" for value in data[2:4])
        print(f"{row:<17} {driver:<7} {data[0]:>9.0f} {data[1]:>8.1f} {p50:>9} {p99:>9}  {ratio:<14}  {' '.join(versus)}".rstrip())
if passes > 1 and comparisons:
    print()
    print(f"{'row':<17} {'ratio':<14} per pass (- where a run is missing); passes where the other led")
    for row, name, ratios in comparisons:
        shown = " ".join("-" if ratio is None else f"{ratio:.2f}" for ratio in ratios)
        behind = sum(1 for ratio in ratios if ratio is not None and ratio < 1.0)
        counted = sum(1 for ratio in ratios if ratio is not None)
        print(f"{row:<17} {name:<14} {shown}  ({behind} of {counted})")
if missing:
    sys.exit(f"{missing} result(s) missing")
SUMMARY
