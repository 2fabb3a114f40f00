//! Single-producer / single-consumer rings in shared memory (`gio_ring_header` + entries).
//!
//! A [`Ring`] is only the location of shared state. Producing and consuming go through short-lived
//! views, [`Producer`] and [`Consumer`], that copy the counters into locals, work on the locals,
//! and publish once per batch — on `sync`/`commit` or when dropped. Publishing a batch costs one
//! Release store however many entries it holds.
//!
//! Ordering argument, in one place:
//! - The producer writes entries (Relaxed), then stores `tail` with Release. The consumer loads
//!   `tail` with Acquire, so every entry (and everything the producer wrote before it, such as the
//!   IOCB an SQ entry names) below that tail is visible to it.
//! - The consumer reads entries, then stores `head` with Release. The producer loads `head` with
//!   Acquire before reusing slots, so the consumer's reads of a slot happen before the producer
//!   overwrites it.
//!   Counters are free-running `u32`s; `tail - head` (wrapping) is the fill level. A fill level
//!   above the depth can only come from a corrupt or hostile writer and is reported as an error.
//!
//! On the GPU side many threads produce CQEs; they serialise on `producer_lock` and follow the same
//! Release protocol (kernels/gio_io_kernel.cu).

use core::marker::PhantomData;
use core::mem::offset_of;
use std::sync::atomic::Ordering;

use crate::abi::gio_cqe;
use crate::error::GioError;
use crate::layout::RingLayout;
use crate::shared_memory::SharedRegion;
use crate::types::IocbId;

/// A value that a ring carries, stored field by field with atomic accesses.
pub trait RingEntry: Copy {
    /// Size of one entry in the ring's entry array.
    const BYTES: usize;
    fn store(region: &SharedRegion, offset_bytes: usize, entry: Self);
    fn load(region: &SharedRegion, offset_bytes: usize) -> Self;
}

impl RingEntry for IocbId {
    const BYTES: usize = 4;
    fn store(region: &SharedRegion, offset_bytes: usize, entry: Self) {
        region.store_u32(offset_bytes, entry.0, Ordering::Relaxed);
    }
    fn load(region: &SharedRegion, offset_bytes: usize) -> Self {
        IocbId(region.load_u32(offset_bytes, Ordering::Relaxed))
    }
}

/// One gio completion (`gio_cqe`), as read from the CQ. Untrusted until checked by the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe {
    pub iocb_id: IocbId,
    pub issue_seq: u32,
    pub failed_ioctx: u32,
    pub status: u16,
    pub failed_nvme_status: u16,
}

impl RingEntry for Cqe {
    const BYTES: usize = core::mem::size_of::<gio_cqe>();
    fn store(region: &SharedRegion, offset_bytes: usize, entry: Self) {
        let o = Ordering::Relaxed;
        region.store_u32(offset_bytes + offset_of!(gio_cqe, iocb_id), entry.iocb_id.0, o);
        region.store_u32(offset_bytes + offset_of!(gio_cqe, issue_seq), entry.issue_seq, o);
        region.store_u32(offset_bytes + offset_of!(gio_cqe, failed_ioctx), entry.failed_ioctx, o);
        region.store_u16(offset_bytes + offset_of!(gio_cqe, status), entry.status, o);
        region.store_u16(offset_bytes + offset_of!(gio_cqe, failed_nvme_status), entry.failed_nvme_status, o);
    }
    fn load(region: &SharedRegion, offset_bytes: usize) -> Self {
        let o = Ordering::Relaxed;
        Cqe {
            iocb_id: IocbId(region.load_u32(offset_bytes + offset_of!(gio_cqe, iocb_id), o)),
            issue_seq: region.load_u32(offset_bytes + offset_of!(gio_cqe, issue_seq), o),
            failed_ioctx: region.load_u32(offset_bytes + offset_of!(gio_cqe, failed_ioctx), o),
            status: region.load_u16(offset_bytes + offset_of!(gio_cqe, status), o),
            failed_nvme_status: region.load_u16(offset_bytes + offset_of!(gio_cqe, failed_nvme_status), o),
        }
    }
}

