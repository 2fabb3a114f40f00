//! Fuzzes what the driver reads from a device: completion queue entries (garbage phase bits,
//! unknown or duplicated command ids, wrong SQ ids), register values (all ones, CFS), and
//! Identify Controller / Namespace data. The driver must return errors, never panic or hang.
#![no_main]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use nvme_driver::hw::{DmaAllocator, DmaPool, RegisterIo};
use nvme_driver::spec::identify::parse_active_namespaces;
use nvme_driver::spec::{IdentifyController, IdentifyNamespace, SubmissionEntry, IDENTIFY_BYTES};
use nvme_driver::{NamespaceId, QueueId, QueuePair};

/// A register space whose reads come from the fuzz input (CSTS may say anything).
struct FuzzRegisters {
    values: Vec<u32>,
    cursor: AtomicUsize,
}

impl RegisterIo for FuzzRegisters {
    fn len(&self) -> usize {
        0x2000
    }
    fn read32(&self, _offset: usize) -> u32 {
        let index = self.cursor.fetch_add(1, Ordering::Relaxed);
        self.values.get(index % self.values.len().max(1)).copied().unwrap_or(u32::MAX)
    }
    fn write32(&self, _offset: usize, _value: u32) {}
    fn read64(&self, offset: usize) -> u64 {
        u64::from(self.read32(offset)) | u64::from(self.read32(offset + 4)) << 32
    }
    fn write64(&self, _offset: usize, _value: u64) {}
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let (header, rest) = data.split_at(8);
    let depth = u32::from(header[0] % 64).max(2);
    let submitted = usize::from(header[1]) % depth as usize;

    // Identify parsers on the same bytes (padded to 4 KiB): errors are fine, panics are not.
    let mut identify = rest.to_vec();
    identify.resize(IDENTIFY_BYTES, 0);
    let _ = IdentifyController::parse(&identify);
    if let Ok(namespace) = IdentifyNamespace::parse(&identify) {
        let _ = namespace.block_size_bytes();
    }
    let _ = IdentifyController::parse(rest);
    let _ = parse_active_namespaces(rest);

    let values: Vec<u32> = header.chunks_exact(4).map(|chunk| u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]])).collect();
    let registers: Arc<dyn RegisterIo> = Arc::new(FuzzRegisters { values, cursor: AtomicUsize::new(0) });
    let pool = DmaPool::identity();
    let Ok(mut queue) = QueuePair::allocate(QueueId(1), depth, &pool, registers, 0) else { return };
    for tag in 0..submitted {
        if queue.submit(SubmissionEntry::flush(NamespaceId(1)), tag as u64).is_err() {
            break;
        }
    }
    let _ = queue.ring_doorbell();
    // The device "writes" the completion ring with whatever the input says.
    let ring_bytes = depth as usize * 16;
    let Ok(ring) = pool.translate(queue.completion_iova(), ring_bytes) else { return };
    let take = rest.len().min(ring_bytes);
    let _ = ring.write(0, &rest[..take]);
    // Reap until the ring stops yielding entries or an error; bounded in rounds and time.
    for _ in 0..4 {
        match queue.reap(usize::MAX, |_| {}) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    let _ = queue.poll_until(Instant::now() + Duration::from_micros(50), |_| {}, |queue| queue.in_flight() == 0);
});
