//! Data buffers in memory the controller reaches only by copies (`nvme_driver::hw::CopiedMemory`:
//! GPU memory tuttid imported, here a vector behind a lock): the same data path as host memory,
//! the same restrictions, never the file backing's direct path, and a failed copy is a Data
//! Transfer Error.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use nvme_driver::hw::{CopiedMemory, CopiedRegion, HwError};
use nvme_driver::spec::command::DataPointerKind;
use nvme_driver::spec::data_pointer::SglDescriptor;
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{NvmeStatus, SubmissionEntry};
use nvme_driver::{Lba, NamespaceId};

use super::harness::{block_count, status_of, with_sgl, HostQueue, TestHost};
use crate::{Backing, EmuConfig, QueueRestriction};

/// "Device memory": bytes behind a lock, reached only through `read` / `write`, which can be
/// told to fail (a CUDA error).
struct VecMemory {
    bytes: Mutex<Vec<u8>>,
    failing: AtomicBool,
}

impl VecMemory {
    fn new(len: usize) -> Arc<VecMemory> {
        Arc::new(VecMemory { bytes: Mutex::new(vec![0; len]), failing: AtomicBool::new(false) })
    }

    fn fail(&self) -> Result<(), HwError> {
        if self.failing.load(Ordering::Relaxed) {
            return Err(HwError::Backend { backend: "test", message: "the copy engine is gone".into() });
        }
        Ok(())
    }
}

impl CopiedMemory for VecMemory {
    fn len(&self) -> usize {
        self.bytes.lock().unwrap().len()
    }
    fn read(&self, offset: usize, destination: &mut [u8]) -> Result<(), HwError> {
        self.fail()?;
        destination.copy_from_slice(&self.bytes.lock().unwrap()[offset..offset + destination.len()]);
        Ok(())
    }
    fn write(&self, offset: usize, source: &[u8]) -> Result<(), HwError> {
        self.fail()?;
        self.bytes.lock().unwrap()[offset..offset + source.len()].copy_from_slice(source);
        Ok(())
    }
    fn describe(&self) -> String {
        "test device memory".into()
    }
}

const NS: NamespaceId = NamespaceId(1);

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|index| (index as u8).wrapping_mul(13).wrapping_add(seed) ^ (index >> 12) as u8).collect()
}

fn sgl_at(mut entry: SubmissionEntry, iova: u64, len: u32) -> SubmissionEntry {
    entry.set_data_pointer_kind(DataPointerKind::Sgl);
    entry.dptr = SglDescriptor::data_block(iova, len).to_dptr();
    entry
}

/// Device memory mapped into the host's DMA space (the daemon's `map_copied`).
fn mapped(host: &TestHost, len: usize) -> (Arc<VecMemory>, CopiedRegion) {
    let memory = VecMemory::new(len);
    let region = host.dma.map_copied(memory.clone()).unwrap();
    (memory, region)
}

fn transfer_error() -> Result<(), NvmeStatus> {
    Err(NvmeStatus::generic(codes::DATA_TRANSFER_ERROR))
}

/// Writes 8 blocks from device memory (SGL), reads them back into host memory and into another
/// part of device memory (PRP, list in host memory); every copy byte-exact.
fn round_trip(host: &TestHost, queue: &mut HostQueue, memory: &VecMemory, region: &CopiedRegion) {
    let len = 8 * 4096;
    let data = pattern(len, 7);
    memory.bytes.lock().unwrap()[4096..4096 + len].copy_from_slice(&data);
    let write = sgl_at(SubmissionEntry::write(NS, Lba(16), block_count(8), false), region.iova().0 + 4096, len as u32);
    assert_eq!(status_of(&host.execute_on(queue, write)), Ok(()));
    let target = host.buffer(len);
    let read = with_sgl(SubmissionEntry::read(NS, Lba(16), block_count(8)), &target, len as u32);
    assert_eq!(status_of(&host.execute_on(queue, read)), Ok(()));
    let mut back = vec![0u8; len];
    target.read(0, &mut back).unwrap();
    assert!(back == data, "device memory -> media -> host memory changed bytes");
    // PRP: 8 pages of device memory, the list (entries 2..8) in host memory.
    let list = host.buffer(4096);
    let base = region.iova().0 + 16 * 4096;
    for page in 1..8u64 {
        list.write((page as usize - 1) * 8, &(base + page * 4096).to_le_bytes()).unwrap();
    }
    let mut read = SubmissionEntry::read(NS, Lba(16), block_count(8));
    read.dptr = [base, list.iova().0];
    assert_eq!(status_of(&host.execute_on(queue, read)), Ok(()));
    assert!(memory.bytes.lock().unwrap()[16 * 4096..16 * 4096 + len] == data[..], "media -> device memory changed bytes");
}

