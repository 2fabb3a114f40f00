//! The KV memory of a client's window in each layout an engine may use as its KV cache in place
//! (`WindowKvLayout`): stored through one layout, retrieved through another, byte-exact (a
//! block is its layers' K and V in order, whatever the layout); the daemon's typed refusals
//! and a lost daemon reach the client classified (`ObjstoreError::RemoteFailed`).

use std::time::{Duration, Instant};

use gio_uring::SmBudget;
use objstore::{KvRequest, LayerKvStore, ObjstoreError, RemoteFailure};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore, WindowKvLayout};
use tutti_daemon::{Client, ErrorCode};

mod common;
use common::{hello, Daemon, WAIT};

const BLOCKS: u32 = 4;
const LAYOUTS: [WindowKvLayout; 4] =
    [WindowKvLayout::BlockMajor, WindowKvLayout::SeparateKv, WindowKvLayout::FusedPerLayer, WindowKvLayout::PagedPerLayer];

fn byte(seed: u32, block: u32, offset: usize) -> u8 {
    let mixed = (offset as u32).wrapping_mul(0x9E37_79B1) ^ block.wrapping_mul(0x85EB_CA6B) ^ seed.wrapping_mul(0xC2B2_AE35);
    (mixed >> 11) as u8 ^ mixed as u8
}

fn layers_of(store: &mut RemoteKvStore) -> u32 {
    store.data_mut().shape().geometry.layers
}

#[test]
fn every_window_layout_round_trips_through_every_other() {
    // Goal: for each layout, a client stores a prompt from engine blocks it filled through
    // `write_block`, and a client of the next layout retrieves it into other engine blocks and
    // reads the same bytes through `read_block`; the regions are as many and as large as the
    // layout says, and lie in the window back to back (page aligned).
    let directory = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(directory.path(), "emu:mem:64m", &["--format"]);
    let config = RemoteConfig { kv_blocks: 2 * BLOCKS, ..RemoteConfig::default() };
    for (turn, &layout) in LAYOUTS.iter().enumerate() {
        let seed = turn as u32 + 1;
        let mut writer = RemoteKvStore::connect_with_layout(&daemon.socket, &hello(0, 1, "writer"), &config, layout).unwrap();
        assert_eq!(writer.kv_layout(), layout);
        let layers = layers_of(&mut writer);
        let geometry = writer.data_mut().shape().geometry;
        let expected_regions = match layout {
            WindowKvLayout::BlockMajor => 1,
            WindowKvLayout::SeparateKv => 2 * layers as usize,
            WindowKvLayout::FusedPerLayer | WindowKvLayout::PagedPerLayer => layers as usize,
        };
        let regions = writer.kv_regions();
        assert_eq!(regions.len(), expected_regions, "{layout:?}");
        let total: usize = regions.iter().map(|region| region.len()).sum();
        assert_eq!(total as u64, u64::from(2 * BLOCKS) * geometry.block_bytes(), "{layout:?}: the regions hold exactly the KV blocks");
        assert!(regions.windows(2).all(|pair| pair[0].iova().0 + pair[0].len() as u64 == pair[1].iova().0), "back to back");
        let block_bytes = writer.block_bytes() as usize;
        let tokens: Vec<u32> = (0..BLOCKS * geometry.block_tokens).map(|token| token.wrapping_mul(2_654_435_761) ^ seed).collect();
        for block in 0..BLOCKS {
            let bytes: Vec<u8> = (0..block_bytes).map(|offset| byte(seed, block, offset)).collect();
            writer.write_block(block, 0, &bytes).unwrap();
        }
        let sources: Vec<u32> = (0..BLOCKS).collect();
        let plan = writer.prepare_store(&KvRequest { tokens: &tokens, block_ids: &sources }).unwrap();
        assert_eq!(writer.placements(plan.handle).unwrap().len(), BLOCKS as usize);
        for layer in 0..layers {
            writer.store_layer(plan.handle, layer, SmBudget(1)).unwrap();
            writer.wait(plan.handle, Instant::now() + WAIT).unwrap();
        }
        assert_eq!(writer.commit_store(plan.handle).unwrap(), BLOCKS as usize);
        drop(writer);

        let next = LAYOUTS[(turn + 1) % LAYOUTS.len()];
        let mut reader = RemoteKvStore::connect_with_layout(&daemon.socket, &hello(0, 1, "reader"), &config, next).unwrap();
        assert_eq!(reader.lookup(&tokens), BLOCKS as usize);
        let targets: Vec<u32> = (BLOCKS..2 * BLOCKS).rev().collect();
        let handle = reader.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &targets }).unwrap();
        for layer in 0..layers {
            reader.retrieve_layer(handle, layer, SmBudget(1)).unwrap();
            reader.wait(handle, Instant::now() + WAIT).unwrap();
        }
        reader.finish(handle).unwrap();
        for (block, &target) in targets.iter().enumerate() {
            let mut found = vec![0u8; block_bytes];
            reader.read_block(target, 0, &mut found).unwrap();
            let wrong = (0..block_bytes).filter(|&offset| found[offset] != byte(seed, block as u32, offset)).count();
            assert_eq!(wrong, 0, "stored as {layout:?}, retrieved as {next:?}: block {block} has {wrong} wrong bytes");
        }
        // Engine blocks outside the registration and bytes past a block are refused.
        assert!(matches!(reader.write_block(2 * BLOCKS, 0, &[0]), Err(ObjstoreError::BlockOutOfRange { .. })));
        assert!(matches!(reader.read_block(0, block_bytes, &mut [0]), Err(ObjstoreError::BadRequest { .. })));
    }
    daemon.terminate();
}

