//! The KV workload: a prompt's KV cache stored and retrieved layer by layer through the object
//! store's layer API (`objstore::KvStore`), on the software controller or a VFIO device, with the
//! CPU executor.
//!
//! The phases themselves are `kv_workload.rs`'s, shared with `--attach` (attach.rs).
//!
//! Pools are formatted with payload CRCs on, unless the run keeps the pool on the devices
//! (`--keep-pool`) or only checks it (`--retrieve-only`: lookup of the whole prompt, retrieve,
//! compare; no store). Tokens and data derive from `--seed` alone, so a later run with the same
//! seed, model and prompt knows every byte the earlier one stored.

use std::sync::Arc;

use anyhow::{anyhow, Context};
use gio_uring::CpuExecutor;
use nvme_driver::{DataPointerMode, DmaAllocator, DmaRegion, NamespaceId};
use objstore::{
    cpu_executor_for, format_pool, FormatParams, KvKind, KvLayout, KvRegistration, KvStore, MappingForm, ModelGeometry, ObjstoreError,
    Pool, PoolTarget, StoreConfig,
};
use serde_json::json;
use tutti_cli::{outln, ModelChoice};

use crate::args::{format_size, Cli, DeviceSpec, OutputFormat};
use crate::devices::{self, CreatedFiles, KvController, OpenOptions2};
use crate::kv_workload::{json_report, run_phases, KvTarget, LayerPhase};
use crate::{usage, Unusable};

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
    /// Layers of a request kept in flight by the in-process store (`--layers-in-flight`).
    pub layers_in_flight: u32,
    /// Engine blocks per slot of a pool this run formats (`--blocks-per-slot`).
    pub blocks_per_slot: u32,
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
            layers_in_flight: cli.layers_in_flight,
            blocks_per_slot: cli.blocks_per_slot,
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

    /// Slots of `blocks_per_slot` blocks the run fills: the cached prefix and the rest of the
    /// prompt are two stores, and a store never fills the slot another one left partly empty,
    /// so each rounds up to whole slots.
    pub fn slots_needed(&self, blocks_per_slot: u64) -> u64 {
        let k = blocks_per_slot.max(1);
        let cached = self.cached_blocks().min(self.blocks());
        cached.div_ceil(k) + (self.blocks() - cached).div_ceil(k)
    }

    /// Bytes of each of `devices` pool devices: slots of `blocks_per_slot` blocks
    /// ([`KvPlan::slots_needed`]) go round-robin across them (one more slot each for where the
    /// store's round-robin cursor starts).
    pub fn pool_bytes_per_device(&self, devices: usize) -> u64 {
        let k = u64::from(self.blocks_per_slot.max(1));
        let slot_bytes = self.geometry().block_bytes().saturating_mul(k).saturating_add(SLOT_OVERHEAD_BYTES);
        let slots = self.slots_needed(k);
        let slots = if devices <= 1 { slots } else { slots.div_ceil(devices as u64) + 1 };
        slots.saturating_mul(slot_bytes).saturating_add(POOL_OVERHEAD_BYTES)
    }
}

/// `--workload=kv` from the command line.
pub fn run(cli: &Cli) -> anyhow::Result<()> {
    let plan = KvPlan::from_cli(cli)?;
    check_plan(&plan)?;
    check_engine_memory(&plan, &cli.devices, engine_processes(cli))?;
    if cli.attach.is_some() {
        return crate::attach::run(cli, &plan);
    }
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
    let access = if plan.pool == PoolMode::Format { crate::run::Access::Formats } else { crate::run::Access::WritesPool };
    crate::run::with_devices(cli, create_bytes, false, access, |specs, created| run_plan(specs, &plan, cli.output_format, created))
}

pub(crate) fn check_plan(plan: &KvPlan) -> anyhow::Result<()> {
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
    // Only the cached prefix is stored and retrieved: with none, --verify would compare nothing
    // and still report verify=true.
    if plan.verify && plan.cached_blocks() == 0 {
        return usage(format!(
            "--verify compares the cached blocks after retrieve, but --hit-rate={} of {} blocks caches no block; accepted: a --hit-rate that caches at least one (at least {:.3} here), or no --verify",
            plan.hit_rate,
            plan.blocks(),
            0.5 / plan.blocks() as f64
        ));
    }
    Ok(())
}

