//! Randomized tests of the client protocol's decoders: bodies and headers come from a socket, so
//! whatever bytes arrive must decode to a value or a typed [`ProtocolError`], never a panic, and a
//! decoded value must encode back to exactly the bytes it came from (the encoding is canonical:
//! every field fixed-width or length-prefixed, flags 0 or 1, no trailing bytes).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use objstore::format::SlotAddressing;
use objstore::{BlockLocation, DeviceLayout, MismatchedBlock, ModelGeometry, Placement, Transferred};
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::sample::{select, Index};

use super::*;

/// Every kind this build knows (checked against `Kind::from_u16` below).
const ALL_KINDS: [Kind; 31] = [
    Kind::Hello,
    Kind::Lookup,
    Kind::Status,
    Kind::Ping,
    Kind::LookupAllRanks,
    Kind::RegisterMemory,
    Kind::AttachQueues,
    Kind::PoolShape,
    Kind::PrepareRetrieve,
    Kind::PrepareStore,
    Kind::Commit,
    Kind::Release,
    Kind::RegisterDeviceMemory,
    Kind::ClusterStatus,
    Kind::LookupCluster,
    Kind::FetchRemote,
    Kind::HelloReply,
    Kind::LookupReply,
    Kind::StatusReply,
    Kind::Pong,
    Kind::Registered,
    Kind::Attached,
    Kind::PoolShapeReply,
    Kind::RetrievePrepared,
    Kind::StorePrepared,
    Kind::Committed,
    Kind::Released,
    Kind::ClusterStatusReply,
    Kind::ClusterLookupReply,
    Kind::Fetched,
    Kind::Error,
];

fn config(cases: u32) -> ProptestConfig {
    // No regression files in the source tree: a failure prints its minimal input.
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

/// A decoded message, request or reply, so one property covers both.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Message {
    Request(Request),
    Reply(Reply),
}

impl Message {
    fn kind(&self) -> Kind {
        match self {
            Message::Request(request) => request.kind(),
            Message::Reply(reply) => reply.kind(),
        }
    }

    fn body(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Message::Request(request) => request.encode_body(&mut out),
            Message::Reply(reply) => reply.encode_body(&mut out),
        }
        out
    }

    fn decode(kind: Kind, body: &[u8]) -> Result<Message, ProtocolError> {
        if kind.is_request() {
            Request::decode(kind, body).map(Message::Request)
        } else {
            Reply::decode(kind, body).map(Message::Reply)
        }
    }
}

/// What any body of `kind` must decode to: a value of that kind that encodes back to exactly
/// `body` (and decodes again to itself), or a `MalformedBody` naming `kind`. Also checks that the
/// other direction (a request kind decoded as a reply, or the reverse) is a typed error.
fn check_body(kind: Kind, body: &[u8]) -> Result<Option<Message>, TestCaseError> {
    let wrong_way = if kind.is_request() { Reply::decode(kind, body).err() } else { Request::decode(kind, body).err() };
    prop_assert!(
        matches!(wrong_way, Some(ProtocolError::MalformedBody { kind: named, .. }) if named == kind),
        "{kind:?} decoded the wrong way: {wrong_way:?}"
    );
    match Message::decode(kind, body) {
        Ok(message) => {
            prop_assert_eq!(message.kind(), kind);
            let encoded = message.body();
            prop_assert_eq!(&encoded[..], body, "{:?} re-encodes to other bytes", kind);
            prop_assert_eq!(Message::decode(kind, &encoded), Ok(message.clone()));
            Ok(Some(message))
        }
        Err(ProtocolError::MalformedBody { kind: named, reason }) => {
            prop_assert_eq!(named, kind);
            prop_assert!(!reason.is_empty());
            Ok(None)
        }
        Err(other) => Err(TestCaseError::fail(format!("{kind:?} body: {other:?} is not a body error"))),
    }
}

// ---- strategies for the messages ----

/// Up to 16 characters of up to 4 bytes: within the 64-byte client and node name caps.
fn short_name() -> impl Strategy<Value = String> {
    "\\PC{0,16}"
}

