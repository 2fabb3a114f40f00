#!/usr/bin/env bash
# tools/vm-test.sh — the driver against QEMU's emulated NVMe controller, through VFIO, inside a
# Linux guest under TCG. Runs alone or as the `vm` stage of tools/test.sh.
#
# Usage: tools/vm-test.sh [MODE]
#   --conformance (default)  two guests, one after the other:
#                            1. the main one (TUTTI_VM_NVME_COUNT controllers): nvme-conformance
#                               --device vfio:<each BDF> --integrity-mib N, then a second short
#                               run in the same guest (proves nothing leaked), then
#                               objstore-roundtrip on a pool over every controller (store,
#                               reopen, compare); then tuttid over every controller with four
#                               tuttid-client processes (TP 2: each rank stores, then each
#                               retrieves and checks byte-exact; doorbells through the relay),
#                               SIGTERM, exit 0 (tools/vm/tuttid-stage.sh);
#                            2. the small one (--small below), unless TUTTI_VM_SMALL=0
#   --small                  only the small guest: one controller that grants a single I/O queue
#                            pair and a small MDTS (TUTTI_VM_SMALL_NVME_ARGS, default
#                            max_ioqpairs=1,mdts=2, i.e. 16 KiB): the conformance suite (which
#                            adapts to what the controller grants), then objstore-roundtrip on it
#   --probe                  the standalone VFIO probe (examples/vfio_probe.rs), run twice, then
#                            tutti unbind (back to nvme) and bind again, and a third probe
#   --smoke                  boot, bind to vfio-pci by hand, list the VFIO nodes: no project code
#   --shell                  like --probe, then an interactive guest shell (debugging)
#
# Before booting, tools/vm/harness-test.sh checks the boot logic against a stand-in QEMU (~40 s).
#
# Environment (all optional):
#   TUTTI_VM_DIR             cache: kernel, debs, images, logs (default <repo>/.tools/vm)
#   TUTTI_VM_COMMANDS        guest commands, one per line, replacing the mode's defaults (then
#                            only the mode's first guest boots); they see $TUTTI_BDFS (every
#                            NVMe BDF) and $TUTTI_BDF0 (the first). A line starting with
#                            `optional ` may fail without failing the run (reported as such)
#   TUTTI_VM_SMALL           0: --conformance skips the small guest (default 1)
#   TUTTI_VM_SMALL_NVME_ARGS `-device nvme` properties of the small guest's controller (default
#                            max_ioqpairs=1,mdts=2); TUTTI_VM_SMALL_NS_ARGS its namespace's
#   TUTTI_VM_SMALL_INTEGRITY_MIB  data-integrity run on it (default 64)
#   TUTTI_VM_INTEGRITY_MIB   size of the data-integrity run (default 256)
#   TUTTI_VM_CONFORMANCE_ARGS  extra nvme-conformance arguments (e.g. --quick, --queue-pairs 8)
#   TUTTI_VM_NVME_COUNT      number of NVMe controllers (default 1; slots 00:04.0, 00:05.0, ...)
#   TUTTI_VM_NVME_ARGS       extra `-device nvme` properties, ';' between controllers, the last
#                            group repeating: e.g. "mdts=5,max_ioqpairs=4;mdts=7" (default
#                            max_ioqpairs=8)
#   TUTTI_VM_NS_ARGS         extra `-device nvme-ns` properties, same convention: e.g.
#                            "logical_block_size=4096,physical_block_size=4096"
#   TUTTI_VM_DISK_MIB        size of each controller's backing image (default 1024)
#   TUTTI_VM_DRIVE_ARGS      its QEMU -drive options (default cache=unsafe; e.g.
#                            cache=unsafe,aio=io_uring: no thread-pool hop per I/O)
#   TUTTI_VM_APPEND          extra guest kernel arguments (e.g. no_timer_check)
#   TUTTI_VM_TIMEOUT_S       watchdog for the whole guest run (default 300)
#   TUTTI_VM_BOOT_TIMEOUT_S, TUTTI_VM_BOOT_RETRIES  a guest that has not reached /init in 90 s
#                            is restarted, once by default (rare TCG boot livelocks); so is one
#                            whose QEMU crashed (SIGSEGV, SIGABRT...) before the guest reported
#   TUTTI_VM_COMMAND_TIMEOUT_S  per-command limit inside the guest (default 240)
#   TUTTI_VM_MEM, TUTTI_VM_SMP  guest memory and CPUs (default 2G, 2)
#   TUTTI_VM_HUGEPAGES       2 MiB pages reserved in the guest (default 128)
#   TUTTI_VM_KERNEL_NVME     1 (default): the guest's nvme driver takes the controllers first, so
#                            `tutti bind` must move them; 0: they start unbound
#   TUTTI_VM_SKIP_APT=1      never call apt (fail if something is missing)
#   TUTTI_VM_KERNEL_PACKAGE  e.g. linux-image-6.1.0-56-amd64 (default: what linux-image-amd64 names)
#
# Exit status: 0 only if every required guest command (a line not marked `optional `) exited
# 0, as the guest reported it (and, leaving through isa-debug-exit, passed to QEMU's exit
# status); a guest that hangs after reporting is stopped after TUTTI_VM_EXIT_GRACE_S and its
# reported status counts. Non-zero on any failure, a missing binary, no result reported, or
# TUTTI_VM_TIMEOUT_S.
set -euo pipefail
# shellcheck source=tools/vm/lib.sh
. "$(dirname "$(readlink -f "$0")")/vm/lib.sh"
# Whatever ends the script with a failure, the last line says so.
trap 'status=$?; [ "$status" = 0 ] || vm_log "vm-test: FAILED (exit status $status)"' EXIT

