//! The kernel path: io_uring with `O_DIRECT` on a file or block device — the CPU-centric
//! comparator, and the fallback where VFIO cannot be used. All of this binary's unsafe code is in
//! this module.
//!
//! Per job: one ring with `depth` entries and one page-aligned buffer of `depth × bs` bytes
//! allocated when the queue opens. Submission and waiting share one `io_uring_enter` per loop
//! (like fio's io_uring engine without fixed buffers), and every wait carries a timeout
//! (`IORING_ENTER_EXT_ARG`), so a stuck device fails the run instead of hanging it.

use std::alloc::Layout;
use std::fs::{File, OpenOptions};
use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

use io_uring::{opcode, types, IoUring};

use crate::args::format_size;
use crate::devices::{Device, DeviceError, Direction, IoQueue, IO_TIMEOUT};

/// `O_DIRECT` needs buffers, offsets and lengths aligned to the logical block size; a page covers
/// every device we expect.
const BUFFER_ALIGNMENT_BYTES: usize = 4096;

/// `BLKGETSIZE64` and `BLKSSZGET` from `<linux/fs.h>`.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;

pub struct UringDevice {
    path: PathBuf,
    file: Arc<File>,
    capacity_bytes: u64,
    block_size_bytes: u32,
    block_device: bool,
}

impl UringDevice {
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
        Ok(Self { path: path.to_path_buf(), file: Arc::new(file), capacity_bytes, block_size_bytes, block_device })
    }
}

impl Device for UringDevice {
    fn name(&self) -> String {
        format!("uring:{}", self.path.display())
    }

    fn describe(&self) -> String {
        let kind = if self.block_device { "block device" } else { "file" };
        format!("kernel io_uring, O_DIRECT, on {kind} {} of {}", self.path.display(), format_size(self.capacity_bytes))
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    fn block_size_bytes(&self) -> u32 {
        self.block_size_bytes
    }

    fn open_queue(&self, depth: u32, slot_bytes: usize) -> Result<Box<dyn IoQueue>, DeviceError> {
        let name = self.name();
        let ring = IoUring::new(depth.next_power_of_two().max(2)).map_err(|source| DeviceError::Io {
            device: name.clone(),
            context: "io_uring_setup".into(),
            source,
        })?;
        if !ring.params().is_feature_ext_arg() {
            return Err(DeviceError::Setup(format!("{name}: the kernel's io_uring lacks EXT_ARG (Linux 5.11+), needed for bounded waits")));
        }
        let slot_len = u32::try_from(slot_bytes).map_err(|_| DeviceError::Setup(format!("{name}: block size {slot_bytes} too large")))?;
        let buffers = AlignedBuffer::new(slot_bytes * depth as usize)
            .ok_or_else(|| DeviceError::Setup(format!("{name}: cannot allocate {depth} × {slot_bytes} bytes of buffers")))?;
        let fill: Vec<u8> = (0..slot_bytes).map(|index| (index as u8).wrapping_mul(31) ^ 0xa5).collect();
        for slot in 0..depth as usize {
            buffers.copy_in(slot * slot_bytes, &fill);
        }
        Ok(Box::new(UringQueue {
            name,
            ring,
            file: Arc::clone(&self.file),
            buffers: ManuallyDrop::new(buffers),
            slot_bytes,
            slot_len,
            in_flight: 0,
            directions: vec![Direction::Read; depth as usize],
            offsets_bytes: vec![0; depth as usize],
        }))
    }
}

/// Page-aligned heap memory the kernel reads and writes by DMA. Never exposed as a Rust
/// reference: the kernel may write it while an I/O is in flight.
struct AlignedBuffer {
    pointer: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain heap memory owned by this value; access goes through `copy_in` /
// `copy_out`, whose callers guarantee no I/O on the range is in flight.
unsafe impl Send for AlignedBuffer {}

impl AlignedBuffer {
    fn new(len: usize) -> Option<Self> {
        let layout = Layout::from_size_align(len.max(BUFFER_ALIGNMENT_BYTES), BUFFER_ALIGNMENT_BYTES).ok()?;
        // SAFETY: the layout has a non-zero size (at least one page).
        let pointer = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(Self { pointer, layout })
    }

