//! Retiring a finished launch of the I/O kernel, on the CPU: everything here reads and writes
//! only the gio queue's shared memory, so it is unit-tested without a GPU.
//!
//! Order, once the launch's event says the kernel (and its copies) completed:
//! 1. [`settle`]: any IOCB the kernel left ISSUED is finished as TIMEOUT (same compare-and-swap as
//!    the kernel, so still one completion per issue); reports whether any IOCB timed out (or the
//!    kernel requested a queue-pair reset in its sink). For a
//!    launch whose enqueueing failed after the kernel started ([`Enqueued::Partly`]: a staged
//!    copy that should have followed it never ran), an IOCB the kernel finished as SUCCESS
//!    becomes TIMEOUT too: its bytes may not be where the caller reads them;
//! 2. the caller resets the NVMe queue pairs if so;
//! 3. [`post_completions`]: one CQE per IOCB, built from its final line;
//! 4. [`advance_sq`]: the SQ head moves past the launch, which only now stops reading its entries.
//!
//! A step that fails leaves the launch unretired and the next `poll` retries; every step is
//! idempotent or resumes where it stopped: [`settle_once`] records settle's verdict and does not
//! settle again (an IOCB whose CQE was posted may have been issued anew meanwhile), and
//! `post_completions` counts the CQEs it posted.

use std::sync::atomic::Ordering;

use crate::abi;
use crate::error::GioError;
use crate::executor::post_cqe;
use crate::layout::{IocbField, QueueMemory};
use crate::ring::{Cqe, Ring};
use crate::types::IocbId;

fn retire_error(reason: String) -> GioError {
    GioError::Executor { executor: "cuda", reason }
}

/// The IOCB id at free-running SQ position `position`, checked against the pool.
pub fn sq_entry(memory: &QueueMemory, position: u32) -> Result<IocbId, GioError> {
    let sq = memory.layout.sq;
    let offset = sq.entries_offset_bytes + (position & sq.mask()) as usize * 4;
    let id = memory.region.load_u32(offset, Ordering::Relaxed);
    if id >= memory.layout.config.depth {
        return Err(retire_error(format!("SQ position {position} holds IOCB {id}, outside depth {}", memory.layout.config.depth)));
    }
    Ok(IocbId(id))
}

/// How much of a launch reached the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// Everything: the copies, the kernel and the event (or nothing that uses the caller's
    /// memory: every IOCB is still ISSUED and times out).
    Fully,
    /// Part of it: a staged GPU-to-host copy of a write, or the kernel, reached the stream, but
    /// a later step failed to enqueue (another copy, the kernel, a staged host-to-GPU copy of
    /// a read, the event). What did reach it may still run until the stream drains, and some
    /// IOCB's data may never have been copied into place.
    Partly,
}