MODE=conformance
case "${1:-}" in
    "" | --conformance) MODE=conformance ;;
    --probe) MODE=probe ;;
    --small) MODE=small ;;
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
if [ "$MODE" != shell ]; then
    vm_log "harness self-test (tools/vm/harness-test.sh)"
    "$VM_REPO/tools/vm/harness-test.sh" 2> "$VM_DIR/logs/harness-test.log" ||
        { cat "$VM_DIR/logs/harness-test.log" >&2; vm_die "the VM harness's own boot logic is broken (tools/vm/harness-test.sh)"; }
fi

INTEGRITY_MIB=${TUTTI_VM_INTEGRITY_MIB:-256}
SMALL_NVME_ARGS=${TUTTI_VM_SMALL_NVME_ARGS:-max_ioqpairs=1,mdts=2}
SMALL_INTEGRITY_MIB=${TUTTI_VM_SMALL_INTEGRITY_MIB:-64}
BINARIES=()
GUESTS=() # in boot order: main, small, probe, shell, smoke
case $MODE in
    conformance | small)
        CONFORMANCE=$VM_REPO/crates/nvme-conformance
        if ! [ -f "$CONFORMANCE/src/main.rs" ] && ! [ -d "$CONFORMANCE/src/bin" ] && ! grep -q '^\[\[bin\]\]' "$CONFORMANCE/Cargo.toml"; then
            vm_die "the nvme-conformance binary does not exist yet (crates/nvme-conformance has no main.rs or src/bin); use --probe to test the VFIO backend"
        fi
        vm_log "building static guest binaries (nvme-conformance, objstore-roundtrip, tutti, tuttid, tuttid-client) into $VM_TARGET_DIR"
        vm_cargo_static -p nvme-conformance --bin nvme-conformance -p objstore --bin objstore-roundtrip -p tutti --bin tutti \
            -p tuttid --bin tuttid --bin tuttid-client > "$VM_DIR/logs/build.log" 2>&1 ||
            { tail -n 30 "$VM_DIR/logs/build.log" >&2; vm_die "static build of the guest binaries failed (log: $VM_DIR/logs/build.log)"; }
        BINARIES=("$VM_BIN_DIR/nvme-conformance" "$VM_BIN_DIR/objstore-roundtrip" "$VM_BIN_DIR/tutti" "$VM_BIN_DIR/tuttid"
            "$VM_BIN_DIR/tuttid-client" "$VM_REPO/tools/vm/tuttid-stage.sh")
        # shellcheck disable=SC2016 # $TUTTI_BDFS is expanded by the guest's shell
        DEVICES='$(for b in $TUTTI_BDFS; do printf -- "--device vfio:%s " "$b"; done)'
        if [ "$MODE" = conformance ]; then
            GUESTS+=(main)
            # The full suite with the data-integrity run on every controller; then a second
            # process in the same guest, which only passes if the first released its groups and
            # mappings; then the object store's persistence round trip (store, reopen, scatter
            # retrieve, compare) on one pool striped over every controller (one VFIO container);
            # then tuttid on the same controllers and its client processes (tuttid-stage.sh).
            printf '%s\n' "nvme-conformance $DEVICES --overwrite ${TUTTI_VM_CONFORMANCE_ARGS:-} --integrity-mib $INTEGRITY_MIB" \
                "nvme-conformance $DEVICES --overwrite --quick --filter bring_up_and_identify" \
                "objstore-roundtrip $DEVICES" "tuttid-stage.sh $DEVICES" > "$VM_DIR/commands.main"
        fi
        if [ "$MODE" = small ] || [ "${TUTTI_VM_SMALL:-1}" = 1 ]; then
            GUESTS+=(small)
            # A controller that grants one I/O queue pair and a 16 KiB MDTS: the suite asks for
            # 4 pairs and must pass with the one it gets; then the object store on it, whose layer
            # commands are cut to the MDTS and whose metadata borrows the executor's one queue
            # pair: one block per slot with separate K/V tensors, and four blocks per slot with
            # block-major tensors (other run lengths, other cuts).
            # shellcheck disable=SC2016 # $TUTTI_BDF0 is expanded by the guest's shell
            printf '%s\n' "nvme-conformance --device vfio:\$TUTTI_BDF0 --overwrite ${TUTTI_VM_CONFORMANCE_ARGS:-} --integrity-mib $SMALL_INTEGRITY_MIB" \
                "objstore-roundtrip --device vfio:\$TUTTI_BDF0" \
                "objstore-roundtrip --device vfio:\$TUTTI_BDF0 --k 4 --layout block-major" > "$VM_DIR/commands.small"
        fi
        ;;
    probe | shell)
        GUESTS+=("$MODE")
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
            'for b in $TUTTI_BDFS; do tutti bind $b || exit 1; done; vfio_probe $TUTTI_BDFS' > "$VM_DIR/commands.$MODE"
        ;;
    smoke)
        GUESTS+=(smoke)
        # shellcheck disable=SC2016
        printf '%s\n' 'ls -l /dev/vfio' 'for b in $TUTTI_BDFS; do ls /sys/bus/pci/devices/$b/iommu_group/devices; done' \
            'grep -q intel_iommu=on /proc/cmdline' > "$VM_DIR/commands.smoke"
        ;;
