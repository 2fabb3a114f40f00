//! Property tests of the on-disk format's decoders (docs/objstore.md): the superblock and the
//! slot-header entries are read back from a disk that may hold anything (another pool, a torn
//! write, a zeroed region, a buggy tool), so they are untrusted. The examples in `format.rs`
//! pin particular cases; these generate thousands of layouts and entries: arbitrary bytes never
//! panic, every planned superblock and valid header round-trips exactly, a single damaged byte
//! is always refused (the CRC covers every byte that is decoded), and whatever a decoder accepts
//! is exactly what the encoder writes for the value it returns.

use proptest::prelude::*;
use proptest::sample::Index;

use super::*;

/// 512 cases per property: each runs in about a second on one core.
fn config() -> ProptestConfig {
    ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() }
}

fn geometry() -> impl Strategy<Value = ModelGeometry> {
    (1..=8u32, 1..=8u32, prop_oneof![Just(64u32), Just(128), Just(256)], 1..=2u32, prop_oneof![Just(16u32), Just(32), Just(64)]).prop_map(
        |(layers, kv_heads, head_dim, dtype_bytes, block_tokens)| ModelGeometry { layers, kv_heads, head_dim, dtype_bytes, block_tokens },
    )
}

/// A planned superblock and the namespace size (in LBAs) it was planned for.
fn planned() -> impl Strategy<Value = (Superblock, u64)> {
    let lba_bytes = prop_oneof![Just(512u32), Just(4096)];
    // The largest k whose entry fits a 512-byte LBA is 29; a 4 KiB one holds 253.
    let blocks_per_slot = prop_oneof![1..=4u32, 1..=29u32, 200..=253u32];
    // From too small for one slot to 256 MiB.
    let namespace_bytes = prop_oneof![(1u64 << 20)..(4 << 20), (1u64 << 20)..(256 << 20)];
    let slot_count_max = prop::option::of(1..=2000u64);
    let device = (1..=8u32).prop_flat_map(|count| (0..count, Just(count)));
    let flags = prop_oneof![Just(0u32), Just(FLAG_PAYLOAD_CRC)];
    let secret = any::<[u8; KEY_SECRET_BYTES]>();
    (geometry(), blocks_per_slot, lba_bytes, namespace_bytes, slot_count_max, any::<[u8; 16]>(), device, flags, secret).prop_filter_map(
        "the parameters plan a pool",
        |(geometry, blocks_per_slot, lba_bytes, namespace_bytes, slot_count_max, uuid, (index, count), flags, secret)| {
            let size_blocks = namespace_bytes / u64::from(lba_bytes);
            let secret = KeySecret::from_bytes(secret).ok()?;
            let superblock =
                Superblock::plan(geometry, blocks_per_slot, lba_bytes, size_blocks, slot_count_max, uuid, index, count, flags, secret)
                    .ok()?;
            Some((superblock, size_blocks))
        },
    )
}

/// One damage to a stored structure: what a disk (or a torn write) can hand back.
#[derive(Debug, Clone)]
enum Damage {
    /// XOR one byte with a non-zero mask.
    Flip { at: Index, mask: u8 },
    /// Keep only the first `length` bytes (`length` below the structure's length).
    Truncate { length: Index },
    /// Append bytes.
    Extend { tail: Vec<u8> },
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        2 => (any::<Index>(), 1..=u8::MAX).prop_map(|(at, mask)| Damage::Flip { at, mask }),
        1 => any::<Index>().prop_map(|length| Damage::Truncate { length }),
        1 => prop::collection::vec(any::<u8>(), 1..16).prop_map(|tail| Damage::Extend { tail }),
    ]
}

fn damaged(bytes: &[u8], damage: &Damage) -> Vec<u8> {
    let mut out = bytes.to_vec();
    match damage {
        Damage::Flip { at, mask } => out[at.index(bytes.len())] ^= mask,
        Damage::Truncate { length } => out.truncate(length.index(bytes.len())),
        Damage::Extend { tail } => out.extend_from_slice(tail),
    }
    out
}

/// A value to store in a field: near what was there, an extreme, or anything.
fn field_value() -> impl Strategy<Value = i128> {
    prop_oneof![-2i128..=2, Just(i128::from(u32::MAX)), Just(i128::from(u64::MAX)), any::<u64>().prop_map(i128::from)]
}

