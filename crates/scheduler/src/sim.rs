//! A discrete-event, layer-granular simulator of one request's prefill and decode, driving a real
//! [`IoPolicy`] against a profile table and an [`SsdModel`] (Tutti §4.2.5, Fig. 13 is the
//! experiment it reproduces in model form).
//!
//! # What is modelled
//!
//! - Compute: each prefill layer takes the table's `compute_duration_us`; its attention (at
//!   `kv_needed_offset_us`) cannot start before all of the layer's cached KV has been read. Time
//!   the GPU spends waiting there — or, for no-overlap, before layer 0 — is the *bubble*.
//! - I/O: each issued kernel is a FIFO job of its direction on the SSD set; its rate is the
//!   aggregate direction bandwidth, capped by its SM budget, times the mixed-traffic fraction
//!   whenever the other direction transfers at the same moment. A kernel pays the command latency
//!   when its direction was idle, and also behind another one unless
//!   [`SimConfig::queued_kernels_hide_latency`] says the SSD already holds its commands. A
//!   kernel's IOCBs complete together when its last byte lands.
//! - The new tokens' KV of a layer becomes writable when the layer ends; what is not written
//!   when the run ends is the *write backlog*.
//!
//! # What is not
//!
//! I/O kernels run on the reserved I/O SMs and never slow compute (Tutti's green contexts); the
//! SSD has no internal state beyond the mixed-traffic penalty (no garbage collection, no cache
//! warm-up); one request at a time. Writes queued by earlier requests can be carried in
//! ([`simulate_with_backlog`], [`simulate_carried`]): the policy sees them as queued from time 0
//! and writes them, oldest first, before this request's own; a write an earlier request already
//! handed to the SSD ([`WriteCarry::in_flight_bytes`]) runs from time 0 and, for a runtime with a
//! read/write barrier, holds this request's reads until it completes. Numbers from this
//! simulator are model outputs, never measurements.

use std::collections::VecDeque;

use serde::Serialize;

use crate::error::{Result, SchedulerError};
use crate::policy::{IoPolicy, Issue, LayerView, QueueView, ReadsOnBudget};
use crate::ssd::SsdModel;
use crate::table::{IoKind, LayerProfile, Profile};

/// Upper bound on simulation steps: a run that needs more is a bug, reported as an error.
const EVENT_COUNT_MAX: u64 = 10_000_000;
/// Bytes below which a job counts as done (float residue).
const BYTES_EPSILON: f64 = 1e-3;
/// Time below which a remainder is float residue: advancing the clock by it may not change it.
const RESIDUE_US: f64 = 1e-6;

/// One run's request and I/O granularity.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SimConfig {
    pub input_tokens: u32,
    pub prefix_tokens: u32,
    /// Bytes one IOCB moves (its IOCTXs × the KV object size).
    pub iocb_bytes: u64,
    /// Decode steps simulated after the first token (their slack takes deferred writes).
    pub decode_step_count: u32,
    /// Whether a kernel queued behind another of its direction hides its command latency (its
    /// commands already wait in the SSD's queue while the one ahead transfers). `false` models a
    /// runtime that hands a direction's next kernel to the device only once the one ahead has
    /// completed, as `tutti-runtime` over the object store does (one layer per request in
    /// flight: the store reissues the same IOCBs per layer), so every kernel pays the latency.
    pub queued_kernels_hide_latency: bool,
}

/// Writes an earlier request left behind when this one arrives (a runtime's write queue outlives
/// its requests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct WriteCarry {
    /// Bytes queued, not yet handed to the SSD: the policy grants them like this request's own.
    pub queued_bytes: u64,
    /// Bytes of a write already handed to the SSD (it cannot be taken back): it runs first, from
    /// time 0, paying the command latency like any kernel.
    pub in_flight_bytes: u64,
    /// Whether this request's reads wait until that write completed (`tutti-runtime` under
    /// slack-aware and no-overlap issues no read while a write is in flight); otherwise they
    /// share the SSD with it at the mixed-traffic rate.
    pub reads_wait_for_in_flight: bool,
}

