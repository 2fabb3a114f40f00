//! Resets, shutdown, log counters, fault filters, unaligned file I/O: the less common paths.

use std::time::{Duration, Instant};

use nvme_driver::hw::{DeviceBackend, DmaRegion, RegisterIo};
use nvme_driver::spec::command::LogPageId;
use nvme_driver::spec::registers::{self, ControllerConfiguration, ShutdownStatus};
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{AdminOpcode, NvmOpcode, NvmeStatus, SubmissionEntry};
use nvme_driver::{Lba, NamespaceId};

use super::harness::{block_count, read_block, status_of, with_sgl, write_block, TestHost, DEADLINE};
use crate::device::SleepBarrier;
use crate::{Backing, EmuConfig, FaultAction, FaultPlan, FaultRule, NamespaceConfig, QueueFilter};

fn memory_config() -> EmuConfig {
    EmuConfig::default().with_backing(Backing::Memory { bytes: 8 << 20 })
}

#[test]
fn shutdown_and_function_reset_write_the_cache_back() {
    // Goal: a normal shutdown and a function reset make cached writes durable (unlike power loss).
    let mut host = TestHost::start(memory_config());
    let mut queue = host.create_io_pair(1, 8);
    write_block(&host, &mut queue, 1, 0x11);
    host.registers.write32(registers::CC, ControllerConfiguration::for_enable().0 | 1 << 14);
    host.wait_shutdown(ShutdownStatus::Complete);
    host.device.power_loss();
    host.enable();
    let mut queue = host.create_io_pair(1, 8);
    assert!(read_block(&host, &mut queue, 1).iter().all(|&b| b == 0x11), "shutdown flushed the cache");

    write_block(&host, &mut queue, 2, 0x22);
    host.device.function_reset().unwrap();
    assert!(!host.csts().ready(), "function reset disables the controller");
    host.device.power_loss();
    host.enable();
    let mut queue = host.create_io_pair(1, 8);
    assert!(read_block(&host, &mut queue, 2).iter().all(|&b| b == 0x22), "function reset flushed the cache");
}

#[test]
fn a_disable_written_during_a_shutdown_on_a_disabled_controller_does_not_stop_it() {
    // Goal: a shutdown notification on a disabled controller (SHN set after a reset, or left
    // set through one as nvme-driver's teardown does), with the host writing CC.EN = 0 again
    // while it runs, still writes the cache back and reads SHST complete: no reset acts on a
    // disabled controller, so the shutdown must not give way to that write. Until 2026-12-01
    // (879764a) it did, returning at SHST 01b, and a notification is run again only from SHST
    // 0, so SHST stayed 01b until the host cleared SHN.
    let mut host = TestHost::start(memory_config());
    let mut queue = host.create_io_pair(1, 8);
    write_block(&host, &mut queue, 1, 0x33);
    host.registers.write32(registers::CC, 0);
    host.wait_ready(false);
    let shutdown = 1 << 14;
    host.device.with_core(|core| {
        core.before_shutdown_wait_for_tests = Some(Box::new(move |registers| registers.write32(registers::CC, shutdown)));
    });
    host.registers.write32(registers::CC, shutdown);
    host.wait_shutdown(ShutdownStatus::Complete);
    assert!(!host.csts().fatal(), "the shutdown failed: {:?}", host.csts());
    assert!(host.device.with_core(|core| core.before_shutdown_wait_for_tests.is_none()), "the disable was written during the shutdown");
    host.device.power_loss();
    host.enable();
    let mut queue = host.create_io_pair(1, 8);
    assert!(read_block(&host, &mut queue, 1).iter().all(|&b| b == 0x33), "the shutdown wrote the cache back");
}

#[test]
fn a_doorbell_wakes_the_sleeping_controller_with_either_barrier() {
    // Goal: the sleep handshake loses no doorbell, with the membarrier handshake (where this
    // kernel has it) and with fences on both sides. After 400 ms idle the controller sleeps in
    // stretches of ~330 ms (doubling from 5 µs, capped at 10 s here), so a doorbell whose
    // wake-up was lost would wait that long; one that woke it is served at once.
    let mut barriers = vec![SleepBarrier::detect()];
    if barriers[0] != SleepBarrier::Fence {
        barriers.push(SleepBarrier::Fence);
    }
    for barrier in barriers {
        let config = EmuConfig { idle_sleep_max: Duration::from_secs(10), ..memory_config() };
        let mut host = TestHost::start_with_barrier(config, barrier);
        let mut queue = host.create_io_pair(1, 8);
        for round in 0..3 {
            std::thread::sleep(Duration::from_millis(400));
            let started = Instant::now();
            write_block(&host, &mut queue, round, 0x5a);
            let waited = started.elapsed();
            assert!(waited < Duration::from_millis(100), "{barrier:?}, round {round}: a write took {waited:?} after an idle period");
        }
    }
}

