//! Figures per policy, the simulator's prediction for the requests the live run served, and the
//! text, JSON and SVG they are written as. Every time is in µs of the modelled system: live
//! wall times divided by the slow-motion factor N, simulator times as they are.

use scheduler::plot::render_svg;
use std::collections::VecDeque;

use scheduler::sim::{simulate_carried, SimConfig, SimResult, WriteCarry};
use scheduler::sweep::PolicySummary;
use scheduler::table::{IoKind, Profile};
use serde_json::{json, Value};
use tutti_runtime::PolicyChoice;

use super::live::LiveRun;
use super::stream::Request;
use super::{Arrivals, ServePlan};
use crate::args::format_size;

/// What `rw_overlap_us` is measured from (also in the JSON).
pub const RW_OVERLAP_SOURCE: &str =
    "nvme-emu timing model: EmuStats::timing.mixed_busy over the whole run (prefill, decode and drain), / N";

/// The simulator's prediction for one policy over the stream.
#[derive(Debug, Clone)]
pub struct Predicted {
    /// Per request, arrival to first token (queueing behind the previous request included).
    pub ttft_us: Vec<f64>,
    /// Per request, the GPU's wait for KV.
    pub bubble_us: Vec<f64>,
    /// Per request, the write backlog it started with (bytes), the write layer in flight included.
    pub backlog_bytes_at_start: Vec<u64>,
    /// Per request, the bytes of the write layer already on the device when it arrived.
    pub write_in_flight_bytes_at_start: Vec<u64>,
    pub prefill_us_total: f64,
    pub compute_us_total: f64,
    pub bubble_us_total: f64,
    pub rw_overlap_us: f64,
    pub write_backlog_bytes_at_end_max: u64,
    /// Time spent writing the oldest stores before a prefill, to stay within the write queue's
    /// bounds (part of TTFT).
    pub forced_write_us: f64,
}

/// A store the prediction's write queue holds, as the runtime's queue would.
#[derive(Clone, Copy)]
struct QueuedStore {
    blocks: u64,
    layer_bytes: u64,
    /// Bytes not yet written.
    bytes_left: u64,
}

