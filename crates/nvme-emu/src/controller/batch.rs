//! Backing-store I/O in flight across doorbell scans: Reads, and Writes that go straight to the
//! store, are validated when fetched and their transfers pushed to io_uring at once; each
//! command finishes (a Read's cache overlay and DMA to the host) and posts its completion when
//! its own transfer completes, found by a later scan or by a wait, in whatever order the kernel
//! completes them (the spec lets I/O commands complete in any order).
//!
//! Ordering stays exact. A command whose LBAs overlap an in-flight Write (or a Write that
//! overlaps any in-flight command) waits for those to finish before its own transfer starts,
//! so a read never misses an earlier write and overlapping writes land in submission order. Any
//! other command (Flush, a cached Write, Write Zeroes, DSM, an admin command, one with an
//! injected fault) first waits for everything in flight, so a Flush or a queue deletion never
//! finds I/O in flight. A controller reset or power loss cancels what is in flight, waits only
//! for what the kernel keeps, and completes none of it; a wait before a command gives way to a
//! reset the host asked for meanwhile (the reset deletes the command's queue), and to a power
//! loss, a function reset or the device's drop (see [`ControllerCore::stop_asked`]).
//!
//! Bounded: at most the ring's depth in flight, of which at most `EmuConfig::in_flight_bytes_max`
//! bytes bounced through the controller's own buffers (a direct transfer holds none); every
//! transfer has a deadline. A ring that fails or passes a deadline is abandoned and what the
//! kernel still holds cancelled; a write the kernel will not give back fences the store (see
//! `backing`) and makes the controller fatal, so it can never land over newer data unnoticed.
//!
//! The table of commands in flight is `in_flight.rs`; settling, abandoning the ring and the
//! store fence are `cancellation.rs`.

use std::time::{Duration, Instant};

use nvme_driver::hw::DmaRegion;
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{NvmOpcode, SubmissionEntry};
use tutti_uring::{Completion, Direction, Refused, RefusedRegions, Transfer, UringError, REGIONS_MAX};

use super::in_flight::{PreparedIo, Settle};
use super::{media, ControllerCore, State};
use crate::backing::{AlignedBuffer, DIRECT_ALIGNMENT_BYTES};
use crate::faults::FaultAction;
use crate::uring::UringReader;

/// Longest a scan that found nothing else to do waits in the kernel for an in-flight transfer
/// (it returns at the first completion); doorbells rung meanwhile wait at most this long.
const IN_FLIGHT_WAIT: Duration = Duration::from_micros(20);
/// Transfer buffers kept for reuse, and the largest one worth keeping.
const IO_BUFFERS_KEPT: usize = 64;
const IO_BUFFER_KEPT_MAX_BYTES: usize = (1 << 20) + 4096;
/// How long a wait for transfers before a command runs (a Flush, an admin command, one that
/// overlaps a transfer) goes between looks at whether a stop was asked for (see
/// [`ControllerCore::stop_asked`]): the stop cancels those transfers or ends the device, so it
/// need not wait for their deadlines (30 s; CAP.TO is 10 s).
const RESET_LOOK_INTERVAL: Duration = Duration::from_millis(10);
/// Empty region lists kept for reuse (one per transfer the ring can hold), so resolving a data
/// pointer does not allocate per command.
const REGION_LISTS_KEPT: usize = 128;

