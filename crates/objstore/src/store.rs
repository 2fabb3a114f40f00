//! The layer-wise API an engine calls (Tutti §3.1–3.2): `prepare_retrieve` / `prepare_store`
//! do every per-block step once — lookup, pinning, slot choice, IOCTXs written into IOCBs — and
//! `retrieve_layer` / `store_layer` then only issue the prepared IOCBs for one layer (O(IOCBs),
//! not O(blocks): gio_uring's per-layer rule moves each IOCTX to the layer).
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
mod teardown;
mod verify;

use std::sync::Arc;
use std::time::Instant;

use gio_uring::abi::Opcode;
use gio_uring::{
    CpuExecutor, Dependency, DeviceIndex, DeviceInfo, DeviceTable, Executor, GioError, GioQueue, IocbId, IocbSpec, IoctxSpec, IovaRange,
    LayerIndex, Lba, QueueConfig, RegisteredMemory, SmBudget,
};
use nvme_driver::{DataPointerMode, DmaAllocator};

use crate::error::{ObjstoreError, Result};
use crate::format::{BlockRecord, SlotAddressing, SlotState};
use crate::hash::block_keys;
use crate::index::{BlockLocation, Claim, IndexCounts};
use crate::mapping::{CommandLimits, MappingForm, MappingTable};
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
    /// last layer's `wait` succeeds only once every block's CRC matched; a block that does
    /// not is named in [`ObjstoreError::PayloadMismatch`] and evicted. Costs one CPU pass over
    /// the retrieved bytes (docs/objstore.md gives the figures).
    pub verify_retrieves: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self { iocbs: 64, ioctx_per_iocb_max: 2048, requests_max: 32, verify_retrieves: false }
    }
}

/// A request: its tokens (only full blocks count) and the engine blocks that hold (store) or
/// will receive (retrieve) block i of the prefix.
#[derive(Debug, Clone, Copy)]
pub struct KvRequest<'a> {
    pub tokens: &'a [u32],
    pub block_ids: &'a [u32],
}

/// Names a prepared request. Stale handles (finished, or of a reused slot) are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestHandle(u64);

