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
//!
//! Pools are formatted with payload CRCs on, unless the run keeps the pool on the devices
//! (`--keep-pool`) or only checks it (`--retrieve-only`: lookup of the whole prompt, retrieve,
//! compare; no store). Tokens and data derive from `--seed` alone, so a later run with the same
//! seed, model and prompt knows every byte the earlier one stored.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use gio_uring::{CpuExecutor, SmBudget};
use nvme_driver::{DataPointerMode, DmaAllocator, DmaRegion, NamespaceId};
use objstore::{
    cpu_executor_for, format_pool, FormatParams, KvKind, KvLayout, KvRegistration, KvRequest, KvStore, MappingForm, ModelGeometry,
    ObjstoreError, Pool, PoolTarget, StoreConfig,
};
use serde_json::{json, Value};
use tutti_cli::{outln, ModelChoice};

use crate::args::{format_size, Cli, DeviceSpec, OutputFormat};
use crate::devices::{self, CreatedFiles, DeviceError, KvController, OpenOptions2};
use crate::report::{CpuTime, ProcessCpu};
use crate::workloads::{fill_pattern, find_mismatch};
use crate::{usage, Unusable};

/// How long one layer may take before the run fails.
const LAYER_TIMEOUT: Duration = Duration::from_secs(60);
/// Bytes a pool needs beyond its slots' payload: superblock, slot headers, rounding (generous;
/// the slot count after formatting is checked anyway).
pub(crate) const POOL_OVERHEAD_BYTES: u64 = 16 << 20;
pub(crate) const SLOT_OVERHEAD_BYTES: u64 = 64 << 10;

/// What a run does with the pool on its devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// Format a fresh pool (payload CRCs on), then store and retrieve.
    Format,
    /// Open the pool the devices hold, then store and retrieve (blocks already there are found).
    Keep,
    /// Open the pool the devices hold, look the whole prompt up, retrieve and compare; no store.
    RetrieveOnly,
}

impl PoolMode {
    fn name(self) -> &'static str {
        match self {
            PoolMode::Format => "format",
            PoolMode::Keep => "keep",
            PoolMode::RetrieveOnly => "retrieve-only",
        }
    }
}

/// What one KV run does.
#[derive(Debug, Clone)]
pub struct KvPlan {
    pub model: ModelChoice,
    pub prompt_tokens: u64,
    pub hit_rate: f64,
    pub verify: bool,
    pub pool: PoolMode,
    /// Seed of the tokens and the data pattern.
    pub seed: u64,
    /// The software controller's timing model.
    pub emu_timing: Option<nvme_emu::TimingModel>,
}

impl KvPlan {
    pub fn from_cli(cli: &Cli) -> anyhow::Result<Self> {
        let model = cli.geometry.resolve(Some(tutti_cli::geometry::DEFAULT_MODEL)).map_err(|error| Unusable(error.to_string()))?;
        let pool = match (cli.retrieve_only, cli.keep_pool) {
            (true, _) => PoolMode::RetrieveOnly,
            (false, true) => PoolMode::Keep,
            (false, false) => PoolMode::Format,
        };
        Ok(Self {
            model,
            prompt_tokens: cli.prompt_tokens,
            hit_rate: if pool == PoolMode::RetrieveOnly { 1.0 } else { cli.hit_rate },
            verify: cli.verify || pool == PoolMode::RetrieveOnly,
            pool,
            seed: cli.seed,
            emu_timing: cli.emu_timing,
        })
    }

    pub fn geometry(&self) -> ModelGeometry {
        self.model.geometry
    }

    pub fn block_tokens(&self) -> u64 {
        u64::from(self.model.geometry.block_tokens)
    }

    /// Full blocks of the prompt (a partial last block is not cached, as in the engines).
    pub fn blocks(&self) -> u64 {
        self.prompt_tokens / self.block_tokens()
    }

    pub fn cached_blocks(&self) -> u64 {
        ((self.blocks() as f64) * self.hit_rate).round() as u64
    }

