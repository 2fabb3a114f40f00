//! Tests of `StoreState` over a real in-process store: a software controller with memory
//! backing, formatted for a small model, its KV memory allocated by the store (as
//! `Store.open(...)` then `allocate_kv(...)`). Faults come from the controller's fault plans
//! (`nvme_emu`) or, for a queue error that ends no layer, `StoreState::queue_errors_injected`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::spec::status::codes;
use nvme_driver::spec::{NvmeStatus, StatusCodeType};
use nvme_emu::{EmuDevice, FaultAction, FaultPlan, FaultRule};
use objstore::{Direction, FormatParams, ModelGeometry, StoreConfig};
use tutti_daemon::pool_open::{open_pool, PoolOptions};
use tutti_devices::{DeviceKind, DeviceSpec};

use super::{Backend, RequestLimits, StoreState};
use crate::errors::ErrorClass;
use crate::tensor::LayoutKind;

/// 4 layers, 4 KiB objects: 32 KiB per block (the Python core tests' model).
pub fn geometry() -> ModelGeometry {
    ModelGeometry { layers: 4, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 }
}

/// A store's state attached to tuttid through `client` (no memory registered; the pool's
/// shape is 2 layers, 1 KV head of 64, 16-token blocks), whose requests wait `timeout`.
pub fn attached_state(client: tutti_daemon::Client, timeout: Duration) -> StoreState {
    let shape =
        tutti_daemon::protocol::PoolShape { layers: 2, kv_heads: 1, head_dim: 64, dtype_bytes: 2, block_tokens: 16, blocks_per_slot: 1 };
    let hello = tutti_daemon::protocol::HelloReply { session: 7, lease_ms: 10_000, shape };
    let config = tutti_daemon::client::RemoteConfig { timeout, ..Default::default() };
    StoreState::new(
        Backend::RemoteAttached { client, hello, config },
        None,
        RequestLimits { layers_in_flight: 1, iocbs: 64, requests_max: 4 },
    )
}

/// Taken by the tests that time how long a thread waits for the store's lock, so that they
/// never run beside each other (cargo runs tests in parallel): each keeps a core busy (a wait
/// polling in its slices, the controller's threads), and two at once on a two-core machine
/// leave a woken thread unrun past the 1 ms a give-way waits for it. Each leaves nothing
/// running once it lets go of it: no layer in flight at a request's drop (which would start a
/// completion thread, and the store's close, polling until the layer ends, would run on it
/// after the test), its own completion thread stopped.
pub fn timing_alone() -> std::sync::MutexGuard<'static, ()> {
    static TIMING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TIMING.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Every wait of these tests ends by then.
pub fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// An in-process store on a fresh 16 MiB memory-backed controller, 8 KV blocks allocated, up
/// to `layers_in_flight` layers in flight per request.
pub fn local_state(layers_in_flight: u32) -> StoreState {
    let spec = DeviceSpec::parse("emu:mem:16m", &[DeviceKind::EmuMemory]).expect("spec");
    let options = PoolOptions {
        specs: vec![spec],
        namespace: 1,
        emu_lba_bytes: 4096,
        emu_create_bytes: None,
        format: Some(FormatParams { payload_crc: true, ..FormatParams::new(geometry()) }),
        overwrite: false,
        lock_dir: PathBuf::from("/nonexistent"), // no vfio: device, nothing to lock
        client_queue_pairs: 1,
        emu_doorbell_relay: false,
    };
    let opened = open_pool(&options).expect("open the pool");
    let config = StoreConfig { iocbs: 64, ioctx_per_iocb_max: 2048, requests_max: 4, verify_retrieves: false };
    let backend = Backend::LocalOpen { pool: opened.pool, emulators: opened.emulators, locks: opened.locks, config, queue_depth: 64 };
    let limits = RequestLimits { layers_in_flight, iocbs: 64, requests_max: 4 };
    let mut state = StoreState::new(backend, None, limits);
    state.allocate(LayoutKind::BlockMajor, 8, Duration::from_secs(5)).expect("allocate_kv");
    state
}

/// The software controller of the store's one device.
pub fn emulator(state: &StoreState) -> Arc<EmuDevice> {
    match &state.backend {
        Backend::Local { emulators, .. } => emulators[0].clone().expect("a software controller"),
        _ => panic!("not an in-process store"),
    }
}

/// Fails the next I/O command the controller takes, without executing it (a media error).
pub fn fail_next_io(state: &StoreState) {
    let media = NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, codes::WRITE_FAULT);
    emulator(state).set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::Status(media))));
}

/// A prompt of `blocks` full blocks that differs per `seed`.
pub fn tokens(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * geometry().block_tokens).map(|i| seed.wrapping_mul(7919).wrapping_add(i)).collect()
}

/// A store of engine blocks 0 and 1; returns its handle.
pub fn prepare_store(state: &mut StoreState, seed: u32) -> u64 {
    let (handle, plan, _) = state.prepare(Direction::Store, &tokens(seed, 2), &[0, 1], 0).expect("prepare a store");
    assert_eq!(plan.map(|plan| plan.new_blocks), Some(2));
    handle.to_bits()
}

/// Drives `handle` until `layer` ended (completed or failed); returns whether it completed.
pub fn drive_until_ended(state: &mut StoreState, handle: u64, layer: u32) -> bool {
    let until = deadline();
    loop {
        match state.drive(handle, until) {
            Ok(Some(ended)) if ended == layer => break,
            Ok(_) => {}
            Err(failure) => panic!("driving layer {layer}: {failure:?}"),
        }
    }
    let outcome = state.request(handle).unwrap().unreported.pop_back().expect("an outcome");
    assert_eq!(outcome.layer, layer);
    outcome.failure.is_none()
}

