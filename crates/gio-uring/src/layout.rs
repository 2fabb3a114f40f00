//! Where everything of one queue lives in its shared region, and typed, copy-in/copy-out access to
//! the IOCB and IOCTX records (never a reference into shared memory).
//!
//! One region per queue, allocated once by `init_queue`:
//!
//! ```text
//! [SQ header 256][SQ entries: depth x u32][CQ header 256][CQ entries: depth x 16]
//! [IOCBs: depth x 128][IOCTXs: depth x ioctx_per_iocb_max x 48]
//! ```
//! Each part starts on a cache line. IOCB `i` owns IOCTXs `[i * max, (i + 1) * max)`, so handing out
//! IOCBs never allocates. Back of the envelope: depth 64 x 2048 IOCTXs x 48 B = 6 MiB per queue.

use core::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::abi::{self, gio_cqe, gio_iocb, gio_ioctx, gio_ring_header, CACHE_LINE_BYTES};
use crate::error::GioError;
use crate::shared_memory::{SharedRegion, REGION_ALIGN_BYTES};
use crate::types::{IocbId, LayerIndex};

/// Sizes fixed at `init_queue`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueConfig {
    /// IOCBs in the pool and entries in each ring: a power of two in `2..=GIO_RING_DEPTH_MAX`.
    pub depth: u32,
    /// IOCTX capacity of each IOCB, `1..=GIO_MAX_IOCTX_PER_IOCB`.
    pub ioctx_per_iocb_max: u32,
}

impl QueueConfig {
    /// `depth` IOCBs of the ABI's maximum of 2048 IOCTXs each.
    pub fn with_depth(depth: u32) -> Self {
        Self { depth, ioctx_per_iocb_max: abi::MAX_IOCTX_PER_IOCB }
    }

    fn validate(&self) -> Result<(), GioError> {
        if !self.depth.is_power_of_two() || self.depth < 2 || self.depth > abi::GIO_RING_DEPTH_MAX {
            return Err(GioError::InvalidConfig {
                reason: format!("depth {} is not a power of two in 2..={}", self.depth, abi::GIO_RING_DEPTH_MAX),
            });
        }
        if self.ioctx_per_iocb_max == 0 || self.ioctx_per_iocb_max > abi::MAX_IOCTX_PER_IOCB {
            return Err(GioError::InvalidConfig {
                reason: format!("ioctx_per_iocb_max {} outside 1..={}", self.ioctx_per_iocb_max, abi::MAX_IOCTX_PER_IOCB),
            });
        }
        Ok(())
    }
}

/// Byte offsets of one ring (header + entries) inside the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingLayout {
    pub header_offset_bytes: usize,
    pub entries_offset_bytes: usize,
    pub depth: u32,
}

impl RingLayout {
    pub fn head_offset(&self) -> usize {
        self.header_offset_bytes + offset_of!(gio_ring_header, head)
    }
    pub fn tail_offset(&self) -> usize {
        self.header_offset_bytes + offset_of!(gio_ring_header, tail)
    }
    pub fn mask(&self) -> u32 {
        self.depth - 1
    }
}

/// Byte offsets of every part of a queue's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLayout {
    pub config: QueueConfig,
    pub sq: RingLayout,
    pub cq: RingLayout,
    pub iocbs_offset_bytes: usize,
    pub ioctxs_offset_bytes: usize,
    pub total_bytes: usize,
}

fn align_up(value: usize, align: usize) -> Option<usize> {
    value.checked_add(align - 1).map(|v| v / align * align)
}

impl QueueLayout {
    pub fn new(config: QueueConfig) -> Result<Self, GioError> {
        config.validate()?;
        let overflow = || GioError::InvalidConfig { reason: format!("{config:?} does not fit the address space") };
        let depth = config.depth as usize;
        let header = size_of::<gio_ring_header>();
        let mut cursor = 0usize;
        let mut take = |bytes: usize| -> Option<usize> {
            let start = align_up(cursor, CACHE_LINE_BYTES)?;
            cursor = start.checked_add(bytes)?;
            Some(start)
        };
        let sq_header = take(header).ok_or_else(overflow)?;
        let sq_entries = take(depth * size_of::<u32>()).ok_or_else(overflow)?;
        let cq_header = take(header).ok_or_else(overflow)?;
        let cq_entries = take(depth * size_of::<gio_cqe>()).ok_or_else(overflow)?;
        let iocbs = take(depth * size_of::<gio_iocb>()).ok_or_else(overflow)?;
        let ioctx_bytes = depth
            .checked_mul(config.ioctx_per_iocb_max as usize)
            .and_then(|n| n.checked_mul(size_of::<gio_ioctx>()))
            .ok_or_else(overflow)?;
        let ioctxs = take(ioctx_bytes).ok_or_else(overflow)?;
        let total_bytes = align_up(cursor, CACHE_LINE_BYTES).ok_or_else(overflow)?;
        Ok(Self {
            config,
            sq: RingLayout { header_offset_bytes: sq_header, entries_offset_bytes: sq_entries, depth: config.depth },
            cq: RingLayout { header_offset_bytes: cq_header, entries_offset_bytes: cq_entries, depth: config.depth },
            iocbs_offset_bytes: iocbs,
            ioctxs_offset_bytes: ioctxs,
            total_bytes,
        })
    }

