//! Zeroing bounds: one Dataset Management (deallocate) command's work is at most the namespace
//! once, however many and however large its ranges, and it, like a Write Zeroes of up to 4 GiB,
//! gives way to a controller reset.

use std::time::{Duration, Instant};

use nvme_driver::hw::DeviceBackend;
use nvme_driver::spec::command::{DatasetRange, IdentifyCns};
use nvme_driver::spec::registers::{self, ShutdownStatus};
use nvme_driver::spec::SubmissionEntry;
use nvme_driver::{CommandId, Lba, NamespaceId};

use super::harness::{block_count, read_block, status_of, with_sgl, write_block, TestHost};
use crate::{Backing, EmuConfig, NamespaceConfig};

/// Most ranges one Dataset Management command carries (NR = FFh).
const RANGES_MAX: usize = 256;

/// A deallocate of `RANGES_MAX` copies of `range` with its range list in host memory (kept
/// alive by the returned region).
fn deallocate_repeated(host: &TestHost, range: DatasetRange) -> (SubmissionEntry, nvme_driver::hw::DmaRegion) {
    let list = host.buffer(RANGES_MAX * DatasetRange::BYTES);
    for index in 0..RANGES_MAX {
        list.write(index * DatasetRange::BYTES, &range.to_bytes()).unwrap();
    }
    let mut entry = SubmissionEntry::deallocate(NamespaceId(1), RANGES_MAX as u32);
    entry.dptr[0] = list.iova().0;
    (entry, list)
}

fn whole_namespace(blocks: u64) -> DatasetRange {
    DatasetRange { context_attributes: 0, blocks: u32::try_from(blocks).unwrap(), start: Lba(0) }
}

#[test]
fn a_deallocate_of_256_whole_namespace_ranges_gives_way_to_a_reset_within_cap_to() {
    // Goal: a host (or one restricted client) cannot hold the controller thread with one DSM:
    // 256 copies of a whole 1 GiB namespace (the memory store maps lazily, so this costs no
    // RAM) once took 256 passes over the namespace on the controller thread, and a CC.EN = 0
    // written meanwhile waited for all of them. RDY must read 0 within CAP.TO.
    const STORE_BYTES: u64 = 1 << 30;
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: STORE_BYTES }).with_namespaces(vec![NamespaceConfig::new(4096, None)]);
    let cap_to = Duration::from_millis(500 * u64::from(config.ready_timeout_500ms_units));
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 8);
    write_block(&host, &mut queue, 5, 0xAB);
    let (entry, _list) = deallocate_repeated(&host, whole_namespace(STORE_BYTES / 4096));
    TestHost::push(&mut queue, entry);
    host.ring_submission(&queue);
    // Let the controller thread take the command (it may even finish it: that passes too).
    std::thread::sleep(Duration::from_millis(50));
    let cleared = Instant::now();
    host.registers.write32(registers::CC, 0);
    while host.csts().ready() {
        assert!(cleared.elapsed() < cap_to, "CSTS.RDY still 1 {:?} after CC.EN = 0 (CAP.TO {cap_to:?})", cleared.elapsed());
        std::thread::sleep(Duration::from_millis(1));
    }
    // The controller works again after the reset.
    host.enable();
    let mut queue = host.create_io_pair(1, 8);
    write_block(&host, &mut queue, 7, 0xCD);
    assert!(read_block(&host, &mut queue, 7).iter().all(|&byte| byte == 0xCD));
}

