//! The write queue: stores of finished layers waiting for slack, possibly across requests.
//!
//! Each queued store is one prepared objstore store (its own request slot and IOCBs). Its layers
//! go through four counts, each never ahead of the one before: *ready* (the engine finished
//! the layer: its new KV is in engine memory), *decided* (the policy released it for writing),
//! *issued* and *written* (its write completed). A store's IOCBs move one layer at a time (the
//! object store reissues the same IOCBs per layer), so at most one layer per store is in flight.
//! A store is committed — its blocks become visible to `lookup` — once every layer is written;
//! only then are its engine blocks releasable.
//!
//! A request that ended while the device may still move its bytes (a store dropped or failed, or
//! a retrieve whose read failed, with a layer whose wait timed out or whose executor failed) is
//! *retiring*: its handle is kept, and its engine blocks stay held, until the object store says
//! no layer of it is in flight; then it is finished. A write hold and a retiring hold count the
//! same for `releasable`.

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
    /// Per layer, the SM budget of the grant that released it: what the executor gets with that
    /// layer (the table's largest for forced writes and drains, and until a grant releases it).
    /// One per layer, as reads keep theirs: under the barrier several grants may release layers
    /// of this store before any is handed over, and with one budget for the store every layer
    /// went on the last grant's (more SMs than compute left free, or fewer than granted). One
    /// entry per model layer, allocated when the store is queued: no allocation per layer.
    pub layer_budgets: Vec<u32>,
    pub ready_layers: u32,
    pub decided_layers: u32,
    pub written_layers: u32,
    pub in_flight: Option<u32>,
    /// The SM budget the layer in flight was handed over on ([`WriteQueue::hand_over`]).
    pub in_flight_sm_budget: u32,
    /// The request's prefill has ended: writes issued from now on are deferred ones.
    pub prefill_ended: bool,
}

impl PendingStore {
    /// The SM budget layer `layer` goes on: that of the grant that released it. A layer past
    /// `layer_budgets` (none: one entry per model layer, and the runtime takes no layer past
    /// the model's) goes on the largest there.
    pub fn layer_budget(&self, layer: u32) -> u32 {
        match self.layer_budgets.get(layer as usize) {
            Some(&budget) => budget,
            None => self.layer_budgets.iter().copied().max().unwrap_or(1),
        }
    }

    /// Layers `layers` go on `sm_budget` SMs (those past `layer_budgets`: see `layer_budget`).
    pub fn set_budgets(&mut self, layers: std::ops::Range<u32>, sm_budget: u32) {
        let end = (layers.end as usize).min(self.layer_budgets.len());
        if let Some(budgets) = self.layer_budgets.get_mut(layers.start as usize..end) {
            budgets.fill(sm_budget);
        }
    }
}

/// A request taken off the queue (or a retrieve ended) with a layer still in flight.
#[derive(Debug)]
pub(crate) struct Retiring {
    pub request: u64,
    pub handle: RequestHandle,
    /// Engine blocks the device may still read (a store) or write (a retrieve): held.
    pub engine_blocks: Vec<u32>,
    /// A retrieve (its layer in flight is a read), not a store.
    pub read: bool,
    /// The layer in flight when it retired, if known: its issue has no completion in the event
    /// log yet, and `Runtime`'s `retire_ended` records one when the device ends it (left open,
    /// the log counted every later layer of the other direction as mixed).
    pub layer: Option<u32>,
}

#[derive(Debug)]
pub(crate) struct WriteQueue {
    pub stores: VecDeque<PendingStore>,
    /// Ended requests the device may still be moving bytes of (see the module documentation).
    /// Each holds an object-store request slot, so there are at most `StoreConfig::requests_max`.
    pub retiring: Vec<Retiring>,
    /// Per engine block, the queued stores that still need its data plus the retiring requests
    /// naming it (each time a list names it: at most the entries of every list, so a `usize`
    /// never saturates; a `u16` did at 65,535 duplicates and released the block early).
    holds: Vec<usize>,
    /// Per engine block, marked while `refuse_unusable` looks for a block named twice; all clear
    /// between calls (kept to avoid an allocation per request).
    named: Vec<bool>,
    /// Sum of `engine_blocks.len()` over `stores`.
    pub queued_blocks: usize,
    /// Block lists of finished stores, reused (no allocation per request once warm).
    spare_lists: Vec<Vec<u32>>,
    /// Write time the policy granted that no whole layer has used yet, at most one head layer's
    /// worth (see [`WriteQueue::decide`]).
    granted_us: f64,
    /// Decode-step time banked while a write layer ran ([`WriteQueue::bank_time`]), not yet
    /// spent: with `granted_us`, at most one head layer's worth. Spent by the next grant as the
    /// carry is; dropped when a prefill begins ([`WriteQueue::drop_banked`]).
    banked_us: f64,
}

