//! Which queue pair a pool device's metadata goes through, and what happens to it when a
//! metadata command fails with commands still in flight (a timeout).
//!
//! NVMe does not order commands in flight: a timed-out header write left queued could complete
//! after a later write of the same sector and undo it (slot X Valid for key A landing after X
//! was reused for key B), and it may still be reading the mirror while the next stage rewrites
//! it. So after such a failure the queue pair is deleted before anything else is written (a
//! fresh one is made at the next use). If the controller does not confirm the deletion, or the
//! queue pair is the executor's (lent; the pool cannot delete it), the device is fenced: no
//! header is staged or written on it, no slot on it is allocated, its mirror is never freed
//! (a late command may still read it), and every metadata call on it fails with
//! [`ObjstoreError::MetadataFenced`] until the pool is reopened (after a controller reset, if
//! the controller stopped answering). Nothing on disk is at risk meanwhile: the fenced device's
//! slots are not reused, so a late header write still describes the bytes in its slot.

use std::time::{Duration, Instant};

use nvme_driver::{DmaRegion, IoQueuePair, NvmeError};

use super::metadata_io::create_metadata_queue;
use super::mirror::HeaderMirror;
use super::{PoolDevice, QueueLender, HEADER_SYNC_FAILURES_FENCE};
use crate::error::{ObjstoreError, Result};

