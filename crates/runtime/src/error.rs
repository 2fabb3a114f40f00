//! The runtime's errors: every misuse by the engine, every refused table and every I/O failure
//! is one of these, with what was expected and what happened.

use objstore::ObjstoreError;
use scheduler::SchedulerError;

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
    #[error("{call}: request {request} is finished or was never begun (the active one is {active:?})")]
    StaleRequest { call: &'static str, request: u64, active: Option<u64> },
    #[error(
        "write queue full: {queued_blocks} blocks in {queued_stores} stores queued, {incoming_blocks} more would pass the limit of \
         {limit_blocks} blocks / {limit_stores} stores ({action})"
    )]
    WriteQueueFull {
        queued_blocks: usize,
        queued_stores: usize,
        incoming_blocks: usize,
        limit_blocks: usize,
        limit_stores: usize,
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

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// Wraps an object-store error with the operation that hit it.
pub(crate) fn store_error(operation: &'static str) -> impl FnOnce(ObjstoreError) -> RuntimeError {
    move |source| RuntimeError::Store { operation, source }
}