/// A string field (cap `STRING_BYTES_MAX`), now and then at or just under the cap (ASCII or
/// two-byte characters).
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => "\\PC{0,40}",
        1 => (STRING_BYTES_MAX - 8..=STRING_BYTES_MAX).prop_map(|bytes| "x".repeat(bytes)),
        1 => Just("é".repeat(STRING_BYTES_MAX / 2)),
    ]
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    prop_oneof![8 => vec(any::<u32>(), 0..64), 1 => vec(any::<u32>(), 1000..3000)]
}

fn u64s(count: usize) -> impl Strategy<Value = Vec<u64>> {
    vec(any::<u64>(), count)
}

fn pool_shape_small() -> impl Strategy<Value = PoolShape> {
    vec(any::<u32>(), 6).prop_map(|v| PoolShape {
        layers: v[0],
        kv_heads: v[1],
        head_dim: v[2],
        dtype_bytes: v[3],
        block_tokens: v[4],
        blocks_per_slot: v[5],
    })
}

fn transferred() -> impl Strategy<Value = Transferred> {
    (any::<u64>(), any::<u64>()).prop_map(|(bytes, commands)| Transferred { bytes, commands })
}

fn mismatched_block() -> impl Strategy<Value = MismatchedBlock> {
    (any::<u32>(), any::<u32>(), any::<u16>(), any::<u32>(), any::<u32>(), any::<u32>()).prop_map(
        |(position, engine_block, device, slot, expected_crc, computed_crc)| MismatchedBlock {
            position: position as usize,
            engine_block,
            device,
            slot,
            expected_crc,
            computed_crc,
        },
    )
}

fn placement() -> impl Strategy<Value = Placement> {
    (any::<u16>(), any::<u32>(), any::<u16>(), any::<u32>())
        .prop_map(|(device, slot, index, engine_block)| Placement { location: BlockLocation { device, slot, index }, engine_block })
}

fn prepare() -> impl Strategy<Value = Prepare> {
    (any::<u64>(), tokens(), vec(any::<u32>(), 0..64), any::<u32>()).prop_map(|(registration, tokens, block_ids, first_block)| Prepare {
        registration,
        tokens,
        block_ids,
        first_block,
    })
}

fn register_device_memory() -> impl Strategy<Value = RegisterDeviceMemory> {
    (
        select(vec![DeviceMemoryKind::CudaIpc, DeviceMemoryKind::Memfd]),
        vec(any::<u8>(), DEVICE_MEMORY_HANDLE_BYTES),
        any::<[u8; DEVICE_UUID_BYTES]>(),
        u64s(3),
        any::<u32>(),
    )
        .prop_map(|(kind, handle, device_uuid, sizes, kv_blocks)| RegisterDeviceMemory {
            kind,
            handle: handle.try_into().unwrap(),
            device_uuid,
            allocation_bytes: sizes[0],
            offset_bytes: sizes[1],
            length_bytes: sizes[2],
            kv_blocks,
        })
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        (any::<[u8; FINGERPRINT_BYTES]>(), any::<u32>(), any::<u32>(), short_name()).prop_map(
            |(model_fingerprint, tp_rank, tp_world, client_name)| Request::Hello(Hello {
                model_fingerprint,
                tp_rank,
                tp_world,
                client_name
            })
        ),
        (tokens(), any::<u32>()).prop_map(|(tokens, first_block)| Request::Lookup { tokens, first_block }),
        Just(Request::Status),
        Just(Request::Ping),
        (tokens(), any::<u32>()).prop_map(|(tokens, first_block)| Request::LookupAllRanks { tokens, first_block }),
        (any::<u64>(), any::<u32>())
            .prop_map(|(window_bytes, kv_blocks)| Request::RegisterMemory(RegisterMemory { window_bytes, kv_blocks })),
        (any::<u64>(), any::<u32>(), prop_oneof![vec(u64s(2), 0..8), vec(u64s(2), DEVICES_MAX - 1..=DEVICES_MAX)]).prop_map(
            |(registration, depth, rings)| Request::AttachQueues(AttachQueues {
                registration,
                depth,
                rings: rings.iter().map(|r| RingOffsets { submission_offset: r[0], completion_offset: r[1] }).collect(),
            })
        ),
        Just(Request::PoolShape),
        prepare().prop_map(Request::PrepareRetrieve),
        prepare().prop_map(Request::PrepareStore),
        (any::<u64>(), option::of(vec(any::<u32>(), 0..64)), transferred())
            .prop_map(|(handle, payload_crcs, transferred)| Request::Commit(Commit { handle, payload_crcs, transferred })),
        (any::<u64>(), transferred(), vec(mismatched_block(), 0..16)).prop_map(|(handle, transferred, corrupt_blocks)| Request::Release {
            handle,
            transferred,
            corrupt_blocks
        }),
        register_device_memory().prop_map(Request::RegisterDeviceMemory),
        Just(Request::ClusterStatus),
        tokens().prop_map(|tokens| Request::LookupCluster { tokens }),
        tokens().prop_map(|tokens| Request::FetchRemote { tokens }),
    ]
}

