//! The CPU-side index: chained block key -> (device, slot, position in slot), per-device free
//! lists, an LRU list of committed slots, pins for slots with I/O in flight, and the set of keys
//! being stored (so that two requests sharing a prefix store it once).
//!
//! Everything is sized at open: the per-slot arrays never grow, the LRU list is intrusive
//! (prev/next indices in the slot array), and keys are already uniformly mixed, so the hash maps
//! use them as their own hash.

use std::collections::hash_map::Entry as MapEntry;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::format::BlockRecord;

/// A hasher for keys that are already hashes.
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 << 8) ^ u64::from(byte);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

type KeyBuild = BuildHasherDefault<KeyHasher>;

/// A key's entry: where its block lives once committed, or a claim by a store in flight (one
/// map serves both, so `prepare_store` probes once per block).
#[derive(Debug, Clone, Copy)]
struct Entry {
    location: BlockLocation,
    committed: bool,
}

const NONE: u32 = u32::MAX;

/// Where a cached block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLocation {
    pub device: u16,
    pub slot: u32,
    /// Position of the block inside its slot (0 when a slot holds one block).
    pub index: u16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotUse {
    Free,
    /// Chosen for a store in flight: its header on disk is Empty, nothing may read it.
    Writing,
    /// Committed: listed in the map and the LRU list.
    Valid,
    /// Taken out of the cache (a payload CRC mismatch) while pinned: in neither the map nor
    /// the LRU list; joins the free list when its last pin goes.
    Condemned,
}

#[derive(Debug, Clone, Copy)]
struct SlotMeta {
    state: SlotUse,
    pins: u32,
    prev: u32,
    next: u32,
    used: u16,
    generation: u64,
}

#[derive(Debug)]
struct DeviceSlots {
    meta: Vec<SlotMeta>,
    /// `slot * k + j` -> key of block j of the slot (0 = none).
    keys: Vec<u64>,
    free: Vec<u32>,
    /// Most recently used.
    head: u32,
    /// Least recently used: the next victim.
    tail: u32,
    valid: u64,
    /// Valid slots with no pin: what eviction can take.
    unpinned_valid: u64,
}

/// What [`Index::claim`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Nobody had the key: this store claimed it and writes the block.
    New,
    /// Committed at this location: shared (the store must pin the slot while it counts on it).
    Cached(BlockLocation),
    /// Claimed by another store in flight: shared.
    Pending,
}

/// What an allocation took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    pub device: u16,
    pub slot: u32,
    /// Whether a committed slot was evicted for it (its header must be made Empty on disk
    /// before the new data goes there).
    pub evicted: bool,
}

/// Counts for tools and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexCounts {
    pub slots: u64,
    pub free_slots: u64,
    pub valid_slots: u64,
    pub writing_slots: u64,
    pub pinned_slots: u64,
    pub cached_blocks: u64,
    pub evictions: u64,
}

#[derive(Debug)]
pub struct Index {
    blocks_per_slot: u32,
    devices: Vec<DeviceSlots>,
    map: HashMap<u64, Entry, KeyBuild>,
    evictions: u64,
    /// Keys of committed blocks that left the map, kept only once asked for
    /// ([`Index::track_departures`]).
    departures: Option<Departures>,
    /// Between the first [`Index::recover`] and [`Index::finish_recovery`]: the free lists are
    /// stale (they still list recovered slots) and nothing may be allocated.
    recovering: bool,
}

/// The keys of committed blocks that left the index (evicted for room, condemned after a CRC
/// mismatch) since their owner last took them: a cluster node unregisters the segments it no
/// longer holds whole. Bounded: past `keys_max` keys the rest are not kept and `overflowed` is
/// set, so the owner checks everything it relies on instead.
#[derive(Debug)]
struct Departures {
    keys: Vec<u64>,
    keys_max: usize,
    overflowed: bool,
}

impl Departures {
    #[inline]
    fn record(departures: &mut Option<Departures>, key: u64) {
        if let Some(departures) = departures {
            if departures.keys.len() < departures.keys_max {
                departures.keys.push(key);
            } else {
                departures.overflowed = true;
            }
        }
    }
}

