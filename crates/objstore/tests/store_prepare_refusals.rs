//! What a store's prepare refuses before anything is reserved or written.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::SmBudget;
use nvme_driver::hw::DeviceBackend;
use nvme_driver::{Controller, ControllerConfig, DataPointerMode, DmaRegion, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice};
use objstore::{
    cpu_executor_for, format_pool, FormatParams, KvLayout, KvRegistration, KvRequest, KvStore, ModelGeometry, ObjstoreError, Pool,
    PoolTarget, StoreConfig,
};

const ENGINE_BLOCKS: u32 = 16;

fn geometry() -> ModelGeometry {
    ModelGeometry { layers: 2, kv_heads: 1, head_dim: 128, dtype_bytes: 2, block_tokens: 16 }
}

/// A one-device pool on the emulator and a store over it, with engine memory of
/// `ENGINE_BLOCKS` blocks registered (the regions are returned: they must outlive the store).
fn store() -> (Arc<EmuDevice>, KvStore<gio_uring::CpuExecutor>, Vec<DmaRegion>) {
    store_with_slots(None)
}

/// As [`store`], with at most `slot_count_max` one-block slots in the pool.
fn store_with_slots(slot_count_max: Option<u64>) -> (Arc<EmuDevice>, KvStore<gio_uring::CpuExecutor>, Vec<DmaRegion>) {
    store_with(slot_count_max, StoreConfig::default())
}

/// As [`store_with_slots`], with `config`.
fn store_with(slot_count_max: Option<u64>, config: StoreConfig) -> (Arc<EmuDevice>, KvStore<gio_uring::CpuExecutor>, Vec<DmaRegion>) {
    let geometry = geometry();
    let device = EmuDevice::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 })).expect("emulator");
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("controller"));
    let targets = vec![PoolTarget { controller: Arc::clone(&controller), namespace: NamespaceId(1) }];
    format_pool(&targets, &FormatParams { slot_count_max, ..FormatParams::new(geometry) }).expect("format");
    let (pool, _) = Pool::open(targets, Some(&geometry)).expect("open pool");
    let object_bytes = geometry.object_bytes();
    let tensors: Vec<DmaRegion> = (0..2 * geometry.layers)
        .map(|_| controller.dma().allocate(object_bytes as usize * ENGINE_BLOCKS as usize).expect("allocate"))
        .collect();
    let layout = KvLayout::SeparateKv {
        key_bases: tensors.iter().step_by(2).map(DmaRegion::iova).collect(),
        value_bases: tensors.iter().skip(1).step_by(2).map(DmaRegion::iova).collect(),
        block_stride_bytes: object_bytes,
    };
    let registration = KvRegistration::new(geometry, ENGINE_BLOCKS, layout, DataPointerMode::Sgl).expect("registration");
    let executor = cpu_executor_for(&pool, 64, &config).expect("executor");
    let store = KvStore::new(pool, registration, Arc::clone(controller.dma()), executor, config).expect("store");
    (device, store, tensors)
}

#[test]
fn a_store_from_one_engine_block_twice_is_refused() {
    // Goal: a store naming one engine block as the source of two blocks is refused, as a
    // retrieve into one block twice is: one block's KV would be committed under the other's
    // key. Before, only a retrieve was checked, and the store committed engine block 5's bytes
    // as both blocks.
    let (_device, mut store, _tensors) = store();
    let tokens: Vec<u32> = (0..32).collect();
    match store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[5, 5] }) {
        Err(ObjstoreError::BadRequest { reason }) => assert!(reason.contains("engine block 5"), "{reason}"),
        other => panic!("expected BadRequest, got {other:?}"),
    }
    assert_eq!(store.lookup(&tokens), 0);
    // Nothing stayed reserved: the same blocks store from distinct engine blocks.
    let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[4, 5] }).expect("prepare_store");
    assert_eq!(plan.new_blocks, 2);
    for layer in 0..geometry().layers {
        store.store_layer(plan.handle, layer, SmBudget(1)).expect("store_layer");
        store.wait(plan.handle, Instant::now() + Duration::from_secs(10)).expect("wait");
    }
    assert_eq!(store.commit_store(plan.handle).expect("commit_store"), 2);
    assert_eq!(store.lookup(&tokens), 2);
}

