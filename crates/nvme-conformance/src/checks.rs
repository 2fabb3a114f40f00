//! The checks. Each one opens with its goal, brings its own controller up, and leaves the device
//! usable for the next.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::datapath::{PAGE_BYTES, PRP_LIST_ENTRIES_MAX};
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{SglDescriptor, StatusCodeType, SubmissionEntry};
use nvme_driver::{
    BlockCount, Controller, ControllerConfig, DataPointerMode, DataPointerPreference, DataSegment, DeviceBackend, DmaAllocator, DmaRegion,
    HwError, IoQueuePair, Lba, Namespace, NamespaceId, NvmeError, QueueId,
};

use crate::pattern::{fill_pattern, mix, verify_pattern};
use crate::{FaultInjector, SuiteConfig};

pub(crate) struct Context {
    pub device: Arc<dyn DeviceBackend>,
    pub faults: Option<Arc<dyn FaultInjector>>,
    pub config: SuiteConfig,
    /// This run's pattern nonce (see [`crate::SuiteReport::pattern_nonce`]).
    pub nonce: u64,
}

impl Context {
    /// The pattern seed for `base` in this run: every check's patterns change with the run's
    /// nonce, so blocks an earlier run left on persistent media never read back as this run's
    /// data (a controller that drops writes would otherwise pass a second run).
    fn seed(&self, base: u64) -> u64 {
        base ^ self.nonce
    }

    /// [`Context::seed`] for data written to `namespace`: each namespace's pattern is its own,
    /// so blocks one namespace's I/O left in another's (a fixed or stale NSID, namespaces that
    /// alias each other) do not read back as the other's data. `mix` is a bijection: distinct
    /// namespaces give distinct seeds for one base.
    fn namespace_seed(&self, base: u64, namespace: NamespaceId) -> u64 {
        self.seed(base) ^ mix(u64::from(namespace.0) << 32)
    }

    /// The pattern of [`read_write_sizes`]'s `round` in `namespace`, in `mode`. The mode is in
    /// it because the PRP and SGL runs write the same LBAs, one after the other in a run: with
    /// one pattern, a write in the second mode that never reached the media would read back
    /// the first mode's blocks and pass. (Rounds stay below 2^16: a handful of sizes.)
    fn read_write_seed(&self, mode: DataPointerMode, round: u64, namespace: NamespaceId) -> u64 {
        self.namespace_seed(0x5eed_0000 + round + ((mode as u64) << 16), namespace)
    }

    /// The pattern of [`namespaces_kept_apart`]'s tags in `namespace`, in `mode` (the mode in
    /// it for the reason [`Context::read_write_seed`] gives).
    fn tag_seed(&self, mode: DataPointerMode, namespace: NamespaceId) -> u64 {
        self.namespace_seed(0x7a95_0000 + mode as u64, namespace)
    }
}

pub(crate) enum Verdict {
    Passed,
    /// Passed, with what the check adapted to (shown on its report line).
    PassedWith(String),
    Skipped(String),
}

/// Why a check failed, as text for the report.
#[derive(Debug)]
pub(crate) struct Failure(String);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<NvmeError> for Failure {
    fn from(error: NvmeError) -> Self {
        Failure(error.to_string())
    }
}

impl From<HwError> for Failure {
    fn from(error: HwError) -> Self {
        Failure(error.to_string())
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure(message)
    }
}

type Outcome = Result<Verdict, Failure>;

macro_rules! ensure {
    ($condition:expr, $($message:tt)+) => {
        if !$condition {
            return Err(Failure(format!($($message)+)));
        }
    };
}

pub(crate) struct Check {
    pub name: &'static str,
    pub run: fn(&Context) -> Outcome,
    /// Skipped on a device without a [`FaultInjector`] (it provokes a fault to check).
    pub needs_faults: bool,
}

pub(crate) const ALL: &[Check] = &[
    Check { name: "bring_up_and_identify", run: bring_up_and_identify, needs_faults: false },
    Check { name: "queue_pairs_at_full_depth", run: queue_pairs_at_full_depth, needs_faults: false },
    Check { name: "read_write_sizes_prp", run: |context| read_write_sizes(context, DataPointerMode::Prp), needs_faults: false },
    Check { name: "read_write_sizes_sgl", run: |context| read_write_sizes(context, DataPointerMode::Sgl), needs_faults: false },
    Check { name: "scatter_read_prp", run: |context| scatter_read(context, DataPointerMode::Prp), needs_faults: false },
    Check { name: "scatter_read_sgl", run: |context| scatter_read(context, DataPointerMode::Sgl), needs_faults: false },
    Check { name: "mdts_split", run: mdts_split, needs_faults: false },
    Check { name: "flush_write_zeroes_deallocate", run: flush_write_zeroes_deallocate, needs_faults: false },
    Check { name: "error_lba_out_of_range", run: error_lba_out_of_range, needs_faults: false },
    Check { name: "error_invalid_field", run: error_invalid_field, needs_faults: false },
    Check { name: "error_invalid_opcode_and_namespace", run: error_invalid_opcode_and_namespace, needs_faults: false },
    Check { name: "error_invalid_sgl", run: error_invalid_sgl, needs_faults: false },
    Check { name: "bounded_timeout", run: bounded_timeout, needs_faults: true },
    Check { name: "corrupted_command_id_detected", run: corrupted_command_id_detected, needs_faults: true },
    Check { name: "fatal_status_then_reset", run: fatal_status_then_reset, needs_faults: true },
    Check { name: "reset_and_continue", run: reset_and_continue, needs_faults: false },
    Check { name: "detached_queue_pair", run: detached_queue_pair, needs_faults: false },
    Check { name: "data_integrity", run: data_integrity, needs_faults: false },
];

fn bring_up(context: &Context, preference: DataPointerPreference) -> Result<Controller, Failure> {
    let config = ControllerConfig {
        io_queue_pairs_requested: context.config.queue_pairs.max(1),
        data_pointer: preference,
        ..ControllerConfig::default()
    };
    Ok(Controller::init(Arc::clone(&context.device), config)?)
}

/// The size of the device's first namespace, from a bring-up of its own; None when the device
/// does not come up or has none (the checks then say why).
pub(crate) fn first_namespace_bytes(context: &Context) -> Option<u64> {
    let controller = bring_up(context, DataPointerPreference::Auto).ok()?;
    first_namespace(&controller).ok().map(|namespace| namespace.size_bytes())
}

fn first_namespace(controller: &Controller) -> Result<Namespace, Failure> {
    controller.namespaces().first().copied().ok_or_else(|| Failure("controller reports no active namespace".into()))
}

fn deadline(context: &Context) -> Instant {
    Instant::now() + context.config.timeout
}

/// An I/O queue pair of `depth` (at most CAP.MQES) on `controller`.
///
/// Every check declares the DMA buffers its commands name before the queue pair that runs
/// them, so that on an early return (an error with commands still in flight) the pair drops
/// first: its drop deletes the queues, after which the controller moves no more data, and only
/// then do the buffers give their IOVA back. Declared after it, they went first, while a read
/// could still write into the range.
fn queue(controller: &Controller, depth: u32) -> Result<IoQueuePair, Failure> {
    let depth = depth.min(controller.capabilities().max_queue_entries());
    Ok(controller.create_io_queue_pair(depth)?)
}

