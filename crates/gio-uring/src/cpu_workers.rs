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
//! moves between threads. The grouping per worker ([`crate::ioctx_index`]) is built at the first
//! issue of a filled IOCB and rebuilt only when an issue brings another budget, so reissuing
//! with the same budget does no per-IOCTX work.
//!
//! Each IOCB goes, over a bounded channel allocated at start-up, to the workers dealt at least
//! one of its IOCTXs. A worker submits exactly its group of IOCTXs, without scanning the
//! others, and reaps its own queues. IOCTXs of one IOCB may be spread over several workers:
//! completion counting is the shared-memory protocol of [`crate::executor::complete_ioctx`] (atomic
//! counter, compare-and-swap on the first failure and on the final status), so whichever worker
//! completes the last IOCTX posts the one CQE, under the CQ's producer lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nvme_driver::IoQueuePair;

use crate::cpu_executor::CpuExecutor;
use crate::error::GioError;
use crate::executor::{Executor, IssueBatch};
use crate::ioctx_index::IoctxIndex;
use crate::layout::{IocbHeader, QueueMemory};
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
    Stop,
}

/// How long `reset` waits for each worker to delete and replace its queue pairs (each deletion
/// is bounded by its controller's admin timeout, 10 s by default).
const RESET_TIMEOUT: Duration = Duration::from_secs(120);

struct Worker {
    sender: SyncSender<Message>,
    thread: Option<JoinHandle<()>>,
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
    /// Scratch: the worker each IOCTX of the IOCB being dealt goes to (sized by `attach`).
    dealt_to: Vec<usize>,
    /// Scratch: per device, IOCTXs of the IOCB being dealt so far.
    dealt: Vec<u32>,
    workers: Vec<Worker>,
    depth: u32,
    /// The first error a worker hit, reported by `poll`. `poll` reads only the flag; the lock
    /// is taken by a worker recording an error and by `poll` once the flag says there is one.
    failure: Arc<Failure>,
}

