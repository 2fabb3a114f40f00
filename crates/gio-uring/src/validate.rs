//! What a caller may put in an IOCB, and the checks that turn it into ABI records.
//!
//! Every IOCTX is checked when its IOCB is filled, for the first and the last layer the IOCB was
//! prepared for. The per-layer rule is linear (`x + layer * stride`) and each check is an interval
//! inside one contiguous range, so both ends inside the same range implies every layer in between
//! is too: a per-layer issue then costs O(1) checks, not O(blocks).

use crate::abi::{self, gio_ioctx, DescriptorKind, Opcode};
use crate::error::IoctxFault;
use crate::layout::IOCTX_WORDS;
use crate::types::{DeviceIndex, Iova, IovaRange, Lba};

/// What the queue knows about one NVMe device (a namespace reachable through the executor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceInfo {
    pub nsid: u32,
    pub capacity_blocks: u64,
    pub block_bytes: u32,
    /// Whether the controller accepts SGL data pointers (Identify Controller SGLS != 0).
    pub sgl_supported: bool,
}

/// The devices an IOCTX's `device` index refers to, fixed at `init_queue`.
#[derive(Debug, Clone, Default)]
pub struct DeviceTable {
    devices: Vec<DeviceInfo>,
    /// Per device, the most data bytes one command may move (see
    /// [`DeviceTable::with_max_transfer_bytes`]); `u64::MAX` where the caller gave none.
    max_transfer_bytes: Vec<u64>,
}

impl DeviceTable {
    /// Devices whose transfer limit is not known here: only NVMe's 65536 blocks per command
    /// bound an IOCTX. A caller that knows each controller's limit (MDTS) passes it with
    /// [`DeviceTable::with_max_transfer_bytes`]: the CPU executors send one command per IOCTX
    /// without the driver's checks, so a larger one fails on the device at every issue.
    pub fn new(devices: Vec<DeviceInfo>) -> Self {
        let max_transfer_bytes = vec![u64::MAX; devices.len()];
        Self { devices, max_transfer_bytes }
    }

    /// Devices with the most data bytes one command may move on each: the controller's MDTS
    /// in bytes (`nvme_driver::Controller::max_transfer_bytes`). `fill_iocb` refuses an IOCTX
    /// above its device's limit ([`IoctxFault::TransferTooLarge`]).
    pub fn with_max_transfer_bytes(devices: Vec<(DeviceInfo, u64)>) -> Self {
        let (devices, max_transfer_bytes) = devices.into_iter().unzip();
        Self { devices, max_transfer_bytes }
    }

    /// The most data bytes one command may move on `device` (`u64::MAX`: not known).
    pub fn max_transfer_bytes(&self, device: DeviceIndex) -> Option<u64> {
        self.max_transfer_bytes.get(usize::from(device.0)).copied()
    }

    pub fn get(&self, device: DeviceIndex) -> Option<&DeviceInfo> {
        self.devices.get(usize::from(device.0))
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
}

/// Device-visible memory that data and descriptors may live in (e.g. the engine's KV pool mapped
/// through the IOMMU, and the descriptor tables).
#[derive(Debug, Clone, Default)]
pub struct RegisteredMemory {
    /// Sorted by start, non-overlapping.
    ranges: Vec<IovaRange>,
}

impl RegisteredMemory {
    /// `None` if two ranges overlap or a range wraps the address space. Ranges stay separate
    /// even when they touch: an IOCTX's interval must lie in one of them at the first and the
    /// last layer, so it cannot run from one registration into the next (e.g. from the KV
    /// memory into a descriptor table allocated after it). A caller whose one buffer was
    /// registered in pieces merges them first.
    pub fn new(mut ranges: Vec<IovaRange>) -> Option<Self> {
        ranges.sort_by_key(|range| range.start);
        for range in &ranges {
            range.end()?;
        }
        for pair in ranges.windows(2) {
            if pair[0].end()? > pair[1].start.0 {
                return None;
            }
        }
        Some(Self { ranges })
    }

    /// The registered range holding `address`, if any.
    #[inline]
    fn range_of(&self, address: u64) -> Option<&IovaRange> {
        // One range (the common case: a pool's mapping table) needs no search.
        if let [only] = self.ranges.as_slice() {
            return only.contains(address, 0).then_some(only);
        }
        let index = self.ranges.partition_point(|range| range.start.0 <= address);
        let range = self.ranges.get(index.checked_sub(1)?)?;
        range.contains(address, 0).then_some(range)
    }
}

/// How the controller finds the data of one IOCTX.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Descriptor {
    /// One contiguous buffer, described by an SGL Data Block inside the command.
    SglInline,
    /// A Last Segment of SGL descriptors at `segment` (16 bytes each).
    SglSegment { segment: IovaRange },
    /// PRP1 = the data address; PRP2 = `prp2` (the second page, or a PRP list), if the transfer
    /// needs it.
    Prp { prp2: Option<IovaRange> },
}

/// One IOCTX as the caller describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoctxSpec {
    pub device: DeviceIndex,
    pub nsid: u32,
    pub start_lba: Lba,
    pub block_count: u32,
    /// Device address of the first data byte.
    pub data: Iova,
    pub descriptor: Descriptor,
    pub force_unit_access: bool,
}

/// The IOCB-wide part of a request: direction, the per-layer rule and the caller's tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IocbSpec {
    pub opcode: Opcode,
    pub user_data: u64,
    /// Layers the request will be issued for (1 for a plain request).
    pub layer_count: u32,
    pub lba_stride_blocks: u64,
    pub mem_stride_bytes: u64,
    pub desc_stride_bytes: u64,
}

impl IocbSpec {
    /// A single-layer request.
    pub fn single(opcode: Opcode, user_data: u64) -> Self {
        Self { opcode, user_data, layer_count: 1, lba_stride_blocks: 0, mem_stride_bytes: 0, desc_stride_bytes: 0 }
    }
}

/// The 16-bit, 0-based NLB field of an NVMe Read/Write command.
pub const NVME_BLOCKS_PER_COMMAND_MAX: u32 = 65536;

/// The memory page size PRP entries name: the one nvme-driver configures every controller with
/// (CC.MPS = 0), for the CPU and the CUDA executor alike.
pub const CONTROLLER_PAGE_BYTES: u64 = nvme_driver::datapath::PAGE_BYTES;

/// Bytes of one PRP list entry.
const PRP_ENTRY_BYTES: u64 = 8;

/// The alignment of a data address (PRP1, an SGL data block): a dword.
const DATA_ALIGN_BYTES: u64 = 4;