impl ControllerCore {
    /// Runs commands fetched from one SQ in order. Reads of a file-backed device (but a FUA one
    /// with cached blocks to write back, see [`ControllerCore::fua_read_needs_write_back`]), and
    /// Writes that go straight to the backing store (write cache off, FUA, or larger than the
    /// cache), start their transfers and finish later (see the module documentation); a lone one with
    /// nothing in flight is a synchronous `pread`/`pwrite` instead (the ring would only add a
    /// wait). Any other command first waits for everything in flight.
    pub(super) fn run_batch(&mut self, queue_id: u16, completion_queue_id: u16, fetched: &[(SubmissionEntry, u32)], now: Instant) {
        let admin = queue_id == 0;
        self.refresh_store_fence();
        // Every command of this batch comes from one SQ: its restriction applies to all of them.
        self.current_restriction = if admin {
            None
        } else {
            self.submission_queues.get(usize::from(queue_id)).and_then(Option::as_ref).and_then(|queue| queue.restriction.clone())
        };
        for (position, (entry, sq_head)) in fetched.iter().enumerate() {
            if self.state != State::Ready || self.stop_asked() {
                // A fatal fault stopped the controller, or a stop is asked for (see
                // `stop_asked`) whose deletion of this queue, or the device's end, leaves the
                // rest without a completion.
                break;
            }
            self.counters.count_command(queue_id, entry);
            let fault = self.faults.on_command(admin, entry.opcode());
            if fault.is_some() {
                self.counters.totals.faults_injected += 1;
            }
            let read = entry.opcode() == NvmOpcode::Read as u8;
            let transfer = fault.is_none()
                && !admin
                && self.reader.as_ref().is_some_and(UringReader::is_usable)
                && entry.fuse() == 0
                && ((read && !self.fua_read_needs_write_back(entry))
                    || (entry.opcode() == NvmOpcode::Write as u8 && self.write_goes_to_store(entry)));
            let alone = position + 1 == fetched.len() && self.in_flight.is_empty();
            if transfer && !alone {
                self.start_io(queue_id, completion_queue_id, entry, *sq_head, !read);
                continue;
            }
            self.settle_unless_stopped();
            // The settle can wait long: a stop may have been asked for meanwhile.
            if self.state != State::Ready || self.stop_asked() {
                break;
            }
            let mut result = match fault {
                Some(FaultAction::Status(status)) => Err(status),
                Some(FaultAction::ControllerFatal) => {
                    self.set_fatal();
                    break;
                }
                _ => self.execute(queue_id, entry),
            };
            if admin && crate::admin::is_held(entry, &result) {
                // An Asynchronous Event Request: held, it completes only with an event.
                continue;
            }
            if self.hold_started_zeroing(&mut result, queue_id, completion_queue_id, *sq_head, entry, fault, &fetched[position + 1..]) {
                // A long zeroing (deallocate, Write Zeroes) runs a slice per poll from now on;
                // it completes, and the rest of this batch runs, when it ends.
                break;
            }
            self.complete(queue_id, completion_queue_id, *sq_head, entry, result, fault, now);
        }
        self.submit_in_flight();
        self.current_restriction = None;
    }

