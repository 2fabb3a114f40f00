//! NVM command set (NVM §3): Read and Write (both with FUA), Flush, Write Zeroes, Dataset Management.

use nvme_driver::hw::DmaRegion;
use nvme_driver::spec::command::{DatasetRange, DSM_DEALLOCATE};
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{NvmOpcode, NvmeStatus, SubmissionEntry};

use crate::controller::{generic, media, CommandResult, ControllerCore, Namespace};
use crate::data_pointer::{self, DataBuffers};
use crate::restriction::{access_denied, HostAccess};

/// NSID that names every namespace (Flush only, as Identify VWC bits 2:1 report).
const ALL_NAMESPACES: u32 = 0xFFFF_FFFF;
/// Most Dataset Management ranges (NR is 8 bits, 0's based).
const DSM_RANGES_MAX: usize = 256;
/// Most bytes a deallocate or Write Zeroes zeroes in one poll, holding the controller's lock:
/// about half a second where zeroes are written to a disk at 128 MB/s, well inside CAP.TO
/// (10 s); one syscall where the store punches a hole (16 Ki of them for a whole terabyte).
const ZEROING_SLICE_BYTES: u64 = 64 << 20;

fn check_range(namespace: &Namespace, start_lba: u64, blocks: u64) -> Result<(), NvmeStatus> {
    let end = start_lba.checked_add(blocks).filter(|&end| end <= namespace.blocks);
    end.map(|_| ()).ok_or(generic(codes::LBA_OUT_OF_RANGE))
}

impl ControllerCore {
    pub(crate) fn execute_io(&mut self, entry: &SubmissionEntry) -> CommandResult {
        let Some(opcode) = NvmOpcode::from_u8(entry.opcode()) else {
            return Err(generic(codes::INVALID_OPCODE));
        };
        match opcode {
            NvmOpcode::Flush => self.flush(entry),
            NvmOpcode::Read | NvmOpcode::Write => self.read_write(entry, opcode == NvmOpcode::Write),
            NvmOpcode::WriteZeroes => self.write_zeroes(entry),
            NvmOpcode::DatasetManagement => self.dataset_management(entry),
        }
    }

    fn namespace(&self, nsid: u32) -> Result<(usize, Namespace), NvmeStatus> {
        let index = self.namespace_index(nsid)?;
        let namespace = self.namespaces.get(index).copied().ok_or(generic(codes::INVALID_NAMESPACE))?;
        Ok((index, namespace))
    }

    /// Resolves a data pointer through the submitting queue's restriction (every PRP list page,
    /// SGL segment and data range is checked before anything is read or written).
    fn resolve(&self, entry: &SubmissionEntry, length_bytes: u64, spare: Vec<DmaRegion>) -> Result<DataBuffers, NvmeStatus> {
        let access = HostAccess::new(&self.dma, self.current_restriction.as_deref());
        let result = data_pointer::resolve(&access, entry, length_bytes, self.config.sgl_supported, spare);
        if access.refused() {
            self.count_refusal();
        }
        result
    }

    fn count_refusal(&self) {
        self.unlocked.count_refusal();
    }

    /// Access Denied when the submitting queue may not address these blocks of `nsid`.
    fn check_allowed_blocks(&self, nsid: u32, start_lba: u64, blocks: u64) -> Result<(), NvmeStatus> {
        match self.current_restriction.as_deref() {
            Some(restriction) if !restriction.allows_blocks(nsid, start_lba, blocks) => {
                self.count_refusal();
                Err(access_denied())
            }
            _ => Ok(()),
        }
    }

    /// Checks a Read/Write and resolves its data pointer into `spare` (an empty region list):
    /// (namespace index, geometry, buffers).
    pub(crate) fn prepare_transfer(
        &self,
        entry: &SubmissionEntry,
        spare: Vec<DmaRegion>,
    ) -> Result<(usize, Namespace, DataBuffers), NvmeStatus> {
        let (index, namespace) = self.namespace(entry.nsid)?;
        let blocks = u64::from(entry.block_count());
        let length_bytes = blocks * u64::from(namespace.block_size_bytes);
        if length_bytes > self.config.accepted_transfer_bytes() {
            return Err(generic(codes::INVALID_FIELD));
        }
        check_range(&namespace, entry.starting_lba().0, blocks)?;
        self.check_allowed_blocks(entry.nsid, entry.starting_lba().0, blocks)?;
        let buffers = self.resolve(entry, length_bytes, spare)?;
        Ok((index, namespace, buffers))
    }

