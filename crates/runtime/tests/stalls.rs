//! A device that holds a completion back past `io_timeout`, or loses it: the runtime never hands
//! back engine memory the device may still move (`releasable` stays false until the layer
//! ends), never hangs, and retires what ended. Every call that could hang runs under a bound.
//! (The executor's own failures, through a rigged executor: tests/executor_errors.rs.)

mod common;

use std::time::{Duration, Instant};

use common::{bounded, config, prefill, prompt, retire_a_read, stack, Stack, IO_TIMEOUT};
use gio_uring::{Executor, GioError};
use nvme_driver::spec::NvmOpcode;
use nvme_emu::{FaultAction, FaultPlan, FaultRule};
use objstore::KvRequest;
use tutti_runtime::{PolicyChoice, Runtime, RuntimeError, WriteQueueFullAction};

fn stalled_stack(policy: PolicyChoice) -> Stack {
    let mut config = config(policy);
    config.io_timeout = IO_TIMEOUT;
    config.write_queue_limit_stores = 1;
    stack(config, None)
}

#[test]
fn a_read_whose_completion_is_lost_retires_and_the_next_request_goes_on() {
    // Goal: a read whose completion the device lost times out: `ReadFailed`, and the request's
    // store leaves the queue at once. Before, the retrieve's refused `finish` skipped dropping
    // the store, which then stayed queued uncommittable: at the one-store limit `ForceOldest`
    // forced it in an endless loop and the next `begin_prefill` never returned. The retrieve
    // itself retires: its target blocks stay unreleasable (the lost command may still write
    // them) until `abandon_in_flight` ends it; meanwhile the next request runs, and `drain`
    // says what is left rather than `Ok`.
    bounded(|| {
        let layers = common::geometry().layers;
        let mut stack = stalled_stack(PolicyChoice::SlackAware);
        let first = prompt(0, 0);
        prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
        common::drain_healthy(&mut stack.runtime);
        common::lose_completion(&stack.device, 1, NvmOpcode::Read);
        let second = prompt(0, 1);
        let targets: Vec<u32> = (4..10).collect();
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &second, block_ids: &targets }).unwrap();
        assert_eq!((start.cached_blocks, start.queued_blocks), (4, 2));
        let failed = stack.runtime.before_layer(start.id, 0);
        assert!(matches!(failed, Err(RuntimeError::ReadFailed { .. })), "{failed:?}");
        assert_eq!(stack.runtime.queued_stores(), 0, "the failed request's store is dropped");
        assert_eq!(stack.runtime.retiring_requests(), 1, "the retrieve waits for its lost read");
        assert!((4..8).all(|block| !stack.runtime.releasable(block)), "the lost read may still write its targets");
        assert!((8..10).all(|block| stack.runtime.releasable(block)), "the dropped store's blocks are free");

        // The next request, at the one-store limit.
        let third = prompt(1, 0);
        let third_blocks: Vec<u32> = (10..14).collect();
        let started = Instant::now();
        assert_eq!(prefill(&mut stack, &third, &third_blocks).unwrap(), 2, "the shared system prompt is read");
        assert!(started.elapsed() < Duration::from_secs(2), "the next prefill took {:?}", started.elapsed());
        let drained = common::drain_writes(&mut stack.runtime);
        assert!(matches!(drained, Err(RuntimeError::DrainIncomplete { queued_stores: 0, retiring: 1 })), "{drained:?}");
        assert!((4..8).all(|block| !stack.runtime.releasable(block)));

        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 1, "the lost read is the one layer in flight");
        assert_eq!(stack.runtime.retiring_requests(), 0);
        assert!((0..14).all(|block| stack.runtime.releasable(block)));
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&second), 4, "the failed request stored nothing");
        assert_eq!(stack.runtime.lookup(&third), 4);
        // The store works on after the abandon: the second request again, read and stored.
        let again: Vec<u32> = (20..26).collect();
        assert_eq!(prefill(&mut stack, &second, &again).unwrap(), 4);
        assert!(stack.engine.holds(&second, 0..4, &again, layers));
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&second), 6);
    });
}