fn device_status() -> impl Strategy<Value = DeviceStatus> {
    (text(), text(), any::<u64>()).prop_map(|(spec, description, refused_commands)| DeviceStatus { spec, description, refused_commands })
}

fn client_status() -> impl Strategy<Value = ClientStatus> {
    (short_name(), vec(any::<u32>(), 7), u64s(5), any::<(bool, bool, bool)>()).prop_map(|(name, w, d, (awaiting_exit, kept, retiring))| {
        ClientStatus {
            session: d[0],
            pid: w[0],
            uid: w[1],
            name,
            tp_rank: w[2],
            tp_world: w[3],
            requests: d[1],
            idle_ms: d[2],
            registrations: w[4],
            queue_pairs: w[5],
            requests_in_flight: w[6],
            doorbells_relayed: d[3],
            doorbells_dropped: d[4],
            awaiting_exit,
            kept,
            retiring,
        }
    })
}

fn status_reply() -> impl Strategy<Value = StatusReply> {
    let devices = vec((device_status(), any::<bool>()), 0..4);
    (any::<u32>(), pool_shape_small(), devices, any::<u32>(), vec(client_status(), 0..6), u64s(16)).prop_map(
        |(daemon_pid, shape, devices, connections, clients, d)| StatusReply {
            daemon_pid,
            uptime_ms: d[0],
            shape,
            metadata_fenced: devices.iter().map(|(_, fenced)| *fenced).collect(),
            devices: devices.into_iter().map(|(device, _)| device).collect(),
            pool: PoolStatus {
                slots: d[1],
                free_slots: d[2],
                valid_slots: d[3],
                writing_slots: d[4],
                pinned_slots: d[5],
                cached_blocks: d[6],
                evictions: d[7],
            },
            connections,
            clients,
            leaked_queue_pairs: d[8],
            leaked_windows: d[9],
            leaked_window_bytes: d[10],
            leaked_requests: d[11],
            relay: RelayStatus { passes: d[12], forwarded: d[13], dropped: d[14], queues: d[15] },
        },
    )
}

fn registry_answer() -> impl Strategy<Value = RegistryAnswer> {
    select(vec![RegistryAnswer::Answered, RegistryAnswer::NotClustered, RegistryAnswer::Unavailable])
}

fn cluster_status() -> impl Strategy<Value = ClusterStatusReply> {
    (
        (any::<bool>(), text(), short_name(), text(), any::<u16>(), any::<bool>()),
        u64s(22),
        text(),
        registry_answer(),
        (any::<[u8; tutti_cluster::KEY_SECRET_TAG_BYTES]>(), any::<i64>()),
    )
        .prop_map(
            |(
                (enabled, cluster, node, data_address, segment_blocks, joined),
                d,
                last_error,
                registry,
                (key_secret_tag, members_other_key_secret),
            )| ClusterStatusReply {
                enabled,
                cluster,
                node,
                data_address,
                segment_blocks,
                joined,
                lease_id: d[0],
                joins: d[1],
                lease_losses: d[2],
                segments_held: d[3],
                segments_registered: d[4],
                registered_segments: d[5],
                registration_transactions: d[6],
                unregistered_segments: d[7],
                registry_errors: d[8],
                commits_dropped: d[9],
                manifest_errors: d[10],
                lookups: d[11],
                lookup_failures: d[12],
                lookups_skipped: d[13],
                remote_blocks_found: d[14],
                remote_reads: d[15],
                remote_read_failures: d[16],
                fetched_blocks: d[17],
                served_segments: d[18],
                serve_refusals: d[19],
                last_error,
                registry,
                registry_silent_ms: d[20],
                replicated_segments: d[21],
                key_secret_tag,
                members_other_key_secret,
            },
        )
}

