//! Devices the benchmark drives, behind two small traits: a [`Device`] opened once, and one
//! [`IoQueue`] per job and device (a thread's own NVMe queue pair or io_uring instance), with
//! `depth` fixed buffers allocated when the queue is opened — nothing is allocated per I/O.
//!
//! - `emu:` and `vfio:` go through `nvme-driver` (the software controller or a VFIO function);
//! - `uring:` is the kernel path (see [`crate::uring`]).

use std::fs::OpenOptions;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::{Controller, ControllerConfig, DataSegment, DmaRegion, IoQueuePair, Lba, NamespaceId, NvmeError};
use nvme_emu::{EmuConfig, EmuDevice, NamespaceConfig};
use tutti_devices::open::EmuOptions;
use tutti_devices::{open_in_one_space, OpenedDevice};

use crate::args::{format_size, DeviceSpec};

/// How long one I/O may take before the run fails (a stuck device, not a slow one).
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a wait may be bounded by at most, whatever a timing model says ([`wait_bound`]).
pub const WAIT_BOUND_MAX: Duration = Duration::from_secs(24 * 3600);

/// How many times what a timing model makes the queued bytes take a wait is bounded by: the
/// model only holds completions back, so this machine's own pace (the controller's copies, on
/// cores it shares with the jobs) comes on top, and a bound a device that keeps to the model
/// never reaches still catches one that stopped.
const WAIT_BOUND_MODEL_FACTOR: f64 = 4.0;

/// The bound of a wait for `bytes` of transfers queued on a software controller that runs
/// `timing`, whose bound without a model is `default`: [`WAIT_BOUND_MODEL_FACTOR`] times what
/// the model makes those bytes take at the pace of what the run moves (`traffic`: one direction
/// alone at its solo rate; both at the slower one's share under mixed traffic, the model's
/// collapse: each direction is a FIFO pipe, so the last of the bytes completes after all of
/// them flowed) plus one command latency; never below `default`, never past
/// [`WAIT_BOUND_MAX`]. Derived rather than refused: a slow model is a valid run (the model
/// stands for an SSD; `tutti-ssd` is one in slow motion), and its I/Os take what the model
/// says, which no fixed figure fits.
pub fn wait_bound(default: Duration, timing: Option<nvme_emu::TimingModel>, traffic: Traffic, bytes: u64) -> Duration {
    let Some(timing) = timing else { return default };
    let bytes_per_s = match traffic {
        Traffic::Reads => timing.read_bytes_per_s.max(1) as f64,
        Traffic::Writes => timing.write_bytes_per_s.max(1) as f64,
        Traffic::Both => {
            let share = f64::from(timing.mixed_share_permille.clamp(1, 1000)) / 1000.0;
            timing.read_bytes_per_s.min(timing.write_bytes_per_s).max(1) as f64 * share
        }
    };
    let model_s = bytes as f64 / bytes_per_s.max(f64::MIN_POSITIVE) + timing.command_latency.as_secs_f64();
    let bound = Duration::try_from_secs_f64(WAIT_BOUND_MODEL_FACTOR * model_s).unwrap_or(WAIT_BOUND_MAX);
    bound.min(WAIT_BOUND_MAX).max(default)
}

/// The directions a run moves through a device while a wait is bounded ([`wait_bound`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Traffic {
    /// Reads alone (a raw run's read or randread phase, a kv retrieve).
    Reads,
    /// Writes alone (a raw run's write or randwrite phase, a kv store).
    Writes,
    /// Both at once (randrw with a mix of both, the serve mode's runtime).
    Both,
}

impl Traffic {
    /// What a raw phase of `pattern` moves (`rwmixread`: randrw's percentage of reads).
    pub fn of(pattern: crate::args::Pattern, rwmixread: u8) -> Traffic {
        use crate::args::Pattern;
        match pattern {
            Pattern::Read | Pattern::Randread => Traffic::Reads,
            Pattern::Write | Pattern::Randwrite => Traffic::Writes,
            Pattern::Randrw if rwmixread >= 100 => Traffic::Reads,
            Pattern::Randrw if rwmixread == 0 => Traffic::Writes,
            Pattern::Randrw => Traffic::Both,
        }
    }
}

/// Waiting on the software controller, a thread of this process, which a waiter that keeps the
/// CPU starves on a small machine: WAIT_SPIN_POLLS polls with a spin hint between them, then a
/// yield per poll. Not a sleep: a sleep left completions unreaped for the sleep and the timer
/// slack (50 µs), and the queue ran short (4 KiB random reads at QD 32: ~0.83 of fio's IOPS
/// sleeping, ~0.93 yielding, three interleaved 5 s runs on a quiet machine, 2026-11-24).
const WAIT_SPIN_POLLS: u32 = 256;
/// Polls between two clock reads of a wait (its deadline): a clock read costs more than a poll,
/// and under an emulated CPU (the TCG guest of tools/vm-bench.sh) far more.
const WAIT_POLLS_PER_CLOCK_READ: u32 = 1024;
/// Polls between two yields of a loop that polls devices in turn ([`IoQueue::pace_idle_poll`]).
const IDLE_POLLS_PER_YIELD: u32 = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Read,
    Write,
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("{device}: {source}")]
    Nvme { device: String, source: NvmeError },
    #[error("{device}: {context}: {source}")]
    Io { device: String, context: String, source: std::io::Error },
    #[error("{device}: {direction:?} at byte offset {offset_bytes} failed: {reason}")]
    Command { device: String, direction: Direction, offset_bytes: u64, reason: String },
    #[error("{device}: no completion within {timeout_s} s ({in_flight} I/Os in flight)")]
    Timeout { device: String, timeout_s: u64, in_flight: usize },
    /// The submission queue is full: reap and retry (not a failure).
    #[error("{device}: submission queue full")]
    Backpressure { device: String },
    #[error("{device}: completion names slot {slot}, which has no I/O in flight")]
    UnexpectedCompletion { device: String, slot: u64 },
    #[error("{0}")]
    Setup(String),
    /// A device string or set the run cannot use (exit status 2).
    #[error(transparent)]
    Spec(#[from] tutti_devices::DeviceError),
}

/// One device, opened once and shared by the jobs.
pub trait Device: Send + Sync {
    fn name(&self) -> String;
    /// A sentence about what is under this name (for the printed configuration).
    fn describe(&self) -> String;
    fn capacity_bytes(&self) -> u64;
    /// Smallest I/O unit: offsets and sizes must be multiples of it.
    fn block_size_bytes(&self) -> u32;
    /// A queue for one job thread with `depth` buffers of `slot_bytes` each.
    /// `traffic`: what the run's jobs move through the device meanwhile (its I/Os' pace under a
    /// timing model, [`wait_bound`]).
    fn open_queue(&self, depth: u32, slot_bytes: usize, traffic: Traffic) -> Result<Box<dyn IoQueue>, DeviceError>;
    /// The io_uring setup flags in force, for devices that drive a ring of their own (`uring:`).
    fn ring_setup(&self) -> Option<String> {
        None
    }
}

/// What [`IoQueue::queue`] did for the device's sight of the I/O: the job loop reads its clock
/// once per publish and stamps the I/Os it made visible, so that each I/O's clat runs from when
/// the device could start on it (not from after the whole refill) and no I/O costs a clock read
/// of its own on a queue that publishes per batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visibility {
    /// Queued, not yet visible: a later `queue` or `submit_and_reap` publishes it.
    Queued,
    /// This I/O and every one queued before it on this queue are visible to the device now.
    Published,
}

/// A job's queue on one device. Slots `0..depth` each own one buffer; a slot is queued at most
/// once until its completion was handed to `on_done`.
pub trait IoQueue: Send {
    /// Queues an I/O of the slot's whole buffer at `offset_bytes`, saying whether that made it
    /// (and what was queued before it) visible to the device.
    fn queue(&mut self, slot: u32, direction: Direction, offset_bytes: u64) -> Result<Visibility, DeviceError>;
    /// Makes queued I/Os visible to the device and reaps what completed; with `wait`, blocks until
    /// at least one I/O completed or `deadline` passed (then [`DeviceError::Timeout`]).
    fn submit_and_reap(
        &mut self,
        wait: bool,
        deadline: Instant,
        on_done: &mut dyn FnMut(u32, Result<(), DeviceError>),
    ) -> Result<usize, DeviceError>;
    /// Copies `source` into the slot's buffer (only while the slot is idle).
    fn write_buffer(&mut self, slot: u32, source: &[u8]) -> Result<(), DeviceError>;
    /// Copies the slot's buffer out (only while the slot is idle).
    fn read_buffer(&self, slot: u32, destination: &mut [u8]) -> Result<(), DeviceError>;
    /// Makes the slot's next write unlike its last (only while the slot is idle): `stamp` +
    /// the chunk's offset goes into the first 8 bytes of every [`STAMP_CHUNK_BYTES`] of the
    /// buffer, as fio's default `scramble_buffers` stamps each I/O, so that blocks written from
    /// one buffer do not deduplicate. One 8-byte store per 4 KiB.
    fn stamp_buffer(&mut self, slot: u32, stamp: u64) -> Result<(), DeviceError>;
    /// Waits for everything in flight (bounded), discarding results: used before tearing down.
    fn drain(&mut self, deadline: Instant);
    /// How long the job waits for this queue's next completion before it calls the device
    /// stuck ([`DeviceError::Timeout`]).
    fn io_timeout(&self) -> Duration {
        IO_TIMEOUT
    }
    /// Paces a loop that polls this queue without waiting on it (several devices polled in
    /// turn), after its `polls`-th poll in a row that completed nothing. By default a spin hint,
    /// and a yield every [`IDLE_POLLS_PER_YIELD`] polls.
    fn pace_idle_poll(&self, polls: u32) {
        spin_then_yield(polls);
    }
}

