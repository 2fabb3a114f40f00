//! Failures of the io_uring wrapper.

use std::io;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum UringError {
    #[error("io_uring is unavailable: {reason}")]
    Unsupported { reason: String, source: Option<io::Error> },
    /// More entries than the kernel sets a ring up with (`IORING_MAX_ENTRIES`; it answers `EINVAL`).
    #[error("a ring of {entries} entries is more than io_uring allows ({max}, IORING_MAX_ENTRIES)")]
    TooManyEntries { entries: u32, max: u32 },
    #[error("the transfer was not run")]
    NotRun,
    #[error("io_uring wait ran past its deadline ({waited:?}) with {in_flight} transfer(s) in flight")]
    Timeout { waited: Duration, in_flight: usize },
    #[error("io_uring_enter failed: {source}")]
    Enter { source: io::Error },
    /// A single-issuer ring (`IORING_SETUP_SINGLE_ISSUER`) is bound to the first thread that
    /// entered it; the kernel refuses every other thread, and so does the ring, before entering.
    #[error("io_uring {operation} refused: the ring is bound to another thread (IORING_SETUP_SINGLE_ISSUER)")]
    WrongThread { operation: &'static str },
    #[error("enabling the single-issuer ring failed (IORING_REGISTER_ENABLE_RINGS): {source}")]
    Enable { source: io::Error },
    #[error("the ring has all {capacity} transfers in flight (or its submission queue is full)")]
    Full { capacity: usize },
    #[error("a transfer of {len_bytes} bytes does not fit its {capacity_bytes}-byte buffer")]
    BufferTooSmall { len_bytes: usize, capacity_bytes: usize },
    /// Longer than one kernel read or write moves (`MAX_RW_COUNT`, `max_bytes`: a longer one
    /// would complete short), or, for [`crate::Ring::push_regions`], not the length its regions
    /// add up to.
    #[error(
        "a transfer of {len_bytes} bytes is larger than one kernel read or write moves ({max_bytes} bytes, MAX_RW_COUNT), or does not match the memory it names"
    )]
    TransferTooLarge { len_bytes: usize, max_bytes: usize },
    /// An offset the kernel does not take as a file position: above `i64::MAX` (its `loff_t`;
    /// `u64::MAX` would read as -1, "the current position"), or with an end past it.
    #[error("a transfer of {len_bytes} bytes at offset {offset_bytes} does not fit in a file position (at most i64::MAX)")]
    BadOffset { offset_bytes: u64, len_bytes: usize },
    #[error("a vectored transfer names {count} regions (1..={max} allowed)")]
    Regions { count: usize, max: usize },
    /// The transfer was not run (or the ring was already abandoned): it will not run later.
    #[error("the ring was abandoned after an earlier failure ({cause}); this transfer was not run")]
    Abandoned { cause: String },
    /// The ring was abandoned and the kernel did not give this transfer back when asked to cancel
    /// it: it may still complete at any time (a write may still land).
    #[error(
        "the ring was abandoned after an earlier failure ({cause}) and the kernel still holds this transfer: it may complete at any time"
    )]
    StillInFlight { cause: String },
    /// [`crate::Ring::run_batch`] on a ring with transfers in flight from [`crate::Ring::push`] or
    /// an earlier batch: their completions could not be told from the batch's own, so the batch
    /// was not run (every job fails with this and keeps its buffer). Reap those first.
    #[error("the ring has {in_flight} transfer(s) in flight from outside this batch; the batch was not run")]
    RingBusy { in_flight: usize },
    #[error("a completion names slot {user_data}, which has no transfer in flight")]
    UnexpectedCompletion { user_data: u64 },
    #[error("{direction:?} of {len_bytes} bytes at offset {offset_bytes} failed: {source}")]
    Transfer { direction: crate::Direction, offset_bytes: u64, len_bytes: usize, source: io::Error },
    #[error("{direction:?} at offset {offset_bytes} moved {done_bytes} of {len_bytes} bytes (past the end of the file?)")]
    ShortTransfer { direction: crate::Direction, offset_bytes: u64, len_bytes: usize, done_bytes: usize },
    #[error("cannot allocate {len_bytes} bytes of page-aligned buffer")]
    Allocation { len_bytes: usize },
}