    fn read_write(&mut self, entry: &SubmissionEntry, write: bool) -> CommandResult {
        let spare = self.spare_region_lists.pop().unwrap_or_default();
        let (index, namespace, buffers) = self.prepare_transfer(entry, spare)?;
        if self.config.no_storage {
            self.recycle_regions(buffers.regions);
            return Ok(0);
        }
        let start_lba = entry.starting_lba().0;
        let length = entry.block_count() as usize * namespace.block_size_bytes as usize;
        // The scratch buffer is taken out for the duration so the store can borrow self.
        let mut scratch = std::mem::take(&mut self.scratch);
        let data = scratch.slice(length);
        let result = if write {
            buffers.gather(data).and_then(|()| self.store_blocks(index, &namespace, start_lba, data, entry.force_unit_access()))
        } else {
            let committed =
                if entry.force_unit_access() { self.commit_for_fua_read(index, start_lba, u64::from(entry.block_count())) } else { Ok(()) };
            committed.and_then(|()| self.load_blocks(index, &namespace, start_lba, data)).and_then(|()| buffers.scatter(data))
        };
        self.scratch = scratch;
        self.recycle_regions(buffers.regions);
        result?;
        if write {
            self.counters.totals.bytes_written += length as u64;
            self.counters.host_writes += 1;
        } else {
            self.counters.totals.bytes_read += length as u64;
            self.counters.host_reads += 1;
        }
        Ok(0)
    }

    /// A Read with FUA (CDW12 bit 30) first commits the data of its blocks to non-volatile media
    /// (NVM command set, Read): their dirty cached copies are written back (other cached blocks
    /// stay cached) and, with `sync_file_on_flush`, the file is synced, as for a FUA Write (its
    /// blocks may also hold a write that bypassed the cache only for its size, never synced).
    /// A failure is a Write Fault, as the Flush that would have done the same reports; the
    /// blocks it could not write back stay cached. The io_uring path runs a FUA Read only when
    /// none of its blocks is cached, and syncs before its completion (`finish_io` in `batch.rs`).
    fn commit_for_fua_read(&mut self, index: usize, start_lba: u64, blocks: u64) -> Result<(), NvmeStatus> {
        self.write_back_range(index, start_lba, blocks)?;
        self.sync_if_promised(true)
    }

    /// Reads blocks as the host sees them: media, overlaid with newer cached writes.
    fn load_blocks(&mut self, index: usize, namespace: &Namespace, start_lba: u64, data: &mut [u8]) -> Result<(), NvmeStatus> {
        let offset = namespace.base_offset_bytes + start_lba * u64::from(namespace.block_size_bytes);
        if let Err(error) = self.store.read(offset, data) {
            tracing::error!(%error, offset, "backing store read failed");
            return Err(media(codes::UNRECOVERED_READ_ERROR));
        }
        self.cache.overlay(index, start_lba, namespace.block_size_bytes as usize, data);
        Ok(())
    }

    /// Writes blocks into the volatile cache, or through to media when the cache is off, the
    /// write is FUA, or it is larger than the whole cache.
    fn store_blocks(
        &mut self,
        index: usize,
        namespace: &Namespace,
        start_lba: u64,
        data: &[u8],
        force_unit_access: bool,
    ) -> Result<(), NvmeStatus> {
        let block_size = namespace.block_size_bytes as usize;
        let cache_on = self.config.volatile_write_cache && self.features.write_cache_enabled;
        let length = data.len() as u64;
        if !cache_on || force_unit_access || length > self.config.write_cache_bytes {
            let offset = namespace.base_offset_bytes + start_lba * block_size as u64;
            self.write_through_refused().and_then(|()| self.store.write(offset, data)).map_err(|error| {
                tracing::error!(%error, offset, "backing store write failed");
                media(codes::WRITE_FAULT)
            })?;
            // Older cached copies of these blocks must not be written back over the new data,
            // but only once it is in the store: a write that failed must not take an earlier
            // completed cached write with it (the in-flight path's `landed` does the same).
            self.cache.discard_range(index, start_lba, (data.len() / block_size) as u64);
            return self.sync_if_promised(force_unit_access);
        }
        if self.cache.dirty_bytes() + length > self.config.write_cache_bytes {
            self.write_back(None)?;
        }
        self.cache.insert(index, start_lba, block_size, data);
        Ok(())
    }

