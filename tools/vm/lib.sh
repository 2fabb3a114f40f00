# tools/vm/lib.sh — shared steps of the VM harnesses (tools/vm-test.sh, tools/vm-bench.sh).
# Sourced, not run. Every step is idempotent and caches under $VM_DIR.
#
# Provides:
#   vm_log / vm_die                 timestamped messages on stderr
#   vm_install_host_tools           qemu-system-x86, busybox-static, cpio, xz, zstd, python3 from Debian
#   vm_prepare_kernel               a Debian linux-image .deb, unpacked with dpkg -x (never installed),
#                                   modules.dep regenerated, vmlinux extracted for PVH boot (and
#                                   checked whole before it is cached)
#   vm_build_guest_binaries ...     static (crt-static) builds of project binaries into target-vm
#   vm_build_initramfs OUT CMDS CONF BIN...   busybox + modules + binaries + tools/vm/init
#   vm_boot INITRD                  QEMU/TCG with intel-iommu and the NVMe controllers; watchdog;
#                                   sets VM_GUEST_RC, VM_BOOT_S, VM_WALL_S
#
# TUTTI_VM_QEMU replaces the QEMU binary (tools/vm/harness-test.sh runs the boot logic against a
# stand-in); TUTTI_VM_EXIT_GRACE_S (default 20) is how long a guest that reported its result may
# take to leave before the exit watchdog stops its QEMU.

VM_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# dpkg_configure_pending (an interrupted dpkg run finished with service starts forbidden), and
# through it tools/lib/process.sh's timeout_interruptibly and interrupted_exit (vm_logged: the
# apt-get steps below).
# shellcheck source=tools/lib/dpkg.sh
. "$VM_REPO/tools/lib/dpkg.sh"
VM_DIR=${TUTTI_VM_DIR:-$VM_REPO/.tools/vm}
VM_T0=$EPOCHREALTIME

vm_elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
vm_log() { printf '[vm %6ss] %s\n' "$(vm_elapsed "$VM_T0")" "$*" >&2; }
vm_die() {
    vm_log "ERROR: $*"
    exit 1
}

