#!/usr/bin/env bash
# tools/vm-bench.sh — side-by-side benchmark in the VM of tools/vm-test.sh: the guest kernel's
# nvme driver driven by fio (io_uring, O_DIRECT) on QEMU's NVMe controller. A benchmark command,
# not a test: it prints a table and fails only if a run fails.
#
# Rows (issue 3 §5): 4 KiB random read at QD 1 and QD 32; 128 KiB and 1 MiB sequential read and
# write. Columns: IOPS, bandwidth, p50/p99 completion latency.
#
# STATUS: only the kernel half exists. The userspace-driver half (the same rows through VFIO with
# tutti-bench, and the ours/kernel ratio) is not implemented here yet: it needs tutti-bench's
# raw-device mode. The table says so rather than printing made-up numbers.
#
# Environment: everything tools/vm-test.sh takes for the VM (TUTTI_VM_DIR, TUTTI_VM_NVME_ARGS,
# TUTTI_VM_NS_ARGS, TUTTI_VM_DISK_MIB, TUTTI_VM_MEM, TUTTI_VM_SMP, TUTTI_VM_TIMEOUT_S,
# TUTTI_VM_IOMMU_PT), plus
#   TUTTI_BENCH_RUNTIME_S    seconds per row after a 1 s ramp (default 8)
#   TUTTI_BENCH_SIZE_MIB     span of the device each job touches (default 512)
# The first controller (/dev/nvme0n1 in the guest) is benchmarked.
set -euo pipefail
# shellcheck source=tools/vm/lib.sh
. "$(dirname "$(readlink -f "$0")")/vm/lib.sh"

RUNTIME_S=${TUTTI_BENCH_RUNTIME_S:-8}
SIZE_MIB=${TUTTI_BENCH_SIZE_MIB:-512}
export TUTTI_VM_DISK_MIB=${TUTTI_VM_DISK_MIB:-$((SIZE_MIB + 64))}
export TUTTI_VM_NVME_COUNT=1

mkdir -p "$VM_DIR"/{debs,logs,kernel}
vm_install_host_tools
command -v fio > /dev/null || {
    [ "${TUTTI_VM_SKIP_APT:-0}" = 1 ] && vm_die "fio is missing (TUTTI_VM_SKIP_APT=1)"
    vm_log "installing fio"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends fio > "$VM_DIR/logs/apt-fio.log" 2>&1 ||
        vm_die "apt-get install fio failed; see $VM_DIR/logs/apt-fio.log"
}
command -v python3 > /dev/null || vm_die "python3 is needed to summarise fio's JSON"
vm_prepare_kernel
vm_nvme_args

# fio and every shared library it loads (Debian's fio links librados, libgfapi, ... directly),
# at their host paths, plus the dynamic loader.
EXTRA=$(mktemp -d "$VM_DIR/fio-root.XXXXXX")
trap 'rm -rf "$EXTRA"' EXIT
mkdir -p "$EXTRA/usr/bin"
cp -L "$(command -v fio)" "$EXTRA/usr/bin/fio"
ldd "$(command -v fio)" | awk '/=> \// { print $3 } /^\t\/.*ld-linux/ { print $1 }' | while read -r library; do
    mkdir -p "$EXTRA$(dirname "$library")"
    cp -L "$library" "$EXTRA$library"
done
# /lib64/ld-linux-x86-64.so.2 is how the binary names its interpreter; Debian's /lib64 is a real
# directory, but make sure the path resolves in the guest either way.
[ -e "$EXTRA/lib64/ld-linux-x86-64.so.2" ] || { mkdir -p "$EXTRA/lib64" && cp -L /lib64/ld-linux-x86-64.so.2 "$EXTRA/lib64/"; }

