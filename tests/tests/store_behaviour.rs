//! Eviction, deduplication of shared prefixes, pinning under concurrent retrieves, pools across
//! several controllers, and bad input — on the software controller with the CPU executor.

use std::time::Duration;

use nvme_driver::DataPointerMode;
use nvme_emu::NamespaceConfig;
use objstore::format::{Superblock, FORMAT_VERSION};
use objstore::{KvRequest, KvStore, ModelGeometry, ObjstoreError, Pool, StoreConfig};
use tutti_tests::*;

struct Rig {
    store: KvStore<gio_uring::CpuExecutor>,
    engine: Engine,
    controller: std::sync::Arc<nvme_driver::Controller>,
    _device: std::sync::Arc<nvme_emu::EmuDevice>,
}

fn rig(slots: u64) -> Rig {
    let device = start_device(vec![NamespaceConfig::new(512, None)], 8 << 20, true);
    let controller = bring_up(&device, Duration::from_secs(5));
    format(&targets(&controller, &[1]), 1, Some(slots));
    let engine = separate_kv(controller.dma(), 32, DataPointerMode::Sgl);
    let store = open_store(targets(&controller, &[1]), &engine, StoreConfig::default());
    Rig { store, engine, controller, _device: device }
}

#[test]
fn lru_eviction_keeps_recently_used_blocks() {
    // Goal: with 6 slots, storing 9 one-block requests evicts the least recently used; a block
    // retrieved in between survives; evicted prefixes are simply absent; survivors read back.
    let mut rig = rig(6);
    let mut rng = Rng(1);
    let requests: Vec<Vec<u32>> = (0..9).map(|_| rng.tokens(16)).collect();
    for tokens in &requests[..6] {
        store(&mut rig.store, &rig.engine, tokens, &[0]);
    }
    assert_eq!(rig.store.counts().free_slots, 0);
    retrieve(&mut rig.store, &rig.engine, &requests[0], &[5]); // request 0 becomes most recent
    for tokens in &requests[6..] {
        let plan = store(&mut rig.store, &rig.engine, tokens, &[1]);
        assert_eq!(plan.evicted_slots, 1);
    }
    let cached: Vec<usize> = requests.iter().map(|t| rig.store.lookup(t)).collect();
    assert_eq!(cached, vec![1, 0, 0, 0, 1, 1, 1, 1, 1]);
    let counts = rig.store.counts();
    assert_eq!((counts.valid_slots, counts.evictions, counts.pinned_slots), (6, 3, 0));
    for (i, tokens) in requests.iter().enumerate().filter(|(i, _)| cached[*i] == 1) {
        retrieve(&mut rig.store, &rig.engine, tokens, &[7]);
        assert!(rig.engine.holds(7, keys_of(tokens)[0], 4), "request {i}");
    }
    // Eviction survives a reopen: the evicted slots' headers were made Empty.
    drop(rig.store);
    let (_, report) = Pool::open(targets(&rig.controller, &[1]), None).unwrap();
    assert_eq!((report.valid_slots, report.corrupt_headers), (6, 0));
}

#[test]
fn shared_prefixes_are_stored_once() {
    // Goal: a second request sharing 3 blocks of prefix writes only its own blocks, also while
    // the first is still in flight (pending keys), and both prefixes read back whole.
    let mut rig = rig(64);
    let mut rng = Rng(2);
    let prefix = rng.tokens(48);
    let a: Vec<u32> = prefix.iter().copied().chain(rng.tokens(32)).collect();
    let b: Vec<u32> = prefix.iter().copied().chain(rng.tokens(16)).collect();
    let keys_a = keys_of(&a);
    let keys_b = keys_of(&b);
    for (i, key) in keys_a.iter().enumerate() {
        rig.engine.fill(i as u32, *key);
    }
    rig.engine.fill(10, keys_b[3]);
    let plan_a = rig.store.prepare_store(&KvRequest { tokens: &a, block_ids: &[0, 1, 2, 3, 4] }).unwrap();
    let plan_b = rig.store.prepare_store(&KvRequest { tokens: &b, block_ids: &[0, 1, 2, 10] }).unwrap();
    assert_eq!((plan_a.new_blocks, plan_a.shared_blocks), (5, 0));
    assert_eq!((plan_b.new_blocks, plan_b.shared_blocks), (1, 3));
    for layer in 0..4 {
        for handle in [plan_a.handle, plan_b.handle] {
            rig.store.store_layer(handle, layer, BUDGET).unwrap();
            rig.store.wait(handle, deadline()).unwrap();
        }
    }
    rig.store.commit_store(plan_b.handle).unwrap();
    assert_eq!(rig.store.lookup(&b), 0, "b's own block is committed but its prefix is not yet");
    rig.store.commit_store(plan_a.handle).unwrap();
    assert_eq!((rig.store.lookup(&a), rig.store.lookup(&b)), (5, 4));
    assert_eq!(rig.store.counts().cached_blocks, 6);
    let again = store(&mut rig.store, &rig.engine, &b, &[0, 1, 2, 10]);
    assert_eq!((again.new_blocks, again.shared_blocks), (0, 4));
    retrieve(&mut rig.store, &rig.engine, &b, &[20, 21, 22, 23]);
    for (i, block) in [20, 21, 22, 23].into_iter().enumerate() {
        assert!(rig.engine.holds(block, keys_b[i], 4), "block {i}");
    }
}

