//! Resolving a command's data pointer (PRP or SGL, §4.1) into DMA regions.
//!
//! Everything read here comes from host memory and is untrusted: PRP lists and SGL segments are
//! read with bounds, every length sum is checked, chains are bounded in hops and descriptors,
//! a segment visited twice is a loop, and an address that translates to no mapped memory is a
//! Data Transfer Error. Nothing here panics on host data.

use std::collections::HashSet;

use nvme_driver::hw::{DataRegion, DmaRegion};
use nvme_driver::spec::data_pointer::{SglDescriptor, SglDescriptorType, PRP_ENTRY_BYTES, SGL_DESCRIPTOR_BYTES};
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{NvmeStatus, SubmissionEntry};
use nvme_driver::Iova;

use crate::restriction::HostAccess;

/// Memory page size (CC.MPS = 0; CAP.MPSMAX = 0 so it is the only one).
pub(crate) const PAGE_BYTES: u64 = 4096;
/// Most SGL descriptors one command may use, over all its segments (bounds loops and work).
pub(crate) const MAX_SGL_DESCRIPTORS: u64 = 1 << 16;

fn generic(code: u8) -> NvmeStatus {
    NvmeStatus::generic(code)
}

/// The memory a command transfers to or from, in order.
///
/// Host DMA memory is the common case and the only one the file backing may move straight to or
/// from (`batch.rs`, by host address): then every piece is in `regions`. A command with any piece
/// in memory reached only by copies (GPU memory a daemon imported: `nvme_driver::hw::CopiedMemory`)
/// has all its pieces, in order, in `copied` instead, and `regions` is empty, so it always moves
/// through the controller's bounce buffer and each piece copies itself.
#[derive(Debug, Default)]
pub(crate) struct DataBuffers {
    pub regions: Vec<DmaRegion>,
    pub copied: Vec<DataRegion>,
}

impl DataBuffers {
    /// Copies `data` into the buffers in order (device to host).
    pub(crate) fn scatter(&self, data: &[u8]) -> Result<(), NvmeStatus> {
        let mut done = 0usize;
        for region in &self.regions {
            let chunk = data.get(done..done + region.len()).ok_or(generic(codes::INTERNAL_ERROR))?;
            region.write(0, chunk).map_err(|_| generic(codes::DATA_TRANSFER_ERROR))?;
            done += region.len();
        }
        for region in &self.copied {
            let chunk = data.get(done..done + region.len()).ok_or(generic(codes::INTERNAL_ERROR))?;
            region.write(0, chunk).map_err(|error| copy_failed(region, &error))?;
            done += region.len();
        }
        Ok(())
    }

    /// Copies the buffers into `data` in order (host to device).
    pub(crate) fn gather(&self, data: &mut [u8]) -> Result<(), NvmeStatus> {
        let mut done = 0usize;
        for region in &self.regions {
            let chunk = data.get_mut(done..done + region.len()).ok_or(generic(codes::INTERNAL_ERROR))?;
            region.read(0, chunk).map_err(|_| generic(codes::DATA_TRANSFER_ERROR))?;
            done += region.len();
        }
        for region in &self.copied {
            let chunk = data.get_mut(done..done + region.len()).ok_or(generic(codes::INTERNAL_ERROR))?;
            region.read(0, chunk).map_err(|error| copy_failed(region, &error))?;
            done += region.len();
        }
        Ok(())
    }
}

/// A copy into or out of memory reached by copies failed (a CUDA error, say): Data Transfer
/// Error, as a device whose DMA faulted reports; the cause goes to the log, once per command.
fn copy_failed(region: &DataRegion, error: &nvme_driver::HwError) -> NvmeStatus {
    tracing::error!(iova = %region.iova(), len = region.len(), %error, "a copy through copied device memory failed");
    generic(codes::DATA_TRANSFER_ERROR)
}

