//! The analytic model, the simulator's SSD and compute model, the timeline importer and the I/O
//! probe driver, each against numbers worked out by hand.

mod common;

use scheduler::analytic::{build_table, layer_kernels, AnalyticGrid, GpuSpec, ModelConfig};
use scheduler::import::import_timeline;
use scheduler::policy::{IoPolicy, Issue, LayerPlan, LayerView, NoOverlap, PolicyKind, QueueView};
use scheduler::probe::{measure_io_costs, IoCostProbe, IoGrid, ProbeSample};
use scheduler::sim::{simulate, simulate_carried, simulate_with_backlog, SimConfig, WriteCarry};
use scheduler::ssd::SsdModel;
use scheduler::table::{DecodeStep, IoKind, Profile};
use scheduler::SchedulerError;

// ---------------------------------------------------------------------------------------------
// Analytic model

#[test]
fn kv_bytes_per_token_match_the_known_models() {
    let llama = ModelConfig::llama3_8b();
    let qwen = ModelConfig::qwen3_32b();
    assert_eq!(llama.kv_bytes_per_token_per_layer() * u64::from(llama.layer_count), 128 * 1024);
    assert_eq!(qwen.kv_bytes_per_token_per_layer() * u64::from(qwen.layer_count), 256 * 1024);
}

/// Goal: a GEMM's estimate is exactly the documented roofline formula.
#[test]
fn qkv_projection_follows_the_roofline() {
    let model = ModelConfig::llama3_8b();
    let gpu = GpuSpec::h100();
    let kernels = layer_kernels(&model, &gpu, 4, 4096, 0);
    let qkv = kernels.iter().find(|k| k.name == "qkv_proj").unwrap();
    let flops = 2.0 * 4096.0 * 4096.0 * (4096.0 + 2.0 * 1024.0);
    let rate_per_us = 989e12 * 0.7 * (128.0 / 132.0) / 1e6;
    let expected_us = flops / rate_per_us + gpu.kernel_overhead_us;
    assert!((qkv.duration_us - expected_us).abs() < 1e-6, "{} vs {expected_us}", qkv.duration_us);
    // Compute-bound: only the reserved I/O SMs are free.
    assert_eq!(qkv.free_sms, 4);
}

#[test]
fn compute_shrinks_with_prefix_and_attention_grows_with_context() {
    let model = ModelConfig::qwen3_32b();
    let gpu = GpuSpec::h100();
    let total = |new: u64, prefix: u64| -> f64 { layer_kernels(&model, &gpu, 4, new, prefix).iter().map(|k| k.duration_us).sum() };
    let attention = |new: u64, prefix: u64| -> f64 {
        layer_kernels(&model, &gpu, 4, new, prefix).iter().find(|k| k.name == "attention").unwrap().duration_us
    };
    // Fixed prompt of 32K: more cached means less to compute.
    let mut previous = f64::INFINITY;
    for prefix in (0..=32768).step_by(4096) {
        let now = total(32768 - prefix, prefix);
        assert!(now < previous, "prefix {prefix}");
        previous = now;
    }
    // Fixed 1K new tokens: attention over a longer prefix costs more.
    assert!(attention(1024, 65536) > 2.0 * attention(1024, 16384));
}

#[test]
fn decode_is_memory_bound_and_faster_on_h200() {
    let model = ModelConfig::llama3_8b();
    let step = |gpu: &GpuSpec| -> f64 { layer_kernels(&model, gpu, 4, 1, 32768).iter().map(|k| k.duration_us).sum() };
    let h100 = step(&GpuSpec::h100());
    let h200 = step(&GpuSpec::h200());
    assert!(h200 < h100 * 0.85, "h200 {h200} vs h100 {h100}");
    let kernels = layer_kernels(&model, &GpuSpec::h100(), 4, 1, 32768);
    assert!(kernels.iter().all(|k| k.free_sms > 4), "decode kernels leave SMs idle");
}

#[test]
fn analytic_build_rejects_bad_configs() {
    let model = ModelConfig::llama3_8b();
    let gpu = GpuSpec::h100();
    let ssd = SsdModel::tutti_two_ssds();
    let io = ssd.cost_table(1 << 20, 8, &[4]).unwrap();
    let grid = AnalyticGrid { input_step_tokens: 1024, input_step_count: 2, prefix_step_tokens: 512, io_sms: 4, decode_step_tokens: 1024 };
    let table = build_table(&model, &gpu, &grid, io.clone(), "test").unwrap();
    Profile::from_table(table).unwrap();

    let too_many_io_sms = AnalyticGrid { io_sms: 132, ..grid.clone() };
    assert!(build_table(&model, &gpu, &too_many_io_sms, io.clone(), "t").is_err());
    // No SM for I/O: refused as such, not as rows of infinite duration.
    let no_io_sms = AnalyticGrid { io_sms: 0, ..grid.clone() };
    let error = build_table(&model, &gpu, &no_io_sms, io.clone(), "t").unwrap_err();
    assert!(matches!(&error, SchedulerError::InvalidConfig { field, .. } if field == "io_sms"), "{error}");
    let error = ssd.cost_table(1 << 20, 8, &[0, 4]).unwrap_err();
    assert!(matches!(&error, SchedulerError::InvalidConfig { field, .. } if field == "sm_budgets"), "{error}");
    let huge = AnalyticGrid { input_step_count: u32::MAX / 1024, prefix_step_tokens: 1, ..grid.clone() };
    assert!(matches!(build_table(&model, &gpu, &huge, io.clone(), "t"), Err(SchedulerError::InvalidConfig { .. })));
    let mut bad_model = model.clone();
    bad_model.head_dim = 0;
    assert!(build_table(&bad_model, &gpu, &grid, io.clone(), "t").is_err());
    let mut bad_gpu = gpu.clone();
    bad_gpu.gemm_efficiency = f64::NAN;
    assert!(build_table(&model, &bad_gpu, &grid, io, "t").is_err());
    let mut bad_ssd = ssd;
    bad_ssd.mixed_bandwidth_fraction = 0.0;
    assert!(bad_ssd.cost_table(1 << 20, 8, &[4]).is_err());
}

/// Goal: an analytic grid is bounded so that its table fits in memory and on disk: the cap was
/// 50M bucket × layer entries (~13 GB in memory, ~40 GB of JSON at ~800 bytes per entry), and
/// `--input-step 64 --input-count 1760 --prefix-step 64` (49.6M) was accepted and then ran out
/// of memory. A grid just past the 2.2M cap (69,005 buckets × 32 layers) is refused at once,
/// naming the grid's fields; the grids of the presets are far below it.
#[test]
fn an_analytic_grid_past_2_2_million_entries_is_refused() {
    let model = ModelConfig::llama3_8b();
    let io = SsdModel::tutti_two_ssds().cost_table(1 << 20, 8, &[4]).unwrap();
    let grid = AnalyticGrid { input_step_tokens: 64, input_step_count: 370, prefix_step_tokens: 64, io_sms: 4, decode_step_tokens: 64 };
    match build_table(&model, &GpuSpec::h100(), &grid, io, "t") {
        Err(SchedulerError::InvalidConfig { reason, .. }) => {
            assert!(reason.contains("2208160") && reason.contains("input_step_count"), "{reason}")
        }
        Err(other) => panic!("expected InvalidConfig, got {other}"),
        Ok(table) => panic!("accepted a grid of {} buckets", table.buckets.len()),
    }
}

// ---------------------------------------------------------------------------------------------
// Simulator