    pub fn iocb_offset(&self, id: IocbId) -> usize {
        assert!(id.0 < self.config.depth, "{id} outside depth {}", self.config.depth);
        self.iocbs_offset_bytes + id.0 as usize * size_of::<gio_iocb>()
    }

    /// First IOCTX (index into the shared IOCTX array) owned by IOCB `id`.
    pub fn ioctx_first(&self, id: IocbId) -> u32 {
        id.0 * self.config.ioctx_per_iocb_max
    }

    pub fn ioctx_capacity(&self) -> u32 {
        self.config.depth * self.config.ioctx_per_iocb_max
    }

    #[inline]
    pub fn ioctx_offset(&self, array_index: u32) -> usize {
        assert!(array_index < self.ioctx_capacity(), "IOCTX {array_index} outside the array");
        self.ioctxs_offset_bytes + array_index as usize * size_of::<gio_ioctx>()
    }
}

/// A queue's shared region together with its layout; shared by the queue and its executor.
///
/// The region, and the writes of the records the queue validates (line 0 of an IOCB, the
/// IOCTXs), are crate-private: code outside the crate, which reaches a `QueueMemory` through
/// [`crate::GioQueue::memory`] or an executor's arguments, cannot rewrite a validated record
/// between `fill_iocb` and `issue_io`.
///
/// ```compile_fail
/// fn rewrite(memory: &gio_uring::layout::QueueMemory) {
///     memory.region.store_u64(0, 0, std::sync::atomic::Ordering::Relaxed);
/// }
/// ```
#[derive(Debug)]
pub struct QueueMemory {
    pub(crate) region: SharedRegion,
    pub layout: QueueLayout,
    /// CQEs a CPU executor could not post yet (`executor::post_cqe_or_keep`), up to the depth.
    pub(crate) kept_cqes: crate::executor::KeptCqes,
    /// Per IOCB: a CPU executor took its issue off the SQ ([`FilledLines::take`]) and it has
    /// not ended yet. Host memory no other agent can write, unlike the IOCB's `status`: set only
    /// by the thread that consumes the SQ, cleared by whichever thread ends the issue (the
    /// compare-and-swap off ISSUED in [`crate::executor::complete_ioctx`] or
    /// `cpu_executor::finish_as_timeout_with`, before its CQE is posted) and by a reset once no
    /// old command can complete. The GPU executor never sets it.
    issues_taken: Box<[AtomicBool]>,
    /// Per IOCB: IOCTXs of the issue a CPU executor took that have not completed yet, set from
    /// the validated line 0 when the issue is taken ([`FilledLines::take`]) and counted down
    /// by [`crate::executor::complete_ioctx`]; the one completion that takes it to zero ends
    /// the issue. Host memory no other agent can write: the shared `completed_ioctx_count` is
    /// only a mirror for the ABI (the GPU kernel counts there), so a rewritten one cannot make
    /// an IOCB end while some of its commands still move data.
    ioctxs_left: Box<[AtomicU32]>,
    /// Per IOCB: the sequence number [`crate::GioQueue::issue_io`] gave its last issue. Host
    /// memory no other agent can write, unlike line 0's `issue_seq`: what a reset ends an
    /// issue no submit took with ([`FilledLines::timeout_seq`]), the number a take checks
    /// against the last taken ([`FilledLines::takeable`]: one more, or no new issue) and the
    /// one a fill records ([`FilledLines::record`]).
    issues_given: Box<[AtomicU32]>,
}

macro_rules! field {
    ($ty:ty, $field:ident) => {
        offset_of!($ty, $field)
    };
}

/// 8-byte words in one `gio_ioctx` (48 bytes, no padding: `reserved0` fills the tail).
pub const IOCTX_WORDS: usize = size_of::<gio_ioctx>() / 8;
const _: () = assert!(size_of::<gio_ioctx>() == IOCTX_WORDS * 8);

// The packing below assumes the little-endian C layout of `gio_ioctx` (the NVMe and GPU side
// are little-endian too); these pin the offsets it relies on.
#[cfg(not(target_endian = "little"))]
compile_error!("gio-uring packs shared records for little-endian hosts only");
const _: () = {
    assert!(offset_of!(gio_ioctx, desc_iova) == 0 && offset_of!(gio_ioctx, data_iova) == 8);
    assert!(offset_of!(gio_ioctx, start_lba) == 16 && offset_of!(gio_ioctx, nsid) == 24);
    assert!(offset_of!(gio_ioctx, block_count) == 28 && offset_of!(gio_ioctx, data_bytes) == 32);
    assert!(offset_of!(gio_ioctx, desc_bytes) == 36 && offset_of!(gio_ioctx, device_index) == 40);
    assert!(offset_of!(gio_ioctx, descriptor_kind) == 42 && offset_of!(gio_ioctx, flags) == 43);
    assert!(offset_of!(gio_ioctx, reserved0) == 44);
};