impl Index {
    /// An empty index over devices with the given slot counts.
    pub fn new(slot_counts: &[u32], blocks_per_slot: u32) -> Self {
        let devices = slot_counts
            .iter()
            .map(|&count| DeviceSlots {
                meta: vec![SlotMeta { state: SlotUse::Free, pins: 0, prev: NONE, next: NONE, used: 0, generation: 0 }; count as usize],
                keys: vec![0; count as usize * blocks_per_slot as usize],
                // Pop from the end: low slots first, which keeps a fresh pool's data compact.
                free: (0..count).rev().collect(),
                head: NONE,
                tail: NONE,
                valid: 0,
                unpinned_valid: 0,
            })
            .collect();
        let total: usize = slot_counts.iter().map(|&c| c as usize * blocks_per_slot as usize).sum();
        Self {
            blocks_per_slot,
            devices,
            map: HashMap::with_capacity_and_hasher(total, KeyBuild::default()),
            evictions: 0,
            departures: None,
            recovering: false,
        }
    }

    /// From now on, keeps the keys of committed blocks that leave the index (eviction,
    /// [`Index::condemn`]), at most `keys_max` between two [`Index::take_departures`].
    pub fn track_departures(&mut self, keys_max: usize) {
        self.departures = Some(Departures { keys: Vec::with_capacity(keys_max.min(1 << 16)), keys_max, overflowed: false });
    }

    /// Moves the keys that left since the last call into `out` (cleared first). Returns `false`
    /// when some were not kept (more than `keys_max` left, or tracking is off): the caller must
    /// then check what it relies on against the index itself.
    pub fn take_departures(&mut self, out: &mut Vec<u64>) -> bool {
        out.clear();
        match &mut self.departures {
            Some(departures) => {
                std::mem::swap(out, &mut departures.keys);
                departures.keys.clear();
                !std::mem::replace(&mut departures.overflowed, false)
            }
            None => false,
        }
    }

    pub fn blocks_per_slot(&self) -> u32 {
        self.blocks_per_slot
    }

    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Where a committed block lives (a claimed, uncommitted key is not visible).
    #[inline]
    pub fn get(&self, key: u64) -> Option<BlockLocation> {
        self.map.get(&key).filter(|entry| entry.committed).map(|entry| entry.location)
    }

    /// How many leading keys are cached (the longest cached prefix, in blocks).
    pub fn cached_prefix(&self, keys: &[u64]) -> usize {
        keys.iter().take_while(|&&key| self.get(key).is_some()).count()
    }

    /// Claims `key` for a store, in one probe: [`Claim::New`] if nobody has it (it is now
    /// claimed), else where it is cached, or that another store in flight claimed it (the block
    /// is then shared, not stored twice).
    #[inline]
    pub fn claim(&mut self, key: u64) -> Claim {
        match self.map.entry(key) {
            MapEntry::Occupied(occupied) if occupied.get().committed => Claim::Cached(occupied.get().location),
            MapEntry::Occupied(_) => Claim::Pending,
            MapEntry::Vacant(vacant) => {
                vacant.insert(Entry { location: BlockLocation { device: 0, slot: 0, index: 0 }, committed: false });
                Claim::New
            }
        }
    }

    /// Whether a store in flight claimed `key` (it is not visible yet).
    pub fn is_claimed(&self, key: u64) -> bool {
        self.map.get(&key).is_some_and(|entry| !entry.committed)
    }

    /// Drops a claim that will not be committed.
    pub fn remove_pending(&mut self, key: u64) {
        if let MapEntry::Occupied(occupied) = self.map.entry(key) {
            if !occupied.get().committed {
                occupied.remove();
            }
        }
    }

