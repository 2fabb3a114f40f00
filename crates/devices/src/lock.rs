//! One user per pool: an exclusive advisory lock (`flock`) on each pool device, taken before
//! the devices are opened and held for as long as they are used (tuttid for its life, `tutti
//! pool` for one command). The kernel drops it when the holder dies, even by SIGKILL, so a stale
//! lock cannot outlive its holder. A second user is refused with the holder named: its pid and
//! command line, found in `/proc/locks` by the lock file's device and inode.
//!
//! - `emu:PATH`: the pool's backing file itself; `uring:PATH` (tutti-bench's kernel path) the
//!   same file, so that neither tool runs on a file the other uses;
//! - `vfio:BDF`: `LOCK_DIR/vfio-BDF.lock` (the kernel also refuses a second open of the VFIO
//!   group, but without naming who holds it), mode 0600 in a directory created 0700: a lock
//!   file others could open would let any local user hold the SSD's lock;
//! - `emu:mem:` / `emu:null:`: nothing to share, no lock.
//!
//! A pool file (`emu:PATH`, `uring:PATH`, a regular file) is its owner's only, like a lock
//! file: one of another user's that others may read or write is refused when locked
//! (`pool_file_access`); one of this user's that others may open is only recorded then, and
//! made its owner's by [`DeviceLocks::narrow_pool_files`], which the caller calls once it knows
//! the file is its pool (formatted, or opened as one): a command that refuses the file after
//! locking it (a file system on it, a file that holds no pool) changes no mode. A block device
//! keeps the mode the system gave it. Files that are not pools (tutti-bench's raw runs, which
//! read any file as fio does; measurement and conformance patterns) are locked without any of
//! this ([`DeviceLocks::acquire_leaving_modes`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::open::refuse_shared_files;
use crate::spec::DeviceSpec;
use crate::{DeviceError, FileUndo};
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

/// Where `vfio:` devices' lock files live unless told otherwise (tuttid's `--lock-dir`).
pub const DEFAULT_LOCK_DIR: &str = "/run/tutti";

/// The mode a pool file (`emu:PATH`, `uring:PATH`) is created with: owner read/write only.
pub const POOL_FILE_MODE: u32 = 0o600;

/// The mode the lock directory is created with: owner only.
pub const LOCK_DIR_MODE: u32 = 0o700;

/// The mode of a `vfio:` lock file: owner read/write only (anyone who can open it can hold it).
pub const LOCK_FILE_MODE: u32 = 0o600;

/// Held locks; dropping releases them.
#[derive(Debug, Default)]
pub struct DeviceLocks {
    held: Vec<(PathBuf, Held)>,
    /// Pool files of this user's that others can open, found when locked and not narrowed yet
    /// ([`DeviceLocks::narrow_pool_files`]): the index of each one's lock in `held` and the mode
    /// it had then (what [`DeviceLocks::open_to_others_notes`] tells; narrowing reads the mode
    /// again).
    open_to_others: Vec<(usize, u32)>,
    /// Pool files [`DeviceLocks::narrow_pool_files`] narrowed, or tried to, with the mode each
    /// had and what narrowing it came to ([`DeviceLocks::narrowed`]).
    narrowed: Vec<(PathBuf, u32, Narrowing)>,
}

/// One lock of a [`DeviceLocks`], held for its drop (read only to narrow its file's mode).
#[derive(Debug)]
enum Held {
    /// Taken here, on an open file description of its own; unlocked on drop.
    Own(Flock<File>),
    /// Handed over by the [`FileUndo`] that made the file and locked it
    /// ([`DeviceLocks::acquire_created`]): a duplicate of its descriptor, so one lock that both
    /// hold. Dropped, it only closes the duplicate (no `LOCK_UN`, which would unlock the
    /// undo's side too); the kernel releases the lock when the last of the two is closed.
    Shared(File),
}

impl Held {
    /// The descriptor the lock is on.
    fn file(&self) -> &File {
        match self {
            Held::Own(lock) => lock,
            Held::Shared(file) => file,
        }
    }
}

impl DeviceLocks {
    /// Locks every device of `specs` that can be shared. `create_files`: an `emu:PATH` that does
    /// not exist is created empty (the software controller sizes it), as `--emu-create-bytes`
    /// allows; otherwise a missing file is left for the device opening to report. One file or
    /// PCI function named twice is refused first ([`refuse_shared_files`]): each spec's lock is
    /// an open file description of its own, so the second would be refused as in use, naming
    /// this very process as the other holder.
    ///
    /// A file a [`FileUndo`] of this process made (and so holds locked) is refused as in use,
    /// like any other holder's: only [`DeviceLocks::acquire_created`], given that undo, shares
    /// its lock, or this with `create_files` called inside [`FileUndo::lending_locks`] on the
    /// undo's thread (for a caller that reaches this through a wrapper of its own).
    ///
    /// No mode is changed here. An existing pool file of another user's that others can read
    /// or write is refused before its lock is taken ([`DeviceError::SharedLockFile`]); one of
    /// this user's that others can open is recorded, for [`DeviceLocks::narrow_pool_files`]
    /// (once the caller knows it is its pool) or [`DeviceLocks::open_to_others_notes`] (a
    /// command that only reads it).
    pub fn acquire(specs: &[DeviceSpec], lock_dir: &Path, create_files: bool) -> Result<DeviceLocks, DeviceError> {
        Self::acquire_sharing(specs, lock_dir, create_files, None, PoolFileModes::Narrow)
    }

    /// [`DeviceLocks::acquire`] for files that are not pools: an existing `emu:`/`uring:` file
    /// others can open is neither refused nor recorded for it. For tutti-bench's raw runs, which
    /// read (or write) any file as fio would (a data set, a disk image shared with other
    /// users), and for tutti-profile's I/O measurement: the mode is its owner's business there,
    /// and the lock only keeps two runs (or a run and tuttid) off one file at once.
    pub fn acquire_leaving_modes(specs: &[DeviceSpec], lock_dir: &Path, create_files: bool) -> Result<DeviceLocks, DeviceError> {
        Self::acquire_sharing(specs, lock_dir, create_files, None, PoolFileModes::Leave)
    }

    /// [`DeviceLocks::acquire`] with `create_files` for the `emu:` files a format is to create,
    /// once `undo` ([`FileUndo::create_missing`]) made the missing ones and locked them: the
    /// lock on each file `undo` made (the same file still, by device and inode) is shared with
    /// it (a duplicate of its descriptor), not taken again, so there is no moment without it;
    /// a file another process made meanwhile is locked as `acquire` locks it (refused if that
    /// process holds it). Neither side's drop unlocks the other's: `undo` keeps its lock until
    /// it is dropped or kept, whether this succeeds, fails part-way, or is dropped first.
    pub fn acquire_created(specs: &[DeviceSpec], lock_dir: &Path, undo: &FileUndo) -> Result<DeviceLocks, DeviceError> {
        Self::acquire_sharing(specs, lock_dir, true, Some(undo), PoolFileModes::Narrow)
    }

    /// [`DeviceLocks::acquire_created`] for files that are not pools, as
    /// [`DeviceLocks::acquire_leaving_modes`]: nvme-conformance, which writes its test patterns
    /// over whatever file it is given.
    pub fn acquire_created_leaving_modes(specs: &[DeviceSpec], lock_dir: &Path, undo: &FileUndo) -> Result<DeviceLocks, DeviceError> {
        Self::acquire_sharing(specs, lock_dir, true, Some(undo), PoolFileModes::Leave)
    }

