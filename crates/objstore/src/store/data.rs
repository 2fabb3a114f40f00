//! The data half of the store: the engine's registration, the mapping table, the gio_uring
//! queue and the pool's shape — no pool, no index. It turns placements (from
//! [`super::StoreControl`], in this process or, with tuttid, another) into IOCTXs and IOCBs
//! once per request, issues them layer by layer (O(IOCBs), no allocation), waits, verifies
//! retrieves and computes the payload CRCs a commit records.
//!
//! **Layers in flight.** An IOCB carries one layer at a time, so a request that may keep up to
//! `n` layers in flight ([`StoreData::set_layers_in_flight_max`], default 1) gets `n` *lanes*:
//! `n` sets of IOCBs holding the same IOCTXs, filled once at prepare. Layer issues take the
//! lanes round-robin; `wait` completes layers in issue order (the oldest first), so the next
//! layer's commands sit queued at the device while the current one drains, and the disk's
//! queue does not fall to zero at every layer boundary. Each layer still completes (and is
//! reported by `wait`) on its own: the boundary the runtime hands kernels over at is kept.
//!
//! Placements are untrusted: each must name a block position of a slot of the shape
//! ([`ObjstoreError::BadPlacement`]) and an engine block of the registration
//! ([`ObjstoreError::BlockOutOfRange`]); the shape itself is checked once, at construction, to
//! keep every slot inside its namespace. A request here is keyed by its control handle (the
//! same value names it in both halves).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use gio_uring::abi::Opcode;
use gio_uring::{
    Dependency, DeviceIndex, DeviceInfo, DeviceTable, Executor, GioError, GioQueue, IocbId, IocbSpec, IoctxSpec, IovaRange, LayerIndex,
    Lba, QueueConfig, RegisteredMemory, SmBudget,
};
use nvme_driver::{DataPointerMode, DmaAllocator, Iova};

use super::shape::{Placement, PoolShape, Transferred};
use super::verify::{self, VerifyFailure};
use super::{Direction, LayerIssuePolicy, RequestHandle, StoreConfig};
use crate::error::{ObjstoreError, Result};
use crate::format::SlotAddressing;
use crate::mapping::{CommandLimits, MappingForm, MappingTable};
use crate::pool::QueueLender;
use crate::registration::KvRegistration;

/// The data state of one prepared request.
#[derive(Debug, Default)]
pub(super) struct Transfer {
    generation: u32,
    active: bool,
    pub(super) direction: Option<Direction>,
    /// The blocks the request moves, as the control half placed them.
    pub(super) placements: Vec<Placement>,
    /// `lanes` sets of `iocbs_per_lane` IOCBs, lane after lane: each set moves the whole
    /// request at one layer (module docs, "Layers in flight").
    pub(super) iocbs: Vec<IocbId>,
    pub(super) iocbs_per_lane: usize,
    lanes: usize,
    /// The lane the next issue takes (lanes are taken round-robin and completed in order, so
    /// it is always free when fewer than `lanes` layers are in flight).
    next_lane: usize,
    /// What one layer of the request moves (its IOCTXs: one NVMe command each, at every
    /// layer), counted once when the IOCBs are built.
    layer: Transferred,
    /// What the layers completed so far moved (each layer once: a layer issued again adds
    /// nothing, so the total stays within `PoolShape::transfer_bound`).
    transferred: Transferred,
    /// The layers in flight and their lanes, oldest first (capacity reserved at construction:
    /// at most `lanes` entries, no allocation per issue).
    pub(super) in_flight: VecDeque<(u32, usize)>,
    /// Whether each layer's latest issue completed: what a commit requires of every layer and
    /// a verified retrieve folds. Cleared when the layer is issued (again): a layer in flight
    /// is not done, and one whose latest issue failed stays not done (its bytes on disk, or in
    /// the engine's memory, may be torn) until an issue of it completes.
    pub(super) layers_done: Vec<bool>,
    /// Whether each layer was counted in `transferred` (once per layer, however often issued).
    layers_counted: Vec<bool>,
    /// Verified retrieves: one running CRC per block, and how many layers (from 0, in order)
    /// are folded into them.
    pub(super) crcs: Vec<crc32fast::Hasher>,
    pub(super) crc_layers: u32,
    /// Verified retrieves: each block's payload CRC as recorded when the request was prepared
    /// (its slot is pinned from then on, so it cannot change; a later eviction of the slot by
    /// another request's mismatch rewrites the control half's mirror entry, not these).
    pub(super) expected_crcs: Vec<u32>,
    /// Verified retrieves: the verification failed. Sticky until `finish`: `wait` and `poll`
    /// return it again, and no layer is issued, so a poll-driven engine never sees the request
    /// complete.
    pub(super) verify_failure: Option<VerifyFailure>,
}

