//! A small stack for the runtime's tests: the software controller (optionally with its SSD
//! timing model), a one-device pool, a paged engine KV memory, and a hand-made profile table
//! whose numbers make the policy's decisions easy to follow.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::layout::QueueMemory;
use gio_uring::{Executor, GioError, IocbId, IssueBatch};
use nvme_driver::hw::DeviceBackend;
use nvme_driver::spec::NvmOpcode;
use nvme_driver::{Controller, ControllerConfig, DataPointerMode, DmaRegion, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice, FaultAction, FaultPlan, FaultRule, TimingModel};
use objstore::{
    cpu_executor_for, format_pool, FormatParams, KvLayout, KvRegistration, KvStore, ModelGeometry, Pool, PoolTarget, StoreConfig,
};
use scheduler::table::{
    Bucket, DecodeStep, GpuIdentity, IoCostEntry, IoKind, LayerProfile, ModelIdentity, Profile, ProfileTable, SlackWindow,
    PROFILE_FORMAT_VERSION,
};
use tutti_runtime::{PolicyChoice, Runtime, RuntimeConfig, RuntimeError};

pub const BLOCK_TOKENS: u32 = 16;
pub const ENGINE_BLOCKS: u32 = 64;
pub const MODEL: &str = "tiny-4-layer";
/// 4 layers, 1 KV head of dim 128, bf16: one object (K or V of a block in a layer) is 4 KiB.
pub fn geometry() -> ModelGeometry {
    ModelGeometry { layers: 4, kv_heads: 1, head_dim: 128, dtype_bytes: 2, block_tokens: BLOCK_TOKENS }
}

pub fn gpu() -> GpuIdentity {
    GpuIdentity { name: "test-gpu".into(), sm_count: 8 }
}

/// One IOCB of the table moves one block's K and V of one layer (8 KiB).
pub const IOCB_BYTES: u64 = 8192;

/// Every layer: 1000 µs, attention at 300 µs, one window [0, 900) with 4 free SMs. Reads cost
/// 20 µs per IOCB, writes 40 µs (4 SMs). Decode steps: 2000 µs, 4 free SMs.
pub fn table(model: &str, layers: u32) -> ProfileTable {
    let (step, count) = (16u32, 16u32);
    let layer = LayerProfile {
        compute_duration_us: 1000.0,
        kv_needed_offset_us: 300.0,
        slack_windows: vec![SlackWindow { offset_us: 0.0, duration_us: 900.0, free_sms: 4 }],
    };
    let mut buckets = Vec::new();
    for k in 1..=count {
        for j in 0..=k {
            buckets.push(Bucket { input_tokens: k * step, prefix_tokens: j * step, layers: vec![layer.clone(); layers as usize] });
        }
    }
    let mut io_costs = Vec::new();
    for (kind, per_iocb_us) in [(IoKind::Read, 20.0), (IoKind::Write, 40.0)] {
        for n in [1u32, 2, 4, 8, 16, 32, 64] {
            io_costs.push(IoCostEntry {
                kind,
                iocb_count: n,
                sm_budget: 4,
                duration_us: per_iocb_us * f64::from(n),
                bytes: u64::from(n) * IOCB_BYTES,
            });
        }
    }
    ProfileTable {
        format_version: PROFILE_FORMAT_VERSION,
        model: ModelIdentity { name: model.into(), layer_count: layers, kv_bytes_per_token_per_layer: 2 * 4096 / u64::from(BLOCK_TOKENS) },
        gpu: gpu(),
        compute_source: "hand-made for tests".into(),
        io_cost_source: "hand-made for tests".into(),
        input_step_tokens: step,
        input_step_count: count,
        prefix_step_tokens: step,
        buckets,
        io_costs,
        decode_steps: vec![
            DecodeStep { context_tokens: 16, duration_us: 2000.0, free_sms: 4 },
            // Below the contexts the table vouches requests reach (twice its largest prompt, 512):
            // a table whose last row alone can write is refused unless contexts past it are.
            DecodeStep { context_tokens: 511, duration_us: 2000.0, free_sms: 4 },
        ],
    }
}

pub fn profile() -> Profile {
    Profile::from_table(table(MODEL, geometry().layers)).expect("hand-made table is valid")
}

