//! The NVMe queue pair of one gio device as the CUDA executor keeps it across resets: a detached
//! pair ([`DetachedQueuePair`]) on rings the executor allocated once and registered with the GPU.
//!
//! After a kernel timeout the executor replaces every pair: delete it on the controller, then
//! create a new one on the same rings (their GPU registrations stay valid). The rings may be
//! reused only once the controller is known to be done with them. So:
//! - a deletion that fails keeps the undeleted pair, and with it the rings: nothing is created on
//!   them, the failure is [`GioError::UndeletedQueuePair`] naming the queue, and the next
//!   replacement tries the deletion again (the pattern of `CpuExecutor::reset`);
//! - a creation that fails and that the driver could not undo (it then keeps the rings, counted
//!   in `Controller::leaked_queue_pairs`) retires the rings for good: no later replacement
//!   touches them;
//! - a pair already replaced for a reset is not replaced again when the reset is retried after
//!   another device's failure (nothing ran on it since).
//!
//! No CUDA here: the decisions are tested against the software controller on any machine.

use std::sync::Arc;

use nvme_driver::{Controller, DetachedQueueLayout, DetachedQueuePair, DmaRegion};

use crate::error::GioError;

/// Where a device's pair stands.
#[derive(Debug)]
enum PairState {
    /// On the controller and usable by the kernel; created for reset generation `generation`
    /// (0: at set-up).
    Live { pair: DetachedQueuePair, generation: u64 },
    /// Its deletion failed: the controller may still fetch from the SQ and write the CQ.
    Undeleted(Box<DetachedQueuePair>),
    /// Deleted; the creation of its successor failed but left nothing on the controller.
    Deleted,
    /// A creation on these rings failed and could not be undone: the driver keeps them.
    Retired,
}

/// One gio device's rings and the pair on them (see the module documentation).
#[derive(Debug)]
pub(crate) struct DetachedRings {
    controller: Arc<Controller>,
    submission: DmaRegion,
    completion: DmaRegion,
    depth: u32,
    state: PairState,
}

impl DetachedRings {
    /// Creates the first pair on `submission` / `completion` (reset generation 0); returns its
    /// layout too.
    pub(crate) fn create(
        controller: Arc<Controller>,
        submission: DmaRegion,
        completion: DmaRegion,
        depth: u32,
    ) -> Result<(Self, DetachedQueueLayout), nvme_driver::NvmeError> {
        let pair = controller.create_detached_queue_pair(depth, Some((submission.clone(), completion.clone())))?;
        let layout = pair.layout();
        Ok((Self { controller, submission, completion, depth, state: PairState::Live { pair, generation: 0 } }, layout))
    }

    /// The live pair's layout; `None` while a replacement is unfinished or the rings are retired.
    #[cfg(test)]
    pub(crate) fn layout(&self) -> Option<DetachedQueueLayout> {
        match &self.state {
            PairState::Live { pair, .. } => Some(pair.layout()),
            PairState::Undeleted(_) | PairState::Deleted | PairState::Retired => None,
        }
    }

    pub(crate) fn depth(&self) -> u32 {
        self.depth
    }

    /// Deletes the pair for good (teardown): afterwards the controller no longer uses the rings.
    /// A failed deletion keeps the pair, as in [`DetachedRings::replace`], and calling again
    /// retries it. Rings with no pair are done already: `Deleted`, and `Retired`, whose queues
    /// the driver keeps but no kernel was ever given (a failed creation), so no doorbell of
    /// theirs was rung and no command of theirs exists.
    pub(crate) fn delete(&mut self, device: usize) -> Result<(), GioError> {
        let pair = match std::mem::replace(&mut self.state, PairState::Deleted) {
            PairState::Live { pair, .. } => pair,
            PairState::Undeleted(pair) => *pair,
            PairState::Deleted => return Ok(()),
            PairState::Retired => {
                self.state = PairState::Retired;
                return Ok(());
            }
        };
        pair.delete().map_err(|undeleted| {
            let queue = undeleted.pair.layout().id;
            self.state = PairState::Undeleted(undeleted.pair);
            GioError::UndeletedQueuePair { device, queue, source: undeleted.source }
        })
    }

