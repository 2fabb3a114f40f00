//! A controller reset, power loss or function reset while the kernel still holds a transfer
//! straight into host memory: CSTS.RDY = 0 tells the host the controller no longer touches its
//! memory, so it must not read 0 until the kernel gave every such transfer back. A direct Read
//! from a socket nobody writes stands in for a read stuck in a hung filesystem, with the ring's
//! cancellation disabled (as the kernel cannot cancel such a read).

use std::io::Write;
use std::time::{Duration, Instant};

use nvme_driver::hw::{DeviceBackend, DmaRegion};
use nvme_driver::spec::registers::{self, ControllerConfiguration};
use nvme_driver::spec::SubmissionEntry;
use nvme_driver::{Lba, NamespaceId};

use super::harness::{block_count, with_sgl, TestHost, DEADLINE};
use super::stall_tests::{block, Stalled};

/// Transfer and cancellation deadline of the held controller (the real ones are 30 s and 5 s).
const HELD_TIMEOUT: Duration = Duration::from_millis(200);
/// How long a test watches CSTS for a change that must not come yet.
const QUIET: Duration = Duration::from_millis(150);

/// A controller whose two direct Reads (LBAs 0 and 1, into the returned host buffers) wait in
/// the kernel for data the socket does not have; `None` where io_uring is unavailable.
fn hold_two_direct_reads(name: &str) -> Option<(Stalled, [DmaRegion; 2])> {
    hold_two_reads(name, HoldReads { direct: true, cancellation: false, timeout: HELD_TIMEOUT })
}

/// How [`hold_two_reads`] holds its Reads.
pub(super) struct HoldReads {
    /// Straight into host memory (else through the controller's bounce buffers).
    pub direct: bool,
    /// Whether the ring may cancel them once `timeout` passed.
    pub cancellation: bool,
    /// Transfer (and cancellation) deadline.
    pub timeout: Duration,
}

/// A controller whose two Reads (LBAs 0 and 1, into the returned host buffers), pushed in one
/// doorbell so that both go through the ring, wait in the kernel for data the socket does not
/// have until the test writes it to `receiver`; `None` where io_uring is unavailable.
pub(super) fn hold_two_reads(name: &str, hold: HoldReads) -> Option<(Stalled, [DmaRegion; 2])> {
    hold_two_reads_after(name, hold, |_| {})
}

/// [`hold_two_reads`], with `before` run on the controller first (a command run once the
/// Reads are held would wait for them).
pub(super) fn hold_two_reads_after(name: &str, hold: HoldReads, before: impl FnOnce(&mut Stalled)) -> Option<(Stalled, [DmaRegion; 2])> {
    let mut stalled = Stalled::start_with(name, hold.cancellation, hold.timeout)?;
    before(&mut stalled);
    if hold.direct {
        stalled.host.device.with_core(|core| core.allow_direct_on_override());
    }
    let targets = [stalled.host.buffer(4096), stalled.host.buffer(4096)];
    for (lba, target) in targets.iter().enumerate() {
        let read = SubmissionEntry::read(NamespaceId(1), Lba(lba as u64), block_count(1));
        TestHost::push(&mut stalled.queue, with_sgl(read, target, 4096));
    }
    stalled.host.ring_submission(&stalled.queue);
    let deadline = Instant::now() + DEADLINE;
    while stalled.host.device.with_core(|core| core.in_flight_ranges().len()) != 2 {
        assert!(Instant::now() < deadline, "the two reads never were in flight together");
        std::thread::sleep(Duration::from_millis(1));
    }
    Some((stalled, targets))
}

