//! The backing store: process memory, or a file / block device with `O_DIRECT` where allowed.
//!
//! File I/O here is synchronous `pread`/`pwrite` (one syscall per contiguous run of a command,
//! so a 128 KiB command costs one syscall); batches of transfers go through `uring` instead,
//! on the descriptors that [`Store::file_descriptor`] picks. Transfers whose offset, length and buffer are 4 KiB
//! aligned go through an `O_DIRECT` descriptor when the filesystem accepts one; the rest go
//! through a buffered descriptor of the same file. Linux keeps the two coherent (direct I/O
//! writes back and invalidates the page-cache range it touches).
//!
//! A file store can be fenced: while an io_uring write that a failed batch gave up on may still
//! land, every access fails (an I/O error, so the command reports a media status) instead of
//! letting a newer write be overtaken by the old one, or a read see data that is about to change.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::config::Backing;
use crate::EmuError;

/// The page-aligned buffer the store's `O_DIRECT` transfers and io_uring batches use: the
/// project's one such type, from the shared io_uring crate.
pub(crate) use tutti_uring::AlignedBuffer;

/// Alignment of offset, length and memory that the `O_DIRECT` descriptor is used for (the
/// largest logical block size of the disks it runs on: conservative for 512-byte ones).
pub(crate) const DIRECT_ALIGNMENT_BYTES: usize = 4096;
/// Chunk of zeroes written per syscall by `write_zeroes` on files.
const ZERO_CHUNK_BYTES: usize = 1 << 20;
/// How often `write_zeroes` tries a hole punch again that a signal interrupted (EINTR)
/// before it reports the failure.
const PUNCH_INTERRUPTED_RETRIES: u32 = 8;
/// Unit in which `write_zeroes` on memory skips what already reads as zero (a page).
const ZERO_CHECK_BYTES: usize = 4096;

pub(crate) enum Store {
    /// An anonymous private mapping: zeroed, committed page by page as it is written.
    Memory(memmap2::MmapMut),
    File(FileStore),
    /// No storage at all, for the no-storage mode (commands are validated and completed
    /// without moving data): only a size, so `emu:null:1T` costs no memory. Every access is an
    /// error; the no-storage mode never makes one.
    Null {
        size_bytes: u64,
    },
}

pub(crate) struct FileStore {
    path: PathBuf,
    buffered: File,
    /// The file both descriptors are open on: device and inode (`fstat` of `buffered`), for a
    /// caller that locked the path to check it serves the file it locked ([`Store::file_identity`]).
    identity: (u64, u64),
    direct: Option<File>,
    size_bytes: u64,
    /// Why every access is refused, while it is (see the module documentation).
    fence: Option<String>,
    /// `fdatasync` calls that succeeded (tests check which commands make data durable).
    syncs: u64,
    /// Hole punching is refused while set, as on a block device without write-zeroes offload
    /// (tests use it to reach the zero-writing fallback on any filesystem).
    #[cfg(test)]
    refuse_punch_for_tests: bool,
    /// Answers the next hole punches get instead of the kernel's, first one first (tests of
    /// how each fallocate error is handled).
    #[cfg(test)]
    punch_answers_for_tests: std::collections::VecDeque<rustix::io::Errno>,
    /// Bytes of zeroes the fallback wrote (tests check that no block is written twice).
    #[cfg(test)]
    zeroes_written_bytes: u64,
}

/// Why a file store is refused whose path named another file at its second open.
const REPLACED_WHILE_OPENING: &str = "the file was replaced (renamed or linked over) while it was being opened; open it again";

fn open_error(path: &Path) -> impl FnOnce(io::Error) -> EmuError + '_ {
    move |source| EmuError::Backing { path: path.to_path_buf(), source }
}

impl Store {
    /// Opens the backing store; with `no_storage` a memory backing is only a size (nothing is
    /// allocated), a file backing is still opened (its size is the namespaces' capacity).
    pub(crate) fn open(backing: &Backing, no_storage: bool) -> Result<Self, EmuError> {
        match backing {
            Backing::Memory { bytes } if no_storage => Ok(Store::Null { size_bytes: *bytes }),
            Backing::Memory { bytes } => {
                let len = usize::try_from(*bytes)
                    .map_err(|_| EmuError::InvalidConfig { reason: format!("{bytes} bytes of memory do not fit usize") })?;
                Ok(Store::Memory(allocate_memory(len)?))
            }
            Backing::File { path, create_bytes } => Ok(Store::File(FileStore::open(path, *create_bytes)?)),
        }
    }

