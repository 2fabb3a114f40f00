//! A long zeroing (a deallocate, or a Write Zeroes, of more than one slice) runs one slice per
//! poll, so the controller's lock is released between slices: on a store that must write
//! zeroes (a block device without write-zeroes offload) a whole namespace takes minutes, and
//! `stats()`, `preset_restriction()` (tuttid calls both under its store lock), a power loss,
//! a function reset and the device's drop must not wait that long. (A shutdown notification
//! finishes a zeroing in one poll, under the lock: host-side calls then wait for the rest of it;
//! a power loss, a function reset and the drop still stop it at its next slice.)
//!
//! While one runs, the poll scans no queue: every other command waits for it, as it waited
//! when the zeroing ran in one go (so ordering is what it was: nothing overlaps it, a Flush
//! after it finds it done). The commands fetched after it in its batch run once it
//! completed. A reset, a power loss and a function reset drop it without a completion (their
//! stop deletes its queue); the blocks it zeroed read as zero, the rest keep their data, which
//! is all a host may assume of a command that never completed. A shutdown finishes it first.

use std::time::Instant;

use nvme_driver::spec::SubmissionEntry;

use super::{CommandResult, ControllerCore};
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
}

impl ControllerCore {
    /// Right after a command ran: takes the long zeroing it started, if it did, with the rest
    /// of its batch (`rest`). True when it did: the command completes when the zeroing ends,
    /// and the batch stops here.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hold_started_zeroing(
        &mut self,
        result: &CommandResult,
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
        self.zeroing = Some(ZeroingCommand { job, queue_id, completion_queue_id, sq_head, entry: *entry, fault, rest: rest.to_vec() });
        true
    }

    /// One poll's slice of the long zeroing held, if any: its command completes when it ends,
    /// then the rest of its batch runs. True while one was held (the poll then scans no queue).
    /// It waits, holding its slices, while a reset, a power loss or function reset, or the
    /// device's drop is pending: each ends it at once.
    pub(super) fn advance_zeroing(&mut self, now: Instant) -> bool {
        let Some(mut command) = self.zeroing.take() else { return false };
        if self.registers.reset_requested() || self.unlocked.give_way() {
            self.zeroing = Some(command);
            return true;
        }
        match self.zero_slice(&mut command.job) {
            Ok(false) => self.zeroing = Some(command),
            ended => {
                let result = ended.map(|_| 0);
                let ZeroingCommand { queue_id, completion_queue_id, sq_head, entry, fault, rest, .. } = command;
                self.complete(queue_id, completion_queue_id, sq_head, &entry, result, fault, now);
                if !rest.is_empty() {
                    self.run_batch(queue_id, completion_queue_id, &rest, now);
                }
            }
        }
        true
    }

    /// Runs the long zeroing held (and any the rest of its batch starts) to its end, unless a
    /// reset, a power loss or function reset, or the device's drop is pending. For a shutdown,
    /// which writes the cache back only once no command is running.
    pub(super) fn finish_zeroing_unless_stopped(&mut self) {
        // Bounded: each pass zeroes at least one block of a finite job, or completes one and
        // runs the finite rest of its batch; a pending stop ends the loop.
        while self.zeroing.is_some() && !self.registers.reset_requested() && !self.unlocked.give_way() {
            self.advance_zeroing(Instant::now());
        }
    }

    /// Drops the long zeroing held, without a completion (a stop deletes its queue).
    pub(super) fn drop_zeroing(&mut self) {
        self.zeroing = None;
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
