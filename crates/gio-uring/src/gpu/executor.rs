//! The CUDA executor: one I/O kernel launch per `issue_io`, over NVMe queue pairs the GPU drives.
//!
//! STATUS: compiled and its pure parts unit-tested (`plan.rs`); never run — no GPU was available
//! while it was written. Treat it as unverified until `tests/gpu.rs` has passed on a GPU.
//!
//! Set-up, once: for each gio device index, a detached NVMe queue pair
//! ([`Controller::create_detached_queue_pair`]) whose rings the executor allocates from the
//! controller's DMA memory and registers with the GPU; BAR0 registered too (the doorbells); the
//! kernel's per-queue-pair state (`gio_nvme_qp` + slots) in GPU memory, filled from each pair's
//! [`nvme_driver::DetachedQueueLayout`]; in `attach`, the gio queue's region, a completion sink and
//! one CUDA event per IOCB.
//!
//! Per issue: `submit` makes the stream wait on the caller's event (if any), enqueues the staged
//! GPU→host copies of writes, launches the kernel with a grid sized within co-residency limits,
//! enqueues the staged host→GPU copies of reads, and records the launch's event. It allocates
//! nothing. `poll` retires launches whose event completed, in order: it posts each IOCB's CQE
//! from the IOCB's final line, then advances the gio SQ head past the launch.
//!
//! Why the CPU posts the CQEs, not the kernel. The kernel writes its own CQEs into a sink ring
//! that nobody reads, and the executor posts the real ones once the launch's event has completed:
//! (1) in staged mode a read's data reaches GPU memory only with the copies that follow the
//! kernel, so a CQE from the kernel would announce bytes not yet in place; (2) the kernel's
//! polling threads find "their" IOCBs through the SQ entries and status words until they exit,
//! so an IOCB reissued from a kernel-posted CQE before that kernel exited would be seen as still
//! running by the old kernel, which could time it out. The cost is CPU work O(IOCBs) per launch
//! and the latency of one `poll` after the kernel exits.
//!
//! Timeouts: when a retired launch holds an IOCB the kernel timed out, the NVMe queue pairs may
//! hold commands the kernel no longer tracks. The executor waits (bounded) for the stream to
//! drain, deletes and recreates every detached queue pair on the same rings, rewrites the kernel
//! state, and only then posts the CQEs, so that nothing can be issued onto a dirty queue pair.
//! A pair whose deletion fails is kept with its rings, which are not reused
//! ([`GioError::UndeletedQueuePair`], see `detached_rings.rs`); the launch then stays unretired,
//! so every later `poll` or `submit` retries the reset and no kernel runs until it succeeds.
//!
//! Teardown ([`Executor::retire_queue_pairs`]): no kernel is launched any more; once the stream
//! has drained (bounded), every detached pair is deleted (those kept by a failed deletion
//! retried), and only when all are known deleted are the launches still unretired retired, so
//! that no CQE tells the caller it may reuse memory a command left on a pair may still use.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::spec::{COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use nvme_driver::{Controller, DmaRegion};

use super::driver::{self, BarMapping, CallerEvent, CopyDirection, DeviceMemory, Event, HostRegistration, MemoryOwner};
use super::plan::{self, CopyRun, GridLimits, LaunchAddresses, QueuePairCounters, SpanLookup, StagedIoctx, StagingPair, StateLayout};
use super::retire::{self, sq_entry};
use super::{DmaMode, GpuRuntime};
use crate::abi::{self, gio_ring_header};
use crate::detached_rings::DetachedRings;
use crate::error::GioError;
use crate::executor::{Executor, IssueBatch};
use crate::layout::{QueueMemory, RingLayout};
use crate::shared_memory::{SharedRegion, REGION_ALIGN_BYTES};
use crate::types::{Dependency, EventToken, IocbId};

const NAME: &str = "cuda";

/// One NVMe queue pair for the GPU, i.e. one gio device index (the position in the list).
#[derive(Debug, Clone)]
pub struct GpuQueueSpec {
    pub controller: Arc<Controller>,
    /// The controller's BAR0 as the host maps it (emulated: [`BarMapping::host_memory`]).
    pub bar: BarMapping,
    /// Entries per ring: a power of two, 2..=min(16384, CAP.MQES + 1) (`plan::GPU_QUEUE_DEPTH_MAX`).
    pub depth: u32,
}

/// A staging buffer of staged DMA mode: IOVA-mapped host memory from a controller's DMA
/// allocator, and the GPU buffer of the same length it mirrors byte for byte.
#[derive(Debug, Clone)]
pub struct StagingBuffer {
    pub host: DmaRegion,
    pub gpu_address: u64,
}

/// How the executor runs the kernel.
#[derive(Debug, Clone)]
pub struct GpuExecutorConfig {
    /// A multiple of 32.
    pub threads_per_block: u32,
    /// Bound on every wait inside the kernel, in polling iterations: at least 1, and enough
    /// that, with the backoff sleeps between them (32 ns doubling up to `backoff_ns_max`), a wait
    /// nominally keeps looking at least [`plan::KERNEL_DEADLINE_MIN`]
    /// ([`plan::kernel_wait_window`], which counts the sleeps asked for: `__nanosleep(t)` sleeps
    /// 0 to about 2t; checked by [`GpuExecutor::new`]): a long cap does not make up for few
    /// iterations. At most so many, with `backoff_ns_max`, that one launch
    /// ([`plan::kernel_time_bound`]) ends within [`plan::DRAIN_TIMEOUT_MAX`] (an hour):
    /// `poll_iterations_max × backoff_ns_max` up to 3599 s, since `drain_timeout` must cover one
    /// launch and may not pass that ceiling ([`GpuExecutor::new`] refuses more, naming both fields).
    pub poll_iterations_max: u32,
    /// Cap of the kernel's exponential `__nanosleep` backoff. Every wait of a launch ends at one
    /// deadline, `poll_iterations_max × backoff_ns_max` after its block started (2 s with the
    /// defaults); a launch ends within [`plan::kernel_time_bound`] of starting, which must be at
    /// most [`plan::DRAIN_TIMEOUT_MAX`] (an hour; see `poll_iterations_max`).
    pub backoff_ns_max: u32,
    /// Bound on waiting for the stream to drain before a queue-pair reset; at least
    /// [`plan::kernel_time_bound`], so that one launch that runs to its deadline always drains,
    /// and at most [`plan::DRAIN_TIMEOUT_MAX`] (an hour), so that the wait stays bounded (both
    /// checked by [`GpuExecutor::new`]). The default, 10 s, drains three launches that all run
    /// to a 2 s deadline (a 3 s bound each); a drain that runs out is retried by the next `poll`.
    /// Teardown waits longer when more launches are unretired, a bound for each, and at least
    /// this, but at most [`plan::TEARDOWN_DRAIN_MAX`] (5 min) or this in all
    /// ([`plan::teardown_drain_timeout`]); a teardown drain that runs out keeps the memory for
    /// good.
    pub drain_timeout: Duration,
    /// Staged mode only (required there, refused in p2p mode).
    pub staging: Vec<StagingBuffer>,
}

