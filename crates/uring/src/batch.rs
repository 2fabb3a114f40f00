//! Running a list of transfers together: the software controller's backing-store batches.

use std::time::Instant;

use crate::buffer::AlignedBuffer;
use crate::error::UringError;
use crate::sys::{Refused, Ring};
use crate::{Direction, Transfer};

/// One transfer of a batch, with its buffer (filled by the caller for a write) and, after
/// [`Ring::run_batch`], its outcome.
#[derive(Debug)]
pub struct Job {
    pub transfer: Transfer,
    pub buffer: AlignedBuffer,
    pub result: Result<(), UringError>,
}

impl Job {
    pub fn new(transfer: Transfer, buffer: AlignedBuffer) -> Self {
        Self { transfer, buffer, result: Err(UringError::NotRun) }
    }
}

impl Ring {
    /// Runs every job, at most [`Ring::capacity`] in flight, in no particular order (the caller
    /// never puts overlapping writes, or a write and an overlapping read, in one batch), and
    /// returns when all are done or at `deadline`. Each job's `result` says how it went; its
    /// buffer is back in the job (a read's holds the data).
    ///
    /// On a ring failure or the deadline, the ring is abandoned and the error returned: jobs
    /// that completed keep their result; the others fail with [`UringError::Abandoned`], and a
    /// job whose buffer was still lent to the kernel gets a fresh one (holding a copy of the data
    /// for a write), so that the caller can retry synchronously. The lent buffers are leaked with
    /// the ring.
    pub fn run_batch(&mut self, jobs: &mut [Job], deadline: Instant) -> Result<(), UringError> {
        let mut next = 0usize;
        // Bounded: each pass pushes or reaps at least one job, or returns.
        while next < jobs.len() || self.in_flight() > 0 {
            while next < jobs.len() {
                let job = &mut jobs[next];
                let buffer = std::mem::take(&mut job.buffer);
                match self.push(job.transfer, buffer, next as u64) {
                    Ok(()) => next += 1,
                    Err(Refused { buffer, error: UringError::Full { .. } }) => {
                        job.buffer = buffer;
                        break;
                    }
                    Err(Refused { buffer, error }) => {
                        job.buffer = buffer;
                        job.result = Err(error);
                        next += 1;
                    }
                }
            }
            if self.in_flight() == 0 {
                if next < jobs.len() {
                    // Nothing in flight and still refused: leave the rest to the caller's
                    // synchronous fallback rather than spin.
                    let error = UringError::Full { capacity: self.capacity() };
                    self.fail_rest(jobs, next, &error);
                    return Err(error);
                }
                break;
            }
            let reaped = self.wait(deadline).and_then(|()| {
                self.reap(|completion| {
                    let Some(job) = usize::try_from(completion.tag).ok().and_then(|index| jobs.get_mut(index)) else { return };
                    job.result = completion.check();
                    job.buffer = completion.buffer;
                })
            });
            if let Err(error) = reaped {
                tracing::error!(%error, in_flight = self.in_flight(), "io_uring batch failed; the ring is abandoned");
                self.abandon(&error);
                self.recover_lent(jobs);
                self.fail_rest(jobs, next, &error);
                return Err(error);
            }
        }
        Ok(())
    }

    /// Gives every job whose buffer is still lent to the kernel a fresh buffer (a copy of the
    /// data for a write) and an `Abandoned` result.
    fn recover_lent(&self, jobs: &mut [Job]) {
        let cause = self.abandon_cause().unwrap_or_else(|| "the ring failed".into());
        let tags: Vec<u64> = self.in_flight_tags().collect();
        for tag in tags {
            let Some(job) = usize::try_from(tag).ok().and_then(|index| jobs.get_mut(index)) else { continue };
            let mut fresh = AlignedBuffer::default();
            if job.transfer.direction == Direction::Write {
                self.copy_in_flight_write(tag, fresh.slice(job.transfer.len_bytes));
            }
            job.buffer = fresh;
            job.result = Err(UringError::Abandoned { cause: cause.clone() });
        }
    }

    /// Jobs from `first` on were never pushed: they fail with the cause, buffers untouched.
    fn fail_rest(&self, jobs: &mut [Job], first: usize, cause: &UringError) {
        for job in jobs.iter_mut().skip(first) {
            job.result = Err(UringError::Abandoned { cause: cause.to_string() });
        }
    }
}
