//! The on-disk format of one pool member (one NVMe namespace), byte by byte in docs/objstore.md:
//!
//! ```text
//! LBA 0                  superblock (256 encoded bytes, zero padded to max(4 KiB, one LBA))
//! byte max(4096, LBA)    slot-header region: slot_count entries of header_entry_bytes
//! data_lba (1 MiB-aligned) data region: slot_count slots of slot_bytes
//! ```
//! A slot holds k = blocks_per_slot engine blocks, layer-major inside:
//! `[layer][block j][K, V]`, so layer l of block j of slot s starts at byte
//! `data + s * slot_bytes + (l * k + j) * 2 * object_bytes` and the per-layer stride is constant
//! across slots (what gio_uring's per-layer rule needs).
//!
//! Everything read back is untrusted: decoding checks magic, CRC, version and ranges and returns
//! a typed error; it never panics.

use crate::error::{ObjstoreError, Result};
use crate::geometry::ModelGeometry;
use crate::hash::{KeySecret, KEY_SECRET_BYTES};

pub const MAGIC: [u8; 8] = *b"TUTTIKV\0";
/// 5: block keys are keyed: each key space's chain (its start and a space key hashed into every
/// block's key) is SHA-256 of the pool's key secret (bytes 120..152 of the superblock,
/// [`KeySecret`]) and the space's seed (`hash::KeyChain::new`), so no one without the secret
/// can compute a key, nor extend a chain from a key seen (or search for colliding prefixes);
/// otherwise the layout is version 4's. Version 4 (SHA-256 keys, unkeyed:
/// computable by anyone), version 3 (keys of the earlier fast mix), version 2 (also all-zero
/// Empty entries, one payload CRC per slot) and version 1 (keys of the first hash scheme) are
/// refused. Version 3 introduced Empty slot headers carrying the pool tag, slot number and a
/// CRC (a zeroed header region is damage, not an empty pool) and payload CRCs per block.
pub const FORMAT_VERSION: u32 = 5;
pub const SUPERBLOCK_ENCODED_BYTES: usize = 256;
/// The superblock region: one 4 KiB unit whatever the LBA size, so headers start at byte 4096.
pub const SUPERBLOCK_REGION_BYTES: u64 = 4096;
/// Data region alignment: SSDs stripe internally at this granularity or finer.
pub const DATA_ALIGN_BYTES: u64 = 1 << 20;
pub const FLAG_PAYLOAD_CRC: u32 = 1;
/// The most engine blocks one slot holds (k); a slot header lists each.
pub const BLOCKS_PER_SLOT_MAX: u32 = 1024;
/// Every superblock flag this build understands; any other bit set is a corrupt superblock.
const FLAGS_KNOWN: u32 = FLAG_PAYLOAD_CRC;
const SLOT_HEADER_FIXED_BYTES: usize = 32;
const SLOT_HEADER_BLOCK_BYTES: usize = 16;
const SLOT_HEADER_CRC_BYTES: u64 = 4;
const SUPERBLOCK_CRC_OFFSET: usize = SUPERBLOCK_ENCODED_BYTES - 4;
/// Where the key secret lies in the superblock (bytes 120..152); reserved zero bytes follow up
/// to the CRC.
const KEY_SECRET_OFFSET: usize = 120;
const KEY_SECRET_END: usize = KEY_SECRET_OFFSET + KEY_SECRET_BYTES;

/// Why a pool of an older format version cannot be opened, `None` for the current one.
fn older_version_reason(version: u32) -> Option<&'static str> {
    match version {
        // Same layout, but its slot headers hold keys of the first block-hash scheme: its
        // blocks could never be found, and new ones would sit beside them unseen.
        1 => Some("its block keys use the first hash scheme; reformat it (`tutti pool format`)"),
        // Its Empty headers are all zeroes, which versions 3 and later read as a damaged header
        // region (and its payload CRCs are per slot): every slot would count as corrupt.
        2 => Some(
            "its empty slot headers are all zeroes, which this version treats as damage (a zeroed header region), and its \
             payload CRCs are per slot, and its block keys use an earlier hash scheme; reformat it (`tutti pool format`)",
        ),
        // Same layout, but its keys are of the earlier fast mix (cheap to collide on purpose):
        // its blocks could never be found under the SHA-256 keys.
        3 => Some("its block keys use the earlier hash scheme; reformat it (`tutti pool format`)"),
        // Same layout, but its keys are unkeyed (no secret in the superblock): anyone can
        // compute them and search for prefixes that collide; reformatting gives it a secret.
        4 => Some(
            "its block keys are unkeyed, computable by anyone (prefixes that collide can be searched for); reformat it \
             (`tutti pool format`), which gives it a key secret",
        ),
        _ => None,
    }
}

/// Everything the superblock records. Its `Debug` prints no secret ([`KeySecret`]'s is redacted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    pub version: u32,
    pub pool_uuid: [u8; 16],
    pub device_index: u32,
    pub device_count: u32,
    pub geometry: ModelGeometry,
    pub blocks_per_slot: u32,
    pub lba_bytes: u32,
    pub flags: u32,
    pub header_entry_bytes: u32,
    pub slot_count: u64,
    pub slot_bytes: u64,
    pub header_lba: u64,
    pub header_blocks: u64,
    pub data_lba: u64,
    /// The pool's key secret (the same on every device of the pool): what every key space's
    /// chain is derived from (`hash::KeyChain::new`).
    pub key_secret: KeySecret,
}

fn u32_at(bytes: &[u8], offset: usize) -> u32 {
    u32::from_le_bytes(bytes[offset..offset + 4].try_into().expect("4-byte slice"))
}

fn u64_at(bytes: &[u8], offset: usize) -> u64 {
    u64::from_le_bytes(bytes[offset..offset + 8].try_into().expect("8-byte slice"))
}

fn put_u32(bytes: &mut [u8], offset: usize, value: u32) {
    bytes[offset..offset + 4].copy_from_slice(&value.to_le_bytes());
}

