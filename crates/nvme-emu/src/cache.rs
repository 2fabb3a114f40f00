//! The volatile write cache: dirty blocks held in memory until Flush, FUA or pressure.
//!
//! Model: a write lands here and completes; it reaches the backing store (becomes durable) on
//! Flush, on a FUA Read of the same blocks (which writes them back), or when the cache exceeds
//! its capacity (then every dirty block is written back); a FUA Write of the same blocks
//! replaces them on media and drops them. A power loss discards the cache (after writing a pseudorandom
//! subset back, in `PowerLossMode::PartialWriteBack`: see `ControllerCore::write_back_some`).
//! Blocks are keyed by (namespace index, LBA) so a write-back walks them in order and
//! coalesces consecutive blocks into few backing-store writes.

use std::collections::BTreeMap;

#[derive(Default)]
pub(crate) struct WriteCache {
    blocks: BTreeMap<(usize, u64), Box<[u8]>>,
    dirty_bytes: u64,
    /// Block buffers written back or discarded, reused by later inserts: freeing megabytes at
    /// each write-back and faulting them in again made cached writes several times slower.
    /// Never more than the cache held, so bounded by the cache capacity.
    spare: Vec<Box<[u8]>>,
}

impl WriteCache {
    pub(crate) fn dirty_bytes(&self) -> u64 {
        self.dirty_bytes
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Stores `data` (a whole number of `block_size` blocks) at `start_lba`.
    pub(crate) fn insert(&mut self, namespace_index: usize, start_lba: u64, block_size: usize, data: &[u8]) {
        for (index, block) in data.chunks_exact(block_size).enumerate() {
            let key = (namespace_index, start_lba + index as u64);
            let buffer = match self.spare.pop() {
                Some(mut spare) if spare.len() == block.len() => {
                    spare.copy_from_slice(block);
                    spare
                }
                _ => block.into(),
            };
            if let Some(old) = self.blocks.insert(key, buffer) {
                self.dirty_bytes -= old.len() as u64;
                self.spare.push(old);
            }
            self.dirty_bytes += block.len() as u64;
        }
    }

    /// Overwrites the parts of `buffer` (blocks from `start_lba`) that the cache holds newer data for.
    pub(crate) fn overlay(&self, namespace_index: usize, start_lba: u64, block_size: usize, buffer: &mut [u8]) {
        let blocks = (buffer.len() / block_size) as u64;
        let range = (namespace_index, start_lba)..(namespace_index, start_lba + blocks);
        for ((_, lba), data) in self.blocks.range(range) {
            let offset = ((lba - start_lba) as usize) * block_size;
            if let Some(target) = buffer.get_mut(offset..offset + block_size) {
                if data.len() == block_size {
                    target.copy_from_slice(data);
                }
            }
        }
    }

    /// Whether any block of `start_lba..start_lba+blocks` is cached (a read of them needs the
    /// overlay).
    pub(crate) fn holds_any(&self, namespace_index: usize, start_lba: u64, blocks: u64) -> bool {
        let end = start_lba.saturating_add(blocks);
        self.blocks.range((namespace_index, start_lba)..(namespace_index, end)).next().is_some()
    }

    /// Forgets cached blocks in `start_lba..start_lba+blocks` (they were overwritten on media).
    pub(crate) fn discard_range(&mut self, namespace_index: usize, start_lba: u64, blocks: u64) {
        let end = start_lba.saturating_add(blocks);
        let keys: Vec<_> = self.blocks.range((namespace_index, start_lba)..(namespace_index, end)).map(|(key, _)| *key).collect();
        for key in keys {
            if let Some(old) = self.blocks.remove(&key) {
                self.dirty_bytes -= old.len() as u64;
                self.spare.push(old);
            }
        }
    }

    /// Takes every dirty block (of one namespace, or all) out of the cache, in (namespace, LBA)
    /// order, for write-back. O(log n) to detach; the caller consumes the map.
    pub(crate) fn take(&mut self, only_namespace: Option<usize>) -> BTreeMap<(usize, u64), Box<[u8]>> {
        let taken = match only_namespace {
            None => std::mem::take(&mut self.blocks),
            Some(namespace) => {
                let mut taken = self.blocks.split_off(&(namespace, 0));
                let mut after = match namespace.checked_add(1) {
                    Some(next) => taken.split_off(&(next, 0)),
                    None => BTreeMap::new(),
                };
                self.blocks.append(&mut after);
                taken
            }
        };
        let bytes: u64 = taken.values().map(|block| block.len() as u64).sum();
        self.dirty_bytes -= bytes;
        taken
    }

    /// Takes the dirty blocks of `start_lba..start_lba+blocks` of one namespace out of the
    /// cache, in LBA order, for write-back (a FUA Read's): O(log n) per block taken.
    pub(crate) fn take_range(&mut self, namespace_index: usize, start_lba: u64, blocks: u64) -> BTreeMap<(usize, u64), Box<[u8]>> {
        let range = (namespace_index, start_lba)..(namespace_index, start_lba.saturating_add(blocks));
        let mut taken = BTreeMap::new();
        // Bounded by the blocks cached in the range: each pass removes one.
        while let Some(key) = self.blocks.range(range.clone()).next().map(|(key, _)| *key) {
            if let Some(data) = self.blocks.remove(&key) {
                self.dirty_bytes -= data.len() as u64;
                taken.insert(key, data);
            }
        }
        taken
    }

    /// Puts blocks from [`WriteCache::take`] back, still dirty, after their write-back failed.
    /// A block cached again since (newer data) wins over the returned copy.
    pub(crate) fn restore(&mut self, blocks: BTreeMap<(usize, u64), Box<[u8]>>) {
        for (key, data) in blocks {
            match self.blocks.entry(key) {
                std::collections::btree_map::Entry::Occupied(_) => self.spare.push(data),
                std::collections::btree_map::Entry::Vacant(slot) => {
                    self.dirty_bytes += data.len() as u64;
                    slot.insert(data);
                }
            }
        }
    }

    /// Returns a written-back block's buffer for reuse.
    pub(crate) fn recycle(&mut self, block: Box<[u8]>) {
        self.spare.push(block);
    }

    /// Power loss: everything not written back is gone.
    pub(crate) fn discard_all(&mut self) {
        self.blocks.clear();
        self.dirty_bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_discard_and_runs() {
        // Goal: newest data wins on reads, and write-back coalesces consecutive blocks.
        let mut cache = WriteCache::default();
        cache.insert(0, 10, 4, &[1, 1, 1, 1, 2, 2, 2, 2]);
        cache.insert(0, 11, 4, &[3, 3, 3, 3]);
        cache.insert(1, 12, 4, &[9, 9, 9, 9]);
        assert_eq!(cache.dirty_bytes(), 12);
        let mut buffer = [0u8; 12];
        cache.overlay(0, 9, 4, &mut buffer);
        assert_eq!(buffer, [0, 0, 0, 0, 1, 1, 1, 1, 3, 3, 3, 3]);
        let taken = cache.take(Some(0));
        assert_eq!(taken.keys().copied().collect::<Vec<_>>(), vec![(0, 10), (0, 11)]);
        assert_eq!(cache.dirty_bytes(), 4, "namespace 1 stays");
        cache.discard_range(1, 0, 100);
        assert!(cache.is_empty());
        assert_eq!(cache.dirty_bytes(), 0);
    }

    #[test]
    fn take_range_takes_only_its_blocks() {
        // Goal: a FUA Read's write-back takes the cached blocks of its range, of its namespace,
        // and leaves the rest dirty.
        let mut cache = WriteCache::default();
        cache.insert(0, 10, 4, &[1; 12]);
        cache.insert(1, 11, 4, &[2; 4]);
        let taken = cache.take_range(0, 11, 5);
        assert_eq!(taken.keys().copied().collect::<Vec<_>>(), vec![(0, 11), (0, 12)]);
        assert_eq!(cache.dirty_bytes(), 8);
        assert!(cache.holds_any(0, 10, 1) && cache.holds_any(1, 11, 1) && !cache.holds_any(0, 11, 2));
        assert!(cache.take_range(0, u64::MAX, 2).is_empty());
    }
}
