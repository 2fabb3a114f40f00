//! The control half's own tests: what a reservation keeps between requests.

use std::sync::Arc;

use nvme_driver::hw::DeviceBackend;
use nvme_driver::{Controller, ControllerConfig, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};

use super::*;
use crate::pool::{format_pool, FormatParams, NoLender, PoolTarget};
use crate::ModelGeometry;

/// 1 layer, 4 KiB objects: 8 KiB per block, 16 tokens.
fn geometry() -> ModelGeometry {
    ModelGeometry { layers: 1, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 }
}

/// A control half over one software controller's pool of `slots` one-block slots.
fn control(slots: u64) -> StoreControl {
    let slot_bytes = geometry().block_bytes();
    // The header region and the 1 MiB data alignment, then the slots (and one more: the
    // planner's first estimate reserves a slot's worth beyond what it needs).
    let namespace = NamespaceConfig::new(512, Some((1 << 20) + (slots + 1) * slot_bytes));
    let config = EmuConfig::default().with_backing(Backing::Memory { bytes: 64 << 20 }).with_namespaces(vec![namespace]);
    let device = EmuDevice::start(config).expect("software controller");
    let backend: Arc<dyn DeviceBackend> = device;
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"));
    let targets = vec![PoolTarget { controller, namespace: NamespaceId(1) }];
    let params = FormatParams::new(geometry());
    format_pool(&targets, &params).expect("format");
    let (pool, _) = Pool::open(targets, Some(&geometry())).expect("open");
    StoreControl::new(pool, 4).expect("control")
}

#[test]
fn a_released_reservation_keeps_little_room_after_a_large_request() {
    // Goal: a daemon holds up to 2^20 reservations for its life (tuttid's REQUESTS_MAX), each
    // reused request after request; one that kept the room of its largest request (36 bytes a
    // block, 2 MiB after a request of 65,532 blocks) would hold gigabytes after a while of
    // long prompts. Released, a reservation keeps room for RESERVATION_BLOCKS_KEPT blocks at
    // most; a request no larger reuses what it has.
    let blocks = 2048;
    let mut control = control(blocks as u64 + 16);
    let keys: Vec<u64> = (1..=blocks as u64).collect();
    let engine_blocks: Vec<u32> = (0..blocks as u32).collect();
    let plan = control.reserve_store(&keys, &engine_blocks, &mut NoLender).expect("reserve_store");
    let index = plan.handle.index();
    assert!(control.reservations[index].placements.capacity() >= blocks);
    control.release(plan.handle).expect("release");
    let reservation = &control.reservations[index];
    let rooms =
        [reservation.placements.capacity(), reservation.keys.capacity(), reservation.slots.capacity(), reservation.shared_pins.capacity()];
    assert!(rooms.iter().all(|&room| room <= RESERVATION_BLOCKS_KEPT), "room kept after a store of {blocks} blocks: {rooms:?}");
    // A small request after it keeps its room (nothing shrunk below what it used).
    let plan = control.reserve_store(&keys[..64], &engine_blocks[..64], &mut NoLender).expect("a small reserve_store");
    control.release(plan.handle).expect("release");
    assert!(control.reservations[plan.handle.index()].placements.capacity() >= 64);
}
