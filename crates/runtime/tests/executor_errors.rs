//! The executor failing beside a device that loses completions (`common::Rigged`: a submission
//! that fails after publishing, a poll error reported once, an issue refused, a reset whose
//! reaping fails): the runtime collects what was published, hands an executor error to the I/O
//! that would not hear it, and says what `abandon_in_flight` did. Every call that could hang
//! runs under a bound.

mod common;

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bounded, is_the_executor_error, prefill, prompt, retire_a_read, rigged_stack, rigged_stack_timed, Rigged, Stack};
use gio_uring::{Executor, GioError};
use nvme_driver::spec::NvmOpcode;
use nvme_emu::{FaultAction, FaultPlan, FaultRule};
use objstore::KvRequest;
use tutti_runtime::{IoDirection, IoEventKind, PolicyChoice, PrefillId, PrefillStart, RuntimeError};

/// Stores 16 blocks of `prompt(0, 6)` and drains, then begins `prompt(0, 7)` on engine blocks
/// 16..34: 16 blocks cached, 18 asked for, past the profile table's largest prompt. Returns its
/// tokens, engine blocks and start.
fn begin_past_the_largest_prompt<E: Executor>(stack: &mut Stack<E>) -> (Vec<u32>, Vec<u32>, PrefillStart) {
    let cached: Vec<u32> = (0..16).collect();
    prefill(stack, &prompt(0, 6), &cached).unwrap();
    common::drain_healthy(&mut stack.runtime);
    let tokens = prompt(0, 7);
    let blocks: Vec<u32> = (16..34).collect();
    let start = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks }).unwrap();
    assert_eq!(start.cached_blocks, 16);
    (tokens, blocks, start)
}

/// Runs `layers` of prefill `id` as the engine does (`before_layer`, the compute of `tokens`'
/// blocks `computed` into `blocks`, `after_layer`), every call expected to succeed.
fn compute_layers<E: Executor>(
    stack: &mut Stack<E>,
    id: PrefillId,
    tokens: &[u32],
    computed: Range<u32>,
    blocks: &[u32],
    layers: Range<u32>,
) {
    for layer in layers {
        stack.runtime.before_layer(id, layer).unwrap();
        stack.engine.compute_layer(tokens, computed.clone(), blocks, layer);
        stack.runtime.after_layer(id, layer).unwrap();
    }
}

/// Ends prefill `id` and checks that the engine's `blocks` hold every layer of `tokens`' first
/// `prefix` blocks.
#[track_caller]
fn end_holding_every_byte<E: Executor>(stack: &mut Stack<E>, id: PrefillId, tokens: &[u32], prefix: u32, blocks: &[u32]) {
    stack.runtime.end_prefill(id).unwrap();
    assert!(stack.engine.holds(tokens, 0..prefix, blocks, common::geometry().layers), "every byte of the prefix arrived");
}

