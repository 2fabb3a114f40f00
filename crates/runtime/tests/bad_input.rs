//! Bad input from the engine, the table and the device: typed errors, no panic, no wrong bytes.

mod common;

use common::{config, gpu, parts, prefill, prompt, stack, table, MODEL};
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{NvmOpcode, NvmeStatus, StatusCodeType};
use nvme_emu::{FaultAction, FaultPlan, FaultRule};
use objstore::KvRequest;
use scheduler::table::{GpuIdentity, Profile};
use tutti_runtime::{PolicyChoice, Runtime, RuntimeConfig, RuntimeError, WriteQueueFullAction};

/// Goal: a table for another model (name, layer count) or another GPU is refused at start.
#[test]
fn profile_for_another_model_or_gpu_is_refused() {
    let layers = common::geometry().layers;
    let cases = [
        (Profile::from_table(table("llama3-8b", layers)).unwrap(), config(PolicyChoice::SlackAware)),
        (Profile::from_table(table(MODEL, layers + 1)).unwrap(), config(PolicyChoice::SlackAware)),
        (Profile::from_table(table(MODEL, layers)).unwrap(), {
            let mut other = config(PolicyChoice::SlackAware);
            other.gpu = GpuIdentity { name: "h200".into(), ..gpu() };
            other
        }),
    ];
    for (profile, config) in cases {
        let (_device, store, _engine) = parts(None);
        match Runtime::new(store, profile, config) {
            Err(RuntimeError::ProfileMismatch { .. }) => {}
            other => panic!("expected ProfileMismatch, got {other:?}"),
        }
    }
}

/// Goal: boundaries out of order (a layer twice, skipped, ended before begun, decode during
/// prefill, end before the last layer, calls on a finished request, a second prefill) are typed
/// errors that leave the runtime usable; the request then completes with the right bytes.
#[test]
fn boundaries_out_of_order_are_refused() {
    let layers = common::geometry().layers;
    let mut stack = stack(config(PolicyChoice::SlackAware), None);
    let tokens = prompt(0, 0);
    let blocks: Vec<u32> = (0..4).collect();
    prefill(&mut stack, &tokens, &blocks).unwrap();
    stack.runtime.drain().unwrap();
    let next = prompt(0, 1);
    let next_blocks: Vec<u32> = (4..10).collect();
    let start = stack.runtime.begin_prefill(&KvRequest { tokens: &next, block_ids: &next_blocks }).unwrap();
    assert_eq!(start.cached_blocks, 4);
    let id = start.id;
    let out_of_order = |result: Result<(), RuntimeError>| matches!(result, Err(RuntimeError::OutOfOrder { .. }));
    assert!(out_of_order(stack.runtime.after_layer(id, 0)), "after_layer before before_layer");
    assert!(out_of_order(stack.runtime.before_layer(id, 1).map(drop)), "layer 1 before layer 0");
    assert!(out_of_order(stack.runtime.end_prefill(id).map(drop)), "end before any layer");
    assert!(out_of_order(stack.runtime.decode_step(100)), "decode during prefill");
    assert!(out_of_order(stack.runtime.begin_prefill(&KvRequest { tokens: &next, block_ids: &next_blocks }).map(drop)));
    stack.runtime.before_layer(id, 0).unwrap();
    assert!(out_of_order(stack.runtime.before_layer(id, 0).map(drop)), "layer 0 twice");
    stack.runtime.after_layer(id, 0).unwrap();
    assert!(out_of_order(stack.runtime.before_layer(id, 0).map(drop)), "layer 0 again after it ended");
    // The split form: begin the layer, (pre-attention work), wait for its KV, end it.
    assert!(out_of_order(stack.runtime.wait_layer_kv(id, 1).map(drop)), "waiting for a layer not begun");
    stack.runtime.begin_layer(id, 1).unwrap();
    assert!(out_of_order(stack.runtime.after_layer(id, 1)), "attention without waiting for the cached KV");
    assert!(out_of_order(stack.runtime.wait_layer_kv(id, 2).map(drop)), "waiting for another layer");
    stack.runtime.wait_layer_kv(id, 1).unwrap();
    assert_eq!(stack.runtime.wait_layer_kv(id, 1).unwrap(), std::time::Duration::ZERO, "a second wait returns at once");
    stack.engine.compute_layer(&next, 4..6, &next_blocks, 1);
    stack.runtime.after_layer(id, 1).unwrap();
    for layer in 2..layers {
        stack.runtime.before_layer(id, layer).unwrap();
        stack.engine.compute_layer(&next, 4..6, &next_blocks, layer);
        stack.runtime.after_layer(id, layer).unwrap();
    }
    assert!(out_of_order(stack.runtime.before_layer(id, layers).map(drop)), "a layer past the model");
    stack.runtime.end_prefill(id).unwrap();
    assert!(stack.engine.holds(&next, 0..4, &next_blocks, layers));
    for call in [
        stack.runtime.before_layer(id, 0).map(drop),
        stack.runtime.begin_layer(id, 0),
        stack.runtime.wait_layer_kv(id, 0).map(drop),
        stack.runtime.after_layer(id, 0),
        stack.runtime.end_prefill(id).map(drop),
        stack.runtime.abort_prefill(id),
    ] {
        assert!(matches!(call, Err(RuntimeError::StaleRequest { .. })), "{call:?}");
    }
    stack.runtime.decode_step(200).unwrap();
}

