//! Ending transfers the controller can no longer wait for normally: settling everything in
//! flight (a Flush or admin command, a reset, a shutdown, a power loss), abandoning a failed
//! ring and cancelling what the kernel still holds, and the store fence that a write the kernel
//! keeps leaves behind.

use tutti_uring::UringError;

use super::in_flight::Settle;
use super::ControllerCore;
use crate::backing::AlignedBuffer;
use crate::uring::UringReader;

impl ControllerCore {
    /// Ends every transfer in flight, finishing or dropping its command per `settle`. Returns
    /// with nothing in flight.
    ///
    /// `Settle::Finish` waits for each transfer (up to its deadline). A stop (`Discard`,
    /// `PowerLoss`) completes none of its commands, so it does not wait for them to end: it asks
    /// the kernel to cancel them all at once and waits only for those the kernel keeps (up to
    /// the cancel timeout, 5 s), so a controller reset ends within CAP.TO (10 s) however long
    /// the transfers' deadlines (30 s). A cancelled transfer never lands: a cancelled Write
    /// leaves its blocks as the cache and the store held them (see `landed` in `batch.rs`);
    /// one the kernel keeps fences the store, and one into host memory keeps the stop from
    /// being reported (see `end_held`).
    pub(super) fn settle_in_flight(&mut self, settle: Settle) {
        if self.in_flight.is_empty() {
            return;
        }
        if settle != Settle::Finish {
            // A power loss stops the drive, a reset deletes the commands' queues: what the
            // kernel can still take back never lands.
            let mut given_back = std::mem::take(&mut self.in_flight.reaped);
            let held = self.reader.as_mut().map(|reader| reader.cancel(|completion| given_back.push(completion))).unwrap_or_default();
            for completion in given_back.drain(..) {
                self.end_given_back(completion, settle);
            }
            self.in_flight.reaped = given_back;
            let why = if settle == Settle::PowerLoss { "a power loss" } else { "a controller or function reset" };
            self.end_held(&held, why, settle);
        }
        // Bounded: each pass finishes at least one transfer, or fails the ring (which empties it).
        while self.wait_in_flight(settle) {}
    }

    /// Abandons the ring after `cause`: what the kernel gives back when cancelled finishes (a
    /// transfer that did not complete is redone synchronously from its own buffer; at a stop,
    /// a Write given back short has the block it stopped in finished); a write it keeps fails
    /// with Write Fault, fences the store and makes the controller fatal.
    pub(super) fn fail_ring(&mut self, cause: &UringError, settle: Settle) {
        let mut given_back = std::mem::take(&mut self.in_flight.reaped);
        let held = self.reader.as_mut().map(|reader| reader.abandon(cause, |completion| given_back.push(completion))).unwrap_or_default();
        let kept_writes = held
            .iter()
            .filter(|&&tag| self.in_flight.slots.get(tag as usize).is_some_and(|slot| slot.as_ref().is_some_and(|(io, _)| io.write)))
            .count();
        // What was given back, then what was kept, ends before the fence (`end_held` fences
        // after its loop), as in `settle_in_flight`: the fence guards the blocks of the writes
        // the kernel keeps, and no other transfer of the ring touches them (it was in flight
        // beside them, and a command overlapping a Write in flight waits for it). A kept Write
        // itself only fails, touching no block. Fenced first, a redo (of a transfer given back,
        // or a kept Read) or a short Write's last block at a stop would fail against a store it
        // cannot harm, and a short Write's block would stay torn. Until 2026-12-01 the fence
        // came first.
        for completion in given_back.drain(..) {
            self.end_given_back(completion, settle);
        }
        self.in_flight.reaped = given_back;
        self.end_held(&held, "an abandoned io_uring batch", settle);
        if kept_writes > 0 && settle == Settle::Finish {
            self.set_fatal();
        }
    }

    /// Commands whose transfers the kernel kept after cancellation: a kept Write fails (its data
    /// may land at any time), a kept Read is redone synchronously into a fresh buffer (before
    /// the store is fenced for the kept Writes, whose blocks it does not overlap). A kept
    /// direct transfer gets no completion at all, since that would hand the host memory the
    /// kernel may still read or write back to the host: the controller becomes fatal (CSTS.CFS)
    /// instead, as a device hung in the middle of its DMA, the ring keeps the memory's regions
    /// (leaked with it if never given back), and no stop reports RDY = 0 until the kernel gives
    /// them back (`host_memory_in_kernel`).
    fn end_held(&mut self, held: &[u64], why: &str, settle: Settle) {
        let mut kept_writes = 0usize;
        let mut kept_direct = 0usize;
        for &tag in held {
            let Some(io) = self.in_flight.take(tag) else { continue };
            self.reserve_completion_slot(io.completion_queue_id, false);
            kept_writes += usize::from(io.write);
            if io.direct {
                kept_direct += 1;
                self.host_memory_in_kernel.push(tag);
                continue;
            }
            let cause = UringError::StillInFlight { cause: why.to_string() };
            self.end_io(io, AlignedBuffer::default(), Err(cause), settle);
        }
        if kept_writes > 0 && !self.store.is_fenced() {
            self.fence_for_kept_writes(kept_writes);
        }
        if kept_direct > 0 {
            tracing::error!(
                kept_direct,
                "transfers into host memory are still with the kernel after cancellation: their commands never complete, \
                 and the controller reports a fatal status"
            );
            if settle == Settle::Finish {
                self.set_fatal();
            }
        }
    }

    fn fence_for_kept_writes(&mut self, kept_writes: usize) {
        // The kernel may complete these writes at any time, over whatever is written to their
        // blocks after them: nothing may touch the store until they are given back.
        tracing::error!(
            kept_writes,
            "backing-store writes of an abandoned io_uring ring are still in flight after cancellation: they fail, the store \
             refuses all I/O until the kernel gives them back, and the controller reports a fatal status"
        );
        self.store.fence(format!("{kept_writes} abandoned io_uring write(s) may still land"));
    }

    /// Whether the kernel still holds a transfer straight into or out of host memory that
    /// cancellation did not take back (asking it once more, without waiting).
    pub(super) fn host_memory_in_kernel(&mut self) -> bool {
        if self.host_memory_in_kernel.is_empty() {
            return false;
        }
        match self.reader.as_mut() {
            Some(reader) => reader.retain_held(&mut self.host_memory_in_kernel),
            // Only a ring can hold a transfer: without one nothing is held.
            None => self.host_memory_in_kernel.clear(),
        }
        !self.host_memory_in_kernel.is_empty()
    }

    /// Whether the ring still holds a write the kernel may complete (see
    /// `UringReader::holds_writes`), for tests that wait for the kernel to give it back.
    #[cfg(test)]
    pub(crate) fn ring_holds_writes_for_tests(&mut self) -> bool {
        self.reader.as_mut().is_some_and(UringReader::holds_writes)
    }

    /// Lifts the store's fence once the kernel has given back every write that an abandoned
    /// ring left with it (they can no longer land over newer data). Checked when the
    /// controller is enabled, before it runs fetched commands and before a shutdown's, a
    /// function reset's or a power loss's (partial) write-back, only while fenced.
    pub(super) fn refresh_store_fence(&mut self) {
        if !self.store.is_fenced() || self.reader.as_mut().is_some_and(UringReader::holds_writes) {
            return;
        }
        self.store.lift_fence();
        tracing::warn!("the kernel gave back every abandoned io_uring write: backing-store I/O resumes (synchronously)");
    }
}