/// 1 MiB of KV per layer read in 200 µs, written in 400 µs, 50 µs latency, mixed traffic halves
/// both directions; SMs never limit.
fn toy_ssd() -> SsdModel {
    SsdModel {
        device_count: 1,
        read_bytes_per_s_per_device: 1048576.0 / 200e-6,
        write_bytes_per_s_per_device: 1048576.0 / 400e-6,
        mixed_bandwidth_fraction: 0.5,
        command_latency_us: 50.0,
        io_bytes_per_s_per_sm: 1e15,
    }
}

/// Reads layers 0 and 1 before layer 0; before layer 1, writes layer 0 and reads layers 2 and 3
/// together (to force mixed traffic); defers everything else.
struct Scripted;

impl IoPolicy for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn plan_layer(&mut self, view: &LayerView<'_>) -> scheduler::Result<LayerPlan> {
        let read = |layer: u32| Issue {
            kind: IoKind::Read,
            layer: Some(layer),
            iocb_count: 1,
            sm_budget: 4,
            offset_us: 0.0,
            after_reads: false,
            slack_us: 0.0,
        };
        let issues = match view.layer {
            0 => vec![read(0), read(1)],
            1 => vec![
                Issue {
                    kind: IoKind::Write,
                    layer: None,
                    iocb_count: view.queued_write_iocbs,
                    sm_budget: 4,
                    offset_us: 0.0,
                    after_reads: false,
                    slack_us: 0.0,
                },
                read(2),
                read(3),
            ],
            _ => vec![],
        };
        Ok(LayerPlan { wait_for_all_reads: false, issues })
    }
    fn plan_prefill_end(&mut self, _: &QueueView<'_>) -> scheduler::Result<Vec<Issue>> {
        Ok(vec![])
    }
    fn plan_decode_step(&mut self, _: &QueueView<'_>) -> scheduler::Result<Vec<Issue>> {
        Ok(vec![])
    }
}

/// Reads layer 0 at once on 4 SMs, and late in layer 0 runs ahead with layer 1 on 4 SMs and
/// layer 2 on 2; before layer 1, records what the view prices the outstanding reads at.
#[derive(Default)]
struct RunsAheadOnTwoBudgets {
    outstanding_reads_us: Option<f64>,
}

impl IoPolicy for RunsAheadOnTwoBudgets {
    fn name(&self) -> &'static str {
        "runs-ahead-on-two-budgets"
    }
    fn plan_layer(&mut self, view: &LayerView<'_>) -> scheduler::Result<LayerPlan> {
        let read = |layer: u32, sm_budget: u32, offset_us: f64| Issue {
            kind: IoKind::Read,
            layer: Some(layer),
            iocb_count: 1,
            sm_budget,
            offset_us,
            after_reads: false,
            slack_us: 0.0,
        };
        let issues = match view.layer {
            0 => vec![read(0, 4, 0.0), read(1, 4, 950.0), read(2, 2, 950.0)],
            1 => {
                self.outstanding_reads_us = Some(view.outstanding_reads_us()?);
                vec![read(3, 4, 0.0)]
            }
            _ => vec![],
        };
        Ok(LayerPlan { wait_for_all_reads: false, issues })
    }
    fn plan_prefill_end(&mut self, _: &QueueView<'_>) -> scheduler::Result<Vec<Issue>> {
        Ok(vec![])
    }
    fn plan_decode_step(&mut self, _: &QueueView<'_>) -> scheduler::Result<Vec<Issue>> {
        Ok(vec![])
    }
}

/// Goal: the simulator's view prices each outstanding read job on its own SM budget, on a
/// table where fewer SMs are faster (reads 100 µs per IOCB on 2 SMs, 150 on 4). Layer 0 lands
/// at 250 (1150 µs layer); its plan's run-ahead reads of layers 1 (4 SMs) and 2 (2 SMs) go out
/// at 1100 and are both outstanding, untouched, when layer 1 begins at 1150: 150 + 100 = 250 µs
/// on the policy's table. Priced on the smallest budget of the two, they were 2 × 100 = 200 µs,
/// faster than the table says the 4-SM one runs.
#[test]
fn the_simulator_prices_each_outstanding_read_on_its_own_sm_budget() {
    let truth = Profile::from_table(common::table()).unwrap();
    let mut rows = common::table();
    for row in rows.io_costs.iter_mut().filter(|row| row.kind == IoKind::Read) {
        row.duration_us = if row.sm_budget == 2 { 100.0 } else { 150.0 } * f64::from(row.iocb_count);
    }
    let scheduler_table = Profile::from_table(rows).unwrap();
    let config = SimConfig {
        input_tokens: 2048,
        prefix_tokens: 1024,
        iocb_bytes: 1 << 20,
        decode_step_count: 0,
        queued_kernels_hide_latency: false,
    };
    let mut policy = RunsAheadOnTwoBudgets::default();
    simulate(&truth, &scheduler_table, &toy_ssd(), &config, &mut policy).unwrap();
    assert_eq!(policy.outstanding_reads_us, Some(250.0));
}

/// Goal: the simulator's timing matches a hand-worked schedule, mixed-traffic penalty included.
#[test]
fn simulator_matches_a_hand_worked_schedule() {
    let table = Profile::from_table(common::table()).unwrap();
    // 2048 tokens, 1024 cached: 1 MiB to read and 1 MiB to write per layer, 1 IOCB each.
    let config =
        SimConfig { input_tokens: 2048, prefix_tokens: 1024, iocb_bytes: 1 << 20, decode_step_count: 0, queued_kernels_hide_latency: true };
    let r = simulate(&table, &table, &toy_ssd(), &config, &mut Scripted).unwrap();
    // Layer 0: read lands at 50 + 200 = 250; attention wanted it at 100 -> 150 µs bubble.
    // Layer 1 starts at 1150: write (0.5 × rate: 800 µs) and reads of layers 2, 3 (0.5 × rate:
    // 400 µs each, back to back) all transfer from 1200 to 2000: 800 µs of mixed traffic.
    // Layers 2 and 3 need their KV at 2250 and 3250: no further bubble.
    assert!((r.bubble_us - 150.0).abs() < 1e-6, "{r:?}");
    assert!((r.mixed_io_us - 800.0).abs() < 1e-6, "{r:?}");
    assert!((r.ttft_us - 4150.0).abs() < 1e-6, "{r:?}");
    assert!((r.fill_bound_us - 150.0).abs() < 1e-6, "{r:?}");
    // Layers 1..3's new KV was never issued.
    assert_eq!(r.write_backlog_bytes_at_ttft, 3 << 20);
    assert_eq!(r.write_backlog_bytes_at_end, 3 << 20);
}

/// Goal: with `queued_kernels_hide_latency` off (a runtime that hands a direction's next kernel
/// to the SSD only once the one ahead completed, as tutti-runtime does), every kernel pays the
/// command latency; on, only the first of a back-to-back run does.
#[test]
fn kernels_handed_over_one_at_a_time_each_pay_the_latency() {
    let table = Profile::from_table(common::table()).unwrap();
    let hidden =
        SimConfig { input_tokens: 2048, prefix_tokens: 1024, iocb_bytes: 1 << 20, decode_step_count: 0, queued_kernels_hide_latency: true };
    let serial = SimConfig { queued_kernels_hide_latency: false, ..hidden };
    // No-overlap reads all 4 layers (1 MiB, 200 µs each) before layer 0 and waits for them.
    let queued = simulate(&table, &table, &toy_ssd(), &hidden, &mut NoOverlap).unwrap();
    let one_at_a_time = simulate(&table, &table, &toy_ssd(), &serial, &mut NoOverlap).unwrap();
    assert!((queued.bubble_us - (50.0 + 4.0 * 200.0)).abs() < 1e-6, "{queued:?}");
    assert!((one_at_a_time.bubble_us - 4.0 * (50.0 + 200.0)).abs() < 1e-6, "{one_at_a_time:?}");
    assert!((one_at_a_time.ttft_us - queued.ttft_us - 3.0 * 50.0).abs() < 1e-6);
}