/// The per-request data path over one registration and one gio_uring queue (module docs).
///
/// Dropping it (or [`StoreData::close`]) deletes the executor's queue pairs; if the executor
/// reports that one could not be deleted, its commands may still read the mapping table and
/// read or write the engine's KV memory: the table is then leaked ([`crate::leak`]), and
/// `close` returns `false` so that the engine keeps its KV memory too.
pub struct StoreData<E: Executor> {
    pub(super) queue: GioQueue<E>,
    pub(super) table: MappingTable,
    pub(super) dma: Arc<dyn DmaAllocator>,
    pub(super) config: StoreConfig,
    pub(super) shape: PoolShape,
    pub(super) requests: Vec<Transfer>,
    /// Layers a request may keep in flight at once (its IOCB lanes), 1..=LAYERS_IN_FLIGHT_LIMIT.
    layers_in_flight_max: usize,
    ioctxs: Vec<IoctxSpec>,
    pub(super) crc_scratch: Vec<u8>,
    /// One bit per engine block, all clear between calls: a retrieve's duplicate engine
    /// blocks found in O(placements) (sized once, at construction).
    engine_blocks_seen: Vec<u64>,
    /// Per pool device: its namespace id and slot addressing (the per-block LBA arithmetic).
    addressing: Vec<(u32, SlotAddressing)>,
    /// Set once the executor's queue pairs were retired (at close or drop): its answer, kept
    /// for a second call (`Some(true)` all known deleted, `Some(false)` one not, `None` the
    /// executor does not say).
    pub(super) retired: Option<Option<bool>>,
    /// Per pool device: whether `KvStore::new` saw the executor lend its queue pair there for
    /// the pool's metadata (what [`QueueLender::lends`] answers; empty: none seen).
    pub(super) lends_metadata: Vec<bool>,
}

/// The most layers one request may keep in flight: each one is a full set of the request's
/// IOCBs (their IOCTX records filled once per lane at prepare), and two already keep the device
/// busy across a layer boundary.
pub const LAYERS_IN_FLIGHT_LIMIT: u32 = 4;

/// The in-flight layers of `transfer` as text, oldest first (for error messages).
fn layers_text(in_flight: &VecDeque<(u32, usize)>) -> String {
    let layers: Vec<String> = in_flight.iter().map(|(layer, _)| layer.to_string()).collect();
    layers.join(", ")
}

/// The KV tensors as gio_uring ranges, touching ones merged: tensors allocated back to back are
/// one buffer to the per-layer rule (a PRP layout at one layer stride spans several). Only KV
/// extents are merged, so no request can run from the KV memory into the mapping table.
fn kv_ranges(registration: &crate::registration::KvRegistration) -> Result<Vec<IovaRange>> {
    Ok(registration.merged_ranges()?.into_iter().map(|(start, end)| IovaRange::new(Iova(start), end - start)).collect())
}

/// The executor's queue pairs, lent for the pool's metadata. It says it lends on the devices
/// `KvStore::new` saw it lend on, so a metadata call that could not use a lent pair does not
/// wait for one (the CPU executor keeps its pairs until the store retires them; an executor
/// that stopped lending would cost a `DeadlinePassed` where a temporary pair would have been
/// tried, on a controller that granted too few pairs for one anyway).
impl<E: Executor> QueueLender for StoreData<E> {
    fn lend(&mut self, device: usize, deadline: Instant) -> Result<Option<&mut nvme_driver::IoQueuePair>> {
        self.queue.lend(device, deadline)
    }

    fn lends(&self, device: usize) -> Option<bool> {
        self.lends_metadata.get(device).copied().unwrap_or(false).then_some(true)
    }
}

