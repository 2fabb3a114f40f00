//! `tutti pool format|inspect|check`: create, describe and verify an object-store pool
//! (crates/objstore, format in docs/objstore.md) on one or more NVMe namespaces.
//!
//! A device is `vfio:<PCI address>` (a function bound to vfio-pci) or `emu:<path>` (the software
//! controller over a regular file, created by `format --emu-create-bytes`, or over a whole block
//! device such as `/dev/nvme0n1`). Devices are listed in pool order for `format`; `inspect` and
//! `check` take them in any order.
//!
//! `format` destroys what the devices hold. Every `emu:` block device is first opened
//! exclusively (`O_EXCL`, tutti-devices' `BlockDeviceClaims`) and held so until the command ends:
//! one that is mounted or otherwise in use is refused (status 2), and nothing can mount it
//! meanwhile (`inspect` and `check` claim it too). A device whose first bytes are not a tutti
//! superblock (a block device, or a `vfio:` SSD, whose first MiB is read through its controller
//! once it is up, before anything is written), or a non-empty file whose first MiB is neither a
//! tutti superblock nor all zeroes, is refused, saying what was found, unless `--overwrite` is
//! given; a tutti pool is reformatted without it.
//!
//! Every command first takes tuttid's lock on each device (tutti-devices' `DeviceLocks`: an
//! exclusive `flock` on an `emu:` file, `LOCK_DIR/vfio-BDF.lock` for a `vfio:` function) and
//! holds it until it ends, so none runs on a pool a live tuttid (or another `tutti pool`) is
//! using: refused with status 2, naming the holder.
//!
//! Exit status: 2 when the devices or options cannot be used (nothing is written, but for a
//! pool file whose mode `format` could not make its owner's only once it wrote the pool: the
//! pool is kept, and the error says so), 1 when the pool is damaged (`check`, `inspect`) or a
//! device fails, 0 otherwise.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;
use nvme_driver::NamespaceId;
use objstore::format::Superblock;
use objstore::pool::{format_uuid, read_superblock};
use objstore::{format_pool, mapping_memory, FormatParams, ObjstoreError, Pool, PoolTarget};
use tutti_cli::{outln, read_key_secret_file, GeometryArgs};
use tutti_devices::{
    format_size, open_pool_devices, parse_size, BlockDeviceClaims, BlockDeviceOpener, DeviceError, DeviceKind, DeviceLocks, DeviceSpec,
    FileUndo, HostBlockDevices, DEFAULT_LOCK_DIR,
};

use crate::Unusable;

/// The kinds of device a pool can live on here (memory would not outlive the command).
const POOL_DEVICE_KINDS: [DeviceKind; 2] = [DeviceKind::Vfio, DeviceKind::EmuFile];

#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// A pool member: `vfio:0000:01:00.0`, `emu:/path/to/file` or `emu:/dev/BLOCKDEVICE` (the
    /// whole device; refused while mounted or in use). Repeat for several devices.
    #[arg(long = "device", required = true, value_parser = parse_pool_device)]
    devices: Vec<DeviceSpec>,
    /// Namespace id on every device: 1..=4294967294 (0 is no namespace, 0xFFFFFFFF is the
    /// broadcast id).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=0xFFFF_FFFE))]
    namespace: u32,
    /// LBA size of an `emu:` device's namespace. `inspect` and `check` must be given the one
    /// `format` was (a pool read with another is refused, status 2, naming it). tuttid, the
    /// Python package's `Store.open` and tutti-bench run `emu:` devices with 4096-byte LBAs
    /// only: they serve only pools formatted with the default 4096.
    #[arg(long, default_value_t = 4096)]
    emu_lba_bytes: u32,
    /// Where `vfio:` devices' lock files live: tuttid's `--lock-dir`, so that the two exclude
    /// each other.
    #[arg(long, default_value = DEFAULT_LOCK_DIR)]
    lock_dir: std::path::PathBuf,
}

/// Takes the lock on every device of `args` that has one, held until the value is dropped;
/// another holder (a live tuttid) is unusable input, named. `create_files`: a missing `emu:`
/// file is created empty to be locked (format, once nothing can refuse it any more); otherwise
/// it is left for opening to report. No mode is changed: a pool file of this user's that others
/// can open is narrowed only once `format` has written the pool ([`narrow_pool_files`]), and
/// `inspect` and `check` only warn of it ([`warn_open_to_others`]).
fn lock_devices(args: &DeviceArgs, specs: &[DeviceSpec], create_files: bool) -> Result<DeviceLocks> {
    DeviceLocks::acquire(specs, &args.lock_dir, create_files).map_err(device_refusal)
}

/// Makes the pool files of `locks` that others could open their owner's only, once `format`
/// wrote the pool on `formatted` (not before: a format refused for what a file holds leaves
/// its mode as it was), and says so on standard error. A file whose mode cannot be changed
/// (EPERM: its filesystem refuses chmod) is unusable input, its mode and the others' put back
/// ([`device_refusal`]), the error saying first that the pool was formatted and is kept: it
/// is, and tuttid would refuse it as it stands (it narrows the file too), so a success status
/// would let `tutti pool format ... && tuttid ...` run on into that refusal.
fn narrow_pool_files(locks: &mut DeviceLocks, formatted: &[DeviceSpec]) -> Result<()> {
    // Tests make one fchmod fail (NARROWING_FAILS_WITH), as a filesystem refusing it does.
    #[cfg(test)]
    let failing = tests::NARROWING_FAILS_WITH.get();
    #[cfg(not(test))]
    let failing: Option<(usize, i32)> = None;
    let notes = match failing {
        Some((nth, errno)) => locks.narrow_pool_files_failing(formatted, nth, errno),
        None => locks.narrow_pool_files(formatted),
    };
    for note in notes.map_err(device_refusal)? {
        tutti_cli::errln!("warning: {note}");
    }
    Ok(())
}

