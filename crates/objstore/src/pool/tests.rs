//! The pool's metadata path on the software controller.

use std::sync::Arc;

use nvme_driver::hw::DeviceBackend;
use nvme_driver::spec::NvmOpcode;
use nvme_driver::{Controller, ControllerConfig};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};

use super::*;

/// 4 layers, 4 KiB objects: 32 KiB slots.
fn geometry() -> ModelGeometry {
    ModelGeometry { layers: 4, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 }
}

/// A pool formatted and opened on a 16 MiB namespace of a controller that grants one I/O queue
/// pair, so its metadata borrows the executor's (`metadata_queue_shared(0)`).
fn pool_borrowing_the_executors_pair() -> (Arc<EmuDevice>, Vec<PoolTarget>, Pool) {
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 16 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, None)])
        .with_io_queue_pairs_max(1);
    let (device, targets) = start(config);
    format(&targets, geometry());
    let (pool, _) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
    assert!(pool.metadata_queue_shared(0));
    (device, targets, pool)
}

fn start(config: EmuConfig) -> (Arc<EmuDevice>, Vec<PoolTarget>) {
    let device = EmuDevice::start(config).expect("software controller");
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"));
    (device, vec![PoolTarget { controller, namespace: NamespaceId(1) }])
}

fn format(targets: &[PoolTarget], geometry: ModelGeometry) {
    let params = FormatParams::new(geometry);
    format_pool(targets, &params).expect("format");
}

#[test]
fn a_sync_writes_only_the_dirty_header_sectors() {
    // Goal: two distant slots made dirty cost two FUA writes of one LBA each, not the ~120
    // LBAs between them (the header sync used to rewrite the whole min..max span); a second
    // slot in an already dirty LBA costs nothing more; a sync with nothing dirty writes nothing.
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 32 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let (device, targets) = start(config);
    format(&targets, geometry());
    let (mut pool, report) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
    let last = (report.slots - 1) as u32;
    assert!(pool.superblock(0).header_blocks > 100, "the header region spans many LBAs: {:?}", pool.superblock(0));
    let before = device.stats();
    for slot in [0, 1, last] {
        pool.stage_header(0, slot, SlotState::Empty, &[]).unwrap();
    }
    assert_eq!(pool.devices[0].mirror.dirty_blocks(), 2, "slots 0 and 1 share an LBA");
    pool.sync_headers(&mut NoLender).unwrap();
    let after = device.stats();
    assert_eq!(after.io(NvmOpcode::Write) - before.io(NvmOpcode::Write), 2, "one FUA write per dirty LBA");
    assert_eq!(after.bytes_written - before.bytes_written, 2 * 512);
    assert_eq!(pool.devices[0].mirror.dirty_blocks(), 0);
    pool.sync_headers(&mut NoLender).unwrap();
    assert_eq!(device.stats().io(NvmOpcode::Write), after.io(NvmOpcode::Write), "nothing dirty, nothing written");
    // Adjacent dirty LBAs go as one command.
    for slot in [8, 16, 24] {
        pool.stage_header(0, slot, SlotState::Empty, &[]).unwrap();
    }
    pool.sync_headers(&mut NoLender).unwrap();
    assert_eq!(device.stats().io(NvmOpcode::Write) - after.io(NvmOpcode::Write), 1, "LBAs 1..4 in one command");
    drop(pool);
    let (_, reopened) = Pool::open(targets, Some(&geometry())).unwrap();
    assert_eq!((reopened.empty_slots, reopened.corrupt_headers), (report.slots, 0), "every rewritten entry is a clean Empty one");
}

#[test]
fn metadata_transfers_fit_a_small_mdts_and_a_shallow_queue() {
    // Goal: on a controller that moves at most 4 KiB per command, a header region of more
    // than 63 commands' worth (the metadata queue's depth) is formatted and read back: the
    // driver refuses a transfer needing more commands than the queue has free, so metadata
    // moves in pieces of a bounded number of commands.
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 16 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, None)])
        .with_mdts(1); // 8 KiB per command
    let (_device, targets) = start(config);
    // 512-byte objects, one layer: a 1 KiB slot per 64-byte header entry.
    let tiny = ModelGeometry { layers: 1, kv_heads: 1, head_dim: 128, dtype_bytes: 2, block_tokens: 2 };
    format(&targets, tiny);
    let (pool, report) = Pool::open(targets, Some(&tiny)).unwrap();
    let region = pool.superblock(0).header_region_bytes();
    assert!(region > 63 * 8192, "{region} bytes of headers");
    assert_eq!((report.empty_slots, report.corrupt_headers), (report.slots, 0));
}

#[test]
fn a_metadata_transfer_never_reaches_past_its_region() {
    // Goal: a metadata read or write whose range runs past its DMA region is refused before
    // anything is submitted. The segment used to be the region's IOVA plus the offset, unchecked,
    // so the controller moved the bytes into (or out of) whatever memory follows the region:
    // here the next allocation, which must come through untouched.
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let (device, targets) = start(config);
    let controller = &targets[0].controller;
    let mut queue = controller.create_io_queue_pair(METADATA_QUEUE_DEPTH).unwrap();
    let region = controller.dma().allocate(4096).unwrap();
    let neighbour = controller.dma().allocate(4096).unwrap();
    assert_eq!(region.iova().checked_add(4096), Some(neighbour.iova()), "the test needs the two allocations adjacent");
    neighbour.fill(0, 4096, 0xAB).unwrap();
    let before = device.stats();
    let timeout = Duration::from_secs(5);
    let read = transfer_region(&mut queue, NamespaceId(1), 0, &region, 0, 8192, 512, Transfer::Read, timeout);
    assert!(matches!(read, Err(ObjstoreError::Dma(nvme_driver::HwError::OutOfRange { .. }))), "{read:?}");
    let read = transfer_region(&mut queue, NamespaceId(1), 0, &region, 4096, 512, 512, Transfer::Read, timeout);
    assert!(matches!(read, Err(ObjstoreError::Dma(nvme_driver::HwError::OutOfRange { .. }))), "{read:?}");
    let write = super::metadata_io::write_runs_durably(
        &mut queue,
        NamespaceId(1),
        0,
        &region,
        [(4, 12)].into_iter(),
        512,
        Instant::now() + timeout,
    );
    assert!(matches!(write, Err(ObjstoreError::Dma(nvme_driver::HwError::OutOfRange { .. }))), "{write:?}");
    let mut bytes = vec![0u8; 4096];
    neighbour.read(0, &mut bytes).unwrap();
    assert!(bytes.iter().all(|&byte| byte == 0xAB), "the neighbouring allocation was overwritten");
    let after = device.stats();
    assert_eq!((after.io(NvmOpcode::Read), after.io(NvmOpcode::Write)), (before.io(NvmOpcode::Read), before.io(NvmOpcode::Write)));
    // Inside the region, the same calls work.
    transfer_region(&mut queue, NamespaceId(1), 0, &region, 0, 4096, 512, Transfer::Read, timeout).unwrap();
    super::metadata_io::write_runs_durably(&mut queue, NamespaceId(1), 0, &region, [(4, 8)].into_iter(), 512, Instant::now() + timeout)
        .unwrap();
}