fn put_u64(bytes: &mut [u8], offset: usize, value: u64) {
    bytes[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
}

/// Bytes of one slot-header entry for k blocks per slot: the smallest power of two holding the
/// fixed part, k (key, token count) records and the CRC, so an entry never straddles an LBA.
pub fn header_entry_bytes(blocks_per_slot: u32) -> u64 {
    (SLOT_HEADER_FIXED_BYTES as u64 + u64::from(blocks_per_slot) * SLOT_HEADER_BLOCK_BYTES as u64 + SLOT_HEADER_CRC_BYTES)
        .next_power_of_two()
}

/// Where format puts a device's metadata for `slot_count` slots of `blocks_per_slot` blocks on
/// LBAs of `lba_bytes`, in bytes: the header region's start and length (whole LBAs, after the
/// superblock's region) and the data region's start (the next 1 MiB boundary past the
/// headers). `None` when it does not fit in 64 bits. The one rule for both
/// [`Superblock::plan`] and a check of a layout from elsewhere (`PoolShape::check`).
pub fn metadata_layout(slot_count: u64, blocks_per_slot: u32, lba_bytes: u32) -> Option<MetadataLayout> {
    let lba = u64::from(lba_bytes).max(1);
    let header_start = SUPERBLOCK_REGION_BYTES.max(lba);
    let header_bytes = slot_count.checked_mul(header_entry_bytes(blocks_per_slot))?.div_ceil(lba).checked_mul(lba)?;
    let data_start = header_start.checked_add(header_bytes)?.div_ceil(DATA_ALIGN_BYTES).checked_mul(DATA_ALIGN_BYTES)?;
    Some(MetadataLayout { header_start, header_bytes, data_start })
}

/// See [`metadata_layout`]: byte offsets in a namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetadataLayout {
    pub header_start: u64,
    pub header_bytes: u64,
    pub data_start: u64,
}

impl Superblock {
    /// Lays out a namespace of `size_blocks` LBAs of `lba_bytes` for `geometry` with k blocks per
    /// slot, using at most `slot_count_max` slots (as many as fit when `None`).
    #[allow(clippy::too_many_arguments)]
    pub fn plan(
        geometry: ModelGeometry,
        blocks_per_slot: u32,
        lba_bytes: u32,
        size_blocks: u64,
        slot_count_max: Option<u64>,
        pool_uuid: [u8; 16],
        device_index: u32,
        device_count: u32,
        flags: u32,
        key_secret: KeySecret,
    ) -> Result<Self> {
        geometry.validate()?;
        let invalid = |reason: String| ObjstoreError::InvalidFormat { reason };
        if !lba_bytes.is_power_of_two() || !(512..=65536).contains(&lba_bytes) {
            return Err(invalid(format!("LBA size {lba_bytes} is not a power of two in 512..=65536")));
        }
        if !geometry.object_bytes().is_multiple_of(u64::from(lba_bytes)) {
            return Err(invalid(format!("an object of {} bytes is not a whole number of {lba_bytes}-byte LBAs", geometry.object_bytes())));
        }
        let entry = header_entry_bytes(blocks_per_slot);
        if blocks_per_slot == 0 || blocks_per_slot > BLOCKS_PER_SLOT_MAX || entry > u64::from(lba_bytes) {
            return Err(invalid(format!(
                "blocks per slot {blocks_per_slot}: expected 1..={BLOCKS_PER_SLOT_MAX} with a header entry ({entry} B) within one LBA ({lba_bytes} B)"
            )));
        }
        if device_count == 0 || device_index >= device_count {
            return Err(invalid(format!("device index {device_index} of {device_count}")));
        }
        let lba = u64::from(lba_bytes);
        let slot_bytes = geometry.block_bytes() * u64::from(blocks_per_slot);
        let size_bytes = size_blocks.saturating_mul(lba);
        let header_start = SUPERBLOCK_REGION_BYTES.max(lba);
        let layout = |slots: u64| metadata_layout(slots, blocks_per_slot, lba_bytes);
        // The end of the last slot, when it fits in 64 bits.
        let end = |slots: u64| layout(slots).and_then(|layout| slots.checked_mul(slot_bytes)?.checked_add(layout.data_start));
        let mut slots = size_bytes.saturating_sub(header_start + DATA_ALIGN_BYTES) / (slot_bytes + entry);
        if let Some(max) = slot_count_max {
            slots = slots.min(max);
        }
        while slots > 0 && end(slots).is_none_or(|end| end > size_bytes) {
            slots -= 1;
        }
        if slots == 0 {
            return Err(ObjstoreError::NamespaceTooSmall {
                device: device_index as usize,
                needed_bytes: end(1).unwrap_or(u64::MAX),
                available_bytes: size_bytes,
            });
        }
        // Slots are numbered with u32 everywhere past the superblock (headers, the index,
        // placements); a superblock read back from disk is re-planned here too, so one that
        // records more is refused rather than truncated.
        if slots > u64::from(u32::MAX) {
            return Err(invalid(format!("device {device_index}: {slots} slots, at most {} supported", u32::MAX)));
        }
        // Fits: the loop above found its end within the namespace.
        let MetadataLayout { header_start, header_bytes, data_start } =
            layout(slots).ok_or_else(|| invalid(format!("device {device_index}: {slots} slots overflow the layout")))?;
        Ok(Self {
            version: FORMAT_VERSION,
            pool_uuid,
            device_index,
            device_count,
            geometry,
            blocks_per_slot,
            lba_bytes,
            flags,
            header_entry_bytes: entry as u32,
            slot_count: slots,
            slot_bytes,
            header_lba: header_start / lba,
            header_blocks: header_bytes / lba,
            data_lba: data_start / lba,
            key_secret,
        })
    }

    pub fn encode(&self) -> [u8; SUPERBLOCK_ENCODED_BYTES] {
        let mut b = [0u8; SUPERBLOCK_ENCODED_BYTES];
        b[..8].copy_from_slice(&MAGIC);
        put_u32(&mut b, 8, self.version);
        put_u32(&mut b, 12, SUPERBLOCK_ENCODED_BYTES as u32);
        b[16..32].copy_from_slice(&self.pool_uuid);
        put_u32(&mut b, 32, self.device_index);
        put_u32(&mut b, 36, self.device_count);
        put_u32(&mut b, 40, self.geometry.layers);
        put_u32(&mut b, 44, self.geometry.kv_heads);
        put_u32(&mut b, 48, self.geometry.head_dim);
        put_u32(&mut b, 52, self.geometry.dtype_bytes);
        put_u32(&mut b, 56, self.geometry.block_tokens);
        put_u32(&mut b, 60, self.blocks_per_slot);
        put_u32(&mut b, 64, self.lba_bytes);
        put_u32(&mut b, 68, self.flags);
        put_u32(&mut b, 72, self.header_entry_bytes);
        put_u64(&mut b, 80, self.slot_count);
        put_u64(&mut b, 88, self.slot_bytes);
        put_u64(&mut b, 96, self.header_lba);
        put_u64(&mut b, 104, self.header_blocks);
        put_u64(&mut b, 112, self.data_lba);
        b[KEY_SECRET_OFFSET..KEY_SECRET_END].copy_from_slice(self.key_secret.as_bytes());
        let crc = crc32fast::hash(&b[..SUPERBLOCK_CRC_OFFSET]);
        put_u32(&mut b, SUPERBLOCK_CRC_OFFSET, crc);
        b
    }

