//! Randomized tests of the data plane's frame decoders: everything read from a peer is untrusted,
//! so arbitrary bytes must give a frame, a value or a typed [`PeerError`], never a panic, never a
//! body allocated past its kind's cap, and decoded values must encode back to the same bytes.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::{select, Index};

use super::*;
use crate::protocol::proptests::{mutate, mutation};

const KINDS: [PeerKind; 4] = [PeerKind::ReadSegment, PeerKind::SegmentHeader, PeerKind::Block, PeerKind::Failure];

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

/// A 12-byte header from parts each the documented value or not.
fn header_bytes() -> impl Strategy<Value = [u8; HEADER_BYTES]> {
    let kinds: Vec<u16> = KINDS.iter().map(|&kind| kind as u16).collect();
    (
        prop_oneof![Just(MAGIC), any::<[u8; 4]>()],
        prop_oneof![Just(VERSION), Just(1u16), Just(VERSION - 1), any::<u16>()],
        prop_oneof![select(kinds), any::<u16>()],
        prop_oneof![0u32..=64, 1000u32..=1100, 4090u32..=4110, any::<u32>()],
    )
        .prop_map(|(magic, version, kind, body_bytes)| {
            let mut header = [0u8; HEADER_BYTES];
            header[0..4].copy_from_slice(&magic);
            header[4..6].copy_from_slice(&version.to_le_bytes());
            header[6..8].copy_from_slice(&kind.to_le_bytes());
            header[8..12].copy_from_slice(&body_bytes.to_le_bytes());
            header
        })
}

/// The caps an asker (expecting `block_bytes`) or a holder applies.
#[derive(Debug, Clone, Copy)]
enum Side {
    Holder,
    Asker(u64),
}

impl Side {
    fn body_max(self, kind: PeerKind) -> u64 {
        match self {
            Side::Holder => request_body_max(kind),
            Side::Asker(block_bytes) => answer_body_max(kind, block_bytes),
        }
    }
}

fn side() -> impl Strategy<Value = Side> {
    prop_oneof![Just(Side::Holder), prop_oneof![0u64..=64, Just(4096u64), Just(BLOCK_BYTES_MAX)].prop_map(Side::Asker)]
}

/// Any five numbers: a geometry on the wire is plain data, compared by the receiver.
fn geometry() -> impl Strategy<Value = objstore::ModelGeometry> {
    any::<[u32; 5]>().prop_map(|[layers, kv_heads, head_dim, dtype_bytes, block_tokens]| objstore::ModelGeometry {
        layers,
        kv_heads,
        head_dim,
        dtype_bytes,
        block_tokens,
    })
}

fn read_segment() -> impl Strategy<Value = ReadSegment> {
    (
        any::<[u8; FINGERPRINT_BYTES]>(),
        1u32..=tutti_cluster::TP_WORLD_MAX,
        any::<u32>(),
        any::<u32>(),
        geometry(),
        vec(1u64..=u64::MAX, 1..=SEGMENT_BLOCKS_MAX),
    )
        .prop_filter_map("an all-zero fingerprint", |(fingerprint, world, rank, index, geometry, keys)| {
            let space = ModelSpace::new(fingerprint, rank % world, world).ok()?;
            Some(ReadSegment { space, index, geometry, keys })
        })
}

/// A `read_frame` over in-memory bytes (a `&[u8]` never blocks: its end is a close).
fn read_all(bytes: &[u8], body: &mut Vec<u8>, side: Side) -> Result<PeerKind, PeerError> {
    let mut stream = bytes;
    let never = || false;
    // A slice never blocks: the bounds matter only to a test descheduled between two reads (a
    // loaded machine), where a 1 s deadline turned a frame cut short (`Closed`) into `Stalled`.
    let bound = Duration::from_secs(600);
    read_frame(&mut stream, body, |kind| side.body_max(kind), bound, bound, Instant::now() + bound, &never, "reading a test frame")
}