/// `inspect` and `check` read the pool and change nothing on its devices, their modes
/// included: a pool file others can open is told on standard error, with how to make it its
/// owner's only, once the pool opened (a file that holds no pool is not called one).
fn warn_open_to_others(locks: &DeviceLocks) {
    for note in locks.open_to_others_notes() {
        tutti_cli::errln!("warning: {note}");
    }
}

/// [`lock_devices`] with `create_files` for the missing `emu:` files of a format, once `undo`
/// made them and locked them: their locks are shared with it
/// ([`DeviceLocks::acquire_created`]), so there is no moment without them.
fn lock_created_devices(args: &DeviceArgs, specs: &[DeviceSpec], undo: &FileUndo) -> Result<DeviceLocks> {
    DeviceLocks::acquire_created(specs, &args.lock_dir, undo).map_err(device_refusal)
}

/// A refused lock, block-device claim or look at what a device holds as an exit status: a file
/// that could not be opened, and any other I/O error (creating or opening the lock directory,
/// examining a file, duplicating a descriptor, `flock`, opening a block device exclusively,
/// reading its first bytes), by its errno ([`tutti_devices::is_unusable_errno`]: a missing path,
/// no permission, a device node with no device: unusable input, 2; EIO, EMFILE, ENOSPC: a
/// failure, 1, as tuttid and tutti-bench say of a failed open); anything else (another holder,
/// a disk in use, a FIFO, foreign contents, a lock directory others could use) unusable input.
pub(crate) fn device_refusal(error: tutti_devices::DeviceError) -> anyhow::Error {
    match error {
        tutti_devices::DeviceError::OpenFailed { ref source, .. } | tutti_devices::DeviceError::Io { ref source, .. }
            if !tutti_devices::is_unusable_errno(source) =>
        {
            anyhow::Error::new(error)
        }
        error => Unusable(error.to_string()).into(),
    }
}

/// Claims every `emu:` block device of `args` exclusively ([`BlockDeviceClaims`]), held until
/// the value is dropped; one in use (mounted, swap, claimed) is unusable input, one that fails
/// to open (EIO) a failure ([`device_refusal`]).
fn claim_block_devices(args: &DeviceArgs, opener: &dyn BlockDeviceOpener) -> Result<BlockDeviceClaims> {
    claim_block_devices_of(&args.devices, opener)
}

/// [`claim_block_devices`] for some of the devices: those format created paths for, which
/// another process may have put a block device at since the first look.
fn claim_block_devices_of(specs: &[DeviceSpec], opener: &dyn BlockDeviceOpener) -> Result<BlockDeviceClaims> {
    BlockDeviceClaims::acquire(specs, opener).map_err(device_refusal)
}

/// Refuses (unusable input) every `emu:` device of `args` that holds something other than a
/// tutti pool, unless `overwrite` (tutti-devices' `contents`: a block device must start with a
/// tutti superblock, a non-empty file may also be blank in its first MiB); a read that fails
/// (EIO) is a failure ([`device_refusal`]).
fn refuse_foreign_contents(args: &DeviceArgs, claims: &BlockDeviceClaims, overwrite: bool) -> Result<()> {
    if overwrite {
        return Ok(());
    }
    tutti_devices::refuse_foreign_contents(&args.devices, claims).map_err(device_refusal)
}

/// Refuses (unusable input) every target whose namespace holds something other than a tutti
/// pool, reading its first bytes through the controller, unless `overwrite`: for `vfio:`
/// devices, which only a controller can read (tutti-devices' `refuse_foreign_namespaces`, as
/// tuttid's `--format` does). A read that fails is a device failure (status 1).
fn refuse_foreign_namespaces<'a>(targets: impl IntoIterator<Item = (&'a DeviceSpec, &'a PoolTarget)>, overwrite: bool) -> Result<()> {
    if overwrite {
        return Ok(());
    }
    tutti_devices::refuse_foreign_namespaces(targets).map_err(|error| match error {
        error @ DeviceError::ForeignContents { .. } => Unusable(error.to_string()).into(),
        error => anyhow::Error::new(error),
    })
}

fn parse_pool_device(text: &str) -> Result<DeviceSpec, String> {
    DeviceSpec::parse(text, &POOL_DEVICE_KINDS).map_err(|error| error.to_string())
}

#[derive(clap::Subcommand, Debug)]
pub enum PoolCommand {
    /// Write a fresh pool (superblock and empty slot headers) on the devices, in pool order.
    Format(FormatArgs),
    /// Print each device's superblock and the slot counts found by recovery; exit status 1 if
    /// a slot header is corrupt or duplicated.
    Inspect(DeviceArgs),
    /// Verify every slot header (and, with --payload, every recorded payload CRC); exit status 1
    /// if anything is damaged.
    Check(CheckArgs),
}

#[derive(Args, Debug)]
pub struct FormatArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    /// Create (or grow) `emu:` files to this size (e.g. 64m, 1g). `format` only: `inspect` and
    /// `check` read a pool and never change the files they read.
    #[arg(long, value_parser = parse_size)]
    emu_create_bytes: Option<u64>,
    /// The model's KV geometry: --model, --model-config, or --layers/--kv-heads/--head-dim.
    #[command(flatten)]
    geometry: GeometryArgs,
    /// Engine blocks per slot (k): 1..=1024.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    blocks_per_slot: u32,
    /// At most this many slots per device, at least 1 (default: as many as fit).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    slots: Option<u64>,
    /// Record a CRC32 of every slot's payload at commit.
    #[arg(long)]
    payload_crc: bool,
    /// The pool's key secret, from a file of exactly 64 hex digits (a trailing newline
    /// allowed; e.g. `openssl rand -hex 32 > FILE`, mode 0600): block keys are keyed with it.
    /// Every node of a cluster must be formatted with the same one, or they share nothing.
    /// Default: a fresh random secret for this pool.
    #[arg(long, value_name = "PATH")]
    key_secret_file: Option<std::path::PathBuf>,
    /// Format devices that hold something other than a tutti pool (a file system, a partition
    /// table, any non-zero bytes in a file's first MiB; any block device that is not a tutti
    /// pool, any `vfio:` SSD that is not a tutti pool): everything on them is lost. Not needed
    /// for a tutti pool, a missing, empty or all-zero file.
    #[arg(long)]
    overwrite: bool,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    /// Also read back every slot that records a payload CRC and compare.
    #[arg(long)]
    payload: bool,
}

