//! Fuzzes what objstore reads from a device before it trusts anything there: a superblock
//! (`Superblock::decode`, for a namespace the input describes), a slot-header entry
//! (`SlotHeader::decode`, against a superblock planned from the input) and a device's first
//! bytes (`looks_like_unfinished_format`, which `tutti pool format` asks before it writes). Each
//! must answer with a typed error, a verdict or a bool, never panic; what decodes must be
//! exactly what this build writes for it (the bytes encode back), as the decoders document.
//!
//! Input: 16 bytes of parameters, then the device bytes.
//! - byte 0: the LBA size, 512 << (byte % 8) (512..=65536, as a namespace has);
//! - bytes 1..9: the namespace's size in LBAs (any u64);
//! - byte 9: the device index; bit 7 of byte 10: the pool records payload CRCs;
//! - bytes 10..12 (low 15 bits): k, reduced to 1..=the most whose header entry fits one LBA;
//! - bytes 12..16: the slot number the entry is checked against;
//! - the rest: decoded as a superblock from its start, as a header entry from its end (the last
//!   `header_entry_bytes(k)` bytes), and given whole to `looks_like_unfinished_format`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use objstore::format::{
    encode_empty_entry, header_entry_bytes, looks_like_unfinished_format, pool_tag, HeaderVerdict, SlotHeader, Superblock,
    FLAG_PAYLOAD_CRC, GENERATION_MAX, SUPERBLOCK_ENCODED_BYTES, SUPERBLOCK_REGION_BYTES,
};
use objstore::hash::KeySecret;
use objstore::ModelGeometry;

/// The pool the planned superblock belongs to (the fuzzer finds its tag by comparison).
const POOL_UUID: [u8; 16] = *b"fuzzed tutti kv!";
/// Its key secret (any non-zero bytes: it changes no layout or header check).
const SECRET: [u8; 32] = *b"fuzzed tutti kv! fuzzed tutti kv";

fuzz_target!(|data: &[u8]| {
    let Some((params, device_bytes)) = data.split_first_chunk::<16>() else { return };
    let lba_bytes = 512u32 << (params[0] % 8);
    let size_blocks = u64::from_le_bytes(params[1..9].try_into().expect("8 bytes"));
    let device = usize::from(params[9]);
    let k_raw = u16::from_le_bytes([params[10], params[11]]);
    let flags = if k_raw & 0x8000 != 0 { FLAG_PAYLOAD_CRC } else { 0 };
    let slot = u32::from_le_bytes(params[12..16].try_into().expect("4 bytes"));

    // A superblock from arbitrary bytes on an arbitrary namespace.
    if let Ok(superblock) = Superblock::decode(device_bytes, device, lba_bytes, size_blocks) {
        assert_eq!(&superblock.encode()[..], &device_bytes[..SUPERBLOCK_ENCODED_BYTES], "accepted {superblock:?}");
        assert_eq!(superblock.lba_bytes, lba_bytes);
    }

    // A slot-header entry of a real pool: 64 KiB objects (a whole number of every LBA size),
    // k as large as one LBA's entry allows, on a namespace with room for a few slots.
    let k_max = ((u64::from(lba_bytes) - 36) / 16) as u32;
    let k = 1 + u32::from(k_raw & 0x7fff) % k_max.min(1024);
    let geometry = ModelGeometry { layers: 2, kv_heads: 16, head_dim: 128, dtype_bytes: 2, block_tokens: 16 };
    let slot_bytes = geometry.block_bytes() * u64::from(k);
    let planned_blocks = ((4 << 20) + 4 * slot_bytes) / u64::from(lba_bytes);
    let superblock = Superblock::plan(
        geometry,
        k,
        lba_bytes,
        planned_blocks,
        None,
        POOL_UUID,
        0,
        1,
        flags,
        KeySecret::from_bytes(SECRET).expect("a non-zero secret"),
    )
    .expect("a plannable pool");
    let entry_bytes = header_entry_bytes(k) as usize;
    if let Some(entry) = device_bytes.len().checked_sub(entry_bytes).map(|start| &device_bytes[start..]) {
        let tag = pool_tag(&POOL_UUID);
        let mut spelled = vec![0u8; entry.len()];
        match SlotHeader::decode(entry, slot, &superblock) {
            Ok(header) => {
                assert_eq!((header.slot, header.pool_tag), (slot, tag));
                assert!(header.generation <= GENERATION_MAX);
                assert!((1..=k as usize).contains(&header.blocks.len()));
                header.encode_into(&mut spelled);
                assert_eq!(&spelled[..], entry, "accepted {header:?}");
            }
            Err(HeaderVerdict::Empty) => {
                let generation = u64::from_le_bytes(entry[..8].try_into().expect("8 bytes"));
                assert!(generation <= GENERATION_MAX);
                encode_empty_entry(&mut spelled, generation, tag, slot);
                assert_eq!(&spelled[..], entry, "an Empty verdict");
            }
            Err(HeaderVerdict::Zeroed) => assert!(entry.iter().all(|&byte| byte == 0)),
            Err(HeaderVerdict::Corrupt) => {}
        }
    }

    // A device's first bytes: an unfinished format has a zeroed superblock region.
    if looks_like_unfinished_format(device_bytes) {
        assert!(device_bytes[..SUPERBLOCK_REGION_BYTES as usize].iter().all(|&byte| byte == 0));
    }
});