/// Runs the simulator on each request the live run served (same prompt, same cached prefix,
/// same decode steps, same table and undilated SSD model), chaining them like the live stream:
/// the write backlog one request leaves is carried into the next (the runtime's write queue
/// outlives its requests), and the runtime's write-queue bounds are applied as it applies them
/// (`ForceOldest`: before a prefill that would overflow them, the oldest queued stores are
/// written at solo write bandwidth, on the request's critical path).
pub fn predict(
    plan: &ServePlan,
    profile: &Profile,
    policy: PolicyChoice,
    requests: &[Request],
    live: &LiveRun,
) -> anyhow::Result<Predicted> {
    let mut predicted = Predicted {
        ttft_us: Vec::with_capacity(requests.len()),
        bubble_us: Vec::with_capacity(requests.len()),
        backlog_bytes_at_start: Vec::with_capacity(requests.len()),
        write_in_flight_bytes_at_start: Vec::with_capacity(requests.len()),
        prefill_us_total: 0.0,
        compute_us_total: 0.0,
        bubble_us_total: 0.0,
        rw_overlap_us: 0.0,
        write_backlog_bytes_at_end_max: 0,
        forced_write_us: 0.0,
    };
    let (limit_blocks, limit_stores) = super::live::write_queue_limits(plan);
    let write_budget = profile.io_sm_budget_max(IoKind::Write);
    let layer_count = u64::from(profile.model().layer_count).max(1);
    let barrier = policy.read_write_barrier();
    // Queued stores, oldest first.
    let mut queue: VecDeque<QueuedStore> = VecDeque::new();
    // Bytes left of the write layer the device was moving when the previous request ended.
    let mut in_flight_bytes = 0_u64;
    let mut free_at_us = 0.0_f64;
    for (request, served) in requests.iter().zip(&live.requests) {
        let blocks = request.tokens.len() as u64 / plan.stream.block_tokens;
        let incoming_blocks = blocks.saturating_sub(served.cached_tokens / plan.stream.block_tokens);
        let mut forced_us = 0.0;
        if incoming_blocks > 0 {
            let over = |queue: &VecDeque<QueuedStore>| {
                queue.iter().map(|store| store.blocks).sum::<u64>() + incoming_blocks > limit_blocks || queue.len() + 1 > limit_stores
            };
            while over(&queue) {
                let Some(QueuedStore { bytes_left: bytes, .. }) = queue.pop_front() else { break };
                if bytes > 0 {
                    forced_us += plan.model.ssd.kernel_duration_us(IoKind::Write, bytes, write_budget);
                }
                // A forced store's layer in flight completes within the forced writes.
                in_flight_bytes = 0;
            }
        }
        let arrival_us = if plan.stream.arrivals == Arrivals::Closed { free_at_us } else { request.arrival_us };
        let start_us = arrival_us.max(free_at_us);
        let backlog_bytes: u64 = queue.iter().map(|store| store.bytes_left).sum();
        // An idle gap before the request (Poisson arrivals) lets the layer in flight finish.
        let idle_us = start_us - free_at_us;
        let in_flight_us = plan.model.ssd.kernel_duration_us(IoKind::Write, in_flight_bytes, write_budget);
        let in_flight = if idle_us >= in_flight_us { 0 } else { in_flight_bytes.min(backlog_bytes) };
        let carry = WriteCarry { queued_bytes: backlog_bytes - in_flight, in_flight_bytes: in_flight, reads_wait_for_in_flight: barrier };
        let config = SimConfig {
            input_tokens: request.tokens.len() as u32,
            prefix_tokens: served.cached_tokens as u32,
            iocb_bytes: plan.model.iocb_bytes,
            decode_step_count: plan.stream.decode_steps,
            // The live runtime hands a direction's next layer over only when the one ahead
            // completed: every layer pays the command latency (docs/scheduler.md, "Live vs
            // simulated").
            queued_kernels_hide_latency: false,
        };
        let mut policy = policy.kind().build();
        let result = simulate_carried(profile, profile, &plan.model.ssd, &config, policy.as_mut(), &carry)?;
        if result.write_bytes > 0 {
            queue.push_back(QueuedStore {
                blocks: incoming_blocks,
                layer_bytes: result.write_bytes / layer_count,
                bytes_left: result.write_bytes,
            });
        }
        // Writes go oldest first: retire what the run wrote from the front of the queue.
        let mut written = (backlog_bytes + result.write_bytes).saturating_sub(result.write_backlog_bytes_at_end);
        while let Some(front) = queue.front_mut() {
            let taken = written.min(front.bytes_left);
            front.bytes_left -= taken;
            written -= taken;
            if front.bytes_left > 0 {
                break;
            }
            queue.pop_front();
        }
        // The runtime hands a store's layers to the device whole and cannot take one back: if
        // the SSD was writing when this request's decode ended, the next request finds the rest
        // of that layer (of the oldest store) in flight.
        in_flight_bytes = match queue.front() {
            Some(&QueuedStore { layer_bytes, bytes_left: left, .. }) if result.write_in_flight_bytes_at_end > 0 && layer_bytes > 0 => {
                // `left` > 0 (an empty store leaves the queue): a whole layer when it divides.
                let rest = left % layer_bytes;
                if rest == 0 {
                    layer_bytes
                } else {
                    rest
                }
            }
            _ => 0,
        };
        predicted.ttft_us.push(start_us - arrival_us + forced_us + result.ttft_us);
        predicted.bubble_us.push(result.bubble_us);
        predicted.backlog_bytes_at_start.push(backlog_bytes);
        predicted.write_in_flight_bytes_at_start.push(in_flight);
        predicted.forced_write_us += forced_us;
        free_at_us = start_us + forced_us + result.ttft_us + result.decode_us;
        predicted.prefill_us_total += result.ttft_us;
        predicted.compute_us_total += result.compute_us;
        predicted.bubble_us_total += result.bubble_us;
        predicted.rw_overlap_us += result.mixed_io_us;
        predicted.write_backlog_bytes_at_end_max = predicted.write_backlog_bytes_at_end_max.max(result.write_backlog_bytes_at_end);
    }
    Ok(predicted)
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Quantiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Quantiles {
    /// Nearest-rank quantiles.
    pub fn of(values: &[f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let rank = |q: f64| sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
        Self { p50: rank(0.5), p90: rank(0.9), p99: rank(0.99), mean: sorted.iter().sum::<f64>() / sorted.len() as f64 }
    }

    fn json(self) -> Value {
        json!({"p50": self.p50, "p90": self.p90, "p99": self.p99, "mean": self.mean})
    }
}

fn share(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        part / whole
    } else {
        0.0
    }
}

/// One policy at one hit rate, live and predicted.
#[derive(Debug, Clone)]
pub struct PolicyResult {
    pub policy: PolicyChoice,
    pub live: LiveRun,
    pub predicted: Predicted,
    pub ttft: Quantiles,
    pub predicted_ttft: Quantiles,
}

impl PolicyResult {
    pub fn new(policy: PolicyChoice, live: LiveRun, predicted: Predicted) -> Self {
        let ttft = Quantiles::of(&live.requests.iter().map(|request| request.ttft_us).collect::<Vec<_>>());
        let predicted_ttft = Quantiles::of(&predicted.ttft_us);
        Self { policy, live, predicted, ttft, predicted_ttft }
    }

    fn total(&self, field: fn(&super::live::ServedRequest) -> f64) -> f64 {
        self.live.requests.iter().map(field).sum()
    }

    pub fn bubble_us(&self) -> f64 {
        self.total(|request| request.bubble_us)
    }

    pub fn prefill_us(&self) -> f64 {
        self.total(|request| request.prefill_us)
    }

    pub fn compute_us(&self) -> f64 {
        self.total(|request| request.compute_us)
    }

    /// Bubble over prefill time (begin_prefill to end_prefill), summed over requests.
    pub fn bubble_share(&self) -> f64 {
        share(self.bubble_us(), self.prefill_us())
    }

    pub fn predicted_bubble_share(&self) -> f64 {
        share(self.predicted.bubble_us_total, self.predicted.prefill_us_total)
    }

    /// Per request, live TTFT over predicted minus one, in stream order (a request predicted at
    /// 0 µs counts as 0).
    pub fn ttft_deviations(&self) -> Vec<f64> {
        self.live
            .requests
            .iter()
            .zip(&self.predicted.ttft_us)
            .map(|(served, &predicted)| if predicted > 0.0 { served.ttft_us / predicted - 1.0 } else { 0.0 })
            .collect()
    }

    /// The median over requests of the per-request TTFT deviation: the figure the 15% of issue 13
    /// is judged on (docs/scheduler.md, "Live vs simulated"). Unlike the deviation of the p50s,
    /// it compares each request with its own prediction, so a bimodal stream (requests with and
    /// without a cached prefix) cannot flip it from one kind to the other between runs.
    pub fn ttft_deviation_median(&self) -> f64 {
        median(&self.ttft_deviations())
    }

    /// Mean live TTFT over mean predicted TTFT, minus one (weights long requests more).
    pub fn ttft_mean_deviation(&self) -> f64 {
        share(self.ttft.mean, self.predicted_ttft.mean) - 1.0
    }

    /// Cached tokens over prompt tokens, over the requests served.
    pub fn hit_rate_served(&self, prompt_tokens: u64) -> f64 {
        share(self.total(|request| request.cached_tokens as f64), (prompt_tokens * self.live.requests.len() as u64) as f64)
    }

    fn backlog_blocks_max(&self) -> usize {
        self.live.backlog.iter().map(|sample| sample.queued_blocks).max().unwrap_or(0)
    }

    /// Each request live beside its prediction, in stream order.
    fn per_request_json(&self) -> Vec<Value> {
        let predicted = &self.predicted;
        let deviations = self.ttft_deviations();
        self.live
            .requests
            .iter()
            .enumerate()
            .map(|(index, served)| {
                json!({
                    "cached_tokens": served.cached_tokens,
                    "ttft_us": served.ttft_us,
                    "admission_us": served.admission_us,
                    "prefill_us": served.prefill_us,
                    "bubble_us": served.bubble_us,
                    "compute_us": served.compute_us,
                    "ttft_deviation": deviations.get(index),
                    "predicted": {
                        "ttft_us": predicted.ttft_us.get(index),
                        "bubble_us": predicted.bubble_us.get(index),
                        "write_backlog_bytes_at_start": predicted.backlog_bytes_at_start.get(index),
                        "write_in_flight_bytes_at_start": predicted.write_in_flight_bytes_at_start.get(index),
                    },
                })
            })
            .collect()
    }

    fn json(&self, prompt_tokens: u64) -> Value {
        let counters = self.live.counters;
        json!({
            "name": self.policy.name(),
            "requests": self.live.requests.len(),
            "hit_rate_served": self.hit_rate_served(prompt_tokens),
            "ttft_us": self.ttft.json(),
            "prefill_us": self.prefill_us(),
            "compute_us": self.compute_us(),
            "bubble_us": self.bubble_us(),
            "bubble_share": self.bubble_share(),
            "rw_overlap_us": self.live.rw_overlap_us,
            "rw_overlap_source": RW_OVERLAP_SOURCE,
            "read_busy_us": self.live.read_busy_us,
            "write_busy_us": self.live.write_busy_us,
            "mixed_issues": counters.mixed_issues,
            "deferred_writes": counters.write_layers_deferred,
            "write_layers_issued": counters.write_layers_issued,
            "read_layers_issued": counters.read_layers_issued,
            "stores_committed": counters.stores_committed,
            "stores_forced": counters.stores_forced,
            "stores_failed": counters.stores_failed,
            "stores_refused": counters.stores_refused,
            "stores_truncated": counters.stores_truncated,
            "stores_skipped_pool_full": counters.stores_skipped_pool_full,
            "stores_skipped_no_request_slot": counters.stores_skipped_no_request_slot,
            "table_fallbacks": counters.table_fallbacks,
            "write_backlog": {
                "block_bytes": self.live.block_bytes,
                "max_blocks": self.backlog_blocks_max(),
                "samples": self.live.backlog.iter().map(|sample| json!({"at_us": sample.at_us, "queued_blocks": sample.queued_blocks, "queued_stores": sample.queued_stores})).collect::<Vec<_>>(),
            },
            "wall_us": self.live.wall_us,
            "per_request": self.per_request_json(),
            "predicted": {
                "ttft_us": self.predicted_ttft.json(),
                "prefill_us": self.predicted.prefill_us_total,
                "compute_us": self.predicted.compute_us_total,
                "bubble_us": self.predicted.bubble_us_total,
                "bubble_share": self.predicted_bubble_share(),
                "rw_overlap_us": self.predicted.rw_overlap_us,
                "write_backlog_bytes_at_end_max": self.predicted.write_backlog_bytes_at_end_max,
                "forced_write_us": self.predicted.forced_write_us,
            },
            "deviation": {
                "ttft_p50": share(self.ttft.p50, self.predicted_ttft.p50) - 1.0,
                "ttft_mean": self.ttft_mean_deviation(),
                "ttft_per_request_median": self.ttft_deviation_median(),
                "ttft_per_request_max_abs": self.ttft_deviations().iter().fold(0.0_f64, |max, value| max.max(value.abs())),
                "bubble_share_points": 100.0 * (self.bubble_share() - self.predicted_bubble_share()),
            },
        })
    }
}

/// One policy's runs on the same stream at one hit rate (`--repeat`).
#[derive(Debug, Clone)]
pub struct PolicyRuns {
    pub runs: Vec<PolicyResult>,
    /// The run whose TTFT p50 is the median of the runs' (the lower middle for an even count):
    /// the one whose details the text and the SVG show.
    median_index: usize,
}

/// The median of `values` (the lower middle for an even count); 0 for none.
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len().saturating_sub(1) / 2).copied().unwrap_or(0.0)
}