/// Checks one IOCTX against the devices and registered memory and encodes it.
pub fn encode_ioctx(spec: &IoctxSpec, iocb: &IocbSpec, devices: &DeviceTable, memory: &RegisteredMemory) -> Result<gio_ioctx, IoctxFault> {
    IoctxEncoder::new(iocb, devices, memory).encode(spec)
}

/// Encodes the IOCTXs of one IOCB: the IOCB-wide products (stride x last layer) are computed
/// once, so each IOCTX costs a handful of compares. Accepts and rejects exactly what checking
/// every IOCTX at layer 0 and at the last layer would (the per-layer rule is monotone: strides
/// are unsigned, so the last layer's interval is the highest and the first the lowest).
#[derive(Debug, Clone, Copy)]
pub struct IoctxEncoder<'a> {
    devices: &'a DeviceTable,
    memory: &'a RegisteredMemory,
    last_layer: u32,
    /// `stride * last_layer` for LBAs, data and descriptors; `None` if it overflows.
    lba_span: Option<u64>,
    mem_span: Option<u64>,
    desc_span: Option<u64>,
    /// `mem_stride_bytes % CONTROLLER_PAGE_BYTES`: how far a layer moves the data inside its
    /// page (PRP page counting).
    mem_step_in_page: u64,
    /// `desc_stride_bytes % CONTROLLER_PAGE_BYTES`: how far a layer moves a PRP list inside its
    /// page.
    desc_step_in_page: u64,
    desc_stride_bytes: u64,
    mem_stride_bytes: u64,
    /// Some layer moves dword-aligned data off a dword boundary (layer 1 does, when any does).
    mem_stride_unaligned: bool,
    /// The IOCB reads: force_unit_access is refused ([`IoctxFault::ForceUnitAccessOnRead`]).
    reads: bool,
}

impl<'a> IoctxEncoder<'a> {
    pub fn new(iocb: &IocbSpec, devices: &'a DeviceTable, memory: &'a RegisteredMemory) -> Self {
        let last_layer = iocb.layer_count.saturating_sub(1);
        let span = |stride: u64| stride.checked_mul(u64::from(last_layer));
        Self {
            devices,
            memory,
            last_layer,
            lba_span: span(iocb.lba_stride_blocks),
            mem_span: span(iocb.mem_stride_bytes),
            desc_span: span(iocb.desc_stride_bytes),
            mem_step_in_page: iocb.mem_stride_bytes % CONTROLLER_PAGE_BYTES,
            desc_step_in_page: iocb.desc_stride_bytes % CONTROLLER_PAGE_BYTES,
            desc_stride_bytes: iocb.desc_stride_bytes,
            mem_stride_bytes: iocb.mem_stride_bytes,
            mem_stride_unaligned: last_layer > 0 && !iocb.mem_stride_bytes.is_multiple_of(DATA_ALIGN_BYTES),
            reads: iocb.opcode == Opcode::Read,
        }
    }

    /// Checks one IOCTX; returns what its record derives from the device. A branch-light pass
    /// decides; only a rejected IOCTX goes through [`IoctxEncoder::check_in_detail`], which
    /// finds the precise fault (the two accept exactly the same IOCTXs: a test compares them).
    #[inline]
    fn check(&self, spec: &IoctxSpec) -> Result<Checked, IoctxFault> {
        match self.check_quickly(spec) {
            Some(checked) => Ok(checked),
            None => self.check_in_detail(spec),
        }
    }

    /// `Some` exactly when [`IoctxEncoder::check_in_detail`] is `Ok`, with the same value. Every
    /// layer's interval lies between layer 0's and the last layer's (unsigned strides), so one
    /// end-of-interval compare covers the last layer and, with it, all before.
    #[inline]
    fn check_quickly(&self, spec: &IoctxSpec) -> Option<Checked> {
        let device = self.devices.get(spec.device)?;
        let count = spec.block_count;
        if count.wrapping_sub(1) >= NVME_BLOCKS_PER_COMMAND_MAX || spec.nsid != device.nsid || (spec.force_unit_access && self.reads) {
            return None;
        }
        let data_bytes = count.checked_mul(device.block_bytes)?;
        if u64::from(data_bytes) > self.devices.max_transfer_bytes(spec.device)?
            || !spec.data.0.is_multiple_of(DATA_ALIGN_BYTES)
            || self.mem_stride_unaligned
        {
            return None;
        }
        let (kind, desc, desc_bytes) = descriptor_parts(spec.descriptor).ok()?;
        if kind == DescriptorKind::Sgl && !device.sgl_supported {
            return None;
        }
        let lba_end = spec.start_lba.0.checked_add(self.lba_span?)?.checked_add(u64::from(count))?;
        if lba_end > device.capacity_blocks || !self.registered_quickly(spec.data.0, u64::from(data_bytes), self.mem_span?) {
            return None;
        }
        if let Some(desc) = desc {
            if !self.registered_quickly(desc.start.0, desc.len_bytes, self.desc_span?) {
                return None;
            }
        }
        if kind == DescriptorKind::Prp && self.check_prp(spec.data.0, data_bytes, desc).is_err() {
            return None;
        }
        Some(Checked {
            lengths_word: u64::from(data_bytes) | u64::from(desc_bytes) << 32,
            desc_iova: desc.map_or(0, |range| range.start.0),
            kind: kind.to_abi(),
        })
    }

    /// `[start, start + span + len)` inside the registered range holding `start`.
    #[inline]
    fn registered_quickly(&self, start: u64, len_bytes: u64, span: u64) -> bool {
        let Some(range) = self.memory.range_of(start) else { return false };
        match (start.checked_add(span).and_then(|last| last.checked_add(len_bytes)), range.end()) {
            (Some(end), Some(range_end)) => end <= range_end,
            _ => false,
        }
    }

