//! One daemon per pool: tuttid takes [`tutti_devices::lock`]'s exclusive lock on each pool
//! device before the devices are opened and holds it for its life (`tutti pool` takes the same
//! lock, so neither runs under the other). This adapter keeps the daemon's own errors: a second
//! daemon is refused as [`DaemonError::DeviceInUse`], naming the holder.

use std::path::Path;

use tutti_devices::{DeviceError, DeviceSpec};

pub use tutti_devices::lock::{holder_of, lists_flock_exactly};

use crate::DaemonError;

/// Held locks; dropping releases them.
#[derive(Debug, Default)]
pub struct DeviceLocks(tutti_devices::DeviceLocks);

impl DeviceLocks {
    /// [`tutti_devices::DeviceLocks::acquire`], its errors as the daemon's.
    pub fn acquire(specs: &[DeviceSpec], lock_dir: &Path, create_files: bool) -> Result<DeviceLocks, DaemonError> {
        tutti_devices::DeviceLocks::acquire(specs, lock_dir, create_files).map(DeviceLocks).map_err(|error| match error {
            DeviceError::DeviceInUse { spec, lock, holder } => DaemonError::DeviceInUse { spec, lock, holder },
            DeviceError::Io { context, source } => DaemonError::Io { context, source },
            error => DaemonError::Devices(error),
        })
    }

    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.0.paths()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