impl PolicyRuns {
    /// `runs` must not be empty (`--repeat` is at least 1).
    pub fn new(runs: Vec<PolicyResult>) -> Self {
        let ttfts: Vec<f64> = runs.iter().map(|run| run.ttft.p50).collect();
        let middle = median(&ttfts);
        let median_index = ttfts.iter().position(|&ttft| ttft == middle).unwrap_or(0);
        Self { runs, median_index }
    }

    pub fn median_run(&self) -> &PolicyResult {
        &self.runs[self.median_index]
    }

    /// Every run's value of `figure`, in run order.
    pub fn each(&self, figure: impl Fn(&PolicyResult) -> f64) -> Vec<f64> {
        self.runs.iter().map(figure).collect()
    }

    /// The median over runs of `figure`.
    pub fn median(&self, figure: impl Fn(&PolicyResult) -> f64) -> f64 {
        median(&self.each(figure))
    }

    pub fn ttft_deviation(&self) -> f64 {
        share(self.median(|run| run.ttft.p50), self.median(|run| run.predicted_ttft.p50)) - 1.0
    }

    fn json(&self, prompt_tokens: u64) -> Value {
        let mut value = self.median_run().json(prompt_tokens);
        value["repeat"] = json!({
            "runs": self.runs.len(),
            "shown_run": self.median_index + 1,
            "ttft_p50_us": self.each(|run| run.ttft.p50),
            "bubble_share": self.each(PolicyResult::bubble_share),
            "rw_overlap_us": self.each(|run| run.live.rw_overlap_us),
            "predicted_ttft_p50_us": self.each(|run| run.predicted_ttft.p50),
            "predicted_bubble_share": self.each(PolicyResult::predicted_bubble_share),
            "ttft_mean_us": self.each(|run| run.ttft.mean),
            "predicted_ttft_mean_us": self.each(|run| run.predicted_ttft.mean),
            "ttft_per_request_median_deviation": self.each(PolicyResult::ttft_deviation_median),
            "median": {
                "ttft_p50_us": self.median(|run| run.ttft.p50),
                "bubble_share": self.median(PolicyResult::bubble_share),
                "rw_overlap_us": self.median(|run| run.live.rw_overlap_us),
                "predicted_ttft_p50_us": self.median(|run| run.predicted_ttft.p50),
                "predicted_bubble_share": self.median(PolicyResult::predicted_bubble_share),
                "ttft_p50_deviation": self.ttft_deviation(),
                "ttft_mean_us": self.median(|run| run.ttft.mean),
                "predicted_ttft_mean_us": self.median(|run| run.predicted_ttft.mean),
                "ttft_per_request_median_deviation": self.median(PolicyResult::ttft_deviation_median),
            },
        });
        value
    }
}

