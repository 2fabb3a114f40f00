//! The kernel path: io_uring with `O_DIRECT` on a file or block device — the CPU-centric
//! comparator, and the fallback where VFIO cannot be used. The ring, its page-aligned buffers and
//! its bounded waits are the shared `tutti-uring` crate's; this module also holds the binary's
//! remaining unsafe code (block-device ioctls, getrusage, statvfs, the interrupt handler).
//!
//! Per job: one ring with `depth` entries and one page-aligned buffer of `bs` bytes per slot,
//! allocated when the queue opens. A slot's buffer is lent to the ring while its I/O is in flight
//! and comes back with the completion. Each I/O is submitted as it is queued and the loop's wait
//! is one more `io_uring_enter` (like fio's io_uring engine with its defaults: no fixed buffers,
//! iodepth_batch_submit=1), and every wait carries the run's deadline, so a stuck device fails
//! the run instead of hanging it. The ring is set up with the
//! flags fio's engine uses (`tutti_uring::SetupFlags::FIO`: CQSIZE, COOP_TASKRUN, SINGLE_ISSUER,
//! DEFER_TASKRUN), or with those of them the kernel accepts; the device line and the JSON say
//! which. A queue is opened, driven and dropped on its job's thread (the single issuer).

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tutti_uring::{AlignedBuffer, Refused, Ring, SetupFlags, Transfer, UringError};

use crate::args::format_size;
use crate::devices::{Device, DeviceError, Direction, IoQueue, Traffic, Visibility, IO_TIMEOUT};

/// `O_DIRECT` needs buffers, offsets and lengths aligned to the logical block size; a page covers
/// every device we expect.
const BUFFER_ALIGNMENT_BYTES: usize = AlignedBuffer::ALIGNMENT_BYTES;

/// `BLKGETSIZE64` and `BLKSSZGET` from `<linux/fs.h>`.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;

pub struct UringDevice {
    path: PathBuf,
    file: Arc<File>,
    /// The file's device and inode ([`UringDevice::file_id`]).
    id: (u64, u64),
    capacity_bytes: u64,
    block_size_bytes: u32,
    block_device: bool,
    /// The ring setup flags this kernel accepts of fio's, found once at open: every queue asks
    /// for exactly these.
    setup_flags: SetupFlags,
}

impl UringDevice {
    /// The device and inode of the file opened, to compare with the one the run locked.
    pub fn file_id(&self) -> (u64, u64) {
        // Examined at open; a file's device and inode never change while it is open.
        self.id
    }

    pub fn open(path: &Path, writable: bool) -> Result<Self, DeviceError> {
        let setup = |context: &str, error: std::io::Error| DeviceError::Setup(format!("uring:{}: {context}: {error}", path.display()));
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(|error| setup("cannot open with O_DIRECT", error))?;
        let metadata = file.metadata().map_err(|error| setup("cannot stat", error))?;
        let block_device = metadata.file_type().is_block_device();
        let (capacity_bytes, block_size_bytes) = if block_device {
            let mut bytes: u64 = 0;
            // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at `bytes`.
            let status = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut bytes as *mut u64) };
            if status != 0 {
                return Err(setup("BLKGETSIZE64", std::io::Error::last_os_error()));
            }
            let mut sector: libc::c_int = 0;
            // SAFETY: BLKSSZGET writes one int through the pointer, which points at `sector`.
            let status = unsafe { libc::ioctl(file.as_raw_fd(), BLKSSZGET, &mut sector as *mut libc::c_int) };
            if status != 0 || sector <= 0 {
                return Err(setup("BLKSSZGET", std::io::Error::last_os_error()));
            }
            (bytes, sector as u32)
        } else if metadata.file_type().is_file() {
            (metadata.len(), BUFFER_ALIGNMENT_BYTES as u32)
        } else {
            return Err(DeviceError::Setup(format!("uring:{}: not a regular file or block device", path.display())));
        };
        // A small ring set up as fio's, to learn (and print) which flags this kernel accepts.
        let setup_flags = Ring::with_setup(2, SetupFlags::FIO)
            .map_err(|error| DeviceError::Setup(format!("uring:{}: {error}", path.display())))?
            .setup_flags();
        let id = (metadata.dev(), metadata.ino());
        Ok(Self { path: path.to_path_buf(), file: Arc::new(file), id, capacity_bytes, block_size_bytes, block_device, setup_flags })
    }
}

impl Device for UringDevice {
    fn name(&self) -> String {
        format!("uring:{}", self.path.display())
    }

