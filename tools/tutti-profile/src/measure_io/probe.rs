//! [`CpuProbe`]: times gio-uring's CPU executor on a live NVMe controller, one grid point at a time.
//!
//! One IOCB is what the table's rows count: `ioctxs_per_iocb` IOCTXs of `ioctx_bytes` each, one
//! NVMe command per IOCTX. A sample issues `iocb_count` IOCBs in one `issue_io` (one "kernel
//! launch") and ends when the last of their completions has been reaped. The SM budget becomes
//! the number of [`CpuWorkers`] threads, each owning one NVMe I/O queue pair; IOCTX `g` (counted
//! over all IOCBs of the sample) goes to worker `g mod workers`, so a kernel's commands are shared
//! out the way a GPU kernel's thread blocks would share them.
//!
//! Memory and LBAs: IOCTX `g` covers LBAs `g × ioctx` (wrapping at the namespace's end) and a
//! slot of one host DMA buffer (wrapping at the buffer's end), so a large grid needs neither a
//! namespace nor a buffer of its total size. The buffer holds a non-zero pattern so that nothing
//! on the way can take a shortcut for zeros.

use std::time::{Duration, Instant};

use gio_uring::abi::Opcode;
use gio_uring::{
    CpuWorkers, Dependency, Descriptor, DeviceIndex, DeviceInfo, DeviceTable, GioQueue, IocbId, IocbSpec, IoctxSpec, IovaRange, LayerIndex,
    Lba, QueueConfig, RegisteredMemory, SmBudget,
};
use nvme_driver::datapath::PAGE_BYTES;
use nvme_driver::DmaRegion;
use scheduler::error::{Result as SchedulerResult, SchedulerError};
use scheduler::probe::{IoCostProbe, ProbeSample};
use scheduler::table::IoKind;

use super::backend::Backend;

/// How commands find their data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DataPointer {
    /// SGL where the controller supports it, PRP otherwise.
    Auto,
    Sgl,
    Prp,
}

/// The shape of the measurement, fixed for the whole run.
#[derive(Clone, Copy, Debug)]
pub struct ProbeShape {
    pub ioctxs_per_iocb: u32,
    pub ioctx_bytes: u32,
    /// The largest IOCB count of the grid (the IOCB pool is this large).
    pub iocb_count_max: u32,
    /// Host DMA buffer; IOCTX data slots wrap over it.
    pub buffer_bytes_max: u64,
    pub data_pointer: DataPointer,
    /// Longest one sample may take before the run fails (a stuck device, not a slow one).
    pub sample_timeout: Duration,
}

impl ProbeShape {
    pub fn iocb_bytes(&self) -> u64 {
        u64::from(self.ioctxs_per_iocb) * u64::from(self.ioctx_bytes)
    }

    /// Bytes of namespace the largest point touches.
    pub fn span_bytes(&self) -> u64 {
        self.iocb_bytes().saturating_mul(u64::from(self.iocb_count_max))
    }
}

/// The IOCBs of one (direction, SM budget): worker threads, their queue pairs, filled IOCBs.
struct Session {
    kind: IoKind,
    sm_budget: u32,
    queue: GioQueue<CpuWorkers>,
    ids: Vec<IocbId>,
}

/// See the module documentation. Fields drop in order: the session (its worker threads and
/// queue pairs, deleted through the controller) before the buffers and the controller.
pub struct CpuProbe {
    session: Option<Session>,
    buffer: DmaRegion,
    /// PRP lists, one per buffer slot (PRP mode with IOCTXs of more than two pages).
    prp_lists: Option<DmaRegion>,
    backend: Backend,
    shape: ProbeShape,
    sgl: bool,
    /// Blocks per IOCTX and how many IOCTX-sized LBA slots the namespace holds.
    blocks_per_ioctx: u32,
    lba_slots: u64,
    buffer_slots: u64,
    /// Bytes of one PRP list slot (a power of two ≤ a page, so no list crosses a page).
    prp_list_bytes: u64,
    nvme_queue_depth: u32,
}

/// A set-up step that failed (an allocation, a write to DMA memory): exit status 1.
fn setup_error(reason: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("setting up the CPU executor probe: {reason}")
}

/// A flag this device cannot take (--ioctx-bytes, --data-pointer): unusable input, exit status 2.
fn flag_error(reason: impl std::fmt::Display) -> anyhow::Error {
    crate::unusable(format!("setting up the CPU executor probe: {reason}"))
}

