//! The KV workload's phases, written once over objstore's [`LayerKvStore`]: the in-process
//! `KvStore` (kv.rs) and tuttid's `RemoteKvStore` (attach.rs) run the same code, so the daemon
//! path is measured, and its bytes checked, exactly as the in-process path is.
//!
//! Phases, for a prompt of n blocks of which a fraction `hit_rate` (h blocks) is a cached prefix:
//! 1. store: an earlier request populates the cache with the first h blocks, layer by layer;
//! 2. retrieve: the request looks its prefix up (must find h blocks) and reads them into the
//!    engine's KV memory layer by layer; with --verify every byte is compared;
//! 3. store: the request's n − h new blocks are written layer by layer and committed.
//!
//! Layers are issued ahead, up to the store's `layers_in_flight_max` (the in-process store: 2
//! by default, `--layers-in-flight`), and waited for in order, so the next layer's commands are
//! queued while the current one drains. Each layer is timed from the later of its issue and the
//! previous layer's completion to the end of its `wait`: the layers' times add up to the time
//! from the first issue to the last completion, however many overlap.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use gio_uring::SmBudget;
use objstore::{KvKind, KvRequest, LayerKvStore, RequestHandle};
use serde_json::{json, Value};

use crate::args::format_size;
use crate::devices::Traffic;
use crate::kv::{KvPlan, PoolMode};
use crate::report::{CpuTime, ProcessCpu};
use crate::workloads::{fill_pattern, find_mismatch};

/// How long one layer may take before the run fails, without a timing model.
const LAYER_TIMEOUT: Duration = Duration::from_secs(60);

/// How long one layer of `bytes_per_layer` may take before the run fails, on devices that run
/// `timing`.
fn layer_timeout(timing: Option<nvme_emu::TimingModel>, direction: Direction, bytes_per_layer: u64) -> Duration {
    // A layer's bytes are issued together and flow through the model's pipes one command after
    // another (layers issued ahead queue behind it, not before it).
    // A phase moves one direction: a retrieve reads, a store writes (phases do not overlap).
    let traffic = match direction {
        Direction::Retrieve => Traffic::Reads,
        Direction::Store => Traffic::Writes,
    };
    crate::devices::wait_bound(LAYER_TIMEOUT, timing, traffic, bytes_per_layer)
}

/// A store and the engine KV memory it moves bytes in and out of. The memory is reached only
/// through copies (the device writes it: no reference into it is handed out).
pub(crate) trait KvTarget {
    type Store: LayerKvStore;
    fn store(&mut self) -> &mut Self::Store;
    fn layers(&self) -> u32;
    /// Bytes of one object: one layer's K (or V) of one engine block.
    fn object_bytes(&self) -> usize;
    /// Copies `bytes` into object (`layer`, `kind`) of engine block `block`.
    fn write_object(&self, layer: u32, kind: KvKind, block: u32, bytes: &[u8]) -> anyhow::Result<()>;
    /// Copies object (`layer`, `kind`) of engine block `block` into `out`.
    fn read_object(&self, layer: u32, kind: KvKind, block: u32, out: &mut [u8]) -> anyhow::Result<()>;
}

/// A logical offset unique to each byte of each object, so the verify pattern tells apart
/// layers, K from V, and blocks.
fn pattern_offset(object_bytes: usize, layer: u32, kind: KvKind, block: u32) -> u64 {
    ((u64::from(layer) * 2 + u64::from(kind == KvKind::Value)) << 40) + u64::from(block) * object_bytes as u64
}

/// Every object of every layer of `blocks`, in the order the pattern is written and checked.
fn objects(layers: u32, blocks: std::ops::Range<u32>) -> impl Iterator<Item = (u32, KvKind, u32)> {
    (0..layers).flat_map(move |layer| {
        let blocks = blocks.clone();
        [KvKind::Key, KvKind::Value].into_iter().flat_map(move |kind| blocks.clone().map(move |block| (layer, kind, block)))
    })
}

fn fill<T: KvTarget>(target: &T, blocks: std::ops::Range<u32>, seed: u64, scratch: &mut [u8]) -> anyhow::Result<()> {
    for (layer, kind, block) in objects(target.layers(), blocks) {
        fill_pattern(scratch, pattern_offset(target.object_bytes(), layer, kind, block), seed);
        target.write_object(layer, kind, block, scratch)?;
    }
    Ok(())
}

