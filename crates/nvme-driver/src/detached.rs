//! Queue pairs driven by another agent: the controller creates the queues, but a GPU kernel (or
//! any other submitter) writes the SQ entries, rings the doorbells and polls the CQ.
//!
//! The host only creates and deletes the queues. It never reads or writes their rings after
//! creation: the agent that owns them does, through the raw addresses this type exposes.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::controller::AdminShared;
use crate::error::NvmeError;
use crate::hw::DmaRegion;
use crate::spec::{COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use crate::types::{Iova, QueueId};

/// Where a detached queue pair lives and how to ring it; everything a GPU kernel needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DetachedQueueLayout {
    pub id: QueueId,
    /// Entries in each ring.
    pub depth: u32,
    /// Device (IOVA) addresses of the rings, as programmed into the controller.
    pub submission_iova: Iova,
    pub completion_iova: Iova,
    /// Host virtual addresses of the rings (for `cuMemHostRegister` when they are host memory).
    pub submission_host_address: usize,
    pub completion_host_address: usize,
    /// Byte offsets of the SQ tail and CQ head doorbells within BAR0.
    pub submission_doorbell_offset: usize,
    pub completion_doorbell_offset: usize,
}

/// An I/O queue pair the host created but does not drive. Deleted on drop (best effort, bounded
/// by the admin timeout) unless the controller was reset since.
pub struct DetachedQueuePair {
    layout: DetachedQueueLayout,
    _submission: DmaRegion,
    _completion: DmaRegion,
    admin: Arc<AdminShared>,
    epoch: u64,
}

impl std::fmt::Debug for DetachedQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DetachedQueuePair").field("layout", &self.layout).finish()
    }
}

impl DetachedQueuePair {
    /// Checks the rings the caller supplied can hold `depth` entries and are page aligned.
    pub(crate) fn validate_rings(depth: u32, submission: &DmaRegion, completion: &DmaRegion) -> Result<(), NvmeError> {
        let checks = [
            (submission, depth as usize * SUBMISSION_ENTRY_BYTES, "submission ring"),
            (completion, depth as usize * COMPLETION_ENTRY_BYTES, "completion ring"),
        ];
        for (region, needed, what) in checks {
            if region.len() < needed {
                return Err(NvmeError::Unsupported {
                    reason: format!("{what} holds {} bytes, {depth} entries need {needed}", region.len()),
                });
            }
            if region.iova().0 % 4096 != 0 {
                return Err(NvmeError::Unsupported { reason: format!("{what} at {} is not page aligned", region.iova()) });
            }
        }
        Ok(())
    }

    pub(crate) fn new(
        layout: DetachedQueueLayout,
        submission: DmaRegion,
        completion: DmaRegion,
        admin: Arc<AdminShared>,
        epoch: u64,
    ) -> Self {
        Self { layout, _submission: submission, _completion: completion, admin, epoch }
    }

    pub fn layout(&self) -> DetachedQueueLayout {
        self.layout
    }

    /// False once the controller was reset: the queues no longer exist on it.
    pub fn is_live(&self) -> bool {
        self.admin.epoch.load(Ordering::Acquire) == self.epoch
    }
}

impl Drop for DetachedQueuePair {
    fn drop(&mut self) {
        if !self.is_live() {
            return;
        }
        self.admin.delete_io_queue_pair(self.layout.id);
    }
}
