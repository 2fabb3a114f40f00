//! Data pointers for one command: PRP entries and lists (§4.1.1), SGL descriptors (§4.1.2), and
//! how a transfer is cut into commands no larger than MDTS.
//!
//! A transfer is a list of [`DataSegment`]s (device-visible address + length) that together cover
//! one contiguous LBA range. [`plan_command`] finds how much of it the next command can carry;
//! [`build_data_pointer`] writes DPTR and, when needed, the PRP list or SGL segment into the
//! command's scratch page. Neither allocates.

use crate::error::NvmeError;
use crate::hw::{DmaRegion, HwError};
use crate::spec::command::DataPointerKind;
use crate::spec::data_pointer::{SglDescriptor, PRP_ENTRY_BYTES, SGL_DESCRIPTOR_BYTES};
use crate::spec::SubmissionEntry;
use crate::types::Iova;

/// Bytes of the per-command scratch page that holds a PRP list or an SGL segment.
pub const SCRATCH_BYTES: usize = 4096;
/// Memory page size the driver configures (CC.MPS = 0).
pub const PAGE_BYTES: u64 = 4096;
/// Most PRP entries a list page holds; one list page per command, so transfers stay <= 2 MiB.
pub const PRP_LIST_ENTRIES_MAX: usize = SCRATCH_BYTES / PRP_ENTRY_BYTES;
/// The most one command carries in either mode: one PRP list page of pages (2 MiB). MDTS may
/// bound it further; the controller's `max_transfer_bytes` never exceeds it.
pub const TRANSFER_BYTES_MAX: u64 = PRP_LIST_ENTRIES_MAX as u64 * PAGE_BYTES;
/// Most SGL Data Block descriptors in one command's Last Segment.
pub const SGL_DESCRIPTORS_MAX: usize = SCRATCH_BYTES / SGL_DESCRIPTOR_BYTES;

/// [`NvmeError::UnsupportedLayout`]'s reason for a segment whose bytes would run past the last
/// device address (untrusted input: the sum must not wrap to a low address).
const ADDRESS_WRAPS: &str = "segment runs past the end of the device address space";

/// One command's scratch page: a borrowed window of its queue's scratch region (no reference
/// count is touched per command).
#[derive(Debug, Clone, Copy)]
pub struct ScratchPage<'a> {
    region: &'a DmaRegion,
    offset: usize,
    /// `region.iova() + offset`, computed (checked) when the page is made.
    iova: Iova,
}

impl<'a> ScratchPage<'a> {
    /// The page at `offset` of `region`; [`HwError::OutOfRange`] unless `region` holds
    /// `offset + SCRATCH_BYTES` bytes (a page past the region would hand the controller an
    /// address of memory nobody reserved for this command).
    #[inline]
    pub fn new(region: &'a DmaRegion, offset: usize) -> Result<Self, HwError> {
        let out_of_range = || HwError::OutOfRange { offset, access_len: SCRATCH_BYTES, region_len: region.len() };
        if offset.checked_add(SCRATCH_BYTES).is_none_or(|end| end > region.len()) {
            return Err(out_of_range());
        }
        let iova = region.iova().checked_add_usize(offset).ok_or_else(out_of_range)?;
        Ok(Self { region, offset, iova })
    }

    /// Device address of the page.
    #[inline]
    pub fn iova(&self) -> Iova {
        self.iova
    }

    /// Copies `bytes` into the page at `at`; never past the page.
    #[inline]
    pub fn write(&self, at: usize, bytes: &[u8]) -> Result<(), HwError> {
        if at.checked_add(bytes.len()).is_none_or(|end| end > SCRATCH_BYTES) {
            return Err(HwError::OutOfRange { offset: at, access_len: bytes.len(), region_len: SCRATCH_BYTES });
        }
        self.region.write(self.offset + at, bytes)
    }
}

/// A piece of a transfer's memory, in the device's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataSegment {
    pub iova: Iova,
    pub len: u32,
}

impl DataSegment {
    #[inline]
    pub fn new(iova: Iova, len: u32) -> Self {
        Self { iova, len }
    }

    /// The whole of a DMA region (lengths above 4 GiB are not representable in one segment).
    pub fn of(region: &DmaRegion) -> Self {
        Self { iova: region.iova(), len: region.len().min(u32::MAX as usize) as u32 }
    }
}

/// How commands describe their memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPointerMode {
    /// PRP entries / lists: every segment but the first must start on a page, every segment but
    /// the last must end on one.
    Prp,
    /// SGL Data Block descriptors: any dword-aligned segments (of whole dwords on a pair whose
    /// controller requires that, Identify SGLS bits 1:0 = 10b).
    Sgl,
}

impl DataPointerMode {
    pub fn name(self) -> &'static str {
        match self {
            DataPointerMode::Prp => "PRP",
            DataPointerMode::Sgl => "SGL",
        }
    }
}

/// A position inside a transfer: segment index and byte offset within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cursor {
    pub segment: usize,
    pub offset: u32,
}

