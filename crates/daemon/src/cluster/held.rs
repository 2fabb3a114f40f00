//! The segments this node holds whole: every block of the segment committed in the local
//! index. Indexed both ways: by segment (what to register, unregister, list), and by block key
//! (a block that left the index breaks every held segment it belongs to — a shared prefix block
//! belongs to the segments of every prompt that starts with it).
//!
//! Memory: per segment its S block keys (8·S bytes) and one map entry; per block one map entry
//! and a small list (usually one segment). At 2·10⁶ blocks (a 4 TB pool of 2 MiB blocks) that
//! is ~100 MB: the price of unregistering exactly what an eviction broke.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, VecDeque};

use tutti_cluster::{ModelSpace, Segment, SegmentKey, FINGERPRINT_BYTES};

/// One held segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldSegment {
    pub space: ModelSpace,
    pub segment: Segment,
    /// The segment's block keys in chain order; the last is the segment key.
    pub keys: Box<[u64]>,
    /// Registered in etcd under the current lease (as far as this node knows).
    registered: bool,
    /// Listed in `to_register`.
    queued: bool,
}

/// Where a held segment sits in `entries`.
type EntryId = u32;

/// See the module docs.
#[derive(Debug, Default)]
pub struct HeldSegments {
    entries: Vec<Option<HeldSegment>>,
    free: Vec<EntryId>,
    by_segment: HashMap<(ModelSpace, SegmentKey), EntryId>,
    by_block: HashMap<u64, Vec<EntryId>>,
    /// Held, not yet registered under the current lease: registered in this order.
    to_register: VecDeque<EntryId>,
    registered: usize,
    /// Held segments per model fingerprint (the member record lists the fingerprints).
    fingerprints: BTreeMap<[u8; FINGERPRINT_BYTES], usize>,
}

impl HeldSegments {
    pub fn len(&self) -> usize {
        self.by_segment.len()
    }

    pub fn registered(&self) -> usize {
        self.registered
    }

    pub fn contains(&self, space: &ModelSpace, key: SegmentKey) -> bool {
        self.by_segment.contains_key(&(*space, key))
    }

    /// The fingerprints of the models whose segments this node holds, in order.
    pub fn fingerprints(&self) -> impl Iterator<Item = &[u8; FINGERPRINT_BYTES]> {
        self.fingerprints.keys()
    }

    pub fn iter(&self) -> impl Iterator<Item = &HeldSegment> {
        self.entries.iter().flatten()
    }