/// A `gio_ioctx` as the words of its C layout, so a record is stored with six 8-byte atomic
/// stores. Built with shifts, not through a byte buffer: narrow stores re-read as wide loads
/// stall store forwarding, which showed in the per-block cost of `prepare_*`.
#[inline]
pub fn ioctx_words(ioctx: &gio_ioctx) -> [u64; IOCTX_WORDS] {
    [
        ioctx.desc_iova,
        ioctx.data_iova,
        ioctx.start_lba,
        u64::from(ioctx.nsid) | u64::from(ioctx.block_count) << 32,
        u64::from(ioctx.data_bytes) | u64::from(ioctx.desc_bytes) << 32,
        u64::from(ioctx.device_index)
            | u64::from(ioctx.descriptor_kind) << 16
            | u64::from(ioctx.flags) << 24
            | u64::from(ioctx.reserved0) << 32,
    ]
}

/// The CPU-written line of an IOCB (line 0 of `gio_iocb`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IocbHeader {
    pub id: u32,
    pub ioctx_count: u32,
    pub ioctx_first: u32,
    pub layer_count: u32,
    pub layer: u32,
    pub issue_seq: u32,
    pub opcode: u8,
    pub user_data: u64,
    pub lba_stride_blocks: u64,
    pub mem_stride_bytes: u64,
    pub desc_stride_bytes: u64,
}

/// The executor-written line of an IOCB (line 1 of `gio_iocb`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IocbProgress {
    pub status: u32,
    pub completed_ioctx_count: u32,
    pub failed_ioctx: u32,
    pub failed_nvme_status: u16,
    pub failed_status: u16,
}

impl IocbProgress {
    /// The state the CPU resets an IOCB to when it issues it.
    pub const ISSUED: IocbProgress = IocbProgress {
        status: abi::GIO_IOCB_STATUS_ISSUED,
        completed_ioctx_count: 0,
        failed_ioctx: abi::GIO_NO_FAILED_IOCTX,
        failed_nvme_status: 0,
        failed_status: 0,
    };
}

impl QueueMemory {
    pub fn new(config: QueueConfig) -> Result<Self, GioError> {
        let layout = QueueLayout::new(config)?;
        // Whole pages: the region may be registered with a GPU, which pins pages, and two
        // registrations must never share one.
        let len_bytes = layout.total_bytes.div_ceil(REGION_ALIGN_BYTES) * REGION_ALIGN_BYTES;
        let region = SharedRegion::allocate_host(len_bytes)?;
        let issues_taken = (0..config.depth).map(|_| AtomicBool::new(false)).collect();
        let ioctxs_left = (0..config.depth).map(|_| AtomicU32::new(0)).collect();
        let issues_given = (0..config.depth).map(|_| AtomicU32::new(0)).collect();
        let kept_cqes = crate::executor::KeptCqes::new(config.depth);
        let memory = Self { region, layout, kept_cqes, issues_taken, ioctxs_left, issues_given };
        for ring in [layout.sq, layout.cq] {
            let base = ring.header_offset_bytes;
            memory.region.store_u32(base + field!(gio_ring_header, mask), ring.mask(), Ordering::Relaxed);
            memory.region.store_u32(base + field!(gio_ring_header, entry_count), ring.depth, Ordering::Relaxed);
        }
        for id in 0..config.depth {
            let offset = layout.iocb_offset(IocbId(id));
            memory.region.store_u32(offset + field!(gio_iocb, id), id, Ordering::Relaxed);
            memory.region.store_u32(offset + field!(gio_iocb, ioctx_first), layout.ioctx_first(IocbId(id)), Ordering::Relaxed);
            memory.region.store_u32(offset + field!(gio_iocb, failed_ioctx), abi::GIO_NO_FAILED_IOCTX, Ordering::Relaxed);
        }
        Ok(memory)
    }

    /// Whether a CPU executor took the issue of `id` off the SQ and has not ended it yet (see
    /// [`QueueMemory::issues_taken`]); `false` for an id outside the pool.
    pub(crate) fn issue_taken(&self, id: IocbId) -> bool {
        self.issues_taken.get(id.0 as usize).is_some_and(|taken| taken.load(Ordering::Acquire))
    }

    /// Notes that the issue of `id` a CPU executor took has ended (or can no longer run: its
    /// queue pairs were deleted). Release, and before the issue's CQE is posted: the consumer
    /// of the IOCB's next issue sees it cleared.
    pub(crate) fn end_issue_taken(&self, id: IocbId) {
        if let Some(taken) = self.issues_taken.get(id.0 as usize) {
            taken.store(false, Ordering::Release);
        }
    }

    /// Notes the sequence number the queue gave the issue of `id` it is publishing (see
    /// [`QueueMemory::issues_given`]). Release, before the SQ tail publishes the issue.
    pub(crate) fn note_issue_given(&self, id: IocbId, issue_seq: u32) {
        if let Some(given) = self.issues_given.get(id.0 as usize) {
            given.store(issue_seq, Ordering::Release);
        }
    }

