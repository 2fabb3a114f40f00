//! The runtime's own CPU cost per layer boundary (issue 13): `before_layer` less the time it
//! waits for the layer's KV, plus `after_layer`, for requests of 2 to 60 cached blocks. The
//! target is a cost that does not grow with the blocks of the request: a boundary is O(layers +
//! queued stores) of decisions and one prepared IOCB issue per layer, never per-block work.
//!
//! The stack is the runtime's test stack (tests/common): 4 layers, 4 KiB objects, a memory-backed
//! software controller without the timing model, the CPU executor, the slack-aware policy. Every
//! measured request hits all its blocks (stored once before measuring), so each layer issues one
//! read.
//!
//! Run: `cargo bench -p tutti-runtime --bench boundary`

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use objstore::KvRequest;
use tutti_runtime::PolicyChoice;

fn boundaries(c: &mut Criterion) {
    let layers = common::geometry().layers;
    let mut group = c.benchmark_group("runtime_boundary");
    group.throughput(Throughput::Elements(u64::from(2 * layers)));
    for blocks in [2u32, 8, 32, 60] {
        let mut stack = common::stack(common::config(PolicyChoice::SlackAware), None);
        let tokens: Vec<u32> = (0..blocks * common::BLOCK_TOKENS).map(|i| i.wrapping_mul(2_654_435_761) ^ blocks).collect();
        let engine_blocks: Vec<u32> = (0..blocks).collect();
        common::prefill(&mut stack, &tokens, &engine_blocks).expect("store the prompt");
        stack.runtime.drain().expect("commit it");
        assert_eq!(stack.runtime.lookup(&tokens), blocks as usize, "every block cached before measuring");
        group.bench_with_input(BenchmarkId::new("blocks", blocks), &blocks, |bench, _| {
            bench.iter_custom(|iterations| {
                let mut spent = Duration::ZERO;
                for _ in 0..iterations {
                    let start = stack.runtime.begin_prefill(&KvRequest { tokens: &tokens, block_ids: &engine_blocks }).expect("begin");
                    assert_eq!(start.cached_blocks, blocks as usize);
                    for layer in 0..layers {
                        let before = Instant::now();
                        let waited = stack.runtime.before_layer(start.id, layer).expect("before_layer");
                        spent += before.elapsed().saturating_sub(waited);
                        let after = Instant::now();
                        stack.runtime.after_layer(start.id, layer).expect("after_layer");
                        spent += after.elapsed();
                    }
                    stack.runtime.end_prefill(start.id).expect("end_prefill");
                }
                spent
            });
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    targets = boundaries
}
criterion_main!(benches);