    /// tuttid's lock on the `vfio:` function `address`, for a tool that moves the function
    /// between drivers (`tutti bind`, `tutti unbind`), taken only where its lock file
    /// (`lock_dir/vfio-BDF.lock`) is already there: None where the directory or the file is
    /// missing, for no tuttid has locked the function there. Neither is ever made: they belong
    /// to the user tuttid runs as, which refuses a lock directory or file of another's (root's,
    /// made by `sudo tutti bind`). The file is opened read-only (flock needs no write access;
    /// where NFS's emulation of it refuses a read-only descriptor, the same file is opened
    /// again for writing, if this user may), never through a symbolic link, and only a regular
    /// file is locked (a FIFO or device node is never opened for writing); its owner and the
    /// directory's are not checked ([`DeviceLocks::acquire`] does, for the files it may make):
    /// whoever owns the directory decides what is there, and nothing is written to it. Nor is
    /// its mode changed, as [`DeviceLocks::narrow_pool_files`] changes a pool file's: it is the file of
    /// the user tuttid runs as, who narrows it when taking it, and it holds no data (one others
    /// can open lets them only hold the lock, and they are named if they do). One another
    /// process holds is [`DeviceError::DeviceInUse`], naming the holder.
    pub fn acquire_existing(address: nvme_driver::hw::vfio::PciAddress, lock_dir: &Path) -> Result<Option<DeviceLocks>, DeviceError> {
        let spec = DeviceSpec::Vfio(address);
        let path = lock_dir.join(format!("vfio-{address}.lock"));
        let refuse = |reason: String| DeviceError::SharedLockFile {
            path: path.clone(),
            reason: format!("{reason}; have its owner remove it, or give the lock directory tuttid uses with --lock-dir"),
        };
        // Opened read-only (flock needs no write access), and its type checked before
        // anything else: a FIFO or a device node put there is never opened for writing.
        // O_NONBLOCK as open_without_waiting: a FIFO must not make the tool wait.
        let open = |write: bool| {
            OpenOptions::new().read(true).write(write).custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK).open(&path)
        };
        let file = match open(false) {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            // O_NOFOLLOW on a link: ELOOP; a socket cannot be opened: ENXIO. Said as what they are.
            Err(source) => match std::fs::symlink_metadata(&path) {
                Ok(metadata) if metadata.file_type().is_symlink() => {
                    return Err(refuse("the lock file is a symbolic link, which is not followed".into()))
                }
                Ok(metadata) if !metadata.file_type().is_file() => {
                    return Err(refuse(format!("the lock file is {}, not a regular file", file_kind(metadata.file_type()))))
                }
                _ => return Err(DeviceError::OpenFailed { path, source }),
            },
        };
        let metadata =
            file.metadata().map_err(|source| DeviceError::Io { context: format!("examining {} (what it is)", path.display()), source })?;
        if !metadata.file_type().is_file() {
            return Err(refuse(format!("the lock file is {}, not a regular file", file_kind(metadata.file_type()))));
        }
        // A second descriptor of the same open file: the inode stays open (its number cannot
        // be reused) and, through /proc/self/fd, can be opened again without looking the path
        // up (a file swapped in meanwhile is never opened).
        let same_file =
            file.try_clone().map_err(|source| DeviceError::Io { context: format!("duplicating {}", path.display()), source })?;
        let mut locks = DeviceLocks::default();
        match locks.lock(&spec, path.clone(), file) {
            // NFS emulates flock with POSIX locks, whose exclusive lock needs a descriptor open
            // for writing: the same file opened so, where this user may.
            Err(DeviceError::Io { source, .. }) if source.raw_os_error() == Some(nix::libc::EBADF) => {
                let again = format!("/proc/self/fd/{}", same_file.as_raw_fd());
                match OpenOptions::new().read(true).write(true).custom_flags(nix::libc::O_NONBLOCK).open(&again) {
                    Ok(writable) => {
                        let reopened = writable.metadata().map_err(|source| DeviceError::Io {
                            context: format!("examining {} opened again for writing", path.display()),
                            source,
                        })?;
                        if (reopened.dev(), reopened.ino()) != (metadata.dev(), metadata.ino()) {
                            return Err(lock_failure(&path, Errno::EBADF));
                        }
                        locks.lock(&spec, path, writable)?
                    }
                    Err(source) => {
                        return Err(DeviceError::Io {
                            context: format!(
                                "locking {}: a read-only descriptor was refused (EBADF: NFS, whose flock emulation needs one \
                                 open for writing), and opening it again for writing failed",
                                path.display()
                            ),
                            source,
                        })
                    }
                }
            }
            locked => locked?,
        }
        drop(same_file);
        Ok(Some(locks))
    }

    fn acquire_sharing(
        specs: &[DeviceSpec],
        lock_dir: &Path,
        create_files: bool,
        undo: Option<&FileUndo>,
        modes: PoolFileModes,
    ) -> Result<DeviceLocks, DeviceError> {
        refuse_shared_files(specs)?;
        let mut locks = DeviceLocks::default();
        // The lock directory, opened and checked once, when the first vfio: device needs it;
        // its lock files are opened relative to this descriptor, so the path is not resolved
        // again (a link swapped in meanwhile is not followed).
        let mut opened_lock_dir: Option<LockDir> = None;
        for spec in specs {
            let path = match spec {
                DeviceSpec::EmuFile(path) | DeviceSpec::Uring(path) => path.clone(),
                DeviceSpec::Vfio(address) => {
                    let dir = match &opened_lock_dir {
                        Some(dir) => dir,
                        None => opened_lock_dir.insert(LockDir::open(lock_dir)?),
                    };
                    let name = format!("vfio-{address}.lock");
                    let path = dir.path.join(&name);
                    let file = dir.open_lock_file(spec, &name, &path)?;
                    refuse_special_file(spec, &path, &file)?;
                    restrict_lock_file(&path, &file)?;
                    locks.lock(spec, path, file)?;
                    continue;
                }
                _ => continue,
            };
            let mut options = OpenOptions::new();
            options.read(true).write(create_files).create(create_files).truncate(false);
            // A pool file will hold every cached KV block: only its owner may read it (the
            // daemon's trust boundary is its 0600 socket and peer uid check), whatever the
            // umask. This mode applies only to a file created here; an existing one is
            // refused (another user's) or recorded (this user's) once open, below.
            options.mode(POOL_FILE_MODE);
            let file = match open_without_waiting(&path, &mut options) {
                Ok(file) => file,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => {
                    // A socket fails open(2) (ENXIO), and a directory opened for writing does
                    // (EISDIR), before any descriptor could be examined: the path says what it is.
                    refuse_special_path(spec, &path)?;
                    return Err(DeviceError::OpenFailed { path, source });
                }
            };
            refuse_special_file(spec, &path, &file)?;
            // An existing file has the mode it was made with (`truncate -s 64G pool.img` under
            // umask 022: 0644): every local user could read the cached KV blocks, and open it
            // to hold its lock (flock needs no write access), keeping tuttid out as in use.
            // Decided on this descriptor, so on the file locked, not a name's later target:
            // another user's is refused now, before its lock; this user's is only recorded
            // (every path below adds its lock to `held` at this index, or fails), to be
            // narrowed by narrow_pool_files once the caller knows it is its pool: a refusal,
            // here or the caller's, changes no file's mode.
            if modes == PoolFileModes::Narrow {
                if let Some(mode) = pool_file_narrowing(&path, &file)? {
                    locks.open_to_others.push((locks.held.len(), mode));
                }
            }
            // A file the given undo made is locked already, on the descriptor that made it:
            // that lock is shared (a duplicate of the descriptor), not refused as another's.
            if create_files {
                let metadata =
                    file.metadata().map_err(|source| DeviceError::Io { context: format!("examining {}", path.display()), source })?;
                let shared = match undo {
                    Some(undo) => undo.made_file(metadata.dev(), metadata.ino()).map(File::try_clone),
                    None => crate::undo::lent_file(metadata.dev(), metadata.ino()),
                };
                if let Some(shared) = shared {
                    let shared = shared.map_err(|source| DeviceError::Io {
                        context: format!("duplicating the descriptor that created {}", path.display()),
                        source,
                    })?;
                    locks.held.push((path, Held::Shared(shared)));
                    continue;
                }
            }
            locks.lock(spec, path, file)?;
        }
        Ok(locks)
    }

    /// Refuses ([`DeviceError::ReplacedWhileOpening`]) an `emu:PATH` or `uring:PATH` device
    /// whose opened file (`opened`: its device and inode, e.g. [`crate::OpenedDevice::backing_file`])
    /// is not a file this set locked at PATH: the device is opened by its path after the lock
    /// was taken, and a rename or link over PATH in between would leave the lock (and the
    /// narrowing of its mode) on one file while another is served, which a second user could
    /// lock and serve too. A PATH this set holds no lock for is refused too: a file missing
    /// when the locks were taken is skipped by [`DeviceLocks::acquire`], and one that appeared
    /// there since is unlocked. For the caller to call right after opening, before any I/O. A
    /// spec of another kind, or `opened` None (nothing was opened by path), passes.
    pub fn check_opened(&self, spec: &DeviceSpec, opened: Option<(u64, u64)>) -> Result<(), DeviceError> {
        check_opened_in(&[self], spec, opened)
    }

    /// Holds `other`'s locks as long as this set's, as one set: its pool files still to narrow
    /// are narrowed (or put back) by this set's [`DeviceLocks::narrow_pool_files`] together with
    /// this set's, and what it narrowed already is this set's to tell.
    pub fn extend(&mut self, other: DeviceLocks) {
        let offset = self.held.len();
        self.held.extend(other.held);
        self.open_to_others.extend(other.open_to_others.into_iter().map(|(index, mode)| (index + offset, mode)));
        self.narrowed.extend(other.narrowed);
    }

    /// Makes every pool file of this user's that others could open when it was locked (recorded
    /// by [`DeviceLocks::acquire`] and [`DeviceLocks::acquire_created`]), and still can, its
    /// owner's only: its mode read again and `fchmod` on the locked descriptor (the file that is
    /// locked, whatever its name names meanwhile; it needs ownership, not write access), so that
    /// a mode its owner changed since it was locked is what is narrowed, told and put back. One
    /// given to another user since (root's chown) is never chmodded: left as it is where only
    /// its owner can open it, refused ([`DeviceError::SharedLockFile`]) where group or others
    /// can, as the lock-time rule refuses it. For
    /// the caller to call once it knows the files are its pool (a format or an open of the pool
    /// succeeded), every lock still held: a command that refuses a file after locking it (what
    /// it holds, a claim) must change no mode. Returns one sentence per file, for the caller to
    /// print or log as a warning (this crate logs nothing): narrowed, or left open to others
    /// (its filesystem is read-only, or ignores permissions). Where one fails (EPERM: its
    /// filesystem refuses mode changes, or a file given away is refused), every file this call
    /// changed, that one included, gets its mode back, and the error names any that could not
    /// be put back. Each file is narrowed once: a second call has nothing left to do.
    ///
    /// `formatted`: the devices the caller has just formatted a pool on (empty if it formatted
    /// none). The error then says first that the pool was formatted there and is kept, and
    /// that only the narrowing failed: it comes after the write, and a bare refusal would read
    /// as if nothing had changed (what the devices held is gone).
    pub fn narrow_pool_files(&mut self, formatted: &[DeviceSpec]) -> Result<Vec<String>, DeviceError> {
        self.narrow_pool_files_with(formatted, &set_mode)
    }

    /// [`DeviceLocks::narrow_pool_files`] as a filesystem refusing the `nth` fchmod (from 1)
    /// with `errno` would make it, the others done: for the callers' tests. A test seam, hidden
    /// from the docs.
    #[doc(hidden)]
    pub fn narrow_pool_files_failing(&mut self, formatted: &[DeviceSpec], nth: usize, errno: i32) -> Result<Vec<String>, DeviceError> {
        let calls = std::cell::Cell::new(0);
        self.narrow_pool_files_with(formatted, &|file, mode| {
            calls.set(calls.get() + 1);
            if calls.get() == nth {
                Err(std::io::Error::from_raw_os_error(errno))
            } else {
                set_mode(file, mode)
            }
        })
    }

    /// [`DeviceLocks::narrow_pool_files`] with its `fchmod` given as `chmod`: for the callers'
    /// tests, which make it fail (EPERM) to see what their command then says and does. A test
    /// seam, hidden from the docs.
    #[doc(hidden)]
    pub fn narrow_pool_files_with(
        &mut self,
        formatted: &[DeviceSpec],
        chmod: &dyn Fn(&File, u32) -> std::io::Result<()>,
    ) -> Result<Vec<String>, DeviceError> {
        self.narrow_with(formatted, chmod, &|file| {
            file.metadata().map(|metadata| (metadata.uid(), metadata.gid(), metadata.mode() & 0o7777))
        })
    }

    /// [`DeviceLocks::narrow_pool_files`] with `chmod` (fchmod) and `mode_of` (fstat, before
    /// and after each fchmod: the file's owner, group and mode) given, so that a test can make
    /// either fail, or give the file away.
    fn narrow_with(
        &mut self,
        formatted: &[DeviceSpec],
        chmod_fn: &dyn Fn(&File, u32) -> std::io::Result<()>,
        mode_of: &ModeOf<'_>,
    ) -> Result<Vec<String>, DeviceError> {
        self.narrow_pending(chmod_fn, mode_of).map_err(|error| formatted_but(error, formatted))
    }

    /// The body of [`DeviceLocks::narrow_with`]: its error not yet told of the format.
    fn narrow_pending(
        &mut self,
        chmod_fn: &dyn Fn(&File, u32) -> std::io::Result<()>,
        mode_of: &ModeOf<'_>,
    ) -> Result<Vec<String>, DeviceError> {
        let pending = std::mem::take(&mut self.open_to_others);
        let first_new = self.narrowed.len();
        let euid = nix::unistd::geteuid().as_raw();
        // The files whose fchmod succeeded in this call, with the mode each had: put back if a
        // later one fails (nobody would be told of them: the caller gets the error).
        let mut changed: Vec<(usize, u32, u32)> = Vec::new();
        for &(index, _) in &pending {
            let (path, held) = &self.held[index];
            // The mode read when the file was locked is a whole format or pool recovery old: its
            // owner may have changed it since (made it 600, or 640 to share it with a group on
            // purpose). Decided again from the mode it has now, on the locked descriptor, so
            // that a file its owner narrowed is left alone, and a restore gives back the mode it
            // had just before, never a wider one of lock time. Its type was settled when it was
            // locked (the same inode); its owner is read again too (below).
            let (owner, gid, from) = match mode_of(held.file()) {
                Ok(read) => read,
                Err(source) => {
                    let error = DeviceError::Io { context: format!("examining {} to narrow its mode", path.display()), source };
                    return Err(self.put_back(first_new, &changed, chmod_fn, error));
                }
            };
            if from & 0o077 == 0 {
                continue;
            }
            // Given to another user since it was locked (chown: root's doing): the lock-time rule
            // applies again. Its mode is that user's to decide (root would be changing what
            // another user set up, anyone else gets EPERM, which would be blamed on the
            // filesystem), so it is never chmodded: one only its owner can open is left as it
            // is; one group or others can open is refused, as the next start would refuse it
            // (a command that succeeded would hand the next tuttid a pool it refuses), every
            // mode this call changed put back.
            if owner != euid {
                match pool_file_access(true, owner, gid, from, euid) {
                    PoolFileAccess::Refuse(reason) => {
                        let error = DeviceError::SharedLockFile {
                            path: path.clone(),
                            reason: format!("it was given to another user while it was locked: {reason}"),
                        };
                        return Err(self.put_back(first_new, &changed, chmod_fn, error));
                    }
                    PoolFileAccess::Keep | PoolFileAccess::Narrow(_) => continue,
                }
            }
            let to = from & 0o700;
            let chmod = chmod_fn(held.file(), to);
            let chmodded = chmod.is_ok();
            if chmodded {
                changed.push((index, from, to));
            }
            // The mode is read again after fchmod: some filesystems accept the change and keep
            // the old mode (narrowing_outcome tells it as such).
            let outcome = match chmod {
                Ok(()) => match mode_of(held.file()) {
                    Ok((_, _, now)) => narrowing_outcome(path, from, to, Ok(()), Some(now)),
                    Err(source) => {
                        Err(DeviceError::Io { context: format!("examining {} after narrowing its mode", path.display()), source })
                    }
                },
                Err(source) => narrowing_outcome(path, from, to, Err(source), None),
            };
            match outcome {
                Ok(narrowing) => self.narrowed.push((path.clone(), from, narrowing)),
                Err(error) => {
                    return Err(self.put_back(first_new, &changed, chmod_fn, error));
                }
            }
        }
        Ok(self.narrowed[first_new..].iter().map(|(path, mode, narrowing)| note(path, *mode, *narrowing)).collect())
    }

    /// `error`, once every file of `changed` (index in `held`, mode it had, mode it was given)
    /// got its mode back through `chmod` and the entries this call added to `narrowed` (from
    /// `first_new` on) were dropped: those that could not be put back are named in its context
    /// (left their owner's only: their owner must know to give the mode back).
    fn put_back(
        &mut self,
        first_new: usize,
        changed: &[(usize, u32, u32)],
        chmod: &dyn Fn(&File, u32) -> std::io::Result<()>,
        error: DeviceError,
    ) -> DeviceError {
        // None of this call's files stays counted as narrowed.
        self.narrowed.truncate(first_new);
        let mut failures = Vec::new();
        for &(index, from, to) in changed {
            let (path, held) = &self.held[index];
            // It was changed by this very descriptor a moment ago.
            if let Err(source) = chmod(held.file(), from) {
                failures
                    .push(format!("putting the mode of {} back to {from:04o} failed too ({source}): it is left {to:04o}", path.display()));
            }
        }
        match error {
            DeviceError::Io { context, source } if !failures.is_empty() => {
                DeviceError::Io { context: format!("{context}; {}", failures.join("; ")), source }
            }
            DeviceError::SharedLockFile { path, reason } if !failures.is_empty() => {
                DeviceError::SharedLockFile { path, reason: format!("{reason}; {}", failures.join("; ")) }
            }
            error => error,
        }
    }

    /// What a command that only reads its pool (`tutti pool inspect`, `check`) tells of the
    /// pool files of this user's that others can open (recorded when locked), one sentence
    /// each: it changes no mode, and says how to, with `chmod go-rwx`, which is right whatever
    /// the mode (a fixed `chmod 600` would take the owner's execute bit, one made of the owner's
    /// bits would differ from file to file), and who else does it.
    pub fn open_to_others_notes(&self) -> Vec<String> {
        self.open_to_others
            .iter()
            .map(|&(index, mode)| {
                let path = self.held[index].0.display();
                format!(
                    "pool file {path} is mode {mode:04o}: other users can read its cached KV blocks and hold its lock; make it its \
                     owner's only with chmod go-rwx {path} (tuttid, the Python Store, `tutti pool format` and tutti-bench's kv \
                     runs do so when they use it)"
                )
            })
            .collect()
    }

    fn lock(&mut self, spec: &DeviceSpec, path: PathBuf, file: File) -> Result<(), DeviceError> {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => {
                self.held.push((path, Held::Own(lock)));
                Ok(())
            }
            Err((file, Errno::EWOULDBLOCK)) => {
                Err(DeviceError::DeviceInUse { spec: spec.to_string(), lock: path.clone(), holder: holder_of(&file, Path::new("/proc")) })
            }
            Err((_, errno)) => Err(lock_failure(&path, errno)),
        }
    }

    /// The pool files of this user's that others could open, whose group and others'
    /// permissions [`DeviceLocks::narrow_pool_files`] took away, each with the mode it had.
    pub fn narrowed(&self) -> impl Iterator<Item = (&Path, u32)> {
        self.narrowed.iter().filter(|(_, _, narrowing)| *narrowing == Narrowing::Done).map(|(path, mode, _)| (path.as_path(), *mode))
    }

    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.held.iter().map(|(path, _)| path.as_path())
    }
}

/// fchmod on the locked descriptor: what narrowing does to a file.
fn set_mode(file: &File, mode: u32) -> std::io::Result<()> {
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))
}

/// [`DeviceLocks::check_opened`] over several sets held together (a command that locks the
/// files it creates as a set of their own): the opened file must be one of those any set
/// locked at its path; a path none of them holds is refused as unlocked.
pub fn check_opened_in(sets: &[&DeviceLocks], spec: &DeviceSpec, opened: Option<(u64, u64)>) -> Result<(), DeviceError> {
    let (DeviceSpec::EmuFile(path) | DeviceSpec::Uring(path)) = spec else { return Ok(()) };
    let Some(opened) = opened else { return Ok(()) };
    // One path may be locked twice in a set grown by `extend` (a file locked again after
    // another was put in its place): the file opened must be one of them. None at all: the
    // file appeared after the locks were taken (`acquire` skips a missing one), unlocked.
    for (_, held) in sets.iter().flat_map(|set| set.held.iter()).filter(|(held, _)| held == path) {
        let locked = held
            .file()
            .metadata()
            .map_err(|source| DeviceError::Io { context: format!("examining the locked {}", path.display()), source })?;
        if (locked.dev(), locked.ino()) == opened {
            return Ok(());
        }
    }
    Err(DeviceError::ReplacedWhileOpening { spec: spec.to_string(), path: path.clone() })
}

/// `error`, from narrowing the pool files of a pool just formatted on `formatted` (none: left
/// as it is), saying first that the format was done and is kept: the narrowing comes after it,
/// so a bare refusal would read as if nothing had changed, though what the devices held is
/// gone. Narrowing fails with [`DeviceError::Io`], or [`DeviceError::SharedLockFile`] (a file
/// given to another user since it was locked, open to others; that error names the file
/// first, then says this); any other error is left as it is.
fn formatted_but(error: DeviceError, formatted: &[DeviceSpec]) -> DeviceError {
    if formatted.is_empty() {
        return error;
    }
    let listed = formatted.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
    let kept = format!(
        "the pool was formatted on {listed} and is kept there (it replaced what was there); only making its files their \
         owner's failed, and tuttid, tutti-bench and the Python Store refuse the pool while that fails"
    );
    match error {
        DeviceError::Io { context, source } => DeviceError::Io { context: format!("{kept}: {context}"), source },
        DeviceError::SharedLockFile { path, reason } => DeviceError::SharedLockFile { path, reason: format!("{kept}: {reason}") },
        error => error,
    }
}