    /// Validates a Read or Write and pushes its transfer (a Write's data is gathered from the
    /// host now; older cached copies of its blocks are dropped only once it landed, see
    /// [`ControllerCore::landed`]). It first waits for in-flight commands it conflicts with, and for
    /// room: a slot of the ring and, for a bounced transfer, `in_flight_bytes_max` (a direct one
    /// holds no buffer of the controller's: at 1 MiB that bound kept 16 of a QD 32 host's
    /// commands at the file, where fio keeps 32). An invalid command completes at once.
    fn start_io(&mut self, queue_id: u16, completion_queue_id: u16, entry: &SubmissionEntry, sq_head: u32, write: bool) {
        let spare = self.spare_region_lists.pop().unwrap_or_default();
        let (namespace_index, namespace, buffers) = match self.prepare_transfer(entry, spare) {
            Ok(prepared) => prepared,
            Err(status) => return self.complete(queue_id, completion_queue_id, sq_head, entry, Err(status), None, Instant::now()),
        };
        let start_lba = entry.starting_lba().0;
        let blocks = u64::from(entry.block_count());
        let io = PreparedIo {
            entry: *entry,
            queue_id,
            completion_queue_id,
            sq_head,
            namespace_index,
            namespace,
            buffers,
            write,
            start_lba,
            blocks,
            direct: false,
        };
        let len = io.len_bytes();
        let capacity = self.reader.as_ref().map_or(0, UringReader::capacity);
        let mut direct = self.direct_target(&io);
        let mut waited = false;
        // Bounded: each pass finishes at least one command in flight, fails the ring (which
        // empties the table) or waits a slice of the way to the oldest transfer's deadline.
        while self.in_flight.conflicts(write, namespace_index, start_lba, blocks)
            || (!self.in_flight.is_empty()
                && (self.in_flight.count() >= capacity
                    || (direct.is_none() && self.in_flight.bounced_bytes + len as u64 > self.config.in_flight_bytes_max)))
        {
            waited = true;
            if self.stop_asked() || !self.wait_in_flight_for(Settle::Finish, Some(RESET_LOOK_INTERVAL)) {
                break;
            }
        }
        if self.state != State::Ready || self.stop_asked() {
            // Waiting made the controller fatal, or a stop was asked for meanwhile (a reset, a
            // power loss or a function reset deletes this command's queue; a dropped device
            // posts nothing): like the rest, this gets no completion.
            return;
        }
        if waited {
            // Finishing transfers leaves the store's descriptors as they were (a fence comes
            // with the fatal status above) and can only drop cached blocks (a Write that landed),
            // so a Read counted as bounced may go direct now (needing no bounced room), never
            // the reverse.
            direct = self.direct_target(&io);
        }
        if let Some((fd, offset_bytes)) = direct {
            return self.start_direct(io, fd, offset_bytes);
        }
        let mut buffer = self.io_buffers.pop().unwrap_or_default();
        if let Err(error) = buffer.try_reserve(len) {
            tracing::error!(%error, "no memory for a transfer buffer");
            self.recycle_buffer(buffer);
            let status = media(if write { codes::WRITE_FAULT } else { codes::UNRECOVERED_READ_ERROR });
            return self.complete(queue_id, completion_queue_id, sq_head, entry, Err(status), None, Instant::now());
        }
        if write {
            if let Err(status) = io.buffers.gather(buffer.slice(len)) {
                self.recycle_buffer(buffer);
                return self.complete(queue_id, completion_queue_id, sq_head, entry, Err(status), None, Instant::now());
            }
        }
        if !self.reader.as_ref().is_some_and(UringReader::is_usable) {
            // The ring failed while this waited: the synchronous path does it.
            return self.finish_io(io, buffer, Err(UringError::NotRun));
        }
        let (fd, offset_bytes) = self.batch_target(io.offset_bytes(), len);
        let direction = if write { Direction::Write } else { Direction::Read };
        let transfer = Transfer { fd, direction, offset_bytes, len_bytes: len };
        let Some(slot) = self.in_flight.take_slot() else {
            return self.finish_io(io, buffer, Err(UringError::NotRun));
        };
        self.in_flight.fill(slot, io, Instant::now());
        let tag = slot as u64;
        let Some(reader) = self.reader.as_mut() else { return };
        match reader.push(transfer, buffer, tag) {
            Ok(()) => self.pushed(completion_queue_id),
            Err(Refused { buffer, error }) => {
                if let Some(io) = self.in_flight.take(tag) {
                    self.finish_io(io, buffer, Err(error));
                }
            }
        }
    }

    /// The `O_DIRECT` descriptor when `io` may move its data straight between the file and the
    /// host memory its command points to: the file offers one and the transfer is aligned, every
    /// host region starts and ends on a 4 KiB boundary, and, for a Read, no block of it is cached
    /// (the overlay needs the bytes in the controller's hands).
    fn direct_target(&self, io: &PreparedIo) -> Option<(std::os::fd::RawFd, u64)> {
        #[cfg(test)]
        if self.batch_descriptor_override.is_some() && !self.direct_on_override {
            return None;
        }
        let aligned = |value: usize| value.is_multiple_of(DIRECT_ALIGNMENT_BYTES);
        let regions = &io.buffers.regions;
        let memory_aligned = !regions.is_empty()
            && regions.len() <= REGIONS_MAX
            && regions.iter().all(|region| aligned(region.host_address()) && aligned(region.len()));
        if !memory_aligned || (!io.write && self.cache.holds_any(io.namespace_index, io.start_lba, io.blocks)) {
            return None;
        }
        self.store.direct_descriptor(io.offset_bytes(), io.len_bytes())?;
        Some(self.batch_target(io.offset_bytes(), io.len_bytes()))
    }