#[test]
fn smart_log_counts_host_commands_and_data_units() {
    // Goal: the SMART log reflects the I/O done (what a host tool would show).
    let mut host = TestHost::start(memory_config());
    let mut queue = host.create_io_pair(1, 8);
    for lba in 0..3 {
        write_block(&host, &mut queue, lba, 1);
    }
    read_block(&host, &mut queue, 0);
    host.device.power_loss();
    host.enable();
    let page = host.buffer(4096);
    let smart = host.admin(SubmissionEntry::get_log_page(LogPageId::SmartHealth, 0, 128, page.iova().0));
    assert_eq!(status_of(&smart), Ok(()));
    let mut log = [0u8; 512];
    page.read(0, &mut log).unwrap();
    let counter = |offset: usize| u64::from_le_bytes(log[offset..offset + 8].try_into().unwrap());
    assert_eq!(counter(48), 1, "data units written: 12 KiB rounds up to one unit of 512,000 bytes");
    assert_eq!(counter(32), 1, "data units read");
    assert_eq!((counter(64), counter(80)), (1, 3), "host read / write commands");
    assert_eq!((counter(112), counter(144)), (2, 1), "power cycles / unsafe shutdowns");
}

#[test]
fn fault_rules_filter_by_queue_and_opcode() {
    // Goal: an opcode filter counts only that opcode; an admin rule leaves I/O alone.
    let mut host = TestHost::start(memory_config());
    let mut queue = host.create_io_pair(1, 8);
    let internal = NvmeStatus::generic(codes::INTERNAL_ERROR);
    host.device.set_faults(
        FaultPlan::none().with_rule(FaultRule::on_nth_io(2, FaultAction::Status(internal)).with_opcode(NvmOpcode::Read as u8)).with_rule(
            FaultRule::on_nth_io(1, FaultAction::Status(internal))
                .with_queue(QueueFilter::Admin)
                .with_opcode(AdminOpcode::GetFeatures as u8),
        ),
    );
    write_block(&host, &mut queue, 0, 5); // not a Read: not counted
    read_block(&host, &mut queue, 0); // first Read
    let target = host.buffer(4096);
    let second = with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(0), block_count(1)), &target, 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, second)), Err(internal), "second Read fails");
    read_block(&host, &mut queue, 0);
    let features = host.admin(SubmissionEntry::get_features(nvme_driver::spec::FeatureId::NumberOfQueues));
    assert_eq!(status_of(&features), Err(internal));
    let stats = host.device.stats();
    assert_eq!(stats.faults_injected, 2);
    assert_eq!(stats.io(NvmOpcode::Read), 3);
    assert_eq!(stats.admin(AdminOpcode::GetFeatures), 1);
}

#[test]
fn deleting_a_queue_with_a_delayed_completion_pending_is_clean() {
    // Goal: deleting an SQ posts its delayed completion at once (the command ran; NVMe wants
    // the commands of a deleted SQ completed or aborted, and the CQ still exists), ahead of the
    // Delete's own completion, and frees the CQ slot it held. The CQ (4 entries: 3 usable)
    // stays and a new SQ 1 is created on it: three Flushes in one doorbell all complete at once
    // (the held slot would leave room for two until the delay ran out), and the delayed
    // completion never arrives a second time. Until 2026-11-29 this test deleted the CQ too
    // and passed just as well without `drop_pending_for`; until 2026-12-01 the deletion dropped
    // the delayed completion.
    const DELAY: Duration = Duration::from_millis(300);
    let mut host = TestHost::start(memory_config());
    let mut queue = host.create_io_pair(1, 4);
    host.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::Delay(DELAY))));
    let started = Instant::now();
    let delayed = TestHost::push(&mut queue, SubmissionEntry::flush(NamespaceId(1)));
    host.ring_submission(&queue);
    let deadline = Instant::now() + DEADLINE;
    while host.device.stats().faults_injected == 0 {
        assert!(Instant::now() < deadline, "the delayed Flush was never fetched");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(status_of(&host.admin(SubmissionEntry::delete_io_submission_queue(1))), Ok(()));
    let held = TestHost::try_reap(&mut queue).expect("the delayed Flush completed with its deleted SQ");
    assert_eq!((held.command_id(), status_of(&held)), (delayed, Ok(())));
    host.ring_completion(&queue);
    queue.submission = host.buffer(4 * 64);
    queue.tail = 0;
    let created = host.admin(SubmissionEntry::create_io_submission_queue(1, 4, queue.submission.iova().0, 1));
    assert_eq!(status_of(&created), Ok(()), "SQ 1 again, on the old CQ 1");
    let flushes: Vec<_> = (0..3).map(|_| TestHost::push(&mut queue, SubmissionEntry::flush(NamespaceId(1)))).collect();
    host.ring_submission(&queue);
    // Reaped without ringing the CQ head until all three are in: the CQ has room for three
    // only if the deleted SQ's reservation was freed.
    let mut completed = Vec::new();
    for _ in 0..3 {
        let completion = TestHost::try_reap_within(&mut queue, DELAY / 3).expect("all three Flushes complete at once");
        assert_eq!(status_of(&completion), Ok(()));
        completed.push(completion.command_id());
    }
    host.ring_completion(&queue);
    assert!(started.elapsed() < DELAY, "the Flushes waited for the delayed completion's slot: {:?}", started.elapsed());
    completed.sort_by_key(|id| id.0);
    assert_eq!(completed, flushes);
    std::thread::sleep(DELAY.saturating_sub(started.elapsed()) + Duration::from_millis(100));
    if let Some(stale) = TestHost::try_reap(&mut queue) {
        panic!("a completion after the delay (the deleted SQ's command is {delayed:?}): {:?}", stale.command_id());
    }
}