impl Default for GpuExecutorConfig {
    fn default() -> Self {
        Self {
            threads_per_block: 128,
            poll_iterations_max: 200_000,
            backoff_ns_max: 10_000,
            drain_timeout: Duration::from_secs(10),
            staging: Vec::new(),
        }
    }
}

#[derive(Debug)]
struct DeviceQueue {
    /// The rings and the detached pair on them, kept across resets.
    rings: DetachedRings,
    rings_gpu: (u64, u64),
    bar_gpu: u64,
    bar_len_bytes: usize,
}

/// An event issues may depend on.
#[derive(Debug)]
enum DependencyEvent {
    Own(Event),
    Caller(CallerEvent),
}

impl DependencyEvent {
    fn raw(&self) -> cudarc::driver::sys::CUevent {
        match self {
            DependencyEvent::Own(event) => event.raw(),
            DependencyEvent::Caller(event) => event.raw(),
        }
    }
}

/// How far the enqueueing of a launch got before it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Reached {
    /// Something that reads or writes the caller's memory reached the stream: a staged copy
    /// (the GPU-to-host copies of writes go before the kernel) or the kernel.
    queued: bool,
    /// The kernel was launched.
    ran: bool,
}

#[derive(Debug, Clone, Copy)]
struct Launch {
    sq_first: u32,
    count: u32,
    /// `None`: enqueueing failed part way; its IOCBs are finished as timed out, even those the
    /// kernel (if it ran) finished as SUCCESS (see `enqueued`).
    event: Option<usize>,
    /// What reached the stream: with `ran`, a timeout may have left the queue pairs dirty; with
    /// `queued` and no event, the stream is drained before the launch retires.
    reached: Reached,
    /// Resets done when it was enqueued: a timeout in a launch older than the last reset does not
    /// need another one.
    reset_generation: u64,
    /// `retire::settle`'s verdict once it ran: a retried retirement does not settle again (see
    /// `retire::settle_once`).
    settled: Option<bool>,
    /// CQEs of its IOCBs posted so far (in SQ order): a retirement that failed part way resumes
    /// after them, so no IOCB gets two.
    posted: u32,
}

impl Launch {
    fn new(batch: &IssueBatch, event: Option<usize>, reached: Reached, reset_generation: u64) -> Self {
        Self { sq_first: batch.sq_first, count: batch.count, event, reached, reset_generation, settled: None, posted: 0 }
    }

    /// Whether everything reached the stream. Not so when the enqueue failed after something
    /// that uses the caller's memory was queued: a staged GPU-to-host copy of a write before
    /// the kernel (which may still be reading the caller's GPU memory), or the kernel, after
    /// which a staged host-to-GPU copy of a read or the event may be missing. Such a launch is
    /// retired only once the stream drained, and serves no SUCCESS.
    fn enqueued(&self) -> retire::Enqueued {
        if self.reached.queued && self.event.is_none() {
            retire::Enqueued::Partly
        } else {
            retire::Enqueued::Fully
        }
    }
}

/// State that exists once `init_queue` attached the executor to a queue.
#[derive(Debug)]
struct Attached {
    /// Keeps the queue's region alive as long as launches may read it; teardown retires the
    /// launches left unretired through it.
    memory: Arc<QueueMemory>,
    queue_gpu: u64,
    sink: Arc<SharedRegion>,
    sink_layout: RingLayout,
    sink_gpu: u64,
    events: Vec<Event>,
    free_events: Vec<usize>,
    launches: VecDeque<Launch>,
    /// Staged mode: the copies of each IOCB at layer 0, planned when it was filled.
    runs: Vec<Vec<CopyRun>>,
    /// The sink's `overflow_count` when last retired: CQEs the kernel could not post.
    sink_overflows: u32,
    /// The sink's `reset_requests` when the queue pairs were last reset (or attached): a launch
    /// retired with another value left a queue pair that only a reset repairs.
    sink_reset_requests: u32,
}

/// The CUDA executor (see the module documentation). Compiled, never run on a GPU.
#[derive(Debug)]
pub struct GpuExecutor {
    // Fields drop in order: host registrations go first, while the memory they pin is still
    // owned (by them and by the fields below); the runtime, which releases the context, goes last.
    registrations: Vec<HostRegistration>,
    attached: Option<Attached>,
    dependency_events: Vec<DependencyEvent>,
    state: DeviceMemory,
    state_layout: StateLayout,
    state_image: Vec<u8>,
    queues: Vec<DeviceQueue>,
    staging: Vec<StagingPair>,
    limits: GridLimits,
    config: GpuExecutorConfig,
    reset_generation: u64,
    /// `retire_queue_pairs` ran: nothing is launched and no queue pair is recreated any more.
    retired: bool,
    /// How long teardown (`retire_queue_pairs`, then the drop) has waited for the I/O stream so
    /// far: the later waits take it off their bound, so teardown blocks at most one
    /// [`plan::teardown_drain_timeout`] in all.
    teardown_waited: Duration,
    runtime: GpuRuntime,
}

