//! A long zeroing (a deallocate, or a Write Zeroes, of more than one slice) runs one slice per
//! poll, so the controller's lock is released between slices: on a store that must write
//! zeroes (a block device without write-zeroes offload) a whole namespace takes minutes, and
//! `stats()`, `preset_restriction()` (tuttid calls both under its store lock), a power loss,
//! a function reset and the device's drop must not wait that long. A shutdown notification
//! waits for it the same way, a poll at a time (SHST reads 01b meanwhile), and writes the
//! cache back once it ended (`lifecycle.rs`).
//!
//! Between slices the poll scans the queues, but a command the zeroing holds back
//! ([`ZeroingCommand::holds_back`]) stays in its SQ, with those behind it, until the zeroing
//! completed: a Read or Write of a block still to zero (a Read would see old data, a Write
//! would be zeroed afterwards), anything that may start a zeroing of its own or touch queues,
//! and anything on the zeroing's own SQ while the commands fetched after it in its batch wait
//! (they run, in order, once it completed). Reads and Writes of other blocks, Flushes (they
//! promise only what completed before them) and admin commands that read only run meanwhile.
//! Once it completed, the rest of its batch waits for one scan, in which every admin command
//! but a Delete I/O SQ of the rest's queue runs: the admin queue waits for one zeroing of a
//! batch at a time, not for all of them.
//! The state this takes is the zeroing's remaining runs (at most 256); held commands stay in
//! host memory (the scan reads an entry once, and runs that copy). The completions the zeroing
//! owes (its own and the rest of its batch's) keep reserved CQ slots until it ends, so what
//! runs meanwhile on other SQs of its CQ cannot fill the CQ before them. A reset, a power
//! loss, a function reset and the controller going fatal drop it without a completion (their
//! stop deletes its queue); the blocks it zeroed read as zero, the rest keep their data, which
//! is all a host may assume of a command that never completed.

use std::time::Instant;

use nvme_driver::spec::status::codes;
use nvme_driver::spec::{AdminOpcode, NvmOpcode, SubmissionEntry};

use super::{generic, CommandResult, ControllerCore};
use crate::faults::FaultAction;
use crate::io::{abandoned_for_reset, Zeroing};

/// A long zeroing with the command it belongs to.
pub(super) struct ZeroingCommand {
    job: Zeroing,
    queue_id: u16,
    completion_queue_id: u16,
    sq_head: u32,
    entry: SubmissionEntry,
    fault: Option<FaultAction>,
    /// The commands fetched after it in its batch: they run, in order, once it completed.
    rest: Vec<(SubmissionEntry, u32)>,
    /// Its own command completed; only `rest` waits, for one scan of the queues (see
    /// [`ControllerCore::advance_zeroing`]).
    completed: bool,
}

impl ZeroingCommand {
    /// Whether the command `entry` at the head of SQ `queue_id` waits for this zeroing (it and
    /// the commands after it stay in the SQ). Held back: a Read or Write of a block it has
    /// still to zero (a Read would see old data, a Write would be zeroed later), a Write Zeroes
    /// or Dataset Management (either may start a zeroing of its own), a fused or unknown
    /// command, any admin command but Identify, Get Log Page, Get Features, Abort and
    /// Asynchronous Event Request (which touch no block and no queue), and anything on its
    /// own SQ while commands fetched after it in its batch wait (they run first). Once its
    /// command completed (only the rest waits, for one scan): its own SQ, what may start a
    /// zeroing, and a Delete I/O SQ of its queue.
    pub(super) fn holds_back(&self, queue_id: u16, entry: &SubmissionEntry) -> bool {
        if queue_id == self.queue_id && !self.rest.is_empty() {
            return true;
        }
        if self.completed {
            // Zeroed: only the rest of its batch waits, for one scan. What may start a zeroing
            // (the rest may start one, and one is held at a time) waits with it, and so does a
            // Delete I/O SQ of the rest's own queue; any other admin command runs now.
            return if queue_id == 0 {
                entry.opcode() == AdminOpcode::DeleteIoSubmissionQueue as u8 && (entry.cdw10 & 0xFFFF) as u16 == self.queue_id
            } else {
                entry.fuse() != 0
                    || !matches!(NvmOpcode::from_u8(entry.opcode()), Some(NvmOpcode::Read | NvmOpcode::Write | NvmOpcode::Flush))
            };
        }
        if queue_id == 0 {
            let reads_only = matches!(
                AdminOpcode::from_u8(entry.opcode()),
                Some(AdminOpcode::Identify | AdminOpcode::GetLogPage | AdminOpcode::GetFeatures | AdminOpcode::Abort)
            ) || entry.opcode() == crate::admin::ASYNC_EVENT_REQUEST;
            return !reads_only;
        }
        if entry.fuse() != 0 {
            return true;
        }
        match NvmOpcode::from_u8(entry.opcode()) {
            // A Flush promises only what completed before it: not this zeroing.
            Some(NvmOpcode::Flush) => false,
            Some(NvmOpcode::Read | NvmOpcode::Write) => {
                if entry.nsid != self.entry.nsid {
                    // Another namespace (NSIDs name namespaces one to one), or none.
                    return false;
                }
                let start = entry.starting_lba().0;
                start.checked_add(u64::from(entry.block_count())).is_none_or(|end| self.job.overlaps(start, end))
            }
            _ => true,
        }
    }
}

