//! An inference engine in miniature: the template for integrating tutti.
//!
//! `cargo run --release --example engine -- [REQUESTS] [COMPUTE_SCALE]`
//!
//! It registers a paged KV pool (Llama-3.1-8B geometry, 16-token blocks, K and V as separate
//! per-layer tensors), then serves a stream of chat turns from a few sessions that share a system
//! prompt. For each request it
//! 1. looks up the longest cached prefix (`lookup`),
//! 2. prepares the retrieve of those blocks into free engine blocks (`prepare_retrieve`: all
//!    per-block work, once),
//! 3. runs prefill layer by layer: the retrieve of layer l+1 is issued before layer l "computes"
//!    (for the time an analytic H100 profile table gives for this prompt and prefix length), and
//!    any wait for a layer's KV is counted as bubble,
//! 4. checks the retrieved bytes, then stores the request's new blocks layer by layer after
//!    prefill (Tutti defers writes out of the prefill critical path) and commits them.
//!
//! It prints hit rate, TTFT and bubble per request and in total.
//!
//! Honest scope: the device is the software NVMe controller in memory and the executor is the
//! CPU one, so I/O runs at this machine's memory-copy speed through an emulated controller, while
//! compute times are an H100 roofline estimate (scaled by COMPUTE_SCALE). The mechanics — what to
//! call when — are the real ones; the ratio of bubble to compute is not an H100's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::SmBudget;
use nvme_driver::hw::DeviceBackend;
use nvme_driver::{Controller, ControllerConfig, DataPointerMode, DmaRegion, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice};
use objstore::{
    cpu_executor_for, format_pool, FormatParams, KvLayout, KvRegistration, KvRequest, KvStore, ModelGeometry, Pool, PoolTarget, StoreConfig,
};
use scheduler::analytic::{build_table, AnalyticGrid, GpuSpec, ModelConfig};
use scheduler::ssd::SsdModel;
use scheduler::table::Profile;

