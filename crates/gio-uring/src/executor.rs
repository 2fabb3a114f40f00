//! The executor seam: whatever turns issued IOCBs into NVMe commands and posts gio CQEs.
//!
//! An executor is the SQ's consumer and the CQ's producer: the CPU executors (`cpu_executor`,
//! `cpu_workers`) and, with the `cuda` feature, the CUDA executor (`gpu`). This module holds the
//! trait, the CPU executors' completion accounting (`complete_ioctx`, crate-private: it counts
//! in host memory the executor arms when it takes an issue; the CUDA kernel follows the same
//! protocol on the shared counter), [`post_cqe`], and — in tests only — an in-memory test double.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::abi::{self, NvmeStatus};
use crate::error::GioError;
use crate::layout::{IocbField, QueueMemory};
use crate::ring::{Cqe, Ring};
use crate::types::{Dependency, IocbId, LayerIndex, SmBudget};

/// One `issue_io` call as the executor receives it: the ids are already on the SQ, at free-running
/// positions `sq_first .. sq_first + count`, published with Release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IssueBatch {
    pub sq_first: u32,
    pub count: u32,
    pub layer: LayerIndex,
    pub sm_budget: SmBudget,
    pub dependency: Dependency,
}

/// Executes issued IOCBs.
pub trait Executor: Send {
    /// A short name for errors and logs.
    fn name(&self) -> &'static str;

    /// Called by `init_queue`, before `attach`, with the number of devices in the queue's
    /// [`crate::validate::DeviceTable`]: an executor that serves devices by index refuses a
    /// table naming devices it has nothing for ([`GioError::InvalidConfig`]), rather than
    /// failing every IOCTX on them as INVALID_IOCTX at each issue, which blames the request for
    /// a configuration error. By default any count is accepted.
    fn check_device_count(&self, devices: usize) -> Result<(), GioError> {
        let _ = devices;
        Ok(())
    }

    /// Called once by `init_queue` with the queue's memory, for executors that run on their own
    /// threads and need to keep it.
    fn attach(&mut self, memory: &Arc<QueueMemory>) -> Result<(), GioError> {
        let _ = memory;
        Ok(())
    }

    /// Whether this executor can make an issue wait on `dependency`; checked by `issue_io` before
    /// anything is published. By default only [`Dependency::None`] is accepted: an executor that
    /// cannot wait on an event must refuse it rather than start the I/O early.
    fn check_dependency(&self, dependency: &Dependency) -> Result<(), GioError> {
        match dependency {
            Dependency::None => Ok(()),
            Dependency::Event(_) => Err(GioError::Unsupported { what: "this executor cannot wait on an event dependency" }),
        }
    }

    /// Called by `fill_iocb` once the IOCB's records are validated and written, before it becomes
    /// issuable, for executors that precompute per-request state (the CUDA executor's staged
    /// copies). An error leaves the IOCB unissuable, like a failed validation. The CPU executors
    /// keep the validated line 0 here and build commands from that copy: an executor that wraps
    /// another must forward this call (and `attach`), or the inner one refuses the IOCB at issue.
    fn prepared(&mut self, memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
        let _ = (memory, id);
        Ok(())
    }

    /// Accepts one issue: consume `batch.count` ids from the SQ in order, execute every IOCTX of
    /// each IOCB (after `batch.dependency` has fired), and post exactly one CQE per IOCB. May
    /// complete before returning or later. The ids are published before this is called, so an
    /// error does not take them back: every IOCB of the batch must still get its one CQE (at
    /// once, later, or by a reset), and the caller treats them as in flight.
    fn submit(&mut self, memory: &QueueMemory, batch: &IssueBatch) -> Result<(), GioError>;

    /// Makes progress without blocking, for executors that are driven by their caller (a polled
    /// executor reaps NVMe completions here). Executors that run on their own return `Ok(())`.
    fn poll(&mut self, memory: &QueueMemory) -> Result<(), GioError>;