/// What one run produced.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimResult {
    pub policy: &'static str,
    pub input_tokens: u32,
    pub prefix_tokens: u32,
    pub hit_rate: f64,
    pub ttft_us: f64,
    /// Sum of the layers' compute durations.
    pub compute_us: f64,
    /// GPU idle waiting for KV.
    pub bubble_us: f64,
    /// The bubble no layer-wise pipeline can avoid: layer 0's read at solo bandwidth, minus the
    /// compute that precedes its attention.
    pub fill_bound_us: f64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// Prefill time during which reads and writes shared the SSD.
    pub mixed_io_us: f64,
    pub write_backlog_bytes_at_ttft: u64,
    pub write_backlog_bytes_at_end: u64,
    /// Of `write_backlog_bytes_at_end`, the bytes left of the write kernel the SSD was serving
    /// when the run ended (transferring or paying its latency): 0 when no write was moving.
    pub write_in_flight_bytes_at_end: u64,
    /// Time decode steps took (writes never slow them in this model).
    pub decode_us: f64,
}

struct Job {
    layer: Option<u32>,
    bytes_total: u64,
    bytes_left: f64,
    release_us: f64,
    after_reads: bool,
    latency_left_us: f64,
    sm_budget: u32,
    /// A write already on the SSD when the run began, which reads may not pass (see
    /// [`WriteCarry::reads_wait_for_in_flight`]).
    holds_reads: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// No-overlap: before layer 0, until every read completed.
    Gate {
        layer: u32,
        since_us: f64,
    },
    PreAttention {
        layer: u32,
        end_us: f64,
    },
    WaitKv {
        layer: u32,
        since_us: f64,
    },
    PostAttention {
        layer: u32,
        end_us: f64,
    },
    Decode {
        step: u32,
        end_us: f64,
    },
    Done,
}

struct Sim<'a> {
    truth: &'a Profile,
    scheduler_table: &'a Profile,
    ssd: SsdModel,
    config: SimConfig,
    policy: &'a mut dyn IoPolicy,
    layers: &'a [LayerProfile],
    now_us: f64,
    reads: VecDeque<Job>,
    writes: VecDeque<Job>,
    /// Launches after attention, held while the layer waits: (offset past attention, issue).
    held: Vec<(f64, Issue)>,
    unissued_read_iocbs: Vec<u32>,
    unissued_read_bytes: Vec<u64>,
    /// Issued or not, not yet landed.
    pending_read_bytes: Vec<f64>,
    queued_write_bytes: u64,
    new_kv_bytes_per_layer: u64,
    bubble_us: f64,
    mixed_io_us: f64,
    prefill_done: bool,
}

/// Runs one request. `truth` gives the durations the simulated GPU takes; `scheduler_table` is
/// what the policy consults (usually the same table).
pub fn simulate(
    truth: &Profile,
    scheduler_table: &Profile,
    ssd: &SsdModel,
    config: &SimConfig,
    policy: &mut dyn IoPolicy,
) -> Result<SimResult> {
    simulate_with_backlog(truth, scheduler_table, ssd, config, policy, 0)
}

/// Runs one request that finds `write_backlog_bytes` of earlier requests' KV still queued for
/// writing (a runtime's write queue outlives its requests). The backlog counts in
/// `write_backlog_bytes_at_ttft` / `_at_end`, not in `write_bytes` (this request's new KV).
pub fn simulate_with_backlog(
    truth: &Profile,
    scheduler_table: &Profile,
    ssd: &SsdModel,
    config: &SimConfig,
    policy: &mut dyn IoPolicy,
    write_backlog_bytes: u64,
) -> Result<SimResult> {
    let carry = WriteCarry { queued_bytes: write_backlog_bytes, ..WriteCarry::default() };
    simulate_carried(truth, scheduler_table, ssd, config, policy, &carry)
}

