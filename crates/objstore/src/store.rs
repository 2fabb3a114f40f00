//! The layer-wise API an engine calls (Tutti §3.1–3.2): `prepare_retrieve` / `prepare_store`
//! do every per-block step once — lookup, pinning, slot choice, IOCTXs written into IOCBs — and
//! `retrieve_layer` / `store_layer` then only issue the prepared IOCBs for one layer (O(IOCBs),
//! not O(blocks): gio_uring's per-layer rule moves each IOCTX to the layer).
//!
//! Two halves (docs/objstore.md, "Control and data halves"): [`StoreControl`] owns the pool
//! (index, slots, pins, eviction, the durable commit) and [`StoreData`] the engine side (the
//! registration, the mapping table, the gio_uring queue); they meet in plain data — handles,
//! [`Placement`]s, [`PoolShape`], payload CRCs — so that tuttid can run the first and each
//! engine process the second. [`KvStore`] is both in one process; [`LayerKvStore`] is the
//! layer-wise API either kind of store offers.
//!
//! Visibility and durability: a stored block enters the index only in `commit_store`, after
//! every layer completed, the devices were flushed and its slot header was written with FUA. A
//! slot reused by eviction is first made Empty on disk (in `prepare_store`, before any data is
//! issued), so a crash never leaves a Valid header over other bytes.
//!
//! Scheduling hook: every issue takes an [`SmBudget`] — how many SMs (GPU executor) or workers
//! (CPU executor) the layer's I/O may use, and the issue happens when the caller calls. The
//! slack-aware scheduler (crates/scheduler) decides both per layer; [`LayerIssuePolicy`] is the
//! seam an engine integration implements with it.

mod abandon;
mod commit;
mod control;
mod data;
mod layer_kv;
mod shape;
mod teardown;
#[cfg(test)]
mod tests;
mod verify;

use std::sync::Arc;
use std::time::Instant;

use gio_uring::{CpuExecutor, Executor, GioQueue, SmBudget};
use nvme_driver::DmaAllocator;

pub use control::StoreControl;
pub use data::{StoreData, LAYERS_IN_FLIGHT_LIMIT};
pub use layer_kv::LayerKvStore;
pub use shape::{DeviceLayout, Placement, PoolShape, Transferred};

use crate::error::{ObjstoreError, Result};
use crate::hash::{block_keys, KeyChain};
use crate::index::IndexCounts;
use crate::mapping::MappingTable;
use crate::pool::{Pool, QueueLender};
use crate::registration::KvRegistration;

/// Bounds the check, in `KvStore::new`, that the executor can lend its queue pairs (nothing is
/// in flight yet, so it answers at once).
const LEND_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Direction of a prepared request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Retrieve,
    Store,
}

/// Decides the SM (or worker) budget of each layer's issue; the scheduler plugs in here.
pub trait LayerIssuePolicy {
    fn budget(&mut self, direction: Direction, layer: u32, iocbs: usize) -> SmBudget;
}

/// The same budget for every layer.
#[derive(Debug, Clone, Copy)]
pub struct FixedBudget(pub SmBudget);

impl LayerIssuePolicy for FixedBudget {
    fn budget(&mut self, _direction: Direction, _layer: u32, _iocbs: usize) -> SmBudget {
        self.0
    }
}

/// Sizes fixed when the store is built.
#[derive(Debug, Clone, Copy)]
pub struct StoreConfig {
    /// IOCBs in the gio_uring queue (a power of two).
    pub iocbs: u32,
    /// IOCTX capacity of each IOCB (<= 2048, the ABI's maximum).
    pub ioctx_per_iocb_max: u32,
    /// Requests that may be prepared at once.
    pub requests_max: usize,
    /// Verify every retrieve against the payload CRCs recorded at commit (the pool must record
    /// them, and the KV memory must be host-visible through the store's DMA allocator): the
    /// `wait` that completes the last missing layer compares every block's CRC, and succeeds
    /// only if all matched; a block that does not is named in
    /// [`ObjstoreError::PayloadMismatch`] and evicted. A layer whose read failed (`LayerIo`)
    /// stays missing until it is issued again and completes: until then no `wait` compares
    /// anything, whichever layer it returns (the last layer's included), so an engine that
    /// must not compute on unverified KV uses the blocks only once every layer's latest
    /// `wait` succeeded. Costs one CPU pass over the retrieved bytes (docs/objstore.md gives
    /// the figures).
    pub verify_retrieves: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self { iocbs: 64, ioctx_per_iocb_max: 2048, requests_max: 32, verify_retrieves: false }
    }
}

