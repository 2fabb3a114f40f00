//! The P2P mapping table (Tutti §3.1): built once at registration, it tells the executor where
//! each (layer, K/V, block) object lives in device address space, in the form the controller
//! takes — 16-byte SGL Data Block descriptors, or PRP lists — so nothing is translated per I/O.
//!
//! gio_uring re-issues a prepared IOCTX per layer with `address + layer * stride`, so the table is
//! laid out layer-major with one stride per layer:
//! - SGL, general layouts: `[layer][block][K, V]` descriptors (32 bytes per block-layer); an
//!   IOCTX points at its block's pair, or at a run of pairs when a slot holds consecutive engine
//!   blocks (one command then moves a layer of several blocks: the scatter list is the table).
//! - Block-major pools (K then V of a layer adjacent, layers at a fixed stride): the table
//!   collapses to base + strides. SGL: an inline data block per IOCTX, no table at all, when a
//!   slot holds one block (with more, the table above, so that runs merge). PRP: a list per
//!   block-layer for the pages after the first.
//! - PRP, per-layer tensors at a fixed layer stride: K and V are separate commands with a list each.
//! - PRP with per-layer tensors at irregular addresses cannot be expressed by the per-layer rule
//!   (PRP1 is `data + layer * stride`): refused at registration.

use std::sync::Arc;

use gio_uring::{Descriptor, IovaRange};
use nvme_driver::{DataPointerMode, DmaAllocator, DmaRegion, Iova};

use crate::error::{KvKind, ObjstoreError, Result};
use crate::geometry::ModelGeometry;
use crate::registration::{KvRegistration, PAGE_BYTES};

pub const SGL_DESCRIPTOR_BYTES: u64 = 16;
pub const PRP_ENTRY_BYTES: u64 = 8;
/// Entries one 4 KiB PRP list page holds; longer lists would need chaining, which we refuse.
const PRP_LIST_ENTRIES_MAX: u64 = PAGE_BYTES / PRP_ENTRY_BYTES;

/// How IOCTXs find an object's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MappingForm {
    /// One IOCTX per block-layer moving K and V (adjacent in memory); `data = K(0, b)`.
    Collapsed,
    /// Two IOCTXs per block-layer (K, then V), each at `X(0, b) + layer * stride`.
    StridedPair,
    /// One IOCTX per block-layer (or run of consecutive blocks) with an SGL segment from the table.
    SglTable,
}

/// One data movement of a block in one layer, relative to the block's place on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Bytes from the start of the block's layer area on disk (0 for K or a K+V pair, object
    /// bytes for V).
    pub disk_offset_bytes: u64,
    pub len_bytes: u64,
    pub data: Iova,
    pub descriptor: Descriptor,
}

/// What one command may move on every device of a pool, fixed when the store is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandLimits {
    /// The smallest largest-transfer (MDTS, at most one PRP list page) of the pool's controllers.
    pub max_transfer_bytes: u64,
    /// The pool's LBA size: every command moves whole LBAs.
    pub lba_bytes: u32,
}

impl CommandLimits {
    /// No limit but the LBA size (tests of the table alone).
    pub fn unlimited(lba_bytes: u32) -> Self {
        Self { max_transfer_bytes: u64::MAX, lba_bytes }
    }
}

/// How a unit (an object, or a block-layer's K+V pair) is cut into equal commands under MDTS:
/// the fewest parts that divide it into whole `granule_bytes` no larger than the limit.
/// Equal parts keep one per-IOCB descriptor stride valid for every part (a PRP part of two
/// pages moves its second page with the data; longer ones point into the table).
fn split_unit(unit_bytes: u64, granule_bytes: u64, max_transfer_bytes: u64) -> Result<(u64, u64)> {
    if granule_bytes > max_transfer_bytes {
        return Err(ObjstoreError::InvalidRegistration {
            reason: format!(
                "one command moves at most {max_transfer_bytes} bytes (MDTS), less than one {granule_bytes}-byte unit of transfer (an LBA, or a page on the PRP path)"
            ),
        });
    }
    if unit_bytes == 0 || !unit_bytes.is_multiple_of(granule_bytes) {
        return Err(ObjstoreError::InvalidRegistration {
            reason: format!(
                "a {unit_bytes}-byte transfer is not a whole number of {granule_bytes}-byte units (LBAs, or pages on the PRP path)"
            ),
        });
    }
    let granules = unit_bytes / granule_bytes;
    let parts =
        (1..=granules).find(|&parts| granules.is_multiple_of(parts) && unit_bytes / parts <= max_transfer_bytes).unwrap_or(granules);
    Ok((parts, unit_bytes / parts))
}

