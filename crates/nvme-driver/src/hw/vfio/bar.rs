//! BAR0 mapped from the VFIO device fd: the controller's registers as volatile memory.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};

use super::error::VfioError;
use super::sysfs::PciAddress;
use crate::hw::RegisterIo;

/// A shared mapping of BAR0 (memmap2's `MmapRaw`: a mapping that is only ever a raw pointer,
/// never a slice, and is unmapped on drop). Holds the device fd so the mapping never outlives the
/// device it belongs to.
#[derive(Debug)]
pub struct MappedBar {
    /// Declared before `_device`: unmapped before the fd closes.
    mapping: MmapRaw,
    len: usize,
    _device: Arc<OwnedFd>,
}

impl MappedBar {
    /// Host virtual address of the mapping (for registering the doorbells with a GPU); valid
    /// while this value lives. Never dereferenced as a Rust reference.
    pub fn host_address(&self) -> usize {
        self.mapping.as_ptr() as usize
    }

    /// Maps `len` bytes of the region at `region_offset` of the device fd, shared, read/write.
    pub fn map(address: PciAddress, device: Arc<OwnedFd>, region_offset: u64, len: usize) -> Result<Self, VfioError> {
        let size_bytes = len as u64;
        // The kernel validates offset and length against the region; a BAR is never empty.
        if len == 0 || i64::try_from(region_offset).is_err() {
            return Err(VfioError::BarMmap { address, size_bytes, source: std::io::Error::from(std::io::ErrorKind::InvalidInput) });
        }
        let mapping = MmapOptions::new()
            .offset(region_offset)
            .len(len)
            .map_raw(device.as_raw_fd())
            .map_err(|source| VfioError::BarMmap { address, size_bytes, source })?;
        Ok(Self { mapping, len, _device: device })
    }

    /// The register's address if `offset..offset+width` lies inside the BAR and is naturally
    /// aligned; registers are never accessed across their natural boundary.
    fn register(&self, offset: usize, width: usize) -> Option<*mut u8> {
        let end = offset.checked_add(width)?;
        if end > self.len || !offset.is_multiple_of(width) {
            return None;
        }
        // `offset + width <= len` (checked): the pointer stays inside the mapping.
        Some(self.mapping.as_mut_ptr().wrapping_add(offset))
    }
}

impl RegisterIo for MappedBar {
    fn len(&self) -> usize {
        self.len
    }

    fn read32(&self, offset: usize) -> u32 {
        match self.register(offset, 4) {
            // SAFETY: in bounds and 4-byte aligned (checked by `register`); a volatile load of
            // exactly 32 bits, as the register requires.
            Some(pointer) => unsafe { pointer.cast::<u32>().read_volatile() },
            None => u32::MAX,
        }
    }

    fn write32(&self, offset: usize, value: u32) {
        if let Some(pointer) = self.register(offset, 4) {
            // SAFETY: in bounds and aligned (checked); a single 32-bit volatile store.
            unsafe { pointer.cast::<u32>().write_volatile(value) }
        }
    }

    /// Two 32-bit loads, low dword first, as Linux reads CAP (`lo_hi_readq`): every controller
    /// takes 32-bit accesses, while a 64-bit MMIO access is mishandled by some controllers and
    /// root complexes. CAP, the only 64-bit register the driver reads, does not change between
    /// the two halves.
    fn read64(&self, offset: usize) -> u64 {
        match self.register(offset, 8) {
            // SAFETY: `offset..offset+8` is in bounds and 8-byte aligned (checked), so both
            // halves are 4-byte aligned volatile loads inside the mapping.
            Some(pointer) => unsafe {
                let low = pointer.cast::<u32>().read_volatile();
                let high = pointer.add(4).cast::<u32>().read_volatile();
                u64::from(low) | u64::from(high) << 32
            },
            None => u64::MAX,
        }
    }

    /// Two 32-bit stores, low dword first, as Linux writes ASQ and ACQ (`lo_hi_writeq`), for the
    /// reason given at `read64`. Both are written while the controller is disabled (CC.EN = 0),
    /// so it never acts on a half-written address.
    fn write64(&self, offset: usize, value: u64) {
        if let Some(pointer) = self.register(offset, 8) {
            // SAFETY: `offset..offset+8` is in bounds and 8-byte aligned (checked), so both
            // halves are 4-byte aligned volatile stores inside the mapping.
            unsafe {
                pointer.cast::<u32>().write_volatile(value as u32);
                pointer.add(4).cast::<u32>().write_volatile((value >> 32) as u32);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_and_misaligned_accesses_read_all_ones() {
        // Goal: the bounds logic of BAR access, exercised on an ordinary file mapping (no VFIO
        // here): in-range accesses round-trip, others read as a vanished device and drop writes.
        let mut file = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut file, &[0u8; 8192]).unwrap();
        let fd = Arc::new(OwnedFd::from(file));
        let address = "0000:00:04.0".parse().unwrap();
        let bar = MappedBar::map(address, fd, 0, 8192).unwrap();
        bar.write32(0x14, 0x0046_0001);
        assert_eq!(bar.read32(0x14), 0x0046_0001);
        bar.write64(0x28, 0x1234_5678_9abc_def0);
        assert_eq!(bar.read64(0x28), 0x1234_5678_9abc_def0);
        assert_eq!(bar.read32(0x2C), 0x1234_5678, "64-bit registers are little endian");
        assert_eq!(bar.read32(8192), u32::MAX);
        assert_eq!(bar.read32(8190), u32::MAX);
        assert_eq!(bar.read64(8188), u64::MAX);
        assert_eq!(bar.read32(0x15), u32::MAX, "misaligned");
        assert_eq!(bar.read64(0x2C), u64::MAX, "misaligned");
        bar.write32(usize::MAX - 1, 7); // must neither wrap nor fault
        assert_eq!(bar.len(), 8192);
    }
}
