//! VFIO failures, each worded with the fix an operator should apply.

use std::io;
use std::path::PathBuf;

use super::sysfs::PciAddress;

/// Why a PCI function could not be opened or driven through VFIO.
#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    #[error("'{text}' is not a PCI address: expected DDDD:BB:DD.F such as 0000:00:04.0")]
    BadAddress { text: String },
    #[error("{address} is listed twice: each function can be opened once")]
    DuplicateDevice { address: PciAddress },
    #[error("no PCI function {address} under {sysfs}: list NVMe functions with `tutti devices`")]
    NoSuchDevice { address: PciAddress, sysfs: PathBuf },
    #[error(
        "{address} has no IOMMU group: turn the IOMMU on (VT-d/AMD-Vi in firmware and \
         intel_iommu=on or amd_iommu=on on the kernel command line)"
    )]
    NoIommuGroup { address: PciAddress },
    #[error(
        "{address} is in IOMMU group {group} only in no-IOMMU mode; this driver needs a real \
         IOMMU (turn it on in firmware and boot with intel_iommu=on / amd_iommu=on)"
    )]
    NoIommuMode { address: PciAddress, group: u32 },
    #[error("{address} is bound to driver '{driver}', not vfio-pci: run `tutti bind {address}`")]
    WrongDriver { address: PciAddress, driver: String },
    #[error("{address} is bound to no driver: run `tutti bind {address}` (loads nothing itself: `modprobe vfio-pci` first)")]
    Unbound { address: PciAddress },
    #[error("{path} does not exist: load the VFIO modules (`modprobe vfio-pci`) and make sure /dev is a devtmpfs")]
    NoVfioNode { path: PathBuf },
    #[error(
        "permission denied opening {path}: run as root, or give your user the device node \
         (a udev rule or chown on /dev/vfio/N) and raise RLIMIT_MEMLOCK"
    )]
    Permission { path: PathBuf, source: io::Error },
    #[error("{path} is busy: another process (or another handle in this one) holds IOMMU group {group}")]
    GroupBusy { path: PathBuf, group: u32 },
    #[error(
        "IOMMU group {group} is not viable: every device in it must be bound to vfio-pci or to no \
         driver; others in the group: {others}. Run `tutti bind` for each, or move the SSD to a \
         slot with its own group"
    )]
    GroupNotViable { group: u32, others: String },
    #[error("the kernel reports VFIO API version {version}; this driver speaks version 0")]
    ApiVersion { version: i32 },
    #[error(
        "the VFIO container offers no type1v2 IOMMU: load vfio_iommu_type1 (`modprobe \
         vfio_iommu_type1`); no-IOMMU mode is not supported"
    )]
    NoType1v2,
    #[error("{operation} on {address} failed: {source}")]
    Ioctl { address: PciAddress, operation: &'static str, source: io::Error },
    #[error("{operation} failed: {source}")]
    Kernel { operation: &'static str, source: io::Error },
    #[error("opening {path} failed: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("{address} is not a PCI device as VFIO reports it (device flags {flags:#x})")]
    NotPci { address: PciAddress, flags: u32 },
    #[error("BAR0 of {address} cannot be memory-mapped (region flags {flags:#x}, {size_bytes} bytes)")]
    BarNotMappable { address: PciAddress, flags: u32, size_bytes: u64 },
    #[error("mmap of BAR0 of {address} ({size_bytes} bytes) failed: {source}")]
    BarMmap { address: PciAddress, size_bytes: u64, source: io::Error },
    #[error(
        "pinning {len_bytes} bytes for DMA exceeds the locked-memory limit ({limit}): raise \
         RLIMIT_MEMLOCK (`ulimit -l`, /etc/security/limits.conf) or run as root"
    )]
    MemlockLimit { len_bytes: usize, limit: String, source: io::Error },
    #[error(
        "the IOMMU has no DMA mapping slots left (vfio_iommu_type1.dma_entry_limit): map fewer, \
         larger regions"
    )]
    MappingSlotsExhausted { source: io::Error },
    #[error("VFIO_IOMMU_MAP_DMA of {len_bytes} bytes at {iova:#x} failed: {source}")]
    MapDma { iova: u64, len_bytes: usize, source: io::Error },
    #[error("VFIO_IOMMU_UNMAP_DMA of {len_bytes} bytes at {iova:#x} failed: {source}")]
    UnmapDma { iova: u64, len_bytes: usize, source: io::Error },
    #[error("VFIO_IOMMU_UNMAP_DMA at {iova:#x} removed {unmapped_bytes} bytes, expected {len_bytes}")]
    PartialUnmap { iova: u64, len_bytes: usize, unmapped_bytes: u64 },
    #[error("DMA length {len_bytes} is not a multiple of the 4 KiB IOMMU page")]
    UnalignedDmaLength { len_bytes: usize },
    #[error("no usable IOVA window in the ranges the IOMMU reports: {ranges}")]
    NoIovaWindow { ranges: String },
    #[error("the IOMMU does not map 4 KiB pages (page size bitmap {bitmap:#x})")]
    NoSmallPages { bitmap: u64 },
    #[error("malformed VFIO capability chain: {reason}")]
    BadCapabilityChain { reason: &'static str },
    #[error("function-level reset of {address} is not supported by the device or its slot")]
    ResetUnsupported { address: PciAddress },
    #[error("PCI command register of {address} reads {value:#06x} after enabling memory space and setting bus mastering to {bus_master}")]
    CommandNotSet { address: PciAddress, value: u16, bus_master: bool },
    #[error("reading {path}: {source}")]
    Sysfs { path: PathBuf, source: io::Error },
}

