//! Builds a profile table from a measured per-layer kernel timeline exported by an engine
//! (Tutti §3.3 profiles the same quantities offline during warm-up).
//!
//! # Timeline format (CSV, one kernel per line)
//!
//! ```text
//! # lines starting with '#' and blank lines are ignored; the header line is required
//! phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used
//! prefill,4096,0,0,input_norm,0.0,11.5,132
//! prefill,4096,0,0,flash_attention,95.0,410.0,132
//! decode,4096,,,decode_step,0.0,5200.0,70
//! ```
//!
//! - `phase`: `prefill` or `decode`.
//! - `input_tokens`, `prefix_tokens`: the bucket (prompt length including the cached prefix, and
//!   the cached prefix). For `decode` rows `input_tokens` is the context length and
//!   `prefix_tokens` and `layer` may be empty.
//! - `layer`: 0-based layer index of a prefill kernel.
//! - `kernel`: kernel name; the first kernel of a layer whose name contains `attn` or
//!   `attention` (any case) is where the layer needs its cached KV.
//! - `start_us`, `end_us`: kernel start and end on any common clock (only differences matter).
//! - `sms_used`: SMs the kernel occupies (from the launch grid or an occupancy tool). Import
//!   reserves `io_sms` SMs for I/O as the analytic model does (compute runs on
//!   `sm_count − io_sms` SMs, the green-context split of Tutti §3.2): a kernel's `sms_used` is
//!   clamped to `sm_count − io_sms`, and so is the sum of the kernels running at once (two
//!   full-grid kernels overlapping by a profiler's rounding left a decode step no free SM), so
//!   every layer and decode step keeps `io_sms` free. A
//!   profiler gives a kernel min(grid, SMs) or all SMs, and one full-grid kernel left a decode
//!   step no free SM: the table validated and simulated, and the slack-aware runtime refused it.
//!   Durations are kept as measured: a timeline measured without the reservation understates
//!   compute slightly once `io_sms` are taken away (measure under a green context for exact
//!   figures). The table's `compute_source` records the reservation.
//! - `run` (optional: a ninth column, named in the header, then on every row): which run of the
//!   bucket, or which decode step at the context, the kernel belongs to (any u32). Without the
//!   column, all rows of a bucket are one run and all decode rows of a context one step: a
//!   timeline holding several must number them, or one span covers them all (two 5 ms steps
//!   at 0 and 100 ms made one step of 105 ms).
//!
//! A run's layer lasts from its first start to its last end, and starts no earlier than the
//! run's layer before it ends (overlapping layers are refused, naming bucket, run and layers:
//! each layer's windows come from its own kernels; up to 1 µs of overlap is taken for the
//! profiler's rounding and accepted). Its slack windows are the maximal intervals with a
//! constant number of free SMs (`sm_count −` SMs of the kernels running, which count at most
//! `sm_count − io_sms`), gaps between kernels counting as fully free; intervals with no free
//! SM are dropped. A decode
//! step's duration spans its kernels (a step whose kernels span 0 µs is refused, naming its
//! context and run) and its free SMs are the minimum over the step. Several
//! runs give the conservative figure: per decode context the shortest step and the fewest free
//! SMs; per layer the shortest duration, the earliest KV need and the runs' windows intersected
//! (at each offset the fewest SMs any run has free, none where a run has none). The input and
//! prefix steps are inferred (smallest input; greatest common divisor of the prefix lengths) and
//! the table is then validated, so a missing bucket is named; a table in which the slack-aware
//! policy could never write in a decode step ([`Profile::check_decode_steps_can_write`]) is
//! refused. Either is [`SchedulerError::ImportedTable`] (the steps were inferred, not declared);
//! an input that is no multiple of the smallest is a [`SchedulerError::Timeline`] error. Cost
//! rows above `io_sms` take compute SMs (those a timeline's kernels leave idle): a decode-step
//! refusal of a table whose rows of a kind have no budget at or below `io_sms` is an
//! [`SchedulerError::InvalidConfig`] on `io_sms` naming that first.

use std::collections::BTreeMap;