#[test]
fn pinned_slots_are_not_evicted_under_concurrent_retrieves() {
    // Goal: two retrieves in flight pin 3 of 4 slots; a store needing 2 slots is refused
    // (PoolFull), one needing 1 evicts the only unpinned slot; the retrieves, interleaved layer
    // by layer with the store, still read the right bytes.
    let mut rig = rig(4);
    let mut rng = Rng(3);
    let requests: Vec<Vec<u32>> = (0..4).map(|_| rng.tokens(16)).collect();
    let two: Vec<u32> = requests[0].iter().chain(&rng.tokens(16)).copied().collect();
    store(&mut rig.store, &rig.engine, &two, &[0, 1]);
    store(&mut rig.store, &rig.engine, &requests[1], &[2]);
    store(&mut rig.store, &rig.engine, &requests[2], &[3]);
    for block in [10, 11, 12] {
        rig.engine.scribble(block);
    }
    let r1 = rig.store.prepare_retrieve(&KvRequest { tokens: &two, block_ids: &[10, 11] }).unwrap();
    let r2 = rig.store.prepare_retrieve(&KvRequest { tokens: &requests[1], block_ids: &[12] }).unwrap();
    assert_eq!(rig.store.counts().pinned_slots, 3);
    let big: Vec<u32> = rng.tokens(32);
    let error = rig.store.prepare_store(&KvRequest { tokens: &big, block_ids: &[4, 5] }).unwrap_err();
    assert!(matches!(error, ObjstoreError::PoolFull { needed: 2, evictable: 1 }), "{error}");
    assert_eq!(rig.store.lookup(&requests[2]), 1, "a store that cannot fit must not evict anything");
    // A one-block store fits: it evicts the one unpinned slot.
    let new = rng.tokens(16);
    rig.engine.fill(6, keys_of(&new)[0]);
    let plan = rig.store.prepare_store(&KvRequest { tokens: &new, block_ids: &[6] }).unwrap();
    for layer in 0..4 {
        for handle in [r1, r2] {
            rig.store.retrieve_layer(handle, layer, BUDGET).unwrap();
        }
        rig.store.store_layer(plan.handle, layer, BUDGET).unwrap();
        for handle in [r1, r2, plan.handle] {
            rig.store.wait(handle, deadline()).unwrap();
        }
    }
    rig.store.commit_store(plan.handle).unwrap();
    assert_eq!(rig.store.lookup(&requests[2]), 0);
    rig.store.finish(r1).unwrap();
    rig.store.finish(r2).unwrap();
    let keys = keys_of(&two);
    assert!(rig.engine.holds(10, keys[0], 4) && rig.engine.holds(11, keys[1], 4));
    assert!(rig.engine.holds(12, keys_of(&requests[1])[0], 4));
    assert_eq!(rig.store.counts().pinned_slots, 0);
    assert_eq!(rig.store.lookup(&new), 1);
}

#[test]
fn a_store_pins_the_cached_blocks_it_shares() {
    // Goal: a store that shares a cached block pins that block's slot from prepare_store until
    // it commits or is finished. With the pool full and the shared slot the least recently
    // used, allocating the store's new block evicts another slot, not the shared one (which
    // left a gap: the committed prefix was unreachable). Pins end on commit and on finish.
    let mut rig = rig(4);
    let mut rng = Rng(12);
    let singles: Vec<Vec<u32>> = (0..4).map(|_| rng.tokens(16)).collect();
    for (i, tokens) in singles.iter().enumerate() {
        store(&mut rig.store, &rig.engine, tokens, &[i as u32]);
    }
    assert_eq!(rig.store.counts().free_slots, 0);
    // Request 0's slot is the least recently used; extend request 0 by one new block.
    let extended: Vec<u32> = singles[0].iter().copied().chain(rng.tokens(16)).collect();
    let keys = keys_of(&extended);
    rig.engine.fill(4, keys[0]);
    rig.engine.fill(5, keys[1]);
    let plan = rig.store.prepare_store(&KvRequest { tokens: &extended, block_ids: &[4, 5] }).unwrap();
    assert_eq!((plan.new_blocks, plan.shared_blocks, plan.evicted_slots), (1, 1, 1));
    assert_eq!(rig.store.lookup(&singles[0]), 1, "the shared block was not evicted");
    assert_eq!(rig.store.lookup(&singles[1]), 0, "the next least recently used slot was");
    assert_eq!(rig.store.counts().pinned_slots, 2, "the shared slot and the slot being written");
    // While the store is in flight, another store cannot evict the shared block either.
    let other = rng.tokens(48);
    let refused = rig.store.prepare_store(&KvRequest { tokens: &other, block_ids: &[6, 7, 12] }).unwrap_err();
    assert!(matches!(refused, ObjstoreError::PoolFull { needed: 3, evictable: 2 }), "{refused}");
    assert_eq!(rig.store.lookup(&singles[2]), 1, "a refused store evicts nothing");
    for layer in 0..4 {
        rig.store.store_layer(plan.handle, layer, BUDGET).unwrap();
        rig.store.wait(plan.handle, deadline()).unwrap();
    }
    rig.store.commit_store(plan.handle).unwrap();
    assert_eq!(rig.store.lookup(&extended), 2, "the whole prefix is cached");
    assert_eq!(rig.store.counts().pinned_slots, 0, "commit unpinned the shared slot");
    retrieve(&mut rig.store, &rig.engine, &extended, &[8, 9]);
    assert!(rig.engine.holds(8, keys[0], 4) && rig.engine.holds(9, keys[1], 4));
    // An abandoned store unpins too.
    let sharing: Vec<u32> = singles[2].iter().copied().chain(rng.tokens(16)).collect();
    let plan = rig.store.prepare_store(&KvRequest { tokens: &sharing, block_ids: &[10, 11] }).unwrap();
    assert_eq!(plan.shared_blocks, 1);
    assert_eq!(rig.store.counts().pinned_slots, 2);
    rig.store.finish(plan.handle).unwrap();
    assert_eq!(rig.store.counts().pinned_slots, 0);
}

