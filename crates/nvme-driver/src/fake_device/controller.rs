//! The fake's register file and queues: what a register write or a doorbell does.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::{FakeCounters, FakeScript};
use crate::hw::{DmaAllocator, DmaPool, RegisterIo};
use crate::spec::registers::{self, ControllerConfiguration};
use crate::spec::status::codes;
use crate::spec::{
    AdminOpcode, CompletionEntry, NvmeStatus, SubmissionEntry, COMPLETION_ENTRY_BYTES, IDENTIFY_BYTES, SUBMISSION_ENTRY_BYTES,
};
use crate::types::Iova;

/// Bytes of BAR0 the fake exposes: registers and the doorbells of queues 0..=63 at stride 0.
pub(super) const BAR_BYTES: usize = 0x2000;
/// Highest queue id the fake accepts (its doorbells must fit in `BAR_BYTES` at DSTRD 0).
const QUEUE_ID_MAX: u16 = 63;
/// CSTS bits (§3.1.3.6).
const CSTS_READY: u32 = 1;
const CSTS_SHUTDOWN_COMPLETE: u32 = 0x2 << 2;
const CSTS_SHUTDOWN_MASK: u32 = 0x3 << 2;

#[derive(Debug, Clone, Copy)]
pub(super) struct SubmissionRing {
    iova: u64,
    entries: u32,
    head: u32,
    completion_queue: u16,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct CompletionRing {
    iova: u64,
    entries: u32,
    tail: u32,
    /// The head the host last wrote to this queue's CQ head doorbell.
    pub(super) head: u32,
    phase: bool,
}

impl CompletionRing {
    fn new(iova: u64, entries: u32) -> Self {
        Self { iova, entries, tail: 0, head: 0, phase: true }
    }

