//! A client process's DMA window: a [`DmaAllocator`] over a shared-memory mapping that the daemon
//! registered in a device's DMA space at a fixed IOVA base.
//!
//! The client never talks to the IOMMU (or to the emulator's DMA table): the daemon mapped the
//! same memfd and told the client where it lives in the device's address space. So an IOVA here
//! is pure arithmetic — `iova_base + offset in the window` — and this allocator only keeps track
//! of which parts of the window are in use, so that the mapping table, the executors and the
//! queue pairs run unchanged in the client.

use std::sync::Arc;

use super::memory::{round_up, Backing, PoolShared, PAGE_SIZE_BYTES};
use super::shared::SharedMemory;
use super::{AddressSpaceId, DmaAllocator, DmaRegion, HwError, IdentityMapper};
use crate::types::Iova;

/// Carves page-aligned regions out of a shared mapping whose device address is `iova_base`.
///
/// Bounded: the window's size is all it can hand out; past that, [`DmaAllocator::allocate`]
/// fails with [`HwError::IovaExhausted`]. Freed regions merge with their free neighbours and are
/// reused best-fit (the pool's allocator, `PoolShared::reserve`).
#[derive(Clone)]
pub struct DmaWindow {
    shared: Arc<PoolShared>,
    memory: Arc<SharedMemory>,
    iova_base: Iova,
    address_space: AddressSpaceId,
}

impl std::fmt::Debug for DmaWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaWindow").field("iova_base", &self.iova_base).field("len", &self.memory.len()).finish()
    }
}

impl DmaWindow {
    /// A window over `memory`, which the device sees at `iova_base` (page aligned) in the
    /// address space `address_space` (the daemon's id for that device's DMA space).
    pub fn new(memory: Arc<SharedMemory>, iova_base: Iova, address_space: AddressSpaceId) -> Result<Self, HwError> {
        if !iova_base.0.is_multiple_of(PAGE_SIZE_BYTES as u64) {
            return Err(HwError::Misaligned { offset: 0, align: PAGE_SIZE_BYTES });
        }
        let limit = iova_base.checked_add_usize(memory.len()).ok_or(HwError::IovaExhausted { len: memory.len() })?;
        let shared = Arc::new(PoolShared::new(Arc::new(IdentityMapper), iova_base, limit));
        Ok(Self { shared, memory, iova_base, address_space })
    }

    pub fn iova_base(&self) -> Iova {
        self.iova_base
    }

    pub fn memory(&self) -> &Arc<SharedMemory> {
        &self.memory
    }

    /// The region for a reserved `iova..iova+len` of the window (given back if it does not fit).
    fn region_at(&self, iova: u64, len: usize) -> Result<DmaRegion, HwError> {
        let offset = iova.checked_sub(self.iova_base.0).and_then(|offset| usize::try_from(offset).ok());
        let Some(pointer) = offset.and_then(|offset| self.memory.pointer_at(offset, len)) else {
            self.shared.unreserve(iova, len as u64);
            return Err(HwError::IovaExhausted { len });
        };
        Ok(self.shared.insert(pointer, len, Iova(iova), Backing::Shared(Arc::clone(&self.memory))))
    }
}

impl DmaAllocator for DmaWindow {
    fn allocate(&self, len: usize) -> Result<DmaRegion, HwError> {
        if len == 0 {
            return Err(HwError::ZeroLength);
        }
        let rounded = round_up(len, PAGE_SIZE_BYTES).ok_or(HwError::IovaExhausted { len })?;
        let iova = self.shared.reserve(rounded as u64, PAGE_SIZE_BYTES as u64)?;
        let region = self.region_at(iova, rounded)?;
        // A reused range holds whatever its last user left: the contract is zeroed memory.
        region.fill(0, rounded, 0)?;
        Ok(region)
    }