/// What the next command carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandPlan {
    pub start: Cursor,
    pub end: Cursor,
    pub bytes: u64,
}

fn is_page_aligned(address: u64) -> bool {
    address.is_multiple_of(PAGE_BYTES)
}

/// The plan of a transfer that is one command as it stands — one segment of whole blocks, at
/// most `max_bytes`, dword aligned, not running past the last address and, for PRP, within one
/// list page — without [`plan_command`]'s general walk: the common case of the hot path. `None`
/// means "not that case": ask [`plan_command`], which then decides (and reports any error).
/// Whenever this returns a plan, it is the one [`plan_command`] returns from the start.
pub fn plan_single_command(segments: &[DataSegment], max_bytes: u64, block_bytes: u32, mode: DataPointerMode) -> Option<CommandPlan> {
    let [segment] = segments else { return None };
    let bytes = u64::from(segment.len);
    let address = segment.iova.0;
    if bytes == 0 || bytes > max_bytes || !bytes.is_multiple_of(u64::from(block_bytes)) || !address.is_multiple_of(4) {
        return None;
    }
    let end = segment.iova.checked_end(bytes)?.0;
    if mode == DataPointerMode::Prp && end.div_ceil(PAGE_BYTES) - address / PAGE_BYTES > PRP_LIST_ENTRIES_MAX as u64 + 1 {
        return None;
    }
    Some(CommandPlan { start: Cursor::default(), end: Cursor { segment: 1, offset: 0 }, bytes })
}

/// The first byte of data at or after `cursor`, past exhausted and empty segments; `None` when
/// no data remains.
#[inline]
pub(crate) fn next_data(segments: &[DataSegment], mut cursor: Cursor) -> Option<Cursor> {
    while let Some(segment) = segments.get(cursor.segment) {
        if cursor.offset < segment.len {
            return Some(cursor);
        }
        cursor = Cursor { segment: cursor.segment + 1, offset: 0 };
    }
    None
}

/// Plans the next command from `start`: at most `max_bytes`, a multiple of `block_bytes`, within
/// the mode's descriptor limits. Returns `None` when the transfer is exhausted.
pub fn plan_command(
    segments: &[DataSegment],
    start: Cursor,
    max_bytes: u64,
    block_bytes: u32,
    mode: DataPointerMode,
) -> Result<Option<CommandPlan>, NvmeError> {
    let block_bytes = u64::from(block_bytes);
    let Some(start) = next_data(segments, start) else { return Ok(None) };
    let mut cursor = start;
    let mut bytes = 0u64;
    let mut descriptors = 0usize;
    // Pages touched, for PRP (PRP1 + list entries).
    let mut prp_pages = 0usize;
    while let Some(segment) = segments.get(cursor.segment) {
        if cursor.offset >= segment.len {
            // An empty segment holds no byte: nothing of it is checked or described (its
            // address may be anything).
            cursor = Cursor { segment: cursor.segment + 1, offset: 0 };
            continue;
        }
        // A segment that wraps past the last address is no memory at all. Once its end is known
        // to be an address, every sum below (address + bytes taken from it) stays at or under it.
        let (Some(address), Some(_end)) =
            (segment.iova.checked_add(u64::from(cursor.offset)), segment.iova.checked_end(u64::from(segment.len)))
        else {
            return Err(NvmeError::UnsupportedLayout { index: cursor.segment, reason: ADDRESS_WRAPS, mode: mode.name() });
        };
        let address = address.0;
        let available = u64::from(segment.len - cursor.offset);
        let first = bytes == 0;
        if address % 4 != 0 {
            return Err(NvmeError::UnsupportedLayout { index: cursor.segment, reason: "address not dword aligned", mode: mode.name() });
        }
        let mut take = available.min(max_bytes - bytes);
        match mode {
            DataPointerMode::Sgl => {
                if descriptors == SGL_DESCRIPTORS_MAX {
                    break;
                }
                if take % 4 != 0 && take < available {
                    take -= take % 4;
                }
            }
            DataPointerMode::Prp => {
                if !first && !is_page_aligned(address) {
                    return Err(NvmeError::UnsupportedLayout {
                        index: cursor.segment,
                        reason: "segment does not start on a page",
                        mode: mode.name(),
                    });
                }
                // A cut inside this segment may fall anywhere: the piece it ends is this
                // command's last, and the next command's PRP1 may carry any dword offset (the
                // block-boundary back-off below keeps it dword aligned). Only where two segments
                // join inside one command must the earlier one end on a page.
                // (Empty segments after this one join nothing.)
                if take == available
                    && !is_page_aligned(address + take)
                    && next_data(segments, Cursor { segment: cursor.segment + 1, offset: 0 }).is_some()
                {
                    return Err(NvmeError::UnsupportedLayout {
                        index: cursor.segment,
                        reason: "segment does not end on a page",
                        mode: mode.name(),
                    });
                }
                let pages = ((address + take).div_ceil(PAGE_BYTES) - address / PAGE_BYTES) as usize;
                // PRP1 + one list page of entries (a two-page transfer uses PRP2 directly).
                if prp_pages + pages > PRP_LIST_ENTRIES_MAX + 1 {
                    let room = PRP_LIST_ENTRIES_MAX + 1 - prp_pages;
                    // Up to the end of the room-th page from the one holding `address`.
                    take = (room as u64 * PAGE_BYTES).saturating_sub(address % PAGE_BYTES).min(take);
                }
                if take > 0 {
                    prp_pages += ((address + take).div_ceil(PAGE_BYTES) - address / PAGE_BYTES) as usize;
                }
            }
        }
        if take == 0 {
            break;
        }
        bytes += take;
        descriptors += 1;
        let new_offset = u64::from(cursor.offset) + take;
        cursor = if new_offset == u64::from(segment.len) {
            Cursor { segment: cursor.segment + 1, offset: 0 }
        } else {
            Cursor { segment: cursor.segment, offset: new_offset as u32 }
        };
        if bytes == max_bytes || take < available {
            break;
        }
    }
    // A command carries whole blocks; a transfer that is not whole blocks is a caller error.
    let remainder = bytes % block_bytes;
    if remainder != 0 {
        let more_follows = next_data(segments, cursor).is_some();
        if !more_follows {
            return Err(NvmeError::UnalignedTransfer { bytes, block_size_bytes: block_bytes as u32 });
        }
        // Back the cut off to a block boundary (both modes). The command only shrinks: MDTS and
        // the descriptor limits still hold, and its (new) last piece may end anywhere.
        cursor = back_off(segments, cursor, remainder);
        bytes -= remainder;
    }
    if bytes == 0 {
        return Err(NvmeError::UnalignedTransfer { bytes, block_size_bytes: block_bytes as u32 });
    }
    Ok(Some(CommandPlan { start, end: cursor, bytes }))
}