/// Goal: bring-up reaches Ready and Identify data is coherent (namespaces, MDTS, LBA sizes).
fn bring_up_and_identify(context: &Context) -> Outcome {
    let controller = bring_up(context, DataPointerPreference::Auto)?;
    let identify = controller.identify();
    ensure!(identify.namespace_count >= 1, "Identify Controller NN is 0");
    ensure!(!controller.namespaces().is_empty(), "no active namespace");
    for namespace in controller.namespaces() {
        ensure!(
            matches!(namespace.block_size_bytes, 512 | 4096),
            "{} has unexpected LBA size {}",
            namespace.id,
            namespace.block_size_bytes
        );
        ensure!(namespace.size_blocks > 0, "{} has zero size", namespace.id);
    }
    ensure!(controller.max_transfer_bytes() >= 4096, "max transfer {} below one page", controller.max_transfer_bytes());
    ensure!(controller.granted_queue_pairs() >= 1, "no I/O queue pairs granted");
    ensure!(controller.status()?.ready(), "CSTS.RDY is not set after bring-up");
    // The SMART log must be readable (1.4 controllers all support it).
    let smart = controller.log_page(nvme_driver::spec::LogPageId::SmartHealth, 512)?;
    ensure!(smart.len() == 512, "SMART log length {}", smart.len());
    Ok(Verdict::Passed)
}

/// How many I/O queue pairs the multi-queue checks use: what the suite asked for, bounded by
/// what the controller granted (a controller may grant fewer, down to one), and the line that
/// says so in the report.
fn queue_pairs_to_use(context: &Context, controller: &Controller) -> Result<(u16, String), Failure> {
    let requested = context.config.queue_pairs.max(1);
    let granted = controller.granted_queue_pairs();
    ensure!(granted >= 1, "controller granted no I/O queue pair");
    let pairs = requested.min(granted);
    let note = if pairs < requested {
        format!("{pairs} I/O queue pair(s): the controller granted {granted} of the {requested} requested")
    } else {
        format!("{pairs} I/O queue pair(s)")
    };
    Ok((pairs, note))
}

/// Goal: every I/O queue pair the controller grants (up to the configured number), each filled
/// to its full depth in one doorbell, all complete.
fn queue_pairs_at_full_depth(context: &Context) -> Outcome {
    let controller = bring_up(context, DataPointerPreference::Auto)?;
    let namespace = first_namespace(&controller)?;
    let (pairs, note) = queue_pairs_to_use(context, &controller)?;
    let depth = context.config.queue_depth_max.min(controller.capabilities().max_queue_entries());
    let block = namespace.block_size_bytes as usize;
    // Before the queues, so that it outlives them (see `queue`).
    let buffer = controller.dma().allocate(block * depth as usize)?;
    let mut queues = Vec::new();
    for _ in 0..pairs {
        queues.push(queue(&controller, depth)?);
    }
    for queue in &mut queues {
        let commands = queue.free_slots();
        ensure!(commands == depth as usize - 1, "{} offers {} slots for depth {}", queue.id(), commands, depth);
        for index in 0..commands {
            let segment = DataSegment::new(
                buffer.iova().checked_add((index * block) as u64).ok_or_else(|| Failure("iova overflow".into()))?,
                block as u32,
            );
            queue.submit_read(namespace.id, Lba(index as u64 % namespace.size_blocks), &[segment], index as u64)?;
        }
        // One more must be back-pressure, not an error or an overwrite.
        let extra = queue.submit_read(namespace.id, Lba(0), &[DataSegment::new(buffer.iova(), block as u32)], 0);
        ensure!(extra.as_ref().is_err_and(NvmeError::is_backpressure), "submitting past full depth gave {extra:?}");
        queue.ring_doorbell()?;
    }
    for queue in &mut queues {
        let mut completed = 0usize;
        let mut failure = None;
        let queue_id = queue.id();
        queue.wait_idle(deadline(context), |completion| {
            completed += 1;
            if failure.is_none() {
                failure = completion.into_result(queue_id).err();
            }
        })?;
        if let Some(error) = failure {
            return Err(error.into());
        }
        ensure!(completed == depth as usize - 1, "{} completed {} of {} commands", queue_id, completed, depth - 1);
    }
    Ok(Verdict::PassedWith(format!("{note}, depth {depth}")))
}

fn mode_preference(controller_sgl: bool, mode: DataPointerMode) -> Result<DataPointerPreference, String> {
    match mode {
        DataPointerMode::Prp => Ok(DataPointerPreference::Prp),
        DataPointerMode::Sgl if controller_sgl => Ok(DataPointerPreference::Sgl),
        DataPointerMode::Sgl => Err("controller does not support SGL (Identify SGLS)".into()),
    }
}

fn controller_for_mode(context: &Context, mode: DataPointerMode) -> Result<Result<Controller, String>, Failure> {
    let probe = bring_up(context, DataPointerPreference::Auto)?;
    let sgl = probe.identify().sgl_support.supported();
    drop(probe);
    match mode_preference(sgl, mode) {
        Ok(preference) => Ok(Ok(bring_up(context, preference)?)),
        Err(reason) => Ok(Err(reason)),
    }
}

fn write_then_read(
    context: &Context,
    queue: &mut IoQueuePair,
    namespace: &Namespace,
    start: Lba,
    write_segments: &[DataSegment],
    read_segments: &[DataSegment],
) -> Result<(), Failure> {
    queue.write(namespace.id, start, write_segments, false, context.config.timeout)?;
    queue.read(namespace.id, start, read_segments, context.config.timeout)?;
    Ok(())
}

/// Goal: reads and writes from one block to 4×MDTS move exactly the bytes written, in `mode`.
fn read_write_sizes(context: &Context, mode: DataPointerMode) -> Outcome {
    let controller = match controller_for_mode(context, mode)? {
        Ok(controller) => controller,
        Err(reason) => return Ok(Verdict::Skipped(reason)),
    };
    let dma = Arc::clone(controller.dma());
    let max = 4 * controller.max_transfer_bytes();
    // One source and one sink for every round, the largest transfer's size, allocated before
    // the queue pairs so that they outlive them (see `queue`).
    let source = dma.allocate(max as usize)?;
    let sink = dma.allocate(max as usize)?;
    for namespace in controller.namespaces().to_vec() {
        let mut queue = queue(&controller, 64)?;
        ensure!(queue.data_pointer_mode() == mode, "queue uses {:?}, wanted {mode:?}", queue.data_pointer_mode());
        let block = u64::from(namespace.block_size_bytes);
        let mut sizes =
            vec![block, 4096.max(block), 8192, 64 * 1024, controller.max_transfer_bytes(), controller.max_transfer_bytes() + block, max];
        if context.config.quick {
            sizes = vec![block, controller.max_transfer_bytes() + block, max];
        }
        sizes.retain(|size| size % block == 0);
        let capacity = namespace.size_bytes();
        for (round, size) in sizes.into_iter().enumerate() {
            ensure!(size <= capacity, "namespace too small for a {size}-byte transfer");
            let start_bytes = (round as u64 * 3 * max) % (capacity - size + 1) / block * block;
            let seed = context.read_write_seed(mode, round as u64, namespace.id);
            fill_pattern(&source, 0, size as usize, seed, start_bytes)?;
            // Zeroed, so that a read that moves nothing fails whatever an earlier round left.
            sink.fill(0, size as usize, 0)?;
            let source_segment = DataSegment::new(source.iova(), size as u32);
            let sink_segment = DataSegment::new(sink.iova(), size as u32);
            write_then_read(context, &mut queue, &namespace, Lba(start_bytes / block), &[source_segment], &[sink_segment])?;
            verify_pattern(&sink, 0, size as usize, seed, start_bytes)
                .map_err(|message| Failure(format!("{} {mode:?} {size} bytes: {message}", namespace.id)))?;
        }
    }
    namespaces_kept_apart(context, &controller, mode)?;
    Ok(Verdict::Passed)
}

