//! The daemon's prepare replies checked against the request they answer, before the data half
//! prepares anything: the placements say which engine blocks the devices read from or write
//! into, so a reply naming a block the request did not (another sequence's KV memory), or
//! fewer blocks than asked (some left unfilled by a retrieve that reports success), would have
//! this process's DMA go wrong. What the daemon promises (`Session::prepare_retrieve` and
//! `prepare_store`, objstore's `reserve_retrieve` and `reserve_store`):
//!
//! - a retrieve reads every requested block: one placement per block id, in the request's
//!   order, and one recorded CRC per placement when the pool records them;
//! - a store's blocks are new or shared (cached, or in flight elsewhere): new + shared is the
//!   request's block count, and the new blocks' placements follow the request's order (each
//!   the next block id it names from there on).

use crate::protocol::{RetrievePrepared, StorePrepared};

/// Why `prepared` cannot answer a retrieve of `block_ids`, if it cannot.
pub(super) fn check_retrieve(block_ids: &[u32], prepared: &RetrievePrepared) -> Result<(), String> {
    let placements = &prepared.placements;
    if placements.len() != block_ids.len() {
        return Err(format!("{} retrieve placements for {} requested blocks", placements.len(), block_ids.len()));
    }
    if let Some((position, (placement, &asked))) =
        placements.iter().zip(block_ids).enumerate().find(|(_, (placement, &asked))| placement.engine_block != asked)
    {
        return Err(format!("retrieve placement {position} reads into engine block {}; the request named {asked}", placement.engine_block));
    }
    if let Some(crcs) = &prepared.expected_crcs {
        if crcs.len() != placements.len() {
            return Err(format!("{} recorded CRCs for {} retrieve placements", crcs.len(), placements.len()));
        }
    }
    Ok(())
}

/// Why `prepared` cannot answer a store of `block_ids`, if it cannot.
pub(super) fn check_store(block_ids: &[u32], prepared: &StorePrepared) -> Result<(), String> {
    let (new, shared) = (u64::from(prepared.new_blocks), u64::from(prepared.shared_blocks));
    if new + shared != block_ids.len() as u64 {
        return Err(format!("{new} new and {shared} shared blocks for {} requested blocks", block_ids.len()));
    }
    if prepared.placements.len() as u64 != new {
        return Err(format!("{} placements for {new} new blocks", prepared.placements.len()));
    }
    // Each placement takes the next block id equal to its engine block: the new blocks are
    // the request's in its order, none twice, none the request did not name.
    let mut remaining = block_ids.iter();
    for (position, placement) in prepared.placements.iter().enumerate() {
        if !remaining.any(|&asked| asked == placement.engine_block) {
            return Err(format!(
                "store placement {position} writes from engine block {}, which the request does not name (in its order, after the \
                 placements before it)",
                placement.engine_block
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use objstore::{BlockLocation, Placement};

    fn placements(engine_blocks: &[u32]) -> Vec<Placement> {
        engine_blocks
            .iter()
            .enumerate()
            .map(|(slot, &engine_block)| Placement { location: BlockLocation { device: 0, slot: slot as u32, index: 0 }, engine_block })
            .collect()
    }

    #[test]
    fn a_retrieve_reads_every_requested_block_in_order() {
        // Goal: only one placement per requested block, in the request's order, with as many
        // CRCs as placements when there are CRCs, answers a retrieve.
        let retrieve = |engine_blocks: &[u32], expected_crcs: Option<Vec<u32>>| RetrievePrepared {
            handle: 1,
            placements: placements(engine_blocks),
            expected_crcs,
        };
        assert_eq!(check_retrieve(&[4, 5, 6], &retrieve(&[4, 5, 6], None)), Ok(()));
        assert_eq!(check_retrieve(&[4, 5, 6], &retrieve(&[4, 5, 6], Some(vec![1, 2, 3]))), Ok(()));
        assert!(check_retrieve(&[4, 5, 6], &retrieve(&[4, 5], None)).is_err(), "fewer");
        assert!(check_retrieve(&[4, 5, 6], &retrieve(&[4, 5, 6, 7], None)).is_err(), "more");
        assert!(check_retrieve(&[4, 5, 6], &retrieve(&[4, 0, 6], None)).is_err(), "another block");
        assert!(check_retrieve(&[4, 5, 6], &retrieve(&[5, 4, 6], None)).is_err(), "another order");
        assert!(check_retrieve(&[4, 5, 6], &retrieve(&[4, 5, 6], Some(vec![1]))).is_err(), "CRCs");
    }

    #[test]
    fn a_stores_new_blocks_follow_the_request() {
        // Goal: new + shared must be the request's blocks, one placement per new block, each
        // a block id of the request in its order (none twice beyond the request's own).
        let store = |new_blocks: u32, shared_blocks: u32, engine_blocks: &[u32]| StorePrepared {
            handle: 1,
            new_blocks,
            shared_blocks,
            evicted_slots: 0,
            placements: placements(engine_blocks),
        };
        assert_eq!(check_store(&[0, 1, 2, 3], &store(4, 0, &[0, 1, 2, 3])), Ok(()));
        assert_eq!(check_store(&[0, 1, 2, 3], &store(2, 2, &[1, 3])), Ok(()));
        assert_eq!(check_store(&[0, 1, 2, 3], &store(0, 4, &[])), Ok(()));
        assert_eq!(check_store(&[7, 7], &store(2, 0, &[7, 7])), Ok(()));
        assert!(check_store(&[0, 1, 2, 3], &store(4, 1, &[0, 1, 2, 3])).is_err(), "five for four");
        assert!(check_store(&[0, 1, 2, 3], &store(3, 0, &[0, 1, 2])).is_err(), "three for four");
        assert!(check_store(&[0, 1, 2, 3], &store(2, 2, &[1])).is_err(), "placements for new blocks");
        assert!(check_store(&[0, 1, 2, 3], &store(2, 2, &[1, 6])).is_err(), "a block not named");
        assert!(check_store(&[0, 1, 2, 3], &store(2, 2, &[3, 1])).is_err(), "out of order");
        assert!(check_store(&[0, 1, 2, 3], &store(2, 2, &[1, 1])).is_err(), "twice");
        assert!(check_store(&[0], &store(u32::MAX, u32::MAX, &[])).is_err(), "counts past u32");
    }
}