#[test]
fn a_store_dropped_with_its_write_in_flight_keeps_its_blocks_until_the_write_ends() {
    // Goal: a store dropped while its write is still in flight (the device holds the completion
    // back past `io_timeout`) keeps its engine blocks unreleasable until the write ends, and
    // `abort_prefill` says so. Before, the drop released them at once (the engine could reuse
    // memory the device was still reading) and only the refused `finish` was reported. The
    // runtime retires the store when the late completion arrives.
    bounded(|| {
        let mut stack = stalled_stack(PolicyChoice::Naive);
        // Well past `io_timeout`: the drop waits that long, then finds the write in flight.
        let late = 3 * IO_TIMEOUT;
        stack
            .device
            .set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::Delay(late)).with_opcode(NvmOpcode::Write as u8)));
        let tokens = prompt(0, 0);
        let blocks = [0, 1, 2, 3];
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks }).unwrap();
        assert_eq!((start.cached_blocks, start.queued_blocks), (0, 4));
        stack.runtime.before_layer(start.id, 0).unwrap();
        stack.engine.compute_layer(&tokens, 0..4, &blocks, 0);
        stack.runtime.after_layer(start.id, 0).unwrap();
        // Naive writes layer k−1 at layer k's boundary.
        stack.runtime.begin_layer(start.id, 1).unwrap();
        assert_eq!(stack.runtime.counters().write_layers_issued, 1);
        let aborted = stack.runtime.abort_prefill(start.id);
        assert!(matches!(aborted, Err(RuntimeError::StillInFlight { .. })), "{aborted:?}");
        assert_eq!(stack.runtime.queued_stores(), 0);
        assert_eq!(stack.runtime.retiring_requests(), 1);
        assert!(blocks.iter().all(|&block| !stack.runtime.releasable(block)), "the device may still read them");
        let until = Instant::now() + late + Duration::from_secs(5);
        while stack.runtime.retiring_requests() > 0 {
            assert!(Instant::now() < until, "the late write was never retired");
            stack.runtime.poll_io().unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(blocks.iter().all(|&block| stack.runtime.releasable(block)));
        assert_eq!(stack.runtime.lookup(&tokens), 0, "an aborted store is never visible");
        common::drain_healthy(&mut stack.runtime);
        // The runtime goes on.
        prefill(&mut stack, &tokens, &[4, 5, 6, 7]).unwrap();
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&tokens), 4);
    });
}

#[test]
fn force_oldest_stores_the_first_blocks_of_a_request_larger_than_the_queue() {
    // Goal: under `ForceOldest`, a request with more new blocks than the whole write queue
    // holds still reads its cached prefix and stores its first `write_queue_limit_blocks` new
    // blocks (`stores_truncated`). Before, `begin_prefill` failed with `WriteQueueFull` and read
    // nothing, not even the prefix. `Refuse` still refuses it.
    bounded(|| {
        let layers = common::geometry().layers;
        for action in [WriteQueueFullAction::ForceOldest, WriteQueueFullAction::Refuse] {
            let mut config = config(PolicyChoice::SlackAware);
            config.write_queue_limit_blocks = 2;
            config.on_write_queue_full = action;
            let mut stack = stack(config, None);
            let first = prompt(0, 0);
            let result = prefill(&mut stack, &first, &[0, 1, 2, 3]);
            if action == WriteQueueFullAction::Refuse {
                assert!(matches!(result, Err(RuntimeError::WriteQueueFull { .. })), "{result:?}");
                continue;
            }
            assert_eq!(result.unwrap(), 0);
            assert_eq!(stack.runtime.counters().stores_truncated, 1);
            common::drain_healthy(&mut stack.runtime);
            assert_eq!(stack.runtime.lookup(&first), 2, "the first two new blocks are stored");
            let second = prompt(0, 1);
            let blocks: Vec<u32> = (10..16).collect();
            assert_eq!(prefill(&mut stack, &second, &blocks).unwrap(), 2, "the cached prefix is read");
            assert!(stack.engine.holds(&second, 0..2, &blocks, layers));
            assert_eq!(stack.runtime.counters().stores_truncated, 2);
            common::drain_healthy(&mut stack.runtime);
            assert_eq!(stack.runtime.lookup(&second), 4);
        }
    });
}