fn nvme_error(context: String) -> impl FnOnce(nvme_driver::NvmeError) -> GioError {
    move |source| GioError::Nvme { context, source }
}

fn executor_error(reason: String) -> GioError {
    GioError::Executor { executor: NAME, reason }
}

/// Registers `host..+len` (kept mapped by `owner`) unless a registered span already covers it;
/// returns its GPU address.
fn register(registrations: &mut Vec<HostRegistration>, owner: MemoryOwner, host: u64, len_bytes: u64) -> Result<u64, GioError> {
    let spans: Vec<_> = registrations.iter().map(HostRegistration::span).collect();
    match plan::lookup_span(&spans, host, len_bytes)? {
        SpanLookup::Registered { device_address } => Ok(device_address),
        SpanLookup::New { host_start, len_bytes } => {
            let registration = HostRegistration::register(owner, host_start, len_bytes)?;
            let address = registration.span().device_start + (host - host_start);
            registrations.push(registration);
            Ok(address)
        }
    }
}

fn registration_for(registrations: &[HostRegistration], host: u64, len_bytes: u64) -> Option<&HostRegistration> {
    registrations.iter().find(|registration| {
        let span = registration.span();
        host >= span.host_start && host.checked_add(len_bytes).is_some_and(|end| end <= span.host_start + span.len_bytes)
    })
}

impl GpuExecutor {
    /// Builds the executor over `queues` (gio device index = position). In staged mode
    /// `config.staging` must name the staging buffers; in p2p mode it must be empty and every
    /// data IOVA must already address GPU memory the platform exposes to the SSD (see
    /// [`DmaMode::P2p`]). Nothing falls back from one mode to the other.
    pub fn new(runtime: GpuRuntime, queues: Vec<GpuQueueSpec>, config: GpuExecutorConfig) -> Result<Self, GioError> {
        let _current = runtime.enter()?;
        if queues.is_empty() || queues.len() > usize::from(u16::MAX) {
            return Err(GioError::InvalidConfig { reason: format!("{} queue pairs; 1..=65535 are possible", queues.len()) });
        }
        plan::check_kernel_waits(config.poll_iterations_max, config.backoff_ns_max, config.drain_timeout)?;
        let dma_mode = runtime.report().dma_mode;
        match (dma_mode, config.staging.is_empty()) {
            (DmaMode::Staged, true) => {
                return Err(GioError::InvalidConfig { reason: "staged DMA mode needs at least one staging buffer".into() });
            }
            (DmaMode::P2p, false) => {
                return Err(GioError::InvalidConfig { reason: "p2p DMA mode takes no staging buffers".into() });
            }
            _ => {}
        }
        let limits = GridLimits {
            threads_per_block: config.threads_per_block,
            blocks_per_sm: driver::occupancy_blocks_per_sm(runtime.function(), config.threads_per_block)?,
            domain_sm_count: runtime.io_sm_count(),
        };
        limits.validate()?;
        let mut registrations = Vec::new();
        let mut staging = Vec::with_capacity(config.staging.len());
        for buffer in &config.staging {
            let host = buffer.host.host_address() as u64;
            let len_bytes = buffer.host.len() as u64;
            register(&mut registrations, MemoryOwner::Dma(buffer.host.clone()), host, len_bytes)?;
            staging.push(StagingPair { iova: buffer.host.iova(), host_address: host, gpu_address: buffer.gpu_address, len_bytes });
        }
        let mut device_queues = Vec::with_capacity(queues.len());
        let mut addresses = Vec::with_capacity(queues.len());
        for (index, spec) in queues.into_iter().enumerate() {
            let context = |what: &str| format!("gio device {index}: {what}");
            let dma = spec.controller.dma();
            let depth = spec.depth as usize;
            let submission = dma
                .allocate(depth * SUBMISSION_ENTRY_BYTES)
                .map_err(|source| GioError::Nvme { context: context("submission ring"), source: source.into() })?;
            let completion = dma
                .allocate(depth * COMPLETION_ENTRY_BYTES)
                .map_err(|source| GioError::Nvme { context: context("completion ring"), source: source.into() })?;
            let sq_gpu = register(
                &mut registrations,
                MemoryOwner::Dma(submission.clone()),
                submission.host_address() as u64,
                submission.len() as u64,
            )?;
            let cq_gpu = register(
                &mut registrations,
                MemoryOwner::Dma(completion.clone()),
                completion.host_address() as u64,
                completion.len() as u64,
            )?;
            let bar = &spec.bar;
            let bar_gpu = register(&mut registrations, MemoryOwner::Bar(bar.clone()), bar.host_address() as u64, bar.len_bytes() as u64)?;
            let (rings, layout) = DetachedRings::create(spec.controller, submission, completion, spec.depth)
                .map_err(nvme_error(context("create detached queue pair")))?;
            addresses.push(plan::queue_pair_addresses(&layout, (sq_gpu, cq_gpu), bar_gpu, bar.len_bytes())?);
            device_queues.push(DeviceQueue { rings, rings_gpu: (sq_gpu, cq_gpu), bar_gpu, bar_len_bytes: bar.len_bytes() });
        }
        let depths: Vec<u32> = device_queues.iter().map(|queue| queue.rings.depth()).collect();
        let state_layout = StateLayout::new(&depths);
        let state = DeviceMemory::allocate(state_layout.total_bytes)?;
        let state_image = plan::state_image(&state_layout, &addresses, state.address());
        // On the I/O stream, so the first launch reads this state (see `reset_queue_pairs`).
        if let Err(error) = state.copy_from_host_on_stream(0, &state_image, runtime.stream(), config.drain_timeout) {
            // The copy may still be queued: its destination is not freed.
            let mut state = state;
            state.keep_for_good();
            return Err(error);
        }
        tracing::info!(
            queue_pairs = device_queues.len(),
            blocks_per_sm = limits.blocks_per_sm,
            io_sms = limits.domain_sm_count,
            "gio-uring CUDA executor ready (DMA mode {dma_mode}, {:?})",
            runtime.report().io_domain
        );
        Ok(Self {
            registrations,
            attached: None,
            dependency_events: Vec::new(),
            state,
            state_layout,
            state_image,
            queues: device_queues,
            staging,
            limits,
            config,
            reset_generation: 0,
            retired: false,
            teardown_waited: Duration::ZERO,
            runtime,
        })
    }

