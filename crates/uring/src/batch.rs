//! Running a list of transfers together, alone on a ring, to the end or to a deadline. (The
//! software controller builds its batches from push, submit, wait and reap instead.)

use std::time::{Duration, Instant};

use crate::buffer::AlignedBuffer;
use crate::error::UringError;
use crate::sys::{Completion, Refused, Ring};
use crate::Transfer;

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
    /// On a ring failure or the deadline, the ring is abandoned, the transfers still in flight
    /// are cancelled ([`Ring::cancel_in_flight`], waiting until `cancel_timeout` from then), and
    /// the error is returned. Jobs the kernel gave back keep their result and buffer (completed,
    /// or failed with `ECANCELED` or another error); jobs never pushed fail with
    /// [`UringError::Abandoned`]: none of these can land later, so the caller may retry them
    /// synchronously. A job the kernel still holds fails with [`UringError::StillInFlight`] and an
    /// empty buffer (its own is leaked with the ring): it may still complete at any time, so a
    /// write among them must not be retried, nor its place written again, while it may land.
    ///
    /// A batch runs alone on its ring: completions are matched to jobs by tag, so on a ring
    /// already abandoned, or with transfers in flight from [`Ring::push`] or an earlier batch, no
    /// job is run; each fails ([`UringError::Abandoned`] or [`UringError::RingBusy`]) with its
    /// buffer untouched, and that error is returned.
    pub fn run_batch(&mut self, jobs: &mut [Job], deadline: Instant, cancel_timeout: Duration) -> Result<(), UringError> {
        if self.is_abandoned() || self.in_flight() > 0 {
            let refusal = || self.abandoned_error().unwrap_or(UringError::RingBusy { in_flight: self.in_flight() });
            for job in jobs.iter_mut() {
                job.result = Err(refusal());
            }
            return Err(refusal());
        }
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
                    fail_rest(jobs, next, &error);
                    return Err(error);
                }
                break;
            }
            let reaped = self.wait(deadline).and_then(|()| self.reap(|completion| hand_back(jobs, completion)));
            if let Err(error) = reaped {
                tracing::error!(%error, in_flight = self.in_flight(), "io_uring batch failed; the ring is abandoned and its transfers cancelled");
                self.abandon(&error);
                let kept = self.cancel_in_flight(Instant::now() + cancel_timeout, |completion| hand_back(jobs, completion));
                if kept > 0 {
                    tracing::error!(kept, "io_uring transfers still in flight after cancellation: they may complete at any time");
                }
                self.mark_still_in_flight(jobs, &error);
                fail_rest(jobs, next, &error);
                return Err(error);
            }
        }
        Ok(())
    }

    /// Jobs whose transfer the kernel still holds: [`UringError::StillInFlight`], empty buffer.
    fn mark_still_in_flight(&self, jobs: &mut [Job], cause: &UringError) {
        for (tag, _) in self.in_flight_transfers() {
            let Some(job) = usize::try_from(tag).ok().and_then(|index| jobs.get_mut(index)) else { continue };
            job.buffer = AlignedBuffer::default();
            job.result = Err(UringError::StillInFlight { cause: cause.to_string() });
        }
    }
}

/// Puts a reaped transfer's result and buffer back into the job it was pushed for.
fn hand_back(jobs: &mut [Job], completion: Completion) {
    let Some(job) = usize::try_from(completion.tag).ok().and_then(|index| jobs.get_mut(index)) else { return };
    job.result = completion.check();
    job.buffer = completion.buffer;
}

