//! The I/O API for the layers above: an I/O queue pair that reads and writes LBA ranges to and
//! from one or many DMA segments, flushes, writes zeroes and deallocates — submitted in batches
//! with one doorbell and reaped in batches, with nothing allocated per command.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::datapath::{build_data_pointer, next_data, plan_command, plan_single_command, Cursor, DataPointerMode, DataSegment};
use crate::error::NvmeError;
use crate::gate::QueueFate;
use crate::namespace::{Namespace, RefusedNamespace};
use crate::queue::{Completion, QueuePair};
use crate::spec::command::DatasetRange;
use crate::spec::SubmissionEntry;
use crate::teardown::AdminShared;
use crate::types::{BlockCount, Lba, NamespaceId, QueueId};

/// `blocks` as a command's NLB, or [`NvmeError::InvalidBlockCount`] past its 16 bits. (Built
/// only on failure: an error made eagerly and dropped costs the hot path a destructor call.)
fn block_count(blocks: u64) -> Result<BlockCount, NvmeError> {
    match u32::try_from(blocks).ok().and_then(BlockCount::new) {
        Some(count) => Ok(count),
        None => Err(NvmeError::InvalidBlockCount { blocks }),
    }
}

/// Most ranges in one Dataset Management command that fit its scratch page (256, the spec's max).
pub const DEALLOCATE_RANGES_MAX: usize = 256;

/// An I/O submission/completion queue pair, owned by one thread (no lock held between calls; per
/// doorbell write, one flag handshake with a concurrent reset on a line only this pair writes,
/// see `gate.rs`).
///
/// Dropping it deletes its queues on the controller and frees its rings. The deletion is two
/// admin commands (Delete SQ, Delete CQ), each bounded by the admin timeout, sent once the
/// admin queue is free: after the admin commands of other threads that hold it or get it
/// first (a pair's creation or deletion is two). A reset in progress on another thread is
/// waited for, and one still waiting for deletions in progress makes this wait for those too:
/// up to about `2n + 1` admin timeouts for `n` of them, then the reset's own wait for the
/// controller to stop (see [`crate::Controller::reset`] and `gate.rs`). Its rings are freed
/// only when the queues are known to be gone: if the deletion fails, or the controller was
/// reset since and never confirmed it stopped, the rings and the queue id are kept for good
/// (leaked, counted in [`crate::Controller::leaked_queue_pairs`], logged at error level),
/// because the controller may still write them.
pub struct IoQueuePair {
    queue: QueuePair,
    owner: PairOwner,
    mode: DataPointerMode,
    /// The controller requires SGL Data Blocks of whole dwords (Identify SGLS bits 1:0 = 10b):
    /// in SGL mode every segment's length must be a multiple of 4.
    sgl_dword_lengths: bool,
    max_transfer_bytes: u64,
    /// Most bytes one Write Zeroes may cover (the controller's WZSL), `None` for no limit.
    write_zeroes_max_bytes: Option<u64>,
    namespaces: Vec<Namespace>,
    refused_namespaces: Vec<RefusedNamespace>,
    /// Set by [`IoQueuePair::delete`], so that drop does not delete twice.
    deleted: bool,
    /// The submission queue is gone on the controller (a deletion got that far).
    sq_deleted: bool,
}

/// Who created the queues on the controller, and so who deletes them.
pub(crate) enum PairOwner {
    /// This process's [`crate::Controller`]: the pair deletes its queues when dropped.
    Controller {
        admin: Arc<AdminShared>,
        /// The controller generation this pair was created in (see `gate.rs`).
        generation: u64,
    },
    /// Another process (the daemon) created the queues and deletes them; this pair only drives
    /// them (see [`IoQueuePair::attach`]).
    Attached,
}

impl std::fmt::Debug for IoQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoQueuePair").field("queue", &self.queue).field("mode", &self.mode).finish()
    }
}

impl IoQueuePair {
    pub(crate) fn new(
        queue: QueuePair,
        owner: PairOwner,
        mode: DataPointerMode,
        max_transfer_bytes: u64,
        namespaces: Vec<Namespace>,
        refused_namespaces: Vec<RefusedNamespace>,
    ) -> Self {
        Self {
            queue,
            owner,
            mode,
            sgl_dword_lengths: false,
            max_transfer_bytes,
            write_zeroes_max_bytes: None,
            namespaces,
            refused_namespaces,
            deleted: false,
            sq_deleted: false,
        }
    }