use crate::between::intersect;
use crate::error::{Result, SchedulerError};
use crate::table::{
    Bucket, DecodeStep, GpuIdentity, IoCostEntry, IoKind, LayerProfile, ModelIdentity, Profile, ProfileTable, SlackWindow,
    PROFILE_FORMAT_VERSION,
};

const HEADER: &str = "phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used";
/// The header with the optional `run` column.
const HEADER_WITH_RUN: &str = "phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used,run";

/// Per bucket (input, prefix), per run, per layer: its kernels.
type PrefillKernels = BTreeMap<(u32, u32), BTreeMap<u32, BTreeMap<u32, Vec<Kernel>>>>;

#[derive(Clone, Debug)]
struct Kernel {
    name: String,
    start_us: f64,
    end_us: f64,
    sms_used: u32,
}

/// Parses a timeline and builds a validated table, reserving `io_sms` SMs (1 to
/// `sm_count − 1`) for I/O.
pub fn import_timeline(
    text: &str,
    model: ModelIdentity,
    gpu: GpuIdentity,
    io_sms: u32,
    io_costs: Vec<IoCostEntry>,
    compute_source: &str,
    io_cost_source: &str,
) -> Result<Profile> {
    if io_sms == 0 || io_sms >= gpu.sm_count {
        return Err(SchedulerError::InvalidConfig {
            field: "io_sms".into(),
            reason: format!(
                "{io_sms} SMs reserved for I/O on a GPU of {} SMs; accepted: 1 to {}",
                gpu.sm_count,
                gpu.sm_count.saturating_sub(1)
            ),
        });
    }
    // The SMs compute may occupy: the rest is the I/O green context's.
    let compute_sms = gpu.sm_count - io_sms;
    let mut prefill: PrefillKernels = BTreeMap::new();
    // Per context, per step: its kernels.
    let mut decode: BTreeMap<u32, BTreeMap<u32, Vec<Kernel>>> = BTreeMap::new();
    let mut saw_header = false;
    let mut field_count = 8;
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if !saw_header {
            field_count = match trimmed.replace(' ', "").as_str() {
                HEADER => 8,
                HEADER_WITH_RUN => 9,
                _ => return Err(SchedulerError::Timeline { line, reason: format!("expected header `{HEADER}` (optionally `,run`)") }),
            };
            saw_header = true;
            continue;
        }
        let fields: Vec<&str> = trimmed.split(',').map(str::trim).collect();
        if fields.len() != field_count {
            return Err(SchedulerError::Timeline { line, reason: format!("{} fields, expected {field_count}", fields.len()) });
        }
        let bad = |reason: String| SchedulerError::Timeline { line, reason };
        let int = |name: &str, value: &str| -> Result<u32> { value.parse::<u32>().map_err(|e| bad(format!("`{name}` = `{value}`: {e}"))) };
        let float = |name: &str, value: &str| -> Result<f64> {
            let v = value.parse::<f64>().map_err(|e| bad(format!("`{name}` = `{value}`: {e}")))?;
            if !v.is_finite() || v < 0.0 {
                return Err(bad(format!("`{name}` = {v} must be finite and >= 0")));
            }
            Ok(v)
        };
        let kernel = Kernel {
            name: fields[4].to_string(),
            start_us: float("start_us", fields[5])?,
            end_us: float("end_us", fields[6])?,
            sms_used: int("sms_used", fields[7])?,
        };
        if kernel.end_us < kernel.start_us {
            return Err(bad("end_us is before start_us".into()));
        }
        if kernel.sms_used > gpu.sm_count {
            return Err(bad(format!("sms_used {} exceeds the GPU's {} SMs", kernel.sms_used, gpu.sm_count)));
        }
        let kernel = Kernel { sms_used: kernel.sms_used.min(compute_sms), ..kernel };
        let input_tokens = int("input_tokens", fields[1])?;
        let run = match fields.get(8) {
            Some(run) => int("run", run)?,
            None => 0,
        };
        match fields[0] {
            "prefill" => {
                let prefix_tokens = int("prefix_tokens", fields[2])?;
                // Off every grid: named here, on its line. Past this, it was a bucket the
                // built table's grid walk called "not strictly increasing".
                if prefix_tokens > input_tokens {
                    return Err(bad(format!("prefix_tokens {prefix_tokens} exceeds input_tokens {input_tokens}")));
                }
                let layer = int("layer", fields[3])?;
                if layer >= model.layer_count {
                    return Err(bad(format!("layer {layer} but the model has {}", model.layer_count)));
                }
                let runs = prefill.entry((input_tokens, prefix_tokens)).or_default();
                runs.entry(run).or_default().entry(layer).or_default().push(kernel);
            }
            "decode" => decode.entry(input_tokens).or_default().entry(run).or_default().push(kernel),
            other => return Err(bad(format!("phase `{other}` is neither prefill nor decode"))),
        }
    }
    if prefill.is_empty() {
        return Err(SchedulerError::Timeline { line: 0, reason: "no prefill rows".into() });
    }

    let input_step_tokens = prefill.keys().map(|k| k.0).min().unwrap_or(0);
    let input_max = prefill.keys().map(|k| k.0).max().unwrap_or(0);
    if input_step_tokens == 0 {
        return Err(SchedulerError::Timeline { line: 0, reason: "input_tokens must be > 0".into() });
    }
    let prefix_step_tokens = prefill.keys().map(|k| k.1).filter(|&p| p > 0).fold(0, gcd).max(1);
    let prefix_step_tokens = if prefill.keys().all(|k| k.1 == 0) { input_step_tokens } else { prefix_step_tokens };
    // The input step is inferred from the smallest input: say so in those terms (validation
    // spoke of a grid "declared by input_step_tokens", which a timeline never declares).
    if let Some(&(input_tokens, prefix_tokens)) = prefill.keys().find(|k| k.0 % input_step_tokens != 0) {
        return Err(SchedulerError::Timeline {
            line: 0,
            reason: format!(
                "bucket(input_tokens={input_tokens}, prefix_tokens={prefix_tokens}): input_tokens {input_tokens} is not a multiple of \
                 the smallest, {input_step_tokens}; import infers the input step from the smallest input, so inputs must be \
                 multiples of it"
            ),
        });
    }

    // Profilers round a kernel's start and duration apart (PyTorch's trace: µs with three
    // decimals), so one stream's back-to-back kernels can seem to overlap by a rounding step.
    const LAYER_OVERLAP_TOLERANCE_US: f64 = 1.0;
    let mut buckets = Vec::with_capacity(prefill.len());
    for ((input_tokens, prefix_tokens), runs) in prefill {
        // Per run, layer k+1 starts no earlier than layer k ends: a layer's span and windows
        // come from its own kernels only, so overlapping layers showed SMs the next layer used
        // as free and summed past the real time. (A missing layer is named below.)
        for (&run, layers) in &runs {
            let spans = layers.iter().map(|(&layer, kernels)| {
                let first_start_us = kernels.iter().map(|k| k.start_us).fold(f64::INFINITY, f64::min);
                let last_end_us = kernels.iter().map(|k| k.end_us).fold(0.0, f64::max);
                (layer, first_start_us, last_end_us)
            });
            let mut previous: Option<(u32, f64)> = None;
            for (layer, first_start_us, last_end_us) in spans {
                if let Some((previous_layer, previous_end_us)) = previous {
                    if previous_end_us - first_start_us > LAYER_OVERLAP_TOLERANCE_US {
                        return Err(SchedulerError::Timeline {
                            line: 0,
                            reason: format!(
                                "bucket(input_tokens={input_tokens}, prefix_tokens={prefix_tokens}) run {run}: layer {layer} starts at \
                                 {first_start_us} us, before layer {previous_layer} ends at {previous_end_us} us; layers must not \
                                 overlap in time (each layer's windows would show SMs the other uses)"
                            ),
                        });
                    }
                }
                previous = Some((layer, last_end_us));
            }
        }
        let mut profiles = Vec::new();
        for layer in 0..model.layer_count {
            let mut conservative: Option<LayerProfile> = None;
            for (&run, layers) in &runs {
                let location = || {
                    let run = if runs.len() > 1 { format!(" run {run}") } else { String::new() };
                    format!("bucket(input_tokens={input_tokens}, prefix_tokens={prefix_tokens}){run} layer {layer}")
                };
                let kernels = layers
                    .get(&layer)
                    .ok_or_else(|| SchedulerError::Timeline { line: 0, reason: format!("{}: no kernels", location()) })?;
                let profile = layer_from_kernels(kernels, gpu.sm_count, compute_sms)
                    .map_err(|reason| SchedulerError::Timeline { line: 0, reason: format!("{}: {reason}", location()) })?;
                conservative = Some(match conservative {
                    None => profile,
                    Some(so_far) => cheaper_of(&so_far, &profile),
                });
            }
            // Every bucket in the map has at least one run.
            profiles.extend(conservative);
        }
        buckets.push(Bucket { input_tokens, prefix_tokens, layers: profiles });
    }

    // Per context, the shortest step and the fewest free SMs of its steps.
    let mut decode_steps = Vec::with_capacity(decode.len());
    for (context_tokens, steps) in decode {
        let (mut duration_us, mut free_sms) = (f64::INFINITY, gpu.sm_count);
        for (&run, kernels) in &steps {
            let start_us = kernels.iter().map(|k| k.start_us).fold(f64::INFINITY, f64::min);
            let end_us = kernels.iter().map(|k| k.end_us).fold(0.0, f64::max);
            // A step whose kernels span no time (zero-length kernels: a launch recorded and
            // never run) is no measurement: it has no interval, so every SM came out free, and
            // as the shortest of its context's steps it made that context's step 0 µs, silently
            // dropping the steps measured beside it.
            if end_us - start_us <= 0.0 {
                let run = if steps.len() > 1 || run != 0 { format!(" run {run}") } else { String::new() };
                return Err(SchedulerError::Timeline {
                    line: 0,
                    reason: format!(
                        "decode step at context {context_tokens}{run}: its kernels span 0 us (from {start_us} to {end_us} us); a \
                         decode step must last (drop the step's rows, or the zero-length kernels)"
                    ),
                });
            }
            duration_us = duration_us.min(end_us - start_us);
            free_sms =
                free_sms.min(free_intervals(kernels, gpu.sm_count, compute_sms).iter().map(|w| w.free_sms).min().unwrap_or(gpu.sm_count));
        }
        decode_steps.push(DecodeStep { context_tokens, duration_us, free_sms });
    }

    let table = ProfileTable {
        format_version: PROFILE_FORMAT_VERSION,
        model,
        gpu,
        compute_source: format!(
            "{compute_source}; {io_sms} of {} SMs reserved for I/O (each kernel's sms_used clamped to {compute_sms}; durations as \
             measured)",
            compute_sms + io_sms
        ),
        io_cost_source: io_cost_source.to_string(),
        input_step_tokens,
        input_step_count: input_max / input_step_tokens,
        prefix_step_tokens,
        buckets,
        io_costs,
        decode_steps,
    };
    let imported = |source| SchedulerError::ImportedTable { input_step_tokens, prefix_step_tokens, source: Box::new(source) };
    // Cost rows of a kind all above the reservation: a refusal for the decode steps names that
    // first. Where compute fills its SMs a decode step leaves `io_sms` free, below every such
    // budget, and the refusal named only the decode steps' free SMs, as though the timeline were
    // at fault. Such rows are not refused as such: budgets above `io_sms` take SMs compute
    // leaves idle, which a timeline may have (kernels on fewer SMs than the compute ones).
    let mismatch = io_reservation_mismatch(&table.io_costs, io_sms);
    let profile = Profile::from_table(table).map_err(imported)?;
    profile.check_decode_steps_can_write().map_err(|source| match mismatch {
        Some(mismatch) => SchedulerError::IoReservation { io_sms, mismatch, source: Box::new(imported(source)) },
        None => imported(source),
    })?;
    Ok(profile)
}