/// An SSD about as fast as the table says (a 4-block layer: 128 µs to read, 256 µs to write),
/// 40% of each under mixed traffic, 20 µs per command.
pub fn slow_ssd() -> TimingModel {
    TimingModel {
        read_bytes_per_s: 256_000_000,
        write_bytes_per_s: 128_000_000,
        mixed_share_permille: 400,
        command_latency: Duration::from_micros(20),
    }
}

pub struct Stack<E: gio_uring::Executor = gio_uring::CpuExecutor> {
    pub device: Arc<EmuDevice>,
    pub runtime: Runtime<E>,
    pub engine: Engine,
}

/// The engine's paged KV memory: one tensor per (layer, K/V).
pub struct Engine {
    pub tensors: Vec<DmaRegion>,
}

/// The byte standing for block `block` of `tokens` at (layer, K/V): a function of the prefix.
pub fn kv_byte(tokens: &[u32], block: u32, layer: u32, value: bool) -> u8 {
    let end = ((block + 1) * BLOCK_TOKENS) as usize;
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for &token in &tokens[..end] {
        hash = (hash ^ u64::from(token)).wrapping_mul(0x100_0000_01b3);
    }
    (hash ^ u64::from(layer) << 1 ^ u64::from(value)).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes()[7]
}

impl Engine {
    const OBJECT_BYTES: usize = 4096;

    fn tensor(&self, layer: u32, value: bool) -> &DmaRegion {
        &self.tensors[(2 * layer + u32::from(value)) as usize]
    }

    /// "Computes" layer `layer` of blocks `blocks` of `tokens` into `engine_blocks`.
    pub fn compute_layer(&self, tokens: &[u32], blocks: std::ops::Range<u32>, engine_blocks: &[u32], layer: u32) {
        for block in blocks {
            for value in [false, true] {
                let byte = kv_byte(tokens, block, layer, value);
                let offset = engine_blocks[block as usize] as usize * Self::OBJECT_BYTES;
                self.tensor(layer, value).fill(offset, Self::OBJECT_BYTES, byte).expect("fill engine memory");
            }
        }
    }

    /// Overwrites engine block `engine_block` in every layer (the engine reusing it).
    pub fn scribble(&self, engine_block: u32, layers: u32) {
        for layer in 0..layers {
            for value in [false, true] {
                self.tensor(layer, value).fill(engine_block as usize * Self::OBJECT_BYTES, Self::OBJECT_BYTES, 0xEE).expect("fill");
            }
        }
    }

    /// Whether every byte of every object of blocks `blocks` in `engine_blocks` is right.
    pub fn holds(&self, tokens: &[u32], blocks: std::ops::Range<u32>, engine_blocks: &[u32], layers: u32) -> bool {
        let mut buffer = vec![0u8; Self::OBJECT_BYTES];
        for block in blocks {
            for layer in 0..layers {
                for value in [false, true] {
                    let expected = kv_byte(tokens, block, layer, value);
                    let offset = engine_blocks[block as usize] as usize * Self::OBJECT_BYTES;
                    self.tensor(layer, value).read(offset, &mut buffer).expect("read engine memory");
                    if buffer.iter().any(|&byte| byte != expected) {
                        return false;
                    }
                }
            }
        }
        true
    }
}

/// The device, a store over it and the engine memory registered with it.
pub fn parts(timing: Option<TimingModel>) -> (Arc<EmuDevice>, KvStore<gio_uring::CpuExecutor>, Engine) {
    parts_with(timing, |pool, config| cpu_executor_for(pool, 256, config).expect("executor"))
}

/// The same, with the executor `executor` builds over the open pool.
pub fn parts_with<E: gio_uring::Executor>(
    timing: Option<TimingModel>,
    executor: impl FnOnce(&Pool, &StoreConfig) -> E,
) -> (Arc<EmuDevice>, KvStore<E>, Engine) {
    parts_configured(timing, StoreConfig::default(), executor)
}