/// Blocks of every namespace that [`namespaces_kept_apart`] tags: the first, the middle and the
/// last, as fractions of the namespace.
const NAMESPACE_TAGS: [(u64, u64); 3] = [(0, 1), (1, 2), (1, 1)];

/// Each namespace written first, then each read back: a block carrying its namespace's own
/// pattern at the first, middle and last LBA of every namespace. A write that reached another
/// namespace (a fixed or stale NSID in the command, namespaces aliasing each other) overwrote
/// that namespace's tag with a pattern that is not its own, and its read-back fails. (Read back
/// straight after its own write, as the rounds of [`read_write_sizes`] are, such a write would
/// pass: the read lands where the write did.)
fn namespaces_kept_apart(context: &Context, controller: &Controller, mode: DataPointerMode) -> Result<(), Failure> {
    let namespaces = controller.namespaces().to_vec();
    if namespaces.len() < 2 {
        return Ok(());
    }
    let dma = Arc::clone(controller.dma());
    // One block of the largest size for every namespace, before the queue pair so that they
    // outlive it (see `queue`).
    let block_max = namespaces.iter().map(|namespace| namespace.block_size_bytes as usize).max().unwrap_or(0);
    let source = dma.allocate(block_max)?;
    let sink = dma.allocate(block_max)?;
    let mut queue = queue(controller, 16)?;
    let tags = |namespace: &Namespace| {
        // A namespace of no blocks (which bring_up_and_identify fails) tags block 0 three times.
        let last = namespace.size_blocks.saturating_sub(1);
        NAMESPACE_TAGS.map(|(numerator, denominator)| Lba(last / denominator * numerator))
    };
    for namespace in &namespaces {
        let block = namespace.block_size_bytes as usize;
        let seed = context.tag_seed(mode, namespace.id);
        for lba in tags(namespace) {
            let disk_bytes = lba.0 * block as u64;
            fill_pattern(&source, 0, block, seed, disk_bytes)?;
            queue.write(namespace.id, lba, &[DataSegment::new(source.iova(), block as u32)], false, context.config.timeout)?;
        }
    }
    for namespace in &namespaces {
        let block = namespace.block_size_bytes as usize;
        let seed = context.tag_seed(mode, namespace.id);
        for lba in tags(namespace) {
            let disk_bytes = lba.0 * block as u64;
            sink.fill(0, block, 0)?;
            queue.read(namespace.id, lba, &[DataSegment::new(sink.iova(), block as u32)], context.config.timeout)?;
            verify_pattern(&sink, 0, block, seed, disk_bytes).map_err(|message| {
                Failure(format!(
                    "{} {mode:?} LBA {} after every namespace was written: {message} (another namespace's write landed in its blocks?)",
                    namespace.id, lba.0
                ))
            })?;
        }
    }
    Ok(())
}

/// Allocates `count` separate page-aligned buffers of `len` bytes (distinct regions, so their
/// device addresses are not contiguous).
fn scattered(dma: &dyn DmaAllocator, count: usize, len: usize) -> Result<Vec<DmaRegion>, Failure> {
    let mut regions = Vec::with_capacity(count);
    for _ in 0..count {
        regions.push(dma.allocate(len)?);
        // A spacer keeps consecutive buffers from being adjacent in IOVA space.
        let _spacer = dma.allocate(4096)?;
        regions.push(_spacer);
    }
    Ok(regions.into_iter().step_by(2).collect())
}

/// Goal: one LBA range read into many non-contiguous buffers lands each piece where it belongs.
fn scatter_read(context: &Context, mode: DataPointerMode) -> Outcome {
    let controller = match controller_for_mode(context, mode)? {
        Ok(controller) => controller,
        Err(reason) => return Ok(Verdict::Skipped(reason)),
    };
    let namespace = first_namespace(&controller)?;
    let dma = Arc::clone(controller.dma());
    let piece = 8192usize.max(namespace.block_size_bytes as usize);
    let count = if context.config.quick { 16 } else { 64 };
    let total = piece * count;
    // The buffers before the queue pair, so that they outlive it (see `queue`).
    let source = dma.allocate(total)?;
    let buffers = scattered(dma.as_ref(), count, piece)?;
    let mut queue = queue(&controller, 64)?;
    let start_bytes = 1024 * 1024u64;
    let seed = context.seed(0x5ca7_7e20 + mode as u64);
    fill_pattern(&source, 0, total, seed, start_bytes)?;
    let start = Lba(start_bytes / u64::from(namespace.block_size_bytes));
    queue.write(namespace.id, start, &[DataSegment::new(source.iova(), total as u32)], false, context.config.timeout)?;
    let segments: Vec<DataSegment> = buffers.iter().map(|region| DataSegment::new(region.iova(), piece as u32)).collect();
    let commands = queue.submit_read(namespace.id, start, &segments, 7)?;
    queue.complete_all(context.config.timeout)?;
    for (index, buffer) in buffers.iter().enumerate() {
        verify_pattern(buffer, 0, piece, seed, start_bytes + (index * piece) as u64)
            .map_err(|message| Failure(format!("piece {index} of {count} ({commands} commands): {message}")))?;
    }
    Ok(Verdict::Passed)
}

/// Goal: a transfer larger than MDTS is split into ceil(bytes / MDTS) commands, data intact.
fn mdts_split(context: &Context) -> Outcome {
    let controller = bring_up(context, DataPointerPreference::Auto)?;
    let namespace = first_namespace(&controller)?;
    let max = controller.max_transfer_bytes();
    let total = 4 * max + u64::from(namespace.block_size_bytes);
    // Before the queue pair, so that it outlives it (see `queue`).
    let buffer = controller.dma().allocate(total as usize)?;
    let mut queue = queue(&controller, 64)?;
    let seed = context.seed(77);
    fill_pattern(&buffer, 0, total as usize, seed, 0)?;
    let commands = queue.submit_write(namespace.id, Lba(0), &[DataSegment::new(buffer.iova(), total as u32)], false, 1)?;
    queue.complete_all(context.config.timeout)?;
    ensure!(commands as u64 == total.div_ceil(max), "{total} bytes with MDTS {max} took {commands} commands");
    buffer.fill(0, total as usize, 0)?;
    queue.read(namespace.id, Lba(0), &[DataSegment::new(buffer.iova(), total as u32)], context.config.timeout)?;
    verify_pattern(&buffer, 0, total as usize, seed, 0).map_err(Failure)?;
    Ok(Verdict::PassedWith(format!("{}: {total} bytes in {commands} commands", mdts_note(&controller))))
}