/// What [`DeviceLocks::narrow_pool_files`] did to the mode of the pool file at `path` (mode
/// `mode` before), one sentence: the one wording tuttid, the in-process Store and the tools
/// print or log as a warning.
fn note(path: &Path, mode: u32, narrowing: Narrowing) -> String {
    let path = path.display();
    match narrowing {
        Narrowing::Done => format!(
            "pool file {path} was mode {mode:04o}: other users could read its cached KV blocks and hold its lock; it is now \
             {:04o}, its owner's only (a process that already had it open keeps its access until it closes it)",
            mode & 0o700
        ),
        Narrowing::Ignored { now } => format!(
            "pool file {path} is mode {now:04o} and could not be narrowed: changing it to {:04o} succeeded but its \
             filesystem ignores permissions (vfat, CIFS with noperm, some FUSE filesystems), so other users may read its \
             cached KV blocks and hold its lock; keep the pool on a filesystem with Unix permissions",
            mode & 0o700
        ),
        Narrowing::ReadOnly => format!(
            "pool file {path} is mode {mode:04o} on a read-only filesystem, where its mode cannot be changed and was left \
             so: other users can read its cached KV blocks and hold its lock"
        ),
    }
}

/// The error of a `flock` on `path` that failed with `errno` (other than `EWOULDBLOCK`, in use).
/// `EBADF` is what NFS answers (and any filesystem that emulates `flock` with POSIX locks):
/// there an exclusive lock needs a descriptor open for writing, and an existing pool file is
/// opened read-only to lock it; the bare errno would leave the user guessing.
fn lock_failure(path: &Path, errno: Errno) -> DeviceError {
    let context = match errno {
        Errno::EBADF => format!(
            "locking {} (it is likely on NFS, or another filesystem that emulates flock with POSIX locks, where an exclusive \
             lock needs a descriptor opened for writing, and an existing pool file, or a lock file this user cannot write, is \
             opened read-only to lock it; a file on a local filesystem avoids this)",
            path.display()
        ),
        _ => format!("locking {}", path.display()),
    };
    DeviceError::Io { context, source: std::io::Error::from_raw_os_error(errno as i32) }
}

/// The lock directory of `vfio:` lock files, open: its lock files are opened relative to this
/// descriptor (`openat`), so the directory checked is the one they are made in.
struct LockDir {
    /// The directory as given, without a trailing slash or `.` (for messages and lock paths).
    path: PathBuf,
    dir: File,
}

impl LockDir {
    /// How the lock directory is opened: `O_PATH`, which needs no read permission on it (a
    /// directory of ours with mode 0300 serves: `openat` of a lock file needs search and write
    /// permission only) and still gives a descriptor that `fstat` and `openat` take; the
    /// directory itself, never what a symbolic link names.
    const FLAGS: nix::fcntl::OFlag = nix::fcntl::OFlag::O_PATH
        .union(nix::fcntl::OFlag::O_DIRECTORY)
        .union(nix::fcntl::OFlag::O_NOFOLLOW)
        .union(nix::fcntl::OFlag::O_CLOEXEC);

    /// Creates `lock_dir` if missing (0700), opens it without following a symbolic link, and
    /// refuses it ([`refuse_shared_lock_dir`]) unless it is this user's own and writable by no
    /// one else.
    fn open(lock_dir: &Path) -> Result<LockDir, DeviceError> {
        // A trailing slash, or a last component `.`, makes the kernel follow a symbolic link
        // named before it even for lstat and O_NOFOLLOW: dropped, the last component is the
        // directory itself.
        let path: PathBuf = lock_dir.components().collect();
        // The owner's only (an existing directory keeps its mode): nobody else has anything
        // to do in it.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(LOCK_DIR_MODE)
            .create(&path)
            .map_err(|source| refuse_non_directory(&path, source))?;
        // The directory itself, not what a symbolic link names: a link (which whoever can write
        // where it lives can point anywhere) is refused; a parent directory that is a link is fine.
        let opened = nix::fcntl::open(&path, Self::FLAGS, nix::sys::stat::Mode::empty());
        let dir = match opened {
            Ok(dir) => File::from(dir),
            Err(errno) => {
                let source = std::io::Error::from_raw_os_error(errno as i32);
                // O_NOFOLLOW | O_DIRECTORY on a link: ELOOP or ENOTDIR, whichever the kernel checks first.
                if std::fs::symlink_metadata(&path).is_ok_and(|metadata| metadata.file_type().is_symlink()) {
                    return Err(DeviceError::SharedLockFile {
                        path,
                        reason: "the lock directory is a symbolic link, which is not followed (whoever can change it could point it \
                                 at a directory of their own); give the directory it names, or another --lock-dir"
                            .into(),
                    });
                }
                return Err(DeviceError::Io { context: format!("opening the lock directory {}", path.display()), source });
            }
        };
        refuse_shared_lock_dir(&path, &dir)?;
        Ok(LockDir { path, dir })
    }

    /// Opens (creating it 0600 if missing) the lock file `name` of this directory for `spec`;
    /// `path` is its path, for messages. A lock file planted as a symbolic link (to
    /// /etc/passwd, say) is not followed, and refused: its mode is changed after this.
    fn open_lock_file(&self, spec: &DeviceSpec, name: &str, path: &Path) -> Result<File, DeviceError> {
        use nix::fcntl::OFlag;
        // flock needs only a descriptor, so anyone who could open the lock file could hold the
        // SSD's lock and keep tuttid from it: owner only, whatever the umask.
        let flags = OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_NONBLOCK | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let mode = nix::sys::stat::Mode::from_bits_truncate(LOCK_FILE_MODE);
        match nix::fcntl::openat(&self.dir, name, flags, mode) {
            Ok(fd) => Ok(File::from(fd)),
            Err(errno) => {
                // A socket fails open(2) (ENXIO), and a directory opened for writing does
                // (EISDIR), before any descriptor could be examined: an O_PATH descriptor of
                // the name (which opens anything, following nothing) says what it is.
                let what = nix::fcntl::openat(
                    &self.dir,
                    name,
                    OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    nix::sys::stat::Mode::empty(),
                )
                .ok()
                .and_then(|fd| File::from(fd).metadata().ok());
                if let Some(metadata) = what {
                    if metadata.file_type().is_symlink() {
                        return Err(DeviceError::SharedLockFile {
                            path: path.to_path_buf(),
                            reason: "the lock file is a symbolic link, which is not followed (whoever made it could hold the lock or \
                                     point it anywhere); have its owner remove it while no tutti process runs, or give another --lock-dir"
                                .into(),
                        });
                    }
                    refuse_special_type(spec, path, metadata.file_type())?;
                }
                Err(DeviceError::OpenFailed { path: path.to_path_buf(), source: std::io::Error::from_raw_os_error(errno as i32) })
            }
        }
    }
}

/// The lock directory `lock_dir`'s making that failed with `source`, as an error: if it failed
/// because `lock_dir`, or a directory above it, exists and is not a directory (a regular file, a
/// dangling symbolic link or a link to a file: `mkdir` says EEXIST), a refusal of what was
/// given ([`DeviceError::SharedLockFile`], unusable input for every tool) naming it; otherwise
/// an I/O error, decided by its errno (EACCES: input; EIO, ENOSPC: a failure). EEXIST itself is
/// not made unusable input everywhere ([`crate::is_unusable_errno`]): elsewhere it means a file
/// made meanwhile by another (`O_CREAT | O_EXCL`), which is no fault of what was given.
fn refuse_non_directory(lock_dir: &Path, source: std::io::Error) -> DeviceError {
    if source.raw_os_error() == Some(Errno::EEXIST as i32) {
        // The deepest path that exists, as mkdir sees it: if it (followed) is no directory,
        // that is why the lock directory could not be made.
        let existing = lock_dir.ancestors().find_map(|at| std::fs::symlink_metadata(at).ok().map(|metadata| (at, metadata)));
        if let Some((at, metadata)) = existing {
            if !std::fs::metadata(at).is_ok_and(|followed| followed.is_dir()) {
                let kind = if !metadata.file_type().is_symlink() {
                    file_kind(metadata.file_type()).to_string()
                } else {
                    match std::fs::metadata(at) {
                        Ok(followed) => format!("a symbolic link to {}", file_kind(followed.file_type())),
                        Err(_) => "a symbolic link that names nothing".to_string(),
                    }
                };
                let what = if at == lock_dir {
                    "the lock directory".to_string()
                } else {
                    format!("a directory above the lock directory {}", lock_dir.display())
                };
                return DeviceError::SharedLockFile {
                    path: at.to_path_buf(),
                    reason: format!("{what} is {kind}, not a directory; give a directory, or another --lock-dir"),
                };
            }
        }
    }
    DeviceError::Io { context: format!("creating the lock directory {}", lock_dir.display()), source }
}

/// Refuses the lock directory `dir` (opened from `lock_dir`) unless it is this user's own and
/// writable by no one else: whoever can write to it can replace a lock file (and so hold the
/// SSD's lock, or plant a link).
fn refuse_shared_lock_dir(lock_dir: &Path, dir: &File) -> Result<(), DeviceError> {
    let metadata = dir
        .metadata()
        .map_err(|source| DeviceError::Io { context: format!("examining the lock directory {}", lock_dir.display()), source })?;
    let euid = nix::unistd::geteuid().as_raw();
    if metadata.uid() != euid || metadata.mode() & 0o022 != 0 {
        return Err(DeviceError::SharedLockFile {
            path: lock_dir.to_path_buf(),
            reason: format!(
                "the lock directory is owned by uid {} with mode {:o}; it must be owned by uid {euid} (the user that runs tutti) \
                 and writable by no one else: give another --lock-dir, or have its owner run tutti",
                metadata.uid(),
                metadata.mode() & 0o7777
            ),
        });
    }
    Ok(())
}

/// A `vfio:` lock file must be a regular file with one link, owned by this user and readable by
/// no one else ([`LOCK_FILE_MODE`]); one others can open (an older build's 0644) is made so.
/// Anything else is refused before its mode is touched (root would otherwise change the mode of
/// whatever a planted hard link names): whoever owns it could hold the lock.
fn restrict_lock_file(path: &Path, file: &File) -> Result<(), DeviceError> {
    let metadata = file.metadata().map_err(|source| DeviceError::Io { context: format!("examining {}", path.display()), source })?;
    let euid = nix::unistd::geteuid().as_raw();
    let advice = "have its owner run tutti, or (while no tutti process runs) chown it to the user that runs tutti and chmod it 600";
    let refuse = |reason: String| Err(DeviceError::SharedLockFile { path: path.to_path_buf(), reason: format!("{reason}; {advice}") });
    if !metadata.is_file() {
        return refuse(format!("the lock file is {}, not a regular file", file_kind(metadata.file_type())));
    }
    if metadata.nlink() != 1 {
        return refuse(format!("the lock file has {} links (a lock file has one)", metadata.nlink()));
    }
    if metadata.uid() != euid {
        return refuse(format!("the lock file is owned by uid {}, not {euid}, so others could hold the lock", metadata.uid()));
    }
    if metadata.mode() & 0o077 == 0 {
        return Ok(());
    }
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(LOCK_FILE_MODE)).map_err(|source| DeviceError::Io {
        context: format!(
            "{} can be opened by other users (mode {:o}), who could hold the lock; making it {LOCK_FILE_MODE:o} failed ({advice})",
            path.display(),
            metadata.mode() & 0o777
        ),
        source,
    })
}

/// Whether [`DeviceLocks`] applies [`pool_file_access`] to the existing files it locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PoolFileModes {
    /// Pool files ([`DeviceLocks::acquire`]): another user's refused, this user's recorded for
    /// [`DeviceLocks::narrow_pool_files`].
    Narrow,
    /// Any file ([`DeviceLocks::acquire_leaving_modes`]): its mode left as it is.
    Leave,
}

/// What is done with a pool file's mode before it is locked ([`pool_file_access`]).
#[derive(Debug, PartialEq, Eq)]
enum PoolFileAccess {
    /// Left as it is.
    Keep,
    /// Changed to this mode (the owner's bits only).
    Narrow(u32),
    /// Refused ([`DeviceError::SharedLockFile`]) for this reason.
    Refuse(String),
}

/// The rule for an existing pool file (`regular`: a regular file; its owner `uid`, group `gid`,
/// `mode`) that the user `euid` is to lock. A pool file holds every cached KV block, and
/// whoever can open it can hold its lock (flock needs only a descriptor), so only its owner may
/// open it: one of this user's that group or others may open is narrowed to its owner's bits;
/// one of another user's that group or others can read or write is refused (changing it is its
/// owner's decision; root could, but would be changing a file another user set up), naming who
/// can. A block device (or a character device: whoever opens it for I/O says what it cannot
/// use) keeps the mode the system gave it (udev, the disk group).
fn pool_file_access(regular: bool, uid: u32, gid: u32, mode: u32, euid: u32) -> PoolFileAccess {
    if !regular {
        return PoolFileAccess::Keep;
    }
    if uid == euid {
        return if mode & 0o077 == 0 { PoolFileAccess::Keep } else { PoolFileAccess::Narrow(mode & 0o700) };
    }
    let can = |bits: u32| match (bits & 0o4 != 0, bits & 0o2 != 0) {
        (true, true) => Some("read and write it"),
        (true, false) => Some("read it"),
        (false, true) => Some("write it"),
        (false, false) => None,
    };
    let mut who = Vec::new();
    if let Some(access) = can(mode >> 3) {
        who.push(format!("group gid {gid} can {access}"));
    }
    if let Some(access) = can(mode) {
        who.push(format!("every user can {access}"));
    }
    if who.is_empty() {
        return PoolFileAccess::Keep;
    }
    PoolFileAccess::Refuse(format!(
        "the pool file is owned by uid {uid}, not {euid} (the user that runs tutti), with mode {mode:o}: {}; it holds every \
         cached KV block, and whoever can open it can hold its lock; have its owner run tutti, or (while no tutti process \
         runs) chmod go-rwx it or chown it to the user that runs tutti",
        who.join(", ")
    ))
}

/// [`pool_file_access`] applied to `file`, opened from `path` to lock it: `Some(mode it has)`
/// where it is to be narrowed ([`DeviceLocks::narrow_pool_files`]); another user's that others
/// can open refused.
fn pool_file_narrowing(path: &Path, file: &File) -> Result<Option<u32>, DeviceError> {
    let metadata = file.metadata().map_err(|source| DeviceError::Io { context: format!("examining {}", path.display()), source })?;
    let mode = metadata.mode() & 0o7777;
    let euid = nix::unistd::geteuid().as_raw();
    match pool_file_access(metadata.is_file(), metadata.uid(), metadata.gid(), mode, euid) {
        PoolFileAccess::Keep => Ok(None),
        PoolFileAccess::Narrow(_) => Ok(Some(mode)),
        PoolFileAccess::Refuse(reason) => Err(DeviceError::SharedLockFile { path: path.to_path_buf(), reason }),
    }
}

