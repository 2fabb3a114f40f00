//! Newtypes for the address spaces and identifiers the driver juggles, so they cannot be mixed.

use std::fmt;

/// A device-visible (I/O virtual) address: what goes into PRP entries and SGL descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Iova(pub u64);

impl Iova {
    /// `self + bytes`, or `None` on overflow (addresses never wrap).
    pub fn checked_add(self, bytes: u64) -> Option<Iova> {
        self.0.checked_add(bytes).map(Iova)
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
    pub fn checked_add(self, blocks: u64) -> Option<Lba> {
        self.0.checked_add(blocks).map(Lba)
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
    fn block_counts_outside_one_to_65536_do_not_exist() {
        // Goal: NLB cannot be masked: 0 and 65537 have no BlockCount, the ends of the range do.
        assert_eq!(BlockCount::new(0), None);
        assert_eq!(BlockCount::new(65537), None);
        assert_eq!(BlockCount::new(u32::MAX), None);
        assert_eq!(BlockCount::new(1).map(BlockCount::zero_based), Some(0));
        assert_eq!(BlockCount::new(65536).map(BlockCount::zero_based), Some(0xFFFF));
    }
}
