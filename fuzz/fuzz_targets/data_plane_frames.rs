//! Fuzzes the cluster data plane's peer frames (crates/daemon/src/cluster/peer.rs): arbitrary
//! bytes from a peer, read frame after frame with `read_frame` over an in-memory stream by a
//! holder (asker's requests) or an asker (holder's answers), must give frames within their
//! kind's cap or a typed `PeerError` — never a panic, never a body allocated past the cap — and
//! every decoded `ReadSegment`, `SegmentHeader` and `Failure` must encode back to its body.
//!
//! Input layout: byte 0 bit 0 = read as the asker (else the holder); bytes 1..3 = the block
//! bytes the asker expects (u16, little-endian); the rest = the stream. Seeds:
//! `fuzz/seeds/data_plane_frames/`.
#![no_main]

use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use tutti_daemon::cluster::peer::{
    answer_body_max, decode_block, decode_failure, decode_segment_header, encode_failure, encode_segment_header, read_frame,
    request_body_max, FailureCode, PeerError, PeerKind, ReadSegment, HEADER_BYTES,
};

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let asker = data[0] & 1 == 1;
    let block_bytes = usize::from(u16::from_le_bytes([data[1], data[2]]));
    let body_max = |kind| if asker { answer_body_max(kind, block_bytes as u64) } else { request_body_max(kind) };
    let mut stream = &data[3..];
    let mut body = Vec::new();
    let never = || false;
    let second = Duration::from_secs(1);
    // Every frame takes at least its header's bytes: the loop ends with the input.
    loop {
        let kind = match read_frame(&mut stream, &mut body, body_max, second, second, Instant::now() + second, &never, "fuzzing") {
            Ok(kind) => kind,
            Err(PeerError::Garbage(_) | PeerError::Closed { .. }) => return,
            Err(other) => panic!("{other:?} from an in-memory stream"),
        };
        assert!(body.len() as u64 <= body_max(kind), "a {kind:?} body of {} bytes past its cap", body.len());
        let mut encoded = Vec::new();
        match kind {
            PeerKind::ReadSegment => {
                if let Ok(request) = ReadSegment::decode(&body) {
                    request.encode(&mut encoded);
                    assert_eq!(&encoded[HEADER_BYTES..], &body[..]);
                }
            }
            PeerKind::SegmentHeader => {
                if let Ok(header) = decode_segment_header(&body) {
                    encode_segment_header(&mut encoded, header);
                    assert_eq!(&encoded[HEADER_BYTES..], &body[..]);
                }
            }
            PeerKind::Block => match decode_block(&body, block_bytes) {
                Ok((index, crc, bytes)) => {
                    assert_eq!(crc, crc32fast::hash(bytes));
                    assert_eq!((index.to_le_bytes(), bytes.len()), ([body[0], body[1]], block_bytes));
                }
                Err(PeerError::Garbage(_) | PeerError::Checksum { .. }) => {}
                Err(other) => panic!("{other:?}"),
            },
            PeerKind::Failure => match decode_failure(&body) {
                PeerError::Refused { code, message } => {
                    if std::str::from_utf8(&body[4..]).is_ok() {
                        encode_failure(&mut encoded, code, &message);
                        assert_eq!(&encoded[HEADER_BYTES..], &body[..]);
                    }
                    let _: FailureCode = code;
                }
                PeerError::Garbage(_) => {}
                other => panic!("{other:?}"),
            },
        }
    }
});
