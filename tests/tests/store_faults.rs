//! The object store under controller limits and faults found by review (issue 17): small
//! CAP.MQES, shallow lent queues, metadata commands that time out, verified retrieves that
//! fail, stores dropped with queue pairs that could not be deleted.

use std::time::Duration;

use nvme_driver::DataPointerMode;
use nvme_emu::NamespaceConfig;
use objstore::StoreConfig;
use tutti_tests::*;

#[test]
fn a_controller_with_a_small_mqes_is_served() {
    // Goal: on a controller whose CAP.MQES allows 16 entries per queue, format, open (metadata
    // queues of 64 asked for), the CPU executor (256 asked for) and a store/retrieve round trip
    // all work at the depth the controller allows; they used to fail with InvalidQueueDepth.
    let device = nvme_emu::EmuDevice::start(device_config(vec![NamespaceConfig::new(512, None)], 8 << 20, true).with_max_queue_entries(16))
        .expect("software controller");
    let controller = bring_up(&device, Duration::from_secs(5));
    assert_eq!(controller.max_queue_depth(), 16);
    format(&targets(&controller, &[1]), 1, Some(16));
    let engine = separate_kv(controller.dma(), 8, DataPointerMode::Sgl);
    let mut kv = open_store(targets(&controller, &[1]), &engine, StoreConfig::default());
    let tokens = Rng(20).tokens(32);
    store(&mut kv, &engine, &tokens, &[0, 1]);
    retrieve(&mut kv, &engine, &tokens, &[2, 3]);
    let keys = keys_of(&tokens);
    assert!(engine.holds(2, keys[0], 4) && engine.holds(3, keys[1], 4));
}

#[test]
fn a_failed_verification_is_sticky_and_spares_good_blocks_of_its_slot() {
    // Goal (k = 2, blocks A and B in one slot, B's bytes changed on disk): R1 retrieves A and B
    // and fails with PayloadMismatch naming B; a second `wait` and a `poll` on R1 fail the same
    // way (they used to report the request complete), and no layer can be issued; R2, pinned on
    // the same slot before R1 condemned it, retrieves A and verifies it against the CRC recorded
    // at its prepare (it used to compare with the Empty entry R1 left in the mirror).
    use objstore::{KvRequest, ObjstoreError};
    let device = start_device(vec![NamespaceConfig::new(512, None)], 8 << 20, true);
    let controller = bring_up(&device, Duration::from_secs(5));
    format(&targets(&controller, &[1]), 2, Some(8));
    let engine = separate_kv(controller.dma(), 32, DataPointerMode::Sgl);
    let verified = StoreConfig { verify_retrieves: true, ..StoreConfig::default() };
    let mut kv = open_store(targets(&controller, &[1]), &engine, verified);
    let tokens = Rng(21).tokens(32);
    let keys = keys_of(&tokens);
    store(&mut kv, &engine, &tokens, &[0, 1]);
    let (a, b) = (kv.pool().index().get(keys[0]).unwrap(), kv.pool().index().get(keys[1]).unwrap());
    assert_eq!((a.slot, a.index, b.slot, b.index), (a.slot, 0, a.slot, 1), "A and B share a slot");
    let superblock = *kv.pool().superblock(0);
    let lba = superblock.block_lba(b.slot, 1) + superblock.layer_stride_blocks();
    let mut sector = raw_read(&controller, 1, lba, 512);
    sector[7] ^= 0x10;
    raw_write(&controller, 1, lba, &sector);
    for block in [10, 11, 12] {
        engine.scribble(block);
    }
    let r2 = kv.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[12] }).unwrap();
    let r1 = kv.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[10, 11] }).unwrap();
    for layer in 0..3 {
        kv.retrieve_layer(r1, layer, BUDGET).unwrap();
        assert_eq!(kv.wait(r1, deadline()).unwrap(), Some(layer));
    }
    kv.retrieve_layer(r1, 3, BUDGET).unwrap();
    fn mismatch<T>(result: &objstore::Result<T>) -> bool {
        matches!(result, Err(ObjstoreError::PayloadMismatch { blocks, .. }) if blocks.len() == 1 && blocks[0].position == 1)
    }
    let first = kv.wait(r1, deadline());
    assert!(mismatch(&first), "{first:?}");
    let again = kv.wait(r1, deadline());
    assert!(mismatch(&again), "a second wait must not report the failed request complete: {again:?}");
    let polled = kv.poll(r1);
    assert!(mismatch(&polled), "poll must not report the failed request complete: {polled:?}");
    assert!(mismatch(&kv.retrieve_layer(r1, 0, BUDGET)), "no layer of a failed request is issued");
    kv.finish(r1).unwrap();
    assert_eq!(kv.lookup(&tokens), 0, "the slot holding A and B is evicted");
    for layer in 0..4 {
        kv.retrieve_layer(r2, layer, BUDGET).unwrap();
        assert_eq!(kv.wait(r2, deadline()).unwrap(), Some(layer), "A is good: layer {layer}");
    }
    assert!(kv.poll(r2).unwrap());
    kv.finish(r2).unwrap();
    assert!(engine.holds(12, keys[0], 4));
}