/// Jobs from `first` on were never pushed: they fail with the cause, buffers untouched.
fn fail_rest(jobs: &mut [Job], first: usize, cause: &UringError) {
    for job in jobs.iter_mut().skip(first) {
        job.result = Err(UringError::Abandoned { cause: cause.to_string() });
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::*;
    use crate::{leaked_buffers_total, Direction};

    fn data(seed: u8) -> AlignedBuffer {
        let mut buffer = AlignedBuffer::with_capacity(4096).unwrap();
        buffer.slice(4096).fill(seed);
        buffer
    }

    /// Fills the socket's send side until a write would block; returns the bytes it holds. The
    /// flag is on the shared open file, but io_uring still waits for room rather than failing.
    fn fill(socket: &mut UnixStream) -> usize {
        socket.set_nonblocking(true).unwrap();
        let mut total = 0usize;
        while let Ok(written) = socket.write(&[0u8; 4096]) {
            total += written;
        }
        total
    }

    /// A ring that cannot cancel (as for a write blocked in a hung filesystem), a file, a
    /// socket pair whose send side is full (`queued_bytes` in it), and two jobs: a write to the
    /// file (tag 0, bytes 1) and a write to the full socket (tag 1, bytes 2) that will be stuck.
    struct StuckWrite {
        ring: Ring,
        file: std::fs::File,
        sender: UnixStream,
        receiver: UnixStream,
        queued_bytes: usize,
        jobs: Vec<Job>,
    }

    /// Reads what the full socket held and the stuck write's 4096 bytes behind it (bounded).
    fn drain(receiver: &mut UnixStream, queued_bytes: usize) -> Vec<u8> {
        let mut received = vec![0u8; queued_bytes + 4096];
        receiver.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        receiver.read_exact(&mut received).unwrap();
        received
    }

    /// A ring of `entries`, or `None` (said) when io_uring with bounded waits is unavailable
    /// here. Asks `available()` first, so that with `TUTTI_REQUIRE_URING=1` a machine without
    /// io_uring fails these tests instead of passing them as skipped.
    fn ring_or_skip(entries: u32) -> Option<Ring> {
        if !crate::available() {
            eprintln!("io_uring with bounded waits is unavailable here: test skipped");
            return None;
        }
        Some(Ring::new(entries).expect("available() found io_uring usable"))
    }

    /// None when io_uring with bounded waits is unavailable here.
    fn stuck_write() -> Option<StuckWrite> {
        let mut ring = ring_or_skip(4)?;
        ring.disable_cancellation();
        let file = tempfile::tempfile().unwrap();
        let (mut sender, receiver) = UnixStream::pair().unwrap();
        let queued_bytes = fill(&mut sender);
        let jobs = vec![
            Job::new(Transfer { fd: file.as_raw_fd(), direction: Direction::Write, offset_bytes: 0, len_bytes: 4096 }, data(1)),
            Job::new(Transfer { fd: sender.as_raw_fd(), direction: Direction::Write, offset_bytes: 0, len_bytes: 4096 }, data(2)),
        ];
        Some(StuckWrite { ring, file, sender, receiver, queued_bytes, jobs })
    }

    #[test]
    fn a_transfer_the_kernel_keeps_is_reported_as_still_in_flight() {
        // Goal: when cancellation cannot take a stuck write back (disabled here, as for a write
        // blocked in a hung filesystem), run_batch says so (StillInFlight, no buffer, so no
        // retry), and the write really is still pending: it lands once the socket drains, and a
        // later cancel_in_flight reaps it. A ring dropped while it holds a transfer leaks the
        // buffer instead of freeing memory the kernel may still read.
        let Some(StuckWrite { mut ring, file, mut sender, mut receiver, queued_bytes, mut jobs }) = stuck_write() else { return };
        let error = ring.run_batch(&mut jobs, Instant::now() + Duration::from_millis(200), Duration::from_millis(100)).unwrap_err();
        assert!(matches!(error, UringError::Timeout { in_flight: 1, .. }), "{error}");
        assert!(jobs[0].result.is_ok(), "{:?}", jobs[0].result);
        assert!(matches!(jobs[1].result, Err(UringError::StillInFlight { .. })), "{:?}", jobs[1].result);
        assert_eq!(jobs[1].buffer.capacity_bytes(), 0, "the kernel still has the buffer: the job gets none");
        let held: Vec<_> = ring.in_flight_transfers().map(|(tag, transfer)| (tag, transfer.direction)).collect();
        assert_eq!(held, [(1, Direction::Write)]);
        assert_eq!(ring.cancel_in_flight(Instant::now(), |_| {}), 1, "still held");
        // Drain the socket: the write the batch gave up on lands now.
        let received = drain(&mut receiver, queued_bytes);
        assert!(received[queued_bytes..].iter().all(|&byte| byte == 2), "the late write's bytes");
        let mut landed = None;
        let left = ring.cancel_in_flight(Instant::now() + Duration::from_secs(5), |completion| landed = Some(completion.check()));
        assert_eq!(left, 0);
        assert!(matches!(landed, Some(Ok(()))), "{landed:?}");
        // Held again, and the ring dropped: the buffer is leaked and counted, not freed.
        fill(&mut sender);
        let mut ring = Ring::new(2).unwrap();
        ring.disable_cancellation();
        let mut stuck = vec![
            Job::new(Transfer { fd: sender.as_raw_fd(), direction: Direction::Write, offset_bytes: 0, len_bytes: 4096 }, data(3)),
            Job::new(Transfer { fd: file.as_raw_fd(), direction: Direction::Write, offset_bytes: 4096, len_bytes: 4096 }, data(4)),
        ];
        let leaked_before = leaked_buffers_total();
        assert!(ring.run_batch(&mut stuck, Instant::now() + Duration::from_millis(100), Duration::ZERO).is_err());
        drop(ring);
        assert_eq!(leaked_buffers_total(), leaked_before + 1, "only the held buffer is leaked");
    }

    /// Fresh jobs for a batch that must not run: two writes whose buffers carry `seed`.
    fn fresh_jobs(file: &std::fs::File, seed: u8) -> Vec<Job> {
        let write = |offset_bytes| Transfer { fd: file.as_raw_fd(), direction: Direction::Write, offset_bytes, len_bytes: 4096 };
        vec![Job::new(write(8192), data(seed)), Job::new(write(12288), data(seed))]
    }

    /// Every job failed with `expected`, and each still holds the caller's buffer with its bytes.
    fn assert_not_run(jobs: &[Job], seed: u8, expected: fn(&UringError) -> bool) {
        for job in jobs {
            assert!(job.result.as_ref().is_err_and(expected), "{:?}", job.result);
            assert_eq!(job.buffer.bytes(4096).len(), 4096, "the caller keeps its buffer");
            assert!(job.buffer.bytes(4096).iter().all(|&byte| byte == seed), "the caller's own bytes");
        }
    }

    #[test]
    fn a_batch_on_an_abandoned_ring_with_a_transfer_still_held_runs_nothing() {
        // Goal: after a batch left a write with the kernel (tag 1), a later batch is refused
        // whole: its job 1 is not matched to that write (marked StillInFlight, its buffer taken),
        // every job fails as not run and keeps the caller's buffer.
        let Some(StuckWrite { mut ring, file, sender: _sender, mut receiver, queued_bytes, mut jobs }) = stuck_write() else { return };
        assert!(ring.run_batch(&mut jobs, Instant::now() + Duration::from_millis(200), Duration::from_millis(100)).is_err());
        assert_eq!(ring.in_flight(), 1);
        let mut later = fresh_jobs(&file, 7);
        let error = ring.run_batch(&mut later, Instant::now() + Duration::from_secs(5), Duration::from_millis(100)).unwrap_err();
        assert!(matches!(error, UringError::Abandoned { .. }), "{error}");
        assert_not_run(&later, 7, |error| matches!(error, UringError::Abandoned { .. }));
        // Let the held write land and reap it, so the ring is dropped holding nothing.
        drain(&mut receiver, queued_bytes);
        assert_eq!(ring.cancel_in_flight(Instant::now() + Duration::from_secs(5), |_| {}), 0);
    }

    #[test]
    fn a_batch_on_an_abandoned_ring_with_nothing_in_flight_fails() {
        // Goal: run_batch on an abandoned ring says so (Err) rather than Ok with every job failed.
        let Some(mut ring) = ring_or_skip(4) else { return };
        let file = tempfile::tempfile().unwrap();
        ring.abandon(&UringError::NotRun);
        let mut jobs = fresh_jobs(&file, 5);
        let error = ring.run_batch(&mut jobs, Instant::now() + Duration::from_secs(5), Duration::from_millis(100)).unwrap_err();
        assert!(matches!(error, UringError::Abandoned { .. }), "{error}");
        assert_not_run(&jobs, 5, |error| matches!(error, UringError::Abandoned { .. }));
    }

    #[test]
    fn a_batch_on_a_ring_with_pushed_transfers_runs_nothing() {
        // Goal: a transfer pushed outside the batch (tag 0) is never taken for the batch's job 0:
        // the batch is refused whole (RingBusy), the ring stays usable, and the pushed transfer
        // completes and is reaped with its own buffer.
        let Some(mut ring) = ring_or_skip(4) else { return };
        let file = tempfile::tempfile().unwrap();
        let pushed = Transfer { fd: file.as_raw_fd(), direction: Direction::Write, offset_bytes: 0, len_bytes: 4096 };
        ring.push(pushed, data(3), 0).unwrap();
        let mut jobs = fresh_jobs(&file, 6);
        let error = ring.run_batch(&mut jobs, Instant::now() + Duration::from_secs(5), Duration::from_millis(100)).unwrap_err();
        assert!(matches!(error, UringError::RingBusy { in_flight: 1 }), "{error}");
        assert_not_run(&jobs, 6, |error| matches!(error, UringError::RingBusy { in_flight: 1 }));
        assert!(!ring.is_abandoned(), "a refused batch leaves the ring usable");
        let mut reaped = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        // Bounded by the deadline (a wait past it is an error).
        while reaped.is_empty() {
            ring.wait(deadline).unwrap();
            ring.reap(|completion| reaped.push(completion)).unwrap();
        }
        assert_eq!(reaped[0].tag, 0);
        reaped[0].check().unwrap();
        assert!(reaped[0].buffer.bytes(4096).iter().all(|&byte| byte == 3), "the pushed transfer's own buffer");
    }
}