/// The table, its memory, and the per-layer strides every IOCB of this pool uses.
#[derive(Debug)]
pub struct MappingTable {
    registration: KvRegistration,
    form: MappingForm,
    /// Descriptor or PRP-list memory (none when the table collapsed completely).
    region: Option<DmaRegion>,
    /// Per-layer offset of data addresses (`mem_stride_bytes` of every IOCB).
    mem_stride_bytes: u64,
    /// Per-layer offset of descriptor addresses (`desc_stride_bytes` of every IOCB).
    desc_stride_bytes: u64,
    /// Bytes of one PRP list (a power of two, so no list crosses a page).
    prp_list_stride_bytes: u64,
    /// Pieces per unit (K+V pair on the collapsed path, object otherwise): 1 unless MDTS is
    /// smaller than the unit. On the SGL table path: descriptors per object.
    parts_per_unit: u64,
    /// Bytes of one piece (collapsed and strided paths) or of one descriptor (SGL table).
    part_bytes: u64,
    /// SGL table path: descriptors one command takes (whole descriptors within MDTS).
    descriptors_per_command: u64,
    /// Bytes of one object, and on the SGL table path the bytes of one block's descriptors in
    /// a layer and the blocks one command takes whole: the per-block path reads these instead
    /// of recomputing them.
    object_bytes: u64,
    sgl_block_bytes: u64,
    sgl_blocks_per_command: u64,
    /// SGL table path: the table's first address (the region's), read per block.
    sgl_table: Iova,
}

fn overflow(what: &str) -> ObjstoreError {
    ObjstoreError::AddressOverflow { what: what.into() }
}

