//! The fixture of tutti's cross-crate integration tests (each file in `tests/tests/` is one test
//! binary): a pool on the software controller, the engine's KV memory in that controller's DMA
//! space, and helpers to fill and check KV blocks with bytes derived from their key.
//!
//! What lives here: tests whose subject is the stack (driver, software controller, gio_uring
//! executors and object store together) — store/retrieve behaviour, round trips, crash loops;
//! later the multi-process daemon and cluster tests. A crate's tests of itself against the
//! software controller as a fixture stay in that crate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::{CpuExecutor, SmBudget};
use nvme_driver::hw::DeviceBackend;
use nvme_driver::{Controller, ControllerConfig, DataPointerMode, DmaAllocator, DmaRegion, Iova, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};
use objstore::hash::{block_keys, KeyChain, KeySecret};
use objstore::{
    cpu_executor_for, format_pool, FormatParams, KvKind, KvLayout, KvRegistration, KvRequest, KvStore, ModelGeometry, Pool, PoolTarget,
    StoreConfig,
};

/// 4 layers, 4 KiB objects (16 tokens x 2 heads x 64 x 2 B), 32 KiB per block.
pub fn geometry() -> ModelGeometry {
    ModelGeometry { layers: 4, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 }
}

pub const BUDGET: SmBudget = SmBudget(1);

pub fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// SplitMix64, for reproducible tests.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn tokens(&mut self, count: usize) -> Vec<u32> {
        (0..count).map(|_| self.next_u64() as u32).collect()
    }
}

pub fn start_device(namespaces: Vec<NamespaceConfig>, backing_bytes: u64, sgl: bool) -> Arc<EmuDevice> {
    EmuDevice::start(device_config(namespaces, backing_bytes, sgl)).expect("software controller")
}

pub fn device_config(namespaces: Vec<NamespaceConfig>, backing_bytes: u64, sgl: bool) -> EmuConfig {
    EmuConfig::default().with_backing(Backing::Memory { bytes: backing_bytes }).with_namespaces(namespaces).with_mdts(8).with_sgl(sgl)
}

pub fn bring_up(device: &Arc<EmuDevice>, admin_timeout: Duration) -> Arc<Controller> {
    let backend: Arc<dyn DeviceBackend> = device.clone();
    Arc::new(Controller::init(backend, ControllerConfig { admin_timeout, ..ControllerConfig::default() }).expect("bring-up"))
}

pub fn targets(controller: &Arc<Controller>, namespaces: &[u32]) -> Vec<PoolTarget> {
    namespaces.iter().map(|&ns| PoolTarget { controller: controller.clone(), namespace: NamespaceId(ns) }).collect()
}

/// The key secret [`format()`] gives every test pool, so that [`keys_of`] can predict its keys.
pub fn key_secret() -> KeySecret {
    KeySecret::from_bytes(*b"tutti-tests key secret, not one!").expect("a non-zero secret")
}

pub fn format(targets: &[PoolTarget], k: u32, slots: Option<u64>) {
    let params = FormatParams {
        blocks_per_slot: k,
        slot_count_max: slots,
        payload_crc: true,
        key_secret: Some(key_secret()),
        ..FormatParams::new(geometry())
    };
    format_pool(targets, &params).expect("format");
}

/// The engine's KV memory: per-layer K and V tensors allocated separately (irregular bases:
/// the SGL-table path), or one block-major region.
pub struct Engine {
    pub regions: Vec<DmaRegion>,
    pub registration: KvRegistration,
    pub dma: Arc<dyn DmaAllocator>,
}

pub fn separate_kv(dma: &Arc<dyn DmaAllocator>, num_blocks: u32, mode: DataPointerMode) -> Engine {
    let g = geometry();
    let bytes = (g.object_bytes() * u64::from(num_blocks)) as usize;
    let regions: Vec<DmaRegion> = (0..2 * g.layers).map(|_| dma.allocate(bytes).unwrap()).collect();
    // Interleave so V is not at a fixed offset from K.
    let key_bases = (0..g.layers as usize).map(|l| regions[2 * l + 1].iova()).collect();
    let value_bases = (0..g.layers as usize).map(|l| regions[2 * l].iova()).collect();
    let layout = KvLayout::SeparateKv { key_bases, value_bases, block_stride_bytes: g.object_bytes() };
    let registration = KvRegistration::new(g, num_blocks, layout, mode).expect("registration");
    Engine { regions, registration, dma: dma.clone() }
}

