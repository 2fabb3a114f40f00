//! Newtypes for the identifiers and addresses that cross the gio_uring API, so that an IOCB id, a
//! device index, an LBA and a device address cannot be confused with each other or with a count.

use core::fmt;

/// Index of an IOCB in its queue's pool, `0..depth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IocbId(pub u32);

/// Index of an NVMe device (a controller's namespace with its queue pairs) in the executor's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceIndex(pub u16);

/// A logical block address on a namespace, and a device-visible address (an IOVA through the
/// IOMMU, or a GPU/host address a device can DMA to): the driver's own newtypes, so values pass
/// between the layers without conversion and with the same checked arithmetic.
pub use nvme_driver::types::{Iova, Lba};

/// A model layer, for the per-layer offset rule of an IOCB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LayerIndex(pub u32);

/// How many SMs an issue may occupy (GPU executor); CPU executors read it as a worker budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmBudget(pub u32);

/// A range of device-visible memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IovaRange {
    pub start: Iova,
    pub len_bytes: u64,
}

impl IovaRange {
    pub fn new(start: Iova, len_bytes: u64) -> Self {
        Self { start, len_bytes }
    }

    /// One past the last byte, or `None` if the range wraps the address space.
    pub fn end(&self) -> Option<u64> {
        self.start.checked_end(self.len_bytes).map(|end| end.0)
    }

    /// Whether `[start, start + len_bytes)` lies inside this range.
    pub fn contains(&self, start: u64, len_bytes: u64) -> bool {
        match (start.checked_add(len_bytes), self.end()) {
            (Some(end), Some(self_end)) => start >= self.start.0 && end <= self_end,
            _ => false,
        }
    }
}

impl fmt::Display for IocbId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "iocb {}", self.0)
    }
}

impl fmt::Display for DeviceIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {}", self.0)
    }
}

impl fmt::Display for IovaRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{:#x}, +{:#x})", self.start.0, self.len_bytes)
    }
}

/// An opaque handle of something an issue must wait for before it starts: a CUDA event for the GPU
/// executor (its `CUevent` handle value), or a token a CPU executor understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventToken(pub u64);

/// What the I/O of a set of IOCBs waits on (the `event` of the paper's `get_iocb(n, event)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Dependency {
    /// Start as soon as issued.
    #[default]
    None,
    /// Start only after this event has fired.
    Event(EventToken),
}
