//! The CUDA executor's pure logic: no CUDA call here, so all of it is unit-tested on machines
//! without a GPU. It translates the NVMe driver's [`DetachedQueueLayout`] into the kernel's
//! per-queue-pair state (`gio_nvme_qp` + `gio_nvme_slot[]`, kernels/gio_abi.h), sizes the grid
//! within co-residency limits, keeps the table of host ranges registered with the GPU, and plans
//! the staged-mode copies.

use core::mem::{offset_of, size_of};
use core::time::Duration;

use nvme_driver::DetachedQueueLayout;

use crate::abi::{self, gio_nvme_qp, gio_nvme_slot};
use crate::error::{GioError, IoctxFault};
use crate::types::{Iova, IovaRange, SmBudget};
use crate::validate::CONTROLLER_PAGE_BYTES;

/// Host page size; `cuMemHostRegister` pins whole pages, so registrations are page-rounded.
pub const PAGE_BYTES: u64 = 4096;
/// Lanes per warp: the kernel's unit of work is a chunk of this many IOCTXs.
pub const WARP_LANES: u32 = 32;
/// The deepest NVMe queue pair the I/O kernel drives (`GIO_SQ_DEPTH_MAX` in
/// kernels/gio_kernel_rules.h). Its command id is `gio_command_id(ticket)`: `ticket & 0xFFFF`, the
/// slot index in the low bits and a generation in the rest, except that FFFFh is never used (the
/// top slot's last generation carries 7FFFh instead). At 16384 each slot has four generations, so
/// that moved id still differs from its slot's previous and next rounds; at 32768 it would equal
/// the previous round's (a late completion of it would be taken for the current one), so deeper
/// queues are refused, lower than nvme-driver's `QUEUE_DEPTH_MAX`.
pub const GPU_QUEUE_DEPTH_MAX: u32 = 16384;
/// CUDA's limit on threads per block (every architecture since sm_20).
pub const THREADS_PER_BLOCK_MAX: u32 = 1024;

/// One detached NVMe queue pair in the GPU's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueuePairAddresses {
    pub qid: u16,
    pub depth: u32,
    pub sq_entries: u64,
    pub cq_entries: u64,
    pub sq_doorbell: u64,
    pub cq_doorbell: u64,
}

/// Translates a queue pair's layout into GPU addresses: `rings` are the GPU addresses of its SQ
/// and CQ, `bar_device_base` the GPU address of BAR0's first byte, `bar_len_bytes` the mapped
/// length. The kernel indexes rings with masks and derives command ids from free-running tickets,
/// so the depth must be a power of two in 2..=[`GPU_QUEUE_DEPTH_MAX`] (16384, which leaves the
/// command id generation bits); a doorbell must lie inside the mapping.
pub fn queue_pair_addresses(
    layout: &DetachedQueueLayout,
    rings: (u64, u64),
    bar_device_base: u64,
    bar_len_bytes: usize,
) -> Result<QueuePairAddresses, GioError> {
    let depth = layout.depth;
    if !(2..=GPU_QUEUE_DEPTH_MAX).contains(&depth) || !depth.is_power_of_two() {
        return Err(GioError::InvalidConfig {
            reason: format!(
                "queue {} has depth {depth}; the I/O kernel needs a power of two in 2..={GPU_QUEUE_DEPTH_MAX} (command ids keep generation bits and never FFFFh)",
                layout.id.0
            ),
        });
    }
    let doorbell = |offset: usize, what: &str| -> Result<u64, GioError> {
        if offset.checked_add(4).is_none_or(|end| end > bar_len_bytes) || !offset.is_multiple_of(4) {
            return Err(GioError::InvalidConfig {
                reason: format!("queue {} {what} doorbell at {offset:#x} is outside the {bar_len_bytes}-byte BAR mapping", layout.id.0),
            });
        }
        bar_device_base.checked_add(offset as u64).ok_or_else(|| GioError::InvalidConfig { reason: "BAR address overflows".into() })
    };
    Ok(QueuePairAddresses {
        qid: layout.id.0,
        depth,
        sq_entries: rings.0,
        cq_entries: rings.1,
        sq_doorbell: doorbell(layout.submission_doorbell_offset, "SQ tail")?,
        cq_doorbell: doorbell(layout.completion_doorbell_offset, "CQ head")?,
    })
}

/// Where the kernel's per-queue-pair state lives in one GPU allocation: the `gio_nvme_qp` array
/// (indexed by gio device index), then each queue pair's slot array, cache-line aligned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateLayout {
    pub slots_offsets_bytes: Vec<usize>,
    pub depths: Vec<u32>,
    pub total_bytes: usize,
}

impl StateLayout {
    pub fn new(depths: &[u32]) -> Self {
        let line = abi::CACHE_LINE_BYTES;
        let mut cursor = depths.len() * size_of::<gio_nvme_qp>();
        let mut slots_offsets_bytes = Vec::with_capacity(depths.len());
        for &depth in depths {
            cursor = cursor.div_ceil(line) * line;
            slots_offsets_bytes.push(cursor);
            cursor += depth as usize * size_of::<gio_nvme_slot>();
        }
        Self { slots_offsets_bytes, depths: depths.to_vec(), total_bytes: cursor.max(line) }
    }

    pub fn qp_offset(index: usize) -> usize {
        index * size_of::<gio_nvme_qp>()
    }
}

fn put_u32(image: &mut [u8], offset: usize, value: u32) {
    image[offset..offset + 4].copy_from_slice(&value.to_le_bytes());
}

fn put_u64(image: &mut [u8], offset: usize, value: u64) {
    image[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
}

/// Writes the fresh state of queue pair `index` into `image` (the host copy of the allocation at
/// GPU address `state_base`): line 0 from `qp`, every counter and lock zero (a newly created NVMe
/// queue has head = tail = 0 and expects phase 1), and slot `s` with
/// `ready_ticket = done_ticket = s + 1 - depth` and `ticket = s - depth` (mod 2^32): "the previous
/// round of this slot is complete", which is what the kernel waits for before reusing a slot, and
/// what makes the completion verdict refuse any completion for the slot until it is submitted.
pub fn write_queue_pair_state(image: &mut [u8], layout: &StateLayout, index: usize, qp: &QueuePairAddresses, state_base: u64) {
    let base = StateLayout::qp_offset(index);
    image[base..base + size_of::<gio_nvme_qp>()].fill(0);
    let slots_offset = layout.slots_offsets_bytes[index];
    put_u64(image, base + offset_of!(gio_nvme_qp, sq_entries), qp.sq_entries);
    put_u64(image, base + offset_of!(gio_nvme_qp, cq_entries), qp.cq_entries);
    put_u64(image, base + offset_of!(gio_nvme_qp, sq_doorbell), qp.sq_doorbell);
    put_u64(image, base + offset_of!(gio_nvme_qp, cq_doorbell), qp.cq_doorbell);
    put_u64(image, base + offset_of!(gio_nvme_qp, slots), state_base + slots_offset as u64);
    put_u32(image, base + offset_of!(gio_nvme_qp, sq_depth), qp.depth);
    put_u32(image, base + offset_of!(gio_nvme_qp, cq_depth), qp.depth);
    put_u32(image, base + offset_of!(gio_nvme_qp, qid), u32::from(qp.qid));
    let slot_bytes = size_of::<gio_nvme_slot>();
    for slot in 0..qp.depth {
        let at = slots_offset + slot as usize * slot_bytes;
        image[at..at + slot_bytes].fill(0);
        let previous_round_done = slot.wrapping_add(1).wrapping_sub(qp.depth);
        put_u32(image, at + offset_of!(gio_nvme_slot, ready_ticket), previous_round_done);
        put_u32(image, at + offset_of!(gio_nvme_slot, done_ticket), previous_round_done);
        // The slot holds the previous round's ticket, completed (done_ticket = ticket + 1), not 0:
        // with ticket 0 a stray completion of command id 0 before ticket 0 was submitted would
        // pass gio_completion_verdict for slot 0 and count as a finished command.
        put_u32(image, at + offset_of!(gio_nvme_slot, ticket), slot.wrapping_sub(qp.depth));
    }
}

/// The whole state image for `qps` (one per gio device index).
pub fn state_image(layout: &StateLayout, qps: &[QueuePairAddresses], state_base: u64) -> Vec<u8> {
    let mut image = vec![0u8; layout.total_bytes];
    for (index, qp) in qps.iter().enumerate() {
        write_queue_pair_state(&mut image, layout, index, qp, state_base);
    }
    image
}

/// The kernel's own counters of one queue pair, as read back from its `gio_nvme_qp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueuePairCounters {
    /// Completions whose command id matched no command in flight (stale or foreign).
    pub unexpected_completions: u32,
    /// Completions the kernel judged controller faults (another SQ, an SQ head outside what was
    /// published, a command not published or fetched: `gio_completion_verdict`).
    pub controller_faults: u32,
    /// SQ slots reserved so far (free-running tickets).
    pub sq_reserved: u32,
    /// SQ tail last written to the doorbell (free-running).
    pub sq_tail: u32,
    /// CQ head last written to the doorbell (free-running).
    pub cq_head: u32,
}

