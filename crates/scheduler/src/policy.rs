//! When and how many IOCBs to issue: Tutti's slack-aware policy (§3.3, "Decoupled Scheduling for
//! Read and Write") and the two baselines it is compared with, behind one trait.
//!
//! The runtime (the object store's `retrieve_layer`/`store_layer`, or the simulator) calls
//! [`IoPolicy::plan_layer`] before each prefill layer, [`IoPolicy::plan_prefill_end`] once the
//! last layer is done, and [`IoPolicy::plan_decode_step`] before each decode step. A policy only
//! sees what a runtime knows — the profile table, what is still unissued, and how many issued
//! IOCBs have not completed yet — and answers with kernels to launch at offsets into the layer.

use crate::error::{Result, SchedulerError};
use crate::table::{IoKind, Profile, SlackWindow};

/// One I/O kernel launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Issue {
    pub kind: IoKind,
    /// Reads: the layer whose cached KV is loaded. Writes: `None` (the oldest queued writes).
    pub layer: Option<u32>,
    pub iocb_count: u32,
    pub sm_budget: u32,
    /// Launch time from the start of the layer (or decode step).
    pub offset_us: f64,
    /// Start only after every read issued before it has completed (a stream dependency, so that
    /// reads and writes never share the SSD).
    pub after_reads: bool,
    /// A write of 0 IOCBs stands for this much window time (from `offset_us` to the window's
    /// end) in which not one IOCB finishes: a window shorter than the smallest write kernel. A
    /// runtime that moves bigger units than an IOCB (whole layers) adds such time up until a
    /// unit is paid for, so a write longer than every window still goes (overrunning the window
    /// it goes in); one that moves IOCBs has nothing to move. In a decode step that one write
    /// layer outstanding takes whole, the step's whole time (offset 0) stands for time to bank
    /// while that layer runs: a runtime adds it to its carry without releasing a layer behind the
    /// one outstanding (`SlackAware::plan_decode_step`). 0 for every other issue.
    pub slack_us: f64,
}

/// The decisions for one prefill layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerPlan {
    /// Hold the layer's first kernel until every read of the request completed (no overlap).
    pub wait_for_all_reads: bool,
    pub issues: Vec<Issue>,
}

/// What the runtime knows before a prefill layer begins.
#[derive(Clone, Copy, Debug)]
pub struct LayerView<'a> {
    pub table: &'a Profile,
    pub input_tokens: u32,
    pub prefix_tokens: u32,
    /// The layer about to begin.
    pub layer: u32,
    /// IOCBs of each layer's cached KV not issued yet (index = layer).
    pub unissued_read_iocbs: &'a [u32],
    /// Issued and not completed, as the completion queue reports.
    pub outstanding_read_iocbs: u32,
    /// How many kernels the outstanding reads reach the SSD as, one after another, each paying
    /// the command latency: `tutti-runtime` hands a layer over only once the one ahead
    /// completed, so its layers waiting and in flight; 1 for a runtime whose queued kernels
    /// hide the latency (the SSD already holds their commands). 0 counts as 1.
    pub outstanding_read_kernels: u32,
    /// The outstanding reads by the SM budget they run on, which prices them: each entry on its
    /// own budget, summed ([`LayerView::outstanding_reads_us`]). Budgets are priced each on its
    /// own rows because the rows need not be monotone across budgets (docs/scheduler.md's
    /// measured io table has reads on 1 SM faster than on 2): one budget for a mixed set,
    /// the smallest, took a layer on a larger budget for the smaller's faster rows, and priced
    /// on the slowest it overpriced the rest. `tutti-runtime` hands a whole layer over on the
    /// budget its plan's issues of it chose (the largest of them), so a run-ahead layer partly
    /// placed in a window of few free SMs runs entirely on those: one entry per budget of its
    /// layers waiting and in flight, each layer one kernel, built in a buffer kept across
    /// calls. The simulator: one per budget of its read jobs, each job a kernel (one per
    /// budget while queued kernels hide the latency). An entry's budget 0 (not known) is priced
    /// on the table's largest read budget, one below every profiled read budget on the slowest
    /// of them, as [`LayerView::in_flight_write_sm_budget`] is. The IOCBs and kernels of
    /// `outstanding_read_iocbs` and `outstanding_read_kernels` that no entry holds (all of them
    /// when it is empty) are priced on the table's largest read budget.
    pub outstanding_reads_by_budget: &'a [ReadsOnBudget],
    /// Writes released (granted) and not completed, in IOCBs.
    pub outstanding_write_iocbs: u32,
    /// How many kernels the outstanding writes reach the SSD as, each paying the command
    /// latency (`tutti-runtime` hands them over a layer at a time); 0 counts as 1.
    pub outstanding_write_kernels: u32,
    /// Of the outstanding writes, the IOCBs of the one write kernel the SSD holds now, which a
    /// read waits behind (the read/write barrier); the others wait for the reads. `tutti-runtime`
    /// hands its write layers over one at a time, and none while a read is pending: its write
    /// layer in flight. Not counted, there nor in `outstanding_write_iocbs`: a retiring request's
    /// write (one that failed, or whose wait timed out, while the device still holds it). It is
    /// outside the barrier, since its completion may be lost: reads, and the next store's
    /// write, are handed over beside it, and it is priced as done. The simulator: the write
    /// carried in flight when this request's reads wait for it
    /// (`WriteCarry::reads_wait_for_in_flight`). 0 when none is.
    pub in_flight_write_iocbs: u32,
    /// The SM budget that write kernel runs on, which prices it: `tutti-runtime` hands a layer
    /// over on its store's budget, the latest grant's that released layers of it (a decode
    /// step's free SMs, or the table's largest for a forced write or a flush), recorded at the
    /// handover (a grant that released more of the store's layers while this one ran changes
    /// the store's budget, not this layer's); the simulator runs its carried write on the
    /// table's largest.
    /// 0 when not known: priced on the table's largest write budget. A budget below every
    /// profiled write budget is priced on the slowest of them (fewer SMs need not be slower,
    /// so the smallest's rows are no bound for it).
    pub in_flight_write_sm_budget: u32,
    /// New KV of finished layers waiting to be written, in IOCBs.
    pub queued_write_iocbs: u32,
}