/// Polls until no store is queued: fails with `stuck` after 5 s, or with `poll_failed` when a
/// poll fails.
#[track_caller]
fn poll_until_no_store_is_queued<E: Executor>(stack: &mut Stack<E>, stuck: &str, poll_failed: &str) {
    let until = Instant::now() + Duration::from_secs(5);
    while stack.runtime.queued_stores() > 0 {
        assert!(Instant::now() < until, "{stuck}");
        stack.runtime.poll_io().expect(poll_failed);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The one store committed, `write_layers` write layers handed over in all, and `tokens`' 4
/// blocks found in the store.
#[track_caller]
fn assert_the_store_committed<E: Executor>(stack: &mut Stack<E>, tokens: &[u32], write_layers: u64) {
    let counters = stack.runtime.counters();
    assert_eq!((counters.stores_committed, counters.write_layers_issued), (1, write_layers), "{counters:?}");
    assert_eq!(stack.runtime.lookup(tokens), 4);
}

#[test]
fn a_write_whose_submission_failed_after_publishing_is_collected() {
    // Goal: a write layer whose submission failed after its IOCBs were published (they are in
    // flight in the object store and still complete) is tracked as in flight by the runtime:
    // the failing call says so, the next calls collect the layer, and the queue drains. Before,
    // the runtime recorded nothing, handed the same layer over again at every call and got
    // "layer N is already in flight" forever: no call succeeded, the store's blocks were never
    // released, and a read could go to the device under the write (the barrier broken).
    bounded(|| {
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        let armed = &rigging.submit_fails;
        let tokens = prompt(0, 0);
        let blocks = [0, 1, 2, 3];
        prefill(&mut stack, &tokens, &blocks).unwrap();
        assert_eq!(stack.runtime.queued_stores(), 1, "slack-aware keeps the last layer queued");
        armed.store(true, Ordering::SeqCst);
        // Decode steps until one hands a write layer over (the layer the prefill left in flight
        // completes first); that step fails.
        let mut failed = Ok(());
        for _ in 0..8 {
            failed = common::decode(&mut stack, tokens.len() as u32);
            if !armed.load(Ordering::SeqCst) {
                break;
            }
            failed.as_ref().expect("nothing failed before the submission");
        }
        assert!(matches!(failed, Err(RuntimeError::Store { operation: "store_layer", .. })), "{failed:?}");
        poll_until_no_store_is_queued(
            &mut stack,
            "the write whose submission failed was never collected",
            "the layer in flight is collected, not issued again",
        );
        common::drain_healthy(&mut stack.runtime);
        // Its IOCBs completed as the device ran them: the store is whole, each layer handed over
        // once.
        let counters = stack.runtime.counters();
        assert_eq!((counters.stores_committed, counters.stores_failed), (1, 0), "{counters:?}");
        assert_eq!(counters.write_layers_issued, u64::from(common::geometry().layers), "{counters:?}");
        assert!(blocks.iter().all(|&block| stack.runtime.releasable(block)));
        assert_eq!(stack.runtime.lookup(&tokens), 4);
    });
}

#[test]
fn a_read_whose_submission_failed_after_publishing_is_collected() {
    // Goal: the same for a read: `before_layer` fails, the layer stays the one read in flight,
    // and the engine's retry of `before_layer` waits for it and goes on; every byte arrives.
    // Before, the retry handed the same layer over again: "already in flight" at every call.
    bounded(|| {
        let layers = common::geometry().layers;
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        let armed = &rigging.submit_fails;
        prefill(&mut stack, &prompt(0, 0), &[0, 1, 2, 3]).unwrap();
        common::drain_healthy(&mut stack.runtime);
        let tokens = prompt(0, 1);
        let blocks: Vec<u32> = (4..10).collect();
        armed.store(true, Ordering::SeqCst);
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks }).unwrap();
        assert_eq!(start.cached_blocks, 4);
        let failed = stack.runtime.before_layer(start.id, 0);
        assert!(matches!(failed, Err(RuntimeError::Store { operation: "retrieve_layer", .. })), "{failed:?}");
        assert!(!armed.load(Ordering::SeqCst), "layer 0's read was handed over");
        for layer in 0..layers {
            stack.runtime.before_layer(start.id, layer).expect("the read in flight is collected, not issued again");
            stack.engine.compute_layer(&tokens, 4..6, &blocks, layer);
            stack.runtime.after_layer(start.id, layer).unwrap();
        }
        end_holding_every_byte(&mut stack, start.id, &tokens, 6, &blocks);
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&tokens), 6);
    });
}

#[test]
fn before_layer_whose_wait_failed_names_wait_layer_kv_as_the_next_call() {
    // Goal: `before_layer` whose layer was begun and whose wait then failed (a read handed over
    // during the wait whose submission failed after publishing) is refused when retried with
    // the call that goes on named: `wait_layer_kv`. Before, the refusal said "after_layer
    // first", which would itself be refused (the layer's KV never waited for).
    bounded(|| {
        let layers = common::geometry().layers;
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        // As in `after_layer_whose_issue_failed_after_publishing_is_retried`: every read is
        // issued at layer 0 and handed over one at a time, so layer 0's begin hands over the
        // first read and its wait the second, once the first completed.
        let (tokens, blocks, start) = begin_past_the_largest_prompt(&mut stack);
        rigging.submit_fails_at.store(2, Ordering::SeqCst);
        let failed = stack.runtime.before_layer(start.id, 0);
        assert!(matches!(failed, Err(RuntimeError::Store { operation: "retrieve_layer", .. })), "{failed:?}");
        assert_eq!(rigging.submit_fails_at.load(Ordering::SeqCst), 0, "the wait handed the second read over");
        match stack.runtime.before_layer(start.id, 0) {
            Err(RuntimeError::OutOfOrder { call: "before_layer", reason }) => {
                assert!(reason.contains("wait_layer_kv"), "the refusal names the next call: {reason}")
            }
            other => panic!("expected OutOfOrder, got {other:?}"),
        }
        // The call it names goes on.
        stack.runtime.wait_layer_kv(start.id, 0).expect("the read in flight is collected, not issued again");
        stack.engine.compute_layer(&tokens, 16..18, &blocks, 0);
        stack.runtime.after_layer(start.id, 0).unwrap();
        compute_layers(&mut stack, start.id, &tokens, 16..18, &blocks, 1..layers);
        end_holding_every_byte(&mut stack, start.id, &tokens, 18, &blocks);
    });
}

