//! A daemon whose prepare replies do not match the request: a real daemon (an in-memory
//! software controller, in a thread) behind a proxy that forwards every frame, descriptors
//! included, and rewrites the next `RetrievePrepared` or `StorePrepared` as a test asks. The
//! client must refuse such a reply (its placements would move other requests' KV blocks, or
//! leave some of the request's blocks unfilled while reporting success). The proxy can also
//! answer `AttachQueues` or `RegisterMemory` itself with `Busy` (what the daemon says while an
//! ended session's queue deletion is not confirmed yet, or while other sessions hold the request
//! reservations a first registration needs), which the client must ask again within its
//! timeout. Every
//! wait is bounded.

use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use gio_uring::SmBudget;
use objstore::{KvRequest, LayerKvStore, ModelGeometry, ObjstoreError, RequestHandle};

use super::store_refusals::ServedPool;
use super::{RemoteConfig, RemoteKvStore};
use crate::frame_io::{read_frame, write_frame_with_fds, ReadOutcome};
use crate::protocol::ErrorCode;
use crate::protocol::{encode_frame, Hello, Kind, Reply};

/// The longest any wait here takes before the test fails.
const WAIT: Duration = Duration::from_secs(10);
/// The proxy's read tick (a chance to see its deadline).
const TICK: Duration = Duration::from_millis(50);
/// Engine KV blocks of the test's store, and the layers of its model.
const KV_BLOCKS: u32 = 8;
const LAYERS: u32 = 2;
const BLOCK_TOKENS: u32 = 16;

/// Rewrites one prepare reply: decoded, or its raw body (which then need not decode).
enum Tamper {
    Reply(RewriteReply),
    Body(RewriteBody),
}
type RewriteReply = Box<dyn FnOnce(&mut Reply) + Send>;
type RewriteBody = Box<dyn FnOnce(&mut Vec<u8>) + Send>;

/// The proxy's own answers to `AttachQueues`: `Busy` while `remaining` is above 0 (each
/// answer takes one), the request then not forwarded; `answered` counts them.
#[derive(Default)]
struct BusyAttaches {
    remaining: AtomicU32,
    /// As `remaining`, for `RegisterMemory` (a first registration short of its reservations).
    registrations: AtomicU32,
    answered: AtomicU32,
}

/// A daemon in a thread behind a proxy; `tamper` rewrites the next prepare reply, `busy`
/// answers attaches.
struct TamperingDaemon {
    proxy_socket: PathBuf,
    tamper: Arc<Mutex<Option<Tamper>>>,
    busy: Arc<BusyAttaches>,
    /// Held to stop the daemon when the test ends; dropped last, the proxy's socket lying in
    /// its directory.
    _daemon: ServedPool,
}

impl TamperingDaemon {
    fn start() -> TamperingDaemon {
        let geometry = ModelGeometry { layers: LAYERS, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: BLOCK_TOKENS };
        let daemon = ServedPool::start(geometry, None);
        let daemon_socket = daemon.socket.clone();
        let proxy_socket = daemon.directory().join("proxy.sock");
        let listener = UnixListener::bind(&proxy_socket).unwrap();
        let tamper: Arc<Mutex<Option<Tamper>>> = Arc::new(Mutex::new(None));
        let replies_tamper = Arc::clone(&tamper);
        let busy = Arc::new(BusyAttaches::default());
        let requests_busy = Arc::clone(&busy);
        // One connection: the test's store.
        thread::spawn(move || {
            let Some(client) = accept_within(&listener, WAIT) else { return };
            let daemon = UnixStream::connect(&daemon_socket).unwrap();
            for stream in [&client, &daemon] {
                stream.set_read_timeout(Some(TICK)).unwrap();
                stream.set_write_timeout(Some(WAIT)).unwrap();
            }
            let (requests_from, requests_to) = (client.try_clone().unwrap(), daemon.try_clone().unwrap());
            let requests = thread::spawn(move || forward(&requests_from, &requests_to, Tampering::Attaches(&requests_busy)));
            forward(&daemon, &client, Tampering::Prepared(&replies_tamper));
            let _ = requests.join();
        });
        TamperingDaemon { proxy_socket, tamper, busy, _daemon: daemon }
    }

