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
        devices: vec![DeviceStatus { spec: "emu:mem:64MiB".into(), description: "software NVMe controller".into(), refused_commands: 4 }],
        metadata_fenced: vec![true],
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
            registrations: 1,
            queue_pairs: 2,
            requests_in_flight: 3,
            doorbells_relayed: 11,
            doorbells_dropped: 1,
            awaiting_exit: true,
            kept: true,
            retiring: true,
        }],
        leaked_queue_pairs: 6,
        leaked_windows: 2,
        leaked_window_bytes: 8 << 20,
        leaked_requests: 3,
        relay: RelayStatus { passes: 1000, forwarded: 11, dropped: 1, queues: 1 },
    }
}

#[test]
fn every_message_round_trips() {
    // Goal: encode then decode gives back each request and reply, header included.
    let requests = [
        Request::Hello(Hello { model_fingerprint: [3; 32], tp_rank: 1, tp_world: 4, client_name: "rank-1".into() }),
        Request::Lookup { tokens: (0..100).collect(), first_block: 0 },
        Request::Lookup { tokens: Vec::new(), first_block: 3 },
        Request::LookupAllRanks { tokens: (7..70).collect(), first_block: 2 },
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
    version[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    assert_eq!(header_of(&version), Err(ProtocolError::UnsupportedVersion { found: PROTOCOL_VERSION + 1 }));
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
    for request in [hello, Request::Lookup { tokens: vec![1, 2, 3], first_block: 0 }] {
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
    let error = Request::decode(Kind::LookupCluster, &lying).unwrap_err().to_string();
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
    let error = encode_frame(&mut out, Kind::LookupCluster, 1, |out| encode_lookup_body(&tokens, out)).unwrap_err();
    assert!(matches!(error, ProtocolError::FrameTooLarge { .. }));
    let fits: Vec<u32> = vec![0; (BODY_BYTES_MAX as usize) / 4 - 1];
    encode_frame(&mut out, Kind::LookupCluster, 1, |out| encode_lookup_body(&fits, out)).unwrap();
    let error = encode_frame(&mut out, Kind::Lookup, 1, |out| encode_lookup_from_body(&fits, 0, out)).unwrap_err();
    assert!(matches!(error, ProtocolError::FrameTooLarge { .. }), "a Lookup's body holds its first block too");
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

fn sample_pool_shape() -> objstore::PoolShape {
    use objstore::format::SlotAddressing;
    let device = |nsid, sgl| objstore::DeviceLayout {
        nsid,
        addressing: SlotAddressing { data_lba: 256, slot_blocks: 8, pair_blocks: 2, lba_shift: 12 },
        slot_count: 1000,
        lba_bytes: 4096,
        capacity_blocks: 16384,
        max_transfer_bytes: 1 << 20,
        sgl_supported: sgl,
    };
    objstore::PoolShape {
        geometry: objstore::ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 },
        blocks_per_slot: 2,
        layer_stride_blocks: 4,
        payload_crcs: true,
        devices: vec![device(1, true), device(3, false)],
    }
}

fn sample_placements() -> Vec<objstore::Placement> {
    (0..3u32)
        .map(|i| objstore::Placement {
            location: objstore::BlockLocation { device: i as u16, slot: 1000 + i, index: (i % 2) as u16 },
            engine_block: 7 * i,
        })
        .collect()
}

fn store_requests() -> Vec<Request> {
    vec![
        Request::RegisterMemory(RegisterMemory { window_bytes: 8 << 20, kv_blocks: 64 }),
        Request::AttachQueues(AttachQueues {
            registration: 3,
            depth: 64,
            rings: vec![
                RingOffsets { submission_offset: 4096, completion_offset: 8192 },
                RingOffsets { submission_offset: 0, completion_offset: 1 },
            ],
        }),
        Request::PoolShape,
        Request::PrepareRetrieve(Prepare { registration: 3, tokens: (0..40).collect(), block_ids: vec![5, 4], first_block: 1 }),
        Request::PrepareStore(Prepare { registration: 9, tokens: vec![1; 33], block_ids: vec![0, 1], first_block: 0 }),
        Request::Commit(Commit {
            handle: 0x1_0000_0002,
            payload_crcs: Some(vec![1, 2, 3]),
            transferred: objstore::Transferred { bytes: 3 << 16, commands: 6 },
        }),
        Request::Commit(Commit { handle: 5, payload_crcs: None, transferred: objstore::Transferred::default() }),
        Request::Release { handle: u64::MAX, transferred: objstore::Transferred::default(), corrupt_blocks: Vec::new() },
        Request::Release {
            handle: 7,
            transferred: objstore::Transferred { bytes: 1 << 20, commands: 16 },
            corrupt_blocks: vec![
                objstore::MismatchedBlock { position: 2, engine_block: 9, device: 1, slot: 300, expected_crc: 0xdead, computed_crc: 7 },
                objstore::MismatchedBlock { position: 0, engine_block: 0, device: 0, slot: 0, expected_crc: 1, computed_crc: 2 },
            ],
        },
    ]
}

fn store_replies() -> Vec<Reply> {
    vec![
        Reply::Registered(Registered { registration: 3, iova_base: 0x10_0000, address_space: 77 }),
        Reply::Attached {
            queues: vec![QueueGrant {
                queue_id: 5,
                depth: 64,
                submission_iova: 0x10_1000,
                completion_iova: 0x10_2000,
                submission_doorbell_offset: 0x1028,
                completion_doorbell_offset: 0x102c,
                namespaces: vec![NamespaceGrant { nsid: 1, lba_bytes: 4096, size_blocks: 16384 }],
                sgl: true,
                sgl_dword_lengths: true,
                max_transfer_bytes: 1 << 20,
                register_fd: 0,
                register_bytes: 16384,
            }],
        },
        Reply::PoolShape(sample_pool_shape()),
        Reply::RetrievePrepared(RetrievePrepared { handle: 9, placements: sample_placements(), expected_crcs: Some(vec![4, 5, 6]) }),
        Reply::RetrievePrepared(RetrievePrepared { handle: 9, placements: Vec::new(), expected_crcs: None }),
        Reply::StorePrepared(StorePrepared {
            handle: 1,
            new_blocks: 3,
            shared_blocks: 2,
            evicted_slots: 1,
            placements: sample_placements(),
        }),
        Reply::Committed { stored: 3 },
        Reply::Released,
    ]
}

#[test]
fn the_largest_prepare_replies_fit_one_frame() {
    // Goal: a prepare the daemon accepts (at most PREPARE_BLOCKS_MAX blocks) always gets a
    // reply that fits a frame, CRCs included: a reply that did not fit would leave its
    // reservation with no handle to release it by. A few more placements do not fit, so the
    // cap is not needlessly low.
    let placements = |count: usize| -> Vec<objstore::Placement> {
        (0..count as u32)
            .map(|i| objstore::Placement {
                location: objstore::BlockLocation { device: u16::MAX, slot: u32::MAX - i, index: u16::MAX },
                engine_block: i,
            })
            .collect()
    };
    let replies = |count: usize| {
        [
            Reply::RetrievePrepared(RetrievePrepared {
                handle: u64::MAX,
                placements: placements(count),
                expected_crcs: Some(vec![u32::MAX; count]),
            }),
            Reply::StorePrepared(StorePrepared {
                handle: u64::MAX,
                new_blocks: count as u32,
                shared_blocks: 0,
                evicted_slots: count as u32,
                placements: placements(count),
            }),
        ]
    };
    let mut out = Vec::new();
    for reply in replies(PREPARE_BLOCKS_MAX) {
        encode_frame(&mut out, reply.kind(), 1, |out| reply.encode_body(out)).unwrap();
        assert_eq!(Reply::decode(reply.kind(), &out[HEADER_BYTES..]).unwrap(), reply);
    }
    let [retrieve, _] = replies(PREPARE_BLOCKS_MAX + 8);
    assert!(encode_frame(&mut out, retrieve.kind(), 1, |out| retrieve.encode_body(out)).is_err());
}

#[test]
fn a_release_of_the_most_corrupt_blocks_fits_one_frame_and_one_more_does_not() {
    // Goal: RELEASE_CORRUPT_BLOCKS_MAX is exactly what one Release carries (the client reports
    // that many and logs the rest, RemoteKvStore::finish), and it is below what a retrieve may
    // name, which is why the client must cut its report.
    let release = |count: usize| Request::Release {
        handle: u64::MAX,
        transferred: objstore::Transferred { bytes: u64::MAX, commands: u64::MAX },
        corrupt_blocks: (0..count)
            .map(|i| objstore::MismatchedBlock {
                position: i,
                engine_block: u32::MAX,
                device: u16::MAX,
                slot: u32::MAX,
                expected_crc: 1,
                computed_crc: 2,
            })
            .collect(),
    };
    let mut out = Vec::new();
    let most = release(RELEASE_CORRUPT_BLOCKS_MAX);
    encode_frame(&mut out, most.kind(), 1, |out| most.encode_body(out)).unwrap();
    assert_eq!(Request::decode(most.kind(), &out[HEADER_BYTES..]).unwrap(), most);
    let over = release(RELEASE_CORRUPT_BLOCKS_MAX + 1);
    assert!(matches!(encode_frame(&mut out, over.kind(), 1, |out| over.encode_body(out)), Err(ProtocolError::FrameTooLarge { .. })));
    const { assert!(RELEASE_CORRUPT_BLOCKS_MAX < PREPARE_BLOCKS_MAX) };
}

#[test]
fn store_path_messages_round_trip_and_every_truncation_is_malformed() {
    // Goal: each store-path request and reply decodes to itself; every cut of its body and a
    // trailing byte are MalformedBody, never a panic.
    let requests = store_requests();
    let replies = store_replies();
    for request in &requests {
        let frame = frame_of(request.kind(), |out| request.encode_body(out));
        let header = header_of(&frame).unwrap();
        assert!(header.kind.is_request());
        let body = &frame[HEADER_BYTES..];
        assert_eq!(&Request::decode(header.kind, body).unwrap(), request);
        for cut in 0..body.len() {
            assert!(
                matches!(Request::decode(header.kind, &body[..cut]), Err(ProtocolError::MalformedBody { .. })),
                "{request:?} cut at {cut}"
            );
        }
        let mut long = body.to_vec();
        long.push(0);
        assert!(matches!(Request::decode(header.kind, &long), Err(ProtocolError::MalformedBody { .. })), "{request:?} + 1 byte");
    }
    for reply in &replies {
        let frame = frame_of(reply.kind(), |out| reply.encode_body(out));
        let header = header_of(&frame).unwrap();
        assert!(!header.kind.is_request());
        let body = &frame[HEADER_BYTES..];
        assert_eq!(&Reply::decode(header.kind, body).unwrap(), reply);
        for cut in 0..body.len() {
            assert!(matches!(Reply::decode(header.kind, &body[..cut]), Err(ProtocolError::MalformedBody { .. })), "{reply:?} cut at {cut}");
        }
        let mut long = body.to_vec();
        long.push(0);
        assert!(matches!(Reply::decode(header.kind, &long), Err(ProtocolError::MalformedBody { .. })), "{reply:?} + 1 byte");
    }
}

#[test]
fn store_path_counts_and_flags_are_checked_before_allocating() {
    // Goal: a count that claims more items than the body holds, and a flag byte other than 0/1,
    // are refused with the field named (nothing allocated from the count).
    let mut lying = Vec::new();
    lying.extend_from_slice(&3u64.to_le_bytes()); // registration
    lying.extend_from_slice(&u32::MAX.to_le_bytes()); // token count
    lying.extend_from_slice(&[0; 8]);
    let error = Request::decode(Kind::PrepareStore, &lying).unwrap_err().to_string();
    assert!(error.contains("token_count 4294967295 but 8 bytes left"), "{error}");
    let mut placements = Vec::new();
    placements.extend_from_slice(&1u64.to_le_bytes());
    placements.extend_from_slice(&1_000_000u32.to_le_bytes());
    let error = Reply::decode(Kind::RetrievePrepared, &placements).unwrap_err().to_string();
    assert!(error.contains("placement_count 1000000"), "{error}");
    let mut flag = Vec::new();
    flag.extend_from_slice(&1u64.to_le_bytes());
    flag.push(2);
    let error = Request::decode(Kind::Commit, &flag).unwrap_err().to_string();
    assert!(error.contains("payload_crcs is 2, expected 0 or 1"), "{error}");
    let mut corrupt = Vec::new();
    corrupt.extend_from_slice(&1u64.to_le_bytes()); // handle
    corrupt.extend_from_slice(&[0; 16]); // transferred
    corrupt.extend_from_slice(&1_000_000u32.to_le_bytes());
    corrupt.extend_from_slice(&[0; 22]);
    let error = Request::decode(Kind::Release, &corrupt).unwrap_err().to_string();
    assert!(error.contains("corrupt_block_count 1000000 but 22 bytes left"), "{error}");
}

fn sample_cluster_status() -> ClusterStatusReply {
    ClusterStatusReply {
        enabled: true,
        cluster: "fleet".into(),
        node: "node-a".into(),
        data_address: "127.0.0.1:7400".into(),
        segment_blocks: 32,
        joined: true,
        lease_id: 0x7f00_0000_0000_0001,
        joins: 2,
        lease_losses: 1,
        segments_held: 40,
        segments_registered: 38,
        registered_segments: 90,
        registration_transactions: 12,
        unregistered_segments: 50,
        registry_errors: 3,
        commits_dropped: 0,
        manifest_errors: 0,
        lookups: 17,
        lookup_failures: 2,
        lookups_skipped: 5,
        remote_blocks_found: 640,
        remote_reads: 4,
        remote_read_failures: 1,
        fetched_blocks: 96,
        served_segments: 9,
        serve_refusals: 2,
        last_error: "the cluster registry is unavailable".into(),
        registry: RegistryAnswer::Unavailable,
        registry_silent_ms: 4_321,
        replicated_segments: 6,
        key_secret_tag: [0xc0, 0xff, 0xee, 0x01],
        members_other_key_secret: -1,
    }
}

#[test]
fn cluster_messages_round_trip_and_every_truncation_is_malformed() {
    // Goal: ClusterStatus, LookupCluster and their replies decode to themselves; every cut of a
    // reply's body, a trailing byte, and a flag or answer out of range are MalformedBody.
    let frame = frame_of(Kind::ClusterStatus, |out| Request::ClusterStatus.encode_body(out));
    let header = header_of(&frame).unwrap();
    assert_eq!(Request::decode(header.kind, &frame[HEADER_BYTES..]).unwrap(), Request::ClusterStatus);
    for request in [Request::LookupCluster { tokens: (5..90).collect() }, Request::FetchRemote { tokens: (7..9).collect() }] {
        let frame = frame_of(request.kind(), |out| request.encode_body(out));
        let header = header_of(&frame).unwrap();
        assert_eq!(Request::decode(header.kind, &frame[HEADER_BYTES..]).unwrap(), request);
    }
    let lookup = ClusterLookupReply {
        cached_blocks: 20,
        block_tokens: 16,
        registry: RegistryAnswer::Answered,
        remote_blocks: 44,
        holders: vec![RemoteHolder { node: "node-b".into(), blocks: 44 }, RemoteHolder { node: "c".into(), blocks: 12 }],
    };
    let not_clustered = ClusterLookupReply {
        cached_blocks: 3,
        block_tokens: 16,
        registry: RegistryAnswer::NotClustered,
        remote_blocks: 0,
        holders: Vec::new(),
    };
    for reply in [
        Reply::ClusterStatus(sample_cluster_status()),
        Reply::ClusterStatus(ClusterStatusReply::default()),
        Reply::ClusterLookup(lookup),
        Reply::ClusterLookup(not_clustered),
        Reply::Fetched { cached_blocks: 32, fetched_blocks: 12 },
    ] {
        let frame = frame_of(reply.kind(), |out| reply.encode_body(out));
        let header = header_of(&frame).unwrap();
        assert_eq!(header.kind, reply.kind());
        let body = &frame[HEADER_BYTES..];
        assert_eq!(Reply::decode(header.kind, body).unwrap(), reply);
        for cut in 0..body.len() {
            assert!(matches!(Reply::decode(header.kind, &body[..cut]), Err(ProtocolError::MalformedBody { .. })), "cut at {cut}");
        }
        let mut long = body.to_vec();
        long.push(0);
        assert!(matches!(Reply::decode(header.kind, &long), Err(ProtocolError::MalformedBody { .. })));
        if header.kind == Kind::ClusterStatusReply {
            // The status's registry answer (after its last string, 29 bytes from the end: then
            // two u64s, the 4-byte key secret tag and an i64).
            let mut answer = body.to_vec();
            let at = answer.len() - 29;
            answer[at] = 3;
            assert!(matches!(Reply::decode(header.kind, &answer), Err(ProtocolError::MalformedBody { .. })));
        }
        // The status's first flag, the lookup's registry answer: 3 is neither.
        if header.kind != Kind::Fetched {
            let mut flag = body.to_vec();
            flag[if header.kind == Kind::ClusterStatusReply { 0 } else { 8 }] = 3;
            assert!(matches!(Reply::decode(header.kind, &flag), Err(ProtocolError::MalformedBody { .. })));
        }
    }
}

#[test]
fn a_status_reply_at_the_clients_cap_fits_one_frame() {
    // Goal: the daemon serves at most STATUS_CLIENTS_MAX sessions so that `tuttid --status`
    // works when it is busiest: a status reply listing that many, each entry at its longest
    // (a name past the longest `Hello` accepts is cut to it), with the devices it keeps room
    // for at their longest, encodes within the body cap and decodes to itself (names cut).
    let mut status = sample_status();
    let longest = "d".repeat(STRING_BYTES_MAX + 10);
    status.devices = (0..STATUS_DEVICES_RESERVED)
        .map(|_| DeviceStatus { spec: longest.clone(), description: longest.clone(), refused_commands: u64::MAX })
        .collect();
    status.metadata_fenced = vec![true; STATUS_DEVICES_RESERVED];
    let client = ClientStatus { name: "é".repeat(CLIENT_NAME_BYTES_MAX), ..sample_status().clients[0].clone() };
    status.clients = vec![client; STATUS_CLIENTS_MAX];
    let frame = frame_of(Kind::StatusReply, |out| Reply::Status(status.clone()).encode_body(out));
    let body_bytes = frame.len() - HEADER_BYTES;
    assert!(body_bytes <= BODY_BYTES_MAX as usize, "{body_bytes} bytes");
    let Reply::Status(decoded) = Reply::decode(Kind::StatusReply, &frame[HEADER_BYTES..]).unwrap() else { panic!("not a status") };
    assert_eq!(decoded.clients.len(), STATUS_CLIENTS_MAX);
    assert!(decoded.clients.iter().all(|client| client.name.len() <= CLIENT_NAME_BYTES_MAX));
    assert_eq!(decoded.devices[0].spec.len(), STRING_BYTES_MAX);
    // The sizes the cap is worked out from are exact: the room left is less than one entry.
    assert!(BODY_BYTES_MAX as usize - body_bytes < CLIENT_STATUS_BYTES_MAX, "{body_bytes} bytes");
}
