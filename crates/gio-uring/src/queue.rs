//! The gio_uring API of Tutti §3.2: `init_queue`, `get_iocb`, fill, `issue_io`, `wait_cqe`, plus
//! non-blocking `peek_cqe` / `reap_cqe` and `put_iocb`.
//!
//! Life of an IOCB (host-side state, never in shared memory):
//! `Free --get_iocb--> Reserved --fill_iocb--> Prepared --issue_io--> InFlight --CQE--> Completed`,
//! then `Completed --issue_io-->` InFlight again (the next layer of a prepared request), or
//! `--put_iocb--> Free`. Everything is allocated by `init_queue`; `issue_io` and the completion
//! path allocate nothing.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::abi::{self, IocbStatus, NvmeStatus};
use crate::error::{GioError, IocbFailure};
use crate::executor::{Executor, IssueBatch, QueuePairReset};
use crate::layout::{IocbHeader, IocbProgress, QueueConfig, QueueMemory};
use crate::ring::{Cqe, Ring};
use crate::types::{Dependency, IocbId, LayerIndex, SmBudget};
use crate::validate::{DeviceTable, IocbSpec, IoctxEncoder, IoctxSpec, RegisteredMemory};

/// The outcome of one issue of one IOCB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub id: IocbId,
    pub layer: LayerIndex,
    pub user_data: u64,
    pub result: Result<(), IocbFailure>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Reserved,
    Prepared,
    InFlight,
    Completed(Completion),
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            State::Free => "free",
            State::Reserved => "reserved (not filled)",
            State::Prepared => "prepared",
            State::InFlight => "in flight",
            State::Completed(_) => "completed",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct HostIocb {
    state: State,
    dependency: Dependency,
    header: IocbHeader,
    /// Epoch of the last `issue_io` that named this IOCB, to find duplicates in O(1).
    issue_mark: u64,
}

/// How many poll errors a queue keeps for later calls (`GioQueue::keep_poll_error`). Two: an
/// error kept behind a completion, and the one of the next wait's poll that posts its completion
/// too (the case where one was lost when only one was kept). A call that returns a kept error
/// takes it and adds at most one, so the list grows only by waits whose poll fails and that return
/// something other than a kept error: a completion, or the CQ's error when their drain of the CQ
/// fails (they take none and keep the poll's), with no peek, reap or wait returning a kept error
/// between them (the runtime's pump peeks after each issue); each one kept fails a later call, so
/// more would mostly fail healthy calls with stale errors.
const POLL_ERRORS_KEPT: usize = 2;

/// A gio_uring queue: its shared rings and records, the host-side state of each IOCB, and the
/// executor that runs them.
#[derive(Debug)]
pub struct GioQueue<E: Executor> {
    memory: Arc<QueueMemory>,
    executor: E,
    devices: DeviceTable,
    registered: RegisteredMemory,
    iocbs: Vec<HostIocb>,
    free: Vec<IocbId>,
    /// Completed IOCBs not yet returned by `reap_cqe` / `wait_cqe`, in completion order.
    reaped: VecDeque<IocbId>,
    issue_epoch: u64,
    /// Errors of executor `poll`s whose calls returned something else (see `keep_poll_error`),
    /// oldest first: each later call that polls returns the oldest, after polling all the same.
    /// At most `POLL_ERRORS_KEPT`; a reset of the queue pairs forgets them (`reset_queue_pairs`).
    poll_errors: VecDeque<GioError>,
}

