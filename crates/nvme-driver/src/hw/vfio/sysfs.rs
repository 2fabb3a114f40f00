//! PCI addresses and the sysfs facts VFIO needs: driver binding and IOMMU group membership.
//!
//! Every path is built under a configurable root so tests (and `tutti --sysfs-root`) can run
//! against a fake tree. Sysfs content is untrusted text: malformed entries are errors or are
//! skipped, never panics.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use super::error::VfioError;

/// A PCI function address, `domain:bus:device.function` (e.g. `0000:00:04.0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    pub domain: u16,
    pub bus: u8,
    /// 0..=31
    pub device: u8,
    /// 0..=7
    pub function: u8,
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:02x}:{:02x}.{:x}", self.domain, self.bus, self.device, self.function)
    }
}

impl FromStr for PciAddress {
    type Err = VfioError;

    /// Accepts `DDDD:BB:DD.F` and the short `BB:DD.F` (domain 0), hexadecimal, any case.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || VfioError::BadAddress { text: text.to_string() };
        let (head, function) = text.rsplit_once('.').ok_or_else(bad)?;
        let parts: Vec<&str> = head.split(':').collect();
        let (domain, bus, device) = match parts.as_slice() {
            [domain, bus, device] => (*domain, *bus, *device),
            [bus, device] => ("0", *bus, *device),
            _ => return Err(bad()),
        };
        let field = |value: &str, digits_max: usize| -> Result<u32, VfioError> {
            if value.is_empty() || value.len() > digits_max || !value.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad());
            }
            u32::from_str_radix(value, 16).map_err(|_| bad())
        };
        let domain = field(domain, 4)?;
        let bus = field(bus, 2)?;
        let device = field(device, 2)?;
        let function = field(function, 1)?;
        if device > 31 || function > 7 {
            return Err(bad());
        }
        // The digit limits above bound every value to its field width.
        Ok(Self { domain: domain as u16, bus: bus as u8, device: device as u8, function: function as u8 })
    }
}

/// The driver vfio-pci registers under.
pub const VFIO_PCI_DRIVER: &str = "vfio-pci";

/// Drivers that may share an IOMMU group with a VFIO device without making it non-viable: they
/// declare `driver_managed_dma` (bridges, the PCI stub) or are VFIO itself.
pub const GROUP_COMPATIBLE_DRIVERS: &[&str] = &[VFIO_PCI_DRIVER, "pci-stub", "pcieport"];

/// A view of `<root>/bus/pci` and `<root>/kernel/iommu_groups` (root is normally `/sys`).
#[derive(Debug, Clone)]
pub struct PciSysfs {
    root: PathBuf,
}

impl Default for PciSysfs {
    fn default() -> Self {
        Self::new("/sys")
    }
}