    /// Accepts only page-aligned host ranges inside the window; their IOVA follows from their
    /// place in it. A range that overlaps an allocation or another mapping is refused
    /// ([`HwError::Overlap`]): two regions must never alias.
    unsafe fn map_external(&self, host: *mut u8, len: usize) -> Result<DmaRegion, HwError> {
        if len == 0 {
            return Err(HwError::ZeroLength);
        }
        if !(host as usize).is_multiple_of(PAGE_SIZE_BYTES) {
            return Err(HwError::Misaligned { offset: 0, align: PAGE_SIZE_BYTES });
        }
        let offset = self.memory.offset_of(host as usize, len).ok_or(HwError::OutsideWindow { host: host as usize, len })?;
        let iova = self.iova_base.0 + offset as u64;
        self.shared.reserve_exact(iova, len as u64)?;
        self.region_at(iova, len)
    }

    fn translate(&self, iova: Iova, len: usize) -> Result<DmaRegion, HwError> {
        self.shared.translate(iova, len)
    }

    fn address_space(&self) -> AddressSpaceId {
        self.address_space
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(pages: usize) -> DmaWindow {
        let memory = SharedMemory::create("window-test", pages * PAGE_SIZE_BYTES).unwrap();
        DmaWindow::new(memory, Iova(1 << 40), AddressSpaceId(7)).unwrap()
    }

    #[test]
    fn allocations_are_carved_from_the_window_and_bounded() {
        // Goal: regions are page aligned at base + offset, zeroed on reuse, and the window refuses
        // an allocation past its end with a typed error.
        let window = window(4);
        assert_eq!(window.address_space(), AddressSpaceId(7));
        let first = window.allocate(100).unwrap();
        assert_eq!((first.iova(), first.len()), (Iova(1 << 40), 4096));
        assert_eq!(first.host_address(), window.memory().pointer().as_ptr() as usize);
        let second = window.allocate(2 * 4096).unwrap();
        assert_eq!(second.iova(), Iova((1 << 40) + 4096));
        assert!(matches!(window.allocate(2 * 4096), Err(HwError::IovaExhausted { .. })));
        first.write(0, b"stale").unwrap();
        let first_iova = first.iova();
        drop(first);
        let reused = window.allocate(4096).unwrap();
        assert_eq!(reused.iova(), first_iova);
        let mut bytes = [1u8; 5];
        reused.read(0, &mut bytes).unwrap();
        assert_eq!(bytes, [0; 5], "a reused range is zeroed");
        let view = window.translate(Iova((1 << 40) + 4096 + 10), 20).unwrap();
        assert_eq!(view.host_address(), second.host_address() + 10);
        assert!(window.translate(Iova((1 << 40) + 3 * 4096), 1).is_err(), "the free page is not mapped");
    }

    #[test]
    fn external_mappings_must_lie_inside_the_window_and_not_overlap() {
        // Goal: map_external takes memory of the window at its fixed IOVA, refuses memory outside
        // it and ranges already handed out, and allocate then skips the mapped range.
        let window = window(4);
        let base = window.memory().pointer().as_ptr();
        let outside = crate::hw::HostMemory::allocate(4096, false).unwrap();
        let _keep = &outside;
        // SAFETY: the window's mapping lives as long as `window` (and the regions hold it).
        let mapped = unsafe { window.map_external(base.wrapping_add(2 * 4096), 4096) }.unwrap();
        assert_eq!(mapped.iova(), Iova((1 << 40) + 2 * 4096));
        // SAFETY: as above; these must all be refused.
        unsafe {
            assert!(matches!(window.map_external(base.wrapping_add(2 * 4096), 4096), Err(HwError::Overlap { .. })));
            assert!(matches!(window.map_external(base.wrapping_add(3 * 4096), 2 * 4096), Err(HwError::OutsideWindow { .. })));
            assert!(matches!(window.map_external(base.wrapping_add(100), 4096), Err(HwError::Misaligned { .. })));
        }
        let a = window.allocate(4096).unwrap();
        let b = window.allocate(4096).unwrap();
        let c = window.allocate(4096).unwrap();
        let iovas = [a.iova().0, b.iova().0, c.iova().0].map(|iova| iova - (1 << 40));
        assert_eq!(iovas, [0, 4096, 3 * 4096], "allocate never hands out the externally mapped page");
        assert!(window.allocate(4096).is_err());
    }
}