impl<E: Executor> GioQueue<E> {
    /// `init_queue(depth)`: allocates `depth` IOCBs with their IOCTXs, an SQ and a CQ of `depth`
    /// entries, in one shared region. `devices` and `registered` are what IOCTXs are checked
    /// against when filled.
    pub fn init_queue(config: QueueConfig, devices: DeviceTable, registered: RegisteredMemory, executor: E) -> Result<Self, GioError> {
        executor.check_device_count(devices.len())?;
        let memory = Arc::new(QueueMemory::new(config)?);
        let mut executor = executor;
        executor.attach(&memory)?;
        let depth = config.depth as usize;
        let iocbs = (0..config.depth)
            .map(|id| HostIocb {
                state: State::Free,
                dependency: Dependency::None,
                header: IocbHeader {
                    id,
                    ioctx_count: 0,
                    ioctx_first: memory.layout.ioctx_first(IocbId(id)),
                    layer_count: 0,
                    layer: 0,
                    issue_seq: 0,
                    opcode: 0,
                    user_data: 0,
                    lba_stride_blocks: 0,
                    mem_stride_bytes: 0,
                    desc_stride_bytes: 0,
                },
                issue_mark: 0,
            })
            .collect();
        // Hand out low ids first: pop from the end of a reversed list.
        let free = (0..config.depth).rev().map(IocbId).collect();
        Ok(Self {
            memory,
            executor,
            devices,
            registered,
            iocbs,
            free,
            reaped: VecDeque::with_capacity(depth),
            issue_epoch: 0,
            poll_errors: VecDeque::with_capacity(POLL_ERRORS_KEPT),
        })
    }

    pub fn config(&self) -> QueueConfig {
        self.memory.layout.config
    }

    pub fn executor(&self) -> &E {
        &self.executor
    }

    pub fn executor_mut(&mut self) -> &mut E {
        &mut self.executor
    }

    /// The executor together with the queue's memory, for executor operations that act on the
    /// shared records (e.g. [`Executor::lend_queue_pair`]). A reset after a lost completion goes
    /// through [`GioQueue::reset_queue_pairs`], which also forgets a poll error kept for the
    /// replaced pairs.
    pub fn executor_and_memory(&mut self) -> (&mut E, &QueueMemory) {
        (&mut self.executor, &self.memory)
    }

    /// The shared memory, e.g. to map it into a GPU.
    pub fn memory(&self) -> &QueueMemory {
        &self.memory
    }

    /// IOCBs not handed out.
    pub fn free_iocbs(&self) -> usize {
        self.free.len()
    }

    fn host(&self, id: IocbId) -> Result<&HostIocb, GioError> {
        self.iocbs.get(id.0 as usize).ok_or(GioError::UnknownIocb { id, depth: self.config().depth })
    }

    /// `get_iocb(n, event)`: reserves `count` IOCBs whose I/O will wait on `dependency`. Called
    /// once per request, off the per-layer path (it returns a small Vec).
    pub fn get_iocb(&mut self, count: usize, dependency: Dependency) -> Result<Vec<IocbId>, GioError> {
        let mut ids = Vec::with_capacity(count);
        self.get_iocb_into(count, dependency, &mut ids)?;
        Ok(ids)
    }

    /// [`GioQueue::get_iocb`] appending to `ids`, which allocates nothing when `ids` has room
    /// (a caller that keeps its id list across requests prepares without allocating).
    pub fn get_iocb_into(&mut self, count: usize, dependency: Dependency, ids: &mut Vec<IocbId>) -> Result<(), GioError> {
        if count == 0 || count > self.free.len() {
            return Err(GioError::NoFreeIocb { requested: count, available: self.free.len() });
        }
        let start = self.free.len() - count;
        for id in self.free.drain(start..).rev() {
            let host = &mut self.iocbs[id.0 as usize];
            host.state = State::Reserved;
            host.dependency = dependency;
            ids.push(id);
        }
        Ok(())
    }

    /// Returns an IOCB to the pool. Not while it is in flight.
    pub fn put_iocb(&mut self, id: IocbId) -> Result<(), GioError> {
        let state = self.host(id)?.state;
        if matches!(state, State::InFlight | State::Free) {
            return Err(GioError::WrongState { id, state: state.name(), operation: "put_iocb" });
        }
        self.forget_reaped(id);
        self.iocbs[id.0 as usize].state = State::Free;
        self.free.push(id);
        Ok(())
    }

