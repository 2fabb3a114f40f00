//! Per-queue access limits (tuttid): the host that created an I/O submission queue for a client
//! process restricts it to that client's memory and LBA ranges, so a client that writes its own
//! SQ entries cannot make the controller read or write another client's memory or blocks.
//!
//! Every address a command makes the controller touch is checked: the data ranges, each PRP
//! list page and each SGL segment (through `HostAccess`, the only way `data_pointer` reaches
//! host memory), and every LBA range (Read, Write, Write Zeroes, each Dataset Management
//! range). A refused command completes with an error status before any data moves.
//!
//! A restriction is set before the queue exists ([`crate::EmuDevice::preset_restriction`],
//! keyed by the SQ's ring address) and applied by the Create I/O SQ that places the queue there,
//! in the same step that makes the queue live: with a shared register page any client can ring
//! any doorbell, so a queue restricted only after its creation would run whatever a client
//! rang in between unrestricted.
//!
//! Statuses. Memory outside the queue's ranges gets Data Transfer Error (generic 04h): on real
//! hardware the IOMMU blocks such a DMA and the controller reports exactly that, so a host sees
//! the same status from the emulator as from an SSD behind VFIO. LBAs outside the queue's ranges
//! get Access Denied (media and data integrity 86h), whose spec meaning is "access to the
//! namespace and/or LBA range is denied due to lack of access rights"; LBA Out of Range would
//! wrongly tell the host the namespace is smaller than Identify says.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use nvme_driver::hw::{DataRegion, DmaAllocator, DmaPool, DmaRegion};
use nvme_driver::spec::status::codes;
use nvme_driver::spec::NvmeStatus;
use nvme_driver::Iova;

/// What one I/O submission queue may reach. Ranges are half-open; overlapping or adjacent
/// memory ranges are merged, so a transfer crossing from one into the next is allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueRestriction {
    /// Merged, sorted (start, end) IOVA ranges.
    memory: Vec<(u64, u64)>,
    /// Per namespace id, the LBA range (start, end) allowed; a namespace not listed is refused.
    blocks: BTreeMap<u32, (u64, u64)>,
}

impl QueueRestriction {
    /// A restriction allowing nothing; add ranges with the builders.
    pub fn new() -> Self {
        Self::default()
    }

    /// Allows `start..start+len` of IOVA space (an overflowing range is clamped to the end of it).
    pub fn allow_memory(mut self, start: Iova, len: u64) -> Self {
        if len == 0 {
            return self;
        }
        self.memory.push((start.0, start.0.saturating_add(len)));
        self.memory.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.memory.len());
        for (start, end) in self.memory.drain(..) {
            match merged.last_mut() {
                Some((_, last_end)) if start <= *last_end => *last_end = (*last_end).max(end),
                _ => merged.push((start, end)),
            }
        }
        self.memory = merged;
        self
    }

    /// Allows blocks `first_lba..first_lba+blocks` of namespace `nsid` (replacing an earlier range
    /// for it).
    pub fn allow_blocks(mut self, nsid: u32, first_lba: u64, blocks: u64) -> Self {
        self.blocks.insert(nsid, (first_lba, first_lba.saturating_add(blocks)));
        self
    }

    pub(crate) fn allows_memory(&self, iova: u64, len: u64) -> bool {
        let Some(end) = iova.checked_add(len) else { return false };
        // The last range starting at or before `iova` is the only one that can contain it.
        let index = self.memory.partition_point(|&(start, _)| start <= iova);
        index > 0 && end <= self.memory[index - 1].1
    }

    pub(crate) fn allows_blocks(&self, nsid: u32, start_lba: u64, blocks: u64) -> bool {
        let Some(end) = start_lba.checked_add(blocks) else { return false };
        self.blocks.get(&nsid).is_some_and(|&(first, limit)| first <= start_lba && end <= limit)
    }
}

/// Restrictions set for I/O SQs not created yet, each keyed by the IOVA of the ring its queue
/// will have (tuttid knows a client's ring address before the driver picks the queue id). The
/// first Create I/O SQ with that ring takes it, whether or not the creation succeeds, so a
/// preset never outlives the one creation it was meant for; the host removes one that no
/// Create I/O SQ took (`RestrictionPreset`'s drop). Bounded by the presets the host holds at
/// once (tuttid: one per attach in progress).
#[derive(Default)]
pub(crate) struct PendingRestrictions {
    pending: Vec<PendingRestriction>,
    next_token: u64,
}

struct PendingRestriction {
    token: u64,
    ring_iova: u64,
    restriction: Arc<QueueRestriction>,
    /// Set to the queue id by the Create I/O SQ that created a queue with it.
    applied_to: Arc<OnceLock<u16>>,
}