/// Goal: Flush succeeds; Write Zeroes reads back as zeroes; Deallocate succeeds (when supported).
fn flush_write_zeroes_deallocate(context: &Context) -> Outcome {
    let controller = bring_up(context, DataPointerPreference::Auto)?;
    let namespace = first_namespace(&controller)?;
    let block = namespace.block_size_bytes as usize;
    // Before the queue pair, so that it outlives it (see `queue`).
    let buffer = controller.dma().allocate(16 * block)?;
    let mut queue = queue(&controller, 64)?;
    let segment = DataSegment::new(buffer.iova(), (16 * block) as u32);
    fill_pattern(&buffer, 0, 16 * block, context.seed(3), 0)?;
    queue.write(namespace.id, Lba(32), &[segment], false, context.config.timeout)?;
    queue.flush(namespace.id, context.config.timeout)?;
    // What the controller does not support is not exercised, and the result line says so.
    let mut unsupported = Vec::new();
    if !controller.identify().supports_write_zeroes() {
        unsupported.push("Write Zeroes".to_string());
    }
    if !controller.identify().supports_dataset_management() {
        unsupported.push("Dataset Management (deallocate)".to_string());
    }
    if controller.identify().supports_write_zeroes() {
        match write_zeroes_submitted(queue.submit_write_zeroes(namespace.id, Lba(32), 16, false, 0))? {
            Err(reason) => unsupported.push(format!("Write Zeroes ({reason})")),
            Ok(()) => {
                queue.complete_all(context.config.timeout)?;
                queue.read(namespace.id, Lba(32), &[segment], context.config.timeout)?;
                let mut bytes = vec![1u8; 16 * block];
                buffer.read(0, &mut bytes)?;
                ensure!(bytes.iter().all(|&byte| byte == 0), "blocks read back non-zero after Write Zeroes");
            }
        }
    }
    if controller.identify().supports_dataset_management() {
        queue.submit_deallocate(namespace.id, &[(Lba(32), 8), (Lba(40), 8)], 0)?;
        queue.complete_all(context.config.timeout)?;
        queue.read(namespace.id, Lba(32), &[segment], context.config.timeout)?;
    }
    // Writes with FUA complete too.
    queue.write(namespace.id, Lba(48), &[segment], true, context.config.timeout)?;
    if unsupported.is_empty() {
        Ok(Verdict::Passed)
    } else {
        Ok(Verdict::PassedWith(format!("not supported by the controller, not exercised: {}", unsupported.join(", "))))
    }
}

/// What came of queuing a Write Zeroes: `Ok(Ok(()))` queued; `Ok(Err(reason))` refused before
/// anything was queued because the controller cannot take it (a Write Zeroes Size Limit below
/// one block: `NvmeError::Unsupported`), which the check lists as not exercised; any other
/// error fails the check.
fn write_zeroes_submitted(submitted: Result<usize, NvmeError>) -> Result<Result<(), String>, Failure> {
    match submitted {
        Ok(_) => Ok(Ok(())),
        Err(NvmeError::Unsupported { reason }) => Ok(Err(reason)),
        Err(error) => Err(error.into()),
    }
}

/// Runs `entry` raw (optionally with data) and returns the controller's status as a typed error.
fn raw_status(
    context: &Context,
    queue: &mut IoQueuePair,
    entry: SubmissionEntry,
    data: Option<&[DataSegment]>,
) -> Result<NvmeError, Failure> {
    match data {
        Some(segments) => queue.submit_raw_with_data(entry, segments, 99)?,
        None => queue.submit_raw(entry, 99)?,
    }
    match queue.complete_all(context.config.timeout) {
        Err(error @ NvmeError::Command { .. }) => Ok(error),
        Err(other) => Err(Failure(format!("expected a command status, got: {other}"))),
        Ok(()) => Err(Failure(format!("command with opcode {:#04x} unexpectedly succeeded", entry.opcode()))),
    }
}

fn expect_status(error: &NvmeError, code_type: StatusCodeType, code: u8, what: &str) -> Result<(), Failure> {
    match error.status() {
        Some(status) if status.is(code_type, code) => Ok(()),
        _ => Err(Failure(format!("{what}: expected status sct {:#x} sc {code:#04x}, got {error}", code_type.as_u8()))),
    }
}

/// Goal: the device's LBA Out of Range reaches the caller as a typed error; the driver's own
/// range check refuses the same request before it reaches the device.
fn error_lba_out_of_range(context: &Context) -> Outcome {
    let controller = bring_up(context, DataPointerPreference::Auto)?;
    let namespace = first_namespace(&controller)?;
    // Before the queue pair, so that it outlives it (see `queue`).
    let buffer = controller.dma().allocate(namespace.block_size_bytes as usize)?;
    let mut queue = queue(&controller, 16)?;
    let segment = DataSegment::new(buffer.iova(), namespace.block_size_bytes);
    let error = raw_status(
        context,
        &mut queue,
        SubmissionEntry::read(namespace.id, Lba(namespace.size_blocks), BlockCount::ONE),
        Some(&[segment]),
    )?;
    expect_status(&error, StatusCodeType::Generic, codes::LBA_OUT_OF_RANGE, "read past the end")?;
    let refused = queue.submit_read(namespace.id, Lba(namespace.size_blocks), &[segment], 0);
    ensure!(matches!(refused, Err(NvmeError::LbaOutOfRange { .. })), "driver range check gave {refused:?}");
    // The queue still works.
    queue.read(namespace.id, Lba(0), &[segment], context.config.timeout)?;
    Ok(Verdict::Passed)
}

/// The device's own MDTS in bytes (Identify MDTS in CAP.MPSMIN units), `None` for no limit. This
/// is not [`Controller::max_transfer_bytes`], which the driver also caps at one PRP list page
/// (2 MiB): a device may accept more in one command.
fn device_max_transfer_bytes(controller: &Controller) -> Option<u64> {
    controller.identify().max_transfer_bytes(controller.capabilities().min_page_size_bytes())
}

/// The device's MDTS for a report line, with the driver's own split size when that is smaller.
fn mdts_note(controller: &Controller) -> String {
    let split_kib = controller.max_transfer_bytes() / 1024;
    match device_max_transfer_bytes(controller) {
        Some(bytes) if bytes / 1024 == split_kib => format!("MDTS {split_kib} KiB"),
        Some(bytes) => format!("MDTS {} KiB (the driver splits at {split_kib} KiB)", bytes / 1024),
        None => format!("no MDTS limit (the driver splits at {split_kib} KiB)"),
    }
}

