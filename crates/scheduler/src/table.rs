//! The profile table: what the slack-aware scheduler reads (Tutti §3.3, "Offline Profiling of SM
//! Slack Windows").
//!
//! # Format (version 1, JSON)
//!
//! ```text
//! {
//!   "format_version": 1,
//!   "model": { "name": "llama3-8b", "layer_count": 32, "kv_bytes_per_token_per_layer": 4096 },
//!   "gpu":   { "name": "h100-sxm", "sm_count": 132 },
//!   "compute_source": "analytic-roofline …",   // where the compute numbers come from
//!   "io_cost_source": "analytic-ssd-model …",  // where the I/O cost numbers come from
//!   "input_step_tokens": 4096, "input_step_count": 8, "prefix_step_tokens": 64,
//!   "buckets": [ { "input_tokens": 4096, "prefix_tokens": 0,
//!                  "layers": [ { "compute_duration_us": 812.5, "kv_needed_offset_us": 60.1,
//!                                "slack_windows": [ { "offset_us": 0.0, "duration_us": 4.1,
//!                                                     "free_sms": 60 }, … ] }, … ] }, … ],
//!   "io_costs": [ { "kind": "read", "iocb_count": 1, "sm_budget": 4,
//!                   "duration_us": 339.2, "bytes": 8388608 }, … ],
//!   "decode_steps": [ { "context_tokens": 4096, "duration_us": 4400.0, "free_sms": 4 }, … ]
//! }
//! ```
//!
//! The grid is uniform: input lengths are `input_step_tokens × k` for `k = 1..=input_step_count`;
//! for each input length, prefix lengths are `prefix_step_tokens × j` for every `j` with
//! `prefix ≤ input`. Buckets are listed in (input, prefix) order, every grid point present, so a
//! lookup is an index computation (O(1)). Within a layer, `kv_needed_offset_us` is when the first
//! kernel that reads the cached KV (attention) starts; slack windows are sorted, do not overlap and
//! lie inside the layer. `io_costs` rows are sorted by (kind, sm_budget, iocb_count).
//!
//! # Lookups between and beyond buckets: conservative rounding
//!
//! A lookup never interpolates: it rounds to the grid point whose layer is *cheapest* — input
//! length rounded down and prefix length rounded up (more cached tokens means fewer new tokens to
//! compute). Less compute means a shorter layer whose windows close sooner, so the scheduler may
//! decide a read does not fit a window and issue it at once; that costs nothing on the critical
//! path, whereas assuming slack time that does not exist would hold a critical read back or push a
//! write into compute it delays. That rounding bounds slack time, not free SMs: a cheaper layer can
//! be more memory-bound and leave more SMs free than the real one. So the slack-aware policy plans
//! with [`Profile::slack_windows_between`] (between.rs): the windows of the grid cell's corners
//! intersected, at each offset the fewest SMs any corner has free (docs/scheduler.md).
//! A prefix rounded up past the last grid prefix of its row takes that prefix; where the prefix
//! step does not divide the row's input (4096 and 3072: prefixes 0 and 3072), that bucket can
//! have more new tokens than the request (4096 with 4000 cached: 1024, not 96), and such a
//! lookup is [`SchedulerError::OutOfRange`] rather than a more expensive bucket.
//! An input longer than the table is looked up at the longest input (again the cheaper side);
//! an input shorter than the first step, or a prefix longer than the input, is
//! [`SchedulerError::OutOfRange`]. I/O costs round the IOCB count up; a profiled SM budget is
//! priced by its own rows, and a budget between profiled ones by the slowest of every profiled
//! budget below it (fewer SMs need not be slower in a measured table; a budget below every row
//! is `OutOfRange`); a count beyond the largest row is costed as back-to-back kernels of the
//! largest row. Decode steps round the context down (shorter step) and take the fewer free SMs
//! of the two rows bracketing the context; past the last row, the last row; before the first,
//! `OutOfRange`.

use serde::{Deserialize, Serialize};

use crate::error::{check_duration, Result, SchedulerError};

/// The newest format this build reads and writes.
pub const PROFILE_FORMAT_VERSION: u32 = 1;

/// The longest duration a table may hold, in µs (11.6 days; a layer, a decode step or one I/O
/// kernel is far shorter). Bounding each keeps every sum of them finite: a count past the
/// largest cost row is costed as up to 2³² back-to-back kernels (≤ 4.3e21 µs), and a runtime
/// adds up the costs of its queued writes. Without it, rows of 1 µs and 1e308 µs were valid and
/// five IOCBs cost infinity.
pub const DURATION_US_MAX: f64 = 1e12;

