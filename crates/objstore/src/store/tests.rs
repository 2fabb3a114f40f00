//! The control and data halves used apart, in one process, on the software controller: the
//! way tuttid (control) and an engine process (data) will use them, minus the socket.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::{CpuExecutor, GioError, SmBudget};
use nvme_driver::hw::DeviceBackend;
use nvme_driver::{Controller, ControllerConfig, DataPointerMode, DmaAllocator, DmaRegion, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};

use super::*;
use crate::error::KvKind;
use crate::hash::{block_keys, KeyChain, KeySecret};
use crate::index::BlockLocation;
use crate::pool::{format_pool, FormatParams, NoLender, PoolTarget, METADATA_TIMEOUT};
use crate::registration::KvLayout;
use crate::ModelGeometry;

/// 4 layers, 4 KiB objects: 32 KiB per block.
fn geometry() -> ModelGeometry {
    ModelGeometry { layers: 4, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 }
}

const BUDGET: SmBudget = SmBudget(1);
const ENGINE_BLOCKS: u32 = 16;
/// A key space other than the in-process store's (tuttid seeds one per session).
const SEED: u64 = 0x5EED;

/// The key secret the fixture's pool is formatted with, so the tests can compute its keys.
fn test_secret() -> KeySecret {
    KeySecret::from_bytes([0x5e; 32]).expect("a non-zero secret")
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

struct Fixture {
    device: Arc<EmuDevice>,
    targets: Vec<PoolTarget>,
    /// Engine memory: one block-major region in the controller's DMA space.
    region: DmaRegion,
    registration: KvRegistration,
    dma: Arc<dyn DmaAllocator>,
}

/// A formatted pool (k blocks per slot, at most `slots` slots) on one software controller,
/// and engine memory in its DMA space.
fn fixture(k: u32, slots: Option<u64>) -> Fixture {
    fixture_on(EmuConfig::default(), k, slots)
}

/// [`fixture`] on a software controller built from `config` (a queue-pair grant, say).
fn fixture_on(config: EmuConfig, k: u32, slots: Option<u64>) -> Fixture {
    let config = config.with_backing(Backing::Memory { bytes: 64 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let device = EmuDevice::start(config).expect("software controller");
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"));
    let targets = vec![PoolTarget { controller: controller.clone(), namespace: NamespaceId(1) }];
    let params = FormatParams {
        blocks_per_slot: k,
        slot_count_max: slots,
        payload_crc: true,
        key_secret: Some(test_secret()),
        ..FormatParams::new(geometry())
    };
    format_pool(&targets, &params).expect("format");
    let dma = controller.dma().clone();
    let g = geometry();
    let region = dma.allocate((g.block_bytes() * u64::from(ENGINE_BLOCKS)) as usize).expect("engine memory");
    let layout = KvLayout::BlockMajor { base: region.iova(), block_stride_bytes: g.block_bytes() };
    let registration = KvRegistration::new(g, ENGINE_BLOCKS, layout, DataPointerMode::Prp).expect("registration");
    Fixture { device, targets, region, registration, dma }
}

/// Opens the pool and builds the two halves apart: the control half gets the pool, the data
/// half only the pool's shape (as tuttid would send it).
fn halves(fixture: &Fixture, config: StoreConfig) -> (StoreControl, StoreData<CpuExecutor>) {
    let (pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("open");
    assert!(!pool.metadata_queue_shared(0), "the pool keeps its own metadata queue pair: the control half needs no lender");
    let shape = pool.shape().expect("shape");
    let executor = cpu_executor_for(&pool, 64, &config).expect("executor");
    let control = StoreControl::new(pool, config.requests_max).expect("control");
    let data = StoreData::new(shape, fixture.registration.clone(), fixture.dma.clone(), executor, config).expect("data");
    (control, data)
}

/// The bytes of object (layer, kind) of the block with `key`.
fn pattern(key: u64, layer: u32, kind: KvKind) -> Vec<u8> {
    let object = geometry().object_bytes() as usize;
    let salt = key ^ (u64::from(layer) << 8) ^ u64::from(kind == KvKind::Value);
    (0..object).map(|i| (salt.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left((i % 61) as u32) >> 7) as u8 ^ i as u8).collect()
}

fn object(fixture: &Fixture, layer: u32, kind: KvKind, block: u32) -> DmaRegion {
    let address = fixture.registration.object_address(layer, kind, block).unwrap();
    fixture.dma.translate(address, geometry().object_bytes() as usize).unwrap()
}

fn fill(fixture: &Fixture, block: u32, key: u64) {
    for layer in 0..geometry().layers {
        for kind in [KvKind::Key, KvKind::Value] {
            object(fixture, layer, kind, block).write(0, &pattern(key, layer, kind)).unwrap();
        }
    }
}

fn holds(fixture: &Fixture, block: u32, key: u64) -> bool {
    let mut found = vec![0u8; geometry().object_bytes() as usize];
    (0..geometry().layers).all(|layer| {
        [KvKind::Key, KvKind::Value].into_iter().all(|kind| {
            object(fixture, layer, kind, block).read(0, &mut found).unwrap();
            found == pattern(key, layer, kind)
        })
    })
}

/// The keys of `tokens` in the space `SEED` of the fixture's pool (keyed with its secret).
fn keys_of(tokens: &[u32]) -> Vec<u64> {
    keys_in(SEED, tokens)
}

/// The keys of `tokens` in the space `seed` of the fixture's pool.
fn keys_in(seed: u64, tokens: &[u32]) -> Vec<u64> {
    let mut keys = Vec::new();
    block_keys(&KeyChain::new(&test_secret(), seed), tokens, geometry().block_tokens, &mut keys);
    keys
}

fn tokens(first: u32, blocks: usize) -> Vec<u32> {
    (0..blocks as u32 * geometry().block_tokens).map(|i| first.wrapping_mul(7919).wrapping_add(i)).collect()
}

/// Stores `keys` from `blocks` through both halves, all layers; returns the handle, ready to
/// commit.
fn store_layers(control: &mut StoreControl, data: &mut StoreData<CpuExecutor>, keys: &[u64], blocks: &[u32]) -> RequestHandle {
    let plan = control.reserve_store(keys, blocks, &mut NoLender).expect("reserve_store");
    data.prepare(plan.handle, Direction::Store, control.placements(plan.handle).unwrap(), None).expect("prepare store");
    for layer in 0..geometry().layers {
        data.store_layer(plan.handle, layer, BUDGET).expect("store_layer");
        assert_eq!(data.wait(plan.handle, deadline()).expect("wait"), Some(layer));
    }
    plan.handle
}

#[test]
fn the_halves_apart_store_commit_look_up_and_retrieve_byte_exact() {
    // Goal: a control half that never sees engine memory and a data half that never sees the
    // pool, meeting only in handles, placements, the pool shape and CRCs, store three blocks
    // (k = 2: one slot and a half), commit them durably with the CRCs the data half computed,
    // find them by their seeded keys, and bring them back byte for byte into other engine
    // blocks, verified against those CRCs; after a reopen the blocks are still there.
    let fixture = fixture(2, None);
    let config = StoreConfig { verify_retrieves: true, requests_max: 4, ..StoreConfig::default() };
    let (mut control, mut data) = halves(&fixture, config);
    let tokens = tokens(1, 3);
    let keys = keys_of(&tokens);
    let sources = [3, 4, 9];
    for (&block, &key) in sources.iter().zip(&keys) {
        fill(&fixture, block, key);
    }
    assert_eq!(control.lookup(&keys), 0);
    let handle = store_layers(&mut control, &mut data, &keys, &sources);
    assert_eq!(control.lookup(&keys), 0, "nothing is visible before commit");
    let mut crcs = Vec::new();
    data.payload_crcs(handle, &mut crcs).expect("payload CRCs");
    assert_eq!(control.commit_store(handle, Some(&crcs), &mut NoLender).expect("commit"), 3);
    data.finish(handle).expect("finish the data path");
    assert_eq!(control.lookup(&keys), 3);
    assert_eq!(control.lookup(&keys_in(0, &tokens)), 0, "another key space does not see them");

    let targets = [12, 1, 7];
    for &block in &targets {
        object(&fixture, 0, KvKind::Key, block).fill(0, geometry().object_bytes() as usize, 0xEE).unwrap();
    }
    let handle = control.reserve_retrieve(&keys, &targets, 0).expect("reserve_retrieve");
    let mut expected = Vec::new();
    control.recorded_payload_crcs(handle, &mut expected).expect("recorded CRCs");
    assert_eq!(expected, crcs, "the CRCs recorded are the ones the data half computed");
    data.prepare(handle, Direction::Retrieve, control.placements(handle).unwrap(), Some(&expected)).expect("prepare retrieve");
    for layer in 0..geometry().layers {
        data.retrieve_layer(handle, layer, BUDGET).expect("retrieve_layer");
        assert_eq!(data.wait(handle, deadline()).expect("wait, verified at the last layer"), Some(layer));
    }
    for (&block, &key) in targets.iter().zip(&keys) {
        assert!(holds(&fixture, block, key), "engine block {block} holds its key's bytes");
    }
    data.finish(handle).unwrap();
    control.release(handle).unwrap();
    assert!(data.close(), "every queue pair deleted");
    drop(control.into_pool());
    let (reopened, report) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("reopen");
    assert_eq!((report.cached_blocks, reopened.index().cached_prefix(&keys)), (3, 3), "durable across a reopen");
}

#[test]
fn the_data_half_counts_what_each_request_moved_as_the_controller_saw_it() {
    // Goal: `StoreData::transferred` (what a tuttid client reports at commit and release) is
    // exactly the bytes and NVMe commands the controller executed for the request's layers,
    // counts each layer once (a layer
    // issued again adds nothing, though the controller runs it again), reaches the bytes of
    // the shape's `transfer_bound` for the request when every layer completed, and starts from zero at
    // every prepare; a report over the bound, or claiming commands without their bytes, does
    // not fit.
    use nvme_driver::spec::NvmOpcode;
    let fixture = fixture(2, None);
    let config = StoreConfig { requests_max: 2, ..StoreConfig::default() };
    let (mut control, mut data) = halves(&fixture, config);
    let shape = control.pool().shape().unwrap();
    let keys = keys_of(&tokens(6, 3));
    for (block, &key) in keys.iter().enumerate() {
        fill(&fixture, block as u32, key);
    }
    let before = fixture.device.stats();
    let plan = control.reserve_store(&keys, &[0, 1, 2], &mut NoLender).unwrap();
    let placements = control.placements(plan.handle).unwrap().to_vec();
    data.prepare(plan.handle, Direction::Store, &placements, None).unwrap();
    assert_eq!(data.transferred(plan.handle).unwrap(), Transferred::default(), "nothing moved before a layer");
    for layer in 0..geometry().layers {
        data.store_layer(plan.handle, layer, BUDGET).unwrap();
        data.wait(plan.handle, deadline()).unwrap();
    }
    let stored = data.transferred(plan.handle).unwrap();
    let after = fixture.device.stats();
    let executed = Transferred {
        bytes: after.bytes_written - before.bytes_written,
        commands: after.io(NvmOpcode::Write) - before.io(NvmOpcode::Write),
    };
    assert_eq!(stored, executed, "the count is what the controller executed");
    assert_eq!(stored.bytes, 3 * geometry().block_bytes());
    assert!(stored.commands >= u64::from(geometry().layers), "at least one command per layer");
    let bound = shape.transfer_bound(&placements);
    assert_eq!(stored.bytes, bound.bytes, "every layer once: the bound's bytes (its commands are one per LBA, the most possible)");
    assert!(stored.fits(bound, shape.command_bytes()));
    data.store_layer(plan.handle, 0, BUDGET).unwrap();
    data.wait(plan.handle, deadline()).unwrap();
    assert_eq!(data.transferred(plan.handle).unwrap(), stored, "a layer issued again is counted once");
    let mut crcs = Vec::new();
    data.payload_crcs(plan.handle, &mut crcs).unwrap();
    control.commit_store(plan.handle, Some(&crcs), &mut NoLender).unwrap();
    data.finish(plan.handle).unwrap();

    let handle = control.reserve_retrieve(&keys[..2], &[5, 6], 0).unwrap();
    let placements = control.placements(handle).unwrap().to_vec();
    data.prepare(handle, Direction::Retrieve, &placements, None).unwrap();
    let before = fixture.device.stats();
    data.retrieve_layer(handle, 0, BUDGET).unwrap();
    data.wait(handle, deadline()).unwrap();
    let after = fixture.device.stats();
    let one_layer = data.transferred(handle).unwrap();
    assert_eq!(one_layer.bytes, after.bytes_read - before.bytes_read);
    assert_eq!(one_layer.commands, after.io(NvmOpcode::Read) - before.io(NvmOpcode::Read));
    assert_eq!(one_layer.bytes, 2 * 2 * geometry().object_bytes(), "one layer: K and V of two blocks");
    let bound = shape.transfer_bound(&placements);
    let per_command = shape.command_bytes();
    assert!(one_layer.fits(bound, per_command.clone()));
    assert!(!Transferred { bytes: bound.bytes + 1, ..one_layer }.fits(bound, per_command.clone()), "more bytes than the grant");
    assert!(!Transferred { commands: bound.commands + 1, bytes: bound.bytes }.fits(bound, per_command.clone()));
    assert!(!Transferred { bytes: 0, commands: 1 }.fits(bound, per_command.clone()), "a command moves at least one LBA");
    assert!(!Transferred { bytes: 4096, commands: 0 }.fits(bound, per_command), "no bytes without a command");
    data.finish(handle).unwrap();
    control.release(handle).unwrap();
    assert!(matches!(data.transferred(handle), Err(ObjstoreError::UnknownHandle { .. })), "a finished request is gone");
}

#[test]
fn the_data_half_refuses_placements_outside_its_shape_and_registration() {
    // Goal: placements come over a socket in the daemon design, so each bad field is a typed
    // error naming the placement, nothing is left prepared by a refusal (the same handle is
    // then prepared fine), and a shape whose slots reach past the namespace is refused before
    // anything is built. The control half likewise refuses a commit without one CRC per new
    // block (keeping the reservation) and an eviction report for a slot its retrieve did not
    // reserve.
    let fixture = fixture(2, Some(8));
    let config = StoreConfig { requests_max: 2, ..StoreConfig::default() };
    let (mut control, mut data) = halves(&fixture, config);
    let good = Placement { location: BlockLocation { device: 0, slot: 7, index: 1 }, engine_block: ENGINE_BLOCKS - 1 };
    let handle = RequestHandle::from_bits(1);
    let bad = [
        Placement { location: BlockLocation { device: 1, ..good.location }, ..good },
        Placement { location: BlockLocation { slot: 8, ..good.location }, ..good },
        Placement { location: BlockLocation { index: 2, ..good.location }, ..good },
    ];
    for placement in bad {
        match data.prepare(handle, Direction::Store, &[good, placement], None) {
            Err(ObjstoreError::BadPlacement { position: 1, reason }) => eprintln!("refused: {reason}"),
            other => panic!("{placement:?}: expected BadPlacement at position 1, got {other:?}"),
        }
    }
    match data.prepare(handle, Direction::Store, &[Placement { engine_block: ENGINE_BLOCKS, ..good }], None) {
        Err(ObjstoreError::BlockOutOfRange { block: ENGINE_BLOCKS, num_blocks: ENGINE_BLOCKS }) => {}
        other => panic!("expected BlockOutOfRange, got {other:?}"),
    }
    match data.prepare(RequestHandle::from_bits(2 << 32 | 1), Direction::Store, &[good], None) {
        Err(ObjstoreError::UnknownHandle { .. }) => {}
        other => panic!("a handle past requests_max: expected UnknownHandle, got {other:?}"),
    }
    match data.store_layer(handle, 0, BUDGET) {
        Err(ObjstoreError::UnknownHandle { .. }) => {}
        other => panic!("nothing was prepared by the refusals, got {other:?}"),
    }
    data.prepare(handle, Direction::Store, &[good], None).expect("the same handle, a good placement");
    match data.prepare(handle, Direction::Store, &[good], None) {
        Err(ObjstoreError::HandleState { .. }) => {}
        other => panic!("a second prepare of a live handle: expected HandleState, got {other:?}"),
    }
    data.finish(handle).unwrap();

    let mut shape = control.pool().shape().unwrap();
    shape.devices[0].slot_count += 1_000_000;
    let executor = cpu_executor_for(control.pool(), 64, &config).expect("executor");
    match StoreData::new(shape, fixture.registration.clone(), fixture.dma.clone(), executor, config) {
        Err(ObjstoreError::InvalidPoolShape { reason }) => eprintln!("refused: {reason}"),
        Err(other) => panic!("expected InvalidPoolShape, got {other:?}"),
        Ok(_) => panic!("a shape past the namespace was accepted"),
    }

    let keys = keys_of(&tokens(2, 1));
    fill(&fixture, 0, keys[0]);
    let stored = store_layers(&mut control, &mut data, &keys, &[0]);
    let mut crcs = Vec::new();
    data.payload_crcs(stored, &mut crcs).unwrap();
    for wrong in [None, Some(&crcs[..0])] {
        match control.commit_store(stored, wrong, &mut NoLender) {
            Err(ObjstoreError::BadRequest { reason }) => eprintln!("refused: {reason}"),
            other => panic!("a commit with {wrong:?} CRCs on a pool that records them: expected BadRequest, got {other:?}"),
        }
    }
    assert_eq!(control.lookup(&keys), 0, "a refused commit makes nothing visible");
    control.commit_store(stored, Some(&crcs), &mut NoLender).expect("the refusals left the reservation to commit");
    data.finish(stored).unwrap();
    let retrieve = control.reserve_retrieve(&keys, &[1], 0).unwrap();
    let placed = control.placements(retrieve).unwrap()[0].location;
    let lie = crate::MismatchedBlock {
        position: 0,
        engine_block: 1,
        device: placed.device,
        slot: placed.slot + 1,
        expected_crc: 0,
        computed_crc: 1,
    };
    match control.evict_mismatched(retrieve, &[lie], &mut NoLender) {
        Err(ObjstoreError::BadPlacement { position: 0, .. }) => {}
        other => panic!("an eviction of a slot the retrieve did not reserve: expected BadPlacement, got {other:?}"),
    }
    control.release(retrieve).unwrap();
    assert_eq!(control.lookup(&keys), 1, "the refused report evicted nothing");
}

#[test]
fn a_reservation_released_without_commit_leaves_nothing_visible_and_frees_its_slots() {
    // Goal: a store whose data was written but never committed (its engine process went
    // away: tuttid releases its session) makes none of its blocks visible, now or after a
    // reopen, and gives its slots back free — not committed, so reusing them evicts nothing.
    let fixture = fixture(1, Some(4));
    let config = StoreConfig { requests_max: 2, ..StoreConfig::default() };
    let (mut control, mut data) = halves(&fixture, config);
    let keys = keys_of(&tokens(3, 4));
    for (block, &key) in keys.iter().enumerate() {
        fill(&fixture, block as u32, key);
    }
    let handle = store_layers(&mut control, &mut data, &keys, &[0, 1, 2, 3]);
    let other = keys_of(&tokens(4, 4));
    match control.reserve_store(&other[..1], &[4], &mut NoLender) {
        Err(ObjstoreError::PoolFull { .. }) => {}
        other => panic!("the four slots are reserved: expected PoolFull, got {other:?}"),
    }
    data.finish(handle).unwrap();
    control.release(handle).unwrap();
    assert!(matches!(control.commit_store(handle, None, &mut NoLender), Err(ObjstoreError::UnknownHandle { .. })), "released is gone");
    assert_eq!(control.lookup(&keys), 0, "nothing of the released store is visible");
    assert_eq!(control.counts().cached_blocks, 0);
    let plan = control.reserve_store(&other, &[4, 5, 6, 7], &mut NoLender).expect("the released slots are free again");
    assert_eq!((plan.new_blocks, plan.evicted_slots), (4, 0), "free, not evicted");
    control.release(plan.handle).unwrap();
    drop(data);
    drop(control.into_pool());
    let (_, report) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("reopen");
    assert_eq!((report.cached_blocks, report.valid_slots), (0, 0), "nothing durable either");
    drop(fixture.region);
}

/// Stores then retrieves `tokens` through the layer-wise trait alone.
fn round_trip_through(store: &mut dyn LayerKvStore, tokens: &[u32], sources: &[u32], targets: &[u32]) -> Result<usize> {
    let plan = store.prepare_store(&KvRequest { tokens, block_ids: sources })?;
    for layer in 0..geometry().layers {
        store.store_layer(plan.handle, layer, BUDGET)?;
        store.wait(plan.handle, deadline())?;
    }
    store.commit_store(plan.handle)?;
    let cached = store.lookup(tokens);
    let handle = store.prepare_retrieve(&KvRequest { tokens, block_ids: &targets[..cached] })?;
    for layer in 0..geometry().layers {
        store.retrieve_layer(handle, layer, BUDGET)?;
        while !store.poll(handle)? {
            std::thread::yield_now();
        }
    }
    store.finish(handle)?;
    Ok(cached)
}

#[test]
fn an_in_process_store_serves_the_layer_wise_trait() {
    // Goal: `KvStore` behind `dyn LayerKvStore` (how an engine integration will hold either
    // it or the daemon's client) stores, commits, looks up and retrieves byte-exact.
    let fixture = fixture(1, None);
    let config = StoreConfig::default();
    let (pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("open");
    let executor = cpu_executor_for(&pool, 64, &config).expect("executor");
    let mut store = KvStore::new(pool, fixture.registration.clone(), fixture.dma.clone(), executor, config).expect("store");
    let tokens = tokens(5, 2);
    let keys = keys_in(0, &tokens);
    fill(&fixture, 0, keys[0]);
    fill(&fixture, 1, keys[1]);
    assert_eq!(round_trip_through(&mut store, &tokens, &[0, 1], &[10, 11]).expect("round trip"), 2);
    assert!(holds(&fixture, 10, keys[0]) && holds(&fixture, 11, keys[1]));
}

#[test]
fn a_stored_key_seen_does_not_give_the_keys_of_its_extensions() {
    // Goal: whoever learns one stored block key K (an etcd segment name, a data-plane frame, a
    // node's manifest show them in plain text) cannot compute the key of any block after it
    // without the pool's secret, so cannot search extensions of K's prefix for a collision.
    // Commit P‖x (P two blocks, x one), take K = P's last block's stored key, and chain from K
    // over x with every public way there is to do it without the secret: another secret's chain
    // of the same seed or of seed 0, the space-seed hash, and format 4's unkeyed block hash
    // (tutti-block-v1 over K, count, x), which was the stored key before every block was keyed.
    // None gives the store's key of x's block, and the store finds nothing under any of them.
    use sha2::{Digest, Sha256};
    let fixture = fixture(1, None);
    let (pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("open");
    let executor = cpu_executor_for(&pool, 64, &StoreConfig::default()).expect("executor");
    let mut store = KvStore::new(pool, fixture.registration.clone(), fixture.dma.clone(), executor, StoreConfig::default()).expect("store");
    store.set_key_seed(SEED);
    let tokens = tokens(31, 3);
    let keys = keys_of(&tokens);
    for (block, &key) in [2u32, 5, 6].iter().zip(&keys) {
        fill(&fixture, *block, key);
    }
    let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[2, 5, 6] }).expect("prepare_store");
    for layer in 0..geometry().layers {
        store.store_layer(plan.handle, layer, BUDGET).unwrap();
        store.wait(plan.handle, deadline()).unwrap();
    }
    store.commit_store(plan.handle).expect("commit");
    assert_eq!(store.control.lookup(&keys), 3);
    let block_tokens = geometry().block_tokens as usize;
    let (seen, x) = (keys[1], &tokens[2 * block_tokens..]);
    let other = KeySecret::from_bytes([0x42; 32]).unwrap();
    let mut format_4 = b"tutti-block-v1".to_vec();
    format_4.extend(seen.to_le_bytes());
    format_4.extend((x.len() as u64).to_le_bytes());
    x.iter().for_each(|token| format_4.extend(token.to_le_bytes()));
    let format_4 = u64::from_le_bytes(Sha256::digest(&format_4)[..8].try_into().unwrap()).max(1);
    let seen_words: Vec<u32> = [seen as u32, (seen >> 32) as u32].into_iter().chain(x.iter().copied()).collect();
    let guesses = [
        KeyChain::new(&other, SEED).block_key(seen, x),
        KeyChain::new(&other, 0).block_key(seen, x),
        crate::hash::space_seed(&seen_words),
        format_4,
    ];
    for guess in guesses {
        assert_ne!(guess, keys[2], "the key after a seen key was computed without the secret");
        assert_eq!(store.control.lookup(&[keys[0], keys[1], guess]), 2);
        assert_eq!(store.control.lookup(&[guess]), 0);
    }
}

#[test]
fn a_key_seed_puts_the_whole_store_in_that_key_space() {
    // Goal: an in-process store given tuttid's seed of a session stores, finds and retrieves
    // under exactly the keys that session uses (`block_keys`), so a pool written by one
    // is found by the other; seed 0 (the default) does not see them. `placements` names the
    // engine blocks a store writes: only the new ones.
    let fixture = fixture(1, None);
    let (pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("open");
    let executor = cpu_executor_for(&pool, 64, &StoreConfig::default()).expect("executor");
    let mut store = KvStore::new(pool, fixture.registration.clone(), fixture.dma.clone(), executor, StoreConfig::default()).expect("store");
    assert_eq!(store.key_seed(), 0);
    store.set_key_seed(SEED);
    let tokens = tokens(9, 3);
    let keys = keys_of(&tokens);
    for (block, &key) in [2u32, 5].iter().zip(&keys) {
        fill(&fixture, *block, key);
    }
    let store_two = |store: &mut KvStore<CpuExecutor>, blocks: &[u32]| {
        let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: blocks }).expect("prepare_store");
        let written: Vec<u32> = store.placements(plan.handle).unwrap().iter().map(|placement| placement.engine_block).collect();
        for layer in 0..geometry().layers {
            store.store_layer(plan.handle, layer, BUDGET).unwrap();
            store.wait(plan.handle, deadline()).unwrap();
        }
        store.commit_store(plan.handle).expect("commit");
        written
    };
    assert_eq!(store_two(&mut store, &[2, 5]), vec![2, 5]);
    assert_eq!(store.lookup(&tokens), 2);
    assert_eq!(store.control.lookup(&keys), 2, "stored under the seeded keys");
    let mut unkeyed = Vec::new();
    block_keys(&KeyChain::new(&KeySecret::from_bytes([0x42; 32]).unwrap(), SEED), &tokens, geometry().block_tokens, &mut unkeyed);
    assert_eq!(store.control.lookup(&unkeyed), 0, "the keys are keyed with the pool's secret, not the seed alone");
    fill(&fixture, 6, keys[2]);
    assert_eq!(store_two(&mut store, &[2, 5, 6]), vec![6], "the first two blocks are shared, only the third is written");
    store.set_key_seed(0);
    assert_eq!(store.lookup(&tokens), 0, "the in-process space does not see them");
    store.set_key_seed(SEED);
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[10, 11, 12] }).expect("prepare_retrieve");
    for layer in 0..geometry().layers {
        store.retrieve_layer(handle, layer, BUDGET).unwrap();
        store.wait(handle, deadline()).unwrap();
    }
    store.finish(handle).unwrap();
    for (block, &key) in [10u32, 11, 12].iter().zip(&keys) {
        assert!(holds(&fixture, *block, key), "engine block {block}");
    }
}

/// A control half over a pool of two namespaces on one software controller, sized to hold
/// `slots[0]` and `slots[1]` slots of one block (payload CRCs off: commits need none).
fn two_device_control(slots: [u64; 2]) -> StoreControl {
    let slot_bytes = geometry().block_bytes();
    // The header region and the 1 MiB data alignment, then the slots; the planner's first
    // estimate reserves one slot's worth more than it needs, hence the extra slot.
    let namespace = |slots: u64| NamespaceConfig::new(512, Some((1 << 20) + (slots + 1) * slot_bytes));
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 16 << 20 })
        .with_namespaces(vec![namespace(slots[0]), namespace(slots[1])]);
    let device = EmuDevice::start(config).expect("software controller");
    let backend: Arc<dyn DeviceBackend> = device;
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"));
    let targets: Vec<PoolTarget> = [1, 2].map(|ns| PoolTarget { controller: controller.clone(), namespace: NamespaceId(ns) }).to_vec();
    let params = FormatParams::new(geometry());
    format_pool(&targets, &params).expect("format");
    let (pool, _) = Pool::open(targets, Some(&geometry())).expect("open");
    assert_eq!([pool.superblock(0).slot_count, pool.superblock(1).slot_count], slots, "the namespaces hold the slots the test needs");
    StoreControl::new(pool, 4).expect("control")
}

