//! Memory a device reaches only by copies: GPU memory a daemon imported from another process
//! (each access a CUDA copy of the imported pointer), or a test's stand-in for it.
//!
//! Host DMA memory ([`DmaRegion`]) has a host pointer: the IOMMU maps its pages, the software
//! controller copies with `memcpy`. Memory behind a [`CopiedMemory`] has none the host may
//! dereference: nothing can map it into an IOMMU through this seam, so only a device that
//! translates IOVAs in software (the software controller, whose DMA engine is a copy loop)
//! can reach it, by asking the memory itself to copy. [`DmaAllocator::map_copied`] gives such
//! memory an IOVA in a DMA space; [`DmaAllocator::translate_data`] resolves a data buffer's
//! IOVA to either kind ([`DataRegion`]), so the controller's data path has one shape for both
//! and is not special-cased for CUDA. Queue rings, PRP lists and SGL segments stay host memory
//! (`translate`): a command whose lists lie in copied memory is a Data Transfer Error.
//!
//! [`DmaAllocator::map_copied`]: super::DmaAllocator::map_copied
//! [`DmaAllocator::translate_data`]: super::DmaAllocator::translate_data

use std::sync::{Arc, Weak};

use super::memory::PoolShared;
use super::{DmaRegion, HwError};
use crate::types::Iova;

/// Memory reached only by copies. Implementations bound-check nothing themselves beyond their
/// own length: [`CopiedRegion`] checks every access against its window before calling them.
#[allow(clippy::len_without_is_empty)] // Never empty: mapping refuses a zero length.
pub trait CopiedMemory: Send + Sync {
    /// Bytes of the memory.
    fn len(&self) -> usize;
    /// Copies `destination.len()` bytes at `offset` out of the memory. Returns once the bytes
    /// are in `destination`.
    fn read(&self, offset: usize, destination: &mut [u8]) -> Result<(), HwError>;
    /// Copies `source` into the memory at `offset`. Returns only once the bytes have landed
    /// (a completion posted after it must not let anyone see older bytes).
    fn write(&self, offset: usize, source: &[u8]) -> Result<(), HwError>;
    /// For logs and errors, e.g. `CUDA IPC allocation of 64 MiB on GPU 0`.
    fn describe(&self) -> String;
}

pub(super) struct CopiedInner {
    pub(super) memory: Arc<dyn CopiedMemory>,
    pub(super) iova: Iova,
    pub(super) len: usize,
    pub(super) pool: Weak<PoolShared>,
}

impl Drop for CopiedInner {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.release_copied(self.iova, self.len);
        }
    }
}

/// A window onto memory reached by copies, with its device-visible address. Like a
/// [`DmaRegion`]: cloning shares it, every clone (and the translations a device made) keeps
/// the memory and its IOVA, and the IOVA goes back when the last one drops.
#[derive(Clone)]
pub struct CopiedRegion {
    pub(super) inner: Arc<CopiedInner>,
    pub(super) offset: usize,
    pub(super) len: usize,
    pub(super) iova: Iova,
}

impl std::fmt::Debug for CopiedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopiedRegion").field("iova", &self.iova).field("len", &self.len).finish()
    }
}

impl CopiedRegion {
    pub fn iova(&self) -> Iova {
        self.iova
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What the memory is (the [`CopiedMemory::describe`] of the whole mapping).
    pub fn describe(&self) -> String {
        self.inner.memory.describe()
    }

    fn check(&self, offset: usize, len: usize) -> Result<usize, HwError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.offset + offset),
            _ => Err(HwError::OutOfRange { offset, access_len: len, region_len: self.len }),
        }
    }

    /// A sub-window `offset..offset+len` of this region.
    pub fn subregion(&self, offset: usize, len: usize) -> Result<CopiedRegion, HwError> {
        let inner_offset = self.check(offset, len)?;
        let iova = self.iova.checked_add_usize(offset).ok_or(HwError::OutOfRange { offset, access_len: len, region_len: self.len })?;
        Ok(CopiedRegion { inner: Arc::clone(&self.inner), offset: inner_offset, len, iova })
    }

    /// Copies bytes at `offset` of this window into `destination` (the memory's own copy).
    pub fn read(&self, offset: usize, destination: &mut [u8]) -> Result<(), HwError> {
        let at = self.check(offset, destination.len())?;
        self.inner.memory.read(at, destination)
    }

    /// Copies `source` into this window at `offset`; returns once the bytes landed.
    pub fn write(&self, offset: usize, source: &[u8]) -> Result<(), HwError> {
        let at = self.check(offset, source.len())?;
        self.inner.memory.write(at, source)
    }
}

/// Where one piece of a device's data transfer lies: host DMA memory (copied with `memcpy` by
/// the software controller, mapped by the IOMMU for hardware), or memory reached by copies.
#[derive(Debug, Clone)]
pub enum DataRegion {
    Host(DmaRegion),
    Copied(CopiedRegion),
}