impl PoolDevice {
    /// Runs `work` on the queue pair device `index`'s metadata goes through: its own (made
    /// again if a failure deleted it), else the lender's, else a temporary one kept in
    /// `temporary` (the caller drops it, deleting it). `work` gets the queue, the mirror and
    /// the scratch buffer. A failure with commands left in flight retires the queue pair or
    /// fences the device (module docs). `timeout_is_full`: false when a caller's deadline cut
    /// `timeout` below the metadata timeout; then a lent queue pair is not used (a timeout
    /// there would fence the device for the caller's haste, not the device's): nothing is
    /// submitted and [`ObjstoreError::DeadlinePassed`] is returned. The same holds when the
    /// lend itself (which waits, up to `timeout`, for the executor's commands on the pair to
    /// end) leaves less than `timeout` before `deadline`, the caller's: `work` measures its
    /// waits from after the lend, and on a lent pair they must be whole. A lender that says it
    /// would lend ([`QueueLender::lends`]) is not asked to when its pair could not be used
    /// anyway (`timeout` cut, or not fitting before `deadline` even now); one that says it
    /// never lends is not asked at all.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_metadata<T>(
        &mut self,
        index: usize,
        lender: &mut dyn QueueLender,
        temporary: &mut Option<IoQueuePair>,
        timeout: Duration,
        timeout_is_full: bool,
        deadline: Option<Instant>,
        work: impl FnOnce(&mut IoQueuePair, &mut HeaderMirror, &DmaRegion) -> Result<T>,
    ) -> Result<T> {
        self.check_fence(index)?;
        if self.own_queue && self.queue.is_none() {
            self.queue = Some(create_metadata_queue(&self.target.controller)?);
        }
        let (result, stuck, lent) = {
            let (queue, lent) = match self.queue.as_mut() {
                Some(queue) => (queue, false),
                None => {
                    // On a lent pair the waits must be whole: all of `timeout`, from after the
                    // lend, before the caller's deadline.
                    let fits = || timeout_is_full && deadline.is_none_or(|deadline| deadline >= Instant::now() + timeout);
                    let unusable = || ObjstoreError::DeadlinePassed { what: "metadata command on a lent queue pair", done: 0 };
                    let lent = match lender.lends(index) {
                        // Lending a pair that cannot be used would only wait, up to the caller's
                        // deadline, for the executor's other layers on it.
                        Some(true) if !fits() => return Err(unusable()),
                        Some(false) => None,
                        Some(true) | None => lender.lend(index, Instant::now() + timeout)?,
                    };
                    match lent {
                        Some(_) if !fits() => return Err(unusable()),
                        Some(queue) => (queue, true),
                        None => {
                            if temporary.is_none() {
                                *temporary = Some(create_metadata_queue(&self.target.controller)?);
                            }
                            (temporary.as_mut().expect("set above"), false)
                        }
                    }
                }
            };
            let result = work(queue, &mut self.mirror, &self.scratch);
            // A failed pair (a completion broke the queue protocol) takes no new command even
            // with nothing in flight: it is retired like one with a command stuck in it.
            let stuck = result.is_err() && (queue.in_flight() > 0 || queue.failed());
            (result, stuck, lent)
        };
        if stuck {
            if lent {
                self.fence(
                    index,
                    "a metadata command timed out on the executor's queue pair the pool borrows for this device, which the pool \
                     cannot delete"
                        .into(),
                );
            } else {
                let queue = self.queue.take().or_else(|| temporary.take()).expect("the queue the command ran on");
                if let Err(error) = crate::leak::retire_queue_pair(queue, &[self.mirror.region(), &self.scratch]) {
                    self.buffers_leaked = true; // by retire_queue_pair, with the rings
                    self.fence(index, format!("a metadata command timed out and its queue pair could not be deleted: {error}"));
                }
            }
        }
        result
    }

    /// [`ObjstoreError::MetadataFenced`] if the device is fenced.
    pub(super) fn check_fence(&self, index: usize) -> Result<()> {
        match &self.fence {
            Some(reason) => Err(ObjstoreError::MetadataFenced { device: index, reason: reason.clone() }),
            None => Ok(()),
        }
    }

    /// Counts a header sync of device `index`: one that failed on the device (an error status,
    /// or a timeout whose queue pair `run_metadata` deleted; one it could not delete fenced the
    /// device already) adds to the failures in a row, and the [`HEADER_SYNC_FAILURES_FENCE`]th
    /// fences the device; its buffers are freed at close as usual, since no command of it is
    /// in flight. One that succeeded resets the count.
    pub(super) fn count_header_sync(&mut self, index: usize, synced: &Result<()>) {
        if let Some(error) = count_in_a_row(&mut self.header_sync_failures, synced, self.fence.is_some()) {
            self.fence_after_failures(index, "header syncs", error);
        }
    }

    /// Counts a cache flush of device `index` as [`Self::count_header_sync`] counts header
    /// syncs, on a count of its own: a commit whose flush fails writes no header, so a shared
    /// count would be reset by the headers other commits stage on the device and a device whose
    /// flushes always fail would never be fenced (and would fail every commit placed on it).
    pub(super) fn count_flush(&mut self, index: usize, flushed: &Result<()>) {
        if let Some(error) = count_in_a_row(&mut self.flush_failures, flushed, self.fence.is_some()) {
            self.fence_after_failures(index, "cache flushes", error);
        }
    }

    fn fence_after_failures(&mut self, index: usize, what: &str, last: &ObjstoreError) {
        self.fence(index, format!("{HEADER_SYNC_FAILURES_FENCE} {what} in a row failed, the last with: {last}"));
        self.fence_idle = true;
    }

    pub(super) fn fence(&mut self, index: usize, reason: String) {
        tracing::error!(
            device = index,
            %reason,
            "objstore: pool device fenced: no further header writes on it, and no slot on it is reused, until the pool is reopened \
             (after a controller reset if the controller stopped answering)"
        );
        // Never written now: the device's headers are re-read from disk at the next open.
        self.mirror.forget_dirty();
        self.fence = Some(reason);
    }
}

/// Adds `outcome` to a count of failures in a row; returns the failure that reaches
/// [`HEADER_SYNC_FAILURES_FENCE`]. What counts is what the device did: a command it answered
/// with an error status, or one it did not answer within the full metadata timeout (a timeout
/// a caller's deadline cut short is not counted: `Pool::sync_devices` leaves it out). A
/// timeout whose queue pair was deleted retires the queue
/// without fencing (`run_metadata`), so a device whose writes hang would otherwise fail every
/// sync, and every store, until reopen. A queue that could not be lent in time, or any other
/// failure that says nothing about the device, neither counts nor resets the count (a busy
/// executor must not fence a healthy device); nothing counts on a device fenced already.
fn count_in_a_row<'a>(failures: &mut u32, outcome: &'a Result<()>, fenced: bool) -> Option<&'a ObjstoreError> {
    match outcome {
        Ok(()) => *failures = 0,
        Err(error @ ObjstoreError::Nvme(NvmeError::Command { .. } | NvmeError::Timeout { .. })) if !fenced => {
            *failures += 1;
            if *failures >= HEADER_SYNC_FAILURES_FENCE {
                return Some(error);
            }
        }
        Err(_) => {}
    }
    None
}