#[test]
fn a_finish_that_cannot_drain_hands_the_runtime_back() {
    // Goal: `finish` whose drain fails (here a write whose completion the device lost) hands
    // the runtime back, store and all, instead of dropping them with the write in flight: the
    // engine keeps `releasable`, `abandon_in_flight` and, in the end, `KvStore::close`'s answer
    // (whether its KV memory may be freed). Before, the error came alone and the store was
    // dropped unclosed.
    bounded(|| {
        let mut stack = stalled_stack(PolicyChoice::SlackAware);
        let tokens = prompt(0, 0);
        let blocks = [0, 1, 2, 3];
        prefill(&mut stack, &tokens, &blocks).unwrap();
        assert_eq!(stack.runtime.queued_stores(), 1, "slack-aware keeps the last layer queued");
        common::lose_completion(&stack.device, 1, NvmOpcode::Write);
        // The engine's KV memory outlives the store, as in an engine.
        let Stack { device: _device, runtime, engine: _engine } = stack;
        let failed = match runtime.finish() {
            Ok(_) => panic!("finish drained a store whose write completion was lost"),
            Err(failed) => failed,
        };
        assert!(failed.to_string().contains("handed back"), "{failed}");
        let mut runtime = *failed.runtime;
        assert_eq!(runtime.queued_stores(), 1, "the store with its lost write is still queued");
        assert!(blocks.iter().all(|&block| !runtime.releasable(block)), "the lost write may still read them");
        assert_eq!(runtime.abandon_in_flight().unwrap(), 1, "the lost write is the one layer in flight");
        assert_eq!(runtime.queued_stores(), 1, "the abandoned write, issued again, is left for finish to drain");
        let (store, counters) = match runtime.finish() {
            Ok(finished) => finished,
            // The healthy write's wait timed out, the whole test process paused past
            // `io_timeout` (see `common::IO_TIMEOUT`): the runtime comes back, its store queued,
            // and draining again collects it.
            Err(failed) if matches!(failed.error, RuntimeError::DrainIncomplete { queued_stores: 1, retiring: 0 }) => {
                let mut runtime = *failed.runtime;
                common::drain_healthy(&mut runtime);
                runtime.finish().expect("nothing left to drain")
            }
            Err(failed) => panic!("the abandoned write was issued again and committed by finish: {failed}"),
        };
        assert_eq!(counters.stores_committed, 1, "{counters:?}");
        assert!(store.close(), "every queue pair was deleted: the engine may free its KV memory");
    });
}

#[test]
fn a_forced_write_that_times_out_is_write_queue_full() {
    // Goal: under `ForceOldest`, a forced store whose write times out (its completion lost)
    // fails `begin_prefill` with `WriteQueueFull`, counted in `stores_refused`, and prepares
    // nothing, as documented. Before, the wait's `Store { "wait for a write", WaitTimeout }`
    // came up as it was and nothing was counted.
    bounded(|| {
        let mut stack = stalled_stack(PolicyChoice::SlackAware);
        let first = prompt(0, 0);
        prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
        assert_eq!(stack.runtime.queued_stores(), 1, "slack-aware keeps the last layer queued");
        common::lose_completion(&stack.device, 1, NvmOpcode::Write);
        let second = prompt(1, 0);
        let refused = stack.runtime.begin_prefill(&KvRequest { tokens: &second, block_ids: &[4, 5, 6, 7] });
        assert!(matches!(refused, Err(RuntimeError::WriteQueueFull { .. })), "{refused:?}");
        let counters = stack.runtime.counters();
        assert_eq!((counters.stores_refused, counters.stores_forced, counters.prefills), (1, 0, 1), "{counters:?}");
        assert!((4..8).all(|block| stack.runtime.releasable(block)), "nothing of the refused request was prepared");
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 1);
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&first), 4);
        prefill(&mut stack, &second, &[4, 5, 6, 7]).unwrap();
        common::drain_healthy(&mut stack.runtime);
    });
}

