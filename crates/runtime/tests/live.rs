//! The runtime over the software controller: the read/write barrier, writes deferred across
//! requests and into decode steps, visibility only after commit, and the releasable-block
//! contract. Every retrieved byte is checked.

mod common;

use common::{config, prefill, prompt, stack, Stack, BLOCK_TOKENS, ENGINE_BLOCKS};
use nvme_driver::spec::NvmOpcode;
use nvme_emu::{FaultAction, FaultPlan, FaultRule};
use scheduler::table::{IoCostEntry, IoKind};
use tutti_runtime::{IoDirection, IoEvent, IoEventKind, PolicyChoice, WriteQueueFullAction};

/// Layers issued while the other direction was in flight, from the runtime's event log.
fn mixed_issues(events: &[IoEvent]) -> usize {
    let (mut reads, mut writes, mut mixed) = (0i64, 0i64, 0);
    for event in events {
        match (event.direction, event.kind) {
            (IoDirection::Read, IoEventKind::Issued) => {
                mixed += usize::from(writes > 0);
                reads += 1;
            }
            (IoDirection::Write, IoEventKind::Issued) => {
                mixed += usize::from(reads > 0);
                writes += 1;
            }
            (IoDirection::Read, IoEventKind::Completed) => reads -= 1,
            (IoDirection::Write, IoEventKind::Completed) => writes -= 1,
        }
    }
    mixed
}

/// Engine blocks free for a new request: not used by it and releasable by the runtime.
fn take_blocks(stack: &mut Stack, count: usize) -> Vec<u32> {
    for _ in 0..64 {
        let free: Vec<u32> = (0..ENGINE_BLOCKS).filter(|&block| stack.runtime.releasable(block)).take(count).collect();
        if free.len() == count {
            return free;
        }
        common::decode(stack, 1024).expect("decode step");
    }
    panic!("no {count} releasable engine blocks after 64 decode steps");
}

/// A multi-turn stream of 3 sessions x 3 turns with 2 decode steps between requests; checks the
/// bytes of every cached block. Returns how many blocks came from the cache.
fn serve(stack: &mut Stack) -> usize {
    let mut cached = 0;
    for turn in 0..3 {
        for session in 0..3 {
            let tokens = prompt(session, turn);
            let engine_blocks = take_blocks(stack, tokens.len() / BLOCK_TOKENS as usize);
            let hit = prefill(stack, &tokens, &engine_blocks).expect("prefill");
            assert!(
                stack.engine.holds(&tokens, 0..hit as u32, &engine_blocks, common::geometry().layers),
                "session {session} turn {turn}: a cached block came back wrong"
            );
            cached += hit;
            for step in 0..2 {
                common::decode(stack, tokens.len() as u32 + step).expect("decode step");
            }
        }
    }
    stack.runtime.drain().expect("drain");
    cached
}

/// Goal: under the slack-aware and no-overlap policies no write is handed to the executor while a
/// read is in flight (nor a read while a write is), and the SSD model saw no mixed traffic; the
/// naive baseline does mix (so the check can see a mix when there is one).
#[test]
fn barrier_keeps_reads_and_writes_apart() {
    for policy in PolicyChoice::ALL {
        let mut stack = stack(config(policy), Some(common::slow_ssd()));
        let cached = serve(&mut stack);
        assert!(cached > 0, "{policy:?}: the stream must hit the cache");
        assert_eq!(stack.runtime.events_dropped(), 0);
        let mixed = mixed_issues(stack.runtime.events());
        let counters = stack.runtime.counters();
        let mixed_busy = stack.device.stats().timing.expect("timing model on").mixed_busy;
        assert_eq!(counters.mixed_issues as usize, mixed, "{policy:?}: counter and event log disagree");
        if policy != PolicyChoice::Naive {
            assert_eq!(mixed, 0, "{policy:?}: a layer was issued while the other direction was in flight");
            assert!(mixed_busy.is_zero(), "{policy:?}: the device saw reads and writes together for {mixed_busy:?}");
        } else {
            assert!(mixed > 0, "naive: expected mixed issues on a slow device");
        }
        assert!(counters.stores_committed > 0 && counters.stores_failed == 0, "{policy:?}: {counters:?}");
    }
}

