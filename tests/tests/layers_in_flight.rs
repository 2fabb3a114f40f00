//! Several layers of one request in flight (`KvStore::set_layers_in_flight_max`): the next
//! layer's commands are queued at the device while the current one drains, layers complete in
//! issue order, the commit rule holds with layers queued, and a failed queued layer fails alone
//! — on the software controller with the CPU executor.

use std::time::{Duration, Instant};

use nvme_driver::spec::{NvmeStatus, StatusCodeType};
use nvme_driver::DataPointerMode;
use nvme_emu::{FaultAction, FaultPlan, FaultRule, NamespaceConfig};
use objstore::{KvRequest, KvStore, ObjstoreError, StoreConfig};
use tutti_tests::*;

struct Rig {
    store: KvStore<gio_uring::CpuExecutor>,
    engine: Engine,
    device: std::sync::Arc<nvme_emu::EmuDevice>,
    _controller: std::sync::Arc<nvme_driver::Controller>,
}

/// A pool of 16 one-block slots on a memory-backed controller, 32 engine blocks, the test
/// geometry's 4 layers, two layers in flight per request.
fn rig() -> Rig {
    let device = start_device(vec![NamespaceConfig::new(512, None)], 8 << 20, true);
    let controller = bring_up(&device, Duration::from_secs(5));
    format(&targets(&controller, &[1]), 1, Some(16));
    let engine = separate_kv(controller.dma(), 32, DataPointerMode::Sgl);
    let mut store = open_store(targets(&controller, &[1]), &engine, StoreConfig::default());
    assert_eq!(store.layers_in_flight_max(), 1, "one layer at a time unless asked");
    store.set_layers_in_flight_max(2).unwrap();
    Rig { store, engine, device, _controller: controller }
}

fn in_flight(store: &KvStore<gio_uring::CpuExecutor>, handle: objstore::RequestHandle) -> Vec<u32> {
    store.layers_in_flight(handle).unwrap().collect()
}

#[test]
fn the_next_layer_moves_while_the_current_one_is_held() {
    // Goal: with layer 1 issued before layer 0 is waited for, layer 1's commands reach the
    // device and complete while one of layer 0's commands is held back (a delayed completion):
    // the device is never idle at the boundary. Layers are still reported one by one, in order.
    let mut rig = rig();
    let tokens = Rng(21).tokens(32); // 2 blocks: 2 commands per layer
    let keys = keys_of(&tokens);
    store(&mut rig.store, &rig.engine, &tokens, &[0, 1]);
    rig.engine.scribble(4);
    rig.engine.scribble(5);
    let hold = Duration::from_millis(300);
    rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::Delay(hold))));
    let handle = rig.store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[4, 5] }).unwrap();
    let started = Instant::now();
    rig.store.retrieve_layer(handle, 0, BUDGET).unwrap();
    rig.store.retrieve_layer(handle, 1, BUDGET).unwrap();
    assert_eq!(in_flight(&rig.store, handle), [0, 1]);
    assert_eq!(rig.store.wait(handle, deadline()).unwrap(), Some(0), "the oldest layer first");
    assert!(started.elapsed() >= hold, "layer 0 was held by the delayed completion");
    // No time left to wait: layer 1 completed while layer 0 was held.
    assert_eq!(rig.store.wait(handle, Instant::now()).unwrap(), Some(1), "layer 1 moved during layer 0's hold");
    rig.device.set_faults(FaultPlan::none());
    for layer in 2..4 {
        rig.store.retrieve_layer(handle, layer, BUDGET).unwrap();
    }
    assert!(wait_poll(&mut rig.store, handle), "poll retires both layers in flight");
    assert_eq!(in_flight(&rig.store, handle), Vec::<u32>::new());
    rig.store.finish(handle).unwrap();
    assert!(rig.engine.holds(4, keys[0], 4) && rig.engine.holds(5, keys[1], 4));
}

