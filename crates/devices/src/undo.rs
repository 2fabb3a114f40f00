//! Undoing what a refused format did to its `emu:` files. A format creates missing files and
//! grows small ones before the software controllers start; a refusal after that (status 2,
//! "nothing was changed") must leave no new file and no grown one behind. [`FileUndo`] creates
//! the missing files itself (`O_CREAT | O_EXCL`, so it knows which ones it made) and locks each
//! on the descriptor that created it at once (`flock`, the lock [`crate::DeviceLocks`] takes),
//! so no other tutti process can take a file it made; it records the sizes of the existing
//! files the caller holds locked; and, when dropped without [`FileUndo::keep`], removes the
//! files it made and shrinks the grown ones back.
//!
//! - The lock on a file made here is shared with the caller by
//!   [`crate::DeviceLocks::acquire_created`], given this undo: a duplicate of the descriptor
//!   this made (the same open file description), so the caller's lock and this one are one
//!   lock and there is no moment without it; neither side's drop unlocks the other's. Any
//!   other opener, in this process too ([`crate::DeviceLocks::acquire`]), is refused as in use.
//! - A file made here is undone under that lock (emptied through its own descriptor, then
//!   unlinked if the path still names it); one another process holds is left alone.
//! - A file whose contents are refused as another's ([`FileUndo::forget`]: a process wrote it
//!   between its creation and the format's read, without the lock, as mkfs would) is left as it
//!   is; so is one another process made meanwhile (it is not recorded at all).
//! - A grown file is one the caller held locked before this was made; it must be dropped before
//!   those locks are released (declared after them), since it shrinks it without a lock of its own.

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::FlockArg;

use crate::lock::POOL_FILE_MODE;
use crate::spec::DeviceSpec;

thread_local! {
    /// The files made by the [`FileUndo`] whose [`FileUndo::lending_locks`] runs on this thread
    /// now, by (device, inode): a duplicate of each one's locked descriptor, or why it could not
    /// be duplicated. Empty otherwise.
    static LENT: RefCell<Vec<(u64, u64, Lent)>> = const { RefCell::new(Vec::new()) };
}

/// What [`FileUndo::lending_locks`] lends of one file: a duplicate of the descriptor that made
/// it, or the error duplicating it failed with (EMFILE, ENFILE), for the acquire to report.
type Lent = std::io::Result<File>;

/// A new duplicate of the descriptor that made the file (`dev`, `ino`), if the
/// [`FileUndo::lending_locks`] running on this thread lends it; the error its duplication
/// failed with if it could not be lent (the file is this process's own: taking a lock of its
/// own would only be refused as in use, naming this very process).
pub(crate) fn lent_file(dev: u64, ino: u64) -> Option<std::io::Result<File>> {
    LENT.with_borrow(|lent| {
        lent.iter().find(|(found_dev, found_ino, _)| (*found_dev, *found_ino) == (dev, ino)).map(|(_, _, file)| match file {
            Ok(file) => duplicate(file),
            // io::Error is not Clone: the errno again (a duplication failure has one).
            Err(error) => Err(match error.raw_os_error() {
                Some(errno) => std::io::Error::from_raw_os_error(errno),
                None => std::io::Error::new(error.kind(), error.to_string()),
            }),
        })
    })
}

#[cfg(test)]
thread_local! {
    /// Tests: the errno [`duplicate`] fails with on this thread (EMFILE, say), instead of
    /// duplicating.
    static DUPLICATION_FAILS_WITH: std::cell::Cell<Option<i32>> = const { std::cell::Cell::new(None) };
}

/// `file.try_clone()` (`dup`), which tests can make fail ([`DUPLICATION_FAILS_WITH`]).
fn duplicate(file: &File) -> std::io::Result<File> {
    #[cfg(test)]
    if let Some(errno) = DUPLICATION_FAILS_WITH.get() {
        return Err(std::io::Error::from_raw_os_error(errno));
    }
    file.try_clone()
}