/// What the runtime knows at the end of prefill or before a decode step.
#[derive(Clone, Copy, Debug)]
pub struct QueueView<'a> {
    pub table: &'a Profile,
    /// Context length (prompt plus tokens generated so far).
    pub context_tokens: u32,
    pub outstanding_read_iocbs: u32,
    /// As [`LayerView::outstanding_reads_by_budget`]; the IOCBs no entry holds are priced as one
    /// kernel on the table's largest read budget.
    pub outstanding_reads_by_budget: &'a [ReadsOnBudget],
    pub outstanding_write_iocbs: u32,
    /// As [`LayerView::outstanding_write_kernels`].
    pub outstanding_write_kernels: u32,
    /// As [`LayerView::in_flight_write_iocbs`]: the write kernel on the device now, of the
    /// outstanding ones.
    pub in_flight_write_iocbs: u32,
    /// As [`LayerView::in_flight_write_sm_budget`].
    pub in_flight_write_sm_budget: u32,
    pub queued_write_iocbs: u32,
}

/// Outstanding reads that run on one SM budget ([`LayerView::outstanding_reads_by_budget`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadsOnBudget {
    /// 0 when not known (the table's largest read budget).
    pub sm_budget: u32,
    pub iocbs: u32,
    /// How many kernels they reach the SSD as, one after another, each paying the command
    /// latency; 0 counts as 1.
    pub kernels: u32,
}

impl LayerView<'_> {
    /// How long the outstanding reads hold the SSD, each on the SMs it runs on: the price
    /// [`SlackAware`] puts on them.
    pub fn outstanding_reads_us(&self) -> Result<f64> {
        outstanding_reads_us(self.table, self.outstanding_read_iocbs, self.outstanding_read_kernels, self.outstanding_reads_by_budget)
    }
}

impl QueueView<'_> {
    /// As [`LayerView::outstanding_reads_us`], the IOCBs no entry holds as one kernel.
    pub fn outstanding_reads_us(&self) -> Result<f64> {
        outstanding_reads_us(self.table, self.outstanding_read_iocbs, 1, self.outstanding_reads_by_budget)
    }
}

