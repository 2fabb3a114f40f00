//! A host write of CC returns at once, as an MMIO write does, however long the transition it
//! starts waits for transfers in flight: the controller thread does the waiting, CSTS tells the
//! host how far it got (RDY stays 1 until a reset completed, SHST reads 01b while a shutdown
//! is processing), and the host's own deadline (CAP.TO) is what bounds its wait. Until
//! 2026-11-29 the write ran the transition itself and blocked until the transfers ended (a
//! review measured ~35 s with a file backing), so no host deadline could work.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::hw::{DeviceBackend, DmaRegion};
use nvme_driver::spec::registers::{self, Capabilities, ControllerConfiguration, ShutdownStatus};
use nvme_driver::spec::{NvmOpcode, SubmissionEntry};
use nvme_driver::{Lba, NamespaceId};

use super::harness::{block_count, with_sgl};
use super::harness::{status_of, write_block, HostQueue, TestHost, DEADLINE};
use super::held_transfer_tests::{hold_two_reads, hold_two_reads_after, HoldReads};
use super::stall_tests::{block, Stalled};
use crate::{Backing, EmuConfig, EmuDevice};

/// Deadline of the held transfers, and how long a reset waits for the kernel to give back what
/// it cancels: the transition they block ends by then at the latest (the real ones are 30 s and
/// 5 s), so a test that measures less saw it end because they did.
const HOLD_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a CC write may take: no wait for I/O, only a store and a wake-up.
const PROMPT: Duration = Duration::from_millis(100);
/// How long a test watches CSTS for a change that must not come yet.
const QUIET: Duration = Duration::from_millis(150);

/// Two bounced Reads held in flight, which the kernel will not cancel (as a read of a hung
/// disk): a reset, which cancels what it can at once, waits for them too (up to
/// `HOLD_TIMEOUT`, then drops them); `None` where io_uring is unavailable.
fn hold(name: &str) -> Option<(Stalled, [DmaRegion; 2])> {
    hold_two_reads(name, HoldReads { direct: false, cancellation: false, timeout: HOLD_TIMEOUT })
}

/// Writes CC with `change` applied to its value and returns how long the write took.
fn write_configuration(stalled: &Stalled, change: impl FnOnce(u32) -> u32) -> Duration {
    let configuration = stalled.host.registers.read32(registers::CC);
    let started = Instant::now();
    stalled.host.registers.write32(registers::CC, change(configuration));
    started.elapsed()
}

/// Gives the held reads their data (block 5, then block 6).
fn release(stalled: &mut Stalled) {
    stalled.receiver.write_all(&[block(5), block(6)].concat()).unwrap();
}

