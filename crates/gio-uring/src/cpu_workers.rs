//! The CPU executor with worker threads: each worker owns its NVMe queue pairs, at most one per
//! device (no locks between workers on the I/O path), and plays the part of a thread block.
//!
//! **The SM budget is the number of workers.** A device may be served by several workers, each
//! through a queue pair of its own. When `submit` (on the caller's thread) takes a batch's IOCB
//! ids off the gio SQ, each IOCB's IOCTXs are dealt to workers: those of device `d` go
//! round-robin (starting at the IOCB id, so that one-IOCTX IOCBs of a batch spread too) over the
//! first `min(budget, n)` of the `n` workers serving `d`, in worker order. So with every worker
//! serving every device, budget `b` puts exactly `min(b, workers)` threads on the batch and the
//! rest idle, as a GPU kernel of `b` blocks would; with each device served by one worker (a
//! partition), the budget cannot go below the workers owning the devices touched: no queue pair
//! moves between threads. The grouping per worker (`crate::ioctx_index`) is built at the first
//! issue of a filled IOCB and rebuilt only when an issue brings another budget, so reissuing
//! with the same budget does no per-IOCTX work.
//!
//! Each IOCB goes, over a bounded channel allocated at start-up, to the workers dealt at least
//! one of its IOCTXs. `submit` deals the whole batch and checks that every worker it needs is
//! running and has room before it takes an id off the SQ; if one cannot take its messages, the
//! batch is taken off the SQ with nothing sent and each IOCB is ended at once as TIMEOUT (one
//! CQE each), so the SQ never stops mid-batch. A worker submits exactly its group of IOCTXs,
//! without scanning the others, and reaps its own queues. IOCTXs of one IOCB may be spread over several workers:
//! completion counting is the protocol of `executor::complete_ioctx` (an atomic count of
//! the IOCTXs left in host memory, compare-and-swap on the first failure and on the final
//! status in shared memory), so whichever worker
//! completes the last IOCTX posts the one CQE, under the CQ's producer lock.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nvme_driver::IoQueuePair;

use crate::cpu_executor::{finish_issue_as_timeout, issued_header_or_end, CpuExecutor};
use crate::error::GioError;
use crate::executor::{Executor, IssueBatch};
use crate::ioctx_index::IoctxIndex;
use crate::layout::{FilledLines, IocbHeader, QueueMemory};
use crate::ring::Ring;
use crate::types::{DeviceIndex, IocbId};

/// How long an idle worker sleeps waiting for work before it polls its queues again.
const IDLE_WAIT: Duration = Duration::from_micros(200);

enum Message {
    Iocb(IocbHeader),
    /// Replace the worker's queue pairs (its devices in increasing index order) and report.
    Reset {
        fresh: Vec<IoQueuePair>,
        done: SyncSender<Result<(), GioError>>,
    },
    /// Teardown: delete every queue pair the worker holds (and retry those kept from a failed
    /// reset) and report whether all are known gone; the worker serves no I/O afterwards.
    Retire {
        done: SyncSender<bool>,
    },
    Stop,
    /// Tests only: the worker panics, as one hitting a bug would.
    #[cfg(test)]
    Panic,
}

/// How long `reset` waits for all workers to delete and replace their queue pairs (they do so
/// concurrently, each deletion bounded by its controller's admin timeout, 10 s by default): one
/// bound for all of them, not one per worker.
const RESET_TIMEOUT: Duration = Duration::from_secs(120);

/// How long `retire_queue_pairs` waits for all workers (they delete their pairs concurrently;
/// each deletion is bounded by its controller's admin timeout).
const RETIRE_TIMEOUT: Duration = Duration::from_secs(120);

struct Worker {
    sender: SyncSender<Message>,
    /// Messages sent and not yet received by the worker: never below the channel's fill, so
    /// `submit` can tell before it consumes anything whether a batch's messages fit.
    queued: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
    /// `poll` has reported that this worker stopped (it does so once).
    stop_reported: bool,
}

impl Worker {
    /// Sends without blocking, counted in `queued` (the worker uncounts it when it receives it).
    fn try_send(&self, message: Message) -> Result<(), TrySendError<Message>> {
        self.queued.fetch_add(1, Ordering::AcqRel);
        let sent = self.sender.try_send(message);
        if sent.is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
        sent
    }

    /// Sends, waiting for room (only for `Stop`, which must arrive), counted as `try_send`.
    fn send(&self, message: Message) -> Result<(), mpsc::SendError<Message>> {
        self.queued.fetch_add(1, Ordering::AcqRel);
        let sent = self.sender.send(message);
        if sent.is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
        sent
    }

