//! The doorbell relay: how a client rings the doorbells of its queue pairs on a device whose
//! BAR0 stays with the daemon (a VFIO device; a software controller in relay mode).
//!
//! Why: QEMU's controller and most real ones have CAP.DSTRD = 0, so every queue's doorbells
//! share one 4 KiB page of BAR0; mapping that page into a client would let it ring every
//! other client's queues (and the admin queue). So the daemon keeps BAR0, and each attached
//! pair gets a *relay page*: a sealed memfd laid out like BAR0 (CAP at offset 0, the pair's
//! SQ tail and CQ head doorbells at their BAR0 offsets), which the client maps and rings through
//! `SharedRegisters` exactly as it rings a software controller's shared register page. One
//! relay thread polls every relayed pair's two slots and forwards a changed value to the BAR.
//!
//! What it enforces: a relayed pair forwards only its own queue's two doorbells, read from
//! their own offsets (anything else a client writes into its page is never read); a value
//! outside the queue's depth is dropped and counted (a controller would raise an "invalid
//! doorbell write" asynchronous event, or worse); [`DoorbellRelay::remove`] returns only once
//! the thread can no longer forward for that pair (session end removes before deleting the
//! queues); [`DoorbellRelay::stop`] ends the thread (the daemon's drain).
//!
//! Ordering: the client stores its SQ entries, then its tail with a Release store into the
//! page; the relay's Acquire load of the tail makes those entry stores visible to this thread,
//! and `fence_before_submission_doorbell` makes them complete before the BAR write (on Arm the
//! load is `ldar` and `dsb st` follows it; Armv8 is multi-copy atomic, so what this CPU sees,
//! the device sees). A CQ head likewise, with `fence_before_completion_doorbell` (the client's
//! loads of the entries it consumed precede its Release store of the head). When both changed
//! between two passes, the head goes to the BAR first (`RelayedQueue::forward`), the order in
//! which the client wrote them, so the controller never sees new commands before the CQ
//! entries given back for their completions.
//!
//! Latency: the thread polls without sleeping for `busy_window` after the last doorbell it
//! forwarded, then sleeps `idle_sleep` between passes; docs/tuttid.md has the measured figure.
//! With no pair relayed it parks (a daemon whose clients use a shared register page, or has
//! none, pays nothing); `add` and `stop` wake it.
//! The trust boundary is unchanged: IOVA access is still shared by every client in the one
//! IOMMU domain (the relay guards doorbells, not DMA).
//!
//! Not covered: the relay writes the BAR directly, not through the controller's doorbell gate,
//! so like an attached pair itself it cannot see a controller reset (the attach contract in
//! `IoQueuePair::attach`: every client detached first). A relay page's CSTS reads 0, so a
//! client's timeout names its oldest command rather than a fatal controller (the daemon sees
//! CSTS).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nvme_driver::hw::{fence_before_completion_doorbell, fence_before_submission_doorbell, SharedMemory, SharedRegisters};
use nvme_driver::spec::registers;
use nvme_driver::{DetachedQueueLayout, RegisterIo};

use crate::DaemonError;

/// How the relay thread polls.
#[derive(Debug, Clone, Copy)]
pub struct RelayConfig {
    /// Sleep between passes once idle: the added latency of the first doorbell after a pause.
    pub idle_sleep: Duration,
    /// How long after the last forwarded doorbell the thread keeps polling without sleeping.
    pub busy_window: Duration,
}

impl Default for RelayConfig {
    /// 50 µs idle sleep, 500 µs busy window.
    fn default() -> Self {
        Self { idle_sleep: Duration::from_micros(50), busy_window: Duration::from_micros(500) }
    }
}

/// One relayed pair's counters, shared with the session that owns the pair (status and
/// `/metrics` show them per client). Updated by the relay thread only when a value moves.
#[derive(Debug, Default)]
pub struct PairCounters {
    /// Doorbell values of this pair written to the BAR.
    pub forwarded: AtomicU64,
    /// Values outside the queue's depth, dropped.
    pub dropped: AtomicU64,
}