/// Goal: writes queued by earlier requests are carried in: the policy sees them from time 0, they
/// are written oldest first, and what is left at the end includes them (a runtime's write queue
/// outlives its requests; the live serve workload carries it from request to request).
#[test]
fn a_carried_write_backlog_is_queued_from_the_start_and_counted() {
    let table = Profile::from_table(common::table()).unwrap();
    let config =
        SimConfig { input_tokens: 2048, prefix_tokens: 1024, iocb_bytes: 1 << 20, decode_step_count: 0, queued_kernels_hide_latency: true };
    let r = simulate_with_backlog(&table, &table, &toy_ssd(), &config, &mut WritesOneIocb, 2 << 20).unwrap();
    // The one write IOCB issued before layer 1 takes 1 MiB of the 2 MiB backlog; this request's
    // own 4 MiB of new KV (1 MiB per layer) all stays queued: 2 + 4 - 1 = 5 MiB.
    assert_eq!(r.write_bytes, 4 << 20, "write_bytes is this request's new KV only");
    assert_eq!(r.write_backlog_bytes_at_ttft, 5 << 20, "{r:?}");
    assert_eq!(r.write_backlog_bytes_at_end, 5 << 20, "{r:?}");
    // No backlog: the same as `simulate` (4 - 1 = 3 MiB left).
    let plain = simulate(&table, &table, &toy_ssd(), &config, &mut WritesOneIocb).unwrap();
    assert_eq!(plain.write_backlog_bytes_at_end, 3 << 20);
    assert_eq!(simulate_with_backlog(&table, &table, &toy_ssd(), &config, &mut WritesOneIocb, 0).unwrap(), plain);
}

/// Goal: a write an earlier request already handed to the SSD runs from time 0 and cannot be
/// taken back. Under a read/write barrier (tutti-runtime's slack-aware and no-overlap) the reads
/// wait until it completed; without one they share the SSD with it. No-overlap reads 4 layers of
/// 1 MiB (200 µs + 50 µs latency each, one after another) before layer 0; the carried write is
/// 1 MiB (400 µs + 50 µs).
#[test]
fn a_write_in_flight_at_arrival_holds_reads_under_a_barrier() {
    let table = Profile::from_table(common::table()).unwrap();
    let config = SimConfig {
        input_tokens: 2048,
        prefix_tokens: 1024,
        iocb_bytes: 1 << 20,
        decode_step_count: 0,
        queued_kernels_hide_latency: false,
    };
    let run = |carry: WriteCarry| simulate_carried(&table, &table, &toy_ssd(), &config, &mut NoOverlap, &carry).unwrap();
    let none = run(WriteCarry::default());
    assert!((none.bubble_us - 4.0 * 250.0).abs() < 1e-6, "{none:?}");
    let held = run(WriteCarry { queued_bytes: 0, in_flight_bytes: 1 << 20, reads_wait_for_in_flight: true });
    assert!((held.bubble_us - (450.0 + 4.0 * 250.0)).abs() < 1e-6, "the reads start after the write: {held:?}");
    // Shared at half rate: layer 0's read ends at 450 µs with half the write moved; the write's
    // last 3/8 MiB share layer 1's read (done at 850 µs); layers 2 and 3 alone: 1350 µs.
    let shared = run(WriteCarry { queued_bytes: 0, in_flight_bytes: 1 << 20, reads_wait_for_in_flight: false });
    assert!((shared.bubble_us - 1350.0).abs() < 1e-6, "{shared:?}");
    assert!(shared.mixed_io_us > 0.0 && held.mixed_io_us == 0.0);
    // The carried bytes are backlog, not this request's new KV.
    assert_eq!(held.write_bytes, none.write_bytes);
    assert_eq!(held.write_backlog_bytes_at_ttft, none.write_backlog_bytes_at_ttft);
}

/// Goal: an `OutOfRange` from a policy's decode step ends the run with that error. It was taken
/// as "a table with no decode row": nothing written that step, the run went on. Validation
/// refuses a table with no decode row and the step's context is priced at or past the first
/// row (`Profile::decode_pricing_context`), so no table reaches that case, and the error
/// meant something else was wrong (`slack_aware_decode_steps_as_priced_are_never_out_of_range`).
#[test]
fn an_out_of_range_decode_step_is_an_error_not_a_step_without_writes() {
    struct DecodeOutOfRange;
    impl IoPolicy for DecodeOutOfRange {
        fn name(&self) -> &'static str {
            "decode-out-of-range"
        }
        fn plan_layer(&mut self, view: &LayerView<'_>) -> scheduler::Result<LayerPlan> {
            WritesOneIocb.plan_layer(view)
        }
        fn plan_prefill_end(&mut self, _: &QueueView<'_>) -> scheduler::Result<Vec<Issue>> {
            Ok(vec![])
        }
        fn plan_decode_step(&mut self, view: &QueueView<'_>) -> scheduler::Result<Vec<Issue>> {
            Err(SchedulerError::OutOfRange { what: "context_tokens", value: u64::from(view.context_tokens), min: 0, max: 0 })
        }
    }
    let table = Profile::from_table(common::table()).unwrap();
    let config =
        SimConfig { input_tokens: 2048, prefix_tokens: 1024, iocb_bytes: 1 << 20, decode_step_count: 2, queued_kernels_hide_latency: true };
    let error = simulate(&table, &table, &toy_ssd(), &config, &mut DecodeOutOfRange).unwrap_err();
    assert!(matches!(error, SchedulerError::OutOfRange { what: "context_tokens", value: 2048, .. }), "{error}");
}

/// Reads every layer up front; before layer 1 writes one IOCB of whatever is queued.
struct WritesOneIocb;

impl IoPolicy for WritesOneIocb {
    fn name(&self) -> &'static str {
        "writes-one-iocb"
    }
    fn plan_layer(&mut self, view: &LayerView<'_>) -> scheduler::Result<LayerPlan> {
        let issue =
            |kind, layer, iocb_count| Issue { kind, layer, iocb_count, sm_budget: 4, offset_us: 0.0, after_reads: false, slack_us: 0.0 };
        let issues = match view.layer {
            0 => (0..view.unissued_read_iocbs.len() as u32).map(|layer| issue(IoKind::Read, Some(layer), 1)).collect(),
            1 if view.queued_write_iocbs > 0 => vec![issue(IoKind::Write, None, 1)],
            _ => vec![],
        };
        Ok(LayerPlan { wait_for_all_reads: false, issues })
    }
    fn plan_prefill_end(&mut self, _: &QueueView<'_>) -> scheduler::Result<Vec<Issue>> {
        Ok(vec![])
    }
    fn plan_decode_step(&mut self, _: &QueueView<'_>) -> scheduler::Result<Vec<Issue>> {
        Ok(vec![])
    }
}

#[test]
fn zero_prefix_means_no_reads_and_no_bubble() {
    let table = Profile::from_table(common::table()).unwrap();
    for kind in scheduler::policy::PolicyKind::ALL {
        let config = SimConfig {
            input_tokens: 1024,
            prefix_tokens: 0,
            iocb_bytes: 1 << 20,
            decode_step_count: 4,
            queued_kernels_hide_latency: true,
        };
        let r = simulate(&table, &table, &toy_ssd(), &config, kind.build().as_mut()).unwrap();
        assert_eq!(r.bubble_us, 0.0, "{kind:?}");
        assert_eq!(r.ttft_us, 4000.0, "{kind:?}");
        assert_eq!(r.read_bytes, 0);
        assert_eq!(r.write_bytes, 4 << 20);
    }
}

struct NeverReads;