#[test]
fn a_header_entry_larger_than_4_kib_is_staged_and_recovered() {
    // Goal: with 8 KiB LBAs and k = 254 a header entry is 8 KiB, which the format allows (an
    // entry up to one LBA). Staging one used to slice a fixed 4 KiB buffer and panic on the
    // first store; it must be written, and a reopen must find the slot Valid with its keys.
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 24 << 20 }).with_namespaces(vec![NamespaceConfig::new(8192, None)]);
    let (_device, targets) = start(config);
    // 8 KiB objects: one LBA each.
    let geometry = ModelGeometry { layers: 1, kv_heads: 1, head_dim: 128, dtype_bytes: 2, block_tokens: 32 };
    let k = 254;
    let params = FormatParams { blocks_per_slot: k, slot_count_max: Some(2), payload_crc: true, ..FormatParams::new(geometry) };
    format_pool(&targets, &params).unwrap();
    let (mut pool, _) = Pool::open(targets.clone(), Some(&geometry)).unwrap();
    assert_eq!(pool.superblock(0).header_entry_bytes, 8192);
    let records: Vec<crate::format::BlockRecord> =
        (0..u64::from(k)).map(|i| crate::format::BlockRecord { key: 1000 + i, token_count: 32, payload_crc: i as u32 }).collect();
    pool.stage_header(0, 1, SlotState::Valid, &records).unwrap();
    pool.sync_headers(&mut NoLender).unwrap();
    drop(pool);
    let (pool, report) = Pool::open(targets, Some(&geometry)).unwrap();
    assert_eq!((report.valid_slots, report.cached_blocks, report.corrupt_headers), (1, u64::from(k), 0));
    assert!(pool.index().get(1000 + 253).is_some());
}

/// Lends one queue pair of its own, as an executor would lend its queue pair of pool device 0.
struct OneQueueLender(IoQueuePair);

impl QueueLender for OneQueueLender {
    fn lend(&mut self, _device: usize, _deadline: Instant) -> Result<Option<&mut IoQueuePair>> {
        Ok(Some(&mut self.0))
    }
}

/// Lends one queue pair as an executor busy with other layers on it does: the pair is idle only
/// 1 ms before the lend's deadline (`lend_queue_pair` waits that long for them to end).
struct SlowLender(IoQueuePair);

impl QueueLender for SlowLender {
    fn lend(&mut self, _device: usize, deadline: Instant) -> Result<Option<&mut IoQueuePair>> {
        std::thread::sleep(deadline.saturating_duration_since(Instant::now()).saturating_sub(Duration::from_millis(1)));
        Ok(Some(&mut self.0))
    }
}

#[test]
fn a_slow_lend_does_not_use_up_the_header_writes_time() {
    // Goal: the executor lends its queue pair only when its own layers on it have ended, up to
    // the lend's deadline. That wait must not come out of the header writes' time: they used to
    // get what was left of one metadata timeout measured before the lend, so a lend ending
    // near its deadline left the writes ~1 ms, they timed out in flight on a pair the pool
    // cannot delete, and a healthy device (writes answered in 20 ms) was fenced at once.
    // With a caller's deadline that the lend leaves too little of, nothing is submitted on the
    // lent pair: DeadlinePassed, the sector stays staged, nothing fenced.
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let (device, targets, mut pool) = pool_borrowing_the_executors_pair();
    let timeout = Duration::from_millis(300);
    pool.set_metadata_timeout(timeout);
    let mut lender = SlowLender(targets[0].controller.create_io_queue_pair(16).unwrap());
    let slow_write = FaultRule::every_nth_io(1, FaultAction::Delay(Duration::from_millis(20))).with_opcode(NvmOpcode::Write as u8);
    device.set_faults(FaultPlan::none().with_rule(slow_write));
    pool.stage_header(0, 5, SlotState::Empty, &[]).unwrap();
    let synced = pool.sync_headers_by(&mut lender, Some(Instant::now() + timeout + Duration::from_millis(100)));
    assert!(matches!(synced, Err(ObjstoreError::DeadlinePassed { .. })), "{synced:?}");
    assert!(!pool.metadata_fenced(0), "the caller's deadline says nothing about the device");
    assert_eq!(pool.devices[0].mirror.dirty_blocks(), 1, "the sector stays staged");
    pool.sync_headers(&mut lender).expect("the writes get the whole metadata timeout after the lend");
    assert!(!pool.metadata_fenced(0));
    assert_eq!(pool.devices[0].mirror.dirty_blocks(), 0);
    device.set_faults(FaultPlan::none());
}

/// Lends one queue pair as [`SlowLender`] does, counting its lends, and says that it lends.
struct CountingLender {
    queue: IoQueuePair,
    lends: u32,
}

impl QueueLender for CountingLender {
    fn lend(&mut self, _device: usize, deadline: Instant) -> Result<Option<&mut IoQueuePair>> {
        self.lends += 1;
        std::thread::sleep(deadline.saturating_duration_since(Instant::now()).saturating_sub(Duration::from_millis(1)));
        Ok(Some(&mut self.queue))
    }

    fn lends(&self, _device: usize) -> Option<bool> {
        Some(true)
    }
}

#[test]
fn a_deadline_too_short_for_a_lent_queue_pair_is_refused_without_lending() {
    // Goal: a sync whose caller's deadline leaves less than the metadata timeout cannot use a
    // lent queue pair (a write timed out there would fence the device), so it must say
    // DeadlinePassed at once. It used to lend first, waiting up to that whole deadline for the
    // executor's other layers on the pair, only to refuse the pair it got.
    let (_device, targets, mut pool) = pool_borrowing_the_executors_pair();
    // Long beside what a temporary pair's creation, write and deletion take on a loaded machine
    // (the last sync below); the refusal's bound does not depend on it.
    let timeout = Duration::from_secs(4);
    pool.set_metadata_timeout(timeout);
    let mut lender = CountingLender { queue: targets[0].controller.create_io_queue_pair(16).unwrap(), lends: 0 };
    pool.stage_header(0, 5, SlotState::Empty, &[]).unwrap();
    let start = Instant::now();
    let synced = pool.sync_headers_by(&mut lender, Some(start + timeout / 2));
    let took = start.elapsed();
    assert!(matches!(synced, Err(ObjstoreError::DeadlinePassed { .. })), "{synced:?}");
    assert_eq!(lender.lends, 0, "a pair that cannot be used is not lent");
    assert!(took < Duration::from_millis(200), "refused after {took:?}: the lend waited for the caller's deadline");
    assert!(!pool.metadata_fenced(0));
    assert_eq!(pool.devices[0].mirror.dirty_blocks(), 1, "the sector stays staged");
    // NoLender says it never lends: a temporary queue pair (the controller's one pair, the
    // lender's no more), usable with a cut deadline, writes the sector.
    drop(lender);
    pool.sync_headers_by(&mut NoLender, Some(Instant::now() + timeout / 2)).expect("a temporary queue pair");
    assert_eq!(pool.devices[0].mirror.dirty_blocks(), 0);
}