    pub fn runtime(&self) -> &GpuRuntime {
        &self.runtime
    }

    /// CQEs the kernel could not post into its completion sink (the sink stayed full past the
    /// kernel's bounded wait). Zero while the sink is sized to the queue depth, as it is; a rise
    /// is logged. The CQEs the caller sees are posted from the IOCBs' final lines either way.
    pub fn kernel_cqe_overflows(&self) -> u32 {
        self.attached.as_ref().map_or(0, |attached| attached.sink_overflows)
    }

    /// The kernel's own counters for gio device `device`'s NVMe queue pair, read back from GPU
    /// memory once the I/O stream is idle (bounded by `drain_timeout`), so no kernel is writing
    /// them. They restart at zero with each queue-pair reset. Non-zero anomaly counters mean the
    /// kernel saw completions it could not match (a stale or foreign command id) or that named
    /// another SQ.
    pub fn queue_pair_counters(&self, device: usize) -> Result<QueuePairCounters, GioError> {
        if device >= self.queues.len() {
            return Err(GioError::InvalidConfig { reason: format!("gio device {device}: {} queue pairs", self.queues.len()) });
        }
        let _current = self.runtime.enter()?;
        self.drain_stream()?;
        let mut bytes = [0u8; core::mem::size_of::<abi::gio_nvme_qp>()];
        // Synchronous, on the legacy default stream: the kernels that wrote the state have
        // completed (the I/O stream is idle), and a device-to-host copy into pageable memory
        // returns only once the bytes are here.
        self.state.copy_to_host(StateLayout::qp_offset(device), &mut bytes)?;
        Ok(QueuePairCounters::from_state(&bytes))
    }

    /// Queue-pair resets done after kernel timeouts.
    pub fn resets(&self) -> u64 {
        self.reset_generation
    }

    pub fn grid_limits(&self) -> GridLimits {
        self.limits
    }

    /// Registers the caller's event (e.g. recorded on its compute stream after the kernel that
    /// produces a layer's KV): issues of IOCBs with [`Dependency::Event`] of the returned token
    /// start only after its last record completed. Registered at set-up time, not per issue.
    pub fn register_caller_event(&mut self, event: CallerEvent) -> EventToken {
        self.dependency_events.push(DependencyEvent::Caller(event));
        EventToken(self.dependency_events.len() as u64 - 1)
    }

    /// Creates an event in the I/O context that issues can depend on, for producers that record
    /// it on a stream of that context ([`GpuExecutor::record_dependency_on_io_stream`]). A stream
    /// of another context needs [`GpuExecutor::register_caller_event`] with an event of its own
    /// context instead (cuEventRecord wants event and stream in one context).
    pub fn create_dependency_event(&mut self) -> Result<EventToken, GioError> {
        let _current = self.runtime.enter()?;
        self.dependency_events.push(DependencyEvent::Own(Event::create()?));
        Ok(EventToken(self.dependency_events.len() as u64 - 1))
    }

    /// Records `token`'s event (one this executor created) on the I/O stream.
    pub fn record_dependency_on_io_stream(&self, token: EventToken) -> Result<(), GioError> {
        let _current = self.runtime.enter()?;
        match self.dependency_event(token)? {
            DependencyEvent::Own(event) => event.record(self.runtime.stream()),
            DependencyEvent::Caller(_) => {
                Err(GioError::InvalidConfig { reason: format!("{token:?} is the caller's event; record it yourself") })
            }
        }
    }

    fn dependency_event(&self, token: EventToken) -> Result<&DependencyEvent, GioError> {
        usize::try_from(token.0).ok().and_then(|index| self.dependency_events.get(index)).ok_or(GioError::UnknownEvent { token })
    }

    /// Waits, polling with a deadline, until everything enqueued on the I/O stream has completed.
    fn drain_stream(&self) -> Result<(), GioError> {
        driver::drain_stream(self.runtime.stream(), self.config.drain_timeout)
    }

    /// Teardown's wait for the I/O stream: long enough for every launch still unretired to run
    /// to its deadline, at least `drain_timeout`, but at most [`plan::TEARDOWN_DRAIN_MAX`] (or
    /// `drain_timeout`) for the whole teardown: what an earlier teardown wait took (a
    /// `retire_queue_pairs` that gave up) is taken off ([`plan::teardown_drain_timeout`]). A
    /// shorter wait would give up on launches still queued behind a stalled device and keep the
    /// caller's memory (or the executor's) for good, though they end within their bounds; a
    /// longer one would block the caller for as many bounds as the queue is deep.
    fn drain_stream_for_teardown(&mut self) -> Result<(), GioError> {
        let unretired = self.attached.as_ref().map_or(0, |attached| attached.launches.len());
        let timeout = plan::teardown_drain_timeout(
            self.config.drain_timeout,
            unretired,
            self.config.poll_iterations_max,
            self.config.backoff_ns_max,
            self.teardown_waited,
        );
        let started = Instant::now();
        let drained = driver::drain_stream(self.runtime.stream(), timeout);
        self.teardown_waited = self.teardown_waited.saturating_add(started.elapsed());
        drained
    }