#[test]
fn a_deallocate_zeroes_each_block_once_however_often_its_ranges_repeat_it() {
    // Goal: where zeroing means writing zeroes (a block device without write-zeroes offload,
    // simulated by refusing the hole punch), 256 copies of a whole-namespace range write the
    // namespace once, not 256 times, and every block reads as zero after the completion.
    const STORE_BYTES: u64 = 4 << 20;
    let path = std::env::temp_dir().join(format!("nvme-emu-deallocate-once-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let config = EmuConfig::default()
        .with_backing(Backing::File { path: path.clone(), create_bytes: Some(STORE_BYTES) })
        .with_namespaces(vec![NamespaceConfig::new(4096, None)])
        .with_volatile_write_cache(false);
    let mut host = TestHost::start(config);
    let _ = std::fs::remove_file(&path);
    let mut queue = host.create_io_pair(1, 8);
    write_block(&host, &mut queue, 0, 0x11);
    write_block(&host, &mut queue, STORE_BYTES / 4096 - 1, 0x22);
    host.device.with_core(|core| core.store.refuse_punch_for_tests());
    let (entry, _list) = deallocate_repeated(&host, whole_namespace(STORE_BYTES / 4096));
    assert_eq!(status_of(&host.execute_on(&mut queue, entry)), Ok(()));
    let written = host.device.with_core(|core| core.store.zeroes_written_bytes());
    assert_eq!(written, STORE_BYTES, "zero bytes the fallback wrote for 256 copies of the whole namespace");
    assert!(read_block(&host, &mut queue, 0).iter().all(|&byte| byte == 0));
    assert!(read_block(&host, &mut queue, STORE_BYTES / 4096 - 1).iter().all(|&byte| byte == 0));
}

#[test]
fn overlapping_and_adjacent_ranges_are_zeroed_and_nothing_else() {
    // Goal: merging ranges keeps exactly their union: blocks in any range read as zero, the
    // blocks between and around them keep their data, and zero-length ranges do nothing.
    let config =
        EmuConfig::default().with_backing(Backing::Memory { bytes: 1 << 20 }).with_namespaces(vec![NamespaceConfig::new(4096, None)]);
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 8);
    for lba in 0..16 {
        write_block(&host, &mut queue, lba, 0x40 + lba as u8);
    }
    // Unsorted, overlapping (2..6 and 4..8), adjacent (8..9 after 4..8), empty (at 12), and
    // apart (10..11, 14..15).
    let ranges = [(4u64, 4u32), (10, 1), (2, 4), (8, 1), (12, 0), (14, 1), (3, 1)];
    let list = host.buffer(4096);
    for (index, (start, blocks)) in ranges.iter().enumerate() {
        let range = DatasetRange { context_attributes: 0, blocks: *blocks, start: Lba(*start) };
        list.write(index * DatasetRange::BYTES, &range.to_bytes()).unwrap();
    }
    let mut entry = SubmissionEntry::deallocate(NamespaceId(1), ranges.len() as u32);
    entry.dptr[0] = list.iova().0;
    assert_eq!(status_of(&host.execute_on(&mut queue, entry)), Ok(()));
    let zeroed = |lba: u64| (2..9).contains(&lba) || lba == 10 || lba == 14;
    for lba in 0..16 {
        let block = read_block(&host, &mut queue, lba);
        let expected = if zeroed(lba) { 0 } else { 0x40 + lba as u8 };
        assert!(block.iter().all(|&byte| byte == expected), "block {lba}: expected {expected:#x}, read {:#x}", block[0]);
    }
}

#[test]
fn a_write_zeroes_of_4_gib_gives_way_to_a_reset_promptly() {
    // Goal: Write Zeroes is bounded by its NLB (65536 blocks), but of 64 KiB blocks that is
    // 4 GiB, which a store that must write zeroes takes half a minute over: like a deallocate,
    // it looks at CC.EN = 0 between slices, so RDY reads 0 well inside CAP.TO. (A 4 GiB memory
    // store maps lazily: the test costs what it writes, one block.)
    const STORE_BYTES: u64 = 4 << 30;
    const BLOCK_BYTES: u32 = 64 << 10;
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: STORE_BYTES })
        .with_namespaces(vec![NamespaceConfig::new(BLOCK_BYTES, None)]);
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 8);
    let source = host.buffer(BLOCK_BYTES as usize);
    source.fill(0, BLOCK_BYTES as usize, 0xEE).unwrap();
    let write = super::harness::with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(1), block_count(1), false), &source, BLOCK_BYTES);
    assert_eq!(status_of(&host.execute_on(&mut queue, write)), Ok(()));
    TestHost::push(&mut queue, SubmissionEntry::write_zeroes(NamespaceId(1), Lba(0), block_count(65536), false));
    host.ring_submission(&queue);
    std::thread::sleep(Duration::from_millis(50));
    let cleared = Instant::now();
    host.registers.write32(registers::CC, 0);
    // A slice is 64 MiB, about 0.1 s unoptimized here; the whole 4 GiB took 6 s before it was
    // sliced. 3 s leaves room for a loaded machine.
    let bound = Duration::from_secs(3);
    while host.csts().ready() {
        assert!(cleared.elapsed() < bound, "CSTS.RDY still 1 {:?} after CC.EN = 0", cleared.elapsed());
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Blocks of the slowly zeroed store: 8 MiB of 4 KiB blocks.
const SLOW_STORE_BLOCKS: u64 = 2048;
/// Its zeroing: 4 blocks, then 20 ms, so the whole namespace takes about 10 s.
const SLOW_SLICE: (u64, Duration) = (4 * 4096, Duration::from_millis(20));
/// How long a host-side call (drop, power loss, function reset) may wait for a zeroing to
/// give way: a slice and the lock handover, with room for a loaded machine.
const GIVE_WAY: Duration = Duration::from_secs(1);

/// A file-backed controller (write cache off) whose store refuses hole punching and zeroes
/// slowly (see [`SLOW_SLICE`]), with an I/O queue pair.
fn slow_zeroing(path: &std::path::Path, create: bool) -> (TestHost, super::harness::HostQueue) {
    let create_bytes = create.then_some(SLOW_STORE_BLOCKS * 4096);
    let config = EmuConfig::default()
        .with_backing(Backing::File { path: path.to_path_buf(), create_bytes })
        .with_namespaces(vec![NamespaceConfig::new(4096, None)])
        .with_volatile_write_cache(false);
    let mut host = TestHost::start(config);
    host.device.with_core(|core| {
        core.store.refuse_punch_for_tests();
        core.zeroing_slice_for_tests = Some(SLOW_SLICE);
    });
    let queue = host.create_io_pair(1, 8);
    (host, queue)
}

/// [`slow_zeroing`] on a file of its own, made for it and unlinked at once (the device keeps it
/// open): nothing is left behind whatever the test does.
fn slow_zeroing_unlinked(name: &str) -> (TestHost, super::harness::HostQueue) {
    let path = std::env::temp_dir().join(format!("nvme-emu-{name}-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let opened = slow_zeroing(&path, true);
    let _ = std::fs::remove_file(&path);
    opened
}

/// Rings a deallocate of the whole slow namespace and gives the controller time to start it.
fn start_slow_deallocate(host: &TestHost, queue: &mut super::harness::HostQueue) -> nvme_driver::hw::DmaRegion {
    let (entry, list) = deallocate_repeated(host, whole_namespace(SLOW_STORE_BLOCKS));
    TestHost::push(queue, entry);
    host.ring_submission(queue);
    std::thread::sleep(Duration::from_millis(200));
    list
}

#[test]
fn dropping_the_device_mid_deallocate_stops_its_zeroing() {
    // Goal: a device dropped while a deallocate writes zeroes (a store that cannot punch holes)
    // stops the zeroing at the next slice and joins its thread, instead of waiting 5 s and
    // then leaving a detached thread writing zeroes into the file: a device opened on the file
    // again keeps what it writes there. Until 2026-12-01 the zeroing looked only at CC.EN.
    let path = std::env::temp_dir().join(format!("nvme-emu-drop-mid-zeroing-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let (host, mut queue) = slow_zeroing(&path, true);
    let _list = start_slow_deallocate(&host, &mut queue);
    let dropping = Instant::now();
    drop(host);
    let took = dropping.elapsed();
    assert!(took < GIVE_WAY, "dropping the device waited {took:?} for the zeroing");
    // 200 blocks per second: the old zeroing, were it still running, reaches block 150 within
    // a second of the drop.
    let (host, mut queue) = slow_zeroing(&path, false);
    write_block(&host, &mut queue, 150, 0x5A);
    std::thread::sleep(GIVE_WAY);
    let block = read_block(&host, &mut queue, 150);
    drop(host);
    let _ = std::fs::remove_file(&path);
    assert!(block.iter().all(|&byte| byte == 0x5A), "the dropped device's zeroing overwrote a later write");
}

#[test]
fn a_power_loss_and_a_function_reset_preempt_a_long_deallocate() {
    // Goal: power_loss() and function_reset() called while a deallocate writes zeroes return
    // within a slice, not after the whole zeroing (they wait for the controller's lock, which
    // the zeroing holds): the zeroing gives way, its command gets no completion (the stop
    // deletes its queue), and the controller serves I/O after a new bring-up. Until 2026-12-01
    // both waited for the whole namespace to be zeroed.
    let (mut host, mut queue) = slow_zeroing_unlinked("preempt-zeroing");
    let _list = start_slow_deallocate(&host, &mut queue);
    let cut = Instant::now();
    host.device.power_loss();
    let took = cut.elapsed();
    assert!(took < GIVE_WAY, "power_loss() waited {took:?} for the zeroing");
    assert!(TestHost::try_reap(&mut queue).is_none(), "the deallocate the power loss cut short completed");
    host.enable();
    let mut queue = host.create_io_pair(1, 8);
    let _list = start_slow_deallocate(&host, &mut queue);
    let reset = Instant::now();
    host.device.function_reset().expect("function reset");
    let took = reset.elapsed();
    assert!(took < GIVE_WAY, "function_reset() waited {took:?} for the zeroing");
    assert!(TestHost::try_reap(&mut queue).is_none(), "the deallocate the function reset cut short completed");
    host.enable();
    let mut queue = host.create_io_pair(1, 8);
    write_block(&host, &mut queue, 7, 0xCD);
    assert!(read_block(&host, &mut queue, 7).iter().all(|&byte| byte == 0xCD));
}

#[test]
fn the_refusal_count_is_read_without_waiting_for_a_long_deallocate() {
    // Goal: tuttid reads the restriction refusal count under its own store lock; during a
    // deallocate that writes zeroes for seconds (the controller's lock held throughout),
    // `restriction_refusals()` still answers at once. Before 2026-12-01 the count was only in
    // `stats()`, which waits for that lock: about 10 s here.
    let (host, mut queue) = slow_zeroing_unlinked("refusals-mid-zeroing");
    let _list = start_slow_deallocate(&host, &mut queue);
    let asked = Instant::now();
    assert_eq!(host.device.restriction_refusals(), 0);
    let took = asked.elapsed();
    assert!(took < Duration::from_millis(100), "restriction_refusals() waited {took:?}");
    // Ends the zeroing now rather than at its end (see the test above).
    host.device.power_loss();
}

#[test]
fn the_controller_answers_other_calls_between_the_slices_of_a_long_deallocate() {
    // Goal: a deallocate that writes zeroes for seconds runs a slice per poll, releasing the
    // controller's lock between slices: `stats()` and `preset_restriction()` (tuttid calls both
    // under its store lock) answer within a slice, and the deallocate still completes with
    // every block of the namespace reading as zero. Until 2026-12-01 the zeroing held the lock
    // for its whole run, and both waited for it (about 10 s here).
    let (host, mut queue) = slow_zeroing_unlinked("calls-mid-zeroing");
    write_block(&host, &mut queue, SLOW_STORE_BLOCKS - 1, 0x77);
    let _list = start_slow_deallocate(&host, &mut queue);
    let answer_within = Duration::from_millis(300);
    let asked = Instant::now();
    let _ = host.device.stats();
    let took = asked.elapsed();
    assert!(took < answer_within, "stats() waited {took:?} for the zeroing");
    let ring = host.buffer(4096);
    let asked = Instant::now();
    let preset = host.device.preset_restriction(ring.iova(), crate::QueueRestriction::new()).expect("preset");
    drop(preset);
    let took = asked.elapsed();
    assert!(took < answer_within, "preset_restriction() and its drop waited {took:?} for the zeroing");
    // The rest at full speed.
    host.device.with_core(|core| core.zeroing_slice_for_tests = Some((1 << 20, Duration::ZERO)));
    assert_eq!(status_of(&host.reap(&mut queue)), Ok(()), "the deallocate");
    assert!(read_block(&host, &mut queue, SLOW_STORE_BLOCKS - 1).iter().all(|&byte| byte == 0));
    assert!(read_block(&host, &mut queue, 0).iter().all(|&byte| byte == 0));
}

#[test]
fn a_shutdown_finishes_a_long_deallocate_before_it_reports_complete() {
    // Goal: a long zeroing runs a slice per poll; a shutdown notification that arrives
    // meanwhile finishes it (the command completes, every block reads as zero) before SHST
    // reads complete, as when the zeroing ran in one go and the shutdown came after it.
    let (host, mut queue) = slow_zeroing_unlinked("shutdown-mid-zeroing");
    write_block(&host, &mut queue, SLOW_STORE_BLOCKS - 1, 0x77);
    let _list = start_slow_deallocate(&host, &mut queue);
    // About a second for the rest: the shutdown comes while it runs.
    host.device.with_core(|core| core.zeroing_slice_for_tests = Some((SLOW_SLICE.0, Duration::from_millis(2))));
    let configuration = host.registers.read32(registers::CC);
    host.registers.write32(registers::CC, configuration & !(0x3 << 14) | 1 << 14);
    host.wait_shutdown(ShutdownStatus::Complete);
    let completion = TestHost::try_reap(&mut queue).expect("the deallocate completed before SHST read complete");
    assert_eq!(status_of(&completion), Ok(()), "the deallocate");
    let mut media = vec![0u8; 4096];
    host.device.with_core(|core| core.store.read((SLOW_STORE_BLOCKS - 1) * 4096, &mut media)).unwrap();
    assert!(media.iter().all(|&byte| byte == 0), "the last block on media");
}

/// A deallocate of blocks `0..blocks` of the slow namespace, rung on `queue`, with time for
/// the controller to start it.
fn start_slow_deallocate_of(host: &TestHost, queue: &mut super::harness::HostQueue, blocks: u64) -> nvme_driver::hw::DmaRegion {
    let (entry, list) =
        deallocate_repeated(host, DatasetRange { context_attributes: 0, blocks: u32::try_from(blocks).unwrap(), start: Lba(0) });
    TestHost::push(queue, entry);
    host.ring_submission(queue);
    std::thread::sleep(Duration::from_millis(200));
    list
}

/// One block of `byte` at `lba`, as a Write pushed (not rung) on `queue`; the buffer keeps it.
fn push_write(host: &TestHost, queue: &mut super::harness::HostQueue, lba: u64, byte: u8) -> nvme_driver::hw::DmaRegion {
    let source = host.buffer(4096);
    source.fill(0, 4096, byte).unwrap();
    TestHost::push(queue, with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(lba), block_count(1), false), &source, 4096));
    source
}

/// One block at `lba`, as a Read pushed (not rung) on `queue`, into the returned buffer.
fn push_read(host: &TestHost, queue: &mut super::harness::HostQueue, lba: u64) -> nvme_driver::hw::DmaRegion {
    let target = host.buffer(4096);
    TestHost::push(queue, with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(lba), block_count(1)), &target, 4096));
    target
}

fn filled_with(region: &nvme_driver::hw::DmaRegion, byte: u8) -> bool {
    let mut out = vec![0u8; 4096];
    region.read(0, &mut out).unwrap();
    out.iter().all(|&value| value == byte)
}

#[test]
fn commands_outside_a_long_zeroing_run_while_it_runs_and_those_inside_wait_for_it() {
    // Goal: while a deallocate of blocks 0..1024 writes zeroes (about 5 s here), a Write, a
    // Read and a Flush of blocks it does not touch, on another queue or on its own, and an
    // Identify, complete within a second; a Read of a block it still has to zero waits and
    // reads zeroes, and a Write there waits, so the zeroing never overwrites it. Until
    // 2026-12-01 every command waited for the whole zeroing.
    let (mut host, mut queue) = slow_zeroing_unlinked("disjoint-mid-zeroing");
    let mut other = host.create_io_pair(2, 8);
    let mut third = host.create_io_pair(3, 8);
    write_block(&host, &mut queue, 1000, 0x22);
    write_block(&host, &mut queue, 1001, 0x23);
    write_block(&host, &mut queue, 1500, 0x15);
    let started = Instant::now();
    let _list = start_slow_deallocate_of(&host, &mut queue, 1024);
    let within = Duration::from_secs(1);
    let _source = push_write(&host, &mut other, 2000, 0x33);
    host.ring_submission(&other);
    let completion = host.reap_within(&mut other, within).expect("a write outside the zeroing completed while it ran");
    assert_eq!(status_of(&completion), Ok(()));
    let target = push_read(&host, &mut other, 2000);
    host.ring_submission(&other);
    let completion = host.reap_within(&mut other, within).expect("a read outside the zeroing completed while it ran");
    assert_eq!(status_of(&completion), Ok(()));
    assert!(filled_with(&target, 0x33));
    // On the deallocate's own queue, in a later batch.
    let target = push_read(&host, &mut queue, 1500);
    host.ring_submission(&queue);
    let completion = host.reap_within(&mut queue, within).expect("a read on the zeroing's queue completed while it ran");
    assert_eq!(status_of(&completion), Ok(()));
    assert!(filled_with(&target, 0x15));
    TestHost::push(&mut other, SubmissionEntry::flush(NamespaceId(1)));
    host.ring_submission(&other);
    let completion = host.reap_within(&mut other, within).expect("a flush completed while the zeroing ran");
    assert_eq!(status_of(&completion), Ok(()));
    let identify = host.buffer(4096);
    let mut admin = host.admin.clone();
    TestHost::push(&mut admin, SubmissionEntry::identify(IdentifyCns::Controller, 0, identify.iova().0));
    host.ring_submission(&admin);
    let completion = host.reap_within(&mut admin, within).expect("an Identify completed while the zeroing ran");
    host.admin = admin;
    assert_eq!(status_of(&completion), Ok(()));
    assert!(started.elapsed() < Duration::from_secs(3), "the checks above took {:?}", started.elapsed());
    // Inside what it still has to zero (it goes from block 0 up, 200 blocks a second): a Read,
    // and a Write alone on a queue of its own (behind the Read it would wait anyway).
    let inside = push_read(&host, &mut other, 1000);
    host.ring_submission(&other);
    let _source = push_write(&host, &mut third, 1001, 0x44);
    host.ring_submission(&third);
    assert!(TestHost::try_reap_within(&mut other, Duration::from_millis(200)).is_none(), "a read inside the zeroing ran before it");
    assert!(TestHost::try_reap(&mut third).is_none(), "a write inside the zeroing ran before it");
    host.device.with_core(|core| core.zeroing_slice_for_tests = Some((1 << 20, Duration::ZERO)));
    assert_eq!(status_of(&host.reap(&mut queue)), Ok(()), "the deallocate");
    assert_eq!(status_of(&host.reap(&mut other)), Ok(()), "the read inside");
    assert!(filled_with(&inside, 0), "a read inside the zeroing's range saw stale data");
    assert_eq!(status_of(&host.reap(&mut third)), Ok(()), "the write inside");
    assert!(read_block(&host, &mut other, 1001).iter().all(|&byte| byte == 0x44), "the zeroing overwrote a later write");
    assert!(read_block(&host, &mut other, 1000).iter().all(|&byte| byte == 0));
    assert!(read_block(&host, &mut other, 2000).iter().all(|&byte| byte == 0x33));
}

#[test]
fn a_shutdown_during_a_long_deallocate_does_not_hold_the_controllers_lock_for_it() {
    // Goal: a shutdown notification that arrives while a deallocate writes zeroes (about 10 s
    // here) lets the zeroing go on a slice per poll, releasing the controller's lock between
    // slices, and reports SHST complete only once it finished (the command completed, every
    // block reads as zero on media). `stats()` answers meanwhile within a slice. Until
    // 2026-12-01 the shutdown ran the rest of the zeroing in one poll, under the lock, and
    // `stats()` waited for all of it.
    let (host, mut queue) = slow_zeroing_unlinked("shutdown-lock-mid-zeroing");
    write_block(&host, &mut queue, SLOW_STORE_BLOCKS - 1, 0x77);
    let _list = start_slow_deallocate(&host, &mut queue);
    let configuration = host.registers.read32(registers::CC);
    host.registers.write32(registers::CC, configuration & !(0x3 << 14) | 1 << 14);
    // Let the controller thread take the notification.
    std::thread::sleep(Duration::from_millis(100));
    let asked = Instant::now();
    let _ = host.device.stats();
    let took = asked.elapsed();
    assert!(took < Duration::from_millis(300), "stats() waited {took:?} for the shutdown's zeroing");
    assert_eq!(host.csts().shutdown(), ShutdownStatus::Occurring, "SHST while the zeroing runs");
    assert!(TestHost::try_reap(&mut queue).is_none(), "the deallocate completed already");
    // The rest at full speed: the shutdown completes after it.
    host.device.with_core(|core| core.zeroing_slice_for_tests = Some((1 << 20, Duration::ZERO)));
    host.wait_shutdown(ShutdownStatus::Complete);
    let completion = TestHost::try_reap(&mut queue).expect("the deallocate completed before SHST read complete");
    assert_eq!(status_of(&completion), Ok(()), "the deallocate");
    let mut media = vec![0u8; 4096];
    host.device.with_core(|core| core.store.read((SLOW_STORE_BLOCKS - 1) * 4096, &mut media)).unwrap();
    assert!(media.iter().all(|&byte| byte == 0), "the last block on media");
}

#[test]
fn a_reset_while_a_shutdown_waits_for_a_long_deallocate_drops_it_and_the_shutdown_runs_again() {
    // Goal: a host whose shutdown wait runs out clears CC.EN with SHN still set (nvme-driver's
    // teardown): RDY reads 0 within a slice or so, the deallocate gets no completion, and the
    // shutdown runs again on the disabled controller and reads complete.
    let (host, mut queue) = slow_zeroing_unlinked("reset-shutdown-mid-zeroing");
    let _list = start_slow_deallocate(&host, &mut queue);
    let configuration = host.registers.read32(registers::CC);
    let shutting_down = configuration & !(0x3 << 14) | 1 << 14;
    host.registers.write32(registers::CC, shutting_down);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(host.csts().shutdown(), ShutdownStatus::Occurring, "SHST while the zeroing runs");
    let cleared = Instant::now();
    host.registers.write32(registers::CC, shutting_down & !1);
    host.wait_ready(false);
    let took = cleared.elapsed();
    assert!(took < GIVE_WAY, "RDY read 1 for {took:?} after CC.EN = 0");
    host.wait_shutdown(ShutdownStatus::Complete);
    assert!(TestHost::try_reap(&mut queue).is_none(), "the deallocate the reset cut short completed");
}

#[test]
fn a_held_zeroings_completion_keeps_its_slot_in_a_shared_completion_queue() {
    // Goal: a deallocate held for its zeroing owes a completion on its CQ, so commands of
    // another SQ sharing that 4-entry CQ are fetched only while a slot stays for it: the host,
    // which does not ring the CQ head, finds at most 3 entries (a 4th would make the CQ read
    // empty to the controller, whose next completions overwrite unread ones); once it rings
    // the head, the rest complete, each once. Until 2026-12-01 the 3 Reads filled the CQ and
    // the deallocate's completion went into its last slot.
    let (mut host, mut queue) = slow_zeroing_unlinked("shared-cq-mid-zeroing");
    write_block(&host, &mut queue, 1500, 0x15);
    let mut shared = super::harness::HostQueue::new(&*host.dma, 2, 4);
    let mut reads = super::harness::HostQueue::new(&*host.dma, 3, 4);
    let created = host.admin(SubmissionEntry::create_io_completion_queue(2, 4, shared.completion.iova().0));
    assert_eq!(status_of(&created), Ok(()), "create CQ 2");
    for sq in [&shared, &reads] {
        let created = host.admin(SubmissionEntry::create_io_submission_queue(sq.id, 4, sq.submission.iova().0, 2));
        assert_eq!(status_of(&created), Ok(()), "create SQ {}", sq.id);
    }
    let deallocate = CommandId(shared.next_command_id);
    let _list = start_slow_deallocate_of(&host, &mut shared, 1024);
    let targets: Vec<_> = (0..3).map(|_| push_read(&host, &mut reads, 1500)).collect();
    host.ring_submission(&reads);
    std::thread::sleep(Duration::from_millis(300));
    host.device.with_core(|core| core.zeroing_slice_for_tests = Some((1 << 20, Duration::ZERO)));
    let mut seen = Vec::new();
    while let Some(completion) = TestHost::try_reap_within(&mut shared, Duration::from_millis(500)) {
        seen.push(completion);
        assert!(seen.len() < 4, "4 completions in a 4-entry CQ whose head the host never rang: {seen:?}");
    }
    assert!(seen.iter().any(|completion| completion.sq_id == 2), "the deallocate completed in its reserved slot: {seen:?}");
    host.ring_completion(&shared);
    while seen.len() < 4 {
        seen.push(host.reap(&mut shared));
    }
    assert!(TestHost::try_reap_within(&mut shared, Duration::from_millis(200)).is_none(), "a completion too many: {seen:?}");
    let mut ids: Vec<_> = seen.iter().map(|completion| (completion.sq_id, completion.command_id().0)).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![(2, deallocate.0), (3, 1), (3, 2), (3, 3)], "each command completed once");
    assert!(seen.iter().all(|completion| status_of(completion) == Ok(())), "{seen:?}");
    assert!(targets.iter().all(|target| filled_with(target, 0x15)));
}

