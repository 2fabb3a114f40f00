//! Stores `RemoteKvStore` refuses itself, before a `PrepareStore` reaches the daemon: the
//! daemon's reservation may evict cached blocks (their headers synced Empty), which releasing
//! it does not bring back, so a store the client's data half would refuse after it must not be
//! sent. A real daemon (an in-memory software controller, in a thread) on a pool of four
//! one-block slots, all committed before each test's refusal. Every wait is bounded.

use std::path::{Path, PathBuf};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use gio_uring::SmBudget;
use objstore::{FormatParams, KvRequest, LayerKvStore, ModelGeometry, ObjstoreError, StoreConfig};
use tutti_devices::{DeviceKind, DeviceSpec};

use super::{RemoteConfig, RemoteKvStore};
use crate::pool_open::{open_pool, PoolOptions};
use crate::protocol::{Hello, PoolStatus};
use crate::{Client, Server, ServerConfig, StopHandle};

/// The longest any wait here takes before the test fails.
const WAIT: Duration = Duration::from_secs(10);
/// The pool's slots (one block each).
const SLOTS: u32 = 4;

/// A daemon in a thread, its configuration the default but for its pool: one in-memory
/// device formatted with `geometry` in one-block slots, at most `slot_count_max` of them. Also
/// the daemon of the sibling `tampered_replies` tests. Dropping it stops the daemon (a bounded
/// wait), then removes its directory.
pub(super) struct ServedPool {
    pub(super) socket: PathBuf,
    stop: StopHandle,
    served: Option<JoinHandle<()>>,
    directory: tempfile::TempDir,
}

impl ServedPool {
    pub(super) fn start(geometry: ModelGeometry, slot_count_max: Option<u64>) -> ServedPool {
        let directory = tempfile::tempdir().unwrap();
        let options = PoolOptions {
            specs: vec![DeviceSpec::parse("emu:mem:64m", &DeviceKind::ALL).unwrap()],
            namespace: 1,
            emu_lba_bytes: 4096,
            emu_create_bytes: None,
            format: Some(FormatParams { slot_count_max, ..FormatParams::new(geometry) }),
            overwrite: false,
            lock_dir: directory.path().join("locks"),
            client_queue_pairs: 4,
            emu_doorbell_relay: false,
        };
        let opened = open_pool(&options).expect("open the pool");
        let socket = directory.path().join("tuttid.sock");
        let server = Server::bind(ServerConfig::new(socket.clone()), opened).expect("bind");
        let stop = server.stop_handle();
        let served = thread::spawn(move || {
            let _ = server.serve();
        });
        ServedPool { socket, stop, served: Some(served), directory }
    }

    /// The daemon's directory (its socket, its locks): a place for a test's own sockets.
    pub(super) fn directory(&self) -> &Path {
        self.directory.path()
    }
}

impl Drop for ServedPool {
    fn drop(&mut self) {
        self.stop.stop();
        let deadline = Instant::now() + WAIT;
        while self.served.as_ref().is_some_and(|served| !served.is_finished()) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
        if let Some(served) = self.served.take().filter(JoinHandle::is_finished) {
            let _ = served.join();
        }
    }
}

/// The tests' daemon: a pool of [`SLOTS`] slots.
struct SmallPool {
    daemon: ServedPool,
}

impl SmallPool {
    fn start() -> SmallPool {
        let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        SmallPool { daemon: ServedPool::start(geometry, Some(u64::from(SLOTS))) }
    }

    fn connect(&self, name: &str, store: StoreConfig) -> RemoteKvStore {
        let hello = Hello { model_fingerprint: [0x5c; 32], tp_rank: 0, tp_world: 1, client_name: name.into() };
        let config = RemoteConfig { kv_blocks: 16, store, ..RemoteConfig::default() };
        RemoteKvStore::connect(&self.daemon.socket, &hello, &config).expect("attach")
    }

    fn pool(&self) -> PoolStatus {
        Client::connect(&self.daemon.socket, WAIT).expect("connect").status().expect("status").pool
    }
}

/// Prompt `p` of the tests: one block of 16 tokens of its own.
fn prompt(p: u32) -> Vec<u32> {
    (p * 1000..p * 1000 + 16).collect()
}

/// Stores and commits prompts 0..SLOTS from engine blocks 0..SLOTS: the pool is full.
fn fill_the_pool(daemon: &SmallPool, store: &mut RemoteKvStore) {
    for p in 0..SLOTS {
        let tokens = prompt(p);
        let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[p] }).expect("prepare_store");
        for layer in 0..2 {
            store.store_layer(plan.handle, layer, SmBudget(1)).expect("store_layer");
            store.wait(plan.handle, Instant::now() + WAIT).expect("wait");
        }
        store.commit_store(plan.handle).expect("commit_store");
    }
    assert_eq!(daemon.pool().free_slots, 0);
}

/// Every prompt stored by [`fill_the_pool`] is still cached.
fn all_prompts_found(store: &mut RemoteKvStore) {
    for p in 0..SLOTS {
        assert_eq!(store.lookup(&prompt(p)), 1, "prompt {p} was lost to a refused store");
    }
}

