//! Queue pairs driven by another agent: the controller creates the queues, but a GPU kernel (or
//! any other submitter) writes the SQ entries, rings the doorbells and polls the CQ.
//!
//! The host only creates and deletes the queues. It never reads or writes their rings after
//! creation: the agent that owns them does, through the raw addresses this type exposes.

use std::sync::Arc;

use crate::error::NvmeError;
use crate::gate::QueueFate;
use crate::hw::DmaRegion;
use crate::spec::{COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use crate::teardown::AdminShared;
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

/// An I/O queue pair the host created but does not drive. Deleted on drop (bounded by the admin
/// timeout).
///
/// # The agent's contract
///
/// The host's doorbell gate (see [`crate::IoQueuePair::ring_doorbell`]) cannot reach another
/// agent: a GPU kernel writes BAR0 directly, and nothing the host does stops it. So the agent
/// must have stopped — no kernel running on these rings, no doorbell write in flight — before
/// this pair is dropped and before [`crate::Controller::reset`] (or the controller's drop) is
/// called. After a reset the queue id is handed out again, and a late doorbell write from the
/// agent would make the controller run another pair's SQ slots; after a drop, the rings may be
/// freed. The GPU executor drains its stream before either.
///
/// Dropping deletes the queues and frees the rings only when that is known to be safe: if the
/// deletion fails, or a reset since creation never confirmed the controller stopped, the rings
/// and the queue id are kept for good (leaked, counted, logged at error level). Rings the caller
/// supplied are kept mapped that way, but the caller still owns the memory behind them and must
/// not reuse or free it either unless [`DetachedQueuePair::delete`] returned `Ok`.
pub struct DetachedQueuePair {
    layout: DetachedQueueLayout,
    submission: DmaRegion,
    completion: DmaRegion,
    admin: Arc<AdminShared>,
    /// The controller generation this pair was created in (see `gate.rs`).
    generation: u64,
    /// Set by [`DetachedQueuePair::delete`], so that drop does not delete twice.
    deleted: bool,
    /// The submission queue is gone on the controller (a deletion got that far).
    sq_deleted: bool,
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
        generation: u64,
    ) -> Self {
        Self { layout, submission, completion, admin, generation, deleted: false, sq_deleted: false }
    }

    pub fn layout(&self) -> DetachedQueueLayout {
        self.layout
    }

    /// False once the controller was reset (or dropped): the queues no longer exist on it, or, if
    /// that reset never saw the controller stop, may still.
    pub fn is_live(&self) -> bool {
        self.admin.gate.fate(self.generation) == QueueFate::Live
    }

    /// Deletes the queues now and reports the outcome (dropping does the same, but can only
    /// log). `Ok` means the controller no longer uses the rings: their memory may be reused.
    /// On an error the pair comes back; dropping it then leaks its rings.
    pub fn delete(mut self) -> Result<(), UndeletedDetachedQueuePair> {
        match self.admin.retire_queue_pair(self.layout.id, self.generation, &mut self.sq_deleted) {
            Ok(()) => {
                self.deleted = true;
                Ok(())
            }
            Err(source) => Err(UndeletedDetachedQueuePair { source, pair: Box::new(self) }),
        }
    }
}

/// A detached queue pair whose deletion failed: the controller may still use its rings.
#[derive(Debug, thiserror::Error)]
#[error("deleting detached {} failed: {source}", pair.layout.id)]
pub struct UndeletedDetachedQueuePair {
    pub source: NvmeError,
    pub pair: Box<DetachedQueuePair>,
}

impl Drop for DetachedQueuePair {
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        if let Err(error) = self.admin.retire_queue_pair(self.layout.id, self.generation, &mut self.sq_deleted) {
            self.admin.leak_queue_pair(self.layout.id, [self.submission.clone(), self.completion.clone()], &error);
        }
    }
}