    fn describe(&self) -> String {
        let kind = if self.block_device { "block device" } else { "file" };
        format!(
            "kernel io_uring, O_DIRECT, on {kind} {}{} of {}, ring setup {}{}",
            self.path.display(),
            crate::filesystems::memory_note(&self.path),
            format_size(self.capacity_bytes),
            self.setup_flags,
            if self.setup_flags == SetupFlags::FIO { " (as fio's)" } else { " (fio's less what this kernel refused)" },
        )
    }

    fn ring_setup(&self) -> Option<String> {
        Some(self.setup_flags.to_string())
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    fn block_size_bytes(&self) -> u32 {
        self.block_size_bytes
    }

    fn open_queue(&self, depth: u32, slot_bytes: usize, _traffic: Traffic) -> Result<Box<dyn IoQueue>, DeviceError> {
        let name = self.name();
        let ring = Ring::with_setup(depth, self.setup_flags).map_err(|error| DeviceError::Setup(format!("{name}: {error}")))?;
        // A job that writes fills the buffers with pseudorandom bytes itself (`run_job`).
        let mut buffers = Vec::with_capacity(depth as usize);
        for _ in 0..depth {
            let buffer = AlignedBuffer::with_capacity(slot_bytes)
                .map_err(|error| DeviceError::Setup(format!("{name}: {depth} buffers of {slot_bytes} bytes: {error}")))?;
            buffers.push(buffer);
        }
        Ok(Box::new(UringQueue {
            name,
            ring,
            file: Arc::clone(&self.file),
            buffers,
            slot_bytes,
            directions: vec![Direction::Read; depth as usize],
            offsets_bytes: vec![0; depth as usize],
        }))
    }
}

struct UringQueue {
    name: String,
    /// Declared before `file`: dropping the ring (which drains or leaks what is in flight)
    /// happens while the file is still open.
    ring: Ring,
    file: Arc<File>,
    /// One buffer per slot; empty while the slot's I/O is in flight (the ring holds it then).
    buffers: Vec<AlignedBuffer>,
    slot_bytes: usize,
    directions: Vec<Direction>,
    offsets_bytes: Vec<u64>,
}

impl UringQueue {
    /// The slot's buffer, if the slot is idle (its buffer is home, not lent to the ring).
    fn idle_buffer(&self, slot: u32) -> Result<&AlignedBuffer, DeviceError> {
        let buffer =
            self.buffers.get(slot as usize).ok_or_else(|| DeviceError::Setup(format!("{}: slot {slot} out of range", self.name)))?;
        if buffer.capacity_bytes() < self.slot_bytes {
            return Err(DeviceError::Setup(format!("{}: slot {slot} has an I/O in flight", self.name)));
        }
        Ok(buffer)
    }
}

/// A failed submit or wait, as the run reports it.
fn enter_error(name: &str, error: UringError) -> DeviceError {
    match error {
        UringError::Timeout { in_flight, .. } => {
            DeviceError::Timeout { device: name.to_string(), timeout_s: IO_TIMEOUT.as_secs(), in_flight }
        }
        UringError::Enter { source } => DeviceError::Io { device: name.to_string(), context: "io_uring_enter".into(), source },
        other => DeviceError::Setup(format!("{name}: {other}")),
    }
}

impl IoQueue for UringQueue {
    fn queue(&mut self, slot: u32, direction: Direction, offset_bytes: u64) -> Result<Visibility, DeviceError> {
        self.idle_buffer(slot)?;
        let index = slot as usize;
        let buffer = std::mem::take(&mut self.buffers[index]);
        let kernel_direction = match direction {
            Direction::Read => tutti_uring::Direction::Read,
            Direction::Write => tutti_uring::Direction::Write,
        };
        let transfer = Transfer { fd: self.file.as_raw_fd(), direction: kernel_direction, offset_bytes, len_bytes: self.slot_bytes };
        match self.ring.push(transfer, buffer, u64::from(slot)) {
            Ok(()) => {
                self.directions[index] = direction;
                self.offsets_bytes[index] = offset_bytes;
                // Each I/O goes to the kernel as it is queued, as fio's engine does by default
                // (iodepth_batch_submit=1): one enter per batch ran the batch's submissions back
                // to back while its completions waited, and the disk's queue ran short (~0.87 of
                // fio's 4 KiB random-read IOPS at QD 32; docs/tutti-bench.md).
                self.ring.submit().map_err(|error| enter_error(&self.name, error))?;
                Ok(Visibility::Published)
            }
            Err(Refused { buffer, error }) => {
                self.buffers[index] = buffer;
                match error {
                    UringError::Full { .. } => Err(DeviceError::Backpressure { device: self.name.clone() }),
                    other => Err(DeviceError::Setup(format!("{}: {other}", self.name))),
                }
            }
        }
    }

