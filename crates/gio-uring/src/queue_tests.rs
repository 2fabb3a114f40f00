//! Tests of the queue API against the in-memory test double (no I/O is performed: these check the
//! protocol — states, rings, per-layer rule, failure reporting, deadlines — not data movement).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::abi::{self, NvmeStatus, Opcode};
use crate::error::{GioError, IocbFailure, IoctxFault};
use crate::executor::test_double::MemoryExecutor;
use crate::layout::QueueConfig;
use crate::queue::GioQueue;
use crate::ring::{Cqe, Ring};
use crate::types::{Dependency, DeviceIndex, EventToken, IocbId, Iova, IovaRange, LayerIndex, Lba, SmBudget};
use crate::validate::{Descriptor, DeviceInfo, DeviceTable, IocbSpec, IoctxSpec, RegisteredMemory};

const BLOCK_BYTES: u32 = 512;
const KV_POOL: u64 = 0x4000_0000;
const LAYERS: u32 = 8;
const LAYER_BYTES: u64 = 0x10_0000;
const LAYER_BLOCKS: u64 = 10_000;

fn queue(executor: MemoryExecutor) -> GioQueue<MemoryExecutor> {
    let devices = DeviceTable::new(vec![
        DeviceInfo { nsid: 1, capacity_blocks: 1 << 20, block_bytes: BLOCK_BYTES, sgl_supported: true },
        DeviceInfo { nsid: 1, capacity_blocks: 1 << 20, block_bytes: BLOCK_BYTES, sgl_supported: false },
    ]);
    let registered = RegisteredMemory::new(vec![IovaRange::new(Iova(KV_POOL), u64::from(LAYERS) * LAYER_BYTES)]).unwrap();
    GioQueue::init_queue(QueueConfig { depth: 8, ioctx_per_iocb_max: 16 }, devices, registered, executor).unwrap()
}

fn layered(user_data: u64) -> IocbSpec {
    IocbSpec {
        opcode: Opcode::Read,
        user_data,
        layer_count: LAYERS,
        lba_stride_blocks: LAYER_BLOCKS,
        mem_stride_bytes: LAYER_BYTES,
        desc_stride_bytes: 0,
    }
}