impl IoPolicy for NeverReads {
    fn name(&self) -> &'static str {
        "never-reads"
    }
    fn plan_layer(&mut self, _: &LayerView<'_>) -> scheduler::Result<LayerPlan> {
        Ok(LayerPlan::default())
    }
    fn plan_prefill_end(&mut self, _: &QueueView<'_>) -> scheduler::Result<Vec<Issue>> {
        Ok(vec![])
    }
    fn plan_decode_step(&mut self, _: &QueueView<'_>) -> scheduler::Result<Vec<Issue>> {
        Ok(vec![])
    }
}

struct OverIssues;

impl IoPolicy for OverIssues {
    fn name(&self) -> &'static str {
        "over-issues"
    }
    fn plan_layer(&mut self, _: &LayerView<'_>) -> scheduler::Result<LayerPlan> {
        Ok(LayerPlan {
            wait_for_all_reads: false,
            issues: vec![Issue {
                kind: IoKind::Read,
                layer: Some(0),
                iocb_count: 99,
                sm_budget: 4,
                offset_us: 0.0,
                after_reads: false,
                slack_us: 0.0,
            }],
        })
    }
    fn plan_prefill_end(&mut self, _: &QueueView<'_>) -> scheduler::Result<Vec<Issue>> {
        Ok(vec![])
    }
    fn plan_decode_step(&mut self, _: &QueueView<'_>) -> scheduler::Result<Vec<Issue>> {
        Ok(vec![])
    }
}

/// Goal: a broken policy ends the run with a typed error, never a hang or a panic.
#[test]
fn broken_policies_are_reported() {
    let table = Profile::from_table(common::table()).unwrap();
    let config =
        SimConfig { input_tokens: 2048, prefix_tokens: 1024, iocb_bytes: 1 << 20, decode_step_count: 0, queued_kernels_hide_latency: true };
    let error = simulate(&table, &table, &toy_ssd(), &config, &mut NeverReads).unwrap_err();
    assert!(matches!(error, SchedulerError::InvalidDecision { policy: "never-reads", .. }), "{error}");
    let error = simulate(&table, &table, &toy_ssd(), &config, &mut OverIssues).unwrap_err();
    assert!(error.to_string().contains("99 IOCBs requested"), "{error}");
    let bad = SimConfig { iocb_bytes: 0, ..config };
    assert!(simulate(&table, &table, &toy_ssd(), &bad, &mut OverIssues).is_err());
    let off_grid = SimConfig { input_tokens: 10, prefix_tokens: 0, ..config };
    assert!(simulate(&table, &table, &toy_ssd(), &off_grid, &mut OverIssues).is_err());
}

/// Goal: a run whose IOCB size is not the scheduler table's is refused (`InvalidConfig`): the
/// policy counts IOCBs of `SimConfig::iocb_bytes` and prices them with the table's rows, so 4 MiB
/// IOCBs priced by 1 MiB rows ran at four times the table's bandwidth. Before, nothing checked.
#[test]
fn an_iocb_size_other_than_the_tables_is_refused() {
    let table = Profile::from_table(common::table()).unwrap();
    assert_eq!(table.iocb_bytes(), 1 << 20);
    let config =
        SimConfig { input_tokens: 2048, prefix_tokens: 1024, iocb_bytes: 4 << 20, decode_step_count: 0, queued_kernels_hide_latency: true };
    let mut policy = PolicyKind::SlackAware.build();
    let error = simulate(&table, &table, &toy_ssd(), &config, policy.as_mut()).unwrap_err();
    assert!(matches!(&error, SchedulerError::InvalidConfig { field, .. } if field == "iocb_bytes"), "{error}");
    let matching = SimConfig { iocb_bytes: 1 << 20, ..config };
    assert!(simulate(&table, &table, &toy_ssd(), &matching, policy.as_mut()).is_ok());
}

/// Goal: a decode context before the scheduler's table's first row is priced as that row, as
/// the runtime prices it (`Runtime::decode_step`; both call `Profile::decode_pricing_context`):
/// the simulated steps write. Before, the simulator wrote nothing in such a step (the comment
/// said "as the runtime does", which stopped being true in 012f997) while the runtime wrote. The
/// simulated GPU's own table (`truth`) still gives what the step takes.
#[test]
fn a_decode_context_before_the_policys_first_row_is_priced_as_that_row() {
    let truth = Profile::from_table(common::table()).unwrap();
    let mut late = common::table();
    for step in &mut late.decode_steps {
        step.context_tokens += 4096;
    }
    let late = Profile::from_table(late).unwrap();
    let first_row = late.table().decode_steps[0].context_tokens;
    assert_eq!(late.decode_pricing_context(2048), first_row);
    assert_eq!(late.decode_pricing_context(first_row + 1), first_row + 1);
    let config =
        SimConfig { input_tokens: 2048, prefix_tokens: 1024, iocb_bytes: 1 << 20, decode_step_count: 3, queued_kernels_hide_latency: true };
    let mut policy = PolicyKind::SlackAware.build();
    let late_run = simulate(&truth, &late, &toy_ssd(), &config, policy.as_mut()).unwrap();
    assert!(late_run.write_backlog_bytes_at_end < late_run.write_backlog_bytes_at_ttft, "{late_run:?}");
    // The late table's first row is the toy table's first row moved: the steps are priced alike.
    let mut policy = PolicyKind::SlackAware.build();
    let planned = simulate(&truth, &truth, &toy_ssd(), &config, policy.as_mut()).unwrap();
    assert!(planned.write_backlog_bytes_at_end < planned.write_backlog_bytes_at_ttft, "{planned:?}");
}

/// Goal: a table whose first decode row is past the request's context simulates when it is the
/// simulated GPU's own table too: the step is priced as the first row for its duration as for its
/// slack (`Profile::decode_pricing_context`, the runtime's rule). Import, `check` and the runtime
/// accept such a table (`check_decode_steps_can_write` counts that range), but the simulator took
/// the step's duration from `Profile::decode_step`, whose `OutOfRange` ended the run.
#[test]
fn a_table_whose_first_decode_row_is_past_the_input_simulates_as_its_own_truth() {
    let mut late = common::table();
    for step in &mut late.decode_steps {
        step.context_tokens += 4096;
    }
    let late = Profile::from_table(late).unwrap();
    late.check_decode_steps_can_write().unwrap();
    let config =
        SimConfig { input_tokens: 2048, prefix_tokens: 1024, iocb_bytes: 1 << 20, decode_step_count: 3, queued_kernels_hide_latency: true };
    let mut policy = PolicyKind::SlackAware.build();
    let run = simulate(&late, &late, &toy_ssd(), &config, policy.as_mut()).unwrap();
    assert!(run.write_backlog_bytes_at_end < run.write_backlog_bytes_at_ttft, "{run:?}");
    // Each of the 3 steps lasts the first row's 1000 µs (context 5120, priced as 5120).
    assert!((run.decode_us - 3.0 * 1000.0).abs() < 1e-6, "{run:?}");
}