/// Every policy at one hit rate.
#[derive(Debug, Clone)]
pub struct SweepPoint {
    pub hit_rate: f64,
    pub requests: usize,
    pub policies: Vec<PolicyRuns>,
}

fn configuration(plan: &ServePlan) -> Value {
    let model = &plan.model;
    let shape = &plan.stream;
    json!({
        "workload": "serve",
        "model": model.choice.name,
        "geometry": model.choice.geometry.to_string(),
        "gpu": model.gpu.name,
        "policies": plan.policies.iter().map(|policy| policy.name()).collect::<Vec<_>>(),
        "prompt_tokens": shape.prompt_tokens,
        "sessions": shape.sessions,
        "turns": shape.turns,
        "system_prompts": shape.system_prompts,
        "system_prompt_tokens": plan.hit_rates.iter().map(|&rate| shape.system_tokens(rate)).collect::<Vec<_>>(),
        "decode_steps": shape.decode_steps,
        "arrivals": match shape.arrivals { Arrivals::Closed => "closed", Arrivals::Poisson => "poisson" },
        "arrival_rate_per_s": (shape.arrivals == Arrivals::Poisson).then_some(shape.arrival_rate),
        "seed": plan.seed,
        "repeat": plan.repeat,
        "executor": "cpu",
        "emu_timing": crate::devices::timing_json(Some(model.timing)),
        "dilation": model.dilation,
        "time_unit": "us of the modelled system: live wall time / dilation",
        "ssd_model": model.ssd,
        "iocb_bytes": model.iocb_bytes,
        "compute": "analytic roofline (not measured), slept by the engine thread x dilation",
    })
}

