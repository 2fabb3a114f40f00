//! Backing-store batches: consecutive Reads, and Writes that go straight to the store, fetched
//! in one scan are validated first and their I/O issued together through io_uring; commands
//! complete in order once the whole group's I/O is done. A batch that stalls past its deadline
//! is cancelled; a write the kernel will not give back fences the store (see `backing`) and
//! makes the controller fatal, so it can never land over newer data unnoticed.

use std::time::Instant;

use nvme_driver::spec::status::codes;
use nvme_driver::spec::{NvmOpcode, SubmissionEntry};
use tutti_uring::{Direction, Job, Transfer, UringError};

use super::{media, ControllerCore, Namespace, State};
use crate::backing::AlignedBuffer;
use crate::data_pointer::DataBuffers;
use crate::faults::FaultAction;
use crate::uring::UringReader;

/// Bytes a batch gathers before it goes to the ring: larger batches leave the disk idle while
/// the controller copies their data, and the host idle until all of it completes.
const GROUP_BYTES_MAX: u64 = 4 << 20;
/// Transfer buffers kept for reuse, and the largest one worth keeping.
const IO_BUFFERS_KEPT: usize = 64;
const IO_BUFFER_KEPT_MAX_BYTES: usize = (1 << 20) + 4096;

/// A Read or Write validated and waiting for its backing-store I/O in a batch.
struct PreparedIo {
    entry: SubmissionEntry,
    sq_head: u32,
    namespace_index: usize,
    namespace: Namespace,
    /// Host memory: where a Read's data goes (a Write's was gathered into `buffer` already).
    buffers: DataBuffers,
    write: bool,
    start_lba: u64,
    blocks: u64,
    /// A Write's data; a Read's destination once the group runs.
    buffer: AlignedBuffer,
}

impl ControllerCore {
    /// Runs fetched commands in order. Consecutive Reads of a file-backed device, and Writes
    /// that go straight to the backing store (write cache off, FUA, or larger than the cache),
    /// are validated first and their backing-store I/O issued together (io_uring). A command
    /// whose LBAs overlap a Write of the group (or a Write overlapping any of it) first completes
    /// the group, as does any other command, so no read can observe a later write or miss an
    /// earlier one and overlapping writes land in submission order.
    pub(super) fn run_batch(&mut self, queue_id: u16, completion_queue_id: u16, fetched: &[(SubmissionEntry, u32)], now: Instant) {
        let admin = queue_id == 0;
        self.refresh_store_fence();
        // Every command of this batch comes from one SQ: its restriction applies to all of them.
        self.current_restriction = if admin {
            None
        } else {
            self.submission_queues.get(usize::from(queue_id)).and_then(Option::as_ref).and_then(|queue| queue.restriction.clone())
        };
        let mut group: Vec<PreparedIo> = Vec::new();
        for (entry, sq_head) in fetched {
            if self.state != State::Ready {
                // A fatal fault stopped the controller: the rest get no completion.
                break;
            }
            self.counters.count_command(queue_id, entry);
            let fault = self.faults.on_command(admin, entry.opcode());
            if fault.is_some() {
                self.counters.totals.faults_injected += 1;
            }
            let read = entry.opcode() == NvmOpcode::Read as u8;
            let batchable = fault.is_none()
                && !admin
                && self.reader.is_some()
                && entry.fuse() == 0
                && (read || (entry.opcode() == NvmOpcode::Write as u8 && self.write_goes_to_store(entry)));
            if batchable {
                self.prepare_io(queue_id, completion_queue_id, &mut group, entry, *sq_head, !read, now);
                continue;
            }
            self.run_group(queue_id, completion_queue_id, &mut group, now);
            let result = match fault {
                Some(FaultAction::Status(status)) => Err(status),
                Some(FaultAction::ControllerFatal) => {
                    self.set_fatal();
                    break;
                }
                _ => self.execute(queue_id, entry),
            };
            self.complete(queue_id, completion_queue_id, *sq_head, entry, result, fault, now);
        }
        self.run_group(queue_id, completion_queue_id, &mut group, now);
        self.current_restriction = None;
    }