#[test]
fn a_read_behind_a_write_whose_completion_is_lost_fails_the_prefill() {
    // Goal: under the barrier a read waits for the write in flight; when that write's completion
    // is lost, the read's wait times out and the prefill ends as documented: `ReadFailed`,
    // retrieve and store dropped, its targets free at once (nothing of the read was handed
    // over), and the next `begin_prefill` goes on without `abort_prefill`. Before, the wait came
    // up as `Store { "wait for a write", WaitTimeout }`, the prefill stayed active holding its
    // targets, and `begin_prefill` was refused `OutOfOrder` until the engine aborted it.
    bounded(|| {
        let mut config = config(PolicyChoice::SlackAware);
        config.io_timeout = IO_TIMEOUT;
        let mut stack = stack(config, None);
        let first = prompt(0, 0);
        prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
        common::drain_healthy(&mut stack.runtime);
        // The next request's first write (issued once its reads are, under the barrier) loses
        // its completion, and stays in flight past its prefill.
        common::lose_completion(&stack.device, 1, NvmOpcode::Write);
        let other = prompt(1, 0);
        prefill(&mut stack, &other, &[10, 11, 12, 13]).unwrap();
        assert_eq!(stack.runtime.queued_stores(), 1);
        let second = prompt(0, 1);
        let targets: Vec<u32> = (4..10).collect();
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &second, block_ids: &targets }).unwrap();
        assert_eq!(start.cached_blocks, 4);
        let failed = stack.runtime.before_layer(start.id, 0);
        assert!(
            matches!(&failed, Err(RuntimeError::ReadFailed { source: objstore::ObjstoreError::Gio(GioError::WaitTimeout { .. }), .. })),
            "{failed:?}"
        );
        assert_eq!(stack.runtime.queued_stores(), 1, "the failed request's store is dropped; the first one's stays queued");
        assert!((4..10).all(|block| stack.runtime.releasable(block)), "nothing of the failed read was handed over");
        assert!((12..14).all(|block| !stack.runtime.releasable(block)), "the lost write may still read them");

        // The engine recomputes the prefix: the next `begin_prefill` needs no `abort_prefill`.
        let recompute = stack.runtime.begin_prefill(&KvRequest { tokens: &second, block_ids: &targets });
        assert!(recompute.is_ok(), "{recompute:?}");
        stack.runtime.abort_prefill(recompute.unwrap().id).unwrap();
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 1, "the lost write is the one layer in flight");
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&other), 4);
    });
}

#[test]
fn a_drain_whose_write_times_out_is_drain_incomplete() {
    // Goal: `drain` whose write times out (its completion lost) goes on to its documented end:
    // it waits for the retiring requests and answers `DrainIncomplete` with what is left. Before,
    // the wait's `Store { "wait for a write", WaitTimeout }` came up at once.
    bounded(|| {
        let mut stack = stalled_stack(PolicyChoice::SlackAware);
        let first = prompt(0, 0);
        prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
        common::lose_completion(&stack.device, 1, NvmOpcode::Write);
        let drained = stack.runtime.drain();
        assert!(matches!(drained, Err(RuntimeError::DrainIncomplete { queued_stores: 1, retiring: 0 })), "{drained:?}");
        // As `RuntimeConfig::io_timeout` says: a write that timed out leaves its store queued,
        // not retiring (a read's request retires).
        assert_eq!((stack.runtime.retiring_requests(), stack.runtime.queued_stores()), (0, 1));
        assert!((0..4).all(|block| !stack.runtime.releasable(block)), "the lost write may still read them");
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 1);
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&first), 4);
    });
}

#[test]
fn a_drain_whose_write_completes_past_io_timeout_is_collected_by_the_next_drain() {
    // Goal: a write that completes after its wait in `drain` timed out (a late device, or the
    // whole test process paused past `io_timeout`, the emulated device with it: the shape that
    // failed a setup's `drain().unwrap()` under load) leaves `DrainIncomplete` with its store
    // queued, and calling `drain` again, as its docs allow, collects and commits it: what
    // `common::drain_writes` relies on for the healthy drains here. The second call is that
    // helper's, so a drain that never collected the late write would fail it.
    bounded(|| {
        let mut stack = stalled_stack(PolicyChoice::SlackAware);
        let first = prompt(0, 0);
        prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
        assert_eq!(stack.runtime.queued_stores(), 1, "slack-aware keeps the last layer queued");
        // The next write handed over (the drain's) completes two `io_timeout`s past the first
        // drain's wait: far enough that a pause of the test process between the device taking
        // it and that wait's deadline being set (about a second, see `IO_TIMEOUT`) cannot make
        // the wait see it (half an `io_timeout`, it could), and within `drain_writes`' tries
        // (the third or fourth call of `DRAIN_TRIES` collects it).
        let late = FaultRule::on_nth_io(1, FaultAction::Delay(IO_TIMEOUT * 3)).with_opcode(NvmOpcode::Write as u8);
        stack.device.set_faults(FaultPlan::none().with_rule(late));
        let drained = stack.runtime.drain();
        assert!(matches!(drained, Err(RuntimeError::DrainIncomplete { queued_stores: 1, retiring: 0 })), "{drained:?}");
        common::drain_writes(&mut stack.runtime).expect("the late write is collected and the store committed");
        assert_eq!(stack.runtime.counters().stores_committed, 1, "{:?}", stack.runtime.counters());
        assert_eq!(stack.runtime.lookup(&first), 4);
    });
}

