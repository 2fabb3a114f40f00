//! The slot-header region of one pool device, mirrored in DMA memory, and which of its sectors
//! changed since they were last made durable.
//!
//! The mirror only ever holds Valid entries whose data is already durable, and Empty entries,
//! so writing any of its sectors is always safe: a torn or lost header write leaves each LBA
//! either old or new, both consistent, and an entry never straddles an LBA. A sync therefore
//! writes only the sectors staged since the last one (two distant slots cost two LBAs, not the
//! span between them), as separate FUA commands in any order.

use std::time::Instant;

use nvme_driver::{DmaRegion, IoQueuePair, NamespaceId};

use super::metadata_io::write_runs_durably;
use crate::error::Result;
use crate::format::Superblock;
use crate::index::reserve;

pub(crate) struct HeaderMirror {
    region: DmaRegion,
    superblock: Superblock,
    /// Header-region LBAs (relative) staged since the last sync, each listed once; at most
    /// `header_blocks` long.
    dirty: Vec<u64>,
    /// One bit per header-region LBA: whether it is listed in `dirty`.
    dirty_bits: Vec<u64>,
    /// Per slot: whether its entry is anything but a clean Empty entry (Valid, or damaged), so
    /// that reuse must stage Empty first.
    not_empty: Vec<bool>,
}

impl HeaderMirror {
    /// A mirror over `region`, which holds the device's header region as read from it. Its
    /// bookkeeping is sized from the superblock: an allocation the host refuses is
    /// [`crate::ObjstoreError::HostMemory`], not an abort.
    pub(crate) fn new(region: DmaRegion, superblock: Superblock) -> Result<Self> {
        let (mut dirty, mut dirty_bits, mut not_empty) = (Vec::new(), Vec::new(), Vec::new());
        let header_blocks = usize::try_from(superblock.header_blocks).unwrap_or(usize::MAX);
        reserve(&mut dirty, header_blocks, "a header mirror's dirty list")?;
        reserve(&mut dirty_bits, header_blocks.div_ceil(64), "a header mirror's dirty bits")?;
        reserve(&mut not_empty, superblock.slot_count as usize, "a header mirror's slot states")?;
        dirty_bits.resize(header_blocks.div_ceil(64), 0);
        not_empty.resize(superblock.slot_count as usize, false);
        Ok(Self { region, superblock, dirty, dirty_bits, not_empty })
    }

    /// The DMA memory the header writes read from (to keep it when a write may be in flight).
    pub(crate) fn region(&self) -> &DmaRegion {
        &self.region
    }

    /// Copies slot `slot`'s entry out of the mirror (`out` is one entry long).
    pub(crate) fn read_entry(&self, slot: u32, out: &mut [u8]) -> Result<()> {
        self.region.read(self.superblock.header_offset(slot) as usize, out)?;
        Ok(())
    }

    /// Reads 4 bytes at `offset` inside slot `slot`'s entry.
    pub(crate) fn read_entry_u32(&self, slot: u32, offset: usize) -> Result<u32> {
        let mut bytes = [0u8; 4];
        self.region.read(self.superblock.header_offset(slot) as usize + offset, &mut bytes)?;
        Ok(u32::from_le_bytes(bytes))
    }

    /// Records whether slot `slot`'s entry is a clean Empty one (recovery's verdict).
    pub(crate) fn set_empty(&mut self, slot: u32, empty: bool) {
        self.not_empty[slot as usize] = !empty;
    }

    pub(crate) fn is_empty(&self, slot: u32) -> bool {
        !self.not_empty[slot as usize]
    }

    /// Writes `entry` as slot `slot`'s header in the mirror without marking its LBA dirty (at
    /// open, in place of a sector that could not be read); `empty` as in [`Self::set_empty`].
    pub(crate) fn put_unstaged(&mut self, slot: u32, entry: &[u8], empty: bool) -> Result<()> {
        self.region.write(self.superblock.header_offset(slot) as usize, entry)?;
        self.not_empty[slot as usize] = !empty;
        Ok(())
    }

    /// Writes `entry` as slot `slot`'s header in the mirror and marks its LBA dirty.
    pub(crate) fn stage(&mut self, slot: u32, entry: &[u8], empty: bool) -> Result<()> {
        let offset = self.superblock.header_offset(slot);
        self.region.write(offset as usize, entry)?;
        self.not_empty[slot as usize] = !empty;
        let lba = offset / u64::from(self.superblock.lba_bytes);
        let (word, bit) = ((lba / 64) as usize, 1u64 << (lba % 64));
        if self.dirty_bits[word] & bit == 0 {
            self.dirty_bits[word] |= bit;
            self.dirty.push(lba);
        }
        Ok(())
    }

    /// Drops the staged LBAs without writing them (a fenced device writes no header again).
    pub(crate) fn forget_dirty(&mut self) {
        for &lba in &self.dirty {
            self.dirty_bits[(lba / 64) as usize] &= !(1u64 << (lba % 64));
        }
        self.dirty.clear();
    }

    /// Whether any LBA was staged since the last sync.
    pub(crate) fn has_dirty(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// LBAs staged and not yet durable.
    #[cfg(test)]
    pub(crate) fn dirty_blocks(&self) -> usize {
        self.dirty.len()
    }

    /// Writes every dirty LBA with FUA (adjacent ones as one command) and waits: on `Ok` they
    /// are durable and nothing is dirty. On an error (one at `deadline`, however many drains the
    /// writes took) they stay dirty, for the next sync.
    pub(crate) fn sync(&mut self, queue: &mut IoQueuePair, namespace: NamespaceId, deadline: Instant) -> Result<()> {
        if self.dirty.is_empty() {
            return Ok(());
        }
        self.dirty.sort_unstable();
        let dirty = &self.dirty;
        let runs = (0..dirty.len()).filter(|&i| i == 0 || dirty[i - 1] + 1 != dirty[i]).map(|start| {
            let mut end = start + 1;
            while end < dirty.len() && dirty[end - 1] + 1 == dirty[end] {
                end += 1;
            }
            (dirty[start], dirty[end - 1] + 1)
        });
        let lba_bytes = u64::from(self.superblock.lba_bytes);
        write_runs_durably(queue, namespace, self.superblock.header_lba, &self.region, runs, lba_bytes, deadline)?;
        for &lba in &self.dirty {
            self.dirty_bits[(lba / 64) as usize] &= !(1u64 << (lba % 64));
        }
        self.dirty.clear();
        Ok(())
    }
}
