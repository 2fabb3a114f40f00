//! The VFIO backend: one NVMe PCI function bound to vfio-pci, driven from user space with the
//! IOMMU on.
//!
//! Opening a device walks the legacy container/group interface:
//! 1. sysfs: the function exists, is bound to vfio-pci and has an IOMMU group;
//! 2. `/dev/vfio/vfio` (container) + `/dev/vfio/<group>`: viable group, type1v2 IOMMU;
//! 3. the device fd; PCI Command register: memory space on, bus mastering off. Bus mastering
//!    goes on only in [`DeviceBackend::enable_bus_master`], which the driver's bring-up calls
//!    once it saw this function's controller stop: the functions of one container share a DMA
//!    space and are brought up one at a time, so a function a crashed process left running
//!    must not DMA (through that process's queues, at IOVAs this process may hand out again)
//!    while another function's rings are mapped. (A controller that cannot master fails its
//!    first DMA with CSTS.CFS=1, so bring-up must have turned it on before CC.EN.)
//! 4. BAR0 mmapped for [`RegisterIo`];
//! 5. a [`DmaPool`] whose IOVAs come from the IOMMU's reported ranges and whose mappings are
//!    programmed with `VFIO_IOMMU_MAP_DMA`.
//!
//! Each fd closes with its last holder, and the kernel cleans up behind it, so a second run in
//! the same system starts clean: the device fd (held by the device and by every
//! `Arc<dyn RegisterIo>` from [`DeviceBackend::registers`]) resets the function as it closes;
//! the container and group fds (held by the device and by its [`DmaPool`]: every clone and every
//! `Arc<dyn DmaAllocator>` from [`DeviceBackend::dma`]) remove every IOMMU mapping as they
//! close. A DMA region holds only a weak reference to its pool, so it keeps neither open.
//!
//! Crates: the kernel's VFIO structs and constants are `vfio-bindings`' generated ones; ioctls,
//! `pread`/`pwrite` and `getrlimit` go through nix's typed wrappers (`sys.rs`; the ioctls are
//! generated with nix's ioctl macros); BAR0 is a memmap2 `MmapRaw` (a mapping that is only a raw
//! pointer, unmapped on drop); flag words are `bitflags` sets (`uapi.rs`). Not used:
//! `vfio-ioctls`, whose container/device types wrap vmm-sys-util's, which would sit beside this
//! module's own hardware seam rather than under it, and which has no BAR mapping; and nix's
//! `mmap`, since memmap2 gives the unmap-on-drop ownership without unsafe code here. Still written
//! by hand, because bindgen cannot produce them: the ioctl request numbers (C macros in vfio.h;
//! see `uapi.rs`).

mod bar;
mod error;
mod iommu;
mod sys;
mod sysfs;
mod uapi;

use std::ffi::CString;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;

pub use bar::MappedBar;
pub use error::VfioError;
pub use iommu::{choose_iova_window, parse_iommu_info, IommuInfo, VfioMapper, MSI_WINDOW_END_EXCLUSIVE, MSI_WINDOW_START};
pub use sysfs::{describe_blockers, PciAddress, PciSysfs, GROUP_COMPATIBLE_DRIVERS, VFIO_PCI_DRIVER};

use self::iommu::Container;
use self::uapi::*;
use super::{DeviceBackend, DmaAllocator, DmaPool, HwError, RegisterIo};
use crate::types::Iova;

/// How to open a device.
#[derive(Debug, Clone)]
pub struct VfioOptions {
    /// Where sysfs is mounted (tests use a fake tree; the kernel's device nodes are always
    /// under /dev/vfio).
    pub sysfs_root: PathBuf,
    /// Back DMA allocations of 2 MiB or more with 2 MiB hugepages when some are reserved
    /// (`vm.nr_hugepages` where 2 MiB is the default huge page size; see docs/vfio.md). Smaller
    /// ones always take 4 KiB pages: they would each take a whole huge page.
    pub prefer_huge_pages: bool,
}

