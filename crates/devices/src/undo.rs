//! Undoing what a refused format did to its `emu:` files. A format creates missing files and
//! grows small ones before the software controllers start; a refusal after that (status 2,
//! "nothing was changed") must leave no new file and no grown one behind. [`FileUndo`] creates
//! the missing files itself (`O_CREAT | O_EXCL`, so it knows which ones it made) and locks each
//! on the descriptor that created it at once (`flock`, the lock [`crate::DeviceLocks`] takes),
//! so no other tutti process can take a file it made; it records the sizes of the existing
//! files the caller holds locked; and, when dropped without [`FileUndo::keep`], removes the
//! files it made and shrinks the grown ones back.
//!
//! - The lock on a file made here is the one [`crate::DeviceLocks::acquire`] then takes: it
//!   locks the descriptor this made (the same open file description), not a new one, so the
//!   caller's lock and this one are one lock and there is no moment without it.
//! - A file made here is undone under that lock (emptied through its own descriptor, then
//!   unlinked if the path still names it); one another process holds is left alone.
//! - A file whose contents are refused as another's ([`FileUndo::forget`]: a process wrote it
//!   between its creation and the format's read, without the lock, as mkfs would) is left as it
//!   is; so is one another process made meanwhile (it is not recorded at all).
//! - A grown file is one the caller held locked before this was made; it must be dropped before
//!   those locks are released (declared after them), since it shrinks it without a lock of its own.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::fcntl::FlockArg;

use crate::lock::POOL_FILE_MODE;
use crate::spec::DeviceSpec;

/// The files this process's [`FileUndo`]s made and hold locked, by (device, inode): the
/// descriptor [`crate::DeviceLocks::acquire`] locks for them instead of opening another.
static MADE_HERE: Mutex<Vec<(u64, u64, File)>> = Mutex::new(Vec::new());

/// A descriptor of the file (`dev`, `ino`) that a [`FileUndo`] of this process made and holds
/// locked (sharing its open file description, so its lock), if any.
pub(crate) fn made_here(dev: u64, ino: u64) -> Option<File> {
    let made = MADE_HERE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    made.iter().find(|(found_dev, found_ino, _)| (*found_dev, *found_ino) == (dev, ino)).and_then(|(_, _, file)| file.try_clone().ok())
}

fn forget_made_here(dev: u64, ino: u64) {
    let mut made = MADE_HERE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    made.retain(|(found_dev, found_ino, _)| (*found_dev, *found_ino) != (dev, ino));
}

/// `flock(LOCK_EX | LOCK_NB)` on `file`'s open file description, left held when `file` is
/// closed (nix's `Flock` unlocks on drop, which would release the lock a
/// [`crate::DeviceLocks`] holds on a descriptor sharing it).
fn lock_exclusive(file: &File) -> bool {
    #[allow(deprecated)]
    nix::fcntl::flock(file.as_raw_fd(), FlockArg::LockExclusiveNonblock).is_ok()
}

/// One file as [`FileUndo`] found it.
#[derive(Debug)]
struct Recorded {
    path: PathBuf,
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
    /// not exist. A file that cannot be created here (its directory is missing) is left for the
    /// opening to report; one that exists but is not held (another process made it since the
    /// caller looked) is not recorded: it is not this format's to undo.
    pub fn create_missing<'a>(specs: &[DeviceSpec], held: impl Iterator<Item = &'a Path>) -> FileUndo {
        let held: Vec<&Path> = held.collect();
        let mut undo = FileUndo::default();
        for spec in specs {
            let DeviceSpec::EmuFile(path) = spec else { continue };
            if held.contains(&path.as_path()) {
                undo.record_held(path);
                continue;
            }
            let mut options = OpenOptions::new();
            options.read(true).write(true).create_new(true).mode(POOL_FILE_MODE).custom_flags(nix::libc::O_NOFOLLOW);
            let Ok(file) = options.open(path) else { continue };
            // Locked at once, on the descriptor that made it; a file another process locked
            // first (it found it there) is its own.
            let Ok(metadata) = file.metadata() else { continue };
            if !lock_exclusive(&file) {
                continue;
            }
            let Ok(registered) = file.try_clone() else { continue };
            MADE_HERE.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((metadata.dev(), metadata.ino(), registered));
            undo.recorded.push(Recorded { path: path.clone(), dev: metadata.dev(), ino: metadata.ino(), made: Some(file), len: 0 });
        }
        undo
    }

    fn record_held(&mut self, path: &Path) {
        // A FIFO must not make this wait; only regular files are created or grown.
        if let Ok(metadata) = std::fs::metadata(path) {
            if metadata.is_file() {
                self.recorded.push(Recorded {
                    path: path.to_path_buf(),
                    dev: metadata.dev(),
                    ino: metadata.ino(),
                    made: None,
                    len: metadata.len(),
                });
            }
        }
    }

    /// The paths this created.
    pub fn created(&self) -> impl Iterator<Item = &Path> {
        self.recorded.iter().filter(|file| file.made.is_some()).map(|file| file.path.as_path())
    }

    /// Leaves `path` as it is, whatever happens to the others: its contents were refused as
    /// another's (written since it was made here), so they are not this format's to undo.
    pub fn forget(&mut self, path: &Path) {
        self.recorded.retain(|file| {
            if file.path != path {
                return true;
            }
            forget_made_here(file.dev, file.ino);
            false
        });
    }

    /// Keeps the files as they are now (the format goes on to write them). The locks on the
    /// files made here stay held by the [`crate::DeviceLocks`] that took them.
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for FileUndo {
    fn drop(&mut self) {
        for file in &self.recorded {
            forget_made_here(file.dev, file.ino);
            if !self.kept {
                undo(file);
            }
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
            // checked to be the file recorded.
            let Ok(opened) = OpenOptions::new().write(true).custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_NOFOLLOW).open(&file.path)
            else {
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
        // the same lock (taken over, not refused as another's).
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
        let created = DeviceLocks::acquire(&specs[..1], &locks, true).expect("the undo's lock is taken over");
        File::options().write(true).open(&new).unwrap().set_len(1 << 20).unwrap();
        File::options().write(true).open(&small).unwrap().set_len(1 << 20).unwrap();
        drop(undo);
        drop((created, held));
        assert!(!new.exists());
        assert_eq!(std::fs::read(&small).unwrap(), [7u8; 4096]);
        // Kept: as they are now, and the caller's lock still held.
        let held = DeviceLocks::acquire(&specs, &locks, false).unwrap();
        let undo = FileUndo::create_missing(&specs, held.paths());
        let created = DeviceLocks::acquire(&specs[..1], &locks, true).unwrap();
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
}
