//! Turning a command line into phases: validation (every refusal is a [`Unusable`]), device
//! opening, the phases themselves, and the printed configuration and results. Also the
//! no-argument default run.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::ArgMatches;
use serde_json::json;
use tutti_cli::outln;

use crate::args::{format_size, Cli, DeviceSpec, Executor, OutputFormat, Pattern, Selected};
use crate::devices::{self, CreatedFiles, Device, FileModes, OpenOptions2};
use crate::progress::with_progress;
use crate::report::{phase_json, phase_text, PhaseResult};
use crate::workloads::{run_phase, PhasePlan, Progress, VerifyMode};
use crate::{usage, Unusable};
use tutti_devices::{memory_shortfall, BlockDeviceClaims, DeviceLocks, HostBlockDevices};

/// Largest pool file the default run creates, and the share of the free space it may take.
const DEFAULT_POOL_BYTES_MAX: u64 = 1 << 30;
const DEFAULT_POOL_FREE_DIVISOR: u64 = 10;
/// Below this the default run refuses: too small to say anything about a device.
const DEFAULT_POOL_BYTES_MIN: u64 = 64 << 20;

pub fn run(cli: &Cli, selected: Selected, matches: &ArgMatches) -> anyhow::Result<()> {
    check_executor(cli.executor)?;
    refuse_pool_options_without_use(cli, selected, matches)?;
    if cli.shadow_doorbells && selected != Selected::Raw {
        return usage("--shadow-doorbells applies to --workload=raw (the kv and serve workloads keep MMIO doorbells)");
    }
    if cli.cpus_allowed.is_some() && selected != Selected::Raw {
        return usage("--cpus_allowed applies to --workload=raw");
    }
    if matches!(selected, Selected::Kv | Selected::Serve) {
        let raw_options = crate::args::raw_options_given(matches);
        if !raw_options.is_empty() {
            let (workload, accepted) = match selected {
                Selected::Kv => ("kv", "--device, --verify, --output-format and the KV options"),
                _ => ("serve", SERVE_ACCEPTS),
            };
            return usage(format!(
                "{} apply to --workload=raw; the {workload} workload sizes its I/O from the model, the prompt and the pool (accepted with it: {accepted})",
                raw_options.join(", ")
            ));
        }
    }
    // Each workload refuses what it would not use rather than run without it, as above: the
    // figures printed would otherwise be taken for those of a configuration that never ran.
    if matches!(selected, Selected::Kv | Selected::Raw) {
        let serve_options = crate::args::serve_options_given(matches);
        if !serve_options.is_empty() {
            return usage(format!(
                "{} apply to --workload=serve; the {} workload runs once, on its own I/O, not on a stream of requests",
                serve_options.join(", "),
                if selected == Selected::Kv { "kv" } else { "raw" }
            ));
        }
    }
    if selected == Selected::Serve {
        let ignored = crate::args::kv_options_serve_ignores_given(matches);
        if !ignored.is_empty() {
            return usage(format!(
                "{} apply to --workload=kv; the serve workload formats a fresh in-memory pool of one block per slot for each policy and keeps its store's default layers in flight (accepted with it: {SERVE_ACCEPTS})",
                ignored.join(", ")
            ));
        }
    }
    match selected {
        Selected::Default => default_run(cli, matches),
        Selected::Kv => crate::kv::run(cli),
        Selected::Serve if cli.attach.is_some() => {
            usage("--attach runs the kv workload through tuttid; --workload=serve runs its own software controller: drop one of them")
        }
        Selected::Serve => crate::serve::run(cli, matches),
        Selected::Raw => {
            let kv_options = crate::args::kv_options_given(matches);
            if !kv_options.is_empty() {
                return usage(format!(
                    "{} apply to --workload=kv; accepted with --workload=raw: --rw, --bs, --iodepth, --numjobs, --size, --runtime, --number_ios, --offset, --verify, --shadow-doorbells, --cpus_allowed",
                    kv_options.join(", ")
                ));
            }
            // Checked before anything is created: without --device the temporary pool file is
            // laid out (written) to --offset + --size first.
            validate_raw(cli)?;
            // Sized as a file --device names and the run creates is (`run_raw`,
            // `stripe_share_bytes` of one device): to whole --bs blocks, as the run counts the
            // capacity it covers. `offset + size` rounded only to 1 MiB left a --size of 10m
            // with --bs 4m short of its third block, refused after the pool was laid out.
            let end_bytes = cli.size.map(|size| region_end(cli.offset, size)).transpose()?;
            // Saturated past 2^64: such a pool is refused as not fitting the free space, named.
            let pool_bytes = end_bytes.map(|end| end.div_ceil(cli.bs).saturating_mul(cli.bs));
            let lay_out = !raw_writes(cli);
            let access = if raw_writes(cli) { Access::Writes } else { Access::Reads };
            with_devices(cli, pool_bytes, lay_out, access, |devices, created| run_raw(cli, devices, created))
        }
    }
}

/// Refuses, as the refusals of [`run`] do, the options of a temporary pool or of device locks
/// where the run has none to apply them to: --directory and --keep are about the temporary
/// pool of a run without --device (with --device the run's files are the ones named, kept when
/// it succeeds); with --attach the pool is tuttid's, locked by tuttid under its own --lock-dir;
/// the serve workload has neither a pool file nor a device to lock (an in-memory pool per policy).
fn refuse_pool_options_without_use(cli: &Cli, selected: Selected, matches: &ArgMatches) -> anyhow::Result<()> {
    let given = |id: &str, name: &'static str| (matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine)).then_some(name);
    let (directory, keep) = (given("directory", "--directory"), given("keep", "--keep"));
    let lock_dir = given("lock_dir", "--lock-dir");
    // One refusal naming every option given that `why` rules out.
    let refuse = |options: &[Option<&'static str>], why: &str| -> anyhow::Result<()> {
        let ignored: Vec<&str> = options.iter().copied().flatten().collect();
        if ignored.is_empty() {
            return Ok(());
        }
        let (verb, pronoun) = if ignored.len() == 1 { ("does", "it") } else { ("do", "them") };
        usage(format!("{} {verb} not apply {why}; drop {pronoun}", ignored.join(", ")))
    };
    if selected == Selected::Serve {
        refuse(
            &[directory, keep, lock_dir],
            &format!(
                "with --workload=serve: it builds a fresh in-memory pool per policy, with no file to place or keep and no device \
                 to lock (accepted with it: {SERVE_ACCEPTS})"
            ),
        )?;
    }
    if cli.attach.is_some() {
        refuse(
            &[directory, keep, lock_dir],
            "with --attach: the pool is tuttid's, on its devices and locked by tuttid under its own --lock-dir",
        )?;
    }
    if !cli.devices.is_empty() {
        refuse(
            &[directory, keep],
            "with --device, which names the run's files (they stay after a run that succeeded): these options are for the \
             temporary pool file of a run without --device (where it goes, whether it stays)",
        )?;
    }
    Ok(())
}

/// What the serve workload accepts, for its refusals.
const SERVE_ACCEPTS: &str = "--output-format, --emu-timing, the model options, --prompt-tokens, --hit-rate, --seed and the serve options";

/// Whether a raw run writes (then its files are opened read-write, and not laid out first).
fn raw_writes(cli: &Cli) -> bool {
    cli.verify || matches!(cli.rw, Pattern::Write | Pattern::Randwrite | Pattern::Randrw)
}

/// `offset + size`, the end of the region a raw run covers; past 2^64 bytes no device holds it.
fn region_end(offset: u64, size: u64) -> anyhow::Result<u64> {
    offset.checked_add(size).ok_or_else(|| {
        Unusable(format!(
            "--size={} from --offset={offset} is larger than the device (together past 2^64 bytes); accepted: --size up to the device's capacity less --offset",
            format_size(size)
        ))
        .into()
    })
}

