//! Fuzzes tuttid's client protocol decoders (crates/daemon/src/protocol.rs): the first 16 bytes
//! are a frame header, the rest a body. The header must be accepted exactly when it is one this
//! build speaks (and then encode back to the same bytes); the body, decoded as the kind the
//! header names (whether or not the header was accepted, so the fuzzer need not find the magic)
//! as a request and as a reply, must give a value or a typed error — never a panic — and a
//! decoded value must encode back to exactly the body and decode again to itself.
//!
//! Input layout: bytes 0..16 = header (magic `TUTD`, version u16, kind u16, request id u32,
//! body length u32, little-endian), the rest = body. Seeds: `fuzz/seeds/tuttid_protocol/`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tutti_daemon::protocol::{FrameHeader, Kind, ProtocolError, Reply, Request, HEADER_BYTES};

fuzz_target!(|data: &[u8]| {
    if data.len() < HEADER_BYTES {
        return;
    }
    let (header, body) = data.split_at(HEADER_BYTES);
    let header: &[u8; HEADER_BYTES] = header.try_into().unwrap();
    if let Ok(decoded) = FrameHeader::decode(header) {
        assert_eq!(&decoded.encode(), header, "an accepted header re-encodes to other bytes");
    }
    let Some(kind) = Kind::from_u16(u16::from_le_bytes([header[6], header[7]])) else {
        return;
    };
    match Request::decode(kind, body) {
        Ok(request) => {
            assert_eq!(request.kind(), kind);
            let mut encoded = Vec::new();
            request.encode_body(&mut encoded);
            assert_eq!(encoded, body, "{kind:?} request re-encodes to other bytes");
            assert_eq!(Request::decode(kind, &encoded), Ok(request));
        }
        Err(error) => assert!(matches!(error, ProtocolError::MalformedBody { kind: named, .. } if named == kind), "{error:?}"),
    }
    match Reply::decode(kind, body) {
        Ok(reply) => {
            assert_eq!(reply.kind(), kind);
            let mut encoded = Vec::new();
            reply.encode_body(&mut encoded);
            assert_eq!(encoded, body, "{kind:?} reply re-encodes to other bytes");
            assert_eq!(Reply::decode(kind, &encoded), Ok(reply));
        }
        Err(error) => assert!(matches!(error, ProtocolError::MalformedBody { kind: named, .. } if named == kind), "{error:?}"),
    }
});
