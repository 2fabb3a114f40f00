//! Memory two processes share: a sealed memfd mapped `MAP_SHARED`, and BAR0 register I/O over
//! such a mapping (the software controller's register page, mapped by a client process).
//!
//! The fd is untrusted when it comes from another process: it may be a pipe, a file the sender
//! can shrink under our mapping (a later access past the new end raises SIGBUS, which no error
//! path can catch), a hugetlbfs memfd (a page the sender punches out is faulted in again from a
//! huge-page pool it can drain: SIGBUS again), or smaller than claimed. So
//! [`SharedMemory::from_fd`] maps only a memfd (one that answers `F_GET_SEALS`) on shmem that is
//! sealed against shrinking and at least as large as claimed; `F_SEAL_SHRINK` cannot be removed
//! once set, so the check holds for the mapping's life.
//!
//! # Who unmaps
//!
//! A [`SharedMemory`] unmaps when the last `Arc` to it drops. Every [`DmaRegion`] made over it
//! ([`super::DmaPool::map_shared`], [`super::DmaWindow`]) holds such an `Arc`, so the mapping
//! outlives every region a device could be told about, and a region that was
//! [leaked](DmaRegion::leak) because a queue could not be deleted keeps the whole mapping for
//! the rest of the process. The memfd's pages themselves live while any process maps them or
//! holds the fd: a client that exits does not take memory away from the daemon's device.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::{HwError, RegisterIo};
use crate::spec::registers;

/// Seals every memfd made here carries: it can neither shrink (SIGBUS under a peer's mapping)
/// nor grow, and no further seal can be added (`F_SEAL_WRITE` / `F_SEAL_FUTURE_WRITE` would
/// make a peer's later writable mapping fail).
const CREATED_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Why a received fd was refused or a memfd could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SharedMemoryError {
    #[error("shared memory length {len} is zero or not a multiple of 4096 bytes")]
    InvalidLength { len: usize },
    #[error("memfd_create/ftruncate/seal of {len} bytes failed: {source}")]
    Create { len: usize, source: std::io::Error },
    #[error("the fd is not a memfd (fcntl F_GET_SEALS: {source})")]
    NotMemfd { source: std::io::Error },
    #[error("the memfd is not sealed against shrinking (seals {seals:#x}); a peer could truncate it under our mapping")]
    NotSealed { seals: libc::c_int },
    #[error("the memfd holds {actual} bytes, fewer than the {claimed} claimed")]
    TooSmall { claimed: usize, actual: u64 },
    #[error(
        "the memfd is on a filesystem of type {f_type:#x}, not shmem (0x1021994): only a plain memfd is mapped (a \
         hugetlbfs one, MFD_HUGETLB, can fault when its huge-page pool runs dry, which would kill this process)"
    )]
    NotShmem { f_type: u64 },
    #[error("fstatfs of the shared memory fd failed: {source}")]
    StatFs { source: std::io::Error },
    #[error("fstat of the shared memory fd failed: {source}")]
    Stat { source: std::io::Error },
    #[error("mmap of {len} bytes of shared memory failed: {source}")]
    Map { len: usize, source: std::io::Error },
}

impl From<SharedMemoryError> for HwError {
    fn from(error: SharedMemoryError) -> Self {
        HwError::Shared(Box::new(error))
    }
}

