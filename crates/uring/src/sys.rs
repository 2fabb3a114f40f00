//! Everything that touches memory the kernel reads or writes behind Rust's back: the page-aligned
//! allocation under [`crate::AlignedBuffer`] and the ring that lends such buffers to the kernel.
//! This is the crate's only module with unsafe code.
//!
//! Soundness argument: [`Ring::push`] takes a transfer's buffer by value and keeps it in its
//! in-flight table until [`Ring::reap`] sees that transfer's completion; only then is the buffer
//! handed back. While it is in the table nothing else can reach it, so no Rust reference to it
//! exists while the kernel may write it, and it cannot be freed: a ring abandoned after a failure,
//! or dropped with transfers still in flight after a bounded drain, leaks those buffers (logged,
//! and counted in [`leaked_buffers_total`]) rather than free memory the kernel may still use.
//!
//! Host DMA memory. [`Ring::push_regions`] moves data straight between a file and
//! `nvme_driver::hw::DmaRegion`s (`IORING_OP_READV` / `WRITEV`), with no buffer of the ring's
//! own: the software controller's transfers into the memory its commands point to. A `DmaRegion`
//! is memory a device may read or write at any time: Rust code never holds a reference into it
//! (its accessors are raw copies whose exclusion is the DMA protocol's, see its module), and it
//! stays allocated while a clone lives (pool memory through the clone's `Arc`; an external
//! mapping by `map_external`'s contract). The ring keeps the clones, and the iovec array naming
//! them, in its in-flight table until the completion is reaped, and leaks both with the table
//! otherwise, exactly as it does buffers.
//!
//! Cancellation. Abandoning a ring does not stop the kernel: a write it still holds can land at
//! any later time, after newer data went to the same place. [`Ring::cancel_in_flight`] asks the
//! kernel to cancel every transfer still in flight (`IORING_OP_ASYNC_CANCEL`, one per transfer)
//! and reaps until each is given back or a deadline passes; a transfer reaped that way (cancelled,
//! failed or completed) can no longer land, one still in flight afterwards can. Its cancel
//! entries carry [`CANCEL_USER_DATA`], which no transfer slot uses, and reference no memory.
//!
//! Setup flags ([`SetupFlags`], chosen with [`Ring::with_setup`]). Under `DEFER_TASKRUN` the
//! kernel posts a completion only while the ring's thread is inside `io_uring_enter` with
//! `IORING_ENTER_GETEVENTS`: the completion queue looks empty until then, however long ago the
//! transfer finished. So on such a ring every non-waiting [`Ring::submit`] enters with
//! GETEVENTS even when nothing is queued, [`Ring::reap`] enters first unless an enter has run
//! since the last reap, and cancellation enters with it before each look; waits always carry it.
//! Under `SINGLE_ISSUER` only the thread the ring is bound to (the first to enter it) may enter:
//! every call that enters checks the calling thread first and refuses another with
//! [`UringError::WrongThread`]; a ring dropped on another thread cannot drain, so it leaks
//! (counted) what it holds, as an abandoned ring does.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use io_uring::{opcode, types, EnterFlags, IoUring};

use nvme_driver::hw::DmaRegion;

use crate::buffer::AlignedBuffer;
use crate::error::UringError;
use crate::setup::{current_thread_number, set_up, set_up_in_kernel, SetupFlags, ENTRIES_MAX};
use crate::{Direction, Transfer};

/// How long dropping a ring waits for transfers still in flight before it leaks their buffers.
const DROP_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// The `user_data` of cancel entries: never a slot index (those are below the capacity, a u32).
const CANCEL_USER_DATA: u64 = u64::MAX;

/// Buffers leaked by every ring of the process (see the module documentation).
static LEAKED_BUFFERS: AtomicU64 = AtomicU64::new(0);

/// Buffers this process leaked because the kernel might still have been using them.
pub fn leaked_buffers_total() -> u64 {
    LEAKED_BUFFERS.load(Ordering::Relaxed)
}

