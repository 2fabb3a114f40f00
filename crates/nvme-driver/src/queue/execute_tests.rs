//! `QueuePair::execute` when the reap that delivers its command's completion then fails on a
//! later entry.

use std::sync::Mutex;
use std::time::Duration;

use super::{doorbell_offsets, QueuePair};
use crate::hw::{DmaAllocator, DmaPool, DmaRegion, RegisterIo};
use crate::spec::{CompletionEntry, SubmissionEntry, COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use crate::types::QueueId;

const QUEUE: QueueId = QueueId(0);

/// A controller that answers the first command fetched with a success completion and, right
/// behind it in the same CQ, an entry for a command id nobody issued.
struct AnswerThenGarbage {
    submission: DmaRegion,
    completion: DmaRegion,
    submission_doorbell: usize,
    answered: Mutex<bool>,
}

impl RegisterIo for AnswerThenGarbage {
    fn len(&self) -> usize {
        0x2000
    }
    fn read32(&self, _offset: usize) -> u32 {
        0
    }
    fn write32(&self, offset: usize, _value: u32) {
        let mut answered = self.answered.lock().expect("flag");
        if offset != self.submission_doorbell || *answered {
            return;
        }
        *answered = true;
        let mut bytes = [0u8; SUBMISSION_ENTRY_BYTES];
        self.submission.read(0, &mut bytes).expect("fetch");
        let command_id = SubmissionEntry::from_bytes(&bytes).command_id().0;
        let ours = CompletionEntry { dw0: 0, dw1: 0, sq_head: 1, sq_id: QUEUE.0, command_id, status_and_phase: 1 };
        let garbage = CompletionEntry { command_id: command_id ^ 0x7700, ..ours };
        self.completion.write(0, &ours.to_bytes()).expect("post");
        self.completion.write(COMPLETION_ENTRY_BYTES, &garbage.to_bytes()).expect("post");
    }
    fn read64(&self, _offset: usize) -> u64 {
        0
    }
    fn write64(&self, _offset: usize, _value: u64) {}
}

#[test]
fn a_delivered_completion_is_returned_although_the_reap_failed_after_it() {
    // Goal: once execute's command completed (its completion delivered by the reap), a later
    // entry of the same reap that the driver rejects does not turn that answer into an error: a
    // Delete I/O SQ that succeeded must be known to have succeeded (the rings are then free to
    // go, and a retry would find the queue gone). Before, execute returned the later entry's
    // UnexpectedCompletion and dropped the delivered completion.
    let dma = DmaPool::identity();
    let doorbells = doorbell_offsets(QUEUE, 0, 0x2000).expect("offsets");
    let depth = 4u32;
    let allocate = |bytes: usize| -> DmaRegion { dma.allocate(bytes).expect("dma") };
    let (submission, completion) = (allocate(depth as usize * SUBMISSION_ENTRY_BYTES), allocate(depth as usize * COMPLETION_ENTRY_BYTES));
    let registers = std::sync::Arc::new(AnswerThenGarbage {
        submission: submission.clone(),
        completion: completion.clone(),
        submission_doorbell: doorbells.0,
        answered: Mutex::new(false),
    });
    let regions = [submission, completion, allocate(crate::datapath::SCRATCH_BYTES)];
    let mut pair = QueuePair::from_regions(QUEUE, depth, regions, registers, doorbells);
    let result = pair.execute(SubmissionEntry::delete_io_submission_queue(1), Duration::from_secs(5));
    assert!(result.as_ref().is_ok_and(|completion| completion.status.is_ok()), "{result:?}");
}