fn get_u32(image: &[u8], offset: usize) -> u32 {
    u32::from_le_bytes([image[offset], image[offset + 1], image[offset + 2], image[offset + 3]])
}

impl QueuePairCounters {
    /// Reads the counters from the bytes of one `gio_nvme_qp`.
    pub fn from_state(qp: &[u8; size_of::<gio_nvme_qp>()]) -> Self {
        Self {
            unexpected_completions: get_u32(qp, offset_of!(gio_nvme_qp, unexpected_completions)),
            controller_faults: get_u32(qp, offset_of!(gio_nvme_qp, controller_faults)),
            sq_reserved: get_u32(qp, offset_of!(gio_nvme_qp, sq_reserved)),
            sq_tail: get_u32(qp, offset_of!(gio_nvme_qp, sq_tail)),
            cq_head: get_u32(qp, offset_of!(gio_nvme_qp, cq_head)),
        }
    }
}

/// The smallest backoff cap the kernel uses (its `Backoff` clamps below this).
pub const BACKOFF_NS_MIN: u32 = 32;

/// Allowance for what a launch does after its deadline: no waiting, only submitting into free
/// slots, finalising IOCBs and one claim attempt each, whose lock-free retries repeat only when
/// another thread succeeded; and the one backoff sleep a wait may have begun just before the
/// deadline (at most [`NANOSLEEP_NS_MAX`], nominally). Milliseconds at most in practice; a
/// second is a wide margin.
pub const KERNEL_TAIL_MARGIN: Duration = Duration::from_secs(1);

/// How long one launch of the I/O kernel runs at most once its blocks have started: every wait of
/// a block ends at one deadline, `poll_iterations_max × max(backoff_ns_max, 32)` ns after the block
/// started (kernels/gio_io_kernel.cu), plus [`KERNEL_TAIL_MARGIN`]. The deadline as the kernel
/// computes it, not the shorter [`kernel_wait_window`]: one wait may run out of iterations
/// sooner, but a warp that waits for several chunks in turn waits several times, and only the
/// deadline bounds them all. Launches on the I/O stream run
/// one after another, so draining `n` queued launches takes at most `n` times this.
pub fn kernel_time_bound(poll_iterations_max: u32, backoff_ns_max: u32) -> Duration {
    let budget_ns = u64::from(poll_iterations_max) * u64::from(backoff_ns_max.max(BACKOFF_NS_MIN));
    Duration::from_nanos(budget_ns) + KERNEL_TAIL_MARGIN
}

/// The longest one `__nanosleep` sleeps: CUDA documents its maximum as about 1 ms, whatever
/// the argument, so a backoff cap above it sleeps no longer.
pub const NANOSLEEP_NS_MAX: u32 = 1_000_000;

/// How long one wait of the kernel keeps looking, from its first look to its last, when its
/// iterations run out before the deadline: each wait (slot, CQE claim, final poll;
/// kernels/gio_io_kernel.cu) looks `poll_iterations_max` times, and between two looks its
/// `Backoff` sleeps 32 ns, doubling up to `max(backoff_ns_max, 32)` ns, each sleep at most
/// [`NANOSLEEP_NS_MAX`]. So `poll_iterations_max - 1` sleeps: the doubling ramp, then the cap.
/// A sleep after the last look (the final poll and the claim take one) serves nothing, since
/// nothing is looked at after it. Nominal sleeps (`__nanosleep(t)` sleeps in [0, 2t]). Never
/// more than the deadline, which counts a full cap per look.
pub fn kernel_wait_window(poll_iterations_max: u32, backoff_ns_max: u32) -> Duration {
    let cap_ns = u64::from(backoff_ns_max.clamp(BACKOFF_NS_MIN, NANOSLEEP_NS_MAX));
    let sleeps = u64::from(poll_iterations_max.saturating_sub(1));
    // The ramp has at most 15 sleeps (32 << 15 > 1 ms); the rest sleep the cap each. No overflow:
    // under 2^32 sleeps of at most 10^6 ns.
    let (mut ramp_sleeps, mut ramp_ns, mut sleep_ns) = (0u64, 0u64, u64::from(BACKOFF_NS_MIN));
    while ramp_sleeps < sleeps && sleep_ns < cap_ns {
        ramp_ns += sleep_ns;
        sleep_ns *= 2;
        ramp_sleeps += 1;
    }
    Duration::from_nanos(ramp_ns + (sleeps - ramp_sleeps) * cap_ns)
}

/// The shortest time a kernel wait must keep looking, both until its block's deadline
/// (`poll_iterations_max × max(backoff_ns_max, 32)` ns) and through its iterations
/// ([`kernel_wait_window`]), that the executor accepts. Below it the kernel's waits end before
/// an NVMe command can complete, so every I/O would time out and every launch reset the queue
/// pairs.
pub const KERNEL_DEADLINE_MIN: Duration = Duration::from_millis(1);

/// The longest `drain_timeout` the executor accepts: it bounds the drain before a queue-pair
/// reset and (with [`teardown_drain_timeout`]) the teardown drain, so a larger one (up to
/// `Duration::MAX`, which `driver::drain_stream` cannot turn into a deadline and waits out for
/// ever) would leave those waits unbounded in practice. An hour is far past any launch a
/// useful configuration runs (3 s with the defaults), and since `drain_timeout` must cover one
/// [`kernel_time_bound`], it caps the kernel's deadline too: [`check_kernel_waits`] refuses
/// kernel settings whose bound is over it, naming `poll_iterations_max` and `backoff_ns_max`.
pub const DRAIN_TIMEOUT_MAX: Duration = Duration::from_secs(3600);

