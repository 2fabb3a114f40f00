//! The KV workload: a prompt's KV cache stored and retrieved layer by layer through the object
//! store's layer API (`objstore::KvStore`), on the software controller or a VFIO device, with the
//! CPU executor.
//!
//! Phases, for a prompt of n blocks of which a fraction `hit_rate` (h blocks) is a cached prefix:
//! 1. store: an earlier request populates the cache with the first h blocks, layer by layer;
//! 2. retrieve: the request looks its prefix up (must find h blocks) and reads them into the
//!    engine's KV memory layer by layer; with --verify every byte is compared;
//! 3. store: the request's n − h new blocks are written layer by layer and committed.
//!
//! Each layer is timed from its issue (`store_layer`/`retrieve_layer`) to the end of its `wait`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use gio_uring::{CpuExecutor, SmBudget};
use nvme_driver::{DataPointerMode, DmaAllocator, DmaRegion, NamespaceId};
use objstore::{
    cpu_executor_for, format_pool, FormatParams, KvKind, KvLayout, KvRegistration, KvRequest, KvStore, ModelGeometry, Pool, PoolTarget,
    StoreConfig,
};
use serde_json::{json, Value};

use crate::args::{format_size, Cli, DeviceSpec, Model, OutputFormat};
use crate::devices::{self, CreatedFiles, DeviceError, KvController, OpenOptions2};
use crate::report::{CpuTime, ProcessCpu};
use crate::workloads::{fill_pattern, find_mismatch};
use crate::{usage, UsageError};

/// How long one layer may take before the run fails.
const LAYER_TIMEOUT: Duration = Duration::from_secs(60);
/// Bytes a pool needs beyond its slots' payload: superblock, slot headers, rounding (generous;
/// the slot count after formatting is checked anyway).
const POOL_OVERHEAD_BYTES: u64 = 16 << 20;
const SLOT_OVERHEAD_BYTES: u64 = 64 << 10;

/// What one KV run does.
#[derive(Debug, Clone, Copy)]
pub struct KvPlan {
    pub model: Model,
    pub prompt_tokens: u64,
    pub hit_rate: f64,
    pub block_tokens: u64,
    pub verify: bool,
}

impl KvPlan {
    pub fn from_cli(cli: &Cli) -> Self {
        Self {
            model: cli.model.unwrap_or(crate::args::MODELS[0]),
            prompt_tokens: cli.prompt_tokens,
            hit_rate: cli.hit_rate,
            block_tokens: cli.block_tokens,
            verify: cli.verify,
        }
    }

    fn geometry(&self) -> anyhow::Result<ModelGeometry> {
        let block_tokens =
            u32::try_from(self.block_tokens).map_err(|_| UsageError(format!("--block-tokens={} is too large", self.block_tokens)))?;
        let geometry = ModelGeometry::preset(self.model.name, block_tokens)
            .ok_or_else(|| UsageError(format!("model {} has no object-store preset", self.model.name)))?;
        geometry
            .validate()
            .map_err(|error| UsageError(format!("model {} with --block-tokens={}: {error}", self.model.name, self.block_tokens)))?;
        Ok(geometry)
    }

    /// Full blocks of the prompt (a partial last block is not cached, as in the engines).
    pub fn blocks(&self) -> u64 {
        self.prompt_tokens / self.block_tokens
    }

    pub fn cached_blocks(&self) -> u64 {
        ((self.blocks() as f64) * self.hit_rate).round() as u64
    }

    /// Bytes of each of `devices` pool devices: blocks go round-robin across them (one more slot
    /// each for where the store's round-robin cursor starts).
    pub fn pool_bytes_per_device(&self, devices: usize) -> u64 {
        let block_bytes = self.model.bytes_per_token() * self.block_tokens;
        let blocks = if devices <= 1 { self.blocks() } else { self.blocks().div_ceil(devices as u64) + 1 };
        blocks * (block_bytes + SLOT_OVERHEAD_BYTES) + POOL_OVERHEAD_BYTES
    }
}

/// `--workload=kv` from the command line.
pub fn run(cli: &Cli) -> anyhow::Result<()> {
    let plan = KvPlan::from_cli(cli);
    check_plan(&plan)?;
    crate::run::with_devices(cli, Some(plan.pool_bytes_per_device(1)), |specs, created| run_plan(specs, &plan, cli.output_format, created))
}

