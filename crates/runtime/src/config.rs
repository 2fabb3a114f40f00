//! What the runtime is told at start: which policy, which model and GPU the profile must
//! describe, how far the write queue may grow and what happens past that.

use std::time::Duration;

use scheduler::policy::PolicyKind;
use scheduler::table::GpuIdentity;

/// The scheduling policy (a setting; slack-aware is the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PolicyChoice {
    /// Tutti §3.3: reads first, sized to the profile's slack windows; writes only into leftover
    /// slack and decode steps, never while a read is in flight.
    #[default]
    SlackAware,
    /// Read layer k+1 and write layer k−1 at every boundary, with no ordering between them (the
    /// baseline Tutti §3.3 argues against; the runtime's read/write barrier is off).
    Naive,
    /// Read everything before layer 0, write everything after the last layer.
    NoOverlap,
}

impl PolicyChoice {
    pub const ALL: [PolicyChoice; 3] = [Self::SlackAware, Self::Naive, Self::NoOverlap];

    pub fn kind(self) -> PolicyKind {
        match self {
            Self::SlackAware => PolicyKind::SlackAware,
            Self::Naive => PolicyKind::NaivePipeline,
            Self::NoOverlap => PolicyKind::NoOverlap,
        }
    }

    pub fn name(self) -> &'static str {
        self.kind().name()
    }

    /// Parses `slack-aware`, `naive` (or `naive-pipeline`), `no-overlap`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "slack-aware" => Some(Self::SlackAware),
            "naive" | "naive-pipeline" => Some(Self::Naive),
            "no-overlap" => Some(Self::NoOverlap),
            _ => None,
        }
    }

    /// Whether the runtime keeps reads and writes apart on the device: a write is handed to the
    /// executor only when no read is in flight or waiting, and a read only when no write is in
    /// flight. Only the naive baseline mixes them (that is what it stands for).
    pub fn read_write_barrier(self) -> bool {
        self != Self::Naive
    }
}

/// What happens when a new request's store would pass the write-queue limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WriteQueueFullAction {
    /// At `begin_prefill` (before the new request issues any read), the oldest queued stores are
    /// written and committed synchronously until the new one fits; counted in
    /// `RuntimeCounters::stores_forced`. The new request's TTFT pays for it. A request with more
    /// new blocks than `write_queue_limit_blocks` stores only the first that many (the queue
    /// emptied for them as needed; `stores_truncated`), and its cached prefix is read as usual.
    /// If forcing cannot make room (a write that timed out), `begin_prefill` fails with
    /// `WriteQueueFull` and prepares nothing.
    #[default]
    ForceOldest,
    /// `begin_prefill` fails with `RuntimeError::WriteQueueFull` and nothing is prepared (a
    /// request with more new blocks than the whole queue holds is always refused);
    /// counted in `RuntimeCounters::stores_refused`. The engine may run the prefill without the
    /// runtime (nothing stored) or wait for decode steps to drain the queue: a layer longer than
    /// any step goes once the steps' time adds up to it, and under slack-aware `Runtime::new`
    /// refuses a table whose decode steps leave fewer SMs free than its smallest write budget
    /// before the first row (a context there is priced as the first row), past the last row and
    /// between every two adjacent rows (only a context exactly on a row could write).
    Refuse,
}

impl WriteQueueFullAction {
    pub fn name(self) -> &'static str {
        match self {
            Self::ForceOldest => "oldest writes forced",
            Self::Refuse => "new store refused",
        }
    }
}

/// The longest `RuntimeConfig::io_timeout`: a day. One layer's I/O that has not ended in a day
/// will not end; and every deadline `Instant::now() + io_timeout` then fits an `Instant` (a
/// `Duration::MAX` passed the non-zero check and the first bounded wait panicked).
pub const IO_TIMEOUT_MAX: Duration = Duration::from_secs(86_400);

/// See the field docs; `RuntimeConfig::new` gives the defaults.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    pub policy: PolicyChoice,
    /// The model name the profile table must carry (its layer count and KV bytes per token are
    /// checked against the store's geometry).
    pub model_name: String,
    /// The GPU the profile table must have been measured on.
    pub gpu: GpuIdentity,
    /// Engine blocks whose new KV may wait in the write queue (stores not yet committed).
    pub write_queue_limit_blocks: usize,
    /// Stores that may wait in the write queue. Each holds one of the object store's request
    /// slots and its IOCBs, so it must be below `StoreConfig::requests_max` (one is needed for the
    /// running request's retrieve; `Runtime::new` refuses it otherwise). A retiring request
    /// (`Runtime::retiring_requests`) holds a slot too: `begin_prefill` makes room for a new
    /// store until the queued and retiring requests leave slots free for it and, on a cache hit,
    /// the retrieve, forcing the oldest stores out as `on_write_queue_full` says. When the
    /// retiring requests alone leave none for the store beside the retrieve (forcing cannot end
    /// them), the store is skipped (`RuntimeCounters::stores_skipped_no_request_slot`) and the
    /// retrieve runs.
    pub write_queue_limit_stores: usize,
    pub on_write_queue_full: WriteQueueFullAction,
    /// Bound on every wait for one layer's I/O, in `1 ns..=IO_TIMEOUT_MAX` (`Runtime::new`
    /// refuses anything else: a deadline is `Instant::now() + io_timeout`). A layer still in
    /// flight after it is not forgotten: a read's request retires (`Runtime::retiring_requests`),
    /// its engine blocks held; a write's store stays queued (`Runtime::queued_stores`, its engine
    /// blocks held), its layer collected at a later call or ended by `Runtime::abandon_in_flight`
    /// (it retires only if its request is dropped meanwhile).
    pub io_timeout: Duration,
    /// Issue/complete events kept for inspection (`Runtime::events`); 0 keeps none. Past the
    /// capacity, events are counted as dropped, never allocated.
    pub event_log_capacity: usize,
}

impl RuntimeConfig {
    pub fn new(model_name: impl Into<String>, gpu: GpuIdentity) -> Self {
        Self {
            policy: PolicyChoice::default(),
            model_name: model_name.into(),
            gpu,
            write_queue_limit_blocks: 4096,
            write_queue_limit_stores: 16,
            on_write_queue_full: WriteQueueFullAction::default(),
            io_timeout: Duration::from_secs(10),
            event_log_capacity: 0,
        }
    }
}