    /// Validates a batchable Read or Write and adds it to `group` (a Write's data is gathered
    /// from the host now, and older cached copies of its blocks are dropped now, in command
    /// order, as the synchronous path does). A command that overlaps a Write of the group, or
    /// a Write that overlaps any command of it, first completes the group. An invalid command
    /// completes at once with its status.
    #[allow(clippy::too_many_arguments)]
    fn prepare_io(
        &mut self,
        queue_id: u16,
        completion_queue_id: u16,
        group: &mut Vec<PreparedIo>,
        entry: &SubmissionEntry,
        sq_head: u32,
        write: bool,
        now: Instant,
    ) {
        let (namespace_index, namespace, buffers) = match self.prepare_transfer(entry) {
            Ok(prepared) => prepared,
            Err(status) => return self.complete(queue_id, completion_queue_id, sq_head, entry, Err(status), None, now),
        };
        let start_lba = entry.starting_lba().0;
        let blocks = u64::from(entry.block_count());
        let conflicts = group.iter().any(|other| {
            (write || other.write)
                && other.namespace_index == namespace_index
                && other.start_lba < start_lba + blocks
                && start_lba < other.start_lba + other.blocks
        });
        if conflicts {
            self.run_group(queue_id, completion_queue_id, group, now);
            if self.state != State::Ready {
                // The group made the controller fatal: like the rest, this gets no completion.
                return;
            }
        }
        let len = (blocks * u64::from(namespace.block_size_bytes)) as usize;
        let mut buffer = self.io_buffers.pop().unwrap_or_default();
        if write {
            if let Err(status) = buffers.gather(buffer.slice(len)) {
                self.recycle_buffer(buffer);
                return self.complete(queue_id, completion_queue_id, sq_head, entry, Err(status), None, now);
            }
            // Older cached copies of these blocks must not be written back over the new data.
            self.cache.discard_range(namespace_index, start_lba, blocks);
        }
        group.push(PreparedIo { entry: *entry, sq_head, namespace_index, namespace, buffers, write, start_lba, blocks, buffer });
        let bytes: u64 = group.iter().map(|io| io.blocks * u64::from(io.namespace.block_size_bytes)).sum();
        if bytes >= GROUP_BYTES_MAX {
            self.run_group(queue_id, completion_queue_id, group, now);
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

    fn recycle_buffer(&mut self, buffer: AlignedBuffer) {
        if self.io_buffers.len() < IO_BUFFERS_KEPT && buffer.capacity_bytes() <= IO_BUFFER_KEPT_MAX_BYTES {
            self.io_buffers.push(buffer);
        }
    }

    /// Performs the backing-store I/O of a group (in flight together when there are several),
    /// then finishes each command in order: a Read gets the cache overlay and its DMA to the
    /// host, and each gets its completion. Returns only when all of the group's I/O is done, or
    /// is known to be with a kernel that would not give it back: then the store is fenced, the
    /// Writes the kernel kept fail with Write Fault, and the controller becomes fatal (CSTS.CFS)
    /// after completing the group. A group of a controller no longer ready is dropped unrun.
    fn run_group(&mut self, queue_id: u16, completion_queue_id: u16, group: &mut Vec<PreparedIo>, now: Instant) {
        if group.is_empty() {
            return;
        }
        if self.state != State::Ready {
            for io in group.drain(..) {
                self.recycle_buffer(io.buffer);
            }
            return;
        }
        let mut jobs: Vec<Job> = Vec::with_capacity(group.len());
        for io in group.iter_mut() {
            let block_size = u64::from(io.namespace.block_size_bytes);
            let offset = io.namespace.base_offset_bytes + io.start_lba * block_size;
            let len = (io.blocks * block_size) as usize;
            let (fd, offset_bytes) = self.batch_target(offset, len);
            let mut buffer = std::mem::take(&mut io.buffer);
            // A read's buffer comes from the pool at any size: grow it now (the ring refuses a
            // buffer smaller than its transfer; that job would then run synchronously).
            if let Err(error) = buffer.try_reserve(len) {
                tracing::warn!(%error, "no memory for a batched read's buffer; it runs synchronously");
            }
            let direction = if io.write { Direction::Write } else { Direction::Read };
            jobs.push(Job::new(Transfer { fd, direction, offset_bytes, len_bytes: len }, buffer));
        }
        if jobs.len() > 1 {
            if let Some(reader) = self.reader.as_mut() {
                reader.run(&mut jobs);
            }
        }
        let kept_writes = jobs.iter().filter(|job| job.transfer.direction == Direction::Write && still_in_flight(&job.result)).count();
        if kept_writes > 0 {
            // The kernel may complete these writes at any time, over whatever is written to
            // their blocks after them: nothing may touch the store until they are given back.
            tracing::error!(
                kept_writes,
                "backing-store writes of an abandoned io_uring batch are still in flight after cancellation: they fail, the store \
                 refuses all I/O until the kernel gives them back, and the controller reports a fatal status"
            );
            self.store.fence(format!("{kept_writes} abandoned io_uring write(s) may still land"));
        }
        for (io, mut job) in group.drain(..).zip(jobs) {
            let len = job.transfer.len_bytes;
            let offset = io.namespace.base_offset_bytes + io.start_lba * u64::from(io.namespace.block_size_bytes);
            let data = job.buffer.slice(len);
            // A single transfer, or one the ring could not do (short transfer, O_DIRECT
            // refusal), or one it cancelled, is a synchronous pread/pwrite of the same buffer;
            // never a write the kernel may still complete.
            let done = match &job.result {
                Ok(()) => {
                    if io.write {
                        self.counters.totals.batched_writes += 1;
                    } else {
                        self.counters.totals.batched_reads += 1;
                    }
                    Ok(())
                }
                Err(error) if io.write && still_in_flight(&job.result) => Err(std::io::Error::other(error.to_string())),
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
                Ok(()) if io.write => Ok(0),
                Ok(()) => {
                    self.cache.overlay(io.namespace_index, io.start_lba, io.namespace.block_size_bytes as usize, data);
                    io.buffers.scatter(data).map(|()| 0)
                }
            };
            if result.is_ok() {
                if io.write {
                    self.counters.totals.bytes_written += len as u64;
                    self.counters.host_writes += 1;
                } else {
                    self.counters.totals.bytes_read += len as u64;
                    self.counters.host_reads += 1;
                }
            }
            self.recycle_buffer(job.buffer);
            self.complete(queue_id, completion_queue_id, io.sq_head, &io.entry, result, None, now);
        }
        if kept_writes > 0 {
            self.set_fatal();
        }
    }

    /// Where a batched transfer of the store's bytes at `offset` goes: the store's descriptor
    /// (see `Store::file_descriptor`) at that offset.
    fn batch_target(&self, offset: u64, len: usize) -> (std::os::fd::RawFd, u64) {
        #[cfg(test)]
        if let Some(fd) = self.batch_descriptor_override {
            // A socket has no position: every transfer goes to offset 0.
            return (fd, 0);
        }
        (self.store.file_descriptor(offset, len).unwrap_or(-1), offset)
    }

    /// Lifts the store's fence once the kernel has given back every write that an abandoned
    /// batch left with it (they can no longer land over newer data). Checked when the
    /// controller is enabled and before it runs fetched commands, only while fenced.
    pub(super) fn refresh_store_fence(&mut self) {
        if !self.store.is_fenced() || self.reader.as_mut().is_some_and(UringReader::holds_writes) {
            return;
        }
        self.store.lift_fence();
        tracing::warn!("the kernel gave back every abandoned io_uring write: backing-store I/O resumes (synchronously)");
    }

    /// Sends batched transfers to `fd` instead of the store's file, with short deadlines and
    /// optionally no cancellation: a backing file that stalls, for tests.
    #[cfg(test)]
    pub(crate) fn stall_batches_for_tests(&mut self, fd: std::os::fd::RawFd, batch_timeout: std::time::Duration, cancellation: bool) {
        self.batch_descriptor_override = Some(fd);
        if let Some(reader) = self.reader.as_mut() {
            reader.stall_for_tests(batch_timeout, batch_timeout, cancellation);
        }
    }
}

/// Whether a batch's job failed because the kernel still holds its transfer.
fn still_in_flight(result: &Result<(), UringError>) -> bool {
    matches!(result, Err(UringError::StillInFlight { .. }))
}