    /// Pushes a transfer straight between the file and the command's host memory. The kernel
    /// reads (Write) or writes (Read) that memory until the transfer completes; the command's
    /// completion, which hands the memory back to the host, is posted only after that, never
    /// while the kernel may still use it (see `end_held`).
    fn start_direct(&mut self, mut io: PreparedIo, fd: std::os::fd::RawFd, offset_bytes: u64) {
        let len = io.len_bytes();
        let direction = if io.write { Direction::Write } else { Direction::Read };
        let transfer = Transfer { fd, direction, offset_bytes, len_bytes: len };
        let regions = std::mem::take(&mut io.buffers.regions);
        io.direct = true;
        let completion_queue_id = io.completion_queue_id;
        let Some(slot) = self.in_flight.take_slot() else {
            // Still `direct`: finishing gathers a Write's data into a bounce buffer.
            io.buffers.regions = regions;
            return self.finish_io(io, AlignedBuffer::default(), Err(UringError::NotRun));
        };
        self.in_flight.fill(slot, io, Instant::now());
        let tag = slot as u64;
        let Some(reader) = self.reader.as_mut() else { return };
        match reader.push_regions(transfer, regions, tag) {
            Ok(()) => self.pushed(completion_queue_id),
            Err(RefusedRegions { regions, error }) => {
                if let Some(mut io) = self.in_flight.take(tag) {
                    io.buffers.regions = regions;
                    self.finish_io(io, AlignedBuffer::default(), Err(error));
                }
            }
        }
    }

    /// Bookkeeping of a transfer the ring took: its completion is owed, so it keeps a CQ slot
    /// (as a delayed completion does), and it goes to the kernel now, before the next command
    /// of the scan is gathered (as fio submits each I/O by default). Held to the end of the
    /// scan, a batch went to the kernel in one `io_uring_enter` whose submissions ran one after
    /// another, while completions waited for the next scan and the disk's queue ran short:
    /// 4 KiB random reads at QD 32 went from ~0.72 to ~0.88 of fio's IOPS (docs/nvme-emu.md).
    fn pushed(&mut self, completion_queue_id: u16) {
        self.reserve_completion_slot(completion_queue_id, true);
        self.in_flight.unsubmitted += 1;
        self.submit_in_flight();
    }

    pub(super) fn reserve_completion_slot(&mut self, completion_queue_id: u16, reserve: bool) {
        if let Some(Some(queue)) = self.completion_queues.get_mut(usize::from(completion_queue_id)) {
            queue.reserved = if reserve { queue.reserved + 1 } else { queue.reserved.saturating_sub(1) };
        }
    }

    /// Hands pushed transfers to the kernel.
    fn submit_in_flight(&mut self) {
        if self.in_flight.unsubmitted == 0 && self.in_flight.is_empty() {
            return;
        }
        if self.in_flight.unsubmitted > 0 {
            self.counters.totals.transfer_submissions += 1;
        }
        self.in_flight.unsubmitted = 0;
        let Some(reader) = self.reader.as_mut() else { return };
        if let Err(error) = reader.submit() {
            self.fail_ring(&error, Settle::Finish);
        }
    }

    /// One scan's look at the transfers in flight: finishes those the kernel completed, fails
    /// the ring when the oldest is past its deadline, and when `wait` (the scan found nothing
    /// else to do) waits in the kernel up to [`IN_FLIGHT_WAIT`] for one. Returns whether any
    /// command is or was in flight (the poller then does not park).
    pub(super) fn poll_in_flight(&mut self, now: Instant, wait: bool) -> bool {
        if self.in_flight.is_empty() {
            return false;
        }
        let timeout = self.reader.as_ref().map_or(Duration::ZERO, UringReader::batch_timeout);
        if let Some(oldest) = self.in_flight.past_deadline(now, timeout) {
            let waited = now.saturating_duration_since(oldest);
            self.fail_ring(&UringError::Timeout { waited, in_flight: self.in_flight.count() }, Settle::Finish);
            return true;
        }
        if wait {
            if let Some(reader) = self.reader.as_mut() {
                match reader.wait(now + IN_FLIGHT_WAIT) {
                    Ok(()) | Err(UringError::Timeout { .. }) => {}
                    Err(error) => {
                        self.fail_ring(&error, Settle::Finish);
                        return true;
                    }
                }
            }
        }
        self.reap_in_flight(Settle::Finish);
        true
    }

    /// Waits (up to the oldest transfer's deadline) for at least one transfer and finishes (or,
    /// per `settle`, drops) what completed. False when nothing is in flight.
    pub(super) fn wait_in_flight(&mut self, settle: Settle) -> bool {
        self.wait_in_flight_for(settle, None)
    }