pub fn json(plan: &ServePlan, points: &[SweepPoint]) -> Value {
    let point_json = |point: &SweepPoint| {
        json!({
            "hit_rate": point.hit_rate,
            "requests": point.requests,
            "policies": point.policies.iter().map(|result| result.json(plan.stream.prompt_tokens)).collect::<Vec<_>>(),
        })
    };
    let first = points.first().map(point_json).unwrap_or(Value::Null);
    json!({
        "tutti-bench version": env!("CARGO_PKG_VERSION"),
        "workload": "serve",
        "global options": configuration(plan),
        "hit_rate": first["hit_rate"],
        "policies": first["policies"],
        "sweep": points.iter().map(point_json).collect::<Vec<_>>(),
    })
}

pub fn header(plan: &ServePlan) -> String {
    let model = &plan.model;
    let shape = &plan.stream;
    format!(
        "tutti-bench: workload=serve model={} ({}) gpu={} prompt={} tokens, {} sessions x {} turns, {} system prompts, {} decode steps, arrivals={}, seed={}, {} run(s) per policy (medians)\n  \
         device: a fresh in-memory software controller per policy, EMULATED {} (--emu-timing=tutti-ssd:x{} {}): every figure is the model's, not hardware's\n  \
         compute: the analytic roofline table (not measured), slept x{} by the engine thread; all times below are us of the modelled system (wall / {})\n  \
         predicted: the scheduler's simulator on the same requests, table and SSD model (one SSD of tutti_two_ssds, undilated)",
        model.choice.name,
        model.choice.geometry,
        model.gpu.name,
        shape.prompt_tokens,
        shape.sessions,
        shape.turns,
        shape.system_prompts,
        shape.decode_steps,
        match shape.arrivals {
            Arrivals::Closed => "closed".to_string(),
            Arrivals::Poisson => format!("poisson at {}/s", shape.arrival_rate),
        },
        plan.seed,
        plan.repeat,
        model.timing,
        model.dilation,
        if plan.model.dilation == tutti_devices::timing::DEFAULT_DILATION { "implied for serve" } else { "given" },
        model.dilation,
        model.dilation,
    )
}