/// Zeroed heap memory with a given alignment, freed on drop.
pub(crate) struct Allocation {
    pointer: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the allocation is plain heap memory owned by this value alone; it is reached only
// through `&self` (shared reads) or `&mut self` (exclusive), like a `Box<[u8]>`.
unsafe impl Send for Allocation {}
// SAFETY: as above: `&Allocation` only gives out `&[u8]`.
unsafe impl Sync for Allocation {}

impl Allocation {
    /// `len` zeroed bytes aligned to `align`; `None` for a zero length, an invalid layout or
    /// when the allocator refuses.
    pub(crate) fn zeroed(len: usize, align: usize) -> Option<Self> {
        let layout = Layout::from_size_align(len, align).ok().filter(|layout| layout.size() > 0)?;
        // SAFETY: the layout has a non-zero size (checked above).
        let pointer = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(Self { pointer, layout })
    }

    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `pointer` is valid for `len` initialised (zeroed at allocation) bytes owned by
        // `self`; the shared borrow of `self` keeps them from being written through Rust, and the
        // kernel never holds an `Allocation` that Rust can reach (see the module documentation).
        unsafe { std::slice::from_raw_parts(self.pointer.as_ptr(), self.len()) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.pointer.as_ptr(), self.len()) }
    }

    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.pointer.as_ptr()
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout and not freed before; a buffer
        // the kernel may still use is leaked by the ring instead of dropped.
        unsafe { std::alloc::dealloc(self.pointer.as_ptr(), self.layout) }
    }
}

/// Most bytes one read or write may move: the kernel's `MAX_RW_COUNT`, `INT_MAX` rounded down
/// to a page (0x7ffff000 with 4 KiB pages). The kernel does not refuse a longer transfer, it
/// moves this much and completes short, so a longer one is refused before it is queued.
/// Worked out once: every push checks against it.
pub(crate) fn transfer_bytes_max() -> usize {
    static MAX_BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX_BYTES.get_or_init(|| {
        // SAFETY: sysconf reads a configuration value; it has no memory-safety preconditions.
        let page_bytes = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        // A page size the kernel will not say (never on Linux): assume the largest page Linux
        // supports (64 KiB), which gives the smallest, safe, limit.
        let page_bytes = usize::try_from(page_bytes).ok().filter(|bytes| bytes.is_power_of_two()).unwrap_or(64 * 1024);
        i32::MAX as usize & !(page_bytes - 1)
    })
}

/// Most regions one vectored transfer may name (the kernel's `UIO_MAXIOV`).
pub const REGIONS_MAX: usize = 1024;

/// The memory of a transfer in flight: a buffer of the ring's, or host DMA regions.
enum Memory {
    Buffer(AlignedBuffer),
    Regions(Vec<DmaRegion>),
}

/// A transfer the kernel owns until its completion is reaped.
struct InFlight {
    memory: Memory,
    tag: u64,
    transfer: Transfer,
}

/// The iovec array of one slot, reused from transfer to transfer (no allocation per transfer
/// once it has grown). The kernel reads it while it imports the entry.
#[derive(Default)]
struct IovecTable(Vec<libc::iovec>);

// SAFETY: the table is plain data (addresses and lengths) that only the kernel dereferences,
// for a transfer whose memory the ring keeps alive (see the module documentation); moving it
// to another thread moves no access to that memory.
unsafe impl Send for IovecTable {}

/// A finished transfer: the caller's tag, its buffer (or regions) back, and the bytes moved or
/// the errno. A transfer pushed with [`Ring::push`] comes back with its buffer and no regions;
/// one pushed with [`Ring::push_regions`] with its regions and an empty buffer.
#[derive(Debug)]
pub struct Completion {
    pub tag: u64,
    pub transfer: Transfer,
    pub buffer: AlignedBuffer,
    pub regions: Vec<DmaRegion>,
    pub result: io::Result<usize>,
}

impl Completion {
    /// `Ok` when the whole transfer was done; a typed error naming it otherwise.
    pub fn check(&self) -> Result<(), UringError> {
        let Transfer { direction, offset_bytes, len_bytes, .. } = self.transfer;
        match &self.result {
            Ok(done) if *done == len_bytes => Ok(()),
            Ok(done) => Err(UringError::ShortTransfer { direction, offset_bytes, len_bytes, done_bytes: *done }),
            Err(error) => Err(UringError::Transfer {
                direction,
                offset_bytes,
                len_bytes,
                source: error.raw_os_error().map_or_else(|| io::Error::new(error.kind(), error.to_string()), io::Error::from_raw_os_error),
            }),
        }
    }
}