impl ControllerCore {
    /// Right after a command ran: takes the long zeroing it started, if it did, with the rest
    /// of its batch (`rest`). True when it did: the command completes when the zeroing ends,
    /// and the batch stops here. A zeroing started while one is held (never, as the scan
    /// holds back what may start one) is refused: `result` becomes Command Sequence Error.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hold_started_zeroing(
        &mut self,
        result: &mut CommandResult,
        queue_id: u16,
        completion_queue_id: u16,
        sq_head: u32,
        entry: &SubmissionEntry,
        fault: Option<FaultAction>,
        rest: &[(SubmissionEntry, u32)],
    ) -> bool {
        let Some(job) = self.zeroing_started.take() else { return false };
        if result.is_err() {
            // Only a successful start leaves a job; a failure after it completes as it is.
            return false;
        }
        if self.zeroing.is_some() {
            // The scan holds back every command that may start a zeroing while one runs, and
            // runs the copy of the entry it looked at: a second one is a bug here. Refused
            // rather than replace the first (whose command would never complete): nothing of
            // it was zeroed yet (`zero_runs` left the whole of it to the job).
            debug_assert!(false, "a second long zeroing started while one was held");
            *result = Err(generic(codes::COMMAND_SEQUENCE_ERROR));
            return false;
        }
        let command =
            ZeroingCommand { job, queue_id, completion_queue_id, sq_head, entry: *entry, fault, rest: rest.to_vec(), completed: false };
        // The completions it owes (its own, and those of the rest of its batch) keep their CQ
        // slots, as a delayed completion's does: the scan fetches other commands meanwhile,
        // and without them those could fill the CQ before the zeroing's completion goes in.
        self.reserve_owed_slots(&command, true);
        self.zeroing = Some(command);
        true
    }

    /// Reserves (or gives back) the CQ slots of the completions `command` owes: its own (until
    /// it completed) and one per command of the rest of its batch.
    fn reserve_owed_slots(&mut self, command: &ZeroingCommand, reserve: bool) {
        // The rest of a batch is at most COMMANDS_PER_QUEUE_PER_SCAN commands.
        let owed = u32::try_from(command.rest.len()).unwrap_or(u32::MAX).saturating_add(u32::from(!command.completed));
        if let Some(Some(queue)) = self.completion_queues.get_mut(usize::from(command.completion_queue_id)) {
            queue.reserved = if reserve { queue.reserved.saturating_add(owed) } else { queue.reserved.saturating_sub(owed) };
        }
    }

    /// One poll's slice of the long zeroing held, if any: its command completes when it ends,
    /// then, at the next poll, the rest of its batch runs. True while one was held (the poll's
    /// scan then fetches only what it does not hold back). It waits, holding its slices, while
    /// a reset, a power loss or function reset, or the device's drop is pending: each ends it
    /// at once.
    ///
    /// The rest waits for the scan of the poll the zeroing ended in, so that the admin queue,
    /// held back while the zeroing ran, is served before the rest may start a zeroing of its own
    /// (a batch of several long DSMs, a restricted client's whole-share deallocates, say): the
    /// admin queue waits for one zeroing at a time, not for the whole batch. Until 2026-12-01
    /// the rest ran at once, and a batch of n held tuttid's admin queue for all n.
    pub(super) fn advance_zeroing(&mut self, now: Instant) -> bool {
        let Some(mut command) = self.zeroing.take() else { return false };
        if self.registers.reset_requested() || self.unlocked.give_way() {
            self.zeroing = Some(command);
            return true;
        }
        if command.completed {
            self.reserve_owed_slots(&command, false);
            self.run_batch(command.queue_id, command.completion_queue_id, &command.rest, now);
            return true;
        }
        match self.zero_slice(&mut command.job) {
            Ok(false) => self.zeroing = Some(command),
            ended => {
                let result = ended.map(|_| 0);
                // Its slots go back just before its completion takes one; those of the rest
                // are taken again until it runs.
                self.reserve_owed_slots(&command, false);
                self.complete(command.queue_id, command.completion_queue_id, command.sq_head, &command.entry, result, command.fault, now);
                if !command.rest.is_empty() {
                    command.completed = true;
                    self.reserve_owed_slots(&command, true);
                    self.zeroing = Some(command);
                }
            }
        }
        true
    }

    /// Drops the long zeroing held, without a completion (a stop deletes its queue; a fatal
    /// controller posts nothing more): the CQ slots it reserved go back.
    pub(super) fn drop_zeroing(&mut self) {
        if let Some(command) = self.zeroing.take() {
            self.reserve_owed_slots(&command, false);
        }
        self.zeroing_started = None;
    }

    /// For a caller that runs one command by itself (the fuzz entry point): finishes the long
    /// zeroing the command started, here, giving way as the controller thread does.
    pub(crate) fn finish_started_zeroing(&mut self, result: CommandResult) -> CommandResult {
        let Some(mut job) = self.zeroing_started.take() else { return result };
        result?;
        // Bounded: each pass zeroes at least one block of a finite job.
        loop {
            if self.registers.reset_requested() || self.unlocked.give_way() {
                return Err(abandoned_for_reset());
            }
            if self.zero_slice(&mut job)? {
                return result;
            }
        }
    }
}