/// Checks the kernel's wait settings of a `GpuExecutorConfig` (what `GpuExecutor::new` refuses):
/// `poll_iterations_max` is at least 1 (the kernel's claim and slot loops run that many times:
/// zero never claims anything), a wait nominally keeps looking at least [`KERNEL_DEADLINE_MIN`]
/// (through its iterations, [`kernel_wait_window`], which counts nominal sleeps and is never
/// longer than the per-block deadline, so the deadline is then at least that too), one launch
/// ([`kernel_time_bound`]) ends within [`DRAIN_TIMEOUT_MAX`] (refused naming
/// `poll_iterations_max` and `backoff_ns_max`, before `drain_timeout` is looked at: no
/// `drain_timeout` could then satisfy the next two rules), and `drain_timeout` covers one launch
/// and is at most [`DRAIN_TIMEOUT_MAX`].
pub fn check_kernel_waits(poll_iterations_max: u32, backoff_ns_max: u32, drain_timeout: Duration) -> Result<(), GioError> {
    if poll_iterations_max == 0 {
        return Err(GioError::InvalidConfig {
            reason: "poll_iterations_max is 0: the kernel's waits would never poll, so every I/O would time out".into(),
        });
    }
    let window = kernel_wait_window(poll_iterations_max, backoff_ns_max);
    if window < KERNEL_DEADLINE_MIN {
        return Err(GioError::InvalidConfig {
            reason: format!(
                "a kernel wait keeps looking for {window:?}, under {KERNEL_DEADLINE_MIN:?}, so NVMe commands would time out: \
                 poll_iterations_max {poll_iterations_max} looks, the sleeps between them {BACKOFF_NS_MIN} ns doubling up to \
                 backoff_ns_max {backoff_ns_max} ns (at least {BACKOFF_NS_MIN}, at most {NANOSLEEP_NS_MAX} ns)"
            ),
        });
    }
    let kernel_bound = kernel_time_bound(poll_iterations_max, backoff_ns_max);
    // Before the drain_timeout checks: no drain_timeout satisfies both when one launch alone may
    // run past the ceiling, and either of their messages would send the user after the wrong field.
    if kernel_bound > DRAIN_TIMEOUT_MAX {
        return Err(GioError::InvalidConfig {
            reason: format!(
                "one launch may run {kernel_bound:?} (poll_iterations_max {poll_iterations_max} x backoff_ns_max \
                 {backoff_ns_max} ns + margin), over the {DRAIN_TIMEOUT_MAX:?} ceiling on drain_timeout, which must cover \
                 one launch: lower poll_iterations_max or backoff_ns_max"
            ),
        });
    }
    if drain_timeout > DRAIN_TIMEOUT_MAX {
        return Err(GioError::InvalidConfig {
            reason: format!(
                "drain_timeout {drain_timeout:?} is over {DRAIN_TIMEOUT_MAX:?}: the drains before a queue-pair reset and on \
                 teardown would not be bounded in practice"
            ),
        });
    }
    if drain_timeout < kernel_bound {
        return Err(GioError::InvalidConfig {
            reason: format!(
                "drain_timeout {drain_timeout:?} is shorter than one launch may run ({kernel_bound:?}: poll_iterations_max \
                 {poll_iterations_max} x backoff_ns_max {backoff_ns_max} ns + margin)"
            ),
        });
    }
    Ok(())
}

/// The most teardown waits for the I/O stream in all (unless `drain_timeout` is longer; see
/// [`teardown_drain_timeout`]): 5 min, a hundred launches running to their 3 s bound with the
/// defaults (objstore's default 64 IOCBs need 192 s). Without it the wait grew with the queue
/// depth, up to `GIO_RING_DEPTH_MAX` (65536) launches: about 54 h blocking the thread that
/// closes or drops the executor. The deletions of the detached pairs that follow the drain are
/// not in it (up to two admin timeouts per pair). Past it the launches still queued are given
/// up on and the caller's memory is kept for good, though they would end within their bounds:
/// the price of a bounded close with more than 100 launches behind a stalled device.
pub const TEARDOWN_DRAIN_MAX: Duration = Duration::from_secs(300);

/// How long teardown waits for the I/O stream to drain with `unretired` launches still on it
/// (`GpuExecutor::retire_queue_pairs` and its drop), when earlier teardown waits of the same
/// executor took `already_waited`. The launches run one after another, each within
/// [`kernel_time_bound`] of starting, so `unretired` bounds from now cover them all (the first
/// may have started already): one `drain_timeout` covers only a few (three with the defaults),
/// and giving up while more still run to their deadlines keeps the caller's memory for good.
/// But that is capped at [`TEARDOWN_DRAIN_MAX`], or `drain_timeout` if longer (at most
/// [`DRAIN_TIMEOUT_MAX`]): launches are bounded only by the queue depth, and teardown blocks
/// its caller. The cap is for the executor's teardown in all: what earlier teardown waits took
/// is taken off (none left: one look at the stream), so a drop after a `retire_queue_pairs`
/// that gave up does not wait for the same launches again.
pub fn teardown_drain_timeout(
    drain_timeout: Duration,
    unretired: usize,
    poll_iterations_max: u32,
    backoff_ns_max: u32,
    already_waited: Duration,
) -> Duration {
    let launches = u32::try_from(unretired).unwrap_or(u32::MAX);
    let every_launch = kernel_time_bound(poll_iterations_max, backoff_ns_max).saturating_mul(launches).min(TEARDOWN_DRAIN_MAX);
    drain_timeout.max(every_launch).saturating_sub(already_waited)
}

/// What bounds the grid of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GridLimits {
    pub threads_per_block: u32,
    /// `cuOccupancyMaxActiveBlocksPerMultiprocessor` for the kernel at that block size.
    pub blocks_per_sm: u32,
    /// SMs of the I/O domain: the green context's, or every SM with the fallback stream.
    pub domain_sm_count: u32,
}

impl GridLimits {
    pub fn validate(&self) -> Result<(), GioError> {
        if self.threads_per_block == 0
            || !self.threads_per_block.is_multiple_of(WARP_LANES)
            || self.threads_per_block > THREADS_PER_BLOCK_MAX
        {
            return Err(GioError::InvalidConfig {
                reason: format!("{} threads per block is not a multiple of 32 in 32..=1024", self.threads_per_block),
            });
        }
        if self.blocks_per_sm == 0 || self.domain_sm_count == 0 {
            return Err(GioError::InvalidConfig {
                reason: format!(
                    "no block of {} threads fits: occupancy {} blocks/SM on {} SMs",
                    self.threads_per_block, self.blocks_per_sm, self.domain_sm_count
                ),
            });
        }
        Ok(())
    }

    /// Blocks for a launch of `chunks` warp-sized chunks with `budget` SMs: never more than can be
    /// resident at once on min(budget, domain) SMs (a block's polling thread waits for IOCTXs
    /// other blocks submit, so an unscheduled block would be a timeout), never more warps than
    /// chunks, at least one.
    pub fn blocks(&self, budget: SmBudget, chunks: u64) -> u32 {
        let sms = budget.0.min(self.domain_sm_count).max(1);
        let resident_max = u64::from(sms) * u64::from(self.blocks_per_sm);
        let warps_per_block = u64::from(self.threads_per_block / WARP_LANES);
        let needed = chunks.div_ceil(warps_per_block).max(1);
        needed.min(resident_max) as u32
    }
}

/// Warp-sized chunks of an IOCB of `ioctx_count` IOCTXs.
pub fn chunks_of(ioctx_count: u32) -> u64 {
    u64::from(ioctx_count.div_ceil(WARP_LANES))
}

/// The page-aligned span `cuMemHostRegister` needs for `len` bytes at `address`.
pub fn page_span(address: u64, len_bytes: u64) -> Option<(u64, u64)> {
    let start = address / PAGE_BYTES * PAGE_BYTES;
    let end = address.checked_add(len_bytes.max(1))?.checked_next_multiple_of(PAGE_BYTES)?;
    Some((start, end - start))
}

/// One host range registered with the GPU, and its GPU address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisteredSpan {
    pub host_start: u64,
    pub len_bytes: u64,
    pub device_start: u64,
}

/// How a new host range relates to what is already registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanLookup {
    /// Inside a registered span: use this GPU address, register nothing.
    Registered { device_address: u64 },
    /// Register this page span.
    New { host_start: u64, len_bytes: u64 },
}