/// A scheduling policy.
pub trait IoPolicy {
    fn name(&self) -> &'static str;
    fn plan_layer(&mut self, view: &LayerView<'_>) -> Result<LayerPlan>;
    fn plan_prefill_end(&mut self, view: &QueueView<'_>) -> Result<Vec<Issue>>;
    fn plan_decode_step(&mut self, view: &QueueView<'_>) -> Result<Vec<Issue>>;
}

/// The three policies by name (CLI, sweeps).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    SlackAware,
    NaivePipeline,
    NoOverlap,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 3] = [Self::SlackAware, Self::NaivePipeline, Self::NoOverlap];

    pub fn name(self) -> &'static str {
        match self {
            Self::SlackAware => "slack-aware",
            Self::NaivePipeline => "naive-pipeline",
            Self::NoOverlap => "no-overlap",
        }
    }

    pub fn build(self) -> Box<dyn IoPolicy> {
        match self {
            Self::SlackAware => Box::new(SlackAware),
            Self::NaivePipeline => Box::new(NaivePipeline),
            Self::NoOverlap => Box::new(NoOverlap),
        }
    }
}

fn read_all(layer: u32, iocb_count: u32, sm_budget: u32) -> Issue {
    Issue { kind: IoKind::Read, layer: Some(layer), iocb_count, sm_budget, offset_us: 0.0, after_reads: false, slack_us: 0.0 }
}

fn write_all(iocb_count: u32, sm_budget: u32, after_reads: bool) -> Issue {
    Issue { kind: IoKind::Write, layer: None, iocb_count, sm_budget, offset_us: 0.0, after_reads, slack_us: 0.0 }
}

/// Tutti's policy.
///
/// Before layer `k`:
/// 1. any of layer `k`'s own KV still unissued is on the critical path: issue it now;
/// 2. layer `k+1`'s reads go into this layer's slack windows — in each window as many IOCBs as
///    the I/O cost table says finish inside it, queued behind the reads outstanding and the
///    write kernel in flight (under the barrier a read waits while a write is in flight; the
///    other released writes wait for the reads). If the
///    windows cannot hold all of them, no window is suitable (reads are the bottleneck): issue
///    them all now rather than stall;
/// 3. windows with room left take reads of later layers (run-ahead);
/// 4. writes go only into room that is left once *every* read of the request is issued, start
///    after those reads complete, and must finish inside the window; otherwise they wait for the
///    decode steps (each step is one window), and what does not fit there stays queued for later
///    requests (the write backlog). A window with room where not one write IOCB finishes (on
///    SMs the cost rows price) is granted as time: a write of 0 IOCBs with
///    [`Issue::slack_us`], which a runtime moving whole layers adds up (else a write longer
///    than every window never went).
#[derive(Clone, Copy, Debug, Default)]
pub struct SlackAware;

/// Output of a window-filling pass.
struct Fill {
    issues: Vec<Issue>,
    ssd_free_at_us: f64,
}

/// Places `targets` (layer, IOCBs; layer `None` for writes) into `windows`, in order, each
/// kernel starting once the SSD is estimated free and finishing before its window closes. A
/// window with room where not one write IOCB finishes gets a write of 0 IOCBs standing for its
/// time ([`Issue::slack_us`]); the SSD is then taken as busy to the window's end.
fn fill_windows(
    table: &Profile,
    kind: IoKind,
    windows: &[SlackWindow],
    mut ssd_free_at_us: f64,
    targets: &mut [(Option<u32>, u32)],
) -> Result<Fill> {
    let budget_max = table.io_sm_budget_max(kind);
    let mut issues = Vec::new();
    for window in windows {
        let budget = window.free_sms.min(budget_max);
        if budget == 0 {
            continue;
        }
        for target in targets.iter_mut().filter(|t| t.1 > 0) {
            // Kernels of one window queue behind each other on the SSD.
            let start_us = window.offset_us.max(ssd_free_at_us);
            let room_us = window.end_us() - start_us;
            if room_us <= 0.0 {
                break;
            }
            let count = largest_fitting(table, kind, budget, target.1, room_us)?;
            if count == 0 {
                // Not one IOCB fits. A write priced on these SMs passes the window's time on,
                // so that a layer bigger than every window still goes; on SMs below every
                // profiled budget no write can be priced, and the window goes unused.
                if kind == IoKind::Write && table.io_duration_us(kind, 1, budget).is_ok() {
                    issues.push(Issue {
                        kind,
                        layer: target.0,
                        iocb_count: 0,
                        sm_budget: budget,
                        offset_us: start_us,
                        after_reads: true,
                        slack_us: room_us,
                    });
                    ssd_free_at_us = window.end_us();
                }
                break;
            }
            issues.push(Issue {
                kind,
                layer: target.0,
                iocb_count: count,
                sm_budget: budget,
                offset_us: start_us,
                after_reads: kind == IoKind::Write,
                slack_us: 0.0,
            });
            target.1 -= count;
            ssd_free_at_us = start_us + table.io_duration_us(kind, count, budget)?;
            if target.1 > 0 {
                // This window is full; the rest of the target goes to the next one.
                break;
            }
        }
    }
    Ok(Fill { issues, ssd_free_at_us })
}