#[test]
fn a_header_sync_fits_a_lent_queue_of_depth_4() {
    // Goal: a header sync through a lent queue of depth 4 (3 commands at once) writes a
    // contiguous dirty run that takes 4 commands under the controller's MDTS. Pieces used to
    // take up to 16 commands whatever the queue's depth: the driver refused the 4th with
    // QueueFull, the retry after draining failed the same way, and so did every store.
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 16 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, None)])
        .with_mdts(1) // 8 KiB (16 LBAs) per command
        .with_io_queue_pairs_max(1);
    let (device, targets) = start(config);
    // 1 KiB slots, 64-byte header entries: 8 per LBA.
    let tiny = ModelGeometry { layers: 1, kv_heads: 1, head_dim: 128, dtype_bytes: 2, block_tokens: 2 };
    format(&targets, tiny);
    let (mut pool, report) = Pool::open(targets.clone(), Some(&tiny)).unwrap();
    assert!(pool.metadata_queue_shared(0), "one queue pair granted: metadata borrows the executor's");
    let mut lender = OneQueueLender(targets[0].controller.create_io_queue_pair(4).unwrap());
    let slots = 64 * 8; // 64 LBAs: 4 commands of 16
    assert!(report.slots >= slots);
    let records = [crate::format::BlockRecord { key: 0, token_count: 2, payload_crc: 0 }];
    for slot in 0..slots as u32 {
        let records = [crate::format::BlockRecord { key: 7000 + u64::from(slot), ..records[0] }];
        pool.stage_header(0, slot, SlotState::Valid, &records).unwrap();
    }
    let before = device.stats();
    pool.sync_headers(&mut lender).unwrap();
    assert_eq!(device.stats().io(NvmOpcode::Write) - before.io(NvmOpcode::Write), 4, "64 LBAs, 16 per command");
    drop(lender);
    drop(pool);
    let (_, reopened) = Pool::open(targets, Some(&tiny)).unwrap();
    assert_eq!((reopened.valid_slots, reopened.corrupt_headers), (slots, 0));
}

/// Bytes of the controller's DMA space mapped now, page by page from the identity pool's base
/// (the software controller's IOVAs start at 4 GiB and grow): what was freed is unmapped.
fn mapped_bytes(controller: &Controller) -> u64 {
    let base = 1u64 << 32;
    (0..(256u64 << 20) / 4096).filter(|page| controller.dma().translate(nvme_driver::Iova(base + page * 4096), 1).is_ok()).count() as u64
        * 4096
}

/// A metadata I/O command that never completes, and every Delete I/O SQ failing: a timed-out
/// command stays with the controller, which keeps the queue.
fn lose_the_next_io_and_the_queue(device: &EmuDevice) {
    use nvme_driver::spec::status::codes;
    use nvme_driver::spec::{AdminOpcode, NvmeStatus};
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let internal = NvmeStatus::generic(codes::INTERNAL_ERROR);
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)).with_rule(FaultRule {
        repeat: true,
        ..FaultRule::on_nth_admin(1, AdminOpcode::DeleteIoSubmissionQueue, FaultAction::Status(internal))
    }));
}

#[test]
fn a_timed_out_superblock_read_keeps_its_buffer_when_the_queue_cannot_be_deleted() {
    // Goal: the superblock read times out and its queue pair cannot be deleted: the controller
    // may still write the read's buffer, so that buffer must stay allocated with the rings. It
    // used to be freed first (locals drop in reverse order), its IOVA handed to the next
    // allocation while the Read stayed queued.
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let (device, targets) = start(config);
    format(&targets, geometry());
    let controller = &targets[0].controller;
    let (leaked_rings_before, mapped_before) = (controller.leaked_bytes(), mapped_bytes(controller));
    lose_the_next_io_and_the_queue(&device);
    let read = super::read_superblock_within(&targets[0], 0, Duration::from_millis(200));
    assert!(matches!(read, Err(ObjstoreError::Nvme(nvme_driver::NvmeError::Timeout { .. }))), "{read:?}");
    device.set_faults(nvme_emu::FaultPlan::none());
    let rings = controller.leaked_bytes() - leaked_rings_before;
    assert!(rings > 0, "the queue pair was leaked");
    assert_eq!(mapped_bytes(controller) - mapped_before, rings + 4096, "the rings and the 4 KiB read buffer stay mapped");
}

#[test]
fn a_pool_dropped_after_a_timed_out_header_write_keeps_its_mirror() {
    // Goal: a header write on the pool's own metadata queue times out and that queue pair
    // cannot be deleted: dropping the pool must keep the mirror the write reads from (and the
    // scratch buffer) with the rings; it used to free them after the queue pair leaked.
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let (device, targets) = start(config);
    format(&targets, geometry());
    let controller = targets[0].controller.clone();
    let (leaked_rings_before, mapped_before) = (controller.leaked_bytes(), mapped_bytes(&controller));
    let (mut pool, _) = Pool::open(targets, Some(&geometry())).unwrap();
    assert!(!pool.metadata_queue_shared(0));
    pool.set_metadata_timeout(Duration::from_millis(200));
    let kept = pool.devices[0].mirror.region().len() as u64 + pool.devices[0].scratch.len() as u64;
    pool.stage_header(0, 3, SlotState::Empty, &[]).unwrap();
    lose_the_next_io_and_the_queue(&device);
    let sync = pool.sync_headers(&mut NoLender);
    assert!(sync.is_err(), "{sync:?}");
    drop(pool);
    device.set_faults(nvme_emu::FaultPlan::none());
    let rings = controller.leaked_bytes() - leaked_rings_before;
    assert!(rings > 0, "the queue pair was leaked");
    assert_eq!(mapped_bytes(&controller) - mapped_before, rings + kept, "the rings, the mirror and the scratch buffer stay mapped");
}

fn lose_the_next_io(device: &EmuDevice) {
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)));
}

#[test]
fn after_a_timed_out_header_write_the_queue_pair_is_replaced_before_the_next_write() {
    // Goal: header write W1 (slot 5 Valid) times out on the pool's own queue. W1 must not stay
    // queued behind later writes of that sector (NVMe does not order them; a late W1 would undo
    // them): the queue pair is deleted at once, the next sync goes through a fresh one and
    // succeeds, and after a reopen slot 5 reads as last written (Empty). The pair used to stay:
    // the next sync waited on W1 again and timed out, and every later store with it.
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let (device, targets) = start(config);
    format(&targets, geometry());
    let (mut pool, _) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
    pool.set_metadata_timeout(Duration::from_millis(200));
    let records = [crate::format::BlockRecord { key: 77, token_count: 16, payload_crc: 0 }];
    pool.stage_header(0, 5, SlotState::Valid, &records).unwrap();
    lose_the_next_io(&device);
    assert!(pool.sync_headers(&mut NoLender).is_err());
    device.set_faults(nvme_emu::FaultPlan::none());
    assert!(pool.devices[0].queue.is_none(), "the queue pair holding W1 was deleted");
    assert!(!pool.metadata_fenced(0), "the deletion succeeded: nothing to fence");
    pool.stage_header(0, 5, SlotState::Empty, &[]).unwrap();
    pool.sync_headers(&mut NoLender).unwrap(); // through a fresh queue pair
    assert!(pool.devices[0].queue.is_some());
    drop(pool);
    let (_, report) = Pool::open(targets, Some(&geometry())).unwrap();
    assert_eq!((report.valid_slots, report.empty_slots), (0, report.slots));
}