pub fn text(plan: &ServePlan, point: &SweepPoint) -> String {
    let ms = |us: f64| us / 1e3;
    let mut lines = vec![format!("hit rate {} ({} requests):", point.hit_rate, point.requests)];
    for runs in &point.policies {
        let result = runs.median_run();
        let counters = result.live.counters;
        lines.push(format!(
            "{}: served hit rate {:.3}, wall {:.1} ms",
            result.policy.name(),
            result.hit_rate_served(plan.stream.prompt_tokens),
            ms(result.live.wall_us)
        ));
        if runs.runs.len() > 1 {
            let listed = |values: Vec<f64>, scale: f64, digits: usize| {
                values.iter().map(|value| format!("{:.digits$}", value * scale)).collect::<Vec<_>>().join(", ")
            };
            lines.push(format!(
                "  {} runs (details below: run {}, the median TTFT p50): ttft p50 (ms) [{}], bubble share (%) [{}], rw_overlap (ms) [{}]",
                runs.runs.len(),
                runs.median_index + 1,
                listed(runs.each(|run| run.ttft.p50), 1e-3, 3),
                listed(runs.each(PolicyResult::bubble_share), 100.0, 2),
                listed(runs.each(|run| run.live.rw_overlap_us), 1e-3, 3)
            ));
        }
        lines.push(format!(
            "  ttft (ms):   p50={:.3}, p90={:.3}, p99={:.3}  | predicted p50={:.3}, p90={:.3}, p99={:.3}",
            ms(result.ttft.p50),
            ms(result.ttft.p90),
            ms(result.ttft.p99),
            ms(result.predicted_ttft.p50),
            ms(result.predicted_ttft.p90),
            ms(result.predicted_ttft.p99)
        ));
        let deviations = result.ttft_deviations();
        lines.push(format!(
            "  per request: ttft mean {:.3} ms | predicted {:.3} ms ({:+.1}%); live/predicted - 1 per request: median {:+.1}%, each [{}]",
            ms(result.ttft.mean),
            ms(result.predicted_ttft.mean),
            100.0 * result.ttft_mean_deviation(),
            100.0 * result.ttft_deviation_median(),
            deviations.iter().map(|value| format!("{:+.0}", 100.0 * value)).collect::<Vec<_>>().join(" ")
        ));
        lines.push(format!(
            "  bubble:      {:.3} ms = {:.2}% of prefill ({:.3} ms, compute {:.3} ms)  | predicted {:.3} ms = {:.2}%",
            ms(result.bubble_us()),
            100.0 * result.bubble_share(),
            ms(result.prefill_us()),
            ms(result.compute_us()),
            ms(result.predicted.bubble_us_total),
            100.0 * result.predicted_bubble_share()
        ));
        lines.push(format!(
            "  io:          rw_overlap={:.3} ms (emulator), mixed issues={}, reads busy {:.1} ms, writes busy {:.1} ms  | predicted overlap {:.3} ms (prefill)",
            ms(result.live.rw_overlap_us),
            counters.mixed_issues,
            ms(result.live.read_busy_us),
            ms(result.live.write_busy_us),
            ms(result.predicted.rw_overlap_us)
        ));
        lines.push(format!(
            "  writes:      deferred layers={}, issued layers={}, stores committed={}, forced={}, failed={}, refused={}, skipped={}; backlog max {} blocks ({})",
            counters.write_layers_deferred,
            counters.write_layers_issued,
            counters.stores_committed,
            counters.stores_forced,
            counters.stores_failed,
            counters.stores_refused,
            counters.stores_skipped_pool_full + counters.stores_skipped_no_request_slot,
            result.backlog_blocks_max(),
            format_size(result.backlog_blocks_max() as u64 * result.live.block_bytes)
        ));
        let samples: Vec<String> = result
            .live
            .backlog
            .iter()
            .step_by(result.live.backlog.len().div_ceil(12).max(1))
            .map(|sample| format!("{:.0}ms:{}", ms(sample.at_us), sample.queued_blocks))
            .collect();
        lines.push(format!("  backlog (time:blocks) {}", samples.join(" ")));
    }
    lines.join("\n")
}