fn ioctx(device: u16, lba: u64, blocks: u32, offset_bytes: u64) -> IoctxSpec {
    IoctxSpec {
        device: DeviceIndex(device),
        nsid: 1,
        start_lba: Lba(lba),
        block_count: blocks,
        data: Iova(KV_POOL + offset_bytes),
        descriptor: if device == 0 { Descriptor::SglInline } else { Descriptor::Prp { prp2: None } },
        force_unit_access: false,
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

#[test]
fn prepared_request_is_reissued_per_layer_with_offsets_applied() {
    // Goal: one fill, then one issue per layer; each layer's commands carry
    // lba + layer * lba_stride and addr + layer * mem_stride, and each issue completes once.
    let mut queue = queue(MemoryExecutor::default());
    let ids = queue.get_iocb(2, Dependency::None).unwrap();
    queue.fill_iocb(ids[0], &layered(10), &[ioctx(0, 0, 8, 0), ioctx(1, 64, 1, 4096)]).unwrap();
    queue.fill_iocb(ids[1], &layered(11), &[ioctx(0, 100, 2, 8192)]).unwrap();
    for layer in [0, 3, LAYERS - 1] {
        queue.executor_mut().executed.clear();
        queue.issue_io(&ids, LayerIndex(layer), SmBudget(2)).unwrap();
        for (&id, user_data) in ids.iter().zip([10, 11]) {
            let completion = queue.wait_cqe(id, soon()).unwrap();
            assert_eq!(completion.id, id);
            assert_eq!(completion.result, Ok(()));
            assert_eq!(completion.layer, LayerIndex(layer));
            assert_eq!(completion.user_data, user_data);
        }
        let executed = &queue.executor().executed;
        assert_eq!(executed.len(), 3);
        let layer = u64::from(layer);
        assert_eq!(executed[0].lba, layer * LAYER_BLOCKS);
        assert_eq!(executed[0].data_iova, KV_POOL + layer * LAYER_BYTES);
        assert_eq!(executed[1].lba, 64 + layer * LAYER_BLOCKS);
        assert_eq!(executed[1].device_index, 1);
        assert_eq!(executed[2].data_iova, KV_POOL + 8192 + layer * LAYER_BYTES);
        assert!(executed.iter().all(|e| u32::from(e.opcode) == abi::GIO_OPCODE_READ));
        assert_eq!(queue.reap_cqe().unwrap(), None, "wait_cqe consumed both completions");
    }
    let batch = queue.executor().batches[1];
    assert_eq!((batch.sq_first, batch.count, batch.layer), (2, 2, LayerIndex(3)));
}

#[test]
fn a_device_error_fails_its_iocb_with_the_first_failure_and_the_ring_keeps_going() {
    let mut queue = queue(MemoryExecutor::default());
    let media_error = NvmeStatus::new(2, 0x81);
    let ids = queue.get_iocb(2, Dependency::None).unwrap();
    queue.executor_mut().faults.push((ids[0], 1, media_error));
    let three = [ioctx(0, 0, 1, 0), ioctx(0, 1, 1, 512), ioctx(0, 2, 1, 1024)];
    queue.fill_iocb(ids[0], &layered(0), &three).unwrap();
    queue.fill_iocb(ids[1], &layered(1), &three).unwrap();
    queue.issue_io(&ids, LayerIndex(0), SmBudget(1)).unwrap();
    let failed = queue.wait_cqe(ids[0], soon()).unwrap();
    assert_eq!(failed.result, Err(IocbFailure::Nvme { ioctx_index: 1, status: media_error }));
    assert_eq!(queue.wait_cqe(ids[1], soon()).unwrap().result, Ok(()));
    // The failed IOCB can be reissued (the next layer) and succeeds once the fault is gone.
    queue.executor_mut().faults.clear();
    queue.issue_io(&ids[..1], LayerIndex(1), SmBudget(1)).unwrap();
    assert_eq!(queue.wait_cqe(ids[0], soon()).unwrap().result, Ok(()));
}

#[test]
fn fill_rejects_bad_ioctxs_naming_the_index_and_leaves_the_iocb_unissuable() {
    let mut queue = queue(MemoryExecutor::default());
    let id = queue.get_iocb(1, Dependency::None).unwrap()[0];
    type Case = (IoctxSpec, fn(&IoctxFault) -> bool);
    let bad: [Case; 4] = [
        (ioctx(0, 0, 1, 0), |f: &IoctxFault| matches!(f, IoctxFault::ZeroLength)),
        (ioctx(5, 0, 1, 0), |f: &IoctxFault| matches!(f, IoctxFault::UnknownDevice { .. })),
        // Fits at layer 0, beyond capacity at the last layer.
        (ioctx(0, (1 << 20) - 70_000, 1, 0), |f: &IoctxFault| matches!(f, IoctxFault::LbaOutOfRange { layer: 7, .. })),
        (ioctx(0, 0, 1, u64::from(LAYERS) * LAYER_BYTES), |f: &IoctxFault| {
            matches!(f, IoctxFault::OutsideRegisteredMemory { what: "data", .. })
        }),
    ];
    for (index, (mut spec, expected)) in bad.into_iter().enumerate() {
        if index == 0 {
            spec.block_count = 0;
        }
        let list = [ioctx(0, 0, 1, 0), ioctx(0, 1, 1, 512), spec];
        match queue.fill_iocb(id, &layered(0), &list) {
            Err(GioError::InvalidIoctx { id: got, index: 2, fault }) => {
                assert_eq!(got, id);
                assert!(expected(&fault), "case {index}: {fault:?}");
            }
            other => panic!("case {index}: expected InvalidIoctx at index 2, got {other:?}"),
        }
        let refused = queue.issue_io(&[id], LayerIndex(0), SmBudget(1));
        assert!(matches!(refused, Err(GioError::WrongState { .. })), "{refused:?}");
    }
    assert!(matches!(queue.fill_iocb(id, &layered(0), &[]), Err(GioError::BadIoctxCount { count: 0, .. })));
    let too_many = vec![ioctx(0, 0, 1, 0); 17];
    assert!(matches!(queue.fill_iocb(id, &layered(0), &too_many), Err(GioError::BadIoctxCount { count: 17, .. })));
}

#[test]
fn fill_refuses_force_unit_access_on_a_read_and_takes_it_on_a_write() {
    // Goal: FUA is for writes; on a Read the CPU executor would drop it and the GPU kernel send
    // it, so fill refuses it and neither executor ever sees one.
    let mut queue = queue(MemoryExecutor::default());
    let id = queue.get_iocb(1, Dependency::None).unwrap()[0];
    let fua = IoctxSpec { force_unit_access: true, ..ioctx(0, 0, 1, 0) };
    let result = queue.fill_iocb(id, &layered(0), &[ioctx(0, 1, 1, 512), fua]);
    assert!(matches!(result, Err(GioError::InvalidIoctx { index: 1, fault: IoctxFault::ForceUnitAccessOnRead, .. })), "{result:?}");
    let refused = queue.issue_io(&[id], LayerIndex(0), SmBudget(1));
    assert!(matches!(refused, Err(GioError::WrongState { .. })), "{refused:?}");
    queue.fill_iocb(id, &IocbSpec { opcode: Opcode::Write, ..layered(0) }, &[fua]).unwrap();
}

#[test]
fn wait_is_bounded_by_its_deadline() {
    // Goal: an executor that never completes makes wait_cqe fail with a timeout, promptly.
    let mut queue = queue(MemoryExecutor { stalled: true, ..Default::default() });
    let id = queue.get_iocb(1, Dependency::None).unwrap()[0];
    queue.fill_iocb(id, &layered(0), &[ioctx(0, 0, 1, 0)]).unwrap();
    queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).unwrap();
    let started = Instant::now();
    let result = queue.wait_cqe(id, Instant::now() + Duration::from_millis(50));
    assert!(matches!(result, Err(GioError::WaitTimeout { id: got, .. }) if got == id), "{result:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(matches!(queue.put_iocb(id), Err(GioError::WrongState { .. })), "in flight cannot be freed");
}

#[test]
fn a_completion_posted_by_the_last_poll_before_the_deadline_is_returned() {
    // Goal: wait_cqe looks at the CQ after its executor's poll, before it gives up: a wait with a
    // deadline already passed (objstore's non-blocking poll) returns a completion that this poll
    // posted, instead of WaitTimeout for an IOCB that has completed.
    let mut queue = queue(MemoryExecutor { deferred: true, ..Default::default() });
    let id = queue.get_iocb(1, Dependency::None).unwrap()[0];
    queue.fill_iocb(id, &layered(7), &[ioctx(0, 0, 1, 0)]).unwrap();
    queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).unwrap();
    let completion = queue.wait_cqe(id, Instant::now());
    assert!(matches!(completion, Ok(c) if c.id == id && c.user_data == 7 && c.result == Ok(())), "{completion:?}");
    assert_eq!(queue.reap_cqe().unwrap(), None, "returned once");
    queue.put_iocb(id).unwrap();
}

#[test]
fn a_poll_error_waits_behind_the_completion_the_same_poll_posted() {
    // Goal: a poll that posts the awaited CQE and also fails (an error about something else)
    // does not hide the completion: wait_cqe returns it, and the error comes from the next call
    // that polls, once. A poll error with nothing completed is returned as before.
    let mut queue = queue(MemoryExecutor { deferred: true, ..Default::default() });
    let ids = queue.get_iocb(2, Dependency::None).unwrap();
    for (n, &id) in ids.iter().enumerate() {
        queue.fill_iocb(id, &layered(n as u64), &[ioctx(0, 0, 1, 0)]).unwrap();
    }
    queue.issue_io(&ids, LayerIndex(0), SmBudget(1)).unwrap();
    queue.executor_mut().fail_next_poll = true;
    assert_eq!(queue.wait_cqe(ids[0], soon()).unwrap().id, ids[0]);
    let reported = queue.peek_cqe();
    assert!(matches!(reported, Err(GioError::Executor { .. })), "the error is kept for the next call: {reported:?}");
    assert_eq!(queue.wait_cqe(ids[1], soon()).unwrap().id, ids[1], "and reported once");
    queue.executor_mut().stalled = true;
    queue.executor_mut().fail_next_poll = true;
    let id = ids[0];
    queue.issue_io(&[id], LayerIndex(1), SmBudget(1)).unwrap();
    let failed = queue.wait_cqe(id, soon());
    assert!(matches!(failed, Err(GioError::Executor { .. })), "nothing completed: the error at once: {failed:?}");
}

#[test]
fn a_reset_forgets_a_kept_poll_error_so_the_first_wait_after_it_polls() {
    // Goal: a poll error kept behind a completion (it may be about another queue pair) is
    // forgotten by the queue-pair reset, as CpuWorkers' reset forgets a worker error not yet
    // reported: it concerned the pairs the reset replaced. Kept, the first call after the
    // reissue that polls (a peek, or a wait whose poll did not end its IOCB) returned it,
    // failing a healthy layer.
    let mut queue = queue(MemoryExecutor { deferred: true, ..Default::default() });
    let id = queue.get_iocb(1, Dependency::None).unwrap()[0];
    queue.fill_iocb(id, &layered(0), &[ioctx(0, 0, 1, 0)]).unwrap();
    queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).unwrap();
    queue.executor_mut().fail_next_poll = true;
    assert_eq!(queue.wait_cqe(id, soon()).unwrap().id, id, "the completion, the error kept");
    assert_eq!(queue.reset_queue_pairs(Vec::new()).unwrap(), 0);
    assert_eq!(queue.executor().resets, 1, "the executor was reset");
    queue.issue_io(&[id], LayerIndex(1), SmBudget(1)).unwrap();
    let completion = queue.wait_cqe(id, soon());
    assert!(matches!(completion, Ok(c) if c.id == id && c.layer == LayerIndex(1) && c.result == Ok(())), "{completion:?}");
    // The wait polls even with an error kept (peek/reap/wait always poll), so the layer above
    // completes either way; what tells the forget apart is that nothing is left to report: kept,
    // the stale error would still be kept after that wait (a wait that returns a completion
    // takes no kept error) and would fail this peek.
    let after = queue.peek_cqe();
    assert!(matches!(after, Ok(None)), "the reset forgot the kept error: {after:?}");
}