#[test]
fn file_backed_512_byte_blocks_at_unaligned_offsets() {
    // Goal: 512 B LBAs at odd offsets (not O_DIRECT-aligned) round-trip on a file, batched or not.
    let path = std::env::temp_dir().join(format!("nvme-emu-test-{}-unaligned", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let config = EmuConfig::default()
        .with_backing(Backing::File { path: path.clone(), create_bytes: Some(2 << 20) })
        .with_namespaces(vec![NamespaceConfig::new(512, Some((1 << 20) + 512)), NamespaceConfig::new(512, None)]);
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 32);
    let sources: Vec<DmaRegion> = (0..8).map(|_| host.buffer(4096)).collect();
    for (index, source) in sources.iter().enumerate() {
        source.fill(0, 1536, 0x30 + index as u8).unwrap();
        let entry = with_sgl(SubmissionEntry::write(NamespaceId(2), Lba(1 + 7 * index as u64), block_count(3), true), source, 1536);
        assert_eq!(status_of(&host.execute_on(&mut queue, entry)), Ok(()));
    }
    let targets: Vec<DmaRegion> = (0..8).map(|_| host.buffer(4096)).collect();
    for (index, target) in targets.iter().enumerate() {
        TestHost::push(
            &mut queue,
            with_sgl(SubmissionEntry::read(NamespaceId(2), Lba(1 + 7 * index as u64), block_count(3)), target, 1536),
        );
    }
    host.ring_submission(&queue);
    let deadline = Instant::now() + DEADLINE;
    for _ in 0..8 {
        assert!(Instant::now() < deadline);
        assert_eq!(status_of(&host.reap(&mut queue)), Ok(()));
    }
    for (index, target) in targets.iter().enumerate() {
        let mut out = vec![0u8; 1536];
        target.read(0, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 0x30 + index as u8), "range {index}");
    }
    drop(host);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_csts_value_stored_into_the_shared_page_does_not_fake_a_shutdown_or_a_fatal_status() {
    // Goal: CSTS is the controller's own: a client that stores SHST = complete (with RDY, 0x9)
    // or CFS straight into the shared register page changes neither what the controller nor
    // what the owner's RegisterIo reads, so a later CC.SHN = 01b still writes the cache back
    // before SHST reads complete.
    let mut host = TestHost::start(memory_config().with_shared_registers(true));
    let mut queue = host.create_io_pair(1, 8);
    write_block(&host, &mut queue, 1, 0x11);
    let page = host.device.register_region();
    page.store_u32(registers::CSTS, 0x9, std::sync::atomic::Ordering::Release).unwrap();
    assert_eq!(host.registers.read32(registers::CSTS), 0x1, "the owner reads the controller's CSTS, not the page's");
    page.store_u32(registers::CSTS, 0x3, std::sync::atomic::Ordering::Release).unwrap();
    assert!(!host.csts().fatal(), "a CFS stored into the page is not the controller's");
    page.store_u32(registers::CSTS, 0x9, std::sync::atomic::Ordering::Release).unwrap();
    host.registers.write32(registers::CC, ControllerConfiguration::for_enable().0 | 1 << 14);
    host.wait_shutdown(ShutdownStatus::Complete);
    assert!(host.device.stats().cache_writeback_bytes > 0, "the shutdown wrote the cached block back");
    let mut status = [0u8; 4];
    page.read(registers::CSTS, &mut status).unwrap();
    assert_eq!(u32::from_le_bytes(status), 0x9, "the controller republished its CSTS to the page (RDY, SHST complete)");
}