/// Resolves the data pointer of `entry` for a transfer of `length_bytes`. `sgl_allowed` is false
/// for admin commands (PCIe admin commands use PRPs) and when the controller reports no SGLs.
///
/// Allocation-free when `spare` (an empty list, e.g. one a finished command gave back) has room
/// for the regions: the pointer's ranges are walked, merged where they continue each other (so
/// one translation covers several pages) and translated as they come, with no intermediate
/// range lists (this runs once per I/O command).
pub(crate) fn resolve(
    dma: &HostAccess<'_>,
    entry: &SubmissionEntry,
    length_bytes: u64,
    sgl_allowed: bool,
    spare: Vec<DmaRegion>,
) -> Result<DataBuffers, NvmeStatus> {
    debug_assert!(spare.is_empty(), "a spare region list holds no region");
    let mut buffers = DataBuffers { regions: spare, copied: Vec::new() };
    if length_bytes == 0 {
        return Ok(buffers);
    }
    let mut pending: Option<(u64, u64)> = None;
    let mut sink = |iova: u64, len: u64| -> Result<(), NvmeStatus> {
        match pending.as_mut() {
            Some((start, total)) if start.checked_add(*total) == Some(iova) => *total += len,
            _ => {
                if let Some((start, total)) = pending.replace((iova, len)) {
                    translate(dma, start, total, &mut buffers)?;
                }
            }
        }
        Ok(())
    };
    match entry.psdt() {
        0 => walk_prp(dma, entry.dptr[0], entry.dptr[1], length_bytes, &mut sink)?,
        1 | 2 if sgl_allowed => walk_sgl(dma, entry.dptr, length_bytes, &mut sink)?,
        _ => return Err(generic(codes::INVALID_FIELD)),
    }
    if let Some((start, total)) = pending {
        translate(dma, start, total, &mut buffers)?;
    }
    Ok(buffers)
}

impl DataBuffers {
    /// Appends the next piece, keeping the invariant: all pieces in `regions` while every one is
    /// host memory, all of them (in order) in `copied` once any is not.
    fn push(&mut self, piece: DataRegion) {
        match piece {
            DataRegion::Host(region) if self.copied.is_empty() => self.regions.push(region),
            DataRegion::Copied(_) if self.copied.is_empty() => {
                self.copied.extend(self.regions.drain(..).map(DataRegion::Host));
                self.copied.push(piece);
            }
            piece => self.copied.push(piece),
        }
    }

    /// (IOVA, length) of the last piece.
    fn last(&self) -> Option<(Iova, usize)> {
        match self.copied.last() {
            Some(piece) => Some((piece.iova(), piece.len())),
            None => self.regions.last().map(|region| (region.iova(), region.len())),
        }
    }

    fn pop(&mut self) {
        if self.copied.pop().is_none() {
            self.regions.pop();
        }
    }
}

/// Translates one data range (host memory or memory reached by copies); a merged range that
/// spans two mappings adjacent in IOVA space is retried page by page.
fn translate(dma: &HostAccess<'_>, iova: u64, len: u64, out: &mut DataBuffers) -> Result<(), NvmeStatus> {
    let transfer_error = generic(codes::DATA_TRANSFER_ERROR);
    let whole_len = usize::try_from(len).map_err(|_| transfer_error)?;
    if let Ok(region) = dma.translate_data(iova, whole_len) {
        out.push(region);
        return Ok(());
    }
    // Mappings start on page boundaries, so a range inside one page meets at most one of them;
    // any range that crosses a boundary, however short (half a page at the end of one buffer
    // and half at the start of the next), may span two.
    if (iova % PAGE_BYTES).saturating_add(len) <= PAGE_BYTES {
        return Err(transfer_error);
    }
    let mut done = 0u64;
    // Bounded by len / page size + 1 iterations: every pass advances to the next page boundary.
    while done < len {
        let at = iova.checked_add(done).ok_or(transfer_error)?;
        let chunk = (PAGE_BYTES - at % PAGE_BYTES).min(len - done);
        let region = dma.translate_data(at, chunk as usize)?;
        match out.last() {
            // Keep one region per mapping where possible.
            Some((previous, previous_len)) if previous.checked_add(previous_len as u64) == Some(Iova(at)) => {
                if let Ok(longer) = dma.translate_data(previous.0, previous_len + chunk as usize) {
                    out.pop();
                    out.push(longer);
                } else {
                    out.push(region);
                }
            }
            _ => out.push(region),
        }
        done += chunk;
    }
    Ok(())
}

