//! An inference engine in miniature: the template for integrating tutti.
//!
//! `cargo run --release -p tutti-runtime --example engine -- [REQUESTS] [POLICY]`
//! (POLICY: slack-aware, the default, naive or no-overlap)
//!
//! It registers a paged KV pool (Llama-3.1-8B geometry, 16-token blocks, K and V as separate
//! per-layer tensors) and serves a stream of chat turns from a few sessions that share a system
//! prompt. The engine only reports its layer boundaries to the runtime, which decides every read
//! and write from the profile table:
//! 1. `begin_prefill`: the runtime looks up the longest cached prefix and prepares its retrieve
//!    into the leading engine blocks and the store of the rest;
//! 2. for each layer, `begin_layer` (the runtime issues what the policy decides), the layer's
//!    work before attention, `wait_layer_kv` (returns once the layer's cached KV is resident: any
//!    wait is bubble), the rest of the layer (here: table times, busy-waited, and its new KV
//!    written into engine memory), `after_layer` (that KV may now be written);
//! 3. `end_prefill`; then decode steps (`decode_step`), into whose slack queued writes go;
//! 4. a new request takes only engine blocks the runtime says are `releasable`: a block holding
//!    KV that is queued for writing is not.
//!
//! It checks every byte of every retrieved block and prints hit rate, TTFT and bubble per request,
//! and what the runtime deferred.
//!
//! Honest scope: the device is the software NVMe controller in memory with its timing model set
//! to one of Tutti's evaluation SSDs in 32x slow motion (`tutti-ssd`), the executor is the CPU
//! one, and compute is an analytic H100 roofline estimate slowed down by the same 32x. The
//! mechanics (what to call when) are the real ones; the figures are emulated, not an H100's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::hw::DeviceBackend;
use nvme_driver::{Controller, ControllerConfig, DataPointerMode, DmaRegion, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice};
use objstore::{
    cpu_executor_for, format_pool, FormatParams, KvLayout, KvRegistration, KvRequest, KvStore, ModelGeometry, Pool, PoolTarget, StoreConfig,
};
use scheduler::analytic::{build_table, AnalyticGrid, GpuSpec, ModelConfig};
use scheduler::ssd::SsdModel;
use scheduler::table::Profile;
use tutti_runtime::{PolicyChoice, Runtime, RuntimeConfig, RuntimeCounters};

const BLOCK_TOKENS: u32 = 16;
const ENGINE_BLOCKS: u32 = 64;
const SESSIONS: u32 = 4;
const SYSTEM_PROMPT_BLOCKS: u32 = 8;
const NEW_BLOCKS_PER_TURN: u32 = 4;
const DECODE_STEPS_PER_REQUEST: u32 = 4;
/// The whole world in slow motion: the SSD model and the compute times, by the same factor.
const DILATION: u32 = 32;

type Failure = Box<dyn std::error::Error>;

/// The tokens of `session`'s prompt at `turn`: the shared system prompt, the session's history
/// (everything its earlier turns said), then this turn's new text.
fn prompt(session: u32, turn: u32) -> Vec<u32> {
    let mut tokens: Vec<u32> = (0..SYSTEM_PROMPT_BLOCKS * BLOCK_TOKENS).collect();
    for past in 0..=turn {
        tokens.extend((0..NEW_BLOCKS_PER_TURN * BLOCK_TOKENS).map(|index| 1_000_000 * (session + 1) + 10_000 * past + index));
    }
    tokens
}

/// A byte that stands for the KV of block `block` of `tokens` at (layer, K/V): a function of the
/// whole prefix up to that block, as real KV is.
fn kv_byte(tokens: &[u32], block: u32, layer: u32, value: bool) -> u8 {
    let end = ((block + 1) * BLOCK_TOKENS) as usize;
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for &token in &tokens[..end] {
        hash = (hash ^ u64::from(token)).wrapping_mul(0x100_0000_01b3);
    }
    (hash ^ u64::from(layer) << 1 ^ u64::from(value)).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes()[7]
}

/// The engine's paged KV memory: one tensor per (layer, K/V), `ENGINE_BLOCKS` blocks each.
struct EnginePool {
    tensors: Vec<DmaRegion>,
    object_bytes: usize,
}

impl EnginePool {
    fn tensor(&self, layer: u32, value: bool) -> &DmaRegion {
        &self.tensors[(2 * layer + u32::from(value)) as usize]
    }