    /// Deletes and recreates every detached queue pair on its rings and rewrites the kernel state,
    /// once the stream has drained (no kernel may be using a queue pair while it is replaced).
    ///
    /// A pair whose deletion fails is kept and its rings are left alone
    /// ([`GioError::UndeletedQueuePair`]); the other pairs are still replaced. The state reaches
    /// the GPU, and the reset counts as done, only once every pair was replaced: until then the
    /// caller's launch stays unretired, so the next `poll` or `submit` calls this again, which
    /// retries the kept deletions and leaves the pairs already replaced for this reset alone.
    fn reset_queue_pairs(&mut self) -> Result<(), GioError> {
        self.drain_stream()?;
        let generation = self.reset_generation + 1;
        let mut failure = None;
        for (index, queue) in self.queues.iter_mut().enumerate() {
            match queue.rings.replace(index, generation) {
                Ok(layout) => {
                    let addresses = plan::queue_pair_addresses(&layout, queue.rings_gpu, queue.bar_gpu, queue.bar_len_bytes)?;
                    plan::write_queue_pair_state(&mut self.state_image, &self.state_layout, index, &addresses, self.state.address());
                }
                Err(error) => {
                    tracing::error!(device = index, %error, "gio-uring: the GPU's NVMe queue pair was not replaced; no kernel runs until it is");
                    failure.get_or_insert(error);
                }
            }
        }
        if let Some(error) = failure {
            return Err(error);
        }
        // Stream-ordered before the next launch, and waited for: the executor is idle here (the
        // stream drained above), so the wait is the copy's alone. A synchronous cuMemcpyHtoD
        // would run on the legacy default stream, which the non-blocking I/O stream does not
        // follow, and from pageable memory may return before the bytes land: the next kernel
        // could read the old tickets and counters. On error the reset is not counted; the
        // launch stays unretired and the next `poll` redoes it.
        self.state.copy_from_host_on_stream(0, &self.state_image, self.runtime.stream(), self.config.drain_timeout)?;
        self.reset_generation = generation;
        if let Some(attached) = self.attached.as_mut() {
            // The stream drained above: every request counted so far was made on the pairs just
            // replaced, so this reset answers all of them.
            attached.sink_reset_requests =
                attached.sink.load_u32(core::mem::offset_of!(gio_ring_header, reset_requests), Ordering::Acquire);
        }
        tracing::warn!(resets = self.reset_generation, "gio-uring: reset the GPU's NVMe queue pairs after a kernel timeout");
        Ok(())
    }

    /// Teardown's deletion of every detached pair (those kept by a failed deletion retried),
    /// once the stream has drained: a kernel still running could ring a deleted pair's doorbell.
    fn delete_queue_pairs(&mut self) -> Result<(), GioError> {
        self.drain_stream()?;
        crate::detached_rings::delete_all(self.queues.iter_mut().map(|queue| &mut queue.rings))
    }

    /// Enqueues everything for one issue, recording in `reached` how far it got (on error: what
    /// the stream may still run).
    fn enqueue(&mut self, memory: &QueueMemory, batch: &IssueBatch, event_index: usize, reached: &mut Reached) -> Result<(), GioError> {
        let attached = self.attached.as_ref().ok_or_else(|| executor_error("not attached to a queue".into()))?;
        let stream = self.runtime.stream();
        let staged = self.runtime.report().dma_mode == DmaMode::Staged;
        if let Dependency::Event(token) = batch.dependency {
            let event = self.dependency_event(token)?;
            driver::stream_wait_event(stream, event.raw())?;
        }
        let mut chunks = 0u64;
        for position in 0..batch.count {
            let id = sq_entry(memory, batch.sq_first.wrapping_add(position))?;
            let header = memory.read_issued_header(id)?;
            chunks += plan::chunks_of(header.ioctx_count);
            if staged && u32::from(header.opcode) == abi::GIO_OPCODE_WRITE {
                let shift = u64::from(header.layer) * header.mem_stride_bytes;
                // Set first: a copy may be queued before a later one of the same runs fails.
                reached.queued = true;
                self.copy_runs(&attached.runs[id.0 as usize], shift, CopyDirection::ToHost)?;
            }
        }
        let blocks = self.limits.blocks(batch.sm_budget, chunks);
        let addresses = LaunchAddresses {
            queue_base: attached.queue_gpu,
            cq_ring_base: attached.sink_gpu,
            nvme_qps: self.state.address(),
            device_count: self.queues.len() as u32,
        };
        let params = plan::launch_params(
            &memory.layout,
            &addresses,
            batch.sq_first,
            batch.count,
            self.config.poll_iterations_max,
            self.config.backoff_ns_max,
        );
        driver::launch_io_kernel(self.runtime.function(), stream, blocks, self.limits.threads_per_block, &params)?;
        *reached = Reached { queued: true, ran: true };
        if staged {
            for position in 0..batch.count {
                let id = sq_entry(memory, batch.sq_first.wrapping_add(position))?;
                let header = memory.read_issued_header(id)?;
                if u32::from(header.opcode) == abi::GIO_OPCODE_READ {
                    let shift = u64::from(header.layer) * header.mem_stride_bytes;
                    self.copy_runs(&attached.runs[id.0 as usize], shift, CopyDirection::ToGpu)?;
                }
            }
        }
        attached.events[event_index].record(stream)
    }

    fn copy_runs(&self, runs: &[CopyRun], shift: u64, direction: CopyDirection) -> Result<(), GioError> {
        for run in runs {
            let host = run.host_address + shift;
            let registration = registration_for(&self.registrations, host, run.len_bytes)
                .ok_or_else(|| executor_error(format!("staged copy {host:#x}+{} outside every staging buffer", run.len_bytes)))?;
            driver::copy_async(direction, registration, host, run.gpu_address + shift, run.len_bytes, self.runtime.stream())?;
        }
        Ok(())
    }