    fn unlink(device: &mut DeviceSlots, slot: u32) {
        let SlotMeta { prev, next, .. } = device.meta[slot as usize];
        match prev {
            NONE => device.head = next,
            p => device.meta[p as usize].next = next,
        }
        match next {
            NONE => device.tail = prev,
            n => device.meta[n as usize].prev = prev,
        }
        device.meta[slot as usize].prev = NONE;
        device.meta[slot as usize].next = NONE;
    }

    fn push_front(device: &mut DeviceSlots, slot: u32) {
        let old = device.head;
        device.meta[slot as usize].prev = NONE;
        device.meta[slot as usize].next = old;
        if old != NONE {
            device.meta[old as usize].prev = slot;
        } else {
            device.tail = slot;
        }
        device.head = slot;
    }

    /// Marks a committed slot most recently used.
    pub fn touch(&mut self, device: u16, slot: u32) {
        Self::touch_slot(&mut self.devices[usize::from(device)], slot);
    }

    pub fn pin(&mut self, device: u16, slot: u32) {
        Self::pin_slot(&mut self.devices[usize::from(device)], slot);
    }

    /// `pin` then `touch` with one device lookup: what a retrieve does to every slot it reads.
    #[inline]
    pub fn pin_and_touch(&mut self, device: u16, slot: u32) {
        let d = &mut self.devices[usize::from(device)];
        Self::pin_slot(d, slot);
        Self::touch_slot(d, slot);
    }

    #[inline]
    fn touch_slot(d: &mut DeviceSlots, slot: u32) {
        if d.meta[slot as usize].state == SlotUse::Valid && d.head != slot {
            Self::unlink(d, slot);
            Self::push_front(d, slot);
        }
    }

    #[inline]
    fn pin_slot(d: &mut DeviceSlots, slot: u32) {
        let meta = &mut d.meta[slot as usize];
        if meta.state == SlotUse::Valid && meta.pins == 0 {
            d.unpinned_valid -= 1;
        }
        meta.pins += 1;
    }

    pub fn unpin(&mut self, device: u16, slot: u32) {
        let d = &mut self.devices[usize::from(device)];
        let meta = &mut d.meta[slot as usize];
        if meta.pins == 1 && meta.state == SlotUse::Valid {
            d.unpinned_valid += 1;
        }
        meta.pins = meta.pins.saturating_sub(1);
        if meta.pins == 0 && meta.state == SlotUse::Condemned {
            meta.state = SlotUse::Free;
            d.free.push(slot);
        }
    }

    /// Takes a committed slot out of the cache for good (its payload failed a CRC check): its
    /// blocks leave the map and the LRU list at once, so no lookup finds them again; the slot
    /// joins the free list when its last pin goes (a retrieve may still be reading it). The
    /// caller makes its header Empty on disk. Does nothing to a slot that is not committed.
    pub fn condemn(&mut self, device: u16, slot: u32) {
        let Some(unpinned) = self.forget_valid(device, slot) else { return };
        let d = &mut self.devices[usize::from(device)];
        if unpinned {
            d.meta[slot as usize].state = SlotUse::Free;
            d.free.push(slot);
        } else {
            d.meta[slot as usize].state = SlotUse::Condemned;
        }
    }

    /// Takes a committed slot's blocks out of the map and the LRU list, so no lookup finds them
    /// again, and stops counting it as valid. Returns whether it was unpinned, or `None` (and
    /// does nothing) when the slot is not committed; the caller sets its new state.
    fn forget_valid(&mut self, device: u16, slot: u32) -> Option<bool> {
        let k = self.blocks_per_slot as usize;
        let d = &mut self.devices[usize::from(device)];
        if d.meta[slot as usize].state != SlotUse::Valid {
            return None;
        }
        Self::unlink(d, slot);
        let base = slot as usize * k;
        for key in &mut d.keys[base..base + k] {
            if *key != 0 {
                self.map.remove(key);
                Departures::record(&mut self.departures, *key);
                *key = 0;
            }
        }
        d.valid -= 1;
        let unpinned = d.meta[slot as usize].pins == 0;
        if unpinned {
            d.unpinned_valid -= 1;
        }
        Some(unpinned)
    }

