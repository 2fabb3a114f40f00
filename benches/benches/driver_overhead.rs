//! Driver CPU time per 4 KiB read command, submitted and reaped in batches of 32, against the
//! software controller's no-storage mode (issue 2, benchmark a).
//!
//! What is timed: for each batch, the driver thread's own work — 32 `submit_read` calls plus one
//! doorbell, and later one `reap` that consumes all 32 completions — and nothing else: the wait
//! for the emulated controller to post the completions is excluded (the bench waits on the
//! controller's counter, untimed, before reaping). So the figure is the driver's cost per command.
//!
//! What it should reach and why: SPDK spends ~72 ns of CPU per I/O on one core; our target is
//! ≤ 72 ns per command (issue 16). On a loaded machine criterion's mean takes in every
//! preemption; `examples/driver_path.rs` runs the same loop and prints the per-batch median and
//! minimum, and is the program to count instructions of under callgrind. Per command the driver plans the data pointer, builds a 64-byte entry,
//! copies it into the SQ and, at reap time, loads one dword with Acquire, copies 16 bytes and
//! frees a slot — a few dozen nanoseconds each — plus the doorbell writes amortised over 32.
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nvme_driver::{Controller, ControllerConfig, DataSegment, DeviceBackend, Lba};
use nvme_emu::{Backing, EmuConfig, EmuDevice};

const BATCH: usize = 32;

fn bench(c: &mut Criterion) {
    let device = EmuDevice::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 64 << 20 }).with_no_storage(true))
        .expect("software controller");
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Controller::init(backend, ControllerConfig::default()).expect("bring-up");
    let namespace = controller.namespaces()[0];
    let mut queue = controller.create_io_queue_pair(256).expect("queue pair");
    let buffer = controller.dma().allocate(BATCH * 4096).expect("buffer");
    let segments: Vec<[DataSegment; 1]> =
        (0..BATCH).map(|index| [DataSegment::new(buffer.iova().checked_add(index as u64 * 4096).expect("iova"), 4096)]).collect();
    let blocks = namespace.size_blocks;

    let mut group = c.benchmark_group("driver_overhead");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.bench_function("read_4KiB_batch32_no_storage", |b| {
        b.iter_custom(|batches| {
            let mut driver_time = Duration::ZERO;
            let mut lba = 0u64;
            for _ in 0..batches {
                let posted_before = device.stats().completions_posted;
                let started = Instant::now();
                for segment in &segments {
                    queue.submit_read(namespace.id, Lba(lba % blocks), segment, 0).expect("submit");
                    lba += 1;
                }
                queue.ring_doorbell().expect("doorbell");
                driver_time += started.elapsed();
                let deadline = Instant::now() + Duration::from_secs(5);
                while device.stats().completions_posted < posted_before + BATCH as u64 {
                    assert!(Instant::now() < deadline, "controller did not complete the batch");
                    std::hint::spin_loop();
                }
                let started = Instant::now();
                let reaped = queue.reap(BATCH, |completion| assert!(completion.status.is_ok())).expect("reap");
                driver_time += started.elapsed();
                assert_eq!(reaped, BATCH);
            }
            driver_time
        })
    });
    group.finish();
    println!("configuration: software controller (no-storage mode), 1 I/O queue pair of depth 256, {BATCH} x 4 KiB reads per batch, SGL data pointers");
}

criterion_group!(benches, bench);
criterion_main!(benches);
