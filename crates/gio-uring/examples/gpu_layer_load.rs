//! KV layer loads through the gio I/O kernel (issue 15, item 5 proper): how long `issue_io` →
//! `wait_cqe` takes to bring one Llama-3.1-8B KV layer into GPU memory in staged DMA mode.
//!
//! What it measures is the software controller (nvme-emu on memory) copying the layer into host
//! staging memory, the I/O kernel submitting and completing the NVMe commands from the GPU, and
//! the executor's host-to-GPU copy of the staging buffer: the emulator's memcpy plus the kernel
//! plus the staged copy. Not an SSD.
//!
//! Set-up, as tests/gpu.rs (shared code in tests/common/gpu_setup.rs): one namespace of 4 KiB
//! LBAs on `Backing::Memory`, one detached NVMe queue pair of 1024 entries driven by the kernel
//! in an I/O domain of --io-sms SMs, a source and a target staging buffer (controller DMA memory
//! registered with the GPU, each mirrored by a GPU buffer), both sized to the largest layer.
//!
//! For each layer size (tokens × 4 KiB: 8 KV heads × 128 dims × K and V × bf16; by default 256,
//! 512, …, 32768 tokens, 1 to 128 MiB, in ascending order): a pattern unique to the size and to
//! every 8-byte word goes into the source GPU buffer and is written once through the kernel at
//! LBA 0 (IOCBs of at most 2048 IOCTXs of --ioctx-kib KiB, one SGL data block each, all IOCBs in
//! one `issue_io`); the namespace's copy is checked through a CPU queue pair (so that a write and
//! a read that agree on wrong LBAs cannot pass); then one untimed read and --repetitions timed
//! ones. Before every read the target staging buffer and the target GPU buffer are poisoned; a
//! timed read is `issue_io` of the layer's read IOCBs → `wait_cqe` of each (bounded: 30 s, the
//! kernel itself gives up after about 2 s); after every read the target GPU buffer is compared
//! with the pattern. A failed IOCB or one differing byte ends the run with exit status 1.
//!
//! Caps: a layer is at most 128 MiB (32768 tokens), the largest the plan needs. The memory
//! backing and each staging buffer are sized to the largest layer asked for: with the default
//! sizes, a 128 MiB backing (lazily committed) and two 128 MiB staging buffers (resident and
//! registered with the GPU), 256 MiB of GPU memory, and three more 128 MiB buffers of ordinary
//! memory (the pattern, the poison, the read-back): about 0.8 GiB of host memory in all.
//!
//! Usage: gpu_layer_load [--tokens 256,512,...,32768] [--ioctx-kib 32] [--repetitions 20]
//!                       [--budget-s 150] [--io-sms 8] [--json PATH]
//! Environment: GIO_KERNEL_DIR (default target/kernels), GIO_DMA_MODE (staged, the default, is
//! the only mode written). tools/gpu/run-all.sh's bandwidth step runs it with both set.
//!
//! --json PATH: a JSON array with one `{layer_bytes, ioctx_bytes, repetitions, median_us,
//! gb_per_s}` point per size (GB = 10^9 bytes), rewritten after every size so that a run cut
//! short still leaves the sizes it finished.
//!
//! Budget: --budget-s counts from the start of the process (set-up included). A size starts only
//! if the previous size's time, scaled by the size ratio, still fits; a repetition only if the
//! previous one (with its poisoning and comparison) still fits. run-all.sh allows 180 s
//! (RUN_ALL_LAYER_LOAD_BUDGET_S); the default 150 s leaves the rest for start-up and teardown.
//!
//! Exit status: 0 every size measured and verified; 1 an error (no CUDA driver or device, a
//! failed IOCB, bytes that differ, a wait that ran out); 2 bad arguments; 3 the budget ran out
//! before every size and repetition was done (each point says how many repetitions it has).
//!
//! What it should show, worked out beforehand (an H200 host; unmeasured): the emulator's thread
//! copies 32 KiB per command at roughly 10 GB/s (about 3 µs) plus a microsecond or two of
//! command handling, and the staged copy of registered memory runs near PCIe Gen5's ~50 GB/s,
//! so the large layers should come in at a few GB/s (128 MiB: about 20–30 ms), bounded by the
//! emulator's single thread, not by the kernel; the 1 MiB layer (32 IOCTXs) should take a few
//! hundred µs, dominated by the launch, the emulator finding the GPU's doorbells (it polls them
//! every 10 µs when idle) and the executor retiring the launch. The whole run: a second or two
//! of set-up, then per size mostly the poisoning and comparison around each read (about 0.1 s a
//! read at 128 MiB), some 5–10 s for the default sizes; well inside the budget.
//!
//! STATUS: written and built on a machine without a GPU; it has never run on one. The pure
//! parts (options, size plan, IOCB chunking, pattern, comparison, statistics, budget, JSON) are
//! unit-tested in gpu_layer_load/plan.rs: `cargo test -p gio-uring --features cuda --example
//! gpu_layer_load`.