/// Reserves and commits a store of `keys` (no data is written: the control half alone);
/// returns its plan and the devices its blocks were placed on.
fn commit_keys(control: &mut StoreControl, keys: &[u64]) -> Result<(StorePlan, Vec<u16>)> {
    let blocks: Vec<u32> = (0..keys.len() as u32).collect();
    let plan = control.reserve_store(keys, &blocks, &mut NoLender)?;
    let devices = control.placements(plan.handle)?.iter().map(|placement| placement.location.device).collect();
    control.commit_store(plan.handle, None, &mut NoLender)?;
    Ok((plan, devices))
}

#[test]
fn a_store_takes_a_free_slot_on_any_device_before_it_evicts() {
    // Goal: devices of different sizes (2 and 8 slots): six one-block stores fit in the ten
    // slots without evicting anything, spread round-robin while both devices have free slots.
    // Allocation used to go strictly round-robin and evict on a full device even with free
    // slots elsewhere: the fifth store evicted the first.
    let mut control = two_device_control([2, 8]);
    let mut devices = Vec::new();
    let mut all_keys = Vec::new();
    for request in 0..6u32 {
        let keys = keys_of(&tokens(100 + request, 1));
        let (plan, placed) = commit_keys(&mut control, &keys).expect("store");
        assert_eq!((plan.new_blocks, plan.evicted_slots), (1, 0), "request {request} evicted");
        devices.extend(placed);
        all_keys.push(keys);
    }
    assert_eq!(devices, [0, 1, 0, 1, 1, 1], "round-robin while both have free slots, then the larger one");
    assert_eq!(control.counts().evictions, 0);
    for keys in &all_keys {
        assert_eq!(control.lookup(keys), 1);
    }
    // Five blocks: the four free slots left, and only then one eviction.
    let (plan, _) = commit_keys(&mut control, &keys_of(&tokens(200, 5))).expect("store");
    assert_eq!(plan.evicted_slots, 1);
}