    pub(crate) fn size_bytes(&self) -> u64 {
        match self {
            Store::Memory(bytes) => bytes.len() as u64,
            Store::File(file) => file.size_bytes,
            Store::Null { size_bytes } => *size_bytes,
        }
    }

    /// The descriptor a read of `len` bytes at `offset` into an aligned buffer should use, for
    /// file stores (the direct one when the transfer is aligned).
    pub(crate) fn file_descriptor(&self, offset: u64, len: usize) -> Option<RawFd> {
        match self {
            Store::Memory(_) | Store::Null { .. } => None,
            Store::File(file) => Some(file.choose(offset, 0, len).as_raw_fd()),
        }
    }

    /// The `O_DIRECT` descriptor, when the store has one and `len` bytes at `offset` are
    /// aligned for it: a transfer may then go straight to or from host memory that is aligned
    /// too (see [`DIRECT_ALIGNMENT_BYTES`]).
    pub(crate) fn direct_descriptor(&self, offset: u64, len: usize) -> Option<RawFd> {
        match self {
            Store::File(FileStore { direct: Some(direct), fence: None, .. })
                if offset.is_multiple_of(DIRECT_ALIGNMENT_BYTES as u64) && len.is_multiple_of(DIRECT_ALIGNMENT_BYTES) =>
            {
                Some(direct.as_raw_fd())
            }
            _ => None,
        }
    }

    pub(crate) fn is_file(&self) -> bool {
        matches!(self, Store::File(_))
    }

    /// The device and inode of a file store's file; `None` for memory.
    pub(crate) fn file_identity(&self) -> Option<(u64, u64)> {
        match self {
            Store::File(file) => Some(file.identity),
            Store::Memory(_) | Store::Null { .. } => None,
        }
    }

    /// Whether this is a file store without an `O_DIRECT` descriptor (the filesystem refused
    /// it): every transfer then goes through the page cache, i.e. memory.
    pub(crate) fn is_buffered_file(&self) -> bool {
        matches!(self, Store::File(FileStore { direct: None, .. }))
    }

    pub(crate) fn describe(&self) -> String {
        match self {
            Store::Memory(bytes) => format!("memory:{}", bytes.len()),
            Store::File(file) => file.path.display().to_string(),
            Store::Null { size_bytes } => format!("null:{size_bytes}"),
        }
    }

    /// Refuses every later access to a file store, for `reason`, until [`Store::lift_fence`].
    pub(crate) fn fence(&mut self, reason: String) {
        if let Store::File(file) = self {
            file.fence = Some(reason);
        }
    }

    pub(crate) fn lift_fence(&mut self) {
        if let Store::File(file) = self {
            file.fence = None;
        }
    }

    pub(crate) fn is_fenced(&self) -> bool {
        matches!(self, Store::File(FileStore { fence: Some(_), .. }))
    }