/// A [`Ring::push_regions`] the ring refused: the regions come back with the reason.
#[derive(Debug)]
pub struct RefusedRegions {
    pub regions: Vec<DmaRegion>,
    pub error: UringError,
}

/// A push the ring refused: the buffer comes back with the reason.
#[derive(Debug)]
pub struct Refused {
    pub buffer: AlignedBuffer,
    pub error: UringError,
}

/// Which threads may enter a ring (see [`SetupFlags::SINGLE_ISSUER`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Issuer {
    /// Any thread (no `SINGLE_ISSUER`).
    Any,
    /// A single-issuer ring set up disabled, not entered yet: the first thread to enter enables
    /// it and is bound to it.
    Unbound,
    /// The thread (a [`current_thread_number`]) bound to the ring.
    Bound(u64),
}

/// See the crate documentation.
///
/// The kernel cancels (`ECANCELED`) the transfers a thread submitted when that thread exits, so
/// a ring is used from the thread that pushes and waits (it is `Send`, to be moved before use).
/// A ring set up with [`SetupFlags::SINGLE_ISSUER`] enforces it: it is bound to the first thread
/// that enters the kernel through it and refuses the others ([`UringError::WrongThread`]).
pub struct Ring {
    ring: IoUring,
    /// The setup flags in force (those asked for, less any the kernel refused).
    setup_flags: SetupFlags,
    issuer: Issuer,
    /// On a `DEFER_TASKRUN` ring: whether an enter with GETEVENTS ran since the last reap, so the
    /// completions the kernel held then are posted and the next reap need not enter again.
    events_posted: bool,
    /// Indexed by the `user_data` of the entry; `capacity` slots, allocated once.
    in_flight: Vec<Option<InFlight>>,
    /// The iovec array of each slot (see [`IovecTable`]).
    iovecs: Vec<IovecTable>,
    /// Free slot indices (a stack), allocated once.
    free: Vec<u32>,
    /// Why the ring was abandoned, once it was: it is never used again.
    abandoned: Option<String>,
    /// Whether [`Ring::cancel_in_flight`] submits cancel entries (false only for tests that need
    /// a transfer the kernel keeps, as a write stuck in a hung filesystem is kept).
    cancellation_enabled: bool,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("capacity", &self.capacity())
            .field("in_flight", &self.in_flight())
            .field("setup_flags", &self.setup_flags)
            .finish()
    }
}

/// Refuses an offset the kernel would not take as the file position the caller means: the
/// kernel's offset is a signed `loff_t`, where -1 (`u64::MAX`) means "the file's current
/// position", so the transfer must lie wholly within `0..=i64::MAX`.
fn check_offset(transfer: &Transfer) -> Result<(), UringError> {
    let end = u64::try_from(transfer.len_bytes).ok().and_then(|len| transfer.offset_bytes.checked_add(len));
    match end {
        Some(end) if end <= i64::MAX as u64 => Ok(()),
        _ => Err(UringError::BadOffset { offset_bytes: transfer.offset_bytes, len_bytes: transfer.len_bytes }),
    }
}

impl Ring {
    /// A plain ring (no setup flags) for up to `entries` transfers in flight (rounded up to a
    /// power of two, at least 2; more than 32768, io_uring's limit, is refused). Refused where
    /// io_uring is missing, forbidden, or too old for bounded waits.
    pub fn new(entries: u32) -> Result<Self, UringError> {
        Self::with_setup(entries, SetupFlags::NONE)
    }

    /// [`Ring::new`] with setup `flags`. A kernel that refuses one (`EINVAL`, an older kernel)
    /// gets the ring with fewer, newest dropped first; [`Ring::setup_flags`] says which are in
    /// force.
    pub fn with_setup(entries: u32, flags: SetupFlags) -> Result<Self, UringError> {
        Self::set_up_with(entries, flags, set_up_in_kernel)
    }

