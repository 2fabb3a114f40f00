//! Metadata commands of a pool device (superblock, slot headers, payload checks): synchronous,
//! bounded by a deadline, in pieces a small-MDTS controller and a shallow queue both take.

use std::time::{Duration, Instant};

use gio_uring::LENT_COMMAND_TAG;
use nvme_driver::{Controller, DataSegment, DmaRegion, HwError, IoQueuePair, Lba, NamespaceId, NvmeError};

use crate::error::{ObjstoreError, Result};

/// The tag of every metadata command: it names no IOCB (the executor checks for it before
/// decoding a tag, whatever the pool's depth), so on a queue pair lent by an executor a late
/// completion of ours can never be counted for an IOCTX.
const METADATA_TAG: u64 = LENT_COMMAND_TAG;

/// Depth of a metadata queue pair (a pool device's own, or a temporary one), on a controller
/// whose CAP.MQES allows it (see `create_metadata_queue`).
pub const METADATA_QUEUE_DEPTH: u32 = 64;
/// Metadata moves in pieces of at most this size (each piece is one submit + wait).
pub(crate) const METADATA_CHUNK_BYTES: u64 = 1 << 20;
/// Commands one piece may need, at most: the driver refuses a transfer that needs more commands
/// than the queue has free slots (it does not wait), so a piece is also capped at what an idle
/// queue of the given depth takes (depth − 1: a lent executor queue may be as shallow as 2).
const COMMANDS_PER_PIECE_MAX: u64 = 16;

/// A metadata queue pair on `controller`: [`METADATA_QUEUE_DEPTH`] deep, or as deep as its
/// CAP.MQES allows if that is less (a fixed depth would refuse such a controller outright).
pub(crate) fn create_metadata_queue(controller: &Controller) -> Result<IoQueuePair> {
    Ok(controller.create_io_queue_pair(METADATA_QUEUE_DEPTH.min(controller.max_queue_depth()))?)
}

/// Which way `transfer_region` moves data.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Transfer {
    Read,
    Write { force_unit_access: bool },
}

/// Bytes one piece of a metadata transfer moves on `queue`: at most [`METADATA_CHUNK_BYTES`],
/// and few enough commands under the controller's MDTS for the idle queue to take them all, in
/// whole LBAs.
fn piece_bytes_max(queue: &IoQueuePair, lba_bytes: u64) -> u64 {
    let commands = COMMANDS_PER_PIECE_MAX.min(u64::from(queue.depth().saturating_sub(1)).max(1));
    let by_commands = queue.max_transfer_bytes().saturating_mul(commands);
    (by_commands.min(METADATA_CHUNK_BYTES) / lba_bytes).max(1) * lba_bytes
}

/// The segment of `len_bytes` at `offset_bytes` of `region`, bounds-checked: a metadata
/// transfer never points the controller at memory outside the region it was given.
fn segment_of(region: &DmaRegion, offset_bytes: u64, len_bytes: u64) -> Result<[DataSegment; 1]> {
    // A value past usize lies past any region: clamped, subregion refuses it.
    let offset = usize::try_from(offset_bytes).unwrap_or(usize::MAX);
    let len = usize::try_from(len_bytes).unwrap_or(usize::MAX);
    let window = region.subregion(offset, len)?;
    // Pieces are at most METADATA_CHUNK_BYTES; a segment carries at most u32::MAX bytes.
    let len = u32::try_from(len_bytes).map_err(|_| HwError::OutOfRange { offset, access_len: len, region_len: region.len() })?;
    Ok([DataSegment::new(window.iova(), len)])
}

/// `first + blocks`, or [`ObjstoreError::AddressOverflow`] naming the metadata transfer.
fn lba_after(first: u64, blocks: u64) -> Result<Lba> {
    Lba(first).checked_add(blocks).ok_or_else(|| ObjstoreError::AddressOverflow { what: format!("metadata LBA {first} + {blocks} blocks") })
}

/// Moves `len` bytes between `region` (from `offset`) and the namespace at `lba` (relative LBAs
/// computed by the caller), piece by piece; a range outside `region` is refused
/// ([`HwError::OutOfRange`]) before anything is submitted.
#[allow(clippy::too_many_arguments)]
pub(crate) fn transfer_region(
    queue: &mut IoQueuePair,
    namespace: NamespaceId,
    lba: u64,
    region: &DmaRegion,
    offset: u64,
    len: u64,
    lba_bytes: u64,
    transfer: Transfer,
    timeout: Duration,
) -> Result<()> {
    let piece_max = piece_bytes_max(queue, lba_bytes);
    let mut done = 0;
    while done < len {
        let piece = (len - done).min(piece_max);
        let at = offset
            .checked_add(done)
            .ok_or_else(|| ObjstoreError::AddressOverflow { what: format!("metadata offset {offset} + {done}") })?;
        let segment = segment_of(region, at, piece)?;
        let start = lba_after(lba, done / lba_bytes)?;
        match transfer {
            Transfer::Read => queue.submit_read(namespace, start, &segment, METADATA_TAG),
            Transfer::Write { force_unit_access } => queue.submit_write(namespace, start, &segment, force_unit_access, METADATA_TAG),
        }?;
        queue.complete_all(timeout)?;
        done += piece;
    }
    Ok(())
}

/// Writes the runs `[first, end)` of LBAs of `region` (relative to `base_lba`, region offset =
/// relative LBA × `lba_bytes`) with FUA, several commands in flight at once, and waits for all
/// of them: on `Ok` every run is durable. Used for the dirty sectors of a header mirror.
///
/// Every wait (each drain of a full queue, and the last one) ends at `deadline`: more runs
/// than the queue holds take several drains, and each getting a fresh timeout would wait a
/// multiple of what the caller allowed. At `deadline` with commands in flight, the drain fails
/// with [`NvmeError::Timeout`] (the caller retires the pair).
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_runs_durably(
    queue: &mut IoQueuePair,
    namespace: NamespaceId,
    base_lba: u64,
    region: &DmaRegion,
    runs: impl Iterator<Item = (u64, u64)>,
    lba_bytes: u64,
    deadline: Instant,
) -> Result<()> {
    let piece_max = piece_bytes_max(queue, lba_bytes) / lba_bytes;
    for (first, end) in runs {
        let mut at = first;
        while at < end {
            let blocks = (end - at).min(piece_max);
            let offset = at
                .checked_mul(lba_bytes)
                .ok_or_else(|| ObjstoreError::AddressOverflow { what: format!("metadata LBA {at} of {lba_bytes} bytes") })?;
            let segment = segment_of(region, offset, blocks * lba_bytes)?;
            let start = lba_after(base_lba, at)?;
            // A full queue refuses before submitting anything: drain it, then submit again.
            match queue.submit_write(namespace, start, &segment, true, METADATA_TAG) {
                Err(NvmeError::QueueFull { .. }) => {
                    queue.complete_all(deadline.saturating_duration_since(Instant::now()))?;
                    queue.submit_write(namespace, start, &segment, true, METADATA_TAG)?;
                }
                other => {
                    other?;
                }
            }
            at += blocks;
        }
    }
    queue.complete_all(deadline.saturating_duration_since(Instant::now()))?;
    Ok(())
}

/// Flushes the namespace's volatile write cache and waits.
pub(crate) fn flush(queue: &mut IoQueuePair, namespace: NamespaceId, timeout: Duration) -> Result<()> {
    queue.submit_flush(namespace, METADATA_TAG)?;
    queue.complete_all(timeout)?;
    Ok(())
}
