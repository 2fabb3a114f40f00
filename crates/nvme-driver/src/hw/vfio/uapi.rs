//! The subset of the kernel's VFIO user ABI (`include/uapi/linux/vfio.h`) this backend uses,
//! written out by hand: ioctl numbers, flag bits and `#[repr(C)]` argument structs.
//!
//! Every VFIO ioctl is `_IO(VFIO_TYPE, VFIO_BASE + n)`: no size or direction bits are encoded,
//! the argument size travels in each struct's leading `argsz` field instead. That is why the
//! numbers below are simply `(';' << 8) | (100 + n)`.

/// `_IO(';', 100 + offset)`.
const fn vfio_io(offset: u8) -> libc::c_ulong {
    ((b';' as libc::c_ulong) << 8) | (100 + offset as libc::c_ulong)
}

// Container (`/dev/vfio/vfio`) ioctls.
pub const VFIO_GET_API_VERSION: libc::c_ulong = vfio_io(0);
pub const VFIO_CHECK_EXTENSION: libc::c_ulong = vfio_io(1);
pub const VFIO_SET_IOMMU: libc::c_ulong = vfio_io(2);
pub const VFIO_IOMMU_GET_INFO: libc::c_ulong = vfio_io(12);
pub const VFIO_IOMMU_MAP_DMA: libc::c_ulong = vfio_io(13);
pub const VFIO_IOMMU_UNMAP_DMA: libc::c_ulong = vfio_io(14);

// Group (`/dev/vfio/N`) ioctls.
pub const VFIO_GROUP_GET_STATUS: libc::c_ulong = vfio_io(3);
pub const VFIO_GROUP_SET_CONTAINER: libc::c_ulong = vfio_io(4);
pub const VFIO_GROUP_GET_DEVICE_FD: libc::c_ulong = vfio_io(6);

// Device fd ioctls.
pub const VFIO_DEVICE_GET_INFO: libc::c_ulong = vfio_io(7);
pub const VFIO_DEVICE_GET_REGION_INFO: libc::c_ulong = vfio_io(8);
pub const VFIO_DEVICE_RESET: libc::c_ulong = vfio_io(11);

/// The only API version the kernel has ever reported.
pub const VFIO_API_VERSION: libc::c_int = 0;
/// IOMMU model: type1 with v2 semantics (no partial unmaps of a mapping).
pub const VFIO_TYPE1V2_IOMMU: libc::c_ulong = 3;

/// `vfio_group_status.flags`: every device in the group is bound to vfio or to no driver.
pub const VFIO_GROUP_FLAGS_VIABLE: u32 = 1 << 0;

/// `vfio_device_info.flags`: the device supports `VFIO_DEVICE_RESET`.
pub const VFIO_DEVICE_FLAGS_RESET: u32 = 1 << 0;
/// `vfio_device_info.flags`: a PCI device (region indices follow the PCI layout).
pub const VFIO_DEVICE_FLAGS_PCI: u32 = 1 << 1;

/// PCI region indices.
pub const VFIO_PCI_BAR0_REGION_INDEX: u32 = 0;
pub const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;

/// `vfio_region_info.flags`: the region may be mmapped.
pub const VFIO_REGION_INFO_FLAG_MMAP: u32 = 1 << 2;

/// `vfio_iommu_type1_info.flags`: a capability chain follows (`cap_offset` valid).
pub const VFIO_IOMMU_INFO_CAPS: u32 = 1 << 1;
/// Capability id of the usable IOVA ranges.
pub const VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE: u16 = 1;
/// Capability id of the number of DMA mappings still available.
pub const VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL: u16 = 3;

pub const VFIO_DMA_MAP_FLAG_READ: u32 = 1 << 0;
pub const VFIO_DMA_MAP_FLAG_WRITE: u32 = 1 << 1;

/// PCI configuration space: the Command register and its enable bits (PCI Local Bus 3.0 §6.2.2).
pub const PCI_COMMAND_OFFSET: u64 = 0x04;
pub const PCI_COMMAND_MEMORY: u16 = 1 << 1;
pub const PCI_COMMAND_MASTER: u16 = 1 << 2;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct VfioGroupStatus {
    pub argsz: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct VfioDeviceInfo {
    pub argsz: u32,
    pub flags: u32,
    pub num_regions: u32,
    pub num_irqs: u32,
    pub cap_offset: u32,
    pub pad: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct VfioRegionInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub cap_offset: u32,
    pub size: u64,
    pub offset: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct VfioIommuType1Info {
    pub argsz: u32,
    pub flags: u32,
    pub iova_pgsizes: u64,
    pub cap_offset: u32,
    pub pad: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct VfioIommuType1DmaMap {
    pub argsz: u32,
    pub flags: u32,
    pub vaddr: u64,
    pub iova: u64,
    pub size: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct VfioIommuType1DmaUnmap {
    pub argsz: u32,
    pub flags: u32,
    pub iova: u64,
    pub size: u64,
}

/// Size of `vfio_info_cap_header` (id u16, version u16, next u32).
pub const CAP_HEADER_BYTES: usize = 8;
/// Size of one `vfio_iova_range` (start u64, end u64 inclusive).
pub const IOVA_RANGE_BYTES: usize = 16;

const _: () = assert!(std::mem::size_of::<VfioGroupStatus>() == 8);
const _: () = assert!(std::mem::size_of::<VfioDeviceInfo>() == 24);
const _: () = assert!(std::mem::size_of::<VfioRegionInfo>() == 32);
const _: () = assert!(std::mem::size_of::<VfioIommuType1Info>() == 24);
const _: () = assert!(std::mem::size_of::<VfioIommuType1DmaMap>() == 32);
const _: () = assert!(std::mem::size_of::<VfioIommuType1DmaUnmap>() == 24);

/// `argsz` for a fixed-size argument struct.
pub fn argsz<T>() -> u32 {
    // The structs above are at most 32 bytes; the cast cannot truncate.
    std::mem::size_of::<T>() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_header() {
        // Values as the kernel's _IO(';', 100 + n) macro expands them on x86_64.
        assert_eq!(VFIO_GET_API_VERSION, 0x3B64);
        assert_eq!(VFIO_SET_IOMMU, 0x3B66);
        assert_eq!(VFIO_GROUP_GET_DEVICE_FD, 0x3B6A);
        assert_eq!(VFIO_DEVICE_GET_REGION_INFO, 0x3B6C);
        assert_eq!(VFIO_DEVICE_RESET, 0x3B6F);
        assert_eq!(VFIO_IOMMU_GET_INFO, 0x3B70);
        assert_eq!(VFIO_IOMMU_MAP_DMA, 0x3B71);
        assert_eq!(VFIO_IOMMU_UNMAP_DMA, 0x3B72);
    }
}