/// Goal: an I/O job that starts late in a long run completes at the event the simulator computed
/// for it. Past 2^34 µs of simulated time a clock step is coarser than the float residue the
/// simulator snapped (1e-6 µs): `now + bytes_left / rate` could round short of the job's end, the
/// bytes left over then moved in a step that rounded to 0 µs, and the run spun to its event budget
/// and blamed the policy ("event budget exhausted"). Here decode steps of 1e9 µs (valid: a table
/// duration may reach 1e12 µs) leave no free SM before context 2068, so the one queued write IOCB
/// goes in step 20, at 2e10 µs, and 1 MiB at 7 GB/s does not end on a clock step.
#[test]
fn a_write_issued_past_2_pow_34_us_completes() {
    let mut table = common::table();
    table.decode_steps = vec![
        DecodeStep { context_tokens: 1024, duration_us: 1e9, free_sms: 0 },
        DecodeStep { context_tokens: 2068, duration_us: 1e9, free_sms: 4 },
    ];
    let table = Profile::from_table(table).unwrap();
    let ssd = SsdModel { write_bytes_per_s_per_device: 7e9, ..toy_ssd() };
    let config = SimConfig {
        input_tokens: 2048,
        prefix_tokens: 1024,
        iocb_bytes: 1 << 20,
        decode_step_count: 21,
        queued_kernels_hide_latency: true,
    };
    let mut policy = PolicyKind::SlackAware.build();
    let run = simulate(&table, &table, &ssd, &config, policy.as_mut()).unwrap();
    assert_eq!(run.write_backlog_bytes_at_ttft, 1 << 20, "{run:?}");
    assert_eq!(run.write_backlog_bytes_at_end, 0, "{run:?}");
    assert_eq!(run.decode_us, 21e9, "{run:?}");
    // Not written before step 20 (no free SM): the write ran past 2^34 µs.
    let before = SimConfig { decode_step_count: 20, ..config };
    let mut policy = PolicyKind::SlackAware.build();
    let run = simulate(&table, &table, &ssd, &before, policy.as_mut()).unwrap();
    assert_eq!(run.write_backlog_bytes_at_end, 1 << 20, "{run:?}");
}

/// Goal: the write predicate counts the contexts before the first decode row (priced as that
/// row) that requests reach (from the smallest profiled input, 1024 tokens here): a table whose
/// only writable row is the first, above the smallest input, can write; at or below it, it
/// cannot. Before, the predicate ignored that range.
#[test]
fn the_decode_write_predicate_counts_contexts_before_the_first_row() {
    let with_steps = |steps: &[(u32, u32)]| {
        let mut table = common::table();
        table.decode_steps =
            steps.iter().map(|&(context_tokens, free_sms)| DecodeStep { context_tokens, duration_us: 1000.0, free_sms }).collect();
        Profile::from_table(table).expect("valid as a table")
    };
    for (steps, accepted) in
        [(&[(2048, 4), (2049, 0)][..], true), (&[(1025, 4), (1026, 0)][..], true), (&[(1024, 4), (1025, 0)][..], false)]
    {
        match with_steps(steps).check_decode_steps_can_write() {
            Ok(()) if accepted => {}
            Err(error) if !accepted => assert!(error.to_string().contains("decode_steps.free_sms"), "{steps:?}: {error}"),
            other => panic!("{steps:?}: {other:?}"),
        }
    }
}

/// Goal: a table whose KV size per token makes the request's bytes pass 2^64 is refused
/// (`InvalidConfig`), never an arithmetic overflow (a panic in debug builds). The table file's
/// `kv_bytes_per_token_per_layer` is only checked > 0.
#[test]
fn kv_bytes_past_u64_are_refused_not_overflowed() {
    let config =
        SimConfig { input_tokens: 2048, prefix_tokens: 1024, iocb_bytes: 1 << 20, decode_step_count: 0, queued_kernels_hide_latency: true };
    let mut table = common::table();
    table.model.kv_bytes_per_token_per_layer = u64::MAX / 1000;
    let table = Profile::from_table(table).unwrap();
    let mut policy = PolicyKind::SlackAware.build();
    let error = simulate(&table, &table, &toy_ssd(), &config, policy.as_mut()).unwrap_err();
    assert!(matches!(&error, SchedulerError::InvalidConfig { field, .. } if field == "kv_bytes_per_token_per_layer"), "{error}");
    // Bytes that fit, carried writes that do not.
    let table = Profile::from_table(common::table()).unwrap();
    let carry = WriteCarry { queued_bytes: u64::MAX, ..WriteCarry::default() };
    let mut policy = PolicyKind::SlackAware.build();
    let error = simulate_carried(&table, &table, &toy_ssd(), &config, policy.as_mut(), &carry).unwrap_err();
    assert!(matches!(&error, SchedulerError::InvalidConfig { .. }), "{error}");
}

// ---------------------------------------------------------------------------------------------
// Timeline import

fn timeline(skip: Option<(u32, u32)>) -> String {
    let mut out = String::from("# toy timeline\nphase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used\n");
    for (input, prefix) in [(1024, 0), (1024, 1024), (2048, 0), (2048, 1024), (2048, 2048)] {
        if skip == Some((input, prefix)) {
            continue;
        }
        for layer in 0..common::LAYERS {
            let t = 5000.0 + 1000.0 * f64::from(layer);
            out.push_str(&format!("prefill,{input},{prefix},{layer},qkv_gemm,{t},{},12\n", t + 100.0));
            out.push_str(&format!("prefill,{input},{prefix},{layer},flash_attn_fwd,{},{},14\n", t + 100.0, t + 600.0));
            out.push_str(&format!("prefill,{input},{prefix},{layer},mlp,{},{},16\n", t + 650.0, t + 1000.0));
        }
    }
    out.push_str("decode,1024,,,decode_step,0,5000,10\ndecode,2048,,,decode_step,0,6000,10\n");
    out
}

/// SMs import reserves for I/O in these tests: the cost rows' smallest budget.
const IO_SMS: u32 = 2;

fn import(text: &str) -> scheduler::Result<Profile> {
    import_timeline(text, common::model(), common::gpu(), IO_SMS, common::io_costs(), "test", "test")
}

#[test]
fn timeline_import_derives_windows_and_attention_offset() {
    let profile = import(&timeline(None)).unwrap();
    let t = profile.table();
    assert_eq!((t.input_step_tokens, t.input_step_count, t.prefix_step_tokens), (1024, 2, 1024));
    let layer = &profile.bucket(2048, 1024).unwrap().layers[3];
    assert_eq!(layer.compute_duration_us, 1000.0);
    assert_eq!(layer.kv_needed_offset_us, 100.0);
    let windows: Vec<(f64, f64, u32)> = layer.slack_windows.iter().map(|w| (w.offset_us, w.duration_us, w.free_sms)).collect();
    // 16 − 12, 16 − 14, then the idle gap; the MLP's 16 SMs are clamped to 14, leaving the
    // 2 reserved for I/O.
    assert_eq!(windows, vec![(0.0, 100.0, 4), (100.0, 500.0, 2), (600.0, 50.0, 16), (650.0, 350.0, 2)]);
    assert!(t.compute_source.contains("2 of 16 SMs reserved for I/O"), "{}", t.compute_source);
    assert_eq!(profile.decode_step(2048).unwrap().duration_us, 6000.0);
    assert_eq!(profile.decode_step(2048).unwrap().free_sms, 6);
}

/// Goal: import reserves `io_sms` for I/O as the analytic model does: a timeline whose every
/// kernel, decode steps included, occupies the whole GPU still gives every decode step and every
/// layer `io_sms` free SMs (before: 0 free, no window at all, and a table the slack-aware
/// runtime refused). A reservation of 0 or of the whole GPU is refused.
#[test]
fn import_reserves_io_sms_on_a_timeline_that_fills_the_gpu() {
    let full = timeline(None).replace(",12\n", ",16\n").replace(",14\n", ",16\n").replace(",10\n", ",16\n");
    assert!(!full.contains(",12\n") && !full.contains(",10\n"), "{full}");
    let profile = import_timeline(&full, common::model(), common::gpu(), 4, common::io_costs(), "test", "test").unwrap();
    for step in &profile.table().decode_steps {
        assert_eq!(step.free_sms, 4, "{step:?}");
    }
    for bucket in &profile.table().buckets {
        for layer in &bucket.layers {
            assert!(layer.slack_windows.iter().any(|window| window.free_sms >= 4), "{layer:?}");
        }
    }
    for io_sms in [0, 16, 17] {
        let error = import_timeline(&full, common::model(), common::gpu(), io_sms, common::io_costs(), "test", "test").unwrap_err();
        assert!(matches!(&error, SchedulerError::InvalidConfig { field, .. } if field == "io_sms"), "{error}");
    }
}

