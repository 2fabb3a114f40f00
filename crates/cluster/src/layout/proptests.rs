//! Property tests of the registry's key parsing and record formats: everything here is read
//! from etcd, which anyone with access to the cluster's prefix can write, so it is untrusted.
//! The examples in `layout.rs` pin particular cases; these generate thousands: arbitrary bytes
//! and strings never panic, every valid value round-trips exactly, a single damaged byte is
//! always refused, and whatever a decoder accepts is exactly what the encoder writes for the
//! value it returns (so no second spelling of a record or key is ever served as the first).

use proptest::prelude::*;
use proptest::sample::Index;

use super::*;
use crate::names::TP_WORLD_MAX;

/// 512 cases per property: each runs in well under a second on one core.
fn config() -> ProptestConfig {
    ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() }
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9_-]{1,8}",
        "[a-z0-9_-]{1,64}",
        // The longest names: the records' length bytes and the entry bounds are at their limit.
        "[a-z0-9_-]{64}",
    ]
}

fn cluster_id() -> impl Strategy<Value = ClusterId> {
    name().prop_map(|text| ClusterId::new(&text).unwrap())
}

fn node_id() -> impl Strategy<Value = NodeId> {
    name().prop_map(|text| NodeId::new(&text).unwrap())
}

fn model_space() -> impl Strategy<Value = ModelSpace> {
    let fingerprint = any::<[u8; FINGERPRINT_BYTES]>().prop_filter("a fingerprint is not all zeroes", |f| f.iter().any(|&b| b != 0));
    let world = prop_oneof![Just(1u32), Just(TP_WORLD_MAX), 1..=TP_WORLD_MAX];
    (fingerprint, world)
        .prop_flat_map(|(fingerprint, world)| (Just(fingerprint), 0..world, Just(world)))
        .prop_map(|(fingerprint, rank, world)| ModelSpace::new(fingerprint, rank, world).unwrap())
}

fn segment_key() -> impl Strategy<Value = SegmentKey> {
    prop_oneof![Just(1u64), Just(u64::MAX), 1..=u64::MAX].prop_map(|key| SegmentKey::new(key).unwrap())
}

fn segment_record() -> impl Strategy<Value = SegmentRecord> {
    (node_id(), model_space(), segment_key(), any::<u32>(), SegmentBlocks::MIN..=SegmentBlocks::MAX).prop_map(
        |(node, space, key, index, blocks)| SegmentRecord { node, space, key, index, segment_blocks: SegmentBlocks::new(blocks).unwrap() },
    )
}

fn member_record() -> impl Strategy<Value = MemberRecord> {
    // Any printable text: 64 characters of at most 4 bytes stay within ADDRESS_BYTES_MAX.
    let address = prop_oneof!["\\PC{0,64}", "[ -~]{256}"];
    let fingerprints = prop_oneof![
        prop::collection::vec(any::<[u8; FINGERPRINT_BYTES]>(), 0..=4),
        prop::collection::vec(any::<[u8; FINGERPRINT_BYTES]>(), FINGERPRINTS_MAX - 1..=FINGERPRINTS_MAX),
    ];
    (node_id(), any::<[u8; KEY_SECRET_TAG_BYTES]>(), address, any::<u64>(), fingerprints).prop_map(
        |(node, tag, address, capacity_bytes, fingerprints)| MemberRecord {
            node,
            key_secret_tag: KeySecretTag::new(tag),
            address,
            capacity_bytes,
            fingerprints,
        },
    )
}

/// One damage to an encoded record, as etcd (or whoever wrote the key) might hand it back.
#[derive(Debug, Clone)]
enum Damage {
    /// XOR one byte with a non-zero mask.
    Flip { at: Index, mask: u8 },
    /// Keep only the first `length` bytes (`length` below the record's length).
    Truncate { length: Index },
    /// Append bytes.
    Extend { tail: Vec<u8> },
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        (any::<Index>(), 1..=u8::MAX).prop_map(|(at, mask)| Damage::Flip { at, mask }),
        any::<Index>().prop_map(|length| Damage::Truncate { length }),
        prop::collection::vec(any::<u8>(), 1..16).prop_map(|tail| Damage::Extend { tail }),
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

/// An edit of a record's body (between the version and the CRC) that a writer then seals with
/// a correct CRC: what a buggy or hostile writer can put in etcd.
#[derive(Debug, Clone)]
enum Edit {
    Set { at: Index, value: u8 },
    Insert { at: Index, value: u8 },
    Remove { at: Index },
    Truncate { length: Index },
    Extend { tail: Vec<u8> },
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<Index>(), any::<u8>()).prop_map(|(at, value)| Edit::Set { at, value }),
        (any::<Index>(), any::<u8>()).prop_map(|(at, value)| Edit::Insert { at, value }),
        any::<Index>().prop_map(|at| Edit::Remove { at }),
        any::<Index>().prop_map(|length| Edit::Truncate { length }),
        prop::collection::vec(any::<u8>(), 1..40).prop_map(|tail| Edit::Extend { tail }),
    ]
}

