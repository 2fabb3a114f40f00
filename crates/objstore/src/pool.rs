//! A pool on its devices: format, open with recovery, the slot-header mirror and its durable
//! writes, and the offline check.
//!
//! Metadata goes through one NVMe queue pair per device owned here (data goes through gio_uring),
//! or, on a controller that granted too few I/O queue pairs for that (fewer than two per pool
//! device on it), through the executor's queue pair, lent between commands (`QueueLender`).
//! Each device's header region is mirrored in DMA memory (`mirror`): the mirror only ever holds
//! Valid entries whose data is already durable, and Empty entries, so writing any of its sectors
//! is always safe, and a sync writes only the sectors that changed.

mod metadata_io;
mod metadata_queue;
mod mirror;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::{Controller, DmaRegion, IoQueuePair, NamespaceId, NvmeError};

pub use metadata_io::METADATA_QUEUE_DEPTH;
use metadata_io::{create_metadata_queue, transfer_region, Transfer, METADATA_CHUNK_BYTES};
use mirror::HeaderMirror;

use crate::error::{ObjstoreError, Result};
use crate::format::{
    encode_empty_entry, encode_entry, pool_tag, HeaderVerdict, SlotHeader, SlotState, Superblock, FLAG_PAYLOAD_CRC, GENERATION_MAX,
    HEADER_FLAG_PAYLOAD_CRC, SUPERBLOCK_REGION_BYTES,
};
use crate::geometry::ModelGeometry;
use crate::hash::KeySecret;
use crate::index::Index;

/// Deadline of each metadata command batch. On a device whose metadata borrows the executor's
/// queue pair, the lend before it waits up to as long again for the executor's commands on the
/// pair (a header sync or flush with no caller's deadline may take up to twice this there).
pub const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// One namespace offered to a pool.
#[derive(Clone)]
pub struct PoolTarget {
    pub controller: Arc<Controller>,
    pub namespace: NamespaceId,
}

impl std::fmt::Debug for PoolTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.controller.backend().name(), self.namespace)
    }
}

/// Lends an executor's NVMe queue pair for the metadata commands of a pool device whose
/// controller granted too few I/O queue pairs for the pool to keep its own (see
/// `gio_uring::Executor::lend_queue_pair`): the queue pair serving pool device `device`, idle,
/// or `None` if the executor cannot lend.
///
/// The in-process store's gio_uring queue implements it; a caller with no executor (tuttid,
/// offline tools) passes [`NoLender`].
pub trait QueueLender {
    fn lend(&mut self, device: usize, deadline: Instant) -> Result<Option<&mut IoQueuePair>>;

    /// Whether [`Self::lend`] would lend a queue pair for `device`, known without waiting:
    /// `Some(true)` it would (once the executor's commands on it have ended), `Some(false)` it
    /// never does (the pool makes a temporary queue pair instead), `None` (the default) it does
    /// not say. A metadata call whose caller's deadline leaves less than the whole metadata
    /// timeout cannot use a lent pair (a timeout there fences the device), so with `Some` it
    /// skips the lend, which could wait until that deadline for the executor's other layers
    /// only to give a pair it cannot use; with `None` it lends to find out.
    fn lends(&self, device: usize) -> Option<bool> {
        let _ = device;
        None
    }
}

/// No executor to borrow from (offline use, a daemon): on a device without a metadata queue
/// pair of its own, the pool creates a temporary one per metadata call.
pub struct NoLender;

impl QueueLender for NoLender {
    fn lend(&mut self, _device: usize, _deadline: Instant) -> Result<Option<&mut IoQueuePair>> {
        Ok(None)
    }

    fn lends(&self, _device: usize) -> Option<bool> {
        Some(false)
    }
}

/// Parameters of `format`.
#[derive(Debug, Clone)]
pub struct FormatParams {
    pub geometry: ModelGeometry,
    /// k: engine blocks per slot (1 = one GPU file per slot).
    pub blocks_per_slot: u32,
    /// Cap on slots per device (`None`: as many as fit).
    pub slot_count_max: Option<u64>,
    /// `None`: a fresh one.
    pub pool_uuid: Option<[u8; 16]>,
    /// Record a CRC32 of each slot's payload at commit (read back from host-visible KV memory),
    /// verified by `check --payload`.
    pub payload_crc: bool,
    /// The pool's key secret, written to every device (`None`: a fresh random one,
    /// [`KeySecret::random`]). Nodes of a cluster share one, or find none of each other's blocks.
    pub key_secret: Option<KeySecret>,
}

impl FormatParams {
    /// One block per slot, as many slots as fit, a fresh pool UUID, no payload CRC and a fresh
    /// random key secret: change the fields that differ (`FormatParams { payload_crc: true,
    /// ..FormatParams::new(geometry) }`).
    pub fn new(geometry: ModelGeometry) -> Self {
        Self { geometry, blocks_per_slot: 1, slot_count_max: None, pool_uuid: None, payload_crc: false, key_secret: None }
    }

    /// The superblock these parameters give device `device_index` of `device_count` on a
    /// namespace of `size_blocks` LBAs of `lba_bytes`, in the pool `pool_uuid` of `key_secret`.
    fn plan_device(
        &self,
        lba_bytes: u32,
        size_blocks: u64,
        device_index: u32,
        device_count: u32,
        pool_uuid: [u8; 16],
        key_secret: KeySecret,
    ) -> Result<Superblock> {
        let flags = if self.payload_crc { FLAG_PAYLOAD_CRC } else { 0 };
        Superblock::plan(
            self.geometry,
            self.blocks_per_slot,
            lba_bytes,
            size_blocks,
            self.slot_count_max,
            pool_uuid,
            device_index,
            device_count,
            flags,
            key_secret,
        )
    }

    /// The layout [`format_pool`] would plan for device `device_index` of `device_count` on a
    /// namespace of `size_blocks` LBAs of `lba_bytes` (slot count, header and data LBAs), or its
    /// error, without writing anything: for sizing or checking a device before formatting it.
    /// Neither the pool UUID nor the secret changes a layout, so the superblock returned has a
    /// zero UUID and the secret given, or, when none is (`format_pool` would draw a random one),
    /// a fixed stand-in that is never written: planning reads no random source.
    pub fn plan_layout(&self, lba_bytes: u32, size_blocks: u64, device_index: u32, device_count: u32) -> Result<Superblock> {
        const LAYOUT_ONLY_SECRET: [u8; crate::hash::KEY_SECRET_BYTES] = [1; crate::hash::KEY_SECRET_BYTES];
        let secret = match self.key_secret {
            Some(secret) => secret,
            None => KeySecret::from_bytes(LAYOUT_ONLY_SECRET)?,
        };
        self.plan_device(lba_bytes, size_blocks, device_index, device_count, [0; 16], secret)
    }
}