    fn memory_range(bytes: &[u8], offset: u64, len: usize) -> io::Result<std::ops::Range<usize>> {
        let start = usize::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let end = start.checked_add(len).filter(|&end| end <= bytes.len());
        end.map(|end| start..end).ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))
    }

    pub(crate) fn read(&mut self, offset: u64, destination: &mut [u8]) -> io::Result<()> {
        match self {
            Store::Memory(bytes) => {
                let range = Self::memory_range(bytes, offset, destination.len())?;
                destination.copy_from_slice(&bytes[range]);
                Ok(())
            }
            Store::File(file) => {
                file.check_fence()?;
                file.choose(offset, destination.as_ptr() as usize, destination.len()).read_exact_at(destination, offset)
            }
            Store::Null { .. } => Err(Self::null_access()),
        }
    }

    pub(crate) fn write(&mut self, offset: u64, source: &[u8]) -> io::Result<()> {
        match self {
            Store::Memory(bytes) => {
                let range = Self::memory_range(bytes, offset, source.len())?;
                bytes[range].copy_from_slice(source);
                Ok(())
            }
            Store::File(file) => {
                file.check_fence()?;
                file.choose(offset, source.as_ptr() as usize, source.len()).write_all_at(source, offset)
            }
            Store::Null { .. } => Err(Self::null_access()),
        }
    }

    /// Makes `len` bytes at `offset` read as zeroes without committing memory or disk space to
    /// them where the store allows (a whole-namespace deallocate must not fill a memory store's
    /// RAM or a sparse file's holes): memory pages that already read as zero are left alone,
    /// file ranges are hole-punched, and zeroes are written only where that is refused.
    pub(crate) fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        match self {
            Store::Memory(bytes) => {
                let len = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
                let range = Self::memory_range(bytes, offset, len)?;
                // A page never written is the kernel's shared zero page: reading it commits
                // nothing, writing it would. (Releasing pages with MADV_DONTNEED would need
                // unsafe code, which this crate forbids.) Checked on the mapping's own pages
                // (it is page-aligned): a range starting inside a page has its first piece end
                // at the next page boundary, so a piece never spans two pages and a written
                // page's piece never writes the zero page next to it.
                let head = (ZERO_CHECK_BYTES - range.start % ZERO_CHECK_BYTES).min(range.len());
                let (first, rest) = bytes[range].split_at_mut(head);
                for chunk in std::iter::once(first).chain(rest.chunks_mut(ZERO_CHECK_BYTES)) {
                    // An OR over the page rather than `any`: no early exit, so it vectorizes.
                    if chunk.iter().fold(0u8, |seen, &byte| seen | byte) != 0 {
                        chunk.fill(0);
                    }
                }
                Ok(())
            }
            Store::File(file) => {
                file.check_fence()?;
                if len == 0 {
                    return Ok(());
                }
                // Reads of a punched range return zeroes (fallocate(2)).
                let Some(refusal) = file.punch_hole(offset, len)? else { return Ok(()) };
                tracing::debug!(error = %refusal, offset, len, "hole punching refused; writing zeroes");
                let zeroes = vec![0u8; ZERO_CHUNK_BYTES];
                let mut done = 0u64;
                // Bounded: each pass advances by at least one byte of `len`.
                while done < len {
                    let chunk = (len - done).min(ZERO_CHUNK_BYTES as u64) as usize;
                    let at = offset.checked_add(done).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
                    file.buffered.write_all_at(&zeroes[..chunk], at)?;
                    done += chunk as u64;
                    #[cfg(test)]
                    {
                        file.zeroes_written_bytes += chunk as u64;
                    }
                }
                Ok(())
            }
            Store::Null { .. } => Err(Self::null_access()),
        }
    }

    pub(crate) fn sync(&mut self) -> io::Result<()> {
        match self {
            Store::Memory(_) | Store::Null { .. } => Ok(()),
            Store::File(file) => {
                file.check_fence()?;
                // fdatasync flushes the file (its inode), whichever descriptor wrote the data:
                // the O_DIRECT one's writes reached the disk's cache, not necessarily its media.
                file.buffered.sync_data()?;
                file.syncs += 1;
                Ok(())
            }
        }
    }

    /// Makes a file store refuse hole punching from now on, so that zeroing writes zeroes.
    #[cfg(test)]
    pub(crate) fn refuse_punch_for_tests(&mut self) {
        if let Store::File(file) = self {
            file.refuse_punch_for_tests = true;
        }
    }

    /// Makes a file store's next hole punches fail with `answers` (in order), without asking
    /// the kernel; later ones go to the kernel again.
    #[cfg(test)]
    pub(crate) fn answer_punches_for_tests(&mut self, answers: &[rustix::io::Errno]) {
        if let Store::File(file) = self {
            file.punch_answers_for_tests.extend(answers.iter().copied());
        }
    }

    /// Bytes of zeroes a file store wrote because hole punching was refused (0 for memory).
    #[cfg(test)]
    pub(crate) fn zeroes_written_bytes(&self) -> u64 {
        match self {
            Store::File(file) => file.zeroes_written_bytes,
            Store::Memory(_) | Store::Null { .. } => 0,
        }
    }

    /// Successful `fdatasync` calls of a file store (0 for memory).
    #[cfg(test)]
    pub(crate) fn syncs(&self) -> u64 {
        match self {
            Store::File(file) => file.syncs,
            Store::Memory(_) | Store::Null { .. } => 0,
        }
    }

    fn null_access() -> io::Error {
        io::Error::new(io::ErrorKind::Unsupported, "a no-storage controller has no backing store to access")
    }
}