/// Finishes IOCBs the kernel left ISSUED as TIMEOUT, and with [`Enqueued::Partly`] those it
/// finished as SUCCESS too (conservatively every one of the launch, not only those whose copy
/// failed: which copies ran is not known here); an IOCB the kernel failed keeps its failure.
/// True if any IOCB of the launch ended with a status after which the queue pairs must be
/// reset (a timeout or a controller fault of the kernel's; not the forced ones, whose NVMe
/// commands all completed).
///
/// A final line no executor may leave (a status that is not terminal or not known, a failed
/// IOCTX outside the IOCB or one that contradicts the status) is not trusted either: it ends
/// as TIMEOUT with no failed IOCTX, and the queue pairs are reset (the kernel broke the
/// protocol; what its commands did is unknown). Posted as it was, the queue would refuse its
/// CQE and the IOCB would stay in flight for good.
///
/// `kernel_requested_reset`: the kernel counted a reset request in its sink
/// (`gio_ring_header.reset_requests`) since the last reset: it left a queue pair damaged in a way
/// no IOCB's status need show (an abandoned SQ ticket, a controller fault after every IOCB was
/// final), so the queue pairs are reset even if every IOCB succeeded.
pub fn settle(memory: &QueueMemory, sq_first: u32, count: u32, enqueued: Enqueued, kernel_requested_reset: bool) -> Result<bool, GioError> {
    let mut reset_needed = kernel_requested_reset;
    for position in 0..count {
        let id = sq_entry(memory, sq_first.wrapping_add(position))?;
        let status = memory.iocb_field_offset(id, IocbField::Status);
        let abandoned = memory
            .region
            .compare_exchange_u32(status, abi::GIO_IOCB_STATUS_ISSUED, abi::GIO_IOCB_STATUS_TIMEOUT, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        // The kernel has exited (the caller waited for the launch's event or drained the
        // stream), so nothing else writes the line: the Acquire above covers its other fields.
        let failed_ioctx_offset = memory.iocb_field_offset(id, IocbField::FailedIoctx);
        let failed_ioctx = memory.region.load_u32(failed_ioctx_offset, Ordering::Relaxed);
        let ioctx_count = memory.read_iocb_header(id).ioctx_count;
        // The fields a CQE will carry; only the NVMe status does not decide whether they are
        // possible.
        let ended = abi::IocbStatus::from_abi(memory.region.load_u32(status, Ordering::Acquire))
            .filter(|&ended| crate::queue::issue_outcome(Some(ended), failed_ioctx, ioctx_count, 0).is_ok());
        let Some(ended) = ended else {
            memory.region.store_u32(failed_ioctx_offset, abi::GIO_NO_FAILED_IOCTX, Ordering::Relaxed);
            memory.region.store_u32(status, abi::GIO_IOCB_STATUS_TIMEOUT, Ordering::Release);
            tracing::error!(%id, "gio-uring: the I/O kernel left an impossible final status; it ends as timed out");
            reset_needed = true;
            continue;
        };
        reset_needed |= abandoned || ended.requires_queue_pair_reset();
        if enqueued == Enqueued::Partly && ended == abi::IocbStatus::Success {
            memory.region.store_u32(status, abi::GIO_IOCB_STATUS_TIMEOUT, Ordering::Release);
        }
    }
    Ok(reset_needed)
}

/// [`settle`] at most once per launch: `settled` is the launch's record of its verdict (`None`
/// until settle first succeeds). A retirement retried after a later step failed (a reset, a full
/// CQ, the SQ header) must not settle again: once some CQEs are posted, the caller may have
/// reaped one and issued that IOCB again, and settling would finish the new issue, still ISSUED,
/// as TIMEOUT. The retry reuses the verdict, with a reset request the kernel raised since.
pub fn settle_once(
    memory: &QueueMemory,
    sq_first: u32,
    count: u32,
    enqueued: Enqueued,
    kernel_requested_reset: bool,
    settled: &mut Option<bool>,
) -> Result<bool, GioError> {
    if let Some(verdict) = *settled {
        return Ok(verdict || kernel_requested_reset);
    }
    let verdict = settle(memory, sq_first, count, enqueued, kernel_requested_reset)?;
    *settled = Some(verdict);
    Ok(verdict)
}

/// Posts one CQE per IOCB of the launch from the IOCB's final line, starting after the
/// `posted` first (those an earlier, failed attempt posted) and counting each one posted, so a
/// retry after a failure part way (a full CQ) never posts a CQE twice.
pub fn post_completions(memory: &QueueMemory, sq_first: u32, count: u32, posted: &mut u32) -> Result<(), GioError> {
    for position in *posted..count {
        let id = sq_entry(memory, sq_first.wrapping_add(position))?;
        let header = memory.read_iocb_header(id);
        let progress = memory.read_iocb_progress(id);
        let failed = progress.failed_ioctx != abi::GIO_NO_FAILED_IOCTX;
        post_cqe(
            memory,
            Cqe {
                iocb_id: id,
                issue_seq: header.issue_seq,
                failed_ioctx: progress.failed_ioctx,
                status: progress.status as u16,
                failed_nvme_status: if failed { progress.failed_nvme_status } else { 0 },
            },
        )?;
        *posted = position + 1;
    }
    Ok(())
}

/// Moves the SQ head past the launch; the launch must be the oldest entries on the SQ.
pub fn advance_sq(memory: &QueueMemory, sq_first: u32, count: u32) -> Result<(), GioError> {
    let ring: Ring<'_, IocbId> = Ring::new(&memory.region, memory.layout.sq, "sq");
    let mut consumer = ring.consumer()?;
    if consumer.head() != sq_first || consumer.len() < count {
        return Err(retire_error(format!(
            "SQ at {} with {} entries cannot retire the launch at {sq_first} of {count}",
            consumer.head(),
            consumer.len()
        )));
    }
    consumer.by_ref().take(count as usize).for_each(drop);
    Ok(()) // dropping the consumer publishes the head (Release)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{NvmeStatus, Opcode};
    use crate::error::IocbFailure;
    use crate::executor::{Executor, IssueBatch};
    use crate::layout::QueueConfig;
    use crate::queue::GioQueue;
    use crate::types::{Dependency, DeviceIndex, Iova, IovaRange, LayerIndex, Lba, SmBudget};
    use crate::validate::{Descriptor, DeviceInfo, DeviceTable, IocbSpec, IoctxSpec, RegisteredMemory};
    use std::time::{Duration, Instant};

    /// Plays a kernel that was launched and has not exited: leaves the SQ entries in place.
    struct Launched;

    impl Executor for Launched {
        fn name(&self) -> &'static str {
            "launched"
        }
        fn submit(&mut self, _memory: &QueueMemory, _batch: &IssueBatch) -> Result<(), GioError> {
            Ok(())
        }
        fn poll(&mut self, _memory: &QueueMemory) -> Result<(), GioError> {
            Ok(())
        }
    }

    fn queue_with_two_issued() -> (GioQueue<Launched>, [IocbId; 2]) {
        let devices = DeviceTable::new(vec![DeviceInfo { nsid: 1, capacity_blocks: 1 << 20, block_bytes: 512, sgl_supported: true }]);
        let registered = RegisteredMemory::new(vec![IovaRange::new(Iova(0x1000_0000), 1 << 20)]).unwrap();
        let mut queue = GioQueue::init_queue(QueueConfig { depth: 4, ioctx_per_iocb_max: 4 }, devices, registered, Launched).unwrap();
        let ids = queue.get_iocb(2, Dependency::None).unwrap();
        let spec = IocbSpec {
            opcode: Opcode::Read,
            user_data: 9,
            layer_count: 1,
            lba_stride_blocks: 0,
            mem_stride_bytes: 0,
            desc_stride_bytes: 0,
        };
        let ioctx = IoctxSpec {
            device: DeviceIndex(0),
            nsid: 1,
            start_lba: Lba(0),
            block_count: 1,
            data: Iova(0x1000_0000),
            descriptor: Descriptor::SglInline,
            force_unit_access: false,
        };
        for &id in &ids {
            queue.fill_iocb(id, &spec, &[ioctx, ioctx]).unwrap();
        }
        queue.issue_io(&ids, LayerIndex(0), SmBudget(1)).unwrap();
        (queue, [ids[0], ids[1]])
    }

    #[test]
    fn retiring_posts_each_final_status_and_frees_the_sq_only_at_the_end() {
        // Goal: after "the kernel" finished one IOCB with an NVMe error and left the other
        // ISSUED, retirement reports a timeout, posts both CQEs (error with its IOCTX and status,
        // and a timeout), and frees exactly the launch's SQ entries.
        let (mut queue, [a, b]) = queue_with_two_issued();
        let memory = queue.memory();
        memory.region.store_u32(memory.iocb_field_offset(a, IocbField::FailedIoctx), 1, Ordering::Relaxed);
        memory.region.store_u16(memory.iocb_field_offset(a, IocbField::FailedNvmeStatus), NvmeStatus::new(2, 0x81).0, Ordering::Relaxed);
        memory.region.store_u32(memory.iocb_field_offset(a, IocbField::Status), abi::GIO_IOCB_STATUS_NVME_ERROR, Ordering::Release);
        assert!(settle(memory, 0, 2, Enqueued::Fully, false).unwrap(), "IOCB b was left ISSUED: a timeout");
        assert!(queue.peek_cqe().unwrap().is_none(), "nothing is visible before the CQEs are posted");
        let memory = queue.memory();
        post_completions(memory, 0, 2, &mut 0).unwrap();
        advance_sq(memory, 0, 2).unwrap();
        assert!(advance_sq(memory, 0, 2).is_err(), "a launch cannot be retired twice");
        let deadline = Instant::now() + Duration::from_secs(1);
        match queue.wait_cqe(a, deadline).unwrap().result {
            Err(IocbFailure::Nvme { ioctx_index: 1, status }) => assert_eq!(status.status_code(), 0x81),
            other => panic!("IOCB a: {other:?}"),
        }
        assert!(matches!(queue.wait_cqe(b, deadline).unwrap().result, Err(IocbFailure::Timeout { .. })));
        // Both can be issued again, and the SQ has room for them.
        queue.issue_io(&[a, b], LayerIndex(0), SmBudget(1)).unwrap();
    }

    #[test]
    fn an_impossible_final_status_ends_as_a_timeout_and_asks_for_a_reset() {
        // Goal: the kernel left an IOCB's line 1 with a status no executor may end it with
        // (IDLE, an unknown code) or a failed IOCTX outside the IOCB. Its CQE must still end
        // the issue, as a timeout (and the queue pairs are reset), not be dropped by the
        // queue's checks with the IOCB left in flight for good.
        for (status, failed_ioctx) in [
            (abi::GIO_IOCB_STATUS_IDLE, abi::GIO_NO_FAILED_IOCTX),
            (42, abi::GIO_NO_FAILED_IOCTX),
            (abi::GIO_IOCB_STATUS_NVME_ERROR, 7),
            (abi::GIO_IOCB_STATUS_SUCCESS, 1),
        ] {
            let (mut queue, [a, b]) = queue_with_two_issued();
            let memory = queue.memory();
            memory.region.store_u32(memory.iocb_field_offset(a, IocbField::FailedIoctx), failed_ioctx, Ordering::Relaxed);
            memory.region.store_u32(memory.iocb_field_offset(a, IocbField::Status), status, Ordering::Release);
            memory.region.store_u32(memory.iocb_field_offset(b, IocbField::Status), abi::GIO_IOCB_STATUS_SUCCESS, Ordering::Release);
            assert!(settle(memory, 0, 2, Enqueued::Fully, false).unwrap(), "status {status}: the queue pairs must be reset");
            post_completions(memory, 0, 2, &mut 0).unwrap();
            advance_sq(memory, 0, 2).unwrap();
            let deadline = Instant::now() + Duration::from_secs(1);
            let ended = queue.wait_cqe(a, deadline);
            assert!(
                matches!(&ended, Ok(completion) if completion.result == Err(IocbFailure::Timeout { ioctx_index: None })),
                "status {status}: {ended:?}"
            );
            assert_eq!(queue.wait_cqe(b, deadline).unwrap().result, Ok(()));
        }
    }

    /// Ends `ids` (both issued) with SUCCESS and fills three of the CQ's four entries with
    /// fillers: room for one of their CQEs. Returns the CQ, for the caller to drain.
    fn both_succeeded_behind_a_nearly_full_cq(memory: &QueueMemory, ids: [IocbId; 2]) -> Ring<'_, Cqe> {
        for id in ids {
            memory.region.store_u32(memory.iocb_field_offset(id, IocbField::Status), abi::GIO_IOCB_STATUS_SUCCESS, Ordering::Release);
        }
        let cq: Ring<'_, Cqe> = Ring::new(&memory.region, memory.layout.cq, "cq");
        let filler = Cqe { iocb_id: IocbId(3), issue_seq: 0, failed_ioctx: abi::GIO_NO_FAILED_IOCTX, status: 2, failed_nvme_status: 0 };
        let mut producer = cq.producer().unwrap();
        for _ in 0..3 {
            producer.push(filler).unwrap();
        }
        drop(producer);
        cq
    }

    #[test]
    fn a_retirement_retried_after_a_full_cq_posts_each_cqe_once() {
        // Goal: posting a launch's CQEs can fail part way (a full CQ); the retry on the next
        // poll resumes after the CQEs already posted, so each IOCB gets exactly one CQE.
        let (mut queue, [a, b]) = queue_with_two_issued();
        let memory = queue.memory();
        let cq = both_succeeded_behind_a_nearly_full_cq(memory, [a, b]);
        assert!(!settle(memory, 0, 2, Enqueued::Fully, false).unwrap());
        let mut posted = 0;
        assert!(matches!(post_completions(memory, 0, 2, &mut posted), Err(GioError::CompletionQueueFull { .. })), "room for one of two");
        assert_eq!(posted, 1);
        assert_eq!(cq.consumer().unwrap().by_ref().take(3).count(), 3, "the caller drains the fillers");
        post_completions(memory, 0, 2, &mut posted).unwrap();
        assert_eq!(posted, 2);
        advance_sq(memory, 0, 2).unwrap();
        let deadline = Instant::now() + Duration::from_secs(1);
        assert_eq!(queue.wait_cqe(a, deadline).unwrap().result, Ok(()));
        assert_eq!(queue.wait_cqe(b, deadline).unwrap().result, Ok(()));
        assert_eq!(queue.reap_cqe().unwrap(), None, "no second CQE for either IOCB");
    }

    #[test]
    fn a_retried_retirement_does_not_settle_an_iocb_reissued_after_its_cqe() {
        // Goal: a retirement that failed after posting some CQEs (a full CQ) is retried on a
        // later poll; meanwhile the caller may have reaped an IOCB's CQE and issued it again. The
        // retry must not settle the launch again: that would finish the IOCB's new issue, still
        // ISSUED, as TIMEOUT (a spurious failure and queue-pair reset).
        let (mut queue, [a, b]) = queue_with_two_issued();
        let memory = queue.memory();
        let cq = both_succeeded_behind_a_nearly_full_cq(memory, [a, b]);
        let mut settled = None;
        assert!(!settle_once(memory, 0, 2, Enqueued::Fully, false, &mut settled).unwrap());
        let mut posted = 0;
        assert!(post_completions(memory, 0, 2, &mut posted).is_err(), "room for a's CQE only");
        assert_eq!(cq.consumer().unwrap().by_ref().take(3).count(), 3, "the caller drains the fillers");
        let deadline = Instant::now() + Duration::from_secs(1);
        assert_eq!(queue.wait_cqe(a, deadline).unwrap().result, Ok(()));
        queue.issue_io(&[a], LayerIndex(0), SmBudget(1)).unwrap();
        let memory = queue.memory();
        assert!(!settle_once(memory, 0, 2, Enqueued::Fully, false, &mut settled).unwrap(), "the retry reports the first verdict");
        assert_eq!(memory.read_iocb_progress(a).status, abi::GIO_IOCB_STATUS_ISSUED, "a's new issue is left to its own launch");
        post_completions(memory, 0, 2, &mut posted).unwrap();
        advance_sq(memory, 0, 2).unwrap();
        assert_eq!(queue.wait_cqe(b, deadline).unwrap().result, Ok(()));
    }

    #[test]
    fn a_launch_that_finished_everything_needs_no_reset() {
        let (queue, [a, b]) = queue_with_two_issued();
        let memory = queue.memory();
        for id in [a, b] {
            memory.region.store_u32(memory.iocb_field_offset(id, IocbField::Status), abi::GIO_IOCB_STATUS_SUCCESS, Ordering::Release);
        }
        assert!(!settle(memory, 0, 2, Enqueued::Fully, false).unwrap());
        assert!(advance_sq(memory, 1, 1).is_err(), "retirement must start at the SQ head");
    }

    #[test]
    fn a_reset_the_kernel_requested_is_made_even_when_every_iocb_succeeded() {
        // Goal: damage a launch leaves on a queue pair that no IOCB's status shows (a reserved
        // SQ ticket abandoned while another IOCTX's NVMe error decided the IOCB's status; a
        // completion naming another SQ reaped after every IOCB was final) still resets the
        // queue pairs: the kernel raised the sink's reset request and settle reports it, with
        // every IOCB a success. Without the request, nothing asks for a reset.
        let (queue, [a, b]) = queue_with_two_issued();
        let memory = queue.memory();
        for id in [a, b] {
            memory.region.store_u32(memory.iocb_field_offset(id, IocbField::Status), abi::GIO_IOCB_STATUS_SUCCESS, Ordering::Release);
        }
        assert!(settle(memory, 0, 2, Enqueued::Fully, true).unwrap(), "the kernel asked for a queue-pair reset");
        assert!(!settle(memory, 0, 2, Enqueued::Fully, false).unwrap(), "nothing else asks for one");
        assert_eq!(queue.memory().read_iocb_progress(a).status, abi::GIO_IOCB_STATUS_SUCCESS, "the IOCBs keep their success");
    }

    #[test]
    fn a_controller_fault_resets_the_queue_pairs_and_reaches_the_caller_as_such() {
        // Goal: an IOCB the kernel failed because a completion named another SQ makes the
        // executor reset its queue pairs (like a timeout), and the caller sees a controller fault.
        let (mut queue, [a, b]) = queue_with_two_issued();
        let memory = queue.memory();
        memory.region.store_u32(memory.iocb_field_offset(a, IocbField::Status), abi::GIO_IOCB_STATUS_SUCCESS, Ordering::Release);
        memory.region.store_u32(memory.iocb_field_offset(b, IocbField::Status), abi::GIO_IOCB_STATUS_CONTROLLER_FAULT, Ordering::Release);
        assert!(settle(memory, 0, 2, Enqueued::Fully, false).unwrap(), "a controller fault requires a queue-pair reset");
        post_completions(memory, 0, 2, &mut 0).unwrap();
        advance_sq(memory, 0, 2).unwrap();
        let deadline = Instant::now() + Duration::from_secs(1);
        assert_eq!(queue.wait_cqe(a, deadline).unwrap().result, Ok(()));
        assert_eq!(queue.wait_cqe(b, deadline).unwrap().result, Err(IocbFailure::ControllerFault { ioctx_index: None }));
    }

    #[test]
    fn a_launch_whose_copies_did_not_all_enqueue_serves_no_success() {
        // Goal: the kernel ran and finished IOCB a as SUCCESS and b with an NVMe error, but a
        // staged host-to-GPU copy after it failed to enqueue: a's bytes may not be in place, so
        // it must complete as a failure (timeout), never as SUCCESS; b keeps its own failure;
        // no queue-pair reset is asked for (every NVMe command completed).
        let (mut queue, [a, b]) = queue_with_two_issued();
        let memory = queue.memory();
        memory.region.store_u32(memory.iocb_field_offset(a, IocbField::Status), abi::GIO_IOCB_STATUS_SUCCESS, Ordering::Release);
        memory.region.store_u32(memory.iocb_field_offset(b, IocbField::FailedIoctx), 0, Ordering::Relaxed);
        memory.region.store_u16(memory.iocb_field_offset(b, IocbField::FailedNvmeStatus), NvmeStatus::new(2, 0x81).0, Ordering::Relaxed);
        memory.region.store_u32(memory.iocb_field_offset(b, IocbField::Status), abi::GIO_IOCB_STATUS_NVME_ERROR, Ordering::Release);
        assert!(!settle(memory, 0, 2, Enqueued::Partly, false).unwrap(), "nothing timed out in the kernel");
        post_completions(memory, 0, 2, &mut 0).unwrap();
        advance_sq(memory, 0, 2).unwrap();
        let deadline = Instant::now() + Duration::from_secs(1);
        assert_eq!(queue.wait_cqe(a, deadline).unwrap().result, Err(IocbFailure::Timeout { ioctx_index: None }));
        assert!(matches!(queue.wait_cqe(b, deadline).unwrap().result, Err(IocbFailure::Nvme { ioctx_index: 0, .. })));
    }
}