#[test]
fn a_timed_out_header_write_on_a_lent_queue_fences_the_device() {
    // Goal: W1 times out on the executor's queue pair lent for metadata, which the pool cannot
    // delete: the device is fenced. Staging a header there (which would rewrite mirror bytes
    // W1 may still be reading, and queue a write W1 may overtake) is refused with
    // MetadataFenced, as is any later sync or flush on it; dropping the pool keeps the mirror.
    let (device, targets, mut pool) = pool_borrowing_the_executors_pair();
    pool.set_metadata_timeout(Duration::from_millis(200));
    let mut lender = OneQueueLender(targets[0].controller.create_io_queue_pair(16).unwrap());
    pool.stage_header(0, 5, SlotState::Empty, &[]).unwrap();
    lose_the_next_io(&device);
    assert!(pool.sync_headers(&mut lender).is_err());
    device.set_faults(nvme_emu::FaultPlan::none());
    assert!(pool.metadata_fenced(0));
    let staged = pool.stage_header(0, 5, SlotState::Empty, &[]);
    assert!(matches!(staged, Err(ObjstoreError::MetadataFenced { device: 0, .. })), "{staged:?}");
    pool.sync_headers(&mut lender).unwrap(); // nothing of the fenced device is written
    let flushed = pool.flush(&[true], &mut lender);
    assert!(matches!(flushed, Err(ObjstoreError::MetadataFenced { device: 0, .. })), "{flushed:?}");
    // Counted for this test alone: tests run in parallel, and one leaking meanwhile (as the
    // thread below does) used to count here too, so `>=` could pass without these two leaks.
    let leaked_before = crate::leak::leaked_dma_regions_on_this_thread();
    let other = targets[0].controller.dma().allocate(4096).unwrap();
    std::thread::spawn(move || crate::leak::leak_regions(&[&other], "another test's leak")).join().unwrap();
    drop(pool);
    assert_eq!(crate::leak::leaked_dma_regions_on_this_thread(), leaked_before + 2, "the mirror and scratch are kept");
}

#[test]
fn a_reformat_interrupted_after_its_header_writes_leaves_no_pool() {
    // Goal: a format over an existing pool that stops after rewriting the header region but
    // before its new superblock (the flush between them fails, then the power goes) leaves no
    // pool: open fails with CorruptSuperblock. The old superblock used to stay valid until the
    // last step, so the old pool still opened over headers of the new one (its rewritten
    // entries counted as corrupt). With a volatile write cache the unflushed header writes are
    // lost at the cut; the old superblock must be gone all the same (written off with FUA).
    // A format that then runs to the end makes a pool again.
    use nvme_driver::spec::status::codes;
    use nvme_driver::spec::NvmeStatus;
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    for volatile_write_cache in [false, true] {
        let config = EmuConfig::default()
            .with_backing(Backing::Memory { bytes: 16 << 20 })
            .with_namespaces(vec![NamespaceConfig::new(512, None)])
            .with_volatile_write_cache(volatile_write_cache);
        let (device, targets) = start(config);
        format(&targets, geometry());
        let (mut pool, _) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
        let records = [crate::format::BlockRecord { key: 77, token_count: 16, payload_crc: 0 }];
        pool.stage_header(0, 3, SlotState::Valid, &records).unwrap();
        pool.sync_headers(&mut NoLender).unwrap();
        drop(pool);
        let failed_flush =
            FaultRule::on_nth_io(1, FaultAction::Status(NvmeStatus::generic(codes::INTERNAL_ERROR))).with_opcode(NvmOpcode::Flush as u8);
        device.set_faults(FaultPlan::none().with_rule(failed_flush));
        let writes_before = device.stats().io(NvmOpcode::Write);
        let params = FormatParams::new(geometry());
        assert!(format_pool(&targets, &params).is_err(), "the flush failed");
        assert!(device.stats().io(NvmOpcode::Write) > writes_before, "the header region was rewritten");
        device.set_faults(FaultPlan::none());
        device.power_loss();
        drop(targets);
        let (_, targets) = restart(&device);
        match Pool::open(targets.clone(), Some(&geometry())) {
            Err(ObjstoreError::CorruptSuperblock { device: 0, reason }) => eprintln!("refused: {reason}"),
            Err(other) => panic!("write cache {volatile_write_cache}: expected CorruptSuperblock, got {other:?}"),
            Ok((_, report)) => panic!("write cache {volatile_write_cache}: the interrupted format left a pool: {report:?}"),
        }
        format(&targets, geometry());
        let (_, report) = Pool::open(targets, Some(&geometry())).expect("a completed format");
        assert_eq!((report.valid_slots, report.empty_slots, report.corrupt_headers), (0, report.slots, 0));
    }
}

/// A fresh controller on `device` (after a power loss), as `start` makes one.
fn restart(device: &Arc<EmuDevice>) -> (Arc<EmuDevice>, Vec<PoolTarget>) {
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up after the power loss"));
    (device.clone(), vec![PoolTarget { controller, namespace: NamespaceId(1) }])
}

#[test]
fn an_unreadable_header_sector_costs_its_slots_not_the_pool() {
    // Goal: a media error reading one header LBA at open frees the slots of that LBA (counted
    // as corrupt and unreadable) and the pool opens with every other slot recovered. One such
    // LBA used to fail `Pool::open` for the whole pool. The unreadable sector is mirrored as
    // clean Empty entries, so a later write of a neighbour's header leaves it whole and Empty.
    use nvme_driver::spec::{NvmeStatus, StatusCodeType};
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let (device, targets) = start(config);
    format(&targets, geometry());
    let (mut pool, _) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
    assert_eq!(pool.superblock(0).header_entry_bytes, 64, "8 entries per 512-byte LBA");
    let region_bytes = pool.superblock(0).header_region_bytes();
    assert!(region_bytes <= METADATA_CHUNK_BYTES && region_bytes <= targets[0].controller.max_transfer_bytes(), "one read command");
    for (slot, key) in [(3u32, 103u64), (9, 109), (20, 120)] {
        let records = [crate::format::BlockRecord { key, token_count: 16, payload_crc: 0 }];
        pool.stage_header(0, slot, SlotState::Valid, &records).unwrap();
    }
    pool.sync_headers(&mut NoLender).unwrap();
    drop(pool);
    // Reads at open: the superblock (1st), the header region (2nd), then, after that failed,
    // header LBA by LBA: LBA 1 (slots 8..16) is the 4th read.
    let media = FaultAction::Status(NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, 0x81));
    let read = NvmOpcode::Read as u8;
    device.set_faults(
        FaultPlan::none()
            .with_rule(FaultRule::on_nth_io(2, media).with_opcode(read))
            .with_rule(FaultRule::on_nth_io(4, media).with_opcode(read)),
    );
    let (mut pool, report) = Pool::open(targets.clone(), Some(&geometry())).expect("the pool opens without header LBA 1");
    device.set_faults(FaultPlan::none());
    assert_eq!((report.unreadable_headers, report.corrupt_headers, report.zeroed_headers), (8, 8, 0));
    assert_eq!((report.valid_slots, report.empty_slots), (2, report.slots - 10));
    assert!(pool.index().get(103).is_some() && pool.index().get(120).is_some());
    assert_eq!(pool.index().get(109), None, "its header could not be read: not served");
    assert!(!pool.header_is_empty(0, 9), "reused only after its header is made Empty");
    assert_eq!(pool.index().counts().free_slots, report.slots - 2);
    pool.stage_header(0, 8, SlotState::Empty, &[]).unwrap();
    pool.sync_headers(&mut NoLender).unwrap();
    drop(pool);
    let (_, report) = Pool::open(targets, Some(&geometry())).unwrap();
    assert_eq!((report.valid_slots, report.corrupt_headers, report.empty_slots), (2, 0, report.slots - 2), "LBA 1 rewritten whole");
}