    /// Makes SGL transfers refuse segments whose length is not a whole number of dwords (see
    /// [`crate::spec::identify::SglSupport::dword_alignment_required`]): the controller would
    /// fail such a command.
    pub(crate) fn require_dword_sgl_lengths(&mut self) {
        self.sgl_dword_lengths = true;
    }

    /// Splits Write Zeroes at `max_bytes` per command (the controller's WZSL): it fails a
    /// command past it (Invalid Field).
    pub(crate) fn limit_write_zeroes(&mut self, max_bytes: u64) {
        self.write_zeroes_max_bytes = Some(max_bytes);
    }

    pub fn id(&self) -> QueueId {
        self.queue.id()
    }

    pub fn depth(&self) -> u32 {
        self.queue.depth()
    }

    pub fn in_flight(&self) -> usize {
        self.queue.in_flight()
    }

    pub fn free_slots(&self) -> usize {
        self.queue.free_slots()
    }

    /// Whether a completion broke the queue protocol (a wrong SQ id, an impossible SQ head, or
    /// a head that has not passed the entry of the command it completes):
    /// the pair then takes no new command ([`NvmeError::QueueFailed`]); delete it and create
    /// another, or reset the controller.
    pub fn failed(&self) -> bool {
        self.queue.failed()
    }

    /// Commands submitted since the last [`IoQueuePair::ring_doorbell`]: the controller cannot
    /// see them yet (an I/O over the max transfer size counts each of its commands).
    pub fn unpublished_submissions(&self) -> usize {
        self.queue.unpublished_submissions()
    }

    /// Device address of the submission ring (diagnostics, tests).
    pub fn submission_iova(&self) -> crate::types::Iova {
        self.queue.submission_iova()
    }

    /// Device address of the completion ring (diagnostics, tests).
    pub fn completion_iova(&self) -> crate::types::Iova {
        self.queue.completion_iova()
    }

    pub fn data_pointer_mode(&self) -> DataPointerMode {
        self.mode
    }

    /// Overrides the data pointer mode for this queue (tests compare PRP and SGL on one device).
    /// Choosing SGL on a controller without SGL support makes its commands fail with the
    /// controller's status.
    pub fn set_data_pointer_mode(&mut self, mode: DataPointerMode) {
        self.mode = mode;
    }

    pub fn max_transfer_bytes(&self) -> u64 {
        self.max_transfer_bytes
    }

    /// A namespace this pair can do I/O on; [`NvmeError::UnsupportedNamespaceFormat`] for one the
    /// driver refused at bring-up.
    pub fn namespace(&self, id: NamespaceId) -> Result<Namespace, NvmeError> {
        crate::namespace::find(&self.namespaces, &self.refused_namespaces, id)
    }

    /// Early refusal of work on a stale pair (the doorbell write checks again, authoritatively).
    fn check_epoch(&self) -> Result<(), NvmeError> {
        if self.queue.is_stale_hint() {
            return Err(NvmeError::QueueStale { queue: self.queue.id() });
        }
        Ok(())
    }

    /// Whether `commands` commands can be queued now: [`NvmeError::TransferTooLarge`] if the
    /// pair never holds that many at once (not back-pressure: reaping does not help),
    /// [`NvmeError::QueueFull`] (back-pressure) if they do not fit its free slots now.
    fn check_room(&self, commands: u64) -> Result<(), NvmeError> {
        let capacity = self.queue.capacity();
        if commands > capacity as u64 {
            return Err(NvmeError::TransferTooLarge { queue: self.queue.id(), commands, capacity });
        }
        if commands > self.queue.free_slots() as u64 {
            return Err(NvmeError::QueueFull { queue: self.queue.id(), depth: self.queue.depth() });
        }
        Ok(())
    }

    /// The end (one past the last block) of `blocks` blocks from `start`, when they are at least
    /// one and all inside the namespace.
    fn check_range(namespace: &Namespace, start: Lba, blocks: u64) -> Result<Lba, NvmeError> {
        match start.checked_add(blocks) {
            Some(end) if blocks > 0 && end.0 <= namespace.size_blocks => Ok(end),
            _ => Err(NvmeError::LbaOutOfRange { namespace: namespace.id, start: start.0, blocks, size_blocks: namespace.size_blocks }),
        }
    }

