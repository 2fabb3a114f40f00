#!/usr/bin/env bash
# tools/vm-test.sh — the driver against QEMU's emulated NVMe controller, through VFIO, inside a
# Linux guest under TCG. Runs alone or as the `vm` stage of tools/test.sh.
#
# Usage: tools/vm-test.sh [MODE]
#   --conformance (default)  nvme-conformance --device vfio:<each BDF> --integrity-mib N, then a
#                            second short run in the same guest (proves nothing leaked), then
#                            objstore-roundtrip on a pool over every controller (store, reopen,
#                            compare)
#   --probe                  the standalone VFIO probe (examples/vfio_probe.rs), run twice, then
#                            tutti unbind (back to nvme) and bind again, and a third probe
#   --smoke                  boot, bind to vfio-pci by hand, list the VFIO nodes: no project code
#   --shell                  like --probe, then an interactive guest shell (debugging)
#
# Environment (all optional):
#   TUTTI_VM_DIR             cache: kernel, debs, images, logs (default <repo>/.tools/vm)
#   TUTTI_VM_COMMANDS        guest commands, one per line, replacing the mode's defaults; they
#                            see $TUTTI_BDFS (every NVMe BDF) and $TUTTI_BDF0 (the first)
#   TUTTI_VM_INTEGRITY_MIB   size of the data-integrity run (default 256)
#   TUTTI_VM_CONFORMANCE_ARGS  extra nvme-conformance arguments (e.g. --quick, --queue-pairs 8)
#   TUTTI_VM_NVME_COUNT      number of NVMe controllers (default 1; slots 00:04.0, 00:05.0, ...)
#   TUTTI_VM_NVME_ARGS       extra `-device nvme` properties, ';' between controllers, the last
#                            group repeating: e.g. "mdts=5,max_ioqpairs=4;mdts=7" (default
#                            max_ioqpairs=8)
#   TUTTI_VM_NS_ARGS         extra `-device nvme-ns` properties, same convention: e.g.
#                            "logical_block_size=4096,physical_block_size=4096"
#   TUTTI_VM_DISK_MIB        size of each controller's backing image (default 1024)
#   TUTTI_VM_TIMEOUT_S       watchdog for the whole guest run (default 300)
#   TUTTI_VM_BOOT_TIMEOUT_S, TUTTI_VM_BOOT_RETRIES  a guest that has not reached /init in 90 s
#                            is restarted, once by default (rare TCG boot livelocks)
#   TUTTI_VM_COMMAND_TIMEOUT_S  per-command limit inside the guest (default 240)
#   TUTTI_VM_MEM, TUTTI_VM_SMP  guest memory and CPUs (default 2G, 2)
#   TUTTI_VM_HUGEPAGES       2 MiB pages reserved in the guest (default 128)
#   TUTTI_VM_KERNEL_NVME     1 (default): the guest's nvme driver takes the controllers first, so
#                            `tutti bind` must move them; 0: they start unbound
#   TUTTI_VM_SKIP_APT=1      never call apt (fail if something is missing)
#   TUTTI_VM_KERNEL_PACKAGE  e.g. linux-image-6.1.0-56-amd64 (default: what linux-image-amd64 names)
#
# Exit status: 0 only if every guest command exited 0 and the guest left through isa-debug-exit
# with that status; non-zero on any failure, a missing binary, or the watchdog.
set -euo pipefail
# shellcheck source=tools/vm/lib.sh
. "$(dirname "$(readlink -f "$0")")/vm/lib.sh"
# Whatever ends the script with a failure, the last line says so.
trap 'status=$?; [ "$status" = 0 ] || vm_log "vm-test: FAILED (exit status $status)"' EXIT

MODE=conformance
case "${1:-}" in
    "" | --conformance) MODE=conformance ;;
    --probe) MODE=probe ;;
    --smoke) MODE=smoke ;;
    --shell) MODE=shell ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
    *) vm_die "unknown mode '$1' (try --help)" ;;
esac

mkdir -p "$VM_DIR"/{debs,logs,kernel}
vm_install_host_tools
vm_prepare_kernel
vm_log "kernel $VM_KVER, qemu $(qemu-system-x86_64 --version | sed -n '1s/.*version \([^ ]*\).*/\1/p')"
vm_nvme_args

