//! An executor error met by the poll that starts the layers a call just handed over (the
//! rigged executor's `poll_fails_after_submit`; gio-uring reports such an error once, there):
//! the runtime fails those layers with it at once, whether the call goes on to wait for them
//! (`wait_layer_kv`, a forced store, `drain`), ends with the handover (`begin_layer`, then
//! `abort_prefill` or `wait_layer_kv`), or forces a store out for `begin_prefill`. Split from
//! tests/executor_errors.rs. Every call that could hang runs under a bound.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{bounded, is_the_executor_error, prefill, prompt, rigged_stack_timed, Stack};
use gio_uring::{Executor, GioError};
use nvme_driver::spec::NvmOpcode;
use objstore::KvRequest;
use tutti_runtime::{IoDirection, IoEventKind, PolicyChoice, RuntimeError};

#[test]
fn an_executor_error_met_starting_a_read_handed_over_fails_that_read() {
    // Goal: an executor error met by the poll that starts the layers a call just handed over
    // (`pump`'s peek; gio-uring reports it once, to that poll) reaches them: `before_layer(0)`,
    // whose `begin_layer` hands layer 0's read over, fails that read with the executor's error
    // at once. Before, `begin_layer` returned it (`Store`, "start issued I/O", the prefill
    // running: retry) and it was gone: the retry's wait, on a read hung on the stopped
    // executor, ran a whole `io_timeout` to fail as `WaitTimeout`, which points the engine at
    // `abandon_in_flight` and not the executor. The same held for every call that hands a layer
    // over (`after_layer`, `end_prefill`, `decode_step`, `poll_io`, a forced store).
    // `io_timeout` is long beside the call's own work so that the bound below tells the two
    // apart.
    bounded(|| {
        let io_timeout = Duration::from_secs(8);
        let (mut stack, rigging) = rigged_stack_timed(PolicyChoice::SlackAware, io_timeout);
        prefill(&mut stack, &prompt(0, 0), &[0, 1, 2, 3]).unwrap();
        common::drain_healthy(&mut stack.runtime);
        // Layer 0's read is lost, as on a stopped executor.
        common::lose_completion(&stack.device, 1, NvmOpcode::Read);
        let tokens = prompt(0, 1);
        let blocks: Vec<u32> = (4..10).collect();
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks }).unwrap();
        assert_eq!(start.cached_blocks, 4);
        // Nothing is in flight: the first executor poll is the one starting layer 0's read.
        rigging.poll_fails.store(true, Ordering::SeqCst);
        let started = Instant::now();
        let failed = stack.runtime.before_layer(start.id, 0);
        let waited = started.elapsed();
        assert!(!rigging.poll_fails.load(Ordering::SeqCst), "the poll starting layer 0's read met the executor's error");
        assert!(
            matches!(
                &failed,
                Err(RuntimeError::ReadFailed { layer: 0, source: objstore::ObjstoreError::Gio(GioError::WorkerStopped { worker: 3 }) })
            ),
            "the read handed over fails with the executor's error: {failed:?}"
        );
        assert!(waited < io_timeout / 2, "the read failed at once, not after a wait: {waited:?}");
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 1, "the hung read, retiring");
        assert_eq!(stack.runtime.retiring_requests(), 0);
        assert!((4..10).all(|block| stack.runtime.releasable(block)));
    });
}

#[test]
fn begin_prefill_refuses_for_an_executor_error_met_forcing_a_store() {
    // Goal: an executor error `begin_prefill` meets while forcing the oldest store out
    // (`ForceOldest`, the queue full) is returned as its doc says, with nothing of the request
    // prepared, and a retry begins it. Forcing advances the queues with no write of its own in
    // flight when the error is claimed (its writes are waited for one at a time), so nothing
    // claimed it there. Before, it was kept past the forcing: the prefill began and its first
    // read failed with an error met before anything of it was prepared. Here the error is met
    // by the poll that starts the forced store's next write layer, which the healthy device
    // completes: the same call claims the error (`advance`'s pass after a handover), for that
    // write if it is still in flight then (the store stays queued and the retry commits it),
    // or, the write done and its store committed, after the forcing (`begin_prefill`'s check).
    bounded(|| {
        let mut config = common::config(PolicyChoice::SlackAware);
        config.io_timeout = common::IO_TIMEOUT;
        config.write_queue_limit_stores = 1;
        config.on_write_queue_full = tutti_runtime::WriteQueueFullAction::ForceOldest;
        let (mut stack, rigging) = common::rigged_stack_configured(config);
        let first = prompt(0, 0);
        prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
        assert_eq!(stack.runtime.queued_stores(), 1, "slack-aware keeps the last layer queued");
        let before = stack.runtime.counters();
        // Another session's prompt: a store of its own, which needs the one store's room.
        let other: Vec<u32> = prompt(1, 0).iter().map(|token| token + 7_000_000).collect();
        let blocks: Vec<u32> = (10..14).collect();
        rigging.poll_fails_after_submit.store(true, Ordering::SeqCst);
        let refused = stack.runtime.begin_prefill(&KvRequest { tokens: &other, block_ids: &blocks });
        assert!(!rigging.poll_fails_after_submit.load(Ordering::SeqCst), "the forced store's write was handed over");
        assert!(!rigging.poll_fails.load(Ordering::SeqCst), "the executor's error was met");
        assert!(is_the_executor_error(&refused), "the executor's error is returned: {refused:?}");
        let counters = stack.runtime.counters();
        assert_eq!(counters.prefills, before.prefills, "no prefill began");
        // Committed, or queued with its write in flight, whichever the claim's poll found.
        let committed = (counters.stores_forced, stack.runtime.queued_stores());
        assert!(committed == (1, 0) || committed == (0, 1), "the forced store committed or is still queued: {counters:?}");
        assert!(blocks.iter().all(|&block| stack.runtime.releasable(block)), "nothing of the request was prepared");
        assert_eq!(prefill(&mut stack, &other, &blocks).unwrap(), 0, "the retry begins and runs");
        assert_eq!(stack.runtime.lookup(&first), 4, "the forced store committed");
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&other), 4);
    });
}