/// What a run does to its devices, for the checks before it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Only reads (a raw read pattern).
    Reads,
    /// Writes where the run's own I/O lands (a raw write pattern, `--verify`).
    Writes,
    /// Formats a pool over whatever the devices held (the kv workload without `--keep-pool`).
    Formats,
    /// Writes into the pool already on the devices (`--keep-pool`, `--retrieve-only`).
    WritesPool,
}

/// Runs `body` on the devices the command line names or, when it names none, on a temporary
/// pool file on the software controller (`bytes`, or the default size; with `lay_out` written
/// with data first, so that a run that only reads hits real blocks, as `prepare_file` does for
/// the files it creates). Files the user named stay after a successful run, like fio's; the
/// temporary one is removed unless `--keep`.
pub fn with_devices(
    cli: &Cli,
    bytes: Option<u64>,
    lay_out: bool,
    access: Access,
    body: impl FnOnce(&[DeviceSpec], &mut CreatedFiles) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    if let Some(spec) = cli.emu_timing.and(cli.devices.iter().find(|spec| !spec.is_emulated())) {
        return usage(format!(
            "--emu-timing models the software controller; {spec} is not one (accepted: emu:PATH, emu:mem:SIZE, emu:null:SIZE)"
        ));
    }
    let mut created = CreatedFiles::default();
    let devices = if cli.devices.is_empty() {
        // A kv or serve run refuses --offset (a raw option) before this: it is 0 there.
        let wanted = bytes.map(|bytes| (bytes, WantedPool::of(cli)));
        // Locked as it was created and held by `created`: the lock step below has no device.
        let mut pool = temporary_pool(cli.directory.as_deref(), wanted, cli.offset, cli.bs, lay_out)?;
        track_pool(&mut pool, &mut created);
        vec![DeviceSpec::EmuFile(pool.path)]
    } else {
        cli.devices.clone()
    };
    // --keep is about the temporary pool: a file created for a --device given is removed when
    // the run fails, --keep or not, as a failed run leaves nothing behind.
    if cli.keep && cli.devices.is_empty() {
        created.keep();
    }
    // The lock tuttid and `tutti pool` take (flock on the file or device node named; for vfio:
    // a lock file per PCI function), held to the end, readers included: runs naming one pool
    // the same way exclude each other, so that neither formats or writes under the other, nor
    // reads a pool mid-write. A block device's lock is its node's (a symbolic link such as
    // /dev/disk/by-id/… is followed to it): the disk named through another node (another /dev,
    // a node made with mknod) is another lock. Writers still meet in the exclusive claim below,
    // which is the disk's own; a raw read run takes none, so such a reader is kept from nothing
    // (it reads what is there, as fio would). The temporary pool (no --device) was locked as it
    // was created.
    // A raw run reads (or writes) any file, as fio does: its mode is left alone. A kv run's
    // devices are a pool, as tuttid's: another user's that others can open refused here, this
    // user's narrowed only once the pool is open (kv.rs, `CreatedFiles::narrow_pool_files`),
    // so that a refusal below (a file system on a device) or on the way there changes no mode.
    let modes = if matches!(access, Access::Reads | Access::Writes) { FileModes::Leave } else { FileModes::Narrow };
    created.set_file_modes(modes);
    let locks = lock_devices(&cli.devices, &cli.lock_dir, modes)?;
    created.note_held(locks.iter().flat_map(DeviceLocks::paths));
    for locks in locks {
        created.hold_locks(locks);
    }
    // A run that writes claims every block device it names (O_EXCL, held to the end): one that
    // is mounted, swap or under device-mapper/MD is refused before a byte is written, and
    // nothing mounts it meanwhile. A run that only reads, like fio's, may read a disk in use.
    let claims = if access == Access::Reads {
        BlockDeviceClaims::default()
    } else {
        match BlockDeviceClaims::acquire(&devices, &HostBlockDevices) {
            Ok(claims) => claims,
            Err(error @ tutti_devices::DeviceError::BlockDeviceInUse { .. }) => return usage(error.to_string()),
            // A disk gone or not allowed between the lock's open and this one is what was given
            // (2), as tutti pool and tuttid decide a claim; EIO and the like are failures (1).
            Err(tutti_devices::DeviceError::Io { ref source, ref context }) if tutti_devices::is_unusable_errno(source) => {
                return usage(format!("{context}: {source}"))
            }
            Err(error) => return Err(error.into()),
        }
    };
    // Formatting destroys what a device holds: as `tutti pool format` and `tuttid --format`,
    // refuse a device holding something other than a tutti pool unless told to overwrite it.
    // A raw write is fio's and writes where it is told, like fio.
    if access == Access::Formats && !cli.overwrite {
        match tutti_devices::refuse_foreign_contents(&devices, &claims) {
            Ok(()) => {}
            Err(error @ tutti_devices::DeviceError::ForeignContents { .. }) => return usage(error.to_string()),
            Err(error) => return Err(error.into()),
        }
        match refuse_foreign_ssds(&devices) {
            Ok(()) => {}
            // A controller that failed (to come up, to read) failed, as in the run itself.
            Err(error @ (tutti_devices::DeviceError::BringUp { .. } | tutti_devices::DeviceError::NamespaceHead { .. })) => {
                return Err(error.into())
            }
            // What was found, or devices that cannot be opened: unusable, as the run says.
            Err(error) => return usage(error.to_string()),
        }
    }
    if access == Access::Formats && !cli.overwrite {
        // A file that appears after these checks (or is put in place of one locked above)
        // is checked the same way when the run opens it (`devices::prepare_file`).
        created.refuse_foreign_appearing();
    }
    let result = body(&devices, &mut created);
    if result.is_ok() && (!cli.devices.is_empty() || cli.keep) {
        created.keep_after_success();
    }
    if cli.devices.is_empty() {
        if let Some(path) = created.paths().first().cloned() {
            // Said as it turned out: removed now, so that a removal that failed is not called one.
            let fate = match created.remove_now().into_iter().next() {
                _ if cli.keep => "kept".to_string(),
                None => "removed".to_string(),
                Some((_, error)) => format!("NOT removed: {error}"),
            };
            tutti_cli::errln!("pool file: {} ({fate})", path.display());
        }
    }
    result
}

/// Refuses ([`tutti_devices::DeviceError::ForeignContents`]) a pool of `vfio:` SSDs (`devices`)
/// one of whose namespace 1 (the kv workload's) holds something other than a tutti pool: only a
/// controller can read it, so the SSDs are opened and brought up here, read (tutti-devices'
/// `refuse_foreign_namespaces`, as `tutti pool format` and `tuttid --format` do) and closed
/// again (each controller stopped) before the run opens them for itself. The locks taken before
/// keep anyone else off them in between. A set that is not all `vfio:` is left alone: the run
/// refuses a mix (two DMA spaces) before it opens anything, and that refusal comes first.
fn refuse_foreign_ssds(devices: &[DeviceSpec]) -> Result<(), tutti_devices::DeviceError> {
    if devices.is_empty() || !devices.iter().all(|spec| matches!(spec, DeviceSpec::Vfio(_))) {
        return Ok(());
    }
    // The LBA size is the software controller's; a vfio: SSD reports its own.
    let opened = tutti_devices::open_pool_devices(devices, 4096, None)?;
    let targets: Vec<objstore::PoolTarget> = opened
        .iter()
        .map(|device| objstore::PoolTarget { controller: Arc::clone(&device.controller), namespace: nvme_driver::NamespaceId(1) })
        .collect();
    tutti_devices::refuse_foreign_namespaces(devices.iter().zip(&targets))
}