/// Opens the pool's devices in one DMA space, as a store over them needs: every `vfio:` device
/// in one VFIO container (which also lets two functions of one IOMMU group be used), every
/// `emu:` controller in one DMA pool. `emu_create_bytes` creates or grows `emu:` files
/// (`format` only). Each `emu:` file opened must be one `locks` (every set the command holds)
/// locked: the controller opens it by its path again, which may name another file by then, or
/// a file that was missing when the locks were taken.
fn open_targets(args: &DeviceArgs, emu_create_bytes: Option<u64>, locks: &[&DeviceLocks]) -> Result<Vec<PoolTarget>> {
    check_namespace(args)?;
    let refusal = |error| match error {
        // A controller that does not come up is a device failure (status 1), not bad input.
        error @ DeviceError::BringUp { .. } => anyhow::Error::new(error),
        error => Unusable(error.to_string()).into(),
    };
    let opened = open_pool_devices(&args.devices, args.emu_lba_bytes, emu_create_bytes).map_err(refusal)?;
    // One of the sets must hold the file opened: a path none holds is a file that appeared
    // after the locks were taken (a missing one is skipped), unlocked.
    for device in &opened {
        tutti_devices::lock::check_opened_in(locks, &device.spec, device.backing_file).map_err(refusal)?;
    }
    Ok(opened.into_iter().map(|device| PoolTarget { controller: device.controller, namespace: NamespaceId(args.namespace) }).collect())
}

/// The software controller a tool opens on an `emu:` file has one namespace, nsid 1: another
/// `--namespace` is refused before anything is opened, created or grown.
fn check_namespace(args: &DeviceArgs) -> Result<()> {
    if args.namespace == 1 {
        return Ok(());
    }
    match args.devices.iter().find(|spec| matches!(spec, DeviceSpec::EmuFile(_))) {
        Some(spec) => {
            Err(Unusable(format!("{spec}: --namespace {}: the software controller on a file has one namespace, nsid 1", args.namespace))
                .into())
        }
        None => Ok(()),
    }
}

/// Lays out every `emu:` file as `format` will find it once opened with `create_bytes` (the
/// larger of its size and `create_bytes`), before anything is created or grown: a refusal
/// (status 2, "nothing is written") must not leave a new or grown file behind. Paths whose size
/// cannot be told here (a block device, a file that cannot be looked at) are left to
/// `format_pool`, which plans the same way on the opened namespace; nothing grows those (the
/// software controller grows regular files only).
fn plan_emu_files(args: &DeviceArgs, create_bytes: u64, params: &FormatParams) -> std::result::Result<(), ObjstoreError> {
    let device_count = u32::try_from(args.devices.len()).unwrap_or(u32::MAX);
    for (device, spec) in args.devices.iter().enumerate() {
        let DeviceSpec::EmuFile(path) = spec else { continue };
        let size_bytes = match std::fs::metadata(path) {
            Ok(metadata) if metadata.is_file() => metadata.len().max(create_bytes),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => create_bytes,
            _ => continue,
        };
        // The software controller's namespace is the whole file in LBAs of --emu-lba-bytes.
        let size_blocks = size_bytes / u64::from(args.emu_lba_bytes.max(1));
        params.plan_layout(args.emu_lba_bytes, size_blocks, device as u32, device_count)?;
    }
    Ok(())
}

/// Exit status 2 for what the devices given cannot be (a set that is not one pool, a format this
/// build does not read, a namespace too small to format, an LBA size other than the format's), 1
/// for damage. `devices`: the devices given, in order (the error's device index names one).
fn classify(error: ObjstoreError, what: &str, devices: &[DeviceSpec]) -> anyhow::Error {
    match error {
        error @ ObjstoreError::LbaSizeMismatch { device, recorded, .. } => match devices.get(device) {
            // The software controller was started with another LBA size than the format's.
            Some(spec @ (DeviceSpec::EmuFile(_) | DeviceSpec::EmuMemory(_) | DeviceSpec::EmuNull(_))) => Unusable(format!(
                "{what}: {spec}: {error}: an emu: device must be read with the LBA size it was formatted with: give --emu-lba-bytes {recorded}"
            ))
            .into(),
            // An SSD's LBA size is its namespace's format, which no flag of tutti's changes.
            Some(spec) => Unusable(format!(
                "{what}: {spec}: {error}: the namespace now has another LBA size than the pool was formatted with \
                 (it was reformatted): format the pool again, or the namespace back to {recorded}-byte LBAs"
            ))
            .into(),
            None => Unusable(format!("{what}: {error}")).into(),
        },
        error @ (ObjstoreError::PoolMembership { .. }
        | ObjstoreError::GeometryMismatch { .. }
        | ObjstoreError::NewerFormatVersion { .. }
        | ObjstoreError::OlderFormatVersion { .. }
        | ObjstoreError::NamespaceTooSmall { .. }
        | ObjstoreError::InvalidFormat { .. }
        | ObjstoreError::InvalidGeometry { .. }) => Unusable(format!("{what}: {error}")).into(),
        error => anyhow::Error::new(error).context(what.to_string()),
    }
}