#[test]
fn a_verified_retrieve_names_and_evicts_blocks_whose_bytes_changed_on_disk() {
    // Goal: with `verify_retrieves`, a block whose bytes on disk no longer match the payload CRC
    // recorded at commit fails the retrieve's last layer with PayloadMismatch naming that block;
    // the request's other blocks are delivered intact; the bad block's slot is evicted (lookup
    // stops before it, and after a reopen too, since its header was made Empty on disk).
    let device = start_device(vec![NamespaceConfig::new(512, None)], 8 << 20, true);
    let controller = bring_up(&device, Duration::from_secs(5));
    format(&targets(&controller, &[1]), 1, Some(16)); // records payload CRCs
    let engine = separate_kv(controller.dma(), 32, DataPointerMode::Sgl);
    let verified = StoreConfig { verify_retrieves: true, ..StoreConfig::default() };
    let mut kv = open_store(targets(&controller, &[1]), &engine, verified);
    let mut rng = Rng(14);
    let tokens = rng.tokens(48);
    let keys = keys_of(&tokens);
    store(&mut kv, &engine, &tokens, &[0, 1, 2]);
    retrieve(&mut kv, &engine, &tokens, &[3, 4, 5]); // intact: verified without complaint
                                                     // Flip one byte of block 1's layer-2 V object on disk, behind the store's back.
    let location = kv.pool().index().get(keys[1]).unwrap();
    let superblock = *kv.pool().superblock(0);
    let object_blocks = geometry().object_bytes() / 512;
    let lba = superblock.block_lba(location.slot, u32::from(location.index)) + 2 * superblock.layer_stride_blocks() + object_blocks;
    let mut sector = raw_read(&controller, 1, lba, 512);
    sector[100] ^= 0x01;
    raw_write(&controller, 1, lba, &sector);
    for block in [20, 21, 22] {
        engine.scribble(block);
    }
    let handle = kv.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[20, 21, 22] }).unwrap();
    for layer in 0..3 {
        kv.retrieve_layer(handle, layer, BUDGET).unwrap();
        assert_eq!(kv.wait(handle, deadline()).unwrap(), Some(layer), "layers before the last are not judged yet");
    }
    kv.retrieve_layer(handle, 3, BUDGET).unwrap();
    match kv.wait(handle, deadline()) {
        Err(ObjstoreError::PayloadMismatch { blocks, .. }) => {
            assert_eq!(blocks.len(), 1, "{blocks:?}");
            assert_eq!((blocks[0].position, blocks[0].engine_block, blocks[0].slot), (1, 21, location.slot), "{blocks:?}");
        }
        other => panic!("expected a payload mismatch, got {other:?}"),
    }
    assert!(engine.holds(20, keys[0], 4) && engine.holds(22, keys[2], 4), "the good blocks were delivered");
    assert!(!engine.holds(21, keys[1], 4));
    kv.finish(handle).unwrap();
    assert_eq!(kv.lookup(&tokens), 1, "block 1 was evicted: the prefix stops there");
    assert_eq!((kv.counts().valid_slots, kv.counts().pinned_slots), (2, 0));
    retrieve(&mut kv, &engine, &tokens[..16], &[23]);
    assert!(engine.holds(23, keys[0], 4));
    drop(kv);
    let (pool, report) = Pool::open(targets(&controller, &[1]), None).unwrap();
    assert_eq!((report.valid_slots, report.corrupt_headers), (2, 0), "the evicted slot's header is Empty on disk");
    drop(pool);
    // Verification needs the CRCs: a pool formatted without them is refused.
    let plain = objstore::FormatParams { slot_count_max: Some(16), ..objstore::FormatParams::new(geometry()) };
    objstore::format_pool(&targets(&controller, &[1]), &plain).unwrap();
    let (pool, _) = Pool::open(targets(&controller, &[1]), None).unwrap();
    let executor = objstore::cpu_executor_for(&pool, 64, &verified).unwrap();
    let Err(refused) = KvStore::new(pool, engine.registration.clone(), engine.dma.clone(), executor, verified) else {
        panic!("verification without recorded CRCs")
    };
    assert!(refused.to_string().contains("payload CRCs"), "{refused}");
}