/// The fewest bytes one IOCB may move: one LBA of the smallest size a store accepts (objstore's
/// `LBA_BYTES_MIN`). An IOCB moves whole LBAs, and every LBA size (a power of two from 512) is a
/// multiple of this, so an IOCB's bytes are too.
pub const IOCB_BYTES_MIN: u64 = 512;

/// Window bounds may exceed the layer by this much (float rounding in producers).
const WINDOW_EPSILON_US: f64 = 1e-6;

/// Which model the table was profiled for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelIdentity {
    pub name: String,
    pub layer_count: u32,
    /// K and V of one token in one layer.
    pub kv_bytes_per_token_per_layer: u64,
}

/// Which GPU the table was profiled on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuIdentity {
    pub name: String,
    pub sm_count: u32,
}

/// A period inside a layer when `free_sms` SMs are idle and I/O can run without delaying compute.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlackWindow {
    /// From the start of the layer.
    pub offset_us: f64,
    pub duration_us: f64,
    pub free_sms: u32,
}

impl SlackWindow {
    /// When the window closes, from the start of the layer.
    pub fn end_us(&self) -> f64 {
        self.offset_us + self.duration_us
    }
}

/// One transformer layer of one bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerProfile {
    pub compute_duration_us: f64,
    /// Offset of the first kernel that needs this layer's cached KV (attention).
    pub kv_needed_offset_us: f64,
    pub slack_windows: Vec<SlackWindow>,
}

/// All layers for one (input length, prefix length) pair.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bucket {
    /// Prompt length, cached prefix included.
    pub input_tokens: u32,
    /// Cached prefix length (tokens whose KV is read rather than computed).
    pub prefix_tokens: u32,
    pub layers: Vec<LayerProfile>,
}

/// Read or write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoKind {
    Read,
    Write,
}

/// Cost of one I/O kernel of `iocb_count` IOCBs on `sm_budget` SMs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IoCostEntry {
    pub kind: IoKind,
    pub iocb_count: u32,
    pub sm_budget: u32,
    pub duration_us: f64,
    pub bytes: u64,
}

/// One decode step (one token for the whole batch) at a context length.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeStep {
    pub context_tokens: u32,
    pub duration_us: f64,
    /// SMs idle for the whole step (decode is memory-bound).
    pub free_sms: u32,
}

/// The on-disk table. Load it through [`Profile`], which validates it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileTable {
    pub format_version: u32,
    pub model: ModelIdentity,
    pub gpu: GpuIdentity,
    /// Where the compute numbers come from ("analytic-roofline", "imported-timeline: file").
    pub compute_source: String,
    /// Where the I/O cost numbers come from ("analytic-ssd-model", "measured: backend").
    pub io_cost_source: String,
    pub input_step_tokens: u32,
    pub input_step_count: u32,
    pub prefix_step_tokens: u32,
    pub buckets: Vec<Bucket>,
    pub io_costs: Vec<IoCostEntry>,
    pub decode_steps: Vec<DecodeStep>,
}

/// A validated table with its lookup index.
#[derive(Clone, Debug)]
pub struct Profile {
    table: ProfileTable,
    /// `bucket_start[k]` = index of the first bucket of input length `step × (k + 1)`.
    bucket_start: Vec<usize>,
}

/// `prefix_tokens` rounded up to the prefix grid (`step`), but no further than the largest
/// grid prefix input `row_input_tokens` lists. In u64: rounding near u32::MAX up would overflow.
pub(crate) fn prefix_up_to_grid(prefix_tokens: u32, row_input_tokens: u32, step: u32) -> u32 {
    let step = u64::from(step);
    let rounded_up = u64::from(prefix_tokens).div_ceil(step) * step;
    let row_max = u64::from(row_input_tokens) / step * step;
    rounded_up.min(row_max) as u32
}

fn bucket_label(input_tokens: u32, prefix_tokens: u32) -> String {
    format!("bucket(input_tokens={input_tokens}, prefix_tokens={prefix_tokens})")
}

fn invalid(field: &str, location: String, reason: impl Into<String>) -> SchedulerError {
    SchedulerError::InvalidField { field: field.to_string(), location, reason: reason.into() }
}