    /// "Computes" layer `layer` of blocks `blocks` of `tokens` into their engine blocks.
    fn compute_layer(&self, tokens: &[u32], blocks: std::ops::Range<u32>, engine_blocks: &[u32], layer: u32) -> Result<(), Failure> {
        for block in blocks {
            for value in [false, true] {
                let byte = kv_byte(tokens, block, layer, value);
                self.tensor(layer, value).fill(engine_blocks[block as usize] as usize * self.object_bytes, self.object_bytes, byte)?;
            }
        }
        Ok(())
    }

    /// Checks that engine block `engine_block` holds block `block` of `tokens` in every layer
    /// (first and last 256 bytes of every object).
    fn check_block(&self, layers: u32, tokens: &[u32], block: u32, engine_block: u32) -> Result<(), Failure> {
        let mut sample = [0u8; 256];
        for layer in 0..layers {
            for value in [false, true] {
                let expected = kv_byte(tokens, block, layer, value);
                let start = engine_block as usize * self.object_bytes;
                for offset in [start, start + self.object_bytes - sample.len()] {
                    self.tensor(layer, value).read(offset, &mut sample)?;
                    if sample.iter().any(|&byte| byte != expected) {
                        return Err(format!("block {block} layer {layer} {} came back wrong", if value { "V" } else { "K" }).into());
                    }
                }
            }
        }
        Ok(())
    }
}

/// How often the engine's CPU thread lets the runtime advance its I/O while the "GPU" computes.
const POLL_INTERVAL: Duration = Duration::from_micros(50);

/// Busy-waits `duration` (a stand-in for the GPU running a layer's kernels) while the engine's
/// otherwise idle CPU thread calls `poll_io`: with the CPU executor, commands start and complete
/// only when polled, so without this the I/O the runtime decided at a boundary would advance one
/// layer per boundary. (A GPU executor's kernel needs no such help.)
fn compute_for(runtime: &mut Runtime<gio_uring::CpuExecutor>, duration: Duration) -> Result<(), Failure> {
    let started = Instant::now();
    let mut next_poll = started;
    while started.elapsed() < duration {
        if Instant::now() >= next_poll {
            runtime.poll_io()?;
            next_poll = Instant::now() + POLL_INTERVAL;
        }
        std::hint::spin_loop();
    }
    Ok(())
}

fn dilated_us(microseconds: f64) -> Duration {
    Duration::from_secs_f64(microseconds * f64::from(DILATION) / 1e6)
}

/// `count` engine blocks the runtime says may be reused; runs decode steps (whose slack takes
/// queued writes) until there are enough. Bounded.
fn take_blocks(runtime: &mut Runtime<gio_uring::CpuExecutor>, profile: &Profile, count: u32, context: u32) -> Result<Vec<u32>, Failure> {
    for _ in 0..256 {
        let free: Vec<u32> = (0..ENGINE_BLOCKS).filter(|&block| runtime.releasable(block)).take(count as usize).collect();
        if free.len() == count as usize {
            return Ok(free);
        }
        decode_step(runtime, profile, context)?;
    }
    Err(format!("no {count} releasable engine blocks after 256 decode steps").into())
}

/// One decode step: the runtime's boundary (queued writes go into its slack), then its compute,
/// as long as the step the runtime priced: a context before the first decode row is priced as
/// that row (`Profile::decode_pricing_context`), which `Profile::decode_step` alone refuses.
fn decode_step(runtime: &mut Runtime<gio_uring::CpuExecutor>, profile: &Profile, context: u32) -> Result<(), Failure> {
    runtime.decode_step(context)?;
    compute_for(runtime, dilated_us(profile.decode_step(profile.decode_pricing_context(context))?.duration_us))
}

/// Ends the runtime: drains the write queue, then closes the store, whose answer says whether
/// the engine may free its KV memory. An engine that cannot drain (a write that timed out, a
/// request still retiring) gets the runtime back from `finish`; this one gives up, closes the
/// store all the same, and keeps its KV memory allocated for good unless `close` says no command
/// can still move it.
fn finish(runtime: Runtime<gio_uring::CpuExecutor>, engine: EnginePool) -> Result<RuntimeCounters, Failure> {
    let (store, counters, failure) = match runtime.finish() {
        Ok((store, counters)) => (store, counters, None),
        Err(failed) => {
            let (store, counters) = failed.runtime.into_store();
            (store, counters, Some(failed.error))
        }
    };
    let memory_free = store.close();
    if !memory_free {
        eprintln!("engine example: an I/O queue pair could not be deleted: the engine's KV memory is kept allocated for good");
        std::mem::forget(engine);
    }
    match failure {
        None if memory_free => Ok(counters),
        None => Err("the store could not delete an I/O queue pair; the engine's KV memory was leaked on purpose".into()),
        Some(error) => Err(format!(
            "finishing the runtime: {error}; the store was closed and the engine's KV memory {}",
            if memory_free { "freed" } else { "leaked on purpose (a command may still move it)" }
        )
        .into()),
    }
}