fn clear<T: KvTarget>(target: &T, blocks: std::ops::Range<u32>, scratch: &mut [u8]) -> anyhow::Result<()> {
    scratch.fill(0);
    for (layer, kind, block) in objects(target.layers(), blocks) {
        target.write_object(layer, kind, block, scratch)?;
    }
    Ok(())
}

/// Names the first byte that differs from the pattern, if any.
fn check<T: KvTarget>(target: &T, blocks: std::ops::Range<u32>, seed: u64, scratch: &mut [u8]) -> anyhow::Result<Option<String>> {
    for (layer, kind, block) in objects(target.layers(), blocks) {
        target.read_object(layer, kind, block, scratch)?;
        if let Some((byte, expected, actual)) = find_mismatch(scratch, pattern_offset(target.object_bytes(), layer, kind, block), seed) {
            return Ok(Some(format!("layer {layer} {kind:?} block {block} byte {byte}: expected {expected:#04x}, read {actual:#04x}")));
        }
    }
    Ok(None)
}

/// The prompt's tokens: a function of `seed` alone, so a later run finds what an earlier one
/// stored (an LCG; only its determinism and spread matter).
pub(crate) fn prompt_tokens(seed: u64, count: u64) -> Vec<u32> {
    let mut state = seed;
    (0..count)
        .map(|_| {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as u32
        })
        .collect()
}

/// Per-layer measurements of one phase.
pub(crate) struct LayerPhase {
    pub(crate) label: String,
    pub(crate) blocks: u64,
    pub(crate) bytes_per_layer: u64,
    pub(crate) layer_latencies: Vec<Duration>,
    /// Wall time of the phase including prepare and commit.
    pub(crate) wall: Duration,
    pub(crate) cpu: CpuTime,
    pub(crate) verified: Option<u64>,
    /// The first layer's issue and the last layer's completion, in nanoseconds on the system's
    /// monotonic clock ([`monotonic_ns`]): attach mode's aggregate spans the client processes'
    /// phases with them. `None` when the phase moved no layer or the clock could not be read.
    pub(crate) layers_span_ns: Option<(u64, u64)>,
}

/// `at` in nanoseconds on `CLOCK_MONOTONIC`: `Instant` reads that clock on Linux but keeps its
/// value private, so the distance from `at` to now is taken off a reading of it. `None` for an
/// `at` in the future or a failed reading.
pub(crate) fn monotonic_ns(at: Instant) -> Option<u64> {
    let now = Instant::now();
    let now_ns = crate::uring::monotonic_now_ns()?;
    let ago_ns = u64::try_from(now.checked_duration_since(at)?.as_nanos()).ok()?;
    now_ns.checked_sub(ago_ns)
}

/// [`LayerPhase::layers_span_ns`] of a phase whose layers ran over `span`.
fn span_ns(span: Option<(Instant, Instant)>) -> Option<(u64, u64)> {
    let (first_issue, last_done) = span?;
    Some((monotonic_ns(first_issue)?, monotonic_ns(last_done)?))
}

impl LayerPhase {
    pub(crate) fn sorted(&self) -> Vec<Duration> {
        let mut sorted = self.layer_latencies.clone();
        sorted.sort();
        sorted
    }

    pub(crate) fn quantile(sorted: &[Duration], quantile: f64) -> Duration {
        let index = ((sorted.len() as f64 - 1.0) * quantile).round() as usize;
        sorted.get(index).copied().unwrap_or_default()
    }

    pub(crate) fn layer_time(&self) -> Duration {
        self.layer_latencies.iter().sum()
    }

    pub(crate) fn gb_per_second(&self) -> f64 {
        let seconds = self.layer_time().as_secs_f64();
        if seconds > 0.0 {
            (self.bytes_per_layer * self.layer_latencies.len() as u64) as f64 / seconds / 1e9
        } else {
            0.0
        }
    }

