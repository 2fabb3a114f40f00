//! Batched backing-store reads and writes through io_uring: several transfers in flight per
//! batch instead of one synchronous `pread`/`pwrite` each. The ring, its buffers' ownership,
//! its deadlines and its cancellation are the shared `tutti-uring` crate's; this module only
//! picks the deadlines and answers whether an abandoned batch left a write with the kernel.

use std::time::{Duration, Instant};

use tutti_uring::{Direction, Job, Ring, UringError};

/// How long one batch may take. A backing file that does not answer within this fails the batch
/// instead of stalling the controller forever.
const BATCH_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a failed batch then waits for the kernel to give back the transfers it cancels (a
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

    /// Runs every job, at most the ring's depth in flight, in no particular order (the caller
    /// never puts overlapping writes, or a write and an overlapping read, in one batch); each
    /// job's `result` says how it went. After a ring failure or a timeout the ring is abandoned
    /// (every later batch is left to the synchronous path) and what the kernel still held is
    /// cancelled: a job that failed may be retried synchronously, except one that failed with
    /// [`UringError::StillInFlight`], which the kernel may still complete at any time.
    pub(crate) fn run(&mut self, jobs: &mut [Job]) {
        if self.ring.is_abandoned() {
            return;
        }
        if let Err(error) = self.ring.run_batch(jobs, Instant::now() + self.batch_timeout, self.cancel_timeout) {
            tracing::error!(%error, "io_uring batch failed: this and every later transfer of the device is synchronous");
        }
    }

    /// Whether the ring still holds a write the kernel may yet complete (only an abandoned ring
    /// can, between batches). Asks the kernel once more to cancel it, without waiting.
    pub(crate) fn holds_writes(&mut self) -> bool {
        self.ring.cancel_in_flight(Instant::now(), drop);
        self.ring.in_flight_transfers().any(|(_, transfer)| transfer.direction == Direction::Write)
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
