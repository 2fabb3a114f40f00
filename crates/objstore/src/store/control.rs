//! The control half of the store: the pool, its index, slot allocation, pins, eviction and
//! the durable commit. No executor, no mapping table: it hands out placements (which slot
//! position holds which engine block) and takes back, at commit, the payload CRCs computed by
//! whoever holds the KV memory. tuttid runs this half; [`super::KvStore`] runs it next to its
//! data half in one process.
//!
//! Header writes and flushes go through the pool's own metadata queue pairs, or, on a
//! controller that granted fewer than two queue pairs per pool device, through `lender` (the
//! in-process store's executor). A caller without an executor passes [`NoLender`]: the pool
//! then makes a temporary queue pair per metadata call on such a device, so a daemon needs one
//! free queue pair per pool device beyond those it gives its clients.

use std::time::Instant;

use crate::error::{MismatchedBlock, ObjstoreError, Result};
use crate::format::{payload_crc_offset, BlockRecord, SlotState};
use crate::index::{BlockLocation, Claim, IndexCounts};
use crate::pool::{Pool, QueueLender};

use super::shape::Placement;
use super::{Direction, RequestHandle, StorePlan};

#[cfg(doc)]
use crate::pool::NoLender;

/// Blocks a released reservation keeps room for (each of its vectors; about 9 KiB in all): a
/// 4K-token prompt in 16-token blocks. Reservations live as long as the control half (tuttid
/// allocates up to 2^20 at start, reused request after request), so one that kept the room of
/// its largest request (up to 36 bytes a block, about 2.3 MiB after 65,532 blocks) would hold,
/// for good, gigabytes after a while of long prompts. A larger request allocates again, a few
/// vectors per prepare.
const RESERVATION_BLOCKS_KEPT: usize = 256;

/// The control state of one reserved request.
#[derive(Debug, Default)]
struct Reservation {
    generation: u32,
    active: bool,
    direction: Option<Direction>,
    /// Every block the request moves: where it lives and which engine block holds it. A
    /// store's blocks fill its slots in order, k at a time, so a slot's blocks are contiguous.
    placements: Vec<Placement>,
    /// The key of each placement.
    keys: Vec<u64>,
    /// (device, slot, blocks used) of every slot the request pinned (retrieve) or allocated
    /// (store).
    slots: Vec<(u16, u32, u16)>,
    /// A store's pins on the slots of the cached blocks it shares, one per block.
    shared_pins: Vec<(u16, u32)>,
}

/// The pool and the index side of every request (see the module docs).
pub struct StoreControl {
    pool: Pool,
    reservations: Vec<Reservation>,
    free: Vec<usize>,
    device_cursor: usize,
    /// Scratch: one slot's header records, and the devices a commit wrote.
    records: Vec<BlockRecord>,
    used_devices: Vec<bool>,
    /// Scratch: the generation each slot of a commit's headers was staged with, last slot
    /// first (the order `stage_valid_headers` stages them in).
    generations: Vec<u64>,
}

