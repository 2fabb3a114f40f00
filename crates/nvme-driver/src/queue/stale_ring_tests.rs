//! `ring_doorbell` against a reset that begins between its two doorbell writes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::{doorbell_offsets, QueuePair};
use crate::error::NvmeError;
use crate::gate::DoorbellGate;
use crate::hw::{DmaAllocator, DmaPool, DmaRegion, RegisterIo};
use crate::spec::{CompletionEntry, SubmissionEntry, COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use crate::types::{NamespaceId, QueueId};

const QUEUE: QueueId = QueueId(1);

/// Registers that log every write and, once armed, end the gate's generation inside the SQ
/// tail doorbell's write: the write lands, and by the time the pair's flag is down a reset has
/// begun (as if it had waited on that flag and bumped the generation the moment it dropped).
struct ResetAfterTail {
    gate: Arc<DoorbellGate>,
    submission_doorbell: usize,
    armed: AtomicBool,
    writes: Mutex<Vec<(usize, u32)>>,
}

impl RegisterIo for ResetAfterTail {
    fn len(&self) -> usize {
        0x2000
    }
    fn read32(&self, _offset: usize) -> u32 {
        0
    }
    fn write32(&self, offset: usize, value: u32) {
        self.writes.lock().expect("log").push((offset, value));
        if offset == self.submission_doorbell && self.armed.swap(false, Ordering::SeqCst) {
            self.gate.end_generation_unwaited();
        }
    }
    fn read64(&self, _offset: usize) -> u64 {
        0
    }
    fn write64(&self, _offset: usize, _value: u64) {}
}

#[test]
fn a_stale_completion_head_does_not_report_a_published_tail_as_unwritten() {
    // Goal: once ring_doorbell wrote the SQ tail, it never answers QueueStale (which promises
    // that nothing of the batch reached the controller): a caller trusting that answer would
    // fail the request and free its buffer while the controller may still fetch the command
    // and move data. The reset here begins right after the tail's write, before the deferred
    // CQ head doorbell that follows it in the same ring.
    let dma = DmaPool::identity();
    let (submission_doorbell, completion_doorbell) = doorbell_offsets(QUEUE, 0, 0x2000).expect("offsets");
    let gate = Arc::new(DoorbellGate::new());
    let registers = Arc::new(ResetAfterTail {
        gate: Arc::clone(&gate),
        submission_doorbell,
        armed: AtomicBool::new(false),
        writes: Mutex::new(Vec::new()),
    });
    let depth = 2u32;
    let allocate = |bytes: usize| -> DmaRegion { dma.allocate(bytes).expect("dma") };
    let completion = allocate(depth as usize * COMPLETION_ENTRY_BYTES);
    let regions = [allocate(depth as usize * SUBMISSION_ENTRY_BYTES), completion.clone(), allocate(crate::datapath::SCRATCH_BYTES)];
    let mut pair = QueuePair::from_regions(QUEUE, depth, regions, registers.clone(), (submission_doorbell, completion_doorbell));
    pair.attach_gate(Arc::clone(&gate), gate.generation());
    pair.defer_completion_doorbell();

    // One command, its completion posted and reaped: the CQ head (1) stays unpublished, since
    // with nothing in flight the controller needs no entry back.
    let first = pair.submit(SubmissionEntry::flush(NamespaceId(1)), 1).expect("submit");
    pair.ring_doorbell().expect("first ring");
    let posted = CompletionEntry { dw0: 0, dw1: 0, sq_head: 1, sq_id: QUEUE.0, command_id: first.0, status_and_phase: 1 };
    completion.write(0, &posted.to_bytes()).expect("post");
    assert_eq!(pair.reap(1, |_| {}).expect("reap"), 1);

    // The second command's ring writes the tail, then needs the head: a depth-2 CQ with one
    // command in flight and one entry unpublished is full as far as the controller knows.
    pair.submit(SubmissionEntry::flush(NamespaceId(1)), 2).expect("submit");
    registers.armed.store(true, Ordering::SeqCst);
    let rang = pair.ring_doorbell();
    let writes = registers.writes.lock().expect("log").clone();
    let tail_written = writes.contains(&(submission_doorbell, 0));
    assert!(tail_written, "the second tail was not written: {writes:?}");
    assert!(
        !matches!(rang, Err(NvmeError::QueueStale { .. })),
        "ring_doorbell said QueueStale (nothing written) after the SQ tail landed: {writes:?}"
    );
    assert!(rang.is_ok(), "{rang:?}");
    assert!(!writes.iter().any(|&(offset, _)| offset == completion_doorbell), "a stale pair wrote a doorbell: {writes:?}");
    // The pair is stale from here: everything else refuses.
    assert!(matches!(pair.reap(1, |_| {}), Err(NvmeError::QueueStale { .. })));
    assert!(matches!(pair.ring_doorbell(), Err(NvmeError::QueueStale { .. })));
}