#[test]
fn a_store_that_fits_only_with_a_fenced_device_is_refused_with_the_cache_intact() {
    // Goal: the free and evictable slots of a fenced device (no header writes until reopen)
    // do not count: a store that needs them fails with PoolFull before evicting anything. They
    // used to count, so such a store passed the check, evicted on the healthy device, then
    // failed with MetadataFenced, having cost the cache the blocks it evicted.
    let mut control = two_device_control([2, 2]);
    let a = keys_of(&tokens(300, 1));
    let b = keys_of(&tokens(301, 1));
    assert_eq!(commit_keys(&mut control, &a).unwrap().1, [0]);
    assert_eq!(commit_keys(&mut control, &b).unwrap().1, [1]);
    let mut pool = control.into_pool();
    pool.fence_for_test(1);
    let mut control = StoreControl::new(pool, 4).expect("control");
    // Device 0: one free slot and A's, evictable; device 1 (fenced): one free and B's.
    let three = keys_of(&tokens(302, 3));
    match control.reserve_store(&three, &[0, 1, 2], &mut NoLender) {
        Err(ObjstoreError::PoolFull { needed: 3, evictable: 2 }) => {}
        other => panic!("expected PoolFull (3 needed, 2 on the healthy device), got {other:?}"),
    }
    assert_eq!((control.lookup(&a), control.lookup(&b), control.counts().evictions), (1, 1, 0), "nothing evicted");
    assert_eq!(control.lookup(&three[..1]), 0, "the refused store left no claim");
    // One block fits in device 0's free slot, without evicting.
    let (plan, devices) = commit_keys(&mut control, &three[..1]).expect("store");
    assert_eq!((plan.evicted_slots, devices), (0, vec![0]));
}

/// A CPU executor whose next `submit` fails after it took the batch, as an executor that fails
/// part way through an issue (the CUDA one after its kernel launch): the IOCBs still run.
struct FailsAfterPublishing {
    inner: CpuExecutor,
    fail_next: bool,
}

impl gio_uring::Executor for FailsAfterPublishing {
    fn name(&self) -> &'static str {
        "fails after publishing"
    }

    fn attach(&mut self, memory: &std::sync::Arc<gio_uring::layout::QueueMemory>) -> std::result::Result<(), GioError> {
        self.inner.attach(memory)
    }

    fn prepared(&mut self, memory: &gio_uring::layout::QueueMemory, id: gio_uring::IocbId) -> std::result::Result<(), GioError> {
        self.inner.prepared(memory, id)
    }

    fn submit(&mut self, memory: &gio_uring::layout::QueueMemory, batch: &gio_uring::IssueBatch) -> std::result::Result<(), GioError> {
        self.inner.submit(memory, batch)?;
        if std::mem::take(&mut self.fail_next) {
            return Err(GioError::Executor { executor: "fails after publishing", reason: "after the batch was taken".into() });
        }
        Ok(())
    }

    fn poll(&mut self, memory: &gio_uring::layout::QueueMemory) -> std::result::Result<(), GioError> {
        self.inner.poll(memory)
    }

    fn retire_queue_pairs(&mut self) -> Option<bool> {
        self.inner.retire_queue_pairs()
    }
}

#[test]
fn a_layer_whose_issue_failed_after_publishing_stays_in_flight_until_waited_for() {
    // Goal: when the executor fails after the layer's IOCBs were published, they are in flight
    // (the device may still move the request's bytes): the data half tracks the layer as in
    // flight, refuses to finish the request (which would put the IOCBs back and let the engine
    // release its blocks) until a wait has reaped them, and then finishes it normally.
    let fixture = fixture(2, None);
    let config = StoreConfig { requests_max: 2, ..StoreConfig::default() };
    let (pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("open");
    let shape = pool.shape().expect("shape");
    let executor = FailsAfterPublishing { inner: cpu_executor_for(&pool, 64, &config).expect("executor"), fail_next: false };
    let mut control = StoreControl::new(pool, config.requests_max).expect("control");
    let mut data = StoreData::new(shape, fixture.registration.clone(), fixture.dma.clone(), executor, config).expect("data");
    let keys = keys_of(&tokens(3, 2));
    for (block, &key) in keys.iter().enumerate() {
        fill(&fixture, block as u32, key);
    }
    let plan = control.reserve_store(&keys, &[0, 1], &mut NoLender).expect("reserve_store");
    data.prepare(plan.handle, Direction::Store, control.placements(plan.handle).unwrap(), None).expect("prepare");
    data.queue_mut().executor_mut().fail_next = true;
    let failed = data.store_layer(plan.handle, 0, BUDGET);
    assert!(matches!(failed, Err(ObjstoreError::Gio(GioError::SubmitFailed { .. }))), "{failed:?}");
    assert_eq!(data.layers_in_flight(plan.handle).unwrap().collect::<Vec<_>>(), vec![0], "the layer is tracked as in flight");
    assert!(matches!(data.finish(plan.handle), Err(ObjstoreError::HandleState { .. })), "not finishable while its IOCBs may run");
    assert_eq!(data.wait(plan.handle, deadline()).expect("its IOCBs complete"), Some(0));
    data.finish(plan.handle).expect("finished once reaped");
    control.release(plan.handle).expect("release");
    assert!(data.close(), "every queue pair deleted");
}

#[test]
fn a_retrieve_from_a_first_block_reads_only_the_blocks_from_there() {
    // Goal: an engine that holds the first blocks of a prefix itself (a local prefix cache hit,
    // possibly shared with other requests) retrieves only the rest: `prepare_retrieve_from`
    // reads blocks first_block.. byte-exact (verified), neither reads nor writes the engine
    // blocks of the prefix before them, needs only its own blocks cached (keys still chain
    // from the prefix's first token), and refuses ranges past the tokens before reserving.
    let fixture = fixture(1, None);
    let config = StoreConfig { verify_retrieves: true, ..StoreConfig::default() };
    let (pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("open");
    let executor = cpu_executor_for(&pool, 64, &config).expect("executor");
    let mut store = KvStore::new(pool, fixture.registration.clone(), fixture.dma.clone(), executor, config).expect("store");
    store.set_key_seed(SEED);
    let tokens = tokens(3, 4);
    let keys = keys_of(&tokens);
    // Blocks 1..4 of the prefix reach the pool; block 0 never does.
    for (block, &key) in [1u32, 2, 3].iter().zip(&keys[1..]) {
        fill(&fixture, *block, key);
    }
    let handle = store_layers(&mut store.control, &mut store.data, &keys[1..], &[1, 2, 3]);
    let mut crcs = Vec::new();
    store.data.payload_crcs(handle, &mut crcs).expect("payload CRCs");
    assert_eq!(store.control.commit_store(handle, Some(&crcs), &mut NoLender).expect("commit"), 3);
    store.data.finish(handle).expect("finish the store");
    assert_eq!(store.lookup(&tokens), 0, "block 0 is not cached, so the prefix lookup finds nothing");
    let ends: Vec<usize> = [0, 1, 2, 3, 4, 9].into_iter().map(|first_block| store.lookup_from(&tokens, first_block)).collect();
    assert_eq!(ends, [0, 4, 4, 4, 4, 4], "from block 1 on the run is cached to the end; a start past the prompt is its end");
    let from_zero = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[8, 9, 10, 11] }).unwrap_err();
    assert!(from_zero.to_string().contains("block 0 of the prefix is not cached"), "{from_zero}");

    // The engine's own blocks 0 and 1 (engine blocks 8 and 9) hold bytes of their own.
    fill(&fixture, 8, 0xA11CE);
    fill(&fixture, 9, 0xB0B);
    fill(&fixture, 10, 0xDEAD);
    fill(&fixture, 11, 0xDEAD);
    let before = fixture.device.stats();
    let handle = store.prepare_retrieve_from(&KvRequest { tokens: &tokens, block_ids: &[10, 11] }, 2).expect("prepare from block 2");
    for layer in 0..geometry().layers {
        store.retrieve_layer(handle, layer, BUDGET).expect("retrieve_layer");
        assert_eq!(store.wait(handle, deadline()).expect("wait, verified"), Some(layer));
    }
    store.finish(handle).expect("finish");
    let after = fixture.device.stats();
    assert!(holds(&fixture, 10, keys[2]) && holds(&fixture, 11, keys[3]), "blocks 2 and 3 of the prefix land byte-exact");
    assert!(holds(&fixture, 8, 0xA11CE) && holds(&fixture, 9, 0xB0B), "the engine's own blocks are left alone");
    assert_eq!(
        after.bytes_read - before.bytes_read,
        2 * 2 * u64::from(geometry().layers) * geometry().object_bytes(),
        "K and V of two blocks per layer: nothing of blocks 0 and 1 is read"
    );

    // Ranges past the tokens, empty ones and absurd starts are refused before any reservation.
    for (block_ids, first_block) in [(&[10u32, 11, 12][..], 2), (&[][..], 2), (&[10][..], 4), (&[10][..], usize::MAX)] {
        let refused = store.prepare_retrieve_from(&KvRequest { tokens: &tokens, block_ids }, first_block).unwrap_err();
        assert!(matches!(refused, ObjstoreError::BadRequest { .. }), "{block_ids:?} from {first_block}: {refused}");
    }
    let handle = store.prepare_retrieve_from(&KvRequest { tokens: &tokens, block_ids: &[12] }, 3).expect("the last block alone");
    store.finish(handle).expect("finish");
}