impl<E: Executor> StoreData<E> {
    /// Binds the engine's registration to a pool of shape `shape`: checks the shape and the
    /// geometry, builds the mapping table in `dma` (the device address space every pool device
    /// reaches the KV memory in), and the gio_uring queue with `executor`, whose queue pair i
    /// must serve pool device i. Every device must reach `dma`'s address space: the caller
    /// knows the controllers (`KvStore::new` checks it), this half does not.
    pub fn new(
        shape: PoolShape,
        registration: KvRegistration,
        dma: Arc<dyn DmaAllocator>,
        executor: E,
        config: StoreConfig,
    ) -> Result<Self> {
        shape.check()?;
        if registration.geometry() != &shape.geometry {
            return Err(ObjstoreError::GeometryMismatch { on_disk: shape.geometry, registered: *registration.geometry() });
        }
        if config.requests_max == 0 || config.requests_max > u32::MAX as usize || config.ioctx_per_iocb_max == 0 {
            return Err(ObjstoreError::BadRequest {
                reason: format!("store config {config:?}: requests_max and ioctx_per_iocb_max must be positive"),
            });
        }
        verify::check_verifiable(&shape, &registration, &dma, config.verify_retrieves)?;
        // Every command must fit every pool device: the table cuts transfers to the smallest MDTS.
        let max_transfer_bytes = shape.devices.iter().map(|device| device.max_transfer_bytes).min().unwrap_or(0);
        let limits = CommandLimits { max_transfer_bytes, lba_bytes: shape.devices[0].lba_bytes };
        let engine_blocks_seen = vec![0; (registration.num_blocks() as usize).div_ceil(64)];
        let table = MappingTable::build(registration, &dma, shape.blocks_per_slot, limits)?;
        let mut devices = Vec::with_capacity(shape.devices.len());
        for (index, device) in shape.devices.iter().enumerate() {
            if table.registration().mode() == DataPointerMode::Sgl && !device.sgl_supported {
                return Err(ObjstoreError::InvalidRegistration {
                    reason: format!(
                        "registered for SGL, but pool device {index} (nsid {}) has no SGL support: register for PRP",
                        device.nsid
                    ),
                });
            }
            devices.push((
                DeviceInfo {
                    nsid: device.nsid,
                    capacity_blocks: device.capacity_blocks,
                    block_bytes: device.lba_bytes,
                    sgl_supported: device.sgl_supported,
                },
                device.max_transfer_bytes,
            ));
        }
        // On the SGL-table path IOCTXs point only into the table (the KV addresses are in the
        // descriptors, checked at registration): registering just the table keeps gio_uring's
        // per-IOCTX range lookup to one range.
        let mut ranges: Vec<IovaRange> = if table.form() == MappingForm::SglTable { Vec::new() } else { kv_ranges(table.registration())? };
        ranges.extend(table.region_range());
        let registered = RegisteredMemory::new(ranges)
            .ok_or_else(|| ObjstoreError::InvalidRegistration { reason: "the mapping table overlaps the registered KV memory".into() })?;
        let queue = GioQueue::init_queue(
            QueueConfig { depth: config.iocbs, ioctx_per_iocb_max: config.ioctx_per_iocb_max },
            DeviceTable::with_max_transfer_bytes(devices),
            registered,
            executor,
        )?;
        let addressing = shape.devices.iter().map(|device| (device.nsid, device.addressing)).collect();
        let layers = shape.geometry.layers as usize;
        let requests = (0..config.requests_max)
            .map(|_| Transfer {
                layers_done: vec![false; layers],
                layers_counted: vec![false; layers],
                in_flight: VecDeque::with_capacity(1),
                ..Transfer::default()
            })
            .collect();
        Ok(Self {
            queue,
            table,
            dma,
            config,
            shape,
            requests,
            layers_in_flight_max: 1,
            ioctxs: Vec::with_capacity(config.ioctx_per_iocb_max as usize),
            crc_scratch: Vec::new(),
            engine_blocks_seen,
            addressing,
            retired: None,
            lends_metadata: Vec::new(),
        })
    }

    pub fn table(&self) -> &MappingTable {
        &self.table
    }

    pub fn shape(&self) -> &PoolShape {
        &self.shape
    }

    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// How many layers of one request may be in flight at once (1 unless set).
    pub fn layers_in_flight_max(&self) -> u32 {
        self.layers_in_flight_max as u32
    }