#[test]
fn after_layer_whose_issue_failed_after_publishing_is_retried() {
    // Goal: `after_layer` that ended its layer and then failed handing a layer over (its
    // submission failed after publishing: the layer is in flight) goes on when retried, as the
    // documentation says. Before, the retry was `OutOfOrder` (the layer had already ended),
    // and the engine could not tell a retry from a misuse.
    bounded(|| {
        let layers = common::geometry().layers;
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        let armed = &rigging.submit_fails;
        // 16 blocks cached, 18 asked for: past the table's largest prompt (256 tokens), so the
        // request falls back to issuing every read at layer 0; they are handed over one layer
        // at a time, each once the one before completed. Layer k's wait leaves layer k + 1's
        // read in flight; it completes during the layer's compute, and `after_layer` hands
        // layer k + 2's over.
        let (tokens, blocks, start) = begin_past_the_largest_prompt(&mut stack);
        let mut tripped = 0;
        for layer in 0..layers {
            stack.runtime.before_layer(start.id, layer).unwrap();
            // Long enough for the device to end the read in flight on a busy machine.
            std::thread::sleep(Duration::from_millis(20));
            stack.engine.compute_layer(&tokens, 16..18, &blocks, layer);
            armed.store(true, Ordering::SeqCst);
            let ended = stack.runtime.after_layer(start.id, layer);
            if armed.swap(false, Ordering::SeqCst) {
                ended.expect("nothing was handed over");
                continue;
            }
            assert!(matches!(ended, Err(RuntimeError::Store { .. })), "{ended:?}");
            tripped += 1;
            stack.runtime.after_layer(start.id, layer).expect("a retry of after_layer goes on");
        }
        assert!(tripped > 0, "no after_layer handed a layer over");
        end_holding_every_byte(&mut stack, start.id, &tokens, 18, &blocks);
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&tokens), 18);
    });
}

#[test]
fn end_prefill_whose_issue_failed_after_publishing_says_the_prefill_ended() {
    // Goal: `end_prefill` that ended the prefill and then failed handing a write layer over
    // (published, then the submission failed) says the prefill ended (`PrefillEnded`, with its
    // KV wait); the store stays queued, its layer is collected, and it commits. Before, the
    // error was the bare `Store { "store_layer" }`: the engine could not tell the prefill had
    // ended, its KV wait was lost, and a retry was `StaleRequest`.
    bounded(|| {
        let layers = common::geometry().layers;
        let (mut stack, rigging) = rigged_stack(PolicyChoice::NoOverlap);
        let armed = &rigging.submit_fails;
        let tokens = prompt(0, 0);
        let blocks = [0, 1, 2, 3];
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks }).unwrap();
        compute_layers(&mut stack, start.id, &tokens, 0..4, &blocks, 0..layers);
        armed.store(true, Ordering::SeqCst);
        let ended = stack.runtime.end_prefill(start.id);
        assert!(!armed.load(Ordering::SeqCst), "no-overlap hands its first write layer over at the end");
        match &ended {
            Err(RuntimeError::PrefillEnded { request, source, .. }) => {
                assert_eq!(*request, start.id.get());
                assert!(matches!(**source, RuntimeError::Store { operation: "store_layer", .. }), "{source:?}");
            }
            other => panic!("expected PrefillEnded, got {other:?}"),
        }
        assert!(matches!(stack.runtime.end_prefill(start.id), Err(RuntimeError::StaleRequest { .. })));
        assert_eq!(stack.runtime.queued_stores(), 1, "the store stays queued");
        common::drain_healthy(&mut stack.runtime);
        assert_the_store_committed(&mut stack, &tokens, u64::from(layers));
    });
}

/// Records the level and message of every event logged on this thread while it is the default.
#[derive(Clone, Default)]
struct LogCapture {
    events: Arc<std::sync::Mutex<Vec<(tracing::Level, String)>>>,
}

impl tracing::Subscriber for LogCapture {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!("{}={value:?} ", field.name()));
            }
        }
        let mut text = Text(String::new());
        event.record(&mut text);
        self.events.lock().expect("log capture").push((*event.metadata().level(), text.0));
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn an_executor_error_met_polling_a_retiring_request_is_logged_as_a_warning() {
    // Goal: an executor-level error that a retiring request's poll meets (`ObjstoreError::Gio`,
    // not the layer's own failure: gio-uring reports a stopped worker or a lasting doorbell
    // fault once, to whichever wait polls first) is logged at warn, not lost at debug. A read
    // whose completion the device lost retires; the executor's next poll fails once, met by
    // `retire_ended` polling that request.
    bounded(|| {
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        let armed = &rigging.poll_fails;
        retire_a_read(&mut stack);
        let capture = LogCapture::default();
        armed.store(true, Ordering::SeqCst);
        tracing::subscriber::with_default(capture.clone(), || stack.runtime.poll_io().expect("poll"));
        assert!(!armed.load(Ordering::SeqCst), "the retiring request's poll met the error");
        let events = capture.events.lock().expect("log capture").clone();
        assert!(
            events.iter().any(|(level, text)| *level == tracing::Level::WARN && text.contains("worker 3")),
            "the executor error is a warning: {events:?}"
        );
        assert!(stack.runtime.abandon_in_flight().unwrap() >= 1);
        assert_eq!(stack.runtime.retiring_requests(), 0);
    });
}

