use super::*;

fn frame_of(kind: Kind, encode: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = Vec::new();
    encode_frame(&mut out, kind, 9, encode).unwrap();
    out
}

fn header_of(frame: &[u8]) -> Result<FrameHeader, ProtocolError> {
    let mut header = [0u8; HEADER_BYTES];
    header.copy_from_slice(&frame[..HEADER_BYTES]);
    FrameHeader::decode(&header)
}

fn sample_status() -> StatusReply {
    StatusReply {
        daemon_pid: 42,
        uptime_ms: 1234,
        shape: PoolShape { layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_tokens: 16, blocks_per_slot: 1 },
        devices: vec![DeviceStatus { spec: "emu:mem:64MiB".into(), description: "software NVMe controller".into() }],
        pool: PoolStatus { slots: 10, free_slots: 7, valid_slots: 3, writing_slots: 0, pinned_slots: 1, cached_blocks: 3, evictions: 2 },
        connections: 2,
        clients: vec![ClientStatus {
            session: 5,
            pid: 77,
            uid: 0,
            name: "worker-0".into(),
            tp_rank: 1,
            tp_world: 2,
            requests: 9,
            idle_ms: 3,
        }],
    }
}

#[test]
fn every_message_round_trips() {
    // Goal: encode then decode gives back each request and reply, header included.
    let requests = [
        Request::Hello(Hello { model_fingerprint: [3; 32], tp_rank: 1, tp_world: 4, client_name: "rank-1".into() }),
        Request::Lookup { tokens: (0..100).collect() },
        Request::Lookup { tokens: Vec::new() },
        Request::LookupAllRanks { tokens: (7..70).collect() },
        Request::Status,
        Request::Ping,
    ];
    for request in requests {
        let frame = frame_of(request.kind(), |out| request.encode_body(out));
        let header = header_of(&frame).unwrap();
        assert_eq!((header.kind, header.request_id, header.body_bytes as usize), (request.kind(), 9, frame.len() - HEADER_BYTES));
        assert_eq!(Request::decode(header.kind, &frame[HEADER_BYTES..]).unwrap(), request);
    }
    let replies = [
        Reply::Hello(HelloReply { session: 7, lease_ms: 10_000, shape: sample_status().shape }),
        Reply::Lookup { cached_blocks: 12, block_tokens: 16 },
        Reply::Status(sample_status()),
        Reply::Pong,
        Reply::error(ErrorCode::BadRequest, "rank 2 is not below 2"),
        Reply::Error { code: ErrorCode::Unknown(999), message: String::new() },
    ];
    for reply in replies {
        let frame = frame_of(reply.kind(), |out| reply.encode_body(out));
        let header = header_of(&frame).unwrap();
        assert_eq!(Reply::decode(header.kind, &frame[HEADER_BYTES..]).unwrap(), reply);
    }
}