    /// Bytes of each of `devices` pool devices: blocks go round-robin across them (one more slot
    /// each for where the store's round-robin cursor starts).
    pub fn pool_bytes_per_device(&self, devices: usize) -> u64 {
        let block_bytes = self.geometry().block_bytes();
        let blocks = if devices <= 1 { self.blocks() } else { self.blocks().div_ceil(devices as u64) + 1 };
        blocks.saturating_mul(block_bytes + SLOT_OVERHEAD_BYTES).saturating_add(POOL_OVERHEAD_BYTES)
    }
}

/// `--workload=kv` from the command line.
pub fn run(cli: &Cli) -> anyhow::Result<()> {
    let plan = KvPlan::from_cli(cli)?;
    check_plan(&plan)?;
    if plan.pool != PoolMode::Format {
        let flag = if plan.pool == PoolMode::Keep { "--keep-pool" } else { "--retrieve-only" };
        if cli.devices.is_empty() {
            return usage(format!(
                "{flag} uses the pool an earlier run left on its devices: name them with --device (e.g. emu:PATH, vfio:BDF)"
            ));
        }
        for spec in &cli.devices {
            match spec {
                DeviceSpec::EmuFile(path) if !path.exists() => {
                    return usage(format!("{spec}: {} does not exist; {flag} needs the pool an earlier run stored there", path.display()))
                }
                DeviceSpec::EmuMemory(_) => {
                    return usage(format!("{spec} starts empty: {flag} needs devices that hold a pool (emu:PATH, vfio:BDF)"))
                }
                _ => {}
            }
        }
    }
    let create_bytes = (plan.pool == PoolMode::Format).then(|| plan.pool_bytes_per_device(1));
    crate::run::with_devices(cli, create_bytes, |specs, created| run_plan(specs, &plan, cli.output_format, created))
}

fn check_plan(plan: &KvPlan) -> anyhow::Result<()> {
    if plan.blocks() == 0 {
        return usage(format!(
            "--prompt-tokens={} is less than one block of --tokens-per-block={}",
            plan.prompt_tokens,
            plan.block_tokens()
        ));
    }
    if plan.blocks() > u64::from(u32::MAX / 2) {
        return usage(format!("--prompt-tokens={} makes too many blocks", plan.prompt_tokens));
    }
    Ok(())
}

/// The engine's KV memory: per-layer K and V tensors, each `blocks` objects long.
pub(crate) struct Engine {
    regions: Vec<DmaRegion>,
    object_bytes: usize,
    layers: u32,
}