/// The budget I/O the view says runs on `sm_budget` SMs is priced on
/// (`LayerView::in_flight_write_sm_budget` for the write kernel in flight,
/// `LayerView::outstanding_reads_by_budget` for the outstanding reads): 0 (not known) is the
/// table's largest budget of that kind.
fn priced_budget(table: &Profile, kind: IoKind, sm_budget: u32) -> u32 {
    match sm_budget {
        0 => table.io_sm_budget_max(kind),
        // Below every profiled budget `io_duration_us` cannot price it. Not on the smallest:
        // fewer SMs need not be slower (`Profile::io_duration_us`), so the smallest's rows may
        // be faster than a larger budget's, and fewer SMs still are likely slower yet. Above
        // every profiled budget, it is priced on the slowest of them all.
        budget if budget < table.io_sm_budget_min(kind) => u32::MAX,
        budget => budget,
    }
}

/// The outstanding reads, as the kernels they reach the SSD as, each entry of `by_budget` on the
/// SMs it runs on and what no entry holds of `iocbs` and `kernels` on the table's largest
/// (`LayerView::outstanding_reads_by_budget`): the price `plan_layer` and `plan_decode_step`
/// both put on them.
fn outstanding_reads_us(table: &Profile, iocbs: u32, kernels: u32, by_budget: &[ReadsOnBudget]) -> Result<f64> {
    let (mut rest_iocbs, mut rest_kernels, mut total_us) = (iocbs, kernels, 0.0);
    for entry in by_budget.iter().filter(|entry| entry.iocbs > 0) {
        total_us +=
            kernels_duration_us(table, IoKind::Read, entry.iocbs, entry.kernels, priced_budget(table, IoKind::Read, entry.sm_budget))?;
        rest_iocbs = rest_iocbs.saturating_sub(entry.iocbs);
        // As `kernels_duration_us` counts them.
        rest_kernels = rest_kernels.saturating_sub(entry.kernels.clamp(1, entry.iocbs));
    }
    Ok(total_us + kernels_duration_us(table, IoKind::Read, rest_iocbs, rest_kernels, table.io_sm_budget_max(IoKind::Read))?)
}

/// The outstanding writes ahead of new I/O, as (the write kernel in flight, priced on the SMs
/// it runs on; what all outstanding writes, as their kernels on the largest budget, add to it,
/// never less than nothing): the price `plan_layer` and `plan_decode_step` both put on them.
fn outstanding_writes_us(
    table: &Profile,
    in_flight_iocbs: u32,
    in_flight_sm_budget: u32,
    outstanding_iocbs: u32,
    outstanding_kernels: u32,
) -> Result<(f64, f64)> {
    let largest = table.io_sm_budget_max(IoKind::Write);
    let in_flight_iocbs = in_flight_iocbs.min(outstanding_iocbs);
    let in_flight_us =
        kernels_duration_us(table, IoKind::Write, in_flight_iocbs, 1, priced_budget(table, IoKind::Write, in_flight_sm_budget))?;
    let behind_us = (kernels_duration_us(table, IoKind::Write, outstanding_iocbs, outstanding_kernels, largest)?
        - kernels_duration_us(table, IoKind::Write, in_flight_iocbs, 1, largest)?)
    .max(0.0);
    Ok((in_flight_us, behind_us))
}