impl PciSysfs {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/bus/pci/devices/<address>`.
    pub fn device_dir(&self, address: PciAddress) -> PathBuf {
        self.root.join("bus/pci/devices").join(address.to_string())
    }

    /// Every PCI function present, sorted; entries whose names are not PCI addresses are skipped.
    pub fn devices(&self) -> Result<Vec<PciAddress>, VfioError> {
        let dir = self.root.join("bus/pci/devices");
        let entries = std::fs::read_dir(&dir).map_err(|source| VfioError::Sysfs { path: dir.clone(), source })?;
        let mut addresses: Vec<PciAddress> = entries
            .filter_map(|entry| entry.ok())
            .filter_map(|entry| entry.file_name().to_str().and_then(|name| name.parse().ok()))
            .collect();
        addresses.sort();
        Ok(addresses)
    }

    pub fn exists(&self, address: PciAddress) -> bool {
        self.device_dir(address).is_dir()
    }

    /// Reads a small attribute file of the device, trimmed (`class`, `vendor`, `device`...).
    pub fn attribute(&self, address: PciAddress, name: &str) -> Result<String, VfioError> {
        let path = self.device_dir(address).join(name);
        std::fs::read_to_string(&path).map(|text| text.trim().to_string()).map_err(|source| VfioError::Sysfs { path, source })
    }

    /// A hexadecimal attribute such as `class` (`0x010802`).
    pub fn hex_attribute(&self, address: PciAddress, name: &str) -> Result<u32, VfioError> {
        let text = self.attribute(address, name)?;
        let digits = text.strip_prefix("0x").unwrap_or(&text);
        u32::from_str_radix(digits, 16).map_err(|_| VfioError::Sysfs {
            path: self.device_dir(address).join(name),
            source: io::Error::new(io::ErrorKind::InvalidData, format!("not a hexadecimal number: {text:?}")),
        })
    }

    /// The name of the driver bound to the function, or `None` when unbound.
    pub fn driver(&self, address: PciAddress) -> Result<Option<String>, VfioError> {
        link_name(&self.device_dir(address).join("driver"))
    }

    /// The IOMMU group number, or `None` when the function has no group (IOMMU off).
    pub fn iommu_group(&self, address: PciAddress) -> Result<Option<u32>, VfioError> {
        let path = self.device_dir(address).join("iommu_group");
        let Some(name) = link_name(&path)? else {
            return Ok(None);
        };
        name.parse().map(Some).map_err(|_| VfioError::Sysfs {
            path,
            source: io::Error::new(io::ErrorKind::InvalidData, format!("IOMMU group link ends in {name:?}")),
        })
    }

    /// The functions in an IOMMU group with their drivers, sorted by address.
    pub fn group_members(&self, group: u32) -> Result<Vec<(PciAddress, Option<String>)>, VfioError> {
        let dir = self.root.join("kernel/iommu_groups").join(group.to_string()).join("devices");
        let entries = std::fs::read_dir(&dir).map_err(|source| VfioError::Sysfs { path: dir.clone(), source })?;
        let mut members = Vec::new();
        for entry in entries.filter_map(|entry| entry.ok()) {
            let Some(address) = entry.file_name().to_str().and_then(|name| name.parse::<PciAddress>().ok()) else {
                continue;
            };
            members.push((address, self.driver(address)?));
        }
        members.sort();
        Ok(members)
    }

    /// Members of `group` other than `address` whose drivers make the group non-viable for VFIO.
    pub fn group_blockers(&self, group: u32, address: PciAddress) -> Result<Vec<(PciAddress, String)>, VfioError> {
        Ok(self
            .group_members(group)?
            .into_iter()
            .filter(|(member, _)| *member != address)
            .filter_map(|(member, driver)| driver.map(|driver| (member, driver)))
            .filter(|(_, driver)| !GROUP_COMPATIBLE_DRIVERS.contains(&driver.as_str()))
            .collect())
    }
}

/// The last path component a symlink points to, `None` if the link does not exist.
fn link_name(path: &Path) -> Result<Option<String>, VfioError> {
    match std::fs::read_link(path) {
        Ok(target) => Ok(target.file_name().and_then(|name| name.to_str()).map(str::to_string)),
        Err(source) if source.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(VfioError::Sysfs { path: path.to_path_buf(), source }),
    }
}

/// Describes group blockers for an error message: `0000:00:1f.2 (ahci), ...`.
pub fn describe_blockers(blockers: &[(PciAddress, String)]) -> String {
    blockers.iter().map(|(address, driver)| format!("{address} ({driver})")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// Builds a minimal fake sysfs: a PCI function with an optional driver and IOMMU group.
    pub(crate) fn add_device(root: &Path, address: &str, class: &str, driver: Option<&str>, group: Option<u32>) {
        let devices = root.join("bus/pci/devices");
        std::fs::create_dir_all(&devices).unwrap();
        // Real sysfs has the function under /sys/devices/... and a link in bus/pci/devices; a
        // directory is enough for everything read here.
        let dir = devices.join(address);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("class"), format!("{class}\n")).unwrap();
        std::fs::write(dir.join("vendor"), "0x1b36\n").unwrap();
        std::fs::write(dir.join("device"), "0x0010\n").unwrap();
        if let Some(driver) = driver {
            let driver_dir = root.join("bus/pci/drivers").join(driver);
            std::fs::create_dir_all(&driver_dir).unwrap();
            symlink(&driver_dir, dir.join("driver")).unwrap();
        }
        if let Some(group) = group {
            let group_dir = root.join("kernel/iommu_groups").join(group.to_string());
            std::fs::create_dir_all(group_dir.join("devices")).unwrap();
            symlink(&group_dir, dir.join("iommu_group")).unwrap();
            symlink(&dir, group_dir.join("devices").join(address)).unwrap();
        }
    }

    #[test]
    fn addresses_parse_strictly() {
        // Goal: accept the kernel's spelling and the short form; reject anything that could
        // escape a sysfs path or overflow a field.
        let address: PciAddress = "0000:00:04.0".parse().unwrap();
        assert_eq!(address, PciAddress { domain: 0, bus: 0, device: 4, function: 0 });
        assert_eq!(address.to_string(), "0000:00:04.0");
        assert_eq!("3A:1f.7".parse::<PciAddress>().unwrap().to_string(), "0000:3a:1f.7");
        assert_eq!("abcd:ff:00.1".parse::<PciAddress>().unwrap().domain, 0xabcd);
        for bad in [
            "",
            "00:04",
            "0000:00:20.0",
            "0000:00:04.8",
            "../../etc:00.0",
            "00000:00:04.0",
            "0000:00:04.0/x",
            "+0:00:04.0",
            "0000:000:04.0",
        ] {
            assert!(bad.parse::<PciAddress>().is_err(), "{bad:?} must not parse");
        }
    }

    #[test]
    fn driver_group_and_blockers_come_from_the_tree() {
        // Goal: read binding and group membership, and find which group members block VFIO.
        let temp = tempfile::tempdir().unwrap();
        let root = temp.path();
        add_device(root, "0000:00:04.0", "0x010802", Some("nvme"), Some(3));
        add_device(root, "0000:00:04.1", "0x0c0330", Some("xhci_hcd"), Some(3));
        add_device(root, "0000:00:03.0", "0x060400", Some("pcieport"), Some(3));
        add_device(root, "0000:00:05.0", "0x010802", None, None);
        std::fs::create_dir_all(root.join("bus/pci/devices/not-an-address")).unwrap();
        let sysfs = PciSysfs::new(root);
        let nvme: PciAddress = "0000:00:04.0".parse().unwrap();
        let bare: PciAddress = "0000:00:05.0".parse().unwrap();
        assert_eq!(sysfs.devices().unwrap().len(), 4);
        assert_eq!(sysfs.driver(nvme).unwrap().as_deref(), Some("nvme"));
        assert_eq!(sysfs.driver(bare).unwrap(), None);
        assert_eq!(sysfs.iommu_group(nvme).unwrap(), Some(3));
        assert_eq!(sysfs.iommu_group(bare).unwrap(), None);
        assert_eq!(sysfs.hex_attribute(nvme, "class").unwrap(), 0x010802);
        let blockers = sysfs.group_blockers(3, nvme).unwrap();
        assert_eq!(blockers.len(), 1, "pcieport is compatible, xhci is not: {blockers:?}");
        assert_eq!(describe_blockers(&blockers), "0000:00:04.1 (xhci_hcd)");
        assert!(sysfs.group_members(99).is_err());
    }

    #[test]
    fn malformed_attributes_are_errors() {
        // Goal: garbage in sysfs yields an error, not a panic or a wrong number.
        let temp = tempfile::tempdir().unwrap();
        add_device(temp.path(), "0000:00:04.0", "zz-not-hex", None, None);
        let sysfs = PciSysfs::new(temp.path());
        let address = "0000:00:04.0".parse().unwrap();
        assert!(sysfs.hex_attribute(address, "class").is_err());
        assert!(sysfs.attribute(address, "missing").is_err());
        let group_dir = temp.path().join("kernel/iommu_groups/abc");
        std::fs::create_dir_all(&group_dir).unwrap();
        symlink(&group_dir, sysfs.device_dir(address).join("iommu_group")).unwrap();
        assert!(sysfs.iommu_group(address).is_err());
    }
}