#[test]
fn an_sq_entry_rewritten_after_the_scan_looked_at_it_runs_as_it_was_looked_at() {
    // Goal: the controller reads an SQ entry once: a host that rewrites a Read the scan let
    // past a held zeroing into a deallocate cannot have that deallocate run (it would start a
    // second zeroing, and the first one's command would never complete). The Read runs, and
    // the held deallocate completes. Until 2026-12-01 the scan read the entry again to fetch it.
    let (mut host, mut queue) = slow_zeroing_unlinked("rewritten-mid-zeroing");
    let mut other = host.create_io_pair(2, 8);
    write_block(&host, &mut queue, 1500, 0x15);
    let _list = start_slow_deallocate_of(&host, &mut queue, 1024);
    let target = push_read(&host, &mut other, 1500);
    let (mut swapped, swapped_list) = deallocate_repeated(&host, DatasetRange { context_attributes: 0, blocks: 1024, start: Lba(1024) });
    swapped.set_command_id(CommandId(1));
    let submission = other.submission.clone();
    let mut armed = true;
    host.device.with_core(move |core| {
        core.after_peek_for_tests = Some(Box::new(move |queue_id, head| {
            let _keep = &swapped_list;
            if queue_id == 2 && std::mem::take(&mut armed) {
                submission.write(head as usize * 64, &swapped.to_bytes()).unwrap();
            }
        }));
    });
    host.ring_submission(&other);
    let completion = host.reap_within(&mut other, Duration::from_secs(1)).expect("the read completed while the zeroing ran");
    assert_eq!(status_of(&completion), Ok(()));
    assert!(filled_with(&target, 0x15), "the command run was not the one the scan looked at");
    host.device.with_core(|core| core.zeroing_slice_for_tests = Some((1 << 20, Duration::ZERO)));
    let completion = host.reap(&mut queue);
    assert_eq!(status_of(&completion), Ok(()), "the held deallocate");
    assert!(read_block(&host, &mut other, 1500).iter().all(|&byte| byte == 0x15), "block 1500 was zeroed");
}