    /// The sequence number the queue gave the last issue of `id` (0 before its first issue,
    /// and for an id outside the pool).
    pub(crate) fn issue_given(&self, id: IocbId) -> u32 {
        self.issues_given.get(id.0 as usize).map_or(0, |given| given.load(Ordering::Acquire))
    }

    /// Notes that the issue of `id` just taken runs `ioctx_count` IOCTXs (see
    /// [`QueueMemory::ioctxs_left`]). Release: the threads completing them are handed the IOCB
    /// after this (through the executor's own state or a channel).
    pub(crate) fn arm_issue(&self, id: IocbId, ioctx_count: u32) {
        if let Some(left) = self.ioctxs_left.get(id.0 as usize) {
            left.store(ioctx_count, Ordering::Release);
        }
    }

    /// Counts one completed IOCTX of the issue of `id` in flight: `Some(true)` when it was the
    /// last, `Some(false)` when some are left, `None` when none was outstanding (more
    /// completions than the issue's IOCTXs, or an id outside the pool): nothing is counted.
    /// AcqRel, so the thread that counts the last one has seen every earlier failure record.
    pub(crate) fn count_ioctx_done(&self, id: IocbId) -> Option<bool> {
        let left = self.ioctxs_left.get(id.0 as usize)?;
        let previous = left.fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| left.checked_sub(1)).ok()?;
        Some(previous == 1)
    }

    /// Writes the CPU line of an IOCB. Relaxed: published by the SQ tail's Release store.
    pub(crate) fn write_iocb_header(&self, id: IocbId, header: &IocbHeader) {
        let base = self.layout.iocb_offset(id);
        let r = &self.region;
        let o = Ordering::Relaxed;
        r.store_u32(base + field!(gio_iocb, id), header.id, o);
        r.store_u32(base + field!(gio_iocb, ioctx_count), header.ioctx_count, o);
        r.store_u32(base + field!(gio_iocb, ioctx_first), header.ioctx_first, o);
        r.store_u32(base + field!(gio_iocb, layer_count), header.layer_count, o);
        r.store_u32(base + field!(gio_iocb, layer), header.layer, o);
        r.store_u32(base + field!(gio_iocb, issue_seq), header.issue_seq, o);
        r.store_u8(base + field!(gio_iocb, opcode), header.opcode, o);
        r.store_u64(base + field!(gio_iocb, user_data), header.user_data, o);
        r.store_u64(base + field!(gio_iocb, lba_stride_blocks), header.lba_stride_blocks, o);
        r.store_u64(base + field!(gio_iocb, mem_stride_bytes), header.mem_stride_bytes, o);
        r.store_u64(base + field!(gio_iocb, desc_stride_bytes), header.desc_stride_bytes, o);
    }

    /// Reads the CPU line of an IOCB; the caller has acquired the SQ tail that published it.
    pub fn read_iocb_header(&self, id: IocbId) -> IocbHeader {
        let base = self.layout.iocb_offset(id);
        let r = &self.region;
        let o = Ordering::Relaxed;
        IocbHeader {
            id: r.load_u32(base + field!(gio_iocb, id), o),
            ioctx_count: r.load_u32(base + field!(gio_iocb, ioctx_count), o),
            ioctx_first: r.load_u32(base + field!(gio_iocb, ioctx_first), o),
            layer_count: r.load_u32(base + field!(gio_iocb, layer_count), o),
            layer: r.load_u32(base + field!(gio_iocb, layer), o),
            issue_seq: r.load_u32(base + field!(gio_iocb, issue_seq), o),
            opcode: r.load_u8(base + field!(gio_iocb, opcode), o),
            user_data: r.load_u64(base + field!(gio_iocb, user_data), o),
            lba_stride_blocks: r.load_u64(base + field!(gio_iocb, lba_stride_blocks), o),
            mem_stride_bytes: r.load_u64(base + field!(gio_iocb, mem_stride_bytes), o),
            desc_stride_bytes: r.load_u64(base + field!(gio_iocb, desc_stride_bytes), o),
        }
    }

    /// Reads the CPU line of an issued IOCB for an executor, which must not trust it: line 0
    /// is shared memory another agent can write. It must name itself (`id` is its position:
    /// kernels/gio_abi.h), own its IOCTXs (`ioctx_first` as the layout places them), hold
    /// `1..=ioctx_per_iocb_max` of them, and be issued for a layer below its layer count.
    /// Only then are offsets derived from it (the IOCTX records, its executor line) in bounds.
    pub fn read_issued_header(&self, id: IocbId) -> Result<IocbHeader, GioError> {
        let depth = self.layout.config.depth;
        if id.0 >= depth {
            return Err(GioError::UnknownIocb { id, depth });
        }
        let header = self.read_iocb_header(id);
        let corrupt = |field, value: u32, expected| Err(GioError::CorruptIocb { id, field, value: u64::from(value), expected });
        if header.id != id.0 {
            return corrupt("id", header.id, "its position in the pool");
        }
        if header.ioctx_first != self.layout.ioctx_first(id) {
            return corrupt("ioctx_first", header.ioctx_first, "the first IOCTX the layout gives it");
        }
        if header.ioctx_count == 0 || header.ioctx_count > self.layout.config.ioctx_per_iocb_max {
            return corrupt("ioctx_count", header.ioctx_count, "1..=the queue's IOCTXs per IOCB");
        }
        if header.layer >= header.layer_count {
            return corrupt("layer", header.layer, "below its layer count");
        }
        Ok(header)
    }

    /// Writes the executor line. `status` is stored last with `status_order` so that a reader that
    /// acquires `status` sees the other fields.
    pub fn write_iocb_progress(&self, id: IocbId, progress: &IocbProgress, status_order: Ordering) {
        let base = self.layout.iocb_offset(id);
        let r = &self.region;
        let o = Ordering::Relaxed;
        r.store_u32(base + field!(gio_iocb, completed_ioctx_count), progress.completed_ioctx_count, o);
        r.store_u32(base + field!(gio_iocb, failed_ioctx), progress.failed_ioctx, o);
        r.store_u16(base + field!(gio_iocb, failed_nvme_status), progress.failed_nvme_status, o);
        r.store_u16(base + field!(gio_iocb, failed_status), progress.failed_status, o);
        r.store_u32(base + field!(gio_iocb, status), progress.status, status_order);
    }

    pub fn read_iocb_progress(&self, id: IocbId) -> IocbProgress {
        let base = self.layout.iocb_offset(id);
        let r = &self.region;
        let status = r.load_u32(base + field!(gio_iocb, status), Ordering::Acquire);
        let o = Ordering::Relaxed;
        IocbProgress {
            status,
            completed_ioctx_count: r.load_u32(base + field!(gio_iocb, completed_ioctx_count), o),
            failed_ioctx: r.load_u32(base + field!(gio_iocb, failed_ioctx), o),
            failed_nvme_status: r.load_u16(base + field!(gio_iocb, failed_nvme_status), o),
            failed_status: r.load_u16(base + field!(gio_iocb, failed_status), o),
        }
    }

    /// Offset of an IOCB's executor-line field, for executors that update it atomically.
    pub fn iocb_field_offset(&self, id: IocbId, field: IocbField) -> usize {
        let base = self.layout.iocb_offset(id);
        base + match field {
            IocbField::Status => field!(gio_iocb, status),
            IocbField::CompletedIoctxCount => field!(gio_iocb, completed_ioctx_count),
            IocbField::FailedIoctx => field!(gio_iocb, failed_ioctx),
            IocbField::FailedNvmeStatus => field!(gio_iocb, failed_nvme_status),
            IocbField::FailedStatus => field!(gio_iocb, failed_status),
        }
    }

    #[cfg(test)]
    pub(crate) fn write_ioctx(&self, array_index: u32, ioctx: &gio_ioctx) {
        self.write_ioctx_record(array_index, &ioctx_words(ioctx));
    }

    /// Writes one IOCTX given as its words (six 8-byte stores after one bounds check). Only
    /// for an IOCB that is not in flight: executors read the record field by field, with
    /// narrower accesses, and only after the issue that publishes it (see
    /// [`SharedRegion::store_u64_array`]).
    #[inline]
    pub(crate) fn write_ioctx_record(&self, array_index: u32, words: &[u64; IOCTX_WORDS]) {
        self.region.store_u64_array(self.layout.ioctx_offset(array_index), words, Ordering::Relaxed);
    }

    pub fn read_ioctx(&self, array_index: u32) -> gio_ioctx {
        let base = self.layout.ioctx_offset(array_index);
        let r = &self.region;
        let o = Ordering::Relaxed;
        gio_ioctx {
            desc_iova: r.load_u64(base + field!(gio_ioctx, desc_iova), o),
            data_iova: r.load_u64(base + field!(gio_ioctx, data_iova), o),
            start_lba: r.load_u64(base + field!(gio_ioctx, start_lba), o),
            nsid: r.load_u32(base + field!(gio_ioctx, nsid), o),
            block_count: r.load_u32(base + field!(gio_ioctx, block_count), o),
            data_bytes: r.load_u32(base + field!(gio_ioctx, data_bytes), o),
            desc_bytes: r.load_u32(base + field!(gio_ioctx, desc_bytes), o),
            device_index: r.load_u16(base + field!(gio_ioctx, device_index), o),
            descriptor_kind: r.load_u8(base + field!(gio_ioctx, descriptor_kind), o),
            flags: r.load_u8(base + field!(gio_ioctx, flags), o),
            reserved0: 0,
        }
    }
}