# Packages come from Debian's archive through apt; installed only when missing. QEMU and busybox
# are checked by running them (a binary whose libraries are gone is as missing as no binary);
# one dpkg lists as installed regardless is reinstalled. Each apt call is bounded, through
# vm_logged (interruptible_timeout's rules, its output to a log): Ctrl-C stops it and the script (130), which a bare `timeout` (a process
# group of its own) would not let it reach. An earlier dpkg run that was interrupted is finished
# first (until it is, every apt-get install fails), with service starts forbidden
# (dpkg_configure_pending: an etcd-server left half-installed would otherwise be configured with
# its service enabled and started).
# vm_logged LOG SECONDS COMMAND [ARG...]: interruptible_timeout SECONDS COMMAND..., its output
# appended to LOG, while an interrupt is said on the script's standard error (the terminal), not
# in LOG: redirected around interruptible_timeout, its message would go to the log alone.
vm_logged() {
    local log=$1 status=0
    shift
    timeout_interruptibly "$@" >> "$log" 2>&1 || status=$?
    interrupted_exit "$2"
    return "$status"
}
vm_static_busybox() { dpkg -L busybox-static 2> /dev/null | grep -m1 '/busybox$' || true; }
vm_busybox_runs() {
    local busybox
    busybox=$(vm_static_busybox)
    [ -n "$busybox" ] && timeout 30 "$busybox" true > /dev/null 2>&1
}
vm_install_host_tools() {
    local missing=() reinstall=() installed damaged=()
    timeout 60 qemu-system-x86_64 -version > /dev/null 2>&1 || missing+=(qemu-system-x86)
    # Run, not looked up in dpkg's status: a package dpkg lists whose binary is gone is missing.
    vm_busybox_runs || missing+=(busybox-static)
    timeout 30 cpio --version > /dev/null 2>&1 || missing+=(cpio)
    timeout 30 xz --version > /dev/null 2>&1 || missing+=(xz-utils)
    timeout 30 zstd --version > /dev/null 2>&1 || missing+=(zstd)
    timeout 30 strip --version > /dev/null 2>&1 || missing+=(binutils)
    # vm_extract_vmlinux checks the vmlinux it extracts with python3.
    timeout 60 python3 -c '' > /dev/null 2>&1 || missing+=(python3)
    # vm_cargo_static builds `tutti` with its cluster support, whose etcd-client build script runs
    # protoc on files that import protobuf's well-known types.
    "$VM_REPO/tools/check-protoc.sh" 2> /dev/null || missing+=(protobuf-compiler libprotobuf-dev)
    if [ ${#missing[@]} -gt 0 ]; then
        [ "${TUTTI_VM_SKIP_APT:-0}" = 1 ] && vm_die "missing host packages: ${missing[*]} (TUTTI_VM_SKIP_APT=1)"
        vm_log "installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        : > "$VM_DIR/logs/apt.log"
        dpkg_configure_pending "$VM_DIR/logs/apt.log"
        # One that dpkg lists as installed has lost files: a plain install would do nothing. The
        # files may be a dependency's (strip is binutils-x86-64-linux-gnu's, protoc's library
        # libprotoc32's): those of its installed dependencies that miss files are reinstalled too.
        installed=$(dpkg_installed "${missing[@]}")
        if [ -n "$installed" ]; then
            # shellcheck disable=SC2086 # one package a word
            mapfile -t damaged < <(dpkg_damaged_depends $installed)
            vm_log "reinstalling ${installed//$'\n'/ }${damaged[*]:+ and their dependencies ${damaged[*]} (files missing)} (dpkg lists it installed, but its check fails)"
            reinstall=(--reinstall)
            missing+=("${damaged[@]}")
        fi
        # DPkg::Lock::Timeout: a concurrent apt-get (another clone's run) is waited for, up to 10
        # minutes, instead of failing at once.
        if ! vm_logged "$VM_DIR/logs/apt.log" 1200 apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${reinstall[@]}" "${missing[@]}"; then
            vm_logged "$VM_DIR/logs/apt.log" 900 apt-get -o DPkg::Lock::Timeout=600 update -qq || true
            vm_logged "$VM_DIR/logs/apt.log" 1200 apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${reinstall[@]}" "${missing[@]}" ||
                vm_die "apt-get install ${missing[*]} failed; see $VM_DIR/logs/apt.log"
        fi
        timeout 60 qemu-system-x86_64 -version > /dev/null 2>&1 || vm_die "qemu-system-x86_64 does not run after installing qemu-system-x86"
    fi
    # The guest has no libc: it needs the statically linked busybox, not the dynamic package's.
    VM_BUSYBOX=$(vm_static_busybox)
    vm_busybox_runs || vm_die "no static busybox that runs${VM_BUSYBOX:+ ($VM_BUSYBOX)} (package busybox-static)"
}

# What linux-image-amd64 depends on in the package lists (empty when it cannot be resolved).
vm_kernel_target_package() {
    apt-cache depends linux-image-amd64 2> /dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }' || true
}

# The kernel: Debian's linux-image-amd64 target package, downloaded once with apt-get download.
vm_prepare_kernel() {
    local package version_file=$VM_DIR/kernel.package
    if [ -n "${TUTTI_VM_KERNEL_PACKAGE:-}" ]; then
        package=$TUTTI_VM_KERNEL_PACKAGE
    elif [ -s "$version_file" ] && [ -s "$VM_DIR/kernel/$(cat "$version_file")/vmlinux" ]; then
        package=$(cat "$version_file")
    else
        package=$(vm_kernel_target_package)
        if [ -z "$package" ]; then
            vm_logged /dev/null 900 apt-get -o DPkg::Lock::Timeout=600 update -qq || true
            package=$(vm_kernel_target_package)
        fi
        [ -n "$package" ] || vm_die "cannot resolve linux-image-amd64 to a kernel package (apt-get update?)"
    fi
    VM_KVER=${package#linux-image-}
    VM_KROOT=$VM_DIR/kernel/$package
    VM_VMLINUX=$VM_KROOT/vmlinux
    if [ ! -s "$VM_VMLINUX" ]; then
        local deb
        # (Every `$(... | ...)` here ends in `|| true`: under pipefail a failed lookup would
        # otherwise end the script silently; the checks after each say what went wrong.)
        deb=$(ls "$VM_DIR"/debs/"${package}"_*.deb 2> /dev/null | head -n1 || true)
        if [ -z "$deb" ]; then
            vm_log "downloading $package"
            # env -C, not a `(cd ... && ...)` subshell: vm_logged's exit on Ctrl-C
            # would end the subshell only, and this script would go on.
            : > "$VM_DIR/logs/download.log"
            if ! vm_logged "$VM_DIR/logs/download.log" 900 env -C "$VM_DIR/debs" apt-get download "$package"; then
                # Stale package lists name a kernel build the archive has since replaced (a
                # 404): update them, resolve linux-image-amd64 again, and try once more.
                vm_log "apt-get download $package failed; updating the package lists and retrying once"
                vm_logged "$VM_DIR/logs/download.log" 900 apt-get -o DPkg::Lock::Timeout=600 update -qq || true
                if [ -z "${TUTTI_VM_KERNEL_PACKAGE:-}" ]; then
                    package=$(vm_kernel_target_package)
                    [ -n "$package" ] || vm_die "cannot resolve linux-image-amd64 to a kernel package after apt-get update"
                    VM_KVER=${package#linux-image-}
                    VM_KROOT=$VM_DIR/kernel/$package
                    VM_VMLINUX=$VM_KROOT/vmlinux
                fi
                vm_logged "$VM_DIR/logs/download.log" 900 env -C "$VM_DIR/debs" apt-get download "$package" ||
                    vm_die "apt-get download $package failed (after apt-get update too); see $VM_DIR/logs/download.log"
            fi
            deb=$(ls "$VM_DIR"/debs/"${package}"_*.deb 2> /dev/null | head -n1 || true)
            [ -n "$deb" ] || vm_die "apt-get download $package left no .deb in $VM_DIR/debs"
        fi
        rm -rf "$VM_KROOT"
        mkdir -p "$VM_KROOT"
        dpkg -x "$deb" "$VM_KROOT"
        # The .deb ships no modules.dep: its postinst runs depmod on the installed system.
        "$VM_BUSYBOX" depmod -b "$VM_KROOT" "$VM_KVER"
        vm_extract_vmlinux "$VM_KROOT/boot/vmlinuz-$VM_KVER" "$VM_VMLINUX.tmp"
        mv "$VM_VMLINUX.tmp" "$VM_VMLINUX"
    fi
    echo "$package" > "$version_file"
    VM_MODULES=$VM_KROOT/lib/modules/$VM_KVER
    [ -f "$VM_MODULES/modules.dep" ] || vm_die "$VM_MODULES/modules.dep missing"
    grep -q '^CONFIG_INTEL_IOMMU=y' "$VM_KROOT/boot/config-$VM_KVER" || vm_die "kernel $VM_KVER lacks CONFIG_INTEL_IOMMU"
}

# bzImage = real-mode setup + decompressor + compressed ELF vmlinux. QEMU can enter the ELF
# directly through its PVH note, which skips several seconds of decompression under TCG.
# The result is cached for good (vm_prepare_kernel takes any non-empty vmlinux), so it is
# accepted only whole: the decompressor's status counts (a stream cut short, a bad checksum, a
# write to a full disk fail it), and the ELF must hold every byte its program headers place
# (vm_elf_whole). The compressed stream is followed by other bytes of the image (the 4-byte size
# the kernel's build appends, then the rest), which both decompressors take for a second stream
# and fail on: xz is told to stop after one stream (--single-stream), zstd is given exactly its
# frame (vm_zstd_frame_bytes).
vm_extract_vmlinux() {
    local image=$1 out=$2 offset length
    rm -f "$out"
    offset=$(LC_ALL=C grep -obUaP '\xFD7zXZ\x00' "$image" | head -n1 | cut -d: -f1 || true)
    if [ -n "$offset" ]; then
        xz -dcq --single-stream < <(tail -c +$((offset + 1)) "$image") > "$out" ||
            { rm -f "$out"; vm_die "xz could not decompress the vmlinux in $image (at byte $offset)"; }
    else
        offset=$(LC_ALL=C grep -obUaP '\x28\xB5\x2F\xFD' "$image" | head -n1 | cut -d: -f1 || true)
        [ -n "$offset" ] || vm_die "no xz or zstd stream in $image"
        length=$(vm_zstd_frame_bytes "$image" "$offset") ||
            vm_die "the zstd frame at byte $offset of $image is cut short or malformed"
        zstd -qdc < <(tail -c +$((offset + 1)) "$image" | head -c "$length") > "$out" ||
            { rm -f "$out"; vm_die "zstd could not decompress the vmlinux in $image (at byte $offset)"; }
    fi
    vm_elf_whole "$out" || { rm -f "$out"; vm_die "what $image decompressed to is not a whole ELF vmlinux"; }
}

# vm_zstd_frame_bytes FILE OFFSET: the length of the zstd frame at OFFSET of FILE, found by
# walking its block headers (RFC 8878, 3.1.1); fails if FILE ends inside it.
vm_zstd_frame_bytes() {
    python3 - "$1" "$2" << 'PY'
import sys
with open(sys.argv[1], "rb") as image:
    image.seek(int(sys.argv[2]))
    data = image.read()
if data[:4] != b"\x28\xb5\x2f\xfd" or len(data) < 5:
    sys.exit("vm_zstd_frame_bytes: no zstd frame header")
descriptor = data[4]
single_segment, checksum = descriptor >> 5 & 1, descriptor >> 2 & 1
pos = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 3] + (single_segment, 2, 4, 8)[descriptor >> 6]
while True:
    if pos + 3 > len(data):
        sys.exit("vm_zstd_frame_bytes: the frame is cut short")
    header = int.from_bytes(data[pos:pos + 3], "little")
    pos += 3
    kind = header >> 1 & 3
    if kind == 3:
        sys.exit("vm_zstd_frame_bytes: a reserved block type")
    pos += 1 if kind == 1 else header >> 3  # an RLE block is one byte long
    if header & 1:
        break
pos += 4 * checksum
if pos > len(data):
    sys.exit("vm_zstd_frame_bytes: the frame is cut short")
print(pos)
PY
}

# vm_elf_whole FILE: FILE is a 64-bit little-endian ELF whose program header table and every
# segment's bytes (p_offset + p_filesz) lie within it.
vm_elf_whole() {
    python3 - "$1" << 'PY'
import struct, sys
with open(sys.argv[1], "rb") as elf:
    data = elf.read()
if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1 or len(data) < 64:
    sys.exit(f"vm_elf_whole: {sys.argv[1]} is not a 64-bit little-endian ELF")
phoff, = struct.unpack_from("<Q", data, 0x20)
phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
if phnum == 0 or phentsize < 56 or phoff + phnum * phentsize > len(data):
    sys.exit(f"vm_elf_whole: {sys.argv[1]}: no program headers, or they lie past its end ({len(data)} bytes)")
end = max(sum(struct.unpack_from("<QxxxxxxxxxxxxxxxxQ", data, phoff + i * phentsize + 8)) for i in range(phnum))
if end > len(data):
    sys.exit(f"vm_elf_whole: {sys.argv[1]} is {len(data)} bytes; its segments reach byte {end}")
PY
}

# Static builds for the guest (its initramfs has no libc). Arguments are cargo selectors, e.g.
# "-p nvme-conformance --bin nvme-conformance". Output lines: paths of the built binaries.
VM_TARGET_DIR=${TUTTI_VM_TARGET_DIR:-$VM_REPO/target-vm}
vm_cargo_static() {
    # Debug info is dropped: the guest loads the whole initramfs into RAM.
    (cd "$VM_REPO" && RUSTFLAGS="-C target-feature=+crt-static" CARGO_PROFILE_RELEASE_DEBUG=0 \
        CARGO_TARGET_DIR=$VM_TARGET_DIR cargo build --locked --release --target x86_64-unknown-linux-gnu "$@")
}
VM_BIN_DIR=$VM_TARGET_DIR/x86_64-unknown-linux-gnu/release

# Copies a module and everything modules.dep says it needs (the list there is already transitive).
vm_copy_module() {
    local root=$1 name=$2 pattern line file
    pattern=$(echo "$name" | sed 's/[-_]/[-_]/g')
    line=$(grep -E "(^|/)${pattern}\.ko(\.xz|\.zst)?:" "$VM_MODULES/modules.dep" | head -n1 || true)
    [ -n "$line" ] || vm_die "module $name not in $VM_MODULES/modules.dep"
    for file in ${line%%:*} ${line#*:}; do
        mkdir -p "$root/lib/modules/$VM_KVER/$(dirname "$file")"
        # Decompressed, so that busybox's insmod needs no xz/zstd support.
        case $file in
            *.xz) xz -dc "$VM_MODULES/$file" > "$root/lib/modules/$VM_KVER/${file%.xz}" ;;
            *.zst) zstd -qdc "$VM_MODULES/$file" > "$root/lib/modules/$VM_KVER/${file%.zst}" ;;
            *) cp "$VM_MODULES/$file" "$root/lib/modules/$VM_KVER/$file" ;;
        esac
    done
}