/// A memfd of a fixed length, mapped read/write `MAP_SHARED` in this process. Never a Rust
/// reference into it: another process (and a device) writes it concurrently.
#[derive(Debug)]
pub struct SharedMemory {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is owned by this value and only accessed through raw pointers with atomic
// or copying accessors (DmaRegion, SharedRegisters), which are safe from any thread.
unsafe impl Send for SharedMemory {}
// SAFETY: as above.
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    /// Creates a memfd of `len` bytes (a multiple of 4096), zeroed, sealed against shrinking and
    /// growing, and maps it. `name` is for /proc/PID/fd and debugging only.
    pub fn create(name: &str, len: usize) -> Result<Arc<Self>, SharedMemoryError> {
        check_length(len)?;
        let create_error = |source| SharedMemoryError::Create { len, source };
        let name = CString::new(name.replace('\0', "?")).map_err(|_| create_error(std::io::Error::other("name has a NUL")))?;
        // SAFETY: `name` is a valid NUL-terminated string; the flags are valid memfd flags. The
        // result is checked before use.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(create_error(std::io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a fresh fd this function exclusively owns from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len).map_err(|_| create_error(std::io::Error::other("length exceeds off_t")))?;
        // SAFETY: ftruncate on an fd we own; no memory is involved.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(create_error(std::io::Error::last_os_error()));
        }
        // SAFETY: fcntl(F_ADD_SEALS) on an fd we own, with a valid seal set.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, CREATED_SEALS) } != 0 {
            return Err(create_error(std::io::Error::last_os_error()));
        }
        Self::map(fd, len)
    }

    /// Maps `len` bytes of a memfd received from another process, after checking it: a memfd
    /// (`F_GET_SEALS` succeeds), sealed against shrinking, on shmem (not a hugetlbfs memfd:
    /// `check_filesystem`), and at least `len` bytes long.
    pub fn from_fd(fd: OwnedFd, len: usize) -> Result<Arc<Self>, SharedMemoryError> {
        check_length(len)?;
        // SAFETY: fcntl(F_GET_SEALS) reads no memory; on an fd that does not support sealing
        // (not a memfd/shmem file) it fails with EINVAL, which is the check.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(SharedMemoryError::NotMemfd { source: std::io::Error::last_os_error() });
        }
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(SharedMemoryError::NotSealed { seals });
        }
        let mut stat = std::mem::MaybeUninit::<libc::stat>::zeroed();
        // SAFETY: `stat` is a valid, writable buffer of the right type for fstat to fill.
        if unsafe { libc::fstat(fd.as_raw_fd(), stat.as_mut_ptr()) } != 0 {
            return Err(SharedMemoryError::Stat { source: std::io::Error::last_os_error() });
        }
        // SAFETY: fstat returned 0, so it initialised the buffer.
        let stat = unsafe { stat.assume_init() };
        if stat.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(SharedMemoryError::NotMemfd { source: std::io::Error::other("not a regular file") });
        }
        let mut statfs = std::mem::MaybeUninit::<libc::statfs>::zeroed();
        // SAFETY: `statfs` is a valid, writable buffer of the right type for fstatfs to fill.
        if unsafe { libc::fstatfs(fd.as_raw_fd(), statfs.as_mut_ptr()) } != 0 {
            return Err(SharedMemoryError::StatFs { source: std::io::Error::last_os_error() });
        }
        // SAFETY: fstatfs returned 0, so it initialised the buffer.
        check_filesystem(filesystem_type(&unsafe { statfs.assume_init() }))?;
        let actual = u64::try_from(stat.st_size).unwrap_or(0);
        if actual < len as u64 {
            return Err(SharedMemoryError::TooSmall { claimed: len, actual });
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Arc<Self>, SharedMemoryError> {
        // SAFETY: a shared mapping of an fd we own, with a null hint; the file is at least `len`
        // bytes and cannot shrink (checked or sealed by the callers), so no access inside the
        // mapping can fault. The result is checked for MAP_FAILED before use.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(SharedMemoryError::Map { len, source: std::io::Error::last_os_error() });
        }
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or(SharedMemoryError::Map { len, source: std::io::Error::other("mmap returned null") })?;
        Ok(Arc::new(Self { ptr, len, fd }))
    }

    /// The memfd, to pass to another process (SCM_RIGHTS or inheritance).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The mapping's first byte, for [`super::DmaPool::map_shared`] and [`super::DmaWindow`].
    pub(super) fn pointer(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Whether `host..host+len` lies inside this mapping; the offset of `host` if so.
    pub(super) fn offset_of(&self, host: usize, len: usize) -> Option<usize> {
        let offset = host.checked_sub(self.ptr.as_ptr() as usize)?;
        let end = offset.checked_add(len)?;
        (end <= self.len).then_some(offset)
    }

    /// The address of `offset..offset+len` inside the mapping, `None` if it does not fit.
    pub(super) fn pointer_at(&self, offset: usize, len: usize) -> Option<NonNull<u8>> {
        if offset.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: `offset + len <= self.len` (checked), so the result stays inside the mapping
        // (or one past its end for len 0), and a pointer into a live mapping is never null.
        Some(unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(offset)) })
    }

    /// The aligned `size`-byte word at `offset`, `None` out of bounds or misaligned.
    fn word(&self, offset: usize, size: usize) -> Option<*mut u8> {
        let end = offset.checked_add(size)?;
        if end > self.len || !offset.is_multiple_of(size) {
            return None;
        }
        // SAFETY: `offset + size <= len` (checked), so the pointer stays inside the mapping.
        Some(unsafe { self.ptr.as_ptr().add(offset) })
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe exactly the mapping made in `map`; every DmaRegion and
        // SharedRegisters over it holds an Arc to this value, so none can access it any more.
        let result = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if result != 0 {
            // Only a mapping that is not what `map` made can fail here (from_fd maps only shmem,
            // unmapped at any page size); said, not hidden: it stays mapped for good.
            let error = std::io::Error::last_os_error();
            tracing::error!(len = self.len, %error, "munmap of shared memory failed: the mapping is leaked");
        }
    }
}

