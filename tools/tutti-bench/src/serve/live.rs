//! One policy serving the stream on a fresh stack: an in-memory software controller with the
//! timing model, a pool, the object store and the runtime. The "engine" here is this thread: it
//! calls the runtime at every layer boundary exactly as an engine would, and between them
//! sleeps the layer's table duration × N (polling the runtime's I/O every
//! [`POLL_INTERVAL`], as a GPU executor would progress on its own), then the decode steps.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use nvme_driver::{DataPointerMode, NamespaceId};
use objstore::{cpu_executor_for, format_pool, FormatParams, KvRegistration, KvRequest, KvStore, Pool, PoolTarget, StoreConfig};
use scheduler::table::Profile;
use tutti_runtime::{PolicyChoice, Runtime, RuntimeConfig, RuntimeCounters};

use super::stream::Request;
use super::ServePlan;
use crate::args::DeviceSpec;
use crate::devices::{self, CreatedFiles, OpenOptions2, Traffic};
use crate::kv::{keep_engine_for_good, Engine, POOL_OVERHEAD_BYTES, SLOT_OVERHEAD_BYTES};

/// How often the sleeping compute thread lets the runtime reap and issue (wall time).
const POLL_INTERVAL: Duration = Duration::from_micros(250);
/// Engine blocks, in prompts: one for the running request, the rest for the write queue.
const ENGINE_PROMPTS: u64 = 4;
/// Stores that may wait in the write queue (each holds engine blocks until committed).
const WRITE_QUEUE_STORES: usize = 3;
/// The runtime's bound on a wait for one layer's I/O where the model makes it take less
/// ([`layer_io_timeout`]).
const LAYER_IO_TIMEOUT: Duration = Duration::from_secs(60);
/// Samples of the write backlog kept per run (one per prefill end and decode step).
const BACKLOG_SAMPLES_MAX: usize = 65_536;

/// One request as the live stack served it. Times are µs of the modelled system (wall ÷ N).
#[derive(Debug, Clone)]
pub struct ServedRequest {
    pub cached_tokens: u64,
    /// Arrival to the end of prefill (includes queueing behind earlier requests).
    pub ttft_us: f64,
    /// Arrival to the return of `begin_prefill` (engine blocks found, lookup, stores prepared,
    /// oldest stores forced when the write queue is full).
    pub admission_us: f64,
    /// `begin_prefill` to `end_prefill`.
    pub prefill_us: f64,
    pub bubble_us: f64,
    /// The table's compute for this request (what the thread slept, ÷ N).
    pub compute_us: f64,
}

/// The write queue at one moment.
#[derive(Debug, Clone, Copy)]
pub struct BacklogSample {
    pub at_us: f64,
    pub queued_blocks: usize,
    pub queued_stores: usize,
}

#[derive(Debug, Clone)]
pub struct LiveRun {
    pub requests: Vec<ServedRequest>,
    pub backlog: Vec<BacklogSample>,
    pub counters: RuntimeCounters,
    /// Model time during which the emulated SSD moved reads and writes at once (÷ N).
    pub rw_overlap_us: f64,
    pub read_busy_us: f64,
    pub write_busy_us: f64,
    /// Wall time of the whole run, µs ÷ N.
    pub wall_us: f64,
    pub block_bytes: u64,
}

/// The runtime's write-queue bounds for this plan, (blocks, stores): engine blocks not needed by
/// the running request, and [`WRITE_QUEUE_STORES`]. The prediction models the same bounds.
pub fn write_queue_limits(plan: &ServePlan) -> (u64, usize) {
    let request_blocks = plan.stream.blocks();
    ((ENGINE_PROMPTS - 1) * request_blocks, WRITE_QUEUE_STORES)
}

/// Pool bytes the stream can fill: every turn 1 stores its whole prompt, later turns their new
/// blocks (more than the live run stores when prefixes are shared).
fn pool_bytes(plan: &ServePlan, hit_rate: f64) -> u64 {
    let shape = &plan.stream;
    let blocks = shape.blocks();
    let cached = shape.cached_tokens(hit_rate) / shape.block_tokens;
    let sessions = u64::from(shape.sessions);
    let stored = sessions
        .saturating_mul(blocks)
        .saturating_add(sessions.saturating_mul(u64::from(shape.turns - 1)).saturating_mul(blocks.saturating_sub(cached)));
    let block_bytes = plan.model.choice.geometry.block_bytes();
    // Saturating: a stream past 2^64 bytes is refused by the memory check, not an overflow.
    stored.saturating_add(2).saturating_mul(block_bytes.saturating_add(SLOT_OVERHEAD_BYTES)).saturating_add(POOL_OVERHEAD_BYTES)
}

