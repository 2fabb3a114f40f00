//! Deleting a queue pair again after a deletion command timed out, against the scripted fake
//! controller. Each test opens with its goal.

use std::time::Duration;

use crate::fake_device::{FakeDevice, FakeScript};
use crate::spec::AdminOpcode;
use crate::{Controller, ControllerConfig, NvmeError, QueueId};

fn bring_up() -> (std::sync::Arc<FakeDevice>, Controller) {
    let device = FakeDevice::new(FakeScript::default());
    let config = ControllerConfig { admin_timeout: Duration::from_millis(200), ..ControllerConfig::default() };
    let controller = Controller::init(device.clone(), config).expect("bring-up");
    (device, controller)
}

#[test]
fn a_delete_retried_after_a_late_delete_sq_completes() {
    // Goal: a Delete I/O SQ that timed out and then completed late (the SQ is gone) does not
    // make the retry fail: its Delete I/O SQ is answered Invalid Queue Identifier, which says
    // the queue is already gone, and the retry goes on to delete the CQ. Before, the retry
    // returned that status as an error, with no way to delete the pair short of a reset: its
    // rings leaked and its queue id stayed reserved.
    let (device, controller) = bring_up();
    let pair = controller.create_io_queue_pair(8).expect("queue pair");
    device.update_script(|script| script.admin_unanswered = vec![AdminOpcode::DeleteIoSubmissionQueue as u8]);
    let undeleted = pair.delete().expect_err("the Delete I/O SQ is never answered");
    assert!(matches!(undeleted.source, NvmeError::Timeout { queue: QueueId(0), .. }), "{:?}", undeleted.source);
    device.update_script(|script| script.admin_unanswered.clear());
    assert_eq!(device.answer_withheld(), 1, "the late Delete I/O SQ executes now");
    let retried = undeleted.pair.delete();
    assert!(retried.is_ok(), "{:?}", retried.err().map(|undeleted| undeleted.source));
    assert_eq!(controller.leaked_queue_pairs(), 0);
    assert_eq!(controller.create_io_queue_pair(8).expect("queue pair").id(), QueueId(1), "the id was released");
}

#[test]
fn a_delete_retried_after_a_late_delete_sq_completes_behind_an_unexpected_completion() {
    // Goal: a completion naming nothing in flight, posted on the admin CQ before the late
    // answer to a Delete I/O SQ that timed out, does not keep the retry from consuming that
    // answer: the stray is stepped over (and logged), the late completion read, and the retry
    // deletes the pair. Before, consuming the late completions stopped at the stray and returned
    // UnexpectedCompletion to the retry, which tuttid takes as final: the pair was kept for good.
    let (device, controller) = bring_up();
    let pair = controller.create_io_queue_pair(8).expect("queue pair");
    device.update_script(|script| script.admin_unanswered = vec![AdminOpcode::DeleteIoSubmissionQueue as u8]);
    let undeleted = pair.delete().expect_err("the Delete I/O SQ is never answered");
    assert!(matches!(undeleted.source, NvmeError::Timeout { queue: QueueId(0), .. }), "{:?}", undeleted.source);
    device.update_script(|script| script.admin_unanswered.clear());
    device.post_unexpected(0, 0x7700);
    assert_eq!(device.answer_withheld(), 1, "the late Delete I/O SQ executes now");
    let retried = undeleted.pair.delete();
    assert!(retried.is_ok(), "{:?}", retried.err().map(|undeleted| undeleted.source));
    assert_eq!(controller.leaked_queue_pairs(), 0);
    assert_eq!(controller.create_io_queue_pair(8).expect("queue pair").id(), QueueId(1), "the id was released");
}

#[test]
fn a_delete_retried_after_a_late_delete_cq_completes() {
    // Goal: the same for the CQ: a Delete I/O CQ that timed out and completed late leaves a
    // retry that finds the CQ gone (Invalid Queue Identifier) done, not failed.
    let (device, controller) = bring_up();
    let pair = controller.create_io_queue_pair(8).expect("queue pair");
    device.update_script(|script| script.admin_unanswered = vec![AdminOpcode::DeleteIoCompletionQueue as u8]);
    let undeleted = pair.delete().expect_err("the Delete I/O CQ is never answered");
    assert!(matches!(undeleted.source, NvmeError::Timeout { queue: QueueId(0), .. }), "{:?}", undeleted.source);
    device.update_script(|script| script.admin_unanswered.clear());
    assert_eq!(device.answer_withheld(), 1);
    let retried = undeleted.pair.delete();
    assert!(retried.is_ok(), "{:?}", retried.err().map(|undeleted| undeleted.source));
    assert_eq!(controller.leaked_queue_pairs(), 0);
}