/// Retires a read ([`retire_a_read`]: block 5 is one of its targets, not `releasable`), then
/// begins `tokens` on `block_ids`, whose `position` is block 5: the begin is refused for block 5
/// there with nothing begun (no prefill counted, no store queued, only the retiring request).
#[track_caller]
fn assert_a_retiring_reads_block_5_is_refused<E: Executor>(stack: &mut Stack<E>, tokens: &[u32], block_ids: &[u32], position: usize) {
    retire_a_read(stack);
    assert!(!stack.runtime.releasable(5));
    let before = stack.runtime.counters();
    let refused = stack.runtime.begin_prefill(&KvRequest { tokens, block_ids });
    assert!(matches!(refused, Err(RuntimeError::BlockRefused { block: 5, position: at, .. }) if at == position), "{refused:?}");
    assert_eq!(stack.runtime.counters().prefills, before.prefills, "no prefill began");
    assert_eq!((stack.runtime.retiring_requests(), stack.runtime.queued_stores()), (1, 0));
}

#[test]
fn a_retiring_reads_target_is_refused_as_a_new_target() {
    // Goal: a block a lost read may still write (its retrieve retiring: not `releasable`) is
    // refused as the next request's retrieve target with nothing begun or prepared; before,
    // `begin_prefill` took it, and the late read could land over the new request's KV.
    bounded(|| {
        let mut stack = stalled_stack(PolicyChoice::SlackAware);
        let tokens = prompt(0, 0);
        assert_a_retiring_reads_block_5_is_refused(&mut stack, &tokens, &[20, 5, 21, 22], 1);
        // Nothing was left begun: the request on free blocks goes.
        assert_eq!(prefill(&mut stack, &tokens, &[20, 21, 22, 23]).unwrap(), 4);
        assert!(stack.engine.holds(&tokens, 0..4, &[20, 21, 22, 23], common::geometry().layers));
    });
}

#[test]
fn a_retiring_reads_target_past_a_truncated_store_is_refused() {
    // Goal: a request with more new blocks than the write queue holds stores only its first
    // `write_queue_limit_blocks`, but the engine computes KV into all of them, so a block past
    // the stored ones that a lost read may still write is refused as well. Before, only the
    // stored blocks were checked, and the late read could land over the new request's KV.
    bounded(|| {
        let mut config = config(PolicyChoice::SlackAware);
        config.io_timeout = IO_TIMEOUT;
        config.write_queue_limit_blocks = 4;
        let mut stack = stack(config, None);
        let block_tokens = common::geometry().block_tokens;
        let tokens: Vec<u32> = (0..6 * block_tokens).map(|index| 9_000_000 + index).collect();
        assert_a_retiring_reads_block_5_is_refused(&mut stack, &tokens, &[20, 21, 22, 23, 24, 5], 5);
    });
}

