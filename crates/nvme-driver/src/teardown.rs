//! What a controller shares with its queue pairs so that they can delete themselves, and the one
//! rule every teardown path follows: memory a controller may still write is never freed.
//!
//! A pair's rings go back to the allocator only when its queues are known to be gone from the
//! controller: deleted by an admin command that succeeded, or ended by a reset that saw
//! CSTS.RDY = 0 (see `gate.rs`). In every other case — a Delete I/O SQ/CQ that failed or timed
//! out, a reset or teardown that could not confirm the controller stopped — the rings (and the
//! queue id) are kept for the rest of the process, the leak is counted, and it is logged at
//! error level. A leaked ring costs memory; a freed one that the controller still writes would
//! corrupt whatever reuses it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::NvmeError;
use crate::gate::{DoorbellGate, QueueFate};
use crate::hw::DmaRegion;
use crate::queue::QueuePair;
use crate::spec::status::codes;
use crate::spec::{StatusCodeType, SubmissionEntry};
use crate::types::QueueId;

/// Counts of memory kept because a controller might still write it.
#[derive(Debug, Default)]
pub(crate) struct LeakCounters {
    queue_pairs: AtomicU64,
    bytes: AtomicU64,
}

/// State shared by a controller and its queue pairs.
pub(crate) struct AdminShared {
    pub(crate) admin: Mutex<QueuePair>,
    pub(crate) gate: Arc<DoorbellGate>,
    /// Queue ids in use, indexed by id (0, the admin queue, always in use). Rebuilt by bring-up.
    pub(crate) queue_ids_in_use: Mutex<Vec<bool>>,
    pub(crate) timeout: Duration,
    pub(crate) leaks: LeakCounters,
}

/// Whether a failed Create I/O CQ/SQ may nevertheless have created the queue: only an error
/// status, or a refusal before submission (a busy or failed admin queue), proves the controller
/// did not execute it; a timeout, a lost controller or a completion that broke the protocol
/// says nothing.
pub(crate) fn may_have_executed(error: &NvmeError) -> bool {
    !matches!(error, NvmeError::Command { .. } | NvmeError::QueueBusy { .. } | NvmeError::QueueFailed { .. })
}

/// Whether a delete failed only because the queue does not exist (Invalid Queue Identifier).
fn queue_absent(error: &NvmeError) -> bool {
    error
        .status()
        .is_some_and(|status| status.code_type == StatusCodeType::CommandSpecific && status.code == codes::INVALID_QUEUE_IDENTIFIER)
}

impl AdminShared {
    pub(crate) fn new(admin: QueuePair, timeout: Duration) -> Self {
        Self {
            admin: Mutex::new(admin),
            gate: Arc::new(DoorbellGate::new()),
            queue_ids_in_use: Mutex::new(Vec::new()),
            timeout,
            leaks: LeakCounters::default(),
        }
    }