impl MappingTable {
    /// Builds the table in memory from `dma` (the engine's address space). `run_blocks_max` is
    /// the longest run of consecutive blocks one IOCTX may move (the pool's blocks per slot);
    /// `limits` cut every transfer into commands the pool's controllers take, decided here
    /// once (more IOCTXs per block-layer, never per-request work).
    pub fn build(registration: KvRegistration, dma: &Arc<dyn DmaAllocator>, run_blocks_max: u32, limits: CommandLimits) -> Result<Self> {
        let geometry = *registration.geometry();
        let object = geometry.object_bytes();
        let layers = u64::from(geometry.layers);
        let n = u64::from(registration.num_blocks());
        let stride = match registration.layer_stride_bytes() {
            Some(stride) if registration.stride_within_one_range(stride)? => Some(stride),
            _ => None,
        };
        let adjacent = registration.key_value_adjacent();
        let lba = u64::from(limits.lba_bytes);
        let max_transfer = limits.max_transfer_bytes;
        let too_big = |what: &str| ObjstoreError::InvalidRegistration { reason: format!("{what} does not fit in memory") };
        let mut table = MappingTable {
            form: MappingForm::SglTable,
            region: None,
            mem_stride_bytes: 0,
            desc_stride_bytes: 0,
            prp_list_stride_bytes: 0,
            parts_per_unit: 1,
            part_bytes: 0,
            descriptors_per_command: 0,
            object_bytes: object,
            sgl_block_bytes: 0,
            sgl_blocks_per_command: 0,
            sgl_table: Iova(0),
            registration,
        };
        match (table.registration.mode(), stride, adjacent) {
            // Collapsed only with one block per slot: with k > 1 a slot's consecutive engine
            // blocks can go as one command per layer (a run), which only the table describes
            // (their K+V pairs are a block stride apart in memory, not adjacent).
            (DataPointerMode::Sgl, Some(stride), true) if run_blocks_max <= 1 => {
                table.form = MappingForm::Collapsed;
                table.mem_stride_bytes = stride;
                (table.parts_per_unit, table.part_bytes) = split_unit(2 * object, lba, max_transfer)?;
            }
            (DataPointerMode::Sgl, _, _) => {
                // One descriptor per object, or per MDTS-sized part of it; a command takes as
                // many whole descriptors as MDTS allows, up to a run of k blocks.
                let (parts, part) = split_unit(object, lba, max_transfer)?;
                (table.parts_per_unit, table.part_bytes) = (parts, part);
                let per_block = 2 * parts;
                table.descriptors_per_command = (max_transfer / part).min(u64::from(run_blocks_max) * per_block);
                table.sgl_blocks_per_command = table.descriptors_per_command / per_block;
                let pair = per_block * SGL_DESCRIPTOR_BYTES;
                table.sgl_block_bytes = pair;
                table.desc_stride_bytes = n.checked_mul(pair).ok_or_else(|| too_big("SGL table"))?;
                // The IOCTX's data field points into the table too (only the segment is read for
                // an SGL segment, but gio_uring checks data ranges): pad by the longest command.
                let pad = table.descriptors_per_command * part;
                let bytes = layers
                    .checked_mul(table.desc_stride_bytes)
                    .and_then(|bytes| bytes.checked_add(pad))
                    .ok_or_else(|| too_big("SGL table"))?;
                let region = dma.allocate(usize::try_from(bytes).map_err(|_| too_big("SGL table"))?)?;
                let mut scratch = Vec::with_capacity((n * pair) as usize);
                for layer in 0..geometry.layers {
                    scratch.clear();
                    for block in 0..table.registration.num_blocks() {
                        for kind in [KvKind::Key, KvKind::Value] {
                            let address = table.registration.address(layer, kind, block).ok_or_else(|| overflow("a KV object"))?;
                            for index in 0..parts {
                                let piece = address.checked_add(index * part).ok_or_else(|| overflow("a part of a KV object"))?;
                                scratch.extend_from_slice(&sgl_data_block(piece, part as u32));
                            }
                        }
                    }
                    region.write((u64::from(layer) * table.desc_stride_bytes) as usize, &scratch)?;
                }
                table.sgl_table = region.iova();
                table.region = Some(region);
            }
            (DataPointerMode::Prp, None, _) => {
                return Err(ObjstoreError::InvalidRegistration {
                    reason: "PRP needs per-layer tensors at one fixed layer stride (PRP1 follows data + layer x stride); this layout has irregular layer bases: use a controller with SGL or allocate the layers at equal spacing".into(),
                })
            }
            (DataPointerMode::Prp, Some(stride), adjacent) => {
                table.form = if adjacent { MappingForm::Collapsed } else { MappingForm::StridedPair };
                table.mem_stride_bytes = stride;
                let unit = if adjacent { 2 * object } else { object };
                // PRP entries name whole pages: parts are whole pages (and whole LBAs).
                (table.parts_per_unit, table.part_bytes) = split_unit(unit, PAGE_BYTES.max(lba), max_transfer)?;
                let pages = unit / PAGE_BYTES;
                let entries = pages.saturating_sub(1);
                if entries > PRP_LIST_ENTRIES_MAX {
                    return Err(ObjstoreError::InvalidRegistration { reason: format!("a {unit}-byte transfer needs {entries} PRP entries; one list page holds {PRP_LIST_ENTRIES_MAX}") });
                }
                // A part of two pages: PRP2 is the second page itself, which moves with the
                // data. More: PRP2 points at the part's entries in the unit's list in the table.
                let part_pages = table.part_bytes / PAGE_BYTES;
                if part_pages == 2 {
                    table.desc_stride_bytes = stride;
                }
                if part_pages > 2 {
                    let pieces = if adjacent { 1 } else { 2 };
                    table.prp_list_stride_bytes = (entries * PRP_ENTRY_BYTES).next_power_of_two();
                    table.desc_stride_bytes =
                        (n * pieces).checked_mul(table.prp_list_stride_bytes).ok_or_else(|| too_big("PRP lists"))?;
                    let bytes = layers.checked_mul(table.desc_stride_bytes).ok_or_else(|| too_big("PRP lists"))?;
                    let region = dma.allocate(usize::try_from(bytes).map_err(|_| too_big("PRP lists"))?)?;
                    let mut scratch = Vec::with_capacity(table.desc_stride_bytes as usize);
                    for layer in 0..geometry.layers {
                        scratch.clear();
                        for block in 0..table.registration.num_blocks() {
                            let kinds: &[KvKind] = if adjacent { &[KvKind::Key] } else { &[KvKind::Key, KvKind::Value] };
                            for &kind in kinds {
                                let address = table.registration.address(layer, kind, block).ok_or_else(|| overflow("a KV object"))?;
                                let start = scratch.len();
                                for page in 1..pages {
                                    let entry = address.checked_add(page * PAGE_BYTES).ok_or_else(|| overflow("a page of a KV object"))?;
                                    scratch.extend_from_slice(&entry.0.to_le_bytes());
                                }
                                scratch.resize(start + table.prp_list_stride_bytes as usize, 0);
                            }
                        }
                        region.write((u64::from(layer) * table.desc_stride_bytes) as usize, &scratch)?;
                    }
                    table.region = Some(region);
                }
            }
        }
        Ok(table)
    }

