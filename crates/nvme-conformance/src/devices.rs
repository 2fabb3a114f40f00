//! Parses `--device` strings into devices.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use nvme_conformance::{EmuFaults, FaultInjector};
use nvme_driver::DeviceBackend;
use nvme_emu::{Backing, EmuConfig, EmuDevice};

/// Parses a size like `256M`, `1G`, `4096` (binary units).
fn parse_size_bytes(text: &str) -> Result<u64> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, suffix) = text.split_at(split);
    let value: u64 = digits.parse().with_context(|| format!("'{text}' is not a size (e.g. 256M, 1G)"))?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        other => bail!("unknown size suffix '{other}' in '{text}' (accepted: K, M, G)"),
    };
    value.checked_mul(1 << shift).with_context(|| format!("size '{text}' overflows"))
}

/// A device under test and, where it has one, its fault injector.
pub type DeviceUnderTest = (Arc<dyn DeviceBackend>, Option<Arc<dyn FaultInjector>>);

/// `vfio:BDF`, `emu:mem:SIZE` or `emu:PATH` (a file of at least 256 MiB is created if missing).
pub fn open(spec: &str) -> Result<DeviceUnderTest> {
    if let Some(address) = spec.strip_prefix("vfio:") {
        let device = nvme_driver::hw::vfio::VfioDevice::open(address)?;
        return Ok((Arc::new(device), None));
    }
    if let Some(rest) = spec.strip_prefix("emu:") {
        let backing = match rest.strip_prefix("mem:") {
            Some(size) => Backing::Memory { bytes: parse_size_bytes(size)? },
            None if rest.is_empty() => bail!("emu: needs a backing, e.g. emu:mem:256M or emu:/tmp/nvme.img"),
            None => Backing::File { path: PathBuf::from(rest), create_bytes: Some(256 << 20) },
        };
        let device = EmuDevice::start(EmuConfig::default().with_backing(backing))?;
        let faults: Arc<dyn FaultInjector> = Arc::new(EmuFaults::new(Arc::clone(&device)));
        return Ok((device, Some(faults)));
    }
    bail!("unknown device '{spec}' (accepted: vfio:DOMAIN:BUS:DEVICE.FUNCTION, emu:mem:SIZE, emu:PATH)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_bad_ones_are_errors() {
        assert_eq!(parse_size_bytes("256M").unwrap(), 256 << 20);
        assert_eq!(parse_size_bytes("4096").unwrap(), 4096);
        assert!(parse_size_bytes("4q").is_err());
        assert!(parse_size_bytes("").is_err());
        assert!(open("nvme:0").is_err());
    }
}