/// The default pacing of an idle poll: a spin hint, and every [`IDLE_POLLS_PER_YIELD`] polls a
/// yield (a software controller may be a thread of this process, on the same cores).
fn spin_then_yield(polls: u32) {
    if polls.is_multiple_of(IDLE_POLLS_PER_YIELD) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// What opening a device needs to know about the run.
#[derive(Debug, Clone, Copy)]
pub struct OpenOptions2 {
    /// The run writes: open files read-write.
    pub writes: bool,
    /// Bytes a missing file is created with (None: a missing file is an error).
    pub create_bytes: Option<u64>,
    /// Largest I/O the run issues (sizes the emulated controller's MDTS).
    pub io_bytes_max: u64,
    /// Queue pairs the run needs (one per job).
    pub queues: u32,
    /// The software controller's timing model (emu: devices only).
    pub timing: Option<nvme_emu::TimingModel>,
    /// Write the created file's contents so that reads hit real blocks, like fio's layout step.
    pub lay_out: bool,
    /// Ask NVMe controllers for shadow doorbells (`ControllerConfig::shadow_doorbells`).
    pub shadow_doorbells: bool,
}

#[cfg(test)]
thread_local! {
    /// Tests: which fchmod of [`CreatedFiles::narrow_pool_files`] on this thread fails (1: the
    /// first, counting the restores), and with what errno (EPERM: a filesystem refusing mode
    /// changes); the others, and all with `None`, are the real fchmod, so that what the
    /// narrowing put back shows.
    pub(crate) static NARROWING_FAILS_WITH: std::cell::Cell<Option<(usize, i32)>> = const { std::cell::Cell::new(None) };
}

/// Files this run created, removed on drop unless kept ([`CreatedFiles::keep_after_success`]); each one
/// [`prepare_file`] created stays locked (tuttid's flock on the file itself) until then.
#[derive(Debug, Default)]
pub struct CreatedFiles {
    paths: Vec<PathBuf>,
    keep: bool,
    locks: Vec<nix::fcntl::Flock<std::fs::File>>,
    /// The files the run's lock step (run.rs `lock_devices`) holds locked, as their specs name
    /// them, its temporary pool ([`CreatedFiles::hold`]) and the files [`prepare_file`] created
    /// (locked as it made them), each with the file it was then
    /// (device, inode; None if it could not be examined): [`prepare_file`] does not lock those
    /// again (a second lock of this process's own would be refused as in use) while that file
    /// is still the one at the path.
    held: Vec<(PathBuf, Option<(u64, u64)>)>,
    /// Existing files not held are checked for foreign contents
    /// ([`CreatedFiles::refuse_foreign_appearing`]).
    refuse_foreign: bool,
    /// The locks of the run's lock step ([`CreatedFiles::hold_locks`]) and those [`prepare_file`]
    /// took on existing files that step did not hold, as one set: a kv run narrows their pool
    /// files together once its pool is open ([`CreatedFiles::narrow_pool_files`]).
    device_locks: tutti_devices::DeviceLocks,
    /// What those locks do with an existing file's mode, as the lock step's do.
    file_modes: FileModes,
    /// The claims [`prepare_file`] took on block devices that appeared after the run's lock
    /// step (which claimed the others), held to the end of the run and released before the
    /// locks (the drop).
    claims: Vec<tutti_devices::BlockDeviceClaims>,
}

/// What the run's locks do with the mode of an existing `emu:`/`uring:` file others can open.
/// Locking changes no mode either way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FileModes {
    /// A pool (the kv workload), as tuttid's: another user's refused, this user's recorded
    /// (`tutti_devices::DeviceLocks::acquire`) and narrowed to its owner's bits once the pool
    /// is open ([`CreatedFiles::narrow_pool_files`]).
    #[default]
    Narrow,
    /// Any file a raw run reads or writes, as fio would (a data set others read too): left as
    /// it is (`tutti_devices::DeviceLocks::acquire_leaving_modes`).
    Leave,
}

impl FileModes {
    /// Locks `specs` (no file is created) as `self` says.
    pub fn acquire(self, specs: &[DeviceSpec], lock_dir: &Path) -> Result<tutti_devices::DeviceLocks, tutti_devices::DeviceError> {
        match self {
            FileModes::Narrow => tutti_devices::DeviceLocks::acquire(specs, lock_dir, false),
            FileModes::Leave => tutti_devices::DeviceLocks::acquire_leaving_modes(specs, lock_dir, false),
        }
    }
}

impl CreatedFiles {
    /// Notes the files the run's own device locks hold (`DeviceLocks::paths`).
    pub fn note_held<'a>(&mut self, paths: impl IntoIterator<Item = &'a Path>) {
        // Examined right after the lock was taken: DeviceLocks does not say which file it holds.
        self.held.extend(paths.into_iter().map(|path| (path.to_path_buf(), file_id(path))));
    }

    /// Whether the file now at `path` is one the run holds locked (the same path, still the
    /// same file: one put in its place since is another, unlocked).
    fn holds(&self, path: &Path) -> bool {
        let now = file_id(path);
        now.is_some() && self.held.iter().any(|(held, id)| held == path && *id == now)
    }

    /// Refuses (`tutti_devices::DeviceError::ReplacedWhileOpening`, exit status 2) an `emu:` or
    /// `uring:` device whose file, opened by its path (`opened`: device and inode), is not the
    /// file the run locked at that path: one renamed or linked over it between the lock and the
    /// open is another file, unlocked, that another process could lock and use too. Against
    /// the run's device locks where they hold the path, else the file the run created there;
    /// a path the run holds no file at is refused too.
    pub fn check_opened(&self, spec: &DeviceSpec, opened: Option<(u64, u64)>) -> Result<(), DeviceError> {
        let (DeviceSpec::EmuFile(path) | DeviceSpec::Uring(path)) = spec else { return Ok(()) };
        let Some(opened) = opened else { return Ok(()) };
        if self.device_locks.paths().any(|held| held == path) {
            return Ok(self.device_locks.check_opened(spec, Some(opened))?);
        }
        // Made by this run ([`prepare_file`], [`CreatedFiles::hold`]): compared with the file it
        // made, examined on the descriptor that made it. A path made or held twice (a file put
        // in place of the first and held in its turn) has two entries: either file passes. A
        // path the run holds nothing at (its lock skipped a file gone meanwhile) is unlocked.
        if self.held.iter().any(|(held, locked)| held == path && *locked == Some(opened)) {
            return Ok(());
        }
        Err(tutti_devices::DeviceError::ReplacedWhileOpening { spec: spec.to_string(), path: path.clone() }.into())
    }

    pub fn push(&mut self, path: PathBuf) {
        self.paths.push(path);
    }

    /// Has [`prepare_file`] lock an existing file the lock step did not hold as that step does.
    pub fn set_file_modes(&mut self, modes: FileModes) {
        self.file_modes = modes;
    }

    /// Holds `locks`, the run's lock step's, to the end of the run with those [`prepare_file`]
    /// takes, for [`CreatedFiles::narrow_pool_files`].
    pub fn hold_locks(&mut self, locks: tutti_devices::DeviceLocks) {
        self.device_locks.extend(locks);
    }

    /// Makes every pool file of the run's locks that others could open its owner's only
    /// (`tutti_devices::DeviceLocks::narrow_pool_files`), and says so on standard error: for a
    /// kv run once its pool is formatted or opened, every device locked, so that a run refused
    /// before (a file system on a device, another device in use) changes no mode. Where one
    /// fails (EPERM), the modes changed are put back and the error returned, saying first that
    /// the pool was formatted on `formatted` and is kept (a run that formatted; empty for one
    /// that opened a kept pool).
    pub fn narrow_pool_files(&mut self, formatted: &[DeviceSpec]) -> Result<(), tutti_devices::DeviceError> {
        // Tests make one fchmod fail (NARROWING_FAILS_WITH), as a filesystem refusing it does.
        #[cfg(test)]
        let failing = NARROWING_FAILS_WITH.get();
        #[cfg(not(test))]
        let failing: Option<(usize, i32)> = None;
        let notes = match failing {
            Some((nth, errno)) => self.device_locks.narrow_pool_files_failing(formatted, nth, errno),
            None => self.device_locks.narrow_pool_files(formatted),
        };
        for note in notes? {
            tutti_cli::errln!("tutti-bench: warning: {note}");
        }
        Ok(())
    }

    /// Has [`prepare_file`] check an existing file the lock step did not hold (one that appeared
    /// since the run's checks, or was put in place of one it held) for foreign contents, as
    /// those checks did: for a run that formats without `--overwrite`.
    pub fn refuse_foreign_appearing(&mut self) {
        self.refuse_foreign = true;
    }

    /// Holds the file at `path`, one the run created (`id`: its device and inode, from `fstat`
    /// on the descriptor that created it), as the run's own to the end of the run, with `lock`,
    /// the run's lock on it, when its filesystem took one: [`prepare_file`] does not lock that
    /// file again either way (where the filesystem took no flock, a second one fails as the
    /// first did).
    pub fn hold(&mut self, path: PathBuf, lock: Option<nix::fcntl::Flock<std::fs::File>>, id: Option<(u64, u64)>) {
        self.locks.extend(lock);
        self.held.push((path, id));
    }

    /// Keeps the files if the run fails (`--keep`); an interrupt still removes them, as it
    /// always removed the temporary pool.
    pub fn keep(&mut self) {
        self.keep = true;
    }

    /// Keeps the files of a run that succeeded, or of a kv run whose pool was formatted on them
    /// before its narrowing failed (the error says the pool is kept there): an interrupt from
    /// here on leaves them too.
    pub fn keep_after_success(&mut self) {
        self.keep = true;
        for path in &self.paths {
            crate::uring::keep_on_interrupt(path);
        }
    }

    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Removes the files now unless they are kept, and returns those that could not be removed
    /// with why, so that the run says what happened instead of "removed". Forgets them all: the
    /// drop tries none again (and an interrupt no longer removes what is at a removed one's
    /// path). Kept files stay, and are not reported.
    pub fn remove_now(&mut self) -> Vec<(PathBuf, std::io::Error)> {
        if self.keep {
            return Vec::new();
        }
        let mut failures = Vec::new();
        for path in std::mem::take(&mut self.paths) {
            match std::fs::remove_file(&path) {
                Ok(()) => crate::uring::keep_on_interrupt(&path),
                Err(error) => failures.push((path, error)),
            }
        }
        failures
    }
}

impl Drop for CreatedFiles {
    fn drop(&mut self) {
        // Nothing else would say so: a file left behind is named (best effort, on stderr).
        for (path, error) in self.remove_now() {
            tutti_cli::errln!("tutti-bench: could not remove {}: {error}", path.display());
        }
        // The claims go before the locks (the fields, dropped after this): a format (tuttid
        // --format, tutti pool format) takes the lock, then the claim, and one that got the
        // lock in between would meet the run's claim and fail as "in use". Taken here rather
        // than left to the fields' declaration order, which a reordering would change.
        drop(std::mem::take(&mut self.claims));
    }
}