/// Asserts the controller keeps saying it may still touch host memory: RDY = 1 with CFS = 1,
/// for a while, from when CFS rose (a reset sets it on the controller thread, once the held
/// reads passed their deadline; RDY reads 1 until then).
fn assert_not_stopped(stalled: &Stalled, after: &str) {
    let deadline = Instant::now() + DEADLINE;
    while !stalled.host.csts().fatal() {
        let csts = stalled.host.csts();
        assert!(csts.ready(), "CSTS.RDY = 0 after {after} while the kernel may still write host memory: {csts:?}");
        assert!(Instant::now() < deadline, "CSTS.CFS never set after {after}, with host memory stuck in the kernel: {csts:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    let until = Instant::now() + QUIET;
    while Instant::now() < until {
        let csts = stalled.host.csts();
        assert!(csts.ready(), "CSTS.RDY = 0 after {after} while the kernel may still write host memory: {csts:?}");
        assert!(csts.fatal(), "CSTS.CFS not set after {after}, with host memory stuck in the kernel: {csts:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Gives the held reads their data, then checks the kernel really wrote it into host memory
/// and that the controller, once it got the reads back, finishes stopping (RDY = 0, CFS = 0)
/// and serves I/O again after a new bring-up.
fn release_and_restart(mut stalled: Stalled, targets: [DmaRegion; 2]) {
    stalled.receiver.write_all(&[block(5), block(6)].concat()).unwrap();
    stalled.host.wait_ready(false);
    assert!(!stalled.host.csts().fatal(), "the stop completed: CSTS.CFS clears with RDY");
    let landed: Vec<Vec<u8>> = targets
        .iter()
        .map(|target| {
            let mut data = vec![0u8; 4096];
            target.read(0, &mut data).unwrap();
            data
        })
        .collect();
    assert!(
        landed == [block(5), block(6)] || landed == [block(6), block(5)],
        "the held reads wrote host memory after the stop began (what RDY = 0 would have hidden)"
    );
    assert!(TestHost::try_reap(&mut stalled.queue).is_none(), "a read of the stopped controller completed");
    stalled.enable_again();
    stalled.assert_serves_again();
}

#[test]
fn a_reset_reports_ready_until_the_kernel_gives_back_a_direct_read() {
    // Goal: a controller reset (CC.EN = 0) with a direct Read the kernel will not give back
    // keeps CSTS.RDY = 1 and sets CFS instead of reporting the reset done, since the kernel may
    // still write the host's buffer; once the read comes back the reset completes (RDY = 0).
    let Some((stalled, targets)) = hold_two_direct_reads("reset-held-read") else { return };
    let configuration = stalled.host.registers.read32(registers::CC);
    stalled.host.registers.write32(registers::CC, configuration & !1);
    assert_not_stopped(&stalled, "CC.EN = 0");
    release_and_restart(stalled, targets);
}

#[test]
fn a_power_loss_reports_ready_until_the_kernel_gives_back_a_direct_read() {
    // Goal: a power loss with a direct Read the kernel will not give back does not read as a
    // freshly powered, stopped controller (all registers zero): RDY stays 1 with CFS until the
    // kernel gave the read back, so a host bringing the controller up again waits (bounded by
    // CAP.TO) instead of reusing memory the kernel may still write.
    let Some((stalled, targets)) = hold_two_direct_reads("power-held-read") else { return };
    stalled.host.device.power_loss();
    assert_eq!(ControllerConfiguration(stalled.host.registers.read32(registers::CC)).0, 0, "the other registers are at their reset values");
    assert_not_stopped(&stalled, "a power loss");
    release_and_restart(stalled, targets);
}

#[test]
fn a_function_reset_reports_ready_until_the_kernel_gives_back_a_direct_read() {
    // Goal: as for a controller reset; a function reset also resets every register, which must
    // not clear the RDY and CFS that say host memory is still in the kernel's hands.
    let Some((stalled, targets)) = hold_two_direct_reads("flr-held-read") else { return };
    let reset = stalled.host.device.function_reset();
    assert!(reset.is_err(), "a function reset that could not stop the controller reports it: {reset:?}");
    assert_not_stopped(&stalled, "a function reset");
    release_and_restart(stalled, targets);
}