impl Profile {
    /// Parses and validates a JSON table. The version is checked before the shape so that a future
    /// table with new fields is reported as a version problem, not as a parse error.
    pub fn from_json(text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text)?;
        match value.get("format_version").and_then(serde_json::Value::as_u64) {
            Some(found) if found > u64::from(PROFILE_FORMAT_VERSION) => {
                return Err(SchedulerError::UnsupportedVersion { found, supported: PROFILE_FORMAT_VERSION })
            }
            Some(_) => {}
            None => return Err(invalid("format_version", "table".into(), "missing or not an unsigned integer")),
        }
        let table: ProfileTable = serde_json::from_value(value)?;
        Self::from_table(table)
    }

    /// Validates a table built in memory.
    pub fn from_table(table: ProfileTable) -> Result<Self> {
        let bucket_start = validate(&table)?;
        Ok(Self { table, bucket_start })
    }

    /// Serializes the table as compact JSON (what tools write: a 32K-token grid is ~3× smaller
    /// than pretty-printed).
    pub fn to_json(&self) -> Result<String> {
        Ok(serde_json::to_string(&self.table)?)
    }

    /// Serializes the table as indented JSON, for reading by eye.
    pub fn to_json_pretty(&self) -> Result<String> {
        Ok(serde_json::to_string_pretty(&self.table)?)
    }

    pub fn table(&self) -> &ProfileTable {
        &self.table
    }

    pub fn model(&self) -> &ModelIdentity {
        &self.table.model
    }

    pub fn gpu(&self) -> &GpuIdentity {
        &self.table.gpu
    }

    pub fn layer_count(&self) -> u32 {
        self.table.model.layer_count
    }

    /// Rejects a table profiled for another model or GPU than the one in use.
    pub fn check_identity(&self, model: &ModelIdentity, gpu: &GpuIdentity) -> Result<()> {
        let t = &self.table;
        if t.model.name != model.name {
            return Err(SchedulerError::IdentityMismatch { field: "model.name", table: t.model.name.clone(), in_use: model.name.clone() });
        }
        if t.model.layer_count != model.layer_count {
            return Err(SchedulerError::IdentityMismatch {
                field: "model.layer_count",
                table: t.model.layer_count.to_string(),
                in_use: model.layer_count.to_string(),
            });
        }
        if t.model.kv_bytes_per_token_per_layer != model.kv_bytes_per_token_per_layer {
            return Err(SchedulerError::IdentityMismatch {
                field: "model.kv_bytes_per_token_per_layer",
                table: t.model.kv_bytes_per_token_per_layer.to_string(),
                in_use: model.kv_bytes_per_token_per_layer.to_string(),
            });
        }
        if t.gpu.name != gpu.name {
            return Err(SchedulerError::IdentityMismatch { field: "gpu.name", table: t.gpu.name.clone(), in_use: gpu.name.clone() });
        }
        if t.gpu.sm_count != gpu.sm_count {
            return Err(SchedulerError::IdentityMismatch {
                field: "gpu.sm_count",
                table: t.gpu.sm_count.to_string(),
                in_use: gpu.sm_count.to_string(),
            });
        }
        Ok(())
    }

    /// Largest profiled input length.
    pub fn input_tokens_max(&self) -> u32 {
        self.table.input_step_tokens * self.table.input_step_count
    }

    /// All input lengths of the grid, shortest first.
    pub fn input_lengths(&self) -> impl Iterator<Item = u32> + '_ {
        (1..=self.table.input_step_count).map(|k| k * self.table.input_step_tokens)
    }

    /// All prefix lengths profiled for one grid input length.
    pub fn prefix_lengths(&self, input_tokens: u32) -> impl Iterator<Item = u32> + '_ {
        let step = self.table.prefix_step_tokens;
        (0..=input_tokens / step).map(move |j| j * step)
    }

    /// The bucket for a request, rounded conservatively (see the module documentation).
    pub fn bucket(&self, input_tokens: u32, prefix_tokens: u32) -> Result<&Bucket> {
        let t = &self.table;
        if prefix_tokens > input_tokens {
            return Err(SchedulerError::OutOfRange {
                what: "prefix_tokens",
                value: u64::from(prefix_tokens),
                min: 0,
                max: u64::from(input_tokens),
            });
        }
        let max = self.input_tokens_max();
        if input_tokens < t.input_step_tokens {
            return Err(SchedulerError::OutOfRange {
                what: "input_tokens",
                value: u64::from(input_tokens),
                min: u64::from(t.input_step_tokens),
                max: u64::from(max),
            });
        }
        // Longer than profiled: the longest input is the cheaper side, hence conservative.
        let input_rounded = input_tokens.min(max) / t.input_step_tokens * t.input_step_tokens;
        // A prefix rounded past the (rounded-down) input's last grid prefix takes that prefix:
        // with a prefix step dividing the input, "everything cached", the cheapest bucket of the
        // row. With one that does not (input step 4096, prefix step 3072: the row lists 0 and
        // 3072), the capped bucket can have more new tokens than the request (4096 with 4000
        // cached: 1024 instead of 96), a layer longer than the real one whose windows promise
        // time that does not exist. The request is then out of the table's range (the runtime's
        // conservative fallback: every read at once, no write granted in the prefill).
        let prefix_rounded_up = prefix_up_to_grid(prefix_tokens, input_rounded, t.prefix_step_tokens);
        if input_rounded - prefix_rounded_up > input_tokens - prefix_tokens {
            return Err(SchedulerError::OutOfRange {
                what: "prefix_tokens",
                value: u64::from(prefix_tokens),
                min: 0,
                max: u64::from(prefix_rounded_up + (input_tokens - input_rounded)),
            });
        }
        // Validation guarantees the bucket exists; a broken invariant is an error, not a panic.
        self.bucket_at_grid_point(input_rounded, prefix_rounded_up)
    }

    /// The bucket at a grid point (`input_tokens` a multiple of the input step within the table,
    /// `prefix_tokens` a multiple of the prefix step no larger): `MissingBucket` otherwise.
    pub(crate) fn bucket_at_grid_point(&self, input_tokens: u32, prefix_tokens: u32) -> Result<&Bucket> {
        let t = &self.table;
        let missing = SchedulerError::MissingBucket { input_tokens, prefix_tokens };
        let on_grid = input_tokens >= t.input_step_tokens
            && input_tokens <= self.input_tokens_max()
            && input_tokens.is_multiple_of(t.input_step_tokens)
            && prefix_tokens <= input_tokens
            && prefix_tokens.is_multiple_of(t.prefix_step_tokens);
        if !on_grid {
            return Err(missing);
        }
        let start = self.bucket_start[(input_tokens / t.input_step_tokens) as usize - 1];
        t.buckets.get(start + (prefix_tokens / t.prefix_step_tokens) as usize).ok_or(missing)
    }

    /// Estimated duration of one I/O kernel, rounded to the slower profiled entry: the count
    /// rounds up; a profiled budget is priced by its own rows, and a budget between profiled
    /// ones by the slowest of every profiled budget below it. Fewer SMs need not be slower in a
    /// measured table (the `io` table of docs/scheduler.md writes 4 IOCBs in 134 ms on 1 SM and
    /// 264 ms on 2), so the budget just below alone is no bound for one between; validation
    /// checks durations against counts only, within one budget.
    pub fn io_duration_us(&self, kind: IoKind, iocb_count: u32, sm_budget: u32) -> Result<f64> {
        if iocb_count == 0 {
            return Ok(0.0);
        }
        let rows = self.table.io_costs.iter().filter(|r| r.kind == kind);
        let budget = rows.clone().map(|r| r.sm_budget).filter(|&b| b <= sm_budget).max().ok_or_else(|| SchedulerError::OutOfRange {
            what: "sm_budget",
            value: u64::from(sm_budget),
            min: self.io_budget_min(kind),
            max: u64::from(self.table.gpu.sm_count),
        })?;
        if budget == sm_budget {
            return self.io_duration_at_budget_us(kind, iocb_count, budget);
        }
        // Rows are sorted by (kind, budget, count): each budget below is visited at its first row.
        let mut slowest_us: f64 = 0.0;
        let mut previous = None;
        for row in rows.filter(|r| r.sm_budget <= sm_budget) {
            if previous != Some(row.sm_budget) {
                previous = Some(row.sm_budget);
                slowest_us = slowest_us.max(self.io_duration_at_budget_us(kind, iocb_count, row.sm_budget)?);
            }
        }
        Ok(slowest_us)
    }

    /// One kernel of `iocb_count` IOCBs by the rows of profiled budget `budget`.
    fn io_duration_at_budget_us(&self, kind: IoKind, iocb_count: u32, budget: u32) -> Result<f64> {
        if iocb_count == 0 {
            return Ok(0.0);
        }
        let mut largest: Option<&IoCostEntry> = None;
        for row in self.table.io_costs.iter().filter(|r| r.kind == kind && r.sm_budget == budget) {
            if row.iocb_count >= iocb_count {
                return Ok(row.duration_us);
            }
            largest = Some(row);
        }
        // Beyond the table: back-to-back kernels of the largest profiled count (ignores any
        // pipelining between them, so it over-estimates).
        let largest = largest.ok_or_else(|| invalid("io_costs", format!("kind={kind:?}"), "no rows"))?;
        let full = iocb_count / largest.iocb_count;
        let rest = iocb_count % largest.iocb_count;
        let rest_us = self.io_duration_at_budget_us(kind, rest, budget)?;
        Ok(f64::from(full) * largest.duration_us + rest_us)
    }

    fn io_budget_min(&self, kind: IoKind) -> u64 {
        self.table.io_costs.iter().filter(|r| r.kind == kind).map(|r| u64::from(r.sm_budget)).min().unwrap_or(0)
    }

    /// The bytes one IOCB moves: every cost row's `bytes / iocb_count`, one size for reads and
    /// writes alike (validated), the unit the policy and a runtime count I/O in.
    pub fn iocb_bytes(&self) -> u64 {
        self.table.io_costs.first().map_or(0, |row| row.bytes / u64::from(row.iocb_count.max(1)))
    }

    /// The smallest profiled SM budget for a kind: fewer SMs cannot be priced (`OutOfRange`).
    pub fn io_sm_budget_min(&self, kind: IoKind) -> u32 {
        self.table.io_costs.iter().filter(|r| r.kind == kind).map(|r| r.sm_budget).min().unwrap_or(0)
    }

    /// The largest profiled SM budget for a kind (what an I/O kernel asks for by default).
    pub fn io_sm_budget_max(&self, kind: IoKind) -> u32 {
        self.table.io_costs.iter().filter(|r| r.kind == kind).map(|r| r.sm_budget).max().unwrap_or(0)
    }

    /// Whether the slack-aware policy could ever write in a decode step: some range of contexts
    /// requests reach must leave the smallest write budget free. [`Profile::decode_step`] gives a
    /// context between two rows the fewer free SMs of the two, one past the last row the last
    /// row's, and a context below the first row is priced as the first row
    /// ([`Profile::decode_pricing_context`]), so the first row (with contexts below it from the
    /// smallest profiled input), the last row, or two adjacent rows, must leave that budget free;
    /// else only contexts exactly on a row could write (rows {1024: 60 free, 2048: 0 free} with
    /// inputs from 1024 wrote at 1024 tokens and nowhere else). Before, the contexts below the
    /// first row were not counted, though the runtime prices them as that row. Under slack-aware, deferred
    /// writes drain in decode steps, and when the queue is full and prefills are refused,
    /// nowhere else.
    ///
    /// The range must have contexts off the rows and be within reach. Two adjacent rows count
    /// only with a context strictly between them (rows {16: 4 free, 17: 4 free, 4096: 0 free}
    /// wrote at 16 and 17 tokens only), and the last row only below
    /// [`Profile::decode_context_reach`] (so that some context past it is reached) and below
    /// `u32::MAX` (rows {4096: 0 free, u32::MAX: 60
    /// free} wrote at a context of exactly u32::MAX only). Both were accepted, and deferred
    /// writes never drained.
    ///
    /// One predicate for every consumer: the runtime refuses such a table under slack-aware
    /// (`Runtime::new`), `tutti-profile check` reports it invalid and `import` refuses to write
    /// it. A table of timelines measured with every SM busy (free SMs 0) was valid, checked
    /// valid and simulated, and then the runtime refused it.
    ///
    /// A step must also last: a context takes the duration of the row at or below it, and in a
    /// step of 0 µs (valid as a table, as every duration may be 0) the policy finds no room for
    /// a write, not even as time carried forward. So the first row, the last row, or the lower
    /// of two adjacent rows, must last more than 0 µs; rows that all lasted 0 µs passed, and nothing was ever
    /// written in a decode step.
    pub fn check_decode_steps_can_write(&self) -> Result<()> {
        let write_budget_min = self.io_sm_budget_min(IoKind::Write);
        let reach = self.decode_context_reach();
        let reach_min = self.table.input_step_tokens;
        let steps = &self.table.decode_steps;
        let enough_sms = |step: &DecodeStep| step.free_sms >= write_budget_min;
        let writable = |step: &DecodeStep| enough_sms(step) && step.duration_us > 0.0;
        // The contexts past the last row, or strictly between two rows, that requests reach.
        let last_in_reach = |step: &DecodeStep| step.context_tokens < u32::MAX && step.context_tokens < reach;
        let pair_in_reach = |pair: &[DecodeStep]| {
            let first_between = u64::from(pair[0].context_tokens) + 1;
            first_between < u64::from(pair[1].context_tokens) && first_between <= u64::from(reach)
        };
        // The contexts before the first row (priced as that row: `decode_pricing_context`) that
        // requests reach: from the smallest profiled input up.
        let before_first_in_reach = |first: &DecodeStep| reach_min < first.context_tokens;
        let some_range_writes = steps.first().is_some_and(|first| writable(first) && before_first_in_reach(first))
            || steps.last().is_some_and(|last| writable(last) && last_in_reach(last))
            || steps.windows(2).any(|pair| writable(&pair[0]) && enough_sms(&pair[1]) && pair_in_reach(pair));
        if some_range_writes {
            return Ok(());
        }
        let some_range_has_sms = steps.first().is_some_and(|first| enough_sms(first) && before_first_in_reach(first))
            || steps.last().is_some_and(|last| enough_sms(last) && last_in_reach(last))
            || steps.windows(2).any(|pair| pair.iter().all(enough_sms) && pair_in_reach(pair));
        if some_range_has_sms {
            return Err(invalid(
                "decode_steps.duration_us",
                "table".into(),
                format!(
                    "every decode step that leaves the smallest write budget ({write_budget_min} SMs) free lasts 0 us (durations \
                     per row: {:?}): no deferred write could go in a decode step under the slack-aware policy",
                    steps.iter().map(|step| step.duration_us).collect::<Vec<_>>()
                ),
            ));
        }
        Err(invalid(
            "decode_steps.free_sms",
            "table".into(),
            format!(
                "the decode steps leave fewer SMs free than the smallest write budget ({write_budget_min} SMs) before the first \
                 row (priced as that row), past the last row and between every two rows, among the contexts requests reach \
                 (from {reach_min} tokens, the smallest prefill input, up to {reach} tokens: twice the largest prefill input; \
                 contexts per row: {:?}, free SMs per row: {:?}): no deferred write could go in a decode step \
                 under the slack-aware policy, but at a context exactly on a row or out of reach",
                steps.iter().map(|step| step.context_tokens).collect::<Vec<_>>(),
                steps.iter().map(|step| step.free_sms).collect::<Vec<_>>()
            ),
        ))
    }

    /// The largest decode context the table vouches requests reach: a prompt of its largest
    /// prefill input that decodes as many tokens again (saturating). The decode rows cannot say
    /// it themselves: a row at u32::MAX is as valid as any, and the contexts past it are reached
    /// by no request.
    pub fn decode_context_reach(&self) -> u32 {
        self.input_tokens_max().saturating_mul(2)
    }

    /// The context a decode step is priced at, by the runtime (`Runtime::decode_step`) and the
    /// simulator alike: `context_tokens`, or for a context before the first decode row, that
    /// row's. At short contexts a decode step is bound by reading the weights, about as long as
    /// the first row's; rounding down there would find no row, and a step without a row knows no
    /// slack, so nothing would be written in it (short requests never drained the write queue).
    /// It is optimistic against [`Profile::decode_step`]'s round-down rule (a step before the
    /// first row may be a little shorter than the row's), as the round-up the rows allow
    /// nowhere else.
    pub fn decode_pricing_context(&self, context_tokens: u32) -> u32 {
        let first_row = self.table.decode_steps.first().map_or(0, |step| step.context_tokens);
        context_tokens.max(first_row)
    }

    /// The decode step at a context length: the row rounded down (shorter step, less slack),
    /// with the fewer free SMs of the two rows bracketing the context (the row itself on a grid
    /// point; past the last row, the last row's). Free SMs need not fall as the context grows (a
    /// longer step can be more memory-bound), so the row below alone could promise SMs the real
    /// step does not have: rows 4096 → 40 free and 8192 → 4 free gave a context of 8000 40 SMs.
    /// The same rule as prefill windows between grid points (`Profile::slack_windows_between`).
    pub fn decode_step(&self, context_tokens: u32) -> Result<DecodeStep> {
        let steps = &self.table.decode_steps;
        let first = steps.first().map(|s| s.context_tokens).unwrap_or(0);
        let last = steps.last().map(|s| s.context_tokens).unwrap_or(0);
        let index = steps.partition_point(|s| s.context_tokens <= context_tokens);
        if index == 0 {
            return Err(SchedulerError::OutOfRange {
                what: "context_tokens",
                value: u64::from(context_tokens),
                min: u64::from(first),
                max: u64::from(last),
            });
        }
        let mut step = steps[index - 1];
        if step.context_tokens != context_tokens {
            if let Some(above) = steps.get(index) {
                step.free_sms = step.free_sms.min(above.free_sms);
            }
        }
        Ok(step)
    }
}