#[test]
fn a_verified_retrieve_with_a_layer_issued_again_compares_when_the_re_read_completes_and_ends() {
    // Goal (two layers in flight, block B's bytes changed on disk): layer 0 is issued again
    // together with the last layer. Its issue unfolds the CRCs, so the last layer's wait
    // completes it without a comparison and the re-read's wait, the last missing layer,
    // compares and finds the mismatch; nothing stays in flight, the mismatch stays (poll, a
    // further issue refused with it) and `finish` succeeds. (Before the re-read unfolded the
    // CRCs, the last layer's wait compared against layer 0's first read with the re-read in
    // flight, and an earlier defect left that re-read uncollected so `finish` refused.)
    use objstore::{KvRequest, ObjstoreError};
    let device = start_device(vec![NamespaceConfig::new(512, None)], 8 << 20, true);
    let controller = bring_up(&device, Duration::from_secs(5));
    format(&targets(&controller, &[1]), 1, Some(8));
    let engine = separate_kv(controller.dma(), 32, DataPointerMode::Sgl);
    let verified = StoreConfig { verify_retrieves: true, ..StoreConfig::default() };
    let mut kv = open_store(targets(&controller, &[1]), &engine, verified);
    kv.set_layers_in_flight_max(2).unwrap();
    let tokens = Rng(22).tokens(32);
    let keys = keys_of(&tokens);
    store(&mut kv, &engine, &tokens, &[0, 1]);
    let b = kv.pool().index().get(keys[1]).unwrap();
    let superblock = *kv.pool().superblock(0);
    let lba = superblock.block_lba(b.slot, 0) + superblock.layer_stride_blocks();
    let mut sector = raw_read(&controller, 1, lba, 512);
    sector[7] ^= 0x10;
    raw_write(&controller, 1, lba, &sector);
    let r = kv.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[10, 11] }).unwrap();
    for layer in 0..3 {
        kv.retrieve_layer(r, layer, BUDGET).unwrap();
        assert_eq!(kv.wait(r, deadline()).unwrap(), Some(layer));
    }
    kv.retrieve_layer(r, 3, BUDGET).unwrap();
    kv.retrieve_layer(r, 0, BUDGET).unwrap();
    let in_flight = |kv: &objstore::KvStore<gio_uring::CpuExecutor>| kv.layers_in_flight(r).unwrap().collect::<Vec<_>>();
    assert_eq!(in_flight(&kv), [3, 0]);
    let mismatch = |result: &objstore::Result<Option<u32>>| matches!(result, Err(ObjstoreError::PayloadMismatch { .. }));
    let last = kv.wait(r, deadline());
    assert!(matches!(last, Ok(Some(3))), "layer 0 is missing again: no comparison yet: {last:?}");
    assert_eq!(in_flight(&kv), [0]);
    let again = kv.wait(r, deadline());
    assert!(mismatch(&again), "the re-read's wait compares: {again:?}");
    assert!(in_flight(&kv).is_empty(), "the layer issued again was collected");
    assert!(matches!(kv.poll(r), Err(ObjstoreError::PayloadMismatch { .. })));
    assert!(matches!(kv.retrieve_layer(r, 1, BUDGET), Err(ObjstoreError::PayloadMismatch { .. })));
    kv.finish(r).expect("nothing in flight: the request ends");
}