const BLOCK_TOKENS: u32 = 16;
const ENGINE_BLOCKS: u32 = 64;
const SESSIONS: u32 = 4;
const SYSTEM_PROMPT_BLOCKS: u32 = 8;
const NEW_BLOCKS_PER_TURN: u32 = 4;

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

    /// "Computes" block `block` of `tokens` into engine block `engine_block` for every layer.
    fn compute_block(&self, geometry: &ModelGeometry, tokens: &[u32], block: u32, engine_block: u32) -> Result<(), Failure> {
        for layer in 0..geometry.layers {
            for value in [false, true] {
                let byte = kv_byte(tokens, block, layer, value);
                self.tensor(layer, value).fill(engine_block as usize * self.object_bytes, self.object_bytes, byte)?;
            }
        }
        Ok(())
    }

    /// Checks that engine block `engine_block` holds block `block` of `tokens` (first and last
    /// 256 bytes of every object).
    fn check_block(&self, geometry: &ModelGeometry, tokens: &[u32], block: u32, engine_block: u32) -> Result<(), Failure> {
        let mut sample = [0u8; 256];
        for layer in 0..geometry.layers {
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

/// Busy-waits `duration`: a stand-in for the GPU running a layer's kernels.
fn compute_for(duration: Duration) {
    let started = Instant::now();
    while started.elapsed() < duration {
        std::hint::spin_loop();
    }
}

fn main() -> Result<(), Failure> {
    let mut args = std::env::args().skip(1);
    let requests: u32 = args.next().map_or(Ok(16), |arg| arg.parse())?;
    let compute_scale: f64 = args.next().map_or(Ok(1.0), |arg| arg.parse())?;
    let geometry = ModelGeometry::llama3_8b(BLOCK_TOKENS);
    let deadline = || Instant::now() + Duration::from_secs(30);

    // Profile table: per-layer compute time of Llama-3.1-8B on an H100 (roofline estimate).
    let grid = AnalyticGrid { input_step_tokens: 64, input_step_count: 32, prefix_step_tokens: 64, io_sms: 4, decode_step_tokens: 256 };
    let io_costs = SsdModel::tutti_two_ssds().cost_table(8 << 20, 16, &[grid.io_sms])?;
    let table = build_table(&ModelConfig::llama3_8b(), &GpuSpec::h100(), &grid, io_costs, "analytic (not measured)")?;
    let profile = Profile::from_table(table)?;

    // Device, pool and the engine's KV memory (registered once).
    let device = EmuDevice::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 512 << 20 }))?;
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default())?);
    let targets = vec![PoolTarget { controller: Arc::clone(&controller), namespace: NamespaceId(1) }];
    format_pool(&targets, &FormatParams { geometry, blocks_per_slot: 1, slot_count_max: None, pool_uuid: None, payload_crc: false })?;
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
    let mut store = KvStore::new(pool, registration, Arc::clone(controller.dma()), executor, store_config)?;

    println!(
        "engine example: Llama-3.1-8B, {BLOCK_TOKENS}-token blocks ({} MiB each), software controller in memory, CPU executor",
        geometry.block_bytes() >> 20
    );
    println!("compute: analytic H100 per-layer times x {compute_scale}; I/O: this machine\n");
    println!("{:>4} {:>8} {:>8} {:>10} {:>10} {:>10} {:>10}", "req", "blocks", "hit", "ttft_ms", "bubble_ms", "compute_ms", "store_ms");
    let (mut hit_blocks_total, mut blocks_total) = (0u64, 0u64);
    let (mut ttft_total, mut bubble_total, mut compute_total) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for request in 0..requests {
        let (session, turn) = (request % SESSIONS, request / SESSIONS);
        let tokens = prompt(session, turn);
        let blocks = tokens.len() as u32 / BLOCK_TOKENS;
        if blocks > ENGINE_BLOCKS {
            println!("stopping: the next prompt ({blocks} blocks) exceeds the engine pool of {ENGINE_BLOCKS} blocks");
            break;
        }
        let engine_blocks: Vec<u32> = (0..blocks).collect();
        let started = Instant::now();
        let hit = store.lookup(&tokens) as u32;
        let layer_profiles = &profile.bucket(tokens.len() as u32, hit * BLOCK_TOKENS)?.layers;
        let retrieve = if hit > 0 {
            let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &engine_blocks[..hit as usize] })?;
            store.retrieve_layer(handle, 0, SmBudget(4))?;
            Some(handle)
        } else {
            None
        };
        let (mut bubble, mut compute) = (Duration::ZERO, Duration::ZERO);
        for layer in 0..geometry.layers {
            if let Some(handle) = retrieve {
                // The layer's KV must be resident before its attention runs.
                let waited = Instant::now();
                store.wait(handle, deadline())?;
                bubble += waited.elapsed();
                if layer + 1 < geometry.layers {
                    store.retrieve_layer(handle, layer + 1, SmBudget(4))?;
                }
            }
            let layer_compute = Duration::from_secs_f64(layer_profiles[layer as usize].compute_duration_us * compute_scale / 1e6);
            compute_for(layer_compute);
            compute += layer_compute;
        }
        let ttft = started.elapsed();
        if let Some(handle) = retrieve {
            store.finish(handle)?;
        }
        for block in 0..hit {
            engine.check_block(&geometry, &tokens, block, engine_blocks[block as usize])?;
        }
        // Prefill produced the KV of the uncached blocks; store them (shared blocks are skipped).
        for block in hit..blocks {
            engine.compute_block(&geometry, &tokens, block, engine_blocks[block as usize])?;
        }
        let store_started = Instant::now();
        let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &engine_blocks })?;
        for layer in 0..geometry.layers {
            store.store_layer(plan.handle, layer, SmBudget(4))?;
            store.wait(plan.handle, deadline())?;
        }
        store.commit_store(plan.handle)?;
        let store_time = store_started.elapsed();
        println!(
            "{request:>4} {blocks:>8} {hit:>8} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
            ttft.as_secs_f64() * 1e3,
            bubble.as_secs_f64() * 1e3,
            compute.as_secs_f64() * 1e3,
            store_time.as_secs_f64() * 1e3
        );
        hit_blocks_total += u64::from(hit);
        blocks_total += u64::from(blocks);
        ttft_total += ttft;
        bubble_total += bubble;
        compute_total += compute;
    }
    let served = requests.max(1);
    println!(
        "\nhit rate {:.1}% of blocks; mean TTFT {:.2} ms; bubble {:.2} ms total ({:.1}% of TTFT); compute {:.2} ms total; every retrieved block verified",
        100.0 * hit_blocks_total as f64 / blocks_total.max(1) as f64,
        ttft_total.as_secs_f64() * 1e3 / f64::from(served),
        bubble_total.as_secs_f64() * 1e3,
        100.0 * bubble_total.as_secs_f64() / ttft_total.as_secs_f64().max(f64::MIN_POSITIVE),
        compute_total.as_secs_f64() * 1e3,
    );
    Ok(())
}