    /// Retires finished launches in order.
    fn retire(&mut self, memory: &QueueMemory) -> Result<(), GioError> {
        loop {
            let Some(attached) = self.attached.as_ref() else { return Ok(()) };
            let Some(&launch) = attached.launches.front() else { return Ok(()) };
            if let Some(event) = launch.event {
                if !attached.events[event].is_complete()? {
                    return Ok(());
                }
            }
            self.finish_launch(memory, launch)?;
            if let Some(attached) = self.attached.as_mut() {
                attached.launches.pop_front();
                if let Some(event) = launch.event {
                    attached.free_events.push(event);
                }
            }
        }
    }

    /// A launch whose kernel (and copies) completed: reset the queue pairs if it timed out, post
    /// one CQE per IOCB from the IOCB's final line, advance the SQ head, empty the sink.
    fn finish_launch(&mut self, memory: &QueueMemory, launch: Launch) -> Result<(), GioError> {
        let enqueued = launch.enqueued();
        if enqueued == retire::Enqueued::Partly {
            // `submit` waited for what reached the stream when the enqueue failed, but that
            // wait may have run out: nothing of it is retired (no status read, no CQE) until
            // the kernel and the copies that did enqueue have finished. An error leaves it unretired, and
            // the next `poll` waits again.
            self.drain_stream()?;
        }
        // Read after the launch's event (or the drain): the kernels that counted into it are done.
        // A request counted by a later launch still running is seen here too; the reset then
        // drains the stream first, so it covers that launch as well.
        let kernel_requested_reset = self.attached.as_ref().is_some_and(|attached| {
            attached.sink.load_u32(core::mem::offset_of!(gio_ring_header, reset_requests), Ordering::Acquire)
                != attached.sink_reset_requests
        });
        let mut settled = launch.settled;
        let settling = retire::settle_once(memory, launch.sq_first, launch.count, enqueued, kernel_requested_reset, &mut settled);
        if let Some(front) = self.attached.as_mut().and_then(|attached| attached.launches.front_mut()) {
            front.settled = settled; // `retire` passes the front launch; kept for a retry
        }
        let timed_out = settling?;
        // Launches enqueued before the last reset ran on the queue pairs it replaced.
        if timed_out && launch.reached.ran && launch.reset_generation == self.reset_generation {
            if self.retired {
                // After teardown the pairs are deleted, never recreated (no kernel will use
                // them); the CQEs wait, as for a reset, until every one is known deleted.
                self.delete_queue_pairs()?;
            } else {
                self.reset_queue_pairs()?;
            }
        }
        let mut posted = launch.posted;
        let posting = retire::post_completions(memory, launch.sq_first, launch.count, &mut posted);
        if let Some(front) = self.attached.as_mut().and_then(|attached| attached.launches.front_mut()) {
            front.posted = posted; // `retire` passes the front launch; kept for a retry
        }
        posting?;
        retire::advance_sq(memory, launch.sq_first, launch.count)?;
        if let Some(attached) = self.attached.as_mut() {
            // The sink's entries are never read: empty it so the kernel never finds it full.
            let sink = &attached.sink;
            let tail = sink.load_u32(attached.sink_layout.tail_offset(), Ordering::Acquire);
            sink.store_u32(attached.sink_layout.head_offset(), tail, Ordering::Release);
            let overflows = sink.load_u32(core::mem::offset_of!(gio_ring_header, overflow_count), Ordering::Acquire);
            if overflows != attached.sink_overflows {
                tracing::error!(
                    overflows,
                    "gio-uring: the I/O kernel could not post CQEs into its sink (full past its wait); the IOCBs' final statuses are used"
                );
                attached.sink_overflows = overflows;
            }
        }
        Ok(())
    }
}