    /// Rewrites the next `RetrievePrepared` or `StorePrepared` with `tamper`.
    fn tamper_next(&self, tamper: impl FnOnce(&mut Reply) + Send + 'static) {
        *self.tamper.lock().unwrap() = Some(Tamper::Reply(Box::new(tamper)));
    }

    /// Rewrites the raw body of the next `RetrievePrepared` or `StorePrepared` with `tamper`
    /// (sent under the same kind and id).
    fn tamper_next_body(&self, tamper: impl FnOnce(&mut Vec<u8>) + Send + 'static) {
        *self.tamper.lock().unwrap() = Some(Tamper::Body(Box::new(tamper)));
    }

    /// Answers the next `attaches` AttachQueues with Busy itself.
    fn busy_next(&self, attaches: u32) {
        self.busy.remaining.store(attaches, Ordering::Release);
    }

    /// Answers the next `registrations` RegisterMemory with Busy itself.
    fn busy_registrations_next(&self, registrations: u32) {
        self.busy.registrations.store(registrations, Ordering::Release);
    }

    fn store(&self) -> RemoteKvStore {
        self.connect(RemoteConfig::default().timeout).expect("attach through the proxy")
    }

    fn connect(&self, timeout: Duration) -> Result<RemoteKvStore, ObjstoreError> {
        let hello = Hello { model_fingerprint: [0x5b; 32], tp_rank: 0, tp_world: 1, client_name: "tampered".into() };
        let config = RemoteConfig { kv_blocks: KV_BLOCKS, timeout, ..RemoteConfig::default() };
        RemoteKvStore::connect(&self.proxy_socket, &hello, &config)
    }
}

fn accept_within(listener: &UnixListener, wait: Duration) -> Option<UnixStream> {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).unwrap();
                return Some(stream);
            }
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => thread::sleep(Duration::from_millis(5)),
            Err(error) => panic!("accepting the store's connection: {error}"),
        }
    }
    None
}

/// What a forwarding direction may change.
#[derive(Clone, Copy)]
enum Tampering<'a> {
    /// Replies: the next prepare reply passes through the tamper set, if any.
    Prepared(&'a Mutex<Option<Tamper>>),
    /// Requests: an `AttachQueues` may be answered Busy (back on `from`) instead of forwarded.
    Attaches(&'a BusyAttaches),
}

/// Copies frames (with their descriptors) from `from` to `to` until either side closes or
/// fails, changing what `tampering` says.
fn forward(from: &UnixStream, to: &UnixStream, tampering: Tampering<'_>) {
    let (mut body, mut fds, mut frame) = (Vec::new(), Vec::new(), Vec::new());
    let never = || false;
    loop {
        let header = match read_frame(from, &mut body, &mut fds, Instant::now() + WAIT, WAIT, &never) {
            Ok(ReadOutcome::Frame(header)) => header,
            Ok(ReadOutcome::Idle) => continue,
            _ => break,
        };
        if let Tampering::Attaches(busy) = tampering {
            let remaining = match header.kind {
                Kind::AttachQueues => Some(&busy.remaining),
                Kind::RegisterMemory => Some(&busy.registrations),
                _ => None,
            };
            let refuse = remaining
                .is_some_and(|remaining| remaining.fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| left.checked_sub(1)).is_ok());
            if refuse {
                // The client waits for this reply before its next request: the reply direction
                // writes nothing to it meanwhile.
                let reply = Reply::error(ErrorCode::Busy, "the proxy's Busy: an ended session's queue deletion is pending; retry");
                encode_frame(&mut frame, reply.kind(), header.request_id, |out| reply.encode_body(out)).unwrap();
                busy.answered.fetch_add(1, Ordering::AcqRel);
                if write_frame_with_fds(from, &frame, &[]).is_err() {
                    break;
                }
                continue;
            }
        }
        let prepared = matches!(header.kind, Kind::RetrievePrepared | Kind::StorePrepared);
        let tamper = match tampering {
            Tampering::Prepared(tamper) if prepared => tamper.lock().unwrap().take(),
            _ => None,
        };
        // A rewrite may change the reply's kind too (under the same request id).
        let mut kind = header.kind;
        match tamper {
            Some(Tamper::Reply(rewrite)) => {
                let mut reply = Reply::decode(header.kind, &body).unwrap();
                rewrite(&mut reply);
                kind = reply.kind();
                body.clear();
                reply.encode_body(&mut body);
            }
            Some(Tamper::Body(rewrite)) => rewrite(&mut body),
            None => {}
        }
        encode_frame(&mut frame, kind, header.request_id, |out| out.extend_from_slice(&body)).unwrap();
        let attached: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
        if write_frame_with_fds(to, &frame, &attached).is_err() {
            break;
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

fn tokens() -> Vec<u32> {
    (0..4 * BLOCK_TOKENS).collect()
}

/// Stores blocks 0..4 of `tokens()` from engine blocks 0..4, honestly answered.
fn store_four_blocks(store: &mut RemoteKvStore) {
    let tokens = tokens();
    let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1, 2, 3] }).expect("prepare_store");
    for layer in 0..LAYERS {
        store.store_layer(plan.handle, layer, SmBudget(1)).unwrap();
        store.wait(plan.handle, Instant::now() + WAIT).unwrap();
    }
    assert_eq!(store.commit_store(plan.handle).unwrap(), 4);
}

