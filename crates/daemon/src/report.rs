//! A client's report on its own request, checked before the daemon acts on it.
//!
//! The per-layer path does not go through the daemon (docs/tuttid.md, "Process model"), so the
//! daemon learns what a request moved, and whether its verification failed, from the client:
//! `Commit` and `Release` carry what the client's data half moved (`StoreData::transferred`),
//! and `Release` the blocks its verified retrieve found corrupt (`StoreData::mismatched_blocks`).
//! Both are untrusted. A report the request's grant does not cover is refused with
//! [`ErrorCode::BadReport`] before anything changes (nothing counted, nothing evicted, the
//! request kept), so the refusal is counted in `tuttid_errors_total` like any other:
//! - what it moved: at most every layer of the request's placements once, and per command
//!   at least one LBA and at most one MDTS ([`objstore::Transferred::fits`] against
//!   `PoolShape::transfer_bound` and `PoolShape::command_bytes`); a store's commit, exactly
//!   every layer once (its blocks become visible);
//! - corrupt blocks: only of a retrieve, on a pool that records payload CRCs (else nothing
//!   could have been verified), each one of that retrieve's own placements (position, device,
//!   slot and engine block as granted), with a computed CRC other than the expected one.
//!
//! What is not checked: that a block the client did retrieve really is corrupt (the daemon
//! would have to read it again). A client can evict good blocks it retrieved; it is trusted
//! as much as the daemon anyway (the IOMMU trust boundary, docs/tuttid.md).

use objstore::{Direction, MismatchedBlock, NoLender, ObjstoreError, PoolShape, RequestHandle, StoreControl, Transferred};

use crate::protocol::ErrorCode;

/// A refused request: the code and the sentence of its `Error` reply.
pub(crate) type Refusal = (ErrorCode, String);

fn bad_report(message: String) -> Refusal {
    (ErrorCode::BadReport, message)
}

/// What a report comes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reported {
    /// A `Commit`: a store's blocks become visible, so it must report every layer of every new
    /// block moved (a report of less — layers skipped, nothing at all — would make slots
    /// nobody wrote answer lookups).
    Commit,
    Release,
}

/// Checks what a client says its request `handle` moved against the request's grant; returns
/// the request's direction (the metric's label).
pub(crate) fn check_transferred(
    control: &StoreControl,
    shape: &PoolShape,
    handle: RequestHandle,
    transferred: Transferred,
    reported: Reported,
) -> Result<Direction, Refusal> {
    let unknown = |error: ObjstoreError| (ErrorCode::NotYours, format!("request {:#x}: {error}", handle.to_bits()));
    let direction = control.direction(handle).map_err(unknown)?;
    let placements = control.placements(handle).map_err(unknown)?;
    let bound = shape.transfer_bound(placements);
    let per_command = shape.command_bytes();
    if !transferred.fits(bound, per_command.clone()) {
        return Err(bad_report(format!(
            "request {:#x} ({direction:?} of {} blocks) reported {} bytes in {} commands: its placements cover at most {} bytes \
             in {} commands, each moving {}..={} bytes",
            handle.to_bits(),
            placements.len(),
            transferred.bytes,
            transferred.commands,
            bound.bytes,
            bound.commands,
            per_command.start(),
            per_command.end()
        )));
    }
    if reported == Reported::Commit && direction == Direction::Store && transferred.bytes < bound.bytes {
        return Err(bad_report(format!(
            "request {:#x} commits {} new blocks but reported moving {} of their {} bytes: every layer is stored before a commit",
            handle.to_bits(),
            placements.len(),
            transferred.bytes,
            bound.bytes
        )));
    }
    Ok(direction)
}

/// Checks the blocks a client says its retrieve `handle` found corrupt (module docs), then
/// evicts their slots: out of the index at once, headers made Empty on disk (best effort: an
/// entry whose write fails stays staged for the next sync; on a fenced device it is never
/// written, so the block comes back at reopen, where a retrieve catches it again only if the
/// pool records payload CRCs and the store verifies retrieves, `verify_retrieves`, off by default).
pub(crate) fn evict_corrupt(control: &mut StoreControl, handle: RequestHandle, blocks: &[MismatchedBlock]) -> Result<(), Refusal> {
    let request = handle.to_bits();
    if control.direction(handle).ok() != Some(Direction::Retrieve) {
        return Err(bad_report(format!("request {request:#x} is not a retrieve: it verified no block")));
    }
    if !control.records_payload_crcs() {
        return Err(bad_report("the pool records no payload CRCs: no retrieve can have found a block corrupt".into()));
    }
    let placements = control.placements(handle).map_err(|error| (ErrorCode::NotYours, error.to_string()))?;
    for block in blocks {
        let granted = placements.get(block.position);
        let matches = granted.is_some_and(|placement| {
            (placement.location.device, placement.location.slot, placement.engine_block) == (block.device, block.slot, block.engine_block)
        });
        if !matches || block.computed_crc == block.expected_crc {
            return Err(bad_report(format!(
                "request {request:#x} did not retrieve {block} as reported (its {} placements: {:?})",
                placements.len(),
                granted
            )));
        }
    }
    // Every block was checked above; the store checks them again before it evicts anything.
    control.evict_mismatched(handle, blocks, &mut NoLender).map_err(|error| match error {
        ObjstoreError::BadPlacement { .. } => bad_report(error.to_string()),
        other => (ErrorCode::StoreFailed, format!("evicting the corrupt blocks: {other}")),
    })
}