#[test]
fn a_peek_with_an_error_kept_still_polls_and_keeps_the_new_error() {
    // Goal: a call that returns a kept poll error still polls the executor. The runtime's pump
    // and python's start_issued peek only to start I/O they just issued on a CPU executor;
    // with an error kept, the peek returned it without a poll, and the layer reached the
    // device only at its wait. The poll's own error is kept in turn, for the call after.
    let mut queue = queue(MemoryExecutor { deferred: true, ..Default::default() });
    let ids = queue.get_iocb(2, Dependency::None).unwrap();
    for (n, &id) in ids.iter().enumerate() {
        queue.fill_iocb(id, &layered(n as u64), &[ioctx(0, 0, 1, 0)]).unwrap();
    }
    queue.issue_io(&[ids[0]], LayerIndex(0), SmBudget(1)).unwrap();
    queue.executor_mut().fail_next_poll = true;
    assert_eq!(queue.wait_cqe(ids[0], soon()).unwrap().id, ids[0], "the completion, the error kept");
    queue.issue_io(&[ids[1]], LayerIndex(0), SmBudget(1)).unwrap();
    queue.executor_mut().fail_next_poll = true;
    let reported = queue.peek_cqe();
    assert!(matches!(reported, Err(GioError::Executor { .. })), "the kept error: {reported:?}");
    assert!(queue.executor().pending.is_empty(), "the peek polled: the IOCB just issued was started");
    let reported = queue.peek_cqe();
    assert!(matches!(reported, Err(GioError::Executor { .. })), "that poll's own error, kept: {reported:?}");
    assert_eq!(queue.peek_cqe().unwrap().map(|c| c.id), Some(ids[1]));
    assert_eq!(queue.reap_cqe().unwrap().map(|c| c.id), Some(ids[1]));
}