    /// Fills an IOCB with its request: checks every IOCTX (device, namespace, LBA range for the
    /// first and last layer, length, descriptor and data inside registered memory) and writes the
    /// records. On error the IOCB is left reserved (not issuable) and the error names the IOCTX.
    pub fn fill_iocb(&mut self, id: IocbId, spec: &IocbSpec, ioctxs: &[IoctxSpec]) -> Result<(), GioError> {
        let state = self.host(id)?.state;
        if !matches!(state, State::Reserved | State::Prepared | State::Completed(_)) {
            return Err(GioError::WrongState { id, state: state.name(), operation: "fill_iocb" });
        }
        let max = self.config().ioctx_per_iocb_max;
        if ioctxs.is_empty() || ioctxs.len() > max as usize {
            return Err(GioError::BadIoctxCount { id, count: ioctxs.len(), max });
        }
        if spec.layer_count == 0 {
            return Err(GioError::ZeroLayerCount { id });
        }
        self.forget_reaped(id);
        self.iocbs[id.0 as usize].state = State::Reserved;
        let first = self.memory.layout.ioctx_first(id);
        // Each IOCTX is stored as soon as it is encoded. A bad one leaves the IOCB Reserved with
        // some records rewritten, which no executor reads (only issued IOCBs are read).
        let encoder = IoctxEncoder::new(spec, &self.devices, &self.registered);
        for (index, ioctx) in (0u32..).zip(ioctxs) {
            let words = encoder.encode_words(ioctx).map_err(|fault| GioError::InvalidIoctx { id, index, fault })?;
            self.memory.write_ioctx_record(first + index, &words);
        }
        let host = &mut self.iocbs[id.0 as usize];
        host.header = IocbHeader {
            id: id.0,
            ioctx_count: ioctxs.len() as u32,
            ioctx_first: first,
            layer_count: spec.layer_count,
            layer: 0,
            issue_seq: host.header.issue_seq,
            opcode: spec.opcode.to_abi(),
            user_data: spec.user_data,
            lba_stride_blocks: spec.lba_stride_blocks,
            mem_stride_bytes: spec.mem_stride_bytes,
            desc_stride_bytes: spec.desc_stride_bytes,
        };
        self.memory.write_iocb_header(id, &host.header);
        self.executor.prepared(&self.memory, id)?;
        self.iocbs[id.0 as usize].state = State::Prepared;
        Ok(())
    }

    /// `issue_io(ids, SMs)` for one layer: publishes the ids on the SQ (one Release store for the
    /// batch) and hands the batch to the executor. All-or-nothing: on any error before the
    /// executor is called, nothing was issued. A full SQ is back-pressure
    /// ([`GioError::SubmissionQueueFull`]): reap and retry. An error of the executor's comes
    /// as [`GioError::SubmitFailed`]: the IOCBs were published and are in flight; each still
    /// completes once, and must be waited for like any issued IOCB.
    pub fn issue_io(&mut self, ids: &[IocbId], layer: LayerIndex, sm_budget: SmBudget) -> Result<(), GioError> {
        let depth = self.config().depth;
        if ids.is_empty() || ids.len() > depth as usize {
            return Err(GioError::BadIssueSize { count: ids.len(), depth });
        }
        if sm_budget.0 == 0 {
            return Err(GioError::ZeroSmBudget);
        }
        self.issue_epoch += 1;
        let epoch = self.issue_epoch;
        let dependency = self.host(ids[0])?.dependency;
        for &id in ids {
            let host = self.host(id)?;
            if !matches!(host.state, State::Prepared | State::Completed(_)) {
                return Err(GioError::WrongState { id, state: host.state.name(), operation: "issue_io" });
            }
            if layer.0 >= host.header.layer_count {
                return Err(GioError::LayerOutOfRange { id, layer, layer_count: host.header.layer_count });
            }
            if host.dependency != dependency {
                return Err(GioError::MixedDependencies { id, expected: dependency, found: host.dependency });
            }
            if host.issue_mark == epoch {
                return Err(GioError::DuplicateIssue { id });
            }
            self.iocbs[id.0 as usize].issue_mark = epoch;
        }
        self.executor.check_dependency(&dependency)?;
        let ring: Ring<'_, IocbId> = Ring::new(&self.memory.region, self.memory.layout.sq, "sq");
        let mut producer = ring.producer()?;
        let needed = ids.len() as u32;
        if producer.free() < needed {
            return Err(GioError::SubmissionQueueFull { free: producer.free(), needed });
        }
        let sq_first = producer.tail();
        for &id in ids {
            let host = &mut self.iocbs[id.0 as usize];
            host.header.layer = layer.0;
            host.header.issue_seq = host.header.issue_seq.wrapping_add(1);
            host.state = State::InFlight;
            self.memory.write_iocb_header(id, &host.header);
            self.memory.note_issue_given(id, host.header.issue_seq);
            // Relaxed: the SQ tail's Release store below publishes these writes.
            self.memory.write_iocb_progress(id, &IocbProgress::ISSUED, Ordering::Relaxed);
            if producer.push(id).is_err() {
                unreachable!("free slots were checked above and this view is the only producer");
            }
        }
        // Publish only (the view's drop: one Release store of the tail). Nothing after this
        // line may fail on its own: the ids are visible to the executor from here on, so any
        // error must come as `SubmitFailed` (a `sync` here reloaded the head and could return
        // `RingCorrupt` as though nothing had been issued).
        drop(producer);
        for &id in ids {
            self.forget_reaped(id);
        }
        let batch = IssueBatch { sq_first, count: needed, layer, sm_budget, dependency };
        self.executor.submit(&self.memory, &batch).map_err(|source| GioError::SubmitFailed { count: needed, source: Box::new(source) })
    }