/// Classifies an `open()` failure on a VFIO device node.
pub fn open_error(path: PathBuf, group: u32, source: io::Error) -> VfioError {
    match source.raw_os_error() {
        Some(libc::ENOENT) => VfioError::NoVfioNode { path },
        Some(libc::EACCES) | Some(libc::EPERM) => VfioError::Permission { path, source },
        Some(libc::EBUSY) => VfioError::GroupBusy { path, group },
        _ => VfioError::Open { path, source },
    }
}

/// Classifies a `VFIO_IOMMU_MAP_DMA` failure. `memlock_limit_bytes` is the soft RLIMIT_MEMLOCK
/// (`None` = unlimited), reported so the operator sees the number to raise.
pub fn map_dma_error(source: io::Error, iova: u64, len_bytes: usize, memlock_limit_bytes: Option<u64>) -> VfioError {
    match source.raw_os_error() {
        // type1 charges pinned pages to locked_vm and answers ENOMEM past RLIMIT_MEMLOCK.
        Some(libc::ENOMEM) => {
            let limit = match memlock_limit_bytes {
                Some(bytes) => format!("{} KiB", bytes / 1024),
                None => "unlimited".to_string(),
            };
            VfioError::MemlockLimit { len_bytes, limit, source }
        }
        Some(libc::ENOSPC) => VfioError::MappingSlotsExhausted { source },
        _ => VfioError::MapDma { iova, len_bytes, source },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errno(code: i32) -> io::Error {
        io::Error::from_raw_os_error(code)
    }

    #[test]
    fn open_errors_name_the_fix() {
        // Goal: each errno from opening /dev/vfio/N maps to the variant whose message names a fix.
        let path = PathBuf::from("/dev/vfio/7");
        assert!(matches!(open_error(path.clone(), 7, errno(libc::ENOENT)), VfioError::NoVfioNode { .. }));
        assert!(matches!(open_error(path.clone(), 7, errno(libc::EACCES)), VfioError::Permission { .. }));
        assert!(matches!(open_error(path.clone(), 7, errno(libc::EPERM)), VfioError::Permission { .. }));
        let busy = open_error(path.clone(), 7, errno(libc::EBUSY));
        assert!(matches!(busy, VfioError::GroupBusy { group: 7, .. }));
        assert!(busy.to_string().contains("group 7"));
        assert!(matches!(open_error(path, 7, errno(libc::EIO)), VfioError::Open { .. }));
        assert!(open_error(PathBuf::from("/x"), 1, errno(libc::EACCES)).to_string().contains("run as root"));
    }

    #[test]
    fn map_errors_distinguish_memlock_from_slot_exhaustion() {
        // Goal: ENOMEM is the memlock limit (with the limit printed), ENOSPC the entry limit.
        let memlock = map_dma_error(errno(libc::ENOMEM), 0x10_0000, 1 << 21, Some(8 << 20));
        assert!(matches!(memlock, VfioError::MemlockLimit { len_bytes: 2097152, .. }));
        let text = memlock.to_string();
        assert!(text.contains("8192 KiB") && text.contains("RLIMIT_MEMLOCK"), "{text}");
        assert!(map_dma_error(errno(libc::ENOMEM), 0, 4096, None).to_string().contains("unlimited"));
        assert!(matches!(map_dma_error(errno(libc::ENOSPC), 0, 4096, None), VfioError::MappingSlotsExhausted { .. }));
        assert!(matches!(map_dma_error(errno(libc::EEXIST), 0x2000, 4096, None), VfioError::MapDma { iova: 0x2000, .. }));
    }
}