# One fio run per row; its JSON is framed by markers so the host can cut it out of the console.
COMMANDS=$VM_DIR/commands.bench
: > "$COMMANDS"
row() {
    local name=$1 rw=$2 block=$3 depth=$4
    printf '%s\n' "echo FIO_BEGIN $name; /usr/bin/fio --name=$name --filename=/dev/nvme0n1 --ioengine=io_uring --direct=1 --rw=$rw --bs=$block --iodepth=$depth --numjobs=1 --size=${SIZE_MIB}M --time_based --ramp_time=1 --runtime=$RUNTIME_S --randrepeat=0 --norandommap --output-format=json | sed 's/^/FIO_JSON /'; echo FIO_END $name" >> "$COMMANDS"
}
# Fill the span once so reads return written data rather than the image's holes.
printf '%s\n' "/usr/bin/fio --name=fill --filename=/dev/nvme0n1 --ioengine=io_uring --direct=1 --rw=write --bs=1M --iodepth=16 --size=${SIZE_MIB}M --output-format=terse > /dev/null" >> "$COMMANDS"
row randread-4k-qd1 randread 4k 1
row randread-4k-qd32 randread 4k 32
row seqread-128k read 128k 32
row seqread-1m read 1m 8
row seqwrite-128k write 128k 32
row seqwrite-1m write 1m 8
# TODO(tutti-bench): the same six rows through VFIO, e.g. `tutti bind $TUTTI_BDF0` followed by
# tutti-bench's raw-device mode, printed between OURS_BEGIN/OURS_END markers for the table below.

CONF=$VM_DIR/conf.bench
printf '%s\n' LOAD_NVME=1 BIND=0 HUGEPAGES=128 "COMMAND_TIMEOUT_S=$((RUNTIME_S * 4 + 120))" SHELL_AFTER=0 > "$CONF"
INITRD=$VM_DIR/initramfs-bench.cpio
vm_build_initramfs "$INITRD" "$COMMANDS" "$CONF" "$EXTRA" --
vm_log "initramfs $(du -h "$INITRD" | cut -f1) (fio and its libraries included)"

LOG=$VM_DIR/logs/vm-bench.log
vm_boot "$INITRD" "$LOG"
vm_log "guest booted to init in ${VM_BOOT_S:-?}s; VM run ${VM_WALL_S}s; log: $LOG"
[ "$VM_GUEST_RC" = 0 ] || vm_die "a benchmark run failed in the guest (status $VM_GUEST_RC)"

python3 - "$LOG" << 'EOF'
import json, re, sys

jobs, current, lines = {}, None, []
for raw in open(sys.argv[1], errors="replace"):
    text = re.sub(r"^\[guest +[0-9.]+s\] ", "", raw.rstrip("\n"))
    if text.startswith("FIO_BEGIN "):
        current, lines = text.split()[1], []
    elif text.startswith("FIO_END ") and current:
        jobs[current] = json.loads("\n".join(lines))
        current = None
    elif current and text.startswith("FIO_JSON "):
        lines.append(text[len("FIO_JSON "):])

print()
print("kernel nvme driver, fio io_uring O_DIRECT, QEMU NVMe under TCG (numbers describe the emulator, not an SSD)")
print(f"{'row':<18} {'IOPS':>10} {'MiB/s':>9} {'p50 us':>9} {'p99 us':>9}   ours/kernel")
for name, doc in jobs.items():
    job = doc["jobs"][0]
    side = job["write"] if job["write"]["io_bytes"] > job["read"]["io_bytes"] else job["read"]
    percentiles = side.get("clat_ns", {}).get("percentile", {})
    p50 = percentiles.get("50.000000", 0) / 1000
    p99 = percentiles.get("99.000000", 0) / 1000
    print(f"{name:<18} {side['iops']:>10.0f} {side['bw_bytes'] / 2**20:>9.1f} {p50:>9.1f} {p99:>9.1f}   n/a (userspace half not implemented)")
if len(jobs) != 6:
    sys.exit(f"expected 6 fio results, found {len(jobs)}")
EOF
