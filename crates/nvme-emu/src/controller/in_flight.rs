//! The table of commands whose transfers the ring holds, and what settling them means.

use std::time::{Duration, Instant};

use nvme_driver::spec::SubmissionEntry;
use tutti_uring::Completion;

use super::Namespace;
use crate::data_pointer::DataBuffers;

/// A Read or Write validated and waiting for (or doing) its backing-store transfer.
pub(super) struct PreparedIo {
    pub(super) entry: SubmissionEntry,
    pub(super) queue_id: u16,
    pub(super) completion_queue_id: u16,
    pub(super) sq_head: u32,
    pub(super) namespace_index: usize,
    pub(super) namespace: Namespace,
    /// Host memory: where a Read's data goes (a Write's was gathered into its buffer already).
    pub(super) buffers: DataBuffers,
    pub(super) write: bool,
    pub(super) start_lba: u64,
    pub(super) blocks: u64,
    /// The transfer goes straight between the file and `buffers` (no bounce buffer); while it
    /// is in flight the ring holds the regions (`buffers.regions` is empty).
    pub(super) direct: bool,
}

impl PreparedIo {
    pub(super) fn len_bytes(&self) -> usize {
        (self.blocks * u64::from(self.namespace.block_size_bytes)) as usize
    }

    pub(super) fn offset_bytes(&self) -> u64 {
        self.namespace.base_offset_bytes + self.start_lba * u64::from(self.namespace.block_size_bytes)
    }

    /// Whether this must wait for `other` (or the reverse): same namespace, intersecting LBAs,
    /// and at least one of them a Write.
    pub(super) fn conflicts(&self, write: bool, namespace_index: usize, start_lba: u64, blocks: u64) -> bool {
        (write || self.write)
            && self.namespace_index == namespace_index
            && self.start_lba < start_lba + blocks
            && start_lba < self.start_lba + self.blocks
    }
}

/// What happens to commands whose transfers are given back while settling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settle {
    /// Finish them and post their completions (a Flush, an admin command follows).
    Finish,
    /// Cancel what the kernel still allows, then drop everything without a completion
    /// (controller or function reset: the queues are going away).
    Discard,
    /// As `Discard`, for a power loss.
    PowerLoss,
}

/// The commands whose transfers the ring holds, indexed by the tag they were pushed with.
///
/// The per-command and per-scan questions are answered without walking the table (it has the
/// ring's 128 slots, and a 4 KiB read costs a few thousand instructions in all): a Read can
/// conflict only when a Write is in flight (`writes`), and no transfer can be past its deadline
/// while `pushed_no_earlier_than` (a lower bound of every push time) is not.
#[derive(Default)]
pub(super) struct InFlight {
    pub(super) slots: Vec<Option<(PreparedIo, Instant)>>,
    pub(super) free: Vec<usize>,
    /// Bytes of the bounced transfers in flight: the controller's buffers they hold. Direct
    /// transfers (host memory) are not counted; the ring's depth bounds them.
    pub(super) bounced_bytes: u64,
    /// Transfers pushed to the ring and not yet handed to the kernel.
    pub(super) unsubmitted: usize,
    /// Writes among the commands in flight.
    pub(super) writes: usize,
    /// No command in flight was pushed before this (exact after [`InFlight::oldest`]; a
    /// completion can only make it conservative).
    pub(super) pushed_no_earlier_than: Option<Instant>,
    /// Reused: completions taken from the ring before their commands finish.
    pub(super) reaped: Vec<Completion>,
}

impl InFlight {
    pub(super) fn with_capacity(capacity: usize) -> Self {
        Self {
            slots: (0..capacity).map(|_| None).collect(),
            free: (0..capacity).rev().collect(),
            bounced_bytes: 0,
            unsubmitted: 0,
            writes: 0,
            pushed_no_earlier_than: None,
            reaped: Vec::with_capacity(capacity),
        }
    }

    pub(super) fn count(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.count() == 0
    }

    pub(super) fn conflicts(&self, write: bool, namespace_index: usize, start_lba: u64, blocks: u64) -> bool {
        // A conflict needs a Write on one side.
        if !write && self.writes == 0 {
            return false;
        }
        self.slots.iter().flatten().any(|(io, _)| io.conflicts(write, namespace_index, start_lba, blocks))
    }

    /// When the oldest transfer in flight was pushed (a walk of the table; it also makes the
    /// lower bound exact).
    pub(super) fn oldest(&mut self) -> Option<Instant> {
        let oldest = self.slots.iter().flatten().map(|(_, pushed)| *pushed).min();
        self.pushed_no_earlier_than = oldest;
        oldest
    }

    /// When the oldest transfer in flight was pushed, if it has been in flight longer than
    /// `timeout` at `now`. Walks the table only when the lower bound is that old (once per
    /// `timeout` under steady traffic), not at every scan.
    pub(super) fn past_deadline(&mut self, now: Instant, timeout: Duration) -> Option<Instant> {
        let bound = self.pushed_no_earlier_than?;
        if now.saturating_duration_since(bound) <= timeout {
            return None;
        }
        self.oldest().filter(|&oldest| now.saturating_duration_since(oldest) > timeout)
    }