/// Goal: a transfer one block above the device's MDTS in one command is answered with Invalid
/// Field in Command. Skipped when the device reports no MDTS, or when that transfer is more than
/// one command can describe (more than one PRP list page's 513 pages, more than 65536 blocks):
/// then the device cannot be asked.
fn error_invalid_field(context: &Context) -> Outcome {
    let controller = bring_up(context, DataPointerPreference::Auto)?;
    let namespace = first_namespace(&controller)?;
    let Some(limit) = device_max_transfer_bytes(&controller) else {
        return Ok(Verdict::Skipped("controller reports no MDTS limit".into()));
    };
    let block = u64::from(namespace.block_size_bytes);
    let bytes = limit.checked_add(block).ok_or_else(|| Failure(format!("MDTS {limit} bytes plus one block overflows")))?;
    let Some(blocks) = u32::try_from(bytes / block).ok().and_then(BlockCount::new) else {
        return Ok(Verdict::Skipped(format!(
            "MDTS {} KiB plus one block is more than the {} blocks of {block} bytes one command carries",
            limit / 1024,
            BlockCount::MAX
        )));
    };
    let (Ok(length), Ok(allocation)) = (u32::try_from(bytes), usize::try_from(bytes)) else {
        return Ok(Verdict::Skipped(format!("MDTS {} KiB plus one block is more than one data segment carries", limit / 1024)));
    };
    // The mode the controller's queue pairs get (bring-up chose it), known before anything is
    // allocated: a transfer the check skips is never allocated (it can be tens of MiB, and a
    // failed allocation would turn the skip into a failure).
    let mode = controller.data_pointer_mode();
    // The buffer is page aligned: PRP1 names its first page, one list page the rest.
    let pages = bytes.div_ceil(PAGE_BYTES);
    let pages_max = PRP_LIST_ENTRIES_MAX as u64 + 1;
    if mode == DataPointerMode::Prp && pages > pages_max {
        return Ok(Verdict::Skipped(format!(
            "MDTS {} KiB plus one block is {pages} pages, more than one PRP data pointer describes ({pages_max})",
            limit / 1024
        )));
    }
    // Before the queue pair, so that it outlives it (see `queue`).
    let buffer = controller.dma().allocate(allocation)?;
    let mut queue = queue(&controller, 16)?;
    ensure!(queue.data_pointer_mode() == mode, "a queue pair of a {} controller uses {}", mode.name(), queue.data_pointer_mode().name());
    let error = raw_status(
        context,
        &mut queue,
        SubmissionEntry::read(namespace.id, Lba(0), blocks),
        Some(&[DataSegment::new(buffer.iova(), length)]),
    )?;
    expect_status(&error, StatusCodeType::Generic, codes::INVALID_FIELD, "read of MDTS plus one block")?;
    Ok(Verdict::PassedWith(format!("{bytes} bytes in one {} command, {}", mode.name(), mdts_note(&controller))))
}

/// Goal: an unknown opcode and an inactive namespace are answered with their statuses.
fn error_invalid_opcode_and_namespace(context: &Context) -> Outcome {
    let controller = bring_up(context, DataPointerPreference::Auto)?;
    let namespace = first_namespace(&controller)?;
    // Before the queue pair, so that it outlives it (see `queue`).
    let buffer = controller.dma().allocate(4096)?;
    let mut queue = queue(&controller, 16)?;
    let mut unknown = SubmissionEntry::flush(namespace.id);
    unknown.cdw0 = 0x7E;
    let error = raw_status(context, &mut queue, unknown, None)?;
    expect_status(&error, StatusCodeType::Generic, codes::INVALID_OPCODE, "opcode 0x7e")?;
    let inactive = nvme_driver::NamespaceId(controller.identify().namespace_count.saturating_add(7));
    let error = raw_status(
        context,
        &mut queue,
        SubmissionEntry::read(inactive, Lba(0), BlockCount::ONE),
        Some(&[DataSegment::new(buffer.iova(), namespace.block_size_bytes)]),
    )?;
    expect_status(&error, StatusCodeType::Generic, codes::INVALID_NAMESPACE, "read from an inactive namespace")?;
    Ok(Verdict::Passed)
}

/// Goal: a malformed SGL (reserved descriptor type) is answered with SGL Descriptor Type Invalid.
fn error_invalid_sgl(context: &Context) -> Outcome {
    let controller = match controller_for_mode(context, DataPointerMode::Sgl)? {
        Ok(controller) => controller,
        Err(reason) => return Ok(Verdict::Skipped(reason)),
    };
    let namespace = first_namespace(&controller)?;
    // Before the queue pair, so that it outlives it (see `queue`).
    let buffer = controller.dma().allocate(4096)?;
    let mut queue = queue(&controller, 16)?;
    let mut entry = SubmissionEntry::read(namespace.id, Lba(0), BlockCount::ONE);
    entry.set_data_pointer_kind(nvme_driver::spec::command::DataPointerKind::Sgl);
    let mut descriptor = SglDescriptor::data_block(buffer.iova().0, namespace.block_size_bytes);
    descriptor.identifier = 0xE0; // type 0xE is reserved
    entry.dptr = descriptor.to_dptr();
    let error = raw_status(context, &mut queue, entry, None)?;
    // Controllers differ on which status names a reserved type in SGL1: SGL Descriptor Type
    // Invalid (the software controller) or Invalid SGL Segment Descriptor (QEMU 7.2). Both say
    // "this SGL is malformed"; anything else (success included) fails the check.
    let accepted = [codes::SGL_DESCRIPTOR_TYPE_INVALID, codes::INVALID_SGL_SEGMENT_DESCRIPTOR];
    match error.status() {
        Some(status) if status.code_type == StatusCodeType::Generic && accepted.contains(&status.code) => Ok(Verdict::Passed),
        _ => Err(Failure(format!(
            "reserved SGL descriptor type: expected SGL Descriptor Type Invalid or Invalid SGL Segment Descriptor, got {error}"
        ))),
    }
}

/// Goal: a command the device never completes fails at its deadline with an error naming the
/// queue and command, instead of hanging.
fn bounded_timeout(context: &Context) -> Outcome {
    let Some(faults) = &context.faults else {
        return Ok(Verdict::Skipped("device has no fault injection".into()));
    };
    let controller = bring_up(context, DataPointerPreference::Auto)?;
    let namespace = first_namespace(&controller)?;
    let mut queue = queue(&controller, 16)?;
    faults.drop_next_completion();
    queue.submit_flush(namespace.id, 5)?;
    queue.ring_doorbell()?;
    let started = Instant::now();
    let asked = Duration::from_millis(300);
    let result = queue.wait_idle(started + asked, |_| {});
    timeout_verdict(&result, started.elapsed(), asked, queue.id())?;
    Ok(Verdict::Passed)
}

/// Early a timeout may come and still count as at its deadline: none, in theory (the wait's
/// deadline is the start plus `asked`, on one monotonic clock); a little for clock granularity.
const TIMEOUT_SLACK: Duration = Duration::from_millis(5);

/// [`bounded_timeout`]'s verdict on a wait of `asked` on `queue` that returned `result` after
/// `waited`: a timeout naming that queue with the command still outstanding, neither before
/// the deadline (a driver that times out on its first empty poll would fail every command on a
/// merely slow device) nor long after it.
fn timeout_verdict(result: &Result<(), NvmeError>, waited: Duration, asked: Duration, queue: QueueId) -> Result<(), Failure> {
    let Err(NvmeError::Timeout { queue: named, outstanding, .. }) = result else {
        return Err(Failure(format!("expected a timeout, got {result:?}")));
    };
    ensure!(*named == queue, "the timeout names queue {named}, not {queue}, the queue waited on");
    ensure!(*outstanding >= 1, "the timeout on {queue} counts {outstanding} commands outstanding, not the one never completed");
    ensure!(waited + TIMEOUT_SLACK >= asked, "timed out after {waited:?}, before the {asked:?} deadline");
    ensure!(waited < Duration::from_secs(5), "timeout took {waited:?}");
    Ok(())
}