    fn address(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset < self.layout.size());
        // SAFETY: callers pass offsets inside the allocation (slot × slot size < depth × slot size).
        unsafe { self.pointer.as_ptr().add(offset) }
    }

    fn copy_in(&self, offset: usize, source: &[u8]) {
        let len = source.len().min(self.layout.size().saturating_sub(offset));
        // SAFETY: `offset..offset+len` is inside the allocation (clamped above); `source` is
        // ordinary memory that cannot overlap it; no I/O uses the range (caller's protocol).
        unsafe { std::ptr::copy_nonoverlapping(source.as_ptr(), self.address(offset), len) }
    }

    fn copy_out(&self, offset: usize, destination: &mut [u8]) {
        let len = destination.len().min(self.layout.size().saturating_sub(offset));
        // SAFETY: as in `copy_in`, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(self.address(offset), destination.as_mut_ptr(), len) }
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; `UringQueue::drop` leaks the buffer instead
        // of dropping it while the kernel may still write into it.
        unsafe { std::alloc::dealloc(self.pointer.as_ptr(), self.layout) }
    }
}

struct UringQueue {
    name: String,
    ring: IoUring,
    file: Arc<File>,
    /// Dropped by hand in `Drop`, only once no I/O is in flight.
    buffers: ManuallyDrop<AlignedBuffer>,
    slot_bytes: usize,
    slot_len: u32,
    in_flight: usize,
    directions: Vec<Direction>,
    offsets_bytes: Vec<u64>,
}

impl UringQueue {
    fn timespec_until(deadline: Instant) -> types::Timespec {
        let left = deadline.saturating_duration_since(Instant::now());
        types::Timespec::new().sec(left.as_secs()).nsec(left.subsec_nanos())
    }
}

impl IoQueue for UringQueue {
    fn queue(&mut self, slot: u32, direction: Direction, offset_bytes: u64) -> Result<(), DeviceError> {
        let index = slot as usize;
        if index >= self.directions.len() {
            return Err(DeviceError::Setup(format!("{}: slot {slot} out of range", self.name)));
        }
        let fd = types::Fd(self.file.as_raw_fd());
        let buffer = self.buffers.address(index * self.slot_bytes);
        let entry = match direction {
            Direction::Read => opcode::Read::new(fd, buffer, self.slot_len).offset(offset_bytes).build(),
            Direction::Write => opcode::Write::new(fd, buffer.cast_const(), self.slot_len).offset(offset_bytes).build(),
        }
        .user_data(u64::from(slot));
        // The slot is not reused before its completion is reaped (caller's protocol).
        // SAFETY: the entry points at this slot's part of `buffers` (slot_len bytes, in bounds) and at `file`'s
        // descriptor; both live as long as the ring (fields of `self`; drop waits for in-flight I/O or leaks).
        let pushed = unsafe { self.ring.submission().push(&entry) };
        if pushed.is_err() {
            return Err(DeviceError::Backpressure { device: self.name.clone() });
        }
        self.directions[index] = direction;
        self.offsets_bytes[index] = offset_bytes;
        self.in_flight += 1;
        Ok(())
    }