/// Where a ring lives; cheap to copy. Create views with [`Ring::producer`] and [`Ring::consumer`].
#[derive(Debug)]
pub struct Ring<'a, E> {
    region: &'a SharedRegion,
    layout: RingLayout,
    name: &'static str,
    _entry: PhantomData<E>,
}

impl<E> Clone for Ring<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for Ring<'_, E> {}

impl<'a, E: RingEntry> Ring<'a, E> {
    pub fn new(region: &'a SharedRegion, layout: RingLayout, name: &'static str) -> Self {
        Self { region, layout, name, _entry: PhantomData }
    }

    pub fn depth(&self) -> u32 {
        self.layout.depth
    }

    fn entry_offset(&self, position: u32) -> usize {
        self.layout.entries_offset_bytes + (position & self.layout.mask()) as usize * E::BYTES
    }

    fn checked_fill(&self, head: u32, tail: u32) -> Result<u32, GioError> {
        let fill = tail.wrapping_sub(head);
        if fill > self.layout.depth {
            return Err(GioError::RingCorrupt { ring: self.name, head, tail, depth: self.layout.depth });
        }
        Ok(fill)
    }

    /// The producer's view. Only one producer view of a ring may exist at a time.
    pub fn producer(&self) -> Result<Producer<'a, E>, GioError> {
        // Our own last store: Relaxed suffices. The head is the other side's: Acquire.
        let tail = self.region.load_u32(self.layout.tail_offset(), Ordering::Relaxed);
        let head = self.region.load_u32(self.layout.head_offset(), Ordering::Acquire);
        self.checked_fill(head, tail)?;
        Ok(Producer { ring: *self, head, tail, published_tail: tail })
    }

    /// The consumer's view. Only one consumer view of a ring may exist at a time.
    pub fn consumer(&self) -> Result<Consumer<'a, E>, GioError> {
        let head = self.region.load_u32(self.layout.head_offset(), Ordering::Relaxed);
        let tail = self.region.load_u32(self.layout.tail_offset(), Ordering::Acquire);
        self.checked_fill(head, tail)?;
        Ok(Consumer { ring: *self, head, tail, published_head: head })
    }
}

/// Producer view: pushes go to local state until [`Producer::sync`] or drop publishes the tail.
#[derive(Debug)]
pub struct Producer<'a, E: RingEntry> {
    ring: Ring<'a, E>,
    head: u32,
    tail: u32,
    published_tail: u32,
}

impl<E: RingEntry> Producer<'_, E> {
    /// Free slots as of the last head this view loaded.
    pub fn free(&self) -> u32 {
        self.ring.layout.depth - self.tail.wrapping_sub(self.head)
    }

    /// Position (free-running) the next pushed entry will take.
    pub fn tail(&self) -> u32 {
        self.tail
    }

    /// Appends an entry, or hands it back if the ring is full (back-pressure).
    pub fn push(&mut self, entry: E) -> Result<(), E> {
        if self.free() == 0 {
            return Err(entry);
        }
        E::store(self.ring.region, self.ring.entry_offset(self.tail), entry);
        self.tail = self.tail.wrapping_add(1);
        Ok(())
    }

    /// Publishes the pushed entries (one Release store) and reloads the consumer's head.
    pub fn sync(&mut self) -> Result<(), GioError> {
        self.publish();
        let head = self.ring.region.load_u32(self.ring.layout.head_offset(), Ordering::Acquire);
        self.ring.checked_fill(head, self.tail)?;
        self.head = head;
        Ok(())
    }

    fn publish(&mut self) {
        if self.tail != self.published_tail {
            self.ring.region.store_u32(self.ring.layout.tail_offset(), self.tail, Ordering::Release);
            self.published_tail = self.tail;
        }
    }
}

impl<E: RingEntry> Drop for Producer<'_, E> {
    fn drop(&mut self) {
        self.publish();
    }
}

/// Consumer view, an iterator over the entries published when it was created (or last synced).
/// Consumed entries are released to the producer by [`Consumer::sync`] or drop.
#[derive(Debug)]
pub struct Consumer<'a, E: RingEntry> {
    ring: Ring<'a, E>,
    head: u32,
    tail: u32,
    published_head: u32,
}