#[test]
fn a_store_whose_queue_pair_cannot_be_deleted_keeps_its_mapping_table() {
    // Goal: a retrieve's completion is lost and the controller refuses every Delete I/O SQ, so
    // neither `abandon_in_flight` nor teardown can delete the executor's queue pair; its Read
    // may still fetch SGL descriptors from the mapping table and write the engine's memory.
    // Closing the store must say so (`false`: keep the KV memory) and keep the table mapped; it
    // used to free the table, handing its IOVA to the next allocation.
    use nvme_driver::spec::status::codes;
    use nvme_driver::spec::{AdminOpcode, NvmeStatus};
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    use objstore::KvRequest;
    let device = start_device(vec![NamespaceConfig::new(512, None)], 8 << 20, true);
    let controller = bring_up(&device, Duration::from_secs(1));
    format(&targets(&controller, &[1]), 1, Some(16));
    let engine = separate_kv(controller.dma(), 8, DataPointerMode::Sgl);
    let mut kv = open_store(targets(&controller, &[1]), &engine, StoreConfig::default());
    let tokens = Rng(22).tokens(16);
    store(&mut kv, &engine, &tokens, &[0]);
    let table = kv.table().region_range().expect("an SGL descriptor table").start;
    let internal = NvmeStatus::generic(codes::INTERNAL_ERROR);
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)).with_rule(FaultRule {
        repeat: true,
        ..FaultRule::on_nth_admin(1, AdminOpcode::DeleteIoSubmissionQueue, FaultAction::Status(internal))
    }));
    let handle = kv.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[1] }).unwrap();
    kv.retrieve_layer(handle, 0, BUDGET).unwrap();
    assert!(kv.wait(handle, std::time::Instant::now() + Duration::from_millis(200)).is_err());
    assert!(kv.abandon_in_flight().is_err(), "the old queue pair cannot be deleted");
    let leaked_before = objstore::leaked_dma_regions();
    assert!(!kv.close(), "the engine must keep its KV memory");
    device.set_faults(FaultPlan::none());
    assert!(objstore::leaked_dma_regions() > leaked_before);
    assert!(controller.dma().translate(table, 1).is_ok(), "the mapping table was freed under a live queue pair");
}

#[test]
fn a_healthy_store_closes_with_its_memory_free_to_reuse() {
    // Goal: with every queue pair deleted, `close` says the KV memory may be freed and the
    // mapping table is freed (nothing leaked).
    let device = start_device(vec![NamespaceConfig::new(512, None)], 8 << 20, true);
    let controller = bring_up(&device, Duration::from_secs(5));
    format(&targets(&controller, &[1]), 1, Some(16));
    let engine = separate_kv(controller.dma(), 8, DataPointerMode::Sgl);
    let mut kv = open_store(targets(&controller, &[1]), &engine, StoreConfig::default());
    store(&mut kv, &engine, &Rng(23).tokens(16), &[0]);
    let table = kv.table().region_range().expect("an SGL descriptor table").start;
    assert!(kv.close());
    assert!(controller.dma().translate(table, 1).is_err(), "the table is freed");
    assert_eq!(controller.leaked_queue_pairs(), 0);
}