impl CpuProbe {
    pub fn new(backend: Backend, shape: ProbeShape) -> anyhow::Result<Self> {
        let namespace = backend.namespace;
        let block_bytes = namespace.block_size_bytes;
        if block_bytes == 0 || shape.ioctx_bytes == 0 || !shape.ioctx_bytes.is_multiple_of(block_bytes) {
            return Err(flag_error(format!(
                "--ioctx-bytes {} is not a positive multiple of the namespace's {block_bytes}-byte blocks",
                shape.ioctx_bytes
            )));
        }
        let blocks_per_ioctx = shape.ioctx_bytes / block_bytes;
        let lba_slots = namespace.size_blocks / u64::from(blocks_per_ioctx);
        if lba_slots == 0 {
            return Err(flag_error(format!(
                "the namespace ({} bytes) is smaller than one IOCTX; lower --ioctx-bytes",
                namespace.size_bytes()
            )));
        }
        let sgl_supported = backend.controller.identify().sgl_support.supported();
        let sgl = match shape.data_pointer {
            DataPointer::Auto => sgl_supported,
            DataPointer::Sgl if !sgl_supported => {
                return Err(flag_error("--data-pointer sgl: the controller does not support SGLs; accepted: --data-pointer prp or auto"))
            }
            DataPointer::Sgl => true,
            DataPointer::Prp => false,
        };
        let pages = u64::from(shape.ioctx_bytes).div_ceil(PAGE_BYTES);
        if !sgl && !u64::from(shape.ioctx_bytes).is_multiple_of(PAGE_BYTES) {
            return Err(flag_error(format!("PRP data pointers need --ioctx-bytes to be a multiple of {PAGE_BYTES}")));
        }
        // One list page holds PAGE_BYTES / 8 entries; the driver's transfer cap keeps us below.
        let prp_list_bytes = if !sgl && pages > 2 { ((pages - 1) * 8).next_power_of_two() } else { 0 };
        if prp_list_bytes > PAGE_BYTES {
            return Err(flag_error("PRP lists longer than one page are not supported; lower --ioctx-bytes"));
        }
        let buffer_slots = (shape.buffer_bytes_max / u64::from(shape.ioctx_bytes))
            .min(u64::from(shape.iocb_count_max) * u64::from(shape.ioctxs_per_iocb))
            .max(1);
        let buffer_bytes = usize::try_from(buffer_slots * u64::from(shape.ioctx_bytes)).map_err(setup_error)?;
        let dma = backend.controller.dma();
        let buffer = dma.allocate(buffer_bytes).map_err(|error| setup_error(format!("{buffer_bytes}-byte DMA buffer: {error}")))?;
        fill_pattern(&buffer).map_err(setup_error)?;
        let prp_lists = if prp_list_bytes == 0 {
            None
        } else {
            let bytes = usize::try_from(buffer_slots * prp_list_bytes).map_err(setup_error)?;
            let lists = dma.allocate(bytes).map_err(|error| setup_error(format!("PRP lists: {error}")))?;
            write_prp_lists(&lists, &buffer, buffer_slots, pages, prp_list_bytes, shape.ioctx_bytes).map_err(setup_error)?;
            Some(lists)
        };
        let nvme_queue_depth = backend.controller.capabilities().max_queue_entries().min(1024);
        Ok(Self {
            session: None,
            buffer,
            prp_lists,
            backend,
            shape,
            sgl,
            blocks_per_ioctx,
            lba_slots,
            buffer_slots,
            prp_list_bytes,
            nvme_queue_depth,
        })
    }

    /// What the commands' data pointers are, for the provenance text.
    pub fn data_pointer_name(&self) -> &'static str {
        if self.sgl {
            "SGL"
        } else {
            "PRP"
        }
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Writes the span the grid touches once, untimed, so that every measured read finds written
    /// blocks (an SSD answers unwritten LBAs without touching flash; a file answers holes with
    /// zero pages) and first-touch costs stay out of the samples.
    pub fn lay_out(&mut self, sm_budget: u32) -> anyhow::Result<Duration> {
        let count = self.shape.iocb_count_max;
        let sample = self.run(IoKind::Write, count, sm_budget).map_err(|error| anyhow::anyhow!("laying out the device: {error}"))?;
        Ok(Duration::from_secs_f64(sample.duration_us / 1e6))
    }