/// Reads `count` little-endian u64 values at `iova` (one PRP list stretch, within one page).
fn read_prp_entries(dma: &HostAccess<'_>, iova: u64, count: usize) -> Result<[u64; 512], NvmeStatus> {
    let transfer_error = generic(codes::DATA_TRANSFER_ERROR);
    let mut raw = [0u8; PAGE_BYTES as usize];
    let bytes = raw.get_mut(..count * PRP_ENTRY_BYTES).ok_or(generic(codes::INTERNAL_ERROR))?;
    let region = dma.translate(iova, bytes.len())?;
    region.read(0, bytes).map_err(|_| transfer_error)?;
    let mut entries = [0u64; 512];
    for (entry, chunk) in entries.iter_mut().zip(bytes.chunks_exact(PRP_ENTRY_BYTES)) {
        let mut qword = [0u8; 8];
        qword.copy_from_slice(chunk);
        *entry = u64::from_le_bytes(qword);
    }
    Ok(entries)
}

/// PRP1/PRP2/PRP lists (§4.1.1): hands the (address, length) pieces of the transfer to `sink`,
/// in order.
fn walk_prp(
    dma: &HostAccess<'_>,
    prp1: u64,
    prp2: u64,
    length_bytes: u64,
    sink: &mut impl FnMut(u64, u64) -> Result<(), NvmeStatus>,
) -> Result<(), NvmeStatus> {
    let offset_error = generic(codes::INVALID_PRP_OFFSET);
    // PRP1 may carry an offset into its page, but it must be dword aligned.
    if prp1 & 0x3 != 0 {
        return Err(offset_error);
    }
    let first = length_bytes.min(PAGE_BYTES - prp1 % PAGE_BYTES);
    let mut remaining = length_bytes - first;
    if remaining == 0 {
        return sink(prp1, first);
    }
    if remaining <= PAGE_BYTES {
        if !prp2.is_multiple_of(PAGE_BYTES) {
            return Err(offset_error);
        }
        sink(prp1, first)?;
        return sink(prp2, remaining);
    }
    // PRP2 points to a list (offset allowed, qword aligned); entries must be page aligned.
    if prp2 & 0x7 != 0 {
        return Err(offset_error);
    }
    sink(prp1, first)?;
    let mut entries_needed = remaining.div_ceil(PAGE_BYTES);
    let mut list = prp2;
    // Every list page but a degenerate first one yields at least one data entry.
    let max_pages = entries_needed + 2;
    for _ in 0..max_pages {
        let slots = (PAGE_BYTES - list % PAGE_BYTES) / PRP_ENTRY_BYTES as u64;
        let chained = entries_needed > slots;
        let take = if chained { slots } else { entries_needed };
        let entries = read_prp_entries(dma, list, take as usize)?;
        let data_entries = if chained { take - 1 } else { take };
        for &entry in entries.iter().take(data_entries as usize) {
            if entry % PAGE_BYTES != 0 {
                return Err(offset_error);
            }
            let len = remaining.min(PAGE_BYTES);
            sink(entry, len)?;
            remaining -= len;
        }
        entries_needed -= data_entries;
        if entries_needed == 0 {
            return Ok(());
        }
        let next = entries.get(take as usize - 1).copied().ok_or(generic(codes::INTERNAL_ERROR))?;
        if next % PAGE_BYTES != 0 {
            return Err(offset_error);
        }
        list = next;
    }
    Err(generic(codes::INVALID_FIELD))
}