/// Fails the next I/O command the software controller takes (without executing it) with a
/// media error, as a layer's write or read that fails.
fn fail_next_io(fixture: &Fixture) {
    use nvme_driver::spec::status::codes;
    use nvme_driver::spec::{NvmeStatus, StatusCodeType};
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let media = NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, codes::WRITE_FAULT);
    fixture.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::Status(media))));
}

/// An in-process store over the fixture's pool, in the test key space.
fn in_process(fixture: &Fixture, config: StoreConfig) -> KvStore<CpuExecutor> {
    let (pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("open");
    let executor = cpu_executor_for(&pool, 64, &config).expect("executor");
    let mut store = KvStore::new(pool, fixture.registration.clone(), fixture.dma.clone(), executor, config).expect("store");
    store.set_key_seed(SEED);
    store
}

#[test]
fn a_store_layer_whose_reissue_failed_is_not_stored_and_refuses_the_commit() {
    // Goal: the commit rule (a block becomes visible only once every layer is on disk) holds
    // for a layer issued again after it completed: when that second write fails, the layer's
    // LBAs may be torn, so the layer no longer counts as stored: `commit_store` refuses with
    // HandleState (nothing visible, the reservation kept), and once the layer is stored again
    // the commit succeeds. What the request moved still counts each layer once.
    let fixture = fixture(2, None);
    let mut store = in_process(&fixture, StoreConfig { requests_max: 2, ..StoreConfig::default() });
    let tokens = tokens(11, 2);
    let keys = keys_of(&tokens);
    for (block, &key) in keys.iter().enumerate() {
        fill(&fixture, block as u32, key);
    }
    let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1] }).expect("prepare_store");
    for layer in 0..geometry().layers {
        store.store_layer(plan.handle, layer, BUDGET).expect("store_layer");
        assert_eq!(store.wait(plan.handle, deadline()).expect("wait"), Some(layer));
    }
    let stored = store.data.transferred(plan.handle).unwrap();
    fail_next_io(&fixture);
    store.store_layer(plan.handle, 0, BUDGET).expect("layer 0 again");
    match store.wait(plan.handle, deadline()) {
        Err(ObjstoreError::LayerIo { layer: 0, .. }) => {}
        other => panic!("the re-issued layer 0 failed: expected LayerIo, got {other:?}"),
    }
    fixture.device.set_faults(nvme_emu::FaultPlan::none());
    match store.commit_store(plan.handle) {
        Err(ObjstoreError::HandleState { reason, .. }) => eprintln!("refused: {reason}"),
        other => panic!("a commit over a layer whose latest write failed: expected HandleState, got {other:?}"),
    }
    assert_eq!(store.lookup(&tokens), 0, "nothing is visible");
    store.store_layer(plan.handle, 0, BUDGET).expect("layer 0 once more");
    assert_eq!(store.wait(plan.handle, deadline()).expect("wait"), Some(0));
    assert_eq!(store.data.transferred(plan.handle).unwrap(), stored, "each layer counted once");
    assert_eq!(store.commit_store(plan.handle).expect("commit"), 2);
    assert_eq!(store.lookup(&tokens), 2);
}

/// Fills engine blocks 0 and 1 with the two blocks of `tokens` and stores them, every layer,
/// committed; returns their keys.
fn store_two_blocks(fixture: &Fixture, store: &mut KvStore<CpuExecutor>, tokens: &[u32]) -> Vec<u64> {
    let (keys, handle) = stage_two_blocks(fixture, store, tokens);
    assert_eq!(store.commit_store(handle).expect("commit"), 2);
    keys
}

/// Two blocks of `tokens` stored from engine blocks 0 and 1, every layer, not committed: their
/// keys and the request.
fn stage_two_blocks(fixture: &Fixture, store: &mut KvStore<CpuExecutor>, tokens: &[u32]) -> (Vec<u64>, RequestHandle) {
    let keys = keys_of(tokens);
    for (block, &key) in keys.iter().enumerate() {
        fill(fixture, block as u32, key);
    }
    let plan = store.prepare_store(&KvRequest { tokens, block_ids: &[0, 1] }).expect("prepare_store");
    for layer in 0..geometry().layers {
        store.store_layer(plan.handle, layer, BUDGET).unwrap();
        store.wait(plan.handle, deadline()).unwrap();
    }
    (keys, plan.handle)
}

#[test]
fn a_verified_retrieve_does_not_fold_a_layer_whose_reissue_failed() {
    // Goal: a verified retrieve folds a layer into its blocks' CRCs only once the layer's
    // latest issue completed. Layers 0, 1 and 3 complete (3 waits, unfolded, for 2); layer 3
    // is issued again and that read fails, leaving its bytes torn in the engine's memory (a
    // partial DMA, written here); when layer 2 completes, the torn layer 3 must not be folded
    // (it would fail the comparison and evict good blocks); issued once more, it completes
    // and the retrieve verifies, byte-exact.
    let fixture = fixture(2, None);
    let mut store = in_process(&fixture, StoreConfig { verify_retrieves: true, requests_max: 2, ..StoreConfig::default() });
    let tokens = tokens(12, 2);
    let keys = store_two_blocks(&fixture, &mut store, &tokens);
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[4, 5] }).expect("prepare_retrieve");
    for layer in [0, 1, 3] {
        store.retrieve_layer(handle, layer, BUDGET).unwrap();
        assert_eq!(store.wait(handle, deadline()).expect("wait"), Some(layer));
    }
    object(&fixture, 3, KvKind::Key, 4).fill(0, geometry().object_bytes() as usize, 0x5A).unwrap();
    fail_next_io(&fixture);
    store.retrieve_layer(handle, 3, BUDGET).unwrap();
    match store.wait(handle, deadline()) {
        Err(ObjstoreError::LayerIo { layer: 3, .. }) => {}
        other => panic!("the re-issued layer 3 failed: expected LayerIo, got {other:?}"),
    }
    fixture.device.set_faults(nvme_emu::FaultPlan::none());
    store.retrieve_layer(handle, 2, BUDGET).unwrap();
    assert_eq!(store.wait(handle, deadline()).expect("layer 2: the torn layer 3 is not folded"), Some(2));
    store.retrieve_layer(handle, 3, BUDGET).unwrap();
    assert_eq!(store.wait(handle, deadline()).expect("layer 3 again: verified"), Some(3));
    store.finish(handle).expect("finish");
    assert!(holds(&fixture, 4, keys[0]) && holds(&fixture, 5, keys[1]), "byte-exact");
    assert_eq!(store.lookup(&tokens), 2, "nothing was evicted");
}

/// Overwrites layer 0 of the slots holding `keys` on disk with other bytes, as silent media
/// corruption would: through the data half, writing engine blocks 6 and 7 (filled with a key's
/// pattern that is not theirs) into the retrieve placements of `keys`.
fn corrupt_layer_0_on_disk(fixture: &Fixture, store: &mut KvStore<CpuExecutor>, keys: &[u64]) {
    let handle = store.control.reserve_retrieve(keys, &[6, 7], 0).expect("reserve the blocks' slots");
    let placements = store.control.placements(handle).unwrap().to_vec();
    for placement in &placements {
        fill(fixture, placement.engine_block, 0xBAD);
    }
    store.data.prepare(handle, Direction::Store, &placements, None).expect("prepare the overwrite");
    store.data.store_layer(handle, 0, BUDGET).unwrap();
    assert_eq!(store.data.wait(handle, deadline()).expect("overwrite layer 0"), Some(0));
    store.data.finish(handle).unwrap();
    store.control.release(handle).unwrap();
}

#[test]
fn a_verified_retrieve_verifies_a_folded_layer_read_again() {
    // Goal: a layer issued again after it was folded into its blocks' CRCs is verified again:
    // the issue unfolds the request's CRCs, and the wait that completes the re-read refolds
    // every layer and compares. Here all four layers were read and verified; layer 0 then
    // changes on disk and is read again: that wait reports PayloadMismatch (the new bytes are
    // not those recorded), where before it returned the layer as verified against the first
    // read. A re-read that fails likewise leaves the CRCs unfolded until a read of the layer
    // completes, so no comparison passes against the earlier good read.
    let fixture = fixture(2, None);
    let mut store = in_process(&fixture, StoreConfig { verify_retrieves: true, requests_max: 2, ..StoreConfig::default() });
    let tokens = tokens(13, 2);
    let keys = store_two_blocks(&fixture, &mut store, &tokens);
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[4, 5] }).expect("prepare_retrieve");
    for layer in 0..geometry().layers {
        store.retrieve_layer(handle, layer, BUDGET).unwrap();
        assert_eq!(store.wait(handle, deadline()).expect("verified"), Some(layer));
    }
    assert!(holds(&fixture, 4, keys[0]) && holds(&fixture, 5, keys[1]), "byte-exact");
    corrupt_layer_0_on_disk(&fixture, &mut store, &keys);
    // A failed re-read first: its layer is reported, and nothing is compared until it is read.
    fail_next_io(&fixture);
    store.retrieve_layer(handle, 0, BUDGET).unwrap();
    match store.wait(handle, deadline()) {
        Err(ObjstoreError::LayerIo { layer: 0, .. }) => {}
        other => panic!("the re-issued layer 0 failed: expected LayerIo, got {other:?}"),
    }
    fixture.device.set_faults(nvme_emu::FaultPlan::none());
    store.retrieve_layer(handle, 0, BUDGET).unwrap();
    match store.wait(handle, deadline()) {
        Err(ObjstoreError::PayloadMismatch { blocks, .. }) => assert_eq!(blocks.len(), 2, "{blocks:?}"),
        other => panic!("layer 0 read again holds other bytes: expected PayloadMismatch, got {other:?}"),
    }
    store.finish(handle).expect("finish");
    assert_eq!(store.lookup(&tokens), 0, "the damaged blocks were evicted");
}

#[test]
fn a_wait_that_finds_a_mismatch_returns_by_its_deadline_and_the_eviction_is_written_later() {
    // Goal: the header sync that makes a mismatched block's slot Empty on disk runs inside the
    // caller's deadline: the wait that finds the mismatch returns by it even when the header
    // write is slow (here it completes 4 s late; the pool allows METADATA_TIMEOUT, 10 s, per
    // device), where it used to block until the write completed. The Empty entries are not
    // dropped: they stay staged, `KvStore::sync_headers` writes them once the device answers,
    // and a reopen serves nothing of the evicted blocks.
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let fixture = fixture(2, None);
    let mut store = in_process(&fixture, StoreConfig { verify_retrieves: true, requests_max: 2, ..StoreConfig::default() });
    let tokens = tokens(14, 2);
    let keys = store_two_blocks(&fixture, &mut store, &tokens);
    corrupt_layer_0_on_disk(&fixture, &mut store, &keys);
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[4, 5] }).expect("prepare_retrieve");
    let layers = geometry().layers;
    for layer in 0..layers - 1 {
        store.retrieve_layer(handle, layer, BUDGET).unwrap();
        store.wait(handle, deadline()).expect("an earlier layer");
    }
    store.retrieve_layer(handle, layers - 1, BUDGET).unwrap();
    let slow_write = FaultRule::on_nth_io(1, FaultAction::Delay(Duration::from_secs(4))).with_opcode(0x01);
    fixture.device.set_faults(FaultPlan::none().with_rule(slow_write));
    let start = Instant::now();
    let result = store.wait(handle, start + Duration::from_millis(500));
    let took = start.elapsed();
    assert!(matches!(result, Err(ObjstoreError::PayloadMismatch { .. })), "{result:?}");
    assert!(took < Duration::from_millis(2500), "the wait returned {took:?} after it was called, past its 500 ms deadline");
    fixture.device.set_faults(FaultPlan::none());
    assert_eq!(store.lookup(&tokens), 0, "out of the index at once");
    store.finish(handle).expect("finish");
    store.sync_headers(deadline()).expect("the staged Empty entries are written");
    drop(store);
    let (_, report) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("reopen");
    assert_eq!(report.cached_blocks, 0, "the evicted blocks are not served after a reopen: {report:?}");
}