/// Whether `reported` is the test double's error of its `n`th failed poll.
fn is_poll_failure(reported: &Result<Option<crate::queue::Completion>, GioError>, n: u32) -> bool {
    matches!(reported, Err(GioError::Executor { reason, .. }) if *reason == format!("poll {n} failed after its work"))
}

#[test]
fn an_error_kept_is_not_lost_when_a_wait_whose_completion_came_keeps_a_new_one() {
    // Goal: with an error K kept, a wait whose poll posts its completion and fails anew (N)
    // returns the completion and keeps both, K first: the executor reports each only once
    // (WorkerStopped, a doorbell fault, a refused CQE), so K dropped was lost for good. The
    // errors kept stay bounded (two): a third wait like that logs and drops its own error.
    let mut queue = queue(MemoryExecutor { deferred: true, ..Default::default() });
    let ids = queue.get_iocb(4, Dependency::None).unwrap();
    for (n, &id) in ids.iter().enumerate() {
        queue.fill_iocb(id, &layered(n as u64), &[ioctx(0, 0, 1, 0)]).unwrap();
    }
    for &id in &ids[..2] {
        queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).unwrap();
        queue.executor_mut().fail_next_poll = true;
        assert_eq!(queue.wait_cqe(id, soon()).unwrap().id, id, "the completion, the error kept");
    }
    let reported = queue.peek_cqe();
    assert!(is_poll_failure(&reported, 1), "the older error first: {reported:?}");
    let reported = queue.peek_cqe();
    assert!(is_poll_failure(&reported, 2), "then the newer: {reported:?}");
    assert!(matches!(queue.peek_cqe(), Ok(None)), "each reported once");

    for &id in &ids[..3] {
        queue.issue_io(&[id], LayerIndex(1), SmBudget(1)).unwrap();
        queue.executor_mut().fail_next_poll = true;
        assert_eq!(queue.wait_cqe(id, soon()).unwrap().id, id);
    }
    for n in [3, 4] {
        let reported = queue.peek_cqe();
        assert!(is_poll_failure(&reported, n), "poll failure {n}: {reported:?}");
    }
    assert!(matches!(queue.peek_cqe(), Ok(None)), "at most two kept: the third was dropped, logged");
}