/// What the requests served added up to.
#[derive(Default)]
struct Served {
    hit_blocks: u64,
    blocks: u64,
    requests: u32,
    ttft: Duration,
    bubble: Duration,
    compute: Duration,
}

/// Serves `requests` chat turns through the runtime. An error leaves the runtime to the caller,
/// which closes its store before the engine memory is freed.
fn serve(runtime: &mut Runtime<gio_uring::CpuExecutor>, engine: &EnginePool, profile: &Profile, requests: u32) -> Result<Served, Failure> {
    let geometry = *runtime.store().pool().geometry();
    let mut totals = Served::default();
    for request in 0..requests {
        let (session, turn) = (request % SESSIONS, request / SESSIONS);
        let tokens = prompt(session, turn);
        let blocks = tokens.len() as u32 / BLOCK_TOKENS;
        if blocks > ENGINE_BLOCKS / 2 {
            println!("stopping: the next prompt ({blocks} blocks) needs more than half the engine pool of {ENGINE_BLOCKS} blocks");
            break;
        }
        let engine_blocks = take_blocks(runtime, profile, blocks, tokens.len() as u32)?;
        let started = Instant::now();
        let start = runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &engine_blocks })?;
        let hit = start.cached_blocks as u32;
        let layer_profiles = &profile.bucket(tokens.len() as u32, hit * BLOCK_TOKENS)?.layers;
        let (mut bubble, mut compute) = (Duration::ZERO, Duration::ZERO);
        for layer in 0..geometry.layers {
            // The layer's work before attention (norm, QKV projection) needs no cached KV: only
            // attention waits for it.
            let profile = &layer_profiles[layer as usize];
            let before_attention_us = profile.kv_needed_offset_us.clamp(0.0, profile.compute_duration_us);
            runtime.begin_layer(start.id, layer)?;
            compute_for(runtime, dilated_us(before_attention_us))?;
            bubble += runtime.wait_layer_kv(start.id, layer)?;
            compute_for(runtime, dilated_us(profile.compute_duration_us - before_attention_us))?;
            engine.compute_layer(&tokens, hit..blocks, &engine_blocks, layer)?;
            compute += dilated_us(profile.compute_duration_us);
            runtime.after_layer(start.id, layer)?;
        }
        runtime.end_prefill(start.id)?;
        let ttft = started.elapsed();
        for block in 0..hit {
            engine.check_block(geometry.layers, &tokens, block, engine_blocks[block as usize])?;
        }
        println!(
            "{request:>4} {blocks:>7} {hit:>5} {:>9.2} {:>10.2} {:>11.2} {:>7}",
            ttft.as_secs_f64() * 1e3,
            bubble.as_secs_f64() * 1e3,
            compute.as_secs_f64() * 1e3,
            runtime.queued_blocks()
        );
        for step in 0..DECODE_STEPS_PER_REQUEST {
            decode_step(runtime, profile, tokens.len() as u32 + step)?;
        }
        totals.hit_blocks += u64::from(hit);
        totals.blocks += u64::from(blocks);
        totals.ttft += ttft;
        totals.bubble += bubble;
        totals.compute += compute;
        totals.requests += 1;
    }
    Ok(totals)
}

/// After a failure: closes the store, and keeps the engine's KV memory allocated for good unless
/// `close` says no command can still move it. Returns the failure, saying which.
fn close_after_failure(store: KvStore<gio_uring::CpuExecutor>, engine: EnginePool, error: Failure) -> Failure {
    if store.close() {
        return error;
    }
    eprintln!("engine example: an I/O queue pair could not be deleted: the engine's KV memory is kept allocated for good");
    std::mem::forget(engine);
    format!("{error} (store closed, engine KV memory leaked on purpose: a command may still move it)").into()
}

