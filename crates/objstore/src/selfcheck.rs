//! A self-contained persistence round trip for any controller: the check the VM harness runs on
//! QEMU's NVMe controller through VFIO (`objstore-roundtrip`), and `cargo test` runs on the
//! software controller.
//!
//! It formats a pool, stores several requests layer by layer (they share a prefix, so dedup is
//! exercised), commits them, drops the store and the pool, reopens the pool (recovery from slot
//! headers), looks every request up, retrieves each into *different* engine blocks than it was
//! stored from (a scatter), and compares every byte.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::SmBudget;
use nvme_driver::{Controller, DataPointerMode, DmaAllocator, DmaRegion};

use crate::format::BLOCKS_PER_SLOT_MAX;
use crate::{
    cpu_executor_for, format_pool, FormatParams, KvKind, KvLayout, KvRegistration, KvRequest, KvStore, ModelGeometry, ObjstoreError, Pool,
    PoolTarget, RecoveryReport, StoreConfig,
};

/// How the round trip lays out the engine's KV memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineLayout {
    /// Separate per-layer K and V tensors: separate allocations on SGL controllers (the SGL
    /// descriptor table), equally spaced in one allocation on PRP ones (K and V as separate
    /// commands).
    SeparateKv,
    /// All layers of a block contiguous (one command per block-layer, K and V together).
    BlockMajor,
}

/// What the round trip does.
#[derive(Debug, Clone, Copy)]
pub struct RoundTripConfig {
    pub geometry: ModelGeometry,
    /// Requests stored; every request after the first shares request 0's first half (a common
    /// system prompt), so those blocks are stored once.
    pub requests: u32,
    pub blocks_per_request: u32,
    /// k, engine blocks per slot.
    pub blocks_per_slot: u32,
    pub layout: EngineLayout,
    /// Deadline for each layer.
    pub layer_timeout: Duration,
}

impl Default for RoundTripConfig {
    fn default() -> Self {
        Self {
            geometry: ModelGeometry::llama3_8b(16),
            requests: 3,
            blocks_per_request: 8,
            blocks_per_slot: 1,
            layout: EngineLayout::SeparateKv,
            layer_timeout: Duration::from_secs(60),
        }
    }
}

impl RoundTripConfig {
    /// Checks that the round trip's sizes fit their types before anything is formatted:
    /// the engine holds twice a request's blocks (u32 block ids), a request's tokens are
    /// counted in u32, and the engine memory's bytes in usize; and that k is one a pool takes
    /// (1..=1024; whether its header entry fits the devices' LBA is known only once they are
    /// open). [`ObjstoreError::BadRequest`] names what is wrong (a command line may ask for any
    /// u32).
    pub fn check(&self) -> Result<(), ObjstoreError> {
        let bad = |reason: String| ObjstoreError::BadRequest { reason };
        let blocks = self.blocks_per_request;
        if self.requests == 0 || blocks == 0 || self.blocks_per_slot == 0 {
            return Err(bad(format!(
                "{} requests of {blocks} blocks, k = {}: each must be at least 1",
                self.requests, self.blocks_per_slot
            )));
        }
        if self.blocks_per_slot > BLOCKS_PER_SLOT_MAX {
            return Err(bad(format!(
                "k = {}: a pool takes 1..={BLOCKS_PER_SLOT_MAX} engine blocks per slot (and as many as one slot header entry \
                 in an LBA holds)",
                self.blocks_per_slot
            )));
        }
        self.geometry.validate()?;
        let engine_blocks =
            blocks.checked_mul(2).ok_or_else(|| bad(format!("{blocks} blocks per request: twice as many engine blocks overflow u32")))?;
        blocks.checked_mul(self.geometry.block_tokens).ok_or_else(|| {
            bad(format!("{blocks} blocks per request of {} tokens: the request's tokens overflow u32", self.geometry.block_tokens))
        })?;
        // The largest engine allocation: every layer's K and V tensors in one region (PRP), as
        // many bytes as the block-major region.
        self.geometry
            .checked_object_bytes()
            .and_then(|bytes| bytes.checked_mul(2 * u64::from(self.geometry.layers)))
            .and_then(|bytes| bytes.checked_mul(u64::from(engine_blocks)))
            .and_then(|bytes| usize::try_from(bytes).ok())
            .ok_or_else(|| bad(format!("{blocks} blocks per request: the engine memory for {engine_blocks} blocks overflows usize")))?;
        Ok(())
    }
}