#[test]
fn the_admin_queue_runs_between_the_zeroings_of_one_batch() {
    // Goal: two long deallocates fetched in one batch (a restricted client's whole-share DSMs,
    // say) hold the admin queue back for one zeroing at a time, not for all of them: an admin
    // command a zeroing holds back (Create I/O CQ) rung during the first completes once the
    // first ended, while the second still runs, and the second then completes too. Until
    // 2026-12-01 the rest of the batch ran in the poll the first zeroing ended, so the second
    // started before the admin queue was looked at again: a batch of n held tuttid's admin
    // queue for all n (minutes each on a store that writes zeroes).
    let (mut host, mut queue) = slow_zeroing_unlinked("admin-between-zeroings");
    // 200 blocks each: about 1 s apiece (see SLOW_SLICE).
    let range = |start: u64| DatasetRange { context_attributes: 0, blocks: 200, start: Lba(start) };
    let (first, _first_list) = deallocate_repeated(&host, range(0));
    let (second, _second_list) = deallocate_repeated(&host, range(200));
    let first_id = TestHost::push(&mut queue, first);
    let second_id = TestHost::push(&mut queue, second);
    host.ring_submission(&queue);
    std::thread::sleep(Duration::from_millis(100));
    let ring = host.buffer(4096);
    let rung = Instant::now();
    assert_eq!(status_of(&host.admin(SubmissionEntry::create_io_completion_queue(2, 4, ring.iova().0))), Ok(()));
    let waited = rung.elapsed();
    let done = TestHost::try_reap(&mut queue).expect("the first deallocate completed before the admin command ran");
    assert_eq!((done.command_id(), status_of(&done)), (first_id, Ok(())));
    assert!(TestHost::try_reap(&mut queue).is_none(), "the admin command waited for the second zeroing too ({waited:?})");
    let done = host.reap_within(&mut queue, Duration::from_secs(5)).expect("the second deallocate completes");
    assert_eq!((done.command_id(), status_of(&done)), (second_id, Ok(())));
}

#[test]
fn deleting_the_queue_of_a_batch_waiting_behind_a_zeroing_waits_for_the_rest_to_complete() {
    // Goal: the one admin command that still waits, between the zeroings of one batch, for the
    // rest of the batch: a Delete I/O SQ of its own queue. Rung during the first of two long
    // deallocates in one batch, it completes only after both did (both completions are in the
    // CQ when it returns), so the rest never runs on a deleted queue.
    let (mut host, mut queue) = slow_zeroing_unlinked("delete-behind-zeroing");
    let range = |start: u64| DatasetRange { context_attributes: 0, blocks: 100, start: Lba(start) };
    let (first, _first_list) = deallocate_repeated(&host, range(0));
    let (second, _second_list) = deallocate_repeated(&host, range(100));
    let ids = [TestHost::push(&mut queue, first), TestHost::push(&mut queue, second)];
    host.ring_submission(&queue);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(status_of(&host.admin(SubmissionEntry::delete_io_submission_queue(1))), Ok(()));
    for id in ids {
        let done = TestHost::try_reap(&mut queue).expect("a deallocate of the batch completed before its queue was deleted");
        assert_eq!((done.command_id(), status_of(&done)), (id, Ok(())));
    }
}