    /// Lets each request keep up to `layers` layers in flight (1..=[`LAYERS_IN_FLIGHT_LIMIT`]):
    /// with 2, an engine issues layer l + 1 before it waits for layer l, so the next layer's
    /// commands are queued at the device while the current one drains. Costs `layers` sets of
    /// IOCBs per request (filled at prepare: the queue must hold `StoreConfig::iocbs` for them).
    /// Only while no request is prepared (every request's lanes are decided at its prepare;
    /// changing them under a prepared one would mix two layouts).
    pub fn set_layers_in_flight_max(&mut self, layers: u32) -> Result<()> {
        if layers == 0 || layers > LAYERS_IN_FLIGHT_LIMIT {
            return Err(ObjstoreError::BadRequest {
                reason: format!("layers in flight per request: {layers}, accepted 1..={LAYERS_IN_FLIGHT_LIMIT}"),
            });
        }
        if let Some(index) = self.requests.iter().position(|request| request.active) {
            return Err(ObjstoreError::BadRequest {
                reason: format!(
                    "layers in flight per request cannot change while request slot {index} is prepared: finish every request first"
                ),
            });
        }
        self.layers_in_flight_max = layers as usize;
        for request in &mut self.requests {
            // Off the per-layer path: reserved here so that issuing never allocates.
            request.in_flight = VecDeque::with_capacity(layers as usize);
        }
        Ok(())
    }

    pub fn queue(&self) -> &GioQueue<E> {
        &self.queue
    }

    pub fn queue_mut(&mut self) -> &mut GioQueue<E> {
        &mut self.queue
    }

    /// The executor, as the lender of queue pairs for the pool's metadata (see `QueueLender`).
    pub fn lender(&mut self) -> &mut dyn QueueLender {
        self
    }

    pub(super) fn index_of(&self, handle: RequestHandle) -> Result<usize> {
        let index = handle.index();
        match self.requests.get(index) {
            Some(request) if request.active && request.generation == handle.generation() => Ok(index),
            _ => Err(ObjstoreError::UnknownHandle { handle: handle.0 }),
        }
    }

    /// Prepares moving `placements` for the request the control half named `handle`: checks
    /// every placement against the shape and the registration, then builds its IOCTXs (merging
    /// runs of consecutive positions and engine blocks on the SGL table path) into IOCBs. A
    /// verified retrieve (`StoreConfig::verify_retrieves`) needs the CRCs recorded for its
    /// blocks (`expected_crcs`, one per placement). On failure nothing stays prepared.
    pub fn prepare(
        &mut self,
        handle: RequestHandle,
        direction: Direction,
        placements: &[Placement],
        expected_crcs: Option<&[u32]>,
    ) -> Result<()> {
        let index = handle.index();
        let Some(request) = self.requests.get(index) else { return Err(ObjstoreError::UnknownHandle { handle: handle.0 }) };
        if request.active {
            return Err(ObjstoreError::HandleState { handle: handle.0, reason: "already prepared: finish it first".into() });
        }
        let registration = self.table.registration();
        for (position, placement) in placements.iter().enumerate() {
            self.shape.check_placement(position, placement)?;
            registration.check_block(placement.engine_block)?;
        }
        // Both ways: a retrieve into one engine block twice overwrites one read with the other;
        // a store from one block twice commits one block's KV under another's key. `KvStore`
        // refuses them before reserving (a store's reservation may evict); this is for callers
        // of the halves.
        self.refuse_duplicate_engine_blocks(direction, placements.iter().map(|placement| placement.engine_block))?;
        let verified = self.config.verify_retrieves && direction == Direction::Retrieve;
        if verified && expected_crcs.is_none_or(|crcs| crcs.len() != placements.len()) {
            return Err(ObjstoreError::BadRequest {
                reason: format!(
                    "a verified retrieve of {} blocks needs as many recorded CRCs, got {:?}",
                    placements.len(),
                    expected_crcs.map(<[u32]>::len)
                ),
            });
        }
        let request = &mut self.requests[index];
        request.generation = handle.generation();
        request.active = true;
        request.direction = Some(direction);
        request.placements.clear();
        request.placements.extend_from_slice(placements);
        request.iocbs.clear();
        request.iocbs_per_lane = 0;
        request.lanes = self.layers_in_flight_max;
        request.next_lane = 0;
        request.layer = Transferred::default();
        request.transferred = Transferred::default();
        request.in_flight.clear();
        request.layers_done.fill(false);
        request.layers_counted.fill(false);
        request.crcs.clear();
        request.crc_layers = 0;
        request.expected_crcs.clear();
        request.verify_failure = None;
        if let (true, Some(crcs)) = (verified, expected_crcs) {
            request.crcs.resize(placements.len(), crc32fast::Hasher::new());
            request.expected_crcs.extend_from_slice(crcs);
        }
        if placements.is_empty() {
            return Ok(()); // nothing to move (a store whose blocks are all shared)
        }
        let opcode = if direction == Direction::Retrieve { Opcode::Read } else { Opcode::Write };
        if let Err(error) = self.build_iocbs(index, handle, opcode) {
            self.release_index(index);
            return Err(error);
        }
        Ok(())
    }

