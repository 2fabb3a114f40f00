//! Opens `--device` strings (parsed by tutti-devices) as devices under test.

use std::os::unix::fs::FileTypeExt;
use std::sync::Arc;

use anyhow::{Context, Result};
use nvme_conformance::{EmuFaults, FaultInjector};
use nvme_driver::DeviceBackend;
use nvme_emu::EmuConfig;
use tutti_devices::open::EmuOptions;
use tutti_devices::{open_in_one_space, DeviceKind, DeviceLocks, DeviceSpec};

/// What `--device` may name.
pub const DEVICE_KINDS: [DeviceKind; 3] = [DeviceKind::Vfio, DeviceKind::EmuMemory, DeviceKind::EmuFile];

/// A missing `emu:PATH` file is created this large (and a smaller one grown to it).
const EMU_FILE_BYTES: u64 = 256 << 20;

/// A device under test and, where it has one, its fault injector.
pub type DeviceUnderTest = (Arc<dyn DeviceBackend>, Option<Arc<dyn FaultInjector>>);

/// Why the suite would overwrite data `spec` may already hold, or None when it holds none: a
/// `vfio:` function (an SSD whose namespaces nothing here reads before writing: a stopped
/// tuttid's pool, a filesystem), an `emu:PATH` that is a block device (a whole disk: a blank
/// start proves nothing) or a regular file that is not empty. The checks write from LBA 0 on
/// (and across every namespace), so such a device is tested only when `--overwrite` says so. A
/// missing or empty file holds nothing; memory devices start blank. (tutti-profile's
/// `holds_prior_data` is stricter: any existing `emu:` file, an empty one too. tutti-devices'
/// `refuse_foreign_contents` lets a tutti pool through, which the suite would destroy.)
pub fn prior_data(spec: &DeviceSpec) -> Option<String> {
    let path = match spec {
        DeviceSpec::Vfio(_) => return Some("is an NVMe controller whose namespaces are written without being read first".into()),
        DeviceSpec::EmuFile(path) => path,
        _ => return None,
    };
    // Whatever cannot be examined (missing, not allowed) is left to the lock and the opening,
    // which report it.
    let metadata = std::fs::metadata(path).ok()?;
    if metadata.file_type().is_block_device() {
        Some("is a block device".into())
    } else if metadata.is_file() && metadata.len() > 0 {
        Some(format!("holds {} bytes", metadata.len()))
    } else {
        None
    }
}

/// Whether [`open`] gives `spec` a fault injector: only the software controller (`emu:`) has
/// one.
pub fn has_faults(spec: &DeviceSpec) -> bool {
    matches!(spec, DeviceSpec::EmuMemory(_) | DeviceSpec::EmuFile(_) | DeviceSpec::EmuNull(_))
}

/// `vfio:BDF`, `emu:mem:SIZE` or `emu:PATH`, in its own DMA space. An `emu:PATH` must be the
/// file `locks` holds at PATH: the software controller opens it by its path again, and one
/// renamed or copied over it since the lock (or put there after a missing one was skipped) is
/// another file, unlocked, which a live tuttid could hold: refused before anything is written.
pub fn open(spec: &DeviceSpec, locks: &DeviceLocks) -> Result<DeviceUnderTest> {
    let emu = EmuOptions { config: EmuConfig::default(), create_bytes: Some(EMU_FILE_BYTES) };
    let device = open_in_one_space(std::slice::from_ref(spec), &emu)?.into_iter().next().context("nothing was opened")?;
    locks.check_opened(spec, device.backing_file())?;
    let faults = device.emulator.map(|emulator| Arc::new(EmuFaults::new(emulator)) as Arc<dyn FaultInjector>);
    Ok((device.backend, faults))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_devices_open_with_faults_and_bad_strings_are_errors() {
        let spec = DeviceSpec::parse("emu:mem:16M", &DEVICE_KINDS).unwrap();
        let (_, faults) = open(&spec, &DeviceLocks::default()).unwrap();
        assert!(faults.is_some() && has_faults(&spec), "the software controller injects faults");
        assert!(DeviceSpec::parse("nvme:0", &DEVICE_KINDS).is_err());
        assert!(DeviceSpec::parse("uring:/dev/nvme0n1", &DEVICE_KINDS).is_err());
        assert!(DeviceSpec::parse("emu:mem:4q", &DEVICE_KINDS).is_err());
    }

    #[test]
    fn a_file_replaced_after_its_lock_is_refused_before_it_is_written() {
        // Goal: the suite locks an emu: file, then the software controller opens it by its path
        // again; a file renamed and copied over the path in between (another holder's pool,
        // say) was written with test patterns, unlocked. Refused, naming the path; the file
        // locked and left in place opens.
        let directory = std::env::temp_dir().join(format!("nvme-conformance-test-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let path = directory.join("p.img");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let spec = DeviceSpec::parse(&format!("emu:{}", path.display()), &DEVICE_KINDS).unwrap();
        let locks = DeviceLocks::acquire(std::slice::from_ref(&spec), &directory, false).unwrap();
        drop(open(&spec, &locks).expect("the file locked"));
        let moved = directory.join("moved.img");
        std::fs::rename(&path, &moved).unwrap();
        std::fs::copy(&moved, &path).unwrap();
        let error = open(&spec, &locks).err().expect("a file replaced after its lock was opened");
        let text = format!("{error:#}");
        drop(locks);
        std::fs::remove_dir_all(&directory).unwrap();
        assert!(text.contains(&path.display().to_string()) && text.contains("replaced"), "{text}");
    }
}