fn main() -> Result<(), Failure> {
    let mut args = std::env::args().skip(1);
    let requests: u32 = args.next().map_or(Ok(16), |arg| arg.parse())?;
    let policy = match args.next() {
        None => PolicyChoice::SlackAware,
        Some(name) => PolicyChoice::parse(&name).ok_or_else(|| format!("unknown policy '{name}': slack-aware, naive or no-overlap"))?,
    };
    let geometry = ModelGeometry::llama3_8b(BLOCK_TOKENS);

    // Profile table: Llama-3.1-8B on an H100 (roofline estimate), I/O costs of Tutti's SSDs.
    let ssd = SsdModel::tutti_two_ssds();
    let grid = AnalyticGrid { input_step_tokens: 64, input_step_count: 32, prefix_step_tokens: 64, io_sms: 4, decode_step_tokens: 64 };
    // One IOCB of the cost table moves 1 MiB, about one layer of one of this stream's requests
    // (the runtime sizes what it issues in the table's IOCBs).
    let io_costs = ssd.cost_table(1 << 20, 64, &[grid.io_sms])?;
    let table = build_table(&ModelConfig::llama3_8b(), &GpuSpec::h100(), &grid, io_costs, "analytic (not measured)")?;
    let profile = Profile::from_table(table)?;

    // Device (one of those SSDs, in slow motion), pool and the engine's KV memory (registered once).
    let timing = tutti_devices::timing::dilated(&ssd, DILATION)?;
    let config = EmuConfig::default().with_backing(Backing::Memory { bytes: 512 << 20 }).with_timing(Some(timing));
    let device = EmuDevice::start(config)?;
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default())?);
    let targets = vec![PoolTarget { controller: Arc::clone(&controller), namespace: NamespaceId(1) }];
    format_pool(&targets, &FormatParams::new(geometry))?;
    let (pool, _) = Pool::open(targets, Some(&geometry))?;
    let object_bytes = geometry.object_bytes() as usize;
    let tensors = (0..2 * geometry.layers)
        .map(|_| controller.dma().allocate(object_bytes * ENGINE_BLOCKS as usize))
        .collect::<Result<Vec<_>, _>>()?;
    let layout = KvLayout::SeparateKv {
        key_bases: tensors.iter().step_by(2).map(DmaRegion::iova).collect(),
        value_bases: tensors.iter().skip(1).step_by(2).map(DmaRegion::iova).collect(),
        block_stride_bytes: geometry.object_bytes(),
    };
    let engine = EnginePool { tensors, object_bytes };
    let registration = KvRegistration::new(geometry, ENGINE_BLOCKS, layout, DataPointerMode::Sgl)?;
    let store_config = StoreConfig::default();
    let executor = cpu_executor_for(&pool, 256, &store_config)?;
    let store = KvStore::new(pool, registration, Arc::clone(controller.dma()), executor, store_config)?;
    let mut runtime_config = RuntimeConfig::new(profile.model().name.clone(), profile.gpu().clone());
    runtime_config.policy = policy;
    // Checked first: `Runtime::new` drops the store when it refuses, and a store is closed (its
    // answer heard) before the engine memory it names is freed.
    if let Err(refused) = Runtime::check(&store, &profile, &runtime_config) {
        return Err(close_after_failure(store, engine, refused.into()));
    }
    // The same checks passed: it does not refuse.
    let mut runtime = Runtime::new(store, profile.clone(), runtime_config)?;

    println!(
        "engine example: Llama-3.1-8B, {BLOCK_TOKENS}-token blocks ({} MiB each), policy {}, CPU executor",
        geometry.block_bytes() >> 20,
        policy.name()
    );
    println!("device: software controller in memory, EMULATED {timing}");
    println!("compute: analytic H100 per-layer times x {DILATION} (the same slow motion as the device)\n");
    println!("{:>4} {:>7} {:>5} {:>9} {:>10} {:>11} {:>7}", "req", "blocks", "hit", "ttft_ms", "bubble_ms", "compute_ms", "queued");
    // Every failure while serving goes through `close_after_failure`: a `?` here would drop the
    // runtime (its store unclosed) and then the engine's KV memory, which a command the device
    // has not ended may still move.
    let served = match serve(&mut runtime, &engine, &profile, requests) {
        Ok(served) => served,
        Err(error) => {
            let (store, _) = runtime.into_store();
            return Err(close_after_failure(store, engine, error));
        }
    };
    let counters = finish(runtime, engine)?;
    let mixed = device.stats().timing.map_or(Duration::ZERO, |timing| timing.mixed_busy);
    println!(
        "\nhit rate {:.1}% of blocks; mean TTFT {:.2} ms; bubble {:.2} ms total ({:.1}% of TTFT); compute {:.2} ms total; every retrieved block verified",
        100.0 * served.hit_blocks as f64 / served.blocks.max(1) as f64,
        served.ttft.as_secs_f64() * 1e3 / f64::from(served.requests.max(1)),
        served.bubble.as_secs_f64() * 1e3,
        100.0 * served.bubble.as_secs_f64() / served.ttft.as_secs_f64().max(f64::MIN_POSITIVE),
        served.compute.as_secs_f64() * 1e3,
    );
    println!(
        "runtime: {} stores committed, {} write layers deferred past their request, {} issues beside the other direction; the device saw reads and writes together for {:.2} ms",
        counters.stores_committed,
        counters.write_layers_deferred,
        counters.mixed_issues,
        mixed.as_secs_f64() * 1e3
    );
    Ok(())
}