/// Retrieves blocks 0..4 into engine blocks 4..8, honestly answered: the daemon still serves
/// the session after the refusals before (nothing was left reserved that blocks it).
fn retrieve_four_blocks(store: &mut RemoteKvStore) {
    let tokens = tokens();
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[4, 5, 6, 7] }).expect("prepare_retrieve");
    read_all_layers(store, handle);
    store.finish(handle).expect("finish");
}

fn read_all_layers(store: &mut RemoteKvStore, handle: RequestHandle) {
    for layer in 0..LAYERS {
        store.retrieve_layer(handle, layer, SmBudget(1)).unwrap();
        store.wait(handle, Instant::now() + WAIT).unwrap();
    }
}

fn retrieve_placements(reply: &mut Reply) -> &mut Vec<objstore::Placement> {
    match reply {
        Reply::RetrievePrepared(prepared) => &mut prepared.placements,
        other => panic!("expected RetrievePrepared, got {:?}", other.kind()),
    }
}

fn store_prepared(reply: &mut Reply) -> &mut crate::protocol::StorePrepared {
    match reply {
        Reply::StorePrepared(prepared) => prepared,
        other => panic!("expected StorePrepared, got {:?}", other.kind()),
    }
}

#[test]
fn retrieve_placements_that_do_not_match_the_request_are_refused() {
    // Goal: a RetrievePrepared whose placements name an engine block the request did not
    // (another sequence's KV memory), or fewer blocks than asked (some left unfilled while
    // the retrieve "succeeds"), or CRCs of another count, is an error, and the request is
    // released at the daemon: the same session retrieves normally afterwards.
    let daemon = TamperingDaemon::start();
    let mut store = daemon.store();
    store_four_blocks(&mut store);
    let tokens = tokens();
    let request = KvRequest { tokens: &tokens, block_ids: &[4, 5, 6, 7] };

    daemon.tamper_next(|reply| retrieve_placements(reply)[1].engine_block = 0);
    let outcome = store.prepare_retrieve(&request);
    assert!(matches!(outcome, Err(ObjstoreError::Remote { .. })), "a placement into engine block 0: {outcome:?}");

    daemon.tamper_next(|reply| {
        retrieve_placements(reply).pop();
    });
    let outcome = store.prepare_retrieve(&request);
    assert!(matches!(outcome, Err(ObjstoreError::Remote { .. })), "three placements for four blocks: {outcome:?}");

    daemon.tamper_next(|reply| retrieve_placements(reply).swap(0, 1));
    let outcome = store.prepare_retrieve(&request);
    assert!(matches!(outcome, Err(ObjstoreError::Remote { .. })), "placements out of the request's order: {outcome:?}");

    daemon.tamper_next(|reply| match reply {
        Reply::RetrievePrepared(prepared) => prepared.expected_crcs = Some(vec![1, 2]),
        other => panic!("expected RetrievePrepared, got {:?}", other.kind()),
    });
    let outcome = store.prepare_retrieve(&request);
    assert!(matches!(outcome, Err(ObjstoreError::Remote { .. })), "two CRCs for four placements: {outcome:?}");

    retrieve_four_blocks(&mut store);
}