/// `statfs.f_type` of shmem (`TMPFS_MAGIC`, linux/magic.h): where every memfd made without
/// `MFD_HUGETLB` lives, whatever its name.
const TMPFS_MAGIC: u64 = 0x0102_1994;
/// `statfs.f_type` of hugetlbfs (`HUGETLBFS_MAGIC`): `memfd_create(MFD_HUGETLB)` files.
#[cfg(test)]
const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;

/// A filesystem type as [`check_filesystem`] takes it (`f_type`'s C type differs per target;
/// a value that does not fit is no known magic, so it is refused).
fn filesystem_type(statfs: &libc::statfs) -> u64 {
    u64::try_from(statfs.f_type).unwrap_or(u64::MAX)
}

/// Whether a received fd's filesystem is one whose mapping this process may access without a
/// fault no error path can catch: shmem only (a plain memfd). Refused first of all: hugetlbfs
/// (an `MFD_HUGETLB` memfd), which passes every other check (it answers `F_GET_SEALS` and takes
/// `F_SEAL_SHRINK`), but a page the sender punches out (`fallocate(PUNCH_HOLE)`: no seal but
/// `F_SEAL_WRITE` stops it) is faulted in again from the huge-page pool, which the sender can
/// drain, and then our access raises SIGBUS; its mappings are also rounded up to the huge
/// page, so an unmap of the length asked for would fail. Not checked: `st_blksize`, which
/// shmem reports as the huge page size where transparent huge pages are on for shmem
/// (`shmem_enabled` always/within_size/force), for memfds that are safe: such a page falls
/// back to small pages when none is free and is split by a partial unmap.
fn check_filesystem(f_type: u64) -> Result<(), SharedMemoryError> {
    if f_type == TMPFS_MAGIC {
        Ok(())
    } else {
        Err(SharedMemoryError::NotShmem { f_type })
    }
}

fn check_length(len: usize) -> Result<(), SharedMemoryError> {
    if len == 0 || !len.is_multiple_of(super::memory::PAGE_SIZE_BYTES) {
        return Err(SharedMemoryError::InvalidLength { len });
    }
    Ok(())
}

/// BAR0 register I/O over a mapping of a software controller's register page received from
/// another process (the daemon's `nvme-emu`; see `EmuConfig::shared_registers`).
///
/// Bounds-checked like the emulator's own register file: an access outside the page or
/// misaligned reads as all ones and writes are dropped. A client only rings doorbells, so writes
/// below the doorbell area (CC, AQA, ASQ, ACQ) are dropped too: the controller's configuration
/// is the daemon's business. Doorbell writes are Release stores, so the SQ entries written before
/// them are visible to the controller thread's Acquire load of the doorbell; no call wakes that
/// thread (it is in another process), so a doorbell is found by its polling, within the
/// emulator's `idle_sleep_max` when it was idle.
#[derive(Debug, Clone)]
pub struct SharedRegisters {
    memory: Arc<SharedMemory>,
}

impl SharedRegisters {
    pub fn new(memory: Arc<SharedMemory>) -> Self {
        Self { memory }
    }