    /// Whether a test makes writes straight to the store fail (never outside tests).
    fn write_through_refused(&self) -> std::io::Result<()> {
        #[cfg(test)]
        if self.fail_write_throughs_for_tests {
            return Err(std::io::Error::other("backing store write refused (injected by a test)"));
        }
        Ok(())
    }

    /// With `sync_file_on_flush`, makes a Write that just reached the store durable before it
    /// completes, when its completion promises that: FUA, or the write cache off (a write
    /// through a cache that is on but too small for it promises nothing until Flush).
    pub(crate) fn sync_if_promised(&mut self, force_unit_access: bool) -> Result<(), NvmeStatus> {
        let cache_on = self.config.volatile_write_cache && self.features.write_cache_enabled;
        let promised = force_unit_access || !cache_on;
        if self.config.sync_file_on_flush && promised {
            self.sync_store()
        } else {
            Ok(())
        }
    }

    /// `fdatasync`s a file store (Write Fault when that fails).
    pub(crate) fn sync_store(&mut self) -> Result<(), NvmeStatus> {
        #[cfg(test)]
        if self.fail_syncs_for_tests {
            tracing::error!("backing store sync failed (injected by a test)");
            return Err(media(codes::WRITE_FAULT));
        }
        self.store.sync().map_err(|error| {
            tracing::error!(%error, "backing store sync failed");
            media(codes::WRITE_FAULT)
        })
    }

    fn flush(&mut self, entry: &SubmissionEntry) -> CommandResult {
        let only = if entry.nsid == ALL_NAMESPACES { None } else { Some(self.namespace_index(entry.nsid)?) };
        if self.config.no_storage {
            return Ok(0);
        }
        self.write_back(only)?;
        if self.config.sync_file_on_flush {
            self.sync_store()?;
        }
        Ok(0)
    }

    /// Zeroes blocks on media (write-through: durable early is allowed, and it keeps huge
    /// deallocations out of the cache).
    fn zero_blocks(&mut self, index: usize, namespace: &Namespace, start_lba: u64, blocks: u64) -> Result<(), NvmeStatus> {
        let block_size = u64::from(namespace.block_size_bytes);
        let offset = namespace.base_offset_bytes + start_lba * block_size;
        self.write_through_refused().and_then(|()| self.store.write_zeroes(offset, blocks * block_size)).map_err(|error| {
            tracing::error!(%error, offset, "backing store zeroing failed");
            media(codes::WRITE_FAULT)
        })?;
        // As in `store_blocks`: cached copies go only once the zeroes are in the store.
        self.cache.discard_range(index, start_lba, blocks);
        Ok(())
    }

    fn write_zeroes(&mut self, entry: &SubmissionEntry) -> CommandResult {
        let (index, namespace) = self.namespace(entry.nsid)?;
        let blocks = u64::from(entry.block_count());
        let start_lba = entry.starting_lba().0;
        check_range(&namespace, start_lba, blocks)?;
        self.check_allowed_blocks(entry.nsid, start_lba, blocks)?;
        if self.config.no_storage || blocks == 0 {
            return Ok(0);
        }
        // Up to 65536 blocks of up to 64 KiB: 4 GiB, sliced as a deallocate is. The zeroes
        // bypass the cache (as a FUA write does), but the completion promises media only with
        // FUA (CDW12 bit 30) or the cache off, as a Write's does.
        self.zero_runs(index, &namespace, &[(start_lba, start_lba + blocks)], Some(entry.force_unit_access()))
    }

