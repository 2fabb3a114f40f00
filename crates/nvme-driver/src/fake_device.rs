//! A scripted NVMe controller at the hardware seam, for unit tests and fuzzing of the driver's
//! handling of untrusted device data (feature `fake-device`; always built for this crate's
//! tests).
//!
//! [`FakeDevice`] implements [`DeviceBackend`]. Unlike the software controller (`nvme-emu`) it
//! has no thread and no storage: a register write does its work before returning — CC.EN sets
//! or clears CSTS.RDY, CC.SHN completes the shutdown, and an SQ tail doorbell fetches the new
//! entries and posts their completions at once. What it answers comes from a [`FakeScript`]:
//! CAP, VS, extra CSTS bits, the Identify Controller / Namespace / Active Namespace List data,
//! Set Features Number of Queues dw0, admin opcodes to fail or leave unanswered (a test can
//! answer them later, [`FakeDevice::answer_withheld`]), and raw I/O completion entries. So a test (or a fuzzer, through [`run_fuzz_input`]) can hand the driver
//! any register file and Identify data a broken or hostile device could produce, deterministically.
//!
//! It trusts the driver no more than a device would: unmapped addresses and out-of-range queue
//! values are ignored or answered with an error status, never a panic.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::controller::{Controller, ControllerConfig};
use crate::hw::{DeviceBackend, DmaAllocator, DmaPool, HwError, RegisterIo};
use crate::spec::registers::{self, Capabilities, ControllerConfiguration};
use crate::spec::status::codes;
use crate::spec::{
    AdminOpcode, CompletionEntry, NvmeStatus, SubmissionEntry, COMPLETION_ENTRY_BYTES, IDENTIFY_BYTES, SUBMISSION_ENTRY_BYTES,
};
use crate::types::{Iova, NamespaceId};

/// Bytes of BAR0 the fake exposes: registers and the doorbells of queues 0..=63 at stride 0.
const BAR_BYTES: usize = 0x2000;
/// Highest queue id the fake accepts (its doorbells must fit in `BAR_BYTES` at DSTRD 0).
const QUEUE_ID_MAX: u16 = 63;
/// CSTS bits (§3.1.3.6).
const CSTS_READY: u32 = 1;
const CSTS_SHUTDOWN_COMPLETE: u32 = 0x2 << 2;

/// What the fake controller answers. `FakeScript::default()` is a small, well-formed controller:
/// NVMe 1.4, MQES 256, CAP.TO 1 (500 ms), one namespace of 4 KiB blocks, SGL support, MDTS 5.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeScript {
    /// CAP (read-only; the fake honours only MQES's use by the driver, not DSTRD).
    pub capabilities: u64,
    /// VS.
    pub version: u32,
    /// OR-ed into every CSTS read (e.g. CFS); `u32::MAX` reads as a device that is gone.
    pub status_bits: u32,
    /// Whether clearing CC.EN clears CSTS.RDY (false: a controller that never stops).
    pub disable_completes: bool,
    /// Identify Controller data (padded with zeroes or cut to 4096 bytes).
    pub identify_controller: Vec<u8>,
    /// Active Namespace ID list data (CNS 02h).
    pub namespace_list: Vec<u8>,
    /// Identify Namespace data for NSID 1, 2, ... (missing ones read as zeroes: inactive).
    pub identify_namespaces: Vec<Vec<u8>>,
    /// Completion dword 0 of Set Features / Number of Queues.
    pub number_of_queues_dw0: u32,
    /// Admin opcodes completed with this status field instead of being executed.
    pub admin_failures: Vec<(u8, NvmeStatus)>,
    /// Admin opcodes fetched but never completed (the driver's admin timeout fires).
    pub admin_unanswered: Vec<u8>,
    /// Raw completion entries for I/O commands, used one per command fetched, in order; once
    /// they run out, each command gets a well-formed success completion.
    pub io_completions: VecDeque<[u8; COMPLETION_ENTRY_BYTES]>,
    /// Keep the phase bit of `io_completions` as scripted (true) or replace it with the right
    /// one (false), so that the rest of the entry is what the driver gets to judge.
    pub io_phase_from_script: bool,
    /// CSTS reads after CC.EN goes to 1 before CSTS.RDY does (0: at once). A disable while
    /// RDY is still 0 is counted (`FakeCounters::disables_before_ready`).
    pub enable_ready_after_status_reads: u32,
    /// The fake starts as a crashed process left it mid-enable: CC.EN = 1, CSTS.RDY = 0 until
    /// `enable_ready_after_status_reads` CSTS reads.
    pub starts_enabling: bool,
}