    /// [`Ring::with_setup`] through `setup` in place of the kernel's `io_uring_setup` (tests
    /// inject refusals there).
    pub(crate) fn set_up_with(
        entries: u32,
        flags: SetupFlags,
        setup: impl FnMut(u32, SetupFlags) -> io::Result<IoUring>,
    ) -> Result<Self, UringError> {
        if entries > ENTRIES_MAX {
            return Err(UringError::TooManyEntries { entries, max: ENTRIES_MAX });
        }
        // At most ENTRIES_MAX, a power of two: the rounding cannot overflow or pass it.
        let entries = entries.max(2).next_power_of_two();
        let (ring, setup_flags) = set_up(entries, flags, setup)?;
        if !ring.params().is_feature_ext_arg() {
            return Err(UringError::Unsupported {
                reason: "the kernel's io_uring lacks IORING_FEAT_EXT_ARG (Linux 5.11+), needed for waits with a deadline".into(),
                source: None,
            });
        }
        let capacity = entries as usize;
        Ok(Self {
            ring,
            setup_flags,
            issuer: if setup_flags.contains(SetupFlags::SINGLE_ISSUER) { Issuer::Unbound } else { Issuer::Any },
            events_posted: false,
            in_flight: (0..capacity).map(|_| None).collect(),
            iovecs: (0..capacity).map(|_| IovecTable::default()).collect(),
            free: (0..entries).rev().collect(),
            abandoned: None,
            cancellation_enabled: true,
        })
    }

    /// The setup flags in force: those asked for less any the kernel refused.
    pub fn setup_flags(&self) -> SetupFlags {
        self.setup_flags
    }

    /// Checks that the calling thread may enter the kernel through this ring; the first thread to
    /// enter a single-issuer ring enables it (`IORING_REGISTER_ENABLE_RINGS`) and is bound to it.
    fn claim_issuer(&mut self, operation: &'static str) -> Result<(), UringError> {
        match self.issuer {
            Issuer::Any => Ok(()),
            Issuer::Bound(thread) if thread == current_thread_number() => Ok(()),
            Issuer::Bound(_) => Err(UringError::WrongThread { operation }),
            Issuer::Unbound => {
                self.ring.submitter().register_enable_rings().map_err(|source| UringError::Enable { source })?;
                self.issuer = Issuer::Bound(current_thread_number());
                Ok(())
            }
        }
    }

    /// Transfers that can be in flight at once.
    pub fn capacity(&self) -> usize {
        self.in_flight.len()
    }

