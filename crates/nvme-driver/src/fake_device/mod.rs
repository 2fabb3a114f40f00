//! A scripted NVMe controller at the hardware seam, for unit tests and fuzzing of the driver's
//! handling of untrusted device data (feature `fake-device`; always built for this crate's
//! tests).
//!
//! [`FakeDevice`] implements [`DeviceBackend`]. Unlike the software controller (`nvme-emu`) it
//! has no thread and no storage: a register write does its work before returning — CC.EN sets
//! or clears CSTS.RDY, CC.SHN completes the shutdown (at once, or after a scripted time), and an SQ tail doorbell fetches the new
//! entries and posts their completions at once. What it answers comes from a [`FakeScript`]:
//! CAP, CRTO, VS, extra CSTS bits, the Identify Controller / Namespace / Active Namespace List data,
//! Set Features Number of Queues dw0, admin opcodes to fail or leave unanswered (a test can
//! answer them later, [`FakeDevice::answer_withheld`]), raw I/O completion entries or none at
//! all, and whether it starts as an earlier process left it (enabled, or mid-enable). So a test
//! (or a fuzzer, through [`run_fuzz_input`]) can hand the driver any register file and Identify
//! data a broken or hostile device could produce, deterministically. [`FakeCounters`] record
//! what the driver did to it (commands fetched, doorbells, disables, DMA mappings made while it
//! still ran as it was found). Like a VFIO function it starts with bus mastering off (no DMA
//! until [`DeviceBackend::enable_bus_master`]), and several fakes can share one DMA space
//! ([`FakeDevice::new_in_one_space`]), as the functions of one VFIO container do.
//!
//! Files: `controller.rs`, the register file and the queues; `fuzz.rs`, fuzz inputs decoded into
//! a script and run.
//! It trusts the driver no more than a device would: unmapped addresses and out-of-range queue
//! values are ignored or answered with an error status, never a panic.

mod controller;
mod fuzz;

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use crate::hw::{DeviceBackend, DmaAllocator, DmaPool, HwError, RegisterIo};
use crate::spec::registers::Capabilities;
use crate::spec::{CompletionEntry, NvmeStatus, SubmissionEntry, COMPLETION_ENTRY_BYTES, IDENTIFY_BYTES};

