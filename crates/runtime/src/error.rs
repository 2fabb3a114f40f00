//! The runtime's errors: every misuse by the engine, every refused table and every I/O failure
//! is one of these, with what was expected and what happened.

use gio_uring::Executor;
use objstore::ObjstoreError;
use scheduler::SchedulerError;

use crate::runtime::Runtime;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("invalid runtime config: {reason}")]
    InvalidConfig { reason: String },
    #[error("the profile table does not describe the model and GPU in use: {source}")]
    ProfileMismatch {
        #[source]
        source: SchedulerError,
    },
    #[error("scheduler ({policy}): {source}")]
    Scheduler {
        policy: &'static str,
        #[source]
        source: SchedulerError,
    },
    #[error("object store, {operation}: {source}")]
    Store {
        operation: &'static str,
        #[source]
        source: ObjstoreError,
    },
    #[error("{call} out of order: {reason}")]
    OutOfOrder { call: &'static str, reason: String },
    /// `begin_prefill` was given an engine block the request may not use: read into, stored
    /// from, or (past a truncated store) only computed into. One not `Runtime::releasable`,
    /// one named twice, or one outside the registered engine blocks. Nothing was prepared or
    /// changed.
    #[error("begin_prefill: engine block {block} (block_ids[{position}]) {reason}; the request was not begun")]
    BlockRefused { block: u32, position: usize, reason: &'static str },
    /// `end_prefill` ended the prefill (its reads are over) and then failed: `source`. Met
    /// ending the retrieve (`source` is `StillInFlight` or `Store`, with the operation "finish
    /// the retrieve"), the request's store was dropped as well: its new KV was computed on that
    /// prefix. Met afterwards, planning the queues (`Scheduler`: nothing was advanced), the
    /// store stays queued. Met advancing them (an issue the executor failed after publishing
    /// it: the layer is in flight and the next call collects it; a write that failed; an
    /// executor error, met beside writes in flight by a retiring request's poll or kept by an
    /// earlier call (met with no live I/O, by `wait_retiring`, or starting layers handed over),
    /// `Store` with the operation "poll the executor"), the
    /// store stays queued unless that advance ended it: committed (its last layer written
    /// meanwhile), or dropped because a write of its own failed (counted in `stores_failed`;
    /// when finishing it was then refused, that is the failure returned, `Store` with the
    /// operation "finish a failed store", unless the same advance also returns an executor
    /// error: that one is returned and the refusal logged). The request is over either way: a retry of
    /// `end_prefill` is `StaleRequest`; the engine goes on with its next call. `kv_wait` is what
    /// `Ok` would have returned.
    #[error("request {request}'s prefill ended (after {kv_wait:?} waiting for KV), then: {source}")]
    PrefillEnded {
        request: u64,
        kv_wait: std::time::Duration,
        #[source]
        source: Box<RuntimeError>,
    },
    #[error("{call}: request {request} is finished or was never begun (the active one is {active:?})")]
    StaleRequest { call: &'static str, request: u64, active: Option<u64> },
    /// `cause` names the bound passed: "the block limit", "the store limit", or "the object
    /// store's request slots" (queued stores, retiring requests, the new store and a retrieve
    /// must fit `requests_max`).
    #[error(
        "write queue full ({cause}): {queued_blocks} blocks in {queued_stores} stores queued and {retiring_requests} retiring \
         requests, {incoming_blocks} more blocks; limits {limit_blocks} blocks / {limit_stores} stores / {requests_max} request \
         slots ({action})"
    )]
    WriteQueueFull {
        queued_blocks: usize,
        queued_stores: usize,
        retiring_requests: usize,
        incoming_blocks: usize,
        limit_blocks: usize,
        limit_stores: usize,
        requests_max: usize,
        cause: &'static str,
        action: &'static str,
    },
    #[error(
        "reading layer {layer}'s cached KV failed ({source}); the prefill is aborted: recompute the prefix, into engine blocks \
         `Runtime::releasable` reports free (a read that timed out keeps its target blocks held until the device ends it)"
    )]
    ReadFailed {
        layer: u32,
        #[source]
        source: ObjstoreError,
    },
    /// A request ended (dropped, aborted, failed) while a layer of it was still in flight: it is
    /// retiring. The runtime finishes it when the object store sees the layer end (a completion
    /// arriving late, a GPU executor's own timeout, `Runtime::abandon_in_flight` on a CPU
    /// executor); until then its engine blocks are not `releasable`.
    #[error(
        "request {request}: {operation}: {source}; a layer is still in flight, so the request is retired once the device ends it \
         and its engine blocks stay held (not releasable) until then"
    )]
    StillInFlight {
        request: u64,
        operation: &'static str,
        #[source]
        source: ObjstoreError,
    },
    #[error(
        "drain left {queued_stores} stores queued and {retiring} requests retiring (a layer in flight the device has not ended; their \
         engine blocks stay held)"
    )]
    DrainIncomplete { queued_stores: usize, retiring: usize },
    #[error("policy {policy} never issued the reads of layer {layer} (unissued IOCBs per layer: {unissued:?})")]
    ReadsNeverIssued { policy: &'static str, layer: u32, unissued: Vec<u32> },
}

/// [`Runtime::finish`] failed: what went wrong, and the runtime handed back with its store and
/// everything the store still has in flight. Dropping it would drop the store unclosed: the
/// engine would lose `KvStore::close`'s answer (whether its registered KV memory may be freed),
/// `Runtime::abandon_in_flight` and `Runtime::releasable`. Drain again, abandon what is in flight
/// (a CPU executor), or give up with [`Runtime::into_store`] and `KvStore::close`.
#[derive(thiserror::Error)]
#[error("finishing the runtime: {error} (the runtime is handed back: its store is not closed yet)")]
pub struct FinishError<E: Executor> {
    #[source]
    pub error: RuntimeError,
    pub runtime: Box<Runtime<E>>,
}

impl<E: Executor> std::fmt::Debug for FinishError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FinishError").field("error", &self.error).field("runtime", &self.runtime).finish()
    }
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// Wraps an object-store error with the operation that hit it.
pub(crate) fn store_error(operation: &'static str) -> impl FnOnce(ObjstoreError) -> RuntimeError {
    move |source| RuntimeError::Store { operation, source }
}