    pub(crate) fn text(&self) -> String {
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

    pub(crate) fn json(&self) -> Value {
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
            "cpu_user_ns": ns(self.cpu.user),
            "cpu_system_ns": ns(self.cpu.system),
            "verified_bytes": self.verified,
            "layers_start_monotonic_ns": self.layers_span_ns.map(|(start, _)| start),
            "layers_end_monotonic_ns": self.layers_span_ns.map(|(_, end)| end),
        })
    }

    /// A phase back from its [`Self::json`] (a client process's report in attach mode); `None`
    /// when a field is missing or of the wrong type.
    pub(crate) fn from_json(value: &Value) -> Option<LayerPhase> {
        let nanos = |value: &Value| value.as_u64().map(Duration::from_nanos);
        let layer_latencies = value["layers"].as_array()?.iter().map(|layer| nanos(&layer["lat_ns"])).collect::<Option<Vec<_>>>()?;
        Some(LayerPhase {
            label: value["phase"].as_str()?.to_string(),
            blocks: value["blocks"].as_u64()?,
            bytes_per_layer: value["bytes_per_layer"].as_u64()?,
            layer_latencies,
            wall: nanos(&value["wall_ns"])?,
            cpu: CpuTime { user: nanos(&value["cpu_user_ns"])?, system: nanos(&value["cpu_system_ns"])? },
            verified: match &value["verified_bytes"] {
                Value::Null => None,
                verified => Some(verified.as_u64()?),
            },
            layers_span_ns: value["layers_start_monotonic_ns"].as_u64().zip(value["layers_end_monotonic_ns"].as_u64()),
        })
    }
}

/// Runs the plan's phases on `target`; `before_phase` is called before each (attach mode lines
/// the client processes up there, so their phases overlap). A kept pool may hold more of the
/// prompt than the plan's hit rate; any other mismatch of the lookup is an error.
pub(crate) fn run_phases<T: KvTarget>(
    target: &mut T,
    plan: &KvPlan,
    before_phase: &mut dyn FnMut(&str) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<LayerPhase>> {
    let blocks = u32::try_from(plan.blocks()).map_err(|_| anyhow!("too many blocks"))?;
    let cached = plan.cached_blocks() as u32;
    let block_tokens = plan.block_tokens() as usize;
    let ids: Vec<u32> = (0..blocks).collect();
    let tokens = prompt_tokens(plan.seed, plan.blocks() * plan.block_tokens());
    let mut scratch = vec![0u8; target.object_bytes()];
    let mut phases = Vec::new();
    if plan.pool != PoolMode::RetrieveOnly {
        fill(target, 0..blocks, plan.seed, &mut scratch)?;
    }
    if cached > 0 && plan.pool != PoolMode::RetrieveOnly {
        before_phase("populate")?;
        let request = KvRequest { tokens: &tokens[..cached as usize * block_tokens], block_ids: &ids[..cached as usize] };
        phases.push(store_phase(target, "store (populate: the cached prefix, written by an earlier request)", &request, plan.emu_timing)?);
    }
    if cached > 0 {
        let found = target.store().lookup(&tokens);
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
            clear(target, 0..cached, &mut scratch)?;
        }
        before_phase("retrieve")?;
        let layers = target.layers();
        let cpu_before = ProcessCpu::now();
        let started = Instant::now();
        let request = KvRequest { tokens: &tokens[..cached as usize * block_tokens], block_ids: &ids[..cached as usize] };
        let bytes_per_layer = u64::from(cached) * 2 * target.object_bytes() as u64;
        let store = target.store();
        let handle = store.prepare_retrieve(&request).context("prepare_retrieve")?;
        let timeout = layer_timeout(plan.emu_timing, Direction::Retrieve, bytes_per_layer);
        let (latencies, span) = move_layers(store, handle, layers, Direction::Retrieve, bytes_per_layer, timeout)?;
        store.finish(handle).context("finishing the retrieve")?;
        let wall = started.elapsed();
        let cpu = ProcessCpu::now().since(&cpu_before);
        let verified = if plan.verify {
            if let Some(mismatch) = check(target, 0..cached, plan.seed, &mut scratch)? {
                return Err(anyhow!("verify failed after retrieve (pattern of --seed={}): {mismatch}", plan.seed));
            }
            Some(u64::from(cached) * 2 * u64::from(layers) * target.object_bytes() as u64)
        } else {
            None
        };
        phases.push(LayerPhase {
            label: "retrieve (the request's cached prefix, read into the engine's KV memory)".to_string(),
            blocks: u64::from(cached),
            bytes_per_layer,
            layer_latencies: latencies,
            wall,
            cpu,
            verified,
            layers_span_ns: span_ns(span),
        });
    }
    if cached < blocks && plan.pool != PoolMode::RetrieveOnly {
        before_phase("store")?;
        let request = KvRequest { tokens: &tokens, block_ids: &ids };
        phases.push(store_phase(target, "store (the request's new blocks after prefill)", &request, plan.emu_timing)?);
    }
    Ok(phases)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Retrieve,
    Store,
}