use controller::FakeRegisters;
pub use fuzz::{run_fuzz_input, FuzzOutcome, FuzzPlan, FUZZ_DISABLE_HANGS, FUZZ_HEADER_BYTES};

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
    /// I/O Command Set specific Identify Controller data for the NVM command set (CNS 06h,
    /// CSI 00h: WZSL, DMRL, DMRSL); empty (the default): that Identify completes with Invalid
    /// Field, as from a controller that does not implement it.
    pub nvm_identify_controller: Vec<u8>,
    /// Identify Namespace data for NSID 1, 2, ... (missing ones read as zeroes: inactive).
    pub identify_namespaces: Vec<Vec<u8>>,
    /// NSIDs whose Identify Namespace (CNS 00h) completes with this status instead of data.
    pub identify_namespace_failures: Vec<(u32, NvmeStatus)>,
    /// Log pages by log identifier: Get Log Page writes exactly the dwords it asks for (NUMD + 1,
    /// zero past the script's bytes), as a controller does. A log not listed completes with
    /// success and writes nothing.
    pub log_pages: Vec<(u8, Vec<u8>)>,
    /// Completion dword 0 of Set Features / Number of Queues.
    pub number_of_queues_dw0: u32,
    /// Admin opcodes completed with this status field instead of being executed.
    pub admin_failures: Vec<(u8, NvmeStatus)>,
    /// Admin opcodes fetched but never completed (the driver's admin timeout fires).
    pub admin_unanswered: Vec<u8>,
    /// Identify CNS values (CDW10 7:0) whose Identify is fetched but never completed, as
    /// `admin_unanswered` does for whole opcodes: e.g. an Active Namespace List that times out
    /// after Identify Controller was answered.
    pub identify_unanswered: Vec<u8>,
    /// Identify CNS values whose Identify completes with this status instead of data (e.g. an
    /// Active Namespace List, CNS 02h, refused with Invalid Field by a controller that reports
    /// NVMe 1.1 or later but does not implement it).
    pub identify_failures: Vec<(u8, NvmeStatus)>,
    /// Raw completion entries for I/O commands, used one per command fetched, in order; once
    /// they run out, each command gets a well-formed success completion.
    pub io_completions: VecDeque<[u8; COMPLETION_ENTRY_BYTES]>,
    /// Keep the phase bit of `io_completions` as scripted (true) or replace it with the right
    /// one (false), so that the rest of the entry is what the driver gets to judge.
    pub io_phase_from_script: bool,
    /// I/O commands fetched while this is set are never completed (a command the controller
    /// lost: the driver's deadline fires). They are counted (`FakeCounters::io_unanswered`).
    pub io_unanswered: bool,
    /// CSTS reads after CC.EN goes to 1 before CSTS.RDY does (0: at once). A disable while
    /// RDY is still 0 is counted (`FakeCounters::disables_before_ready`).
    pub enable_ready_after_status_reads: u32,
    /// How long after CC.EN goes to 1 CSTS.RDY does at the earliest (zero: no wait), as a
    /// controller readying its media would; with `enable_ready_after_status_reads`, RDY waits
    /// for both.
    pub enable_takes: Duration,
    /// CRTO (offset 68h, NVMe 2.0): CRWMT in bits 15:0, CRIMT in bits 31:16, 500 ms units. The
    /// driver reads it when CAP.CRMS.CRWMS (CAP bit 59) is set in `capabilities`.
    pub ready_timeouts: u32,
    /// The fake starts as a crashed process left it mid-enable: CC.EN = 1, CSTS.RDY = 0 until
    /// `enable_ready_after_status_reads` CSTS reads.
    pub starts_enabling: bool,
    /// The fake starts as an earlier process left it running: CC.EN = 1 and CSTS.RDY = 1, so
    /// it may DMA into whatever is mapped until it is disabled (see
    /// `FakeCounters::mappings_while_left_enabled`).
    pub starts_enabled: bool,
    /// The fake may master the bus (DMA) from the start, as a backend without a bus-master
    /// gate would. False (the default) models VFIO, which opens a function with bus mastering
    /// off until [`DeviceBackend::enable_bus_master`]; without it the fake fetches no command.
    pub starts_mastering: bool,
    /// How long a normal shutdown (CC.SHN = 01b) reads as in progress (CSTS.SHST = 01b) before
    /// it reads complete, as an SSD writing back its cache would; zero: complete at once.
    pub shutdown_takes: Duration,
    /// CSTS.SHST while that shutdown is in progress: 01b (occurring, the default), or any other
    /// value a broken controller might report meanwhile, such as the reserved 11b.
    pub shutdown_status_in_progress: u8,
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
            nvm_identify_controller: Vec::new(),
            identify_namespaces: vec![identify_namespace_bytes(4096, 1024, 0, false)],
            identify_namespace_failures: Vec::new(),
            log_pages: Vec::new(),
            number_of_queues_dw0: 0x0003_0003,
            admin_failures: Vec::new(),
            admin_unanswered: Vec::new(),
            identify_unanswered: Vec::new(),
            identify_failures: Vec::new(),
            io_completions: VecDeque::new(),
            io_phase_from_script: false,
            io_unanswered: false,
            enable_ready_after_status_reads: 0,
            enable_takes: Duration::ZERO,
            ready_timeouts: 0,
            starts_enabling: false,
            starts_enabled: false,
            starts_mastering: false,
            shutdown_takes: Duration::ZERO,
            shutdown_status_in_progress: 0b01,
        }
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
    /// DMA mappings made (through [`FakeDevice::pool`], by the driver of any fake in its space)
    /// while the fake was still enabled as it started (`starts_enabled`, `starts_enabling`),
    /// before a disable reached CSTS.RDY = 0, with bus mastering on: a controller an earlier
    /// process left running could write such memory.
    pub mappings_while_left_enabled: u64,
    /// [`DeviceBackend::enable_bus_master`] calls while the fake was still enabled as it
    /// started: from then on it could DMA into everything already mapped in its space.
    pub bus_master_enables_while_left_enabled: u64,
    /// SQ tail doorbells ignored because bus mastering was off (the fake cannot fetch).
    pub doorbells_without_bus_master: u64,
    /// I/O commands fetched and left unanswered (`FakeScript::io_unanswered`).
    pub io_unanswered: u64,
    /// CC writes that cleared EN while a shutdown was in progress (within `shutdown_takes`,
    /// whatever CSTS.SHST read meanwhile): a real SSD may then lose what it was writing back.
    pub disables_during_shutdown: u64,
}