/// Goal: one predicate says whether the slack-aware policy could ever write in a decode step;
/// `Runtime::new`, `tutti-profile check` and `import` all call it. A hand-made table with no
/// free SM anywhere is valid as a table and refused by the predicate; the toy table passes.
#[test]
fn the_decode_write_predicate_refuses_a_table_with_no_free_sms() {
    assert!(Profile::from_table(common::table()).unwrap().check_decode_steps_can_write().is_ok());
    let mut starved = common::table();
    for step in &mut starved.decode_steps {
        step.free_sms = 0;
    }
    for bucket in &mut starved.buckets {
        for layer in &mut bucket.layers {
            layer.slack_windows.clear();
        }
    }
    let profile = Profile::from_table(starved).expect("valid as a table");
    let error = profile.check_decode_steps_can_write().unwrap_err();
    assert!(error.to_string().contains("smallest write budget (2 SMs)") && error.to_string().contains("[0, 0]"), "{error}");
    // import refuses to write such a table: a reservation below the write budget leaves the
    // decode steps (16 SMs busy, clamped to 15) 1 SM where a write needs 2; the refusal names
    // the reservation too (`an_io_reservation_below_every_cost_row_budget_is_named_when_the_table_is_refused`).
    let full = timeline(None).replace(",10\n", ",16\n");
    let error = import_timeline(&full, common::model(), common::gpu(), 1, common::io_costs(), "test", "test").unwrap_err();
    assert!(error.to_string().contains("io_sms 1") && error.to_string().contains("smallest write budget"), "{error}");
}

/// Goal: an imported table whose cost rows of a kind have no budget at or below the SMs
/// reserved for I/O is, when refused, refused naming that mismatch (`io_sms`, the kind's smallest
/// `sm_budget`), with the refusal behind it. Budgets above `io_sms` take SMs compute may be
/// using: where every kernel fills the compute SMs, a decode step leaves only `io_sms` free and
/// no write on 8 SMs fits. Before, import with `io_sms` 4 and write rows only at 8 was refused
/// for its decode steps alone (`decode_steps.free_sms`, "fewer SMs free than the smallest write
/// budget"), which blamed the timeline. A table that works with such rows (kernels leaving 16
/// of 32 SMs free) is still accepted.
#[test]
fn an_io_reservation_below_every_cost_row_budget_is_named_when_the_table_is_refused() {
    let full = timeline(None).replace(",12\n", ",16\n").replace(",14\n", ",16\n").replace(",10\n", ",16\n");
    let mut rows_at_8 = common::io_costs();
    for row in rows_at_8.iter_mut().filter(|row| row.kind == IoKind::Write) {
        row.sm_budget *= 2;
    }
    rows_at_8.retain(|row| row.kind == IoKind::Read || row.sm_budget == 8);
    let error = import_timeline(&full, common::model(), common::gpu(), 4, rows_at_8.clone(), "test", "test").unwrap_err();
    let text = error.to_string();
    assert!(matches!(&error, SchedulerError::IoReservation { io_sms: 4, .. }), "{error}");
    assert!(text.contains("io_sms 4") && text.contains("smallest write sm_budget 8"), "{text}");
    assert!(text.contains("decode_steps.free_sms"), "the refusal behind it: {text}");
    // The refusal behind it is kept typed, as its source, not flattened into the text: a caller
    // walking the chain (anyhow's, tutti-profile's exit status) reaches the imported table's
    // refusal and the validation error under it.
    // (A boxed source is the box as the error: `Box<SchedulerError>`.)
    let behind = std::error::Error::source(&error).and_then(|cause| cause.downcast_ref::<Box<SchedulerError>>());
    assert!(matches!(behind.map(|cause| &**cause), Some(SchedulerError::ImportedTable { .. })), "source {behind:?} of {error:?}");
    let under = behind.and_then(|cause| std::error::Error::source(&**cause)).map(ToString::to_string).unwrap_or_default();
    assert!(under.contains("decode_steps.free_sms"), "{under}");
    // Reads alike: rows at 2 and 4, a reservation of 1 (the writes' too).
    let error = import_timeline(&full, common::model(), common::gpu(), 1, common::io_costs(), "test", "test").unwrap_err();
    let text = error.to_string();
    assert!(text.contains("io_sms 1") && text.contains("smallest read sm_budget 2") && text.contains("write sm_budget 2"), "{text}");
    // On 32 SMs the kernels (16 SMs) leave 16 free: the same rows are usable, and accepted.
    let mut gpu = common::gpu();
    gpu.sm_count = 32;
    import_timeline(&full, common::model(), gpu, 4, rows_at_8, "test", "test").unwrap();
}

/// Goal: a decode step of no time is no step a write can go in: the predicate refuses a table
/// whose every decode step lasts 0 µs (valid as a table: durations may be 0), as it refuses one
/// with no free SM. Before, it looked at free SMs only and passed it, and under slack-aware the
/// policy's window had no room (`room_us <= 0`): nothing was ever granted in a decode step.
/// A range of contexts writes when the row whose duration it takes (the one below) lasts.
#[test]
fn the_decode_write_predicate_refuses_decode_steps_of_no_time() {
    let with_durations = |durations: [f64; 2]| {
        let mut table = common::table();
        for (step, duration_us) in table.decode_steps.iter_mut().zip(durations) {
            step.duration_us = duration_us;
        }
        Profile::from_table(table).expect("valid as a table")
    };
    let error = with_durations([0.0, 0.0]).check_decode_steps_can_write().unwrap_err();
    assert!(error.to_string().contains("decode_steps.duration_us") && error.to_string().contains("[0.0, 0.0]"), "{error}");
    // Past the last row, the last row's step; between the rows, the first row's.
    with_durations([0.0, 2000.0]).check_decode_steps_can_write().expect("the last row lasts");
    with_durations([1000.0, 0.0]).check_decode_steps_can_write().expect("contexts between the rows take the first row's 1000 us");
}

/// Goal: the predicate asks for a range of contexts requests reach, not for a row. A writable
/// pair of rows needs a context strictly between them, and a writable last row must be at or
/// below the reach (twice the largest prefill input: 4096 tokens here) and below u32::MAX.
/// Before, rows {1024: 0 free, u32::MAX: 4 free} (only a context of exactly u32::MAX could
/// write) and {1024: 4, 1025: 4, 2048: 0} (only 1024 and 1025) passed.
#[test]
fn the_decode_write_predicate_asks_for_contexts_off_the_rows_within_reach() {
    let with_steps = |steps: &[(u32, u32)]| {
        let mut table = common::table();
        table.decode_steps =
            steps.iter().map(|&(context_tokens, free_sms)| DecodeStep { context_tokens, duration_us: 1000.0, free_sms }).collect();
        Profile::from_table(table).expect("valid as a table")
    };
    assert_eq!(with_steps(&[(1024, 4)]).decode_context_reach(), 4096);
    for (steps, accepted) in [
        (&[(1024, 0), (u32::MAX, 4)][..], false),
        (&[(1024, 0), (u32::MAX - 1, 4)][..], false),
        (&[(1024, 4), (1025, 4), (2048, 0)][..], false),
        (&[(1024, 4), (1026, 4), (2048, 0)][..], true),
        // Past a last row at the reach itself no context is reached: only the row's own.
        (&[(1024, 0), (4096, 4)][..], false),
        (&[(1024, 0), (4095, 4)][..], true),
        (&[(1024, 0), (4097, 4)][..], false),
        (&[(1024, 0), (4095, 4), (4097, 4)][..], true),
        (&[(1024, 0), (4096, 4), (4098, 4)][..], false),
    ] {
        match with_steps(steps).check_decode_steps_can_write() {
            Ok(()) if accepted => {}
            Err(error) if !accepted => assert!(error.to_string().contains("decode_steps.free_sms"), "{steps:?}: {error}"),
            other => panic!("{steps:?}: {other:?}"),
        }
    }
}