    /// [`ControllerCore::wait_in_flight`], returning after `slice` (when given) if nothing
    /// completed by then and the deadline is still ahead.
    fn wait_in_flight_for(&mut self, settle: Settle, slice: Option<Duration>) -> bool {
        let Some(oldest) = self.in_flight.oldest() else { return false };
        let Some(reader) = self.reader.as_mut() else { return false };
        self.in_flight.unsubmitted = 0;
        let deadline = oldest + reader.batch_timeout();
        let until = slice.and_then(|slice| Instant::now().checked_add(slice)).map_or(deadline, |end| end.min(deadline));
        match reader.wait(until) {
            Ok(()) => {}
            // The slice ended, not the deadline: nothing failed.
            Err(UringError::Timeout { .. }) if until < deadline => {}
            Err(error) => {
                self.fail_ring(&error, settle);
                return true;
            }
        }
        self.reap_in_flight(settle);
        true
    }

    /// Waits for everything in flight before a command that must not run beside it (see
    /// [`ControllerCore::run_batch`]) or a shutdown's write-back, finishing each, unless a stop
    /// is asked for meanwhile ([`ControllerCore::stop_asked`], looked at every
    /// [`RESET_LOOK_INTERVAL`]): then it returns with transfers still in flight, and the stop
    /// cancels them and deletes the command's queue, or ends the device (the command gets no
    /// completion), instead of starting only at their deadlines, well past CAP.TO.
    pub(super) fn settle_unless_stopped(&mut self) {
        // Bounded: each pass finishes at least one transfer, fails the ring (which empties the
        // table) or waits a slice of the way to the oldest transfer's deadline.
        #[cfg(test)]
        self.unlocked.set_settling_for_tests(!self.in_flight.is_empty());
        while !self.stop_asked() && self.wait_in_flight_for(Settle::Finish, Some(RESET_LOOK_INTERVAL)) {}
        #[cfg(test)]
        self.unlocked.set_settling_for_tests(false);
    }

    /// Whether a wait for transfers in flight, and the command behind it, should give way: the
    /// host cleared CC.EN (the reset at the next poll deletes the queues), a power loss or a
    /// function reset waits for the controller's lock (its stop deletes them), or the device is
    /// being dropped (its thread must end within the drop's bound, not run the command later,
    /// detached, against a file a new device may have opened). Until 2026-12-01 only the first
    /// counted: `power_loss()` and `function_reset()` waited up to the transfers' 30 s deadline,
    /// and a drop detached the thread, which then ran a waiting Flush's write-back into the file.
    pub(super) fn stop_asked(&self) -> bool {
        self.registers.reset_requested() || self.unlocked.give_way()
    }

    /// Finishes (or, settling for a reset, drops) every command whose transfer is ready.
    fn reap_in_flight(&mut self, settle: Settle) {
        let mut reaped = std::mem::take(&mut self.in_flight.reaped);
        let outcome = match self.reader.as_mut() {
            Some(reader) => reader.reap(|completion| reaped.push(completion)),
            None => Ok(0),
        };
        for completion in reaped.drain(..) {
            self.end_given_back(completion, settle);
        }
        self.in_flight.reaped = reaped;
        if let Err(error) = outcome {
            self.fail_ring(&error, settle);
        }
    }

    /// Ends the command of a transfer the kernel gave back (completed, failed or cancelled).
    pub(super) fn end_given_back(&mut self, completion: Completion, settle: Settle) {
        let result = completion.check();
        let Some(mut io) = self.in_flight.take(completion.tag) else { return };
        self.reserve_completion_slot(io.completion_queue_id, false);
        if io.direct {
            io.buffers.regions = completion.regions;
        }
        #[cfg(test)]
        let result = self.short_write_for_tests(&io, &completion.buffer, result, settle);
        self.end_io(io, completion.buffer, result, settle);
    }

    /// `short_write_at_stop_for_tests`: lands the first bytes of a Write given back at a stop in
    /// the store, as a kernel that wrote part of it would have, and reports it short.
    #[cfg(test)]
    fn short_write_for_tests(
        &mut self,
        io: &PreparedIo,
        buffer: &AlignedBuffer,
        result: Result<(), UringError>,
        settle: Settle,
    ) -> Result<(), UringError> {
        let len_bytes = io.len_bytes();
        match self.short_write_at_stop_for_tests {
            Some(done_bytes) if settle != Settle::Finish && io.write && done_bytes < len_bytes => {
                let mut data = vec![0u8; len_bytes];
                if io.direct {
                    io.buffers.gather(&mut data).expect("the direct Write's host memory");
                } else {
                    data.copy_from_slice(buffer.bytes(len_bytes));
                }
                let offset_bytes = io.offset_bytes();
                self.store.write(offset_bytes, &data[..done_bytes]).expect("the test's short write lands");
                self.short_writes_at_stop_for_tests += 1;
                self.short_direct_writes_at_stop_for_tests += usize::from(io.direct);
                Err(UringError::ShortTransfer { direction: Direction::Write, offset_bytes, len_bytes, done_bytes })
            }
            _ => result,
        }
    }