    /// Turns the request's placements into IOCTXs and fills IOCBs with them.
    fn build_iocbs(&mut self, index: usize, handle: RequestHandle, opcode: Opcode) -> Result<()> {
        self.ioctxs.clear();
        let mergeable = self.table.form() == MappingForm::SglTable;
        let blocks = &self.requests[index].placements;
        let mut i = 0;
        while i < blocks.len() {
            let Placement { location: first, engine_block } = blocks[i];
            let mut run = 1;
            while mergeable && i + run < blocks.len() {
                let Placement { location: next, engine_block: next_block } = blocks[i + run];
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
                // Inside the slot, which the shape check placed in the namespace.
                let start_lba = start
                    .checked_add(piece.disk_offset_bytes >> lba_shift)
                    .ok_or_else(|| ObjstoreError::AddressOverflow { what: format!("the LBA of a piece of slot {}", first.slot) })?;
                ioctxs.push(IoctxSpec {
                    device: DeviceIndex(first.device),
                    nsid,
                    start_lba,
                    // At most MDTS (the shape check bounds it) in LBAs: fits; checked all the same.
                    block_count: u32::try_from(piece.len_bytes >> lba_shift).map_err(|_| ObjstoreError::AddressOverflow {
                        what: format!("the LBA count of a {}-byte command to slot {}", piece.len_bytes, first.slot),
                    })?,
                    data: piece.data,
                    descriptor: piece.descriptor,
                    force_unit_access: false,
                });
                Ok(())
            })?;
            i += run;
        }
        let mut layer = Transferred { bytes: 0, commands: self.ioctxs.len() as u64 };
        for ioctx in &self.ioctxs {
            let lba_shift = self.addressing[usize::from(ioctx.device.0)].1.lba_shift;
            layer.bytes += u64::from(ioctx.block_count) << lba_shift;
        }
        self.requests[index].layer = layer;
        let per_iocb = self.config.ioctx_per_iocb_max as usize;
        let iocb_count = self.ioctxs.len().div_ceil(per_iocb);
        let lanes = self.requests[index].lanes;
        // The request's id list keeps its capacity across requests: no allocation here.
        let first_iocb = self.requests[index].iocbs.len();
        self.queue.get_iocb_into(iocb_count * lanes, Dependency::None, &mut self.requests[index].iocbs)?;
        self.requests[index].iocbs_per_lane = iocb_count;
        let spec = IocbSpec {
            opcode,
            user_data: handle.0,
            layer_count: self.shape.geometry.layers,
            lba_stride_blocks: self.shape.layer_stride_blocks,
            mem_stride_bytes: self.table.mem_stride_bytes(),
            desc_stride_bytes: self.table.desc_stride_bytes(),
        };
        for lane in 0..lanes {
            for (n, chunk) in self.ioctxs.chunks(per_iocb).enumerate() {
                self.queue.fill_iocb(self.requests[index].iocbs[first_iocb + lane * iocb_count + n], &spec, chunk)?;
            }
        }
        Ok(())
    }

    /// Refuses a store whose new blocks need more IOCBs than the queue has free, with the
    /// [`GioError::NoFreeIocb`] `build_iocbs` would return: asked before the reservation, which
    /// may evict cached blocks (and sync their headers Empty) that releasing it does not bring
    /// back. `new_blocks` are the engine blocks of the store's new blocks in order (see
    /// [`StoreData::store_iocbs`]).
    pub(super) fn refuse_short_of_iocbs(&self, new_blocks: impl Iterator<Item = u32>, blocks_per_slot: usize) -> Result<()> {
        let needed = self.store_iocbs(new_blocks, blocks_per_slot);
        let available = self.queue.free_iocbs();
        if needed > available {
            return Err(GioError::NoFreeIocb { requested: needed, available }.into());
        }
        Ok(())
    }

    /// The IOCBs `build_iocbs` takes for a store whose new blocks come from `new_blocks` (in
    /// order; 0 when there are none). The control half places them `blocks_per_slot` to a
    /// slot, the i-th at index i % blocks_per_slot of a fresh slot, so the runs `build_iocbs`
    /// merges, and so its count, are known before they are placed.
    pub(super) fn store_iocbs(&self, new_blocks: impl Iterator<Item = u32>, blocks_per_slot: usize) -> usize {
        let mergeable = self.table.form() == MappingForm::SglTable;
        let mut commands = 0u64;
        // The run being merged: (its first engine block, its length).
        let mut run: Option<(u32, u32)> = None;
        for (i, block) in new_blocks.enumerate() {
            match run {
                Some((first, len)) if mergeable && i % blocks_per_slot != 0 && block as usize == first as usize + len as usize => {
                    run = Some((first, len + 1));
                }
                _ => {
                    if let Some((_, len)) = run {
                        commands += self.table.commands_per_run(len);
                    }
                    run = Some((block, 1));
                }
            }
        }
        if let Some((_, len)) = run {
            commands += self.table.commands_per_run(len);
        }
        usize::try_from(commands.div_ceil(u64::from(self.config.ioctx_per_iocb_max)))
            .unwrap_or(usize::MAX)
            .saturating_mul(self.layers_in_flight_max)
    }

    /// The most IOCBs a store of `blocks` blocks can take, whichever of them are new: each
    /// block a run of its own (a merged run takes no more commands than its blocks apart).
    /// A caller that cannot see the index (tuttid's client, before it sends its
    /// `PrepareStore`) refuses a store above the queue's free IOCBs with this, before the
    /// reservation can evict; `KvStore` counts exactly when this is above them.
    pub fn store_iocbs_at_most(&self, blocks: usize) -> usize {
        let commands = self.table.commands_per_run(1).saturating_mul(blocks as u64);
        usize::try_from(commands.div_ceil(u64::from(self.config.ioctx_per_iocb_max)))
            .unwrap_or(usize::MAX)
            .saturating_mul(self.layers_in_flight_max)
    }

    /// Whether a store of `blocks` blocks might need more IOCBs than are free
    /// ([`StoreData::store_iocbs_at_most`]): when not, `KvStore` spares the exact count's index
    /// probes.
    pub(super) fn may_be_short_of_iocbs(&self, blocks: usize) -> bool {
        self.store_iocbs_at_most(blocks) > self.queue.free_iocbs()
    }

    /// Refuses a retrieve that reads two blocks into one engine block (one would overwrite the
    /// other, and a verified retrieve would condemn a good slot for it) and a store that writes
    /// two blocks from one (one block's KV would be committed under the other's key). `blocks`
    /// (the engine block of each position, in order) were checked in the registration's range.
    pub(super) fn refuse_duplicate_engine_blocks(&mut self, direction: Direction, blocks: impl Iterator<Item = u32> + Clone) -> Result<()> {
        let mut duplicate = None;
        for (position, engine_block) in blocks.clone().enumerate() {
            let block = engine_block as usize;
            let (word, bit) = (block / 64, 1u64 << (block % 64));
            if self.engine_blocks_seen[word] & bit != 0 {
                duplicate = Some((position, engine_block));
                break;
            }
            self.engine_blocks_seen[word] |= bit;
        }
        for engine_block in blocks {
            self.engine_blocks_seen[engine_block as usize / 64] = 0;
        }
        match duplicate {
            Some((position, block)) => Err(ObjstoreError::BadRequest {
                reason: match direction {
                    Direction::Retrieve => {
                        format!("engine block {block} is read into twice (again at position {position}): a retrieve fills each once")
                    }
                    Direction::Store => format!(
                        "engine block {block} is stored from twice (again at position {position}): one block's KV cannot be two \
                         blocks'"
                    ),
                },
            }),
            None => Ok(()),
        }
    }

    /// The IOCBs of lane `lane` of request `index`.
    fn lane(&self, index: usize, lane: usize) -> &[IocbId] {
        let request = &self.requests[index];
        &request.iocbs[lane * request.iocbs_per_lane..(lane + 1) * request.iocbs_per_lane]
    }

    fn issue(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget, direction: Direction) -> Result<()> {
        let index = self.index_of(handle)?;
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
        if request.in_flight.iter().any(|&(in_flight, _)| in_flight == layer) {
            return Err(ObjstoreError::HandleState {
                handle: handle.0,
                reason: format!("layer {layer} is already in flight: wait for it before issuing it again"),
            });
        }
        if request.in_flight.len() >= request.lanes.max(1) {
            return Err(ObjstoreError::HandleState {
                handle: handle.0,
                reason: format!(
                    "layer {} still in flight (at most {} per request): wait for the oldest before issuing layer {layer}",
                    layers_text(&request.in_flight),
                    request.lanes.max(1)
                ),
            });
        }
        if request.iocbs.is_empty() {
            self.requests[index].layers_done[layer as usize] = true; // nothing to move (all shared)
            return Ok(());
        }
        let lane = request.next_lane;
        let request = &self.requests[index];
        let ids = &request.iocbs[lane * request.iocbs_per_lane..(lane + 1) * request.iocbs_per_lane];
        let issued = self.queue.issue_io(ids, LayerIndex(layer), budget);
        // An executor failure after the ids were published (`SubmitFailed`) leaves the IOCBs in
        // flight, each still to complete once: the layer is tracked like any issued one, so
        // `wait` reaps its IOCBs and `finish` refuses until it has. Any other error issued
        // nothing.
        if matches!(issued, Ok(()) | Err(GioError::SubmitFailed { .. })) {
            let request = &mut self.requests[index];
            // Not done until this issue completes: should it fail, an earlier completion of
            // the layer no longer describes the bytes (a store's commit refuses, a verified
            // retrieve does not fold them).
            request.layers_done[layer as usize] = false;
            // A verified retrieve that already folded this layer unfolds: the re-read replaces
            // the bytes the CRCs were computed over, so they are refolded from layer 0 (and
            // compared again) once every layer is done, this issue's included. Kept folded, a
            // comparison would pass against the earlier read whatever this one leaves behind.
            if layer < request.crc_layers {
                request.crcs.fill(crc32fast::Hasher::new());
                request.crc_layers = 0;
            }
            request.in_flight.push_back((layer, lane));
            request.next_lane = (lane + 1) % request.lanes;
        }
        issued.map_err(ObjstoreError::from)
    }

    /// Issues the prepared reads of one layer (O(IOCBs)). Wait with [`StoreData::wait`].
    pub fn retrieve_layer(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget) -> Result<()> {
        self.issue(handle, layer, budget, Direction::Retrieve)
    }

    /// Issues the prepared writes of one layer (O(IOCBs)). Wait with [`StoreData::wait`].
    pub fn store_layer(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget) -> Result<()> {
        self.issue(handle, layer, budget, Direction::Store)
    }

    /// Issues one layer with the budget `policy` gives it (the scheduler integration point).
    pub fn issue_layer_with(&mut self, handle: RequestHandle, layer: u32, policy: &mut dyn LayerIssuePolicy) -> Result<()> {
        let index = self.index_of(handle)?;
        let direction = self.requests[index].direction.ok_or(ObjstoreError::UnknownHandle { handle: handle.0 })?;
        let budget = policy.budget(direction, layer, self.requests[index].iocbs.len());
        self.issue(handle, layer, budget, direction)
    }

    /// The blocks the prepared request `handle` moves, as the control half placed them (a
    /// store's new blocks only).
    pub fn placements(&self, handle: RequestHandle) -> Result<&[Placement]> {
        let index = self.index_of(handle)?;
        Ok(&self.requests[index].placements)
    }

    /// The direction the request was prepared for.
    pub fn direction(&self, handle: RequestHandle) -> Result<Direction> {
        let index = self.index_of(handle)?;
        self.requests[index].direction.ok_or(ObjstoreError::UnknownHandle { handle: handle.0 })
    }

    /// What the request moved so far: the bytes and NVMe commands of its completed layers,
    /// each layer once (a failed layer adds nothing: its bytes are not to be used). O(1).
    pub fn transferred(&self, handle: RequestHandle) -> Result<Transferred> {
        Ok(self.requests[self.index_of(handle)?].transferred)
    }

    /// Whether `handle` names a verified retrieve whose verification already failed.
    pub fn verify_failed(&self, handle: RequestHandle) -> bool {
        self.index_of(handle).is_ok_and(|index| self.requests[index].verify_failure.is_some())
    }

    /// Waits (until `deadline`) for the oldest layer in flight; returns it, or `None` if none
    /// was. With several layers in flight, each `wait` completes one, in issue order; a failed
    /// layer leaves the later ones in flight (wait for them too before `finish`).
    /// After a timeout the layer is still in flight: wait again, or (CPU executor) end it with
    /// `abandon_in_flight`. On a verified retrieve, the `wait` that completes the last layer
    /// compares the blocks' CRCs; a mismatch (`PayloadMismatch`, naming the blocks, whose
    /// slots the control half must evict) is returned by this and every later `wait` and
    /// `poll` until `finish`. Such a `wait` still collects the oldest layer in flight first, if
    /// any (a layer issued again after the last one), so that the request can be finished.
    pub fn wait(&mut self, handle: RequestHandle, deadline: Instant) -> Result<Option<u32>> {
        let index = self.index_of(handle)?;
        let Some(&(layer, lane)) = self.requests[index].in_flight.front() else {
            return match &self.requests[index].verify_failure {
                Some(failure) => Err(failure.to_error(handle)),
                None => Ok(None),
            };
        };
        // Every IOCB of the layer is waited for, even after a failure: until all completed, the
        // device may still be moving bytes of this request. A timeout leaves the layer in flight
        // (wait again, or `abandon_in_flight`).
        let mut failure = None;
        for i in 0..self.requests[index].iocbs_per_lane {
            let id = self.lane(index, lane)[i];
            let completion = self.queue.wait_cqe(id, deadline)?;
            if let (None, Err(error)) = (&failure, completion.result) {
                failure = Some(ObjstoreError::LayerIo { layer, iocb: id.to_string(), failure: error });
            }
        }
        self.requests[index].in_flight.pop_front();
        // A verification already failed: the layer is collected, not folded.
        if let Some(stuck) = &self.requests[index].verify_failure {
            return Err(stuck.to_error(handle));
        }
        if let Some(error) = failure {
            return Err(error);
        }
        let request = &mut self.requests[index];
        request.layers_done[layer as usize] = true;
        if !request.layers_counted[layer as usize] {
            request.layers_counted[layer as usize] = true;
            request.transferred.bytes += request.layer.bytes;
            request.transferred.commands += request.layer.commands;
        }
        if self.config.verify_retrieves && self.requests[index].direction == Some(Direction::Retrieve) {
            self.verify_layers(index, handle)?;
        }
        Ok(Some(layer))
    }

    /// Non-blocking: `Ok(true)` once nothing is in flight for the request (the layers that
    /// were are then complete, or the first failure is returned). Completes the layers in
    /// flight that are done, oldest first, as `wait` would.
    pub fn poll(&mut self, handle: RequestHandle) -> Result<bool> {
        let index = self.index_of(handle)?;
        // Bounded: each round retires one layer in flight, of which there are at most `lanes`.
        while !self.requests[index].in_flight.is_empty() {
            match self.wait(handle, Instant::now()) {
                Ok(_) => {}
                Err(ObjstoreError::Gio(GioError::WaitTimeout { .. })) => return Ok(false),
                Err(error) => return Err(error),
            }
        }
        if let Some(failure) = &self.requests[index].verify_failure {
            return Err(failure.to_error(handle));
        }
        Ok(true)
    }

    /// The layers of `handle` in flight, oldest first (issued, not yet returned by `wait`).
    pub fn layers_in_flight(&self, handle: RequestHandle) -> Result<impl Iterator<Item = u32> + '_> {
        let index = self.index_of(handle)?;
        Ok(self.requests[index].in_flight.iter().map(|&(layer, _)| layer))
    }

    /// Ends a request's data path: its IOCBs go back to the queue. Not while a layer is in
    /// flight: the device may still be moving its bytes.
    pub fn finish(&mut self, handle: RequestHandle) -> Result<()> {
        let index = self.index_of(handle)?;
        if !self.requests[index].in_flight.is_empty() {
            return Err(ObjstoreError::HandleState {
                handle: handle.0,
                reason: format!(
                    "layer {} in flight: wait for it first (after a timed-out wait, `abandon_in_flight`)",
                    layers_text(&self.requests[index].in_flight)
                ),
            });
        }
        self.release_index(index);
        Ok(())
    }

    fn release_index(&mut self, index: usize) {
        for &id in &self.requests[index].iocbs {
            // Only fails for an IOCB in flight, which `finish` refuses before getting here.
            if let Err(error) = self.queue.put_iocb(id) {
                tracing::warn!(%error, "returning an IOCB");
            }
        }
        let request = &mut self.requests[index];
        request.iocbs.clear();
        request.iocbs_per_lane = 0;
        request.placements.clear();
        request.active = false;
        request.in_flight.clear();
    }
}