#[test]
fn api_misuse_and_bad_requests_are_typed_errors() {
    let mut rig = rig(16);
    let mut rng = Rng(4);
    let tokens = rng.tokens(40); // 2 full blocks
    let too_far = rig.store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 32] }).unwrap_err();
    assert!(matches!(too_far, ObjstoreError::BlockOutOfRange { block: 32, num_blocks: 32 }), "{too_far}");
    let too_many = rig.store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1, 2] }).unwrap_err();
    assert!(matches!(too_many, ObjstoreError::BadRequest { .. }), "{too_many}");
    let uncached = rig.store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[0] }).unwrap_err();
    assert!(uncached.to_string().contains("not cached"), "{uncached}");
    let plan = rig.store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1] }).unwrap();
    let past = rig.store.store_layer(plan.handle, 4, BUDGET).unwrap_err();
    assert!(matches!(past, ObjstoreError::LayerOutOfRange { layer: 4, layers: 4 }), "{past}");
    assert!(matches!(rig.store.retrieve_layer(plan.handle, 0, BUDGET), Err(ObjstoreError::HandleState { .. })));
    assert!(matches!(rig.store.commit_store(plan.handle), Err(ObjstoreError::HandleState { .. })));
    rig.store.store_layer(plan.handle, 0, BUDGET).unwrap();
    let overlap = rig.store.store_layer(plan.handle, 1, BUDGET).unwrap_err();
    assert!(overlap.to_string().contains("still in flight"), "{overlap}");
    assert!(matches!(rig.store.finish(plan.handle), Err(ObjstoreError::HandleState { .. })));
    assert_eq!(rig.store.wait(plan.handle, deadline()).unwrap(), Some(0));
    assert_eq!(rig.store.wait(plan.handle, deadline()).unwrap(), None);
    rig.store.finish(plan.handle).unwrap(); // abandon: slots back, nothing visible
    assert!(matches!(rig.store.store_layer(plan.handle, 1, BUDGET), Err(ObjstoreError::UnknownHandle { .. })));
    assert_eq!(rig.store.lookup(&tokens), 0);
    assert_eq!(rig.store.counts().free_slots, 16);
}

#[test]
fn open_refuses_other_geometries_versions_and_damaged_superblocks() {
    // Goal: geometry mismatch names both sides; a newer version, a flipped superblock byte, an
    // unformatted namespace are typed errors; a damaged slot header loses only its own block.
    let rig = rig(16);
    let mut rig = rig;
    let mut rng = Rng(5);
    let a = rng.tokens(16);
    let b = rng.tokens(16);
    store(&mut rig.store, &rig.engine, &a, &[0]);
    store(&mut rig.store, &rig.engine, &b, &[1]);
    let controller = rig.controller.clone();
    drop(rig.store);
    let other = ModelGeometry::llama3_8b(16);
    let Err(error) = Pool::open(targets(&controller, &[1]), Some(&other)) else { panic!("opened a pool of another geometry") };
    let message = error.to_string();
    assert!(message.contains("32 layers") && message.contains("4 layers"), "{message}");
    let superblock = raw_read(&controller, 1, 0, 4096);
    let decoded = Superblock::decode(&superblock, 0, 512, controller.namespaces()[0].size_blocks).unwrap();
    // Damage the first slot header (slot 0 holds request a's block).
    let header_lba = decoded.header_lba;
    let mut headers = raw_read(&controller, 1, header_lba, 512);
    headers[9] ^= 0xFF;
    raw_write(&controller, 1, header_lba, &headers);
    let engine = separate_kv(controller.dma(), 32, DataPointerMode::Sgl);
    let (pool, report) = Pool::open(targets(&controller, &[1]), None).unwrap();
    assert_eq!((report.valid_slots, report.corrupt_headers), (1, 1));
    let executor = objstore::cpu_executor_for(&pool, 64, &StoreConfig::default()).unwrap();
    let mut store = KvStore::new(pool, engine.registration.clone(), engine.dma.clone(), executor, StoreConfig::default()).unwrap();
    assert_eq!((store.lookup(&a), store.lookup(&b)), (0, 1));
    retrieve(&mut store, &engine, &b, &[9]);
    assert!(engine.holds(9, keys_of(&b)[0], 4));
    drop(store);
    let with_version = |version: u32| {
        let mut bytes = superblock.clone();
        bytes[8..12].copy_from_slice(&version.to_le_bytes());
        let crc = crc32fast::hash(&bytes[..252]);
        bytes[252..256].copy_from_slice(&crc.to_le_bytes());
        bytes
    };
    raw_write(&controller, 1, 0, &with_version(FORMAT_VERSION + 1)[..512]);
    assert!(matches!(
        Pool::open(targets(&controller, &[1]), None),
        Err(ObjstoreError::NewerFormatVersion { found, supported: FORMAT_VERSION, sealed: true, .. }) if found == FORMAT_VERSION + 1
    ));
    // Version 1 had this layout with keys of the first hash scheme, version 2 all-zero Empty
    // headers: both refused, with the fix.
    for older in [1, 2] {
        raw_write(&controller, 1, 0, &with_version(older)[..512]);
        match Pool::open(targets(&controller, &[1]), None) {
            Err(error @ ObjstoreError::OlderFormatVersion { found, .. }) if found == older => {
                assert!(error.to_string().contains("tutti pool format"), "{error}")
            }
            Err(other) => panic!("expected OlderFormatVersion, got {other}"),
            Ok(_) => panic!("a version {older} pool was opened"),
        }
    }
    let mut flipped = superblock.clone();
    flipped[100] ^= 1;
    raw_write(&controller, 1, 0, &flipped[..512]);
    assert!(matches!(Pool::open(targets(&controller, &[1]), None), Err(ObjstoreError::CorruptSuperblock { .. })));
    raw_write(&controller, 1, 0, &vec![0u8; 512]);
    let Err(error) = Pool::open(targets(&controller, &[1]), None) else { panic!("opened an unformatted namespace") };
    assert!(error.to_string().contains("magic"), "{error}");
}