/// The first error any worker hit.
#[derive(Default)]
struct Failure {
    /// Set (Release) after `reason` holds the text, so a poll that sees it (Acquire) finds it.
    raised: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl Failure {
    fn record(&self, error: &GioError) {
        let mut slot = self.reason.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        slot.get_or_insert_with(|| error.to_string());
        self.raised.store(true, Ordering::Release);
    }

    /// The recorded reason; locks only when one was recorded, so the steady-state poll of a
    /// healthy executor is one atomic load and never waits on a worker.
    fn reason(&self) -> Option<String> {
        if !self.raised.load(Ordering::Acquire) {
            return None;
        }
        self.reason.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
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
    pub fn new(device_count: usize, workers: Vec<Vec<(DeviceIndex, IoQueuePair)>>, depth: u32) -> Result<Self, GioError> {
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
            dealt_to: Vec::new(),
            dealt: vec![0; device_count],
            workers: Vec::new(),
            depth,
            failure: Arc::default(),
        })
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

    /// Acts on one message; `false` when the worker must stop.
    fn handle(core: &mut CpuExecutor, message: Message) -> bool {
        match message {
            Message::Iocb(header) => core.accept(header),
            Message::Reset { fresh, done } => {
                // The caller waits on `done`; if it gave up, nobody needs the answer.
                let _ = done.send(core.replace_queue_pairs(fresh));
            }
            Message::Stop => return false,
        }
        true
    }

    fn run(memory: Arc<QueueMemory>, mut core: CpuExecutor, receiver: Receiver<Message>, failure: Arc<Failure>) {
        loop {
            // Take every IOCB handed over since the last round.
            loop {
                match receiver.try_recv() {
                    Ok(message) => {
                        if !Self::handle(&mut core, message) {
                            return;
                        }
                    }
                    Err(TryRecvError::Disconnected) => return,
                    Err(TryRecvError::Empty) => break,
                }
            }
            if let Err(error) = core.poll(&memory) {
                tracing::error!("gio-uring CPU worker: {error}");
                failure.record(&error);
            }
            if core.has_pending() || core.in_flight() > 0 {
                std::thread::yield_now();
                continue;
            }
            // Idle: block until work arrives, bounded so that a lost wake-up cannot stall it.
            match receiver.recv_timeout(IDLE_WAIT) {
                Ok(message) => {
                    if !Self::handle(&mut core, message) {
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

    fn attach(&mut self, memory: &Arc<QueueMemory>) -> Result<(), GioError> {
        // A worker receives an IOCB only if it owns some of its IOCTXs, so the IOCB cannot complete
        // (and be reissued) before that worker took the message: the depth bounds each channel.
        // Twice the depth leaves slack.
        let capacity = self.depth as usize * 2;
        let config = memory.layout.config;
        let ioctx_index = Arc::new(IoctxIndex::new(config.depth, config.ioctx_per_iocb_max, self.counts.len()));
        self.index = Some(Arc::clone(&ioctx_index));
        self.dealt_to = vec![0; config.ioctx_per_iocb_max as usize];
        self.built_for_budget = vec![0; config.depth as usize];
        for (index, queues) in std::mem::take(&mut self.assignments).into_iter().enumerate() {
            let (sender, receiver) = mpsc::sync_channel(capacity);
            let core = CpuExecutor::for_devices(queues, self.depth, Some((Arc::clone(&ioctx_index), index)));
            let memory = Arc::clone(memory);
            let failure = Arc::clone(&self.failure);
            let thread = std::thread::Builder::new()
                .name(format!("gio-cpu-{index}"))
                .spawn(move || Self::run(memory, core, receiver, failure))
                .map_err(|error| GioError::Executor { executor: "cpu-workers", reason: format!("spawn: {error}") })?;
            self.workers.push(Worker { sender, thread: Some(thread) });
        }
        Ok(())
    }

    fn prepared(&mut self, _memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
        // Refilled: its IOCTXs (and their devices) may have changed; deal them at the next issue.
        let built = self
            .built_for_budget
            .get_mut(id.0 as usize)
            .ok_or_else(|| GioError::Executor { executor: "cpu-workers", reason: format!("{id} is outside the pool (not attached?)") })?;
        *built = 0;
        Ok(())
    }

    fn submit(&mut self, memory: &QueueMemory, batch: &IssueBatch) -> Result<(), GioError> {
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
        let budget = batch.sm_budget.0;
        for _ in 0..batch.count {
            let Some(id) = consumer.next() else { break };
            if id.0 >= memory.layout.config.depth {
                return Err(GioError::Executor { executor: "cpu-workers", reason: format!("SQ names {id}, outside the pool") });
            }
            let header = memory.read_iocb_header(id);
            if self.built_for_budget[id.0 as usize] != budget {
                // The IOCB's previous issue has completed: no worker reads its group any more.
                self.deal(memory, &header, budget as usize)?;
                ioctx_index.build(id, &self.dealt_to[..header.ioctx_count as usize], &mut self.counts);
                self.built_for_budget[id.0 as usize] = budget;
            }
            for (index, worker) in self.workers.iter().enumerate() {
                if ioctx_index.range(id, index).1 == 0 {
                    continue; // dealt none of this IOCB's IOCTXs
                }
                worker.sender.try_send(Message::Iocb(header)).map_err(|error| GioError::Executor {
                    executor: "cpu-workers",
                    reason: match error {
                        TrySendError::Full(_) => format!("worker {index} is {} IOCBs behind", self.depth * 2),
                        TrySendError::Disconnected(_) => format!("worker {index} has stopped"),
                    },
                })?;
            }
        }
        Ok(())
    }

    fn poll(&mut self, _memory: &QueueMemory) -> Result<(), GioError> {
        match self.failure.reason() {
            Some(reason) => Err(GioError::Executor { executor: "cpu-workers", reason }),
            None => Ok(()),
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
            match worker.sender.send(Message::Reset { fresh, done }) {
                Ok(()) => replies.push((index, reply)),
                Err(_) => {
                    failure.get_or_insert(GioError::Executor { executor: "cpu-workers", reason: format!("worker {index} has stopped") });
                }
            }
        }
        for (index, reply) in replies {
            let outcome = match reply.recv_timeout(RESET_TIMEOUT) {
                Ok(outcome) => outcome,
                Err(RecvTimeoutError::Timeout) => Err(GioError::Executor {
                    executor: "cpu-workers",
                    reason: format!(
                        "worker {index} did not replace its queue pairs within {} s (a later reset hears of any deletion it could not do)",
                        RESET_TIMEOUT.as_secs()
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
        if let Some(error) = failure {
            return Err(error);
        }
        crate::cpu_executor::finish_issued_as_timeout(memory)
    }
}

impl Drop for CpuWorkers {
    fn drop(&mut self) {
        for worker in &self.workers {
            // A worker that already stopped has dropped its receiver; nothing to tell it.
            let _ = worker.sender.send(Message::Stop);
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

    #[test]
    fn poll_does_not_take_the_failure_lock_while_healthy() {
        // Goal: the steady-state poll reads a flag, not the mutex: with the lock held elsewhere
        // (as by a worker recording an error) a poll of a healthy executor returns at once.
        let mut workers = CpuWorkers::new(0, Vec::new(), 4).expect("no devices is a valid executor");
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
    }
}