    /// Moves every posted CQE into the host state. Each CQE is untrusted: it must name an IOCB in
    /// flight with the issue sequence number it was issued with, else it is dropped and
    /// reported. One that does, with impossible fields, ends the issue as timed out (it was
    /// consumed: nothing else would end it) and is reported too.
    fn drain_cq(&mut self) -> Result<(), GioError> {
        let ring: Ring<'_, Cqe> = Ring::new(&self.memory.region, self.memory.layout.cq, "cq");
        let mut consumer = ring.consumer()?;
        for cqe in &mut consumer {
            let (completion, refused) = self.check_cqe(&cqe)?;
            self.iocbs[cqe.iocb_id.0 as usize].state = State::Completed(completion);
            self.reaped.push_back(cqe.iocb_id);
            if let Some(error) = refused {
                return Err(error);
            }
        }
        Ok(())
    }

    /// The completion a CQE gives its issue, with the error to report when its fields are
    /// impossible (the issue then ends as timed out); `Err` when it matches no issue in flight.
    fn check_cqe(&self, cqe: &Cqe) -> Result<(Completion, Option<GioError>), GioError> {
        let id = cqe.iocb_id;
        let unexpected = |reason| GioError::UnexpectedCompletion { id, issue_seq: cqe.issue_seq, reason };
        let host = self.iocbs.get(id.0 as usize).ok_or(unexpected("id outside the pool"))?;
        if host.state != State::InFlight {
            return Err(unexpected("IOCB not in flight"));
        }
        if host.header.issue_seq != cqe.issue_seq {
            return Err(unexpected("stale issue sequence number"));
        }
        let completion = |result| Completion { id, layer: LayerIndex(host.header.layer), user_data: host.header.user_data, result };
        // The issue in flight, with fields no executor may post: it ends here, as a failure
        // after which the caller resets the queue pairs (what the executor did is unknown).
        match issue_outcome(IocbStatus::from_abi(u32::from(cqe.status)), cqe.failed_ioctx, host.header.ioctx_count, cqe.failed_nvme_status)
        {
            Ok(result) => Ok((completion(result), None)),
            Err(reason) => Ok((completion(Err(IocbFailure::Timeout { ioctx_index: None })), Some(unexpected(reason)))),
        }
    }

    fn forget_reaped(&mut self, id: IocbId) {
        // Bounded by the depth; only on issue/put of an IOCB whose completion was never reaped.
        if let Some(position) = self.reaped.iter().position(|&reaped| reaped == id) {
            self.reaped.remove(position);
        }
    }

