//! How host memory becomes visible to a device: the IOMMU mapper trait, and the mappers for a
//! device that translates IOVAs itself (the software controller, through the pool's table).

use super::HwError;
use crate::types::Iova;

/// Makes host memory visible to a device at a chosen IOVA (the IOMMU), and undoes it.
pub trait IommuMapper: Send + Sync {
    /// # Safety
    /// `host..host+len` must stay valid until `unmap(iova, len)` has returned.
    unsafe fn map(&self, host: *mut u8, len: usize, iova: Iova) -> Result<(), HwError>;
    fn unmap(&self, iova: Iova, len: usize) -> Result<(), HwError>;

    /// Whether the device translates IOVAs itself through the pool's table (the software
    /// controller), so that memory reached only by copies can be given an IOVA
    /// (`DmaAllocator::map_copied`). An IOMMU maps host pages, not copy functions: false.
    fn device_translates(&self) -> bool {
        false
    }
}

/// A mapper for devices that translate IOVAs themselves through `DmaPool::translate` (the
/// software controller). Nothing is programmed anywhere; the pool's table is the IOMMU.
#[derive(Debug, Default)]
pub struct IdentityMapper;

impl IommuMapper for IdentityMapper {
    unsafe fn map(&self, _host: *mut u8, _len: usize, _iova: Iova) -> Result<(), HwError> {
        Ok(())
    }
    fn unmap(&self, _iova: Iova, _len: usize) -> Result<(), HwError> {
        Ok(())
    }
    fn device_translates(&self) -> bool {
        true
    }
}

/// Called with each range an [`ObservedIdentityMapper`] maps, before the mapping takes effect.
pub type MapObserver = Box<dyn Fn(Iova, usize) + Send + Sync>;

/// An [`IdentityMapper`] that tells an observer about every mapping: a fake controller uses it
/// to record what state the controller was in when the driver made memory reachable to it (a
/// controller left enabled by an earlier process may DMA into anything mapped then).
pub struct ObservedIdentityMapper {
    pub(super) observer: MapObserver,
}

impl IommuMapper for ObservedIdentityMapper {
    unsafe fn map(&self, _host: *mut u8, len: usize, iova: Iova) -> Result<(), HwError> {
        (self.observer)(iova, len);
        Ok(())
    }
    fn unmap(&self, _iova: Iova, _len: usize) -> Result<(), HwError> {
        Ok(())
    }
    fn device_translates(&self) -> bool {
        true
    }
}