    /// Decodes and checks a superblock read from device `device` whose namespace has
    /// `size_blocks` LBAs of `lba_bytes`.
    pub fn decode(bytes: &[u8], device: usize, lba_bytes: u32, size_blocks: u64) -> Result<Self> {
        let corrupt = |reason: String| ObjstoreError::CorruptSuperblock { device, reason };
        if bytes.len() < SUPERBLOCK_ENCODED_BYTES {
            return Err(corrupt(format!("truncated: {} bytes, expected {SUPERBLOCK_ENCODED_BYTES}", bytes.len())));
        }
        if bytes[..8] != MAGIC {
            return Err(corrupt(format!("magic {:02x?}, expected {:02x?} (not a tutti pool, or never formatted)", &bytes[..8], MAGIC)));
        }
        let version = u32_at(bytes, 8);
        let stored = u32_at(bytes, SUPERBLOCK_CRC_OFFSET);
        let computed = crc32fast::hash(&bytes[..SUPERBLOCK_CRC_OFFSET]);
        if version > FORMAT_VERSION {
            // Refused before the CRC (a newer format may place it elsewhere), but the CRC under
            // this layout tells a newer pool from a damaged version field in the message.
            return Err(ObjstoreError::NewerFormatVersion {
                device,
                found: version,
                supported: FORMAT_VERSION,
                sealed: stored == computed,
            });
        }
        if stored != computed {
            return Err(corrupt(format!("CRC32 {stored:#010x}, computed {computed:#010x}")));
        }
        if let Some(reason) = older_version_reason(version) {
            return Err(ObjstoreError::OlderFormatVersion { device, found: version, supported: FORMAT_VERSION, reason });
        }
        if version == 0 || u32_at(bytes, 12) != SUPERBLOCK_ENCODED_BYTES as u32 {
            return Err(corrupt(format!(
                "version {version} with encoded length {}, expected {FORMAT_VERSION} / {SUPERBLOCK_ENCODED_BYTES}",
                u32_at(bytes, 12)
            )));
        }
        let geometry = ModelGeometry {
            layers: u32_at(bytes, 40),
            kv_heads: u32_at(bytes, 44),
            head_dim: u32_at(bytes, 48),
            dtype_bytes: u32_at(bytes, 52),
            block_tokens: u32_at(bytes, 56),
        };
        let secret_bytes: [u8; KEY_SECRET_BYTES] = bytes[KEY_SECRET_OFFSET..KEY_SECRET_END].try_into().expect("32-byte slice");
        // The error says what is wrong with the field, never its bytes.
        let key_secret = KeySecret::from_bytes(secret_bytes).map_err(|_| corrupt("its key secret is all zeroes (never set)".into()))?;
        let superblock = Self {
            version,
            pool_uuid: bytes[16..32].try_into().expect("16-byte slice"),
            device_index: u32_at(bytes, 32),
            device_count: u32_at(bytes, 36),
            geometry,
            blocks_per_slot: u32_at(bytes, 60),
            lba_bytes: u32_at(bytes, 64),
            flags: u32_at(bytes, 68),
            header_entry_bytes: u32_at(bytes, 72),
            slot_count: u64_at(bytes, 80),
            slot_bytes: u64_at(bytes, 88),
            header_lba: u64_at(bytes, 96),
            header_blocks: u64_at(bytes, 104),
            data_lba: u64_at(bytes, 112),
            key_secret,
        };
        if superblock.flags & !FLAGS_KNOWN != 0 {
            return Err(corrupt(format!(
                "flags {:#x}: bits {:#x} are unknown to this build",
                superblock.flags,
                superblock.flags & !FLAGS_KNOWN
            )));
        }
        if u32_at(bytes, 76) != 0 || bytes[KEY_SECRET_END..SUPERBLOCK_CRC_OFFSET].iter().any(|&byte| byte != 0) {
            return Err(corrupt("reserved bytes are not zero".into()));
        }
        // A CRC-valid superblock can still describe a layout that does not fit this namespace
        // (copied from another device, or written by a buggy tool): re-derive and compare.
        if superblock.lba_bytes != lba_bytes {
            return Err(ObjstoreError::LbaSizeMismatch { device, recorded: superblock.lba_bytes, namespace: lba_bytes });
        }
        let expected = Self::plan(
            geometry,
            superblock.blocks_per_slot,
            lba_bytes,
            size_blocks,
            Some(superblock.slot_count),
            superblock.pool_uuid,
            superblock.device_index,
            superblock.device_count,
            superblock.flags,
            superblock.key_secret,
        )
        .map_err(|error| corrupt(format!("layout does not fit this namespace: {error}")))?;
        if expected != superblock {
            return Err(corrupt(layout_difference(&superblock, &expected, lba_bytes, size_blocks)));
        }
        Ok(superblock)
    }

    pub fn pair_blocks(&self) -> u64 {
        2 * self.geometry.object_bytes() / u64::from(self.lba_bytes)
    }

    /// LBAs between layer l and layer l + 1 of the same block (gio_uring's `lba_stride_blocks`).
    pub fn layer_stride_blocks(&self) -> u64 {
        self.pair_blocks() * u64::from(self.blocks_per_slot)
    }

    /// First LBA of block `index` of slot `slot` at layer 0.
    pub fn block_lba(&self, slot: u32, index: u32) -> u64 {
        self.data_lba + u64::from(slot) * (self.slot_bytes / u64::from(self.lba_bytes)) + u64::from(index) * self.pair_blocks()
    }

    /// The LBA arithmetic of the data region with its divisions done once (see [`SlotAddressing`]).
    pub fn addressing(&self) -> SlotAddressing {
        SlotAddressing {
            data_lba: self.data_lba,
            slot_blocks: self.slot_bytes / u64::from(self.lba_bytes),
            pair_blocks: self.pair_blocks(),
            lba_shift: self.lba_bytes.trailing_zeros(),
        }
    }

    /// Byte offset of slot `slot`'s header entry inside the header region.
    pub fn header_offset(&self, slot: u32) -> u64 {
        u64::from(slot) * u64::from(self.header_entry_bytes)
    }

    pub fn header_region_bytes(&self) -> u64 {
        self.header_blocks * u64::from(self.lba_bytes)
    }
}