/// Line 0 of each IOCB as `fill_iocb` wrote it, once validated: an executor's private copy,
/// taken when the IOCB is prepared (from [`crate::Executor::prepared`], right after the queue
/// wrote the line), in a table sized at construction or attach. At an issue the executor takes
/// the command-shaping fields (opcode, IOCTX count, layer count, strides) from this copy, never
/// from shared memory another agent can write, and refuses the IOCB when the shared line no
/// longer matches it. The layer comes from the issue itself and the issue sequence number from
/// this table's count (its copy's `issue_seq` is that of the last issue taken, see
/// [`FilledLines::take`]). An SQ entry is taken only for an IOCB that is ISSUED, not
/// already taken (in flight here), and given a new issue by the queue
/// ([`QueueMemory::issue_given`]): an entry another agent rewrote to name some other IOCB
/// never moves that IOCB's count. The CPU executors use it; the CUDA kernel reads line 0 from
/// device-visible memory itself.
#[derive(Debug, Default)]
pub(crate) struct FilledLines {
    lines: Vec<Option<IocbHeader>>,
}

impl FilledLines {
    pub(crate) fn new(depth: u32) -> Self {
        Self { lines: vec![None; depth as usize] }
    }

    /// Records IOCB `id`'s line 0 just written by `fill_iocb` (checked as an issued one: its
    /// own id and IOCTXs, a count within the maximum, layer 0 below its layer count). Its
    /// `issue_seq` is the number the queue gave the IOCB's last issue
    /// ([`QueueMemory::issue_given`]), not the shared line's: one rewritten between the fill
    /// and this copy would make the executor expect another number than the queue's next
    /// issue carries, and refuse every later issue of the IOCB.
    pub(crate) fn record(&mut self, memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
        let header = memory.read_issued_header(id)?;
        let depth = self.lines.len() as u32;
        let slot = self.lines.get_mut(id.0 as usize).ok_or(GioError::UnknownIocb { id, depth })?;
        *slot = Some(IocbHeader { issue_seq: memory.issue_given(id), ..header });
        Ok(())
    }