impl WriteQueue {
    pub fn new(engine_blocks: u32, stores_max: usize) -> Self {
        Self {
            stores: VecDeque::with_capacity(stores_max),
            retiring: Vec::with_capacity(stores_max + 1),
            holds: vec![0; engine_blocks as usize],
            named: vec![false; engine_blocks as usize],
            queued_blocks: 0,
            spare_lists: Vec::with_capacity(stores_max),
            granted_us: 0.0,
            banked_us: 0.0,
        }
    }

    /// A block list to fill (reused when one is spare).
    pub fn take_list(&mut self) -> Vec<u32> {
        let mut list = self.spare_lists.pop().unwrap_or_default();
        list.clear();
        list
    }

    fn hold(&mut self, blocks: &[u32]) {
        for &block in blocks {
            // Block ids were checked against the registration by the store's prepare.
            if let Some(hold) = self.holds.get_mut(block as usize) {
                *hold = hold.saturating_add(1);
            }
        }
    }

    fn unhold(&mut self, blocks: &[u32]) {
        for &block in blocks {
            if let Some(hold) = self.holds.get_mut(block as usize) {
                *hold = hold.saturating_sub(1);
            }
        }
    }

    pub fn push(&mut self, store: PendingStore) {
        self.hold(&store.engine_blocks);
        self.queued_blocks += store.engine_blocks.len();
        self.stores.push_back(store);
    }

    /// Removes the store at `index` and releases its engine blocks. Only once nothing of it is
    /// in flight (the device may otherwise still read them): see [`WriteQueue::retire`].
    pub fn remove(&mut self, index: usize) -> Option<PendingStore> {
        let store = self.stores.remove(index)?;
        self.unhold(&store.engine_blocks);
        self.queued_blocks -= store.engine_blocks.len();
        Some(store)
    }

    /// Takes the store at `index` off the queue with a layer still in flight: it is retiring,
    /// its engine blocks stay held. Returns its request.
    pub fn retire(&mut self, index: usize) -> Option<u64> {
        let store = self.stores.remove(index)?;
        self.queued_blocks -= store.engine_blocks.len();
        self.retiring.push(Retiring {
            request: store.request,
            handle: store.handle,
            engine_blocks: store.engine_blocks,
            read: false,
            layer: store.in_flight,
        });
        Some(store.request)
    }

    /// Holds the running retrieve's target engine blocks: the device writes them until the
    /// prefill ends ([`WriteQueue::release_targets`]) or, if it ends with a read in flight,
    /// until the retiring retrieve is finished ([`WriteQueue::retire_retrieve`]).
    pub fn hold_targets(&mut self, engine_blocks: &[u32]) {
        self.hold(engine_blocks);
    }

    /// Releases targets held by [`WriteQueue::hold_targets`] (the retrieve is finished: nothing
    /// of it in flight) and keeps the list for reuse.
    pub fn release_targets(&mut self, engine_blocks: Vec<u32>) {
        self.unhold(&engine_blocks);
        self.recycle(engine_blocks);
    }

    /// A retrieve ended with a layer still in flight: it is retiring, and `engine_blocks` (its
    /// targets, held by [`WriteQueue::hold_targets`] since its prefill began) stay held until it
    /// is finished. `layer`: its read in flight, if known.
    pub fn retire_retrieve(&mut self, request: u64, handle: RequestHandle, engine_blocks: Vec<u32>, layer: Option<u32>) {
        self.retiring.push(Retiring { request, handle, engine_blocks, read: true, layer });
    }

    /// Removes the retiring request at `index` and releases its engine blocks (its handle was
    /// found with nothing in flight).
    pub fn remove_retiring(&mut self, index: usize) -> Option<Retiring> {
        if index >= self.retiring.len() {
            return None;
        }
        let entry = self.retiring.swap_remove(index);
        self.unhold(&entry.engine_blocks);
        Some(entry)
    }

    /// Whether a retiring request of this direction (a read: a retrieve) is left: the device
    /// still held its layer when the retiring requests were last polled. Retiring I/O is outside
    /// the barrier (a lost completion would otherwise stall the other direction until
    /// `Runtime::abandon_in_flight`), but a layer issued beside it is a mixed issue.
    pub fn retiring_in(&self, read: bool) -> bool {
        self.retiring.iter().any(|entry| entry.read == read)
    }

    /// Whether anything of request `request` is retiring.
    pub fn is_retiring(&self, request: u64) -> bool {
        self.retiring.iter().any(|entry| entry.request == request)
    }

    pub fn recycle(&mut self, list: Vec<u32>) {
        if self.spare_lists.len() < self.spare_lists.capacity() {
            self.spare_lists.push(list);
        }
    }

