//! The controller proper: state machine (disabled, ready, fatal), doorbell scanning, command
//! dispatch and completion posting. Admin and NVM command handlers live in `admin` and `io`.
//!
//! Enable, reset, shutdown and power loss are in `controller/lifecycle.rs`; the cache's
//! write-back in `controller/write_back.rs`; backing-store I/O in flight (io_uring, its
//! cancellation and the store fence) in `controller/batch.rs`; a long zeroing, run a slice per
//! poll, in `controller/zeroing.rs`.
//!
//! `ControllerCore` is plain single-threaded state; the device thread owns it behind a mutex and
//! calls [`ControllerCore::poll`] in a loop, and the fuzz entry point drives
//! [`ControllerCore::execute`] directly.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::hw::DmaPool;
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{CompletionEntry, NvmOpcode, NvmeStatus, StatusCodeType, SubmissionEntry};
use nvme_driver::CommandId;

use crate::backing::{AlignedBuffer, Store};
use crate::cache::WriteCache;
use crate::config::EmuConfig;
use crate::faults::{FaultAction, FaultPlan, FaultState};
use crate::queues::{CompletionQueue, SubmissionQueue};
use crate::registers::RegisterFile;
use crate::restriction::{PendingRestrictions, QueueRestriction};
use crate::shadow::ShadowDoorbells;
use crate::stats::{Counters, EmuStats};
use crate::timing::{FinishedCommand, TimingState};
use crate::uring::UringReader;
use crate::EmuError;

mod batch;
mod cancellation;
mod in_flight;
mod lifecycle;
mod write_back;
mod zeroing;

use in_flight::InFlight;

/// Commands fetched from one SQ per scan, so one busy queue cannot starve the others.
const COMMANDS_PER_QUEUE_PER_SCAN: usize = 64;
/// Idle sleep of a disabled controller (a CC write through RegisterIo unparks it at once).
const DISABLED_SLEEP: Duration = Duration::from_millis(2);
/// Longest delay a fault may impose on a completion.
const MAX_FAULT_DELAY: Duration = Duration::from_secs(3600);
/// Transfers in flight at once through io_uring (the bounced ones also by `in_flight_bytes_max`).
const URING_DEPTH: u32 = 128;
/// Largest single backing-store write during a cache write-back.
const WRITE_BACK_CHUNK_BYTES: usize = 1 << 20;
/// Error Information log entries kept (Identify ELPE + 1).
pub(crate) const ERROR_LOG_ENTRIES: usize = 64;
/// CSTS bits (§3.1.3.6).
const CSTS_READY: u32 = 1;
const CSTS_FATAL: u32 = 1 << 1;
const CSTS_SHUTDOWN_MASK: u32 = 0x3 << 2;
const CSTS_SHUTDOWN_OCCURRING: u32 = 0x1 << 2;
const CSTS_SHUTDOWN_COMPLETE: u32 = 0x2 << 2;

/// A command's result: completion dword 0 on success, or the status to report.
pub(crate) type CommandResult = Result<u32, NvmeStatus>;

pub(crate) fn generic(code: u8) -> NvmeStatus {
    NvmeStatus::generic(code)
}

pub(crate) fn command_specific(code: u8) -> NvmeStatus {
    NvmeStatus::command_specific(code)
}

pub(crate) fn media(code: u8) -> NvmeStatus {
    NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, code)
}

/// One namespace's geometry and its place in the backing store.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Namespace {
    pub block_size_bytes: u32,
    pub blocks: u64,
    pub base_offset_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Disabled,
    Ready,
    /// CSTS.CFS is set; nothing is processed until the host clears CC.EN.
    Fatal,
    /// A stop (CC.EN cleared, a power loss or a function reset) deleted the queues, but the
    /// kernel still holds transfers straight into host memory that cancellation could not take
    /// back: CSTS reads RDY = 1 with CFS, never a clean stop, until the kernel gives them back.
    Stopping,
}

/// Features the host can set (§5.27).
pub(crate) struct Features {
    /// Number of Queues granted (I/O SQs, I/O CQs).
    pub submission_queues_granted: u16,
    pub completion_queues_granted: u16,
    /// Volatile Write Cache enable (only meaningful when the cache is present).
    pub write_cache_enabled: bool,
}

struct PendingCompletion {
    due: Instant,
    completion_queue_id: u16,
    entry: CompletionEntry,
}

/// The last errors, newest last, for the Error Information log page.
#[derive(Default)]
pub(crate) struct ErrorLog {
    pub entries: VecDeque<[u8; 64]>,
    pub count: u64,
}

