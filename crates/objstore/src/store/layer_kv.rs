//! The layer-wise API as a trait, so that an engine integration can drive an in-process
//! [`KvStore`] or (with tuttid) a store whose control half lives in the daemon through the same
//! calls. Shaped after `KvStore`'s own methods, which keep their meaning here.

use std::time::Instant;

use gio_uring::{Executor, SmBudget};

use super::{KvRequest, KvStore, RequestHandle, StorePlan};
use crate::error::Result;

/// A layer-wise KV store: per request, `lookup`, one `prepare_*`, then per layer an issue and a
/// `wait` (or `poll`), then `commit_store` (a store) or `finish`.
pub trait LayerKvStore {
    /// The longest cached prefix of `tokens`, in blocks.
    fn lookup(&mut self, tokens: &[u32]) -> usize {
        self.lookup_from(tokens, 0)
    }
    /// Where the run of cached blocks that starts at `first_block` ends, in blocks of the
    /// prefix (`first_block` when that block is not cached).
    fn lookup_from(&mut self, tokens: &[u32], first_block: usize) -> usize;
    /// Prepares reading the cached blocks 0..block_ids.len() of the prefix into `block_ids`.
    fn prepare_retrieve(&mut self, request: &KvRequest<'_>) -> Result<RequestHandle> {
        self.prepare_retrieve_from(request, 0)
    }
    /// Prepares reading the cached blocks `first_block..first_block + block_ids.len()` of the
    /// prefix into `block_ids`; the blocks before are neither read nor required to be cached.
    fn prepare_retrieve_from(&mut self, request: &KvRequest<'_>, first_block: usize) -> Result<RequestHandle>;
    /// Prepares storing the prefix's blocks from `block_ids` (shared blocks are stored once).
    fn prepare_store(&mut self, request: &KvRequest<'_>) -> Result<StorePlan>;
    /// Issues the prepared reads of one layer.
    fn retrieve_layer(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget) -> Result<()>;
    /// Issues the prepared writes of one layer.
    fn store_layer(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget) -> Result<()>;
    /// How many layers of one request may be in flight at once: an engine may issue up to this
    /// many layers before it waits for the oldest (each `wait` completes one, in issue order).
    /// 1 for a store that does not say otherwise.
    fn layers_in_flight_max(&self) -> u32 {
        1
    }
    /// Whether any layer of the request is in flight — also after an issue that failed once
    /// its commands were published (`GioError::SubmitFailed`): its memory may still be moved.
    fn any_layer_in_flight(&self, handle: RequestHandle) -> Result<bool>;
    /// Waits until `deadline` for the oldest layer in flight; returns it, or `None` if none was.
    fn wait(&mut self, handle: RequestHandle, deadline: Instant) -> Result<Option<u32>>;
    /// Non-blocking: whether nothing is in flight for the request any more.
    fn poll(&mut self, handle: RequestHandle) -> Result<bool>;
    /// Makes a completed store durable and visible; once begun, finishes the handle (`Ok` or
    /// `Err`). Returns blocks stored. Refused before it begins (`HandleState`: not a store, or
    /// a layer not stored), the request is left as it was, holding its slots: store the
    /// missing layers and commit again, or `finish` it.
    fn commit_store(&mut self, handle: RequestHandle) -> Result<usize>;
    /// Ends a request without committing (nothing of a store becomes visible).
    fn finish(&mut self, handle: RequestHandle) -> Result<()>;
}

impl<E: Executor> LayerKvStore for KvStore<E> {
    fn lookup_from(&mut self, tokens: &[u32], first_block: usize) -> usize {
        KvStore::lookup_from(self, tokens, first_block)
    }

    fn prepare_retrieve_from(&mut self, request: &KvRequest<'_>, first_block: usize) -> Result<RequestHandle> {
        KvStore::prepare_retrieve_from(self, request, first_block)
    }

    fn prepare_store(&mut self, request: &KvRequest<'_>) -> Result<StorePlan> {
        KvStore::prepare_store(self, request)
    }

    fn retrieve_layer(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget) -> Result<()> {
        KvStore::retrieve_layer(self, handle, layer, budget)
    }

    fn store_layer(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget) -> Result<()> {
        KvStore::store_layer(self, handle, layer, budget)
    }

    fn layers_in_flight_max(&self) -> u32 {
        KvStore::layers_in_flight_max(self)
    }

    fn any_layer_in_flight(&self, handle: RequestHandle) -> Result<bool> {
        Ok(KvStore::layers_in_flight(self, handle)?.next().is_some())
    }

    fn wait(&mut self, handle: RequestHandle, deadline: Instant) -> Result<Option<u32>> {
        KvStore::wait(self, handle, deadline)
    }

    fn poll(&mut self, handle: RequestHandle) -> Result<bool> {
        KvStore::poll(self, handle)
    }

    fn commit_store(&mut self, handle: RequestHandle) -> Result<usize> {
        KvStore::commit_store(self, handle)
    }

    fn finish(&mut self, handle: RequestHandle) -> Result<()> {
        KvStore::finish(self, handle)
    }
}
