//! Doorbell Buffer Config (§5.7), the controller's side: once the host gave the shadow doorbell
//! and EventIdx pages, every I/O queue's SQ tail and CQ head are read from the shadow page
//! instead of the doorbell registers, and each read is answered in the EventIdx page with the
//! value seen, which tells the host (see the driver's `shadow.rs`) that the next value past it
//! needs an MMIO doorbell write too. The admin queue keeps its register doorbells, as Linux
//! drives it (QEMU copies admin doorbell writes into the shadow page instead; both work with
//! hosts that write admin doorbells through MMIO, which every host does).
//!
//! The handshake that lets a host skip the MMIO write without a command going unseen: the host
//! stores the shadow value, fences, loads the EventIdx; here the value is loaded, the EventIdx
//! stored, a full fence, the value loaded again and used. Either the host saw the EventIdx
//! (and, as the value passed it, wrote the doorbell, which wakes a sleeping controller) or the
//! second load here saw the host's value. A scan that finds new work scans again, and the
//! controller always scans once more after announcing that it will sleep, so a value read on
//! the second load, ahead of its EventIdx, is answered before the controller parks.

use std::sync::atomic::{fence, Ordering};

use nvme_driver::hw::{DmaAllocator, DmaRegion};
use nvme_driver::spec::registers::shadow_doorbell_offset;
use nvme_driver::spec::status::codes;
use nvme_driver::spec::SubmissionEntry;
use nvme_driver::Iova;

use crate::controller::{generic, CommandResult, ControllerCore};

/// Each buffer is one memory page (CC.MPS: 4 KiB here).
const PAGE_BYTES: usize = 4096;

/// The host's two pages, as the controller reaches them.
pub(crate) struct ShadowDoorbells {
    shadow: DmaRegion,
    event_indexes: DmaRegion,
    doorbell_stride_log2: u8,
}

impl ShadowDoorbells {
    /// Where queue `queue_id`'s doorbell lives in both pages: `None` for the admin queue and for
    /// a queue whose slot falls outside the page (its register doorbell is used).
    fn slot(&self, queue_id: u16, completion: bool) -> Option<usize> {
        let offset = shadow_doorbell_offset(queue_id, completion, self.doorbell_stride_log2);
        (queue_id != 0 && offset + 4 <= PAGE_BYTES).then_some(offset)
    }

    /// The doorbell's value from the shadow page, its EventIdx set to what was seen (see the
    /// module documentation); `None` where the register doorbell applies.
    pub(crate) fn read(&self, queue_id: u16, completion: bool) -> Option<u32> {
        let offset = self.slot(queue_id, completion)?;
        let seen = self.shadow.load_u32(offset, Ordering::Acquire).ok()?;
        self.event_indexes.store_u32(offset, seen, Ordering::Release).ok()?;
        fence(Ordering::SeqCst);
        self.shadow.load_u32(offset, Ordering::Acquire).ok()
    }

    /// Writes a queue's present value into its shadow slot (when the pages arrive after the
    /// queue was created, or when a queue is created: head = tail = 0).
    pub(crate) fn initialize(&self, queue_id: u16, completion: bool, value: u32) {
        if let Some(offset) = self.slot(queue_id, completion) {
            let _ = self.shadow.store_u32(offset, value, Ordering::Release);
            let _ = self.event_indexes.store_u32(offset, value, Ordering::Release);
        }
    }
}

impl ControllerCore {
    /// Doorbell Buffer Config: PRP1 the shadow doorbell page, PRP2 the EventIdx page, each page
    /// aligned and mapped. Queues that exist already carry on from their present values: the
    /// doorbells as the host last rang them (read now, see `read_io_doorbells`), not as the
    /// controller last looked.
    pub(crate) fn doorbell_buffer_config(&mut self, entry: &SubmissionEntry) -> CommandResult {
        if !self.config.shadow_doorbells {
            return Err(generic(codes::INVALID_OPCODE));
        }
        let [shadow, event_indexes] = entry.dptr;
        if shadow == 0 || event_indexes == 0 || shadow % PAGE_BYTES as u64 != 0 || event_indexes % PAGE_BYTES as u64 != 0 {
            return Err(generic(codes::INVALID_FIELD));
        }
        let translate = |iova| self.dma.translate(Iova(iova), PAGE_BYTES).map_err(|_| generic(codes::DATA_TRANSFER_ERROR));
        let pages = ShadowDoorbells {
            shadow: translate(shadow)?,
            event_indexes: translate(event_indexes)?,
            doorbell_stride_log2: self.config.doorbell_stride_log2,
        };
        self.read_io_doorbells();
        for (queue_id, queue) in self.submission_queues.iter().enumerate() {
            if let Some(queue) = queue {
                pages.initialize(queue_id as u16, false, queue.tail);
            }
        }
        for (queue_id, queue) in self.completion_queues.iter().enumerate() {
            if let Some(queue) = queue {
                pages.initialize(queue_id as u16, true, queue.head);
            }
        }
        self.shadow_doorbells = Some(pages);
        Ok(0)
    }
}