/// Stores `tokens` (one block per 16 tokens) from engine blocks `block_ids` and commits it.
fn store_and_commit(store: &mut KvStore<gio_uring::CpuExecutor>, tokens: &[u32], block_ids: &[u32]) {
    let plan = store.prepare_store(&KvRequest { tokens, block_ids }).expect("prepare_store");
    for layer in 0..geometry().layers {
        store.store_layer(plan.handle, layer, SmBudget(1)).expect("store_layer");
        store.wait(plan.handle, Instant::now() + Duration::from_secs(10)).expect("wait");
    }
    assert_eq!(store.commit_store(plan.handle).expect("commit_store"), block_ids.len());
}

#[test]
fn a_refused_duplicate_costs_a_full_pool_nothing() {
    // Goal: a store refused for naming one engine block twice is refused before any slot is
    // reserved, so on a full pool it evicts nothing. Before, the refusal came after the
    // reservation had evicted the two least recently used prompts (and synced their headers
    // Empty): a bad request destroyed cached KV.
    const SLOTS: u64 = 4;
    let (_device, mut store, _tensors) = store_with_slots(Some(SLOTS));
    assert_eq!(store.counts().slots, SLOTS);
    let prompts: Vec<Vec<u32>> = (0..SLOTS as u32).map(|p| (p * 1000..p * 1000 + 16).collect()).collect();
    for (p, tokens) in prompts.iter().enumerate() {
        store_and_commit(&mut store, tokens, &[p as u32]);
    }
    assert_eq!(store.counts().free_slots, 0);
    let tokens: Vec<u32> = (50_000..50_032).collect();
    match store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[5, 5] }) {
        Err(ObjstoreError::BadRequest { reason }) => assert!(reason.contains("engine block 5"), "{reason}"),
        other => panic!("expected BadRequest, got {other:?}"),
    }
    for tokens in &prompts {
        assert_eq!(store.lookup(tokens), 1, "a cached prompt was lost to a refused store");
    }
    assert_eq!(store.counts().evictions, 0);
    assert_eq!(store.counts().valid_slots, SLOTS);
}

#[test]
fn a_store_short_of_iocbs_costs_a_full_pool_nothing() {
    // Goal: a store that cannot get the IOCBs its new blocks need is refused before any slot
    // is reserved, so on a full pool it evicts nothing. Before, the reservation evicted the
    // least recently used prompt (and synced its header Empty), then building the IOCBs failed
    // NoFreeIocb: with every IOCB held by prepared requests, each refused store destroyed a
    // cached prompt.
    const SLOTS: u64 = 4;
    let (_device, mut store, _tensors) = store_with(Some(SLOTS), StoreConfig { iocbs: 2, ..StoreConfig::default() });
    let prompts: Vec<Vec<u32>> = (0..SLOTS as u32).map(|p| (p * 1000..p * 1000 + 16).collect()).collect();
    for (p, tokens) in prompts.iter().enumerate() {
        store_and_commit(&mut store, tokens, &[p as u32]);
    }
    assert_eq!(store.counts().free_slots, 0);
    // Two retrieves pin prompts 0 and 1 (the LRU tail is then prompt 2) and hold both IOCBs.
    let reads: Vec<_> = (0..2)
        .map(|p| store.prepare_retrieve(&KvRequest { tokens: &prompts[p], block_ids: &[8 + p as u32] }).expect("prepare_retrieve"))
        .collect();
    let tokens: Vec<u32> = (50_000..50_016).collect();
    match store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[10] }) {
        Err(ObjstoreError::Gio(gio_uring::GioError::NoFreeIocb { .. })) => {}
        other => panic!("expected NoFreeIocb, got {other:?}"),
    }
    assert_eq!(store.counts().evictions, 0);
    for tokens in &prompts {
        assert_eq!(store.lookup(tokens), 1, "a cached prompt was lost to a refused store");
    }
    // Once an IOCB is back, the same store goes ahead (evicting the LRU tail, prompt 2).
    store.finish(reads[0]).expect("finish");
    let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[10] }).expect("prepare_store");
    assert_eq!((plan.new_blocks, plan.evicted_slots), (1, 1));
    store.finish(plan.handle).expect("finish the store");
    store.finish(reads[1]).expect("finish");
}