    /// Line 0 of issued IOCB `id` for building its commands: the copy recorded at the fill,
    /// with the issue's `layer` (from the batch) and its sequence number (one more than the
    /// last issue of `id` this executor took, see [`FilledLines::take`]: the queue adds one
    /// per issue). The shared line is checked ([`QueueMemory::read_issued_header`]) and must
    /// equal the copy in every field the fill wrote, and the issue in the layer and the
    /// sequence number, else [`GioError::CorruptIocb`] names the first field that differs.
    /// Takes nothing: the caller calls `take` once per SQ entry naming `id`.
    pub(crate) fn issued(&self, memory: &QueueMemory, id: IocbId, layer: LayerIndex) -> Result<IocbHeader, GioError> {
        let shared = memory.read_issued_header(id)?;
        let Some(filled) = self.lines.get(id.0 as usize).copied().flatten() else {
            return Err(GioError::CorruptIocb { id, field: "id", value: u64::from(id.0), expected: "an IOCB filled on this queue" });
        };
        let issue_seq = filled.issue_seq.wrapping_add(1);
        let fields = [
            ("ioctx_count", u64::from(shared.ioctx_count), u64::from(filled.ioctx_count), "what fill_iocb validated"),
            ("layer_count", u64::from(shared.layer_count), u64::from(filled.layer_count), "what fill_iocb validated"),
            ("opcode", u64::from(shared.opcode), u64::from(filled.opcode), "what fill_iocb validated"),
            ("user_data", shared.user_data, filled.user_data, "what fill_iocb validated"),
            ("lba_stride_blocks", shared.lba_stride_blocks, filled.lba_stride_blocks, "what fill_iocb validated"),
            ("mem_stride_bytes", shared.mem_stride_bytes, filled.mem_stride_bytes, "what fill_iocb validated"),
            ("desc_stride_bytes", shared.desc_stride_bytes, filled.desc_stride_bytes, "what fill_iocb validated"),
            ("layer", u64::from(shared.layer), u64::from(layer.0), "the layer issue_io was given"),
            ("issue_seq", u64::from(shared.issue_seq), u64::from(issue_seq), "one more than the IOCB's previous issue"),
        ];
        if let Some(&(field, value, _, expected)) = fields.iter().find(|(_, value, wanted, _)| value != wanted) {
            return Err(GioError::CorruptIocb { id, field, value, expected });
        }
        // `layer` equals `shared.layer`, below `shared.layer_count`, which equals the validated one.
        Ok(IocbHeader { layer: layer.0, issue_seq, ..filled })
    }

    /// Takes the issue of `id` an SQ entry names: only if the IOCB is ISSUED, this queue's
    /// executor has not taken it already (an issue in flight, see
    /// [`QueueMemory::issue_taken`]), and the queue gave it an issue not yet taken (its number,
    /// [`QueueMemory::issue_given`], is one more than the last one taken). Then it is noted as taken (until it ends) and consumed,
    /// its IOCTX count (the validated one) is armed for counting its completions
    /// ([`QueueMemory::arm_issue`]), and its sequence number comes back: one more than the previous one; `None` for an IOCB
    /// never filled on this queue (nothing is known of its issues). Otherwise the entry is not
    /// an issue of `id` (another agent rewrote it, or named an IOCB twice): nothing of `id` is
    /// touched, not its count, not its status, and [`GioError::WrongState`] says why; the
    /// IOCB whose entry it was stays ISSUED until a reset ends it.
    pub(crate) fn take(&mut self, memory: &QueueMemory, id: IocbId) -> Result<Option<u32>, GioError> {
        self.takeable(memory, id)?;
        memory.issues_taken[id.0 as usize].store(true, Ordering::Release);
        let Some(line) = self.lines.get_mut(id.0 as usize).and_then(Option::as_mut) else { return Ok(None) };
        line.issue_seq = line.issue_seq.wrapping_add(1);
        memory.arm_issue(id, line.ioctx_count);
        Ok(Some(line.issue_seq))
    }

