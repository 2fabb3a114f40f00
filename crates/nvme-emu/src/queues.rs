//! Controller-side queue state: where each queue lives, its head/tail, the CQ phase.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::restriction::QueueRestriction;
use nvme_driver::hw::DmaRegion;
use nvme_driver::spec::{CompletionEntry, SubmissionEntry, COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};

/// A submission queue as the controller tracks it.
pub(crate) struct SubmissionQueue {
    pub completion_queue_id: u16,
    pub entries: u32,
    /// Next slot the controller fetches.
    pub head: u32,
    /// Last valid tail the host rang.
    pub tail: u32,
    pub memory: DmaRegion,
    /// The last out-of-range doorbell value seen, so one bad write is counted once.
    pub last_invalid_doorbell: Option<u32>,
    /// What this queue's commands may reach (set by the host after creating it; see
    /// `restriction.rs`). `None`: the whole DMA space and every namespace.
    pub restriction: Option<Arc<QueueRestriction>>,
    /// The last scan left commands here for want of a free completion queue entry (so a wait
    /// is counted once, not once per scan).
    pub waiting_for_completion_room: bool,
}

impl SubmissionQueue {
    pub(crate) fn new(memory: DmaRegion, entries: u32, completion_queue_id: u16) -> Self {
        Self {
            completion_queue_id,
            entries,
            head: 0,
            tail: 0,
            memory,
            last_invalid_doorbell: None,
            restriction: None,
            waiting_for_completion_room: false,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.head == self.tail
    }

    /// The entry at the head, read from host memory once: the caller runs this copy and then
    /// takes the slot with [`SubmissionQueue::advance`], never reading the entry again (a host
    /// may rewrite it meanwhile). The host published it before its doorbell write, which the
    /// caller observed with Acquire ordering.
    pub(crate) fn peek(&self) -> Option<SubmissionEntry> {
        let mut bytes = [0u8; SUBMISSION_ENTRY_BYTES];
        self.memory.read(self.head as usize * SUBMISSION_ENTRY_BYTES, &mut bytes).ok()?;
        Some(SubmissionEntry::from_bytes(&bytes))
    }

    /// Takes the entry at the head (the caller read it with `peek`): advances the head.
    pub(crate) fn advance(&mut self) {
        self.head = (self.head + 1) % self.entries;
    }
}

/// A completion queue as the controller tracks it.
pub(crate) struct CompletionQueue {
    pub entries: u32,
    /// Next slot the controller writes.
    pub tail: u32,
    /// Last valid head the host rang.
    pub head: u32,
    /// Phase tag of the current pass (starts at 1, flips on wrap).
    pub phase: bool,
    /// Slots promised to completions still on their way (delayed by fault injection).
    pub reserved: u32,
    pub memory: DmaRegion,
    pub last_invalid_doorbell: Option<u32>,
}

impl CompletionQueue {
    pub(crate) fn new(memory: DmaRegion, entries: u32) -> Self {
        Self { entries, tail: 0, head: 0, phase: true, reserved: 0, memory, last_invalid_doorbell: None }
    }

    /// Slots the controller can fill without overwriting entries the host has not consumed
    /// (one slot always stays empty: full is tail + 1 == head).
    pub(crate) fn free_slots(&self) -> u32 {
        let used = (self.tail + self.entries - self.head) % self.entries;
        (self.entries - 1).saturating_sub(used).saturating_sub(self.reserved)
    }

    /// Writes `entry` (its phase bit replaced by the current phase) at the tail and advances.
    /// Dwords 0..2 are copied first; dword 3 (command id, status, phase) is stored last with
    /// Release so a host that loads it with Acquire sees the whole entry.
    pub(crate) fn post(&mut self, mut entry: CompletionEntry) -> bool {
        entry.status_and_phase = entry.status_and_phase & !1 | u16::from(self.phase);
        let bytes = entry.to_bytes();
        let offset = self.tail as usize * COMPLETION_ENTRY_BYTES;
        let dword3 = u32::from(entry.command_id) | u32::from(entry.status_and_phase) << 16;
        let written = self.memory.write(offset, &bytes[..CompletionEntry::DWORD3_OFFSET]).is_ok()
            && self.memory.store_u32(offset + CompletionEntry::DWORD3_OFFSET, dword3, Ordering::Release).is_ok();
        self.tail += 1;
        if self.tail == self.entries {
            self.tail = 0;
            self.phase = !self.phase;
        }
        written
    }
}