    /// Transfers pushed and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.capacity() - self.free.len()
    }

    /// Whether [`Ring::abandon`] was called (every later call fails).
    pub fn is_abandoned(&self) -> bool {
        self.abandoned.is_some()
    }

    pub(crate) fn abandoned_error(&self) -> Option<UringError> {
        self.abandoned.as_ref().map(|cause| UringError::Abandoned { cause: cause.clone() })
    }

    /// Queues `transfer` on `buffer`, which the ring keeps until the transfer's completion is
    /// reaped; `tag` comes back with it. The entry reaches the kernel at the next
    /// [`Ring::submit`] or [`Ring::wait`]. A refusal hands the buffer back; a transfer that does
    /// not lie within `0..=i64::MAX` of the file is one ([`UringError::BadOffset`]).
    pub fn push(&mut self, transfer: Transfer, mut buffer: AlignedBuffer, tag: u64) -> Result<(), Refused> {
        let refuse = |buffer, error| Err(Refused { buffer, error });
        if let Some(error) = self.abandoned_error() {
            return refuse(buffer, error);
        }
        let max_bytes = transfer_bytes_max();
        let Some(len) = u32::try_from(transfer.len_bytes).ok().filter(|_| transfer.len_bytes <= max_bytes) else {
            return refuse(buffer, UringError::TransferTooLarge { len_bytes: transfer.len_bytes, max_bytes });
        };
        if let Err(error) = check_offset(&transfer) {
            return refuse(buffer, error);
        }
        if buffer.capacity_bytes() < transfer.len_bytes {
            let capacity_bytes = buffer.capacity_bytes();
            return refuse(buffer, UringError::BufferTooSmall { len_bytes: transfer.len_bytes, capacity_bytes });
        }
        let Some(&slot) = self.free.last() else {
            let capacity = self.capacity();
            return refuse(buffer, UringError::Full { capacity });
        };
        // An empty buffer (a zero-length transfer) has no allocation: a dangling, aligned
        // pointer that the kernel never dereferences for zero bytes.
        let memory = buffer.allocation_mut().map_or(NonNull::<u64>::dangling().as_ptr().cast::<u8>(), Allocation::as_mut_ptr);
        let fd = types::Fd(transfer.fd);
        let entry = match transfer.direction {
            Direction::Read => opcode::Read::new(fd, memory, len).offset(transfer.offset_bytes).build(),
            Direction::Write => opcode::Write::new(fd, memory.cast_const(), len).offset(transfer.offset_bytes).build(),
        }
        .user_data(u64::from(slot));
        // SAFETY: the entry names `len` bytes of `buffer`'s allocation (capacity checked above),
        // and `buffer` moves into the in-flight table below, where nothing reaches it until this
        // entry's completion is reaped (or it is leaked): the memory stays valid and unaliased for
        // as long as the kernel may use it. The fd is the caller's to keep open (see `Transfer`);
        // a stale one cannot make the kernel touch any memory but this buffer.
        if unsafe { self.ring.submission().push(&entry) }.is_err() {
            let capacity = self.capacity();
            return refuse(buffer, UringError::Full { capacity });
        }
        self.free.pop();
        self.in_flight[slot as usize] = Some(InFlight { memory: Memory::Buffer(buffer), tag, transfer });
        Ok(())
    }

    /// Queues `transfer` straight between the file and `regions` (host DMA memory, in order; at
    /// most [`REGIONS_MAX`], their lengths adding up to the transfer's), with no buffer of the
    /// ring's: `IORING_OP_READV` / `WRITEV`. The ring keeps the regions until the transfer's
    /// completion is reaped (see the module documentation); `tag` comes back with them. The
    /// caller must not touch the regions' memory meanwhile (the DMA protocol), and, for
    /// `O_DIRECT` descriptors, align them as the file needs (a refusal is the completion's
    /// `EINVAL`). A refusal hands the regions back (an offset as for [`Ring::push`] is one).
    pub fn push_regions(&mut self, transfer: Transfer, regions: Vec<DmaRegion>, tag: u64) -> Result<(), RefusedRegions> {
        let refuse = |regions, error| Err(RefusedRegions { regions, error });
        if let Some(error) = self.abandoned_error() {
            return refuse(regions, error);
        }
        let total = regions.iter().try_fold(0usize, |total, region| total.checked_add(region.len()));
        let max_bytes = transfer_bytes_max();
        if transfer.len_bytes > max_bytes || total != Some(transfer.len_bytes) {
            return refuse(regions, UringError::TransferTooLarge { len_bytes: transfer.len_bytes, max_bytes });
        }
        if regions.is_empty() || regions.len() > REGIONS_MAX {
            let count = regions.len();
            return refuse(regions, UringError::Regions { count, max: REGIONS_MAX });
        }
        if let Err(error) = check_offset(&transfer) {
            return refuse(regions, error);
        }
        let Some(&slot) = self.free.last() else {
            let capacity = self.capacity();
            return refuse(regions, UringError::Full { capacity });
        };
        let table = &mut self.iovecs[slot as usize].0;
        table.clear();
        table.extend(
            regions.iter().map(|region| libc::iovec { iov_base: region.host_address() as *mut libc::c_void, iov_len: region.len() }),
        );
        let fd = types::Fd(transfer.fd);
        // At most REGIONS_MAX (checked above): fits u32.
        let count = table.len() as u32;
        let entry = match transfer.direction {
            Direction::Read => opcode::Readv::new(fd, table.as_ptr(), count).offset(transfer.offset_bytes).build(),
            Direction::Write => opcode::Writev::new(fd, table.as_ptr(), count).offset(transfer.offset_bytes).build(),
        }
        .user_data(u64::from(slot));
        // SAFETY: the entry names this slot's iovec table, which is not touched again until the
        // slot is free (its transfer reaped) and is leaked with the ring otherwise, and through
        // it exactly the memory of `regions`: DMA memory, never referenced by Rust, that stays
        // allocated while these clones live (module documentation). The clones move into the
        // in-flight table below, where they stay until this entry's completion is reaped or the
        // ring leaks them. The fd is the caller's to keep open (see `Transfer`).
        if unsafe { self.ring.submission().push(&entry) }.is_err() {
            let capacity = self.capacity();
            return refuse(regions, UringError::Full { capacity });
        }
        self.free.pop();
        self.in_flight[slot as usize] = Some(InFlight { memory: Memory::Regions(regions), tag, transfer });
        Ok(())
    }

    /// Hands queued entries to the kernel without waiting. A busy or interrupted kernel is not an
    /// error: the entries stay queued for the next call.
    ///
    /// On a `DEFER_TASKRUN` ring it also posts the completions the kernel holds (it enters with
    /// GETEVENTS whenever a transfer is in flight, even with nothing queued).
    pub fn submit(&mut self) -> Result<(), UringError> {
        if let Some(error) = self.abandoned_error() {
            return Err(error);
        }
        self.claim_issuer("submit")?;
        self.submit_queued()
    }

    /// [`Ring::submit`] without the abandonment and thread checks (cancellation runs on
    /// abandoned rings; callers check the thread).
    fn submit_queued(&mut self) -> Result<(), UringError> {
        let result = if self.setup_flags.defers_task_run() {
            if self.ring.submission().is_empty() && self.in_flight() == 0 {
                return Ok(());
            }
            self.enter_for_events()
        } else {
            if self.ring.submission().is_empty() {
                return Ok(());
            }
            self.ring.submit()
        };
        match result {
            Ok(_) => Ok(()),
            Err(error) if retryable(&error) => Ok(()),
            Err(source) => Err(UringError::Enter { source }),
        }
    }

    /// One `io_uring_enter` that submits what is queued and, with GETEVENTS and no minimum,
    /// makes the kernel post the completions it holds for this thread (a `DEFER_TASKRUN` ring's
    /// only way to see them without waiting). The caller has checked the thread.
    fn enter_for_events(&mut self) -> io::Result<usize> {
        let queued = self.ring.submission().len() as u32;
        // SAFETY: `queued` counts entries pushed by `push`, `push_regions` and `push_cancel`,
        // whose memory stays valid until their completions are reaped (see their SAFETY
        // comments); no argument pointer is passed (none is read for these flags).
        let entered = unsafe { self.ring.submitter().enter::<libc::sigset_t>(queued, 0, EnterFlags::GETEVENTS.bits(), None) };
        if entered.is_ok() {
            self.events_posted = true;
        }
        entered
    }

    /// Submits queued entries (also when `deadline` has passed already) and waits until at
    /// least one completion is ready or `deadline` passes ([`UringError::Timeout`]). Returns at
    /// once (after submitting) when a completion is already there or nothing is in flight; past
    /// its deadline, also when that submit posted one.
    pub fn wait(&mut self, deadline: Instant) -> Result<(), UringError> {
        if let Some(error) = self.abandoned_error() {
            return Err(error);
        }
        self.claim_issuer("wait")?;
        self.wait_for_completion(deadline)
    }

    /// [`Ring::wait`] without the abandonment check (cancellation runs on abandoned rings).
    fn wait_for_completion(&mut self, deadline: Instant) -> Result<(), UringError> {
        let started = Instant::now();
        // Bounded by the deadline: every pass either returns or sleeps in the kernel until it.
        loop {
            if !self.ring.completion().is_empty() || self.in_flight() == 0 {
                // Entries queued since the last call still go to the kernel now.
                return self.submit_queued();
            }
            let now = Instant::now();
            if now >= deadline {
                // Queued entries still go to the kernel: a deadline that had passed before the
                // wait below (which submits them too) was ever reached would leave them queued,
                // counted in flight and never started, until some later call. Only here, so a
                // wait whose deadline is ahead stays one `io_uring_enter` (submit and wait).
                self.submit_queued()?;
                // That submit may have completed a transfer inline (a write with room), or, on
                // a `DEFER_TASKRUN` ring, posted completions the kernel held: the wait then
                // found what it waits for, and a Timeout would send the caller to fail a ring
                // whose completion is ready to reap.
                if !self.ring.completion().is_empty() {
                    return Ok(());
                }
                return Err(UringError::Timeout { waited: now.saturating_duration_since(started), in_flight: self.in_flight() });
            }
            let left = deadline.saturating_duration_since(now);
            let timespec = types::Timespec::new().sec(left.as_secs()).nsec(left.subsec_nanos());
            let arguments = types::SubmitArgs::new().timespec(&timespec);
            // Waiting for one completion always carries GETEVENTS, which on a `DEFER_TASKRUN`
            // ring also posts every completion held.
            match self.ring.submitter().submit_with_args(1, &arguments) {
                Ok(_) => self.events_posted = true,
                // ETIME: the deadline passed in the kernel; the loop reports it (or a completion
                // that raced it).
                Err(error) if error.raw_os_error() == Some(libc::ETIME) || retryable(&error) => {}
                Err(source) => return Err(UringError::Enter { source }),
            }
        }
    }

    /// Hands every completion that is ready to `on_done`, with its buffer; returns how many. A
    /// completion naming no transfer in flight is consumed and reported after the others. On a
    /// `DEFER_TASKRUN` ring, enters the kernel first (GETEVENTS, no wait) unless a submit or wait
    /// did since the last reap.
    pub fn reap(&mut self, mut on_done: impl FnMut(Completion)) -> Result<usize, UringError> {
        if self.setup_flags.defers_task_run() {
            self.claim_issuer("reap")?;
            if !self.events_posted && self.in_flight() > 0 {
                match self.enter_for_events() {
                    Ok(_) => {}
                    Err(error) if retryable(&error) => {}
                    Err(source) => return Err(UringError::Enter { source }),
                }
            }
            self.events_posted = false;
        }
        let mut done = 0;
        let mut unexpected = None;
        for entry in self.ring.completion() {
            let user_data = entry.user_data();
            if user_data == CANCEL_USER_DATA {
                // A cancel request's own answer (found, not found, already running): what
                // matters is whether the transfer it named comes back, which its own entry says.
                continue;
            }
            let Some(in_flight) = usize::try_from(user_data).ok().and_then(|slot| self.in_flight.get_mut(slot)).and_then(Option::take)
            else {
                unexpected = Some(user_data);
                continue;
            };
            // The slot index fits u32: it came from `free`, which holds only u32 values.
            self.free.push(user_data as u32);
            let result = entry.result();
            let result = if result < 0 { Err(io::Error::from_raw_os_error(-result)) } else { Ok(result as usize) };
            done += 1;
            let (buffer, regions) = match in_flight.memory {
                Memory::Buffer(buffer) => (buffer, Vec::new()),
                Memory::Regions(regions) => (AlignedBuffer::default(), regions),
            };
            on_done(Completion { tag: in_flight.tag, transfer: in_flight.transfer, buffer, regions, result });
        }
        match unexpected {
            Some(user_data) => Err(UringError::UnexpectedCompletion { user_data }),
            None => Ok(done),
        }
    }

    /// Gives up on the ring after a failure: it is never used again, and the buffers of
    /// transfers still in flight stay with it, to be leaked when it is dropped.
    pub fn abandon(&mut self, cause: &UringError) {
        self.abandoned.get_or_insert_with(|| cause.to_string());
    }

    /// Queues one `IORING_OP_ASYNC_CANCEL` entry; false when the submission queue is full.
    fn push_cancel(&mut self, entry: &io_uring::squeue::Entry) -> bool {
        // SAFETY: a cancel entry names the transfer it cancels by `user_data` and references no
        // memory, so nothing it points to can be freed or reused while the kernel holds it.
        unsafe { self.ring.submission().push(entry) }.is_ok()
    }

    /// The transfers still in flight, with the tags they were pushed with.
    pub fn in_flight_transfers(&self) -> impl Iterator<Item = (u64, Transfer)> + '_ {
        self.in_flight.iter().flatten().map(|in_flight| (in_flight.tag, in_flight.transfer))
    }

    /// Asks the kernel to cancel every transfer still in flight and reaps until none is left or
    /// `deadline` passes, handing each one reaped to `on_done` with its buffer (its result says
    /// whether it was cancelled, failed or completed before the cancel reached it). Returns how
    /// many stay in flight: those may still complete, and a write among them may still land, at
    /// any time. Works on an abandoned ring (that is what it is for) and may be called again
    /// later, with a deadline of now, to learn whether the kernel has given them back since.
    pub fn cancel_in_flight(&mut self, deadline: Instant, mut on_done: impl FnMut(Completion)) -> usize {
        if let Err(error) = self.claim_issuer("cancel") {
            tracing::error!(%error, in_flight = self.in_flight(), "io_uring cancellation impossible from this thread");
            return self.in_flight();
        }
        if self.cancellation_enabled {
            // Bounded: one cancel entry per slot in flight, at most the capacity.
            for slot in 0..self.in_flight.len() {
                if self.in_flight[slot].is_none() {
                    continue;
                }
                let entry = opcode::AsyncCancel::new(slot as u64).build().user_data(CANCEL_USER_DATA);
                // A full submission queue is submitted once to make room.
                let pushed = self.push_cancel(&entry) || (self.submit_queued().is_ok() && self.push_cancel(&entry));
                if !pushed {
                    tracing::error!(slot, "io_uring cancel could not be queued; that transfer is left to finish on its own");
                }
            }
        }
        // Enter the kernel even with nothing to submit, with GETEVENTS: completions it owes this
        // thread are posted on the way back (task work, deferred or not), so a transfer given
        // back since the last call is seen by the reap below even with a deadline of now.
        match self.enter_for_events() {
            Ok(_) => {}
            Err(error) if retryable(&error) => {}
            Err(error) => tracing::error!(%error, "io_uring_enter during cancellation failed"),
        }
        // Bounded by the deadline: each pass reaps, or waits in the kernel until the deadline.
        loop {
            if let Err(error) = self.reap(&mut on_done) {
                tracing::error!(%error, "io_uring reaping during cancellation");
            }
            if self.in_flight() == 0 || Instant::now() >= deadline {
                return self.in_flight();
            }
            match self.wait_for_completion(deadline) {
                Ok(()) | Err(UringError::Timeout { .. }) => {}
                Err(error) => {
                    tracing::error!(%error, "io_uring wait during cancellation failed");
                    return self.in_flight();
                }
            }
        }
    }

    /// Makes [`Ring::cancel_in_flight`] submit no cancel requests, so that a transfer stuck in
    /// the kernel stays in flight as one the kernel cannot cancel would (a write blocked in a
    /// hung filesystem): for tests of what callers do with such transfers.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn disable_cancellation(&mut self) {
        self.cancellation_enabled = false;
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // A single-issuer ring dropped on another thread cannot enter the kernel to drain: what
        // it holds is leaked below, as an abandoned ring's is.
        if self.in_flight() > 0 && self.abandoned.is_none() && self.claim_issuer("drop").is_ok() {
            let deadline = Instant::now() + DROP_DRAIN_TIMEOUT;
            while self.in_flight() > 0 {
                if self.wait(deadline).is_err() || self.reap(drop).is_err() {
                    break;
                }
            }
        }
        let mut leaked = 0u64;
        for (slot, table) in self.in_flight.iter_mut().zip(&mut self.iovecs) {
            if let Some(in_flight) = slot.take() {
                // The kernel may still read or write it (closing the ring does not wait for
                // every transfer): never free it, nor the iovec table naming it.
                std::mem::forget(in_flight.memory);
                std::mem::forget(std::mem::take(table));
                leaked += 1;
            }
        }
        if leaked > 0 {
            LEAKED_BUFFERS.fetch_add(leaked, Ordering::Relaxed);
            tracing::error!(leaked, abandoned = ?self.abandoned, "io_uring ring dropped with transfers in flight: their buffers are leaked");
        }
    }
}

/// Errors of `io_uring_enter` that mean "try again": interrupted, or the kernel short of
/// resources or with a full completion queue (reaping makes room).
fn retryable(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY))
}
