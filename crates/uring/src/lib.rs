//! The project's one io_uring wrapper: the software controller's file backing (`nvme-emu`) and
//! the kernel comparator of `tutti-bench` both go through it.
//!
//! - [`AlignedBuffer`]: page-aligned heap memory (what `O_DIRECT` needs), growable, empty
//!   without allocating.
//! - [`Ring`]: a ring that takes ownership of a transfer's buffer from [`Ring::push`] until the
//!   transfer's completion hands it back ([`Ring::reap`]), so no Rust reference to memory the
//!   kernel may write can exist, and a buffer is never freed while the kernel may still use it:
//!   a ring that is abandoned or dropped with transfers in flight leaks their buffers, logs it
//!   and counts it ([`leaked_buffers_total`]).
//! - [`Ring::push_regions`]: a transfer straight between a file and host DMA memory
//!   (`nvme_driver::hw::DmaRegion`s, vectored), with no bounce buffer: the ring keeps the
//!   regions as it keeps buffers.
//! - One timeout discipline: every wait takes a deadline ([`Ring::wait`] passes it to
//!   `io_uring_enter` through `IORING_ENTER_EXT_ARG`, Linux 5.11+), and running past it is
//!   [`UringError::Timeout`]. A kernel without that feature is refused at [`Ring::new`] rather
//!   than waited on without a bound.
//! - [`Ring::run_batch`]: a list of transfers with at most the ring's capacity in flight, run
//!   alone on its ring (one with anything in flight, or abandoned, is refused), for a caller that
//!   has the whole list at once. The software controller does not use it: it keeps transfers in
//!   flight across doorbell scans with [`Ring::push`], [`Ring::submit`], [`Ring::wait`] and
//!   [`Ring::reap`] (`nvme-emu`'s own `Controller::run_batch`). A batch that fails or runs
//!   past its deadline abandons the ring and cancels what the kernel still holds
//!   ([`Ring::cancel_in_flight`], bounded): each job then says whether it can still land
//!   ([`UringError::StillInFlight`]) or not, so a caller never retries a write that the kernel
//!   may still complete after the retry.
//!
//! - [`SetupFlags`] / [`Ring::with_setup`]: the setup flags fio's io_uring engine uses
//!   (`CQSIZE`, `COOP_TASKRUN`, `SINGLE_ISSUER`, `DEFER_TASKRUN`), for a comparator set up as fio
//!   is. A kernel that refuses one (`EINVAL`) gets a ring with fewer ([`Ring::setup_flags`] says
//!   which are in force). Under `DEFER_TASKRUN` the ring enters the kernel with
//!   `IORING_ENTER_GETEVENTS` before every look at its completions (submit, reap, cancellation),
//!   since the kernel posts them only then; under `SINGLE_ISSUER` it is bound to the first thread
//!   that enters it and refuses others with [`UringError::WrongThread`].
//!
//! All unsafe code is in the `sys` module.
#![deny(unsafe_code)]

mod batch;
mod buffer;
mod error;
mod setup;
mod sys;

pub use batch::Job;
pub use buffer::AlignedBuffer;
pub use error::UringError;
pub use setup::SetupFlags;
pub use sys::{leaked_buffers_total, Completion, Refused, RefusedRegions, Ring, REGIONS_MAX};

use std::os::fd::RawFd;

/// Which way a transfer moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the file into the buffer.
    Read,
    /// From the buffer into the file.
    Write,
}

/// One transfer: `len_bytes` at `offset_bytes` of `fd`, into or from the start of a buffer.
///
/// `fd` must stay open until the transfer completes; a descriptor closed (or reused) early makes
/// the transfer fail or touch another file, never memory other than its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    pub fd: RawFd,
    pub direction: Direction,
    pub offset_bytes: u64,
    pub len_bytes: usize,
}

/// Whether this kernel (and its seccomp or container policy) offers io_uring with bounded waits.
/// Tests call it first and skip, saying so, where it answers false.
///
/// With `TUTTI_REQUIRE_URING=1` in the environment (tools/test.sh's rust stage sets it) it never
/// answers false: it panics, naming the error, so that a machine without io_uring fails the
/// tests that need it instead of passing them as skipped.
pub fn available() -> bool {
    match Ring::new(2) {
        Ok(_) => true,
        Err(error) if std::env::var_os("TUTTI_REQUIRE_URING").is_some_and(|value| value == "1") => {
            panic!("TUTTI_REQUIRE_URING=1, but io_uring with bounded waits is unavailable here: {error}")
        }
        Err(_) => false,
    }
}