#[test]
fn store_replies_that_do_not_match_the_request_are_refused() {
    // Goal: a StorePrepared whose new and shared blocks do not add up to the request's, or
    // whose placements name an engine block the request did not, is an error, and the
    // reservation is released at the daemon: the same blocks store normally afterwards.
    let daemon = TamperingDaemon::start();
    let mut store = daemon.store();
    let tokens = tokens();
    let request = KvRequest { tokens: &tokens, block_ids: &[0, 1, 2, 3] };
    daemon.tamper_next(|reply| store_prepared(reply).shared_blocks += 1);
    let outcome = store.prepare_store(&request);
    assert!(matches!(outcome, Err(ObjstoreError::Remote { .. })), "five blocks for a four-block request: {outcome:?}");

    daemon.tamper_next(|reply| store_prepared(reply).placements[2].engine_block = 6);
    let outcome = store.prepare_store(&request);
    assert!(matches!(outcome, Err(ObjstoreError::Remote { .. })), "a placement from engine block 6: {outcome:?}");

    store_four_blocks(&mut store);
    retrieve_four_blocks(&mut store);
}

#[test]
fn a_reply_of_a_kind_that_does_not_answer_the_request_is_a_lost_connection() {
    // Goal: a PrepareStore answered under its own id with a reply of another kind (Pong) is a
    // daemon out of step with the protocol: the store reports the connection lost
    // (`RemoteFailed { Disconnected }`: reconnect) and its client refuses every later call,
    // rather than an `ObjstoreError::Remote` that leaves the store using that daemon.
    let daemon = TamperingDaemon::start();
    let mut store = daemon.store();
    let tokens = tokens();
    daemon.tamper_next(|reply| *reply = Reply::Pong);
    let outcome = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1, 2, 3] });
    match outcome {
        Err(ObjstoreError::RemoteFailed { failure: objstore::RemoteFailure::Disconnected { code: None }, reason }) => {
            assert!(reason.contains("Pong") && reason.contains("PrepareStore"), "{reason}")
        }
        other => panic!("a PrepareStore answered Pong: {other:?}"),
    }
    assert!(store.client().is_broken(), "the connection is still taken as in step");
}

#[test]
fn a_reply_that_does_not_decode_is_a_lost_connection() {
    // Goal: a StorePrepared whose body is cut short (3 bytes) fails to decode: the client
    // cannot tell where the next frame of a daemon that sends such bodies begins, so it leaves
    // the connection out of step, and the store reports it lost (`RemoteFailed { Disconnected }`:
    // reconnect), as it does a reply of a kind that does not answer the request, rather than
    // `ObjstoreError::Remote`, which the Python package takes for a daemon error on a live
    // connection.
    let daemon = TamperingDaemon::start();
    let mut store = daemon.store();
    let tokens = tokens();
    daemon.tamper_next_body(|body| body.truncate(body.len() - 3));
    let outcome = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1, 2, 3] });
    match outcome {
        Err(ObjstoreError::RemoteFailed { failure: objstore::RemoteFailure::Disconnected { code: None }, reason }) => {
            assert!(reason.contains("StorePrepared"), "{reason}")
        }
        other => panic!("a StorePrepared cut 3 bytes short: {other:?}"),
    }
    assert!(store.client().is_broken(), "the connection is still taken as in step");
}