#[test]
fn peek_and_reap_never_block_and_keep_completion_order() {
    let mut queue = queue(MemoryExecutor { deferred: true, ..Default::default() });
    let ids = queue.get_iocb(3, Dependency::None).unwrap();
    for (n, &id) in ids.iter().enumerate() {
        queue.fill_iocb(id, &layered(n as u64), &[ioctx(0, 0, 1, 0)]).unwrap();
    }
    queue.issue_io(&ids, LayerIndex(0), SmBudget(1)).unwrap();
    // Waiting for the last drives the executor through all three; the others stay reapable.
    assert_eq!(queue.wait_cqe(ids[2], soon()).unwrap().id, ids[2]);
    assert_eq!(queue.peek_cqe().unwrap().map(|c| c.id), Some(ids[0]));
    assert_eq!(queue.reap_cqe().unwrap().map(|c| c.id), Some(ids[0]));
    assert_eq!(queue.reap_cqe().unwrap().map(|c| c.id), Some(ids[1]));
    assert_eq!(queue.reap_cqe().unwrap(), None);
    for id in ids {
        queue.put_iocb(id).unwrap();
    }
    assert_eq!(queue.free_iocbs(), 8);
}

#[test]
fn issue_is_all_or_nothing_on_bad_arguments() {
    let mut queue = queue(MemoryExecutor::default());
    let ids = queue.get_iocb(2, Dependency::None).unwrap();
    let other = queue.get_iocb(1, Dependency::Event(EventToken(42))).unwrap()[0];
    for &id in ids.iter().chain([&other]) {
        queue.fill_iocb(id, &layered(0), &[ioctx(0, 0, 1, 0)]).unwrap();
    }
    let layer = LayerIndex(0);
    assert!(matches!(queue.issue_io(&[ids[0], ids[0]], layer, SmBudget(1)), Err(GioError::DuplicateIssue { .. })));
    assert!(matches!(queue.issue_io(&ids, LayerIndex(LAYERS), SmBudget(1)), Err(GioError::LayerOutOfRange { .. })));
    assert!(matches!(queue.issue_io(&[ids[0], other], layer, SmBudget(1)), Err(GioError::MixedDependencies { .. })));
    assert!(matches!(queue.issue_io(&ids, layer, SmBudget(0)), Err(GioError::ZeroSmBudget)));
    assert!(matches!(queue.issue_io(&[], layer, SmBudget(1)), Err(GioError::BadIssueSize { .. })));
    assert!(matches!(queue.issue_io(&[IocbId(99)], layer, SmBudget(1)), Err(GioError::UnknownIocb { .. })));
    assert!(queue.executor().batches.is_empty(), "nothing reached the executor");
    // The dependency travels with the batch.
    queue.issue_io(&[other], layer, SmBudget(1)).unwrap();
    assert_eq!(queue.executor().batches[0].dependency, Dependency::Event(EventToken(42)));
    queue.issue_io(&ids, layer, SmBudget(1)).unwrap();
    assert!(
        matches!(queue.issue_io(&ids, layer, SmBudget(1)), Err(GioError::WrongState { .. })),
        "a completion not yet drained by wait/reap keeps the IOCB in flight"
    );
}

#[test]
fn a_full_submission_queue_is_back_pressure_and_changes_nothing() {
    let mut queue = queue(MemoryExecutor::default());
    let ids = queue.get_iocb(2, Dependency::None).unwrap();
    for &id in &ids {
        queue.fill_iocb(id, &layered(0), &[ioctx(0, 0, 1, 0)]).unwrap();
    }
    // Pretend a slow consumer left 7 of 8 SQ slots occupied.
    let sq = queue.memory().layout.sq;
    queue.memory().region.store_u32(sq.tail_offset(), 7, Ordering::Release);
    let result = queue.issue_io(&ids, LayerIndex(0), SmBudget(1));
    assert!(matches!(result, Err(GioError::SubmissionQueueFull { free: 1, needed: 2 })), "{result:?}");
    queue.memory().region.store_u32(sq.head_offset(), 7, Ordering::Release);
    queue.issue_io(&ids, LayerIndex(0), SmBudget(1)).expect("issuable once the consumer caught up");
}