/// Runs one request that finds `carry` of earlier requests' writes: queued bytes, and possibly a
/// write already on the SSD. Both count in `write_backlog_bytes_at_ttft` / `_at_end`, not in
/// `write_bytes` (this request's new KV).
pub fn simulate_carried(
    truth: &Profile,
    scheduler_table: &Profile,
    ssd: &SsdModel,
    config: &SimConfig,
    policy: &mut dyn IoPolicy,
    carry: &WriteCarry,
) -> Result<SimResult> {
    ssd.validate()?;
    if config.iocb_bytes == 0 {
        return Err(SchedulerError::InvalidConfig { field: "iocb_bytes".into(), reason: "must be > 0".into() });
    }
    // The policy counts I/O in IOCBs and prices them with the scheduler table's rows, which are
    // of one size: counts of another size would be priced as that size's bytes.
    let table_iocb_bytes = scheduler_table.iocb_bytes();
    if config.iocb_bytes != table_iocb_bytes {
        return Err(SchedulerError::InvalidConfig {
            field: "iocb_bytes".into(),
            reason: format!(
                "{} bytes, but the scheduler table's cost rows are of {table_iocb_bytes}-byte IOCBs: the policy would price \
                 these IOCBs as that size",
                config.iocb_bytes
            ),
        });
    }
    let bucket = truth.bucket(config.input_tokens, config.prefix_tokens)?;
    let layer_count = bucket.layers.len();
    // The table file's KV size is only checked > 0: the request's bytes must fit a u64 (the
    // write total with the carry bounds every byte count the run adds up later).
    let kv_bytes = truth.model().kv_bytes_per_token_per_layer;
    let too_large = || SchedulerError::InvalidConfig {
        field: "kv_bytes_per_token_per_layer".into(),
        reason: format!(
            "{kv_bytes} bytes per token per layer: {} tokens ({} cached) over {layer_count} layers, with {} bytes of writes carried \
             in, are past 2^64 bytes",
            config.input_tokens,
            config.prefix_tokens,
            carry.queued_bytes.saturating_add(carry.in_flight_bytes)
        ),
    };
    let new_tokens = config.input_tokens.checked_sub(config.prefix_tokens).ok_or_else(too_large)?;
    let read_bytes_per_layer = u64::from(config.prefix_tokens).checked_mul(kv_bytes).ok_or_else(too_large)?;
    let new_kv_bytes_per_layer = u64::from(new_tokens).checked_mul(kv_bytes).ok_or_else(too_large)?;
    let layers = layer_count as u64;
    read_bytes_per_layer.checked_mul(layers).ok_or_else(too_large)?;
    new_kv_bytes_per_layer
        .checked_mul(layers)
        .and_then(|bytes| bytes.checked_add(carry.queued_bytes))
        .and_then(|bytes| bytes.checked_add(carry.in_flight_bytes))
        .ok_or_else(too_large)?;
    let read_iocbs = u32::try_from(read_bytes_per_layer.div_ceil(config.iocb_bytes)).map_err(|_| SchedulerError::InvalidConfig {
        field: "iocb_bytes".into(),
        reason: "too small: more than u32::MAX IOCBs per layer".into(),
    })?;
    let mut writes = VecDeque::new();
    if carry.in_flight_bytes > 0 {
        writes.push_back(Job {
            layer: None,
            bytes_total: carry.in_flight_bytes,
            bytes_left: carry.in_flight_bytes as f64,
            release_us: 0.0,
            after_reads: false,
            latency_left_us: ssd.command_latency_us,
            sm_budget: scheduler_table.io_sm_budget_max(IoKind::Write).max(1),
            holds_reads: carry.reads_wait_for_in_flight,
        });
    }
    let sim = Sim {
        truth,
        scheduler_table,
        ssd: *ssd,
        config: *config,
        policy,
        layers: &bucket.layers,
        now_us: 0.0,
        reads: VecDeque::new(),
        writes,
        held: Vec::new(),
        unissued_read_iocbs: vec![read_iocbs; layer_count],
        unissued_read_bytes: vec![read_bytes_per_layer; layer_count],
        pending_read_bytes: vec![read_bytes_per_layer as f64; layer_count],
        queued_write_bytes: carry.queued_bytes,
        new_kv_bytes_per_layer,
        bubble_us: 0.0,
        mixed_io_us: 0.0,
        prefill_done: false,
    };
    sim.run(read_bytes_per_layer)
}