fn describe(superblock: &Superblock) -> String {
    let g = &superblock.geometry;
    let payload_bytes = superblock.slot_count.saturating_mul(superblock.slot_bytes);
    let mapping = mapping_memory(g, payload_bytes);
    format!(
        "pool {} device {}/{} v{}\n  geometry: {g}\n  object {} B, block {} B, {} block(s) per slot, slot {} B\n  {} slots, LBA {} B, headers at LBA {} ({} LBAs of {}-byte entries), data at LBA {}, payload CRC {}\n  key secret tag {} (names the secret, reveals nothing of it: pools or cluster nodes that share a secret show one tag)\n  mapping table for these {} of KV ({} objects): {} of SGL descriptors (PRP lists: {})",
        format_uuid(&superblock.pool_uuid),
        superblock.device_index,
        superblock.device_count,
        superblock.version,
        g.object_bytes(),
        g.block_bytes(),
        superblock.blocks_per_slot,
        superblock.slot_bytes,
        superblock.slot_count,
        superblock.lba_bytes,
        superblock.header_lba,
        superblock.header_blocks,
        superblock.header_entry_bytes,
        superblock.data_lba,
        if superblock.flags & objstore::format::FLAG_PAYLOAD_CRC != 0 { "on" } else { "off" },
        superblock.key_secret.tag(),
        format_size(payload_bytes),
        mapping.objects,
        format_size(mapping.sgl_bytes),
        format_size(mapping.prp_packed_bytes),
    )
}

pub fn run(command: &PoolCommand) -> Result<()> {
    run_with(command, &HostBlockDevices)
}