    /// The full check, fault by fault in a fixed order, for IOCTXs the quick check rejected.
    #[cold]
    #[inline(never)]
    fn check_in_detail(&self, spec: &IoctxSpec) -> Result<Checked, IoctxFault> {
        let Some(device) = self.devices.get(spec.device) else {
            return Err(cold_fault(|| IoctxFault::UnknownDevice { device: spec.device, device_count: self.devices.len() }));
        };
        if spec.block_count == 0 {
            return Err(cold_fault(|| IoctxFault::ZeroLength));
        }
        if spec.block_count > NVME_BLOCKS_PER_COMMAND_MAX {
            return Err(cold_fault(|| IoctxFault::TooManyBlocks { block_count: spec.block_count }));
        }
        if spec.nsid != device.nsid {
            return Err(cold_fault(|| IoctxFault::WrongNamespace { nsid: spec.nsid, expected_nsid: device.nsid }));
        }
        // The CPU executor builds a Read without FUA, the kernel would send it: one rule for
        // both by never letting a Read carry the flag.
        if spec.force_unit_access && self.reads {
            return Err(cold_fault(|| IoctxFault::ForceUnitAccessOnRead));
        }
        let Some(data_bytes) = spec.block_count.checked_mul(device.block_bytes) else {
            return Err(cold_fault(|| IoctxFault::LengthMismatch {
                data_bytes: u32::MAX,
                block_count: spec.block_count,
                block_bytes: device.block_bytes,
            }));
        };
        let max_transfer_bytes = self.devices.max_transfer_bytes(spec.device).unwrap_or(u64::MAX);
        if u64::from(data_bytes) > max_transfer_bytes {
            return Err(cold_fault(|| IoctxFault::TransferTooLarge { data_bytes, max_transfer_bytes }));
        }
        let (kind, desc, desc_bytes) = descriptor_parts(spec.descriptor)?;
        if kind == DescriptorKind::Sgl && !device.sgl_supported {
            return Err(cold_fault(|| IoctxFault::SglUnsupported));
        }
        self.check_lbas(spec, device)?;
        self.check_registered("data", spec.data.0, u64::from(data_bytes), self.mem_span)?;
        self.check_data_alignment(spec.data.0)?;
        if let Some(desc) = desc {
            self.check_registered("descriptor", desc.start.0, desc.len_bytes, self.desc_span)?;
        }
        if kind == DescriptorKind::Prp {
            self.check_prp(spec.data.0, data_bytes, desc)?;
        }
        Ok(Checked {
            lengths_word: u64::from(data_bytes) | u64::from(desc_bytes) << 32,
            desc_iova: desc.map_or(0, |range| range.start.0),
            kind: kind.to_abi(),
        })
    }

    /// Checks one IOCTX and encodes it.
    pub fn encode(&self, spec: &IoctxSpec) -> Result<gio_ioctx, IoctxFault> {
        let checked = self.check(spec)?;
        Ok(gio_ioctx {
            desc_iova: checked.desc_iova,
            data_iova: spec.data.0,
            start_lba: spec.start_lba.0,
            nsid: spec.nsid,
            block_count: spec.block_count,
            data_bytes: checked.lengths_word as u32,
            desc_bytes: (checked.lengths_word >> 32) as u32,
            device_index: spec.device.0,
            descriptor_kind: checked.kind,
            flags: fua_flag(spec),
            reserved0: 0,
        })
    }

    /// Checks one IOCTX and encodes it as the words of its record (what
    /// [`crate::layout::ioctx_words`] gives for [`IoctxEncoder::encode`]), combined in
    /// registers: going through a `gio_ioctx` in memory made the compiler re-read narrow stores
    /// as wide loads, a store-forwarding stall that was 40% of `fill_iocb`.
    #[inline]
    pub fn encode_words(&self, spec: &IoctxSpec) -> Result<[u64; IOCTX_WORDS], IoctxFault> {
        let checked = self.check(spec)?;
        Ok([
            checked.desc_iova,
            spec.data.0,
            spec.start_lba.0,
            u64::from(spec.nsid) | u64::from(spec.block_count) << 32,
            checked.lengths_word,
            u64::from(spec.device.0) | u64::from(checked.kind) << 16 | u64::from(fua_flag(spec)) << 24,
        ])
    }

    /// Blocks `[start + L*stride, +count)` within capacity at the first and the last layer.
    #[inline]
    fn check_lbas(&self, spec: &IoctxSpec, device: &DeviceInfo) -> Result<(), IoctxFault> {
        let count = u64::from(spec.block_count);
        let start = spec.start_lba.0;
        let fits = |first_lba: u64| first_lba.checked_add(count).is_some_and(|end| end <= device.capacity_blocks);
        let out_of_range = |first_lba: u64, layer: u32| {
            cold_fault(|| IoctxFault::LbaOutOfRange {
                first_lba,
                block_count: spec.block_count,
                layer,
                capacity_blocks: device.capacity_blocks,
            })
        };
        if !fits(start) {
            return Err(out_of_range(start, 0));
        }
        let Some(last) = self.lba_span.and_then(|span| start.checked_add(span)) else {
            return Err(cold_fault(|| IoctxFault::AddressOverflow { layer: self.last_layer }));
        };
        if !fits(last) {
            return Err(out_of_range(last, self.last_layer));
        }
        Ok(())
    }

    /// The data address dword aligned at every layer (NVMe §4.1.1: PRP1's bits 1:0 are zero;
    /// the same is asked of an SGL data block): at layer 0, and a stride that keeps it so. Runs
    /// after the registered-memory check, so layer 1's address does not overflow.
    #[inline]
    fn check_data_alignment(&self, data: u64) -> Result<(), IoctxFault> {
        if !data.is_multiple_of(DATA_ALIGN_BYTES) {
            return Err(cold_fault(|| IoctxFault::UnalignedData { data_iova: data, layer: 0 }));
        }
        if self.mem_stride_unaligned {
            return Err(cold_fault(|| IoctxFault::UnalignedData { data_iova: data.wrapping_add(self.mem_stride_bytes), layer: 1 }));
        }
        Ok(())
    }

    /// The lowest and the highest offset of the data inside its memory page over the layers
    /// (see [`page_offsets`]).
    #[inline]
    fn data_page_offsets(&self, data: u64) -> (u64, u64) {
        page_offsets(data, self.mem_step_in_page, self.last_layer)
    }

