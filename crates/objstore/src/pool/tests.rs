//! The pool's metadata path on the software controller.

use std::sync::Arc;

use nvme_driver::hw::DeviceBackend;
use nvme_driver::spec::NvmOpcode;
use nvme_driver::{Controller, ControllerConfig};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};

use super::*;

/// 4 layers, 4 KiB objects: 32 KiB slots.
fn geometry() -> ModelGeometry {
    ModelGeometry { layers: 4, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 }
}

fn start(config: EmuConfig) -> (Arc<EmuDevice>, Vec<PoolTarget>) {
    let device = EmuDevice::start(config).expect("software controller");
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"));
    (device, vec![PoolTarget { controller, namespace: NamespaceId(1) }])
}

fn format(targets: &[PoolTarget], geometry: ModelGeometry) {
    let params = FormatParams { geometry, blocks_per_slot: 1, slot_count_max: None, pool_uuid: None, payload_crc: false };
    format_pool(targets, &params).expect("format");
}

#[test]
fn a_sync_writes_only_the_dirty_header_sectors() {
    // Goal: two distant slots made dirty cost two FUA writes of one LBA each, not the ~120
    // LBAs between them (the header sync used to rewrite the whole min..max span); a second
    // slot in an already dirty LBA costs nothing more; a sync with nothing dirty writes nothing.
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 32 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let (device, targets) = start(config);
    format(&targets, geometry());
    let (mut pool, report) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
    let last = (report.slots - 1) as u32;
    assert!(pool.superblock(0).header_blocks > 100, "the header region spans many LBAs: {:?}", pool.superblock(0));
    let before = device.stats();
    for slot in [0, 1, last] {
        pool.stage_header(0, slot, SlotState::Empty, &[]).unwrap();
    }
    assert_eq!(pool.devices[0].mirror.dirty_blocks(), 2, "slots 0 and 1 share an LBA");
    pool.sync_headers(&mut NoLender).unwrap();
    let after = device.stats();
    assert_eq!(after.io(NvmOpcode::Write) - before.io(NvmOpcode::Write), 2, "one FUA write per dirty LBA");
    assert_eq!(after.bytes_written - before.bytes_written, 2 * 512);
    assert_eq!(pool.devices[0].mirror.dirty_blocks(), 0);
    pool.sync_headers(&mut NoLender).unwrap();
    assert_eq!(device.stats().io(NvmOpcode::Write), after.io(NvmOpcode::Write), "nothing dirty, nothing written");
    // Adjacent dirty LBAs go as one command.
    for slot in [8, 16, 24] {
        pool.stage_header(0, slot, SlotState::Empty, &[]).unwrap();
    }
    pool.sync_headers(&mut NoLender).unwrap();
    assert_eq!(device.stats().io(NvmOpcode::Write) - after.io(NvmOpcode::Write), 1, "LBAs 1..4 in one command");
    drop(pool);
    let (_, reopened) = Pool::open(targets, Some(&geometry())).unwrap();
    assert_eq!((reopened.empty_slots, reopened.corrupt_headers), (report.slots, 0), "every rewritten entry is a clean Empty one");
}

#[test]
fn metadata_transfers_fit_a_small_mdts_and_a_shallow_queue() {
    // Goal: on a controller that moves at most 4 KiB per command, a header region of more
    // than 63 commands' worth (the metadata queue's depth) is formatted and read back: the
    // driver refuses a transfer needing more commands than the queue has free, so metadata
    // moves in pieces of a bounded number of commands.
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 16 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, None)])
        .with_mdts(1); // 8 KiB per command
    let (_device, targets) = start(config);
    // 512-byte objects, one layer: a 1 KiB slot per 64-byte header entry.
    let tiny = ModelGeometry { layers: 1, kv_heads: 1, head_dim: 128, dtype_bytes: 2, block_tokens: 2 };
    format(&targets, tiny);
    let (pool, report) = Pool::open(targets, Some(&tiny)).unwrap();
    let region = pool.superblock(0).header_region_bytes();
    assert!(region > 63 * 8192, "{region} bytes of headers");
    assert_eq!((report.empty_slots, report.corrupt_headers), (report.slots, 0));
}
