//! Segments: runs of consecutive blocks, the unit the registry names (TokenLake's argument: a
//! per-block key would multiply etcd's keys and writes by the segment size, docs/cluster.md).

use crate::error::{ClusterError, Result};
use crate::names::SegmentKey;

/// Blocks per segment, a cluster-wide setting within [`SegmentBlocks::MIN`]..=[`SegmentBlocks::MAX`].
/// Every node of a cluster must use the same value: it is recorded in each registration and a
/// lookup skips registrations made with another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentBlocks(u16);

impl SegmentBlocks {
    /// Fewer blocks per segment multiply etcd's keys and writes (docs/cluster.md).
    pub const MIN: u16 = 16;
    /// More blocks per segment lose the tail of every prompt that ends inside one.
    pub const MAX: u16 = 64;

    pub fn new(blocks: u16) -> Result<SegmentBlocks> {
        if !(Self::MIN..=Self::MAX).contains(&blocks) {
            return Err(ClusterError::InvalidSetting(format!("segment size {blocks} blocks is outside {}..={}", Self::MIN, Self::MAX)));
        }
        Ok(SegmentBlocks(blocks))
    }
    pub fn get(self) -> u16 {
        self.0
    }
}

/// One segment of a prompt: its position in the prompt's chain (0 = the first `SegmentBlocks`
/// blocks) and its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Segment {
    pub index: u32,
    pub key: SegmentKey,
}

/// The segments of a prompt whose chained block keys are `block_keys` (objstore's
/// `hash::block_keys`): segment i ends at block (i+1)·S−1 and takes that block's key. A partial
/// last segment is not a segment: it is neither registered nor looked up. Refuses a key of 0
/// (no chained hash is 0: such a list did not come from the chain).
pub fn segments_of(block_keys: &[u64], blocks: SegmentBlocks, out: &mut Vec<Segment>) -> Result<()> {
    out.clear();
    let per_segment = usize::from(blocks.get());
    for (index, run) in block_keys.chunks_exact(per_segment).enumerate() {
        let index = u32::try_from(index).map_err(|_| ClusterError::InvalidSetting("a prompt of more than 2^32 segments".into()))?;
        out.push(Segment { index, key: SegmentKey::new(run[per_segment - 1])? });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_take_the_key_of_their_last_block() {
        // Goal: segment i is named by block (i+1)·S−1's chained key; a partial tail is dropped.
        let keys: Vec<u64> = (1..=50).collect();
        let mut segments = Vec::new();
        segments_of(&keys, SegmentBlocks::new(16).unwrap(), &mut segments).unwrap();
        assert_eq!(segments.len(), 3);
        assert_eq!(segments[0], Segment { index: 0, key: SegmentKey::new(16).unwrap() });
        assert_eq!(segments[2], Segment { index: 2, key: SegmentKey::new(48).unwrap() });
        let mut zero = keys.clone();
        zero[15] = 0;
        assert!(segments_of(&zero, SegmentBlocks::new(16).unwrap(), &mut segments).is_err());
    }

    #[test]
    fn segment_size_is_bounded() {
        assert!(SegmentBlocks::new(15).is_err());
        assert!(SegmentBlocks::new(65).is_err());
        assert!(SegmentBlocks::new(32).is_ok());
    }
}
