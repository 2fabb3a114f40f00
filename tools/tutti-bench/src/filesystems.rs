//! Where a pool file lives: a file on tmpfs or ramfs is memory, and a benchmark over it measures
//! memory, not a disk. `/tmp` is tmpfs on several distributions (Debian 13, Fedora, Arch), and
//! Linux 6.6 and later let tmpfs accept `O_DIRECT`, so opening the file tells nothing. The default
//! run therefore picks a directory on a disk; a directory the user names is used as given, and
//! the device line says that it is memory.

use std::path::{Path, PathBuf};

/// `f_type` of ramfs (linux/magic.h); nix names tmpfs's but not this one.
const RAMFS_MAGIC: u64 = 0x8584_58f6;

/// The name of the memory filesystem holding `path` ("tmpfs", "ramfs"), `None` on anything
/// else; an error when `statfs(2)` fails (the path does not exist, cannot be reached).
pub fn memory_filesystem(path: &Path) -> std::io::Result<Option<&'static str>> {
    use nix::sys::statfs::{statfs, TMPFS_MAGIC};
    let stats = statfs(path).map_err(std::io::Error::from)?;
    let kind = stats.filesystem_type();
    // The field's type differs between targets (i64 here, u32 on some).
    #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
    let magic = kind.0 as u64;
    Ok(if kind == TMPFS_MAGIC {
        Some("tmpfs")
    } else if magic == RAMFS_MAGIC {
        Some("ramfs")
    } else {
        None
    })
}

/// What a device description adds for a file on a memory filesystem: nothing otherwise. A file
/// not created yet is judged by its directory.
pub fn memory_note(path: &Path) -> String {
    let existing =
        if path.exists() { path } else { path.parent().filter(|parent| !parent.as_os_str().is_empty()).unwrap_or(Path::new(".")) };
    match memory_filesystem(existing) {
        Ok(Some(kind)) => format!(" ({kind}: memory, not a disk)"),
        _ => String::new(),
    }
}

/// The candidate directories of the default pool file, in order of preference: the system temp
/// directory, then `/var/tmp` (a disk on the distributions whose `/tmp` is tmpfs).
pub fn default_directory_candidates() -> Vec<PathBuf> {
    let mut candidates = vec![std::env::temp_dir()];
    let var_tmp = PathBuf::from("/var/tmp");
    if !candidates.contains(&var_tmp) {
        candidates.push(var_tmp);
    }
    candidates
}

/// The first of `candidates` that `memory_filesystem` (statfs) says is a directory on a disk
/// and `free_bytes` says has `needed_bytes` free for this user (an error: it cannot take a file,
/// e.g. not writable); with room on none of them, the first on a disk, whose own refusal (the
/// pool's, naming its free space) is the one to give. Otherwise a one-line refusal naming each
/// candidate's fate and `--directory`.
pub fn choose_default_directory(
    candidates: &[PathBuf],
    memory_filesystem: impl Fn(&Path) -> std::io::Result<Option<&'static str>>,
    free_bytes: impl Fn(&Path) -> std::io::Result<u64>,
    needed_bytes: u64,
) -> Result<PathBuf, String> {
    let mut refused = Vec::with_capacity(candidates.len());
    let mut first_on_disk = None;
    for candidate in candidates {
        match memory_filesystem(candidate) {
            Ok(None) => {
                // A small or read-only temp directory is passed over for the next candidate
                // (/var/tmp) rather than refused with /var/tmp never tried.
                if free_bytes(candidate).is_ok_and(|free| free >= needed_bytes) {
                    return Ok(candidate.clone());
                }
                first_on_disk.get_or_insert(candidate);
            }
            Ok(Some(kind)) => refused.push(format!("{} is {kind} (memory, not a disk)", candidate.display())),
            Err(error) => refused.push(format!("{}: {error}", candidate.display())),
        }
    }
    match first_on_disk {
        Some(candidate) => Ok(candidate.clone()),
        None => Err(format!(
            "no directory on a disk for the temporary pool file: {}; pass --directory DIR on the disk to measure",
            refused.join(", ")
        )),
    }
}

