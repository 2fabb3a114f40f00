//! Shadow doorbells (Doorbell Buffer Config, §5.7): for emulated controllers, whose MMIO
//! doorbell writes are the costliest thing a polled driver does (each one leaves the guest's
//! vCPU for the hypervisor's device model). The host hands the controller two pages: the shadow
//! doorbell page, where it stores every SQ tail and CQ head, and the EventIdx page, where the
//! controller stores, per doorbell, the value it last read. The host still writes the MMIO
//! doorbell, but only when the value it publishes passes the EventIdx (the controller has read
//! everything before it and may be waiting); otherwise the controller, still working, finds the
//! new value in the shadow page itself.
//!
//! Once the command is given, the controller reads every I/O queue's doorbells from the shadow
//! page: a writer that only writes MMIO doorbells (a GPU kernel on a detached pair, a tuttid
//! client) would go unseen. So shadow doorbells are opt-in
//! ([`crate::ControllerConfig::shadow_doorbells`]) and a controller using them refuses detached
//! pairs. The admin queue keeps writing MMIO only, as Linux drives it: QEMU copies an admin
//! doorbell write into the shadow page, and the software controller reads admin doorbells from
//! the registers.

use std::sync::atomic::Ordering;

use crate::error::NvmeError;
use crate::hw::{self, DmaAllocator, DmaRegion};
use crate::spec::registers::{doorbell_event_needed, shadow_doorbell_offset};
use crate::spec::SubmissionEntry;
use crate::types::QueueId;

/// One memory page (CC.MPS = 4 KiB): each of the two buffers is exactly one (§5.7).
const PAGE_BYTES: usize = 4096;

/// The controller's two pages.
pub(crate) struct DoorbellBuffer {
    shadow: DmaRegion,
    event_indexes: DmaRegion,
    doorbell_stride_log2: u8,
}

impl DoorbellBuffer {
    /// Allocates both pages, zeroed (every queue starts at head = tail = 0).
    pub(crate) fn allocate(dma: &dyn DmaAllocator, doorbell_stride_log2: u8) -> Result<Self, NvmeError> {
        let shadow = dma.allocate(PAGE_BYTES)?;
        let event_indexes = dma.allocate(PAGE_BYTES)?;
        let buffer = Self { shadow, event_indexes, doorbell_stride_log2 };
        buffer.clear()?;
        Ok(buffer)
    }

    /// Zeroes both pages: before the command is (re)sent after a controller reset, which
    /// deleted every queue.
    pub(crate) fn clear(&self) -> Result<(), NvmeError> {
        self.shadow.fill(0, PAGE_BYTES, 0)?;
        self.event_indexes.fill(0, PAGE_BYTES, 0)?;
        Ok(())
    }

    /// The Doorbell Buffer Config command that hands these pages to the controller.
    pub(crate) fn command(&self) -> SubmissionEntry {
        SubmissionEntry::doorbell_buffer_config(self.shadow.iova().0, self.event_indexes.iova().0)
    }

    /// Queue `id`'s slots, zeroed: called before the queue is created on the controller, which
    /// starts it at head = tail = 0 and reads the shadow slots from then on. A queue whose slots
    /// fall outside the page (a doorbell stride too large for this queue id) cannot use them.
    pub(crate) fn slots(&self, id: QueueId) -> Result<ShadowSlots, NvmeError> {
        let submission = shadow_doorbell_offset(id.0, false, self.doorbell_stride_log2);
        let completion = shadow_doorbell_offset(id.0, true, self.doorbell_stride_log2);
        let span = completion - submission + 4;
        if submission.checked_add(span).is_none_or(|end| end > PAGE_BYTES) {
            let stride_bytes = 4usize << self.doorbell_stride_log2;
            // Queue q's slots end at (2q + 1)·stride + 4: q fits while that is within the page.
            let last_queue = u16::try_from((PAGE_BYTES - 4) / stride_bytes).map_or(u16::MAX, |slots| slots.saturating_sub(1) / 2);
            return Err(NvmeError::NoShadowDoorbellSlot { queue: id, stride_bytes, last_queue });
        }
        let slots = ShadowSlots {
            shadow: self.shadow.subregion(submission, span)?,
            event_indexes: self.event_indexes.subregion(submission, span)?,
            completion_offset: completion - submission,
        };
        slots.shadow.fill(0, span, 0)?;
        slots.event_indexes.fill(0, span, 0)?;
        Ok(slots)
    }

    /// Both pages, for leaking them when the controller could not be stopped (it may still
    /// write EventIdx values into the second).
    pub(crate) fn regions(&self) -> [DmaRegion; 2] {
        [self.shadow.clone(), self.event_indexes.clone()]
    }
}

/// One I/O queue pair's slots in the two pages: its SQ tail at offset 0, its CQ head at
/// `completion_offset`, in each page.
#[derive(Clone)]
pub(crate) struct ShadowSlots {
    shadow: DmaRegion,
    event_indexes: DmaRegion,
    completion_offset: usize,
}