/// SGLs (§4.1.2): a Data Block in SGL1, or a chain of Segment / Last Segment descriptors. Hands
/// the (address, length) pieces to `sink`, in order.
fn walk_sgl<F: FnMut(u64, u64) -> Result<(), NvmeStatus>>(
    dma: &HostAccess<'_>,
    dptr: [u64; 2],
    length_bytes: u64,
    sink: &mut F,
) -> Result<(), NvmeStatus> {
    let mut walk = SglWalk { sink, total_bytes: 0, expected_bytes: length_bytes };
    let first = SglDescriptor::from_dptr(dptr);
    match first.kind() {
        SglDescriptorType::DataBlock => walk.data_block(&first)?,
        SglDescriptorType::Segment | SglDescriptorType::LastSegment => walk.follow(dma, first)?,
        _ => return Err(generic(codes::SGL_DESCRIPTOR_TYPE_INVALID)),
    }
    if walk.total_bytes != length_bytes {
        return Err(generic(codes::DATA_SGL_LENGTH_INVALID));
    }
    Ok(())
}

#[cfg(test)]
thread_local! {
    /// Sets of visited segments `SglWalk::follow` made on this thread (a test of when it makes one).
    static LOOP_SETS_MADE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

struct SglWalk<'a, F> {
    sink: &'a mut F,
    total_bytes: u64,
    expected_bytes: u64,
}

