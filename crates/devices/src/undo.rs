//! Undoing what a refused format did to its `emu:` files. A format creates missing files and
//! grows small ones before the software controllers start; a refusal after that (status 2,
//! "nothing was changed") must leave no new file and no grown one behind. [`FileUndo`] creates
//! the missing files itself (`O_CREAT | O_EXCL`, so it knows which ones it made), records the
//! sizes of the existing ones, and, when dropped without [`FileUndo::keep`], removes the files
//! it made and shrinks the grown ones back.
//!
//! It must be dropped after the device locks are released: it undoes a file only under a lock
//! of its own (`flock`, the same the locks take), so a file another process has locked since
//! (another format that found it there) is left alone.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use crate::lock::POOL_FILE_MODE;
use crate::spec::DeviceSpec;

/// One file as [`FileUndo`] found it.
#[derive(Debug)]
struct Recorded {
    path: PathBuf,
    dev: u64,
    ino: u64,
    /// `None`: made here (removed on undo); otherwise its size then (shrunk back to it).
    len: Option<u64>,
}

/// The `emu:` files of a format, to be put back as they were unless [`FileUndo::keep`] is
/// called (module docs).
#[derive(Debug, Default)]
pub struct FileUndo {
    recorded: Vec<Recorded>,
    kept: bool,
}

impl FileUndo {
    /// Records the size of every `emu:` regular file of `specs` that exists, and creates (empty,
    /// mode 0600) every one that does not. A file that cannot be created here (its directory
    /// is missing) is left for the opening to report; one that another process created
    /// meanwhile is recorded as it is found.
    pub fn create_missing(specs: &[DeviceSpec]) -> FileUndo {
        let mut undo = FileUndo::default();
        for spec in specs {
            let DeviceSpec::EmuFile(path) = spec else { continue };
            let mut options = OpenOptions::new();
            options.write(true).create_new(true).mode(POOL_FILE_MODE);
            match options.open(path) {
                Ok(file) => undo.record(path, &file, None),
                Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => undo.record_existing(path),
                Err(_) => {}
            }
        }
        undo
    }

    fn record_existing(&mut self, path: &Path) {
        // A FIFO must not make this wait; only regular files are created or grown.
        if let Ok(metadata) = std::fs::metadata(path) {
            if metadata.is_file() {
                self.recorded.push(Recorded {
                    path: path.to_path_buf(),
                    dev: metadata.dev(),
                    ino: metadata.ino(),
                    len: Some(metadata.len()),
                });
            }
        }
    }

    fn record(&mut self, path: &Path, file: &File, len: Option<u64>) {
        if let Ok(metadata) = file.metadata() {
            self.recorded.push(Recorded { path: path.to_path_buf(), dev: metadata.dev(), ino: metadata.ino(), len });
        }
    }

    /// The paths this created.
    pub fn created(&self) -> impl Iterator<Item = &Path> {
        self.recorded.iter().filter(|file| file.len.is_none()).map(|file| file.path.as_path())
    }

    /// Keeps the files as they are now (the format goes on to write them).
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for FileUndo {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        for file in &self.recorded {
            undo(file);
        }
    }
}

/// Removes `file` if made here, shrinks it back otherwise, if it is still the same file and no
/// other process holds its lock; best effort (nothing else can be done about a failure here).
fn undo(file: &Recorded) {
    let Ok(opened) = OpenOptions::new().write(true).custom_flags(nix::libc::O_NONBLOCK).open(&file.path) else { return };
    let Ok(metadata) = opened.metadata() else { return };
    if !metadata.is_file() || metadata.dev() != file.dev || metadata.ino() != file.ino {
        return;
    }
    let Ok(locked) = Flock::lock(opened, FlockArg::LockExclusiveNonblock) else { return };
    match file.len {
        None => {
            let _ = std::fs::remove_file(&file.path);
        }
        Some(len) if metadata.len() > len => {
            let _ = locked.set_len(len);
        }
        Some(_) => {}
    }
    drop(locked);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_removes_the_files_made_and_shrinks_the_grown_ones() {
        // Goal: the files a format made are removed, the ones it grew shrunk back, unless kept;
        // a file another process holds locked is left alone.
        let directory = tempfile::tempdir().unwrap();
        let new = directory.path().join("new.img");
        let small = directory.path().join("small.img");
        std::fs::write(&small, [7u8; 4096]).unwrap();
        let specs = [DeviceSpec::EmuFile(new.clone()), DeviceSpec::EmuFile(small.clone())];
        let undo = FileUndo::create_missing(&specs);
        assert_eq!(undo.created().collect::<Vec<_>>(), [new.as_path()]);
        assert_eq!(std::fs::metadata(&new).unwrap().mode() & 0o777, POOL_FILE_MODE);
        File::options().write(true).open(&new).unwrap().set_len(1 << 20).unwrap();
        File::options().write(true).open(&small).unwrap().set_len(1 << 20).unwrap();
        drop(undo);
        assert!(!new.exists());
        assert_eq!(std::fs::read(&small).unwrap(), [7u8; 4096]);
        // Kept: as they are now.
        let undo = FileUndo::create_missing(&specs);
        File::options().write(true).open(&small).unwrap().set_len(1 << 20).unwrap();
        undo.keep();
        assert!(new.exists());
        assert_eq!(std::fs::metadata(&small).unwrap().len(), 1 << 20);
        // Held by another: left alone.
        std::fs::remove_file(&new).unwrap();
        let undo = FileUndo::create_missing(&specs[..1]);
        let held = Flock::lock(File::open(&new).unwrap(), FlockArg::LockExclusiveNonblock).unwrap();
        drop(undo);
        assert!(new.exists(), "removed a file another holder had locked");
        drop(held);
    }
}
