//! The CPU executor: plays the I/O kernel's part on the CPU, with the same records and the same
//! completion protocol, over the NVMe driver's I/O queue pairs (crates/nvme-driver). It runs on
//! the software controller, on VFIO devices, anywhere the driver runs.
//!
//! Shape: one executor owns one I/O queue pair per device of the queue's [`DeviceTable`] (same
//! index) and is driven by its caller — `submit` only takes the IOCB ids off the SQ (O(IOCBs), like
//! a kernel launch); `poll` turns pending IOCTXs into NVMe commands as far as the device queues
//! have room, reaps completions and posts gio CQEs. `GioQueue::wait_cqe`, `peek_cqe` and
//! `reap_cqe` call `poll`. Each IOCTX is
//! one command built directly from the IOCTX (no planning, no splitting: the IOCTX already names its
//! data pointer), so a command costs a few field copies. Per batch there is one SQ doorbell per
//! device touched and one CQ doorbell per reap.
//!
//! With worker threads, each owning the queue pairs of some devices, see [`crate::cpu_workers`];
//! each worker runs one of these executors over its own devices.
//!
//! [`DeviceTable`]: crate::validate::DeviceTable

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use nvme_driver::spec::command::DataPointerKind;
use nvme_driver::spec::{NvmeStatus as DriverStatus, SubmissionEntry};
use nvme_driver::{IoQueuePair, NamespaceId};

use crate::abi::{self, NvmeStatus, Opcode};
use crate::error::GioError;
use crate::executor::{complete_ioctx, post_cqe_or_keep, repost_kept_cqes, Executor, IssueBatch};
use crate::ioctx_index::IoctxIndex;
use crate::layout::{FilledLines, IocbHeader, QueueMemory};
use crate::ring::Ring;
use crate::types::{IocbId, LayerIndex};

/// An IOCB accepted from the SQ whose IOCTXs are not all submitted yet: positions
/// `next..end` are left (IOCTX indices, or with a worker index, positions in its group).
#[derive(Debug, Clone, Copy)]
struct Pending {
    header: IocbHeader,
    next: u32,
    end: u32,
}

/// See the module documentation.
#[derive(Debug)]
pub struct CpuExecutor {
    /// Indexed by device index; `None`: the device belongs to another worker (see `cpu_workers`).
    queues: Vec<Option<IoQueuePair>>,
    /// Bounded by the gio queue depth (each IOCB is in flight at most once); reserved up front.
    pending: VecDeque<Pending>,
    /// Whether a device's SQ holds entries not yet announced by a doorbell.
    doorbell_due: Vec<bool>,
    /// Worker mode: the IOCTX index built at fill time and this worker's number in it.
    index: Option<(Arc<IoctxIndex>, usize)>,
    /// (device, old queue pair) whose deletion failed in a reset: retried by the next one, and
    /// reaped by every poll meanwhile (its completions count for the issues in flight).
    undeleted: Vec<(usize, IoQueuePair)>,
    /// Per device: its pair's controller was reset (the driver answers `QueueStale`). Reported
    /// once; from then on the pair is not reaped and its IOCTXs are held back, like a failed
    /// pair's, until a reset installs a fresh one.
    stale: Vec<bool>,
    /// `retire_queue_pairs` ran: no queue pair is left, and an issue ends at once.
    retired: bool,
    /// The queue's memory, kept by `attach`, so that `retire_queue_pairs` can end the IOCBs
    /// still issued. `None` in worker mode (a worker's pairs are not all of them: `CpuWorkers`
    /// ends the IOCBs once every worker's are deleted).
    memory: Option<Arc<QueueMemory>>,
    /// Line 0 of each IOCB as validated by `fill_iocb` (recorded by `prepared`): what `submit`
    /// builds commands from. Unused in worker mode (the dealing thread holds it).
    filled: FilledLines,
    /// Per IOCB, line 0 of its issue in flight as this executor accepted it: what completions
    /// are counted against (never line 0 re-read from shared memory).
    issued: Vec<Option<IocbHeader>>,
    /// The last submit pass left pending only IOCTXs held for failed or stale pairs (it was
    /// not stopped by a full queue), and nothing was accepted since: polling again cannot
    /// submit any of them until a reset.
    pending_held_only: bool,
    /// Per device: a doorbell write of its pair failed with an error other than `QueueStale`,
    /// and that was reported. The doorbell is rung again by every pump, but the fault is not
    /// reported again until a ring succeeds or a reset installs a fresh pair: the driver's only
    /// such error (a shadow doorbell slot out of reach) lasts as long as the pair, and reporting
    /// it from every poll failed every wait on every device at once, so none timed out and the
    /// reset that replaces the pair never ran.
    doorbell_fault_reported: Vec<bool>,
    /// Tests only, per device: this many next doorbell rings fail without writing anything, as
    /// one whose shadow doorbell slot is out of reach would (the driver's only error other than
    /// `QueueStale`, which no software controller can cause).
    #[cfg(test)]
    failing_doorbells: Vec<u32>,
}

fn device_error(device: usize, error: nvme_driver::NvmeError) -> GioError {
    GioError::Executor { executor: "cpu", reason: format!("device {device}: {error}") }
}

/// Records a device's error in a pass over the devices: the first one is what the pass
/// returns; a pair made stale by its controller's reset is marked (held back from then on).
fn note_device_error(stale: &mut [bool], first_error: &mut Option<GioError>, device: usize, error: nvme_driver::NvmeError) {
    stale[device] |= matches!(error, nvme_driver::NvmeError::QueueStale { .. });
    first_error.get_or_insert(device_error(device, error));
}

/// Line 0 of issued IOCB `id` as `fill_iocb` validated it, with the issue's layer and sequence
/// number ([`FilledLines::issued`]), the issue taken and noted as consumed
/// ([`FilledLines::take`]). An SQ entry naming an IOCB that is not ISSUED, whose issue is in
/// flight here already, or that the queue gave no new issue since the last taken, is no issue
/// of it (another agent rewrote the entry): it is skipped,
/// nothing of that IOCB is touched, the error goes to `refused` and `None` comes back. When the
/// shared line was overwritten, nothing of the IOCB runs: it ends now with its CQE (carrying
/// the issue's own sequence number, never the shared one, so the queue takes it), the error
/// goes to `refused` (the first one is what the issue returns) and `None` comes back. `who`
/// names the executor in the log.
pub(crate) fn issued_header_or_end(
    memory: &QueueMemory,
    filled: &mut FilledLines,
    id: IocbId,
    layer: LayerIndex,
    who: &str,
    refused: &mut Option<GioError>,
) -> Option<IocbHeader> {
    let header = filled.issued(memory, id, layer);
    let issue_seq = match filled.take(memory, id) {
        Ok(issue_seq) => issue_seq,
        Err(error) => {
            refused.get_or_insert(error);
            return None;
        }
    };
    match header {
        Ok(header) => Some(header),
        Err(error) => {
            if let Err(posting) = finish_issue_as_timeout(memory, id, issue_seq) {
                tracing::error!(%id, %posting, "gio-uring {who}: ending an IOCB with a corrupt line 0");
            }
            refused.get_or_insert(error);
            None
        }
    }
}

/// The tag of an NVMe command: which IOCTX of which issue of which IOCB it carries, as
/// IOCB id (16 bits) | issue sequence number (all 32 bits) | IOCTX index (16 bits). The id fits:
/// a pool holds at most `GIO_RING_DEPTH_MAX` (2^16) IOCBs; so does the index, below
/// `abi::MAX_IOCTX_PER_IOCB` (2048). The whole sequence number, so a late completion of any
/// earlier issue (not only one less than 2^16 issues back) is told from the issue in flight.
/// [`crate::executor::LENT_COMMAND_TAG`] (all ones) decodes to IOCTX index 0xFFFF, which no
/// IOCB has: refused whatever the depth (and `finish_command` tells it apart before decoding).
fn tag(id: IocbId, issue_seq: u32, ioctx_index: u32) -> u64 {
    u64::from(id.0 & 0xFFFF) << 48 | u64::from(issue_seq) << 16 | u64::from(ioctx_index & 0xFFFF)
}

const _: () = assert!(abi::GIO_RING_DEPTH_MAX <= 1 << 16 && abi::MAX_IOCTX_PER_IOCB < 0xFFFF, "tags hold 16-bit ids and indices");

/// (IOCB, issue sequence number, IOCTX index) of a [`tag`].
fn untag(tag: u64) -> (IocbId, u32, u32) {
    (IocbId((tag >> 48) as u32), (tag >> 16) as u32, tag as u32 & 0xFFFF)
}

/// The driver's status in the CQE status-field layout of the ABI (phase bit clear).
fn abi_status(status: DriverStatus) -> NvmeStatus {
    let mut field = NvmeStatus::new(status.code_type.as_u8(), status.code).0;
    if status.more {
        field |= 1 << 14;
    }
    if status.do_not_retry {
        field |= 1 << 15;
    }
    NvmeStatus(field)
}

impl CpuExecutor {
    /// `queues[i]` serves device index `i`. `depth` is the gio queue depth.
    pub fn new(queues: Vec<IoQueuePair>, depth: u32) -> Self {
        Self::for_devices(queues.into_iter().map(Some).collect(), depth, None)
    }

    /// An executor serving only the devices whose slot is `Some`; IOCTXs for the others are left
    /// to the workers that own them. With `index`, it visits only the IOCTXs the index gives
    /// this worker.
    pub(crate) fn for_devices(queues: Vec<Option<IoQueuePair>>, depth: u32, index: Option<(Arc<IoctxIndex>, usize)>) -> Self {
        let device_count = queues.len();
        let doorbell_due = vec![false; device_count];
        let stale = vec![false; device_count];
        Self {
            queues,
            pending: VecDeque::with_capacity(depth as usize),
            doorbell_due,
            index,
            undeleted: Vec::new(),
            stale,
            retired: false,
            memory: None,
            filled: FilledLines::new(depth),
            issued: vec![None; depth as usize],
            pending_held_only: false,
            doorbell_fault_reported: vec![false; device_count],
            #[cfg(test)]
            failing_doorbells: vec![0; device_count],
        }
    }

    /// Takes an IOCB another thread consumed from the SQ (worker mode).
    pub(crate) fn accept(&mut self, header: IocbHeader) {
        match self.issued.get_mut(header.id as usize) {
            Some(slot) => *slot = Some(header),
            // Only with a depth below the queue's: its completions are then refused as naming
            // no IOCB issued here, and the IOCB waits for a reset.
            None => tracing::error!(id = header.id, "gio-uring CPU executor: an IOCB outside the depth it was built for"),
        }
        let (next, len) = match &self.index {
            Some((index, worker)) => index.range(IocbId(header.id), *worker),
            None => (0, header.ioctx_count),
        };
        self.pending.push_back(Pending { header, next, end: next + len });
        self.pending_held_only = false;
    }

    /// Whether IOCTXs are still waiting for room in a device queue.
    pub(crate) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Whether polling again can make progress without a message from outside: commands in
    /// flight on a pair that is reaped (neither failed nor stale), or IOCTXs pending that a pair
    /// may take (accepted since the last submit pass, or left by a pass that a full queue
    /// stopped). A failed or stale pair's commands are never reaped and its IOCTXs stay pending
    /// until a reset replaces it, so a worker whose only work is held that way — beside idle
    /// usable pairs too — waits for its next message (the reset, new work) instead of spinning.
    pub(crate) fn can_progress(&self) -> bool {
        let in_flight_on_usable = self
            .queues
            .iter()
            .enumerate()
            .any(|(device, queue)| queue.as_ref().is_some_and(|queue| !self.stale[device] && !queue.failed() && queue.in_flight() > 0));
        in_flight_on_usable || (self.has_pending() && !self.pending_held_only)
    }

    /// Builds the NVMe command for one IOCTX at the IOCB's current layer, or `None` when the
    /// IOCTX command rule (`abi::ioctx_command`, the kernel's `gio_ioctx_command`) refuses it.
    fn command(header: &IocbHeader, ioctx: &abi::gio_ioctx) -> Option<SubmissionEntry> {
        let layer = abi::IocbLayer {
            opcode: header.opcode,
            layer: header.layer,
            lba_stride_blocks: header.lba_stride_blocks,
            mem_stride_bytes: header.mem_stride_bytes,
            desc_stride_bytes: header.desc_stride_bytes,
        };
        let command = abi::ioctx_command(&layer, ioctx)?;
        let namespace = NamespaceId(ioctx.nsid);
        let start = nvme_driver::Lba(command.lba);
        let fua = u32::from(ioctx.flags) & abi::GIO_IOCTX_FLAG_FUA != 0;
        let (data, desc) = (command.data_iova, command.desc_iova);
        let mut entry = match command.opcode {
            Opcode::Read => SubmissionEntry::read(namespace, start, command.block_count),
            Opcode::Write => SubmissionEntry::write(namespace, start, command.block_count, fua),
        };
        match command.descriptor_kind {
            abi::DescriptorKind::Sgl => {
                entry.set_data_pointer_kind(DataPointerKind::Sgl);
                // SGL descriptor: address, then length (bits 31:0) and identifier (bits 63:56).
                let (address, length, identifier) = if desc == 0 {
                    (data, ioctx.data_bytes, 0x00u64) // Data Block, address sub type
                } else {
                    (desc, ioctx.desc_bytes, 0x30u64) // Last Segment, address sub type
                };
                entry.dptr = [address, u64::from(length) | identifier << 56];
            }
            abi::DescriptorKind::Prp => {
                entry.set_data_pointer_kind(DataPointerKind::Prp);
                entry.dptr = [data, desc];
            }
        }
        Some(entry)
    }