/// Takes tuttid's lock ([`DeviceLocks`]) on every device of `devices` that has one: an `emu:`
/// or `uring:` file or block device (the file itself), a `vfio:` function
/// (`LOCK_DIR/vfio-BDF.lock`). Another holder is unusable input, named. A file that does not
/// exist yet is not locked here: the run creates it (`create_new`, so it cannot be another's)
/// and `devices::prepare_file` locks it then, held by the run's `CreatedFiles` to the end; one
/// another process made meanwhile is locked there as here (refused while that process holds it).
/// `modes`: whether an existing file others can open is refused (another user's) or recorded
/// (this user's, narrowed later) as a pool file (a kv run), or left as it is (a raw run);
/// no mode is changed here.
fn lock_devices(devices: &[DeviceSpec], lock_dir: &Path, modes: FileModes) -> anyhow::Result<Vec<DeviceLocks>> {
    // One device named twice would otherwise be refused below as held by "another process"
    // (this one): each spec takes its lock through its own open file.
    match tutti_devices::refuse_shared_files(devices) {
        Ok(()) => {}
        Err(error @ (tutti_devices::DeviceError::DuplicateFile { .. } | tutti_devices::DeviceError::DuplicateFunction { .. })) => {
            return usage(error.to_string())
        }
        Err(error) => return Err(error.into()),
    }
    let mut locks = Vec::with_capacity(devices.len());
    for spec in devices {
        let held = modes.acquire(std::slice::from_ref(spec), lock_dir).map_err(|error| lock_refusal(spec, error))?;
        locks.push(held);
    }
    Ok(locks)
}

/// Why `spec`'s lock could not be taken, as the exit status says it: unusable input (2) for
/// what was given, a failure (1) otherwise.
fn lock_refusal(spec: &DeviceSpec, error: tutti_devices::DeviceError) -> anyhow::Error {
    let usage = |message: String| anyhow::Error::new(Unusable(message));
    match error {
        // A device another process holds, a directory, FIFO or socket named as a device, or a
        // vfio: lock file or directory others could use: unusable input, as README's exit
        // statuses say.
        error @ (tutti_devices::DeviceError::DeviceInUse { .. }
        | tutti_devices::DeviceError::NotAFileOrDevice { .. }
        | tutti_devices::DeviceError::SharedLockFile { .. }) => usage(error.to_string()),
        // A vfio: lock file lives in the lock directory, /run/tutti by default, which a user
        // other than root may not create or open: say which option picks another.
        error @ (tutti_devices::DeviceError::OpenFailed { .. } | tutti_devices::DeviceError::Io { .. })
            if matches!(spec, DeviceSpec::Vfio(_)) && lock_input_error(&error) =>
        {
            usage(format!(
                "{error} (--lock-dir picks another directory for vfio: lock files; give tuttid's, so that a run is refused on a device it uses)"
            ))
        }
        // A file that cannot be opened, or any other I/O error of the lock step, by its errno
        // (no such path, no permission, read-only, a loop: what was given; EIO, EMFILE,
        // ENOSPC: a failure), as tutti pool and tuttid say. (No mode is narrowed here: a kv
        // run narrows once its pool is open, kv.rs `narrowing_error`.)
        error if lock_input_error(&error) => usage(error.to_string()),
        error => error.into(),
    }
}

/// Whether a lock file's open, or the lock directory's making, failed for what was given (no
/// such path, no permission, read-only, a loop: `tutti_devices::is_unusable_errno`) rather than
/// because the host failed (EIO, EMFILE, ENOSPC: exit 1).
pub(crate) fn lock_input_error(error: &tutti_devices::DeviceError) -> bool {
    match error {
        tutti_devices::DeviceError::Io { source, .. } => tutti_devices::is_unusable_errno(source),
        error => error.is_unusable_input(),
    }
}

fn check_executor(executor: Executor) -> anyhow::Result<()> {
    match executor {
        Executor::Cpu => Ok(()),
        Executor::Cuda => usage("--executor=cuda: the GPU I/O executor is not available in this build of tutti-bench (no CUDA executor is linked and no CUDA driver is used); accepted: --executor=cpu"),
    }
}

/// The phases a raw command line asks for, and which of them is the headline.
fn plan_phases(cli: &Cli, region_start: u64, region_bytes: u64, seed: u64) -> anyhow::Result<(Vec<PhasePlan>, usize)> {
    let base = PhasePlan {
        label: cli.rw.name().to_string(),
        pattern: cli.rw,
        bs: cli.bs,
        iodepth: cli.iodepth,
        region_start,
        region_bytes,
        split_region: false,
        runtime: cli.runtime,
        time_based: cli.time_based,
        number_ios: cli.number_ios,
        rwmixread: cli.rwmixread,
        verify: VerifyMode::None,
        scramble_buffers: cli.scramble_buffers,
        seed,
        cpus_allowed: cli.cpus_allowed.clone(),
    };
    if !cli.verify {
        return Ok((vec![base], 0));
    }
    // Each job verifies its own slice, so that every block is written once and read back once:
    // a job without a block of its own would fail at run time, so refuse that here.
    let blocks = region_bytes / cli.bs;
    if blocks < u64::from(cli.numjobs) {
        return usage(format!(
            "--verify gives each job a slice of its own: --numjobs={} needs at least {} blocks of --bs={}, the region holds {blocks}; accepted: --numjobs up to {blocks}, or a larger --size",
            cli.numjobs,
            cli.numjobs,
            format_size(cli.bs)
        ));
    }
    let write = PhasePlan {
        label: format!("{} (verify: write pattern)", if cli.rw.is_random() { "randwrite" } else { "write" }),
        pattern: if cli.rw.is_random() { Pattern::Randwrite } else { Pattern::Write },
        split_region: true,
        runtime: None,
        verify: VerifyMode::WritePattern,
        ..base.clone()
    };
    let read = PhasePlan {
        label: format!("{} (verify: read back and compare)", if cli.rw.is_random() { "randread" } else { "read" }),
        pattern: if cli.rw.is_random() { Pattern::Randread } else { Pattern::Read },
        split_region: true,
        runtime: None,
        verify: VerifyMode::CheckPattern,
        ..base
    };
    let headline = if matches!(cli.rw, Pattern::Write | Pattern::Randwrite) { 0 } else { 1 };
    Ok((vec![write, read], headline))
}

/// Bytes each of `devices` striped devices needs so that the stripe holds `end_bytes`: stripes
/// go round-robin in units of `bs`, and a device's usable capacity is a whole number of them,
/// so each share is rounded up to whole `bs` (a share of 1.5 × bs held one bs, and two new
/// files of `--size 1m --bs 1m` held nothing).
fn stripe_share_bytes(end_bytes: u64, bs: u64, devices: u64) -> anyhow::Result<u64> {
    let blocks = end_bytes.div_ceil(bs).div_ceil(devices.max(1));
    blocks.checked_mul(bs).ok_or_else(|| {
        Unusable(format!("--size and --offset end at {end_bytes} bytes, larger than the device; accepted: up to the device's capacity"))
            .into()
    })
}