    /// Whether engine block `block` holds no data that a queued store still has to write, and
    /// no retiring request's I/O may still move it. Unknown blocks (outside the registration)
    /// hold nothing of ours.
    pub fn releasable(&self, block: u32) -> bool {
        self.holds.get(block as usize).is_none_or(|&hold| hold == 0)
    }

    /// The first of `blocks` (a new request's: retrieve targets, store sources, and the blocks
    /// past a truncated store that the engine computes into all the same) that it may
    /// not use, its position and why: one still held (a queued store's source, a retiring
    /// request's, the running retrieve's target: the device may still move its bytes, and
    /// data read into it or written from it would be another request's), or one named twice
    /// (two blocks' KV cannot share it: a read into it would overwrite the other block, a store
    /// from it would commit one block's KV under another's key), or one outside the
    /// registration (`named` has one entry per registered engine block): checked here, not
    /// left to the object store's prepare, which blocks past a truncated store (or all new
    /// blocks of a store skipped) never reach.
    pub fn refuse_unusable(&mut self, blocks: &[u32]) -> Option<(usize, u32, &'static str)> {
        let mut refused = None;
        for (position, &block) in blocks.iter().enumerate() {
            if !self.releasable(block) {
                refused = Some((position, block, "is still held (not releasable): the device may still move its bytes"));
                break;
            }
            let Some(named) = self.named.get_mut(block as usize) else {
                refused = Some((position, block, "is outside the registered engine blocks"));
                break;
            };
            if *named {
                refused = Some((position, block, "is named twice: two blocks' KV cannot share one engine block"));
                break;
            }
            *named = true;
        }
        for &block in blocks {
            if let Some(named) = self.named.get_mut(block as usize) {
                *named = false;
            }
        }
        refused
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

    /// Layers released for writing and not written yet: the kernels the outstanding writes reach
    /// the device as (one layer handed over at a time, each paying the command latency).
    pub fn outstanding_layers(&self) -> u32 {
        self.stores.iter().fold(0u32, |sum, s| sum.saturating_add(s.decided_layers - s.written_layers))
    }

    /// The IOCBs of the write layers in flight: of the outstanding ones, those the device holds
    /// now. One layer at most (`Runtime::pump_layers` hands them over one at a time), and while a
    /// read is pending no other is handed over (the barrier), so of the queued stores' writes a
    /// read waits behind these alone.
    ///
    /// Retiring stores' layers ([`WriteQueue::retire`]: a write that failed, or whose wait timed
    /// out, while the device still holds it) are not counted, here nor in
    /// [`WriteQueue::outstanding_iocbs`]: they are outside the barrier, so reads are handed over
    /// beside them (and the next store's write: two write layers may then be on the device), and
    /// the policy prices the SSD as if they were done. Not counted because their completion may
    /// be lost: a read does not wait for them, and priced ahead of it, a write that never ends
    /// (until `abandon_in_flight`) would push every later layer's reads out of its windows.
    pub fn in_flight_iocbs(&self) -> u32 {
        self.stores.iter().filter(|s| s.in_flight.is_some()).fold(0u32, |sum, s| sum.saturating_add(s.iocbs_per_layer))
    }

    /// The SM budget the write layer in flight runs on (what the policy prices it on): the one
    /// it was handed over on ([`WriteQueue::hand_over`]), that of the grant that released it.
    /// Once the store kept one budget, which a grant releasing more of it while the layer ran
    /// (a decode step) overwrote: a layer handed over on 2 SMs was priced at its 4-SM time
    /// after a 4-SM grant, the optimistic error pricing it on its own budget avoids. 0 when
    /// none is in flight.
    pub fn in_flight_sm_budget(&self) -> u32 {
        self.stores.iter().find(|s| s.in_flight.is_some()).map_or(0, |s| s.in_flight_sm_budget)
    }

    /// Layer `layer` of the store at `index` was handed over to the device on its budget,
    /// [`PendingStore::layer_budget`] (`Runtime::pump_layers`): it is in flight, and is priced
    /// on that budget until it ends. The only place a write layer is put in flight, so that
    /// what it is priced on is what it was handed over on.
    pub fn hand_over(&mut self, index: usize, layer: u32) {
        debug_assert!(!self.any_in_flight(), "one write layer in flight at a time");
        if let Some(store) = self.stores.get_mut(index) {
            debug_assert_eq!(layer, store.written_layers, "a store's layers are handed over in order");
            store.in_flight = Some(layer);
            store.in_flight_sm_budget = store.layer_budget(layer);
        }
    }

    pub fn any_in_flight(&self) -> bool {
        self.stores.iter().any(|store| store.in_flight.is_some())
    }

    /// Releases the oldest ready layers for writing, as many whole layers as the policy's grants
    /// cover. `cost_us(n)` is what `n` write IOCBs take as one kernel by the table: a grant of
    /// `grant_iocbs` is worth `cost_us(grant_iocbs)`, and each layer costs `cost_us` of its own
    /// IOCBs, latency included, because the store hands a layer over only once the one before it
    /// completed. So a window granted k layers' bytes as one kernel releases fewer layers when
    /// their k latencies do not fit (before, they overran it: in the last decode step of a
    /// request, into the next request, whose first read then waited behind them). This holds for
    /// a grant that covers the whole queue too: a slack-aware decode step that granted all 8
    /// IOCBs of 4 layers of 2 as one kernel (1450 µs of a 1500 µs step at 50 + 175 µs per IOCB)
    /// released all four (1600 µs). Only a flush ([`WriteQueue::flush`]) releases everything.
    ///
    /// A layer moves whole (the store issues a layer's IOCBs together), so time granted and not
    /// used is kept, up to the oldest waiting layer's cost, and adds to the next grants: the
    /// simulator writes the granted bytes of a layer, and without the carry a layer larger than
    /// every window would wait for the queue limit (then be forced onto a prefill's critical
    /// path). The price: such a layer overruns the window it goes in by what that window's grant
    /// lacks. Returns the layers released.
    /// The grant's `sm_budget` goes with each layer it releases (`PendingStore::layer_budgets`).
    pub fn decide(&mut self, grant_iocbs: u32, sm_budget: u32, cost_us: impl Fn(u32) -> f64) -> u32 {
        let grant_us = cost_us(grant_iocbs);
        self.release(grant_us, sm_budget, cost_us)
    }

    /// A flush grant (naive and no-overlap ask for the whole queue, whatever else the device
    /// does: `scheduler::policy::Issue::after_reads` false): every ready layer is released on
    /// `sm_budget` SMs, and the carry is spent. Returns the layers released.
    pub fn flush(&mut self, sm_budget: u32) -> u32 {
        let released = self.decide_all(sm_budget);
        self.granted_us = 0.0;
        self.banked_us = 0.0;
        released
    }

    /// Window time in which not one write IOCB fits (a write grant of 0 IOCBs,
    /// `scheduler::policy::Issue::slack_us`) joins the carry: a layer longer than every window
    /// goes once such windows add up to its cost, as with [`WriteQueue::decide`]. Without it
    /// such a layer was never released (no grant was made at all), and under
    /// `WriteQueueFullAction::Refuse` every later request was refused. Returns the layers
    /// released.
    pub fn decide_time(&mut self, slack_us: f64, sm_budget: u32, cost_us: impl Fn(u32) -> f64) -> u32 {
        self.release(slack_us, sm_budget, cost_us)
    }

    /// Time granted while a write layer is outstanding (a decode step the layer in flight takes
    /// whole: `scheduler::policy::Issue::slack_us`) is banked beside the carry, the two together
    /// up to the oldest waiting layer's cost, and releases nothing: the next grant after the layer ends releases the
    /// next one at once. Banking nothing while a layer ran, the carry started only after it,
    /// and a layer longer than a step wrote about half the time. Releasing on it would let a
    /// layer wait behind the one in flight and, if a prefill began meanwhile, go during that
    /// prefill's compute, in no window of it.
    ///
    /// The banked time is kept apart from the carry and dropped when a prefill begins
    /// ([`WriteQueue::drop_banked`]): carried into it, it let the prefill's first grant, however
    /// small, release a whole layer that then ran through the prefill's compute (20 ms layers,
    /// 4.4 ms steps: 19.6 ms banked, and a 1 ms window released the next layer).
    pub fn bank_time(&mut self, slack_us: f64, cost_us: impl Fn(u32) -> f64) {
        let slack_us = if slack_us.is_finite() { slack_us.max(0.0) } else { 0.0 };
        let head_layer_cost_us = self.head_layer_cost_us(&cost_us);
        self.banked_us = (self.banked_us + slack_us).min((head_layer_cost_us - self.granted_us).max(0.0));
    }

    /// A prefill begins: decode-step time banked while a write layer ran is dropped (see
    /// [`WriteQueue::bank_time`]). Only decode steps bank, so only decode-step grants spend it.
    /// The carry itself (time granted with the SSD free to write) is kept, as before banking.
    pub fn drop_banked(&mut self) {
        self.banked_us = 0.0;
    }

    /// What the oldest layer waiting to be released costs (0 with none waiting, or priced
    /// other than finite): the bound on the carry and the banked time together.
    fn head_layer_cost_us(&self, cost_us: impl Fn(u32) -> f64) -> f64 {
        let head = self.stores.iter().find(|store| store.decided_layers < store.ready_layers);
        let head_layer_cost_us = head.map_or(0.0, |store| cost_us(store.iocbs_per_layer));
        if head_layer_cost_us.is_finite() {
            head_layer_cost_us.max(0.0)
        } else {
            0.0
        }
    }

    fn release(&mut self, grant_us: f64, sm_budget: u32, cost_us: impl Fn(u32) -> f64) -> u32 {
        // The carry and the banked time were capped against the head layer when they were kept,
        // but that head may have left since without a release (its store forced, dropped or
        // failed): 20 ms banked against a 20 ms head let the next grant release four 5 ms layers
        // of the store behind it at once. Capped again against the head waiting now.
        let head_layer_cost_us = self.head_layer_cost_us(&cost_us);
        self.granted_us = self.granted_us.min(head_layer_cost_us);
        self.banked_us = self.banked_us.min((head_layer_cost_us - self.granted_us).max(0.0));
        let stores = self.stores.iter_mut().map(|store| {
            (
                Released { decided_layers: &mut store.decided_layers, layer_budgets: &mut store.layer_budgets },
                store.ready_layers,
                store.iocbs_per_layer,
            )
        });
        // The banked time is spent with the carry. A layer released spends it first (the head
        // layer costs at least the carry and the banked time together) and what is left is
        // carry; with none released, the carry grows by the grant (up to the head layer's cost)
        // and the banked time keeps what room is left beside it.
        let grant_us = if grant_us.is_finite() { grant_us.max(0.0) } else { 0.0 };
        let carried_us = self.granted_us;
        let mut available_us = carried_us + self.banked_us;
        let released = release_layers(&mut available_us, grant_us, sm_budget, stores, cost_us);
        if released > 0 {
            (self.granted_us, self.banked_us) = (available_us, 0.0);
        } else {
            self.granted_us = (carried_us + grant_us).min(available_us);
            self.banked_us = available_us - self.granted_us;
        }
        released
    }

    /// Releases every ready layer on `sm_budget` SMs (a flush, forced drains, `finish`).
    /// Returns the layers released.
    pub fn decide_all(&mut self, sm_budget: u32) -> u32 {
        let mut released = 0;
        for store in self.stores.iter_mut() {
            if store.decided_layers < store.ready_layers {
                released += store.ready_layers - store.decided_layers;
                store.set_budgets(store.decided_layers..store.ready_layers, sm_budget);
                store.decided_layers = store.ready_layers;
            }
        }
        released
    }
}

/// What [`release_layers`] updates in a store when it releases a layer.
struct Released<'a> {
    decided_layers: &'a mut u32,
    layer_budgets: &'a mut [u32],
}