fn check_plan(plan: &KvPlan) -> anyhow::Result<()> {
    plan.geometry()?;
    if plan.blocks() == 0 {
        return usage(format!("--prompt-tokens={} is less than one block of --block-tokens={}", plan.prompt_tokens, plan.block_tokens));
    }
    if plan.blocks() > u64::from(u32::MAX / 2) {
        return usage(format!("--prompt-tokens={} makes too many blocks", plan.prompt_tokens));
    }
    Ok(())
}

/// The engine's KV memory: per-layer K and V tensors, each `blocks` objects long.
struct Engine {
    regions: Vec<DmaRegion>,
    object_bytes: usize,
    layers: u32,
}

impl Engine {
    fn allocate(dma: &Arc<dyn DmaAllocator>, geometry: &ModelGeometry, blocks: u32) -> anyhow::Result<(Self, KvLayout)> {
        let object_bytes = geometry.object_bytes() as usize;
        let tensor_bytes = object_bytes.checked_mul(blocks as usize).ok_or_else(|| anyhow!("KV tensor size overflows"))?;
        let regions: Vec<DmaRegion> =
            (0..2 * geometry.layers).map(|_| dma.allocate(tensor_bytes)).collect::<Result<_, _>>().with_context(|| {
                format!("allocating {} of engine KV memory", format_size(tensor_bytes as u64 * 2 * u64::from(geometry.layers)))
            })?;
        let layout = KvLayout::SeparateKv {
            key_bases: regions.iter().step_by(2).map(DmaRegion::iova).collect(),
            value_bases: regions.iter().skip(1).step_by(2).map(DmaRegion::iova).collect(),
            block_stride_bytes: geometry.object_bytes(),
        };
        Ok((Self { regions, object_bytes, layers: geometry.layers }, layout))
    }

    fn tensor(&self, layer: u32, kind: KvKind) -> &DmaRegion {
        &self.regions[2 * layer as usize + usize::from(kind == KvKind::Value)]
    }

    /// A logical offset unique to each byte of each object, so the verify pattern tells apart
    /// layers, K from V, and blocks.
    fn pattern_offset(&self, layer: u32, kind: KvKind, block: u32) -> u64 {
        ((u64::from(layer) * 2 + u64::from(kind == KvKind::Value)) << 40) + u64::from(block) * self.object_bytes as u64
    }

    fn fill(&self, blocks: std::ops::Range<u32>, seed: u64, scratch: &mut [u8]) -> anyhow::Result<()> {
        for layer in 0..self.layers {
            for kind in [KvKind::Key, KvKind::Value] {
                for block in blocks.clone() {
                    fill_pattern(scratch, self.pattern_offset(layer, kind, block), seed);
                    self.tensor(layer, kind).write(block as usize * self.object_bytes, scratch)?;
                }
            }
        }
        Ok(())
    }

    fn clear(&self, blocks: std::ops::Range<u32>) -> anyhow::Result<()> {
        for region in &self.regions {
            let start = blocks.start as usize * self.object_bytes;
            region.fill(start, (blocks.end - blocks.start) as usize * self.object_bytes, 0)?;
        }
        Ok(())
    }

    /// Names the first byte that differs from the pattern, if any.
    fn check(&self, blocks: std::ops::Range<u32>, seed: u64, scratch: &mut [u8]) -> anyhow::Result<Option<String>> {
        for layer in 0..self.layers {
            for kind in [KvKind::Key, KvKind::Value] {
                for block in blocks.clone() {
                    self.tensor(layer, kind).read(block as usize * self.object_bytes, scratch)?;
                    if let Some((byte, expected, actual)) = find_mismatch(scratch, self.pattern_offset(layer, kind, block), seed) {
                        return Ok(Some(format!(
                            "layer {layer} {kind:?} block {block} byte {byte}: expected {expected:#04x}, read {actual:#04x}"
                        )));
                    }
                }
            }
        }
        Ok(None)
    }
}

/// Per-layer measurements of one phase.
struct LayerPhase {
    label: &'static str,
    blocks: u64,
    bytes_per_layer: u64,
    layer_latencies: Vec<Duration>,
    /// Wall time of the phase including prepare and commit.
    wall: Duration,
    cpu: CpuTime,
    verified: Option<u64>,
}

impl LayerPhase {
    fn sorted(&self) -> Vec<Duration> {
        let mut sorted = self.layer_latencies.clone();
        sorted.sort();
        sorted
    }

    fn quantile(sorted: &[Duration], quantile: f64) -> Duration {
        let index = ((sorted.len() as f64 - 1.0) * quantile).round() as usize;
        sorted.get(index).copied().unwrap_or_default()
    }