    /// Submits as many pending IOCTXs as the device queues take, in IOCB order, then rings each
    /// touched device's doorbell once. A full device queue stops the pass (back-pressure, FIFO:
    /// retried on the next poll, in order). A device whose pair takes no command until a reset
    /// (failed by a completion, or stale after its controller was reset) holds back only its
    /// own IOCTXs: the IOCB waiting on one keeps its place and the pass goes on with the next.
    /// Every device is served before an error is returned (the first one seen).
    fn pump(&mut self, memory: &QueueMemory) -> Result<(), GioError> {
        let mut first_error = None;
        let mut position = 0;
        // Whatever this pass leaves pending is held, unless a full queue stops it (below).
        self.pending_held_only = true;
        'iocbs: while let Some(pending) = self.pending.get_mut(position) {
            let header = pending.header;
            let id = IocbId(header.id);
            while pending.next < pending.end {
                let index = match &self.index {
                    Some((ioctx_index, _)) => ioctx_index.ioctx_at(id, pending.next),
                    None => pending.next,
                };
                let ioctx = memory.read_ioctx(header.ioctx_first + index);
                let device = usize::from(ioctx.device_index);
                let command = Self::command(&header, &ioctx);
                let (Some(Some(queue)), Some(command)) = (self.queues.get_mut(device), command) else {
                    // Validation at fill time makes this unreachable unless shared memory was
                    // changed behind the queue's back, or the queue pairs were retired: fail
                    // the IOCTX, never guess. In worker mode too: the index gives this worker
                    // only IOCTXs dealt to it for a device it serves, so a record naming
                    // another worker's device was rewritten since the dealing; skipping it
                    // would leave it uncounted (no worker runs it) and the IOCB in flight
                    // until its caller's deadline, with no error naming the cause.
                    let status = Err((abi::GIO_IOCB_STATUS_INVALID_IOCTX, NvmeStatus::SUCCESS));
                    if let Some(cqe) = complete_ioctx(memory, id, index, header.issue_seq, status) {
                        if let Err(error) = post_cqe_or_keep(memory, cqe) {
                            first_error.get_or_insert(error);
                        }
                    }
                    pending.next += 1;
                    continue;
                };
                // A failed pair (a completion broke the queue protocol; reported once, by the
                // reap that saw it) or a stale one (its controller was reset; reported once)
                // takes no command: what is pending for it waits, so that the caller's wait
                // times out and its reset (the pair deleted, then the IOCBs still issued ended
                // as TIMEOUT) recovers, rather than every later poll failing with the same
                // error. IOCTXs for other devices go on.
                if self.stale[device] || queue.failed() {
                    position += 1;
                    continue 'iocbs;
                }
                if queue.free_slots() == 0 {
                    self.pending_held_only = false;
                    break 'iocbs; // back-pressure: retried on the next poll, in order
                }
                if let Err(error) = queue.submit_raw(command, tag(id, header.issue_seq, index)) {
                    note_device_error(&mut self.stale, &mut first_error, device, error);
                    position += 1; // held in place, like a pair that takes no command
                    continue 'iocbs;
                }
                self.doorbell_due[device] = true;
                pending.next += 1;
            }
            // Bounded by the depth, and only once per IOCB: no allocation.
            self.pending.remove(position);
        }
        for device in 0..self.queues.len() {
            if std::mem::take(&mut self.doorbell_due[device]) {
                // Fails with QueueStale only for a pair whose controller was reset before this
                // batch's tail went out (the driver answers Ok once the tail is written, even
                // if a reset begins right after). Either way the IOCBs submitted stay in flight
                // here: only `reset`, once the old pair's deletion succeeded, ends them.
                let Some(rung) = self.ring_doorbell(device) else { continue };
                match rung {
                    Ok(()) => self.doorbell_fault_reported[device] = false,
                    Err(error @ nvme_driver::NvmeError::QueueStale { .. }) => {
                        note_device_error(&mut self.stale, &mut first_error, device, error)
                    }
                    Err(error) => {
                        // Any error but QueueStale (a pair held until a reset) says nothing
                        // about whether the tail went out, and the driver keeps it pending: ring
                        // again at the next pump (a repeat is harmless), or nothing would
                        // announce these commands until the caller's reset. A passing fault
                        // then costs no reset. Reported once per pair: a lasting one (the
                        // driver's only such error is fixed when the pair is created) would
                        // otherwise fail every poll, so every wait, on every device, would
                        // return it at once and none would time out, and the caller's reset,
                        // which replaces the pair, would never run.
                        self.doorbell_due[device] = true;
                        if !std::mem::replace(&mut self.doorbell_fault_reported[device], true) {
                            note_device_error(&mut self.stale, &mut first_error, device, error);
                        }
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl CpuExecutor {
    /// Rings the doorbell of the pair serving `device`; `None` when none does here. Tests make
    /// it fail on demand (`failing_doorbells`).
    fn ring_doorbell(&mut self, device: usize) -> Option<Result<(), nvme_driver::NvmeError>> {
        let queue = self.queues.get_mut(device)?.as_mut()?;
        #[cfg(test)]
        if let Some(left) = self.failing_doorbells[device].checked_sub(1) {
            self.failing_doorbells[device] = left;
            let error = nvme_driver::hw::HwError::OutOfRange { offset: 0, access_len: 4, region_len: 0 };
            return Some(Err(nvme_driver::NvmeError::from(error)));
        }
        Some(queue.ring_doorbell())
    }

    /// Recovers from lost completions (after `wait_cqe` timed out): replaces every queue pair
    /// with one from `fresh` (same order as the devices this executor serves) and returns how
    /// many IOCBs it reclaimed.
    ///
    /// The old queue pairs are deleted on their controllers first: the controller aborts or
    /// finishes what they held, so no command of theirs can move data or complete afterwards.
    /// Only then is every IOCB still in flight finished as TIMEOUT (the same compare-and-swap as
    /// a normal completion, so one CQE per issue) and made reissuable. IOCBs whose IOCTXs were
    /// never submitted are reclaimed too; the caller reissues whatever it still needs.
    ///
    /// If a deletion fails (each is bounded by the controller's admin timeout), nothing is
    /// reclaimed: the fresh pairs are in place, but the IOCBs stay in flight, because the old
    /// commands may still move data. The failed pair is kept and its deletion retried by the
    /// next reset, which reclaims only once it succeeds (or the controller was reset).
    pub fn reset(&mut self, memory: &QueueMemory, fresh: Vec<IoQueuePair>) -> Result<usize, GioError> {
        self.replace_queue_pairs(fresh)?;
        Ok(finish_issued_as_timeout(memory, &mut self.filled))
    }

    /// The first half of [`CpuExecutor::reset`]: deletes the old queue pairs, installs `fresh`
    /// and forgets every IOCTX not yet submitted. Also run by each worker of `CpuWorkers`.
    ///
    /// A pair whose deletion fails is kept (its rings stay allocated: late completions cannot
    /// land in reused memory) and its deletion is retried by the next reset; until one succeeds,
    /// or its controller is reset, every reset returns an error, so no IOCB is reclaimed while
    /// the old commands may still move data.
    pub(crate) fn replace_queue_pairs(&mut self, fresh: Vec<IoQueuePair>) -> Result<(), GioError> {
        let served = self.queues.iter().filter(|queue| queue.is_some()).count();
        if fresh.len() != served {
            return Err(GioError::InvalidConfig { reason: format!("reset needs {served} fresh queue pairs, got {}", fresh.len()) });
        }
        let mut failure = None;
        let mut delete = |device: usize, pair: IoQueuePair, undeleted: &mut Vec<(usize, IoQueuePair)>| {
            if let Err(error) = pair.delete() {
                failure.get_or_insert(GioError::Nvme {
                    context: format!(
                        "deleting device {device}'s old queue pair during reset (its commands may still move data: nothing is reclaimed \
                         until a later reset deletes it or the controller is reset)"
                    ),
                    source: error.source,
                });
                undeleted.push((device, *error.pair));
            }
        };
        let mut undeleted = Vec::new();
        for (device, pair) in std::mem::take(&mut self.undeleted) {
            delete(device, pair, &mut undeleted);
        }
        let mut fresh = fresh.into_iter();
        for (device, slot) in self.queues.iter_mut().enumerate().filter(|(_, queue)| queue.is_some()) {
            let old = std::mem::replace(slot, fresh.next()).expect("served slots hold a queue pair");
            delete(device, old, &mut undeleted);
        }
        self.undeleted = undeleted;
        self.pending.clear();
        self.doorbell_due.iter_mut().for_each(|due| *due = false);
        self.doorbell_fault_reported.iter_mut().for_each(|reported| *reported = false);
        self.stale.iter_mut().for_each(|stale| *stale = false);
        failure.map_or(Ok(()), Err)
    }
}

/// How long a retirement waits, in all, for the commands still in flight on its attached pairs
/// (`IoQueuePair::attach`) to complete: such a pair cannot delete its queues and says it is
/// deleted only once none of its commands is in flight, which only reaping lowers. One deadline
/// serves every pair of the retirement (they are waited for one after the other, each reaped
/// at least once), so a retirement never waits longer than this, however many pairs are stuck.
/// A command that does not complete within it (a lost completion, which only the end of the
/// daemon's session can settle) leaves its pair undeleted, and the caller keeps the memory it
/// names.
pub(crate) const ATTACHED_RETIRE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl CpuExecutor {
    /// The first half of `retire_queue_pairs`, also run by each worker of `CpuWorkers` on its
    /// thread: deletes every queue pair held (those kept from a failed deletion too) and says
    /// whether all are known gone; afterwards nothing is pending and every issue ends at once.
    ///
    /// With the queue's `memory`, each pair is reaped first, its completions counted as usual
    /// (they belong to the issues in flight, whose CQEs go out): an attached pair is deleted
    /// only when none of its commands is in flight, so one whose last completion arrived but
    /// was not reaped was never deleted. The attached pairs that still hold commands are then
    /// waited for until one deadline, [`ATTACHED_RETIRE_WAIT`] after the first deletions, and
    /// deleted again. Waiting at all is for commands that are merely slow: the daemon's
    /// controller still runs them while the connection is open, and each that completes in
    /// time saves the caller from keeping its memory for good. A controller's own pair needs
    /// no wait: deleting it aborts or finishes what it holds.
    pub(crate) fn retire_pairs(&mut self, memory: Option<&QueueMemory>) -> bool {
        let mut retiring = std::mem::take(&mut self.undeleted);
        retiring.extend(self.queues.iter_mut().enumerate().filter_map(|(device, slot)| slot.take().map(|pair| (device, pair))));
        let mut posting = Ok(());
        // Attached pairs with commands in flight, waited for below.
        let mut busy = Vec::new();
        for (device, mut pair) in retiring {
            if let Some(memory) = memory {
                let depth = pair.depth() as usize;
                if let Err(error) = pair.reap(depth, |completion| finish_command(memory, &self.issued, completion, &mut posting)) {
                    tracing::warn!(device, %error, "gio-uring CPU executor teardown: reaping a queue pair before its deletion");
                }
            }
            match (pair.delete(), memory) {
                (Ok(()), _) => {}
                // Only an attached pair with commands in flight answers Unsupported.
                (Err(undeleted), Some(_)) if matches!(undeleted.source, nvme_driver::NvmeError::Unsupported { .. }) => {
                    busy.push((device, *undeleted.pair));
                }
                (Err(error), _) => {
                    tracing::error!(device, source = %error.source, "gio-uring CPU executor teardown: a queue pair could not be deleted");
                    self.undeleted.push((device, *error.pair));
                }
            }
        }
        if let (Some(memory), false) = (memory, busy.is_empty()) {
            let deadline = Instant::now() + ATTACHED_RETIRE_WAIT;
            for (device, mut pair) in busy {
                // Past the deadline, the wait still reaps once: what completed meanwhile counts.
                if let Err(error) = pair.wait_idle(deadline, |completion| finish_command(memory, &self.issued, completion, &mut posting)) {
                    tracing::warn!(device, %error, "gio-uring CPU executor teardown: an attached pair's commands did not all complete");
                }
                if let Err(error) = pair.delete() {
                    tracing::error!(device, source = %error.source, "gio-uring CPU executor teardown: a queue pair could not be deleted");
                    self.undeleted.push((device, *error.pair));
                }
            }
        }
        if let Err(error) = posting {
            tracing::error!(%error, "gio-uring CPU executor teardown: a completion reaped before the deletion");
        }
        self.pending.clear();
        self.retired = true;
        self.undeleted.is_empty()
    }
}

/// The second half of a reset, once no old command can complete: every IOCB still ISSUED ends
/// as TIMEOUT with one CQE (the compare-and-swap of a normal completion). Returns how many.
/// Each CQE carries the issue's sequence number as `filled` knows it
/// ([`FilledLines::timeout_seq`]), not line 0's, which another agent may have rewritten.
///
/// First the SQ head moves past any entries still on it: a CPU executor takes a batch off the
/// SQ inside `submit`, so an entry left there belongs to a submit that failed before it took
/// it, and names an IOCB that is ISSUED (ended here) or already ended. An SQ whose header is
/// corrupt is logged and left as it is: the IOCBs are ended all the same (no command of theirs
/// can complete any more), and the queue's next issue reports the SQ.
///
/// Never fails. A CQE that cannot be posted yet (the CQ producer lock held past its bound)
/// does not fail the reset: its IOCB has ended, the CQE is kept and the next poll posts it
/// (reporting the error again while it still cannot). Callers read an error of a reset as "a
/// queue pair cannot be deleted: reset the controller", which a busy CQ or a corrupt SQ is
/// not; they are logged here instead.
pub(crate) fn finish_issued_as_timeout(memory: &QueueMemory, filled: &mut FilledLines) -> usize {
    match Ring::<IocbId>::new(&memory.region, memory.layout.sq, "sq").consumer() {
        Ok(consumer) => {
            let dropped = consumer.count();
            if dropped > 0 {
                tracing::warn!(dropped, "gio-uring CPU executor reset: SQ entries no submit took were dropped");
            }
        }
        Err(error) => tracing::error!(%error, "gio-uring CPU executor reset: the SQ is corrupt and was left as it is"),
    }
    let mut reclaimed = 0;
    let mut kept = 0;
    let mut first_error = None;
    for id in (0..memory.layout.config.depth).map(IocbId) {
        // Read before the end clears it; cleared below either way: no command of it can
        // complete any more, and nothing of it is pending (the reset forgot that).
        let taken = memory.issue_taken(id);
        let given = memory.issue_given(id);
        let ended = finish_as_timeout_with(memory, id, |shared| filled.timeout_seq(id, shared, taken, given));
        memory.end_issue_taken(id);
        // The IOCB is ended either way, and the IOCBs after it still are.
        match ended {
            Ok(ended) => reclaimed += usize::from(ended),
            Err(error) => {
                reclaimed += 1;
                kept += 1;
                first_error.get_or_insert(error);
            }
        }
    }
    if let Some(error) = first_error {
        tracing::warn!(kept, %error, "gio-uring CPU executor reset: TIMEOUT CQEs kept for the next poll to post");
    }
    reclaimed
}

/// Teardown, once every queue pair is deleted: ends each IOCB still ISSUED as TIMEOUT with its
/// one CQE ([`finish_issued_as_timeout`]), so nothing issued is left in flight for ever.
pub(crate) fn end_issued_after_retirement(memory: &QueueMemory, filled: &mut FilledLines, who: &str) {
    match finish_issued_as_timeout(memory, filled) {
        0 => {}
        ended => tracing::warn!(ended, "gio-uring {who} teardown: IOCBs still issued ended as timed out"),
    }
}

/// Takes `count` entries off the SQ and ends each IOCB they name as TIMEOUT with its one CQE:
/// a batch no queue pair can run (the executor's were retired). An entry naming an IOCB not
/// ISSUED, in flight already, or given no new issue since the last taken, is skipped
/// ([`FilledLines::take`]).
pub(crate) fn end_batch_as_timeout(
    consumer: &mut crate::ring::Consumer<'_, IocbId>,
    memory: &QueueMemory,
    filled: &mut FilledLines,
    count: u32,
) {
    for _ in 0..count {
        let Some(id) = consumer.next() else { break };
        let issue_seq = match filled.take(memory, id) {
            Ok(issue_seq) => issue_seq,
            Err(error) => {
                tracing::warn!(%id, %error, "gio-uring CPU executor: an SQ entry of a batch no queue pair can run");
                continue; // no issue of it: there is nothing to end
            }
        };
        if let Err(error) = finish_issue_as_timeout(memory, id, issue_seq) {
            tracing::error!(%id, %error, "gio-uring CPU executor: ending an IOCB of a batch no queue pair can run");
        }
    }
}

/// [`finish_as_timeout_with`] for an issue just taken, none of whose commands was sent: its
/// CQE carries `issue_seq` (from [`FilledLines::take`]), or line 0's for an IOCB never filled
/// on this queue (`None`). The issue is no longer taken afterwards, even if another agent moved
/// its status off ISSUED first (nothing of it runs).
pub(crate) fn finish_issue_as_timeout(memory: &QueueMemory, id: IocbId, issue_seq: Option<u32>) -> Result<bool, GioError> {
    let ended = finish_as_timeout_with(memory, id, |shared| issue_seq.unwrap_or(shared));
    memory.end_issue_taken(id);
    ended
}

/// Ends IOCB `id` as TIMEOUT with one CQE if it is still ISSUED (the compare-and-swap of a
/// normal completion, so never a second CQE); `false` if it had ended already. The CQE carries
/// the sequence number `issue_seq` gives for the one line 0 holds. Only for an IOCB none of
/// whose commands can still complete: none was sent, or its queue pairs were deleted. A CQE
/// that cannot be posted is kept for the next poll (`post_cqe_or_keep`): the error is
/// returned, but the IOCB has ended. Once ended, its issue is no longer taken
/// ([`QueueMemory::end_issue_taken`], before the CQE is posted).
pub(crate) fn finish_as_timeout_with(memory: &QueueMemory, id: IocbId, issue_seq: impl FnOnce(u32) -> u32) -> Result<bool, GioError> {
    let status = memory.iocb_field_offset(id, crate::layout::IocbField::Status);
    let finished = memory.region.compare_exchange_u32(
        status,
        abi::GIO_IOCB_STATUS_ISSUED,
        abi::GIO_IOCB_STATUS_TIMEOUT,
        std::sync::atomic::Ordering::AcqRel,
        std::sync::atomic::Ordering::Relaxed,
    );
    if finished.is_err() {
        return Ok(false);
    }
    let header = memory.read_iocb_header(id);
    let progress = memory.read_iocb_progress(id);
    let failed = progress.failed_ioctx != abi::GIO_NO_FAILED_IOCTX;
    let issue_seq = issue_seq(header.issue_seq);
    memory.end_issue_taken(id);
    post_cqe_or_keep(
        memory,
        crate::ring::Cqe {
            iocb_id: id,
            issue_seq,
            failed_ioctx: progress.failed_ioctx,
            status: abi::GIO_IOCB_STATUS_TIMEOUT as u16,
            failed_nvme_status: if failed { progress.failed_nvme_status } else { 0 },
        },
    )?;
    Ok(true)
}

impl crate::executor::QueuePairReset for CpuExecutor {
    fn served_queue_depths(&self) -> Vec<(usize, u32)> {
        self.queues.iter().enumerate().filter_map(|(device, queue)| queue.as_ref().map(|queue| (device, queue.depth()))).collect()
    }

    fn reset(&mut self, memory: &QueueMemory, fresh: Vec<IoQueuePair>) -> Result<usize, GioError> {
        CpuExecutor::reset(self, memory, fresh)
    }
}

impl Executor for CpuExecutor {
    fn name(&self) -> &'static str {
        "cpu"
    }

    /// One queue pair per device of the table, same index: fewer is refused.
    fn check_device_count(&self, devices: usize) -> Result<(), GioError> {
        if self.queues.len() < devices {
            return Err(GioError::InvalidConfig {
                reason: format!(
                    "the device table has {devices} devices but the CPU executor has queue pairs for {} (one per device, same index)",
                    self.queues.len()
                ),
            });
        }
        Ok(())
    }

    /// Sizes the per-IOCB tables for the queue's depth (once; nothing is allocated per I/O).
    fn attach(&mut self, memory: &Arc<QueueMemory>) -> Result<(), GioError> {
        let depth = memory.layout.config.depth;
        self.filled = FilledLines::new(depth);
        self.issued = vec![None; depth as usize];
        self.pending.reserve(depth as usize);
        self.memory = Some(Arc::clone(memory));
        Ok(())
    }

    /// Keeps the line `fill_iocb` just wrote and validated: commands are built from this copy.
    fn prepared(&mut self, memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
        self.filled.record(memory, id)
    }

    fn submit(&mut self, memory: &QueueMemory, batch: &IssueBatch) -> Result<(), GioError> {
        let ring: Ring<'_, IocbId> = Ring::new(&memory.region, memory.layout.sq, "sq");
        let mut consumer = ring.consumer()?;
        if consumer.head() != batch.sq_first || consumer.len() < batch.count {
            return Err(GioError::Executor {
                executor: "cpu",
                reason: format!("SQ at {} with {} entries does not hold batch {batch:?}", consumer.head(), consumer.len()),
            });
        }
        if self.retired {
            // No queue pair is left to run it: the batch leaves the SQ and each IOCB ends now.
            end_batch_as_timeout(&mut consumer, memory, &mut self.filled, batch.count);
            return Err(GioError::QueuePairsRetired { executor: "cpu" });
        }
        let mut refused = None;
        for _ in 0..batch.count {
            let Some(id) = consumer.next() else { break };
            if id.0 >= memory.layout.config.depth {
                // Names no IOCB: skipped, as CpuWorkers does, so the rest of the batch is
                // taken (returning here left it on the SQ and every later submit failed). The
                // IOCB whose entry this was stays ISSUED until a reset ends it.
                refused.get_or_insert(GioError::Executor { executor: "cpu", reason: format!("SQ names {id}, outside the pool: skipped") });
                continue;
            }
            // Capacity is the depth and an IOCB is pending at most once: never reallocates.
            if let Some(header) = issued_header_or_end(memory, &mut self.filled, id, batch.layer, "CPU executor", &mut refused) {
                self.accept(header);
            }
        }
        // Commands are built on the next poll, not here: like a kernel launch, issue_io costs
        // O(IOCBs) on the caller's thread whatever the IOCTX count (wait_cqe polls at once).
        refused.map_or(Ok(()), Err)
    }

    /// Reaps every device, then pumps, even after an error: one device's error (reported
    /// once) never stops the others. Returns the first error seen.
    fn poll(&mut self, memory: &QueueMemory) -> Result<(), GioError> {
        // CQEs an earlier poll (or a reset) built but could not post go out first.
        let mut first_error = repost_kept_cqes(memory).err();
        let mut posting = Ok(());
        for (device, queue) in self.queues.iter_mut().enumerate() {
            let Some(queue) = queue else { continue };
            if self.stale[device] {
                continue; // its controller was reset: nothing to reap; reported already
            }
            let depth = queue.depth() as usize;
            if let Err(error) = queue.reap(depth, |completion| finish_command(memory, &self.issued, completion, &mut posting)) {
                note_device_error(&mut self.stale, &mut first_error, device, error);
            }
        }
        // Pairs whose deletion failed in a reset still deliver completions of the issues in
        // flight (the reset reclaimed nothing): counted as usual. An attached pair is deleted
        // only once none of its commands is in flight, which only this lowers, so without it
        // every later reset failed to delete it. Their errors are not reported here: the next
        // reset retries the deletion and reports that.
        for (device, pair) in &mut self.undeleted {
            let depth = pair.depth() as usize;
            if let Err(error) = pair.reap(depth, |completion| finish_command(memory, &self.issued, completion, &mut posting)) {
                tracing::debug!(device, %error, "gio-uring CPU executor: reaping a queue pair whose deletion failed");
            }
        }
        if let Err(error) = posting {
            first_error.get_or_insert(error);
        }
        if let Err(error) = self.pump(memory) {
            first_error.get_or_insert(error);
        }
        first_error.map_or(Ok(()), Err)
    }

    fn retire_queue_pairs(&mut self) -> Option<bool> {
        let memory = self.memory.clone();
        let all_deleted = self.retire_pairs(memory.as_deref());
        if let (true, Some(memory)) = (all_deleted, &memory) {
            // No command of this executor can complete any more: what is still issued (sent
            // or pending) would never end otherwise.
            end_issued_after_retirement(memory, &mut self.filled, "CPU executor");
        }
        Some(all_deleted)
    }

    fn lend_queue_pair(&mut self, memory: &QueueMemory, device: usize, deadline: Instant) -> Result<Option<&mut IoQueuePair>, GioError> {
        if !matches!(self.queues.get(device), Some(Some(_))) {
            return Ok(None);
        }
        // `pump` rings before it returns, but a ring that failed (other than stale) leaves its
        // commands unannounced until the next pump's: they would never complete here, and the
        // wait below would last until `deadline` and fail with a timeout naming no doorbell.
        // Ring first; a failure is the lend's error. The executor's state is left as it was, so
        // that the queue's caller, whose IOCBs are on this pair, hears of it too: the borrower
        // is another. A fault other than stale is reported by the next pump's ring unless it was
        // already (`doorbell_fault_reported`). A stale pair is not marked here: polls skip a
        // marked pair as reported already, so its IOCBs would only time out, no cause stated;
        // unmarked, the next poll's reap hears QueueStale (the driver refuses every operation
        // of the pair from its controller's reset on), reports it and marks the pair.
        if self.doorbell_due[device] {
            match self.ring_doorbell(device) {
                Some(Err(error)) => {
                    let reason = format!("device {device}: ringing the doorbell to lend the queue pair: {error}");
                    return Err(GioError::Executor { executor: "cpu", reason });
                }
                Some(Ok(())) | None => {
                    self.doorbell_due[device] = false;
                    self.doorbell_fault_reported[device] = false;
                }
            }
        }
        let Some(Some(queue)) = self.queues.get_mut(device) else { return Ok(None) };
        // Everything submitted is announced now: wait for it.
        let mut posting = Ok(());
        let issued = &self.issued;
        queue.wait_idle(deadline, |completion| finish_command(memory, issued, completion, &mut posting)).map_err(|error| {
            GioError::Executor { executor: "cpu", reason: format!("device {device}: emptying the queue pair to lend it: {error}") }
        })?;
        posting?;
        Ok(Some(queue))
    }
}

/// Accounts one NVMe completion to its IOCTX and posts the IOCB's CQE if it was the last. A
/// borrower's [`crate::executor::LENT_COMMAND_TAG`] (told apart before the tag is decoded: all
/// ones decodes to IOCB 65535, which a pool of depth 2^16 has), a tag naming no IOCB (garbage),
/// or another issue than the one in flight, or no IOCTX of it, is an error and is not counted.
///
/// The IOCB's issue sequence number comes from `issued`, the line this executor accepted for
/// the issue, not from shared memory, and the IOCTXs left are counted in host memory
/// ([`complete_ioctx`]): neither a rewritten line 0 nor a rewritten line 1 can make the IOCB end
/// while some of its commands still move data. The tag carries the issue's sequence number, so
/// a completion of an earlier issue that arrives after a reissue is never counted for it.
fn finish_command(
    memory: &QueueMemory,
    issued: &[Option<IocbHeader>],
    completion: nvme_driver::Completion,
    posting: &mut Result<(), GioError>,
) {
    if completion.tag == crate::executor::LENT_COMMAND_TAG {
        // Not counted: it names no IOCB (its IOCTX index, 0xFFFF, is no IOCB's).
        *posting = Err(GioError::Executor {
            executor: "cpu",
            reason: "a borrower's command (tag LENT_COMMAND_TAG, on a queue pair this executor lent) completed after it was \
                     given back: it names no IOCB, not counted"
                .into(),
        });
        return;
    }
    let (id, issue_seq, index) = untag(completion.tag);
    let Some(header) = issued.get(id.0 as usize).copied().flatten() else {
        // Not counted: an IOCB this executor issued waits for a reset, which ends it as timed out.
        *posting = Err(GioError::Executor {
            executor: "cpu",
            reason: format!("completion tag {:#x} names no IOCB issued to this executor", completion.tag),
        });
        return;
    };
    if issue_seq != header.issue_seq || index >= header.ioctx_count {
        // Not counted: the issue in flight still waits for its own completions (or a reset).
        *posting = Err(GioError::Executor {
            executor: "cpu",
            reason: format!(
                "completion tag {:#x} names IOCTX {index} of issue {issue_seq} of {id}, not one of its issue in flight ({}, {} \
                 IOCTXs): not counted",
                completion.tag, header.issue_seq, header.ioctx_count
            ),
        });
        return;
    }
    let status = completion.status.map_err(|status| (abi::GIO_IOCB_STATUS_NVME_ERROR, abi_status(status)));
    if let Some(cqe) = complete_ioctx(memory, id, index, header.issue_seq, status) {
        if let Err(error) = post_cqe_or_keep(memory, cqe) {
            *posting = Err(error);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme_driver::spec::StatusCodeType;

    #[test]
    fn an_iocb_whose_line_0_was_overwritten_is_refused_with_an_error_not_a_panic() {
        // Goal: the executor reads line 0 of an IOCB back from shared memory, so it checks it:
        // an id that is not the SQ entry's (999: outside the pool) is a typed error of the
        // issue, never a panic, and the IOCB still ends once (as timed out).
        use crate::executor::test_double::{queue_with_one_read, Corrupting};
        let id_field = core::mem::offset_of!(abi::gio_iocb, id);
        let (mut queue, id) = queue_with_one_read(Corrupting::new(CpuExecutor::for_devices(vec![None], 4, None), IocbId(0), id_field, 999));
        let issued = queue.issue_io(&[id], crate::types::LayerIndex(0), crate::types::SmBudget(1));
        match &issued {
            Err(GioError::SubmitFailed { source, .. }) => {
                assert!(matches!(**source, GioError::CorruptIocb { field: "id", value: 999, .. }), "{source}")
            }
            other => panic!("expected a refused issue, got {other:?}"),
        }
        let ended = queue.wait_cqe(id, Instant::now() + std::time::Duration::from_secs(5)).expect("ended once");
        assert!(matches!(ended.result, Err(crate::IocbFailure::Timeout { .. })), "{:?}", ended.result);
    }

    /// A software controller with one namespace of 512-byte blocks and one I/O queue pair, a
    /// 64 KiB DMA buffer (the only registered memory) and a gio queue over `executor` holding
    /// one filled, not issued, one-block Read of two layers (the second 512 bytes on).
    /// Fields drop in order: the queue pair is deleted while the controller is up.
    struct EmuRig<E: Executor> {
        queue: crate::queue::GioQueue<E>,
        id: IocbId,
        _buffer: nvme_driver::hw::DmaRegion,
        controller: nvme_driver::Controller,
        device: Arc<nvme_emu::EmuDevice>,
    }

    /// One worker serving device 0 on `pair`: the CpuWorkers side of the tests run on both CPU
    /// executors.
    fn one_worker(pair: IoQueuePair) -> crate::CpuWorkers {
        crate::CpuWorkers::new(1, vec![vec![(crate::types::DeviceIndex(0), pair)]], 4).expect("workers")
    }

    fn emu_rig<E: Executor>(executor: impl FnOnce(IoQueuePair) -> E) -> EmuRig<E> {
        emu_rig_on_devices(1, |mut pairs| executor(pairs.remove(0)))
    }

    /// A one-pair CPU executor rig whose IOCB was issued (layer 0) and whose doorbell ring for
    /// it failed once, as a peek reported: the command sits unannounced, the ring due again.
    fn rig_whose_first_ring_failed() -> EmuRig<CpuExecutor> {
        let mut rig = emu_rig(|pair| CpuExecutor::new(vec![pair], 4));
        rig.queue.executor_mut().failing_doorbells[0] = 1;
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        assert!(rig.queue.peek_cqe().is_err(), "the poll's failed ring is reported");
        rig
    }

    /// [`emu_rig`] whose device table names the controller's namespace `devices` times, each
    /// entry served by a queue pair of its own (`executor` gets them in device order); the
    /// rig's IOCB reads from device 0.
    fn emu_rig_on_devices<E: Executor>(devices: usize, executor: impl FnOnce(Vec<IoQueuePair>) -> E) -> EmuRig<E> {
        use crate::types::{DeviceIndex, IovaRange, Lba};
        use crate::validate::{Descriptor, DeviceInfo, DeviceTable, IocbSpec, IoctxSpec, RegisteredMemory};
        let config = nvme_emu::EmuConfig::default()
            .with_backing(nvme_emu::Backing::Memory { bytes: 1 << 20 })
            .with_namespaces(vec![nvme_emu::NamespaceConfig::new(512, Some(1024))]);
        let device = nvme_emu::EmuDevice::start(config).expect("software controller");
        let backend: Arc<dyn nvme_driver::hw::DeviceBackend> = device.clone();
        let controller = nvme_driver::Controller::init(backend, nvme_driver::ControllerConfig::default()).expect("bring-up");
        let namespace = controller.namespaces()[0];
        let pairs = (0..devices).map(|_| controller.create_io_queue_pair(16).expect("I/O queue pair")).collect();
        let buffer = controller.dma().allocate(64 << 10).expect("DMA buffer");
        let info = DeviceInfo {
            nsid: namespace.id.0,
            capacity_blocks: namespace.size_blocks,
            block_bytes: namespace.block_size_bytes,
            sgl_supported: false,
        };
        let registered = RegisteredMemory::new(vec![IovaRange::new(buffer.iova(), buffer.len() as u64)]).expect("registered");
        let config = crate::layout::QueueConfig { depth: 4, ioctx_per_iocb_max: 4 };
        let mut queue =
            crate::queue::GioQueue::init_queue(config, DeviceTable::new(vec![info; devices]), registered, executor(pairs)).expect("queue");
        let id = queue.get_iocb(1, crate::types::Dependency::None).expect("IOCB")[0];
        let ioctx = IoctxSpec {
            device: DeviceIndex(0),
            nsid: namespace.id.0,
            start_lba: Lba(0),
            block_count: 1,
            data: buffer.iova(),
            descriptor: Descriptor::Prp { prp2: None },
            force_unit_access: false,
        };
        let spec = IocbSpec { layer_count: 2, lba_stride_blocks: 1, mem_stride_bytes: 512, ..IocbSpec::single(Opcode::Read, 0) };
        queue.fill_iocb(id, &spec, &[ioctx]).expect("fill");
        EmuRig { queue, id, _buffer: buffer, controller, device }
    }

    /// Another IOCB on the rig's queue, filled as the rig's own (a one-block Read of two layers
    /// from the DMA buffer), not issued.
    fn refill_like_the_rig<E: Executor>(rig: &mut EmuRig<E>) -> IocbId {
        fill_read_on(rig, 0)
    }

    /// [`refill_like_the_rig`] reading from device `device` of an [`emu_rig_on_devices`].
    fn fill_read_on<E: Executor>(rig: &mut EmuRig<E>, device: u16) -> IocbId {
        use crate::validate::{Descriptor, IocbSpec, IoctxSpec};
        let id = rig.queue.get_iocb(1, crate::types::Dependency::None).expect("IOCB")[0];
        let ioctx = IoctxSpec {
            device: crate::types::DeviceIndex(device),
            nsid: rig.controller.namespaces()[0].id.0,
            start_lba: crate::types::Lba(0),
            block_count: 1,
            data: rig._buffer.iova(),
            descriptor: Descriptor::Prp { prp2: None },
            force_unit_access: false,
        };
        let spec = IocbSpec { layer_count: 2, lba_stride_blocks: 1, mem_stride_bytes: 512, ..IocbSpec::single(Opcode::Read, 0) };
        rig.queue.fill_iocb(id, &spec, &[ioctx]).expect("fill");
        id
    }

    fn io_commands(device: &nvme_emu::EmuDevice) -> u64 {
        device.stats().io_commands.values().sum()
    }

    #[test]
    fn a_doorbell_that_failed_other_than_stale_is_rung_by_the_next_poll() {
        // Goal: a doorbell write that fails with an error other than QueueStale (the tail may
        // not have gone out; the driver keeps it pending) is reported and rung again by the
        // next poll. The executor used to forget that the doorbell was due: the command sat
        // unannounced in the SQ, and the IOCB waited for the caller's timeout and a reset.
        let mut rig = emu_rig(|pair| CpuExecutor::new(vec![pair], 4));
        rig.queue.executor_mut().failing_doorbells[0] = 1;
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        match rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5)) {
            Err(GioError::Executor { reason, .. }) => assert!(reason.contains("outside a region"), "{reason}"),
            other => panic!("expected the failed doorbell to be reported, got {other:?}"),
        }
        let completion = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5)).expect("rung by the next poll");
        assert_eq!(completion.result, Ok(()));
        assert_eq!(io_commands(&rig.device), 1, "one command, one completion");
    }

    #[test]
    fn a_lasting_doorbell_fault_is_reported_once_and_ends_in_a_timeout_and_a_reset() {
        // Goal: a doorbell fault that lasts (the driver's only non-stale one, a shadow slot out
        // of reach, is fixed when the pair is created) is rung again by every poll but reported
        // once per pair. Reported by every poll, it failed every wait at once, on the healthy
        // device too, and the faulty pair's wait never timed out, so the reset that replaces
        // the pair (and cures the fault) never ran.
        let seconds = |s| Instant::now() + std::time::Duration::from_secs(s);
        let (layer, budget) = (crate::types::LayerIndex(0), crate::types::SmBudget(1));
        let mut rig = emu_rig_on_devices(2, |pairs| CpuExecutor::new(pairs, 4));
        let healthy = fill_read_on(&mut rig, 1);
        rig.queue.executor_mut().failing_doorbells[0] = u32::MAX;
        rig.queue.issue_io(&[rig.id], layer, budget).expect("issue on the faulty pair");
        rig.queue.issue_io(&[healthy], layer, budget).expect("issue on the healthy pair");
        let reported = |waited: Result<crate::queue::Completion, GioError>| match waited {
            Err(GioError::Executor { reason, .. }) => {
                assert!(reason.contains("device 0") && reason.contains("outside a region"), "{reason}")
            }
            other => panic!("expected device 0's doorbell fault, got {other:?}"),
        };
        // The first poll reports the fault (the healthy IOCB's command was only just sent).
        reported(rig.queue.wait_cqe(healthy, seconds(5)));
        let completion = rig.queue.wait_cqe(healthy, seconds(5)).expect("the healthy pair's IOCB completes");
        assert_eq!(completion.result, Ok(()));
        match rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_millis(100)) {
            Err(GioError::WaitTimeout { .. }) => {}
            other => panic!("expected the faulty pair's wait to time out, got {other:?}"),
        }
        // The caller's reset replaces both pairs: the IOCB ends as TIMEOUT, and the same fault
        // on the fresh pair is reported again, once.
        let fresh = (0..2).map(|_| rig.controller.create_io_queue_pair(16).expect("fresh pair")).collect();
        let (executor, memory) = rig.queue.executor_and_memory();
        assert_eq!(executor.reset(memory, fresh).expect("reset"), 1, "the IOCB on the faulty pair ended");
        let ended = rig.queue.wait_cqe(rig.id, seconds(5)).expect("its TIMEOUT CQE");
        assert!(matches!(ended.result, Err(crate::IocbFailure::Timeout { .. })), "{:?}", ended.result);
        rig.queue.issue_io(&[rig.id], layer, budget).expect("reissue");
        reported(rig.queue.wait_cqe(rig.id, seconds(5)));
        // Cured: the next ring succeeds and announces the command.
        rig.queue.executor_mut().failing_doorbells[0] = 0;
        let completion = rig.queue.wait_cqe(rig.id, seconds(5)).expect("rung by the next poll");
        assert_eq!(completion.result, Ok(()));
        assert_eq!(io_commands(&rig.device), 2, "the healthy read and the reissue, each once");
    }

    #[test]
    fn lending_a_pair_whose_doorbell_ring_failed_rings_it_first() {
        // Goal: lend_queue_pair empties the pair with wait_idle, which only reaps: a command
        // left unannounced by a failed doorbell ring (pump rings it again at its next pass)
        // never completed, so the lend waited out the whole deadline and failed with a timeout
        // that named no doorbell. It rings first: a passing fault costs nothing, a lasting one
        // is the lend's error at once. (Neither error fences the device: the object store counts
        // only NVMe command failures and timeouts towards that, and a lend's error is a
        // GioError::Executor; the caller's reset, which replaces the pair, cures the fault.)
        let budget = crate::types::SmBudget(1);
        let deadline = || Instant::now() + std::time::Duration::from_secs(2);
        let mut rig = rig_whose_first_ring_failed();
        let (executor, memory) = rig.queue.executor_and_memory();
        let lent = executor.lend_queue_pair(memory, 0, deadline()).map(|pair| pair.map(|pair| pair.in_flight()));
        assert!(matches!(lent, Ok(Some(0))), "rung, then emptied: {lent:?}");
        let completion = rig.queue.wait_cqe(rig.id, deadline()).expect("the IOCB's CQE, posted by the lend");
        assert_eq!(completion.result, Ok(()));

        rig.queue.executor_mut().failing_doorbells[0] = u32::MAX;
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(1), budget).expect("issue");
        assert!(rig.queue.peek_cqe().is_err(), "the poll's failed ring is reported");
        let started = Instant::now();
        let (executor, memory) = rig.queue.executor_and_memory();
        match executor.lend_queue_pair(memory, 0, deadline()).map(|pair| pair.is_some()) {
            Err(GioError::Executor { reason, .. }) => {
                assert!(reason.contains("device 0") && reason.contains("doorbell") && reason.contains("outside a region"), "{reason}")
            }
            other => panic!("expected the lasting doorbell fault, got {other:?}"),
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(1), "at once, not at the deadline");
        rig.queue.executor_mut().failing_doorbells[0] = 0;
        let completion = rig.queue.wait_cqe(rig.id, deadline()).expect("rung by the next poll once cured");
        assert_eq!(completion.result, Ok(()));
        assert_eq!(io_commands(&rig.device), 2, "each layer's command once");
    }

