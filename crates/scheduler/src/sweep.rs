//! Sweeps over hit rate and prefix length, crossover points and the analytic bound — the model
//! counterpart of Tutti's Fig. 13 (§4.2.5) and Fig. 11 (§4.2.3).
//!
//! # Definitions
//!
//! - **Analytic bound**: the hit rate at which one layer's KV read at the SSD set's aggregate
//!   read bandwidth takes as long as that layer's compute (from the table). Below it a perfect
//!   layer-wise pipeline hides every read but the first layer's; above it reads are the
//!   bottleneck. Found by linear interpolation between grid points.
//! - **Crossover** of a policy (the transition from compute-bound to I/O-bound): the lowest hit
//!   rate at which its bubble exceeds the pipeline fill (the part of layer 0's read no layer-wise
//!   pipeline can hide, [`SimResult::fill_bound_us`]) by more than
//!   [`IO_BOUND_TOLERANCE`] of TTFT; interpolated between the two sweep points around it.
//! - **Bubble exceeds compute**: the lowest hit rate at which bubble > compute time, the star in
//!   Tutti's Fig. 13, reported alongside.

use serde::Serialize;

use crate::analytic::{build_table, AnalyticGrid, GpuSpec, ModelConfig};
use crate::error::{Result, SchedulerError};
use crate::policy::PolicyKind;
use crate::sim::{simulate, SimConfig, SimResult};
use crate::ssd::SsdModel;
use crate::table::{IoKind, Profile};

/// Share of TTFT by which the bubble may exceed the pipeline fill before a run counts as
/// I/O-bound.
pub const IO_BOUND_TOLERANCE: f64 = 0.01;

/// A named, fully specified experiment.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Preset {
    pub name: String,
    pub model: ModelConfig,
    pub gpu: GpuSpec,
    pub ssd: SsdModel,
    /// Prompt length of the hit-rate sweep.
    pub input_tokens: u32,
    pub grid: AnalyticGrid,
    pub iocb_bytes: u64,
    pub iocb_count_max: u32,
    pub decode_step_count: u32,
    /// Hit rate of the prefix-length sweep across input lengths.
    pub prefix_sweep_hit_rate: f64,
}

/// IOCB payload in the presets: 256 IOCTXs of 32 KiB (a 16-token block of one layer's K or V
/// for 8 KV heads × 128 dims in bf16) — a fraction of the 2048 IOCTXs an IOCB may hold, so a
/// layer's reads split into kernels small enough to place into slack windows.
pub const PRESET_IOCB_BYTES: u64 = 256 * 32 * 1024;

/// Every preset name: `{llama3-8b,qwen3-32b}-{h100,h200}-{32k,128k}`.
pub fn preset_names() -> Vec<String> {
    let mut names = Vec::new();
    for model in ["llama3-8b", "qwen3-32b"] {
        for gpu in ["h100", "h200"] {
            for length in ["32k", "128k"] {
                names.push(format!("{model}-{gpu}-{length}"));
            }
        }
    }
    names
}

/// Looks a preset up by name.
pub fn preset(name: &str) -> Option<Preset> {
    let mut parts = name.rsplitn(3, '-');
    let length = parts.next()?;
    let gpu = parts.next()?;
    let model = parts.next()?;
    let input_tokens = match length {
        "32k" => 32 * 1024,
        "128k" => 128 * 1024,
        _ => return None,
    };
    // 512 prefix steps per prompt: 0.2 percentage points of hit rate per sweep point.
    let prefix_step_tokens = input_tokens / 512;
    Some(Preset {
        name: name.to_string(),
        model: ModelConfig::preset(model)?,
        gpu: GpuSpec::preset(gpu)?,
        ssd: SsdModel::tutti_two_ssds(),
        input_tokens,
        grid: AnalyticGrid {
            input_step_tokens: input_tokens / 8,
            input_step_count: 8,
            prefix_step_tokens,
            io_sms: 4,
            decode_step_tokens: input_tokens / 8,
        },
        iocb_bytes: PRESET_IOCB_BYTES,
        iocb_count_max: 256,
        decode_step_count: 64,
        prefix_sweep_hit_rate: 0.9,
    })
}