/// Goal: layers of one run that overlap in time are refused, naming the bucket, the run and the
/// layers. Each layer's span and windows come from its own kernels only, so when layer 1 starts
/// before layer 0 ends, layer 0's windows showed SMs layer 1 was using and the layers' sums
/// exceeded the real time (here 600 + 600 µs for 1100 µs).
#[test]
fn layers_overlapping_in_time_are_refused() {
    let model = scheduler::table::ModelIdentity { name: "two".into(), layer_count: 2, kv_bytes_per_token_per_layer: 1024 };
    let gpu = scheduler::table::GpuIdentity { name: "g".into(), sm_count: 132 };
    let csv = |layer_1_start: f64| {
        format!(
            "phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used\n\
             prefill,1024,0,0,qkv,0,100,100\nprefill,1024,0,0,attn,100,600,100\n\
             prefill,1024,0,1,qkv,{layer_1_start},{},100\nprefill,1024,0,1,attn,{},{},100\n\
             prefill,1024,1024,0,qkv,0,100,100\nprefill,1024,1024,0,attn,100,600,100\n\
             prefill,1024,1024,1,qkv,600,700,100\nprefill,1024,1024,1,attn,700,1200,100\n\
             decode,1024,,,step,0,1000,100\n",
            layer_1_start + 100.0,
            layer_1_start + 100.0,
            layer_1_start + 600.0
        )
    };
    let error = import_timeline(&csv(500.0), model.clone(), gpu.clone(), 4, common::io_costs(), "test", "test").unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, SchedulerError::Timeline { .. }), "{text}");
    assert!(
        text.contains("bucket(input_tokens=1024, prefix_tokens=0) run 0") && text.contains("layer 1") && text.contains("layer 0"),
        "{text}"
    );
    // Touching layers are fine, and so is an overlap of a profiler's rounding (up to 1 µs);
    // 2 µs is not.
    import_timeline(&csv(600.0), model.clone(), gpu.clone(), 4, common::io_costs(), "test", "test").unwrap();
    import_timeline(&csv(599.999), model.clone(), gpu.clone(), 4, common::io_costs(), "test", "test").unwrap();
    import_timeline(&csv(598.0), model, gpu, 4, common::io_costs(), "test", "test").unwrap_err();
}

/// Goal: two full-grid decode kernels that overlap by a profiler's rounding (PyTorch's trace
/// keeps three decimals, so back-to-back kernels can seem to overlap by 0.001 µs) leave the step
/// `io_sms` free, as the reservation promises: at no instant can compute use more than
/// `sm_count − io_sms` SMs. Before, each kernel was clamped but their sum was not (32 SMs busy
/// on 16), the step had 0 free SMs, and import refused the table ("smallest write budget").
#[test]
fn overlapping_full_grid_decode_kernels_keep_the_io_sms_free() {
    let rounded = timeline(None).replace(
        "decode,1024,,,decode_step,0,5000,10\ndecode,2048,,,decode_step,0,6000,10\n",
        "decode,1024,,,a,0,10.001,16\ndecode,1024,,,b,10.000,5000,16\ndecode,2048,,,a,0,10.001,16\ndecode,2048,,,b,10.000,6000,16\n",
    );
    assert!(rounded.contains("10.001"), "{rounded}");
    let profile = import(&rounded).unwrap();
    let steps = &profile.table().decode_steps;
    assert_eq!(steps.iter().map(|step| (step.context_tokens, step.free_sms)).collect::<Vec<_>>(), vec![(1024, IO_SMS), (2048, IO_SMS)]);
    assert_eq!(steps[0].duration_us, 5000.0);
}

#[test]
fn overlapping_kernels_whose_sms_sum_past_u32_leave_only_the_io_sms() {
    // Goal: two concurrent kernels of 3e9 SMs each on a GPU of 4e9 (each row within the GPU,
    // so accepted) occupy every compute SM and leave exactly the `io_sms` reserved for I/O:
    // their sum used to overflow a u32 (a panic in debug, in release a wrapped count and slack
    // that does not exist). (Until the sum was clamped to the compute SMs as each kernel is,
    // this expected no window at all there, against the reservation's promise.)
    let mut lines: Vec<String> = timeline(None).lines().map(str::to_string).collect();
    assert_eq!(lines[2], "prefill,1024,0,0,qkv_gemm,5000,5100,12");
    lines[2] = "prefill,1024,0,0,qkv_gemm,5000,5100,3000000000".into();
    lines.insert(3, "prefill,1024,0,0,side_copy,5000,5100,3000000000".into());
    let gpu = scheduler::table::GpuIdentity { name: "huge".into(), sm_count: 4_000_000_000 };
    let profile = import_timeline(&lines.join("\n"), common::model(), gpu, IO_SMS, common::io_costs(), "test", "test").unwrap();
    let layer = &profile.bucket(1024, 0).unwrap().layers[0];
    let first = layer.slack_windows.first().map(|window| (window.offset_us, window.duration_us, window.free_sms));
    assert_eq!(first, Some((0.0, 100.0, IO_SMS)), "{:?}", layer.slack_windows);
}

#[test]
fn timeline_errors_name_the_line_or_bucket() {
    let error = import(&timeline(Some((2048, 1024)))).unwrap_err();
    assert!(
        matches!(&error, SchedulerError::ImportedTable { input_step_tokens: 1024, prefix_step_tokens: 1024, source }
            if matches!(**source, SchedulerError::MissingBucket { input_tokens: 2048, prefix_tokens: 1024 })),
        "{error}"
    );

    let with_line = |line_no: usize, replacement: &str| {
        let mut lines: Vec<String> = timeline(None).lines().map(str::to_string).collect();
        lines[line_no - 1] = replacement.to_string();
        import(&lines.join("\n")).unwrap_err()
    };
    let error = with_line(3, "prefill,1024,0,0,qkv_gemm,5000,NaN,12");
    assert!(matches!(error, SchedulerError::Timeline { line: 3, .. }), "{error}");
    let error = with_line(3, "prefill,1024,0,0,qkv_gemm,5000,4000,12");
    assert!(error.to_string().contains("end_us is before start_us"), "{error}");
    let error = with_line(3, "prefill,1024,0,9,qkv_gemm,5000,5100,12");
    assert!(error.to_string().contains("layer 9"), "{error}");
    let error = with_line(3, "prefill,1024,0,0,qkv_gemm,-1,5100,12");
    assert!(error.to_string().contains("start_us"), "{error}");
    let error = with_line(3, "prefill,1024,0,0,qkv_gemm,5000,5100,99");
    assert!(error.to_string().contains("sms_used"), "{error}");
    let error = with_line(2, "phase,input,prefix");
    assert!(matches!(error, SchedulerError::Timeline { line: 2, .. }), "{error}");
    let error = with_line(3, "warmup,1024,0,0,qkv_gemm,5000,5100,12");
    assert!(error.to_string().contains("warmup"), "{error}");
    // A prefix longer than its prompt is off the grid: named on its line, not as a bucket "not
    // strictly increasing" in the table built from the timeline.
    let error = with_line(3, "prefill,1024,2048,0,qkv_gemm,5000,5100,12");
    assert!(matches!(&error, SchedulerError::Timeline { line: 3, reason } if reason.contains("prefix_tokens 2048")), "{error}");

    let no_attention = timeline(None).replace("flash_attn_fwd", "gemm");
    let error = import(&no_attention).unwrap_err();
    assert!(error.to_string().contains("no attention kernel"), "{error}");
    assert!(error.to_string().contains("bucket(input_tokens=1024, prefix_tokens=0) layer 0"), "{error}");
    assert!(import("").is_err());
}