/// Whether fallocate's `errno` for a hole punch says it does not punch holes here (zeroes are
/// written instead), rather than that the punch failed: EOPNOTSUPP (a filesystem without it;
/// a block device whose kernel has no write-zeroes offload for it; a mode it does not know),
/// EINVAL (a block device's range not aligned to its logical blocks, or a filesystem that
/// takes the mode for invalid), ENODEV (neither a file nor a block device) and ENOSYS (no
/// fallocate at all, e.g. under a sandbox's seccomp filter). fallocate never answers ENOTTY.
fn punch_refused(errno: rustix::io::Errno) -> bool {
    use rustix::io::Errno;
    matches!(errno, Errno::OPNOTSUPP | Errno::INVAL | Errno::NODEV | Errno::NOSYS)
}

/// Zeroed memory for a memory-backed store, refused with [`EmuError::Memory`] when the kernel
/// will not grant it (`vec![0; len]` would abort the process instead). An anonymous mapping is
/// zeroed and lazily committed like `calloc`'s large allocations, so a device costs only what is
/// written to it. It is mapped without `MAP_NORESERVE` on purpose: the kernel's commit
/// accounting then refuses, at mmap time, a size it could never back (overcommit modes 0 and 2)
/// instead of letting a later write fault the process into the OOM killer. Under mode 1
/// (always overcommit) nothing is refused here; the tools check `MemAvailable` first.
fn allocate_memory(len: usize) -> Result<memmap2::MmapMut, EmuError> {
    memmap2::MmapOptions::new().len(len).map_anon().map_err(|source| EmuError::Memory { bytes: len as u64, source })
}

impl FileStore {
    fn open(path: &Path, create_bytes: Option<u64>) -> Result<Self, EmuError> {
        let mut options = OpenOptions::new();
        // A pool file holds every cached KV block: only its owner may read it, whatever the
        // umask (tuttid's trust boundary is its 0600 socket and peer uid check). The mode applies
        // only when the file is created here; an existing file keeps its own.
        options.read(true).write(true).create(create_bytes.is_some()).mode(0o600);
        let mut buffered = options.open(path).map_err(open_error(path))?;
        let mut size_bytes = buffered.seek(SeekFrom::End(0)).map_err(open_error(path))?;
        // One fstat: growing the file (below) changes neither its type nor its identity.
        let metadata = buffered.metadata().map_err(open_error(path))?;
        let identity = (metadata.dev(), metadata.ino());
        if let Some(wanted) = create_bytes {
            // Only a regular file is grown: a block device has its own size, and set_len on a
            // character device fails (EINVAL), or would try to truncate what it is.
            if metadata.is_file() && size_bytes < wanted {
                buffered.set_len(wanted).map_err(open_error(path))?;
                size_bytes = wanted;
            }
        }
        // The path is looked up a second time: a file renamed or linked into its place between
        // the two opens would be served by half the descriptors (aligned transfers to one file,
        // the rest to the other). Refused; the caller's check against the file it locked
        // (tutti-devices' `DeviceLocks::check_opened`) reads the identity of `buffered`.
        let direct = match OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(path) {
            Ok(file) => {
                let reopened = file.metadata().map_err(open_error(path))?;
                if (reopened.dev(), reopened.ino()) != identity {
                    return Err(EmuError::Backing { path: path.to_path_buf(), source: io::Error::other(REPLACED_WHILE_OPENING) });
                }
                Some(file)
            }
            Err(error) => {
                // Once per device: tmpfs and some FUSE filesystems refuse O_DIRECT.
                tracing::warn!(path = %path.display(), %error, "O_DIRECT refused; using buffered pread/pwrite (the page cache, not the disk, serves I/O)");
                None
            }
        };
        Ok(Self {
            path: path.to_path_buf(),
            buffered,
            identity,
            direct,
            size_bytes,
            fence: None,
            syncs: 0,
            #[cfg(test)]
            refuse_punch_for_tests: false,
            #[cfg(test)]
            punch_answers_for_tests: std::collections::VecDeque::new(),
            #[cfg(test)]
            zeroes_written_bytes: 0,
        })
    }