/// The in-memory device one policy's pool lives on at `hit_rate`: [`pool_bytes`] in whole MiB.
fn pool_device(plan: &ServePlan, hit_rate: f64) -> DeviceSpec {
    DeviceSpec::EmuMemory(pool_bytes(plan, hit_rate).div_ceil(1 << 20).saturating_mul(1 << 20))
}

/// The runtime's bound on each wait for one layer's I/O (`RuntimeConfig::io_timeout`) on the
/// plan's device: [`LAYER_IO_TIMEOUT`], or longer where the timing model (always one here,
/// `tutti-ssd:xN`) makes the bytes a layer wait can sit behind take longer
/// ([`devices::wait_bound`]). Those are one request's layer (its blocks, K and V), moving while
/// the other direction moves: the runtime keeps at most one read layer and one write layer in
/// flight (`pump_layers`), and the emulated device moves each direction through its own FIFO
/// pipe, so neither waits behind the other; each only runs at its mixed share while both flow
/// (`nvme_emu`'s timing model). A layer of a store is at most a request's blocks too. At most the
/// runtime's `IO_TIMEOUT_MAX` (the same 24 h as `devices::WAIT_BOUND_MAX`), which `Runtime::new`
/// refuses past.
fn layer_io_timeout(plan: &ServePlan) -> Duration {
    let layer_bytes = plan.stream.blocks().saturating_mul(2).saturating_mul(plan.model.choice.geometry.object_bytes());
    devices::wait_bound(LAYER_IO_TIMEOUT, Some(plan.model.timing), Traffic::Both, layer_bytes).min(tutti_runtime::IO_TIMEOUT_MAX)
}

/// Engine blocks one policy's stack allocates: [`ENGINE_PROMPTS`] prompts of blocks.
fn engine_blocks(plan: &ServePlan) -> u64 {
    ENGINE_PROMPTS.saturating_mul(plan.stream.blocks())
}

/// The host memory one policy's stack allocates before it serves (one stack at a time: each is
/// dropped before the next policy's starts).
pub struct HostMemory {
    /// What it is, in words, for a refusal.
    pub what: String,
    /// The engine's KV memory: K and V of every layer, [`engine_blocks`] objects each.
    pub engine_bytes: u64,
    /// The pool's in-memory device at the largest hit rate's size.
    pub pool: DeviceSpec,
}

/// What the serve run asks of the host per policy (for the check before anything runs).
pub fn host_memory(plan: &ServePlan) -> HostMemory {
    let geometry = plan.model.choice.geometry;
    let blocks = engine_blocks(plan);
    let engine_bytes = blocks.saturating_mul(geometry.object_bytes()).saturating_mul(2 * u64::from(geometry.layers));
    // The pool is largest at the lowest hit rate (fewer cached blocks, more stored).
    let pool = plan
        .hit_rates
        .iter()
        .map(|&hit_rate| pool_device(plan, hit_rate))
        .max_by_key(|spec| spec.memory_bytes().unwrap_or(0))
        .unwrap_or(DeviceSpec::EmuMemory(0));
    let what = format!(
        "serve engine KV memory ({blocks} blocks of {} over {} layers, per policy run, beside its in-memory pool)",
        plan.model.choice.name, geometry.layers
    );
    HostMemory { what, engine_bytes, pool }
}