impl Preset {
    /// The analytic table of this preset, with I/O costs from its SSD model.
    pub fn build_profile(&self) -> Result<Profile> {
        let io_costs = self.ssd.cost_table(self.iocb_bytes, self.iocb_count_max, &[self.grid.io_sms])?;
        let table = build_table(
            &self.model,
            &self.gpu,
            &self.grid,
            io_costs,
            "analytic-ssd-model (not measured): see SsdModel in the scheduler crate",
        )?;
        Profile::from_table(table)
    }
}

/// One policy's figures over a hit-rate sweep.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicySummary {
    pub policy: &'static str,
    pub crossover_hit_rate: Option<f64>,
    pub bubble_exceeds_compute_hit_rate: Option<f64>,
    /// Largest bubble / TTFT among sweep points below the crossover (all points if none).
    pub max_bubble_share_below_crossover: f64,
    /// Same, with the pipeline fill taken out of the bubble.
    pub max_excess_bubble_share_below_crossover: f64,
    /// Prefill time reads and writes shared the SSD, summed over the sweep.
    pub mixed_io_us_total: f64,
}

/// Runs every policy at every prefix length of the grid for one input length.
pub fn hit_rate_sweep(
    profile: &Profile,
    ssd: &SsdModel,
    input_tokens: u32,
    iocb_bytes: u64,
    decode_step_count: u32,
    policies: &[PolicyKind],
) -> Result<Vec<SimResult>> {
    if !profile.input_lengths().any(|i| i == input_tokens) {
        return Err(SchedulerError::OutOfRange {
            what: "input_tokens (must be a grid input length)",
            value: u64::from(input_tokens),
            min: u64::from(profile.table().input_step_tokens),
            max: u64::from(profile.input_tokens_max()),
        });
    }
    let mut results = Vec::new();
    for &kind in policies {
        for prefix_tokens in profile.prefix_lengths(input_tokens) {
            let config = SimConfig { input_tokens, prefix_tokens, iocb_bytes, decode_step_count, queued_kernels_hide_latency: true };
            let mut policy = kind.build();
            results.push(simulate(profile, profile, ssd, &config, policy.as_mut())?);
        }
    }
    Ok(results)
}

/// Runs every policy at one hit rate across the grid's input lengths, so the prefix length grows
/// with the prompt (prefix rounded down to the grid).
pub fn prefix_length_sweep(
    profile: &Profile,
    ssd: &SsdModel,
    hit_rate: f64,
    iocb_bytes: u64,
    decode_step_count: u32,
    policies: &[PolicyKind],
) -> Result<Vec<SimResult>> {
    if !(0.0..=1.0).contains(&hit_rate) {
        return Err(SchedulerError::InvalidConfig { field: "hit_rate".into(), reason: format!("{hit_rate} is outside [0, 1]") });
    }
    let step = profile.table().prefix_step_tokens;
    let mut results = Vec::new();
    for &kind in policies {
        for input_tokens in profile.input_lengths() {
            let prefix_tokens = ((f64::from(input_tokens) * hit_rate) as u32 / step) * step;
            let config = SimConfig { input_tokens, prefix_tokens, iocb_bytes, decode_step_count, queued_kernels_hide_latency: true };
            let mut policy = kind.build();
            results.push(simulate(profile, profile, ssd, &config, policy.as_mut())?);
        }
    }
    Ok(results)
}

/// The hit rate where per-layer read time equals per-layer compute time (see module docs);
/// `None` if reads stay faster than compute over the whole grid.
pub fn analytic_bound(profile: &Profile, ssd: &SsdModel, input_tokens: u32) -> Result<Option<f64>> {
    let kv_bytes = profile.model().kv_bytes_per_token_per_layer as f64;
    let read_bytes_per_us = ssd.bandwidth_bytes_per_s(IoKind::Read) / 1e6;
    let mut previous: Option<(f64, f64)> = None;
    for prefix_tokens in profile.prefix_lengths(input_tokens) {
        let bucket = profile.bucket(input_tokens, prefix_tokens)?;
        let layers = bucket.layers.len().max(1) as f64;
        let compute_us = bucket.layers.iter().map(|l| l.compute_duration_us).sum::<f64>() / layers;
        let read_us = f64::from(prefix_tokens) * kv_bytes / read_bytes_per_us;
        let hit_rate = f64::from(prefix_tokens) / f64::from(input_tokens);
        let gap_us = read_us - compute_us;
        if gap_us >= 0.0 {
            return Ok(Some(match previous {
                Some((h0, g0)) => interpolate_zero(h0, g0, hit_rate, gap_us),
                None => hit_rate,
            }));
        }
        previous = Some((hit_rate, gap_us));
    }
    Ok(None)
}

