//! Batched backing-store reads and writes through io_uring: several transfers in flight per
//! batch instead of one synchronous `pread`/`pwrite` each. The ring, its buffers' ownership and
//! its deadlines are the shared `tutti-uring` crate's; this module only picks the deadline and
//! what to do when a batch fails (fall back to synchronous transfers, for good).

use std::time::{Duration, Instant};

use tutti_uring::{Job, Ring, UringError};

/// How long one batch may take. A backing file that does not answer within this fails the batch
/// (its commands retry synchronously) instead of stalling the controller forever.
const BATCH_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) struct UringReader {
    ring: Ring,
}

impl UringReader {
    pub(crate) fn new(depth: u32) -> Result<Self, UringError> {
        Ok(Self { ring: Ring::new(depth)? })
    }

    /// Runs every job, at most the ring's depth in flight, in no particular order (the caller
    /// never puts overlapping writes, or a write and an overlapping read, in one batch); each
    /// job's `result` says how it went, and a failed one is retried synchronously by the caller
    /// (which for a write rewrites the same bytes). After a ring failure or a timeout the ring is
    /// abandoned and every later batch is left to the synchronous path.
    pub(crate) fn run(&mut self, jobs: &mut [Job]) {
        if self.ring.is_abandoned() {
            return;
        }
        if let Err(error) = self.ring.run_batch(jobs, Instant::now() + BATCH_TIMEOUT) {
            tracing::error!(%error, "io_uring batch failed: this and every later transfer of the device is synchronous");
        }
    }
}