impl Engine {
    pub(crate) fn allocate(dma: &Arc<dyn DmaAllocator>, geometry: &ModelGeometry, blocks: u32) -> anyhow::Result<(Self, KvLayout)> {
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

/// The prompt's tokens: a function of `seed` alone, so a later run finds what an earlier one
/// stored (an LCG; only its determinism and spread matter).
fn prompt_tokens(seed: u64, count: u64) -> Vec<u32> {
    let mut state = seed;
    (0..count)
        .map(|_| {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as u32
        })
        .collect()
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
    let geometry = plan.geometry();
    let options = OpenOptions2 {
        writes: true,
        create_bytes: (plan.pool == PoolMode::Format).then(|| plan.pool_bytes_per_device(specs.len())),
        io_bytes_max: 2 * geometry.object_bytes(),
        queues: 4,
        lay_out: false,
        timing: plan.emu_timing,
    };
    let listed = specs.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
    let devices = devices::open_controllers(specs, options, created).map_err(|error| match error {
        DeviceError::Setup(message) => Unusable(message).into(),
        DeviceError::Spec(error) => Unusable(error.to_string()).into(),
        error => anyhow::Error::new(error).context(format!("opening {listed}")),
    })?;
    let rig = Rig::build(&devices, &geometry, plan)?;
    let mapping = rig.store.table();
    let mapping_bytes = mapping.memory_bytes();
    let config = json!({
        "workload": "kv",
        "model": plan.model.name,
        "geometry": geometry.to_string(),
        "layers": geometry.layers,
        "kv_heads": geometry.kv_heads,
        "head_dim": geometry.head_dim,
        "dtype_bytes": geometry.dtype_bytes,
        "tokens_per_block": geometry.block_tokens,
        "prompt_tokens": plan.prompt_tokens,
        "block_tokens": geometry.block_tokens,
        "blocks": plan.blocks(),
        "cached_blocks": plan.cached_blocks(),
        "hit_rate": plan.hit_rate,
        "kv_bytes": plan.blocks() * geometry.block_bytes(),
        "verify": plan.verify,
        "pool_mode": plan.pool.name(),
        "seed": plan.seed,
        "executor": "cpu",
        "device": listed,
        "device_description": devices.iter().map(|device| device.description.as_str()).collect::<Vec<_>>().join("; "),
        "emu_timing": devices::timing_json(plan.emu_timing),
        "pool_slots": rig.slots,
        "pool_valid_slots_at_open": rig.valid_slots_at_open,
        "payload_crc": rig.payload_crc,
        "mapping_table": {
            "form": mapping_form_name(mapping.form()),
            "bytes": mapping_bytes,
            "engine_blocks": plan.blocks(),
        },
    });
    if output == OutputFormat::Normal {
        outln!(
            "tutti-bench: workload=kv model={} ({}) prompt={} tokens = {} blocks ({} of KV), hit-rate={} ({} cached blocks), verify={}, pool={}, seed={}, executor=cpu",
            plan.model.name,
            geometry,
            plan.prompt_tokens,
            plan.blocks(),
            format_size(plan.blocks() * geometry.block_bytes()),
            plan.hit_rate,
            plan.cached_blocks(),
            plan.verify,
            plan.pool.name(),
            plan.seed
        )?;
        for (spec, device) in specs.iter().zip(&devices) {
            outln!("  device {spec}: {}", device.description)?;
        }
        outln!(
            "  pool of {} slots (1 block per slot) over {} device(s), blocks round-robin, payload CRC {}{}",
            rig.slots,
            devices.len(),
            if rig.payload_crc { "on" } else { "off" },
            match plan.pool {
                PoolMode::Format => ", formatted for this run".to_string(),
                _ => format!(", kept: {} valid slots found at open", rig.valid_slots_at_open),
            }
        )?;
        outln!(
            "  mapping table: {} of {} for {} engine blocks ({}), built once at registration",
            format_size(mapping_bytes),
            mapping_form_name(mapping.form()),
            plan.blocks(),
            format_size(plan.blocks() * geometry.block_bytes())
        )?;
    }
    let phases = rig.run(plan)?;
    match output {
        OutputFormat::Normal => {
            for phase in &phases {
                outln!("{}", phase.text())?;
            }
        }
        OutputFormat::Json => {
            let out = json!({
                "tutti-bench version": env!("CARGO_PKG_VERSION"),
                "workload": "kv",
                "global options": config,
                "phases": phases.iter().map(LayerPhase::json).collect::<Vec<_>>(),
            });
            outln!("{}", serde_json::to_string_pretty(&out)?)?;
        }
    }
    Ok(())
}

fn mapping_form_name(form: MappingForm) -> &'static str {
    match form {
        MappingForm::Collapsed => "base + strides (collapsed: no per-object entries)",
        MappingForm::StridedPair => "PRP lists at a fixed layer stride",
        MappingForm::SglTable => "16-byte SGL descriptors",
    }
}

/// Words (and an exit status) for a pool the devices hold that this run cannot use.
fn pool_open_error(error: ObjstoreError, plan: &KvPlan) -> anyhow::Error {
    match error {
        ObjstoreError::GeometryMismatch { on_disk, registered } => Unusable(format!(
            "the pool on the devices was formatted for {on_disk}; this run asks for {registered} ({}): give the model options of the run that stored it",
            plan.model.name
        ))
        .into(),
        error @ (ObjstoreError::PoolMembership { .. }
        | ObjstoreError::NewerFormatVersion { .. }
        | ObjstoreError::OlderFormatVersion { .. }) => Unusable(format!("the devices do not hold one usable pool: {error}")).into(),
        error => anyhow::Error::new(error).context("opening the pool on the devices (it is damaged or was never formatted)"),
    }
}

/// Everything a run needs, in drop order: the store (its queue pairs) before the engine memory
/// and the controller.
struct Rig {
    store: KvStore<CpuExecutor>,
    engine: Engine,
    slots: u64,
    valid_slots_at_open: u64,
    payload_crc: bool,
    tokens: Vec<u32>,
    seed: u64,
}

impl Rig {
    fn build(devices: &[KvController], geometry: &ModelGeometry, plan: &KvPlan) -> anyhow::Result<Self> {
        let blocks = u32::try_from(plan.blocks()).map_err(|_| anyhow!("too many blocks"))?;
        let targets: Vec<PoolTarget> =
            devices.iter().map(|device| PoolTarget { controller: Arc::clone(&device.controller), namespace: NamespaceId(1) }).collect();
        if plan.pool == PoolMode::Format {
            // Payload CRCs on: `tutti pool check --payload` can verify what a bench run left.
            let params = FormatParams { geometry: *geometry, blocks_per_slot: 1, slot_count_max: None, pool_uuid: None, payload_crc: true };
            format_pool(&targets, &params).map_err(|error| match error {
                error @ (ObjstoreError::NamespaceTooSmall { .. } | ObjstoreError::InvalidFormat { .. }) => {
                    Unusable(format!("cannot format a pool on {}: {error}", plan.model.name)).into()
                }
                error => anyhow::Error::new(error).context("formatting the pool"),
            })?;
        }
        let (pool, report) = Pool::open(targets, Some(geometry)).map_err(|error| pool_open_error(error, plan))?;
        let payload_crc = pool.superblock(0).flags & objstore::format::FLAG_PAYLOAD_CRC != 0;
        if report.slots < plan.blocks() {
            let tokens = report.slots * plan.block_tokens();
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
        Ok(Self {
            store,
            engine,
            slots: report.slots,
            valid_slots_at_open: report.valid_slots,
            payload_crc,
            tokens: prompt_tokens(plan.seed, plan.blocks() * plan.block_tokens()),
            seed: plan.seed,
        })
    }

    fn run(mut self, plan: &KvPlan) -> anyhow::Result<Vec<LayerPhase>> {
        let blocks = plan.blocks() as u32;
        let cached = plan.cached_blocks() as u32;
        let block_tokens = plan.block_tokens() as usize;
        let ids: Vec<u32> = (0..blocks).collect();
        let tokens = std::mem::take(&mut self.tokens);
        let mut scratch = vec![0u8; self.engine.object_bytes];
        let mut phases = Vec::new();
        if plan.pool != PoolMode::RetrieveOnly {
            self.engine.fill(0..blocks, self.seed, &mut scratch)?;
        }
        if cached > 0 && plan.pool != PoolMode::RetrieveOnly {
            let request = KvRequest { tokens: &tokens[..cached as usize * block_tokens], block_ids: &ids[..cached as usize] };
            phases.push(self.store_phase("store (populate: the cached prefix, written by an earlier request)", &request)?);
        }
        if cached > 0 {
            let found = self.store.lookup(&tokens);
            match plan.pool {
                PoolMode::RetrieveOnly if found < cached as usize => {
                    return Err(anyhow!(
                        "the pool holds {found} of the prompt's {cached} blocks (lookup stops at the first block it lacks): blocks were lost, \
                         or the run that stored them used another --seed, model or --prompt-tokens"
                    ));
                }
                // A kept pool may hold more of the prompt than this run's hit rate (an earlier run
                // with the same seed stored it); the retrieve below moves the first `cached` blocks.
                PoolMode::Keep if found >= cached as usize => {}
                _ if found != cached as usize => {
                    return Err(anyhow!("lookup found {found} cached blocks of the prompt, expected {cached}"));
                }
                _ => {}
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
                    return Err(anyhow!("verify failed after retrieve (pattern of --seed={}): {mismatch}", self.seed));
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
        if cached < blocks && plan.pool != PoolMode::RetrieveOnly {
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