#[test]
fn a_zeroed_header_region_is_reported_as_damage() {
    // Goal: wiping the slot-header region (zeroed or deallocated LBAs) is not "an empty pool":
    // open counts every slot's header as corrupt and zeroed, so the loss of the committed
    // blocks is visible (`tutti pool check` fails on it). A freshly formatted pool has none.
    let mut rig = rig(16);
    let (_, fresh) = Pool::open(targets(&rig.controller, &[1]), None).unwrap();
    assert_eq!((fresh.empty_slots, fresh.corrupt_headers, fresh.zeroed_headers), (16, 0, 0), "format writes tagged Empty entries");
    let mut rng = Rng(11);
    let tokens = rng.tokens(32);
    store(&mut rig.store, &rig.engine, &tokens, &[0, 1]);
    drop(rig.store);
    let superblock = Superblock::decode(&raw_read(&rig.controller, 1, 0, 512), 0, 512, rig.controller.namespaces()[0].size_blocks).unwrap();
    let zeros = vec![0u8; superblock.header_region_bytes() as usize];
    raw_write(&rig.controller, 1, superblock.header_lba, &zeros);
    let (pool, report) = Pool::open(targets(&rig.controller, &[1]), None).unwrap();
    assert_eq!((report.valid_slots, report.empty_slots, report.corrupt_headers, report.zeroed_headers), (0, 0, 16, 16), "{report:?}");
    // The pool stays usable: damaged slots are free, and each is made Empty before reuse.
    let executor = objstore::cpu_executor_for(&pool, 64, &StoreConfig::default()).unwrap();
    let mut kv = KvStore::new(pool, rig.engine.registration.clone(), rig.engine.dma.clone(), executor, StoreConfig::default()).unwrap();
    assert_eq!(kv.lookup(&tokens), 0);
    store(&mut kv, &rig.engine, &tokens, &[0, 1]);
    drop(kv);
    let (_, report) = Pool::open(targets(&rig.controller, &[1]), None).unwrap();
    assert_eq!((report.valid_slots, report.zeroed_headers), (2, 14), "{report:?}");
}