impl<'a> Sim<'a> {
    fn run(mut self, read_bytes_per_layer: u64) -> Result<SimResult> {
        let compute_us: f64 = self.layers.iter().map(|l| l.compute_duration_us).sum();
        let first = self.layers.first();
        let layer0_read_us = if read_bytes_per_layer == 0 {
            0.0
        } else {
            let budget = self.scheduler_table.io_sm_budget_max(IoKind::Read);
            self.ssd.kernel_duration_us(IoKind::Read, read_bytes_per_layer, budget)
        };
        let fill_bound_us = (layer0_read_us - first.map_or(0.0, |l| l.kv_needed_offset_us)).max(0.0);

        let mut phase = if self.layers.is_empty() { Phase::Done } else { self.start_layer(0)? };
        let mut ttft_us = if self.layers.is_empty() { 0.0 } else { f64::NAN };
        let mut write_backlog_bytes_at_ttft = 0;
        let mut events = 0u64;
        loop {
            phase = self.step_compute(phase)?;
            if self.prefill_done && ttft_us.is_nan() {
                ttft_us = self.now_us;
                write_backlog_bytes_at_ttft = self.write_backlog_bytes();
            }
            if phase == Phase::Done {
                break;
            }
            events += 1;
            if events > EVENT_COUNT_MAX {
                return Err(self.stuck(&phase, "event budget exhausted"));
            }
            let next_us = self.next_event_us(&phase);
            if !next_us.is_finite() {
                return Err(self.stuck(&phase, "nothing left that could make progress"));
            }
            self.advance_io(next_us);
        }
        let decode_us = self.now_us - ttft_us;
        Ok(SimResult {
            policy: self.policy.name(),
            input_tokens: self.config.input_tokens,
            prefix_tokens: self.config.prefix_tokens,
            hit_rate: f64::from(self.config.prefix_tokens) / f64::from(self.config.input_tokens),
            ttft_us,
            compute_us,
            bubble_us: self.bubble_us,
            fill_bound_us,
            // Checked against overflow before the run.
            read_bytes: read_bytes_per_layer.saturating_mul(self.layers.len() as u64),
            write_bytes: self.new_kv_bytes_per_layer.saturating_mul(self.layers.len() as u64),
            mixed_io_us: self.mixed_io_us,
            write_backlog_bytes_at_ttft,
            write_backlog_bytes_at_end: self.write_backlog_bytes(),
            write_in_flight_bytes_at_end: self.write_in_flight_bytes(),
            decode_us,
        })
    }

    fn stuck(&self, phase: &Phase, reason: &str) -> SchedulerError {
        SchedulerError::InvalidDecision {
            policy: self.policy.name(),
            location: format!("{phase:?} at {:.3} us", self.now_us),
            reason: format!("{reason} (unissued read IOCBs per layer: {:?})", self.unissued_read_iocbs),
        }
    }

    fn write_backlog_bytes(&self) -> u64 {
        let in_flight: f64 = self.writes.iter().map(|j| j.bytes_left).sum();
        self.queued_write_bytes + in_flight.round() as u64
    }

    /// Bytes left of the write kernel the SSD is serving now (0 when none is).
    fn write_in_flight_bytes(&self) -> u64 {
        match self.writes.front() {
            Some(head) if self.head_active(IoKind::Write) => head.bytes_left.round() as u64,
            _ => 0,
        }
    }

    fn outstanding_iocbs(&self, kind: IoKind) -> u32 {
        let queue = match kind {
            IoKind::Read => &self.reads,
            IoKind::Write => &self.writes,
        };
        let bytes: f64 = queue.iter().map(|j| j.bytes_left).sum();
        let iocbs = (bytes / self.config.iocb_bytes as f64).ceil();
        iocbs.min(f64::from(u32::MAX)) as u32
    }

    /// The outstanding reads by the SM budget of their jobs (`LayerView::outstanding_reads_by_budget`),
    /// each budget priced on its own rows: each job a kernel, or one per budget while queued
    /// kernels hide the latency; the IOCBs of a budget's bytes left, rounded up as
    /// `outstanding_iocbs` rounds all of them (so a table of one budget prices them as before).
    /// Not the runtime's hot path: a fresh vector per view.
    fn outstanding_reads_by_budget(&self) -> Vec<ReadsOnBudget> {
        let mut by_budget: Vec<(u32, f64, u32)> = Vec::new();
        for job in &self.reads {
            match by_budget.iter_mut().find(|(budget, _, _)| *budget == job.sm_budget) {
                Some((_, bytes, jobs)) => {
                    *bytes += job.bytes_left;
                    *jobs += 1;
                }
                None => by_budget.push((job.sm_budget, job.bytes_left, 1)),
            }
        }
        by_budget
            .into_iter()
            .map(|(sm_budget, bytes, jobs)| ReadsOnBudget {
                sm_budget,
                iocbs: (bytes / self.config.iocb_bytes as f64).ceil().min(f64::from(u32::MAX)) as u32,
                kernels: if self.config.queued_kernels_hide_latency { 1 } else { jobs },
            })
            .collect()
    }