    pub fn registration(&self) -> &KvRegistration {
        &self.registration
    }

    pub fn form(&self) -> MappingForm {
        self.form
    }

    pub fn mem_stride_bytes(&self) -> u64 {
        self.mem_stride_bytes
    }

    pub fn desc_stride_bytes(&self) -> u64 {
        self.desc_stride_bytes
    }

    /// Bytes of device memory the table occupies (0 when collapsed to base + strides).
    pub fn memory_bytes(&self) -> u64 {
        self.region.as_ref().map_or(0, |region| region.len() as u64)
    }

    /// The table's memory (to leak it when a controller may still read it).
    pub(crate) fn region(&self) -> Option<&DmaRegion> {
        self.region.as_ref()
    }

    /// The table's memory range, to register with gio_uring next to the KV tensors.
    pub fn region_range(&self) -> Option<IovaRange> {
        self.region.as_ref().map(|region| IovaRange::new(region.iova(), region.len() as u64))
    }

    /// Commands (IOCTXs) that move one layer of a run of `run` consecutive blocks of one slot:
    /// the pieces [`MappingTable::for_each_piece`] emits for it (the store merges runs longer
    /// than one block only on the SGL table path; elsewhere each block has its own commands).
    pub fn commands_per_run(&self, run: u32) -> u64 {
        match self.form {
            MappingForm::SglTable => (2 * self.parts_per_unit * u64::from(run)).div_ceil(self.descriptors_per_command),
            MappingForm::Collapsed => self.parts_per_unit * u64::from(run),
            MappingForm::StridedPair => 2 * self.parts_per_unit * u64::from(run),
        }
    }

    /// The most bytes one command of this table moves.
    pub fn command_bytes_max(&self) -> u64 {
        match self.form {
            MappingForm::SglTable => self.descriptors_per_command * self.part_bytes,
            MappingForm::Collapsed | MappingForm::StridedPair => self.part_bytes,
        }
    }

    /// The pieces that move engine blocks `first_block .. first_block + run` (consecutive ids)
    /// at layer 0, handed to `emit` in disk order (one per command: at most 2 per block unless
    /// MDTS cuts objects). Runs longer than one block are merged into one piece only on the
    /// SGL table path; on the other forms each block of the run gives its own pieces, the
    /// block's disk offsets a K+V pair past the previous block's. Allocation-free: the hot path of `prepare_*` calls it per block. A
    /// callback rather than an out-array: writing the pieces to memory and reading them back
    /// in wider loads stalled store forwarding.
    ///
    /// Blocks outside the registration are [`ObjstoreError::BlockOutOfRange`]. Inside it, every
    /// address lies in memory `build` checked (the KV extents, the table), so the checked sums
    /// here never fail; if one did, it would be [`ObjstoreError::AddressOverflow`], never a
    /// wrapped address. `emit`'s error ends the walk and is returned.
    #[inline]
    pub fn for_each_piece(&self, first_block: u32, run: u32, mut emit: impl FnMut(Piece) -> Result<()>) -> Result<()> {
        let num_blocks = self.registration.num_blocks();
        if u64::from(first_block) + u64::from(run) > u64::from(num_blocks) {
            return Err(ObjstoreError::BlockOutOfRange { block: first_block.max(num_blocks), num_blocks });
        }
        // From here `first_block + run` is at most `num_blocks`: no u32 sum below overflows.
        let b = u64::from(first_block);
        match self.form {
            MappingForm::SglTable => {
                // b < num_blocks: the offset lies inside the table `build` allocated.
                let first = self.sgl_table.checked_add(b * self.sgl_block_bytes).ok_or_else(|| overflow("the SGL table"))?;
                if u64::from(run) <= self.sgl_blocks_per_command {
                    // The common case (MDTS holds the run): one command, as before the split.
                    let segment = IovaRange::new(first, u64::from(run) * self.sgl_block_bytes);
                    let descriptor = Descriptor::SglSegment { segment };
                    return emit(Piece {
                        disk_offset_bytes: 0,
                        len_bytes: u64::from(run) * 2 * self.object_bytes,
                        data: first,
                        descriptor,
                    });
                }
                self.split_sgl_pieces(first, run, &mut emit)
            }
            // No merging here: a run is its blocks one after another, each block's layer a
            // K+V pair (`2 * object` bytes) past the previous one's on disk.
            MappingForm::Collapsed => {
                for (j, block) in (first_block..first_block + run).enumerate() {
                    let pair = j as u64 * 2 * self.object_bytes;
                    let base = self.registration.address(0, KvKind::Key, block).ok_or_else(|| overflow("a KV object"))?;
                    for part in 0..self.parts_per_unit {
                        let offset = part * self.part_bytes;
                        let data = base.checked_add(offset).ok_or_else(|| overflow("a part of a KV object"))?;
                        let descriptor = self.prp_descriptor(data, block, 0, offset)?;
                        emit(Piece { disk_offset_bytes: pair + offset, len_bytes: self.part_bytes, data, descriptor })?;
                    }
                }
                Ok(())
            }
            MappingForm::StridedPair => {
                let object = self.object_bytes;
                for (j, block) in (first_block..first_block + run).enumerate() {
                    let pair = j as u64 * 2 * object;
                    for (index, kind) in [KvKind::Key, KvKind::Value].into_iter().enumerate() {
                        let base = self.registration.address(0, kind, block).ok_or_else(|| overflow("a KV object"))?;
                        for part in 0..self.parts_per_unit {
                            let offset = part * self.part_bytes;
                            let data = base.checked_add(offset).ok_or_else(|| overflow("a part of a KV object"))?;
                            emit(Piece {
                                disk_offset_bytes: pair + index as u64 * object + offset,
                                len_bytes: self.part_bytes,
                                data,
                                descriptor: self.prp_descriptor(data, block, index as u64, offset)?,
                            })?;
                        }
                    }
                }
                Ok(())
            }
        }
    }

