//! The scheduler's SM budget reaches the executor: every layer is handed over with the budget
//! the policy decided for it (a window's free SMs, a decode step's), not the table's largest;
//! on the CPU worker executor that budget is the number of worker threads (each with its own
//! queue pair on the device) that carry the layer.

mod common;

use std::time::Duration;

use common::{config, parts_with, prompt, BLOCK_TOKENS, DECODE_STEP_US, LAYER_COMPUTE_US};
use gio_uring::{CpuWorkers, DeviceIndex, SmBudget};
use objstore::KvRequest;
use scheduler::table::{IoCostEntry, IoKind, Profile};
use tutti_runtime::{IoDirection, IoEventKind, PolicyChoice, Runtime};

const WORKERS: usize = 4;

/// The common table with windows of 2 free SMs, decode steps with 1, and cost rows for budgets
/// 1, 2 and 4 (fewer SMs, proportionally slower): the largest budget is 4, the policy's
/// decisions in windows 2 and in decode steps 1.
fn budget_profile() -> Profile {
    let mut table = common::table(common::MODEL, common::geometry().layers);
    for bucket in &mut table.buckets {
        for layer in &mut bucket.layers {
            for window in &mut layer.slack_windows {
                window.free_sms = 2;
            }
        }
    }
    for step in &mut table.decode_steps {
        step.free_sms = 1;
    }
    // Rows ordered by direction, then budget, then count, as the table requires.
    let rows = std::mem::take(&mut table.io_costs);
    for kind in [IoKind::Read, IoKind::Write] {
        for budget in [1u32, 2, 4] {
            table.io_costs.extend(rows.iter().filter(|row| row.kind == kind).map(|row| IoCostEntry {
                sm_budget: budget,
                duration_us: row.duration_us * 4.0 / f64::from(budget),
                ..*row
            }));
        }
    }
    Profile::from_table(table).expect("budget table is valid")
}

#[test]
fn each_layer_goes_on_the_budget_the_policy_chose() {
    // Goal: a write released in a prefill window of 2 free SMs goes to 2 of the 4 worker
    // threads, one released in a decode step of 1 free SM to 1, and a read issued in a window
    // goes with 2 while the read a layer needs at once goes with the table's largest (4). Before,
    // the runtime handed every layer over with the table's largest budget: all 4 threads.
    let mut worker_queues = Vec::new();
    let (device, store, engine) = parts_with(None, |pool, store_config| {
        let controller = &pool.target(0).controller;
        let workers = (0..WORKERS)
            .map(|_| {
                let queue = controller.create_io_queue_pair(256).expect("a queue pair per worker");
                worker_queues.push(queue.id().0);
                vec![(DeviceIndex(0), queue)]
            })
            .collect();
        CpuWorkers::new(1, workers, store_config.iocbs).expect("CPU workers")
    });
    let mut runtime = Runtime::new(store, budget_profile(), config(PolicyChoice::SlackAware)).expect("runtime");
    let commands_per_worker = || {
        let stats = device.stats();
        worker_queues.iter().map(|queue| stats.commands_by_queue.get(queue).copied().unwrap_or(0)).collect::<Vec<u64>>()
    };
    let layers = common::geometry().layers;

    // Request 1: nothing cached, so its writes are the only I/O until its store commits.
    let first = prompt(0, 0);
    let first_blocks: Vec<u32> = (0..(first.len() as u32 / BLOCK_TOKENS)).collect();
    let before = commands_per_worker();
    serve(&mut runtime, &engine, &first, &first_blocks);
    for _ in 0..64 {
        if runtime.queued_stores() == 0 {
            break;
        }
        runtime.decode_step(first.len() as u32).expect("decode step");
        std::thread::sleep(Duration::from_micros(DECODE_STEP_US));
    }
    assert_eq!(runtime.queued_stores(), 0, "request 1's store committed within 64 decode steps");
    let writes: Vec<u64> = commands_per_worker().iter().zip(&before).map(|(after, before)| after - before).collect();
    let write_budgets: Vec<u32> = runtime
        .events()
        .iter()
        .filter(|event| event.direction == IoDirection::Write && event.kind == IoEventKind::Issued)
        .map(|event| event.sm_budget.expect("an issue names its budget").0)
        .collect();
    assert_eq!(write_budgets.len(), layers as usize, "every layer written once: {write_budgets:?}");
    assert!(write_budgets.iter().all(|&budget| budget <= 2), "writes on the windows' and steps' budgets: {write_budgets:?}");
    let widest = *write_budgets.iter().max().expect("writes") as usize;
    assert!(writes[..widest].iter().all(|&count| count > 0), "workers 0..{widest} wrote: {writes:?}");
    assert!(writes[widest..].iter().all(|&count| count == 0), "no worker past the budget wrote: {writes:?} (budgets {write_budgets:?})");

    // Request 2 finds request 1's blocks: its reads.
    runtime.clear_events();
    let second = prompt(0, 1);
    let second_blocks: Vec<u32> = (0..(second.len() as u32 / BLOCK_TOKENS)).collect();
    let cached = serve(&mut runtime, &engine, &second, &second_blocks);
    assert_eq!(cached, first_blocks.len(), "request 2 found request 1's blocks");
    let read_budgets: Vec<(u32, SmBudget)> = runtime
        .events()
        .iter()
        .filter(|event| event.direction == IoDirection::Read && event.kind == IoEventKind::Issued)
        .map(|event| (event.layer, event.sm_budget.expect("an issue names its budget")))
        .collect();
    let expected: Vec<(u32, SmBudget)> = (0..layers).map(|layer| (layer, SmBudget(if layer == 0 { 4 } else { 2 }))).collect();
    assert_eq!(read_budgets, expected, "layer 0 at once on the largest budget, the rest in windows of 2 free SMs");
    assert!(engine.holds(&second, 0..cached as u32, &second_blocks, layers), "every retrieved byte is right");
    runtime.finish().expect("finish");
}

/// One prefill with compute stood in for by busy-waiting; returns the cached block count.
fn serve(runtime: &mut Runtime<CpuWorkers>, engine: &common::Engine, tokens: &[u32], engine_blocks: &[u32]) -> usize {
    let start = runtime.begin_prefill(&KvRequest { tokens, block_ids: engine_blocks }).expect("begin_prefill");
    for layer in 0..common::geometry().layers {
        runtime.before_layer(start.id, layer).expect("before_layer");
        common::compute_for(Duration::from_micros(LAYER_COMPUTE_US));
        engine.compute_layer(tokens, start.cached_blocks as u32..engine_blocks.len() as u32, engine_blocks, layer);
        runtime.after_layer(start.id, layer).expect("after_layer");
    }
    runtime.end_prefill(start.id).expect("end_prefill");
    start.cached_blocks
}