/// Decode steps until `tokens`' blocks are visible; on the way, checks that they are never visible
/// (nor their engine blocks releasable) before the store committed. Bounded.
fn decode_until_visible(stack: &mut Stack, tokens: &[u32], engine_blocks: &[u32]) {
    let blocks = engine_blocks.len();
    for step in 0..200 {
        let committed = stack.runtime.counters().blocks_committed;
        let visible = stack.runtime.lookup(tokens);
        if visible == blocks {
            assert!(engine_blocks.iter().all(|&block| stack.runtime.releasable(block)), "visible but still held");
            return;
        }
        assert!(
            engine_blocks.iter().all(|&block| !stack.runtime.releasable(block)),
            "releasable before its data reached the device (committed {committed}, visible {visible})"
        );
        common::decode(stack, 64 + step).unwrap();
    }
    panic!("not visible after 200 decode steps: {:?}", stack.runtime);
}

/// Goal: slack-aware keeps the last layer's write out of the request (it goes into the next
/// request's slack or decode steps: a deferred write); blocks become visible to lookup, and their
/// engine blocks releasable, only once committed; a later turn reads the right bytes.
#[test]
fn writes_are_deferred_across_requests_and_visible_only_when_committed() {
    let layers = common::geometry().layers;
    let mut stack = stack(config(PolicyChoice::SlackAware), Some(common::slow_ssd()));
    let first = prompt(0, 0);
    let first_blocks: Vec<u32> = (0..4).collect();
    assert_eq!(prefill(&mut stack, &first, &first_blocks).unwrap(), 0);
    // The last layer became writable at the end of prefill; slack-aware leaves it queued.
    assert_eq!(stack.runtime.queued_stores(), 1);
    assert_eq!(stack.runtime.lookup(&first), 0, "visible before all its layers are durable");
    assert!(first_blocks.iter().all(|&block| !stack.runtime.releasable(block)), "releasable before the data reached the device");

    // The next request's prefill (another session: nothing cached) takes the deferred layer.
    let second = prompt(1, 0);
    let second_blocks: Vec<u32> = (4..8).collect();
    prefill(&mut stack, &second, &second_blocks).unwrap();
    decode_until_visible(&mut stack, &first, &first_blocks);
    decode_until_visible(&mut stack, &second, &second_blocks);
    let counters = stack.runtime.counters();
    assert!(counters.write_layers_deferred >= 2, "both last layers are deferred writes: {counters:?}");
    assert_eq!(counters.mixed_issues, 0);

    // The engine reuses the first request's blocks; the next turn of session 0 reads them back.
    for &block in &first_blocks {
        stack.engine.scribble(block, layers);
    }
    let next = prompt(0, 1);
    let next_blocks: Vec<u32> = (8..14).collect();
    assert_eq!(prefill(&mut stack, &next, &next_blocks).unwrap(), 4);
    assert!(stack.engine.holds(&next, 0..4, &next_blocks, layers));
    stack.runtime.drain().unwrap();
    assert_eq!(stack.runtime.lookup(&next), 6);
}