    /// The SGL table path when a run's descriptors exceed one command (MDTS smaller than the
    /// run): commands of `descriptors_per_command` whole descriptors. Out of line, so that the
    /// common path stays small enough to inline into the per-block loop.
    #[cold]
    #[inline(never)]
    fn split_sgl_pieces(&self, first: Iova, run: u32, emit: &mut dyn FnMut(Piece) -> Result<()>) -> Result<()> {
        let total = u64::from(run) * 2 * self.parts_per_unit;
        let mut done = 0;
        while done < total {
            let count = (total - done).min(self.descriptors_per_command);
            let at = first.checked_add(done * SGL_DESCRIPTOR_BYTES).ok_or_else(|| overflow("the SGL table"))?;
            let segment = IovaRange::new(at, count * SGL_DESCRIPTOR_BYTES);
            emit(Piece {
                disk_offset_bytes: done * self.part_bytes,
                len_bytes: count * self.part_bytes,
                data: at,
                descriptor: Descriptor::SglSegment { segment },
            })?;
            done += count;
        }
        Ok(())
    }

    /// The descriptor for a piece on the non-table paths: SGL inline, or PRP (second page or
    /// the piece's entries in its unit's list). `list` is the unit's list index in its block
    /// (0 for K or a K+V pair, 1 for V); `offset` the piece's byte offset inside the unit.
    fn prp_descriptor(&self, data: Iova, block: u32, list: u64, offset: u64) -> Result<Descriptor> {
        if self.registration.mode() == DataPointerMode::Sgl {
            return Ok(Descriptor::SglInline);
        }
        let pages = self.part_bytes / PAGE_BYTES;
        let prp2 = match (pages, &self.region) {
            (0 | 1, _) => None,
            (2, _) => Some(IovaRange::new(data.checked_add(PAGE_BYTES).ok_or_else(|| overflow("a part of a KV object"))?, PAGE_BYTES)),
            (_, Some(region)) => {
                let lists = if self.form == MappingForm::Collapsed { 1 } else { 2 };
                // Entry i of a unit's list names its page i + 1: a piece from page s takes s..
                // Inside the list memory `build` allocated for every block of the registration.
                let first_entry = offset / PAGE_BYTES;
                let at = (u64::from(block) * lists + list) * self.prp_list_stride_bytes + first_entry * PRP_ENTRY_BYTES;
                let entries = region.iova().checked_add(at).ok_or_else(|| overflow("the PRP lists"))?;
                Some(IovaRange::new(entries, (pages - 1) * PRP_ENTRY_BYTES))
            }
            (_, None) => None,
        };
        Ok(Descriptor::Prp { prp2 })
    }
}

