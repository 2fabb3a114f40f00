//! A client's request slots and the daemon's: tuttid numbers requests across every session
//! (one control half, `clients_max × requests per session` slots), while each engine
//! process's data half holds only its own `StoreConfig::requests_max`. A client whose
//! `requests_max` is smaller than the daemon's slot numbers must still take the daemon's
//! handles, and refuse past its own count with a typed error, not a stale-handle one.

use std::path::Path;
use std::time::Instant;

use gio_uring::SmBudget;
use objstore::{KvRequest, LayerKvStore, ObjstoreError, RequestHandle, StoreConfig, StorePlan};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};

mod common;
use common::{hello, pattern_byte, prompt, Daemon, WAIT};

/// Blocks each prompt stores.
const BLOCKS: usize = 2;
/// The clients' own request slots: fewer than the daemon's numbers reach.
const REQUESTS_MAX: usize = 2;

fn connect(socket: &Path, name: &str) -> RemoteKvStore {
    let config = RemoteConfig {
        kv_blocks: 3 * BLOCKS as u32,
        store: StoreConfig { requests_max: REQUESTS_MAX, ..StoreConfig::default() },
        ..RemoteConfig::default()
    };
    RemoteKvStore::connect(socket, &hello(0, 1, name), &config).expect("attach a remote store")
}

/// Writes prompt `seed`'s blocks into engine blocks `first..first + BLOCKS` and prepares
/// their store (the blocks are read when the layers move: two stores prepared at once need
/// blocks of their own).
fn prepare_store(store: &mut RemoteKvStore, seed: u32, first: u32) -> Result<StorePlan, ObjstoreError> {
    let tokens = prompt(seed, BLOCKS, store.hello_reply().shape.block_tokens);
    let block_bytes = store.block_bytes() as usize;
    for block in 0..BLOCKS {
        let bytes: Vec<u8> = (0..block_bytes).map(|offset| pattern_byte(seed, 0, block, offset)).collect();
        store.write_block(first + block as u32, 0, &bytes)?;
    }
    let block_ids: Vec<u32> = (first..first + BLOCKS as u32).collect();
    store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &block_ids })
}

/// Moves every layer of a prepared request, in `direction`'s call.
fn move_layers(store: &mut RemoteKvStore, handle: RequestHandle, retrieve: bool) {
    let deadline = Instant::now() + WAIT;
    for layer in 0..store.hello_reply().shape.layers {
        if retrieve {
            store.retrieve_layer(handle, layer, SmBudget(1)).expect("retrieve_layer");
        } else {
            store.store_layer(handle, layer, SmBudget(1)).expect("store_layer");
        }
        assert_eq!(store.wait(handle, deadline).expect("wait"), Some(layer));
    }
}

/// Retrieves prompt `seed` into engine blocks 2·BLOCKS..3·BLOCKS (cleared first) and returns
/// how many bytes differ from its pattern.
fn retrieve_and_compare(store: &mut RemoteKvStore, seed: u32) -> usize {
    let tokens = prompt(seed, BLOCKS, store.hello_reply().shape.block_tokens);
    let block_bytes = store.block_bytes() as usize;
    let block_ids: Vec<u32> = (2 * BLOCKS as u32..3 * BLOCKS as u32).collect();
    for &block in &block_ids {
        store.write_block(block, 0, &vec![0u8; block_bytes]).unwrap();
    }
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &block_ids }).expect("prepare the retrieve");
    move_layers(store, handle, true);
    store.finish(handle).expect("finish the retrieve");
    let mut wrong = 0;
    let mut bytes = vec![0u8; block_bytes];
    for (prompt_block, &engine_block) in block_ids.iter().enumerate() {
        store.read_block(engine_block, 0, &mut bytes).unwrap();
        wrong += bytes.iter().enumerate().filter(|&(offset, &byte)| byte != pattern_byte(seed, 0, prompt_block, offset)).count();
    }
    wrong
}

#[test]
fn a_client_with_few_request_slots_takes_the_daemons_higher_handles() {
    // Goal: with client A holding both of its request slots (the daemon's slots 0 and 1),
    // client B (also `requests_max = 2`) is handed daemon slot 2 or above and still stores
    // and retrieves its blocks byte for byte; the handle B sees is the daemon's. A third
    // request on A is refused as too many (and released at the daemon: B's requests after it
    // still get slots), A's two stores then commit, and a finished handle is unknown after.
    let directory = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(directory.path(), "emu:mem:64m", &["--format"]);
    let mut a = connect(&daemon.socket, "client-a");
    let mut b = connect(&daemon.socket, "client-b");

    let first = prepare_store(&mut a, 1, 0).expect("A's first store");
    let second = prepare_store(&mut a, 2, BLOCKS as u32).expect("A's second store");
    // Into blocks neither prepared store reads: its bytes are written before the refusal.
    match prepare_store(&mut a, 3, 2 * BLOCKS as u32) {
        Err(ObjstoreError::TooManyRequests { max }) => assert_eq!(max, REQUESTS_MAX),
        other => panic!("a third request on a client with {REQUESTS_MAX} slots: expected TooManyRequests, got {other:?}"),
    }

    let plan = prepare_store(&mut b, 4, 0).expect("B's store, on a daemon slot past B's own count");
    assert!(plan.handle.to_bits() >> 32 >= REQUESTS_MAX as u64, "B sees the daemon's handle: {:#x}", plan.handle.to_bits());
    assert_eq!(plan.new_blocks, BLOCKS);
    move_layers(&mut b, plan.handle, false);
    assert_eq!(b.commit_store(plan.handle).expect("B's commit"), BLOCKS);
    assert_eq!(retrieve_and_compare(&mut b, 4), 0, "B's blocks came back different");

    for plan in [first, second] {
        move_layers(&mut a, plan.handle, false);
        assert_eq!(a.commit_store(plan.handle).expect("A's commit"), BLOCKS);
    }
    assert_eq!(retrieve_and_compare(&mut a, 1), 0, "A's first prompt came back different");
    assert_eq!(retrieve_and_compare(&mut a, 2), 0, "A's second prompt came back different");
    match a.store_layer(first.handle, 0, SmBudget(1)) {
        Err(ObjstoreError::UnknownHandle { handle }) => assert_eq!(handle, first.handle.to_bits()),
        other => panic!("a committed handle: expected UnknownHandle, got {other:?}"),
    }
    // Both slots of A are free again: a new request takes one.
    let again = prepare_store(&mut a, 5, 0).expect("A's store after its slots were freed");
    a.finish(again.handle).expect("finish an unmoved store");
    drop(daemon);
}