impl Executor for GpuExecutor {
    fn name(&self) -> &'static str {
        NAME
    }

    /// One queue pair per device of the table, same index: fewer is refused. The kernel would
    /// fail every IOCTX on a device without one as INVALID_IOCTX at each issue
    /// (`device_index >= device_count`), blaming the request for a configuration error.
    fn check_device_count(&self, devices: usize) -> Result<(), GioError> {
        if self.queues.len() < devices {
            return Err(GioError::InvalidConfig {
                reason: format!(
                    "the device table has {devices} devices but the CUDA executor has queue pairs for {} (one per device, same index)",
                    self.queues.len()
                ),
            });
        }
        Ok(())
    }

    fn attach(&mut self, memory: &Arc<QueueMemory>) -> Result<(), GioError> {
        if self.attached.is_some() {
            return Err(GioError::InvalidConfig { reason: "the CUDA executor serves one queue".into() });
        }
        let _current = self.runtime.enter()?;
        let region = &memory.region;
        let queue_gpu =
            register(&mut self.registrations, MemoryOwner::Queue(Arc::clone(memory)), region.host_address(), region.len_bytes() as u64)?;
        let depth = memory.layout.config.depth;
        let header_bytes = core::mem::size_of::<gio_ring_header>();
        let sink_bytes =
            (header_bytes + depth as usize * core::mem::size_of::<abi::gio_cqe>()).div_ceil(REGION_ALIGN_BYTES) * REGION_ALIGN_BYTES;
        let sink = Arc::new(SharedRegion::allocate_host(sink_bytes)?);
        let sink_layout = RingLayout { header_offset_bytes: 0, entries_offset_bytes: header_bytes, depth };
        sink.store_u32(core::mem::offset_of!(gio_ring_header, mask), depth - 1, Ordering::Relaxed);
        sink.store_u32(core::mem::offset_of!(gio_ring_header, entry_count), depth, Ordering::Relaxed);
        let sink_gpu = register(&mut self.registrations, MemoryOwner::Shared(Arc::clone(&sink)), sink.host_address(), sink_bytes as u64)?;
        // One event per IOCB: every launch in flight holds at least one SQ entry.
        let events = (0..depth).map(|_| Event::create()).collect::<Result<Vec<_>, _>>()?;
        self.attached = Some(Attached {
            memory: Arc::clone(memory),
            queue_gpu,
            sink,
            sink_layout,
            sink_gpu,
            events,
            free_events: (0..depth as usize).rev().collect(),
            launches: VecDeque::with_capacity(depth as usize),
            runs: vec![Vec::new(); depth as usize],
            sink_overflows: 0,
            sink_reset_requests: 0,
        });
        Ok(())
    }

    fn check_dependency(&self, dependency: &Dependency) -> Result<(), GioError> {
        match dependency {
            Dependency::None => Ok(()),
            Dependency::Event(token) => self.dependency_event(*token).map(|_| ()),
        }
    }

    fn prepared(&mut self, memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
        if self.runtime.report().dma_mode != DmaMode::Staged {
            return Ok(());
        }
        let Some(attached) = self.attached.as_mut() else {
            return Err(executor_error("not attached to a queue".into()));
        };
        let header = memory.read_issued_header(id)?;
        let ioctxs = (0..header.ioctx_count).map(|index| {
            let ioctx = memory.read_ioctx(header.ioctx_first + index);
            StagedIoctx {
                data_iova: ioctx.data_iova,
                data_bytes: ioctx.data_bytes,
                desc_iova: ioctx.desc_iova,
                descriptor_kind: ioctx.descriptor_kind,
            }
        });
        plan::plan_staged_copies(
            ioctxs,
            header.layer_count,
            header.mem_stride_bytes,
            header.desc_stride_bytes,
            &self.staging,
            &mut attached.runs[id.0 as usize],
        )
        .map_err(|(index, fault)| GioError::InvalidIoctx { id, index, fault })
    }

    fn submit(&mut self, memory: &QueueMemory, batch: &IssueBatch) -> Result<(), GioError> {
        // The I/O context stays current for the whole call (popped when `_current` drops).
        let (_current, retired) = match self.runtime.enter() {
            Ok(current) => {
                let retired = self.retire(memory);
                (Some(current), retired)
            }
            Err(error) => (None, Err(error)),
        };
        if let Err(error) = retired {
            // The batch is on the SQ already: recorded as a launch that never ran, its IOCBs
            // still complete exactly once, in SQ order (as timed out), once the launches ahead
            // of it retire (e.g. after a reset that failed here succeeds).
            let launch = Launch::new(batch, None, Reached::default(), self.reset_generation);
            if let Some(attached) = self.attached.as_mut() {
                attached.launches.push_back(launch);
            }
            return Err(error);
        }
        if self.retired {
            // No queue pair is left to run it: recorded as a launch that never ran, and retired
            // at once if the launches ahead of it are, so each IOCB ends as TIMEOUT with its CQE.
            let launch = Launch::new(batch, None, Reached::default(), self.reset_generation);
            if let Some(attached) = self.attached.as_mut() {
                attached.launches.push_back(launch);
            }
            if let Err(error) = self.retire(memory) {
                tracing::warn!(%error, "gio-uring CUDA executor: an issue after teardown could not end yet; the next poll retries");
            }
            return Err(GioError::QueuePairsRetired { executor: NAME });
        }
        let attached = self.attached.as_mut().ok_or_else(|| executor_error("not attached to a queue".into()))?;
        let event_index = attached
            .free_events
            .pop()
            .ok_or_else(|| executor_error(format!("{} launches in flight, no event left", attached.launches.len())))?;
        let reset_generation = self.reset_generation;
        let mut reached = Reached::default();
        let (launch, result) = match self.enqueue(memory, batch, event_index, &mut reached) {
            Ok(()) => (Launch::new(batch, Some(event_index), reached, reset_generation), Ok(())),
            Err(error) => {
                // The batch's IOCBs must still complete exactly once, in SQ order: the launch is
                // recorded without an event and every IOCB of it is retired as timed out, even
                // one the kernel finished as SUCCESS (a copy meant to follow the kernel may be
                // missing; see `Launch::enqueued`). Whatever did reach the stream (a kernel,
                // which reads the SQ entries until it exits, or a staged copy, which reads or
                // writes the caller's memory) is waited for first (bounded, and again at
                // retirement), so no CQE goes out while it may still run.
                if let Some(attached) = self.attached.as_mut() {
                    attached.free_events.push(event_index);
                }
                let drained = if reached.queued { self.drain_stream() } else { Ok(()) };
                let error = match drained {
                    Ok(()) => error,
                    Err(drain_error) => executor_error(format!("{error}; then {drain_error}")),
                };
                (Launch::new(batch, None, reached, reset_generation), Err(error))
            }
        };
        if let Some(attached) = self.attached.as_mut() {
            attached.launches.push_back(launch);
        }
        result
    }

    fn poll(&mut self, memory: &QueueMemory) -> Result<(), GioError> {
        let _current = self.runtime.enter()?;
        self.retire(memory)
    }

    /// Stops launching, waits for the stream to drain, blocking the calling thread (bounded:
    /// every unretired launch's [`plan::kernel_time_bound`], at least `drain_timeout`, at most
    /// [`plan::TEARDOWN_DRAIN_MAX`] or `drain_timeout` for this and the drop together;
    /// [`plan::teardown_drain_timeout`]: 192 s at 64 launches with the defaults, 5 min from 100),
    /// then deletes every detached pair (see the module documentation). That cap is on the stream
    /// waits only: the deletions add up to two admin timeouts per pair (Delete SQ, Delete CQ; the
    /// controller's `admin_timeout`, 10 s by default, plus the wait for the admin queue's lock),
    /// and the drop tries those that failed again. More than 100 launches queued behind a stalled
    /// device (a store of up to 1024 IOCBs can have that many) outlast the cap though each would
    /// end within its bound: `Some(false)`, and the memory is kept for good. `Some(false)` while a
    /// kernel or copy may still run (the context cannot be made current, or the stream did not
    /// drain: nothing is deleted then, since a kernel may still ring the pairs' doorbells) or a
    /// pair could not be deleted; a later call retries both (waiting only what is left of the
    /// bound). With `Some(true)` the launches still unretired are retired: each IOCB gets its
    /// CQE, one the kernel left ISSUED ending as TIMEOUT.
    fn retire_queue_pairs(&mut self) -> Option<bool> {
        self.retired = true;
        let _current = match self.runtime.enter() {
            Ok(current) => current,
            Err(error) => {
                tracing::error!(%error, "gio-uring CUDA executor teardown: cannot wait for the I/O stream; its queue pairs are kept");
                return Some(false);
            }
        };
        // The longer teardown wait first; delete_queue_pairs's own drain then returns at once.
        if let Err(error) = self.drain_stream_for_teardown().and_then(|()| self.delete_queue_pairs()) {
            tracing::error!(%error, "gio-uring CUDA executor teardown: a kernel may still run or a queue pair is undeleted");
            return Some(false);
        }
        // The stream drained, so every launch's event has completed and retirement does not
        // wait; with the pairs deleted no command of theirs completes any more either.
        if let Some(memory) = self.attached.as_ref().map(|attached| Arc::clone(&attached.memory)) {
            if let Err(error) = self.retire(&memory) {
                tracing::warn!(%error, "gio-uring CUDA executor teardown: launches left unretired; the next poll retries");
            }
        }
        Some(true)
    }
}