    /// Punches a hole over `len` bytes at `offset` (reads of it then return zeroes, fallocate(2);
    /// on a block device the kernel zeroes it). `Ok(None)` when punched; `Ok(Some(errno))`
    /// when the kernel says it does not punch here ([`punch_refused`]), so zeroes must be
    /// written; `Err` when the punch failed (EIO, ENOSPC, EPERM, EBUSY, ...): writing 64 MiB of
    /// zeroes through a store that just failed would hide the error or fail the same way.
    /// EINTR is tried again, at most [`PUNCH_INTERRUPTED_RETRIES`] times.
    fn punch_hole(&mut self, offset: u64, len: u64) -> io::Result<Option<rustix::io::Errno>> {
        let punch = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        let mut interrupted = 0u32;
        // Bounded: each pass returns, or counts one more EINTR up to the retries.
        loop {
            #[cfg(test)]
            let punched = if let Some(answer) = self.punch_answers_for_tests.pop_front() {
                Err(answer)
            } else if self.refuse_punch_for_tests {
                Err(rustix::io::Errno::OPNOTSUPP)
            } else {
                rustix::fs::fallocate(&self.buffered, punch, offset, len)
            };
            #[cfg(not(test))]
            let punched = rustix::fs::fallocate(&self.buffered, punch, offset, len);
            match punched {
                Ok(()) => return Ok(None),
                Err(rustix::io::Errno::INTR) if interrupted < PUNCH_INTERRUPTED_RETRIES => interrupted += 1,
                Err(errno) if punch_refused(errno) => return Ok(Some(errno)),
                Err(errno) => {
                    tracing::error!(error = %errno, offset, len, interrupted, "hole punching failed");
                    return Err(errno.into());
                }
            }
        }
    }

    fn check_fence(&self) -> io::Result<()> {
        match &self.fence {
            Some(reason) => Err(io::Error::other(format!("backing store access refused: {reason}"))),
            None => Ok(()),
        }
    }