/// Finds `address..+len_bytes` among `spans`. A range that straddles a registered span's edge is
/// an error: CUDA refuses overlapping registrations, and splitting them is not worth the state.
pub fn lookup_span(spans: &[RegisteredSpan], address: u64, len_bytes: u64) -> Result<SpanLookup, GioError> {
    let (start, len) = page_span(address, len_bytes)
        .ok_or_else(|| GioError::InvalidConfig { reason: format!("host range {address:#x}+{len_bytes} wraps") })?;
    let end = start + len;
    for span in spans {
        let span_end = span.host_start + span.len_bytes;
        if span.host_start <= start && end <= span_end {
            return Ok(SpanLookup::Registered { device_address: span.device_start + (address - span.host_start) });
        }
        if start < span_end && span.host_start < end {
            return Err(GioError::InvalidConfig {
                reason: format!(
                    "host range {address:#x}+{len_bytes} partly overlaps the registered span {:#x}+{}",
                    span.host_start, span.len_bytes
                ),
            });
        }
    }
    Ok(SpanLookup::New { host_start: start, len_bytes: len })
}

/// A staging buffer of staged DMA mode: IOVA-mapped host memory the SSD reads and writes, paired
/// byte for byte with a GPU buffer of the same length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingPair {
    pub iova: Iova,
    pub host_address: u64,
    pub gpu_address: u64,
    pub len_bytes: u64,
}

/// One copy of staged mode at layer 0: `len_bytes` between host staging memory and GPU memory.
/// At layer L both addresses move by L × the IOCB's `mem_stride_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRun {
    pub host_address: u64,
    pub gpu_address: u64,
    pub len_bytes: u64,
}

/// What staged-mode planning reads from one IOCTX.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedIoctx {
    pub data_iova: u64,
    pub data_bytes: u32,
    pub desc_iova: u64,
    pub descriptor_kind: u8,
}

/// Plans the copies of an IOCB in staged mode into `runs` (cleared first). Each IOCTX's data
/// must be the contiguous IOVA range `data_iova..+data_bytes` inside one staging pair at the
/// first and the last layer, and the SSD must move exactly that range, since that is what is
/// copied: an SGL segment (scattered data) and a PRP list (which the executor does not read) are
/// refused, and PRP2 must be the page after the data's first page at every layer (see
/// `contiguous_prp2`). Adjacent IOCTXs merge into one run: a pool laid out contiguously costs
/// one copy per IOCB. Runs never cover bytes outside the IOCTXs, because a read's copy into GPU
/// memory must not overwrite neighbouring data.
pub fn plan_staged_copies(
    ioctxs: impl Iterator<Item = StagedIoctx>,
    layer_count: u32,
    mem_stride_bytes: u64,
    desc_stride_bytes: u64,
    pairs: &[StagingPair],
    runs: &mut Vec<CopyRun>,
) -> Result<(), (u32, IoctxFault)> {
    runs.clear();
    let last_layer = layer_count.saturating_sub(1);
    for (index, ioctx) in (0u32..).zip(ioctxs) {
        match abi::DescriptorKind::from_abi(ioctx.descriptor_kind) {
            None => return Err((index, IoctxFault::UnknownDescriptorKind { kind: ioctx.descriptor_kind })),
            Some(abi::DescriptorKind::Sgl) if ioctx.desc_iova != 0 => return Err((index, IoctxFault::StagedScatteredData)),
            Some(abi::DescriptorKind::Prp)
                if ioctx.desc_iova != 0 && !contiguous_prp2(&ioctx, last_layer, mem_stride_bytes, desc_stride_bytes) =>
            {
                return Err((index, IoctxFault::StagedScatteredData));
            }
            Some(_) => {}
        }
        let len = u64::from(ioctx.data_bytes);
        let shift = u64::from(last_layer)
            .checked_mul(mem_stride_bytes)
            .and_then(|shift| shift.checked_add(ioctx.data_iova))
            .ok_or((index, IoctxFault::AddressOverflow { layer: last_layer }))?;
        let inside = |pair: &&StagingPair, start: u64| {
            Iova(start)
                .checked_offset_from(pair.iova)
                .is_some_and(|offset| offset.checked_add(len).is_some_and(|end| end <= pair.len_bytes))
        };
        let pair = pairs
            .iter()
            .find(|pair| inside(pair, ioctx.data_iova) && inside(pair, shift))
            .ok_or((index, IoctxFault::OutsideStaging { range: IovaRange::new(Iova(ioctx.data_iova), len) }))?;
        let offset = Iova(ioctx.data_iova)
            .checked_offset_from(pair.iova)
            .ok_or((index, IoctxFault::OutsideStaging { range: IovaRange::new(Iova(ioctx.data_iova), len) }))?;
        let run = CopyRun { host_address: pair.host_address + offset, gpu_address: pair.gpu_address + offset, len_bytes: len };
        match runs.last_mut() {
            Some(last)
                if last.host_address + last.len_bytes == run.host_address && last.gpu_address + last.len_bytes == run.gpu_address =>
            {
                last.len_bytes += run.len_bytes;
            }
            _ => runs.push(run),
        }
    }
    Ok(())
}

/// Whether a PRP IOCTX's PRP2 (`desc_iova`, not 0) makes the SSD move exactly
/// `data_iova..+data_bytes` at every layer: two memory pages with PRP2 the page right after the
/// data's first page. At layer 0 that is an address check; at later layers both move by their
/// stride, so the strides must be equal, and a page multiple so that the data's page moves with
/// PRP2 (fill already asks a two-page PRP2's stride to be one). A transfer over more pages takes
/// a PRP list, which may name any pages: the executor does not read lists (the caller may rewrite
/// one after fill), so a list is refused rather than trusted.
fn contiguous_prp2(ioctx: &StagedIoctx, last_layer: u32, mem_stride_bytes: u64, desc_stride_bytes: u64) -> bool {
    let first_page = ioctx.data_iova / CONTROLLER_PAGE_BYTES * CONTROLLER_PAGE_BYTES;
    // offset < 4096 and data_bytes < 2^32: no overflow.
    let pages = ((ioctx.data_iova - first_page) + u64::from(ioctx.data_bytes)).div_ceil(CONTROLLER_PAGE_BYTES);
    let strides_agree =
        last_layer == 0 || (desc_stride_bytes == mem_stride_bytes && mem_stride_bytes.is_multiple_of(CONTROLLER_PAGE_BYTES));
    pages <= 2 && first_page.checked_add(CONTROLLER_PAGE_BYTES) == Some(ioctx.desc_iova) && strides_agree
}

/// GPU addresses of what one launch reads, besides the batch itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchAddresses {
    /// GPU address of the gio queue's shared region.
    pub queue_base: u64,
    /// GPU address of the CQ ring (header then entries) the kernel posts to.
    pub cq_ring_base: u64,
    /// GPU address of the `gio_nvme_qp` array.
    pub nvme_qps: u64,
    pub device_count: u32,
}