impl RequestHandle {
    fn index(self) -> usize {
        (self.0 >> 32) as usize
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

#[derive(Debug, Default)]
struct Request {
    generation: u32,
    active: bool,
    direction: Option<Direction>,
    iocbs: Vec<IocbId>,
    /// (device, slot, position, engine block, key) of every block the request moves.
    blocks: Vec<(BlockLocation, u32, u64)>,
    /// (device, slot, blocks used) of every slot the request pinned (retrieve) or allocated
    /// (store).
    slots: Vec<(u16, u32, u16)>,
    /// A store's pins on the slots of the cached blocks it shares, one per block.
    shared_pins: Vec<(u16, u32)>,
    layer_in_flight: Option<u32>,
    layers_done: Vec<bool>,
    /// Verified retrieves: one running CRC per block, and how many layers (from 0, in order)
    /// are folded into them.
    crcs: Vec<crc32fast::Hasher>,
    crc_layers: u32,
    /// Verified retrieves: each block's payload CRC as recorded when the request was prepared
    /// (its slot is pinned from then on, so it cannot change; a later eviction of the slot by
    /// another request's mismatch rewrites the mirror entry, not these).
    expected_crcs: Vec<u32>,
    /// Verified retrieves: the verification failed. Sticky until `finish`: `wait` and `poll`
    /// return it again, and no layer is issued, so a poll-driven engine never sees the request
    /// complete.
    verify_failure: Option<verify::VerifyFailure>,
}

/// The layer-wise KV store over one pool, one registration and one gio_uring queue.
///
/// Dropping it (or [`KvStore::close`]) first deletes the executor's queue pairs (before the
/// pool, whose targets may hold the last references to the controllers). If the executor
/// reports that one could not be deleted, its commands may still read the mapping table (SGL
/// descriptors, PRP lists) and read or write the engine's KV memory: the table is then leaked
/// ([`crate::leak`]), and `close` returns `false` so that the engine keeps its KV memory too.
pub struct KvStore<E: Executor> {
    queue: GioQueue<E>,
    pool: Pool,
    table: MappingTable,
    dma: Arc<dyn DmaAllocator>,
    config: StoreConfig,
    requests: Vec<Request>,
    free_requests: Vec<usize>,
    keys: Vec<u64>,
    ioctxs: Vec<IoctxSpec>,
    device_cursor: usize,
    crc_scratch: Vec<u8>,
    records: Vec<BlockRecord>,
    /// Per pool device: its namespace id and slot addressing (the per-block LBA arithmetic).
    addressing: Vec<(u32, SlotAddressing)>,
    /// Set once the executor's queue pairs were retired (at close, `into_pool` or drop):
    /// whether the memory their commands name may be freed.
    retired: Option<bool>,
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

/// The KV tensors as gio_uring ranges, touching ones merged: tensors allocated back to back are
/// one buffer to the per-layer rule (a PRP layout at one layer stride spans several). Only KV
/// extents are merged, so no request can run from the KV memory into the mapping table.
fn kv_ranges(extents: &[crate::registration::Extent]) -> Vec<IovaRange> {
    let mut sorted: Vec<IovaRange> = extents.iter().map(|e| IovaRange::new(e.start, e.len_bytes)).collect();
    sorted.sort_by_key(|range| range.start);
    let mut merged: Vec<IovaRange> = Vec::with_capacity(sorted.len());
    for range in sorted {
        match merged.last_mut() {
            Some(last) if last.end() == Some(range.start.0) => last.len_bytes += range.len_bytes,
            _ => merged.push(range),
        }
    }
    merged
}

impl<E: Executor> KvStore<E> {
    /// Binds an open pool to the engine's registration: checks the geometry against the
    /// pool's, builds the mapping table in `dma` (the engine's device address space, shared by
    /// every pool device), and the gio_uring queue with `executor`.
    pub fn new(pool: Pool, registration: KvRegistration, dma: Arc<dyn DmaAllocator>, executor: E, config: StoreConfig) -> Result<Self> {
        if registration.geometry() != pool.geometry() {
            return Err(ObjstoreError::GeometryMismatch { on_disk: *pool.geometry(), registered: *registration.geometry() });
        }
        if config.requests_max == 0 || config.ioctx_per_iocb_max == 0 {
            return Err(ObjstoreError::BadRequest {
                reason: format!("store config {config:?}: requests_max and ioctx_per_iocb_max must be positive"),
            });
        }
        if config.verify_retrieves {
            verify::check_verifiable(&pool, &registration, &dma)?;
        }
        let k = pool.blocks_per_slot();
        // Every command must fit every pool device: the table cuts transfers to the smallest MDTS.
        let max_transfer_bytes =
            (0..pool.device_count()).map(|device| pool.target(device).controller.max_transfer_bytes()).min().unwrap_or(0);
        let limits = CommandLimits { max_transfer_bytes, lba_bytes: pool.superblock(0).lba_bytes };
        let table = MappingTable::build(registration, &dma, k, limits)?;
        let mut devices = Vec::with_capacity(pool.device_count());
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
            let namespace = target.controller.namespace(target.namespace)?;
            let sgl = target.controller.data_pointer_mode() == DataPointerMode::Sgl;
            if table.registration().mode() == DataPointerMode::Sgl && !sgl {
                return Err(ObjstoreError::InvalidRegistration {
                    reason: format!("registered for SGL, but pool device {device} ({target:?}) has no SGL support: register for PRP"),
                });
            }
            devices.push(DeviceInfo {
                nsid: namespace.id.0,
                capacity_blocks: namespace.size_blocks,
                block_bytes: namespace.block_size_bytes,
                sgl_supported: sgl,
            });
        }
        // On the SGL-table path IOCTXs point only into the table (the KV addresses are in the
        // descriptors, checked at registration): registering just the table keeps gio_uring's
        // per-IOCTX range lookup to one range.
        let mut ranges: Vec<IovaRange> =
            if table.form() == MappingForm::SglTable { Vec::new() } else { kv_ranges(&table.registration().extents()?) };
        ranges.extend(table.region_range());
        let registered = RegisteredMemory::new(ranges)
            .ok_or_else(|| ObjstoreError::InvalidRegistration { reason: "the mapping table overlaps the registered KV memory".into() })?;
        let queue = GioQueue::init_queue(
            QueueConfig { depth: config.iocbs, ioctx_per_iocb_max: config.ioctx_per_iocb_max },
            DeviceTable::new(devices),
            registered,
            executor,
        )?;
        let mut queue = queue;
        for device in (0..pool.device_count()).filter(|&device| pool.metadata_queue_shared(device)) {
            // The pool's metadata (header writes, flushes) borrows the executor's queue pair here.
            if queue.lend(device, Instant::now() + LEND_CHECK_TIMEOUT)?.is_none() {
                let controller = &pool.target(device).controller;
                let on_controller = (0..pool.device_count()).filter(|&d| Arc::ptr_eq(&pool.target(d).controller, controller)).count();
                return Err(ObjstoreError::QueuePairs {
                    device,
                    granted: controller.granted_queue_pairs(),
                    needed: 2 * on_controller,
                    reason: format!(
                        "one per pool device on it for the executor and one for the pool's metadata; executor `{}` cannot lend its \
                         queue pairs for metadata (the CPU executor of `cpu_executor_for` can: with it, one per pool device is enough)",
                        queue.executor().name()
                    ),
                });
            }
        }
        let addressing = pool.devices.iter().map(|device| (device.target.namespace.0, device.superblock.addressing())).collect();
        let layers = pool.geometry().layers as usize;
        let requests = (0..config.requests_max).map(|_| Request { layers_done: vec![false; layers], ..Request::default() }).collect();
        Ok(Self {
            pool,
            table,
            queue,
            dma,
            config,
            requests,
            free_requests: (0..config.requests_max).rev().collect(),
            keys: Vec::new(),
            ioctxs: Vec::with_capacity(config.ioctx_per_iocb_max as usize),
            device_cursor: 0,
            crc_scratch: Vec::new(),
            records: Vec::with_capacity(k as usize),
            addressing,
            retired: None,
        })
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn table(&self) -> &MappingTable {
        &self.table
    }

    pub fn queue_mut(&mut self) -> &mut GioQueue<E> {
        &mut self.queue
    }

    pub fn counts(&self) -> IndexCounts {
        self.pool.index.counts()
    }

    /// Gives the pool back (every request must be finished); the executor's queue pairs are
    /// retired first, as by [`KvStore::close`].
    pub fn into_pool(mut self) -> Pool {
        self.retire_queue_pairs();
        std::mem::replace(&mut self.pool, Pool::empty())
    }

    /// The longest cached prefix of `tokens`, in blocks (times block_tokens for tokens).
    pub fn lookup(&mut self, tokens: &[u32]) -> usize {
        block_keys(tokens, self.pool.geometry().block_tokens, &mut self.keys);
        self.pool.index.cached_prefix(&self.keys)
    }

    fn check_request(&mut self, request: &KvRequest<'_>) -> Result<usize> {
        let block_tokens = self.pool.geometry().block_tokens as usize;
        let full = request.tokens.len() / block_tokens;
        let n = request.block_ids.len();
        if n == 0 || n > full {
            return Err(ObjstoreError::BadRequest {
                reason: format!(
                    "{n} block ids for {} tokens ({full} full blocks of {block_tokens}); expected 1..={full}",
                    request.tokens.len()
                ),
            });
        }
        // One max (vectorised) instead of a check per block; the error names the first bad id.
        if request.block_ids.iter().copied().max().is_some_and(|max| max >= self.table.registration().num_blocks()) {
            let registration = self.table.registration();
            for &block in request.block_ids {
                registration.check_block(block)?;
            }
        }
        block_keys(&request.tokens[..n * block_tokens], block_tokens as u32, &mut self.keys);
        Ok(n)
    }

    fn take_request(&mut self, direction: Direction) -> Result<usize> {
        let index = self.free_requests.pop().ok_or(ObjstoreError::TooManyRequests { max: self.config.requests_max })?;
        let request = &mut self.requests[index];
        request.generation = request.generation.wrapping_add(1);
        request.active = true;
        request.direction = Some(direction);
        request.iocbs.clear();
        request.blocks.clear();
        request.slots.clear();
        request.shared_pins.clear();
        request.layer_in_flight = None;
        request.layers_done.fill(false);
        request.crcs.clear();
        request.crc_layers = 0;
        request.expected_crcs.clear();
        request.verify_failure = None;
        Ok(index)
    }

    fn handle_of(&self, index: usize) -> RequestHandle {
        RequestHandle((index as u64) << 32 | u64::from(self.requests[index].generation))
    }

    fn request_index(&self, handle: RequestHandle) -> Result<usize> {
        let index = handle.index();
        match self.requests.get(index) {
            Some(request) if request.active && u64::from(request.generation) == handle.0 & 0xFFFF_FFFF => Ok(index),
            _ => Err(ObjstoreError::UnknownHandle { handle: handle.0 }),
        }
    }

    /// Prepares reading blocks 0..n of `request`'s prefix (n = block_ids.len(), all cached: call
    /// `lookup` first) into the engine blocks `block_ids`. Pins their slots until `finish`.
    pub fn prepare_retrieve(&mut self, request: &KvRequest<'_>) -> Result<RequestHandle> {
        let n = self.check_request(request)?;
        let index = self.take_request(Direction::Retrieve)?;
        let mut blocks = std::mem::take(&mut self.requests[index].blocks);
        let mut slots = std::mem::take(&mut self.requests[index].slots);
        for (i, &key) in self.keys[..n].iter().enumerate() {
            let Some(location) = self.pool.index.get(key) else {
                self.requests[index].blocks = blocks;
                self.requests[index].slots = slots;
                self.release(index);
                return Err(ObjstoreError::BadRequest {
                    reason: format!("block {i} of the prefix is not cached (lookup found {i} of {n})"),
                });
            };
            self.pool.index.pin_and_touch(location.device, location.slot);
            slots.push((location.device, location.slot, 0));
            blocks.push((location, request.block_ids[i], key));
        }
        self.requests[index].blocks = blocks;
        self.requests[index].slots = slots;
        if self.config.verify_retrieves {
            self.requests[index].crcs.resize(n, crc32fast::Hasher::new());
            if let Err(error) = self.snapshot_expected_crcs(index) {
                self.release(index);
                return Err(error);
            }
        }
        if let Err(error) = self.build_iocbs(index, Opcode::Read) {
            self.release(index);
            return Err(error);
        }
        Ok(self.handle_of(index))
    }

    /// Prepares storing `request`'s blocks: blocks already cached or in flight elsewhere are
    /// shared, the rest get slots (k consecutive new blocks per slot, slots round-robin across
    /// devices, LRU eviction when full) and prepared IOCTXs. The slots of shared cached blocks
    /// are pinned until the store commits or is finished, so no allocation (this one's or
    /// another store's) evicts a block this request counts on.
    pub fn prepare_store(&mut self, request: &KvRequest<'_>) -> Result<StorePlan> {
        let n = self.check_request(request)?;
        let k = self.pool.blocks_per_slot() as usize;
        let index = self.take_request(Direction::Store)?;
        let mut blocks = std::mem::take(&mut self.requests[index].blocks);
        let mut pins = std::mem::take(&mut self.requests[index].shared_pins);
        let mut shared = 0;
        // Pass 1, one map probe per block: claim the new keys, pin the slots of cached ones
        // before any allocation can evict them.
        let unplaced = BlockLocation { device: 0, slot: 0, index: 0 };
        for (&key, &engine_block) in self.keys[..n].iter().zip(request.block_ids) {
            match self.pool.index.claim(key) {
                Claim::New => blocks.push((unplaced, engine_block, key)),
                Claim::Cached(location) => {
                    self.pool.index.pin(location.device, location.slot);
                    pins.push((location.device, location.slot));
                    shared += 1;
                }
                Claim::Pending => shared += 1,
            }
        }
        self.requests[index].blocks = blocks;
        self.requests[index].shared_pins = pins;
        // Refuse before evicting anything: a store that cannot fit must not cost the cache.
        // New blocks fill slots k at a time (shared ones do not break a slot), so this is exact.
        let needed = self.requests[index].blocks.len().div_ceil(k);
        let available = self.pool.index.available();
        if needed as u64 > available {
            self.release(index);
            return Err(ObjstoreError::PoolFull { needed, evictable: available as usize });
        }
        // Pass 2: slots for the new blocks.
        let mut blocks = std::mem::take(&mut self.requests[index].blocks);
        let mut slots = std::mem::take(&mut self.requests[index].slots);
        let mut evicted = 0;
        let mut failure = None;
        // The slot being filled: (device, slot, blocks used); `None` until the first new block
        // and whenever it is full (k blocks).
        let mut open: Option<(u16, u32, u16)> = None;
        for i in 0..blocks.len() {
            let (device, slot, used) = match open {
                Some(slot) => slot,
                None => match self.allocate_slot() {
                    Some(allocation) => {
                        evicted += usize::from(allocation.evicted);
                        // A slot whose header is not a clean Empty entry (evicted, or left by a
                        // failed commit or a duplicate found at recovery) must read Empty on
                        // disk before its data is overwritten.
                        // Listed first, so that a failure below still returns it to the free list.
                        slots.push((allocation.device, allocation.slot, 0));
                        let stale = allocation.evicted || !self.pool.header_is_empty(allocation.device, allocation.slot);
                        if stale {
                            if let Err(error) = self.pool.stage_header(allocation.device, allocation.slot, SlotState::Empty, &[]) {
                                failure = Some(error);
                                break;
                            }
                        }
                        (allocation.device, allocation.slot, 0)
                    }
                    None => {
                        // After the check above: the free slots are on fenced devices (or the
                        // index is inconsistent).
                        failure = Some(match (0..self.pool.device_count()).find(|&device| self.pool.metadata_fenced(device)) {
                            Some(device) => {
                                ObjstoreError::MetadataFenced { device, reason: "the slots this store needs are on fenced devices".into() }
                            }
                            None => ObjstoreError::PoolFull { needed: (blocks.len() - i).div_ceil(k), evictable: 0 },
                        });
                        break;
                    }
                },
            };
            let used_now = used + 1;
            if let Some(last) = slots.last_mut() {
                last.2 = used_now; // the open slot is always the last one listed
            }
            open = (usize::from(used_now) < k).then_some((device, slot, used_now));
            blocks[i].0 = BlockLocation { device, slot, index: used };
        }
        self.requests[index].blocks = blocks;
        self.requests[index].slots = slots;
        // Evicted slots must read Empty on disk before new data can land in them.
        let result = match failure {
            Some(error) => Err(error),
            None => self.pool.sync_headers(&mut self.queue).and_then(|()| {
                if self.requests[index].blocks.is_empty() {
                    Ok(())
                } else {
                    self.build_iocbs(index, Opcode::Write)
                }
            }),
        };
        if let Err(error) = result {
            self.release(index);
            return Err(error);
        }
        Ok(StorePlan {
            handle: self.handle_of(index),
            new_blocks: self.requests[index].blocks.len(),
            shared_blocks: shared,
            evicted_slots: evicted,
        })
    }

    /// A slot on the next device round-robin that has one (wrapping by compare, not `%`: this
    /// runs once per slot of a store).
    #[inline]
    fn allocate_slot(&mut self) -> Option<crate::index::Allocation> {
        let devices = self.pool.device_count();
        let mut device = self.device_cursor;
        for _ in 0..devices {
            let next = if device + 1 == devices { 0 } else { device + 1 };
            // A fenced device takes no header writes: none of its slots is reused until reopen.
            if self.pool.metadata_fenced(device) {
                device = next;
                continue;
            }
            if let Some(allocation) = self.pool.index.allocate_on(device as u16) {
                self.device_cursor = next;
                return Some(allocation);
            }
            device = next;
        }
        None
    }

    /// Turns the request's blocks into IOCTXs (merging runs of consecutive positions and engine
    /// blocks on the SGL table path) and fills IOCBs with them.
    fn build_iocbs(&mut self, index: usize, opcode: Opcode) -> Result<()> {
        self.ioctxs.clear();
        let mergeable = self.table.form() == MappingForm::SglTable;
        let blocks = &self.requests[index].blocks;
        let mut i = 0;
        while i < blocks.len() {
            let (first, engine_block, _) = blocks[i];
            let mut run = 1;
            while mergeable && i + run < blocks.len() {
                let (next, next_block, _) = blocks[i + run];
                let follows = next.device == first.device
                    && next.slot == first.slot
                    && usize::from(next.index) == usize::from(first.index) + run
                    && next_block as usize == engine_block as usize + run;
                if !follows {
                    break;
                }
                run += 1;
            }
            // By reference: a copy of the tuple went through the stack as wide stores read back
            // narrower (a store-forwarding stall once the closure had to live in memory).
            let (nsid, addressing) = &self.addressing[usize::from(first.device)];
            let (nsid, lba_shift) = (*nsid, addressing.lba_shift);
            let start = Lba(addressing.block_lba(first.slot, u32::from(first.index)));
            let ioctxs = &mut self.ioctxs;
            self.table.for_each_piece(engine_block, run as u32, move |piece| {
                // Inside the slot, which the superblock check at open placed in the namespace.
                let start_lba = start
                    .checked_add(piece.disk_offset_bytes >> lba_shift)
                    .ok_or_else(|| ObjstoreError::AddressOverflow { what: format!("the LBA of a piece of slot {}", first.slot) })?;
                ioctxs.push(IoctxSpec {
                    device: DeviceIndex(first.device),
                    nsid,
                    start_lba,
                    block_count: (piece.len_bytes >> lba_shift) as u32,
                    data: piece.data,
                    descriptor: piece.descriptor,
                    force_unit_access: false,
                });
                Ok(())
            })?;
            i += run;
        }
        let per_iocb = self.config.ioctx_per_iocb_max as usize;
        let iocb_count = self.ioctxs.len().div_ceil(per_iocb);
        // The request's id list keeps its capacity across requests: no allocation here.
        let first_iocb = self.requests[index].iocbs.len();
        self.queue.get_iocb_into(iocb_count, Dependency::None, &mut self.requests[index].iocbs)?;
        let superblock = self.pool.superblock(0);
        let spec = IocbSpec {
            opcode,
            user_data: self.handle_of(index).0,
            layer_count: self.pool.geometry().layers,
            lba_stride_blocks: superblock.layer_stride_blocks(),
            mem_stride_bytes: self.table.mem_stride_bytes(),
            desc_stride_bytes: self.table.desc_stride_bytes(),
        };
        for (n, chunk) in self.ioctxs.chunks(per_iocb).enumerate() {
            self.queue.fill_iocb(self.requests[index].iocbs[first_iocb + n], &spec, chunk)?;
        }
        Ok(())
    }

    fn issue(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget, direction: Direction) -> Result<()> {
        let index = self.request_index(handle)?;
        self.table.registration().check_layer(layer)?;
        let request = &self.requests[index];
        if request.direction != Some(direction) {
            return Err(ObjstoreError::HandleState {
                handle: handle.0,
                reason: format!("prepared for {:?}, not {direction:?}", request.direction),
            });
        }
        if let Some(failure) = &request.verify_failure {
            return Err(failure.to_error(handle));
        }
        if let Some(previous) = request.layer_in_flight {
            return Err(ObjstoreError::HandleState {
                handle: handle.0,
                reason: format!("layer {previous} is still in flight: wait for it before issuing layer {layer}"),
            });
        }
        if request.iocbs.is_empty() {
            self.requests[index].layers_done[layer as usize] = true; // nothing to move (all shared)
            return Ok(());
        }
        self.queue.issue_io(&self.requests[index].iocbs, LayerIndex(layer), budget)?;
        self.requests[index].layer_in_flight = Some(layer);
        Ok(())
    }

    /// Issues the prepared reads of one layer (O(IOCBs)). Wait with [`KvStore::wait`].
    pub fn retrieve_layer(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget) -> Result<()> {
        self.issue(handle, layer, budget, Direction::Retrieve)
    }

    /// Issues the prepared writes of one layer (O(IOCBs)). Wait with [`KvStore::wait`].
    pub fn store_layer(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget) -> Result<()> {
        self.issue(handle, layer, budget, Direction::Store)
    }

    /// Issues one layer with the budget `policy` gives it (the scheduler integration point).
    pub fn issue_layer_with(&mut self, handle: RequestHandle, layer: u32, policy: &mut dyn LayerIssuePolicy) -> Result<()> {
        let index = self.request_index(handle)?;
        let direction = self.requests[index].direction.ok_or(ObjstoreError::UnknownHandle { handle: handle.0 })?;
        let budget = policy.budget(direction, layer, self.requests[index].iocbs.len());
        self.issue(handle, layer, budget, direction)
    }

    /// Waits (until `deadline`) for the layer in flight; returns it, or `None` if none was.
    /// After a timeout the layer is still in flight: wait again, or (CPU executor) end it with
    /// `abandon_in_flight`.
    ///
    /// On a verified retrieve whose verification failed, this and every later `wait` and `poll`
    /// return that failure until `finish`.
    pub fn wait(&mut self, handle: RequestHandle, deadline: Instant) -> Result<Option<u32>> {
        let index = self.request_index(handle)?;
        if let Some(failure) = &self.requests[index].verify_failure {
            return Err(failure.to_error(handle));
        }
        let Some(layer) = self.requests[index].layer_in_flight else { return Ok(None) };
        // Every IOCB of the layer is waited for, even after a failure: until all completed, the
        // device may still be moving bytes of this request. A timeout leaves the layer in flight
        // (wait again, or `abandon_in_flight`).
        let mut failure = None;
        for i in 0..self.requests[index].iocbs.len() {
            let id = self.requests[index].iocbs[i];
            let completion = self.queue.wait_cqe(id, deadline)?;
            if let (None, Err(error)) = (&failure, completion.result) {
                failure = Some(ObjstoreError::LayerIo { layer, iocb: id.to_string(), failure: error });
            }
        }
        self.requests[index].layer_in_flight = None;
        if let Some(error) = failure {
            return Err(error);
        }
        self.requests[index].layers_done[layer as usize] = true;
        if self.config.verify_retrieves && self.requests[index].direction == Some(Direction::Retrieve) {
            self.verify_layers(index, handle)?;
        }
        Ok(Some(layer))
    }

    /// Non-blocking: `Ok(true)` once nothing is in flight for the request (the layer that was
    /// is then complete, or its failure is returned).
    pub fn poll(&mut self, handle: RequestHandle) -> Result<bool> {
        let index = self.request_index(handle)?;
        if let Some(failure) = &self.requests[index].verify_failure {
            return Err(failure.to_error(handle));
        }
        if self.requests[index].layer_in_flight.is_none() {
            return Ok(true);
        }
        match self.wait(handle, Instant::now()) {
            Ok(_) => Ok(true),
            Err(ObjstoreError::Gio(GioError::WaitTimeout { .. })) => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// Ends a request without committing: a retrieve's pins are dropped; a store's slots go back
    /// to the free list (their headers already read Empty). Not while a layer is in flight: the
    /// device may still be moving its bytes.
    pub fn finish(&mut self, handle: RequestHandle) -> Result<()> {
        let index = self.request_index(handle)?;
        if let Some(layer) = self.requests[index].layer_in_flight {
            return Err(ObjstoreError::HandleState {
                handle: handle.0,
                reason: format!("layer {layer} in flight: wait for it first (after a timed-out wait, `abandon_in_flight`)"),
            });
        }
        self.release(index);
        Ok(())
    }

    fn release(&mut self, index: usize) {
        let request = &mut self.requests[index];
        let direction = request.direction;
        for &(device, slot, _) in &request.slots {
            match direction {
                Some(Direction::Retrieve) => self.pool.index.unpin(device, slot),
                _ => self.pool.index.release_unwritten(device, slot),
            }
        }
        for &(device, slot) in &request.shared_pins {
            self.pool.index.unpin(device, slot);
        }
        if direction == Some(Direction::Store) {
            for (_, _, key) in &request.blocks {
                self.pool.index.remove_pending(*key);
            }
        }
        for &id in &request.iocbs {
            // Only fails for an IOCB in flight, which `finish` refuses before getting here.
            if let Err(error) = self.queue.put_iocb(id) {
                tracing::warn!(%error, "returning an IOCB");
            }
        }
        let request = &mut self.requests[index];
        request.iocbs.clear();
        request.slots.clear();
        request.shared_pins.clear();
        request.blocks.clear();
        request.active = false;
        request.layer_in_flight = None;
        self.free_requests.push(index);
    }
}