/// Words for a CRC-valid superblock whose recorded layout is not the one its own parameters
/// give on this namespace: each field that differs, and the likely cause.
fn layout_difference(recorded: &Superblock, derived: &Superblock, lba_bytes: u32, size_blocks: u64) -> String {
    let fields = [
        ("slot count", recorded.slot_count, derived.slot_count),
        ("slot bytes", recorded.slot_bytes, derived.slot_bytes),
        ("header LBA", recorded.header_lba, derived.header_lba),
        ("header LBAs", recorded.header_blocks, derived.header_blocks),
        ("data LBA", recorded.data_lba, derived.data_lba),
        ("header entry bytes", u64::from(recorded.header_entry_bytes), u64::from(derived.header_entry_bytes)),
    ];
    let differences: Vec<String> = fields
        .iter()
        .filter(|(_, recorded, derived)| recorded != derived)
        .map(|(name, recorded, derived)| format!("{name} {recorded} recorded, {derived} fit"))
        .collect();
    let namespace_bytes = size_blocks.saturating_mul(u64::from(lba_bytes));
    let cause = if derived.slot_count < recorded.slot_count {
        format!("the namespace ({namespace_bytes} bytes) is smaller than when the pool was formatted: a truncated file, or another device")
    } else {
        "the superblock was written for another namespace or by another tool".to_string()
    };
    let listed = if differences.is_empty() { "fields beyond the layout differ".to_string() } else { differences.join(", ") };
    format!("its layout does not fit this namespace ({listed}): {cause}")
}

/// A superblock's data-region addressing with every quotient precomputed, for the per-block
/// path of `prepare_*` (two 64-bit divisions per block were a measurable share of its cost).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAddressing {
    pub data_lba: u64,
    /// LBAs per slot.
    pub slot_blocks: u64,
    /// LBAs of one block's K and V objects of one layer.
    pub pair_blocks: u64,
    /// log2 of the LBA size (a power of two, checked when the superblock is planned or decoded).
    pub lba_shift: u32,
}

impl SlotAddressing {
    /// Same as [`Superblock::block_lba`].
    #[inline]
    pub fn block_lba(&self, slot: u32, index: u32) -> u64 {
        self.data_lba + u64::from(slot) * self.slot_blocks + u64::from(index) * self.pair_blocks
    }

    /// Bytes to LBAs (the caller's byte counts are whole LBAs).
    #[inline]
    pub fn blocks_of(&self, bytes: u64) -> u64 {
        bytes >> self.lba_shift
    }
}

/// A slot's state as recorded in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// Nothing valid: never written, evicted, or being rewritten. Still a full entry (pool tag,
    /// slot number, CRC), so that a zeroed entry is recognisably damage.
    Empty = 0,
    /// Every object of every block listed is durable.
    Valid = 1,
}

/// One block recorded in a slot header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockRecord {
    /// The chained hash of the block (its prefix and its tokens).
    pub key: u64,
    pub token_count: u32,
    /// CRC-32 of the block's payload in disk order (`for l: K then V`), when the pool records
    /// payload CRCs ([`FLAG_PAYLOAD_CRC`]); 0 otherwise.
    pub payload_crc: u32,
}

/// A decoded slot header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotHeader {
    /// Commit sequence number on this device (newer wins if a key appears twice).
    pub generation: u64,
    /// First 8 bytes of the pool UUID: a header left by an earlier format of the namespace
    /// carries another tag and is ignored.
    pub pool_tag: u64,
    pub slot: u32,
    pub state: SlotState,
    /// Bit 0 ([`HEADER_FLAG_PAYLOAD_CRC`]): every block record carries its payload CRC.
    pub flags: u32,
    pub blocks: Vec<BlockRecord>,
}

/// Header flag: the block records carry payload CRCs.
pub const HEADER_FLAG_PAYLOAD_CRC: u32 = 1;

/// The largest generation a header may carry: the pool counts its headers up to it, and a
/// header read back above it is refused as damage (a buggy or hostile tool's). One bound for
/// both, so that the pool never stages a header its next open refuses (with a lower bound on
/// reading, a pool that opened on a header near it wrote every later commit above it, and lost
/// them all at each restart). A pool that committed a header every nanosecond would take 292
/// years to reach it; a header at it (or just below) leaves the count no room, and every later
/// commit, eviction and condemnation is refused, naming that header
/// ([`crate::ObjstoreError::GenerationExhausted`]) rather
/// than wrapped (a wrapped count would invert which copy of a key is newer).
pub const GENERATION_MAX: u64 = 1 << 63;

/// Why a header entry was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderVerdict {
    /// A well-formed Empty entry of this pool and slot.
    Empty,
    /// All zeroes: an Empty entry carries a pool tag and a CRC, so this is damage (a zeroed or
    /// deallocated header region), and any block it recorded is lost.
    Zeroed,
    /// CRC mismatch, a foreign pool tag, a wrong slot number, a generation above
    /// [`GENERATION_MAX`], an impossible block count or non-zero reserved bytes.
    Corrupt,
}

/// Byte offset, inside an entry, of block `index`'s record.
fn block_record_offset(index: usize) -> usize {
    SLOT_HEADER_FIXED_BYTES + index * SLOT_HEADER_BLOCK_BYTES
}

/// Byte offset, inside an entry, of block `index`'s payload CRC.
pub fn payload_crc_offset(index: usize) -> usize {
    block_record_offset(index) + 12
}

/// Encodes a slot-header entry into `out` (exactly `header_entry_bytes` long) without building
/// a [`SlotHeader`] (no allocation on the commit path). An Empty entry lists no blocks.
pub fn encode_entry(
    out: &mut [u8],
    generation: u64,
    pool_tag: u64,
    slot: u32,
    state: SlotState,
    payload_crcs: bool,
    blocks: &[BlockRecord],
) {
    out.fill(0);
    put_u64(out, 0, generation);
    put_u64(out, 8, pool_tag);
    put_u32(out, 16, slot);
    out[20..22].copy_from_slice(&(state as u16).to_le_bytes());
    out[22..24].copy_from_slice(&(blocks.len() as u16).to_le_bytes());
    put_u32(out, 24, if payload_crcs { HEADER_FLAG_PAYLOAD_CRC } else { 0 });
    for (j, block) in blocks.iter().enumerate() {
        let at = block_record_offset(j);
        put_u64(out, at, block.key);
        put_u32(out, at + 8, block.token_count);
        put_u32(out, at + 12, if payload_crcs { block.payload_crc } else { 0 });
    }
    let crc_at = out.len() - 4;
    let crc = crc32fast::hash(&out[..crc_at]);
    put_u32(out, crc_at, crc);
}

