//! Newtypes for the address spaces and identifiers the driver juggles, so they cannot be mixed.
//!
//! Addresses and block numbers never wrap: arithmetic on them goes through the checked
//! operations here, which answer `None` on overflow, underflow or a zero block size, and the
//! caller turns that into its own typed error. gio-uring re-exports [`Iova`] and [`Lba`], so the
//! whole stack uses one pair.

use std::fmt;

/// A device-visible (I/O virtual) address: what goes into PRP entries and SGL descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Iova(pub u64);

impl Iova {
    /// `self + bytes`, or `None` on overflow (addresses never wrap).
    #[inline]
    pub fn checked_add(self, bytes: u64) -> Option<Iova> {
        self.0.checked_add(bytes).map(Iova)
    }

    /// `self + bytes` for an in-memory offset or length, or `None` on overflow.
    #[inline]
    pub fn checked_add_usize(self, bytes: usize) -> Option<Iova> {
        self.checked_add(u64::try_from(bytes).ok()?)
    }

    /// `self - bytes`, or `None` below address 0.
    pub fn checked_sub(self, bytes: u64) -> Option<Iova> {
        self.0.checked_sub(bytes).map(Iova)
    }

    /// How many bytes `self` lies above `base`, or `None` when it lies below it.
    pub fn checked_offset_from(self, base: Iova) -> Option<u64> {
        self.0.checked_sub(base.0)
    }

    /// The end of `len_bytes` starting here (one past the last byte), or `None` on overflow.
    #[inline]
    pub fn checked_end(self, len_bytes: u64) -> Option<Iova> {
        self.checked_add(len_bytes)
    }
}

impl fmt::Display for Iova {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "iova:{:#x}", self.0)
    }
}

/// A logical block address within one namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lba(pub u64);

impl Lba {
    /// `self + blocks`, or `None` on overflow.
    #[inline]
    pub fn checked_add(self, blocks: u64) -> Option<Lba> {
        self.0.checked_add(blocks).map(Lba)
    }

    /// `self - blocks`, or `None` below block 0.
    pub fn checked_sub(self, blocks: u64) -> Option<Lba> {
        self.0.checked_sub(blocks).map(Lba)
    }

    /// How many blocks `self` lies after `base`, or `None` when it lies before it.
    pub fn checked_blocks_from(self, base: Lba) -> Option<u64> {
        self.0.checked_sub(base.0)
    }

    /// The block holding byte `offset_bytes` when it is a whole number of blocks of
    /// `block_size_bytes`; `None` for a zero block size or an offset inside a block.
    pub fn from_byte_offset(offset_bytes: u64, block_size_bytes: u64) -> Option<Lba> {
        if block_size_bytes == 0 || !offset_bytes.is_multiple_of(block_size_bytes) {
            return None;
        }
        Some(Lba(offset_bytes / block_size_bytes))
    }

    /// The byte offset of this block, or `None` on overflow.
    pub fn checked_byte_offset(self, block_size_bytes: u64) -> Option<u64> {
        self.0.checked_mul(block_size_bytes)
    }
}

impl fmt::Display for Lba {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lba:{}", self.0)
    }
}

/// How many logical blocks one Read, Write or Write Zeroes moves: 1..=65536, because NLB
/// (CDW12 bits 15:0, NVM §3.2.4) is a 16-bit 0's based field. The only way to build one is
/// [`BlockCount::new`], so a command constructor can never mask a larger count into a smaller
/// one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockCount(u32);

impl BlockCount {
    /// The largest count one command carries.
    pub const MAX: u32 = 65536;
    /// One block.
    pub const ONE: BlockCount = BlockCount(1);

    /// `blocks` if it is in 1..=[`BlockCount::MAX`], `None` otherwise.
    pub const fn new(blocks: u32) -> Option<Self> {
        if blocks >= 1 && blocks <= Self::MAX {
            Some(Self(blocks))
        } else {
            None
        }
    }

    /// The count (1..=65536).
    pub const fn get(self) -> u32 {
        self.0
    }

    /// NLB as the command carries it: the count minus one, which always fits 16 bits.
    pub const fn zero_based(self) -> u16 {
        (self.0 - 1) as u16
    }
}

impl fmt::Display for BlockCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} blocks", self.0)
    }
}

/// A queue identifier (0 is the admin queue pair).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QueueId(pub u16);

impl fmt::Display for QueueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "q{}", self.0)
    }
}

/// A command identifier as written in CDW0 and echoed in the completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CommandId(pub u16);

impl fmt::Display for CommandId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cid:{:#06x}", self.0)
    }
}

/// A namespace identifier (1-based; 0 and 0xFFFF_FFFF are special in the spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamespaceId(pub u32);

impl fmt::Display for NamespaceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "nsid:{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iova_arithmetic_is_checked() {
        // Goal: every Iova operation answers None instead of wrapping at either end.
        let base = Iova(0x1000);
        assert_eq!(base.checked_add(0x20), Some(Iova(0x1020)));
        assert_eq!(Iova(u64::MAX).checked_add(1), None);
        assert_eq!(base.checked_add_usize(4096), Some(Iova(0x2000)));
        assert_eq!(Iova(u64::MAX - 1).checked_add_usize(2), None);
        assert_eq!(base.checked_sub(0x1000), Some(Iova(0)));
        assert_eq!(base.checked_sub(0x1001), None);
        assert_eq!(Iova(0x1800).checked_offset_from(base), Some(0x800));
        assert_eq!(base.checked_offset_from(Iova(0x1800)), None);
        assert_eq!(base.checked_end(0x1000), Some(Iova(0x2000)));
        assert_eq!(Iova(u64::MAX).checked_end(1), None);
        assert_eq!(Iova(u64::MAX).checked_end(0), Some(Iova(u64::MAX)));
    }

    #[test]
    fn lba_arithmetic_is_checked() {
        // Goal: block arithmetic never wraps, and byte offsets convert only when exact.
        assert_eq!(Lba(7).checked_add(3), Some(Lba(10)));
        assert_eq!(Lba(u64::MAX).checked_add(1), None);
        assert_eq!(Lba(7).checked_sub(7), Some(Lba(0)));
        assert_eq!(Lba(7).checked_sub(8), None);
        assert_eq!(Lba(10).checked_blocks_from(Lba(4)), Some(6));
        assert_eq!(Lba(4).checked_blocks_from(Lba(10)), None);
        assert_eq!(Lba::from_byte_offset(8192, 4096), Some(Lba(2)));
        assert_eq!(Lba::from_byte_offset(8193, 4096), None);
        assert_eq!(Lba::from_byte_offset(512, 0), None);
        assert_eq!(Lba(3).checked_byte_offset(512), Some(1536));
        assert_eq!(Lba(u64::MAX / 2).checked_byte_offset(4), None);
    }

    #[test]
    fn block_counts_outside_one_to_65536_do_not_exist() {
        // Goal: NLB cannot be masked: 0 and 65537 have no BlockCount, the ends of the range do.
        assert_eq!(BlockCount::new(0), None);
        assert_eq!(BlockCount::new(65537), None);
        assert_eq!(BlockCount::new(u32::MAX), None);
        assert_eq!(BlockCount::new(1).map(BlockCount::zero_based), Some(0));
        assert_eq!(BlockCount::new(65536).map(BlockCount::zero_based), Some(0xFFFF));
    }
}