/// Every check of a raw command line that needs no device, made before anything is created or
/// written: a run without --device lays out its whole temporary pool file first.
fn validate_raw(cli: &Cli) -> anyhow::Result<()> {
    if !cli.bs.is_multiple_of(512) {
        return usage(format!(
            "--bs={} is not a multiple of 512 bytes; accepted: multiples of the device block size, e.g. 4k, 128k, 1m",
            cli.bs
        ));
    }
    if cli.bs > 64 << 20 {
        return usage(format!("--bs={} is above 64 MiB; accepted: 512 bytes to 64 MiB", format_size(cli.bs)));
    }
    if !cli.offset.is_multiple_of(cli.bs) {
        return usage(format!("--offset={} is not a multiple of --bs={}", cli.offset, cli.bs));
    }
    if cli.verify && cli.devices.iter().any(|spec| matches!(spec, DeviceSpec::EmuNull(_))) {
        return usage("--verify cannot check emu:null devices (they move no data); accepted: emu:PATH, emu:mem:SIZE, uring:PATH, vfio:BDF");
    }
    if cli.time_based && cli.runtime.is_none() {
        return usage("--time_based needs --runtime");
    }
    if cli.size.is_some_and(|size| size < cli.bs) {
        return usage(format!("--size={} is smaller than --bs={}", cli.size.unwrap_or(0), cli.bs));
    }
    // Without --device or --size the run gets the default temporary pool, never above
    // DEFAULT_POOL_BYTES_MAX: an --offset at or past that is refused before the directory is
    // even looked at (a smaller pool, for lack of free space, is checked in temporary_pool,
    // still before the file is created).
    // The run covers whole --bs blocks of it: 3 MiB blocks end at 1023 MiB.
    if cli.devices.is_empty() && cli.size.is_none() && cli.offset >= DEFAULT_POOL_BYTES_MAX / cli.bs * cli.bs {
        return usage(format!(
            "--offset={} is at or past the end of the last whole --bs={} block of the temporary pool file (at most {}: a tenth of the free space); accepted: a smaller --offset, or --size, or --device",
            cli.offset,
            format_size(cli.bs),
            format_size(DEFAULT_POOL_BYTES_MAX)
        ));
    }
    if cli.verify {
        if cli.runtime.is_some() {
            return usage("--verify makes one full pass (write, then read back) and does not stop at --runtime; drop --runtime");
        }
        if cli.rw == Pattern::Randrw {
            return usage("--verify works with --rw=read|write|randread|randwrite, not randrw");
        }
        if cli.time_based {
            return usage("--verify makes one full pass (write, then read back); drop --time_based");
        }
        if cli.number_ios.is_some() {
            return usage("--verify makes one full pass (write, then read back); drop --number_ios");
        }
    }
    // Memory devices are checked together: two emu:mem devices may fit one by one, not both.
    tutti_devices::check_memory(&cli.devices).map_err(|error| Unusable(error.to_string()))?;
    // And the I/O buffers beside them: every job opens a queue of --iodepth buffers of --bs on
    // every device (DMA memory, or aligned memory for uring:), allocated before the run starts.
    // Without --device the run has one device, the temporary pool file (no memory device).
    let devices = cli.devices.len().max(1);
    crate::memory::check_host_memory(
        &format!(
            "I/O buffers (--numjobs={} × {} device(s) × --iodepth={} × --bs={})",
            cli.numjobs,
            devices,
            cli.iodepth,
            format_size(cli.bs)
        ),
        crate::memory::raw_buffer_bytes(cli.numjobs, devices, cli.iodepth, cli.bs),
        &cli.devices,
        "a smaller --iodepth, --bs or --numjobs",
    )?;
    // So are files: the same file as two devices of a stripe would overwrite itself.
    tutti_devices::refuse_shared_files(&cli.devices).map_err(|error| Unusable(error.to_string()))?;
    Ok(())
}

fn run_raw(cli: &Cli, specs: &[DeviceSpec], created: &mut CreatedFiles) -> anyhow::Result<()> {
    // Checks that need no device were made by `validate_raw`, before anything was created.
    let writes = raw_writes(cli);
    let end_bytes = cli.size.map(|size| region_end(cli.offset, size)).transpose()?;
    let per_device_bytes = end_bytes.map(|end| stripe_share_bytes(end, cli.bs, specs.len() as u64)).transpose()?;
    let options = OpenOptions2 {
        writes,
        create_bytes: per_device_bytes,
        io_bytes_max: cli.bs,
        queues: cli.numjobs,
        lay_out: !writes,
        timing: cli.emu_timing,
        shadow_doorbells: cli.shadow_doorbells,
    };
    let mut devices: Vec<Arc<dyn Device>> = Vec::with_capacity(specs.len());
    for spec in specs {
        let device = devices::open(spec, options, created).map_err(|error| devices::open_error(error, &spec.to_string()))?;
        if u64::from(device.block_size_bytes()) > cli.bs || !cli.bs.is_multiple_of(u64::from(device.block_size_bytes())) {
            return usage(format!("--bs={} is not a multiple of {}'s {}-byte blocks", cli.bs, device.name(), device.block_size_bytes()));
        }
        devices.push(device);
    }
    let stripe_capacity = devices.iter().map(|device| device.capacity_bytes()).min().unwrap_or(0) / cli.bs * cli.bs;
    let capacity = stripe_capacity.saturating_mul(devices.len() as u64);
    if cli.offset >= capacity {
        return usage(format!("--offset={} is at or past the end of the device ({} bytes)", cli.offset, capacity));
    }
    let region_bytes = match (cli.size, end_bytes) {
        (Some(size), Some(end)) if end > capacity => {
            return usage(format!(
                "--size={} from --offset={} is larger than the device ({}, {} bytes); accepted: up to {} bytes",
                format_size(size),
                cli.offset,
                format_size(capacity),
                capacity,
                capacity - cli.offset
            ));
        }
        (Some(size), _) => size / cli.bs * cli.bs,
        (None, _) => (capacity - cli.offset) / cli.bs * cli.bs,
    };
    let seed = seed_from_clock();
    let (phases, headline) = plan_phases(cli, cli.offset, region_bytes, seed)?;
    let config = configuration(cli, &devices, region_bytes);
    if cli.output_format == OutputFormat::Normal {
        outln!("{}", config_text(&config))?;
    }
    let results = run_phases(&devices, cli.numjobs, &phases)?;
    match cli.output_format {
        OutputFormat::Normal => {
            for result in &results {
                outln!("{}", phase_text(result))?;
            }
        }
        OutputFormat::Json => {
            let output = json!({
                "tutti-bench version": env!("CARGO_PKG_VERSION"),
                "workload": "raw",
                "global options": config,
                "jobs": phase_json(&results[headline])["jobs"],
                "phases": results.iter().map(phase_json).collect::<Vec<_>>(),
            });
            outln!("{}", serde_json::to_string_pretty(&output)?)?;
        }
    }
    Ok(())
}

fn run_phases(devices: &[Arc<dyn Device>], numjobs: u32, phases: &[PhasePlan]) -> anyhow::Result<Vec<PhaseResult>> {
    let mut results = Vec::with_capacity(phases.len());
    for plan in phases {
        let progress = Arc::new(Progress::default());
        let total = (!plan.time_based || plan.number_ios.is_some()).then(|| {
            if let Some(ios) = plan.number_ios {
                ios.saturating_mul(plan.bs).saturating_mul(u64::from(numjobs))
            } else if plan.split_region {
                // The jobs' slices together cover every whole block of the region.
                plan.region_bytes / plan.bs * plan.bs
            } else {
                plan.region_bytes.saturating_mul(u64::from(numjobs))
            }
        });
        let result = with_progress(&plan.label, total, plan.runtime, &progress, || run_phase(devices, numjobs, plan, &progress))?;
        results.push(result);
    }
    Ok(results)
}

fn seed_from_clock() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0x0074_7574_7469, |elapsed| elapsed.as_nanos() as u64)
}

/// The full configuration, printed with the result (and written as fio's "global options").
fn configuration(cli: &Cli, devices: &[Arc<dyn Device>], region_bytes: u64) -> serde_json::Value {
    json!({
        "rw": cli.rw.name(),
        "bs": cli.bs,
        "iodepth": cli.iodepth,
        "numjobs": cli.numjobs,
        "size": region_bytes,
        "offset": cli.offset,
        // Milliseconds with a fraction (fio's unit; `as_millis` made 100us a 0), and the exact
        // microseconds --runtime is given in at the finest.
        "runtime_ms": cli.runtime.map(|runtime| runtime.as_micros() as f64 / 1000.0),
        "runtime_us": cli.runtime.map(|runtime| u64::try_from(runtime.as_micros()).unwrap_or(u64::MAX)),
        "time_based": cli.time_based,
        "number_ios": cli.number_ios,
        "rwmixread": (cli.rw == Pattern::Randrw).then_some(cli.rwmixread),
        "verify": cli.verify,
        "cpus_allowed": cli.cpus_allowed.as_ref().map(ToString::to_string),
        "executor": "cpu",
        "emu_timing": devices::timing_json(cli.emu_timing),
        "devices": devices.iter().map(|device| json!({"name": device.name(), "description": device.describe(), "capacity_bytes": device.capacity_bytes(), "io_uring_setup": device.ring_setup()})).collect::<Vec<_>>(),
        "striping": if devices.len() > 1 { format!("round-robin in units of bs across {} devices", devices.len()) } else { "none".into() },
    })
}