#[test]
fn forged_or_stale_completions_are_errors() {
    // Goal: a CQE for an IOCB that is not in flight, or for an old issue, is reported, not
    // trusted, and leaves the issue in flight alone. (One for the issue in flight with
    // impossible fields ends it: see the next test.)
    let mut queue = queue(MemoryExecutor { stalled: true, ..Default::default() });
    let id = queue.get_iocb(1, Dependency::None).unwrap()[0];
    queue.fill_iocb(id, &layered(0), &[ioctx(0, 0, 1, 0)]).unwrap();
    let post = |queue: &GioQueue<MemoryExecutor>, cqe: Cqe| {
        let ring: Ring<'_, Cqe> = Ring::new(&queue.memory().region, queue.memory().layout.cq, "cq");
        ring.producer().unwrap().push(cqe).unwrap();
    };
    let success = Cqe {
        iocb_id: id,
        issue_seq: 1,
        failed_ioctx: abi::GIO_NO_FAILED_IOCTX,
        status: abi::GIO_IOCB_STATUS_SUCCESS as u16,
        failed_nvme_status: 0,
    };
    post(&queue, success);
    assert!(matches!(queue.reap_cqe(), Err(GioError::UnexpectedCompletion { reason: "IOCB not in flight", .. })));
    queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).unwrap();
    post(&queue, Cqe { issue_seq: 0, ..success });
    assert!(matches!(queue.reap_cqe(), Err(GioError::UnexpectedCompletion { reason: "stale issue sequence number", .. })));
    post(&queue, Cqe { iocb_id: IocbId(99), ..success });
    assert!(matches!(queue.reap_cqe(), Err(GioError::UnexpectedCompletion { reason: "id outside the pool", .. })));
    post(&queue, success);
    assert_eq!(queue.wait_cqe(id, soon()).unwrap().result, Ok(()));
}

#[test]
fn a_completion_of_the_issue_in_flight_with_an_impossible_status_ends_it_as_a_timeout() {
    // Goal: a CQE that names the IOCB and the issue in flight but whose other fields are
    // impossible (status IDLE or unknown, a failed IOCTX outside the IOCB, SUCCESS with a failed
    // IOCTX) is consumed: it must not leave the IOCB in flight for good. It is reported once,
    // and the IOCB ends as timed out, the failure after which the caller resets the queue pairs.
    let mut queue = queue(MemoryExecutor { stalled: true, ..Default::default() });
    let id = queue.get_iocb(1, Dependency::None).unwrap()[0];
    queue.fill_iocb(id, &layered(0), &[ioctx(0, 0, 1, 0)]).unwrap();
    let nvme_error = abi::GIO_IOCB_STATUS_NVME_ERROR as u16;
    let impossible = [
        (abi::GIO_IOCB_STATUS_IDLE as u16, abi::GIO_NO_FAILED_IOCTX),
        (42, abi::GIO_NO_FAILED_IOCTX),
        (nvme_error, 5),
        (abi::GIO_IOCB_STATUS_SUCCESS as u16, 0),
    ];
    for (layer, (status, failed_ioctx)) in (0u32..).zip(impossible) {
        queue.issue_io(&[id], LayerIndex(layer), SmBudget(1)).unwrap();
        let issue_seq = layer + 1;
        let ring: Ring<'_, Cqe> = Ring::new(&queue.memory().region, queue.memory().layout.cq, "cq");
        ring.producer().unwrap().push(Cqe { iocb_id: id, issue_seq, failed_ioctx, status, failed_nvme_status: 0 }).unwrap();
        let reported = queue.reap_cqe();
        assert!(matches!(reported, Err(GioError::UnexpectedCompletion { .. })), "status {status}: {reported:?}");
        let ended = queue.wait_cqe(id, Instant::now() + Duration::from_secs(1));
        assert_eq!(
            ended.map(|completion| completion.result).ok(),
            Some(Err(IocbFailure::Timeout { ioctx_index: None })),
            "status {status}"
        );
    }
}

#[test]
fn get_iocb_hands_out_each_id_once_until_put_back() {
    let mut queue = queue(MemoryExecutor::default());
    let first = queue.get_iocb(5, Dependency::None).unwrap();
    let second = queue.get_iocb(3, Dependency::None).unwrap();
    let mut all: Vec<u32> = first.iter().chain(&second).map(|id| id.0).collect();
    all.sort_unstable();
    assert_eq!(all, (0..8).collect::<Vec<_>>());
    assert!(matches!(queue.get_iocb(1, Dependency::None), Err(GioError::NoFreeIocb { available: 0, .. })));
    queue.put_iocb(first[2]).unwrap();
    assert_eq!(queue.get_iocb(1, Dependency::None).unwrap(), vec![first[2]]);
    assert!(matches!(queue.get_iocb(0, Dependency::None), Err(GioError::NoFreeIocb { .. })));
}