#[test]
fn an_executor_error_met_polling_a_retiring_request_fails_the_read_in_flight() {
    // Goal: an executor error (gio-uring reports it once, to whichever wait polls first) that a
    // retiring request's poll meets while a read is in flight fails that read with the
    // executor's error, at once. Before, `retire_ended` (which polls first) only logged it: the
    // read's own waits never saw it, and `wait_layer_kv` waited a whole `io_timeout` to fail as
    // `WaitTimeout`, which steers the engine to `abandon_in_flight` rather than to the executor.
    // Here the read's completion is lost, as a stopped worker's would be. `io_timeout` is long
    // beside the call's own work so that the bound below tells the two apart.
    bounded(|| {
        let io_timeout = Duration::from_secs(8);
        let (mut stack, rigging) = rigged_stack_timed(PolicyChoice::SlackAware, io_timeout);
        retire_a_read(&mut stack);
        common::lose_completion(&stack.device, 1, NvmOpcode::Read);
        let first = prompt(0, 0);
        let targets: Vec<u32> = (10..14).collect();
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &first, block_ids: &targets }).unwrap();
        assert_eq!((start.cached_blocks, start.queued_blocks), (4, 0), "fully cached: a retrieve only");
        stack.runtime.begin_layer(start.id, 0).expect("layer 0's read is handed over");
        rigging.poll_fails.store(true, Ordering::SeqCst);
        let started = Instant::now();
        let failed = stack.runtime.wait_layer_kv(start.id, 0);
        let waited = started.elapsed();
        assert!(!rigging.poll_fails.load(Ordering::SeqCst), "the executor's error was met");
        assert!(
            matches!(
                &failed,
                Err(RuntimeError::ReadFailed { layer: 0, source: objstore::ObjstoreError::Gio(GioError::WorkerStopped { worker: 3 }) })
            ),
            "the read in flight fails with the executor's error: {failed:?}"
        );
        assert!(waited < io_timeout / 2, "the read failed at once, not after a wait: {waited:?}");
        // Its lost read retires the prefill's retrieve beside the first one.
        assert_eq!(stack.runtime.retiring_requests(), 2);
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 2);
        assert_eq!(stack.runtime.retiring_requests(), 0);
        assert!((0..14).all(|block| stack.runtime.releasable(block)));
    });
}

/// Retires a read ([`retire_a_read`]), then stores a prompt of its own (engine blocks 20..24)
/// whose first write the device loses: it stays in flight, its store queued. Returns the prompt.
fn a_write_in_flight_beside_a_retiring_read<E: Executor>(stack: &mut Stack<E>) -> Vec<u32> {
    let layers = common::geometry().layers;
    retire_a_read(stack);
    common::lose_completion(&stack.device, 1, NvmOpcode::Write);
    // Shares no block with the prompts before it: a store and no retrieve.
    let fresh: Vec<u32> = (0..4 * common::BLOCK_TOKENS).map(|index| 7_000_000 + index).collect();
    let targets: Vec<u32> = (20..24).collect();
    let issued = stack.runtime.counters().write_layers_issued;
    let start = stack.runtime.begin_prefill(&KvRequest { tokens: &fresh, block_ids: &targets }).unwrap();
    assert_eq!((start.cached_blocks, start.queued_blocks), (0, 4));
    compute_layers(stack, start.id, &fresh, 0..4, &targets, 0..layers);
    stack.runtime.end_prefill(start.id).unwrap();
    assert_eq!(stack.runtime.counters().write_layers_issued - issued, 1, "the lost write holds the others back");
    fresh
}

#[test]
fn an_executor_error_met_polling_a_retiring_request_is_returned_beside_a_write_in_flight() {
    // Goal: with no read in flight, an executor error a retiring request's poll meets while a
    // write is in flight comes back from the call (`Store`, "poll the executor"), the store
    // still queued: the write's own polls would never see it. Before, it was only logged.
    bounded(|| {
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        let fresh = a_write_in_flight_beside_a_retiring_read(&mut stack);
        rigging.poll_fails.store(true, Ordering::SeqCst);
        let failed = stack.runtime.poll_io();
        assert!(!rigging.poll_fails.load(Ordering::SeqCst), "the executor's error was met");
        assert!(is_the_executor_error(&failed), "the executor's error is returned: {failed:?}");
        assert_eq!((stack.runtime.queued_stores(), stack.runtime.retiring_requests()), (1, 1));
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 2, "the lost read and the lost write");
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&fresh), 4, "the store committed once its write was issued again");
    });
}

