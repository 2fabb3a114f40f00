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
//!   collapses to base + strides. SGL: an inline data block per IOCTX, no table at all. PRP: a
//!   list per block-layer for the pages after the first.
//! - PRP, per-layer tensors at a fixed layer stride: K and V are separate commands with a list each.
//! - PRP with per-layer tensors at irregular addresses cannot be expressed by the per-layer rule
//!   (PRP1 is `data + layer * stride`): refused at registration.

use std::sync::Arc;

use gio_uring::{Descriptor, Iova as GioIova, IovaRange};
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
    /// Bytes of one piece on the PRP path (a K+V pair or one object).
    piece_bytes: u64,
}

fn gio(iova: Iova) -> GioIova {
    GioIova(iova.0)
}

impl MappingTable {
    /// Builds the table in memory from `dma` (the engine's address space). `run_blocks_max` is
    /// the longest run of consecutive blocks one IOCTX may move (the pool's blocks per slot).
    pub fn build(registration: KvRegistration, dma: &Arc<dyn DmaAllocator>, run_blocks_max: u32) -> Result<Self> {
        let geometry = *registration.geometry();
        let object = geometry.object_bytes();
        let layers = u64::from(geometry.layers);
        let n = u64::from(registration.num_blocks());
        let stride = registration.layer_stride_bytes();
        let adjacent = registration.key_value_adjacent();
        let too_big = |what: &str| ObjstoreError::InvalidRegistration { reason: format!("{what} does not fit in memory") };
        let mut table = MappingTable {
            form: MappingForm::SglTable,
            region: None,
            mem_stride_bytes: 0,
            desc_stride_bytes: 0,
            prp_list_stride_bytes: 0,
            piece_bytes: 0,
            registration,
        };
        match (table.registration.mode(), stride, adjacent) {
            (DataPointerMode::Sgl, Some(stride), true) => {
                table.form = MappingForm::Collapsed;
                table.mem_stride_bytes = stride;
            }
            (DataPointerMode::Sgl, _, _) => {
                let pair = 2 * SGL_DESCRIPTOR_BYTES;
                table.desc_stride_bytes = n * pair;
                // The IOCTX's data field points into the table too (only the segment is read for
                // an SGL segment, but gio_uring checks data ranges): pad by the longest transfer.
                let pad = u64::from(run_blocks_max) * 2 * object;
                let bytes = (layers * n * pair).checked_add(pad).ok_or_else(|| too_big("SGL table"))?;
                let region = dma.allocate(usize::try_from(bytes).map_err(|_| too_big("SGL table"))?)?;
                let mut scratch = Vec::with_capacity((n * pair) as usize);
                for layer in 0..geometry.layers {
                    scratch.clear();
                    for block in 0..table.registration.num_blocks() {
                        for kind in [KvKind::Key, KvKind::Value] {
                            let address = table.registration.address_unchecked(layer, kind, block);
                            scratch.extend_from_slice(&sgl_data_block(address, object as u32));
                        }
                    }
                    region.write((u64::from(layer) * table.desc_stride_bytes) as usize, &scratch)?;
                }
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
                table.piece_bytes = if adjacent { 2 * object } else { object };
                let pages = table.piece_bytes / PAGE_BYTES;
                let entries = pages.saturating_sub(1);
                if entries > PRP_LIST_ENTRIES_MAX {
                    return Err(ObjstoreError::InvalidRegistration { reason: format!("a {}-byte transfer needs {entries} PRP entries; one list page holds {PRP_LIST_ENTRIES_MAX}", table.piece_bytes) });
                }
                // Two pages: PRP2 is the second page itself, which moves with the data.
                // More: PRP2 points at a list in the table.
                if pages == 2 {
                    table.desc_stride_bytes = stride;
                }
                if pages > 2 {
                    let pieces = if adjacent { 1 } else { 2 };
                    table.prp_list_stride_bytes = (entries * PRP_ENTRY_BYTES).next_power_of_two();
                    table.desc_stride_bytes = n * pieces * table.prp_list_stride_bytes;
                    let bytes = layers.checked_mul(table.desc_stride_bytes).ok_or_else(|| too_big("PRP lists"))?;
                    let region = dma.allocate(usize::try_from(bytes).map_err(|_| too_big("PRP lists"))?)?;
                    let mut scratch = Vec::with_capacity(table.desc_stride_bytes as usize);
                    for layer in 0..geometry.layers {
                        scratch.clear();
                        for block in 0..table.registration.num_blocks() {
                            let kinds: &[KvKind] = if adjacent { &[KvKind::Key] } else { &[KvKind::Key, KvKind::Value] };
                            for &kind in kinds {
                                let address = table.registration.address_unchecked(layer, kind, block).0;
                                let start = scratch.len();
                                for page in 1..pages {
                                    scratch.extend_from_slice(&(address + page * PAGE_BYTES).to_le_bytes());
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

    /// The table's memory range, to register with gio_uring next to the KV tensors.
    pub fn region_range(&self) -> Option<IovaRange> {
        self.region.as_ref().map(|region| IovaRange::new(gio(region.iova()), region.len() as u64))
    }

    /// The pieces that move engine blocks `first_block .. first_block + run` (consecutive ids)
    /// at layer 0, handed to `emit` in disk order (at most 2 per block). Runs longer than one
    /// block are merged into one piece only on the SGL table path. Allocation-free: the hot
    /// path of `prepare_*` calls it per block. A callback rather than an out-array: writing the
    /// pieces to memory and reading them back in wider loads stalled store forwarding.
    #[inline]
    pub fn for_each_piece(&self, first_block: u32, run: u32, mut emit: impl FnMut(Piece)) {
        let object = self.registration.geometry().object_bytes();
        let b = u64::from(first_block);
        match self.form {
            MappingForm::SglTable => {
                let table = self.region.as_ref().map_or(0, |region| region.iova().0);
                let at = Iova(table + b * 2 * SGL_DESCRIPTOR_BYTES);
                let segment = IovaRange::new(gio(at), u64::from(run) * 2 * SGL_DESCRIPTOR_BYTES);
                emit(Piece {
                    disk_offset_bytes: 0,
                    len_bytes: u64::from(run) * 2 * object,
                    data: at,
                    descriptor: Descriptor::SglSegment { segment },
                });
            }
            MappingForm::Collapsed => {
                let data = self.registration.address_unchecked(0, KvKind::Key, first_block);
                emit(Piece { disk_offset_bytes: 0, len_bytes: 2 * object, data, descriptor: self.prp_descriptor(data, first_block, 0) });
            }
            MappingForm::StridedPair => {
                for (index, kind) in [KvKind::Key, KvKind::Value].into_iter().enumerate() {
                    let data = self.registration.address_unchecked(0, kind, first_block);
                    emit(Piece {
                        disk_offset_bytes: index as u64 * object,
                        len_bytes: object,
                        data,
                        descriptor: self.prp_descriptor(data, first_block, index as u64),
                    });
                }
            }
        }
    }

    /// The descriptor for a piece on the non-table paths: SGL inline, or PRP (second page or list).
    fn prp_descriptor(&self, data: Iova, block: u32, piece: u64) -> Descriptor {
        if self.registration.mode() == DataPointerMode::Sgl {
            return Descriptor::SglInline;
        }
        let pages = self.piece_bytes / PAGE_BYTES;
        let prp2 = match (pages, &self.region) {
            (0 | 1, _) => None,
            (2, _) => Some(IovaRange::new(gio(Iova(data.0 + PAGE_BYTES)), PAGE_BYTES)),
            (_, Some(region)) => {
                let pieces = if self.form == MappingForm::Collapsed { 1 } else { 2 };
                let offset = (u64::from(block) * pieces + piece) * self.prp_list_stride_bytes;
                Some(IovaRange::new(gio(Iova(region.iova().0 + offset)), (pages - 1) * PRP_ENTRY_BYTES))
            }
            (_, None) => None,
        };
        Descriptor::Prp { prp2 }
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
}