    fn layer_time(&self) -> Duration {
        self.layer_latencies.iter().sum()
    }

    fn gb_per_second(&self) -> f64 {
        let seconds = self.layer_time().as_secs_f64();
        if seconds > 0.0 {
            (self.bytes_per_layer * self.layer_latencies.len() as u64) as f64 / seconds / 1e9
        } else {
            0.0
        }
    }

    fn text(&self) -> String {
        let sorted = self.sorted();
        let ms = |duration: Duration| duration.as_secs_f64() * 1e3;
        let mut lines = vec![
            format!(
                "{}: {} blocks, {} layers x {} = {}, {:.2} GB/s over the layers' time ({:.3}s), wall {:.3}s with prepare/commit",
                self.label,
                self.blocks,
                self.layer_latencies.len(),
                format_size(self.bytes_per_layer),
                format_size(self.bytes_per_layer * self.layer_latencies.len() as u64),
                self.gb_per_second(),
                self.layer_time().as_secs_f64(),
                self.wall.as_secs_f64()
            ),
            format!(
                "  per-layer latency (ms): min={:.3}, avg={:.3}, max={:.3}, p50={:.3}, p90={:.3}, p99={:.3}",
                ms(sorted.first().copied().unwrap_or_default()),
                ms(self.layer_time()) / self.layer_latencies.len().max(1) as f64,
                ms(sorted.last().copied().unwrap_or_default()),
                ms(Self::quantile(&sorted, 0.5)),
                ms(Self::quantile(&sorted, 0.9)),
                ms(Self::quantile(&sorted, 0.99)),
            ),
        ];
        let per_layer: Vec<String> = self
            .layer_latencies
            .iter()
            .enumerate()
            .map(|(layer, latency)| {
                format!("{layer}:{:.2}ms/{:.2}GB/s", ms(*latency), self.bytes_per_layer as f64 / latency.as_secs_f64().max(1e-9) / 1e9)
            })
            .collect();
        for chunk in per_layer.chunks(6) {
            lines.push(format!("  layers {}", chunk.join("  ")));
        }
        let seconds = self.wall.as_secs_f64().max(1e-9);
        lines.push(format!(
            "  cpu (process): usr={:.2}%, sys={:.2}%",
            100.0 * self.cpu.user.as_secs_f64() / seconds,
            100.0 * self.cpu.system.as_secs_f64() / seconds
        ));
        if let Some(bytes) = self.verified {
            lines.push(format!("  verify: {} compared byte for byte, no mismatch", format_size(bytes)));
        }
        lines.join("\n")
    }

    fn json(&self) -> Value {
        let sorted = self.sorted();
        let ns = |duration: Duration| duration.as_nanos() as u64;
        let seconds = self.wall.as_secs_f64().max(1e-9);
        json!({
            "phase": self.label,
            "blocks": self.blocks,
            "bytes_per_layer": self.bytes_per_layer,
            "io_bytes": self.bytes_per_layer * self.layer_latencies.len() as u64,
            "bw_bytes": (self.gb_per_second() * 1e9).round() as u64,
            "wall_ns": ns(self.wall),
            "lat_ns": {
                "min": ns(sorted.first().copied().unwrap_or_default()),
                "max": ns(sorted.last().copied().unwrap_or_default()),
                "mean": ns(self.layer_time()) as f64 / self.layer_latencies.len().max(1) as f64,
                "percentile": {
                    "50.000000": ns(Self::quantile(&sorted, 0.5)),
                    "90.000000": ns(Self::quantile(&sorted, 0.9)),
                    "99.000000": ns(Self::quantile(&sorted, 0.99)),
                },
            },
            "layers": self.layer_latencies.iter().enumerate().map(|(layer, latency)| json!({"layer": layer, "lat_ns": ns(*latency), "bw_bytes": (self.bytes_per_layer as f64 / latency.as_secs_f64().max(1e-9)).round() as u64})).collect::<Vec<_>>(),
            "usr_cpu": 100.0 * self.cpu.user.as_secs_f64() / seconds,
            "sys_cpu": 100.0 * self.cpu.system.as_secs_f64() / seconds,
            "verified_bytes": self.verified,
        })
    }
}