    /// The page owner's side (tuttid making a doorbell relay page, which mirrors BAR0's
    /// layout): publishes CAP, the one register below the doorbells a client reads (for
    /// CAP.DSTRD, to check its doorbell offsets). Not part of [`RegisterIo`]: a client's own
    /// writes below the doorbells stay dropped, and the value only steers that client's own
    /// checks, never the controller.
    pub fn publish_capabilities(&self, capabilities: u64) {
        if let Some(pointer) = self.memory.word(registers::CAP, 8) {
            // SAFETY: in bounds and 8-aligned (checked by `word`); atomic access to shared memory.
            unsafe { AtomicU64::from_ptr(pointer.cast()) }.store(capabilities, Ordering::Release);
        }
    }
}

impl RegisterIo for SharedRegisters {
    fn len(&self) -> usize {
        self.memory.len()
    }

    fn read32(&self, offset: usize) -> u32 {
        match self.memory.word(offset, 4) {
            // SAFETY: in bounds and 4-aligned (checked by `word`); the mapping lives as long as
            // `self.memory`; an atomic view is valid for memory another process writes.
            Some(pointer) => unsafe { AtomicU32::from_ptr(pointer.cast()) }.load(Ordering::Acquire),
            None => u32::MAX,
        }
    }

    fn write32(&self, offset: usize, value: u32) {
        if offset < registers::DOORBELL_BASE {
            return;
        }
        if let Some(pointer) = self.memory.word(offset, 4) {
            // SAFETY: as in `read32`.
            unsafe { AtomicU32::from_ptr(pointer.cast()) }.store(value, Ordering::Release);
        }
    }

    fn read64(&self, offset: usize) -> u64 {
        match self.memory.word(offset, 8) {
            // SAFETY: in bounds and 8-aligned (checked by `word`); atomic access to shared memory.
            Some(pointer) => unsafe { AtomicU64::from_ptr(pointer.cast()) }.load(Ordering::Acquire),
            None => u64::MAX,
        }
    }