/// The sweep as a table: live vs predicted bubble share and TTFT p50 per policy and hit rate,
/// each the median over `--repeat` runs.
pub fn sweep_table(points: &[SweepPoint]) -> String {
    let mut lines = vec![
        "hit rate | policy | bubble share live | predicted | TTFT per-request deviation (median) | TTFT mean live (ms) | predicted (ms) | TTFT p50 live (ms) | predicted (ms) | p50 deviation | rw_overlap (ms) | deferred writes | runs".to_string(),
    ];
    for point in points {
        for runs in &point.policies {
            lines.push(format!(
                "{:.2} | {} | {:.2}% | {:.2}% | {:+.1}% | {:.3} | {:.3} | {:.3} | {:.3} | {:+.1}% | {:.3} | {} | {}",
                point.hit_rate,
                runs.median_run().policy.name(),
                100.0 * runs.median(PolicyResult::bubble_share),
                100.0 * runs.median(PolicyResult::predicted_bubble_share),
                100.0 * runs.median(PolicyResult::ttft_deviation_median),
                runs.median(|run| run.ttft.mean) / 1e3,
                runs.median(|run| run.predicted_ttft.mean) / 1e3,
                runs.median(|run| run.ttft.p50) / 1e3,
                runs.median(|run| run.predicted_ttft.p50) / 1e3,
                100.0 * runs.ttft_deviation(),
                runs.median(|run| run.live.rw_overlap_us) / 1e3,
                runs.median(|run| run.live.counters.write_layers_deferred as f64),
                runs.runs.len()
            ));
        }
    }
    lines.join("\n")
}