/// What the round trip found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundTripReport {
    pub recovery: RecoveryReport,
    pub blocks_stored: u64,
    pub blocks_shared: u64,
    pub bytes_verified: u64,
}

/// Why a round trip failed.
#[derive(Debug, thiserror::Error)]
pub enum RoundTripError {
    #[error(transparent)]
    Store(#[from] ObjstoreError),
    #[error(transparent)]
    Hardware(#[from] nvme_driver::HwError),
    #[error("request {request}: lookup after reopen found {found} of {expected} blocks")]
    Missing { request: u32, found: usize, expected: u32 },
    #[error("request {request}, block {block}, layer {layer}, {kind}: byte {offset} is {found:#04x}, expected {expected:#04x}")]
    Mismatch { request: u32, block: u32, layer: u32, kind: &'static str, offset: usize, expected: u8, found: u8 },
    /// Every step of the phase succeeded, but closing its store could not delete an executor
    /// queue pair (the controller refused or did not answer the deletion): a command of that
    /// pair may still use the engine memory, which is kept for good.
    #[error(
        "the {phase} phase's store: its executor queue pairs could not be deleted: the controller may still move data \
         through them, so the engine memory is kept for good (leaked)"
    )]
    QueuePairsNotDeleted { phase: &'static str },
}

fn tokens(config: &RoundTripConfig, request: u32) -> Vec<u32> {
    let block_tokens = config.geometry.block_tokens;
    let shared_blocks = if request == 0 { 0 } else { config.blocks_per_request / 2 };
    (0..config.blocks_per_request * block_tokens)
        .map(|index| {
            // The shared half repeats request 0's tokens exactly.
            let owner = if index < shared_blocks * block_tokens { 0 } else { request };
            owner.wrapping_mul(0x0100_0193) ^ index
        })
        .collect()
}

/// The byte pattern of one object: a function of the prefix that produced it (as real KV is).
fn object_pattern(tokens: &[u32], block: u32, block_tokens: u32, layer: u32, value: bool, out: &mut [u8]) {
    let mut key = 0xcbf2_9ce4_8422_2325u64;
    for &token in &tokens[..((block + 1) * block_tokens) as usize] {
        key = (key ^ u64::from(token)).wrapping_mul(0x100_0000_01b3);
    }
    key ^= u64::from(layer) << 33 ^ u64::from(value) << 32;
    for (index, chunk) in out.chunks_mut(8).enumerate() {
        let mut word = key ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        word = (word ^ (word >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        chunk.copy_from_slice(&word.to_le_bytes()[..chunk.len()]);
    }
}

/// Ends `store` ([`KvStore::close`]) and passes `result` on. When the store says the engine's
/// memory must be kept (a queue pair it could not delete may still hold a layer's command,
/// which reads or writes that memory), `memory` is leaked: freed, its IOVAs would go to the
/// next allocation while that command may still move data. A phase that succeeded then fails
/// with [`RoundTripError::QueuePairsNotDeleted`]: a controller that does not delete one of
/// the store's executor queue pairs fails the check, however well the bytes compared (the
/// pool's own metadata or temporary pairs are not checked here: their buffers are the pool's,
/// which leaks them itself) (a failure already there is
/// passed on: it says more).
fn end_store<T>(
    store: KvStore<gio_uring::CpuExecutor>,
    memory: &[DmaRegion],
    phase: &'static str,
    result: Result<T, RoundTripError>,
) -> Result<T, RoundTripError> {
    if !store.close() {
        let regions: Vec<&DmaRegion> = memory.iter().collect();
        crate::leak::leak_regions(&regions, "the round trip's engine memory: the store says a command may still use it");
        return result.and(Err(RoundTripError::QueuePairsNotDeleted { phase }));
    }
    result
}

/// Runs the round trip on one pool over `targets` (which it formats): one namespace, or
/// namespaces of several controllers, which must then share one DMA space (one VFIO container,
/// or emulators started in one DMA pool). The engine memory is allocated in the first
/// target's space; PRP is registered if any controller lacks SGL.
pub fn round_trip(targets: Vec<PoolTarget>, config: &RoundTripConfig) -> Result<RoundTripReport, RoundTripError> {
    // Before the format: a size that overflows must not cost the devices' contents.
    config.check()?;
    let geometry = config.geometry;
    let Some(first) = targets.first() else {
        return Err(ObjstoreError::BadRequest { reason: "a round trip needs at least one pool device".into() }.into());
    };
    let controller: Arc<Controller> = Arc::clone(&first.controller);
    let mode = if targets.iter().all(|target| target.controller.data_pointer_mode() == DataPointerMode::Sgl) {
        DataPointerMode::Sgl
    } else {
        DataPointerMode::Prp
    };
    format_pool(&targets, &FormatParams { blocks_per_slot: config.blocks_per_slot, ..FormatParams::new(geometry) })?;
    // Engine memory twice the request size: retrieves land in the other half (a scatter).
    let engine_blocks = 2 * config.blocks_per_request;
    let object_bytes = geometry.object_bytes() as usize;
    let dma: Arc<dyn DmaAllocator> = Arc::clone(controller.dma());
    let tensor_bytes = object_bytes * engine_blocks as usize;
    // `memory`: the engine's allocations, kept for good if a store says a command may still
    // use them (`end_store`).
    let (memory, layout) = match config.layout {
        EngineLayout::BlockMajor => {
            let region = dma.allocate(geometry.block_bytes() as usize * engine_blocks as usize)?;
            let layout = KvLayout::BlockMajor { base: region.iova(), block_stride_bytes: geometry.block_bytes() };
            (vec![region], layout)
        }
        EngineLayout::SeparateKv => {
            let (tensors, memory) = if mode == DataPointerMode::Sgl {
                // Separate allocations: irregular layer bases, so the SGL descriptor table is used.
                let tensors = (0..2 * geometry.layers).map(|_| dma.allocate(tensor_bytes)).collect::<Result<Vec<DmaRegion>, _>>()?;
                (tensors.clone(), tensors)
            } else {
                // PRP follows `data + layer x stride`: the tensors at equal spacing in one region.
                let region = dma.allocate(tensor_bytes * 2 * geometry.layers as usize)?;
                let tensors = (0..2 * geometry.layers as usize)
                    .map(|i| region.subregion(i * tensor_bytes, tensor_bytes))
                    .collect::<Result<Vec<DmaRegion>, _>>()?;
                (tensors, vec![region])
            };
            let layout = KvLayout::SeparateKv {
                key_bases: tensors.iter().step_by(2).map(DmaRegion::iova).collect(),
                value_bases: tensors.iter().skip(1).step_by(2).map(DmaRegion::iova).collect(),
                block_stride_bytes: geometry.object_bytes(),
            };
            (memory, layout)
        }
    };
    let registration = KvRegistration::new(geometry, engine_blocks, layout, mode)?;
    // The engine's view of object (layer, K/V, block): host-visible here (the round trip's
    // memory is the controllers' DMA memory).
    let object_region = |layer: u32, kind: KvKind, block: u32| -> Result<DmaRegion, RoundTripError> {
        let address = registration.object_address(layer, kind, block)?;
        Ok(dma.translate(address, object_bytes)?)
    };
    let open_store = || -> Result<(KvStore<gio_uring::CpuExecutor>, RecoveryReport), RoundTripError> {
        let (pool, recovery) = Pool::open(targets.clone(), Some(&geometry))?;
        let store_config = StoreConfig::default();
        let executor = cpu_executor_for(&pool, 256, &store_config)?;
        Ok((KvStore::new(pool, registration.clone(), Arc::clone(&dma), executor, store_config)?, recovery))
    };
    let mut object = vec![0u8; object_bytes];
    let store_ids: Vec<u32> = (0..config.blocks_per_request).collect();
    // Every phase ends its store with `end_store`, on an error too: a `?` with the store in
    // scope would drop it and then the engine memory, whatever the store said of it.
    let mut store_requests = |store: &mut KvStore<gio_uring::CpuExecutor>| -> Result<(u64, u64), RoundTripError> {
        let (mut blocks_stored, mut blocks_shared) = (0u64, 0u64);
        for request in 0..config.requests {
            let tokens = tokens(config, request);
            for (block, &engine_block) in store_ids.iter().enumerate() {
                for layer in 0..geometry.layers {
                    for value in [false, true] {
                        object_pattern(&tokens, block as u32, geometry.block_tokens, layer, value, &mut object);
                        let kind = if value { KvKind::Value } else { KvKind::Key };
                        object_region(layer, kind, engine_block)?.write(0, &object)?;
                    }
                }
            }
            let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &store_ids })?;
            blocks_stored += plan.new_blocks as u64;
            blocks_shared += plan.shared_blocks as u64;
            for layer in 0..geometry.layers {
                store.store_layer(plan.handle, layer, SmBudget(1))?;
                store.wait(plan.handle, Instant::now() + config.layer_timeout)?;
            }
            store.commit_store(plan.handle)?;
        }
        Ok((blocks_stored, blocks_shared))
    };
    let (mut store, _) = open_store()?;
    let stored = store_requests(&mut store);
    let (blocks_stored, blocks_shared) = end_store(store, &memory, "store", stored)?;
    // Reopen: the index comes back from the slot headers alone.
    let retrieve_ids: Vec<u32> = (config.blocks_per_request..engine_blocks).rev().collect();
    let mut actual = vec![0u8; object_bytes];
    let mut retrieve_requests = |store: &mut KvStore<gio_uring::CpuExecutor>| -> Result<u64, RoundTripError> {
        let mut bytes_verified = 0u64;
        for request in 0..config.requests {
            let tokens = tokens(config, request);
            let found = store.lookup(&tokens);
            if found != config.blocks_per_request as usize {
                return Err(RoundTripError::Missing { request, found, expected: config.blocks_per_request });
            }
            for &engine_block in &retrieve_ids {
                for layer in 0..geometry.layers {
                    for kind in [KvKind::Key, KvKind::Value] {
                        object_region(layer, kind, engine_block)?.fill(0, object_bytes, 0)?;
                    }
                }
            }
            let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &retrieve_ids })?;
            for layer in 0..geometry.layers {
                store.retrieve_layer(handle, layer, SmBudget(1))?;
                store.wait(handle, Instant::now() + config.layer_timeout)?;
            }
            store.finish(handle)?;
            for (block, &engine_block) in retrieve_ids.iter().enumerate() {
                for layer in 0..geometry.layers {
                    for value in [false, true] {
                        object_pattern(&tokens, block as u32, geometry.block_tokens, layer, value, &mut object);
                        let kind = if value { KvKind::Value } else { KvKind::Key };
                        object_region(layer, kind, engine_block)?.read(0, &mut actual)?;
                        if let Some(offset) = actual.iter().zip(&object).position(|(a, b)| a != b) {
                            let kind = if value { "V" } else { "K" };
                            return Err(RoundTripError::Mismatch {
                                request,
                                block: block as u32,
                                layer,
                                kind,
                                offset,
                                expected: object[offset],
                                found: actual[offset],
                            });
                        }
                        bytes_verified += object_bytes as u64;
                    }
                }
            }
        }
        Ok(bytes_verified)
    };
    let (mut store, recovery) = open_store()?;
    let verified = retrieve_requests(&mut store);
    let bytes_verified = end_store(store, &memory, "retrieve", verified)?;
    Ok(RoundTripReport { recovery, blocks_stored, blocks_shared, bytes_verified })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use nvme_driver::hw::DeviceBackend;
    use nvme_driver::spec::status::codes;
    use nvme_driver::spec::{AdminOpcode, NvmOpcode, NvmeStatus};
    use nvme_driver::{Controller, ControllerConfig, NamespaceId};
    use nvme_emu::{Backing, EmuConfig, EmuDevice, FaultAction, FaultPlan, FaultRule};