/// `flock(LOCK_EX | LOCK_NB)` on `file`'s open file description, left held when `file` is
/// closed (nix's `Flock` unlocks on drop, which would release the lock a
/// [`crate::DeviceLocks`] shares with it, [`crate::DeviceLocks::acquire_created`]).
fn lock_exclusive(file: &File) -> bool {
    #[allow(deprecated)]
    nix::fcntl::flock(file.as_raw_fd(), FlockArg::LockExclusiveNonblock).is_ok()
}

/// One file as [`FileUndo`] found it.
#[derive(Debug)]
struct Recorded {
    /// The file itself: for one made through a dangling symbolic link, the link's target.
    path: PathBuf,
    /// The `emu:` path that named it ([`FileUndo::forget`] is given that).
    named: PathBuf,
    dev: u64,
    ino: u64,
    /// `Some`: made here, locked on this descriptor (removed on undo); `None`: grown.
    made: Option<File>,
    /// The size it had (shrunk back to it); 0 for one made here.
    len: u64,
}

/// The `emu:` files of a format, to be put back as they were unless [`FileUndo::keep`] is
/// called (module docs).
#[derive(Debug, Default)]
pub struct FileUndo {
    recorded: Vec<Recorded>,
    kept: bool,
}

impl FileUndo {
    /// Records the size of every `emu:` regular file of `specs` that `held` (the paths the
    /// caller holds locked) names, and creates (empty, mode 0600) and locks every one that does
    /// not exist. A path that is a dangling symbolic link makes the file it names (the last
    /// target of the chain, as opening it with `O_CREAT` would: the lock and the software
    /// controller follow it), recorded by that target's path. A file that cannot be created
    /// here (its directory is missing) is left for the opening to report; one that exists but
    /// is not held (another process made it since the caller looked) is not recorded: it is not
    /// this format's to undo.
    pub fn create_missing<'a>(specs: &[DeviceSpec], held: impl Iterator<Item = &'a Path>) -> FileUndo {
        let held: Vec<&Path> = held.collect();
        let mut undo = FileUndo::default();
        for spec in specs {
            let DeviceSpec::EmuFile(path) = spec else { continue };
            if held.contains(&path.as_path()) {
                undo.record_held(path);
                continue;
            }
            // A dangling link's own name exists (O_EXCL fails on it), while the lock's open
            // (O_CREAT) would follow it and make its target, which nothing would undo: the
            // target is made here instead, without following a link planted there meanwhile.
            let Some(target) = crate::open::creation_path(path) else { continue };
            let mut options = OpenOptions::new();
            options.read(true).write(true).create_new(true).mode(POOL_FILE_MODE).custom_flags(nix::libc::O_NOFOLLOW);
            let Ok(file) = options.open(&target) else { continue };
            // Locked at once, on the descriptor that made it; a file another process locked
            // first (it found it there) is its own.
            let Ok(metadata) = file.metadata() else { continue };
            if !lock_exclusive(&file) {
                continue;
            }
            undo.recorded.push(Recorded {
                path: target,
                named: path.clone(),
                dev: metadata.dev(),
                ino: metadata.ino(),
                made: Some(file),
                len: 0,
            });
        }
        undo
    }

    fn record_held(&mut self, path: &Path) {
        // A FIFO must not make this wait; only regular files are created or grown. A symbolic
        // link is followed, as the caller's lock and the software controller follow it: the
        // file it names is the one grown, and shrunk back (`undo` follows it too).
        if let Ok(metadata) = std::fs::metadata(path) {
            if metadata.is_file() {
                self.recorded.push(Recorded {
                    path: path.to_path_buf(),
                    named: path.to_path_buf(),
                    dev: metadata.dev(),
                    ino: metadata.ino(),
                    made: None,
                    len: metadata.len(),
                });
            }
        }
    }

    /// The paths of the files this created (a dangling symbolic link's target, not the link).
    pub fn created(&self) -> impl Iterator<Item = &Path> {
        self.recorded.iter().filter(|file| file.made.is_some()).map(|file| file.path.as_path())
    }

    /// The descriptor that made (and locked) the file (`dev`, `ino`), if this made it: the one
    /// [`crate::DeviceLocks::acquire_created`] shares the lock of.
    pub(crate) fn made_file(&self, dev: u64, ino: u64) -> Option<&File> {
        self.recorded.iter().find(|file| (file.dev, file.ino) == (dev, ino)).and_then(|file| file.made.as_ref())
    }

    /// Runs `lock` with the locks of the files this made lent to [`crate::DeviceLocks::acquire`]
    /// (with `create_files`) on this thread, and on this thread only, while it runs: what
    /// [`crate::DeviceLocks::acquire_created`] does, for a caller that locks through a wrapper
    /// of its own (tuttid's, which also claims block devices). Another thread's acquire, or one
    /// after `lock` returned, is refused as in use as before. A descriptor that cannot be
    /// duplicated here (EMFILE, ENFILE) makes the acquire of its file fail with that I/O error
    /// ([`crate::DeviceError::Io`], "duplicating the descriptor that created …"), as
    /// [`crate::DeviceLocks::acquire_created`] does, not refuse it as in use by this process.
    pub fn lending_locks<T>(&self, lock: impl FnOnce() -> T) -> T {
        let lent: Vec<(u64, u64, Lent)> =
            self.recorded.iter().filter_map(|file| Some((file.dev, file.ino, duplicate(file.made.as_ref()?)))).collect();
        /// Puts back what was lent before (nested calls), even if `lock` panics.
        struct Restore(Vec<(u64, u64, Lent)>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let before = std::mem::take(&mut self.0);
                LENT.with_borrow_mut(|lent| *lent = before);
            }
        }
        let _restore = Restore(LENT.with_borrow_mut(|current| std::mem::replace(current, lent)));
        lock()
    }

    /// Leaves `path` as it is, whatever happens to the others: its contents were refused as
    /// another's (written since it was made here), so they are not this format's to undo.
    /// `path` is the `emu:` path given (a symbolic link's target made here is forgotten with it).
    pub fn forget(&mut self, path: &Path) {
        self.recorded.retain(|file| file.named != path && file.path != path);
    }

    /// Keeps the files as they are now (the format goes on to write them). The locks on the
    /// files made here stay held by the [`crate::DeviceLocks`] they were shared with
    /// ([`crate::DeviceLocks::acquire_created`]); a file never shared is unlocked.
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for FileUndo {
    fn drop(&mut self) {
        if !self.kept {
            self.recorded.iter().for_each(undo);
        }
    }
}

