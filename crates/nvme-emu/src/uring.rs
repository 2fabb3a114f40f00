//! Batched backing-store reads and writes through io_uring: several transfers in flight per
//! batch instead of one synchronous `pread`/`pwrite` each. This is the only module of the crate
//! with unsafe code.
//!
//! Soundness argument: the kernel writes into a read job's buffer (and reads a write job's)
//! between the push of its entry and the reaping of its completion. Jobs own their buffers (heap
//! memory that does not move when the job does), the caller lends the whole job list mutably
//! for the duration of [`UringReader::run`], and `run` returns only after every pushed entry was
//! reaped, except when the ring fails irrecoverably: then the buffers still in flight are leaked
//! (never freed), so the kernel can never touch freed memory.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types, IoUring};

use crate::backing::AlignedBuffer;

/// Retries of a failing `io_uring_enter` before giving up on the batch.
const SUBMIT_RETRIES_MAX: u32 = 100;

/// One transfer: `len` bytes at `offset` of `fd` into (a read) or from (a write) the start of
/// `buffer`'s aligned slice.
pub(crate) struct ReadJob {
    pub fd: RawFd,
    /// A write of the buffer's first `len` bytes, which the caller filled before `run`.
    pub write: bool,
    pub offset: u64,
    pub len: usize,
    pub buffer: AlignedBuffer,
    pub result: io::Result<()>,
}

pub(crate) struct UringReader {
    ring: IoUring,
    depth: usize,
    /// Tags completions with the batch they belong to (high 32 bits of user data), so that a
    /// stale completion can never be taken for one of a later batch.
    generation: u32,
    /// Set when a batch had to be abandoned: entries may still sit in the ring, so it is never
    /// used again (every later read is synchronous).
    broken: bool,
}

impl UringReader {
    pub(crate) fn new(depth: u32) -> io::Result<Self> {
        Ok(Self { ring: IoUring::new(depth)?, depth: depth as usize, generation: 0, broken: false })
    }

    /// Runs every job, at most `depth` in flight, in no particular order (the caller never puts
    /// overlapping writes, or a write and an overlapping read, in one batch); each job's `result`
    /// says how it went (a short transfer is an `UnexpectedEof` error; the caller may retry
    /// synchronously, which for a write rewrites the same bytes).
    pub(crate) fn run(&mut self, jobs: &mut [ReadJob]) {
        if self.broken {
            return;
        }
        self.generation = self.generation.wrapping_add(1);
        let tag = u64::from(self.generation) << 32;
        let mut next = 0usize;
        let mut in_flight = 0usize;
        let mut failures = 0u32;
        // Bounded: each pass pushes or reaps at least one job, or counts a failure.
        while next < jobs.len() || in_flight > 0 {
            while next < jobs.len() && in_flight < self.depth {
                let Some(job) = jobs.get_mut(next) else { break };
                let Ok(len) = u32::try_from(job.len) else {
                    job.result = Err(io::Error::from(io::ErrorKind::InvalidInput));
                    next += 1;
                    continue;
                };
                let memory = job.buffer.slice(job.len).as_mut_ptr();
                let entry = if job.write {
                    opcode::Write::new(types::Fd(job.fd), memory.cast_const(), len).offset(job.offset).build()
                } else {
                    opcode::Read::new(types::Fd(job.fd), memory, len).offset(job.offset).build()
                };
                let entry = entry.user_data(tag | next as u64);
                // `abandon` only reads a write job's buffer, which the kernel also only reads; `fd` is an open
                // descriptor the store keeps for its whole life.
                // SAFETY: `memory..+len` is the job's own heap buffer, allocated, unmoved and not otherwise
                // accessed until this entry's completion is reaped below (or leaked if the ring fails).
                if unsafe { self.ring.submission().push(&entry) }.is_err() {
                    break;
                }
                next += 1;
                in_flight += 1;
            }
            if in_flight == 0 {
                // Nothing could be pushed into an empty ring: leave the rest to the caller's
                // synchronous fallback rather than spin.
                return;
            }
            if let Err(error) = self.ring.submit_and_wait(1) {
                let retryable = matches!(error.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock)
                    || error.raw_os_error() == Some(libc::EBUSY);
                failures += 1;
                if !retryable || failures > SUBMIT_RETRIES_MAX {
                    tracing::error!(%error, "io_uring submission failed; leaking the buffers of reads in flight");
                    self.abandon(jobs, &error);
                    return;
                }
                continue;
            }
            for completion in self.ring.completion() {
                if completion.user_data() & !0xFFFF_FFFF != tag {
                    continue;
                }
                let Some(job) = jobs.get_mut((completion.user_data() & 0xFFFF_FFFF) as usize) else { continue };
                in_flight = in_flight.saturating_sub(1);
                let transferred = completion.result();
                job.result = if transferred < 0 {
                    Err(io::Error::from_raw_os_error(-transferred))
                } else if transferred as usize == job.len {
                    Ok(())
                } else {
                    Err(io::Error::from(io::ErrorKind::UnexpectedEof))
                };
            }
        }
    }

    /// Gives up on the batch: buffers of transfers still in flight may yet be used by the
    /// kernel, so every job's buffer is leaked rather than freed, and every job reports an error
    /// (the caller falls back to synchronous transfers). A write job gets a fresh buffer with a
    /// copy of its data first, so that its synchronous retry writes the same bytes.
    fn abandon(&mut self, jobs: &mut [ReadJob], error: &io::Error) {
        self.broken = true;
        for job in jobs.iter_mut() {
            let mut fresh = AlignedBuffer::default();
            if job.write {
                fresh.slice(job.len).copy_from_slice(job.buffer.bytes(job.len));
            }
            std::mem::forget(std::mem::replace(&mut job.buffer, fresh));
            job.result = Err(io::Error::new(error.kind(), error.to_string()));
        }
    }
}
