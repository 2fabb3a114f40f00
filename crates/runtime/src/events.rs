//! What the runtime issued and saw complete, for tests and tools: a bounded event log and the
//! counters a serving loop reports.

use std::time::{Duration, Instant};

use gio_uring::SmBudget;

/// Direction of one layer's I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoDirection {
    Read,
    Write,
}

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoEventKind {
    /// A layer's IOCBs were handed to the executor.
    Issued,
    /// The runtime saw all of them complete (successfully or not), saw the device end the layer
    /// of a retiring request (`Runtime::retiring_requests`), or ended it with
    /// `Runtime::abandon_in_flight` (a healthy layer ended so is issued, and logged, again).
    Completed,
}

/// One layer of one request, issued or completed. `request` is the runtime's request id (the
/// one that prepared the retrieve or the store).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoEvent {
    pub at: Instant,
    pub request: u64,
    pub direction: IoDirection,
    pub layer: u32,
    pub kind: IoEventKind,
    /// Issued: the SM budget handed to the executor with the layer (the policy's decision).
    /// Completed: `None`.
    pub sm_budget: Option<SmBudget>,
}

/// A log with a fixed capacity, allocated at start.
#[derive(Debug)]
pub(crate) struct EventLog {
    events: Vec<IoEvent>,
    capacity: usize,
    pub dropped: u64,
}

impl EventLog {
    pub fn new(capacity: usize) -> Self {
        Self { events: Vec::with_capacity(capacity), capacity, dropped: 0 }
    }

    pub fn record(&mut self, event: IoEvent) {
        if self.events.len() < self.capacity {
            self.events.push(event);
        } else if self.capacity > 0 {
            self.dropped += 1;
        }
    }

    pub fn events(&self) -> &[IoEvent] {
        &self.events
    }

    pub fn clear(&mut self) {
        self.events.clear();
        self.dropped = 0;
    }
}

/// Counters since the runtime started.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RuntimeCounters {
    pub prefills: u64,
    /// Layers of reads / writes handed to the executor.
    pub read_layers_issued: u64,
    pub write_layers_issued: u64,
    /// Write layers issued after their own request's prefill ended (in later requests' slack,
    /// decode steps, or forced).
    pub write_layers_deferred: u64,
    /// Layers issued while the other direction was in flight: beside the running prefill's read
    /// or the write queue's write layer (never under a barrier policy), or beside a layer of a
    /// retiring request of the other direction that the device still held, under any policy
    /// (retiring I/O is outside the barrier: `Runtime::retiring_requests`). The event log shows
    /// the same.
    pub mixed_issues: u64,
    pub stores_committed: u64,
    pub blocks_committed: u64,
    /// Stores dropped after a write or commit failure: their blocks never became visible.
    pub stores_failed: u64,
    /// Stores written synchronously because the write queue was full, and committed (one whose
    /// forced write or commit failed is counted in `stores_failed` only).
    pub stores_forced: u64,
    /// Requests `begin_prefill` refused with `WriteQueueFull` (under `Refuse`, or `ForceOldest`
    /// when forcing could not make room): their new blocks did not fit the write queue's limits,
    /// or the queued and retiring requests left no object-store request slot for their store and
    /// retrieve. A fully cached prompt, which has no store, counts here too when no slot was left
    /// for its retrieve: the count is of requests refused, not only of stores.
    pub stores_refused: u64,
    /// Requests with more new blocks than `write_queue_limit_blocks` under `ForceOldest`: only
    /// the first that many were stored (the rest will be computed again when next needed).
    pub stores_truncated: u64,
    /// Requests stored without a store because the pool had no evictable slot.
    pub stores_skipped_pool_full: u64,
    /// Requests run without a store because the object store's requests retiring
    /// (`Runtime::retiring_requests`) left no request slot for it beside the retrieve (forcing
    /// queued stores cannot end a retiring request): the retrieve runs, the new blocks are not
    /// stored.
    pub stores_skipped_no_request_slot: u64,
    /// Prefills the table had no bucket for (every read at layer 0, writes left to decode
    /// steps). Decode steps never count: a validated table has decode rows, and a context
    /// before the first row is priced as that row.
    pub table_fallbacks: u64,
    /// Time `before_layer` waited for a layer's KV (the bubble the runtime saw).
    pub kv_wait: Duration,
}