/// Opens (and, where allowed, creates) the device a spec names, in its own DMA space.
pub fn open(spec: &DeviceSpec, options: OpenOptions2, created: &mut CreatedFiles) -> Result<Arc<dyn Device>, DeviceError> {
    match spec {
        DeviceSpec::Uring(path) => {
            prepare_file(spec, options, created)?;
            let device = crate::uring::UringDevice::open(path, options.writes)?;
            created.check_opened(spec, Some(device.file_id()))?;
            Ok(Arc::new(device))
        }
        _ => {
            prepare_file(spec, options, created)?;
            let emu = EmuOptions { config: emu_config(options), create_bytes: None };
            let opened = open_in_one_space(std::slice::from_ref(spec), &emu)?;
            let device = opened.into_iter().next().ok_or_else(|| DeviceError::Setup(format!("{spec}: nothing was opened")))?;
            created.check_opened(spec, device.backing_file())?;
            Ok(Arc::new(NvmeDevice::init(device, options)?))
        }
    }
}

/// The LBA size of the software controller's namespace in every tutti-bench run (it has no
/// `--emu-lba-bytes`).
pub(crate) const EMU_LBA_BYTES: u32 = 4096;

fn emu_config(options: OpenOptions2) -> EmuConfig {
    // MDTS large enough that one benchmark I/O is one command (as on an SSD with MDTS ≥ bs),
    // capped at 16 MiB; the driver cuts commands at 2 MiB whatever the MDTS (one PRP list page
    // per command, nvme-driver's TRANSFER_BYTES_MAX), so larger I/Os are several commands. The
    // write cache off so that a completed write has reached the file, as with O_DIRECT on the
    // kernel path.
    let mut mdts = 5u8;
    while (4096u64 << mdts) < options.io_bytes_max && mdts < 12 {
        mdts += 1;
    }
    EmuConfig::default()
        .with_namespaces(vec![NamespaceConfig::new(EMU_LBA_BYTES, None)])
        .with_mdts(mdts)
        .with_volatile_write_cache(false)
        .with_io_queue_pairs_max(u16::try_from(options.queues.max(1)).unwrap_or(64))
        .with_timing(options.timing)
}

/// The timing model in JSON (`null` without one): the figures of such a run are the model's.
pub fn timing_json(timing: Option<nvme_emu::TimingModel>) -> serde_json::Value {
    timing.map_or(serde_json::Value::Null, |timing| {
        serde_json::json!({
            "read_bytes_per_s": timing.read_bytes_per_s,
            "write_bytes_per_s": timing.write_bytes_per_s,
            "mixed_share": f64::from(timing.mixed_share_permille) / 1000.0,
            "command_latency_us": timing.command_latency.as_micros() as u64,
        })
    })
}

/// What a device description adds about shadow doorbells: nothing unless they were asked for.
fn shadow_note(options: OpenOptions2, active: bool) -> &'static str {
    match (options.shadow_doorbells, active) {
        (false, _) => "",
        (true, true) => ", shadow doorbells",
        (true, false) => ", MMIO doorbells (the controller does not offer shadow doorbells)",
    }
}

/// What a device description adds when the software controller runs a timing model: the
/// figures are the model's, not hardware's.
fn timing_note(spec: &DeviceSpec, options: OpenOptions2) -> String {
    match options.timing {
        Some(timing) if spec.is_emulated() => format!("; EMULATED {timing}"),
        _ => String::new(),
    }
}

/// What a device description adds when its data is in memory while it reads like a disk: a
/// file on tmpfs or ramfs, or a software controller that runs buffered (its filesystem refused
/// `O_DIRECT`, so the page cache serves its I/O). Nothing otherwise.
pub fn storage_note(spec: &DeviceSpec, emulator: Option<&EmuDevice>) -> String {
    let mut note = match spec {
        DeviceSpec::EmuFile(path) | DeviceSpec::Uring(path) => crate::filesystems::memory_note(path),
        _ => String::new(),
    };
    if emulator.is_some_and(EmuDevice::backing_is_buffered) {
        note.push_str(", buffered pread/pwrite (O_DIRECT refused: the page cache, not the disk, serves I/O)");
    }
    note
}

/// The file at `path` (following links, as a lock's open does): device and inode.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|metadata| (metadata.dev(), metadata.ino()))
}

/// An error of tuttid's lock on an existing file of `spec` (`tutti_devices::DeviceLocks::acquire`)
/// as the run's lock step (run.rs `lock_refusal`) reads it: another holder, or a path that
/// names nothing usable (by its errno: `tutti_devices::is_unusable_errno`), is unusable input
/// (2); an open or a `flock` the host failed (EIO, EMFILE, ENOLCK, NFS's EBADF) is a failure
/// (1), as [`DeviceError::Io`].
fn lock_error(spec: &DeviceSpec, error: tutti_devices::DeviceError) -> DeviceError {
    match error {
        tutti_devices::DeviceError::Io { context, source } if !tutti_devices::is_unusable_errno(&source) => {
            DeviceError::Io { device: spec.to_string(), context, source }
        }
        tutti_devices::DeviceError::OpenFailed { path, source } if !tutti_devices::is_unusable_errno(&source) => {
            DeviceError::Io { device: spec.to_string(), context: format!("opening {} to lock it", path.display()), source }
        }
        error => DeviceError::Spec(error),
    }
}

/// A device error from opening the run's devices (`what`: the devices, for the context), as
/// the exit status reads it: what was given ([`DeviceError::Setup`], [`DeviceError::Spec`]) is
/// unusable input (2), anything else a failure (1).
pub fn open_error(error: DeviceError, what: &str) -> anyhow::Error {
    match error {
        DeviceError::Setup(message) => crate::Unusable(message).into(),
        DeviceError::Spec(error) => crate::Unusable(error.to_string()).into(),
        error => anyhow::Error::new(error).context(format!("opening {what}")),
    }
}

/// The existing file of `spec` (at `path`): checks it opens as the run needs and, unless the
/// run's lock step holds it, takes tuttid's lock on it as that step does (`DeviceLocks`;
/// refused as in use, exit 2, while another process holds it) and, for a run that writes, claims
/// it if it is a block device (`opener`; refused as in use, exit 2, while mounted), both held by
/// `created` to the end of the run. The lock step skipped it because it did not exist then:
/// another process (a second run, `tutti pool format`, `tuttid --format`) made it since, and
/// must not share it unlocked.
fn use_existing(
    spec: &DeviceSpec,
    path: &Path,
    options: OpenOptions2,
    created: &mut CreatedFiles,
    opener: &dyn tutti_devices::BlockDeviceOpener,
) -> Result<(), DeviceError> {
    OpenOptions::new().read(true).write(options.writes).open(path).map_err(|source| {
        let context = if options.writes { "cannot open for reading and writing" } else { "cannot open for reading" };
        // What was given (no permission, read-only, a loop) by its errno; EIO and the like failed.
        if tutti_devices::is_unusable_errno(&source) {
            DeviceError::Setup(format!("{}: {context}: {source}", path.display()))
        } else {
            DeviceError::Io { device: spec.to_string(), context: context.to_string(), source }
        }
    })?;
    if !created.holds(path) {
        // The lock directory holds vfio: functions' lock files only: an emu: or uring: file is
        // locked itself.
        let locks = created
            .file_modes
            .acquire(std::slice::from_ref(spec), Path::new(tutti_devices::DEFAULT_LOCK_DIR))
            .map_err(|error| lock_error(spec, error))?;
        created.note_held(locks.paths());
        created.device_locks.extend(locks);
        // A run that writes claims its block devices at its lock step (run.rs), only those
        // there then: a disk put here since (a node made, a link) is claimed now, lock then
        // claim as there, and held to the end of the run; one in use (mounted) is refused
        // before a byte is written.
        let claims = if options.writes {
            tutti_devices::BlockDeviceClaims::acquire(std::slice::from_ref(spec), opener).map_err(|error| lock_error(spec, error))?
        } else {
            tutti_devices::BlockDeviceClaims::default()
        };
        // The run's checks (run.rs with_devices) saw no file here, or another one: what is here
        // now is checked as they would have checked it, under the lock, before it is formatted
        // (a copier such as cp takes no lock, so the lock alone did not keep it off); a block
        // device through its claim (a blank first MiB proves nothing on a disk).
        if created.refuse_foreign {
            match tutti_devices::refuse_foreign_contents(std::slice::from_ref(spec), &claims) {
                Ok(()) => {}
                Err(error) => return Err(lock_error(spec, error)),
            }
        }
        created.claims.push(claims);
    }
    Ok(())
}

/// Checks the file of an `emu:PATH` or `uring:PATH` spec (others: nothing to do) can be opened
/// as the run needs, creating it (and laying it out) when missing and allowed. A created file is
/// registered in `created` so that a failed run removes it.
pub fn prepare_file(spec: &DeviceSpec, options: OpenOptions2, created: &mut CreatedFiles) -> Result<(), DeviceError> {
    prepare_file_with(spec, options, created, &tutti_devices::HostBlockDevices)
}

/// [`prepare_file`] with `opener` answering for the block devices (tests give a fake).
fn prepare_file_with(
    spec: &DeviceSpec,
    options: OpenOptions2,
    created: &mut CreatedFiles,
    opener: &dyn tutti_devices::BlockDeviceOpener,
) -> Result<(), DeviceError> {
    let (DeviceSpec::EmuFile(path) | DeviceSpec::Uring(path)) = spec else { return Ok(()) };
    let io_error = |context: &str, source: std::io::Error| DeviceError::Setup(format!("{}: {context}: {source}", path.display()));
    if path.exists() {
        return use_existing(spec, path, options, created, opener);
    }
    let Some(bytes) = options.create_bytes else {
        return Err(DeviceError::Setup(format!("{} does not exist; give --size to create it", path.display())));
    };
    let bytes = bytes
        .div_ceil(4096)
        .checked_mul(4096)
        .ok_or_else(|| DeviceError::Setup(format!("{}: {bytes} bytes is larger than any file can be", path.display())))?;
    let parent = path.parent().filter(|parent| !parent.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if let Ok(free) = crate::uring::statvfs_free_bytes(parent) {
        if bytes > free {
            return Err(DeviceError::Setup(format!(
                "{}: creating it with {} needs more than the {} free in {}",
                path.display(),
                format_size(bytes),
                format_size(free),
                parent.display()
            )));
        }
    }
    // Owner-only, as tuttid's and `tutti pool format`'s pool files: a kv pool holds KV bytes.
    let file = match OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path) {
        Ok(file) => file,
        // Another process made it since the look above: not this run's to size or remove.
        Err(source) if source.kind() == std::io::ErrorKind::AlreadyExists => return use_existing(spec, path, options, created, opener),
        Err(source) => return Err(io_error("cannot create", source)),
    };
    created.push(path.to_path_buf());
    // The file made, for [`CreatedFiles::check_opened`] (and not locked again by this run).
    let made = file.metadata().map_err(|source| io_error("cannot examine", source))?;
    created.held.push((path.to_path_buf(), Some((made.dev(), made.ino()))));
    // Removed on Ctrl-C too, as a failed run removes it; until the run has succeeded.
    crate::uring::remove_on_interrupt(path);
    // The run's device locks (run.rs lock_devices) were taken before it existed: lock it as they
    // do, before a byte is written, so that tuttid, `tutti pool format` or another run cannot
    // take it and write it mid-run. Held by `created` to the end of the run.
    let lock_file = file.try_clone().map_err(|source| io_error("cannot lock", source))?;
    match nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(lock) => created.locks.push(lock),
        // Only between its creation and here: another process took it at once.
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            return Err(DeviceError::Setup(format!("{}: another process locked the file as this run created it", path.display())))
        }
        // The filesystem took no lock (ENOLCK, ...): failed, as the lock step's failures are.
        Err((_, errno)) => {
            return Err(DeviceError::Io {
                device: spec.to_string(),
                context: format!("locking {}", path.display()),
                source: std::io::Error::from(errno),
            })
        }
    }
    if options.lay_out {
        lay_out(&file, bytes).map_err(|source| io_error("cannot lay out", source))?;
    } else {
        file.set_len(bytes).map_err(|source| io_error("cannot size", source))?;
    }
    Ok(())
}