/// What `open` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecoveryReport {
    pub devices: usize,
    pub slots: u64,
    pub valid_slots: u64,
    pub empty_slots: u64,
    /// Headers whose CRC, pool tag, slot number or contents were wrong: their slots are free.
    /// Includes the zeroed ones.
    pub corrupt_headers: u64,
    /// Of the corrupt headers, those that were all zeroes: a zeroed (or deallocated) header
    /// region. Every slot has a tagged entry from format on, so these are damage, and the
    /// blocks they recorded, if any, are lost.
    pub zeroed_headers: u64,
    /// Of the corrupt headers, those in header LBAs that could not be read at open (the
    /// device answered the read with an error status): their slots are free, their blocks, if
    /// any, are not served.
    pub unreadable_headers: u64,
    /// Slots whose every key another, newer slot also holds: freed. (A slot only some of
    /// whose keys a newer slot holds keeps serving the others: each key is served by its
    /// newest copy.)
    pub duplicate_slots: u64,
    pub cached_blocks: u64,
}

/// Dropping it deletes the queue pair first, while its controller (kept alive by `target`) still
/// runs; if that fails with a command in flight, or the device was fenced, the mirror and
/// scratch buffer a command may still use are leaked ([`crate::leak`]) instead of freed.
pub(crate) struct PoolDevice {
    /// The device's own metadata queue pair (when `own_queue`; `None` for a moment after a
    /// failure deleted it, made again at the next use).
    pub(crate) queue: Option<IoQueuePair>,
    /// Whether the device keeps a metadata queue pair of its own; otherwise its controller
    /// granted too few and metadata borrows the executor's (`QueueLender`).
    own_queue: bool,
    /// Why the device is fenced (see `metadata_queue`): no header writes until reopened.
    fence: Option<String>,
    /// Fenced with nothing of it in flight (header writes that kept failing with an error
    /// status): its mirror and scratch need not be leaked.
    fence_idle: bool,
    /// Header syncs of this device that failed in a row (reset by one that succeeds).
    header_sync_failures: u32,
    /// Cache flushes of this device that failed in a row (reset by one that succeeds).
    flush_failures: u32,
    /// The mirror and scratch were leaked already (with a queue pair that was not deleted).
    buffers_leaked: bool,
    pub(crate) target: PoolTarget,
    pub(crate) superblock: Superblock,
    mirror: HeaderMirror,
    /// A DMA buffer for payload checks and superblock I/O.
    scratch: DmaRegion,
    /// One header entry (`superblock.header_entry_bytes`, up to one LBA), encoded here before
    /// it is staged in the mirror: sized from the superblock at open, so no entry the format
    /// allows is too big for it, and no store allocates one.
    entry: Vec<u8>,
}

impl Drop for PoolDevice {
    fn drop(&mut self) {
        if let Some(queue) = self.queue.take() {
            if crate::leak::retire_queue_pair(queue, &[self.mirror.region(), &self.scratch]).is_err() {
                self.buffers_leaked = true;
            }
        }
        if self.fence.is_some() && !self.fence_idle && !self.buffers_leaked {
            // Fenced on a queue pair the pool could not delete: a late command may still read them.
            crate::leak::leak_regions(&[self.mirror.region(), &self.scratch], "a fenced pool device's header mirror and scratch");
        }
    }
}

impl Drop for Pool {
    /// Writes the header sectors still staged (the Empty entries of an eviction whose `wait`
    /// left no time for them, or whose write failed) before the devices are let go: a clean
    /// shutdown with no commit or sync since must not bring condemned blocks back at the next
    /// open. Best effort, the header writes bounded by one metadata timeout for all devices
    /// together (a temporary queue pair's create and delete by the admin timeout each, on top),
    /// with no executor to borrow from ([`NoLender`]: a device whose metadata borrowed one gets a
    /// temporary queue pair, the executor's being retired by then); a device whose controller
    /// reads fatal, not ready or gone is not written; a failure is logged.
    fn drop(&mut self) {
        self.sync_staged_at_end(&mut NoLender);
    }
}

/// Header syncs (or, counted apart, cache flushes) of one device that may fail in a row (the
/// device answering them with an error status, or not within the metadata timeout) before it
/// is fenced: a transient error costs the stores of that sync; a device that keeps failing
/// stops costing the other devices' stores.
pub(crate) const HEADER_SYNC_FAILURES_FENCE: u32 = 3;

/// An open pool: devices in pool order (device index i at position i) and the index.
pub struct Pool {
    pub(crate) devices: Vec<PoolDevice>,
    pub(crate) index: Index,
    pub(crate) generation: u64,
    /// The newest Valid header read at open (device, slot, generation): where `generation`
    /// started. Named when the count is exhausted if it claims more than a pool counts to from
    /// its format (another tool's header, or the pool's own counted on from one).
    newest_read_at_open: Option<(u16, u32, u64)>,
    /// The last header this pool staged (device, slot), which carries `generation` once one
    /// was: named when the count is exhausted by the pool's own headers.
    last_staged: Option<(u16, u32)>,
    /// Deadline of each metadata command batch after open.
    timeout: Duration,
}

fn fresh_uuid() -> [u8; 16] {
    // Uniqueness, not secrecy: a version-4 UUID's 122 random bits from the OS's random source
    // (RFC 4122's way, and what the key secret is read from already); only if that cannot be
    // read, time, process and a stack address through SHA-256 (unique enough on one host: the
    // pool UUID tells pools apart, it keys nothing). Not the block-key hash: that takes a key
    // space's secret chain, which a UUID has nothing to do with.
    let mut uuid = crate::hash::os_random::<16>().unwrap_or_else(|_| {
        use sha2::{Digest, Sha256};
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let local = 0u8;
        let mut hasher = Sha256::new();
        hasher.update(b"tutti-puuid-v1");
        hasher.update(nanos.to_le_bytes());
        hasher.update(std::process::id().to_le_bytes());
        hasher.update((&local as *const u8 as usize).to_le_bytes());
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&hasher.finalize()[..16]);
        uuid
    });
    uuid[6] = (uuid[6] & 0x0F) | 0x40; // RFC 4122 version 4 layout
    uuid[8] = (uuid[8] & 0x3F) | 0x80;
    uuid
}