    /// Dataset Management (NVM §3.2.3): with the Deallocate attribute, every range reads as
    /// zeroes afterwards (DLFEAT = 001b). All ranges are checked before any is applied.
    ///
    /// The ranges are host input: up to 256 of them, each up to 2^32 blocks, may repeat and
    /// overlap. They are sorted and merged first, so one command zeroes each block at most once
    /// (at most the namespace), and a zeroing longer than a slice runs a slice per poll
    /// (`controller/zeroing.rs`): on a store that must write zeroes (a block device without
    /// write-zeroes offload) a whole namespace takes minutes, and neither a reset (CAP.TO) nor
    /// the device's other callers may wait for it. A command a reset, power loss or function
    /// reset cuts short gets no completion (its queue is deleted); the blocks it had zeroed
    /// read as zero, the rest keep their data, which is all a host may assume of a command
    /// that never completed.
    fn dataset_management(&mut self, entry: &SubmissionEntry) -> CommandResult {
        let (index, namespace) = self.namespace(entry.nsid)?;
        let range_count = (entry.cdw10 & 0xFF) as usize + 1;
        let length = range_count * DatasetRange::BYTES;
        let buffers = self.resolve(entry, length as u64, Vec::new())?;
        let mut raw = [0u8; DSM_RANGES_MAX * DatasetRange::BYTES];
        let bytes = raw.get_mut(..length).ok_or(generic(codes::INVALID_FIELD))?;
        buffers.gather(bytes)?;
        if entry.cdw11 & DSM_DEALLOCATE == 0 {
            return Ok(0); // Only hints (integral read/write): nothing to do.
        }
        // (start, end) block runs, end exclusive; on the stack, as the range list is bounded.
        let mut runs = [(0u64, 0u64); DSM_RANGES_MAX];
        let mut run_count = 0;
        for chunk in bytes.chunks_exact(DatasetRange::BYTES) {
            let mut array = [0u8; DatasetRange::BYTES];
            array.copy_from_slice(chunk);
            let range = DatasetRange::from_bytes(&array);
            let blocks = u64::from(range.blocks);
            check_range(&namespace, range.start.0, blocks)?;
            self.check_allowed_blocks(entry.nsid, range.start.0, blocks)?;
            if blocks > 0 {
                // check_range proved start + blocks <= the namespace's size: no overflow.
                runs[run_count] = (range.start.0, range.start.0 + blocks);
                run_count += 1;
            }
        }
        if self.config.no_storage {
            return Ok(0);
        }
        let merged = merge_runs(&mut runs[..run_count]);
        self.zero_runs(index, &namespace, &runs[..merged], None)
    }

    /// Zeroes a command's block `runs` ((start, end), end exclusive, sorted and disjoint), then
    /// syncs the store as a Write Zeroes' `force_unit_access` promises (`None`: a deallocate,
    /// which promises nothing more). Work of at most one slice ([`ZEROING_SLICE_BYTES`]) is
    /// done now; a longer one is left in `zeroing_started` as a [`Zeroing`], which the batch
    /// takes and runs a slice per poll (see `controller/zeroing.rs`): where the store must write
    /// zeroes a range takes minutes, and the controller's lock must not be held that long.
    fn zero_runs(&mut self, index: usize, namespace: &Namespace, runs: &[(u64, u64)], force_unit_access: Option<bool>) -> CommandResult {
        // The runs are disjoint and inside the namespace: their sum is at most its block count.
        let total_blocks: u64 = runs.iter().map(|&(start, end)| end - start).sum();
        if total_blocks > self.zeroing_slice_blocks(namespace) {
            // The next run last, so that finished runs pop off the end.
            let runs = runs.iter().rev().copied().collect();
            self.zeroing_started = Some(Zeroing { namespace_index: index, namespace: *namespace, runs, force_unit_access });
            return Ok(0);
        }
        for &(start, end) in runs {
            self.zero_blocks(index, namespace, start, end - start)?;
        }
        if let Some(force_unit_access) = force_unit_access {
            self.sync_if_promised(force_unit_access)?;
        }
        Ok(0)
    }