/// The scripted controller (see the module documentation).
pub struct FakeDevice {
    registers: Arc<FakeRegisters>,
    pool: Arc<DmaPool>,
}

impl FakeDevice {
    pub fn new(script: FakeScript) -> Arc<Self> {
        let mut devices = Self::new_in_one_space([script]);
        devices.pop().expect("one device per script")
    }

    /// One fake per script, all in one DMA space (one pool, as `VfioDevice::open_many` gives
    /// the functions of one VFIO container): memory mapped through any of them is reachable by
    /// every one, and each counts the mappings made while it still runs as it was found.
    pub fn new_in_one_space(scripts: impl IntoIterator<Item = FakeScript>) -> Vec<Arc<Self>> {
        // The observer holds the registers weakly (they hold the pool), and locks a device's
        // state only while the driver maps memory, never while the fake holds that lock itself.
        let members: Arc<OnceLock<Vec<Weak<FakeRegisters>>>> = Arc::new(OnceLock::new());
        let observed = Arc::clone(&members);
        let observer = Box::new(move |_, _| {
            for registers in observed.get().into_iter().flatten().filter_map(Weak::upgrade) {
                registers.lock().note_mapping();
            }
        });
        let pool = Arc::new(DmaPool::identity_observed(observer));
        let devices: Vec<Arc<Self>> = scripts
            .into_iter()
            .map(|script| Arc::new(Self { registers: Arc::new(FakeRegisters::new(script, Arc::clone(&pool))), pool: Arc::clone(&pool) }))
            .collect();
        // Set once, here, before any device is handed out: nothing can map memory earlier.
        let _ = members.set(devices.iter().map(|device| Arc::downgrade(&device.registers)).collect());
        devices
    }

    /// Changes the script (e.g. makes the next disable hang, queues more raw completions).
    pub fn update_script(&self, change: impl FnOnce(&mut FakeScript)) {
        change(&mut self.registers.lock().script);
    }

    /// Makes the fake post `entry` (its phase the fake's) into every free entry of CQ
    /// `queue_id`, now and after each head doorbell, until a disable or the CQ's deletion: a
    /// controller that never stops posting completions (for `entry`'s command, or naming none).
    pub fn keep_posting(&self, queue_id: u16, entry: CompletionEntry) {
        let mut state = self.registers.lock();
        state.endless.insert(queue_id, entry);
        state.fill_with_endless(&self.pool, queue_id);
    }

    /// Posts one completion of `command_id` on CQ `queue_id` reporting the SQ's head now (its
    /// phase the fake's), as a controller answering a command the host never issued, or one
    /// twice, would: with no such command in flight, a completion naming nothing in flight.
    pub fn post_unexpected(&self, queue_id: u16, command_id: u16) {
        let mut state = self.registers.lock();
        let mut entry = state.completion_for(queue_id, &SubmissionEntry::flush(crate::NamespaceId(1)), 0, None);
        entry.command_id = command_id;
        state.post(&self.pool, queue_id, entry, false);
    }

    /// The admin commands the fake fetched and has not answered (their data pointers are where
    /// a late answer would write), oldest first.
    pub fn withheld_admin_commands(&self) -> Vec<SubmissionEntry> {
        self.registers.lock().withheld.clone()
    }

    /// Answers the withheld admin commands now, as a slow controller finally would: each is
    /// executed as it would have been when fetched (a Delete I/O SQ deletes the queue, an
    /// Identify writes its data; `admin_failures` still apply) and completed with its status.
    /// Commands the fake answers without data (Get Log Page) stay so: write the data pointer
    /// first to model a late transfer. Returns how many were answered.
    pub fn answer_withheld(&self) -> usize {
        let mut state = self.registers.lock();
        let withheld = std::mem::take(&mut state.withheld);
        for entry in &withheld {
            let completion = state.run_admin(&self.pool, entry);
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
        // As VFIO's reset leaves it: bring-up turns bus mastering on again.
        state.bus_master = false;
        Ok(())
    }

    fn enable_bus_master(&self) -> Result<(), HwError> {
        let mut state = self.registers.lock();
        if state.left_enabled {
            state.counters.bus_master_enables_while_left_enabled += 1;
        }
        state.bus_master = true;
        Ok(())
    }
}