    /// Counts the commands a transfer needs, validating its layout and every command's block
    /// count (no side effects): whatever submit_transfer's loop could refuse is refused here,
    /// before its first command is queued, so a transfer is queued whole or not at all.
    fn count_commands(&self, segments: &[DataSegment], block_size_bytes: u32) -> Result<(usize, u64), NvmeError> {
        // (The one-command case does not come here: see plan_single_command in submit_transfer.
        // Its one segment is whole blocks of at least 512 bytes, so whole dwords too.)
        if self.mode == DataPointerMode::Sgl && self.sgl_dword_lengths {
            // Addresses are checked dword aligned by the planning; a cut between commands falls
            // on a block boundary, so whole-dword segments make whole-dword descriptors.
            if let Some(index) = segments.iter().position(|segment| segment.len % 4 != 0) {
                return Err(NvmeError::UnsupportedLayout {
                    index,
                    reason: "length not a whole number of dwords, which this controller requires of SGL data blocks",
                    mode: self.mode.name(),
                });
            }
        }
        let mut cursor = Cursor::default();
        let mut commands = 0;
        let mut bytes = 0;
        while let Some(plan) = plan_command(segments, cursor, self.max_transfer_bytes, block_size_bytes, self.mode)? {
            block_count(plan.bytes / u64::from(block_size_bytes))?;
            commands += 1;
            bytes += plan.bytes;
            cursor = plan.end;
        }
        if commands == 0 {
            return Err(NvmeError::EmptyTransfer);
        }
        Ok((commands, bytes))
    }

    fn submit_transfer(
        &mut self,
        namespace: Namespace,
        start: Lba,
        segments: &[DataSegment],
        tag: u64,
        make: impl Fn(Lba, BlockCount) -> SubmissionEntry,
    ) -> Result<usize, NvmeError> {
        self.check_epoch()?;
        let block = u64::from(namespace.block_size_bytes);
        let mode = self.mode;
        if let Some(plan) = plan_single_command(segments, self.max_transfer_bytes, namespace.block_size_bytes, mode) {
            // One command: no planning walk, and no room check beyond the slot and SQ entry that
            // submit_with reserves (it gives both back on any error, so nothing is half queued).
            let blocks = plan.bytes / block;
            Self::check_range(&namespace, start, blocks)?;
            let count = block_count(blocks)?;
            self.queue.submit_with(make(start, count), tag, |entry, scratch| build_data_pointer(entry, segments, &plan, mode, scratch))?;
            return Ok(1);
        }
        let (commands, bytes) = self.count_commands(segments, namespace.block_size_bytes)?;
        Self::check_range(&namespace, start, bytes / block)?;
        self.check_room(commands as u64)?;
        let mut cursor = Cursor::default();
        let mut lba = start;
        while let Some(plan) = plan_command(segments, cursor, self.max_transfer_bytes, namespace.block_size_bytes, self.mode)? {
            let blocks = plan.bytes / block;
            // The plan is bounded by MDTS; a count past NLB's 16 bits is a typed error, never masked.
            let count = block_count(blocks)?;
            self.queue.submit_with(make(lba, count), tag, |entry, scratch| build_data_pointer(entry, segments, &plan, mode, scratch))?;
            // Inside the range check_range accepted, so this cannot fail; checked all the same.
            let Some(next) = lba.checked_add(blocks) else {
                return Err(NvmeError::LbaOutOfRange { namespace: namespace.id, start: lba.0, blocks, size_blocks: namespace.size_blocks });
            };
            lba = next;
            cursor = plan.end;
        }
        Ok(commands)
    }

    /// Queues reads of the LBA range starting at `start` into `segments` (scattered buffers allowed:
    /// one SGL list or PRP list per command). Returns the number of commands queued, each of which
    /// completes with `tag`. All of them are queued or none: [`NvmeError::QueueFull`]
    /// (back-pressure) when they do not fit the free slots now, [`NvmeError::TransferTooLarge`]
    /// when they outnumber what the pair ever holds (depth − 1). Nothing is visible to the controller until [`IoQueuePair::ring_doorbell`].
    pub fn submit_read(&mut self, namespace: NamespaceId, start: Lba, segments: &[DataSegment], tag: u64) -> Result<usize, NvmeError> {
        let namespace = self.namespace(namespace)?;
        self.submit_transfer(namespace, start, segments, tag, |lba, blocks| SubmissionEntry::read(namespace.id, lba, blocks))
    }

    /// Queues writes of `segments` to the LBA range starting at `start`; with
    /// `force_unit_access` each command completes only once its data is durable.
    pub fn submit_write(
        &mut self,
        namespace: NamespaceId,
        start: Lba,
        segments: &[DataSegment],
        force_unit_access: bool,
        tag: u64,
    ) -> Result<usize, NvmeError> {
        let namespace = self.namespace(namespace)?;
        self.submit_transfer(namespace, start, segments, tag, |lba, blocks| {
            SubmissionEntry::write(namespace.id, lba, blocks, force_unit_access)
        })
    }