#[test]
fn one_granted_queue_pair_serves_data_and_metadata() {
    // Goal: on a controller that grants a single I/O queue pair, the pool's metadata (header
    // writes, flushes) borrows the CPU executor's queue pair between its commands. A commit
    // while another request's layer is in flight on that queue first lets those reads finish
    // (their completion is kept for that request's wait), and every byte is right. Executors
    // that cannot lend, and pools needing more queue pairs than granted, are refused at setup
    // with the counts and the reason.
    let config = device_config(vec![NamespaceConfig::new(512, Some(4 << 20)), NamespaceConfig::new(512, Some(4 << 20))], 8 << 20, true)
        .with_io_queue_pairs_max(1);
    let device = nvme_emu::EmuDevice::start(config).unwrap();
    let controller = bring_up(&device, Duration::from_secs(5));
    format(&targets(&controller, &[1]), 1, Some(16));
    let engine = separate_kv(controller.dma(), 32, DataPointerMode::Sgl);
    let mut kv = open_store(targets(&controller, &[1]), &engine, StoreConfig::default());
    assert!(kv.pool().metadata_queue_shared(0));
    let mut rng = Rng(13);
    let first = rng.tokens(32);
    store(&mut kv, &engine, &first, &[0, 1]);
    let second = rng.tokens(48);
    let keys = keys_of(&second);
    for (i, key) in keys.iter().enumerate() {
        engine.fill(4 + i as u32, *key);
    }
    let plan = kv.prepare_store(&KvRequest { tokens: &second, block_ids: &[4, 5, 6] }).unwrap();
    for layer in 0..4 {
        kv.store_layer(plan.handle, layer, BUDGET).unwrap();
        kv.wait(plan.handle, deadline()).unwrap();
    }
    engine.scribble(8);
    engine.scribble(9);
    let reading = kv.prepare_retrieve(&KvRequest { tokens: &first, block_ids: &[8, 9] }).unwrap();
    kv.retrieve_layer(reading, 0, BUDGET).unwrap();
    kv.commit_store(plan.handle).unwrap(); // borrows the queue the reads are on
    assert_eq!(kv.wait(reading, deadline()).unwrap(), Some(0));
    for layer in 1..4 {
        kv.retrieve_layer(reading, layer, BUDGET).unwrap();
        kv.wait(reading, deadline()).unwrap();
    }
    kv.finish(reading).unwrap();
    let first_keys = keys_of(&first);
    assert!(engine.holds(8, first_keys[0], 4) && engine.holds(9, first_keys[1], 4));
    drop(kv);
    let mut kv = open_store(targets(&controller, &[1]), &engine, StoreConfig::default());
    assert_eq!(kv.lookup(&second), 3, "the commit's headers are durable");
    retrieve(&mut kv, &engine, &second, &[10, 11, 12]);
    for (i, key) in keys.iter().enumerate() {
        assert!(engine.holds(10 + i as u32, *key, 4), "block {i}");
    }
    drop(kv);

    // The threaded executor owns its queue pairs on worker threads: it cannot lend them.
    let (pool, _) = Pool::open(targets(&controller, &[1]), None).unwrap();
    let workers = vec![vec![(gio_uring::DeviceIndex(0), controller.create_io_queue_pair(64).unwrap())]];
    let executor = gio_uring::CpuWorkers::new(1, workers, 64).unwrap();
    let Err(refused) = KvStore::new(pool, engine.registration.clone(), engine.dma.clone(), executor, StoreConfig::default()) else {
        panic!("a store whose metadata has no queue pair was built")
    };
    assert!(
        matches!(&refused, ObjstoreError::QueuePairs { device: 0, granted: 1, needed: 2, reason } if reason.contains("cannot lend")),
        "{refused}"
    );
    // Two pool devices on one controller need two queue pairs for the executor alone.
    let both = targets(&controller, &[1, 2]);
    format(&both, 1, Some(8));
    let (pool, _) = Pool::open(both, None).unwrap();
    let Err(refused) = objstore::cpu_executor_for(&pool, 64, &StoreConfig::default()) else { panic!("two queue pairs from one") };
    assert!(matches!(&refused, ObjstoreError::QueuePairs { granted: 1, needed: 2, .. }), "{refused}");
}

#[test]
fn a_pool_across_several_controllers() {
    // Goal: one pool over two software controllers: open in either order, refuse a missing
    // member or a member of another pool, naming the device and both pool ids.
    let devices: Vec<_> = (0..3).map(|_| start_device(vec![NamespaceConfig::new(512, None)], 4 << 20, true)).collect();
    let controllers: Vec<_> = devices.iter().map(|d| bring_up(d, Duration::from_secs(5))).collect();
    let pool_targets: Vec<_> = controllers[..2].iter().flat_map(|c| targets(c, &[1])).collect();
    format(&pool_targets, 1, None);
    format(&targets(&controllers[2], &[1]), 1, None);
    let reversed: Vec<_> = pool_targets.iter().rev().cloned().collect();
    let (pool, report) = Pool::open(reversed, Some(&geometry())).unwrap();
    assert_eq!(report.devices, 2);
    assert_eq!(pool.superblock(0).device_index, 0);
    assert!(std::sync::Arc::ptr_eq(&pool.target(0).controller, &controllers[0]));
    drop(pool);
    let Err(missing) = Pool::open(pool_targets[..1].to_vec(), None) else { panic!("opened half a pool") };
    assert!(missing.to_string().contains("2 devices, 1 were given"), "{missing}");
    let mixed = vec![pool_targets[0].clone(), targets(&controllers[2], &[1]).remove(0)];
    let Err(foreign) = Pool::open(mixed, None) else { panic!("mixed two pools") };
    assert!(matches!(&foreign, ObjstoreError::PoolMembership { device: 1, reason } if reason.contains("belongs to pool")), "{foreign}");
    // These controllers each have their own DMA space: a store over them is refused, since
    // the second could not reach memory registered in the first's.
    let engine = separate_kv(controllers[0].dma(), 8, DataPointerMode::Sgl);
    let (pool, _) = Pool::open(pool_targets.clone(), None).unwrap();
    let executor = objstore::cpu_executor_for(&pool, 64, &StoreConfig::default()).unwrap();
    let Err(refused) = KvStore::new(pool, engine.registration.clone(), engine.dma.clone(), executor, StoreConfig::default()) else {
        panic!("a store across two DMA spaces was built")
    };
    assert!(refused.to_string().contains("pool device 1") && refused.to_string().contains("another DMA address space"), "{refused}");
}