    /// Free or evictable slots on all devices (evictable = committed and not pinned), O(devices).
    pub fn available(&self) -> u64 {
        (0..self.devices.len()).map(|device| self.available_on(device as u16)).sum()
    }

    /// Free or evictable slots on `device`, O(1).
    pub fn available_on(&self, device: u16) -> u64 {
        let d = &self.devices[usize::from(device)];
        d.free.len() as u64 + d.unpinned_valid
    }

    /// Whether `device` has a free slot (`allocate_on` would take it without evicting).
    #[inline]
    pub fn has_free(&self, device: u16) -> bool {
        !self.devices[usize::from(device)].free.is_empty()
    }

    /// Takes a slot on `device`: a free one, else the least recently used committed slot that
    /// is not pinned (its blocks leave the index). The slot comes back Writing and pinned.
    #[inline]
    pub fn allocate_on(&mut self, device: u16) -> Option<Allocation> {
        // The free lists are stale during recovery: they may list committed slots.
        debug_assert!(!self.recovering, "allocation before finish_recovery");
        if self.recovering {
            return None;
        }
        let k = self.blocks_per_slot as usize;
        let d = &mut self.devices[usize::from(device)];
        let (slot, evicted) = if let Some(slot) = d.free.pop() {
            (slot, false)
        } else {
            // Walk from the LRU end past pinned slots; bounded by the slot count.
            let mut candidate = d.tail;
            while candidate != NONE && d.meta[candidate as usize].pins > 0 {
                candidate = d.meta[candidate as usize].prev;
            }
            if candidate == NONE {
                return None;
            }
            Self::unlink(d, candidate);
            let base = candidate as usize * k;
            for key in &mut d.keys[base..base + k] {
                if *key != 0 {
                    self.map.remove(key);
                    Departures::record(&mut self.departures, *key);
                    *key = 0;
                }
            }
            d.valid -= 1;
            d.unpinned_valid -= 1;
            self.evictions += 1;
            (candidate, true)
        };
        let meta = &mut d.meta[slot as usize];
        meta.state = SlotUse::Writing;
        meta.pins = 1;
        meta.used = 0;
        Some(Allocation { device, slot, evicted })
    }

    /// Makes a written slot visible: its blocks enter the map, the slot becomes most recently
    /// used and loses the pin its store held.
    pub fn commit(&mut self, device: u16, slot: u32, keys: &[u64], generation: u64) {
        let k = self.blocks_per_slot as usize;
        for (j, &key) in keys.iter().enumerate() {
            self.map.insert(key, Entry { location: BlockLocation { device, slot, index: j as u16 }, committed: true });
        }
        let d = &mut self.devices[usize::from(device)];
        let base = slot as usize * k;
        d.keys[base..base + keys.len()].copy_from_slice(keys);
        let meta = &mut d.meta[slot as usize];
        meta.state = SlotUse::Valid;
        meta.used = keys.len() as u16;
        meta.generation = generation;
        meta.pins = meta.pins.saturating_sub(1);
        d.valid += 1;
        if meta.pins == 0 {
            d.unpinned_valid += 1;
        }
        Self::push_front(d, slot);
    }

    /// Returns a slot taken by `allocate_on` whose store did not commit.
    pub fn release_unwritten(&mut self, device: u16, slot: u32) {
        let d = &mut self.devices[usize::from(device)];
        let meta = &mut d.meta[slot as usize];
        if meta.state == SlotUse::Writing {
            meta.state = SlotUse::Free;
            meta.pins = 0;
            d.free.push(slot);
        }
    }