/// Processes on this host that each allocate the plan's engine KV memory: the parent of an
/// --attach run starts --clients of them (each with its own KV window); a client process, or
/// an in-process run, is one.
pub(crate) fn engine_processes(cli: &Cli) -> u32 {
    if cli.attach.is_some() && cli.attach_client.is_none() {
        cli.clients
    } else {
        1
    }
}

/// The engine KV memory of `processes` processes running `plan` (K and V tensors of every
/// layer, `blocks` objects each), in words and bytes.
pub(crate) fn engine_memory(plan: &KvPlan, processes: u32) -> (String, u64) {
    let geometry = plan.geometry();
    let bytes = plan
        .blocks()
        .saturating_mul(geometry.object_bytes())
        .saturating_mul(2 * u64::from(geometry.layers))
        .saturating_mul(u64::from(processes));
    let each = if processes > 1 { format!(" × {processes} client processes") } else { String::new() };
    (format!("engine KV memory ({} blocks of {} over {} layers{each})", plan.blocks(), plan.model.name, geometry.layers), bytes)
}

/// Refuses a plan whose engine KV memory (allocated before the run starts, in each of
/// `processes` processes: the clients of an --attach run) does not fit the host beside the
/// memory devices among `specs`.
pub(crate) fn check_engine_memory(plan: &KvPlan, specs: &[DeviceSpec], processes: u32) -> anyhow::Result<()> {
    // Memory devices that do not fit on their own are named as such.
    tutti_devices::check_memory(specs).map_err(|error| Unusable(error.to_string()))?;
    let (what, bytes) = engine_memory(plan, processes);
    let accepted =
        if processes > 1 { "a smaller --prompt-tokens or model, or fewer --clients" } else { "a smaller --prompt-tokens or model" };
    crate::memory::check_host_memory(&what, bytes, specs, accepted)?;
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
}

/// Runs a plan on one pool over `specs` (created files are registered in `created`).
pub fn run_plan(specs: &[DeviceSpec], plan: &KvPlan, output: OutputFormat, created: &mut CreatedFiles) -> anyhow::Result<()> {
    let geometry = plan.geometry();
    // A kept pool has the K it was formatted with, which this run cannot give
    // (--blocks-per-slot is refused with --keep-pool and --retrieve-only).
    let blocks_per_slot = match plan.pool {
        PoolMode::Format => plan.blocks_per_slot,
        PoolMode::Keep | PoolMode::RetrieveOnly => kept_blocks_per_slot(specs, created).unwrap_or(plan.blocks_per_slot),
    };
    let options = OpenOptions2 {
        writes: true,
        create_bytes: (plan.pool == PoolMode::Format).then(|| plan.pool_bytes_per_device(specs.len())),
        // One command moves a layer of a slot's run of blocks (K and V of each).
        io_bytes_max: 2 * geometry.object_bytes() * u64::from(blocks_per_slot.max(1)),
        queues: 4,
        lay_out: false,
        timing: plan.emu_timing,
        shadow_doorbells: false,
    };
    let listed = specs.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
    let devices = devices::open_controllers(specs, options, created).map_err(|error| devices::open_error(error, &listed))?;
    let mut rig = Rig::build(specs, &devices, &geometry, plan)?;
    // The devices hold this run's pool now (formatted, or opened as one): a pool file of this
    // user's that others could open is made its owner's only, every device at once. Not
    // before: a run refused on the way (a file system on a device, a device in use) must
    // leave every mode as it was.
    // A run that formatted says so if the narrowing then fails: the pool is there, and the
    // files the run created for it are kept with the others (an interrupt leaves them too), as
    // tuttid and `tutti pool format` keep theirs. Removed, they would leave the devices not
    // created holding part of a pool nothing can open, under an error saying it is kept.
    let formatted = if plan.pool == PoolMode::Format { specs } else { &[] };
    let narrowed = created.narrow_pool_files(formatted);
    if narrowed.is_err() && !formatted.is_empty() {
        created.keep_after_success();
    }
    let result = narrowed.map_err(narrowing_error).and_then(|()| run_on_rig(&mut rig, specs, &devices, &listed, plan, output));
    // The store's queue pairs are deleted before the engine memory they name is freed, and
    // if one could not be, that memory is kept: asked here, not left to the drops.
    if !rig.close() && result.is_ok() {
        return Err(anyhow!(
            "closing the store: an I/O queue pair could not be deleted; the engine's KV memory was kept (leaked) on purpose"
        ));
    }
    result
}