#[test]
fn a_device_whose_header_writes_keep_failing_is_fenced_and_the_others_sync_on() {
    // Goal: one pool device answering its header writes with an error status (nothing left in
    // flight, so not "stuck") costs the syncs it is part of, not every sync until reopen: the
    // other devices' staged sectors are written at each sync all the same, and after
    // HEADER_SYNC_FAILURES_FENCE failures in a row the device is fenced (its staged sectors
    // dropped, its slots not reused), after which syncs of the other devices succeed. Before,
    // `sync_headers` returned at the first failing device, and every later sync failed on it.
    use nvme_driver::spec::{NvmeStatus, StatusCodeType};
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let config =
        || EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    // Device 1 first in pool order, so a sync that stopped at the first failure would leave
    // device 0's sectors unwritten.
    let (failing, failing_targets) = start(config());
    let (_healthy, healthy_targets) = start(config());
    let targets = vec![failing_targets[0].clone(), healthy_targets[0].clone()];
    format(&targets, geometry());
    let (mut pool, _) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
    let record = |key| [crate::format::BlockRecord { key, token_count: 16, payload_crc: 0 }];
    let write_fault = FaultAction::Status(NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, 0x80));
    failing.set_faults(FaultPlan::none().with_rule(FaultRule::every_nth_io(1, write_fault).with_opcode(NvmOpcode::Write as u8)));
    for round in 0..HEADER_SYNC_FAILURES_FENCE {
        assert!(!pool.metadata_fenced(0), "fenced after {round} failures");
        pool.stage_header(0, round, SlotState::Valid, &record(100 + u64::from(round))).unwrap();
        pool.stage_header(1, round, SlotState::Valid, &record(200 + u64::from(round))).unwrap();
        assert!(pool.sync_headers(&mut NoLender).is_err(), "round {round}: device 0's writes fail");
        assert_eq!(pool.devices[1].mirror.dirty_blocks(), 0, "round {round}: device 1 synced all the same");
    }
    assert!(pool.metadata_fenced(0), "fenced after {HEADER_SYNC_FAILURES_FENCE} failures in a row");
    assert_eq!(pool.devices[0].mirror.dirty_blocks(), 0, "a fenced device's staged sectors are dropped");
    assert!(matches!(pool.stage_header(0, 7, SlotState::Empty, &[]), Err(ObjstoreError::MetadataFenced { device: 0, .. })));
    pool.stage_header(1, 7, SlotState::Valid, &record(207)).unwrap();
    pool.sync_headers(&mut NoLender).expect("the healthy device syncs once the failing one is fenced");
    drop(pool);
    failing.set_faults(FaultPlan::none());
    let (pool, report) = Pool::open(targets, Some(&geometry())).unwrap();
    assert_eq!(report.valid_slots, 4, "device 1's four headers, none of device 0's");
    for key in [200, 201, 202, 207] {
        assert_eq!(pool.index().get(key).map(|location| location.device), Some(1), "key {key}");
    }
    assert!((100..103).all(|key| pool.index().get(key).is_none()));
}

#[test]
fn a_device_whose_header_writes_keep_timing_out_is_fenced_and_the_others_sync_on() {
    // Goal: one pool device whose header writes are never answered (lost I/O; the controller
    // still confirms the deletion of the queue pair, so each timeout only retires the queue)
    // costs the syncs it is part of, HEADER_SYNC_FAILURES_FENCE of them, not every sync until
    // reopen: each timeout spent the full metadata timeout, so it counts toward the fence like
    // an error status, and once fenced the other device's syncs succeed without waiting on it.
    // Before, only an error status counted: such a device was never fenced, and every later
    // sync waited out the metadata timeout on it and failed.
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let config =
        || EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let (hanging, hanging_targets) = start(config());
    let (_healthy, healthy_targets) = start(config());
    let targets = vec![hanging_targets[0].clone(), healthy_targets[0].clone()];
    format(&targets, geometry());
    let (mut pool, _) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
    assert!(!pool.metadata_queue_shared(0), "the pool's own queue pair: a timeout retires it, it does not fence");
    pool.set_metadata_timeout(Duration::from_millis(200));
    let record = |key| [crate::format::BlockRecord { key, token_count: 16, payload_crc: 0 }];
    hanging.set_faults(
        FaultPlan::none().with_rule(FaultRule::every_nth_io(1, FaultAction::DropCompletion).with_opcode(NvmOpcode::Write as u8)),
    );
    for round in 0..HEADER_SYNC_FAILURES_FENCE {
        assert!(!pool.metadata_fenced(0), "fenced after {round} timeouts");
        pool.stage_header(0, round, SlotState::Valid, &record(100 + u64::from(round))).unwrap();
        pool.stage_header(1, round, SlotState::Valid, &record(200 + u64::from(round))).unwrap();
        match pool.sync_headers(&mut NoLender) {
            Err(ObjstoreError::Nvme(nvme_driver::NvmeError::Timeout { .. })) => {}
            other => panic!("round {round}: device 0's write is never answered: expected a timeout, got {other:?}"),
        }
        assert_eq!(pool.devices[1].mirror.dirty_blocks(), 0, "round {round}: device 1 synced all the same");
    }
    assert!(pool.metadata_fenced(0), "fenced after {HEADER_SYNC_FAILURES_FENCE} timeouts in a row");
    assert_eq!(pool.devices[0].mirror.dirty_blocks(), 0, "a fenced device's staged sectors are dropped");
    pool.stage_header(1, 7, SlotState::Valid, &record(207)).unwrap();
    let start = Instant::now();
    pool.sync_headers(&mut NoLender).expect("the healthy device syncs once the hanging one is fenced");
    assert!(start.elapsed() < Duration::from_millis(200), "no wait on the fenced device: {:?}", start.elapsed());
    drop(pool);
    hanging.set_faults(FaultPlan::none());
    // Device 0's writes were carried out, only their completions lost: what it holds is not
    // asserted.
    let (pool, _) = Pool::open(targets, Some(&geometry())).unwrap();
    for key in [200, 201, 202, 207] {
        assert_eq!(pool.index().get(key).map(|location| location.device), Some(1), "key {key}");
    }
}