    fn write64(&self, offset: usize, value: u64) {
        // Doorbells are 32-bit; split as §3.1.1 allows, low dword first.
        if offset.is_multiple_of(8) {
            self.write32(offset, value as u32);
            self.write32(offset.saturating_add(4), (value >> 32) as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_memfd_round_trips_through_its_fd() {
        // Goal: a second mapping of the same memfd, made from its fd alone, sees the first's writes.
        let first = SharedMemory::create("test", 8192).unwrap();
        let fd = first.fd().try_clone_to_owned().unwrap();
        let second = SharedMemory::from_fd(fd, 8192).unwrap();
        let registers = SharedRegisters::new(Arc::clone(&first));
        registers.write32(registers::DOORBELL_BASE + 8, 0x1234_5678);
        assert_eq!(SharedRegisters::new(second).read32(registers::DOORBELL_BASE + 8), 0x1234_5678);
        assert_eq!(registers.read32(8190), u32::MAX, "misaligned reads as all ones");
        assert_eq!(registers.read64(8192), u64::MAX, "out of range reads as all ones");
        registers.write32(registers::CC, 1);
        assert_eq!(registers.read32(registers::CC), 0, "a client cannot write below the doorbells");
        registers.write64(registers::CAP, 7);
        assert_eq!(registers.read64(registers::CAP), 0, "nor CAP");
        registers.publish_capabilities(0x0000_0020_0000_00ff);
        assert_eq!(registers.read64(registers::CAP), 0x0000_0020_0000_00ff, "the page's owner publishes CAP");
    }

    #[test]
    fn untrusted_fds_are_refused() {
        // Goal: a pipe, a plain file, an unsealed memfd and a memfd smaller than claimed are all
        // refused before anything is mapped.
        let (read_end, _write_end) = std::io::pipe().unwrap();
        assert!(matches!(SharedMemory::from_fd(read_end.into(), 4096), Err(SharedMemoryError::NotMemfd { .. })));

        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&[0; 8192]).unwrap();
        let refused = SharedMemory::from_fd(file.into(), 4096);
        assert!(matches!(refused, Err(SharedMemoryError::NotMemfd { .. }) | Err(SharedMemoryError::NotSealed { .. })), "{refused:?}");

        let name = CString::new("unsealed").unwrap();
        // SAFETY: a valid name and flags; the fd is checked and owned right after.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(raw >= 0);
        // SAFETY: a fresh fd owned by this test from here on.
        let unsealed = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on an fd we own.
        assert_eq!(unsafe { libc::ftruncate(unsealed.as_raw_fd(), 8192) }, 0);
        assert!(matches!(SharedMemory::from_fd(unsealed, 8192), Err(SharedMemoryError::NotSealed { .. })));

        let small = SharedMemory::create("small", 4096).unwrap();
        let fd = small.fd().try_clone_to_owned().unwrap();
        assert!(matches!(SharedMemory::from_fd(fd, 8192), Err(SharedMemoryError::TooSmall { claimed: 8192, actual: 4096 })));

        // And a sealed one cannot be shrunk by the peer afterwards.
        // SAFETY: ftruncate on an fd this test holds; it must fail.
        assert_ne!(unsafe { libc::ftruncate(small.fd().as_raw_fd(), 0) }, 0);
        assert!(matches!(SharedMemory::create("odd", 100), Err(SharedMemoryError::InvalidLength { len: 100 })));
    }

    #[test]
    fn only_shmem_is_mapped() {
        // Goal: the filesystem check takes a plain memfd's filesystem (shmem, TMPFS_MAGIC) and
        // refuses every other, hugetlbfs (an MFD_HUGETLB memfd) first of all, whatever its
        // seals: a huge-page pool that runs dry faults SIGBUS on a later access, and its
        // mappings round up to the huge page.
        assert!(check_filesystem(TMPFS_MAGIC).is_ok());
        for other in [HUGETLBFS_MAGIC, 0xEF53 /* ext4 */, 0x5846_5342 /* xfs */, 0] {
            assert!(matches!(check_filesystem(other), Err(SharedMemoryError::NotShmem { f_type }) if f_type == other), "{other:#x}");
        }
        // And what a real memfd's filesystem answers here.
        let memory = SharedMemory::create("statfs", 4096).unwrap();
        let mut statfs = std::mem::MaybeUninit::<libc::statfs>::zeroed();
        // SAFETY: `statfs` is a valid, writable buffer of the right type for fstatfs to fill.
        assert_eq!(unsafe { libc::fstatfs(memory.fd().as_raw_fd(), statfs.as_mut_ptr()) }, 0);
        // SAFETY: fstatfs returned 0, so it initialised the buffer.
        let statfs = unsafe { statfs.assume_init() };
        assert_eq!(filesystem_type(&statfs), TMPFS_MAGIC);
    }

    #[test]
    fn a_hugetlb_memfd_is_refused() {
        // Goal: a sealed MFD_HUGETLB memfd (a peer could punch a hole in it and exhaust the
        // huge-page pool, so that our next access to the mapping raises SIGBUS) is refused
        // before anything is mapped, as NotShmem. No huge page needs to be configured: the
        // refusal comes before mmap (which would reserve one). Skipped where the kernel makes
        // no such memfd.
        let name = CString::new("hugetlb").unwrap();
        // SAFETY: a valid name and flags; the fd is checked and owned right after.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | libc::MFD_HUGETLB) };
        if raw < 0 {
            println!("skipped: memfd_create(MFD_HUGETLB) failed here ({})", std::io::Error::last_os_error());
            return;
        }
        // SAFETY: a fresh fd owned by this test from here on.
        let huge = unsafe { OwnedFd::from_raw_fd(raw) };
        // One 2 MiB huge page long (the common size; ftruncate reserves nothing).
        // SAFETY: ftruncate on an fd we own.
        if unsafe { libc::ftruncate(huge.as_raw_fd(), 2 << 20) } != 0 {
            println!("skipped: ftruncate of a hugetlb memfd failed here ({})", std::io::Error::last_os_error());
            return;
        }
        // SAFETY: fcntl(F_ADD_SEALS) on an fd we own, with a valid seal set.
        if unsafe { libc::fcntl(huge.as_raw_fd(), libc::F_ADD_SEALS, CREATED_SEALS) } != 0 {
            println!("skipped: sealing a hugetlb memfd failed here ({})", std::io::Error::last_os_error());
            return;
        }
        let refused = SharedMemory::from_fd(huge, 4096);
        assert!(matches!(refused, Err(SharedMemoryError::NotShmem { f_type: HUGETLBFS_MAGIC })), "{refused:?}");
    }
}