/// An NVMe SGL Data Block descriptor (§4.1.3): address, length, 3 reserved bytes, type 0 / subtype 0.
pub fn sgl_data_block(address: Iova, len_bytes: u32) -> [u8; 16] {
    let mut descriptor = [0u8; 16];
    descriptor[..8].copy_from_slice(&address.0.to_le_bytes());
    descriptor[8..12].copy_from_slice(&len_bytes.to_le_bytes());
    descriptor
}

/// What a mapping table costs for a pool of `pool_bytes` of KV blocks of `geometry`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappingMemoryReport {
    /// (layer, K/V, block) objects in the pool.
    pub objects: u64,
    /// One 16-byte SGL descriptor per object (what this crate builds for general layouts).
    pub sgl_bytes: u64,
    /// One 4 KiB PRP list page per object, as Tutti §3.1 counts the PRP alternative.
    pub prp_list_page_per_object_bytes: u64,
    /// PRP lists packed at a power-of-two stride (what this crate builds on the PRP path).
    pub prp_packed_bytes: u64,
}

/// Tutti §3.1's arithmetic for any geometry: 60 GiB of Llama-3.1-8B blocks of 32 tokens
/// (64 KiB objects) gives 983,040 objects: 15 MiB of SGL descriptors, 3.75 GiB of PRP pages.
pub fn mapping_memory(geometry: &ModelGeometry, pool_bytes: u64) -> MappingMemoryReport {
    let object = geometry.object_bytes().max(1);
    let objects = pool_bytes / object;
    let entries = (object / PAGE_BYTES).saturating_sub(1);
    let packed_list = if object / PAGE_BYTES > 2 { (entries * PRP_ENTRY_BYTES).next_power_of_two() } else { 0 };
    MappingMemoryReport {
        objects,
        sgl_bytes: objects * SGL_DESCRIPTOR_BYTES,
        prp_list_page_per_object_bytes: objects * PAGE_BYTES,
        prp_packed_bytes: objects * packed_list,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixty_gib_of_llama_8b_matches_tutti_figures() {
        // Goal: the figures of Tutti §3.1 (~15 MB SGL, 3.75 GB PRP) for 60 GiB of Llama-3.1-8B
        // blocks of 32 tokens (64 KiB objects), computed, not copied.
        let report = mapping_memory(&ModelGeometry::llama3_8b(32), 60 << 30);
        assert_eq!(report.objects, 983_040);
        assert_eq!(report.sgl_bytes, 15 << 20);
        assert_eq!(report.prp_list_page_per_object_bytes, 3840 << 20); // 3.75 GiB
        assert_eq!(report.prp_packed_bytes, 983_040 * 128); // 15 entries padded to 16
                                                            // 16-token blocks halve the object: twice the descriptors.
        assert_eq!(mapping_memory(&ModelGeometry::llama3_8b(16), 60 << 30).sgl_bytes, 30 << 20);
    }

    #[test]
    fn sgl_descriptor_bytes() {
        let d = sgl_data_block(Iova(0x1122_3344_5566_7788), 0x1_0000);
        assert_eq!(&d[..8], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&d[8..12], &0x1_0000u32.to_le_bytes());
        assert_eq!(&d[12..], &[0, 0, 0, 0]);
    }

    fn engine(mode: DataPointerMode, major: bool, blocks: u32) -> (Arc<dyn DmaAllocator>, KvRegistration, Vec<DmaRegion>) {
        // 2 layers of 32 KiB objects (Llama-3.1-8B's 16-token block).
        let geometry = ModelGeometry { layers: 2, ..ModelGeometry::llama3_8b(16) };
        let dma: Arc<dyn DmaAllocator> = Arc::new(nvme_driver::hw::DmaPool::identity());
        let object = geometry.object_bytes();
        if major {
            let region = dma.allocate((geometry.block_bytes() * u64::from(blocks)) as usize).unwrap();
            let layout = crate::KvLayout::BlockMajor { base: region.iova(), block_stride_bytes: geometry.block_bytes() };
            return (dma.clone(), KvRegistration::new(geometry, blocks, layout, mode).unwrap(), vec![region]);
        }
        // Per-layer tensors at one stride (the PRP path needs it; SGL takes it as irregular).
        let tensor = object * u64::from(blocks);
        let region = dma.allocate((tensor * 2 * u64::from(geometry.layers)) as usize).unwrap();
        let base = region.iova();
        let key_bases = (0..u64::from(geometry.layers)).map(|l| base.checked_add(2 * l * tensor).unwrap()).collect();
        let value_bases = (0..u64::from(geometry.layers)).map(|l| base.checked_add((2 * l + 1) * tensor).unwrap()).collect();
        let layout = crate::KvLayout::SeparateKv { key_bases, value_bases, block_stride_bytes: object };
        (dma.clone(), KvRegistration::new(geometry, blocks, layout, mode).unwrap(), vec![region])
    }

    #[test]
    fn pieces_of_blocks_outside_the_registration_are_an_error_not_an_address() {
        // Goal: in every form, a run reaching past the registered blocks is refused before
        // anything is emitted (the SGL table path handed out descriptor addresses past the
        // table, the other forms addresses past the KV tensors), and an error from `emit`
        // ends the walk and comes back.
        for (mode, major, blocks_per_slot) in [
            (DataPointerMode::Sgl, false, 4),
            (DataPointerMode::Sgl, true, 1),
            (DataPointerMode::Sgl, true, 4),
            (DataPointerMode::Prp, true, 4),
            (DataPointerMode::Prp, false, 4),
        ] {
            let (dma, registration, _memory) = engine(mode, major, 8);
            let table = MappingTable::build(registration, &dma, blocks_per_slot, CommandLimits::unlimited(512)).unwrap();
            let form = table.form();
            for (first, run) in [(8, 1), (7, 2), (u32::MAX, 1), (u32::MAX, u32::MAX)] {
                let mut emitted = 0;
                let result = table.for_each_piece(first, run, |_| {
                    emitted += 1;
                    Ok(())
                });
                assert!(matches!(result, Err(ObjstoreError::BlockOutOfRange { num_blocks: 8, .. })), "{form:?} {first}+{run}: {result:?}");
                assert_eq!(emitted, 0, "{form:?} {first}+{run}");
            }
            let stopped = table.for_each_piece(6, 2, |_| Err(ObjstoreError::BadRequest { reason: "stop".into() }));
            assert!(matches!(stopped, Err(ObjstoreError::BadRequest { .. })), "{form:?}: {stopped:?}");
        }
    }

    #[test]
    fn units_split_into_the_fewest_equal_parts_within_mdts() {
        assert_eq!(split_unit(65536, 512, 1 << 20).unwrap(), (1, 65536), "fits: one command, as before");
        assert_eq!(split_unit(65536, 512, 16384).unwrap(), (4, 16384));
        assert_eq!(split_unit(65536, 4096, 49152).unwrap(), (2, 32768), "equal parts, not 48 + 16 KiB");
        assert_eq!(split_unit(3 * 4096, 4096, 8192).unwrap(), (3, 4096), "3 pages cannot halve");
        assert!(split_unit(4096, 65536 / 8, 4096).unwrap_err().to_string().contains("MDTS"));
        assert!(split_unit(6000, 512, 1 << 20).is_err(), "not whole LBAs");
    }

    #[test]
    fn pieces_tile_every_layer_of_a_run_within_mdts() {
        // Goal: for every form, with a large and a small MDTS, the pieces of a run cover its
        // bytes on disk exactly once, in order, each within MDTS, each a whole number of LBAs;
        // their memory is the objects' bytes in the same order (SGL: through the table's
        // descriptors; PRP: PRP1 and the list entries it points at); and the large-MDTS case
        // keeps one command per block-layer (per run on the SGL table path). A block-major
        // SGL registration collapses with one block per slot and takes the table with more, so
        // that a slot's run of blocks is one command per layer. Runs of several blocks are
        // walked on every form, as many pieces as `commands_per_run` counts (the non-table
        // forms emitted only the first block's pieces, and no caller could tell).
        let cases = [
            (DataPointerMode::Sgl, false, 4, MappingForm::SglTable),
            (DataPointerMode::Sgl, true, 1, MappingForm::Collapsed),
            (DataPointerMode::Sgl, true, 4, MappingForm::SglTable),
            (DataPointerMode::Prp, true, 4, MappingForm::Collapsed),
            (DataPointerMode::Prp, false, 4, MappingForm::StridedPair),
        ];
        for (mode, major, blocks_per_slot, form) in cases {
            for (max_transfer, run) in [(1u64 << 20, 4u32), (16384, 4), (16384, 1), (8192, 2), (49152, 3)] {
                let (dma, registration, _memory) = engine(mode, major, 8);
                let geometry = *registration.geometry();
                let object = geometry.object_bytes();
                let limits = CommandLimits { max_transfer_bytes: max_transfer, lba_bytes: 512 };
                let table = MappingTable::build(registration.clone(), &dma, blocks_per_slot, limits).unwrap();
                assert_eq!(table.form(), form);
                let context = format!("{form:?} {mode:?} MDTS {max_transfer} run {run}");
                let mut pieces = Vec::new();
                table
                    .for_each_piece(3, run, |piece| {
                        pieces.push(piece);
                        Ok(())
                    })
                    .unwrap();
                assert_eq!(pieces.len() as u64, table.commands_per_run(run), "{context}");
                if max_transfer == 1 << 20 {
                    let per_block = if form == MappingForm::StridedPair { 2 } else { 1 };
                    let expected = if form == MappingForm::SglTable { 1 } else { per_block * run as usize };
                    assert_eq!(pieces.len(), expected, "{context}: the common case is not split");
                }
                // Memory of the run in disk order: for block j, K then V.
                let expected_memory: Vec<(u64, u64)> = (0..run)
                    .flat_map(|j| [KvKind::Key, KvKind::Value].map(|kind| (registration.address(0, kind, 3 + j).unwrap().0, object)))
                    .collect();
                let mut disk = 0;
                let mut memory: Vec<(u64, u64)> = Vec::new();
                for piece in &pieces {
                    assert_eq!(piece.disk_offset_bytes, disk, "{context}: pieces in disk order, no gap");
                    assert!(piece.len_bytes <= max_transfer && piece.len_bytes % 512 == 0, "{context}: {piece:?}");
                    disk += piece.len_bytes;
                    let mut push = |address: u64, len: u64| match memory.last_mut() {
                        Some(last) if last.0 + last.1 == address => last.1 += len,
                        _ => memory.push((address, len)),
                    };
                    match piece.descriptor {
                        Descriptor::SglSegment { segment } => {
                            let region = dma.translate(segment.start, segment.len_bytes as usize).unwrap();
                            let mut bytes = vec![0u8; segment.len_bytes as usize];
                            region.read(0, &mut bytes).unwrap();
                            let mut total = 0;
                            for descriptor in bytes.chunks_exact(16) {
                                let address = u64::from_le_bytes(descriptor[..8].try_into().unwrap());
                                let len = u64::from(u32::from_le_bytes(descriptor[8..12].try_into().unwrap()));
                                push(address, len);
                                total += len;
                            }
                            assert_eq!(total, piece.len_bytes, "{context}");
                        }
                        Descriptor::SglInline => push(piece.data.0, piece.len_bytes),
                        Descriptor::Prp { prp2 } => {
                            let pages = piece.len_bytes / PAGE_BYTES;
                            push(piece.data.0, PAGE_BYTES.min(piece.len_bytes));
                            match (pages, prp2) {
                                (1, None) => {}
                                (2, Some(second)) => push(second.start.0, PAGE_BYTES),
                                (_, Some(list)) => {
                                    assert_eq!(list.len_bytes, (pages - 1) * PRP_ENTRY_BYTES, "{context}");
                                    let region = dma.translate(list.start, list.len_bytes as usize).unwrap();
                                    let mut bytes = vec![0u8; list.len_bytes as usize];
                                    region.read(0, &mut bytes).unwrap();
                                    for entry in bytes.chunks_exact(8) {
                                        push(u64::from_le_bytes(entry.try_into().unwrap()), PAGE_BYTES);
                                    }
                                }
                                other => panic!("{context}: {other:?}"),
                            }
                        }
                    }
                }
                assert_eq!(disk, u64::from(run) * 2 * object, "{context}: the run's bytes, all of them");
                let mut expected = Vec::new();
                for (address, len) in expected_memory {
                    match expected.last_mut() {
                        Some((a, l)) if *a + *l == address => *l += len,
                        _ => expected.push((address, len)),
                    }
                }
                assert_eq!(memory, expected, "{context}: memory in disk order");
            }
        }
    }
}