/// Checks everything the lookups rely on; returns the per-input bucket offsets.
fn validate(t: &ProfileTable) -> Result<Vec<usize>> {
    let table = || "table".to_string();
    if t.format_version == 0 || t.format_version > PROFILE_FORMAT_VERSION {
        return Err(SchedulerError::UnsupportedVersion { found: u64::from(t.format_version), supported: PROFILE_FORMAT_VERSION });
    }
    if t.model.name.is_empty() {
        return Err(invalid("model.name", table(), "empty"));
    }
    if t.model.layer_count == 0 {
        return Err(invalid("model.layer_count", table(), "must be > 0"));
    }
    if t.model.kv_bytes_per_token_per_layer == 0 {
        return Err(invalid("model.kv_bytes_per_token_per_layer", table(), "must be > 0"));
    }
    if t.gpu.name.is_empty() {
        return Err(invalid("gpu.name", table(), "empty"));
    }
    if t.gpu.sm_count == 0 {
        return Err(invalid("gpu.sm_count", table(), "must be > 0"));
    }
    for (field, value) in
        [("input_step_tokens", t.input_step_tokens), ("input_step_count", t.input_step_count), ("prefix_step_tokens", t.prefix_step_tokens)]
    {
        if value == 0 {
            return Err(invalid(field, table(), "must be > 0"));
        }
    }
    if t.input_step_tokens.checked_mul(t.input_step_count).is_none() {
        return Err(invalid("input_step_count", table(), "input range overflows u32"));
    }

    // Walk the expected grid in order alongside the listed buckets.
    // Not pre-sized: the count is untrusted, and a missing bucket ends the walk early anyway.
    let mut bucket_start = Vec::new();
    let mut index = 0usize;
    for k in 1..=t.input_step_count {
        let input_tokens = k * t.input_step_tokens;
        bucket_start.push(index);
        for j in 0..=input_tokens / t.prefix_step_tokens {
            let prefix_tokens = j * t.prefix_step_tokens;
            let Some(bucket) = t.buckets.get(index) else {
                return Err(SchedulerError::MissingBucket { input_tokens, prefix_tokens });
            };
            let found = (bucket.input_tokens, bucket.prefix_tokens);
            if found != (input_tokens, prefix_tokens) {
                check_prefix_within_input(bucket)?;
                // Smaller than expected: listed twice or out of order. Larger: we skipped one.
                if found < (input_tokens, prefix_tokens) {
                    return Err(SchedulerError::NonMonotonic {
                        field: "buckets".into(),
                        location: bucket_label(bucket.input_tokens, bucket.prefix_tokens),
                    });
                }
                return Err(SchedulerError::MissingBucket { input_tokens, prefix_tokens });
            }
            validate_bucket(t, bucket)?;
            index += 1;
        }
    }
    if let Some(extra) = t.buckets.get(index) {
        check_prefix_within_input(extra)?;
        return Err(invalid(
            "buckets",
            bucket_label(extra.input_tokens, extra.prefix_tokens),
            "not on the grid declared by input_step_tokens/input_step_count/prefix_step_tokens",
        ));
    }

    validate_io_costs(t)?;
    validate_decode_steps(t)?;
    Ok(bucket_start)
}