/// Goal: past the write-queue limit, `Refuse` fails the new request with a typed error and
/// prepares nothing; `ForceOldest` writes and commits the oldest store first. Both are counted.
#[test]
fn full_write_queue_refuses_or_forces_as_configured() {
    for action in [WriteQueueFullAction::Refuse, WriteQueueFullAction::ForceOldest] {
        let mut config = config(PolicyChoice::SlackAware);
        config.write_queue_limit_blocks = 4;
        config.on_write_queue_full = action;
        let mut stack = stack(config, None);
        let first = prompt(0, 0);
        prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
        assert_eq!(stack.runtime.queued_blocks(), 4, "slack-aware keeps the last layer queued");
        let second = prompt(1, 0);
        let result = prefill(&mut stack, &second, &[4, 5, 6, 7]);
        let counters = stack.runtime.counters();
        match action {
            WriteQueueFullAction::Refuse => {
                assert!(matches!(result, Err(RuntimeError::WriteQueueFull { .. })), "{result:?}");
                assert_eq!((counters.stores_refused, counters.prefills), (1, 1));
                // Nothing was prepared: the engine can go on.
                stack.runtime.drain().unwrap();
                assert_eq!(stack.runtime.lookup(&first), 4);
                prefill(&mut stack, &second, &[4, 5, 6, 7]).unwrap();
            }
            WriteQueueFullAction::ForceOldest => {
                result.unwrap();
                assert_eq!(counters.stores_forced, 1);
                assert_eq!(stack.runtime.lookup(&first), 4, "the forced store is committed");
            }
        }
        stack.runtime.drain().unwrap();
        assert_eq!(stack.runtime.lookup(&second), 4);
    }
}

/// Goal: a device error on a deferred write drops that store only: its blocks never become
/// visible (no wrong bytes can be served from them), its engine blocks are released, the other
/// store commits, and later requests go on.
#[test]
fn device_error_in_a_deferred_write_drops_only_that_store() {
    let layers = common::geometry().layers;
    let mut stack = stack(config(PolicyChoice::SlackAware), None);
    let (first, second) = (prompt(0, 0), prompt(1, 0));
    // Another system prompt for the second session, so the two stores share no block.
    let second: Vec<u32> = second.iter().map(|token| token + 7_000_000).collect();
    prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
    prefill(&mut stack, &second, &[4, 5, 6, 7]).unwrap();
    let write_fault = NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, codes::WRITE_FAULT);
    stack.device.set_faults(
        FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::Status(write_fault)).with_opcode(NvmOpcode::Write as u8)),
    );
    stack.runtime.drain().unwrap();
    let counters = stack.runtime.counters();
    assert_eq!(counters.stores_failed, 1, "{counters:?}");
    assert_eq!(counters.stores_committed, 1, "{counters:?}");
    let (visible_first, visible_second) = (stack.runtime.lookup(&first), stack.runtime.lookup(&second));
    assert!(
        (visible_first, visible_second) == (0, 4) || (visible_first, visible_second) == (4, 0),
        "exactly one store dropped: {visible_first} {visible_second}"
    );
    assert!((0..8).all(|block| stack.runtime.releasable(block)));
    // The surviving store serves the right bytes.
    let cached: Vec<u32> = if visible_first == 4 { prompt(0, 1) } else { second.iter().copied().chain(10_000..10_032).collect() };
    let blocks: Vec<u32> = (10..10 + cached.len() as u32 / common::BLOCK_TOKENS).collect();
    for block in 0..8 {
        stack.engine.scribble(block, layers);
    }
    assert_eq!(prefill(&mut stack, &cached, &blocks).unwrap(), 4);
    assert!(stack.engine.holds(&cached, 0..4, &blocks, layers));
    stack.runtime.drain().unwrap();
}