    /// Queues a Flush: completes when every write completed before it is durable.
    pub fn submit_flush(&mut self, namespace: NamespaceId, tag: u64) -> Result<usize, NvmeError> {
        self.check_epoch()?;
        let namespace = self.namespace(namespace)?;
        self.queue.submit(SubmissionEntry::flush(namespace.id), tag)?;
        Ok(1)
    }

    /// Queues Write Zeroes over `blocks` blocks from `start` (split at [`BlockCount::MAX`] blocks
    /// per command, and at the controller's Write Zeroes size limit, WZSL, where it reports
    /// one; more commands than the pair holds at once is [`NvmeError::TransferTooLarge`]). A
    /// limit below one block of the namespace is [`NvmeError::Unsupported`], nothing queued.
    /// An [attached](IoQueuePair::attach) pair knows no such limit (the daemon's grant does
    /// not carry it) and splits at [`BlockCount::MAX`] only.
    pub fn submit_write_zeroes(
        &mut self,
        namespace: NamespaceId,
        start: Lba,
        blocks: u64,
        deallocate: bool,
        tag: u64,
    ) -> Result<usize, NvmeError> {
        self.check_epoch()?;
        let namespace = self.namespace(namespace)?;
        let end = Self::check_range(&namespace, start, blocks)?;
        let block_bytes = u64::from(namespace.block_size_bytes);
        let per_command = match self.write_zeroes_max_bytes {
            Some(max_bytes) if max_bytes < block_bytes => {
                return Err(NvmeError::Unsupported {
                    reason: format!("the Write Zeroes size limit (WZSL, {max_bytes} bytes) is below one block of {}", namespace.id),
                });
            }
            Some(max_bytes) => (max_bytes / block_bytes).min(u64::from(BlockCount::MAX)),
            None => u64::from(BlockCount::MAX),
        };
        let commands = blocks.div_ceil(per_command);
        self.check_room(commands)?;
        let mut lba = start;
        // Every step stays below `end`, which check_range proved is a block number.
        while let Some(left) = end.checked_blocks_from(lba).filter(|&left| left > 0) {
            let count = left.min(per_command);
            let count = block_count(count)?;
            self.queue.submit(SubmissionEntry::write_zeroes(namespace.id, lba, count, deallocate), tag)?;
            lba = lba.checked_add(u64::from(count.get())).unwrap_or(end);
        }
        Ok(commands as usize)
    }

    /// Queues one Dataset Management / Deallocate command over up to 256 ranges (start, blocks).
    pub fn submit_deallocate(&mut self, namespace: NamespaceId, ranges: &[(Lba, u32)], tag: u64) -> Result<usize, NvmeError> {
        self.check_epoch()?;
        let namespace = self.namespace(namespace)?;
        if ranges.is_empty() || ranges.len() > DEALLOCATE_RANGES_MAX {
            return Err(NvmeError::Unsupported {
                reason: format!("deallocate takes 1..={DEALLOCATE_RANGES_MAX} ranges, got {}", ranges.len()),
            });
        }
        for &(start, blocks) in ranges {
            Self::check_range(&namespace, start, u64::from(blocks))?;
        }
        let entry = SubmissionEntry::deallocate(namespace.id, ranges.len() as u32);
        self.queue.submit_with(entry, tag, |entry, scratch| {
            for (index, &(start, blocks)) in ranges.iter().enumerate() {
                let range = DatasetRange { context_attributes: 0, blocks, start };
                scratch.write(index * DatasetRange::BYTES, &range.to_bytes())?;
            }
            entry.dptr = [scratch.iova().0, 0];
            Ok(())
        })?;
        Ok(1)
    }

    /// Submits a raw entry as given (command id assigned here): for conformance tests that send
    /// commands the typed API would refuse, to check the controller's answer.
    pub fn submit_raw(&mut self, entry: SubmissionEntry, tag: u64) -> Result<(), NvmeError> {
        self.check_epoch()?;
        self.queue.submit(entry, tag).map(|_| ())
    }