fn back_off(segments: &[DataSegment], mut cursor: Cursor, mut bytes: u64) -> Cursor {
    while bytes > 0 {
        if cursor.offset == 0 {
            cursor.segment -= 1;
            cursor.offset = segments[cursor.segment].len;
        }
        let step = bytes.min(u64::from(cursor.offset));
        cursor.offset -= step as u32;
        bytes -= step;
    }
    cursor
}

/// Visits the (segment index, address, length) pieces of a plan in order; `address + length`
/// never overflows (a piece that would is [`NvmeError::UnsupportedLayout`], as [`plan_command`]
/// reports it).
fn for_each_piece(
    segments: &[DataSegment],
    plan: &CommandPlan,
    mode: DataPointerMode,
    mut visit: impl FnMut(usize, u64, u64),
) -> Result<(), NvmeError> {
    let mut cursor = plan.start;
    let mut remaining = plan.bytes;
    while remaining > 0 {
        let Some(segment) = segments.get(cursor.segment) else { return Ok(()) };
        let available = u64::from(segment.len.saturating_sub(cursor.offset)).min(remaining);
        if available > 0 {
            let address = segment.iova.checked_add(u64::from(cursor.offset)).filter(|start| start.checked_end(available).is_some());
            let address =
                address.ok_or_else(|| NvmeError::UnsupportedLayout { index: cursor.segment, reason: ADDRESS_WRAPS, mode: mode.name() })?;
            visit(cursor.segment, address.0, available);
        }
        remaining -= available;
        cursor = Cursor { segment: cursor.segment + 1, offset: 0 };
    }
    Ok(())
}

/// Writes DPTR (and the scratch page when needed) for `plan`; `scratch` is the command slot's page.
/// A PRP plan covering more pages than PRP1 and one list page describe (513; [`plan_command`]
/// never makes one) is [`NvmeError::UnsupportedLayout`].
pub fn build_data_pointer(
    entry: &mut SubmissionEntry,
    segments: &[DataSegment],
    plan: &CommandPlan,
    mode: DataPointerMode,
    scratch: ScratchPage<'_>,
) -> Result<(), NvmeError> {
    if build_single_piece_data_pointer(entry, segments, plan, mode) {
        return Ok(());
    }
    build_data_pointer_from_pieces(entry, segments, plan, mode, scratch)
}