#[test]
fn a_short_wait_deadline_does_not_fence_a_device_whose_metadata_borrows_the_executors_queue() {
    // Goal: on a controller granting one queue pair per pool device (the pool's metadata
    // borrows the executor's queue pair, which the pool cannot delete), a wait that finds a
    // mismatch with 500 ms left does not submit the Empty header writes with a 500 ms timeout:
    // such a write cut short by the caller's deadline, not by the device, left commands in
    // flight and fenced the device until reopen (no slot allocated there, the staged Empty
    // entries dropped). The entries stay staged instead, the device stays unfenced, and a sync
    // whose deadline leaves the metadata timeout writes them.
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let fixture = fixture_on(EmuConfig::default().with_io_queue_pairs_max(1), 2, None);
    let mut store = in_process(&fixture, StoreConfig { verify_retrieves: true, requests_max: 2, ..StoreConfig::default() });
    assert!(store.pool().metadata_queue_shared(0), "one queue pair granted: metadata borrows the executor's");
    let later = tokens(16, 2);
    let tokens = tokens(15, 2);
    let keys = store_two_blocks(&fixture, &mut store, &tokens);
    corrupt_layer_0_on_disk(&fixture, &mut store, &keys);
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[4, 5] }).expect("prepare_retrieve");
    let layers = geometry().layers;
    for layer in 0..layers - 1 {
        store.retrieve_layer(handle, layer, BUDGET).unwrap();
        store.wait(handle, deadline()).expect("an earlier layer");
    }
    store.retrieve_layer(handle, layers - 1, BUDGET).unwrap();
    let slow_write = FaultRule::on_nth_io(1, FaultAction::Delay(Duration::from_secs(2))).with_opcode(0x01);
    fixture.device.set_faults(FaultPlan::none().with_rule(slow_write));
    let start = Instant::now();
    let result = store.wait(handle, start + Duration::from_millis(500));
    let took = start.elapsed();
    assert!(matches!(result, Err(ObjstoreError::PayloadMismatch { .. })), "{result:?}");
    assert!(took < Duration::from_millis(2500), "the wait returned {took:?} after it was called, past its 500 ms deadline");
    assert!(!store.pool().metadata_fenced(0), "a write cut short by the caller's deadline fenced the device");
    assert_eq!(store.lookup(&tokens), 0, "out of the index at once");
    store.finish(handle).expect("finish");
    fixture.device.set_faults(FaultPlan::none());
    let short = store.sync_headers(Instant::now() + Duration::from_millis(100));
    assert!(matches!(short, Err(ObjstoreError::DeadlinePassed { .. })), "the metadata timeout does not fit: {short:?}");
    assert!(!store.pool().metadata_fenced(0));
    store.sync_headers(Instant::now() + METADATA_TIMEOUT + Duration::from_secs(1)).expect("the staged Empty entries are written");
    store_two_blocks(&fixture, &mut store, &later);
    drop(store);
    let (_, report) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("reopen");
    assert_eq!(report.cached_blocks, 2, "the evicted blocks are not served after a reopen, the later store is: {report:?}");
}

#[test]
fn a_deadline_that_rules_out_the_lent_queue_pair_does_not_wait_for_the_executors_layers() {
    // Goal: on a device whose metadata borrows the executor's queue pair, a header write whose
    // caller's deadline leaves less than the metadata timeout is not submitted (a timeout on
    // the lent pair fences the device), so the store must say so at once, not after lending
    // the pair: the lend waited up to that whole deadline for a layer in flight on it (a read
    // held 1 s), then failed as an executor error or gave a pair that could not be used.
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let fixture = fixture_on(EmuConfig::default().with_io_queue_pairs_max(1), 2, None);
    let mut store = in_process(&fixture, StoreConfig { requests_max: 2, ..StoreConfig::default() });
    assert!(store.pool().metadata_queue_shared(0), "one queue pair granted: metadata borrows the executor's");
    let tokens = tokens(15, 2);
    store_two_blocks(&fixture, &mut store, &tokens);
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[4, 5] }).expect("prepare_retrieve");
    let slow_read = FaultRule::every_nth_io(1, FaultAction::Delay(Duration::from_secs(1))).with_opcode(0x02);
    fixture.device.set_faults(FaultPlan::none().with_rule(slow_read));
    store.retrieve_layer(handle, 0, BUDGET).unwrap();
    // The poll sends the layer's reads to the device: the pair is busy until they end.
    assert!(!store.poll(handle).expect("poll"), "the reads are held");
    let start = Instant::now();
    assert_eq!(store.evict_retrieve(handle, start + Duration::from_millis(400)).expect("evicted"), 2);
    let evicting = start.elapsed();
    let start = Instant::now();
    let synced = store.sync_headers(start + Duration::from_millis(400));
    let syncing = start.elapsed();
    assert!(matches!(synced, Err(ObjstoreError::DeadlinePassed { .. })), "the metadata timeout does not fit: {synced:?}");
    assert!(evicting < Duration::from_millis(200), "the eviction's header sync took {evicting:?}: it waited for the lend");
    assert!(syncing < Duration::from_millis(200), "the sync took {syncing:?}: it waited for the lend");
    assert!(!store.pool().metadata_fenced(0));
    fixture.device.set_faults(FaultPlan::none());
    store.wait(handle, deadline()).expect("the held reads");
    store.finish(handle).expect("finish");
    store.sync_headers(Instant::now() + METADATA_TIMEOUT + Duration::from_secs(1)).expect("the staged Empty entries are written");
    drop(store);
    let (_, report) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("reopen");
    assert_eq!(report.cached_blocks, 0, "the evicted blocks are Empty on disk: {report:?}");
}

#[test]
fn into_pool_releases_the_reservations_still_live() {
    // Goal: giving the pool back with requests never finished leaves nothing of them in the
    // pool: a store's slot goes back to the free list and its keys are no longer claimed
    // (another store would have shared them, counting on a commit that never comes); a
    // retrieve's and a store's pins go, so their slots can be evicted again. They used to stay
    // Writing, claimed and pinned for the pool's life.
    let fixture = fixture(1, Some(8));
    let mut store = in_process(&fixture, StoreConfig { requests_max: 4, ..StoreConfig::default() });
    let cached = tokens(21, 2);
    store_two_blocks(&fixture, &mut store, &cached);
    store.prepare_retrieve(&KvRequest { tokens: &cached, block_ids: &[4, 5] }).expect("prepare_retrieve");
    let extended = tokens(21, 3);
    let plan = store.prepare_store(&KvRequest { tokens: &extended, block_ids: &[0, 1, 2] }).expect("prepare_store");
    assert_eq!(plan.new_blocks, 1, "shares the two cached blocks");
    let counts = store.counts();
    assert_eq!((counts.writing_slots, counts.pinned_slots), (1, 3), "live: {counts:?}");
    let pool = store.into_pool();
    let counts = pool.index().counts();
    assert_eq!((counts.writing_slots, counts.pinned_slots, counts.free_slots, counts.valid_slots), (0, 0, 6, 2), "{counts:?}");
    let new_key = keys_of(&extended)[2];
    assert!(!pool.index().is_claimed(new_key), "the uncommitted block is no longer claimed");
}

/// Reserves and commits `keys` as a store from engine blocks 0.. (no data is moved: the control
/// half alone, as the LRU tests need).
fn commit_recorded(control: &mut StoreControl, keys: &[u64]) {
    let blocks: Vec<u32> = (0..keys.len() as u32).collect();
    let plan = control.reserve_store(keys, &blocks, &mut NoLender).expect("reserve_store");
    let crcs = vec![0u32; plan.new_blocks];
    control.commit_store(plan.handle, Some(&crcs), &mut NoLender).expect("commit");
}

#[test]
fn eviction_takes_a_prefix_from_its_end_after_a_retrieve_and_a_store() {
    // Goal (one block per slot, four slots): a prefix is evicted from its last block, never its
    // first, whatever used it last. A retrieve of [A, B, C] leaves A the most recent, so two
    // more stores evict D and then C, and [A, B] still answers; likewise a store that shares
    // [A, B] and adds C. Before, the retrieve touched A first (least recent of the three), the
    // second eviction took A, and the prefix answered 0 while B and C kept two slots.
    let fixture = fixture(1, Some(4));
    let (mut control, _data) = halves(&fixture, StoreConfig::default());
    let (a, b, c, d, e, f, g) = (11, 12, 13, 14, 15, 16, 17);
    commit_recorded(&mut control, &[a, b, c]);
    commit_recorded(&mut control, &[d]);
    let retrieve = control.reserve_retrieve(&[a, b, c], &[0, 1, 2], 0).expect("reserve_retrieve");
    control.release(retrieve).expect("release");
    commit_recorded(&mut control, &[e]);
    commit_recorded(&mut control, &[f]);
    let index = control.pool().index();
    assert!(index.get(d).is_none() && index.get(c).is_none(), "D then C evicted");
    assert_eq!(index.cached_prefix(&[a, b, c]), 2, "the prefix keeps its start");
    // A store sharing [A, B] and adding C (evicting E): C is the least recent of the three
    // afterwards, so two more stores evict F and then C.
    commit_recorded(&mut control, &[a, b, c]);
    commit_recorded(&mut control, &[g]);
    commit_recorded(&mut control, &[g + 1]);
    let index = control.pool().index();
    assert!(index.get(f).is_none() && index.get(c).is_none(), "F then C evicted");
    assert_eq!(index.cached_prefix(&[a, b, c]), 2, "the store's new tail block went first");
}

#[test]
fn eviction_after_a_reopen_goes_by_commit_recency_and_takes_a_prefix_from_its_end() {
    // Goal (one block per slot, three slots): a reopened pool evicts as the session before it
    // would have. [A, B, C] committed in one store sits in slots 0, 1, 2; after a reopen a
    // store of X evicts C, and [A, B] still answers. Before, recovery rebuilt the LRU list in
    // slot order (the highest slot most recent), X evicted A in slot 0 and the prefix answered
    // 0 while B and C kept two slots for nothing.
    let fixture = fixture(1, Some(3));
    let (mut control, data) = halves(&fixture, StoreConfig::default());
    let (a, b, c, x) = (31, 32, 33, 34);
    commit_recorded(&mut control, &[a, b, c]);
    let slots: Vec<u32> = [a, b, c].iter().map(|&key| control.pool().index().get(key).unwrap().slot).collect();
    assert_eq!(slots, [0, 1, 2], "the prefix fills the slots in order");
    drop((control, data));
    let (mut control, _data) = halves(&fixture, StoreConfig::default());
    assert_eq!(control.lookup(&[a, b, c]), 3, "durable across the reopen");
    commit_recorded(&mut control, &[x]);
    let index = control.pool().index();
    assert!(index.get(c).is_none(), "C, the prefix's last block, evicted");
    assert_eq!(index.cached_prefix(&[a, b, c]), 2, "the prefix keeps its start");
    assert!(index.get(x).is_some());
}

#[test]
fn a_store_on_a_healthy_device_commits_while_another_devices_header_writes_hang() {
    // Goal: a store whose slots are all on a healthy device reserves and commits while another
    // pool device's header writes are never answered (lost I/O, before that device is
    // fenced): a store and its commit are judged on the headers of their own devices. Before,
    // they judged every device's staged headers: the hanging device's sync timed out and the
    // store on the healthy device failed with it (its commit released though its own headers
    // were durable). k = 1, one-block stores: round-robin puts A on device 0, B on device 1.
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let config =
        || EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let start = || {
        let device = EmuDevice::start(config()).expect("software controller");
        let backend: Arc<dyn DeviceBackend> = device.clone();
        let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"));
        (device, PoolTarget { controller, namespace: NamespaceId(1) })
    };
    let (hanging, hanging_target) = start();
    let (_healthy, healthy_target) = start();
    let targets = vec![hanging_target, healthy_target];
    let params = FormatParams { slot_count_max: Some(8), payload_crc: true, ..FormatParams::new(geometry()) };
    format_pool(&targets, &params).expect("format");
    let (mut pool, _) = Pool::open(targets.clone(), Some(&geometry())).expect("open");
    pool.set_metadata_timeout(Duration::from_millis(200));
    let mut control = StoreControl::new(pool, 4).expect("control");
    let (a, b) = (41, 42);
    hanging.set_faults(
        FaultPlan::none()
            .with_rule(FaultRule::every_nth_io(1, FaultAction::DropCompletion).with_opcode(nvme_driver::spec::NvmOpcode::Write as u8)),
    );
    let plan = control.reserve_store(&[a], &[0], &mut NoLender).expect("A's slot needs no header write");
    assert_eq!(control.placements(plan.handle).unwrap()[0].location.device, 0);
    assert!(control.commit_store(plan.handle, Some(&[0]), &mut NoLender).is_err(), "A's header on device 0 is never written");
    assert!(!control.pool().metadata_fenced(0), "one timeout does not fence");
    let plan = control.reserve_store(&[b], &[1], &mut NoLender).expect("B's slots are on device 1 alone");
    assert_eq!(control.placements(plan.handle).unwrap()[0].location.device, 1);
    assert_eq!(control.commit_store(plan.handle, Some(&[0]), &mut NoLender).expect("B's header on device 1 is durable"), 1);
    assert_eq!(control.lookup(&[b]), 1);
    drop(control);
    hanging.set_faults(FaultPlan::none());
    let (pool, _) = Pool::open(targets, Some(&geometry())).expect("reopen");
    assert_eq!(pool.index().get(b).map(|location| location.device), Some(1), "B committed durably");
}