/// The blocks per slot (K) of the pool that the `emu:PATH` devices among `specs` hold, read from
/// their superblocks before the devices are opened, so that the software controller's MDTS can
/// hold a layer of a slot's run of blocks (the largest K found). `None` where no such file holds
/// a superblock this build reads: the run then opens the devices as it would have, and opening
/// the pool says what is wrong with what they hold. `vfio:` devices' MDTS is their own.
///
/// The path is opened again after the lock step, so what is there now may not be what was
/// locked: it is opened without waiting (`O_NONBLOCK`: a FIFO renamed over it must not make the
/// run wait for a writer, the lock step's rule; `O_NOCTTY`: a link to a terminal does not make
/// it the run's; std adds `O_CLOEXEC`), examined on the descriptor, and read only where it is a
/// regular file or a block device that is the file the run locked there (`created`'s
/// [`CreatedFiles::check_opened`], the check the devices' own open makes). Anything else gives
/// `None`: the devices' open then refuses it, saying what it is.
fn kept_blocks_per_slot(specs: &[DeviceSpec], created: &CreatedFiles) -> Option<u32> {
    use std::io::{Read, Seek, SeekFrom};
    use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
    let lba_bytes = devices::EMU_LBA_BYTES;
    let read = |device: usize, spec: &DeviceSpec, path: &std::path::Path| -> Option<u32> {
        let mut file = std::fs::OpenOptions::new().read(true).custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_NOCTTY).open(path).ok()?;
        let metadata = file.metadata().ok()?;
        if !(metadata.file_type().is_file() || metadata.file_type().is_block_device()) {
            return None;
        }
        created.check_opened(spec, Some((metadata.dev(), metadata.ino()))).ok()?;
        // A block device's metadata says 0 bytes; its end says its size, as the emulator sizes it.
        let size_bytes = file.seek(SeekFrom::End(0)).ok()?;
        file.seek(SeekFrom::Start(0)).ok()?;
        let mut bytes = [0u8; objstore::format::SUPERBLOCK_ENCODED_BYTES];
        file.read_exact(&mut bytes).ok()?;
        let superblock = objstore::format::Superblock::decode(&bytes, device, lba_bytes, size_bytes / u64::from(lba_bytes)).ok()?;
        Some(superblock.blocks_per_slot)
    };
    specs
        .iter()
        .enumerate()
        .filter_map(|(device, spec)| match spec {
            DeviceSpec::EmuFile(path) => read(device, spec, path),
            _ => None,
        })
        .max()
}

/// A pool file whose mode could not be narrowed, as the exit status says it: by its errno
/// (EPERM: a filesystem refusing chmod: what was given, 2), by the rule of the lock step's
/// refusals (run.rs `lock_input_error`), as tutti pool and tuttid decide it; a failure (1)
/// otherwise (EIO from the fstat after it).
fn narrowing_error(error: tutti_devices::DeviceError) -> anyhow::Error {
    // A pool file given to another user while it was locked, which others can open, is refused
    // as at the lock step (run.rs lock_refusal): unusable input.
    if matches!(error, tutti_devices::DeviceError::SharedLockFile { .. }) || crate::run::lock_input_error(&error) {
        Unusable(error.to_string()).into()
    } else {
        error.into()
    }
}