fn config_text(config: &serde_json::Value) -> String {
    let get = |key: &str| config.get(key).cloned().unwrap_or(serde_json::Value::Null);
    let mut lines = vec![format!(
        "tutti-bench: rw={} bs={} iodepth={} numjobs={} size={} offset={} runtime={} time_based={}{} verify={} executor={}{}",
        get("rw").as_str().unwrap_or("?"),
        format_size(get("bs").as_u64().unwrap_or(0)),
        get("iodepth"),
        get("numjobs"),
        format_size(get("size").as_u64().unwrap_or(0)),
        get("offset"),
        get("runtime_us").as_u64().map_or("none".to_string(), runtime_text),
        get("time_based"),
        get("number_ios").as_u64().map(|ios| format!(" number_ios={ios}")).unwrap_or_default(),
        get("verify"),
        get("executor").as_str().unwrap_or("?"),
        get("rwmixread").as_u64().map(|mix| format!(" rwmixread={mix}")).unwrap_or_default(),
    )];
    if let Some(devices) = config.get("devices").and_then(|devices| devices.as_array()) {
        for device in devices {
            lines.push(format!("  device {}: {}", device["name"].as_str().unwrap_or("?"), device["description"].as_str().unwrap_or("?")));
        }
    }
    lines.join("\n")
}

/// A runtime in whole milliseconds when it is one, else in microseconds (100us, not 0ms).
fn runtime_text(micros: u64) -> String {
    if micros.is_multiple_of(1000) {
        format!("{}ms", micros / 1000)
    } else {
        format!("{micros}us")
    }
}

/// What asked for a temporary pool of a given size, in the user's words.
struct WantedPool {
    /// As given: a raw run's `--size` (from its `--offset`), a kv run's prompt.
    named: String,
    /// What bounds it.
    accepted: &'static str,
}

impl WantedPool {
    fn of(cli: &Cli) -> Self {
        match cli.size {
            // The file holds --offset + --size: name both, not a --size of their sum.
            Some(size) if cli.offset > 0 => WantedPool {
                named: format!("--size={} from --offset={}", format_size(size), format_size(cli.offset)),
                accepted: "--offset + --size",
            },
            Some(size) => WantedPool { named: format!("--size={}", format_size(size)), accepted: "--size" },
            // Only the kv workload sizes a pool without --size (it refuses the raw options).
            None => WantedPool { named: format!("the KV pool of --prompt-tokens={}", cli.prompt_tokens), accepted: "a pool" },
        }
    }
}

/// A pool file in `directory` (default: the system temp directory, or `/var/tmp` when that is
/// tmpfs or ramfs, lacks room for the pool or cannot be written) sized for the free space.
struct TemporaryPool {
    path: PathBuf,
    bytes: u64,
    free_bytes: u64,
    /// The run's lock on it, taken on the descriptor that created it (None: the filesystem
    /// takes no flock; see [`lock_temporary_pool`]).
    lock: Option<nix::fcntl::Flock<std::fs::File>>,
    /// The file created (device, inode), from `fstat` on the descriptor that created it: what
    /// marks it as the run's own when no lock does.
    id: Option<(u64, u64)>,
}

/// Registers the temporary pool in `created`: removed unless kept, and held as the run's own
/// (locked, where its filesystem took the lock) to the end of the run, so that opening it does
/// not lock it again.
fn track_pool(pool: &mut TemporaryPool, created: &mut CreatedFiles) {
    created.push(pool.path.clone());
    created.hold(pool.path.clone(), pool.lock.take(), pool.id);
}

/// The run's lock on its temporary pool `path` (tuttid's: an exclusive `flock`), as `flock` on
/// the descriptor that created it answered. The file is this run's own and new (a random name,
/// `O_EXCL`, owner-only), so a filesystem that takes no `flock` (ENOLCK: NFS without a lock
/// manager; EOPNOTSUPP, EINVAL, EBADF) costs only the lock: the run goes on without it, said on
/// standard error, as runs did before they took one. Another process holding it already is a
/// failure (exit 1), nothing the user gave.
fn lock_temporary_pool(
    locked: Result<nix::fcntl::Flock<std::fs::File>, (std::fs::File, nix::errno::Errno)>,
    path: &Path,
) -> anyhow::Result<Option<nix::fcntl::Flock<std::fs::File>>> {
    match locked {
        Ok(lock) => Ok(Some(lock)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            Err(anyhow::anyhow!("{}: another process locked the pool file as this run created it", path.display()))
        }
        Err((_, errno)) => {
            tutti_cli::errln!(
                "tutti-bench: warning: the pool file {} cannot be locked ({errno}: its filesystem takes no flock); it is this run's own new file and is used unlocked, so tuttid or `tutti pool` would not see it in use",
                path.display()
            );
            Ok(None)
        }
    }
}

fn free_bytes(directory: &Path) -> anyhow::Result<u64> {
    // statvfs through std's metadata is not available; ask the filesystem via libc (safe wrapper
    // in the uring module, which holds this binary's unsafe code).
    crate::uring::statvfs_free_bytes(directory)
        .map_err(|error| Unusable(format!("{}: cannot read free space: {error}", directory.display())).into())
}

/// The free space a directory needs for the temporary pool below not to be refused for lack of
/// it: `wanted` bytes (rounded up to pages, as checked there), or the default pool's minimum.
fn needed_free(wanted: Option<u64>) -> u64 {
    match wanted {
        Some(wanted) => wanted.div_ceil(4096).saturating_mul(4096),
        None => DEFAULT_POOL_BYTES_MIN * DEFAULT_POOL_FREE_DIVISOR,
    }
}