/// Memory the controller reaches only by copies (`DmaAllocator::map_copied`), as it reaches
/// GPU memory: the host cannot read it through `translate`.
struct DeviceMemory(std::sync::Mutex<Vec<u8>>);

impl nvme_driver::hw::CopiedMemory for DeviceMemory {
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    fn read(&self, offset: usize, destination: &mut [u8]) -> std::result::Result<(), nvme_driver::HwError> {
        destination.copy_from_slice(&self.0.lock().unwrap()[offset..offset + destination.len()]);
        Ok(())
    }
    fn write(&self, offset: usize, source: &[u8]) -> std::result::Result<(), nvme_driver::HwError> {
        self.0.lock().unwrap()[offset..offset + source.len()].copy_from_slice(source);
        Ok(())
    }
    fn describe(&self) -> String {
        "test device memory".into()
    }
}

#[test]
fn a_pool_recording_payload_crcs_is_refused_kv_memory_the_host_cannot_read() {
    // Goal: a pool that records payload CRCs computes them at every commit from the engine's
    // memory on the CPU; memory the host cannot read (GPU memory) is refused when the store is
    // built, naming the setting, as the tuttid client refuses it. Only `verify_retrieves` used
    // to check it: the store was built, and every commit failed, after its reservation had
    // evicted cached blocks to make room.
    let fixture = fixture(1, None);
    let g = geometry();
    let memory = DeviceMemory(std::sync::Mutex::new(vec![0; (g.block_bytes() * u64::from(ENGINE_BLOCKS)) as usize]));
    let kv = fixture.dma.map_copied(Arc::new(memory)).expect("device memory");
    assert!(fixture.dma.translate(kv.iova(), 1).is_err(), "the host cannot read it");
    let layout = KvLayout::BlockMajor { base: kv.iova(), block_stride_bytes: g.block_bytes() };
    let registration = KvRegistration::new(g, ENGINE_BLOCKS, layout, DataPointerMode::Prp).expect("registration");
    let (pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("open");
    let config = StoreConfig { verify_retrieves: false, ..StoreConfig::default() };
    let executor = cpu_executor_for(&pool, 64, &config).expect("executor");
    match KvStore::new(pool, registration, fixture.dma.clone(), executor, config) {
        Err(ObjstoreError::InvalidRegistration { reason }) => assert!(reason.contains("payload CRC"), "{reason}"),
        Err(other) => panic!("expected InvalidRegistration, got {other:?}"),
        Ok(_) => panic!("a store whose every commit must fail was built"),
    }
}

#[test]
fn key_zero_is_refused() {
    // Goal: 0 is no block's key (the index marks unused entries with it): a request naming it
    // is refused before anything is reserved, both ways.
    let fixture = fixture(1, Some(4));
    let (mut control, _data) = halves(&fixture, StoreConfig::default());
    assert!(matches!(control.reserve_store(&[7, 0], &[0, 1], &mut NoLender), Err(ObjstoreError::BadRequest { .. })));
    assert!(matches!(control.reserve_retrieve(&[0], &[0], 0), Err(ObjstoreError::BadRequest { .. })));
    commit_recorded(&mut control, &[7]);
    assert_eq!(control.pool().index().cached_prefix(&[7]), 1);
}

#[test]
fn a_retrieve_into_one_engine_block_twice_is_refused() {
    // Goal: a retrieve naming one engine block for two blocks is refused before anything is
    // read (one read would overwrite the other, and a verified retrieve would condemn a good
    // slot for it); nothing stays reserved, and the same blocks retrieve into distinct ones.
    let fixture = fixture(1, None);
    let mut store = in_process(&fixture, StoreConfig { verify_retrieves: true, ..StoreConfig::default() });
    let tokens = tokens(31, 2);
    let keys = store_two_blocks(&fixture, &mut store, &tokens);
    match store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[5, 5] }) {
        Err(ObjstoreError::BadRequest { reason }) => assert!(reason.contains("engine block 5"), "{reason}"),
        other => panic!("expected BadRequest, got {other:?}"),
    }
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[4, 5] }).expect("prepare_retrieve");
    for layer in 0..geometry().layers {
        store.retrieve_layer(handle, layer, BUDGET).unwrap();
        assert_eq!(store.wait(handle, deadline()).expect("verified"), Some(layer));
    }
    store.finish(handle).expect("finish");
    assert!(holds(&fixture, 4, keys[0]) && holds(&fixture, 5, keys[1]), "byte-exact");
    assert_eq!(store.lookup(&tokens), 2);
}

/// A CPU executor that deletes its queue pairs at retirement but does not say so (answers
/// `None`, the trait's default, which no executor in the tree keeps any more).
struct DoesNotReport {
    inner: CpuExecutor,
}

impl gio_uring::Executor for DoesNotReport {
    fn name(&self) -> &'static str {
        "does not report"
    }

    fn attach(&mut self, memory: &std::sync::Arc<gio_uring::layout::QueueMemory>) -> std::result::Result<(), GioError> {
        self.inner.attach(memory)
    }

    fn prepared(&mut self, memory: &gio_uring::layout::QueueMemory, id: gio_uring::IocbId) -> std::result::Result<(), GioError> {
        self.inner.prepared(memory, id)
    }

    fn submit(&mut self, memory: &gio_uring::layout::QueueMemory, batch: &gio_uring::IssueBatch) -> std::result::Result<(), GioError> {
        self.inner.submit(memory, batch)
    }

    fn poll(&mut self, memory: &gio_uring::layout::QueueMemory) -> std::result::Result<(), GioError> {
        self.inner.poll(memory)
    }

    fn retire_queue_pairs(&mut self) -> Option<bool> {
        let _ = self.inner.retire_queue_pairs();
        None
    }
}

#[test]
fn into_pool_keeps_the_reservations_when_a_store_layer_may_still_be_written() {
    // Goal: giving the pool back while a layer is in flight, over an executor that does not
    // say whether its queue pairs are gone, keeps that layer's request's reservation (see
    // `into_pool_with_a_layer_in_flight_releases_the_requests_with_none` for the others) and
    // says the engine must keep its KV memory (`into_pool_reporting` answers false, as `close`
    // would). A store
    // layer's late write may still land in the store's slot, which must not be reused (it
    // used to go back to the free list, so a later commit could be overwritten by it); a
    // retrieve layer's late read may still write the KV memory, and its slots stay pinned
    // (they used to be unpinned, and nothing told the caller to keep the memory). With nothing
    // in flight the same executor's requests are released as usual, and the memory may go.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum InFlight {
        Store,
        Retrieve,
        Nothing,
    }
    let config = StoreConfig { requests_max: 2, ..StoreConfig::default() };
    for in_flight in [InFlight::Store, InFlight::Retrieve, InFlight::Nothing] {
        let fixture = fixture(1, Some(8));
        let (pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("open");
        let executor = DoesNotReport { inner: cpu_executor_for(&pool, 64, &config).expect("executor") };
        let mut store = KvStore::new(pool, fixture.registration.clone(), fixture.dma.clone(), executor, config).expect("store");
        store.set_key_seed(SEED);
        let tokens = tokens(31, 1);
        fill(&fixture, 0, keys_of(&tokens)[0]);
        let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0] }).expect("prepare_store");
        store.store_layer(plan.handle, 0, BUDGET).expect("store_layer");
        if in_flight != InFlight::Store {
            assert_eq!(store.wait(plan.handle, deadline()).expect("wait"), Some(0));
        }
        if in_flight == InFlight::Retrieve {
            for layer in 1..geometry().layers {
                store.store_layer(plan.handle, layer, BUDGET).expect("store_layer");
                assert_eq!(store.wait(plan.handle, deadline()).expect("wait"), Some(layer));
            }
            assert_eq!(store.commit_store(plan.handle).expect("commit"), 1);
            let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[4] }).expect("prepare_retrieve");
            store.retrieve_layer(handle, 0, BUDGET).expect("retrieve_layer");
        }
        let (pool, memory_may_go) = store.into_pool_reporting();
        let counts = pool.index().counts();
        let expected = match in_flight {
            InFlight::Store => (1, 1, 7, false),
            InFlight::Retrieve => (0, 1, 7, false),
            InFlight::Nothing => (0, 0, 8, true),
        };
        assert_eq!(
            (counts.writing_slots, counts.pinned_slots, counts.free_slots, memory_may_go),
            expected,
            "{in_flight:?} in flight: {counts:?}"
        );
    }
}

#[test]
fn into_pool_with_a_layer_in_flight_releases_the_requests_with_none() {
    // Goal: over an executor that does not say whether its queue pairs are gone, giving the
    // pool back with a retrieve layer in flight keeps that retrieve's pins (its late read may
    // still come), but a store with no layer in flight (one written and waited for) has no
    // command left that could write its slot: its slot goes back to the free list. Every reservation used to be kept, the idle store's slot Writing
    // until a reopen.
    let config = StoreConfig { requests_max: 3, ..StoreConfig::default() };
    let fixture = fixture(1, Some(8));
    let (pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("open");
    let executor = DoesNotReport { inner: cpu_executor_for(&pool, 64, &config).expect("executor") };
    let mut store = KvStore::new(pool, fixture.registration.clone(), fixture.dma.clone(), executor, config).expect("store");
    store.set_key_seed(SEED);
    let cached = tokens(41, 1);
    let idle = tokens(42, 1);
    fill(&fixture, 0, keys_of(&cached)[0]);
    let plan = store.prepare_store(&KvRequest { tokens: &cached, block_ids: &[0] }).expect("prepare_store");
    for layer in 0..geometry().layers {
        store.store_layer(plan.handle, layer, BUDGET).expect("store_layer");
        assert_eq!(store.wait(plan.handle, deadline()).expect("wait"), Some(layer));
    }
    assert_eq!(store.commit_store(plan.handle).expect("commit"), 1);
    let retrieve = store.prepare_retrieve(&KvRequest { tokens: &cached, block_ids: &[4] }).expect("prepare_retrieve");
    let idle_store = store.prepare_store(&KvRequest { tokens: &idle, block_ids: &[1] }).expect("prepare_store");
    store.store_layer(idle_store.handle, 0, BUDGET).expect("store_layer");
    assert_eq!(store.wait(idle_store.handle, deadline()).expect("wait"), Some(0));
    store.retrieve_layer(retrieve, 0, BUDGET).expect("retrieve_layer");
    let (pool, memory_may_go) = store.into_pool_reporting();
    assert!(!memory_may_go, "the retrieve's late read may still write the KV memory");
    let counts = pool.index().counts();
    assert_eq!(
        (counts.writing_slots, counts.pinned_slots, counts.free_slots),
        (0, 1, 7),
        "the retrieve's slot stays pinned, the idle store's is free again: {counts:?}"
    );
}

#[test]
fn close_keeps_the_mapping_table_while_a_layer_may_still_move_over_an_executor_that_does_not_say() {
    // Goal: `close` over an executor that does not say whether its queue pairs are gone
    // (`retire_queue_pairs` answers `None`, the trait's default) with a layer still in flight
    // (issued, never waited for) answers `false` and leaks the mapping table: that layer's
    // commands may still read the table's SGL descriptors and write the engine's KV memory
    // (a retrieve) or read it (a store). It used to answer `true`, and the table was freed
    // under the commands. With every layer reaped the same store closes as before: `true`,
    // nothing leaked.
    for layer_in_flight in [true, false] {
        let mut fixture = fixture(2, Some(8));
        let g = geometry();
        let layout = KvLayout::BlockMajor { base: fixture.region.iova(), block_stride_bytes: g.block_bytes() };
        fixture.registration = KvRegistration::new(g, ENGINE_BLOCKS, layout, DataPointerMode::Sgl).expect("registration");
        let config = StoreConfig { requests_max: 2, ..StoreConfig::default() };
        let (pool, _) = Pool::open(fixture.targets.clone(), Some(&g)).expect("open");
        let executor = DoesNotReport { inner: cpu_executor_for(&pool, 64, &config).expect("executor") };
        let mut store = KvStore::new(pool, fixture.registration.clone(), fixture.dma.clone(), executor, config).expect("store");
        assert_eq!(store.table().form(), crate::mapping::MappingForm::SglTable, "a table the device reads");
        store.set_key_seed(SEED);
        let tokens = tokens(31, 2);
        for (block, &key) in keys_of(&tokens).iter().enumerate() {
            fill(&fixture, block as u32, key);
        }
        let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1] }).expect("prepare_store");
        for layer in 0..g.layers {
            store.store_layer(plan.handle, layer, BUDGET).expect("store_layer");
            assert_eq!(store.wait(plan.handle, deadline()).expect("wait"), Some(layer));
        }
        assert_eq!(store.commit_store(plan.handle).expect("commit"), 2);
        let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[4, 5] }).expect("prepare_retrieve");
        store.retrieve_layer(handle, 0, BUDGET).expect("retrieve_layer");
        if !layer_in_flight {
            assert_eq!(store.wait(handle, deadline()).expect("wait"), Some(0));
        }
        let leaked_before = crate::leak::leaked_dma_regions_on_this_thread();
        let safe = store.close();
        let leaked = crate::leak::leaked_dma_regions_on_this_thread() - leaked_before;
        let expected = if layer_in_flight { (false, 1) } else { (true, 0) };
        assert_eq!((safe, leaked), expected, "layer in flight: {layer_in_flight}: (safe to free, tables leaked)");
    }
}