#[test]
fn bad_headers_are_refused_before_the_body() {
    // Goal: magic, version, kind and size are each refused with their own error, in that order.
    let good = frame_of(Kind::Ping, |_| {});
    let mut garbage = good.clone();
    garbage[..4].copy_from_slice(b"GET ");
    assert!(matches!(header_of(&garbage), Err(ProtocolError::BadMagic { found }) if &found == b"GET "));
    let mut version = good.clone();
    version[4..6].copy_from_slice(&2u16.to_le_bytes());
    assert_eq!(header_of(&version), Err(ProtocolError::UnsupportedVersion { found: 2 }));
    let mut kind = good.clone();
    kind[6..8].copy_from_slice(&77u16.to_le_bytes());
    assert_eq!(header_of(&kind), Err(ProtocolError::UnknownKind { kind: 77 }));
    let mut large = good.clone();
    large[12..16].copy_from_slice(&(BODY_BYTES_MAX + 1).to_le_bytes());
    assert_eq!(header_of(&large), Err(ProtocolError::FrameTooLarge { body_bytes: BODY_BYTES_MAX + 1 }));
    large[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(header_of(&large).unwrap_err().code(), ErrorCode::FrameTooLarge);
    let mut exact = good;
    exact[12..16].copy_from_slice(&BODY_BYTES_MAX.to_le_bytes());
    assert!(header_of(&exact).is_ok(), "the cap itself is allowed");
}

#[test]
fn malformed_bodies_are_typed_errors_never_panics() {
    // Goal: every truncation of every body, a lying token count, trailing bytes, bad UTF-8, an
    // oversized name, and a reply kind sent as a request: MalformedBody, no panic.
    let hello = Request::Hello(Hello { model_fingerprint: [1; 32], tp_rank: 0, tp_world: 1, client_name: "x".into() });
    let status = Reply::Status(sample_status());
    let mut bodies: Vec<(Kind, Vec<u8>, bool)> = Vec::new();
    for request in [hello, Request::Lookup { tokens: vec![1, 2, 3] }] {
        let mut body = Vec::new();
        request.encode_body(&mut body);
        bodies.push((request.kind(), body, true));
    }
    let mut body = Vec::new();
    status.encode_body(&mut body);
    bodies.push((Kind::StatusReply, body, false));
    for (kind, body, is_request) in &bodies {
        for cut in 0..body.len() {
            let result = if *is_request { Request::decode(*kind, &body[..cut]).err() } else { Reply::decode(*kind, &body[..cut]).err() };
            assert!(matches!(result, Some(ProtocolError::MalformedBody { .. })), "{kind:?} cut at {cut}");
        }
        let mut long = body.clone();
        long.push(0);
        let result = if *is_request { Request::decode(*kind, &long).err() } else { Reply::decode(*kind, &long).err() };
        assert!(matches!(result, Some(ProtocolError::MalformedBody { .. })), "{kind:?} with a trailing byte");
    }
    // A token count that claims more than the body holds (no allocation from the count).
    let mut lying = Vec::new();
    lying.extend_from_slice(&u32::MAX.to_le_bytes());
    lying.extend_from_slice(&[0; 8]);
    let error = Request::decode(Kind::Lookup, &lying).unwrap_err().to_string();
    assert!(error.contains("token_count 4294967295 but 8 bytes of tokens"), "{error}");
    // A name that is not UTF-8, and one over its cap.
    let mut name = vec![1u8; 32];
    name.extend_from_slice(&0u32.to_le_bytes());
    name.extend_from_slice(&1u32.to_le_bytes());
    let mut bad_utf8 = name.clone();
    bad_utf8.extend_from_slice(&2u16.to_le_bytes());
    bad_utf8.extend_from_slice(&[0xff, 0xfe]);
    assert!(Request::decode(Kind::Hello, &bad_utf8).unwrap_err().to_string().contains("not UTF-8"));
    let mut too_long = name;
    too_long.extend_from_slice(&65u16.to_le_bytes());
    too_long.extend_from_slice(&[b'a'; 65]);
    assert!(Request::decode(Kind::Hello, &too_long).unwrap_err().to_string().contains("over its cap of 64"));
    assert!(matches!(Request::decode(Kind::Pong, &[]), Err(ProtocolError::MalformedBody { .. })));
    assert!(matches!(Reply::decode(Kind::Ping, &[]), Err(ProtocolError::MalformedBody { .. })));
}

#[test]
fn a_body_over_the_cap_is_not_encoded_and_long_strings_are_cut() {
    // Goal: the sender refuses to build a frame its peer would refuse; strings are cut on a
    // character boundary to the cap.
    let tokens: Vec<u32> = vec![0; (BODY_BYTES_MAX as usize) / 4];
    let mut out = Vec::new();
    let error = encode_frame(&mut out, Kind::Lookup, 1, |out| encode_lookup_body(&tokens, out)).unwrap_err();
    assert!(matches!(error, ProtocolError::FrameTooLarge { .. }));
    let fits: Vec<u32> = vec![0; (BODY_BYTES_MAX as usize) / 4 - 1];
    encode_frame(&mut out, Kind::Lookup, 1, |out| encode_lookup_body(&fits, out)).unwrap();
    let long = "é".repeat(STRING_BYTES_MAX);
    let Reply::Error { message, .. } = Reply::error(ErrorCode::BadRequest, long) else { unreachable!() };
    assert!(message.len() <= STRING_BYTES_MAX && message.chars().all(|c| c == 'é'));
}

#[test]
fn error_codes_round_trip() {
    for code in 0..=20u16 {
        assert_eq!(ErrorCode::from_u16(code).to_u16(), code);
    }
}