/// The kernel's argument for one issue (`sq_first`, `count`: the batch's SQ positions).
pub fn launch_params(
    layout: &crate::layout::QueueLayout,
    addresses: &LaunchAddresses,
    sq_first: u32,
    count: u32,
    poll_iterations_max: u32,
    backoff_ns_max: u32,
) -> abi::gio_launch_params {
    abi::gio_launch_params {
        iocbs: addresses.queue_base + layout.iocbs_offset_bytes as u64,
        ioctxs: addresses.queue_base + layout.ioctxs_offset_bytes as u64,
        sq_entries: addresses.queue_base + layout.sq.entries_offset_bytes as u64,
        cq_header: addresses.cq_ring_base,
        cq_entries: addresses.cq_ring_base + size_of::<abi::gio_ring_header>() as u64,
        nvme_qps: addresses.nvme_qps,
        sq_first,
        iocb_count: count,
        sq_mask: layout.sq.mask(),
        iocb_capacity: layout.config.depth,
        ioctx_capacity: layout.ioctx_capacity(),
        device_count: addresses.device_count,
        poll_iterations_max,
        backoff_ns_max,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme_driver::QueueId;

    fn layout(depth: u32) -> DetachedQueueLayout {
        DetachedQueueLayout {
            id: QueueId(3),
            depth,
            submission_iova: nvme_driver::Iova(0x10_0000),
            completion_iova: nvme_driver::Iova(0x20_0000),
            submission_host_address: 0x7000_0000,
            completion_host_address: 0x7100_0000,
            submission_doorbell_offset: 0x1000 + 6 * 4,
            completion_doorbell_offset: 0x1000 + 7 * 4,
        }
    }

    fn get_u32(image: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(image[at..at + 4].try_into().unwrap())
    }

    fn get_u64(image: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(image[at..at + 8].try_into().unwrap())
    }

    #[test]
    fn layout_translates_into_gpu_addresses_and_bad_layouts_are_refused() {
        // Goal: doorbells are BAR base + the driver's offsets; depths the kernel cannot mask and
        // doorbells outside the mapping are configuration errors, not wild GPU stores.
        let qp = queue_pair_addresses(&layout(64), (0xA000, 0xB000), 0xF000_0000, 0x2000).unwrap();
        assert_eq!((qp.qid, qp.depth, qp.sq_entries, qp.cq_entries), (3, 64, 0xA000, 0xB000));
        assert_eq!(qp.sq_doorbell, 0xF000_0000 + 0x1018);
        assert_eq!(qp.cq_doorbell, 0xF000_0000 + 0x101C);
        assert!(queue_pair_addresses(&layout(48), (0, 0), 0, 0x2000).is_err());
        assert!(queue_pair_addresses(&layout(1), (0, 0), 0, 0x2000).is_err());
        assert!(queue_pair_addresses(&layout(64), (0, 0), 0, 0x101C).is_err(), "CQ doorbell past the mapping");
    }

    #[test]
    fn state_image_matches_the_abi_and_slots_start_as_completed_rounds() {
        // Goal: every field the kernel reads sits at its gio_abi.h offset; counters are zero; slot
        // s reads "ticket s - depth is done", so ticket s may use it at once and no earlier.
        let depths = [8u32, 4];
        let state = StateLayout::new(&depths);
        let base = 0x5_0000_0000u64;
        let a = queue_pair_addresses(&layout(8), (0xA000, 0xB000), 0xF000_0000, 0x2000).unwrap();
        let b = QueuePairAddresses { qid: 4, depth: 4, ..a };
        let image = state_image(&state, &[a, b], base);
        assert_eq!(image.len(), state.total_bytes);
        assert_eq!(state.slots_offsets_bytes[0], 2 * 320);
        assert_eq!(state.slots_offsets_bytes[1], 2 * 320 + 8 * 32);
        let q1 = StateLayout::qp_offset(1);
        assert_eq!(get_u64(&image, q1 + offset_of!(gio_nvme_qp, slots)), base + state.slots_offsets_bytes[1] as u64);
        assert_eq!(get_u64(&image, offset_of!(gio_nvme_qp, sq_doorbell)), a.sq_doorbell);
        assert_eq!(get_u32(&image, q1 + offset_of!(gio_nvme_qp, sq_depth)), 4);
        assert_eq!(get_u32(&image, q1 + offset_of!(gio_nvme_qp, cq_depth)), 4);
        assert_eq!(get_u32(&image, q1 + offset_of!(gio_nvme_qp, qid)), 4);
        for counter in [offset_of!(gio_nvme_qp, sq_reserved), offset_of!(gio_nvme_qp, sq_tail), offset_of!(gio_nvme_qp, cq_head)] {
            assert_eq!(get_u32(&image, q1 + counter), 0);
        }
        for slot in 0..8u32 {
            let at = state.slots_offsets_bytes[0] + slot as usize * 32;
            let expected = slot.wrapping_add(1).wrapping_sub(8);
            assert_eq!(get_u32(&image, at), expected, "ready_ticket of slot {slot}");
            assert_eq!(get_u32(&image, at + 4), expected, "done_ticket of slot {slot}");
            // The kernel's test for ticket t = slot: done_ticket == t + 1 - depth.
            assert_eq!(get_u32(&image, at + 4), slot.wrapping_add(1).wrapping_sub(8));
            // The slot holds the previous round's ticket, already completed (done = ticket + 1):
            // gio_completion_verdict then refuses every command id for it, so a stray completion
            // before the slot's first submission (command id 0 for slot 0) completes nothing.
            let ticket = get_u32(&image, at + offset_of!(gio_nvme_slot, ticket));
            assert_eq!(ticket, slot.wrapping_sub(8), "ticket of slot {slot}");
            assert_eq!(get_u32(&image, at + offset_of!(gio_nvme_slot, done_ticket)), ticket.wrapping_add(1));
        }
    }

    #[test]
    fn a_submitter_fences_after_its_slot_wait_before_it_overwrites_the_slot() {
        // Goal: kernels/gio_io_kernel.cu's submit_ioctx pairs the reaper's release (it reads
        // the previous round's tracker and fences before storing done_ticket) with an acquire:
        // a fence after the wait on done_ticket, before the SQE and the tracker are overwritten,
        // so those writes cannot be ordered before the load that saw the slot free. Without it
        // the reaper could read this round's fields as the previous round's.
        let kernel = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../kernels/gio_io_kernel.cu")).unwrap();
        let submit = &kernel[kernel.find("__device__ uint32_t submit_ioctx(").expect("submit_ioctx")..];
        let wait = submit.find("while (load_volatile(&slot->done_ticket) != previous_done)").expect("the slot wait");
        let wait_end = wait + submit[wait..].find("\n    }\n").expect("the wait loop's end");
        let overwrite = submit.find("target[part] = source[part]").expect("the SQE store");
        let tracker = submit.find("store_volatile(&slot->iocb_id").expect("the tracker store");
        assert!(wait_end < overwrite && overwrite < tracker);
        assert!(submit[wait_end..overwrite].contains("__threadfence();"), "no fence between the slot wait and the SQE store");
    }

    #[test]
    fn the_kernel_backoff_doubles_without_wrapping_past_its_cap() {
        // Goal: Backoff::pause doubles its 32-bit sleep only while the double stays within the
        // cap, compared against half the cap: `sleep_ns * 2 > max_ns` wraps for a cap of 2^31
        // ns or more (backoff_ns_max is a u32 check_kernel_waits accepts), the sleep dropping
        // to 0 after 27 steps and the wait spinning from then on.
        let kernel = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../kernels/gio_io_kernel.cu")).unwrap();
        let backoff = &kernel[kernel.find("struct Backoff {").expect("Backoff")..];
        let pause = &backoff[backoff.find("void pause()").expect("pause")..];
        let pause = &pause[..pause.find("\n    }\n").expect("pause's end")];
        assert!(!pause.contains("sleep_ns * 2 >"), "the doubled sleep is compared after it may have wrapped:\n{pause}");
        assert!(pause.contains("sleep_ns > max_ns / 2"), "{pause}");
    }

    #[test]
    fn queues_too_deep_for_a_generation_bit_are_refused() {
        // Goal: the command id is ticket & 0xFFFF, slot index in the low bits and a generation in
        // the rest, never FFFFh (the top slot's last generation takes 7FFFh): at depth 32768 that
        // is its previous round's id (a late completion of it would match the current one), so
        // the deepest queue the kernel takes is 16384 (GIO_SQ_DEPTH_MAX, rules_check.c).
        const { assert!(GPU_QUEUE_DEPTH_MAX <= nvme_driver::QUEUE_DEPTH_MAX) };
        let rules = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../kernels/gio_kernel_rules.h")).unwrap();
        assert!(rules.contains(&format!("#define GIO_SQ_DEPTH_MAX {GPU_QUEUE_DEPTH_MAX}u")));
        assert!(queue_pair_addresses(&layout(16384), (0, 0), 0, 0x2000).is_ok());
        let refused = queue_pair_addresses(&layout(32768), (0, 0), 0, 0x2000).unwrap_err();
        assert!(matches!(&refused, GioError::InvalidConfig { reason } if reason.contains("2..=16384")), "{refused:?}");
    }

    #[test]
    fn counters_are_read_at_their_abi_offsets_and_start_at_zero() {
        // Goal: the read-back of a queue pair's counters takes each from its gio_abi.h field,
        // and a fresh state reads all zero (what the GPU test asserts after its traffic).
        let state = StateLayout::new(&[4]);
        let qp = queue_pair_addresses(&layout(4), (1, 2), 0, 0x2000).unwrap();
        let mut image = state_image(&state, &[qp], 0);
        let bytes = |image: &[u8]| -> [u8; size_of::<gio_nvme_qp>()] { image[..size_of::<gio_nvme_qp>()].try_into().unwrap() };
        let zero = QueuePairCounters { unexpected_completions: 0, controller_faults: 0, sq_reserved: 0, sq_tail: 0, cq_head: 0 };
        assert_eq!(QueuePairCounters::from_state(&bytes(&image)), zero);
        for (field, value) in [
            (offset_of!(gio_nvme_qp, unexpected_completions), 7u32),
            (offset_of!(gio_nvme_qp, controller_faults), 9),
            (offset_of!(gio_nvme_qp, sq_reserved), 11),
            (offset_of!(gio_nvme_qp, sq_tail), 13),
            (offset_of!(gio_nvme_qp, cq_head), 15),
        ] {
            put_u32(&mut image, field, value);
        }
        let read = QueuePairCounters::from_state(&bytes(&image));
        assert_eq!(read, QueuePairCounters { unexpected_completions: 7, controller_faults: 9, sq_reserved: 11, sq_tail: 13, cq_head: 15 });
    }

    #[test]
    fn rewriting_one_queue_pair_resets_its_counters_only() {
        // Goal: the reset after a timeout clears a dirty queue pair's locks and tickets and leaves
        // its neighbour's state alone.
        let state = StateLayout::new(&[4, 4]);
        let qp = queue_pair_addresses(&layout(4), (1, 2), 0, 0x2000).unwrap();
        let mut image = state_image(&state, &[qp, qp], 0);
        let dirty = StateLayout::qp_offset(1) + offset_of!(gio_nvme_qp, sq_lock);
        image[dirty] = 1;
        let neighbour = offset_of!(gio_nvme_qp, sq_tail);
        image[neighbour] = 9;
        write_queue_pair_state(&mut image, &state, 1, &qp, 0);
        assert_eq!(image[dirty], 0);
        assert_eq!(image[neighbour], 9);
    }

    #[test]
    fn kernel_wait_settings_that_would_time_out_every_io_are_refused_naming_the_field() {
        // Goal: GpuExecutor::new refuses settings under which the kernel cannot finish any
        // I/O (zero polling iterations: its claim loops never run; a deadline shorter than a
        // command takes) instead of timing out every IOCB and resetting the queue pairs on
        // every launch; the error names the field. The defaults and the GPU test's pass.
        let drain = Duration::from_secs(10);
        let refused = |poll, backoff, drain| match check_kernel_waits(poll, backoff, drain) {
            Err(GioError::InvalidConfig { reason }) => reason,
            other => panic!("({poll}, {backoff}, {drain:?}) accepted: {other:?}"),
        };
        assert!(refused(0, 10_000, drain).contains("poll_iterations_max"));
        assert!(refused(1, 10_000, drain).contains("poll_iterations_max"), "a 10 us deadline");
        assert!(refused(31_000, 0, drain).contains("backoff_ns_max"), "a zero cap counts as 32 ns: 0.99 ms");
        assert!(refused(200_000, 10_000, Duration::from_secs(2)).contains("drain_timeout"));
        // A long deadline is not enough: each wait also ends after poll_iterations_max looks,
        // with a backoff that starts at 32 ns. One look never waits at all; ten sleep about
        // 16 us, not the "1 ms" of 10 x 100 us.
        assert!(refused(1, 1_000_000, drain).contains("poll_iterations_max"), "one look, a 1 ms deadline");
        assert!(refused(10, 100_000, drain).contains("poll_iterations_max"), "ten looks, a 1 ms deadline");
        assert!(refused(2, u32::MAX, drain).contains("poll_iterations_max"), "one sleep of 32 ns, a 8.6 s deadline");
        assert!(check_kernel_waits(200_000, 10_000, drain).is_ok(), "the defaults");
        assert!(check_kernel_waits(20_000, 10_000, drain).is_ok(), "the GPU test's first pass: 0.2 s");
        assert!(check_kernel_waits(31_251, 0, drain).is_ok(), "exactly 1 ms between the first look and the last");
        assert!(refused(31_250, 0, drain).contains("poll_iterations_max"), "1 ms less one 32 ns sleep");
    }

    #[test]
    fn a_drain_timeout_past_the_maximum_is_refused_naming_it() {
        // Goal: every wait bounded. drain_timeout bounds the reset drain and (with
        // teardown_drain_timeout) the teardown drain; a config asking for Duration::MAX (which
        // drain_stream treats as no deadline: an Instant cannot hold it) or days would make
        // those waits unbounded in practice. GpuExecutor::new refuses it, naming the field.
        for drain in [DRAIN_TIMEOUT_MAX + Duration::from_nanos(1), Duration::from_secs(86_400), Duration::MAX] {
            match check_kernel_waits(200_000, 10_000, drain) {
                Err(GioError::InvalidConfig { reason }) => assert!(reason.contains("drain_timeout"), "{drain:?}: {reason}"),
                other => panic!("{drain:?} accepted: {other:?}"),
            }
        }
        assert!(check_kernel_waits(200_000, 10_000, DRAIN_TIMEOUT_MAX).is_ok(), "the maximum itself");
        assert_eq!(DRAIN_TIMEOUT_MAX, Duration::from_secs(3600));
    }

    #[test]
    fn kernel_settings_whose_one_launch_outlasts_the_drain_ceiling_are_refused_naming_them() {
        // Goal: a config no drain_timeout can satisfy is refused for its real cause. With
        // 4_000_000 looks and a 1 ms cap one launch may run 4001 s, over DRAIN_TIMEOUT_MAX,
        // which drain_timeout may not pass but must cover one launch: the user was told
        // "drain_timeout is shorter than one launch", then, once raised, "over 3600s".
        for drain in [Duration::from_secs(10), DRAIN_TIMEOUT_MAX, DRAIN_TIMEOUT_MAX + Duration::from_secs(1)] {
            match check_kernel_waits(4_000_000, 1_000_000, drain) {
                Err(GioError::InvalidConfig { reason }) => {
                    assert!(reason.contains("poll_iterations_max") && reason.contains("backoff_ns_max"), "{drain:?}: {reason}");
                    assert!(reason.contains("3600s"), "names the ceiling: {reason}");
                    assert!(!reason.contains("shorter than") && !reason.starts_with("drain_timeout"), "{drain:?}: {reason}");
                }
                other => panic!("{drain:?} accepted: {other:?}"),
            }
        }
        // The largest budget under the ceiling (the bound adds the 1 s margin) is accepted with
        // the ceiling itself; one look (1 ms) more is not.
        assert!(check_kernel_waits(3_599_000, 1_000_000, DRAIN_TIMEOUT_MAX).is_ok());
        assert!(check_kernel_waits(3_599_001, 1_000_000, DRAIN_TIMEOUT_MAX).is_err());
    }

    #[test]
    fn a_wait_lasts_the_backoff_ramp_then_the_cap_between_its_first_and_last_look() {
        // Goal: the time a kernel wait keeps looking is what its looks and sleeps add up to:
        // poll_iterations_max looks, the sleeps between them 32 ns doubling up to the cap (at
        // least 32 ns; at most the ~1 ms one __nanosleep sleeps), not looks x cap.
        assert_eq!(kernel_wait_window(0, 10_000), Duration::ZERO);
        assert_eq!(kernel_wait_window(1, 10_000), Duration::ZERO, "one look, no sleep");
        assert_eq!(kernel_wait_window(2, 10_000), Duration::from_nanos(32));
        // 32 + 64 + ... + 8192, then 10 us each.
        assert_eq!(kernel_wait_window(10, 10_000), Duration::from_nanos(16_352));
        assert_eq!(kernel_wait_window(11, 10_000), Duration::from_nanos(16_352 + 10_000));
        assert_eq!(kernel_wait_window(10, 100_000), Duration::from_nanos(16_352));
        assert_eq!(kernel_wait_window(200_000, 10_000), Duration::from_nanos(16_352 + (199_999 - 9) * 10_000));
        assert_eq!(kernel_wait_window(5, 0), Duration::from_nanos(4 * 32), "a zero cap sleeps 32 ns");
        assert_eq!(kernel_wait_window(5, 100), Duration::from_nanos(32 + 64 + 100 + 100));
        // Up to 524_288 ns the ramp, then 1 ms per sleep however large the cap.
        let ramp_to_1_ms = 32 * ((1 << 15) - 1);
        assert_eq!(kernel_wait_window(17, u32::MAX), Duration::from_nanos(ramp_to_1_ms + 1_000_000));
        assert_eq!(kernel_wait_window(u32::MAX, u32::MAX), Duration::from_nanos(ramp_to_1_ms + (u64::from(u32::MAX) - 16) * 1_000_000));
        // Never longer than the deadline, which counts every look a full cap.
        for (poll, cap) in [(1, 0), (10, 100), (10, 100_000), (200_000, 10_000), (u32::MAX, 5_000_000)] {
            assert!(kernel_wait_window(poll, cap) <= kernel_time_bound(poll, cap) - KERNEL_TAIL_MARGIN, "({poll}, {cap})");
        }
    }

    #[test]
    fn the_kernel_time_bound_is_its_deadline_plus_the_tail_margin() {
        // Goal: the bound the executor checks its drain timeout against is the kernel's one
        // deadline (iterations x backoff cap, the cap clamped as the kernel clamps it), not
        // that per wait; the executor's defaults give 2 s + the margin.
        assert_eq!(kernel_time_bound(200_000, 10_000), Duration::from_secs(2) + KERNEL_TAIL_MARGIN);
        assert_eq!(kernel_time_bound(1000, 0), Duration::from_micros(32) + KERNEL_TAIL_MARGIN);
        assert_eq!(
            kernel_time_bound(u32::MAX, u32::MAX),
            Duration::from_nanos(u64::from(u32::MAX) * u64::from(u32::MAX)) + KERNEL_TAIL_MARGIN
        );
    }

    #[test]
    fn teardown_waits_long_enough_for_every_launch_still_queued() {
        // Goal: teardown's wait for the I/O stream covers every launch still on it, each of
        // which may run a whole kernel_time_bound after the one before: with more launches
        // queued behind a stalled device than drain_timeout covers (10 s: three 3 s bounds),
        // one drain_timeout would give up while they still run to their deadlines, and the
        // caller would keep its memory for good. Never shorter than drain_timeout. (Up to the
        // cap of 100 bounds with the defaults: teardown_waits_at_most_its_cap_in_all_...)
        let drain = Duration::from_secs(10);
        let bound = kernel_time_bound(200_000, 10_000);
        for launches in [0usize, 1, 3, 4, 16, 64, 100] {
            let wait = teardown_drain_timeout(drain, launches, 200_000, 10_000, Duration::ZERO);
            assert!(wait >= bound * launches as u32, "{launches} launches: {wait:?}");
            assert!(wait >= drain, "{launches} launches: {wait:?}");
        }
        assert_eq!(teardown_drain_timeout(drain, 16, 200_000, 10_000, Duration::ZERO), bound * 16);
        assert_eq!(teardown_drain_timeout(drain, 1, 200_000, 10_000, Duration::ZERO), drain);
        assert_eq!(teardown_drain_timeout(Duration::MAX, usize::MAX, u32::MAX, u32::MAX, Duration::ZERO), Duration::MAX, "saturates");
    }

    #[test]
    fn teardown_waits_at_most_its_cap_in_all_however_many_launches_are_queued() {
        // Goal: teardown blocks the thread that closes or drops the executor for a bounded,
        // documented time. Unretired launches are bounded only by the gio queue depth (up to
        // 65536): a kernel_time_bound each (3 s with the defaults) is 192 s at 64 IOCBs but about
        // 54 h at 65536, so the wait is capped at TEARDOWN_DRAIN_MAX (or drain_timeout if that
        // is longer). And close then drop never wait for the same launches twice: what an
        // earlier teardown wait used is taken off the next.
        let drain = Duration::from_secs(10);
        let bound = kernel_time_bound(200_000, 10_000);
        assert_eq!(bound, Duration::from_secs(3));
        assert_eq!(TEARDOWN_DRAIN_MAX, Duration::from_secs(300));
        let wait = |launches, waited| teardown_drain_timeout(drain, launches, 200_000, 10_000, waited);
        assert_eq!(wait(64, Duration::ZERO), Duration::from_secs(192), "objstore's default depth: under the cap");
        assert_eq!(wait(100, Duration::ZERO), TEARDOWN_DRAIN_MAX);
        assert_eq!(wait(101, Duration::ZERO), TEARDOWN_DRAIN_MAX, "capped");
        assert_eq!(wait(65_536, Duration::ZERO), TEARDOWN_DRAIN_MAX, "GIO_RING_DEPTH_MAX launches: 5 min, not 54 h");
        assert_eq!(wait(usize::MAX, Duration::ZERO), TEARDOWN_DRAIN_MAX);
        // A retire_queue_pairs that gave up after waiting it all leaves drop nothing to wait
        // (one look at the stream); one that gave up sooner leaves the rest.
        assert_eq!(wait(65_536, TEARDOWN_DRAIN_MAX), Duration::ZERO);
        assert_eq!(wait(65_536, Duration::from_secs(100)), Duration::from_secs(200));
        assert_eq!(wait(64, Duration::from_secs(192)), Duration::ZERO);
        assert_eq!(wait(1, drain), Duration::ZERO, "drain_timeout is not waited again either");
        assert_eq!(wait(1, Duration::MAX), Duration::ZERO);
        // A drain_timeout longer than the cap (at most DRAIN_TIMEOUT_MAX) is still honoured.
        let long = teardown_drain_timeout(DRAIN_TIMEOUT_MAX, 65_536, 200_000, 10_000, Duration::ZERO);
        assert_eq!(long, DRAIN_TIMEOUT_MAX);
    }

    #[test]
    fn grid_never_exceeds_what_is_co_resident_nor_the_work() {
        let limits = GridLimits { threads_per_block: 128, blocks_per_sm: 4, domain_sm_count: 2 };
        limits.validate().unwrap();
        assert_eq!(limits.blocks(SmBudget(2), chunks_of(1)), 1);
        assert_eq!(limits.blocks(SmBudget(2), chunks_of(2048)), 8, "64 chunks, 4 warps/block, capped at 2 SMs x 4");
        assert_eq!(limits.blocks(SmBudget(1), chunks_of(2048)), 4);
        assert_eq!(limits.blocks(SmBudget(64), chunks_of(2048)), 8, "the budget cannot exceed the domain");
        assert_eq!(limits.blocks(SmBudget(2), 5), 2);
        assert_eq!(chunks_of(33), 2);
        assert!(GridLimits { threads_per_block: 100, ..limits }.validate().is_err());
        assert!(GridLimits { threads_per_block: 1056, ..limits }.validate().is_err());
        assert!(GridLimits { threads_per_block: 1024, ..limits }.validate().is_ok());
        assert!(GridLimits { blocks_per_sm: 0, ..limits }.validate().is_err());
    }

    #[test]
    fn spans_are_page_rounded_reused_when_contained_and_refused_when_straddling() {
        assert_eq!(page_span(0x1234, 10), Some((0x1000, 0x1000)));
        assert_eq!(page_span(0x1000, 0x1001), Some((0x1000, 0x2000)));
        assert_eq!(page_span(u64::MAX - 10, 100), None);
        let spans = [RegisteredSpan { host_start: 0x10_000, len_bytes: 0x3000, device_start: 0xD0_000 }];
        assert_eq!(lookup_span(&spans, 0x11_010, 16).unwrap(), SpanLookup::Registered { device_address: 0xD1_010 });
        assert_eq!(lookup_span(&spans, 0x20_000, 1).unwrap(), SpanLookup::New { host_start: 0x20_000, len_bytes: 0x1000 });
        assert!(lookup_span(&spans, 0x12_000, 0x2000).is_err());
    }

    #[test]
    fn launch_params_point_into_the_queue_region_at_its_layout_offsets() {
        let layout = crate::layout::QueueLayout::new(crate::layout::QueueConfig { depth: 8, ioctx_per_iocb_max: 4 }).unwrap();
        let addresses =
            LaunchAddresses { queue_base: 0x1_0000_0000, cq_ring_base: 0x2_0000_0000, nvme_qps: 0x3_0000_0000, device_count: 2 };
        let params = launch_params(&layout, &addresses, 13, 3, 1000, 64);
        assert_eq!(params.iocbs, 0x1_0000_0000 + layout.iocbs_offset_bytes as u64);
        assert_eq!(params.ioctxs, 0x1_0000_0000 + layout.ioctxs_offset_bytes as u64);
        assert_eq!(params.sq_entries, 0x1_0000_0000 + layout.sq.entries_offset_bytes as u64);
        assert_eq!((params.cq_header, params.cq_entries), (0x2_0000_0000, 0x2_0000_0100));
        assert_eq!((params.sq_first, params.iocb_count, params.sq_mask), (13, 3, 7));
        assert_eq!((params.iocb_capacity, params.ioctx_capacity, params.device_count), (8, 32, 2));
    }

    fn ioctx(data_iova: u64, data_bytes: u32) -> StagedIoctx {
        StagedIoctx { data_iova, data_bytes, desc_iova: 0, descriptor_kind: abi::GIO_DESCRIPTOR_SGL as u8 }
    }

    #[test]
    fn staged_copies_merge_adjacent_ioctxs_and_never_cover_gaps() {
        // Goal: contiguous IOCTXs give one copy; a gap gives two (a read's copy must not overwrite
        // GPU bytes outside the IOCB); the last layer must stay inside the staging buffer.
        let pairs = [StagingPair { iova: Iova(0x1_0000), host_address: 0x7000_0000, gpu_address: 0x9000_0000, len_bytes: 0x4000 }];
        let mut runs = Vec::new();
        let contiguous = [ioctx(0x1_0000, 512), ioctx(0x1_0200, 512)];
        plan_staged_copies(contiguous.into_iter(), 2, 0x1000, 0, &pairs, &mut runs).unwrap();
        assert_eq!(runs, vec![CopyRun { host_address: 0x7000_0000, gpu_address: 0x9000_0000, len_bytes: 1024 }]);
        let gap = [ioctx(0x1_0000, 512), ioctx(0x1_0400, 512)];
        plan_staged_copies(gap.into_iter(), 1, 0, 0, &pairs, &mut runs).unwrap();
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[1], CopyRun { host_address: 0x7000_0400, gpu_address: 0x9000_0400, len_bytes: 512 });
        let past_end = [ioctx(0x1_0000, 512), ioctx(0x1_3000, 512)];
        let error = plan_staged_copies(past_end.into_iter(), 2, 0x1000, 0, &pairs, &mut runs).unwrap_err();
        assert!(matches!(error, (1, IoctxFault::OutsideStaging { .. })), "{error:?}");
        let segment = [StagedIoctx { desc_iova: 0x1_2000, ..ioctx(0x1_0000, 512) }];
        assert_eq!(plan_staged_copies(segment.into_iter(), 1, 0, 0, &pairs, &mut runs).unwrap_err(), (0, IoctxFault::StagedScatteredData));
        let prp = [StagedIoctx { desc_iova: 0x1_1000, descriptor_kind: abi::GIO_DESCRIPTOR_PRP as u8, ..ioctx(0x1_0000, 8192) }];
        plan_staged_copies(prp.into_iter(), 1, 0, 0, &pairs, &mut runs).unwrap();
        assert_eq!(runs.len(), 1);
    }

    #[test]
    fn staged_prp_must_name_the_page_after_the_data_at_every_layer() {
        // Goal: the staged copy moves data_iova..+data_bytes, so the SSD must move exactly those
        // bytes: PRP2 of a two-page transfer is the data's next page at every layer (layer 0 and a
        // descriptor stride equal to the data's), and a PRP list (which the executor does not
        // read) is refused. Otherwise the copy would move bytes the SSD never touched.
        let pairs = [StagingPair { iova: Iova(0x1_0000), host_address: 0x7000_0000, gpu_address: 0x9000_0000, len_bytes: 0x8000 }];
        let mut runs = Vec::new();
        let prp = |data_iova, data_bytes, desc_iova| StagedIoctx {
            desc_iova,
            descriptor_kind: abi::GIO_DESCRIPTOR_PRP as u8,
            ..ioctx(data_iova, data_bytes)
        };
        let elsewhere = [prp(0x1_0000, 8192, 0x1_3000)];
        assert_eq!(plan_staged_copies(elsewhere.into_iter(), 1, 0, 0, &pairs, &mut runs), Err((0, IoctxFault::StagedScatteredData)));
        let unaligned_start = [prp(0x1_0200, 4096, 0x1_1000)];
        plan_staged_copies(unaligned_start.into_iter(), 1, 0, 0, &pairs, &mut runs).unwrap();
        assert_eq!(runs, vec![CopyRun { host_address: 0x7000_0200, gpu_address: 0x9000_0200, len_bytes: 4096 }]);
        let drifting = [prp(0x1_0000, 8192, 0x1_1000)];
        assert_eq!(plan_staged_copies(drifting.into_iter(), 2, 0x2000, 0, &pairs, &mut runs), Err((0, IoctxFault::StagedScatteredData)));
        let moving = [prp(0x1_0000, 8192, 0x1_1000)];
        plan_staged_copies(moving.into_iter(), 2, 0x2000, 0x2000, &pairs, &mut runs).unwrap();
        assert_eq!(runs, vec![CopyRun { host_address: 0x7000_0000, gpu_address: 0x9000_0000, len_bytes: 8192 }]);
        let list = [prp(0x1_0000, 12288, 0x1_7000)];
        assert_eq!(plan_staged_copies(list.into_iter(), 1, 0, 0, &pairs, &mut runs), Err((0, IoctxFault::StagedScatteredData)));
        let inline = [prp(0x1_0000, 12288, 0)];
        plan_staged_copies(inline.into_iter(), 1, 0, 0, &pairs, &mut runs).unwrap();
        assert_eq!(runs.len(), 1, "no PRP2: the plan does not judge it (fill refuses what needs one)");
    }

    #[test]
    fn staged_planning_refuses_a_descriptor_kind_the_abi_does_not_define() {
        // Goal: the same rule as the kernel and the CPU executor: an unknown kind is an invalid
        // IOCTX, never read as a contiguous PRP transfer and copied.
        let pairs = [StagingPair { iova: Iova(0x1_0000), host_address: 0x7000_0000, gpu_address: 0x9000_0000, len_bytes: 0x4000 }];
        let mut runs = Vec::new();
        for kind in [abi::GIO_DESCRIPTOR_KIND_COUNT as u8, 9, u8::MAX] {
            let unknown = [ioctx(0x1_0000, 512), StagedIoctx { descriptor_kind: kind, ..ioctx(0x1_0200, 512) }];
            let error = plan_staged_copies(unknown.into_iter(), 1, 0, 0, &pairs, &mut runs).unwrap_err();
            assert_eq!(error, (1, IoctxFault::UnknownDescriptorKind { kind }));
        }
    }
}