    fn completion_of(&self, id: IocbId) -> Option<Completion> {
        match self.iocbs[id.0 as usize].state {
            State::Completed(completion) => Some(completion),
            _ => None,
        }
    }

    /// The oldest completion not yet reaped, without consuming it. Never waits for a completion;
    /// the executor's `poll` may wait, bounded (the CUDA executor drains its stream, up to its
    /// `drain_timeout`, before it retires a launch that timed out).
    pub fn peek_cqe(&mut self) -> Result<Option<Completion>, GioError> {
        self.poll_executor()?;
        self.drain_cq()?;
        Ok(self.reaped.front().and_then(|&id| self.completion_of(id)))
    }

    /// Takes the oldest completion not yet reaped. Never waits for a completion (see
    /// [`GioQueue::peek_cqe`] for the executor's bounded waits).
    pub fn reap_cqe(&mut self) -> Result<Option<Completion>, GioError> {
        self.poll_executor()?;
        self.drain_cq()?;
        Ok(self.reaped.pop_front().and_then(|id| self.completion_of(id)))
    }

    /// Polls the executor, and returns the oldest error an earlier poll kept back (see
    /// `poll_errors`), else this poll's. With one kept, the executor is polled all the same (the
    /// runtime's pump peeks only to start I/O it just issued on a CPU executor, which nothing
    /// else would start before its wait), and an error of this poll is kept behind the others
    /// for a later call: one taken, at most one added.
    fn poll_executor(&mut self) -> Result<(), GioError> {
        let polled = self.executor.poll(&self.memory);
        self.report_kept_before(polled)
    }

    /// What a call that reports an error returns, `polled` being its own poll's outcome: the
    /// oldest error kept, `polled`'s kept behind the others; else `polled`.
    fn report_kept_before(&mut self, polled: Result<(), GioError>) -> Result<(), GioError> {
        match self.poll_errors.pop_front() {
            Some(kept) => {
                self.keep_poll_error(polled);
                Err(kept)
            }
            None => polled,
        }
    }

    /// Keeps the error of a poll whose call returns something else (the completion asked for,
    /// an error of the CQ, an error kept earlier) for a later call that polls: it may be about
    /// another IOCB or another device, and the executor reports it only once (a stopped worker,
    /// a doorbell fault, a refused CQE), so one dropped is lost for good. They are kept in order,
    /// at most `POLL_ERRORS_KEPT`: a call that returns a kept error takes it and adds at most
    /// one, so only waits whose poll fails make the list grow: one that returns a completion, or
    /// one whose drain of the CQ then fails (it returns the CQ's error and takes none); past the
    /// bound `polled`'s error is logged and dropped, and the older ones (the first fault is the
    /// likelier cause of the later ones) are reported.
    fn keep_poll_error(&mut self, polled: Result<(), GioError>) {
        if let Err(error) = polled {
            if self.poll_errors.len() < POLL_ERRORS_KEPT {
                self.poll_errors.push_back(error);
            } else {
                tracing::warn!(%error, kept = self.poll_errors.len(), "gio-uring: a poll error is dropped: older ones are kept for the next calls");
            }
        }
    }

    /// Takes IOCB `id`'s completion, if its current issue has completed.
    fn take_completion(&mut self, id: IocbId) -> Option<Completion> {
        let completion = self.completion_of(id)?;
        self.forget_reaped(id);
        Some(completion)
    }