    /// IOCTX `global` of the grid: buffer slot `global % buffer_slots`, its addresses taken from
    /// bounds-checked windows of the buffer and the PRP lists.
    fn ioctx(&self, global: u64, workers: u32) -> std::result::Result<IoctxSpec, String> {
        let slot = global % self.buffer_slots;
        let window = |region: &DmaRegion, stride_bytes: u64, what: &str| {
            let offset = slot.checked_mul(stride_bytes).and_then(|offset| usize::try_from(offset).ok()).unwrap_or(usize::MAX);
            let len = usize::try_from(stride_bytes).unwrap_or(usize::MAX);
            region.subregion(offset, len).map(|window| window.iova()).map_err(|error| format!("{what} of buffer slot {slot}: {error}"))
        };
        let data = window(&self.buffer, u64::from(self.shape.ioctx_bytes), "data")?;
        let descriptor = if self.sgl {
            Descriptor::SglInline
        } else {
            match (&self.prp_lists, u64::from(self.shape.ioctx_bytes).div_ceil(PAGE_BYTES)) {
                (_, 0 | 1) => Descriptor::Prp { prp2: None },
                (None, _) => {
                    let second = data.checked_add(PAGE_BYTES).ok_or_else(|| format!("buffer slot {slot}: its second page overflows"))?;
                    Descriptor::Prp { prp2: Some(IovaRange::new(second, PAGE_BYTES)) }
                }
                (Some(lists), _) => {
                    let start = window(lists, self.prp_list_bytes, "PRP list")?;
                    Descriptor::Prp { prp2: Some(IovaRange::new(start, self.prp_list_bytes)) }
                }
            }
        };
        Ok(IoctxSpec {
            device: DeviceIndex((global % u64::from(workers)) as u16),
            nsid: self.backend.namespace.id.0,
            start_lba: Lba((global % self.lba_slots) * u64::from(self.blocks_per_ioctx)),
            block_count: self.blocks_per_ioctx,
            data,
            descriptor,
            force_unit_access: false,
        })
    }

    /// Builds the worker threads, queue pairs and filled IOCBs of one (direction, budget).
    fn open_session(&mut self, kind: IoKind, sm_budget: u32) -> std::result::Result<Session, String> {
        // The old session's queue pairs are deleted before new ones are asked for.
        self.session = None;
        let workers = sm_budget;
        let worker_count = u16::try_from(workers).map_err(|_| format!("{workers} CPU workers is too many"))?;
        let controller = &self.backend.controller;
        let mut assignments = Vec::with_capacity(usize::from(worker_count));
        for device in 0..worker_count {
            let queue =
                controller.create_io_queue_pair(self.nvme_queue_depth).map_err(|error| format!("I/O queue pair {device}: {error}"))?;
            assignments.push(vec![(DeviceIndex(device), queue)]);
        }
        let namespace = self.backend.namespace;
        let info = DeviceInfo {
            nsid: namespace.id.0,
            capacity_blocks: namespace.size_blocks,
            block_bytes: namespace.block_size_bytes,
            sgl_supported: self.sgl,
        };
        // Each IOCTX is checked against the controller's MDTS at fill time, as the store's are.
        let devices = DeviceTable::with_max_transfer_bytes(vec![(info, controller.max_transfer_bytes()); usize::from(worker_count)]);
        let mut ranges = vec![IovaRange::new(self.buffer.iova(), self.buffer.len() as u64)];
        if let Some(lists) = &self.prp_lists {
            ranges.push(IovaRange::new(lists.iova(), lists.len() as u64));
        }
        let registered = RegisteredMemory::new(ranges).ok_or("DMA regions overlap")?;
        let depth = self.shape.iocb_count_max.next_power_of_two().max(2);
        let executor = CpuWorkers::new(usize::from(worker_count), assignments, depth).map_err(|error| error.to_string())?;
        let config = QueueConfig { depth, ioctx_per_iocb_max: self.shape.ioctxs_per_iocb };
        let mut queue = GioQueue::init_queue(config, devices, registered, executor).map_err(|error| error.to_string())?;
        let count = self.shape.iocb_count_max as usize;
        let ids = queue.get_iocb(count, Dependency::None).map_err(|error| error.to_string())?;
        let opcode = match kind {
            IoKind::Read => Opcode::Read,
            IoKind::Write => Opcode::Write,
        };
        let per_iocb = u64::from(self.shape.ioctxs_per_iocb);
        for (index, &id) in ids.iter().enumerate() {
            let first = index as u64 * per_iocb;
            let ioctxs = (first..first + per_iocb).map(|global| self.ioctx(global, workers)).collect::<std::result::Result<Vec<_>, _>>()?;
            queue
                .fill_iocb(id, &IocbSpec::single(opcode, index as u64), &ioctxs)
                .map_err(|error| format!("filling IOCB {index}: {error}"))?;
        }
        Ok(Session { kind, sm_budget, queue, ids })
    }

    /// One timed issue of `iocb_count` IOCBs: from `issue_io` to the last completion.
    fn run(&mut self, kind: IoKind, iocb_count: u32, sm_budget: u32) -> std::result::Result<ProbeSample, String> {
        if iocb_count == 0 || iocb_count > self.shape.iocb_count_max {
            return Err(format!("IOCB count outside 1..={}", self.shape.iocb_count_max));
        }
        if !matches!(&self.session, Some(s) if s.kind == kind && s.sm_budget == sm_budget) {
            let session = self.open_session(kind, sm_budget)?;
            self.session = Some(session);
            // Untimed warm-up: starts the worker threads and touches the new queues.
            self.issue_and_wait(1, sm_budget)?;
        }
        let duration = self.issue_and_wait(iocb_count, sm_budget)?;
        let bytes = u64::from(iocb_count) * self.shape.iocb_bytes();
        Ok(ProbeSample { duration_us: duration.as_secs_f64() * 1e6, bytes })
    }