    fn choose(&self, offset: u64, buffer_address: usize, len: usize) -> &File {
        let aligned = offset.is_multiple_of(DIRECT_ALIGNMENT_BYTES as u64)
            && len.is_multiple_of(DIRECT_ALIGNMENT_BYTES)
            && buffer_address.is_multiple_of(DIRECT_ALIGNMENT_BYTES);
        match &self.direct {
            Some(direct) if aligned => direct,
            _ => &self.buffered,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_store_round_trips_aligned_and_unaligned() {
        // Goal: both descriptors (direct and buffered) see the same bytes.
        let path = std::env::temp_dir().join(format!("nvme-emu-backing-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut store = Store::open(&Backing::File { path: path.clone(), create_bytes: Some(1 << 20) }, false).unwrap();
        assert_eq!(store.size_bytes(), 1 << 20);
        let mut buffer = AlignedBuffer::default();
        let data = buffer.slice(8192);
        data.iter_mut().enumerate().for_each(|(index, byte)| *byte = index as u8);
        store.write(4096, data).unwrap();
        let mut small = [0u8; 3];
        store.read(4097, &mut small).unwrap();
        assert_eq!(small, [1, 2, 3]);
        store.write(4096 + 10, &[0xAA; 5]).unwrap();
        let check = buffer.slice(8192);
        store.read(4096, check).unwrap();
        assert_eq!(&check[10..15], &[0xAA; 5]);
        assert_eq!(check[15], 15);
        store.write_zeroes(4096, 4096).unwrap();
        store.read(4096, check).unwrap();
        assert!(check[..4096].iter().all(|&b| b == 0));
        assert!(store.read((1 << 20) - 1, &mut small).is_err(), "reads past the end fail");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_size_to_create_never_grows_a_device() {
        // Goal: `create_bytes` creates or grows a regular file only: a character device (and a
        // block device, which has its own size) is opened as it is, not truncated with
        // set_len, which failed with EINVAL on /dev/null after other files had been grown.
        let store = Store::open(&Backing::File { path: "/dev/null".into(), create_bytes: Some(1 << 20) }, false).unwrap();
        assert_eq!(store.size_bytes(), 0);
    }

    #[test]
    fn only_a_file_store_without_o_direct_is_buffered() {
        // Goal: the accessor tools use to say "buffered" is true only for a file without its
        // O_DIRECT descriptor (a filesystem that refused O_DIRECT).
        let path = std::env::temp_dir().join(format!("nvme-emu-buffered-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut store = Store::open(&Backing::File { path: path.clone(), create_bytes: Some(1 << 20) }, false).unwrap();
        let _ = std::fs::remove_file(&path);
        let direct_accepted = matches!(&store, Store::File(FileStore { direct: Some(_), .. }));
        assert_eq!(store.is_buffered_file(), !direct_accepted);
        if let Store::File(file) = &mut store {
            file.direct = None;
        }
        assert!(store.is_buffered_file());
        assert!(!Store::open(&Backing::Memory { bytes: 1 << 20 }, false).unwrap().is_buffered_file());
    }

    #[test]
    fn a_fenced_file_store_refuses_every_access_until_the_fence_lifts() {
        // Goal: while fenced (an abandoned write may still land), reads, writes, zeroing and
        // sync all fail with the reason, and nothing reaches the file; lifting restores access.
        let file = tempfile_path("fence");
        let mut store = Store::open(&Backing::File { path: file.clone(), create_bytes: Some(1 << 20) }, false).unwrap();
        store.write(0, &[7u8; 4096]).unwrap();
        store.fence("a write may still land".into());
        assert!(store.is_fenced());
        let refused = store.write(0, &[9u8; 4096]).unwrap_err();
        assert!(refused.to_string().contains("a write may still land"), "{refused}");
        let mut read = [0u8; 4096];
        assert!(store.read(0, &mut read).is_err());
        assert!(store.write_zeroes(0, 4096).is_err());
        assert!(store.sync().is_err());
        store.lift_fence();
        store.read(0, &mut read).unwrap();
        assert_eq!(read, [7u8; 4096], "nothing written while fenced");
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn a_file_store_creates_its_file_readable_by_its_owner_only() {
        // Goal: a backing file the store creates (create_bytes: tuttid --format, `tutti pool
        // format`, tools' emu: files) is mode 0600, not 0644 under the usual umask 022: it holds
        // every cached KV block, which only the daemon's owner may read. (This crate cannot set
        // the umask without unsafe code: run under umask 022, the default, it fails without the
        // explicit mode; under a stricter umask it cannot tell.)
        use std::os::unix::fs::PermissionsExt;
        let path = tempfile_path("mode");
        let store = Store::open(&Backing::File { path: path.clone(), create_bytes: Some(1 << 20) }, false).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        drop(store);
        let _ = std::fs::remove_file(&path);
        assert_eq!(mode & 0o077, 0, "created with mode {mode:o}");
    }

    fn tempfile_path(name: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("nvme-emu-backing-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        path
    }

    #[test]
    fn memory_the_machine_cannot_hold_is_an_error_not_an_abort() {
        // Goal: a memory backing far beyond any machine (2^62 bytes) is refused with a typed
        // error naming the size; a small one is zeroed and round-trips.
        let error = Store::open(&Backing::Memory { bytes: 1 << 62 }, false).err().expect("2^62 bytes cannot be mapped");
        assert!(matches!(error, EmuError::Memory { bytes, .. } if bytes == 1 << 62), "{error}");
        assert!(error.to_string().contains("4611686018427387904 bytes"), "{error}");
        let mut store = Store::open(&Backing::Memory { bytes: 1 << 20 }, false).unwrap();
        let mut read = [0xFFu8; 8];
        store.read(4096, &mut read).unwrap();
        assert_eq!(read, [0; 8]);
        store.write(4096, &[1, 2, 3]).unwrap();
        store.read(4096, &mut read[..3]).unwrap();
        assert_eq!(&read[..3], &[1, 2, 3]);
    }

    /// Resident bytes of the mapping that holds `address` (from /proc/self/smaps, so other
    /// tests' allocations in this process do not count).
    fn resident_bytes_of_mapping(address: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((start, end)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
                if let (Ok(start), Ok(end)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16)) {
                    inside = (start..end).contains(&address);
                    continue;
                }
            }
            if inside && line.starts_with("Rss:") {
                let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
                return kib * 1024;
            }
        }
        panic!("no mapping holds {address:#x}");
    }

    #[test]
    fn deallocating_a_whole_memory_store_commits_no_memory() {
        // Goal: zeroing all of a 1 GiB memory store (a whole-namespace deallocate) releases
        // pages instead of writing them, so the mapping stays small, and every byte, including
        // partial pages at the ends of an unaligned range, reads as zero afterwards.
        const GIB: u64 = 1 << 30;
        let mut store = Store::open(&Backing::Memory { bytes: GIB }, false).unwrap();
        let Store::Memory(bytes) = &store else { panic!("a memory store") };
        let address = bytes.as_ptr() as usize;
        store.write(0, &[7u8; 3 * 4096]).unwrap();
        store.write(GIB - 4096, &[7u8; 4096]).unwrap();
        store.write_zeroes(100, 2 * 4096).unwrap();
        let mut read = vec![0xFFu8; 3 * 4096];
        store.read(0, &mut read).unwrap();
        assert!(read[..100].iter().all(|&b| b == 7) && read[100..100 + 8192].iter().all(|&b| b == 0));
        assert!(read[100 + 8192..].iter().all(|&b| b == 7), "bytes after the range are kept");
        store.write_zeroes(0, GIB).unwrap();
        let resident = resident_bytes_of_mapping(address);
        assert!(resident < 64 << 20, "deallocating 1 GiB left {resident} bytes resident");
        store.read(0, &mut read).unwrap();
        assert!(read.iter().all(|&b| b == 0));
        store.read(GIB - 4096, &mut read[..4096]).unwrap();
        assert!(read[..4096].iter().all(|&b| b == 0));
    }

    #[test]
    fn zeroing_an_unaligned_range_commits_no_page_that_was_zero() {
        // Goal: zeroing is checked page by page on the store's own 4 KiB pages, so a range that
        // starts inside a page does not write the untouched (never committed) pages next to
        // written ones: with every other page written, zeroing all of them from byte 100 keeps
        // the mapping's resident size, and every byte reads as zero.
        const PAGES: usize = 512;
        let mut store = Store::open(&Backing::Memory { bytes: (PAGES * 4096) as u64 }, false).unwrap();
        let Store::Memory(bytes) = &store else { panic!("a memory store") };
        // Page-sized pages, so residency counts what was written (not a 2 MiB huge page).
        bytes.advise(memmap2::Advice::NoHugePage).unwrap();
        let address = bytes.as_ptr() as usize;
        for page in (0..PAGES).step_by(2) {
            store.write((page * 4096) as u64, &[7u8; 4096]).unwrap();
        }
        let written = resident_bytes_of_mapping(address);
        store.write_zeroes(100, (PAGES * 4096 - 200) as u64).unwrap();
        let after = resident_bytes_of_mapping(address);
        assert!(after <= written, "zeroing from byte 100 committed {} more bytes ({written} resident before)", after - written);
        let mut read = vec![0xFFu8; PAGES * 4096];
        store.read(0, &mut read).unwrap();
        assert!(read[..100].iter().all(|&b| b == 7) && read[100..PAGES * 4096 - 100].iter().all(|&b| b == 0));
    }

    #[test]
    fn deallocating_a_sparse_file_keeps_it_sparse() {
        // Goal: zeroing all of a sparse 1 GiB file punches holes instead of writing zeroes (no
        // disk space committed, no ENOSPC), and what was written reads as zero afterwards.
        use std::os::unix::fs::MetadataExt;
        const GIB: u64 = 1 << 30;
        let path = tempfile_path("sparse");
        let mut store = Store::open(&Backing::File { path: path.clone(), create_bytes: Some(GIB) }, false).unwrap();
        store.write(4096, &[9u8; 8192]).unwrap();
        store.write_zeroes(0, GIB).unwrap();
        let allocated = std::fs::metadata(&path).unwrap().blocks() * 512;
        let mut read = [0xFFu8; 8192];
        store.read(4096, &mut read).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(read.iter().all(|&b| b == 0));
        assert!(allocated < 64 << 20, "deallocating a sparse 1 GiB file allocated {allocated} bytes");
    }

    /// A 1 MiB file store with 8 KiB of 9s at 4096, and the answers its next hole punches get
    /// instead of the kernel's.
    fn store_punching_with(name: &str, answers: &[rustix::io::Errno]) -> (Store, std::path::PathBuf) {
        let path = tempfile_path(name);
        let mut store = Store::open(&Backing::File { path: path.clone(), create_bytes: Some(1 << 20) }, false).unwrap();
        store.write(4096, &[9u8; 8192]).unwrap();
        store.answer_punches_for_tests(answers);
        (store, path)
    }

    #[test]
    fn an_interrupted_hole_punch_is_retried_not_replaced_by_written_zeroes() {
        // Goal: a hole punch interrupted by a signal (EINTR) is tried again, a bounded number of
        // times, rather than taken for a refusal: zeroing a range then writes no zeroes (they
        // would commit disk space a deallocate must not take) and the range reads as zero.
        // Until 2026-12-01 any fallocate error fell back to writing zeroes.
        let (mut probe, probe_path) = store_punching_with("punch-probe", &[]);
        probe.write_zeroes(4096, 8192).unwrap();
        let _ = std::fs::remove_file(&probe_path);
        if probe.zeroes_written_bytes() != 0 {
            eprintln!("this filesystem refuses hole punching: test skipped");
            return;
        }
        let (mut store, path) = store_punching_with("punch-interrupted", &[rustix::io::Errno::INTR; 2]);
        store.write_zeroes(4096, 8192).unwrap();
        let mut read = [0xFFu8; 8192];
        store.read(4096, &mut read).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(store.zeroes_written_bytes(), 0, "an interrupted punch fell back to writing zeroes");
        assert!(read.iter().all(|&b| b == 0));
    }

    #[test]
    fn a_hole_punch_that_fails_is_an_error_not_written_zeroes() {
        // Goal: a hole punch that failed (EIO, ENOSPC, EPERM, or EINTR past the retries) is an
        // error the controller reports (Write Fault), not a refusal to answer by writing 64 MiB
        // of zeroes through a store that just failed: nothing is written, the data stays.
        // Until 2026-12-01 any fallocate error fell back to writing zeroes and succeeded.
        use rustix::io::Errno;
        for (name, answers) in [
            ("punch-eio", vec![Errno::IO]),
            ("punch-enospc", vec![Errno::NOSPC]),
            ("punch-eperm", vec![Errno::PERM]),
            ("punch-eintr", vec![Errno::INTR; 64]),
        ] {
            let (mut store, path) = store_punching_with(name, &answers);
            let result = store.write_zeroes(4096, 8192);
            let mut read = [0u8; 8192];
            store.read(4096, &mut read).unwrap();
            let _ = std::fs::remove_file(&path);
            assert!(result.is_err(), "{name}: a failed punch reported success");
            assert_eq!(store.zeroes_written_bytes(), 0, "{name}: a failed punch fell back to writing zeroes");
            assert!(read.iter().all(|&b| b == 9), "{name}: the data changed");
        }
    }

    #[test]
    fn a_refused_hole_punch_writes_zeroes_instead() {
        // Goal: the answers with which fallocate says it does not punch holes here (EOPNOTSUPP:
        // a filesystem without it, a block device without write-zeroes offload; EINVAL: a range
        // not aligned to a block device's logical blocks; ENODEV: not a file or block device;
        // ENOSYS: no fallocate) are a refusal: zeroes are written and the range reads as zero.
        use rustix::io::Errno;
        for (name, errno) in [
            ("punch-eopnotsupp", Errno::OPNOTSUPP),
            ("punch-einval", Errno::INVAL),
            ("punch-enodev", Errno::NODEV),
            ("punch-enosys", Errno::NOSYS),
        ] {
            let (mut store, path) = store_punching_with(name, &[errno]);
            store.write_zeroes(4096, 8192).unwrap();
            let mut read = [0xFFu8; 8192];
            store.read(4096, &mut read).unwrap();
            let _ = std::fs::remove_file(&path);
            assert_eq!(store.zeroes_written_bytes(), 8192, "{name}: the refused punch wrote no zeroes");
            assert!(read.iter().all(|&b| b == 0), "{name}");
        }
    }

    #[test]
    fn a_no_storage_store_is_a_size_without_memory() {
        // Goal: no-storage mode allocates nothing, so a size far beyond the machine (2^62 bytes,
        // refused above when it must be backed) opens, reports its size, and refuses access.
        let mut store = Store::open(&Backing::Memory { bytes: 1 << 62 }, true).expect("no memory is allocated");
        assert_eq!(store.size_bytes(), 1 << 62);
        assert!(store.read(0, &mut [0u8; 8]).is_err() && store.write(0, &[0u8; 8]).is_err());
    }
}