    fn submit_and_reap(
        &mut self,
        wait: bool,
        deadline: Instant,
        on_done: &mut dyn FnMut(u32, Result<(), DeviceError>),
    ) -> Result<usize, DeviceError> {
        let submitted = if wait { self.ring.wait(deadline) } else { self.ring.submit() };
        submitted.map_err(|error| enter_error(&self.name, error))?;
        let Self { ring, buffers, directions, offsets_bytes, name, .. } = self;
        let reaped = ring.reap(|completion| {
            // The tag is a slot index this queue pushed (below the depth).
            let index = completion.tag as usize;
            let outcome = completion.check().map_err(|error| DeviceError::Command {
                device: name.clone(),
                direction: directions[index],
                offset_bytes: offsets_bytes[index],
                reason: match error {
                    UringError::Transfer { source, .. } => source.to_string(),
                    UringError::ShortTransfer { done_bytes, len_bytes, .. } => {
                        format!("short transfer: {done_bytes} of {len_bytes} bytes (past the end of the file?)")
                    }
                    other => other.to_string(),
                },
            });
            buffers[index] = completion.buffer;
            on_done(completion.tag as u32, outcome);
        });
        reaped.map_err(|error| match error {
            UringError::UnexpectedCompletion { user_data } => {
                DeviceError::UnexpectedCompletion { device: self.name.clone(), slot: user_data }
            }
            other => DeviceError::Setup(format!("{}: {other}", self.name)),
        })
    }

    fn write_buffer(&mut self, slot: u32, source: &[u8]) -> Result<(), DeviceError> {
        self.idle_buffer(slot)?;
        let len = source.len().min(self.slot_bytes);
        self.buffers[slot as usize].slice(len).copy_from_slice(&source[..len]);
        Ok(())
    }

    fn stamp_buffer(&mut self, slot: u32, stamp: u64) -> Result<(), DeviceError> {
        self.idle_buffer(slot)?;
        let buffer = self.buffers[slot as usize].slice(self.slot_bytes);
        for (chunk, bytes) in buffer.chunks_mut(crate::devices::STAMP_CHUNK_BYTES).enumerate() {
            let value = stamp.wrapping_add((chunk * crate::devices::STAMP_CHUNK_BYTES) as u64).to_le_bytes();
            bytes[..8].copy_from_slice(&value);
        }
        Ok(())
    }

    fn read_buffer(&self, slot: u32, destination: &mut [u8]) -> Result<(), DeviceError> {
        let buffer = self.idle_buffer(slot)?;
        let len = destination.len().min(self.slot_bytes);
        destination[..len].copy_from_slice(buffer.bytes(len));
        Ok(())
    }

    fn drain(&mut self, deadline: Instant) {
        while self.ring.in_flight() > 0 && Instant::now() < deadline {
            if self.submit_and_reap(true, deadline, &mut |_, _| {}).is_err() {
                break;
            }
        }
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        // The ring leaks (never frees) the buffers of I/Os still in flight when it is dropped.
        self.drain(Instant::now() + IO_TIMEOUT);
    }
}

/// Now on `CLOCK_MONOTONIC` in nanoseconds (`clock_gettime(2)`), here because this module holds
/// the binary's unsafe code. It is the clock `Instant` reads on Linux, and one clock for the
/// whole system, so that times taken in different processes compare; `None` if the call fails.
pub fn monotonic_now_ns() -> Option<u64> {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one `struct timespec` through the pointer, which points at a
    // live, initialised value of that type.
    let status = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    if status != 0 {
        return None;
    }
    let seconds = u64::try_from(now.tv_sec).ok()?;
    let nanos = u64::try_from(now.tv_nsec).ok()?;
    seconds.checked_mul(1_000_000_000)?.checked_add(nanos)
}

/// `getrusage(2)`, here because this module holds the binary's unsafe code.
pub fn getrusage(who: libc::c_int) -> Option<libc::rusage> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `struct rusage` through the pointer, which points at memory
    // of that type; on success it is fully initialised (and it was zeroed before anyway).
    let status = unsafe { libc::getrusage(who, usage.as_mut_ptr()) };
    // SAFETY: zero is a valid `rusage` (plain integers), and getrusage only wrote valid values.
    (status == 0).then(|| unsafe { usage.assume_init() })
}