#[test]
fn a_retiring_request_counts_against_the_queues_request_slots() {
    // Goal: at the deepest queue allowed (`write_queue_limit_stores` = `requests_max` − 1), a
    // request retiring (a read that timed out) holds an object-store request slot as a queued
    // store does, and `make_room` counts it: the oldest store is forced out and the next
    // cache-hit prefill runs. Before, `make_room` counted only the queued stores: the new
    // store took the last slot and `prepare_retrieve` failed `TooManyRequests` (the new
    // request's store dropped), for every cache-hit prefill while the request retired.
    bounded(|| {
        let store_config = objstore::StoreConfig { requests_max: 3, ..objstore::StoreConfig::default() };
        let (device, store, engine) =
            common::parts_configured(None, store_config, |pool, config| objstore::cpu_executor_for(pool, 256, config).expect("executor"));
        let mut config = config(PolicyChoice::SlackAware);
        config.io_timeout = IO_TIMEOUT;
        config.write_queue_limit_stores = 2;
        let runtime = Runtime::new(store, common::profile(), config).expect("runtime");
        let mut stack = Stack { device, runtime, engine };
        retire_a_read(&mut stack);
        // Another session's prompt (no block shared): its store queued.
        let other: Vec<u32> = prompt(1, 0).iter().map(|token| token + 7_000_000).collect();
        assert_eq!(prefill(&mut stack, &other, &[10, 11, 12, 13]).unwrap(), 0);
        assert_eq!(stack.runtime.queued_stores(), 1);
        // A cache hit with new blocks: its store and retrieve need two slots, one is left.
        let hit = prompt(0, 2);
        let blocks: Vec<u32> = (20..28).collect();
        assert_eq!(prefill(&mut stack, &hit, &blocks).unwrap(), 4);
        assert_eq!(stack.runtime.counters().stores_forced, 1, "{:?}", stack.runtime.counters());
        // The lost read (and any write of the queue handed over meanwhile).
        assert!(stack.runtime.abandon_in_flight().unwrap() >= 1);
        assert_eq!(stack.runtime.retiring_requests(), 0);
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&other), 4);
        assert_eq!(stack.runtime.lookup(&hit), 8);
        // Every issue is closed in the event log, the abandoned layers' too (issued again).
        let events = stack.runtime.events();
        let issued = events.iter().filter(|event| event.kind == tutti_runtime::IoEventKind::Issued).count();
        assert_eq!(issued, events.len() - issued, "issues and completions in the event log");
        let counters = stack.runtime.counters();
        assert_eq!(counters.mixed_issues, mixed_in_log(events), "{counters:?}");
    });
}

/// Layers issued while the other direction was in flight, from the runtime's event log (a
/// retiring read's issue has no completion until it ends).
fn mixed_in_log(events: &[tutti_runtime::IoEvent]) -> u64 {
    use tutti_runtime::{IoDirection, IoEventKind};
    let (mut reads, mut writes, mut mixed) = (0i64, 0i64, 0);
    for event in events {
        match (event.direction, event.kind) {
            (IoDirection::Read, IoEventKind::Issued) => {
                mixed += u64::from(writes > 0);
                reads += 1;
            }
            (IoDirection::Write, IoEventKind::Issued) => {
                mixed += u64::from(reads > 0);
                writes += 1;
            }
            (IoDirection::Read, IoEventKind::Completed) => reads -= 1,
            (IoDirection::Write, IoEventKind::Completed) => writes -= 1,
        }
    }
    mixed
}

#[test]
fn writes_beside_a_retiring_read_count_as_mixed() {
    // Goal: a retrieve whose read timed out retires with its layer still on the device; write
    // layers handed over meanwhile go beside that read, and `mixed_issues` counts them, as the
    // event log shows them. (They are not held back: retiring I/O is outside the barrier, so a
    // lost completion does not stall the write queue until `abandon_in_flight`.) Before, the
    // read was dropped from `reads.in_flight` when it retired and the writes went uncounted.
    bounded(|| {
        let mut config = config(PolicyChoice::SlackAware);
        config.io_timeout = IO_TIMEOUT;
        config.event_log_capacity = 4096;
        let mut stack = stack(config, None);
        let first = prompt(0, 0);
        prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.counters().mixed_issues, 0);
        common::lose_completion(&stack.device, 1, NvmOpcode::Read);
        let failed = prefill(&mut stack, &prompt(0, 1), &[4, 5, 6, 7, 8, 9]);
        assert!(matches!(failed, Err(RuntimeError::ReadFailed { .. })), "{failed:?}");
        stack.device.set_faults(FaultPlan::none());
        assert_eq!(stack.runtime.retiring_requests(), 1);
        // A miss of another session: its store is written while the read retires.
        let other = other_session(0);
        assert_eq!(prefill(&mut stack, &other, &[10, 11, 12, 13]).unwrap(), 0);
        let drained = common::drain_writes(&mut stack.runtime);
        assert!(matches!(drained, Err(RuntimeError::DrainIncomplete { queued_stores: 0, retiring: 1 })), "{drained:?}");
        let counters = stack.runtime.counters();
        let logged = mixed_in_log(stack.runtime.events());
        assert!(logged > 0, "the event log shows writes beside the retiring read");
        assert_eq!(counters.mixed_issues, logged, "{counters:?}");
        assert!(stack.runtime.abandon_in_flight().unwrap() >= 1);
        assert_eq!(stack.runtime.retiring_requests(), 0);
        assert_eq!(stack.runtime.lookup(&other), 4);
        // The read ended: the log closes it as the counter stops counting beside it, so a later
        // miss's writes are mixed in neither. Before, the log never saw it complete.
        let later: Vec<u32> = prompt(2, 0).iter().map(|token| token + 8_000_000).collect();
        assert_eq!(prefill(&mut stack, &later, &[14, 15, 16, 17]).unwrap(), 0);
        common::drain_healthy(&mut stack.runtime);
        let counters = stack.runtime.counters();
        assert_eq!(counters.mixed_issues, mixed_in_log(stack.runtime.events()), "{counters:?}");
    });
}