/// Moves every layer of a prepared request: up to the store's `layers_in_flight_max` layers
/// issued ahead, each waited for in order. Returns each layer's time (module docs). A failed
/// layer ends the run, after every layer still in flight, the failed one's included when its
/// wait timed out, is waited for, within [`drain`]'s bounds (the device may still be moving
/// their bytes; a stuck one is given up on after a second timeout).
/// Also the first layer's issue and the last layer's completion (`None` with no layer).
/// `bytes_per_layer` is what each layer moves: a layer with nothing in flight is accepted only
/// where it is 0.
fn move_layers<S: LayerKvStore>(
    store: &mut S,
    handle: RequestHandle,
    layers: u32,
    direction: Direction,
    bytes_per_layer: u64,
    layer_timeout: Duration,
) -> anyhow::Result<MovedLayers> {
    let ahead = store.layers_in_flight_max().max(1);
    let verb = if direction == Direction::Retrieve { "retrieve" } else { "store" };
    let mut latencies = Vec::with_capacity(layers as usize);
    let mut issued_at = Vec::with_capacity(layers as usize);
    let mut next = 0u32;
    let mut previous_done: Option<Instant> = None;
    for layer in 0..layers {
        while next < layers && next < layer + ahead {
            issued_at.push(Instant::now());
            let issued = match direction {
                Direction::Retrieve => store.retrieve_layer(handle, next, SmBudget(1)),
                Direction::Store => store.store_layer(handle, next, SmBudget(1)),
            };
            if let Err(error) = issued {
                // Layers `layer..next` issued and not collected, and the failed one: its
                // commands may have been published (`GioError::SubmitFailed`).
                drain(store, handle, next - layer + 1, false, layer_timeout);
                return Err(error).with_context(|| format!("{verb}_layer {next}"));
            }
            next += 1;
        }
        let waited = store.wait(handle, Instant::now() + layer_timeout);
        let done = Instant::now();
        match waited {
            Ok(Some(completed)) if completed == layer => {}
            // Nothing was in flight: right only where the layer moves no bytes (a store whose
            // blocks are all cached already), so its issues completed at once. Elsewhere the
            // layer's bytes would be counted over no I/O, a rate made up.
            Ok(None) if bytes_per_layer == 0 => {}
            other => {
                // Layers `layer..next` were issued and not collected; a timed-out wait leaves
                // `layer` among them (objstore's `GioError::WaitTimeout`).
                drain(store, handle, next - layer, is_wait_timeout(&other), layer_timeout);
                let error = match other {
                    Err(error) => anyhow::Error::new(error),
                    Ok(None) => anyhow!("the store had nothing in flight for layer {layer}, which moves {bytes_per_layer} bytes"),
                    Ok(Some(completed)) => anyhow!("the store completed layer {completed}, expected layer {layer} (issue order)"),
                };
                return Err(error).with_context(|| format!("waiting for {verb} layer {layer}"));
            }
        }
        let started = previous_done.map_or(issued_at[layer as usize], |previous| previous.max(issued_at[layer as usize]));
        latencies.push(done - started);
        previous_done = Some(done);
    }
    let span = issued_at.first().copied().zip(previous_done);
    Ok((latencies, span))
}

/// Each layer's time, and the span from the first issue to the last completion.
type MovedLayers = (Vec<Duration>, Option<(Instant, Instant)>);