    /// PRP2 against what the controller does with it (NVMe Base Spec §4.1.1): data inside one
    /// memory page takes none (the controller would otherwise read PRP2 = 0 as the second page,
    /// a DMA to IOVA 0); data over two pages needs the second page, page aligned, covering the
    /// rest of the data; over more, a PRP list, 8-byte aligned, of 8 bytes per page after the
    /// first. At every layer: the offset of the data in its page may change with the layer
    /// (then the page count is taken for the extremes), and PRP2 moves by the descriptor
    /// stride. A request whose page count is two at some layer and more at another is refused:
    /// PRP2 cannot be both a data page and a list.
    #[inline]
    fn check_prp(&self, data: u64, data_bytes: u32, prp2: Option<IovaRange>) -> Result<(), IoctxFault> {
        let (offset_min, offset_max) = self.data_page_offsets(data);
        let bytes = u64::from(data_bytes);
        // offset < page size and bytes < 2^32: no overflow.
        let pages = |offset: u64| (offset + bytes).div_ceil(CONTROLLER_PAGE_BYTES);
        let (pages_min, pages_max) = (pages(offset_min), pages(offset_max));
        let mismatch = |reason: &'static str| cold_fault(|| IoctxFault::PrpMismatch { reason, pages_min, pages_max, prp2 });
        let Some(range) = prp2 else {
            return if pages_max <= 1 { Ok(()) } else { Err(mismatch("data over more than one memory page needs PRP2")) };
        };
        let (needed_bytes, align_bytes, short, misaligned) = match pages_max {
            0 | 1 => return Err(mismatch("data inside one memory page takes no PRP2")),
            2 => (
                offset_max + bytes - CONTROLLER_PAGE_BYTES,
                CONTROLLER_PAGE_BYTES,
                "the second page is shorter than the data past the first page",
                "the second page is not page aligned at every layer",
            ),
            _ if pages_min < 3 => return Err(mismatch("PRP2 would be the second page at some layers and a PRP list at others")),
            _ => (
                (pages_max - 1) * PRP_ENTRY_BYTES,
                PRP_ENTRY_BYTES,
                "the PRP list is shorter than 8 bytes per page after the first",
                "the PRP list is not 8-byte aligned at every layer",
            ),
        };
        if range.len_bytes < needed_bytes {
            return Err(mismatch(short));
        }
        let aligned =
            range.start.0.is_multiple_of(align_bytes) && (self.last_layer == 0 || self.desc_stride_bytes.is_multiple_of(align_bytes));
        if !aligned {
            return Err(mismatch(misaligned));
        }
        // A list must lie inside one memory page at every layer: when more entries are needed
        // than its page holds, the controller reads the page's last entry as a pointer to the
        // next list page (§4.1.1), so a list running into the next page would have a data page
        // read as a list. This also caps a list at one page of entries (512).
        if pages_max > 2 {
            let (_, list_offset_max) = page_offsets(range.start.0, self.desc_step_in_page, self.last_layer);
            if list_offset_max + needed_bytes > CONTROLLER_PAGE_BYTES {
                return Err(mismatch(
                    "the PRP list does not fit in its memory page at every layer (the controller would chain to the next list page)",
                ));
            }
        }
        Ok(())
    }

    /// `[start + L*stride, +len)` must lie in one registered range for the first and the last
    /// layer — the same range, so every layer in between lies in it too.
    #[inline]
    fn check_registered(&self, what: &'static str, start: u64, len_bytes: u64, span: Option<u64>) -> Result<(), IoctxFault> {
        let outside = |layer: u32, start: u64| {
            cold_fault(|| IoctxFault::OutsideRegisteredMemory { what, range: IovaRange::new(Iova(start), len_bytes), layer })
        };
        let Some(first) = self.memory.range_of(start).filter(|r| r.contains(start, len_bytes)) else {
            return Err(outside(0, start));
        };
        let Some(last_start) = span.and_then(|span| start.checked_add(span)) else {
            return Err(cold_fault(|| IoctxFault::AddressOverflow { layer: self.last_layer }));
        };
        if !first.contains(last_start, len_bytes) {
            return Err(outside(self.last_layer, last_start));
        }
        Ok(())
    }
}

/// The lowest and the highest offset inside its memory page of `first + layer * stride` over
/// layers `0..=last_layer`, where `step_in_page` is `stride % CONTROLLER_PAGE_BYTES`: exact while
/// the layers do not wrap past a page boundary (the offsets then rise from layer 0's), else
/// bounds (every offset is layer 0's modulo the largest power of two dividing the step).
#[inline]
fn page_offsets(first_address: u64, step_in_page: u64, last_layer: u32) -> (u64, u64) {
    let first = first_address % CONTROLLER_PAGE_BYTES;
    if step_in_page == 0 || last_layer == 0 {
        return (first, first);
    }
    match step_in_page.checked_mul(u64::from(last_layer)).and_then(|rise| rise.checked_add(first)) {
        Some(last) if last < CONTROLLER_PAGE_BYTES => (first, last),
        _ => {
            let granule = 1u64 << step_in_page.trailing_zeros(); // step < page size: at most half a page
            let low = first % granule;
            (low, CONTROLLER_PAGE_BYTES - granule + low)
        }
    }
}

/// The descriptor kind of `descriptor` (typed, so every kind written to a record is a valid
/// one), the descriptor range it names and that range's byte count (saturated for PRP), or the
/// fault of a malformed SGL segment (empty, not a multiple of 16 bytes, or past `u32`) or of a
/// descriptor at IOVA 0 (the record's "none"; only layer 0 can be there: strides are unsigned
/// and overflow is refused). Shared by the quick and the detailed check.
#[inline]
fn descriptor_parts(descriptor: Descriptor) -> Result<(DescriptorKind, Option<IovaRange>, u32), IoctxFault> {
    match descriptor {
        Descriptor::SglInline => Ok((DescriptorKind::Sgl, None, 0)),
        Descriptor::SglSegment { segment } => {
            let bytes = u32::try_from(segment.len_bytes).unwrap_or(0);
            if bytes == 0 || bytes % 16 != 0 {
                return Err(IoctxFault::BadSglSegment { desc_bytes: bytes });
            }
            if segment.start.0 == 0 {
                return Err(IoctxFault::DescriptorAtZero { what: "SGL segment" });
            }
            Ok((DescriptorKind::Sgl, Some(segment), bytes))
        }
        Descriptor::Prp { prp2 } => {
            if prp2.is_some_and(|range| range.start.0 == 0) {
                return Err(IoctxFault::DescriptorAtZero { what: "PRP2" });
            }
            let bytes = prp2.map_or(0, |range| u32::try_from(range.len_bytes).unwrap_or(u32::MAX));
            Ok((DescriptorKind::Prp, prp2, bytes))
        }
    }
}

/// What `IoctxEncoder::check` derives for a record besides the caller's fields. The two
/// lengths travel as the one word they occupy in the record: as two u32 fields the compiler
/// re-read them with one wide load after two narrow stores (a store-forwarding stall).
#[derive(Debug, Clone, Copy)]
struct Checked {
    /// `data_bytes | desc_bytes << 32`.
    lengths_word: u64,
    desc_iova: u64,
    kind: u8,
}