#[test]
fn a_store_past_the_clients_request_slots_is_refused_before_the_daemon_reserves() {
    // Goal: the client's request slots (`StoreConfig::requests_max`) may be fewer than the
    // daemon's per session (32 by default). A store with every client slot taken was sent, the
    // daemon reserved it (evicting a cached prompt on a full pool), and then the client refused
    // it (TooManyRequests): each refused store cost a cached prompt, and vLLM's worker relies
    // on refusals past requests_max. Two client slots, both held by prepared retrieves: the
    // store is refused without a request sent, nothing evicted.
    let daemon = SmallPool::start();
    let mut store = daemon.connect("two slots", StoreConfig { requests_max: 2, iocbs: 64, ..StoreConfig::default() });
    fill_the_pool(&daemon, &mut store);
    let before = daemon.pool();
    let reads: Vec<_> =
        (0..2).map(|p| store.prepare_retrieve(&KvRequest { tokens: &prompt(p), block_ids: &[8 + p] }).expect("prepare_retrieve")).collect();
    let sent = store.requests_sent();
    let tokens = prompt(50);
    match store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[10] }) {
        Err(ObjstoreError::TooManyRequests { max: 2 }) => {}
        other => panic!("expected TooManyRequests, got {other:?}"),
    }
    assert_eq!(store.requests_sent(), sent, "the refused store reached the daemon");
    let after = daemon.pool();
    assert_eq!(after.evictions, before.evictions, "{after:?}");
    all_prompts_found(&mut store);
    // Once a slot is free, the same store goes ahead (evicting the LRU tail, prompt 2).
    let mut reads = reads.into_iter();
    store.finish(reads.next().unwrap()).expect("finish a retrieve");
    let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[10] }).expect("prepare_store");
    assert_eq!((plan.new_blocks, plan.evicted_slots), (1, 1));
    store.finish(plan.handle).expect("finish the store");
    store.finish(reads.next().unwrap()).expect("finish a retrieve");
}

#[test]
fn a_malformed_store_is_a_bad_request_even_with_no_slot_or_iocb_free() {
    // Goal: the client's refusals before sending (no request slot free, fewer IOCBs free than
    // the store could take) are for stores the daemon would reserve. A malformed store (more
    // block ids than full blocks, an engine block named twice or past the registration) was
    // refused NoFreeIocb or TooManyRequests while those were short, where objstore's KvStore
    // (and the daemon) says BadRequest, which is what the engine must see: the request is
    // wrong, not early. Such a store goes to the daemon, which refuses it before reserving.
    // Both request slots and both IOCBs held; then one slot free, the IOCBs still held.
    malformed_stores_are_bad_requests(StoreConfig { requests_max: 2, iocbs: 2, ..StoreConfig::default() }, |refused| {
        matches!(refused, ObjstoreError::TooManyRequests { max: 2 })
    });
    malformed_stores_are_bad_requests(StoreConfig { requests_max: 3, iocbs: 2, ..StoreConfig::default() }, |refused| {
        matches!(refused, ObjstoreError::Gio(gio_uring::GioError::NoFreeIocb { .. }))
    });
}

/// Two prepared retrieves on a full pool, with `config`: malformed stores are the daemon's
/// BadRequest, and a well-formed one is refused here as `refused_here` says, nothing sent.
fn malformed_stores_are_bad_requests(config: StoreConfig, refused_here: impl Fn(&ObjstoreError) -> bool) {
    let daemon = SmallPool::start();
    let mut store = daemon.connect("malformed", config);
    fill_the_pool(&daemon, &mut store);
    let before = daemon.pool();
    let reads: Vec<_> =
        (0..2).map(|p| store.prepare_retrieve(&KvRequest { tokens: &prompt(p), block_ids: &[8 + p] }).expect("prepare_retrieve")).collect();
    let one_block = prompt(50);
    let two_blocks: Vec<u32> = (50_000..50_032).collect();
    let malformed: [(&str, &[u32], &[u32]); 3] = [
        ("more block ids than full blocks", &one_block, &[10, 11]),
        ("an engine block named twice", &two_blocks, &[10, 10]),
        ("an engine block past the registration", &one_block, &[16]),
    ];
    let bad_request = crate::protocol::ErrorCode::BadRequest.to_u16();
    for (what, tokens, block_ids) in malformed {
        match store.prepare_store(&KvRequest { tokens, block_ids }) {
            Err(ObjstoreError::RemoteFailed { failure: objstore::RemoteFailure::Refused { code }, .. }) if code == bad_request => {}
            other => panic!("{what}: expected the daemon's BadRequest, got {other:?}"),
        }
    }
    // A well-formed store is still refused here, before the daemon reserves.
    let sent = store.requests_sent();
    match store.prepare_store(&KvRequest { tokens: &two_blocks, block_ids: &[10, 11] }) {
        Err(refused) if refused_here(&refused) => {}
        other => panic!("expected a refusal before sending, got {other:?}"),
    }
    assert_eq!(store.requests_sent(), sent, "the refused store reached the daemon");
    let after = daemon.pool();
    assert_eq!(after.evictions, before.evictions, "{after:?}");
    all_prompts_found(&mut store);
    for read in reads {
        store.finish(read).expect("finish a retrieve");
    }
}
