//! Heavy hitters (docs/cluster.md, "Heavy hitters"): how many times this node, as a holder, has
//! served each segment to other nodes. The count travels in each answer's `SegmentHeader`; an
//! asker that stores a segment whose holder has served it more than `--cluster-replicate-after`
//! times registers its copy as a second replica (through its registrar, like its own commits).
//!
//! Why the holder counts: it sees every remote read of its segments, whoever asks — one node
//! re-fetching after its copy was evicted, or many nodes fetching once each (TokenLake's hot
//! prefixes) — so the count is the segment's remote demand, where an asker's own count would
//! see only its own.
//!
//! **Bounded:** at most [`SERVED_COUNTS_MAX`] segments are counted (one entry: model space 40
//! bytes, segment key 8, count 4, plus the map's own ~1 byte and load factor: under 2 MiB).
//! When a new segment finds the map full, the coldest eighth (the lowest counts; ties broken
//! arbitrarily) is forgotten in one pass, so the cost is O(1) amortised per read served and a
//! hot segment is never the one dropped while colder ones remain. Counts live in memory only: a
//! holder's restart starts them again from 0.

use std::collections::HashMap;

use tutti_cluster::{ModelSpace, SegmentKey};

/// Segments whose served count is kept at most.
pub const SERVED_COUNTS_MAX: usize = 16_384;

/// See the module docs.
#[derive(Debug)]
pub struct ServedCounts {
    counts: HashMap<(ModelSpace, SegmentKey), u32>,
    max: usize,
    /// Scratch for the eviction pass.
    scratch: Vec<u32>,
}

impl ServedCounts {
    pub fn new(max: usize) -> ServedCounts {
        let max = max.max(8);
        ServedCounts { counts: HashMap::with_capacity(max), max, scratch: Vec::new() }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// What [`ServedCounts::served`] would answer now (the count plus this read), without
    /// counting it: a holder sends this in the segment's header and counts the read only once
    /// the whole segment is sent (a read that fails mid-stream is no demand met).
    pub fn next(&self, space: &ModelSpace, key: SegmentKey) -> u32 {
        self.counts.get(&(*space, key)).copied().unwrap_or(0).saturating_add(1)
    }

    /// One more read of segment `key` of `space` served: its count now (saturating).
    pub fn served(&mut self, space: &ModelSpace, key: SegmentKey) -> u32 {
        if self.counts.len() >= self.max && !self.counts.contains_key(&(*space, key)) {
            self.forget_coldest();
        }
        let count = self.counts.entry((*space, key)).or_insert(0);
        *count = count.saturating_add(1);
        *count
    }

    /// Forgets the coldest eighth of the counted segments.
    fn forget_coldest(&mut self) {
        let drop = (self.max / 8).max(1).min(self.counts.len());
        if drop == 0 {
            return;
        }
        self.scratch.clear();
        self.scratch.extend(self.counts.values().copied());
        let (_, &mut threshold, _) = self.scratch.select_nth_unstable(drop - 1);
        // Every count below the threshold goes; counts equal to it go until `drop` went.
        let below = self.scratch.iter().filter(|&&count| count < threshold).count();
        let mut equal_to_drop = drop - below;
        self.counts.retain(|_, count| {
            if *count < threshold {
                false
            } else if *count == threshold && equal_to_drop > 0 {
                equal_to_drop -= 1;
                false
            } else {
                true
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tutti_cluster::FINGERPRINT_BYTES;

    fn space(byte: u8) -> ModelSpace {
        ModelSpace::new([byte; FINGERPRINT_BYTES], 0, 1).unwrap()
    }

    fn key(value: u64) -> SegmentKey {
        SegmentKey::new(value).unwrap()
    }

    #[test]
    fn counts_are_per_segment_and_model_space() {
        // Goal: each read served counts for its own segment of its own model space.
        let mut counts = ServedCounts::new(64);
        assert_eq!(counts.next(&space(1), key(7)), 1, "peeking counts nothing");
        assert_eq!(counts.next(&space(1), key(7)), 1);
        assert_eq!(counts.served(&space(1), key(7)), 1);
        assert_eq!(counts.served(&space(1), key(7)), 2);
        assert_eq!(counts.next(&space(1), key(7)), 3);
        assert_eq!(counts.served(&space(2), key(7)), 1, "another model space is another segment");
        assert_eq!(counts.served(&space(1), key(8)), 1);
        assert_eq!(counts.served(&space(1), key(7)), 3);
    }

    #[test]
    fn a_full_map_forgets_the_coldest_and_keeps_the_hot() {
        // Goal: the map never holds more than its bound; when a new segment finds it full, the
        // coldest eighth goes and the hot segments keep their counts, however many cold
        // segments stream past.
        let mut counts = ServedCounts::new(64);
        for hot in 1..=4 {
            for _ in 0..5 {
                counts.served(&space(1), key(hot));
            }
        }
        for cold in 100..10_000u64 {
            counts.served(&space(1), key(cold));
            assert!(counts.len() <= 64, "{} counted", counts.len());
        }
        for hot in 1..=4 {
            assert_eq!(counts.served(&space(1), key(hot)), 6, "hot segment {hot} lost its count");
        }
        assert!(counts.len() > 64 - 64 / 8 - 1, "only an eighth is dropped per pass: {}", counts.len());
    }
}