    /// Recovery: records a committed slot read from disk. A key already present with a higher
    /// generation wins; the loser's slot is returned as `Err` (it is free after `finish_recovery`).
    /// Until [`Index::finish_recovery`], nothing can be allocated.
    pub fn recover(&mut self, device: u16, slot: u32, blocks: &[BlockRecord], generation: u64) -> Result<(), (u16, u32)> {
        self.recovering = true;
        for block in blocks {
            if let Some(existing) = self.get(block.key) {
                let theirs = self.devices[usize::from(existing.device)].meta[existing.slot as usize].generation;
                if theirs >= generation {
                    return Err((device, slot));
                }
                self.drop_valid(existing.device, existing.slot);
                return self.recover(device, slot, blocks, generation).and(Err((existing.device, existing.slot)));
            }
        }
        // The free list is left alone: it still lists this slot until `finish_recovery`
        // rebuilds it from the slot states. Removing it here (a scan of a list that starts
        // with every slot) made recovery quadratic: hours for a full device of millions.
        let d = &mut self.devices[usize::from(device)];
        let keys: Vec<u64> = blocks.iter().map(|b| b.key).collect();
        d.meta[slot as usize].pins = 1; // commit() drops it
        self.commit(device, slot, &keys, generation);
        Ok(())
    }

    /// Recovery: after every header was read, rebuilds the free lists from the slot states
    /// (every slot not committed, low slots first), in O(slots). Must follow the last
    /// [`Index::recover`] before anything is allocated.
    pub fn finish_recovery(&mut self) {
        for d in &mut self.devices {
            d.free.clear();
            d.free.extend((0..d.meta.len() as u32).rev().filter(|&s| d.meta[s as usize].state == SlotUse::Free));
        }
        self.recovering = false;
    }

    /// Recovery: a committed slot whose key a newer slot holds goes back to Free (the free
    /// lists are rebuilt by `finish_recovery`).
    fn drop_valid(&mut self, device: u16, slot: u32) {
        if self.forget_valid(device, slot).is_some() {
            self.devices[usize::from(device)].meta[slot as usize].state = SlotUse::Free;
        }
    }

    pub fn generation_of(&self, device: u16, slot: u32) -> u64 {
        self.devices[usize::from(device)].meta[slot as usize].generation
    }