/// [`run`] with `opener` answering for the block devices (tests give a fake).
fn run_with(command: &PoolCommand, opener: &dyn BlockDeviceOpener) -> Result<()> {
    match command {
        PoolCommand::Format(args) => {
            let model = args.geometry.resolve(None).map_err(|error| Unusable(error.to_string()))?;
            let key_secret = args.key_secret_file.as_deref().map(read_key_secret_file).transpose()?;
            let params = FormatParams {
                blocks_per_slot: args.blocks_per_slot,
                slot_count_max: args.slots,
                payload_crc: args.payload_crc,
                key_secret,
                ..FormatParams::new(model.geometry)
            };
            let what = format!("formatting a pool for {model}");
            check_namespace(&args.devices)?;
            // What opening the devices refuses on its own (kinds, one DMA space, one file named
            // twice) is refused before anything is locked, created or grown.
            tutti_devices::check_one_space(&args.devices.devices, args.emu_create_bytes).map_err(|error| Unusable(error.to_string()))?;
            // Existing files are locked before anything is read or planned; the ones format is
            // to create, once nothing can refuse any more (a refusal leaves no file behind).
            // The lock comes before the claim, as in tuttid and tutti-bench: a tuttid holding a
            // block device holds both, and its lock's refusal names it (the claim's cannot).
            let mut locks = lock_devices(&args.devices, &args.devices.devices, false)?;
            // Block devices are claimed before anything is read or written, and held to the end.
            let claims = claim_block_devices(&args.devices, opener)?;
            refuse_foreign_contents(&args.devices, &claims, args.overwrite)?;
            if let Some(create_bytes) = args.emu_create_bytes {
                plan_emu_files(&args.devices, create_bytes, &params).map_err(|error| classify(error, &what, &args.devices.devices))?;
            }
            let to_create: Vec<DeviceSpec> = args
                .devices
                .devices
                .iter()
                .filter(|spec| matches!(spec, DeviceSpec::EmuFile(path) if !locks.paths().any(|held| held == path)))
                .cloned()
                .collect();
            // The files this format creates and grows, put back as they were if it is refused
            // before anything is written. Declared after the locks, so dropped before them: it
            // undoes the files while they are still held.
            let mut created_locks: Option<DeviceLocks> = None;
            // The claims on block devices that appeared at paths missing at the first look,
            // held to the end as `claims` are.
            let mut _created_claims: Option<BlockDeviceClaims> = None;
            let mut undo: Option<FileUndo> = None;
            if args.emu_create_bytes.is_some() {
                // Made here with O_EXCL (so the undo knows which it made) and locked at once;
                // the lock taken on them next is that same lock, shared with the undo.
                #[cfg(test)]
                tests::BEFORE_CREATING_FILES.with(|hook| hook.take().map(|hook| hook()));
                let mut made = FileUndo::create_missing(&args.devices.devices, locks.paths());
                #[cfg(test)]
                tests::AFTER_CREATING_FILES.with(|hook| hook.take().map(|hook| hook()));
                let created = lock_created_devices(&args.devices, &to_create, &made)?;
                // A block device put at a missing path since the first look (a node made, a
                // link) was not claimed then: it is claimed now, lock then claim as above, with
                // or without --overwrite (a mounted disk is refused either way), and read
                // through its claim (a blank first MiB proves nothing on a disk). A refusal
                // undoes the files made here while they are still locked.
                let created_claims = match claim_block_devices_of(&to_create, opener) {
                    Ok(claims) => claims,
                    Err(error) => {
                        drop(made);
                        drop(created);
                        return Err(error);
                    }
                };
                // A file another process made or wrote since the first look is read as the
                // others were; one refused is left as that process wrote it (its mode too:
                // narrowing waits for the format).
                if !args.overwrite {
                    for spec in &to_create {
                        if let Err(error) = tutti_devices::refuse_foreign_contents(std::slice::from_ref(spec), &created_claims) {
                            if let DeviceSpec::EmuFile(path) = spec {
                                made.forget(path);
                            }
                            // Undone while the files are still locked.
                            drop(made);
                            drop(created);
                            return Err(device_refusal(error));
                        }
                    }
                }
                _created_claims = Some(created_claims);
                created_locks = Some(created);
                undo = Some(made);
            }
            let targets =
                open_targets(&args.devices, args.emu_create_bytes, &[&locks].into_iter().chain(&created_locks).collect::<Vec<_>>())?;
            // What a vfio: SSD holds can only be read through its controller, now that it is up;
            // emu: devices were read before anything was created or grown.
            let vfio = args.devices.devices.iter().zip(&targets).filter(|(spec, _)| matches!(spec, DeviceSpec::Vfio(_)));
            refuse_foreign_namespaces(vfio, args.overwrite)?;
            // format_pool plans every device before it writes any: a refusal of its plan (status
            // 2) wrote nothing, and the files are put back; anything else keeps them.
            let formatted = format_pool(&targets, &params).map_err(|error| classify(error, &what, &args.devices.devices));
            if !matches!(&formatted, Err(error) if error.is::<Unusable>()) {
                if let Some(undo) = undo.take() {
                    undo.keep();
                }
            }
            let superblocks = formatted?;
            // The devices hold this pool now: their files (all together) are narrowed before
            // anything is printed, so that a print that fails (a full disk, a closed pipe)
            // cannot skip it. What was written is told even when the narrowing failed, and that
            // failure is the error returned ahead of a failed print's.
            if let Some(created) = created_locks.take() {
                locks.extend(created);
            }
            let narrowed = narrow_pool_files(&mut locks, &args.devices.devices);
            for superblock in superblocks {
                if let Err(error) = outln!("{}", describe(&superblock)) {
                    return narrowed.and(Err(error.into()));
                }
            }
            narrowed
        }
        PoolCommand::Inspect(args) => {
            // Lock, then claim (see format).
            let locks = lock_devices(args, &args.devices, false)?;
            let _claims = claim_block_devices(args, opener)?;
            let targets = open_targets(args, None, &[&locks])?;
            for ((position, target), spec) in targets.iter().enumerate().zip(&args.devices) {
                match read_superblock(target, position) {
                    Ok(superblock) => outln!("{spec}: {}", describe(&superblock))?,
                    Err(error) => outln!("{spec}: {error}")?,
                }
            }
            let (pool, report) = Pool::open(targets, None).map_err(|error| classify(error, "opening the pool", &args.devices))?;
            warn_open_to_others(&locks);
            let counts = pool.index().counts();
            outln!(
                "{} slots: {} valid, {} empty, {} corrupt headers, {} duplicates; {} cached blocks",
                report.slots,
                report.valid_slots,
                report.empty_slots,
                report.corrupt_headers,
                report.duplicate_slots,
                counts.cached_blocks
            )?;
            // Damage is what check counts without --payload (exit status 1, as documented).
            let damaged = report.corrupt_headers + report.duplicate_slots;
            if damaged > 0 {
                bail!("{damaged} damaged slots (their blocks are not served; the slots are reused); `tutti pool check` says more");
            }
            Ok(())
        }
        PoolCommand::Check(args) => {
            // Lock, then claim (see format).
            let locks = lock_devices(&args.devices, &args.devices.devices, false)?;
            let _claims = claim_block_devices(&args.devices, opener)?;
            let (mut pool, report) = Pool::open(open_targets(&args.devices, None, &[&locks])?, None)
                .map_err(|error| classify(error, "opening the pool", &args.devices.devices))?;
            warn_open_to_others(&locks);
            outln!(
                "{} slots checked: {} valid, {} empty, {} corrupt headers ({} all zeroes), {} duplicates",
                report.slots,
                report.valid_slots,
                report.empty_slots,
                report.corrupt_headers,
                report.zeroed_headers,
                report.duplicate_slots
            )?;
            if report.zeroed_headers > 0 {
                outln!("  the slot-header region was zeroed or deallocated: the blocks recorded there are lost")?;
            }
            if report.unreadable_headers > 0 {
                outln!(
                    "  {} of the corrupt headers are in header LBAs the device could not read (media errors): their blocks are lost",
                    report.unreadable_headers
                )?;
            }
            let mut damaged = report.corrupt_headers + report.duplicate_slots;
            if args.payload {
                let (verified, bad) = pool.check_payloads(Instant::now() + Duration::from_secs(24 * 3600))?;
                outln!("{verified} payloads verified, {} damaged (a CRC mismatch or a media error; the log says which)", bad.len())?;
                for (device, slot) in &bad {
                    outln!("  damaged payload: device {device} slot {slot}")?;
                }
                damaged += bad.len() as u64;
            }
            if damaged > 0 {
                bail!("{damaged} damaged slots (their blocks are not served; the slots are reused)");
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::fs::File;
    use std::path::{Path, PathBuf};

    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: PoolCommand,
    }

    fn command(arguments: &[&str]) -> PoolCommand {
        Cli::try_parse_from(std::iter::once("pool").chain(arguments.iter().copied())).unwrap().command
    }

    thread_local! {
        /// Run by format after its first look, just before it creates the missing files
        /// (`FileUndo::create_missing`, O_EXCL): a test makes one meanwhile, as another process.
        pub(super) static BEFORE_CREATING_FILES: std::cell::RefCell<Option<Box<dyn FnOnce()>>> = std::cell::RefCell::new(None);
        /// Run by format once it created the missing files, before it locks them and reads
        /// them: a test writes one it made, as another process that ignores the lock would.
        pub(super) static AFTER_CREATING_FILES: std::cell::RefCell<Option<Box<dyn FnOnce()>>> = std::cell::RefCell::new(None);
        /// Which fchmod of format's narrowing on this thread fails (1: the first, counting the
        /// restores), and with what errno (EPERM: a filesystem that refuses chmod); the others,
        /// and all with `None`, are the real fchmod, so that what the narrowing put back shows.
        pub(super) static NARROWING_FAILS_WITH: Cell<Option<(usize, i32)>> = const { Cell::new(None) };
    }

    #[test]
    fn a_format_whose_narrowing_fails_says_the_pool_was_formatted_and_keeps_it() {
        // Goal: narrowing waits for the format, so an EPERM from it (a filesystem refusing
        // chmod) comes after the pool was written; the user saw only the lock step's old
        // refusal ("making it 600 failed", status 2), which reads as if nothing had changed,
        // though the file holds a fresh pool (with --overwrite, what it held is gone). Now the
        // error says the pool was formatted there and is kept. Two files, the second one's
        // fchmod failing: the first, narrowed already, gets its mode back (all are narrowed
        // together).
        use std::os::unix::fs::PermissionsExt;
        let directory = tempfile::tempdir().unwrap();
        let paths = [directory.path().join("a.img"), directory.path().join("b.img")];
        for path in &paths {
            File::create(path).unwrap().set_len(64 << 20).unwrap();
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        let [a, b] = paths.each_ref().map(|path| format!("emu:{}", path.display()));
        NARROWING_FAILS_WITH.set(Some((2, libc::EPERM)));
        let formatted = run_with(&command(&["format", "--device", &a, "--device", &b, "--model", "llama3-8b"]), &HostBlockDevices);
        NARROWING_FAILS_WITH.set(None);
        let error = formatted.unwrap_err();
        let unusable = error.downcast_ref::<Unusable>().unwrap_or_else(|| panic!("not status 2: {error:#}"));
        assert!(unusable.0.contains(&format!("the pool was formatted on {a}, {b} and is kept")), "{}", unusable.0);
        assert!(unusable.0.contains("EPERM") && !unusable.0.contains("immutable"), "{}", unusable.0);
        for path in &paths {
            let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, 0o644, "{} was not put back", path.display());
        }
        run_with(&command(&["inspect", "--device", &a, "--device", &b]), &HostBlockDevices).expect("the pool formatted is there");
    }

    type Hook = std::thread::LocalKey<std::cell::RefCell<Option<Box<dyn FnOnce()>>>>;

    /// Formats a missing `late.img` with `hook` set to write an ext4-looking file there, as
    /// another process would: the format must be refused as foreign (status 2, naming what it
    /// holds), the file left exactly as that process wrote it. Panics with `what` otherwise.
    fn refused_when_written_meanwhile(hook: &'static Hook, what: &str) {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("late.img");
        let mut bytes = vec![0u8; 8 << 20];
        bytes[1080..1082].copy_from_slice(&[0x53, 0xef]);
        let device = format!("emu:{}", path.display());
        let arguments = ["format", "--device", &device, "--model", "llama3-8b", "--emu-create-bytes", "64m"];
        let (late, written) = (path.clone(), bytes.clone());
        hook.with(|hook| *hook.borrow_mut() = Some(Box::new(move || std::fs::write(&late, &written).unwrap())));
        let error = run_with(&command(&arguments), &HostBlockDevices).unwrap_err();
        let unusable = error.downcast_ref::<Unusable>().unwrap_or_else(|| panic!("{what}: not status 2: {error:#}"));
        assert!(unusable.0.contains(&device) && unusable.0.contains("ext2/3/4"), "{what}: {}", unusable.0);
        assert!(std::fs::read(&path).map(|read| read == bytes).unwrap_or(false), "{what}: the file was removed or changed");
    }

    #[test]
    fn a_file_made_by_another_process_meanwhile_is_read_before_it_is_formatted() {
        // Goal: a missing emu: file that another process creates, holding something, between
        // format's first look and its creating lock is refused as the files that were there are
        // (status 2, naming what it holds) and left as it is, unless --overwrite.
        refused_when_written_meanwhile(&BEFORE_CREATING_FILES, "made before format's O_EXCL");
    }

    #[test]
    fn a_file_made_here_then_written_by_another_process_is_refused_and_left_as_it_is() {
        // Goal: a missing emu: file that format creates and another process then writes (without
        // the lock, as mkfs would) before format reads it is refused as foreign (status 2) and
        // left exactly as that process wrote it, not removed as "made here".
        refused_when_written_meanwhile(&AFTER_CREATING_FILES, "written after format made it");
    }

    #[test]
    fn a_lock_file_that_fails_to_open_is_input_or_failure_by_its_errno() {
        // Goal: every refused lock was status 2; an open that failed with EIO, EMFILE or
        // ENOSPC is a failure (1), as tuttid and tutti-bench make it; a missing path, no
        // permission or a device node with no device (ENXIO) stays unusable input (2).
        let open =
            |errno: i32| tutti_devices::DeviceError::OpenFailed { path: "/x".into(), source: std::io::Error::from_raw_os_error(errno) };
        for errno in [libc::EIO, libc::EMFILE, libc::ENOSPC] {
            assert!(!device_refusal(open(errno)).is::<Unusable>(), "errno {errno} made unusable input");
        }
        for errno in [libc::ENOENT, libc::EACCES, libc::ENXIO] {
            assert!(device_refusal(open(errno)).is::<Unusable>(), "errno {errno} made a failure");
        }
        let in_use = tutti_devices::DeviceError::DeviceInUse { spec: "emu:/x".into(), lock: "/x".into(), holder: "pid 1".into() };
        assert!(device_refusal(in_use).is::<Unusable>());
    }

    #[test]
    fn a_lock_that_fails_with_an_io_error_is_input_or_failure_by_its_errno() {
        // Goal: every DeviceError::Io of a lock (creating or opening the lock directory,
        // examining a file, duplicating a descriptor, flock) was unusable input (2), EIO,
        // ENOSPC and EMFILE included, where tuttid says 1; it is decided by its errno, as a
        // failed open is.
        let io = |errno: i32| tutti_devices::DeviceError::Io {
            context: "creating the lock directory /run/tutti".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        for errno in [libc::EIO, libc::EMFILE, libc::ENOSPC, libc::ENOLCK] {
            assert!(!device_refusal(io(errno)).is::<Unusable>(), "errno {errno} made unusable input");
        }
        for errno in [libc::EACCES, libc::EPERM, libc::EROFS, libc::ENOTDIR] {
            assert!(device_refusal(io(errno)).is::<Unusable>(), "errno {errno} made a failure");
        }
    }

    #[test]
    fn another_lba_size_names_emu_lba_bytes_only_for_an_emu_device() {
        // Goal: a pool recording another LBA size than its device's is unusable input; the
        // advice names --emu-lba-bytes only for an emu: device (the error's device index), not
        // for a vfio: SSD, whose LBA size is its namespace's format.
        let specs = [
            DeviceSpec::parse("emu:/tmp/pool.img", &DeviceKind::ALL).unwrap(),
            DeviceSpec::parse("vfio:0000:00:04.0", &DeviceKind::ALL).unwrap(),
        ];
        let message = |device| {
            let error = classify(ObjstoreError::LbaSizeMismatch { device, recorded: 512, namespace: 4096 }, "opening the pool", &specs);
            error.downcast_ref::<Unusable>().unwrap_or_else(|| panic!("not status 2: {error:#}")).0.clone()
        };
        assert!(message(0).contains("--emu-lba-bytes 512"), "{}", message(0));
        assert!(!message(1).contains("--emu-lba-bytes"), "{}", message(1));
        assert!(message(1).contains("vfio:0000:00:04.0"), "{}", message(1));
    }

    /// Calls `path` a block device and answers EBUSY for it, as the kernel does for a mounted one.
    struct BusyDevice {
        path: PathBuf,
        opens: Cell<usize>,
    }

    impl BlockDeviceOpener for BusyDevice {
        fn is_block_device(&self, path: &Path) -> bool {
            path == self.path
        }

        fn open_exclusive(&self, _path: &Path) -> std::io::Result<File> {
            self.opens.set(self.opens.get() + 1);
            Err(std::io::Error::from_raw_os_error(libc::EBUSY))
        }
    }

    #[test]
    fn a_file_that_appeared_after_the_locks_were_taken_is_status_2() {
        // Goal: tutti pool inspect/check lock the files first and skip a missing one; one put
        // at its path before the controller opens it is unlocked (another tuttid could serve
        // it too) and is refused, status 2, naming it.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("late.img");
        let device = format!("emu:{}", path.display());
        let PoolCommand::Inspect(args) = command(&["inspect", "--device", &device]) else { unreachable!() };
        let locks = DeviceLocks::acquire(&args.devices, directory.path(), false).unwrap();
        std::fs::write(&path, vec![0u8; 8 << 20]).unwrap();
        let error = open_targets(&args, None, &[&locks]).expect_err("an unlocked file was opened");
        let unusable = error.downcast_ref::<Unusable>().unwrap_or_else(|| panic!("not status 2: {error:#}"));
        assert!(unusable.0.contains(&path.display().to_string()), "{}", unusable.0);
    }

    #[test]
    fn a_namespace_holding_a_file_system_is_refused_unless_overwrite() {
        // Goal: tutti pool format's wrapper of tutti-devices' check (tested there) makes what a
        // vfio: SSD holds (an emu:-file-backed target stands in for it here) status 2, naming
        // it; --overwrite lets it through.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("ssd.img");
        let mut bytes = vec![0u8; 8 << 20];
        bytes[1080..1082].copy_from_slice(&[0x53, 0xef]);
        std::fs::write(&path, &bytes).unwrap();
        let device = format!("emu:{}", path.display());
        let PoolCommand::Inspect(args) = command(&["inspect", "--device", &device]) else { unreachable!() };
        let locks = DeviceLocks::acquire(&args.devices, directory.path(), false).unwrap();
        let targets = open_targets(&args, None, &[&locks]).unwrap();
        let error = refuse_foreign_namespaces(args.devices.iter().zip(&targets), false).unwrap_err();
        let unusable = error.downcast_ref::<Unusable>().unwrap_or_else(|| panic!("not status 2: {error:#}"));
        assert!(unusable.0.contains(&device) && unusable.0.contains("ext2/3/4"), "{}", unusable.0);
        refuse_foreign_namespaces(args.devices.iter().zip(&targets), true).unwrap();
        drop(targets);
        assert!(std::fs::read(&path).unwrap() == bytes, "reading what a device holds wrote to it");
    }

    #[test]
    fn a_block_device_in_use_is_refused_before_anything_is_written() {
        // Goal: format (even with --overwrite and a size to grow to), inspect and check claim
        // every emu: block device first; EBUSY is unusable input naming the device, and the
        // device is neither written nor grown.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("disk");
        let bytes = vec![0xa5u8; 1 << 20];
        std::fs::write(&path, &bytes).unwrap();
        let device = format!("emu:{}", path.display());
        let opener = BusyDevice { path: path.clone(), opens: Cell::new(0) };
        let runs = [
            vec!["format", "--device", &device, "--model", "llama3-8b", "--overwrite", "--emu-create-bytes", "64m"],
            vec!["inspect", "--device", &device],
            vec!["check", "--device", &device],
        ];
        for (count, arguments) in runs.iter().enumerate() {
            let error = run_with(&command(arguments), &opener).unwrap_err();
            let unusable = error.downcast_ref::<Unusable>().unwrap_or_else(|| panic!("{arguments:?}: not status 2: {error:#}"));
            assert!(unusable.0.contains(&device) && unusable.0.contains("in use"), "{}", unusable.0);
            assert_eq!(opener.opens.get(), count + 1, "{arguments:?}: claimed once");
        }
        assert!(std::fs::read(&path).unwrap() == bytes, "a refused command wrote to the device");
    }

    /// Calls `path` a block device once something is there (a disk node that appeared at a
    /// path missing at format's first look) and answers EBUSY for it, as for a mounted disk.
    struct BusyOnceThere {
        path: PathBuf,
        opens: Cell<usize>,
    }

    impl BlockDeviceOpener for BusyOnceThere {
        fn is_block_device(&self, path: &Path) -> bool {
            path == self.path && path.exists()
        }

        fn open_exclusive(&self, _path: &Path) -> std::io::Result<File> {
            self.opens.set(self.opens.get() + 1);
            Err(std::io::Error::from_raw_os_error(libc::EBUSY))
        }
    }

    #[test]
    fn a_block_device_that_appeared_at_a_missing_path_is_claimed_before_it_is_formatted() {
        // Goal: format --emu-create-bytes claims (O_EXCL) only the devices there at its first
        // look; a disk that appears at a missing path before it creates the files (a node made,
        // a link put there) was locked but never claimed, and read as a regular file (a blank
        // first MiB enough): a mounted disk was formatted with --overwrite, and one with a zero
        // first MiB without. It is claimed now, with or without --overwrite, and refused as in
        // use (status 2), unchanged.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("disk");
        let device = format!("emu:{}", path.display());
        let lock_dir = directory.path().join("locks");
        let lock_dir = lock_dir.to_str().unwrap();
        let bytes = vec![0u8; 8 << 20];
        for overwrite in [false, true] {
            let _ = std::fs::remove_file(&path);
            let mut arguments =
                vec!["format", "--device", &device, "--model", "llama3-8b", "--emu-create-bytes", "64m", "--lock-dir", lock_dir];
            if overwrite {
                arguments.push("--overwrite");
            }
            let (late, written) = (path.clone(), bytes.clone());
            BEFORE_CREATING_FILES.with(|hook| *hook.borrow_mut() = Some(Box::new(move || std::fs::write(&late, &written).unwrap())));
            let opener = BusyOnceThere { path: path.clone(), opens: Cell::new(0) };
            let error = run_with(&command(&arguments), &opener).expect_err("a disk in use was formatted");
            let unusable = error.downcast_ref::<Unusable>().unwrap_or_else(|| panic!("overwrite {overwrite}: not status 2: {error:#}"));
            assert!(unusable.0.contains(&device) && unusable.0.contains("in use"), "overwrite {overwrite}: {}", unusable.0);
            assert_eq!(opener.opens.get(), 1, "overwrite {overwrite}: claimed once");
            assert!(std::fs::read(&path).unwrap() == bytes, "overwrite {overwrite}: the disk was written or removed");
        }
    }

    /// Calls `path` a block device; its exclusive open fails with `open_errno`, or, with none,
    /// gives a descriptor whose reads fail with EIO (`/proc/self/mem` at offset 0, unmapped),
    /// as a failing disk's would.
    struct FailingDisk {
        path: PathBuf,
        open_errno: Option<i32>,
    }

    impl BlockDeviceOpener for FailingDisk {
        fn is_block_device(&self, path: &Path) -> bool {
            path == self.path
        }

        fn open_exclusive(&self, _path: &Path) -> std::io::Result<File> {
            match self.open_errno {
                Some(errno) => Err(std::io::Error::from_raw_os_error(errno)),
                None => File::open("/proc/self/mem"),
            }
        }
    }

    #[test]
    fn a_block_device_that_fails_is_a_failure_not_unusable_input() {
        // Goal: a block device whose exclusive open fails with EIO, or whose first bytes cannot
        // be read (EIO) when format looks at what it holds, is a device failure (status 1), as
        // tuttid says of the same claim; both were unusable input (2) whatever the errno. A
        // device node with no device behind it (ENXIO) stays unusable input.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("disk");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let device = format!("emu:{}", path.display());
        let format = ["format", "--device", &device, "--model", "llama3-8b"];
        for (open_errno, unusable, expected) in [
            (Some(libc::EIO), false, "opening the block device exclusively"),
            (None, false, "reading its first bytes"),
            (Some(libc::ENXIO), true, "opening the block device exclusively"),
        ] {
            let opener = FailingDisk { path: path.clone(), open_errno };
            for arguments in [&format[..], &["check", "--device", &device]] {
                let error = run_with(&command(arguments), &opener).unwrap_err();
                if open_errno.is_none() && arguments[0] == "check" {
                    // check does not read the head through the claim: the pool open fails instead.
                    continue;
                }
                assert_eq!(error.is::<Unusable>(), unusable, "{arguments:?} {open_errno:?}: {error:#}");
                assert!(format!("{error:#}").contains(expected), "{arguments:?} {open_errno:?}: {error:#}");
            }
        }
    }

    #[test]
    fn a_character_device_that_cannot_be_read_is_unusable_input_with_or_without_overwrite() {
        // Goal: `emu:` naming a character device whose reads fail (EAGAIN for /dev/ptmx, EINVAL
        // for an NVMe controller's /dev/nvme0) is no pool device: status 2 with or without
        // --overwrite, as its open for I/O says; the look at what it holds made it a failure (1)
        // without --overwrite once that look's read errors went by errno.
        let directory = tempfile::tempdir().unwrap();
        let lock_dir = directory.path().join("locks");
        let lock_dir = lock_dir.to_str().unwrap();
        for overwrite in [false, true] {
            let mut arguments = vec!["format", "--device", "emu:/dev/ptmx", "--model", "llama3-8b", "--lock-dir", lock_dir];
            if overwrite {
                arguments.push("--overwrite");
            }
            let error = run_with(&command(&arguments), &HostBlockDevices).unwrap_err();
            assert!(error.is::<Unusable>(), "overwrite {overwrite}: not status 2: {error:#}");
        }
    }
}
