//! The scheduler's own decision at a layer boundary (issue 13): `IoPolicy::plan_layer` for each
//! policy, Llama-3.1-8B on the analytic H100 table, one 8192-token prompt whose cached prefix is
//! 2 to 512 blocks of 16 tokens. The target is a decision whose cost does not grow with the
//! blocks of the request: the view the runtime hands over counts IOCBs per layer, and a larger
//! prefix only makes those counts larger. (The runtime bench `runtime_boundary` times a whole
//! boundary, which also builds the layer's per-block NVMe commands.)
//!
//! Run: `cargo bench -p scheduler --bench plan_layer`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use scheduler::analytic::{build_table, AnalyticGrid, GpuSpec, ModelConfig};
use scheduler::policy::{LayerView, PolicyKind};
use scheduler::ssd::SsdModel;
use scheduler::table::Profile;

const PROMPT_TOKENS: u32 = 8192;
const BLOCK_TOKENS: u32 = 16;
const IOCB_BYTES: u64 = 1 << 20;
const IO_SMS: u32 = 4;

fn profile(model: &ModelConfig) -> Profile {
    let grid = AnalyticGrid {
        input_step_tokens: PROMPT_TOKENS,
        input_step_count: 1,
        prefix_step_tokens: BLOCK_TOKENS,
        io_sms: IO_SMS,
        decode_step_tokens: PROMPT_TOKENS / 8,
    };
    let io_costs = SsdModel::tutti_two_ssds().cost_table(IOCB_BYTES, 4096, &[IO_SMS]).expect("cost table");
    let table = build_table(model, &GpuSpec::h100(), &grid, io_costs, "analytic (bench)").expect("analytic table");
    Profile::from_table(table).expect("valid table")
}

fn plan_layer(c: &mut Criterion) {
    let model = ModelConfig::llama3_8b();
    let table = profile(&model);
    let layers = model.layer_count as usize;
    // Mid-prefill: the layers before `layer` issued, the rest not; a store of the new tokens
    // queued, one write layer in flight.
    let layer = model.layer_count / 2;
    let mut group = c.benchmark_group("plan_layer");
    for policy in PolicyKind::ALL {
        for blocks in [2u32, 32, 128, 512] {
            let prefix_tokens = blocks * BLOCK_TOKENS;
            let per_layer = u32::try_from((u64::from(prefix_tokens) * model.kv_bytes_per_token_per_layer()).div_ceil(IOCB_BYTES))
                .expect("IOCBs per layer fit u32");
            let mut unissued = vec![per_layer; layers];
            unissued[..layer as usize].fill(0);
            let mut planner = policy.build();
            group.bench_with_input(BenchmarkId::new(policy.name(), blocks), &blocks, |bench, _| {
                bench.iter(|| {
                    let view = LayerView {
                        table: &table,
                        input_tokens: PROMPT_TOKENS,
                        prefix_tokens,
                        layer,
                        unissued_read_iocbs: black_box(&unissued),
                        outstanding_read_iocbs: per_layer,
                        outstanding_reads_by_budget: &[],
                        outstanding_read_kernels: 1,
                        outstanding_write_iocbs: 8,
                        outstanding_write_kernels: 1,
                        in_flight_write_iocbs: 8,
                        in_flight_write_sm_budget: 0,
                        queued_write_iocbs: 64,
                    };
                    black_box(planner.plan_layer(&view).expect("plan"))
                });
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
    targets = plan_layer
}
criterion_main!(benches);