/// The same, with the store configured by `store_config`.
pub fn parts_configured<E: gio_uring::Executor>(
    timing: Option<TimingModel>,
    store_config: StoreConfig,
    executor: impl FnOnce(&Pool, &StoreConfig) -> E,
) -> (Arc<EmuDevice>, KvStore<E>, Engine) {
    let geometry = geometry();
    let device =
        EmuDevice::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 64 << 20 }).with_timing(timing)).expect("emulator");
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("controller"));
    let targets = vec![PoolTarget { controller: Arc::clone(&controller), namespace: NamespaceId(1) }];
    format_pool(&targets, &FormatParams::new(geometry)).expect("format");
    let (pool, _) = Pool::open(targets, Some(&geometry)).expect("open pool");
    let tensors: Vec<DmaRegion> =
        (0..2 * geometry.layers).map(|_| controller.dma().allocate(4096 * ENGINE_BLOCKS as usize).expect("allocate")).collect();
    let layout = KvLayout::SeparateKv {
        key_bases: tensors.iter().step_by(2).map(DmaRegion::iova).collect(),
        value_bases: tensors.iter().skip(1).step_by(2).map(DmaRegion::iova).collect(),
        block_stride_bytes: geometry.object_bytes(),
    };
    let registration = KvRegistration::new(geometry, ENGINE_BLOCKS, layout, DataPointerMode::Sgl).expect("registration");
    let executor = executor(&pool, &store_config);
    let store = KvStore::new(pool, registration, Arc::clone(controller.dma()), executor, store_config).expect("store");
    (device, store, Engine { tensors })
}

pub fn stack(config: RuntimeConfig, timing: Option<TimingModel>) -> Stack {
    stack_with_profile(config, timing, profile())
}

/// The same stack, with another table (of the same model and GPU).
pub fn stack_with_profile(config: RuntimeConfig, timing: Option<TimingModel>, profile: Profile) -> Stack {
    let (device, store, engine) = parts(timing);
    let runtime = Runtime::new(store, profile, config).expect("runtime");
    Stack { device, runtime, engine }
}

pub fn config(policy: PolicyChoice) -> RuntimeConfig {
    let mut config = RuntimeConfig::new(MODEL, gpu());
    config.policy = policy;
    config.event_log_capacity = 4096;
    config.io_timeout = Duration::from_secs(20);
    config
}

/// The prompt of `session` at `turn`: a shared 2-block system prompt, then 2 blocks per turn.
pub fn prompt(session: u32, turn: u32) -> Vec<u32> {
    let mut tokens: Vec<u32> = (0..2 * BLOCK_TOKENS).collect();
    for past in 0..=turn {
        tokens.extend((0..2 * BLOCK_TOKENS).map(|index| 1_000_000 * (session + 1) + 10_000 * past + index));
    }
    tokens
}

/// The table's compute time of one layer.
pub const LAYER_COMPUTE_US: u64 = 1000;

/// Busy-waits `duration`: a stand-in for the GPU running a layer.
pub fn compute_for(duration: Duration) {
    let started = std::time::Instant::now();
    while started.elapsed() < duration {
        std::hint::spin_loop();
    }
}

/// Runs one request's prefill through the runtime, computing the uncached blocks' KV into
/// engine memory layer by layer. Returns the cached block count.
pub fn prefill<E: gio_uring::Executor>(
    stack: &mut Stack<E>,
    tokens: &[u32],
    engine_blocks: &[u32],
) -> Result<usize, tutti_runtime::RuntimeError> {
    let layers = geometry().layers;
    let blocks = engine_blocks.len() as u32;
    let start = stack.runtime.begin_prefill(&objstore::KvRequest { tokens, block_ids: engine_blocks })?;
    for layer in 0..layers {
        stack.runtime.before_layer(start.id, layer)?;
        compute_for(Duration::from_micros(LAYER_COMPUTE_US));
        stack.engine.compute_layer(tokens, start.cached_blocks as u32..blocks, engine_blocks, layer);
        stack.runtime.after_layer(start.id, layer)?;
    }
    stack.runtime.end_prefill(start.id)?;
    Ok(start.cached_blocks)
}

/// The table's decode step time.
pub const DECODE_STEP_US: u64 = 2000;

/// One decode step: the runtime's boundary, then the step's compute.
pub fn decode<E: gio_uring::Executor>(stack: &mut Stack<E>, context_tokens: u32) -> Result<(), tutti_runtime::RuntimeError> {
    stack.runtime.decode_step(context_tokens)?;
    compute_for(Duration::from_micros(DECODE_STEP_US));
    Ok(())
}

// Shared by the stall tests (tests/stalls.rs, tests/executor_errors.rs): their bounds, a
// read retired by a lost completion, and an executor that fails as a test arms it.