fn fua_flag(spec: &IoctxSpec) -> u8 {
    if spec.force_unit_access {
        abi::GIO_IOCTX_FLAG_FUA as u8
    } else {
        0
    }
}

/// Builds a fault off the hot path.
#[cold]
#[inline(never)]
fn cold_fault(fault: impl FnOnce() -> IoctxFault) -> IoctxFault {
    fault()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn devices() -> DeviceTable {
        DeviceTable::new(vec![
            DeviceInfo { nsid: 1, capacity_blocks: 1000, block_bytes: 512, sgl_supported: true },
            DeviceInfo { nsid: 1, capacity_blocks: 1 << 20, block_bytes: 4096, sgl_supported: false },
        ])
    }

    fn memory() -> RegisteredMemory {
        RegisteredMemory::new(vec![IovaRange::new(Iova(0x10_0000), 0x10_0000), IovaRange::new(Iova(0x80_0000), 0x1000)]).unwrap()
    }

    fn good() -> IoctxSpec {
        IoctxSpec {
            device: DeviceIndex(0),
            nsid: 1,
            start_lba: Lba(10),
            block_count: 8,
            data: Iova(0x10_0000),
            descriptor: Descriptor::SglInline,
            force_unit_access: false,
        }
    }

    fn layered(layers: u32) -> IocbSpec {
        IocbSpec {
            opcode: Opcode::Read,
            user_data: 0,
            layer_count: layers,
            lba_stride_blocks: 100,
            mem_stride_bytes: 0x1000,
            desc_stride_bytes: 0x10,
        }
    }

    fn check(spec: IoctxSpec, iocb: IocbSpec) -> Result<gio_ioctx, IoctxFault> {
        encode_ioctx(&spec, &iocb, &devices(), &memory())
    }

    #[test]
    fn a_good_ioctx_is_encoded_field_by_field() {
        let ioctx = check(good(), layered(9)).unwrap();
        assert_eq!(ioctx.flags, 0);
        let ioctx = check(IoctxSpec { force_unit_access: true, ..good() }, IocbSpec { opcode: Opcode::Write, ..layered(9) }).unwrap();
        assert_eq!(ioctx.data_iova, 0x10_0000);
        assert_eq!(ioctx.data_bytes, 4096);
        assert_eq!(ioctx.start_lba, 10);
        assert_eq!(ioctx.desc_iova, 0);
        assert_eq!(u32::from(ioctx.descriptor_kind), abi::GIO_DESCRIPTOR_SGL);
        assert_eq!(u32::from(ioctx.flags), abi::GIO_IOCTX_FLAG_FUA);
    }

    #[test]
    fn each_bad_input_gets_its_own_fault() {
        // Goal: every rejection reason of the issue is reachable and typed.
        let iocb = layered(1);
        type Case = (IoctxSpec, IocbSpec, fn(&IoctxFault) -> bool);
        let cases: Vec<Case> = vec![
            (IoctxSpec { device: DeviceIndex(2), ..good() }, iocb, |f| matches!(f, IoctxFault::UnknownDevice { device_count: 2, .. })),
            (IoctxSpec { block_count: 0, ..good() }, iocb, |f| matches!(f, IoctxFault::ZeroLength)),
            (IoctxSpec { block_count: 65537, ..good() }, iocb, |f| matches!(f, IoctxFault::TooManyBlocks { .. })),
            (IoctxSpec { nsid: 2, ..good() }, iocb, |f| matches!(f, IoctxFault::WrongNamespace { .. })),
            (IoctxSpec { force_unit_access: true, ..good() }, iocb, |f| matches!(f, IoctxFault::ForceUnitAccessOnRead)),
            (IoctxSpec { start_lba: Lba(993), ..good() }, iocb, |f| matches!(f, IoctxFault::LbaOutOfRange { layer: 0, .. })),
            // In range at layer 0, out of range at layer 10 (10 + 10*100 + 8 > 1000).
            (good(), layered(11), |f| matches!(f, IoctxFault::LbaOutOfRange { layer: 10, .. })),
            (IoctxSpec { data: Iova(0x7F_0000), ..good() }, iocb, |f| {
                matches!(f, IoctxFault::OutsideRegisteredMemory { what: "data", layer: 0, .. })
            }),
            // Straddles the end of a range.
            (IoctxSpec { data: Iova(0x1F_F800), ..good() }, iocb, |f| matches!(f, IoctxFault::OutsideRegisteredMemory { .. })),
            (IoctxSpec { descriptor: Descriptor::SglSegment { segment: IovaRange::new(Iova(0x90_0000), 32) }, ..good() }, iocb, |f| {
                matches!(f, IoctxFault::OutsideRegisteredMemory { what: "descriptor", .. })
            }),
            (IoctxSpec { descriptor: Descriptor::SglSegment { segment: IovaRange::new(Iova(0x80_0000), 24) }, ..good() }, iocb, |f| {
                matches!(f, IoctxFault::BadSglSegment { desc_bytes: 24 })
            }),
            (IoctxSpec { device: DeviceIndex(1), ..good() }, iocb, |f| matches!(f, IoctxFault::SglUnsupported)),
            (IoctxSpec { start_lba: Lba(u64::MAX - 2), ..good() }, iocb, |f| matches!(f, IoctxFault::LbaOutOfRange { .. })),
            (IoctxSpec { block_count: 16, descriptor: Descriptor::Prp { prp2: None }, ..good() }, iocb, |f| {
                matches!(f, IoctxFault::PrpMismatch { pages_min: 2, pages_max: 2, .. })
            }),
            (IoctxSpec { descriptor: Descriptor::SglSegment { segment: IovaRange::new(Iova(0), 32) }, ..good() }, iocb, |f| {
                matches!(f, IoctxFault::DescriptorAtZero { .. })
            }),
        ];
        for (index, (spec, iocb, expected)) in cases.into_iter().enumerate() {
            let fault = check(spec, iocb).expect_err(&format!("case {index} must fail"));
            assert!(expected(&fault), "case {index}: unexpected {fault:?}");
        }
    }

    #[test]
    fn prp_descriptor_and_layer_strides_are_checked_at_the_last_layer() {
        // Three 4 KiB pages: PRP2 is a list of two entries.
        let prp = IoctxSpec {
            device: DeviceIndex(1),
            block_count: 3,
            descriptor: Descriptor::Prp { prp2: Some(IovaRange::new(Iova(0x80_0000), 16)) },
            ..good()
        };
        let ok = check(prp, layered(1)).unwrap();
        assert_eq!(ok.desc_iova, 0x80_0000);
        assert_eq!(u32::from(ok.descriptor_kind), abi::GIO_DESCRIPTOR_PRP);
        // With 0x10 descriptor stride, layer 0x200 puts the list outside its 0x1000-byte range.
        let fault = check(prp, IocbSpec { layer_count: 0x200, lba_stride_blocks: 0, mem_stride_bytes: 0, ..layered(1) }).unwrap_err();
        assert!(matches!(fault, IoctxFault::OutsideRegisteredMemory { what: "descriptor", layer: 0x1FF, .. }), "{fault:?}");
    }

    #[test]
    fn a_prp_transfer_past_one_page_is_refused_without_a_prp2_that_covers_it() {
        // Goal: PRP2 is checked against what the controller reads or writes through it. A
        // page-aligned 16 x 512-byte transfer spans two memory pages: without PRP2 the
        // controller would take PRP2 = 0 as the second page (a DMA to IOVA 0), so it is
        // refused; so are a second page too short for the rest of the data, a PRP list shorter
        // than 8 bytes per page after the first, and a PRP2 on a transfer inside one page.
        let prp = |block_count: u32, data: u64, prp2: Option<(u64, u64)>| IoctxSpec {
            block_count,
            data: Iova(data),
            descriptor: Descriptor::Prp { prp2: prp2.map(|(start, len)| IovaRange::new(Iova(start), len)) },
            ..good()
        };
        let refused = [
            prp(16, 0x10_0000, None),
            prp(16, 0x10_0000, Some((0x80_0000, 8))),
            prp(24, 0x10_0000, Some((0x80_0000, 8))),
            prp(8, 0x10_0000, Some((0x80_0000, 0x1000))),
            // 4 KiB starting half way into a page touches two pages.
            prp(8, 0x10_0800, None),
        ];
        for (index, spec) in refused.into_iter().enumerate() {
            let fault = check(spec, layered(1)).expect_err(&format!("case {index}: {spec:?}"));
            assert!(matches!(fault, IoctxFault::PrpMismatch { .. }), "case {index}: {fault}");
        }
        let accepted = [
            prp(8, 0x10_0000, None),
            prp(16, 0x10_0000, Some((0x80_0000, 0x1000))),
            prp(8, 0x10_0800, Some((0x80_0000, 0x800))),
            prp(24, 0x10_0000, Some((0x80_0000, 16))),
        ];
        for (index, spec) in accepted.into_iter().enumerate() {
            assert!(check(spec, layered(1)).is_ok(), "case {index}: {spec:?}");
        }
    }

    #[test]
    fn a_descriptor_at_iova_zero_is_refused() {
        // Goal: desc_iova 0 means "no descriptor" in the record, so a segment or PRP2 at IOVA 0
        // (registered) would silently become an inline data block or no PRP2: refused.
        let iocb = IocbSpec::single(Opcode::Read, 0);
        let low = RegisteredMemory::new(vec![IovaRange::new(Iova(0), 0x1_0000)]).unwrap();
        let segment =
            IoctxSpec { data: Iova(0x1000), descriptor: Descriptor::SglSegment { segment: IovaRange::new(Iova(0), 32) }, ..good() };
        let fault = encode_ioctx(&segment, &iocb, &devices(), &low).expect_err("SGL segment at 0");
        assert_eq!(fault, IoctxFault::DescriptorAtZero { what: "SGL segment" });
        let prp = IoctxSpec {
            block_count: 16,
            data: Iova(0x1000),
            descriptor: Descriptor::Prp { prp2: Some(IovaRange::new(Iova(0), 0x1000)) },
            ..good()
        };
        let fault = encode_ioctx(&prp, &iocb, &devices(), &low).expect_err("PRP2 at 0");
        assert_eq!(fault, IoctxFault::DescriptorAtZero { what: "PRP2" });
        let moved = IoctxSpec { descriptor: Descriptor::Prp { prp2: Some(IovaRange::new(Iova(0x2000), 0x1000)) }, ..prp };
        assert!(encode_ioctx(&moved, &iocb, &devices(), &low).is_ok(), "the same PRP2 one page up is fine");
    }

    #[test]
    fn prp_pages_are_counted_at_every_layer() {
        // Goal: when the layer stride moves the data inside its page, the page count is taken
        // where it is largest; PRP2 must stay aligned at every layer, and a request that would
        // make PRP2 a data page at one layer and a list at another is refused.
        let one_block = IoctxSpec { block_count: 1, descriptor: Descriptor::Prp { prp2: None }, ..good() };
        let strided = |layers: u32, mem: u64, desc: u64| IocbSpec {
            layer_count: layers,
            lba_stride_blocks: 0,
            mem_stride_bytes: mem,
            desc_stride_bytes: desc,
            ..layered(1)
        };
        // 512 bytes stepping 512 bytes a layer never crosses a page.
        assert!(check(one_block, strided(16, 512, 0)).is_ok());
        // 512 bytes stepping 256 bytes a layer crosses one at layer 15 (offset 3840).
        let fault = check(one_block, strided(16, 256, 0)).unwrap_err();
        assert!(matches!(fault, IoctxFault::PrpMismatch { pages_max: 2, .. }), "{fault}");
        // With the second page (page aligned, moving a page a layer) it passes; a list-sized
        // stride of 8 bytes would leave it misaligned.
        let second = IoctxSpec { descriptor: Descriptor::Prp { prp2: Some(IovaRange::new(Iova(0x80_0000), 0x100)) }, ..one_block };
        assert!(check(second, strided(16, 256, 0)).is_ok());
        assert!(matches!(check(second, strided(2, 0x1000 + 0x100, 8)), Err(IoctxFault::PrpMismatch { .. })));
        // 8 KiB starting at offsets 0 and 0x800: two pages at layer 0, three at layer 1.
        let two_pages =
            IoctxSpec { block_count: 16, descriptor: Descriptor::Prp { prp2: Some(IovaRange::new(Iova(0x80_0000), 0x800)) }, ..good() };
        let fault = check(two_pages, strided(2, 0x800, 0)).unwrap_err();
        assert!(matches!(fault, IoctxFault::PrpMismatch { pages_min: 2, pages_max: 3, .. }), "{fault}");
        // A list that moves by a multiple of 8 bytes a layer stays aligned.
        let list = IoctxSpec { block_count: 24, descriptor: Descriptor::Prp { prp2: Some(IovaRange::new(Iova(0x80_0000), 16)) }, ..good() };
        assert!(check(list, strided(4, 0x3000, 16)).is_ok());
        assert!(matches!(check(list, strided(4, 0x3000, 12)), Err(IoctxFault::PrpMismatch { .. })));
    }

    #[test]
    fn a_prp_list_that_crosses_a_memory_page_at_any_layer_is_refused() {
        // Goal: the controller reads the last entry of a list page as a pointer to the next
        // list page when more entries are needed (NVMe §4.1.1), so a list that crosses a page
        // would make it take a data page for a list and move data to whatever addresses its
        // bytes spell. A list must fit in its page at every layer (which caps it at 512
        // entries); one ending exactly at the page end is fine.
        let list = |start: u64, len: u64| IoctxSpec {
            device: DeviceIndex(1),
            block_count: 3,
            data: Iova(0x10_0000),
            descriptor: Descriptor::Prp { prp2: Some(IovaRange::new(Iova(start), len)) },
            ..good()
        };
        let strided = |layers: u32, desc: u64| IocbSpec {
            layer_count: layers,
            lba_stride_blocks: 0,
            mem_stride_bytes: 0x3000,
            desc_stride_bytes: desc,
            ..layered(1)
        };
        // Two entries at page offset 0xFF8: the second is in the next page.
        let fault = check(list(0x10_0FF8, 16), layered(1)).unwrap_err();
        assert!(matches!(fault, IoctxFault::PrpMismatch { pages_max: 3, .. }), "{fault}");
        // Fits at layer 0 (0xFE8..0xFF8) and 1, crosses at layer 2 (0xFF8..0x1008).
        assert!(check(list(0x10_0FE8, 16), strided(2, 8)).is_ok());
        let fault = check(list(0x10_0FE8, 16), strided(3, 8)).unwrap_err();
        assert!(matches!(fault, IoctxFault::PrpMismatch { .. }), "{fault}");
        // Ending exactly at the page end, and moving a page a layer, is fine.
        assert!(check(list(0x10_0FF0, 16), layered(1)).is_ok());
        assert!(check(list(0x10_0FF0, 16), strided(3, 0x1000)).is_ok());
        // Wrapping past the page end with a 16-byte step stays inside: offsets are 0xFF0 mod 16.
        assert!(check(list(0x10_0FF0, 16), strided(3, 0x1010)).is_ok());
        // More than 512 entries cannot fit in one page, wherever the list starts.
        let big = RegisteredMemory::new(vec![IovaRange::new(Iova(0x100_0000), 0x100_0000)]).unwrap();
        let long = IoctxSpec {
            device: DeviceIndex(1),
            block_count: 514,
            data: Iova(0x100_0000),
            descriptor: Descriptor::Prp { prp2: Some(IovaRange::new(Iova(0x180_0000), 513 * 8)) },
            ..good()
        };
        let fault = encode_ioctx(&long, &layered(1), &devices(), &big).unwrap_err();
        assert!(matches!(fault, IoctxFault::PrpMismatch { pages_max: 514, .. }), "{fault}");
        let longest =
            IoctxSpec { block_count: 513, descriptor: Descriptor::Prp { prp2: Some(IovaRange::new(Iova(0x180_0000), 512 * 8)) }, ..long };
        assert!(encode_ioctx(&longest, &layered(1), &devices(), &big).is_ok());
    }

    #[test]
    fn a_transfer_above_the_devices_limit_or_unaligned_data_is_refused() {
        // Goal: the CPU executors send one command per IOCTX without the driver's checks, so
        // what a device would refuse at every issue is refused at the fill: 64 x 4 KiB (256 KiB)
        // on a device whose MDTS is 128 KiB (nvme-emu's default answers INVALID_FIELD), and data
        // not dword aligned at some layer (PRP1 and an SGL data block; INVALID_PRP_OFFSET).
        let device = DeviceInfo { nsid: 1, capacity_blocks: 1 << 20, block_bytes: 4096, sgl_supported: true };
        let limited = DeviceTable::with_max_transfer_bytes(vec![(device, 128 << 10)]);
        let spec = |block_count: u32, data: u64| IoctxSpec { block_count, data: Iova(data), ..good() };
        let fault = encode_ioctx(&spec(64, 0x10_0000), &layered(1), &limited, &memory()).unwrap_err();
        assert_eq!(fault, IoctxFault::TransferTooLarge { data_bytes: 256 << 10, max_transfer_bytes: 128 << 10 });
        assert!(encode_ioctx(&spec(32, 0x10_0000), &layered(1), &limited, &memory()).is_ok(), "128 KiB fits");
        assert!(encode_ioctx(&spec(64, 0x10_0000), &layered(1), &DeviceTable::new(vec![device]), &memory()).is_ok(), "no limit given");
        // Through fill_iocb: refused, naming the IOCTX.
        let config = crate::layout::QueueConfig { depth: 2, ioctx_per_iocb_max: 2 };
        let executor = crate::executor::test_double::MemoryExecutor::default();
        let mut queue = crate::queue::GioQueue::init_queue(config, limited.clone(), memory(), executor).unwrap();
        let id = queue.get_iocb(1, crate::types::Dependency::None).unwrap()[0];
        let filled = queue.fill_iocb(id, &layered(1), &[spec(32, 0x10_0000), spec(64, 0x10_8000)]);
        assert!(
            matches!(filled, Err(crate::GioError::InvalidIoctx { index: 1, fault: IoctxFault::TransferTooLarge { .. }, .. })),
            "{filled:?}"
        );
        // Dword alignment, at the first and at a later layer, PRP and SGL alike.
        let fault = check(spec(1, 0x10_0002), layered(1)).unwrap_err();
        assert_eq!(fault, IoctxFault::UnalignedData { data_iova: 0x10_0002, layer: 0 });
        let prp = IoctxSpec { device: DeviceIndex(1), descriptor: Descriptor::Prp { prp2: None }, ..spec(1, 0x10_0001) };
        assert!(matches!(check(prp, layered(1)), Err(IoctxFault::UnalignedData { layer: 0, .. })));
        let strided = IocbSpec { mem_stride_bytes: 0x1002, ..layered(2) };
        assert_eq!(check(spec(1, 0x10_0000), strided).unwrap_err(), IoctxFault::UnalignedData { data_iova: 0x10_1002, layer: 1 });
        assert!(check(spec(1, 0x10_0004), IocbSpec { mem_stride_bytes: 0x1004, ..layered(2) }).is_ok());
    }

    #[test]
    fn an_interval_cannot_run_from_one_registration_into_the_next() {
        // Goal: two touching registrations are not one: a request whose last layer falls in
        // the second is refused; the same bytes registered as one range pass.
        let iocb = IocbSpec { layer_count: 2, mem_stride_bytes: 0x1000, ..IocbSpec::single(Opcode::Read, 0) };
        let spec = IoctxSpec { start_lba: Lba(0), block_count: 1, data: Iova(0x2000), ..good() };
        let touching = RegisteredMemory::new(vec![IovaRange::new(Iova(0x3000), 0x1000), IovaRange::new(Iova(0x2000), 0x1000)]).unwrap();
        assert!(matches!(encode_ioctx(&spec, &iocb, &devices(), &touching), Err(IoctxFault::OutsideRegisteredMemory { layer: 1, .. })));
        let one = RegisteredMemory::new(vec![IovaRange::new(Iova(0x2000), 0x2000)]).unwrap();
        assert!(encode_ioctx(&spec, &iocb, &devices(), &one).is_ok());
    }

    #[test]
    fn overlapping_registrations_are_refused() {
        assert!(RegisteredMemory::new(vec![IovaRange::new(Iova(0), 0x2000), IovaRange::new(Iova(0x1000), 0x1000),]).is_none());
        assert!(RegisteredMemory::new(vec![IovaRange::new(Iova(u64::MAX), 2)]).is_none());
    }

    mod quick_and_detailed_checks {
        use super::*;
        use crate::layout::ioctx_words;
        use proptest::prelude::*;

        /// Mostly plausible values near the limits of `devices()` / `memory()` (so both outcomes
        /// are common), sometimes anything (overflow, far off).
        fn near(plausible: std::ops::Range<u64>) -> impl Strategy<Value = u64> {
            prop_oneof![8 => plausible, 1 => (u64::MAX - 0x4000)..=u64::MAX, 1 => any::<u64>()]
        }

        fn spec() -> impl Strategy<Value = IoctxSpec> {
            let descriptor = prop_oneof![
                Just(Descriptor::SglInline),
                (near(0x80_0f00..0x80_1010), prop_oneof![(0u64..6).prop_map(|n| n * 16), 0u64..100, any::<u64>()])
                    .prop_map(|(start, len)| Descriptor::SglSegment { segment: IovaRange::new(Iova(start), len) }),
                proptest::option::of((
                    prop_oneof![near(0x80_0f00..0x80_1010), (0u64..8).prop_map(|n| 0x80_0000 + n * 0x200), 0u64..16],
                    prop_oneof![0u64..0x200, (0u64..0x40).prop_map(|n| n * 8), Just(0x1000)]
                ))
                .prop_map(|range| Descriptor::Prp { prp2: range.map(|(start, len)| IovaRange::new(Iova(start), len)) }),
            ];
            let lba = prop_oneof![near(900..1010), near((1 << 20) - 300..(1 << 20) + 10)];
            let data = prop_oneof![near(0x1F_0000..0x20_0010), near(0x10_0000 - 16..0x10_1000), near(0x80_0000..0x80_1010)];
            (
                prop_oneof![8 => 0u16..2, 1 => 2u16..4],
                prop_oneof![8 => Just(1u32), 1 => 0u32..3],
                lba,
                prop_oneof![8 => 0u32..40, 1 => 65530u32..65540, 1 => any::<u32>()],
                data,
                descriptor,
                any::<bool>(),
            )
                .prop_map(|(device, nsid, start_lba, block_count, data, descriptor, fua)| IoctxSpec {
                    device: DeviceIndex(device),
                    nsid,
                    start_lba: Lba(start_lba),
                    block_count,
                    data: Iova(data),
                    descriptor,
                    force_unit_access: fua,
                })
        }

        fn iocb() -> impl Strategy<Value = IocbSpec> {
            let mem = prop_oneof![near(0..0x3000), (0u64..3).prop_map(|pages| pages * 0x1000)];
            let desc = prop_oneof![near(0..0x40), (0u64..3).prop_map(|entries| entries * 8)];
            let opcode = prop_oneof![Just(Opcode::Write), Just(Opcode::Read)];
            (prop_oneof![8 => 1u32..5, 1 => any::<u32>()], near(0..40), mem, desc, opcode).prop_map(|(layers, lba, mem, desc, opcode)| {
                IocbSpec {
                    opcode,
                    user_data: 0,
                    layer_count: layers,
                    lba_stride_blocks: lba,
                    mem_stride_bytes: mem,
                    desc_stride_bytes: desc,
                }
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

            #[test]
            fn accept_the_same_ioctxs_and_encode_the_same_words(spec in spec(), iocb in iocb()) {
                // Goal: the fast path is an optimisation only: it accepts exactly what the
                // fault-by-fault check accepts, and the words equal the record's layout.
                let (devices, memory) = (devices(), memory());
                let encoder = IoctxEncoder::new(&iocb, &devices, &memory);
                let quick = encoder.check_quickly(&spec);
                let detailed = encoder.check_in_detail(&spec);
                prop_assert_eq!(quick.is_some(), detailed.is_ok(), "quick {:?} vs detailed {:?}", quick, detailed);
                if let (Some(quick), Ok(detailed)) = (quick, detailed) {
                    prop_assert_eq!((quick.lengths_word, quick.desc_iova, quick.kind), (detailed.lengths_word, detailed.desc_iova, detailed.kind));
                    let record = encoder.encode(&spec).unwrap();
                    prop_assert_eq!(encoder.encode_words(&spec).unwrap(), ioctx_words(&record));
                }
            }
        }

        #[test]
        fn the_generators_reach_both_outcomes() {
            // Goal: the property above is not vacuous: good() passes quickly, and edges fail.
            let (devices, memory) = (devices(), memory());
            let iocb = layered(9);
            let encoder = IoctxEncoder::new(&iocb, &devices, &memory);
            assert!(encoder.check_quickly(&good()).is_some());
            let list =
                IoctxSpec { block_count: 24, descriptor: Descriptor::Prp { prp2: Some(IovaRange::new(Iova(0x80_0000), 16)) }, ..good() };
            assert!(encoder.check_quickly(&list).is_some(), "a PRP list passes quickly");
            assert!(encoder.check_quickly(&IoctxSpec { block_count: 16, ..list }).is_none(), "a list where a page is due");
            let past_capacity = IoctxSpec { start_lba: Lba(1000 - 8 - 8 * 100 + 1), ..good() };
            assert!(encoder.check_quickly(&past_capacity).is_none());
            assert!(encoder.check_in_detail(&past_capacity).is_err());
        }
    }
}