#[test]
fn a_commit_refused_before_it_begins_leaves_the_request_to_its_caller() {
    // Goal: the contract of a refused commit. Refused before it begins (a layer never stored,
    // or a retrieve's handle), the request is left as it was, still holding its slot, pins and
    // claimed keys: the caller stores the missing layer and commits again, or ends it with
    // `finish`, after which every request slot can be prepared again. A caller that forgot
    // the handle instead (as if the store had released it) would leak the request slot.
    let fixture = fixture(1, Some(8));
    let requests_max = 2;
    let mut store = in_process(&fixture, StoreConfig { requests_max, ..StoreConfig::default() });
    let cached = tokens(41, 1);
    store_two_blocks(&fixture, &mut store, &tokens(51, 2));
    let plan = store.prepare_store(&KvRequest { tokens: &cached, block_ids: &[0] }).expect("prepare_store");
    for layer in 0..geometry().layers - 1 {
        store.store_layer(plan.handle, layer, BUDGET).expect("store_layer");
        assert_eq!(store.wait(plan.handle, deadline()).expect("wait"), Some(layer));
    }
    match store.commit_store(plan.handle) {
        Err(ObjstoreError::HandleState { .. }) => {}
        other => panic!("a commit with the last layer never stored: expected HandleState, got {other:?}"),
    }
    assert_eq!(store.counts().writing_slots, 1, "the refused store still holds its slot");
    let retrieve = store.prepare_retrieve(&KvRequest { tokens: &tokens(51, 2), block_ids: &[4, 5] }).expect("prepare_retrieve");
    assert!(matches!(store.commit_store(retrieve), Err(ObjstoreError::HandleState { .. })), "not a store");
    // What the contract asks of the caller: finish both (or store the last layer and commit).
    store.finish(plan.handle).expect("the refused store is finished by its caller");
    store.finish(retrieve).expect("the retrieve is finished by its caller");
    let counts = store.counts();
    assert_eq!((counts.writing_slots, counts.pinned_slots), (0, 0), "{counts:?}");
    assert_eq!(store.lookup(&cached), 0, "nothing of the refused store is visible");
    let handles: Vec<RequestHandle> = (0..requests_max)
        .map(|_| store.prepare_retrieve(&KvRequest { tokens: &tokens(51, 2), block_ids: &[4, 5] }).expect("every request slot is free"))
        .collect();
    for handle in handles {
        store.finish(handle).expect("finish");
    }
}

/// A verified retrieve over two damaged blocks whose wait leaves the slots' Empty headers
/// staged (the header write does not fit its 500 ms deadline), finished; nothing synced.
fn evict_with_headers_left_staged(fixture: &Fixture, store: &mut KvStore<CpuExecutor>, tokens: &[u32]) {
    use nvme_driver::spec::{NvmeStatus, StatusCodeType};
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let keys = store_two_blocks(fixture, store, tokens);
    corrupt_layer_0_on_disk(fixture, store, &keys);
    let handle = store.prepare_retrieve(&KvRequest { tokens, block_ids: &[4, 5] }).expect("prepare_retrieve");
    let layers = geometry().layers;
    for layer in 0..layers - 1 {
        store.retrieve_layer(handle, layer, BUDGET).unwrap();
        store.wait(handle, deadline()).expect("an earlier layer");
    }
    store.retrieve_layer(handle, layers - 1, BUDGET).unwrap();
    // Own metadata queue: the header write fails; borrowed one: it is not submitted at all.
    let write_fault = FaultAction::Status(NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, 0x80));
    fixture.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, write_fault).with_opcode(0x01)));
    let result = store.wait(handle, Instant::now() + Duration::from_millis(500));
    assert!(matches!(result, Err(ObjstoreError::PayloadMismatch { .. })), "{result:?}");
    fixture.device.set_faults(FaultPlan::none());
    assert_eq!(store.lookup(tokens), 0, "out of the index at once");
    store.finish(handle).expect("finish");
}

#[test]
fn staged_eviction_headers_are_written_when_the_store_ends() {
    // Goal: the Empty headers of an eviction whose wait left them staged reach the disk when
    // the store ends (close, drop, into_pool then drop) with no commit or sync_headers in
    // between, also where the pool's metadata borrows the executor's queue pair: they used to
    // be dropped with the mirror, and a reopen served the condemned blocks again.
    type End = fn(KvStore<CpuExecutor>);
    let ends: [(&str, End); 3] =
        [("close", |store| assert!(store.close())), ("drop", drop), ("into_pool", |store| drop(store.into_pool()))];
    for queue_pairs in [None, Some(1)] {
        for (round, (name, end)) in ends.iter().enumerate() {
            let config = queue_pairs.map_or(EmuConfig::default(), |max| EmuConfig::default().with_io_queue_pairs_max(max));
            let fixture = fixture_on(config, 2, None);
            let mut store = in_process(&fixture, StoreConfig { verify_retrieves: true, requests_max: 2, ..StoreConfig::default() });
            assert_eq!(store.pool().metadata_queue_shared(0), queue_pairs.is_some());
            evict_with_headers_left_staged(&fixture, &mut store, &tokens(17 + round as u32, 2));
            end(store);
            let (_, report) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("reopen");
            assert_eq!(
                report.cached_blocks, 0,
                "{name}, queue pairs {queue_pairs:?}: the evicted blocks are served after a reopen: {report:?}"
            );
        }
    }
}

#[test]
fn each_committed_slot_keeps_the_generation_its_header_was_written_with() {
    // Goal: `Index::generation_of` says what the slot's header on disk says. A commit stages
    // one header per slot, each taking the pool's next generation, but entered every slot of
    // the commit into the index with the last one: two slots of one commit agreed in memory
    // and differed on disk (and after a reopen).
    let fixture = fixture(1, None);
    let mut store = in_process(&fixture, StoreConfig::default());
    let keys = store_two_blocks(&fixture, &mut store, &tokens(30, 2));
    let generations = |index: &crate::index::Index| -> Vec<u64> {
        keys.iter()
            .map(|&key| {
                let at = index.get(key).expect("cached");
                index.generation_of(at.device, at.slot)
            })
            .collect()
    };
    let in_memory = generations(store.pool().index());
    assert_ne!(in_memory[0], in_memory[1], "two slots, two headers: {in_memory:?}");
    drop(store);
    let (pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("reopen");
    assert_eq!(generations(pool.index()), in_memory, "in memory as on disk");
}

/// Stages one Valid header (key 0xBAD) for slot 3 of device 0 at `generation`, as another
/// tool may have written it, and writes it out.
fn valid_header_at(fixture: &Fixture, generation: u64) {
    let (mut pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("open");
    pool.generation = generation - 1;
    let record = crate::format::BlockRecord { key: 0xBAD, token_count: 16, payload_crc: 1 };
    assert_eq!(pool.stage_header(0, 3, crate::format::SlotState::Valid, &[record]).expect("stage"), generation);
    pool.sync_headers(&mut NoLender).expect("sync");
}

#[test]
fn every_header_a_pool_stages_is_accepted_at_its_next_open() {
    // Goal: whatever generation the pool counts to, its next open accepts the headers it
    // staged. A pool that opened on one header near the acceptance bound (2^62 here: the bound
    // decode had while the pool counted on to 2^63) used to write every later commit above it:
    // all refused as Corrupt at the next open, so each restart lost every commit since the
    // last one. Here one Valid header is staged near the bound, the pool reopened, two blocks
    // committed and the pool reopened again: all three served, nothing corrupt.
    for start in [1 << 62, crate::format::GENERATION_MAX - 16] {
        let fixture = fixture(1, None);
        valid_header_at(&fixture, start);
        let (pool, report) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("reopen");
        assert_eq!((report.corrupt_headers, report.valid_slots), (0, 1), "start {start}: {report:?}");
        drop(pool);
        let mut store = in_process(&fixture, StoreConfig::default());
        let keys = store_two_blocks(&fixture, &mut store, &tokens(31, 2));
        drop(store);
        let (pool, report) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("reopen after the commits");
        assert_eq!((report.corrupt_headers, report.valid_slots), (0, 3), "start {start}: {report:?}");
        for key in keys.iter().chain(&[0xBAD]) {
            assert!(pool.index().get(*key).is_some(), "start {start}: key {key:#x} served");
        }
    }
}

#[test]
fn a_header_at_the_largest_generation_refuses_every_later_stage_naming_it() {
    // Goal: one CRC-valid Valid header at the largest generation the pool counts to (a buggy or
    // hostile tool's; no pool commits that often) is served, and every later commit, eviction
    // and condemnation is refused loudly, naming that header, the bound and the way out (a
    // reformat), rather than "device 0: the pool's header generation count is exhausted".
    let fixture = fixture(1, None);
    valid_header_at(&fixture, crate::format::GENERATION_MAX);
    let (mut pool, report) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("reopen");
    assert_eq!((report.corrupt_headers, report.valid_slots), (0, 1), "{report:?}");
    assert!(pool.index().get(0xBAD).is_some(), "the header is the pool's newest");
    let refused = |error: ObjstoreError| {
        let message = error.to_string();
        for part in ["device 0 slot 3", &crate::format::GENERATION_MAX.to_string(), "reformat"] {
            assert!(message.contains(part), "{part:?} in {message}");
        }
        assert!(
            matches!(
                error,
                ObjstoreError::GenerationExhausted { device: 0, slot: 3, generation: crate::format::GENERATION_MAX, read_at_open: true }
            ),
            "{error:?}"
        );
    };
    refused(pool.stage_header(0, 5, crate::format::SlotState::Empty, &[]).expect_err("an eviction is refused"));
    drop(pool);
    let mut store = in_process(&fixture, StoreConfig::default());
    let tokens = tokens(31, 2);
    let (_, handle) = stage_two_blocks(&fixture, &mut store, &tokens);
    refused(store.commit_store(handle).expect_err("a commit is refused"));
    assert_eq!(store.lookup(&tokens), 0, "nothing committed");
}

#[test]
fn a_stage_refused_before_it_reaches_the_mirror_leaves_its_generation_free() {
    // Goal: a header the pool could not stage (its device fenced) uses no generation and is
    // not named as the pool's newest. It used to: the count moved on before the fence check,
    // so with one generation left a refused eviction on a fenced device spent it, and the next
    // commit was refused with GenerationExhausted naming the header before it.
    let mut pool = two_device_control([6, 4]).into_pool();
    pool.generation = crate::format::GENERATION_MAX - 2;
    let record = crate::format::BlockRecord { key: 0xBAD, token_count: 16, payload_crc: 1 };
    assert_eq!(pool.stage_header(0, 3, crate::format::SlotState::Valid, &[record]).expect("stage"), crate::format::GENERATION_MAX - 1);
    pool.fence_for_test(1);
    match pool.stage_header(1, 2, crate::format::SlotState::Empty, &[]) {
        Err(ObjstoreError::MetadataFenced { device: 1, .. }) => {}
        other => panic!("expected MetadataFenced on device 1, got {other:?}"),
    }
    assert_eq!(
        pool.stage_header(0, 4, crate::format::SlotState::Valid, &[record]).expect("the last generation"),
        crate::format::GENERATION_MAX
    );
}

#[test]
fn a_count_exhausted_by_the_pools_own_headers_does_not_blame_another_tool() {
    // Goal: GenerationExhausted blames another tool only for a header read at open. With the
    // count run up by the pool's own headers (here set near the bound directly; no header read
    // at open claims much), it names the pool's last header, an eviction's Empty entry, as its
    // own. It used to say "another tool wrote that header" of it.
    let fixture = fixture(1, None);
    let (mut pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("open");
    pool.generation = crate::format::GENERATION_MAX - 1;
    assert_eq!(pool.stage_header(0, 5, crate::format::SlotState::Empty, &[]).expect("stage"), crate::format::GENERATION_MAX);
    let error = pool.stage_header(0, 6, crate::format::SlotState::Empty, &[]).expect_err("the count is at its bound");
    let message = error.to_string();
    for part in ["device 0 slot 5", "wrote itself", "reformat"] {
        assert!(message.contains(part), "{part:?} in {message}");
    }
    assert!(!message.contains("another tool"), "{message}");
    assert!(
        matches!(
            error,
            ObjstoreError::GenerationExhausted { device: 0, slot: 5, generation: crate::format::GENERATION_MAX, read_at_open: false }
        ),
        "{error:?}"
    );
}

#[test]
fn a_count_exhausted_after_a_header_read_at_open_names_that_header() {
    // Goal: a header read at open one short of the bound leaves the pool one header; once it
    // wrote that one, the refusal names the header read at open and what it claimed, not the
    // pool's own last header. Here the pool wrote that header itself (counting on from a count
    // set near the bound, as it would from another tool's header read at an earlier open), so
    // the refusal must not say flatly that another tool wrote it: it used to.
    let fixture = fixture(1, None);
    valid_header_at(&fixture, crate::format::GENERATION_MAX - 1);
    let (mut pool, _) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("reopen");
    assert_eq!(pool.stage_header(0, 5, crate::format::SlotState::Empty, &[]).expect("the last generation"), crate::format::GENERATION_MAX);
    let error = pool.stage_header(0, 6, crate::format::SlotState::Empty, &[]).expect_err("the count is at its bound");
    let message = error.to_string();
    for part in [
        "device 0 slot 3",
        &(crate::format::GENERATION_MAX - 1).to_string(),
        "read at open",
        "another tool wrote it, or the pool counted on from a header another tool wrote",
        "reformat",
    ] {
        assert!(message.contains(part), "{part:?} in {message}");
    }
    assert!(!message.contains("so another tool wrote that header"), "{message}");
    assert!(
        matches!(
            error,
            ObjstoreError::GenerationExhausted { device: 0, slot: 3, generation, read_at_open: true } if generation == crate::format::GENERATION_MAX - 1
        ),
        "{error:?}"
    );
}

#[test]
fn a_commit_whose_count_runs_out_midway_leaves_none_of_it_after_a_reopen() {
    // Goal: a commit refused because the header count ran out partway through staging its
    // headers is not visible after a restart. With one generation left and two slots, the
    // last slot was staged Valid at the bound, the next stage was refused, and the rollback's
    // Empty stage was refused too: the Valid entry stayed staged and the store's drop wrote
    // it, so the reopened pool served the tail of a commit reported failed.
    let fixture = fixture(1, None);
    valid_header_at(&fixture, crate::format::GENERATION_MAX - 1);
    let mut store = in_process(&fixture, StoreConfig::default());
    let tokens = tokens(41, 2);
    let (keys, handle) = stage_two_blocks(&fixture, &mut store, &tokens);
    let slots: std::collections::BTreeSet<u32> = plan_slots(&store, handle);
    assert_eq!(slots.len(), 2, "one slot per block: {slots:?}");
    match store.commit_store(handle) {
        Err(ObjstoreError::GenerationExhausted { .. }) => {}
        other => panic!("the second header finds the count at its bound: expected GenerationExhausted, got {other:?}"),
    }
    assert_eq!(store.lookup(&tokens), 0, "nothing committed");
    drop(store);
    let (pool, report) = Pool::open(fixture.targets.clone(), Some(&geometry())).expect("reopen");
    assert_eq!((report.corrupt_headers, report.valid_slots), (0, 1), "only the header read at open: {report:?}");
    for &key in &keys {
        assert!(pool.index().get(key).is_none(), "key {key:#x} of the failed commit is not served");
    }
    assert!(pool.index().get(0xBAD).is_some());
}

/// The slots a store request's placements are in.
fn plan_slots(store: &KvStore<CpuExecutor>, handle: RequestHandle) -> std::collections::BTreeSet<u32> {
    store.control.placements(handle).unwrap().iter().map(|p| p.location.slot).collect()
}

use nvme_driver::spec::{NvmOpcode, NvmeStatus};

/// A control half over a pool of two namespaces (one-block slots, 8 each) on one software
/// controller whose admin commands time out after `admin_timeout`, the metadata timeout
/// `metadata_timeout`; and the controller, for faults.
fn two_device_control_on_one_controller(admin_timeout: Duration, metadata_timeout: Duration) -> (Arc<EmuDevice>, StoreControl) {
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 32 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, Some(8 << 20)), NamespaceConfig::new(512, Some(8 << 20))]);
    let device = EmuDevice::start(config).expect("software controller");
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let config = ControllerConfig { admin_timeout, ..ControllerConfig::default() };
    let controller = Arc::new(Controller::init(backend, config).expect("bring-up"));
    let targets: Vec<PoolTarget> = [1, 2].map(|ns| PoolTarget { controller: controller.clone(), namespace: NamespaceId(ns) }).to_vec();
    let params = FormatParams { slot_count_max: Some(8), ..FormatParams::new(geometry()) };
    format_pool(&targets, &params).expect("format");
    let (mut pool, _) = Pool::open(targets, Some(&geometry())).expect("open");
    pool.set_metadata_timeout(metadata_timeout);
    (device, StoreControl::new(pool, 4).expect("control"))
}