    /// Lends the NVMe queue pair serving device `device` for the caller's own synchronous
    /// commands: an object store's metadata on a controller that granted one I/O queue pair.
    /// First reaps, until `deadline`, every command of this executor in flight on it (posting
    /// CQEs as usual; those a failed doorbell ring left unannounced are announced first, or the
    /// ring's error is returned), so the caller finds it idle; IOCTXs not yet submitted wait for
    /// the next `poll`. The caller must leave it idle again, and tag its commands with
    /// [`LENT_COMMAND_TAG`] (a late completion of theirs is then an executor error, never taken
    /// for an IOCTX's). `Ok(None)`: this executor cannot lend (its queue pairs live on
    /// other threads, or on a GPU).
    fn lend_queue_pair(
        &mut self,
        memory: &QueueMemory,
        device: usize,
        deadline: Instant,
    ) -> Result<Option<&mut nvme_driver::IoQueuePair>, GioError> {
        let _ = (memory, device, deadline);
        Ok(None)
    }

    /// Teardown: deletes every NVMe queue pair this executor holds now (and retries those kept
    /// from an earlier failed deletion), and says whether all of them are known gone. The CPU
    /// executors reap each pair first (an attached one is deleted only once idle: they wait for
    /// its commands, bounded). `Some(true)`:
    /// none of its commands moves data any more, so the memory its IOCTXs name (the caller's
    /// buffers, descriptor tables and PRP lists) may be freed. `Some(false)`: at least one pair
    /// could not be deleted (its rings are leaked) and its commands may still read or write that
    /// memory: the caller must keep it for good. Afterwards the executor serves no I/O. With
    /// `Some(true)` the CPU executors end every IOCB still issued as TIMEOUT (one CQE each), and
    /// the CUDA executor, which first waits for its stream to drain (`Some(false)` if it does
    /// not), retires its launches. `None` (the default): this executor does not report it (the
    /// in-memory test doubles): nothing is known either way.
    fn retire_queue_pairs(&mut self) -> Option<bool> {
        None
    }
}

/// The tag a borrower of a lent queue pair ([`Executor::lend_queue_pair`]) gives its commands:
/// all ones, it names IOCTX 0xFFFF (the CPU executors' tag layout), which no IOCB has (at most
/// `abi::MAX_IOCTX_PER_IOCB`), so a completion of one can never be counted for an IOCTX. The
/// CPU executors check for it before decoding a tag, and report a late one as a borrower's.
pub const LENT_COMMAND_TAG: u64 = u64::MAX;

/// Executors whose NVMe queue pairs the caller can replace after a wait timed out (a lost
/// completion, a silent device): the CPU executors. `reset` deletes the old queue pairs on the
/// controllers (so none of their commands moves data afterwards), installs `fresh` (one per
/// served device, in the order of `served_queue_depths`), then ends every IOCB still in flight
/// as TIMEOUT with one CQE, and returns how many. If a deletion fails nothing is reclaimed and
/// the error says that controller needs a reset. A TIMEOUT CQE that cannot be posted at once is
/// no failure of the reset: it is kept and the next poll posts it. (The GPU executor resets its
/// queue pairs itself after a kernel timeout.)
pub trait QueuePairReset: Executor {
    /// `(device index, NVMe queue depth)` of every device served.
    fn served_queue_depths(&self) -> Vec<(usize, u32)>;
    fn reset(&mut self, memory: &QueueMemory, fresh: Vec<nvme_driver::IoQueuePair>) -> Result<usize, GioError>;
}

