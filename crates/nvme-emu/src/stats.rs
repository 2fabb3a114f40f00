//! Counters the controller keeps, readable by tests through [`crate::EmuDevice::stats`].

use std::collections::BTreeMap;

use nvme_driver::spec::{AdminOpcode, NvmOpcode, SubmissionEntry};

/// A snapshot of the controller's counters since it was started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EmuStats {
    /// Admin commands fetched, by opcode.
    pub admin_commands: BTreeMap<u8, u64>,
    /// I/O commands fetched, by opcode.
    pub io_commands: BTreeMap<u8, u64>,
    /// Commands fetched, by submission queue id (0 = admin): shows which queues' doorbells the
    /// controller acted on, e.g. that a stale queue pair's doorbell made it run another pair's SQ.
    pub commands_by_queue: BTreeMap<u16, u64>,
    /// Submission entries fetched that were all zeroes: a doorbell published slots nobody wrote
    /// (a stale or wrong tail). A correct host never causes one.
    pub zeroed_entries_fetched: u64,
    /// Bytes moved to the host by Read.
    pub bytes_read: u64,
    /// Bytes moved from the host by Write.
    pub bytes_written: u64,
    /// Completions posted (including error completions).
    pub completions_posted: u64,
    /// Completions with a non-success status.
    pub error_completions: u64,
    /// Commands refused because they named memory or LBAs outside their submission queue's
    /// restriction (`EmuDevice::restrict_submission_queue`); none of them moved data.
    pub restriction_refusals: u64,
    /// Doorbell values beyond the queue size, ignored.
    pub invalid_doorbell_writes: u64,
    /// Times a submission queue's commands were left unfetched because its completion queue
    /// had no free entry, even after reading the CQ head doorbell again (counted once per wait,
    /// not per scan): each such wait costs the commands at least one more scan.
    pub completion_room_waits: u64,
    /// Bytes written back from the volatile write cache to the backing store.
    pub cache_writeback_bytes: u64,
    /// Reads whose backing-store I/O went through io_uring (several in flight; bounced or direct).
    pub batched_reads: u64,
    /// Writes whose backing-store I/O went through io_uring (several in flight; bounced or direct).
    pub batched_writes: u64,
    /// Of those, the Reads and Writes whose transfer went straight between the file and host
    /// memory (no bounce buffer: aligned memory, an `O_DIRECT` file).
    pub direct_transfers: u64,
    /// Submissions that handed pushed transfers to the kernel (`io_uring_enter` calls with
    /// something new for it): one per transfer, each goes as soon as it is pushed.
    pub transfer_submissions: u64,
    /// Faults the plan injected.
    pub faults_injected: u64,
    /// `power_loss()` calls.
    pub power_losses: u64,
    /// Controller enables (CC.EN 0 to 1 that reached CSTS.RDY = 1).
    pub enables: u64,
    /// What the timing model did, when one is configured.
    pub timing: Option<crate::TimingStats>,
}

impl EmuStats {
    pub fn admin(&self, opcode: AdminOpcode) -> u64 {
        self.admin_commands.get(&(opcode as u8)).copied().unwrap_or(0)
    }

    pub fn io(&self, opcode: NvmOpcode) -> u64 {
        self.io_commands.get(&(opcode as u8)).copied().unwrap_or(0)
    }

    /// Commands fetched from submission queue `queue_id`.
    pub fn commands_on_queue(&self, queue_id: u16) -> u64 {
        self.commands_by_queue.get(&queue_id).copied().unwrap_or(0)
    }
}

/// The live counters: flat arrays on the hot path, turned into maps only for a snapshot.
pub(crate) struct Counters {
    pub admin_by_opcode: [u64; 256],
    pub io_by_opcode: [u64; 256],
    /// Indexed by submission queue id; grows once per new queue id, not per command.
    pub by_queue: Vec<u64>,
    pub totals: EmuStats,
    /// Host read/write commands completed successfully (SMART log).
    pub host_reads: u64,
    pub host_writes: u64,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            admin_by_opcode: [0; 256],
            io_by_opcode: [0; 256],
            by_queue: Vec::new(),
            totals: EmuStats::default(),
            host_reads: 0,
            host_writes: 0,
        }
    }
}

impl Counters {
    /// Counts one fetched command of submission queue `queue_id`.
    pub(crate) fn count_command(&mut self, queue_id: u16, entry: &SubmissionEntry) {
        let table = if queue_id == 0 { &mut self.admin_by_opcode } else { &mut self.io_by_opcode };
        table[usize::from(entry.opcode())] += 1;
        let index = usize::from(queue_id);
        if index >= self.by_queue.len() {
            self.by_queue.resize(index + 1, 0);
        }
        self.by_queue[index] += 1;
        if *entry == SubmissionEntry::default() {
            self.totals.zeroed_entries_fetched += 1;
        }
    }

    pub(crate) fn snapshot(&self) -> EmuStats {
        let to_map = |table: &[u64; 256]| {
            table.iter().enumerate().filter(|(_, &count)| count > 0).map(|(opcode, &count)| (opcode as u8, count)).collect()
        };
        let commands_by_queue =
            self.by_queue.iter().enumerate().filter(|(_, &count)| count > 0).map(|(queue_id, &count)| (queue_id as u16, count)).collect();
        EmuStats {
            admin_commands: to_map(&self.admin_by_opcode),
            io_commands: to_map(&self.io_by_opcode),
            commands_by_queue,
            ..self.totals.clone()
        }
    }
}