impl Default for VfioOptions {
    fn default() -> Self {
        Self { sysfs_root: PathBuf::from("/sys"), prefer_huge_pages: true }
    }
}

/// An NVMe function opened through VFIO. Implements [`DeviceBackend`].
pub struct VfioDevice {
    address: PciAddress,
    /// Its IOMMU group (the container may hold others: see [`VfioDevice::open_many`]).
    group: u32,
    device: Arc<OwnedFd>,
    /// Keeps the container and its group fds open while the device is.
    _container: Arc<Container>,
    registers: Arc<MappedBar>,
    pool: Arc<DmaPool>,
    iommu: IommuInfo,
    iova_window: (Iova, Iova),
    config_offset: u64,
    reset_supported: bool,
}

impl std::fmt::Debug for VfioDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioDevice")
            .field("address", &self.address)
            .field("group", &self.group)
            .field("bar0_bytes", &self.registers.len())
            .field("iova_window", &self.iova_window)
            .finish()
    }
}

impl VfioDevice {
    /// Opens `address` (`0000:00:04.0`) with default options.
    pub fn open(address: &str) -> Result<Self, HwError> {
        Self::open_with(address.parse()?, &VfioOptions::default())
    }

    pub fn open_with(address: PciAddress, options: &VfioOptions) -> Result<Self, HwError> {
        let mut devices = Self::open_many(&[address], options)?;
        Ok(devices.pop().expect("one device per address"))
    }

    /// Opens several functions in one container, so they share one IOVA space and one
    /// [`DmaPool`]: memory allocated or mapped through any of them is reachable by all at the
    /// same IOVAs — what a pool striped across several SSDs needs (the engine's KV memory is
    /// registered once). Every group is attached before the IOMMU is queried, so the IOVA
    /// window avoids the reserved ranges of all of them.
    pub fn open_many(addresses: &[PciAddress], options: &VfioOptions) -> Result<Vec<Self>, HwError> {
        let Some(&first) = addresses.first() else { return Ok(Vec::new()) };
        for (index, address) in addresses.iter().enumerate() {
            if addresses[..index].contains(address) {
                return Err(VfioError::DuplicateDevice { address: *address }.into());
            }
        }
        let sysfs = PciSysfs::new(&options.sysfs_root);
        let mut groups = Vec::with_capacity(addresses.len());
        for &address in addresses {
            let group = check_sysfs(&sysfs, address)?;
            let group_path = PathBuf::from(format!("/dev/vfio/{group}"));
            if !group_path.exists() && PathBuf::from(format!("/dev/vfio/noiommu-{group}")).exists() {
                return Err(VfioError::NoIommuMode { address, group }.into());
            }
            groups.push((address, group, group_path));
        }
        let describe = |group: u32, address: PciAddress| {
            let sysfs = &sysfs;
            move || match sysfs.group_blockers(group, address) {
                Ok(blockers) if !blockers.is_empty() => describe_blockers(&blockers),
                Ok(_) => "none found in sysfs (a member may be mid-unbind; retry)".to_string(),
                Err(error) => format!("unknown ({error})"),
            }
        };
        let (_, first_group, first_path) = &groups[0];
        let container = Arc::new(Container::open(first_path, *first_group, describe(*first_group, first))?);
        for (address, group, path) in &groups[1..] {
            container.attach(path, *group, describe(*group, *address))?;
        }

        let iommu = container.info()?;
        if iommu.page_sizes != 0 && iommu.page_sizes & 0x1000 == 0 {
            return Err(VfioError::NoSmallPages { bitmap: iommu.page_sizes }.into());
        }
        let (base, limit) = choose_iova_window(&iommu.ranges).ok_or_else(|| VfioError::NoIovaWindow {
            ranges: iommu.ranges.iter().map(|(start, end)| format!("{start:#x}..={end:#x}")).collect::<Vec<_>>().join(", "),
        })?;
        let mapper = Arc::new(VfioMapper::new(Arc::clone(&container)));
        let pool = Arc::new(DmaPool::new(mapper, Iova(base), Iova(limit), options.prefer_huge_pages));

        let mut devices = Vec::with_capacity(groups.len());
        for (address, group, _) in groups {
            let group_fd = container.group_fd(group).expect("every group was attached above");
            let device = Arc::new(device_fd(&group_fd, address)?);

            let mut info = vfio_device_info { argsz: argsz::<vfio_device_info>(), ..vfio_device_info::default() };
            sys::device_info(&*device, &mut info).map_err(|source| VfioError::Ioctl {
                address,
                operation: "VFIO_DEVICE_GET_INFO",
                source,
            })?;
            let flags = DeviceFlags::from_bits_retain(info.flags);
            if !flags.contains(DeviceFlags::PCI) {
                return Err(VfioError::NotPci { address, flags: info.flags }.into());
            }

            let config = region_info(&device, address, VFIO_PCI_CONFIG_REGION_INDEX)?;
            // Registers only: no DMA until bring-up saw the controller stop (module docs, 3).
            set_command(&device, address, config.offset, BusMaster::Off)?;

            let bar0 = region_info(&device, address, VFIO_PCI_BAR0_REGION_INDEX)?;
            let bar_len = usize::try_from(bar0.size).ok().filter(|&len| len >= 0x1000);
            let (true, Some(bar_len)) = (RegionFlags::from_bits_retain(bar0.flags).contains(RegionFlags::MMAP), bar_len) else {
                return Err(VfioError::BarNotMappable { address, flags: bar0.flags, size_bytes: bar0.size }.into());
            };
            let registers = Arc::new(MappedBar::map(address, Arc::clone(&device), bar0.offset, bar_len)?);
            tracing::debug!(%address, group, base, limit, bar_len, devices = addresses.len(), "VFIO device open");
            devices.push(Self {
                address,
                group,
                device,
                _container: Arc::clone(&container),
                registers,
                pool: Arc::clone(&pool),
                iommu: iommu.clone(),
                iova_window: (Iova(base), Iova(limit)),
                config_offset: config.offset,
                reset_supported: flags.contains(DeviceFlags::RESET),
            });
        }
        Ok(devices)
    }