#[test]
fn data_moves_across_controllers_that_share_a_dma_space() {
    // Goal: a pool striped over two controllers started in one DMA space stores blocks on
    // both (round-robin), survives a reopen, and retrieves every block into other engine
    // blocks byte for byte.
    let first = start_device(vec![NamespaceConfig::new(512, None)], 8 << 20, true);
    let second =
        nvme_emu::EmuDevice::start_in(device_config(vec![NamespaceConfig::new(512, None)], 8 << 20, true), &first.dma_pool()).unwrap();
    let controllers = [bring_up(&first, Duration::from_secs(5)), bring_up(&second, Duration::from_secs(5))];
    let pool_targets: Vec<_> = controllers.iter().flat_map(|c| targets(c, &[1])).collect();
    format(&pool_targets, 1, None);
    let engine = separate_kv(controllers[0].dma(), 32, DataPointerMode::Sgl);
    let mut kv = open_store(pool_targets.clone(), &engine, StoreConfig::default());
    let mut rng = Rng(9);
    let requests: Vec<Vec<u32>> = (0..3).map(|_| rng.tokens(64)).collect();
    for (r, tokens) in requests.iter().enumerate() {
        let blocks: Vec<u32> = (0..4).map(|b| (r * 4 + b) as u32).collect();
        store(&mut kv, &engine, tokens, &blocks);
    }
    let written = |device: &nvme_emu::EmuDevice| device.stats().bytes_written;
    assert!(written(&first) > 0 && written(&second) > 0, "both controllers hold data");
    drop(kv);
    let mut kv = open_store(pool_targets, &engine, StoreConfig::default());
    for (r, tokens) in requests.iter().enumerate() {
        assert_eq!(kv.lookup(tokens), 4);
        let blocks: Vec<u32> = (0..4).map(|b| (16 + r * 4 + b) as u32).collect();
        retrieve(&mut kv, &engine, tokens, &blocks);
        for (b, key) in keys_of(tokens).iter().enumerate() {
            assert!(engine.holds(blocks[b], *key, 4), "request {r} block {b}");
        }
    }
}

#[test]
fn a_device_error_fails_the_layer_and_leaves_nothing_visible() {
    // Goal: a media error on one data write fails that layer's wait with the NVMe status; the
    // abandoned store frees its slots and shows nothing; a failed read fails the retrieve;
    // the store keeps working afterwards.
    use nvme_driver::spec::{NvmeStatus, StatusCodeType};
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let mut rig = rig(16);
    let mut rng = Rng(6);
    let tokens = rng.tokens(32);
    let keys = keys_of(&tokens);
    rig.engine.fill(0, keys[0]);
    rig.engine.fill(1, keys[1]);
    let media = NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, 0x81);
    rig._device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(3, FaultAction::Status(media))));
    let plan = rig.store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1] }).unwrap();
    let mut failed_layer = None;
    for layer in 0..4 {
        rig.store.store_layer(plan.handle, layer, BUDGET).unwrap();
        if let Err(error) = rig.store.wait(plan.handle, deadline()) {
            assert!(matches!(error, ObjstoreError::LayerIo { .. }), "{error}");
            failed_layer = Some(layer);
            break;
        }
    }
    assert_eq!(failed_layer, Some(1), "2 commands per layer: the 3rd command is layer 1's first");
    assert!(matches!(rig.store.commit_store(plan.handle), Err(ObjstoreError::HandleState { .. })));
    rig.store.finish(plan.handle).unwrap();
    assert_eq!((rig.store.lookup(&tokens), rig.store.counts().free_slots), (0, 16));
    store(&mut rig.store, &rig.engine, &tokens, &[0, 1]);
    rig._device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::Status(media))));
    let handle = rig.store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[5, 6] }).unwrap();
    rig.store.retrieve_layer(handle, 0, BUDGET).unwrap();
    assert!(matches!(rig.store.wait(handle, deadline()), Err(ObjstoreError::LayerIo { layer: 0, .. })));
    rig.store.finish(handle).unwrap();
    retrieve(&mut rig.store, &rig.engine, &tokens, &[5, 6]);
    assert!(rig.engine.holds(5, keys[0], 4) && rig.engine.holds(6, keys[1], 4));
}

#[test]
fn poll_reports_completion_without_blocking() {
    // Goal: `poll` returns false while a layer is in flight and true once it completed, within
    // a bounded number of tries; the polled layers read the right bytes.
    let mut rig = rig(16);
    let mut rng = Rng(7);
    let tokens = rng.tokens(64);
    store(&mut rig.store, &rig.engine, &tokens, &[0, 1, 2, 3]);
    for block in 8..12 {
        rig.engine.scribble(block);
    }
    let handle = rig.store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[8, 9, 10, 11] }).unwrap();
    assert!(rig.store.poll(handle).unwrap(), "nothing in flight yet");
    for layer in 0..4 {
        rig.store.retrieve_layer(handle, layer, BUDGET).unwrap();
        let until = deadline();
        while !rig.store.poll(handle).unwrap() {
            assert!(std::time::Instant::now() < until, "layer {layer} never completed");
            std::thread::yield_now();
        }
        assert_eq!(rig.store.wait(handle, deadline()).unwrap(), None, "poll already retired the layer");
    }
    rig.store.finish(handle).unwrap();
    let keys = keys_of(&tokens);
    for (i, block) in (8..12).enumerate() {
        assert!(rig.engine.holds(block, keys[i], 4), "block {i}");
    }
}