/// A request: its tokens (only full blocks count) and the engine blocks that hold (store) or
/// will receive (retrieve) block i of the prefix (block `first_block + i` for a retrieve
/// prepared with [`KvStore::prepare_retrieve_from`]).
#[derive(Debug, Clone, Copy)]
pub struct KvRequest<'a> {
    pub tokens: &'a [u32],
    pub block_ids: &'a [u32],
}

/// Names a prepared request. Stale handles (finished, or of a reused slot) are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestHandle(u64);

impl RequestHandle {
    /// The handle of request slot `index` in its `generation` (the low half).
    fn new(index: usize, generation: u32) -> Self {
        Self((index as u64) << 32 | u64::from(generation))
    }

    /// The request slot it names (the high half).
    fn index(self) -> usize {
        (self.0 >> 32) as usize
    }

    /// The generation of its slot it names: a slot reused since gives a different one.
    fn generation(self) -> u32 {
        self.0 as u32
    }

    /// The handle's value, as it travels between processes.
    pub fn to_bits(self) -> u64 {
        self.0
    }

    /// A handle from its value (from another process: the store checks it before use).
    pub fn from_bits(bits: u64) -> Self {
        Self(bits)
    }
}

/// What `prepare_store` decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StorePlan {
    pub handle: RequestHandle,
    /// Blocks this request writes.
    pub new_blocks: usize,
    /// Blocks already cached or being stored by another request (stored once).
    pub shared_blocks: usize,
    /// Committed slots evicted to make room.
    pub evicted_slots: usize,
}

/// The layer-wise KV store over one pool, one registration and one gio_uring queue: a
/// [`StoreControl`] and a [`StoreData`] in one process, a request named by one handle in both.
///
/// Dropping it (or [`KvStore::close`]) first deletes the executor's queue pairs (before the
/// pool, whose targets may hold the last references to the controllers). If the executor
/// reports that one could not be deleted, its commands may still read the mapping table (SGL
/// descriptors, PRP lists) and read or write the engine's KV memory: the table is then leaked
/// ([`crate::leak`]), and `close` returns `false` so that the engine keeps its KV memory too.
pub struct KvStore<E: Executor> {
    /// Declared first, so dropped first: its queue pairs go before the pool's controllers.
    data: StoreData<E>,
    control: StoreControl,
    /// Scratch: a request's block keys, and its payload CRCs (recorded or computed).
    keys: Vec<u64>,
    crcs: Vec<u32>,
    /// The key space of lookups and prepares: 0, the in-process space, unless set (tuttid's key
    /// space of a model, rank and world).
    key_seed: u64,
    /// That space's key chain in this pool, `hash::KeyChain::new` of the pool's secret and
    /// `key_seed`: computed when the seed is set, not per block.
    chain: KeyChain,
}