#[test]
fn begin_prefill_refuses_for_an_executor_error_and_begins_on_retry() {
    // Goal: `begin_prefill`, reaping first, returns an executor error it meets there (the
    // request's own I/O would go to the same executor) with nothing prepared, and a retry
    // begins the request: the error is reported once. (Another request's store failure met
    // there is logged instead: not this request's.)
    bounded(|| {
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        a_write_in_flight_beside_a_retiring_read(&mut stack);
        let before = stack.runtime.counters();
        let tokens = prompt(1, 0);
        let blocks: Vec<u32> = (30..34).collect();
        rigging.poll_fails.store(true, Ordering::SeqCst);
        let refused = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks });
        assert!(is_the_executor_error(&refused), "the executor's error is returned: {refused:?}");
        assert_eq!(stack.runtime.counters().prefills, before.prefills, "no prefill began");
        assert_eq!((stack.runtime.queued_stores(), stack.runtime.retiring_requests()), (1, 1), "nothing was prepared");
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks }).expect("the retry begins");
        stack.runtime.abort_prefill(start.id).expect("nothing of it in flight");
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 2, "the lost read and the lost write");
        common::drain_healthy(&mut stack.runtime);
    });
}

#[test]
fn a_retrieve_reaped_before_abandon_in_flight_failed_is_read_again() {
    // Goal: when `abandon_in_flight` fails after the reset, partway through reaping (a later
    // request's TIMEOUT CQE not posted, the poll failing), the running prefill's read it did
    // reap (its layer ended as TIMEOUT, not done) is issued again: `before_layer` does not
    // return until it was, and completed (layer 1's read here, handed over by `after_layer(0)`).
    // Before, the runtime returned at once with the read still in flight; the next poll found
    // nothing of it in the object store and marked it done, and `before_layer` returned on
    // blocks the device may never have filled. (Checked by the event log's issues: here the
    // emulated device may well have moved the bytes before the reset.) A read whose completion
    // the device lost leaves a retrieve retiring in request slot 1; a fully cached request's
    // retrieve then takes slot 0, so the reset's reaping reaches it first.
    bounded(|| {
        let layers = common::geometry().layers;
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        let held = &rigging.held;
        let first = prompt(0, 0);
        retire_a_read(&mut stack);
        held.lock().expect("held").mark();

        let logged = stack.runtime.events().len();
        let targets: Vec<u32> = (10..14).collect();
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &first, block_ids: &targets }).unwrap();
        assert_eq!((start.cached_blocks, start.queued_blocks), (4, 0), "fully cached: no store");
        let request = start.id.get();
        let read_issues = |stack: &Stack<Rigged>, layer: u32| {
            stack.runtime.events()[logged..]
                .iter()
                .filter(|e| e.request == request && e.direction == IoDirection::Read && e.layer == layer && e.kind == IoEventKind::Issued)
                .count()
        };
        // Layer 0's read completes in `before_layer`; `after_layer` hands layer 1's over.
        stack.runtime.before_layer(start.id, 0).expect("layer 0");
        stack.runtime.after_layer(start.id, 0).expect("layer 0");
        assert_eq!(read_issues(&stack, 1), 1, "layer 1's read is in flight: {:?}", &stack.runtime.events()[logged..]);
        let abandoned = stack.runtime.abandon_in_flight();
        assert!(abandoned.is_err(), "the retiring retrieve's reap fails: {abandoned:?}");

        stack.runtime.before_layer(start.id, 1).expect("layer 1");
        assert_eq!(
            read_issues(&stack, 1),
            2,
            "layer 1's read, ended by the reset, was issued again: {:?}",
            &stack.runtime.events()[logged..]
        );
        stack.runtime.after_layer(start.id, 1).expect("layer 1");
        for layer in 2..layers {
            stack.runtime.before_layer(start.id, layer).expect("layer");
            stack.runtime.after_layer(start.id, layer).expect("layer");
        }
        stack.runtime.end_prefill(start.id).expect("end");
        assert!(stack.engine.holds(&first, 0..4, &targets, layers), "every layer was read");
        assert!(held.lock().expect("held").cqes.is_empty(), "a poll after the failed one posted the held CQE");
        assert_eq!(stack.runtime.retiring_requests(), 0, "the retiring retrieve ended once its CQE was posted");
    });
}