/// `iocbs` IOCBs reaching the SSD as `kernels` kernels one after another (as even as whole IOCBs
/// allow), each paying its own latency; 0 kernels counts as 1.
fn kernels_duration_us(table: &Profile, kind: IoKind, iocbs: u32, kernels: u32, budget: u32) -> Result<f64> {
    if iocbs == 0 {
        return Ok(0.0);
    }
    let kernels = kernels.clamp(1, iocbs);
    let (per_kernel, rest) = (iocbs / kernels, iocbs % kernels);
    let larger_us = if rest == 0 { 0.0 } else { f64::from(rest) * table.io_duration_us(kind, per_kernel + 1, budget)? };
    Ok(larger_us + f64::from(kernels - rest) * table.io_duration_us(kind, per_kernel, budget)?)
}

/// The most IOCBs (≤ `want`) whose kernel finishes within `room_us`; 0 if none does or the budget
/// is below every profiled one.
fn largest_fitting(table: &Profile, kind: IoKind, budget: u32, want: u32, room_us: f64) -> Result<u32> {
    let fits = |n: u32| -> Result<bool> {
        match table.io_duration_us(kind, n, budget) {
            Ok(d) => Ok(d <= room_us),
            Err(SchedulerError::OutOfRange { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    };
    if !fits(1)? {
        return Ok(0);
    }
    // Durations are validated non-decreasing in the count: binary search.
    let (mut lo, mut hi) = (1u32, want);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Ok(lo)
}

impl SlackAware {
    /// The layer's slack windows, conservative in time and free SMs between grid points
    /// ([`Profile::slack_windows_between`]).
    fn layer_windows(view: &LayerView<'_>) -> Result<Vec<SlackWindow>> {
        let mut windows = Vec::new();
        view.table.slack_windows_between(view.input_tokens, view.prefix_tokens, view.layer, &mut windows)?;
        Ok(windows)
    }
}

impl IoPolicy for SlackAware {
    fn name(&self) -> &'static str {
        PolicyKind::SlackAware.name()
    }

    fn plan_layer(&mut self, view: &LayerView<'_>) -> Result<LayerPlan> {
        let table = view.table;
        let windows = Self::layer_windows(view)?;
        let read_budget = table.io_sm_budget_max(IoKind::Read);
        let layer = view.layer as usize;
        let mut unissued = view.unissued_read_iocbs.to_vec();
        let mut plan = LayerPlan::default();
        // Reads issued and not completed, priced as the kernels they reach the SSD as: as one,
        // three layers handed over one at a time were taken to pay one command latency, and
        // run-ahead reads went into room their other latencies had taken. The write kernel in
        // flight holds the SSD too (the barrier: a read waits while a write is in flight):
        // priced from the reads alone, the next layer's reads went into windows a write carried
        // in from the last request still took. Only that one: the other released writes wait
        // for the reads (no write is handed over while a read is pending), so they come after
        // them, before new writes (step 4). Priced ahead as well, a decode step's L released
        // layers pushed every layer's reads of the next prefill L-1 write kernels late, past
        // its windows: each layer's reads went at once and nothing ran ahead. The writes behind
        // are all outstanding ones as their kernels, less the one in flight: for layers of one
        // size, the others as their kernels. The one in flight is priced on the SMs it runs on
        // (a decode step's free SMs): on the table's largest budget, a layer a 2-SM step
        // released was priced as its 4-SM time and the next layer's reads went into windows
        // it still took. The others, whose budgets the view does not give, are priced on the
        // largest, as before. The reads are priced on the SMs they run on as well, each budget
        // on its own rows (`LayerView::outstanding_reads_by_budget`): `tutti-runtime` hands a
        // whole layer over on the budget its plan chose, so a run-ahead layer placed partly in
        // a 2-SM window runs entirely on 2 SMs; priced on the largest, it was taken for its
        // 4-SM time and writes (rule 4) were placed into time it still took. Rows need not be
        // monotone across budgets, so no one budget prices a mixed set right.
        let (in_flight_write_us, writes_behind_us) = outstanding_writes_us(
            table,
            view.in_flight_write_iocbs,
            view.in_flight_write_sm_budget,
            view.outstanding_write_iocbs,
            view.outstanding_write_kernels,
        )?;
        let mut ssd_free_at_us = view.outstanding_reads_us()? + in_flight_write_us;

        // 1. This layer's KV is needed now.
        if let Some(own) = unissued.get_mut(layer).filter(|c| **c > 0) {
            plan.issues.push(read_all(view.layer, *own, read_budget));
            ssd_free_at_us += table.io_duration_us(IoKind::Read, *own, read_budget)?;
            *own = 0;
        }

        // 2 + 3. Next layer into the windows, then run-ahead; if the next layer does not fit,
        // issue it immediately and run ahead with what is left.
        let mut targets: Vec<(Option<u32>, u32)> =
            (layer + 1..unissued.len()).map(|l| (Some(l as u32), unissued[l])).filter(|t| t.1 > 0).collect();
        let mut trial = targets.clone();
        let fill = fill_windows(table, IoKind::Read, &windows, ssd_free_at_us, &mut trial)?;
        let next_fits = trial.first().zip(targets.first()).is_none_or(|(after, before)| before.0 != Some(view.layer + 1) || after.1 == 0);
        let fill = if next_fits {
            targets = trial;
            fill
        } else {
            let next = targets.remove(0);
            plan.issues.push(read_all(view.layer + 1, next.1, read_budget));
            ssd_free_at_us += table.io_duration_us(IoKind::Read, next.1, read_budget)?;
            fill_windows(table, IoKind::Read, &windows, ssd_free_at_us, &mut targets)?
        };
        plan.issues.extend(fill.issues);
        ssd_free_at_us = fill.ssd_free_at_us;

        // 4. Writes only once no read of this request is left to issue.
        // Whether any is left, not how many: per-layer counts can sum past a u32.
        let reads_left = targets.iter().any(|t| t.1 > 0);
        if !reads_left && view.queued_write_iocbs > 0 {
            // The SSD is free once the write in flight, the reads and the writes released
            // earlier are done, one after the other (the first two counted in `ssd_free_at_us`);
            // as their max, the new writes were placed into the earlier writes' time.
            let mut writes = [(None, view.queued_write_iocbs)];
            let fill = fill_windows(table, IoKind::Write, &windows, ssd_free_at_us + writes_behind_us, &mut writes)?;
            plan.issues.extend(fill.issues);
        }
        Ok(plan)
    }

    fn plan_prefill_end(&mut self, _view: &QueueView<'_>) -> Result<Vec<Issue>> {
        // Deferred writes wait for decode slack: issuing them now would contend with the next
        // request's reads.
        Ok(Vec::new())
    }

    fn plan_decode_step(&mut self, view: &QueueView<'_>) -> Result<Vec<Issue>> {
        if view.queued_write_iocbs == 0 {
            return Ok(Vec::new());
        }
        let step = view.table.decode_step(view.context_tokens)?;
        let window = SlackWindow { offset_us: 0.0, duration_us: step.duration_us, free_sms: step.free_sms };
        let table = view.table;
        let write_budget = table.io_sm_budget_max(IoKind::Write);
        // Reads and writes never share the SSD (the barrier): what is outstanding of each runs
        // one after the other, the writes as the kernels they reach the SSD as. The write
        // kernel in flight is priced on the SMs it runs on (a decode step's free SMs), as in
        // `plan_layer`: on the table's largest budget, a 1-IOCB write on 2 SMs (300 µs on the
        // test table) was taken for 200 µs and a 1000 µs step granted 4 IOCBs (800 µs) from
        // 200, which ran 100 µs past the step. The others, whose budgets the view does not
        // give, on the largest, as what all outstanding writes add to the one in flight, never
        // less than nothing: the same price as `plan_layer`'s. Where the table makes a kernel
        // cost more than the smaller kernels it could be split into (the outstanding writes as
        // their kernels priced below the one in flight alone), an unclamped difference priced
        // the writes below the kernel in flight and granted new ones into time it still took.
        // Exactly the price before the in-flight budget was known when that budget is the
        // largest (the simulator's) and the writes cost at least the one in flight, so the
        // simulator's numbers stay.
        let (in_flight_write_us, writes_behind_us) = outstanding_writes_us(
            table,
            view.in_flight_write_iocbs,
            view.in_flight_write_sm_budget,
            view.outstanding_write_iocbs,
            view.outstanding_write_kernels,
        )?;
        // The reads on the SMs they run on, as in `plan_layer`.
        let busy_until_us = view.outstanding_reads_us()? + in_flight_write_us + writes_behind_us;
        // A write layer outstanding past the step's end (a layer longer than a step, priced
        // whole from the step's start: the runtime does not say how far into it the SSD is)
        // leaves no room, but the step's time is still granted, to bank: a runtime moving
        // whole layers adds it to its carry while the layer runs, so that the next layer can
        // go at the first step after it. Without it the carry banked only while the SSD was
        // idle: with 20 ms layers and 4.4 ms steps, ~5 steps banking then ~5 writing, half
        // the rate the steps allow. Only behind a single layer (none waits behind it yet), so
        // the banked time never stacks up released layers; the simulator, moving IOCBs, has
        // nothing to move for it.
        let one_layer_in_flight = view.outstanding_write_iocbs > 0 && view.outstanding_write_kernels <= 1;
        if one_layer_in_flight && busy_until_us >= window.end_us() {
            let budget = window.free_sms.min(write_budget);
            let priced = budget > 0 && table.io_duration_us(IoKind::Write, 1, budget).is_ok();
            if !priced || window.duration_us <= 0.0 {
                return Ok(Vec::new());
            }
            return Ok(vec![Issue {
                kind: IoKind::Write,
                layer: None,
                iocb_count: 0,
                sm_budget: budget,
                offset_us: 0.0,
                after_reads: true,
                slack_us: window.duration_us,
            }]);
        }
        let mut writes = [(None, view.queued_write_iocbs)];
        Ok(fill_windows(table, IoKind::Write, &[window], busy_until_us, &mut writes)?.issues)
    }
}

/// Layer-wise pipelining without a schedule: before layer `k`, read layer `k+1` and write layer
/// `k−1` at once, whatever else the SSD is doing (what Tutti §3.3 argues against).
#[derive(Clone, Copy, Debug, Default)]
pub struct NaivePipeline;

impl IoPolicy for NaivePipeline {
    fn name(&self) -> &'static str {
        PolicyKind::NaivePipeline.name()
    }

    fn plan_layer(&mut self, view: &LayerView<'_>) -> Result<LayerPlan> {
        let budget = view.table.io_sm_budget_max(IoKind::Read);
        let mut plan = LayerPlan::default();
        for layer in [view.layer, view.layer + 1] {
            if let Some(&count) = view.unissued_read_iocbs.get(layer as usize).filter(|c| **c > 0) {
                plan.issues.push(read_all(layer, count, budget));
            }
        }
        if view.queued_write_iocbs > 0 {
            let write_budget = view.table.io_sm_budget_max(IoKind::Write);
            plan.issues.push(write_all(view.queued_write_iocbs, write_budget, false));
        }
        Ok(plan)
    }

    fn plan_prefill_end(&mut self, view: &QueueView<'_>) -> Result<Vec<Issue>> {
        Ok(flush_writes(view))
    }

    fn plan_decode_step(&mut self, view: &QueueView<'_>) -> Result<Vec<Issue>> {
        Ok(flush_writes(view))
    }
}

/// Load every layer's KV, then compute; write everything after the last layer.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoOverlap;

impl IoPolicy for NoOverlap {
    fn name(&self) -> &'static str {
        PolicyKind::NoOverlap.name()
    }

    fn plan_layer(&mut self, view: &LayerView<'_>) -> Result<LayerPlan> {
        let budget = view.table.io_sm_budget_max(IoKind::Read);
        let issues = view
            .unissued_read_iocbs
            .iter()
            .enumerate()
            .filter(|(_, &count)| count > 0)
            .map(|(layer, &count)| read_all(layer as u32, count, budget))
            .collect();
        Ok(LayerPlan { wait_for_all_reads: view.layer == 0, issues })
    }

    fn plan_prefill_end(&mut self, view: &QueueView<'_>) -> Result<Vec<Issue>> {
        Ok(flush_writes(view))
    }

    fn plan_decode_step(&mut self, view: &QueueView<'_>) -> Result<Vec<Issue>> {
        Ok(flush_writes(view))
    }
}

fn flush_writes(view: &QueueView<'_>) -> Vec<Issue> {
    if view.queued_write_iocbs == 0 {
        return Vec::new();
    }
    let budget = view.table.io_sm_budget_max(IoKind::Write);
    vec![write_all(view.queued_write_iocbs, budget, false)]
}