/// Goal: a write queue allowed as many stores as the object store has request slots is refused
/// at construction (each queued store holds a slot and the running retrieve needs one; past
/// that every cached-prefix request would fail mid-stream), and one below it is accepted.
#[test]
fn a_write_queue_as_deep_as_the_stores_request_slots_is_refused() {
    let (_device, store, _engine) = parts(None);
    let requests_max = store.config().requests_max;
    let mut too_deep = config(PolicyChoice::SlackAware);
    too_deep.write_queue_limit_stores = requests_max;
    match Runtime::new(store, Profile::from_table(table(MODEL, common::geometry().layers)).unwrap(), too_deep) {
        Err(RuntimeError::InvalidConfig { reason }) => assert!(reason.contains("requests_max"), "{reason}"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    let (_device, store, _engine) = parts(None);
    let mut fits = config(PolicyChoice::SlackAware);
    fits.write_queue_limit_stores = requests_max - 1;
    Runtime::new(store, Profile::from_table(table(MODEL, common::geometry().layers)).unwrap(), fits).expect("a queue one below");
}

/// Goal: an `io_timeout` no deadline can hold (`Duration::MAX`; anything past a day) is refused
/// at construction with `InvalidConfig`. It passed the non-zero check, and the first bounded
/// wait panicked computing `Instant::now() + io_timeout`. A day is accepted.
#[test]
fn an_io_timeout_past_a_day_is_refused() {
    for (io_timeout, accepted) in [
        (std::time::Duration::MAX, false),
        (std::time::Duration::from_secs(86_400) + std::time::Duration::from_nanos(1), false),
        (std::time::Duration::from_secs(86_400), true),
    ] {
        let (_device, store, _engine) = parts(None);
        let mut config = config(PolicyChoice::SlackAware);
        config.io_timeout = io_timeout;
        match Runtime::new(store, Profile::from_table(table(MODEL, common::geometry().layers)).unwrap(), config) {
            Err(RuntimeError::InvalidConfig { reason }) if !accepted => assert!(reason.contains("io_timeout"), "{reason}"),
            Ok(_) if accepted => {}
            other => panic!("io_timeout {io_timeout:?}: {other:?}"),
        }
    }
}

/// Goal: under slack-aware, a table whose every decode step leaves fewer SMs free than its
/// smallest write budget is refused at construction (`InvalidConfig`): no deferred write could
/// ever go in a decode step, so under `Refuse` the full queue refused every later request
/// forever. The baselines do not use the windows and accept it; one step with enough SMs is
/// enough.
#[test]
fn a_table_where_no_decode_step_can_write_is_refused_under_slack_aware() {
    let layers = common::geometry().layers;
    let mut starved = table(MODEL, layers);
    for step in &mut starved.decode_steps {
        step.free_sms = 2; // the write rows are all on 4 SMs
    }
    let (_device, store, _engine) = parts(None);
    match Runtime::new(store, Profile::from_table(starved.clone()).unwrap(), config(PolicyChoice::SlackAware)) {
        Err(RuntimeError::InvalidConfig { reason }) => assert!(reason.contains("decode step") && reason.contains("(4 SMs)"), "{reason}"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    for policy in [PolicyChoice::Naive, PolicyChoice::NoOverlap] {
        let (_device, store, _engine) = parts(None);
        Runtime::new(store, Profile::from_table(starved.clone()).unwrap(), config(policy)).expect("the baselines ignore the windows");
    }
    starved.decode_steps[1].free_sms = 4;
    let (_device, store, _engine) = parts(None);
    Runtime::new(store, Profile::from_table(starved).unwrap(), config(PolicyChoice::SlackAware)).expect("one step can write");
}

/// Goal: under slack-aware, the decode-step check asks for what `decode_step` can grant, not
/// for one row: a context between two rows gets the fewer free SMs of the two, past the last
/// row the last row's, below the first row nothing. Rows {16: 4 free, 4096: 0 free} with write
/// rows on 4 SMs let only a context of exactly 16 tokens write; they were accepted, and under
/// `Refuse` a full queue then refused every later request. Refused now; a table where the last
/// row, or two adjacent rows, leave enough SMs is accepted. The range must have contexts off
/// the rows and be within reach: rows {4096: 0 free, u32::MAX: 8 free} (only u32::MAX writes)
/// and {16: 4, 17: 4, 4096: 0} (only 16 and 17 write) were accepted too. Within reach means at
/// most twice the table's largest prompt (256 tokens): a last row at 4096 no longer counts, nor
/// one at 512 (past it, no context is within reach).
#[test]
fn a_table_where_only_one_decode_row_can_write_is_refused_under_slack_aware() {
    use scheduler::table::DecodeStep;
    let layers = common::geometry().layers;
    let step = |context_tokens, free_sms| DecodeStep { context_tokens, duration_us: 2000.0, free_sms };
    for (steps, accepted) in [
        (vec![step(16, 4), step(4096, 0)], false),
        (vec![step(16, 4), step(256, 0), step(511, 4)], true),
        (vec![step(16, 4), step(2048, 4), step(4096, 0)], true),
        (vec![step(16, 4), step(2048, 0), step(4096, 0)], false),
        // Only a context of exactly u32::MAX could write: contexts 4096..u32::MAX-1 get 0.
        (vec![step(4096, 0), step(u32::MAX, 8)], false),
        // Two adjacent rows with no context between them: only contexts 16 and 17 could write.
        (vec![step(16, 4), step(17, 4), step(4096, 0)], false),
        // The last row writes if contexts past it are within reach (twice the largest prefill
        // input, 2 × 256 tokens): past a row at 512 itself, none is.
        (vec![step(16, 0), step(511, 4)], true),
        (vec![step(16, 0), step(512, 4)], false),
        (vec![step(16, 4), step(2048, 0), step(4096, 4)], false),
    ] {
        let mut starved = table(MODEL, layers);
        starved.decode_steps = steps.clone();
        let (_device, store, _engine) = parts(None);
        match Runtime::new(store, Profile::from_table(starved).unwrap(), config(PolicyChoice::SlackAware)) {
            Ok(_) if accepted => {}
            Err(RuntimeError::InvalidConfig { reason }) if !accepted => assert!(reason.contains("decode step"), "{reason}"),
            other => panic!("{steps:?}: {other:?}"),
        }
    }
}

/// A stack holding prompt (0, 0)'s 4 blocks, its device failing reads as `rule` says, and the
/// prefill that hit them failed (`ReadFailed`, blocks 4..8 given): the stack and the prompt.
fn a_cached_prefix_whose_read_failed(rule: FaultRule) -> (common::Stack, Vec<u32>) {
    let mut stack = stack(config(PolicyChoice::SlackAware), None);
    let tokens = prompt(0, 0);
    prefill(&mut stack, &tokens, &[0, 1, 2, 3]).unwrap();
    stack.runtime.drain().unwrap();
    assert_eq!(stack.runtime.lookup(&tokens), 4);
    stack.device.set_faults(FaultPlan::none().with_rule(rule.with_opcode(NvmOpcode::Read as u8)));
    let first = prefill(&mut stack, &tokens, &[4, 5, 6, 7]);
    assert!(matches!(first, Err(RuntimeError::ReadFailed { .. })), "{first:?}");
    (stack, tokens)
}

/// Goal: a cached prefix the device cannot read (an unrecovered read error on its LBAs, every
/// time) is evicted by the read that fails, not hit and failed again by every later request with
/// that prefix (each of which dropped its store, so the prefix was never stored again). Once the
/// device reads again, the prefix stored anew is hit.
#[test]
fn a_prefix_the_device_cannot_read_is_evicted_not_hit_again() {
    let layers = common::geometry().layers;
    let unreadable = NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, codes::UNRECOVERED_READ_ERROR);
    let (mut stack, tokens) = a_cached_prefix_whose_read_failed(FaultRule::every_nth_io(1, FaultAction::Status(unreadable)));
    // The next request with the prefix misses it and computes it (nothing is read: it succeeds
    // on the same device), storing it again.
    let second = prefill(&mut stack, &tokens, &[8, 9, 10, 11]);
    assert_eq!(second.unwrap(), 0, "the unreadable prefix was evicted");
    stack.device.set_faults(FaultPlan::none());
    stack.runtime.drain().unwrap();
    for block in 0..12 {
        stack.engine.scribble(block, layers);
    }
    assert_eq!(prefill(&mut stack, &tokens, &[12, 13, 14, 15]).unwrap(), 4, "the prefix stored again is hit");
    assert!(stack.engine.holds(&tokens, 0..4, &[12, 13, 14, 15], layers));
    stack.runtime.drain().unwrap();
}

/// Goal: a read the device fails with a status that says nothing of the media (Generic
/// "Namespace Not Ready": the device was not ready, the LBAs may read fine later) ends the
/// prefill but does not evict the cached prefix; only a Media and Data Integrity status (as
/// objstore's `check_payloads` judges) does. Before, any NVMe status evicted it.
#[test]
fn a_read_failed_with_a_status_other_than_a_media_error_keeps_the_prefix() {
    let layers = common::geometry().layers;
    // Namespace Not Ready (Generic Command Status 82h).
    let not_ready = NvmeStatus::new(StatusCodeType::Generic, 0x82);
    let (mut stack, tokens) = a_cached_prefix_whose_read_failed(FaultRule::on_nth_io(1, FaultAction::Status(not_ready)));
    stack.device.set_faults(FaultPlan::none());
    stack.runtime.drain().unwrap();
    assert_eq!(stack.runtime.lookup(&tokens), 4, "a read that was not a media error keeps the prefix cached");
    for block in 0..8 {
        stack.engine.scribble(block, layers);
    }
    assert_eq!(prefill(&mut stack, &tokens, &[8, 9, 10, 11]).unwrap(), 4, "the prefix is hit again");
    assert!(stack.engine.holds(&tokens, 0..4, &[8, 9, 10, 11], layers));
    stack.runtime.drain().unwrap();
}

/// Goal: a decode step over a context before the table's first decode row (rows from 4096 with
/// the analytic table's default input step; here from 128, past the 64-token prompt) drains the
/// write queue, priced as that row.
/// Before, such a step wrote nothing: short requests never drained, and under `Refuse` every
/// later store was refused (`WriteQueueFull`) until `drain`.
#[test]
fn decode_steps_before_the_first_row_drain_the_queue() {
    let mut late = table(MODEL, common::geometry().layers);
    for (step, context) in late.decode_steps.iter_mut().zip([128, 1024]) {
        step.context_tokens = context;
    }
    let mut config = config(PolicyChoice::SlackAware);
    config.write_queue_limit_blocks = 4;
    config.on_write_queue_full = WriteQueueFullAction::Refuse;
    let mut stack = common::stack_with_profile(config, None, Profile::from_table(late).unwrap());
    let first = prompt(0, 0);
    prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
    assert_eq!(stack.runtime.queued_blocks(), 4, "slack-aware keeps the last layer queued");
    for context in (64..128).cycle().take(1000) {
        if stack.runtime.queued_stores() == 0 {
            break;
        }
        common::decode(&mut stack, context).unwrap();
    }
    assert_eq!(stack.runtime.queued_stores(), 0, "{:?}", stack.runtime.counters());
    assert_eq!(stack.runtime.lookup(&first), 4);
    let second = prompt(1, 0);
    prefill(&mut stack, &second, &[4, 5, 6, 7]).unwrap();
    stack.runtime.drain().unwrap();
}

/// Goal: an engine can have a refused config or table said without losing its store
/// (`Runtime::new` drops it with the error): `Runtime::check` runs the same checks on a borrowed
/// store, which then starts a runtime with a good config.
#[test]
fn a_refused_config_can_be_checked_without_losing_the_store() {
    let (_device, store, _engine) = parts(None);
    let profile = common::profile();
    let mut too_deep = config(PolicyChoice::SlackAware);
    too_deep.write_queue_limit_stores = store.config().requests_max;
    match Runtime::check(&store, &profile, &too_deep) {
        Err(RuntimeError::InvalidConfig { reason }) => assert!(reason.contains("requests_max"), "{reason}"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    let other_gpu = RuntimeConfig { gpu: GpuIdentity { name: "h200".into(), ..gpu() }, ..config(PolicyChoice::SlackAware) };
    assert!(matches!(Runtime::check(&store, &profile, &other_gpu), Err(RuntimeError::ProfileMismatch { .. })));
    Runtime::check(&store, &profile, &config(PolicyChoice::SlackAware)).unwrap();
    Runtime::new(store, profile, config(PolicyChoice::SlackAware)).expect("the same store, a good config");
}

/// Goal: `stores_forced` counts forced stores that committed; one whose forced write failed is
/// counted in `stores_failed` only (it made room all the same: it left the queue). Before, it
/// was counted as forced too.
#[test]
fn a_forced_store_whose_write_fails_is_not_counted_forced() {
    let mut config = config(PolicyChoice::SlackAware);
    config.write_queue_limit_blocks = 4;
    let mut stack = stack(config, None);
    let first = prompt(0, 0);
    prefill(&mut stack, &first, &[0, 1, 2, 3]).unwrap();
    assert_eq!(stack.runtime.queued_blocks(), 4);
    let write_fault = NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, codes::WRITE_FAULT);
    stack.device.set_faults(
        FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::Status(write_fault)).with_opcode(NvmOpcode::Write as u8)),
    );
    let second = prompt(1, 0);
    prefill(&mut stack, &second, &[4, 5, 6, 7]).unwrap();
    let counters = stack.runtime.counters();
    assert_eq!((counters.stores_forced, counters.stores_failed), (0, 1), "{counters:?}");
    assert_eq!(stack.runtime.lookup(&first), 0, "the failed store is not visible");
    stack.runtime.drain().unwrap();
    assert_eq!(stack.runtime.lookup(&second), 4);
}

/// Goal: one engine block named for two blocks of a request (a retrieve target and a store
/// source, or two store sources) is refused before anything is prepared: a read into it would
/// overwrite the source, or one block's KV would be committed under another's key. Before, the
/// object store refused duplicates only within a retrieve, and both were accepted.
#[test]
fn an_engine_block_named_twice_in_a_request_is_refused() {
    let mut stack = stack(config(PolicyChoice::SlackAware), None);
    prefill(&mut stack, &prompt(0, 0), &[0, 1, 2, 3]).unwrap();
    stack.runtime.drain().unwrap();
    let cases: [(Vec<u32>, Vec<u32>, u32, usize); 2] = [
        // Four cached blocks read into 10..14, and 10 again as the fifth block's source.
        (prompt(0, 1), vec![10, 11, 12, 13, 10, 15], 10, 4),
        // The system prompt read into 20, 21; 22 the source of both new blocks.
        (prompt(1, 0), vec![20, 21, 22, 22], 22, 3),
    ];
    for (tokens, blocks, block, position) in cases {
        let before = stack.runtime.counters();
        let refused = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &blocks });
        match refused {
            Err(RuntimeError::BlockRefused { block: b, position: p, .. }) => assert_eq!((b, p), (block, position)),
            other => panic!("expected BlockRefused for block {block}, got {other:?}"),
        }
        assert_eq!(stack.runtime.counters().prefills, before.prefills, "no prefill began");
        assert_eq!(stack.runtime.queued_stores(), 0, "nothing was prepared");
        assert!(blocks.iter().all(|&block| stack.runtime.releasable(block)));
    }
    // Distinct blocks go.
    let blocks: Vec<u32> = (30..36).collect();
    assert_eq!(prefill(&mut stack, &prompt(0, 1), &blocks).unwrap(), 4);
    assert!(stack.engine.holds(&prompt(0, 1), 0..6, &blocks, common::geometry().layers));
}

#[test]
fn an_engine_block_outside_the_registration_is_refused_past_a_truncated_store_too() {
    // Goal: a block id past the registered engine memory is refused wherever it stands in
    // `block_ids`, as `BlockRefused` before anything is prepared. Before, only the blocks that
    // reached the object store's prepare were checked: one past a truncated store (stored
    // nowhere, only computed into) was accepted.
    let mut config = config(PolicyChoice::SlackAware);
    config.on_write_queue_full = WriteQueueFullAction::ForceOldest;
    config.write_queue_limit_blocks = 4;
    let mut stack = stack(config, None);
    let block_tokens = common::geometry().block_tokens;
    let tokens: Vec<u32> = (0..6 * block_tokens).map(|index| 9_000_000 + index).collect();
    let outside = common::ENGINE_BLOCKS;
    let refused = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &[20, 21, 22, 23, 24, outside] });
    assert!(matches!(refused, Err(RuntimeError::BlockRefused { block, position: 5, .. }) if block == outside), "{refused:?}");
    assert_eq!(stack.runtime.counters().prefills, 0, "no prefill began");
    assert_eq!(stack.runtime.queued_stores(), 0, "nothing was prepared");
}