impl<F: FnMut(u64, u64) -> Result<(), NvmeStatus>> SglWalk<'_, F> {
    fn data_block(&mut self, descriptor: &SglDescriptor) -> Result<(), NvmeStatus> {
        // Sub type 1 (offset addressing) is for fabrics; on PCIe only addresses are valid.
        if descriptor.subtype() != 0 {
            return Err(generic(codes::SGL_DESCRIPTOR_TYPE_INVALID));
        }
        let len = u64::from(descriptor.length);
        let total = self.total_bytes.checked_add(len).filter(|&total| total <= self.expected_bytes);
        self.total_bytes = total.ok_or(generic(codes::DATA_SGL_LENGTH_INVALID))?;
        if len > 0 {
            (self.sink)(descriptor.address, len)?;
        }
        Ok(())
    }

    fn follow(&mut self, dma: &HostAccess<'_>, mut segment: SglDescriptor) -> Result<(), NvmeStatus> {
        // The segments visited, to find a loop: made only at the second hop, since a Last
        // Segment (the driver's SGL for every command of more than one piece) ends the walk at
        // the first, and the set's first insert is a heap allocation, one per I/O otherwise.
        let first_address = segment.address;
        let mut visited: Option<HashSet<u64>> = None;
        let mut descriptors_seen = 0u64;
        // Each hop reads at least one descriptor, so the descriptor bound bounds the hops.
        for hop in 0..MAX_SGL_DESCRIPTORS {
            if segment.subtype() != 0 {
                return Err(generic(codes::SGL_DESCRIPTOR_TYPE_INVALID));
            }
            let segment_bytes = u64::from(segment.length);
            if segment_bytes == 0 || segment_bytes % SGL_DESCRIPTOR_BYTES as u64 != 0 {
                return Err(generic(codes::INVALID_SGL_DESCRIPTOR_COUNT));
            }
            let count = segment_bytes / SGL_DESCRIPTOR_BYTES as u64;
            descriptors_seen += count;
            if descriptors_seen > MAX_SGL_DESCRIPTORS {
                return Err(generic(codes::INVALID_SGL_DESCRIPTOR_COUNT));
            }
            if hop > 0 {
                let visited = visited.get_or_insert_with(|| {
                    #[cfg(test)]
                    LOOP_SETS_MADE.with(|made| made.set(made.get() + 1));
                    HashSet::from([first_address])
                });
                if !visited.insert(segment.address) {
                    return Err(generic(codes::INVALID_SGL_SEGMENT_DESCRIPTOR));
                }
            }
            let last = segment.kind() == SglDescriptorType::LastSegment;
            let next = self.read_segment(dma, segment.address, count, last)?;
            match (last, next) {
                (true, _) => return Ok(()),
                (false, Some(next)) => segment = next,
                // A Segment must end with a descriptor pointing to the next segment.
                (false, None) => return Err(generic(codes::INVALID_SGL_SEGMENT_DESCRIPTOR)),
            }
        }
        Err(generic(codes::INVALID_SGL_DESCRIPTOR_COUNT))
    }

    /// Reads one segment of `count` descriptors; returns the chained segment descriptor, if any.
    fn read_segment(&mut self, dma: &HostAccess<'_>, address: u64, count: u64, last: bool) -> Result<Option<SglDescriptor>, NvmeStatus> {
        let transfer_error = generic(codes::DATA_TRANSFER_ERROR);
        let bytes = usize::try_from(count * SGL_DESCRIPTOR_BYTES as u64).map_err(|_| transfer_error)?;
        let region = dma.translate(address, bytes)?;
        let mut chunk = [0u8; 4096];
        let per_chunk = (chunk.len() / SGL_DESCRIPTOR_BYTES) as u64;
        let mut next = None;
        let mut index = 0u64;
        // Bounded by `count` descriptors, read 256 at a time.
        while index < count {
            let batch = per_chunk.min(count - index);
            let raw = &mut chunk[..batch as usize * SGL_DESCRIPTOR_BYTES];
            region.read(index as usize * SGL_DESCRIPTOR_BYTES, raw).map_err(|_| transfer_error)?;
            for (offset, bytes) in raw.chunks_exact(SGL_DESCRIPTOR_BYTES).enumerate() {
                let mut array = [0u8; SGL_DESCRIPTOR_BYTES];
                array.copy_from_slice(bytes);
                let descriptor = SglDescriptor::from_bytes(&array);
                let position = index + offset as u64;
                match descriptor.kind() {
                    SglDescriptorType::DataBlock => self.data_block(&descriptor)?,
                    SglDescriptorType::Segment | SglDescriptorType::LastSegment => {
                        // Only the last descriptor of a (non-last) segment may chain on.
                        if last || position + 1 != count {
                            return Err(generic(codes::INVALID_SGL_SEGMENT_DESCRIPTOR));
                        }
                        next = Some(descriptor);
                    }
                    // Bit Bucket is optional (SGLS bit 16 clear); keyed and transport data
                    // blocks belong to fabrics.
                    _ => return Err(generic(codes::SGL_DESCRIPTOR_TYPE_INVALID)),
                }
            }
            index += batch;
        }
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use nvme_driver::hw::{DmaAllocator, DmaPool};
    use nvme_driver::spec::command::DataPointerKind;

    /// The (address, length) pieces a PRP walk hands out, collected.
    fn prp_ranges(dma: &HostAccess<'_>, prp1: u64, prp2: u64, length_bytes: u64) -> Result<Vec<(u64, u64)>, NvmeStatus> {
        let mut ranges = Vec::new();
        walk_prp(dma, prp1, prp2, length_bytes, &mut |iova, len| {
            ranges.push((iova, len));
            Ok(())
        })?;
        Ok(ranges)
    }

    /// The (address, length) pieces an SGL walk hands out, collected.
    fn sgl_ranges(dma: &HostAccess<'_>, dptr: [u64; 2], length_bytes: u64) -> Result<Vec<(u64, u64)>, NvmeStatus> {
        let mut ranges = Vec::new();
        walk_sgl(dma, dptr, length_bytes, &mut |iova, len| {
            ranges.push((iova, len));
            Ok(())
        })?;
        Ok(ranges)
    }

    fn put_u64s(region: &DmaRegion, offset: usize, values: &[u64]) {
        for (index, value) in values.iter().enumerate() {
            region.write(offset + index * 8, &value.to_le_bytes()).unwrap();
        }
    }

    #[test]
    fn prp_list_chains_across_pages() {
        // Goal: a list that starts near the end of a page chains to the next list page.
        let dma = DmaPool::identity();
        let data = dma.allocate(8 * 4096).unwrap();
        let lists = dma.allocate(2 * 4096).unwrap();
        let base = data.iova().0;
        // List starts at the second-to-last slot of page 0: one data entry, then a chain pointer.
        let list_start = lists.iova().checked_add(4096 - 16).unwrap().0;
        put_u64s(&lists, 4096 - 16, &[base + 4096, lists.iova().checked_add(4096).unwrap().0]);
        put_u64s(&lists, 4096, &[base + 2 * 4096, base + 3 * 4096]);
        let ranges = prp_ranges(&HostAccess::new(&dma, None), base + 512, list_start, 4096 - 512 + 3 * 4096).unwrap();
        assert_eq!(ranges, vec![(base + 512, 3584), (base + 4096, 4096), (base + 8192, 4096), (base + 12288, 4096)]);
        // Resolved, the pieces that continue each other are one region.
        let entry = SubmissionEntry { dptr: [base + 512, list_start], ..SubmissionEntry::default() };
        let buffers = resolve(&HostAccess::new(&dma, None), &entry, 4096 - 512 + 3 * 4096, false, Vec::new()).unwrap();
        let regions: Vec<_> = buffers.regions.iter().map(|region| (region.iova().0, region.len())).collect();
        assert_eq!(regions, vec![(base + 512, 3584 + 3 * 4096)]);
        assert!(buffers.copied.is_empty());
        // Offsets: PRP2 as a page pointer must be aligned; PRP1 must be dword aligned.
        assert_eq!(prp_ranges(&HostAccess::new(&dma, None), base, base + 8, 8192), Err(NvmeStatus::generic(codes::INVALID_PRP_OFFSET)));
        assert_eq!(prp_ranges(&HostAccess::new(&dma, None), base + 2, base, 8192), Err(NvmeStatus::generic(codes::INVALID_PRP_OFFSET)));
        // A list entry with an offset.
        put_u64s(&lists, 0, &[base + 100, base + 8192]);
        assert_eq!(
            prp_ranges(&HostAccess::new(&dma, None), base, lists.iova().0, 3 * 4096),
            Err(NvmeStatus::generic(codes::INVALID_PRP_OFFSET))
        );
        // A list in unmapped memory.
        assert_eq!(prp_ranges(&HostAccess::new(&dma, None), base, 0x1000, 3 * 4096), Err(NvmeStatus::generic(codes::DATA_TRANSFER_ERROR)));
    }

    #[test]
    fn sgl_segments_loops_and_lengths() {
        // Goal: valid chains resolve; loops, bad types and length mismatches get their status.
        let dma = DmaPool::identity();
        let data = dma.allocate(4 * 4096).unwrap();
        let segs = dma.allocate(4096).unwrap();
        let base = data.iova().0;
        let seg = segs.iova().0;
        let write_descriptors = |offset: usize, descriptors: &[SglDescriptor]| {
            for (index, descriptor) in descriptors.iter().enumerate() {
                segs.write(offset + index * 16, &descriptor.to_bytes()).unwrap();
            }
        };
        // Segment(2) -> [data 100, LastSegment(1) -> [data 28]]
        write_descriptors(0, &[SglDescriptor::data_block(base, 100), SglDescriptor::last_segment(seg + 256, 1)]);
        write_descriptors(256, &[SglDescriptor::data_block(base + 4096, 28)]);
        let head = SglDescriptor::segment(seg, 2).to_dptr();
        assert_eq!(sgl_ranges(&HostAccess::new(&dma, None), head, 128).unwrap(), vec![(base, 100), (base + 4096, 28)]);
        assert_eq!(sgl_ranges(&HostAccess::new(&dma, None), head, 129), Err(NvmeStatus::generic(codes::DATA_SGL_LENGTH_INVALID)));
        assert_eq!(sgl_ranges(&HostAccess::new(&dma, None), head, 127), Err(NvmeStatus::generic(codes::DATA_SGL_LENGTH_INVALID)));
        // A loop: Segment -> itself.
        write_descriptors(512, &[SglDescriptor::data_block(base, 1), SglDescriptor::segment(seg + 512, 2)]);
        let looped = SglDescriptor::segment(seg + 512, 2).to_dptr();
        assert_eq!(
            sgl_ranges(&HostAccess::new(&dma, None), looped, 1 << 20),
            Err(NvmeStatus::generic(codes::INVALID_SGL_SEGMENT_DESCRIPTOR))
        );
        // Bit bucket and unknown types.
        let bucket = SglDescriptor::new(SglDescriptorType::BitBucket, 0, 10).to_dptr();
        assert_eq!(sgl_ranges(&HostAccess::new(&dma, None), bucket, 10), Err(NvmeStatus::generic(codes::SGL_DESCRIPTOR_TYPE_INVALID)));
        let other = SglDescriptor::new(SglDescriptorType::Other(0xE), base, 10).to_dptr();
        assert_eq!(sgl_ranges(&HostAccess::new(&dma, None), other, 10), Err(NvmeStatus::generic(codes::SGL_DESCRIPTOR_TYPE_INVALID)));
        // Segment length not a multiple of 16; segment in unmapped memory.
        let ragged = SglDescriptor::new(SglDescriptorType::LastSegment, seg, 17).to_dptr();
        assert_eq!(sgl_ranges(&HostAccess::new(&dma, None), ragged, 10), Err(NvmeStatus::generic(codes::INVALID_SGL_DESCRIPTOR_COUNT)));
        let nowhere = SglDescriptor::last_segment(0x2000, 1).to_dptr();
        assert_eq!(sgl_ranges(&HostAccess::new(&dma, None), nowhere, 10), Err(NvmeStatus::generic(codes::DATA_TRANSFER_ERROR)));
        // A segment descriptor inside a last segment.
        write_descriptors(768, &[SglDescriptor::last_segment(seg, 1)]);
        let nested = SglDescriptor::last_segment(seg + 768, 1).to_dptr();
        assert_eq!(sgl_ranges(&HostAccess::new(&dma, None), nested, 10), Err(NvmeStatus::generic(codes::INVALID_SGL_SEGMENT_DESCRIPTOR)));
        // A loop back to the first segment: Segment A -> Segment B -> A.
        write_descriptors(1024, &[SglDescriptor::data_block(base, 1), SglDescriptor::segment(seg + 1280, 2)]);
        write_descriptors(1280, &[SglDescriptor::data_block(base, 1), SglDescriptor::segment(seg + 1024, 2)]);
        let back = SglDescriptor::segment(seg + 1024, 2).to_dptr();
        assert_eq!(
            sgl_ranges(&HostAccess::new(&dma, None), back, 1 << 20),
            Err(NvmeStatus::generic(codes::INVALID_SGL_SEGMENT_DESCRIPTOR))
        );
    }

    #[test]
    fn a_last_segment_resolves_without_the_set_of_visited_segments() {
        // Goal: the SGL the driver sends for every command of more than one piece, a Last
        // Segment of data blocks, resolves without making the set that finds loops (a heap
        // allocation per I/O, against the no-per-I/O-allocation rule); a chain of two segments
        // or more makes it. Until 2026-12-01 the set's first insert, at the first segment,
        // allocated for a Last Segment too. (A counting allocator would be the direct test, but
        // the crate forbids unsafe code: `LOOP_SETS_MADE` counts the set's creations.)
        let dma = DmaPool::identity();
        let data = dma.allocate(2 * 4096).unwrap();
        let segs = dma.allocate(4096).unwrap();
        let base = data.iova().0;
        for (index, descriptor) in [SglDescriptor::data_block(base, 4096), SglDescriptor::data_block(base + 4096, 4096)].iter().enumerate()
        {
            segs.write(index * 16, &descriptor.to_bytes()).unwrap();
        }
        let dptr = SglDescriptor::last_segment(segs.iova().0, 2).to_dptr();
        let made_before = LOOP_SETS_MADE.with(Cell::get);
        assert_eq!(sgl_ranges(&HostAccess::new(&dma, None), dptr, 2 * 4096).unwrap(), vec![(base, 4096), (base + 4096, 4096)]);
        assert_eq!(LOOP_SETS_MADE.with(Cell::get), made_before, "resolving a Last Segment made the set of visited segments");
        // A chain of two segments makes it (the counter counts).
        segs.write(0, &SglDescriptor::data_block(base, 4096).to_bytes()).unwrap();
        segs.write(16, &SglDescriptor::last_segment(segs.iova().0 + 256, 1).to_bytes()).unwrap();
        segs.write(256, &SglDescriptor::data_block(base + 4096, 4096).to_bytes()).unwrap();
        let chained = SglDescriptor::segment(segs.iova().0, 2).to_dptr();
        assert_eq!(sgl_ranges(&HostAccess::new(&dma, None), chained, 2 * 4096).unwrap(), vec![(base, 4096), (base + 4096, 4096)]);
        assert_eq!(LOOP_SETS_MADE.with(Cell::get), made_before + 1);
    }

    #[test]
    fn a_short_range_across_two_adjacent_mappings_resolves_per_mapping() {
        // Goal: pieces that continue each other across two separate mappings adjacent in IOVA
        // space (the pool's allocator leaves no gap) resolve into one region per mapping, however
        // short the merged range. Until 2026-12-01 only a merged range longer than a page was
        // retried page by page: one of a page or less that crossed a page boundary (PRP1 in the
        // middle of one buffer, PRP2 the next) failed with Data Transfer Error.
        let dma = DmaPool::identity();
        let first = dma.allocate(4096).unwrap();
        let second = dma.allocate(4096).unwrap();
        let segs = dma.allocate(4096).unwrap();
        let (a, b) = (first.iova().0, second.iova().0);
        assert_eq!(a + 4096, b, "the pool handed out IOVAs with a gap: the test needs adjacent ones");
        let regions = |buffers: &DataBuffers| buffers.regions.iter().map(|region| (region.iova().0, region.len())).collect::<Vec<_>>();
        // PRP: half a page at the end of one buffer, half at the start of the next.
        let entry = SubmissionEntry { dptr: [a + 2048, b], ..SubmissionEntry::default() };
        let buffers = resolve(&HostAccess::new(&dma, None), &entry, 4096, false, Vec::new()).unwrap();
        assert_eq!(regions(&buffers), vec![(a + 2048, 2048), (b, 2048)]);
        // SGL: a Last Segment of two data blocks, 196 bytes in all, across the same boundary.
        segs.write(0, &SglDescriptor::data_block(a + 4000, 96).to_bytes()).unwrap();
        segs.write(16, &SglDescriptor::data_block(b, 100).to_bytes()).unwrap();
        let mut entry = SubmissionEntry { dptr: SglDescriptor::last_segment(segs.iova().0, 2).to_dptr(), ..SubmissionEntry::default() };
        entry.set_data_pointer_kind(DataPointerKind::Sgl);
        let buffers = resolve(&HostAccess::new(&dma, None), &entry, 196, true, Vec::new()).unwrap();
        assert_eq!(regions(&buffers), vec![(a + 4000, 96), (b, 100)]);
        // The data lands where the pointer said.
        buffers.scatter(&[7u8; 196]).unwrap();
        let (mut end_of_first, mut start_of_second) = ([0u8; 96], [0u8; 100]);
        first.read(4000, &mut end_of_first).unwrap();
        second.read(0, &mut start_of_second).unwrap();
        assert_eq!((end_of_first, start_of_second), ([7u8; 96], [7u8; 100]));
    }
}