#[test]
fn the_completion_thread_retries_a_wait_that_failed_without_ending_its_layer() {
    // Goal: a queue error seen by the completion thread (the store's wait failed, the layer
    // still in flight) is kept to report, and the request is not parked: a later pass, after a
    // short backoff, drives it again, so a transient error clears and both layers complete
    // with no wait from the engine (as docs/python.md says the thread does for any armed
    // request with a layer in flight). Before, the thread skipped the request until a wait
    // took the stall, and no layer of it ended.
    let mut state = local_state(2);
    let handle = prepare_store(&mut state, 1);
    state.request(handle).unwrap().eventfd().expect("eventfd: armed for the thread");
    for layer in [0, 1] {
        state.issue(handle, layer, 1, Direction::Store).expect("issue");
    }
    state.queue_errors_injected = 1;
    let pass = state.drive_armed(Duration::from_micros(200));
    assert_eq!(pass, super::ArmedPass { driven: true, backing_off: true }, "driven, then left alone for the backoff");
    assert!(state.request(handle).unwrap().stalled.is_some(), "the failed wait is kept to report");
    let until = deadline();
    while !state.request(handle).unwrap().in_flight.is_empty() {
        assert!(Instant::now() < until, "the thread never drove the request again: {:?}", state.request(handle).unwrap().in_flight);
        state.drive_armed(Duration::from_micros(200));
        std::thread::sleep(Duration::from_millis(1));
    }
    let request = state.request(handle).unwrap();
    assert_eq!(request.completed, [0, 1], "both layers completed once the error cleared");
    assert!(request.stalled.is_none(), "the layer it named ended: nothing left to report");
}

#[test]
fn a_commit_over_a_layer_whose_reissued_write_failed_is_refused_and_the_request_kept() {
    // Goal: through the binding, a store layer issued again after every layer completed, whose
    // second write failed (a media error), no longer counts as stored: commit is refused with
    // InvalidState and the request stays live, so the engine stores the layer again and
    // commits. Before objstore's fix the commit succeeded over the torn layer.
    let mut state = local_state(1);
    let handle = prepare_store(&mut state, 2);
    for layer in 0..geometry().layers {
        state.issue(handle, layer, 1, Direction::Store).expect("issue");
        assert!(drive_until_ended(&mut state, handle, layer), "layer {layer} completed");
    }
    fail_next_io(&state);
    state.issue(handle, 0, 1, Direction::Store).expect("layer 0 again");
    assert!(!drive_until_ended(&mut state, handle, 0), "the re-issued layer 0 failed");
    emulator(&state).set_faults(FaultPlan::none());
    let refused = state.commit(handle).expect_err("a commit over a torn layer");
    assert_eq!(refused.class, ErrorClass::InvalidState, "{refused:?}");
    assert!(state.requests.contains_key(&handle), "the request is still live");
    assert_eq!(state.lookup(&tokens(2, 2), 0).unwrap(), 0, "nothing visible");
    state.issue(handle, 0, 1, Direction::Store).expect("layer 0 once more");
    assert!(drive_until_ended(&mut state, handle, 0));
    assert_eq!(state.commit(handle).expect("commit"), 2);
    assert_eq!(state.lookup(&tokens(2, 2), 0).unwrap(), 2);
}

#[test]
fn a_commit_that_failed_after_the_store_let_go_forgets_the_request() {
    // Goal: when the store ends the request on a failed commit (in-process: a failed flush
    // finishes its data half and releases its reservation), the binding forgets it too (its
    // memory is not held for it), while a refusal that leaves the store holding it keeps it
    // (see the re-issued write test): the binding follows what the store holds, not the
    // error's kind.
    let mut state = local_state(1);
    let handle = prepare_store(&mut state, 4);
    for layer in 0..geometry().layers {
        state.issue(handle, layer, 1, Direction::Store).expect("issue");
        assert!(drive_until_ended(&mut state, handle, layer));
    }
    let flush = FaultRule::on_nth_io(1, FaultAction::Status(NvmeStatus::generic(codes::INTERNAL_ERROR)))
        .with_opcode(nvme_driver::spec::NvmOpcode::Flush as u8);
    emulator(&state).set_faults(FaultPlan::none().with_rule(flush));
    let failed = state.commit(handle).expect_err("the flush failed");
    emulator(&state).set_faults(FaultPlan::none());
    assert_eq!(failed.class, ErrorClass::Device, "{failed:?}");
    assert!(!state.requests.contains_key(&handle), "the store let go: so does the binding");
    assert_eq!(state.store_in_flight(handle), None, "the store no longer knows it");
    assert_eq!(state.lookup(&tokens(4, 2), 0).unwrap(), 0, "nothing visible");
}

#[test]
fn a_closed_store_refuses_register_kv_and_allocate_kv_as_stale() {
    // Goal: once the store is closed, register_kv (even of the very layout it had registered)
    // and allocate_kv raise StaleRequest ("the store is closed"), as every other call does.
    // Before, the registered layout was compared first: register_kv of the same memory
    // succeeded silently (re-attaching the layout to a closed store) and allocate_kv raised
    // InvalidState ("registered already").
    let mut state = local_state(1);
    let registered = state.registered.clone().expect("allocate_kv registered its layout");
    state.close(deadline());
    let again = state.register(registered, Vec::new(), None, Duration::from_secs(5)).expect_err("register_kv on a closed store");
    assert_eq!(again.class, ErrorClass::StaleRequest, "{again:?}");
    let allocated = state.allocate(LayoutKind::BlockMajor, 8, Duration::from_secs(5)).expect_err("allocate_kv on a closed store");
    assert_eq!(allocated.class, ErrorClass::StaleRequest, "{allocated:?}");
}