/// A CPU executor with one I/O queue pair per pool device (device index i = pool device i),
/// each `nvme_queue_depth` deep, or as deep as its controller's CAP.MQES allows if that is
/// less. On a controller that granted fewer than two queue pairs per pool device, the pool's
/// metadata borrows these (the CPU executor lends them between commands).
pub fn cpu_executor_for(pool: &Pool, nvme_queue_depth: u32, config: &StoreConfig) -> Result<CpuExecutor> {
    let mut queues = Vec::with_capacity(pool.device_count());
    for device in 0..pool.device_count() {
        let controller = &pool.target(device).controller;
        match controller.create_io_queue_pair(nvme_queue_depth.min(controller.max_queue_depth())) {
            Ok(queue) => queues.push(queue),
            Err(nvme_driver::NvmeError::NoQueueAvailable { granted }) => {
                let needed = (0..pool.device_count()).filter(|&d| Arc::ptr_eq(&pool.target(d).controller, controller)).count();
                let own = (0..pool.device_count()).filter(|&d| !pool.metadata_queue_shared(d)).count();
                return Err(ObjstoreError::QueuePairs {
                    device,
                    granted,
                    needed,
                    reason: format!(
                        "the CPU executor needs one per pool device on this controller (pool metadata borrows them when the controller \
                         grants fewer than two per device; {own} pool device(s) keep a metadata queue pair of their own, and other \
                         users of the controller may hold some)"
                    ),
                });
            }
            Err(error) => return Err(error.into()),
        }
    }
    Ok(CpuExecutor::new(queues, config.iocbs))
}

/// The executor lends its queue pair of pool device `device` for the pool's metadata when the
/// pool has none of its own there (see `Executor::lend_queue_pair`).
impl<E: Executor> QueueLender for GioQueue<E> {
    fn lend(&mut self, device: usize, deadline: Instant) -> Result<Option<&mut nvme_driver::IoQueuePair>> {
        let (executor, memory) = self.executor_and_memory();
        Ok(executor.lend_queue_pair(memory, device, deadline)?)
    }
}

impl<E: Executor> KvStore<E> {
    /// Binds an open pool to the engine's registration: checks the geometry against the
    /// pool's, builds the mapping table in `dma` (the engine's device address space, shared by
    /// every pool device), and the gio_uring queue with `executor`.
    pub fn new(pool: Pool, registration: KvRegistration, dma: Arc<dyn DmaAllocator>, executor: E, config: StoreConfig) -> Result<Self> {
        if registration.geometry() != pool.geometry() {
            return Err(ObjstoreError::GeometryMismatch { on_disk: *pool.geometry(), registered: *registration.geometry() });
        }
        for device in 0..pool.device_count() {
            let target = pool.target(device);
            // Every device must reach the engine's memory and the mapping table at the IOVAs
            // registered: an IOVA of another space names unrelated memory on that device.
            if target.controller.dma().address_space() != dma.address_space() {
                return Err(ObjstoreError::InvalidRegistration {
                    reason: format!(
                        "pool device {device} ({target:?}) is in another DMA address space than the registered memory: open all pool \
                         controllers in one space (VfioDevice::open_many, EmuDevice::start_in) and register memory allocated there"
                    ),
                });
            }
        }
        let mut data = StoreData::new(pool.shape()?, registration, dma, executor, config)?;
        data.lends_metadata = vec![false; pool.device_count()];
        for device in (0..pool.device_count()).filter(|&device| pool.metadata_queue_shared(device)) {
            // The pool's metadata (header writes, flushes) borrows the executor's queue pair here.
            data.lends_metadata[device] = data.queue_mut().lend(device, Instant::now() + LEND_CHECK_TIMEOUT)?.is_some();
            if !data.lends_metadata[device] {
                let controller = &pool.target(device).controller;
                let on_controller = (0..pool.device_count()).filter(|&d| Arc::ptr_eq(&pool.target(d).controller, controller)).count();
                return Err(ObjstoreError::QueuePairs {
                    device,
                    granted: controller.granted_queue_pairs(),
                    needed: 2 * on_controller,
                    reason: format!(
                        "one per pool device on it for the executor and one for the pool's metadata; executor `{}` cannot lend its \
                         queue pairs for metadata (the CPU executor of `cpu_executor_for` can: with it, one per pool device is enough)",
                        data.queue().executor().name()
                    ),
                });
            }
        }
        let chain = KeyChain::new(pool.key_secret(), 0);
        let control = StoreControl::new(pool, config.requests_max)?;
        Ok(Self { data, control, keys: Vec::new(), crcs: Vec::new(), key_seed: 0, chain })
    }