/// Runs a plan on one pool over `specs` (created files are registered in `created`).
pub fn run_plan(specs: &[DeviceSpec], plan: &KvPlan, output: OutputFormat, created: &mut CreatedFiles) -> anyhow::Result<()> {
    let geometry = plan.geometry()?;
    let options = OpenOptions2 {
        writes: true,
        create_bytes: Some(plan.pool_bytes_per_device(specs.len())),
        io_bytes_max: 2 * geometry.object_bytes(),
        queues: 4,
        lay_out: false,
    };
    let listed = specs.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
    let devices = devices::open_controllers(specs, options, created).map_err(|error| match error {
        DeviceError::Setup(message) => UsageError(message).into(),
        error => anyhow::Error::new(error).context(format!("opening {listed}")),
    })?;
    let rig = Rig::build(&devices, &geometry, plan)?;
    let config = json!({
        "workload": "kv",
        "model": plan.model.name,
        "geometry": geometry.to_string(),
        "prompt_tokens": plan.prompt_tokens,
        "block_tokens": plan.block_tokens,
        "blocks": plan.blocks(),
        "cached_blocks": plan.cached_blocks(),
        "hit_rate": plan.hit_rate,
        "kv_bytes": plan.blocks() * geometry.block_bytes(),
        "verify": plan.verify,
        "executor": "cpu",
        "device": listed,
        "device_description": devices.iter().map(|device| device.description.as_str()).collect::<Vec<_>>().join("; "),
        "pool_slots": rig.slots,
    });
    if output == OutputFormat::Normal {
        println!(
            "tutti-bench: workload=kv model={} ({}) prompt={} tokens = {} blocks ({} of KV), hit-rate={} ({} cached blocks), verify={}, executor=cpu",
            plan.model.name,
            geometry,
            plan.prompt_tokens,
            plan.blocks(),
            format_size(plan.blocks() * geometry.block_bytes()),
            plan.hit_rate,
            plan.cached_blocks(),
            plan.verify
        );
        for (spec, device) in specs.iter().zip(&devices) {
            println!("  device {spec}: {}", device.description);
        }
        println!("  pool of {} slots (1 block per slot) over {} device(s), blocks round-robin", rig.slots, devices.len());
    }
    let phases = rig.run(plan)?;
    match output {
        OutputFormat::Normal => {
            for phase in &phases {
                println!("{}", phase.text());
            }
        }
        OutputFormat::Json => {
            let out = json!({
                "tutti-bench version": env!("CARGO_PKG_VERSION"),
                "workload": "kv",
                "global options": config,
                "phases": phases.iter().map(LayerPhase::json).collect::<Vec<_>>(),
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
    }
    Ok(())
}

/// Everything a run needs, in drop order: the store (its queue pairs) before the engine memory
/// and the controller.
struct Rig {
    store: KvStore<CpuExecutor>,
    engine: Engine,
    slots: u64,
    tokens: Vec<u32>,
    seed: u64,
}

impl Rig {
    fn build(devices: &[KvController], geometry: &ModelGeometry, plan: &KvPlan) -> anyhow::Result<Self> {
        let blocks = u32::try_from(plan.blocks()).map_err(|_| anyhow!("too many blocks"))?;
        let targets: Vec<PoolTarget> =
            devices.iter().map(|device| PoolTarget { controller: Arc::clone(&device.controller), namespace: NamespaceId(1) }).collect();
        let params = FormatParams { geometry: *geometry, blocks_per_slot: 1, slot_count_max: None, pool_uuid: None, payload_crc: false };
        format_pool(&targets, &params).context("formatting the pool")?;
        let (pool, report) = Pool::open(targets, Some(geometry)).context("opening the pool")?;
        if report.slots < plan.blocks() {
            let tokens = report.slots * plan.block_tokens;
            return usage(format!(
                "--prompt-tokens={} needs {} slots of {}; the pool's {} device(s) hold {}; accepted: up to {tokens} tokens on them",
                plan.prompt_tokens,
                plan.blocks(),
                format_size(geometry.block_bytes()),
                devices.len(),
                report.slots
            ));
        }
        // One DMA space for all pool devices (open_controllers): the first one's allocator.
        let dma = Arc::clone(devices[0].controller.dma());
        let (engine, layout) = Engine::allocate(&dma, geometry, blocks)?;
        let sgl = devices.iter().all(|device| device.controller.data_pointer_mode() == DataPointerMode::Sgl);
        let mode = if sgl { DataPointerMode::Sgl } else { DataPointerMode::Prp };
        let registration = KvRegistration::new(*geometry, blocks, layout, mode).context("registering the engine's KV memory")?;
        let config = StoreConfig::default();
        let executor = cpu_executor_for(&pool, 1024, &config).context("creating the CPU executor")?;
        let store = KvStore::new(pool, registration, dma, executor, config).context("building the KV store")?;
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |elapsed| elapsed.as_nanos() as u64);
        let mut state = seed;
        let tokens = (0..plan.blocks() * plan.block_tokens)
            .map(|_| {
                state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                (state >> 33) as u32
            })
            .collect();
        Ok(Self { store, engine, slots: report.slots, tokens, seed })
    }

    fn run(mut self, plan: &KvPlan) -> anyhow::Result<Vec<LayerPhase>> {
        let blocks = plan.blocks() as u32;
        let cached = plan.cached_blocks() as u32;
        let block_tokens = plan.block_tokens as usize;
        let ids: Vec<u32> = (0..blocks).collect();
        let tokens = std::mem::take(&mut self.tokens);
        let mut scratch = vec![0u8; self.engine.object_bytes];
        let mut phases = Vec::new();
        self.engine.fill(0..blocks, self.seed, &mut scratch)?;
        if cached > 0 {
            let request = KvRequest { tokens: &tokens[..cached as usize * block_tokens], block_ids: &ids[..cached as usize] };
            phases.push(self.store_phase("store (populate: the cached prefix, written by an earlier request)", &request)?);
        }
        if cached > 0 {
            let found = self.store.lookup(&tokens);
            if found != cached as usize {
                return Err(anyhow!("lookup found {found} cached blocks of the prompt, expected {cached}"));
            }
            if plan.verify {
                self.engine.clear(0..cached)?;
            }
            let cpu_before = ProcessCpu::now();
            let started = Instant::now();
            let request = KvRequest { tokens: &tokens[..cached as usize * block_tokens], block_ids: &ids[..cached as usize] };
            let handle = self.store.prepare_retrieve(&request).context("prepare_retrieve")?;
            let mut latencies = Vec::with_capacity(self.engine.layers as usize);
            for layer in 0..self.engine.layers {
                let issued = Instant::now();
                self.store.retrieve_layer(handle, layer, SmBudget(1)).with_context(|| format!("retrieve_layer {layer}"))?;
                self.store.wait(handle, Instant::now() + LAYER_TIMEOUT).with_context(|| format!("waiting for retrieved layer {layer}"))?;
                latencies.push(issued.elapsed());
            }
            self.store.finish(handle).context("finishing the retrieve")?;
            let wall = started.elapsed();
            let cpu = ProcessCpu::now().since(&cpu_before);
            let verified = if plan.verify {
                if let Some(mismatch) = self.engine.check(0..cached, self.seed, &mut scratch)? {
                    return Err(anyhow!("verify failed after retrieve: {mismatch}"));
                }
                Some(u64::from(cached) * 2 * u64::from(self.engine.layers) * self.engine.object_bytes as u64)
            } else {
                None
            };
            phases.push(LayerPhase {
                label: "retrieve (the request's cached prefix, read into the engine's KV memory)",
                blocks: u64::from(cached),
                bytes_per_layer: u64::from(cached) * 2 * self.engine.object_bytes as u64,
                layer_latencies: latencies,
                wall,
                cpu,
                verified,
            });
        }
        if cached < blocks {
            let request = KvRequest { tokens: &tokens, block_ids: &ids };
            phases.push(self.store_phase("store (the request's new blocks after prefill)", &request)?);
        }
        Ok(phases)
    }

    fn store_phase(&mut self, label: &'static str, request: &KvRequest<'_>) -> anyhow::Result<LayerPhase> {
        let cpu_before = ProcessCpu::now();
        let started = Instant::now();
        let plan = self.store.prepare_store(request).context("prepare_store")?;
        let mut latencies = Vec::with_capacity(self.engine.layers as usize);
        for layer in 0..self.engine.layers {
            let issued = Instant::now();
            self.store.store_layer(plan.handle, layer, SmBudget(1)).with_context(|| format!("store_layer {layer}"))?;
            self.store.wait(plan.handle, Instant::now() + LAYER_TIMEOUT).with_context(|| format!("waiting for stored layer {layer}"))?;
            latencies.push(issued.elapsed());
        }
        self.store.commit_store(plan.handle).context("commit_store")?;
        Ok(LayerPhase {
            label,
            blocks: plan.new_blocks as u64,
            bytes_per_layer: plan.new_blocks as u64 * 2 * self.engine.object_bytes as u64,
            layer_latencies: latencies,
            wall: started.elapsed(),
            cpu: ProcessCpu::now().since(&cpu_before),
            verified: None,
        })
    }
}