/// What a Create I/O SQ took from [`PendingRestrictions`]: the restriction, and where to record
/// the queue it was applied to.
pub(crate) struct TakenRestriction {
    pub restriction: Arc<QueueRestriction>,
    pub applied_to: Arc<OnceLock<u16>>,
}

impl PendingRestrictions {
    /// Adds a preset for the SQ whose ring will be at `ring_iova`: its token (to remove it) and
    /// the cell its queue id is recorded in; `None` when one is pending for that ring already.
    pub(crate) fn add(&mut self, ring_iova: u64, restriction: QueueRestriction) -> Option<(u64, Arc<OnceLock<u16>>)> {
        if self.pending.iter().any(|pending| pending.ring_iova == ring_iova) {
            return None;
        }
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1);
        let applied_to = Arc::new(OnceLock::new());
        self.pending.push(PendingRestriction { token, ring_iova, restriction: Arc::new(restriction), applied_to: Arc::clone(&applied_to) });
        Some((token, applied_to))
    }

    /// Takes the preset for a queue being created with its ring at `ring_iova`, if any.
    pub(crate) fn take(&mut self, ring_iova: u64) -> Option<TakenRestriction> {
        let index = self.pending.iter().position(|pending| pending.ring_iova == ring_iova)?;
        let pending = self.pending.swap_remove(index);
        Some(TakenRestriction { restriction: pending.restriction, applied_to: pending.applied_to })
    }

    /// Removes the preset `token` if no Create I/O SQ took it.
    pub(crate) fn remove(&mut self, token: u64) {
        self.pending.retain(|pending| pending.token != token);
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.pending.len()
    }
}

/// The status of a command refused for its LBAs (see the module documentation).
pub(crate) fn access_denied() -> NvmeStatus {
    NvmeStatus::new(nvme_driver::spec::status::StatusCodeType::MediaAndDataIntegrity, codes::ACCESS_DENIED)
}

/// The controller's view of host memory for one command: DMA translation, limited to the
/// submitting queue's ranges when it has a restriction. Remembers whether it refused anything,
/// for the counters.
pub(crate) struct HostAccess<'a> {
    dma: &'a DmaPool,
    restriction: Option<&'a QueueRestriction>,
    refused: Cell<bool>,
}

impl<'a> HostAccess<'a> {
    pub(crate) fn new(dma: &'a DmaPool, restriction: Option<&'a QueueRestriction>) -> Self {
        Self { dma, restriction, refused: Cell::new(false) }
    }

    /// The mapped region at `iova..iova+len`, or Data Transfer Error when it is not mapped or
    /// not allowed to this queue.
    pub(crate) fn translate(&self, iova: u64, len: usize) -> Result<DmaRegion, NvmeStatus> {
        let transfer_error = NvmeStatus::generic(codes::DATA_TRANSFER_ERROR);
        if let Some(restriction) = self.restriction {
            if !restriction.allows_memory(iova, len as u64) {
                self.refused.set(true);
                return Err(transfer_error);
            }
        }
        self.dma.translate(Iova(iova), len).map_err(|_| transfer_error)
    }

    /// As [`HostAccess::translate`], for a data buffer: host memory or memory reached by copies
    /// (`nvme_driver::hw::CopiedMemory`), under the same restriction.
    pub(crate) fn translate_data(&self, iova: u64, len: usize) -> Result<DataRegion, NvmeStatus> {
        let transfer_error = NvmeStatus::generic(codes::DATA_TRANSFER_ERROR);
        if let Some(restriction) = self.restriction {
            if !restriction.allows_memory(iova, len as u64) {
                self.refused.set(true);
                return Err(transfer_error);
            }
        }
        self.dma.translate_data(Iova(iova), len).map_err(|_| transfer_error)
    }

    pub(crate) fn refused(&self) -> bool {
        self.refused.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_and_bound_exactly() {
        // Goal: adjacent ranges merge, a range is allowed only when wholly inside, and LBA ranges
        // are per namespace.
        let restriction = QueueRestriction::new().allow_memory(Iova(8192), 4096).allow_memory(Iova(4096), 4096).allow_blocks(1, 10, 5);
        assert!(restriction.allows_memory(4096, 8192));
        assert!(!restriction.allows_memory(4095, 2));
        assert!(!restriction.allows_memory(12288 - 1, 2));
        assert!(!restriction.allows_memory(u64::MAX, 2));
        assert!(restriction.allows_blocks(1, 10, 5));
        assert!(!restriction.allows_blocks(1, 9, 1));
        assert!(!restriction.allows_blocks(1, 14, 2));
        assert!(!restriction.allows_blocks(2, 10, 1));
        assert!(!QueueRestriction::new().allows_memory(0, 1));
    }
}