fn cluster_lookup() -> impl Strategy<Value = ClusterLookupReply> {
    (any::<u32>(), any::<u32>(), registry_answer(), any::<u32>(), vec((short_name(), any::<u32>()), 0..16)).prop_map(
        |(cached_blocks, block_tokens, registry, remote_blocks, holders)| ClusterLookupReply {
            cached_blocks,
            block_tokens,
            registry,
            remote_blocks,
            holders: holders.into_iter().map(|(node, blocks)| RemoteHolder { node, blocks }).collect(),
        },
    )
}

fn device_layout() -> impl Strategy<Value = DeviceLayout> {
    (u64s(7), vec(any::<u32>(), 3), any::<bool>()).prop_map(|(d, w, sgl_supported)| DeviceLayout {
        nsid: w[0],
        addressing: SlotAddressing { data_lba: d[0], slot_blocks: d[1], pair_blocks: d[2], lba_shift: w[1] },
        slot_count: d[3],
        lba_bytes: w[2],
        capacity_blocks: d[4],
        max_transfer_bytes: d[5],
        sgl_supported,
    })
}

fn objstore_pool_shape() -> impl Strategy<Value = objstore::PoolShape> {
    (pool_shape_small(), any::<u64>(), any::<bool>(), vec(device_layout(), 0..6)).prop_map(
        |(s, layer_stride_blocks, payload_crcs, devices)| objstore::PoolShape {
            geometry: ModelGeometry {
                layers: s.layers,
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
                dtype_bytes: s.dtype_bytes,
                block_tokens: s.block_tokens,
            },
            blocks_per_slot: s.blocks_per_slot,
            layer_stride_blocks,
            payload_crcs,
            devices,
        },
    )
}

fn queue_grant() -> impl Strategy<Value = QueueGrant> {
    (
        any::<u16>(),
        any::<u32>(),
        u64s(7),
        vec((any::<u32>(), any::<u32>(), any::<u64>()), 0..=NAMESPACES_MAX),
        any::<bool>(),
        any::<bool>(),
        any::<u8>(),
    )
        .prop_map(|(queue_id, depth, d, namespaces, sgl, sgl_dword_lengths, register_fd)| QueueGrant {
            queue_id,
            depth,
            submission_iova: d[0],
            completion_iova: d[1],
            submission_doorbell_offset: d[2],
            completion_doorbell_offset: d[3],
            namespaces: namespaces
                .into_iter()
                .map(|(nsid, lba_bytes, size_blocks)| NamespaceGrant { nsid, lba_bytes, size_blocks })
                .collect(),
            sgl,
            sgl_dword_lengths,
            max_transfer_bytes: d[4],
            register_fd,
            register_bytes: d[5],
        })
}

fn reply() -> impl Strategy<Value = Reply> {
    prop_oneof![
        (any::<u64>(), any::<u32>(), pool_shape_small()).prop_map(|(session, lease_ms, shape)| Reply::Hello(HelloReply {
            session,
            lease_ms,
            shape
        })),
        (any::<u32>(), any::<u32>()).prop_map(|(cached_blocks, block_tokens)| Reply::Lookup { cached_blocks, block_tokens }),
        status_reply().prop_map(Reply::Status),
        Just(Reply::Pong),
        (any::<u16>(), text()).prop_map(|(code, message)| Reply::Error { code: ErrorCode::from_u16(code), message }),
        u64s(3).prop_map(|d| Reply::Registered(Registered { registration: d[0], iova_base: d[1], address_space: d[2] })),
        vec(queue_grant(), 0..6).prop_map(|queues| Reply::Attached { queues }),
        objstore_pool_shape().prop_map(Reply::PoolShape),
        (any::<u64>(), vec(placement(), 0..64), option::of(vec(any::<u32>(), 0..64))).prop_map(|(handle, placements, expected_crcs)| {
            Reply::RetrievePrepared(RetrievePrepared { handle, placements, expected_crcs })
        }),
        (any::<u64>(), vec(any::<u32>(), 3), vec(placement(), 0..64)).prop_map(|(handle, w, placements)| Reply::StorePrepared(
            StorePrepared { handle, new_blocks: w[0], shared_blocks: w[1], evicted_slots: w[2], placements }
        )),
        any::<u32>().prop_map(|stored| Reply::Committed { stored }),
        Just(Reply::Released),
        cluster_status().prop_map(Reply::ClusterStatus),
        cluster_lookup().prop_map(Reply::ClusterLookup),
        (any::<u32>(), any::<u32>()).prop_map(|(cached_blocks, fetched_blocks)| Reply::Fetched { cached_blocks, fetched_blocks }),
    ]
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![request().prop_map(Message::Request), reply().prop_map(Message::Reply)]
}