/// Goal: a layer larger than any one decode step's write grant is still written once the
/// policy's grants add up to it, instead of waiting for the queue limit to force it onto a
/// prefill's critical path. The table leaves no slack in prefill and 100 µs decode steps: two
/// write IOCBs of 40 µs per step, where a layer of this 4-block store needs four.
#[test]
fn small_write_grants_add_up_to_a_whole_layer() {
    let mut table = common::table(common::MODEL, common::geometry().layers);
    for bucket in &mut table.buckets {
        for layer in &mut bucket.layers {
            layer.slack_windows.clear();
        }
    }
    for step in &mut table.decode_steps {
        step.duration_us = 100.0;
    }
    let profile = scheduler::table::Profile::from_table(table).expect("valid table");
    let mut stack = common::stack_with_profile(config(PolicyChoice::SlackAware), None, profile);
    let tokens = prompt(0, 0);
    let engine_blocks: Vec<u32> = (0..4).collect();
    prefill(&mut stack, &tokens, &engine_blocks).unwrap();
    assert_eq!(stack.runtime.queued_stores(), 1);
    decode_until_visible(&mut stack, &tokens, &engine_blocks);
    let counters = stack.runtime.counters();
    assert_eq!(counters.stores_forced, 0, "{counters:?}");
    assert_eq!(counters.stores_committed, 1, "{counters:?}");
}