    /// Whether the worker thread has ended (it panicked, or was told to stop): it takes no
    /// more messages.
    fn stopped(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

/// See the module documentation.
pub struct CpuWorkers {
    /// Queue pairs per worker until `attach` moves them into the worker threads.
    assignments: Vec<Vec<Option<IoQueuePair>>>,
    /// Per device index, the workers holding a queue pair on it, in increasing order.
    servers: Vec<Vec<usize>>,
    /// Every queue pair as (worker, device, NVMe queue depth), by worker then device: the order
    /// of `served_queue_depths` and of `reset`'s fresh pairs (which match the depth).
    served: Vec<(usize, usize, u32)>,
    /// Built by `attach`; each IOCB's group per worker is written by `submit`.
    index: Option<Arc<IoctxIndex>>,
    /// Scratch of one counter per worker for building the index.
    counts: Vec<u32>,
    /// Per IOCB, the SM budget its index group was built for (0: not built since it was filled).
    built_for_budget: Vec<u32>,
    /// Line 0 of each IOCB as validated by `fill_iocb` (sized by `attach`, recorded by
    /// `prepared`): what is dealt and sent to the workers, never line 0 as found at the issue.
    filled: FilledLines,
    /// Scratch: the worker each IOCTX of the IOCB being dealt goes to (sized by `attach`).
    dealt_to: Vec<usize>,
    /// Scratch: per device, IOCTXs of the IOCB being dealt so far.
    dealt: Vec<u32>,
    /// Scratch: per worker, the messages the batch being submitted sends it (sized by `attach`).
    wanted: Vec<usize>,
    /// Scratch: the ids of the batch being submitted, read from the SQ once (a batch holds at
    /// most the depth; reserved by `attach`): what `plan` deals and counts room for is what
    /// `submit` takes and sends, whatever the SQ entries say by then.
    batch_ids: Vec<IocbId>,
    workers: Vec<Worker>,
    depth: u32,
    /// The first error a worker hit since `poll` last reported one. `poll` reads only the flag;
    /// the lock is taken by a worker recording an error and by `poll` once the flag says
    /// there is one.
    failure: Arc<Failure>,
    /// `retire_queue_pairs` ran: the workers hold no queue pair, and an issue ends at once.
    retired: bool,
    /// The queue's memory, kept by `attach`, so that `retire_queue_pairs` can end the IOCBs
    /// still issued once every worker's queue pairs are deleted.
    memory: Option<Arc<QueueMemory>>,
    /// Tests only: (position in the batch, id) written over that SQ entry by the next submit
    /// once `plan` has read the batch, as another agent rewriting the SQ at that moment would.
    #[cfg(test)]
    rewrite_after_plan: Option<(u32, u32)>,
}

/// The first error any worker hit since it was last reported, like a `CpuExecutor` error:
/// `poll` reports it once (a worker's error is about one completion, e.g. a duplicate the
/// device sent, not a lasting state of the executor), and a successful reset forgets it.
#[derive(Default)]
struct Failure {
    /// Set (Release) after `reason` holds the text, so a poll that sees it (Acquire) finds it.
    /// Written only under the `reason` lock, so a `take` cannot clear a flag a later `record`
    /// set.
    raised: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl Failure {
    fn record(&self, error: &GioError) {
        let mut slot = self.reason.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        slot.get_or_insert_with(|| error.to_string());
        self.raised.store(true, Ordering::Release);
    }

    /// Takes the recorded reason; locks only when one was recorded, so the steady-state poll
    /// of a healthy executor is one atomic load and never waits on a worker.
    fn take(&self) -> Option<String> {
        if !self.raised.load(Ordering::Acquire) {
            return None;
        }
        let mut slot = self.reason.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        self.raised.store(false, Ordering::Relaxed); // under the lock: see `raised`
        slot.take()
    }
}

/// The last error a worker logged: a poll that keeps failing the same way (a CQ whose lock is
/// never released, a failed pair's error) is logged once, not on every loop (thousands a
/// second); another error, or the same one after a poll that succeeded, is logged again.
#[derive(Default)]
struct LoggedError {
    last: Option<String>,
}

impl LoggedError {
    /// Whether `error` differs from the last one logged (and is now the last one).
    fn first_time(&mut self, error: &GioError) -> bool {
        let text = error.to_string();
        if self.last.as_deref() == Some(text.as_str()) {
            return false;
        }
        self.last = Some(text);
        true
    }

    fn clear(&mut self) {
        self.last = None;
    }
}

impl std::fmt::Debug for CpuWorkers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuWorkers").field("workers", &self.workers.len()).field("depth", &self.depth).finish()
    }
}

impl CpuWorkers {
    /// `workers[w]` lists the (device index, queue pair) that worker `w` owns: at most one
    /// queue pair per device and worker; every device index of `0..device_count` needs at least
    /// one worker. Give every worker a queue pair on every device for the SM budget to set the
    /// number of threads exactly (module documentation). `depth` is the gio queue depth.
    ///
    /// Refused ([`GioError::InvalidConfig`]): no worker at all (every submit would fail), and,
    /// at `init_queue`, fewer devices than the queue's device table.
    pub fn new(device_count: usize, workers: Vec<Vec<(DeviceIndex, IoQueuePair)>>, depth: u32) -> Result<Self, GioError> {
        if workers.is_empty() {
            return Err(GioError::InvalidConfig { reason: "CPU workers need at least one worker".into() });
        }
        let mut servers: Vec<Vec<usize>> = vec![Vec::new(); device_count];
        let mut served = Vec::new();
        let mut assignments = Vec::with_capacity(workers.len());
        for (worker, queues) in workers.into_iter().enumerate() {
            let mut slots: Vec<Option<IoQueuePair>> = (0..device_count).map(|_| None).collect();
            for (device, queue) in queues {
                let index = usize::from(device.0);
                let slot = slots.get_mut(index).ok_or_else(|| GioError::InvalidConfig {
                    reason: format!("worker {worker} owns {device}, outside the {device_count} devices"),
                })?;
                if slot.is_some() {
                    return Err(GioError::InvalidConfig { reason: format!("worker {worker} has two queue pairs on {device}") });
                }
                servers[index].push(worker);
                *slot = Some(queue);
            }
            served.extend(slots.iter().enumerate().filter_map(|(device, slot)| slot.as_ref().map(|queue| (worker, device, queue.depth()))));
            assignments.push(slots);
        }
        if let Some(device) = servers.iter().position(Vec::is_empty) {
            return Err(GioError::InvalidConfig { reason: format!("device {device} has no worker") });
        }
        let counts = vec![0; assignments.len()];
        Ok(Self {
            assignments,
            servers,
            served,
            index: None,
            counts,
            built_for_budget: Vec::new(),
            filled: FilledLines::default(),
            dealt_to: Vec::new(),
            dealt: vec![0; device_count],
            wanted: Vec::new(),
            batch_ids: Vec::new(),
            workers: Vec::new(),
            depth,
            failure: Arc::default(),
            retired: false,
            memory: None,
            #[cfg(test)]
            rewrite_after_plan: None,
        })
    }

    /// Tests only: `workers` workers, each serving all `device_count` devices but holding no
    /// queue pair (every IOCTX dealt fails as INVALID_IOCTX at its worker: no NVMe needed).
    #[cfg(test)]
    pub(crate) fn without_queue_pairs(device_count: usize, workers: usize, depth: u32) -> Self {
        let mut executor = Self::new(0, (0..workers).map(|_| Vec::new()).collect(), depth).expect("workers");
        executor.servers = vec![(0..workers).collect(); device_count];
        executor.assignments = (0..workers).map(|_| (0..device_count).map(|_| None).collect()).collect();
        executor.dealt = vec![0; device_count];
        executor
    }