# vm_build_initramfs OUT COMMANDS_FILE CONF_FILE [EXTRA_ROOT_DIR] -- BINARY...
# EXTRA_ROOT_DIR (may be empty) is copied over the root as is (vm-bench puts fio there).
# Runs in a subshell, whose EXIT trap removes the staging root (and a half-written OUT.tmp)
# however it ends, a vm_die included.
vm_build_initramfs() (
    local out=$1 commands=$2 conf=$3 extra=$4 root="" binary module
    shift 4
    [ "${1:-}" = -- ] && shift
    trap 'rm -rf "$root" "$out.tmp"' EXIT
    root=$(mktemp -d "$VM_DIR/initramfs.XXXXXX")
    mkdir -p "$root"/{bin,dev,proc,sys,tmp,etc,lib/modules/"$VM_KVER"}
    cp "$VM_BUSYBOX" "$root/bin/busybox"
    # The kernel opens /dev/console before /init runs, and before devtmpfs is mounted.
    mknod -m 600 "$root/dev/console" c 5 1
    mknod -m 666 "$root/dev/null" c 1 3
    install -m 755 "$VM_REPO/tools/vm/init" "$root/init"
    cp "$commands" "$root/etc/tutti-vm.commands"
    cp "$conf" "$root/etc/tutti-vm.conf"
    for binary in "$@"; do
        install -m 755 "$binary" "$root/bin/$(basename "$binary")"
        # Scripts (tools/vm/tuttid-stage.sh) go in as they are.
        case $binary in *.sh) ;; *) strip --strip-debug "$root/bin/$(basename "$binary")" ;; esac
    done
    for module in vfio vfio_iommu_type1 vfio-pci nvme; do
        vm_copy_module "$root" "$module"
    done
    [ -n "$extra" ] && cp -a "$extra"/. "$root"/
    "$VM_BUSYBOX" depmod -b "$root" "$VM_KVER"
    # Uncompressed: the guest would spend longer inflating it under TCG than the copy costs.
    (cd "$root" && find . | LC_ALL=C sort | cpio -o -H newc --quiet) > "$out.tmp"
    mv "$out.tmp" "$out"
)