impl DataRegion {
    pub fn iova(&self) -> Iova {
        match self {
            DataRegion::Host(region) => region.iova(),
            DataRegion::Copied(region) => region.iova(),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            DataRegion::Host(region) => region.len(),
            DataRegion::Copied(region) => region.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies out of the region (see [`DmaRegion::read`] for the host kind's hazard).
    pub fn read(&self, offset: usize, destination: &mut [u8]) -> Result<(), HwError> {
        match self {
            DataRegion::Host(region) => region.read(offset, destination),
            DataRegion::Copied(region) => region.read(offset, destination),
        }
    }

    /// Copies into the region (see [`DmaRegion::write`] for the host kind's hazard).
    pub fn write(&self, offset: usize, source: &[u8]) -> Result<(), HwError> {
        match self {
            DataRegion::Host(region) => region.write(offset, source),
            DataRegion::Copied(region) => region.write(offset, source),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::hw::{DmaAllocator, DmaPool, IommuMapper};

    /// Memory in a `Vec`, reached only through `read` / `write`.
    struct VecMemory(Mutex<Vec<u8>>);

    impl CopiedMemory for VecMemory {
        fn len(&self) -> usize {
            self.0.lock().unwrap().len()
        }
        fn read(&self, offset: usize, destination: &mut [u8]) -> Result<(), HwError> {
            destination.copy_from_slice(&self.0.lock().unwrap()[offset..offset + destination.len()]);
            Ok(())
        }
        fn write(&self, offset: usize, source: &[u8]) -> Result<(), HwError> {
            self.0.lock().unwrap()[offset..offset + source.len()].copy_from_slice(source);
            Ok(())
        }
        fn describe(&self) -> String {
            "a test vector".into()
        }
    }

    #[test]
    fn copied_memory_translates_as_data_only_and_gives_its_iova_back() {
        // Goal: memory mapped by copies gets an IOVA of its own, `translate_data` finds it (any
        // sub-range, bounds checked), `translate` (rings, lists) does not, and dropping the
        // last holder frees the IOVA.
        let pool = DmaPool::identity();
        let host = pool.allocate(4096).unwrap();
        let copied = pool.map_copied(Arc::new(VecMemory(Mutex::new(vec![0; 3 * 4096])))).unwrap();
        assert_eq!(copied.len(), 3 * 4096);
        assert_eq!(copied.iova().0 % 4096, 0);
        let at = copied.iova().checked_add(4096 + 10).unwrap();
        let DataRegion::Copied(view) = pool.translate_data(at, 100).unwrap() else { panic!("a host region for copied memory") };
        view.write(0, b"through the copies").unwrap();
        let mut out = [0u8; 18];
        copied.read(4096 + 10, &mut out).unwrap();
        assert_eq!(&out, b"through the copies");
        assert!(matches!(pool.translate_data(host.iova(), 4096).unwrap(), DataRegion::Host(_)));
        assert!(pool.translate(at, 100).is_err(), "copied memory must never serve as a ring or a list");
        assert!(pool.translate_data(copied.iova().checked_add(3 * 4096 - 10).unwrap(), 11).is_err());
        assert!(matches!(view.read(90, &mut [0u8; 11]), Err(HwError::OutOfRange { .. })));
        assert!(matches!(copied.subregion(3 * 4096, 1), Err(HwError::OutOfRange { .. })));
        let iova = copied.iova();
        drop((copied, view));
        assert!(pool.translate_data(iova, 1).is_err(), "a dropped copied mapping must not translate");
        let again = pool.map_copied(Arc::new(VecMemory(Mutex::new(vec![0; 3 * 4096])))).unwrap();
        assert_eq!(again.iova(), iova, "its IOVA range is reused");
    }

    struct HardwareMapper;

    impl IommuMapper for HardwareMapper {
        unsafe fn map(&self, _host: *mut u8, _len: usize, _iova: Iova) -> Result<(), HwError> {
            Ok(())
        }
        fn unmap(&self, _iova: Iova, _len: usize) -> Result<(), HwError> {
            Ok(())
        }
    }

    #[test]
    fn an_iommu_pool_refuses_copied_memory() {
        // Goal: a pool programmed through an IOMMU (VFIO) cannot give copied memory an IOVA: the
        // device would DMA to an address nothing backs.
        let pool = DmaPool::new(Arc::new(HardwareMapper), Iova(1 << 32), Iova(1 << 40), false);
        let refused = pool.map_copied(Arc::new(VecMemory(Mutex::new(vec![0; 4096]))));
        assert!(matches!(refused, Err(HwError::CopiedUnsupported { .. })), "{refused:?}");
        assert!(matches!(DmaPool::identity().map_copied(Arc::new(VecMemory(Mutex::new(Vec::new())))), Err(HwError::ZeroLength)));
    }
}