    pub(crate) fn lock_admin(&self) -> MutexGuard<'_, QueuePair> {
        self.admin.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lock_ids(&self) -> MutexGuard<'_, Vec<bool>> {
        self.queue_ids_in_use.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The admin queue, idle: completions that arrived late for commands that timed out are
    /// consumed first (the controller has finished with their buffers once it posts them),
    /// stepping over completions naming nothing in flight (logged; the queue goes on, and a
    /// late completion may be posted behind one). If a command is still outstanding,
    /// [`NvmeError::QueueBusy`]: its buffer may still be written, so no admin command may be
    /// submitted, nor its buffer refilled, until it completes or a reset confirms the
    /// controller stopped (bring-up then clears the queue).
    pub(crate) fn lock_idle_admin(&self) -> Result<MutexGuard<'_, QueuePair>, NvmeError> {
        let mut admin = self.lock_admin();
        if admin.in_flight() > 0 {
            // Every admin command goes through `execute` under this lock, so whatever is in
            // flight here is a command whose caller gave up on it.
            admin.reap_late(|late| {
                tracing::warn!(command_id = %late.command_id, opcode = late.opcode, status = ?late.status, "late admin completion consumed");
            })?;
        }
        // A completion that broke the protocol failed the admin queue: only a reset clears it.
        admin.check_not_failed()?;
        if admin.in_flight() > 0 {
            return Err(NvmeError::QueueBusy { queue: admin.id(), outstanding: admin.in_flight() });
        }
        Ok(admin)
    }

    pub(crate) fn execute(&self, entry: SubmissionEntry) -> Result<crate::queue::Completion, NvmeError> {
        self.lock_idle_admin()?.execute(entry, self.timeout)
    }

    /// Runs an admin command whose data buffer is `buffer` (Identify, Get Log Page) and copies
    /// the first `data.len()` bytes of the result out. The buffer is zeroed and read only while
    /// the admin queue is held idle: after a timeout, the late command may still write it, and
    /// refilling it then would race with the device (see [`AdminShared::lock_idle_admin`]).
    pub(crate) fn execute_with_buffer(
        &self,
        entry: SubmissionEntry,
        buffer: &DmaRegion,
        data: &mut [u8],
    ) -> Result<crate::queue::Completion, NvmeError> {
        let mut admin = self.lock_idle_admin()?;
        buffer.fill(0, data.len(), 0)?;
        let completion = admin.execute(entry, self.timeout)?;
        buffer.read(0, data)?;
        Ok(completion)
    }

    /// Reserves the lowest free I/O queue id.
    pub(crate) fn reserve_queue_id(&self, granted: u16) -> Result<QueueId, NvmeError> {
        let mut ids = self.lock_ids();
        let free = ids.iter().position(|used| !used).ok_or(NvmeError::NoQueueAvailable { granted })?;
        ids[free] = true;
        Ok(QueueId(free as u16))
    }

    pub(crate) fn release_queue_id(&self, id: QueueId) {
        if let Some(slot) = self.lock_ids().get_mut(usize::from(id.0)) {
            *slot = false;
        }
    }

    /// After a disable reached CSTS.RDY = 0 no I/O queue exists: until Number of Queues says
    /// how many may, none can be reserved.
    pub(crate) fn forget_queue_ids(&self) {
        *self.lock_ids() = vec![true];
    }

    /// Makes ids `1..=granted` available (and only those).
    pub(crate) fn grant_queue_ids(&self, granted: u16) {
        let mut ids = vec![false; usize::from(granted) + 1];
        ids[0] = true;
        *self.lock_ids() = ids;
    }

    /// Ends the life of queue pair `id` created in `generation`: deletes its SQ (unless
    /// `sq_deleted` says an earlier try did) and CQ and releases the id when its generation is
    /// current (a delete answered with Invalid Queue Identifier counts as done: a retry after a
    /// delete that timed out and then completed); does nothing when a reset since then confirmed
    /// the queues gone; and fails with
    /// [`NvmeError::QueueMaybeLive`] when a reset since then could not confirm it. The gate's
    /// shared side is held throughout, so a reset on another thread waits for the deletion
    /// (bounded by the admin timeout per command) instead of disabling the controller under it.
    ///
    /// `Ok` means the rings are the caller's to free: no command of the pair moves data any more.
    pub(crate) fn retire_queue_pair(&self, id: QueueId, generation: u64, sq_deleted: &mut bool) -> Result<(), NvmeError> {
        let hold = self.gate.hold();
        match hold.fate(generation) {
            // A successful reset rebuilt the id table: the old id is not ours to release.
            QueueFate::Gone => return Ok(()),
            QueueFate::MaybeLive => return Err(NvmeError::QueueMaybeLive { queue: id }),
            QueueFate::Live => {}
        }
        let mut admin = self.lock_idle_admin()?;
        // A delete answered with Invalid Queue Identifier finds the queue already gone: an
        // earlier try of this retirement timed out and its command completed late (consumed by
        // `lock_idle_admin`). The id is still reserved for this pair, so nothing else created a
        // queue under it since: that answer means done, as in `abandon_queue_pair`.
        let delete = |admin: &mut QueuePair, entry: SubmissionEntry| match admin.execute(entry, self.timeout) {
            Err(error) if !queue_absent(&error) => Err(error),
            _ => Ok(()),
        };
        if !*sq_deleted {
            // Deleting the SQ makes the controller abort or finish its commands (§5.7), so none
            // moves data after this succeeded.
            delete(&mut admin, SubmissionEntry::delete_io_submission_queue(id.0))?;
            *sq_deleted = true;
        }
        delete(&mut admin, SubmissionEntry::delete_io_completion_queue(id.0))?;
        drop(admin);
        self.release_queue_id(id);
        drop(hold);
        Ok(())
    }

    /// Cleans up after a failed creation of queue pair `id`: deletes the SQ and the CQ where
    /// they may exist (see [`may_have_executed`]); a delete answered with Invalid Queue
    /// Identifier counts as done. `Ok` means neither exists and the id was released; on `Err`
    /// the caller must leak the rings with [`AdminShared::leak_queue_pair`] (the id stays
    /// reserved).
    pub(crate) fn abandon_queue_pair(&self, id: QueueId, sq_may_exist: bool, cq_may_exist: bool) -> Result<(), NvmeError> {
        let delete = |entry: SubmissionEntry| match self.execute(entry) {
            Err(error) if !queue_absent(&error) => Err(error),
            _ => Ok(()),
        };
        if sq_may_exist {
            delete(SubmissionEntry::delete_io_submission_queue(id.0))?;
        }
        if cq_may_exist {
            delete(SubmissionEntry::delete_io_completion_queue(id.0))?;
        }
        self.release_queue_id(id);
        Ok(())
    }

    /// Keeps `regions` (a queue pair's rings and scratch pages) allocated forever because the
    /// controller may still write them, counts it and logs it at error level.
    pub(crate) fn leak_queue_pair(&self, id: QueueId, regions: impl IntoIterator<Item = DmaRegion>, reason: &NvmeError) {
        let bytes: usize = regions.into_iter().map(DmaRegion::leak).sum();
        let pairs = self.leaks.queue_pairs.fetch_add(1, Ordering::Relaxed) + 1;
        self.leaks.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        tracing::error!(
            queue = %id,
            bytes,
            leaked_queue_pairs = pairs,
            error = %reason,
            "queue pair not known to be deleted on the controller: its rings are kept (leaked) and its queue id stays reserved"
        );
    }

    /// Queue pairs leaked so far, and their bytes.
    pub(crate) fn leaked(&self) -> (u64, u64) {
        (self.leaks.queue_pairs.load(Ordering::Relaxed), self.leaks.bytes.load(Ordering::Relaxed))
    }
}