    /// A free slot, taken (the tag a transfer is pushed with); `None` when the table is full.
    pub(super) fn take_slot(&mut self) -> Option<usize> {
        self.free.pop()
    }

    /// Puts `io` into a slot from [`InFlight::take_slot`].
    pub(super) fn fill(&mut self, slot: usize, io: PreparedIo, now: Instant) {
        let Some(entry) = self.slots.get_mut(slot) else { return };
        if !io.direct {
            self.bounced_bytes += io.len_bytes() as u64;
        }
        self.writes += usize::from(io.write);
        // Push times only grow: the bound stays below every one of them.
        self.pushed_no_earlier_than = Some(self.pushed_no_earlier_than.map_or(now, |bound| bound.min(now)));
        *entry = Some((io, now));
    }

    pub(super) fn take(&mut self, tag: u64) -> Option<PreparedIo> {
        let slot = usize::try_from(tag).ok()?;
        let (io, _) = self.slots.get_mut(slot)?.take()?;
        self.free.push(slot);
        if !io.direct {
            self.bounced_bytes = self.bounced_bytes.saturating_sub(io.len_bytes() as u64);
        }
        self.writes = self.writes.saturating_sub(usize::from(io.write));
        if self.free.len() == self.slots.len() {
            self.pushed_no_earlier_than = None;
        }
        Some(io)
    }

    /// Test view: (namespace index, first LBA, blocks, write) of every command in flight.
    #[cfg(test)]
    pub(super) fn ranges(&self) -> Vec<(usize, u64, u64, bool)> {
        self.slots.iter().flatten().map(|(io, _)| (io.namespace_index, io.start_lba, io.blocks, io.write)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prepared(write: bool, start_lba: u64) -> PreparedIo {
        PreparedIo {
            entry: SubmissionEntry::default(),
            queue_id: 1,
            completion_queue_id: 1,
            sq_head: 0,
            namespace_index: 0,
            namespace: Namespace { block_size_bytes: 4096, blocks: 1 << 20, base_offset_bytes: 0 },
            buffers: DataBuffers::default(),
            write,
            start_lba,
            blocks: 1,
            direct: false,
        }
    }

    #[test]
    fn the_deadline_follows_the_oldest_transfer_still_in_flight() {
        // Goal: the per-scan deadline check, which walks the table only when its lower bound of
        // the push times is past the timeout, fails exactly the transfers that are: a transfer
        // that completed long ago does not make a young one look late, and an old one stays late.
        let timeout = Duration::from_secs(30);
        let start = Instant::now();
        let mut in_flight = InFlight::with_capacity(4);
        let first = in_flight.take_slot().unwrap();
        in_flight.fill(first, prepared(false, 0), start);
        let second = in_flight.take_slot().unwrap();
        in_flight.fill(second, prepared(false, 8), start + Duration::from_secs(20));
        assert_eq!(in_flight.past_deadline(start + Duration::from_secs(29), timeout), None);
        in_flight.take(first as u64).unwrap();
        // The bound still says `start`; the walk finds the second transfer, 15 s old.
        assert_eq!(in_flight.past_deadline(start + Duration::from_secs(35), timeout), None);
        assert_eq!(in_flight.past_deadline(start + Duration::from_secs(51), timeout), Some(start + Duration::from_secs(20)));
        // Emptied, then refilled later: the new transfer's own time counts.
        in_flight.take(second as u64).unwrap();
        assert_eq!(in_flight.past_deadline(start + Duration::from_secs(100), timeout), None);
        let third = in_flight.take_slot().unwrap();
        in_flight.fill(third, prepared(false, 16), start + Duration::from_secs(90));
        assert_eq!(in_flight.past_deadline(start + Duration::from_secs(119), timeout), None);
        assert_eq!(in_flight.past_deadline(start + Duration::from_secs(121), timeout), Some(start + Duration::from_secs(90)));
    }

    #[test]
    fn reads_conflict_only_with_writes_in_flight() {
        // Goal: the shortcut for Reads (no table walk while no Write is in flight) still finds
        // every overlapping Write, and forgets it once it completed.
        let now = Instant::now();
        let mut in_flight = InFlight::with_capacity(4);
        let read = in_flight.take_slot().unwrap();
        in_flight.fill(read, prepared(false, 0), now);
        assert!(!in_flight.conflicts(false, 0, 0, 1), "two reads never conflict");
        assert!(in_flight.conflicts(true, 0, 0, 1), "a write over a read in flight waits");
        let write = in_flight.take_slot().unwrap();
        in_flight.fill(write, prepared(true, 8), now);
        assert!(in_flight.conflicts(false, 0, 8, 1), "a read over a write in flight waits");
        assert!(!in_flight.conflicts(false, 0, 9, 1), "a read next to it does not");
        assert!(!in_flight.conflicts(false, 1, 8, 1), "nor one in another namespace");
        in_flight.take(write as u64).unwrap();
        assert!(!in_flight.conflicts(false, 0, 8, 1), "the write completed");
    }
}