/// Polls until nothing is in flight (bounded by the test deadline).
fn wait_poll(store: &mut KvStore<gio_uring::CpuExecutor>, handle: objstore::RequestHandle) -> bool {
    let until = deadline();
    while !store.poll(handle).unwrap() {
        if Instant::now() >= until {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

#[test]
fn a_store_commits_only_once_no_layer_is_queued_or_in_flight() {
    // Goal: the commit rule with layers queued: commit is refused while any layer is in flight
    // — also once every layer completed and one was issued again — and nothing is visible
    // until the commit that follows the last wait. Misuse is refused with typed errors.
    let mut rig = rig();
    let tokens = Rng(22).tokens(32);
    let keys = keys_of(&tokens);
    rig.engine.fill(0, keys[0]);
    rig.engine.fill(1, keys[1]);
    let plan = rig.store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1] }).unwrap();
    let changed = rig.store.set_layers_in_flight_max(1).unwrap_err();
    assert!(matches!(changed, ObjstoreError::BadRequest { .. }), "not while a request is prepared: {changed}");
    rig.store.store_layer(plan.handle, 0, BUDGET).unwrap();
    let again = rig.store.store_layer(plan.handle, 0, BUDGET).unwrap_err();
    assert!(again.to_string().contains("already in flight"), "{again}");
    rig.store.store_layer(plan.handle, 1, BUDGET).unwrap();
    let third = rig.store.store_layer(plan.handle, 2, BUDGET).unwrap_err();
    assert!(matches!(third, ObjstoreError::HandleState { .. }) && third.to_string().contains("at most 2"), "{third}");
    assert!(matches!(rig.store.finish(plan.handle), Err(ObjstoreError::HandleState { .. })));
    assert_eq!(rig.store.wait(plan.handle, deadline()).unwrap(), Some(0));
    rig.store.store_layer(plan.handle, 2, BUDGET).unwrap();
    assert_eq!(rig.store.wait(plan.handle, deadline()).unwrap(), Some(1));
    rig.store.store_layer(plan.handle, 3, BUDGET).unwrap();
    assert_eq!(in_flight(&rig.store, plan.handle), [2, 3]);
    assert!(matches!(rig.store.commit_store(plan.handle), Err(ObjstoreError::HandleState { .. })), "layers 2 and 3 in flight");
    assert_eq!(rig.store.lookup(&tokens), 0, "nothing visible before the commit");
    assert_eq!(rig.store.wait(plan.handle, deadline()).unwrap(), Some(2));
    assert!(matches!(rig.store.commit_store(plan.handle), Err(ObjstoreError::HandleState { .. })), "layer 3 in flight");
    assert_eq!(rig.store.wait(plan.handle, deadline()).unwrap(), Some(3));
    // Every layer done, and layer 0 written again: its write is in flight, so no commit yet.
    rig.store.store_layer(plan.handle, 0, BUDGET).unwrap();
    let rewriting = rig.store.commit_store(plan.handle).unwrap_err();
    assert!(matches!(rewriting, ObjstoreError::HandleState { .. }), "a layer in flight, though all completed once: {rewriting}");
    assert_eq!(rig.store.lookup(&tokens), 0);
    assert_eq!(rig.store.wait(plan.handle, deadline()).unwrap(), Some(0));
    assert_eq!(rig.store.wait(plan.handle, deadline()).unwrap(), None);
    assert_eq!(rig.store.commit_store(plan.handle).unwrap(), 2);
    assert_eq!(rig.store.lookup(&tokens), 2);
    retrieve(&mut rig.store, &rig.engine, &tokens, &[7, 8]);
    assert!(rig.engine.holds(7, keys[0], 4) && rig.engine.holds(8, keys[1], 4));
    rig.store.set_layers_in_flight_max(1).unwrap();
    assert!(matches!(rig.store.set_layers_in_flight_max(0), Err(ObjstoreError::BadRequest { .. })));
    assert!(matches!(rig.store.set_layers_in_flight_max(objstore::LAYERS_IN_FLIGHT_LIMIT + 1), Err(ObjstoreError::BadRequest { .. })));
}