/// The body of [`run_plan`] on its rig: the configuration, the phases, the report.
fn run_on_rig(
    rig: &mut Rig,
    specs: &[DeviceSpec],
    devices: &[KvController],
    listed: &str,
    plan: &KvPlan,
    output: OutputFormat,
) -> anyhow::Result<()> {
    let geometry = plan.geometry();
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
        "layers_in_flight": plan.layers_in_flight,
        "blocks_per_slot": rig.store.pool().blocks_per_slot(),
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
            "tutti-bench: workload=kv model={} ({}) prompt={} tokens = {} blocks ({} of KV), hit-rate={} ({} cached blocks), verify={}, pool={}, seed={}, layers-in-flight={}, executor=cpu",
            plan.model.name,
            geometry,
            plan.prompt_tokens,
            plan.blocks(),
            format_size(plan.blocks() * geometry.block_bytes()),
            plan.hit_rate,
            plan.cached_blocks(),
            plan.verify,
            plan.pool.name(),
            plan.seed,
            plan.layers_in_flight
        )?;
        for (spec, device) in specs.iter().zip(devices) {
            outln!("  device {spec}: {}", device.description)?;
        }
        outln!(
            "  pool of {} slots ({} block(s) per slot) over {} device(s), slots round-robin, payload CRC {}{}",
            rig.slots,
            rig.store.pool().blocks_per_slot(),
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
    let phases = run_phases(rig, plan, &mut |_phase| Ok(()))?;
    match output {
        OutputFormat::Normal => {
            for phase in &phases {
                outln!("{}", phase.text())?;
            }
        }
        OutputFormat::Json => {
            let out = json_report("in-process", None, config, phases.iter().map(LayerPhase::json).collect());
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

/// Words (and an exit status) for a pool the devices (`specs`, in the order given to the pool)
/// hold that this run cannot use.
fn pool_open_error(error: ObjstoreError, specs: &[DeviceSpec], plan: &KvPlan) -> anyhow::Error {
    match error {
        // A sound superblock of another LBA size: what the device holds is wrong for this run,
        // not damaged (exit 2, as `tutti pool` and tuttid say).
        error @ ObjstoreError::LbaSizeMismatch { device, recorded, namespace } => match specs.get(device) {
            // The software controller runs every namespace with 4096-byte LBAs here.
            Some(spec) if spec.is_emulated() => Unusable(format!(
                "{spec}: {error}: tutti-bench runs emu: devices with {namespace}-byte LBAs (it has no --emu-lba-bytes), so it \
                 cannot read a pool formatted with {recorded}-byte LBAs (only `tutti pool inspect|check --emu-lba-bytes \
                 {recorded}` read it; tuttid and the Python package run emu: devices with {namespace}-byte LBAs too): \
                 accepted: a pool formatted with {namespace}-byte LBAs"
            ))
            .into(),
            // An SSD's LBA size is its namespace's format, which no flag of tutti-bench changes.
            Some(spec) => Unusable(format!(
                "{spec}: {error}: the namespace now has another LBA size than the pool was formatted with (it was \
                 reformatted): format the pool again, or the namespace back to {recorded}-byte LBAs"
            ))
            .into(),
            None => Unusable(format!("the devices do not hold one usable pool: {error}")).into(),
        },
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

/// Engine KV memory kept for good so far (see [`keep_engine_for_good`]).
static KEPT_ENGINE_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Keeps `engine`'s memory allocated for good, loudly: a queue pair whose commands name it could
/// not be deleted (`KvStore::close` said false), so a late command may still write it, and
/// freeing it would hand its IOVAs to the next allocation.
pub(crate) fn keep_engine_for_good(engine: Engine, who: &str) {
    let bytes = engine.regions.iter().map(|region| region.len() as u64).sum::<u64>();
    KEPT_ENGINE_BYTES.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    tutti_cli::errln!(
        "{who}: an I/O queue pair could not be deleted: the engine's KV memory ({}) is kept allocated for good",
        format_size(bytes)
    );
    std::mem::forget(engine);
}

/// The slots formatting `targets` with `params` gives in all, each device planned as
/// `format_pool` plans it (`FormatParams::plan_layout`, on the namespace's LBA size and
/// size); `None` when a device cannot be planned: `format_pool` then refuses it, saying why.
fn planned_slots(targets: &[PoolTarget], params: &FormatParams) -> Option<u64> {
    let device_count = u32::try_from(targets.len()).ok()?;
    let mut slots = 0u64;
    for (device, target) in (0u32..).zip(targets) {
        let namespace = target.controller.namespace(target.namespace).ok()?;
        let superblock = params.plan_layout(namespace.block_size_bytes, namespace.size_blocks, device, device_count).ok()?;
        slots = slots.saturating_add(superblock.slot_count);
    }
    Some(slots)
}

/// Refuses (exit 2) a plan whose prompt needs more than `slots` slots of `blocks_per_slot`
/// blocks, the pool's over `device_count` devices.
fn refuse_too_few_slots(
    plan: &KvPlan,
    geometry: &ModelGeometry,
    device_count: usize,
    slots: u64,
    blocks_per_slot: u64,
) -> anyhow::Result<()> {
    let slots_needed = plan.slots_needed(blocks_per_slot);
    if slots >= slots_needed {
        return Ok(());
    }
    let tokens = slots.saturating_mul(blocks_per_slot).saturating_mul(plan.block_tokens());
    usage(format!(
        "--prompt-tokens={} needs {slots_needed} slots of {blocks_per_slot} block(s) of {} ({} blocks, the cached prefix and the rest in slots of their own); the pool's {device_count} device(s) hold {slots}; accepted: up to {tokens} tokens on them",
        plan.prompt_tokens,
        format_size(geometry.block_bytes()),
        plan.blocks(),
    ))
}

/// Everything a run needs: the store (its queue pairs), the engine memory they name, and
/// figures of the pool. End it with [`Rig::close`]; a drop (a panic) deletes the pairs before
/// freeing the memory but cannot ask whether that worked.
struct Rig {
    store: KvStore<CpuExecutor>,
    engine: Engine,
    slots: u64,
    valid_slots_at_open: u64,
    payload_crc: bool,
}

impl Rig {
    /// `specs` are `devices`' specs, in the same order (for the words of a refused open).
    fn build(specs: &[DeviceSpec], devices: &[KvController], geometry: &ModelGeometry, plan: &KvPlan) -> anyhow::Result<Self> {
        let blocks = u32::try_from(plan.blocks()).map_err(|_| anyhow!("too many blocks"))?;
        let targets: Vec<PoolTarget> =
            devices.iter().map(|device| PoolTarget { controller: Arc::clone(&device.controller), namespace: NamespaceId(1) }).collect();
        if plan.pool == PoolMode::Format {
            // Payload CRCs on: `tutti pool check --payload` can verify what a bench run left.
            let params = FormatParams { blocks_per_slot: plan.blocks_per_slot, payload_crc: true, ..FormatParams::new(*geometry) };
            // Refused before the format destroys what the devices hold (a pool kept there for a
            // later --retrieve-only, say): the slots are planned as format_pool plans them.
            if let Some(slots) = planned_slots(&targets, &params) {
                refuse_too_few_slots(plan, geometry, devices.len(), slots, u64::from(plan.blocks_per_slot))?;
            }
            format_pool(&targets, &params).map_err(|error| match error {
                error @ (ObjstoreError::NamespaceTooSmall { .. } | ObjstoreError::InvalidFormat { .. }) => {
                    Unusable(format!("cannot format a pool on {}: {error}", plan.model.name)).into()
                }
                error => anyhow::Error::new(error).context("formatting the pool"),
            })?;
        }
        let (pool, report) = Pool::open(targets, Some(geometry)).map_err(|error| pool_open_error(error, specs, plan))?;
        let payload_crc = pool.superblock(0).flags & objstore::format::FLAG_PAYLOAD_CRC != 0;
        let blocks_per_slot = u64::from(pool.blocks_per_slot());
        // A kept pool's slots, and a backstop for a format planned otherwise.
        refuse_too_few_slots(plan, geometry, devices.len(), report.slots, blocks_per_slot)?;
        // One DMA space for all pool devices (open_controllers): the first one's allocator.
        let dma = Arc::clone(devices[0].controller.dma());
        let (engine, layout) = Engine::allocate(&dma, geometry, blocks)?;
        let sgl = devices.iter().all(|device| device.controller.data_pointer_mode() == DataPointerMode::Sgl);
        let mode = if sgl { DataPointerMode::Sgl } else { DataPointerMode::Prp };
        let registration = KvRegistration::new(*geometry, blocks, layout, mode).context("registering the engine's KV memory")?;
        let config = StoreConfig::default();
        let executor = cpu_executor_for(&pool, 1024, &config).context("creating the CPU executor")?;
        let mut store = KvStore::new(pool, registration, dma, executor, config).context("building the KV store")?;
        if let Err(error) = store.set_layers_in_flight_max(plan.layers_in_flight) {
            if !store.close() {
                keep_engine_for_good(engine, "tutti-bench");
            }
            return Err(anyhow::Error::new(error).context("setting the layers in flight"));
        }
        Ok(Self { store, engine, slots: report.slots, valid_slots_at_open: report.valid_slots, payload_crc })
    }

    /// Closes the store (deleting its queue pairs) and frees the engine memory only if it says
    /// no command can still move it; otherwise keeps it for good. Whether it was freed.
    fn close(self) -> bool {
        let Rig { store, engine, .. } = self;
        let memory_free = store.close();
        if memory_free {
            drop(engine);
        } else {
            keep_engine_for_good(engine, "tutti-bench");
        }
        memory_free
    }
}

impl KvTarget for Rig {
    type Store = KvStore<CpuExecutor>;

    fn store(&mut self) -> &mut Self::Store {
        &mut self.store
    }

    fn layers(&self) -> u32 {
        self.engine.layers
    }

    fn object_bytes(&self) -> usize {
        self.engine.object_bytes
    }

    fn write_object(&self, layer: u32, kind: KvKind, block: u32, bytes: &[u8]) -> anyhow::Result<()> {
        Ok(self.engine.tensor(layer, kind).write(block as usize * self.engine.object_bytes, bytes)?)
    }

    fn read_object(&self, layer: u32, kind: KvKind, block: u32, out: &mut [u8]) -> anyhow::Result<()> {
        Ok(self.engine.tensor(layer, kind).read(block as usize * self.engine.object_bytes, out)?)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// 20 GiB available: 17.5 GiB can be spared.
    const MEMINFO_20G: &str = "MemTotal:       24000000 kB\nMemAvailable:   20971520 kB\n";

    #[test]
    fn engine_memory_is_kept_when_the_store_cannot_delete_its_queue_pairs() {
        // Goal: the store's commands name the engine's KV memory until its queue pairs are
        // deleted; when the controller refuses every Delete I/O SQ, KvStore::close says so and
        // the engine memory must be kept for good (counted, said on stderr), not freed by the
        // drops that followed the store's.
        let cli = Cli::try_parse_from(["tutti-bench", "--workload=kv", "--prompt-tokens=160"]).unwrap();
        let plan = KvPlan::from_cli(&cli).unwrap();
        let options = OpenOptions2 {
            writes: true,
            create_bytes: None,
            io_bytes_max: 2 * plan.geometry().object_bytes() * u64::from(plan.blocks_per_slot),
            queues: 4,
            lay_out: false,
            timing: None,
            shadow_doorbells: false,
        };
        let mut created = CreatedFiles::default();
        let specs = [DeviceSpec::EmuMemory(128 << 20)];
        let devices = devices::open_controllers(&specs, options, &mut created).expect("emu:mem");
        let rig = Rig::build(&specs, &devices, &plan.geometry(), &plan).expect("rig");
        let refuse =
            nvme_emu::FaultAction::Status(nvme_driver::spec::NvmeStatus::generic(nvme_driver::spec::status::codes::INTERNAL_ERROR));
        let rule = nvme_emu::FaultRule {
            repeat: true,
            ..nvme_emu::FaultRule::on_nth_admin(1, nvme_driver::spec::AdminOpcode::DeleteIoSubmissionQueue, refuse)
        };
        devices[0].emulator.as_ref().expect("software controller").set_faults(nvme_emu::FaultPlan::none().with_rule(rule));
        let engine_bytes = rig.engine.regions.iter().map(|region| region.len() as u64).sum::<u64>();
        let before = KEPT_ENGINE_BYTES.load(std::sync::atomic::Ordering::Relaxed);
        assert!(!rig.close(), "the store's queue pairs were not deleted, yet close said the memory may be freed");
        let kept = KEPT_ENGINE_BYTES.load(std::sync::atomic::Ordering::Relaxed) - before;
        assert!(kept >= engine_bytes, "{kept} of {engine_bytes} bytes of engine memory kept: the rest was freed");
    }

    #[test]
    fn a_kv_run_whose_narrowing_fails_says_the_pool_was_formatted_with_status_2() {
        // Goal: narrowing waits for the pool, so an EPERM from it (a filesystem refusing chmod)
        // comes after Rig::build formatted the devices; the run stopped with the lock step's old
        // refusal alone, which reads as if nothing had changed though the file now holds a
        // fresh pool (with --overwrite, what it held is gone). Now the error says the pool was
        // formatted there, with status 2 (what was given: the file's filesystem). Two files,
        // each locked as run.rs's lock step does, the second one's fchmod failing: the first,
        // narrowed already, gets its mode back (all are narrowed together).
        use std::os::unix::fs::PermissionsExt;
        let cli = Cli::try_parse_from(["tutti-bench", "--workload=kv", "--prompt-tokens=160"]).unwrap();
        let plan = KvPlan::from_cli(&cli).unwrap();
        let directory = tempfile::tempdir().unwrap();
        let paths = [directory.path().join("a.img"), directory.path().join("b.img")];
        for path in &paths {
            std::fs::File::create(path).unwrap().set_len(plan.pool_bytes_per_device(2)).unwrap();
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        let specs = paths.clone().map(DeviceSpec::EmuFile);
        let mut created = CreatedFiles::default();
        for spec in &specs {
            let locks = devices::FileModes::Narrow.acquire(std::slice::from_ref(spec), &directory.path().join("locks")).expect("locked");
            created.note_held(locks.paths());
            created.hold_locks(locks);
        }
        devices::NARROWING_FAILS_WITH.set(Some((2, libc::EPERM)));
        let result = run_plan(&specs, &plan, cli.output_format, &mut created);
        devices::NARROWING_FAILS_WITH.set(None);
        let error = result.unwrap_err();
        let unusable = error.downcast_ref::<Unusable>().unwrap_or_else(|| panic!("not status 2: {error:#}"));
        let kept = format!("the pool was formatted on {}, {} and is kept", specs[0], specs[1]);
        assert!(unusable.0.contains(&kept), "{}", unusable.0);
        for path in &paths {
            let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, 0o644, "{} was not put back", path.display());
        }
    }

    #[test]
    fn a_kv_run_whose_narrowing_fails_after_formatting_keeps_the_files_it_created() {
        // Goal: the error says the pool was formatted on every device and is kept there, yet a
        // failed run removed the files it created: with a.img (0644, refused a mode change) and
        // b.img (made by the run), b.img went and a.img was left holding device 0/2 of a pool
        // nothing can open. The files are kept, as tuttid and `tutti pool format` keep theirs.
        use std::os::unix::fs::PermissionsExt;
        let cli = Cli::try_parse_from(["tutti-bench", "--workload=kv", "--prompt-tokens=160"]).unwrap();
        let plan = KvPlan::from_cli(&cli).unwrap();
        let directory = tempfile::tempdir().unwrap();
        let (a, b) = (directory.path().join("a.img"), directory.path().join("b.img"));
        std::fs::File::create(&a).unwrap().set_len(plan.pool_bytes_per_device(2)).unwrap();
        std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o644)).unwrap();
        let specs = [DeviceSpec::EmuFile(a.clone()), DeviceSpec::EmuFile(b.clone())];
        let mut created = CreatedFiles::default();
        for spec in &specs {
            let locks = devices::FileModes::Narrow.acquire(std::slice::from_ref(spec), &directory.path().join("locks")).expect("locked");
            created.note_held(locks.paths());
            created.hold_locks(locks);
        }
        devices::NARROWING_FAILS_WITH.set(Some((1, libc::EPERM)));
        let result = run_plan(&specs, &plan, cli.output_format, &mut created);
        devices::NARROWING_FAILS_WITH.set(None);
        let error = result.unwrap_err();
        let unusable = error.downcast_ref::<Unusable>().unwrap_or_else(|| panic!("not status 2: {error:#}"));
        let kept = format!("the pool was formatted on emu:{}, emu:{} and is kept", a.display(), b.display());
        assert!(unusable.0.contains(&kept), "{}", unusable.0);
        assert_eq!(created.paths(), std::slice::from_ref(&b), "the run did not create b.img");
        drop(created);
        assert!(b.exists(), "b.img, said to be kept, was removed");
    }

    #[test]
    fn a_pool_file_that_cannot_be_narrowed_is_status_2_and_one_that_fails_to_be_examined_1() {
        // Goal: this was checked on run.rs's lock_refusal, which no longer meets a narrowing
        // (the lock step changes no mode since 2dc4560): narrowing_error, the path a kv run's
        // narrowing takes, was untested. EPERM (a filesystem refusing chmod) is what was given,
        // 2, as tutti pool and tuttid say; EIO (the fstat after the fchmod) is a failure, 1.
        let io = |errno: i32| tutti_devices::DeviceError::Io {
            context: "/pool.img can be opened by other users (mode 644)".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        let error = narrowing_error(io(libc::EPERM));
        assert!(error.downcast_ref::<Unusable>().is_some(), "EPERM made status 1: {error:#}");
        let error = narrowing_error(io(libc::EIO));
        assert!(error.downcast_ref::<Unusable>().is_none(), "EIO made status 2: {error:#}");
        // A file given to another user meanwhile, others able to open it: refused, 2, as when
        // the lock step finds it so.
        let given_away = tutti_devices::DeviceError::SharedLockFile { path: "/pool.img".into(), reason: "owned by uid 1000".into() };
        let error = narrowing_error(given_away);
        assert!(error.downcast_ref::<Unusable>().is_some(), "a shared pool file made status 1: {error:#}");
    }

    #[test]
    fn an_attach_run_counts_the_engine_memory_of_every_client_it_starts() {
        // Goal: the parent of an --attach run starts --clients processes on this host, each with
        // its own KV window of the plan's blocks (llama3-8b, 16384 tokens: 2 GiB): 16 of them
        // (32 GiB) do not fit 17.5 GiB to spare although one does. A client process counts its own.
        let attach = ["tutti-bench", "--workload=kv", "--attach", "/run/tuttid.sock", "--prompt-tokens=16384"];
        let parent = Cli::try_parse_from([&attach[..], &["--clients=16"]].concat()).unwrap();
        let client = Cli::try_parse_from([&attach[..], &["--clients=16", "--attach-client=3"]].concat()).unwrap();
        let in_process = Cli::try_parse_from(["tutti-bench", "--workload=kv", "--prompt-tokens=16384"]).unwrap();
        assert_eq!((engine_processes(&parent), engine_processes(&client), engine_processes(&in_process)), (16, 1, 1));
        let plan = KvPlan::from_cli(&parent).unwrap();
        let (what, bytes) = engine_memory(&plan, 1);
        assert_eq!(bytes, 2 << 30);
        crate::memory::check_host_memory_with(&what, bytes, &[], "", MEMINFO_20G).unwrap();
        let (what, bytes) = engine_memory(&plan, 16);
        assert_eq!(bytes, 32 << 30);
        let message = crate::memory::check_host_memory_with(&what, bytes, &[], "", MEMINFO_20G).unwrap_err().to_string();
        assert!(message.contains("× 16 client processes") && message.contains("32GiB of host memory asked"), "{message}");
    }

    #[test]
    fn a_fifo_at_a_kept_pool_s_path_is_not_read_and_does_not_make_the_run_wait() {
        // Goal: the K of a kept pool is read from the file at its path after the lock step; a
        // FIFO renamed over the path (or a symlink to /dev/tty) made a blocking open and
        // read_exact wait for a writer for ever, where the tool's rule is that a FIFO never
        // makes it wait (devices' open_without_waiting). Now it is opened without waiting,
        // examined on the descriptor, and read only where it is the file the run locked.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("pool.img");
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR).unwrap();
        let specs = vec![DeviceSpec::EmuFile(path)];
        let (sender, receiver) = std::sync::mpsc::channel();
        // On a thread: a run that waits must fail this test, not hang it.
        std::thread::spawn(move || sender.send(kept_blocks_per_slot(&specs, &CreatedFiles::default())));
        let kept = receiver.recv_timeout(std::time::Duration::from_secs(5)).expect("kept_blocks_per_slot waited on a FIFO");
        assert_eq!(kept, None);
    }
}