    /// Ends a command whose transfer the kernel gave back: finishes it (`Settle::Finish`), or
    /// drops it without a completion. A dropped Write that did not complete is not redone: its
    /// blocks keep whatever the cache and the store held before it (it never happened, which a
    /// command without a completion may not have); one that completed landed all the same; one
    /// given back short has the block it stopped in finished ([`ControllerCore::whole_blocks_after`]).
    /// One given back failed (an error, not a count: an O_DIRECT write part of whose bios
    /// landed returns EIO) is left as the kernel left it: which of its blocks landed, whole or
    /// in part, is unknown, so nothing can finish or drop them back.
    pub(super) fn end_io(&mut self, io: PreparedIo, mut buffer: AlignedBuffer, result: Result<(), UringError>, settle: Settle) {
        if settle == Settle::Finish {
            self.finish_io(io, buffer, result);
        } else {
            match result {
                Ok(()) if io.write => self.landed(&io),
                Err(UringError::ShortTransfer { done_bytes, .. }) if io.write => self.whole_blocks_after(&io, &mut buffer, done_bytes),
                _ => {}
            }
            self.recycle_buffer(buffer);
        }
    }

    /// A dropped Write the kernel gave back short, `done_bytes` of it in the store: the logical
    /// block it stopped in holds new bytes over old ones. One logical block is atomic on power
    /// fail (Identify's AWUPF = 0, a 0's based value), and a stop is where the host may see one,
    /// so that block is finished from the command's data (its first bytes, already there, are
    /// written again with it): each block then reads wholly old (not reached) or wholly new,
    /// unless finishing fails (the data cannot be gathered again, or the store write fails):
    /// that block then stays torn, logged as an error.
    /// Dropping it back instead would need its old bytes, which the store no longer has. The
    /// blocks before it landed whole; older cached copies of them stay (a command with no
    /// completion may have happened or not, block by block). A direct Write's data is gathered
    /// again from the host's memory, which the kernel gave back with the transfer.
    ///
    /// Only a Write given back within the cancellation comes here, and it never finds the store
    /// fenced (a fence comes only with an abandoned ring, whose transfers given back all end
    /// before it, and which takes no new ones). One the kernel keeps past the cancellation was
    /// ended by `end_held` (failed or dropped, the store fenced); when the kernel gives it back
    /// later its completion is dropped unread (`UringReader::holds_writes`, `retain_held`), so
    /// a block it wrote in part stays torn: its command (namespace, block size) is no longer
    /// tracked by then.
    fn whole_blocks_after(&mut self, io: &PreparedIo, buffer: &mut AlignedBuffer, done_bytes: usize) {
        let block = io.namespace.block_size_bytes as usize;
        let len = io.len_bytes();
        if block == 0 || done_bytes.is_multiple_of(block) || done_bytes >= len {
            return;
        }
        let start = done_bytes - done_bytes % block;
        let mut bounce = None;
        let data: &[u8] = if io.direct {
            let bounce = bounce.insert(self.io_buffers.pop().unwrap_or_default());
            if let Err(status) = io.buffers.gather(bounce.slice(len)) {
                tracing::error!(%status, "a Write cut short by a stop left a torn block: its data could not be gathered again");
                return;
            }
            bounce.bytes(len)
        } else {
            buffer.bytes(len)
        };
        let offset = io.offset_bytes() + start as u64;
        let written = match data.get(start..start + block) {
            Some(rest) => self.store.write(offset, rest),
            None => Err(std::io::Error::other("the Write's buffer is shorter than the command")),
        };
        if let Err(error) = written {
            tracing::error!(%error, offset, "a Write cut short by a stop left a torn block: finishing it failed");
        }
        if let Some(bounce) = bounce {
            self.recycle_buffer(bounce);
        }
    }