#[test]
fn a_lost_completion_is_abandoned_and_the_layer_issued_again() {
    // Goal: a layer whose completion the device dropped times out and cannot be finished;
    // `abandon_in_flight` ends it (one layer), after which the same layer is issued again and
    // moves the right bytes: for a retrieve, and for a store that then commits and reads back.
    use gio_uring::GioError;
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let short = || std::time::Instant::now() + Duration::from_millis(200);
    let mut rig = rig(16);
    let mut rng = Rng(8);
    let tokens = rng.tokens(32);
    let keys = keys_of(&tokens);
    store(&mut rig.store, &rig.engine, &tokens, &[0, 1]);
    rig.engine.scribble(5);
    rig.engine.scribble(6);
    rig._device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(2, FaultAction::DropCompletion)));
    let handle = rig.store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[5, 6] }).unwrap();
    rig.store.retrieve_layer(handle, 0, BUDGET).unwrap();
    let timed_out = rig.store.wait(handle, short());
    assert!(matches!(timed_out, Err(ObjstoreError::Gio(GioError::WaitTimeout { .. }))), "{timed_out:?}");
    assert!(matches!(rig.store.finish(handle), Err(ObjstoreError::HandleState { .. })), "in flight: not finishable");
    rig._device.set_faults(FaultPlan::none());
    assert_eq!(rig.store.abandon_in_flight().unwrap(), 1);
    assert!(rig.store.poll(handle).unwrap(), "nothing in flight after the abandon");
    for layer in 0..4 {
        rig.store.retrieve_layer(handle, layer, BUDGET).unwrap();
        assert_eq!(rig.store.wait(handle, deadline()).unwrap(), Some(layer));
    }
    rig.store.finish(handle).unwrap();
    assert!(rig.engine.holds(5, keys[0], 4) && rig.engine.holds(6, keys[1], 4));
    assert_eq!(rig.store.counts().pinned_slots, 0);

    let fresh = rng.tokens(16);
    let fresh_key = keys_of(&fresh)[0];
    rig.engine.fill(2, fresh_key);
    rig._device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)));
    let plan = rig.store.prepare_store(&KvRequest { tokens: &fresh, block_ids: &[2] }).unwrap();
    rig.store.store_layer(plan.handle, 0, BUDGET).unwrap();
    assert!(matches!(rig.store.wait(plan.handle, short()), Err(ObjstoreError::Gio(GioError::WaitTimeout { .. }))));
    rig._device.set_faults(FaultPlan::none());
    assert_eq!(rig.store.abandon_in_flight().unwrap(), 1);
    assert!(matches!(rig.store.commit_store(plan.handle), Err(ObjstoreError::HandleState { .. })), "layer 0 is not stored");
    for layer in 0..4 {
        rig.store.store_layer(plan.handle, layer, BUDGET).unwrap();
        rig.store.wait(plan.handle, deadline()).unwrap();
    }
    assert_eq!(rig.store.commit_store(plan.handle).unwrap(), 1);
    retrieve(&mut rig.store, &rig.engine, &fresh, &[7]);
    assert!(rig.engine.holds(7, fresh_key, 4));
    assert_eq!(rig.store.abandon_in_flight().unwrap(), 0, "nothing in flight: nothing abandoned");
}

#[test]
fn a_lost_completion_on_the_worker_executor_is_abandoned_too() {
    // Goal: the same recovery with CpuWorkers, whose queue pairs live on worker threads: each
    // worker replaces its own, then the layer is reissued and reads the right bytes.
    use gio_uring::GioError;
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let device = start_device(vec![NamespaceConfig::new(512, None)], 8 << 20, true);
    let controller = bring_up(&device, Duration::from_secs(5));
    format(&targets(&controller, &[1]), 1, Some(16));
    let engine = separate_kv(controller.dma(), 32, DataPointerMode::Sgl);
    let mut kv = open_store_workers(targets(&controller, &[1]), &engine, StoreConfig::default());
    let mut rng = Rng(10);
    let tokens = rng.tokens(32);
    let keys = keys_of(&tokens);
    store(&mut kv, &engine, &tokens, &[0, 1]);
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)));
    let handle = kv.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[3, 4] }).unwrap();
    kv.retrieve_layer(handle, 0, BUDGET).unwrap();
    let timed_out = kv.wait(handle, std::time::Instant::now() + Duration::from_millis(200));
    assert!(matches!(timed_out, Err(ObjstoreError::Gio(GioError::WaitTimeout { .. }))), "{timed_out:?}");
    device.set_faults(FaultPlan::none());
    assert_eq!(kv.abandon_in_flight().unwrap(), 1);
    for layer in 0..4 {
        kv.retrieve_layer(handle, layer, BUDGET).unwrap();
        assert_eq!(kv.wait(handle, deadline()).unwrap(), Some(layer));
    }
    kv.finish(handle).unwrap();
    assert!(engine.holds(3, keys[0], 4) && engine.holds(4, keys[1], 4));
}
