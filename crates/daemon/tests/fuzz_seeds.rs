//! The committed seeds of the `data_plane_frames` and `tuttid_protocol` fuzz targets
//! (fuzz/seeds/), built here from the crate's own encoders. A seed written by hand, or by an
//! older build, goes stale when a wire format changes (the data plane's version 3 added the
//! pool geometry, tuttid's protocol is at version 9): every mutation of it then starts from a
//! frame the header check refuses, and the fuzzer starts blind. So each committed seed must
//! equal what is built here and get past the target's first check.
//!
//! After a format change: `cargo test -p tutti-daemon --test fuzz_seeds -- --ignored write_fuzz_seeds`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use objstore::{MismatchedBlock, ModelGeometry, Placement, Transferred};
use tutti_cluster::ModelSpace;
use tutti_daemon::cluster::peer::{
    answer_body_max, decode_block, decode_failure, decode_segment_header, encode_block_prefix, encode_failure, encode_segment_header,
    read_frame, request_body_max, FailureCode, PeerError, PeerKind, ReadSegment, SegmentHeader,
};
use tutti_daemon::protocol::{
    encode_frame, ClusterLookupReply, Commit, ErrorCode, FrameHeader, Hello, HelloReply, Kind, PoolShape, RegistryAnswer, RemoteHolder,
    Reply, Request, RetrievePrepared, HEADER_BYTES,
};

fn seed_directory(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds").join(target)
}