/// Serves `requests` under `policy` on a fresh stack.
pub fn serve(plan: &ServePlan, profile: &Profile, policy: PolicyChoice, requests: &[Request], hit_rate: f64) -> anyhow::Result<LiveRun> {
    let geometry = plan.model.choice.geometry;
    let spec = pool_device(plan, hit_rate);
    let options = OpenOptions2 {
        writes: true,
        create_bytes: None,
        io_bytes_max: 2 * geometry.object_bytes(),
        queues: 4,
        timing: Some(plan.model.timing),
        lay_out: false,
        shadow_doorbells: false,
    };
    let mut created = CreatedFiles::default();
    let devices = devices::open_controllers(std::slice::from_ref(&spec), options, &mut created)
        .map_err(|error| devices::open_error(error, &spec.to_string()))?;
    let emulator = devices[0].emulator.clone().ok_or_else(|| anyhow!("{spec} did not start a software controller"))?;
    let targets = vec![PoolTarget { controller: Arc::clone(&devices[0].controller), namespace: NamespaceId(1) }];
    let params = FormatParams::new(geometry);
    format_pool(&targets, &params).context("formatting the pool")?;
    let (pool, _) = Pool::open(targets, Some(&geometry)).context("opening the pool")?;
    let request_blocks = plan.stream.blocks();
    let engine_blocks = u32::try_from(engine_blocks(plan)).map_err(|_| anyhow!("too many engine blocks"))?;
    let dma = Arc::clone(devices[0].controller.dma());
    let (engine, layout) = Engine::allocate(&dma, &geometry, engine_blocks)?;
    let mode = if devices[0].controller.data_pointer_mode() == DataPointerMode::Sgl { DataPointerMode::Sgl } else { DataPointerMode::Prp };
    let registration = KvRegistration::new(geometry, engine_blocks, layout, mode).context("registering the engine's KV memory")?;
    let store_config = StoreConfig::default();
    let executor = cpu_executor_for(&pool, 1024, &store_config).context("creating the CPU executor")?;
    let store = KvStore::new(pool, registration, dma, executor, store_config).context("building the KV store")?;
    let mut config = RuntimeConfig::new(plan.model.compute.name.clone(), plan.model.gpu.identity());
    config.policy = policy;
    let (limit_blocks, limit_stores) = write_queue_limits(plan);
    debug_assert_eq!(limit_blocks, u64::from(engine_blocks) - request_blocks);
    config.write_queue_limit_blocks = usize::try_from(limit_blocks).map_err(|_| anyhow!("write queue limit too large"))?;
    config.write_queue_limit_stores = limit_stores;
    config.io_timeout = layer_io_timeout(plan);
    let runtime = Runtime::new(store, profile.clone(), config).context("starting the runtime")?;
    let mut driver = Driver {
        runtime,
        profile,
        dilation: f64::from(plan.model.dilation),
        started: Instant::now(),
        engine_blocks,
        backlog: Vec::with_capacity((requests.len() * (plan.stream.decode_steps as usize + 1)).min(BACKLOG_SAMPLES_MAX)),
    };
    let before = emulator.stats().timing.unwrap_or_default();
    let mut served = Vec::with_capacity(requests.len());
    for request in requests {
        let closed = plan.stream.arrivals == super::Arrivals::Closed;
        match driver.request(request, closed, plan.stream.decode_steps, request_blocks as usize) {
            Ok(request) => served.push(request),
            Err(error) => {
                // As below: the store is closed before the engine memory its commands name is
                // freed, and that memory is kept if a queue pair could not be deleted (dropping
                // the runtime and then the engine would free it without asking).
                let (store, _) = driver.runtime.into_store();
                if !store.close() {
                    keep_engine_for_good(engine, "serve");
                    return Err(
                        error.context("serving a request (store closed, engine KV memory leaked on purpose: a command may still move it)")
                    );
                }
                return Err(error);
            }
        }
    }
    let Driver { runtime, backlog, started, dilation, .. } = driver;
    // A drain that fails hands the runtime back: the store is closed either way, and the
    // engine's KV memory freed only if `close` says no command can still move it.
    let (store, counters, failure) = match runtime.finish() {
        Ok((store, counters)) => (store, counters, None),
        Err(failed) => {
            let (store, counters) = failed.runtime.into_store();
            (store, counters, Some(failed.error))
        }
    };
    let wall_us = started.elapsed().as_secs_f64() * 1e6 / dilation;
    let memory_free = store.close();
    if memory_free {
        drop(engine);
    } else {
        keep_engine_for_good(engine, "serve");
    }
    if let Some(error) = failure {
        let memory = if memory_free { "freed" } else { "leaked on purpose (a command may still move it)" };
        return Err(anyhow::Error::new(error).context(format!("draining the write queue (store closed, engine KV memory {memory})")));
    }
    if !memory_free {
        return Err(anyhow!("closing the store: an I/O queue pair could not be deleted; the engine's KV memory was leaked on purpose"));
    }
    let after = emulator.stats().timing.ok_or_else(|| anyhow!("the software controller ran without its timing model"))?;
    let model_us = |later: Duration, earlier: Duration| later.saturating_sub(earlier).as_secs_f64() * 1e6 / dilation;
    Ok(LiveRun {
        requests: served,
        backlog,
        counters,
        rw_overlap_us: model_us(after.mixed_busy, before.mixed_busy),
        read_busy_us: model_us(after.read_busy, before.read_busy),
        write_busy_us: model_us(after.write_busy, before.write_busy),
        wall_us,
        block_bytes: geometry.block_bytes(),
    })
}

struct Driver<'a> {
    runtime: Runtime<gio_uring::CpuExecutor>,
    profile: &'a Profile,
    dilation: f64,
    started: Instant,
    engine_blocks: u32,
    backlog: Vec<BacklogSample>,
}

