//! A block whose bytes changed on the device behind the daemon's back, retrieved through
//! tuttid: the client's verification (the payload CRC the pool recorded at commit) fails with
//! a typed error naming the block, the client reports it at release, and the daemon, which
//! holds the index, evicts it: no client's lookup finds it any more, and after a restart
//! neither (its header was made Empty on disk). A client that reports corruption of blocks it
//! did not retrieve is refused and nothing is evicted. The daemon is the `tuttid` binary over
//! an `emu:PATH` file; this test process is its client and, between commit and retrieve,
//! corrupts the file.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use gio_uring::SmBudget;
use objstore::{KvRequest, LayerKvStore, MismatchedBlock, ObjstoreError, StoreConfig, Transferred};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::protocol::{Prepare, Reply, Request, RetrievePrepared};
use tutti_daemon::{DaemonError, ErrorCode};

mod common;
use common::{hello, pattern_byte, prompt, retrieve_prompt, store_prompt, Daemon, WAIT};

const BLOCKS: usize = 4;
const SEED: u32 = 5;
/// The prompt block whose bytes are corrupted on the device.
const CORRUPT: usize = 2;

/// A client that verifies every retrieve against the recorded CRCs.
fn verifying(socket: &Path, name: &str) -> RemoteKvStore {
    let store = StoreConfig { verify_retrieves: true, ..StoreConfig::default() };
    let config = RemoteConfig { kv_blocks: 2 * BLOCKS as u32, store, ..RemoteConfig::default() };
    RemoteKvStore::connect(socket, &hello(0, 1, name), &config).expect("attach a verifying remote store")
}

/// A retrieve of the prompt's first `blocks` blocks prepared with raw requests (the client's
/// data half is not told), to see its placements or to report on it.
fn raw_retrieve(store: &mut RemoteKvStore, blocks: usize) -> RetrievePrepared {
    let tokens = prompt(SEED, BLOCKS, store.hello_reply().shape.block_tokens);
    let prepare = Prepare { registration: store.registration(), tokens, block_ids: (0..blocks as u32).collect(), first_block: 0 };
    match store.client().call(&Request::PrepareRetrieve(prepare)).unwrap() {
        Reply::RetrievePrepared(prepared) => prepared,
        other => panic!("{other:?}"),
    }
}

fn release(store: &mut RemoteKvStore, handle: u64, corrupt_blocks: Vec<MismatchedBlock>) -> Result<Reply, DaemonError> {
    store.client().call(&Request::Release { handle, transferred: Transferred::default(), corrupt_blocks })
}

