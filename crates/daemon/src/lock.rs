//! One daemon per pool: tuttid takes [`tutti_devices::lock`]'s exclusive lock on each pool
//! device before the devices are opened and holds it for its life (`tutti pool` takes the same
//! lock, so neither runs under the other). This adapter keeps the daemon's own errors: a second
//! daemon is refused as [`DaemonError::DeviceInUse`], naming the holder.
//!
//! An `emu:` device that is a block device (the software controller over a whole disk) is also
//! claimed exclusively ([`tutti_devices::claim`], `O_EXCL`) for the daemon's life, as `tutti pool`
//! claims it: a disk that is mounted, used as swap or held by device-mapper/MD is refused before
//! tuttid writes to it (a `--format` included), and while tuttid serves it nothing can mount it.

use std::path::Path;

use tutti_devices::{BlockDeviceClaims, BlockDeviceOpener, DeviceError, DeviceSpec, HostBlockDevices};

pub use tutti_devices::lock::{holder_of, lists_flock_exactly};

use crate::DaemonError;

/// Held locks and block-device claims; dropping releases them.
#[derive(Debug, Default)]
pub struct DeviceLocks {
    /// This set's locks and those of the sets added by [`DeviceLocks::extend`], as one.
    locks: tutti_devices::DeviceLocks,
    claims: BlockDeviceClaims,
    /// The claims of sets taken later for more devices ([`DeviceLocks::extend`]), held as long
    /// as this one.
    more_claims: Vec<BlockDeviceClaims>,
}

/// A device error as the daemon's: I/O that failed (an open that failed with EIO, EMFILE, ...
/// included) as [`DaemonError::Io`] (tuttid: exit status 1), what was given (a lock directory
/// this user may not make, say) as [`DaemonError::Devices`] (2), by the errno
/// (`tutti_devices::is_unusable_errno`), as `tutti pool` and tutti-bench decide.
pub(crate) fn daemon_error(error: DeviceError) -> DaemonError {
    let open_failed = matches!(error, DeviceError::OpenFailed { .. }) && !error.is_unusable_input();
    match error {
        DeviceError::DeviceInUse { spec, lock, holder } => DaemonError::DeviceInUse { spec, lock, holder },
        DeviceError::Io { context, source } if !tutti_devices::is_unusable_errno(&source) => DaemonError::Io { context, source },
        DeviceError::OpenFailed { path, source } if open_failed => {
            DaemonError::Io { context: format!("opening {} to lock it", path.display()), source }
        }
        error => DaemonError::Devices(error),
    }
}

#[cfg(test)]
thread_local! {
    /// Tests: the errno every `fchmod` of [`DeviceLocks::narrow_pool_files`] on this thread
    /// fails with (EPERM: a filesystem refusing mode changes); `None`: the real fchmod.
    pub(crate) static NARROWING_FAILS_WITH: std::cell::Cell<Option<i32>> = const { std::cell::Cell::new(None) };
}

impl DeviceLocks {
    /// [`tutti_devices::DeviceLocks::acquire`] and the claims of the block devices among
    /// `specs`, their errors as the daemon's.
    pub fn acquire(specs: &[DeviceSpec], lock_dir: &Path, create_files: bool) -> Result<DeviceLocks, DaemonError> {
        Self::acquire_with(specs, lock_dir, create_files, &HostBlockDevices)
    }

    pub(crate) fn acquire_with(
        specs: &[DeviceSpec],
        lock_dir: &Path,
        create_files: bool,
        opener: &dyn BlockDeviceOpener,
    ) -> Result<DeviceLocks, DaemonError> {
        // Changes no mode: a pool file of this user's that others can open is narrowed only
        // once the pool is open (`narrow_pool_files`), so a refused start leaves it as it was.
        let locks = tutti_devices::DeviceLocks::acquire(specs, lock_dir, create_files).map_err(daemon_error)?;
        let claims = BlockDeviceClaims::acquire(specs, opener).map_err(daemon_error)?;
        Ok(DeviceLocks { locks, claims, more_claims: Vec::new() })
    }

    /// Makes every pool file of this set (and of those added by [`DeviceLocks::extend`]) that
    /// others could open its owner's only ([`tutti_devices::DeviceLocks::narrow_pool_files`]):
    /// for `open_pool` once the pool is open, so that no refusal (what a file holds, a file
    /// that holds no pool) changes a mode. What was done is logged as a warning (the devices
    /// crate logs nothing, and the owner should hear that a tool reading the file as another
    /// user now cannot); a failure (EPERM) puts the modes back and is the daemon's error,
    /// saying first that the pool was formatted on `formatted` (a `--format` start; empty
    /// otherwise) and is kept.
    pub fn narrow_pool_files(&mut self, formatted: &[DeviceSpec]) -> Result<(), DaemonError> {
        // Tests make every fchmod fail (NARROWING_FAILS_WITH), as a filesystem refusing it does.
        #[cfg(test)]
        let failing = NARROWING_FAILS_WITH.get();
        #[cfg(not(test))]
        let failing: Option<i32> = None;
        let notes = match failing {
            Some(errno) => self.locks.narrow_pool_files_with(formatted, &|_, _| Err(std::io::Error::from_raw_os_error(errno))),
            None => self.locks.narrow_pool_files(formatted),
        };
        for note in notes.map_err(daemon_error)? {
            tracing::warn!("{note}");
        }
        Ok(())
    }