/// Goal: a completion whose command id matches nothing in flight is detected, not trusted.
fn corrupted_command_id_detected(context: &Context) -> Outcome {
    let Some(faults) = &context.faults else {
        return Ok(Verdict::Skipped("device has no fault injection".into()));
    };
    let controller = bring_up(context, DataPointerPreference::Auto)?;
    let namespace = first_namespace(&controller)?;
    let mut queue = queue(&controller, 16)?;
    faults.corrupt_next_command_id();
    queue.submit_flush(namespace.id, 5)?;
    queue.ring_doorbell()?;
    // Reaped by hand: a wait goes on past such a completion (the commands it waits for may still
    // complete), so only `reap` reports it as it comes.
    let deadline = Instant::now() + Duration::from_millis(500);
    let mut delivered = 0;
    let detected = loop {
        match queue.reap(usize::MAX, |_| delivered += 1) {
            Err(NvmeError::UnexpectedCompletion { .. }) => break true,
            Err(error) => return Err(Failure(format!("expected an unexpected-completion error, got {error:?}"))),
            Ok(_) if Instant::now() >= deadline => break false,
            Ok(_) => std::thread::yield_now(),
        }
    };
    ensure!(delivered == 0, "the flush completed under its own command id: nothing was corrupted");
    ensure!(detected, "no unexpected completion reported within 500 ms of the flush");
    ensure!(queue.in_flight() == 1, "the flush whose completion was corrupted is no longer in flight ({} are)", queue.in_flight());
    ensure!(!queue.failed(), "a completion naming nothing in flight failed the pair");
    // The flush's own completion never comes (the corrupted one was it): a wait on it runs to its
    // deadline and times out as any wait with a command still in flight.
    let asked = Duration::from_millis(100);
    let started = Instant::now();
    let result = queue.wait_idle(started + asked, |_| {});
    timeout_verdict(&result, started.elapsed(), asked, queue.id())?;
    ensure!(queue.in_flight() == 1, "the flush whose completion was corrupted is no longer in flight ({} are)", queue.in_flight());
    Ok(Verdict::Passed)
}

/// Goal: CSTS.CFS surfaces as ControllerFatal; after reset() I/O works again on new queues.
fn fatal_status_then_reset(context: &Context) -> Outcome {
    let Some(faults) = &context.faults else {
        return Ok(Verdict::Skipped("device has no fault injection".into()));
    };
    let mut controller = bring_up(context, DataPointerPreference::Auto)?;
    let namespace = first_namespace(&controller)?;
    let mut queue = queue(&controller, 16)?;
    faults.raise_fatal_status();
    let _ = queue.submit_flush(namespace.id, 1);
    queue.ring_doorbell()?;
    let result = queue.wait_idle(Instant::now() + Duration::from_millis(500), |_| {});
    ensure!(matches!(result, Err(NvmeError::ControllerFatal { .. })), "expected ControllerFatal, got {result:?}");
    faults.clear_faults();
    controller.reset(true)?;
    let stale = queue.submit_flush(namespace.id, 1);
    ensure!(matches!(stale, Err(NvmeError::QueueStale { .. })), "old queue after reset gave {stale:?}");
    drop(queue);
    let block = namespace.block_size_bytes as usize;
    // The buffers before the queue pair, so that they outlive it (see `queue`).
    let buffer = controller.dma().allocate(block)?;
    // Read back into a zeroed buffer of its own and compare: a controller that completes the
    // read without moving data must fail here.
    let sink = controller.dma().allocate(block)?;
    let mut fresh = self::queue(&controller, 16)?;
    let seed = context.seed(11);
    fill_pattern(&buffer, 0, block, seed, 0)?;
    sink.fill(0, block, 0)?;
    let (source, target) = (DataSegment::new(buffer.iova(), block as u32), DataSegment::new(sink.iova(), block as u32));
    write_then_read(context, &mut fresh, &namespace, Lba(0), &[source], &[target])?;
    verify_pattern(&sink, 0, block, seed, 0).map_err(Failure)?;
    Ok(Verdict::Passed)
}

/// Goal: reset() (with function-level reset) brings the controller back and data survives it.
fn reset_and_continue(context: &Context) -> Outcome {
    reset_and_continue_with(context, |controller| controller.reset(true))
}

/// [`reset_and_continue`] with `reset` for the controller's reset (a test gives one that does
/// less, which the check must fail).
fn reset_and_continue_with(context: &Context, reset: impl FnOnce(&mut Controller) -> Result<(), NvmeError>) -> Outcome {
    // The device behind a witness of its function-level resets: the data surviving and a new
    // queue working would also hold after a reset() that did nothing.
    let witness = Arc::new(ResetWitness { device: Arc::clone(&context.device), function_resets: AtomicUsize::new(0) });
    let context = &Context {
        device: Arc::clone(&witness) as Arc<dyn DeviceBackend>,
        faults: context.faults.clone(),
        config: context.config.clone(),
        nonce: context.nonce,
    };
    let mut controller = bring_up(context, DataPointerPreference::Auto)?;
    let namespace = first_namespace(&controller)?;
    let block = namespace.block_size_bytes as usize;
    let buffer = controller.dma().allocate(8 * block)?;
    let segment = DataSegment::new(buffer.iova(), (8 * block) as u32);
    let seed = context.seed(21);
    fill_pattern(&buffer, 0, 8 * block, seed, 64 * block as u64)?;
    // Kept across the reset: its queue is gone from the controller afterwards, and the driver
    // must say so rather than submit to it.
    let mut old = queue(&controller, 16)?;
    old.write(namespace.id, Lba(64), &[segment], false, context.config.timeout)?;
    old.flush(namespace.id, context.config.timeout)?;
    let resets_before = witness.function_resets.load(Ordering::Relaxed);
    reset(&mut controller)?;
    ensure!(
        witness.function_resets.load(Ordering::Relaxed) > resets_before,
        "reset(true) returned without asking the device for a function-level reset"
    );
    let stale = old.submit_flush(namespace.id, 1);
    ensure!(matches!(stale, Err(NvmeError::QueueStale { .. })), "a queue pair from before the reset gave {stale:?}, not QueueStale");
    drop(old);
    buffer.fill(0, 8 * block, 0)?;
    let mut queue = queue(&controller, 16)?;
    queue.read(namespace.id, Lba(64), &[segment], context.config.timeout)?;
    verify_pattern(&buffer, 0, 8 * block, seed, 64 * block as u64).map_err(Failure)?;
    Ok(Verdict::Passed)
}

/// A device that counts the function-level resets asked of it, for [`reset_and_continue`].
struct ResetWitness {
    device: Arc<dyn DeviceBackend>,
    function_resets: AtomicUsize,
}

impl DeviceBackend for ResetWitness {
    fn name(&self) -> String {
        self.device.name()
    }

    fn registers(&self) -> Arc<dyn nvme_driver::RegisterIo> {
        self.device.registers()
    }

    fn dma(&self) -> Arc<dyn DmaAllocator> {
        self.device.dma()
    }

    fn function_reset(&self) -> Result<(), HwError> {
        self.function_resets.fetch_add(1, Ordering::Relaxed);
        self.device.function_reset()
    }

    fn enable_bus_master(&self) -> Result<(), HwError> {
        self.device.enable_bus_master()
    }
}