/// What is wrong with cost rows none of whose budgets of a kind is at or below the `io_sms` SMs
/// reserved for I/O (`None` when every kind with rows has one): each such kind's smallest
/// budget against `io_sms`. A budget above `io_sms` takes SMs compute may be using, so such a
/// kind has no kernel that fits where compute fills its SMs: an imported table refused for its
/// decode steps' free SMs is refused for this (`import_timeline`).
fn io_reservation_mismatch(io_costs: &[IoCostEntry], io_sms: u32) -> Option<String> {
    let above: Vec<String> = [IoKind::Read, IoKind::Write]
        .into_iter()
        .filter_map(|kind| {
            let smallest = io_costs.iter().filter(|row| row.kind == kind).map(|row| row.sm_budget).min()?;
            let name = match kind {
                IoKind::Read => "read",
                IoKind::Write => "write",
            };
            (smallest > io_sms).then(|| format!("the smallest {name} sm_budget {smallest}"))
        })
        .collect();
    if above.is_empty() {
        return None;
    }
    Some(format!(
        "io_sms {io_sms} is below {} of the I/O cost rows: budgets above io_sms take SMs compute may be using, and where \
         compute fills its SMs (sm_count − io_sms) no such kernel fits; measure (or pass) rows at budgets at or below io_sms, or \
         reserve as many SMs as the smallest budget",
        above.join(" and ")
    ))
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Two runs of one layer as one, on the conservative side: the shorter duration, the earlier KV
/// need, and the windows of both intersected (at each offset the fewer free SMs; none where
/// either has none). The intersection lies inside both layers, so inside the shorter.
fn cheaper_of(a: &LayerProfile, b: &LayerProfile) -> LayerProfile {
    let mut slack_windows = Vec::new();
    intersect(&a.slack_windows, &b.slack_windows, &mut slack_windows);
    LayerProfile {
        compute_duration_us: a.compute_duration_us.min(b.compute_duration_us),
        kv_needed_offset_us: a.kv_needed_offset_us.min(b.kv_needed_offset_us),
        slack_windows,
    }
}

fn layer_from_kernels(kernels: &[Kernel], sm_count: u32, compute_sms: u32) -> std::result::Result<LayerProfile, String> {
    let start_us = kernels.iter().map(|k| k.start_us).fold(f64::INFINITY, f64::min);
    let end_us = kernels.iter().map(|k| k.end_us).fold(0.0, f64::max);
    let attention = kernels
        .iter()
        .filter(|k| k.name.to_ascii_lowercase().contains("attn") || k.name.to_ascii_lowercase().contains("attention"))
        .map(|k| k.start_us)
        .fold(f64::INFINITY, f64::min);
    if !attention.is_finite() {
        return Err("no attention kernel (name containing `attn` or `attention`)".into());
    }
    let slack_windows = free_intervals(kernels, sm_count, compute_sms)
        .into_iter()
        .filter(|w| w.free_sms > 0 && w.duration_us > 0.0)
        .map(|w| SlackWindow { offset_us: w.offset_us - start_us, ..w })
        .collect();
    Ok(LayerProfile { compute_duration_us: end_us - start_us, kv_needed_offset_us: attention - start_us, slack_windows })
}

/// Maximal intervals (absolute times) with a constant number of free SMs.
///
/// One sweep over the kernels' starts and ends in time order, O(k log k): a timeline is
/// untrusted input, and a decode step of a long profiling run (or a context whose steps carry
/// no `run` number, pooled) gives one list of hundreds of thousands (a scan of every kernel per
/// interval was quadratic).
/// A kernel is busy over [start, end): over the interval between two neighbouring bounds, the
/// busy SMs are those of the kernels started at or before its beginning and not yet ended, at
/// most `compute_sms`. Compute runs on `compute_sms` SMs (the rest are reserved for I/O), so
/// kernels running together share them: each one's `sms_used` is clamped to `compute_sms`, and
/// so is their sum. Summed unclamped, two full-grid kernels overlapping by a profiler's rounding
/// (0.001 µs) left a decode step no free SM and the table was refused.
fn free_intervals(kernels: &[Kernel], sm_count: u32, compute_sms: u32) -> Vec<SlackWindow> {
    // (time, change in busy SMs). Summed wide and signed: each kernel is within the GPU, their
    // sum need not be within a u32, and an end may be applied before a start at the same time.
    let mut events: Vec<(f64, i64)> =
        kernels.iter().flat_map(|k| [(k.start_us, i64::from(k.sms_used)), (k.end_us, -i64::from(k.sms_used))]).collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut windows: Vec<SlackWindow> = Vec::new();
    let mut busy: i64 = 0;
    let mut index = 0;
    while index < events.len() {
        let from = events[index].0;
        while index < events.len() && events[index].0.total_cmp(&from).is_eq() {
            busy += events[index].1;
            index += 1;
        }
        let Some(&(to, _)) = events.get(index) else { break };
        let busy_sms = busy.clamp(0, i64::from(compute_sms)) as u64;
        let free_sms = u64::from(sm_count).saturating_sub(busy_sms) as u32;
        match windows.last_mut() {
            Some(last) if last.free_sms == free_sms && (last.end_us() - from).abs() < 1e-9 => {
                last.duration_us = to - last.offset_us;
            }
            _ => windows.push(SlackWindow { offset_us: from, duration_us: to - from, free_sms }),
        }
    }
    windows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(start_us: f64, end_us: f64, sms_used: u32) -> Kernel {
        Kernel { name: "k".into(), start_us, end_us, sms_used }
    }

    /// The definition the sweep replaces: for each interval between neighbouring bounds, the
    /// kernels running at its middle, at most `compute_sms` of them together.
    fn free_intervals_by_scan(kernels: &[Kernel], sm_count: u32, compute_sms: u32) -> Vec<(f64, f64, u32)> {
        let mut bounds: Vec<f64> = kernels.iter().flat_map(|k| [k.start_us, k.end_us]).collect();
        bounds.sort_by(f64::total_cmp);
        bounds.dedup();
        let mut windows: Vec<(f64, f64, u32)> = Vec::new();
        for pair in bounds.windows(2) {
            let middle = (pair[0] + pair[1]) / 2.0;
            let busy: u64 = kernels.iter().filter(|k| k.start_us <= middle && middle < k.end_us).map(|k| u64::from(k.sms_used)).sum();
            let free = u64::from(sm_count).saturating_sub(busy.min(u64::from(compute_sms))) as u32;
            match windows.last_mut() {
                Some(last) if last.2 == free => last.1 = pair[1],
                _ => windows.push((pair[0], pair[1], free)),
            }
        }
        windows
    }

    /// Goal: the sweep finds the same windows as the scan over every interval, on overlapping,
    /// nested, touching and zero-length kernels, and kernels whose SMs together exceed the
    /// compute SMs (up to 12 of up to 80 SMs on 128) leave the reserved SMs free.
    #[test]
    fn the_sweep_finds_the_windows_the_scan_over_every_interval_finds() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |bound: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % bound
        };
        for _ in 0..200 {
            let kernels: Vec<Kernel> = (0..1 + next(12))
                .map(|_| {
                    let start = next(20) as f64;
                    kernel(start, start + next(6) as f64, 1 + next(80) as u32)
                })
                .collect();
            let swept: Vec<(f64, f64, u32)> =
                free_intervals(&kernels, 132, 128).iter().map(|w| (w.offset_us, w.end_us(), w.free_sms)).collect();
            assert_eq!(swept, free_intervals_by_scan(&kernels, 132, 128), "kernels {kernels:?}");
            assert!(swept.iter().all(|&(_, _, free_sms)| free_sms >= 4), "kernels {kernels:?}: {swept:?}");
        }
    }

    /// Goal: a decode context of 200,000 kernels (a long profiling run pools every step's kernels)
    /// imports in well under a second; the scan over every interval took minutes.
    #[test]
    fn a_long_decode_context_is_swept_in_linearithmic_time() {
        let kernels: Vec<Kernel> =
            (0..200_000u32).map(|index| kernel(f64::from(index) * 10.0, f64::from(index) * 10.0 + 7.0, 100)).collect();
        let started = std::time::Instant::now();
        let windows = free_intervals(&kernels, 132, 128);
        let elapsed = started.elapsed();
        assert_eq!(windows.len(), 2 * 200_000 - 1);
        assert!(windows.iter().all(|w| w.free_sms == 32 || w.free_sms == 132));
        assert!(elapsed < std::time::Duration::from_secs(2), "took {elapsed:?}");
    }
}