    /// Full as the controller sees it (§4.6: one entry always stays empty).
    fn is_full(&self) -> bool {
        (self.tail + 1) % self.entries == self.head
    }
}

pub(super) struct FakeState {
    pub(super) script: FakeScript,
    pub(super) cc: u32,
    pub(super) csts: u32,
    pub(super) aqa: u32,
    pub(super) asq: u64,
    pub(super) acq: u64,
    pub(super) submission: BTreeMap<u16, SubmissionRing>,
    pub(super) completion: BTreeMap<u16, CompletionRing>,
    /// Completions waiting for room in their CQ, oldest first, with their `keep_phase`.
    pub(super) held: BTreeMap<u16, VecDeque<(CompletionEntry, bool)>>,
    /// Completions posted again into every entry of their CQ that a head doorbell frees
    /// ([`FakeDevice::keep_posting`]), until a disable or the CQ's deletion.
    pub(super) endless: BTreeMap<u16, CompletionEntry>,
    pub(super) counters: FakeCounters,
    /// Admin commands fetched and left unanswered (`admin_unanswered`), oldest first, until
    /// [`FakeDevice::answer_withheld`] or a disable.
    pub(super) withheld: Vec<SubmissionEntry>,
    /// CSTS reads left before an enable in progress sets RDY (`None`: no enable in progress).
    pub(super) enabling_reads_left: Option<u32>,
    /// When the enable in progress started (`None`: none, or one the fake started in, which
    /// waits for reads only).
    pub(super) enabling_since: Option<Instant>,
    /// Still enabled as the script started it (`starts_enabled`, `starts_enabling`): no disable
    /// has reached CSTS.RDY = 0 yet.
    pub(super) left_enabled: bool,
    /// Bus Master Enable: without it the fake does no DMA (fetches no command).
    pub(super) bus_master: bool,
    /// When the shutdown in progress (CSTS.SHST = 01b) started (`None`: none in progress).
    pub(super) shutdown_started: Option<Instant>,
}

pub(super) struct FakeRegisters {
    state: Mutex<FakeState>,
    pool: Arc<DmaPool>,
}

impl FakeRegisters {
    pub(super) fn new(script: FakeScript, pool: Arc<DmaPool>) -> Self {
        let (cc, csts, enabling_reads_left) = match (script.starts_enabled, script.starts_enabling) {
            (true, _) => (1, CSTS_READY, None),
            (false, true) => (1, 0, Some(script.enable_ready_after_status_reads)),
            (false, false) => (0, 0, None),
        };
        let left_enabled = cc == 1;
        let bus_master = script.starts_mastering;
        let state = FakeState {
            script,
            cc,
            csts,
            aqa: 0,
            asq: 0,
            acq: 0,
            submission: BTreeMap::new(),
            completion: BTreeMap::new(),
            counters: FakeCounters::default(),
            held: BTreeMap::new(),
            endless: BTreeMap::new(),
            withheld: Vec::new(),
            enabling_reads_left,
            enabling_since: None,
            left_enabled,
            bus_master,
            shutdown_started: None,
        };
        Self { state: Mutex::new(state), pool }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl FakeState {
    pub(super) fn disable(&mut self) {
        self.counters.disables += 1;
        self.enabling_since = None;
        if self.enabling_reads_left.take().is_some() {
            self.counters.disables_before_ready += 1;
        }
        self.submission.clear();
        self.completion.clear();
        self.held.clear();
        self.endless.clear();
        self.withheld.clear();
        if self.script.disable_completes {
            self.csts &= !CSTS_READY;
            self.left_enabled = false;
        }
    }

    /// The driver mapped memory for DMA: counted if the controller still runs as it was found
    /// and can master the bus.
    pub(super) fn note_mapping(&mut self) {
        if self.left_enabled && self.bus_master {
            self.counters.mappings_while_left_enabled += 1;
        }
    }

    /// A shutdown in progress reads complete once its scripted time has passed.
    fn advance_shutdown(&mut self) {
        if self.shutdown_started.is_some_and(|started| started.elapsed() >= self.script.shutdown_takes) {
            self.shutdown_started = None;
            self.csts = self.csts & !CSTS_SHUTDOWN_MASK | CSTS_SHUTDOWN_COMPLETE;
        }
    }

    fn write_cc(&mut self, value: u32) {
        self.advance_shutdown();
        let was_enabled = self.cc & 1 == 1;
        self.cc = value;
        let configuration = ControllerConfiguration(value);
        if configuration.enabled() && !was_enabled {
            let (sq_entries, cq_entries) = registers::decode_admin_queue_attributes(self.aqa);
            self.submission.insert(0, SubmissionRing { iova: self.asq, entries: sq_entries, head: 0, completion_queue: 0 });
            self.completion.insert(0, CompletionRing::new(self.acq, cq_entries));
            match (self.script.enable_ready_after_status_reads, self.script.enable_takes.is_zero()) {
                (0, true) => self.csts |= CSTS_READY,
                (reads, _) => {
                    self.enabling_reads_left = Some(reads);
                    self.enabling_since = Some(Instant::now());
                }
            }
        } else if !configuration.enabled() && was_enabled {
            if self.shutdown_started.is_some() {
                self.counters.disables_during_shutdown += 1;
            }
            self.disable();
        }
        if value >> 14 & 0x3 == 0 {
            self.shutdown_started = None;
            self.csts &= !CSTS_SHUTDOWN_MASK;
        } else if self.csts & CSTS_SHUTDOWN_MASK == 0 && self.shutdown_started.is_none() {
            // A new shutdown request (one in progress or complete is left as it is).
            self.csts |= u32::from(self.script.shutdown_status_in_progress & 0x3) << 2;
            self.shutdown_started = Some(Instant::now());
            self.advance_shutdown();
        }
    }

    fn ring_submission(&mut self, pool: &DmaPool, queue_id: u16, tail: u32) {
        let Some(mut ring) = self.submission.get(&queue_id).copied() else {
            self.counters.doorbells_for_missing_queues += 1;
            return;
        };
        if tail >= ring.entries || self.csts & CSTS_READY == 0 {
            return;
        }
        if !self.bus_master {
            self.counters.doorbells_without_bus_master += 1;
            return;
        }
        // Bounded: at most entries − 1 commands between head and tail.
        while ring.head != tail {
            let offset = u64::from(ring.head) * SUBMISSION_ENTRY_BYTES as u64;
            ring.head = (ring.head + 1) % ring.entries;
            self.submission.insert(queue_id, ring);
            let mut bytes = [0u8; SUBMISSION_ENTRY_BYTES];
            let entry_address = Iova(ring.iova).checked_add(offset);
            let fetched = entry_address.map(|at| pool.translate(at, SUBMISSION_ENTRY_BYTES).and_then(|region| region.read(0, &mut bytes)));
            if !matches!(fetched, Some(Ok(()))) {
                return; // a real controller would set CFS; the test sees no completion
            }
            *self.counters.commands_by_queue.entry(queue_id).or_default() += 1;
            let entry = SubmissionEntry::from_bytes(&bytes);
            let completion = if queue_id == 0 { self.execute_admin(pool, &entry) } else { self.execute_io(queue_id, &entry) };
            let Some(completion) = completion else { continue };
            self.post(pool, ring.completion_queue, completion, queue_id != 0 && self.script.io_phase_from_script);
            ring = match self.submission.get(&queue_id) {
                Some(ring) => *ring,
                None => return, // the command deleted its own queue
            };
        }
    }

    /// Posts `entry`, or holds it (in order) while its CQ is full by the head the host wrote.
    pub(super) fn post(&mut self, pool: &DmaPool, completion_queue: u16, entry: CompletionEntry, keep_phase: bool) {
        let Some(ring) = self.completion.get_mut(&completion_queue) else { return };
        if ring.is_full() || self.held.get(&completion_queue).is_some_and(|held| !held.is_empty()) {
            self.counters.completions_held_for_room += 1;
            self.held.entry(completion_queue).or_default().push_back((entry, keep_phase));
            return;
        }
        Self::write_completion(pool, ring, entry, keep_phase);
    }

    /// A CQ head doorbell write: records the head (a value outside the ring is ignored) and
    /// posts what was held for the room it frees, then the CQ's endless completion, if any, into
    /// the rest.
    fn ring_completion(&mut self, pool: &DmaPool, completion_queue: u16, head: u32) {
        let Some(ring) = self.completion.get_mut(&completion_queue) else { return };
        *self.counters.completion_doorbells_by_queue.entry(completion_queue).or_default() += 1;
        if head >= ring.entries {
            return;
        }
        if head == ring.head {
            self.counters.repeated_completion_heads += 1;
        }
        ring.head = head;
        if let Some(held) = self.held.get_mut(&completion_queue) {
            while !ring.is_full() {
                let Some((entry, keep_phase)) = held.pop_front() else { break };
                Self::write_completion(pool, ring, entry, keep_phase);
            }
        }
        self.fill_with_endless(pool, completion_queue);
    }

    /// Posts CQ `completion_queue`'s endless completion into every free entry (nothing while
    /// completions are held for room: those go first).
    pub(super) fn fill_with_endless(&mut self, pool: &DmaPool, completion_queue: u16) {
        let (Some(ring), Some(&entry)) = (self.completion.get_mut(&completion_queue), self.endless.get(&completion_queue)) else {
            return;
        };
        if self.held.get(&completion_queue).is_some_and(|held| !held.is_empty()) {
            return;
        }
        while !ring.is_full() {
            Self::write_completion(pool, ring, entry, false);
        }
    }

    fn write_completion(pool: &DmaPool, ring: &mut CompletionRing, mut entry: CompletionEntry, keep_phase: bool) {
        if !keep_phase {
            entry.status_and_phase = entry.status_and_phase & !1 | u16::from(ring.phase);
        }
        let offset = u64::from(ring.tail) * COMPLETION_ENTRY_BYTES as u64;
        if let Some(Ok(region)) = Iova(ring.iova).checked_add(offset).map(|at| pool.translate(at, COMPLETION_ENTRY_BYTES)) {
            let bytes = entry.to_bytes();
            let dword3 = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
            let _ = region.write(0, &bytes[..CompletionEntry::DWORD3_OFFSET]);
            let _ = region.store_u32(CompletionEntry::DWORD3_OFFSET, dword3, Ordering::Release);
        }
        ring.tail += 1;
        if ring.tail == ring.entries {
            ring.tail = 0;
            ring.phase = !ring.phase;
        }
    }

    pub(super) fn completion_for(&self, queue_id: u16, entry: &SubmissionEntry, dw0: u32, status: Option<NvmeStatus>) -> CompletionEntry {
        let head = self.submission.get(&queue_id).map_or(0, |ring| ring.head) as u16;
        let status_field = status.map_or(0, |status| status.to_status_field());
        CompletionEntry {
            dw0,
            dw1: 0,
            sq_head: head,
            sq_id: queue_id,
            command_id: entry.command_id().0,
            status_and_phase: status_field << 1,
        }
    }

    fn to_host(pool: &DmaPool, address: u64, data: &[u8]) -> Option<NvmeStatus> {
        let mut page = data.to_vec();
        page.resize(IDENTIFY_BYTES, 0);
        match pool.translate(Iova(address), IDENTIFY_BYTES).and_then(|region| region.write(0, &page)) {
            Ok(()) => None,
            Err(_) => Some(NvmeStatus::generic(codes::DATA_TRANSFER_ERROR)),
        }
    }

    fn execute_admin(&mut self, pool: &DmaPool, entry: &SubmissionEntry) -> Option<CompletionEntry> {
        let opcode = entry.opcode();
        let identify_unanswered =
            opcode == AdminOpcode::Identify as u8 && self.script.identify_unanswered.contains(&((entry.cdw10 & 0xFF) as u8));
        if self.script.admin_unanswered.contains(&opcode) || identify_unanswered {
            // Bounded by the admin queue: a command stays here while its slot stays busy in the
            // driver, and a disable clears them all.
            self.withheld.push(*entry);
            return None;
        }
        Some(self.run_admin(pool, entry))
    }

    /// Executes admin command `entry` (scripted failures first) and returns its completion.
    pub(super) fn run_admin(&mut self, pool: &DmaPool, entry: &SubmissionEntry) -> CompletionEntry {
        let opcode = entry.opcode();
        if let Some(&(_, status)) = self.script.admin_failures.iter().find(|(failing, _)| *failing == opcode) {
            return self.completion_for(0, entry, 0, Some(status));
        }
        let queue_id = (entry.cdw10 & 0xFFFF) as u16;
        let entries = (entry.cdw10 >> 16) + 1;
        let invalid_queue = Some(NvmeStatus::command_specific(codes::INVALID_QUEUE_IDENTIFIER));
        let (dw0, status) = match AdminOpcode::from_u8(opcode) {
            Some(AdminOpcode::Identify) => {
                let cns = (entry.cdw10 & 0xFF) as u8;
                if let Some(&(_, status)) = self.script.identify_failures.iter().find(|(failing, _)| *failing == cns) {
                    return self.completion_for(0, entry, 0, Some(status));
                }
                let data = match cns {
                    0x01 => self.script.identify_controller.clone(),
                    0x02 => self.script.namespace_list.clone(),
                    // The NVM command set's (CSI 00h, CDW11 31:24) only.
                    0x06 if entry.cdw11 >> 24 == 0 && !self.script.nvm_identify_controller.is_empty() => {
                        self.script.nvm_identify_controller.clone()
                    }
                    0x00 => {
                        if let Some(&(_, status)) = self.script.identify_namespace_failures.iter().find(|(nsid, _)| *nsid == entry.nsid) {
                            return self.completion_for(0, entry, 0, Some(status));
                        }
                        let index = usize::try_from(entry.nsid).ok().and_then(|nsid| nsid.checked_sub(1));
                        index.and_then(|index| self.script.identify_namespaces.get(index)).cloned().unwrap_or_default()
                    }
                    _ => return self.completion_for(0, entry, 0, Some(NvmeStatus::generic(codes::INVALID_FIELD))),
                };
                (0, Self::to_host(pool, entry.dptr[0], &data))
            }
            Some(AdminOpcode::GetLogPage) => {
                let log = (entry.cdw10 & 0xFF) as u8;
                // NUMD (0-based): NUMDL in CDW10 31:16, NUMDU in CDW11 15:0.
                let dwords = ((entry.cdw10 >> 16) | (entry.cdw11 & 0xFFFF) << 16) as usize + 1;
                match self.script.log_pages.iter().find(|(id, _)| *id == log) {
                    Some(_) if dwords * 4 > IDENTIFY_BYTES => (0, Some(NvmeStatus::generic(codes::INVALID_FIELD))),
                    Some((_, page)) => {
                        let mut data = page.clone();
                        data.resize(dwords * 4, 0);
                        let written = pool.translate(Iova(entry.dptr[0]), data.len()).and_then(|region| region.write(0, &data));
                        (0, written.err().map(|_| NvmeStatus::generic(codes::DATA_TRANSFER_ERROR)))
                    }
                    None => (0, None),
                }
            }
            Some(AdminOpcode::SetFeatures) if entry.cdw10 & 0xFF == 0x07 => (self.script.number_of_queues_dw0, None),
            Some(AdminOpcode::CreateIoCompletionQueue) if (1..=QUEUE_ID_MAX).contains(&queue_id) => {
                self.completion.insert(queue_id, CompletionRing::new(entry.dptr[0], entries));
                (0, None)
            }
            Some(AdminOpcode::CreateIoSubmissionQueue) if (1..=QUEUE_ID_MAX).contains(&queue_id) => {
                let completion_queue = (entry.cdw11 >> 16) as u16;
                self.submission.insert(queue_id, SubmissionRing { iova: entry.dptr[0], entries, head: 0, completion_queue });
                (0, None)
            }
            Some(AdminOpcode::DeleteIoSubmissionQueue) => (0, self.submission.remove(&queue_id).map_or(invalid_queue, |_| None)),
            Some(AdminOpcode::DeleteIoCompletionQueue) => {
                self.held.remove(&queue_id);
                self.endless.remove(&queue_id);
                (0, self.completion.remove(&queue_id).map_or(invalid_queue, |_| None))
            }
            Some(AdminOpcode::CreateIoCompletionQueue | AdminOpcode::CreateIoSubmissionQueue) => (0, invalid_queue),
            _ => (0, None),
        };
        self.completion_for(0, entry, dw0, status)
    }

    fn execute_io(&mut self, queue_id: u16, entry: &SubmissionEntry) -> Option<CompletionEntry> {
        if self.script.io_unanswered {
            self.counters.io_unanswered += 1;
            return None;
        }
        // Scripted bytes are posted as they are (every field is the script's to choose).
        match self.script.io_completions.pop_front() {
            Some(bytes) => Some(CompletionEntry::from_bytes(&bytes)),
            None => Some(self.completion_for(queue_id, entry, 0, None)),
        }
    }
}

impl RegisterIo for FakeRegisters {
    fn len(&self) -> usize {
        BAR_BYTES
    }

    fn read32(&self, offset: usize) -> u32 {
        let mut state = self.lock();
        if state.cc & 1 == 0 && state.script.disable_completes {
            // A disable the script held back completes once the script allows it.
            state.csts &= !CSTS_READY;
            state.left_enabled = false;
        }
        if state.script.status_bits == u32::MAX {
            return u32::MAX;
        }
        match offset {
            registers::CAP => state.script.capabilities as u32,
            0x04 => (state.script.capabilities >> 32) as u32,
            registers::VS => state.script.version,
            registers::CC => state.cc,
            // RDY comes from the state alone, so a script cannot leave a bounded wait spinning
            // for its whole CAP.TO by forcing it.
            registers::CSTS => {
                state.advance_shutdown();
                // An enable in progress reaches RDY after its scripted number of reads and time.
                let enable_takes = state.script.enable_takes;
                let waited = state.enabling_since.is_none_or(|since| since.elapsed() >= enable_takes);
                match state.enabling_reads_left {
                    Some(0) if waited => {
                        state.enabling_reads_left = None;
                        state.enabling_since = None;
                        state.csts |= CSTS_READY;
                    }
                    Some(0) => {}
                    Some(left) => state.enabling_reads_left = Some(left - 1),
                    None => {}
                }
                state.csts | state.script.status_bits & !CSTS_READY
            }
            registers::AQA => state.aqa,
            registers::ASQ => state.asq as u32,
            0x2C => (state.asq >> 32) as u32,
            registers::ACQ => state.acq as u32,
            0x34 => (state.acq >> 32) as u32,
            registers::CRTO => state.script.ready_timeouts,
            _ => 0,
        }
    }

    fn write32(&self, offset: usize, value: u32) {
        let mut state = self.lock();
        match offset {
            registers::CC => state.write_cc(value),
            registers::AQA => state.aqa = value,
            registers::ASQ => state.asq = state.asq & !0xFFFF_FFFF | u64::from(value),
            registers::ACQ => state.acq = state.acq & !0xFFFF_FFFF | u64::from(value),
            offset if (registers::DOORBELL_BASE..BAR_BYTES).contains(&offset) => {
                let index = (offset - registers::DOORBELL_BASE) / 4;
                if index.is_multiple_of(2) {
                    state.ring_submission(&self.pool, (index / 2) as u16, value);
                } else {
                    state.ring_completion(&self.pool, (index / 2) as u16, value);
                }
            }
            _ => {}
        }
    }

    fn read64(&self, offset: usize) -> u64 {
        u64::from(self.read32(offset)) | u64::from(self.read32(offset + 4)) << 32
    }

    fn write64(&self, offset: usize, value: u64) {
        let mut state = self.lock();
        match offset {
            registers::ASQ => state.asq = value,
            registers::ACQ => state.acq = value,
            _ => {}
        }
    }
}