/// Goal: a write layer longer than every window (prefill windows and decode steps alike) still
/// goes once the windows' time adds up to it, so that `Refuse` never refuses forever. The table
/// has one write row: 1 IOCB on 4 SMs takes 10 ms; decode steps are 4.4 ms with 8 SMs free (as
/// `tutti-profile io` measured 8 MiB writes of 16-59 ms against ~4.4 ms steps). Before, not one
/// IOCB fitted any window, so no write grant was made, the carry never built up, and every
/// later `begin_prefill` failed with `WriteQueueFull`.
#[test]
fn a_write_longer_than_every_window_still_goes() {
    let mut table = common::table(common::MODEL, common::geometry().layers);
    table.io_costs.retain(|row| row.kind == IoKind::Read);
    table.io_costs.push(IoCostEntry { kind: IoKind::Write, iocb_count: 1, sm_budget: 4, duration_us: 10_000.0, bytes: common::IOCB_BYTES });
    for step in &mut table.decode_steps {
        (step.duration_us, step.free_sms) = (4400.0, 8);
    }
    let profile = scheduler::table::Profile::from_table(table).expect("valid table");
    let mut config = config(PolicyChoice::SlackAware);
    config.on_write_queue_full = WriteQueueFullAction::Refuse;
    config.write_queue_limit_stores = 1;
    let mut stack = common::stack_with_profile(config, None, profile);
    let first = prompt(0, 0);
    prefill(&mut stack, &first, &[0, 1, 2, 3]).expect("first prefill");
    for _ in 0..1000 {
        if stack.runtime.queued_stores() == 0 {
            break;
        }
        stack.runtime.decode_step(first.len() as u32).expect("decode step");
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
    let second = prompt(1, 0);
    let start = stack.runtime.begin_prefill(&objstore::KvRequest { tokens: &second, block_ids: &[4, 5, 6, 7] });
    assert!(start.is_ok(), "{start:?}: {:?}", stack.runtime);
    let counters = stack.runtime.counters();
    assert_eq!((counters.stores_committed, counters.stores_forced, counters.stores_refused), (1, 0, 0), "{counters:?}");
    assert_eq!(stack.runtime.lookup(&first), 4, "the first store is committed");
}

/// Goal: decode steps a write layer in flight takes whole are banked for the next layer, which
/// goes at the first step after the one in flight ends. Writes of 5 ms per IOCB (a 4-IOCB layer:
/// 20 ms), steps of 4.4 ms, no prefill window (the carry starts at 0); the emulated SSD takes
/// ~3 s over a layer (`banking_stack`), so the steps called meanwhile all see it in flight,
/// on a loaded machine too (at ~0.3 s, nine steps did not always finish within it; the test
/// polls until the layer completes, so only the wait itself is added). Five steps release the
/// first layer (22 ms, 2 ms carried); five more while it runs bank 20 ms and release nothing
/// behind it; the first step after it ends releases the second. Before, no step was granted
/// while the layer ran: the next layer needed four more steps of an idle SSD after it ended
/// (2 + 4.4 × 4 ms), and the SSD wrote about half the time.
#[test]
fn decode_steps_bank_while_a_write_layer_runs() {
    let mut stack = banking_stack(|_| {});
    let first = prompt(0, 0);
    let context = first.len() as u32;
    prefill(&mut stack, &first, &[0, 1, 2, 3]).expect("prefill");
    assert_eq!(stack.runtime.counters().write_layers_issued, 0, "no window in prefill: nothing written");
    for _ in 0..5 {
        stack.runtime.decode_step(context).expect("decode step");
    }
    assert_eq!(stack.runtime.counters().write_layers_issued, 1, "five steps pay for the first layer");
    for _ in 0..5 {
        stack.runtime.decode_step(context).expect("decode step");
    }
    assert_eq!(write_layers_completed(&stack), 0, "the emulated layer takes ~3 s");
    assert_eq!(stack.runtime.counters().write_layers_issued, 1, "nothing released behind the layer in flight");
    poll_until_the_first_write_layer_completes(&mut stack);
    stack.runtime.decode_step(context).expect("decode step");
    assert_eq!(stack.runtime.counters().write_layers_issued, 2, "the first step after it releases the next layer");
}

/// Write layers completed, from the runtime's event log.
fn write_layers_completed(stack: &Stack) -> usize {
    stack.runtime.events().iter().filter(|e| e.direction == IoDirection::Write && e.kind == IoEventKind::Completed).count()
}

/// Polls the banking stack's I/O until its first write layer completed (~3 s; 30 s at most).
fn poll_until_the_first_write_layer_completes(stack: &mut Stack) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while write_layers_completed(stack) == 0 {
        assert!(std::time::Instant::now() < deadline, "the first write layer never completed");
        stack.runtime.poll_io().expect("poll");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The stack of `decode_steps_bank_while_a_write_layer_runs`: writes of 5 ms per IOCB, 4.4 ms
/// decode steps with 4 SMs free, no prefill window (`windows` may give some buckets theirs back),
/// an emulated SSD taking ~3 s over a 4-block layer: 0.3 s writing it at 100 kB/s, and each
/// write's completion posted 2.5 s after it ran (a fault rule set once the pool is formatted: a
/// timing model that slow would take minutes over the format's metadata).
fn banking_stack(windows: impl Fn(&mut scheduler::table::Bucket)) -> Stack {
    let mut table = common::table(common::MODEL, common::geometry().layers);
    for row in table.io_costs.iter_mut().filter(|row| row.kind == IoKind::Write) {
        row.duration_us = 5000.0 * f64::from(row.iocb_count);
    }
    for bucket in &mut table.buckets {
        for layer in &mut bucket.layers {
            layer.slack_windows.clear();
        }
        windows(bucket);
    }
    for step in &mut table.decode_steps {
        (step.duration_us, step.free_sms) = (4400.0, 4);
    }
    let profile = scheduler::table::Profile::from_table(table).expect("valid table");
    let timing = nvme_emu::TimingModel { write_bytes_per_s: 100_000, ..common::slow_ssd() };
    let stack = common::stack_with_profile(config(PolicyChoice::SlackAware), Some(timing), profile);
    stack.device.set_faults(FaultPlan::none().with_rule(
        FaultRule::every_nth_io(1, FaultAction::Delay(std::time::Duration::from_millis(2500))).with_opcode(NvmOpcode::Write as u8),
    ));
    stack
}

/// Goal: decode-step time banked while a write layer runs does not cross into the next prefill.
/// As in `decode_steps_bank_while_a_write_layer_runs`, five steps release the first 20 ms layer
/// (2 ms carried); four more bank 17.6 ms while it runs; decode ends with the layer, and the next
/// request (a miss of 96 tokens, whose bucket alone has a window: 1 ms per layer) begins. Its
/// first layer's window is a grant of 0 IOCBs (1 ms). Before, it found 19.6 ms carried and
/// released a whole 20 ms layer, which ran through the prefill's compute in no window of it; now
/// the banked time is dropped at `begin_prefill` and the 3 ms carried release nothing.
#[test]
fn time_banked_in_decode_steps_does_not_cross_into_the_next_prefill() {
    let mut stack = banking_stack(|bucket| {
        if (bucket.input_tokens, bucket.prefix_tokens) == (96, 0) {
            for layer in &mut bucket.layers {
                layer.slack_windows = vec![scheduler::table::SlackWindow { offset_us: 0.0, duration_us: 1000.0, free_sms: 4 }];
            }
        }
    });
    let first = prompt(0, 0);
    let context = first.len() as u32;
    prefill(&mut stack, &first, &[0, 1, 2, 3]).expect("prefill");
    for _ in 0..5 {
        stack.runtime.decode_step(context).expect("decode step");
    }
    assert_eq!(stack.runtime.counters().write_layers_issued, 1, "five steps pay for the first layer");
    for _ in 0..4 {
        stack.runtime.decode_step(context).expect("decode step");
    }
    assert_eq!(write_layers_completed(&stack), 0, "the emulated layer takes ~3 s");
    poll_until_the_first_write_layer_completes(&mut stack);
    let second: Vec<u32> = prompt(1, 1).iter().map(|token| token + 7_000_000).collect();
    assert_eq!(second.len(), 96);
    let engine_blocks: Vec<u32> = (4..10).collect();
    let start = stack.runtime.begin_prefill(&objstore::KvRequest { tokens: &second, block_ids: &engine_blocks }).expect("begin");
    assert_eq!(start.cached_blocks, 0);
    stack.runtime.before_layer(start.id, 0).expect("layer 0");
    stack.engine.compute_layer(&second, 0..6, &engine_blocks, 0);
    stack.runtime.after_layer(start.id, 0).expect("layer 0");
    assert_eq!(stack.runtime.counters().write_layers_issued, 1, "a 1 ms window released a 20 ms layer: {:?}", stack.runtime);
}

/// The most layers of `direction` in flight at once, from the runtime's event log.
fn in_flight_max(events: &[IoEvent], direction: IoDirection) -> usize {
    let (mut in_flight, mut most) = (0usize, 0usize);
    for event in events.iter().filter(|event| event.direction == direction) {
        match event.kind {
            IoEventKind::Issued => {
                in_flight += 1;
                most = most.max(in_flight);
            }
            IoEventKind::Completed => in_flight = in_flight.saturating_sub(1),
        }
    }
    most
}

/// Goal: with several stores queued, one write layer is in flight at a time (oldest store
/// first), so a read that arrives waits under the barrier for at most one layer, not for one
/// layer of every queued store. No-overlap writes every layer at the end of each prefill; with
/// no decode step between requests, three stores queue up. Before, every store had a layer in
/// flight and the next request's first read waited for all of them.
#[test]
fn one_write_layer_in_flight_across_queued_stores() {
    // Writes at a sixteenth of slow_ssd's rate (a store's 4 layers take ~16 ms, a prefill's
    // compute 4 ms), so that stores queue behind one another however the machine's load
    // stretches the prefills (at a quarter, ~4 ms a store, a loaded 2-core machine once wrote
    // them as fast as they came: never two queued in 8 sessions); each session on engine
    // blocks of its own, so that no later session's store holds the first's blocks when the
    // test asks whether they were let go (take_blocks would hand a committed store's blocks to
    // the next prefill).
    let timing = nvme_emu::TimingModel { write_bytes_per_s: 8_000_000, ..common::slow_ssd() };
    let mut stack = stack(config(PolicyChoice::NoOverlap), Some(timing));
    let blocks_per_prompt = prompt(0, 0).len() / BLOCK_TOKENS as usize;
    let own_blocks =
        |session: usize| -> Vec<u32> { (0..blocks_per_prompt).map(|index| (session * blocks_per_prompt + index) as u32).collect() };
    let mut first = None;
    let mut sessions = 0;
    while sessions < 3 || (stack.runtime.queued_stores() < 2 && sessions < 8) {
        let tokens = prompt(sessions as u32 + 10, 0);
        let engine_blocks = own_blocks(sessions);
        prefill(&mut stack, &tokens, &engine_blocks).expect("prefill");
        first.get_or_insert((tokens, engine_blocks));
        sessions += 1;
    }
    assert!(stack.runtime.queued_stores() >= 2, "the test needs stores queued together: {:?}", stack.runtime);
    // A turn that reads once its session's store is visible (others may still be queued).
    let (first_tokens, first_blocks) = first.expect("three prefills");
    decode_until_visible(&mut stack, &first_tokens, &first_blocks);
    let tokens = prompt(10, 1);
    let engine_blocks: Vec<u32> =
        (0..tokens.len() / BLOCK_TOKENS as usize).map(|index| (sessions * blocks_per_prompt + index) as u32).collect();
    assert!(prefill(&mut stack, &tokens, &engine_blocks).expect("prefill") > 0, "the turn hits its session's blocks");
    stack.runtime.drain().expect("drain");
    let events = stack.runtime.events();
    assert_eq!(stack.runtime.events_dropped(), 0);
    assert_eq!(in_flight_max(events, IoDirection::Write), 1, "write layers in flight together");
    assert_eq!(mixed_issues(events), 0);
}

/// Goal: writes a decode step released but the runtime had not handed over yet (one write layer
/// goes at a time) wait while the next request still has a read to issue: the policy's rule is
/// that writes go only once every read of the request is issued (and start after those reads
/// complete). Before, they went whenever reads were momentarily idle: at the next request's
/// `begin_prefill`, before its first read, and between its layers' reads. The table has no
/// prefill windows (no write is granted inside a prefill, every read goes at once), so a decode
/// step releases every layer of the first request's store together.
#[test]
fn released_writes_wait_for_every_read_of_the_next_request() {
    let mut table = common::table(common::MODEL, common::geometry().layers);
    for bucket in &mut table.buckets {
        for layer in &mut bucket.layers {
            layer.slack_windows.clear();
        }
    }
    let profile = scheduler::table::Profile::from_table(table).expect("valid table");
    let mut stack = common::stack_with_profile(config(PolicyChoice::SlackAware), None, profile);
    // A cached prefix for the request after next.
    let cached = prompt(0, 0);
    prefill(&mut stack, &cached, &[0, 1, 2, 3]).unwrap();
    stack.runtime.drain().unwrap();
    // The request whose writes the decode step releases: 2 new blocks.
    let first = prompt(1, 0);
    prefill(&mut stack, &first, &[4, 5, 6, 7]).unwrap();
    assert_eq!(stack.runtime.queued_stores(), 1);
    stack.runtime.decode_step(first.len() as u32).unwrap();
    stack.runtime.clear_events();
    // No poll_io: the released layers past the first are still in the runtime. The first may
    // have completed meanwhile.
    std::thread::sleep(std::time::Duration::from_millis(5));
    let next = prompt(0, 1);
    let start = stack.runtime.begin_prefill(&objstore::KvRequest { tokens: &next, block_ids: &[8, 9, 10, 11, 12, 13] }).unwrap();
    assert_eq!(start.cached_blocks, 4);
    for layer in 0..common::geometry().layers {
        stack.runtime.before_layer(start.id, layer).unwrap();
        // The layer's compute: the next layer's read may complete meanwhile.
        common::compute_for(std::time::Duration::from_micros(common::LAYER_COMPUTE_US));
        stack.runtime.after_layer(start.id, layer).unwrap();
    }
    stack.runtime.end_prefill(start.id).unwrap();
    let events = stack.runtime.events();
    let last_read = events
        .iter()
        .rposition(|event| event.direction == IoDirection::Read && event.kind == IoEventKind::Issued)
        .expect("the request read its prefix");
    let early: Vec<&IoEvent> =
        events[..last_read].iter().filter(|event| event.direction == IoDirection::Write && event.kind == IoEventKind::Issued).collect();
    assert!(early.is_empty(), "writes issued before the request's last read: {early:?}\n{events:?}");
    assert!(
        events.iter().any(|event| event.direction == IoDirection::Write && event.kind == IoEventKind::Issued),
        "the released writes go once the reads are issued"
    );
    stack.runtime.drain().unwrap();
}

/// Goal: a slack-aware decode step's grant that happens to cover the whole write queue is
/// priced like any other: each released layer pays its own command latency, and what does not
/// fit the step is carried. Writes cost 50 + 175 µs per IOCB; one store of 4 layers × 2 IOCBs
/// (8 queued, no prefill slack); a 1500 µs step. The policy grants all 8 IOCBs as one kernel
/// (1450 µs), but the layers go one at a time at 400 µs each: 3 fit (1200 µs), the 4th would
/// end 100 µs past the step. Before, a grant covering the queue released all 4. The next step
/// releases the 4th.
#[test]
fn a_slack_aware_grant_of_the_whole_queue_releases_only_what_fits() {
    let mut table = common::table(common::MODEL, common::geometry().layers);
    for bucket in &mut table.buckets {
        for layer in &mut bucket.layers {
            layer.slack_windows.clear();
        }
    }
    table.io_costs.retain(|row| row.kind == IoKind::Read);
    for n in [1u32, 2, 4, 8, 16, 32, 64] {
        let duration_us = 50.0 + 175.0 * f64::from(n);
        table.io_costs.push(IoCostEntry {
            kind: IoKind::Write,
            iocb_count: n,
            sm_budget: 4,
            duration_us,
            bytes: u64::from(n) * common::IOCB_BYTES,
        });
    }
    for step in &mut table.decode_steps {
        (step.duration_us, step.free_sms) = (1500.0, 4);
    }
    let profile = scheduler::table::Profile::from_table(table).expect("valid table");
    let mut stack = common::stack_with_profile(config(PolicyChoice::SlackAware), None, profile);
    let tokens: Vec<u32> = (0..2 * BLOCK_TOKENS).collect();
    let engine_blocks = [0, 1];
    prefill(&mut stack, &tokens, &engine_blocks).unwrap();
    assert_eq!((stack.runtime.queued_stores(), stack.runtime.counters().write_layers_issued), (1, 0), "no prefill slack");
    // Lets the released layers go, one at a time (no timing model: microseconds each).
    let settle = |stack: &mut Stack| {
        for _ in 0..200 {
            stack.runtime.poll_io().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };
    stack.runtime.decode_step(tokens.len() as u32).unwrap();
    settle(&mut stack);
    let counters = stack.runtime.counters();
    assert_eq!((counters.write_layers_issued, counters.stores_committed), (3, 0), "{counters:?}");
    stack.runtime.decode_step(tokens.len() as u32).unwrap();
    settle(&mut stack);
    let counters = stack.runtime.counters();
    assert_eq!((counters.write_layers_issued, counters.stores_committed), (4, 1), "{counters:?}");
}

/// Goal: the running prefill's retrieve holds its target engine blocks (the cached prefix's)
/// from `begin_prefill` to `end_prefill`: the device writes them meanwhile, so `releasable`
/// says no, as its contract promises ("no I/O the device may still be doing names it"). Before,
/// they were releasable while their reads were in flight. An aborted prefill releases them.
#[test]
fn a_running_retrieve_holds_its_target_blocks_until_the_prefill_ends() {
    let layers = common::geometry().layers;
    let mut stack = stack(config(PolicyChoice::SlackAware), Some(common::slow_ssd()));
    let first = prompt(0, 0);
    prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
    stack.runtime.drain().unwrap();
    for (turn, abort) in [(1, false), (2, true)] {
        let next = prompt(0, turn);
        let blocks: Vec<u32> = (10 * turn..10 * turn + next.len() as u32 / BLOCK_TOKENS).collect();
        let start = stack.runtime.begin_prefill(&objstore::KvRequest { tokens: &next, block_ids: &blocks }).unwrap();
        let cached = start.cached_blocks;
        assert!(cached > 0, "the turn hits its session's blocks");
        let held = |stack: &Stack| blocks[..cached].iter().all(|&block| !stack.runtime.releasable(block));
        assert!(held(&stack), "targets of reads about to be issued");
        stack.runtime.begin_layer(start.id, 0).unwrap();
        assert!(held(&stack), "targets of reads in flight");
        stack.runtime.wait_layer_kv(start.id, 0).unwrap();
        stack.engine.compute_layer(&next, cached as u32..blocks.len() as u32, &blocks, 0);
        stack.runtime.after_layer(start.id, 0).unwrap();
        if abort {
            stack.runtime.abort_prefill(start.id).unwrap();
            assert!(blocks.iter().all(|&block| stack.runtime.releasable(block)), "an aborted prefill holds nothing");
            continue;
        }
        for layer in 1..layers {
            stack.runtime.before_layer(start.id, layer).unwrap();
            assert!(held(&stack), "layer {layer}");
            stack.engine.compute_layer(&next, cached as u32..blocks.len() as u32, &blocks, layer);
            stack.runtime.after_layer(start.id, layer).unwrap();
        }
        stack.runtime.end_prefill(start.id).unwrap();
        assert!(blocks[..cached].iter().all(|&block| stack.runtime.releasable(block)), "the reads ended with the prefill");
        assert!(stack.engine.holds(&next, 0..cached as u32, &blocks, layers));
        stack.runtime.drain().unwrap();
    }
}

#[test]
fn a_queued_stores_source_is_refused_as_a_retrieve_target() {
    // Goal: an engine block a queued store still has to write from (not `releasable`) is refused
    // as the next request's retrieve target, before anything is prepared: the read would land
    // over the store's source and the store would commit the cached block's bytes under its own
    // keys. Before, `begin_prefill` accepted it.
    let mut stack = stack(config(PolicyChoice::SlackAware), None);
    prefill(&mut stack, &prompt(0, 0), &[0, 1, 2, 3]).unwrap();
    stack.runtime.drain().unwrap();
    // Shares the system prompt (read into 4, 5); its own blocks, from 6 and 7, stay queued.
    assert_eq!(prefill(&mut stack, &prompt(1, 0), &[4, 5, 6, 7]).unwrap(), 2);
    assert_eq!(stack.runtime.queued_stores(), 1, "slack-aware keeps the last layer queued");
    assert!(!stack.runtime.releasable(6));
    let before = stack.runtime.counters();
    let tokens = prompt(0, 0);
    let refused = stack.runtime.begin_prefill(&objstore::KvRequest { tokens: &tokens, block_ids: &[10, 6, 11, 12] });
    assert!(matches!(refused, Err(tutti_runtime::RuntimeError::BlockRefused { block: 6, position: 1, .. })), "{refused:?}");
    assert_eq!(stack.runtime.counters().prefills, before.prefills, "no prefill began");
    assert_eq!((stack.runtime.queued_stores(), stack.runtime.queued_blocks()), (1, 2), "the queue is as it was");
    // Nothing was left begun: the same request on free blocks goes, and the queued store commits
    // its own bytes.
    assert_eq!(prefill(&mut stack, &tokens, &[10, 11, 12, 13]).unwrap(), 4);
    stack.runtime.drain().unwrap();
    assert!(stack.engine.holds(&prompt(1, 0), 2..4, &[4, 5, 6, 7], common::geometry().layers));
    assert_eq!(stack.runtime.lookup(&prompt(1, 0)), 4);
}