    /// Like [`IoQueuePair::submit_raw`] but with a data pointer built for `segments`, which one
    /// command's data pointer must describe whole (one PRP list page, or 256 SGL descriptors):
    /// [`NvmeError::UnsupportedLayout`] otherwise, with nothing queued. (A pointer covering part
    /// of the data would leave the controller reading past the end of a full PRP list page as a
    /// pointer to the next one, §4.1.1.) The entry's own fields, its block count included, are
    /// sent as given.
    pub fn submit_raw_with_data(&mut self, entry: SubmissionEntry, segments: &[DataSegment], tag: u64) -> Result<(), NvmeError> {
        self.check_epoch()?;
        let plan = plan_command(segments, Cursor::default(), u64::MAX, 1, self.mode)?.ok_or(NvmeError::EmptyTransfer)?;
        if next_data(segments, plan.end).is_some() {
            return Err(NvmeError::UnsupportedLayout {
                index: plan.end.segment,
                reason: "the data needs more than one command's data pointer (one PRP list page or 256 SGL descriptors)",
                mode: self.mode.name(),
            });
        }
        let mode = self.mode;
        self.queue.submit_with(entry, tag, |entry, scratch| build_data_pointer(entry, segments, &plan, mode, scratch))?;
        Ok(())
    }

    /// Makes every queued command visible to the controller with one doorbell write. Fails with
    /// [`NvmeError::QueueStale`], writing nothing of this batch, once the controller was reset
    /// since this pair was created (its queue id may belong to a new pair by then). Once the
    /// SQ tail is written it returns `Ok`, even if a reset beginning right after makes the CQ
    /// head write that may follow stale: those commands are in flight, and the memory they name
    /// stays the controller's until [`IoQueuePair::delete`] returns `Ok`. Any other error
    /// leaves the batch's fate unknown: treat its commands as in flight (see
    /// `QueuePair::ring_doorbell`).
    pub fn ring_doorbell(&mut self) -> Result<(), NvmeError> {
        self.queue.ring_doorbell()
    }

    /// Whether [`IoQueuePair::reap`] would report something now (a completion, staleness or a
    /// failure): one load, for spin loops that call `reap` only when this is true.
    #[inline]
    pub fn completion_pending(&self) -> bool {
        self.queue.completion_pending()
    }

    /// Reaps up to `max` completions without waiting; at most one CQ doorbell write (on a pair
    /// the driver created, none while the controller has room for every command in flight; see
    /// `QueuePair::completion_doorbell_needed`). (A stale pair is refused by the queue's own
    /// reap, first thing: no second check here.)
    ///
    /// A completion the driver rejects is reported as the error, after those before it were
    /// delivered. One with a wrong SQ id, an impossible SQ head or a head that has not passed
    /// its command's entry (a command completed before it was fetched) fails the pair
    /// ([`IoQueuePair::failed`]): new commands are refused with [`NvmeError::QueueFailed`], and
    /// if it named a command in flight, [`NvmeError::CommandOutcomeUnknown`] gives that
    /// command's tag. Its memory must be left alone until the pair is deleted (or the controller
    /// reset): the controller may still move its data. The pair still delivers the completions
    /// of its other commands.
    pub fn reap(&mut self, max: usize, on_completion: impl FnMut(Completion)) -> Result<usize, NvmeError> {
        self.queue.reap(max, on_completion)
    }

    /// Reaps until no command is in flight, or fails at `deadline` with
    /// [`NvmeError::Timeout`] naming the oldest command outstanding (the first issued of those
    /// still in flight).
    ///
    /// A completion naming nothing in flight does not end the wait: the first one is returned
    /// as [`NvmeError::UnexpectedCompletion`] once nothing is in flight. At the deadline the
    /// wait times out as any other (the ones it met are logged), so an unexpected completion
    /// always means nothing is in flight and a timeout that something still is.
    pub fn wait_idle(&mut self, deadline: Instant, on_completion: impl FnMut(Completion)) -> Result<(), NvmeError> {
        self.check_epoch()?;
        self.queue.poll_until(deadline, on_completion, |queue| queue.in_flight() == 0)
    }

    /// Reaps until at least `count` more completions arrived, or fails at `deadline`. A
    /// completion naming nothing in flight does not count and does not end the wait; the first
    /// one is returned as [`NvmeError::UnexpectedCompletion`] once `count` arrived (at the
    /// deadline the wait times out, as for [`IoQueuePair::wait_idle`]).
    pub fn wait_for(&mut self, count: usize, deadline: Instant, mut on_completion: impl FnMut(Completion)) -> Result<(), NvmeError> {
        self.check_epoch()?;
        let seen = std::cell::Cell::new(0usize);
        self.queue.poll_until(
            deadline,
            |completion| {
                seen.set(seen.get() + 1);
                on_completion(completion)
            },
            |_| seen.get() >= count,
        )
    }