impl ErrorLog {
    fn record(&mut self, queue_id: u16, entry: &SubmissionEntry, status_field: u16) {
        self.count += 1;
        let mut bytes = [0u8; 64];
        bytes[0..8].copy_from_slice(&self.count.to_le_bytes());
        bytes[8..10].copy_from_slice(&queue_id.to_le_bytes());
        bytes[10..12].copy_from_slice(&entry.command_id().0.to_le_bytes());
        bytes[12..14].copy_from_slice(&(status_field << 1).to_le_bytes());
        bytes[14..16].copy_from_slice(&0xFFFFu16.to_le_bytes()); // parameter location unknown
        bytes[16..24].copy_from_slice(&entry.starting_lba().0.to_le_bytes());
        bytes[24..28].copy_from_slice(&entry.nsid.to_le_bytes());
        if self.entries.len() == ERROR_LOG_ENTRIES {
            self.entries.pop_front();
        }
        self.entries.push_back(bytes);
    }
}

/// What host-side calls reach without the controller's lock. The controller thread holds that
/// lock for every command it runs, for a slice of a long zeroing at a time (a whole one takes
/// minutes for a namespace on a disk without write-zeroes offload), and while a command or a
/// shutdown waits for transfers in flight (up to their 30 s deadline), so what must not wait
/// that long goes through here: the device's drop and a power loss or function reset ask what
/// holds the lock to give way ([`Unlocked::give_way`]), and the refusal count tuttid reports
/// is read without the lock.
#[derive(Debug, Default)]
pub(crate) struct Unlocked {
    /// Set once by the device's drop: the controller thread ends.
    stopping: AtomicBool,
    /// Host-side calls waiting for the lock that end every command in flight anyway (power
    /// loss, function reset: their stop deletes the queues).
    preempting: AtomicU32,
    /// Host-side calls waiting for the lock, of any kind: the controller thread lets them in
    /// between its polls (the mutex is not fair: it would retake the lock at once).
    callers: AtomicU32,
    /// Commands refused by a queue restriction ([`EmuStats::restriction_refusals`]).
    restriction_refusals: AtomicU64,
    /// Tests: a wait for transfers in flight before a command or a shutdown's write-back
    /// (`settle_unless_stopped`) is under way. Read without the lock, which that wait holds,
    /// so a test can tell that a command is waiting before it stops the device.
    #[cfg(test)]
    settling_for_tests: AtomicBool,
}