#[test]
fn an_error_in_a_queued_layer_fails_that_layer_alone() {
    // Goal: a media error on a command of the layer queued behind another is reported by the
    // wait for that layer (not the one before it, not the one after); the layer after it stays
    // in flight until waited for; the store cannot commit with the failed layer missing, and
    // completes once that layer is written again.
    let mut rig = rig();
    let tokens = Rng(23).tokens(32);
    let keys = keys_of(&tokens);
    rig.engine.fill(0, keys[0]);
    rig.engine.fill(1, keys[1]);
    let media = NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, 0x81);
    // 2 commands per layer, layers fetched in issue order: the 3rd command is layer 1's first.
    rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(3, FaultAction::Status(media))));
    let plan = rig.store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1] }).unwrap();
    rig.store.store_layer(plan.handle, 0, BUDGET).unwrap();
    rig.store.store_layer(plan.handle, 1, BUDGET).unwrap();
    assert_eq!(rig.store.wait(plan.handle, deadline()).unwrap(), Some(0));
    rig.store.store_layer(plan.handle, 2, BUDGET).unwrap();
    let failed = rig.store.wait(plan.handle, deadline()).unwrap_err();
    assert!(matches!(failed, ObjstoreError::LayerIo { layer: 1, .. }), "{failed}");
    assert_eq!(in_flight(&rig.store, plan.handle), [2]);
    assert!(matches!(rig.store.finish(plan.handle), Err(ObjstoreError::HandleState { .. })), "layer 2 still in flight");
    assert_eq!(rig.store.wait(plan.handle, deadline()).unwrap(), Some(2));
    assert!(matches!(rig.store.commit_store(plan.handle), Err(ObjstoreError::HandleState { .. })), "layers 1 and 3 missing");
    rig.store.store_layer(plan.handle, 1, BUDGET).unwrap();
    rig.store.store_layer(plan.handle, 3, BUDGET).unwrap();
    assert_eq!(rig.store.wait(plan.handle, deadline()).unwrap(), Some(1));
    assert_eq!(rig.store.wait(plan.handle, deadline()).unwrap(), Some(3));
    assert_eq!(rig.store.commit_store(plan.handle).unwrap(), 2);
    retrieve(&mut rig.store, &rig.engine, &tokens, &[9, 10]);
    assert!(rig.engine.holds(9, keys[0], 4) && rig.engine.holds(10, keys[1], 4));
}

#[test]
fn lost_completions_of_two_layers_in_flight_are_abandoned_together() {
    // Goal: with two layers in flight and a completion of the first lost, `abandon_in_flight`
    // ends both (the count is of layers), leaves nothing in flight, and the request is issued
    // again and completes with the right bytes.
    let mut rig = rig();
    let tokens = Rng(24).tokens(32);
    let keys = keys_of(&tokens);
    store(&mut rig.store, &rig.engine, &tokens, &[0, 1]);
    rig.engine.scribble(2);
    rig.engine.scribble(3);
    rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)));
    let handle = rig.store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &[2, 3] }).unwrap();
    rig.store.retrieve_layer(handle, 0, BUDGET).unwrap();
    rig.store.retrieve_layer(handle, 1, BUDGET).unwrap();
    let timed_out = rig.store.wait(handle, Instant::now() + Duration::from_millis(200)).unwrap_err();
    assert!(matches!(timed_out, ObjstoreError::Gio(gio_uring::GioError::WaitTimeout { .. })), "{timed_out}");
    rig.device.set_faults(FaultPlan::none());
    assert_eq!(rig.store.abandon_in_flight().unwrap(), 2);
    assert_eq!(in_flight(&rig.store, handle), Vec::<u32>::new());
    for layer in 0..4 {
        rig.store.retrieve_layer(handle, layer, BUDGET).unwrap();
        assert_eq!(rig.store.wait(handle, deadline()).unwrap(), Some(layer));
    }
    rig.store.finish(handle).unwrap();
    assert!(rig.engine.holds(2, keys[0], 4) && rig.engine.holds(3, keys[1], 4));
}