#[test]
fn header_writes_timed_out_early_by_a_callers_deadline_do_not_count_toward_the_fence() {
    // Goal: a sync bounded by a caller's deadline (a `wait`'s) that times out before the
    // metadata timeout says nothing about the device: however many in a row, the device is
    // not fenced (its own queue pair is deleted each time, its sectors stay staged); the
    // counted timeouts are those that waited the whole metadata timeout.
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let (device, targets) = start(config);
    format(&targets, geometry());
    let (mut pool, _) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
    pool.set_metadata_timeout(Duration::from_secs(2));
    device.set_faults(
        FaultPlan::none().with_rule(FaultRule::every_nth_io(1, FaultAction::DropCompletion).with_opcode(NvmOpcode::Write as u8)),
    );
    pool.stage_header(0, 3, SlotState::Empty, &[]).unwrap();
    for round in 0..2 * HEADER_SYNC_FAILURES_FENCE {
        match pool.sync_headers_by(&mut NoLender, Some(Instant::now() + Duration::from_millis(50))) {
            Err(ObjstoreError::Nvme(nvme_driver::NvmeError::Timeout { .. })) => {}
            other => panic!("round {round}: expected a timeout, got {other:?}"),
        }
        assert!(!pool.metadata_fenced(0), "fenced after {} early timeouts", round + 1);
        assert_eq!(pool.devices[0].mirror.dirty_blocks(), 1, "the sector stays staged");
    }
    device.set_faults(FaultPlan::none());
    pool.sync_headers(&mut NoLender).expect("the device answers again");
}

#[test]
fn a_header_sync_that_fails_once_does_not_fence() {
    // Goal: a transient error status on a header write fails that sync only; the next sync
    // writes the still-staged sectors and resets the count, so occasional errors never add up
    // to a fence.
    use nvme_driver::spec::{NvmeStatus, StatusCodeType};
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let (device, targets) = start(config);
    format(&targets, geometry());
    let (mut pool, _) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
    let write_fault = FaultAction::Status(NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, 0x80));
    for round in 0..2 * HEADER_SYNC_FAILURES_FENCE {
        device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, write_fault).with_opcode(NvmOpcode::Write as u8)));
        let records = [crate::format::BlockRecord { key: 300 + u64::from(round), token_count: 16, payload_crc: 0 }];
        pool.stage_header(0, round, SlotState::Valid, &records).unwrap();
        assert!(pool.sync_headers(&mut NoLender).is_err(), "round {round}: the first write fails");
        pool.sync_headers(&mut NoLender).expect("the retry writes the staged sector");
        assert!(!pool.metadata_fenced(0), "round {round}");
    }
    drop(pool);
    let (_, report) = Pool::open(targets, Some(&geometry())).unwrap();
    assert_eq!(report.valid_slots, u64::from(2 * HEADER_SYNC_FAILURES_FENCE));
}

#[test]
fn a_device_whose_flushes_keep_failing_is_fenced_even_while_its_header_writes_succeed() {
    // Goal: a device answering every Flush with an error status fails each commit placed on it
    // (the commit writes no header); after HEADER_SYNC_FAILURES_FENCE failed flushes in a row it
    // is fenced, so new stores go elsewhere. Header syncs that succeed on it meanwhile (other
    // commits' headers, the failed ones restaged Empty) keep their own count and do not reset
    // the flushes'. Before, a failed flush counted for nothing and the device was never fenced.
    use nvme_driver::spec::{NvmeStatus, StatusCodeType};
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let (device, targets) = start(config);
    format(&targets, geometry());
    let (mut pool, _) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
    let flush_fault = FaultAction::Status(NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, 0x80));
    device.set_faults(FaultPlan::none().with_rule(FaultRule::every_nth_io(1, flush_fault).with_opcode(NvmOpcode::Flush as u8)));
    for round in 0..HEADER_SYNC_FAILURES_FENCE {
        assert!(!pool.metadata_fenced(0), "fenced after {round} failed flushes");
        pool.stage_header(0, round, SlotState::Empty, &[]).unwrap();
        pool.sync_headers(&mut NoLender).expect("header writes still succeed");
        assert!(pool.flush(&[true], &mut NoLender).is_err(), "round {round}: the flush fails");
    }
    assert!(pool.metadata_fenced(0), "fenced after {HEADER_SYNC_FAILURES_FENCE} failed flushes in a row");
    assert!(matches!(pool.stage_header(0, 9, SlotState::Empty, &[]), Err(ObjstoreError::MetadataFenced { device: 0, .. })));

    // A flush that fails now and then never adds up to a fence.
    drop(pool);
    let (mut pool, _) = Pool::open(targets, Some(&geometry())).unwrap();
    for round in 0..2 * HEADER_SYNC_FAILURES_FENCE {
        device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, flush_fault).with_opcode(NvmOpcode::Flush as u8)));
        assert!(pool.flush(&[true], &mut NoLender).is_err(), "round {round}: the first flush fails");
        pool.flush(&[true], &mut NoLender).expect("the next one succeeds");
        assert!(!pool.metadata_fenced(0), "round {round}");
    }
}

#[test]
fn recovery_keeps_the_newest_copy_of_each_block_across_three_overlapping_slots() {
    // Goal: recovery resolves duplicate keys block by block, whatever order it reads the slots
    // in. Slots X (oldest: keys a, b), N (b, c) and Y (newest: c), k = 2, as a crash between an
    // eviction's data and its Empty header can leave them: the newest copy of each key is
    // a in X, b in N, c in Y, so all three stay served and no slot is freed. Recovery used to
    // resolve whole slots in slot order: reading X, N, Y, N's b dropped X (and a with it),
    // then Y's c dropped N (and b with it); only c survived. Every placement of the three
    // slots is tried (recovery reads slots in slot order).
    let (a, b, c) = (101, 102, 103);
    let record = |key| crate::format::BlockRecord { key, token_count: 16, payload_crc: 0 };
    for slots in [[1, 2, 3], [1, 3, 2], [2, 1, 3], [2, 3, 1], [3, 1, 2], [3, 2, 1]] {
        let config =
            EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
        let (_device, targets) = start(config);
        let params = FormatParams { blocks_per_slot: 2, slot_count_max: Some(8), ..FormatParams::new(geometry()) };
        format_pool(&targets, &params).unwrap();
        let (mut pool, _) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
        let [x, n, y] = slots;
        // Staged in generation order: X, then N, then Y.
        pool.stage_header(0, x, SlotState::Valid, &[record(a), record(b)]).unwrap();
        pool.stage_header(0, n, SlotState::Valid, &[record(b), record(c)]).unwrap();
        pool.stage_header(0, y, SlotState::Valid, &[record(c)]).unwrap();
        pool.sync_headers(&mut NoLender).unwrap();
        drop(pool);
        let (pool, report) = Pool::open(targets, Some(&geometry())).unwrap();
        let at = |key| pool.index().get(key).map(|location| (location.slot, location.index));
        assert_eq!([at(a), at(b), at(c)], [Some((x, 0)), Some((n, 0)), Some((y, 0))], "X, N, Y in slots {slots:?}: {report:?}");
        assert_eq!((report.valid_slots, report.cached_blocks, report.duplicate_slots), (3, 3, 0), "slots {slots:?}");
    }
}