/// Where a linear function through (x0, y0 < 0) and (x1, y1 >= 0) crosses zero.
fn interpolate_zero(x0: f64, y0: f64, x1: f64, y1: f64) -> f64 {
    if y1 == y0 {
        return x1;
    }
    x0 + (x1 - x0) * (-y0) / (y1 - y0)
}

/// First hit rate where `metric` turns positive, interpolated; `points` sorted by hit rate.
fn first_positive(points: &[&SimResult], metric: impl Fn(&SimResult) -> f64) -> Option<f64> {
    let mut previous: Option<(f64, f64)> = None;
    for point in points {
        let value = metric(point);
        if value > 0.0 {
            return Some(match previous {
                Some((h0, v0)) => interpolate_zero(h0, v0, point.hit_rate, value),
                None => point.hit_rate,
            });
        }
        previous = Some((point.hit_rate, value));
    }
    None
}

/// How far a run is past I/O-bound (positive = I/O-bound), see [`IO_BOUND_TOLERANCE`].
pub fn io_bound_excess_us(point: &SimResult) -> f64 {
    point.bubble_us - point.fill_bound_us - IO_BOUND_TOLERANCE * point.ttft_us
}

/// Summaries per policy, in the order the policies first appear in `results`.
pub fn summarize(results: &[SimResult]) -> Vec<PolicySummary> {
    let mut names: Vec<&'static str> = Vec::new();
    for r in results {
        if !names.contains(&r.policy) {
            names.push(r.policy);
        }
    }
    names
        .into_iter()
        .map(|policy| {
            let mut points: Vec<&SimResult> = results.iter().filter(|r| r.policy == policy).collect();
            points.sort_by(|a, b| a.hit_rate.total_cmp(&b.hit_rate));
            let crossover = first_positive(&points, io_bound_excess_us);
            let below = |r: &&&SimResult| crossover.is_none_or(|c| r.hit_rate < c);
            let share = |part: f64, r: &SimResult| if r.ttft_us > 0.0 { part / r.ttft_us } else { 0.0 };
            PolicySummary {
                policy,
                crossover_hit_rate: crossover,
                bubble_exceeds_compute_hit_rate: first_positive(&points, |r| r.bubble_us - r.compute_us),
                max_bubble_share_below_crossover: points.iter().filter(below).map(|r| share(r.bubble_us, r)).fold(0.0, f64::max),
                max_excess_bubble_share_below_crossover: points
                    .iter()
                    .filter(below)
                    .map(|r| share((r.bubble_us - r.fill_bound_us).max(0.0), r))
                    .fold(0.0, f64::max),
                mixed_io_us_total: points.iter().map(|r| r.mixed_io_us).sum(),
            }
        })
        .collect()
}

/// CSV with one row per run.
pub fn to_csv(results: &[SimResult]) -> String {
    let mut out = String::from(
        "policy,input_tokens,prefix_tokens,hit_rate,ttft_us,compute_us,bubble_us,fill_bound_us,\
         mixed_io_us,read_bytes,write_bytes,write_backlog_bytes_at_ttft,write_backlog_bytes_at_end,\
         decode_us\n",
    );
    for r in results {
        out.push_str(&format!(
            "{},{},{},{:.6},{:.3},{:.3},{:.3},{:.3},{:.3},{},{},{},{},{:.3}\n",
            r.policy,
            r.input_tokens,
            r.prefix_tokens,
            r.hit_rate,
            r.ttft_us,
            r.compute_us,
            r.bubble_us,
            r.fill_bound_us,
            r.mixed_io_us,
            r.read_bytes,
            r.write_bytes,
            r.write_backlog_bytes_at_ttft,
            r.write_backlog_bytes_at_end,
            r.decode_us
        ));
    }
    out
}