    /// Rings, waits for everything in flight and turns the first failed completion into an error.
    /// A completion naming nothing in flight met on the way is [`NvmeError::UnexpectedCompletion`]
    /// when every command succeeded; a failed command's error comes first (once nothing is in
    /// flight, that is what the caller must act on). Any other error of the wait, a timeout
    /// with commands still in flight (unexpected completions met or not) included, comes back
    /// as it is.
    pub fn complete_all(&mut self, timeout: Duration) -> Result<(), NvmeError> {
        self.ring_doorbell()?;
        let queue = self.queue.id();
        let mut first_failure = None;
        let waited = self.wait_idle(Instant::now() + timeout, |completion| {
            if first_failure.is_none() {
                first_failure = completion.into_result(queue).err();
            }
        });
        match (waited, first_failure) {
            (Ok(()), None) => Ok(()),
            (Ok(()), Some(failure)) => Err(failure),
            (Err(unexpected @ NvmeError::UnexpectedCompletion { .. }), Some(failure)) if self.queue.in_flight() == 0 => {
                tracing::warn!(%queue, %unexpected, "an unexpected completion while the wait's commands completed (one failed)");
                Err(failure)
            }
            (Err(error), _) => Err(error),
        }
    }

    /// Synchronous read (tests, tools): submit, ring, wait.
    pub fn read(&mut self, namespace: NamespaceId, start: Lba, segments: &[DataSegment], timeout: Duration) -> Result<(), NvmeError> {
        self.submit_read(namespace, start, segments, 0)?;
        self.complete_all(timeout)
    }

    /// Synchronous write (tests, tools): submit, ring, wait.
    pub fn write(
        &mut self,
        namespace: NamespaceId,
        start: Lba,
        segments: &[DataSegment],
        force_unit_access: bool,
        timeout: Duration,
    ) -> Result<(), NvmeError> {
        self.submit_write(namespace, start, segments, force_unit_access, 0)?;
        self.complete_all(timeout)
    }

    /// Synchronous flush.
    pub fn flush(&mut self, namespace: NamespaceId, timeout: Duration) -> Result<(), NvmeError> {
        self.submit_flush(namespace, 0)?;
        self.complete_all(timeout)
    }
}

impl IoQueuePair {
    /// Deletes the queue pair on the controller and reports how that went (dropping it does the
    /// same, but can only log a failure). After `Ok`, none of its commands moves data any more:
    /// the controller aborted or finished them (or a reset since then deleted the queues), and
    /// their completions are discarded; the rings are freed.
    ///
    /// On an error that is not guaranteed, and the pair comes back inside the error: keep it and
    /// call `delete` again (after a reset that succeeded, it returns `Ok` at once), or drop it,
    /// which tries once more and, failing that, leaks its rings.
    ///
    /// An [attached](IoQueuePair::attach) pair cannot delete its queues (the daemon that created
    /// them does, when this process's session ends). For it `delete` answers the same question
    /// from this process's side: `Ok` when none of its commands is in flight (every one it
    /// submitted completed, so none moves data any more and this process is done with the
    /// pair); otherwise [`NvmeError::Unsupported`] with the pair handed back, and the memory its
    /// commands name must not be reused until the daemon has deleted the queues.
    pub fn delete(mut self) -> Result<(), UndeletedQueuePair> {
        let PairOwner::Controller { admin, generation } = &self.owner else {
            let in_flight = self.queue.in_flight();
            if in_flight == 0 {
                self.deleted = true;
                return Ok(());
            }
            let source = NvmeError::Unsupported {
                reason: format!(
                    "{} is attached with {in_flight} commands in flight: the process that created it deletes it",
                    self.queue.id()
                ),
            };
            return Err(UndeletedQueuePair { source, pair: Box::new(self) });
        };
        match admin.retire_queue_pair(self.queue.id(), *generation, &mut self.sq_deleted) {
            Ok(()) => {
                self.deleted = true;
                Ok(())
            }
            Err(source) => Err(UndeletedQueuePair { source, pair: Box::new(self) }),
        }
    }

    /// Whether the controller was reset (or dropped) since this pair was created: it can no
    /// longer ring its doorbells. Its queues are gone from the controller if that reset saw it
    /// stop; otherwise dropping the pair leaks its rings.
    ///
    /// Always false for an [attached](IoQueuePair::attach) pair: this process cannot see the
    /// daemon's controller generation (see the attach contract).
    ///
    /// While a reset runs on another thread this waits for it to know whether the controller
    /// stopped, and, while that reset still waits for queue deletions in progress, for those
    /// too (about two admin timeouts each; see `gate.rs`).
    pub fn controller_was_reset(&self) -> bool {
        match &self.owner {
            PairOwner::Controller { admin, generation } => admin.gate.fate(*generation) != QueueFate::Live,
            PairOwner::Attached => false,
        }
    }
}