impl Unlocked {
    /// The device is being dropped: the controller thread ends at its next look.
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Runs `lock` (taking the controller's lock) for a host-side call, which counts as
    /// waiting until `lock` returned: the controller thread lets it in after its current poll
    /// (a slice of a long zeroing, or a wait for transfers in flight, at most). With `preempt`
    /// (a power loss, a function reset) what holds the lock gives way ([`Unlocked::give_way`])
    /// instead (its command ends without a completion: the caller's stop deletes its queue).
    pub(crate) fn lock_as_caller<T>(&self, preempt: bool, lock: impl FnOnce() -> T) -> T {
        self.callers.fetch_add(1, Ordering::AcqRel);
        if preempt {
            self.preempting.fetch_add(1, Ordering::AcqRel);
        }
        let locked = lock();
        if preempt {
            self.preempting.fetch_sub(1, Ordering::AcqRel);
        }
        self.callers.fetch_sub(1, Ordering::AcqRel);
        locked
    }

    /// Whether a host-side call waits for the controller's lock.
    pub(crate) fn callers_waiting(&self) -> bool {
        self.callers.load(Ordering::Acquire) != 0
    }

    /// Whether a call waits for the lock to preempt what runs under it.
    pub(crate) fn preempting(&self) -> bool {
        self.preempting.load(Ordering::Acquire) != 0
    }

    /// Whether what holds the controller's lock long should give way: the device is dropped,
    /// or a power loss or function reset waits for the lock. A zeroing looks between slices
    /// and stops there; a wait for transfers in flight before a command or a shutdown's
    /// write-back looks every 10 ms and returns with them still in flight, its command never
    /// run (see `ControllerCore::stop_asked`, which adds the host's CC.EN = 0).
    pub(crate) fn give_way(&self) -> bool {
        self.stopping() || self.preempting()
    }

    #[cfg(test)]
    pub(crate) fn set_settling_for_tests(&self, settling: bool) {
        self.settling_for_tests.store(settling, Ordering::Release);
    }

    #[cfg(test)]
    pub(crate) fn settling_for_tests(&self) -> bool {
        self.settling_for_tests.load(Ordering::Acquire)
    }

    pub(crate) fn count_refusal(&self) {
        self.restriction_refusals.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn restriction_refusals(&self) -> u64 {
        self.restriction_refusals.load(Ordering::Relaxed)
    }
}

/// A test's action on the registers at a chosen point of the controller's work.
#[cfg(test)]
pub(crate) type RegisterHookForTests = Box<dyn FnOnce(&RegisterFile) + Send>;

pub(crate) struct ControllerCore {
    pub(crate) config: EmuConfig,
    pub(crate) registers: Arc<RegisterFile>,
    pub(crate) dma: DmaPool,
    state: State,
    pub(crate) submission_queues: Vec<Option<SubmissionQueue>>,
    pub(crate) completion_queues: Vec<Option<CompletionQueue>>,
    pub(crate) namespaces: Vec<Namespace>,
    /// Batched reads and writes for file stores (None: memory store, disabled, or no io_uring).
    /// Declared before `store` on purpose: fields drop in declaration order, and the ring's drop
    /// waits for (and may first submit) transfers naming the store's descriptors, which must
    /// still be open then rather than closed and possibly reused for another file.
    reader: Option<UringReader>,
    pub(crate) store: Store,
    pub(crate) cache: WriteCache,
    pub(crate) features: Features,
    faults: FaultState,
    pending: Vec<PendingCompletion>,
    pub(crate) counters: Counters,
    pub(crate) error_log: ErrorLog,
    pub(crate) scratch: AlignedBuffer,
    /// Reads and Writes whose transfers the ring holds (see `controller/batch.rs`).
    in_flight: InFlight,
    /// Ring tags of transfers straight into or out of host memory that the kernel kept after
    /// cancellation (their commands ended without a completion; the abandoned ring keeps their
    /// regions). While any is left the controller cannot report that it stopped touching host
    /// memory (see `State::Stopping`).
    host_memory_in_kernel: Vec<u64>,
    io_buffers: Vec<AlignedBuffer>,
    /// Empty region lists of finished transfers, reused for the next commands' data pointers.
    pub(crate) spare_region_lists: Vec<Vec<nvme_driver::hw::DmaRegion>>,
    /// Reused per scan: commands fetched from one SQ.
    fetched: Vec<(SubmissionEntry, u32)>,
    /// The timing model, when configured: Read/Write completions it holds back.
    timing: Option<TimingState>,
    /// Reused per poll: completions the timing model released.
    finished: Vec<FinishedCommand>,
    /// Unsafe shutdowns (power losses) and power cycles, for the SMART log.
    pub(crate) power_cycles: u64,
    pub(crate) unsafe_shutdowns: u64,
    /// The restriction of the I/O queue whose batch is running (see `restriction.rs`); `None`
    /// for the admin queue and unrestricted queues.
    pub(crate) current_restriction: Option<Arc<QueueRestriction>>,
    /// Restrictions for I/O SQs not created yet, applied by their Create I/O SQ (see
    /// `restriction.rs`).
    pub(crate) pending_restrictions: PendingRestrictions,
    /// The count of host CC writes when the controller last looked at CC: a poll with no write
    /// since (and no stop to finish) costs one load, not the configuration lock.
    configuration_seen: u32,
    /// The host's shadow doorbell pages, once it sent Doorbell Buffer Config (cleared with the
    /// queues by a reset or power loss).
    pub(crate) shadow_doorbells: Option<ShadowDoorbells>,
    /// What host-side calls reach without this core's lock (the device holds a clone): the
    /// stop and preemption requests a zeroing looks at, the refusal count.
    pub(crate) unlocked: Arc<Unlocked>,
    /// Command ids of the Asynchronous Event Requests held (at most AERL + 1; see `admin.rs`);
    /// every stop aborts them without a completion.
    pub(crate) async_event_requests: Vec<CommandId>,
    /// Where batched transfers go instead of the store's file (a stalled socket, in tests).
    #[cfg(test)]
    batch_descriptor_override: Option<std::os::fd::RawFd>,
    /// Whether direct transfers go to that descriptor too (otherwise they bounce, in tests).
    #[cfg(test)]
    direct_on_override: bool,
    /// Cache write-backs fail with an I/O error while set (a store that refuses writes, in tests).
    #[cfg(test)]
    pub(crate) fail_write_backs_for_tests: bool,
    /// A Write the kernel gives back at a stop (reset, power loss) is taken as having
    /// written this many bytes of its data to the store before it stopped (they are written
    /// there, and the transfer reports short): a short write cut off by the stop, in tests.
    #[cfg(test)]
    pub(crate) short_write_at_stop_for_tests: Option<usize>,
    /// How many Writes `short_write_at_stop_for_tests` cut short, so a test can tell that its
    /// case happened (a transfer past its deadline before the stop is redone whole instead).
    #[cfg(test)]
    pub(crate) short_writes_at_stop_for_tests: usize,
    /// How many of those went straight from host memory (a direct transfer), so a test of the
    /// direct path can tell it from the bounced one it falls back to.
    #[cfg(test)]
    pub(crate) short_direct_writes_at_stop_for_tests: usize,
    /// `fdatasync` of the store fails with an I/O error while set (a disk that loses its
    /// cache flushes, in tests).
    #[cfg(test)]
    pub(crate) fail_syncs_for_tests: bool,
    /// Writes and zeroing that go straight to the store (FUA, cache off, Write Zeroes) fail
    /// with an I/O error while set (in tests).
    #[cfg(test)]
    pub(crate) fail_write_throughs_for_tests: bool,
    /// Zeroing slices of this many bytes, each followed by this pause, instead of
    /// `ZEROING_SLICE_BYTES` (a store that zeroes slowly, in tests).
    #[cfg(test)]
    pub(crate) zeroing_slice_for_tests: Option<(u64, Duration)>,
    /// Called with (SQ id, head) right after the scan looked at the entry at an SQ's head for a
    /// held zeroing (a host that rewrites the entry then, in tests).
    #[cfg(test)]
    pub(crate) after_peek_for_tests: Option<Box<dyn FnMut(u16, u32) + Send>>,
    /// Called once, with the registers, as the next shutdown notification begins its wait for
    /// transfers in flight (a host that writes CC again meanwhile, in tests).
    #[cfg(test)]
    pub(crate) before_shutdown_wait_for_tests: Option<RegisterHookForTests>,
    /// Called once, with the registers, as the next scan has read the completion queues' head
    /// doorbells and not yet the submission queues' tails (a host whose doorbell writes fall
    /// between the two, in tests).
    #[cfg(test)]
    pub(crate) after_completion_heads_read_for_tests: Option<RegisterHookForTests>,
    /// A long zeroing a command just started (`io.rs`), for the batch to take.
    pub(crate) zeroing_started: Option<crate::io::Zeroing>,
    /// The long zeroing running, a slice per poll (see `controller/zeroing.rs`).
    zeroing: Option<zeroing::ZeroingCommand>,
    /// A shutdown notification waits (SHST 01b) for the long zeroing to end, a slice per poll,
    /// before it writes the cache back (see `handle_shutdown`).
    shutdown_awaits_zeroing: bool,
}

impl ControllerCore {
    pub(crate) fn new(config: EmuConfig, registers: Arc<RegisterFile>, dma: DmaPool) -> Result<Self, EmuError> {
        config.validate()?;
        let store = Store::open(&config.backing, config.no_storage)?;
        let namespaces = layout_namespaces(&config, store.size_bytes())?;
        let queue_slots = usize::from(config.io_queue_pairs_max) + 1;
        let features = Self::default_features(&config);
        let reader = if store.is_file() && config.io_uring && !config.no_storage {
            UringReader::new(URING_DEPTH)
                .map_err(|error| tracing::info!(%error, "io_uring unavailable; reads and writes use synchronous pread/pwrite"))
                .ok()
        } else {
            None
        };
        let in_flight = InFlight::with_capacity(reader.as_ref().map_or(0, UringReader::capacity));
        Ok(Self {
            registers,
            dma,
            state: State::Disabled,
            submission_queues: (0..queue_slots).map(|_| None).collect(),
            completion_queues: (0..queue_slots).map(|_| None).collect(),
            namespaces,
            store,
            cache: WriteCache::default(),
            features,
            faults: FaultState::default(),
            pending: Vec::new(),
            counters: Counters::default(),
            error_log: ErrorLog::default(),
            scratch: AlignedBuffer::default(),
            reader,
            in_flight,
            host_memory_in_kernel: Vec::new(),
            io_buffers: Vec::new(),
            spare_region_lists: Vec::new(),
            fetched: Vec::new(),
            timing: config.timing.map(TimingState::new),
            finished: Vec::new(),
            power_cycles: 1,
            unsafe_shutdowns: 0,
            current_restriction: None,
            pending_restrictions: PendingRestrictions::default(),
            configuration_seen: 0,
            shadow_doorbells: None,
            unlocked: Arc::new(Unlocked::default()),
            async_event_requests: Vec::with_capacity(usize::from(crate::admin::ASYNC_EVENT_REQUEST_LIMIT) + 1),
            #[cfg(test)]
            batch_descriptor_override: None,
            #[cfg(test)]
            direct_on_override: false,
            #[cfg(test)]
            fail_write_backs_for_tests: false,
            #[cfg(test)]
            short_write_at_stop_for_tests: None,
            #[cfg(test)]
            short_writes_at_stop_for_tests: 0,
            #[cfg(test)]
            short_direct_writes_at_stop_for_tests: 0,
            #[cfg(test)]
            fail_syncs_for_tests: false,
            #[cfg(test)]
            fail_write_throughs_for_tests: false,
            #[cfg(test)]
            zeroing_slice_for_tests: None,
            #[cfg(test)]
            after_peek_for_tests: None,
            #[cfg(test)]
            before_shutdown_wait_for_tests: None,
            #[cfg(test)]
            after_completion_heads_read_for_tests: None,
            zeroing_started: None,
            zeroing: None,
            shutdown_awaits_zeroing: false,
            config,
        })
    }

    fn default_features(config: &EmuConfig) -> Features {
        Features {
            submission_queues_granted: config.io_queue_pairs_max,
            completion_queues_granted: config.io_queue_pairs_max,
            write_cache_enabled: config.volatile_write_cache,
        }
    }

    pub(crate) fn describe_store(&self) -> String {
        self.store.describe()
    }

    pub(crate) fn store_file_identity(&self) -> Option<(u64, u64)> {
        self.store.file_identity()
    }

    pub(crate) fn store_is_buffered_file(&self) -> bool {
        self.store.is_buffered_file()
    }

    pub(crate) fn stats(&self) -> EmuStats {
        EmuStats {
            timing: self.timing.as_ref().map(TimingState::stats),
            restriction_refusals: self.unlocked.restriction_refusals(),
            ..self.counters.snapshot()
        }
    }

    /// Restricts I/O submission queue `queue_id` (or lifts its restriction with `None`). The
    /// restriction ends with the queue: a queue created again under the id starts unrestricted
    /// unless a preset for its ring applies (`pending_restrictions`).
    pub(crate) fn restrict_submission_queue(&mut self, queue_id: u16, restriction: Option<QueueRestriction>) -> bool {
        match self.submission_queues.get_mut(usize::from(queue_id)).and_then(Option::as_mut) {
            Some(queue) if queue_id != 0 => {
                queue.restriction = restriction.map(Arc::new);
                true
            }
            _ => false,
        }
    }

    pub(crate) fn set_faults(&mut self, plan: FaultPlan) {
        self.faults.install(plan);
    }

    /// The earliest time a delayed completion is due, so the poller does not oversleep.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        let delayed = self.pending.iter().map(|pending| pending.due).min();
        let modelled = self.timing.as_ref().and_then(TimingState::next_due);
        match (delayed, modelled) {
            (Some(delayed), Some(modelled)) => Some(delayed.min(modelled)),
            (one, other) => one.or(other),
        }
    }

    /// One scan: reacts to CC, posts due delayed completions, consumes doorbells. Returns whether
    /// anything happened (the poller backs off when nothing does).
    pub(crate) fn poll(&mut self, now: Instant) -> bool {
        let mut worked = self.react_to_configuration();
        if self.state != State::Ready {
            return worked;
        }
        self.advance_timing(now);
        worked |= self.post_due(now);
        // A long zeroing's next slice; the scan then runs the commands it does not hold back
        // (those outside the blocks it has still to zero: see `controller/zeroing.rs`).
        worked |= self.advance_zeroing(now);
        worked |= self.scan_queues(now);
        worked
    }

    /// The value of queue `queue_id`'s doorbell: from the host's shadow page for an I/O queue
    /// once it sent Doorbell Buffer Config, from the register otherwise; `None` if the queue has
    /// no doorbell in the register file.
    fn rung(registers: &RegisterFile, shadow: Option<&ShadowDoorbells>, queue_id: u16, completion: bool) -> Option<u32> {
        shadow.and_then(|shadow| shadow.read(queue_id, completion)).or_else(|| registers.doorbell(queue_id, completion))
    }

    fn update_doorbell(rung: Option<u32>, counters: &mut Counters, entries: u32, value: &mut u32, last_invalid: &mut Option<u32>) {
        let Some(rung) = rung else { return };
        if rung < entries {
            *value = rung;
            *last_invalid = None;
        } else if *last_invalid != Some(rung) {
            // Beyond the queue: ignored (a real controller may post an asynchronous event).
            counters.totals.invalid_doorbell_writes += 1;
            *last_invalid = Some(rung);
        }
    }

    /// Reads every existing I/O queue's doorbell now, from where the scan reads it and
    /// validated as the scan does, into the queue's tail (SQ) or head (CQ). Doorbell Buffer
    /// Config calls it before it seeds the new shadow page from those values: a doorbell the
    /// host rang before it sent the command, seen by the same scan (which reads the admin queue
    /// first), would otherwise be seeded with the older value, and with the register no longer
    /// read, never seen.
    pub(crate) fn read_io_doorbells(&mut self) {
        self.read_completion_doorbells(1);
        let shadow = self.shadow_doorbells.as_ref();
        for (queue_id, slot) in self.submission_queues.iter_mut().enumerate().skip(1) {
            if let Some(queue) = slot {
                Self::update_doorbell(
                    Self::rung(&self.registers, shadow, queue_id as u16, false),
                    &mut self.counters,
                    queue.entries,
                    &mut queue.tail,
                    &mut queue.last_invalid_doorbell,
                );
            }
        }
    }

    /// Reads the CQ head doorbells of the completion queues from `first` on (0: the admin
    /// queue's too), validated, into their heads.
    fn read_completion_doorbells(&mut self, first: usize) {
        let shadow = self.shadow_doorbells.as_ref();
        for (queue_id, slot) in self.completion_queues.iter_mut().enumerate().skip(first) {
            if let Some(queue) = slot {
                Self::update_doorbell(
                    Self::rung(&self.registers, shadow, queue_id as u16, true),
                    &mut self.counters,
                    queue.entries,
                    &mut queue.head,
                    &mut queue.last_invalid_doorbell,
                );
            }
        }
    }

    fn scan_queues(&mut self, now: Instant) -> bool {
        // Commands whose transfers completed since the last scan finish first: their CQ slots
        // free up, and their completions go out as soon as their I/O is done.
        let had_in_flight = self.poll_in_flight(now, false);
        self.read_completion_doorbells(0);
        #[cfg(test)]
        if let Some(hook) = self.after_completion_heads_read_for_tests.take() {
            hook(&self.registers);
        }
        let mut worked = false;
        let mut fetched = std::mem::take(&mut self.fetched);
        for queue_index in 0..self.submission_queues.len() {
            // A reset the host asked for during this scan runs at the next poll: fetch nothing
            // more for the queues it deletes.
            if self.state != State::Ready || self.registers.reset_requested() {
                break;
            }
            let queue_id = queue_index as u16;
            let Some(Some(queue)) = self.submission_queues.get_mut(queue_index) else { continue };
            Self::update_doorbell(
                Self::rung(&self.registers, self.shadow_doorbells.as_ref(), queue_id, false),
                &mut self.counters,
                queue.entries,
                &mut queue.tail,
                &mut queue.last_invalid_doorbell,
            );
            let completion_queue_id = queue.completion_queue_id;
            // A full CQ leaves commands in the SQ until the host rings the CQ head; never fetch
            // more than there are free slots for.
            let Some(Some(completion_queue)) = self.completion_queues.get_mut(usize::from(completion_queue_id)) else {
                continue;
            };
            let mut free = completion_queue.free_slots();
            if free == 0 && !queue.is_empty() {
                // A host that writes the SQ tail before the CQ head that makes room for it (as
                // our driver does, so the command starts first) may have written that head after
                // this scan read it: read it again rather than leave the command a scan.
                Self::update_doorbell(
                    Self::rung(&self.registers, self.shadow_doorbells.as_ref(), completion_queue_id, true),
                    &mut self.counters,
                    completion_queue.entries,
                    &mut completion_queue.head,
                    &mut completion_queue.last_invalid_doorbell,
                );
                free = completion_queue.free_slots();
            }
            let waiting = free == 0 && !queue.is_empty();
            if waiting && !queue.waiting_for_completion_room {
                self.counters.totals.completion_room_waits += 1;
            }
            queue.waiting_for_completion_room = waiting;
            let limit = (free as usize).min(COMMANDS_PER_QUEUE_PER_SCAN);
            fetched.clear();
            while fetched.len() < limit && !queue.is_empty() {
                // Read once: what runs is what was looked at, whatever the host writes there
                // meanwhile.
                let Some(entry) = queue.peek() else { break };
                // A command a long zeroing holds back stays in the SQ, with those after it
                // (see `controller/zeroing.rs`); the next scan after the zeroing fetches it.
                if let Some(held) = self.zeroing.as_ref() {
                    if held.holds_back(queue_id, &entry) {
                        break;
                    }
                    #[cfg(test)]
                    if let Some(hook) = self.after_peek_for_tests.as_mut() {
                        hook(queue_id, queue.head);
                    }
                }
                queue.advance();
                fetched.push((entry, queue.head));
            }
            if !fetched.is_empty() {
                worked = true;
                // The scan's `now` was read before this doorbell: a command the host rang in
                // between would enter the timing model's pipe before it was submitted, and
                // complete early by up to a scan (or a preemption of this thread).
                let fetched_at = Instant::now();
                self.run_batch(queue_id, completion_queue_id, &fetched, fetched_at);
            }
        }
        self.fetched = fetched;
        if !worked && had_in_flight && self.state == State::Ready {
            // Nothing new: wait in the kernel (briefly) for a transfer instead of spinning.
            self.poll_in_flight(Instant::now(), true);
        }
        // While transfers are in flight the poller keeps scanning (each idle scan waits in the
        // kernel) rather than parking.
        worked || had_in_flight
    }

    /// Records the outcome and posts (or, per the fault, delays, drops or corrupts) the completion.
    #[allow(clippy::too_many_arguments)]
    fn complete(
        &mut self,
        queue_id: u16,
        completion_queue_id: u16,
        sq_head: u32,
        entry: &SubmissionEntry,
        result: CommandResult,
        fault: Option<FaultAction>,
        now: Instant,
    ) {
        let (dw0, status_field) = match result {
            Ok(dw0) => (dw0, 0),
            Err(status) => {
                let field = status.to_status_field();
                self.error_log.record(queue_id, entry, field);
                self.counters.totals.error_completions += 1;
                (0, field)
            }
        };
        let mut completion = CompletionEntry {
            dw0,
            dw1: 0,
            sq_head: self.current_sq_head(queue_id, sq_head),
            sq_id: queue_id,
            command_id: entry.command_id().0,
            status_and_phase: status_field << 1,
        };
        match fault {
            Some(FaultAction::DropCompletion) => {}
            // Clamped so that no plan can overflow the clock.
            Some(FaultAction::Delay(delay)) => self.delay_completion(completion_queue_id, completion, now + delay.min(MAX_FAULT_DELAY)),
            Some(FaultAction::CorruptCommandId) => {
                completion.command_id ^= 0x8001;
                self.post(completion_queue_id, completion);
            }
            Some(FaultAction::WrongSubmissionQueueId) => {
                completion.sq_id = completion.sq_id.wrapping_add(1);
                self.post(completion_queue_id, completion);
            }
            _ if queue_id != 0 && self.timing.is_some() => self.complete_modelled(completion_queue_id, entry, completion, now),
            _ => self.post(completion_queue_id, completion),
        }
    }

    /// Hands an I/O command's completion to the timing model: a successful Read or Write waits
    /// for its bytes to flow through the model's pipe, anything else for the command latency.
    fn complete_modelled(&mut self, completion_queue_id: u16, entry: &SubmissionEntry, completion: CompletionEntry, now: Instant) {
        let opcode = entry.opcode();
        let transfer = opcode == NvmOpcode::Read as u8 || opcode == NvmOpcode::Write as u8;
        let bytes = self
            .namespace_index(entry.nsid)
            .ok()
            .and_then(|index| self.namespaces.get(index))
            .map(|namespace| u64::from(entry.block_count()) * u64::from(namespace.block_size_bytes));
        let succeeded = completion.status_and_phase >> 1 == 0;
        let Some(timing) = self.timing.as_mut() else { return self.post(completion_queue_id, completion) };
        match bytes {
            Some(bytes) if transfer && succeeded => {
                let Some(Some(queue)) = self.completion_queues.get_mut(usize::from(completion_queue_id)) else { return };
                queue.reserved += 1;
                let write = opcode == NvmOpcode::Write as u8;
                timing.admit(now, write, bytes, (completion_queue_id, completion), &mut self.finished);
                self.collect_finished();
            }
            _ => {
                let due = timing.due_without_transfer(now);
                self.delay_completion(completion_queue_id, completion, due);
            }
        }
    }

    /// Lets the timing model's pipes flow up to `now`; what finished waits in `pending`.
    fn advance_timing(&mut self, now: Instant) {
        if let Some(timing) = self.timing.as_mut() {
            timing.advance(now, &mut self.finished);
            self.collect_finished();
        }
    }

    /// Moves completions the model released into `pending` (their slots are reserved already).
    fn collect_finished(&mut self) {
        for done in self.finished.drain(..) {
            self.pending.push(PendingCompletion { due: done.due, completion_queue_id: done.completion_queue_id, entry: done.entry });
        }
    }

    /// The SQ head to report: where fetching has got to now (monotonic, even when completions
    /// are posted out of fetch order), or `fallback` for a deleted queue.
    fn current_sq_head(&self, queue_id: u16, fallback: u32) -> u16 {
        let head = self.submission_queues.get(usize::from(queue_id)).and_then(Option::as_ref).map_or(fallback, |queue| queue.head);
        head as u16
    }

    fn delay_completion(&mut self, completion_queue_id: u16, entry: CompletionEntry, due: Instant) {
        if let Some(Some(queue)) = self.completion_queues.get_mut(usize::from(completion_queue_id)) {
            queue.reserved += 1;
            self.pending.push(PendingCompletion { due, completion_queue_id, entry });
        }
    }

    fn post(&mut self, completion_queue_id: u16, entry: CompletionEntry) {
        if let Some(Some(queue)) = self.completion_queues.get_mut(usize::from(completion_queue_id)) {
            if queue.post(entry) {
                self.counters.totals.completions_posted += 1;
            }
        }
    }

    fn post_due(&mut self, now: Instant) -> bool {
        let mut worked = false;
        let mut index = 0;
        // Bounded by the number of pending entries: each pass removes one or advances.
        while index < self.pending.len() {
            if self.pending[index].due > now {
                index += 1;
                continue;
            }
            let pending = self.pending.swap_remove(index);
            if let Some(Some(queue)) = self.completion_queues.get_mut(usize::from(pending.completion_queue_id)) {
                queue.reserved = queue.reserved.saturating_sub(1);
            }
            let mut entry = pending.entry;
            entry.sq_head = self.current_sq_head(entry.sq_id, u32::from(entry.sq_head));
            self.post(pending.completion_queue_id, entry);
            worked = true;
        }
        worked
    }

    /// Executes one command and returns its completion dword 0 or its status. Never panics on
    /// anything in `entry` or in host memory.
    pub(crate) fn execute(&mut self, queue_id: u16, entry: &SubmissionEntry) -> CommandResult {
        // Fused operations (§4.15) are optional and not supported.
        if entry.fuse() != 0 {
            return Err(generic(codes::INVALID_FIELD));
        }
        if queue_id == 0 {
            self.execute_admin(entry)
        } else {
            self.execute_io(entry)
        }
    }

    /// Idle sleep bound for the poller: the configured maximum, or less if a completion is due.
    pub(crate) fn sleep_bound(&self, now: Instant) -> Duration {
        // Disabled: only a CC write gives us work, and it unparks us.
        if self.state != State::Ready {
            return DISABLED_SLEEP;
        }
        let max = self.config.idle_sleep_max;
        self.next_due().map_or(max, |due| due.saturating_duration_since(now).min(max))
    }
}

/// Places the configured namespaces back to back in a store of `store_bytes`.
fn layout_namespaces(config: &EmuConfig, store_bytes: u64) -> Result<Vec<Namespace>, EmuError> {
    let mut namespaces = Vec::with_capacity(config.namespaces.len());
    let mut offset = 0u64;
    for (index, namespace) in config.namespaces.iter().enumerate() {
        let block = u64::from(namespace.block_size_bytes);
        let available = store_bytes.saturating_sub(offset);
        let wanted = namespace.size_bytes.unwrap_or(available);
        let blocks = wanted / block;
        if blocks == 0 || blocks * block > available {
            return Err(EmuError::InvalidConfig {
                reason: format!(
                    "namespace {} needs {wanted} bytes but {available} of the {store_bytes}-byte backing store remain",
                    index + 1
                ),
            });
        }
        namespaces.push(Namespace { block_size_bytes: namespace.block_size_bytes, blocks, base_offset_bytes: offset });
        offset += blocks * block;
    }
    Ok(namespaces)
}

impl ControllerCore {
    /// The namespace index of a host-supplied NSID (1-based), or Invalid Namespace or Format.
    pub(crate) fn namespace_index(&self, nsid: u32) -> Result<usize, NvmeStatus> {
        let index = usize::try_from(nsid).ok().and_then(|nsid| nsid.checked_sub(1));
        index.filter(|&index| index < self.namespaces.len()).ok_or(generic(codes::INVALID_NAMESPACE))
    }