    /// Deletes the pair and creates one on the same rings for reset `generation` (the caller
    /// has stopped every kernel that could use the old one). Returns the new layout, or the
    /// live pair's when it was already made for `generation`. `device` names the gio device in
    /// errors. On a failed deletion the undeleted pair is kept, the rings are not touched, and
    /// the error is [`GioError::UndeletedQueuePair`]; calling again retries the deletion.
    pub(crate) fn replace(&mut self, device: usize, generation: u64) -> Result<DetachedQueueLayout, GioError> {
        let pair = match std::mem::replace(&mut self.state, PairState::Deleted) {
            PairState::Live { pair, generation: made_for } if made_for == generation => {
                let layout = pair.layout();
                self.state = PairState::Live { pair, generation };
                return Ok(layout);
            }
            PairState::Live { pair, .. } => Some(pair),
            PairState::Undeleted(pair) => Some(*pair),
            PairState::Deleted => None,
            PairState::Retired => {
                self.state = PairState::Retired;
                return Err(GioError::Executor {
                    executor: "cuda",
                    reason: format!(
                        "gio device {device}: a queue creation on its rings failed and could not be undone, so the driver keeps them \
                         (the controller may use them) and they are never reused; build a new executor"
                    ),
                });
            }
        };
        if let Some(pair) = pair {
            if let Err(undeleted) = pair.delete() {
                let queue = undeleted.pair.layout().id;
                self.state = PairState::Undeleted(undeleted.pair);
                return Err(GioError::UndeletedQueuePair { device, queue, source: undeleted.source });
            }
        }
        let leaked_before = self.controller.leaked_queue_pairs();
        match self.controller.create_detached_queue_pair(self.depth, Some((self.submission.clone(), self.completion.clone()))) {
            Ok(pair) => {
                let layout = pair.layout();
                self.state = PairState::Live { pair, generation };
                Ok(layout)
            }
            Err(source) => {
                // A rise of the leak count (ours, or another pair's at the same moment: then
                // the rings are retired needlessly, never reused wrongly) means the driver kept
                // these rings because the controller may still use them.
                if self.controller.leaked_queue_pairs() != leaked_before {
                    self.state = PairState::Retired;
                }
                Err(GioError::Nvme { context: format!("gio device {device}: recreate detached queue pair"), source })
            }
        }
    }
}