/// One edit of an encoded body (the data plane's frame properties use these too).
#[derive(Debug, Clone)]
pub(crate) enum Mutation {
    /// XOR one byte with a nonzero value.
    Flip(Index, u8),
    /// Cut the body at a point.
    Truncate(Index),
    /// Append bytes.
    Extend(Vec<u8>),
    /// Insert bytes at a point.
    Insert(Index, Vec<u8>),
    /// Overwrite a u16 or u32 at a point with a value near a count's bounds.
    Count(Index, u32, bool),
}

pub(crate) fn mutation() -> impl Strategy<Value = Mutation> {
    let counts =
        select(vec![0u32, 1, 2, 6, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1023, 1024, 1025, 4096, 4097, 0xFFFF, 0x1_0000, u32::MAX]);
    prop_oneof![
        (any::<Index>(), 1u8..=255).prop_map(|(at, xor)| Mutation::Flip(at, xor)),
        any::<Index>().prop_map(Mutation::Truncate),
        vec(any::<u8>(), 1..8).prop_map(Mutation::Extend),
        (any::<Index>(), vec(any::<u8>(), 1..8)).prop_map(|(at, bytes)| Mutation::Insert(at, bytes)),
        (any::<Index>(), counts, any::<bool>()).prop_map(|(at, value, wide)| Mutation::Count(at, value, wide)),
    ]
}

pub(crate) fn mutate(body: &mut Vec<u8>, mutation: &Mutation) {
    match mutation {
        Mutation::Flip(at, xor) if !body.is_empty() => {
            let at = at.index(body.len());
            body[at] ^= xor;
        }
        Mutation::Truncate(at) => body.truncate(at.index(body.len() + 1)),
        Mutation::Extend(bytes) => body.extend_from_slice(bytes),
        Mutation::Insert(at, bytes) => {
            let at = at.index(body.len() + 1);
            body.splice(at..at, bytes.iter().copied());
        }
        Mutation::Count(at, value, wide) => {
            let bytes = if *wide { value.to_le_bytes().to_vec() } else { (*value as u16).to_le_bytes().to_vec() };
            if body.len() >= bytes.len() {
                let at = at.index(body.len() - bytes.len() + 1);
                body[at..at + bytes.len()].copy_from_slice(&bytes);
            }
        }
        Mutation::Flip(..) => {}
    }
}

/// A 16-byte header built from parts that are each the documented value or not.
fn header_bytes() -> impl Strategy<Value = [u8; HEADER_BYTES]> {
    let kinds: Vec<u16> = ALL_KINDS.iter().map(|&kind| kind as u16).collect();
    (
        prop_oneof![Just(MAGIC), any::<[u8; 4]>()],
        prop_oneof![Just(PROTOCOL_VERSION), Just(PROTOCOL_VERSION - 1), Just(PROTOCOL_VERSION + 1), any::<u16>()],
        prop_oneof![select(kinds), any::<u16>()],
        any::<u32>(),
        prop_oneof![0..=BODY_BYTES_MAX, BODY_BYTES_MAX - 2..=BODY_BYTES_MAX + 2, any::<u32>()],
    )
        .prop_map(|(magic, version, kind, request_id, body_bytes)| {
            let mut header = [0u8; HEADER_BYTES];
            header[0..4].copy_from_slice(&magic);
            header[4..6].copy_from_slice(&version.to_le_bytes());
            header[6..8].copy_from_slice(&kind.to_le_bytes());
            header[8..12].copy_from_slice(&request_id.to_le_bytes());
            header[12..16].copy_from_slice(&body_bytes.to_le_bytes());
            header
        })
}

#[test]
fn all_kinds_lists_every_kind() {
    let known = (0..=u16::MAX).filter(|&raw| Kind::from_u16(raw).is_some()).count();
    assert_eq!(known, ALL_KINDS.len());
    for kind in ALL_KINDS {
        assert_eq!(Kind::from_u16(kind as u16), Some(kind));
    }
}