/// The stalled stacks' `io_timeout`: what a lost completion costs. The emulated device is a
/// thread of the test process, so a pause of the whole process (a loaded CI machine's CPU
/// quota, other builds on 2 cores) stops it as well as the waiting caller, and a wait whose
/// deadline passed during the pause times out on its first poll, the device thread not having
/// run since: a healthy layer then fails as a lost one would. At 200 ms that happened under
/// load (a setup's drain, `DrainIncomplete`); a second is past such pauses, while a test's
/// lost completions still fit `TEST_LIMIT` many times over. Drains of healthy writes go
/// through [`drain_healthy`] / [`drain_writes`] as well, which call `drain` again.
pub const IO_TIMEOUT: Duration = Duration::from_secs(1);

/// Bound on a whole test here: its I/O waits add up to a few `IO_TIMEOUT`s and one late
/// completion; a call that hangs fails the test instead of stalling the suite.
pub const TEST_LIMIT: Duration = Duration::from_secs(30);

/// Calls of `drain` [`drain_writes`] makes at most.
pub const DRAIN_TRIES: usize = 8;

/// `drain`, called again (as its docs allow: the layer whose wait timed out stays in flight and
/// its store queued, and the next call collects it) while it leaves stores queued, up to
/// [`DRAIN_TRIES`] calls: a healthy write's wait can time out when the whole test process was
/// paused past `io_timeout` (see [`IO_TIMEOUT`]). A write the device really lost is still
/// queued after the last call, and that answer is returned; so is any other error at once, and
/// the retiring requests' count as the last call left it.
pub fn drain_writes<E: Executor>(runtime: &mut Runtime<E>) -> Result<(), RuntimeError> {
    let mut drained = runtime.drain();
    for _ in 1..DRAIN_TRIES {
        match drained {
            Err(RuntimeError::DrainIncomplete { queued_stores, .. }) if queued_stores > 0 => drained = runtime.drain(),
            _ => break,
        }
    }
    drained
}

/// Drains a stack whose queued writes are all healthy and nothing retiring: fails the test
/// unless [`drain_writes`] ends `Ok`.
#[track_caller]
pub fn drain_healthy<E: Executor>(runtime: &mut Runtime<E>) {
    if let Err(error) = drain_writes(runtime) {
        panic!("draining healthy writes: {error}");
    }
}

/// Runs `test` on a thread of its own (the runtime is not `Send`, so all of it), passing on its
/// panic; fails if it has not ended within `TEST_LIMIT` (the thread is left behind).
pub fn bounded(test: impl FnOnce() + Send + 'static) {
    let (sender, receiver) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        test();
        let _ = sender.send(());
    });
    match receiver.recv_timeout(TEST_LIMIT) {
        Ok(()) => {}
        Err(RecvTimeoutError::Disconnected) => {
            if let Err(panic) = thread.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(RecvTimeoutError::Timeout) => panic!("the test did not end within {TEST_LIMIT:?}: a runtime call hangs"),
    }
}

/// What a test arms in a [`Rigged`] executor (shared with it).
#[derive(Clone, Default)]
pub struct Rigging {
    /// Armed: the next `submit` takes the batch and then fails: as a GPU executor whose launch
    /// call errs after the kernel was queued, or a CPU executor that meets a retired queue
    /// pair part way through. The IOCBs still run and complete (`GioError::SubmitFailed`).
    pub submit_fails: Arc<AtomicBool>,
    /// Armed with n > 0: the n-th `submit` from now fails as an armed `submit_fails` makes the
    /// next one fail (for a failure past the first issue of a call).
    pub submit_fails_at: Arc<AtomicU32>,
    /// Armed: the next `poll` polls and then fails: an executor-level error reported once (as
    /// gio-uring reports a stopped worker or a lasting doorbell fault).
    pub poll_fails: Arc<AtomicBool>,
    /// Armed: the next `submit` arms `poll_fails`, so that the first poll after it fails (the
    /// one that starts what a call handed over, past the polls the call made before it).
    pub poll_fails_after_submit: Arc<AtomicBool>,
    /// The IOCBs whose TIMEOUT CQEs the next reset holds back ([`Held`]).
    pub held: Arc<std::sync::Mutex<Held>>,
    /// Armed: the next issue is refused before anything of it is published (the executor's
    /// `check_dependency` fails): the layer is not in flight, and nothing of it runs.
    pub issue_refused: Arc<AtomicBool>,
}

