//! The read barrier between a completion entry's phase tag and the rest of the entry.

use super::{doorbell_offsets, QueuePair};
use crate::hw::{DmaAllocator, DmaPool, DmaRegion, RegisterIo, COMPLETION_PHASE_FENCES};
use crate::spec::{CompletionEntry, SubmissionEntry, COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use crate::types::{NamespaceId, QueueId};

const QUEUE: QueueId = QueueId(1);

/// Registers that ignore every write: the test posts completions itself.
struct Silent;

impl RegisterIo for Silent {
    fn len(&self) -> usize {
        0x2000
    }
    fn read32(&self, _offset: usize) -> u32 {
        0
    }
    fn write32(&self, _offset: usize, _value: u32) {}
    fn read64(&self, _offset: usize) -> u64 {
        0
    }
    fn write64(&self, _offset: usize, _value: u64) {}
}

#[test]
fn reap_fences_after_each_phase_match_before_reading_the_entry() {
    // Goal: every completion entry reap consumes is read only after
    // hw::fence_after_completion_phase (dmb oshld on Arm), which no x86 run can observe by
    // its effect: an Acquire load of dword 3 alone does not order the body's loads for a PCIe
    // device's writes on Arm, and the body (SQ head, SQ id, dword 0) could come from the
    // slot's previous lap. A poll that finds no entry (phase not matching) needs no fence.
    let dma = DmaPool::identity();
    let doorbells = doorbell_offsets(QUEUE, 0, 0x2000).expect("offsets");
    let depth = 4u32;
    let allocate = |bytes: usize| -> DmaRegion { dma.allocate(bytes).expect("dma") };
    let completion = allocate(depth as usize * COMPLETION_ENTRY_BYTES);
    let regions = [allocate(depth as usize * SUBMISSION_ENTRY_BYTES), completion.clone(), allocate(3 * crate::datapath::SCRATCH_BYTES)];
    let mut pair = QueuePair::from_regions(QUEUE, depth, regions, std::sync::Arc::new(Silent), doorbells);
    let ids: Vec<_> = (0..2).map(|tag| pair.submit(SubmissionEntry::flush(NamespaceId(1)), tag).expect("submit")).collect();
    pair.ring_doorbell().expect("ring");
    let fences = || COMPLETION_PHASE_FENCES.with(std::cell::Cell::get);
    let before = fences();
    assert_eq!(pair.reap(8, |_| {}).expect("nothing posted"), 0);
    assert!(!pair.completion_pending());
    assert_eq!(fences(), before, "no entry, no fence");
    for (index, id) in ids.iter().enumerate() {
        let posted = CompletionEntry { dw0: 0, dw1: 0, sq_head: 2, sq_id: QUEUE.0, command_id: id.0, status_and_phase: 1 };
        completion.write(index * COMPLETION_ENTRY_BYTES, &posted.to_bytes()).expect("post");
    }
    assert_eq!(pair.reap(8, |_| {}).expect("reap"), 2);
    assert_eq!(fences() - before, 2, "one fence per entry read");
}