fn reseal_superblock(bytes: &mut [u8]) {
    let crc = crc32fast::hash(&bytes[..SUPERBLOCK_CRC_OFFSET]);
    put_u32(bytes, SUPERBLOCK_CRC_OFFSET, crc);
}

fn reseal_entry(entry: &mut [u8]) {
    let crc_at = entry.len() - 4;
    let crc = crc32fast::hash(&entry[..crc_at]);
    put_u32(entry, crc_at, crc);
}

/// A Valid header this superblock's pool could have written at some slot.
fn valid_header(superblock: Superblock) -> impl Strategy<Value = SlotHeader> {
    let crcs = superblock.flags & FLAG_PAYLOAD_CRC != 0;
    let block = (
        prop_oneof![Just(1u64), Just(u64::MAX), 1..=u64::MAX],
        1..=superblock.geometry.block_tokens,
        any::<u32>().prop_map(move |crc| if crcs { crc } else { 0 }),
    )
        .prop_map(|(key, token_count, payload_crc)| BlockRecord { key, token_count, payload_crc });
    let generation = prop_oneof![Just(0u64), Just(GENERATION_MAX), 0..=GENERATION_MAX];
    let slot = prop_oneof![Just(0u32), Just(u32::MAX), 0..superblock.slot_count as u32];
    let blocks = prop::collection::vec(block, 1..=superblock.blocks_per_slot as usize);
    (generation, slot, blocks).prop_map(move |(generation, slot, blocks)| SlotHeader {
        generation,
        pool_tag: pool_tag(&superblock.pool_uuid),
        slot,
        state: SlotState::Valid,
        flags: if crcs { HEADER_FLAG_PAYLOAD_CRC } else { 0 },
        blocks,
    })
}

/// A planned superblock, one Valid header of its pool and that header's entry bytes.
fn pool_and_header() -> impl Strategy<Value = (Superblock, SlotHeader, Vec<u8>)> {
    planned().prop_flat_map(|(superblock, _)| (Just(superblock), valid_header(superblock))).prop_map(|(superblock, header)| {
        let mut entry = vec![0u8; superblock.header_entry_bytes as usize];
        header.encode_into(&mut entry);
        (superblock, header, entry)
    })
}