impl ShadowSlots {
    /// Stores `value` (moved on from `previous`) in the shadow doorbell and says whether the
    /// MMIO doorbell must be written too. The caller fenced the ring accesses the value
    /// publishes before calling.
    pub(crate) fn publish(&self, completion: bool, value: u32, previous: u32) -> Result<bool, NvmeError> {
        let offset = if completion { self.completion_offset } else { 0 };
        self.shadow.store_u32(offset, value, Ordering::Release)?;
        // The shadow store must be visible before the EventIdx is read (see the fence).
        hw::fence_before_event_index_load();
        // From the controller: any value is harmless here (the worst is one MMIO write too many
        // or, for a controller that lies, one it does not get and then waits for).
        let event_index = self.event_indexes.load_u32(offset, Ordering::Acquire)?;
        // Queue indexes are below 2^16 (depth ≤ 32768), so the low halves carry them whole.
        Ok(doorbell_event_needed(event_index as u16, value as u16, previous as u16))
    }

    /// The slots, for leaking with the rings of a queue the controller may still use.
    pub(crate) fn regions(&self) -> [DmaRegion; 2] {
        [self.shadow.clone(), self.event_indexes.clone()]
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::hw::{DmaPool, RegisterIo};
    use crate::queue::QueuePair;
    use crate::spec::registers::doorbell_offset;
    use crate::types::NamespaceId;

    /// Registers that record every doorbell write.
    #[derive(Default)]
    struct Recorder {
        writes: Mutex<Vec<(usize, u32)>>,
    }

    impl RegisterIo for Recorder {
        fn len(&self) -> usize {
            0x2000
        }
        fn read32(&self, _offset: usize) -> u32 {
            0
        }
        fn write32(&self, offset: usize, value: u32) {
            self.writes.lock().expect("recorder").push((offset, value));
        }
        fn read64(&self, _offset: usize) -> u64 {
            0
        }
        fn write64(&self, _offset: usize, _value: u64) {}
    }

    fn take(recorder: &Recorder) -> Vec<(usize, u32)> {
        std::mem::take(&mut *recorder.writes.lock().expect("recorder"))
    }

    #[test]
    fn the_mmio_doorbell_follows_the_event_index_and_the_shadow_always_moves() {
        // Goal: every doorbell value lands in the shadow slot; the register write happens
        // exactly when the value passes the controller's EventIdx.
        let dma = DmaPool::identity();
        let registers = Arc::new(Recorder::default());
        let buffer = DoorbellBuffer::allocate(&dma, 0).expect("pages");
        let mut queue = QueuePair::allocate(QueueId(1), 8, &dma, Arc::clone(&registers) as Arc<dyn RegisterIo>, 0).expect("pair");
        queue.attach_shadow(buffer.slots(QueueId(1)).expect("slots"));
        let sq_doorbell = doorbell_offset(1, false, 0);
        let sq_slot = shadow_doorbell_offset(1, false, 0);
        let shadow_tail = || buffer.shadow.load_u32(sq_slot, Ordering::Acquire).expect("shadow");
        let set_event = |value: u32| buffer.event_indexes.store_u32(sq_slot, value, Ordering::Release).expect("event");
        let submit = |queue: &mut QueuePair, count: usize| {
            for tag in 0..count {
                queue.submit(SubmissionEntry::flush(NamespaceId(1)), tag as u64).expect("submit");
            }
            queue.ring_doorbell().expect("ring");
        };

        // EventIdx 0, tail 0 to 1: the controller waits at 0, so it must be told.
        submit(&mut queue, 1);
        assert_eq!((take(&registers), shadow_tail()), (vec![(sq_doorbell, 1)], 1));
        // Still at 0 (it has not read 1 yet): 1 to 3 goes to the shadow page only.
        submit(&mut queue, 2);
        assert_eq!((take(&registers), shadow_tail()), (vec![], 3));
        // It read 3 and waits there: 3 to 4 passes it.
        set_event(3);
        submit(&mut queue, 1);
        assert_eq!((take(&registers), shadow_tail()), (vec![(sq_doorbell, 4)], 4));
        // Without shadow slots every doorbell is a register write, as before.
        let mut plain = QueuePair::allocate(QueueId(2), 8, &dma, Arc::clone(&registers) as Arc<dyn RegisterIo>, 0).expect("pair");
        submit(&mut plain, 1);
        submit(&mut plain, 1);
        let plain_doorbell = doorbell_offset(2, false, 0);
        assert_eq!(take(&registers), vec![(plain_doorbell, 1), (plain_doorbell, 2)]);
        assert_eq!(buffer.shadow.load_u32(shadow_doorbell_offset(2, false, 0), Ordering::Acquire).expect("shadow"), 0);
    }

    #[test]
    fn slots_outside_the_page_are_refused() {
        // Goal: a queue whose doorbells do not fit in the page (wide stride) gets no slots
        // instead of slots past the page's end.
        let dma = DmaPool::identity();
        let buffer = DoorbellBuffer::allocate(&dma, 6).expect("pages"); // 256-byte stride: 8 queues
        assert!(buffer.slots(QueueId(7)).is_ok());
        assert!(matches!(
            buffer.slots(QueueId(8)),
            Err(NvmeError::NoShadowDoorbellSlot { queue: QueueId(8), stride_bytes: 256, last_queue: 7 })
        ));
        let narrow = DoorbellBuffer::allocate(&dma, 0).expect("pages"); // 4-byte stride: 511 queues
        assert!(narrow.slots(QueueId(511)).is_ok());
        assert!(matches!(narrow.slots(QueueId(512)), Err(NvmeError::NoShadowDoorbellSlot { last_queue: 511, .. })));
    }
}
