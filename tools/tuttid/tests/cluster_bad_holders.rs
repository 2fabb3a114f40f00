//! A tuttid node's remote reads from holders that misbehave, against a real etcd (`LocalEtcd`,
//! loopback): a fake holder (a loopback listener this test registers in etcd as the only node
//! holding a prompt's segments) answers garbage, stalls mid-block, sends a block with a wrong
//! CRC or closes mid-stream — each a typed `RemoteReadFailed` naming it, nothing stored, the
//! node serving on — or serves slowly: a fetch longer than the client's lease keeps the
//! client's session, and fetches past the node's limit of 4 at once are refused at once. A fake
//! listed past a real node's run: its bad CRC in the fetch's later run is counted though the
//! fetch answers the run read, and its NotHeld in one run does not keep it from the next.
//! Every wait is bounded. Skipped (with a note) where no etcd is installed, unless
//! TUTTI_REQUIRE_ETCD=1 (the cluster stage of tools/test.sh). The nodes and the registry reader
//! are `common::cluster`'s (16-block segments, 48-slot pools, a 2 s lease unless a test sets one).

use std::time::{Duration, Instant};

use tutti_cluster::local_etcd::LocalEtcd;
use tutti_cluster::{segments_of, ClusterConfig, ClusterId, ClusterNode, KeySecretTag, MemberRecord, NodeId, Segment, SegmentBlocks};
use tutti_daemon::protocol::ClusterStatusReply;
use tutti_daemon::{DaemonError, ErrorCode};

mod common;
use common::cluster::{
    holders_once_available, members, model, reader, segments, space, store, wait_for, Node, BLOCK_TOKENS, CLUSTER, LEASE, PROMPT_BLOCKS,
    REQUEST_TIMEOUT, SEGMENT_BLOCKS, SOON,
};
use common::hello;

/// How a fake holder misbehaves.
#[derive(Debug, Clone, Copy)]
enum Misbehaviour {
    /// Answers with bytes that are no frame.
    Garbage,
    /// Sends the segment header and half a block, then nothing.
    Stall,
    /// Sends a segment one of whose blocks' CRC does not match its bytes.
    WrongChecksum,
    /// Sends one good block, then closes the connection (a holder that died mid-stream).
    Dies,
    /// Sends a sound segment slowly (each block inside the stall bound, the whole longer than
    /// the asking client's lease), then closes.
    Slow,
    /// Refuses the read `NotHeld` (a segment evicted since it was registered).
    NotHeld,
    /// Refuses the read `ReadFailed` (its disks failed, or a block was found damaged).
    ReadFailed,
    /// Sends a sound segment at once.
    Sound,
}

#[test]
fn the_fake_holders_frames_pass_the_data_planes_header_check() {
    // Goal: the fakes below misbehave in their bodies only: their headers are ones this build
    // takes (a stale version made every case a version refusal, which the fault counts could
    // not tell from the misbehaviour each test is about).
    use tutti_daemon::cluster::peer::{answer_body_max, decode_header, HEADER_BYTES};
    for kind in [0x8001u16, 0x8002] {
        let bytes = frame(kind, &[0; 8]);
        let header: &[u8; HEADER_BYTES] = bytes[..HEADER_BYTES].try_into().unwrap();
        let decoded = decode_header(header, |kind| answer_body_max(kind, BLOCK_BYTES as u64));
        assert!(decoded.is_ok(), "kind {kind:#x}: {:?}", decoded.err());
    }
}

/// Bytes of one block of the test geometry (2 layers × K and V × 2 heads × 64 × 16 × 2 bytes).
const BLOCK_BYTES: usize = 2 * 2 * 2 * 64 * 16 * 2;