/// After a failure: waits for the layers still in flight, so that the request can be finished;
/// their own errors are dropped (the first one is what the run reports). Until the store says
/// none is in flight, not over the layers behind the failed one: a timed-out wait leaves its
/// layer in flight (objstore's `GioError::WaitTimeout`), and an issue that failed after its
/// commands were published (`GioError::SubmitFailed`) leaves that layer in flight too.
///
/// Bounded by what can be in flight, not by the model's layers: at most `in_flight` (the
/// layers issued and not collected, the failed issue's included; at most
/// `layers_in_flight_max` + 1) + 1 waits of the layer timeout each, the + 1 for one retry of a
/// layer still moving. And a timeout right after a timeout (`timed_out`: the failed wait's
/// own) ends it: the oldest layer did not complete within two layer timeouts (all a timed-out
/// wait says), the device is taken as stuck, and every further wait would only hold the run
/// (attach mode's parent gives a client's step 600 s before it kills it, its error unprinted).
/// Layers still in flight then are left to the store's close, which deletes its queue pairs
/// before the engine memory they name is freed, and keeps that memory for good where one cannot
/// be deleted (kv.rs).
fn drain<S: LayerKvStore>(store: &mut S, handle: RequestHandle, in_flight: u32, mut timed_out: bool, layer_timeout: Duration) {
    for _ in 0..=in_flight {
        // A store that cannot say counts as one with a layer in flight: waited on, bounded.
        if !store.any_layer_in_flight(handle).unwrap_or(true) {
            return;
        }
        let waited = store.wait(handle, Instant::now() + layer_timeout);
        let timeout = is_wait_timeout(&waited);
        if timeout && timed_out {
            return;
        }
        timed_out = timeout;
    }
}

/// Whether a `wait` ran out its deadline, its layer still in flight.
fn is_wait_timeout<T>(waited: &objstore::Result<T>) -> bool {
    matches!(waited, Err(objstore::ObjstoreError::Gio(gio_uring::GioError::WaitTimeout { .. })))
}

/// `timing`: the devices' timing model (`--emu-timing`), which bounds the layers' waits.
fn store_phase<T: KvTarget>(
    target: &mut T,
    label: &str,
    request: &KvRequest<'_>,
    timing: Option<nvme_emu::TimingModel>,
) -> anyhow::Result<LayerPhase> {
    let layers = target.layers();
    let object_bytes = target.object_bytes() as u64;
    let store = target.store();
    let cpu_before = ProcessCpu::now();
    let started = Instant::now();
    let plan = store.prepare_store(request).context("prepare_store")?;
    let bytes_per_layer = plan.new_blocks as u64 * 2 * object_bytes;
    let (latencies, span) = move_layers(
        store,
        plan.handle,
        layers,
        Direction::Store,
        bytes_per_layer,
        layer_timeout(timing, Direction::Store, bytes_per_layer),
    )?;
    store.commit_store(plan.handle).context("commit_store")?;
    Ok(LayerPhase {
        label: label.to_string(),
        blocks: plan.new_blocks as u64,
        bytes_per_layer,
        layer_latencies: latencies,
        wall: started.elapsed(),
        cpu: ProcessCpu::now().since(&cpu_before),
        verified: None,
        layers_span_ns: span_ns(span),
    })
}