impl<E: RingEntry> Consumer<'_, E> {
    /// Entries available to this view without another sync.
    pub fn len(&self) -> u32 {
        self.tail.wrapping_sub(self.head)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Position (free-running) of the next entry this view yields.
    pub fn head(&self) -> u32 {
        self.head
    }

    /// The next entry without consuming it.
    pub fn peek(&self) -> Option<E> {
        (self.head != self.tail).then(|| E::load(self.ring.region, self.ring.entry_offset(self.head)))
    }

    /// The entry `ahead` positions after the next one (0: the next), without consuming
    /// anything; `None` past the entries this view holds.
    pub fn peek_ahead(&self, ahead: u32) -> Option<E> {
        (ahead < self.len()).then(|| E::load(self.ring.region, self.ring.entry_offset(self.head.wrapping_add(ahead))))
    }

    /// Consumes up to `count` entries without reading them again (a caller that read them
    /// with `peek_ahead` and acts on what it read then); returns how many.
    pub fn advance(&mut self, count: u32) -> u32 {
        let skipped = count.min(self.len());
        self.head = self.head.wrapping_add(skipped);
        skipped
    }

    /// Releases consumed slots (one Release store) and loads the producer's newest tail.
    pub fn sync(&mut self) -> Result<(), GioError> {
        self.release();
        let tail = self.ring.region.load_u32(self.ring.layout.tail_offset(), Ordering::Acquire);
        self.ring.checked_fill(self.head, tail)?;
        self.tail = tail;
        Ok(())
    }

    fn release(&mut self) {
        if self.head != self.published_head {
            self.ring.region.store_u32(self.ring.layout.head_offset(), self.head, Ordering::Release);
            self.published_head = self.head;
        }
    }
}

impl<E: RingEntry> Iterator for Consumer<'_, E> {
    type Item = E;

    fn next(&mut self) -> Option<E> {
        let entry = self.peek()?;
        self.head = self.head.wrapping_add(1);
        Some(entry)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let len = self.len() as usize;
        (len, Some(len))
    }
}