# NVMe controllers: TUTTI_VM_NVME_COUNT (default 1) controllers at PCI slots 4, 5, ...; per
# controller extra properties from TUTTI_VM_NVME_ARGS / TUTTI_VM_NS_ARGS, groups separated by ';'
# (the last group repeats for further controllers). Each is backed by a fresh sparse image, opened
# with TUTTI_VM_DRIVE_ARGS (default cache=unsafe: the host's page cache, QEMU's thread-pool I/O;
# e.g. cache=unsafe,aio=io_uring serves the emulated controller's I/O without a worker thread).
vm_nvme_args() {
    local count=${TUTTI_VM_NVME_COUNT:-1} index controller_groups ns_groups controller_extra ns_extra image size_mib
    size_mib=${TUTTI_VM_DISK_MIB:-1024}
    IFS=';' read -r -a controller_groups <<< "${TUTTI_VM_NVME_ARGS:-max_ioqpairs=8}"
    IFS=';' read -r -a ns_groups <<< "${TUTTI_VM_NS_ARGS:-}"
    VM_NVME_ARGS=()
    VM_NVME_BDFS=()
    [ "$count" -ge 1 ] && [ "$count" -le 8 ] || vm_die "TUTTI_VM_NVME_COUNT=$count: 1..8 supported"
    mkdir -p "$VM_DIR/disks"
    for ((index = 0; index < count; index++)); do
        controller_extra=${controller_groups[$index]:-${controller_groups[-1]:-}}
        ns_extra=""
        [ ${#ns_groups[@]} -gt 0 ] && ns_extra=${ns_groups[$index]:-${ns_groups[-1]}}
        image=$VM_DIR/disks/nvme$index.img
        rm -f "$image"
        truncate -s "${size_mib}M" "$image"
        VM_NVME_ARGS+=(-drive "file=$image,if=none,id=nvmedisk$index,format=raw,${TUTTI_VM_DRIVE_ARGS:-cache=unsafe}"
            -device "nvme,id=nvme$index,serial=tutti-vm-$index,addr=$(printf '0x%x' $((4 + index)))${controller_extra:+,$controller_extra}"
            -device "nvme-ns,drive=nvmedisk$index,bus=nvme$index,nsid=1${ns_extra:+,$ns_extra}")
        VM_NVME_BDFS+=("$(printf '0000:00:%02x.0' $((4 + index)))")
    done
}

# vm_step_summary LOG: one line per guest command of a finished run: PASS, FAIL, "FAIL
# (optional: allowed)" for a failed `optional` command, or NO RESULT (the guest stopped first).
vm_step_summary() {
    awk '
        /TUTTI_VM: command [0-9]+ started at / {
            line = $0; sub(/.*TUTTI_VM: command /, "", line)
            n = line + 0; sub(/^[0-9]+ started at [0-9.]+s: /, "", line)
            command[n] = line; order[++count] = n
        }
        /TUTTI_VM: command [0-9]+ finished: rc=/ {
            line = $0; sub(/.*TUTTI_VM: command /, "", line); split(line, field, " ")
            n = field[1] + 0; status[n] = substr(field[3], 4); took[n] = field[5]
        }
        /TUTTI_VM_OPTIONAL_FAILED command=/ {
            line = $0; sub(/.*TUTTI_VM_OPTIONAL_FAILED command=/, "", line); optional[line + 0] = 1
        }
        END {
            for (i = 1; i <= count; i++) {
                n = order[i]
                if (!(n in status)) word = "NO RESULT"
                else if (status[n] == 0) word = "PASS"
                else if (n in optional) word = "FAIL (optional: allowed)"
                else word = "FAIL"
                printf "  step %d: %-24s rc=%-3s %7s  %s\n", n, word, (n in status) ? status[n] : "-", took[n], command[n]
            }
        }' "$1"
}

# vm_boot INITRD LOG: boots the guest, streams its console with host timestamps into LOG and
# stderr, and enforces TUTTI_VM_TIMEOUT_S. Sets VM_GUEST_RC (the guest's reported status, or
# 124 on timeout, 125 when the guest never reported), VM_BOOT_S and VM_WALL_S.
#
# A guest kernel that has not reached /init within TUTTI_VM_BOOT_TIMEOUT_S (default 90) is
# stopped and booted again, up to TUTTI_VM_BOOT_RETRIES times (default 1): under TCG a boot very
# occasionally livelocks before any of our code runs, which says nothing about the driver. A
# QEMU that dies of a fault (SIGSEGV and the like) before the guest reports is booted again
# under the same count: the emulator crashed, and the guest's commands all run again.
vm_boot() {
    local attempt retries=${TUTTI_VM_BOOT_RETRIES:-1}
    for ((attempt = 0; attempt <= retries; attempt++)); do
        vm_boot_once "$@"
        if [ -f "$2.boothang" ]; then
            vm_log "the guest kernel did not reach /init within ${TUTTI_VM_BOOT_TIMEOUT_S:-90}s (TCG boot hang); attempt $((attempt + 1)) of $((retries + 1))"
            cp "$2" "$2.boothang.$attempt"
        elif [ -f "$2.crashed" ]; then
            # QEMU itself died of a fault before the guest reported (seen once, 2026-12-02: QEMU
            # 7.2's TCG dispatched an MMIO write to a NULL memory region as a guest's vfio
            # closed one controller and opened the next). The emulator failed, not the guest:
            # the whole guest runs again, from a fresh boot. A guest that makes QEMU crash
            # every time still fails, with status 125.
            vm_log "QEMU itself crashed ($(cat "$2.crashed")) before the guest reported a result: an emulator fault, its console log kept as $2.crashed.$attempt; attempt $((attempt + 1)) of $((retries + 1))"
            cp "$2" "$2.crashed.$attempt"
        else
            return 0
        fi
    done
    [ ! -f "$2.boothang" ] || VM_GUEST_RC=127
}

# vm_below PID: the pids of every process below PID (by parent links, from /proc: procps is not
# on every machine), one a line.
vm_below() {
    local -A below=([$1]=1)
    local changed=1 stat line fields pid
    while [ "$changed" = 1 ]; do
        changed=0
        for stat in /proc/[0-9]*/stat; do
            # To the end of the file, as tools/lib/process.sh's proc_stat: a command name may
            # hold a newline, where a line-wise read would stop inside it and take the wrong
            # parent (`|| :`: read returns 1 at the end although it read everything).
            line=''
            { IFS= read -r -d '' line || :; } 2> /dev/null < "$stat"
            [ -n "$line" ] || continue
            read -r -a fields <<< "${line##*") "}"
            pid=${stat#/proc/} pid=${pid%/stat}
            if [ -n "${below[${fields[1]}]:-}" ] && [ -z "${below[$pid]:-}" ]; then
                below[$pid]=1 changed=1
            fi
        done
    done
    unset "below[$1]"
    [ ${#below[@]} -eq 0 ] || printf '%s\n' "${!below[@]}"
}

# SIGINT or SIGTERM while a guest runs (vm_boot_once's trap): QEMU (by its pid file; it is in
# timeout's process group, which Ctrl-C does not reach) and everything below the boot pipeline
# are stopped (SIGTERM, SIGKILL 10 s later), then the script ends with 128+signal.
vm_boot_interrupted() {
    local signal=$1 code=$2 pidfile=$3 boot_pid=$4 qemu_pid pids round
    trap '' INT TERM
    vm_log "SIG$signal: stopping QEMU"
    qemu_pid=$(cat "$pidfile" 2> /dev/null || true)
    # shellcheck disable=SC2207
    pids=($qemu_pid $(vm_below "$boot_pid"))
    [ ${#pids[@]} -eq 0 ] || kill -TERM "${pids[@]}" 2> /dev/null || true
    for round in $(seq 1 20); do
        [ -n "$(vm_below "$boot_pid")" ] || { [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2> /dev/null; } || break
        sleep 0.5
    done
    # shellcheck disable=SC2207
    pids=($qemu_pid $(vm_below "$boot_pid"))
    [ ${#pids[@]} -eq 0 ] || kill -KILL "${pids[@]}" 2> /dev/null || true
    wait "$boot_pid" 2> /dev/null || true
    rm -f "$pidfile" "$pidfile.rc"
    exit "$code"
}

vm_boot_once() {
    local initrd=$1 log=$2 timeout_s=${TUTTI_VM_TIMEOUT_S:-300} boot_timeout_s=${TUTTI_VM_BOOT_TIMEOUT_S:-90}
    local started pidfile qemu_rc line stamp booted started_s status grace_s=${TUTTI_VM_EXIT_GRACE_S:-20}
    # cryptomgr.notests: the crypto self-tests cost boot time and are where the rare TCG boot
    # livelocks were seen.
    # iommu=pt: the guest kernel's own DMA (its nvme driver) bypasses translation unless
    # TUTTI_VM_IOMMU_PT=0; VFIO domains are translated either way.
    local append="console=ttyS0 panic=-1 loglevel=4 intel_iommu=on cryptomgr.notests"
    [ "${TUTTI_VM_IOMMU_PT:-1}" = 1 ] && append="$append iommu=pt"
    append="$append ${TUTTI_VM_APPEND:-}"
    local qemu=("${TUTTI_VM_QEMU:-qemu-system-x86_64}" -machine q35,kernel-irqchip=split -accel tcg -cpu max
        -smp "${TUTTI_VM_SMP:-2}" -m "${TUTTI_VM_MEM:-2G}" -nographic -nodefaults -no-reboot -serial stdio
        # The vIOMMU must exist before the devices it translates for.
        -device intel-iommu,intremap=on,caching-mode=on
        -device isa-debug-exit,iobase=0xf4,iosize=0x04
        -kernel "$VM_VMLINUX" -initrd "$initrd" -append "$append"
        "${VM_NVME_ARGS[@]}")
    # One pid file per run: a watchdog of an earlier run (or of another harness sharing VM_DIR)
    # must never find this run's QEMU under its name.
    pidfile=$(mktemp "$VM_DIR/qemu.XXXXXX.pid")
    rm -f "$log.watchdog" "$log.boothang" "$log.crashed"
    : > "$log"
    vm_log "qemu: ${qemu[*]}"
    if [ "${VM_INTERACTIVE:-0}" = 1 ]; then
        # The terminal is the guest's console (leave QEMU with Ctrl-A X); no watchdog.
        rm -f "$pidfile"
        set +e
        "${qemu[@]}"
        qemu_rc=$?
        set -e
        VM_WALL_S=0
        VM_GUEST_RC=$([ $((qemu_rc % 2)) = 1 ] && echo $(((qemu_rc - 1) / 2)) || echo "$qemu_rc")
        return 0
    fi
    started=$EPOCHREALTIME
    started_s=$SECONDS
    VM_BOOT_S=""
    set +e
    # A guest that printed its result but hangs on the way out is stopped grace_s later (the
    # result still counts); one that never finishes is stopped by timeout(1). The watchdog
    # takes QEMU's pid when the result is printed, not when it fires, and ends with QEMU's
    # output, so it can only ever stop the QEMU of this run. It is the console loop itself,
    # which looks at the time on every line and at least every 2 s (the read's timeout), so it
    # fires grace_s to grace_s + 3 s after the result: no process of its own (a background
    # `sleep`, which a kill of its subshell left running for up to grace_s after the boot,
    # a leak that fails tools/test.sh's vm stage).
    # The pipeline runs in the background, waited for with `wait`, which a trapped SIGINT or
    # SIGTERM interrupts at once: `timeout` moves QEMU into a process group of its own, which
    # Ctrl-C on the terminal does not reach, and a trap would wait for a foreground pipeline to
    # end (up to timeout_s). The trap (vm_boot_interrupted) stops QEMU and everything below the
    # pipeline, then ends the script. (Background commands ignore SIGINT here: only the
    # script's trap answers it.)
    {
        timeout -k 10 "$timeout_s" "${qemu[@]}" -pidfile "$pidfile" < /dev/null 2>&1 | {
            booted=0
            result_s=""
            qemu_pid=""
            partial=""
            while :; do
                line=""
                IFS= read -r -t 2 line
                status=$?
                if [ "$status" -gt 128 ]; then
                    # Timed out mid-line (a slow console): keep the part; the rest comes later.
                    # (Logged as two lines, it would break a JSON document of tools/vm-bench.sh.)
                    partial+=$line
                    line=""
                else
                    line=$partial$line
                    partial=""
                    [ "$status" -ne 0 ] && [ -z "$line" ] && break # end of output
                fi
                if [ -n "$line" ]; then
                    line=${line//$'\r'/}
                    stamp=$(vm_elapsed "$started")
                    printf '[guest %6ss] %s\n' "$stamp" "$line" | tee -a "$log" >&2
                    case $line in
                        *"TUTTI_VM: init started"*) booted=1 ;;
                        *"TUTTI_VM_RESULT rc="*)
                            if [ -z "$result_s" ]; then
                                result_s=$SECONDS
                                qemu_pid=$(cat "$pidfile" 2> /dev/null || true)
                            fi
                            ;;
                    esac
                fi
                # SECONDS counts whole seconds: -gt, so that it never fires before grace_s.
                if [ -n "$qemu_pid" ] && [ ! -f "$log.watchdog" ] && [ $((SECONDS - result_s)) -gt "$grace_s" ] &&
                    kill -0 "$qemu_pid" 2> /dev/null; then
                    touch "$log.watchdog"
                    kill "$qemu_pid" 2> /dev/null
                fi
                if [ "$booted" = 0 ] && [ $((SECONDS - started_s)) -gt "$boot_timeout_s" ] && [ ! -f "$log.boothang" ]; then
                    touch "$log.boothang"
                    [ -s "$pidfile" ] && kill "$(cat "$pidfile")" 2> /dev/null
                fi
            done
        }
        echo "${PIPESTATUS[0]}" > "$pidfile.rc"
    } &
    local boot_pid=$! saved_traps
    saved_traps=$(trap -p INT TERM)
    # shellcheck disable=SC2064 # the pids and paths are this run's, fixed now
    trap "vm_boot_interrupted INT 130 '$pidfile' $boot_pid" INT
    # shellcheck disable=SC2064
    trap "vm_boot_interrupted TERM 143 '$pidfile' $boot_pid" TERM
    wait "$boot_pid"
    trap - INT TERM
    eval "$saved_traps"
    qemu_rc=$(cat "$pidfile.rc" 2> /dev/null || echo 125)
    rm -f "$pidfile.rc"
    set -e
    VM_WALL_S=$(vm_elapsed "$started")
    VM_BOOT_S=$(grep -a -m1 'TUTTI_VM: init started' "$log" | sed -E 's/^\[guest +([0-9.]+)s\].*/\1/' || true)
    local reported
    reported=$(grep -a -m1 -o 'TUTTI_VM_RESULT rc=[0-9]*' "$log" | cut -d= -f2 || true)
    if [ "$qemu_rc" = 124 ] || [ "$qemu_rc" = 137 ]; then
        vm_log "TIMEOUT: the guest did not finish within ${timeout_s}s (TUTTI_VM_TIMEOUT_S)"
        VM_GUEST_RC=124
    elif [ -z "$reported" ]; then
        vm_log "the guest exited (QEMU status $qemu_rc) without reporting a result"
        # Killed by SIGILL, SIGABRT, SIGBUS, SIGFPE or SIGSEGV (timeout(1) passes 128 + the
        # signal on): QEMU crashed (vm_boot runs the guest again). The watchdog's and the boot
        # hang's kills are TERMs, and timeout's own are 124 and 137.
        case $qemu_rc in
            132 | 134 | 135 | 136 | 139) echo "QEMU status $qemu_rc: signal $((qemu_rc - 128))" > "$log.crashed" ;;
        esac
        VM_GUEST_RC=125
    elif [ -f "$log.watchdog" ]; then
        vm_log "guest reported rc=$reported but hung on exit (stopped by the watchdog)"
        VM_GUEST_RC=$reported
    elif [ $((qemu_rc % 2)) = 1 ] && [ $(((qemu_rc - 1) / 2)) = "$reported" ]; then
        # isa-debug-exit makes QEMU exit with (value << 1) | 1.
        VM_GUEST_RC=$reported
    elif [ "$reported" -gt 127 ] && [ "$qemu_rc" = 255 ]; then
        # A command killed by a signal (timeout's TERM: 143, the OOM killer: 137): /init passes
        # at most 127 to isa-debug-exit (one byte, shifted), so QEMU exits 255; the printed
        # status is the real one.
        VM_GUEST_RC=$reported
    else
        vm_log "guest reported rc=$reported but QEMU exited with status $qemu_rc"
        VM_GUEST_RC=126
    fi
    rm -f "$pidfile"
}