    /// Posts now the completions held back for commands of submission queue
    /// `submission_queue_id`, which is being deleted: by a fault plan's delay or by the timing
    /// model. Each of those commands ran (its data moved, its write reached the cache or the
    /// store) and only its completion waited, so it completes with its own status, not
    /// Command Aborted due to SQ Deletion, which would tell the host that a write that landed
    /// did not happen. NVMe wants the commands of a deleted SQ completed or aborted before the
    /// Delete completes (its completion is posted after these), and their CQ still exists (it
    /// cannot be deleted while the SQ is bound to it). Each frees the CQ slot it reserved.
    /// Called before the SQ goes, so each reports the SQ's final head.
    pub(crate) fn complete_held_for(&mut self, submission_queue_id: u16) {
        // A queue deletion is rare: a list of its held completions is no per-I/O allocation.
        let mut held: Vec<(u16, CompletionEntry)> = Vec::new();
        if let Some(timing) = self.timing.as_mut() {
            timing.take_for(submission_queue_id, |completion_queue_id, entry| held.push((completion_queue_id, entry)));
        }
        self.pending.retain(|pending| {
            let keep = pending.entry.sq_id != submission_queue_id;
            if !keep {
                held.push((pending.completion_queue_id, pending.entry));
            }
            keep
        });
        for (completion_queue_id, mut entry) in held {
            if let Some(Some(queue)) = self.completion_queues.get_mut(usize::from(completion_queue_id)) {
                queue.reserved = queue.reserved.saturating_sub(1);
            }
            entry.sq_head = self.current_sq_head(entry.sq_id, u32::from(entry.sq_head));
            self.post(completion_queue_id, entry);
        }
    }

    /// Whether the host has created any I/O queue.
    pub(crate) fn io_queues_exist(&self) -> bool {
        self.submission_queues.iter().skip(1).any(Option::is_some) || self.completion_queues.iter().skip(1).any(Option::is_some)
    }
}