/// Encodes the Empty entry of `slot` (what format writes, and what eviction stages).
pub fn encode_empty_entry(out: &mut [u8], generation: u64, pool_tag: u64, slot: u32) {
    encode_entry(out, generation, pool_tag, slot, SlotState::Empty, false, &[]);
}

pub fn pool_tag(uuid: &[u8; 16]) -> u64 {
    u64::from_le_bytes(uuid[..8].try_into().expect("8-byte slice"))
}

impl SlotHeader {
    /// Encodes into `out` (exactly `header_entry_bytes` long).
    pub fn encode_into(&self, out: &mut [u8]) {
        let payload_crcs = self.flags & HEADER_FLAG_PAYLOAD_CRC != 0;
        encode_entry(out, self.generation, self.pool_tag, self.slot, self.state, payload_crcs, &self.blocks);
    }

    /// Decodes entry `slot` of a header region of `superblock`'s pool. `Err(Empty)` for a
    /// well-formed Empty entry; anything not exactly what this build writes is refused.
    pub fn decode(entry: &[u8], slot: u32, superblock: &Superblock) -> std::result::Result<Self, HeaderVerdict> {
        if entry.len() != superblock.header_entry_bytes as usize || entry.len() < SLOT_HEADER_FIXED_BYTES + 4 {
            return Err(HeaderVerdict::Corrupt);
        }
        if entry.iter().all(|&byte| byte == 0) {
            return Err(HeaderVerdict::Zeroed);
        }
        let crc_at = entry.len() - 4;
        if crc32fast::hash(&entry[..crc_at]) != u32_at(entry, crc_at) {
            return Err(HeaderVerdict::Corrupt);
        }
        if u64_at(entry, 8) != pool_tag(&superblock.pool_uuid) || u32_at(entry, 16) != slot {
            return Err(HeaderVerdict::Corrupt);
        }
        if u64_at(entry, 0) > GENERATION_MAX {
            return Err(HeaderVerdict::Corrupt);
        }
        let count = u16::from_le_bytes([entry[22], entry[23]]) as usize;
        let flags = u32_at(entry, 24);
        match u16::from_le_bytes([entry[20], entry[21]]) {
            // Empty: no blocks, no flags, nothing else set.
            0 if entry[22..crc_at].iter().all(|&byte| byte == 0) => return Err(HeaderVerdict::Empty),
            1 => {}
            _ => return Err(HeaderVerdict::Corrupt),
        }
        // A Valid entry records payload CRCs exactly when the pool does.
        let pool_crcs = superblock.flags & FLAG_PAYLOAD_CRC != 0;
        let expected_flags = if pool_crcs { HEADER_FLAG_PAYLOAD_CRC } else { 0 };
        if count == 0 || count > superblock.blocks_per_slot as usize || block_record_offset(count) > crc_at || flags != expected_flags {
            return Err(HeaderVerdict::Corrupt);
        }
        if u32_at(entry, 28) != 0 || entry[block_record_offset(count)..crc_at].iter().any(|&byte| byte != 0) {
            return Err(HeaderVerdict::Corrupt);
        }
        let blocks = (0..count)
            .map(|j| {
                let at = block_record_offset(j);
                BlockRecord { key: u64_at(entry, at), token_count: u32_at(entry, at + 8), payload_crc: u32_at(entry, at + 12) }
            })
            .collect::<Vec<_>>();
        let bad_block = |b: &BlockRecord| {
            b.key == 0 || b.token_count == 0 || b.token_count > superblock.geometry.block_tokens || (!pool_crcs && b.payload_crc != 0)
        };
        if blocks.iter().any(bad_block) {
            return Err(HeaderVerdict::Corrupt);
        }
        Ok(Self { generation: u64_at(entry, 0), pool_tag: u64_at(entry, 8), slot, state: SlotState::Valid, flags, blocks })
    }
}

/// Whether `head` (a device's first bytes) is what a format interrupted before its superblock
/// leaves: [`format_pool`](crate::format_pool) first zeroes every device's superblock region,
/// then writes the slot-header region, and the superblock last. So the superblock region reads
/// zero and slot 0's entry, at byte `max(4096, LBA size)`, is a CRC-valid entry (the new pool's
/// Empty one, or the old pool's, Empty or Valid, where the interruption came before it). The
/// LBA size and the entry size are not known without the superblock, so every possible pair is
/// tried (LBAs 512 B..=64 KiB, entries 64 B..=32 KiB, powers of two: at most 50 CRCs); a CRC
/// matching by chance at a fixed place behind a zeroed region is a 2^-32 event per pair.
pub fn looks_like_unfinished_format(head: &[u8]) -> bool {
    let mut header_start = SUPERBLOCK_REGION_BYTES as usize;
    while header_start <= 1 << 16 {
        if head.len() < header_start || head[..header_start].iter().any(|&byte| byte != 0) {
            return false;
        }
        let mut entry_bytes = header_entry_bytes(0) as usize;
        while entry_bytes <= header_entry_bytes(BLOCKS_PER_SLOT_MAX) as usize {
            if let Some(entry) = head.get(header_start..header_start + entry_bytes) {
                let crc_at = entry_bytes - 4;
                let state = u16::from_le_bytes([entry[20], entry[21]]);
                if crc32fast::hash(&entry[..crc_at]) == u32_at(entry, crc_at)
                    && u32_at(entry, 16) == 0
                    && state <= 1
                    && u64_at(entry, 0) <= GENERATION_MAX
                {
                    return true;
                }
            }
            entry_bytes *= 2;
        }
        header_start *= 2;
    }
    false
}