/// Compute and bubble per request (means) against hit rate, live on top, predicted below, as
/// two figures of the scheduler's Fig. 13-style plot.
pub fn sweep_svg(plan: &ServePlan, points: &[SweepPoint]) -> String {
    let series = |live: bool| -> (Vec<SimResult>, Vec<PolicySummary>) {
        let mut results = Vec::new();
        for point in points {
            for runs in &point.policies {
                let result = runs.median_run();
                let count = result.live.requests.len().max(1) as f64;
                let (compute, bubble, prefill, overlap) = if live {
                    (result.compute_us(), result.bubble_us(), result.prefill_us(), result.live.rw_overlap_us)
                } else {
                    let predicted = &result.predicted;
                    (predicted.compute_us_total, predicted.bubble_us_total, predicted.prefill_us_total, predicted.rw_overlap_us)
                };
                results.push(SimResult {
                    policy: result.policy.name(),
                    input_tokens: plan.stream.prompt_tokens as u32,
                    prefix_tokens: (point.hit_rate * plan.stream.prompt_tokens as f64) as u32,
                    hit_rate: point.hit_rate,
                    ttft_us: prefill / count,
                    compute_us: compute / count,
                    bubble_us: bubble / count,
                    fill_bound_us: 0.0,
                    read_bytes: 0,
                    write_bytes: 0,
                    mixed_io_us: overlap / count,
                    write_backlog_bytes_at_ttft: 0,
                    write_backlog_bytes_at_end: 0,
                    write_in_flight_bytes_at_end: 0,
                    decode_us: 0.0,
                });
            }
        }
        let summaries = plan
            .policies
            .iter()
            .map(|policy| PolicySummary {
                policy: policy.name(),
                crossover_hit_rate: None,
                bubble_exceeds_compute_hit_rate: None,
                max_bubble_share_below_crossover: 0.0,
                max_excess_bubble_share_below_crossover: 0.0,
                mixed_io_us_total: 0.0,
            })
            .collect();
        (results, summaries)
    };
    let title = |what: &str| {
        format!(
            "{what}: {} on {}, {}-token prompts, mean per request (us of the modelled system; tutti-bench serve)",
            plan.model.choice.name, plan.model.gpu.name, plan.stream.prompt_tokens
        )
    };
    let (live_results, summaries) = series(true);
    let (predicted_results, _) = series(false);
    let live = render_svg(&title("LIVE (emulated SSD x dilation)"), &live_results, &summaries, None);
    let predicted = render_svg(&title("PREDICTED (simulator)"), &predicted_results, &summaries, None);
    let size = |svg: &str, attribute: &str| -> f64 {
        let key = format!("{attribute}=\"");
        svg.find(&key)
            .and_then(|start| svg[start + key.len()..].split('"').next().and_then(|value| value.parse::<f64>().ok()))
            .unwrap_or(600.0)
    };
    let (width, height) = (size(&live, "width").max(size(&predicted, "width")), size(&live, "height"));
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{:.0}\">\n<g>\n{live}</g>\n<g transform=\"translate(0,{height:.0})\">\n{predicted}</g>\n</svg>\n",
        2.0 * height
    )
}
