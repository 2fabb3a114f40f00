//! The committed seeds of the `objstore_format` fuzz target (fuzz/seeds/objstore_format/), built
//! here from the crate's own encoders. A seed written by hand, or by an older build, goes stale
//! when the pool format changes: every mutation of it then starts from bytes the decoders refuse
//! at their first check, and the fuzzer starts blind. So each committed seed must equal what is
//! built here and reach what it was made for, read as the target reads its input
//! (fuzz/fuzz_targets/objstore_format.rs; `target_reads` repeats its layout).
//!
//! After a format change: `cargo test -p objstore --test fuzz_seeds -- --ignored write_fuzz_seeds`.

use std::path::PathBuf;

use objstore::format::{
    encode_empty_entry, header_entry_bytes, looks_like_unfinished_format, pool_tag, BlockRecord, HeaderVerdict, SlotHeader, SlotState,
    Superblock, FLAG_PAYLOAD_CRC, HEADER_FLAG_PAYLOAD_CRC, MAGIC, SUPERBLOCK_ENCODED_BYTES, SUPERBLOCK_REGION_BYTES,
};
use objstore::hash::KeySecret;
use objstore::ModelGeometry;

/// The target's pool: its UUID and geometry (the slot-header entry is checked against a
/// superblock planned from them).
const POOL_UUID: [u8; 16] = *b"fuzzed tutti kv!";
const GEOMETRY: ModelGeometry = ModelGeometry { layers: 2, kv_heads: 16, head_dim: 128, dtype_bytes: 2, block_tokens: 16 };

/// The target's key secret (`SECRET` there).
fn secret() -> KeySecret {
    KeySecret::from_bytes(*b"fuzzed tutti kv! fuzzed tutti kv").expect("a non-zero secret")
}

fn seed_directory() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/objstore_format")
}

/// The target's 16 parameter bytes: byte 0 the LBA size (512 << (byte % 8)), bytes 1..9 the
/// namespace's LBAs, byte 9 the device index, bytes 10..12 k - 1 (low 15 bits; bit 15 payload
/// CRCs), bytes 12..16 the slot.
fn params(lba_shift: u8, size_blocks: u64, device: u8, k: u16, payload_crcs: bool, slot: u32) -> Vec<u8> {
    let mut out = vec![lba_shift];
    out.extend_from_slice(&size_blocks.to_le_bytes());
    out.push(device);
    out.extend_from_slice(&((k - 1) | if payload_crcs { 0x8000 } else { 0 }).to_le_bytes());
    out.extend_from_slice(&slot.to_le_bytes());
    out
}

/// The LBAs of the namespace the target plans its pool on, for k blocks per slot.
fn target_planned_blocks(lba_bytes: u32, k: u32) -> u64 {
    ((4 << 20) + 4 * GEOMETRY.block_bytes() * u64::from(k)) / u64::from(lba_bytes)
}

fn valid_entry(k: u32, generation: u64, slot: u32, payload_crcs: bool, blocks: Vec<BlockRecord>) -> Vec<u8> {
    let header = SlotHeader {
        generation,
        pool_tag: pool_tag(&POOL_UUID),
        slot,
        state: SlotState::Valid,
        flags: if payload_crcs { HEADER_FLAG_PAYLOAD_CRC } else { 0 },
        blocks,
    };
    let mut entry = vec![0u8; header_entry_bytes(k) as usize];
    header.encode_into(&mut entry);
    entry
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    // A format interrupted before its superblock: a zeroed superblock region, then slot 0's
    // Empty entry (512-byte LBAs, k = 1).
    let mut unfinished = params(0, 0x20_0000, 0, 1, false, 0);
    unfinished.resize(unfinished.len() + SUPERBLOCK_REGION_BYTES as usize, 0);
    let mut empty = vec![0u8; header_entry_bytes(1) as usize];
    encode_empty_entry(&mut empty, 5, pool_tag(&POOL_UUID), 0);
    unfinished.extend_from_slice(&empty);

    // A Valid entry of slot 7 (k = 1, no payload CRCs) behind a superblock that is only magic.
    let mut slot_7 = params(0, 0x20_0000, 0, 1, false, 7);
    let mut magic_only = [0u8; SUPERBLOCK_ENCODED_BYTES];
    magic_only[..MAGIC.len()].copy_from_slice(&MAGIC);
    slot_7.extend_from_slice(&magic_only);
    slot_7.extend_from_slice(&valid_entry(
        1,
        9,
        7,
        false,
        vec![BlockRecord { key: 0x1234_5678_9abc_def0, token_count: 16, payload_crc: 0 }],
    ));

    // A superblock this build writes for the namespace the parameters describe (4 KiB LBAs,
    // k = 4, payload CRCs), then a Valid entry of slot 2 with two blocks and their CRCs.
    let (lba_bytes, k) = (4096, 4);
    let size_blocks = target_planned_blocks(lba_bytes, k);
    let superblock =
        Superblock::plan(GEOMETRY, k, lba_bytes, size_blocks, None, POOL_UUID, 0, 1, FLAG_PAYLOAD_CRC, secret()).expect("a plannable pool");
    let mut formatted = params(3, size_blocks, 0, k as u16, true, 2);
    formatted.extend_from_slice(&superblock.encode());
    let blocks = vec![
        BlockRecord { key: 0x0bad_cafe_0000_0001, token_count: 16, payload_crc: 0x1111_2222 },
        BlockRecord { key: 0x0bad_cafe_0000_0002, token_count: 5, payload_crc: 0x3333_4444 },
    ];
    formatted.extend_from_slice(&valid_entry(k, 12, 2, true, blocks));

    vec![("unfinished_format_empty_entry", unfinished), ("valid_entry_slot_7", slot_7), ("valid_superblock_and_crc_entry", formatted)]
}

