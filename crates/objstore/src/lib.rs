//! Object store: Tutti's GPU-file / NVMe-file pools (§3.1) with a persistent, crash-safe format.
//!
//! - [`geometry`]: the model's KV shape and presets;
//! - [`registration`]: the engine's KV pool in device address space, validated once;
//! - [`mapping`]: the P2P mapping table (SGL descriptors or PRP lists, or base + strides);
//! - [`format`](mod@format): superblock and slot headers on each namespace, byte by byte;
//! - [`hash`], [`index`]: chained prefix keys, slot allocation, LRU eviction, pins;
//! - [`pool`]: the pool's devices — format, open with recovery, metadata I/O, check;
//! - [`leak`]: DMA memory kept for good because a controller may still use it;
//! - [`store`]: the layer-wise API an engine calls (`prepare_*`, `*_layer`, `wait`, `commit`),
//!   as a control half (the pool: `StoreControl`) and a data half (the I/O: `StoreData`);
//! - [`selfcheck`]: a persistence round trip for any controller (`objstore-roundtrip`).
//!
//! No unsafe code: device memory is touched only through `DmaRegion` accessors.
#![forbid(unsafe_code)]

pub mod error;
pub mod format;
pub mod geometry;
pub mod hash;
pub mod index;
pub mod leak;
pub mod mapping;
pub mod pool;
pub mod registration;
pub mod selfcheck;
pub mod store;

pub use error::{KvKind, MismatchedBlock, ObjstoreError, RemoteFailure, Result};
pub use geometry::ModelGeometry;
pub use index::{BlockLocation, IndexCounts};
pub use leak::{leaked_dma_bytes, leaked_dma_regions};
pub use mapping::{mapping_memory, CommandLimits, MappingForm, MappingMemoryReport, MappingTable};
pub use pool::{check_format, format_pool, FormatParams, NoLender, Pool, PoolTarget, QueueLender, RecoveryReport};
pub use registration::{KvLayout, KvRegistration};
pub use store::{
    cpu_executor_for, DeviceLayout, Direction, FixedBudget, KvRequest, KvStore, LayerIssuePolicy, LayerKvStore, Placement, PoolShape,
    RequestHandle, StoreConfig, StoreControl, StoreData, StorePlan, Transferred, LAYERS_IN_FLIGHT_LIMIT,
};