    /// Blocks of `namespace` one zeroing slice covers (at least one).
    fn zeroing_slice_blocks(&self, namespace: &Namespace) -> u64 {
        #[cfg(test)]
        let slice_bytes = self.zeroing_slice_for_tests.map_or(ZEROING_SLICE_BYTES, |(bytes, _)| bytes);
        #[cfg(not(test))]
        let slice_bytes = ZEROING_SLICE_BYTES;
        (slice_bytes / u64::from(namespace.block_size_bytes)).max(1)
    }

    /// Zeroes the next slice of `job`. True once every block of it is zeroed (and the store
    /// synced as its Write Zeroes promised); an error ends it (the blocks zeroed so far read as
    /// zero, the rest keep their data).
    pub(crate) fn zero_slice(&mut self, job: &mut Zeroing) -> Result<bool, NvmeStatus> {
        let slice_blocks = self.zeroing_slice_blocks(&job.namespace);
        if let Some(run) = job.runs.last_mut() {
            let blocks = (run.1 - run.0).min(slice_blocks);
            let start = run.0;
            run.0 += blocks;
            if run.0 == run.1 {
                job.runs.pop();
            }
            self.zero_blocks(job.namespace_index, &job.namespace, start, blocks)?;
            #[cfg(test)]
            if let Some((_, pause)) = self.zeroing_slice_for_tests {
                std::thread::sleep(pause);
            }
        }
        if !job.runs.is_empty() {
            return Ok(false);
        }
        if let Some(force_unit_access) = job.force_unit_access {
            self.sync_if_promised(force_unit_access)?;
        }
        Ok(true)
    }
}

/// The zeroing of a deallocate or Write Zeroes longer than one slice, run a slice per poll
/// (see `controller/zeroing.rs`).
pub(crate) struct Zeroing {
    namespace_index: usize,
    namespace: Namespace,
    /// Block runs (start, end) still to zero, the next one last; its start moves per slice.
    runs: Vec<(u64, u64)>,
    /// A Write Zeroes' FUA bit, honoured once every block is zeroed; `None` for a deallocate.
    force_unit_access: Option<bool>,
}

impl Zeroing {
    /// Whether blocks `start..end` of its namespace meet a block it has still to zero (at most
    /// 256 runs: a Dataset Management command's ranges, merged).
    pub(crate) fn overlaps(&self, start: u64, end: u64) -> bool {
        self.runs.iter().any(|&(run_start, run_end)| start < run_end && run_start < end)
    }
}

/// Sorts `runs` ((start, end) block runs, end exclusive) and merges overlapping and adjacent
/// ones in place; returns how many merged runs lead the slice. Their total length is at most
/// the span the runs cover, however often the host repeated a range.
fn merge_runs(runs: &mut [(u64, u64)]) -> usize {
    runs.sort_unstable();
    let mut merged = 0usize;
    for index in 0..runs.len() {
        let (start, end) = runs[index];
        match merged.checked_sub(1).map(|last| &mut runs[last]) {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => {
                runs[merged] = (start, end);
                merged += 1;
            }
        }
    }
    merged
}

/// The status of a long zeroing cut short by a reset where the command runs by itself (the
/// fuzz entry point, `ControllerCore::finish_started_zeroing`; the controller thread posts no
/// completion for such a command, as the reset deletes its queue): Command Abort Requested,
/// which nothing else in the controller returns.
pub(crate) fn abandoned_for_reset() -> NvmeStatus {
    generic(codes::ABORTED_BY_REQUEST)
}

#[cfg(test)]
mod tests {
    use super::merge_runs;

    #[test]
    fn merging_runs_keeps_their_union_and_nothing_else() {
        // Goal: repeated, overlapping, adjacent and unsorted runs merge into their union.
        let mut runs = [(8, 9), (2, 6), (4, 8), (10, 11), (2, 6), (20, 30), (0, 1), (25, 26)];
        let merged = merge_runs(&mut runs);
        assert_eq!(&runs[..merged], &[(0, 1), (2, 9), (10, 11), (20, 30)]);
        let mut repeated = [(0, 1 << 40); 256];
        assert_eq!(merge_runs(&mut repeated), 1);
        assert_eq!(repeated[0], (0, 1 << 40));
        assert_eq!(merge_runs(&mut []), 0);
    }
}