    /// Deals IOCB `header`'s IOCTXs to workers for an issue on `budget` SMs (module
    /// documentation) into `dealt_to`. An IOCTX naming a device outside the table goes to
    /// worker 0, which fails it as invalid.
    fn deal(&mut self, memory: &QueueMemory, header: &IocbHeader, budget: usize) -> Result<(), GioError> {
        let count = header.ioctx_count as usize;
        if count > self.dealt_to.len() {
            return Err(GioError::Executor {
                executor: "cpu-workers",
                reason: format!("IOCB {} holds {count} IOCTXs, above the queue's maximum {}", header.id, self.dealt_to.len()),
            });
        }
        self.dealt.fill(header.id);
        for (index, slot) in self.dealt_to[..count].iter_mut().enumerate() {
            let device = usize::from(memory.read_ioctx(header.ioctx_first + index as u32).device_index);
            *slot = match (self.servers.get(device), self.dealt.get_mut(device)) {
                (Some(servers), Some(dealt)) => {
                    // `servers` is never empty (checked by `new`) and the budget is at least 1.
                    let sharing = servers.len().min(budget).max(1);
                    let worker = servers[*dealt as usize % sharing];
                    *dealt = dealt.wrapping_add(1);
                    worker
                }
                _ => 0,
            };
        }
        Ok(())
    }

    /// Acts on one message just received; `false` when the worker must stop.
    fn handle(memory: &QueueMemory, core: &mut CpuExecutor, queued: &AtomicUsize, message: Message) -> bool {
        queued.fetch_sub(1, Ordering::AcqRel);
        match message {
            Message::Iocb(header) => core.accept(header),
            Message::Reset { fresh, done } => {
                // The caller waits on `done`; if it gave up, nobody needs the answer.
                let _ = done.send(core.replace_queue_pairs(fresh));
            }
            Message::Retire { done } => {
                // As for a reset. A pair that was not deleted stays in `core` (its rings are
                // never freed while the controller may use them) and the answer says so. The
                // pairs are reaped first (their completions counted; an attached pair is
                // deleted only once idle); `CpuWorkers` ends what is still issued.
                let _ = done.send(core.retire_pairs(Some(memory)));
            }
            Message::Stop => return false,
            #[cfg(test)]
            Message::Panic => panic!("a test told this worker to panic"),
        }
        true
    }