    pub fn pool(&self) -> &Pool {
        self.control.pool()
    }

    /// The settings the store was built with.
    pub fn config(&self) -> &StoreConfig {
        self.data.config()
    }

    pub fn table(&self) -> &MappingTable {
        self.data.table()
    }

    pub fn queue_mut(&mut self) -> &mut GioQueue<E> {
        self.data.queue_mut()
    }

    pub fn counts(&self) -> IndexCounts {
        self.control.counts()
    }

    /// Gives the pool back; the executor's queue pairs are retired first, as by
    /// [`KvStore::close`]. Drops `close`'s answer (logged at error level when it is no): a
    /// caller that frees the engine's KV memory afterwards uses
    /// [`KvStore::into_pool_reporting`] instead.
    pub fn into_pool(self) -> Pool {
        self.into_pool_reporting().0
    }

    /// Gives the pool back, and says, as [`KvStore::close`] does, whether the engine may free
    /// its registered KV memory; the executor's queue pairs are retired first. Requests never
    /// finished are released ([`StoreControl::into_pool`]), unless a queue pair could not be
    /// retired (then every reservation is kept: those slots are not reused before a reopen),
    /// or a layer (a store's or a retrieve's) is still in flight and the executor does not say
    /// whether its pairs are gone (`retire_queue_pairs` answers `None`, the trait's default):
    /// then the reservations of the requests with a layer in flight are kept, since a store's
    /// late write may still land in its slots and a retrieve's late read still reads its slots
    /// into the KV memory, and the others are released (no command of theirs is left). The
    /// answer is `false` in both cases.
    pub fn into_pool_reporting(self) -> (Pool, bool) {
        let KvStore { mut data, control, .. } = self;
        let layer_in_flight = data.layer_in_flight();
        let requests_in_flight = data.requests_in_flight();
        let answer = data.retire_reporting();
        drop(data);
        match answer {
            Some(true) => (control.into_pool(), true),
            None if !layer_in_flight => (control.into_pool(), true),
            Some(false) => {
                tracing::error!("objstore: the pool was given back with executor queue pairs not retired: live reservations kept");
                (control.into_pool_unreleased(), false)
            }
            None => {
                tracing::error!(
                    "objstore: the pool was given back with a layer in flight, over an executor that does not say whether its queue \
                     pairs are gone: the reservations of the requests with a layer in flight kept"
                );
                (control.into_pool_keeping(&requests_in_flight), false)
            }
        }
    }

    /// Sets the key space of every later lookup and prepare: block keys are
    /// `objstore::hash::block_keys` in the chain `hash::KeyChain::new` of the pool's key secret
    /// and `seed`. 0 (the default) is the in-process space
    /// (keyed too); tuttid derives one per model fingerprint, TP rank and world, and an
    /// in-process store given the same seed finds what sessions of that space stored in the
    /// pool (and the reverse). One hash, here; none per block.
    pub fn set_key_seed(&mut self, seed: u64) {
        if seed == self.key_seed {
            // Its chain is computed already (at construction for seed 0).
            return;
        }
        self.key_seed = seed;
        self.chain = KeyChain::new(self.control.pool().key_secret(), seed);
    }

    /// The key space's seed last set (not the keyed chain derived from it).
    pub fn key_seed(&self) -> u64 {
        self.key_seed
    }

    /// The blocks a prepared request moves, as placed: for a store, its new blocks only (the
    /// shared ones are not written), each naming its engine block.
    pub fn placements(&self, handle: RequestHandle) -> Result<&[Placement]> {
        self.data.placements(handle)
    }

    /// The longest cached prefix of `tokens`, in blocks (times block_tokens for tokens).
    pub fn lookup(&mut self, tokens: &[u32]) -> usize {
        self.lookup_from(tokens, 0)
    }