#[test]
fn a_fully_cached_prefill_makes_room_for_its_retrieve() {
    // Goal: a fully cached prompt (no new block, so no store) still needs a request slot for its
    // retrieve, and `begin_prefill` makes room for it as for a store: with `requests_max` 3, two
    // requests retiring and a store queued, the store is forced out under `ForceOldest` and the
    // prefill runs; under `Refuse` it is refused naming the request slots. Before, `make_room`
    // ran only for new blocks: `prepare_retrieve` failed `TooManyRequests` under either, for
    // every fully cached prefill while the requests retired.
    bounded(|| {
        let first = prompt(0, 0);
        let blocks = [30, 31, 32, 33];
        let mut stack = two_retiring(WriteQueueFullAction::ForceOldest);
        let other = other_session(0);
        assert_eq!(prefill(&mut stack, &other, &[20, 21, 22, 23]).unwrap(), 0);
        assert_eq!(stack.runtime.queued_stores(), 1);
        assert_eq!(prefill(&mut stack, &first, &blocks).unwrap(), 4, "every block cached");
        assert!(stack.engine.holds(&first, 0..4, &blocks, common::geometry().layers));
        let counters = stack.runtime.counters();
        assert_eq!((counters.stores_forced, counters.stores_refused), (1, 0), "{counters:?}");
        assert!(stack.runtime.abandon_in_flight().unwrap() >= 2);
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&other), 4);

        let mut stack = two_retiring(WriteQueueFullAction::Refuse);
        assert_eq!(prefill(&mut stack, &other, &[20, 21, 22, 23]).unwrap(), 0);
        match stack.runtime.begin_prefill(&KvRequest { tokens: &first, block_ids: &blocks }) {
            Err(error @ RuntimeError::WriteQueueFull { .. }) => {
                let message = error.to_string();
                assert!(message.contains("request slots") && message.contains("2 retiring"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(stack.runtime.queued_stores(), 1, "refused: nothing forced");
        // Counted as a refused request (`stores_refused` says so), though it had no store.
        assert_eq!(stack.runtime.counters().stores_refused, 1);
    });
}

/// A stack with `requests_max` 3 (`write_queue_limit_stores` 2, the deepest allowed) and two
/// requests retiring (reads whose completions the device lost), the queue empty.
fn two_retiring(action: WriteQueueFullAction) -> Stack {
    let store_config = objstore::StoreConfig { requests_max: 3, ..objstore::StoreConfig::default() };
    let (device, store, engine) =
        common::parts_configured(None, store_config, |pool, config| objstore::cpu_executor_for(pool, 256, config).expect("executor"));
    let mut config = config(PolicyChoice::SlackAware);
    config.io_timeout = IO_TIMEOUT;
    config.write_queue_limit_stores = 2;
    config.on_write_queue_full = action;
    let runtime = Runtime::new(store, common::profile(), config).expect("runtime");
    let mut stack = Stack { device, runtime, engine };
    prefill(&mut stack, &prompt(0, 0), &[0, 1, 2, 3]).unwrap();
    common::drain_healthy(&mut stack.runtime);
    for (turn, blocks) in [(1, [4, 5, 6, 7, 8, 9]), (2, [10, 11, 12, 13, 14, 15])] {
        common::lose_completion(&stack.device, 1, NvmOpcode::Read);
        let failed = prefill(&mut stack, &prompt(0, turn), &blocks);
        assert!(matches!(failed, Err(RuntimeError::ReadFailed { .. })), "{failed:?}");
    }
    stack.device.set_faults(FaultPlan::none());
    assert_eq!(stack.runtime.retiring_requests(), 2);
    assert_eq!(stack.runtime.queued_stores(), 0);
    stack
}

/// Another session's prompt: no block shared with `prompt(0, _)`.
fn other_session(turn: u32) -> Vec<u32> {
    prompt(1, turn).iter().map(|token| token + 7_000_000).collect()
}

#[test]
fn a_miss_needs_one_request_slot_not_two() {
    // Goal: with two of three request slots held by retiring requests, a cache miss (a store,
    // no retrieve) fits the last slot and is stored. Before, `make_room` counted a retrieve for
    // every request: the miss was refused (`WriteQueueFull`, nothing queued to force).
    bounded(|| {
        for action in [WriteQueueFullAction::ForceOldest, WriteQueueFullAction::Refuse] {
            let mut stack = two_retiring(action);
            let miss = other_session(0);
            assert_eq!(prefill(&mut stack, &miss, &[20, 21, 22, 23]).unwrap(), 0, "{action:?}");
            assert_eq!(stack.runtime.queued_stores(), 1, "{action:?}");
            let counters = stack.runtime.counters();
            assert_eq!((counters.stores_refused, counters.stores_forced), (0, 0), "{action:?}: {counters:?}");
            assert!(stack.runtime.abandon_in_flight().unwrap() >= 2);
            common::drain_healthy(&mut stack.runtime);
            assert_eq!(stack.runtime.lookup(&miss), 4, "{action:?}");
        }
    });
}

#[test]
fn a_store_the_retiring_requests_leave_no_slot_for_is_skipped_not_forced() {
    // Goal: with two of three request slots retiring, a cache hit with new blocks cannot have
    // both a store and a retrieve whatever is forced: its store is skipped (counted in
    // `stores_skipped_no_request_slot`), nothing is forced, and the retrieve runs. Before, under
    // `ForceOldest` every queued store was forced and `begin_prefill` still failed
    // `WriteQueueFull`, the retrieve with it.
    bounded(|| {
        for action in [WriteQueueFullAction::ForceOldest, WriteQueueFullAction::Refuse] {
            let mut stack = two_retiring(action);
            let hit = prompt(0, 3);
            let blocks: Vec<u32> = (20..28).collect();
            assert_eq!(prefill(&mut stack, &hit, &blocks).unwrap(), 4, "{action:?}");
            assert!(stack.engine.holds(&hit, 0..4, &blocks, common::geometry().layers), "{action:?}");
            let counters = stack.runtime.counters();
            assert_eq!(
                (counters.stores_forced, counters.stores_refused, counters.stores_skipped_no_request_slot),
                (0, 0, 1),
                "{action:?}: {counters:?}"
            );
            assert_eq!(stack.runtime.queued_stores(), 0, "{action:?}");
            assert!(stack.runtime.abandon_in_flight().unwrap() >= 2);
            common::drain_healthy(&mut stack.runtime);
            assert_eq!(stack.runtime.lookup(&hit), 4, "{action:?}: the new blocks were not stored");
        }
    });
}

#[test]
fn a_queue_full_for_request_slots_says_so() {
    // Goal: with two of three request slots retiring and the third a queued store, a cache hit
    // under `Refuse` needs that slot for its retrieve: `WriteQueueFull` names the request slots
    // and the retiring requests (before, it reported one queued store under a limit of two, no
    // cause). Under `ForceOldest` the queued store is forced out for the retrieve (forcing helps
    // there), the new store skipped, and the prefill runs.
    bounded(|| {
        let mut stack = two_retiring(WriteQueueFullAction::Refuse);
        assert_eq!(prefill(&mut stack, &other_session(0), &[20, 21, 22, 23]).unwrap(), 0);
        let blocks: Vec<u32> = (30..38).collect();
        match stack.runtime.begin_prefill(&KvRequest { tokens: &prompt(0, 3), block_ids: &blocks }) {
            Err(error @ RuntimeError::WriteQueueFull { .. }) => {
                let message = error.to_string();
                assert!(message.contains("request slots") && message.contains("2 retiring"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let mut stack = two_retiring(WriteQueueFullAction::ForceOldest);
        let other = other_session(0);
        assert_eq!(prefill(&mut stack, &other, &[20, 21, 22, 23]).unwrap(), 0);
        assert_eq!(prefill(&mut stack, &prompt(0, 3), &blocks).unwrap(), 4);
        let counters = stack.runtime.counters();
        assert_eq!((counters.stores_forced, counters.stores_refused, counters.stores_skipped_no_request_slot), (1, 0, 1), "{counters:?}");
        assert!(stack.runtime.abandon_in_flight().unwrap() >= 2);
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&other), 4);
    });
}