/// How [`DeviceLocks::narrow_pool_files`] reads a locked file's owner, group and mode (fstat;
/// a test's own for the tests).
type ModeOf<'a> = dyn Fn(&File) -> std::io::Result<(u32, u32, u32)> + 'a;

/// What narrowing a pool file's mode came to ([`narrowing_outcome`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Narrowing {
    /// Its group and others' bits are cleared.
    Done,
    /// `fchmod` succeeded, yet the mode (`now`) still lets others open it: a filesystem that
    /// ignores permissions (vfat without `quiet` errors, CIFS with `noperm`, some FUSE ones).
    Ignored { now: u32 },
    /// Left as it is: `fchmod` said EROFS, a read-only mount, where nobody can write the file.
    /// Hardly reached: the callers narrow once their pool is open for writing, which fails on
    /// a read-only mount first (a mount made read-only since would do it).
    ReadOnly,
}

/// The decision of [`DeviceLocks::narrow_pool_files`] on what `fchmod` of the pool file at `path` from
/// `from` to `to` said (`chmod`) and, where it succeeded, the mode `fstat` then read (`now`).
fn narrowing_outcome(path: &Path, from: u32, to: u32, chmod: std::io::Result<()>, now: Option<u32>) -> Result<Narrowing, DeviceError> {
    let source = match chmod {
        Ok(()) => {
            return Ok(match now {
                Some(now) if now & 0o077 != 0 => Narrowing::Ignored { now },
                _ => Narrowing::Done,
            })
        }
        Err(source) => source,
    };
    let why = match source.raw_os_error().map(Errno::from_raw) {
        Some(Errno::EROFS) => return Ok(Narrowing::ReadOnly),
        // Not an immutable or append-only file (chattr +i, +a): every caller opens its pool for
        // writing before narrowing it, and that open fails there first.
        Some(Errno::EPERM) => format!(
            "EPERM: its filesystem refuses mode changes (vfat, CIFS, NFS mapping user ids, some FUSE filesystems); make it its \
             owner's only yourself where its filesystem allows it (chmod go-rwx {}), or keep the pool on a filesystem with Unix \
             permissions",
            path.display()
        ),
        _ => format!("chmod go-rwx {}, or keep the pool on a filesystem with Unix permissions", path.display()),
    };
    Err(DeviceError::Io {
        context: format!(
            "{} can be opened by other users (mode {from:o}), who could read every cached KV block and hold its lock; making it \
             {to:o} failed ({why})",
            path.display()
        ),
        source,
    })
}

/// Opens `path` as `options` say, with `O_NONBLOCK`: opening a FIFO for reading waits for a
/// writer, without end (and tuttid, its SIGINT and SIGTERM blocked until the pool is open,
/// could not even be stopped). On a regular file or a block device the flag changes nothing
/// here: the descriptor is only locked or read with `pread`, which it does not affect.
pub(crate) fn open_without_waiting(path: &Path, options: &mut OpenOptions) -> std::io::Result<File> {
    options.custom_flags(nix::libc::O_NONBLOCK).open(path)
}

/// Refuses ([`DeviceError::NotAFileOrDevice`], naming `path` and what it is) `file`, opened
/// from `path` for `spec`, unless it is a regular file or a device: a FIFO, a socket or a
/// directory is no place for a pool. A character device is left to whoever opens it for I/O,
/// which says what it cannot use (tutti-bench locks its `uring:` paths here too, and its kv
/// workload refuses `uring:/dev/null` as no pool device, naming the kinds it takes).
pub(crate) fn refuse_special_file(spec: &DeviceSpec, path: &Path, file: &File) -> Result<(), DeviceError> {
    let metadata =
        file.metadata().map_err(|source| DeviceError::Io { context: format!("examining {} (what it is)", path.display()), source })?;
    refuse_special_type(spec, path, metadata.file_type())
}

/// [`refuse_special_file`] for a `path` that could not be opened (a socket cannot be): its
/// type from `stat` of the path, following symlinks as the open did (stat opens nothing, so a
/// FIFO does not make it wait). Ok when the path cannot be examined either: the caller reports
/// the open's own error.
pub(crate) fn refuse_special_path(spec: &DeviceSpec, path: &Path) -> Result<(), DeviceError> {
    match std::fs::metadata(path) {
        Ok(metadata) => refuse_special_type(spec, path, metadata.file_type()),
        Err(_) => Ok(()),
    }
}

fn refuse_special_type(spec: &DeviceSpec, path: &Path, file_type: std::fs::FileType) -> Result<(), DeviceError> {
    if file_type.is_file() || file_type.is_block_device() || file_type.is_char_device() {
        return Ok(());
    }
    Err(DeviceError::NotAFileOrDevice { spec: spec.to_string(), path: path.to_path_buf(), kind: file_kind(file_type).into() })
}

/// What a file of `file_type` is, for a refusal that names it ("a FIFO (named pipe)").
pub fn file_kind(file_type: std::fs::FileType) -> &'static str {
    if file_type.is_file() {
        "a regular file"
    } else if file_type.is_dir() {
        "a directory"
    } else if file_type.is_symlink() {
        "a symbolic link"
    } else if file_type.is_fifo() {
        "a FIFO (named pipe)"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "a special file"
    }
}

/// Reads of `/proc/locks` before the holder is given up as not found.
const PROC_LOCKS_READS: usize = 5;

/// "pid N (command line)" of the process holding a flock on `file`, from `proc/locks` (its
/// first 200 characters, control characters escaped: `printable`) once that process is seen to
/// have the file open; otherwise a sentence saying what is known: a pid /proc/locks recorded
/// that no longer has it open, a lock listed without a pid, or no lock found (the holder may
/// have just exited).
pub fn holder_of(file: &File, proc_root: &Path) -> String {
    let Ok(metadata) = file.metadata() else {
        return "another process (the lock file cannot be examined)".into();
    };
    let (major, minor) = split_device(metadata.dev());
    // A candidate is confirmed by the path its descriptors name, compared with the one ours
    // names (`has_open`); without our own path there is nothing to compare (None).
    let own_path = own_descriptor_path(file);
    // Each pid's descriptors are looked at once, however many times /proc/locks is read.
    let confirmed: RefCell<HashMap<u32, Option<bool>>> = RefCell::default();
    let holds_the_file = |pid: u32| {
        own_path
            .as_ref()
            .and_then(|own_path| *confirmed.borrow_mut().entry(pid).or_insert_with(|| has_open(proc_root, pid, own_path, FDS_EXAMINED_MAX)))
    };
    // The kernel produces /proc/locks page by page from lists other processes change meanwhile,
    // so one read can miss a line that was there all along (seen under load in CI): read again.
    let holder = (0..PROC_LOCKS_READS).find_map(|_| {
        let locks = std::fs::read_to_string(proc_root.join("locks")).unwrap_or_default();
        find_flock_holder(&locks, major, minor, metadata.ino(), &holds_the_file)
    });
    let command_line = |pid: u32| {
        let command = std::fs::read(proc_root.join(pid.to_string()).join("cmdline"))
            .map(|raw| {
                let text: String = String::from_utf8_lossy(&raw).replace('\0', " ").trim().chars().take(200).collect();
                printable(&text)
            })
            .unwrap_or_default();
        if command.is_empty() {
            format!("pid {pid}")
        } else {
            format!("pid {pid} ({command})")
        }
    };
    match holder {
        Some(FlockHolder::Confirmed(pid)) => command_line(pid),
        // The pid listed is all there is (another user's process, one /proc hides, one with more
        // descriptors than are looked at): named, saying so.
        Some(FlockHolder::Unconfirmed(pid)) => {
            format!("{} as /proc/locks lists it (whether it still has the file open could not be seen)", command_line(pid))
        }
        // Its command line is not given: the pid may name another program by now.
        Some(FlockHolder::Recorded(pid)) => format!(
            "another process: /proc/locks lists pid {pid}, recorded when it took the lock, but that process no longer has \
             it open by this path (it left its descriptor to a process that inherited it, or opened the file under \
             another name: a hard link, another mount namespace's path)"
        ),
        Some(FlockHolder::NoPid) => "another process (/proc/locks gives no pid: the one that took the lock is outside this \
                                     PID namespace, or has exited and left it to a process that inherited its descriptor)"
            .into(),
        None => "another process (not found in /proc/locks; it may have just exited)".into(),
    }
}

/// `text` with its control characters escaped (`\n`, `\u{1b}`), the rest kept: another
/// process's command line goes into [`DeviceError::DeviceInUse`], and so into tuttid's log and
/// the tools' one-line errors, where a raw terminal escape (ESC `[2K` erases the line being
/// read) or newline (a forged log line) would act on whoever reads it. Escaped as tutti-cli's
/// `printable` escapes (this crate does not depend on it).
fn printable(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for character in text.chars() {
        if character.is_control() {
            escaped.extend(character.escape_default());
        } else {
            escaped.push(character);
        }
    }
    escaped
}

/// Whether `/proc/locks` lists a FLOCK WRITE lock held by `pid` on `path`'s own device and inode.
/// Tests use it to tell a lookup that must name the holder from a system that hides the lock (a
/// holder outside the reading pid namespace is left out; a stacked filesystem lists the lock
/// under another device); a line that merely shares the inode number is no evidence, since inode
/// numbers repeat across filesystems.
pub fn lists_flock_exactly(path: &Path, pid: u32) -> bool {
    let Ok(metadata) = std::fs::metadata(path) else {
        return false;
    };
    let (major, minor) = split_device(metadata.dev());
    let ours = (pid, major, minor, metadata.ino());
    std::fs::read_to_string("/proc/locks").unwrap_or_default().lines().filter_map(parse_flock_write).any(|lock| lock == ours)
}

/// (pid, major, minor, inode) of a `/proc/locks` FLOCK WRITE line, e.g.
/// `3: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF`; `None` for any other line (waiters `->`,
/// POSIX locks, malformed text: the file is the kernel's, but nothing here trusts its shape).
fn parse_flock_write(line: &str) -> Option<(u32, u64, u64, u64)> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.get(1) != Some(&"FLOCK") || fields.get(3) != Some(&"WRITE") {
        return None;
    }
    let pid = fields.get(4)?.parse::<u32>().ok()?;
    let mut location = fields.get(5)?.split(':');
    let major = u64::from_str_radix(location.next()?, 16).ok()?;
    let minor = u64::from_str_radix(location.next()?, 16).ok()?;
    let inode = location.next()?.parse::<u64>().ok()?;
    Some((pid, major, minor, inode))
}

/// Linux's encoding of a `dev_t` (glibc's `gnu_dev_major`/`minor`).
fn split_device(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major, minor)
}

/// What `/proc/locks` says of the holder of a flock ([`find_flock_holder`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FlockHolder {
    /// The pid listed, seen to have the file open.
    Confirmed(u32),
    /// The pid listed on the file's exact device, which could not be checked (our own path of
    /// the file is unknown, or the process's descriptors could not all be looked at:
    /// [`has_open`]).
    Unconfirmed(u32),
    /// The pid listed on the file's exact device, which does not have the file open: the pid
    /// recorded when the lock was taken, whose taker left it to a process that inherited its
    /// descriptor (that pid may name another process by now), or one in another namespace.
    Recorded(u32),
    /// Listed on the exact device with pid 0: the kernel's answer for a taker outside the
    /// reader's PID namespace or one that has exited.
    NoPid,
}

/// The holder of the FLOCK WRITE lock on (major:minor:inode) in `/proc/locks` text (lines read
/// by [`parse_flock_write`]). The pid listed is the one that took the lock, so a line on this
/// exact device names its holder only once `holds_the_file` confirms that the pid has the file
/// open (None from it: cannot tell); pid 0 names nobody ([`FlockHolder::NoPid`]). When no line
/// names this exact device (a stacked filesystem can report another device number to `stat`
/// than the one its locks are listed under), a line on the same inode is only evidence once
/// confirmed too (inode numbers repeat across filesystems: an unconfirmed line may be any
/// process's lock on any other file).
fn find_flock_holder(locks: &str, major: u64, minor: u64, inode: u64, holds_the_file: &dyn Fn(u32) -> Option<bool>) -> Option<FlockHolder> {
    let same_inode: Vec<(u32, u64, u64)> = locks
        .lines()
        .filter_map(parse_flock_write)
        .filter(|&(_, _, _, found_inode)| found_inode == inode)
        .map(|(pid, found_major, found_minor, _)| (pid, found_major, found_minor))
        .collect();
    let exact = same_inode.iter().find(|&&(_, found_major, found_minor)| found_major == major && found_minor == minor);
    match exact {
        Some(&(0, _, _)) => Some(FlockHolder::NoPid),
        Some(&(pid, _, _)) => Some(match holds_the_file(pid) {
            Some(true) => FlockHolder::Confirmed(pid),
            Some(false) => FlockHolder::Recorded(pid),
            None => FlockHolder::Unconfirmed(pid),
        }),
        None => {
            same_inode.iter().map(|&(pid, _, _)| pid).find(|&pid| pid != 0 && holds_the_file(pid) == Some(true)).map(FlockHolder::Confirmed)
        }
    }
}

/// Descriptors of one process looked at before giving up: a bound on the walk of
/// `proc_root/PID/fd` (a process may hold very many; each look is one readlink, about a
/// microsecond, so the bound costs at most some tens of milliseconds per candidate).
const FDS_EXAMINED_MAX: usize = 1 << 16;

/// The path the kernel shows for this process's descriptor `file` (`/proc/self/fd/N`, always
/// the real /proc: it is our own descriptor), as it shows another process's descriptors of the
/// same file; `None` if it cannot be read.
fn own_descriptor_path(file: &File) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).ok()
}