    /// Host virtual address and length of the BAR0 mapping, for registering the doorbells with
    /// another agent (`cuMemHostRegister` with IOMEMORY). Valid while this device lives.
    pub fn bar0_host_range(&self) -> (usize, usize) {
        (self.registers.host_address(), self.registers.len())
    }

    pub fn address(&self) -> PciAddress {
        self.address
    }

    /// The IOMMU group the device belongs to.
    pub fn iommu_group(&self) -> u32 {
        self.group
    }

    /// The IOVA window `[base, limit)` the DMA pool allocates from.
    pub fn iova_window(&self) -> (Iova, Iova) {
        self.iova_window
    }

    /// What the IOMMU reported (page sizes, ranges, mapping slots left at open time).
    pub fn iommu_info(&self) -> &IommuInfo {
        &self.iommu
    }

    /// Whether VFIO offers a function-level (or slot/bus) reset for this device.
    pub fn reset_supported(&self) -> bool {
        self.reset_supported
    }

    /// The DMA pool itself (for callers that want the concrete type).
    pub fn dma_pool(&self) -> Arc<DmaPool> {
        Arc::clone(&self.pool)
    }
}

impl DeviceBackend for VfioDevice {
    fn name(&self) -> String {
        format!("vfio:{}", self.address)
    }

    fn registers(&self) -> Arc<dyn RegisterIo> {
        Arc::clone(&self.registers) as Arc<dyn RegisterIo>
    }

    fn dma(&self) -> Arc<dyn DmaAllocator> {
        Arc::clone(&self.pool) as Arc<dyn DmaAllocator>
    }