mod model {
    //! Property test of the queue's IOCB life cycle against a plain model: random sequences of
    //! get / fill / issue / reap / wait / put on a deferred executor (one IOCB completes per poll,
    //! in issue order) must agree with the model on every result, and every issue must complete
    //! exactly once.
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, VecDeque};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum ModelState {
        Reserved,
        Prepared,
        InFlight(u32),
        Completed(u32),
    }

    #[derive(Debug, Clone)]
    enum Op {
        Get(usize),
        Fill(usize),
        Issue(Vec<usize>, u32),
        Reap,
        Wait(usize),
        Put(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Weighted so that most IOCBs get filled and issued, and several complete before a reap.
        prop_oneof![
            2 => (1usize..4).prop_map(Op::Get),
            5 => any::<usize>().prop_map(Op::Fill),
            5 => (proptest::collection::vec(any::<usize>(), 1..3), 0u32..(LAYERS + 1)).prop_map(|(ids, layer)| Op::Issue(ids, layer)),
            3 => Just(Op::Reap),
            2 => any::<usize>().prop_map(Op::Wait),
            1 => any::<usize>().prop_map(Op::Put),
        ]
    }

    #[derive(Default)]
    struct Model {
        states: BTreeMap<u32, ModelState>,
        /// Issued, not yet completed by the executor, in issue order.
        pending: VecDeque<u32>,
        /// Completed, not yet returned by reap/wait, in completion order.
        unreported: VecDeque<u32>,
    }

    impl Model {
        fn pick(&self, index: usize) -> Option<u32> {
            let ids: Vec<u32> = self.states.keys().copied().collect();
            (!ids.is_empty()).then(|| ids[index % ids.len()])
        }
        /// One executor poll: the oldest pending IOCB completes.
        fn step(&mut self) {
            if let Some(id) = self.pending.pop_front() {
                let ModelState::InFlight(layer) = self.states[&id] else { unreachable!() };
                self.states.insert(id, ModelState::Completed(layer));
                self.unreported.push_back(id);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn iocb_life_cycle_matches_the_model(ops in proptest::collection::vec(op(), 1..80)) {
            let mut queue = queue(MemoryExecutor { deferred: true, ..Default::default() });
            let mut model = Model::default();
            for op in ops {
                match op {
                    Op::Get(count) => {
                        let free = 8 - model.states.len();
                        match queue.get_iocb(count, Dependency::None) {
                            Ok(ids) => {
                                prop_assert!(count <= free);
                                for id in ids {
                                    prop_assert!(model.states.insert(id.0, ModelState::Reserved).is_none(), "id handed out twice");
                                }
                            }
                            Err(GioError::NoFreeIocb { .. }) => prop_assert!(count > free),
                            Err(other) => prop_assert!(false, "get: {other}"),
                        }
                    }
                    Op::Fill(index) => {
                        let Some(id) = model.pick(index) else { continue };
                        let result = queue.fill_iocb(IocbId(id), &layered(u64::from(id)), &[ioctx(0, 0, 1, 0)]);
                        match model.states[&id] {
                            ModelState::InFlight(_) => prop_assert!(result.is_err()),
                            _ => {
                                prop_assert!(result.is_ok(), "fill: {result:?}");
                                model.unreported.retain(|&u| u != id);
                                model.states.insert(id, ModelState::Prepared);
                            }
                        }
                    }
                    Op::Issue(indices, layer) => {
                        let picked: Vec<u32> = indices.iter().filter_map(|&i| model.pick(i)).collect();
                        if picked.is_empty() { continue; }
                        let ids: Vec<IocbId> = picked.iter().map(|&id| IocbId(id)).collect();
                        let mut unique = picked.clone();
                        unique.sort_unstable();
                        unique.dedup();
                        let ok = unique.len() == picked.len()
                            && layer < LAYERS
                            && picked.iter().all(|id| matches!(model.states[id], ModelState::Prepared | ModelState::Completed(_)));
                        let result = queue.issue_io(&ids, LayerIndex(layer), SmBudget(1));
                        prop_assert_eq!(result.is_ok(), ok, "issue {:?} layer {}: {:?}", picked, layer, result);
                        if ok {
                            for id in picked {
                                model.unreported.retain(|&u| u != id);
                                model.states.insert(id, ModelState::InFlight(layer));
                                model.pending.push_back(id);
                            }
                        }
                    }
                    Op::Reap => {
                        model.step();
                        let expected = model.unreported.pop_front();
                        let got = queue.reap_cqe().unwrap();
                        prop_assert_eq!(got.map(|c| c.id.0), expected);
                        if let (Some(completion), Some(id)) = (got, expected) {
                            let ModelState::Completed(layer) = model.states[&id] else { unreachable!() };
                            prop_assert_eq!(completion.layer, LayerIndex(layer));
                            prop_assert_eq!(completion.user_data, u64::from(id));
                        }
                    }
                    Op::Wait(index) => {
                        let Some(id) = model.pick(index) else { continue };
                        let result = queue.wait_cqe(IocbId(id), Instant::now() + Duration::from_secs(5));
                        match model.states[&id] {
                            ModelState::InFlight(_) | ModelState::Completed(_) => {
                                while matches!(model.states[&id], ModelState::InFlight(_)) {
                                    model.step();
                                }
                                model.unreported.retain(|&u| u != id);
                                let ModelState::Completed(layer) = model.states[&id] else { unreachable!() };
                                let completion = result.unwrap();
                                prop_assert_eq!((completion.id.0, completion.layer), (id, LayerIndex(layer)));
                            }
                            _ => {
                                let wrong_state = matches!(result, Err(GioError::WrongState { .. }));
                                prop_assert!(wrong_state, "wait on a never-issued IOCB: {:?}", result);
                            }
                        }
                    }
                    Op::Put(index) => {
                        let Some(id) = model.pick(index) else { continue };
                        let result = queue.put_iocb(IocbId(id));
                        if matches!(model.states[&id], ModelState::InFlight(_)) {
                            prop_assert!(result.is_err());
                        } else {
                            prop_assert!(result.is_ok());
                            model.states.remove(&id);
                            model.unreported.retain(|&u| u != id);
                        }
                    }
                }
                prop_assert_eq!(queue.free_iocbs(), 8 - model.states.len());
            }
        }
    }
}

#[test]
fn an_iocb_the_executor_refuses_to_prepare_cannot_be_issued() {
    // Goal: an executor's `prepared` error (the CUDA executor's staged-mode checks) surfaces from
    // fill_iocb and leaves the IOCB unissuable, exactly like a failed validation.
    let mut queue = queue(MemoryExecutor { refuse_prepared: true, ..MemoryExecutor::default() });
    let id = queue.get_iocb(1, Dependency::None).unwrap()[0];
    let result = queue.fill_iocb(id, &layered(0), &[ioctx(0, 0, 8, 0)]);
    assert!(matches!(result, Err(GioError::InvalidIoctx { index: 0, fault: IoctxFault::StagedScatteredData, .. })), "{result:?}");
    let issued = queue.issue_io(&[id], LayerIndex(0), SmBudget(1));
    assert!(matches!(issued, Err(GioError::WrongState { .. })), "{issued:?}");
    queue.executor_mut().refuse_prepared = false;
    queue.fill_iocb(id, &layered(0), &[ioctx(0, 0, 8, 0)]).unwrap();
    queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).unwrap();
    assert_eq!(queue.wait_cqe(id, soon()).unwrap().result, Ok(()));
}

#[test]
fn an_executor_failure_after_publishing_leaves_the_iocbs_in_flight_until_they_complete() {
    // Goal: once `issue_io` has published the ids, an executor error cannot take them back: it
    // comes as `SubmitFailed`, the IOCBs stay in flight (they cannot be put back or refilled
    // while the executor may still run them), and each completes once, as usual.
    let mut queue = queue(MemoryExecutor { deferred: true, fail_next_submit: true, ..MemoryExecutor::default() });
    let ids = queue.get_iocb(2, Dependency::None).unwrap();
    for (n, &id) in ids.iter().enumerate() {
        queue.fill_iocb(id, &layered(n as u64), &[ioctx(0, 0, 8, 0)]).unwrap();
    }
    let failed = queue.issue_io(&ids, LayerIndex(0), SmBudget(1));
    assert!(
        matches!(&failed, Err(GioError::SubmitFailed { count: 2, source }) if matches!(**source, GioError::Executor { .. })),
        "{failed:?}"
    );
    for &id in &ids {
        assert!(matches!(queue.put_iocb(id), Err(GioError::WrongState { .. })), "{id} is in flight");
        assert!(matches!(queue.fill_iocb(id, &layered(9), &[ioctx(0, 0, 8, 0)]), Err(GioError::WrongState { .. })));
    }
    for &id in &ids {
        assert_eq!(queue.wait_cqe(id, soon()).unwrap().result, Ok(()), "{id} completes once");
        queue.put_iocb(id).unwrap();
    }
}