# ---- guest binaries and default commands
INTEGRITY_MIB=${TUTTI_VM_INTEGRITY_MIB:-256}
BINARIES=()
COMMANDS=$VM_DIR/commands.$MODE
case $MODE in
    conformance)
        CONFORMANCE=$VM_REPO/crates/nvme-conformance
        if ! [ -f "$CONFORMANCE/src/main.rs" ] && ! [ -d "$CONFORMANCE/src/bin" ] && ! grep -q '^\[\[bin\]\]' "$CONFORMANCE/Cargo.toml"; then
            vm_die "the nvme-conformance binary does not exist yet (crates/nvme-conformance has no main.rs or src/bin); use --probe to test the VFIO backend"
        fi
        vm_log "building static guest binaries (nvme-conformance, objstore-roundtrip, tutti) into $VM_TARGET_DIR"
        vm_cargo_static -p nvme-conformance --bin nvme-conformance -p objstore --bin objstore-roundtrip -p tutti --bin tutti \
            > "$VM_DIR/logs/build.log" 2>&1 ||
            { tail -n 30 "$VM_DIR/logs/build.log" >&2; vm_die "static build of the guest binaries failed (log: $VM_DIR/logs/build.log)"; }
        BINARIES=("$VM_BIN_DIR/nvme-conformance" "$VM_BIN_DIR/objstore-roundtrip" "$VM_BIN_DIR/tutti")
        # The full suite with the data-integrity run on every controller; then a second process
        # in the same guest, which only passes if the first released its groups and mappings.
        # shellcheck disable=SC2016 # $TUTTI_BDFS is expanded by the guest's shell
        DEVICES='$(for b in $TUTTI_BDFS; do printf -- "--device vfio:%s " "$b"; done)'
        # Then the object store's persistence round trip (store, reopen, scatter retrieve, compare)
        # on one pool striped over every controller (one VFIO container), which it formats.
        printf '%s\n' "nvme-conformance $DEVICES ${TUTTI_VM_CONFORMANCE_ARGS:-} --integrity-mib $INTEGRITY_MIB" \
            "nvme-conformance $DEVICES --quick --filter bring_up_and_identify" \
            "objstore-roundtrip $DEVICES" > "$COMMANDS"
        ;;
    probe | shell)
        vm_log "building static guest binaries (vfio_probe, tutti) into $VM_TARGET_DIR"
        vm_cargo_static -p nvme-driver --example vfio_probe -p tutti --bin tutti > "$VM_DIR/logs/build.log" 2>&1 ||
            { tail -n 30 "$VM_DIR/logs/build.log" >&2; vm_die "static build of vfio_probe/tutti failed (log: $VM_DIR/logs/build.log)"; }
        BINARIES=("$VM_BIN_DIR/examples/vfio_probe" "$VM_BIN_DIR/tutti")
        # Twice, as two processes: the second proves the first released the group and mappings.
        # Then the round trip through the kernel's driver: unbind (nvme takes the controllers
        # back and must see a working device; the probe must now refuse, naming the fix), bind
        # again, probe once more.
        # shellcheck disable=SC2016
        printf '%s\n' 'vfio_probe $TUTTI_BDFS' 'vfio_probe $TUTTI_BDFS' \
            'for b in $TUTTI_BDFS; do tutti unbind $b || exit 1; done; tutti devices; vfio_probe $TUTTI_BDFS 2>&1 | grep "not vfio-pci: run .tutti bind"' \
            'for b in $TUTTI_BDFS; do tutti bind $b || exit 1; done; vfio_probe $TUTTI_BDFS' > "$COMMANDS"
        ;;
    smoke)
        # shellcheck disable=SC2016
        printf '%s\n' 'ls -l /dev/vfio' 'for b in $TUTTI_BDFS; do ls /sys/bus/pci/devices/$b/iommu_group/devices; done' \
            'grep -q intel_iommu=on /proc/cmdline' > "$COMMANDS"
        ;;
esac
for binary in "${BINARIES[@]}"; do
    [ -x "$binary" ] || vm_die "expected guest binary $binary was not built"
done
[ -n "${TUTTI_VM_COMMANDS:-}" ] && printf '%s\n' "$TUTTI_VM_COMMANDS" > "$COMMANDS"

CONF=$VM_DIR/conf.$MODE
cat > "$CONF" << EOF
LOAD_NVME=${TUTTI_VM_KERNEL_NVME:-1}
HUGEPAGES=${TUTTI_VM_HUGEPAGES:-128}
COMMAND_TIMEOUT_S=${TUTTI_VM_COMMAND_TIMEOUT_S:-240}
SHELL_AFTER=$([ "$MODE" = shell ] && echo 1 || echo 0)
EOF
[ "$MODE" = smoke ] && sed -i 's/^LOAD_NVME=.*/LOAD_NVME=0/' "$CONF"

INITRD=$VM_DIR/initramfs-$MODE.cpio
vm_build_initramfs "$INITRD" "$COMMANDS" "$CONF" "" -- "${BINARIES[@]}"
vm_log "initramfs $(du -h "$INITRD" | cut -f1); controllers: ${VM_NVME_BDFS[*]}; guest commands:"
sed 's/^/    /' "$COMMANDS" >&2

[ "$MODE" = shell ] && VM_INTERACTIVE=1
LOG=$VM_DIR/logs/vm-test-$MODE.log
vm_boot "$INITRD" "$LOG"
vm_log "guest booted to init in ${VM_BOOT_S:-?}s; VM run ${VM_WALL_S}s; whole VM stage $(vm_elapsed "$VM_T0")s; log: $LOG"
if [ "$VM_GUEST_RC" != 0 ]; then
    vm_log "FAIL: guest status $VM_GUEST_RC ($MODE)"
    exit 1
fi
vm_log "PASS ($MODE, ${#VM_NVME_BDFS[@]} controller(s))"