    #[test]
    fn a_stale_answer_to_the_lends_ring_is_reported_by_the_next_poll_too() {
        // Goal: a lend that rings a doorbell left due and hears QueueStale (the controller was
        // reset) returns that to the borrower; the queue's caller, whose IOCBs are on that pair,
        // must hear it too. The lend marked the pair stale, and polls skip a stale pair as
        // "reported already": its IOCBs only timed out, with no cause stated.
        let soon = || Instant::now() + std::time::Duration::from_millis(100);
        let mut rig = rig_whose_first_ring_failed();
        rig.controller.reset(false).expect("controller reset");
        let stale = |error: &GioError| matches!(error, GioError::Executor { reason, .. } if reason.contains("device 0") && reason.contains("reset"));
        let (executor, memory) = rig.queue.executor_and_memory();
        match executor.lend_queue_pair(memory, 0, soon()).map(|pair| pair.is_some()) {
            Err(error) => assert!(stale(&error), "{error}"),
            other => panic!("expected the lend's ring to answer QueueStale, got {other:?}"),
        }
        match rig.queue.wait_cqe(rig.id, soon()) {
            Err(error) => assert!(stale(&error), "the queue's caller hears why: {error}"),
            other => panic!("expected the stale pair's error, got {other:?}"),
        }
        match rig.queue.wait_cqe(rig.id, soon()) {
            Err(GioError::WaitTimeout { .. }) => {}
            other => panic!("reported once, then the wait times out: got {other:?}"),
        }
        let fresh = vec![rig.controller.create_io_queue_pair(16).expect("fresh pair")];
        let (executor, memory) = rig.queue.executor_and_memory();
        assert_eq!(executor.reset(memory, fresh).expect("reset"), 1, "the IOCB on the stale pair ended");
        let ended = rig.queue.wait_cqe(rig.id, soon()).expect("its TIMEOUT CQE");
        assert!(matches!(ended.result, Err(crate::IocbFailure::Timeout { .. })), "{:?}", ended.result);
    }

