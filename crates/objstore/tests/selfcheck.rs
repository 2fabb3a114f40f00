//! Goal: the persistence round trip the VM harness runs on QEMU's controller passes on the
//! software controller, for k = 1 and k = 4.
use std::sync::Arc;

use nvme_driver::hw::DeviceBackend;
use nvme_driver::{Controller, ControllerConfig, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice};
use objstore::selfcheck::{round_trip, EngineLayout, RoundTripConfig};
use objstore::{ModelGeometry, PoolTarget};

fn controller() -> Arc<Controller> {
    bring_up(EmuDevice::start(config()).expect("software controller"))
}

fn config() -> EmuConfig {
    // MDTS 7 (512 KiB), as QEMU reports: a k = 4 slot moves 256 KiB per command.
    EmuConfig::default().with_backing(Backing::Memory { bytes: 256 << 20 }).with_mdts(7)
}

fn bring_up(device: Arc<EmuDevice>) -> Arc<Controller> {
    let backend: Arc<dyn DeviceBackend> = device;
    Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"))
}

fn small() -> RoundTripConfig {
    // 4 layers keep the test quick; the layout logic is the same as for 32.
    RoundTripConfig { geometry: ModelGeometry { layers: 4, ..ModelGeometry::llama3_8b(16) }, ..RoundTripConfig::default() }
}

#[test]
fn round_trip_passes_with_one_and_four_blocks_per_slot() {
    for k in [1, 4] {
        let targets = vec![PoolTarget { controller: controller(), namespace: NamespaceId(1) }];
        let report = round_trip(targets, &RoundTripConfig { blocks_per_slot: k, ..small() }).expect("round trip");
        assert_eq!(report.blocks_shared, 2 * 4, "k={k}: requests 1 and 2 share half of 8 blocks");
        assert_eq!(report.blocks_stored, 8 + 4 + 4, "k={k}");
        assert_eq!(report.bytes_verified, 3 * 8 * 2 * 4 * small().geometry.object_bytes(), "k={k}");
        assert_eq!(report.recovery.corrupt_headers, 0);
    }
}

#[test]
fn round_trip_passes_across_two_controllers_in_one_dma_space() {
    // Goal: the multi-controller form the VM harness runs on two QEMU controllers (one VFIO
    // container), here on two software controllers in one DMA pool, one of them PRP-only.
    let first = EmuDevice::start(config()).expect("software controller");
    let second = EmuDevice::start_in(config().with_sgl(false), &first.dma_pool()).expect("software controller");
    let targets = vec![
        PoolTarget { controller: bring_up(first), namespace: NamespaceId(1) },
        PoolTarget { controller: bring_up(second), namespace: NamespaceId(1) },
    ];
    let report = round_trip(targets, &small()).expect("round trip");
    assert_eq!(report.recovery.devices, 2);
    assert_eq!(report.bytes_verified, 3 * 8 * 2 * 4 * small().geometry.object_bytes());
}

#[test]
fn round_trip_passes_on_a_controller_with_a_small_mdts_and_one_queue_pair() {
    // Goal: a controller like a cheap or busy SSD (QEMU's `mdts=2,max_ioqpairs=1`): at most
    // 16 KiB per command and one I/O queue pair. A pool of 32 KiB objects (64 KiB per
    // block-layer, 256 KiB per k = 4 slot layer) formats, stores, reopens and retrieves byte
    // for byte: every transfer is cut into commands the controller accepts, and the pool's
    // metadata borrows the executor's queue pair. For SGL and PRP-only controllers, both engine
    // layouts, k = 1 and 4. It used to refuse the pool ("one command would move 65536 bytes;
    // pool device 0 takes at most 16384"), then fail with "no free I/O queue identifier".
    for sgl in [true, false] {
        for layout in [EngineLayout::SeparateKv, EngineLayout::BlockMajor] {
            for k in [1, 4] {
                let device = EmuDevice::start(config().with_mdts(2).with_sgl(sgl).with_io_queue_pairs_max(1)).expect("software controller");
                let targets = vec![PoolTarget { controller: bring_up(device), namespace: NamespaceId(1) }];
                let context = format!("sgl={sgl} {layout:?} k={k}");
                let report = round_trip(targets, &RoundTripConfig { blocks_per_slot: k, layout, ..small() }).expect(&context);
                assert_eq!(report.bytes_verified, 3 * 8 * 2 * 4 * small().geometry.object_bytes(), "{context}");
            }
        }
    }
}

#[test]
fn a_round_trip_whose_sizes_overflow_is_refused_before_the_device_is_formatted() {
    // Goal: a request size whose engine-block or token arithmetic overflows u32 (2 × blocks,
    // blocks × block tokens) is refused with BadRequest before anything is written: the file
    // behind the controller stays as it was (zeroes). It used to format the pool first and
    // then overflow (a panic in a debug build).
    let path = std::env::temp_dir().join(format!("objstore-roundtrip-overflow-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let bytes = 64u64 << 20;
    let config = EmuConfig::default().with_backing(Backing::File { path: path.clone(), create_bytes: Some(bytes) });
    let device = EmuDevice::start(config).expect("software controller");
    let targets = vec![PoolTarget { controller: bring_up(device), namespace: NamespaceId(1) }];
    for blocks_per_request in [u32::MAX, 1 << 28] {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            round_trip(targets.clone(), &RoundTripConfig { blocks_per_request, ..small() })
        }));
        let outcome = result.unwrap_or_else(|_| panic!("{blocks_per_request} blocks per request: a panic"));
        match outcome {
            Err(objstore::selfcheck::RoundTripError::Store(objstore::ObjstoreError::BadRequest { reason })) => {
                assert!(reason.contains("blocks"), "{reason}")
            }
            other => panic!("{blocks_per_request} blocks per request: expected BadRequest, got {other:?}"),
        }
    }
    drop(targets);
    let contents = std::fs::read(&path).expect("the backing file");
    let _ = std::fs::remove_file(&path);
    assert_eq!(contents.len() as u64, bytes);
    assert!(contents.iter().all(|&byte| byte == 0), "the file was written: the pool was formatted before the refusal");
}