    /// Adds segment `index` of `space` made of `keys` (its blocks, all committed), to be
    /// registered. Returns false (and changes nothing) when it is held already or `keys` is
    /// empty.
    pub fn insert(&mut self, space: ModelSpace, index: u32, keys: &[u64]) -> bool {
        let Some(key) = keys.last().and_then(|&last| SegmentKey::new(last).ok()) else { return false };
        let id = match self.by_segment.entry((space, key)) {
            Entry::Occupied(_) => return false,
            Entry::Vacant(vacant) => {
                let id = self.free.pop().unwrap_or(self.entries.len() as EntryId);
                vacant.insert(id);
                id
            }
        };
        for &block in keys {
            let segments = self.by_block.entry(block).or_default();
            // A key repeated inside one segment (a hash collision) is listed once.
            if !segments.contains(&id) {
                segments.push(id);
            }
        }
        let held = HeldSegment { space, segment: Segment { index, key }, keys: keys.into(), registered: false, queued: true };
        if id as usize == self.entries.len() {
            self.entries.push(Some(held));
        } else {
            self.entries[id as usize] = Some(held);
        }
        *self.fingerprints.entry(*space.fingerprint()).or_default() += 1;
        self.to_register.push_back(id);
        // Removed segments leave stale ids behind (skipped when met); while etcd is away and
        // the cache churns they would pile up: rebuild the line from the entries now and then.
        if self.to_register.len() > 2 * self.by_segment.len() + 1024 {
            self.to_register = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, held)| held.as_ref().is_some_and(|held| held.queued))
                .map(|(id, _)| id as EntryId)
                .collect();
        }
        true
    }

    fn remove_id(&mut self, id: EntryId) -> Option<HeldSegment> {
        let held = self.entries.get_mut(id as usize)?.take()?;
        self.free.push(id);
        self.by_segment.remove(&(held.space, held.segment.key));
        for block in held.keys.iter() {
            if let Entry::Occupied(mut occupied) = self.by_block.entry(*block) {
                occupied.get_mut().retain(|&other| other != id);
                if occupied.get().is_empty() {
                    occupied.remove();
                }
            }
        }
        if held.registered {
            self.registered -= 1;
        }
        if let std::collections::btree_map::Entry::Occupied(mut count) = self.fingerprints.entry(*held.space.fingerprint()) {
            *count.get_mut() -= 1;
            if *count.get() == 0 {
                count.remove();
            }
        }
        // A stale id left in `to_register` is skipped there (its entry is gone or reused: the
        // reused one is queued by its own insert, so the stale copy registers nothing twice).
        Some(held)
    }

    /// A block left the local index: every held segment containing it for which `whole` (its
    /// keys still all committed?) now answers false is dropped, into `removed`. A block that
    /// left and came back (stored again) keeps its segments.
    pub fn block_departed(&mut self, block: u64, whole: &mut dyn FnMut(&[u64]) -> bool, removed: &mut Vec<HeldSegment>) {
        let Some(ids) = self.by_block.get(&block) else { return };
        let broken: Vec<EntryId> =
            ids.iter().copied().filter(|&id| self.entries[id as usize].as_ref().is_some_and(|held| !whole(&held.keys))).collect();
        for id in broken {
            removed.extend(self.remove_id(id));
        }
    }

    /// Checks every held segment (after departures were not all recorded).
    pub fn recheck_all(&mut self, whole: &mut dyn FnMut(&[u64]) -> bool, removed: &mut Vec<HeldSegment>) {
        let broken: Vec<EntryId> = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, held)| held.as_ref().is_some_and(|held| !whole(&held.keys)))
            .map(|(id, _)| id as EntryId)
            .collect();
        for id in broken {
            removed.extend(self.remove_id(id));
        }
    }

    /// Takes up to `max` segments to register, all of one model space (one registration call):
    /// their ids into `ids`, the segments into `segments`; the space, or None when nothing waits.
    pub fn next_to_register(&mut self, max: usize, ids: &mut Vec<EntryId>, segments: &mut Vec<Segment>) -> Option<ModelSpace> {
        ids.clear();
        segments.clear();
        let mut space = None;
        while ids.len() < max {
            let Some(id) = self.to_register.pop_front() else { break };
            let Some(held) = self.entries[id as usize].as_mut() else { continue };
            if held.registered || !held.queued {
                continue;
            }
            match space {
                None => space = Some(held.space),
                Some(first) if first != held.space => {
                    self.to_register.push_front(id);
                    break;
                }
                Some(_) => {}
            }
            held.queued = false;
            ids.push(id);
            segments.push(held.segment);
        }
        space
    }

    /// The registration of `ids` succeeded.
    pub fn registered_now(&mut self, ids: &[EntryId]) {
        for &id in ids {
            if let Some(held) = self.entries[id as usize].as_mut() {
                if !held.registered {
                    held.registered = true;
                    self.registered += 1;
                }
            }
        }
    }

    /// The registration of `ids` failed: they wait again, first in line.
    pub fn register_later(&mut self, ids: &[EntryId]) {
        for &id in ids.iter().rev() {
            if let Some(held) = self.entries[id as usize].as_mut() {
                if !held.registered && !held.queued {
                    held.queued = true;
                    self.to_register.push_front(id);
                }
            }
        }
    }

    /// A new lease has no registrations: every held segment waits to be registered again.
    pub fn unregister_all(&mut self) {
        self.to_register.clear();
        for (id, held) in self.entries.iter_mut().enumerate() {
            if let Some(held) = held {
                held.registered = false;
                held.queued = true;
                self.to_register.push_back(id as EntryId);
            }
        }
        self.registered = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space(byte: u8) -> ModelSpace {
        ModelSpace::new([byte; FINGERPRINT_BYTES], 0, 1).unwrap()
    }

    #[test]
    fn a_departed_block_drops_exactly_the_segments_it_broke() {
        // Goal: two prompts share their first block; evicting it drops both their segments,
        // evicting a block of one drops only that one; a block that came back keeps them.
        let mut held = HeldSegments::default();
        assert!(held.insert(space(1), 0, &[1, 2, 3]));
        assert!(held.insert(space(1), 0, &[1, 5, 6]));
        assert!(!held.insert(space(1), 0, &[9, 9, 3]), "same segment key: held already");
        assert!(held.insert(space(2), 0, &[1, 2, 3]), "another model space is another segment");
        assert_eq!(held.len(), 3);
        assert_eq!(held.fingerprints().count(), 2);
        let mut removed = Vec::new();
        held.block_departed(1, &mut |_| true, &mut removed);
        assert!(removed.is_empty(), "still whole (stored again): kept");
        held.block_departed(6, &mut |keys| !keys.contains(&6), &mut removed);
        assert_eq!(removed.len(), 1);
        assert_eq!(removed[0].segment.key.get(), 6);
        removed.clear();
        held.block_departed(1, &mut |keys| !keys.contains(&1), &mut removed);
        assert_eq!(removed.len(), 2);
        assert_eq!(held.len(), 0);
        assert_eq!(held.fingerprints().count(), 0);
        assert!(held.by_block.is_empty(), "no block entry outlives its segments");
    }

    #[test]
    fn registration_goes_by_space_and_failures_wait_first_in_line() {
        // Goal: each batch is of one model space and at most `max` segments; a failed batch is
        // retried before later ones; a removed segment is never handed out; after a new lease
        // everything is registered again.
        let mut held = HeldSegments::default();
        for key in 1..=3u64 {
            held.insert(space(1), key as u32, &[100 + key, key]);
        }
        held.insert(space(2), 0, &[200, 4]);
        let (mut ids, mut segments) = (Vec::new(), Vec::new());
        assert_eq!(held.next_to_register(2, &mut ids, &mut segments), Some(space(1)));
        assert_eq!(segments.iter().map(|s| s.key.get()).collect::<Vec<_>>(), [1, 2]);
        held.register_later(&ids);
        assert_eq!(held.next_to_register(8, &mut ids, &mut segments), Some(space(1)));
        assert_eq!(segments.iter().map(|s| s.key.get()).collect::<Vec<_>>(), [1, 2, 3], "the failed batch first, then the rest");
        held.registered_now(&ids);
        let mut removed = Vec::new();
        held.block_departed(200, &mut |_| false, &mut removed);
        assert_eq!(held.next_to_register(8, &mut ids, &mut segments), None, "the removed segment is not registered");
        assert_eq!(held.registered(), 3);
        held.unregister_all();
        assert_eq!(held.registered(), 0);
        assert_eq!(held.next_to_register(8, &mut ids, &mut segments), Some(space(1)));
        assert_eq!(ids.len(), 3);
    }
}