    /// The IOCBs left of the write this request's reads wait behind, and the SM budget it runs
    /// on: the carried write that holds them (`WriteCarry::reads_wait_for_in_flight`; queued
    /// first, it is the write queue's head until it completes). Reads pass every other write.
    /// (0, 0) when none holds them.
    fn write_holding_reads(&self) -> (u32, u32) {
        match self.writes.front() {
            Some(head) if head.holds_reads => {
                let iocbs = (head.bytes_left / self.config.iocb_bytes as f64).ceil();
                (iocbs.min(f64::from(u32::MAX)) as u32, head.sm_budget)
            }
            _ => (0, 0),
        }
    }

    fn queued_write_iocbs(&self) -> u32 {
        let iocbs = self.queued_write_bytes.div_ceil(self.config.iocb_bytes);
        u32::try_from(iocbs).unwrap_or(u32::MAX)
    }

    fn layer_loaded(&self, layer: u32) -> bool {
        self.pending_read_bytes.get(layer as usize).is_none_or(|&b| b <= BYTES_EPSILON)
    }

    fn all_loaded(&self) -> bool {
        self.pending_read_bytes.iter().all(|&b| b <= BYTES_EPSILON)
    }

    /// Is the head of this queue moving bytes (or paying latency) right now?
    fn head_active(&self, kind: IoKind) -> bool {
        let (queue, other) = match kind {
            IoKind::Read => (&self.reads, &self.reads),
            IoKind::Write => (&self.writes, &self.reads),
        };
        let Some(head) = queue.front() else {
            return false;
        };
        if head.release_us > self.now_us {
            return false;
        }
        // Reads wait behind a carried write that holds them: it was queued first, so it is the
        // write queue's head until it completes.
        if kind == IoKind::Read && self.writes.front().is_some_and(|w| w.holds_reads) {
            return false;
        }
        // A gated write waits for every released read.
        !(head.after_reads && other.iter().any(|r| r.release_us <= self.now_us))
    }

    fn transferring(&self, kind: IoKind) -> bool {
        let queue = match kind {
            IoKind::Read => &self.reads,
            IoKind::Write => &self.writes,
        };
        self.head_active(kind) && queue.front().is_some_and(|j| j.latency_left_us <= 0.0)
    }

    fn rate_bytes_per_us(&self, kind: IoKind, sm_budget: u32) -> f64 {
        let other = match kind {
            IoKind::Read => IoKind::Write,
            IoKind::Write => IoKind::Read,
        };
        let mixed = if self.transferring(other) { self.ssd.mixed_bandwidth_fraction } else { 1.0 };
        self.ssd.kernel_bytes_per_s(kind, sm_budget) * mixed / 1e6
    }

    fn next_event_us(&self, phase: &Phase) -> f64 {
        let mut next = match *phase {
            Phase::PreAttention { end_us, .. } | Phase::PostAttention { end_us, .. } | Phase::Decode { end_us, .. } => end_us,
            Phase::Gate { .. } | Phase::WaitKv { .. } | Phase::Done => f64::INFINITY,
        };
        for kind in [IoKind::Read, IoKind::Write] {
            let queue = match kind {
                IoKind::Read => &self.reads,
                IoKind::Write => &self.writes,
            };
            let Some(head) = queue.front() else { continue };
            if head.release_us > self.now_us {
                next = next.min(head.release_us);
            } else if self.head_active(kind) {
                let done_us = if head.latency_left_us > 0.0 {
                    head.latency_left_us
                } else {
                    head.bytes_left / self.rate_bytes_per_us(kind, head.sm_budget)
                };
                next = next.min(self.now_us + done_us);
            }
        }
        next
    }