proptest! {
    #![proptest_config(config(512))]

    /// Goal: a header is accepted exactly when magic, version and kind are the documented ones
    /// and the body is within the side's cap for that kind.
    #[test]
    fn header_accepts_only_the_documented_fields(
        header in prop_oneof![header_bytes(), any::<[u8; HEADER_BYTES]>()],
        side in side(),
    ) {
        let version = u16::from_le_bytes([header[4], header[5]]);
        let kind = PeerKind::from_u16(u16::from_le_bytes([header[6], header[7]]));
        let body_bytes = u32::from_le_bytes(header[8..12].try_into().unwrap());
        let expected = match kind {
            Some(kind) if header[..4] == MAGIC && version == VERSION && u64::from(body_bytes) <= side.body_max(kind) => {
                Some(PeerHeader { kind, body_bytes })
            }
            _ => None,
        };
        match decode_header(&header, |kind| side.body_max(kind)) {
            Ok(decoded) => {
                prop_assert_eq!(Some(decoded), expected);
                let mut encoded = Vec::new();
                encode_header(&mut encoded, decoded.kind, decoded.body_bytes);
                prop_assert_eq!(&encoded[..], &header[..]);
            }
            Err(PeerError::Garbage(reason)) => prop_assert!(expected.is_none(), "refused {:?}: {}", expected, reason),
            Err(other) => prop_assert!(false, "{:?}", other),
        }
    }

    /// Goal: `read_frame` over arbitrary bytes gives the frame the header announces (its body
    /// the bytes after the header), `Closed` when they run out first, or `Garbage` for a header
    /// the side refuses — and then nothing is allocated for the body.
    #[test]
    fn read_frame_checks_the_header_before_allocating(
        header in header_bytes(),
        tail in vec(any::<u8>(), 0..=4200),
        cut in any::<Index>(),
        side in side(),
    ) {
        let mut bytes = header.to_vec();
        bytes.extend_from_slice(&tail);
        // Now and then the header itself is cut short.
        let bytes = if tail.len() % 8 == 0 { &bytes[..cut.index(bytes.len() + 1)] } else { &bytes[..] };
        let mut body = Vec::new();
        let result = read_all(bytes, &mut body, side);
        if bytes.len() < HEADER_BYTES {
            prop_assert!(matches!(result, Err(PeerError::Closed { .. })), "{:?}", result);
            prop_assert_eq!(body.capacity(), 0);
            return Ok(());
        }
        match (decode_header(&header, |kind| side.body_max(kind)), result) {
            (Err(_), Err(PeerError::Garbage(_))) => prop_assert_eq!(body.capacity(), 0, "a refused frame's body was allocated"),
            (Ok(expected), Ok(kind)) => {
                prop_assert_eq!(kind, expected.kind);
                prop_assert_eq!(&body[..], &bytes[HEADER_BYTES..HEADER_BYTES + expected.body_bytes as usize]);
            }
            (Ok(expected), Err(PeerError::Closed { .. })) => {
                prop_assert!(bytes.len() < HEADER_BYTES + expected.body_bytes as usize);
                prop_assert!(body.len() as u64 <= side.body_max(expected.kind));
            }
            (expected, result) => prop_assert!(false, "header {:?}: {:?}", expected, result),
        }
    }

    /// Goal: a header claiming a body over its cap (up to 4 GiB) is refused as `Garbage` from
    /// its 12 bytes alone, with nothing allocated, for every kind and either side.
    #[test]
    fn a_huge_claimed_body_is_refused_without_allocating(
        kind in select(KINDS.to_vec()),
        side in side(),
        over in 1u64..=u64::from(u32::MAX),
    ) {
        let claimed = side.body_max(kind).saturating_add(over);
        prop_assume!(claimed <= u64::from(u32::MAX));
        let mut bytes = Vec::new();
        encode_header(&mut bytes, kind, claimed as u32);
        bytes.extend_from_slice(&[0u8; 64]);
        let mut body = Vec::new();
        let result = read_all(&bytes, &mut body, side);
        prop_assert!(matches!(result, Err(PeerError::Garbage(_))), "{:?}", result);
        prop_assert_eq!(body.capacity(), 0);
    }

    /// Goal: arbitrary `ReadSegment` bodies decode to a request that re-encodes to exactly those
    /// bytes (within the holder's cap), or a refusal in words; never a panic.
    #[test]
    fn read_segment_arbitrary_bodies(body in prop_oneof![
        vec(any::<u8>(), 0..=1024),
        (any::<[u8; FINGERPRINT_BYTES]>(), any::<u32>(), 1u32..=8, any::<u32>(), 0u16..=70, prop_oneof![8 => Just(0i32), 1 => -1i32..=1], any::<u64>())
            .prop_map(|(fingerprint, rank, world, index, count, off, seed)| {
                // Mostly a count that matches its keys (nonzero, but for now and then a zero).
                let mut body = fingerprint.to_vec();
                for word in [rank % (world + 1), world, index] {
                    body.extend_from_slice(&word.to_le_bytes());
                }
                body.extend_from_slice(&count.to_le_bytes());
                let keys = (i32::from(count) + off).max(0) as u64;
                for key in 0..keys {
                    let key = if seed % 97 == key { 0 } else { seed.wrapping_mul(key + 1) | 1 };
                    body.extend_from_slice(&key.to_le_bytes());
                }
                body
            }),
    ]) {
        if let Ok(request) = ReadSegment::decode(&body) {
            prop_assert!(!request.keys.is_empty() && request.keys.len() <= SEGMENT_BLOCKS_MAX);
            prop_assert!(!request.keys.contains(&0));
            let mut frame = Vec::new();
            request.encode(&mut frame);
            prop_assert_eq!(&frame[HEADER_BYTES..], &body[..]);
            prop_assert!(body.len() as u64 <= ReadSegment::body_max());
        }
    }

    /// Goal: generated requests round-trip through a frame read by the holder; a mutated body
    /// decodes to a request that re-encodes to it, or is refused.
    #[test]
    fn read_segment_round_trips_and_mutations_are_refused_or_canonical(
        request in read_segment(),
        edit in mutation(),
    ) {
        let mut frame = Vec::new();
        request.encode(&mut frame);
        let mut body = Vec::new();
        prop_assert_eq!(read_all(&frame, &mut body, Side::Holder).unwrap(), PeerKind::ReadSegment);
        prop_assert_eq!(ReadSegment::decode(&body), Ok(request));
        mutate(&mut body, &edit);
        if let Ok(decoded) = ReadSegment::decode(&body) {
            decoded.encode(&mut frame);
            prop_assert_eq!(&frame[HEADER_BYTES..], &body[..]);
        }
    }

    /// Goal: a segment header body decodes exactly when it is 34 bytes, to what encodes back to
    /// those bytes.
    #[test]
    fn segment_header_round_trips(
        body in vec(any::<u8>(), 0..=48),
        sent in (any::<u16>(), any::<u64>(), any::<u32>(), geometry()),
    ) {
        match decode_segment_header(&body) {
            Ok(header) => {
                prop_assert_eq!(body.len(), SEGMENT_HEADER_BYTES);
                let mut frame = Vec::new();
                encode_segment_header(&mut frame, header);
                prop_assert_eq!(&frame[HEADER_BYTES..], &body[..]);
            }
            Err(error) => prop_assert!(body.len() != SEGMENT_HEADER_BYTES && matches!(error, PeerError::Garbage(_))),
        }
        let header = SegmentHeader { blocks: sent.0, block_bytes: sent.1, served: sent.2, geometry: sent.3 };
        let mut frame = Vec::new();
        encode_segment_header(&mut frame, header);
        let mut body = Vec::new();
        prop_assert_eq!(read_all(&frame, &mut body, Side::Asker(4096)).unwrap(), PeerKind::SegmentHeader);
        prop_assert_eq!(decode_segment_header(&body).unwrap(), header);
    }

    /// Goal: a block body is accepted exactly when its length is the expected one and its bytes
    /// match its CRC; a sent block round-trips and any flipped byte of its CRC or bytes is refused.
    #[test]
    fn blocks_are_accepted_only_whole_and_matching_their_crc(
        bytes in vec(any::<u8>(), 0..=4096),
        index in any::<u16>(),
        flip in any::<Index>(),
        xor in 1u8..=255,
        arbitrary in vec(any::<u8>(), 0..=64),
        expected_bytes in 0usize..=64,
    ) {
        let mut frame = Vec::new();
        encode_block_prefix(&mut frame, index, crc32fast::hash(&bytes), bytes.len());
        frame.extend_from_slice(&bytes);
        let mut body = Vec::new();
        prop_assert_eq!(read_all(&frame, &mut body, Side::Asker(bytes.len() as u64)).unwrap(), PeerKind::Block);
        prop_assert_eq!(decode_block(&body, bytes.len()).unwrap(), (index, crc32fast::hash(&bytes), &bytes[..]));
        let at = flip.index(body.len());
        body[at] ^= xor;
        let flipped = decode_block(&body, bytes.len());
        if at < 2 {
            // The index is not under the CRC: the asker compares it with the block it expects.
            prop_assert_eq!(flipped.unwrap(), (index ^ (u16::from(xor) << (8 * at)), crc32fast::hash(&bytes), &bytes[..]));
        } else {
            prop_assert!(matches!(flipped, Err(PeerError::Checksum { .. })), "byte {} flipped: {:?}", at, flipped);
        }
        // A block one byte longer than expected is refused by the asker's header check.
        let mut long = Vec::new();
        encode_block_prefix(&mut long, index, 0, bytes.len() + 1);
        prop_assert!(matches!(read_all(&long, &mut body, Side::Asker(bytes.len() as u64)), Err(PeerError::Garbage(_))));

        match decode_block(&arbitrary, expected_bytes) {
            Ok((index, crc, block)) => {
                prop_assert_eq!(arbitrary.len(), 6 + expected_bytes);
                prop_assert_eq!(crc, crc32fast::hash(block));
                prop_assert_eq!(&arbitrary[..2], &index.to_le_bytes()[..]);
            }
            Err(PeerError::Garbage(_)) => prop_assert!(arbitrary.len() != 6 + expected_bytes),
            Err(PeerError::Checksum { .. }) => prop_assert!(arbitrary.len() == 6 + expected_bytes),
            Err(other) => prop_assert!(false, "{:?}", other),
        }
    }

    /// Goal: a failure body is a refusal (re-encoding to the same bytes when its text is UTF-8
    /// within the cap) or `Garbage` when its length does not frame; never a panic. A sent
    /// failure's text arrives cut to the cap on a character boundary.
    #[test]
    fn failures_decode_to_a_refusal_or_garbage(
        body in prop_oneof![
            vec(any::<u8>(), 0..=1100),
            (any::<u16>(), "\\PC{0,300}").prop_map(|(code, text)| {
                let mut body = code.to_le_bytes().to_vec();
                body.extend_from_slice(&(text.len() as u16).to_le_bytes());
                body.extend_from_slice(text.as_bytes());
                body
            }),
        ],
        code in any::<u16>(),
        message in prop_oneof!["\\PC{0,100}", (1000usize..=1100).prop_map(|n| "é".repeat(n / 2) + &"x".repeat(n % 2))],
    ) {
        match decode_failure(&body) {
            PeerError::Refused { code, message } => {
                prop_assert_eq!(body.len(), 4 + usize::from(u16::from_le_bytes([body[2], body[3]])));
                if std::str::from_utf8(&body[4..]).is_ok() && body.len() <= 4 + MESSAGE_BYTES_MAX {
                    let mut frame = Vec::new();
                    encode_failure(&mut frame, code, &message);
                    prop_assert_eq!(&frame[HEADER_BYTES..], &body[..]);
                }
            }
            PeerError::Garbage(_) => {
                prop_assert!(body.len() < 4 || body.len() != 4 + usize::from(u16::from_le_bytes([body[2], body[3]])));
            }
            other => prop_assert!(false, "{:?}", other),
        }
        let mut frame = Vec::new();
        encode_failure(&mut frame, FailureCode::from_u16(code), &message);
        let mut body = Vec::new();
        prop_assert_eq!(read_all(&frame, &mut body, Side::Asker(0)).unwrap(), PeerKind::Failure);
        match decode_failure(&body) {
            PeerError::Refused { code: received, message: text } => {
                prop_assert_eq!(received, FailureCode::from_u16(code));
                prop_assert!(text.len() <= MESSAGE_BYTES_MAX && message.starts_with(&text));
                prop_assert!(message.len() <= MESSAGE_BYTES_MAX || text.len() > MESSAGE_BYTES_MAX - 4);
            }
            other => prop_assert!(false, "{:?}", other),
        }
    }
}