#[test]
fn a_block_corrupted_on_the_device_is_refused_by_the_client_and_evicted_by_the_daemon() {
    // Goal: the retrieve's last wait fails with PayloadMismatch naming exactly the corrupted
    // block, the other blocks arrive byte-exact, the daemon accepts the report and evicts the
    // block (every client's lookup then stops before it, and a restarted daemon's too); reports
    // naming blocks a request did not retrieve (another position, another slot, a CRC that
    // matched, a store) are refused with BadReport and evict nothing.
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("pool.img");
    let device = format!("emu:{}", image.display());
    let daemon = Daemon::start(directory.path(), &device, &["--format", "--payload-crc", "--emu-create-bytes", "64m"]);
    let mut writer = verifying(&daemon.socket, "writer");
    assert_eq!(store_prompt(&mut writer, SEED, 0, BLOCKS).unwrap(), BLOCKS);

    // Where the block lives on the device: its placement, then the file offset of its layer 0.
    let placements = raw_retrieve(&mut writer, BLOCKS);
    release(&mut writer, placements.handle, Vec::new()).unwrap();
    let placement = placements.placements[CORRUPT];
    let shape = writer.data_mut().shape().clone();
    let layout = &shape.devices[usize::from(placement.location.device)];
    let lba = layout.addressing.block_lba(placement.location.slot, u32::from(placement.location.index));
    let offset = lba * u64::from(layout.lba_bytes);
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&image).unwrap();
    let mut bytes = [0u8; 64];
    file.read_exact_at(&mut bytes, offset).unwrap();
    let stored: Vec<u8> = (0..bytes.len()).map(|at| pattern_byte(SEED, 0, CORRUPT, at)).collect();
    assert_eq!(&bytes[..], &stored[..], "the committed block is on the file at {offset}");
    for byte in &mut bytes {
        *byte ^= 0xFF;
    }
    file.write_all_at(&bytes, offset).unwrap();
    file.sync_data().unwrap();

    // A verifying client retrieves the prompt: the mismatch, named; nothing else wrong.
    let mut reader = verifying(&daemon.socket, "reader");
    let tokens = prompt(SEED, BLOCKS, reader.hello_reply().shape.block_tokens);
    assert_eq!(reader.lookup(&tokens), BLOCKS);
    let block_ids: Vec<u32> = (BLOCKS as u32..2 * BLOCKS as u32).collect();
    let handle = reader.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &block_ids }).unwrap();
    let layers = reader.hello_reply().shape.layers;
    let deadline = Instant::now() + WAIT;
    for layer in 0..layers - 1 {
        reader.retrieve_layer(handle, layer, SmBudget(1)).unwrap();
        assert_eq!(reader.wait(handle, deadline).unwrap(), Some(layer));
    }
    reader.retrieve_layer(handle, layers - 1, SmBudget(1)).unwrap();
    match reader.wait(handle, deadline) {
        Err(ObjstoreError::PayloadMismatch { blocks, .. }) => {
            assert_eq!(blocks.len(), 1, "{blocks:?}");
            let block = blocks[0];
            assert_eq!((block.position, block.engine_block, block.slot), (CORRUPT, block_ids[CORRUPT], placement.location.slot));
        }
        other => panic!("the corrupted block was handed out: {other:?}"),
    }
    assert!(matches!(reader.poll(handle), Err(ObjstoreError::PayloadMismatch { .. })), "the failure is sticky");
    let block_bytes = reader.block_bytes() as usize;
    let mut received = vec![0u8; block_bytes];
    for prompt_block in (0..BLOCKS).filter(|&block| block != CORRUPT) {
        reader.read_block(block_ids[prompt_block], 0, &mut received).unwrap();
        let wrong = received.iter().enumerate().filter(|&(at, &byte)| byte != pattern_byte(SEED, 0, prompt_block, at)).count();
        assert_eq!(wrong, 0, "prompt block {prompt_block}");
    }
    reader.finish(handle).expect("the daemon accepts the report");

    // Evicted: no client finds it; the prefix before it is still served exactly.
    let mut fresh = daemon.client();
    fresh.hello(&hello(0, 1, "fresh")).unwrap();
    assert_eq!(fresh.lookup(&tokens).unwrap() as usize, CORRUPT);
    assert_eq!(reader.lookup(&tokens), CORRUPT);
    assert_eq!(writer.lookup(&tokens), CORRUPT);
    assert_eq!(retrieve_prompt(&mut reader, SEED, 0, CORRUPT).unwrap(), 0, "the blocks before it are intact");
    let status = daemon.client().status().unwrap();
    assert_eq!(status.pool.cached_blocks, BLOCKS as u64 - 1, "{:?}", status.pool);

    // Lies: a retrieve of the first two blocks reporting blocks it did not retrieve.
    let mut liar = verifying(&daemon.socket, "liar");
    let prepared = raw_retrieve(&mut liar, CORRUPT);
    let own = prepared.placements[0];
    let honest = MismatchedBlock {
        position: 0,
        engine_block: own.engine_block,
        device: own.location.device,
        slot: own.location.slot,
        expected_crc: 1,
        computed_crc: 2,
    };
    let last = placements.placements[BLOCKS - 1].location;
    for lie in [
        MismatchedBlock { position: BLOCKS - 1, slot: last.slot, ..honest },
        MismatchedBlock { slot: last.slot, ..honest },
        MismatchedBlock { engine_block: own.engine_block + 1, ..honest },
        MismatchedBlock { computed_crc: 1, ..honest },
    ] {
        match release(&mut liar, prepared.handle, vec![lie]) {
            Err(DaemonError::Remote { code: ErrorCode::BadReport, message }) => eprintln!("refused: {message}"),
            other => panic!("{lie:?} was not refused: {other:?}"),
        }
    }
    let store_tokens = prompt(SEED + 1, BLOCKS, liar.hello_reply().shape.block_tokens);
    let prepare = Prepare { registration: liar.registration(), tokens: store_tokens, block_ids: vec![0], first_block: 0 };
    let Reply::StorePrepared(store) = liar.client().call(&Request::PrepareStore(prepare)).unwrap() else { panic!("prepare store") };
    match release(&mut liar, store.handle, vec![honest]) {
        Err(DaemonError::Remote { code: ErrorCode::BadReport, message }) => assert!(message.contains("not a retrieve"), "{message}"),
        other => panic!("a store's corruption report was not refused: {other:?}"),
    }
    release(&mut liar, store.handle, Vec::new()).unwrap();
    release(&mut liar, prepared.handle, Vec::new()).unwrap();
    assert_eq!(fresh.lookup(&tokens).unwrap() as usize, CORRUPT, "the refused reports evicted nothing");
    assert_eq!(daemon.client().status().unwrap().pool.cached_blocks, BLOCKS as u64 - 1);
    drop((writer, reader, liar, fresh));

    // The eviction reached the disk: a restarted daemon does not serve the block either.
    let (exit, stderr) = daemon.terminate();
    assert!(exit.success(), "{exit}: {stderr}");
    let restarted = Daemon::start(directory.path(), &device, &[]);
    let mut client = restarted.client();
    client.hello(&hello(0, 1, "after-restart")).unwrap();
    assert_eq!(client.lookup(&tokens).unwrap() as usize, CORRUPT);
}