    /// Moves the SSD forward to `until_us` and retires finished jobs.
    fn advance_io(&mut self, until_us: f64) {
        let dt_us = (until_us - self.now_us).max(0.0);
        let read_moving = self.transferring(IoKind::Read);
        let write_moving = self.transferring(IoKind::Write);
        if read_moving && write_moving && !self.prefill_done {
            self.mixed_io_us += dt_us;
        }
        // Rates depend on both heads: take them all before either moves.
        let rates: Vec<(IoKind, f64)> = [IoKind::Read, IoKind::Write]
            .into_iter()
            .filter(|&kind| self.head_active(kind))
            .map(|kind| {
                let budget = match kind {
                    IoKind::Read => self.reads.front().map_or(0, |j| j.sm_budget),
                    IoKind::Write => self.writes.front().map_or(0, |j| j.sm_budget),
                };
                (kind, self.rate_bytes_per_us(kind, budget))
            })
            .collect();
        for (kind, rate) in rates {
            let queue = match kind {
                IoKind::Read => &mut self.reads,
                IoKind::Write => &mut self.writes,
            };
            if let Some(head) = queue.front_mut() {
                // A step that reaches the end `next_event_us` computed for the head (the same
                // expression, so the same float) ends it: past 2^34 µs a clock step is coarser
                // than the residue snapped below, so `now + left` may round short of the end and
                // leave a remainder whose own step rounds to 0 µs; the run then spun to its event
                // budget.
                let now_us = self.now_us;
                if head.latency_left_us > 0.0 {
                    let ends_here = now_us + head.latency_left_us <= until_us;
                    head.latency_left_us -= dt_us;
                    // Snap float residue (below a picosecond) so the next step moves bytes.
                    if ends_here || head.latency_left_us < RESIDUE_US {
                        head.latency_left_us = 0.0;
                    }
                } else {
                    let ends_here = now_us + head.bytes_left / rate <= until_us;
                    head.bytes_left -= rate * dt_us;
                    if ends_here || head.bytes_left < rate * RESIDUE_US {
                        head.bytes_left = 0.0;
                    }
                }
            }
        }
        self.now_us = until_us;
        for kind in [IoKind::Read, IoKind::Write] {
            loop {
                let queue = match kind {
                    IoKind::Read => &mut self.reads,
                    IoKind::Write => &mut self.writes,
                };
                let done =
                    queue.front().is_some_and(|j| j.release_us <= until_us && j.latency_left_us <= 0.0 && j.bytes_left <= BYTES_EPSILON);
                if !done {
                    break;
                }
                let Some(job) = queue.pop_front() else { break };
                // The next kernel was already queued behind this one: its latency overlapped
                // (unless the runtime hands it over only now).
                let hide_latency = self.config.queued_kernels_hide_latency;
                if let Some(next) = queue.front_mut() {
                    if hide_latency && next.release_us <= until_us {
                        next.latency_left_us = 0.0;
                    }
                }
                if let (IoKind::Read, Some(layer)) = (kind, job.layer) {
                    if let Some(pending) = self.pending_read_bytes.get_mut(layer as usize) {
                        *pending = 0.0_f64.max(*pending - job.bytes_total as f64);
                    }
                }
            }
        }
    }

    fn start_layer(&mut self, layer: u32) -> Result<Phase> {
        let (in_flight_write_iocbs, in_flight_write_sm_budget) = self.write_holding_reads();
        let reads_by_budget = self.outstanding_reads_by_budget();
        let view = LayerView {
            table: self.scheduler_table,
            input_tokens: self.config.input_tokens,
            prefix_tokens: self.config.prefix_tokens,
            layer,
            unissued_read_iocbs: &self.unissued_read_iocbs,
            outstanding_read_iocbs: self.outstanding_iocbs(IoKind::Read),
            outstanding_reads_by_budget: &reads_by_budget,
            // Each read job pays the latency unless queued kernels hide it (then one does).
            outstanding_read_kernels: if self.config.queued_kernels_hide_latency {
                u32::from(!self.reads.is_empty())
            } else {
                u32::try_from(self.reads.len()).unwrap_or(u32::MAX)
            },
            outstanding_write_iocbs: self.outstanding_iocbs(IoKind::Write),
            outstanding_write_kernels: self.outstanding_write_kernels(),
            in_flight_write_iocbs,
            in_flight_write_sm_budget,
            queued_write_iocbs: self.queued_write_iocbs(),
        };
        let plan = self.policy.plan_layer(&view)?;
        let profile = self.layer(layer)?.clone();
        for issue in plan.issues {
            if issue.offset_us >= profile.kv_needed_offset_us && issue.offset_us > 0.0 {
                self.held.push((issue.offset_us - profile.kv_needed_offset_us, issue));
            } else {
                self.launch(issue, self.now_us + issue.offset_us.max(0.0))?;
            }
        }
        if plan.wait_for_all_reads {
            return Ok(Phase::Gate { layer, since_us: self.now_us });
        }
        Ok(Phase::PreAttention { layer, end_us: self.now_us + profile.kv_needed_offset_us })
    }

