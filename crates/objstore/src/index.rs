//! The CPU-side index: chained block key -> (device, slot, position in slot), per-device free
//! lists, an LRU list of committed slots, pins for slots with I/O in flight, and the set of keys
//! being stored (so that two requests sharing a prefix store it once).
//!
//! Everything is sized at open: the per-slot arrays never grow, the LRU list is intrusive
//! (prev/next indices in the slot array), and keys are already uniformly mixed, so the hash map
//! needs only a cheap mix with a per-process secret ([`KeyHasher`]: one multiply), there so
//! that keys a client ground to collide do not.

use std::collections::hash_map::Entry as MapEntry;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use crate::error::{ObjstoreError, Result};
use crate::format::BlockRecord;

/// The map's hasher: a key is already a hash, but not a secret one. Keys are chained hashes
/// of tokens by a public scheme, and a tuttid client chooses the tokens (and knows its key
/// seed), so it can grind keys that agree in their low bits (the bucket index) or top 7 (the
/// tag compared before the key); hashed as themselves they would all probe one chain, every
/// insert and lookup walking it under the pool's single lock, stalling every client. So the
/// key is mixed with a secret chosen once per process ([`KeyBuild`]): xored, then one
/// 64x64->128 multiply by an odd secret, folded (every bit of the key reaches the low bits and
/// the top ones). A plain multiply would not do: its low bits depend only on the key's low bits.
pub struct KeyHasher {
    state: u64,
    multiplier: u64,
    xor: u64,
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        let product = u128::from(self.state ^ self.xor) * u128::from(self.multiplier);
        (product as u64) ^ ((product >> 64) as u64)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.state = (self.state << 8) ^ u64::from(byte);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.state = value;
    }
}

/// Builds [`KeyHasher`]s with the process's secret: every map of the process hashes alike, and
/// the secret is never on disk or on the socket (the maps are rebuilt at every open).
#[derive(Debug, Clone, Copy)]
pub struct KeyBuild {
    multiplier: u64,
    xor: u64,
}

impl KeyBuild {
    /// With a given secret (tests); the multiplier is made odd.
    #[cfg(test)]
    fn with_secret(multiplier: u64, xor: u64) -> Self {
        Self { multiplier: multiplier | 1, xor }
    }
}

impl Default for KeyBuild {
    fn default() -> Self {
        // std's RandomState draws its keys from the OS's randomness (once per thread, then
        // counted on): hashing two constants with one gives two secret words, no new crate.
        static SECRET: std::sync::OnceLock<(u64, u64)> = std::sync::OnceLock::new();
        let &(multiplier, xor) = SECRET.get_or_init(|| {
            let random = std::collections::hash_map::RandomState::new();
            (random.hash_one(1u64) | 1, random.hash_one(2u64))
        });
        Self { multiplier, xor }
    }
}