impl Driver<'_> {
    fn model_us(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.started).as_secs_f64() * 1e6 / self.dilation
    }

    /// Sleeps `table_us` × N of wall time, letting the runtime progress its I/O meanwhile.
    fn compute(&mut self, table_us: f64) -> anyhow::Result<()> {
        let end =
            Duration::try_from_secs_f64(table_us * self.dilation / 1e6).ok().and_then(|span| Instant::now().checked_add(span)).ok_or_else(
                || anyhow!("a compute step of {table_us} µs (× {} slow motion) is not a time this clock can wait for", self.dilation),
            )?;
        loop {
            self.runtime.poll_io()?;
            let now = Instant::now();
            if now >= end {
                return Ok(());
            }
            std::thread::sleep((end - now).min(POLL_INTERVAL));
        }
    }

    fn sample(&mut self) {
        if self.backlog.len() < BACKLOG_SAMPLES_MAX {
            let at_us = self.model_us(Instant::now());
            self.backlog.push(BacklogSample {
                at_us,
                queued_blocks: self.runtime.queued_blocks(),
                queued_stores: self.runtime.queued_stores(),
            });
        }
    }

    /// Engine blocks the write queue does not hold, first ones first.
    fn free_blocks(&self, count: usize) -> anyhow::Result<Vec<u32>> {
        let blocks: Vec<u32> = (0..self.engine_blocks).filter(|&block| self.runtime.releasable(block)).take(count).collect();
        if blocks.len() < count {
            return Err(anyhow!(
                "only {} of {} engine blocks are releasable for a request of {count} (the write queue holds {})",
                blocks.len(),
                self.engine_blocks,
                self.runtime.queued_blocks()
            ));
        }
        Ok(blocks)
    }

    /// Serves one request. Closed loop: it arrives now (the previous one finished decoding);
    /// Poisson: at its arrival time, waiting for it if the stack is idle before.
    fn request(&mut self, request: &Request, closed: bool, decode_steps: u32, blocks: usize) -> anyhow::Result<ServedRequest> {
        // ServePlan::from_cli bounds the stream's expected span; a draw far in the tail (or a
        // rate that slipped past it) is an error, not a panic converting or adding the time.
        let arrival = if closed {
            Instant::now()
        } else {
            Duration::try_from_secs_f64(request.arrival_us * self.dilation / 1e6)
                .ok()
                .and_then(|offset| self.started.checked_add(offset))
                .ok_or_else(|| {
                anyhow!("a request arriving {} µs into the modelled stream is not a time this clock can wait for", request.arrival_us)
            })?
        };
        while Instant::now() < arrival {
            self.runtime.poll_io()?;
            std::thread::sleep(arrival.saturating_duration_since(Instant::now()).min(POLL_INTERVAL));
        }
        let arrived_us = self.model_us(arrival.max(self.started));
        let block_ids = self.free_blocks(blocks)?;
        let begun = Instant::now();
        let start = self.runtime.begin_prefill(&KvRequest { tokens: &request.tokens, block_ids: &block_ids })?;
        let admitted = Instant::now();
        let block_tokens = request.tokens.len() as u64 / blocks as u64;
        let cached_tokens = start.cached_blocks as u64 * block_tokens;
        let input_tokens = request.tokens.len() as u32;
        let layers = self.profile.bucket(input_tokens, cached_tokens as u32)?.layers.clone();
        let mut compute_us = 0.0;
        for (layer, profile) in layers.iter().enumerate() {
            // As an engine does: the layer's work before attention needs no cached KV (the
            // table's `kv_needed_offset_us`); only attention waits for it.
            let before_attention_us = profile.kv_needed_offset_us.clamp(0.0, profile.compute_duration_us);
            self.runtime.begin_layer(start.id, layer as u32)?;
            self.compute(before_attention_us)?;
            self.runtime.wait_layer_kv(start.id, layer as u32)?;
            self.compute(profile.compute_duration_us - before_attention_us)?;
            compute_us += profile.compute_duration_us;
            self.runtime.after_layer(start.id, layer as u32)?;
        }
        let bubble = self.runtime.end_prefill(start.id)?;
        let ended = Instant::now();
        self.sample();
        for step in 0..decode_steps {
            let context_tokens = input_tokens.saturating_add(step);
            self.runtime.decode_step(context_tokens)?;
            let duration_us = self.profile.decode_step(context_tokens)?.duration_us;
            self.compute(duration_us)?;
            self.sample();
        }
        Ok(ServedRequest {
            cached_tokens,
            ttft_us: self.model_us(ended) - arrived_us,
            admission_us: self.model_us(admitted) - arrived_us,
            prefill_us: (ended - begun).as_secs_f64() * 1e6 / self.dilation,
            bubble_us: bubble.as_secs_f64() * 1e6 / self.dilation,
            compute_us,
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches};

    use super::*;
    use crate::args::Cli;

    /// 20 GiB available: 17.5 GiB can be spared.
    const MEMINFO_20G: &str = "MemTotal:       24000000 kB\nMemAvailable:   20971520 kB\n";

    fn plan(arguments: &[&str]) -> ServePlan {
        let matches = Cli::command().try_get_matches_from(std::iter::once("tutti-bench").chain(arguments.iter().copied())).unwrap();
        ServePlan::from_cli(&Cli::from_arg_matches(&matches).unwrap(), &matches).unwrap()
    }

    #[test]
    fn a_slow_model_stretches_the_runtime_s_layer_wait_to_what_it_makes_one_request_s_layer_take() {
        // Goal: serve always runs a tutti-ssd:xN model, and kept the runtime's io_timeout at a
        // fixed 60 s: at x1024 with 65536-token prompts one request's layer of llama3-8b (4096
        // blocks x 2 x 32 KiB = 256 MiB), moving while the other direction does (writes at 40%
        // of ~5.9 MB/s), takes ~115 s of model time, which the fixed 60 s failed as a stuck device.
        // A wait sits behind that one layer: the runtime has at most one read layer and one
        // write layer in flight, and the device moves each direction in its own FIFO pipe, so
        // neither queues behind the other (each only slows it to its mixed share). The bound is
        // four times that layer's model time (devices::wait_bound), not a layer of every engine
        // block (four times the bytes: ~30 min); at most the runtime's IO_TIMEOUT_MAX. At
        // 16384-token prompts a layer takes ~29 s, the bound ~115 s; the default model keeps 60 s.
        for (tokens, blocks) in [(65536, 4096), (16384, 1024)] {
            let slow = plan(&["--workload=serve", &format!("--prompt-tokens={tokens}"), "--emu-timing=tutti-ssd:x1024"]);
            let timing = slow.model.timing;
            let layer_bytes = blocks * 2 * slow.model.choice.geometry.object_bytes();
            assert_eq!(layer_bytes, blocks * (64 << 10));
            let model_s = layer_bytes as f64 / (timing.write_bytes_per_s.min(timing.read_bytes_per_s) as f64 * 0.4)
                + timing.command_latency.as_secs_f64();
            let bound = layer_io_timeout(&slow).as_secs_f64();
            assert!(
                (4.0 * model_s..4.0 * model_s + 1.0).contains(&bound),
                "{tokens} tokens: {bound:.1} s for one layer's {model_s:.1} s of model time"
            );
        }
        assert_eq!(layer_io_timeout(&plan(&["--workload=serve", "--prompt-tokens=256"])), Duration::from_secs(60));
    }

    #[test]
    fn the_engine_memory_counts_beside_the_pool() {
        // Goal: a serve run whose pool alone fits but whose engine KV memory beside it does not
        // is refused. llama3-8b's 16-token blocks are 2 MiB (all layers, K and V): 16384-token
        // prompts make 4 x 1024 blocks of engine memory (8 GiB), and 4 sessions x 2 turns at hit
        // rate 0.5 store 6144 blocks (a 12 GiB pool): 20 GiB against 17.5 GiB to spare.
        let asked = host_memory(&plan(&["--workload=serve", "--prompt-tokens=16384", "--sessions=4", "--turns=2", "--hit-rate=0.5"]));
        assert_eq!(asked.engine_bytes, 8 << 30);
        let pool_bytes = asked.pool.memory_bytes().unwrap();
        assert!((12 << 30..14 << 30).contains(&pool_bytes), "{pool_bytes}");
        let pool = std::slice::from_ref(&asked.pool);
        crate::memory::check_host_memory_with("the pool alone", 0, pool, "", MEMINFO_20G).unwrap();
        let message =
            crate::memory::check_host_memory_with(&asked.what, asked.engine_bytes, pool, "", MEMINFO_20G).unwrap_err().to_string();
        assert!(message.starts_with("serve engine KV memory (4096 blocks of llama3-8b over 32 layers"), "{message}");
        assert!(message.contains("8GiB of host memory asked beside"), "{message}");
        // The pool is sized for the lowest hit rate of a sweep (the most blocks stored).
        let sweep = host_memory(&plan(&["--workload=serve", "--prompt-tokens=16384", "--sweep-hit-rates=0.75,0.25"]));
        let lowest = host_memory(&plan(&["--workload=serve", "--prompt-tokens=16384", "--hit-rate=0.25"]));
        assert_eq!(sweep.pool, lowest.pool);
    }
}