/// Names one relayed pair, to remove it, and holds its counters.
#[derive(Debug, Clone)]
pub struct RelayTicket {
    id: u64,
    counters: Arc<PairCounters>,
}

impl RelayTicket {
    pub fn counters(&self) -> &Arc<PairCounters> {
        &self.counters
    }
}

/// The relay's counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RelayCounts {
    /// Polling passes made (wake-ups of the relay thread; none while nothing is relayed).
    pub passes: u64,
    /// Doorbell values written to a BAR.
    pub forwarded: u64,
    /// Values outside their queue's depth, dropped.
    pub dropped: u64,
    /// Pairs relayed now.
    pub queues: u64,
}

/// One doorbell slot: the value last forwarded and the value last read (a bad value is
/// counted once, not once per pass).
#[derive(Debug, Default)]
struct Slot {
    offset: usize,
    forwarded: u32,
    seen: u32,
}

/// The warning a pair's bad doorbell values get: the first at once, then at most one per
/// [`BAD_VALUE_WARNING_INTERVAL`], saying how many went unlogged in between. A client writing a
/// new bad value every pass would otherwise have the relay thread log thousands of lines a
/// second, under the queue list's lock that every pair's forwarding waits on. The counters
/// (`PairCounters::dropped`, the relay's) count every value whatever is logged.
#[derive(Debug, Default)]
struct BadValueWarnings {
    /// When the last warning was logged (`None`: never).
    logged_at: Option<Instant>,
    /// Bad values since then that were not logged.
    unlogged: u64,
    /// Warnings logged (for the tests).
    logged: u64,
}

/// The least time between two of one pair's bad-value warnings.
const BAD_VALUE_WARNING_INTERVAL: Duration = Duration::from_secs(1);

impl BadValueWarnings {
    /// Whether to log the bad value seen at `now`; if so, how many went unlogged before it.
    fn log_now(&mut self, now: Instant) -> Option<u64> {
        let due = self.logged_at.is_none_or(|logged_at| now.saturating_duration_since(logged_at) >= BAD_VALUE_WARNING_INTERVAL);
        if !due {
            self.unlogged = self.unlogged.saturating_add(1);
            return None;
        }
        self.logged_at = Some(now);
        self.logged = self.logged.saturating_add(1);
        Some(std::mem::take(&mut self.unlogged))
    }
}

struct RelayedQueue {
    ticket: u64,
    counters: Arc<PairCounters>,
    page: SharedRegisters,
    bar: Arc<dyn RegisterIo>,
    queue_id: u16,
    depth: u32,
    submission: Slot,
    completion: Slot,
    bad_values: BadValueWarnings,
}

#[derive(Clone, Copy)]
enum Doorbell {
    SubmissionTail,
    CompletionHead,
}

impl RelayedQueue {
    /// Forwards what changed in this pair's two slots; returns how many values moved.
    ///
    /// The SQ tail is read before the CQ head, and the head is written to the BAR before the
    /// tail. A client publishes the CQ head it reaped to before the SQ tail of the commands it
    /// queues next (`QueuePair::ring_doorbell`), so a tail read here comes with that head
    /// (both Release stores by the client, both Acquire loads here). Forwarding in the other
    /// order would let the controller see the new commands while the CQ entries their
    /// completions need were not yet given back: with the queue full, it would find its CQ full.
    fn forward(&mut self, dropped: &AtomicU64) -> u64 {
        let tail = self.take_new_value(Doorbell::SubmissionTail, dropped);
        let head = self.take_new_value(Doorbell::CompletionHead, dropped);
        if let Some(head) = head {
            self.write_doorbell(Doorbell::CompletionHead, head);
        }
        if let Some(tail) = tail {
            self.write_doorbell(Doorbell::SubmissionTail, tail);
        }
        u64::from(head.is_some()) + u64::from(tail.is_some())
    }

    fn slot(&mut self, doorbell: Doorbell) -> &mut Slot {
        match doorbell {
            Doorbell::SubmissionTail => &mut self.submission,
            Doorbell::CompletionHead => &mut self.completion,
        }
    }