    pub fn counts(&self) -> IndexCounts {
        let cached_blocks = self.map.values().filter(|entry| entry.committed).count() as u64;
        let mut counts = IndexCounts { evictions: self.evictions, cached_blocks, ..IndexCounts::default() };
        for d in &self.devices {
            counts.slots += d.meta.len() as u64;
            counts.free_slots += d.free.len() as u64;
            counts.valid_slots += d.valid;
            for meta in &d.meta {
                counts.writing_slots += u64::from(meta.state == SlotUse::Writing);
                counts.pinned_slots += u64::from(meta.pins > 0);
            }
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_and_touch_equals_pin_then_touch() {
        // Goal: the fused retrieve path leaves the same LRU order and counts as the two calls.
        let build = || {
            let mut index = Index::new(&[4], 1);
            for key in [10u64, 20, 30, 40] {
                let a = index.allocate_on(0).unwrap();
                index.commit(0, a.slot, &[key], key);
            }
            index
        };
        let (mut fused, mut separate) = (build(), build());
        for key in [10u64, 30, 10] {
            let slot = fused.get(key).unwrap().slot;
            fused.pin_and_touch(0, slot);
            separate.pin(0, slot);
            separate.touch(0, slot);
        }
        assert_eq!(fused.counts(), separate.counts());
        for key in [100u64, 200] {
            // Both evict the same (least recently used, unpinned) slots: 20, then 40.
            let (a, b) = (fused.allocate_on(0), separate.allocate_on(0));
            assert_eq!(a, b);
            fused.commit(0, a.unwrap().slot, &[key], key);
            separate.commit(0, b.unwrap().slot, &[key], key);
        }
        assert!(fused.get(20).is_none() && fused.get(40).is_none() && fused.get(10).is_some());
    }

    #[test]
    fn departures_list_every_committed_key_that_left_and_say_when_some_were_not_kept() {
        // Goal: with tracking on, an eviction and a condemnation each report exactly the keys of
        // the slot that left (k = 2 blocks per slot); nothing is kept before tracking starts;
        // past the bound the call says the list is incomplete, once.
        let mut index = Index::new(&[2], 2);
        let mut out = vec![99];
        assert!(!index.take_departures(&mut out), "untracked: nothing is kept");
        assert!(out.is_empty());
        for keys in [[1u64, 2], [3, 4]] {
            let allocation = index.allocate_on(0).unwrap();
            index.commit(0, allocation.slot, &keys, 1);
        }
        index.track_departures(3);
        let slot_of_3 = index.get(3).unwrap().slot;
        index.touch(0, slot_of_3);
        let allocation = index.allocate_on(0).unwrap();
        assert!(allocation.evicted);
        index.commit(0, allocation.slot, &[5, 6], 2);
        assert!(index.take_departures(&mut out));
        assert_eq!(out, [1, 2], "the least recently used slot's keys");
        index.condemn(0, index.get(3).unwrap().slot);
        assert!(index.take_departures(&mut out));
        assert_eq!(out, [3, 4]);
        assert!(index.take_departures(&mut out) && out.is_empty());
        // Over the bound: 3 kept, the fourth lost and said so.
        let allocation = index.allocate_on(0).unwrap();
        index.commit(0, allocation.slot, &[7, 8], 3);
        for slot in [index.get(5).unwrap().slot, index.get(7).unwrap().slot] {
            index.condemn(0, slot);
        }
        assert!(!index.take_departures(&mut out));
        assert_eq!(out, [5, 6, 7]);
        assert!(index.take_departures(&mut out) && out.is_empty(), "the overflow is reported once");
    }

    #[test]
    fn lru_eviction_skips_pinned_slots() {
        // Goal: a full device evicts its least recently used unpinned slot; touching moves a
        // slot to the front; a pinned slot is never chosen; all pinned -> None.
        let mut index = Index::new(&[3], 1);
        for (slot_key, _) in [(100u64, 0), (200, 1), (300, 2)] {
            let a = index.allocate_on(0).unwrap();
            assert!(!a.evicted);
            index.commit(0, a.slot, &[slot_key], slot_key);
        }
        assert_eq!(index.counts().free_slots, 0);
        let oldest = index.get(100).unwrap();
        index.touch(0, oldest.slot); // 200 is now LRU
        let victim = index.get(200).unwrap();
        index.pin(0, victim.slot); // ... but pinned: 300 goes
        let a = index.allocate_on(0).unwrap();
        assert!(a.evicted);
        assert!(index.get(300).is_none() && index.get(200).is_some() && index.get(100).is_some());
        index.commit(0, a.slot, &[400], 400);
        index.pin(0, index.get(100).unwrap().slot);
        index.pin(0, index.get(400).unwrap().slot);
        assert_eq!(index.available(), 0);
        assert_eq!(index.allocate_on(0), None);
        assert_eq!(index.cached_prefix(&[100, 200, 999, 400]), 2);
        let counts = index.counts();
        assert_eq!((counts.valid_slots, counts.pinned_slots, counts.evictions), (3, 3, 1));
    }

    #[test]
    fn a_condemned_slot_leaves_the_cache_now_and_is_reused_once_unpinned() {
        // Goal: condemning a pinned committed slot hides its blocks at once, keeps it out of
        // allocation while pinned (a retrieve may still read it), and frees it on the last unpin.
        let mut index = Index::new(&[2], 2);
        let a = index.allocate_on(0).unwrap();
        index.commit(0, a.slot, &[10, 11], 1);
        let b = index.allocate_on(0).unwrap();
        index.commit(0, b.slot, &[20], 2);
        index.pin(0, a.slot);
        index.pin(0, a.slot);
        index.condemn(0, a.slot);
        assert_eq!((index.get(10), index.get(11)), (None, None));
        assert_eq!(index.available(), 1, "only b can be taken");
        let next = index.allocate_on(0).unwrap();
        assert_eq!((next.slot, next.evicted), (b.slot, true));
        assert_eq!(index.allocate_on(0), None, "the condemned slot is still pinned");
        index.unpin(0, a.slot);
        assert_eq!(index.allocate_on(0), None);
        index.unpin(0, a.slot);
        let reused = index.allocate_on(0).unwrap();
        assert_eq!((reused.slot, reused.evicted), (a.slot, false));
        let counts = index.counts();
        assert_eq!((counts.valid_slots, counts.writing_slots, counts.cached_blocks), (0, 2, 0));
    }

    #[test]
    fn recovery_keeps_the_newest_copy_of_a_key() {
        let mut index = Index::new(&[4], 2);
        let rec = |key| BlockRecord { key, token_count: 16, payload_crc: 0 };
        assert_eq!(index.recover(0, 1, &[rec(7), rec(8)], 5), Ok(()));
        assert_eq!(index.recover(0, 2, &[rec(8)], 3), Err((0, 2)));
        assert_eq!(index.recover(0, 3, &[rec(7)], 9), Err((0, 1)));
        index.finish_recovery();
        assert_eq!(index.get(7), Some(BlockLocation { device: 0, slot: 3, index: 0 }));
        assert_eq!(index.get(8), None);
        assert_eq!(index.counts().free_slots, 3);
    }

    /// Distinct, well-mixed, non-zero keys (real keys are hashes; the map uses them as their own
    /// hash, so sequential small keys would all share one control tag).
    fn mixed_key(i: u64) -> u64 {
        (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
    }

    #[test]
    fn recovering_every_slot_of_a_large_device_takes_linear_time() {
        // Goal: `Pool::open` recovers a full device in time linear in its slots. `recover` used
        // to look each Valid slot up in the free list (which starts with every slot) and remove
        // it: n²/2 comparisons, about 7 × 10^12 for a full 3.7 M-slot device, hours of start-up.
        // 2^20 slots take ~0.65 s in a debug build now (idle 2-core machine); the quadratic
        // version took 14 s for the first 4096 of them, ~30 min for all. The budget is checked
        // as it goes, so the quadratic version fails within seconds.
        const SLOTS: u32 = 1 << 20;
        let budget = std::time::Duration::from_secs(5);
        let mut index = Index::new(&[SLOTS], 1);
        let start = std::time::Instant::now();
        for slot in 0..SLOTS {
            let record = [BlockRecord { key: mixed_key(u64::from(slot)), token_count: 16, payload_crc: 0 }];
            assert_eq!(index.recover(0, slot, &record, 1), Ok(()));
            if slot % 4096 == 0 {
                assert!(start.elapsed() < budget, "{slot} of {SLOTS} slots recovered in {:?}: not linear", start.elapsed());
            }
        }
        index.finish_recovery();
        let elapsed = start.elapsed();
        eprintln!("recovered {SLOTS} slots in {elapsed:?}");
        assert!(elapsed < budget, "{SLOTS} slots recovered in {elapsed:?}");
        let counts = index.counts();
        assert_eq!((counts.valid_slots, counts.free_slots, counts.cached_blocks), (u64::from(SLOTS), 0, u64::from(SLOTS)));
        let allocation = index.allocate_on(0).expect("a full device evicts");
        assert!(allocation.evicted);
    }

    #[test]
    fn after_recovery_the_free_lists_are_exactly_the_slots_not_committed() {
        // Goal: whatever `recover` saw (Valid slots, a duplicate whose older copy is dropped
        // after it was recovered, a duplicate refused because it is older), `finish_recovery`
        // leaves each device's free list holding every non-committed slot once, low slots
        // first, and allocation hands out exactly those before it evicts anything.
        let mut index = Index::new(&[16, 8], 1);
        let rec = |key| [BlockRecord { key, token_count: 16, payload_crc: 0 }];
        for (device, slot, key, generation) in [(0u16, 1u32, 101u64, 1u64), (0, 3, 103, 2), (0, 9, 109, 3), (0, 15, 115, 4), (1, 0, 200, 5)]
        {
            assert_eq!(index.recover(device, slot, &rec(key), generation), Ok(()));
        }
        // Key 500: first on device 0 slot 5, then a newer copy on device 1 slot 7 (slot 5 is
        // dropped), then an older copy on device 0 slot 6 (refused).
        assert_eq!(index.recover(0, 5, &rec(500), 6), Ok(()));
        assert_eq!(index.recover(1, 7, &rec(500), 8), Err((0, 5)));
        assert_eq!(index.recover(0, 6, &rec(500), 7), Err((0, 6)));
        index.finish_recovery();
        let valid: [&[u32]; 2] = [&[1, 3, 9, 15], &[0, 7]];
        for (device, valid) in valid.iter().enumerate() {
            let slots = index.devices[device].meta.len() as u32;
            let expected: Vec<u32> = (0..slots).rev().filter(|slot| !valid.contains(slot)).collect();
            assert_eq!(index.devices[device].free, expected, "device {device}");
        }
        assert_eq!(index.get(500), Some(BlockLocation { device: 1, slot: 7, index: 0 }));
        assert_eq!(index.available(), 24);
        // Device 0: its 12 free slots, lowest first, then evictions only.
        let mut taken = Vec::new();
        for _ in 0..12 {
            let allocation = index.allocate_on(0).unwrap();
            assert!(!allocation.evicted, "slot {} evicted with free slots left", allocation.slot);
            taken.push(allocation.slot);
        }
        assert_eq!(taken, [0, 2, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14]);
        assert!(index.allocate_on(0).unwrap().evicted);
    }

    #[test]
    fn random_operations_agree_with_a_simple_model() {
        // Goal: against a model (a Vec ordered by last use, pin counts, free set), thousands of
        // random allocate/commit/pin/unpin/touch/release steps keep the counters right and
        // eviction always takes the least recently used unpinned slot.
        let slots = 8u32;
        let mut index = Index::new(&[slots], 1);
        let mut state = 0x1234_5678u64;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        let mut lru: Vec<u32> = Vec::new(); // committed slots, least recent first
        let mut pins = vec![0u32; slots as usize];
        let mut writing: Vec<u32> = Vec::new();
        let mut key = 1u64;
        for step in 0..5000 {
            match next() % 5 {
                0 => {
                    let evictable = lru.iter().copied().find(|&s| pins[s as usize] == 0);
                    let free = slots as usize - lru.len() - writing.len();
                    match index.allocate_on(0) {
                        Some(a) if a.evicted => {
                            assert_eq!(free, 0, "step {step}: evicted with free slots");
                            assert_eq!(Some(a.slot), evictable, "step {step}: not the LRU unpinned slot");
                            lru.retain(|&s| s != a.slot);
                            writing.push(a.slot);
                        }
                        Some(a) => {
                            assert!(free > 0, "step {step}");
                            writing.push(a.slot);
                        }
                        None => assert!(free == 0 && evictable.is_none(), "step {step}: refused with room"),
                    }
                }
                1 if !writing.is_empty() => {
                    let slot = writing.remove(next() as usize % writing.len());
                    if next() % 4 == 0 {
                        index.release_unwritten(0, slot);
                    } else {
                        key += 1;
                        index.commit(0, slot, &[key], key);
                        lru.push(slot);
                    }
                }
                2 if !lru.is_empty() => {
                    let slot = lru[next() as usize % lru.len()];
                    index.pin(0, slot);
                    pins[slot as usize] += 1;
                }
                3 => {
                    if let Some(slot) = (0..slots).find(|&s| pins[s as usize] > 0 && lru.contains(&s)) {
                        index.unpin(0, slot);
                        pins[slot as usize] -= 1;
                    }
                }
                _ if !lru.is_empty() => {
                    let position = next() as usize % lru.len();
                    let slot = lru.remove(position);
                    index.touch(0, slot);
                    lru.push(slot);
                }
                _ => {}
            }
            let free = slots as u64 - lru.len() as u64 - writing.len() as u64;
            let unpinned = lru.iter().filter(|&&s| pins[s as usize] == 0).count() as u64;
            assert_eq!(index.available(), free + unpinned, "step {step}");
            assert_eq!(index.counts().valid_slots, lru.len() as u64, "step {step}");
        }
    }
}