    /// Where the run of cached blocks of `tokens`' prefix that starts at `first_block` ends, in
    /// blocks of the prefix: `first_block` plus how many are cached from there (an engine that
    /// holds blocks 0..first_block itself needs only those; see
    /// [`KvStore::prepare_retrieve_from`]). `first_block` past the full blocks counts as their end.
    pub fn lookup_from(&mut self, tokens: &[u32], first_block: usize) -> usize {
        block_keys(&self.chain, tokens, self.control.pool().geometry().block_tokens, &mut self.keys);
        self.control.lookup_from(&self.keys, first_block)
    }

    /// Checks `request`, whose blocks are blocks `first_block..` of its prefix, and computes the
    /// keys of the prefix's blocks up to its last into `self.keys`; returns how many (the
    /// request's own are the last `block_ids.len()`). Everything refused here is refused before
    /// anything is reserved: a store's reservation may evict (and sync Empty headers over)
    /// cached blocks, which releasing it does not bring back. So is a store short of IOCBs
    /// (`prepare_store` counts them next), and the reservation refuses a pool too full before
    /// it evicts. What can still refuse a store after its reservation evicted: the evicted
    /// slots' headers failing to sync, and the data half's own checks of the placements the
    /// control half made (consistent unless the index is), none of which a request causes.
    /// A retrieve's reservation evicts nothing.
    fn check_request(&mut self, request: &KvRequest<'_>, first_block: usize, direction: Direction) -> Result<usize> {
        let block_tokens = self.control.pool().geometry().block_tokens as usize;
        let full = request.tokens.len() / block_tokens;
        let blocks = request.block_ids.len();
        let end = first_block.checked_add(blocks).filter(|&end| blocks > 0 && end <= full).ok_or_else(|| ObjstoreError::BadRequest {
            reason: if first_block == 0 {
                format!(
                    "{blocks} block ids for {} tokens ({full} full blocks of {block_tokens}); expected 1..={full}",
                    request.tokens.len()
                )
            } else {
                format!(
                    "{blocks} block ids from block {first_block} for {} tokens ({full} full blocks of {block_tokens}); expected 1..={}",
                    request.tokens.len(),
                    full.saturating_sub(first_block)
                )
            },
        })?;
        // One max (vectorised) instead of a check per block; the error names the first bad id.
        let registration = self.data.table().registration();
        if request.block_ids.iter().copied().max().is_some_and(|max| max >= registration.num_blocks()) {
            for &block in request.block_ids {
                registration.check_block(block)?;
            }
        }
        // All of the request's blocks, shared ones included: one engine block cannot hold two
        // blocks' KV whichever of them is already cached.
        self.data.refuse_duplicate_engine_blocks(direction, request.block_ids.iter().copied())?;
        block_keys(&self.chain, &request.tokens[..end * block_tokens], block_tokens as u32, &mut self.keys);
        Ok(end)
    }

    /// Prepares reading blocks 0..n of `request`'s prefix (n = block_ids.len(), all cached: call
    /// `lookup` first) into the engine blocks `block_ids`. Pins their slots until `finish`.
    pub fn prepare_retrieve(&mut self, request: &KvRequest<'_>) -> Result<RequestHandle> {
        self.prepare_retrieve_from(request, 0)
    }

    /// Prepares reading blocks `first_block..first_block + block_ids.len()` of `request`'s
    /// prefix (all cached) into the engine blocks `block_ids`; the blocks before `first_block`
    /// (an engine's own prefix) are neither read nor required to be cached. `tokens` is the
    /// whole prefix up to the last block read: a block's key depends on every token before it.
    /// Pins the read blocks' slots until `finish`.
    pub fn prepare_retrieve_from(&mut self, request: &KvRequest<'_>, first_block: usize) -> Result<RequestHandle> {
        let end = self.check_request(request, first_block, Direction::Retrieve)?;
        let handle = self.control.reserve_retrieve(&self.keys[first_block..end], request.block_ids, first_block)?;
        let expected = if self.data.config().verify_retrieves {
            if let Err(error) = self.control.recorded_payload_crcs(handle, &mut self.crcs) {
                let _ = self.control.release(handle);
                return Err(error);
            }
            Some(&self.crcs[..])
        } else {
            None
        };
        let prepared =
            self.control.placements(handle).and_then(|placements| self.data.prepare(handle, Direction::Retrieve, placements, expected));
        if let Err(error) = prepared {
            let _ = self.control.release(handle);
            return Err(error);
        }
        Ok(handle)
    }