/// A bucket off the grid because its prefix is longer than its prompt is named as such: the grid
/// walk would call it out of order (among the grid's buckets) or off a grid of other steps.
fn check_prefix_within_input(bucket: &Bucket) -> Result<()> {
    if bucket.prefix_tokens > bucket.input_tokens {
        return Err(invalid(
            "buckets.prefix_tokens",
            bucket_label(bucket.input_tokens, bucket.prefix_tokens),
            format!("{} tokens, longer than the input ({} tokens)", bucket.prefix_tokens, bucket.input_tokens),
        ));
    }
    Ok(())
}

fn validate_bucket(t: &ProfileTable, bucket: &Bucket) -> Result<()> {
    let label = bucket_label(bucket.input_tokens, bucket.prefix_tokens);
    if bucket.layers.len() != t.model.layer_count as usize {
        return Err(invalid("layers", label, format!("{} layers listed, model has {}", bucket.layers.len(), t.model.layer_count)));
    }
    for (layer_index, layer) in bucket.layers.iter().enumerate() {
        let at = || format!("{label} layer {layer_index}");
        check_duration(layer.compute_duration_us, "compute_duration_us", &at)?;
        check_duration(layer.kv_needed_offset_us, "kv_needed_offset_us", &at)?;
        if layer.kv_needed_offset_us > layer.compute_duration_us + WINDOW_EPSILON_US {
            return Err(invalid("kv_needed_offset_us", at(), "after the end of the layer"));
        }
        let mut previous_end_us = 0.0;
        for (window_index, window) in layer.slack_windows.iter().enumerate() {
            let at_window = || format!("{label} layer {layer_index} window {window_index}");
            check_duration(window.offset_us, "slack_windows.offset_us", &at_window)?;
            check_duration(window.duration_us, "slack_windows.duration_us", &at_window)?;
            if window.offset_us + WINDOW_EPSILON_US < previous_end_us {
                return Err(SchedulerError::NonMonotonic { field: "slack_windows.offset_us".into(), location: at_window() });
            }
            if window.end_us() > layer.compute_duration_us + WINDOW_EPSILON_US {
                return Err(invalid("slack_windows.duration_us", at_window(), "window ends after the layer"));
            }
            if window.free_sms > t.gpu.sm_count {
                return Err(invalid(
                    "slack_windows.free_sms",
                    at_window(),
                    format!("{} exceeds the GPU's {} SMs", window.free_sms, t.gpu.sm_count),
                ));
            }
            previous_end_us = window.end_us();
        }
    }
    Ok(())
}