    fn run(memory: Arc<QueueMemory>, mut core: CpuExecutor, receiver: Receiver<Message>, queued: Arc<AtomicUsize>, failure: Arc<Failure>) {
        let mut logged = LoggedError::default();
        loop {
            // Take every IOCB handed over since the last round.
            loop {
                match receiver.try_recv() {
                    Ok(message) => {
                        if !Self::handle(&memory, &mut core, &queued, message) {
                            return;
                        }
                    }
                    Err(TryRecvError::Disconnected) => return,
                    Err(TryRecvError::Empty) => break,
                }
            }
            match core.poll(&memory) {
                Err(error) => {
                    if logged.first_time(&error) {
                        tracing::error!("gio-uring CPU worker: {error}");
                    }
                    failure.record(&error);
                }
                Ok(()) => logged.clear(),
            }
            if core.can_progress() {
                std::thread::yield_now();
                continue;
            }
            // Idle, or held until a reset (a failed or stale pair's work): block until a message
            // arrives, bounded so that a lost wake-up cannot stall it.
            match receiver.recv_timeout(IDLE_WAIT) {
                Ok(message) => {
                    if !Self::handle(&memory, &mut core, &queued, message) {
                        return;
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return,
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }
}

impl Executor for CpuWorkers {
    fn name(&self) -> &'static str {
        "cpu-workers"
    }

    /// Every device of the table needs a worker: fewer devices than the table is refused.
    fn check_device_count(&self, devices: usize) -> Result<(), GioError> {
        if self.servers.len() < devices {
            return Err(GioError::InvalidConfig {
                reason: format!("the device table has {devices} devices but the CPU workers serve {}", self.servers.len()),
            });
        }
        Ok(())
    }

    fn attach(&mut self, memory: &Arc<QueueMemory>) -> Result<(), GioError> {
        // A worker receives an IOCB only if it owns some of its IOCTXs, so the IOCB cannot complete
        // (and be reissued) before that worker took the message: the depth bounds each channel.
        // Twice the depth leaves slack.
        let config = memory.layout.config;
        // The channels are sized from the depth given to `new`: a shallower one than the queue's
        // would refuse batches the queue accepts (every IOCB of them ended as TIMEOUT).
        if self.depth != config.depth {
            return Err(GioError::InvalidConfig {
                reason: format!("cpu-workers were built for gio queue depth {}, attached to a queue of depth {}", self.depth, config.depth),
            });
        }
        let capacity = self.channel_capacity();
        let ioctx_index = Arc::new(IoctxIndex::new(config.depth, config.ioctx_per_iocb_max, self.counts.len()));
        self.index = Some(Arc::clone(&ioctx_index));
        self.dealt_to = vec![0; config.ioctx_per_iocb_max as usize];
        self.built_for_budget = vec![0; config.depth as usize];
        self.filled = FilledLines::new(config.depth);
        self.memory = Some(Arc::clone(memory));
        self.wanted = vec![0; self.assignments.len()];
        self.batch_ids = Vec::with_capacity(config.depth as usize);
        for (index, queues) in std::mem::take(&mut self.assignments).into_iter().enumerate() {
            let (sender, receiver) = mpsc::sync_channel(capacity);
            let core = CpuExecutor::for_devices(queues, config.depth, Some((Arc::clone(&ioctx_index), index)));
            let memory = Arc::clone(memory);
            let failure = Arc::clone(&self.failure);
            let queued = Arc::new(AtomicUsize::new(0));
            let counter = Arc::clone(&queued);
            let thread = std::thread::Builder::new()
                .name(format!("gio-cpu-{index}"))
                .spawn(move || Self::run(memory, core, receiver, counter, failure))
                .map_err(|error| GioError::Executor { executor: "cpu-workers", reason: format!("spawn: {error}") })?;
            self.workers.push(Worker { sender, queued, thread: Some(thread), stop_reported: false });
        }
        Ok(())
    }

    fn prepared(&mut self, memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
        // Refilled: its IOCTXs (and their devices) may have changed; deal them at the next issue.
        let built = self
            .built_for_budget
            .get_mut(id.0 as usize)
            .ok_or_else(|| GioError::Executor { executor: "cpu-workers", reason: format!("{id} is outside the pool (not attached?)") })?;
        *built = 0;
        self.filled.record(memory, id)
    }

    fn submit(&mut self, memory: &QueueMemory, batch: &IssueBatch) -> Result<(), GioError> {
        // Refusals before anything is consumed leave the batch on the SQ with its IOCBs ISSUED:
        // a reset ends them and drops the entries.
        if self.workers.is_empty() {
            return Err(GioError::Executor { executor: "cpu-workers", reason: "not attached to a queue".into() });
        }
        let ring: Ring<'_, IocbId> = Ring::new(&memory.region, memory.layout.sq, "sq");
        let mut consumer = ring.consumer()?;
        if consumer.head() != batch.sq_first || consumer.len() < batch.count {
            return Err(GioError::Executor {
                executor: "cpu-workers",
                reason: format!("SQ at {} with {} entries does not hold batch {batch:?}", consumer.head(), consumer.len()),
            });
        }
        let Some(ioctx_index) = self.index.clone() else {
            return Err(GioError::Executor { executor: "cpu-workers", reason: "not attached to a queue".into() });
        };
        if self.retired {
            // No worker holds a queue pair to run it: the batch leaves the SQ and each IOCB
            // ends now (a worker would skip every IOCTX as another worker's).
            crate::cpu_executor::end_batch_as_timeout(&mut consumer, memory, &mut self.filled, batch.count);
            return Err(GioError::QueuePairsRetired { executor: "cpu-workers" });
        }
        // Deal the whole batch and check that every worker it needs can take its messages
        // before an id is consumed: a refusal part way would leave the SQ head inside the
        // batch, and every later submit would fail.
        // The batch's ids are read once: an entry another agent rewrites after this is not
        // read again (the plan's room check counted these ids, and these are sent).
        self.batch_ids.clear();
        self.batch_ids.extend((0..batch.count).map_while(|position| consumer.peek_ahead(position)));
        let mut refused = None;
        let mut failure = self.plan(memory, batch, &ioctx_index, &mut refused).err().map(|error| match error {
            GioError::Executor { reason, .. } => reason,
            other => other.to_string(),
        });
        #[cfg(test)]
        if let Some((position, id)) = self.rewrite_after_plan.take() {
            let sq = memory.layout.sq;
            let offset = sq.entries_offset_bytes + (batch.sq_first.wrapping_add(position) & sq.mask()) as usize * 4;
            memory.region.store_u32(offset, id, Ordering::Relaxed);
        }
        let mut ended = 0u32;
        let budget = batch.sm_budget.0;
        for position in 0..self.batch_ids.len() {
            let id = self.batch_ids[position];
            if id.0 >= memory.layout.config.depth {
                continue; // `plan` refused the batch for it: there is no IOCB to end
            }
            // Each path below takes the issue first (`FilledLines::take`): an entry naming an
            // IOCB not ISSUED, in flight already (`plan` dealt it to no worker), or given no new
            // issue since the last taken, is no issue of it and is skipped, nothing of that
            // IOCB touched.
            if failure.is_some() {
                // No worker got this IOCB, so nothing runs it: it ends now, with its one CQE.
                let issue_seq = match self.filled.take(memory, id) {
                    Ok(issue_seq) => issue_seq,
                    Err(error) => {
                        refused.get_or_insert(error); // not taken: no issue of it
                        continue;
                    }
                };
                match finish_issue_as_timeout(memory, id, issue_seq) {
                    Ok(_) => ended += 1,
                    Err(error) => tracing::error!(%id, %error, "gio-uring CPU workers: ending an IOCB no worker took"),
                }
                continue;
            }
            if self.built_for_budget[id.0 as usize] != budget {
                // `plan` refused its line 0 (the error is in `refused`) and dealt it to no
                // worker: it ends now, whatever the line reads like by now.
                let issue_seq = match self.filled.take(memory, id) {
                    Ok(issue_seq) => issue_seq,
                    Err(error) => {
                        refused.get_or_insert(error); // not taken: no issue of it
                        continue;
                    }
                };
                if let Err(error) = finish_issue_as_timeout(memory, id, issue_seq) {
                    tracing::error!(%id, %error, "gio-uring CPU workers: ending an IOCB with a corrupt line 0");
                }
                continue;
            }
            // Overwritten since `plan` read it: no worker gets it, and it ends now.
            let Some(header) = issued_header_or_end(memory, &mut self.filled, id, batch.layer, "CPU workers", &mut refused) else {
                continue;
            };
            for (index, worker) in self.workers.iter().enumerate() {
                if ioctx_index.range(id, index).1 == 0 {
                    continue; // dealt none of this IOCB's IOCTXs
                }
                if let Err(error) = worker.try_send(Message::Iocb(header)) {
                    // Only if the worker ended since `plan` looked. The workers that took this
                    // IOCB run their IOCTXs; the rest never complete, so it waits for a reset.
                    failure = Some(Self::send_error(index, &error));
                    break;
                }
            }
        }
        consumer.advance(self.batch_ids.len() as u32);
        drop(consumer); // the head moves past the whole batch (Release)
        match failure {
            None => refused.map_or(Ok(()), Err),
            Some(error) => Err(GioError::Executor {
                executor: "cpu-workers",
                reason: format!("{error}; {ended} IOCBs of the batch no worker took were ended as timed out"),
            }),
        }
    }

    fn poll(&mut self, memory: &QueueMemory) -> Result<(), GioError> {
        // CQEs a worker (or a reset) built but could not post: posted here, on the caller's
        // thread, as the CPU executor does in its poll.
        let reposted = crate::executor::repost_kept_cqes(memory);
        if let Some(reason) = self.failure.take() {
            return Err(GioError::Executor { executor: "cpu-workers", reason });
        }
        // A worker ends only when `drop` tells it to, so one that has ended now panicked: the
        // IOCTXs dealt to it never complete and no reset can replace its pairs. Said once per
        // worker, at the first poll after (one atomic load per worker while all run), instead of
        // only as every wait's timeout and every later reset's failure. Any worker counts, dealt
        // IOCTXs or not: either way the executor cannot be reset any more.
        if let Some((worker, state)) = self.workers.iter_mut().enumerate().find(|(_, worker)| !worker.stop_reported && worker.stopped()) {
            state.stop_reported = true;
            return Err(GioError::WorkerStopped { worker });
        }
        reposted
    }

    /// Deletes every worker's queue pairs (each worker its own, on its thread; those a failed
    /// reset kept are retried) and says whether all are known gone. `Some(false)` also when a
    /// worker has stopped or does not answer within the bound: its pairs may still be live.
    fn retire_queue_pairs(&mut self) -> Option<bool> {
        self.retired = true;
        if self.workers.is_empty() {
            // Never attached: the queue pairs are still here. One that is not deleted stays
            // (and its drop retries, else leaks its rings); a later call retries it.
            let mut all_deleted = true;
            for (worker, slots) in self.assignments.iter_mut().enumerate() {
                for (device, slot) in slots.iter_mut().enumerate() {
                    if let Some(pair) = slot.take() {
                        if let Err(error) = pair.delete() {
                            let source = &error.source;
                            tracing::error!(worker, device, %source, "gio-uring CPU workers teardown: a queue pair could not be deleted");
                            *slot = Some(*error.pair);
                            all_deleted = false;
                        }
                    }
                }
            }
            return Some(all_deleted);
        }
        let deadline = Instant::now() + RETIRE_TIMEOUT;
        let mut all_deleted = true;
        let mut replies = Vec::with_capacity(self.workers.len());
        for (index, worker) in self.workers.iter().enumerate() {
            let (done, reply) = mpsc::sync_channel(1);
            match worker.try_send(Message::Retire { done }) {
                Ok(()) => replies.push((index, reply)),
                Err(error) => {
                    tracing::error!(worker = index, "gio-uring CPU workers teardown: {}", Self::send_error(index, &error));
                    all_deleted = false;
                }
            }
        }
        for (index, reply) in replies {
            let outcome = reply.recv_timeout(deadline.saturating_duration_since(Instant::now()));
            match outcome {
                Ok(true) => {}
                Ok(false) => {
                    tracing::error!(worker = index, "gio-uring CPU workers teardown: a worker could not delete a queue pair");
                    all_deleted = false;
                }
                Err(error) => {
                    tracing::error!(
                        worker = index,
                        "gio-uring CPU workers teardown: no answer within {} s ({error}): its queue pairs may still be live",
                        RETIRE_TIMEOUT.as_secs()
                    );
                    all_deleted = false;
                }
            }
        }
        if let (true, Some(memory)) = (all_deleted, &self.memory) {
            // Every worker deleted its pairs and dropped what it held pending: no command can
            // complete any more, so what is still issued would never end otherwise.
            crate::cpu_executor::end_issued_after_retirement(memory, &mut self.filled, "CPU workers");
        }
        Some(all_deleted)
    }
}

impl CpuWorkers {
    /// Deals every IOCB of `batch` (its ids as `submit` read them into `batch_ids`) and checks
    /// that each worker it sends to is running and has room in its channel for all its messages. An IOCB whose line 0 is
    /// corrupt is dealt to no worker (its `built_for_budget` is cleared, so `submit` ends it
    /// alone) and its error goes to `refused` (the first one is what the issue returns).
    fn plan(
        &mut self,
        memory: &QueueMemory,
        batch: &IssueBatch,
        ioctx_index: &IoctxIndex,
        refused: &mut Option<GioError>,
    ) -> Result<(), GioError> {
        let budget = batch.sm_budget.0;
        self.wanted.fill(0);
        for position in 0..batch.count {
            let Some(id) = self.batch_ids.get(position as usize).copied() else {
                return Err(GioError::Executor { executor: "cpu-workers", reason: format!("SQ lost entry {position} of batch {batch:?}") });
            };
            if id.0 >= memory.layout.config.depth {
                return Err(GioError::Executor { executor: "cpu-workers", reason: format!("SQ names {id}, outside the pool") });
            }
            if let Err(error) = self.filled.takeable(memory, id) {
                // Not ISSUED, in flight already, or given no new issue since the last taken: no
                // issue of it (`submit` skips the entry).
                // Its group is left alone: a worker may be reading it.
                refused.get_or_insert(error);
                continue;
            }
            let header = match self.filled.issued(memory, id, batch.layer) {
                Ok(header) => header,
                Err(error) => {
                    self.built_for_budget[id.0 as usize] = 0; // its group is rebuilt at its next issue
                    refused.get_or_insert(error);
                    continue;
                }
            };
            if self.built_for_budget[id.0 as usize] != budget {
                // The IOCB's previous issue has completed: no worker reads its group any more.
                self.deal(memory, &header, budget as usize)?;
                ioctx_index.build(id, &self.dealt_to[..header.ioctx_count as usize], &mut self.counts);
                self.built_for_budget[id.0 as usize] = budget;
            }
            for (worker, wanted) in self.wanted.iter_mut().enumerate() {
                if ioctx_index.range(id, worker).1 > 0 {
                    *wanted += 1;
                }
            }
        }
        let capacity = self.channel_capacity();
        for (index, (worker, &wanted)) in self.workers.iter().zip(&self.wanted).enumerate() {
            if wanted == 0 {
                continue;
            }
            if worker.stopped() {
                return Err(GioError::Executor { executor: "cpu-workers", reason: format!("worker {index} has stopped") });
            }
            let queued = worker.queued.load(Ordering::Acquire);
            if queued.saturating_add(wanted) > capacity {
                return Err(GioError::Executor {
                    executor: "cpu-workers",
                    reason: format!("worker {index} has {queued} messages queued, no room for {wanted} more (capacity {capacity})"),
                });
            }
        }
        Ok(())
    }

    /// Waits for every worker told to reset to answer, all within one `timeout` from now (the
    /// workers replace their pairs concurrently, so the wait is bounded by `timeout` whatever
    /// their number), and returns the first failure: a worker's error, one that did not
    /// answer in time, or one that stopped.
    fn await_resets(replies: Vec<(usize, Receiver<Result<(), GioError>>)>, timeout: Duration) -> Option<GioError> {
        let deadline = Instant::now() + timeout;
        let mut failure = None;
        for (index, reply) in replies {
            let outcome = match reply.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(outcome) => outcome,
                Err(RecvTimeoutError::Timeout) => Err(GioError::Executor {
                    executor: "cpu-workers",
                    reason: format!(
                        "worker {index} did not replace its queue pairs within {} s (a later reset hears of any deletion it could not do)",
                        timeout.as_secs_f64()
                    ),
                }),
                Err(RecvTimeoutError::Disconnected) => {
                    Err(GioError::Executor { executor: "cpu-workers", reason: format!("worker {index} stopped during the reset") })
                }
            };
            if let Err(error) = outcome {
                failure.get_or_insert(error);
            }
        }
        failure
    }

    /// Messages a worker's channel holds: twice the depth (see `attach`).
    fn channel_capacity(&self) -> usize {
        self.depth as usize * 2
    }

    fn send_error(index: usize, error: &TrySendError<Message>) -> String {
        match error {
            TrySendError::Full(_) => format!("worker {index} has no room for another message"),
            TrySendError::Disconnected(_) => format!("worker {index} has stopped"),
        }
    }
}

impl crate::executor::QueuePairReset for CpuWorkers {
    /// One entry per queue pair, by worker then device (a device served by several workers
    /// appears once for each).
    fn served_queue_depths(&self) -> Vec<(usize, u32)> {
        self.served.iter().map(|&(_, device, depth)| (device, depth)).collect()
    }

    /// Every worker deletes and replaces its own queue pairs (on its thread, between polls);
    /// only when all have, are the IOCBs still in flight ended. `fresh` follows
    /// `served_queue_depths`.
    fn reset(&mut self, memory: &QueueMemory, fresh: Vec<IoQueuePair>) -> Result<usize, GioError> {
        if fresh.len() != self.served.len() {
            return Err(GioError::InvalidConfig {
                reason: format!("reset needs {} fresh queue pairs, got {}", self.served.len(), fresh.len()),
            });
        }
        if self.workers.is_empty() {
            return Err(GioError::Executor { executor: "cpu-workers", reason: "not attached to a queue".into() });
        }
        let mut per_worker: Vec<Vec<IoQueuePair>> = (0..self.workers.len()).map(|_| Vec::new()).collect();
        for (&(worker, _, _), queue) in self.served.iter().zip(fresh) {
            per_worker[worker].push(queue); // increasing device order per worker
        }
        // Tell every worker, then wait for every one told (even after a failure: a worker that
        // got the message replaces its pairs regardless, and its outcome must be heard).
        let mut failure = None;
        let mut replies = Vec::with_capacity(self.workers.len());
        for (index, (worker, fresh)) in self.workers.iter().zip(per_worker).enumerate() {
            let (done, reply) = mpsc::sync_channel(1);
            match worker.try_send(Message::Reset { fresh, done }) {
                Ok(()) => replies.push((index, reply)),
                Err(error) => {
                    failure.get_or_insert(GioError::Executor { executor: "cpu-workers", reason: Self::send_error(index, &error) });
                }
            }
        }
        if let Some(error) = Self::await_resets(replies, RESET_TIMEOUT) {
            failure.get_or_insert(error);
        }
        if let Some(error) = failure {
            return Err(error);
        }
        // Every queue pair is new: an error a worker hit on the old ones is history, and is no
        // longer reported by `poll` (it was logged when it happened).
        if let Some(reason) = self.failure.take() {
            tracing::warn!(reason, "gio-uring CPU workers: the reset replaced the queue pairs a worker error concerned");
        }
        Ok(crate::cpu_executor::finish_issued_as_timeout(memory, &mut self.filled))
    }
}

impl Drop for CpuWorkers {
    fn drop(&mut self) {
        for worker in &self.workers {
            // A worker that already stopped has dropped its receiver; nothing to tell it.
            let _ = worker.send(Message::Stop);
        }
        for worker in &mut self.workers {
            if let Some(thread) = worker.thread.take() {
                if thread.join().is_err() {
                    tracing::error!("gio-uring CPU worker panicked");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::QueueConfig;

    fn queue_memory() -> QueueMemory {
        QueueMemory::new(QueueConfig { depth: 4, ioctx_per_iocb_max: 4 }).expect("memory")
    }

    /// A queue over `workers` workers that own no queue pair: every IOCTX names device 0, which
    /// they do not serve, so worker 0 takes it and fails it as invalid (no NVMe needed).
    fn queue_without_devices(workers: usize) -> crate::queue::GioQueue<CpuWorkers> {
        use crate::types::{Iova, IovaRange};
        use crate::validate::{DeviceInfo, DeviceTable, RegisteredMemory};
        let executor = CpuWorkers::without_queue_pairs(1, workers, 4);
        let devices = DeviceTable::new(vec![DeviceInfo { nsid: 1, capacity_blocks: 1 << 20, block_bytes: 512, sgl_supported: true }]);
        let registered = RegisteredMemory::new(vec![IovaRange::new(Iova(0x1000_0000), 1 << 20)]).expect("registered");
        crate::queue::GioQueue::init_queue(QueueConfig { depth: 4, ioctx_per_iocb_max: 4 }, devices, registered, executor).expect("queue")
    }

    #[test]
    fn a_reset_waits_for_all_workers_within_one_bound() {
        // Goal: the reset's wait for the workers' answers is one bound for all of them (they
        // replace their pairs concurrently), as the documentation says; it used to be the bound
        // for each worker in turn, so N silent workers held the caller N × 120 s.
        let mut senders = Vec::new();
        let mut replies = Vec::new();
        for index in 0..4 {
            let (done, reply) = mpsc::sync_channel(1);
            senders.push(done); // kept alive and silent: the worker does not answer
            replies.push((index, reply));
        }
        let started = Instant::now();
        let failure = CpuWorkers::await_resets(replies, Duration::from_millis(200));
        let took = started.elapsed();
        assert!(matches!(&failure, Some(GioError::Executor { reason, .. }) if reason.contains("worker 0 did not replace")), "{failure:?}");
        assert!(took < Duration::from_millis(600), "4 silent workers held the reset {took:?}, bound 200 ms");
        drop(senders);
    }

    #[test]
    fn a_worker_that_stopped_is_reported_by_the_next_poll_once() {
        // Goal: a worker thread that ended (a panic) used to go unreported: the IOCBs dealt to it
        // waited out their deadlines, and every reset then failed with no earlier sign. The next
        // poll reports it, as `WorkerStopped` naming the worker, once; the healthy workers go on.
        let mut queue = queue_without_devices(2);
        queue.peek_cqe().expect("healthy workers: nothing to report");
        queue.executor_mut().workers[1].try_send(Message::Panic).expect("worker 1 takes the message");
        let deadline = Instant::now() + Duration::from_secs(5);
        while !queue.executor_mut().workers[1].stopped() {
            assert!(Instant::now() < deadline, "worker 1 did not stop");
            std::thread::sleep(Duration::from_millis(1));
        }
        let reported = queue.peek_cqe();
        assert!(matches!(reported, Err(GioError::WorkerStopped { worker: 1 })), "{reported:?}");
        assert!(queue.peek_cqe().is_ok(), "reported once");
        assert!(!queue.executor_mut().workers[0].stopped(), "worker 0 runs on");
    }

    #[test]
    fn a_worker_logs_a_recurring_error_once() {
        // Goal: a worker whose every poll fails the same way logged it on every loop (thousands
        // a second); it logs each distinct error once, and again after a poll that succeeded.
        let busy = GioError::Executor { executor: "cq", reason: "CQ producer lock not released".into() };
        let other = GioError::Executor { executor: "cpu", reason: "device 0: stale".into() };
        let mut logged = LoggedError::default();
        assert!(logged.first_time(&busy));
        assert!(!logged.first_time(&busy));
        assert!(!logged.first_time(&busy));
        assert!(logged.first_time(&other));
        assert!(logged.first_time(&busy));
        logged.clear();
        assert!(logged.first_time(&busy));
    }

    #[test]
    fn workers_built_for_another_depth_than_the_queue_are_refused_at_attach() {
        // Goal: the worker channels are sized from `new`'s depth; attached to a deeper queue they
        // would refuse full batches the queue accepts (spurious SubmitFailed). A mismatch is an
        // InvalidConfig naming both depths, before any worker starts.
        use crate::types::{Iova, IovaRange};
        use crate::validate::{DeviceInfo, DeviceTable, RegisteredMemory};
        let executor = CpuWorkers::without_queue_pairs(1, 1, 1);
        let devices = DeviceTable::new(vec![DeviceInfo { nsid: 1, capacity_blocks: 1 << 20, block_bytes: 512, sgl_supported: true }]);
        let registered = RegisteredMemory::new(vec![IovaRange::new(Iova(0x1000_0000), 1 << 20)]).expect("registered");
        let error = crate::queue::GioQueue::init_queue(QueueConfig { depth: 4, ioctx_per_iocb_max: 4 }, devices, registered, executor)
            .expect_err("a depth-1 executor on a depth-4 queue is refused");
        assert!(
            matches!(&error, GioError::InvalidConfig { reason } if reason.contains("depth 1") && reason.contains("depth 4")),
            "{error}"
        );
    }

    fn fill<E: Executor>(queue: &mut crate::queue::GioQueue<E>, count: usize) -> Vec<IocbId> {
        use crate::abi::Opcode;
        use crate::types::{Dependency, DeviceIndex, Iova, Lba};
        use crate::validate::{Descriptor, IocbSpec, IoctxSpec};
        let ids = queue.get_iocb(count, Dependency::None).expect("IOCBs");
        let spec = IocbSpec::single(Opcode::Read, 0);
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
            queue.fill_iocb(id, &spec, &[ioctx]).expect("fill");
        }
        ids
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn an_iocb_whose_line_0_was_overwritten_is_refused_with_an_error_not_a_panic() {
        // Goal: as for the CPU executor: a corrupt line 0 (an IOCTX count above the queue's
        // maximum, then an id that is not the SQ entry's) is a typed error of the issue, the
        // IOCB ends once as timed out, and the workers keep running.
        use crate::error::IocbFailure;
        use crate::executor::test_double::{queue_with_one_read, Corrupting};
        use crate::types::{LayerIndex, SmBudget};
        for (field, value) in
            [(core::mem::offset_of!(crate::abi::gio_iocb, ioctx_count), 4000), (core::mem::offset_of!(crate::abi::gio_iocb, id), 999)]
        {
            let workers = CpuWorkers::without_queue_pairs(1, 1, 4);
            let (mut queue, id) = queue_with_one_read(Corrupting::new(workers, IocbId(0), field, value));
            let issued = queue.issue_io(&[id], LayerIndex(0), SmBudget(1));
            assert!(matches!(&issued, Err(GioError::SubmitFailed { .. })), "field {field}: {issued:?}");
            let ended = queue.wait_cqe(id, soon()).expect("ended once");
            assert!(matches!(ended.result, Err(IocbFailure::Timeout { .. })), "field {field}: {:?}", ended.result);
            queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).expect("the workers still run");
            let completion = queue.wait_cqe(id, soon()).expect("completes");
            assert_eq!(completion.result, Err(IocbFailure::InvalidIoctx { ioctx_index: 0 }), "device 0 has no worker's queue pair");
        }
    }

    #[test]
    fn a_corrupt_line_0_ends_only_its_iocb_with_the_typed_error() {
        // Goal: as docs/gio-uring.md says, an IOCB whose line 0 was overwritten ends at once as
        // TIMEOUT and the issue reports GioError::CorruptIocb; the other IOCBs of its batch run
        // as usual (they used to end as TIMEOUT too, with an untyped executor error).
        use crate::error::IocbFailure;
        use crate::executor::test_double::Corrupting;
        use crate::types::{Iova, IovaRange, LayerIndex, SmBudget};
        use crate::validate::{DeviceInfo, DeviceTable, RegisteredMemory};
        let workers = CpuWorkers::without_queue_pairs(1, 1, 4);
        let stride = core::mem::offset_of!(crate::abi::gio_iocb, mem_stride_bytes);
        let devices = DeviceTable::new(vec![DeviceInfo { nsid: 1, capacity_blocks: 1 << 20, block_bytes: 512, sgl_supported: true }]);
        let registered = RegisteredMemory::new(vec![IovaRange::new(Iova(0x1000_0000), 1 << 20)]).expect("registered");
        let config = QueueConfig { depth: 4, ioctx_per_iocb_max: 4 };
        let executor = Corrupting::new(workers, IocbId(0), stride, 1 << 30);
        let mut queue = crate::queue::GioQueue::init_queue(config, devices, registered, executor).expect("queue");
        let ids = fill(&mut queue, 2);
        assert_eq!(ids[0], IocbId(0));
        let issued = queue.issue_io(&ids, LayerIndex(0), SmBudget(1));
        match &issued {
            Err(GioError::SubmitFailed { source, .. }) => {
                assert!(matches!(**source, GioError::CorruptIocb { field: "mem_stride_bytes", .. }), "{source}")
            }
            other => panic!("expected a refused issue, got {other:?}"),
        }
        let corrupt = queue.wait_cqe(ids[0], soon()).expect("ended once");
        assert_eq!(corrupt.result, Err(IocbFailure::Timeout { ioctx_index: None }));
        let other = queue.wait_cqe(ids[1], soon()).expect("ran");
        assert_eq!(other.result, Err(IocbFailure::InvalidIoctx { ioctx_index: 0 }), "run by the worker (device 0 has no queue pair)");
    }

    #[test]
    fn a_batch_a_stopped_worker_cannot_take_ends_whole_and_the_sq_stays_usable() {
        // Goal: when the worker a batch needs has stopped, submit consumes none of it part way:
        // the whole batch leaves the SQ and each IOCB ends at once as timed out (one CQE each),
        // so the caller can reap them, and a later issue finds the SQ where it expects it.
        use crate::error::IocbFailure;
        use crate::types::{LayerIndex, SmBudget};
        let mut queue = queue_without_devices(1);
        let ids = fill(&mut queue, 2);
        queue.issue_io(&ids[..1], LayerIndex(0), SmBudget(1)).expect("a healthy worker takes the issue");
        let first = queue.wait_cqe(ids[0], soon()).expect("the worker completes it");
        assert_eq!(first.result, Err(IocbFailure::InvalidIoctx { ioctx_index: 0 }), "device 0 is served by no worker");
        {
            let worker = &mut queue.executor_mut().workers[0];
            worker.try_send(Message::Stop).expect("the worker takes the stop");
            worker.thread.take().expect("running").join().expect("the worker stops cleanly");
        }
        for round in 0..2 {
            let refused = queue.issue_io(&ids, LayerIndex(0), SmBudget(1));
            assert!(matches!(&refused, Err(error) if error.to_string().contains("worker 0 has stopped")), "round {round}: {refused:?}");
            for &id in &ids {
                let ended = queue.wait_cqe(id, soon()).expect("ended at once, not left hanging");
                assert_eq!(ended.result, Err(IocbFailure::Timeout { ioctx_index: None }), "round {round}, {id}");
            }
        }
    }

    #[test]
    fn a_worker_error_is_reported_once_and_a_reset_forgets_one_not_yet_reported() {
        // Goal: like the CPU executor, an error a worker recorded is returned by one poll, not
        // by every later one; one still unreported when a reset replaces the queue pairs is
        // forgotten (it concerned the old pairs), so I/O after the reset is not failed by it.
        use crate::error::IocbFailure;
        use crate::types::{LayerIndex, SmBudget};
        let mut queue = queue_without_devices(1);
        let ids = fill(&mut queue, 1);
        let failure = Arc::clone(&queue.executor().failure);
        failure.record(&GioError::InvalidConfig { reason: "a duplicate completion".into() });
        let reported = queue.peek_cqe().expect_err("reported");
        assert!(reported.to_string().contains("a duplicate completion"), "{reported}");
        assert!(queue.peek_cqe().expect("reported once").is_none());
        failure.record(&GioError::InvalidConfig { reason: "a stale completion".into() });
        let (executor, memory) = queue.executor_and_memory();
        assert_eq!(crate::executor::QueuePairReset::reset(executor, memory, Vec::new()).expect("reset"), 0);
        queue.issue_io(&ids, LayerIndex(0), SmBudget(1)).expect("issue");
        let completion = queue.wait_cqe(ids[0], soon()).expect("the wait is not failed by the forgotten error");
        assert_eq!(completion.result, Err(IocbFailure::InvalidIoctx { ioctx_index: 0 }));
    }

    #[test]
    fn an_sq_entry_rewritten_after_the_plan_is_not_read_again() {
        // Goal: submit takes the ids its plan dealt and counted room for, read once from the
        // SQ: an entry rewritten between the plan and the take (here to name an IOCB filled
        // but not issued) used to be read again, so the IOCB planned was never taken (its
        // issue hung until a reset) and the one named instead could be sent to workers whose
        // room was never checked for it.
        use crate::error::IocbFailure;
        use crate::types::{LayerIndex, SmBudget};
        let mut queue = queue_without_devices(1);
        let ids = fill(&mut queue, 2);
        queue.executor_mut().rewrite_after_plan = Some((0, ids[1].0));
        queue.issue_io(&ids[..1], LayerIndex(0), SmBudget(1)).expect("the planned IOCB is taken");
        let done = queue.wait_cqe(ids[0], Instant::now() + Duration::from_secs(2)).expect("it runs");
        assert_eq!(done.result, Err(IocbFailure::InvalidIoctx { ioctx_index: 0 }), "no worker holds a pair for device 0");
    }

    #[test]
    fn poll_does_not_take_the_failure_lock_while_healthy() {
        // Goal: the steady-state poll reads a flag, not the mutex: with the lock held elsewhere
        // (as by a worker recording an error) a poll of a healthy executor returns at once.
        let mut workers = CpuWorkers::new(0, vec![Vec::new()], 4).expect("no devices is a valid executor");
        let memory = queue_memory();
        let failure = Arc::clone(&workers.failure);
        let held = failure.reason.lock().expect("lock");
        let (done, finished) = mpsc::channel();
        let poller = std::thread::spawn(move || {
            let result = workers.poll(&memory).map_err(|error| error.to_string());
            let _ = done.send(result);
            workers
        });
        let result = finished.recv_timeout(Duration::from_secs(5));
        drop(held);
        assert_eq!(result, Ok(Ok(())), "poll blocked on the failure mutex (or failed)");
        let mut workers = poller.join().expect("poller");
        // A recorded failure is still reported, with its text.
        failure.record(&GioError::InvalidConfig { reason: "worker 0 hit a wall".into() });
        let reported = workers.poll(&queue_memory()).expect_err("the failure must be reported");
        assert!(reported.to_string().contains("worker 0 hit a wall"), "{reported}");
        assert!(workers.poll(&queue_memory()).is_ok(), "and reported once");
    }
}