impl StoreControl {
    /// At most `requests_max` requests reserved at once.
    pub fn new(pool: Pool, requests_max: usize) -> Result<Self> {
        if requests_max == 0 || requests_max > u32::MAX as usize {
            return Err(ObjstoreError::BadRequest { reason: format!("requests_max {requests_max}: expected 1..={}", u32::MAX) });
        }
        let k = pool.blocks_per_slot() as usize;
        let devices = pool.device_count();
        Ok(Self {
            pool,
            reservations: (0..requests_max).map(|_| Reservation::default()).collect(),
            free: (0..requests_max).rev().collect(),
            device_cursor: 0,
            records: Vec::with_capacity(k),
            used_devices: vec![false; devices],
            generations: Vec::new(),
        })
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn counts(&self) -> IndexCounts {
        self.pool.index.counts()
    }

    /// Gives the pool back. Reservations still live (requests never released) are released
    /// first, as [`StoreControl::release`] would: a store's slots go back to the free list
    /// and its keys are no longer claimed, pins go. Kept, they left slots Writing and pinned
    /// for the pool's life, and keys claimed by a store that never commits (a later store
    /// would share them). As for `release`, the caller must know that no command of those
    /// requests is still in flight.
    pub fn into_pool(self) -> Pool {
        self.into_pool_keeping(&[])
    }

    /// [`Self::into_pool`], except that the reservations marked in `keep` (by request index)
    /// are left as they are: a command of theirs may still move data (see
    /// [`Self::into_pool_unreleased`]).
    pub(super) fn into_pool_keeping(mut self, keep: &[bool]) -> Pool {
        let mut live = 0;
        for index in 0..self.reservations.len() {
            if self.reservations[index].active && !keep.get(index).copied().unwrap_or(false) {
                self.release_index(index);
                live += 1;
            }
        }
        if live > 0 {
            tracing::warn!(live, "objstore: the pool was given back with requests never finished: released");
        }
        self.pool
    }

    /// Gives the pool back with every reservation left as it is: a store's slots stay Writing
    /// and a retrieve's pins stay, until the pool is reopened. Right when a command of a live
    /// request may still move data: the data half could not retire its queue pairs, or (tuttid's
    /// drain) every request its holder could release was released and those still live belong
    /// to holders kept for good, whose queue pairs may still write the slots. Wrong for requests
    /// merely abandoned: their slots and claimed keys would be held for the pool's life
    /// ([`Self::into_pool`] releases those).
    pub fn into_pool_unreleased(self) -> Pool {
        self.pool
    }

    /// Whether the pool records a payload CRC per block ([`StoreControl::commit_store`] then
    /// needs them).
    pub fn records_payload_crcs(&self) -> bool {
        self.pool.superblock(0).flags & crate::format::FLAG_PAYLOAD_CRC != 0
    }

    /// See [`crate::index::Index::track_departures`]: from now on the keys of committed blocks
    /// that leave the index (evicted, condemned) are kept for [`StoreControl::take_departures`].
    pub fn track_departures(&mut self, keys_max: usize) {
        self.pool.index.track_departures(keys_max);
    }

    /// See [`crate::index::Index::take_departures`].
    pub fn take_departures(&mut self, out: &mut Vec<u64>) -> bool {
        self.pool.index.take_departures(out)
    }

    /// The longest cached prefix of `keys`, in blocks.
    pub fn lookup(&self, keys: &[u64]) -> usize {
        self.pool.index.cached_prefix(keys)
    }

    /// Where the run of cached blocks among `keys` from `first_block` ends (see
    /// [`Index::cached_run_end`](crate::index::Index::cached_run_end)).
    pub fn lookup_from(&self, keys: &[u64], first_block: usize) -> usize {
        self.pool.index.cached_run_end(keys, first_block)
    }

    fn take(&mut self, direction: Direction) -> Result<usize> {
        let index = self.free.pop().ok_or(ObjstoreError::TooManyRequests { max: self.reservations.len() })?;
        let reservation = &mut self.reservations[index];
        reservation.generation = reservation.generation.wrapping_add(1);
        reservation.active = true;
        reservation.direction = Some(direction);
        reservation.placements.clear();
        reservation.keys.clear();
        reservation.slots.clear();
        reservation.shared_pins.clear();
        Ok(index)
    }

    fn handle_of(&self, index: usize) -> RequestHandle {
        RequestHandle::new(index, self.reservations[index].generation)
    }

    /// The reservation `handle` names (handles may come from another process: any value is
    /// answered, a stale or foreign one with `UnknownHandle`).
    fn index_of(&self, handle: RequestHandle) -> Result<usize> {
        let index = handle.index();
        match self.reservations.get(index) {
            Some(reservation) if reservation.active && reservation.generation == handle.generation() => Ok(index),
            _ => Err(ObjstoreError::UnknownHandle { handle: handle.0 }),
        }
    }

    /// What `handle` was reserved for.
    pub fn direction(&self, handle: RequestHandle) -> Result<Direction> {
        let index = self.index_of(handle)?;
        self.reservations[index].direction.ok_or(ObjstoreError::UnknownHandle { handle: handle.0 })
    }

    /// The placements of a reserved request, in prefix order (a store's: its new blocks only).
    pub fn placements(&self, handle: RequestHandle) -> Result<&[Placement]> {
        let index = self.index_of(handle)?;
        Ok(&self.reservations[index].placements)
    }

    fn check_lengths(keys: &[u64], engine_blocks: &[u32]) -> Result<()> {
        if keys.is_empty() || keys.len() != engine_blocks.len() {
            return Err(ObjstoreError::BadRequest {
                reason: format!("{} keys and {} engine blocks: expected as many, at least one", keys.len(), engine_blocks.len()),
            });
        }
        // 0 is no block's key (`KeyChain::block_key` never returns it; the index marks unused
        // entries with it, so a block stored under 0 would stay in the map after its slot is reused).
        if let Some(position) = keys.iter().position(|&key| key == 0) {
            return Err(ObjstoreError::BadRequest { reason: format!("key {position} is 0, which is no block's key") });
        }
        Ok(())
    }

    /// Reserves reading blocks `keys` (all cached: `lookup` first) into `engine_blocks`: pins
    /// their slots until [`StoreControl::release`]. The placements are then
    /// [`StoreControl::placements`]. `keys[0]` is block `first_block` of its prefix (errors
    /// number blocks in the prefix).
    pub fn reserve_retrieve(&mut self, keys: &[u64], engine_blocks: &[u32], first_block: usize) -> Result<RequestHandle> {
        Self::check_lengths(keys, engine_blocks)?;
        let index = self.take(Direction::Retrieve)?;
        let mut reservation = std::mem::take(&mut self.reservations[index]);
        let mut missing = None;
        for (i, (&key, &engine_block)) in keys.iter().zip(engine_blocks).enumerate() {
            let Some(location) = self.pool.index.get(key) else {
                missing = Some(i);
                break;
            };
            self.pool.index.pin(location.device, location.slot);
            reservation.slots.push((location.device, location.slot, 0));
            reservation.placements.push(Placement { location, engine_block });
            reservation.keys.push(key);
        }
        if missing.is_none() {
            // Most recently used last to first, so that the prefix's first block is the most
            // recent of them: eviction takes a prefix from its end, never its start (a prefix
            // without its first block is no hit, its other blocks capacity wasted).
            for &(device, slot, _) in reservation.slots.iter().rev() {
                self.pool.index.touch(device, slot);
            }
        }
        self.reservations[index] = reservation;
        if let Some(i) = missing {
            self.release_index(index);
            return Err(ObjstoreError::BadRequest {
                reason: format!(
                    "block {} of the prefix is not cached (blocks {first_block}..{} requested, the first {i} cached)",
                    first_block + i,
                    first_block + keys.len()
                ),
            });
        }
        Ok(self.handle_of(index))
    }

    /// The payload CRC recorded for each of a retrieve's blocks, in placement order, into
    /// `out` (its slots are pinned, so these cannot change before it is released).
    pub fn recorded_payload_crcs(&self, handle: RequestHandle, out: &mut Vec<u32>) -> Result<()> {
        let index = self.index_of(handle)?;
        out.clear();
        for placement in &self.reservations[index].placements {
            let location = placement.location;
            out.push(self.pool.recorded_payload_crc(location.device, location.slot, payload_crc_offset(usize::from(location.index)))?);
        }
        Ok(())
    }

    /// Reserves storing blocks `keys` from `engine_blocks`: blocks already cached or in flight
    /// elsewhere are shared, the rest get slots (k consecutive new blocks per slot, slots
    /// round-robin across devices, LRU eviction when full) whose headers read Empty on disk
    /// before this returns. The slots of shared cached blocks stay pinned until the store is
    /// committed or released, so no allocation evicts a block this request counts on.
    pub fn reserve_store(&mut self, keys: &[u64], engine_blocks: &[u32], lender: &mut dyn QueueLender) -> Result<StorePlan> {
        Self::check_lengths(keys, engine_blocks)?;
        let k = self.pool.blocks_per_slot() as usize;
        let index = self.take(Direction::Store)?;
        let mut reservation = std::mem::take(&mut self.reservations[index]);
        let mut shared = 0;
        // Pass 1, one map probe per block: claim the new keys, pin the slots of cached ones
        // before any allocation can evict them.
        let unplaced = BlockLocation { device: 0, slot: 0, index: 0 };
        for (&key, &engine_block) in keys.iter().zip(engine_blocks) {
            match self.pool.index.claim(key) {
                Claim::New => {
                    reservation.placements.push(Placement { location: unplaced, engine_block });
                    reservation.keys.push(key);
                }
                Claim::Cached(location) => {
                    // Touched too, so that the slots this store counts on leave the LRU tail
                    // the allocations below walk (commit orders them again).
                    self.pool.index.pin_and_touch(location.device, location.slot);
                    reservation.shared_pins.push((location.device, location.slot));
                    shared += 1;
                }
                Claim::Pending => shared += 1,
            }
        }
        // Refuse before evicting anything: a store that cannot fit must not cost the cache.
        // New blocks fill slots k at a time (shared ones do not break a slot), and allocation
        // takes every free or evictable slot of the devices that are not fenced before it
        // gives up, so this is exact.
        let needed = reservation.placements.len().div_ceil(k);
        let available = self.available_slots();
        if needed as u64 > available {
            self.reservations[index] = reservation;
            self.release_index(index);
            return Err(ObjstoreError::PoolFull { needed, evictable: available as usize });
        }
        let placed = self.place_new_blocks(&mut reservation, k);
        self.used_devices.fill(false);
        for &(device, _, _) in &reservation.slots {
            self.used_devices[usize::from(device)] = true;
        }
        self.reservations[index] = reservation;
        // Evicted slots must read Empty on disk before new data can land in them: judged on
        // this store's devices (another device's headers failing says nothing of its slots).
        let result = placed.and_then(|evicted| self.pool.sync_headers_of(lender, &self.used_devices).map(|()| evicted));
        match result {
            Ok(evicted) => Ok(StorePlan {
                handle: self.handle_of(index),
                new_blocks: self.reservations[index].placements.len(),
                shared_blocks: shared,
                evicted_slots: evicted,
            }),
            Err(error) => {
                self.release_index(index);
                Err(error)
            }
        }
    }

    /// Pass 2 of `reserve_store`: slots for the new blocks, and Empty headers staged for the
    /// stale ones among them. Returns how many committed slots were evicted.
    fn place_new_blocks(&mut self, reservation: &mut Reservation, k: usize) -> Result<usize> {
        let mut evicted = 0;
        // The slot being filled: (device, slot, blocks used); `None` until the first new block
        // and whenever it is full (k blocks).
        let mut open: Option<(u16, u32, u16)> = None;
        let total = reservation.placements.len();
        for i in 0..total {
            let (device, slot, used) = match open {
                Some(slot) => slot,
                None => match self.allocate_slot() {
                    Some(allocation) => {
                        evicted += usize::from(allocation.evicted);
                        // Listed first, so that a failure below still returns it to the free list.
                        reservation.slots.push((allocation.device, allocation.slot, 0));
                        // A slot whose header is not a clean Empty entry (evicted, or left by a
                        // failed commit or a duplicate found at recovery) must read Empty on
                        // disk before its data is overwritten.
                        if allocation.evicted || !self.pool.header_is_empty(allocation.device, allocation.slot) {
                            self.pool.stage_header(allocation.device, allocation.slot, SlotState::Empty, &[])?;
                        }
                        (allocation.device, allocation.slot, 0)
                    }
                    None => {
                        // Unreachable after the exact check of `reserve_store` (it counts only what
                        // `allocate_slot` can take), unless the index is inconsistent.
                        return Err(ObjstoreError::PoolFull { needed: (total - i).div_ceil(k), evictable: 0 });
                    }
                },
            };
            let used_now = used + 1;
            if let Some(last) = reservation.slots.last_mut() {
                last.2 = used_now; // the open slot is always the last one listed
            }
            open = (usize::from(used_now) < k).then_some((device, slot, used_now));
            reservation.placements[i].location = BlockLocation { device, slot, index: used };
        }
        Ok(evicted)
    }

    /// Free or evictable slots on the devices that are not fenced: what [`Self::allocate_slot`]
    /// can hand out, O(devices).
    fn available_slots(&self) -> u64 {
        (0..self.pool.device_count())
            .filter(|&device| !self.pool.metadata_fenced(device))
            .map(|device| self.pool.index.available_on(device as u16))
            .sum()
    }

    /// A free slot on the next device round-robin that has one; only when no device has a free
    /// slot, the least recently used unpinned slot of the next device round-robin that has one
    /// (devices may differ in size, or one may have lost its slots' contents: a full device
    /// must not evict while another has room). Fenced devices are skipped: they take no header
    /// writes, so none of their slots is reused until reopen. Wrapping by compare, not `%`:
    /// this runs once per slot of a store, at most 2 × devices steps.
    #[inline]
    fn allocate_slot(&mut self) -> Option<crate::index::Allocation> {
        let devices = self.pool.device_count();
        for evict in [false, true] {
            let mut device = self.device_cursor;
            for _ in 0..devices {
                let next = if device + 1 == devices { 0 } else { device + 1 };
                let usable = !self.pool.metadata_fenced(device) && (evict || self.pool.index.has_free(device as u16));
                if usable {
                    if let Some(allocation) = self.pool.index.allocate_on(device as u16) {
                        self.device_cursor = next;
                        return Some(allocation);
                    }
                }
                device = next;
            }
        }
        None
    }

    /// Makes a store durable and visible once the data half reports every layer written:
    /// flushes the devices written, stages the slot headers Valid (with `payload_crcs`, one per
    /// placement, when the pool records them; ignored otherwise), writes them with FUA, then
    /// enters the blocks into the index and releases the handle. Returns the blocks stored.
    ///
    /// CRCs of the wrong count, on a pool that records them, are refused before anything is
    /// written (the handle stays reserved). A failed flush or header write on a device its
    /// slots are on releases the handle: its slots go back free and nothing of it becomes
    /// visible. Other devices' staged headers are synced too, but their failure is not this
    /// commit's (logged, and counted toward that device's fence).
    pub fn commit_store(&mut self, handle: RequestHandle, payload_crcs: Option<&[u32]>, lender: &mut dyn QueueLender) -> Result<usize> {
        let index = self.index_of(handle)?;
        if self.reservations[index].direction != Some(Direction::Store) {
            return Err(ObjstoreError::HandleState { handle: handle.0, reason: "not a store".into() });
        }
        let blocks = self.reservations[index].placements.len();
        let crcs = if self.records_payload_crcs() {
            match payload_crcs {
                Some(crcs) if crcs.len() == blocks => Some(crcs),
                other => {
                    return Err(ObjstoreError::BadRequest {
                        reason: format!(
                            "the pool records payload CRCs: commit needs one per new block ({blocks}), got {:?}",
                            other.map(<[u32]>::len)
                        ),
                    })
                }
            }
        } else {
            None
        };
        self.used_devices.fill(false);
        for &(device, _, _) in &self.reservations[index].slots {
            self.used_devices[usize::from(device)] = true;
        }
        let reservation = std::mem::take(&mut self.reservations[index]);
        // Counts the Valid headers staged (`stage_valid_headers` pushes one generation each).
        self.generations.clear();
        let result = self
            .pool
            .flush(&self.used_devices, lender)
            .and_then(|()| self.stage_valid_headers(&reservation, crcs))
            .and_then(|()| self.pool.sync_headers_of(lender, &self.used_devices));
        self.reservations[index] = reservation;
        if let Err(error) = result {
            // Headers staged Valid must not reach the disk for slots that go back to the free
            // list (their data may not be durable): stage them Empty again; the next
            // `sync_headers` (always before new data is issued) writes them. Only those: the
            // others read Empty on disk already (`reserve_store`), and staging them would
            // leave writes for a controller that may have just died (the pool's drop).
            // `stage_valid_headers` stages last slot first, one generation each. An Empty
            // stage refused (the count exhausted, maybe by this very commit's headers) must not
            // leave the Valid entry staged: it puts the Empty entry back without a generation.
            // A fenced device refuses both, and never writes its mirror again.
            let slots = self.reservations[index].slots.len();
            let staged = self.generations.len().min(slots);
            for s in slots - staged..slots {
                let (device, slot, _) = self.reservations[index].slots[s];
                if self.pool.stage_header(device, slot, SlotState::Empty, &[]).is_err() {
                    match self.pool.stage_empty_without_generation(device, slot) {
                        Ok(()) | Err(ObjstoreError::MetadataFenced { .. }) => {}
                        Err(undo) => {
                            tracing::warn!(device, slot, error = %undo, "a failed commit's Valid header could not be staged Empty again")
                        }
                    }
                }
            }
            self.release_index(index);
            return Err(error);
        }
        let reservation = &mut self.reservations[index];
        // Committed last to first, then the shared cached blocks touched last to first: the
        // prefix's first block ends the most recently used (see `reserve_retrieve`).
        // Each slot enters the index with the generation its header was written with.
        let mut end: usize = reservation.slots.iter().map(|&(_, _, used)| usize::from(used)).sum();
        for (&(device, slot, used), &generation) in reservation.slots.iter().rev().zip(&self.generations) {
            // A slot's blocks are contiguous (`place_new_blocks` fills one slot at a time).
            let range = end - usize::from(used)..end;
            end = range.start;
            self.pool.index.commit(device, slot, &reservation.keys[range], generation);
        }
        for &(device, slot) in reservation.shared_pins.iter().rev() {
            self.pool.index.touch(device, slot);
        }
        reservation.slots.clear(); // committed: nothing left to release
        self.release_index(index);
        Ok(blocks)
    }

    /// Stages a store's slot headers Valid, last slot first: each header staged takes the
    /// pool's next generation, so the slot of the prefix's first block gets the highest. A
    /// reopen orders the LRU list by generation (`Index::finish_recovery`), and so finds the
    /// order `commit_store` gives it in memory: the prefix's first block the most recent.
    /// Each slot's generation goes to `self.generations`, in the order staged.
    fn stage_valid_headers(&mut self, reservation: &Reservation, crcs: Option<&[u32]>) -> Result<()> {
        let block_tokens = self.pool.geometry().block_tokens;
        self.generations.clear();
        let mut end: usize = reservation.slots.iter().map(|&(_, _, used)| usize::from(used)).sum();
        for &(device, slot, used) in reservation.slots.iter().rev() {
            // A slot's blocks are contiguous (`place_new_blocks` fills one slot at a time).
            let range = end - usize::from(used)..end;
            end = range.start;
            self.records.clear();
            for i in range {
                let payload_crc = crcs.map_or(0, |crcs| crcs[i]);
                self.records.push(BlockRecord { key: reservation.keys[i], token_count: block_tokens, payload_crc });
            }
            let generation = self.pool.stage_header(device, slot, SlotState::Valid, &self.records)?;
            self.generations.push(generation);
        }
        Ok(())
    }

    /// Ends a request without committing: a retrieve's pins are dropped; a store's slots go
    /// back to the free list (their headers already read Empty) and none of its blocks becomes
    /// visible. The caller must know that no command of the request is still in flight.
    pub fn release(&mut self, handle: RequestHandle) -> Result<()> {
        let index = self.index_of(handle)?;
        self.release_index(index);
        Ok(())
    }

    fn release_index(&mut self, index: usize) {
        let reservation = &mut self.reservations[index];
        let direction = reservation.direction;
        for &(device, slot, _) in &reservation.slots {
            match direction {
                Some(Direction::Retrieve) => self.pool.index.unpin(device, slot),
                _ => self.pool.index.release_unwritten(device, slot),
            }
        }
        for &(device, slot) in &reservation.shared_pins {
            self.pool.index.unpin(device, slot);
        }
        if direction == Some(Direction::Store) {
            for &key in &reservation.keys {
                self.pool.index.remove_pending(key);
            }
        }
        reservation.slots.clear();
        reservation.shared_pins.clear();
        reservation.placements.clear();
        reservation.keys.clear();
        // Cleared, with no more room than RESERVATION_BLOCKS_KEPT blocks' (a no-op below it).
        reservation.slots.shrink_to(RESERVATION_BLOCKS_KEPT);
        reservation.shared_pins.shrink_to(RESERVATION_BLOCKS_KEPT);
        reservation.placements.shrink_to(RESERVATION_BLOCKS_KEPT);
        reservation.keys.shrink_to(RESERVATION_BLOCKS_KEPT);
        reservation.active = false;
        self.free.push(index);
    }

    /// Writes the slot header entries staged and not yet durable (an eviction whose sync did
    /// not fit its caller's deadline, say), each device within what is left of `deadline` (and
    /// `METADATA_TIMEOUT`); what does not fit stays staged (`DeadlinePassed`). A write that
    /// times out early because of `deadline` leaves commands in flight: the pool deletes its
    /// own queue pair then (the timeout does not count toward fencing the device), but it
    /// cannot delete an executor's queue pair lent for a device's metadata, and would fence
    /// that device until reopen: there the writes are submitted only if the whole metadata
    /// timeout fits before `deadline` after the lend, which first waits (up to that timeout,
    /// within `deadline`) for the executor's commands on the pair; a `deadline` too short for
    /// the timeout even before the lend is refused without lending when `lender` says it lends
    /// there ([`QueueLender::lends`]).
    pub fn sync_headers(&mut self, lender: &mut dyn QueueLender, deadline: Instant) -> Result<()> {
        self.pool.sync_headers_by(lender, Some(deadline))
    }

    /// Evicts the slots of blocks a verified retrieve found damaged: out of the index at once,
    /// their headers made Empty on disk (best effort: an entry that cannot be written now stays
    /// staged for the next sync, which precedes any data issued into the slot). Every block
    /// must be one of the retrieve's own placements (the report may come from another process).
    pub fn evict_mismatched(&mut self, handle: RequestHandle, blocks: &[MismatchedBlock], lender: &mut dyn QueueLender) -> Result<()> {
        self.evict_mismatched_by(handle, blocks, lender, None)
    }

    /// [`Self::evict_mismatched`], its header sync bounded by `deadline` (a `wait`'s): the
    /// entries whose write does not fit (see [`Self::sync_headers`]) stay staged, written by
    /// the next sync (the next commit, or [`Self::sync_headers`]), which comes before any data
    /// is issued into these slots, or at the latest when the pool is dropped. Best effort: a
    /// fenced device's Empty entries are never written (and one the drop cannot write, on a
    /// dead controller or past its one metadata timeout, is not), so that device's condemned
    /// blocks come back at reopen, where a verified retrieve catches them again.
    pub fn evict_mismatched_by(
        &mut self,
        handle: RequestHandle,
        blocks: &[MismatchedBlock],
        lender: &mut dyn QueueLender,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let index = self.index_of(handle)?;
        let reservation = &self.reservations[index];
        for block in blocks {
            let placement = reservation.placements.get(block.position);
            if reservation.direction != Some(Direction::Retrieve)
                || placement.is_none_or(|p| (p.location.device, p.location.slot) != (block.device, block.slot))
            {
                return Err(ObjstoreError::BadPlacement {
                    position: block.position,
                    reason: format!("device {} slot {} is not a block this retrieve reserved", block.device, block.slot),
                });
            }
        }
        for block in blocks {
            tracing::warn!(%block, "payload CRC mismatch on retrieve: the slot is evicted");
        }
        // Several bad blocks of one slot (k > 1) evict it once.
        let mut slots: Vec<(u16, u32)> = blocks.iter().map(|block| (block.device, block.slot)).collect();
        slots.sort_unstable();
        slots.dedup();
        self.evict_slots_by(&slots, lender, deadline);
        Ok(())
    }

    /// Evicts the slots of every block retrieve `handle` reserved, as
    /// [`Self::evict_mismatched_by`] does: for a retrieve whose read the device failed (an NVMe
    /// error status), whose blocks would fail every later request that hits them. Returns the
    /// blocks evicted.
    pub fn evict_retrieve_by(&mut self, handle: RequestHandle, lender: &mut dyn QueueLender, deadline: Option<Instant>) -> Result<usize> {
        let index = self.index_of(handle)?;
        let reservation = &self.reservations[index];
        if reservation.direction != Some(Direction::Retrieve) {
            return Err(ObjstoreError::HandleState { handle: handle.0, reason: "not a retrieve".into() });
        }
        let blocks = reservation.placements.len();
        // With k > 1 a slot holds several of the retrieve's blocks: each slot once (its blocks
        // are contiguous in the placements, but a slot may be listed apart all the same).
        let mut slots: Vec<(u16, u32)> = reservation.placements.iter().map(|p| (p.location.device, p.location.slot)).collect();
        slots.sort_unstable();
        slots.dedup();
        for &(device, slot) in &slots {
            tracing::warn!(device, slot, "a read of this retrieve failed on the device: the slot is evicted");
        }
        self.evict_slots_by(&slots, lender, deadline);
        Ok(blocks)
    }

    /// Takes `slots` out of the index and stages their headers Empty, then writes what fits
    /// before `deadline` (the rest stays staged for the next sync, which comes before any data is
    /// issued into these slots, or at the latest when the pool is dropped, best effort: see
    /// [`Self::evict_mismatched_by`]). `slots` lists each slot once.
    fn evict_slots_by(&mut self, slots: &[(u16, u32)], lender: &mut dyn QueueLender, deadline: Option<Instant>) {
        for &(device, slot) in slots {
            self.pool.index.condemn(device, slot);
            // Refused on a fenced device, whose slots are not reused before a reopen anyway.
            if let Err(error) = self.pool.stage_header(device, slot, SlotState::Empty, &[]) {
                tracing::warn!(%error, "staging the evicted slot's header Empty failed");
            }
        }
        if let Err(error) = self.pool.sync_headers_by(lender, deadline) {
            // The eviction is the news: the Empty entries stay dirty and go out with the next
            // sync, which comes before any data is issued into these slots.
            tracing::warn!(%error, "writing the evicted slots' headers Empty failed; they stay staged for the next sync");
        }
    }
}

#[cfg(test)]
mod tests;