/// Whether `result` is `ReadFailed` for `layer` with the executor error the rigged poll returns.
fn is_the_executor_error_failing_read<T>(result: &Result<T, RuntimeError>, layer: u32) -> bool {
    matches!(
        result,
        Err(RuntimeError::ReadFailed { layer: failed, source: objstore::ObjstoreError::Gio(GioError::WorkerStopped { worker: 3 }) })
            if *failed == layer
    )
}

#[test]
fn an_executor_error_met_starting_a_read_handed_over_while_waiting_fails_that_read() {
    // Goal: an executor error met by the poll that starts a read handed over inside
    // `wait_layer_kv`'s wait (no-overlap's layer 0 waits for every read: each after the first
    // is handed over there) fails that read with the executor's error at once. Before, `pump`
    // kept it and the wait went straight to waiting for that read, which never heard it: a
    // whole `io_timeout` later it failed as `WaitTimeout`, the kept error left for a later call
    // (and forgotten by the `abandon_in_flight` that `WaitTimeout` points the engine at).
    bounded(|| {
        let io_timeout = Duration::from_secs(8);
        let (mut stack, rigging) = rigged_stack_timed(PolicyChoice::NoOverlap, io_timeout);
        prefill(&mut stack, &prompt(0, 0), &[0, 1, 2, 3]).unwrap();
        common::drain_healthy(&mut stack.runtime);
        // One command per block: layer 1's first read is the 5th of a 4-block retrieve. It is
        // lost, as on a stopped executor.
        common::lose_completion(&stack.device, 5, NvmOpcode::Read);
        let tokens = prompt(0, 1);
        let blocks: Vec<u32> = (4..10).collect();
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks }).unwrap();
        assert_eq!(start.cached_blocks, 4);
        // Every read decided, layer 0's handed over (its start's poll clean).
        stack.runtime.begin_layer(start.id, 0).unwrap();
        // The next handover is layer 1's read, inside the wait: the poll starting it fails.
        rigging.poll_fails_after_submit.store(true, Ordering::SeqCst);
        let started = Instant::now();
        let failed = stack.runtime.wait_layer_kv(start.id, 0);
        let waited = started.elapsed();
        assert!(!rigging.poll_fails.load(Ordering::SeqCst), "the poll starting layer 1's read met the executor's error");
        assert!(is_the_executor_error_failing_read(&failed, 1), "the read handed over fails with the executor's error: {failed:?}");
        assert!(waited < io_timeout / 2, "the read failed at once, not after a wait: {waited:?}");
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 1, "the hung read, retiring");
        assert_eq!(stack.runtime.retiring_requests(), 0);
        assert!((4..10).all(|block| stack.runtime.releasable(block)));
    });
}

#[test]
fn abort_prefill_fails_a_read_handed_over_with_the_executor_error_met_starting_it() {
    // Goal: `abort_prefill` right after `begin_layer` handed a read over and the poll starting
    // it met an executor error (kept for it) ends the prefill at once, the read failed with the
    // executor's error (it is retiring: `Err`), not after a whole `io_timeout` spent waiting
    // for a read hung on the failed executor.
    bounded(|| {
        let io_timeout = Duration::from_secs(8);
        let (mut stack, rigging) = rigged_stack_timed(PolicyChoice::SlackAware, io_timeout);
        prefill(&mut stack, &prompt(0, 0), &[0, 1, 2, 3]).unwrap();
        common::drain_healthy(&mut stack.runtime);
        // Layer 0's read is lost, as on a stopped executor.
        common::lose_completion(&stack.device, 1, NvmOpcode::Read);
        let tokens = prompt(0, 1);
        let blocks: Vec<u32> = (4..10).collect();
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks }).unwrap();
        rigging.poll_fails_after_submit.store(true, Ordering::SeqCst);
        stack.runtime.begin_layer(start.id, 0).unwrap();
        assert!(!rigging.poll_fails.load(Ordering::SeqCst), "the poll starting layer 0's read met the executor's error");
        let started = Instant::now();
        let aborted = stack.runtime.abort_prefill(start.id);
        let waited = started.elapsed();
        assert!(is_the_executor_error_failing_read(&aborted, 0), "the read fails with the executor's error: {aborted:?}");
        assert!(waited < io_timeout / 2, "the abort ended at once, not after a wait: {waited:?}");
        assert_eq!(stack.runtime.retiring_requests(), 1, "the hung read");
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 1, "the hung read");
        assert!((4..10).all(|block| stack.runtime.releasable(block)));
        common::drain_healthy(&mut stack.runtime);
    });
}