    /// Whether [`FilledLines::take`] would take an SQ entry naming `id`, taking nothing.
    pub(crate) fn takeable(&self, memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
        let depth = memory.layout.config.depth;
        if id.0 >= depth || id.0 as usize >= memory.issues_taken.len() {
            return Err(GioError::UnknownIocb { id, depth });
        }
        let refused = |state| Err(GioError::WrongState { id, state, operation: "an SQ entry naming it (skipped)" });
        if memory.issue_taken(id) {
            return refused("in flight on this executor already");
        }
        if memory.read_iocb_progress(id).status != abi::GIO_IOCB_STATUS_ISSUED {
            return refused("not issued");
        }
        // The queue notes the number it gives each issue before it publishes the SQ entry: an
        // entry naming an IOCB whose status another agent set back to ISSUED while it was idle
        // is no issue the queue gave (the number is the last one taken). Taken, it moved the
        // count past the queue's, so every later issue of the IOCB was refused and lost it.
        if let Some(line) = self.lines.get(id.0 as usize).copied().flatten() {
            if memory.issue_given(id) != line.issue_seq.wrapping_add(1) {
                return refused("not given a new issue by the queue");
            }
        }
        Ok(())
    }

    /// The sequence number to end IOCB `id`, still ISSUED, with when no command of it can
    /// complete (a reset, a retirement), given the one `shared` line 0 holds, whether its issue
    /// was `taken` off the SQ ([`QueueMemory::issue_taken`], read before the end) and the number
    /// the queue `given` its last issue ([`QueueMemory::issue_given`]). Taken: the last issue
    /// consumed is the one in flight, whatever line 0 says. Not taken: the number the queue
    /// gave, noted as the last issue consumed, whatever `shared` says (it may have been
    /// rewritten). That is one more than the last issue taken for an issue whose SQ entry no
    /// submit took (a submit that failed before taking it, or an entry rewritten to name another
    /// IOCB): adopting `shared`, or keeping the last issue's number, made the queue drop the CQE
    /// as stale and keep the IOCB in flight for ever. And it is the last issue taken itself for
    /// an idle IOCB whose status another agent set back to ISSUED: the queue refuses that CQE
    /// (no issue in flight), and the next issue still gets the number this table expects
    /// (counting an issue there made every later issue of the IOCB refused and lost it for
    /// good). `shared` for an IOCB never filled on this queue.
    pub(crate) fn timeout_seq(&mut self, id: IocbId, shared: u32, taken: bool, given: u32) -> u32 {
        let Some(line) = self.lines.get_mut(id.0 as usize).and_then(Option::as_mut) else { return shared };
        if !taken {
            line.issue_seq = given;
        }
        line.issue_seq
    }
}