    /// A Write's data reached the store: older cached copies of its blocks must not be written
    /// back over it, nor overlay it on reads. Dropped only now, not when the Write was fetched:
    /// until it landed those copies are the newest completed data of the blocks (a reset may yet
    /// drop the Write, and a controller reset keeps the cache), and nothing else touches the
    /// blocks meanwhile (a command overlapping a Write in flight waits for it, any other command
    /// that reads or fills the cache waits for everything in flight). Finishing can therefore
    /// only drop cached blocks, never add any.
    fn landed(&mut self, io: &PreparedIo) {
        self.cache.discard_range(io.namespace_index, io.start_lba, io.blocks);
    }

    /// Finishes one command after its transfer: a transfer that did not complete (short, refused,
    /// cancelled, never pushed) is redone synchronously from the same buffer, never a write the
    /// kernel may still complete; a Write that landed drops older cached copies of its blocks
    /// ([`ControllerCore::landed`]), a Read gets the cache overlay and its DMA to the host; then
    /// the completion is posted.
    fn finish_io(&mut self, io: PreparedIo, mut buffer: AlignedBuffer, result: Result<(), UringError>) {
        let len = io.len_bytes();
        let offset = io.offset_bytes();
        if io.direct && result.is_ok() {
            // The data is already where it belongs: in the file, or in the host's memory.
            self.counters.totals.direct_transfers += 1;
            if io.write {
                self.counters.totals.batched_writes += 1;
            } else {
                self.counters.totals.batched_reads += 1;
            }
            let durable = if io.write {
                self.landed(&io);
                self.sync_if_promised(io.entry.force_unit_access())
            } else {
                self.sync_for_fua_read(&io)
            };
            return self.finish_counted(io, buffer, durable.map(|()| 0));
        }
        if io.direct {
            // Given back without completing: redone through a bounce buffer, the host's memory
            // being the controller's again.
            buffer = self.io_buffers.pop().unwrap_or_default();
            if io.write {
                if let Err(status) = io.buffers.gather(buffer.slice(len)) {
                    return self.finish_counted(io, buffer, Err(status));
                }
            }
        }
        let data = buffer.slice(len);
        let done = match &result {
            Ok(()) => {
                if io.write {
                    self.counters.totals.batched_writes += 1;
                } else {
                    self.counters.totals.batched_reads += 1;
                }
                Ok(())
            }
            Err(error @ UringError::StillInFlight { .. }) if io.write => Err(std::io::Error::other(error.to_string())),
            Err(_) if io.write => self.store.write(offset, data),
            Err(_) => self.store.read(offset, data),
        };
        let result = match done {
            Err(error) if io.write => {
                tracing::error!(%error, offset, "backing store write failed");
                Err(media(codes::WRITE_FAULT))
            }
            Err(error) => {
                tracing::error!(%error, offset, "backing store read failed");
                Err(media(codes::UNRECOVERED_READ_ERROR))
            }
            Ok(()) if io.write => {
                self.landed(&io);
                self.sync_if_promised(io.entry.force_unit_access()).map(|()| 0)
            }
            Ok(()) => {
                self.cache.overlay(io.namespace_index, io.start_lba, io.namespace.block_size_bytes as usize, data);
                io.buffers.scatter(data).and_then(|()| self.sync_for_fua_read(&io)).map(|()| 0)
            }
        };
        self.finish_counted(io, buffer, result);
    }

    /// Counts a finished Read or Write, recycles its buffer and posts its completion.
    fn finish_counted(&mut self, io: PreparedIo, buffer: AlignedBuffer, result: super::CommandResult) {
        let len = io.len_bytes();
        if result.is_ok() {
            if io.write {
                self.counters.totals.bytes_written += len as u64;
                self.counters.host_writes += 1;
            } else {
                self.counters.totals.bytes_read += len as u64;
                self.counters.host_reads += 1;
            }
        }
        self.recycle_buffer(buffer);
        self.complete(io.queue_id, io.completion_queue_id, io.sq_head, &io.entry, result, None, Instant::now());
        self.recycle_regions(io.buffers.regions);
    }