#[test]
fn daemon_failures_reach_the_store_classified() {
    // Goal: a refusal carries the daemon's code (another session's handle: NotYours; a store
    // of more blocks than the pool holds: LimitReached), and a daemon that is gone is
    // `Disconnected`, not an unclassified error.
    let directory = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(directory.path(), "emu:mem:8m", &["--format", "--slots", "16"]);
    let config = RemoteConfig { kv_blocks: 64, ..RemoteConfig::default() };
    let mut store = RemoteKvStore::connect(&daemon.socket, &hello(0, 1, "classified"), &config).unwrap();
    let block_tokens = store.data_mut().shape().geometry.block_tokens;
    let tokens: Vec<u32> = (0..64 * block_tokens).collect();
    let blocks: Vec<u32> = (0..64).collect();
    match store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &blocks }) {
        Err(ObjstoreError::RemoteFailed { failure: RemoteFailure::Refused { code }, reason }) => {
            assert_eq!(ErrorCode::from_u16(code), ErrorCode::LimitReached, "{reason}");
            assert!(reason.contains("pool full"), "{reason}");
        }
        other => panic!("expected a LimitReached refusal, got {other:?}"),
    }
    let foreign = objstore::RequestHandle::from_bits(0x7777_0000_0001);
    match store.finish(foreign) {
        // The data half refuses a handle it never prepared before anything is sent.
        Err(ObjstoreError::UnknownHandle { .. }) => {}
        other => panic!("expected UnknownHandle, got {other:?}"),
    }
    let mut client = Client::connect(&daemon.socket, Duration::from_secs(5)).unwrap();
    client.hello(&hello(0, 1, "other")).unwrap();
    let (status, _) = daemon.terminate();
    assert!(status.success());
    let failure = match store.prepare_store(&KvRequest { tokens: &tokens[..block_tokens as usize], block_ids: &[0] }) {
        Err(ObjstoreError::RemoteFailed { failure, .. }) => failure,
        other => panic!("expected the daemon gone, got {other:?}"),
    };
    // The goodbye (ShuttingDown) when the client read it before the close, no code otherwise.
    let goodbye = Some(ErrorCode::ShuttingDown.to_u16());
    assert!(matches!(failure, RemoteFailure::Disconnected { code } if code.is_none() || code == goodbye), "{failure:?}");
}
