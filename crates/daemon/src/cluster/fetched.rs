//! Replicas in waiting (docs/cluster.md, "Remote reads"): the segments this node fetched and
//! did not register (not heavy hitters), remembered so that a later local commit of a longer
//! prompt — a store always hands the registrar its whole prefix, from block 0 — does not
//! register them after all. Under `--cluster-replicate-after 0` ("never") a node that fetched a
//! prompt and extended it registered every fetched segment as its own replica; with the default
//! N, a segment fetched once became a registered replica as soon as the prompt grew.
//!
//! The fetch path adds a segment right after storing it (before `FetchRemote` answers, so before
//! any commit of the client's that could include it), under the pool lock and only while its
//! last block is in the pool; the registrar asks at each commit, and drops a segment whose last
//! block left the pool (the copy is gone: a segment stored again later is this node's own work,
//! registered as any commit). Only the last block is looked at (the segment key; the blocks of
//! a fetched segment are stored and retrieved together, so they leave together under LRU): a
//! copy that lost another block alone and had it computed again stays unregistered until its
//! last block leaves or it is forgotten past the bound.
//!
//! **Which departure is the copy's.** The registrar takes the pool's departed keys in batches
//! (one per pass, [`FetchedCopies::batch_taken`], under the pool lock); each entry is stamped
//! with the number of batches taken when it was added. A departure in a batch taken two or more
//! after the stamp happened after the addition, so it is the copy's own: the entry is forgotten
//! even when the block is back (evicted, then computed and committed here again before the
//! registrar's pass — this node's work, to be registered). Only a departure in the batch after
//! the stamp (the window the entry was added in) may predate the copy — an older copy of the
//! block leaving before the fetch stored it anew — and there the block's presence decides (kept
//! while present). So a copy evicted and computed again within the very window it was fetched
//! in stays unregistered: from one pass's take to the next, up to a tick (50 ms) and the
//! registrar's etcd calls between (each bounded by the request timeout: seconds when etcd is
//! slow). When departures were not all recorded ([`FetchedCopies::recheck_all`]) an entry
//! older than the window is forgotten (it may have left and come back) and one of the window is
//! kept while its block is present: a commit may then register a fetched copy, as past the
//! bound.
//!
//! In memory only: after a restart a commit that includes a surviving fetched copy registers
//! it (the manifest does not journal unregistered segments).
//!
//! **Bounded:** at most [`FETCHED_MAX`] segments; past it the oldest is forgotten, and a later
//! commit including it registers it (as before this list existed). Under 3.25 MiB held, 4.25
//! MiB at the peak: the map (segment key 8 bytes, model space 40, generation 8, batch stamp 8,
//! and hashbrown's control byte) grows to 32,768 buckets for its 16,385 entries, 2.1 MiB; the
//! line (a key and a generation, 16 bytes) holds up to twice the map plus one before it is
//! rebuilt, so 65,536 slots, 1 MiB. Removals leave tombstones in the map, which hashbrown
//! counts as used: left alone, a full table of them would grow the map to 65,536 buckets (4.1
//! MiB, with the old table's 2.1 MiB during the move) after about 9.5 × [`FETCHED_MAX`]
//! segments and keep it there; instead a full map is rebuilt without them, never larger than
//! room for the bound and a quarter (still 32,768 buckets), its entries (1 MiB) held in a
//! vector meanwhile — the 1 MiB of the peak.

use std::collections::{HashMap, VecDeque};

use tutti_cluster::{ModelSpace, SegmentKey};

/// Segments remembered at most.
pub const FETCHED_MAX: usize = 16_384;
/// The most memory the list takes (module docs; checked by a test).
#[cfg(test)]
const FETCHED_BYTES_MAX: usize = 13 << 18;

/// See the module docs.
#[derive(Debug)]
pub struct FetchedCopies {
    /// By segment key (its last block's key): the space, the generation it was added in and
    /// the departure batches taken by then (module docs).
    by_key: HashMap<u64, (ModelSpace, u64, u64)>,
    /// Oldest first: a segment key and the generation of its addition (an entry whose map
    /// entry has another generation, or none, is stale and skipped).
    order: VecDeque<(u64, u64)>,
    generation: u64,
    /// Departure batches the registrar has taken (module docs).
    batches: u64,
    max: usize,
}