/// Goal: `integrity_mib` MiB of patterned data written across every queue pair read back through
/// scattered buffers byte for byte.
fn data_integrity(context: &Context) -> Outcome {
    let controller = bring_up(context, DataPointerPreference::Auto)?;
    let namespace = first_namespace(&controller)?;
    let chunk = 1usize << 20;
    let total = context.config.integrity_mib.checked_mul(chunk as u64);
    ensure!(
        total.is_some_and(|total| total <= namespace.size_bytes()),
        "namespace holds {} bytes, integrity run needs {} MiB",
        namespace.size_bytes(),
        context.config.integrity_mib
    );
    let (pairs, note) = queue_pairs_to_use(context, &controller)?;
    // The buffers before the queue pairs, so that they outlive them (see `queue`). The reads
    // go into 16 scattered 64 KiB pieces per MiB.
    let staging = controller.dma().allocate(chunk)?;
    let pieces = scattered(controller.dma().as_ref(), 16, chunk / 16)?;
    let mut queues = Vec::new();
    for _ in 0..pairs {
        queues.push(queue(&controller, 256)?);
    }
    let block = u64::from(namespace.block_size_bytes);
    let seed = context.seed(0x1a7e_9417);
    for index in 0..context.config.integrity_mib {
        let offset = index * chunk as u64;
        fill_pattern(&staging, 0, chunk, seed, offset)?;
        let queue_count = queues.len();
        let queue = &mut queues[index as usize % queue_count];
        queue.write(namespace.id, Lba(offset / block), &[DataSegment::new(staging.iova(), chunk as u32)], false, context.config.timeout)?;
    }
    queues[0].flush(namespace.id, context.config.timeout)?;
    let segments: Vec<DataSegment> = pieces.iter().map(|region| DataSegment::new(region.iova(), (chunk / 16) as u32)).collect();
    for index in 0..context.config.integrity_mib {
        let offset = index * chunk as u64;
        let queue_count = queues.len();
        let queue = &mut queues[index as usize % queue_count];
        queue.read(namespace.id, Lba(offset / block), &segments, context.config.timeout)?;
        for (piece_index, piece) in pieces.iter().enumerate() {
            verify_pattern(piece, 0, chunk / 16, seed, offset + (piece_index * chunk / 16) as u64).map_err(Failure)?;
        }
    }
    Ok(Verdict::PassedWith(format!("{} MiB over {note}, {}", context.config.integrity_mib, mdts_note(&controller))))
}