/// Writes `bytes` of non-zero data so that later reads hit allocated blocks, not holes.
pub fn lay_out(file: &std::fs::File, bytes: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let chunk: Vec<u8> = (0..1usize << 20).map(|index| (index as u8) ^ 0x5a).collect();
    let mut offset = 0u64;
    while offset < bytes {
        let len = (bytes - offset).min(chunk.len() as u64) as usize;
        file.write_all_at(&chunk[..len], offset)?;
        offset += len as u64;
    }
    file.sync_all()
}

/// The granule of [`IoQueue::stamp_buffer`]: the block size deduplicating storage commonly works in.
pub const STAMP_CHUNK_BYTES: usize = 4096;

/// A controller reached through `nvme-driver`: the software one or a VFIO function.
struct NvmeDevice {
    controller: Controller,
    /// Keeps the software controller's thread alive as long as the driver uses it.
    emulator: Option<Arc<EmuDevice>>,
    namespace: nvme_driver::Namespace,
    description: String,
    /// The software controller's timing model (`None` on a VFIO function).
    timing: Option<nvme_emu::TimingModel>,
    /// Queues the run opens on this device (one per job).
    queues: u32,
}

impl NvmeDevice {
    fn init(device: OpenedDevice, options: OpenOptions2) -> Result<Self, DeviceError> {
        Self::init_with_admin_timeout(device, options, ControllerConfig::default().admin_timeout)
    }

    /// [`NvmeDevice::init`] with the admin commands' timeout (a test's deletes give up sooner).
    fn init_with_admin_timeout(device: OpenedDevice, options: OpenOptions2, admin_timeout: Duration) -> Result<Self, DeviceError> {
        let name = device.backend.name();
        let config = ControllerConfig {
            io_queue_pairs_requested: u16::try_from(options.queues.clamp(1, 1024)).unwrap_or(1024),
            shadow_doorbells: options.shadow_doorbells,
            admin_timeout,
            ..ControllerConfig::default()
        };
        let controller = Controller::init(device.backend, config).map_err(|source| DeviceError::Nvme { device: name.clone(), source })?;
        let namespace = *controller
            .namespaces()
            .first()
            .ok_or_else(|| DeviceError::Setup(format!("{name}: the controller has no active namespace")))?;
        let description = format!(
            "{}{}: namespace {} of {} ({}-byte LBAs), {} data pointers, max transfer {}{}{}",
            device.spec.describe(),
            storage_note(&device.spec, device.emulator.as_deref()),
            namespace.id.0,
            format_size(namespace.size_bytes()),
            namespace.block_size_bytes,
            controller.data_pointer_mode().name(),
            format_size(controller.max_transfer_bytes()),
            shadow_note(options, controller.shadow_doorbells_active()),
            timing_note(&device.spec, options),
        );
        let timing = if device.emulator.is_some() { options.timing } else { None };
        Ok(Self { controller, emulator: device.emulator, namespace, description, timing, queues: options.queues.max(1) })
    }

    /// How a wait on this device spends its polls: see [`Waiter`].
    fn waiter(&self) -> Waiter {
        if self.emulator.is_some() {
            Waiter::SharesOurCores
        } else {
            Waiter::Polls
        }
    }

    fn open_nvme_queue(&self, depth: u32, slot_bytes: usize, traffic: Traffic, waiter: Waiter) -> Result<NvmeQueue, DeviceError> {
        let name = self.controller.backend().name();
        let nvme = |source| DeviceError::Nvme { device: name.clone(), source };
        let slot_len = u32::try_from(slot_bytes)
            .map_err(|_| DeviceError::Setup(format!("{name}: block size {slot_bytes} does not fit one segment")))?;
        // One I/O may take several commands when it exceeds the controller's max transfer size.
        let commands_per_io = (slot_bytes as u64).div_ceil(self.controller.max_transfer_bytes().max(4096));
        let max_entries = self.controller.capabilities().max_queue_entries();
        // Room for twice the commands in flight: the driver writes the CQ head doorbell only
        // when the controller could run short of entries, so the spare half lets one write
        // answer many completions (nvme-driver's `QueuePair::completion_doorbell_needed`). One
        // command at a time gets no spare entries: each completion's head then goes out with
        // the next command's ring, right after its tail, and QEMU's controller answers a head
        // that frees a full CQ by running its SQ and CQ again; with spare entries QD 1 lost
        // its fast mode there (docs/vfio.md).
        let commands = u64::from(depth) * commands_per_io;
        let spare = if commands > 1 { commands } else { 0 };
        let entries = (commands + spare + 1).min(u64::from(max_entries)) as u32;
        let pair = self.controller.create_io_queue_pair(entries.max(2)).map_err(nvme)?;
        let total = slot_bytes
            .checked_mul(depth as usize)
            .ok_or_else(|| DeviceError::Setup(format!("{name}: {depth} buffers of {slot_bytes} bytes overflow")))?;
        let buffers = self.controller.dma().allocate(total).map_err(|source| nvme(NvmeError::Hardware(source)))?;
        // A job that writes fills the buffers with pseudorandom bytes itself (`run_job`).
        let mut segments = Vec::with_capacity(depth as usize);
        for slot in 0..depth as usize {
            let region = buffers.subregion(slot * slot_bytes, slot_bytes).map_err(|source| nvme(NvmeError::Hardware(source)))?;
            segments.push(DataSegment::new(region.iova(), slot_len));
        }
        // A job's next completion may wait behind every I/O the jobs queued on this device,
        // which a timing model passes one after another.
        let queued_bytes = u64::from(self.queues).saturating_mul(u64::from(depth)).saturating_mul(slot_bytes as u64);
        Ok(NvmeQueue {
            name,
            pair: Some(pair),
            io_timeout: wait_bound(IO_TIMEOUT, self.timing, traffic, queued_bytes),
            namespace: self.namespace.id,
            block_size_bytes: u64::from(self.namespace.block_size_bytes),
            buffers,
            slot_bytes,
            segments,
            waiter,
            remaining_commands: vec![0; depth as usize],
            failure: vec![None; depth as usize],
            directions: vec![Direction::Read; depth as usize],
            offsets_bytes: vec![0; depth as usize],
            ring_every_commands: ring_every_commands(commands),
        })
    }
}

/// A refill of at least this many commands is published in parts (see [`ring_every_commands`]).
const PARTIAL_DOORBELL_COMMANDS_MIN: u64 = 16;
/// How many SQ doorbells a full refill of the queue's commands gets (at most).
const DOORBELLS_PER_REFILL: u64 = 2;

/// After how many queued commands a queue rings the SQ doorbell without waiting for
/// `submit_and_reap`. A job refills every slot its reap freed before the batch's doorbell; when
/// a device completes its commands in a bunch (QEMU's controller posts a batch of writes
/// together), one doorbell after the whole refill leaves the device idle while the CPU builds
/// the batch, and the queue then runs in lockstep with it (QEMU's trace of the 128K write row:
/// no write in its block layer at the median doorbell). Ringing when half of a deep queue is
/// queued lets the device start on the first half while the second is built, at one more MMIO
/// write per full refill; quarters, or a doorbell for each of the first commands, cost more than
/// the overlap gains (figures: docs/vfio.md, "Half a refill"). Shallow queues (under 16
/// commands) ring once per batch.
fn ring_every_commands(commands: u64) -> usize {
    if commands >= PARTIAL_DOORBELL_COMMANDS_MIN {
        usize::try_from(commands / DOORBELLS_PER_REFILL).unwrap_or(usize::MAX)
    } else {
        usize::MAX
    }
}

impl Device for NvmeDevice {
    fn name(&self) -> String {
        self.controller.backend().name()
    }

    fn describe(&self) -> String {
        self.description.clone()
    }

    fn capacity_bytes(&self) -> u64 {
        self.namespace.size_bytes()
    }

    fn block_size_bytes(&self) -> u32 {
        self.namespace.block_size_bytes
    }

    fn open_queue(&self, depth: u32, slot_bytes: usize, traffic: Traffic) -> Result<Box<dyn IoQueue>, DeviceError> {
        Ok(Box::new(self.open_nvme_queue(depth, slot_bytes, traffic, self.waiter())?))
    }
}

/// How a wait for a completion spends its polls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiter {
    /// The software controller: spin hints, then yields (WAIT_SPIN_POLLS).
    SharesOurCores,
    /// A VFIO function: back-to-back polls, one load each, until a completion or the deadline,
    /// as SPDK's pollers do. No spin hint (x86 PAUSE): under QEMU's TCG it leaves the vCPU's
    /// loop and takes the big lock the emulated controller runs under, once per poll, and
    /// that, not a busy vCPU, was what starved the controller in tools/vm-bench.sh's guest. No
    /// yield or sleep either: without the hint but still yielding and sleeping, 4 KiB random
    /// reads went from ~12k to ~21-23k IOPS at QD 1 but fell at QD 32; with neither, 38.6-49.0k
    /// at QD 1 against b18d064's 14.1-16.8k, and 1.24-1.50x at QD 32 (docs/vfio.md).
    Polls,
}