/// Teardown of the CUDA executor: deletes every device's pair, retrying those a failed deletion
/// kept; `Ok` when the controller is known done with all of them (`Executor::
/// retire_queue_pairs`), else the first failure. The caller has stopped every kernel (drained
/// the stream) and launches none afterwards. A deletion that fails keeps its pair (the rings
/// untouched) for the next call; the other devices are still deleted.
pub(crate) fn delete_all<'a>(queues: impl IntoIterator<Item = &'a mut DetachedRings>) -> Result<(), GioError> {
    let mut first_error = None;
    for (device, rings) in queues.into_iter().enumerate() {
        if let Err(error) = rings.delete(device) {
            tracing::error!(device, %error, "gio-uring CUDA executor teardown: a detached queue pair could not be deleted");
            first_error.get_or_insert(error);
        }
    }
    first_error.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme_driver::hw::DeviceBackend;
    use nvme_driver::spec::status::codes;
    use nvme_driver::spec::{NvmeStatus, COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
    use nvme_driver::ControllerConfig;
    use nvme_emu::{EmuConfig, EmuDevice, FaultAction, FaultPlan, FaultRule, QueueFilter};

    const DEPTH: u32 = 16;
    const DELETE_SQ: u8 = 0x00;
    const CREATE_SQ: u8 = 0x01;
    const DELETE_CQ: u8 = 0x04;
    const CREATE_CQ: u8 = 0x05;

    fn rig() -> (Arc<EmuDevice>, Arc<Controller>, DetachedRings) {
        let device = EmuDevice::start(EmuConfig::default()).expect("software controller");
        let backend: Arc<dyn DeviceBackend> = device.clone();
        let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"));
        let submission = controller.dma().allocate(DEPTH as usize * SUBMISSION_ENTRY_BYTES).unwrap();
        let completion = controller.dma().allocate(DEPTH as usize * COMPLETION_ENTRY_BYTES).unwrap();
        let (rings, layout) = DetachedRings::create(Arc::clone(&controller), submission, completion, DEPTH).unwrap();
        assert_eq!(rings.layout(), Some(layout));
        (device, controller, rings)
    }

    fn admin_commands(device: &EmuDevice, opcode: u8) -> u64 {
        device.stats().admin_commands.get(&opcode).copied().unwrap_or(0)
    }

    /// The `nth` admin command with `opcode` from now on fails with an internal error.
    fn refuse(nth: u64, opcode: u8) -> FaultRule {
        FaultRule {
            nth,
            queue: QueueFilter::Admin,
            opcode: Some(opcode),
            action: FaultAction::Status(NvmeStatus::generic(codes::INTERNAL_ERROR)),
            repeat: false,
        }
    }

    #[test]
    fn a_pair_whose_deletion_fails_is_kept_and_its_rings_are_not_reused_until_a_retry_deletes_it() {
        // Goal: the executor's reset never creates a queue on rings the controller may still
        // use. A refused Delete I/O SQ leaves the pair undeleted: no Create command follows,
        // the error names the device and the queue, there is no layout for the kernel, and
        // nothing is leaked yet. The retry deletes the kept pair first, then creates on the
        // same rings; a retry of the same reset does not replace the new pair again.
        let (device, controller, mut rings) = rig();
        let first = rings.layout().unwrap();
        device.set_faults(FaultPlan::none().with_rule(refuse(1, DELETE_SQ)));
        let creates = (admin_commands(&device, CREATE_CQ), admin_commands(&device, CREATE_SQ));
        let refused = rings.replace(3, 1);
        match &refused {
            Err(GioError::UndeletedQueuePair { device: 3, queue, .. }) => assert_eq!(*queue, first.id),
            other => panic!("expected UndeletedQueuePair for device 3: {other:?}"),
        }
        assert!(refused.unwrap_err().to_string().contains(&first.id.to_string()));
        assert_eq!((admin_commands(&device, CREATE_CQ), admin_commands(&device, CREATE_SQ)), creates, "nothing created on the rings");
        assert!(rings.layout().is_none(), "no queue pair for the kernel while the old one may run");
        assert_eq!(controller.leaked_queue_pairs(), 0, "kept by the executor, not leaked (a retry may still delete it)");
        let deletes = admin_commands(&device, DELETE_SQ);
        let second = rings.replace(3, 1).unwrap();
        assert_eq!(admin_commands(&device, DELETE_SQ), deletes + 1, "the retry deleted the kept pair");
        assert_eq!((second.submission_iova, second.completion_iova), (first.submission_iova, first.completion_iova), "the same rings");
        assert_eq!(rings.layout(), Some(second));
        let commands = device.stats().admin_commands.values().sum::<u64>();
        assert_eq!(rings.replace(3, 1).unwrap(), second, "already replaced for this reset");
        assert_eq!(device.stats().admin_commands.values().sum::<u64>(), commands, "without a command");
        assert_eq!(controller.leaked_queue_pairs(), 0);
    }

    #[test]
    fn an_undeleted_pair_dropped_with_the_executor_leaks_its_rings_rather_than_freeing_them() {
        // Goal: if the deletion never succeeds, the rings outlive the executor (leaked,
        // counted), because the controller may still write them.
        let (device, controller, mut rings) = rig();
        device.set_faults(FaultPlan::none().with_rule(refuse(1, DELETE_SQ)).with_rule(refuse(2, DELETE_SQ)));
        assert!(matches!(rings.replace(0, 1), Err(GioError::UndeletedQueuePair { .. })));
        let ring_bytes = (rings.submission.len() + rings.completion.len()) as u64;
        drop(rings);
        assert_eq!(controller.leaked_queue_pairs(), 1);
        assert_eq!(controller.leaked_bytes(), ring_bytes);
    }

    #[test]
    fn rings_a_failed_creation_could_not_release_are_never_used_again() {
        // Goal: when the recreation fails after the CQ was created and the driver cannot
        // delete that CQ again, it keeps the rings; the executor then retires them: no later
        // replacement creates anything on them, and each says why.
        let (device, controller, mut rings) = rig();
        device.set_faults(FaultPlan::none().with_rule(refuse(1, CREATE_SQ)).with_rule(refuse(2, DELETE_CQ)));
        assert!(matches!(rings.replace(0, 1), Err(GioError::Nvme { .. })));
        assert_eq!(controller.leaked_queue_pairs(), 1, "the driver kept the rings");
        let creates = admin_commands(&device, CREATE_CQ);
        let retired = rings.replace(0, 2);
        assert!(matches!(&retired, Err(GioError::Executor { reason, .. }) if reason.contains("never reused")), "{retired:?}");
        assert_eq!(admin_commands(&device, CREATE_CQ), creates, "nothing created on retired rings");
        assert!(rings.layout().is_none());
    }

    #[test]
    fn a_creation_that_failed_cleanly_is_retried_on_the_same_rings() {
        // Goal: a refused Create I/O CQ leaves nothing on the controller, so the next
        // replacement creates on the same rings.
        let (device, controller, mut rings) = rig();
        let first = rings.layout().unwrap();
        device.set_faults(FaultPlan::none().with_rule(refuse(1, CREATE_CQ)));
        assert!(matches!(rings.replace(0, 1), Err(GioError::Nvme { .. })));
        assert_eq!(controller.leaked_queue_pairs(), 0);
        let layout = rings.replace(0, 1).unwrap();
        assert_eq!(layout.submission_iova, first.submission_iova);
        assert_eq!(rings.depth(), DEPTH);
    }
    #[test]
    fn teardown_deletes_every_pair_and_reports_one_it_could_not_until_a_retry_deletes_it() {
        // Goal: the CUDA executor's teardown answers Some(true) only when the controller is done
        // with every detached pair. A refused Delete I/O SQ keeps that pair (false), the other
        // device's pair is still deleted, and the next call deletes the kept one (true) without
        // touching the pair already gone; rings a creation left to the driver are not the
        // executor's to delete.
        let (device, _controller, first) = rig();
        let (_, _, second) = rig();
        let mut queues = [first, second];
        device.set_faults(FaultPlan::none().with_rule(refuse(1, DELETE_SQ)));
        assert!(
            matches!(delete_all(queues.iter_mut()), Err(GioError::UndeletedQueuePair { device: 0, .. })),
            "a refused deletion is reported"
        );
        assert!(matches!(queues[0].state, PairState::Undeleted(_)), "kept for a retry: {:?}", queues[0].state);
        assert!(matches!(queues[1].state, PairState::Deleted), "the other device's pair is deleted anyway");
        let deletes = admin_commands(&device, DELETE_SQ);
        assert!(delete_all(queues.iter_mut()).is_ok(), "the retry deleted the kept pair");
        assert_eq!(admin_commands(&device, DELETE_SQ), deletes + 1);
        assert!(queues.iter().all(|rings| matches!(rings.state, PairState::Deleted)));
        assert!(delete_all(queues.iter_mut()).is_ok(), "nothing left to delete");
        assert_eq!(admin_commands(&device, DELETE_SQ), deletes + 1, "no command for a pair already deleted");

        let (device, _controller, mut rings) = rig();
        device.set_faults(FaultPlan::none().with_rule(refuse(1, CREATE_SQ)).with_rule(refuse(2, DELETE_CQ)));
        assert!(matches!(rings.replace(0, 1), Err(GioError::Nvme { .. })));
        assert!(matches!(rings.state, PairState::Retired));
        assert!(delete_all([&mut rings]).is_ok(), "no command can run on rings the driver keeps: no kernel was given them");
    }
}