/// The common case of [`build_data_pointer`] without its piece walk: a plan that lies inside one
/// segment and needs no list (one SGL Data Block descriptor, or at most two PRP entries). Writes
/// exactly what the walk would and returns true; returns false, writing nothing, otherwise.
fn build_single_piece_data_pointer(
    entry: &mut SubmissionEntry,
    segments: &[DataSegment],
    plan: &CommandPlan,
    mode: DataPointerMode,
) -> bool {
    let Some(segment) = segments.get(plan.start.segment) else { return false };
    if u64::from(segment.len.saturating_sub(plan.start.offset)) < plan.bytes || plan.bytes == 0 {
        return false;
    }
    // The same address checks as the walk: a piece whose end is no address takes the walk,
    // which reports it.
    let Some(address) = segment.iova.checked_add(u64::from(plan.start.offset)) else { return false };
    let Some(end) = address.checked_end(plan.bytes) else { return false };
    let (address, end) = (address.0, end.0);
    match mode {
        DataPointerMode::Sgl => {
            let Ok(len) = u32::try_from(plan.bytes) else { return false };
            entry.set_data_pointer_kind(DataPointerKind::Sgl);
            entry.dptr = SglDescriptor::data_block(address, len).to_dptr();
        }
        DataPointerMode::Prp => {
            // The page after the first, when the transfer reaches into it; more pages need a
            // list. No page starts past the last address: a transfer in the top page ends there.
            let second = match (address / PAGE_BYTES + 1).checked_mul(PAGE_BYTES) {
                Some(second_page) if end > second_page => {
                    if end - second_page > PAGE_BYTES {
                        return false;
                    }
                    second_page
                }
                _ => 0,
            };
            entry.set_data_pointer_kind(DataPointerKind::Prp);
            entry.dptr = [address, second];
        }
    }
    true
}