struct NvmeQueue {
    name: String,
    /// None only once `drop` has taken it to delete it.
    pair: Option<IoQueuePair>,
    /// How long the job waits for a completion before it calls the device stuck, and `drop`
    /// lets commands still in flight finish before deleting the pair ([`wait_bound`]).
    io_timeout: Duration,
    namespace: NamespaceId,
    block_size_bytes: u64,
    buffers: DmaRegion,
    slot_bytes: usize,
    segments: Vec<DataSegment>,
    waiter: Waiter,
    /// Commands of each slot's I/O still in flight (an I/O over MDTS is several commands).
    remaining_commands: Vec<u32>,
    /// First failed status of each slot's I/O, reported when its last command completes.
    failure: Vec<Option<nvme_driver::spec::NvmeStatus>>,
    directions: Vec<Direction>,
    offsets_bytes: Vec<u64>,
    /// Rings the SQ doorbell from `queue` once this many commands are unpublished.
    ring_every_commands: usize,
}

impl Drop for NvmeQueue {
    fn drop(&mut self) {
        // A failed run can leave commands in flight: let them finish (bounded) before the queue
        // pair is deleted and the buffers they point at are freed.
        self.drain(Instant::now() + self.io_timeout);
        let Some(pair) = self.pair.take() else { return };
        let in_flight = pair.in_flight();
        if let Err(undeleted) = pair.delete() {
            // Commands still in flight on a pair the controller did not confirm deleting may
            // still move data into or out of the buffers: keep them for good (a leaked clone
            // keeps the whole allocation), loudly, instead of freeing them as this drop ends.
            if in_flight > 0 {
                let bytes = self.buffers.clone().leak();
                LEAKED_DMA_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
                tutti_cli::errln!(
                    "tutti-bench: {}: {bytes} bytes of I/O buffers at {} kept for good (leaked): {in_flight} command(s) were in flight when {}",
                    self.name,
                    self.buffers.iova(),
                    undeleted.source
                );
            }
            drop(undeleted.pair); // tries once more, else leaks its rings
        }
    }
}

/// The queue's pair, which only `drop` takes away.
fn live_pair<'a>(pair: &'a mut Option<IoQueuePair>, name: &str) -> Result<&'a mut IoQueuePair, DeviceError> {
    pair.as_mut().ok_or_else(|| DeviceError::Setup(format!("{name}: the queue pair was already deleted")))
}

static LEAKED_DMA_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes of I/O buffers kept for good so far because a queue pair with commands in flight on
/// them could not be deleted (a late command may still write them). The run says each leak
/// on stderr as it happens; the sum is for tests.
#[cfg(test)]
fn leaked_dma_bytes() -> u64 {
    LEAKED_DMA_BYTES.load(Ordering::Relaxed)
}

impl IoQueue for NvmeQueue {
    fn queue(&mut self, slot: u32, direction: Direction, offset_bytes: u64) -> Result<Visibility, DeviceError> {
        let index = slot as usize;
        let segment =
            self.segments.get(index..=index).ok_or_else(|| DeviceError::Setup(format!("{}: slot {slot} out of range", self.name)))?;
        let lba = Lba(offset_bytes / self.block_size_bytes);
        let pair = live_pair(&mut self.pair, &self.name)?;
        let result = match direction {
            Direction::Read => pair.submit_read(self.namespace, lba, segment, u64::from(slot)),
            Direction::Write => pair.submit_write(self.namespace, lba, segment, false, u64::from(slot)),
        };
        match result {
            Ok(commands) => {
                self.remaining_commands[index] = commands as u32;
                self.failure[index] = None;
                self.directions[index] = direction;
                self.offsets_bytes[index] = offset_bytes;
                if pair.unpublished_submissions() >= self.ring_every_commands {
                    pair.ring_doorbell().map_err(|source| DeviceError::Nvme { device: self.name.clone(), source })?;
                    return Ok(Visibility::Published);
                }
                Ok(Visibility::Queued)
            }
            Err(error) if error.is_backpressure() => Err(DeviceError::Backpressure { device: self.name.clone() }),
            Err(source) => Err(DeviceError::Nvme { device: self.name.clone(), source }),
        }
    }

    fn submit_and_reap(
        &mut self,
        wait: bool,
        deadline: Instant,
        on_done: &mut dyn FnMut(u32, Result<(), DeviceError>),
    ) -> Result<usize, DeviceError> {
        let Self { name, pair, remaining_commands, failure, directions, offsets_bytes, waiter, io_timeout, .. } = self;
        let pair = live_pair(pair, name)?;
        pair.ring_doorbell().map_err(|source| DeviceError::Nvme { device: name.clone(), source })?;
        let mut done = 0usize;
        let mut unexpected = None;
        let mut on_completion = |completion: nvme_driver::Completion| {
            let Some(remaining) = usize::try_from(completion.tag)
                .ok()
                .and_then(|index| remaining_commands.get_mut(index))
                .filter(|remaining| **remaining > 0)
            else {
                unexpected = Some(completion.tag);
                return;
            };
            *remaining -= 1;
            let index = completion.tag as usize;
            if let Err(status) = completion.status {
                failure[index].get_or_insert(status);
            }
            if *remaining == 0 {
                done += 1;
                let result = match failure[index].take() {
                    None => Ok(()),
                    Some(status) => Err(DeviceError::Command {
                        device: name.clone(),
                        direction: directions[index],
                        offset_bytes: offsets_bytes[index],
                        reason: status.to_string(),
                    }),
                };
                on_done(index as u32, result);
            }
        };
        let reaped = if pair.completion_pending() {
            pair.reap(usize::MAX, &mut on_completion).map_err(|source| DeviceError::Nvme { device: name.clone(), source })?
        } else {
            0
        };
        if reaped == 0 && wait && pair.in_flight() > 0 {
            // Our own bounded wait rather than the driver's spin-and-yield (Waiter says how each
            // device is waited on). An empty poll is one load (completion_pending); reap runs
            // when it says so.
            let in_flight = pair.in_flight();
            let mut polls = 0u32;
            loop {
                if pair.completion_pending()
                    && pair.reap(usize::MAX, &mut on_completion).map_err(|source| DeviceError::Nvme { device: name.clone(), source })? > 0
                {
                    break;
                }
                polls = polls.wrapping_add(1);
                if polls.is_multiple_of(WAIT_POLLS_PER_CLOCK_READ) && Instant::now() >= deadline {
                    return Err(DeviceError::Timeout { device: name.clone(), timeout_s: io_timeout.as_secs(), in_flight });
                }
                match waiter {
                    Waiter::Polls => {}
                    Waiter::SharesOurCores if polls < WAIT_SPIN_POLLS => std::hint::spin_loop(),
                    Waiter::SharesOurCores => std::thread::yield_now(),
                }
            }
        }
        if let Some(slot) = unexpected {
            return Err(DeviceError::UnexpectedCompletion { device: name.clone(), slot });
        }
        Ok(done)
    }

    fn write_buffer(&mut self, slot: u32, source: &[u8]) -> Result<(), DeviceError> {
        let offset = slot as usize * self.slot_bytes;
        self.buffers
            .write(offset, &source[..source.len().min(self.slot_bytes)])
            .map_err(|source| DeviceError::Nvme { device: self.name.clone(), source: source.into() })
    }

    fn stamp_buffer(&mut self, slot: u32, stamp: u64) -> Result<(), DeviceError> {
        let start = slot as usize * self.slot_bytes;
        for chunk in (0..self.slot_bytes).step_by(STAMP_CHUNK_BYTES) {
            self.buffers
                .write(start + chunk, &stamp.wrapping_add(chunk as u64).to_le_bytes())
                .map_err(|source| DeviceError::Nvme { device: self.name.clone(), source: source.into() })?;
        }
        Ok(())
    }

    fn read_buffer(&self, slot: u32, destination: &mut [u8]) -> Result<(), DeviceError> {
        let offset = slot as usize * self.slot_bytes;
        let len = destination.len().min(self.slot_bytes);
        self.buffers
            .read(offset, &mut destination[..len])
            .map_err(|source| DeviceError::Nvme { device: self.name.clone(), source: source.into() })
    }

    fn drain(&mut self, deadline: Instant) {
        if let Some(pair) = self.pair.as_mut() {
            let _ = pair.wait_idle(deadline, |_| {});
        }
    }

    fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    fn pace_idle_poll(&self, polls: u32) {
        match self.waiter {
            // Polled back to back, as in submit_and_reap's wait (see Waiter::Polls).
            Waiter::Polls => {}
            Waiter::SharesOurCores => spin_then_yield(polls),
        }
    }
}

/// A controller for the object store (which takes `Arc<Controller>`), and what keeps it alive.
pub struct KvController {
    pub controller: Arc<Controller>,
    /// Keeps the software controller's thread alive as long as the driver uses it.
    pub emulator: Option<Arc<EmuDevice>>,
    pub description: String,
}