    fn function_reset(&self) -> Result<(), HwError> {
        if !self.reset_supported {
            return Err(VfioError::ResetUnsupported { address: self.address }.into());
        }
        sys::device_reset(&*self.device).map_err(|source| VfioError::Ioctl {
            address: self.address,
            operation: "VFIO_DEVICE_RESET",
            source,
        })?;
        // The kernel restores the saved config space after the reset (bus mastering included,
        // or not, depending on the path): memory space on, bus mastering off, for the bring-up
        // that follows to turn on once it saw the controller stop.
        set_command(&self.device, self.address, self.config_offset, BusMaster::Off)?;
        Ok(())
    }

    fn enable_bus_master(&self) -> Result<(), HwError> {
        set_command(&self.device, self.address, self.config_offset, BusMaster::On)?;
        Ok(())
    }
}

/// Checks the function's sysfs state and returns its IOMMU group.
fn check_sysfs(sysfs: &PciSysfs, address: PciAddress) -> Result<u32, VfioError> {
    if !sysfs.exists(address) {
        return Err(VfioError::NoSuchDevice { address, sysfs: sysfs.root().to_path_buf() });
    }
    match sysfs.driver(address)? {
        Some(driver) if driver == VFIO_PCI_DRIVER => {}
        Some(driver) => return Err(VfioError::WrongDriver { address, driver }),
        None => return Err(VfioError::Unbound { address }),
    }
    sysfs.iommu_group(address)?.ok_or(VfioError::NoIommuGroup { address })
}

fn device_fd(group: &OwnedFd, address: PciAddress) -> Result<OwnedFd, VfioError> {
    // The address text is ASCII hex digits and separators: it never contains NUL.
    let name = CString::new(address.to_string()).map_err(|_| VfioError::BadAddress { text: address.to_string() })?;
    sys::group_device_fd(group, &name).map_err(|source| VfioError::Ioctl { address, operation: "VFIO_GROUP_GET_DEVICE_FD", source })
}

fn region_info(device: &OwnedFd, address: PciAddress, index: u32) -> Result<vfio_region_info, VfioError> {
    let mut info = vfio_region_info { argsz: argsz::<vfio_region_info>(), index, ..vfio_region_info::default() };
    sys::region_info(device, &mut info).map_err(|source| VfioError::Ioctl { address, operation: "VFIO_DEVICE_GET_REGION_INFO", source })?;
    Ok(info)
}

/// Bus Master Enable as [`set_command`] leaves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BusMaster {
    On,
    Off,
}

