//! The data plane against hostile and unlucky peers, over loopback TCP with raw clients: a holder
//! (a `DataPlane` serving a one-device pool on a software controller) and, for the asker's side,
//! a second one fetching from it. Bounds are shortened per test (`PeerBounds`); every wait in a
//! test is bounded.

use std::io::{Read, Write};
use std::sync::Arc;
use std::thread::JoinHandle;

use nvme_driver::{Controller, ControllerConfig, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};
use objstore::{format_pool, FormatParams, ModelGeometry, Pool, PoolTarget};
use tutti_cluster::FINGERPRINT_BYTES;

use super::*;
use crate::relay::{DoorbellRelay, RelayConfig};
use crate::test_tracing::{EventSubscriber, OnEvent};

const SEGMENT: u16 = 16;

/// A node: its pool, data plane and stop flag.
struct Node {
    store: Mutex<StoreState>,
    plane: DataPlane,
    stop: StopHandle,
    metrics: ClusterMetrics,
}

/// A serving node (stopped and joined when dropped).
struct Serving {
    node: Arc<Node>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.node.stop.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A node over a fresh pool of blocks of `layers` × 2 × 8 heads × `head_dim` × 16 tokens × 2
/// bytes.
fn node(layers: u32, head_dim: u32, backing_bytes: u64, bounds: PeerBounds) -> Node {
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: backing_bytes }).with_namespaces(vec![NamespaceConfig::new(4096, None)]);
    let device = EmuDevice::start(config).unwrap();
    let controller = Arc::new(Controller::init(device.clone(), ControllerConfig::default()).unwrap());
    let targets = vec![PoolTarget { controller, namespace: NamespaceId(1) }];
    let geometry = ModelGeometry { layers, kv_heads: 8, head_dim, dtype_bytes: 2, block_tokens: 16 };
    // Every node of a cluster shares one key secret (docs/cluster.md), as these nodes do; the
    // tests' keys are made up (`keys`), so nothing here depends on it.
    let key_secret = Some(objstore::hash::KeySecret::from_bytes([0xc1; 32]).unwrap());
    let params = FormatParams { slot_count_max: Some(48), key_secret, ..FormatParams::new(geometry) };
    format_pool(&targets, &params).unwrap();
    let (pool, _) = Pool::open(targets, Some(&geometry)).unwrap();
    let control = StoreControl::new(pool, 16).unwrap();
    let mut plane =
        DataPlane::bind(BoundAddress::bind("127.0.0.1:0".parse().unwrap()).unwrap(), &control, SegmentBlocks::new(SEGMENT).unwrap(), 16)
            .unwrap();
    plane.bounds = bounds;
    let relay = DoorbellRelay::start(RelayConfig::default()).unwrap();
    let store = Mutex::new(StoreState { control, emulators: vec![Some(device)], relay });
    Node { store, plane, stop: StopHandle::default(), metrics: ClusterMetrics::default() }
}

/// The geometry of a `small` node's pool.
const SMALL_GEOMETRY: ModelGeometry = ModelGeometry { layers: 1, kv_heads: 8, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };

/// A small node: 16 KiB blocks (256 KiB segments).
fn small(bounds: PeerBounds) -> Node {
    node(1, 64, 32 << 20, bounds)
}

fn serve(node: Node) -> Serving {
    let node = Arc::new(node);
    let serving = Arc::clone(&node);
    let thread =
        std::thread::spawn(move || serving.plane.serve(&serving.store, &serving.stop, Duration::from_millis(10), &serving.metrics));
    Serving { node, thread: Some(thread) }
}

fn space() -> ModelSpace {
    ModelSpace::new([3; FINGERPRINT_BYTES], 0, 1).unwrap()
}

/// Prompt `seed`'s block keys (`segments` whole segments).
fn keys(seed: u64, segments: usize) -> Vec<u64> {
    (0..segments as u64 * u64::from(SEGMENT)).map(|i| (seed << 32) + i + 1).collect()
}

/// Segment bytes whose every block differs (block i of prompt `seed`).
fn segment_bytes(node: &Node, seed: u64, segment: usize) -> Vec<u8> {
    let block = node.plane.block_bytes;
    (0..usize::from(SEGMENT) * block).map(|i| (i / block + segment * 64 + seed as usize * 7 + i % 251) as u8).collect()
}