/// Whether process `pid` has a descriptor whose link in `proc_root/PID/fd` names `own_path`
/// (the lock file as our own descriptor names it). Only the links' text is read (readlink, which
/// the kernel answers from its own record of the open file): following a link (stat, open)
/// reaches the file's filesystem, and on a hung hard-mounted NFS or FUSE mount that blocks
/// without end, with tuttid's stop signals blocked while it opens its pool. So a descriptor
/// opened through another name (a hard link, another mount namespace's path) is not recognised
/// and the holder is never named on that evidence. False only once every descriptor of the
/// process was looked at; None, which says nothing either way, when they were not: the
/// directory cannot be read (another user's process: EACCES), the process is not visible (no
/// directory: it has exited, or /proc is mounted hidepid=invisible and hides another user's
/// live one the same way), or the walk stopped at `examined_max` descriptors (the holder's
/// may be among those left) or on an error.
fn has_open(proc_root: &Path, pid: u32, own_path: &Path, examined_max: usize) -> Option<bool> {
    let mut entries = std::fs::read_dir(proc_root.join(pid.to_string()).join("fd")).ok()?;
    for entry in entries.by_ref().take(examined_max) {
        // A listing that failed part way did not show them all.
        let entry = entry.ok()?;
        // A link that cannot be read is a descriptor closed since the listing: not this one.
        if std::fs::read_link(entry.path()).is_ok_and(|target| target == own_path) {
            return Some(true);
        }
    }
    match entries.next() {
        None => Some(false),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_replaced_between_lock_and_open_is_refused() {
        // Goal: the software controller opens an emu: file by its path after the lock was taken
        // on it; a rename and copy over the path in between (`mv p.img moved.img; cp -p
        // moved.img p.img`) had it serve the new, unlocked file while the lock (and the mode
        // narrowing) stayed on the old one, so a second tuttid could lock and serve the file
        // too. The opened file is compared with the locked one and refused, naming the path;
        // a file left in place passes, and so do uring: files compared the same way.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("p.img");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let spec = DeviceSpec::parse(&format!("emu:{}", path.display()), &crate::DeviceKind::ALL).unwrap();
        let emu = crate::open::EmuOptions::default();
        let locks = DeviceLocks::acquire(std::slice::from_ref(&spec), directory.path(), false).unwrap();
        let opened = crate::open_in_one_space(std::slice::from_ref(&spec), &emu).unwrap();
        assert!(opened[0].backing_file().is_some());
        locks.check_opened(&spec, opened[0].backing_file()).expect("the file locked is the file opened");
        drop(opened);
        let moved = directory.path().join("moved.img");
        std::fs::rename(&path, &moved).unwrap();
        std::fs::copy(&moved, &path).unwrap();
        let opened = crate::open_in_one_space(std::slice::from_ref(&spec), &emu).unwrap();
        let error = locks.check_opened(&spec, opened[0].backing_file()).unwrap_err();
        assert!(matches!(&error, DeviceError::ReplacedWhileOpening { path: named, .. } if *named == path), "{error:?}");
        let text = error.to_string();
        assert!(text.contains(&path.display().to_string()) && text.contains("replaced while it was being opened"), "{text}");
        // uring: (tutti-bench opens it itself): the same comparison, on what it opened.
        drop(opened);
        let kernel = DeviceSpec::parse(&format!("uring:{}", path.display()), &crate::DeviceKind::ALL).unwrap();
        let kernel_locks = DeviceLocks::acquire(std::slice::from_ref(&kernel), directory.path(), false).unwrap();
        let id = |path: &Path| std::fs::metadata(path).map(|metadata| (metadata.dev(), metadata.ino())).ok();
        kernel_locks.check_opened(&kernel, id(&path)).expect("the same file");
        assert!(matches!(kernel_locks.check_opened(&kernel, id(&moved)), Err(DeviceError::ReplacedWhileOpening { .. })));
        // Nothing opened by path: nothing to compare.
        locks.check_opened(&spec, None).unwrap();
        // Several sets: the file one of them locked passes.
        check_opened_in(&[&DeviceLocks::default(), &kernel_locks], &kernel, id(&path)).expect("locked by the second set");
    }

    #[test]
    fn a_file_that_appeared_after_the_locks_were_taken_is_refused() {
        // Goal: a file missing when the locks were taken is skipped (nothing to lock), and the
        // controller then opened one that appeared at its path meanwhile, unlocked: tuttid
        // without --format, or tutti pool inspect/check, served it, and a second tuttid could
        // lock and serve it too. A path no held lock covers is refused as the replaced one is.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("late.img");
        let spec = DeviceSpec::parse(&format!("emu:{}", path.display()), &crate::DeviceKind::ALL).unwrap();
        let locks = DeviceLocks::acquire(std::slice::from_ref(&spec), directory.path(), false).unwrap();
        assert_eq!(locks.paths().count(), 0, "a missing file is not locked");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let opened = crate::open_in_one_space(std::slice::from_ref(&spec), &crate::open::EmuOptions::default()).unwrap();
        let error = locks.check_opened(&spec, opened[0].backing_file()).unwrap_err();
        assert!(matches!(&error, DeviceError::ReplacedWhileOpening { path: named, .. } if *named == path), "{error:?}");
        assert!(matches!(check_opened_in(&[], &spec, opened[0].backing_file()), Err(DeviceError::ReplacedWhileOpening { .. })));
    }

    #[test]
    fn proc_locks_lines_are_parsed_and_waiters_skipped() {
        let text = "1: POSIX  ADVISORY  WRITE 10 fd:01:99 0 EOF\n2: -> FLOCK  ADVISORY  WRITE 11 fd:01:42 0 EOF\n\
                    3: FLOCK  ADVISORY  WRITE 12 fd:01:42 0 EOF\ngarbage\n4: FLOCK ADVISORY WRITE x 00:zz:1 0 EOF\n";
        use FlockHolder::{Confirmed, NoPid, Recorded, Unconfirmed};
        let nobody = |_: u32| Some(false);
        let only = |holder: u32| move |pid: u32| Some(pid == holder);
        assert_eq!(find_flock_holder(text, 0xfd, 1, 42, &only(12)), Some(Confirmed(12)));
        // The exact device: the pid listed, said to be only what was recorded unless it has the
        // file open, and unconfirmed when that cannot be told.
        assert_eq!(find_flock_holder(text, 0xfd, 1, 42, &nobody), Some(Recorded(12)));
        assert_eq!(find_flock_holder(text, 0xfd, 1, 42, &|_| None), Some(Unconfirmed(12)));
        assert_eq!(find_flock_holder(text, 0xfd, 1, 99, &nobody), None, "a POSIX lock is not ours");
        // Another device number, a lock on the inode: that one only if it has the file open
        // (stacked filesystems); otherwise it is any process's lock on another file.
        assert_eq!(find_flock_holder(text, 0xfd, 2, 42, &nobody), None);
        assert_eq!(find_flock_holder(text, 0xfd, 2, 42, &|_| None), None);
        assert_eq!(find_flock_holder(text, 0xfd, 2, 42, &only(12)), Some(Confirmed(12)));
        // Two candidates on other devices: the one that has the file open.
        let two = "1: FLOCK  ADVISORY  WRITE 12 fd:01:42 0 EOF\n2: FLOCK  ADVISORY  WRITE 13 fd:03:42 0 EOF\n";
        assert_eq!(find_flock_holder(two, 0xfd, 2, 42, &nobody), None);
        assert_eq!(find_flock_holder(two, 0xfd, 2, 42, &only(13)), Some(Confirmed(13)));
        assert_eq!(find_flock_holder(two, 0xfd, 3, 42, &only(13)), Some(Confirmed(13)));
        // Pid 0 (outside this PID namespace, or exited): no pid, and never a candidate.
        let hidden = "1: FLOCK  ADVISORY  WRITE 0 fd:01:42 0 EOF\n";
        assert_eq!(find_flock_holder(hidden, 0xfd, 1, 42, &|_| Some(true)), Some(NoPid));
        assert_eq!(find_flock_holder(hidden, 0xfd, 2, 42, &|_| Some(true)), None);
    }

    /// A lock file `directory/pool.img`, opened, and a fake proc root whose `locks` lists one
    /// FLOCK on the file's inode under another device, held by pid 4242 with `cmdline` and no
    /// descriptors yet: (the file, the proc root, the process's directory).
    fn lock_listed_on_another_device(directory: &Path, cmdline: &[u8]) -> (File, PathBuf, PathBuf) {
        lock_listed(directory, cmdline, 1, 4242)
    }

    /// [`lock_listed_on_another_device`] with the line's device number `major_offset` away from
    /// the file's (0: the file's own device) and its pid `pid` (whose directory is made anyway).
    fn lock_listed(directory: &Path, cmdline: &[u8], major_offset: u64, pid: u32) -> (File, PathBuf, PathBuf) {
        let image = directory.join("pool.img");
        std::fs::write(&image, [0u8; 4096]).unwrap();
        let file = File::open(&image).unwrap();
        let metadata = file.metadata().unwrap();
        let (major, minor) = split_device(metadata.dev());
        let proc_root = directory.join("proc");
        let process = proc_root.join(pid.to_string());
        std::fs::create_dir_all(process.join("fd")).unwrap();
        std::fs::write(process.join("cmdline"), cmdline).unwrap();
        let line = format!("1: FLOCK  ADVISORY  WRITE {pid} {:02x}:{:02x}:{} 0 EOF\n", major + major_offset, minor, metadata.ino());
        std::fs::write(proc_root.join("locks"), line).unwrap();
        (file, proc_root, process)
    }

    #[test]
    fn a_lock_on_another_device_names_its_holder_only_if_it_has_the_file_open() {
        // Goal: a /proc/locks line with the lock file's inode number but another device is no
        // evidence (inode numbers repeat across filesystems): with no descriptor of the file in
        // PID/fd the holder is "not found" (it used to be that pid, an unrelated process); with
        // one (a stacked filesystem listing the lock under another device) it is named.
        let directory = tempfile::tempdir().unwrap();
        let (file, proc_root, process) = lock_listed_on_another_device(directory.path(), b"unrelated\0--flag\0");
        let holder = holder_of(&file, &proc_root);
        assert!(holder.contains("not found"), "{holder}");
        std::os::unix::fs::symlink(own_descriptor_path(&file).unwrap(), process.join("fd").join("3")).unwrap();
        assert_eq!(holder_of(&file, &proc_root), "pid 4242 (unrelated --flag)");
    }

    #[test]
    fn a_lock_listed_with_pid_0_names_no_pid() {
        // Goal: /proc/locks shows pid 0 for a lock whose taker is outside the reader's PID
        // namespace or has exited (its descriptor inherited by another process): the refusal
        // said "held by pid 0", a pid that names nothing (the kernel's idle task at most). It
        // says the holder is another process whose pid /proc/locks does not give.
        let directory = tempfile::tempdir().unwrap();
        let (file, proc_root, _) = lock_listed(directory.path(), b"swapper\0", 0, 0);
        let holder = holder_of(&file, &proc_root);
        assert!(!holder.contains("pid 0") && !holder.contains("swapper"), "{holder}");
        assert!(holder.contains("another process") && holder.contains("gives no pid"), "{holder}");
    }

    #[test]
    fn a_lock_on_the_exact_device_names_its_pid_as_the_holder_only_if_it_has_the_file_open() {
        // Goal: /proc/locks gives the pid that took the lock; a descriptor inherited by a child
        // that outlived it keeps the lock, and the pid may since name another process: an
        // exact-device line was believed as it stood, naming that process and its command line.
        // It is named as the holder once it has the file open (PID/fd, as for a line on another
        // device); otherwise the pid is said to be the one recorded when the lock was taken,
        // with no command line (it would be another program's).
        let directory = tempfile::tempdir().unwrap();
        let (file, proc_root, process) = lock_listed(directory.path(), b"reused\0", 0, 4242);
        let holder = holder_of(&file, &proc_root);
        assert!(!holder.contains("reused"), "an unconfirmed pid's command line was given: {holder}");
        assert!(holder.contains("pid 4242") && holder.contains("when it took the lock"), "{holder}");
        assert!(holder.contains("no longer has it open"), "{holder}");
        std::os::unix::fs::symlink(own_descriptor_path(&file).unwrap(), process.join("fd").join("3")).unwrap();
        assert_eq!(holder_of(&file, &proc_root), "pid 4242 (reused)");
    }

    #[test]
    fn a_listed_pid_not_visible_in_proc_is_unconfirmed_not_said_to_have_let_go() {
        // Goal: a live process /proc does not show (mounted hidepid=invisible: another user's)
        // has no PID directory, as one that has exited: has_open took that as "does not have
        // the file open", and the refusal said falsely that the pid listed no longer has it
        // open. Nothing was seen either way: the pid is named as unconfirmed.
        let directory = tempfile::tempdir().unwrap();
        let (file, proc_root, process) = lock_listed(directory.path(), b"hidden\0", 0, 4242);
        std::fs::remove_dir_all(&process).unwrap();
        let holder = holder_of(&file, &proc_root);
        assert!(!holder.contains("no longer has it open"), "a process not seen was said to have let go: {holder}");
        assert!(holder.contains("pid 4242") && holder.contains("could not be seen"), "{holder}");
    }

    #[test]
    fn a_walk_stopped_at_its_bound_does_not_say_the_file_is_not_open() {
        // Goal: has_open looks at a bounded number of descriptors (FDS_EXAMINED_MAX); a walk
        // that stopped there with descriptors left answered "not open" (the refusal: the pid
        // "no longer has it open"), though the file may be among those not looked at. It
        // answers "cannot tell" then; "not open" only once every descriptor was looked at.
        let directory = tempfile::tempdir().unwrap();
        let (file, proc_root, process) = lock_listed(directory.path(), b"many\0", 0, 4242);
        let own_path = own_descriptor_path(&file).unwrap();
        for fd in 0..3 {
            std::os::unix::fs::symlink(directory.path().join(format!("other{fd}")), process.join("fd").join(fd.to_string())).unwrap();
        }
        assert_eq!(has_open(&proc_root, 4242, &own_path, 2), None, "stopped with one descriptor left");
        assert_eq!(has_open(&proc_root, 4242, &own_path, 3), Some(false), "all three looked at");
        assert_eq!(has_open(&proc_root, 4242, &own_path, 4), Some(false));
        std::os::unix::fs::symlink(&own_path, process.join("fd").join("3")).unwrap();
        assert_eq!(has_open(&proc_root, 4242, &own_path, 4), Some(true));
        assert_ne!(has_open(&proc_root, 4242, &own_path, 2), Some(false), "the file may be among those not looked at");
    }

    #[test]
    fn a_holders_command_line_comes_out_with_its_control_characters_escaped() {
        // Goal: the holder's /proc/PID/cmdline is another process's text, put into
        // DeviceInUse and so into tuttid's log and the tools' one-line errors: a terminal escape
        // in it (ESC [2K erases the line a reader sees) or a newline (a forged log line) came
        // out raw. Control characters are escaped as tutti-cli's `printable` escapes them;
        // the argument separators still read as spaces and the rest is kept.
        let directory = tempfile::tempdir().unwrap();
        let (file, proc_root, process) = lock_listed_on_another_device(directory.path(), b"evil\x1b[2K\0--x\nfake line\x7f \xc3\xa9\0");
        std::os::unix::fs::symlink(own_descriptor_path(&file).unwrap(), process.join("fd").join("3")).unwrap();
        let holder = holder_of(&file, &proc_root);
        assert_eq!(holder, "pid 4242 (evil\\u{1b}[2K --x\\nfake line\\u{7f} \u{e9})");
        assert!(!holder.chars().any(char::is_control), "{holder:?}");
    }

    #[test]
    fn a_holder_is_confirmed_by_the_path_its_descriptor_names_never_by_following_it() {
        // Goal: confirming a candidate holder must not stat through its /proc/PID/fd links: a
        // descriptor of a file on a hung NFS or FUSE mount would block that stat without end,
        // inside tuttid's open_pool with its SIGINT and SIGTERM blocked. The link's text (the
        // kernel's path of the open file) is compared with the lock file's own: a descriptor
        // naming the file through a hard link (same device and inode, another path) is no
        // confirmation, which only following the link could give; one naming its path is.
        let directory = tempfile::tempdir().unwrap();
        let (file, proc_root, process) = lock_listed_on_another_device(directory.path(), b"holder\0");
        let other_name = directory.path().join("other-name.img");
        std::fs::hard_link(directory.path().join("pool.img"), &other_name).unwrap();
        std::os::unix::fs::symlink(&other_name, process.join("fd").join("3")).unwrap();
        let holder = holder_of(&file, &proc_root);
        assert!(holder.contains("not found"), "the link was followed to the file: {holder}");
        // What the kernel shows for a descriptor of the file: its path, as a holder's link has it.
        let own_path = own_descriptor_path(&file).expect("this process's descriptor names its file");
        std::os::unix::fs::symlink(own_path, process.join("fd").join("4")).unwrap();
        assert_eq!(holder_of(&file, &proc_root), "pid 4242 (holder)");
    }

    #[test]
    fn a_socket_is_refused_naming_what_it_is() {
        // Goal: `emu:SOCKET` is refused as a socket (NotAFileOrDevice), not as an I/O error:
        // open(2) fails on a socket (ENXIO) before any fstat could tell what it is, so the path
        // itself is examined (stat, no open) when the open fails.
        let directory = tempfile::tempdir().unwrap();
        let socket = directory.path().join("pool.img");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        for create_files in [false, true] {
            let error = DeviceLocks::acquire(&[DeviceSpec::EmuFile(socket.clone())], directory.path(), create_files).unwrap_err();
            assert!(matches!(error, DeviceError::NotAFileOrDevice { .. }), "{error}");
            assert!(error.to_string().contains(&format!("{} is a socket", socket.display())), "{error}");
        }
    }

    #[test]
    fn a_second_lock_is_refused_naming_this_process() {
        // Goal: two lockers of one file (separate open file descriptions, as two daemons would
        // have): the second gets DeviceInUse with our pid, found through /proc/locks.
        let directory = tempfile::tempdir().unwrap();
        let image = directory.path().join("pool.img");
        std::fs::write(&image, [0u8; 4096]).unwrap();
        let spec = DeviceSpec::EmuFile(image.clone());
        let first = DeviceLocks::acquire(std::slice::from_ref(&spec), directory.path(), false).unwrap();
        assert_eq!(first.paths().count(), 1);
        let error = DeviceLocks::acquire(std::slice::from_ref(&spec), directory.path(), false).unwrap_err().to_string();
        let pid = std::process::id();
        // The holder must be named when /proc/locks lists this very lock: a FLOCK WRITE line
        // with our pid on the file's own device and inode. /proc/locks can leave it out (a lock
        // whose owner is not visible in the reading pid namespace is skipped) or list it under
        // another device (stacked filesystems); then the message may only say it could not be
        // found, and the parsing is covered by the synthetic lines above. A line that merely
        // ends in the same inode number is no evidence: inode numbers repeat across filesystems.
        let listed_exactly = lists_flock_exactly(&image, pid);
        if listed_exactly {
            assert!(error.contains(&format!("held by pid {pid} (")), "{error}");
        } else {
            assert!(error.contains("held by"), "{error}");
            eprintln!("note: /proc/locks does not list this test's lock on its own device; naming the holder is not checked here");
        }
        drop(first);
        DeviceLocks::acquire(&[spec], directory.path(), false).expect("free again once the holder let go");
    }

    #[test]
    fn a_uring_path_takes_the_lock_an_emu_path_of_the_same_file_takes() {
        // Goal: tutti-bench's `uring:FILE` and tuttid's `emu:FILE` exclude each other, in both
        // orders: one lock, on the file itself.
        let directory = tempfile::tempdir().unwrap();
        let image = directory.path().join("pool.img");
        std::fs::write(&image, [0u8; 4096]).unwrap();
        let emu = DeviceSpec::EmuFile(image.clone());
        let uring = DeviceSpec::Uring(image.clone());
        for (first, second) in [(&emu, &uring), (&uring, &emu)] {
            let held = DeviceLocks::acquire(std::slice::from_ref(first), directory.path(), false).unwrap();
            assert_eq!(held.paths().collect::<Vec<_>>(), [image.as_path()]);
            let error = DeviceLocks::acquire(std::slice::from_ref(second), directory.path(), false).unwrap_err();
            assert!(matches!(&error, DeviceError::DeviceInUse { spec, .. } if *spec == second.to_string()), "{error}");
        }
        // A missing uring: file is left for the opening to report, as an emu: one is.
        let missing = DeviceSpec::Uring(directory.path().join("missing.img"));
        assert_eq!(DeviceLocks::acquire(&[missing], directory.path(), false).unwrap().paths().count(), 0);
    }

    #[test]
    fn one_device_named_twice_is_refused_as_such_not_as_in_use() {
        // Goal: a file and a hard link to it, or one PCI function spelled twice, used to be
        // refused as held by another process (this one: the second flock is on an open file
        // description of its own); they are refused as one device named twice, naming both,
        // and nothing is left locked.
        let directory = tempfile::tempdir().unwrap();
        let image = directory.path().join("pool.img");
        std::fs::write(&image, [0u8; 4096]).unwrap();
        std::fs::hard_link(&image, directory.path().join("link.img")).unwrap();
        let files = [DeviceSpec::EmuFile(image.clone()), DeviceSpec::EmuFile(directory.path().join("link.img"))];
        let error = DeviceLocks::acquire(&files, directory.path(), false).unwrap_err();
        assert!(matches!(error, DeviceError::DuplicateFile { .. }), "{error}");
        let function = |text| DeviceSpec::parse(text, &crate::DeviceKind::ALL).unwrap();
        let functions = [function("vfio:0000:00:04.0"), function("vfio:0000:00:04.0")];
        let error = DeviceLocks::acquire(&functions, &directory.path().join("run"), false).unwrap_err();
        assert!(matches!(error, DeviceError::DuplicateFunction { .. }), "{error}");
        assert!(error.to_string().starts_with("vfio:0000:00:04.0 and vfio:0000:00:04.0 name the same PCI function"), "{error}");
        DeviceLocks::acquire(&files[..1], directory.path(), false).expect("nothing was left locked");
    }

    /// Runs `call` on a thread of its own and gives its answer, or `None` if it has none within
    /// a second (then `release` is run so the thread can end): a test of something that used to
    /// wait without end fails instead of hanging.
    fn within_a_second<T: Send + 'static>(call: impl FnOnce() -> T + Send + 'static, release: impl FnOnce()) -> Option<T> {
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = sender.send(call());
        });
        let answer = receiver.recv_timeout(std::time::Duration::from_secs(1)).ok();
        if answer.is_none() {
            release();
        }
        answer
    }

    #[test]
    fn a_fifo_is_refused_at_once_naming_what_it_is() {
        // Goal: `emu:FIFO` used to wait in open(2) for a writer, for good (tuttid hung with its
        // signals blocked); locking it, and reading what it holds, refuse it at once, naming the
        // path and what it is.
        let directory = tempfile::tempdir().unwrap();
        let fifo = directory.path().join("pool.img");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR).unwrap();
        let spec = DeviceSpec::EmuFile(fifo.clone());
        // A writer that opens the FIFO lets a reader stuck in open(2) go on.
        let release = || drop(OpenOptions::new().write(true).custom_flags(nix::libc::O_NONBLOCK).open(&fifo));
        for create_files in [false, true] {
            let (specs, lock_dir) = ([spec.clone()], directory.path().to_path_buf());
            let answer = within_a_second(move || DeviceLocks::acquire(&specs, &lock_dir, create_files).map(|_| ()), release);
            let error = answer.expect("locking a FIFO is still waiting after 1 s").unwrap_err();
            assert!(matches!(error, DeviceError::NotAFileOrDevice { .. }), "{error}");
            assert!(error.to_string().contains(&format!("{} is a FIFO (named pipe)", fifo.display())), "{error}");
        }
        let specs = [spec.clone()];
        let answer = within_a_second(move || crate::refuse_foreign_contents(&specs, &crate::BlockDeviceClaims::default()), release);
        let error = answer.expect("reading a FIFO's contents is still waiting after 1 s").unwrap_err();
        assert!(matches!(error, DeviceError::NotAFileOrDevice { .. }), "{error}");
    }

    #[test]
    fn vfio_devices_lock_a_file_in_the_lock_directory_and_memory_devices_none() {
        let directory = tempfile::tempdir().unwrap();
        let lock_dir = directory.path().join("run");
        let specs = [DeviceSpec::parse("vfio:0000:00:04.0", &crate::DeviceKind::ALL).unwrap(), DeviceSpec::EmuMemory(1 << 20)];
        let locks = DeviceLocks::acquire(&specs, &lock_dir, false).unwrap();
        let paths: Vec<_> = locks.paths().collect();
        assert_eq!(paths, [lock_dir.join("vfio-0000:00:04.0.lock").as_path()]);
        let error = DeviceLocks::acquire(&specs[..1], &lock_dir, false).unwrap_err();
        assert!(matches!(error, DeviceError::DeviceInUse { .. }), "{error}");
    }

    #[test]
    fn the_lock_directory_and_vfio_lock_files_are_their_owners_only() {
        // Goal: flock needs only an open descriptor, so a lock file anyone can open (0644) let
        // any local user hold a vfio: SSD's lock and keep tuttid from it; the lock directory
        // (0755) let anyone look. Under the usual umask 022 the directory is made 0700 and the
        // lock file 0600, and a lock file left readable by others (an older build's) is made
        // 0600 when taken.
        let directory = tempfile::tempdir().unwrap();
        let lock_dir = directory.path().join("run").join("tutti");
        let specs = [DeviceSpec::parse("vfio:0000:00:04.0", &crate::DeviceKind::ALL).unwrap()];
        // Whatever the umask (not changed here: tests run in parallel threads of one process).
        drop(DeviceLocks::acquire(&specs, &lock_dir, false).unwrap());
        let mode = |path: &Path| std::fs::metadata(path).unwrap().mode() & 0o777;
        assert_eq!(mode(&lock_dir), 0o700);
        let lock_file = lock_dir.join("vfio-0000:00:04.0.lock");
        assert_eq!(mode(&lock_file), 0o600);
        std::fs::set_permissions(&lock_file, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        drop(DeviceLocks::acquire(&specs, &lock_dir, false).unwrap());
        assert_eq!(mode(&lock_file), 0o600);
    }

    #[test]
    fn a_pool_file_created_to_lock_it_is_readable_by_its_owner_only() {
        // Goal: a missing emu: file that acquire creates (tuttid --format, `tutti pool format`)
        // is mode 0600 under the usual umask 022, not 0644: it will hold every cached KV block,
        // and tuttid's trust boundary is its 0600 socket and the peer uid check, which a
        // world-readable pool file would step around.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("pool.img");
        // Whatever the umask (not changed here: tests run in parallel threads of one process).
        drop(DeviceLocks::acquire(&[DeviceSpec::EmuFile(path.clone())], &directory.path().join("locks"), true).unwrap());
        let mode = std::fs::metadata(&path).unwrap().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "created with mode {mode:o}");
    }

    #[test]
    fn a_failed_or_ignored_narrowing_is_decided_by_what_chmod_and_fstat_said() {
        // Goal: a failing fchmod made every such file a refusal with one piece of advice. On a
        // read-only mount (EROFS) nobody can write the file: its mode is kept and the lock
        // taken (a later read-write open fails as it did). EPERM (a filesystem refusing chmod)
        // is still refused, naming the errno and what causes it. A chmod that
        // succeeded but changed nothing (vfat, CIFS noperm, FUSE) is told as such, not as 0600.
        let path = Path::new("/pool.img");
        let errno = |errno: Errno| Err(std::io::Error::from_raw_os_error(errno as i32));
        assert_eq!(narrowing_outcome(path, 0o644, 0o600, errno(Errno::EROFS), None).unwrap(), Narrowing::ReadOnly);
        let error = narrowing_outcome(path, 0o644, 0o600, errno(Errno::EPERM), None).unwrap_err();
        let text = error.to_string();
        assert!(matches!(&error, DeviceError::Io { source, .. } if crate::is_unusable_errno(source)), "{error:?}");
        assert!(text.contains("EPERM") && text.contains("chmod go-rwx /pool.img") && !text.contains("immutable"), "{text}");
        let error = narrowing_outcome(path, 0o644, 0o600, errno(Errno::EIO), None).unwrap_err();
        assert!(!error.to_string().contains("chattr"), "{error}");
        assert_eq!(narrowing_outcome(path, 0o644, 0o600, Ok(()), Some(0o600)).unwrap(), Narrowing::Done);
        assert_eq!(narrowing_outcome(path, 0o644, 0o600, Ok(()), Some(0o755)).unwrap(), Narrowing::Ignored { now: 0o755 });

        // What each is told: a narrowing does not reach descriptors already open.
        let locks = |narrowing: Narrowing| DeviceLocks { narrowed: vec![(path.to_path_buf(), 0o644, narrowing)], ..Default::default() };
        let note = |narrowing: Narrowing| note(path, 0o644, narrowing);
        assert_eq!(locks(Narrowing::Done).narrowed().collect::<Vec<_>>(), [(path, 0o644)]);
        let text = note(Narrowing::Done);
        assert!(text.contains("was mode 0644") && text.contains("it is now 0600") && text.contains("already had it open"), "{text}");
        assert_eq!(locks(Narrowing::Ignored { now: 0o755 }).narrowed().count(), 0);
        let text = note(Narrowing::Ignored { now: 0o755 });
        assert!(text.contains("could not be narrowed") && text.contains("ignores") && !text.contains("it is now 0600"), "{text}");
        let text = note(Narrowing::ReadOnly);
        assert!(text.contains("read-only filesystem") && !text.contains("it is now"), "{text}");
    }

    #[test]
    fn a_refused_acquire_leaves_every_pool_files_mode_as_it_was() {
        // Goal: a pool file was narrowed as soon as it was opened, before its flock: when that
        // lock, or a later spec's, was refused, the DeviceLocks (and the list of what it
        // narrowed) was dropped with nobody told, yet the file's mode had changed. Narrowing
        // waits until every lock is held: a refusal leaves every file as it was.
        let directory = tempfile::tempdir().unwrap();
        let mode = |path: &Path| std::fs::metadata(path).unwrap().mode() & 0o7777;
        let [first, held] = ["a.img", "b.img"].map(|name| {
            let path = directory.path().join(name);
            std::fs::write(&path, [0u8; 4096]).unwrap();
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
            path
        });
        let lock_dir = directory.path().join("locks");
        let holder = DeviceLocks::acquire_leaving_modes(&[DeviceSpec::EmuFile(held.clone())], &lock_dir, false).unwrap();
        let specs = [DeviceSpec::EmuFile(first.clone()), DeviceSpec::EmuFile(held.clone())];
        let error = DeviceLocks::acquire(&specs, &lock_dir, false).unwrap_err();
        assert!(matches!(error, DeviceError::DeviceInUse { .. }), "{error}");
        assert_eq!(mode(&first), 0o644, "the first file was narrowed though the acquire was refused");
        assert_eq!(mode(&held), 0o644, "the held file was narrowed though its lock was refused");
        drop(holder);
        let mut locks = DeviceLocks::acquire(&specs, &lock_dir, false).unwrap();
        assert_eq!((mode(&first), mode(&held)), (0o644, 0o644), "acquire changed a mode");
        assert_eq!(locks.narrow_pool_files(&[]).unwrap().len(), 2);
        assert_eq!((mode(&first), mode(&held)), (0o600, 0o600));
        assert_eq!(locks.narrowed().count(), 2);
    }

    #[test]
    fn a_narrowing_that_fails_part_way_puts_every_mode_back_or_names_the_file_it_could_not() {
        // Goal: narrow_pool_files restored only the files narrowed before the one that failed:
        // where fchmod succeeded but the fstat after it failed, that file stayed 0600 with
        // nobody told; and a restore that failed was dropped in silence. Now every file whose
        // fchmod succeeded gets its mode back, and one that could not is named in the error.
        let directory = tempfile::tempdir().unwrap();
        let mode = |path: &Path| std::fs::metadata(path).unwrap().mode() & 0o7777;
        let paths = ["a.img", "b.img"].map(|name| directory.path().join(name));
        let specs = paths.clone().map(DeviceSpec::EmuFile);
        let lock_dir = directory.path().join("locks");
        let chmod = |file: &File, mode: u32| file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode));
        let real_mode = |file: &File| file.metadata().map(|metadata| (metadata.uid(), metadata.gid(), metadata.mode() & 0o7777));
        let fresh = || {
            for path in &paths {
                std::fs::write(path, [0u8; 4096]).unwrap();
                std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
            }
            DeviceLocks::acquire(&specs, &lock_dir, false).unwrap()
        };
        // fstat fails on the second file, after its fchmod succeeded (each file's mode is read
        // before and after its fchmod: the fourth read): both put back.
        let mut locks = fresh();
        let calls = std::cell::Cell::new(0);
        let failing_second = |file: &File| {
            calls.set(calls.get() + 1);
            if calls.get() == 4 {
                return Err(std::io::Error::from_raw_os_error(nix::libc::EIO));
            }
            real_mode(file)
        };
        let error = locks.narrow_with(&[], &chmod, &failing_second).unwrap_err();
        assert!(error.to_string().contains("after narrowing its mode"), "{error}");
        assert_eq!((mode(&paths[0]), mode(&paths[1])), (0o644, 0o644), "a file was left narrowed: {error}");
        assert_eq!(locks.narrowed().count(), 0);
        drop(locks);
        // The second fchmod fails (EPERM) and putting the first back fails too: named.
        let mut locks = fresh();
        let chmods = std::cell::Cell::new(0);
        let failing = |file: &File, mode: u32| {
            chmods.set(chmods.get() + 1);
            match chmods.get() {
                1 => chmod(file, mode),
                _ => Err(std::io::Error::from_raw_os_error(nix::libc::EPERM)),
            }
        };
        let error = locks.narrow_with(&[], &failing, &real_mode).unwrap_err();
        let text = error.to_string();
        let first = paths[0].display().to_string();
        assert!(text.contains("EPERM") && text.contains(&format!("putting the mode of {first} back to 0644 failed")), "{text}");
        assert!(text.contains("it is left 0600"), "{text}");
        assert!(matches!(&error, DeviceError::Io { source, .. } if source.raw_os_error() == Some(nix::libc::EPERM)), "{error:?}");
    }

    #[test]
    fn a_narrowing_that_fails_after_a_format_says_the_pool_was_formatted() {
        // Goal: since narrowing waits for the format, an EPERM from it comes after the pool was
        // written, yet the error was the lock step's old refusal ("... making it 600 failed"),
        // which reads as if nothing had changed though what the device held is gone; and it
        // named an immutable file as a cause, which the read-write open refuses long before.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("pool.img");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        let specs = [DeviceSpec::EmuFile(path.clone())];
        let lock_dir = directory.path().join("locks");
        let refusing = |_: &File, _: u32| Err(std::io::Error::from_raw_os_error(nix::libc::EPERM));
        for formatted in [&specs[..], &[]] {
            let mut locks = DeviceLocks::acquire(&specs, &lock_dir, false).unwrap();
            let error = locks.narrow_pool_files_with(formatted, &refusing).unwrap_err();
            let text = error.to_string();
            assert!(matches!(&error, DeviceError::Io { source, .. } if crate::is_unusable_errno(source)), "{error:?}");
            assert!(text.contains("EPERM") && !text.contains("immutable") && text.contains("chmod"), "{text}");
            let told = text.starts_with(&format!("the pool was formatted on emu:{} and is kept", path.display()));
            assert_eq!(told, !formatted.is_empty(), "{text}");
        }
    }

    #[test]
    fn a_narrowing_decides_from_the_mode_the_file_has_then_not_the_one_it_had_when_locked() {
        // Goal: narrow_pool_files used the mode read when the file was locked, which is a whole
        // format or pool recovery earlier. Its owner's change meanwhile was overridden: a file
        // chmodded 640 (shared with a group on purpose) was put back to the 0644 of lock time
        // when a later file's fchmod failed, widening it; one narrowed to 600 was told as "was
        // mode 0644". Now each file's mode is read again on its locked descriptor.
        let directory = tempfile::tempdir().unwrap();
        let mode = |path: &Path| std::fs::metadata(path).unwrap().mode() & 0o7777;
        let set_mode = |path: &Path, mode: u32| std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
        let paths = ["a.img", "b.img"].map(|name| directory.path().join(name));
        let specs = paths.clone().map(DeviceSpec::EmuFile);
        let lock_dir = directory.path().join("locks");
        let chmod = |file: &File, mode: u32| file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode));
        let real_mode = |file: &File| file.metadata().map(|metadata| (metadata.uid(), metadata.gid(), metadata.mode() & 0o7777));
        let fresh = || {
            for path in &paths {
                std::fs::write(path, [0u8; 4096]).unwrap();
                set_mode(path, 0o644);
            }
            DeviceLocks::acquire(&specs, &lock_dir, false).unwrap()
        };
        // a.img made 640 by its owner meanwhile; b.img's fchmod fails: a.img gets 640 back.
        let mut locks = fresh();
        set_mode(&paths[0], 0o640);
        let chmods = std::cell::Cell::new(0);
        let second_fails = |file: &File, mode: u32| {
            chmods.set(chmods.get() + 1);
            match chmods.get() {
                2 => Err(std::io::Error::from_raw_os_error(nix::libc::EPERM)),
                _ => chmod(file, mode),
            }
        };
        locks.narrow_with(&[], &second_fails, &real_mode).unwrap_err();
        assert_eq!((mode(&paths[0]), mode(&paths[1])), (0o640, 0o644), "a mode its owner set was not put back");
        drop(locks);
        // a.img made 600 by its owner meanwhile: left alone, and only b.img is told.
        let mut locks = fresh();
        set_mode(&paths[0], 0o600);
        let notes = locks.narrow_with(&[], &chmod, &real_mode).unwrap();
        assert!(notes.len() == 1 && notes[0].contains(&*paths[1].to_string_lossy()), "{notes:?}");
        assert_eq!(locks.narrowed().collect::<Vec<_>>(), [(paths[1].as_path(), 0o644)]);
        drop(locks);
        // a.img made 755 meanwhile: narrowed to 700, told as the 0755 it was.
        let mut locks = fresh();
        set_mode(&paths[0], 0o755);
        let notes = locks.narrow_with(&[], &chmod, &real_mode).unwrap();
        assert_eq!((mode(&paths[0]), mode(&paths[1])), (0o700, 0o600));
        assert!(notes[0].contains("was mode 0755"), "{notes:?}");
    }

    #[test]
    fn a_pool_file_given_away_since_it_was_locked_that_others_can_open_is_refused_and_every_mode_put_back() {
        // Goal: a file chowned to another user while it was locked (root's doing during a
        // format) was left open to others with a warning and the command succeeded, though the
        // lock-time rule (pool_file_access) refuses another user's file that group or others can
        // open, so the next tuttid start refused it (exit 2). Now the narrowing applies that rule
        // again: refused (SharedLockFile, after a format saying the pool is kept), every mode
        // this call changed put back, and nothing told as narrowed.
        let directory = tempfile::tempdir().unwrap();
        let mode = |path: &Path| std::fs::metadata(path).unwrap().mode() & 0o7777;
        let paths = ["a.img", "b.img"].map(|name| directory.path().join(name));
        let specs = paths.clone().map(DeviceSpec::EmuFile);
        let lock_dir = directory.path().join("locks");
        let other = nix::unistd::geteuid().as_raw() + 1;
        // Either file given away: the other one narrowed first (then put back) or never reached.
        for given in [0, 1] {
            for formatted in [&specs[..], &[]] {
                for path in &paths {
                    std::fs::write(path, [0u8; 4096]).unwrap();
                    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
                }
                let mut locks = DeviceLocks::acquire(&specs, &lock_dir, false).unwrap();
                let given_away = std::fs::metadata(&paths[given]).unwrap().ino();
                let owner_and_mode = |file: &File| {
                    file.metadata().map(|metadata| {
                        let owner = if metadata.ino() == given_away { other } else { metadata.uid() };
                        (owner, metadata.gid(), metadata.mode() & 0o7777)
                    })
                };
                let chmodded = std::cell::RefCell::new(Vec::new());
                let chmod = |file: &File, mode: u32| {
                    chmodded.borrow_mut().push(file.metadata()?.ino());
                    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))
                };
                let error = locks.narrow_with(formatted, &chmod, &owner_and_mode).unwrap_err();
                let text = error.to_string();
                assert!(matches!(&error, DeviceError::SharedLockFile { path, .. } if *path == paths[given]), "{error:?}");
                assert!(text.contains(&format!("owned by uid {other}")), "{text}");
                let listed = format!("emu:{}, emu:{}", paths[0].display(), paths[1].display());
                let told = text.contains(&format!("the pool was formatted on {listed} and is kept"));
                assert_eq!(told, !formatted.is_empty(), "{text}");
                assert!(!chmodded.borrow().contains(&given_away), "the file given away was chmodded");
                assert_eq!((mode(&paths[0]), mode(&paths[1])), (0o644, 0o644), "a mode was left changed: {text}");
                assert_eq!(locks.narrowed().count(), 0);
            }
        }
    }

    #[test]
    fn a_pool_file_given_away_since_it_was_locked_that_only_its_owner_can_open_is_left_alone() {
        // Goal: the other side of the rule applied again: a file given to another user with
        // only execute bits for group and others (nobody else can open it: pool_file_access
        // keeps it) is neither chmodded (its mode is its owner's decision) nor refused nor told.
        let directory = tempfile::tempdir().unwrap();
        let mode = |path: &Path| std::fs::metadata(path).unwrap().mode() & 0o7777;
        let paths = ["a.img", "b.img"].map(|name| directory.path().join(name));
        for path in &paths {
            std::fs::write(path, [0u8; 4096]).unwrap();
            std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        }
        let specs = paths.clone().map(DeviceSpec::EmuFile);
        let mut locks = DeviceLocks::acquire(&specs, &directory.path().join("locks"), false).unwrap();
        std::fs::set_permissions(&paths[0], std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
        let given_away = std::fs::metadata(&paths[0]).unwrap().ino();
        let other = nix::unistd::geteuid().as_raw() + 1;
        let owner_and_mode = |file: &File| {
            file.metadata().map(|metadata| {
                let owner = if metadata.ino() == given_away { other } else { metadata.uid() };
                (owner, metadata.gid(), metadata.mode() & 0o7777)
            })
        };
        let chmodded = std::cell::RefCell::new(Vec::new());
        let chmod = |file: &File, mode: u32| {
            chmodded.borrow_mut().push(file.metadata()?.ino());
            file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))
        };
        let notes = locks.narrow_with(&[], &chmod, &owner_and_mode).unwrap();
        assert!(!chmodded.borrow().contains(&given_away), "the file given away was chmodded");
        assert_eq!((mode(&paths[0]), mode(&paths[1])), (0o711, 0o600));
        assert!(notes.len() == 1 && notes[0].contains(&*paths[1].to_string_lossy()), "{notes:?}");
        assert_eq!(locks.narrowed().collect::<Vec<_>>(), [(paths[1].as_path(), 0o644)]);
    }

    #[test]
    fn an_existing_pool_file_others_can_open_is_made_its_owners_only_or_refused() {
        // Goal: the mode a pool file is created with (0600) applied only to a file acquire
        // created; one that already existed kept its own, e.g. 0644 from `truncate -s 64G
        // pool.img` under umask 022: any local user could read every cached KV block, and open
        // it and hold its lock (flock works on a read-only descriptor), keeping tuttid and
        // `tutti pool` out as in use. Now a file of ours is narrowed to its owner's bits when
        // taken, with either open (read-only, or for writing when files may be created), and
        // the change is told to the caller (`narrowed`); one of another user's that others
        // can read or write is refused, its mode untouched.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("pool.img");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let mode = |path: &Path| std::fs::metadata(path).unwrap().mode() & 0o7777;
        let set_mode = |path: &Path, mode: u32| std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
        let specs = [DeviceSpec::EmuFile(path.clone())];
        let lock_dir = directory.path().join("locks");
        for create_files in [false, true] {
            set_mode(&path, 0o644);
            let mut locks = DeviceLocks::acquire(&specs, &lock_dir, create_files).unwrap();
            // Only recorded: the caller narrows once it knows the file is its pool.
            assert_eq!(mode(&path), 0o644, "create_files {create_files}: acquire changed the mode");
            assert_eq!(locks.open_to_others_notes().len(), 1);
            let notes = locks.narrow_pool_files(&[]).unwrap();
            assert_eq!(mode(&path), 0o600, "create_files {create_files}");
            assert!(notes.len() == 1 && notes[0].contains("was mode 0644"), "{notes:?}");
            assert_eq!(locks.narrowed().collect::<Vec<_>>(), [(path.as_path(), 0o644)]);
            assert!(locks.narrow_pool_files(&[]).unwrap().is_empty() && locks.open_to_others_notes().is_empty(), "narrowed twice");
            drop(locks);
            // Already the owner's only: nothing to tell.
            let mut locks = DeviceLocks::acquire(&specs, &lock_dir, create_files).unwrap();
            assert!(locks.narrow_pool_files(&[]).unwrap().is_empty());
            assert_eq!(locks.narrowed().count(), 0);
        }
        // A uring: path is the same file, taken the same way; a lock that leaves modes records
        // nothing.
        set_mode(&path, 0o660);
        let mut leaving = DeviceLocks::acquire_leaving_modes(&[DeviceSpec::Uring(path.clone())], &lock_dir, false).unwrap();
        assert!(leaving.narrow_pool_files(&[]).unwrap().is_empty());
        drop(leaving);
        assert_eq!(mode(&path), 0o660);
        DeviceLocks::acquire(&[DeviceSpec::Uring(path.clone())], &lock_dir, false).unwrap().narrow_pool_files(&[]).unwrap();
        assert_eq!(mode(&path), 0o600);
        // Another user's file: refused naming who else can open it, left as it is. Only root
        // can give a file away here; elsewhere the decision is pinned by the unit test below.
        if !nix::unistd::geteuid().is_root() {
            eprintln!("note: not root, so no file of another user's can be made; refusing one is not checked here");
            return;
        }
        let nobody = nix::unistd::Uid::from_raw(65534);
        nix::unistd::chown(&path, Some(nobody), None).unwrap();
        set_mode(&path, 0o644);
        for create_files in [false, true] {
            let error = DeviceLocks::acquire(&specs, &lock_dir, create_files).unwrap_err();
            assert!(matches!(error, DeviceError::SharedLockFile { .. }), "{error}");
            let text = error.to_string();
            assert!(text.contains("uid 65534") && text.contains("every user"), "{text}");
            assert_eq!(mode(&path), 0o644, "another user's file was chmodded");
        }
        // Readable by its owner alone: that user's file, used as it is.
        set_mode(&path, 0o600);
        let mut locks = DeviceLocks::acquire(&specs, &lock_dir, false).expect("another user's file only its owner can open");
        assert!(locks.open_to_others_notes().is_empty(), "recorded as open to others");
        assert!(locks.narrow_pool_files(&[]).unwrap().is_empty());
        assert_eq!(mode(&path), 0o600);
    }

    #[test]
    fn who_may_open_a_pool_file_decides_whether_it_is_kept_narrowed_or_refused() {
        // Goal: the rule apart from the files a test can make (another owner needs root): only
        // a regular file is touched (a block device's mode is the system's: udev, the disk
        // group), ours is narrowed to its owner's bits, another user's that its group or every
        // user can read or write is refused naming them, and one only its owner can open kept.
        let regular = true;
        assert_eq!(pool_file_access(regular, 1000, 100, 0o600, 1000), PoolFileAccess::Keep);
        assert_eq!(pool_file_access(regular, 1000, 100, 0o400, 1000), PoolFileAccess::Keep);
        assert_eq!(pool_file_access(regular, 1000, 100, 0o644, 1000), PoolFileAccess::Narrow(0o600));
        assert_eq!(pool_file_access(regular, 1000, 100, 0o4755, 1000), PoolFileAccess::Narrow(0o700));
        assert_eq!(pool_file_access(regular, 0, 0, 0o606, 0), PoolFileAccess::Narrow(0o600));
        assert_eq!(pool_file_access(!regular, 0, 6, 0o660, 0), PoolFileAccess::Keep, "a block device is left alone");
        assert_eq!(pool_file_access(regular, 1000, 100, 0o600, 0), PoolFileAccess::Keep, "another's, its owner's only");
        let refused = |mode: u32| match pool_file_access(regular, 1000, 100, mode, 0) {
            PoolFileAccess::Refuse(reason) => reason,
            other => panic!("mode {mode:o}: {other:?}"),
        };
        let reason = refused(0o640);
        assert!(reason.contains("uid 1000") && reason.contains("group gid 100 can read") && !reason.contains("every user"), "{reason}");
        let reason = refused(0o602);
        assert!(reason.contains("every user can write") && !reason.contains("group"), "{reason}");
        let reason = refused(0o664);
        assert!(reason.contains("group gid 100 can read and write") && reason.contains("every user can read"), "{reason}");
        // Execute bits alone open nothing.
        assert_eq!(pool_file_access(regular, 1000, 100, 0o711, 0), PoolFileAccess::Keep);
    }

    #[test]
    fn a_lock_file_that_is_a_link_or_not_ours_or_in_a_shared_directory_is_refused_untouched() {
        // Goal: a vfio: lock file planted as a symbolic link (to /etc/passwd, say) in a lock
        // directory others can write to used to be followed and its target chmod 0600 (as root:
        // any file). It is refused, the target's mode unchanged; so is a hard link, and a lock
        // directory others may write to.
        let directory = tempfile::tempdir().unwrap();
        let lock_dir = directory.path().join("run");
        std::fs::DirBuilder::new().mode(0o700).create(&lock_dir).unwrap();
        let target = directory.path().join("passwd");
        std::fs::write(&target, b"root:x:0:0").unwrap();
        std::fs::set_permissions(&target, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        let specs = [DeviceSpec::parse("vfio:0000:00:04.0", &crate::DeviceKind::ALL).unwrap()];
        let lock_file = lock_dir.join("vfio-0000:00:04.0.lock");
        let mode = |path: &Path| std::fs::metadata(path).unwrap().mode() & 0o777;
        std::os::unix::fs::symlink(&target, &lock_file).unwrap();
        let error = DeviceLocks::acquire(&specs, &lock_dir, false).unwrap_err();
        assert!(matches!(error, DeviceError::SharedLockFile { .. }), "a symbolic link was taken as the lock file: {error}");
        assert_eq!(mode(&target), 0o644, "the link's target was chmodded");
        std::fs::remove_file(&lock_file).unwrap();
        std::fs::hard_link(&target, &lock_file).unwrap();
        let error = DeviceLocks::acquire(&specs, &lock_dir, false).unwrap_err();
        assert!(matches!(error, DeviceError::SharedLockFile { .. }), "{error}");
        assert!(!error.to_string().contains("remove it"), "{error}");
        assert_eq!(mode(&target), 0o644, "the hard link's target was chmodded");
        std::fs::remove_file(&lock_file).unwrap();
        // A socket cannot be opened (ENXIO): refused naming what it is, as before the lock
        // files were opened relative to the directory's descriptor.
        let listener = std::os::unix::net::UnixListener::bind(&lock_file).unwrap();
        let error = DeviceLocks::acquire(&specs, &lock_dir, false).unwrap_err();
        assert!(matches!(error, DeviceError::NotAFileOrDevice { .. }), "{error}");
        drop(listener);
        std::fs::remove_file(&lock_file).unwrap();
        std::fs::set_permissions(&lock_dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        let error = DeviceLocks::acquire(&specs, &lock_dir, false).unwrap_err();
        assert!(matches!(error, DeviceError::SharedLockFile { .. }), "{error}");
        std::fs::set_permissions(&lock_dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        drop(DeviceLocks::acquire(&specs, &lock_dir, false).expect("a lock directory and file of our own"));
    }

    /// Whether `error` makes `tutti pool`, tutti-bench and tuttid exit 2 (unusable input): a
    /// refusal of what was given, or an I/O error whose errno says so.
    fn is_input(error: &DeviceError) -> bool {
        match error {
            DeviceError::SharedLockFile { .. } | DeviceError::NotAFileOrDevice { .. } => true,
            DeviceError::Io { source, .. } => crate::is_unusable_errno(source),
            error => error.is_unusable_input(),
        }
    }

    #[test]
    fn an_existing_lock_is_taken_where_its_file_is_there_and_nothing_is_made() {
        // Goal: `tutti bind`/`unbind` run as root take tuttid's lock on a function only where
        // its file is there, making neither the directory nor the file (they belong to the user
        // tuttid runs as); a link is not followed and a FIFO neither waited on nor locked; a
        // held one is in use, named as such.
        let address: nvme_driver::hw::vfio::PciAddress = "0000:00:04.0".parse().unwrap();
        let directory = tempfile::tempdir().unwrap();
        let lock_dir = directory.path().join("locks");
        assert!(DeviceLocks::acquire_existing(address, &lock_dir).unwrap().is_none());
        assert!(!lock_dir.exists(), "the directory was made");
        std::fs::create_dir(&lock_dir).unwrap();
        assert!(DeviceLocks::acquire_existing(address, &lock_dir).unwrap().is_none());
        assert_eq!(std::fs::read_dir(&lock_dir).unwrap().count(), 0, "a lock file was made");

        let path = lock_dir.join("vfio-0000:00:04.0.lock");
        let target = directory.path().join("elsewhere");
        std::fs::write(&target, b"").unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let error = DeviceLocks::acquire_existing(address, &lock_dir).unwrap_err();
        assert!(is_input(&error) && error.to_string().contains("symbolic link"), "a link is refused as input: {error}");
        std::fs::remove_file(&path).unwrap();

        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let error = within_a_second(move || DeviceLocks::acquire_existing(address, &lock_dir).map(|_| ()), || ())
            .expect("a FIFO made the lock wait")
            .unwrap_err();
        assert!(matches!(error, DeviceError::SharedLockFile { .. }), "{error}");
        assert!(error.to_string().contains("not a regular file") && !error.to_string().contains("pool"), "{error}");
        let lock_dir = directory.path().join("locks");
        std::fs::remove_file(&path).unwrap();
        let _socket = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let error = DeviceLocks::acquire_existing(address, &lock_dir).unwrap_err();
        assert!(is_input(&error) && error.to_string().contains("a socket"), "a socket is named as such: {error}");
        std::fs::remove_file(&path).unwrap();

        std::fs::write(&path, b"").unwrap();
        let held = DeviceLocks::acquire_existing(address, &lock_dir).unwrap().expect("the file is there");
        let error = DeviceLocks::acquire_existing(address, &lock_dir).unwrap_err();
        assert!(matches!(error, DeviceError::DeviceInUse { .. }), "{error}");
        drop(held);
        assert!(DeviceLocks::acquire_existing(address, &lock_dir).unwrap().is_some(), "let go on drop");
    }

    #[test]
    fn a_lock_directory_that_is_not_a_directory_is_unusable_input() {
        // Goal: a --lock-dir naming a regular file, a dangling symbolic link or a link to a file
        // failed in DirBuilder::create with EEXIST (a DeviceError::Io, an errno not among the
        // unusable ones), so tutti pool, tutti-bench and tuttid exited 1, a failure worth
        // retrying, for what was given. It is refused as not a directory; so is a dangling link
        // above it (mkdir: EEXIST too), while a regular file above it says ENOTDIR, input already.
        let directory = tempfile::tempdir().unwrap();
        let file = directory.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let dangling = directory.path().join("dangling");
        std::os::unix::fs::symlink(directory.path().join("missing"), &dangling).unwrap();
        let to_file = directory.path().join("to-file");
        std::os::unix::fs::symlink(&file, &to_file).unwrap();
        let specs = [DeviceSpec::parse("vfio:0000:00:04.0", &crate::DeviceKind::ALL).unwrap()];
        for lock_dir in [file.clone(), dangling.clone(), to_file.clone(), file.join("tutti"), dangling.join("tutti")] {
            let error = DeviceLocks::acquire(&specs, &lock_dir, false).unwrap_err();
            assert!(is_input(&error), "{}: {error:?}", lock_dir.display());
            assert!(error.to_string().to_lowercase().contains("not a directory"), "{}: {error}", lock_dir.display());
        }
        assert!(std::fs::symlink_metadata(directory.path().join("missing")).is_err(), "the dangling link's target was made");
    }

    #[test]
    fn a_lock_directory_of_ours_without_read_permission_is_used() {
        // Goal: the lock directory was opened for reading (O_RDONLY|O_DIRECTORY), which needs
        // read permission: a directory of our own with mode 0300 (search and write, which is
        // all openat needs) was refused with EACCES. It is opened O_PATH, which needs none.
        // As root the mode is not enforced, so this passes either way there; the flags are
        // pinned by the assertions on LockDir::FLAGS.
        assert!(LockDir::FLAGS.contains(nix::fcntl::OFlag::O_PATH));
        assert!(!LockDir::FLAGS.intersects(nix::fcntl::OFlag::O_RDWR | nix::fcntl::OFlag::O_WRONLY));
        let directory = tempfile::tempdir().unwrap();
        let lock_dir = directory.path().join("run");
        std::fs::DirBuilder::new().mode(0o300).create(&lock_dir).unwrap();
        let specs = [DeviceSpec::parse("vfio:0000:00:04.0", &crate::DeviceKind::ALL).unwrap()];
        drop(DeviceLocks::acquire(&specs, &lock_dir, false).expect("a 0300 lock directory of our own"));
        std::fs::set_permissions(&lock_dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    }

    #[test]
    fn a_lock_refused_for_a_read_only_descriptor_says_why() {
        // Goal: an existing emu:/uring: file is opened read-only to lock it; on NFS (flock
        // emulated with POSIX locks) an exclusive lock needs a descriptor open for writing, and
        // flock fails with EBADF, which said only "locking X: Bad file descriptor". The error
        // says the file is likely on such a filesystem. (flock's EBADF cannot be had on a local
        // filesystem, so the text is tested through the mapping of the errno.)
        let path = Path::new("/nfs/pool.img");
        let error = lock_failure(path, Errno::EBADF);
        let text = error.to_string();
        assert!(text.starts_with("locking /nfs/pool.img"), "{text}");
        assert!(text.contains("NFS") && text.contains("POSIX locks") && text.contains("opened for writing"), "{text}");
        assert!(matches!(&error, DeviceError::Io { source, .. } if source.raw_os_error() == Some(Errno::EBADF as i32)), "{error:?}");
        // Any other errno is told as it is.
        let text = lock_failure(path, Errno::ENOLCK).to_string();
        assert!(text.starts_with("locking /nfs/pool.img: ") && !text.contains("NFS"), "{text}");
    }

    #[test]
    fn a_lock_directory_that_is_a_symbolic_link_is_refused() {
        // Goal: the lock directory's owner and mode were read through a symbolic link, so a
        // link (planted by whoever can write where it lives) to a directory of ours passed; a
        // link is refused, while a parent directory that is a link is fine.
        let directory = tempfile::tempdir().unwrap();
        let real = directory.path().join("real");
        std::fs::DirBuilder::new().mode(0o700).create(&real).unwrap();
        let link = directory.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let specs = [DeviceSpec::parse("vfio:0000:00:04.0", &crate::DeviceKind::ALL).unwrap()];
        // A trailing slash (or "/.") makes lstat and open follow the link: it is refused too.
        let spellings = [link.clone(), PathBuf::from(format!("{}/", link.display())), link.join(".")];
        for lock_dir in &spellings {
            let error = DeviceLocks::acquire(&specs, lock_dir, false).unwrap_err();
            assert!(matches!(error, DeviceError::SharedLockFile { .. }), "{}: {error}", lock_dir.display());
            assert!(error.to_string().contains("symbolic link"), "{error}");
            assert!(!real.join("vfio-0000:00:04.0.lock").exists(), "a lock file was made through the link {}", lock_dir.display());
        }
        drop(DeviceLocks::acquire(&specs, &link.join("tutti"), false).expect("a parent that is a link is fine"));
    }
}