/// The kv workload's JSON report, one shape for both paths: `mode` is `in-process` or `attach`
/// (then with the number of client processes).
pub fn json_report(mode: &str, clients: Option<u32>, config: Value, phases: Vec<Value>) -> Value {
    let mut out = json!({
        "tutti-bench version": env!("CARGO_PKG_VERSION"),
        "workload": "kv",
        "mode": mode,
        "global options": config,
        "phases": phases,
    });
    if let Some(clients) = clients {
        out["clients"] = json!(clients);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use objstore::{Result, StorePlan};

    /// How a [`ScriptedStore`]'s device answers: whether its issues go in flight, and how each
    /// `wait` answers. A timeout is objstore's `GioError::WaitTimeout`, the oldest layer left in
    /// flight; a completion completes the oldest layer in flight, in issue order.
    #[derive(Clone, Copy, PartialEq)]
    enum Device {
        /// Nothing is ever in flight: every issue is taken, every `wait` answers `None`.
        Idle,
        /// Every `wait` completes at once.
        Prompt,
        /// The first `wait` times out, later ones complete.
        FirstWaitTimesOut,
        /// A stuck device: no layer ever completes, every `wait` times out.
        Stuck,
        /// `wait`s alternate: the first times out, the second completes, and so on.
        Alternating,
    }

    /// The tests' one store: every issue is taken and (unless the device is idle) goes in flight;
    /// its `wait`s answer as `device` says. Counts its waits, and records the layers they
    /// completed and how far off each wait's deadline was.
    struct ScriptedStore {
        device: Device,
        /// `layers_in_flight_max`.
        ahead: u32,
        in_flight: std::collections::VecDeque<u32>,
        waits: u32,
        collected: Vec<u32>,
        deadlines_in: Vec<Duration>,
    }

    impl ScriptedStore {
        fn new(device: Device, ahead: u32) -> Self {
            Self { device, ahead, in_flight: Default::default(), waits: 0, collected: Vec::new(), deadlines_in: Vec::new() }
        }

        fn issue(&mut self, layer: u32) {
            if self.device != Device::Idle {
                self.in_flight.push_back(layer);
            }
        }
    }

    impl LayerKvStore for ScriptedStore {
        fn lookup_from(&mut self, _tokens: &[u32], first_block: usize) -> usize {
            first_block
        }
        fn prepare_retrieve_from(&mut self, _request: &KvRequest<'_>, _first_block: usize) -> Result<RequestHandle> {
            Ok(RequestHandle::from_bits(1))
        }
        fn prepare_store(&mut self, _request: &KvRequest<'_>) -> Result<StorePlan> {
            unreachable!("move_layers prepares nothing")
        }
        fn retrieve_layer(&mut self, _handle: RequestHandle, layer: u32, _budget: SmBudget) -> Result<()> {
            self.issue(layer);
            Ok(())
        }
        fn store_layer(&mut self, _handle: RequestHandle, layer: u32, _budget: SmBudget) -> Result<()> {
            self.issue(layer);
            Ok(())
        }
        fn layers_in_flight_max(&self) -> u32 {
            self.ahead
        }
        fn any_layer_in_flight(&self, _handle: RequestHandle) -> Result<bool> {
            Ok(!self.in_flight.is_empty())
        }
        fn wait(&mut self, _handle: RequestHandle, deadline: Instant) -> Result<Option<u32>> {
            self.deadlines_in.push(deadline.saturating_duration_since(Instant::now()));
            self.waits += 1;
            let times_out = match self.device {
                Device::Idle | Device::Prompt => false,
                Device::FirstWaitTimesOut => self.waits == 1,
                Device::Stuck => true,
                Device::Alternating => self.waits % 2 == 1,
            };
            if times_out {
                return Err(objstore::ObjstoreError::Gio(gio_uring::GioError::WaitTimeout { id: gio_uring::IocbId(0), waited_ms: 0 }));
            }
            let completed = self.in_flight.pop_front();
            self.collected.extend(completed);
            Ok(completed)
        }
        fn poll(&mut self, _handle: RequestHandle) -> Result<bool> {
            Ok(self.in_flight.is_empty())
        }
        fn commit_store(&mut self, _handle: RequestHandle) -> Result<usize> {
            Ok(0)
        }
        fn finish(&mut self, _handle: RequestHandle) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_timing_model_stretches_the_layer_bound_to_what_it_makes_a_layer_take() {
        // Goal: the fixed 60 s per layer failed valid runs under a slow --emu-timing model (a
        // 64 MiB layer at 1 MiB/s takes 64 s). The bound is four times what the model makes
        // the layer's bytes take, never below 60 s; each wait of move_layers uses it.
        let slow = nvme_emu::TimingModel {
            read_bytes_per_s: 1 << 20,
            write_bytes_per_s: 1 << 20,
            mixed_share_permille: 1000,
            command_latency: Duration::from_millis(1),
        };
        assert_eq!(layer_timeout(None, Direction::Retrieve, 64 << 20), LAYER_TIMEOUT);
        assert_eq!(layer_timeout(Some(slow), Direction::Retrieve, 1 << 20), LAYER_TIMEOUT, "4 s of model time: the default");
        let bound = layer_timeout(Some(slow), Direction::Retrieve, 64 << 20);
        assert!(bound >= Duration::from_secs(4 * 64), "{bound:?}");
        let mut store = ScriptedStore::new(Device::Prompt, 1);
        move_layers(&mut store, RequestHandle::from_bits(1), 3, Direction::Retrieve, 64 << 20, bound).unwrap();
        assert_eq!(store.deadlines_in.len(), 3);
        for deadline_in in &store.deadlines_in {
            assert!(*deadline_in + Duration::from_secs(1) >= bound, "a wait's deadline was {deadline_in:?} away, the bound {bound:?}");
        }
    }

    #[test]
    fn a_failed_wait_leaves_no_layer_in_flight() {
        // Goal: move_layers' doc says a failed layer ends the run after the layers behind it
        // are waited for. A timed-out wait leaves its layer in flight (objstore keeps it
        // queued), so draining only the layers behind it left one in flight: the request was
        // then finished while the device could still move its bytes. Drained until the store
        // says none is, every wait bounded.
        let handle = RequestHandle::from_bits(1);
        let mut store = ScriptedStore::new(Device::FirstWaitTimesOut, 2);
        let error = move_layers(&mut store, handle, 4, Direction::Retrieve, 1 << 20, LAYER_TIMEOUT).unwrap_err();
        assert!(format!("{error:#}").contains("waiting for retrieve layer 0"), "{error:#}");
        assert!(!store.any_layer_in_flight(handle).unwrap(), "layers {:?} were left in flight", store.in_flight);
    }

    #[test]
    fn a_stuck_device_is_drained_over_the_layers_in_flight_not_the_model_s_layers() {
        // Goal: after a failed layer the drain waited up to the model's layer count + 1 times
        // (33 for 32 layers), each wait the full layer timeout on the same stuck oldest layer:
        // a hung device held a kv run ~34 min, and attach mode's parent (600 s a step) killed
        // the client before its error was printed. The drain waits at most for the layers in
        // flight (at most layers_in_flight_max, + 1 for a failed issue), and stops at the
        // second timeout in a row: the failed wait's and the drain's first, two in all (the
        // layers-in-flight bound alone, 2 ahead, would allow 1 + 3).
        let handle = RequestHandle::from_bits(1);
        for direction in [Direction::Retrieve, Direction::Store] {
            let mut store = ScriptedStore::new(Device::Stuck, 2);
            let error = move_layers(&mut store, handle, 32, direction, 1 << 20, LAYER_TIMEOUT).unwrap_err();
            assert!(format!("{error:#}").contains("layer 0"), "{error:#}");
            assert_eq!(store.waits, 2, "waits of the layer timeout each");
        }
    }

    #[test]
    fn a_drain_whose_waits_alternate_timeout_and_completion_collects_them_within_its_bound() {
        // Goal: the drain stops at a second timeout in a row only; a timeout after a completion
        // is a layer still moving, so the drain goes on and collects what completes. Whatever
        // the device does, it makes at most in flight + 1 waits (4 ahead: 5), never one per
        // layer left. The failed wait times out, then the drain's waits complete, time out,
        // complete, time out, complete: layers 0, 1 and 2 collected, layer 3 left to the close.
        let handle = RequestHandle::from_bits(1);
        for direction in [Direction::Retrieve, Direction::Store] {
            let mut store = ScriptedStore::new(Device::Alternating, 4);
            let error = move_layers(&mut store, handle, 32, direction, 1 << 20, LAYER_TIMEOUT).unwrap_err();
            assert!(format!("{error:#}").contains("layer 0"), "{error:#}");
            let drain_waits = store.waits - 1;
            assert!(drain_waits <= store.ahead + 1, "the drain made {drain_waits} waits, {} in flight", store.ahead);
            assert_eq!(store.collected, [0, 1, 2], "the layers the drain's waits completed");
            assert_eq!(store.in_flight, [3], "the layer left in flight");
        }
    }

    #[test]
    fn nothing_in_flight_is_accepted_only_for_a_layer_that_moves_no_bytes() {
        // Goal: a store whose blocks were all cached moves no bytes, and its layers complete at
        // once (`wait` answers None). A layer that should move bytes and had nothing in flight
        // is the store's failure: counted as done, its bytes over ~0 s made GB/s up.
        let handle = RequestHandle::from_bits(1);
        let (latencies, _) = move_layers(&mut ScriptedStore::new(Device::Idle, 1), handle, 3, Direction::Store, 0, LAYER_TIMEOUT).unwrap();
        assert_eq!(latencies.len(), 3);
        for direction in [Direction::Retrieve, Direction::Store] {
            let error = move_layers(&mut ScriptedStore::new(Device::Idle, 1), handle, 3, direction, 1 << 20, LAYER_TIMEOUT).unwrap_err();
            assert!(format!("{error:#}").contains("nothing in flight for layer 0"), "{error:#}");
        }
    }
}