/// Waits (bounded) until `condition` holds of CSTS.
fn wait_for(stalled: &Stalled, what: &str, condition: impl Fn(ControllerStatusView) -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition(ControllerStatusView::read(stalled)) {
        assert!(Instant::now() < deadline, "{what} never came: {:?}", stalled.host.csts());
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The CSTS fields these tests look at.
#[derive(Debug, Clone, Copy)]
struct ControllerStatusView {
    ready: bool,
    fatal: bool,
    shutdown: ShutdownStatus,
}

impl ControllerStatusView {
    fn read(stalled: &Stalled) -> Self {
        let csts = stalled.host.csts();
        Self { ready: csts.ready(), fatal: csts.fatal(), shutdown: csts.shutdown() }
    }
}

/// Asserts `condition` holds of CSTS at every look for [`QUIET`].
fn assert_for_a_while(stalled: &Stalled, what: &str, condition: impl Fn(ControllerStatusView) -> bool) {
    let until = Instant::now() + QUIET;
    while Instant::now() < until {
        let csts = ControllerStatusView::read(stalled);
        assert!(condition(csts), "{what}: {csts:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_reset_with_transfers_in_flight_returns_at_once_and_reads_ready_until_they_end() {
    // Goal: CC.EN = 0 while two Reads are held in the kernel returns within PROMPT; CSTS.RDY
    // stays 1 (without CFS) while the reset waits for them, and drops to 0 once they end,
    // well before their deadline; none of them completes, and the controller comes up again.
    let before_hold = Instant::now();
    let Some((mut stalled, _targets)) = hold("cc-reset-in-flight") else { return };
    let took = write_configuration(&stalled, |configuration| configuration & !1);
    assert!(took < PROMPT, "the CC write waited {took:?} for the transfers in flight");
    assert_for_a_while(&stalled, "RDY dropped (or CFS rose) while the reset still waits for transfers", |csts| csts.ready && !csts.fatal);
    release(&mut stalled);
    wait_for(&stalled, "RDY = 0 after the transfers ended", |csts| !csts.ready);
    let ended = before_hold.elapsed();
    assert!(ended < HOLD_TIMEOUT, "the reset ended at the transfers' deadline ({ended:?}), not when they ended");
    assert!(!stalled.host.csts().fatal());
    assert!(TestHost::try_reap(&mut stalled.queue).is_none(), "a reset completed a command that was in flight");
    stalled.enable_again();
    stalled.assert_serves_again();
}

#[test]
fn a_shutdown_with_transfers_in_flight_returns_at_once_and_reads_processing_until_they_end() {
    // Goal: CC.SHN = 01b while two Reads are held in the kernel returns within PROMPT; SHST
    // reads 01b (processing) while the shutdown waits for them to finish, then 10b (complete)
    // once they did, well before their deadline; both Reads complete with their data.
    let before_hold = Instant::now();
    let Some((mut stalled, targets)) = hold("cc-shutdown-in-flight") else { return };
    let took = write_configuration(&stalled, |configuration| configuration & !(0x3 << 14) | 1 << 14);
    assert!(took < PROMPT, "the CC write waited {took:?} for the transfers in flight");
    wait_for(&stalled, "SHST = processing", |csts| csts.shutdown == ShutdownStatus::Occurring);
    assert_for_a_while(&stalled, "SHST left processing while the shutdown still waits for transfers", |csts| {
        csts.shutdown == ShutdownStatus::Occurring && csts.ready && !csts.fatal
    });
    release(&mut stalled);
    wait_for(&stalled, "SHST = complete after the transfers ended", |csts| csts.shutdown == ShutdownStatus::Complete);
    let ended = before_hold.elapsed();
    assert!(ended < HOLD_TIMEOUT, "the shutdown ended at the transfers' deadline ({ended:?}), not when they ended");
    assert!(!stalled.host.csts().fatal());
    for _ in 0..2 {
        assert_eq!(status_of(&stalled.host.reap(&mut stalled.queue)), Ok(()), "a Read the shutdown finished");
    }
    let landed: Vec<Vec<u8>> = targets
        .iter()
        .map(|target| {
            let mut data = vec![0u8; 4096];
            target.read(0, &mut data).unwrap();
            data
        })
        .collect();
    assert!(landed == [block(5), block(6)] || landed == [block(6), block(5)], "the Reads' data");
}

#[test]
fn a_doorbell_rung_while_a_reset_waits_is_not_run_on_the_old_queues() {
    // Goal: once the host cleared CC.EN, a doorbell it rings on an old I/O queue (a racing
    // thread) is not new work: while the reset waits for the transfers in flight, and after it,
    // the command is never fetched, run or completed.
    let Some((mut stalled, _targets)) = hold("cc-reset-doorbell") else { return };
    let took = write_configuration(&stalled, |configuration| configuration & !1);
    assert!(took < PROMPT, "the CC write waited {took:?} for the transfers in flight");
    TestHost::push(&mut stalled.queue, SubmissionEntry::flush(NamespaceId(1)));
    stalled.host.ring_submission(&stalled.queue);
    assert_for_a_while(&stalled, "RDY dropped while the reset still waits for transfers", |csts| csts.ready);
    release(&mut stalled);
    wait_for(&stalled, "RDY = 0 after the transfers ended", |csts| !csts.ready);
    assert!(TestHost::try_reap(&mut stalled.queue).is_none(), "a command of the old queues completed");
    assert_eq!(stalled.host.device.stats().io(NvmOpcode::Flush), 0, "the Flush rung during the reset ran");
}

#[test]
fn a_disable_and_enable_written_before_the_controller_looks_still_reset_it() {
    // Goal: CC.EN 1 -> 0 -> 1 written before the controller thread looked at CC (the test holds
    // its lock meanwhile) is still a reset followed by an enable, not a level that never
    // changed: the old I/O queue is gone (creating queue 1 again succeeds) and the controller
    // serves the new admin queue.
    let mut host = TestHost::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 8 << 20 }));
    let mut queue = host.create_io_pair(1, 8);
    write_block(&host, &mut queue, 0, 0x11);
    let admin = HostQueue::new(&*host.dma, 0, 32);
    host.device.with_core(|_| {
        host.registers.write32(registers::CC, 0);
        host.registers.write64(registers::ASQ, admin.submission.iova().0);
        host.registers.write64(registers::ACQ, admin.completion.iova().0);
        host.registers.write32(registers::CC, ControllerConfiguration::for_enable().0);
    });
    host.admin = admin;
    let deadline = Instant::now() + DEADLINE;
    while host.device.stats().enables != 2 {
        assert!(Instant::now() < deadline, "the controller was not reset and enabled again");
        std::thread::sleep(Duration::from_micros(200));
    }
    assert!(host.csts().ready() && !host.csts().fatal());
    let mut queue = host.create_io_pair(1, 8);
    write_block(&host, &mut queue, 0, 0x22);
}

/// The real transfer deadline (`BATCH_TIMEOUT`, 30 s): longer than CAP.TO (10 s by default).
const REAL_TRANSFER_TIMEOUT: Duration = Duration::from_secs(30);

/// Two bounced Reads stuck in the kernel with the real deadline, which the kernel can cancel.
fn hold_past_cap_to(name: &str) -> Option<(Stalled, [DmaRegion; 2])> {
    hold_two_reads(name, HoldReads { direct: false, cancellation: true, timeout: REAL_TRANSFER_TIMEOUT })
}

/// Clears CC.EN and asserts CSTS.RDY reads 0 within CAP.TO (the bound a host waits, NVMe
/// §3.1.1), without CFS; then that the controller serves I/O again after a new bring-up.
fn assert_reset_within_cap_to(stalled: &mut Stalled) {
    assert_ready_drops_within_cap_to(stalled);
    stalled.enable_again();
    stalled.assert_serves_again();
}

/// The first half of [`assert_reset_within_cap_to`]: CC.EN cleared (the rest of CC kept),
/// CSTS.RDY reads 0 within CAP.TO without CFS, and no command in flight completed.
fn assert_ready_drops_within_cap_to(stalled: &mut Stalled) {
    let cap_to = Duration::from_millis(Capabilities(stalled.host.registers.read64(registers::CAP)).ready_timeout_ms());
    assert!(cap_to < REAL_TRANSFER_TIMEOUT, "the test needs CAP.TO below the transfers' deadline");
    write_configuration(stalled, |configuration| configuration & !1);
    let started = Instant::now();
    while stalled.host.csts().ready() {
        assert!(started.elapsed() < cap_to, "CSTS.RDY still 1 at CAP.TO ({cap_to:?}) after CC.EN = 0");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!stalled.host.csts().fatal(), "the reset cancelled every transfer: a clean stop");
    assert!(TestHost::try_reap(&mut stalled.queue).is_none(), "a reset completed a command that was in flight");
}

#[test]
fn a_reset_ends_within_cap_to_with_transfers_stuck_past_it() {
    // Goal: with two Reads stuck in the kernel under the real 30 s deadline, CSTS.RDY reads 0
    // within CAP.TO of CC.EN = 0: the reset completes none of them, so it cancels them at once
    // (the kernel can) instead of waiting for their deadline. Until 2026-11-29 it waited for
    // each until 30 s after it was pushed, then up to 5 s for the cancellation.
    let Some((mut stalled, _targets)) = hold_past_cap_to("cc-reset-cap-to") else { return };
    assert_reset_within_cap_to(&mut stalled);
}

#[test]
fn a_reset_ends_within_cap_to_while_a_flush_waits_for_stuck_transfers() {
    // Goal: as above, with a Flush that was already waiting for the stuck Reads (a Flush waits
    // for everything in flight) when the host cleared CC.EN, the usual reason for a reset (the
    // host gave up on its command): the wait gives way to the reset, and the Flush, whose queue
    // the reset deletes, gets no completion. Until 2026-11-29 the reset began only when the
    // Flush's wait ended, at the Reads' deadline.
    let Some((mut stalled, _targets)) = hold_past_cap_to("cc-reset-cap-to-flush") else { return };
    flush_and_wait_until_it_waits(&mut stalled);
    assert_reset_within_cap_to(&mut stalled);
    assert_eq!(stalled.host.device.stats().io(NvmOpcode::Flush), 1, "the Flush was fetched before the reset");
}

#[test]
fn a_reset_ends_within_cap_to_while_a_shutdown_waits_for_stuck_transfers() {
    // Goal: the driver's own teardown order, CC.SHN = 01b and then, once its shutdown wait ran
    // out, CC.EN = 0 with SHN still set, with two Reads stuck in the kernel under the real 30 s
    // deadline: the shutdown's wait for them gives way to the reset, so RDY reads 0 within
    // CAP.TO of CC.EN = 0 (a driver that waits no longer would leak its memory otherwise), and
    // the shutdown, run again on the disabled controller, still writes a cached block back.
    // Until 2026-12-01 the shutdown waited for the Reads' deadline (30 s) before the reset
    // began, so RDY still read 1 at CAP.TO.
    let hold = HoldReads { direct: false, cancellation: true, timeout: REAL_TRANSFER_TIMEOUT };
    let Some((mut stalled, _targets)) = hold_two_reads_after("cc-shutdown-cap-to", hold, write_cached) else { return };
    assert_eq!(stalled.media_blocks(3)[CACHED_LBA as usize * 4096..], [0u8; 4096], "the write was cached, not written through");
    write_configuration(&stalled, |configuration| configuration & !(0x3 << 14) | 1 << 14);
    wait_for(&stalled, "SHST = processing", |csts| csts.shutdown == ShutdownStatus::Occurring);
    assert_ready_drops_within_cap_to(&mut stalled);
    wait_for(&stalled, "SHST = complete after the reset (SHN still set)", |csts| csts.shutdown == ShutdownStatus::Complete || csts.fatal);
    assert!(!stalled.host.csts().fatal(), "the shutdown after the reset failed: {:?}", stalled.host.csts());
    assert_eq!(stalled.media_blocks(3)[CACHED_LBA as usize * 4096..], block(0x2C)[..], "the shutdown wrote the cached block back");
    stalled.enable_again();
    stalled.assert_serves_again();
}

/// How long `power_loss()`, `function_reset()` or the device's drop may take while a Flush
/// waits for Reads stuck under the real 30 s deadline: the wait gives way at its next look
/// (every 10 ms) and the kernel cancels them at once. Below the drop's 5 s `STOP_TIMEOUT`,
/// after which it would give up on the controller thread and detach it.
const STOP_PROMPT: Duration = Duration::from_secs(3);
/// The block cached (not yet on the file) before the Reads are held.
const CACHED_LBA: u64 = 2;

/// A Write of block `CACHED_LBA` held in the volatile cache, two Reads stuck in the kernel
/// under the real deadline (the kernel can cancel them), and a Flush fetched and waiting for
/// them: it would write the cached block back once they end. `None` where io_uring is
/// unavailable.
fn flush_waiting_for_stuck_reads(name: &str) -> Option<Stalled> {
    let hold = HoldReads { direct: false, cancellation: true, timeout: REAL_TRANSFER_TIMEOUT };
    let (mut stalled, _targets) = hold_two_reads_after(name, hold, write_cached)?;
    assert!(cached_block_on_file(&stalled) == [0u8; 4096], "the write was cached, not written through");
    flush_and_wait_until_it_waits(&mut stalled);
    Some(stalled)
}

/// Rings a Flush and waits (bounded) until the controller thread waits for the transfers in
/// flight before running it. It holds the controller's lock meanwhile (`stats()` would wait
/// too), so the probe is read without it. A fixed sleep instead let a test stop the device
/// before the Flush was fetched on a loaded machine, and pass without a Flush waiting.
fn flush_and_wait_until_it_waits(stalled: &mut Stalled) {
    assert!(!stalled.host.device.settling_for_tests(), "a wait for transfers before the Flush was rung");
    TestHost::push(&mut stalled.queue, SubmissionEntry::flush(NamespaceId(1)));
    stalled.host.ring_submission(&stalled.queue);
    let deadline = Instant::now() + DEADLINE;
    while !stalled.host.device.settling_for_tests() {
        assert!(Instant::now() < deadline, "the Flush never waited for the transfers in flight");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Writes block `CACHED_LBA` (`block(0x2C)`) into the volatile write cache.
fn write_cached(stalled: &mut Stalled) {
    let source = stalled.host.buffer(4096);
    source.write(0, &block(0x2C)).unwrap();
    let write = with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(CACHED_LBA), block_count(1), false), &source, 4096);
    assert_eq!(status_of(&stalled.host.execute_on(&mut stalled.queue, write)), Ok(()), "the cached write");
}

/// Block `CACHED_LBA` as the backing file holds it.
fn cached_block_on_file(stalled: &Stalled) -> Vec<u8> {
    stalled.media_blocks(CACHED_LBA as usize + 1)[CACHED_LBA as usize * 4096..].to_vec()
}

#[test]
fn a_power_loss_ends_promptly_while_a_flush_waits_for_stuck_transfers() {
    // Goal: `power_loss()` called while a Flush waits for two Reads stuck under the real 30 s
    // deadline returns within STOP_PROMPT: the Flush's wait gives way to it (as to a reset),
    // the cut cancels the Reads, and CSTS reads as a freshly powered controller (RDY = 0,
    // CFS = 0, CC = 0: the kernel gave every transfer back). The Flush gets no completion and
    // wrote nothing back (the cut lost the cached block). Until 2026-12-01 the call waited for
    // the controller's lock, which the Flush's wait held until the Reads' deadline (~30 s).
    let Some(mut stalled) = flush_waiting_for_stuck_reads("power-loss-flush") else { return };
    let cut = Instant::now();
    stalled.host.device.power_loss();
    let took = cut.elapsed();
    assert!(took < STOP_PROMPT, "power_loss() waited {took:?} for the Flush's wait");
    let csts = ControllerStatusView::read(&stalled);
    assert!(!csts.ready && !csts.fatal, "not a clean, freshly powered controller: {csts:?}");
    assert_eq!(stalled.host.registers.read32(registers::CC), 0, "the registers are at their reset values");
    assert!(TestHost::try_reap(&mut stalled.queue).is_none(), "a command the power loss cut short completed");
    assert_eq!(stalled.host.device.stats().io(NvmOpcode::Flush), 1, "the Flush was fetched before the cut");
    assert!(cached_block_on_file(&stalled) == [0u8; 4096], "the Flush wrote the cache back despite the cut");
    stalled.enable_again();
    stalled.assert_serves_again();
}

#[test]
fn a_function_reset_ends_promptly_while_a_flush_waits_for_stuck_transfers() {
    // Goal: as for a power loss; a function reset writes the cache back itself (it is not a
    // power loss), once the Reads were cancelled, and the Flush gets no completion.
    let Some(mut stalled) = flush_waiting_for_stuck_reads("flr-flush") else { return };
    let reset = Instant::now();
    stalled.host.device.function_reset().expect("function reset");
    let took = reset.elapsed();
    assert!(took < STOP_PROMPT, "function_reset() waited {took:?} for the Flush's wait");
    let csts = ControllerStatusView::read(&stalled);
    assert!(!csts.ready && !csts.fatal, "not a clean stop: {csts:?}");
    assert!(TestHost::try_reap(&mut stalled.queue).is_none(), "a command the function reset cut short completed");
    assert!(cached_block_on_file(&stalled) == block(0x2C), "the function reset wrote the cache back");
    stalled.enable_again();
    stalled.assert_serves_again();
}

#[test]
fn dropping_the_device_while_a_flush_waits_for_stuck_transfers_stops_its_thread() {
    // Goal: dropping the device while a Flush waits for two stuck Reads joins the controller
    // thread within STOP_PROMPT (the wait gives way to the drop), and the Flush never runs
    // after it: once the Reads could end, the file still lacks the cached block. Until
    // 2026-12-01 the drop gave up after 5 s and detached the thread, which, when the Reads
    // ended, ran the Flush and wrote old cached blocks into the file, over whatever a device
    // reopened on it wrote meanwhile.
    let Some(mut stalled) = flush_waiting_for_stuck_reads("drop-flush") else { return };
    // Until 2026-12-01 this test only slept before the drop: a Flush not fetched yet, which the
    // stopping thread never fetches, passed it under the old code too.
    let stand_in = EmuDevice::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 1 << 20 })).expect("a stand-in device");
    let device = std::mem::replace(&mut stalled.host.device, stand_in);
    assert_eq!(Arc::strong_count(&device), 1, "the test holds the only handle");
    let dropping = Instant::now();
    drop(device);
    let took = dropping.elapsed();
    // What the Reads wait for: a thread still running them would finish the Flush now.
    release(&mut stalled);
    std::thread::sleep(QUIET);
    assert!(cached_block_on_file(&stalled) == [0u8; 4096], "the dropped device's Flush wrote the cache back");
    assert!(took < STOP_PROMPT, "the drop took {took:?}: it gave up on the controller thread");
}