/// A CPU executor with the failures its [`Rigging`] arms; unarmed, it is the CPU executor.
pub struct Rigged {
    inner: gio_uring::CpuExecutor,
    rigging: Rigging,
}

/// The stalled stack's configuration (`IO_TIMEOUT`) over a [`Rigged`] executor, and its rigging.
pub fn rigged_stack(policy: PolicyChoice) -> (Stack<Rigged>, Rigging) {
    rigged_stack_timed(policy, IO_TIMEOUT)
}

/// The same, with `io_timeout` instead of `IO_TIMEOUT`.
pub fn rigged_stack_timed(policy: PolicyChoice, io_timeout: Duration) -> (Stack<Rigged>, Rigging) {
    let mut config = config(policy);
    config.io_timeout = io_timeout;
    rigged_stack_configured(config)
}

/// A [`Rigged`] stack with the runtime configured by `config`.
pub fn rigged_stack_configured(config: RuntimeConfig) -> (Stack<Rigged>, Rigging) {
    let rigging = Rigging::default();
    let shared = rigging.clone();
    let (device, store, engine) = parts_with(None, move |pool, store_config| Rigged {
        inner: objstore::cpu_executor_for(pool, 256, store_config).expect("executor"),
        rigging: shared,
    });
    let runtime = Runtime::new(store, profile(), config).expect("runtime");
    (Stack { device, runtime, engine }, rigging)
}

/// Whether `result` is the executor error the rigged poll returns ([`Rigging::poll_fails`]),
/// returned as no live I/O's (`Store`, "poll the executor").
pub fn is_the_executor_error<T>(result: &Result<T, RuntimeError>) -> bool {
    matches!(
        result,
        Err(RuntimeError::Store {
            operation: "poll the executor",
            source: objstore::ObjstoreError::Gio(GioError::WorkerStopped { worker: 3 })
        })
    )
}

/// The device executes its `nth` I/O command of `opcode` (counted from now) and never posts its
/// completion, as a stopped executor's commands never finish. Replaces the fault plan.
pub fn lose_completion(device: &EmuDevice, nth: u64, opcode: NvmOpcode) {
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(nth, FaultAction::DropCompletion).with_opcode(opcode as u8)));
}

/// Stores the first prompt (`prompt(0, 0)`, engine blocks 0..4) and drains it, then prefills
/// `prompt(0, 1)` (engine blocks 4..10) with its first read's completion lost on the device: the
/// prefill fails with ReadFailed and its retrieve retires (the fault plan stays set).
pub fn retire_a_read<E: Executor>(stack: &mut Stack<E>) {
    prefill(stack, &prompt(0, 0), &[0, 1, 2, 3]).unwrap();
    drain_healthy(&mut stack.runtime);
    lose_completion(&stack.device, 1, NvmOpcode::Read);
    let failed = prefill(stack, &prompt(0, 1), &[4, 5, 6, 7, 8, 9]);
    assert!(matches!(failed, Err(RuntimeError::ReadFailed { .. })), "{failed:?}");
    assert_eq!(stack.runtime.retiring_requests(), 1);
}

/// What a [`Rigged`] executor holds back: the IOCBs marked (`mark`: those ISSUED then), the
/// TIMEOUT CQEs of those the next reset ended, and whether the next poll fails.
#[derive(Default)]
pub struct Held {
    pub memory: Option<Arc<QueueMemory>>,
    pub marked: Vec<IocbId>,
    pub cqes: Vec<gio_uring::ring::Cqe>,
    pub fail_next_poll: bool,
}

impl Held {
    /// Marks the IOCBs ISSUED now: the next reset ends them without posting their CQEs.
    pub fn mark(&mut self) {
        let memory = self.memory.as_ref().expect("attached");
        let issued = gio_uring::abi::GIO_IOCB_STATUS_ISSUED;
        self.marked = (0..memory.layout.config.depth).map(IocbId).filter(|&id| memory.read_iocb_progress(id).status == issued).collect();
    }
}