impl BuildHasher for KeyBuild {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher { state: 0, multiplier: self.multiplier, xor: self.xor }
    }
}

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
    /// Slots in state Writing, kept in step at every state change so that
    /// [`Index::counts`] need not walk the slot table (it runs under the pool's lock).
    writing: u64,
    /// Slots with at least one pin, kept in step like `writing`.
    pinned: u64,
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
    /// Committed entries in `map`, kept in step at every insert and removal (from what the
    /// map hands back, so a key inserted twice or replaced in place counts once): a metrics
    /// scrape reads it under the pool's lock, where a walk of millions of keys would stall
    /// every lookup and store.
    cached_blocks: u64,
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
    /// An empty index over devices with the given slot counts, for sizes known to fit (tests,
    /// tools). Sizes read from a device go through [`Index::try_new`].
    ///
    /// # Panics
    /// If the host cannot allocate it.
    pub fn new(slot_counts: &[u32], blocks_per_slot: u32) -> Self {
        Self::try_new(slot_counts, blocks_per_slot).unwrap_or_else(|error| panic!("Index::new: {error}"))
    }

    /// An empty index over devices with the given slot counts, or
    /// [`ObjstoreError::HostMemory`] when this host cannot allocate it: the counts come from
    /// the superblocks, so a huge (or lying) device must be an error, not a process abort.
    /// Every vector is reserved before any is filled, so a refusal touches no memory.
    pub fn try_new(slot_counts: &[u32], blocks_per_slot: u32) -> Result<Self> {
        let k = blocks_per_slot as usize;
        let mut reserved = Vec::new();
        reserve(&mut reserved, slot_counts.len(), "the index's device table")?;
        let mut total_keys = 0usize;
        for &count in slot_counts {
            let slots = count as usize;
            let keys = slots.checked_mul(k).ok_or_else(|| too_large("the index's block keys", u64::MAX))?;
            total_keys = total_keys.checked_add(keys).ok_or_else(|| too_large("the index's key map", u64::MAX))?;
            let (mut meta, mut key_slots, mut free) = (Vec::new(), Vec::new(), Vec::new());
            reserve(&mut key_slots, keys, "the index's block keys")?;
            reserve(&mut meta, slots, "the index's slot table")?;
            reserve(&mut free, slots, "the index's free list")?;
            reserved.push((count, meta, key_slots, free));
        }
        let mut map = HashMap::with_hasher(KeyBuild::default());
        map.try_reserve(total_keys).map_err(|_| too_large("the index's key map", bytes_of::<(u64, Entry)>(total_keys)))?;
        let devices = reserved
            .into_iter()
            .map(|(count, mut meta, mut keys, mut free)| {
                let slots = count as usize;
                meta.resize(slots, SlotMeta { state: SlotUse::Free, pins: 0, prev: NONE, next: NONE, used: 0, generation: 0 });
                keys.resize(slots * k, 0);
                // Pop from the end: low slots first, which keeps a fresh pool's data compact.
                free.extend((0..count).rev());
                DeviceSlots { meta, keys, free, head: NONE, tail: NONE, valid: 0, unpinned_valid: 0, writing: 0, pinned: 0 }
            })
            .collect();
        Ok(Self { blocks_per_slot, devices, map, cached_blocks: 0, evictions: 0, departures: None, recovering: false })
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

    /// Where the run of committed keys that starts at `first` ends (`first` itself when that
    /// key is not committed; a start past the keys counts as their end).
    pub fn cached_run_end(&self, keys: &[u64], first: usize) -> usize {
        let first = first.min(keys.len());
        first + self.cached_prefix(&keys[first..])
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
        if meta.pins == 0 {
            d.pinned += 1;
            if meta.state == SlotUse::Valid {
                d.unpinned_valid -= 1;
            }
        }
        meta.pins += 1;
    }

    pub fn unpin(&mut self, device: u16, slot: u32) {
        let d = &mut self.devices[usize::from(device)];
        let meta = &mut d.meta[slot as usize];
        if meta.pins == 1 {
            d.pinned -= 1;
            if meta.state == SlotUse::Valid {
                d.unpinned_valid += 1;
            }
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
                Self::remove_committed(&mut self.map, &mut self.cached_blocks, *key);
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
                    Self::remove_committed(&mut self.map, &mut self.cached_blocks, *key);
                    Departures::record(&mut self.departures, *key);
                    *key = 0;
                }
            }
            d.valid -= 1;
            d.unpinned_valid -= 1;
            self.evictions += 1;
            (candidate, true)
        };
        let before = d.meta[slot as usize];
        let meta = &mut d.meta[slot as usize];
        meta.state = SlotUse::Writing;
        meta.pins = 1;
        meta.used = 0;
        Self::account(d, slot, before);
        Some(Allocation { device, slot, evicted })
    }

    /// Makes a written slot visible: its blocks enter the map, the slot becomes most recently
    /// used and loses the pin its store held.
    pub fn commit(&mut self, device: u16, slot: u32, keys: &[u64], generation: u64) {
        let k = self.blocks_per_slot as usize;
        for (j, &key) in keys.iter().enumerate() {
            let location = BlockLocation { device, slot, index: j as u16 };
            Self::insert_committed(&mut self.map, &mut self.cached_blocks, key, location);
        }
        let d = &mut self.devices[usize::from(device)];
        let base = slot as usize * k;
        d.keys[base..base + keys.len()].copy_from_slice(keys);
        let before = d.meta[slot as usize];
        let meta = &mut d.meta[slot as usize];
        meta.state = SlotUse::Valid;
        meta.used = keys.len() as u16;
        meta.generation = generation;
        meta.pins = meta.pins.saturating_sub(1);
        d.valid += 1;
        if meta.pins == 0 {
            d.unpinned_valid += 1;
        }
        Self::account(d, slot, before);
        Self::push_front(d, slot);
    }

    /// Returns a slot taken by `allocate_on` whose store did not commit.
    pub fn release_unwritten(&mut self, device: u16, slot: u32) {
        let d = &mut self.devices[usize::from(device)];
        let before = d.meta[slot as usize];
        let meta = &mut d.meta[slot as usize];
        if meta.state == SlotUse::Writing {
            meta.state = SlotUse::Free;
            meta.pins = 0;
            d.free.push(slot);
            Self::account(d, slot, before);
        }
    }

    /// Recovery: records a committed slot read from disk, key by key, so that each key ends
    /// up served by its newest copy whatever order the slots are read in: a key some slot of
    /// a higher (or the same) generation already holds is not served from this one; a key an
    /// older slot holds moves here, and that slot's position no longer serves it. A slot left
    /// serving no key (this one, or an older one it superseded) goes Free (after
    /// `finish_recovery`); returns how many did. Resolving whole slots instead lost blocks: an
    /// older slot dropped for one key took its other keys along, even when the slot that
    /// dropped it later lost to a third. Until [`Index::finish_recovery`], nothing can be
    /// allocated.
    pub fn recover(&mut self, device: u16, slot: u32, blocks: &[BlockRecord], generation: u64) -> u64 {
        self.recovering = true;
        let k = self.blocks_per_slot as usize;
        let base = slot as usize * k;
        // Set first: a key listed twice in this header finds this slot as its holder.
        self.devices[usize::from(device)].meta[slot as usize].generation = generation;
        let mut freed = 0;
        let mut served = 0u16;
        for (j, block) in blocks.iter().enumerate() {
            if let Some(holder) = self.get(block.key) {
                let theirs = &self.devices[usize::from(holder.device)];
                if theirs.meta[holder.slot as usize].generation >= generation {
                    continue; // as new or newer: that copy is served
                }
                if self.supersede(holder, k) {
                    freed += 1;
                }
            }
            let location = BlockLocation { device, slot, index: j as u16 };
            Self::insert_committed(&mut self.map, &mut self.cached_blocks, block.key, location);
            self.devices[usize::from(device)].keys[base + j] = block.key;
            served += 1;
        }
        if served == 0 {
            return freed + 1; // stays Free: every key is served by a newer copy
        }
        // The free list is left alone: it still lists this slot until `finish_recovery`
        // rebuilds it from the slot states. Removing it here (a scan of a list that starts
        // with every slot) made recovery quadratic: hours for a full device of millions.
        let d = &mut self.devices[usize::from(device)];
        let before = d.meta[slot as usize];
        let meta = &mut d.meta[slot as usize];
        meta.state = SlotUse::Valid;
        meta.used = blocks.len() as u16;
        meta.pins = 0;
        d.valid += 1;
        d.unpinned_valid += 1;
        Self::account(d, slot, before);
        // Linked now so that a newer copy found later can unlink it; `finish_recovery` puts
        // the list in commit order.
        Self::push_front(d, slot);
        freed
    }

    /// Recovery: an older copy of a key at `holder` stops serving it (a newer slot takes the
    /// key); its slot goes Free once it serves no key. Returns whether it did.
    fn supersede(&mut self, holder: BlockLocation, k: usize) -> bool {
        let d = &mut self.devices[usize::from(holder.device)];
        let base = holder.slot as usize * k;
        d.keys[base + usize::from(holder.index)] = 0;
        if d.keys[base..base + k].iter().any(|&key| key != 0) {
            return false;
        }
        self.drop_valid(holder.device, holder.slot);
        true
    }

    /// Recovery: after every header was read, rebuilds each device's LRU list in commit order
    /// and its free list from the slot states (every slot not committed, low slots first).
    /// Must follow the last [`Index::recover`] before anything is allocated.
    ///
    /// The LRU list is ordered by the generation each header was committed with, oldest at
    /// the tail: `recover` sees the slots in slot order, which would make the highest slot
    /// the most recent and evict a prefix from its start. A commit stages a store's headers
    /// from its last slot to its first, so the prefix's first block comes back the most
    /// recent, as that commit left it in memory. What only touched a slot (a retrieve, a store
    /// sharing a cached block) wrote no header and is not seen here: after a reopen the order
    /// is commit recency. Sorting the committed slots costs O(n log n) (well under a second for
    /// 2^20 slots) and no memory: the free list, reserved for every slot at open, is the
    /// scratch before it is rebuilt.
    pub fn finish_recovery(&mut self) {
        for d in &mut self.devices {
            // Taken, not copied: `Vec::new` allocates nothing and the capacity comes back.
            let mut order = std::mem::take(&mut d.free);
            order.clear();
            order.extend((0..d.meta.len() as u32).filter(|&s| d.meta[s as usize].state == SlotUse::Valid));
            // Ties (equal generations only on a damaged pool) go by slot, so the order is
            // the same at every open.
            order.sort_unstable_by_key(|&s| (d.meta[s as usize].generation, s));
            (d.head, d.tail) = (NONE, NONE);
            for &slot in &order {
                Self::push_front(d, slot);
            }
            order.clear();
            d.free = order;
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

    /// The generation of the slot's last Valid header, as on disk: read at recovery, or the
    /// one its commit staged it with (0 if none since open). Meaningful while the slot is
    /// Valid.
    pub fn generation_of(&self, device: u16, slot: u32) -> u64 {
        self.devices[usize::from(device)].meta[slot as usize].generation
    }

    /// The counts, in O(devices): every figure is kept in step as the index changes, because
    /// this runs under the pool's lock on every metrics scrape, which any local user can ask
    /// for in a loop. [`Index::counts_walked`] works the same figures out the slow way.
    pub fn counts(&self) -> IndexCounts {
        let mut counts = IndexCounts { evictions: self.evictions, cached_blocks: self.cached_blocks, ..IndexCounts::default() };
        for d in &self.devices {
            counts.slots += d.meta.len() as u64;
            counts.free_slots += d.free.len() as u64;
            counts.valid_slots += d.valid;
            counts.writing_slots += d.writing;
            counts.pinned_slots += d.pinned;
        }
        counts
    }

    /// The same figures as [`Index::counts`], worked out by walking every key and slot
    /// (O(keys + slots)): a check for tests and debugging that the kept counts did not drift.
    /// Not for a path that holds the pool's lock while others wait.
    pub fn counts_walked(&self) -> IndexCounts {
        let cached_blocks = self.map.values().filter(|entry| entry.committed).count() as u64;
        let mut counts = IndexCounts { evictions: self.evictions, cached_blocks, ..IndexCounts::default() };
        for d in &self.devices {
            counts.slots += d.meta.len() as u64;
            counts.free_slots += d.free.len() as u64;
            for meta in &d.meta {
                counts.valid_slots += u64::from(meta.state == SlotUse::Valid);
                counts.writing_slots += u64::from(meta.state == SlotUse::Writing);
                counts.pinned_slots += u64::from(meta.pins > 0);
            }
        }
        counts
    }

    /// Keeps a device's `writing` and `pinned` counts in step with one slot's change from
    /// `before` to its present state and pins.
    #[inline]
    fn account(d: &mut DeviceSlots, slot: u32, before: SlotMeta) {
        let after = d.meta[slot as usize];
        // Add before subtracting: the counts are unsigned and never below the true count.
        d.writing = d.writing + u64::from(after.state == SlotUse::Writing) - u64::from(before.state == SlotUse::Writing);
        d.pinned = d.pinned + u64::from(after.pins > 0) - u64::from(before.pins > 0);
    }

    /// Inserts a committed entry for `key`, counting it unless it replaced a committed one.
    #[inline]
    fn insert_committed(map: &mut HashMap<u64, Entry, KeyBuild>, cached_blocks: &mut u64, key: u64, location: BlockLocation) {
        let replaced = map.insert(key, Entry { location, committed: true });
        if !replaced.is_some_and(|entry| entry.committed) {
            *cached_blocks += 1;
        }
    }

    /// Removes `key` from the map, uncounting it if its entry was committed.
    #[inline]
    fn remove_committed(map: &mut HashMap<u64, Entry, KeyBuild>, cached_blocks: &mut u64, key: u64) {
        if map.remove(&key).is_some_and(|entry| entry.committed) {
            *cached_blocks -= 1;
        }
    }
}

/// Reserves room for `count` more elements in `vec` (an empty one: exactly `count`), or
/// [`ObjstoreError::HostMemory`] naming `what`.
pub(crate) fn reserve<T>(vec: &mut Vec<T>, count: usize, what: &str) -> Result<()> {
    vec.try_reserve_exact(count).map_err(|_| too_large(what, bytes_of::<T>(count)))
}

fn bytes_of<T>(count: usize) -> u64 {
    (count as u64).saturating_mul(std::mem::size_of::<T>() as u64)
}

fn too_large(what: &str, bytes: u64) -> ObjstoreError {
    ObjstoreError::HostMemory { what: what.to_string(), bytes }
}

#[cfg(test)]
mod tests;