/// Checks each committed seed of `target` against `seeds` (named as the files), then `reaches`.
fn check_committed(target: &str, seeds: Vec<(&'static str, Vec<u8>)>, reaches: impl Fn(&str, &[u8])) {
    assert_only_built_files(&seed_directory(target), seeds.iter().map(|(name, _)| *name));
    for (name, data) in seeds {
        let committed = std::fs::read(seed_directory(target).join(name)).unwrap_or_default();
        assert!(
            committed == data,
            "seed {target}/{name} is stale ({} bytes committed, {} built): run `cargo test -p tutti-daemon --test fuzz_seeds -- --ignored write_fuzz_seeds`",
            committed.len(),
            data.len()
        );
        reaches(name, &committed);
    }
}

fn write_seeds(target: &str, seeds: Vec<(&'static str, Vec<u8>)>) {
    std::fs::create_dir_all(seed_directory(target)).expect("seed directory");
    for (name, data) in seeds {
        std::fs::write(seed_directory(target).join(name), data).expect("write seed");
    }
}

// --- data_plane_frames -------------------------------------------------------------------------

/// A pool whose blocks are 64 bytes (1 layer x 2 x 1 KV head x dim 2 x 2 bytes x 8 tokens): small
/// enough for whole Block frames in a seed, and the block size the answers' prefix names.
const GEOMETRY: ModelGeometry = ModelGeometry { layers: 1, kv_heads: 1, head_dim: 2, dtype_bytes: 2, block_tokens: 8 };
const BLOCK_BYTES: u16 = 64;

/// The target's prefix: byte 0 bit 0 = read as the asker; bytes 1..3 = the asker's block bytes.
fn data_plane_prefix(asker: bool, block_bytes: u16) -> Vec<u8> {
    let mut input = vec![u8::from(asker)];
    input.extend_from_slice(&block_bytes.to_le_bytes());
    input
}

fn data_plane_seeds() -> Vec<(&'static str, Vec<u8>)> {
    assert_eq!(GEOMETRY.block_bytes(), u64::from(BLOCK_BYTES));
    let mut frame = Vec::new();
    let space = ModelSpace::new([9; 32], 1, 2).expect("a model space");
    let request = ReadSegment { space, index: 3, geometry: GEOMETRY, keys: vec![1, 2, 3, 4] };
    request.encode(&mut frame);
    let mut read_segment = data_plane_prefix(false, 0);
    read_segment.extend_from_slice(&frame);

    let header = |served| SegmentHeader { blocks: 2, block_bytes: u64::from(BLOCK_BYTES), served, geometry: GEOMETRY };
    let mut segment_answer = data_plane_prefix(true, BLOCK_BYTES);
    encode_segment_header(&mut frame, header(3));
    segment_answer.extend_from_slice(&frame);
    for (index, fill) in [(0u16, 0u8), (1, 1)] {
        let bytes = [fill; BLOCK_BYTES as usize];
        encode_block_prefix(&mut frame, index, crc32fast::hash(&bytes), bytes.len());
        segment_answer.extend_from_slice(&frame);
        segment_answer.extend_from_slice(&bytes);
    }

    let mut failure = data_plane_prefix(true, BLOCK_BYTES);
    encode_segment_header(&mut frame, header(1));
    failure.extend_from_slice(&frame);
    encode_failure(&mut frame, FailureCode::NotHeld, "block 3 is gone");
    failure.extend_from_slice(&frame);

    vec![("read_segment", read_segment), ("segment_answer", segment_answer), ("failure", failure)]
}

/// Reads `input` as the target does (every frame by `read_frame` over the bytes after the prefix,
/// as the holder or the asker) and returns each frame's kind, failing on the first frame the
/// header check refuses or whose body does not decode as its kind.
fn data_plane_frames_read(input: &[u8]) -> Result<Vec<PeerKind>, String> {
    let (prefix, mut stream) = input.split_at_checked(3).ok_or("shorter than the target's 3-byte prefix")?;
    let asker = prefix[0] & 1 == 1;
    let block_bytes = usize::from(u16::from_le_bytes([prefix[1], prefix[2]]));
    let body_max = |kind| if asker { answer_body_max(kind, block_bytes as u64) } else { request_body_max(kind) };
    let (mut body, mut kinds) = (Vec::new(), Vec::new());
    let second = Duration::from_secs(1);
    while !stream.is_empty() {
        let kind = read_frame(&mut stream, &mut body, body_max, second, second, Instant::now() + second, &|| false, "reading a seed")
            .map_err(|error| format!("frame {}: {error}", kinds.len()))?;
        let decoded = match kind {
            PeerKind::ReadSegment => ReadSegment::decode(&body).map(drop),
            PeerKind::SegmentHeader => decode_segment_header(&body).map(drop).map_err(|error| error.to_string()),
            PeerKind::Block => decode_block(&body, block_bytes).map(drop).map_err(|error| error.to_string()),
            PeerKind::Failure => match decode_failure(&body) {
                PeerError::Refused { .. } => Ok(()),
                other => Err(other.to_string()),
            },
        };
        decoded.map_err(|error| format!("frame {} ({kind:?}): {error}", kinds.len()))?;
        kinds.push(kind);
    }
    Ok(kinds)
}

#[test]
#[ignore = "writes fuzz/seeds/{data_plane_frames,tuttid_protocol}; run by hand after changing the seeds"]
fn write_fuzz_seeds() {
    write_seeds("data_plane_frames", data_plane_seeds());
    write_seeds("tuttid_protocol", tuttid_protocol_seeds());
}

#[test]
fn committed_data_plane_seeds_are_current_and_read_as_frames() {
    // Goal: each committed seed is this build's frames, every one read past the header check
    // (magic, version, kind, cap) and decoded as its kind (else the fuzzer starts blind).
    use PeerKind::{Block, Failure, ReadSegment as Read, SegmentHeader as Header};
    check_committed("data_plane_frames", data_plane_seeds(), |name, seed| {
        let expected: &[PeerKind] = match name {
            "read_segment" => &[Read],
            "segment_answer" => &[Header, Block, Block],
            "failure" => &[Header, Failure],
            other => panic!("no expectation for seed {other}"),
        };
        assert_eq!(data_plane_frames_read(seed).as_deref(), Ok(expected), "seed data_plane_frames/{name}");
    });
}

// --- tuttid_protocol ---------------------------------------------------------------------------

fn request_frame(request: &Request) -> Vec<u8> {
    let mut frame = Vec::new();
    encode_frame(&mut frame, request.kind(), 9, |out| request.encode_body(out)).expect("a seed frame within the cap");
    frame
}

fn reply_frame(reply: &Reply) -> Vec<u8> {
    let mut frame = Vec::new();
    encode_frame(&mut frame, reply.kind(), 9, |out| reply.encode_body(out)).expect("a seed frame within the cap");
    frame
}

/// The target's input is one frame: its 16-byte header, then the body.
fn tuttid_protocol_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let hello = Request::Hello(Hello { model_fingerprint: [3; 32], tp_rank: 1, tp_world: 4, client_name: "rank-1".into() });
    let lookup = Request::Lookup { tokens: vec![0, 1, 2, 3, 4], first_block: 0 };
    let commit = Request::Commit(Commit {
        handle: 7,
        payload_crcs: Some(vec![0xdead_beef, 1]),
        transferred: Transferred { bytes: 8192, commands: 2 },
    });
    let release = Request::Release {
        handle: 7,
        transferred: Transferred { bytes: 4096, commands: 1 },
        corrupt_blocks: vec![MismatchedBlock {
            position: 1,
            engine_block: 12,
            device: 0,
            slot: 3,
            expected_crc: 0x1234,
            computed_crc: 0x4321,
        }],
    };
    let location = objstore::BlockLocation { device: 0, slot: 3, index: 0 };
    let retrieve_prepared = Reply::RetrievePrepared(RetrievePrepared {
        handle: 5,
        placements: vec![Placement { location, engine_block: 11 }],
        expected_crcs: Some(vec![0x1234]),
    });
    let shape = PoolShape { layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_tokens: 16, blocks_per_slot: 4 };
    let hello_reply = Reply::Hello(HelloReply { session: 2, lease_ms: 30_000, shape });
    let cluster_lookup = Reply::ClusterLookup(ClusterLookupReply {
        cached_blocks: 3,
        block_tokens: 16,
        registry: RegistryAnswer::Answered,
        remote_blocks: 4,
        holders: vec![RemoteHolder { node: "node-b".into(), blocks: 4 }],
    });
    vec![
        ("hello", request_frame(&hello)),
        ("lookup", request_frame(&lookup)),
        ("ping", request_frame(&Request::Ping)),
        ("commit_with_crcs", request_frame(&commit)),
        ("release_with_corrupt_block", request_frame(&release)),
        ("hello_reply", reply_frame(&hello_reply)),
        ("retrieve_prepared", reply_frame(&retrieve_prepared)),
        ("cluster_lookup_reply", reply_frame(&cluster_lookup)),
        ("error_reply", reply_frame(&Reply::error(ErrorCode::BadRequest, "rank 2 is not below 2"))),
    ]
}

#[test]
fn committed_tuttid_protocol_seeds_are_current_and_decode() {
    // Goal: each committed seed's header is one this build accepts (magic, version, kind, cap)
    // and names its body's length, and the body decodes as that kind (a request kind as a
    // request, a reply kind as a reply) — as the target splits its input.
    check_committed("tuttid_protocol", tuttid_protocol_seeds(), |name, seed| {
        let (header, body) =
            seed.split_at_checked(HEADER_BYTES).unwrap_or_else(|| panic!("seed tuttid_protocol/{name} is shorter than a header"));
        let header: &[u8; HEADER_BYTES] = header.try_into().expect("HEADER_BYTES bytes");
        let decoded = FrameHeader::decode(header).unwrap_or_else(|error| panic!("seed tuttid_protocol/{name}: header refused: {error}"));
        assert_eq!(decoded.body_bytes as usize, body.len(), "seed tuttid_protocol/{name}");
        let kind: Kind = decoded.kind;
        let decodes = if kind.is_request() {
            Request::decode(kind, body).map(|request| request.kind())
        } else {
            Reply::decode(kind, body).map(|reply| reply.kind())
        };
        assert_eq!(decodes, Ok(kind), "seed tuttid_protocol/{name}: its body as {kind:?}");
    });
}

/// The fuzzer reads every file of the directory: one this file does not build (renamed, left
/// behind) would be fed to it unchecked.
fn assert_only_built_files<'a>(directory: &std::path::Path, built: impl Iterator<Item = &'a str>) {
    let mut committed: Vec<String> = std::fs::read_dir(directory)
        .expect("seed directory")
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut built: Vec<String> = built.map(str::to_string).collect();
    committed.sort();
    built.sort();
    assert_eq!(committed, built, "{} holds files this test does not build", directory.display());
}