    fn submit_and_reap(
        &mut self,
        wait: bool,
        deadline: Instant,
        on_done: &mut dyn FnMut(u32, Result<(), DeviceError>),
    ) -> Result<usize, DeviceError> {
        let queued = self.ring.submission().len();
        let must_wait = wait && self.ring.completion().is_empty() && self.in_flight > 0;
        if must_wait {
            let timespec = Self::timespec_until(deadline);
            let arguments = types::SubmitArgs::new().timespec(&timespec);
            match self.ring.submitter().submit_with_args(1, &arguments) {
                Ok(_) => {}
                Err(error) if error.raw_os_error() == Some(libc::ETIME) => {
                    if self.ring.completion().is_empty() {
                        return Err(DeviceError::Timeout {
                            device: self.name.clone(),
                            timeout_s: IO_TIMEOUT.as_secs(),
                            in_flight: self.in_flight,
                        });
                    }
                }
                // Interrupted or the kernel is short of resources: retried by the caller's loop.
                Err(error) if matches!(error.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)) => {}
                Err(source) => return Err(DeviceError::Io { device: self.name.clone(), context: "io_uring_enter".into(), source }),
            }
        } else if queued > 0 {
            match self.ring.submit() {
                Ok(_) => {}
                Err(error) if matches!(error.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)) => {}
                Err(source) => return Err(DeviceError::Io { device: self.name.clone(), context: "io_uring_enter".into(), source }),
            }
        }
        let mut done = 0;
        let mut unexpected = None;
        for entry in self.ring.completion() {
            let slot = entry.user_data();
            let Some(index) = usize::try_from(slot).ok().filter(|&index| index < self.directions.len()) else {
                unexpected = Some(slot);
                continue;
            };
            self.in_flight = self.in_flight.saturating_sub(1);
            done += 1;
            let result = entry.result();
            let outcome = if result < 0 {
                let reason = std::io::Error::from_raw_os_error(-result).to_string();
                Err(DeviceError::Command {
                    device: self.name.clone(),
                    direction: self.directions[index],
                    offset_bytes: self.offsets_bytes[index],
                    reason,
                })
            } else if result as u32 != self.slot_len {
                let reason = format!("short transfer: {result} of {} bytes (past the end of the file?)", self.slot_len);
                Err(DeviceError::Command {
                    device: self.name.clone(),
                    direction: self.directions[index],
                    offset_bytes: self.offsets_bytes[index],
                    reason,
                })
            } else {
                Ok(())
            };
            on_done(index as u32, outcome);
        }
        if let Some(slot) = unexpected {
            return Err(DeviceError::UnexpectedCompletion { device: self.name.clone(), slot });
        }
        Ok(done)
    }

    fn write_buffer(&mut self, slot: u32, source: &[u8]) -> Result<(), DeviceError> {
        let len = source.len().min(self.slot_bytes);
        self.buffers.copy_in(slot as usize * self.slot_bytes, &source[..len]);
        Ok(())
    }

    fn read_buffer(&self, slot: u32, destination: &mut [u8]) -> Result<(), DeviceError> {
        let len = destination.len().min(self.slot_bytes);
        self.buffers.copy_out(slot as usize * self.slot_bytes, &mut destination[..len]);
        Ok(())
    }

    fn drain(&mut self, deadline: Instant) {
        while self.in_flight > 0 && Instant::now() < deadline {
            if self.submit_and_reap(true, deadline, &mut |_, _| {}).is_err() {
                break;
            }
        }
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        self.drain(Instant::now() + IO_TIMEOUT);
        // With I/O still in flight the kernel may write into the buffers: leak them rather than
        // free memory a device could scribble on.
        if self.in_flight == 0 {
            // SAFETY: no I/O references the buffers any more and they are not used after this.
            unsafe { ManuallyDrop::drop(&mut self.buffers) }
        }
    }
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

/// The temporary pool file an interrupted run must not leave behind (set once per process).
static INTERRUPT_REMOVES: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();

extern "C" fn remove_pool_and_exit(_signal: libc::c_int) {
    if let Some(path) = INTERRUPT_REMOVES.get() {
        // SAFETY: unlink(2) and _exit(2) are async-signal-safe; `path` is a NUL-terminated string
        // that lives for the rest of the process (a static set before the handler was installed).
        unsafe { libc::unlink(path.as_ptr()) };
    }
    // SAFETY: _exit is async-signal-safe and ends the process without running Rust code.
    unsafe { libc::_exit(130) }
}

/// On SIGINT/SIGTERM, removes `path` and exits with status 130, so that interrupting the default
/// run does not leave up to 1 GiB in the temp directory. Best effort: returns false if not set up.
pub fn remove_on_interrupt(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return false };
    if INTERRUPT_REMOVES.set(path).is_err() {
        return false;
    }
    let handler = remove_pool_and_exit as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only calls async-signal-safe functions (see above); `signal` replaces
    // the default disposition of two signals that would otherwise kill the process anyway.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
    true
}