/// Bytes available to an unprivileged user on the filesystem holding `directory` (`statvfs(3)`).
pub fn statvfs_free_bytes(directory: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path =
        std::ffi::CString::new(directory.as_os_str().as_bytes()).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let mut stats = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `path` is a NUL-terminated string that outlives the call; statvfs writes one
    // `struct statvfs` through the second pointer, which points at memory of that type.
    let status = unsafe { libc::statvfs(path.as_ptr(), stats.as_mut_ptr()) };
    if status != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs succeeded, so the structure is initialised (it was zeroed before anyway).
    let stats = unsafe { stats.assume_init() };
    // The field types differ between targets (u64 here, u32 on some 32-bit ones).
    #[allow(clippy::useless_conversion)]
    let free = u64::from(stats.f_bavail).saturating_mul(u64::from(stats.f_frsize));
    Ok(free)
}

/// Most files an interrupted run removes: the temporary pool, or the files a run creates (one
/// per device of a stripe); past this, a file is left for the failed run's own cleanup only.
const INTERRUPT_REMOVES_MAX: usize = 64;

/// Files an interrupted run must not leave behind: a fixed static list, so that the signal
/// handler reads it with atomic loads alone (no lock, no allocation). Each entry is a
/// NUL-terminated path leaked for the rest of the process (never freed: the handler may be
/// reading one on another thread), or null (empty, or kept after all).
static INTERRUPT_REMOVES: [std::sync::atomic::AtomicPtr<libc::c_char>; INTERRUPT_REMOVES_MAX] =
    [const { std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()) }; INTERRUPT_REMOVES_MAX];

static INTERRUPT_HANDLER: std::sync::Once = std::sync::Once::new();

extern "C" fn remove_pool_and_exit(_signal: libc::c_int) {
    for entry in &INTERRUPT_REMOVES {
        let path = entry.load(std::sync::atomic::Ordering::Acquire);
        if !path.is_null() {
            // SAFETY: unlink(2) is async-signal-safe; a non-null entry is a NUL-terminated
            // string leaked for the rest of the process (`remove_on_interrupt`).
            unsafe { libc::unlink(path) };
        }
    }
    // SAFETY: _exit is async-signal-safe and ends the process without running Rust code.
    unsafe { libc::_exit(130) }
}

/// On SIGINT/SIGTERM, removes `path` (with every other file registered so) and exits with
/// status 130, so that interrupting a run does not leave behind the files it created (up to
/// 1 GiB of temporary pool in the temp directory). Best effort: returns false if not set up.
pub fn remove_on_interrupt(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return false };
    let raw = path.into_raw();
    let placed = INTERRUPT_REMOVES.iter().any(|entry| {
        entry.compare_exchange(std::ptr::null_mut(), raw, std::sync::atomic::Ordering::AcqRel, std::sync::atomic::Ordering::Acquire).is_ok()
    });
    if !placed {
        // SAFETY: `raw` came from `CString::into_raw` just above and was not stored anywhere.
        drop(unsafe { std::ffi::CString::from_raw(raw) });
        return false;
    }
    handle_interrupts();
    true
}

/// From now on SIGINT and SIGTERM end the run with status 130, removing the files registered
/// with [`remove_on_interrupt`] (none yet is fine): `main` calls it first thing, so that every
/// run, one on `emu:mem:` too, exits 130 as documented instead of dying by the signal. A signal
/// the process inherited as ignored (a `nohup` or background job's SIGINT) stays ignored, as in
/// any Unix tool. Once per process; later calls do nothing.
pub fn handle_interrupts() {
    INTERRUPT_HANDLER.call_once(|| {
        let handler = remove_pool_and_exit as extern "C" fn(libc::c_int) as libc::sighandler_t;
        for signal in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: a zeroed sigaction is a valid out-parameter; sigaction with a null `act`
            // only reads the current disposition.
            let ignored = unsafe {
                let mut old: libc::sigaction = std::mem::zeroed();
                libc::sigaction(signal, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
            };
            if ignored {
                continue;
            }
            // SAFETY: the handler only calls async-signal-safe functions (see above); `signal`
            // replaces the default disposition of a signal that would otherwise kill the
            // process anyway.
            unsafe { libc::signal(signal, handler) };
        }
    });
}

/// Takes `path` off the list an interrupt removes: a run that succeeded keeps its files.
pub fn keep_on_interrupt(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let wanted = path.as_os_str().as_bytes();
    for entry in &INTERRUPT_REMOVES {
        let current = entry.load(std::sync::atomic::Ordering::Acquire);
        // SAFETY: a non-null entry is a NUL-terminated string leaked for the rest of the process.
        if !current.is_null() && unsafe { std::ffi::CStr::from_ptr(current) }.to_bytes() == wanted {
            // The string itself stays leaked: the handler may be reading it right now.
            let _ = entry.compare_exchange(
                current,
                std::ptr::null_mut(),
                std::sync::atomic::Ordering::AcqRel,
                std::sync::atomic::Ordering::Acquire,
            );
        }
    }
}