#[test]
fn a_header_sync_longer_than_its_queue_ends_at_the_callers_deadline() {
    // Goal: a sync whose dirty runs outnumber what its queue holds drains the queue several
    // times; all of those drains together stay within the caller's deadline. Each drain used to
    // get the whole time left at the start, so 12 runs on a queue taking 3 waited ~4 command
    // latencies against a deadline of 1.5.
    use nvme_emu::TimingModel;
    let latency = Duration::from_millis(300);
    let timing =
        TimingModel { read_bytes_per_s: 1 << 30, write_bytes_per_s: 1 << 30, mixed_share_permille: 1000, command_latency: latency };
    // A queue of 4 entries holds 3 commands.
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 32 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, None)])
        .with_max_queue_entries(4)
        .with_timing(Some(timing));
    let (_device, targets) = start(config);
    format(&targets, geometry());
    let (mut pool, report) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
    pool.set_metadata_timeout(Duration::from_secs(10));
    // 8 entries per LBA: every 16th slot is its own run of one LBA.
    assert!(report.slots >= 12 * 16, "{} slots", report.slots);
    for run in 0..12u32 {
        pool.stage_header(0, run * 16, SlotState::Empty, &[]).unwrap();
    }
    assert_eq!(pool.devices[0].mirror.dirty_blocks(), 12);
    let deadline = latency * 3 / 2;
    let start = Instant::now();
    let synced = pool.sync_headers_by(&mut NoLender, Some(start + deadline));
    let elapsed = start.elapsed();
    // The margin is one command latency: retiring the pair may wait for what is in flight.
    assert!(elapsed < deadline + latency, "the sync took {elapsed:?} against a deadline of {deadline:?}: {synced:?}");
    assert!(synced.is_err(), "12 runs at 3 per {latency:?} cannot be durable within {deadline:?}");
    pool.sync_headers(&mut NoLender).expect("without a deadline the sync completes");
    assert_eq!(pool.devices[0].mirror.dirty_blocks(), 0);
}

#[test]
fn an_unreadable_data_sector_fails_its_slot_not_the_payload_check() {
    // Goal: `check_payloads` (`tutti pool check --payload`) reports a slot whose data answers
    // a read with a media error as a bad slot, named, and goes on to check the others. It used
    // to return the bare NVMe error at once: the slot unnamed, every later slot unchecked.
    use nvme_driver::spec::{NvmeStatus, StatusCodeType};
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
    let (device, targets) = start(config);
    let params = FormatParams { slot_count_max: Some(4), payload_crc: true, ..FormatParams::new(geometry()) };
    format_pool(&targets, &params).expect("format");
    let (mut pool, _) = Pool::open(targets.clone(), Some(&geometry())).unwrap();
    // The data regions read zeroes: record the CRC of a zeroed block for slot 0, a wrong one
    // (as if a byte had flipped on disk) for slot 1.
    let zeroed = crc32fast::hash(&vec![0u8; (u64::from(geometry().layers) * 2 * geometry().object_bytes()) as usize]);
    for (slot, crc) in [(0u32, zeroed), (1, zeroed ^ 1)] {
        let records = [crate::format::BlockRecord { key: 100 + u64::from(slot), token_count: 16, payload_crc: crc }];
        pool.stage_header(0, slot, SlotState::Valid, &records).unwrap();
    }
    pool.sync_headers(&mut NoLender).unwrap();
    assert_eq!(pool.check_payloads(Instant::now() + Duration::from_secs(30)).expect("a clean check"), (2, vec![(0, 1)]));
    let media = FaultAction::Status(NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, 0x81));
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, media).with_opcode(NvmOpcode::Read as u8)));
    let checked = pool.check_payloads(Instant::now() + Duration::from_secs(30));
    device.set_faults(FaultPlan::none());
    assert_eq!(checked.expect("the check goes on past the unreadable slot"), (2, vec![(0, 0), (0, 1)]));
}

#[test]
fn more_devices_than_a_pool_holds_are_refused_before_any_is_read() {
    // Goal: `Pool::open` refuses more than 65535 targets (a pool's device index is a u16, as
    // format and check_format already enforce) before it reads anything, instead of reading
    // every superblock and, had they matched, numbering devices past 65535 with a wrapping
    // cast. The first superblock read fails here: `open` used to return that error.
    use nvme_driver::spec::{NvmeStatus, StatusCodeType};
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let (device, targets) = start(EmuConfig::default());
    format(&targets, geometry());
    let media = FaultAction::Status(NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, 0x81));
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, media).with_opcode(NvmOpcode::Read as u8)));
    let reads = device.stats().io(NvmOpcode::Read);
    let many = vec![targets[0].clone(); usize::from(u16::MAX) + 1];
    let opened = Pool::open(many, Some(&geometry()));
    device.set_faults(FaultPlan::none());
    match opened {
        Err(ObjstoreError::PoolMembership { reason, .. }) => assert!(reason.contains("65536 devices"), "{reason}"),
        Err(other) => panic!("expected PoolMembership, got {other}"),
        Ok(_) => panic!("65536 devices opened"),
    }
    assert_eq!(device.stats().io(NvmOpcode::Read), reads, "nothing was read");
}

#[test]
fn a_superblock_recording_more_devices_than_a_pool_holds_is_refused() {
    // Goal: a sealed superblock whose device count is past 65535 (the format refuses such a
    // pool; `Superblock::decode` takes any u32) is refused by `open` as such, not only as a
    // count that differs from the devices given.
    let (_device, targets) = start(EmuConfig::default());
    format(&targets, geometry());
    let mut superblock = read_superblock(&targets[0], 0).unwrap();
    superblock.device_count = u32::from(u16::MAX) + 1;
    let lba = u64::from(superblock.lba_bytes);
    let bytes = SUPERBLOCK_REGION_BYTES.max(lba);
    let buffer = targets[0].controller.dma().allocate(bytes as usize).unwrap();
    buffer.fill(0, buffer.len(), 0).unwrap();
    buffer.write(0, &superblock.encode()).unwrap();
    let queue = create_metadata_queue(&targets[0].controller).unwrap();
    with_metadata_queue(queue, &[&buffer], |queue| {
        transfer_region(
            queue,
            targets[0].namespace,
            0,
            &buffer,
            0,
            bytes,
            lba,
            Transfer::Write { force_unit_access: true },
            METADATA_TIMEOUT,
        )
    })
    .unwrap();
    assert_eq!(read_superblock(&targets[0], 0).unwrap().device_count, 65536, "it decodes");
    match Pool::open(targets, Some(&geometry())) {
        Err(ObjstoreError::PoolMembership { reason, .. }) => assert!(reason.contains("records 65536 devices"), "{reason}"),
        Err(other) => panic!("expected PoolMembership, got {other}"),
        Ok(_) => panic!("a superblock of 65536 devices opened"),
    }
}