fn frame(kind: u16, body: &[u8]) -> Vec<u8> {
    let mut out = b"TPDP".to_vec();
    // The data plane's version, this build's: a fake holder that spoke another would be refused
    // at its first header, and every misbehaviour below would read as that refusal.
    out.extend_from_slice(&tutti_daemon::cluster::peer::VERSION.to_le_bytes());
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

fn block_frame(index: u16, bytes: &[u8], crc: u32) -> Vec<u8> {
    let mut body = index.to_le_bytes().to_vec();
    body.extend_from_slice(&crc.to_le_bytes());
    body.extend_from_slice(bytes);
    frame(0x8002, &body)
}

/// Joins `etcd` as node `name` at `address` (a fake holder's) and registers prompt `seed`'s
/// segments there: the registry then sends fetches of that prompt to the fake.
fn register_fake_holder(etcd: &LocalEtcd, name: &str, address: std::net::SocketAddr, seed: u32) -> ClusterNode {
    register_fake_holder_of(etcd, name, address, &segments(seed))
}

/// [`register_fake_holder`] of the segments given.
fn register_fake_holder_of(etcd: &LocalEtcd, name: &str, address: std::net::SocketAddr, segments: &[Segment]) -> ClusterNode {
    register_fake_holder_tagged(etcd, name, address, segments, common::cluster::key_secret_tag())
}

/// [`register_fake_holder_of`], its member record naming the key secret tag given.
fn register_fake_holder_tagged(
    etcd: &LocalEtcd,
    name: &str,
    address: std::net::SocketAddr,
    segments: &[Segment],
    key_secret_tag: KeySecretTag,
) -> ClusterNode {
    let mut config = ClusterConfig::new(etcd.endpoints(), ClusterId::new(CLUSTER).unwrap(), SegmentBlocks::new(SEGMENT_BLOCKS).unwrap());
    config.lease_ttl = LEASE;
    config.request_timeout = REQUEST_TIMEOUT;
    let record = MemberRecord {
        node: NodeId::new(name).unwrap(),
        key_secret_tag,
        address: address.to_string(),
        capacity_bytes: 1 << 30,
        fingerprints: vec![],
    };
    let node = ClusterNode::join(config, record).unwrap();
    node.register(&model(), segments).unwrap();
    node
}

/// The segments of prompt 72 extended to 48 blocks (three; a node's `store` of prompt 72 holds
/// the first two).
fn extended_segments() -> Vec<Segment> {
    let extended = common::prompt(72, 48, BLOCK_TOKENS);
    let mut keys = Vec::new();
    space().keys(&extended, BLOCK_TOKENS, &mut keys);
    let mut all = Vec::new();
    segments_of(&keys, SegmentBlocks::new(SEGMENT_BLOCKS).unwrap(), &mut all).unwrap();
    assert_eq!(all.len(), 3);
    all
}

/// Node b, the asker of these tests, started (with `extra` daemon options) in a fresh pool and
/// joined.
fn joined_b(etcd: &LocalEtcd, root: &std::path::Path, extra: Vec<&'static str>) -> Node {
    let reader = reader(etcd);
    let mut b = Node::new(root, "b");
    b.extra = extra;
    b.start(etcd, true);
    wait_for("b joins", SOON, || members(&reader) == ["b"]);
    b
}

/// A holder that takes one connection, reads one request and misbehaves as told.
fn fake_holder(misbehaviour: Misbehaviour) -> (std::net::SocketAddr, std::thread::JoinHandle<()>) {
    fake_holder_answering(vec![misbehaviour])
}

/// A holder that takes a connection per answer, in turn, reads one request on each and
/// answers it as told.
fn fake_holder_answering(answers: Vec<Misbehaviour>) -> (std::net::SocketAddr, std::thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    let thread = std::thread::spawn(move || {
        // One connection is all a fetch makes of one holder; bounded, should none come.
        listener.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        for misbehaviour in answers {
            let mut stream = loop {
                match listener.accept() {
                    Ok((stream, _)) => break stream,
                    Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                    Err(_) => return,
                }
            };
            stream.set_nonblocking(false).unwrap();
            stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut header = [0u8; 12];
            if stream.read_exact(&mut header).is_err() {
                return;
            }
            let mut body = vec![0u8; u32::from_le_bytes(header[8..12].try_into().unwrap()) as usize];
            let _ = stream.read_exact(&mut body);
            let mut segment_header = 16u16.to_le_bytes().to_vec();
            segment_header.extend_from_slice(&(BLOCK_BYTES as u64).to_le_bytes());
            // Served once: never a heavy hitter.
            segment_header.extend_from_slice(&1u32.to_le_bytes());
            // The nodes' geometry: layers, KV heads, head dim, bytes per element, tokens per block.
            for field in [2u32, 2, 64, 2, BLOCK_TOKENS] {
                segment_header.extend_from_slice(&field.to_le_bytes());
            }
            let bytes = vec![0x5au8; BLOCK_BYTES];
            let _ = match misbehaviour {
                Misbehaviour::Garbage => stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"),
                Misbehaviour::Stall => {
                    let _ = stream.write_all(&frame(0x8001, &segment_header));
                    let half = block_frame(0, &bytes, crc32fast::hash(&bytes));
                    let _ = stream.write_all(&half[..half.len() / 2]);
                    std::thread::sleep(Duration::from_secs(8));
                    Ok(())
                }
                Misbehaviour::WrongChecksum => {
                    // A whole segment, sound but for block 7's CRC: taken without the check, it
                    // would be stored.
                    let _ = stream.write_all(&frame(0x8001, &segment_header));
                    for index in 0..16u16 {
                        let crc = crc32fast::hash(&bytes) ^ u32::from(index == 7);
                        let _ = stream.write_all(&block_frame(index, &bytes, crc));
                    }
                    Ok(())
                }
                Misbehaviour::Dies => {
                    let _ = stream.write_all(&frame(0x8001, &segment_header));
                    stream.write_all(&block_frame(0, &bytes, crc32fast::hash(&bytes)))
                }
                Misbehaviour::Slow => {
                    let _ = stream.write_all(&frame(0x8001, &segment_header));
                    for index in 0..16u16 {
                        std::thread::sleep(Duration::from_millis(250));
                        let _ = stream.write_all(&block_frame(index, &bytes, crc32fast::hash(&bytes)));
                    }
                    Ok(())
                }
                Misbehaviour::NotHeld | Misbehaviour::ReadFailed => {
                    let (code, message): (u16, &[u8]) =
                        if matches!(misbehaviour, Misbehaviour::NotHeld) { (2, b"not held") } else { (3, b"read failed") };
                    let mut body = code.to_le_bytes().to_vec();
                    body.extend_from_slice(&(message.len() as u16).to_le_bytes());
                    body.extend_from_slice(message);
                    stream.write_all(&frame(0x80FF, &body))
                }
                Misbehaviour::Sound => {
                    let _ = stream.write_all(&frame(0x8001, &segment_header));
                    for index in 0..16u16 {
                        let _ = stream.write_all(&block_frame(index, &bytes, crc32fast::hash(&bytes)));
                    }
                    Ok(())
                }
            };
        }
    });
    (address, thread)
}

#[test]
fn a_holder_that_sends_garbage_stalls_lies_or_dies_is_a_typed_error_and_nothing_is_stored() {
    // Goal: a fake node, registered as the only holder of prompt 10's segments, misbehaves in
    // each way in turn; node b's fetch answers RemoteReadFailed (within the 2 s stall bound
    // plus slack for the stall), b stores nothing of prompt 10, and b serves on.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let b = joined_b(&etcd, root.path(), Vec::new());
    let mut on_b = b.daemon().client();
    on_b.hello(&hello(0, 1, "fetch-b")).unwrap();
    let tokens = common::prompt(10, PROMPT_BLOCKS, BLOCK_TOKENS);
    for misbehaviour in [Misbehaviour::Garbage, Misbehaviour::Stall, Misbehaviour::WrongChecksum, Misbehaviour::Dies] {
        let (address, thread) = fake_holder(misbehaviour);
        let evil = register_fake_holder(&etcd, "evil", address, 10);
        let started = Instant::now();
        let failure = on_b.fetch_remote(&tokens).expect_err("a fetch from a misbehaving holder");
        let took = started.elapsed();
        match &failure {
            DaemonError::Remote { code: ErrorCode::RemoteReadFailed, message } => {
                eprintln!("{misbehaviour:?}: {message} ({took:?})");
                assert!(message.contains("evil"), "{message}");
            }
            other => panic!("{misbehaviour:?}: {other:?}"),
        }
        assert!(took < Duration::from_secs(5), "{misbehaviour:?} took {took:?}");
        assert_eq!(on_b.lookup(&tokens).unwrap(), 0, "{misbehaviour:?}: b stored something");
        drop(evil);
        thread.join().unwrap();
    }
    let status = b.status();
    assert_eq!((status.remote_reads, status.remote_read_failures, status.fetched_blocks), (4, 4, 0), "{status:?}");
    store(&b, 11);
    assert_eq!(on_b.lookup(&common::prompt(11, PROMPT_BLOCKS, BLOCK_TOKENS)).unwrap(), PROMPT_BLOCKS as u32, "b serves on");
}

#[test]
fn a_holder_whose_pool_has_another_key_secret_is_not_read_from() {
    // Goal: holders register block keys keyed with their own pool's secret, so one whose
    // member record names another secret than the asker's holds the asker's key only by a
    // 64-bit accident (or a writer that lies), and its blocks are another prefix's. The asker
    // passes it over before connecting: the fetch fails naming the other secret, nothing is
    // stored, and the holder's address is never dialled.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let b = joined_b(&etcd, root.path(), Vec::new());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let other = KeySecretTag::new([0x7e; 4]);
    let _alien = register_fake_holder_tagged(&etcd, "alien", listener.local_addr().unwrap(), &segments(10), other);
    let mut on_b = b.daemon().client();
    on_b.hello(&hello(0, 1, "fetch-b")).unwrap();
    let tokens = common::prompt(10, PROMPT_BLOCKS, BLOCK_TOKENS);
    let lookup = on_b.lookup_cluster(&tokens).unwrap();
    assert_eq!(lookup.remote_blocks, 32, "the registry lists the alien holder: {lookup:?}");
    let failure = on_b.fetch_remote(&tokens).expect_err("a fetch from a holder of another secret");
    match &failure {
        DaemonError::Remote { code: ErrorCode::RemoteReadFailed, message } => {
            assert!(message.contains("alien") && message.contains(&format!("another key secret (tag {other}")), "{message}");
        }
        other => panic!("{other:?}"),
    }
    match listener.accept() {
        Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
        other => panic!("the holder of another secret was dialled: {other:?}"),
    }
    assert_eq!(on_b.lookup(&tokens).unwrap(), 0, "b stored something");
    let status = b.status();
    assert_eq!(status.fetched_blocks, 0, "{status:?}");
}

#[test]
fn a_fetch_longer_than_the_clients_lease_keeps_its_session() {
    // Goal: the client lease counts from the daemon's answer, not from the request: a slow
    // holder (every block inside the stall bound, the segment longer than b's 1 s client lease)
    // makes a long FetchRemote, and the same client's next request is still served.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let b = joined_b(&etcd, root.path(), vec!["--lease", "1s"]);
    let mut on_b = b.daemon().client();
    on_b.hello(&hello(0, 1, "fetch-slow")).unwrap();
    let tokens = common::prompt(12, PROMPT_BLOCKS, BLOCK_TOKENS);
    let (address, thread) = fake_holder(Misbehaviour::Slow);
    let slow = register_fake_holder(&etcd, "slow", address, 12);
    let started = Instant::now();
    // The fake serves one segment and closes: the first is stored, the second read fails.
    let failure = on_b.fetch_remote(&tokens).expect_err("the fake holder serves one segment only");
    assert!(started.elapsed() > Duration::from_millis(1500), "the fetch outlasted the lease: {:?}", started.elapsed());
    assert!(matches!(failure, DaemonError::Remote { code: ErrorCode::RemoteReadFailed, .. }), "{failure:?}");
    // The session lives on: the same client, silent for less than its lease since the answer,
    // is answered and sees the segment stored.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(on_b.lookup(&tokens).unwrap(), u32::from(SEGMENT_BLOCKS), "b stored the slow segment and still serves this client");
    drop(slow);
    thread.join().unwrap();
}

#[test]
fn fetches_past_the_nodes_limit_are_refused_at_once() {
    // Goal: each fetch buffers up to a segment in memory, so a node runs at most 4 at once: with
    // 4 in progress (a slow holder), a fifth is refused at once, naming the limit, and a fetch
    // after they end is served again.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let b = joined_b(&etcd, root.path(), Vec::new());
    let tokens = common::prompt(13, PROMPT_BLOCKS, BLOCK_TOKENS);
    let (address, thread) = fake_holder(Misbehaviour::Slow);
    let slow = register_fake_holder(&etcd, "slow", address, 13);
    // The slow holder serves the first connection; the others wait unanswered (stall, 2 s).
    let fetchers: Vec<_> = (0..4)
        .map(|index| {
            let mut client = b.daemon().client();
            client.hello(&hello(0, 1, &format!("fetch-{index}"))).unwrap();
            let tokens = tokens.clone();
            std::thread::spawn(move || client.fetch_remote(&tokens))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let mut fifth = b.daemon().client();
    fifth.hello(&hello(0, 1, "fetch-5")).unwrap();
    let started = Instant::now();
    match fifth.fetch_remote(&tokens) {
        Err(DaemonError::Remote { code: ErrorCode::RemoteReadFailed, message }) => {
            assert!(message.contains("4 remote fetches are in progress"), "{message}")
        }
        other => panic!("a fifth fetch at once: {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_millis(500), "refused at once, not after {:?}", started.elapsed());
    for fetcher in fetchers {
        let _ = fetcher.join().unwrap();
    }
    thread.join().unwrap();
    drop(slow);
    // The limit is a count, not a latch: with none in progress, a fetch runs (and finds nothing
    // to fetch, the slow node's lease being gone or its segment stored already).
    let again = fifth.fetch_remote(&tokens);
    assert!(!matches!(&again, Err(DaemonError::Remote { message, .. }) if message.contains("in progress")), "{again:?}");
}

/// What node c sees fetching prompt 72 extended to 48 blocks, node a holding (registered)
/// prompt 72's two segments and a fake holder answering `answers` in turn registered for
/// `fake_segments` of the extended prompt: the fetch's answer, c's lookup of the extended
/// prompt after it and c's cluster status.
fn c_fetches_72_extended(etcd: &LocalEtcd, answers: Vec<Misbehaviour>, fake_segments: &[Segment]) -> ((u32, u32), u32, ClusterStatusReply) {
    let root = tempfile::tempdir().unwrap();
    let reader = reader(etcd);
    let mut nodes: Vec<Node> = ["a", "c"].into_iter().map(|name| Node::new(root.path(), name)).collect();
    for node in &mut nodes {
        node.start(etcd, true);
    }
    wait_for("two nodes join", SOON, || members(&reader) == ["a", "c"]);
    let [a, c] = &nodes[..] else { unreachable!("two nodes") };
    store(a, 72);
    wait_for("a's segments registered", SOON, || holders_once_available(&reader, 72).is_some_and(|holders| holders == [["a"], ["a"]]));
    let extended = common::prompt(72, 48, BLOCK_TOKENS);
    let (address, thread) = fake_holder_answering(answers);
    let evil = register_fake_holder_of(etcd, "evil", address, fake_segments);
    let mut on_c = c.daemon().client();
    on_c.hello(&hello(0, 1, "fetch-c")).unwrap();
    let fetched = on_c.fetch_remote(&extended).unwrap();
    let looked_up = on_c.lookup(&extended).unwrap();
    let status = c.status();
    drop(evil);
    thread.join().unwrap();
    (fetched, looked_up, status)
}

#[test]
fn a_later_runs_holder_that_sends_a_bad_crc_is_counted_though_the_fetch_answers_what_it_read() {
    // Goal: node a holds prompt 72's segments 0 and 1; a fake holder, registered for segment 2
    // of the prompt extended to 48 blocks only, sends it with a wrong CRC. c's fetch of the
    // extended prompt reads a's 32 blocks, then the fake's run fails its CRC check: the fetch
    // answers the 32 stored (what is held is answered correctly), but the fault is counted in
    // `remote_read_failures`. Before, a later run's failure of any kind was only logged.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let (fetched, looked_up, status) = c_fetches_72_extended(&etcd, vec![Misbehaviour::WrongChecksum], &extended_segments()[2..]);
    assert_eq!(fetched, (32, 32));
    assert_eq!(looked_up, 32);
    assert_eq!((status.remote_reads, status.remote_read_failures, status.fetched_blocks), (1, 1, 32), "{status:?}");
}

#[test]
fn a_later_runs_only_holder_refusing_read_failed_is_counted_though_the_fetch_answers_what_it_read() {
    // Goal: as a bad CRC, the only holder of the extended prompt's segment 2 refusing ReadFailed
    // (its disks, a damaged block) is a fault: the fetch answers a's 32 blocks and counts it in
    // `remote_read_failures`. Before, the refusal was passed over (another holder may serve) and,
    // none left, the fetch ended with what it read and counted nothing.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let (fetched, looked_up, status) = c_fetches_72_extended(&etcd, vec![Misbehaviour::ReadFailed], &extended_segments()[2..]);
    assert_eq!(fetched, (32, 32));
    assert_eq!(looked_up, 32);
    assert_eq!((status.remote_reads, status.remote_read_failures, status.fetched_blocks), (1, 1, 32), "{status:?}");
}

#[test]
fn a_holder_that_answered_not_held_in_one_run_is_asked_in_the_next() {
    // Goal: a fake holder is registered for all three segments of prompt 72 extended to 48
    // blocks, but holds (answers) only the last: it refuses segments 0-1 NotHeld, and node a
    // serves them. The fetch's next run, from block 32, lists the fake alone, and its NotHeld
    // was about the earlier run's segments: it is asked and serves segment 2 (48 blocks
    // fetched). Before, a holder passed over in one run was skipped in every later one and the
    // fetch ended with a's 32.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let (fetched, looked_up, status) = c_fetches_72_extended(&etcd, vec![Misbehaviour::NotHeld, Misbehaviour::Sound], &extended_segments());
    assert_eq!(fetched, (48, 48));
    assert_eq!(looked_up, 48);
    assert_eq!((status.remote_reads, status.remote_read_failures, status.fetched_blocks), (1, 0, 48), "{status:?}");
}