/// A raw run's `offset` at or past the pool's last whole block of `block_bytes` (its --bs; 1 for
/// a run that covers no such blocks) is refused before the file is created.
fn temporary_pool(
    directory: Option<&Path>,
    wanted_bytes: Option<(u64, WantedPool)>,
    offset: u64,
    block_bytes: u64,
    lay_out: bool,
) -> anyhow::Result<TemporaryPool> {
    let directory = match directory {
        Some(directory) => {
            // The user's choice is kept, and said plainly: its figures are memory's.
            if let Ok(Some(kind)) = crate::filesystems::memory_filesystem(directory) {
                tutti_cli::errln!(
                    "tutti-bench: warning: --directory {} is {kind}: the pool file is in memory, not on a disk, and the figures are memory's",
                    directory.display()
                );
            }
            directory.to_path_buf()
        }
        // The system temp directory is tmpfs on several distributions: a disk instead.
        // One with room for the pool, where one has it (`needed_free`).
        None => crate::filesystems::choose_default_directory(
            &crate::filesystems::default_directory_candidates(),
            crate::filesystems::memory_filesystem,
            crate::filesystems::writable_free_bytes,
            needed_free(wanted_bytes.as_ref().map(|(wanted, _)| *wanted)),
        )
        .map_err(Unusable)?,
    };
    let free = free_bytes(&directory)?;
    let fitting = (free / DEFAULT_POOL_FREE_DIVISOR).min(DEFAULT_POOL_BYTES_MAX) / (1 << 20) * (1 << 20);
    let bytes = match wanted_bytes {
        Some((wanted, what)) if wanted.div_ceil(4096).checked_mul(4096).is_none_or(|bytes| bytes > free) => {
            return usage(format!(
                "{} needs a pool file of {}, which does not fit the {} free in {}; accepted: {} up to {}, or --directory DIR with more space",
                what.named,
                format_size(wanted),
                format_size(free),
                directory.display(),
                what.accepted,
                format_size(free)
            ));
        }
        Some((wanted, _)) => wanted.div_ceil(1 << 20) * (1 << 20),
        None if fitting < DEFAULT_POOL_BYTES_MIN => {
            return usage(format!(
                "only {} free in {}: the default pool needs {} (a tenth of the free space, at least {}); free some space or pass --directory DIR",
                format_size(free),
                directory.display(),
                format_size(DEFAULT_POOL_BYTES_MIN * DEFAULT_POOL_FREE_DIVISOR),
                format_size(DEFAULT_POOL_BYTES_MIN)
            ));
        }
        None => fitting,
    };
    // Refused before the file is created and laid out (up to 1 GiB written and fsynced). A raw
    // run covers whole --bs blocks (`run_raw`): an --offset in the tail past the last one would
    // be refused there, after the lay-out.
    let whole_blocks_bytes = bytes / block_bytes.max(1) * block_bytes.max(1);
    if offset >= whole_blocks_bytes {
        return usage(format!(
            "--offset={offset} is at or past the end of the last whole --bs={} block of the temporary pool file ({}, {} of it in whole blocks; sized from the {} free in {}); accepted: a smaller --offset, or --size, or --device",
            format_size(block_bytes),
            format_size(bytes),
            format_size(whole_blocks_bytes),
            format_size(free),
            directory.display()
        ));
    }
    let file = tempfile::Builder::new().prefix("tutti-bench-pool-").suffix(".img").tempfile_in(&directory).map_err(|error| {
        Unusable(format!("cannot create a pool file in {}: {error}; pass --directory DIR with a writable directory", directory.display()))
    })?;
    let (file, path) = file.keep().map_err(|error| anyhow::anyhow!("cannot keep the pool file: {error}"))?;
    crate::uring::remove_on_interrupt(&path);
    let id = file.metadata().ok().map(|metadata| (metadata.dev(), metadata.ino()));
    // Locked before a byte is written, on this descriptor (open for writing: NFS emulates flock
    // with POSIX locks, where an exclusive lock on a read-only descriptor fails with EBADF), and
    // held by the run to its end (`track_pool`), so that opening it takes no second lock.
    let locked = file
        .try_clone()
        .map_err(|source| anyhow::Error::new(source).context(format!("duplicating the descriptor of {} to lock it", path.display())))
        .and_then(|clone| lock_temporary_pool(nix::fcntl::Flock::lock(clone, nix::fcntl::FlockArg::LockExclusiveNonblock), &path));
    let lock = match locked {
        Ok(lock) => lock,
        Err(error) => {
            let _ = std::fs::remove_file(&path);
            return Err(error);
        }
    };
    let sized = if lay_out { devices::lay_out(&file, bytes) } else { file.set_len(bytes) };
    if let Err(error) = sized {
        let _ = std::fs::remove_file(&path);
        return usage(format!(
            "cannot {} the pool file {} to {}: {error}",
            if lay_out { "lay out" } else { "size" },
            path.display(),
            format_size(bytes)
        ));
    }
    Ok(TemporaryPool { path, bytes, free_bytes: free, lock, id })
}

/// The default run's request: Llama-3.1-8B, 16-token blocks, up to this many prompt tokens
/// (512 MiB of KV), fewer when the pool is smaller.
const DEFAULT_PROMPT_TOKENS_MAX: u64 = 4096;

/// The embedded default: what `cargo run --release --bin tutti-bench` does on a fresh machine.
/// Where a run says what it is about: standard output, or standard error when standard output
/// holds only the JSON.
pub fn narrator(format: OutputFormat) -> impl Fn(String) -> anyhow::Result<()> {
    move |text: String| {
        if format == OutputFormat::Json {
            tutti_cli::errln!("{text}");
        } else {
            outln!("{text}")?;
        }
        Ok(())
    }
}

/// With `--output-format=json` standard output holds only the JSON; what the run is about goes
/// to standard error.
pub fn default_run(cli: &Cli, matches: &ArgMatches) -> anyhow::Result<()> {
    let started = Instant::now();
    let say = narrator(cli.output_format);
    let mut pool = temporary_pool(cli.directory.as_deref(), None, 0, 1, false)?;
    let mut created = CreatedFiles::default();
    track_pool(&mut pool, &mut created);
    if cli.keep {
        created.keep();
    }
    say(format!(
        "tutti-bench: no workload options: running the embedded default on a temporary pool file {} of {} ({} free there; a pool takes min(1 GiB, 10% of free space)), the software NVMe controller (nvme-emu) and the CPU executor.",
        pool.path.display(),
        format_size(pool.bytes),
        format_size(pool.free_bytes)
    ))?;
    let result = default_kv(&pool, cli, matches, &say, &mut created);
    if cli.keep {
        // Finished: an interrupt while the last lines are written no longer removes it.
        created.keep_after_success();
    }
    // Removed now, so that the line below says what happened: a removal that failed (a
    // read-only directory, EIO) names the file and why instead of calling it removed.
    let fate = match created.remove_now().into_iter().next() {
        _ if cli.keep => "kept (--keep)".to_string(),
        None => "removed".to_string(),
        Some((_, error)) => format!("NOT removed ({error})"),
    };
    drop(created);
    match &result {
        Ok(()) => say(format!("tutti-bench: done in {:.1}s; pool file {} {fate}.", started.elapsed().as_secs_f64(), pool.path.display()))?,
        Err(_) => {
            tutti_cli::errln!("tutti-bench: pool file {} {fate}.", pool.path.display());
        }
    }
    result
}

/// The default run's KV workload: store a prompt's KV cache layer by layer, retrieve it layer by
/// layer into cleared engine memory, compare every byte.
fn default_kv(
    pool: &TemporaryPool,
    cli: &Cli,
    matches: &ArgMatches,
    say: &dyn Fn(String) -> anyhow::Result<()>,
    created: &mut CreatedFiles,
) -> anyhow::Result<()> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let plan = default_plan(cli, pool.bytes, &meminfo)?;
    say(format!(
        "Workload: KV store + retrieve through the object store's layer API: a {}-token prompt of {} ({} blocks of {} tokens, {} of KV) stored layer by layer, \
         then looked up and retrieved layer by layer into cleared engine memory and compared byte for byte (equivalent to: {}).",
        plan.prompt_tokens,
        plan.model.name,
        plan.blocks(),
        plan.block_tokens(),
        format_size(plan.blocks() * plan.geometry().block_bytes()),
        equivalent_command(&plan, matches, pool.path.parent().unwrap_or(Path::new(".")))
    ))?;
    crate::kv::run_plan(&[DeviceSpec::EmuFile(pool.path.clone())], &plan, cli.output_format, created)
}

/// The kv command line that runs what the default run does with `plan` (`matches`: the default
/// run's own command line; `pool_directory`: where its pool file lies).
fn equivalent_command(plan: &crate::kv::KvPlan, matches: &ArgMatches, pool_directory: &Path) -> String {
    let mut command = format!(
        "tutti-bench --workload=kv --model={} --prompt-tokens={} --tokens-per-block={} --hit-rate=1 --verify",
        plan.model.name,
        plan.prompt_tokens,
        plan.block_tokens()
    );
    // The timing model as given (not re-spelled from the parsed figures, which round): without
    // it the command runs at full speed, up to 32x off the figures of this run.
    if let Some(timing) = matches.get_raw("emu_timing").and_then(|mut values| values.next()) {
        command.push_str(&format!(" --emu-timing={}", shell_word(&timing.to_string_lossy())));
    }
    // The directory the pool file lies in: as given, or the default one this run chose. Without
    // it the command's pool goes to the default directory (a disk), not where this run measured
    // (/dev/shm, a slow disk); and that default is chosen by the room the command's own smaller
    // pool needs, so it could be the /tmp this run passed over for /var/tmp.
    let directory = match matches.get_raw("directory").and_then(|mut values| values.next()) {
        Some(given) => given.to_string_lossy().into_owned(),
        None => pool_directory.to_string_lossy().into_owned(),
    };
    command.push_str(&format!(" --directory={}", shell_word(&directory)));
    command
}