// The rigged executor's reset ends the IOCBs marked (`Held::mark`) as TIMEOUT without posting
// their CQEs, as when the CQ producer lock is held past its bound (gio-uring keeps such a CQE
// for the next poll: `a_cqe_whose_post_failed_is_posted_by_the_next_poll`), and its next poll
// then fails (the post failing again); the poll after posts them. The other IOCBs in flight
// end as usual, their CQEs posted by the reset.
impl Executor for Rigged {
    fn name(&self) -> &'static str {
        "rigged"
    }

    fn attach(&mut self, memory: &Arc<QueueMemory>) -> Result<(), GioError> {
        self.rigging.held.lock().expect("held").memory = Some(Arc::clone(memory));
        self.inner.attach(memory)
    }

    fn prepared(&mut self, memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
        self.inner.prepared(memory, id)
    }

    fn check_dependency(&self, dependency: &gio_uring::Dependency) -> Result<(), GioError> {
        if self.rigging.issue_refused.swap(false, Ordering::SeqCst) {
            return Err(GioError::Executor { executor: "refuses once before publishing", reason: "nothing was published".into() });
        }
        self.inner.check_dependency(dependency)
    }

    fn submit(&mut self, memory: &QueueMemory, batch: &IssueBatch) -> Result<(), GioError> {
        self.inner.submit(memory, batch)?;
        if self.rigging.poll_fails_after_submit.swap(false, Ordering::SeqCst) {
            self.rigging.poll_fails.store(true, Ordering::SeqCst);
        }
        let countdown = self.rigging.submit_fails_at.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if self.rigging.submit_fails.swap(false, Ordering::SeqCst) || countdown == Ok(1) {
            return Err(GioError::Executor { executor: "fails once after publishing", reason: "after the batch was taken".into() });
        }
        Ok(())
    }

    fn poll(&mut self, memory: &QueueMemory) -> Result<(), GioError> {
        let mut held = self.rigging.held.lock().expect("held");
        if std::mem::take(&mut held.fail_next_poll) {
            self.inner.poll(memory)?;
            return Err(GioError::Executor { executor: "cq", reason: "CQ producer lock not released (test)".into() });
        }
        for cqe in std::mem::take(&mut held.cqes) {
            gio_uring::executor::post_cqe(memory, cqe)?;
        }
        drop(held);
        self.inner.poll(memory)?;
        if self.rigging.poll_fails.swap(false, Ordering::SeqCst) {
            return Err(GioError::WorkerStopped { worker: 3 });
        }
        Ok(())
    }

    fn lend_queue_pair(
        &mut self,
        memory: &QueueMemory,
        device: usize,
        deadline: Instant,
    ) -> Result<Option<&mut nvme_driver::IoQueuePair>, GioError> {
        self.inner.lend_queue_pair(memory, device, deadline)
    }

    fn retire_queue_pairs(&mut self) -> Option<bool> {
        self.inner.retire_queue_pairs()
    }
}

impl gio_uring::QueuePairReset for Rigged {
    fn served_queue_depths(&self) -> Vec<(usize, u32)> {
        self.inner.served_queue_depths()
    }

    fn reset(&mut self, memory: &QueueMemory, fresh: Vec<nvme_driver::IoQueuePair>) -> Result<usize, GioError> {
        let mut held = self.rigging.held.lock().expect("held");
        let (issued, timeout) = (gio_uring::abi::GIO_IOCB_STATUS_ISSUED, gio_uring::abi::GIO_IOCB_STATUS_TIMEOUT);
        // Ended here as the reset would (status ISSUED → TIMEOUT), the CQE kept: the reset
        // below finds them ended and posts nothing for them.
        for id in std::mem::take(&mut held.marked) {
            let mut progress = memory.read_iocb_progress(id);
            if progress.status != issued {
                continue;
            }
            progress.status = timeout;
            memory.write_iocb_progress(id, &progress, Ordering::Release);
            held.cqes.push(gio_uring::ring::Cqe {
                iocb_id: id,
                issue_seq: memory.read_iocb_header(id).issue_seq,
                failed_ioctx: progress.failed_ioctx,
                status: timeout as u16,
                failed_nvme_status: 0,
            });
        }
        held.fail_next_poll = !held.cqes.is_empty();
        let kept = held.cqes.len();
        drop(held);
        Ok(self.inner.reset(memory, fresh)? + kept)
    }
}