/// Identify Namespace data with one LBA format (format 0) in use: `block_size_bytes` (a power
/// of two) of data and `metadata_bytes` of metadata per block, interleaved when `extended_lba`.
pub fn identify_namespace_bytes(block_size_bytes: u32, size_blocks: u64, metadata_bytes: u16, extended_lba: bool) -> Vec<u8> {
    let mut bytes = vec![0u8; IDENTIFY_BYTES];
    bytes[0..8].copy_from_slice(&size_blocks.to_le_bytes());
    bytes[8..16].copy_from_slice(&size_blocks.to_le_bytes());
    bytes[26] = u8::from(extended_lba) << 4; // format 0
    let lbads = block_size_bytes.trailing_zeros();
    bytes[128..132].copy_from_slice(&(u32::from(metadata_bytes) | lbads << 16).to_le_bytes());
    bytes
}

impl Default for FakeScript {
    fn default() -> Self {
        let mut controller = vec![0u8; IDENTIFY_BYTES];
        controller[24..28].copy_from_slice(b"fake");
        controller[77] = 5; // MDTS: 128 KiB
        controller[512] = 0x66; // SQES
        controller[513] = 0x44; // CQES
        controller[516..520].copy_from_slice(&1u32.to_le_bytes()); // NN
        controller[536..540].copy_from_slice(&1u32.to_le_bytes()); // SGLS
        let mut namespace_list = vec![0u8; IDENTIFY_BYTES];
        namespace_list[0..4].copy_from_slice(&1u32.to_le_bytes());
        Self {
            capabilities: Capabilities::build(256, 1, 0, 0, 0).0,
            version: 0x0001_0400,
            status_bits: 0,
            disable_completes: true,
            identify_controller: controller,
            namespace_list,
            identify_namespaces: vec![identify_namespace_bytes(4096, 1024, 0, false)],
            number_of_queues_dw0: 0x0003_0003,
            admin_failures: Vec::new(),
            admin_unanswered: Vec::new(),
            io_completions: VecDeque::new(),
            io_phase_from_script: false,
            enable_ready_after_status_reads: 0,
            starts_enabling: false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct SubmissionRing {
    iova: u64,
    entries: u32,
    head: u32,
    completion_queue: u16,
}

#[derive(Debug, Clone, Copy)]
struct CompletionRing {
    iova: u64,
    entries: u32,
    tail: u32,
    /// The head the host last wrote to this queue's CQ head doorbell.
    head: u32,
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

/// Counters a test can read back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeCounters {
    /// Commands fetched, by submission queue id.
    pub commands_by_queue: BTreeMap<u16, u64>,
    /// SQ tail doorbell writes for a queue that does not exist (ignored).
    pub doorbells_for_missing_queues: u64,
    /// CC writes that cleared EN.
    pub disables: u64,
    /// CQ head doorbell writes, by completion queue id.
    pub completion_doorbells_by_queue: BTreeMap<u16, u64>,
    /// Completions the fake had to hold because their CQ was full by the head the host last
    /// wrote (a real controller stalls there; a host that never frees the entries hangs).
    pub completions_held_for_room: u64,
    /// CQ head doorbell writes that repeated the head already written (they give nothing back).
    pub repeated_completion_heads: u64,
    /// CC writes that cleared EN while an enable had not reached CSTS.RDY = 1 (the spec leaves
    /// what a controller does then undefined; a careful host waits for RDY first).
    pub disables_before_ready: u64,
}

struct FakeState {
    script: FakeScript,
    cc: u32,
    csts: u32,
    aqa: u32,
    asq: u64,
    acq: u64,
    submission: BTreeMap<u16, SubmissionRing>,
    completion: BTreeMap<u16, CompletionRing>,
    /// Completions waiting for room in their CQ, oldest first, with their `keep_phase`.
    held: BTreeMap<u16, VecDeque<(CompletionEntry, bool)>>,
    counters: FakeCounters,
    /// Admin commands fetched and left unanswered (`admin_unanswered`), oldest first, until
    /// [`FakeDevice::answer_withheld`] or a disable.
    withheld: Vec<SubmissionEntry>,
    /// CSTS reads left before an enable in progress sets RDY (`None`: no enable in progress).
    enabling_reads_left: Option<u32>,
}

/// The scripted controller (see the module documentation).
pub struct FakeDevice {
    registers: Arc<FakeRegisters>,
    pool: Arc<DmaPool>,
}

struct FakeRegisters {
    state: Mutex<FakeState>,
    pool: Arc<DmaPool>,
}

impl FakeDevice {
    pub fn new(script: FakeScript) -> Arc<Self> {
        let pool = Arc::new(DmaPool::identity());
        let (cc, enabling_reads_left) = if script.starts_enabling { (1, Some(script.enable_ready_after_status_reads)) } else { (0, None) };
        let state = FakeState {
            script,
            cc,
            csts: 0,
            aqa: 0,
            asq: 0,
            acq: 0,
            submission: BTreeMap::new(),
            completion: BTreeMap::new(),
            counters: FakeCounters::default(),
            held: BTreeMap::new(),
            withheld: Vec::new(),
            enabling_reads_left,
        };
        let registers = Arc::new(FakeRegisters { state: Mutex::new(state), pool: Arc::clone(&pool) });
        Arc::new(Self { registers, pool })
    }

    /// Changes the script (e.g. makes the next disable hang, queues more raw completions).
    pub fn update_script(&self, change: impl FnOnce(&mut FakeScript)) {
        change(&mut self.registers.lock().script);
    }

    /// The admin commands the fake fetched and has not answered (their data pointers are where
    /// a late answer would write), oldest first.
    pub fn withheld_admin_commands(&self) -> Vec<SubmissionEntry> {
        self.registers.lock().withheld.clone()
    }

    /// Answers the withheld admin commands now, as a slow controller finally would: each is
    /// completed successfully, without data (write the data pointer first to model a late
    /// transfer). Returns how many were answered.
    pub fn answer_withheld(&self) -> usize {
        let mut state = self.registers.lock();
        let withheld = std::mem::take(&mut state.withheld);
        for entry in &withheld {
            let completion = state.completion_for(0, entry, 0, None);
            state.post(&self.pool, 0, completion, false);
        }
        withheld.len()
    }

    pub fn counters(&self) -> FakeCounters {
        self.registers.lock().counters.clone()
    }

    /// The head the host last wrote to CQ `queue_id`'s doorbell (`None`: no such queue).
    pub fn completion_queue_head(&self, queue_id: u16) -> Option<u32> {
        self.registers.lock().completion.get(&queue_id).map(|ring| ring.head)
    }

    /// Completions of CQ `queue_id` held now because the CQ is full by the head the host last
    /// wrote (they are posted as a later head frees room).
    pub fn completions_waiting_for_room(&self, queue_id: u16) -> usize {
        self.registers.lock().held.get(&queue_id).map_or(0, VecDeque::len)
    }

    /// The identity pool the fake translates through (the same as [`DeviceBackend::dma`]).
    pub fn pool(&self) -> Arc<DmaPool> {
        Arc::clone(&self.pool)
    }
}

impl DeviceBackend for FakeDevice {
    fn name(&self) -> String {
        "fake".to_string()
    }
    fn registers(&self) -> Arc<dyn RegisterIo> {
        Arc::clone(&self.registers) as Arc<dyn RegisterIo>
    }
    fn dma(&self) -> Arc<dyn DmaAllocator> {
        Arc::clone(&self.pool) as Arc<dyn DmaAllocator>
    }
    fn function_reset(&self) -> Result<(), HwError> {
        let mut state = self.registers.lock();
        state.disable();
        state.cc = 0;
        Ok(())
    }
}

impl FakeRegisters {
    fn lock(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl FakeState {
    fn disable(&mut self) {
        self.counters.disables += 1;
        if self.enabling_reads_left.take().is_some() {
            self.counters.disables_before_ready += 1;
        }
        self.submission.clear();
        self.completion.clear();
        self.held.clear();
        self.withheld.clear();
        if self.script.disable_completes {
            self.csts &= !CSTS_READY;
        }
    }

    fn write_cc(&mut self, value: u32) {
        let was_enabled = self.cc & 1 == 1;
        self.cc = value;
        let configuration = ControllerConfiguration(value);
        if configuration.enabled() && !was_enabled {
            let (sq_entries, cq_entries) = registers::decode_admin_queue_attributes(self.aqa);
            self.submission.insert(0, SubmissionRing { iova: self.asq, entries: sq_entries, head: 0, completion_queue: 0 });
            self.completion.insert(0, CompletionRing::new(self.acq, cq_entries));
            match self.script.enable_ready_after_status_reads {
                0 => self.csts |= CSTS_READY,
                reads => self.enabling_reads_left = Some(reads),
            }
        } else if !configuration.enabled() && was_enabled {
            self.disable();
        }
        if value >> 14 & 0x3 != 0 {
            self.csts = self.csts & !(0x3 << 2) | CSTS_SHUTDOWN_COMPLETE;
        } else {
            self.csts &= !(0x3 << 2);
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
    fn post(&mut self, pool: &DmaPool, completion_queue: u16, entry: CompletionEntry, keep_phase: bool) {
        let Some(ring) = self.completion.get_mut(&completion_queue) else { return };
        if ring.is_full() || self.held.get(&completion_queue).is_some_and(|held| !held.is_empty()) {
            self.counters.completions_held_for_room += 1;
            self.held.entry(completion_queue).or_default().push_back((entry, keep_phase));
            return;
        }
        Self::write_completion(pool, ring, entry, keep_phase);
    }

    /// A CQ head doorbell write: records the head (a value outside the ring is ignored) and
    /// posts what was held for the room it frees.
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
        let Some(held) = self.held.get_mut(&completion_queue) else { return };
        while !ring.is_full() {
            let Some((entry, keep_phase)) = held.pop_front() else { break };
            Self::write_completion(pool, ring, entry, keep_phase);
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

    fn completion_for(&self, queue_id: u16, entry: &SubmissionEntry, dw0: u32, status: Option<NvmeStatus>) -> CompletionEntry {
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
        if self.script.admin_unanswered.contains(&opcode) {
            // Bounded by the admin queue: a command stays here while its slot stays busy in the
            // driver, and a disable clears them all.
            self.withheld.push(*entry);
            return None;
        }
        if let Some(&(_, status)) = self.script.admin_failures.iter().find(|(failing, _)| *failing == opcode) {
            return Some(self.completion_for(0, entry, 0, Some(status)));
        }
        let queue_id = (entry.cdw10 & 0xFFFF) as u16;
        let entries = (entry.cdw10 >> 16) + 1;
        let invalid_queue = Some(NvmeStatus::command_specific(codes::INVALID_QUEUE_IDENTIFIER));
        let (dw0, status) = match AdminOpcode::from_u8(opcode) {
            Some(AdminOpcode::Identify) => {
                let data = match entry.cdw10 & 0xFF {
                    0x01 => self.script.identify_controller.clone(),
                    0x02 => self.script.namespace_list.clone(),
                    0x00 => {
                        let index = usize::try_from(entry.nsid).ok().and_then(|nsid| nsid.checked_sub(1));
                        index.and_then(|index| self.script.identify_namespaces.get(index)).cloned().unwrap_or_default()
                    }
                    _ => return Some(self.completion_for(0, entry, 0, Some(NvmeStatus::generic(codes::INVALID_FIELD)))),
                };
                (0, Self::to_host(pool, entry.dptr[0], &data))
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
                (0, self.completion.remove(&queue_id).map_or(invalid_queue, |_| None))
            }
            Some(AdminOpcode::CreateIoCompletionQueue | AdminOpcode::CreateIoSubmissionQueue) => (0, invalid_queue),
            _ => (0, None),
        };
        Some(self.completion_for(0, entry, dw0, status))
    }

    fn execute_io(&mut self, queue_id: u16, entry: &SubmissionEntry) -> Option<CompletionEntry> {
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
                // An enable in progress reaches RDY after its scripted number of reads.
                match state.enabling_reads_left {
                    Some(0) => {
                        state.enabling_reads_left = None;
                        state.csts |= CSTS_READY;
                    }
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

// ---- Fuzzing ---------------------------------------------------------------------------------

/// Header bytes of a fuzz input (see [`FakeScript::from_fuzz_input`]).
pub const FUZZ_HEADER_BYTES: usize = 32;
/// Header byte 28 with this value scripts a controller whose disable never completes.
pub const FUZZ_DISABLE_HANGS: u8 = 0xA5;

/// What [`run_fuzz_input`] does besides bring-up, from the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FuzzPlan {
    pub admin_queue_depth: u32,
    pub io_queue_depth: u32,
    /// Flush commands submitted on the I/O queue pair.
    pub commands: usize,
    /// Reset the controller after reaping and use the (stale) pair again.
    pub reset: bool,
}

impl FakeScript {
    /// Decodes a fuzz input: a [`FUZZ_HEADER_BYTES`]-byte header — CAP (8), VS (4), CSTS bits
    /// (4), Number of Queues dw0 (4), flags (1: bit 0 raw I/O phase, bit 1 reset afterwards),
    /// admin depth (1), I/O depth (1), commands (1), a failing admin opcode (1, 0xFF none) and
    /// its status field (2), an unanswered admin opcode (1, 0xFF none), a byte that makes every
    /// disable hang when it is [`FUZZ_DISABLE_HANGS`] (1; a hang costs the driver a CAP.TO wait,
    /// so random inputs should rarely pay it, and CAP.TO is then forced to 1, 500 ms), 3 spare —
    /// then sections, each a 2-byte little-endian length and that many bytes
    /// (cut short by the end of the input): Identify Controller, Active Namespace List, raw I/O
    /// completions (16 bytes each), then Identify Namespace data for NSID 1, 2, ...
    pub fn from_fuzz_input(data: &[u8]) -> Option<(FakeScript, FuzzPlan)> {
        let (header, mut rest) = data.split_first_chunk::<FUZZ_HEADER_BYTES>()?;
        let u16_at = |at: usize| u16::from_le_bytes([header[at], header[at + 1]]);
        let u32_at = |at: usize| u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]]);
        let flags = header[20];
        let mut sections = Vec::new();
        while let Some((length, tail)) = rest.split_first_chunk::<2>() {
            let length = usize::from(u16::from_le_bytes(*length)).min(tail.len());
            sections.push(tail[..length].to_vec());
            rest = &tail[length..];
        }
        let mut sections = sections.into_iter();
        let mut script = FakeScript {
            capabilities: u64::from(u32_at(0)) | u64::from(u32_at(4)) << 32,
            version: u32_at(8),
            status_bits: u32_at(12),
            disable_completes: header[28] != FUZZ_DISABLE_HANGS,
            identify_controller: sections.next().unwrap_or_default(),
            namespace_list: sections.next().unwrap_or_default(),
            identify_namespaces: Vec::new(),
            number_of_queues_dw0: u32_at(16),
            admin_failures: Vec::new(),
            admin_unanswered: Vec::new(),
            io_completions: VecDeque::new(),
            io_phase_from_script: flags & 1 == 1,
            enable_ready_after_status_reads: 0,
            starts_enabling: false,
        };
        let raw = sections.next().unwrap_or_default();
        script.io_completions = raw.chunks_exact(COMPLETION_ENTRY_BYTES).map(|chunk| chunk.try_into().unwrap_or([0; 16])).collect();
        script.identify_namespaces = sections.collect();
        if header[24] != 0xFF {
            let status = NvmeStatus::from_status_field(u16_at(25)).err().unwrap_or(NvmeStatus::generic(codes::INTERNAL_ERROR));
            script.admin_failures.push((header[24], status));
        }
        if header[27] != 0xFF {
            script.admin_unanswered.push(header[27]);
        }
        if !script.disable_completes {
            // The driver waits CAP.TO (up to 127 s) for a disable; with one that never
            // completes, the wait is the whole run. CAP.TO = 1 (500 ms) takes the same paths.
            script.capabilities = script.capabilities & !(0xFF << 24) | 1 << 24;
        }
        let plan = FuzzPlan {
            admin_queue_depth: u32::from(header[21]),
            io_queue_depth: u32::from(header[22]),
            commands: usize::from(header[23]),
            reset: flags & 2 == 2,
        };
        Some((script, plan))
    }

    /// Encodes a script and plan as [`FakeScript::from_fuzz_input`] reads them (for seeds), with
    /// trailing zeroes of each section left out. Admin failures and unanswered opcodes beyond
    /// the first are not representable.
    pub fn to_fuzz_input(&self, plan: &FuzzPlan) -> Vec<u8> {
        let mut data = vec![0u8; FUZZ_HEADER_BYTES];
        data[0..8].copy_from_slice(&self.capabilities.to_le_bytes());
        data[8..12].copy_from_slice(&self.version.to_le_bytes());
        data[12..16].copy_from_slice(&self.status_bits.to_le_bytes());
        data[16..20].copy_from_slice(&self.number_of_queues_dw0.to_le_bytes());
        data[20] = u8::from(self.io_phase_from_script) | u8::from(plan.reset) << 1;
        data[21] = plan.admin_queue_depth.min(255) as u8;
        data[22] = plan.io_queue_depth.min(255) as u8;
        data[23] = plan.commands.min(255) as u8;
        data[24] = self.admin_failures.first().map_or(0xFF, |(opcode, _)| *opcode);
        let status = self.admin_failures.first().map_or(0, |(_, status)| status.to_status_field());
        data[25..27].copy_from_slice(&status.to_le_bytes());
        data[27] = self.admin_unanswered.first().copied().unwrap_or(0xFF);
        data[28] = if self.disable_completes { 0 } else { FUZZ_DISABLE_HANGS };
        let raw: Vec<u8> = self.io_completions.iter().flatten().copied().collect();
        let mut sections = vec![&self.identify_controller, &self.namespace_list, &raw];
        sections.extend(self.identify_namespaces.iter());
        for section in sections {
            // Trailing zeroes are implied (Identify data is zero-padded to 4 KiB on its way to
            // the host), which keeps seeds small for the fuzzer's mutations.
            let used = section.iter().rposition(|&byte| byte != 0).map_or(0, |last| last + 1);
            let length = used.min(usize::from(u16::MAX));
            data.extend_from_slice(&(length as u16).to_le_bytes());
            data.extend_from_slice(&section[..length]);
        }
        data
    }
}

/// What [`run_fuzz_input`] got to, for tests that check a seed reaches deep paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FuzzOutcome {
    pub brought_up: bool,
    pub queue_created: bool,
    pub completions_reaped: usize,
    pub reset_done: bool,
}

/// Runs one fuzz input: brings a controller up on a [`FakeDevice`] scripted by the input,
/// creates an I/O queue pair, submits Flushes, reaps whatever the script posts (with a deadline
/// of a few milliseconds), optionally resets and tries the stale pair, then drops everything.
/// Every outcome is fine except a panic or a hang; `None` if the input is too short.
pub fn run_fuzz_input(data: &[u8]) -> Option<FuzzOutcome> {
    let (script, plan) = FakeScript::from_fuzz_input(data)?;
    let device = FakeDevice::new(script);
    let config = ControllerConfig {
        admin_queue_depth: plan.admin_queue_depth,
        io_queue_pairs_requested: 2,
        admin_timeout: Duration::from_millis(2),
        ..ControllerConfig::default()
    };
    let mut outcome = FuzzOutcome::default();
    let Ok(mut controller) = Controller::init(device, config) else { return Some(outcome) };
    outcome.brought_up = true;
    for namespace in controller.namespaces() {
        let _ = (namespace.size_bytes(), controller.namespace(namespace.id));
    }
    let _ = controller.namespace(NamespaceId(1));
    let Ok(mut queue) = controller.create_io_queue_pair(plan.io_queue_depth) else { return Some(outcome) };
    outcome.queue_created = true;
    for tag in 0..plan.commands {
        if queue.submit_raw(SubmissionEntry::flush(NamespaceId(1)), tag as u64).is_err() {
            break;
        }
    }
    let mut reaped = 0;
    if queue.ring_doorbell().is_ok() {
        // The fake posted its completions inside the doorbell write: the first reap sees them
        // all, however slow the machine. Later rounds (for scripted entries the driver skips)
        // end at a short deadline, and an error ends them.
        let deadline = Instant::now() + Duration::from_millis(2);
        loop {
            if queue.reap(usize::MAX, |_| reaped += 1).is_err() || queue.in_flight() == 0 || Instant::now() >= deadline {
                break;
            }
        }
    }
    outcome.completions_reaped = reaped;
    if plan.reset {
        outcome.reset_done = controller.reset(false).is_ok();
        let stale = queue.submit_raw(SubmissionEntry::flush(NamespaceId(1)), 0).and_then(|()| queue.ring_doorbell());
        assert!(stale.is_err(), "a pair from before a reset rang its doorbell");
    }
    drop(queue);
    drop(controller);
    Some(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed(script: &FakeScript, plan: FuzzPlan) -> Vec<u8> {
        script.to_fuzz_input(&plan)
    }

    fn seed_directory() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/driver_bring_up")
    }

    /// The committed seeds of the `driver_bring_up` fuzz target, by name: each reaches a
    /// different path of bring-up, I/O or teardown.
    fn seeds() -> Vec<(&'static str, Vec<u8>)> {
        let plan = FuzzPlan { admin_queue_depth: 8, io_queue_depth: 16, commands: 5, reset: true };
        let well_formed = FakeScript::default();
        let mut prp_two_namespaces = FakeScript::default();
        prp_two_namespaces.identify_controller[536..540].copy_from_slice(&0u32.to_le_bytes());
        prp_two_namespaces.identify_controller[516..520].copy_from_slice(&2u32.to_le_bytes());
        prp_two_namespaces.namespace_list[4..8].copy_from_slice(&2u32.to_le_bytes());
        prp_two_namespaces.identify_namespaces.push(identify_namespace_bytes(512, 4096, 8, true));
        let raw = |command_id: u16, sq_head: u16, sq_id: u16| {
            CompletionEntry { dw0: 0, dw1: 0, sq_head, sq_id, command_id, status_and_phase: 0 }.to_bytes()
        };
        let hostile_completions = FakeScript {
            io_completions: VecDeque::from([raw(0, 1, 1), raw(0x8001, 2, 1), raw(1, 9, 1), raw(2, 3, 7)]),
            ..FakeScript::default()
        };
        let version_1_0 = FakeScript { version: 0x0001_0000, ..FakeScript::default() };
        let failing_create = FakeScript {
            admin_failures: vec![(AdminOpcode::CreateIoSubmissionQueue as u8, NvmeStatus::generic(codes::INTERNAL_ERROR))],
            ..FakeScript::default()
        };
        let unanswered_delete = FakeScript { admin_unanswered: vec![AdminOpcode::DeleteIoSubmissionQueue as u8], ..FakeScript::default() };
        vec![
            ("well_formed", seed(&well_formed, plan)),
            ("prp_two_namespaces_one_with_metadata", seed(&prp_two_namespaces, plan)),
            ("hostile_completions", seed(&hostile_completions, FuzzPlan { commands: 4, ..plan })),
            ("version_1_0_without_namespace_list", seed(&version_1_0, plan)),
            ("create_sq_fails", seed(&failing_create, plan)),
            ("delete_sq_unanswered", seed(&unanswered_delete, FuzzPlan { reset: false, ..plan })),
            // No seed with a disable that hangs: each run would cost two CAP.TO waits (1 s), and
            // every mutation of it would too; the unit tests in `hardening_tests` cover that path.
        ]
    }

    #[test]
    #[ignore = "writes fuzz/seeds/driver_bring_up; run by hand after changing the seeds"]
    fn write_fuzz_seeds() {
        std::fs::create_dir_all(seed_directory()).expect("seed directory");
        for (name, data) in seeds() {
            std::fs::write(seed_directory().join(name), data).expect("write seed");
        }
    }

    #[test]
    fn committed_fuzz_seeds_are_current_and_reach_bring_up() {
        // Goal: the seeds in the repository are the ones this file describes, and each gets
        // through bring-up (else the fuzzer starts blind).
        for (name, data) in seeds() {
            let committed = std::fs::read(seed_directory().join(name)).unwrap_or_default();
            assert_eq!(committed, data, "seed {name} is stale: run `cargo test -p nvme-driver -- --ignored write_fuzz_seeds`");
            let outcome = run_fuzz_input(&data).expect("decodes");
            assert!(outcome.brought_up, "seed {name}: {outcome:?}");
        }
    }

    #[test]
    fn the_default_script_brings_up_and_serves_io() {
        // Goal: the fake is a controller the driver accepts (else fuzzing it proves nothing),
        // and its fuzz encoding round-trips.
        let plan = FuzzPlan { admin_queue_depth: 8, io_queue_depth: 16, commands: 5, reset: true };
        let script = FakeScript::default();
        let input = seed(&script, plan);
        let (decoded, decoded_plan) = FakeScript::from_fuzz_input(&input).expect("decodes");
        assert_eq!(decoded.to_fuzz_input(&decoded_plan), input, "encoding round-trips");
        assert_eq!(decoded_plan, plan);
        let outcome = run_fuzz_input(&input).expect("runs");
        assert_eq!(outcome, FuzzOutcome { brought_up: true, queue_created: true, completions_reaped: 5, reset_done: true });
    }
}