impl<E: RingEntry> Drop for Consumer<'_, E> {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{QueueConfig, QueueMemory};
    use proptest::prelude::*;
    use std::collections::VecDeque;
    use std::time::{Duration, Instant};

    fn memory(depth: u32) -> QueueMemory {
        QueueMemory::new(QueueConfig { depth, ioctx_per_iocb_max: 1 }).unwrap()
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push(u32),
        Pop(u32),
        /// Reopen views between batches, as separate calls of the API do.
        Reopen,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![(0u32..40).prop_map(Op::Push), (0u32..40).prop_map(Op::Pop), Just(Op::Reopen),]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Goal: any interleaving of batched pushes and pops (with head/tail wrapping past u32::MAX)
        /// behaves like a bounded VecDeque: FIFO order, no loss, back-pressure exactly when full.
        #[test]
        fn ring_matches_vecdeque_model(
            depth_log2 in 1u32..7,
            start in prop_oneof![Just(0u32), Just(u32::MAX - 70), any::<u32>()],
            ops in proptest::collection::vec(op(), 1..60),
        ) {
            let depth = 1u32 << depth_log2;
            let memory = memory(depth);
            let layout = memory.layout.sq;
            // Start the free-running counters anywhere, including just before wrapping.
            memory.region.store_u32(layout.head_offset(), start, Ordering::Relaxed);
            memory.region.store_u32(layout.tail_offset(), start, Ordering::Relaxed);
            let ring: Ring<'_, IocbId> = Ring::new(&memory.region, layout, "test");
            let mut model: VecDeque<u32> = VecDeque::new();
            let mut next_value = 0u32;
            let mut producer = ring.producer().unwrap();
            let mut consumer = ring.consumer().unwrap();
            for op in ops {
                match op {
                    Op::Push(count) => {
                        for _ in 0..count {
                            let model_full = model.len() as u32 == depth;
                            // The view sees the consumer's head as of its last sync: refresh it
                            // so its notion of "full" equals the model's.
                            producer.sync().unwrap();
                            match producer.push(IocbId(next_value)) {
                                Ok(()) => { prop_assert!(!model_full); model.push_back(next_value); }
                                Err(back) => { prop_assert!(model_full); prop_assert_eq!(back, IocbId(next_value)); }
                            }
                            next_value += 1;
                        }
                        producer.sync().unwrap();
                    }
                    Op::Pop(count) => {
                        consumer.sync().unwrap();
                        for _ in 0..count {
                            let got = consumer.next().map(|id| id.0);
                            prop_assert_eq!(got, model.pop_front());
                        }
                        consumer.sync().unwrap();
                    }
                    Op::Reopen => {
                        drop(producer);
                        drop(consumer);
                        producer = ring.producer().unwrap();
                        consumer = ring.consumer().unwrap();
                    }
                }
                consumer.sync().unwrap();
                producer.sync().unwrap();
                prop_assert_eq!(consumer.len() as usize, model.len());
                prop_assert_eq!(producer.free() as usize, depth as usize - model.len());
            }
        }
    }

    #[test]
    fn batch_is_invisible_until_published() {
        // Goal: the consumer sees nothing of a batch until the producer publishes it, then all.
        let memory = memory(8);
        let ring: Ring<'_, IocbId> = Ring::new(&memory.region, memory.layout.sq, "sq");
        let mut producer = ring.producer().unwrap();
        producer.push(IocbId(1)).unwrap();
        producer.push(IocbId(2)).unwrap();
        assert!(ring.consumer().unwrap().is_empty());
        drop(producer);
        let ids: Vec<u32> = ring.consumer().unwrap().map(|id| id.0).collect();
        assert_eq!(ids, [1, 2]);
        assert!(ring.consumer().unwrap().is_empty(), "dropping the consumer released the entries");
    }

    #[test]
    fn corrupt_counters_are_an_error_not_a_panic() {
        let memory = memory(4);
        let layout = memory.layout.cq;
        memory.region.store_u32(layout.tail_offset(), 9, Ordering::Relaxed);
        let ring: Ring<'_, Cqe> = Ring::new(&memory.region, layout, "cq");
        assert!(matches!(ring.consumer(), Err(GioError::RingCorrupt { ring: "cq", tail: 9, .. })));
        assert!(matches!(ring.producer(), Err(GioError::RingCorrupt { .. })));
    }

    #[test]
    fn cqe_entries_round_trip() {
        let memory = memory(2);
        let ring: Ring<'_, Cqe> = Ring::new(&memory.region, memory.layout.cq, "cq");
        let cqe = Cqe { iocb_id: IocbId(1), issue_seq: 42, failed_ioctx: 7, status: 3, failed_nvme_status: 0x100 };
        ring.producer().unwrap().push(cqe).unwrap();
        assert_eq!(ring.consumer().unwrap().next(), Some(cqe));
    }

    #[test]
    fn two_threads_transfer_in_order_with_bounded_waits() {
        // Goal: a producer and a consumer thread move 20k ids through a depth-8 ring in order;
        // every wait has a deadline so a lost publication fails the test instead of hanging it.
        const COUNT: u32 = 20_000;
        let memory = memory(8);
        let deadline = Instant::now() + Duration::from_secs(20);
        std::thread::scope(|scope| {
            let producer_memory = &memory;
            scope.spawn(move || {
                let ring: Ring<'_, IocbId> = Ring::new(&producer_memory.region, producer_memory.layout.sq, "sq");
                let mut next = 0;
                while next < COUNT {
                    assert!(Instant::now() < deadline, "producer stalled at {next}");
                    let mut producer = ring.producer().unwrap();
                    while next < COUNT && producer.push(IocbId(next)).is_ok() {
                        next += 1;
                    }
                    drop(producer);
                    std::thread::yield_now();
                }
            });
            let ring: Ring<'_, IocbId> = Ring::new(&memory.region, memory.layout.sq, "sq");
            let mut expected = 0;
            while expected < COUNT {
                assert!(Instant::now() < deadline, "consumer stalled at {expected}");
                for id in ring.consumer().unwrap() {
                    assert_eq!(id.0, expected);
                    expected += 1;
                }
                std::thread::yield_now();
            }
        });
    }
}