/// The free space of `directory` for a file of this user's: `statvfs`'s, or an error where it
/// may not create one (not writable).
pub fn writable_free_bytes(directory: &Path) -> std::io::Result<u64> {
    nix::unistd::access(directory, nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK).map_err(std::io::Error::from)?;
    crate::uring::statvfs_free_bytes(directory)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(answers: &'static [(&'static str, Option<&'static str>)]) -> impl Fn(&Path) -> std::io::Result<Option<&'static str>> {
        move |path: &Path| {
            answers
                .iter()
                .find(|(name, _)| Path::new(name) == path)
                .map(|(_, kind)| *kind)
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
        }
    }

    #[test]
    fn a_temp_directory_in_memory_gives_way_to_var_tmp() {
        // Goal: with /tmp on tmpfs the default pool goes to /var/tmp, not into RAM.
        let candidates = [PathBuf::from("/tmp"), PathBuf::from("/var/tmp")];
        let chosen = choose_default_directory(&candidates, fake(&[("/tmp", Some("tmpfs")), ("/var/tmp", None)]), plenty, 1);
        assert_eq!(chosen, Ok(PathBuf::from("/var/tmp")));
        let chosen = choose_default_directory(&candidates, fake(&[("/tmp", None), ("/var/tmp", None)]), plenty, 1);
        assert_eq!(chosen, Ok(PathBuf::from("/tmp")), "a temp directory on a disk is kept");
    }

    /// Free space enough for anything.
    fn plenty(_: &Path) -> std::io::Result<u64> {
        Ok(u64::MAX)
    }

    #[test]
    fn a_temp_directory_without_room_or_write_access_gives_way_to_var_tmp() {
        // Goal: with no --directory, a /tmp on a disk with too little free space for the pool
        // (a small partition) or none this user may write used to be refused, /var/tmp never
        // tried; it is passed over. With room nowhere, the first on a disk is kept, where the
        // pool's own refusal names its free space and --directory.
        let candidates = [PathBuf::from("/tmp"), PathBuf::from("/var/tmp")];
        let on_disk = || fake(&[("/tmp", None), ("/var/tmp", None)]);
        let small_tmp = |path: &Path| Ok(if path == Path::new("/tmp") { 100 << 20 } else { 10 << 30 });
        assert_eq!(choose_default_directory(&candidates, on_disk(), small_tmp, 640 << 20), Ok(PathBuf::from("/var/tmp")));
        let unwritable_tmp = |path: &Path| {
            if path == Path::new("/tmp") {
                Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied))
            } else {
                Ok(10 << 30)
            }
        };
        assert_eq!(choose_default_directory(&candidates, on_disk(), unwritable_tmp, 640 << 20), Ok(PathBuf::from("/var/tmp")));
        let small_everywhere = |_: &Path| Ok(100 << 20);
        assert_eq!(choose_default_directory(&candidates, on_disk(), small_everywhere, 640 << 20), Ok(PathBuf::from("/tmp")));
        // Memory is still passed over for room: /var/tmp on a disk without it is kept.
        let memory_tmp = fake(&[("/tmp", Some("tmpfs")), ("/var/tmp", None)]);
        let small_var_tmp = |path: &Path| Ok(if path == Path::new("/tmp") { 10 << 30 } else { 100 << 20 });
        assert_eq!(choose_default_directory(&candidates, memory_tmp, small_var_tmp, 640 << 20), Ok(PathBuf::from("/var/tmp")));
    }

    #[test]
    fn no_directory_on_a_disk_is_refused_naming_directory() {
        // Goal: when every candidate is memory or unusable the run refuses and names the fix.
        let candidates = [PathBuf::from("/tmp"), PathBuf::from("/var/tmp")];
        let refused =
            choose_default_directory(&candidates, fake(&[("/tmp", Some("tmpfs")), ("/var/tmp", Some("ramfs"))]), plenty, 1).unwrap_err();
        assert!(refused.contains("--directory") && refused.contains("/tmp is tmpfs") && refused.contains("/var/tmp is ramfs"), "{refused}");
        let refused = choose_default_directory(&candidates, fake(&[("/tmp", Some("tmpfs"))]), plenty, 1).unwrap_err();
        assert!(refused.contains("--directory") && refused.contains("/var/tmp:"), "{refused}");
    }

    #[test]
    fn dev_shm_is_memory_and_the_note_says_so() {
        // Goal: the real statfs recognises tmpfs (skips where /dev/shm is absent).
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            eprintln!("skipped: no /dev/shm here");
            return;
        }
        assert_eq!(memory_filesystem(shm).unwrap(), Some("tmpfs"));
        assert!(memory_note(&shm.join("not-created-yet.img")).contains("memory, not a disk"));
    }
}
