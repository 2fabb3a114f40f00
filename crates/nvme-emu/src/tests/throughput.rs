//! Throughput of the controller thread (ignored by default: a measurement, not a check).
//! Run: `cargo test -p nvme-emu --release -- --ignored --nocapture throughput`.

use std::time::{Duration, Instant};

use nvme_driver::spec::SubmissionEntry;
use nvme_driver::{Lba, NamespaceId};

use super::harness::{block_count, status_of, with_sgl, TestHost};
use crate::{Backing, EmuConfig};

fn measure(label: &str, config: EmuConfig, write: bool, block_bytes: usize, queue_depth: usize) {
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 64);
    let buffers: Vec<_> = (0..queue_depth).map(|_| host.buffer(block_bytes)).collect();
    let blocks = (block_bytes / 4096) as u32;
    let span_blocks = (64u64 << 20) / 4096 / u64::from(blocks);
    let mut next = 0u64;
    let mut entry_for = |index: usize| {
        let lba = Lba((next % span_blocks) * u64::from(blocks));
        next += 1;
        let entry = if write {
            SubmissionEntry::write(NamespaceId(1), lba, block_count(blocks), false)
        } else {
            SubmissionEntry::read(NamespaceId(1), lba, block_count(blocks))
        };
        with_sgl(entry, &buffers[index], block_bytes as u32)
    };
    for index in 0..queue_depth {
        TestHost::push(&mut queue, entry_for(index));
    }
    host.ring_submission(&queue);
    let started = Instant::now();
    let mut completed = 0u64;
    while started.elapsed() < Duration::from_millis(700) {
        // Busy-poll (the harness's reap sleeps between polls and would measure itself).
        let deadline = Instant::now() + super::harness::DEADLINE;
        let completion = loop {
            if let Some(completion) = TestHost::try_reap(&mut queue) {
                break completion;
            }
            assert!(Instant::now() < deadline, "no completion");
            std::hint::spin_loop();
        };
        host.ring_completion(&queue);
        assert_eq!(status_of(&completion), Ok(()));
        completed += 1;
        TestHost::push(&mut queue, entry_for((completed as usize) % queue_depth));
        host.ring_submission(&queue);
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{label}: {} {} KiB QD{queue_depth}: {:.0} IOPS, {:.0} MB/s",
        if write { "write" } else { "read" },
        block_bytes / 1024,
        completed as f64 / seconds,
        completed as f64 * block_bytes as f64 / seconds / 1e6
    );
}

#[test]
#[ignore = "measurement; run explicitly with --ignored --nocapture"]
fn throughput() {
    if let Ok(only) = std::env::var("EMU_THROUGHPUT_ONLY") {
        // e.g. EMU_THROUGHPUT_ONLY=cached-write: one case, for profiling.
        if only == "cached-write" {
            measure("memory", EmuConfig::default().with_backing(Backing::Memory { bytes: 64 << 20 }), true, 4096, 32);
        }
        return;
    }
    let memory = || EmuConfig::default().with_backing(Backing::Memory { bytes: 64 << 20 });
    let path = std::env::temp_dir().join(format!("nvme-emu-throughput-{}", std::process::id()));
    let file = || EmuConfig::default().with_backing(Backing::File { path: path.clone(), create_bytes: Some(64 << 20) });
    for (block, depth) in [(4096, 32), (128 << 10, 32)] {
        measure("memory", memory(), false, block, depth);
        measure("memory", memory(), true, block, depth);
        measure("memory (no cache)", memory().with_volatile_write_cache(false), true, block, depth);
        measure("memory no-storage", memory().with_no_storage(true), false, block, depth);
        measure("file", file(), false, block, depth);
        measure("file (no cache)", file().with_volatile_write_cache(false), true, block, depth);
    }
    let _ = std::fs::remove_file(&path);
}