/// `text` as one shell word: as it is when it holds nothing a shell treats specially, in
/// single quotes otherwise.
fn shell_word(text: &str) -> String {
    if !text.is_empty() && text.chars().all(|c| c.is_ascii_alphanumeric() || "=,.:_-+/".contains(c)) {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// The default run's plan: up to [`DEFAULT_PROMPT_TOKENS_MAX`] tokens, fewer until the pool
/// file of `pool_bytes` holds them and their engine KV memory (allocated up front, populated)
/// fits what `meminfo` (the text of /proc/meminfo; without `MemAvailable`, anything) says can be
/// spared, as `--workload=kv` checks; refused (exit 2) when not even one block fits.
fn default_plan(cli: &Cli, pool_bytes: u64, meminfo: &str) -> anyhow::Result<crate::kv::KvPlan> {
    let model = tutti_cli::GeometryArgs::default()
        .resolve(Some(tutti_cli::geometry::DEFAULT_MODEL))
        .map_err(|error| anyhow::anyhow!("the default model: {error}"))?;
    let mut plan = crate::kv::KvPlan {
        model,
        prompt_tokens: DEFAULT_PROMPT_TOKENS_MAX,
        hit_rate: 1.0,
        verify: true,
        pool: crate::kv::PoolMode::Format,
        seed: cli.seed,
        emu_timing: cli.emu_timing,
        layers_in_flight: cli.layers_in_flight,
        blocks_per_slot: cli.blocks_per_slot,
    };
    // The pool file is an emu: file, not a memory device: only the engine memory counts.
    let engine_fits = |plan: &crate::kv::KvPlan| memory_shortfall(crate::kv::engine_memory(plan, 1).1, &[], meminfo).is_none();
    while (plan.pool_bytes_per_device(1) > pool_bytes || !engine_fits(&plan)) && plan.prompt_tokens > plan.block_tokens() {
        plan.prompt_tokens -= plan.block_tokens();
    }
    if plan.pool_bytes_per_device(1) > pool_bytes {
        return usage(format!(
            "the pool file of {} cannot hold one KV block of {}; free some space or pass --directory DIR",
            format_size(pool_bytes),
            plan.model.name
        ));
    }
    let (what, bytes) = crate::kv::engine_memory(&plan, 1);
    crate::memory::check_host_memory_with(&what, bytes, &[], "more available memory (the default run needs one block)", meminfo)?;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn a_device_file_that_cannot_be_opened_is_unusable_input_by_its_errno() {
        // Goal: a device path that cannot be opened to lock it (here ENOTDIR and ELOOP) is
        // unusable input (exit 2), told by the error's type and errno, not by the words of its
        // context; an errno that says the host failed (EIO) is not.
        let directory = tempfile::tempdir().unwrap();
        let file = directory.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let looping = directory.path().join("loop");
        std::os::unix::fs::symlink(&looping, &looping).unwrap();
        for path in [file.join("under-a-file"), looping] {
            let error = lock_devices(&[DeviceSpec::EmuFile(path.clone())], directory.path(), FileModes::Narrow).unwrap_err();
            assert!(error.downcast_ref::<Unusable>().is_some(), "{}: not status 2: {error:#}", path.display());
        }
        let failed = tutti_devices::DeviceError::OpenFailed { path: file.clone(), source: std::io::Error::from_raw_os_error(libc::EIO) };
        let error = lock_refusal(&DeviceSpec::EmuFile(file), failed);
        assert!(error.downcast_ref::<Unusable>().is_none(), "EIO made status 2: {error:#}");
        // A vfio: lock directory this user may not make is what was given; one the host failed
        // to make is not.
        let vfio = DeviceSpec::Vfio("0000:00:04.0".parse().unwrap());
        let io = |errno: i32| tutti_devices::DeviceError::Io {
            context: "making the lock directory".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        assert!(lock_refusal(&vfio, io(libc::EACCES)).downcast_ref::<Unusable>().is_some());
        let error = lock_refusal(&vfio, io(libc::EIO));
        assert!(error.downcast_ref::<Unusable>().is_none(), "EIO on a vfio: lock made status 2: {error:#}");
    }

    /// Opens the 1 MiB temporary pool `pool` for writing as a run does (prepare_file), noting it
    /// in `created`; fails the test with `what` if it is refused.
    fn open_temporary_pool(pool: &TemporaryPool, created: &mut CreatedFiles, what: &str) {
        let options = OpenOptions2 {
            writes: true,
            create_bytes: Some(1 << 20),
            io_bytes_max: 4096,
            queues: 1,
            timing: None,
            lay_out: false,
            shadow_doorbells: false,
        };
        devices::prepare_file(&DeviceSpec::EmuFile(pool.path.clone()), options, created).expect(what);
    }

    #[test]
    fn the_temporary_pool_is_locked_as_created_and_opened_as_held() {
        // Goal: the run's temporary pool (the default run's, and a run's without --device) is
        // locked on the descriptor that created it, before a byte is written, and held to the
        // end: opening it then takes no second lock. Locked later through a read-only
        // descriptor, as an existing file is, NFS's emulated flock refused it (EBADF), so the
        // README's first command failed there with exit 2.
        let directory = tempfile::tempdir().unwrap();
        let cli = Cli::try_parse_from(["tutti-bench"]).unwrap();
        let mut pool = temporary_pool(Some(directory.path()), Some((1 << 20, WantedPool::of(&cli))), 0, 1, false).unwrap();
        let mut created = CreatedFiles::default();
        track_pool(&mut pool, &mut created);
        let probe = std::fs::File::open(&pool.path).unwrap();
        assert!(
            nix::fcntl::Flock::lock(probe, nix::fcntl::FlockArg::LockExclusiveNonblock).is_err(),
            "the temporary pool is not locked before it is opened"
        );
        open_temporary_pool(&pool, &mut created, "the run's own pool");
        drop(created);
        assert!(!pool.path.exists(), "the temporary pool was left");
    }

    #[test]
    fn an_offset_past_the_temporary_pools_last_whole_block_is_refused_before_it_is_created() {
        // Goal: a raw run covers whole --bs blocks; a 10 MiB pool holds two of 4 MiB, so an
        // --offset of 8 MiB starts past them. It is refused before the file is created, not by
        // the run after the pool was laid out; 4 MiB, in the second block, is kept.
        let directory = tempfile::tempdir().unwrap();
        let cli = Cli::try_parse_from(["tutti-bench"]).unwrap();
        let error =
            temporary_pool(Some(directory.path()), Some((10 << 20, WantedPool::of(&cli))), 8 << 20, 4 << 20, true).map(|_| ()).unwrap_err();
        assert!(error.downcast_ref::<Unusable>().is_some(), "status 1: {error:#}");
        assert!(error.to_string().contains("--offset") && error.to_string().contains("--bs"), "{error:#}");
        assert_eq!(std::fs::read_dir(directory.path()).unwrap().count(), 0, "a file was created: {error:#}");
        let mut pool = temporary_pool(Some(directory.path()), Some((10 << 20, WantedPool::of(&cli))), 4 << 20, 4 << 20, false).unwrap();
        let mut created = CreatedFiles::default();
        track_pool(&mut pool, &mut created);
    }

    #[test]
    fn a_temporary_pool_the_filesystem_cannot_lock_is_used_unlocked() {
        // Goal: the temporary pool is this run's own new file (a random name, created with
        // O_EXCL, owner-only): where its filesystem takes no flock (ENOLCK: NFS without a lock
        // manager; EOPNOTSUPP, EINVAL, EBADF), the run goes on without the lock, as it did
        // before it took one, instead of refusing the README's first command. One another
        // process locked at once is a failure (1), not something the user gave (2).
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("pool.img");
        for errno in [nix::errno::Errno::ENOLCK, nix::errno::Errno::EOPNOTSUPP, nix::errno::Errno::EINVAL, nix::errno::Errno::EBADF] {
            let file = std::fs::File::create(&path).unwrap();
            let lock = lock_temporary_pool(Err((file, errno)), &path).unwrap_or_else(|error| panic!("{errno}: {error:#}"));
            assert!(lock.is_none());
        }
        let file = std::fs::File::create(&path).unwrap();
        let error = lock_temporary_pool(Err((file, nix::errno::Errno::EWOULDBLOCK)), &path).unwrap_err();
        assert!(error.downcast_ref::<Unusable>().is_none(), "status 2: {error:#}");
        let file = std::fs::File::create(&path).unwrap();
        let lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock);
        assert!(lock_temporary_pool(lock, &path).unwrap().is_some());
    }

    #[test]
    fn a_temporary_pool_left_unlocked_is_opened_without_a_second_lock() {
        // Goal: a temporary pool whose filesystem took no flock (lock_temporary_pool's None) is
        // still the run's own: opening it must not lock it again, or that second lock fails as
        // the first did (ENOLCK on NFS without a lock manager) and the README's first command
        // exits 1 after saying the pool is used unlocked. The flock the filesystem refuses is
        // stood in for by another descriptor's, which any second lock would be refused by.
        let directory = tempfile::tempdir().unwrap();
        let cli = Cli::try_parse_from(["tutti-bench"]).unwrap();
        let mut pool = temporary_pool(Some(directory.path()), Some((1 << 20, WantedPool::of(&cli))), 0, 1, false).unwrap();
        pool.lock = None;
        let other = std::fs::OpenOptions::new().read(true).write(true).open(&pool.path).unwrap();
        let _other = nix::fcntl::Flock::lock(other, nix::fcntl::FlockArg::LockExclusiveNonblock).unwrap();
        let mut created = CreatedFiles::default();
        track_pool(&mut pool, &mut created);
        open_temporary_pool(&pool, &mut created, "the run's own unlocked pool was locked again");
        drop(created);
        assert!(!pool.path.exists(), "the temporary pool was left");
    }

    #[test]
    fn the_default_runs_equivalent_command_keeps_its_timing_model() {
        // Goal: --emu-timing keeps the default run (it is not a workload option), which applies
        // the model; the kv command it prints as equivalent must too, or running that measures
        // at full speed, up to 32x off the figures it claims to reproduce.
        let plenty = "MemTotal: 64000000 kB\nMemAvailable: 60000000 kB\n";
        for (arguments, timing) in [
            (&["tutti-bench", "--emu-timing=tutti-ssd:x1"][..], Some("--emu-timing=tutti-ssd:x1")),
            (
                &["tutti-bench", "--emu-timing", "read=16m,write=32m,mixed=0.5,latency=1ms"][..],
                Some("--emu-timing=read=16m,write=32m,mixed=0.5,latency=1ms"),
            ),
            (&["tutti-bench"][..], None),
        ] {
            let matches = <Cli as clap::CommandFactory>::command().try_get_matches_from(arguments).unwrap();
            let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap();
            assert_eq!(crate::args::select_workload(&matches, &cli), Selected::Default, "{arguments:?}");
            let plan = default_plan(&cli, 1 << 30, plenty).unwrap();
            let command = equivalent_command(&plan, &matches, Path::new("/tmp"));
            assert!(command.starts_with("tutti-bench --workload=kv --model=llama3-8b --prompt-tokens=4096"), "{command}");
            match timing {
                Some(timing) => assert!(command.contains(&format!(" {timing}")), "{arguments:?}: {command}"),
                None => assert!(!command.contains("--emu-timing"), "{command}"),
            }
        }
    }

    #[test]
    fn the_default_runs_equivalent_command_keeps_its_directory() {
        // Goal: --directory keeps the default run, whose pool file lies there (memory, with
        // /dev/shm); the kv command it prints as equivalent must put its pool there too, or
        // running that measures the default directory's disk instead, an order of magnitude off.
        let plenty = "MemTotal: 64000000 kB\nMemAvailable: 60000000 kB\n";
        for (arguments, directory) in [
            (&["tutti-bench", "--directory", "/tmp/x y"][..], "--directory='/tmp/x y'"),
            (&["tutti-bench", "--directory=/dev/shm", "--emu-timing=tutti-ssd:x1"][..], "--directory=/dev/shm"),
        ] {
            let matches = <Cli as clap::CommandFactory>::command().try_get_matches_from(arguments).unwrap();
            let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap();
            assert_eq!(crate::args::select_workload(&matches, &cli), Selected::Default, "{arguments:?}");
            let plan = default_plan(&cli, 1 << 30, plenty).unwrap();
            let command = equivalent_command(&plan, &matches, Path::new("/elsewhere"));
            assert!(command.contains(&format!(" {directory}")), "{arguments:?}: {command}");
            assert_eq!(command.matches("--directory").count(), 1, "{command}");
        }
    }

    #[test]
    fn the_default_runs_equivalent_command_names_the_directory_its_pool_went_to() {
        // Goal: without --directory the default run's pool goes to the first default directory
        // with room for 640 MiB free (/var/tmp when /tmp is memory, small or not writable); the
        // kv command picks its own by the room its smaller pool needs, so without --directory it
        // could run on the /tmp this run passed over. The command names the directory used.
        let plenty = "MemTotal: 64000000 kB\nMemAvailable: 60000000 kB\n";
        let matches = <Cli as clap::CommandFactory>::command().try_get_matches_from(["tutti-bench"]).unwrap();
        let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap();
        let plan = default_plan(&cli, 1 << 30, plenty).unwrap();
        for (pool_directory, directory) in [("/var/tmp", "--directory=/var/tmp"), ("/home/a b", "--directory='/home/a b'")] {
            let command = equivalent_command(&plan, &matches, Path::new(pool_directory));
            assert!(command.ends_with(&format!(" {directory}")), "{pool_directory}: {command}");
        }
    }

    #[test]
    fn the_default_plan_fits_the_engine_memory_the_host_can_spare() {
        // Goal: the no-argument run allocates (and populates) the engine KV memory of its prompt
        // before it starts; on a host with 300 MiB available (44 MiB to spare past the 256 MiB
        // reserve) it shrinks the prompt until that memory fits, as --workload=kv refuses a plan
        // that does not, instead of being OOM-killed with the pool file left behind; with too
        // little for one block it is refused (exit 2). A 1 GiB pool alone allows 4096 tokens.
        let cli = Cli::try_parse_from(["tutti-bench"]).unwrap();
        let pool_bytes = 1 << 30;
        let plenty = "MemTotal: 64000000 kB\nMemAvailable: 60000000 kB\n";
        assert_eq!(default_plan(&cli, pool_bytes, plenty).unwrap().prompt_tokens, DEFAULT_PROMPT_TOKENS_MAX);
        let small = "MemTotal: 1000000 kB\nMemAvailable: 307200 kB\n";
        let plan = default_plan(&cli, pool_bytes, small).unwrap();
        let (_, engine_bytes) = crate::kv::engine_memory(&plan, 1);
        assert!(plan.blocks() >= 1 && engine_bytes <= 44 << 20, "{} tokens: {engine_bytes} bytes of engine memory", plan.prompt_tokens);
        assert_eq!(plan.prompt_tokens, 352, "the largest prompt that fits");
        let tiny = "MemTotal: 1000000 kB\nMemAvailable: 262144 kB\n";
        let error = default_plan(&cli, pool_bytes, tiny).unwrap_err();
        assert!(error.downcast_ref::<Unusable>().is_some(), "{error:#}");
        assert!(error.to_string().contains("engine KV memory"), "{error:#}");
    }
}