esac
for binary in "${BINARIES[@]}"; do
    [ -x "$binary" ] || vm_die "expected guest binary $binary was not built"
done
if [ -n "${TUTTI_VM_COMMANDS:-}" ]; then
    GUESTS=("${GUESTS[0]}")
    printf '%s\n' "$TUTTI_VM_COMMANDS" > "$VM_DIR/commands.${GUESTS[0]}"
fi

# run_guest NAME: boots guest NAME with its controllers and commands and prints each command's
# outcome. Sets GUEST_RC (0 when every required command passed) and adds a line to SUMMARY.
run_guest() {
    local name=$1 conf=$VM_DIR/conf.$1 initrd=$VM_DIR/initramfs-$1.cpio log=$VM_DIR/logs/vm-test-$1.log
    local commands=$VM_DIR/commands.$1 controllers optional_failed verdict
    if [ "$name" = small ]; then
        TUTTI_VM_NVME_COUNT=1 TUTTI_VM_NVME_ARGS=$SMALL_NVME_ARGS TUTTI_VM_NS_ARGS=${TUTTI_VM_SMALL_NS_ARGS:-} vm_nvme_args
        controllers="1 controller, $SMALL_NVME_ARGS"
    else
        vm_nvme_args
        controllers="${#VM_NVME_BDFS[@]} controller(s), ${TUTTI_VM_NVME_ARGS:-max_ioqpairs=8}"
    fi
    {
        echo "LOAD_NVME=$([ "$name" = smoke ] && echo 0 || echo "${TUTTI_VM_KERNEL_NVME:-1}")"
        echo "HUGEPAGES=${TUTTI_VM_HUGEPAGES:-128}"
        echo "COMMAND_TIMEOUT_S=${TUTTI_VM_COMMAND_TIMEOUT_S:-240}"
        echo "SHELL_AFTER=$([ "$name" = shell ] && echo 1 || echo 0)"
    } > "$conf"
    vm_build_initramfs "$initrd" "$commands" "$conf" "" -- "${BINARIES[@]}"
    vm_log "guest '$name': initramfs $(du -h "$initrd" | cut -f1); $controllers at ${VM_NVME_BDFS[*]}; commands:"
    sed 's/^/    /' "$commands" >&2
    VM_INTERACTIVE=$([ "$name" = shell ] && echo 1 || echo 0)
    vm_boot "$initrd" "$log"
    vm_log "guest '$name' booted to init in ${VM_BOOT_S:-?}s; VM run ${VM_WALL_S}s; log: $log; steps:"
    vm_step_summary "$log" >&2
    GUEST_RC=$VM_GUEST_RC
    optional_failed=$(grep -a -c 'TUTTI_VM_OPTIONAL_FAILED' "$log" || true)
    verdict=$([ "$GUEST_RC" = 0 ] && echo PASS || echo "FAIL (status $GUEST_RC)")
    [ "${optional_failed:-0}" -gt 0 ] && verdict="$verdict, with $optional_failed optional step(s) FAILED (allowed; see its steps)"
    SUMMARY+=("guest '$name' ($controllers): $verdict")
}

SUMMARY=()
FAILED=0
for guest in "${GUESTS[@]}"; do
    run_guest "$guest"
    [ "$GUEST_RC" = 0 ] || FAILED=1
done
vm_log "whole VM stage $(vm_elapsed "$VM_T0")s"
for line in "${SUMMARY[@]}"; do vm_log "$line"; done
if [ "$FAILED" != 0 ]; then
    vm_log "FAIL ($MODE)"
    exit 1
fi
vm_log "PASS ($MODE)"