    /// [`tutti_devices::DeviceLocks::check_opened`] over this set (and those added by
    /// [`DeviceLocks::extend`]): an opened `emu:` or `uring:` file must be the file locked.
    pub fn check_opened(&self, spec: &DeviceSpec, opened: Option<(u64, u64)>) -> Result<(), DaemonError> {
        self.locks.check_opened(spec, opened).map_err(daemon_error)
    }

    /// The block devices claimed when this set was acquired (not those of sets added by
    /// [`DeviceLocks::extend`]), to read what they hold before formatting them.
    pub fn claims(&self) -> &BlockDeviceClaims {
        &self.claims
    }

    /// Holds `other` (locks and claims on other devices) as long as this set, without letting go
    /// of anything: a format locks the files it creates only after the existing ones were taken
    /// and read, and keeps both.
    pub fn extend(&mut self, other: DeviceLocks) {
        self.locks.extend(other.locks);
        self.more_claims.push(other.claims);
        self.more_claims.extend(other.more_claims);
    }

    /// Every lock file held, this set's and those added by [`DeviceLocks::extend`].
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.locks.paths()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_file_that_failed_to_open_is_a_failure_unless_the_path_is_the_problem() {
        // Goal: tuttid's exit status for a lock file it could not open follows the errno (ec9a832
        // typed it as OpenFailed, which the daemon passed on as unusable input, 2, for EIO too).
        let open = |errno: nix::errno::Errno| DeviceError::OpenFailed {
            path: "/x".into(),
            source: std::io::Error::from_raw_os_error(errno as i32),
        };
        assert!(matches!(daemon_error(open(nix::errno::Errno::EIO)), DaemonError::Io { .. }));
        assert!(matches!(daemon_error(open(nix::errno::Errno::EMFILE)), DaemonError::Io { .. }));
        assert!(matches!(daemon_error(open(nix::errno::Errno::ENOENT)), DaemonError::Devices(DeviceError::OpenFailed { .. })));
        assert!(matches!(daemon_error(open(nix::errno::Errno::EACCES)), DaemonError::Devices(DeviceError::OpenFailed { .. })));
        let io = |errno: nix::errno::Errno| DeviceError::Io {
            context: "making /run/tutti".into(),
            source: std::io::Error::from_raw_os_error(errno as i32),
        };
        assert!(matches!(daemon_error(io(nix::errno::Errno::EIO)), DaemonError::Io { .. }));
        assert!(matches!(daemon_error(io(nix::errno::Errno::EACCES)), DaemonError::Devices(DeviceError::Io { .. })));
    }

    #[test]
    fn a_second_daemon_is_refused_as_the_daemons_device_in_use() {
        // Goal: the lock lives in tutti-devices; the daemon still reports a held device as its
        // own DeviceInUse ("in use by another daemon"), naming the lock file.
        let directory = tempfile::tempdir().unwrap();
        let image = directory.path().join("pool.img");
        std::fs::write(&image, [0u8; 4096]).unwrap();
        let spec = DeviceSpec::EmuFile(image.clone());
        let first = DeviceLocks::acquire(std::slice::from_ref(&spec), directory.path(), false).unwrap();
        assert_eq!(first.paths().collect::<Vec<_>>(), [image.as_path()]);
        let error = DeviceLocks::acquire(std::slice::from_ref(&spec), directory.path(), false).unwrap_err();
        assert!(matches!(error, DaemonError::DeviceInUse { .. }), "{error}");
        assert!(error.to_string().contains("is in use by another daemon"), "{error}");
        drop(first);
        DeviceLocks::acquire(&[spec], directory.path(), false).expect("free again once the holder let go");
    }

    /// Answers for the kernel: `block` is a block device, busy (mounted) or not.
    struct FakeDisk {
        block: std::path::PathBuf,
        busy: bool,
    }

    impl BlockDeviceOpener for FakeDisk {
        fn is_block_device(&self, path: &Path) -> bool {
            path == self.block
        }

        fn open_exclusive(&self, path: &Path) -> std::io::Result<std::fs::File> {
            if self.busy {
                return Err(std::io::Error::from_raw_os_error(nix::libc::EBUSY));
            }
            std::fs::File::open(path)
        }
    }

    #[test]
    fn a_block_device_in_use_is_refused_before_the_daemon_opens_it() {
        // Goal: `tuttid --device emu:/dev/…` (with or without --format) over a disk that is
        // mounted, swap or held is refused naming it, before anything opens or writes it; a free
        // disk is claimed and held with the lock.
        let directory = tempfile::tempdir().unwrap();
        let disk = directory.path().join("disk");
        std::fs::write(&disk, [0u8; 4096]).unwrap();
        let spec = DeviceSpec::EmuFile(disk.clone());
        let busy = FakeDisk { block: disk.clone(), busy: true };
        let error = DeviceLocks::acquire_with(std::slice::from_ref(&spec), directory.path(), false, &busy).unwrap_err();
        assert!(matches!(error, DaemonError::Devices(DeviceError::BlockDeviceInUse { .. })), "{error}");
        assert!(error.to_string().contains("in use"), "{error}");
        // The lock taken before the claim was let go with the refusal.
        let free = FakeDisk { block: disk, busy: false };
        let held = DeviceLocks::acquire_with(std::slice::from_ref(&spec), directory.path(), false, &free).unwrap();
        assert_eq!(held.claims.len(), 1);
    }
}