#[test]
fn device_memory_reached_by_copies_round_trips_through_sgl_and_prp() {
    // Goal: a Write whose data lies in memory reached only by copies stores exactly those bytes,
    // and Reads deliver them into host memory and into device memory (PRP with a host list);
    // a PRP list inside device memory is refused (lists are read by the controller as host
    // memory only); a failing copy completes with Data Transfer Error and the controller serves on.
    let mut host = TestHost::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 8 << 20 }));
    let mut queue = host.create_io_pair(1, 16);
    let (memory, region) = mapped(&host, 32 * 4096);
    round_trip(&host, &mut queue, &memory, &region);

    let mut read = SubmissionEntry::read(NS, Lba(16), block_count(4));
    read.dptr = [region.iova().0, region.iova().0 + 24 * 4096];
    assert_eq!(status_of(&host.execute_on(&mut queue, read)), transfer_error(), "a PRP list in device memory");

    memory.failing.store(true, Ordering::Relaxed);
    let write = sgl_at(SubmissionEntry::write(NS, Lba(0), block_count(1), false), region.iova().0, 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, write)), transfer_error(), "a failed copy out");
    let read = sgl_at(SubmissionEntry::read(NS, Lba(16), block_count(1)), region.iova().0, 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, read)), transfer_error(), "a failed copy in");
    memory.failing.store(false, Ordering::Relaxed);
    round_trip(&host, &mut queue, &memory, &region);

    // Released: its IOVA names nothing any more.
    let iova = region.iova().0;
    drop(region);
    let write = sgl_at(SubmissionEntry::write(NS, Lba(0), block_count(1), false), iova, 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, write)), transfer_error(), "unmapped device memory");
}

#[test]
fn a_queue_restriction_covers_device_memory_too() {
    // Goal: a restricted queue reaches device memory only where its restriction allows it (a
    // client's own registration), and a refusal is counted like one of host memory.
    let mut host = TestHost::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 8 << 20 }));
    let mut queue = host.create_io_pair(1, 16);
    let (memory, region) = mapped(&host, 32 * 4096);
    let (_other_memory, other) = mapped(&host, 4096);
    // Everything but `other` (the queue's rings and the host buffers of the round trip included).
    let other_end = other.iova().0 + other.len() as u64;
    let restriction = QueueRestriction::new()
        .allow_memory(nvme_driver::Iova(0), other.iova().0)
        .allow_memory(nvme_driver::Iova(other_end), u64::MAX - other_end)
        .allow_blocks(1, 0, 1 << 20);
    host.device.restrict_submission_queue(1, Some(restriction)).unwrap();
    round_trip(&host, &mut queue, &memory, &region);
    let refused_before = host.device.stats().restriction_refusals;
    let write = sgl_at(SubmissionEntry::write(NS, Lba(0), block_count(1), false), other.iova().0, 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, write)), transfer_error(), "device memory outside the restriction");
    assert_eq!(host.device.stats().restriction_refusals, refused_before + 1);
    assert_eq!(host.device.restriction_refusals(), refused_before + 1, "the count read without the controller's lock");
}

#[test]
fn device_memory_never_takes_the_file_backings_direct_path() {
    // Goal: on a file backing, whose aligned transfers move straight between the file and host
    // memory by host address, a transfer into device memory (which has none) goes through the
    // bounce buffer and lands byte-exact, both ways, batched or not.
    let path = std::env::temp_dir().join(format!("nvme-emu-test-{}-copied", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let config = EmuConfig::default()
        .with_backing(Backing::File { path: path.clone(), create_bytes: Some(4 << 20) })
        .with_volatile_write_cache(false);
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 64);
    let (memory, region) = mapped(&host, 32 * 4096);
    let data = pattern(16 * 4096, 3);
    memory.bytes.lock().unwrap()[..data.len()].copy_from_slice(&data);
    // Two commands per doorbell, so that neither is the lone synchronous one.
    for half in 0..2u64 {
        let at = region.iova().0 + half * 8 * 4096;
        TestHost::push(&mut queue, sgl_at(SubmissionEntry::write(NS, Lba(half * 8), block_count(8), false), at, 8 * 4096));
    }
    host.ring_submission(&queue);
    for _ in 0..2 {
        assert_eq!(status_of(&host.reap(&mut queue)), Ok(()));
    }
    for half in 0..2u64 {
        let at = region.iova().0 + (16 + half * 8) * 4096;
        TestHost::push(&mut queue, sgl_at(SubmissionEntry::read(NS, Lba(half * 8), block_count(8)), at, 8 * 4096));
    }
    host.ring_submission(&queue);
    for _ in 0..2 {
        assert_eq!(status_of(&host.reap(&mut queue)), Ok(()));
    }
    assert!(memory.bytes.lock().unwrap()[16 * 4096..] == data[..], "device memory -> file -> device memory changed bytes");
    assert_eq!(host.device.stats().direct_transfers, 0, "a transfer into device memory went direct");
    drop(host);
    let media = std::fs::read(&path).unwrap();
    assert!(media[..data.len()] == data[..], "the writes are on the file");
    let _ = std::fs::remove_file(&path);
}