pub fn format_uuid(uuid: &[u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

fn namespace_of(target: &PoolTarget) -> Result<nvme_driver::Namespace> {
    Ok(target.controller.namespace(target.namespace)?)
}

/// Whether `error` is a read the device answered with a media error status (the sectors are
/// unreadable) with nothing left in flight on `queue`: the queue pair is still good, and the
/// caller may name what could not be read and go on. Anything else (a timeout, a broken
/// queue) is not.
fn is_media_error(queue: &IoQueuePair, error: &ObjstoreError) -> bool {
    queue.in_flight() == 0
        && matches!(error, ObjstoreError::Nvme(nvme)
            if nvme.status().is_some_and(|status| status.code_type == nvme_driver::spec::StatusCodeType::MediaAndDataIntegrity))
}

/// Reads and decodes the superblock of one target (for `open` and `tutti pool inspect`).
pub fn read_superblock(target: &PoolTarget, device: usize) -> Result<Superblock> {
    read_superblock_within(target, device, METADATA_TIMEOUT)
}

/// `read_superblock` with its deadline (tests use short ones).
pub(crate) fn read_superblock_within(target: &PoolTarget, device: usize, timeout: Duration) -> Result<Superblock> {
    let namespace = namespace_of(target)?;
    let queue = create_metadata_queue(&target.controller)?;
    let bytes = SUPERBLOCK_REGION_BYTES.max(u64::from(namespace.block_size_bytes));
    let region = target.controller.dma().allocate(bytes as usize)?;
    let lba_bytes = u64::from(namespace.block_size_bytes);
    with_metadata_queue(queue, &[&region], |queue| {
        transfer_region(queue, target.namespace, 0, &region, 0, bytes, lba_bytes, Transfer::Read, timeout)
    })?;
    let mut raw = vec![0u8; bytes as usize];
    region.read(0, &mut raw)?;
    Superblock::decode(&raw, device, namespace.block_size_bytes, namespace.size_blocks)
}

/// Whether `params` can format a namespace of `size_blocks` LBAs of `lba_bytes` as one of
/// `device_count` devices: the checks [`format_pool`] makes of each device before it writes
/// anything, for a caller about to create such a device (tuttid's `--emu-create-bytes` file), so
/// that a format refused by its parameters leaves nothing behind. The same error `format_pool`
/// would return (device 0 named).
pub fn check_format(params: &FormatParams, lba_bytes: u32, size_blocks: u64, device_count: usize) -> Result<()> {
    if device_count == 0 || device_count > usize::from(u16::MAX) {
        return Err(ObjstoreError::InvalidFormat { reason: format!("{device_count} devices, expected 1..={}", u16::MAX) });
    }
    params.plan_layout(lba_bytes, size_blocks, 0, device_count as u32).map(|_| ())
}

/// Formats `targets` as one pool (target i becomes device i): first zeroes every target's
/// superblock region with FUA (whatever pool was there no longer opens), then per device writes
/// an Empty entry for every slot, makes the header region durable, and writes the new
/// superblock with FUA — a format interrupted anywhere leaves no new pool (open fails with
/// `CorruptSuperblock` or `PoolMembership`), never a pool over headers it did not write. One
/// stopped while it zeroes the superblocks may leave an old pool on devices not yet reached
/// (a device holding a one-device pool of its own): it still opens, over its own headers,
/// which this format had not touched yet.
pub fn format_pool(targets: &[PoolTarget], params: &FormatParams) -> Result<Vec<Superblock>> {
    if targets.is_empty() || targets.len() > usize::from(u16::MAX) {
        return Err(ObjstoreError::InvalidFormat { reason: format!("{} devices, expected 1..={}", targets.len(), u16::MAX) });
    }
    let uuid = params.pool_uuid.unwrap_or_else(fresh_uuid);
    // One secret for every device of the pool (open checks they agree).
    let key_secret = match params.key_secret {
        Some(secret) => secret,
        None => KeySecret::random()?,
    };
    let mut planned = Vec::with_capacity(targets.len());
    for (device, target) in targets.iter().enumerate() {
        let namespace = namespace_of(target)?;
        let superblock = params
            .plan_device(namespace.block_size_bytes, namespace.size_blocks, device as u32, targets.len() as u32, uuid, key_secret)
            .map_err(|error| match error {
                ObjstoreError::NamespaceTooSmall { needed_bytes, available_bytes, .. } => {
                    ObjstoreError::NamespaceTooSmall { device, needed_bytes, available_bytes }
                }
                other => other,
            })?;
        planned.push(superblock);
    }
    // The old pool's superblocks go first, on every device, durably: until the new superblock
    // is written, the old one would still open, over header sectors this format rewrote.
    for (target, superblock) in targets.iter().zip(&planned) {
        let queue = create_metadata_queue(&target.controller)?;
        let bytes = SUPERBLOCK_REGION_BYTES.max(u64::from(superblock.lba_bytes));
        let buffer = target.controller.dma().allocate(bytes as usize)?;
        with_metadata_queue(queue, &[&buffer], |queue| {
            buffer.fill(0, buffer.len(), 0)?;
            let lba = u64::from(superblock.lba_bytes);
            let fua = Transfer::Write { force_unit_access: true };
            transfer_region(queue, target.namespace, 0, &buffer, 0, bytes, lba, fua, METADATA_TIMEOUT)
        })?;
    }
    for (target, superblock) in targets.iter().zip(&planned) {
        let queue = create_metadata_queue(&target.controller)?;
        let buffer = target.controller.dma().allocate(METADATA_CHUNK_BYTES as usize)?;
        with_metadata_queue(queue, &[&buffer], |queue| format_device(queue, &buffer, target, superblock))?;
    }
    Ok(planned)
}

/// Reads a device's header region into `mirror` in pieces of at most [`METADATA_CHUNK_BYTES`].
/// A piece that fails with a media error status (nothing left in flight) is read again LBA by
/// LBA: the LBAs that fail again with one are returned (relative to the region, ascending), and
/// the pool opens without their slots rather than not at all. Any other failure is returned
/// (after a timeout the caller must retire the queue pair). At most one command per LBA of the
/// failed pieces beyond the usual reads.
fn read_header_region(queue: &mut IoQueuePair, target: &PoolTarget, superblock: &Superblock, mirror: &DmaRegion) -> Result<Vec<u64>> {
    let lba = u64::from(superblock.lba_bytes);
    let region = superblock.header_region_bytes();
    let read = |queue: &mut IoQueuePair, offset: u64, len: u64| -> Result<()> {
        let first = superblock
            .header_lba
            .checked_add(offset / lba)
            .ok_or_else(|| ObjstoreError::AddressOverflow { what: format!("header LBA {} + {}", superblock.header_lba, offset / lba) })?;
        transfer_region(queue, target.namespace, first, mirror, offset, len, lba, Transfer::Read, METADATA_TIMEOUT)
    };
    let mut unreadable = Vec::new();
    let mut done = 0;
    while done < region {
        let piece = (region - done).min(METADATA_CHUNK_BYTES);
        match read(queue, done, piece) {
            Ok(()) => {}
            Err(error) if is_media_error(queue, &error) => {
                tracing::warn!(device = superblock.device_index, %error, "reading slot headers failed: reading them again one LBA at a time");
                for at in (done..done + piece).step_by(lba as usize) {
                    match read(queue, at, lba) {
                        Ok(()) => {}
                        Err(error) if is_media_error(queue, &error) => {
                            tracing::error!(device = superblock.device_index, header_lba = at / lba, %error, "a slot header LBA is unreadable");
                            // Whatever the failed reads left there goes: recovery fills the
                            // sector's entries in, and its tail past the last slot stays zero.
                            mirror.fill(at as usize, lba as usize, 0)?;
                            unreadable.push(at / lba);
                        }
                        Err(error) => return Err(error),
                    }
                }
            }
            Err(error) => return Err(error),
        }
        done += piece;
    }
    Ok(unreadable)
}

/// Runs `work` on a metadata queue pair whose commands name `buffers`, then deletes the pair.
/// After an error the deletion decides what becomes of the buffers: if the controller does not
/// confirm it while a command was still in flight (a timeout), they are leaked with the pair's
/// rings ([`crate::leak`]), never freed under a command that may still move their bytes.
fn with_metadata_queue(mut queue: IoQueuePair, buffers: &[&DmaRegion], work: impl FnOnce(&mut IoQueuePair) -> Result<()>) -> Result<()> {
    let result = work(&mut queue);
    if let Err(error) = crate::leak::retire_queue_pair(queue, buffers) {
        tracing::warn!(%error, "deleting a metadata queue pair failed");
    }
    result
}

/// Writes one device's header region (every slot Empty), flushes, then writes its superblock
/// with FUA, through `queue` and its chunk buffer `buffer`.
fn format_device(queue: &mut IoQueuePair, buffer: &DmaRegion, target: &PoolTarget, superblock: &Superblock) -> Result<()> {
    let lba = u64::from(superblock.lba_bytes);
    let region_bytes = superblock.header_region_bytes();
    let entry_bytes = u64::from(superblock.header_entry_bytes);
    let tag = pool_tag(&superblock.pool_uuid);
    let mut entries = vec![0u8; METADATA_CHUNK_BYTES as usize];
    let mut done = 0;
    while done < region_bytes {
        // Every slot gets a tagged, checksummed Empty entry (a zeroed one is damage); the
        // region's tail past the last slot stays zero. Chunks are whole LBAs, and entries
        // never straddle an LBA, so a chunk holds whole entries.
        let piece = (region_bytes - done).min(METADATA_CHUNK_BYTES);
        let chunk = &mut entries[..piece as usize];
        chunk.fill(0);
        let first_slot = done / entry_bytes;
        let slots = (piece / entry_bytes).min(superblock.slot_count.saturating_sub(first_slot));
        for (index, entry) in chunk.chunks_exact_mut(entry_bytes as usize).take(slots as usize).enumerate() {
            encode_empty_entry(entry, 0, tag, (first_slot + index as u64) as u32);
        }
        buffer.write(0, chunk)?;
        transfer_region(
            queue,
            target.namespace,
            superblock.header_lba + done / lba,
            buffer,
            0,
            piece,
            lba,
            Transfer::Write { force_unit_access: false },
            METADATA_TIMEOUT,
        )?;
        done += piece;
    }
    metadata_io::flush(queue, target.namespace, METADATA_TIMEOUT)?;
    let encoded = superblock.encode();
    let block = buffer.subregion(0, SUPERBLOCK_REGION_BYTES.max(lba) as usize)?;
    block.fill(0, block.len(), 0)?;
    block.write(0, &encoded)?;
    transfer_region(
        queue,
        target.namespace,
        0,
        &block,
        0,
        SUPERBLOCK_REGION_BYTES.max(lba),
        lba,
        Transfer::Write { force_unit_access: true },
        METADATA_TIMEOUT,
    )?;
    Ok(())
}

impl Pool {
    /// Opens a pool: reads every superblock, checks that the targets form one whole pool of one
    /// geometry (and `expected`, if given), reads every slot header and rebuilds the index.
    /// Targets may be given in any order; the pool orders them by their recorded device index.
    pub fn open(targets: Vec<PoolTarget>, expected: Option<&ModelGeometry>) -> Result<(Pool, RecoveryReport)> {
        // A device index is a u16 (format refuses more devices): refused before anything is read.
        if targets.len() > usize::from(u16::MAX) {
            return Err(ObjstoreError::PoolMembership {
                device: usize::from(u16::MAX),
                reason: format!("{} devices given: a pool holds at most {}", targets.len(), u16::MAX),
            });
        }
        let mut found = Vec::with_capacity(targets.len());
        for (position, target) in targets.into_iter().enumerate() {
            let superblock = read_superblock(&target, position)?;
            found.push((superblock, target));
        }
        let Some((first, _)) = found.first() else {
            return Err(ObjstoreError::PoolMembership { device: 0, reason: "no devices given".into() });
        };
        let first = *first;
        if let Some(expected) = expected {
            if *expected != first.geometry {
                return Err(ObjstoreError::GeometryMismatch { on_disk: first.geometry, registered: *expected });
            }
        }
        for (position, (superblock, _)) in found.iter().enumerate() {
            let membership = |reason: String| Err(ObjstoreError::PoolMembership { device: position, reason });
            if superblock.pool_uuid != first.pool_uuid {
                return membership(format!(
                    "belongs to pool {}, the first device to pool {}",
                    format_uuid(&superblock.pool_uuid),
                    format_uuid(&first.pool_uuid)
                ));
            }
            if superblock.key_secret != first.key_secret {
                // Same pool UUID, another secret: a superblock copied or rewritten by hand, or a
                // device of another format run. Its keys would disagree with the first device's.
                // The secrets are not printed, their non-secret tags are.
                return membership(format!(
                    "its key secret (tag {}) differs from the first device's (tag {}): the devices were not formatted together",
                    superblock.key_secret.tag(),
                    first.key_secret.tag()
                ));
            }
            if superblock.geometry != first.geometry {
                return Err(ObjstoreError::GeometryMismatch { on_disk: superblock.geometry, registered: first.geometry });
            }
            if superblock.device_count > u32::from(u16::MAX) {
                return membership(format!(
                    "the superblock records {} devices: a pool holds at most {}",
                    superblock.device_count,
                    u16::MAX
                ));
            }
            if superblock.device_count as usize != found.len() {
                return membership(format!("the pool has {} devices, {} were given", superblock.device_count, found.len()));
            }
            if superblock.blocks_per_slot != first.blocks_per_slot
                || superblock.lba_bytes != first.lba_bytes
                || superblock.flags != first.flags
            {
                return membership(format!(
                    "blocks per slot {} / LBA {} B / flags {:#x}, device 0 has {} / {} B / {:#x}",
                    superblock.blocks_per_slot, superblock.lba_bytes, superblock.flags, first.blocks_per_slot, first.lba_bytes, first.flags
                ));
            }
        }
        found.sort_by_key(|(superblock, _)| superblock.device_index);
        for (index, (superblock, _)) in found.iter().enumerate() {
            if superblock.device_index as usize != index {
                return Err(ObjstoreError::PoolMembership {
                    device: index,
                    reason: format!("device index {} given twice or device {index} missing", superblock.device_index),
                });
            }
        }
        let slot_counts: Vec<u32> = found.iter().map(|(superblock, _)| superblock.slot_count as u32).collect();
        let mut pool = Pool {
            devices: Vec::with_capacity(found.len()),
            index: Index::try_new(&slot_counts, first.blocks_per_slot)?,
            generation: 0,
            newest_read_at_open: None,
            last_staged: None,
            timeout: METADATA_TIMEOUT,
        };
        let mut report = RecoveryReport { devices: found.len(), ..RecoveryReport::default() };
        // Per device, the header LBAs (relative, ascending) that answered reads with a media error.
        let mut unreadable_lbas: Vec<Vec<u64>> = Vec::with_capacity(found.len());
        // A controller serving n pool devices needs n queue pairs for the executor; the pool
        // keeps n more for metadata only if it granted 2n, and otherwise borrows the executor's.
        let devices_on = |controller: &Arc<Controller>| found.iter().filter(|(_, t)| Arc::ptr_eq(&t.controller, controller)).count();
        let own_queue: Vec<bool> = found
            .iter()
            .map(|(_, target)| usize::from(target.controller.granted_queue_pairs()) >= 2 * devices_on(&target.controller))
            .collect();
        for ((superblock, target), own_queue) in found.into_iter().zip(own_queue) {
            let mut queue = create_metadata_queue(&target.controller)?;
            let mirror = target.controller.dma().allocate(superblock.header_region_bytes() as usize)?;
            let read = read_header_region(&mut queue, &target, &superblock, &mirror);
            let unreadable = match read {
                Ok(unreadable) => unreadable,
                Err(error) => {
                    // A timed-out read may still land in the mirror: it is freed only once the
                    // queue pair is known deleted, and leaked otherwise.
                    let _ = crate::leak::retire_queue_pair(queue, &[&mirror]);
                    return Err(error);
                }
            };
            unreadable_lbas.push(unreadable);
            let scratch =
                target.controller.dma().allocate((2 * superblock.geometry.object_bytes()).max(SUPERBLOCK_REGION_BYTES) as usize)?;
            if !own_queue {
                tracing::info!(
                    device = superblock.device_index,
                    granted = target.controller.granted_queue_pairs(),
                    "the controller granted too few I/O queue pairs for a metadata queue of the pool's own: metadata will \
                     borrow the executor's queue pair"
                );
            }
            let queue = own_queue.then_some(queue); // a shared one is deleted here, freeing its id
            let entry = vec![0u8; superblock.header_entry_bytes as usize];
            pool.devices.push(PoolDevice {
                queue,
                own_queue,
                fence: None,
                fence_idle: false,
                header_sync_failures: 0,
                flush_failures: 0,
                buffers_leaked: false,
                target,
                superblock,
                mirror: HeaderMirror::new(mirror, superblock)?,
                scratch,
                entry,
            });
        }
        pool.recover(&unreadable_lbas, &mut report)?;
        Ok((pool, report))
    }

    /// Rebuilds the index from the mirrors. `unreadable_lbas[device]` lists the header LBAs
    /// (relative, ascending) that could not be read: their slots count as corrupt and go free,
    /// and their mirror sectors are filled with clean Empty entries, so that writing such a
    /// sector later (a neighbour's header) keeps the mirror's rule (only Empty entries and
    /// Valid ones over durable data).
    fn recover(&mut self, unreadable_lbas: &[Vec<u64>], report: &mut RecoveryReport) -> Result<()> {
        let mut entry = Vec::new();
        let mut duplicate_slots = 0;
        for device in 0..self.devices.len() {
            // `open` refuses more devices than a u16 numbers.
            let index_of = u16::try_from(device).map_err(|_| ObjstoreError::PoolMembership {
                device,
                reason: format!("device index {device}: a pool holds at most {} devices", u16::MAX),
            })?;
            let superblock = self.devices[device].superblock;
            let tag = pool_tag(&superblock.pool_uuid);
            let unreadable = unreadable_lbas.get(device).map_or(&[][..], Vec::as_slice);
            entry.resize(superblock.header_entry_bytes as usize, 0);
            for slot in 0..superblock.slot_count as u32 {
                report.slots += 1;
                let lba = superblock.header_offset(slot) / u64::from(superblock.lba_bytes);
                if unreadable.binary_search(&lba).is_ok() {
                    report.corrupt_headers += 1;
                    report.unreadable_headers += 1;
                    encode_empty_entry(&mut entry, 0, tag, slot);
                    // Not a clean Empty entry on disk: staged Empty before the slot is reused.
                    self.devices[device].mirror.put_unstaged(slot, &entry, false)?;
                    continue;
                }
                self.devices[device].mirror.read_entry(slot, &mut entry)?;
                let verdict = SlotHeader::decode(&entry, slot, &superblock);
                self.devices[device].mirror.set_empty(slot, verdict == Err(HeaderVerdict::Empty));
                match verdict {
                    Ok(header) => {
                        if header.generation >= self.generation {
                            self.generation = header.generation;
                            self.newest_read_at_open = Some((index_of, slot, header.generation));
                        }
                        duplicate_slots += self.index.recover(index_of, slot, &header.blocks, header.generation);
                    }
                    Err(HeaderVerdict::Empty) => report.empty_slots += 1,
                    Err(HeaderVerdict::Zeroed) => {
                        report.corrupt_headers += 1;
                        report.zeroed_headers += 1;
                    }
                    Err(HeaderVerdict::Corrupt) => {
                        report.corrupt_headers += 1;
                        tracing::warn!(device, slot, "slot header failed its checks; slot returned to the free list");
                    }
                }
            }
        }
        if report.unreadable_headers > 0 {
            tracing::warn!(
                unreadable = report.unreadable_headers,
                "slot headers could not be read (media errors): their slots are free; blocks recorded there are lost"
            );
        }
        if report.zeroed_headers > 0 {
            tracing::warn!(
                zeroed = report.zeroed_headers,
                "slot headers are all zeroes: the header region was zeroed or deallocated; blocks recorded there are lost"
            );
        }
        // No pool commits 2^62 times (146 years at one a nanosecond): a newest header above that
        // was written by another tool, or by this pool counting on from another tool's header
        // read at an earlier open (after a restart, usually the pool's own). Said at open, since
        // the pool will refuse every header once the count reaches GENERATION_MAX
        // (`stage_header`).
        if let Some((device, slot, generation)) = self.newest_read_at_open.filter(|&(.., generation)| generation > GENERATION_MAX / 2) {
            tracing::warn!(
                device,
                slot,
                generation,
                headers_left = GENERATION_MAX - generation,
                "the pool's newest slot header claims a generation no pool counts to from its format: another tool wrote it, or the pool counted on from a header another tool wrote (read at an earlier open). The pool can write headers_left more headers, then refuses every commit, eviction and condemnation until it is reformatted"
            );
        }
        // A slot whose every key a newer slot holds is freed in memory; its header is rewritten
        // Empty lazily, when the slot is next allocated (the newer copies win again on every
        // recovery until then). A slot with some such keys keeps serving the others.
        report.duplicate_slots = duplicate_slots;
        self.index.finish_recovery();
        let counts = self.index.counts();
        report.valid_slots = counts.valid_slots;
        report.cached_blocks = counts.cached_blocks;
        Ok(())
    }

    /// Changes the deadline of metadata writes and flushes (tests that cut the power use short ones).
    pub fn set_metadata_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    pub fn superblock(&self, device: usize) -> &Superblock {
        &self.devices[device].superblock
    }

    pub fn geometry(&self) -> &ModelGeometry {
        &self.devices[0].superblock.geometry
    }

    pub fn blocks_per_slot(&self) -> u32 {
        self.devices[0].superblock.blocks_per_slot
    }

    /// The pool's key secret (every device's: `open` checks they agree), from which every key
    /// space's chain is derived (`hash::KeyChain::new`).
    pub fn key_secret(&self) -> &KeySecret {
        &self.devices[0].superblock.key_secret
    }

    pub fn index(&self) -> &Index {
        &self.index
    }

    pub fn target(&self, device: usize) -> &PoolTarget {
        &self.devices[device].target
    }

    /// Records a slot header in the mirror; it reaches the device at the next `sync_headers`.
    /// `blocks` carry their payload CRCs when the pool records them; an Empty entry lists none.
    pub(crate) fn stage_header(&mut self, device: u16, slot: u32, state: SlotState, blocks: &[crate::format::BlockRecord]) -> Result<u64> {
        // Recovery refuses headers above GENERATION_MAX and the count stops there, so every
        // header staged is accepted at the next open. Reached only after 2^63 commits, or when
        // the newest header read at open (another tool's, or counted on from one) claims it:
        // refused rather than wrapped (a wrapped count would make every later header lose to
        // the older ones).
        let generation = self.generation.checked_add(1).filter(|&generation| generation <= GENERATION_MAX).ok_or_else(|| {
            // No pool counts past GENERATION_MAX / 2 from its format (the warning at open): the
            // header read at open is named when it claims more (another tool's, or the pool's own
            // counted on from one), else the pool's own last header.
            let (device, slot, generation, read_at_open) = match (self.newest_read_at_open, self.last_staged) {
                (Some((device, slot, generation)), _) if generation > GENERATION_MAX / 2 => (device, slot, generation, true),
                (_, Some((device, slot))) => (device, slot, self.generation, false),
                // Only when the count was set without a header (tests set it directly).
                (_, None) => (device, slot, self.generation, false),
            };
            ObjstoreError::GenerationExhausted { device: usize::from(device), slot, generation, read_at_open }
        })?;
        let d = &mut self.devices[usize::from(device)];
        // A fenced device's mirror may still be read by a late header write, and is never
        // written out again: nothing is staged there.
        d.check_fence(usize::from(device))?;
        let superblock = d.superblock;
        let entry = &mut d.entry[..];
        let tag = pool_tag(&superblock.pool_uuid);
        match state {
            SlotState::Empty => encode_empty_entry(entry, generation, tag, slot),
            SlotState::Valid => {
                let payload_crcs = superblock.flags & FLAG_PAYLOAD_CRC != 0;
                encode_entry(entry, generation, tag, slot, state, payload_crcs, blocks);
            }
        }
        d.mirror.stage(slot, &d.entry, state == SlotState::Empty)?;
        // Counted only once in the mirror: a header refused above (a fenced device) uses no
        // generation, and the one named as the newest is one that carries the count.
        self.generation = generation;
        self.last_staged = Some((device, slot));
        Ok(generation)
    }

    /// Stages slot `slot`'s header back to a clean Empty entry without taking a generation:
    /// a failed commit's rollback, for a slot it staged Valid, when `stage_header` refuses the
    /// Empty stage (the count exhausted). The slot read Empty on disk before the commit
    /// (`reserve_store`), recovery reads no generation from an Empty entry, and the sector is
    /// staged anyway, so writing it is safe whether or not the Valid entry reached the disk;
    /// left Valid in the mirror, the next sync or the pool's drop would write it and a commit
    /// reported failed would be served after a restart. Generation 0, as format writes. A
    /// fenced device is refused as in `stage_header` (its mirror is never written out again).
    pub(crate) fn stage_empty_without_generation(&mut self, device: u16, slot: u32) -> Result<()> {
        let d = &mut self.devices[usize::from(device)];
        d.check_fence(usize::from(device))?;
        encode_empty_entry(&mut d.entry[..], 0, pool_tag(&d.superblock.pool_uuid), slot);
        d.mirror.stage(slot, &d.entry, true)
    }

    /// The payload CRC recorded for a committed block: 4 bytes at `offset` (see
    /// `format::payload_crc_offset`) in slot `slot`'s entry in the mirror.
    pub(crate) fn recorded_payload_crc(&self, device: u16, slot: u32, offset: usize) -> Result<u32> {
        self.devices[usize::from(device)].mirror.read_entry_u32(slot, offset)
    }

    /// Whether slot `slot`'s header in the mirror is a clean Empty entry (as formatted, or made
    /// Empty since).
    pub(crate) fn header_is_empty(&self, device: u16, slot: u32) -> bool {
        self.devices[usize::from(device)].mirror.is_empty(slot)
    }

    /// Whether device `device`'s metadata borrows the executor's queue pair (its controller
    /// granted fewer than two I/O queue pairs per pool device on it).
    pub fn metadata_queue_shared(&self, device: usize) -> bool {
        !self.devices[device].own_queue
    }

    /// Whether device `device` is fenced: a metadata command on it timed out on a queue pair
    /// that could not be deleted; it takes no header writes and no new slots until reopened.
    pub fn metadata_fenced(&self, device: usize) -> bool {
        self.devices[device].fence.is_some()
    }

    /// Fences device `device` as a metadata command stuck on a queue pair that cannot be
    /// deleted would (`metadata_queue`), for tests of what a fenced device still takes.
    #[cfg(test)]
    pub(crate) fn fence_for_test(&mut self, device: usize) {
        self.devices[device].fence(device, "fenced by a test".into());
    }

    /// [`Self::sync_devices`] with no deadline, every device's failure returned (tests).
    #[cfg(test)]
    pub(crate) fn sync_headers(&mut self, lender: &mut dyn QueueLender) -> Result<()> {
        self.sync_headers_by(lender, None)
    }

    /// Whether some header sector is staged and not yet written on a device not fenced.
    pub(crate) fn headers_staged(&self) -> bool {
        self.devices.iter().any(|d| d.fence.is_none() && d.mirror.has_dirty())
    }

    /// As the pool ends (its `Drop`): writes the header sectors still staged, best effort, all
    /// devices' writes together within one metadata timeout (a device reached with none of it
    /// left is not written; a temporary queue pair's create and delete are bounded by the admin
    /// timeout each, on top), logging (not returning) a failure. A device whose controller reads fatal
    /// (CSTS.CFS), not ready (a reset) or gone is not written at all: it would answer nothing,
    /// and waiting for it (then deleting the queue pair, or making a temporary one, by admin
    /// commands that time out too) would only hold up the drop, during an unwinding as well.
    /// What is not written stays staged in a mirror about to be freed: a reopen finds those
    /// headers as last written, so blocks condemned since (a verified retrieve catches them)
    /// come back. The shared deadline cuts each device's wait below the metadata timeout, so a
    /// queue pair `lender` lends is not used (see [`Self::sync_headers_by`]): `Drop` lends none.
    pub(crate) fn sync_staged_at_end(&mut self, lender: &mut dyn QueueLender) {
        if !self.headers_staged() {
            return;
        }
        let mut skip = vec![false; self.devices.len()];
        for (index, d) in self.devices.iter().enumerate() {
            if d.fence.is_some() || !d.mirror.has_dirty() {
                continue;
            }
            let unusable = match d.target.controller.status() {
                Err(error) => Some(error.to_string()),
                Ok(status) if status.fatal() => Some("controller fatal status (CSTS.CFS=1)".to_owned()),
                Ok(status) if !status.ready() => Some("controller not ready (CSTS.RDY=0)".to_owned()),
                Ok(_) => None,
            };
            if let Some(why) = unusable {
                tracing::error!(
                    device = index,
                    why,
                    "objstore: header entries staged on this device are not written as the pool ends: its controller cannot \
                     answer; blocks condemned since the last sync may be served again after a reopen"
                );
                skip[index] = true;
            }
        }
        let deadline = Instant::now() + self.timeout;
        if let Err(error) = self.sync_devices(lender, Some(deadline), None, Some(&skip)) {
            tracing::error!(
                %error,
                "objstore: header entries staged and not yet written (the Empty headers of evicted slots) could not be written \
                 as the pool ends: blocks condemned since the last sync may be served again after a reopen"
            );
        }
    }

    /// [`Self::sync_devices`] for a caller that must return by `deadline` (a `wait`): each
    /// device's writes wait within what is left of `deadline` (and the metadata timeout). A
    /// device reached with no time left is not written: its staged sectors stay staged for the
    /// next sync, and [`ObjstoreError::DeadlinePassed`] (counting the devices synced) says so.
    /// A write whose wait the caller's deadline cut short and that timed out left commands in
    /// flight: on the pool's own (or a temporary) queue pair, that pair is deleted
    /// (`metadata_queue`) and the sectors stay staged, and the timeout says nothing about the
    /// device, so it does not count toward [`HEADER_SYNC_FAILURES_FENCE`]. On the executor's
    /// queue pair lent for metadata, which the pool cannot delete, such a timeout would fence
    /// a device that may be healthy until reopen: there the writes are submitted only if the
    /// whole metadata timeout fits before `deadline` once the pair is lent (the lend waits for
    /// the executor's commands on it), else they stay staged (`DeadlinePassed`).
    /// `None`: no deadline but the metadata timeout's, on each wait: on a lent pair the lend
    /// (up to one timeout) and then the writes (one more), so up to twice the timeout.
    pub(crate) fn sync_headers_by(&mut self, lender: &mut dyn QueueLender, deadline: Option<Instant>) -> Result<()> {
        self.sync_devices(lender, deadline, None, None)
    }

    /// [`Self::sync_devices`] for a store or a commit whose slots are on `devices` alone (a
    /// bitmap by index): every device with staged sectors is synced as there, but only a
    /// failure on one of `devices` is returned; one elsewhere is logged (and counted toward
    /// that device's fence). Its own headers durable, a store must not fail because another
    /// device's writes hang, at every sync until that device is fenced.
    pub(crate) fn sync_headers_of(&mut self, lender: &mut dyn QueueLender, devices: &[bool]) -> Result<()> {
        self.sync_devices(lender, None, Some(devices), None)
    }

    /// Writes every staged header sector with FUA and waits: on `Ok` they are durable. Returns
    /// the first failure of a device in `judged` (every device for `None`).
    ///
    /// Every device with staged sectors is synced even after another failed: one device whose
    /// header writes fail must not keep the others' headers from the disk. A device whose syncs
    /// fail [`HEADER_SYNC_FAILURES_FENCE`] times in a row is fenced (its staged sectors dropped,
    /// none of its slots reused until reopen), so that the other devices' stores go on instead
    /// of failing with it at every sync. A device marked in `skip` is left alone (staged).
    fn sync_devices(
        &mut self,
        lender: &mut dyn QueueLender,
        deadline: Option<Instant>,
        judged: Option<&[bool]>,
        skip: Option<&[bool]>,
    ) -> Result<()> {
        let mut first_error = None;
        let mut synced_devices = 0;
        let full_timeout = self.timeout;
        for (index, d) in self.devices.iter_mut().enumerate() {
            if !d.mirror.has_dirty() || skip.is_some_and(|skip| skip.get(index).copied().unwrap_or(false)) {
                continue;
            }
            let left = match deadline {
                None => full_timeout,
                Some(deadline) => full_timeout.min(deadline.saturating_duration_since(Instant::now())),
            };
            if left.is_zero() {
                first_error.get_or_insert(ObjstoreError::DeadlinePassed { what: "header sync", done: synced_devices });
                continue;
            }
            let mut cut_short = left < full_timeout;
            let timeout_is_full = !cut_short;
            let namespace = d.target.namespace;
            let mut synced = d.run_metadata(index, lender, &mut None, left, timeout_is_full, deadline, |queue, mirror, _| {
                // One absolute end for all of this device's waits (its runs may take several
                // drains), measured from here: a lent queue pair comes once the executor's
                // commands on it have ended, which may take up to `left`, and that wait must
                // not leave the writes too little time, timing out in flight on a pair the pool
                // cannot delete (fencing a healthy device). `run_metadata` submits nothing on a
                // lent pair unless `left` fits before `deadline` from here.
                let mut ends = Instant::now() + left;
                if let Some(deadline) = deadline.filter(|&deadline| deadline < ends) {
                    // Only on a pair of the pool's own (or a temporary one) that took a while
                    // to make: cut to the caller's deadline, and not counted (below).
                    ends = deadline;
                    cut_short = true;
                }
                mirror.sync(queue, namespace, ends)
            });
            if let Err(ObjstoreError::DeadlinePassed { .. }) = synced {
                synced = Err(ObjstoreError::DeadlinePassed { what: "header sync", done: synced_devices });
            }
            // A timeout the caller's deadline cut short says nothing about the device.
            if !(cut_short && matches!(synced, Err(ObjstoreError::Nvme(NvmeError::Timeout { .. })))) {
                d.count_header_sync(index, &synced);
            }
            match synced {
                Ok(()) => synced_devices += 1,
                Err(error) if judged.is_none_or(|devices| devices.get(index).copied().unwrap_or(false)) => {
                    first_error.get_or_insert(error);
                }
                Err(error) => {
                    tracing::warn!(device = index, %error, "objstore: a header sync failed on a device this store has no slot on; its sectors stay staged");
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Flushes the volatile write cache of the devices in `devices` (a bitmap by index),
    /// stopping at the first that fails. A device whose flushes fail
    /// [`HEADER_SYNC_FAILURES_FENCE`] times in a row is fenced, as for header syncs: new stores
    /// then go to the other devices instead of failing at every commit placed on it.
    pub(crate) fn flush(&mut self, devices: &[bool], lender: &mut dyn QueueLender) -> Result<()> {
        let timeout = self.timeout;
        for (index, (d, &used)) in self.devices.iter_mut().zip(devices).enumerate() {
            if used {
                let namespace = d.target.namespace;
                let flushed = d.run_metadata(index, lender, &mut None, timeout, true, None, |queue, _, _| {
                    metadata_io::flush(queue, namespace, timeout)
                });
                d.count_flush(index, &flushed);
                flushed?;
            }
        }
        Ok(())
    }

    /// The offline check of `tutti pool check`: every header was verified by `open` (counted in
    /// the report); with `payload`, every block of every valid slot whose header records payload
    /// CRCs is read back and compared. Returns (slots verified, slots with a mismatching block
    /// or data the device answered with a media error, as (device, slot)); a read that times
    /// out ends the check with its error.
    pub fn check_payloads(&mut self, deadline: Instant) -> Result<(u64, Vec<(usize, u32)>)> {
        let mut verified = 0;
        let mut bad = Vec::new();
        let mut entry = Vec::new();
        let mut bytes = Vec::new();
        let mut hashers = Vec::new();
        let mut no_lender = NoLender;
        for device in 0..self.devices.len() {
            // A device without a metadata queue of its own gets one for the check (no store,
            // so no executor holds the controller's queue pairs).
            let mut temporary = None;
            let superblock = self.devices[device].superblock;
            entry.resize(superblock.header_entry_bytes as usize, 0);
            for slot in 0..superblock.slot_count as u32 {
                if Instant::now() > deadline {
                    return Err(ObjstoreError::DeadlinePassed { what: "payload check", done: verified });
                }
                self.devices[device].mirror.read_entry(slot, &mut entry)?;
                let Ok(header) = SlotHeader::decode(&entry, slot, &superblock) else { continue };
                if header.flags & HEADER_FLAG_PAYLOAD_CRC == 0 {
                    continue;
                }
                // One CRC per block, each over `for l: K then V` of that block.
                hashers.clear();
                hashers.resize(header.blocks.len(), crc32fast::Hasher::new());
                let pair = 2 * superblock.geometry.object_bytes();
                bytes.resize(pair as usize, 0);
                // A read answered with a media error (nothing left in flight) makes the slot
                // bad, named, and the check goes on; a timeout or a broken queue ends it.
                let mut readable = true;
                'layers: for layer in 0..superblock.geometry.layers {
                    for (j, hasher) in hashers.iter_mut().enumerate() {
                        let lba = superblock.block_lba(slot, j as u32) + u64::from(layer) * superblock.layer_stride_blocks();
                        let d = &mut self.devices[device];
                        let (namespace, timeout) = (d.target.namespace, self.timeout);
                        readable = d.run_metadata(device, &mut no_lender, &mut temporary, timeout, true, None, |queue, _, scratch| {
                            let lba_bytes = u64::from(superblock.lba_bytes);
                            match transfer_region(queue, namespace, lba, scratch, 0, pair, lba_bytes, Transfer::Read, timeout) {
                                Ok(()) => {}
                                Err(error) if is_media_error(queue, &error) => {
                                    tracing::error!(device, slot, block = j, layer, %error, "payload check: a slot's data is unreadable");
                                    return Ok(false);
                                }
                                Err(error) => return Err(error),
                            }
                            scratch.read(0, &mut bytes)?;
                            Ok(true)
                        })?;
                        if !readable {
                            break 'layers;
                        }
                        hasher.update(&bytes);
                    }
                }
                verified += 1;
                if !readable
                    || hashers.iter_mut().zip(&header.blocks).any(|(hasher, block)| std::mem::take(hasher).finalize() != block.payload_crc)
                {
                    bad.push((device, slot));
                }
            }
        }
        Ok((verified, bad))
    }
}