#[test]
fn a_store_write_reaped_before_abandon_in_flight_failed_is_written_again() {
    // Goal: when `abandon_in_flight` fails after the reset, partway through reaping, a store's
    // write it did reap (its layer ended as TIMEOUT, unwritten) is issued again, and the store
    // commits once it completed. Without the requeue (the runtime keeping the layer in flight,
    // the object store not), the store was never committed: the same prompt found nothing
    // cached. Until now only the read side of this path was tested. A read whose completion the device
    // lost leaves a retrieve retiring in request slot 1; an uncached prompt's store then takes
    // slot 0, so the reset's reaping reaches its write first.
    bounded(|| {
        let layers = common::geometry().layers;
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        let held = &rigging.held;
        retire_a_read(&mut stack);
        held.lock().expect("held").mark();

        let logged = stack.runtime.events().len();
        // Shares no block with the prompts before it: a store and no retrieve.
        let fresh: Vec<u32> = (0..4 * common::BLOCK_TOKENS).map(|index| 7_000_000 + index).collect();
        let targets: Vec<u32> = (20..24).collect();
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &fresh, block_ids: &targets }).unwrap();
        assert_eq!((start.cached_blocks, start.queued_blocks), (0, 4), "uncached: a store of every block");
        let request = start.id.get();
        let writes = |stack: &Stack<Rigged>, layer: u32, kind: IoEventKind| {
            stack.runtime.events()[logged..]
                .iter()
                .filter(|e| e.request == request && e.direction == IoDirection::Write && e.layer == layer && e.kind == kind)
                .count()
        };
        for layer in 0..layers {
            stack.runtime.before_layer(start.id, layer).expect("layer");
            stack.engine.compute_layer(&fresh, 0..4, &targets, layer);
            stack.runtime.after_layer(start.id, layer).expect("layer");
        }
        stack.runtime.end_prefill(start.id).expect("end");
        // The store's writes go out after the prefill; one of them is in flight now.
        let in_flight: Vec<u32> = (0..layers)
            .filter(|&layer| writes(&stack, layer, IoEventKind::Issued) > writes(&stack, layer, IoEventKind::Completed))
            .collect();
        assert_eq!(in_flight.len(), 1, "one write of the store is in flight: {:?}", &stack.runtime.events()[logged..]);
        let abandoned = stack.runtime.abandon_in_flight();
        assert!(abandoned.is_err(), "the retiring retrieve's reap fails: {abandoned:?}");

        common::drain_healthy(&mut stack.runtime);
        let issued_twice = writes(&stack, in_flight[0], IoEventKind::Issued);
        // What was committed is what the engine computed: read back into other blocks.
        let again: Vec<u32> = (30..34).collect();
        let cached = prefill(&mut stack, &fresh, &again).expect("the stored prompt, retrieved");
        assert_eq!(cached, 4, "every block of the store was committed");
        assert!(stack.engine.holds(&fresh, 0..4, &again, layers), "every layer was written and read back");
        assert_eq!(issued_twice, 2, "layer {}'s write, ended by the reset, was issued again", in_flight[0]);
        assert!(held.lock().expect("held").cqes.is_empty(), "a poll after the failed one posted the held CQE");
        assert_eq!(stack.runtime.retiring_requests(), 0, "the retiring retrieve ended once its CQE was posted");
    });
}

