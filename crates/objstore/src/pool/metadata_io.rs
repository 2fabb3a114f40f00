//! Metadata commands of a pool device (superblock, slot headers, payload checks): synchronous,
//! bounded by a deadline, in pieces a small-MDTS controller and a shallow queue both take.

use std::time::Duration;

use gio_uring::LENT_COMMAND_TAG;
use nvme_driver::{DataSegment, DmaRegion, IoQueuePair, Iova, Lba, NamespaceId, NvmeError};

use crate::error::Result;

/// The tag of every metadata command: it names no IOCB, so on a queue pair lent by an executor
/// a late completion of ours can never be counted for an IOCTX.
const METADATA_TAG: u64 = LENT_COMMAND_TAG;

/// Depth of a metadata queue pair (a pool device's own, or a temporary one).
pub const METADATA_QUEUE_DEPTH: u32 = 64;
/// Metadata moves in pieces of at most this size (each piece is one submit + wait).
pub(crate) const METADATA_CHUNK_BYTES: u64 = 1 << 20;
/// Commands one piece may need: well below any queue depth the pool uses (the driver refuses a
/// transfer that needs more commands than the queue has free slots, it does not wait).
const COMMANDS_PER_PIECE_MAX: u64 = 16;

/// Which way `transfer_region` moves data.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Transfer {
    Read,
    Write { force_unit_access: bool },
}

/// Bytes one piece of a metadata transfer moves on `queue`: at most [`METADATA_CHUNK_BYTES`],
/// and few enough commands under the controller's MDTS, in whole LBAs.
fn piece_bytes_max(queue: &IoQueuePair, lba_bytes: u64) -> u64 {
    let by_commands = queue.max_transfer_bytes().saturating_mul(COMMANDS_PER_PIECE_MAX);
    (by_commands.min(METADATA_CHUNK_BYTES) / lba_bytes).max(1) * lba_bytes
}

/// Moves `len` bytes between `region` (from `offset`) and the namespace at `lba` (relative LBAs
/// computed by the caller), piece by piece.
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
        let segment = [DataSegment::new(Iova(region.iova().0 + offset + done), piece as u32)];
        let start = Lba(lba + done / lba_bytes);
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
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_runs_durably(
    queue: &mut IoQueuePair,
    namespace: NamespaceId,
    base_lba: u64,
    region: &DmaRegion,
    runs: impl Iterator<Item = (u64, u64)>,
    lba_bytes: u64,
    timeout: Duration,
) -> Result<()> {
    let piece_max = piece_bytes_max(queue, lba_bytes) / lba_bytes;
    for (first, end) in runs {
        let mut at = first;
        while at < end {
            let blocks = (end - at).min(piece_max);
            let segment = [DataSegment::new(Iova(region.iova().0 + at * lba_bytes), (blocks * lba_bytes) as u32)];
            let start = Lba(base_lba + at);
            // A full queue refuses before submitting anything: drain it, then submit again.
            match queue.submit_write(namespace, start, &segment, true, METADATA_TAG) {
                Err(NvmeError::QueueFull { .. }) => {
                    queue.complete_all(timeout)?;
                    queue.submit_write(namespace, start, &segment, true, METADATA_TAG)?;
                }
                other => {
                    other?;
                }
            }
            at += blocks;
        }
    }
    queue.complete_all(timeout)?;
    Ok(())
}

/// Flushes the namespace's volatile write cache and waits.
pub(crate) fn flush(queue: &mut IoQueuePair, namespace: NamespaceId, timeout: Duration) -> Result<()> {
    queue.submit_flush(namespace, METADATA_TAG)?;
    queue.complete_all(timeout)?;
    Ok(())
}