    /// The slot's value when it changed since the last pass and differs from what the BAR was
    /// last given; a value outside the queue's depth is dropped (counted once) instead.
    fn take_new_value(&mut self, doorbell: Doorbell, dropped: &AtomicU64) -> Option<u32> {
        let offset = self.slot(doorbell).offset;
        // Acquire (SharedRegisters::read32): the client's ring accesses before its Release
        // store of this value happen before everything below.
        let value = self.page.read32(offset);
        let depth = self.depth;
        let slot = self.slot(doorbell);
        if value == slot.seen {
            return None;
        }
        slot.seen = value;
        if value >= depth {
            dropped.fetch_add(1, Ordering::Relaxed);
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            if let Some(unlogged) = self.bad_values.log_now(Instant::now()) {
                tracing::warn!(
                    queue = self.queue_id,
                    value,
                    depth = self.depth,
                    ?doorbell,
                    unlogged,
                    "relay: a doorbell value outside the queue's depth, dropped (unlogged: those dropped since the last warning)"
                );
            }
            return None;
        }
        (value != slot.forwarded).then_some(value)
    }

    fn write_doorbell(&mut self, doorbell: Doorbell, value: u32) {
        match doorbell {
            Doorbell::SubmissionTail => fence_before_submission_doorbell(),
            Doorbell::CompletionHead => fence_before_completion_doorbell(),
        }
        let slot = self.slot(doorbell);
        slot.forwarded = value;
        let offset = slot.offset;
        self.bar.write32(offset, value);
        self.counters.forwarded.fetch_add(1, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Doorbell {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            Doorbell::SubmissionTail => "sq-tail",
            Doorbell::CompletionHead => "cq-head",
        })
    }
}

struct RelayShared {
    queues: Mutex<Vec<RelayedQueue>>,
    stop: AtomicBool,
    forwarded: AtomicU64,
    dropped: AtomicU64,
    next_ticket: AtomicU64,
    /// Polling passes made (the cost of the relay while nothing is relayed: none).
    passes: AtomicU64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The relay thread and the pairs it serves (module docs).
pub struct DoorbellRelay {
    shared: Arc<RelayShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// To wake the thread from its park (`add`, `stop`).
    waker: std::thread::Thread,
}

impl DoorbellRelay {
    pub fn start(config: RelayConfig) -> Result<DoorbellRelay, DaemonError> {
        let shared = Arc::new(RelayShared {
            queues: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            forwarded: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            next_ticket: AtomicU64::new(1),
            passes: AtomicU64::new(0),
        });
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("tuttid-relay".into())
            .spawn(move || relay_loop(&thread_shared, config))
            .map_err(|source| DaemonError::Io { context: "starting the doorbell relay thread".into(), source })?;
        let waker = thread.thread().clone();
        Ok(DoorbellRelay { shared, thread: Mutex::new(Some(thread)), waker })
    }

    /// Makes the relay page for a pair created on the controller behind `bar`: BAR0's layout,
    /// CAP copied from the BAR (a client checks its doorbell offsets against CAP.DSTRD), just
    /// long enough for the pair's two doorbells. Its SQ tail and CQ head start at 0, as the
    /// new queue's do.
    pub fn make_page(bar: &dyn RegisterIo, layout: &DetachedQueueLayout) -> Result<Arc<SharedMemory>, DaemonError> {
        let end = layout.submission_doorbell_offset.max(layout.completion_doorbell_offset).max(registers::DOORBELL_BASE).saturating_add(4);
        let bytes = end.div_ceil(4096).saturating_mul(4096);
        let memory = SharedMemory::create(&format!("tuttid-relay-q{}", layout.id.0), bytes).map_err(|error| DaemonError::Io {
            context: format!("creating the relay page of queue {}", layout.id.0),
            source: std::io::Error::other(error),
        })?;
        SharedRegisters::new(Arc::clone(&memory)).publish_capabilities(bar.read64(registers::CAP));
        Ok(memory)
    }