proptest! {
    #![proptest_config(config(1024))]

    /// Goal: a header is accepted exactly when its magic, version, kind and body length are the
    /// documented ones, refused for the first that is not (in that order), and an accepted one
    /// encodes back to the same 16 bytes.
    #[test]
    fn frame_header_accepts_only_the_documented_fields(header in prop_oneof![header_bytes(), any::<[u8; HEADER_BYTES]>()]) {
        let magic: [u8; 4] = header[0..4].try_into().unwrap();
        let version = u16::from_le_bytes([header[4], header[5]]);
        let raw_kind = u16::from_le_bytes([header[6], header[7]]);
        let body_bytes = u32::from_le_bytes(header[12..16].try_into().unwrap());
        let expected = if magic != MAGIC {
            Err(ProtocolError::BadMagic { found: magic })
        } else if version != PROTOCOL_VERSION {
            Err(ProtocolError::UnsupportedVersion { found: version })
        } else if Kind::from_u16(raw_kind).is_none() {
            Err(ProtocolError::UnknownKind { kind: raw_kind })
        } else if body_bytes > BODY_BYTES_MAX {
            Err(ProtocolError::FrameTooLarge { body_bytes })
        } else {
            Ok(FrameHeader {
                kind: Kind::from_u16(raw_kind).unwrap(),
                request_id: u32::from_le_bytes(header[8..12].try_into().unwrap()),
                body_bytes,
            })
        };
        let decoded = FrameHeader::decode(&header);
        prop_assert_eq!(&decoded, &expected);
        if let Ok(decoded) = decoded {
            prop_assert_eq!(decoded.encode(), header);
        }
    }

    /// Goal: arbitrary bodies of every kind, decoded as a request and as a reply, are a value
    /// that re-encodes to the same bytes or a typed body error; never a panic.
    #[test]
    fn arbitrary_bodies_decode_to_a_canonical_value_or_a_typed_error(
        kind in select(ALL_KINDS.to_vec()),
        body in vec(any::<u8>(), 0..=4096),
    ) {
        check_body(kind, &body)?;
    }
}

proptest! {
    #![proptest_config(config(512))]

    /// Goal: every generated request and reply fits a frame, round-trips exactly through
    /// `encode_frame` and the header and body decoders, and every strict prefix or extension of
    /// its body is refused (each decoder reads exactly its body).
    #[test]
    fn generated_messages_round_trip_and_only_their_exact_body_decodes(
        message in message(),
        request_id in any::<u32>(),
        cut in any::<Index>(),
        extra in vec(any::<u8>(), 1..16),
    ) {
        let mut frame = Vec::new();
        let body = message.body();
        encode_frame(&mut frame, message.kind(), request_id, |out| out.extend_from_slice(&body)).unwrap();
        let header = FrameHeader::decode(frame[..HEADER_BYTES].try_into().unwrap()).unwrap();
        prop_assert_eq!(header, FrameHeader { kind: message.kind(), request_id, body_bytes: body.len() as u32 });
        prop_assert_eq!(Message::decode(header.kind, &frame[HEADER_BYTES..]), Ok(message.clone()));
        prop_assert_eq!(check_body(message.kind(), &body)?, Some(message.clone()));
        if !body.is_empty() {
            let short = &body[..cut.index(body.len())];
            let is_malformed = matches!(Message::decode(message.kind(), short), Err(ProtocolError::MalformedBody { .. }));
            prop_assert!(is_malformed, "{} of {} bytes decoded", short.len(), body.len());
        }
        let mut long = body.clone();
        long.extend_from_slice(&extra);
        let is_malformed = matches!(Message::decode(message.kind(), &long), Err(ProtocolError::MalformedBody { .. }));
        prop_assert!(is_malformed, "{} extra bytes decoded", extra.len());
    }

    /// Goal: a valid encoding with any one byte changed (every position, up to 300 of them)
    /// decodes to a value that re-encodes to those bytes, or a typed error.
    #[test]
    fn every_single_byte_change_decodes_to_a_canonical_value_or_a_typed_error(
        message in message(),
        xor in 1u8..=255,
        start in any::<Index>(),
    ) {
        let body = message.body();
        let positions = body.len().min(300);
        let first = if body.len() > positions { start.index(body.len() - positions + 1) } else { 0 };
        for at in first..first + positions {
            let mut changed = body.clone();
            changed[at] ^= xor;
            check_body(message.kind(), &changed)?;
        }
    }

    /// Goal: valid encodings with bytes flipped, cut, inserted, appended or counts overwritten
    /// with values near their caps decode to a value (which re-encodes to those bytes) or a typed
    /// error, never a panic.
    #[test]
    fn mutated_encodings_decode_to_a_canonical_value_or_a_typed_error(
        message in message(),
        mutations in vec(mutation(), 1..4),
    ) {
        let mut body = message.body();
        for mutation in &mutations {
            mutate(&mut body, mutation);
        }
        check_body(message.kind(), &body)?;
    }
}