impl FetchedCopies {
    pub fn new(max: usize) -> FetchedCopies {
        let max = max.max(1);
        FetchedCopies { by_key: HashMap::new(), order: VecDeque::new(), generation: 0, batches: 0, max }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Segment `key` of `space` was fetched and stored here, not registered. Called under the
    /// pool lock with the segment's last block in the pool (module docs).
    pub fn fetched(&mut self, space: &ModelSpace, key: SegmentKey) {
        self.generation += 1;
        let key = key.get();
        if self.by_key.len() >= self.by_key.capacity() {
            self.rebuild_map();
        }
        self.by_key.insert(key, (*space, self.generation, self.batches));
        self.order.push_back((key, self.generation));
        while self.by_key.len() > self.max {
            let Some((oldest, generation)) = self.order.pop_front() else { break };
            if self.by_key.get(&oldest).is_some_and(|&(_, added, _)| added == generation) {
                self.by_key.remove(&oldest);
            }
        }
        // Stale entries (removed or added again) are skipped when met; rebuilt now and then so
        // the line stays within twice the map.
        if self.order.len() > 2 * self.max {
            let by_key = &self.by_key;
            self.order.retain(|(key, generation)| by_key.get(key).is_some_and(|&(_, added, _)| added == *generation));
        }
    }

    /// The map is full (its capacity counts removals' tombstones out): rebuilt without them,
    /// growing as a map does (to twice its entries) but never past room for the bound and a
    /// quarter more, where hashbrown would grow it to twice its buckets however many of them
    /// are tombstones (module docs). The room past the bound keeps rebuilds a quarter of the
    /// bound's insertions apart at least. The entries wait in a vector meanwhile, so the old
    /// and new tables are never held together.
    fn rebuild_map(&mut self) {
        let entries: Vec<_> = std::mem::take(&mut self.by_key).into_iter().collect();
        let room = (2 * (entries.len() + 1)).min(self.max + 1 + self.max / 4);
        self.by_key = HashMap::with_capacity(room);
        self.by_key.extend(entries);
    }

    /// Whether segment `key` of `space` is a fetched copy not to be registered.
    pub fn contains(&self, space: &ModelSpace, key: SegmentKey) -> bool {
        self.by_key.get(&key.get()).is_some_and(|(held, _, _)| held == space)
    }

    /// Segment `key` of `space` is registered after all (a heavy hitter): forgotten here.
    pub fn replicated(&mut self, space: &ModelSpace, key: SegmentKey) {
        if self.contains(space, key) {
            self.by_key.remove(&key.get());
        }
    }

    /// The registrar took a batch of departures from the pool (under the pool lock); those it
    /// hands to [`FetchedCopies::departed`] next are this batch's.
    pub fn batch_taken(&mut self) {
        self.batches += 1;
    }

    /// Block `block` left the pool (in the batch taken last): forgets the copy it was the last
    /// block of — unless the copy was added in that batch's window and `held` says the block
    /// is in the pool (the departure may be an older copy's, before the fetch stored it).
    pub fn departed(&mut self, block: u64, held: &mut dyn FnMut(u64) -> bool) {
        let Some(&(_, _, added)) = self.by_key.get(&block) else { return };
        if self.batches.saturating_sub(added) >= 2 || !held(block) {
            self.by_key.remove(&block);
        }
    }

    /// After departures were not all recorded (the batch taken last is incomplete): forgets
    /// every copy added before that batch's window (it may have left and come back) and every
    /// one whose last block `held` says is gone.
    pub fn recheck_all(&mut self, held: &mut dyn FnMut(u64) -> bool) {
        let batches = self.batches;
        self.by_key.retain(|&key, &mut (_, _, added)| batches.saturating_sub(added) < 2 && held(key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(value: u64) -> SegmentKey {
        SegmentKey::new(value).unwrap()
    }

    #[test]
    fn copies_are_remembered_per_space_bounded_and_forgotten_when_gone() {
        // Goal: a fetched segment is remembered for its space only; past the bound the oldest
        // goes first (one added again counts from its new addition); a departure of its last
        // block forgets it unless the block is back; a heavy hitter's registration forgets it.
        let (one, two) = (ModelSpace::new([1; 32], 0, 1).unwrap(), ModelSpace::new([2; 32], 0, 1).unwrap());
        let mut copies = FetchedCopies::new(3);
        copies.fetched(&one, key(10));
        assert!(copies.contains(&one, key(10)));
        assert!(!copies.contains(&two, key(10)));
        copies.fetched(&one, key(20));
        copies.fetched(&one, key(10));
        copies.fetched(&one, key(30));
        copies.fetched(&one, key(40));
        assert_eq!(copies.len(), 3);
        assert!(!copies.contains(&one, key(20)), "the oldest was kept");
        assert!(copies.contains(&one, key(10)), "one added again was forgotten by its first addition");
        copies.departed(30, &mut |_| true);
        assert!(copies.contains(&one, key(30)), "a block back in the pool forgot its copy");
        copies.departed(30, &mut |_| false);
        assert!(!copies.contains(&one, key(30)));
        copies.replicated(&two, key(40));
        assert!(copies.contains(&one, key(40)), "another space's registration forgot it");
        copies.replicated(&one, key(40));
        assert!(!copies.contains(&one, key(40)));
        copies.recheck_all(&mut |block| block != 10);
        assert_eq!(copies.len(), 0);
        // Departure batches: a departure in the window an entry was added in (the batch taken
        // next) forgets it only when its block is gone; a later batch's forgets it regardless
        // (it left after it was added: a block back is another copy).
        copies.fetched(&one, key(50));
        copies.batch_taken();
        copies.departed(50, &mut |_| true);
        assert!(copies.contains(&one, key(50)), "a departure that may predate the copy forgot it");
        copies.batch_taken();
        copies.departed(50, &mut |_| true);
        assert!(!copies.contains(&one, key(50)), "a departure after the copy was added kept it");
        copies.fetched(&one, key(60));
        copies.batch_taken();
        copies.recheck_all(&mut |_| true);
        assert!(copies.contains(&one, key(60)));
        copies.batch_taken();
        copies.recheck_all(&mut |_| true);
        assert!(!copies.contains(&one, key(60)), "an incomplete batch kept a copy that may have left and come back");
        for value in 1..=100 {
            copies.fetched(&one, key(value));
        }
        assert!(copies.order.len() <= 2 * 3 + 1, "the line grew to {}", copies.order.len());
    }

    #[test]
    fn the_list_at_its_bound_takes_what_the_module_docs_say() {
        // Goal: the memory figure in the module docs holds at the peak, however many keys pass
        // through: the map at FETCHED_MAX (+1 before the oldest goes) entries, its removals'
        // tombstones included (16 x FETCHED_MAX distinct keys: before, the map grew to 65,536
        // buckets past about 9.5 x), and the line at up to twice that (keys added again and
        // again). Estimated from the largest capacities seen: hashbrown's buckets (a power of
        // two, 7/8 of them usable) of an entry and a control byte each; the line's slots.
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let mut copies = FetchedCopies::new(FETCHED_MAX);
        let (mut map_capacity, mut line_capacity) = (0, 0);
        for value in 1..=16 * FETCHED_MAX as u64 {
            copies.fetched(&space, key(value));
            if value <= 4 * FETCHED_MAX as u64 {
                copies.fetched(&space, key(value));
            }
            map_capacity = map_capacity.max(copies.by_key.capacity());
            line_capacity = line_capacity.max(copies.order.capacity());
        }
        let buckets = (map_capacity * 8).div_ceil(7).next_power_of_two();
        let entry = std::mem::size_of::<(u64, (ModelSpace, u64, u64))>();
        let bytes = buckets * (entry + 1) + line_capacity * std::mem::size_of::<(u64, u64)>();
        eprintln!("{buckets} buckets of {entry} bytes, {line_capacity} line slots: {bytes} bytes");
        assert!(bytes <= FETCHED_BYTES_MAX, "{bytes} bytes, more than the {FETCHED_BYTES_MAX} the docs say");
        assert_eq!(copies.len(), FETCHED_MAX);
    }
}