pub fn block_major(dma: &Arc<dyn DmaAllocator>, num_blocks: u32, mode: DataPointerMode) -> Engine {
    let g = geometry();
    let region = dma.allocate((g.block_bytes() * u64::from(num_blocks)) as usize).unwrap();
    let layout = KvLayout::BlockMajor { base: region.iova(), block_stride_bytes: g.block_bytes() };
    let registration = KvRegistration::new(g, num_blocks, layout, mode).expect("registration");
    Engine { regions: vec![region], registration, dma: dma.clone() }
}

/// One tensor per layer whose block holds that layer's K and V in one run (vLLM 0.32's paged
/// view, FlashInfer): the layers' tensors allocated separately, so their bases are irregular
/// unless `equal_spacing` carves them from one region (the collapsed mapping form then).
pub fn paged_per_layer(dma: &Arc<dyn DmaAllocator>, num_blocks: u32, mode: DataPointerMode, equal_spacing: bool) -> Engine {
    let g = geometry();
    let bytes = (2 * g.object_bytes() * u64::from(num_blocks)) as usize;
    let (regions, layer_bases) = if equal_spacing {
        let region = dma.allocate(bytes * g.layers as usize).unwrap();
        let bases = (0..u64::from(g.layers)).map(|l| region.iova().checked_add(l * bytes as u64).unwrap()).collect();
        (vec![region], bases)
    } else {
        let regions: Vec<DmaRegion> = (0..g.layers).map(|_| dma.allocate(bytes).unwrap()).collect();
        // Reversed, so the bases do not progress by one stride.
        let bases = regions.iter().rev().map(DmaRegion::iova).collect();
        (regions, bases)
    };
    let layout = KvLayout::PagedPerLayer { layer_bases, block_stride_bytes: 2 * g.object_bytes() };
    let registration = KvRegistration::new(g, num_blocks, layout, mode).expect("registration");
    Engine { regions, registration, dma: dma.clone() }
}