/// What the target's decoders make of an input, read exactly as the target lays it out.
#[derive(Debug, PartialEq, Eq)]
struct Reached {
    superblock: Result<(), String>,
    /// `Ok` for a Valid header, else the verdict; `None` when the input is shorter than an entry.
    header: Option<Result<(), HeaderVerdict>>,
    unfinished_format: bool,
}

fn target_reads(data: &[u8]) -> Option<Reached> {
    let (params, device_bytes) = data.split_first_chunk::<16>()?;
    let lba_bytes = 512u32 << (params[0] % 8);
    let size_blocks = u64::from_le_bytes(params[1..9].try_into().expect("8 bytes"));
    let device = usize::from(params[9]);
    let k_raw = u16::from_le_bytes([params[10], params[11]]);
    let flags = if k_raw & 0x8000 != 0 { FLAG_PAYLOAD_CRC } else { 0 };
    let slot = u32::from_le_bytes(params[12..16].try_into().expect("4 bytes"));
    let superblock = Superblock::decode(device_bytes, device, lba_bytes, size_blocks).map(drop).map_err(|error| error.to_string());
    let k_max = ((u64::from(lba_bytes) - 36) / 16) as u32;
    let k = 1 + u32::from(k_raw & 0x7fff) % k_max.min(1024);
    let planned = Superblock::plan(GEOMETRY, k, lba_bytes, target_planned_blocks(lba_bytes, k), None, POOL_UUID, 0, 1, flags, secret())
        .expect("a plannable pool");
    let entry_bytes = header_entry_bytes(k) as usize;
    let header =
        device_bytes.len().checked_sub(entry_bytes).map(|start| SlotHeader::decode(&device_bytes[start..], slot, &planned).map(drop));
    Some(Reached { superblock, header, unfinished_format: looks_like_unfinished_format(device_bytes) })
}

#[test]
#[ignore = "writes fuzz/seeds/objstore_format; run by hand after changing the seeds"]
fn write_fuzz_seeds() {
    std::fs::create_dir_all(seed_directory()).expect("seed directory");
    for (name, data) in seeds() {
        std::fs::write(seed_directory().join(name), data).expect("write seed");
    }
}

#[test]
fn committed_fuzz_seeds_are_current_and_decode_as_the_target_reads_them() {
    // Goal: the committed seeds are the ones this file builds, and each reaches what it is for
    // (an Empty entry behind a zeroed superblock region, a Valid entry, a superblock accepted
    // on its namespace) — else the fuzzer starts blind. The fuzzer reads every file of the
    // directory: none may be there that this file does not build.
    let mut committed: Vec<String> = std::fs::read_dir(seed_directory())
        .expect("seed directory")
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut built: Vec<String> = seeds().iter().map(|(name, _)| name.to_string()).collect();
    committed.sort();
    built.sort();
    assert_eq!(committed, built, "fuzz/seeds/objstore_format holds files this test does not build");
    for (name, data) in seeds() {
        let committed = std::fs::read(seed_directory().join(name)).unwrap_or_default();
        assert!(
            committed == data,
            "seed objstore_format/{name} is stale ({} bytes committed, {} built): run `cargo test -p objstore --test fuzz_seeds -- --ignored write_fuzz_seeds`",
            committed.len(),
            data.len()
        );
        let reached = target_reads(&committed).unwrap_or_else(|| panic!("seed objstore_format/{name} is shorter than the parameters"));
        let (superblock, header, unfinished_format) = match name {
            "unfinished_format_empty_entry" => (false, Err(HeaderVerdict::Empty), true),
            "valid_entry_slot_7" => (false, Ok(()), false),
            "valid_superblock_and_crc_entry" => (true, Ok(()), false),
            other => panic!("no expectation for seed {other}"),
        };
        assert_eq!(reached.superblock.is_ok(), superblock, "seed objstore_format/{name}: {reached:?}");
        assert_eq!(reached.header, Some(header), "seed objstore_format/{name}");
        assert_eq!(reached.unfinished_format, unfinished_format, "seed objstore_format/{name}");
    }
}
