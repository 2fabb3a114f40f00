//! Normal shutdown against the scripted fake controller: the wait for CSTS.SHST is bounded by
//! what the device says a shutdown takes (Identify RTD3E), not only by CAP.TO (how long CSTS.RDY
//! may take), and teardown never clears CC.EN while that shutdown is still in progress within the
//! bound. Each test opens with its goal.

use std::time::{Duration, Instant};

use crate::fake_device::{FakeDevice, FakeScript};
use crate::spec::registers::{self, ShutdownStatus};
use crate::{Controller, ControllerConfig, NvmeError};

/// CAP.TO 1 (500 ms, the fake's default), RTD3E `rtd3e_us`, and a shutdown that reads in
/// progress for `takes`.
fn slow_shutdown(rtd3e_us: u32, takes: Duration) -> FakeScript {
    let mut script = FakeScript { shutdown_takes: takes, ..FakeScript::default() };
    script.identify_controller[88..92].copy_from_slice(&rtd3e_us.to_le_bytes());
    script
}

fn bring_up(script: FakeScript) -> (std::sync::Arc<FakeDevice>, Controller) {
    let device = FakeDevice::new(script);
    let config = ControllerConfig { admin_timeout: Duration::from_millis(200), ..ControllerConfig::default() };
    let controller = Controller::init(device.clone(), config).expect("bring-up");
    (device, controller)
}

#[test]
fn a_shutdown_within_rtd3e_but_past_cap_to_completes() {
    // Goal: a drive whose RTD3E (3 s) is longer than its CAP.TO (500 ms) and whose shutdown takes
    // 1 s gets its shutdown waited for: before, shutdown() gave up at CAP.TO with ReadyTimeout
    // while SHST still read "occurring".
    let (device, controller) = bring_up(slow_shutdown(3_000_000, Duration::from_secs(1)));
    assert_eq!(controller.shutdown_timeout(), Duration::from_secs(3));
    let started = Instant::now();
    let result = controller.shutdown();
    assert!(result.is_ok(), "{result:?} after {:?}", started.elapsed());
    assert_eq!(controller.status().expect("status").shutdown(), ShutdownStatus::Complete);
    drop(controller);
    assert_eq!(device.counters().disables_during_shutdown, 0);
}

#[test]
fn teardown_does_not_disable_a_controller_mid_shutdown() {
    // Goal: dropping the controller requests a shutdown and lets it finish within RTD3E before
    // it clears CC.EN: before, Drop's wait ended at CAP.TO (500 ms) and CC.EN was cleared while
    // SHST read "occurring" (the drive's write-back cut short).
    let (device, controller) = bring_up(slow_shutdown(3_000_000, Duration::from_secs(1)));
    drop(controller);
    let counters = device.counters();
    assert_eq!(counters.disables_during_shutdown, 0, "{counters:?}");
    assert_eq!(counters.disables, 1, "the teardown's disable, once the shutdown completed: {counters:?}");
}