#[test]
fn a_decode_step_whose_first_handover_failed_still_applies_its_grant() {
    // Goal: a decode step whose first progress (before it plans) fails handing a write layer
    // over still plans and applies the step's grant, as docs/scheduler.md tells the engine
    // ("poll_io goes on": it does not call decode_step again for that step). Before, the
    // failure returned before planning: the step's slack was never granted, and with the last
    // layer undecided, poll_io alone never finished the store.
    bounded(|| {
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        let tokens = prompt(0, 0);
        // Layer 1's first write (one command per block) completes late: it is still in flight
        // when the prefill ends, whatever the timing.
        let late = FaultRule::on_nth_io(5, FaultAction::Delay(Duration::from_millis(100))).with_opcode(NvmOpcode::Write as u8);
        stack.device.set_faults(FaultPlan::none().with_rule(late));
        prefill(&mut stack, &tokens, &[0, 1, 2, 3]).unwrap();
        // Slack-aware left layer 1 in flight (or layer 0, on a loaded machine), layer 2 decided
        // and the last layer undecided (for the decode steps' slack).
        let issued = stack.runtime.counters().write_layers_issued;
        assert!((1..=2).contains(&issued), "{issued} write layers issued by the prefill's end");
        // The layer in flight ends on the device (every write issued fetched, every command
        // fetched completed), so that the step's first progress, before it plans, collects it
        // and hands the next over, whose submission fails after publishing. (Were the layer
        // still in flight, the handover would come after planning, and the step would apply
        // its grant however its first progress went.)
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let device = stack.device.stats();
            let fetched = device.admin_commands.values().sum::<u64>() + device.io_commands.values().sum::<u64>();
            if device.io(NvmOpcode::Write) >= issued * 4 && device.completions_posted >= fetched {
                break;
            }
            assert!(Instant::now() < until, "the layer in flight did not end on the device: {device:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
        rigging.submit_fails_at.store(1, Ordering::SeqCst);
        let failed = stack.runtime.decode_step(tokens.len() as u32);
        assert!(matches!(failed, Err(RuntimeError::Store { operation: "store_layer", .. })), "{failed:?}");
        assert_eq!(rigging.submit_fails_at.load(Ordering::SeqCst), 0, "the step handed a layer over");
        poll_until_no_store_is_queued(&mut stack, "the step's grant was not applied: poll_io never wrote the last layer", "poll_io");
        assert_the_store_committed(&mut stack, &tokens, 4);
    });
}

#[test]
fn abandon_in_flight_whose_reissue_is_refused_says_what_it_abandoned() {
    // Goal: `abandon_in_flight` whose reset succeeded says so (`Ok`, the layers abandoned) even
    // when handing the abandoned read over again is then refused (an issue refused before
    // anything was published): the read waits, and the next `before_layer` hands it over and
    // waits for it. Before, the refusal came back as the call's error, which its doc reserves
    // for a queue pair that could not be deleted ("nothing is released: the controller must be
    // reset first"), although every layer had been abandoned and the read requeued.
    bounded(|| {
        let layers = common::geometry().layers;
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        prefill(&mut stack, &prompt(0, 0), &[0, 1, 2, 3]).unwrap();
        common::drain_healthy(&mut stack.runtime);
        // One command per block: layer 1's first read is the 5th of a 4-block retrieve.
        common::lose_completion(&stack.device, 5, NvmOpcode::Read);
        let logged = stack.runtime.events().len();
        let tokens = prompt(0, 1);
        let blocks: Vec<u32> = (4..10).collect();
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks }).unwrap();
        assert_eq!(start.cached_blocks, 4);
        let request = start.id.get();
        let read_issues = |stack: &Stack<Rigged>, layer: u32| {
            stack.runtime.events()[logged..]
                .iter()
                .filter(|e| e.request == request && e.direction == IoDirection::Read && e.layer == layer && e.kind == IoEventKind::Issued)
                .count()
        };
        // Layer 0's read completes in `before_layer`; `after_layer` hands layer 1's over, whose
        // completion the device loses.
        compute_layers(&mut stack, start.id, &tokens, 4..6, &blocks, 0..1);
        assert_eq!(read_issues(&stack, 1), 1, "layer 1's read is in flight: {:?}", &stack.runtime.events()[logged..]);

        rigging.issue_refused.store(true, Ordering::SeqCst);
        let abandoned = stack.runtime.abandon_in_flight();
        assert!(matches!(abandoned, Ok(1)), "the lost read was abandoned; only its reissue was refused: {abandoned:?}");
        assert!(!rigging.issue_refused.load(Ordering::SeqCst), "the abandoned read was handed over again, and refused");
        assert_eq!(read_issues(&stack, 1), 1, "the refused issue is not logged as issued");

        compute_layers(&mut stack, start.id, &tokens, 4..6, &blocks, 1..layers);
        assert_eq!(read_issues(&stack, 1), 2, "layer 1's read was issued again: {:?}", &stack.runtime.events()[logged..]);
        end_holding_every_byte(&mut stack, start.id, &tokens, 6, &blocks);
        common::drain_healthy(&mut stack.runtime);
        assert_eq!(stack.runtime.lookup(&tokens), 6);
    });
}

#[test]
fn an_executor_error_met_reissuing_after_abandon_in_flight_fails_the_read_again_handed_over() {
    // Goal: `abandon_in_flight` whose reissue meets an executor error (the poll that starts the
    // read handed over again: the first since the reset, which forgot the errors kept before it,
    // so gio-uring reports this one once, there) still returns the layers abandoned, and the
    // error reaches that read: the next `before_layer` fails it with the executor's error at
    // once. Before, the error was only logged, and the read, hung on the stopped executor,
    // waited a whole `io_timeout` to fail as `WaitTimeout`. `io_timeout` is long beside the
    // call's own work so that the bound below tells the two apart.
    bounded(|| {
        let io_timeout = Duration::from_secs(8);
        let (mut stack, rigging) = rigged_stack_timed(PolicyChoice::SlackAware, io_timeout);
        prefill(&mut stack, &prompt(0, 0), &[0, 1, 2, 3]).unwrap();
        common::drain_healthy(&mut stack.runtime);
        // One command per block: layer 1's first read is the 5th of a 4-block retrieve.
        common::lose_completion(&stack.device, 5, NvmOpcode::Read);
        let tokens = prompt(0, 1);
        let blocks: Vec<u32> = (4..10).collect();
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks }).unwrap();
        assert_eq!(start.cached_blocks, 4);
        compute_layers(&mut stack, start.id, &tokens, 4..6, &blocks, 0..1);
        // The read handed over again hangs too, as on a stopped executor.
        common::lose_completion(&stack.device, 1, NvmOpcode::Read);
        rigging.poll_fails.store(true, Ordering::SeqCst);
        let abandoned = stack.runtime.abandon_in_flight();
        assert!(matches!(abandoned, Ok(1)), "the lost read was abandoned: {abandoned:?}");
        assert!(!rigging.poll_fails.load(Ordering::SeqCst), "the reissue's poll met the executor's error");
        let started = Instant::now();
        let failed = stack.runtime.before_layer(start.id, 1);
        let waited = started.elapsed();
        assert!(
            matches!(
                &failed,
                Err(RuntimeError::ReadFailed { layer: 1, source: objstore::ObjstoreError::Gio(GioError::WorkerStopped { worker: 3 }) })
            ),
            "the read handed over again fails with the executor's error: {failed:?}"
        );
        assert!(waited < io_timeout / 2, "the read failed at once, not after a wait: {waited:?}");
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 1, "the hung read, retiring");
        assert_eq!(stack.runtime.retiring_requests(), 0);
        assert!((4..10).all(|block| stack.runtime.releasable(block)));
    });
}