/// The bytes object (layer, kind) of the block with `key` must hold.
pub fn pattern(key: u64, layer: u32, kind: KvKind, out: &mut [u8]) {
    let mut rng = Rng(key ^ (u64::from(layer) << 1 | u64::from(kind == KvKind::Value)).wrapping_mul(0x1000_0000_01B3));
    for chunk in out.chunks_mut(8) {
        let word = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

impl Engine {
    /// Object (layer, kind, block) of the engine's memory: a window that starts at its first byte.
    fn object(&self, layer: u32, kind: KvKind, block: u32) -> DmaRegion {
        let address: Iova = self.registration.object_address(layer, kind, block).unwrap();
        self.dma.translate(address, self.registration.geometry().object_bytes() as usize).unwrap()
    }

    /// Fills engine block `block` with the pattern of `key`.
    pub fn fill(&self, block: u32, key: u64) {
        let g = self.registration.geometry();
        let mut bytes = vec![0u8; g.object_bytes() as usize];
        for layer in 0..g.layers {
            for kind in [KvKind::Key, KvKind::Value] {
                pattern(key, layer, kind, &mut bytes);
                self.object(layer, kind, block).write(0, &bytes).unwrap();
            }
        }
    }

    pub fn scribble(&self, block: u32) {
        let g = self.registration.geometry();
        for layer in 0..g.layers {
            for kind in [KvKind::Key, KvKind::Value] {
                self.object(layer, kind, block).fill(0, g.object_bytes() as usize, 0xEE).unwrap();
            }
        }
    }

    /// Whether engine block `block` holds the pattern of `key` in every layer below `layers`.
    pub fn holds(&self, block: u32, key: u64, layers: u32) -> bool {
        let g = self.registration.geometry();
        let mut expected = vec![0u8; g.object_bytes() as usize];
        let mut found = vec![0u8; g.object_bytes() as usize];
        for layer in 0..layers {
            for kind in [KvKind::Key, KvKind::Value] {
                pattern(key, layer, kind, &mut expected);
                self.object(layer, kind, block).read(0, &mut found).unwrap();
                if found != expected {
                    return false;
                }
            }
        }
        true
    }
}

/// The block keys of `tokens` in a pool of [`format()`] as an in-process store computes them (key
/// space 0, keyed with the pool's secret): what its slot headers record.
pub fn keys_of(tokens: &[u32]) -> Vec<u64> {
    let mut keys = Vec::new();
    block_keys(&KeyChain::new(&key_secret(), 0), tokens, geometry().block_tokens, &mut keys);
    keys
}

pub fn open_store(targets: Vec<PoolTarget>, engine: &Engine, config: StoreConfig) -> KvStore<CpuExecutor> {
    let (pool, report) = Pool::open(targets, Some(&geometry())).expect("open");
    eprintln!("open: {report:?}");
    let executor = cpu_executor_for(&pool, 256, &config).expect("executor");
    KvStore::new(pool, engine.registration.clone(), engine.dma.clone(), executor, config).expect("store")
}

/// Like `open_store`, with the threaded CPU executor: one worker per pool device.
pub fn open_store_workers(targets: Vec<PoolTarget>, engine: &Engine, config: StoreConfig) -> KvStore<gio_uring::CpuWorkers> {
    let (pool, _report) = Pool::open(targets, Some(&geometry())).expect("open");
    let workers = (0..pool.device_count())
        .map(|device| vec![(gio_uring::DeviceIndex(device as u16), pool.target(device).controller.create_io_queue_pair(256).unwrap())])
        .collect();
    let executor = gio_uring::CpuWorkers::new(pool.device_count(), workers, config.iocbs).expect("workers");
    KvStore::new(pool, engine.registration.clone(), engine.dma.clone(), executor, config).expect("store")
}

/// Stores `tokens` from engine blocks `blocks` (filled with their keys' patterns first), layer
/// by layer, and commits.
pub fn store<E: gio_uring::Executor>(store: &mut KvStore<E>, engine: &Engine, tokens: &[u32], blocks: &[u32]) -> objstore::StorePlan {
    let keys = keys_of(tokens);
    for (i, &block) in blocks.iter().enumerate() {
        engine.fill(block, keys[i]);
    }
    let plan = store.prepare_store(&KvRequest { tokens, block_ids: blocks }).expect("prepare_store");
    for layer in 0..geometry().layers {
        store.store_layer(plan.handle, layer, BUDGET).expect("store_layer");
        store.wait(plan.handle, deadline()).expect("wait");
    }
    store.commit_store(plan.handle).expect("commit");
    plan
}

/// Retrieves the first `blocks.len()` blocks of `tokens` into `blocks`, layer by layer.
pub fn retrieve<E: gio_uring::Executor>(store: &mut KvStore<E>, engine: &Engine, tokens: &[u32], blocks: &[u32]) {
    for &block in blocks {
        engine.scribble(block);
    }
    let handle = store.prepare_retrieve(&KvRequest { tokens, block_ids: blocks }).expect("prepare_retrieve");
    for layer in 0..geometry().layers {
        store.retrieve_layer(handle, layer, BUDGET).expect("retrieve_layer");
        assert_eq!(store.wait(handle, deadline()).expect("wait"), Some(layer));
    }
    store.finish(handle).expect("finish");
}

/// Reads `len` bytes at `lba` of namespace `ns` behind the pool's back.
pub fn raw_read(controller: &Arc<Controller>, ns: u32, lba: u64, len: usize) -> Vec<u8> {
    let mut queue = controller.create_io_queue_pair(16).unwrap();
    let region = controller.dma().allocate(len).unwrap();
    queue
        .read(NamespaceId(ns), nvme_driver::Lba(lba), &[nvme_driver::DataSegment::new(region.iova(), len as u32)], Duration::from_secs(5))
        .unwrap();
    let mut out = vec![0u8; len];
    region.read(0, &mut out).unwrap();
    out
}

/// Writes `bytes` (a whole number of LBAs) at `lba`, durably.
pub fn raw_write(controller: &Arc<Controller>, ns: u32, lba: u64, bytes: &[u8]) {
    let mut queue = controller.create_io_queue_pair(16).unwrap();
    let region = controller.dma().allocate(bytes.len()).unwrap();
    region.write(0, bytes).unwrap();
    queue
        .write(
            NamespaceId(ns),
            nvme_driver::Lba(lba),
            &[nvme_driver::DataSegment::new(region.iova(), bytes.len() as u32)],
            true,
            Duration::from_secs(5),
        )
        .unwrap();
}