    /// Starts relaying `layout`'s two doorbells from `page` (made by [`Self::make_page`]) to
    /// `bar`. Only those two offsets of the page are ever read.
    pub fn add(&self, page: Arc<SharedMemory>, bar: Arc<dyn RegisterIo>, layout: &DetachedQueueLayout) -> RelayTicket {
        let ticket = RelayTicket { id: self.shared.next_ticket.fetch_add(1, Ordering::Relaxed), counters: Arc::default() };
        let slot = |offset| Slot { offset, forwarded: 0, seen: 0 };
        let queue = RelayedQueue {
            ticket: ticket.id,
            counters: Arc::clone(&ticket.counters),
            page: SharedRegisters::new(page),
            bar,
            queue_id: layout.id.0,
            depth: layout.depth,
            submission: slot(layout.submission_doorbell_offset),
            completion: slot(layout.completion_doorbell_offset),
            bad_values: BadValueWarnings::default(),
        };
        lock(&self.shared.queues).push(queue);
        self.waker.unpark();
        ticket
    }

    /// Stops relaying one pair. When this returns, the thread forwards nothing more for it (a
    /// pass holds the queue list's lock for its whole length), so its queues may be deleted.
    /// Returns whether the ticket was relayed.
    pub fn remove(&self, ticket: &RelayTicket) -> bool {
        let mut queues = lock(&self.shared.queues);
        let before = queues.len();
        queues.retain(|queue| queue.ticket != ticket.id);
        queues.len() != before
    }

    pub fn counts(&self) -> RelayCounts {
        RelayCounts {
            passes: self.shared.passes.load(Ordering::Relaxed),
            forwarded: self.shared.forwarded.load(Ordering::Relaxed),
            dropped: self.shared.dropped.load(Ordering::Relaxed),
            queues: lock(&self.shared.queues).len() as u64,
        }
    }

    /// Ends the thread (the daemon's drain) and waits for it: within one pass plus one
    /// `idle_sleep`. Nothing is forwarded afterwards. Idempotent.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.waker.unpark();
        if let Some(thread) = lock(&self.thread).take() {
            if thread.join().is_err() {
                tracing::error!("the doorbell relay thread panicked");
            }
        }
    }
}

impl Drop for DoorbellRelay {
    fn drop(&mut self) {
        self.stop();
    }
}