/// A queue pair whose deletion failed: the controller may still run its commands.
#[derive(Debug, thiserror::Error)]
#[error("deleting {} failed: {source}", pair.queue.id())]
pub struct UndeletedQueuePair {
    pub source: NvmeError,
    pub pair: Box<IoQueuePair>,
}

impl Drop for IoQueuePair {
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        match &self.owner {
            PairOwner::Controller { admin, generation } => {
                if let Err(error) = admin.retire_queue_pair(self.queue.id(), *generation, &mut self.sq_deleted) {
                    admin.leak_queue_pair(self.queue.id(), self.queue.regions(), &error);
                }
            }
            PairOwner::Attached => crate::detached::drop_attached(&self.queue),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::fake_device::{identify_namespace_bytes, FakeDevice, FakeScript};
    use crate::{Controller, ControllerConfig, Iova};

    #[test]
    fn a_transfer_is_queued_whole_or_not_at_all() {
        // Goal: a transfer cut into several commands is checked whole before its first command
        // is queued: a later command whose block count NLB cannot hold (here 64 MiB of 512-byte
        // blocks, behind 256 small segments that fill the first command's SGL, with no transfer
        // limit) is a typed error with nothing in the SQ. It used to leave the first command
        // queued, for the next doorbell to publish under the caller's tag.
        let script = FakeScript { identify_namespaces: vec![identify_namespace_bytes(512, 1 << 20, 0, false)], ..FakeScript::default() };
        let controller = Controller::init(FakeDevice::new(script), ControllerConfig::default()).expect("bring-up");
        let mut pair = controller.create_io_queue_pair(8).expect("queue pair");
        pair.set_data_pointer_mode(DataPointerMode::Sgl);
        pair.max_transfer_bytes = u64::MAX;
        let mut segments: Vec<_> = (0..256u64).map(|index| DataSegment::new(Iova(0x100_0000 + index * 0x1000), 512)).collect();
        segments.push(DataSegment::new(Iova(0x1000_0000), 64 << 20));
        let submitted = pair.submit_read(NamespaceId(1), Lba(0), &segments, 9);
        assert!(matches!(submitted, Err(NvmeError::InvalidBlockCount { blocks: 131072 })), "{submitted:?}");
        assert_eq!((pair.in_flight(), pair.unpublished_submissions()), (0, 0), "a command of the refused transfer was queued");
    }

    #[test]
    fn a_request_needing_more_commands_than_the_queue_holds_is_not_back_pressure() {
        // Goal: back-pressure means "reap and retry"; a request that needs more commands than
        // a queue of its depth ever holds at once (depth − 1) would never get in, so it is a
        // distinct error, even on an idle pair, with nothing queued: Write Zeroes over 4 × 65536
        // blocks needs 4 commands, a depth-4 pair holds 3, and so does a read cut into 4
        // commands by the transfer limit. Both used to be QueueFull, which callers retry for
        // ever. One command more than the free slots of a busy pair stays back-pressure.
        let script = FakeScript { identify_namespaces: vec![identify_namespace_bytes(512, 1 << 20, 0, false)], ..FakeScript::default() };
        let controller = Controller::init(FakeDevice::new(script), ControllerConfig::default()).expect("bring-up");
        let mut pair = controller.create_io_queue_pair(4).expect("queue pair");
        let zeroes = pair.submit_write_zeroes(NamespaceId(1), Lba(0), 4 * 65536, false, 0);
        assert!(
            matches!(zeroes, Err(NvmeError::TransferTooLarge { commands: 4, capacity: 3, .. }))
                && !zeroes.as_ref().unwrap_err().is_backpressure(),
            "{zeroes:?}"
        );
        let limit = pair.max_transfer_bytes();
        let read = pair.submit_read(NamespaceId(1), Lba(0), &[DataSegment::new(Iova(0x1000_0000), (4 * limit) as u32)], 0);
        assert!(matches!(read, Err(NvmeError::TransferTooLarge { commands: 4, capacity: 3, .. })), "{read:?}");
        assert_eq!(pair.in_flight(), 0);
        pair.submit_flush(NamespaceId(1), 0).expect("flush");
        let busy = pair.submit_write_zeroes(NamespaceId(1), Lba(0), 3 * 65536, false, 0);
        assert!(busy.as_ref().is_err_and(NvmeError::is_backpressure), "{busy:?}");
    }

    #[test]
    fn sgl_segments_of_odd_lengths_are_refused_where_the_controller_requires_dwords() {
        // Goal: a controller reporting SGLS bits 1:0 = 10b requires every SGL Data Block to be
        // dword aligned and a whole number of dwords; a transfer whose segments are not (508 +
        // 4 bytes is fine, 510 + 2 is not) is refused by the driver, naming the segment, with
        // nothing queued, instead of being sent for the controller to fail. A controller
        // without that requirement (SGLS = 01b) takes the same transfer. The requirement used
        // to be parsed and never used.
        for (sgls, required) in [(2u32, true), (1, false)] {
            let mut script =
                FakeScript { identify_namespaces: vec![identify_namespace_bytes(512, 1 << 20, 0, false)], ..FakeScript::default() };
            script.identify_controller[536..540].copy_from_slice(&sgls.to_le_bytes());
            let controller = Controller::init(FakeDevice::new(script), ControllerConfig::default()).expect("bring-up");
            let mut pair = controller.create_io_queue_pair(8).expect("queue pair");
            assert_eq!(pair.data_pointer_mode(), DataPointerMode::Sgl);
            check_dword_sgl_rule(&mut pair, required);
        }
    }

    /// On an SGL pair with nothing in flight: 508 + 4 bytes is taken; 510 + 2 is refused with
    /// nothing queued when `required` (the controller wants whole-dword SGL data blocks), taken
    /// otherwise.
    pub(crate) fn check_dword_sgl_rule(pair: &mut IoQueuePair, required: bool) {
        let whole_dwords = [DataSegment::new(Iova(0x100_0000), 508), DataSegment::new(Iova(0x200_0000), 4)];
        assert_eq!(pair.submit_read(NamespaceId(1), Lba(0), &whole_dwords, 0).expect("whole dwords"), 1);
        let odd = [DataSegment::new(Iova(0x100_0000), 510), DataSegment::new(Iova(0x200_0000), 2)];
        let submitted = pair.submit_read(NamespaceId(1), Lba(0), &odd, 0);
        if required {
            assert!(matches!(submitted, Err(NvmeError::UnsupportedLayout { index: 0, .. })), "{submitted:?}");
            assert_eq!(pair.in_flight(), 1, "the refused transfer queued nothing");
        } else {
            assert_eq!(submitted.expect("no dword requirement"), 1);
        }
    }

    #[test]
    fn a_raw_command_whose_data_one_data_pointer_cannot_describe_is_refused() {
        // Goal: submit_raw_with_data builds one command's data pointer; data that needs more
        // than one (4 MiB in PRP mode: 1024 pages, one list page holds 512) is a typed error
        // with nothing queued. It used to queue a Read whose 512-entry list ended with a data
        // page where a controller moving 4 MiB reads the pointer to the next list page (§4.1.1),
        // so it would DMA at whatever address that data page's contents named. In SGL mode the
        // limit is the 256 descriptors of one segment.
        let controller = Controller::init(FakeDevice::new(FakeScript::default()), ControllerConfig::default()).expect("bring-up");
        let mut pair = controller.create_io_queue_pair(8).expect("queue pair");
        let read = |blocks| SubmissionEntry::read(NamespaceId(1), Lba(0), BlockCount::new(blocks).expect("block count"));
        let whole = [DataSegment::new(Iova(0x1000_0000), 4 << 20)];
        let scattered: Vec<_> = (0..257u64).map(|index| DataSegment::new(Iova(0x100_0000 + index * 0x2000), 4096)).collect();
        for (mode, segments, blocks) in [(DataPointerMode::Prp, &whole[..], 1024), (DataPointerMode::Sgl, &scattered[..], 257)] {
            pair.set_data_pointer_mode(mode);
            let submitted = pair.submit_raw_with_data(read(blocks), segments, 0);
            assert!(matches!(submitted, Err(NvmeError::UnsupportedLayout { .. })), "{}: {submitted:?}", mode.name());
            assert_eq!(pair.in_flight(), 0, "{}", mode.name());
        }
        // What one command can describe is still accepted.
        pair.set_data_pointer_mode(DataPointerMode::Prp);
        pair.submit_raw_with_data(read(512), &[DataSegment::new(Iova(0x1000_0000), 2 << 20)], 0).expect("2 MiB in one list page");
    }
}