    use super::*;

    #[test]
    fn a_round_trip_that_fails_with_a_layer_in_flight_keeps_the_engine_memory_the_store_says_to_keep() {
        // Goal: a store layer's wait times out (its write is slow) and the executor's queue
        // pair cannot be deleted: its write may still read the engine's memory, so the store
        // says to keep it ("KV memory must not be freed"), and the round trip must then keep
        // every engine tensor for good. The error's `?` used to drop the store and then the
        // tensors, freeing them (their IOVAs handed to the next allocation) under the write.
        let device = EmuDevice::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 64 << 20 })).expect("controller");
        let internal = NvmeStatus::generic(codes::INTERNAL_ERROR);
        device.set_faults(
            FaultPlan::none()
                .with_rule(FaultRule::every_nth_io(1, FaultAction::Delay(Duration::from_millis(100))).with_opcode(NvmOpcode::Write as u8))
                .with_rule(FaultRule {
                    repeat: true,
                    ..FaultRule::on_nth_admin(1, AdminOpcode::DeleteIoSubmissionQueue, FaultAction::Status(internal))
                }),
        );
        let backend: Arc<dyn DeviceBackend> = device.clone();
        let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"));
        assert_eq!(controller.data_pointer_mode(), DataPointerMode::Sgl, "a tensor per layer and kind");
        let config = RoundTripConfig {
            geometry: ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 },
            requests: 1,
            blocks_per_request: 2,
            layer_timeout: Duration::from_millis(10),
            ..RoundTripConfig::default()
        };
        let leaked_before = crate::leak::leaked_dma_regions_on_this_thread();
        let result = round_trip(vec![PoolTarget { controller, namespace: NamespaceId(1) }], &config);
        assert!(result.is_err(), "the layer's wait timed out: {result:?}");
        let leaked = crate::leak::leaked_dma_regions_on_this_thread() - leaked_before;
        assert!(leaked >= 2 * config.geometry.layers as u64, "{leaked} regions kept: every engine tensor must be: {result:?}");
        device.set_faults(FaultPlan::none());
    }

    #[test]
    fn a_round_trip_whose_queue_pairs_cannot_be_deleted_fails_and_keeps_the_engine_memory() {
        // Goal: every byte compares fine, but the controller refuses to delete the executor's
        // queue pairs, so the store says its commands may still use the engine memory. The
        // round trip used to keep that memory and still report success (the VM harness's
        // objstore-roundtrip printed OBJSTORE_ROUNDTRIP_OK and exited 0): a controller that
        // cannot delete an I/O queue must fail the check, and the memory stays kept.
        let device = EmuDevice::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 64 << 20 })).expect("controller");
        let internal = NvmeStatus::generic(codes::INTERNAL_ERROR);
        device.set_faults(FaultPlan::none().with_rule(FaultRule {
            repeat: true,
            ..FaultRule::on_nth_admin(1, AdminOpcode::DeleteIoSubmissionQueue, FaultAction::Status(internal))
        }));
        let backend: Arc<dyn DeviceBackend> = device.clone();
        let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"));
        let config = RoundTripConfig {
            geometry: ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 },
            requests: 1,
            blocks_per_request: 2,
            ..RoundTripConfig::default()
        };
        let leaked_before = crate::leak::leaked_dma_regions_on_this_thread();
        let result = round_trip(vec![PoolTarget { controller, namespace: NamespaceId(1) }], &config);
        assert!(
            matches!(result, Err(RoundTripError::QueuePairsNotDeleted { phase: "store" })),
            "a queue pair the controller did not delete must fail the round trip: {result:?}"
        );
        let leaked = crate::leak::leaked_dma_regions_on_this_thread() - leaked_before;
        assert!(leaked >= 2 * config.geometry.layers as u64, "{leaked} regions kept: every engine tensor must be: {result:?}");
        device.set_faults(FaultPlan::none());
    }
}