/// Sets Memory Space Enable in the PCI Command register, and sets or clears Bus Master Enable;
/// the other bits are kept. Read back to check.
fn set_command(device: &OwnedFd, address: PciAddress, config_offset: u64, bus_master: BusMaster) -> Result<(), VfioError> {
    let config_error_offset = |_| VfioError::Ioctl {
        address,
        operation: "PCI config access (Command register)",
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    };
    let at = config_offset.checked_add(PCI_COMMAND_OFFSET).ok_or(()).map_err(config_error_offset)?;
    let config_error = |source| VfioError::Ioctl { address, operation: "PCI config access (Command register)", source };
    let mut bytes = [0u8; 2];
    sys::pread_exact(device, &mut bytes, at).map_err(config_error)?;
    let mut command = PciCommand::from_bits_retain(u16::from_le_bytes(bytes)) | PciCommand::MEMORY;
    command.set(PciCommand::MASTER, bus_master == BusMaster::On);
    sys::pwrite_exact(device, &command.bits().to_le_bytes(), at).map_err(config_error)?;
    sys::pread_exact(device, &mut bytes, at).map_err(config_error)?;
    let value = u16::from_le_bytes(bytes);
    let read_back = PciCommand::from_bits_retain(value);
    if !read_back.contains(PciCommand::MEMORY) || read_back.contains(PciCommand::MASTER) != (bus_master == BusMaster::On) {
        return Err(VfioError::CommandNotSet { address, value, bus_master: bus_master == BusMaster::On });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::sysfs::tests::add_device;
    use super::*;

    #[test]
    fn sysfs_checks_name_the_fix() {
        // Goal: every sysfs state that prevents VFIO yields an error that says what to run.
        let temp = tempfile::tempdir().unwrap();
        let root = temp.path();
        add_device(root, "0000:00:04.0", "0x010802", Some("nvme"), Some(4));
        add_device(root, "0000:00:05.0", "0x010802", None, Some(5));
        add_device(root, "0000:00:06.0", "0x010802", Some("vfio-pci"), None);
        add_device(root, "0000:00:07.0", "0x010802", Some("vfio-pci"), Some(7));
        let sysfs = PciSysfs::new(root);
        let at = |text: &str| text.parse::<PciAddress>().unwrap();

        let wrong = check_sysfs(&sysfs, at("0000:00:04.0")).unwrap_err();
        assert!(matches!(wrong, VfioError::WrongDriver { ref driver, .. } if driver == "nvme"));
        assert!(wrong.to_string().contains("tutti bind 0000:00:04.0"), "{wrong}");
        let unbound = check_sysfs(&sysfs, at("0000:00:05.0")).unwrap_err();
        assert!(matches!(unbound, VfioError::Unbound { .. }));
        assert!(unbound.to_string().contains("tutti bind"));
        let no_group = check_sysfs(&sysfs, at("0000:00:06.0")).unwrap_err();
        assert!(no_group.to_string().contains("intel_iommu=on"), "{no_group}");
        let missing = check_sysfs(&sysfs, at("0000:00:08.0")).unwrap_err();
        assert!(matches!(missing, VfioError::NoSuchDevice { .. }));
        assert_eq!(check_sysfs(&sysfs, at("0000:00:07.0")).unwrap(), 7);
    }

    #[test]
    fn command_register_gains_memory_and_bus_master_and_keeps_other_bits() {
        // Goal: the read-modify-write of the PCI Command register, run against an ordinary
        // file standing in for the config region (VFIO exposes it through pread/pwrite too):
        // open sets memory space and clears bus mastering (a function left mastering by
        // whatever had it before included), bring-up sets bus mastering; other bits stay.
        let mut file = tempfile::tempfile().unwrap();
        // vfio-pci puts region N at N << 40; any offset exercises the same arithmetic.
        let config_offset = 0x1000u64;
        let mut image = vec![0u8; config_offset as usize + 64];
        image[config_offset as usize + 4] = 0x04; // Bus Master Enable left on
        image[config_offset as usize + 5] = 0x04; // INTx Disable (bit 10) already set
        std::io::Write::write_all(&mut file, &image).unwrap();
        let device = OwnedFd::from(file);
        let address = "0000:00:04.0".parse().unwrap();
        let command = || {
            let mut bytes = [0u8; 2];
            sys::pread_exact(&device, &mut bytes, config_offset + PCI_COMMAND_OFFSET).unwrap();
            u16::from_le_bytes(bytes)
        };
        set_command(&device, address, config_offset, BusMaster::Off).unwrap();
        assert_eq!(command(), 0x0402, "MEM added, MASTER cleared, INTx Disable kept");
        set_command(&device, address, config_offset, BusMaster::On).unwrap();
        assert_eq!(command(), 0x0406, "MEM + MASTER, INTx Disable kept");
        // A region that ends before the register is an error, not a panic.
        assert!(set_command(&device, address, 1 << 20, BusMaster::On).is_err());
    }

    #[test]
    fn open_reports_bad_addresses_and_missing_devices() {
        // Goal: the public entry point fails cleanly before touching /dev/vfio.
        assert!(matches!(VfioDevice::open("not-a-bdf"), Err(HwError::Vfio(VfioError::BadAddress { .. }))));
        let temp = tempfile::tempdir().unwrap();
        let options = VfioOptions { sysfs_root: temp.path().to_path_buf(), prefer_huge_pages: false };
        let result = VfioDevice::open_with("0000:00:04.0".parse().unwrap(), &options);
        assert!(matches!(result, Err(HwError::Vfio(VfioError::NoSuchDevice { .. }))));
    }
}