/// Executor-line fields of an IOCB that executors update with atomics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IocbField {
    Status,
    CompletedIoctxCount,
    FailedIoctx,
    FailedNvmeStatus,
    FailedStatus,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_parts_are_disjoint_and_cache_line_aligned() {
        // Goal: no two parts overlap and each starts on a cache line, for a few shapes.
        for (depth, max) in [(2, 1), (64, 2048), (4, 3), (1024, 16)] {
            let layout = QueueLayout::new(QueueConfig { depth, ioctx_per_iocb_max: max }).unwrap();
            let d = depth as usize;
            let parts = [
                (layout.sq.header_offset_bytes, 256),
                (layout.sq.entries_offset_bytes, d * 4),
                (layout.cq.header_offset_bytes, 256),
                (layout.cq.entries_offset_bytes, d * 16),
                (layout.iocbs_offset_bytes, d * 128),
                (layout.ioctxs_offset_bytes, d * max as usize * 48),
            ];
            for window in parts.windows(2) {
                assert!(window[0].0 + window[0].1 <= window[1].0, "{depth}/{max}: {parts:?}");
            }
            for (offset, _) in parts {
                assert_eq!(offset % CACHE_LINE_BYTES, 0);
            }
            let (last, len) = parts[5];
            assert!(last + len <= layout.total_bytes);
        }
    }

    #[test]
    fn bad_configs_are_rejected() {
        for config in [
            QueueConfig { depth: 3, ioctx_per_iocb_max: 1 },
            QueueConfig { depth: 1, ioctx_per_iocb_max: 1 },
            QueueConfig { depth: 1 << 17, ioctx_per_iocb_max: 1 },
            QueueConfig { depth: 4, ioctx_per_iocb_max: 0 },
            QueueConfig { depth: 4, ioctx_per_iocb_max: 2049 },
        ] {
            assert!(matches!(QueueLayout::new(config), Err(GioError::InvalidConfig { .. })), "{config:?}");
        }
    }

    #[test]
    fn records_round_trip_through_shared_memory() {
        let memory = QueueMemory::new(QueueConfig { depth: 4, ioctx_per_iocb_max: 8 }).unwrap();
        let header = IocbHeader {
            id: 3,
            ioctx_count: 5,
            ioctx_first: 24,
            layer_count: 32,
            layer: 7,
            issue_seq: 9,
            opcode: abi::Opcode::Write.to_abi(),
            user_data: 0xFEED,
            lba_stride_blocks: 1 << 20,
            mem_stride_bytes: 1 << 30,
            desc_stride_bytes: 4096,
        };
        memory.write_iocb_header(IocbId(3), &header);
        assert_eq!(memory.read_iocb_header(IocbId(3)), header);
        assert_eq!(memory.read_iocb_header(IocbId(2)).id, 2, "init writes each IOCB's id");
        memory.write_iocb_progress(IocbId(3), &IocbProgress::ISSUED, Ordering::Release);
        assert_eq!(memory.read_iocb_progress(IocbId(3)), IocbProgress::ISSUED);
        let ioctx = gio_ioctx {
            desc_iova: 0x1000,
            data_iova: 0x2000,
            start_lba: 77,
            nsid: 1,
            block_count: 8,
            data_bytes: 4096,
            desc_bytes: 32,
            device_index: 2,
            descriptor_kind: abi::GIO_DESCRIPTOR_SGL as u8,
            flags: abi::GIO_IOCTX_FLAG_FUA as u8,
            reserved0: 0,
        };
        memory.write_ioctx(31, &ioctx);
        assert_eq!(memory.read_ioctx(31), ioctx);
        let zero = gio_ioctx {
            desc_iova: 0,
            data_iova: 0,
            start_lba: 0,
            nsid: 0,
            block_count: 0,
            data_bytes: 0,
            desc_bytes: 0,
            device_index: 0,
            descriptor_kind: 0,
            flags: 0,
            reserved0: 0,
        };
        assert_eq!(memory.read_ioctx(30), zero, "neighbouring record untouched");
    }

    #[test]
    fn ioctx_words_read_back_field_by_field() {
        // Goal: the word packing places every field where the per-field reader (and the C
        // struct) expects it, for consecutive records; each stays inside its own 48 bytes.
        let memory = QueueMemory::new(QueueConfig { depth: 4, ioctx_per_iocb_max: 8 }).unwrap();
        let record = |i: u32| gio_ioctx {
            desc_iova: 0x1000 + u64::from(i),
            data_iova: 0x2_0000_0000 + u64::from(i),
            start_lba: 0xFFFF_0000_0000 | u64::from(i),
            nsid: 10 + i,
            block_count: 20 + i,
            data_bytes: 30 + i,
            desc_bytes: 40 + i,
            device_index: 0xAB00 | i as u16,
            descriptor_kind: 1,
            flags: 0x80 | i as u8,
            reserved0: 0,
        };
        for i in 0..3 {
            memory.write_ioctx_record(9 + i, &ioctx_words(&record(i)));
        }
        for i in 0..3 {
            assert_eq!(memory.read_ioctx(9 + i), record(i));
        }
        assert_eq!(memory.read_ioctx(8).nsid, 0);
        assert_eq!(memory.read_ioctx(12).nsid, 0);
    }

    #[test]
    fn a_corrupt_line_0_is_refused_field_by_field() {
        // Goal: each field an executor derives offsets or counts from is checked against what
        // the queue wrote; an id outside the pool is an error, not a panic.
        let memory = QueueMemory::new(QueueConfig { depth: 4, ioctx_per_iocb_max: 8 }).unwrap();
        let id = IocbId(2);
        let good = IocbHeader {
            id: 2,
            ioctx_count: 8,
            ioctx_first: 16,
            layer_count: 4,
            layer: 3,
            issue_seq: 1,
            opcode: abi::Opcode::Read.to_abi(),
            user_data: 0,
            lba_stride_blocks: 0,
            mem_stride_bytes: 0,
            desc_stride_bytes: 0,
        };
        memory.write_iocb_header(id, &good);
        assert_eq!(memory.read_issued_header(id).unwrap(), good);
        let cases = [
            ("id", IocbHeader { id: 999, ..good }),
            ("ioctx_first", IocbHeader { ioctx_first: 8, ..good }),
            ("ioctx_count", IocbHeader { ioctx_count: 0, ..good }),
            ("ioctx_count", IocbHeader { ioctx_count: 9, ..good }),
            ("layer", IocbHeader { layer: 4, ..good }),
        ];
        for (expected, header) in cases {
            memory.write_iocb_header(id, &header);
            let error = memory.read_issued_header(id).unwrap_err();
            assert!(matches!(error, GioError::CorruptIocb { field, .. } if field == expected), "{header:?}: {error}");
        }
        assert!(matches!(memory.read_issued_header(IocbId(4)), Err(GioError::UnknownIocb { .. })));
    }

    #[test]
    #[should_panic(expected = "outside the array")]
    fn a_record_past_the_ioctx_array_panics_before_writing() {
        let memory = QueueMemory::new(QueueConfig { depth: 2, ioctx_per_iocb_max: 2 }).unwrap();
        memory.write_ioctx_record(4, &[0; IOCTX_WORDS]);
    }
}