/// Polls until no write layer of `stack` is in flight (every one issued has completed, as the
/// event log says), or fails after 5 s.
#[track_caller]
fn settle_writes<E: Executor>(stack: &mut Stack<E>) {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        stack.runtime.poll_io().expect("a healthy poll");
        let count =
            |kind| stack.runtime.events().iter().filter(|event| event.direction == IoDirection::Write && event.kind == kind).count();
        if count(IoEventKind::Issued) == count(IoEventKind::Completed) {
            return;
        }
        assert!(Instant::now() < until, "a healthy write did not complete");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn begin_prefill_refuses_at_once_for_an_executor_error_met_starting_a_forced_write_that_hangs() {
    // Goal: under `ForceOldest`, an executor error met by the poll starting the forced store's
    // write layer, which hangs on the failed executor, fails `begin_prefill` with that error
    // at once (`Store`, "poll the executor"), nothing of the request prepared. Before, it was
    // kept and the forced write's wait ran a whole `io_timeout`: `begin_prefill` returned
    // `WriteQueueFull` ("a forced write timed out") and the executor's error only came with a
    // later call.
    bounded(|| {
        let io_timeout = Duration::from_secs(8);
        let mut config = common::config(PolicyChoice::SlackAware);
        config.io_timeout = io_timeout;
        config.write_queue_limit_stores = 1;
        config.on_write_queue_full = tutti_runtime::WriteQueueFullAction::ForceOldest;
        let (mut stack, rigging) = common::rigged_stack_configured(config);
        let first = prompt(0, 0);
        prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
        assert_eq!(stack.runtime.queued_stores(), 1, "slack-aware keeps the last layer queued");
        settle_writes(&mut stack);
        assert_eq!(stack.runtime.queued_stores(), 1, "slack-aware keeps the last layer queued");
        // The forced write layer is lost, as on a stopped executor.
        common::lose_completion(&stack.device, 1, NvmOpcode::Write);
        let before = stack.runtime.counters();
        let other: Vec<u32> = prompt(1, 0).iter().map(|token| token + 7_000_000).collect();
        let blocks: Vec<u32> = (10..14).collect();
        rigging.poll_fails_after_submit.store(true, Ordering::SeqCst);
        let started = Instant::now();
        let refused = stack.runtime.begin_prefill(&KvRequest { tokens: &other, block_ids: &blocks });
        let waited = started.elapsed();
        assert!(!rigging.poll_fails_after_submit.load(Ordering::SeqCst), "the forced store's write was handed over");
        assert!(!rigging.poll_fails.load(Ordering::SeqCst), "the executor's error was met");
        assert!(is_the_executor_error(&refused), "the executor's error is returned: {refused:?}");
        assert!(waited < io_timeout / 2, "refused at once, not after a wait: {waited:?}");
        assert_eq!(stack.runtime.counters().prefills, before.prefills, "no prefill began");
        assert_eq!(stack.runtime.queued_stores(), 1, "the forced store stays queued, its write in flight");
        assert!(blocks.iter().all(|&block| stack.runtime.releasable(block)), "nothing of the request was prepared");
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 1, "the hung write");
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&first), 4);
    });
}

#[test]
fn a_drain_fails_at_once_for_an_executor_error_met_starting_a_write_that_hangs() {
    // Goal: `drain` whose handover of a write layer meets an executor error (the poll starting
    // it), the layer hung on the failed executor, returns that error at once (`Store`, "poll
    // the executor"), the store still queued. Before, it was kept, the write's wait ran a whole
    // `io_timeout`, and only then did the drain's last advance return it.
    bounded(|| {
        let io_timeout = Duration::from_secs(8);
        let (mut stack, rigging) = rigged_stack_timed(PolicyChoice::SlackAware, io_timeout);
        let first = prompt(0, 0);
        prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
        settle_writes(&mut stack);
        assert_eq!(stack.runtime.queued_stores(), 1, "slack-aware keeps the last layer queued");
        common::lose_completion(&stack.device, 1, NvmOpcode::Write);
        rigging.poll_fails_after_submit.store(true, Ordering::SeqCst);
        let started = Instant::now();
        let failed = stack.runtime.drain();
        let waited = started.elapsed();
        assert!(!rigging.poll_fails.load(Ordering::SeqCst), "the executor's error was met");
        assert!(is_the_executor_error(&failed), "the executor's error is returned: {failed:?}");
        assert!(waited < io_timeout / 2, "the drain failed at once, not after a wait: {waited:?}");
        assert_eq!(stack.runtime.queued_stores(), 1, "the store stays queued, its write in flight");
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 1, "the hung write");
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&first), 4);
    });
}