    /// Prepares storing `request`'s blocks: blocks already cached or in flight elsewhere are
    /// shared, the rest get slots (k consecutive new blocks per slot, slots round-robin across
    /// devices, LRU eviction when full) and prepared IOCTXs. The slots of shared cached blocks
    /// are pinned until the store commits or is finished, so no allocation (this one's or
    /// another store's) evicts a block this request counts on.
    pub fn prepare_store(&mut self, request: &KvRequest<'_>) -> Result<StorePlan> {
        let n = self.check_request(request, 0, Direction::Store)?;
        if self.data.may_be_short_of_iocbs(n) {
            // The IOCBs the new blocks take, refused before the reservation can evict: the
            // blocks no one holds or claimed are exactly those `reserve_store` finds new.
            let index = self.control.pool().index();
            let new_blocks = self.keys[..n]
                .iter()
                .zip(request.block_ids)
                .filter(|&(&key, _)| index.get(key).is_none() && !index.is_claimed(key))
                .map(|(_, &engine_block)| engine_block);
            self.data.refuse_short_of_iocbs(new_blocks, index.blocks_per_slot() as usize)?;
        }
        let plan = self.control.reserve_store(&self.keys[..n], request.block_ids, self.data.lender())?;
        let prepared =
            self.control.placements(plan.handle).and_then(|placements| self.data.prepare(plan.handle, Direction::Store, placements, None));
        if let Err(error) = prepared {
            let _ = self.control.release(plan.handle);
            return Err(error);
        }
        Ok(plan)
    }

    /// Issues the prepared reads of one layer (O(IOCBs)). Wait with [`KvStore::wait`].
    #[inline]
    pub fn retrieve_layer(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget) -> Result<()> {
        self.data.retrieve_layer(handle, layer, budget)
    }

    /// Issues the prepared writes of one layer (O(IOCBs)). Wait with [`KvStore::wait`].
    #[inline]
    pub fn store_layer(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget) -> Result<()> {
        self.data.store_layer(handle, layer, budget)
    }

    /// Issues one layer with the budget `policy` gives it (the scheduler integration point).
    pub fn issue_layer_with(&mut self, handle: RequestHandle, layer: u32, policy: &mut dyn LayerIssuePolicy) -> Result<()> {
        self.data.issue_layer_with(handle, layer, policy)
    }

    /// How many layers of one request may be in flight at once (1 unless set).
    pub fn layers_in_flight_max(&self) -> u32 {
        self.data.layers_in_flight_max()
    }

    /// Lets each request keep up to `layers` layers in flight: see
    /// [`StoreData::set_layers_in_flight_max`]. Only while no request is prepared.
    pub fn set_layers_in_flight_max(&mut self, layers: u32) -> Result<()> {
        self.data.set_layers_in_flight_max(layers)
    }