    fn layer(&self, layer: u32) -> Result<&LayerProfile> {
        self.layers.get(layer as usize).ok_or_else(|| SchedulerError::OutOfRange {
            what: "layer",
            value: u64::from(layer),
            min: 0,
            max: self.layers.len().saturating_sub(1) as u64,
        })
    }

    /// Turns a decision into SSD jobs, rejecting impossible ones.
    fn launch(&mut self, issue: Issue, release_us: f64) -> Result<()> {
        let name = self.policy.name();
        let bad = |reason: String| SchedulerError::InvalidDecision { policy: name, location: format!("{issue:?}"), reason };
        if issue.kind == IoKind::Write && issue.iocb_count == 0 && issue.slack_us.is_finite() && issue.slack_us >= 0.0 {
            // Window time where not one IOCB fits (`Issue::slack_us`): the simulator moves
            // whole IOCBs, so there is nothing to move.
            return Ok(());
        }
        if !issue.offset_us.is_finite() || issue.iocb_count == 0 {
            return Err(bad("offset must be finite and iocb_count > 0".into()));
        }
        // At most what is left (below): a count past it saturates rather than wraps.
        let want_bytes = u64::from(issue.iocb_count).saturating_mul(self.config.iocb_bytes);
        let (bytes, layer) = match issue.kind {
            IoKind::Read => {
                let layer = issue.layer.ok_or_else(|| bad("a read must name its layer".into()))?;
                let index = layer as usize;
                let unissued = self.unissued_read_iocbs.get_mut(index).ok_or_else(|| bad(format!("layer {layer} does not exist")))?;
                if issue.iocb_count > *unissued {
                    return Err(bad(format!("{} IOCBs requested, {} unissued", issue.iocb_count, unissued)));
                }
                *unissued -= issue.iocb_count;
                let bytes = want_bytes.min(self.unissued_read_bytes[index]);
                self.unissued_read_bytes[index] -= bytes;
                (bytes, Some(layer))
            }
            IoKind::Write => {
                let queued = self.queued_write_iocbs();
                if issue.iocb_count > queued {
                    return Err(bad(format!("{} IOCBs requested, {queued} queued", issue.iocb_count)));
                }
                let bytes = want_bytes.min(self.queued_write_bytes);
                self.queued_write_bytes -= bytes;
                (bytes, None)
            }
        };
        if bytes == 0 {
            return Ok(());
        }
        let job = Job {
            layer,
            bytes_total: bytes,
            bytes_left: bytes as f64,
            release_us,
            after_reads: issue.after_reads,
            latency_left_us: self.ssd.command_latency_us,
            sm_budget: issue.sm_budget.max(1),
            holds_reads: false,
        };
        let queue = match issue.kind {
            IoKind::Read => &mut self.reads,
            IoKind::Write => &mut self.writes,
        };
        // FIFO by launch time; equal times keep issue order.
        let at = queue.partition_point(|j| j.release_us <= release_us);
        queue.insert(at, job);
        Ok(())
    }