/// `bytes` (a sealed record) with `edits` applied to its body and a fresh CRC.
fn edited_and_resealed(bytes: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut body = bytes[6..bytes.len() - 4].to_vec();
    for edit in edits {
        match edit {
            Edit::Set { at, value } if !body.is_empty() => {
                let at = at.index(body.len());
                body[at] = *value;
            }
            Edit::Insert { at, value } => body.insert(at.index(body.len() + 1), *value),
            Edit::Remove { at } if !body.is_empty() => {
                body.remove(at.index(body.len()));
            }
            Edit::Truncate { length } => body.truncate(length.index(body.len() + 1)),
            Edit::Extend { tail } => body.extend_from_slice(tail),
            Edit::Set { .. } | Edit::Remove { .. } => {}
        }
    }
    let mut out = bytes[..6].to_vec();
    out.extend_from_slice(&body);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Arbitrary values: short ones, ones around the fixed header (magic, version, CRC: 10 bytes)
/// and ones across the records' whole length range.
fn arbitrary_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..=16),
        prop::collection::vec(any::<u8>(), 60..=200),
        prop::collection::vec(any::<u8>(), 0..=MEMBER_VALUE_BYTES_MAX + 8),
    ]
}

/// Arbitrary bytes behind a real magic and version, sealed with a correct CRC: these reach the
/// field decoding that an unsealed value never gets past the CRC to.
/// Also short bytes of any kind sealed the same way (shorter than a magic and a version: the
/// CRC alone must not let them through to the field reads).
fn sealed_arbitrary_value(magic: &'static [u8; 4]) -> impl Strategy<Value = Vec<u8>> {
    let headed = prop::collection::vec(any::<u8>(), 0..=300).prop_map(move |body| {
        let mut out = magic.to_vec();
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&body);
        out
    });
    prop_oneof![headed, prop::collection::vec(any::<u8>(), 0..=10)].prop_map(|mut out| {
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn segment_records_round_trip_and_refuse_another_key(
        cluster in cluster_id(),
        record in segment_record(),
        other_cluster in cluster_id(),
        other_node in node_id(),
        other_space in model_space(),
        other_key in segment_key(),
    ) {
        // Goal: a record decodes to exactly what was encoded at its own key, within the length
        // the read bounds assume, and is refused at any key that differs in one field (a value
        // copied under another key).
        let bytes = record.encode(&cluster);
        prop_assert!(bytes.len() <= SEGMENT_VALUE_BYTES_MAX);
        let decode = |cluster: &ClusterId, space: &ModelSpace, key: SegmentKey, node: &NodeId| {
            SegmentRecord::decode(&bytes, cluster, space, key, node)
        };
        prop_assert_eq!(decode(&cluster, &record.space, record.key, &record.node), Ok(record.clone()));
        if other_cluster != cluster {
            prop_assert!(decode(&other_cluster, &record.space, record.key, &record.node).is_err());
        }
        if other_node != record.node {
            prop_assert!(decode(&cluster, &record.space, record.key, &other_node).is_err());
        }
        if other_space != record.space {
            prop_assert!(decode(&cluster, &other_space, record.key, &record.node).is_err());
        }
        if other_key != record.key {
            prop_assert!(decode(&cluster, &record.space, other_key, &record.node).is_err());
        }
        prop_assert!(MemberRecord::decode(&bytes, &cluster, &record.node).is_err(), "a holder record read as a member");
    }

    #[test]
    fn member_records_round_trip_and_refuse_another_key(
        cluster in cluster_id(),
        record in member_record(),
        other_cluster in cluster_id(),
        other_node in node_id(),
    ) {
        // Goal: as for holders: exact round trip within MEMBER_VALUE_BYTES_MAX, refused under
        // another cluster or node.
        let bytes = record.encode(&cluster).unwrap();
        prop_assert!(bytes.len() <= MEMBER_VALUE_BYTES_MAX);
        prop_assert_eq!(MemberRecord::decode(&bytes, &cluster, &record.node), Ok(record.clone()));
        if other_cluster != cluster {
            prop_assert!(MemberRecord::decode(&bytes, &other_cluster, &record.node).is_err());
        }
        if other_node != record.node {
            prop_assert!(MemberRecord::decode(&bytes, &cluster, &other_node).is_err());
        }
    }

    #[test]
    fn arbitrary_values_decode_to_an_error_or_their_own_encoding(
        plain in arbitrary_value(),
        sealed_segment in sealed_arbitrary_value(SEGMENT_MAGIC),
        sealed_member in sealed_arbitrary_value(MEMBER_MAGIC),
        cluster in cluster_id(),
        record in segment_record(),
    ) {
        // Goal: whatever bytes sit at a key, decoding returns (no panic) an error or a record
        // that encodes back to exactly those bytes.
        for bytes in [&plain, &sealed_segment, &sealed_member] {
            if let Ok(decoded) = SegmentRecord::decode(bytes, &cluster, &record.space, record.key, &record.node) {
                prop_assert_eq!(&decoded.encode(&cluster), bytes);
            }
            if let Ok(decoded) = MemberRecord::decode(bytes, &cluster, &record.node) {
                prop_assert_eq!(&decoded.encode(&cluster).unwrap(), bytes);
            }
        }
    }

    #[test]
    fn any_single_damage_to_a_record_is_refused(
        cluster in cluster_id(),
        segment in segment_record(),
        member in member_record(),
        damage in damage(),
    ) {
        // Goal: one flipped byte anywhere (fields, magic, version or the CRC itself), a
        // truncation or appended bytes: the CRC-32 over the whole body catches every one, so
        // the damaged record is refused, never served as another value.
        let bytes = segment.encode(&cluster);
        let bad = damaged(&bytes, &damage);
        let decoded = SegmentRecord::decode(&bad, &cluster, &segment.space, segment.key, &segment.node);
        prop_assert!(decoded.is_err(), "{:?} of a holder record decoded to {:?}", damage, decoded);
        let bytes = member.encode(&cluster).unwrap();
        let bad = damaged(&bytes, &damage);
        let decoded = MemberRecord::decode(&bad, &cluster, &member.node);
        prop_assert!(decoded.is_err(), "{:?} of a member record decoded to {:?}", damage, decoded);
    }

    #[test]
    fn resealed_edits_decode_to_an_error_or_their_own_encoding(
        cluster in cluster_id(),
        segment in segment_record(),
        member in member_record(),
        edits in prop::collection::vec(edit(), 1..4),
    ) {
        // Goal: a record edited and sealed with a correct CRC (a buggy or hostile writer) gets
        // past the checksum, so the field checks alone stand between it and a reader: it is
        // refused, or it is exactly the encoding of the record returned (lengths, names, the
        // key's fields and the reserved ranges all checked, nothing read past or ignored).
        let bad = edited_and_resealed(&segment.encode(&cluster), &edits);
        if let Ok(decoded) = SegmentRecord::decode(&bad, &cluster, &segment.space, segment.key, &segment.node) {
            prop_assert_eq!(decoded.encode(&cluster), bad);
        }
        let bad = edited_and_resealed(&member.encode(&cluster).unwrap(), &edits);
        if let Ok(decoded) = MemberRecord::decode(&bad, &cluster, &member.node) {
            prop_assert_eq!(decoded.encode(&cluster).unwrap(), bad);
        }
    }

    #[test]
    fn valid_keys_round_trip(
        cluster in cluster_id(),
        record in segment_record(),
        other_cluster in cluster_id(),
    ) {
        // Goal: every key the layout builds parses back to what built it, and only in its own
        // cluster.
        let layout = KeyLayout::new(cluster.clone());
        let key = layout.segment_key(&record.space, record.key, &record.node);
        prop_assert!(key.len() <= SEGMENT_KEY_BYTES_MAX);
        prop_assert_eq!(layout.parse_segment_key(key.as_bytes()), Some((record.space, record.key, record.node.clone())));
        prop_assert_eq!(layout.parse_member_key(key.as_bytes()), None);
        let member_key = layout.member_key(&record.node);
        prop_assert!(member_key.len() <= MEMBER_KEY_BYTES_MAX);
        prop_assert_eq!(layout.parse_member_key(member_key.as_bytes()), Some(record.node.clone()));
        prop_assert_eq!(layout.parse_segment_key(member_key.as_bytes()), None);
        if other_cluster != cluster {
            let other = KeyLayout::new(other_cluster);
            prop_assert_eq!(other.parse_segment_key(key.as_bytes()), None);
            prop_assert_eq!(other.parse_member_key(member_key.as_bytes()), None);
        }
    }

    #[test]
    fn arbitrary_keys_parse_to_none_or_their_canonical_spelling(
        cluster in cluster_id(),
        record in segment_record(),
        edits in prop::collection::vec((any::<Index>(), "[-+/.0-9a-fA-Z_é ]"), 1..4),
        arbitrary in prop_oneof!["\\PC{0,300}", "[-+/.0-9a-fA-F]{0,300}"],
        raw in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        // Goal: any bytes under the prefix (arbitrary text, raw non-UTF-8 bytes, a valid key
        // with characters replaced: upper-case or signed hex, another shape, an extra '/')
        // parse without panic to None, or to the names whose key is exactly those bytes: one
        // record never has two keys.
        let layout = KeyLayout::new(cluster);
        let mut edited: Vec<char> = layout.segment_key(&record.space, record.key, &record.node).chars().collect();
        for (at, replacement) in &edits {
            let at = at.index(edited.len());
            edited.splice(at..at + 1, replacement.chars());
        }
        let edited: String = edited.into_iter().collect();
        let prefixed = format!("{}{arbitrary}", layout.segments_prefix());
        let member_prefixed = format!("{}{arbitrary}", layout.members_prefix());
        for key in [edited.as_bytes(), prefixed.as_bytes(), member_prefixed.as_bytes(), arbitrary.as_bytes(), &raw] {
            if let Some((space, segment, node)) = layout.parse_segment_key(key) {
                let spelled = layout.segment_key(&space, segment, &node);
                prop_assert_eq!(spelled.as_bytes(), key);
            }
            if let Some(node) = layout.parse_member_key(key) {
                let spelled = layout.member_key(&node);
                prop_assert_eq!(spelled.as_bytes(), key);
            }
        }
    }
}