    /// The layers of `handle` in flight, oldest first.
    pub fn layers_in_flight(&self, handle: RequestHandle) -> Result<impl Iterator<Item = u32> + '_> {
        self.data.layers_in_flight(handle)
    }

    /// Waits (until `deadline`) for the oldest layer in flight; returns it, or `None` if none
    /// was. After a timeout the layer is still in flight: wait again, or (CPU executor) end it
    /// with `abandon_in_flight`. With several layers in flight
    /// ([`KvStore::set_layers_in_flight_max`]) each `wait` completes one, in issue order.
    ///
    /// On a verified retrieve whose verification failed, this and every later `wait` and `poll`
    /// return that failure until `finish`; the bad blocks' slots are evicted when it is first
    /// found: out of the index at once, their headers made Empty on disk within `deadline`
    /// (what does not fit stays staged for the next sync: the next commit, or
    /// [`KvStore::sync_headers`]). On a device whose metadata borrows the executor's queue
    /// pair, they are written only if the whole metadata timeout
    /// ([`crate::pool::METADATA_TIMEOUT`]) still fits before `deadline` once the pair is lent
    /// (the lend first waits for the executor's commands on it, which may take most of
    /// `deadline`; a `deadline` too short for the timeout is refused without lending): a write
    /// timed out early there would fence the device until reopen.
    pub fn wait(&mut self, handle: RequestHandle, deadline: Instant) -> Result<Option<u32>> {
        let failed_before = self.data.verify_failed(handle);
        let result = self.data.wait(handle, deadline);
        self.evict_new_mismatches(handle, failed_before, &result, deadline);
        result
    }

    /// Non-blocking: `Ok(true)` once nothing is in flight for the request (the layers that
    /// were are then complete, or the first failure is returned). A mismatch it finds evicts
    /// the bad blocks' slots from the index; their Empty headers stay staged (it does not wait
    /// for a header write) for the next sync: the next commit, [`KvStore::sync_headers`], or at
    /// the latest the pool's end (best effort: never on a fenced device, so its condemned
    /// blocks come back at reopen, where a verified retrieve catches them again).
    pub fn poll(&mut self, handle: RequestHandle) -> Result<bool> {
        let failed_before = self.data.verify_failed(handle);
        let result = self.data.poll(handle);
        self.evict_new_mismatches(handle, failed_before, &result, Instant::now());
        result
    }

    /// Writes the slot header entries staged and not yet durable (the Empty entries of an
    /// eviction whose `wait` or `poll` left no time for them), each device within what is left
    /// of `deadline` (on a device whose metadata borrows the executor's queue pair, only if the
    /// whole metadata timeout fits after the lend, which waits for the executor's commands on
    /// the pair: see [`StoreControl::sync_headers`]);
    /// [`ObjstoreError::DeadlinePassed`] if some stay staged.
    pub fn sync_headers(&mut self, deadline: Instant) -> Result<()> {
        self.control.sync_headers(self.data.lender(), deadline)
    }

    /// Evicts the slots of every block retrieve `handle` reserved, as a verification mismatch
    /// does (out of the index at once, their headers made Empty within `deadline`, what does not
    /// fit staged for the next sync). For a retrieve whose read the device failed (an NVMe error
    /// status on an unreadable LBA, say): left cached, every later request with that prefix would
    /// hit the same blocks and fail the same way. Call before `finish`. Returns the blocks evicted.
    pub fn evict_retrieve(&mut self, handle: RequestHandle, deadline: Instant) -> Result<usize> {
        self.control.evict_retrieve_by(handle, self.data.lender(), Some(deadline))
    }

    /// The control half evicts the slots of blocks a verification just found damaged, its
    /// header writes bounded by the caller's `deadline`.
    fn evict_new_mismatches<T>(&mut self, handle: RequestHandle, failed_before: bool, result: &Result<T>, deadline: Instant) {
        if let (false, Err(ObjstoreError::PayloadMismatch { blocks, .. })) = (failed_before, result) {
            if let Err(error) = self.control.evict_mismatched_by(handle, blocks, self.data.lender(), Some(deadline)) {
                tracing::warn!(%error, "evicting the slots of mismatched blocks (Empty headers not yet written stay staged)");
            }
        }
    }

    /// Ends a request without committing: a retrieve's pins are dropped; a store's slots go back
    /// to the free list (their headers already read Empty). Not while a layer is in flight: the
    /// device may still be moving its bytes.
    pub fn finish(&mut self, handle: RequestHandle) -> Result<()> {
        self.data.finish(handle)?;
        self.control.release(handle)
    }

    /// Ends both halves of a request on a failure path (nothing of it is in flight).
    fn release(&mut self, handle: RequestHandle) {
        let _ = self.data.finish(handle);
        let _ = self.control.release(handle);
    }
}