/// The release rule of [`WriteQueue::decide`] over each store's (decided layers and budgets,
/// ready layers, IOCBs per layer), oldest first; `carried_us` is the time granted and not used
/// yet, `grant_us` what this grant adds; a released layer takes the grant's `sm_budget`.
fn release_layers<'a>(
    carried_us: &mut f64,
    grant_us: f64,
    sm_budget: u32,
    stores: impl Iterator<Item = (Released<'a>, u32, u32)>,
    cost_us: impl Fn(u32) -> f64,
) -> u32 {
    // Validated tables bound every duration (`scheduler::table::DURATION_US_MAX`), so costs are
    // finite; should one not be, a grant is worth nothing and a layer never fits (taken as
    // free, a layer of infinite cost went on any grant).
    let grant_us = if grant_us.is_finite() { grant_us.max(0.0) } else { 0.0 };
    let mut available_us = *carried_us + grant_us;
    let mut released = 0;
    let mut head_layer_cost_us = 0.0;
    'stores: for (store, ready_layers, iocbs_per_layer) in stores {
        let layer_cost_us = cost_us(iocbs_per_layer);
        let layer_cost_us = if layer_cost_us.is_finite() { layer_cost_us.max(0.0) } else { f64::INFINITY };
        while *store.decided_layers < ready_layers {
            if layer_cost_us > available_us {
                head_layer_cost_us = layer_cost_us;
                break 'stores; // oldest first: no younger write jumps ahead
            }
            available_us -= layer_cost_us;
            if let Some(budget) = store.layer_budgets.get_mut(*store.decided_layers as usize) {
                *budget = sm_budget;
            }
            *store.decided_layers += 1;
            released += 1;
        }
    }
    *carried_us = available_us.min(head_layer_cost_us);
    released
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One store of `ready` layers of 2 IOCBs; `cost_us(n)` = 50 µs latency + 175 µs per IOCB.
    /// Returns what each grant (in IOCBs) released.
    fn releases(ready: u32, grants: &[u32]) -> Vec<u32> {
        let cost_us = |iocbs: u32| 50.0 + 175.0 * f64::from(iocbs);
        let (mut carried_us, mut decided, mut budgets) = (0.0, 0, vec![4; ready as usize]);
        grants
            .iter()
            .map(|&grant| {
                let store = Released { decided_layers: &mut decided, layer_budgets: &mut budgets };
                release_layers(&mut carried_us, cost_us(grant), 4, std::iter::once((store, ready, 2)), cost_us)
            })
            .collect()
    }

    #[test]
    fn each_layer_pays_its_own_latency() {
        // Goal: a grant of 8 IOCBs as one kernel (1450 µs) holds 3 layers of 2 IOCBs (400 µs
        // each, latency included), not 4 (1600 µs: 150 µs past the window). The 250 µs left
        // carry over: with the next 2-IOCB grant (400 µs) they release one layer, and the
        // 250 µs left then are kept for the next.
        assert_eq!(releases(8, &[8, 2, 0]), vec![3, 1, 0]);
        assert_eq!(releases(8, &[1, 1]), vec![0, 1], "225 + 225 µs add up to a 400 µs layer");
    }

    #[test]
    fn a_plans_later_grant_releases_no_more_than_it_and_the_carry_pay_for() {
        // Goal: released layers never cost more than the carry plus the grants, even when a
        // grant covers the whole queue. One store of 4 layers of 2 IOCBs (400 µs each, latency
        // included; 8 queued); a plan grants 2 then 6 IOCBs (400 + 1100 µs). The first releases
        // one layer; the second covers the 6 IOCBs left, but 3 layers cost 1200 µs: it releases
        // 2 and carries 300 µs. A single grant of all 8 (1450 µs) releases 3, not 4 (1600 µs).
        let cost_us = |iocbs: u32| 50.0 + 175.0 * f64::from(iocbs);
        let (mut carried_us, mut decided, mut budgets) = (0.0, 0, [4; 4]);
        let mut granted_us = 0.0;
        for grant in [2, 6] {
            let store = Released { decided_layers: &mut decided, layer_budgets: &mut budgets };
            release_layers(&mut carried_us, cost_us(grant), 4, std::iter::once((store, 4, 2)), cost_us);
            granted_us += cost_us(grant);
            assert!(f64::from(decided) * cost_us(2) + carried_us <= granted_us, "{decided} layers, {carried_us} µs carried");
        }
        assert_eq!((decided, carried_us), (3, 300.0));
        assert_eq!(releases(4, &[8]), vec![3]);
    }

    #[test]
    fn a_layer_whose_cost_is_not_finite_is_never_released() {
        // Goal: a layer the cost rows price at infinity (or NaN) is never released by a grant:
        // it was taken as free (0 µs) and went on any grant, however small. A grant that is not
        // finite is worth nothing.
        for layer_cost_us in [f64::INFINITY, f64::NAN] {
            let cost_us = |iocbs: u32| if iocbs == 5 { layer_cost_us } else { 10.0 };
            let (mut carried_us, mut decided, mut budgets) = (0.0, 0, [4; 2]);
            for _ in 0..3 {
                let store = Released { decided_layers: &mut decided, layer_budgets: &mut budgets };
                assert_eq!(release_layers(&mut carried_us, cost_us(1), 4, std::iter::once((store, 2, 5)), cost_us), 0, "{layer_cost_us}");
            }
            assert!(carried_us.is_finite());
        }
        let (mut carried_us, mut decided, mut budgets) = (0.0, 0, [4; 2]);
        let store = Released { decided_layers: &mut decided, layer_budgets: &mut budgets };
        assert_eq!(release_layers(&mut carried_us, f64::INFINITY, 4, std::iter::once((store, 2, 5)), |_| 10.0), 0);
    }

    /// A store whose prefill ended (one engine block, an SM budget of 4, nothing written yet).
    fn ended_store(request: u64, iocbs_per_layer: u32, ready_layers: u32, decided_layers: u32, in_flight: Option<u32>) -> PendingStore {
        PendingStore {
            request,
            handle: RequestHandle::from_bits(request),
            engine_blocks: vec![0],
            iocbs_per_layer,
            layer_budgets: vec![4; ready_layers as usize],
            ready_layers,
            decided_layers,
            written_layers: 0,
            in_flight,
            in_flight_sm_budget: 4,
            prefill_ended: true,
        }
    }

    #[test]
    fn the_writes_a_read_waits_behind_are_the_layer_in_flight_not_every_released_one() {
        // Goal: the policy prices a read behind the write layer in flight alone
        // (`LayerView::in_flight_write_iocbs`): the other released layers wait for the reads.
        // A decode step released 4 layers of 2 IOCBs, one in flight; another store 2 of 3.
        let mut queue = WriteQueue::new(4, 2);
        queue.push(ended_store(1, 2, 4, 4, Some(0)));
        queue.push(ended_store(2, 3, 2, 2, None));
        assert_eq!((queue.outstanding_iocbs(), queue.outstanding_layers(), queue.in_flight_iocbs()), (14, 6, 2));
        queue.stores[0].in_flight = None;
        queue.stores[0].written_layers = 1;
        assert_eq!((queue.outstanding_iocbs(), queue.outstanding_layers(), queue.in_flight_iocbs()), (12, 5, 0));
    }

    #[test]
    fn the_write_in_flight_is_priced_on_its_stores_sm_budget() {
        // Goal: the policy prices the write layer in flight on the SMs it runs on
        // (`LayerView::in_flight_write_sm_budget`), the budget it was handed over on (a decode
        // step's free SMs), not the table's largest; 0 when none is in flight.
        let mut queue = WriteQueue::new(4, 2);
        queue.push(ended_store(1, 2, 4, 4, None));
        queue.push(ended_store(2, 3, 2, 2, Some(0)));
        queue.stores[1].in_flight_sm_budget = 2;
        assert_eq!(queue.in_flight_sm_budget(), 2);
        queue.stores[1].in_flight = None;
        assert_eq!(queue.in_flight_sm_budget(), 0);
    }

    #[test]
    fn a_later_grant_does_not_reprice_the_write_layer_in_flight() {
        // Goal: the layer in flight is priced on the budget it was handed over on, not on that
        // of a later grant releasing more of its store while it runs. Layer 0 handed over on 2
        // SMs, then a 4-SM decode step releases layer 1: the layer in flight still runs on 2
        // (before, the store's budget was read, which the later grant overwrote).
        let mut queue = WriteQueue::new(4, 2);
        queue.push(ended_store(1, 1, 2, 1, None));
        queue.stores[0].layer_budgets[0] = 2;
        queue.hand_over(0, 0);
        assert_eq!(queue.decide(1, 4, f64::from), 1);
        assert_eq!(queue.stores[0].layer_budgets, [2, 4]);
        assert_eq!(queue.in_flight_sm_budget(), 2);
    }

    #[test]
    fn each_layer_is_handed_over_on_the_budget_of_the_grant_that_released_it() {
        // Goal: under the barrier several grants may release layers of one store before any is
        // handed over; each layer runs (and is priced) on the budget of the grant that released
        // it, as reads do. A 4-SM grant releases layer 0, then a 2-SM grant layer 1, nothing
        // handed over yet: layer 0 goes on 4 SMs, layer 1 on 2. Before, the store kept one
        // budget, the last grant's, and layer 0 went on 2.
        let mut queue = WriteQueue::new(4, 2);
        queue.push(ended_store(1, 1, 2, 0, None));
        assert_eq!(queue.decide(1, 4, f64::from), 1);
        assert_eq!(queue.decide(1, 2, f64::from), 1);
        queue.hand_over(0, 0);
        assert_eq!(queue.in_flight_sm_budget(), 4);
        queue.stores[0].in_flight = None;
        queue.stores[0].written_layers = 1;
        queue.hand_over(0, 1);
        assert_eq!(queue.in_flight_sm_budget(), 2);
    }

    #[test]
    fn a_retiring_stores_write_is_not_counted_as_in_flight_or_outstanding() {
        // Goal: pins the documented exclusion (`in_flight_iocbs`): a store retired with its
        // layer in flight (its write failed or its wait timed out) leaves the counts the policy
        // prices reads behind; the device may still hold that layer (`retiring_in`), but it is
        // outside the barrier and its completion may be lost.
        let mut queue = WriteQueue::new(4, 2);
        queue.push(ended_store(1, 2, 4, 4, Some(0)));
        assert_eq!((queue.outstanding_iocbs(), queue.in_flight_iocbs(), queue.in_flight_sm_budget()), (8, 2, 4));
        assert_eq!(queue.retire(0), Some(1));
        assert!(queue.retiring_in(false) && !queue.any_in_flight());
        assert_eq!(
            (queue.outstanding_iocbs(), queue.outstanding_layers(), queue.in_flight_iocbs(), queue.in_flight_sm_budget()),
            (0, 0, 0, 0)
        );
    }

    #[test]
    fn time_banked_while_a_layer_runs_releases_nothing_until_the_next_grant() {
        // Goal: decode steps a 10 ms write layer in flight takes whole (4.4 ms each) are banked,
        // up to the next layer's cost, releasing nothing behind the layer in flight; the first
        // grant after it (a step of the idle SSD) releases the next layer at once. Before, no
        // step was granted while the layer ran, and the next layer needed three idle steps.
        let cost_us = |iocbs: u32| 10_000.0 * f64::from(iocbs);
        let mut queue = WriteQueue::new(4, 2);
        queue.push(ended_store(1, 1, 3, 1, Some(0)));
        for _ in 0..3 {
            queue.bank_time(4400.0, cost_us);
        }
        assert_eq!(queue.stores[0].decided_layers, 1, "nothing released behind the layer in flight");
        assert_eq!((queue.granted_us, queue.banked_us), (0.0, 10_000.0), "banked up to the next layer's cost");
        queue.bank_time(f64::NAN, cost_us);
        assert_eq!(queue.banked_us, 10_000.0);
        assert_eq!(queue.decide_time(4400.0, 4, cost_us), 1, "the first grant after it releases the next layer");
        assert_eq!((queue.granted_us, queue.banked_us), (4400.0, 0.0));
    }

    #[test]
    fn time_banked_is_dropped_when_a_prefill_begins_and_the_carry_is_kept() {
        // Goal: time banked in decode steps while a layer ran (`bank_time`) does not cross into
        // a prefill: `drop_banked` drops it and keeps the carry (time granted with the SSD free).
        // With nothing released, a grant joins the carry first; the banked time keeps what room
        // is left beside it, the two together never above the head layer's cost.
        let cost_us = |iocbs: u32| 10_000.0 * f64::from(iocbs);
        let mut queue = WriteQueue::new(4, 2);
        queue.push(ended_store(1, 1, 3, 1, Some(0)));
        assert_eq!(queue.decide_time(2000.0, 4, cost_us), 0);
        queue.bank_time(4400.0, cost_us);
        assert_eq!((queue.granted_us, queue.banked_us), (2000.0, 4400.0));
        assert_eq!(queue.decide_time(1000.0, 4, cost_us), 0);
        assert_eq!((queue.granted_us, queue.banked_us), (3000.0, 4400.0), "the grant joins the carry");
        queue.bank_time(4400.0, cost_us);
        queue.bank_time(4400.0, cost_us);
        assert_eq!((queue.granted_us, queue.banked_us), (3000.0, 7000.0), "together at most the head layer's cost");
        queue.drop_banked();
        assert_eq!((queue.granted_us, queue.banked_us), (3000.0, 0.0));
        assert_eq!(queue.decide_time(1000.0, 4, cost_us), 0, "a prefill's 1 ms window releases nothing");
        assert_eq!(queue.granted_us, 4000.0);
    }

    #[test]
    fn time_banked_against_a_head_that_left_without_a_release_is_capped_by_the_next_head() {
        // Goal: banked time (and carry) capped against the head layer when kept is capped again
        // against the head waiting when it is spent: the head store may leave without a release
        // (forced, dropped, failed). 20 ms banked against a 20 ms head layer, that store
        // removed, a store of 5 ms layers queued: a 4.4 ms grant releases at most one layer.
        // Before, the 20 ms banked released four at once.
        let cost_us = |iocbs: u32| 5_000.0 * f64::from(iocbs);
        let mut queue = WriteQueue::new(4, 2);
        queue.push(ended_store(1, 4, 8, 1, Some(0)));
        for _ in 0..5 {
            queue.bank_time(4400.0, cost_us);
        }
        assert_eq!(queue.banked_us, 20_000.0, "banked up to the 20 ms head layer");
        queue.remove(0).expect("the head store");
        queue.push(ended_store(2, 1, 8, 0, None));
        let released = queue.decide_time(4400.0, 4, cost_us);
        assert!(released <= 1, "a 4.4 ms grant released {released} layers of 5 ms");
        assert!(queue.granted_us + queue.banked_us <= 5_000.0, "{} + {}", queue.granted_us, queue.banked_us);
    }

    #[test]
    fn a_block_named_more_than_65535_times_stays_held_until_its_last_store_leaves() {
        // Goal: a block's hold count does not saturate: a store naming one engine block 65,536
        // times (an engine's block list with duplicates) and another store naming it once; when
        // the first leaves, the block is still held by the second. With a u16 count, the first
        // saturated it at 65,535 and its removal took it to 0: releasable while queued.
        let store = |request: u64, engine_blocks: Vec<u32>| PendingStore {
            request,
            handle: RequestHandle::from_bits(request),
            engine_blocks,
            iocbs_per_layer: 1,
            layer_budgets: Vec::new(),
            ready_layers: 0,
            decided_layers: 0,
            written_layers: 0,
            in_flight: None,
            in_flight_sm_budget: 0,
            prefill_ended: false,
        };
        let mut queue = WriteQueue::new(4, 2);
        queue.push(store(1, vec![0; 65_536]));
        queue.push(store(2, vec![0]));
        queue.remove(0).expect("the first store");
        assert!(!queue.releasable(0), "the second store still needs block 0");
        queue.remove(0).expect("the second store");
        assert!(queue.releasable(0));
    }
}