#[test]
fn a_handle_already_held_is_refused_without_releasing_the_live_request() {
    // Goal: a daemon answering a prepare with the handle of a request this process already
    // holds gets an error, and that live request is not released (its layers may still move
    // data): it reads its layers and finishes at the daemon as usual.
    let daemon = TamperingDaemon::start();
    let mut store = daemon.store();
    store_four_blocks(&mut store);
    let tokens = tokens();
    let live = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[4, 5, 6, 7] }).expect("the live retrieve");
    let held = live.to_bits();
    daemon.tamper_next(move |reply| match reply {
        Reply::RetrievePrepared(prepared) => prepared.handle = held,
        other => panic!("expected RetrievePrepared, got {:?}", other.kind()),
    });
    let outcome = store.prepare_retrieve(&KvRequest { tokens: &tokens[..2 * BLOCK_TOKENS as usize], block_ids: &[0, 1] });
    assert!(matches!(outcome, Err(ObjstoreError::HandleState { .. })), "a handle already held: {outcome:?}");
    read_all_layers(&mut store, live);
    store.finish(live).expect("the live request is still the daemon's: its release is accepted");
}

#[test]
fn a_prompt_too_long_to_look_up_is_a_miss_warned_once() {
    // Goal: a prompt of more tokens than one Lookup frame carries (262,142) is answered a miss
    // (the engine computes it), the connection stays usable, and the warning is logged once
    // per store, not at every lookup of every long prompt.
    let daemon = TamperingDaemon::start();
    let mut store = daemon.store();
    let long = vec![1u32; 262_143];
    for _ in 0..3 {
        assert_eq!(store.lookup_from(&long, 0), 0);
    }
    assert_eq!(store.lookup_warnings, 1);
    assert_eq!(store.lookup_from(&tokens(), 0), 0, "the connection is still usable");
    store_four_blocks(&mut store);
    retrieve_four_blocks(&mut store);
}

#[test]
fn an_attach_answered_busy_is_asked_again() {
    // Goal: an AttachQueues answered Busy (the daemon's word for an ended session's queue
    // deletion not confirmed yet, which frees the ids and the admin queue by itself) is asked
    // again on the same connection and registration, and the store then works; nothing is
    // left of the refused attempt (the refusal came before the daemon saw the request).
    let daemon = TamperingDaemon::start();
    daemon.busy_next(2);
    let mut store = daemon.store();
    assert_eq!(daemon.busy.answered.load(Ordering::Acquire), 2, "the Busy answers");
    store_four_blocks(&mut store);
    retrieve_four_blocks(&mut store);
}

#[test]
fn a_registration_answered_busy_is_asked_again() {
    // Goal: a first registration answered Busy (the daemon's word for a session short of its
    // request reservations while ended or live sessions hold them) is asked again on the same
    // connection, the window's descriptor sent again, and the store then works.
    let daemon = TamperingDaemon::start();
    daemon.busy_registrations_next(2);
    let mut store = daemon.store();
    assert_eq!(daemon.busy.answered.load(Ordering::Acquire), 2, "the Busy answers");
    store_four_blocks(&mut store);
    retrieve_four_blocks(&mut store);
}

#[test]
fn an_attach_busy_past_the_timeout_fails_saying_busy() {
    // Goal: an attach answered Busy every time is asked again only until the store's timeout
    // has passed (bounded: never a wait for ever), then fails as the daemon's Busy refusal
    // (a caller classifying by code sees Busy), saying it asked more than once.
    let daemon = TamperingDaemon::start();
    daemon.busy_next(u32::MAX);
    let timeout = Duration::from_secs(1);
    let started = Instant::now();
    let outcome = daemon.connect(timeout);
    let waited = started.elapsed();
    match outcome {
        Err(ObjstoreError::RemoteFailed { failure: objstore::RemoteFailure::Refused { code }, reason }) => {
            assert_eq!(ErrorCode::from_u16(code), ErrorCode::Busy, "{reason}");
            assert!(reason.contains("AttachQueues") && reason.contains("retry"), "{reason}");
        }
        Err(other) => panic!("an attach busy past its timeout: {other:?}"),
        Ok(_) => panic!("an attach busy past its timeout succeeded"),
    }
    let answered = daemon.busy.answered.load(Ordering::Acquire);
    assert!(answered > 1, "asked {answered} time(s)");
    assert!(waited >= timeout / 2, "gave up after {waited:?}, before the timeout of {timeout:?}");
    assert!(waited < timeout + Duration::from_secs(3), "asked again for {waited:?}, past the timeout of {timeout:?}");
}