    /// `reads_by_budget`: `outstanding_reads_by_budget()`, kept by the caller while the policy
    /// reads the view.
    fn queue_view<'s>(&self, context_tokens: u32, reads_by_budget: &'s [ReadsOnBudget]) -> QueueView<'s>
    where
        'a: 's,
    {
        let (in_flight_write_iocbs, in_flight_write_sm_budget) = self.write_holding_reads();
        QueueView {
            table: self.scheduler_table,
            context_tokens,
            outstanding_read_iocbs: self.outstanding_iocbs(IoKind::Read),
            outstanding_reads_by_budget: reads_by_budget,
            outstanding_write_iocbs: self.outstanding_iocbs(IoKind::Write),
            outstanding_write_kernels: self.outstanding_write_kernels(),
            in_flight_write_iocbs,
            in_flight_write_sm_budget,
            queued_write_iocbs: self.queued_write_iocbs(),
        }
    }

    /// Write jobs not completed, as the kernels that pay the command latency (one when queued
    /// kernels hide it), as for reads.
    fn outstanding_write_kernels(&self) -> u32 {
        if self.config.queued_kernels_hide_latency {
            u32::from(!self.writes.is_empty())
        } else {
            u32::try_from(self.writes.len()).unwrap_or(u32::MAX)
        }
    }

    fn start_decode_step(&mut self, step: u32) -> Result<Phase> {
        if step >= self.config.decode_step_count {
            return Ok(Phase::Done);
        }
        let context_tokens = self.config.input_tokens.saturating_add(step);
        // As the runtime does (`Runtime::decode_step`): a context before a table's first decode
        // row is priced as that row (`Profile::decode_pricing_context`, one rule for both), for
        // the step's length on the simulated GPU as for the policy's slack. `decode_step` alone
        // refuses such a context, which ended the run on a table import, `check` and the runtime
        // accept. Validation refuses a table with no decode row, so a step priced so is always
        // in range, and an error from the policy (`OutOfRange` included) ends the run: it once
        // stood for "no decode row, nothing written", a case no table reaches, and hid whatever
        // else had gone wrong.
        let duration_us = self.truth.decode_step(self.truth.decode_pricing_context(context_tokens))?.duration_us;
        let reads_by_budget = self.outstanding_reads_by_budget();
        let view = self.queue_view(self.scheduler_table.decode_pricing_context(context_tokens), &reads_by_budget);
        for issue in self.policy.plan_decode_step(&view)? {
            self.launch(issue, self.now_us + issue.offset_us.max(0.0))?;
        }
        Ok(Phase::Decode { step, end_us: self.now_us + duration_us })
    }

    /// Applies every compute transition due at `now_us`.
    fn step_compute(&mut self, mut phase: Phase) -> Result<Phase> {
        // Bounded: each pass either changes phase or returns.
        for _ in 0..8 {
            let now = self.now_us;
            let next = match phase {
                Phase::Gate { layer, since_us } if self.all_loaded() => {
                    self.bubble_us += now - since_us;
                    let offset = self.layer(layer)?.kv_needed_offset_us;
                    Phase::PreAttention { layer, end_us: now + offset }
                }
                Phase::PreAttention { layer, end_us } if end_us <= now => {
                    if self.layer_loaded(layer) {
                        self.enter_attention(layer)?
                    } else {
                        Phase::WaitKv { layer, since_us: now }
                    }
                }
                Phase::WaitKv { layer, since_us } if self.layer_loaded(layer) => {
                    self.bubble_us += now - since_us;
                    self.enter_attention(layer)?
                }
                Phase::PostAttention { layer, end_us } if end_us <= now => {
                    self.queued_write_bytes += self.new_kv_bytes_per_layer;
                    if layer + 1 < self.layers.len() as u32 {
                        self.start_layer(layer + 1)?
                    } else {
                        self.prefill_done = true;
                        let reads_by_budget = self.outstanding_reads_by_budget();
                        let view = self.queue_view(self.config.input_tokens, &reads_by_budget);
                        for issue in self.policy.plan_prefill_end(&view)? {
                            self.launch(issue, now + issue.offset_us.max(0.0))?;
                        }
                        self.start_decode_step(0)?
                    }
                }
                Phase::Decode { step, end_us } if end_us <= now => self.start_decode_step(step + 1)?,
                _ => return Ok(phase),
            };
            phase = next;
        }
        Ok(phase)
    }

    fn enter_attention(&mut self, layer: u32) -> Result<Phase> {
        let now = self.now_us;
        for (after_us, issue) in std::mem::take(&mut self.held) {
            self.launch(issue, now + after_us)?;
        }
        let profile = self.layer(layer)?;
        let rest_us = profile.compute_duration_us - profile.kv_needed_offset_us;
        Ok(Phase::PostAttention { layer, end_us: now + rest_us.max(0.0) })
    }
}