#[test]
fn a_commit_that_fails_before_staging_its_headers_leaves_nothing_staged() {
    // Goal: a commit whose flush fails stages no header: its slots read Empty on disk already
    // (`reserve_store` made them so), so nothing is left for a later sync or the pool's drop
    // to write. Its error path used to stage every slot Empty again, so the drop of a pool
    // whose controller then stopped answering waited out a header write per device.
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let (device, mut control) = two_device_control_on_one_controller(Duration::from_secs(10), Duration::from_secs(10));
    let keys = keys_of(&tokens(500, 2));
    let plan = control.reserve_store(&keys, &[0, 1], &mut NoLender).expect("reserve");
    let devices: Vec<u16> = control.placements(plan.handle).unwrap().iter().map(|p| p.location.device).collect();
    assert_eq!(devices, [0, 1], "one slot on each device");
    assert!(!control.pool().headers_staged());
    let failed = NvmeStatus::generic(nvme_driver::spec::status::codes::INTERNAL_ERROR);
    device
        .set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::Status(failed)).with_opcode(NvmOpcode::Flush as u8)));
    assert!(control.commit_store(plan.handle, None, &mut NoLender).is_err(), "the flush fails");
    device.set_faults(FaultPlan::none());
    assert!(!control.pool().headers_staged(), "no Valid header was staged, so none is staged Empty again");
    assert_eq!(control.lookup(&keys), 0);
}

#[test]
fn a_commit_whose_header_write_fails_stages_its_valid_headers_empty_again() {
    // Goal: the error path still undoes what was staged: a commit whose header sync fails
    // (after its Valid headers were staged) leaves them staged Empty, and a reopen after the
    // next sync finds both slots Empty.
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let (device, mut control) = two_device_control_on_one_controller(Duration::from_secs(10), Duration::from_secs(10));
    let keys = keys_of(&tokens(510, 2));
    let plan = control.reserve_store(&keys, &[0, 1], &mut NoLender).expect("reserve");
    let failed = NvmeStatus::generic(nvme_driver::spec::status::codes::INTERNAL_ERROR);
    device.set_faults(
        FaultPlan::none().with_rule(FaultRule::every_nth_io(1, FaultAction::Status(failed)).with_opcode(NvmOpcode::Write as u8)),
    );
    assert!(control.commit_store(plan.handle, None, &mut NoLender).is_err(), "the header writes fail");
    device.set_faults(FaultPlan::none());
    assert!(control.pool().headers_staged(), "the Valid headers staged are staged Empty again");
    control.sync_headers(&mut NoLender, deadline()).expect("sync");
    let targets: Vec<PoolTarget> = (0..2).map(|d| control.pool().target(d).clone()).collect();
    drop(control);
    let (_, report) = Pool::open(targets, Some(&geometry())).expect("reopen");
    assert_eq!(report.valid_slots, 0);
}

#[test]
fn dropping_a_store_after_its_controller_died_at_a_commit_does_not_wait_out_header_writes() {
    // Goal: the controller of both pool devices goes fatal (CSTS.CFS) at a commit's flush; the
    // commit fails; dropping the store then returns within one admin timeout (and a margin).
    // It used to write the Empty headers the failed commit staged for every slot, waiting out
    // the metadata timeout on each device that was not fenced.
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let admin_timeout = Duration::from_millis(200);
    let metadata_timeout = Duration::from_millis(1500);
    let (device, mut control) = two_device_control_on_one_controller(admin_timeout, metadata_timeout);
    let keys = keys_of(&tokens(520, 2));
    let plan = control.reserve_store(&keys, &[0, 1], &mut NoLender).expect("reserve");
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::ControllerFatal)));
    assert!(control.commit_store(plan.handle, None, &mut NoLender).is_err(), "the controller died at the flush");
    let started = Instant::now();
    drop(control);
    let took = started.elapsed();
    device.set_faults(FaultPlan::none());
    assert!(took < admin_timeout + Duration::from_millis(500), "dropping the store took {took:?}");
}

#[test]
fn evicting_a_retrieve_stages_each_slot_once() {
    // Goal: a retrieve of two blocks sharing one slot (k = 2) whose read failed evicts that
    // slot once: one Empty header staged (one generation), the two blocks gone. It used to
    // stage (and log) the slot once per block.
    let fixture = fixture(2, None);
    let (mut control, _data) = halves(&fixture, StoreConfig::default());
    let keys = keys_of(&tokens(530, 2));
    let plan = control.reserve_store(&keys, &[0, 1], &mut NoLender).expect("reserve");
    control.commit_store(plan.handle, Some(&[0, 0]), &mut NoLender).expect("commit");
    let handle = control.reserve_retrieve(&keys, &[2, 3], 0).expect("retrieve");
    let slots: Vec<(u16, u32)> = control.placements(handle).unwrap().iter().map(|p| (p.location.device, p.location.slot)).collect();
    assert_eq!(slots.len(), 2);
    assert_eq!(slots[0], slots[1], "both blocks in one slot");
    let before = control.pool().generation;
    assert_eq!(control.evict_retrieve_by(handle, &mut NoLender, None).expect("evict"), 2, "two blocks evicted");
    assert_eq!(control.pool().generation - before, 1, "one Empty header staged for the one slot");
    assert_eq!(control.lookup(&keys), 0);
}

#[test]
fn a_store_takes_the_iocbs_counted_before_its_reservation() {
    // Goal: the IOCB count `KvStore::prepare_store` refuses on before reserving (so that a
    // store short of IOCBs evicts nothing) is exactly what building the store's IOCBs takes,
    // with merged runs, slot boundaries and lanes: more would refuse stores that fit, fewer
    // would let a reservation evict and then fail NoFreeIocb.
    // With k = 4 on the SGL table: runs [1] [3 4 5] | [6] [9 10] [12], the slot boundary
    // splitting 3..=6.
    let blocks = [1u32, 3, 4, 5, 6, 9, 10, 12];
    for (mode, k) in [(DataPointerMode::Prp, 1), (DataPointerMode::Sgl, 1), (DataPointerMode::Sgl, 4)] {
        for lanes in [1, 2] {
            let mut fixture = fixture(k, None);
            let g = geometry();
            let layout = KvLayout::BlockMajor { base: fixture.region.iova(), block_stride_bytes: g.block_bytes() };
            fixture.registration = KvRegistration::new(g, ENGINE_BLOCKS, layout, mode).expect("registration");
            // One IOCTX per IOCB: the count is the commands', merged runs showing.
            let (mut control, mut data) = halves(&fixture, StoreConfig { ioctx_per_iocb_max: 1, ..StoreConfig::default() });
            data.set_layers_in_flight_max(lanes).expect("lanes");
            let keys = keys_of(&tokens(1, blocks.len()));
            let counted = data.store_iocbs(blocks.iter().copied(), k as usize);
            let free = data.queue().free_iocbs();
            let plan = control.reserve_store(&keys, &blocks, &mut NoLender).expect("reserve_store");
            data.prepare(plan.handle, Direction::Store, control.placements(plan.handle).unwrap(), None).expect("prepare");
            let form = data.table().form();
            assert_eq!(free - data.queue().free_iocbs(), counted, "{mode:?}, {form:?}, k = {k}, {lanes} lanes");
            assert!(counted > 0);
            data.finish(plan.handle).expect("finish");
            control.release(plan.handle).expect("release");
        }
    }
}