#[test]
fn the_shutdown_wait_is_bounded() {
    // Goal: the wait honours RTD3E up to 60 s and never drops below CAP.TO or 1 s; a shutdown
    // that never completes within it is ReadyTimeout, with SHST still in progress.
    let (_device, controller) = bring_up(slow_shutdown(u32::MAX, Duration::ZERO));
    assert_eq!(controller.shutdown_timeout(), Duration::from_secs(60));
    let (_device, controller) = bring_up(slow_shutdown(0, Duration::from_secs(3600)));
    assert_eq!(controller.shutdown_timeout(), Duration::from_secs(1));
    let started = Instant::now();
    let result = controller.shutdown();
    assert!(matches!(result, Err(NvmeError::ReadyTimeout { timeout_ms: 1000, .. })), "{result:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    let status = registers::ControllerStatus(controller.registers().read32(registers::CSTS));
    assert_eq!(status.shutdown(), ShutdownStatus::Occurring);
}

#[test]
fn a_reserved_shutdown_status_is_not_taken_for_complete() {
    // Goal: CSTS.SHST = 11b is reserved, not "complete": a controller reporting it while its
    // shutdown runs (600 ms here, within RTD3E 3 s) is waited for until SHST reads 10b, and
    // teardown does not clear CC.EN before. It used to read as complete, so shutdown() returned
    // at once and Drop disabled the controller mid write-back.
    let script = FakeScript { shutdown_status_in_progress: 0b11, ..slow_shutdown(3_000_000, Duration::from_millis(600)) };
    let (device, controller) = bring_up(script.clone());
    let started = Instant::now();
    let result = controller.shutdown();
    assert!(result.is_ok(), "{result:?}");
    assert!(started.elapsed() >= Duration::from_millis(600), "returned after {:?}", started.elapsed());
    assert_eq!(controller.status().expect("status").shutdown(), ShutdownStatus::Complete);
    drop(controller);
    assert_eq!(device.counters().disables_during_shutdown, 0);

    let (device, controller) = bring_up(script);
    drop(controller);
    let counters = device.counters();
    assert_eq!(counters.disables_during_shutdown, 0, "{counters:?}");
    assert_eq!(counters.disables, 1, "{counters:?}");
}

#[test]
fn a_shut_down_controller_creates_no_queue_pair_until_a_reset() {
    // Goal: after a normal shutdown the controller executes no command until CC.EN goes 1 → 0
    // (§3.6.1), so creating a queue pair is refused up front: before, Create I/O CQ/SQ went to
    // the controller, and one that timed out there left its rings leaked and its id reserved.
    // A reset makes the controller usable again.
    let (_device, mut controller) = bring_up(FakeScript::default());
    controller.shutdown().expect("shutdown");
    let host_driven = controller.create_io_queue_pair(8).map(drop);
    assert!(matches!(host_driven, Err(NvmeError::ControllerShutDown)), "{host_driven:?}");
    let detached = controller.create_detached_queue_pair(8, None).map(drop);
    assert!(matches!(detached, Err(NvmeError::ControllerShutDown)), "{detached:?}");
    controller.reset(false).expect("reset");
    controller.create_io_queue_pair(8).expect("a reset controller creates queue pairs again");
}

#[test]
fn after_a_shutdown_a_failed_reset_refuses_queue_pairs_as_not_ready() {
    // Goal: after a shutdown, a reset that fails, before the controller was seen to stop or
    // after, leaves queue pair creation refused, with ControllerNotReady naming the stage it
    // failed at (checked before the shutdown): what shutdown()'s doc says. A reset that then
    // succeeds makes the controller usable again.
    use crate::spec::command::AdminOpcode;
    use crate::spec::status::{codes, NvmeStatus};
    use crate::BringUpStage;
    let (device, mut controller) = bring_up(FakeScript::default());
    controller.shutdown().expect("shutdown");
    device.update_script(|script| script.disable_completes = false);
    assert!(controller.reset(false).is_err(), "the controller never stops");
    let refused = controller.create_io_queue_pair(8).map(drop);
    assert!(matches!(refused, Err(NvmeError::ControllerNotReady { stage: BringUpStage::WaitNotReady })), "{refused:?}");
    device.update_script(|script| {
        script.disable_completes = true;
        script.admin_failures = vec![(AdminOpcode::Identify as u8, NvmeStatus::generic(codes::INTERNAL_ERROR))];
    });
    assert!(controller.reset(false).is_err(), "Identify fails after the controller stopped");
    let refused = controller.create_detached_queue_pair(8, None).map(drop);
    assert!(matches!(refused, Err(NvmeError::ControllerNotReady { stage: BringUpStage::Identify })), "{refused:?}");
    device.update_script(|script| script.admin_failures.clear());
    controller.reset(false).expect("reset");
    controller.create_io_queue_pair(8).expect("a reset controller creates queue pairs again");
}