/// Stores segment `segment` of prompt `seed` in `node`'s pool (as a fetch would).
fn put(node: &Node, seed: u64, segment: usize) {
    let keys = keys(seed, segment + 1);
    let per = usize::from(SEGMENT);
    let bytes = segment_bytes(node, seed, segment);
    let stored = node.plane.store_segment(&node.store, &keys[segment * per..(segment + 1) * per], &bytes, far(), &|| false).unwrap();
    assert_eq!(stored, (per, true));
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

fn pinned(node: &Node) -> u64 {
    lock(&node.store).control.counts().pinned_slots
}

/// Serves `node` and connects to it with 4 KiB socket buffers on both sides (accepted
/// connections inherit the listener's send buffer), so the holder's writes block on a reader
/// that does not keep up.
fn serve_through_small_buffers(node: Node) -> (Serving, TcpStream) {
    let listener = lock(&node.plane.listener);
    nix::sys::socket::setsockopt(listener.as_ref().unwrap(), nix::sys::socket::sockopt::SndBuf, &4096).unwrap();
    drop(listener);
    let holder = serve(node);
    let stream = connect(&holder);
    nix::sys::socket::setsockopt(&stream, nix::sys::socket::sockopt::RcvBuf, &4096).unwrap();
    (holder, stream)
}

fn connect(serving: &Serving) -> TcpStream {
    let stream = TcpStream::connect(serving.node.plane.address()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream
}

fn request(seed: u64, segment: usize) -> Vec<u8> {
    let per = usize::from(SEGMENT);
    let mut frame = Vec::new();
    let keys = keys(seed, segment + 1)[segment * per..].to_vec();
    ReadSegment { space: space(), index: segment as u32, geometry: SMALL_GEOMETRY, keys }.encode(&mut frame);
    frame
}

/// Reads one frame (kind, body); `None` at a clean close.
fn read_frame(stream: &mut TcpStream) -> Option<(u16, Vec<u8>)> {
    let mut header = [0u8; 12];
    if stream.read_exact(&mut header).is_err() {
        return None;
    }
    assert_eq!(&header[..4], b"TPDP");
    let mut body = vec![0u8; u32::from_le_bytes(header[8..12].try_into().unwrap()) as usize];
    stream.read_exact(&mut body).ok()?;
    Some((u16::from_le_bytes([header[6], header[7]]), body))
}

fn failure(stream: &mut TcpStream) -> (FailureCode, String) {
    let (kind, body) = read_frame(stream).expect("a Failure frame");
    assert_eq!(kind, PeerKind::Failure as u16);
    match peer::decode_failure(&body) {
        PeerError::Refused { code, message } => (code, message),
        other => panic!("{other:?}"),
    }
}

/// Reads a whole segment's answer: its served count and bytes.
fn segment_answer(stream: &mut TcpStream, block_bytes: usize) -> (u32, Vec<u8>) {
    let (kind, body) = read_frame(stream).expect("a segment header");
    assert_eq!(kind, PeerKind::SegmentHeader as u16, "{:?}", String::from_utf8_lossy(&body));
    let header = peer::decode_segment_header(&body).unwrap();
    let mut bytes = Vec::new();
    for expected in 0..header.blocks {
        let (kind, body) = read_frame(stream).expect("a block");
        assert_eq!(kind, PeerKind::Block as u16);
        let (index, _, block) = peer::decode_block(&body, block_bytes).unwrap();
        assert_eq!(index, expected);
        bytes.extend_from_slice(block);
    }
    (header.served, bytes)
}

fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < until, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn garbage_gets_a_bad_request_failure_then_the_connection_closes() {
    // Goal: bytes that are no frame are answered BadRequest (a sentence saying why) and the
    // connection is closed; the holder serves on.
    let holder = serve(small(PeerBounds::default()));
    let mut stream = connect(&holder);
    stream.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let (code, message) = failure(&mut stream);
    assert_eq!(code, FailureCode::BadRequest);
    assert!(message.contains("magic"), "{message}");
    assert!(read_frame(&mut stream).is_none(), "closed after the refusal");
    wait_for("the slot is given back", Duration::from_secs(5), || holder.node.plane.peers.load(Ordering::Acquire) == 0);
}

#[test]
fn a_request_of_another_version_is_refused_then_closed_cleanly_not_reset() {
    // Goal: a request the holder cannot read (another data plane version, a fleet part-way
    // through an upgrade) with its body behind the header is refused BadRequest saying why,
    // then the connection ends with a FIN: what the asker sent is drained first. Before, the
    // holder closed with the body unread, which makes the kernel send a reset, and on a real
    // network that may discard the refusal before the asker reads it (here, the read after
    // the refusal saw the reset).
    let holder = serve(small(PeerBounds::default()));
    let mut stream = connect(&holder);
    let mut frame = b"TPDP".to_vec();
    frame.extend_from_slice(&9u16.to_le_bytes());
    frame.extend_from_slice(&(PeerKind::ReadSegment as u16).to_le_bytes());
    frame.extend_from_slice(&4096u32.to_le_bytes());
    frame.resize(frame.len() + 4096, 7);
    stream.write_all(&frame).unwrap();
    let (code, message) = failure(&mut stream);
    assert_eq!(code, FailureCode::BadRequest);
    assert!(message.contains("version 9"), "{message}");
    let mut byte = [0u8; 1];
    let after = stream.read(&mut byte);
    assert!(matches!(after, Ok(0)), "a clean close after the refusal: {after:?}");
    wait_for("the slot is given back", Duration::from_secs(5), || holder.node.plane.peers.load(Ordering::Acquire) == 0);
}

#[test]
fn a_frame_of_another_kind_is_refused_and_pipelined_reads_are_answered_in_order() {
    // Goal: a holder's own kind of frame sent to it is refused BadRequest and the connection
    // serves on; two reads sent back to back are answered in order, each whole, with the bytes
    // stored; a segment not held whole is refused NotHeld with a plain sentence that does not
    // say which of its blocks are cached.
    let node = small(PeerBounds::default());
    put(&node, 1, 0);
    put(&node, 1, 1);
    let (first, second) = (segment_bytes(&node, 1, 0), segment_bytes(&node, 1, 1));
    let block_bytes = node.plane.block_bytes;
    let holder = serve(node);
    let mut stream = connect(&holder);
    // Bodiless: a body over the kind's cap (0 for an answer's kind, sent to a holder) is garbage.
    let mut header = Vec::new();
    peer::encode_header(&mut header, PeerKind::SegmentHeader, 0);
    stream.write_all(&header).unwrap();
    let (code, message) = failure(&mut stream);
    assert_eq!(code, FailureCode::BadRequest, "{message}");

    let mut both = request(1, 0);
    both.extend_from_slice(&request(1, 1));
    stream.write_all(&both).unwrap();
    assert_eq!(segment_answer(&mut stream, block_bytes), (1, first));
    assert_eq!(segment_answer(&mut stream, block_bytes), (1, second));

    // Half of segment 2's keys are segment 1's (cached), half not.
    let mut keys = keys(1, 2)[24..].to_vec();
    keys.extend((0..8).map(|i| 900 + i));
    let mut frame = Vec::new();
    ReadSegment { space: space(), index: 2, geometry: SMALL_GEOMETRY, keys }.encode(&mut frame);
    stream.write_all(&frame).unwrap();
    let (code, message) = failure(&mut stream);
    assert_eq!((code, message.as_str()), (FailureCode::NotHeld, NOT_HELD));
    assert_eq!(pinned(&holder.node), 0);
}

#[test]
fn a_connection_over_the_cap_is_answered_busy() {
    // Goal: with PEERS_MAX connections held open, one more is answered Unavailable (saying
    // busy) and closed, not just closed; once one closes, a new connection is served.
    let node = small(PeerBounds::default());
    put(&node, 1, 0);
    let block_bytes = node.plane.block_bytes;
    let holder = serve(node);
    let held: Vec<TcpStream> = (0..PEERS_MAX).map(|_| connect(&holder)).collect();
    wait_for("every slot taken", Duration::from_secs(5), || holder.node.plane.peers.load(Ordering::Acquire) == PEERS_MAX);
    let mut over = connect(&holder);
    over.write_all(&request(1, 0)).unwrap();
    let (code, message) = failure(&mut over);
    assert_eq!(code, FailureCode::Unavailable);
    assert!(message.contains("busy"), "{message}");
    assert!(read_frame(&mut over).is_none());
    drop(held);
    wait_for("the slots are given back", Duration::from_secs(5), || holder.node.plane.peers.load(Ordering::Acquire) == 0);
    let mut stream = connect(&holder);
    stream.write_all(&request(1, 0)).unwrap();
    assert_eq!(segment_answer(&mut stream, block_bytes).0, 1);
}

#[test]
fn refused_requests_do_not_keep_a_slot() {
    // Goal: a peer that sends a request the holder refuses (not held) every 200 ms, well inside
    // the idle bound each time, loses its connection one idle bound after it was accepted (a
    // read served whole would have extended it), and one refused too often loses it at once.
    let bounds = PeerBounds { idle: Duration::from_millis(800), ..PeerBounds::default() };
    let holder = serve(small(bounds));
    let mut stream = connect(&holder);
    let started = Instant::now();
    let closed = loop {
        assert!(started.elapsed() < Duration::from_secs(5), "the bogus peer kept its slot");
        if stream.write_all(&request(7, 0)).is_err() {
            break started.elapsed();
        }
        match read_frame(&mut stream) {
            Some((kind, _)) => assert_eq!(kind, PeerKind::Failure as u16),
            None => break started.elapsed(),
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(closed >= Duration::from_millis(700), "closed after {closed:?}");
    assert!(closed < Duration::from_millis(2500), "closed after {closed:?}");

    // A holder of its own with a generous idle bound: the refusals alone close the connection.
    let holder = serve(small(PeerBounds::default()));
    let mut stream = connect(&holder);
    for _ in 0..REFUSALS_PER_CONNECTION_MAX {
        stream.write_all(&request(7, 0)).unwrap();
        assert_eq!(failure(&mut stream).0, FailureCode::NotHeld);
    }
    let _ = stream.write_all(&request(7, 0));
    assert!(read_frame(&mut stream).is_none(), "closed after {REFUSALS_PER_CONNECTION_MAX} refusals");
}

#[test]
fn a_reader_that_never_reads_loses_its_pins_within_the_bounds() {
    // Goal: a peer asks for a segment and reads nothing: within the stall bound (300 ms here;
    // the whole send's bound, when the bytes trickle) the blocks are unpinned and the slot given
    // back. (On loopback the 256 KiB segment may fit the sockets' buffers whole; a stall cut is
    // `peer.rs`'s trickle test.)
    let bounds = PeerBounds { stall: Duration::from_millis(300), idle: Duration::from_millis(500), ..PeerBounds::default() };
    let node = small(bounds);
    put(&node, 1, 0);
    let block_bytes = node.plane.block_bytes;
    let holder = serve(node);
    let stream = connect(&holder);
    nix::sys::socket::setsockopt(&stream, nix::sys::socket::sockopt::RcvBuf, &4096).unwrap();
    let asked = Instant::now();
    (&stream).write_all(&request(1, 0)).unwrap();
    wait_for("the pins go and the slot is given back", Duration::from_secs(3), || {
        pinned(&holder.node) == 0 && holder.node.plane.peers.load(Ordering::Acquire) == 0
    });
    assert!(asked.elapsed() < Duration::from_millis(1500), "{:?}", asked.elapsed());
    drop(stream);
    let mut stream = connect(&holder);
    stream.write_all(&request(1, 0)).unwrap();
    let (served, _) = segment_answer(&mut stream, block_bytes);
    assert!(served <= 2, "{served}");
}

/// An asker node and a serving holder of prompt 1's two segments.
fn asker_and_holder(bounds: PeerBounds) -> (Node, Serving) {
    let holder = small(bounds);
    put(&holder, 1, 0);
    put(&holder, 1, 1);
    (small(bounds), serve(holder))
}

fn fetch(asker: &Node, holder: &Serving, deadline: Instant) -> Result<usize, (usize, FetchError)> {
    let keys = keys(1, 2);
    let address = holder.node.plane.address();
    asker.plane.fetch(&asker.store, &space(), &keys, 0..2, "holder", address, deadline, &|| false, &mut |_, _, _, _| {})
}

#[test]
fn a_fetch_waits_for_a_holder_whose_staging_area_is_busy() {
    // Goal: the holder's staging area is taken for 3 s (as by queued peer reads and stores)
    // when a read arrives: the asker waits for the segment header past the 2 s stall bound
    // (up to the segment's deadline) and the fetch succeeds.
    let (asker, holder) = asker_and_holder(PeerBounds::default());
    let turn = holder.node.plane.staging.take(far(), &|| false).ok().unwrap();
    let started = Instant::now();
    let fetched = std::thread::scope(|scope| {
        let fetching = scope.spawn(|| fetch(&asker, &holder, Instant::now() + FETCH_DEADLINE));
        std::thread::sleep(Duration::from_secs(3));
        drop(turn);
        fetching.join().unwrap()
    });
    assert_eq!(fetched.map_err(|(_, error)| error.to_string()), Ok(32));
    assert!(started.elapsed() >= Duration::from_secs(3));
}

#[test]
fn an_asker_retries_a_busy_holder_and_its_own_staging_wait_ends_at_the_deadline() {
    // Goal: with every connection slot of the holder taken for 1 s, a fetch is answered busy,
    // retries and succeeds; a fetch whose own staging area stays busy past its deadline fails
    // at the deadline (StagingBusy), not when the area frees.
    let (asker, holder) = asker_and_holder(PeerBounds::default());
    let held: Vec<TcpStream> = (0..PEERS_MAX).map(|_| connect(&holder)).collect();
    wait_for("every slot taken", Duration::from_secs(5), || holder.node.plane.peers.load(Ordering::Acquire) == PEERS_MAX);
    let freeing = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        drop(held);
    });
    let fetched = fetch(&asker, &holder, Instant::now() + FETCH_DEADLINE);
    freeing.join().unwrap();
    assert_eq!(fetched.map_err(|(_, error)| error.to_string()), Ok(32));

    let (asker, holder) = asker_and_holder(PeerBounds::default());
    let turn = asker.plane.staging.take(far(), &|| false).ok().unwrap();
    let started = Instant::now();
    let fetched = fetch(&asker, &holder, started + Duration::from_millis(1500));
    let took = started.elapsed();
    drop(turn);
    match fetched {
        Err((0, FetchError::StagingBusy)) => {}
        other => panic!("{other:?}"),
    }
    assert!(took < Duration::from_millis(2500), "{took:?}");
}

#[test]
fn a_holder_that_accepts_and_never_answers_fails_a_fetch_within_the_stall_bound() {
    // Goal: a holder whose kernel accepts the connection but which never answers (a stopped
    // process, a frozen host) costs the asker the stall bound (2 s) for the segment header, not
    // the segment's deadline: the fetch fails Stalled, its slot given back, nothing stored.
    let asker = small(PeerBounds::default());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let silent = std::thread::spawn(move || {
        let accepted = listener.accept();
        let _ = wait.recv_timeout(Duration::from_secs(30));
        drop(accepted);
    });
    let keys = keys(1, 2);
    let started = Instant::now();
    let fetched = asker.plane.fetch(
        &asker.store,
        &space(),
        &keys,
        0..2,
        "silent",
        address,
        started + Duration::from_secs(10),
        &|| false,
        &mut |_, _, _, _| {},
    );
    let took = started.elapsed();
    done.send(()).unwrap();
    silent.join().unwrap();
    match fetched {
        Err((0, error @ FetchError::Peer { segment: 0, .. })) => {
            assert!(matches!(&error, FetchError::Peer { source, .. } if matches!(**source, PeerError::Stalled { .. })), "{error}");
            // Silent before a byte of its answer: another listed holder is asked (and this one
            // not again in a later run), as for one unreachable; before, the fetch failed here
            // and the same asker, ranking the same holder first, failed every time.
            assert!(error.another_holder_may_serve(), "a holder silent before its header is not passed over: {error}");
            assert!(error.holder_unreachable(), "{error}");
            assert!(!error.is_fault(), "{error}");
        }
        other => panic!("{other:?}"),
    }
    assert!(took >= PEER_STALL && took < Duration::from_secs(4), "{took:?}");
    assert_eq!(asker.plane.fetches.load(Ordering::Acquire), 0);
    assert_eq!(lock(&asker.store).control.counts().cached_blocks, 0);
}

/// `asker` fetches the first segment of one prompt from `holder_address`, its daemon draining
/// (`stopped`) 100 ms in; returns the fetch's outcome and how long it took.
fn fetch_drained_after_100_ms(
    asker: &Node,
    holder_address: std::net::SocketAddr,
    holder: &str,
) -> (Result<usize, (usize, FetchError)>, Duration) {
    let keys = keys(1, 1);
    let started = Instant::now();
    let stopped = || started.elapsed() >= Duration::from_millis(100);
    let deadline = started + Duration::from_secs(10);
    let fetched = asker.plane.fetch(&asker.store, &space(), &keys, 0..1, holder, holder_address, deadline, &stopped, &mut |_, _, _, _| {});
    (fetched, started.elapsed())
}

/// The fetch ended as `Stopped` (not a fault) before any segment was stored.
fn assert_stopped_before_any_segment(fetched: Result<usize, (usize, FetchError)>) {
    match fetched {
        Err((0, error)) => {
            assert!(matches!(error, FetchError::Stopped), "{error}");
            assert!(!error.is_fault(), "{error}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_drain_during_a_read_is_the_fetch_stopped_not_the_holder_closing() {
    // Goal: SIGTERM while the asker waits for a segment's first block (the holder sent the
    // header and is reading its disks) ends the fetch as `Stopped`, not a fault, and says so;
    // before, the drain was told as "the peer closed the connection" (`Closed`), a fault that
    // blamed the holder and was counted in `remote_read_failures`.
    let asker = small(PeerBounds::default());
    let block_bytes = asker.plane.block_bytes as u64;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let slow = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut request = vec![0u8; peer::HEADER_BYTES];
        stream.read_exact(&mut request).unwrap();
        let mut header = Vec::new();
        let geometry = SMALL_GEOMETRY;
        peer::encode_segment_header(&mut header, SegmentHeader { blocks: SEGMENT, block_bytes, served: 1, geometry });
        stream.write_all(&header).unwrap();
        let _ = wait.recv_timeout(Duration::from_secs(30));
    });
    let (fetched, took) = fetch_drained_after_100_ms(&asker, address, "slow");
    done.send(()).unwrap();
    slow.join().unwrap();
    assert_stopped_before_any_segment(fetched);
    assert!(took < Duration::from_secs(1), "{took:?}");
    assert_eq!(asker.plane.fetches.load(Ordering::Acquire), 0);
}

#[test]
fn the_drain_during_a_busy_holders_pause_is_the_fetch_stopped_not_the_holder_busy() {
    // Goal: a holder answering every read `Unavailable` is paused for and asked again; SIGTERM
    // during that pause ends the fetch as `Stopped`, at once, not as `HolderBusy` (which told
    // the client the holder "stayed busy": this node's drain blamed on the holder).
    let asker = small(PeerBounds::default());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let busy = std::thread::spawn(move || {
        // Every connection (each retry makes one) is answered Unavailable; bounded by `done`.
        while wait.try_recv().is_err() {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    stream.set_nonblocking(false).unwrap();
                    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                    let mut request = vec![0u8; peer::HEADER_BYTES];
                    if stream.read_exact(&mut request).is_err() {
                        continue;
                    }
                    let length = u32::from_le_bytes(request[8..12].try_into().unwrap()) as usize;
                    let mut body = vec![0u8; length];
                    let _ = stream.read_exact(&mut body);
                    let mut failure = Vec::new();
                    peer::encode_failure(&mut failure, FailureCode::Unavailable, "busy");
                    let _ = stream.write_all(&failure);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    let (fetched, took) = fetch_drained_after_100_ms(&asker, address, "busy");
    done.send(()).unwrap();
    busy.join().unwrap();
    assert_stopped_before_any_segment(fetched);
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!(asker.plane.fetches.load(Ordering::Acquire), 0);
}

#[test]
fn a_holder_whose_staging_stays_busy_sends_the_header_then_a_failure_and_counts_nothing() {
    // Goal: the holder sends the segment header as soon as the blocks are pinned, before its
    // wait for the staging area; when that wait fails (half the segment's bound: 1 s here) a
    // `Failure` (Unavailable) comes where the first block was due, the pins go, the connection
    // serves on, and the refused read is not counted for heavy hitters.
    let bounds = PeerBounds { segment: Duration::from_secs(2), ..PeerBounds::default() };
    let node = small(bounds);
    put(&node, 1, 0);
    let block_bytes = node.plane.block_bytes;
    let holder = serve(node);
    let turn = holder.node.plane.staging.take(far(), &|| false).ok().unwrap();
    let mut stream = connect(&holder);
    let asked = Instant::now();
    stream.write_all(&request(1, 0)).unwrap();
    let (kind, body) = read_frame(&mut stream).expect("a segment header");
    assert_eq!(kind, PeerKind::SegmentHeader as u16);
    assert!(asked.elapsed() < Duration::from_millis(700), "the header waited for staging: {:?}", asked.elapsed());
    let header = peer::decode_segment_header(&body).unwrap();
    assert_eq!((header.blocks, header.served), (SEGMENT, 1));
    let (code, message) = failure(&mut stream);
    assert_eq!(code, FailureCode::Unavailable, "{message}");
    assert!(asked.elapsed() >= Duration::from_millis(900), "{:?}", asked.elapsed());
    wait_for("the pins go", Duration::from_secs(2), || pinned(&holder.node) == 0);
    drop(turn);
    stream.write_all(&request(1, 0)).unwrap();
    let (served, bytes) = segment_answer(&mut stream, block_bytes);
    assert_eq!(served, 1, "the refused read was counted");
    assert_eq!(bytes, segment_bytes(&holder.node, 1, 0));
}

#[test]
fn a_holder_draining_during_its_staging_wait_still_answers_unavailable() {
    // Goal: the holder sent the segment header and waits for its staging area when its daemon
    // starts draining (SIGTERM, a restart): the wait ends and the asker is told `Unavailable`
    // where the first block was due. Before, the refusal was written with the drain's stop
    // predicate, which refuses before a byte: the connection closed after the header, which
    // the asker counts a fault and does not pass over to another replica.
    let node = small(PeerBounds::default());
    put(&node, 1, 0);
    let holder = serve(node);
    let turn = holder.node.plane.staging.take(far(), &|| false).ok().unwrap();
    let mut stream = connect(&holder);
    stream.write_all(&request(1, 0)).unwrap();
    let (kind, _) = read_frame(&mut stream).expect("a segment header");
    assert_eq!(kind, PeerKind::SegmentHeader as u16);
    holder.node.stop.stop();
    let (kind, body) = read_frame(&mut stream).expect("a Failure frame where the first block was due, not the connection closed");
    assert_eq!(kind, PeerKind::Failure as u16);
    match peer::decode_failure(&body) {
        PeerError::Refused { code, message } => assert_eq!(code, FailureCode::Unavailable, "{message}"),
        other => panic!("{other:?}"),
    }
    drop(turn);
}

#[test]
fn a_fetch_from_a_holder_that_drains_mid_answer_passes_it_over_without_a_fault() {
    // Goal: the fetch-level view of the drain above: the holder is told to stop while the
    // asker awaits the first block; its `Unavailable` is asked again on a new connection,
    // which the stopped holder refuses: the fetch fails as the holder unreachable — another
    // listed holder may serve, not counted a fault. Before, the close after the header failed
    // the fetch as a fault that no other holder was asked for.
    let (asker, holder) = asker_and_holder(PeerBounds::default());
    let turn = holder.node.plane.staging.take(far(), &|| false).ok().unwrap();
    let fetched = std::thread::scope(|scope| {
        let fetching = scope.spawn(|| fetch(&asker, &holder, Instant::now() + Duration::from_secs(20)));
        wait_for("the holder pins the segment", Duration::from_secs(5), || pinned(&holder.node) > 0);
        holder.node.stop.stop();
        fetching.join().unwrap()
    });
    drop(turn);
    match fetched {
        Err((0, error)) => {
            assert!(error.another_holder_may_serve(), "not passed over: {error}");
            assert!(!error.is_fault(), "counted a fault: {error}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(lock(&asker.store).control.counts().cached_blocks, 0);
}

#[test]
fn a_holder_drained_while_sending_blocks_ends_on_a_frame_boundary_with_unavailable() {
    // Goal: the drain met while a segment's blocks are being sent (a slow reader: the holder's
    // writes block) ends the answer between two blocks with `Failure(Unavailable)`, which the
    // asker takes at any block index and passes the holder over for; or, if the last block was
    // already on its way, with the segment whole. Before, each block's write ended at the
    // drain between write calls: the connection closed mid-answer, often mid-frame, which the
    // asker counts a fault and passes no one over for.
    let node = small(PeerBounds::default());
    put(&node, 1, 0);
    let block_bytes = node.plane.block_bytes;
    let (holder, mut stream) = serve_through_small_buffers(node);
    stream.write_all(&request(1, 0)).unwrap();
    let (kind, _) = read_frame(&mut stream).expect("a segment header");
    assert_eq!(kind, PeerKind::SegmentHeader as u16);
    let (kind, _) = read_frame(&mut stream).expect("block 0");
    assert_eq!(kind, PeerKind::Block as u16);
    holder.node.stop.stop();
    // Time for the holder's next write call to meet the stop.
    std::thread::sleep(Duration::from_millis(100));
    let mut next = 1;
    loop {
        let (kind, body) = read_frame(&mut stream).unwrap_or_else(|| panic!("the connection ended mid-answer, at block {next}"));
        if kind == PeerKind::Failure as u16 {
            match peer::decode_failure(&body) {
                PeerError::Refused { code, message } => assert_eq!(code, FailureCode::Unavailable, "{message}"),
                other => panic!("{other:?}"),
            }
            break;
        }
        assert_eq!(kind, PeerKind::Block as u16);
        let (index, _, _) = peer::decode_block(&body, block_bytes).unwrap();
        assert_eq!(index, next);
        next += 1;
        if next == SEGMENT {
            break;
        }
    }
}

#[test]
fn a_drain_waits_at_most_the_stall_bound_for_a_slow_readers_block() {
    // Goal: a block being sent when the drain comes is given one stall bound more, then cut:
    // a reader that trickles (each write call moves, so the socket's write timeout does not
    // trip) holds the peer thread, and with it the daemon's drain, at most the write call in
    // progress plus one stall bound. Before, the block was written whole whatever the reader's
    // pace, bounded only by the segment's 60 s deadline: here the peer thread lasted ~20 s.
    // 128 KiB blocks; the default stall bound (at 1 s a write call of this trickle could
    // stall, ending the thread early whatever the drain).
    let node = node(8, 32, 32 << 20, PeerBounds::default());
    let stall = node.plane.bounds.stall;
    put(&node, 1, 0);
    let geometry = node.plane.geometry;
    let (holder, mut stream) = serve_through_small_buffers(node);
    let mut frame = Vec::new();
    ReadSegment { space: space(), index: 0, geometry, keys: keys(1, 1) }.encode(&mut frame);
    stream.write_all(&frame).unwrap();
    let (kind, _) = read_frame(&mut stream).expect("a segment header");
    assert_eq!(kind, PeerKind::SegmentHeader as u16);
    let (kind, _) = read_frame(&mut stream).expect("block 0");
    assert_eq!(kind, PeerKind::Block as u16);
    holder.node.stop.stop();
    let stopped = Instant::now();
    // 2 KiB every 250 ms until the holder cuts the connection (a read waits 10 ms at most, so
    // the peer thread's end is looked for every 10 ms or so).
    let bound = 2 * stall + Duration::from_secs(1);
    let mut trickle = [0u8; 2048];
    let mut next_read = Some(stopped);
    stream.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
    while holder.node.plane.peers.load(Ordering::Acquire) != 0 {
        assert!(stopped.elapsed() < bound, "the peer thread still sending {:?} after the stop", stopped.elapsed());
        if next_read.is_some_and(|at| Instant::now() >= at) {
            next_read = match stream.read(&mut trickle) {
                Ok(0) => None,
                Ok(_) => Some(Instant::now() + Duration::from_millis(250)),
                Err(error) if matches!(error.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => next_read,
                Err(_) => None,
            };
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_holder_drained_between_two_segments_is_passed_over_not_counted_a_fault() {
    // Goal: the drain met by a holder between two segments of a fetch (its accept loop asleep
    // for a 200 ms tick) is never a fault: its peer threads end for the drain only once its
    // listener is closed, so the asker's reconnect is refused (passed over) rather than taken
    // into the backlog of a listener about to be dropped and reset there, after the one
    // reconnect a segment: a fault no other holder was asked for.
    let holder = small(PeerBounds::default());
    put(&holder, 1, 0);
    put(&holder, 1, 1);
    let asker = small(PeerBounds::default());
    let holder = Arc::new(holder);
    let serving = Arc::clone(&holder);
    let thread =
        std::thread::spawn(move || serving.plane.serve(&serving.store, &serving.stop, Duration::from_millis(200), &serving.metrics));
    let holder = Serving { node: holder, thread: Some(thread) };
    let keys = keys(1, 2);
    let address = holder.node.plane.address();
    // The holder's staging area is taken with the stop, so its read of segment 1 waits for it
    // and meets the drain there, every time, rather than racing the accept loop's tick.
    let mut turn = None;
    let mut stop_after_first = |segment: usize, _: &[u64], _: u32, _: bool| {
        if segment == 0 {
            turn = holder.node.plane.staging.take(far(), &|| false).ok();
            holder.node.stop.stop();
        }
    };
    let fetched = asker.plane.fetch(&asker.store, &space(), &keys, 0..2, "holder", address, far(), &|| false, &mut stop_after_first);
    drop(turn);
    match fetched {
        Err((stored, error)) => {
            assert_eq!(stored, usize::from(SEGMENT), "{error}");
            assert!(!error.is_fault(), "counted a fault: {error}");
            assert!(error.another_holder_may_serve(), "not passed over: {error}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_holder_whose_asker_left_during_its_staging_wait_unpins_without_reading() {
    // Goal: an asker that gave up on a holder after its header (passed it over) and closed the
    // connection is not served on: the holder, waiting for its staging area, sees the close
    // (a peek) and ends the answer, its pins released, no read done. Before, it waited up to
    // 30 s for the staging area, then read the whole segment from its disks for nobody,
    // keeping the blocks pinned and its staging area from other askers meanwhile.
    let node = small(PeerBounds::default());
    put(&node, 1, 0);
    let device = lock(&node.store).emulators[0].clone().expect("an emulated device");
    let holder = serve(node);
    let turn = holder.node.plane.staging.take(far(), &|| false).ok().unwrap();
    let io_commands = || device.stats().io_commands.values().sum::<u64>();
    let before = io_commands();
    let mut stream = connect(&holder);
    stream.write_all(&request(1, 0)).unwrap();
    let (kind, _) = read_frame(&mut stream).expect("a segment header");
    assert_eq!(kind, PeerKind::SegmentHeader as u16);
    assert!(pinned(&holder.node) > 0);
    drop(stream);
    wait_for("the holder unpins the segment of an asker that left", Duration::from_secs(2), || pinned(&holder.node) == 0);
    drop(turn);
    wait_for("the peer thread ends", Duration::from_secs(2), || holder.node.plane.peers.load(Ordering::Acquire) == 0);
    assert_eq!(io_commands(), before, "the holder read the segment for an asker that left");
    assert_eq!(holder.node.metrics.serve_refusals.get(), 0, "an asker leaving is not a refusal");
}

#[test]
fn an_asker_retries_a_busy_failure_in_place_of_the_first_block_and_stores_nothing_partial() {
    // Goal: a holder whose staging area stays busy past its wait (3 s here) sends `Unavailable`
    // where the first block was due: the asker asks again and the fetch succeeds once the area
    // frees. When it stays busy past the asker's segment deadline, the fetch fails by then,
    // cleanly: nothing stored, nothing left pinned, the fetch slot given back.
    let bounds = PeerBounds { segment: Duration::from_secs(6), ..PeerBounds::default() };
    let (asker, holder) = asker_and_holder(bounds);
    let turn = holder.node.plane.staging.take(far(), &|| false).ok().unwrap();
    let started = Instant::now();
    let fetched = std::thread::scope(|scope| {
        let fetching = scope.spawn(|| fetch(&asker, &holder, Instant::now() + FETCH_DEADLINE));
        std::thread::sleep(Duration::from_secs(4));
        drop(turn);
        fetching.join().unwrap()
    });
    assert_eq!(fetched.map_err(|(_, error)| error.to_string()), Ok(32));
    assert!(started.elapsed() >= Duration::from_secs(4));

    let bounds = PeerBounds { segment: Duration::from_secs(2), ..PeerBounds::default() };
    let (asker, holder) = asker_and_holder(bounds);
    let turn = holder.node.plane.staging.take(far(), &|| false).ok().unwrap();
    let started = Instant::now();
    let fetched = fetch(&asker, &holder, started + FETCH_DEADLINE);
    let took = started.elapsed();
    drop(turn);
    match fetched {
        Err((0, FetchError::HolderBusy { segment: 0, .. })) => {}
        Err((0, FetchError::Peer { segment: 0, source, .. })) if matches!(*source, PeerError::Stalled { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(took < Duration::from_millis(3500), "{took:?}");
    assert_eq!(lock(&asker.store).control.counts().cached_blocks, 0, "a partial segment was stored");
    assert_eq!(asker.plane.fetches.load(Ordering::Acquire), 0);
    wait_for("the holder's pins go", Duration::from_secs(3), || pinned(&holder.node) == 0);
}

#[test]
fn a_holder_closing_an_idle_connection_between_segments_is_asked_again() {
    // Goal: the asker's wait between two segments (its own staging area, up to the fetch's
    // deadline) may outlast the holder's idle bound (300 ms here): the holder closes the
    // connection, and the asker, finding it closed before a byte of the next answer, connects
    // again once and the fetch succeeds.
    let bounds = PeerBounds { idle: Duration::from_millis(300), ..PeerBounds::default() };
    let (asker, holder) = asker_and_holder(bounds);
    let keys = keys(1, 2);
    let address = holder.node.plane.address();
    let mut stored = Vec::new();
    let fetched = asker.plane.fetch(&asker.store, &space(), &keys, 0..2, "holder", address, far(), &|| false, &mut |segment, _, _, _| {
        stored.push(segment);
        if segment == 0 {
            wait_for("the holder closes the idle connection", Duration::from_secs(5), || {
                holder.node.plane.peers.load(Ordering::Acquire) == 0
            });
        }
    });
    assert_eq!(fetched.map_err(|(_, error)| error.to_string()), Ok(32));
    assert_eq!(stored, [0, 1]);
}

#[test]
fn a_fetched_segment_whose_blocks_were_here_already_is_not_called_written() {
    // Goal: the asker committed segment 0 of the prompt itself (a local client's store,
    // its hand-over to the registrar perhaps still queued) and then fetches both segments:
    // segment 0's store shares every block and writes none, so the fetch says its last
    // block was not written by it (the fetch path then does not take the segment for a
    // fetched copy, which the registrar would leave unregistered); segment 1's store wrote
    // it. Before, every stored segment was passed on alike.
    let (asker, holder) = asker_and_holder(PeerBounds::default());
    put(&asker, 1, 0);
    let keys = keys(1, 2);
    let address = holder.node.plane.address();
    let mut seen = Vec::new();
    let fetched =
        asker.plane.fetch(&asker.store, &space(), &keys, 0..2, "holder", address, far(), &|| false, &mut |segment, _, _, written| {
            seen.push((segment, written))
        });
    assert_eq!(fetched.map_err(|(_, error)| error.to_string()), Ok(16), "segment 0's blocks were written again");
    assert_eq!(seen, [(0, false), (1, true)]);
}

#[test]
fn pools_of_another_geometry_with_equal_block_sizes_exchange_nothing() {
    // Goal: a holder's blocks are 1 layer × 8 heads × dim 64 and the asker's 2 layers × 8
    // heads × dim 32: the same 32 KiB a block, bytes that mean something else. Checking the
    // block size alone let the asker store them as its own KV; the pools' geometries travel
    // with the request and the segment header, and the holder refuses the read (BadRequest,
    // naming both) before it pins anything: the fetch fails, nothing is stored, nothing served.
    let holder = small(PeerBounds::default());
    put(&holder, 1, 0);
    put(&holder, 1, 1);
    let holder = serve(holder);
    let asker = node(2, 32, 32 << 20, PeerBounds::default());
    assert_eq!(asker.plane.block_bytes, holder.node.plane.block_bytes, "the test needs equal block sizes");
    match fetch(&asker, &holder, far()) {
        Err((0, FetchError::Peer { segment: 0, source, .. })) => match *source {
            PeerError::Refused { code: FailureCode::BadRequest, ref message } => assert!(message.contains("geometry"), "{message}"),
            ref other => panic!("{other}"),
        },
        other => panic!("a fetch across geometries: {other:?}"),
    }
    assert_eq!(lock(&asker.store).control.counts().cached_blocks, 0, "bytes of another geometry were stored");
    assert_eq!(holder.node.metrics.served_segments.get(), 0);
    assert_eq!(pinned(&holder.node), 0);
}

#[test]
fn a_holder_whose_disk_is_slow_ends_a_read_at_the_segments_deadline_and_keeps_its_staging_area() {
    // Goal: a holder of 8-layer blocks whose device answers every command 400 ms late (a slow
    // disk, not a dead one) serves a read under a 1 s segment bound. The transfer was bounded
    // only by LAYER_TIMEOUT × layers (80 s here, 800 s for 80 layers), so the blocks stayed
    // pinned for the whole ≥ 3.2 s read; now no layer is issued past the segment's deadline:
    // a `Failure` (ReadFailed) comes within ~1.5 s, the pins go, and the staging area is not
    // retired — once the disk is quick again the same connection gets the segment whole.
    let bounds = PeerBounds { segment: Duration::from_secs(1), ..PeerBounds::default() };
    let node = node(8, 16, 32 << 20, bounds);
    put(&node, 1, 0);
    let block_bytes = node.plane.block_bytes;
    let geometry = node.plane.geometry;
    let device = lock(&node.store).emulators[0].clone().expect("an emulated device");
    let holder = serve(node);
    device.set_faults(nvme_emu::FaultPlan {
        rules: vec![nvme_emu::FaultRule::every_nth_io(1, nvme_emu::FaultAction::Delay(Duration::from_millis(400)))],
    });
    let per = usize::from(SEGMENT);
    let mut frame = Vec::new();
    ReadSegment { space: space(), index: 0, geometry, keys: keys(1, 1)[..per].to_vec() }.encode(&mut frame);
    let mut stream = connect(&holder);
    let asked = Instant::now();
    stream.write_all(&frame).unwrap();
    let (kind, _) = read_frame(&mut stream).expect("a segment header");
    assert_eq!(kind, PeerKind::SegmentHeader as u16);
    let (kind, body) = read_frame(&mut stream).expect("a Failure where the first block was due");
    let took = asked.elapsed();
    assert_eq!(kind, PeerKind::Failure as u16, "the slow read was sent whole after {took:?}");
    match peer::decode_failure(&body) {
        PeerError::Refused { code: FailureCode::ReadFailed, message } => assert!(message.contains("deadline"), "{message}"),
        other => panic!("{other:?}"),
    }
    // ~1.4 s expected (the deadline plus the one 400 ms layer in flight); the unbounded read
    // takes ≥ 3.2 s. 2.8 s leaves a loaded machine room without letting that pass.
    assert!(took < Duration::from_millis(2800), "the read ran {took:?} past a 1 s segment bound");
    wait_for("the pins go", Duration::from_secs(1), || pinned(&holder.node) == 0);
    device.set_faults(nvme_emu::FaultPlan::default());
    stream.write_all(&frame).unwrap();
    let (_, bytes) = segment_answer(&mut stream, block_bytes);
    assert_eq!(bytes, segment_bytes(&holder.node, 1, 0), "the staging area was retired or the bytes are wrong");
}

#[test]
fn a_store_on_a_slow_disk_ends_at_the_drain_within_a_layer_and_keeps_its_staging_area() {
    // Goal: an asker's store of a fetched segment on a device answering every command 400 ms
    // late (8 layers: 3.2 s) while the daemon starts draining 100 ms in ends `Stopped` within
    // about one layer (the one in flight is finished), not a fault; nothing of it is stored,
    // its reservation released and the staging area kept. Before, the write ignored the drain
    // and ran every layer (up to the fetch's deadline plus a layer's timeout).
    let node = node(8, 16, 32 << 20, PeerBounds::default());
    let device = lock(&node.store).emulators[0].clone().expect("an emulated device");
    device.set_faults(nvme_emu::FaultPlan {
        rules: vec![nvme_emu::FaultRule::every_nth_io(1, nvme_emu::FaultAction::Delay(Duration::from_millis(400)))],
    });
    let per = usize::from(SEGMENT);
    let keys = keys(1, 1);
    let bytes = segment_bytes(&node, 1, 0);
    let started = Instant::now();
    let stopped = || started.elapsed() >= Duration::from_millis(100);
    let stored = node.plane.store_segment(&node.store, &keys[..per], &bytes, far(), &stopped);
    let took = started.elapsed();
    device.set_faults(nvme_emu::FaultPlan::default());
    match stored {
        Err(error @ FetchError::Stopped) => assert!(!error.is_fault()),
        other => panic!("a store drained 100 ms in: {other:?} after {took:?}"),
    }
    // ~0.4-0.8 s expected (the layer in flight at the drain); every layer takes >= 3.2 s.
    assert!(took < Duration::from_millis(2000), "the store ran {took:?} past the drain");
    assert!(!node.plane.staging.retired(), "the staging area was retired");
    assert_eq!(pinned(&node), 0, "the store's reservation was kept");
    assert_eq!(lock(&node.store).control.lookup(&keys), 0, "a drained store was committed");
    put(&node, 1, 0);
}

#[test]
fn a_second_address_prepared_on_a_port_another_holds_unlistened_is_refused_at_once() {
    // Goal: two daemons started together on one data address: the second's prepare is refused
    // (EADDRINUSE) while the first's is only bound, not listened on (its pool still opening),
    // before the second touches its pool; not both bound and the second refused only at
    // listen, after a `--format`. Connections to the prepared address are still refused.
    let first = BoundAddress::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let address = first.local_addr().unwrap();
    match BoundAddress::bind(address) {
        Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::AddrInUse, "{error}"),
        Ok(_) => panic!("a second prepare on {address} was bound while the first's was"),
    }
    match TcpStream::connect_timeout(&address, Duration::from_secs(2)) {
        Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::ConnectionRefused, "{error}"),
        Ok(_) => panic!("a connect to the prepared, unlistened address succeeded"),
    }
    let listening = first.listen().unwrap();
    match BoundAddress::bind(address) {
        Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::AddrInUse, "{error}"),
        Ok(_) => panic!("a prepare on {address} was bound while it was listened on"),
    }
    drop(listening);
}

#[test]
fn a_restart_binds_past_its_predecessors_time_wait_and_still_refuses_a_second_prepare() {
    // Goal: the holder's side closed its connections first (TIME_WAIT on the data address):
    // the next start binds the address anyway (SO_REUSEADDR), listens on it, and while it is
    // only prepared another prepare on it is refused.
    let first = BoundAddress::bind("127.0.0.1:0".parse().unwrap()).unwrap().listen().unwrap();
    let address = first.local_addr().unwrap();
    let client = TcpStream::connect_timeout(&address, Duration::from_secs(2)).unwrap();
    let (accepted, _) = first.accept().unwrap();
    // The holder's side closes first: its end of the connection lies in TIME_WAIT.
    drop(accepted);
    client.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = (&client).read(&mut [0u8; 1]);
    drop(client);
    drop(first);
    {
        // TIME_WAIT holds the address: a bind without SO_REUSEADDR is refused.
        use nix::sys::socket::{bind, socket, AddressFamily, SockFlag, SockType, SockaddrStorage};
        use std::os::fd::AsRawFd;
        let plain = socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
        assert_eq!(bind(plain.as_raw_fd(), &SockaddrStorage::from(address)), Err(nix::errno::Errno::EADDRINUSE));
    }
    let restarted = BoundAddress::bind(address).expect("a restart binds past TIME_WAIT");
    match BoundAddress::bind(address) {
        Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::AddrInUse, "{error}"),
        Ok(_) => panic!("a second prepare on {address} was bound while a restart's was"),
    }
    let listening = restarted.listen().expect("the restart listens past TIME_WAIT");
    assert_eq!(listening.local_addr().unwrap(), address);
    TcpStream::connect_timeout(&address, Duration::from_secs(2)).expect("a connect once it listens");
}

#[test]
fn a_store_whose_staging_queue_pair_is_not_deleted_keeps_its_reservation_counted() {
    // Goal: a fetched segment's store whose layer is left in flight (the controller failed
    // under it) retires the staging area; when a queue pair's deletion is refused too, a
    // command may still move the reserved slots: the reservation is kept for good (the slots
    // stay pinned) and counted in `kept_reservations` (`tuttid_cluster_kept_reservations`).
    // Before, only an error line said so: every counter read 0 while the slots stayed pinned.
    let node = small(PeerBounds::default());
    let device = lock(&node.store).emulators[0].clone().expect("an emulated device");
    let refuse = nvme_emu::FaultAction::Status(nvme_driver::spec::NvmeStatus::generic(nvme_driver::spec::status::codes::INTERNAL_ERROR));
    device.set_faults(nvme_emu::FaultPlan {
        rules: vec![
            nvme_emu::FaultRule::on_nth_io(1, nvme_emu::FaultAction::DropCompletion),
            nvme_emu::FaultRule::on_nth_admin(1, nvme_driver::spec::AdminOpcode::DeleteIoSubmissionQueue, refuse),
        ],
    });
    let per = usize::from(SEGMENT);
    let keys = keys(1, 1);
    let bytes = segment_bytes(&node, 1, 0);
    let stored = node.plane.store_segment(&node.store, &keys[..per], &bytes, far(), &|| false);
    assert!(matches!(stored, Err(FetchError::Store { .. })), "{stored:?}");
    assert!(node.plane.staging.retired(), "the staging area was not retired");
    assert_eq!(node.plane.kept_reservations.get(), 1, "the reservation kept for good was not counted");
    assert_eq!(pinned(&node), per as u64, "the kept reservation's slots");
}

#[test]
fn a_peer_slot_is_given_back_when_its_thread_panics() {
    // Goal: a peer connection's slot is a guard, given back on every way out of its thread,
    // a panic included; before, the count was decremented after `serve_peer` returned, so a
    // panic in it kept one of the 8 slots for good.
    let peers = AtomicUsize::new(0);
    let slot = PeerSlot::take(&peers);
    assert_eq!(peers.load(Ordering::Acquire), 1);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _slot = slot;
        panic!("a peer thread panics");
    }));
    assert!(panicked.is_err());
    assert_eq!(peers.load(Ordering::Acquire), 0, "the slot was kept");
}

/// A tracing subscriber that panics at the first warning: made the default of the accept
/// loop's thread only, it stands for a bug that panics in that loop.
struct PanicAtWarning;

impl OnEvent for PanicAtWarning {
    fn on_event(&self, event: &tracing::Event<'_>) {
        if *event.metadata().level() == tracing::Level::WARN {
            panic!("a bug in the accept loop (test)");
        }
    }
}

#[test]
fn a_panic_in_the_accept_loop_still_drains_the_peer_threads() {
    // Goal: the peer threads' drain (set once the listener is closed) is set on every way out
    // of the accept loop, a panic included, the listener closed first. Before, it was the
    // loop's last statement: a panic skipped it, and the scope waited for peer threads that
    // never met the drain (an asker parked between requests holds one for the idle bound, 30 s
    // here; one that keeps reading, for good), and with them the daemon's drain.
    let node = Arc::new(small(PeerBounds::default()));
    let address = node.plane.address();
    let serving = Arc::clone(&node);
    // A second dispatcher alive for the whole test: with only one registered, tracing-core
    // 0.1 caches a call site's interest from whichever thread reaches it first
    // (tokio-rs/tracing#3611), so another test's accept thread, with no subscriber, could
    // leave the over-the-limit warning cached as disabled and this one would never panic.
    let _second_dispatch = tracing::Dispatch::new(EventSubscriber(PanicAtWarning));
    let thread = std::thread::spawn(move || {
        tracing::subscriber::with_default(EventSubscriber(PanicAtWarning), || {
            serving.plane.serve(&serving.store, &serving.stop, Duration::from_millis(10), &serving.metrics)
        })
    });
    // Every peer slot taken by a connection waiting for a request.
    let parked: Vec<TcpStream> = (0..PEERS_MAX).map(|_| TcpStream::connect(address).unwrap()).collect();
    wait_for("every peer slot taken", Duration::from_secs(5), || node.plane.peers.load(Ordering::Acquire) == PEERS_MAX);
    // One more: the accept loop warns that it is over the limit, and panics there.
    let _over = TcpStream::connect(address).unwrap();
    wait_for("serve ends after the accept loop panicked", Duration::from_secs(2), || thread.is_finished());
    assert!(thread.join().is_err(), "serve passes the accept loop's panic on");
    assert_eq!(node.plane.peers.load(Ordering::Acquire), 0);
    match TcpStream::connect(address) {
        Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::ConnectionRefused, "{error}"),
        Ok(_) => panic!("a connect after serve ended was accepted"),
    }
    drop(parked);
}

#[test]
fn a_panic_during_a_staging_turn_retires_the_area() {
    // Goal: a bug that panics in a staging turn's work (a layer issued on a slow device, still
    // in flight) retires the staging area as the turn ends: the next turn must not reuse
    // memory that layer may still write. Before, the turn's drop passed the area on as it was.
    // The request's reservation is never released (the unwinding skips its release): its
    // slots stay pinned, counted in `kept_reservations` as an asker's store's is (before, not
    // counted: only logged when the queue pairs could not be deleted). Later fetches fail
    // `NoStaging`, before a holder is asked.
    let node = small(PeerBounds::default());
    put(&node, 1, 0);
    let device = lock(&node.store).emulators[0].clone().expect("an emulated device");
    device.set_faults(nvme_emu::FaultPlan {
        rules: vec![nvme_emu::FaultRule::every_nth_io(1, nvme_emu::FaultAction::Delay(Duration::from_millis(400)))],
    });
    let per = usize::from(SEGMENT);
    let keys = keys(1, 1);
    let engine_blocks: Vec<u32> = (0..per as u32).collect();
    let (handle, placements) = {
        let mut store = lock(&node.store);
        let handle = store.control.reserve_retrieve(&keys, &engine_blocks, 0).unwrap();
        (handle, store.control.placements(handle).unwrap().to_vec())
    };
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        node.plane.with_staging(handle, far(), &|| false, Some(&node.plane.kept_reservations), |staging| {
            staging.issue_first_layer(handle, Direction::Retrieve, &placements).unwrap();
            panic!("a bug mid-transfer");
        })
    }));
    assert!(panicked.is_err());
    assert!(node.plane.staging.retired(), "the staging area was passed on with a layer in flight");
    assert_eq!(pinned(&node), per as u64, "the reservation's slots");
    assert_eq!(node.plane.kept_reservations.get(), 1, "the reservation kept for good was not counted");
    device.set_faults(nvme_emu::FaultPlan::default());
    let address: SocketAddr = "127.0.0.1:1".parse().unwrap();
    match node.plane.fetch(&node.store, &space(), &keys, 0..1, "anyone", address, far(), &|| false, &mut |_, _, _, _| {}) {
        Err((0, FetchError::NoStaging)) => {}
        other => panic!("a fetch after the panic: {other:?}"),
    }
}

/// Retires `node`'s staging area, as a layer left in flight would (`DataPlane::with_staging`).
fn retire_staging(node: &Node) {
    let mut turn = node.plane.staging.take(far(), &|| false).ok().unwrap();
    assert!(turn.area().take().is_some_and(Staging::retire), "the idle staging area's queue pairs were not deleted");
}

#[test]
fn a_holder_whose_staging_area_is_retired_is_passed_over() {
    // Goal: a holder whose staging area was retired (a device timeout) refuses every read of
    // its segments (ReadFailed) until it restarts. That is its own trouble: another replica's
    // disks and staging area are independent, so the refusal lets the asker try the next
    // holder listed. Before, only NotHeld, busy and unreachable holders were passed over, and
    // askers whose hash ranked the retired node first failed every fetch of those segments.
    let (asker, holder) = asker_and_holder(PeerBounds::default());
    retire_staging(&holder.node);
    match fetch(&asker, &holder, far()) {
        Err((0, error)) => {
            assert!(
                matches!(&error, FetchError::Peer { source, .. } if matches!(**source, PeerError::Refused { code: FailureCode::ReadFailed, .. })),
                "{error}"
            );
            assert!(error.another_holder_may_serve(), "a holder with a retired staging area is not passed over: {error}");
        }
        other => panic!("a fetch from a holder with a retired staging area: {other:?}"),
    }
    assert_eq!(lock(&asker.store).control.counts().cached_blocks, 0);
    assert_eq!(holder.node.metrics.served_segments.get(), 0);
}

#[test]
fn an_asker_whose_staging_area_is_retired_fails_before_asking_a_holder() {
    // Goal: an asker whose own staging area was retired cannot store a byte: its fetch fails
    // NoStaging at once, before it connects. Before, it read the whole segment over the
    // network (the holder's disks, staging area and link busy for it, the read counted served
    // toward a replica) and only then failed.
    let (asker, holder) = asker_and_holder(PeerBounds::default());
    retire_staging(&asker);
    match fetch(&asker, &holder, far()) {
        Err((0, FetchError::NoStaging)) => {}
        other => panic!("a fetch by an asker with a retired staging area: {other:?}"),
    }
    wait_for("the holder's connection (if any) ends", Duration::from_secs(5), || holder.node.plane.peers.load(Ordering::Acquire) == 0);
    assert_eq!(holder.node.metrics.served_segments.get(), 0, "the holder sent a segment the asker could not store");
    assert!(!FetchError::NoStaging.another_holder_may_serve(), "the asker's own trouble meets every holder");
}

#[test]
fn a_stopped_holder_refuses_connections_while_its_peer_threads_finish() {
    // Goal: once the daemon stops, its data address refuses connections (ECONNREFUSED: askers
    // pass the node over at once) within a few ticks, even while a peer thread is still in a
    // slow read (a disk answering 1.5 s late: the layer in flight at the stop is finished).
    // Before, the listener stayed open until every peer thread was joined (up to a segment's
    // send): the kernel accepted connections into a backlog nobody accepted from, and each
    // asker waited out its stall bound for a header.
    let node = node(8, 16, 32 << 20, PeerBounds::default());
    put(&node, 1, 0);
    let geometry = node.plane.geometry;
    let device = lock(&node.store).emulators[0].clone().expect("an emulated device");
    let holder = serve(node);
    let address = holder.node.plane.address();
    device.set_faults(nvme_emu::FaultPlan {
        rules: vec![nvme_emu::FaultRule::every_nth_io(1, nvme_emu::FaultAction::Delay(Duration::from_millis(1500)))],
    });
    let io_commands = || device.stats().io_commands.values().sum::<u64>();
    let before = io_commands();
    let mut frame = Vec::new();
    ReadSegment { space: space(), index: 0, geometry, keys: keys(1, 1) }.encode(&mut frame);
    let mut stream = connect(&holder);
    stream.write_all(&frame).unwrap();
    let (kind, _) = read_frame(&mut stream).expect("a segment header");
    assert_eq!(kind, PeerKind::SegmentHeader as u16);
    // Stopped only once the read's first layer is on the device: a stop before it would end
    // the read before any layer, within a millisecond, and leave no peer thread to outlive it.
    wait_for("the read's first layer is issued", Duration::from_secs(5), || io_commands() > before);
    holder.node.stop.stop();
    let stopped = Instant::now();
    // Asked every 20 ms until refused (on a loaded machine the accept thread may wake late):
    // the refusal must come while the slow read's layer (1.5 s) is still in flight. A connect
    // accepted before the accept loop saw the stop is dropped at once; its peer thread ends as
    // it reads that close (not at the drain, which peer threads meet only once the listener is
    // closed), within the 20 ms before the next connect, so it is not counted: the slow read
    // is the only peer thread that can last.
    let refused_with_peers = loop {
        match TcpStream::connect_timeout(&address, Duration::from_secs(2)) {
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => {
                break holder.node.plane.peers.load(Ordering::Acquire);
            }
            Err(error) => panic!("a connect {:?} after the stop: {error}", stopped.elapsed()),
            Ok(stream) => drop(stream),
        }
        assert!(stopped.elapsed() < Duration::from_secs(5), "connects were still accepted 5 s after the stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(refused_with_peers >= 1, "refused only once the slow read ended ({:?} after the stop)", stopped.elapsed());
    // The slow read itself ends at the drain within the layer in flight (not all 8 layers,
    // 12 s), answered `Unavailable` where the first block was due.
    let (code, message) = failure(&mut stream);
    assert_eq!(code, FailureCode::Unavailable, "{message}");
    assert!(stopped.elapsed() < Duration::from_millis(3000), "the read ran {:?} past the drain", stopped.elapsed());
    device.set_faults(nvme_emu::FaultPlan::default());
}

#[test]
fn faults_are_told_from_waits_and_limits() {
    // Goal: a later run's failure is counted (`remote_read_failures`) when it is a fault — a
    // holder's bad CRC or frame, its close or error mid-answer, its ReadFailed, this node's
    // store or staging area — and not when it is a wait or a limit (the holder unreachable,
    // stalling, busy, no longer holding the segment; this node's fetch limit, the drain).
    let address: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let peer = |source: PeerError| FetchError::Peer { node: "n".into(), address, segment: 2, source: Box::new(source) };
    let io = |context| PeerError::Io { context, source: std::io::Error::from(std::io::ErrorKind::ConnectionReset) };
    let refused = |code| PeerError::Refused { code, message: String::new() };
    for fault in [
        peer(PeerError::Checksum { index: 7, sent: 1, computed: 2 }),
        peer(PeerError::Garbage("frame magic".into())),
        peer(PeerError::Closed { context: "reading a block" }),
        peer(io("reading a block")),
        peer(refused(FailureCode::ReadFailed)),
        peer(refused(FailureCode::BadRequest)),
        FetchError::NoStaging,
    ] {
        assert!(fault.is_fault(), "{fault}");
    }
    for load in [
        peer(io("connecting")),
        peer(PeerError::Stalled { context: "waiting for the segment header", waited: Duration::from_secs(2) }),
        peer(refused(FailureCode::NotHeld)),
        peer(refused(FailureCode::Unavailable)),
        FetchError::Busy { max: 4 },
        FetchError::HolderBusy { node: "n".into(), address, segment: 2, waited: Duration::from_secs(60), message: String::new() },
        FetchError::StagingBusy,
        FetchError::Stopped,
        FetchError::Store { segment: 2, source: Box::new(ObjstoreError::PoolFull { needed: 16, evictable: 0 }) },
        FetchError::Store { segment: 2, source: Box::new(ObjstoreError::TooManyRequests { max: 32 }) },
    ] {
        assert!(!load.is_fault(), "{load}");
    }
    // Not asked again in a later run: only a holder unreachable or busy, not one whose answer
    // was about the earlier run's segments.
    assert!(peer(io("connecting")).holder_unreachable());
    assert!(FetchError::HolderBusy { node: "n".into(), address, segment: 2, waited: Duration::from_secs(60), message: String::new() }
        .holder_unreachable());
    for answered in
        [refused(FailureCode::NotHeld), refused(FailureCode::ReadFailed), PeerError::Checksum { index: 0, sent: 1, computed: 2 }]
    {
        assert!(!peer(answered).holder_unreachable());
    }
    // A stall once the answer began (mid-header, between blocks) is the holder's trouble with
    // this read, not its absence: neither passed over nor skipped later.
    for begun in ["receiving the segment header", "receiving a block"] {
        let stalled = peer(PeerError::Stalled { context: begun, waited: Duration::from_secs(2) });
        assert!(!stalled.another_holder_may_serve() && !stalled.holder_unreachable(), "{stalled}");
    }
}

/// The emulator's host-side DMA allocator, refusing (and counting) allocations over `cap`
/// bytes: a controller's rings and a pool's metadata buffers are far below it, a staging area
/// of blocks over `peer::BLOCK_BYTES_MAX` far above.
struct CappedDma {
    inner: Arc<dyn nvme_driver::DmaAllocator>,
    cap: usize,
    refused: AtomicUsize,
}

impl nvme_driver::DmaAllocator for CappedDma {
    fn allocate(&self, len: usize) -> Result<nvme_driver::DmaRegion, nvme_driver::HwError> {
        if len > self.cap {
            self.refused.fetch_add(1, Ordering::AcqRel);
            return Err(nvme_driver::HwError::Backend { backend: "test", message: format!("{len} bytes refused (over {})", self.cap) });
        }
        self.inner.allocate(len)
    }

    // Unsafe to call by the trait; this one performs no unsafe operation (as session/tests.rs's
    // `SlowMapping`): nothing here maps external memory, so it refuses rather than forwards.
    #[allow(unsafe_code)]
    unsafe fn map_external(&self, _host: *mut u8, _len: usize) -> Result<nvme_driver::DmaRegion, nvme_driver::HwError> {
        Err(nvme_driver::HwError::Backend { backend: "test", message: "map_external is not offered".into() })
    }

    fn translate(&self, iova: nvme_driver::Iova, len: usize) -> Result<nvme_driver::DmaRegion, nvme_driver::HwError> {
        self.inner.translate(iova, len)
    }

    fn address_space(&self) -> nvme_driver::AddressSpaceId {
        self.inner.address_space()
    }
}

/// An emulated device whose host side allocates through a [`CappedDma`].
struct CappedDevice {
    device: Arc<EmuDevice>,
    dma: Arc<CappedDma>,
}

impl nvme_driver::DeviceBackend for CappedDevice {
    fn name(&self) -> String {
        nvme_driver::DeviceBackend::name(&*self.device)
    }

    fn registers(&self) -> Arc<dyn nvme_driver::RegisterIo> {
        nvme_driver::DeviceBackend::registers(&*self.device)
    }

    fn dma(&self) -> Arc<dyn nvme_driver::DmaAllocator> {
        Arc::clone(&self.dma) as Arc<dyn nvme_driver::DmaAllocator>
    }

    fn function_reset(&self) -> Result<(), nvme_driver::HwError> {
        nvme_driver::DeviceBackend::function_reset(&*self.device)
    }
}

#[test]
fn blocks_over_the_largest_the_data_plane_moves_are_refused_before_the_staging_area_is_made() {
    // Goal: a pool whose blocks pass peer::BLOCK_BYTES_MAX (256 MiB; here 258 MiB: 129 layers of
    // 1 MiB objects) is refused by bind before its staging area (segment blocks x block bytes of
    // DMA memory, 4 GiB here, populated at allocation; an executor and queue pairs) is made:
    // the allocator is never asked for it. Before, bind allocated it, then refused the block size.
    let geometry = ModelGeometry { layers: 129, kv_heads: 8, head_dim: 4096, dtype_bytes: 2, block_tokens: 16 };
    assert!(geometry.block_bytes() > peer::BLOCK_BYTES_MAX);
    // Lazily committed: only what the format writes costs memory.
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 1 << 30 }).with_namespaces(vec![NamespaceConfig::new(4096, None)]);
    let device = EmuDevice::start(config).unwrap();
    let dma = Arc::new(CappedDma { inner: nvme_driver::DeviceBackend::dma(&*device), cap: 64 << 20, refused: AtomicUsize::new(0) });
    let backend = Arc::new(CappedDevice { device: Arc::clone(&device), dma: Arc::clone(&dma) });
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).unwrap());
    let targets = vec![PoolTarget { controller, namespace: NamespaceId(1) }];
    let params = FormatParams { slot_count_max: Some(2), ..FormatParams::new(geometry) };
    format_pool(&targets, &params).unwrap();
    let (pool, _) = Pool::open(targets, Some(&geometry)).unwrap();
    let control = StoreControl::new(pool, 16).unwrap();
    let outcome =
        DataPlane::bind(BoundAddress::bind("127.0.0.1:0".parse().unwrap()).unwrap(), &control, SegmentBlocks::new(SEGMENT).unwrap(), 16);
    let refused = dma.refused.load(Ordering::Acquire);
    match outcome {
        Err(error) => assert!(error.to_string().contains("at most"), "{error}"),
        Ok(_) => panic!("a data plane over blocks of {} bytes was bound", geometry.block_bytes()),
    }
    assert_eq!(refused, 0, "the staging area's memory was asked for before the block size was checked");
}