#[cfg(test)]
mod proptests;

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> ModelGeometry {
        ModelGeometry { layers: 2, kv_heads: 1, head_dim: 128, dtype_bytes: 2, block_tokens: 16 }
        // 4 KiB objects
    }

    fn test_secret() -> KeySecret {
        KeySecret::from_bytes([0x5a; KEY_SECRET_BYTES]).unwrap()
    }

    #[test]
    fn the_key_secret_is_kept_at_bytes_120_to_152_and_never_printed() {
        // Goal: version 5 records the pool's key secret at bytes 120..152 (what docs/objstore.md's
        // table says) and reads it back; an all-zero one (a field never written) is corrupt; the
        // bytes after it stay reserved zero; and neither the superblock's Debug nor the error
        // prints a byte of it.
        let secret = KeySecret::from_bytes(core::array::from_fn(|i| 0xa0 + i as u8)).unwrap();
        let superblock = Superblock::plan(small(), 1, 512, 16 << 11, None, [7; 16], 0, 1, 0, secret).unwrap();
        let good = superblock.encode();
        assert_eq!(&good[120..152], secret.as_bytes());
        let decoded = Superblock::decode(&good, 0, 512, 16 << 11).unwrap();
        assert_eq!(decoded.key_secret, secret);
        assert_eq!(decoded, superblock);
        let printed = format!("{decoded:?} {decoded:#?}");
        assert!(printed.contains("KeySecret(<redacted>)"), "{printed}");
        // The bytes as Debug of an array, or as hex, would show these.
        for needle in ["160, 161", "a0a1", "0xa0, 0xa1", "160,\n"] {
            assert!(!printed.contains(needle), "{printed}");
        }
        let reseal = |mut bytes: [u8; SUPERBLOCK_ENCODED_BYTES]| {
            let crc = crc32fast::hash(&bytes[..SUPERBLOCK_CRC_OFFSET]);
            put_u32(&mut bytes, SUPERBLOCK_CRC_OFFSET, crc);
            bytes
        };
        let mut zeroed = good;
        zeroed[120..152].fill(0);
        let error = Superblock::decode(&reseal(zeroed), 2, 512, 16 << 11).unwrap_err();
        assert!(matches!(&error, ObjstoreError::CorruptSuperblock { device: 2, reason } if reason.contains("key secret")), "{error}");
        let mut reserved = good;
        reserved[152] = 1;
        let error = Superblock::decode(&reseal(reserved), 0, 512, 16 << 11).unwrap_err();
        assert!(matches!(&error, ObjstoreError::CorruptSuperblock { reason, .. } if reason.contains("reserved")), "{error}");
        let mut other = good;
        other[130] ^= 1;
        let other = Superblock::decode(&reseal(other), 0, 512, 16 << 11).unwrap();
        assert_ne!(other.key_secret, secret);
        assert_eq!(Superblock { key_secret: secret, ..other }, superblock);
    }

    fn plan() -> Superblock {
        Superblock::plan(small(), 1, 512, 16 << 11, None, [7; 16], 0, 2, 0, test_secret()).unwrap()
    }

    #[test]
    fn an_interrupted_format_is_recognised_by_its_first_entry_behind_a_zeroed_superblock() {
        // Goal: what format leaves when stopped before the superblock (a zeroed superblock region,
        // then slot 0's CRC-valid entry at max(4096, LBA size), of any entry size) is recognised;
        // zeroes alone, a non-zero superblock region, a broken CRC or another slot are not.
        let mut head = vec![0u8; 1 << 20];
        assert!(!looks_like_unfinished_format(&head), "all zeroes");
        for (header_start, entry_bytes) in [(4096, 64), (4096, 32768), (8192, 128), (65536, 4096)] {
            head.fill(0);
            encode_empty_entry(&mut head[header_start..header_start + entry_bytes], 0, 0x1234, 0);
            assert!(looks_like_unfinished_format(&head), "Empty entry of {entry_bytes} B at {header_start}");
            head[1] = 1;
            assert!(!looks_like_unfinished_format(&head), "a non-zero superblock region");
            head[1] = 0;
            head[header_start + 30] ^= 1;
            assert!(!looks_like_unfinished_format(&head), "a broken CRC");
        }
        // The old pool's Valid entry, where the format stopped before writing slot 0's.
        head.fill(0);
        let blocks = [BlockRecord { key: 9, token_count: 16, payload_crc: 0 }];
        encode_entry(&mut head[4096..4096 + 128], 5, 0x1234, 0, SlotState::Valid, false, &blocks);
        assert!(looks_like_unfinished_format(&head));
        head.fill(0);
        encode_empty_entry(&mut head[4096..4096 + 64], 0, 0x1234, 1);
        assert!(!looks_like_unfinished_format(&head), "slot 1's entry where slot 0's belongs");
        assert!(!looks_like_unfinished_format(&head[..4000]), "shorter than a superblock region");
    }

    #[test]
    fn plan_fits_the_namespace_and_round_trips() {
        // Goal: the planned layout lies inside the namespace, regions do not overlap, and the
        // encoding decodes to the same superblock.
        let sb = plan();
        let size = 16u64 << 20;
        assert_eq!(sb.header_lba, 8);
        assert!(sb.header_lba + sb.header_blocks <= sb.data_lba);
        assert_eq!(sb.data_lba * 512 % DATA_ALIGN_BYTES, 0);
        assert!(sb.data_lba * 512 + sb.slot_count * sb.slot_bytes <= size);
        assert_eq!(sb.slot_bytes, 16384);
        assert_eq!(sb.layer_stride_blocks(), 16);
        assert_eq!(Superblock::decode(&sb.encode(), 0, 512, 16 << 11).unwrap(), sb);
        let k4 = Superblock::plan(small(), 4, 512, 16 << 11, Some(10), [7; 16], 1, 2, 0, test_secret()).unwrap();
        assert_eq!(k4.slot_count, 10);
        assert_eq!(k4.header_entry_bytes, 128);
        assert_eq!(k4.layer_stride_blocks(), 64);
        assert_eq!(k4.block_lba(2, 3), k4.data_lba + 2 * 128 + 3 * 16);
        for superblock in [sb, k4] {
            let addressing = superblock.addressing();
            for slot in 0..superblock.slot_count as u32 {
                for index in 0..superblock.blocks_per_slot {
                    assert_eq!(addressing.block_lba(slot, index), superblock.block_lba(slot, index));
                }
            }
            assert_eq!(addressing.blocks_of(superblock.slot_bytes), superblock.slot_bytes / u64::from(superblock.lba_bytes));
        }
    }

    #[test]
    fn a_superblock_is_taken_on_a_larger_namespace_and_refused_on_one_its_slots_do_not_fit() {
        // Goal: decode re-plans the layout with the recorded slot count, so what it asks of the
        // namespace is that those slots fit: a superblock read on twice the namespace it was
        // formatted on (a copy onto a larger device, or a namespace grown since) is accepted,
        // the rest unused; on half of it, where its slots reach past the end, it is
        // CorruptSuperblock (docs/objstore.md, "Superblock", says so).
        let sb = plan();
        let size_blocks = 16 << 11;
        assert_eq!(Superblock::decode(&sb.encode(), 0, 512, size_blocks * 2).unwrap(), sb);
        let error = Superblock::decode(&sb.encode(), 0, 512, size_blocks / 2).unwrap_err();
        assert!(matches!(error, ObjstoreError::CorruptSuperblock { .. }), "{error}");
        // A pool formatted with fewer slots than its namespace holds also fits a smaller one.
        let few = Superblock::plan(small(), 1, 512, size_blocks, Some(16), [7; 16], 0, 2, 0, test_secret()).unwrap();
        assert_eq!(Superblock::decode(&few.encode(), 0, 512, size_blocks / 2).unwrap(), few);
    }

    #[test]
    fn damaged_superblocks_are_typed_errors() {
        // Goal: truncation, wrong magic, CRC failure, newer version, foreign LBA size, and a
        // layout that does not fit the namespace: each refused with what was expected.
        let sb = plan();
        let good = sb.encode();
        assert!(
            matches!(Superblock::decode(&good[..100], 0, 512, 16 << 11), Err(ObjstoreError::CorruptSuperblock { reason, .. }) if reason.contains("truncated"))
        );
        let mut magic = good;
        magic[0] ^= 1;
        assert!(
            matches!(Superblock::decode(&magic, 0, 512, 16 << 11), Err(ObjstoreError::CorruptSuperblock { reason, .. }) if reason.contains("magic"))
        );
        let mut flipped = good;
        flipped[90] ^= 0x40;
        assert!(
            matches!(Superblock::decode(&flipped, 0, 512, 16 << 11), Err(ObjstoreError::CorruptSuperblock { reason, .. }) if reason.contains("CRC"))
        );
        // A version field past this build's: unsealed, it may be damage and the message says so;
        // resealed (a newer tutti wrote it), the message says to open it with that version.
        let mut newer = good;
        put_u32(&mut newer, 8, FORMAT_VERSION + 1);
        match Superblock::decode(&newer, 3, 512, 16 << 11) {
            Err(error @ ObjstoreError::NewerFormatVersion { device: 3, found, supported: FORMAT_VERSION, sealed: false })
                if found == FORMAT_VERSION + 1 =>
            {
                assert!(error.to_string().contains("damaged version field"), "{error}")
            }
            other => panic!("{other:?}"),
        }
        let crc = crc32fast::hash(&newer[..SUPERBLOCK_CRC_OFFSET]);
        put_u32(&mut newer, SUPERBLOCK_CRC_OFFSET, crc);
        match Superblock::decode(&newer, 3, 512, 16 << 11) {
            Err(error @ ObjstoreError::NewerFormatVersion { device: 3, sealed: true, .. }) => {
                let message = error.to_string();
                assert!(message.contains("a newer tutti formatted") && !message.contains("damaged"), "{message}")
            }
            other => panic!("{other:?}"),
        }
        for older in [1, 2, 3, 4] {
            let mut bytes = good;
            // Versions before 5 kept these bytes zero (reserved): so does the one tested here.
            bytes[KEY_SECRET_OFFSET..KEY_SECRET_END].fill(0);
            put_u32(&mut bytes, 8, older);
            let crc = crc32fast::hash(&bytes[..SUPERBLOCK_CRC_OFFSET]);
            put_u32(&mut bytes, SUPERBLOCK_CRC_OFFSET, crc);
            let error = Superblock::decode(&bytes, 3, 512, 16 << 11).unwrap_err();
            assert!(
                matches!(&error, ObjstoreError::OlderFormatVersion { device: 3, found, supported: FORMAT_VERSION, .. } if *found == older),
                "{error}"
            );
            assert!(error.to_string().contains("tutti pool format"), "{error}");
            if older == 3 {
                assert!(error.to_string().contains("earlier hash scheme"), "{error}");
            }
            if older == 4 {
                assert!(error.to_string().contains("unkeyed"), "{error}");
            }
        }
        assert!(matches!(
            Superblock::decode(&good, 0, 4096, 16 << 8),
            Err(ObjstoreError::LbaSizeMismatch { device: 0, recorded: 512, namespace: 4096 })
        ));
        assert!(
            matches!(Superblock::decode(&good, 0, 512, 1 << 11), Err(ObjstoreError::CorruptSuperblock { reason, .. }) if reason.contains("does not fit"))
        );
        let zeros = [0u8; 512];
        assert!(Superblock::decode(&zeros, 0, 512, 16 << 11).is_err());
    }

    #[test]
    fn crc_valid_superblocks_with_extreme_fields_are_refused_without_overflow() {
        // Goal: a superblock whose CRC is right but whose fields are at their extremes (a
        // buggy or hostile tool wrote it) is a typed error: the object size 2^16^4 = 2^64 used
        // to overflow in `object_bytes` before any range check ran.
        let good = plan().encode();
        let reseal = |mut bytes: [u8; SUPERBLOCK_ENCODED_BYTES]| {
            let crc = crc32fast::hash(&bytes[..SUPERBLOCK_CRC_OFFSET]);
            put_u32(&mut bytes, SUPERBLOCK_CRC_OFFSET, crc);
            bytes
        };
        let mut extreme = good;
        for offset in [40, 44, 48, 52, 56] {
            put_u32(&mut extreme, offset, 1 << 16);
        }
        let error = Superblock::decode(&reseal(extreme), 0, 512, 16 << 11).unwrap_err();
        assert!(matches!(&error, ObjstoreError::CorruptSuperblock { reason, .. } if reason.contains("overflows")), "{error}");
        // Every field at its maximum, one at a time, never panics; the geometry and layout
        // fields are refused (the device count is checked against the pool at open).
        for offset in (32..120).step_by(4) {
            let mut bytes = good;
            put_u32(&mut bytes, offset, u32::MAX);
            let decoded = Superblock::decode(&reseal(bytes), 0, 512, 16 << 11);
            assert_eq!(decoded.is_err(), offset != 36, "u32 at {offset}: {decoded:?}");
        }
        for offset in (80..120).step_by(8) {
            let mut bytes = good;
            put_u64(&mut bytes, offset, u64::MAX);
            assert!(Superblock::decode(&reseal(bytes), 0, 512, u64::MAX).is_err(), "u64 at {offset}");
        }
    }

    #[test]
    fn more_slots_than_u32_numbers_are_refused_in_plan_and_on_disk() {
        // Goal: slots are numbered with u32 past the superblock, so neither a format nor a
        // CRC-valid superblock read back may record more: it used to be accepted on disk and
        // truncated (`slot_count as u32`), the index built for a handful of slots.
        let huge_namespace = 1u64 << 50;
        let over = (1u64 << 32) + 10;
        let error = Superblock::plan(small(), 1, 512, huge_namespace, Some(over), [7; 16], 0, 1, 0, test_secret()).unwrap_err();
        assert!(matches!(&error, ObjstoreError::InvalidFormat { reason } if reason.contains("at most")), "{error}");
        let most = Superblock::plan(small(), 1, 512, huge_namespace, Some(u64::from(u32::MAX)), [7; 16], 0, 1, 0, test_secret()).unwrap();
        assert_eq!(most.slot_count, u64::from(u32::MAX));
        let mut bytes = most.encode();
        put_u64(&mut bytes, 80, over);
        let crc = crc32fast::hash(&bytes[..SUPERBLOCK_CRC_OFFSET]);
        put_u32(&mut bytes, SUPERBLOCK_CRC_OFFSET, crc);
        let error = Superblock::decode(&bytes, 0, 512, huge_namespace).unwrap_err();
        assert!(matches!(&error, ObjstoreError::CorruptSuperblock { reason, .. } if reason.contains("at most")), "{error}");
    }

    #[test]
    fn headers_past_the_largest_generation_are_refused() {
        // Goal: a CRC-valid header claiming a generation above GENERATION_MAX is damage, not
        // the newest commit: taken as the pool's generation, the next commit would overflow
        // (or wrap, making every later header lose to older ones). GENERATION_MAX itself, the
        // largest the pool stages, is accepted.
        let sb = Superblock::plan(small(), 1, 512, 16 << 11, None, [9; 16], 0, 1, 0, test_secret()).unwrap();
        let header = |generation| SlotHeader {
            generation,
            pool_tag: pool_tag(&sb.pool_uuid),
            slot: 3,
            state: SlotState::Valid,
            flags: 0,
            blocks: vec![BlockRecord { key: 11, token_count: 16, payload_crc: 0 }],
        };
        let mut entry = vec![0u8; sb.header_entry_bytes as usize];
        header(GENERATION_MAX).encode_into(&mut entry);
        assert_eq!(SlotHeader::decode(&entry, 3, &sb), Ok(header(GENERATION_MAX)));
        for generation in [GENERATION_MAX + 1, u64::MAX] {
            header(generation).encode_into(&mut entry);
            assert_eq!(SlotHeader::decode(&entry, 3, &sb), Err(HeaderVerdict::Corrupt), "generation {generation}");
        }
    }

    #[test]
    fn slot_headers_round_trip_and_reject_damage() {
        // Goal: an encoded header decodes back; any flipped byte, a foreign tag or a header
        // found at another slot's position is refused (never data from the wrong slot); so
        // is a Valid header whose payload-CRC flag disagrees with the pool's.
        for pool_flags in [0, FLAG_PAYLOAD_CRC] {
            let sb = Superblock::plan(small(), 3, 512, 16 << 11, None, [9; 16], 0, 1, pool_flags, test_secret()).unwrap();
            let crcs = pool_flags != 0;
            let crc = |value: u32| if crcs { value } else { 0 };
            let header = SlotHeader {
                generation: 42,
                pool_tag: pool_tag(&sb.pool_uuid),
                slot: 5,
                state: SlotState::Valid,
                flags: if crcs { HEADER_FLAG_PAYLOAD_CRC } else { 0 },
                blocks: vec![
                    BlockRecord { key: 11, token_count: 16, payload_crc: crc(0xDEAD_BEEF) },
                    BlockRecord { key: 12, token_count: 16, payload_crc: crc(0x1234_5678) },
                ],
            };
            let mut entry = vec![0u8; sb.header_entry_bytes as usize];
            header.encode_into(&mut entry);
            assert_eq!(SlotHeader::decode(&entry, 5, &sb).unwrap(), header);
            if crcs {
                assert_eq!(u32_at(&entry, payload_crc_offset(1)), 0x1234_5678);
            }
            assert_eq!(SlotHeader::decode(&entry, 6, &sb), Err(HeaderVerdict::Corrupt));
            for index in 0..entry.len() {
                let mut damaged = entry.clone();
                damaged[index] ^= 0x10;
                assert!(SlotHeader::decode(&damaged, 5, &sb).is_err(), "flip at byte {index} accepted");
            }
            let other_pool = Superblock { pool_uuid: [1; 16], ..sb };
            assert_eq!(SlotHeader::decode(&entry, 5, &other_pool), Err(HeaderVerdict::Corrupt));
            let other_flags = Superblock { flags: pool_flags ^ FLAG_PAYLOAD_CRC, ..sb };
            assert_eq!(SlotHeader::decode(&entry, 5, &other_flags), Err(HeaderVerdict::Corrupt));
        }
    }

    #[test]
    fn empty_headers_carry_tag_and_crc_and_zeroes_are_damage() {
        // Goal: the Empty entry format writes decodes as Empty only for its own pool and slot,
        // every single-byte flip of it is refused, and an all-zero entry (a zeroed header
        // region) is `Zeroed`, not Empty: committed blocks cannot vanish silently.
        let sb = Superblock::plan(small(), 1, 512, 16 << 11, None, [9; 16], 0, 1, FLAG_PAYLOAD_CRC, test_secret()).unwrap();
        let mut entry = vec![0u8; sb.header_entry_bytes as usize];
        encode_empty_entry(&mut entry, 7, pool_tag(&sb.pool_uuid), 3);
        assert_eq!(SlotHeader::decode(&entry, 3, &sb), Err(HeaderVerdict::Empty));
        assert_eq!(SlotHeader::decode(&entry, 4, &sb), Err(HeaderVerdict::Corrupt));
        let other_pool = Superblock { pool_uuid: [1; 16], ..sb };
        assert_eq!(SlotHeader::decode(&entry, 3, &other_pool), Err(HeaderVerdict::Corrupt));
        for index in 0..entry.len() {
            let mut damaged = entry.clone();
            damaged[index] ^= 0x01;
            assert_eq!(SlotHeader::decode(&damaged, 3, &sb), Err(HeaderVerdict::Corrupt), "flip at byte {index}");
        }
        assert_eq!(SlotHeader::decode(&vec![0u8; entry.len()], 3, &sb), Err(HeaderVerdict::Zeroed));
        // An Empty state with a block count (or any other field) set is not a clean Empty entry.
        let mut with_count = entry.clone();
        with_count[22] = 1;
        let crc_at = with_count.len() - 4;
        let crc = crc32fast::hash(&with_count[..crc_at]);
        put_u32(&mut with_count, crc_at, crc);
        assert_eq!(SlotHeader::decode(&with_count, 3, &sb), Err(HeaderVerdict::Corrupt));
    }
}