#[path = "../tests/common/gpu_setup.rs"]
mod gpu_setup;

use std::process::ExitCode;
use std::time::Instant;

use plan::Options;

fn main() -> ExitCode {
    let started = Instant::now();
    let options = match Options::parse(std::env::args().skip(1)) {
        Ok(Some(options)) => options,
        Ok(None) => {
            println!("{}", plan::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            eprintln!("gpu-layer-load: {error}\n{}", plan::USAGE);
            return ExitCode::from(2);
        }
    };
    let outcome = run::run(&options, started);
    // An executor whose teardown could not drain its I/O stream (a hung kernel) kept its GPU
    // state, and the stagings kept their memory (gpu_setup::Staging): whatever the run said, its
    // figures are not to be trusted and nothing more is asked of the GPU. Exit 1 at once.
    if gio_uring::gpu::teardowns_leaked() > 0 {
        let said = match &outcome {
            Ok(run::Outcome::Complete) => "complete".to_string(),
            Ok(run::Outcome::Partial { reason }) => format!("partial: {reason}"),
            Err(error) => format!("error: {error}"),
        };
        eprintln!(
            "gpu-layer-load: error: the CUDA executor could not drain its stream at teardown (a kernel or copy still runs); \
             its memory and the staging buffers were kept, not freed (the run itself: {said})"
        );
        std::process::exit(1);
    }
    match outcome {
        Ok(run::Outcome::Complete) => ExitCode::SUCCESS,
        Ok(run::Outcome::Partial { reason }) => {
            eprintln!("gpu-layer-load: PARTIAL: {reason}");
            ExitCode::from(3)
        }
        Err(error) => {
            eprintln!("gpu-layer-load: error: {error}");
            ExitCode::from(1)
        }
    }
}

/// The GPU run: set-up, then per size write once, check, read and time.
mod run {
    use std::error::Error;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use gio_uring::abi::Opcode;
    use gio_uring::gpu::{probe_driver, GpuExecutor};
    use gio_uring::{Dependency, DeviceTable, GioError, GioQueue, IocbId, IocbSpec, LayerIndex, Lba, QueueConfig, SmBudget};
    use nvme_driver::{Controller, DataSegment, IoQueuePair};
    use nvme_emu::{Backing, EmuConfig, NamespaceConfig};

    use super::gpu_setup::{self, EmulatedController, Staging};
    use super::plan::{self, Budget, LayerPlan, Options, Point, BLOCK_BYTES, POISON};

    type Result<T> = std::result::Result<T, Box<dyn Error>>;

    /// Entries of the kernel's NVMe queue pair: a 128 MiB layer of 32 KiB IOCTXs (4096
    /// commands) goes round it four times.
    const NVME_QUEUE_DEPTH: u32 = 1024;
    /// Bound on every `wait_cqe`. The kernel gives up on a command after about 2 s (the
    /// executor's default polling bound) and the executor drains its stream within 10 s.
    const WAIT_BOUND: Duration = Duration::from_secs(30);
    /// Bound on each CPU read of the namespace check.
    const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

    pub enum Outcome {
        Complete,
        Partial { reason: String },
    }

    pub fn run(options: &Options, started: Instant) -> Result<Outcome> {
        let layers = plan::layer_plan(&options.tokens, options.ioctx_bytes)?;
        let largest = layers.iter().map(|layer| layer.layer_bytes).max().ok_or("no layer sizes")?;
        // Fail fast, before any memory is set up: a mode that cannot work, no GPU, no kernels.
        gpu_setup::staged_mode_from_env()?;
        let driver = match probe_driver() {
            Ok(driver) => driver,
            Err(GioError::NoCudaDriver { reason }) => {
                return Err(format!(
                    "no CUDA driver or device ({reason}); this example runs the gio I/O kernel on an NVIDIA GPU \
                     (tools/gpu/run-all.sh bandwidth on a GPU machine)"
                )
                .into())
            }
            Err(other) => return Err(format!("CUDA driver probe: {other}").into()),
        };
        let kernel_dir = gpu_setup::kernel_dir();
        if !kernel_dir.is_dir() {
            return Err(format!(
                "GIO_KERNEL_DIR {}: not a directory (tools/cuda-build.sh writes the kernels to target/kernels)",
                kernel_dir.display()
            )
            .into());
        }
        let runtime = gpu_setup::open_runtime(SmBudget(options.io_sms))?;
        println!("gpu-layer-load: driver {driver:?}");
        println!("gpu-layer-load: {:?}", runtime.report());

        let emu = EmuConfig {
            // The GPU's doorbell writes cannot wake the controller thread; it finds them by
            // polling, within this bound once idle (the default 100 µs would dominate 1 MiB).
            idle_sleep_max: Duration::from_micros(10),
            ..EmuConfig::default()
        }
        .with_backing(Backing::Memory { bytes: largest })
        .with_namespaces(vec![NamespaceConfig::new(BLOCK_BYTES as u32, Some(largest))])
        .with_volatile_write_cache(false)
        .with_sgl(true);
        let emulated = EmulatedController::start(emu)?;
        let controller = &emulated.controller;
        if options.ioctx_bytes > controller.max_transfer_bytes() {
            return Err(format!(
                "--ioctx-kib {}: the controller moves at most {} bytes per command",
                options.ioctx_bytes / 1024,
                controller.max_transfer_bytes()
            )
            .into());
        }
        let info = emulated.device_info();
        if !info.sgl_supported {
            return Err("the software controller reports no SGL support; the IOCTXs are SGL data blocks".into());
        }
        let bytes = usize::try_from(largest)?;
        let source = Staging::allocate(controller, bytes, "source")?;
        let target = Staging::allocate(controller, bytes, "target")?;
        let executor = gpu_setup::staged_executor(
            runtime,
            &emulated,
            NVME_QUEUE_DEPTH,
            &[&source, &target],
            gio_uring::gpu::GpuExecutorConfig::default().poll_iterations_max,
        )?;
        let grid = executor.grid_limits();
        let iocbs_max = layers.iter().map(|layer| layer.iocb_ranges.len()).max().unwrap_or(1);
        let queue_config = QueueConfig { depth: plan::queue_depth(iocbs_max), ioctx_per_iocb_max: plan::IOCTX_PER_IOCB_MAX };
        let registered = gpu_setup::registered(&[&source, &target])?;
        let mut queue = GioQueue::init_queue(queue_config, DeviceTable::new(vec![info]), registered, executor)?;
        let writes = queue.get_iocb(iocbs_max, Dependency::None)?;
        let reads = queue.get_iocb(iocbs_max, Dependency::None)?;
        let mut checking = controller.create_io_queue_pair(16)?;
        let scratch_bytes = controller.max_transfer_bytes().min(128 << 10) as usize;
        let scratch = controller.dma().allocate(scratch_bytes)?;
        println!(
            "gpu-layer-load: software controller on {largest} bytes of memory, 4 KiB LBAs, SGL; 1 NVMe queue pair of \
             {NVME_QUEUE_DEPTH}; {grid:?}; gio queue depth {}; IOCTX {} bytes; {} repetitions after 1 untimed; budget {} s; \
             staged mode",
            queue_config.depth,
            options.ioctx_bytes,
            options.repetitions,
            options.budget.as_secs()
        );
        println!(
            "{:>7} {:>10} {:>5} {:>6} {:>5} {:>10} {:>10} {:>10} {:>8} {:>10}",
            "tokens", "bytes", "iocbs", "ioctxs", "reps", "median_us", "p10_us", "p90_us", "GB/s", "write_us"
        );

        let budget = Budget { started, limit: options.budget };
        let mut points: Vec<Point> = Vec::new();
        let mut previous: Option<(u64, Duration)> = None;
        let sm_budget = SmBudget(options.io_sms);
        let mut rig = Rig {
            queue: &mut queue,
            writes: &writes,
            reads: &reads,
            source: &source,
            target: &target,
            controller,
            checking: &mut checking,
            scratch: &scratch,
            sm_budget,
            poison: vec![POISON; bytes],
            back: vec![0u8; bytes],
        };
        for (index, layer) in layers.iter().enumerate() {
            let size_started = Instant::now();
            if let Some((previous_bytes, previous_time)) = previous {
                let estimate = plan::scale_estimate(previous_time, previous_bytes, layer.layer_bytes);
                if !budget.fits(size_started, estimate) {
                    return Ok(Outcome::Partial {
                        reason: format!(
                            "budget of {} s: stopped before {} tokens (estimated {:.1} s, {:.1} s left); {} of {} sizes done",
                            options.budget.as_secs(),
                            layer.tokens,
                            estimate.as_secs_f64(),
                            budget.left(size_started).as_secs_f64(),
                            index,
                            layers.len()
                        ),
                    });
                }
            }
            let Measured { samples_us, write_us, stopped } = rig.measure(layer, options.repetitions, &budget)?;
            let summary = plan::summarize(&samples_us).ok_or("no timed repetition")?;
            let point = Point::new(layer.layer_bytes, options.ioctx_bytes, samples_us.len() as u32, summary.median_us);
            println!(
                "{:>7} {:>10} {:>5} {:>6} {:>5} {:>10.1} {:>10.1} {:>10.1} {:>8.3} {:>10.1}",
                layer.tokens,
                layer.layer_bytes,
                layer.iocb_ranges.len(),
                layer.ioctx_count,
                point.repetitions,
                point.median_us,
                summary.p10_us,
                summary.p90_us,
                point.gb_per_s,
                write_us
            );
            points.push(point);
            if let Some(path) = &options.json_path {
                plan::write_json(path, &points).map_err(|error| format!("writing {}: {error}", path.display()))?;
            }
            if stopped {
                return Ok(Outcome::Partial {
                    reason: format!(
                        "budget of {} s: {} tokens stopped after {} of {} repetitions; {} of {} sizes done",
                        options.budget.as_secs(),
                        layer.tokens,
                        samples_us.len(),
                        options.repetitions,
                        index + 1,
                        layers.len()
                    ),
                });
            }
            previous = Some((layer.layer_bytes, size_started.elapsed()));
        }
        let executor: &GpuExecutor = rig.queue.executor();
        if executor.kernel_cqe_overflows() != 0 || executor.resets() != 0 {
            return Err(format!(
                "the kernel could not post {} CQEs and the executor reset its queue pairs {} times",
                executor.kernel_cqe_overflows(),
                executor.resets()
            )
            .into());
        }
        println!("gpu-layer-load: {} sizes, every read verified ({:.1} s)", points.len(), started.elapsed().as_secs_f64());
        Ok(Outcome::Complete)
    }

    /// What the per-size steps use.
    struct Rig<'a> {
        queue: &'a mut GioQueue<GpuExecutor>,
        writes: &'a [IocbId],
        reads: &'a [IocbId],
        source: &'a Staging,
        target: &'a Staging,
        controller: &'a Arc<Controller>,
        checking: &'a mut IoQueuePair,
        scratch: &'a nvme_driver::DmaRegion,
        sm_budget: SmBudget,
        /// What the targets are filled with before each read, and where each read comes back.
        poison: Vec<u8>,
        back: Vec<u8>,
    }

    /// One size's figures.
    struct Measured {
        samples_us: Vec<f64>,
        write_us: f64,
        /// The budget ended the repetitions early.
        stopped: bool,
    }

    impl Rig<'_> {
        /// Writes the layer once, checks the namespace, then reads it: once untimed, then up to
        /// `repetitions` times timed while the budget allows (at least once).
        fn measure(&mut self, layer: &LayerPlan, repetitions: u32, budget: &Budget) -> Result<Measured> {
            let expected = plan::layer_pattern(layer.layer_bytes, layer.layer_bytes as usize);
            let write_us = self.write_layer(layer, &expected)?;
            self.check_namespace(&expected)?;
            self.prepare_reads(layer)?;
            let mut samples_us = Vec::with_capacity(repetitions as usize);
            let mut last_cost = Duration::ZERO;
            // Repetition 0 is the untimed one.
            for repetition in 0..=repetitions {
                let before = Instant::now();
                if repetition > 1 && !budget.fits(before, last_cost) {
                    return Ok(Measured { samples_us, write_us, stopped: true });
                }
                let elapsed = self.read_layer(layer, &expected, repetition)?;
                if repetition > 0 {
                    samples_us.push(elapsed.as_secs_f64() * 1e6);
                }
                last_cost = before.elapsed();
            }
            Ok(Measured { samples_us, write_us, stopped: false })
        }

        /// Fills `ids[..n]` with the layer's IOCBs (IOCTX `i` at LBA `i × blocks` and at byte
        /// `i × ioctx_bytes` of `staging`) and returns them.
        fn fill<'i>(&mut self, ids: &'i [IocbId], opcode: Opcode, layer: &LayerPlan, staging: &Staging) -> Result<&'i [IocbId]> {
            let nsid = self.controller.namespaces()[0].id.0;
            let used = &ids[..layer.iocb_ranges.len()];
            for (&id, range) in used.iter().zip(&layer.iocb_ranges) {
                let ioctxs = plan::ioctx_specs(range.clone(), staging.host.iova(), layer.ioctx_bytes, nsid)?;
                self.queue.fill_iocb(id, &IocbSpec::single(opcode, u64::from(id.0)), &ioctxs)?;
            }
            Ok(used)
        }

        /// Issues `ids` in one `issue_io` and waits for each; returns the time from issue to
        /// the last completion.
        fn issue_and_wait(&mut self, ids: &[IocbId], what: &str) -> Result<Duration> {
            let issued = Instant::now();
            self.queue.issue_io(ids, LayerIndex(0), self.sm_budget)?;
            for &id in ids {
                let completion = self
                    .queue
                    .wait_cqe(id, issued + WAIT_BOUND)
                    .map_err(|error| format!("{what}: waiting for IOCB {} (bounded by {WAIT_BOUND:?}): {error}", id.0))?;
                if let Err(failure) = completion.result {
                    return Err(format!("{what}: IOCB {} failed: {failure}", id.0).into());
                }
            }
            Ok(issued.elapsed())
        }

        /// Puts `expected` into the source GPU buffer and writes it to LBA 0 through the kernel.
        fn write_layer(&mut self, layer: &LayerPlan, expected: &[u8]) -> Result<f64> {
            self.source.gpu.copy_from_host(0, expected)?;
            gpu_setup::settle_copies(&self.source.gpu)?;
            let writes = self.writes;
            let ids = self.fill(writes, Opcode::Write, layer, self.source)?;
            let elapsed = self.issue_and_wait(ids, &format!("write of {} tokens", layer.tokens))?;
            Ok(elapsed.as_secs_f64() * 1e6)
        }

        /// Fills the read IOCBs: the layer's LBAs into the target staging buffer.
        fn prepare_reads(&mut self, layer: &LayerPlan) -> Result<()> {
            let reads = self.reads;
            self.fill(reads, Opcode::Read, layer, self.target).map(|_| ())
        }

        /// Reads the namespace from LBA 0 through a CPU queue pair and compares it with
        /// `expected`: the kernel's write landed at the LBAs the IOCTXs name.
        fn check_namespace(&mut self, expected: &[u8]) -> Result<()> {
            let namespace = self.controller.namespaces()[0];
            let chunk = self.scratch.len();
            let mut on_ssd = vec![0u8; chunk];
            for (index, piece) in expected.chunks(chunk).enumerate() {
                let offset = index * chunk;
                let lba = Lba((offset / plan::BLOCK_BYTES as usize) as u64);
                let segment = DataSegment::new(self.scratch.iova(), piece.len() as u32);
                self.checking
                    .read(namespace.id, lba, &[segment], CHECK_TIMEOUT)
                    .map_err(|error| format!("checking the namespace at LBA {}: {error}", lba.0))?;
                self.scratch.read(0, &mut on_ssd[..piece.len()])?;
                if let Some(mismatch) = plan::first_mismatch(piece, &on_ssd[..piece.len()]) {
                    return Err(format!(
                        "the namespace does not hold what the kernel wrote: byte {} is {:#04x}, expected {:#04x} ({} bytes \
                         of that {}-byte read differ)",
                        offset + mismatch.offset,
                        mismatch.actual,
                        mismatch.expected,
                        mismatch.differing,
                        piece.len()
                    )
                    .into());
                }
            }
            Ok(())
        }

        /// Poisons the targets, reads the layer through the kernel (timed), then compares the
        /// target GPU buffer with `expected`.
        fn read_layer(&mut self, layer: &LayerPlan, expected: &[u8], repetition: u32) -> Result<Duration> {
            let bytes = expected.len();
            self.target.host.fill(0, bytes, POISON)?;
            self.target.gpu.copy_from_host(0, &self.poison[..bytes])?;
            gpu_setup::settle_copies(&self.target.gpu)?;
            let reads = &self.reads[..layer.iocb_ranges.len()];
            let elapsed = self.issue_and_wait(reads, &format!("read of {} tokens, repetition {repetition}", layer.tokens))?;
            self.target.gpu.copy_to_host(0, &mut self.back[..bytes])?;
            if let Some(mismatch) = plan::first_mismatch(expected, &self.back[..bytes]) {
                return Err(format!(
                    "read of {} tokens, repetition {repetition}: {} (0 is the untimed one)",
                    layer.tokens,
                    mismatch.describe(layer.ioctx_bytes)
                )
                .into());
            }
            Ok(elapsed)
        }
    }
}

/// The parts that need no GPU (unit-tested there).
#[path = "gpu_layer_load/plan.rs"]
mod plan;
