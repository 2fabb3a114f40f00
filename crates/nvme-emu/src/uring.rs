//! Backing-store reads and writes through io_uring: transfers stay in flight across doorbell
//! scans instead of one synchronous `pread`/`pwrite` each. The ring, its buffers' ownership, its
//! deadlines and its cancellation are the shared `tutti-uring` crate's; this module only picks
//! the deadlines and says which transfers an abandoned ring left with the kernel.

use std::time::{Duration, Instant};

use nvme_driver::hw::DmaRegion;
use tutti_uring::{Completion, Direction, Refused, RefusedRegions, Ring, Transfer, UringError};

use crate::backing::AlignedBuffer;

/// How long one transfer may stay in flight. A backing file that does not answer within this
/// fails the ring instead of stalling the controller forever.
const BATCH_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a failed ring then waits for the kernel to give back the transfers it cancels (a
/// write to a hung disk may never come back; one to a slow one usually does by then).
const CANCEL_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) struct UringReader {
    ring: Ring,
    batch_timeout: Duration,
    cancel_timeout: Duration,
}

impl UringReader {
    pub(crate) fn new(depth: u32) -> Result<Self, UringError> {
        Ok(Self { ring: Ring::new(depth)?, batch_timeout: BATCH_TIMEOUT, cancel_timeout: CANCEL_TIMEOUT })
    }

    /// Whether transfers may still be pushed (false once the ring was abandoned).
    pub(crate) fn is_usable(&self) -> bool {
        !self.ring.is_abandoned()
    }

    /// Transfers that can be in flight at once.
    pub(crate) fn capacity(&self) -> usize {
        self.ring.capacity()
    }

    /// How long a transfer may stay in flight before the ring is failed.
    pub(crate) fn batch_timeout(&self) -> Duration {
        self.batch_timeout
    }

    /// Queues one transfer (the ring owns `buffer` until its completion is reaped).
    pub(crate) fn push(&mut self, transfer: Transfer, buffer: AlignedBuffer, tag: u64) -> Result<(), Refused> {
        self.ring.push(transfer, buffer, tag)
    }

    /// Queues one transfer straight between the file and host memory (the ring keeps the
    /// regions until its completion is reaped; see `tutti_uring::Ring::push_regions`).
    pub(crate) fn push_regions(&mut self, transfer: Transfer, regions: Vec<DmaRegion>, tag: u64) -> Result<(), RefusedRegions> {
        self.ring.push_regions(transfer, regions, tag)
    }

    /// Hands queued transfers to the kernel without waiting.
    pub(crate) fn submit(&mut self) -> Result<(), UringError> {
        self.ring.submit()
    }

    /// Submits what is queued and waits until a completion is ready or `deadline` passes.
    pub(crate) fn wait(&mut self, deadline: Instant) -> Result<(), UringError> {
        self.ring.wait(deadline)
    }

    /// Hands every completion that is ready to `on_done`, without waiting.
    pub(crate) fn reap(&mut self, on_done: impl FnMut(Completion)) -> Result<usize, UringError> {
        self.ring.reap(on_done)
    }

    /// Asks the kernel to cancel every transfer in flight and reaps, handing each one given back
    /// to `on_done`, until none is left or the cancel timeout passes. Returns the tags of those
    /// still held: they may complete (a write may land) at any time. The ring stays usable when
    /// none is held; otherwise it is abandoned.
    pub(crate) fn cancel(&mut self, on_done: impl FnMut(Completion)) -> Vec<u64> {
        let held = self.ring.cancel_in_flight(Instant::now() + self.cancel_timeout, on_done);
        if held == 0 {
            return Vec::new();
        }
        self.ring.abandon(&UringError::StillInFlight { cause: "cancellation did not take every transfer back".into() });
        self.ring.in_flight_transfers().map(|(tag, _)| tag).collect()
    }

    /// Gives up on the ring after `cause` (a failed `io_uring_enter`, a deadline): every later
    /// transfer of the device is synchronous. What the kernel still holds is cancelled as in
    /// [`UringReader::cancel`]; returns the tags it kept.
    pub(crate) fn abandon(&mut self, cause: &UringError, on_done: impl FnMut(Completion)) -> Vec<u64> {
        tracing::error!(%cause, "io_uring failed: its transfers are cancelled and every later transfer of the device is synchronous");
        self.ring.abandon(cause);
        let held = self.ring.cancel_in_flight(Instant::now() + self.cancel_timeout, on_done);
        if held > 0 {
            tracing::error!(held, "io_uring transfers still in flight after cancellation: they may complete at any time");
        }
        self.ring.in_flight_transfers().map(|(tag, _)| tag).collect()
    }

    /// Whether the ring still holds a write the kernel may yet complete (only an abandoned ring
    /// can keep one the controller no longer tracks). Asks the kernel once more to cancel it,
    /// without waiting.
    pub(crate) fn holds_writes(&mut self) -> bool {
        if !self.ring.is_abandoned() {
            return false;
        }
        self.ring.cancel_in_flight(Instant::now(), drop);
        self.ring.in_flight_transfers().any(|(_, transfer)| transfer.direction == Direction::Write)
    }

    /// Keeps in `tags` those of the ring's transfers the kernel still holds (each may yet
    /// complete, reading or writing its memory), after asking the kernel once more to cancel
    /// them, without waiting. What it gave back since is dropped: its memory is free again.
    pub(crate) fn retain_held(&mut self, tags: &mut Vec<u64>) {
        self.ring.cancel_in_flight(Instant::now(), drop);
        tags.retain(|&tag| self.ring.in_flight_transfers().any(|(held, _)| held == tag));
    }

    /// Shorter deadlines, and optionally no cancellation (a write the kernel keeps), for tests of
    /// a stalled backing file.
    #[cfg(test)]
    pub(crate) fn stall_for_tests(&mut self, batch_timeout: Duration, cancel_timeout: Duration, cancellation: bool) {
        self.batch_timeout = batch_timeout;
        self.cancel_timeout = cancel_timeout;
        if !cancellation {
            self.ring.disable_cancellation();
        }
    }
}