/// Goal: a queue pair created for another agent (as the GPU executor uses them) works when that
/// agent writes entries and rings doorbells itself: here the check plays the agent from the CPU.
fn detached_queue_pair(context: &Context) -> Outcome {
    use nvme_driver::spec::{CompletionEntry, SUBMISSION_ENTRY_BYTES};
    use std::sync::atomic::Ordering;
    let controller = bring_up(context, DataPointerPreference::Prp)?;
    let namespace = first_namespace(&controller)?;
    let depth = 16u32;
    let submission = controller.dma().allocate(depth as usize * SUBMISSION_ENTRY_BYTES)?;
    let completion = controller.dma().allocate(depth as usize * 16)?;
    let block = namespace.block_size_bytes;
    // Write one block with PRP1, then read it back into a second buffer: both before the
    // queue pairs, so that they outlive them (see `queue`).
    let buffer = controller.dma().allocate(block as usize)?;
    let sink = controller.dma().allocate(block as usize)?;
    let detached = controller.create_detached_queue_pair(depth, Some((submission.clone(), completion.clone())))?;
    let layout = detached.layout();
    ensure!(layout.submission_iova == submission.iova(), "layout names another submission ring");
    let seed = context.seed(41);
    fill_pattern(&buffer, 0, block as usize, seed, 0)?;
    let mut write = SubmissionEntry::write(namespace.id, Lba(5), BlockCount::ONE, false);
    write.set_command_id(nvme_driver::CommandId(1));
    write.dptr = [buffer.iova().0, 0];
    let mut read = SubmissionEntry::read(namespace.id, Lba(5), BlockCount::ONE);
    read.set_command_id(nvme_driver::CommandId(2));
    read.dptr = [sink.iova().0, 0];
    submission.write(0, &write.to_bytes())?;
    // Commands in one SQ may complete in any order, so the read is submitted only after the write
    // completed: one doorbell per entry.
    // The agent owes the controller what the driver's own queue pairs do (nvme_driver::hw's
    // fences, whose docs say why): the entry's stores complete before the doorbell that makes
    // it fetchable, the completion's body is read only after its phase tag was seen, and its
    // loads complete before the CQ doorbell hands the slots back. On Arm (GH200, where the
    // GPU agent runs) a device is outside what plain atomics order: without them the
    // controller could fetch a stale (zeroed) entry, or the body read return the slot's
    // earlier, zeroed contents, and the check fail a correct controller.
    let registers = controller.registers();
    nvme_driver::hw::fence_before_submission_doorbell();
    registers.write32(layout.submission_doorbell_offset, 1);
    let wait_entry = |index: usize| -> Result<CompletionEntry, Failure> {
        let deadline = deadline(context);
        loop {
            let dword3 = completion.load_u32(index * 16 + CompletionEntry::DWORD3_OFFSET, Ordering::Acquire)?;
            if CompletionEntry::decode_dword3(dword3).2 {
                nvme_driver::hw::fence_after_completion_phase();
                let mut bytes = [0u8; 16];
                completion.read(index * 16, &mut bytes)?;
                return Ok(CompletionEntry::from_bytes(&bytes));
            }
            ensure!(Instant::now() < deadline, "no completion in slot {index} of the detached CQ");
            std::thread::yield_now();
        }
    };
    let first = wait_entry(0)?;
    ensure!(first.command_id == 1 && first.status().is_ok(), "write completion {first:?}");
    submission.write(SUBMISSION_ENTRY_BYTES, &read.to_bytes())?;
    nvme_driver::hw::fence_before_submission_doorbell();
    registers.write32(layout.submission_doorbell_offset, 2);
    let second = wait_entry(1)?;
    ensure!(second.command_id == 2 && second.status().is_ok(), "read completion {second:?}");
    nvme_driver::hw::fence_before_completion_doorbell();
    registers.write32(layout.completion_doorbell_offset, 2);
    verify_pattern(&sink, 0, block as usize, seed, 0).map_err(Failure)?;
    drop(detached);
    // The queue id is free again: an ordinary queue pair can be created and used. The sink is
    // zeroed first, so the read must move the block to pass.
    let mut queue = queue(&controller, 16)?;
    sink.fill(0, block as usize, 0)?;
    queue.read(namespace.id, Lba(5), &[DataSegment::new(sink.iova(), block)], context.config.timeout)?;
    verify_pattern(&sink, 0, block as usize, seed, 0).map_err(Failure)?;
    Ok(Verdict::Passed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timed_out(queue: QueueId) -> Result<(), NvmeError> {
        Err(NvmeError::Timeout { queue, command_id: nvme_driver::CommandId(5), waited_ms: 300, outstanding: 1 })
    }

    fn emu_context() -> Context {
        let emulator =
            nvme_emu::EmuDevice::start(nvme_emu::EmuConfig::default().with_backing(nvme_emu::Backing::Memory { bytes: 4 << 20 }))
                .expect("start the software controller");
        let config = SuiteConfig { timeout: Duration::from_secs(20), ..SuiteConfig::default() };
        Context { device: emulator, faults: None, config, nonce: 0x1234_5678_9abc_def0 }
    }

    #[test]
    fn reset_and_continue_fails_a_reset_that_does_not_reset() {
        // Goal (finding 5): on QEMU and real SSDs this is the only reset check: a reset() that
        // returns having done nothing, or that skips the function-level reset it was asked
        // for, fails it; the driver's own reset passes.
        let context = emu_context();
        assert!(matches!(reset_and_continue(&context), Ok(Verdict::Passed)), "the driver's reset");
        let nothing = reset_and_continue_with(&context, |_| Ok(()));
        assert!(nothing.is_err(), "a reset that did nothing passed");
        let without_flr = reset_and_continue_with(&context, |controller| controller.reset(false));
        assert!(without_flr.as_ref().is_err_and(|failure| failure.0.contains("function-level reset")), "{:?}", without_flr.err());
    }

    #[test]
    fn namespaces_get_patterns_of_their_own() {
        // Goal (finding 4): one seed base gives each namespace another pattern, so that data
        // one namespace's I/O left in another's blocks (a fixed or stale NSID, namespaces
        // aliasing each other) does not read back as that namespace's own.
        let emulator =
            nvme_emu::EmuDevice::start(nvme_emu::EmuConfig::default().with_backing(nvme_emu::Backing::Memory { bytes: 1 << 20 }))
                .expect("start the software controller");
        let context = Context { device: emulator, faults: None, config: SuiteConfig::default(), nonce: 0x1234_5678_9abc_def0 };
        let seeds: Vec<u64> = (1..=64).map(|namespace| context.namespace_seed(0x5eed_0000, NamespaceId(namespace))).collect();
        for (index, seed) in seeds.iter().enumerate() {
            assert!(!seeds[..index].contains(seed), "namespace {} shares its pattern with an earlier one", index + 1);
            assert_ne!(*seed, context.namespace_seed(0x5eed_0001, NamespaceId(index as u32 + 1)), "rounds share a pattern");
        }
    }

    #[test]
    fn prp_and_sgl_write_patterns_of_their_own() {
        // Goal (rc-driver finding 2): read_write_sizes_prp and _sgl (and their
        // namespaces_kept_apart) write the same LBAs in one run, PRP first: with one pattern for
        // both, an SGL write that never reached the media read back the bytes the PRP check
        // left there and passed.
        let context = emu_context();
        for namespace in (1..=4).map(NamespaceId) {
            for round in 0..8 {
                let (prp, sgl) = (
                    context.read_write_seed(DataPointerMode::Prp, round, namespace),
                    context.read_write_seed(DataPointerMode::Sgl, round, namespace),
                );
                assert_ne!(prp, sgl, "round {round} of {namespace} writes one pattern in both modes");
            }
            assert_ne!(
                context.tag_seed(DataPointerMode::Prp, namespace),
                context.tag_seed(DataPointerMode::Sgl, namespace),
                "{namespace}'s tags carry one pattern in both modes"
            );
        }
    }

    #[test]
    fn error_invalid_field_skips_a_prp_transfer_past_one_list_before_allocating_it() {
        // Goal: on a PRP-only controller whose MDTS plus one block needs more than one PRP list
        // page, error_invalid_field skips before allocating that transfer's buffer (4 MiB here,
        // up to tens of MiB on real SSDs): a device short of DMA space would have turned the
        // skip into a failure. It used to allocate first and decide on the skip after. The DMA
        // space reports the largest mapping made.
        let largest = Arc::new(AtomicUsize::new(0));
        let observed = Arc::clone(&largest);
        let space = nvme_driver::DmaPool::identity_observed(Box::new(move |_, len| {
            observed.fetch_max(len, Ordering::Relaxed);
        }));
        let config =
            nvme_emu::EmuConfig::default().with_backing(nvme_emu::Backing::Memory { bytes: 4 << 20 }).with_sgl(false).with_mdts(10);
        let device = nvme_emu::EmuDevice::start_in(config, &space).expect("start the software controller");
        let config = SuiteConfig { timeout: Duration::from_secs(20), ..SuiteConfig::default() };
        let context = Context { device, faults: None, config, nonce: 0x1234_5678_9abc_def0 };
        let skipped = matches!(error_invalid_field(&context), Ok(Verdict::Skipped(reason)) if reason.contains("PRP"));
        assert!(skipped, "not skipped for its PRP pages");
        let largest = largest.load(Ordering::Relaxed);
        assert!(largest < 1 << 20, "a mapping of {largest} bytes was made for a transfer the check skips");
    }

    #[test]
    fn a_write_zeroes_the_controller_cannot_take_is_listed_as_not_exercised() {
        // Goal: since the driver refuses Write Zeroes where the controller's WZSL is below one
        // block (Unsupported, before anything is queued), flush_write_zeroes_deallocate lists
        // it as not exercised instead of failing through `?`. Other errors still fail it.
        // (Neither the software controller nor this crate's devices report a WZSL, so the
        // mapping is tested on the driver's answers.)
        let refused =
            Err(NvmeError::Unsupported { reason: "the Write Zeroes size limit (WZSL, 4096 bytes) is below one block of ns1".into() });
        match write_zeroes_submitted(refused) {
            Ok(Err(reason)) => assert!(reason.contains("WZSL"), "{reason}"),
            other => panic!("expected 'not exercised', got {:?}", other.map_err(|failure| failure.0)),
        }
        assert!(matches!(write_zeroes_submitted(Ok(1)), Ok(Ok(()))));
        let full = write_zeroes_submitted(Err(NvmeError::QueueFull { queue: QueueId(1), depth: 8 }));
        assert!(full.is_err(), "another error did not fail the check");
    }

    #[test]
    fn a_timeout_passes_only_at_its_deadline_and_naming_its_queue() {
        // Goal (finding 3): a driver that reports a timeout before the deadline (on its first
        // empty poll, or with a deadline it takes as passed) fails bounded_timeout, and so does
        // one whose error names another queue; a timeout at the deadline passes.
        let (queue, asked) = (QueueId(1), Duration::from_millis(300));
        timeout_verdict(&timed_out(queue), Duration::from_millis(301), asked, queue).expect("a timeout at its deadline");
        let early = timeout_verdict(&timed_out(queue), Duration::from_millis(1), asked, queue);
        assert!(early.as_ref().is_err_and(|failure| failure.0.contains("before")), "{early:?}");
        let other = timeout_verdict(&timed_out(QueueId(2)), Duration::from_millis(301), asked, queue);
        assert!(other.as_ref().is_err_and(|failure| failure.0.contains("names queue q2")), "{other:?}");
        let late = timeout_verdict(&timed_out(queue), Duration::from_secs(6), asked, queue);
        assert!(late.is_err(), "a timeout long past its deadline passed");
        let empty = Err(NvmeError::Timeout { queue, command_id: nvme_driver::CommandId(5), waited_ms: 300, outstanding: 0 });
        assert!(timeout_verdict(&empty, Duration::from_millis(301), asked, queue).is_err(), "a timeout with nothing outstanding passed");
        let none = timeout_verdict(&Ok(()), Duration::from_millis(301), asked, queue);
        assert!(none.is_err(), "no timeout passed");
    }
}
