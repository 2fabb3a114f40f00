//! Block devices claimed before a tool writes to them. `emu:PATH` also takes a block device
//! (the software controller over a whole disk), and a disk's name can change between boots
//! (kernel NVMe numbering): a tool that is to write one first opens it `O_RDONLY | O_EXCL`. On
//! Linux that open fails with `EBUSY` while the device or one of its partitions is mounted, used
//! as swap, stacked under device-mapper/MD, or claimed by another exclusive opener; and while it
//! is held, those claims (a mount among them) fail in turn. So the claim is taken before
//! anything is written and held until the tool is done.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::spec::DeviceSpec;
use crate::DeviceError;

/// The system calls behind a claim, so that tests can answer for the kernel.
pub trait BlockDeviceOpener {
    /// Whether `path` names a block device (following symbolic links).
    fn is_block_device(&self, path: &Path) -> bool;
    /// Opens `path` read-only and exclusively (`O_RDONLY | O_EXCL`).
    fn open_exclusive(&self, path: &Path) -> io::Result<File>;
}

/// The host's block devices.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostBlockDevices;

impl BlockDeviceOpener for HostBlockDevices {
    fn is_block_device(&self, path: &Path) -> bool {
        std::fs::metadata(path).is_ok_and(|metadata| metadata.file_type().is_block_device())
    }

    fn open_exclusive(&self, path: &Path) -> io::Result<File> {
        std::fs::OpenOptions::new().read(true).custom_flags(nix::libc::O_EXCL).open(path)
    }
}

/// Exclusive opens of the block devices among some specs; dropping releases them.
#[derive(Debug, Default)]
pub struct BlockDeviceClaims {
    held: Vec<(DeviceSpec, File)>,
}

impl BlockDeviceClaims {
    /// Claims every `emu:` or `uring:` spec that names a block device, in order; the first that cannot be
    /// claimed is refused ([`DeviceError::BlockDeviceInUse`] for `EBUSY`), releasing the rest.
    /// Other specs (regular files, memory, `vfio:`) are not touched.
    pub fn acquire(specs: &[DeviceSpec], opener: &dyn BlockDeviceOpener) -> Result<BlockDeviceClaims, DeviceError> {
        let mut claims = BlockDeviceClaims::default();
        for spec in specs {
            let (DeviceSpec::EmuFile(path) | DeviceSpec::Uring(path)) = spec else { continue };
            if !opener.is_block_device(path) {
                continue;
            }
            match opener.open_exclusive(path) {
                Ok(file) => claims.held.push((spec.clone(), file)),
                Err(error) if error.raw_os_error() == Some(nix::libc::EBUSY) => {
                    return Err(DeviceError::BlockDeviceInUse { spec: spec.to_string() })
                }
                Err(source) => return Err(DeviceError::Io { context: format!("{spec}: opening the block device exclusively"), source }),
            }
        }
        Ok(claims)
    }

    /// The claimed descriptor of `spec` (read-only), if it is a claimed block device.
    pub fn file(&self, spec: &DeviceSpec) -> Option<&File> {
        self.held.iter().find(|(held, _)| held == spec).map(|(_, file)| file)
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::path::PathBuf;

    use super::*;

    /// Says every path under `blocks` is a block device; answers `EBUSY` for `busy`.
    struct FakeOpener {
        blocks: Vec<PathBuf>,
        busy: Option<PathBuf>,
        opened: RefCell<Vec<PathBuf>>,
    }

    impl BlockDeviceOpener for FakeOpener {
        fn is_block_device(&self, path: &Path) -> bool {
            self.blocks.iter().any(|block| block == path)
        }

        fn open_exclusive(&self, path: &Path) -> io::Result<File> {
            self.opened.borrow_mut().push(path.to_path_buf());
            if self.busy.as_deref() == Some(path) {
                return Err(io::Error::from_raw_os_error(nix::libc::EBUSY));
            }
            File::open(path)
        }
    }

    #[test]
    fn block_devices_are_claimed_and_a_busy_one_is_refused_by_name() {
        // Goal: only emu: block devices are opened; EBUSY (mounted, swap, claimed) is
        // BlockDeviceInUse naming the spec; the others' claims are held until dropped.
        let directory = tempfile::tempdir().unwrap();
        let first = directory.path().join("first");
        let second = directory.path().join("second");
        let regular = directory.path().join("regular.img");
        for path in [&first, &second, &regular] {
            std::fs::write(path, b"x").unwrap();
        }
        let specs = [
            DeviceSpec::EmuFile(first.clone()),
            DeviceSpec::EmuFile(regular.clone()),
            DeviceSpec::EmuMemory(1 << 20),
            DeviceSpec::EmuFile(second.clone()),
        ];
        let free = FakeOpener { blocks: vec![first.clone(), second.clone()], busy: None, opened: RefCell::default() };
        let claims = BlockDeviceClaims::acquire(&specs, &free).unwrap();
        assert_eq!(claims.len(), 2);
        assert_eq!(*free.opened.borrow(), [first.clone(), second.clone()], "regular files and memory are not opened");
        assert!(claims.file(&specs[0]).is_some() && claims.file(&specs[1]).is_none());

        let busy = FakeOpener { blocks: vec![first.clone(), second.clone()], busy: Some(second.clone()), opened: RefCell::default() };
        let error = BlockDeviceClaims::acquire(&specs, &busy).unwrap_err();
        assert!(matches!(&error, DeviceError::BlockDeviceInUse { spec } if spec == &specs[3].to_string()), "{error}");
        assert!(error.to_string().contains("in use"), "{error}");
    }

    #[test]
    fn a_block_device_that_cannot_be_opened_is_an_error_with_its_name() {
        let directory = tempfile::tempdir().unwrap();
        let missing = directory.path().join("gone");
        let opener = FakeOpener { blocks: vec![missing.clone()], busy: None, opened: RefCell::default() };
        let error = BlockDeviceClaims::acquire(&[DeviceSpec::EmuFile(missing.clone())], &opener).unwrap_err().to_string();
        assert!(error.contains(&missing.display().to_string()) && error.contains("exclusively"), "{error}");
    }
}