    /// Whether a Read has FUA and any of its blocks cached: then it runs on the synchronous path,
    /// which writes them back before it reads (`commit_for_fua_read` in `io.rs`). Only the FUA
    /// bit costs a look at the cache, so plain Reads stay as they were. Its blocks cannot be
    /// cached later while it is in flight: a cached Write waits for everything in flight, and a
    /// Write that lands only drops cached blocks. A Read naming no valid namespace answers false
    /// (its transfer's validation reports the error).
    fn fua_read_needs_write_back(&self, entry: &SubmissionEntry) -> bool {
        if !entry.force_unit_access() {
            return false;
        }
        let Ok(index) = self.namespace_index(entry.nsid) else { return false };
        self.cache.holds_any(index, entry.starting_lba().0, u64::from(entry.block_count()))
    }

    /// The sync a FUA Read promises (see `commit_for_fua_read` in `io.rs`) once its transfer
    /// through io_uring is done; none of its blocks was cached (see
    /// [`ControllerCore::fua_read_needs_write_back`]), so there is nothing to write back.
    fn sync_for_fua_read(&mut self, io: &PreparedIo) -> Result<(), nvme_driver::spec::NvmeStatus> {
        if io.entry.force_unit_access() {
            self.sync_if_promised(true)
        } else {
            Ok(())
        }
    }

    /// Whether a Write bypasses the volatile write cache (the rule of `store_blocks`). A Write
    /// naming no valid namespace answers false: the synchronous path reports its error.
    fn write_goes_to_store(&self, entry: &SubmissionEntry) -> bool {
        let Ok(index) = self.namespace_index(entry.nsid) else { return false };
        let Some(namespace) = self.namespaces.get(index) else { return false };
        let length = u64::from(entry.block_count()) * u64::from(namespace.block_size_bytes);
        let cache_on = self.config.volatile_write_cache && self.features.write_cache_enabled;
        !cache_on || entry.force_unit_access() || length > self.config.write_cache_bytes
    }

    /// Keeps a finished command's region list for the next command, empty: its regions (strong
    /// references to host memory) are dropped now, so memory the host frees is unmapped as
    /// before and a later command naming its IOVA gets a Data Transfer Error.
    pub(crate) fn recycle_regions(&mut self, mut regions: Vec<DmaRegion>) {
        regions.clear();
        if self.spare_region_lists.len() < REGION_LISTS_KEPT && regions.capacity() <= REGIONS_MAX {
            self.spare_region_lists.push(regions);
        }
    }

    fn recycle_buffer(&mut self, buffer: AlignedBuffer) {
        if self.io_buffers.len() < IO_BUFFERS_KEPT && buffer.capacity_bytes() <= IO_BUFFER_KEPT_MAX_BYTES {
            self.io_buffers.push(buffer);
        }
    }

    /// Where a transfer of the store's bytes at `offset` goes: the store's descriptor (see
    /// `Store::file_descriptor`) at that offset.
    fn batch_target(&self, offset: u64, len: usize) -> (std::os::fd::RawFd, u64) {
        #[cfg(test)]
        if let Some(fd) = self.batch_descriptor_override {
            // A socket has no position: every transfer goes to offset 0.
            return (fd, 0);
        }
        (self.store.file_descriptor(offset, len).unwrap_or(-1), offset)
    }

    /// Sends transfers to `fd` instead of the store's file, with short deadlines and optionally
    /// no cancellation: a backing file that stalls, for tests.
    #[cfg(test)]
    pub(crate) fn stall_batches_for_tests(&mut self, fd: std::os::fd::RawFd, batch_timeout: Duration, cancellation: bool) {
        self.batch_descriptor_override = Some(fd);
        if let Some(reader) = self.reader.as_mut() {
            reader.stall_for_tests(batch_timeout, batch_timeout, cancellation);
        }
    }

    /// Lets transfers sent to the test descriptor (see `stall_batches_for_tests`) go straight
    /// to or from host memory, as they would to the store's file.
    #[cfg(test)]
    pub(crate) fn allow_direct_on_override(&mut self) {
        self.direct_on_override = true;
    }

    /// Sets `EmuConfig::in_flight_bytes_max` of a running controller, for tests.
    #[cfg(test)]
    pub(crate) fn set_in_flight_bytes_max_for_tests(&mut self, bytes: u64) {
        self.config.in_flight_bytes_max = bytes;
    }

    /// Test view of the commands in flight (see [`InFlight::ranges`]).
    #[cfg(test)]
    pub(crate) fn in_flight_ranges(&self) -> Vec<(usize, u64, u64, bool)> {
        self.in_flight.ranges()
    }
}