/// A pool of two namespaces on one software controller whose admin commands time out after
/// `admin_timeout`, its metadata timeout `metadata_timeout`.
fn two_namespace_pool(admin_timeout: Duration, metadata_timeout: Duration) -> (Arc<EmuDevice>, Pool) {
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 32 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, Some(8 << 20)), NamespaceConfig::new(512, Some(8 << 20))]);
    let device = EmuDevice::start(config).expect("software controller");
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let config = ControllerConfig { admin_timeout, ..ControllerConfig::default() };
    let controller = Arc::new(Controller::init(backend, config).expect("bring-up"));
    let targets: Vec<PoolTarget> = [1, 2].map(|ns| PoolTarget { controller: controller.clone(), namespace: NamespaceId(ns) }).to_vec();
    format(&targets, geometry());
    let (mut pool, _) = Pool::open(targets, Some(&geometry())).unwrap();
    pool.set_metadata_timeout(metadata_timeout);
    (device, pool)
}

#[test]
fn the_pools_drop_skips_the_header_writes_of_a_fatal_controller() {
    // Goal: Empty headers are staged on both devices; the controller goes fatal (CSTS.CFS) at
    // a flush of device 0, which is fenced for it. Dropping the pool does not write device 1's
    // staged header to the dead controller: it returns within one admin timeout (and a
    // margin). It used to wait out the metadata timeout on the write first.
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let admin_timeout = Duration::from_millis(200);
    let (device, mut pool) = two_namespace_pool(admin_timeout, Duration::from_millis(1500));
    for d in 0..2 {
        pool.stage_header(d, 3, SlotState::Empty, &[]).unwrap();
    }
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::ControllerFatal)));
    assert!(pool.flush(&[true, false], &mut NoLender).is_err());
    assert!(pool.headers_staged(), "device 1's header is still staged");
    let started = Instant::now();
    drop(pool);
    let took = started.elapsed();
    device.set_faults(FaultPlan::none());
    assert!(took < admin_timeout + Duration::from_millis(500), "dropping the pool took {took:?}");
}

#[test]
fn the_pools_drop_waits_one_metadata_timeout_in_all_not_one_per_device() {
    // Goal: the header writes of both devices are never answered (the controller is alive:
    // admin commands work). Dropping the pool gives all of its writes one metadata timeout
    // together, not one per device: it used to take one per device with staged headers.
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let timeout = Duration::from_millis(1000);
    let (device, mut pool) = two_namespace_pool(Duration::from_secs(10), timeout);
    for d in 0..2 {
        pool.stage_header(d, 3, SlotState::Empty, &[]).unwrap();
    }
    device.set_faults(
        FaultPlan::none().with_rule(FaultRule::every_nth_io(1, FaultAction::DropCompletion).with_opcode(NvmOpcode::Write as u8)),
    );
    let started = Instant::now();
    drop(pool);
    let took = started.elapsed();
    device.set_faults(FaultPlan::none());
    assert!(took < timeout + timeout / 2, "dropping the pool took {took:?}");
}

#[test]
fn every_device_gets_the_pools_secret_and_open_refuses_devices_that_disagree() {
    // Goal: format writes one key secret to every device (the one given, else a fresh random
    // one per pool); `open` refuses devices of one pool UUID whose secrets differ (their keys
    // would disagree), and its error prints neither secret, only their non-secret tags.
    let config = EmuConfig::default().with_backing(Backing::Memory { bytes: 48 << 20 }).with_namespaces(vec![
        NamespaceConfig::new(512, Some(8 << 20)),
        NamespaceConfig::new(512, Some(8 << 20)),
        NamespaceConfig::new(512, Some(8 << 20)),
    ]);
    let device = EmuDevice::start(config).expect("software controller");
    let backend: Arc<dyn DeviceBackend> = device;
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"));
    let target = |ns: u32| PoolTarget { controller: controller.clone(), namespace: NamespaceId(ns) };
    let params = |key_secret: Option<KeySecret>| FormatParams { pool_uuid: Some([3; 16]), key_secret, ..FormatParams::new(geometry()) };
    let random = format_pool(&[target(1), target(2)], &params(None)).expect("format");
    assert_eq!(random[0].key_secret, random[1].key_secret, "one secret per pool");
    let again = format_pool(&[target(1), target(2)], &params(None)).expect("format");
    assert_ne!(again[0].key_secret, random[0].key_secret, "a fresh secret per format");
    let first = KeySecret::from_bytes([0xa1; 32]).unwrap();
    let second = KeySecret::from_bytes([0xb2; 32]).unwrap();
    format_pool(&[target(1), target(2)], &params(Some(first))).expect("format");
    let (pool, _) = Pool::open(vec![target(1), target(2)], Some(&geometry())).expect("open");
    assert_eq!((*pool.key_secret(), pool.superblock(1).key_secret), (first, first));
    drop(pool);
    // Device 1 of the same pool UUID, formatted again with another secret beside namespace 3.
    format_pool(&[target(3), target(2)], &params(Some(second))).expect("format");
    match Pool::open(vec![target(1), target(2)], Some(&geometry())) {
        Err(ObjstoreError::PoolMembership { device: 1, reason }) => {
            assert!(reason.contains("key secret") && reason.contains(&first.tag()) && reason.contains(&second.tag()), "{reason}");
            assert!(!reason.contains("a1a1") && !reason.contains("b2b2") && !reason.contains("161"), "{reason}");
        }
        Err(other) => panic!("expected PoolMembership, got {other}"),
        Ok(_) => panic!("devices with different key secrets opened as one pool"),
    }
}

/// `plan_layout` (what tutti pool format, tutti-bench and tuttid check before creating or
/// formatting a device) gives the layout `format_pool` writes, whatever the secret: with the
/// pool's own secret, with none (its stand-in) and with another one, on devices 0 and 1.
#[test]
fn plan_layout_gives_the_layout_format_writes_whatever_the_secret() {
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 32 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, Some(16 << 20)), NamespaceConfig::new(4096, Some(12 << 20))]);
    let device = EmuDevice::start(config).expect("software controller");
    let backend: Arc<dyn DeviceBackend> = device;
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"));
    let targets: Vec<PoolTarget> = [1, 2].map(|ns| PoolTarget { controller: controller.clone(), namespace: NamespaceId(ns) }).to_vec();
    let secret = KeySecret::from_bytes([5; crate::hash::KEY_SECRET_BYTES]).unwrap();
    let params = FormatParams { blocks_per_slot: 2, payload_crc: true, key_secret: Some(secret), ..FormatParams::new(geometry()) };
    let written = format_pool(&targets, &params).expect("format");
    let other = KeySecret::from_bytes([6; crate::hash::KEY_SECRET_BYTES]).unwrap();
    for key_secret in [Some(secret), None, Some(other)] {
        let planning = FormatParams { key_secret, ..params.clone() };
        for (index, (target, superblock)) in targets.iter().zip(&written).enumerate() {
            let namespace = controller.namespace(target.namespace).unwrap();
            let planned = planning.plan_layout(namespace.block_size_bytes, namespace.size_blocks, index as u32, 2).expect("plan");
            let layout = |sb: &Superblock| {
                (sb.slot_count, sb.slot_bytes, sb.header_lba, sb.header_blocks, sb.data_lba, sb.lba_bytes, sb.flags, sb.device_index)
            };
            assert_eq!(layout(&planned), layout(superblock), "device {index}, secret {key_secret:?}");
            assert_eq!(planned.pool_uuid, [0; 16], "a plan names no pool");
        }
    }
    assert_ne!(written[0].slot_count, written[1].slot_count, "the two namespaces plan differently: the test compares per device");
}