/// Opens the `emu:` or `vfio:` devices of one KV pool, in one DMA space (the store registers
/// the engine's memory once): every `vfio:` function in one VFIO container, every software
/// controller in one DMA pool. `uring:` and `emu:null:` cannot hold a pool (no NVMe queues; no
/// data), and `vfio:` and `emu:` cannot be mixed (two address spaces).
pub fn open_controllers(specs: &[DeviceSpec], options: OpenOptions2, created: &mut CreatedFiles) -> Result<Vec<KvController>, DeviceError> {
    for spec in specs {
        if matches!(spec, DeviceSpec::EmuNull(_) | DeviceSpec::Uring(_)) {
            return Err(DeviceError::Setup(format!(
                "{spec} cannot hold a KV pool; accepted for --workload=kv: emu:PATH, emu:mem:SIZE, vfio:BDF"
            )));
        }
    }
    // Refused before any file is created.
    if specs.iter().any(|spec| matches!(spec, DeviceSpec::Vfio(_))) && specs.iter().any(DeviceSpec::is_emulated) {
        return Err(tutti_devices::DeviceError::MixedSpaces.into());
    }
    tutti_devices::check_memory(specs)?;
    for spec in specs {
        prepare_file(spec, options, created)?;
    }
    let emu = EmuOptions { config: emu_config(options), create_bytes: None };
    let mut controllers = Vec::with_capacity(specs.len());
    for device in open_in_one_space(specs, &emu)? {
        created.check_opened(&device.spec, device.backing_file())?;
        let name = device.backend.name();
        let controller =
            Controller::init(device.backend, ControllerConfig::default()).map_err(|source| DeviceError::Nvme { device: name, source })?;
        let description = format!(
            "{}{}: {} data pointers, max transfer {}{}",
            device.spec.describe(),
            storage_note(&device.spec, device.emulator.as_deref()),
            controller.data_pointer_mode().name(),
            format_size(controller.max_transfer_bytes()),
            timing_note(&device.spec, options)
        );
        controllers.push(KvController { controller: Arc::new(controller), emulator: device.emulator, description });
    }
    Ok(controllers)
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use nvme_emu::{FaultAction, FaultPlan, FaultRule};

    use super::*;

    #[test]
    fn a_file_the_run_creates_is_readable_by_its_owner_only() {
        // Goal: a created kv pool holds KV bytes: mode 0600 whatever the umask lets through
        // (tuttid's and `tutti pool format`'s files are owner-only too).
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("created.img");
        let options = OpenOptions2 { create_bytes: Some(8192), ..test_options() };
        let mut created = CreatedFiles::default();
        prepare_file(&DeviceSpec::EmuFile(path.clone()), options, &mut created).expect("created");
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&path).unwrap().permissions());
        assert_eq!(mode & 0o077, 0, "created with mode {:o}", mode & 0o777);
        created.keep_after_success();
    }

    #[test]
    fn a_created_file_that_cannot_be_removed_is_reported_not_said_removed() {
        // Goal: the run says a created file was removed only when it was; one whose unlink
        // fails (here a directory stands at its path, which root cannot unlink either) is
        // named with the error, not swallowed, and a file removed is not reported.
        let directory = tempfile::tempdir().unwrap();
        let stuck = directory.path().join("stuck.img");
        std::fs::create_dir(&stuck).unwrap();
        let removed = directory.path().join("removed.img");
        std::fs::write(&removed, b"pool").unwrap();
        let mut created = CreatedFiles::default();
        created.push(removed.clone());
        created.push(stuck.clone());
        let failures = created.remove_now();
        assert!(!removed.exists(), "{} left", removed.display());
        assert_eq!(failures.iter().map(|(path, _)| path).collect::<Vec<_>>(), [&stuck], "{failures:?}");
        assert!(created.paths().is_empty(), "the drop would remove them again: {:?}", created.paths());
        // Kept files are not removed, nor reported.
        let kept = directory.path().join("kept.img");
        std::fs::write(&kept, b"pool").unwrap();
        let mut created = CreatedFiles::default();
        created.push(kept.clone());
        created.keep();
        assert!(created.remove_now().is_empty());
        assert!(kept.exists());
    }

    #[test]
    fn a_file_that_appeared_after_the_lock_step_is_locked_or_refused_as_in_use() {
        // Goal: the run's lock step skips a file that does not exist yet, for the run to create
        // and lock; one another process made meanwhile (a second run, `tutti pool format`) must
        // be locked as the lock step locks a file, and refused (exit 2) while that process holds
        // it, not used beside it. One the lock step holds is not locked twice.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("raced.img");
        let spec = DeviceSpec::EmuFile(path.clone());
        let options = OpenOptions2 { create_bytes: Some(1 << 20), ..test_options() };
        // The other process: it made the file and holds it.
        let other = std::fs::File::create(&path).unwrap();
        let other = nix::fcntl::Flock::lock(other, nix::fcntl::FlockArg::LockExclusiveNonblock).unwrap();
        let mut created = CreatedFiles::default();
        let error = prepare_file(&spec, options, &mut created).unwrap_err();
        assert!(matches!(error, DeviceError::Spec(tutti_devices::DeviceError::DeviceInUse { .. })), "{error}");
        drop(created);
        assert!(path.exists(), "another process's file was removed");
        // Let go: the run takes the lock and holds it to its end.
        drop(other);
        let mut created = CreatedFiles::default();
        prepare_file(&spec, options, &mut created).expect("a file nobody holds");
        let probe = std::fs::File::open(&path).unwrap();
        assert!(
            nix::fcntl::Flock::lock(probe, nix::fcntl::FlockArg::LockExclusiveNonblock).is_err(),
            "the run uses a file it does not hold locked"
        );
        drop(created);
        // Held by the run's own lock step: used as it is.
        let locks = tutti_devices::DeviceLocks::acquire(std::slice::from_ref(&spec), directory.path(), false).unwrap();
        let mut created = CreatedFiles::default();
        created.note_held(locks.paths());
        prepare_file(&spec, options, &mut created).expect("a file the run holds");
        created.keep_after_success();
    }

    #[test]
    fn a_file_replaced_between_its_lock_and_its_open_is_refused() {
        // Goal: the device is opened by its path after the run locked it (its lock step, or
        // prepare_file as it created it); a file renamed or copied over the path in between
        // (`mv p.img moved.img; cp -p moved.img p.img`) was served unlocked, and another run or
        // tuttid could lock and use it too. Refused (exit 2), naming the path; a file left in
        // place opens.
        let directory = tempfile::tempdir().unwrap();
        let swap = |path: &Path| {
            let moved = path.with_extension("moved");
            std::fs::rename(path, &moved).unwrap();
            std::fs::copy(&moved, path).unwrap();
        };
        let id = |path: &Path| file_id(path).unwrap();
        let replaced = |error: DeviceError, path: &Path| {
            assert!(
                matches!(&error, DeviceError::Spec(tutti_devices::DeviceError::ReplacedWhileOpening { path: named, .. }) if named == path),
                "{error:?}"
            );
            let error = open_error(error, "the devices");
            let unusable = error.downcast_ref::<crate::Unusable>().unwrap_or_else(|| panic!("not status 2: {error:#}"));
            assert!(unusable.0.contains(&path.display().to_string()) && unusable.0.contains("replaced"), "{}", unusable.0);
        };
        // Locked by the run's lock step (uring: opened by tutti-bench itself: compared by what it opened).
        let path = directory.path().join("kernel.img");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let spec = DeviceSpec::Uring(path.clone());
        let mut created = CreatedFiles::default();
        let locks = FileModes::Leave.acquire(std::slice::from_ref(&spec), directory.path()).unwrap();
        created.note_held(locks.paths());
        created.hold_locks(locks);
        created.check_opened(&spec, Some(id(&path))).expect("the file locked");
        swap(&path);
        replaced(created.check_opened(&spec, Some(id(&path))).unwrap_err(), &path);
        // Made and locked by prepare_file, then opened by the software controller (as `open`
        // does, with the swap between the two).
        let path = directory.path().join("made.img");
        let spec = DeviceSpec::EmuFile(path.clone());
        let options = OpenOptions2 { create_bytes: Some(1 << 20), ..test_options() };
        let mut created = CreatedFiles::default();
        drop(open(&spec, options, &mut created).expect("a file the run made and locked"));
        swap(&path);
        let emu = EmuOptions { config: emu_config(options), create_bytes: None };
        let opened = open_in_one_space(std::slice::from_ref(&spec), &emu).unwrap();
        replaced(created.check_opened(&spec, opened[0].backing_file()).unwrap_err(), &path);
        // Opened again through `open`, the file now there is locked first (prepare_file): served.
        drop(opened);
        // Two files held at one path (the second put there and held in its turn): the one
        // opened is compared with each, not only the first held.
        let twice = directory.path().join("twice.img");
        std::fs::write(&twice, b"first").unwrap();
        let twice_spec = DeviceSpec::EmuFile(twice.clone());
        let mut held_twice = CreatedFiles::default();
        held_twice.hold(twice.clone(), None, Some(id(&twice)));
        swap(&twice);
        held_twice.hold(twice.clone(), None, Some(id(&twice)));
        held_twice.check_opened(&twice_spec, Some(id(&twice))).expect("the second file held");
        let other = directory.path().join("other.img");
        std::fs::write(&other, b"other").unwrap();
        replaced(held_twice.check_opened(&twice_spec, Some(id(&other))).unwrap_err(), &twice);
        // A path the run holds nothing at: the file there is unlocked.
        replaced(CreatedFiles::default().check_opened(&twice_spec, Some(id(&twice))).unwrap_err(), &twice);
        held_twice.keep_after_success();
        drop(open(&spec, options, &mut created).expect("the file now there, locked"));
        created.keep_after_success();
    }

    #[test]
    fn a_lock_that_failed_on_the_host_is_a_failure_not_unusable_input() {
        // Goal: a file that appeared after the lock step is locked in prepare_file as the lock
        // step locks a file, and its errors read as that step's do: another holder, or a path
        // that names nothing usable, is unusable input (exit 2); EIO, ENOLCK, and the EBADF of
        // NFS's emulated flock on a read-only descriptor say the host failed (1).
        let io = |errno: i32| tutti_devices::DeviceError::Io {
            context: "locking /x/p.img".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        let spec = DeviceSpec::EmuFile("/x/p.img".into());
        for errno in [libc::EIO, libc::ENOLCK, libc::EBADF] {
            let error = open_error(lock_error(&spec, io(errno)), "emu:/x/p.img");
            assert!(error.downcast_ref::<crate::Unusable>().is_none(), "errno {errno} made status 2: {error:#}");
        }
        let failed_open =
            tutti_devices::DeviceError::OpenFailed { path: "/x/p.img".into(), source: std::io::Error::from_raw_os_error(libc::EIO) };
        assert!(open_error(lock_error(&spec, failed_open), "emu:/x/p.img").downcast_ref::<crate::Unusable>().is_none());
        let not_allowed =
            tutti_devices::DeviceError::OpenFailed { path: "/x/p.img".into(), source: std::io::Error::from_raw_os_error(libc::EACCES) };
        assert!(open_error(lock_error(&spec, not_allowed), "emu:/x/p.img").downcast_ref::<crate::Unusable>().is_some());
        let in_use =
            tutti_devices::DeviceError::DeviceInUse { spec: "emu:/x/p.img".into(), lock: "/x/p.img".into(), holder: "pid 1".into() };
        assert!(open_error(lock_error(&spec, in_use), "emu:/x/p.img").downcast_ref::<crate::Unusable>().is_some());
    }

    #[test]
    fn a_file_that_appeared_after_the_checks_is_checked_for_foreign_contents() {
        // Goal: a run that formats without --overwrite refuses (exit 2) a device holding
        // something other than a tutti pool; a file that did not exist when the run checked, and
        // that another process (a cp, which takes no lock) put there before the run opened it,
        // is checked the same way once locked, not formatted over. Held by the lock step, but
        // replaced at its path since (a mv), is not held: the new file is locked and checked.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("p.img");
        let spec = DeviceSpec::EmuFile(path.clone());
        let options = OpenOptions2 { create_bytes: Some(1 << 20), ..test_options() };
        let foreign = |error: DeviceError| matches!(error, DeviceError::Spec(tutti_devices::DeviceError::ForeignContents { .. }));
        std::fs::write(&path, b"an image the copier wrote").unwrap();
        let mut created = CreatedFiles::default();
        created.refuse_foreign_appearing();
        let error = prepare_file(&spec, options, &mut created).expect_err("formatted over what appeared");
        assert!(foreign(error), "not refused as foreign contents");
        drop(created);
        assert!(path.exists(), "another process's file was removed");
        // With --overwrite (no check asked), or blank: used.
        prepare_file(&spec, options, &mut CreatedFiles::default()).expect("--overwrite formats it");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let mut created = CreatedFiles::default();
        created.refuse_foreign_appearing();
        prepare_file(&spec, options, &mut created).expect("a blank file");
        drop(created);
        // Locked by the lock step, then replaced at its path.
        let locks = tutti_devices::DeviceLocks::acquire(std::slice::from_ref(&spec), directory.path(), false).unwrap();
        let mut created = CreatedFiles::default();
        created.refuse_foreign_appearing();
        created.note_held(locks.paths());
        let other = directory.path().join("other.img");
        std::fs::write(&other, b"another image").unwrap();
        std::fs::rename(&other, &path).unwrap();
        let error = prepare_file(&spec, options, &mut created).expect_err("used a replaced file as held");
        assert!(foreign(error), "not refused as foreign contents");
        // Replaced by a blank one: used, and locked.
        std::fs::write(&other, vec![0u8; 8192]).unwrap();
        std::fs::rename(&other, &path).unwrap();
        prepare_file(&spec, options, &mut created).expect("a blank replacement");
        let probe = std::fs::File::open(&path).unwrap();
        assert!(
            nix::fcntl::Flock::lock(probe, nix::fcntl::FlockArg::LockExclusiveNonblock).is_err(),
            "the run uses a replacement it does not hold locked"
        );
        created.keep_after_success();
    }

    /// Calls `path` a block device (a disk node put where the run saw nothing) and answers
    /// EBUSY for it, as the kernel does for a mounted disk.
    struct BusyDisk {
        path: PathBuf,
        opens: std::cell::Cell<usize>,
    }

    impl tutti_devices::BlockDeviceOpener for BusyDisk {
        fn is_block_device(&self, path: &Path) -> bool {
            path == self.path
        }

        fn open_exclusive(&self, _path: &Path) -> std::io::Result<std::fs::File> {
            self.opens.set(self.opens.get() + 1);
            Err(std::io::Error::from_raw_os_error(libc::EBUSY))
        }
    }

    #[test]
    fn a_block_device_that_appeared_after_the_claims_is_claimed_before_it_is_written() {
        // Goal: a run that writes claims (O_EXCL) every block device it names, but only those
        // there at its lock step; a disk put at a path missing then (a node made, a link) was
        // locked but never claimed when the run opened it, and read as a regular file (a blank
        // first MiB enough): a mounted disk was written, with --overwrite or with a zero first
        // MiB. It is claimed now, and refused as in use (exit 2), unchanged, whether or not the
        // run checks contents; a run that only reads claims nothing, as at its lock step.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("disk");
        let spec = DeviceSpec::EmuFile(path.clone());
        let bytes = vec![0u8; 8 << 20];
        std::fs::write(&path, &bytes).unwrap();
        let opener = BusyDisk { path: path.clone(), opens: std::cell::Cell::new(0) };
        let options = OpenOptions2 { create_bytes: Some(1 << 20), ..test_options() };
        for (count, refuse_foreign) in [(1, false), (2, true)] {
            let mut created = CreatedFiles::default();
            if refuse_foreign {
                created.refuse_foreign_appearing();
            }
            let error = prepare_file_with(&spec, options, &mut created, &opener).expect_err("a disk in use was used");
            assert!(
                matches!(&error, DeviceError::Spec(tutti_devices::DeviceError::BlockDeviceInUse { .. })),
                "refuse_foreign {refuse_foreign}: {error}"
            );
            assert_eq!(opener.opens.get(), count, "refuse_foreign {refuse_foreign}: claimed once");
            drop(created);
            assert!(std::fs::read(&path).unwrap() == bytes, "refuse_foreign {refuse_foreign}: the disk was written or removed");
        }
        let reads = OpenOptions2 { writes: false, ..options };
        prepare_file_with(&spec, reads, &mut CreatedFiles::default(), &opener).expect("a read run reads a disk in use, as fio");
        assert_eq!(opener.opens.get(), 2, "a read run claimed");
    }

    /// Calls `path` a free block device, and claims it by opening `claimed` (another file), so
    /// that the claim's descriptor can be told from the lock's.
    struct FreeDisk {
        path: PathBuf,
        claimed: PathBuf,
    }

    impl tutti_devices::BlockDeviceOpener for FreeDisk {
        fn is_block_device(&self, path: &Path) -> bool {
            path == self.path
        }

        fn open_exclusive(&self, _path: &Path) -> std::io::Result<std::fs::File> {
            std::fs::File::open(&self.claimed)
        }
    }

    /// The watch descriptors of the inotify events queued on `inotify`, in the order they
    /// happened (non-blocking: what is queued now).
    fn inotify_watches(inotify: &std::os::fd::OwnedFd) -> Vec<i32> {
        use std::os::fd::AsRawFd;
        let mut buffer = [0u8; 4096];
        let mut watches = Vec::new();
        loop {
            // SAFETY: the buffer is writable for its length; the descriptor is open.
            let read = unsafe { libc::read(inotify.as_raw_fd(), buffer.as_mut_ptr().cast(), buffer.len()) };
            if read <= 0 {
                return watches;
            }
            let mut at = 0;
            while at + std::mem::size_of::<libc::inotify_event>() <= read as usize {
                // SAFETY: a whole event header lies at `at`, as the kernel wrote it; read unaligned.
                let event: libc::inotify_event = unsafe { std::ptr::read_unaligned(buffer[at..].as_ptr().cast()) };
                watches.push(event.wd);
                at += std::mem::size_of::<libc::inotify_event>() + event.len as usize;
            }
        }
    }

    #[test]
    fn a_claim_taken_after_the_lock_step_is_released_before_the_locks() {
        // Goal: a process that formats a disk (tuttid --format, tutti pool format) takes the
        // lock, then the claim: a run's end must release them the other way round, the claim
        // first, as run.rs and pool.rs do. The claim prepare_file takes on a disk put at a path
        // after the lock step was released after every lock of the run (field order), and a
        // format starting in between got the lock and then EBUSY (exit 2, "in use"). The
        // closes are seen in the order they happen (inotify, both files watched).
        use std::os::fd::FromRawFd;
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("disk");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let claimed = directory.path().join("claimed");
        std::fs::write(&claimed, b"").unwrap();
        let opener = FreeDisk { path: path.clone(), claimed: claimed.clone() };
        let mut created = CreatedFiles::default();
        prepare_file_with(&DeviceSpec::EmuFile(path.clone()), test_options(), &mut created, &opener).expect("a free disk is used");
        assert_eq!(created.claims.iter().map(tutti_devices::BlockDeviceClaims::len).sum::<usize>(), 1, "claimed");
        // SAFETY: inotify_init1 returns a new descriptor (checked) that nothing else owns.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(raw >= 0, "inotify_init1: {}", std::io::Error::last_os_error());
        // SAFETY: as above.
        let inotify = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
        let watch = |file: &Path| {
            use std::os::fd::AsRawFd;
            let name = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: a NUL-terminated path and an open inotify descriptor.
            let watch = unsafe { libc::inotify_add_watch(inotify.as_raw_fd(), name.as_ptr(), libc::IN_CLOSE) };
            assert!(watch >= 0, "inotify_add_watch: {}", std::io::Error::last_os_error());
            watch
        };
        let (lock, claim) = (watch(&path), watch(&claimed));
        assert_eq!(inotify_watches(&inotify), Vec::<i32>::new(), "nothing closed yet");
        drop(created);
        assert_eq!(inotify_watches(&inotify), vec![claim, lock], "the claim ({claim}) is released before the lock ({lock})");
    }

    /// Writable, 4 KiB transfers, one queue, nothing created or laid out.
    fn test_options() -> OpenOptions2 {
        OpenOptions2 {
            writes: true,
            create_bytes: None,
            io_bytes_max: 4096,
            queues: 1,
            timing: None,
            lay_out: false,
            shadow_doorbells: false,
        }
    }

    /// A 16 MiB in-memory software controller opened as the raw workload opens one.
    fn memory_controller(options: OpenOptions2) -> OpenedDevice {
        let emu = EmuOptions { config: emu_config(options), create_bytes: None };
        let opened = open_in_one_space(&[DeviceSpec::EmuMemory(16 << 20)], &emu).expect("open emu:mem");
        opened.into_iter().next().expect("one device")
    }

    fn memory_device() -> NvmeDevice {
        let options = test_options();
        NvmeDevice::init(memory_controller(options), options).expect("init")
    }

    /// 1 MiB/s each way, no collapse, 1 ms per command: one 64 MiB I/O takes 64 s.
    const SLOW_MODEL: nvme_emu::TimingModel = nvme_emu::TimingModel {
        read_bytes_per_s: 1 << 20,
        write_bytes_per_s: 1 << 20,
        mixed_share_permille: 1000,
        command_latency: Duration::from_millis(1),
    };

    #[test]
    fn a_timing_model_stretches_the_wait_bound_to_what_it_makes_transfers_take() {
        // Goal: under a slow --emu-timing model a valid run's I/O takes longer than the fixed
        // 30 s (one 64 MiB I/O at 1 MiB/s: 64 s) and the run failed as a stuck device. The bound
        // is four times what the model makes the bytes take (the slower direction, at its mixed
        // share, plus a command latency), never below the default, never past WAIT_BOUND_MAX.
        assert_eq!(wait_bound(IO_TIMEOUT, None, Traffic::Both, 1 << 40), IO_TIMEOUT, "no model: the default");
        assert_eq!(wait_bound(IO_TIMEOUT, Some(SLOW_MODEL), Traffic::Both, 4096), IO_TIMEOUT, "a few ms: the default");
        let bound = wait_bound(IO_TIMEOUT, Some(SLOW_MODEL), Traffic::Both, 64 << 20);
        assert!(bound >= Duration::from_secs(4 * 64) && bound < Duration::from_secs(4 * 65), "{bound:?}");
        // The slower direction under mixed traffic: writes at 0.5 MiB/s, half of it mixed.
        let collapsing = nvme_emu::TimingModel { write_bytes_per_s: 1 << 19, mixed_share_permille: 500, ..SLOW_MODEL };
        let bound = wait_bound(IO_TIMEOUT, Some(collapsing), Traffic::Both, 16 << 20);
        assert!(bound >= Duration::from_secs(4 * 64) && bound < Duration::from_secs(4 * 65), "{bound:?}");
        // Bounded whatever the figures: the deadline it makes can be computed.
        let crawling = nvme_emu::TimingModel { read_bytes_per_s: 1, write_bytes_per_s: 1, ..SLOW_MODEL };
        let bound = wait_bound(IO_TIMEOUT, Some(crawling), Traffic::Both, u64::MAX);
        assert_eq!(bound, WAIT_BOUND_MAX);
        assert!(Instant::now().checked_add(bound).is_some());
    }

    #[test]
    fn a_run_that_moves_one_direction_is_bounded_by_that_direction_s_solo_rate() {
        // Goal: the bound took the slower direction at its mixed-traffic share whatever the run
        // moved: a reads-only run on a model with fast reads and slow writes was bounded by the
        // writes' pace (here 1024 times too loose). A direction moved alone runs at its solo
        // rate (the model collapses a direction only while the other one also transfers); the
        // slower at its share only where both move.
        let lopsided = nvme_emu::TimingModel {
            read_bytes_per_s: 1 << 20,
            write_bytes_per_s: 1 << 10,
            mixed_share_permille: 500,
            command_latency: Duration::from_millis(1),
        };
        let bytes = 64 << 20;
        let reads = wait_bound(IO_TIMEOUT, Some(lopsided), Traffic::Reads, bytes);
        assert!(reads >= Duration::from_secs(4 * 64) && reads < Duration::from_secs(4 * 65), "reads: {reads:?}");
        let writes = wait_bound(IO_TIMEOUT, Some(lopsided), Traffic::Writes, 64 << 10);
        assert!(writes >= Duration::from_secs(4 * 64) && writes < Duration::from_secs(4 * 65), "writes: {writes:?}");
        // Both: the writes at half their 1 KiB/s.
        let both = wait_bound(IO_TIMEOUT, Some(lopsided), Traffic::Both, 32 << 10);
        assert!(both >= Duration::from_secs(4 * 64) && both < Duration::from_secs(4 * 65), "both: {both:?}");
        // A raw phase's pattern says what it moves; randrw moves both unless its mix is one-sided.
        assert_eq!(Traffic::of(crate::args::Pattern::Randread, 50), Traffic::Reads);
        assert_eq!(Traffic::of(crate::args::Pattern::Write, 50), Traffic::Writes);
        assert_eq!(Traffic::of(crate::args::Pattern::Randrw, 50), Traffic::Both);
        assert_eq!(Traffic::of(crate::args::Pattern::Randrw, 100), Traffic::Reads);
        assert_eq!(Traffic::of(crate::args::Pattern::Randrw, 0), Traffic::Writes);
    }

    #[test]
    fn a_queue_under_a_timing_model_waits_as_long_as_its_devices_queued_bytes_take() {
        // Goal: a job's wait for its next completion may sit behind every I/O the jobs queued
        // on the device (each job's queue: --iodepth buffers of --bs), which the model passes
        // one after another: 2 jobs × 4 × 1 MiB at 1 MiB/s is 8 s, bounded at 32 s or more,
        // not at the fixed 30 s. A device without a model keeps the default.
        let options = OpenOptions2 { io_bytes_max: 1 << 20, queues: 2, timing: Some(SLOW_MODEL), ..test_options() };
        let device = NvmeDevice::init(memory_controller(options), options).expect("init");
        let queue = device.open_queue(4, 1 << 20, Traffic::Both).expect("queue");
        assert!(queue.io_timeout() >= Duration::from_secs(32), "{:?}", queue.io_timeout());
        let queue = memory_device().open_queue(4, 1 << 20, Traffic::Both).expect("queue");
        assert_eq!(queue.io_timeout(), IO_TIMEOUT);
    }

    /// Runs `job` on a thread of its own and fails if it has not finished within `limit` (a wait
    /// that never gives up must fail the test, not hang it).
    fn finishes_within<T: Send + 'static>(limit: Duration, job: impl FnOnce() -> T + Send + 'static) -> T {
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = sender.send(job());
        });
        receiver.recv_timeout(limit).expect("the wait did not return in time")
    }

    #[test]
    fn both_waiters_reap_every_read_into_its_own_slot() {
        // Goal: the VFIO waiter (polls back to back, no spin hint) and the software
        // controller's (spins, then yields) hand each completion to its slot, once.
        for waiter in [Waiter::Polls, Waiter::SharesOurCores] {
            let counts = finishes_within(Duration::from_secs(60), move || {
                let device = memory_device();
                let depth = 4u32;
                let mut queue = device.open_nvme_queue(depth, 4096, Traffic::Both, waiter).expect("queue");
                let mut counts = vec![0u32; depth as usize];
                let deadline = Instant::now() + IO_TIMEOUT;
                for round in 0..64u64 {
                    for slot in 0..depth {
                        queue.queue(slot, Direction::Read, (round * u64::from(depth) + u64::from(slot)) * 4096).expect("queue read");
                    }
                    let mut done = 0;
                    while done < depth as usize {
                        done += queue
                            .submit_and_reap(true, deadline, &mut |slot, result| {
                                result.expect("read");
                                counts[slot as usize] += 1;
                            })
                            .expect("wait");
                    }
                }
                counts
            });
            assert_eq!(counts, vec![64; 4], "{waiter:?}");
        }
    }

    #[test]
    fn a_deep_queue_publishes_each_half_of_a_refill_before_its_doorbell() {
        // Goal: a queue of 32 commands rings the SQ doorbell as each 16th command is queued, so
        // the device starts on them while the rest are built (the controller runs them with no
        // submit_and_reap); a queue under 16 commands leaves the whole batch to
        // submit_and_reap's doorbell.
        finishes_within(Duration::from_secs(60), || {
            let device = memory_device();
            let mut deep = device.open_nvme_queue(32, 4096, Traffic::Both, Waiter::Polls).expect("deep queue");
            for slot in 0..31u32 {
                deep.queue(slot, Direction::Read, u64::from(slot) * 4096).expect("queue read");
                let expected = (slot as usize + 1) % 16;
                assert_eq!(deep.pair.as_ref().expect("pair").unpublished_submissions(), expected, "after {} queued", slot + 1);
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut completed = 0;
            while completed < 16 {
                assert!(Instant::now() < deadline, "the 16 published reads did not complete ({completed} did)");
                completed +=
                    deep.pair.as_mut().expect("pair").reap(usize::MAX, |completion| assert!(completion.status.is_ok())).expect("reap");
            }
            assert_eq!(completed, 16, "only the published reads ran");
            let mut reaped = 0;
            while reaped < 15 {
                reaped += deep.submit_and_reap(true, deadline, &mut |_, result| result.expect("read")).expect("wait");
            }
            drop(deep);

            let mut shallow = device.open_nvme_queue(8, 4096, Traffic::Both, Waiter::Polls).expect("shallow queue");
            for slot in 0..8u32 {
                shallow.queue(slot, Direction::Read, u64::from(slot) * 4096).expect("queue read");
            }
            assert_eq!(shallow.pair.as_ref().expect("pair").unpublished_submissions(), 8, "a shallow queue rings once per batch");
            let mut reaped = 0;
            while reaped < 8 {
                reaped += shallow.submit_and_reap(true, deadline, &mut |_, result| result.expect("read")).expect("wait");
            }
        });
    }

    #[test]
    fn buffers_of_a_queue_pair_that_could_not_be_deleted_are_kept() {
        // Goal: a device may still write the buffers its commands name until their queue pair
        // is deleted; when that delete fails (the controller swallows a read's completion and
        // the admin Delete I/O SQ's) the buffers must be kept for good, counted and logged,
        // not freed for the next allocation to reuse under a late write.
        let leaked = finishes_within(Duration::from_secs(60), || {
            let options = test_options();
            let device =
                NvmeDevice::init_with_admin_timeout(memory_controller(options), options, Duration::from_millis(300)).expect("init");
            let plan = FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)).with_rule(FaultRule {
                repeat: true,
                ..FaultRule::on_nth_admin(1, nvme_driver::spec::AdminOpcode::DeleteIoSubmissionQueue, FaultAction::DropCompletion)
            });
            device.emulator.as_ref().expect("software controller").set_faults(plan);
            let mut queue = device.open_nvme_queue(4, 4096, Traffic::Both, Waiter::SharesOurCores).expect("queue");
            queue.io_timeout = Duration::from_millis(100);
            queue.queue(0, Direction::Read, 0).expect("queue read");
            let _ = queue.submit_and_reap(false, Instant::now(), &mut |_, _| {});
            let before = leaked_dma_bytes();
            drop(queue);
            leaked_dma_bytes() - before
        });
        assert!(leaked >= 4 * 4096, "{leaked} bytes kept: the buffers were freed though the pair was not deleted");
    }

    #[test]
    fn the_polling_waiter_gives_up_at_its_deadline() {
        // Goal: a waiter that never yields is still bounded: a completion held back past the
        // deadline fails the wait with Timeout, soon after the deadline.
        let (result, waited) = finishes_within(Duration::from_secs(20), || {
            let device = memory_device();
            let delay = FaultAction::Delay(Duration::from_millis(600));
            device.emulator.as_ref().expect("software controller").set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, delay)));
            let mut queue = device.open_nvme_queue(1, 4096, Traffic::Both, Waiter::Polls).expect("queue");
            queue.queue(0, Direction::Read, 0).expect("queue read");
            let started = Instant::now();
            let result = queue.submit_and_reap(true, started + Duration::from_millis(100), &mut |_, _| {});
            let waited = started.elapsed();
            // Dropping the queue drains it: the delayed completion arrives, then the pair goes.
            (matches!(result, Err(DeviceError::Timeout { in_flight: 1, .. })).then_some(()).ok_or(format!("{result:?}")), waited)
        });
        result.expect("a completion 600 ms late must fail a 100 ms wait with Timeout");
        assert!(waited >= Duration::from_millis(100) && waited < Duration::from_millis(500), "gave up after {waited:?}");
    }
}