/// Removes `file` if made here, shrinks it back otherwise, if it is still the same file;
/// best effort (nothing else can be done about a failure here).
fn undo(file: &Recorded) {
    match &file.made {
        Some(made) => {
            // Under the lock taken when it was made (still held, or taken again if whoever
            // shared it let go and nobody else took it since): emptied through its own
            // descriptor, then unlinked only if the path still names it.
            if !lock_exclusive(made) {
                return;
            }
            let _ = made.set_len(0);
            match std::fs::symlink_metadata(&file.path) {
                Ok(metadata) if metadata.dev() == file.dev && metadata.ino() == file.ino => {
                    let _ = std::fs::remove_file(&file.path);
                }
                _ => {}
            }
        }
        None => {
            // Held locked by the caller (this is dropped first): shrunk through a descriptor
            // checked to be the file recorded (a symbolic link followed, as when recorded).
            let Ok(opened) = OpenOptions::new().write(true).custom_flags(nix::libc::O_NONBLOCK).open(&file.path) else {
                return;
            };
            let Ok(metadata) = opened.metadata() else { return };
            if metadata.is_file() && metadata.dev() == file.dev && metadata.ino() == file.ino && metadata.len() > file.len {
                let _ = opened.set_len(file.len);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeviceLocks;

    #[test]
    fn a_refusal_removes_the_files_made_and_shrinks_the_grown_ones() {
        // Goal: the files a format made are removed, the ones it grew shrunk back, unless kept;
        // a file made here is locked from the moment it exists, and the caller's lock on it is
        // the same lock (shared by acquire_created, not refused as another's).
        let directory = tempfile::tempdir().unwrap();
        let (new, small, locks) = (directory.path().join("new.img"), directory.path().join("small.img"), directory.path().join("locks"));
        std::fs::write(&small, [7u8; 4096]).unwrap();
        let specs = [DeviceSpec::EmuFile(new.clone()), DeviceSpec::EmuFile(small.clone())];
        let held = DeviceLocks::acquire(&specs, &locks, false).unwrap();
        let undo = FileUndo::create_missing(&specs, held.paths());
        assert_eq!(undo.created().collect::<Vec<_>>(), [new.as_path()]);
        assert_eq!(std::fs::metadata(&new).unwrap().mode() & 0o777, POOL_FILE_MODE);
        let other = nix::fcntl::Flock::lock(File::open(&new).unwrap(), FlockArg::LockExclusiveNonblock);
        assert!(other.is_err(), "a file made here was not locked at once");
        let created = DeviceLocks::acquire_created(&specs[..1], &locks, &undo).expect("the undo's lock is shared");
        File::options().write(true).open(&new).unwrap().set_len(1 << 20).unwrap();
        File::options().write(true).open(&small).unwrap().set_len(1 << 20).unwrap();
        drop(undo);
        drop((created, held));
        assert!(!new.exists());
        assert_eq!(std::fs::read(&small).unwrap(), [7u8; 4096]);
        // Kept: as they are now, and the caller's lock still held.
        let held = DeviceLocks::acquire(&specs, &locks, false).unwrap();
        let undo = FileUndo::create_missing(&specs, held.paths());
        let created = DeviceLocks::acquire_created(&specs[..1], &locks, &undo).unwrap();
        File::options().write(true).open(&small).unwrap().set_len(1 << 20).unwrap();
        undo.keep();
        assert!(new.exists());
        assert_eq!(std::fs::metadata(&small).unwrap().len(), 1 << 20);
        let other = nix::fcntl::Flock::lock(File::open(&new).unwrap(), FlockArg::LockExclusiveNonblock);
        assert!(other.is_err(), "kept, but no longer locked");
        drop((created, held));
        // Forgotten (another process wrote it): left as it is.
        std::fs::remove_file(&new).unwrap();
        let mut undo = FileUndo::create_missing(&specs[..1], std::iter::empty());
        std::fs::write(&new, b"theirs").unwrap();
        undo.forget(&new);
        drop(undo);
        assert_eq!(std::fs::read(&new).unwrap(), b"theirs");
        // Made by another process meanwhile (not held, already there): not recorded.
        let undo = FileUndo::create_missing(&specs[..1], std::iter::empty());
        assert_eq!(undo.created().count(), 0);
        drop(undo);
        assert_eq!(std::fs::read(&new).unwrap(), b"theirs");
    }

    #[test]
    fn another_opener_in_this_process_is_refused_and_cannot_unlock_a_file_made_here() {
        // Goal: a file made here is locked for this format alone. Any other DeviceLocks::acquire
        // of this process (another Store.open on another thread) took over its lock through a
        // process-wide table, was not refused, and on drop unlocked it under the format.
        let directory = tempfile::tempdir().unwrap();
        let (path, locks) = (directory.path().join("new.img"), directory.path().join("locks"));
        let specs = [DeviceSpec::EmuFile(path.clone())];
        let undo = FileUndo::create_missing(&specs, std::iter::empty());
        assert_eq!(undo.created().count(), 1);
        let other = DeviceLocks::acquire(&specs, &locks, false);
        assert!(matches!(other, Err(crate::DeviceError::DeviceInUse { .. })), "another opener was not refused: {other:?}");
        drop(other);
        let fresh = nix::fcntl::Flock::lock(File::open(&path).unwrap(), FlockArg::LockExclusiveNonblock);
        assert!(fresh.is_err(), "the file made here was unlocked by another opener");
        drop(undo);
        assert!(!path.exists());
    }

    #[test]
    fn a_handover_refused_part_way_leaves_the_files_made_here_locked() {
        // Goal: taking the locks on the files a format made fails when another process took one
        // of them (B, made by it after the first look); the file made here (A) must stay locked
        // by the undo throughout: the partial set used to unlock A's description on its drop.
        let directory = tempfile::tempdir().unwrap();
        let (a, b, locks) = (directory.path().join("a.img"), directory.path().join("b.img"), directory.path().join("locks"));
        let specs = [DeviceSpec::EmuFile(a.clone()), DeviceSpec::EmuFile(b.clone())];
        std::fs::write(&b, b"").unwrap();
        let theirs = nix::fcntl::Flock::lock(File::open(&b).unwrap(), FlockArg::LockExclusiveNonblock).unwrap();
        let undo = FileUndo::create_missing(&specs, std::iter::empty());
        assert_eq!(undo.created().collect::<Vec<_>>(), [a.as_path()]);
        let refused = DeviceLocks::acquire_created(&specs, &locks, &undo);
        assert!(matches!(refused, Err(crate::DeviceError::DeviceInUse { .. })), "{refused:?}");
        drop(refused);
        let fresh = nix::fcntl::Flock::lock(File::open(&a).unwrap(), FlockArg::LockExclusiveNonblock);
        assert!(fresh.is_err(), "the file made here was unlocked by the refused handover");
        drop(undo);
        assert!(!a.exists());
        drop(theirs);
        // Handed over: the caller's set holds it too, and dropping the undo first (as callers
        // do) or the set first leaves the other's lock in place.
        let undo = FileUndo::create_missing(&specs[..1], std::iter::empty());
        let taken = DeviceLocks::acquire_created(&specs[..1], &locks, &undo).expect("the undo's lock is handed over");
        assert_eq!(taken.paths().collect::<Vec<_>>(), [a.as_path()]);
        drop(taken);
        let fresh = nix::fcntl::Flock::lock(File::open(&a).unwrap(), FlockArg::LockExclusiveNonblock);
        assert!(fresh.is_err(), "dropping the caller's set unlocked the undo's file");
        let taken = DeviceLocks::acquire_created(&specs[..1], &locks, &undo).unwrap();
        undo.keep();
        let fresh = nix::fcntl::Flock::lock(File::open(&a).unwrap(), FlockArg::LockExclusiveNonblock);
        assert!(fresh.is_err(), "kept, but no longer locked");
        drop(taken);
        nix::fcntl::Flock::lock(File::open(&a).unwrap(), FlockArg::LockExclusiveNonblock).expect("free once both let go");
    }

    #[test]
    fn a_grown_file_named_through_a_symbolic_link_is_shrunk_back() {
        // Goal: an emu: file given as a symbolic link to the pool file is grown by the format
        // like any other, so a refused format shrinks it back; the undo opened it with
        // O_NOFOLLOW and left it grown.
        let directory = tempfile::tempdir().unwrap();
        let (target, link, locks) = (directory.path().join("small.img"), directory.path().join("link.img"), directory.path().join("locks"));
        std::fs::write(&target, [7u8; 4096]).unwrap();
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let specs = [DeviceSpec::EmuFile(link.clone())];
        let held = DeviceLocks::acquire(&specs, &locks, false).unwrap();
        let undo = FileUndo::create_missing(&specs, held.paths());
        File::options().write(true).open(&link).unwrap().set_len(1 << 20).unwrap();
        drop(undo);
        drop(held);
        assert_eq!(std::fs::metadata(&target).unwrap().len(), 4096, "left grown");
        assert!(std::fs::read(&target).unwrap() == [7u8; 4096]);
    }

    #[test]
    fn a_file_made_through_a_dangling_symbolic_link_is_removed_by_a_refusal() {
        // Goal: an emu: path that is a dangling symbolic link (link.img -> target.img, missing)
        // made create_missing's O_EXCL | O_NOFOLLOW fail (EEXIST), so nothing was recorded; the
        // lock step then opened it with O_CREAT, following the link, and made target.img, which
        // a refused format ("nothing was changed") left behind. The undo makes the target
        // itself, names it, shares its lock with the caller's and removes it; the link stays.
        let directory = tempfile::tempdir().unwrap();
        let (target, link, locks) =
            (directory.path().join("target.img"), directory.path().join("link.img"), directory.path().join("locks"));
        std::os::unix::fs::symlink("target.img", &link).unwrap();
        let specs = [DeviceSpec::EmuFile(link.clone())];
        let undo = FileUndo::create_missing(&specs, std::iter::empty());
        assert_eq!(undo.created().collect::<Vec<_>>(), [target.as_path()], "the target made is not named");
        let created = DeviceLocks::acquire_created(&specs, &locks, &undo).expect("the undo's lock is shared");
        File::options().write(true).open(&link).unwrap().set_len(1 << 20).unwrap();
        drop(undo);
        drop(created);
        assert!(std::fs::symlink_metadata(&target).is_err(), "the file made through the link was left");
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link itself was removed");
        // Forgotten by the name given (its contents refused as another's): left as it is.
        let mut undo = FileUndo::create_missing(&specs, std::iter::empty());
        std::fs::write(&target, b"theirs").unwrap();
        undo.forget(&link);
        drop(undo);
        assert_eq!(std::fs::read(&target).unwrap(), b"theirs");
    }

    #[test]
    fn locks_lent_on_this_thread_are_shared_only_while_lending() {
        // Goal: a caller that locks through a wrapper (tuttid's) gets the undo's locks shared
        // inside lending_locks, on its own thread; another thread meanwhile, or any acquire
        // after it, is refused as in use, and dropping the shared set unlocks nothing.
        let directory = tempfile::tempdir().unwrap();
        let (path, locks) = (directory.path().join("new.img"), directory.path().join("locks"));
        let specs = [DeviceSpec::EmuFile(path.clone())];
        let undo = FileUndo::create_missing(&specs, std::iter::empty());
        let (other_specs, other_locks) = (specs.clone(), locks.clone());
        let taken = undo.lending_locks(|| {
            let other = std::thread::spawn(move || DeviceLocks::acquire(&other_specs, &other_locks, true).map(|_| ())).join().unwrap();
            assert!(matches!(other, Err(crate::DeviceError::DeviceInUse { .. })), "another thread shared it: {other:?}");
            DeviceLocks::acquire(&specs, &locks, true)
        });
        let taken = taken.expect("lent on this thread");
        assert!(matches!(DeviceLocks::acquire(&specs, &locks, true), Err(crate::DeviceError::DeviceInUse { .. })));
        drop(taken);
        let fresh = nix::fcntl::Flock::lock(File::open(&path).unwrap(), FlockArg::LockExclusiveNonblock);
        assert!(fresh.is_err(), "dropping the shared set unlocked the undo's file");
        drop(undo);
        assert!(!path.exists());
    }

    #[test]
    fn a_lock_that_cannot_be_lent_fails_as_io_not_as_in_use() {
        // Goal: a descriptor lending_locks could not duplicate (EMFILE, ENFILE) was silently not
        // lent, so the acquire inside took a lock of its own, found the undo's, and refused the
        // file as in use, held by this very process (status 2); it fails as the I/O error it
        // is (status 1), naming the duplication, as acquire_created does.
        let directory = tempfile::tempdir().unwrap();
        let (path, locks) = (directory.path().join("new.img"), directory.path().join("locks"));
        let specs = [DeviceSpec::EmuFile(path.clone())];
        let undo = FileUndo::create_missing(&specs, std::iter::empty());
        DUPLICATION_FAILS_WITH.set(Some(nix::libc::EMFILE));
        let taken = undo.lending_locks(|| DeviceLocks::acquire(&specs, &locks, true).map(|_| ()));
        DUPLICATION_FAILS_WITH.set(None);
        match taken {
            Err(crate::DeviceError::Io { context, source }) => {
                assert!(context.contains("duplicating"), "{context}");
                assert_eq!(source.raw_os_error(), Some(nix::libc::EMFILE));
            }
            other => panic!("not an I/O error: {other:?}"),
        }
        drop(undo);
        assert!(!path.exists());
    }
}
