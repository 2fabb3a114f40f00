//! The loop of `benches/driver_overhead.rs` (32 × 4 KiB reads per batch, one doorbell, one
//! reap, against the software controller's no-storage mode) for a fixed number of batches and
//! without criterion: the program to run under callgrind, whose instruction counts do not
//! depend on the machine's noise.
//!
//! ```text
//! cargo build --release -p tutti-benches --example driver_path
//! valgrind --tool=callgrind --toggle-collect='*driver_path::driver_batch*' \
//!     target/release/examples/driver_path 2000
//! ```
//!
//! Only `driver_batch` (the driver's submit, doorbell and reap, as the criterion bench times
//! them) is counted; the wait for the controller thread is outside it. Instructions per command
//! = the collected total / (batches × 32).
//!
//! Run natively it also prints the median and the minimum of the per-batch times (per command):
//! on a loaded machine criterion's mean takes every preemption of the bench thread into the
//! figure, while a batch lasts a few microseconds and the median batch is one nobody preempted.
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::{Controller, ControllerConfig, DataSegment, DeviceBackend, IoQueuePair, Lba, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice};

const BATCH: usize = 32;

/// The counted part: submit 32 reads and ring once (`reap == false`), or reap all 32.
#[inline(never)]
fn driver_batch(queue: &mut IoQueuePair, namespace: NamespaceId, segments: &[[DataSegment; 1]], lba: &mut u64, blocks: u64, reap: bool) {
    if reap {
        let reaped = queue.reap(BATCH, |completion| assert!(completion.status.is_ok())).expect("reap");
        assert_eq!(reaped, BATCH);
        return;
    }
    for segment in segments {
        queue.submit_read(namespace, Lba(*lba % blocks), segment, 0).expect("submit");
        *lba += 1;
    }
    queue.ring_doorbell().expect("doorbell");
}

fn main() {
    let batches: u64 = std::env::args().nth(1).map_or(2000, |text| text.parse().expect("batches: a number"));
    let device = EmuDevice::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 64 << 20 }).with_no_storage(true))
        .expect("software controller");
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Controller::init(backend, ControllerConfig::default()).expect("bring-up");
    let namespace = controller.namespaces()[0];
    let mut queue = controller.create_io_queue_pair(256).expect("queue pair");
    let buffer = controller.dma().allocate(BATCH * 4096).expect("buffer");
    let segments: Vec<[DataSegment; 1]> =
        (0..BATCH).map(|index| [DataSegment::new(buffer.iova().checked_add(index as u64 * 4096).expect("iova"), 4096)]).collect();
    let mut lba = 0u64;
    let mut batch_ns: Vec<u64> = Vec::with_capacity(batches as usize);
    for _ in 0..batches {
        let posted_before = device.stats().completions_posted;
        let started = Instant::now();
        driver_batch(&mut queue, namespace.id, &segments, &mut lba, namespace.size_blocks, false);
        let mut driver_time = started.elapsed();
        let deadline = Instant::now() + Duration::from_secs(60);
        while device.stats().completions_posted < posted_before + BATCH as u64 {
            assert!(Instant::now() < deadline, "controller did not complete the batch");
            std::thread::yield_now();
        }
        let started = Instant::now();
        driver_batch(&mut queue, namespace.id, &segments, &mut lba, namespace.size_blocks, true);
        driver_time += started.elapsed();
        batch_ns.push(driver_time.as_nanos() as u64);
    }
    batch_ns.sort_unstable();
    let per_command = |ns: u64| ns as f64 / BATCH as f64;
    println!(
        "{batches} batches of {BATCH} x 4 KiB reads ({} commands): driver time per command median {:.1} ns, minimum {:.1} ns",
        batches * BATCH as u64,
        per_command(batch_ns[batch_ns.len() / 2]),
        per_command(batch_ns[0])
    );
}