fn relay_loop(shared: &RelayShared, config: RelayConfig) {
    let mut last_forward = Instant::now();
    while !shared.stop.load(Ordering::Acquire) {
        shared.passes.fetch_add(1, Ordering::Relaxed);
        let (moved, relayed) = {
            let mut queues = lock(&shared.queues);
            (queues.iter_mut().map(|queue| queue.forward(&shared.dropped)).sum::<u64>(), queues.len())
        };
        if relayed == 0 {
            // Nothing to poll: park until `add` or `stop` unparks (a token left by an unpark
            // that came first makes this return at once); the timeout only bounds a lost wake.
            std::thread::park_timeout(Duration::from_secs(1));
            continue;
        }
        if moved > 0 {
            shared.forwarded.fetch_add(moved, Ordering::Relaxed);
            last_forward = Instant::now();
        }
        if last_forward.elapsed() < config.busy_window {
            std::thread::yield_now();
        } else {
            std::thread::sleep(config.idle_sleep);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use nvme_driver::{Iova, QueueId};

    use super::*;

    /// A BAR that records doorbell writes.
    #[derive(Default)]
    struct RecordingBar {
        writes: Mutex<Vec<(usize, u32)>>,
        capabilities: u64,
        written: AtomicU32,
    }

    impl RegisterIo for RecordingBar {
        fn len(&self) -> usize {
            16 << 10
        }
        fn read32(&self, _offset: usize) -> u32 {
            0
        }
        fn write32(&self, offset: usize, value: u32) {
            lock(&self.writes).push((offset, value));
            self.written.fetch_add(1, Ordering::Release);
        }
        fn read64(&self, offset: usize) -> u64 {
            if offset == registers::CAP {
                self.capabilities
            } else {
                0
            }
        }
        fn write64(&self, _offset: usize, _value: u64) {}
    }

    fn layout(queue: u16, depth: u32) -> DetachedQueueLayout {
        let (submission_doorbell_offset, completion_doorbell_offset) =
            (registers::doorbell_offset(queue, false, 0), registers::doorbell_offset(queue, true, 0));
        DetachedQueueLayout {
            id: QueueId(queue),
            depth,
            submission_iova: Iova(0x10_0000),
            completion_iova: Iova(0x20_0000),
            submission_host_address: 0,
            completion_host_address: 0,
            submission_doorbell_offset,
            completion_doorbell_offset,
        }
    }

    fn fast() -> RelayConfig {
        RelayConfig { idle_sleep: Duration::from_micros(20), busy_window: Duration::from_micros(100) }
    }

    /// Waits (bounded) until the relay has made at least two full passes past now.
    fn settle(relay: &DoorbellRelay) {
        // Two passes: a pass that started before the caller's write may have missed it.
        for _ in 0..2 {
            let ticket = relay.add(SharedMemory::create("probe", 8192).unwrap(), Arc::new(RecordingBar::default()), &layout(1, 2));
            relay.remove(&ticket);
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn wait_for(bar: &RecordingBar, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while lock(&bar.writes).len() < count {
            assert!(Instant::now() < deadline, "the relay forwarded {:?}, expected {count} writes", lock(&bar.writes));
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    #[test]
    fn the_relay_forwards_only_the_owned_queues_doorbells() {
        // Goal: a client's SQ tail and CQ head reach the BAR at the queue's own offsets; a value
        // the client writes at another queue's doorbell offset in its page changes nothing.
        let relay = DoorbellRelay::start(fast()).unwrap();
        let bar = Arc::new(RecordingBar { capabilities: 0x1234, ..RecordingBar::default() });
        let own = layout(3, 16);
        let page = DoorbellRelay::make_page(bar.as_ref(), &own).unwrap();
        let client = SharedRegisters::new(Arc::clone(&page));
        assert_eq!(client.read64(registers::CAP), 0x1234, "CAP copied for the client's stride check");
        let ticket = relay.add(Arc::clone(&page), bar.clone(), &own);

        let other = layout(2, 16);
        client.write32(other.submission_doorbell_offset, 5);
        client.write32(other.completion_doorbell_offset, 6);
        client.write32(registers::doorbell_offset(0, false, 0), 1); // the admin SQ
        client.write32(own.submission_doorbell_offset, 7);
        wait_for(&bar, 1);
        client.write32(own.completion_doorbell_offset, 4);
        wait_for(&bar, 2);
        settle(&relay);
        assert_eq!(*lock(&bar.writes), vec![(own.submission_doorbell_offset, 7), (own.completion_doorbell_offset, 4)]);
        let counts = relay.counts();
        assert_eq!((counts.forwarded, counts.dropped, counts.queues), (2, 0, 1));
        assert!(counts.passes >= 2, "{counts:?}");
        let pair = ticket.counters();
        assert_eq!((pair.forwarded.load(Ordering::Relaxed), pair.dropped.load(Ordering::Relaxed)), (2, 0), "the pair's own counters");
    }

    /// Queue 1 of depth 8 relayed onto a recording BAR, driven by hand (`forward`), and the
    /// client's view of its page.
    fn relayed_queue() -> (Arc<RecordingBar>, DetachedQueueLayout, SharedRegisters, RelayedQueue) {
        let bar = Arc::new(RecordingBar::default());
        let own = layout(1, 8);
        let page = DoorbellRelay::make_page(bar.as_ref(), &own).unwrap();
        let client = SharedRegisters::new(Arc::clone(&page));
        let queue = RelayedQueue {
            ticket: 0,
            counters: Arc::default(),
            page: SharedRegisters::new(page),
            bar: bar.clone(),
            queue_id: 1,
            depth: 8,
            submission: Slot { offset: own.submission_doorbell_offset, ..Slot::default() },
            completion: Slot { offset: own.completion_doorbell_offset, ..Slot::default() },
            bad_values: BadValueWarnings::default(),
        };
        (bar, own, client, queue)
    }

    #[test]
    fn a_pass_forwards_the_completion_head_before_the_submission_tail() {
        // Goal: when a client gave back CQ entries and queued new commands between two passes,
        // the controller gets the head first; the tail first would show it commands whose
        // completions may find the CQ full (a full queue: depth - 1 in flight again).
        let (bar, own, client, mut queue) = relayed_queue();
        let dropped = AtomicU64::new(0);
        client.write32(own.submission_doorbell_offset, 7);
        assert_eq!(queue.forward(&dropped), 1);
        // Seven commands in flight; the client reaps five, then queues three more.
        client.write32(own.completion_doorbell_offset, 5);
        client.write32(own.submission_doorbell_offset, 2);
        assert_eq!(queue.forward(&dropped), 2);
        assert_eq!(
            *lock(&bar.writes),
            vec![(own.submission_doorbell_offset, 7), (own.completion_doorbell_offset, 5), (own.submission_doorbell_offset, 2)]
        );
        assert_eq!(queue.forward(&dropped), 0, "nothing changed since the last pass");
        assert_eq!(dropped.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_value_outside_the_depth_is_dropped_and_counted_once() {
        // Goal: a tail or head >= depth never reaches the BAR, is counted once (not once per
        // pass), and the next good value is forwarded.
        let relay = DoorbellRelay::start(fast()).unwrap();
        let bar = Arc::new(RecordingBar::default());
        let own = layout(1, 8);
        let page = DoorbellRelay::make_page(bar.as_ref(), &own).unwrap();
        let client = SharedRegisters::new(Arc::clone(&page));
        let ticket = relay.add(page, bar.clone(), &own);
        client.write32(own.submission_doorbell_offset, 8);
        client.write32(own.completion_doorbell_offset, u32::MAX);
        settle(&relay);
        assert!(lock(&bar.writes).is_empty(), "{:?}", lock(&bar.writes));
        assert_eq!(relay.counts().dropped, 2);
        client.write32(own.submission_doorbell_offset, 3);
        wait_for(&bar, 1);
        assert_eq!(*lock(&bar.writes), vec![(own.submission_doorbell_offset, 3)]);
        assert_eq!(relay.counts().dropped, 2);
        let pair = ticket.counters();
        assert_eq!((pair.forwarded.load(Ordering::Relaxed), pair.dropped.load(Ordering::Relaxed)), (1, 2), "the pair's own counters");
    }

    #[test]
    fn bad_values_are_all_counted_but_logged_at_most_once_a_second_per_pair() {
        // Goal: a client writing a new out-of-depth value before every pass has each one
        // dropped and counted (exactly), but the warning logged once (the first), not once per
        // value: the relay thread logs under the lock every pair's forwarding waits on. A second
        // later the next bad value is logged again, saying how many were not.
        let (bar, own, client, mut queue) = relayed_queue();
        let dropped = AtomicU64::new(0);
        for value in 8..1008 {
            client.write32(own.submission_doorbell_offset, value);
            assert_eq!(queue.forward(&dropped), 0);
        }
        assert!(lock(&bar.writes).is_empty());
        assert_eq!((dropped.load(Ordering::Relaxed), queue.counters.dropped.load(Ordering::Relaxed)), (1000, 1000));
        assert_eq!(queue.bad_values.logged, 1, "warnings logged for 1000 bad values within a second");
        let later = Instant::now() + BAD_VALUE_WARNING_INTERVAL;
        assert_eq!(queue.bad_values.log_now(later), Some(999), "a second on: logged, with the count of those not");
        assert_eq!(queue.bad_values.log_now(later), None);
    }

    /// A BAR that stamps the time of each doorbell it receives.
    struct StampingBar {
        stamps: Mutex<Vec<Instant>>,
    }

    impl RegisterIo for StampingBar {
        fn len(&self) -> usize {
            16 << 10
        }
        fn read32(&self, _offset: usize) -> u32 {
            0
        }
        fn write32(&self, _offset: usize, _value: u32) {
            lock(&self.stamps).push(Instant::now());
        }
        fn read64(&self, _offset: usize) -> u64 {
            0
        }
        fn write64(&self, _offset: usize, _value: u64) {}
    }

    #[test]
    fn relay_latency_with_the_default_polling() {
        // Goal: measure what the relay adds between a client's doorbell store and the BAR
        // write, with the daemon's default polling: an idle relay (the first doorbell after a
        // pause, so the thread is sleeping) and a busy one (a doorbell right after the last).
        // Printed for docs/tuttid.md; the bound asserted is loose (a loaded 2-core CI host).
        let relay = DoorbellRelay::start(RelayConfig::default()).unwrap();
        let bar = Arc::new(StampingBar { stamps: Mutex::new(Vec::new()) });
        let own = layout(1, 64);
        let page = DoorbellRelay::make_page(bar.as_ref(), &own).unwrap();
        let client = SharedRegisters::new(Arc::clone(&page));
        relay.add(page, bar.clone(), &own);
        let mut latencies = [Vec::new(), Vec::new()];
        for round in 0..200u32 {
            let busy = round % 2 == 1;
            if !busy {
                std::thread::sleep(Duration::from_millis(2));
            }
            let rung = Instant::now();
            client.write32(own.submission_doorbell_offset, (round % 63) + 1);
            let deadline = rung + Duration::from_secs(10);
            let stamp = loop {
                if let Some(&stamp) = lock(&bar.stamps).get(round as usize) {
                    break stamp;
                }
                assert!(Instant::now() < deadline, "doorbell {round} not forwarded within 10 s");
                std::hint::spin_loop();
            };
            latencies[usize::from(busy)].push(stamp.duration_since(rung));
        }
        for (name, latencies) in ["idle", "busy"].iter().zip(&mut latencies) {
            latencies.sort();
            let (median, p99) = (latencies[latencies.len() / 2], latencies[latencies.len() * 99 / 100]);
            println!("relay latency ({name}): median {median:?}, p99 {p99:?}, max {:?}", latencies[latencies.len() - 1]);
            assert!(median < Duration::from_millis(100), "{name} median {median:?}");
        }
    }

    #[test]
    fn an_idle_relay_parks() {
        // Goal: with no pair relayed the thread does not poll (a daemon whose clients all use a
        // shared register page pays nothing); an added pair wakes it at once.
        let relay = DoorbellRelay::start(fast()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let passes = relay.counts().passes;
        assert!(passes <= 2, "{passes} passes with nothing relayed");
        let bar = Arc::new(RecordingBar::default());
        let own = layout(1, 8);
        let page = DoorbellRelay::make_page(bar.as_ref(), &own).unwrap();
        SharedRegisters::new(Arc::clone(&page)).write32(own.submission_doorbell_offset, 1);
        relay.add(page, bar.clone(), &own);
        wait_for(&bar, 1);
    }

    #[test]
    fn remove_and_stop_end_forwarding() {
        // Goal: once `remove` returned, that pair's doorbells are not forwarded (its queues may
        // be deleted); once `stop` returned, nothing is.
        let relay = DoorbellRelay::start(fast()).unwrap();
        let bar = Arc::new(RecordingBar::default());
        let (first, second) = (layout(1, 8), layout(2, 8));
        let first_page = DoorbellRelay::make_page(bar.as_ref(), &first).unwrap();
        let second_page = DoorbellRelay::make_page(bar.as_ref(), &second).unwrap();
        let first_ticket = relay.add(Arc::clone(&first_page), bar.clone(), &first);
        relay.add(Arc::clone(&second_page), bar.clone(), &second);
        let (first_client, second_client) = (SharedRegisters::new(first_page), SharedRegisters::new(second_page));
        first_client.write32(first.submission_doorbell_offset, 1);
        wait_for(&bar, 1);
        assert!(relay.remove(&first_ticket));
        assert!(!relay.remove(&first_ticket));
        first_client.write32(first.submission_doorbell_offset, 2);
        second_client.write32(second.submission_doorbell_offset, 1);
        wait_for(&bar, 2);
        settle(&relay);
        assert_eq!(*lock(&bar.writes), vec![(first.submission_doorbell_offset, 1), (second.submission_doorbell_offset, 1)]);

        relay.stop();
        second_client.write32(second.submission_doorbell_offset, 2);
        std::thread::sleep(Duration::from_millis(20));
        let writes = lock(&bar.writes).clone();
        assert_eq!(writes.len(), 2, "forwarded after stop: {writes:?}");
        assert_eq!(bar.written.load(Ordering::Acquire), 2);
        relay.stop();
    }
}
