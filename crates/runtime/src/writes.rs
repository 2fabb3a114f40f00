//! The write queue: stores of finished layers waiting for slack, possibly across requests.
//!
//! Each queued store is one prepared objstore store (its own request slot and IOCBs). Its layers
//! go through four counts, each never ahead of the one before: *ready* (the engine finished
//! the layer: its new KV is in engine memory), *decided* (the policy released it for writing),
//! *issued* and *written* (its write completed). A store's IOCBs move one layer at a time (the
//! object store reissues the same IOCBs per layer), so at most one layer per store is in flight.
//! A store is committed — its blocks become visible to `lookup` — once every layer is written;
//! only then are its engine blocks releasable.

use std::collections::VecDeque;

use objstore::RequestHandle;

/// One queued store.
#[derive(Debug)]
pub(crate) struct PendingStore {
    pub request: u64,
    pub handle: RequestHandle,
    /// Engine blocks holding the data to write (held until commit or failure).
    pub engine_blocks: Vec<u32>,
    /// The policy's unit for one layer of this store.
    pub iocbs_per_layer: u32,
    pub ready_layers: u32,
    pub decided_layers: u32,
    pub written_layers: u32,
    pub in_flight: Option<u32>,
    /// The request's prefill has ended: writes issued from now on are deferred ones.
    pub prefill_ended: bool,
}

#[derive(Debug)]
pub(crate) struct WriteQueue {
    pub stores: VecDeque<PendingStore>,
    /// Per engine block, the queued stores that still need its data.
    holds: Vec<u16>,
    /// Sum of `engine_blocks.len()` over `stores`.
    pub queued_blocks: usize,
    /// Block lists of finished stores, reused (no allocation per request once warm).
    spare_lists: Vec<Vec<u32>>,
    /// Write IOCBs the policy granted that no whole layer has used yet, at most one head layer's
    /// worth (see [`WriteQueue::decide`]).
    granted_iocbs: u32,
}

impl WriteQueue {
    pub fn new(engine_blocks: u32, stores_max: usize) -> Self {
        Self {
            stores: VecDeque::with_capacity(stores_max),
            holds: vec![0; engine_blocks as usize],
            queued_blocks: 0,
            spare_lists: Vec::with_capacity(stores_max),
            granted_iocbs: 0,
        }
    }

    /// A block list to fill (reused when one is spare).
    pub fn take_list(&mut self) -> Vec<u32> {
        let mut list = self.spare_lists.pop().unwrap_or_default();
        list.clear();
        list
    }

    pub fn push(&mut self, store: PendingStore) {
        for &block in &store.engine_blocks {
            // Block ids were checked against the registration by `prepare_store`.
            if let Some(hold) = self.holds.get_mut(block as usize) {
                *hold = hold.saturating_add(1);
            }
        }
        self.queued_blocks += store.engine_blocks.len();
        self.stores.push_back(store);
    }

    /// Removes the store at `index` and releases its engine blocks.
    pub fn remove(&mut self, index: usize) -> Option<PendingStore> {
        let store = self.stores.remove(index)?;
        for &block in &store.engine_blocks {
            if let Some(hold) = self.holds.get_mut(block as usize) {
                *hold = hold.saturating_sub(1);
            }
        }
        self.queued_blocks -= store.engine_blocks.len();
        Some(store)
    }

    pub fn recycle(&mut self, list: Vec<u32>) {
        if self.spare_lists.len() < self.spare_lists.capacity() {
            self.spare_lists.push(list);
        }
    }

    /// Whether engine block `block` holds no data that a queued store still has to write.
    /// Unknown blocks (outside the registration) hold nothing of ours.
    pub fn releasable(&self, block: u32) -> bool {
        self.holds.get(block as usize).is_none_or(|&hold| hold == 0)
    }

    pub fn index_of(&self, request: u64) -> Option<usize> {
        self.stores.iter().position(|store| store.request == request)
    }

    /// New KV finished and not yet released for writing, in the policy's IOCBs.
    pub fn queued_iocbs(&self) -> u32 {
        self.stores.iter().fold(0u32, |sum, s| sum.saturating_add((s.ready_layers - s.decided_layers).saturating_mul(s.iocbs_per_layer)))
    }

    /// Released for writing and not written yet, in the policy's IOCBs.
    pub fn outstanding_iocbs(&self) -> u32 {
        self.stores.iter().fold(0u32, |sum, s| sum.saturating_add((s.decided_layers - s.written_layers).saturating_mul(s.iocbs_per_layer)))
    }

    pub fn any_in_flight(&self) -> bool {
        self.stores.iter().any(|store| store.in_flight.is_some())
    }

    /// Releases the oldest ready layers for writing, as many whole layers as the policy's grants
    /// cover: `iocb_count` now, plus what earlier grants left unused. A layer moves whole (the
    /// store issues a layer's IOCBs together), so a grant smaller than the oldest layer is kept,
    /// up to that layer's size, and the layer goes once the grants add up to it: the simulator
    /// writes the granted bytes of a layer, and without the carry a layer larger than every
    /// window would wait for the queue limit (then be forced onto a prefill's critical path).
    /// The price: the layer may overrun the window it goes in by what that window's grant lacks.
    /// Returns the layers released.
    pub fn decide(&mut self, iocb_count: u32) -> u32 {
        let mut available = self.granted_iocbs.saturating_add(iocb_count);
        let mut released = 0;
        'stores: for store in self.stores.iter_mut() {
            while store.decided_layers < store.ready_layers {
                if store.iocbs_per_layer > available {
                    break 'stores; // oldest first: no younger write jumps ahead
                }
                available -= store.iocbs_per_layer;
                store.decided_layers += 1;
                released += 1;
            }
        }
        let head_layer_iocbs =
            self.stores.iter().find(|store| store.decided_layers < store.ready_layers).map_or(0, |store| store.iocbs_per_layer);
        self.granted_iocbs = available.min(head_layer_iocbs);
        released
    }

    /// Releases every ready layer (forced drains, `finish`).
    pub fn decide_all(&mut self) {
        for store in self.stores.iter_mut() {
            store.decided_layers = store.ready_layers;
        }
    }
}