    fn issue_and_wait(&mut self, iocb_count: u32, sm_budget: u32) -> std::result::Result<Duration, String> {
        let timeout = self.shape.sample_timeout;
        let session = self.session.as_mut().ok_or("no session")?;
        let ids = &session.ids[..iocb_count as usize];
        let started = Instant::now();
        let deadline = started + timeout;
        session.queue.issue_io(ids, LayerIndex(0), SmBudget(sm_budget)).map_err(|error| error.to_string())?;
        // Every completion belongs to this issue: nothing else is in flight on the queue.
        let mut completed = 0;
        let mut idle_polls = 0u32;
        while completed < ids.len() {
            match session.queue.reap_cqe().map_err(|error| error.to_string())? {
                Some(completion) => {
                    completion.result.map_err(|failure| format!("{}: {failure:?}", completion.id))?;
                    completed += 1;
                    idle_polls = 0;
                }
                None if Instant::now() >= deadline => {
                    return Err(format!("{} of {} IOCBs completed within {} s", completed, ids.len(), timeout.as_secs()));
                }
                None => {
                    idle_polls += 1;
                    back_off(idle_polls);
                }
            }
        }
        Ok(started.elapsed())
    }
}

/// Waiting for completions: spin briefly, then sleep. The executor's worker threads and the
/// software controller's thread need the cores; a waiter that spins or yields competes with them
/// and, on a 2-core machine, measures the scheduler rather than the I/O. A sleep adds at most
/// ~`WAIT_SLEEP_MAX` (plus timer slack) to a sample, small next to an IOCB's transfer.
fn back_off(idle_polls: u32) {
    const SPIN_POLLS: u32 = 64;
    const WAIT_SLEEP_MIN: Duration = Duration::from_micros(5);
    const WAIT_SLEEP_MAX: Duration = Duration::from_micros(50);
    if idle_polls <= SPIN_POLLS {
        std::hint::spin_loop();
    } else {
        let doublings = (idle_polls - SPIN_POLLS).min(4);
        std::thread::sleep((WAIT_SLEEP_MIN * (1 << doublings)).min(WAIT_SLEEP_MAX));
    }
}

impl IoCostProbe for CpuProbe {
    fn describe(&self) -> String {
        format!("gio-uring CPU executor over {}", self.backend.description)
    }

    fn measure(&mut self, kind: IoKind, iocb_count: u32, sm_budget: u32) -> SchedulerResult<ProbeSample> {
        self.run(kind, iocb_count, sm_budget).map_err(|reason| SchedulerError::Probe {
            probe: self.describe(),
            point: format!("kind={kind:?} iocb_count={iocb_count} sm_budget={sm_budget}"),
            reason,
        })
    }
}

/// A cheap non-repeating-looking byte pattern (xorshift), written in 1 MiB pieces.
fn fill_pattern(region: &DmaRegion) -> std::result::Result<(), String> {
    const PIECE_BYTES: usize = 1 << 20;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut piece = vec![0u8; PIECE_BYTES];
    let mut offset = 0;
    while offset < region.len() {
        for chunk in piece.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes());
        }
        let take = PIECE_BYTES.min(region.len() - offset);
        region.write(offset, &piece[..take]).map_err(|error| error.to_string())?;
        offset += take;
    }
    Ok(())
}

/// For each buffer slot, the PRP list naming its pages after the first.
fn write_prp_lists(
    lists: &DmaRegion,
    buffer: &DmaRegion,
    slots: u64,
    pages: u64,
    list_bytes: u64,
    ioctx_bytes: u32,
) -> std::result::Result<(), String> {
    let mut entries = Vec::with_capacity((pages as usize - 1) * 8);
    let ioctx_len = ioctx_bytes as usize;
    for slot in 0..slots {
        let offset = usize::try_from(slot).ok().and_then(|slot| slot.checked_mul(ioctx_len)).unwrap_or(usize::MAX);
        let data = buffer.subregion(offset, ioctx_len).map_err(|error| format!("buffer slot {slot}: {error}"))?;
        entries.clear();
        for page in 1..pages {
            // Inside the slot's window: `pages` pages of it exist.
            let entry =
                data.subregion((page * PAGE_BYTES) as usize, 1).map_err(|error| format!("buffer slot {slot}, page {page}: {error}"))?;
            entries.extend_from_slice(&entry.iova().0.to_le_bytes());
        }
        lists.write((slot * list_bytes) as usize, &entries).map_err(|error| error.to_string())?;
    }
    Ok(())
}