proptest! {
    #![proptest_config(config(24))]

    /// Goal: bodies at and just under the 1 MiB cap decode to a value or a typed error; a
    /// lookup whose body is exactly at the cap round-trips and one a token over is refused by
    /// `encode_frame` rather than sent.
    #[test]
    fn bodies_near_the_cap(
        kind in select(ALL_KINDS.to_vec()),
        short_by in 0usize..=8,
        seed in any::<u64>(),
        first in vec(any::<u8>(), 0..16),
    ) {
        let mut body = vec![0u8; BODY_BYTES_MAX as usize - short_by];
        let mut state = seed | 1;
        for byte in body.iter_mut() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *byte = state as u8;
        }
        body[..first.len()].copy_from_slice(&first);
        check_body(kind, &body)?;

        let tokens_max = (BODY_BYTES_MAX as usize - 8) / 4;
        let tokens: Vec<u32> = (0..(tokens_max - short_by % 2) as u32).map(|token| token ^ seed as u32).collect();
        let request = Request::Lookup { tokens, first_block: seed as u32 };
        let mut frame = Vec::new();
        encode_frame(&mut frame, Kind::Lookup, 1, |out| request.encode_body(out)).unwrap();
        prop_assert_eq!(Request::decode(Kind::Lookup, &frame[HEADER_BYTES..]), Ok(request));
        let over = Request::Lookup { tokens: vec![7; tokens_max + 1], first_block: 0 };
        let refused = encode_frame(&mut frame, Kind::Lookup, 1, |out| over.encode_body(out));
        prop_assert_eq!(refused, Err(ProtocolError::FrameTooLarge { body_bytes: BODY_BYTES_MAX + 4 }));
    }
}

proptest! {
    #![proptest_config(config(128))]

    /// Goal: the server's frame reader, given arbitrary bytes on a socket, returns a frame whose
    /// header is what `FrameHeader::decode` accepts and whose body is the bytes after it, or an
    /// error; a header it refuses (e.g. a body over the cap) is refused before anything is
    /// allocated for the body.
    #[test]
    fn frame_reader_checks_the_header_before_the_body(
        header in header_bytes(),
        tail in vec(any::<u8>(), 0..=4096),
    ) {
        let (near, mut far) = UnixStream::pair().unwrap();
        near.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut bytes = header.to_vec();
        bytes.extend_from_slice(&tail);
        // Sent whole before reading: the socket buffer holds it (a 4 KiB tail).
        far.write_all(&bytes).unwrap();
        drop(far);
        let mut body = Vec::new();
        let mut fds = Vec::new();
        let never = || false;
        let result = crate::frame_io::read_frame(&near, &mut body, &mut fds, Instant::now() + Duration::from_secs(5), Duration::from_secs(5), &never);
        match (FrameHeader::decode(&header), result) {
            (Err(expected), Err(crate::DaemonError::Protocol(error))) => {
                prop_assert_eq!(error, expected);
                prop_assert_eq!(body.capacity(), 0, "a refused header's body was allocated");
            }
            (Ok(expected), Ok(crate::frame_io::ReadOutcome::Frame(header))) => {
                prop_assert_eq!(header, expected);
                prop_assert_eq!(&body[..], &tail[..header.body_bytes as usize]);
            }
            (Ok(expected), Err(crate::DaemonError::Truncated { received, expected: wanted })) => {
                prop_assert!(tail.len() < expected.body_bytes as usize);
                prop_assert_eq!((received, wanted), (HEADER_BYTES + tail.len(), HEADER_BYTES + expected.body_bytes as usize));
            }
            (expected, result) => prop_assert!(false, "header {:?}: {:?}", expected, result),
        }
    }
}