/// Goal: a decode step whose kernels span no time (one zero-length kernel, say: a profiler's
/// record of a launch that never ran) is refused naming its context and run, not folded in.
/// Folded, it gave a step of 0 µs with every SM free, and the shortest of the context's steps
/// made the context's step 0 µs, silently: the 5000 µs step measured beside it was lost.
#[test]
fn a_decode_step_of_no_time_is_refused_naming_its_context_and_run() {
    let mut text = String::new();
    for line in timeline(None).lines() {
        match line {
            "" => {}
            _ if line.starts_with('#') => text.push_str(&format!("{line}\n")),
            _ if line.starts_with("phase,") => text.push_str(&format!("{line},run\n")),
            _ => text.push_str(&format!("{line},0\n")),
        }
    }
    let measured = format!("{text}decode,4096,,,decode_step,0,5000,10,0\n");
    assert_eq!(import(&measured).unwrap().decode_step(4096).unwrap().duration_us, 5000.0);
    let degenerate = format!("{measured}decode,4096,,,decode_step,100000,100000,10,7\n");
    let error = import(&degenerate).unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, SchedulerError::Timeline { .. }), "{error}");
    assert!(text.contains("context 4096") && text.contains("run 7") && text.contains("0 us"), "{text}");
}

/// Goal: repeated runs of a bucket, and repeated decode steps at one context, marked by the
/// optional `run` column, become one figure each on the conservative side: per context the
/// shortest step and the fewest free SMs; per layer the shortest duration, the earliest KV need
/// and the windows of every run intersected. Keyed by context alone, two steps of 5000 µs at 0
/// and at 100000 µs became one step of 105000 µs (slack over-estimated twentyfold), and two
/// runs of a bucket one layer spanning both.
#[test]
fn timeline_runs_keep_the_conservative_figure() {
    let mut text = String::new();
    for line in timeline(None).lines() {
        match line {
            "" => {}
            _ if line.starts_with('#') => text.push_str(&format!("{line}\n")),
            _ if line.starts_with("phase,") => text.push_str(&format!("{line},run\n")),
            _ => text.push_str(&format!("{line},0\n")),
        }
    }
    text.push_str("decode,4096,,,decode_step,0,5000,10,0\ndecode,4096,,,decode_step,100000,105000,10,1\n");
    // A second run of bucket (1024, 0): later, other SMs in use, and its MLP 200 µs longer.
    for layer in 0..common::LAYERS {
        let t = 200_000.0 + 2000.0 * f64::from(layer); // its layers are 1200 µs long
        text.push_str(&format!("prefill,1024,0,{layer},qkv_gemm,{t},{},14,1\n", t + 100.0));
        text.push_str(&format!("prefill,1024,0,{layer},flash_attn_fwd,{},{},14,1\n", t + 100.0, t + 600.0));
        text.push_str(&format!("prefill,1024,0,{layer},mlp,{},{},12,1\n", t + 650.0, t + 1200.0));
    }
    let profile = import(&text).unwrap();
    let step = profile.decode_step(4096).unwrap();
    assert!(step.duration_us <= 5000.0, "{step:?}");
    assert_eq!((step.duration_us, step.free_sms), (5000.0, 6));
    let layer = &profile.bucket(1024, 0).unwrap().layers[2];
    assert_eq!((layer.compute_duration_us, layer.kv_needed_offset_us), (1000.0, 100.0));
    let windows: Vec<(f64, f64, u32)> = layer.slack_windows.iter().map(|w| (w.offset_us, w.duration_us, w.free_sms)).collect();
    // Run 0: 4 free, then 2, the gap, the 2 reserved SMs under the MLP; run 1: 2 free, the
    // gap, then 4.
    assert_eq!(windows, vec![(0.0, 100.0, 2), (100.0, 500.0, 2), (600.0, 50.0, 16), (650.0, 350.0, 2)]);
    // Buckets with one run are as before.
    assert_eq!(profile.bucket(2048, 1024).unwrap().layers[3].compute_duration_us, 1000.0);

    // With the column, every row carries it.
    let short = text.replacen("decode,4096,,,decode_step,0,5000,10,0", "decode,4096,,,decode_step,0,5000,10", 1);
    let error = import(&short).unwrap_err();
    assert!(matches!(error, SchedulerError::Timeline { .. }) && error.to_string().contains("8 fields, expected 9"), "{error}");
    // A run missing a layer is named.
    let partial: String = text
        .lines()
        .filter(|line| !(line.starts_with("prefill,1024,0,3,") && line.ends_with(",1")))
        .map(|line| format!("{line}\n"))
        .collect();
    let error = import(&partial).unwrap_err();
    assert!(error.to_string().contains("bucket(input_tokens=1024, prefix_tokens=0) run 1 layer 3: no kernels"), "{error}");
}

// ---------------------------------------------------------------------------------------------
// I/O probe driver (with a fake probe standing in for a backend: these rows are not measured)

struct FakeProbe {
    calls: u32,
}

impl IoCostProbe for FakeProbe {
    fn describe(&self) -> String {
        "fake".into()
    }
    fn measure(&mut self, kind: IoKind, iocb_count: u32, sm_budget: u32) -> scheduler::Result<ProbeSample> {
        self.calls += 1;
        let per_iocb_us = if kind == IoKind::Read { 100.0 } else { 250.0 } * 4.0 / f64::from(sm_budget);
        // Noise: the 4-IOCB point reads fast once in a while; the median and the monotone
        // clamp must absorb it.
        let noise = if iocb_count == 4 && self.calls.is_multiple_of(3) { -300.0 } else { 0.0 };
        Ok(ProbeSample { duration_us: per_iocb_us * f64::from(iocb_count) + noise + 10.0, bytes: u64::from(iocb_count) << 20 })
    }
}

#[test]
fn probe_grid_yields_a_valid_sorted_cost_table() {
    let mut probe = FakeProbe { calls: 0 };
    let grid = IoGrid { iocb_counts: vec![8, 1, 4, 2, 2], sm_budgets: vec![4, 2], repetitions: 3 };
    let mut progress = Vec::new();
    let rows = measure_io_costs(&mut probe, &grid, &mut |done, total| progress.push((done, total))).unwrap();
    assert_eq!(rows.len(), 16);
    assert_eq!(progress.last(), Some(&(16, 16)));
    assert_eq!(probe.calls, 48);
    let mut table = common::table();
    table.io_costs = rows;
    let profile = Profile::from_table(table).expect("probe rows form a valid table");
    assert_eq!(profile.io_duration_us(IoKind::Read, 4, 4).unwrap(), 410.0);

    struct Broken;
    impl IoCostProbe for Broken {
        fn describe(&self) -> String {
            "broken".into()
        }
        fn measure(&mut self, _: IoKind, _: u32, _: u32) -> scheduler::Result<ProbeSample> {
            Ok(ProbeSample { duration_us: f64::NAN, bytes: 1 })
        }
    }
    let error = measure_io_costs(&mut Broken, &grid, &mut |_, _| {}).unwrap_err();
    assert!(error.to_string().contains("kind=Read iocb_count=1 sm_budget=2"), "{error}");
    let empty = IoGrid { iocb_counts: vec![], ..grid };
    assert!(measure_io_costs(&mut FakeProbe { calls: 0 }, &empty, &mut |_, _| {}).is_err());
}