/// [`build_data_pointer`]'s general case: walks the plan's pieces, writing a PRP list or SGL
/// segment into the scratch page when one descriptor does not do.
fn build_data_pointer_from_pieces(
    entry: &mut SubmissionEntry,
    segments: &[DataSegment],
    plan: &CommandPlan,
    mode: DataPointerMode,
    scratch: ScratchPage<'_>,
) -> Result<(), NvmeError> {
    // Descriptors go straight into the scratch page as they are produced: no 4 KiB staging copy.
    let mut failure = None;
    let mut record = |result: Result<(), HwError>| {
        if let Err(error) = result {
            failure.get_or_insert(error);
        }
    };
    match mode {
        DataPointerMode::Sgl => {
            entry.set_data_pointer_kind(DataPointerKind::Sgl);
            let mut count = 0usize;
            let mut first = SglDescriptor::default();
            for_each_piece(segments, plan, mode, |_, address, len| {
                let descriptor = SglDescriptor::data_block(address, len as u32);
                match count {
                    0 => first = descriptor,
                    1 => {
                        record(scratch.write(0, &first.to_bytes()));
                        record(scratch.write(SGL_DESCRIPTOR_BYTES, &descriptor.to_bytes()));
                    }
                    _ => record(scratch.write(count * SGL_DESCRIPTOR_BYTES, &descriptor.to_bytes())),
                }
                count += 1;
            })?;
            entry.dptr = if count <= 1 { first.to_dptr() } else { SglDescriptor::last_segment(scratch.iova().0, count as u32).to_dptr() };
        }
        DataPointerMode::Prp => {
            entry.set_data_pointer_kind(DataPointerKind::Prp);
            let mut count = 0usize;
            let mut first_two = [0u64; 2];
            // The segment holding the first page PRP1 and one list page cannot describe.
            let mut overflow = None;
            for_each_piece(segments, plan, mode, |segment, address, len| {
                // The first entry may carry an offset; every later one is a page start.
                let mut page = if count == 0 { address } else { address / PAGE_BYTES * PAGE_BYTES };
                let end = address + len; // for_each_piece checked that this is an address
                while page < end {
                    if count > PRP_LIST_ENTRIES_MAX {
                        // `plan_command` never plans this; a hand-made plan can (the function
                        // is public). Stopping here silently would leave the command's NLB
                        // covering pages its PRPs do not, and the controller would take the
                        // last list entry for a pointer to a next list page (§4.1.1).
                        overflow.get_or_insert(segment);
                        break;
                    }
                    match count {
                        0 | 1 => first_two[count] = page,
                        2 => {
                            record(scratch.write(0, &first_two[1].to_le_bytes()));
                            record(scratch.write(PRP_ENTRY_BYTES, &page.to_le_bytes()));
                        }
                        _ => record(scratch.write((count - 1) * PRP_ENTRY_BYTES, &page.to_le_bytes())),
                    }
                    count += 1;
                    // No page starts past the last address, so none is left below `end` either.
                    let Some(next) = (page / PAGE_BYTES + 1).checked_mul(PAGE_BYTES) else { break };
                    page = next;
                }
            })?;
            if let Some(index) = overflow {
                return Err(NvmeError::UnsupportedLayout { index, reason: "more pages than one PRP list page holds", mode: mode.name() });
            }
            entry.dptr[0] = first_two[0];
            entry.dptr[1] = match count {
                0 | 1 => 0,
                2 => first_two[1],
                _ => scratch.iova().0,
            };
        }
    }
    if let Some(error) = failure {
        return Err(error.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(iova: u64, len: u32) -> DataSegment {
        DataSegment::new(Iova(iova), len)
    }

    fn plans(segments: &[DataSegment], max: u64, block: u32, mode: DataPointerMode) -> Result<Vec<CommandPlan>, NvmeError> {
        let mut cursor = Cursor::default();
        let mut out = Vec::new();
        while let Some(plan) = plan_command(segments, cursor, max, block, mode)? {
            cursor = plan.end;
            out.push(plan);
        }
        Ok(out)
    }

    #[test]
    fn empty_segments_after_the_last_bytes_join_nothing() {
        // Goal: a PRP transfer whose last bytes end mid-page is fine when only empty segments
        // follow (they were counted as a join, and the transfer refused); bytes after it still
        // need the page end.
        let tail_empty = [segment(0x10_0000, 4608), segment(0x20_0000, 0)];
        let planned = plans(&tail_empty, 1 << 20, 512, DataPointerMode::Prp).expect("empty tail");
        assert_eq!(planned.iter().map(|plan| plan.bytes).sum::<u64>(), 4608);
        let joined = [segment(0x10_0000, 4608), segment(0x20_0000, 0), segment(0x30_0000, 512)];
        assert!(matches!(plans(&joined, 1 << 20, 512, DataPointerMode::Prp), Err(NvmeError::UnsupportedLayout { index: 0, .. })));
        // An empty segment anywhere, at any address, is skipped in both modes (one at an address
        // off a page, or off a dword, was refused as if it held data there).
        for mode in [DataPointerMode::Prp, DataPointerMode::Sgl] {
            let scattered = [segment(0x10_0000, 4096), segment(0x20_0003, 0), segment(0x30_0000, 4096), segment(0x40_0006, 0)];
            let planned = plans(&scattered, 1 << 20, 512, mode).expect("empty segments between and after");
            assert_eq!(planned.iter().map(|plan| plan.bytes).sum::<u64>(), 8192, "{mode:?}");
        }
        // A transfer of part blocks is refused naming its bytes, empty tail or not.
        let part = [segment(0x10_0000, 4600), segment(0x20_0000, 0)];
        assert!(matches!(plans(&part, 1 << 20, 512, DataPointerMode::Prp), Err(NvmeError::UnalignedTransfer { bytes: 4600, .. })));
    }

    #[test]
    fn mdts_splits_a_large_transfer() {
        let segments = [segment(0x10_0000, 512 * 1024)];
        for mode in [DataPointerMode::Prp, DataPointerMode::Sgl] {
            let plans = plans(&segments, 128 * 1024, 4096, mode).unwrap();
            assert_eq!(plans.len(), 4);
            assert!(plans.iter().all(|plan| plan.bytes == 128 * 1024));
        }
    }

    #[test]
    fn scattered_buffers_become_one_sgl_command() {
        let segments: Vec<_> = (0..8).map(|index| segment(0x100_0000 + index * 0x10_0000, 4096)).collect();
        let plans = plans(&segments, 1 << 20, 512, DataPointerMode::Sgl).unwrap();
        assert_eq!(plans.len(), 1);
        assert_eq!(plans[0].bytes, 8 * 4096);
    }

    #[test]
    fn prp_rejects_unaligned_middle_segments() {
        let segments = [segment(0x1000, 4096), segment(0x3200, 4096)];
        assert!(matches!(plans(&segments, 1 << 20, 512, DataPointerMode::Prp), Err(NvmeError::UnsupportedLayout { index: 1, .. })));
        let sgl = plans(&segments, 1 << 20, 512, DataPointerMode::Sgl).unwrap();
        assert_eq!(sgl.len(), 1);
    }

    #[test]
    fn transfer_must_be_whole_blocks() {
        let segments = [segment(0x1000, 1000)];
        assert!(matches!(plans(&segments, 1 << 20, 512, DataPointerMode::Sgl), Err(NvmeError::UnalignedTransfer { .. })));
    }

    #[test]
    fn sgl_with_more_descriptors_than_a_page_splits_on_block_boundaries() {
        let segments: Vec<_> = (0..300).map(|index| segment(0x100_0000 + index * 0x2000, 512)).collect();
        let plans = plans(&segments, 1 << 20, 512, DataPointerMode::Sgl).unwrap();
        assert_eq!(plans.len(), 2);
        assert_eq!(plans[0].bytes, 256 * 512);
        assert_eq!(plans[1].bytes, 44 * 512);
    }

    #[test]
    fn prp_offset_first_page_then_list() {
        // Starts 512 bytes into a page: 3 pages touched for 8 KiB.
        let segments = [segment(0x10_0200, 8192)];
        let plans = plans(&segments, 1 << 20, 512, DataPointerMode::Prp).unwrap();
        assert_eq!(plans.len(), 1);
        let pool = crate::hw::DmaPool::identity();
        let scratch = crate::hw::DmaAllocator::allocate(&pool, 4096).unwrap();
        let mut entry = SubmissionEntry::default();
        build_data_pointer(&mut entry, &segments, &plans[0], DataPointerMode::Prp, ScratchPage::new(&scratch, 0).unwrap()).unwrap();
        assert_eq!(entry.dptr[0], 0x10_0200);
        assert_eq!(entry.dptr[1], scratch.iova().0);
        let mut list = [0u8; 16];
        scratch.read(0, &mut list).unwrap();
        assert_eq!(u64::from_le_bytes(list[0..8].try_into().unwrap()), 0x10_1000);
        assert_eq!(u64::from_le_bytes(list[8..16].try_into().unwrap()), 0x10_2000);
    }

    /// The PRP entries `entry` names for a `bytes`-byte command (DPTR, then the list page).
    fn prp_entries(entry: &SubmissionEntry, bytes: u64, scratch: &DmaRegion) -> Vec<u64> {
        let first = entry.dptr[0];
        let pages = ((first % PAGE_BYTES + bytes).div_ceil(PAGE_BYTES)) as usize;
        match pages {
            0 | 1 => vec![first],
            2 => vec![first, entry.dptr[1]],
            _ => {
                assert_eq!(entry.dptr[1], scratch.iova().0, "PRP2 must name the list page");
                let mut entries = vec![first];
                for index in 0..pages - 1 {
                    let mut raw = [0u8; 8];
                    scratch.read(index * PRP_ENTRY_BYTES, &mut raw).unwrap();
                    entries.push(u64::from_le_bytes(raw));
                }
                entries
            }
        }
    }

    /// Plans `segments`, builds every command's DPTR and checks it against the PRP rules: PRP1
    /// dword aligned, every later entry a page start, at most one list page, each command whole
    /// blocks within `max_bytes`, and the entries naming exactly the transfer's bytes in order.
    fn check_prp_plans(segments: &[DataSegment], max_bytes: u64, block: u32) -> Vec<CommandPlan> {
        let plans = plans(segments, max_bytes, block, DataPointerMode::Prp).unwrap();
        let pool = crate::hw::DmaPool::identity();
        let scratch = crate::hw::DmaAllocator::allocate(&pool, SCRATCH_BYTES).unwrap();
        let mut described = Vec::new(); // (address, len) runs, merged when contiguous
        let push = |runs: &mut Vec<(u64, u64)>, address: u64, len: u64| match runs.last_mut() {
            Some((start, run)) if *start + *run == address => *run += len,
            _ => runs.push((address, len)),
        };
        for plan in &plans {
            assert!(plan.bytes > 0 && plan.bytes <= max_bytes && plan.bytes % u64::from(block) == 0, "{plan:?}");
            let mut entry = SubmissionEntry::default();
            build_data_pointer(&mut entry, segments, plan, DataPointerMode::Prp, ScratchPage::new(&scratch, 0).unwrap()).unwrap();
            let entries = prp_entries(&entry, plan.bytes, &scratch);
            assert!(entries.len() <= PRP_LIST_ENTRIES_MAX + 1);
            assert_eq!(entries[0] % 4, 0, "PRP1 not dword aligned");
            let mut left = plan.bytes;
            for (index, &address) in entries.iter().enumerate() {
                assert!(index == 0 || is_page_aligned(address), "PRP entry {index} ({address:#x}) is not a page start");
                let len = (PAGE_BYTES - address % PAGE_BYTES).min(left);
                push(&mut described, address, len);
                left -= len;
            }
            assert_eq!(left, 0, "entries cover less than the command");
        }
        let mut expected = Vec::new();
        for segment in segments.iter().filter(|segment| segment.len > 0) {
            push(&mut expected, segment.iova.0, u64::from(segment.len));
        }
        assert_eq!(described, expected, "the commands do not describe the transfer");
        plans
    }

    #[test]
    fn a_prp_transfer_starting_mid_page_splits_on_block_boundaries() {
        // Goal: without SGL, a buffer starting mid-page with blocks over 512 B and a transfer
        // over MDTS is served (each command's PRP1 carries the offset), not refused.
        let plans = check_prp_plans(&[segment(0x10_0800, 256 << 10)], 128 << 10, 4096);
        assert_eq!(plans.iter().map(|plan| plan.bytes).collect::<Vec<_>>(), [128 << 10, 128 << 10]);
        assert_eq!(plans[1].start, Cursor { segment: 0, offset: 128 << 10 });
        let pool = crate::hw::DmaPool::identity();
        let scratch = crate::hw::DmaAllocator::allocate(&pool, SCRATCH_BYTES).unwrap();
        let mut entry = SubmissionEntry::default();
        build_data_pointer(
            &mut entry,
            &[segment(0x10_0800, 256 << 10)],
            &plans[1],
            DataPointerMode::Prp,
            ScratchPage::new(&scratch, 0).unwrap(),
        )
        .unwrap();
        assert_eq!(entry.dptr[0], 0x10_0800 + (128 << 10));
        // Where one list page is the limit (513 pages from mid-page: 2 MiB + 2 KiB), the cut backs off.
        let plans = check_prp_plans(&[segment(0x10_0800, 4 << 20)], u64::MAX, 4096);
        assert_eq!(plans[0].bytes, 2 << 20);
    }

    #[test]
    fn a_segment_that_wraps_past_the_last_address_is_refused_in_both_modes() {
        // Goal: a segment whose bytes would run past the last device address (addresses come
        // from callers, ultimately from IOCTXs) is a typed error, never a command whose data
        // pointer wrapped around to a low address; a plan made for other segments cannot
        // smuggle such a segment into build_data_pointer either.
        let wrapping = [segment(u64::MAX - 4095, 8192)];
        let pool = crate::hw::DmaPool::identity();
        let scratch = crate::hw::DmaAllocator::allocate(&pool, 4096).unwrap();
        for mode in [DataPointerMode::Prp, DataPointerMode::Sgl] {
            assert!(matches!(plans(&wrapping, 1 << 20, 512, mode), Err(NvmeError::UnsupportedLayout { index: 0, .. })), "{}", mode.name());
            let plan = plans(&[segment(0x10_0000, 8192)], 1 << 20, 512, mode).unwrap()[0];
            let mut entry = SubmissionEntry::default();
            let built = build_data_pointer(&mut entry, &wrapping, &plan, mode, ScratchPage::new(&scratch, 0).unwrap());
            assert!(matches!(built, Err(NvmeError::UnsupportedLayout { index: 0, .. })), "{}: {built:?}", mode.name());
        }
    }

    #[test]
    fn a_prp_plan_with_more_pages_than_one_list_page_holds_is_refused() {
        // Goal: build_data_pointer is public and takes any plan; one covering more pages than
        // PRP1 and one list page describe (513) is a typed error. It used to stop at 513 pages
        // and return Ok: the command's NLB still covered the rest, and a controller moving it
        // takes the last list entry for a pointer to a next list page (a data page), DMAing
        // wherever that page's contents point. A plan of exactly 513 pages is still built.
        let pool = crate::hw::DmaPool::identity();
        let scratch = crate::hw::DmaAllocator::allocate(&pool, SCRATCH_BYTES).unwrap();
        let segments = [segment(0x10_0000, 4 << 20)];
        let plan =
            |bytes: u32| CommandPlan { start: Cursor::default(), end: Cursor { segment: 0, offset: bytes }, bytes: u64::from(bytes) };
        let mut entry = SubmissionEntry::default();
        let built = build_data_pointer(&mut entry, &segments, &plan(4 << 20), DataPointerMode::Prp, ScratchPage::new(&scratch, 0).unwrap());
        assert!(matches!(built, Err(NvmeError::UnsupportedLayout { index: 0, mode: "PRP", .. })), "{built:?}");
        let full = 513 * PAGE_BYTES as u32;
        let mut entry = SubmissionEntry::default();
        build_data_pointer(&mut entry, &segments, &plan(full), DataPointerMode::Prp, ScratchPage::new(&scratch, 0).unwrap()).unwrap();
        assert_eq!(entry.dptr, [0x10_0000, scratch.iova().0]);
        let mut last = [0u8; 8];
        scratch.read((PRP_LIST_ENTRIES_MAX - 1) * PRP_ENTRY_BYTES, &mut last).unwrap();
        assert_eq!(u64::from_le_bytes(last), 0x10_0000 + 512 * PAGE_BYTES);
    }

    #[test]
    fn a_prp_transfer_in_the_last_page_of_the_address_space_ends_without_wrapping() {
        // Goal: the PRP builder stops at the transfer's end in the topmost page instead of
        // computing a next page start past the last address.
        let top_page = u64::MAX - 4095;
        let segments = [segment(top_page - 4096, 7680)];
        let plans = plans(&segments, 1 << 20, 512, DataPointerMode::Prp).unwrap();
        assert_eq!(plans.len(), 1);
        let pool = crate::hw::DmaPool::identity();
        let scratch = crate::hw::DmaAllocator::allocate(&pool, 4096).unwrap();
        let mut entry = SubmissionEntry::default();
        build_data_pointer(&mut entry, &segments, &plans[0], DataPointerMode::Prp, ScratchPage::new(&scratch, 0).unwrap()).unwrap();
        assert_eq!(entry.dptr, [top_page - 4096, top_page]);
    }

    /// Addresses near page boundaries and near the top of the address space, where the fast
    /// paths' arithmetic could differ from the walk's.
    fn interesting_address() -> impl proptest::strategy::Strategy<Value = u64> {
        use proptest::prelude::*;
        prop_oneof![
            (0x10_0000u64..0x20_0000).prop_map(|address| address & !3),
            (0u64..4).prop_map(|page| 0x10_0000 + page * PAGE_BYTES),
            (0u64..64).prop_map(|back| (u64::MAX - 3 * PAGE_BYTES + 1 + back * 192) & !3),
            any::<u64>(),
        ]
    }

    use proptest::strategy::Strategy as _;

    proptest::proptest! {
        #[test]
        fn the_single_command_plan_is_the_walks_plan(
            address in interesting_address(),
            len in proptest::prop_oneof![0u32..20_000, (1u32..600).prop_map(|pages| pages * 4096), (511u32..515).prop_map(|pages| pages * 4096)],
            max_bytes in proptest::prop_oneof![proptest::strategy::Just(u64::MAX), 512u64..4 << 20],
            block in proptest::prop_oneof![proptest::strategy::Just(512u32), proptest::strategy::Just(4096u32)],
            sgl in proptest::bool::ANY,
        ) {
            // Goal: the one-command fast path of submit_transfer never plans differently from
            // plan_command, and takes over wherever the walk yields exactly one command.
            let mode = if sgl { DataPointerMode::Sgl } else { DataPointerMode::Prp };
            let segments = [segment(address, len)];
            let walked = plans(&segments, max_bytes, block, mode).ok().filter(|plans| plans.len() == 1);
            proptest::prop_assert_eq!(plan_single_command(&segments, max_bytes, block, mode).map(|fast| vec![fast]), walked);
        }

        #[test]
        fn every_prp_plan_obeys_the_prp_rules(
            first_offset in proptest::prop_oneof![proptest::strategy::Just(0u64), (0u64..1024).prop_map(|dwords| dwords * 4)],
            pages in proptest::collection::vec(0u64..300, 1..5),
            last_blocks in 0u64..300,
            mdts_pages in proptest::prop_oneof![1u64..8, 1u64..700],
            block in proptest::prop_oneof![proptest::strategy::Just(512u32), proptest::strategy::Just(4096u32)],
        ) {
            // Goal: any layout PRP can describe (first segment at any dword offset, joins on
            // pages) is planned into commands that each obey the PRP rules and MDTS, whole
            // blocks, together covering the transfer exactly.
            let block64 = u64::from(block);
            let mut segments = Vec::new();
            let mut total = 0u64;
            for (index, &extra) in pages.iter().enumerate() {
                let base = 0x100_0000 * (index as u64 + 1);
                let last = index + 1 == pages.len();
                let (start, len) = match (index, last) {
                    (0, true) => (base + first_offset, (last_blocks + 1) * block64),
                    (0, false) => (base + first_offset, (extra + 1) * PAGE_BYTES - first_offset),
                    (_, false) => (base, (extra + 1) * PAGE_BYTES),
                    (_, true) => (base, (last_blocks + 1) * block64 - total % block64),
                };
                segments.push(segment(start, len as u32));
                total += len;
            }
            let max_bytes = (mdts_pages * PAGE_BYTES).max(block64);
            check_prp_plans(&segments, max_bytes, block);
        }

        #[test]
        fn the_single_piece_data_pointer_is_the_walks(
            address in interesting_address(),
            offset_blocks in 0u32..4,
            blocks in proptest::prop_oneof![1u32..20, 1u32..600],
            sgl in proptest::bool::ANY,
        ) {
            // Goal: where the one-descriptor fast path of build_data_pointer applies, DPTR and
            // the entry's PSDT are exactly what the piece walk writes (and where the walk fails,
            // on a piece that wraps, the fast path does not apply).
            let mode = if sgl { DataPointerMode::Sgl } else { DataPointerMode::Prp };
            let segments = [segment(address, (offset_blocks + blocks) * 512)];
            let plan = CommandPlan { start: Cursor { segment: 0, offset: offset_blocks * 512 }, end: Cursor { segment: 1, offset: 0 }, bytes: u64::from(blocks) * 512 };
            let pool = crate::hw::DmaPool::identity();
            let scratch = crate::hw::DmaAllocator::allocate(&pool, SCRATCH_BYTES).unwrap();
            let mut fast = SubmissionEntry::default();
            let mut walked = SubmissionEntry::default();
            let walk = build_data_pointer_from_pieces(&mut walked, &segments, &plan, mode, ScratchPage::new(&scratch, 0).unwrap());
            // The walk needs no list page: one SGL descriptor in DPTR, or PRP2 naming no list.
            let walk_without_list = walk.is_ok() && if sgl { walked.dptr[1] >> 56 == 0 } else { walked.dptr[1] != scratch.iova().0 };
            if build_single_piece_data_pointer(&mut fast, &segments, &plan, mode) {
                proptest::prop_assert!(walk_without_list, "the fast path took a plan that needs a list: {walk:?}");
                proptest::prop_assert_eq!(fast.to_bytes(), walked.to_bytes());
            } else {
                proptest::prop_assert!(!walk_without_list, "the fast path declined a plan that needs no list");
                proptest::prop_assert_eq!(fast.to_bytes(), SubmissionEntry::default().to_bytes(), "a declined fast path wrote the entry");
            }
        }
    }

    #[test]
    fn a_scratch_page_must_lie_inside_its_region() {
        // Goal: a scratch page past the end of its region (which the controller would be
        // told to read a list from) is refused when it is made, at any offset.
        let pool = crate::hw::DmaPool::identity();
        let region = crate::hw::DmaAllocator::allocate(&pool, 2 * SCRATCH_BYTES).unwrap();
        let second = ScratchPage::new(&region, SCRATCH_BYTES).unwrap();
        assert_eq!(second.iova(), region.iova().checked_add_usize(SCRATCH_BYTES).unwrap());
        for offset in [SCRATCH_BYTES + 1, 2 * SCRATCH_BYTES, usize::MAX] {
            assert!(matches!(ScratchPage::new(&region, offset), Err(HwError::OutOfRange { .. })), "offset {offset}");
        }
    }
}