    /// `wait_cqe(id)`: waits until IOCB `id`'s current issue completes, or `deadline` passes.
    /// Completions of other IOCBs seen meanwhile stay available to `reap_cqe`. A deadline already
    /// passed makes one non-blocking round: poll the executor once, then look at the CQ.
    pub fn wait_cqe(&mut self, id: IocbId, deadline: Instant) -> Result<Completion, GioError> {
        let started = Instant::now();
        let state = self.host(id)?.state;
        if !matches!(state, State::InFlight | State::Completed(_)) {
            return Err(GioError::WrongState { id, state: state.name(), operation: "wait_cqe" });
        }
        self.drain_cq()?;
        if let Some(completion) = self.take_completion(id) {
            return Ok(completion);
        }
        // Spin briefly (a CPU executor completes in microseconds), then yield the core.
        const SPINS_BEFORE_YIELD: u32 = 256;
        let mut spins = 0u32;
        loop {
            // The CQ is read after every poll, before the deadline is checked: with the CPU
            // executors the poll is what posts CQEs, so one it posted just as the deadline passed
            // is returned, not reported as a timeout (after which the caller would reset every
            // queue pair for an IOCB that had succeeded).
            // An error kept earlier is taken only when the wait returns it (nothing completed and
            // the CQ drained): taken before a completion, it had to be put back beside this
            // poll's own. Returning a completion or the CQ's error takes none and keeps this
            // poll's error, if any: either adds one to the errors kept.
            let polled = self.executor.poll(&self.memory);
            if let Err(error) = self.drain_cq() {
                self.keep_poll_error(polled);
                return Err(error);
            }
            if let Some(completion) = self.take_completion(id) {
                self.keep_poll_error(polled);
                return Ok(completion);
            }
            self.report_kept_before(polled)?;
            if Instant::now() >= deadline {
                return Err(GioError::WaitTimeout { id, waited_ms: started.elapsed().as_millis() });
            }
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

impl<E: QueuePairReset> GioQueue<E> {
    /// Recovers from a wait that timed out ([`QueuePairReset::reset`]): the executor replaces its
    /// queue pairs with `fresh` and ends every IOCB still in flight as TIMEOUT; returns how many.
    ///
    /// Poll errors kept for later calls (`poll_errors`) are forgotten first, and logged: they were
    /// about queue pairs this reset replaces (as `CpuWorkers`' reset forgets a worker's error not
    /// yet reported), and kept, the first calls after the reissue that poll (a peek, or a wait
    /// whose poll did not complete its IOCB) returned them, failing a healthy layer.
    pub fn reset_queue_pairs(&mut self, fresh: Vec<nvme_driver::IoQueuePair>) -> Result<usize, GioError> {
        for error in self.poll_errors.drain(..) {
            tracing::warn!(%error, "gio-uring: a poll error not yet reported is forgotten: it concerned the queue pairs the reset replaces");
        }
        self.executor.reset(&self.memory, fresh)
    }
}

/// What an IOCB's final fields (status, failed IOCTX, its NVMe status) say its issue did: a
/// terminal status, with a failed IOCTX inside the IOCB named exactly when the status needs one;
/// `Err` with the reason when no executor may post them. The one rule for a CQE (`check_cqe`)
/// and for the final line the GPU executor's retirement turns into one (`gpu::retire`).
pub(crate) fn issue_outcome(
    status: Option<IocbStatus>,
    failed_ioctx: u32,
    ioctx_count: u32,
    nvme_status: u16,
) -> Result<Result<(), IocbFailure>, &'static str> {
    let failed_index = (failed_ioctx != abi::GIO_NO_FAILED_IOCTX).then_some(failed_ioctx);
    if failed_index.is_some_and(|index| index >= ioctx_count) {
        return Err("failed IOCTX index outside the IOCB");
    }
    Ok(match (status, failed_index) {
        (Some(IocbStatus::Success), None) => Ok(()),
        (Some(IocbStatus::NvmeError), Some(ioctx_index)) => Err(IocbFailure::Nvme { ioctx_index, status: NvmeStatus(nvme_status) }),
        (Some(IocbStatus::InvalidIoctx), Some(ioctx_index)) => Err(IocbFailure::InvalidIoctx { ioctx_index }),
        (Some(IocbStatus::Timeout), ioctx_index) => Err(IocbFailure::Timeout { ioctx_index }),
        (Some(IocbStatus::ControllerFault), ioctx_index) => Err(IocbFailure::ControllerFault { ioctx_index }),
        _ => return Err("status inconsistent with failed IOCTX"),
    })
}