/// Records the completion of IOCTX `ioctx_index` of IOCB `id` with `status`; returns the CQE to
/// post if this was the last outstanding IOCTX of the issue. The CPU executors' side of the
/// protocol the GPU kernel follows too:
/// 1. a failure claims `failed_ioctx` with a compare-and-swap (first failure wins), then writes its
///    NVMe status and the IOCB status it implies;
/// 2. the IOCTXs left of the issue are counted down with AcqRel, so the thread that counts the
///    last one has seen every earlier failure record. The count is kept in host memory
///    ([`QueueMemory::count_ioctx_done`], armed with the validated IOCTX count when the issue was
///    taken off the SQ), never in the shared `completed_ioctx_count` another agent can write,
///    which is only brought along as a mirror for the ABI. A completion with none left is not
///    counted (logged; nothing is returned);
/// 3. that thread moves `status` off ISSUED with a compare-and-swap: exactly one CQE per issue,
///    even if a timeout path raced it. It then notes that a CPU executor's issue of the IOCB
///    has ended (`QueueMemory::end_issue_taken`) before the CQE goes out.
pub(crate) fn complete_ioctx(
    memory: &QueueMemory,
    id: IocbId,
    ioctx_index: u32,
    issue_seq: u32,
    status: Result<(), (u32, NvmeStatus)>,
) -> Option<Cqe> {
    let region = &memory.region;
    if let Err((iocb_status, nvme_status)) = status {
        let claimed = region
            .compare_exchange_u32(
                memory.iocb_field_offset(id, IocbField::FailedIoctx),
                abi::GIO_NO_FAILED_IOCTX,
                ioctx_index,
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .is_ok();
        if claimed {
            region.store_u16(memory.iocb_field_offset(id, IocbField::FailedNvmeStatus), nvme_status.0 & 0xFFFE, Ordering::Relaxed);
            region.store_u16(memory.iocb_field_offset(id, IocbField::FailedStatus), iocb_status as u16, Ordering::Relaxed);
        }
    }
    let Some(last) = memory.count_ioctx_done(id) else {
        tracing::error!(%id, ioctx_index, issue_seq, "gio-uring: an IOCTX completion with none of its issue outstanding; not counted");
        return None;
    };
    region.fetch_add_u32(memory.iocb_field_offset(id, IocbField::CompletedIoctxCount), 1, Ordering::Relaxed);
    if !last {
        return None;
    }
    let failed_ioctx = region.load_u32(memory.iocb_field_offset(id, IocbField::FailedIoctx), Ordering::Relaxed);
    let (final_status, failed_nvme_status) = if failed_ioctx == abi::GIO_NO_FAILED_IOCTX {
        (abi::GIO_IOCB_STATUS_SUCCESS, 0)
    } else {
        (
            u32::from(region.load_u16(memory.iocb_field_offset(id, IocbField::FailedStatus), Ordering::Relaxed)),
            region.load_u16(memory.iocb_field_offset(id, IocbField::FailedNvmeStatus), Ordering::Relaxed),
        )
    };
    region
        .compare_exchange_u32(
            memory.iocb_field_offset(id, IocbField::Status),
            abi::GIO_IOCB_STATUS_ISSUED,
            final_status,
            Ordering::AcqRel,
            Ordering::Relaxed,
        )
        .ok()?;
    memory.end_issue_taken(id);
    Some(Cqe { iocb_id: id, issue_seq, failed_ioctx, status: final_status as u16, failed_nvme_status })
}

/// How long a post waits for the CQ's producer lock before giving up: holders keep it for a few
/// stores, so running out means a holder died (or a GPU kernel was killed) while holding it, or
/// was descheduled for that long. A time bound, not a count of attempts, so that what a wait
/// costs does not depend on the machine's speed or load.
pub(crate) const CQ_LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// Posts a CQE. Any number of producers (executor threads, GPU threads) may post concurrently: they
/// serialise on the ring's `producer_lock`, whose Acquire/Release pair also orders one holder's
/// tail store before the next holder's tail load. The CQ has one entry per IOCB and an IOCB is
/// reissued only after its CQE was reaped, so a full CQ is a protocol violation, not back-pressure.
/// Waits for the lock at most `CQ_LOCK_WAIT`.
pub fn post_cqe(memory: &QueueMemory, cqe: Cqe) -> Result<(), GioError> {
    let lock = memory.layout.cq.header_offset_bytes + core::mem::offset_of!(abi::gio_ring_header, producer_lock);
    let mut attempts = 0u32;
    let mut deadline = None;
    while memory.region.compare_exchange_u32(lock, 0, 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
        attempts = attempts.wrapping_add(1);
        if attempts.is_multiple_of(64) {
            // The clock is read only once the lock was found held a while.
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + CQ_LOCK_WAIT);
            if Instant::now() >= deadline {
                return Err(GioError::Executor {
                    executor: "cq",
                    reason: format!(
                        "CQ producer lock not released within {} ms; CQE for {} not posted",
                        CQ_LOCK_WAIT.as_millis(),
                        cqe.iocb_id
                    ),
                });
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    let posted = Ring::<Cqe>::new(&memory.region, memory.layout.cq, "cq")
        .producer()
        .and_then(|mut producer| producer.push(cqe).map_err(|cqe| GioError::CompletionQueueFull { id: cqe.iocb_id }));
    // The producer view published the tail (Release) when it was dropped, before this unlock.
    memory.region.store_u32(lock, 0, Ordering::Release);
    posted
}

/// CQEs a CPU executor built but could not post (the CQ producer lock was not released within
/// its time bound, or the CQ was full): the IOCB already left ISSUED (its compare-and-swap
/// succeeded), so no reset ends it again and it is in flight until this CQE is posted. They are
/// kept here and posted by the executor's next `poll` ([`repost_kept_cqes`]). At most one per
/// IOCB (one CQE per issue), so the list is bounded by the queue depth and allocated once, with
/// the queue's memory: nothing is allocated per I/O. The GPU executor does not use it (its
/// retirement counts what it posted and retries the rest itself).
#[derive(Debug)]
pub(crate) struct KeptCqes {
    /// How many CQEs are kept: polls look here without taking the lock.
    count: AtomicU32,
    entries: Mutex<Vec<Cqe>>,
}

impl KeptCqes {
    pub(crate) fn new(depth: u32) -> Self {
        KeptCqes { count: AtomicU32::new(0), entries: Mutex::new(Vec::with_capacity(depth as usize)) }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, Vec<Cqe>> {
        // A panic while holding the lock leaves the list whole (push/remove only): keep using it.
        self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn keep(&self, cqe: Cqe) {
        let mut entries = self.entries();
        if entries.len() == entries.capacity() {
            // Unreachable while one CQE per issue holds: more CQEs than IOCBs were built.
            tracing::error!(id = %cqe.iocb_id, kept = entries.len(), "gio-uring: more unposted CQEs than IOCBs; this one is dropped");
            return;
        }
        entries.push(cqe);
        self.count.store(entries.len() as u32, Ordering::Release);
    }
}

/// [`post_cqe`] for the CPU executors: a CQE that cannot be posted is kept in
/// `memory.kept_cqes` and posted by the next poll's [`repost_kept_cqes`]. The error is still
/// returned to the caller, and each later poll returns it again for as long as the CQE still
/// cannot be posted (a CQ nobody can post to is not a one-off), so a waiter sees it until then.
///
/// While CQEs are kept already, this one is kept behind them at once, without waiting for the
/// lock: a poll (or a reset) whose first post ran out of [`CQ_LOCK_WAIT`] does not wait again
/// for each CQE after it, and the CQEs go out in the order they were built.
pub(crate) fn post_cqe_or_keep(memory: &QueueMemory, cqe: Cqe) -> Result<(), GioError> {
    let earlier = memory.kept_cqes.count.load(Ordering::Acquire);
    if earlier > 0 {
        memory.kept_cqes.keep(cqe);
        return Err(GioError::Executor {
            executor: "cq",
            reason: format!("CQE for {} kept behind {earlier} earlier CQEs not posted yet (the next poll posts them)", cqe.iocb_id),
        });
    }
    post_cqe(memory, cqe).inspect_err(|_| memory.kept_cqes.keep(cqe))
}

/// Posts the CQEs kept by [`post_cqe_or_keep`], oldest first; stops at the first that still
/// cannot be posted (it and the rest stay kept) and returns that error. Cheap when none is kept.
pub(crate) fn repost_kept_cqes(memory: &QueueMemory) -> Result<(), GioError> {
    let kept = &memory.kept_cqes;
    if kept.count.load(Ordering::Acquire) == 0 {
        return Ok(());
    }
    let mut entries = kept.entries();
    let mut result = Ok(());
    let mut posted = 0;
    for &cqe in entries.iter() {
        if let Err(error) = post_cqe(memory, cqe) {
            result = Err(error);
            break;
        }
        posted += 1;
    }
    entries.drain(..posted); // shifts in place: no allocation
    kept.count.store(entries.len() as u32, Ordering::Release);
    result
}

#[cfg(test)]
pub(crate) mod test_double {
    //! An in-memory stand-in for an executor, for tests of the queue protocol only. It performs no
    //! I/O: every IOCTX "completes" with the status the test injected (success by default). It is
    //! never exported.

    use super::*;
    use crate::ring::Ring;
    use std::collections::VecDeque;

    /// One IOCTX as the test double would have sent it to a device, after the per-layer rule.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct ExecutedIoctx {
        pub iocb: IocbId,
        pub ioctx_index: u32,
        pub opcode: u8,
        pub device_index: u16,
        pub lba: u64,
        pub data_iova: u64,
        pub desc_iova: u64,
        pub block_count: u32,
        pub layer: u32,
    }

    #[derive(Debug, Default)]
    pub struct MemoryExecutor {
        /// Complete on `poll` (one IOCB per poll) instead of inside `submit`.
        pub deferred: bool,
        /// Never complete anything (to test deadlines).
        pub stalled: bool,
        /// Refuse every `prepared` call (as the CUDA executor does for data outside staging).
        pub refuse_prepared: bool,
        /// Fail the next `submit` after taking its batch (as an executor that fails part way,
        /// e.g. after a kernel launch): the IOCBs complete on later polls.
        pub fail_next_submit: bool,
        /// Fail the next `poll` after doing its work (as a poll that completes an IOCB and also
        /// reports an error about something else, e.g. another device).
        pub fail_next_poll: bool,
        /// How many polls `fail_next_poll` failed; each error names its number, so a test can
        /// tell which one a call reported.
        pub poll_failures: u32,
        /// How many times `QueuePairReset::reset` was called.
        pub resets: u32,
        /// (iocb, ioctx index) → NVMe status to complete with.
        pub faults: Vec<(IocbId, u32, NvmeStatus)>,
        pub pending: VecDeque<IocbId>,
        pub executed: Vec<ExecutedIoctx>,
        pub batches: Vec<IssueBatch>,
    }

    impl MemoryExecutor {
        fn execute(&mut self, memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
            let header = memory.read_iocb_header(id);
            memory.arm_issue(id, header.ioctx_count);
            for index in 0..header.ioctx_count {
                let ioctx = memory.read_ioctx(header.ioctx_first + index);
                let layer = u64::from(header.layer);
                self.executed.push(ExecutedIoctx {
                    iocb: id,
                    ioctx_index: index,
                    opcode: header.opcode,
                    device_index: ioctx.device_index,
                    lba: ioctx.start_lba + layer * header.lba_stride_blocks,
                    data_iova: ioctx.data_iova + layer * header.mem_stride_bytes,
                    desc_iova: if ioctx.desc_iova == 0 { 0 } else { ioctx.desc_iova + layer * header.desc_stride_bytes },
                    block_count: ioctx.block_count,
                    layer: header.layer,
                });
                let status = self
                    .faults
                    .iter()
                    .find(|(iocb, i, _)| *iocb == id && *i == index)
                    .map(|(_, _, status)| (abi::GIO_IOCB_STATUS_NVME_ERROR, *status));
                let status = status.map_or(Ok(()), Err);
                if let Some(cqe) = complete_ioctx(memory, id, index, header.issue_seq, status) {
                    post_cqe(memory, cqe)?;
                }
            }
            Ok(())
        }
    }

    impl Executor for MemoryExecutor {
        fn name(&self) -> &'static str {
            "memory test double"
        }

        fn check_dependency(&self, _dependency: &Dependency) -> Result<(), GioError> {
            Ok(()) // records the dependency in `batches` for the tests to inspect
        }

        fn prepared(&mut self, _memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
            if self.refuse_prepared {
                return Err(GioError::InvalidIoctx { id, index: 0, fault: crate::error::IoctxFault::StagedScatteredData });
            }
            Ok(())
        }

        fn submit(&mut self, memory: &QueueMemory, batch: &IssueBatch) -> Result<(), GioError> {
            self.batches.push(*batch);
            let ring: Ring<'_, IocbId> = Ring::new(&memory.region, memory.layout.sq, "sq");
            let mut consumer = ring.consumer()?;
            if consumer.head() != batch.sq_first || consumer.len() < batch.count {
                return Err(GioError::Executor {
                    executor: self.name(),
                    reason: format!("SQ at {} with {} entries, batch {batch:?}", consumer.head(), consumer.len()),
                });
            }
            let ids: Vec<IocbId> = consumer.by_ref().take(batch.count as usize).collect();
            drop(consumer);
            if std::mem::take(&mut self.fail_next_submit) {
                self.pending.extend(ids);
                return Err(GioError::Executor { executor: self.name(), reason: "failed after taking the batch".into() });
            }
            for id in ids {
                if self.deferred || self.stalled {
                    self.pending.push_back(id);
                } else {
                    self.execute(memory, id)?;
                }
            }
            Ok(())
        }

        fn poll(&mut self, memory: &QueueMemory) -> Result<(), GioError> {
            let fail = std::mem::take(&mut self.fail_next_poll);
            if !self.stalled {
                if let Some(id) = self.pending.pop_front() {
                    self.execute(memory, id)?;
                }
            }
            if fail {
                self.poll_failures += 1;
                let reason = format!("poll {} failed after its work", self.poll_failures);
                return Err(GioError::Executor { executor: self.name(), reason });
            }
            Ok(())
        }
    }

    /// No queue pairs to replace: a reset only lets queue-level reset logic be tested. Nothing
    /// is ended (the test double's IOCBs complete on their own).
    impl QueuePairReset for MemoryExecutor {
        fn served_queue_depths(&self) -> Vec<(usize, u32)> {
            Vec::new()
        }
        fn reset(&mut self, _memory: &QueueMemory, _fresh: Vec<nvme_driver::IoQueuePair>) -> Result<usize, GioError> {
            self.resets += 1;
            Ok(0)
        }
    }

    /// Wraps an executor and, on the next `submit`, overwrites one 32-bit field of one IOCB's
    /// line 0 first: what another agent scribbling on shared memory between the queue's write
    /// and the executor's read looks like.
    pub struct Corrupting<E> {
        pub inner: E,
        pub iocb: IocbId,
        /// Offset of the field in `gio_iocb`.
        pub field_offset: usize,
        pub value: u32,
        pub armed: bool,
    }

    impl<E: Executor> Corrupting<E> {
        pub fn new(inner: E, iocb: IocbId, field_offset: usize, value: u32) -> Self {
            Self { inner, iocb, field_offset, value, armed: true }
        }
    }

    impl<E: Executor> Executor for Corrupting<E> {
        fn name(&self) -> &'static str {
            self.inner.name()
        }
        fn attach(&mut self, memory: &Arc<QueueMemory>) -> Result<(), GioError> {
            self.inner.attach(memory)
        }
        fn prepared(&mut self, memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
            self.inner.prepared(memory, id)
        }
        fn submit(&mut self, memory: &QueueMemory, batch: &IssueBatch) -> Result<(), GioError> {
            if std::mem::take(&mut self.armed) {
                memory.region.store_u32(memory.layout.iocb_offset(self.iocb) + self.field_offset, self.value, Ordering::Relaxed);
            }
            self.inner.submit(memory, batch)
        }
        fn poll(&mut self, memory: &QueueMemory) -> Result<(), GioError> {
            self.inner.poll(memory)
        }
        fn retire_queue_pairs(&mut self) -> Option<bool> {
            self.inner.retire_queue_pairs()
        }
    }

    /// A queue of depth 4 over `executor` with one device (namespace 1, 512-byte blocks) and
    /// one filled single-IOCTX Read IOCB on it, not issued.
    pub fn queue_with_one_read<E: Executor>(executor: E) -> (crate::queue::GioQueue<E>, IocbId) {
        use crate::abi::Opcode;
        use crate::layout::QueueConfig;
        use crate::types::{DeviceIndex, Iova, IovaRange, Lba};
        use crate::validate::{Descriptor, DeviceInfo, DeviceTable, IocbSpec, IoctxSpec, RegisteredMemory};
        let devices = DeviceTable::new(vec![DeviceInfo { nsid: 1, capacity_blocks: 1 << 20, block_bytes: 512, sgl_supported: true }]);
        let registered = RegisteredMemory::new(vec![IovaRange::new(Iova(0x1000_0000), 1 << 20)]).expect("registered");
        let config = QueueConfig { depth: 4, ioctx_per_iocb_max: 4 };
        let mut queue = crate::queue::GioQueue::init_queue(config, devices, registered, executor).expect("queue");
        let id = queue.get_iocb(1, Dependency::None).expect("IOCB")[0];
        let ioctx = IoctxSpec {
            device: DeviceIndex(0),
            nsid: 1,
            start_lba: Lba(0),
            block_count: 1,
            data: Iova(0x1000_0000),
            descriptor: Descriptor::SglInline,
            force_unit_access: false,
        };
        queue.fill_iocb(id, &IocbSpec::single(Opcode::Read, 0), &[ioctx]).expect("fill");
        (queue, id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{IocbProgress, QueueConfig};

    #[test]
    fn concurrent_producers_lose_no_cqe() {
        // Goal: four threads posting at once (as CPU workers and GPU threads do) never overwrite
        // each other's entries: the consumer sees every CQE exactly once.
        const PER_THREAD: u32 = 16_000;
        let memory = QueueMemory::new(QueueConfig { depth: 1 << 16, ioctx_per_iocb_max: 1 }).unwrap();
        let start = std::sync::Barrier::new(4);
        std::thread::scope(|scope| {
            for thread in 0..4u32 {
                let (memory, start) = (&memory, &start);
                scope.spawn(move || {
                    start.wait();
                    for n in 0..PER_THREAD {
                        let cqe = Cqe { iocb_id: IocbId(thread), issue_seq: n, failed_ioctx: 0, status: 2, failed_nvme_status: 0 };
                        // A holder descheduled past CQ_LOCK_WAIT (four threads on a loaded 2-core
                        // machine) makes a post give up, as designed (its caller keeps the CQE and
                        // posts it again); posted again here, a bounded number of times. What is
                        // tested is that no posted CQE is lost or overwritten.
                        let mut tries = 0;
                        while let Err(error) = post_cqe(memory, cqe) {
                            tries += 1;
                            assert!(
                                tries < 100 && matches!(error, GioError::Executor { executor: "cq", .. }),
                                "post {n} of thread {thread}: {error}"
                            );
                        }
                    }
                });
            }
        });
        let ring: Ring<'_, Cqe> = Ring::new(&memory.region, memory.layout.cq, "cq");
        let mut seen = vec![0u32; 4];
        for cqe in ring.consumer().unwrap() {
            let thread = cqe.iocb_id.0 as usize;
            assert_eq!(cqe.issue_seq, seen[thread], "thread {thread}'s CQEs in its own order, none lost");
            seen[thread] += 1;
        }
        assert_eq!(seen, vec![PER_THREAD; 4]);
    }

    #[test]
    fn last_completion_posts_once_and_first_failure_wins() {
        // Goal: with failures on IOCTX 2 then 1, the CQE names IOCTX 2 and only the last
        // completion produces it; a late duplicate finaliser (timeout race) produces nothing.
        let memory = QueueMemory::new(QueueConfig { depth: 2, ioctx_per_iocb_max: 4 }).unwrap();
        let id = IocbId(1);
        memory.write_iocb_progress(id, &IocbProgress::ISSUED, Ordering::Release);
        memory.arm_issue(id, 4);
        let nvme = |sc| Err((abi::GIO_IOCB_STATUS_NVME_ERROR, NvmeStatus::new(0, sc)));
        assert_eq!(complete_ioctx(&memory, id, 0, 7, Ok(())), None);
        assert_eq!(complete_ioctx(&memory, id, 2, 7, nvme(0x80)), None);
        assert_eq!(complete_ioctx(&memory, id, 1, 7, nvme(0x81)), None);
        let cqe = complete_ioctx(&memory, id, 3, 7, Ok(())).expect("last IOCTX posts");
        assert_eq!(cqe.failed_ioctx, 2);
        assert_eq!(NvmeStatus(cqe.failed_nvme_status).status_code(), 0x80);
        assert_eq!(u32::from(cqe.status), abi::GIO_IOCB_STATUS_NVME_ERROR);
        assert_eq!(cqe.issue_seq, 7);
        assert_eq!(memory.read_iocb_progress(id).completed_ioctx_count, 4, "the shared count mirrors the host one");
        // A completion more than the issue's IOCTXs is not counted and posts nothing, even
        // with the shared mirror rewritten to say one is left.
        memory.region.store_u32(memory.iocb_field_offset(id, IocbField::CompletedIoctxCount), 3, Ordering::Relaxed);
        assert_eq!(complete_ioctx(&memory, id, 3, 7, Ok(())), None);
        // Status already final: a second finaliser (armed again) must not post another CQE.
        memory.arm_issue(id, 1);
        assert_eq!(complete_ioctx(&memory, id, 3, 7, Ok(())), None);
    }
}