    #[test]
    fn a_cqe_whose_post_failed_is_posted_by_the_next_poll() {
        // Goal: a completion whose CQE cannot be posted (the CQ producer lock held past the
        // time bound: a preempted holder) is reported, and not lost: the CQE is kept and
        // the next poll posts it, so wait_cqe returns the IOCB's completion once the lock is
        // free. (The IOCB had already left ISSUED: no reset could end it, put_iocb refuses it.)
        let mut rig = emu_rig(|pair| CpuExecutor::new(vec![pair], 4));
        let lock = rig.queue.memory().layout.cq.header_offset_bytes + core::mem::offset_of!(abi::gio_ring_header, producer_lock);
        rig.queue.memory().region.store_u32(lock, 1, std::sync::atomic::Ordering::Release);
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        let deadline = Instant::now() + std::time::Duration::from_secs(20);
        match rig.queue.wait_cqe(rig.id, deadline) {
            Err(GioError::Executor { reason, .. }) => assert!(reason.contains("producer lock"), "{reason}"),
            other => panic!("expected the failed post to be reported, got {other:?}"),
        }
        rig.queue.memory().region.store_u32(lock, 0, std::sync::atomic::Ordering::Release);
        let completion = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5)).expect("posted by the next poll");
        assert_eq!(completion.result, Ok(()));
        assert_eq!(io_commands(&rig.device), 1, "one command, one completion");
    }

    #[test]
    fn a_held_cq_lock_costs_a_wait_its_deadline_not_a_spin_bound_per_cqe() {
        // Goal: the CQ producer lock is waited for up to a time bound, once per poll: after a
        // post fails, the poll keeps the other CQEs without waiting again. It used to spin a
        // count of attempts for each CQE, so a wait with a 100 ms deadline on a CQ whose lock a
        // dead holder kept took seconds with a few IOCBs completing.
        let mut rig = emu_rig(|pair| CpuExecutor::new(vec![pair], 4));
        let mut ids = vec![rig.id];
        for _ in 0..3 {
            ids.push(refill_like_the_rig(&mut rig));
        }
        let lock = rig.queue.memory().layout.cq.header_offset_bytes + core::mem::offset_of!(abi::gio_ring_header, producer_lock);
        rig.queue.memory().region.store_u32(lock, 1, std::sync::atomic::Ordering::Release);
        rig.queue.issue_io(&ids, crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        // Let every command complete on the device first, so one poll reaps all four.
        let settle = Instant::now() + std::time::Duration::from_secs(5);
        let (executor, memory) = rig.queue.executor_and_memory();
        executor.pump(memory).expect("commands sent");
        while io_commands(&rig.device) < 4 && Instant::now() < settle {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        let started = Instant::now();
        let waited = rig.queue.wait_cqe(ids[3], started + std::time::Duration::from_millis(100));
        let took = started.elapsed();
        assert!(waited.is_err(), "{waited:?}");
        assert!(took < std::time::Duration::from_secs(1), "a 100 ms wait took {took:?}");
        rig.queue.memory().region.store_u32(lock, 0, std::sync::atomic::Ordering::Release);
        for id in ids {
            let done = rig.queue.wait_cqe(id, Instant::now() + std::time::Duration::from_secs(5)).expect("posted once the lock is free");
            assert_eq!(done.result, Ok(()));
        }
    }

    #[test]
    fn a_reset_whose_timeout_cqe_could_not_be_posted_yet_succeeds() {
        // Goal: a reset that deleted the old queue pair and ended the IOCB in flight succeeded,
        // even when that IOCB's TIMEOUT CQE could not be posted at once (the CQ producer lock
        // held past its time bound): the CQE is kept and the next poll posts it. An error
        // here reads to callers as "a queue pair cannot be deleted: reset the controller".
        use nvme_emu::{FaultAction, FaultPlan, FaultRule};
        let mut rig = emu_rig(|pair| CpuExecutor::new(vec![pair], 4));
        rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)));
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        let lost = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_millis(200));
        assert!(matches!(lost, Err(GioError::WaitTimeout { .. })), "{lost:?}");
        let fresh = rig.controller.create_io_queue_pair(16).expect("fresh I/O queue pair");
        let lock = rig.queue.memory().layout.cq.header_offset_bytes + core::mem::offset_of!(abi::gio_ring_header, producer_lock);
        rig.queue.memory().region.store_u32(lock, 1, std::sync::atomic::Ordering::Release);
        let (executor, memory) = rig.queue.executor_and_memory();
        let reset = executor.reset(memory, vec![fresh]);
        rig.queue.memory().region.store_u32(lock, 0, std::sync::atomic::Ordering::Release);
        assert_eq!(reset.expect("the reset succeeded"), 1, "the IOCB in flight was ended");
        let ended = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5)).expect("posted by the next poll");
        assert_eq!(ended.result, Err(crate::IocbFailure::Timeout { ioctx_index: None }));
    }

    /// Issues the rig's IOCB for layer 1 with `field` of line 0 rewritten to `value` between the
    /// issue and the executor's read, and checks the issue is refused naming `field`, that the
    /// IOCB ends once as TIMEOUT (its one CQE carries the issue's own sequence number, so the
    /// queue takes it) and that no command reached the device. Then reissues it untouched.
    fn rewritten_field_is_refused<E: Executor>(mut rig: EmuRig<E>, field: &'static str, refused_by_submit: bool) {
        let issued = rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(1), crate::types::SmBudget(1));
        match &issued {
            Err(GioError::SubmitFailed { source, .. }) => {
                assert!(matches!(**source, GioError::CorruptIocb { field: f, .. } if f == field), "{source}")
            }
            other if refused_by_submit => panic!("expected a refused issue, got {other:?}"),
            _ => {}
        }
        let ended = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5)).expect("ended once");
        assert!(matches!(ended.result, Err(crate::IocbFailure::Timeout { .. })), "{field}: {:?}", ended.result);
        assert_eq!(io_commands(&rig.device), 0, "{field}: no command reached the device");
        // The next issue (line 0 untouched now) runs, with the next sequence number.
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(1), crate::types::SmBudget(1)).expect("reissue");
        let done = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5)).expect("completes");
        assert_eq!(done.result, Ok(()), "{field}: the reissue runs");
        assert_eq!(io_commands(&rig.device), 1);
    }

    #[test]
    fn a_layer_rewritten_in_line_0_at_the_issue_sends_no_command() {
        // Goal: the layer comes from the issue, not from line 0 as found in shared memory: an
        // issue for layer 1 whose line 0 another agent rewrote to layer 0 used to move layer 0's
        // blocks and memory and complete as layer 1 (wrong data served). It is refused as a
        // corrupt "layer" and nothing reaches the device, with either CPU executor.
        use crate::executor::test_double::Corrupting;
        let layer = core::mem::offset_of!(abi::gio_iocb, layer);
        rewritten_field_is_refused(emu_rig(|pair| Corrupting::new(CpuExecutor::new(vec![pair], 4), IocbId(0), layer, 0)), "layer", true);
        let workers = one_worker;
        rewritten_field_is_refused(emu_rig(|pair| Corrupting::new(workers(pair), IocbId(0), layer, 0)), "layer", true);
    }

    #[test]
    fn an_issue_sequence_number_rewritten_in_line_0_still_ends_the_iocb_once() {
        // Goal: the executor posts the issue's own sequence number (one more than its last
        // issue), never the one found in shared memory: a rewritten one used to be posted, the
        // queue dropped the CQE as stale and the IOCB stayed in flight for ever (no reset ended
        // it: it had left ISSUED). It is refused as a corrupt "issue_seq", ends once as TIMEOUT
        // with the right number, and the next issue runs.
        use crate::executor::test_double::Corrupting;
        let seq = core::mem::offset_of!(abi::gio_iocb, issue_seq);
        rewritten_field_is_refused(emu_rig(|pair| Corrupting::new(CpuExecutor::new(vec![pair], 4), IocbId(0), seq, 77)), "issue_seq", true);
        let workers = one_worker;
        rewritten_field_is_refused(emu_rig(|pair| Corrupting::new(workers(pair), IocbId(0), seq, 77)), "issue_seq", true);
    }

    #[test]
    fn a_reset_with_a_corrupt_sq_still_ends_the_iocbs_in_flight() {
        // Goal: once the old queue pairs are deleted, ending the IOCBs still ISSUED is safe
        // whatever the SQ holds: a corrupt SQ header (its tail far past the head) used to fail
        // the reset before any IOCB was ended (read by callers as "reset the controller"), and
        // the IOCB stayed in flight. The SQ is logged; the reset succeeds and ends the IOCB.
        use nvme_emu::{FaultAction, FaultPlan, FaultRule};
        let mut rig = emu_rig(|pair| CpuExecutor::new(vec![pair], 4));
        rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)));
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        let lost = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_millis(200));
        assert!(matches!(lost, Err(GioError::WaitTimeout { .. })), "{lost:?}");
        let sq = rig.queue.memory().layout.sq;
        let tail = sq.header_offset_bytes + core::mem::offset_of!(abi::gio_ring_header, tail);
        rig.queue.memory().region.store_u32(tail, 1 << 30, std::sync::atomic::Ordering::Release);
        let fresh = rig.controller.create_io_queue_pair(16).expect("fresh I/O queue pair");
        let (executor, memory) = rig.queue.executor_and_memory();
        assert_eq!(executor.reset(memory, vec![fresh]).expect("the reset succeeded"), 1, "the IOCB in flight was ended");
        let ended = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5)).expect("ended");
        assert_eq!(ended.result, Err(crate::IocbFailure::Timeout { ioctx_index: None }));
    }

    #[test]
    fn a_stride_rewritten_in_line_0_after_the_fill_sends_no_command() {
        // Goal: the executor builds commands from what fill_iocb validated, not from line 0 as
        // it finds it at the issue: a memory stride rewritten between the fill and the issue
        // (16 MiB: layer 1's data far outside the 64 KiB registered) sends no command to the
        // device; the IOCB ends as timed out, and the CPU executor names the corrupt field.
        use crate::executor::test_double::Corrupting;
        let stride_field = core::mem::offset_of!(abi::gio_iocb, mem_stride_bytes);
        let mut rig = emu_rig(|pair| Corrupting::new(CpuExecutor::new(vec![pair], 4), IocbId(0), stride_field, 16 << 20));
        let issued = rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(1), crate::types::SmBudget(1));
        match &issued {
            Err(GioError::SubmitFailed { source, .. }) => {
                assert!(matches!(**source, GioError::CorruptIocb { field: "mem_stride_bytes", .. }), "{source}")
            }
            other => panic!("expected a refused issue, got {other:?}"),
        }
        let ended = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5)).expect("ended once");
        assert!(matches!(ended.result, Err(crate::IocbFailure::Timeout { .. })), "{:?}", ended.result);
        assert_eq!(io_commands(&rig.device), 0, "no command reached the device");

        let mut rig = emu_rig(|pair| {
            let workers = one_worker(pair);
            Corrupting::new(workers, IocbId(0), stride_field, 16 << 20)
        });
        let _ = rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(1), crate::types::SmBudget(1));
        let ended = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5)).expect("ended once");
        assert!(matches!(ended.result, Err(crate::IocbFailure::Timeout { .. })), "{:?}", ended.result);
        assert_eq!(io_commands(&rig.device), 0, "no command reached the device");
        // Untouched, the same request runs.
        let mut rig = emu_rig(|pair| CpuExecutor::new(vec![pair], 4));
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(1), crate::types::SmBudget(1)).expect("issue");
        let done = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5)).expect("completes");
        assert_eq!(done.result, Ok(()));
        assert_eq!(io_commands(&rig.device), 1);
    }

    /// Issues the rig's IOCB with its completion lost (it stays in flight), retires the queue
    /// pairs, and returns how the IOCB then ends.
    fn retire_with_an_iocb_in_flight<E: Executor>(mut rig: EmuRig<E>) -> Result<crate::queue::Completion, GioError> {
        use nvme_emu::{FaultAction, FaultPlan, FaultRule};
        rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)));
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        let lost = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_millis(200));
        assert!(matches!(lost, Err(GioError::WaitTimeout { .. })), "{lost:?}");
        assert_eq!(io_commands(&rig.device), 1, "the command was sent");
        assert_eq!(rig.queue.executor_mut().retire_queue_pairs(), Some(true), "every queue pair deleted");
        rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(2))
    }

    #[test]
    fn retiring_the_queue_pairs_ends_the_iocbs_still_issued() {
        // Goal: once every queue pair is deleted no command can complete, so an IOCB still
        // issued (its command in flight with a lost completion, or never sent) ends at once as
        // TIMEOUT with its one CQE, as after a reset; it used to stay in flight for ever.
        let timeout = Err(crate::IocbFailure::Timeout { ioctx_index: None });
        let ended = retire_with_an_iocb_in_flight(emu_rig(|pair| CpuExecutor::new(vec![pair], 4))).expect("ended");
        assert_eq!(ended.result, timeout, "CPU executor, command in flight");
        let ended = retire_with_an_iocb_in_flight(emu_rig(|pair| {
            crate::CpuWorkers::new(1, vec![vec![(crate::types::DeviceIndex(0), pair)]], 4).expect("workers")
        }))
        .expect("ended");
        assert_eq!(ended.result, timeout, "CPU workers, command in flight");
        // Never sent: submit only takes the ids, commands are built on the next poll.
        let mut rig = emu_rig(|pair| CpuExecutor::new(vec![pair], 4));
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        assert_eq!(rig.queue.executor_mut().retire_queue_pairs(), Some(true));
        let ended = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(2)).expect("ended");
        assert_eq!((ended.result, io_commands(&rig.device)), (timeout, 0), "CPU executor, IOCB pending");
    }

    /// Overwrites entry `position` of the next batch on the SQ with `value` before `submit`
    /// reads it: an SQ entry naming no IOCB, or another IOCB than the one issued, as another
    /// agent scribbling on the shared ring would leave it.
    struct ForgedSqEntry<E> {
        inner: E,
        position: u32,
        value: Option<u32>,
    }

    impl<E: Executor> Executor for ForgedSqEntry<E> {
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
            if let Some(value) = self.value.take() {
                let sq = memory.layout.sq;
                let offset = sq.entries_offset_bytes + (batch.sq_first.wrapping_add(self.position) & sq.mask()) as usize * 4;
                memory.region.store_u32(offset, value, std::sync::atomic::Ordering::Relaxed);
            }
            self.inner.submit(memory, batch)
        }
        fn poll(&mut self, memory: &QueueMemory) -> Result<(), GioError> {
            self.inner.poll(memory)
        }
    }

    /// IOCB A (the rig's) and B (filled like it) with B's SQ entry rewritten to name A: A
    /// completed before (`same_batch` false), or A issued in the same batch, just ahead of B
    /// (true: A is in flight when the rewritten entry is read). The entry naming A is refused
    /// without touching A's issue count: A runs (or stays done) and ends once, B was never
    /// taken and a reset ends it, and the next issues of A and B run.
    fn an_sq_entry_rewritten_to_another_iocb_leaves_it_alone<E: crate::executor::QueuePairReset>(
        mut rig: EmuRig<ForgedSqEntry<E>>,
        same_batch: bool,
        who: &str,
    ) {
        use crate::types::{LayerIndex, SmBudget};
        let soon = || Instant::now() + std::time::Duration::from_secs(5);
        let a = rig.id;
        let b = refill_like_the_rig(&mut rig);
        if !same_batch {
            rig.queue.issue_io(&[a], LayerIndex(0), SmBudget(1)).expect("issue A");
            assert_eq!(rig.queue.wait_cqe(a, soon()).expect("A completes").result, Ok(()), "{who}");
        }
        let forged = rig.queue.executor_mut();
        forged.position = u32::from(same_batch);
        forged.value = Some(a.0);
        let batch: &[IocbId] = if same_batch { &[a, b] } else { &[b] };
        let issued = rig.queue.issue_io(batch, LayerIndex(0), SmBudget(1));
        assert!(matches!(issued, Err(GioError::SubmitFailed { .. })), "{who}: {issued:?}");
        if same_batch {
            assert_eq!(rig.queue.wait_cqe(a, soon()).expect("A ends once").result, Ok(()), "{who}: A ran");
        }
        let fresh = rig.controller.create_io_queue_pair(16).expect("fresh I/O queue pair");
        let (executor, memory) = rig.queue.executor_and_memory();
        let reclaimed = executor.inner.reset(memory, vec![fresh]).expect("reset");
        assert_eq!(reclaimed, 1, "{who}: B, never taken, is ended by the reset");
        let ended = rig.queue.wait_cqe(b, soon()).expect("B ended");
        assert_eq!(ended.result, Err(crate::IocbFailure::Timeout { ioctx_index: None }), "{who}");
        rig.queue.issue_io(&[a, b], LayerIndex(0), SmBudget(1)).expect("reissue A and B");
        for id in [a, b] {
            let done = rig.queue.wait_cqe(id, soon());
            assert!(matches!(done, Ok(crate::queue::Completion { result: Ok(()), .. })), "{who}: {id} reissued: {done:?}");
        }
    }

    #[test]
    fn an_sq_entry_rewritten_to_another_iocb_does_not_move_its_issue_count() {
        // Goal: an SQ entry naming an IOCB that is not ISSUED (it completed) or that this
        // executor already took (in flight in the same batch) is refused without noting an
        // issue of it: the count moved anyway, so A's next real issue was refused as a corrupt
        // issue_seq and ended with a TIMEOUT CQE the queue dropped as stale (A stuck for ever),
        // or, in flight, A was ended as TIMEOUT under its pending commands. Both executors.
        let workers = one_worker;
        for same_batch in [false, true] {
            let single = emu_rig(|pair| ForgedSqEntry { inner: CpuExecutor::new(vec![pair], 4), position: 0, value: None });
            an_sq_entry_rewritten_to_another_iocb_leaves_it_alone(single, same_batch, &format!("CPU executor, same batch {same_batch}"));
            let pooled = emu_rig(|pair| ForgedSqEntry { inner: workers(pair), position: 0, value: None });
            an_sq_entry_rewritten_to_another_iocb_leaves_it_alone(pooled, same_batch, &format!("CPU workers, same batch {same_batch}"));
        }
    }

    /// IOCB A (the rig's) completes; another agent sets A's status back to ISSUED and rewrites
    /// the SQ entry of B's issue to name A. The entry is no issue the queue gave A (host memory
    /// says which issue it gave last): refused, A's issue count untouched. The reset ends B with
    /// its own number (and A, ISSUED but idle, with a CQE the queue refuses), and A's and B's
    /// next issues run.
    fn a_forged_issue_of_an_idle_iocb_is_not_taken<E: crate::executor::QueuePairReset>(mut rig: EmuRig<ForgedSqEntry<E>>, who: &str) {
        use crate::types::{LayerIndex, SmBudget};
        let soon = || Instant::now() + std::time::Duration::from_secs(5);
        let a = rig.id;
        let b = refill_like_the_rig(&mut rig);
        rig.queue.issue_io(&[a], LayerIndex(0), SmBudget(1)).expect("issue A");
        assert_eq!(rig.queue.wait_cqe(a, soon()).expect("A completes").result, Ok(()), "{who}");
        let memory = rig.queue.memory();
        let status = memory.iocb_field_offset(a, crate::layout::IocbField::Status);
        memory.region.store_u32(status, abi::GIO_IOCB_STATUS_ISSUED, std::sync::atomic::Ordering::Release);
        let forged = rig.queue.executor_mut();
        forged.position = 0;
        forged.value = Some(a.0);
        let issued = rig.queue.issue_io(&[b], LayerIndex(0), SmBudget(1));
        assert!(matches!(issued, Err(GioError::SubmitFailed { .. })), "{who}: {issued:?}");
        let fresh = rig.controller.create_io_queue_pair(16).expect("fresh I/O queue pair");
        let (executor, memory) = rig.queue.executor_and_memory();
        executor.inner.reset(memory, vec![fresh]).expect("reset");
        let ended = loop {
            match rig.queue.wait_cqe(b, soon()) {
                // A's CQE, for no issue in flight: the queue refuses it.
                Err(GioError::UnexpectedCompletion { id, .. }) if id == a => continue,
                other => break other,
            }
        };
        assert_eq!(ended.expect("B ended").result, Err(crate::IocbFailure::Timeout { ioctx_index: None }), "{who}");
        rig.queue.issue_io(&[a, b], LayerIndex(1), SmBudget(1)).expect("reissue A and B");
        for id in [a, b] {
            let done = rig.queue.wait_cqe(id, soon());
            assert!(matches!(done, Ok(crate::queue::Completion { result: Ok(()), .. })), "{who}: {id} reissued: {done:?}");
        }
    }

    #[test]
    fn an_sq_entry_naming_an_idle_iocb_rewritten_to_issued_does_not_lose_it() {
        // Goal: an SQ entry is taken only for the issue the queue gave last (host memory), not
        // for any IOCB whose shared status reads ISSUED: taking an idle IOCB whose status was
        // rewritten moved its count past the queue's, so every later issue of it was refused
        // (CorruptIocb) and ended with a number the queue dropped: the IOCB was lost for good.
        // Both CPU executors.
        let workers = one_worker;
        let single = emu_rig(|pair| ForgedSqEntry { inner: CpuExecutor::new(vec![pair], 4), position: 0, value: None });
        a_forged_issue_of_an_idle_iocb_is_not_taken(single, "CPU executor");
        let pooled = emu_rig(|pair| ForgedSqEntry { inner: workers(pair), position: 0, value: None });
        a_forged_issue_of_an_idle_iocb_is_not_taken(pooled, "CPU workers");
    }

    /// Rewrites `issue_seq` in the line 0 of the first IOCB filled, between the fill's write and
    /// the executor's copy of the line (`prepared`), as another agent could.
    struct SeqRewrittenAtTheFill<E> {
        inner: E,
        armed: bool,
    }

    impl<E: Executor> Executor for SeqRewrittenAtTheFill<E> {
        fn name(&self) -> &'static str {
            self.inner.name()
        }
        fn attach(&mut self, memory: &Arc<QueueMemory>) -> Result<(), GioError> {
            self.inner.attach(memory)
        }
        fn prepared(&mut self, memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
            if std::mem::take(&mut self.armed) {
                let offset = memory.layout.iocb_offset(id) + core::mem::offset_of!(abi::gio_iocb, issue_seq);
                memory.region.store_u32(offset, 41, std::sync::atomic::Ordering::Relaxed);
            }
            self.inner.prepared(memory, id)
        }
        fn submit(&mut self, memory: &QueueMemory, batch: &IssueBatch) -> Result<(), GioError> {
            self.inner.submit(memory, batch)
        }
        fn poll(&mut self, memory: &QueueMemory) -> Result<(), GioError> {
            self.inner.poll(memory)
        }
    }

    #[test]
    fn an_issue_sequence_number_rewritten_before_the_fill_is_copied_does_not_refuse_the_issues() {
        // Goal: the executor's copy of a filled line takes the issue sequence number the queue
        // gave (host memory), not line 0's: copied from a rewritten line 0, it expected another
        // number than the queue's next issue carries, so every issue of the IOCB was refused
        // (CorruptIocb). Both CPU executors.
        use crate::types::{LayerIndex, SmBudget};
        let workers = one_worker;
        let mut single = emu_rig(|pair| SeqRewrittenAtTheFill { inner: CpuExecutor::new(vec![pair], 4), armed: true });
        let mut pooled = emu_rig(|pair| SeqRewrittenAtTheFill { inner: workers(pair), armed: true });
        let soon = || Instant::now() + std::time::Duration::from_secs(5);
        single.queue.issue_io(&[single.id], LayerIndex(0), SmBudget(1)).expect("CPU executor: issue");
        assert_eq!(single.queue.wait_cqe(single.id, soon()).expect("CPU executor: ends").result, Ok(()));
        pooled.queue.issue_io(&[pooled.id], LayerIndex(0), SmBudget(1)).expect("CPU workers: issue");
        assert_eq!(pooled.queue.wait_cqe(pooled.id, soon()).expect("CPU workers: ends").result, Ok(()));
    }

    /// Issues the rig's IOCB with its completion lost, rewrites the issue sequence number in
    /// its line 0 to one more, resets, and checks the IOCB ends once, as TIMEOUT, with the
    /// CQE of the issue in flight (not the rewritten number, which the queue drops as stale);
    /// then its next issue runs.
    fn a_reset_ends_the_issue_taken_whatever_line_0_says<E: crate::executor::QueuePairReset>(mut rig: EmuRig<E>, who: &str) {
        use crate::types::{LayerIndex, SmBudget};
        use nvme_emu::{FaultAction, FaultPlan, FaultRule};
        rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)));
        rig.queue.issue_io(&[rig.id], LayerIndex(0), SmBudget(1)).expect("issue");
        let lost = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_millis(200));
        assert!(matches!(lost, Err(GioError::WaitTimeout { .. })), "{who}: {lost:?}");
        let memory = rig.queue.memory();
        let seq = memory.layout.iocb_offset(rig.id) + core::mem::offset_of!(abi::gio_iocb, issue_seq);
        let rewritten = memory.read_iocb_header(rig.id).issue_seq.wrapping_add(1);
        memory.region.store_u32(seq, rewritten, std::sync::atomic::Ordering::Relaxed);
        let fresh = rig.controller.create_io_queue_pair(16).expect("fresh I/O queue pair");
        let (executor, memory) = rig.queue.executor_and_memory();
        assert_eq!(executor.reset(memory, vec![fresh]).expect("reset"), 1, "{who}");
        let ended = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(2));
        assert!(
            matches!(ended, Ok(crate::queue::Completion { result: Err(crate::IocbFailure::Timeout { ioctx_index: None }), .. })),
            "{who}: {ended:?}"
        );
        rig.queue.issue_io(&[rig.id], LayerIndex(0), SmBudget(1)).expect("reissue");
        let done = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5));
        assert!(matches!(done, Ok(crate::queue::Completion { result: Ok(()), .. })), "{who}: reissued: {done:?}");
    }

    #[test]
    fn a_reset_ends_an_iocb_in_flight_with_its_own_issue_seq_after_line_0_was_rewritten() {
        // Goal: for an IOCB this executor took (in flight), a reset posts the sequence number
        // of the issue taken: it used to adopt a line 0 rewritten to one more (as though that
        // issue's SQ entry had not been taken), and the queue dropped the TIMEOUT CQE as stale,
        // leaving the IOCB in flight for ever. Both executors.
        a_reset_ends_the_issue_taken_whatever_line_0_says(emu_rig(|pair| CpuExecutor::new(vec![pair], 4)), "CPU executor");
        let workers = one_worker;
        a_reset_ends_the_issue_taken_whatever_line_0_says(emu_rig(workers), "CPU workers");
    }

    #[test]
    fn an_sq_entry_naming_no_iocb_is_skipped_and_the_rest_of_the_batch_runs() {
        // Goal: as CpuWorkers does, an SQ entry outside the pool is skipped (and reported)
        // instead of stopping submit part way through the batch, which left the rest of it on
        // the SQ and failed every later issue until a reset. The IOCB whose entry was forged
        // was never taken: a reset ends it.
        use crate::executor::test_double::queue_with_one_read;
        use crate::types::{LayerIndex, SmBudget};
        let executor = ForgedSqEntry { inner: CpuExecutor::for_devices(vec![None], 4, None), position: 0, value: Some(999) };
        let (mut queue, first) = queue_with_one_read(executor);
        let second = queue.get_iocb(1, crate::types::Dependency::None).expect("IOCB")[0];
        let ioctx = crate::validate::IoctxSpec {
            device: crate::types::DeviceIndex(0),
            nsid: 1,
            start_lba: crate::types::Lba(0),
            block_count: 1,
            data: crate::types::Iova(0x1000_0000),
            descriptor: crate::validate::Descriptor::SglInline,
            force_unit_access: false,
        };
        queue.fill_iocb(second, &crate::validate::IocbSpec::single(Opcode::Read, 0), &[ioctx]).expect("fill");
        let issued = queue.issue_io(&[first, second], LayerIndex(0), SmBudget(1));
        assert!(matches!(&issued, Err(GioError::SubmitFailed { .. })), "{issued:?}");
        let soon = || Instant::now() + std::time::Duration::from_secs(2);
        let ran = queue.wait_cqe(second, soon()).expect("the rest of the batch was taken and ran");
        assert_eq!(ran.result, Err(crate::IocbFailure::InvalidIoctx { ioctx_index: 0 }), "no queue pair for device 0");
        queue.issue_io(&[second], LayerIndex(0), SmBudget(1)).expect("the SQ is not stuck");
        queue.wait_cqe(second, soon()).expect("runs again");
        let (executor, memory) = queue.executor_and_memory();
        assert_eq!(executor.inner.reset(memory, Vec::new()).expect("reset"), 1, "the IOCB never taken ends at the reset");
        let ended = queue.wait_cqe(first, soon()).expect("ended");
        assert_eq!(ended.result, Err(crate::IocbFailure::Timeout { ioctx_index: None }));
        // The executor counts that issue as consumed: the next one is taken and ends once.
        queue.issue_io(&[first], LayerIndex(0), SmBudget(1)).expect("reissued");
        let ran = queue.wait_cqe(first, soon()).expect("the reissue ends");
        assert_eq!(ran.result, Err(crate::IocbFailure::InvalidIoctx { ioctx_index: 0 }));
    }

    #[test]
    fn an_ioctx_for_a_device_without_a_queue_pair_fails_when_no_worker_owns_it() {
        // Goal: outside worker mode no other worker can own a device, so an IOCTX whose slot
        // holds no queue pair (the pairs were retired) fails as invalid instead of being
        // skipped for good, which left its IOCB in flight forever.
        use crate::executor::test_double::queue_with_one_read;
        let (mut queue, id) = queue_with_one_read(CpuExecutor::for_devices(vec![None], 4, None));
        queue.issue_io(&[id], crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        let completion = queue.wait_cqe(id, Instant::now() + std::time::Duration::from_secs(1)).expect("completes");
        assert_eq!(completion.result, Err(crate::IocbFailure::InvalidIoctx { ioctx_index: 0 }));
    }

    /// Fills another IOCB on the rig's queue with two one-block Reads of device 0 (blocks 0 and
    /// 1 into the first two 512-byte blocks of the DMA buffer), not issued.
    fn fill_two_reads<E: Executor>(rig: &mut EmuRig<E>) -> IocbId {
        use crate::validate::{Descriptor, IocbSpec, IoctxSpec};
        let id = rig.queue.get_iocb(1, crate::types::Dependency::None).expect("IOCB")[0];
        let read = |block: u64| IoctxSpec {
            device: crate::types::DeviceIndex(0),
            nsid: rig.controller.namespaces()[0].id.0,
            start_lba: crate::types::Lba(block),
            block_count: 1,
            data: crate::types::Iova(rig._buffer.iova().0 + block * 512),
            descriptor: Descriptor::Prp { prp2: None },
            force_unit_access: false,
        };
        rig.queue.fill_iocb(id, &IocbSpec::single(Opcode::Read, 0), &[read(0), read(1)]).expect("fill");
        id
    }

    /// A two-IOCTX IOCB whose shared completed-IOCTX count another agent sets to 1 right after
    /// the issue reset it, its second read's completion 2 s late: it must not end before
    /// that completion, and ends once with it; its next issue runs on its own completions. The
    /// delay is far longer than the 100 ms early wait, so a test thread descheduled for a while
    /// on a loaded machine still looks before that completion arrives.
    fn a_rewritten_progress_line_does_not_end_an_iocb_early<E: Executor>(
        mut rig: EmuRig<crate::executor::test_double::Corrupting<E>>,
        who: &str,
    ) {
        use crate::types::{LayerIndex, SmBudget};
        use nvme_emu::{FaultAction, FaultPlan, FaultRule};
        let id = fill_two_reads(&mut rig);
        assert_eq!(id, rig.queue.executor_mut().iocb, "{who}: the IOCB the wrapper rewrites");
        let delay = FaultAction::Delay(std::time::Duration::from_secs(2));
        rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(2, delay)));
        rig.queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).expect("issue");
        let early = rig.queue.wait_cqe(id, Instant::now() + std::time::Duration::from_millis(100));
        assert!(matches!(early, Err(GioError::WaitTimeout { .. })), "{who}: ended while IOCTX 1 was in flight: {early:?}");
        let done = rig.queue.wait_cqe(id, Instant::now() + std::time::Duration::from_secs(5)).expect("ends with its last completion");
        assert_eq!(done.result, Ok(()), "{who}");
        rig.queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).expect("reissue");
        let again = rig.queue.wait_cqe(id, Instant::now() + std::time::Duration::from_secs(5)).expect("the reissue ends");
        assert_eq!(again.result, Ok(()), "{who}");
        assert_eq!(io_commands(&rig.device), 4, "{who}: both issues sent both reads");
    }

    #[test]
    fn a_completed_ioctx_count_rewritten_in_shared_memory_does_not_end_an_iocb_early() {
        // Goal: the CPU executors count an issue's completed IOCTXs in host memory, not in the
        // shared line 1 another agent can write: a completed_ioctx_count set to 1 after the
        // issue reset it made the first completion of a two-IOCTX IOCB end it as SUCCESS while
        // IOCTX 1 still moved data. Both executors.
        use crate::executor::test_double::Corrupting;
        let count = core::mem::offset_of!(abi::gio_iocb, completed_ioctx_count);
        let single = emu_rig(|pair| Corrupting::new(CpuExecutor::new(vec![pair], 4), IocbId(1), count, 1));
        a_rewritten_progress_line_does_not_end_an_iocb_early(single, "CPU executor");
        let workers = one_worker;
        let pooled = emu_rig(|pair| Corrupting::new(workers(pair), IocbId(1), count, 1));
        a_rewritten_progress_line_does_not_end_an_iocb_early(pooled, "CPU workers");
    }

    #[test]
    fn a_completion_of_an_earlier_issue_is_not_counted_against_the_next() {
        // Goal: a command's tag carries its issue's sequence number, so a completion that
        // arrives after its IOCB was issued again (the issue it belonged to ended some other
        // way) is refused as an executor error, never counted against the new issue.
        let memory = QueueMemory::new(crate::layout::QueueConfig { depth: 2, ioctx_per_iocb_max: 2 }).expect("memory");
        let id = IocbId(1);
        let header = IocbHeader {
            id: 1,
            ioctx_count: 2,
            ioctx_first: 2,
            layer_count: 1,
            layer: 0,
            issue_seq: 6,
            opcode: Opcode::Read.to_abi(),
            user_data: 0,
            lba_stride_blocks: 0,
            mem_stride_bytes: 0,
            desc_stride_bytes: 0,
        };
        memory.write_iocb_progress(id, &crate::layout::IocbProgress::ISSUED, std::sync::atomic::Ordering::Release);
        memory.arm_issue(id, header.ioctx_count);
        let issued = vec![None, Some(header)];
        let completion = |tag| nvme_driver::Completion { tag, command_id: nvme_driver::CommandId(0), opcode: 0x02, dw0: 0, status: Ok(()) };
        let mut posting = Ok(());
        finish_command(&memory, &issued, completion(self::tag(id, 5, 1)), &mut posting);
        assert!(matches!(&posting, Err(GioError::Executor { reason, .. }) if reason.contains("issue")), "{posting:?}");
        // An issue 2^16 earlier or later is another one too: the tag carries the whole number.
        for other in [6u32.wrapping_sub(1 << 16), 6 + (1 << 16)] {
            let mut posting = Ok(());
            finish_command(&memory, &issued, completion(self::tag(id, other, 1)), &mut posting);
            assert!(matches!(&posting, Err(GioError::Executor { reason, .. }) if reason.contains("issue")), "{other}: {posting:?}");
        }
        // A borrower's command: its tag names no IOCTX of any issue, whatever the depth.
        let mut posting = Ok(());
        finish_command(&memory, &issued, completion(crate::executor::LENT_COMMAND_TAG), &mut posting);
        assert!(posting.is_err(), "a lent command's completion is refused");
        let mut posting = Ok(());
        finish_command(&memory, &issued, completion(self::tag(id, 6, 0)), &mut posting);
        posting.expect("IOCTX 0 of the issue in flight is counted");
        assert_eq!(memory.read_iocb_progress(id).status, abi::GIO_IOCB_STATUS_ISSUED, "IOCTX 1 is still to come");
        let mut posting = Ok(());
        finish_command(&memory, &issued, completion(self::tag(id, 6, 1)), &mut posting);
        posting.expect("IOCTX 1 ends it");
        assert_eq!(memory.read_iocb_progress(id).status, abi::GIO_IOCB_STATUS_SUCCESS);
    }

    #[test]
    fn a_borrowers_completion_is_named_as_one_whatever_the_depth() {
        // Goal: all ones decodes to IOCB 65535, which a pool of the deepest depth (2^16) has: a
        // borrower's late completion must still be refused as a borrower's, not reported as a
        // stray issue of that IOCB (which sent whoever chased it after the wrong IOCB).
        let memory = QueueMemory::new(crate::layout::QueueConfig { depth: 2, ioctx_per_iocb_max: 2 }).expect("memory");
        let last = abi::GIO_RING_DEPTH_MAX - 1;
        let header = IocbHeader {
            id: last,
            ioctx_count: 2,
            ioctx_first: 0,
            layer_count: 1,
            layer: 0,
            issue_seq: 3,
            opcode: Opcode::Read.to_abi(),
            user_data: 0,
            lba_stride_blocks: 0,
            mem_stride_bytes: 0,
            desc_stride_bytes: 0,
        };
        let mut issued = vec![None; abi::GIO_RING_DEPTH_MAX as usize];
        issued[last as usize] = Some(header);
        let lent = nvme_driver::Completion {
            tag: crate::executor::LENT_COMMAND_TAG,
            command_id: nvme_driver::CommandId(0),
            opcode: 0x02,
            dw0: 0,
            status: Ok(()),
        };
        let mut posting = Ok(());
        finish_command(&memory, &issued, lent, &mut posting);
        assert!(
            matches!(&posting, Err(GioError::Executor { reason, .. }) if reason.contains("borrower") && !reason.contains("iocb 65535")),
            "{posting:?}"
        );
    }

    #[test]
    fn a_worker_dealt_an_ioctx_whose_device_it_does_not_serve_fails_it() {
        // Goal: a worker reads each IOCTX record at its pump; one that names a device of
        // another worker by then (the record was rewritten after the dealing) is failed as
        // INVALID_IOCTX, with its CQE, instead of being skipped uncounted, which left the IOCB
        // in flight until its caller's deadline with no error naming the cause.
        let index = Arc::new(IoctxIndex::new(4, 4, 1));
        let worker_index = Arc::clone(&index);
        let mut rig = emu_rig_on_devices(2, move |pairs| {
            let mut pairs = pairs.into_iter();
            let own = pairs.next();
            if let Some(other) = pairs.next() {
                other.delete().expect("the other worker's pair is deleted");
            }
            CpuExecutor::for_devices(vec![own, None], 4, Some((worker_index, 0)))
        });
        let id = fill_read_on(&mut rig, 1);
        index.build(id, &[0], &mut [0]); // dealt to this worker, which serves device 0 only
        rig.queue.issue_io(&[id], crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        let ended = rig.queue.wait_cqe(id, Instant::now() + std::time::Duration::from_secs(1));
        assert!(
            matches!(ended, Ok(crate::queue::Completion { result: Err(crate::IocbFailure::InvalidIoctx { ioctx_index: 0 }), .. })),
            "{ended:?}"
        );
        assert_eq!(io_commands(&rig.device), 0, "no command was sent");
    }

    /// A gio queue whose CPU executor drives an I/O queue pair attached as a client of a
    /// daemon would (`IoQueuePair::attach`, over the software controller's shared register
    /// page), with one filled one-block Read, not issued. Fields drop in order: the queue (and
    /// the attached pair) first, then the daemon's detached pair, which deletes the queues.
    struct AttachedRig<E: Executor> {
        queue: crate::queue::GioQueue<E>,
        id: IocbId,
        /// The daemon's side of every pair attached: the rig's, then those of `attach_pair`.
        detached: Vec<nvme_driver::DetachedQueuePair>,
        _buffer: nvme_driver::hw::DmaRegion,
        _controller: nvme_driver::Controller,
        device: Arc<nvme_emu::EmuDevice>,
    }

    /// A detached queue pair the controller creates (the daemon's side) and the I/O queue pair
    /// attached to it over the shared register page (the client's side).
    fn attach_pair(controller: &nvme_driver::Controller, device: &nvme_emu::EmuDevice) -> (nvme_driver::DetachedQueuePair, IoQueuePair) {
        use nvme_driver::spec::{COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
        let depth = 16u32;
        let dma = controller.dma();
        let rings = (
            dma.allocate(depth as usize * SUBMISSION_ENTRY_BYTES).expect("SQ"),
            dma.allocate(depth as usize * COMPLETION_ENTRY_BYTES).expect("CQ"),
        );
        let detached = controller.create_detached_queue_pair(depth, Some(rings.clone())).expect("detached pair");
        let registers = device.shared_register_memory().expect("shared registers");
        let registers: Arc<dyn nvme_driver::RegisterIo> = Arc::new(nvme_driver::hw::SharedRegisters::new(registers));
        let attach = nvme_driver::AttachedQueueConfig {
            layout: detached.layout(),
            namespaces: controller.namespaces().to_vec(),
            data_pointer_mode: controller.data_pointer_mode(),
            max_transfer_bytes: controller.max_transfer_bytes(),
            sgl_dword_lengths: false,
        };
        let pair = IoQueuePair::attach(attach, rings, dma.as_ref(), registers).expect("attach");
        (detached, pair)
    }

    fn attached_rig<E: Executor>(executor: impl FnOnce(IoQueuePair) -> E) -> AttachedRig<E> {
        attached_rig_on_devices(1, |mut pairs| executor(pairs.remove(0)))
    }

    /// [`attached_rig`] whose device table names the controller's namespace `devices` times,
    /// each entry served by an attached pair of its own (`executor` gets them in device order);
    /// the rig's IOCB reads block 0 of each device (device `d`'s into the buffer's block `d`).
    fn attached_rig_on_devices<E: Executor>(devices: usize, executor: impl FnOnce(Vec<IoQueuePair>) -> E) -> AttachedRig<E> {
        use crate::types::{DeviceIndex, Iova, IovaRange, Lba};
        use crate::validate::{Descriptor, DeviceInfo, DeviceTable, IocbSpec, IoctxSpec, RegisteredMemory};
        let config = nvme_emu::EmuConfig::default()
            .with_backing(nvme_emu::Backing::Memory { bytes: 1 << 20 })
            .with_namespaces(vec![nvme_emu::NamespaceConfig::new(512, Some(1024))])
            .with_shared_registers(true);
        let device = nvme_emu::EmuDevice::start(config).expect("software controller");
        let backend: Arc<dyn nvme_driver::hw::DeviceBackend> = device.clone();
        let controller = nvme_driver::Controller::init(backend, nvme_driver::ControllerConfig::default()).expect("bring-up");
        let (detached, pairs): (Vec<_>, Vec<_>) = (0..devices).map(|_| attach_pair(&controller, &device)).unzip();
        let dma = controller.dma();
        let buffer = dma.allocate(64 << 10).expect("DMA buffer");
        let namespace = controller.namespaces()[0];
        let info = DeviceInfo {
            nsid: namespace.id.0,
            capacity_blocks: namespace.size_blocks,
            block_bytes: namespace.block_size_bytes,
            sgl_supported: false,
        };
        let registered = RegisteredMemory::new(vec![IovaRange::new(buffer.iova(), buffer.len() as u64)]).expect("registered");
        let config = crate::layout::QueueConfig { depth: 4, ioctx_per_iocb_max: 4 };
        let mut queue =
            crate::queue::GioQueue::init_queue(config, DeviceTable::new(vec![info; devices]), registered, executor(pairs)).expect("queue");
        let id = queue.get_iocb(1, crate::types::Dependency::None).expect("IOCB")[0];
        let ioctxs: Vec<_> = (0..devices)
            .map(|device| IoctxSpec {
                device: DeviceIndex(device as u16),
                nsid: namespace.id.0,
                start_lba: Lba(0),
                block_count: 1,
                data: Iova(buffer.iova().0 + device as u64 * 512),
                descriptor: Descriptor::Prp { prp2: None },
                force_unit_access: false,
            })
            .collect();
        queue.fill_iocb(id, &IocbSpec::single(Opcode::Read, 0), &ioctxs).expect("fill");
        AttachedRig { queue, id, detached, _buffer: buffer, _controller: controller, device }
    }

    /// Issues the rig's IOCB, waits until its command was executed (its completion posted,
    /// not reaped), retires the queue pairs and checks they are all deleted and the IOCB ended
    /// by its own completion.
    fn retire_an_attached_pair_with_a_completion_not_reaped<E: Executor>(mut rig: AttachedRig<E>, who: &str) {
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        let (executor, memory) = rig.queue.executor_and_memory();
        let _ = executor.poll(memory); // the CPU executor sends its command here
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while io_commands(&rig.device) == 0 && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        std::thread::sleep(std::time::Duration::from_millis(50)); // its completion is posted
        assert_eq!(rig.queue.executor_mut().retire_queue_pairs(), Some(true), "{who}: the attached pair is idle once reaped");
        let done = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(2)).expect("ended");
        assert_eq!(done.result, Ok(()), "{who}: ended by its own completion, not as timed out");
    }

    #[test]
    fn retiring_an_attached_pair_reaps_what_completed_first() {
        // Goal: an attached pair says it is deleted only when none of its commands is in
        // flight, which only reaping lowers: retiring it with a command completed but not
        // reaped used to answer Some(false) (the caller then keeps its memory for good). The
        // retirement reaps first: Some(true), and the IOCB ends with its own completion. The
        // CPU executor's command is sent by a poll and never reaped; a CPU worker reaps on its
        // own, so for it the test shows the retirement does not lose what the worker had.
        retire_an_attached_pair_with_a_completion_not_reaped(attached_rig(|pair| CpuExecutor::new(vec![pair], 4)), "CPU executor");
        let workers = one_worker;
        retire_an_attached_pair_with_a_completion_not_reaped(attached_rig(workers), "CPU workers");
    }

    /// Issues the rig's IOCB (one read per attached pair) with every completion dropped,
    /// waits until each read was executed, and times the retirement: every pair keeps a
    /// command in flight, so none can be deleted.
    fn retire_attached_pairs_whose_completions_were_lost<E: Executor>(mut rig: AttachedRig<E>, devices: u64, who: &str) {
        use nvme_emu::{FaultAction, FaultPlan, FaultRule};
        rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::every_nth_io(1, FaultAction::DropCompletion)));
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        let (executor, memory) = rig.queue.executor_and_memory();
        let _ = executor.poll(memory); // the CPU executor sends its commands here
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while io_commands(&rig.device) < devices && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(io_commands(&rig.device), devices, "{who}: every read was executed, its completion dropped");
        let started = Instant::now();
        let retired = rig.queue.executor_mut().retire_queue_pairs();
        let took = started.elapsed();
        assert_eq!(retired, Some(false), "{who}: every attached pair still holds a command");
        assert!(took < std::time::Duration::from_millis(2500), "{who}: the retirement took {took:?}");
    }

    #[test]
    fn a_retirement_waits_for_all_its_attached_pairs_at_most_once() {
        // Goal: an attached pair whose command's completion was lost can only become idle
        // when its session ends, which the retirement does not bring: each such pair waited
        // ATTACHED_RETIRE_WAIT (2 s) on its own, so three took 6 s, all of it out of the
        // time a close leaves tuttid to confirm the session's end. One deadline serves the
        // whole retirement. Both CPU executors (a worker retires its pairs on its thread).
        let devices = 3;
        let single = attached_rig_on_devices(devices, |pairs| CpuExecutor::new(pairs, 4));
        retire_attached_pairs_whose_completions_were_lost(single, devices as u64, "CPU executor");
        let workers = |pairs: Vec<IoQueuePair>| {
            let served = pairs.into_iter().enumerate().map(|(device, pair)| (crate::types::DeviceIndex(device as u16), pair)).collect();
            crate::CpuWorkers::new(3, vec![served], 4).expect("workers")
        };
        retire_attached_pairs_whose_completions_were_lost(attached_rig_on_devices(devices, workers), devices as u64, "CPU workers");
    }

    #[test]
    fn a_pair_whose_deletion_failed_is_reaped_until_a_reset_deletes_it() {
        // Goal: a reset keeps a pair it could not delete (an attached one with a command in
        // flight) and polls reap it: its completion ends the IOCB as usual and the next reset
        // deletes it. It used to be reaped by nobody, so an attached pair never became idle
        // and every later reset failed.
        use nvme_emu::{FaultAction, FaultPlan, FaultRule};
        let mut rig = attached_rig(|pair| CpuExecutor::new(vec![pair], 4));
        rig.device
            .set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::Delay(std::time::Duration::from_millis(300)))));
        rig.queue.issue_io(&[rig.id], crate::types::LayerIndex(0), crate::types::SmBudget(1)).expect("issue");
        let (executor, memory) = rig.queue.executor_and_memory();
        executor.poll(memory).expect("the command is sent");
        let (detached, fresh) = attach_pair(&rig._controller, &rig.device);
        rig.detached.push(detached);
        let (executor, memory) = rig.queue.executor_and_memory();
        assert!(executor.reset(memory, vec![fresh]).is_err(), "the attached pair holds a command in flight");
        let done = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(2));
        assert!(matches!(done, Ok(crate::queue::Completion { result: Ok(()), .. })), "ended by its own completion: {done:?}");
        let (detached, fresh) = attach_pair(&rig._controller, &rig.device);
        rig.detached.push(detached);
        let (executor, memory) = rig.queue.executor_and_memory();
        assert_eq!(executor.reset(memory, vec![fresh]).expect("the old pair is idle and deleted"), 0);
    }

    /// Refuses every `submit` without consuming the batch (as an executor whose SQ check failed
    /// before it took anything); forwards the rest.
    struct RefusingSubmit<E> {
        inner: E,
    }

    impl<E: Executor> Executor for RefusingSubmit<E> {
        fn name(&self) -> &'static str {
            self.inner.name()
        }
        fn attach(&mut self, memory: &Arc<QueueMemory>) -> Result<(), GioError> {
            self.inner.attach(memory)
        }
        fn prepared(&mut self, memory: &QueueMemory, id: IocbId) -> Result<(), GioError> {
            self.inner.prepared(memory, id)
        }
        fn submit(&mut self, _memory: &QueueMemory, _batch: &IssueBatch) -> Result<(), GioError> {
            Err(GioError::Executor { executor: "refusing", reason: "refused before taking the batch".into() })
        }
        fn poll(&mut self, memory: &QueueMemory) -> Result<(), GioError> {
            self.inner.poll(memory)
        }
    }

    impl<E: crate::executor::QueuePairReset> crate::executor::QueuePairReset for RefusingSubmit<E> {
        fn served_queue_depths(&self) -> Vec<(usize, u32)> {
            self.inner.served_queue_depths()
        }
        fn reset(&mut self, memory: &QueueMemory, fresh: Vec<IoQueuePair>) -> Result<usize, GioError> {
            self.inner.reset(memory, fresh)
        }
    }

    /// Issues the rig's IOCB through a submit that takes nothing, rewrites line 0's issue
    /// sequence number to 5 more, resets, and checks the IOCB ends as TIMEOUT with the issue's
    /// own number (the queue takes the CQE).
    fn a_reset_ends_an_issue_never_taken_with_its_own_seq<E: crate::executor::QueuePairReset>(
        mut rig: EmuRig<RefusingSubmit<E>>,
        who: &str,
    ) {
        use crate::types::{LayerIndex, SmBudget};
        let issued = rig.queue.issue_io(&[rig.id], LayerIndex(0), SmBudget(1));
        assert!(matches!(issued, Err(GioError::SubmitFailed { .. })), "{who}: {issued:?}");
        let memory = rig.queue.memory();
        let seq = memory.layout.iocb_offset(rig.id) + core::mem::offset_of!(abi::gio_iocb, issue_seq);
        let rewritten = memory.read_iocb_header(rig.id).issue_seq.wrapping_add(5);
        memory.region.store_u32(seq, rewritten, std::sync::atomic::Ordering::Relaxed);
        let fresh = rig.controller.create_io_queue_pair(16).expect("fresh I/O queue pair");
        assert_eq!(rig.queue.reset_queue_pairs(vec![fresh]).expect("reset"), 1, "{who}");
        let ended = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(2));
        assert!(
            matches!(ended, Ok(crate::queue::Completion { result: Err(crate::IocbFailure::Timeout { ioctx_index: None }), .. })),
            "{who}: {ended:?}"
        );
    }

    #[test]
    fn a_reset_ends_an_issue_never_taken_with_its_own_seq_whatever_line_0_says() {
        // Goal: an issue whose SQ entry no submit took is ended by the reset with the number
        // the queue gave it (one more than the last issue taken), whatever line 0 holds by
        // then: a line 0 rewritten to any other number made the reset post the last issue's
        // number, the queue dropped the CQE as stale, and the IOCB stayed in flight for ever.
        let single = emu_rig(|pair| RefusingSubmit { inner: CpuExecutor::new(vec![pair], 4) });
        a_reset_ends_an_issue_never_taken_with_its_own_seq(single, "CPU executor");
        let workers = one_worker;
        a_reset_ends_an_issue_never_taken_with_its_own_seq(emu_rig(|pair| RefusingSubmit { inner: workers(pair) }), "CPU workers");
    }

    #[test]
    fn executors_serving_fewer_devices_than_the_table_are_refused_at_init() {
        // Goal: a CPU executor with queue pairs (or workers) for fewer devices than the queue's
        // device table is a configuration error, refused by init_queue as InvalidConfig; it
        // used to be accepted and then failed every IOCTX on a missing device, at each issue,
        // as INVALID_IOCTX, blaming the request. Zero workers are refused by CpuWorkers::new.
        use crate::types::IovaRange;
        use crate::validate::{DeviceInfo, DeviceTable, RegisteredMemory};
        let config = nvme_emu::EmuConfig::default()
            .with_backing(nvme_emu::Backing::Memory { bytes: 1 << 20 })
            .with_namespaces(vec![nvme_emu::NamespaceConfig::new(512, Some(1024))]);
        let device = nvme_emu::EmuDevice::start(config).expect("software controller");
        let backend: Arc<dyn nvme_driver::hw::DeviceBackend> = device.clone();
        let controller = nvme_driver::Controller::init(backend, nvme_driver::ControllerConfig::default()).expect("bring-up");
        let namespace = controller.namespaces()[0];
        let info = DeviceInfo {
            nsid: namespace.id.0,
            capacity_blocks: namespace.size_blocks,
            block_bytes: namespace.block_size_bytes,
            sgl_supported: false,
        };
        let buffer = controller.dma().allocate(4096).expect("DMA buffer");
        let registered = || RegisteredMemory::new(vec![IovaRange::new(buffer.iova(), buffer.len() as u64)]).expect("registered");
        let config = crate::layout::QueueConfig { depth: 4, ioctx_per_iocb_max: 4 };
        let two_devices = || DeviceTable::new(vec![info; 2]);
        let single = CpuExecutor::new(vec![controller.create_io_queue_pair(16).expect("pair")], 4);
        let refused = crate::queue::GioQueue::init_queue(config, two_devices(), registered(), single).map(|_| ());
        assert!(matches!(&refused, Err(GioError::InvalidConfig { .. })), "CPU executor: {refused:?}");
        let pair = controller.create_io_queue_pair(16).expect("pair");
        let workers = one_worker(pair);
        let refused = crate::queue::GioQueue::init_queue(config, two_devices(), registered(), workers).map(|_| ());
        assert!(matches!(&refused, Err(GioError::InvalidConfig { .. })), "CPU workers: {refused:?}");
        let none = crate::CpuWorkers::new(0, Vec::new(), 4).map(|_| ());
        assert!(matches!(&none, Err(GioError::InvalidConfig { .. })), "zero workers: {none:?}");
    }

    /// Issues the rig's IOCB and waits for it, then sets its status back to ISSUED (another
    /// agent's rewrite of an idle IOCB), resets, and checks the IOCB still issues and completes.
    fn a_reset_after_a_status_rewrite_keeps_the_iocb_usable<E: crate::executor::QueuePairReset>(mut rig: EmuRig<E>, who: &str) {
        use crate::types::{LayerIndex, SmBudget};
        rig.queue.issue_io(&[rig.id], LayerIndex(0), SmBudget(1)).expect("issue");
        let done = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5)).expect("completes");
        assert_eq!(done.result, Ok(()), "{who}");
        let memory = rig.queue.memory();
        let status = memory.iocb_field_offset(rig.id, crate::layout::IocbField::Status);
        memory.region.store_u32(status, abi::GIO_IOCB_STATUS_ISSUED, std::sync::atomic::Ordering::Release);
        let fresh = rig.controller.create_io_queue_pair(16).expect("fresh I/O queue pair");
        rig.queue.reset_queue_pairs(vec![fresh]).expect("reset");
        // The reset ends the rewritten IOCB with a CQE for no issue of the queue's: refused.
        let refused = rig.queue.peek_cqe();
        assert!(matches!(refused, Err(GioError::UnexpectedCompletion { .. })), "{who}: {refused:?}");
        rig.queue.issue_io(&[rig.id], LayerIndex(1), SmBudget(1)).expect("reissue");
        let again = rig.queue.wait_cqe(rig.id, Instant::now() + std::time::Duration::from_secs(5));
        assert!(matches!(again, Ok(crate::queue::Completion { result: Ok(()), .. })), "{who}: {again:?}");
    }

    #[test]
    fn a_status_rewritten_to_issued_on_an_idle_iocb_does_not_lose_it_at_a_reset() {
        // Goal: a reset that finds an IOCB ISSUED whose issue no submit took ends it with the
        // number the queue gave its last issue (host memory), not one more than the last
        // issue taken whatever happened: an idle IOCB whose status another agent set back to
        // ISSUED has no such issue, and counting one made the executor expect S + 2 from the
        // queue's next issue S + 1, so every later issue was refused (CorruptIocb) and ended
        // with a number the queue dropped as stale: the IOCB was lost for good. Both CPU
        // executors.
        a_reset_after_a_status_rewrite_keeps_the_iocb_usable(emu_rig(|pair| CpuExecutor::new(vec![pair], 4)), "CPU executor");
        let workers = one_worker;
        a_reset_after_a_status_rewrite_keeps_the_iocb_usable(emu_rig(workers), "CPU workers");
    }

    #[test]
    fn tags_round_trip_and_statuses_keep_their_fields() {
        assert_eq!(untag(tag(IocbId(7), 0x1_2345, 2047)), (IocbId(7), 0x1_2345, 2047));
        let last = IocbId(abi::GIO_RING_DEPTH_MAX - 1);
        assert_eq!(untag(tag(last, u32::MAX, abi::MAX_IOCTX_PER_IOCB - 1)), (last, u32::MAX, abi::MAX_IOCTX_PER_IOCB - 1));
        let (_, _, lent_index) = untag(crate::executor::LENT_COMMAND_TAG);
        assert!(lent_index >= abi::MAX_IOCTX_PER_IOCB, "a lent command's tag names no IOCTX of any IOCB");
        let media = DriverStatus { code_type: StatusCodeType::from_u8(2), code: 0x81, do_not_retry: true, more: false };
        let status = abi_status(media);
        assert_eq!((status.status_code_type(), status.status_code(), status.do_not_retry()), (2, 0x81, true));
    }

    #[test]
    fn commands_follow_the_descriptor_kind_and_the_layer_rule() {
        let header = IocbHeader {
            id: 1,
            ioctx_count: 1,
            ioctx_first: 0,
            layer_count: 4,
            layer: 3,
            issue_seq: 1,
            opcode: Opcode::Write.to_abi(),
            user_data: 0,
            lba_stride_blocks: 100,
            mem_stride_bytes: 0x1000,
            desc_stride_bytes: 0x20,
        };
        let mut ioctx = abi::gio_ioctx {
            desc_iova: 0,
            data_iova: 0x10000,
            start_lba: 5,
            nsid: 1,
            block_count: 8,
            data_bytes: 4096,
            desc_bytes: 0,
            device_index: 0,
            descriptor_kind: abi::GIO_DESCRIPTOR_SGL as u8,
            flags: abi::GIO_IOCTX_FLAG_FUA as u8,
            reserved0: 0,
        };
        let inline = CpuExecutor::command(&header, &ioctx).unwrap();
        assert_eq!(inline.psdt(), 1);
        assert_eq!(inline.starting_lba().0, 305);
        assert_eq!(inline.block_count(), 8);
        assert!(inline.force_unit_access());
        assert_eq!(inline.dptr, [0x13000, 4096]);
        ioctx.desc_iova = 0x8000;
        ioctx.desc_bytes = 32;
        let segment = CpuExecutor::command(&header, &ioctx).unwrap();
        assert_eq!(segment.dptr, [0x8060, 32 | 0x30 << 56]);
        ioctx.descriptor_kind = abi::GIO_DESCRIPTOR_PRP as u8;
        let prp = CpuExecutor::command(&header, &ioctx).unwrap();
        assert_eq!((prp.psdt(), prp.dptr), (0, [0x13000, 0x8060]));
        ioctx.descriptor_kind = 9;
        assert!(CpuExecutor::command(&header, &ioctx).is_none());
    }

    #[test]
    fn commands_are_built_exactly_when_the_ioctx_command_rule_accepts() {
        // Goal: CpuExecutor::command refuses what the shared rule (abi::ioctx_command, the
        // kernel's gio_ioctx_command) refuses — any opcode but Read and Write, a block count
        // outside 1..=65536, an overflowing per-layer address — and builds the rest.
        let ioctx = abi::gio_ioctx {
            desc_iova: 0x8000,
            data_iova: 0x10000,
            start_lba: 5,
            nsid: 1,
            block_count: 8,
            data_bytes: 4096,
            desc_bytes: 32,
            device_index: 0,
            descriptor_kind: abi::GIO_DESCRIPTOR_PRP as u8,
            flags: 0,
            reserved0: 0,
        };
        let header = |opcode: u8, stride: u64| IocbHeader {
            id: 1,
            ioctx_count: 1,
            ioctx_first: 0,
            layer_count: 4,
            layer: 3,
            issue_seq: 1,
            opcode,
            user_data: 0,
            lba_stride_blocks: stride,
            mem_stride_bytes: stride,
            desc_stride_bytes: stride,
        };
        for opcode in 0..=u8::MAX {
            for block_count in [0, 1, 65536, 65537, u32::MAX] {
                for stride in [0x20, u64::MAX / 3 + 1, u64::MAX / 3 - 1] {
                    let ioctx = abi::gio_ioctx { block_count, ..ioctx };
                    let header = header(opcode, stride);
                    let layer = abi::IocbLayer {
                        opcode,
                        layer: header.layer,
                        lba_stride_blocks: stride,
                        mem_stride_bytes: stride,
                        desc_stride_bytes: stride,
                    };
                    let rule = abi::ioctx_command(&layer, &ioctx);
                    let built = CpuExecutor::command(&header, &ioctx);
                    assert_eq!(built.is_some(), rule.is_some(), "opcode {opcode:#x}, {block_count} blocks, stride {stride:#x}");
                    let expected = matches!(opcode, 0x01 | 0x02) && (1..=65536).contains(&block_count) && stride == 0x20;
                    assert_eq!(built.is_some(), expected, "opcode {opcode:#x}, {block_count} blocks, stride {stride:#x}");
                }
            }
        }
    }
}