/// CUDA executors whose teardown could not wait for the GPU and kept their memory for good.
static TEARDOWNS_LEAKED: AtomicU64 = AtomicU64::new(0);

/// How many CUDA executors so far in this process were dropped while the I/O stream would not
/// drain, and so kept (leaked) their GPU state, host registrations, queue pairs and context.
pub fn teardowns_leaked() -> u64 {
    TEARDOWNS_LEAKED.load(Ordering::Relaxed)
}

impl GpuExecutor {
    /// Teardown when the stream did not drain: a kernel or staged copy may still read or write
    /// the registered host memory (gio queue, sink, staging, NVMe rings), the kernel state in
    /// GPU memory and the detached queue pairs, and use the module and the contexts. None of
    /// it is unregistered, freed, deleted or released: it stays until the process ends.
    fn keep_for_good(&mut self, why: &GioError) {
        let registrations = std::mem::take(&mut self.registrations);
        let registered = registrations.len();
        std::mem::forget(registrations);
        std::mem::forget(self.attached.take());
        std::mem::forget(std::mem::take(&mut self.dependency_events));
        let queue_pairs = std::mem::take(&mut self.queues);
        let queue_pair_count = queue_pairs.len();
        std::mem::forget(queue_pairs);
        self.state.keep_for_good();
        self.runtime.keep_for_good();
        TEARDOWNS_LEAKED.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            %why,
            registered,
            queue_pairs = queue_pair_count,
            state_bytes = self.state.len_bytes(),
            "gio-uring CUDA executor teardown: the I/O stream did not drain, so a kernel or copy may still use its memory; its host \
             registrations, GPU state, detached NVMe queue pairs, events and contexts are kept for good (leaked)"
        );
    }
}

/// Blocks the dropping thread until the I/O stream drains, for what is left of teardown's
/// bound ([`plan::teardown_drain_timeout`]: at most [`plan::TEARDOWN_DRAIN_MAX`], or
/// `drain_timeout` if longer, counted together with `retire_queue_pairs`'s wait); then releases
/// everything, or keeps it for good if the stream did not drain. Releasing the queues (their
/// field drop) deletes the pairs still undeleted: outside that cap, up to two admin timeouts
/// per pair, each possibly after as long a wait for the admin queue's lock.
impl Drop for GpuExecutor {
    fn drop(&mut self) {
        // Host memory may only be unregistered (and then freed), GPU memory freed and queue pairs
        // deleted once no kernel or copy uses them.
        let current = match self.runtime.enter() {
            Ok(current) => current,
            Err(error) => return self.keep_for_good(&error),
        };
        if let Err(error) = self.drain_stream_for_teardown() {
            return self.keep_for_good(&error);
        }
        // What needs the I/O context to be released goes now, in field order, while it is
        // current on this thread (it is popped below; the fields would drop after that).
        drop(std::mem::take(&mut self.registrations));
        drop(self.attached.take());
        drop(std::mem::take(&mut self.dependency_events));
        drop(std::mem::replace(&mut self.state, DeviceMemory::released()));
        drop(current);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{LayerIndex, SmBudget};

    #[test]
    fn a_launch_whose_enqueue_failed_after_copies_were_queued_is_drained_before_it_retires() {
        // Goal: a launch whose enqueue failed is retired without waiting only if nothing that
        // uses the caller's memory reached the stream. GPU-to-host copies of writes queued
        // before a failure that kept the kernel from launching may still read the caller's GPU
        // memory: that launch is Partly (drained before retirement, no SUCCESS served), not
        // Fully (retired at once, its TIMEOUT CQEs telling the caller it may reuse the memory).
        let batch = IssueBatch { sq_first: 0, count: 1, layer: LayerIndex(0), sm_budget: SmBudget(1), dependency: Dependency::None };
        let failed = |queued, ran| Launch::new(&batch, None, Reached { queued, ran }, 0);
        assert_eq!(failed(true, false).enqueued(), retire::Enqueued::Partly, "copies queued, the kernel not launched");
        assert_eq!(failed(true, true).enqueued(), retire::Enqueued::Partly, "the kernel launched, a later step failed");
        assert_eq!(failed(false, false).enqueued(), retire::Enqueued::Fully, "nothing reached the stream");
        let whole = Launch::new(&batch, Some(0), Reached { queued: true, ran: true }, 0);
        assert_eq!(whole.enqueued(), retire::Enqueued::Fully);
        assert_eq!(whole.posted, 0);
    }
}