fn validate_io_costs(t: &ProfileTable) -> Result<()> {
    for kind in [IoKind::Read, IoKind::Write] {
        if !t.io_costs.iter().any(|r| r.kind == kind) {
            return Err(invalid("io_costs", format!("kind={kind:?}"), "no rows for this kind"));
        }
    }
    let mut previous: Option<&IoCostEntry> = None;
    let mut iocb_bytes_first: Option<u64> = None;
    for (row_index, row) in t.io_costs.iter().enumerate() {
        let at = || format!("io_costs[{row_index}] (kind={:?}, iocb_count={}, sm_budget={})", row.kind, row.iocb_count, row.sm_budget);
        check_duration(row.duration_us, "io_costs.duration_us", &at)?;
        if row.duration_us == 0.0 {
            return Err(invalid("io_costs.duration_us", at(), "must be > 0"));
        }
        if row.iocb_count == 0 {
            return Err(invalid("io_costs.iocb_count", at(), "must be > 0"));
        }
        if row.sm_budget == 0 || row.sm_budget > t.gpu.sm_count {
            return Err(invalid("io_costs.sm_budget", at(), "must be in 1..=gpu.sm_count"));
        }
        if row.bytes == 0 {
            return Err(invalid("io_costs.bytes", at(), "must be > 0"));
        }
        // One IOCB size across all rows: the policy and the runtime count reads and writes in
        // it, and cost them with these rows.
        if !row.bytes.is_multiple_of(u64::from(row.iocb_count)) {
            return Err(invalid("io_costs.bytes", at(), format!("{} bytes do not divide into {} IOCBs", row.bytes, row.iocb_count)));
        }
        let iocb_bytes = row.bytes / u64::from(row.iocb_count);
        if iocb_bytes < IOCB_BYTES_MIN {
            return Err(invalid("io_costs.bytes", at(), format!("{iocb_bytes} bytes per IOCB is less than one {IOCB_BYTES_MIN}-byte LBA")));
        }
        if !iocb_bytes.is_multiple_of(IOCB_BYTES_MIN) {
            return Err(invalid(
                "io_costs.bytes",
                at(),
                format!("{iocb_bytes} bytes per IOCB is not a multiple of {IOCB_BYTES_MIN} (an IOCB moves whole LBAs)"),
            ));
        }
        let first_iocb_bytes = *iocb_bytes_first.get_or_insert(iocb_bytes);
        if iocb_bytes != first_iocb_bytes {
            return Err(invalid(
                "io_costs.bytes",
                at(),
                format!(
                    "{iocb_bytes} bytes per IOCB, but io_costs[0] has {first_iocb_bytes}: every row (read and write) must move IOCBs \
                     of one size"
                ),
            ));
        }
        if let Some(p) = previous {
            let key = |r: &IoCostEntry| (r.kind, r.sm_budget, r.iocb_count);
            if key(row) <= key(p) {
                return Err(SchedulerError::NonMonotonic { field: "io_costs".into(), location: at() });
            }
            // More IOCBs on the same budget cannot finish sooner; a table saying so is corrupt.
            if p.kind == row.kind && p.sm_budget == row.sm_budget && row.duration_us < p.duration_us {
                return Err(SchedulerError::NonMonotonic { field: "io_costs.duration_us".into(), location: at() });
            }
        }
        previous = Some(row);
    }
    Ok(())
}

fn validate_decode_steps(t: &ProfileTable) -> Result<()> {
    if t.decode_steps.is_empty() {
        return Err(invalid("decode_steps", "table".into(), "no rows"));
    }
    let mut previous: Option<u32> = None;
    for (row_index, step) in t.decode_steps.iter().enumerate() {
        let at = || format!("decode_steps[{row_index}] (context_tokens={})", step.context_tokens);
        check_duration(step.duration_us, "decode_steps.duration_us", &at)?;
        if step.free_sms > t.gpu.sm_count {
            return Err(invalid("decode_steps.free_sms", at(), "exceeds gpu.sm_count"));
        }
        if previous.is_some_and(|p| step.context_tokens <= p) {
            return Err(SchedulerError::NonMonotonic { field: "decode_steps.context_tokens".into(), location: at() });
        }
        previous = Some(step.context_tokens);
    }
    Ok(())
}