#[test]
fn an_executor_error_met_while_a_read_waits_behind_a_write_fails_the_prefill() {
    // Goal: an executor error a retiring request's poll meets while the running prefill's read
    // waits behind a write in flight (under the barrier; a decode step's, say) fails that read
    // as a write's timed-out wait does (`ReadFailed`, the prefill ended, its targets free), and
    // the next `begin_prefill` needs no `abort_prefill`. Before, it came back as `Store`
    // ("poll the executor") with the prefill still running, holding its targets: `begin_prefill`
    // refused `OutOfOrder` until the engine aborted it, and a retry's read waited a whole
    // `io_timeout` on the failed executor.
    bounded(|| {
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        a_write_in_flight_beside_a_retiring_read(&mut stack);
        let first = prompt(0, 0);
        let targets: Vec<u32> = (10..14).collect();
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &first, block_ids: &targets }).unwrap();
        assert_eq!((start.cached_blocks, start.queued_blocks), (4, 0), "fully cached: a retrieve only");
        rigging.poll_fails.store(true, Ordering::SeqCst);
        let failed = stack.runtime.before_layer(start.id, 0);
        assert!(!rigging.poll_fails.load(Ordering::SeqCst), "the executor's error was met");
        assert!(
            matches!(
                &failed,
                Err(RuntimeError::ReadFailed { layer: 0, source: objstore::ObjstoreError::Gio(GioError::WorkerStopped { worker: 3 }) })
            ),
            "the read waiting behind the write fails with the executor's error: {failed:?}"
        );
        assert!((10..14).all(|block| stack.runtime.releasable(block)), "nothing of the read was handed over");
        let again = stack.runtime.begin_prefill(&KvRequest { tokens: &first, block_ids: &targets });
        let again = again.expect("the prefill ended: the next one begins without abort_prefill");
        stack.runtime.abort_prefill(again.id).expect("nothing of it in flight");
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 2, "the lost read and the lost write");
        common::drain_healthy(&mut stack.runtime);
    });
}

#[test]
fn begin_prefill_refuses_for_an_executor_error_met_with_nothing_in_flight() {
    // Goal: an executor error `begin_prefill` meets reaping (a retiring request's poll) is
    // returned as its doc says, with nothing prepared, though no write is in flight: the
    // request's own I/O would go to the same executor, and no other I/O is left to hear it.
    // Before, only an error met beside a write in flight was; with the queue empty it was
    // logged and the prefill began, its reads handed to the failed executor.
    bounded(|| {
        let (mut stack, rigging) = rigged_stack(PolicyChoice::SlackAware);
        retire_a_read(&mut stack);
        assert_eq!(stack.runtime.queued_stores(), 0);
        let before = stack.runtime.counters();
        let tokens = prompt(0, 0);
        let blocks: Vec<u32> = (30..34).collect();
        rigging.poll_fails.store(true, Ordering::SeqCst);
        let refused = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks });
        assert!(!rigging.poll_fails.load(Ordering::SeqCst), "the executor's error was met");
        assert!(is_the_executor_error(&refused), "the executor's error is returned: {refused:?}");
        assert_eq!(stack.runtime.counters().prefills, before.prefills, "no prefill began");
        assert_eq!((stack.runtime.queued_stores(), stack.runtime.retiring_requests()), (0, 1), "nothing was prepared");
        let start = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks }).expect("the retry begins");
        stack.runtime.abort_prefill(start.id).expect("nothing of it in flight");
        assert_eq!(stack.runtime.abandon_in_flight().unwrap(), 1, "the lost read");
        common::drain_healthy(&mut stack.runtime);
    });
}