/// The entry bytes a decoder's answer stands for: an accepted header must be exactly what
/// `encode_into` writes for it, an Empty verdict exactly an Empty entry of that slot and pool
/// (any generation), a Zeroed one all zeroes.
fn check_canonical(
    entry: &[u8],
    slot: u32,
    superblock: &Superblock,
    verdict: &std::result::Result<SlotHeader, HeaderVerdict>,
) -> std::result::Result<(), TestCaseError> {
    match verdict {
        Ok(header) => {
            prop_assert_eq!(header.slot, slot);
            prop_assert_eq!(header.pool_tag, pool_tag(&superblock.pool_uuid));
            prop_assert!(header.generation <= GENERATION_MAX);
            let mut spelled = vec![0u8; entry.len()];
            header.encode_into(&mut spelled);
            prop_assert_eq!(&spelled[..], entry, "accepted {:?}", header);
        }
        Err(HeaderVerdict::Empty) => {
            let mut spelled = vec![0u8; entry.len()];
            encode_empty_entry(&mut spelled, u64_at(entry, 0), pool_tag(&superblock.pool_uuid), slot);
            prop_assert_eq!(&spelled[..], entry, "an Empty verdict");
            prop_assert!(u64_at(entry, 0) <= GENERATION_MAX);
        }
        Err(HeaderVerdict::Zeroed) => prop_assert!(entry.iter().all(|&byte| byte == 0)),
        Err(HeaderVerdict::Corrupt) => {}
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn planned_superblocks_round_trip((superblock, size_blocks) in planned(), device in 0..64usize) {
        // Goal: every layout `plan` produces decodes from its 256 bytes, and from the zero-padded
        // region `read_superblock` reads, to exactly itself on the namespace it was planned for,
        // and lies inside that namespace.
        let bytes = superblock.encode();
        let decode = |bytes: &[u8]| Superblock::decode(bytes, device, superblock.lba_bytes, size_blocks);
        prop_assert_eq!(decode(&bytes).unwrap(), superblock);
        let mut region = vec![0u8; SUPERBLOCK_REGION_BYTES.max(u64::from(superblock.lba_bytes)) as usize];
        region[..SUPERBLOCK_ENCODED_BYTES].copy_from_slice(&bytes);
        prop_assert_eq!(decode(&region).unwrap(), superblock);
        let lba = u64::from(superblock.lba_bytes);
        prop_assert!(superblock.header_lba * lba >= SUPERBLOCK_REGION_BYTES);
        prop_assert!(superblock.header_lba + superblock.header_blocks <= superblock.data_lba);
        prop_assert!(superblock.header_region_bytes() >= superblock.slot_count * u64::from(superblock.header_entry_bytes));
        prop_assert!(superblock.data_lba * lba + superblock.slot_count * superblock.slot_bytes <= size_blocks * lba);
    }

    #[test]
    fn arbitrary_superblock_bytes_are_refused_or_their_own_encoding(
        plain in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..=64),
            prop::collection::vec(any::<u8>(), SUPERBLOCK_ENCODED_BYTES - 8..=SUPERBLOCK_ENCODED_BYTES + 8),
            prop::collection::vec(any::<u8>(), 0..=600),
        ],
        sealed_fields in prop::collection::vec(any::<u8>(), SUPERBLOCK_ENCODED_BYTES - 16),
        zero_reserved in any::<bool>(),
        window_at in any::<Index>(),
        window_bytes in 1..=16usize,
        (superblock, size_blocks) in planned(),
    ) {
        // Goal: whatever LBA 0 holds decodes (no panic, no overflow) to a typed error or to the
        // superblock whose encoding it is. The sealed case has the magic, version, length and a
        // correct CRC around arbitrary fields, so it reaches the range checks and the re-plan.
        let mut sealed = vec![0u8; SUPERBLOCK_ENCODED_BYTES];
        sealed[..8].copy_from_slice(&MAGIC);
        put_u32(&mut sealed, 8, FORMAT_VERSION);
        put_u32(&mut sealed, 12, SUPERBLOCK_ENCODED_BYTES as u32);
        sealed[16..SUPERBLOCK_ENCODED_BYTES].copy_from_slice(&sealed_fields);
        if zero_reserved {
            sealed[76..80].fill(0);
            // The key secret (120..152) stays arbitrary: almost never all zeroes.
            sealed[KEY_SECRET_END..SUPERBLOCK_CRC_OFFSET].fill(0);
        }
        reseal_superblock(&mut sealed);
        // The planned superblock with a window of its fields or reserved bytes overwritten by
        // arbitrary bytes, resealed: close enough to a real layout to pass the re-plan at times.
        let mut window = superblock.encode().to_vec();
        let start = 8 + window_at.index(SUPERBLOCK_CRC_OFFSET - 8);
        let end = (start + window_bytes).min(SUPERBLOCK_CRC_OFFSET);
        window[start..end].copy_from_slice(&sealed_fields[..end - start]);
        reseal_superblock(&mut window);
        for bytes in [&plain, &sealed, &window] {
            for (lba_bytes, size_blocks) in [(superblock.lba_bytes, size_blocks), (512, u64::MAX), (4096, 0)] {
                if let Ok(decoded) = Superblock::decode(bytes, 0, lba_bytes, size_blocks) {
                    prop_assert_eq!(&decoded.encode()[..], &bytes[..SUPERBLOCK_ENCODED_BYTES]);
                }
            }
        }
    }

    #[test]
    fn any_single_damage_to_a_superblock_is_refused((superblock, size_blocks) in planned(), damage in damage()) {
        // Goal: a flipped byte anywhere in the 256 encoded bytes (magic, version, any field,
        // reserved bytes or the CRC itself) or a truncation is a typed error, never a superblock
        // with another field; bytes past the 256 (the region's padding) are not part of it, so
        // appending them changes nothing.
        let bytes = superblock.encode();
        let bad = damaged(&bytes, &damage);
        match Superblock::decode(&bad, 0, superblock.lba_bytes, size_blocks) {
            Ok(decoded) => {
                prop_assert!(matches!(damage, Damage::Extend { .. }), "{:?} decoded to {:?}", damage, decoded);
                prop_assert_eq!(decoded, superblock);
            }
            Err(error) => prop_assert!(
                matches!(
                    error,
                    ObjstoreError::CorruptSuperblock { device: 0, .. }
                        | ObjstoreError::NewerFormatVersion { device: 0, sealed: false, .. }
                ),
                "{:?}: {}", damage, error
            ),
        }
    }

    #[test]
    fn resealed_superblock_fields_are_refused_or_their_own_encoding(
        (superblock, size_blocks) in planned(),
        field in 0..23usize,
        value in field_value(),
    ) {
        // Goal: a superblock with one field rewritten and a correct CRC (another tool, or one
        // copied from another namespace) is refused, or is exactly the encoding of a layout
        // that fits this namespace (decode re-plans it). Fields are the u32 words at 8..80 and
        // the u64 words at 80..120; the value is near the old one, an extreme, or anything.
        let mut bytes = superblock.encode();
        let (offset, width) = if field < 18 { (8 + 4 * field, 4) } else { (80 + 8 * (field - 18), 8) };
        if width == 4 {
            let old = i128::from(u32_at(&bytes, offset));
            put_u32(&mut bytes, offset, (old + value) as u32);
        } else {
            let old = i128::from(u64_at(&bytes, offset));
            put_u64(&mut bytes, offset, (old + value) as u64);
        }
        reseal_superblock(&mut bytes);
        if let Ok(decoded) = Superblock::decode(&bytes, 0, superblock.lba_bytes, size_blocks) {
            prop_assert_eq!(decoded.encode(), bytes);
            let again = Superblock::plan(
                decoded.geometry,
                decoded.blocks_per_slot,
                decoded.lba_bytes,
                size_blocks,
                Some(decoded.slot_count),
                decoded.pool_uuid,
                decoded.device_index,
                decoded.device_count,
                decoded.flags,
                decoded.key_secret,
            );
            prop_assert_eq!(again.ok(), Some(decoded));
        }
    }

    #[test]
    fn valid_headers_round_trip_only_at_their_slot_and_pool(
        (superblock, header, entry) in pool_and_header(),
        other_uuid in any::<[u8; 16]>(),
    ) {
        // Goal: a Valid header decodes to exactly itself at its own slot of its own pool, and
        // is Corrupt at any other slot or in a pool with another tag (never another slot's
        // blocks served); the Empty entry of the slot decodes as Empty.
        prop_assert_eq!(SlotHeader::decode(&entry, header.slot, &superblock), Ok(header.clone()));
        prop_assert_eq!(SlotHeader::decode(&entry, header.slot.wrapping_add(1), &superblock), Err(HeaderVerdict::Corrupt));
        prop_assert_eq!(SlotHeader::decode(&entry, header.slot ^ 0x8000_0000, &superblock), Err(HeaderVerdict::Corrupt));
        let other = Superblock { pool_uuid: other_uuid, ..superblock };
        if pool_tag(&other_uuid) != header.pool_tag {
            prop_assert_eq!(SlotHeader::decode(&entry, header.slot, &other), Err(HeaderVerdict::Corrupt));
        }
        let mut empty = vec![0u8; entry.len()];
        encode_empty_entry(&mut empty, header.generation, header.pool_tag, header.slot);
        prop_assert_eq!(SlotHeader::decode(&empty, header.slot, &superblock), Err(HeaderVerdict::Empty));
        prop_assert_eq!(SlotHeader::decode(&empty, header.slot.wrapping_add(1), &superblock), Err(HeaderVerdict::Corrupt));
    }

    #[test]
    fn arbitrary_entries_are_refused_or_their_own_encoding(
        (superblock, header, _) in pool_and_header(),
        plain in prop::collection::vec(any::<u8>(), 0..=600),
        near in prop::collection::vec(any::<u8>(), 0..=16),
        sealed_words in prop::collection::vec(any::<u8>(), 256),
        state in prop_oneof![Just(0u16), Just(1), any::<u16>()],
        count in 0..=300u16,
        flags in prop_oneof![Just(0u32), Just(HEADER_FLAG_PAYLOAD_CRC), any::<u32>()],
        zero_reserved in any::<bool>(),
    ) {
        // Goal: whatever a header slot holds decodes (no panic) to Corrupt, to Zeroed only when
        // all zeroes, to Empty only when it is this slot's Empty entry, or to a header whose
        // encoding it is exactly. Lengths around the entry size are tried as well as the exact
        // one; the sealed case has this pool's tag and slot, a state, a block count and flags
        // and a correct CRC around arbitrary block records, so it reaches every field check.
        let entry_bytes = superblock.header_entry_bytes as usize;
        let mut near_size = near.clone();
        near_size.resize(entry_bytes - 8 + near.len() % 17, 0xa5);
        let mut sealed = sealed_words[..entry_bytes.min(256)].to_vec();
        sealed.resize(entry_bytes, 0);
        // Within the bound whatever it is, so that the generation check never stops the entry
        // before the field checks it is meant to reach (a shift sized for one bound let 3/4 of
        // the cases stop there once the bound was lowered).
        let generation = u64_at(&sealed, 0) % (GENERATION_MAX + 1);
        put_u64(&mut sealed, 0, generation);
        put_u64(&mut sealed, 8, pool_tag(&superblock.pool_uuid));
        put_u32(&mut sealed, 16, header.slot);
        sealed[20..22].copy_from_slice(&state.to_le_bytes());
        sealed[22..24].copy_from_slice(&(count % (superblock.blocks_per_slot as u16 + 2)).to_le_bytes());
        put_u32(&mut sealed, 24, flags);
        if zero_reserved {
            let used = block_record_offset(usize::from(u16::from_le_bytes([sealed[22], sealed[23]])));
            sealed[28..32].fill(0);
            let crc_at = entry_bytes - 4;
            sealed[used.min(crc_at)..crc_at].fill(0);
        }
        reseal_entry(&mut sealed);
        // A whole entry of this pool, cut or extended by up to 8 bytes and resealed: only its
        // length is wrong.
        let mut resized = vec![0u8; entry_bytes];
        header.encode_into(&mut resized);
        resized.resize(entry_bytes - 8 + near.len() % 17, 0);
        reseal_entry(&mut resized);
        for entry in [&plain, &near_size, &sealed, &resized] {
            let verdict = SlotHeader::decode(entry, header.slot, &superblock);
            if entry.len() != entry_bytes {
                prop_assert_eq!(verdict, Err(HeaderVerdict::Corrupt));
            } else {
                check_canonical(entry, header.slot, &superblock, &verdict)?;
            }
        }
    }

    #[test]
    fn any_single_damage_to_a_header_entry_is_refused(
        (superblock, header, entry) in pool_and_header(),
        empty in any::<bool>(),
        damage in damage(),
    ) {
        // Goal: a flipped byte anywhere in a Valid or an Empty entry (the CRC covers all of it
        // but itself), a truncated or an extended entry is Corrupt (or Zeroed, were it all
        // zeroes): never a header with another block, key, count or slot, and never Empty
        // (which would silently drop a Valid slot's blocks).
        let mut entry = entry;
        if empty {
            encode_empty_entry(&mut entry, header.generation, header.pool_tag, header.slot);
        }
        let bad = damaged(&entry, &damage);
        let verdict = SlotHeader::decode(&bad, header.slot, &superblock);
        prop_assert!(
            verdict == Err(HeaderVerdict::Corrupt) || (verdict == Err(HeaderVerdict::Zeroed) && bad.iter().all(|&byte| byte == 0)),
            "{:?} of {} entry decoded to {:?}", damage, if empty { "an Empty" } else { "a Valid" }, verdict
        );
    }

    #[test]
    fn resealed_header_edits_are_refused_or_their_own_encoding(
        (superblock, header, entry) in pool_and_header(),
        empty in any::<bool>(),
        edits in prop::collection::vec((any::<Index>(), any::<u8>()), 1..4),
    ) {
        // Goal: a Valid or Empty entry with bytes rewritten and a correct CRC (a buggy writer) gets past the
        // checksum; the field checks alone must then refuse it or accept exactly its encoding
        // (no reserved byte, stale block record or payload CRC of a CRC-less pool ignored).
        let mut bad = entry;
        if empty {
            encode_empty_entry(&mut bad, header.generation, header.pool_tag, header.slot);
        }
        let crc_at = bad.len() - 4;
        for (at, value) in &edits {
            bad[at.index(crc_at)] = *value;
        }
        reseal_entry(&mut bad);
        let verdict = SlotHeader::decode(&bad, header.slot, &superblock);
        check_canonical(&bad, header.slot, &superblock, &verdict)?;
    }
}
