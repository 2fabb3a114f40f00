//! Controller bring-up (§3.5.1) as a state machine with deadlines (CSTS.RDY = 0 after a
//! disable within CAP.TO; CSTS.RDY = 1 after an enable within the enable bound,
//! [`Controller::ready_timeout`]: CAP.TO, or CRTO.CRWMT when larger), Identify, queue creation
//! and deletion, features, log pages, reset and teardown. An enable this controller started
//! and waited the whole enable bound for is given CAP.TO more to finish before a disable, not
//! the enable bound again (see `settle_enable`).
//!
//! Teardown. A controller is disabled before its memory goes: `Drop` makes every queue pair
//! stale (the doorbell gate), requests a normal shutdown and waits for it to complete (within
//! the shutdown bound, [`Controller::shutdown_timeout`]: RTD3E, CAP.TO), then clears CC.EN and
//! waits for CSTS.RDY = 0 within CAP.TO.
//! CC.EN is never cleared while the shutdown reads in progress within the shutdown bound: that
//! would cut an SSD's cache write-back short. Only a controller seen to stop gets its admin
//! rings and scratch page freed (and lets stale queue pairs free theirs); otherwise they are
//! leaked and counted, because a controller that is still enabled may still write them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::datapath::{DataPointerMode, PAGE_BYTES, TRANSFER_BYTES_MAX};
use crate::detached::{DetachedQueueLayout, DetachedQueuePair};
use crate::error::{NvmeError, ReadyBoundSource};
use crate::gate::ResetGuard;
use crate::hw::{DeviceBackend, DmaAllocator, DmaRegion, RegisterIo};
use crate::io::{IoQueuePair, PairOwner};
use crate::namespace::{classify, refuse_identify_failed, refuse_malformed, Namespace, RefusedNamespace};
use crate::queue::{doorbell_offsets, Completion, QueuePair, QUEUE_DEPTH_MAX};
use crate::shadow::DoorbellBuffer;
use crate::spec::command::{FeatureId, IdentifyCns, LogPageId};
use crate::spec::identify::{parse_active_namespaces, NvmIdentifyController};
use crate::spec::registers::{self, Capabilities, ControllerConfiguration, ControllerStatus, ReadyTimeouts, Version};
use crate::spec::{IdentifyController, IdentifyNamespace, SubmissionEntry, COMPLETION_ENTRY_BYTES, IDENTIFY_BYTES, SUBMISSION_ENTRY_BYTES};
use crate::teardown::{may_have_executed, AdminShared};
use crate::types::{NamespaceId, QueueId};

/// Most namespaces bring-up identifies (each costs one admin command).
const NAMESPACES_MAX: usize = 1024;

/// Longest shutdown latency (Identify RTD3E) the shutdown wait honours: the figure is device
/// data, and a value near its 71-minute maximum would hold a teardown that long. Linux caps its
/// shutdown wait at 60 s too.
const SHUTDOWN_LATENCY_MAX_MS: u64 = 60_000;
/// Shortest shutdown wait, for controllers that report no RTD3E and a small CAP.TO.
const SHUTDOWN_TIMEOUT_MIN_MS: u64 = 1_000;

/// How long a normal shutdown may take before the driver gives up on it: the controller's RTD3
/// Entry Latency (rounded up to a millisecond, at most [`SHUTDOWN_LATENCY_MAX_MS`]), and never
/// less than CAP.TO (its 8-bit field bounds it at 127.5 s) or [`SHUTDOWN_TIMEOUT_MIN_MS`].
/// CAP.TO alone is too short for drives whose cache write-back takes longer than their enable:
/// RTD3E is what they report for it. CRTO.CRWMT is no floor: it bounds an enable only, and as a
/// 16-bit figure (up to about 9.1 h) it would undo the 60 s cap on RTD3E.
fn shutdown_timeout_ms(capabilities: Capabilities, rtd3_entry_latency_us: u32) -> u64 {
    let reported_ms = u64::from(rtd3_entry_latency_us).div_ceil(1000).min(SHUTDOWN_LATENCY_MAX_MS);
    reported_ms.max(capabilities.ready_timeout_ms()).max(SHUTDOWN_TIMEOUT_MIN_MS)
}

/// A bound on a wait for CSTS and the register field it came from, which a
/// [`NvmeError::ReadyTimeout`] names: a drive's CRTO.CRWMT can set a far longer bound than its
/// CAP.TO, and the reader of the error needs to know which figure the drive gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ReadyBound {
    ms: u64,
    source: ReadyBoundSource,
}

impl ReadyBound {
    /// The bound on every wait for CSTS.RDY = 0 after CC.EN = 0: CAP.TO.
    fn disable(capabilities: Capabilities) -> Self {
        Self { ms: capabilities.ready_timeout_ms(), source: ReadyBoundSource::CapTo }
    }

    /// The bound on a wait for CSTS.RDY = 1 after CC.EN = 1 ([`registers::ready_timeout_ms`]),
    /// named after the field that set it.
    fn enable(capabilities: Capabilities, ready_timeouts: Option<ReadyTimeouts>) -> Self {
        let ms = registers::ready_timeout_ms(capabilities, ready_timeouts);
        Self { ms, source: if ms > capabilities.ready_timeout_ms() { ReadyBoundSource::CrtoCrwmt } else { ReadyBoundSource::CapTo } }
    }
}

/// Which data pointer the driver uses for I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataPointerPreference {
    /// SGL when Identify Controller SGLS says the controller supports it, PRP otherwise.
    #[default]
    Auto,
    /// Always PRP (every controller supports it).
    Prp,
    /// Always SGL; bring-up fails on a controller without SGL support.
    Sgl,
}

/// Bring-up parameters.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Entries in the admin SQ and CQ.
    pub admin_queue_depth: u32,
    /// I/O queue pairs to ask for with Set Features / Number of Queues.
    pub io_queue_pairs_requested: u16,
    pub data_pointer: DataPointerPreference,
    /// Deadline for each admin command.
    pub admin_timeout: Duration,
    /// Use shadow doorbells (Doorbell Buffer Config, §5.7) when Identify Controller OACS says
    /// the controller supports them: emulated controllers (QEMU's, the software controller),
    /// where each MMIO doorbell write is a trip out of the guest. A controller using them
    /// refuses detached queue pairs (their agents write MMIO doorbells only; see `shadow.rs`),
    /// and I/O queue ids whose slots fall outside the one-page buffer (from 512 at the minimum
    /// doorbell stride). Real SSDs do not advertise the command, so there this changes nothing.
    pub shadow_doorbells: bool,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        Self {
            admin_queue_depth: 64,
            io_queue_pairs_requested: 16,
            data_pointer: DataPointerPreference::Auto,
            admin_timeout: Duration::from_secs(10),
            shadow_doorbells: false,
        }
    }
}

/// The bring-up stages (§3.5.1), in order; each waiting stage has a deadline: CAP.TO for
/// `WaitNotReady`, the enable bound ([`Controller::ready_timeout`]: CAP.TO, or CRTO.CRWMT when
/// larger) for `WaitReady` and for `Disable`'s wait for an enable under way to finish (CAP.TO
/// for the latter when it is this controller's own enable that already ran out `WaitReady`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BringUpStage {
    Disable,
    WaitNotReady,
    ConfigureAdminQueues,
    Enable,
    WaitReady,
    Identify,
    NumberOfQueues,
    /// Doorbell Buffer Config, when asked for and supported.
    DoorbellBuffer,
    Ready,
}

/// A controller that completed bring-up.
pub struct Controller {
    backend: Arc<dyn DeviceBackend>,
    registers: Arc<dyn RegisterIo>,
    dma: Arc<dyn DmaAllocator>,
    config: ControllerConfig,
    capabilities: Capabilities,
    /// The enable bound: how long CSTS.RDY may take to become 1 after CC.EN does
    /// ([`registers::ready_timeout_ms`]: CAP.TO, or CRTO.CRWMT when CAP.CRMS.CRWMS is set and
    /// it is larger), read once at init. A disable's wait is bounded by CAP.TO alone
    /// ([`Capabilities::ready_timeout_ms`]).
    enable_bound: ReadyBound,
    /// The last enable this controller started (bring-up's `Enable` stage) ran out the enable
    /// bound in `WaitReady`. That enable has had its whole bound, so a later wait for it to
    /// finish before a disable (teardown's `stop`, the next reset's `Disable` stage) is
    /// bounded by CAP.TO ([`Controller::settle_bound`]): otherwise an enable that never
    /// completes held init's error (its teardown) or the next reset (with the doorbell gate's
    /// exclusive side) for a second enable bound, up to 9.1 h more with CRTO.CRWMT. A settle
    /// that times out is no less safe: CC.EN is left set and the memory kept (teardown leaks it,
    /// a reset fails leaving the old pairs to keep theirs), as after the longer wait. Only a
    /// drive that finishes its enable between CAP.TO and a whole bound late now ends leaked
    /// instead of stopped and freed.
    enable_ran_out: bool,
    version: Version,
    admin: Arc<AdminShared>,
    identify: IdentifyController,
    namespaces: Vec<Namespace>,
    refused_namespaces: Vec<RefusedNamespace>,
    /// I/O queue pairs Number of Queues granted; 0 from the moment a bring-up saw the
    /// controller stop (a controller reset ends the grant) until Number of Queues answers again.
    granted_queue_pairs: u16,
    /// The stage at which the last bring-up (a reset's) failed, `None` once one finished: the
    /// queue ids, grant and Identify data may then not describe the controller as it is now, so
    /// no queue pair is created (`NvmeError::ControllerNotReady`) until a reset succeeds.
    unfinished: Option<BringUpStage>,
    /// [`Controller::shutdown`] set CC.SHN since the controller was last seen stopped (a reset's
    /// CSTS.RDY = 0): a shut-down controller executes no command until it is reset (§3.6.1), so
    /// no queue pair is created ([`NvmeError::ControllerShutDown`]). Atomic because `shutdown`
    /// takes `&self`.
    shut_down: AtomicBool,
    mode: DataPointerMode,
    max_transfer_bytes: u64,
    /// Most bytes one Write Zeroes may cover (WZSL, Identify CNS 06h), `None` for no limit.
    write_zeroes_max_bytes: Option<u64>,
    /// The shutdown bound ([`shutdown_timeout_ms`]), from the last Identify (CAP.TO alone
    /// before one).
    shutdown_timeout_ms: u64,
    /// A 4 KiB buffer for Identify and log pages.
    scratch: DmaRegion,
    /// The shadow doorbell pages, once allocated (kept across resets).
    doorbell_buffer: Option<DoorbellBuffer>,
    /// Where Doorbell Buffer Config stands in the current bring-up.
    shadow_doorbells: ShadowState,
}

/// Where Doorbell Buffer Config stands in the current bring-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ShadowState {
    /// Not sent (not asked for, not offered, or a reset since): MMIO doorbells.
    Off,
    /// Accepted: I/O pairs keep their doorbells in the pages.
    Active,
    /// Sent, and it timed out or failed in a way that does not say whether it took effect:
    /// neither kind of pair would be seen for sure, so none is created until a reset succeeds.
    Unknown,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller").field("device", &self.backend.name()).field("model", &self.identify.model_number).finish()
    }
}

fn read_status(registers: &dyn RegisterIo) -> Result<ControllerStatus, NvmeError> {
    let status = ControllerStatus(registers.read32(registers::CSTS));
    if status.device_gone() {
        return Err(NvmeError::DeviceGone);
    }
    Ok(status)
}

/// Waits for CSTS.RDY to equal `ready`, polling every 200 µs until `bound` has passed.
fn wait_ready(registers: &dyn RegisterIo, ready: bool, bound: ReadyBound) -> Result<(), NvmeError> {
    let deadline = Instant::now() + Duration::from_millis(bound.ms);
    loop {
        let status = read_status(registers)?;
        if ready && status.fatal() {
            return Err(NvmeError::ControllerFatal { context: "during enable" });
        }
        if status.ready() == ready {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(NvmeError::ReadyTimeout {
                wanted: if ready { "CSTS.RDY=1" } else { "CSTS.RDY=0" },
                timeout_ms: bound.ms,
                bound: bound.source,
                csts: status.0,
            });
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Before CC.EN is cleared: a controller seen with CC.EN = 1 and CSTS.RDY = 0 may be in the middle
/// of enabling (a crashed process's bring-up, or our own that timed out waiting for RDY). The spec
/// leaves clearing EN then undefined, and a RDY = 0 read right after the clear could be the enable
/// not yet done rather than the reset done: waits (`bound`: the enable bound, since this is an
/// enable's RDY 0 → 1, or CAP.TO where the caller's `settle_bound` says our own enable already ran
/// the enable bound out) for RDY = 1 first, as SPDK's DISABLE_WAIT_FOR_READY_1 does. A fatal status
/// skips the wait (it will not become ready; clearing EN is its reset). A timeout is returned: the
/// caller then cannot know the controller stopped, and keeps what it may write.
///
/// A wait longer than CAP.TO (CRTO.CRWMT, up to about 9.1 h) is logged at warn level first:
/// bring-up or teardown would otherwise sit silent that long.
fn settle_enable(registers: &dyn RegisterIo, bound: ReadyBound, device: &str) -> Result<(), NvmeError> {
    if !ControllerConfiguration(registers.read32(registers::CC)).enabled() {
        return Ok(());
    }
    let status = read_status(registers)?;
    if status.ready() || status.fatal() {
        return Ok(());
    }
    if bound.source == ReadyBoundSource::CrtoCrwmt {
        tracing::warn!(
            device,
            timeout_ms = bound.ms,
            "controller found mid-enable (CC.EN = 1, CSTS.RDY = 0): waiting up to CRTO.CRWMT for the enable to finish before disabling it"
        );
    }
    match wait_ready(registers, true, bound) {
        Err(NvmeError::ControllerFatal { .. }) => Ok(()),
        other => other,
    }
}

/// The `Disable` stage: clears CC.EN if it is set, once [`settle_enable`] let it (within
/// `settle_bound`).
fn clear_enable(registers: &dyn RegisterIo, settle_bound: ReadyBound, device: &str) -> Result<(), NvmeError> {
    settle_enable(registers, settle_bound, device)?;
    let configuration = ControllerConfiguration(registers.read32(registers::CC));
    if configuration.enabled() {
        registers.write32(registers::CC, configuration.0 & !1);
    }
    Ok(())
}

impl Controller {
    /// Brings the controller up: disable, wait RDY=0, map the admin queues and the scratch page,
    /// allow bus mastering, program AQA/ASQ/ACQ, enable, wait RDY=1, Identify, Number of
    /// Queues. I/O queue pairs are created afterwards with [`Controller::create_io_queue_pair`].
    ///
    /// Nothing is mapped for the device until it was seen to stop (CSTS.RDY = 0 after CC.EN = 0,
    /// within CAP.TO): a function an earlier process left enabled may still DMA through that
    /// process's queues into whatever this one maps. If it never stops, nothing was mapped and the
    /// error is [`NvmeError::ReadyTimeout`]. Bus mastering ([`DeviceBackend::enable_bus_master`])
    /// is turned on only after that stop too: other functions of the same DMA space, brought up one
    /// by one, may have memory mapped already.
    pub fn init(backend: Arc<dyn DeviceBackend>, config: ControllerConfig) -> Result<Self, NvmeError> {
        let registers = backend.registers();
        let dma = backend.dma();
        let capabilities = Capabilities(registers.read64(registers::CAP));
        if capabilities.0 == u64::MAX {
            return Err(NvmeError::DeviceGone);
        }
        let version = Version(registers.read32(registers::VS));
        if !capabilities.nvm_command_set_supported() {
            return Err(NvmeError::Unsupported { reason: "CAP.CSS does not include the NVM command set".into() });
        }
        if capabilities.min_page_size_bytes() > PAGE_BYTES || capabilities.max_page_size_bytes() < PAGE_BYTES {
            return Err(NvmeError::Unsupported {
                reason: format!(
                    "controller page sizes {}..={} exclude 4 KiB",
                    capabilities.min_page_size_bytes(),
                    capabilities.max_page_size_bytes()
                ),
            });
        }
        let max_entries = capabilities.max_queue_entries();
        if max_entries < 2 {
            // MQES is 0's based and a queue needs two entries (one always stays empty): 0 is
            // reserved by the spec, and would leave no legal depth at all.
            return Err(NvmeError::Unsupported { reason: "CAP.MQES = 0: queues of one entry cannot hold a command".into() });
        }
        // CRTO exists only where CAP.CRMS.CRWMS says so (offset 68h is reserved before NVMe 2.0).
        // The driver enables with CC.CRIME = 0, so CRWMT is the bound that applies, to the
        // enable only: the spec defines it for CSTS.RDY 0 → 1, a disable stays within CAP.TO
        // (as Linux's nvme_disable_ctrl has it), and a drive that never stops is not waited
        // for up to CRWMT's 9 hours.
        let ready_timeouts = capabilities.ready_with_media_supported().then(|| ReadyTimeouts(registers.read32(registers::CRTO)));
        let enable_bound = ReadyBound::enable(capabilities, ready_timeouts);
        if let Some(crto) = ready_timeouts.filter(|crto| u64::from(crto.with_media_500ms_units()) * 500 < capabilities.ready_timeout_ms()) {
            tracing::warn!(device = %backend.name(), crto = crto.0, cap = capabilities.0, "CRTO.CRWMT is below CAP.TO: waiting CAP.TO");
        }
        // Stop the function before any memory is mapped for it (see above). The bring-up below
        // starts with the same two stages; on a stopped controller they write nothing.
        clear_enable(registers.as_ref(), enable_bound, &backend.name())?;
        wait_ready(registers.as_ref(), false, ReadyBound::disable(capabilities))?;
        // AQA holds 12-bit sizes: admin queues have at most 4096 entries.
        let admin_depth = config.admin_queue_depth.clamp(2, max_entries.min(4096));
        let admin_queue =
            QueuePair::allocate(QueueId(0), admin_depth, dma.as_ref(), Arc::clone(&registers), capabilities.doorbell_stride_log2())?;
        let admin = Arc::new(AdminShared::new(admin_queue, config.admin_timeout));
        let scratch = dma.allocate(IDENTIFY_BYTES)?;
        let mut controller = Self {
            backend,
            registers,
            dma,
            config,
            capabilities,
            enable_bound,
            enable_ran_out: false,
            version,
            admin,
            identify: IdentifyController::default(),
            namespaces: Vec::new(),
            refused_namespaces: Vec::new(),
            granted_queue_pairs: 0,
            unfinished: None,
            shut_down: AtomicBool::new(false),
            mode: DataPointerMode::Prp,
            max_transfer_bytes: PAGE_BYTES,
            write_zeroes_max_bytes: None,
            shutdown_timeout_ms: shutdown_timeout_ms(capabilities, 0),
            scratch,
            doorbell_buffer: None,
            shadow_doorbells: ShadowState::Off,
        };
        controller.bring_up(None)?;
        Ok(controller)
    }

    /// Runs the bring-up state machine from `Disable` to `Ready`, and records the stage it
    /// failed at (`unfinished`). `ending` is the doorbell gate held by a reset: released once
    /// CSTS.RDY = 0 was seen (marking the old generations' queues gone) or bring-up failed
    /// before that (leaving them possibly live).
    fn bring_up(&mut self, ending: Option<ResetGuard<'_>>) -> Result<(), NvmeError> {
        let mut stage = BringUpStage::Disable;
        let outcome = self.run_stages(&mut stage, ending);
        self.unfinished = outcome.is_err().then_some(stage);
        outcome
    }

    /// The stages of [`Controller::bring_up`]; `stage` is left at the one that failed.
    fn run_stages(&mut self, stage: &mut BringUpStage, mut ending: Option<ResetGuard<'_>>) -> Result<(), NvmeError> {
        let enable_bound = self.enable_bound;
        let disable_bound = ReadyBound::disable(self.capabilities);
        loop {
            tracing::debug!(device = %self.backend.name(), ?stage, "bring-up");
            *stage = match *stage {
                BringUpStage::Disable => {
                    clear_enable(self.registers.as_ref(), self.settle_bound(), &self.backend.name())?;
                    BringUpStage::WaitNotReady
                }
                BringUpStage::WaitNotReady => {
                    wait_ready(self.registers.as_ref(), false, disable_bound)?;
                    // CSTS.RDY = 0 after CC.EN = 0: the controller reset completed and deleted
                    // every I/O queue (§3.7.2), so older queue pairs' rings are free to go.
                    if let Some(ending) = ending.take() {
                        ending.mark_quiesced();
                    }
                    self.admin.forget_queue_ids();
                    self.granted_queue_pairs = 0;
                    // The reset §3.6.1 asks for after a shutdown: the next enable starts afresh.
                    self.shut_down.store(false, Ordering::Relaxed);
                    // A controller reset clears the Doorbell Buffer Config too.
                    self.shadow_doorbells = ShadowState::Off;
                    // Only now may the function DMA (VFIO opens it, and a function-level reset
                    // leaves it, with bus mastering off): it was seen stopped, so it runs no
                    // queue an earlier process left it, and the next DMA it does is for the
                    // admin queue configured below.
                    self.backend.enable_bus_master()?;
                    BringUpStage::ConfigureAdminQueues
                }
                BringUpStage::ConfigureAdminQueues => {
                    let mut admin = self.admin.lock_admin();
                    admin.clear()?;
                    let depth = admin.depth();
                    self.registers.write32(registers::AQA, registers::admin_queue_attributes(depth, depth));
                    self.registers.write64(registers::ASQ, admin.submission_iova().0);
                    self.registers.write64(registers::ACQ, admin.completion_iova().0);
                    BringUpStage::Enable
                }
                BringUpStage::Enable => {
                    // A new enable of ours: it gets the whole enable bound.
                    self.enable_ran_out = false;
                    self.registers.write32(registers::CC, ControllerConfiguration::for_enable().0);
                    BringUpStage::WaitReady
                }
                BringUpStage::WaitReady => {
                    if let Err(error) = wait_ready(self.registers.as_ref(), true, enable_bound) {
                        self.enable_ran_out = matches!(error, NvmeError::ReadyTimeout { .. });
                        return Err(error);
                    }
                    BringUpStage::Identify
                }
                BringUpStage::Identify => {
                    self.identify_all()?;
                    BringUpStage::NumberOfQueues
                }
                BringUpStage::NumberOfQueues => {
                    let requested = self.config.io_queue_pairs_requested.max(1);
                    let completion = self.admin_command(SubmissionEntry::set_number_of_queues(requested, requested))?;
                    let submission_queues = (completion.dw0 & 0xFFFF) as u16;
                    let completion_queues = (completion.dw0 >> 16) as u16;
                    // dw0 is 0's based; the controller may grant more than asked (we use what we asked).
                    self.granted_queue_pairs = submission_queues.min(completion_queues).saturating_add(1).min(requested);
                    self.admin.grant_queue_ids(self.granted_queue_pairs);
                    BringUpStage::DoorbellBuffer
                }
                BringUpStage::DoorbellBuffer => {
                    if self.config.shadow_doorbells && self.identify.supports_doorbell_buffer_config() {
                        self.configure_doorbell_buffer()?;
                    }
                    BringUpStage::Ready
                }
                BringUpStage::Ready => return Ok(()),
            };
        }
    }

    /// Hands the (zeroed) shadow doorbell pages to the controller. Bring-up fails if it refuses
    /// them after advertising the command: it may have taken them anyway, and then it would no
    /// longer see MMIO-only doorbells.
    fn configure_doorbell_buffer(&mut self) -> Result<(), NvmeError> {
        let buffer = match self.doorbell_buffer.take() {
            Some(buffer) => {
                buffer.clear()?;
                buffer
            }
            None => DoorbellBuffer::allocate(self.dma.as_ref(), self.capabilities.doorbell_stride_log2())?,
        };
        let command = buffer.command();
        self.doorbell_buffer = Some(buffer);
        match self.admin_command(command) {
            Ok(_) => {
                self.shadow_doorbells = ShadowState::Active;
                Ok(())
            }
            Err(error) => {
                if may_have_executed(&error) {
                    self.shadow_doorbells = ShadowState::Unknown;
                }
                Err(error)
            }
        }
    }

    /// Refuses new queue pairs while Doorbell Buffer Config may or may not have taken effect.
    fn check_doorbells_known(&self) -> Result<(), NvmeError> {
        match self.shadow_doorbells {
            ShadowState::Unknown => Err(NvmeError::ShadowDoorbellsUnknown),
            ShadowState::Off | ShadowState::Active => Ok(()),
        }
    }

    /// Refuses new queue pairs after a bring-up that did not finish: a failure after the
    /// controller stopped leaves no grant and no I/O queue (creation would otherwise report the
    /// ids of a grant that no longer exists used up), one before it leaves the controller in
    /// a state nobody confirmed. Refuses them after a shutdown too, until a reset: the
    /// controller would not execute the Create commands, and a Create that times out leaves its
    /// rings leaked and its queue id reserved.
    fn check_brought_up(&self) -> Result<(), NvmeError> {
        if let Some(stage) = self.unfinished {
            return Err(NvmeError::ControllerNotReady { stage });
        }
        // Relaxed: the flag orders no memory; a creation racing a shutdown on another thread
        // is a caller's race either way.
        if self.shut_down.load(Ordering::Relaxed) {
            return Err(NvmeError::ControllerShutDown);
        }
        Ok(())
    }

    /// Whether this controller's I/O queue pairs use shadow doorbells (asked for in
    /// [`ControllerConfig::shadow_doorbells`], advertised, and accepted).
    pub fn shadow_doorbells_active(&self) -> bool {
        self.shadow_doorbells == ShadowState::Active
    }

    fn identify_all(&mut self) -> Result<(), NvmeError> {
        let bytes = self.identify_raw(IdentifyCns::Controller, 0)?;
        let identify = IdentifyController::parse(&bytes)?;
        // Everything derived from Identify is assigned together at the end: a bring-up that
        // fails part-way (a namespace Identify that times out) keeps the view of before whole,
        // rather than a new transfer limit next to old Identify data and namespaces.
        let mode = match (self.config.data_pointer, identify.sgl_support.supported()) {
            (DataPointerPreference::Prp, _) | (DataPointerPreference::Auto, false) => DataPointerMode::Prp,
            (DataPointerPreference::Sgl, true) | (DataPointerPreference::Auto, true) => DataPointerMode::Sgl,
            (DataPointerPreference::Sgl, false) => {
                return Err(NvmeError::Unsupported { reason: "SGL requested but Identify Controller SGLS reports no SGL support".into() });
            }
        };
        // One PRP list page per command bounds a command at 2 MiB; MDTS may bound it further.
        let max_transfer_bytes =
            identify.max_transfer_bytes(self.capabilities.min_page_size_bytes()).unwrap_or(TRANSFER_BYTES_MAX).min(TRANSFER_BYTES_MAX);
        // WZSL (CNS 06h, for the NVM command set) bounds one Write Zeroes, which MDTS does not.
        // Asked only where Write Zeroes is supported, and only of controllers of NVMe 1.2 or
        // later, whose CNS field is a whole byte: a 1.0 controller reads one bit of it, a 1.1
        // controller two, and would answer 06h as another CNS, whose data would be taken for
        // these limits (Linux asks the same controllers, `nvme_id_cns_ok`).
        let write_zeroes_max_bytes = if identify.supports_write_zeroes() && self.version.0 >= 0x0001_0200 {
            match self.identify_raw(IdentifyCns::IoCommandSetController, 0) {
                Ok(bytes) => NvmIdentifyController::parse(&bytes)?.write_zeroes_max_bytes(self.capabilities.min_page_size_bytes()),
                // Optional before NVMe 2.0: a controller that refuses it (Invalid Field, as
                // most 1.x controllers do) reports no limit. A timeout or a transport error
                // says the controller itself is unwell: bring-up fails.
                Err(NvmeError::Command { status, .. }) => {
                    tracing::debug!(device = %self.backend.name(), %status, "no NVM Identify Controller (CNS 06h): Write Zeroes unbounded");
                    None
                }
                Err(error) => return Err(error),
            }
        } else {
            None
        };
        // CNS 02h exists from NVMe 1.1; older controllers: every NSID up to NN (inactive ones
        // read as zeroes and are skipped below).
        let every_nsid = || (1..=identify.namespace_count.min(NAMESPACES_MAX as u32)).collect::<Vec<_>>();
        let namespace_ids = if self.version.0 >= 0x0001_0100 {
            match self.identify_raw(IdentifyCns::ActiveNamespaceList, 0) {
                Ok(list) => valid_namespace_ids(parse_active_namespaces(&list)),
                // A controller that claims 1.1 or later but refuses the list (Invalid Field, as
                // some do) answered: scan NSIDs as for an older one, as Linux does. A timeout or
                // a transport error says the controller itself is unwell: bring-up fails.
                Err(NvmeError::Command { status, .. }) => {
                    tracing::warn!(
                        device = %self.backend.name(),
                        %status,
                        "Identify Active Namespace List (CNS 02h) failed: identifying NSIDs 1..=NN one by one instead"
                    );
                    every_nsid()
                }
                Err(error) => return Err(error),
            }
        } else {
            every_nsid()
        };
        let mut namespaces = Vec::with_capacity(namespace_ids.len());
        let mut refused = Vec::new();
        for nsid in namespace_ids.into_iter().take(NAMESPACES_MAX) {
            let classified = match self.identify_raw(IdentifyCns::Namespace, nsid) {
                // An inactive namespace returns zeroes; skip rather than fail the whole controller.
                Ok(bytes) if bytes.iter().all(|&byte| byte == 0) => continue,
                // Data the driver cannot compute with refuses this namespace, not the controller.
                Ok(bytes) => match IdentifyNamespace::parse(&bytes) {
                    Ok(namespace) => classify(NamespaceId(nsid), &namespace, max_transfer_bytes),
                    Err(error) => Err(refuse_malformed(NamespaceId(nsid), error)),
                },
                // So does an error status: the controller answered, about this namespace. A
                // timeout or a transport error says the controller itself is unwell: bring-up fails.
                Err(NvmeError::Command { status, .. }) => Err(refuse_identify_failed(NamespaceId(nsid), status)),
                Err(error) => return Err(error),
            };
            match classified {
                Ok(namespace) => namespaces.push(namespace),
                Err(refusal) => {
                    tracing::warn!(device = %self.backend.name(), %refusal, "namespace refused");
                    refused.push(refusal);
                }
            }
        }
        self.shutdown_timeout_ms = shutdown_timeout_ms(self.capabilities, IdentifyController::rtd3_entry_latency_us(&bytes));
        self.mode = mode;
        self.max_transfer_bytes = max_transfer_bytes;
        self.write_zeroes_max_bytes = write_zeroes_max_bytes;
        self.identify = identify;
        self.namespaces = namespaces;
        self.refused_namespaces = refused;
        Ok(())
    }

    fn identify_raw(&self, cns: IdentifyCns, nsid: u32) -> Result<Vec<u8>, NvmeError> {
        let mut bytes = vec![0u8; IDENTIFY_BYTES];
        self.admin.execute_with_buffer(SubmissionEntry::identify(cns, nsid, self.scratch.iova().0), &self.scratch, &mut bytes)?;
        Ok(bytes)
    }

    /// Runs one admin command and waits for it (bounded by the configured admin timeout). A
    /// command that times out keeps the admin queue: later ones fail with
    /// [`NvmeError::QueueBusy`] until its late completion arrives or a reset succeeds. A caller
    /// passing its own data buffer must likewise leave it alone after a timeout.
    pub fn admin_command(&self, entry: SubmissionEntry) -> Result<Completion, NvmeError> {
        self.admin.execute(entry)
    }

    /// The deepest I/O queue this controller gets: CAP.MQES, and at most [`QUEUE_DEPTH_MAX`] so
    /// that command ids keep generation bits.
    pub fn max_queue_depth(&self) -> u32 {
        self.capabilities.max_queue_entries().min(QUEUE_DEPTH_MAX)
    }

    fn check_queue_depth(&self, depth: u32) -> Result<(), NvmeError> {
        let max = self.max_queue_depth();
        if !(2..=max).contains(&depth) {
            return Err(NvmeError::InvalidQueueDepth { requested: depth, max });
        }
        Ok(())
    }

    /// Creates an I/O completion queue and submission queue with `depth` entries each, at the
    /// lowest free queue id. Depth is bounded by [`Controller::max_queue_depth`].
    pub fn create_io_queue_pair(&self, depth: u32) -> Result<IoQueuePair, NvmeError> {
        self.check_doorbells_known()?;
        self.check_brought_up()?;
        self.check_queue_depth(depth)?;
        let id = self.admin.reserve_queue_id(self.granted_queue_pairs)?;
        let stride = self.capabilities.doorbell_stride_log2();
        let allocated = QueuePair::allocate(id, depth, self.dma.as_ref(), Arc::clone(&self.registers), stride).and_then(|mut queue| {
            if let Some(buffer) = self.doorbell_buffer.as_ref().filter(|_| self.shadow_doorbells_active()) {
                queue.attach_shadow(buffer.slots(id)?);
            }
            Ok(queue)
        });
        let mut queue = match allocated {
            Ok(queue) => queue,
            Err(error) => {
                self.admin.release_queue_id(id);
                return Err(error);
            }
        };
        let generation = self.admin.gate.generation();
        queue.attach_gate(Arc::clone(&self.admin.gate), generation);
        queue.defer_completion_doorbell();
        self.create_queues_on_controller(id, depth, queue.submission_iova().0, queue.completion_iova().0, || queue.regions().to_vec())?;
        let mut pair = IoQueuePair::new(
            queue,
            PairOwner::Controller { admin: Arc::clone(&self.admin), generation },
            self.mode,
            self.max_transfer_bytes,
            self.namespaces.clone(),
            self.refused_namespaces.clone(),
        );
        if self.identify.sgl_support.dword_alignment_required() {
            pair.require_dword_sgl_lengths();
        }
        if let Some(max_bytes) = self.write_zeroes_max_bytes {
            pair.limit_write_zeroes(max_bytes);
        }
        Ok(pair)
    }

    /// Sends Create I/O CQ then Create I/O SQ for queue pair `id`. On failure, removes whatever
    /// the controller may have created and releases the id; if that cleanup fails too, the
    /// rings (`regions`) are leaked and the id stays reserved, since the controller may still
    /// write them.
    fn create_queues_on_controller(
        &self,
        id: QueueId,
        depth: u32,
        submission_iova: u64,
        completion_iova: u64,
        regions: impl FnOnce() -> Vec<DmaRegion>,
    ) -> Result<(), NvmeError> {
        let (error, sq_may_exist, cq_may_exist) =
            match self.admin_command(SubmissionEntry::create_io_completion_queue(id.0, depth, completion_iova)) {
                Err(error) => {
                    let cq_may_exist = may_have_executed(&error);
                    (error, false, cq_may_exist)
                }
                Ok(_) => match self.admin_command(SubmissionEntry::create_io_submission_queue(id.0, depth, submission_iova, id.0)) {
                    Ok(_) => return Ok(()),
                    Err(error) => {
                        let sq_may_exist = may_have_executed(&error);
                        (error, sq_may_exist, true)
                    }
                },
            };
        if let Err(cleanup) = self.admin.abandon_queue_pair(id, sq_may_exist, cq_may_exist) {
            self.admin.leak_queue_pair(id, regions(), &cleanup);
        }
        Err(error)
    }

    /// Creates an I/O queue pair that another agent (a GPU kernel) drives: the host programs the
    /// controller with `submission`/`completion` (or freshly allocated DMA memory when `None`),
    /// then never touches the rings. The returned layout has the ring addresses and doorbell
    /// offsets that agent needs. The host cannot stop that agent's doorbell writes: see
    /// [`DetachedQueuePair`] for the contract around drop and reset.
    ///
    /// Rings the caller gives must be memory of this controller's DMA space ([`Controller::dma`]'s
    /// allocations and mappings) at their IOVAs ([`NvmeError::RingNotDeviceMemory`] otherwise)
    /// and apart from each other ([`NvmeError::RingsOverlap`]).
    pub fn create_detached_queue_pair(&self, depth: u32, rings: Option<(DmaRegion, DmaRegion)>) -> Result<DetachedQueuePair, NvmeError> {
        self.check_doorbells_known()?;
        self.check_brought_up()?;
        if self.shadow_doorbells_active() {
            return Err(NvmeError::ShadowDoorbellsActive);
        }
        self.check_queue_depth(depth)?;
        let (submission, completion) = match rings {
            Some(rings) => rings,
            None => {
                (self.dma.allocate(depth as usize * SUBMISSION_ENTRY_BYTES)?, self.dma.allocate(depth as usize * COMPLETION_ENTRY_BYTES)?)
            }
        };
        DetachedQueuePair::validate_rings(depth, &submission, &completion)?;
        DetachedQueuePair::check_rings_in(self.dma.as_ref(), depth, &submission, &completion)?;
        completion.fill(0, depth as usize * COMPLETION_ENTRY_BYTES, 0)?;
        let id = self.admin.reserve_queue_id(self.granted_queue_pairs)?;
        // The agent writes these offsets of BAR0 itself: check them as QueuePair::allocate does
        // for host-driven pairs, before the controller creates anything.
        let (submission_doorbell_offset, completion_doorbell_offset) =
            match doorbell_offsets(id, self.capabilities.doorbell_stride_log2(), self.registers.len()) {
                Ok(offsets) => offsets,
                Err(error) => {
                    self.admin.release_queue_id(id);
                    return Err(error);
                }
            };
        let layout = DetachedQueueLayout {
            id,
            depth,
            submission_iova: submission.iova(),
            completion_iova: completion.iova(),
            submission_host_address: submission.host_address(),
            completion_host_address: completion.host_address(),
            submission_doorbell_offset,
            completion_doorbell_offset,
        };
        let generation = self.admin.gate.generation();
        self.create_queues_on_controller(id, depth, submission.iova().0, completion.iova().0, || {
            vec![submission.clone(), completion.clone()]
        })?;
        Ok(DetachedQueuePair::new(layout, submission, completion, Arc::clone(&self.admin), generation))
    }

    /// The controller's register space (for mapping doorbells into another agent).
    pub fn registers(&self) -> &Arc<dyn RegisterIo> {
        &self.registers
    }

    /// Disables and re-enables the controller (function-level reset first when `function_reset`),
    /// then repeats Identify and Number of Queues. Existing queue pairs become stale first:
    /// from the moment this is called, none of them can write a doorbell (their operations fail
    /// with [`NvmeError::QueueStale`]); create new ones. This waits for any doorbell write or
    /// queue deletion already in progress on another thread. A deletion sends two admin
    /// commands (Delete SQ, Delete CQ), each bounded by the admin timeout, and deletions take the
    /// admin queue in turn, behind any admin command already running: with `n` pairs being
    /// deleted when this is called, the wait is up to about `2n + 1` admin timeouts (with the
    /// 10 s default and 16 pairs, over 5 minutes) against a controller that answers each just
    /// in time. One that does not answer at all ends it sooner: after the first timeout the
    /// admin queue is busy, and the other deletions fail at once ([`NvmeError::QueueBusy`]).
    ///
    /// If the controller never reaches CSTS.RDY = 0 (an error from this call), the old queues
    /// may still be live: their pairs keep (leak) their rings when dropped, until a later reset
    /// succeeds. The same holds when a doorbell write in progress on another thread does not
    /// finish within a bound (its thread is stopped):
    /// [`NvmeError::ResetBlockedByDoorbellWrite`], with the controller left untouched; retry
    /// once that thread runs again.
    ///
    /// A reset that fails otherwise (in its function-level reset or at any bring-up stage)
    /// leaves the controller unusable for new queue pairs: creating one fails with
    /// [`NvmeError::ControllerNotReady`], naming the stage, until a reset succeeds (or
    /// [`NvmeError::ShadowDoorbellsUnknown`] first, where a Doorbell Buffer Config whose fate is
    /// unknown may have run: that check comes before this one). One that
    /// failed after the controller stopped has no grant left ([`Controller::granted_queue_pairs`]
    /// is 0), and the Identify-derived view (Identify data, namespaces, transfer limit, data
    /// pointer mode) stays the one of before whenever Identify did not complete.
    pub fn reset(&mut self, function_reset: bool) -> Result<(), NvmeError> {
        // The gate stays exclusive until bring-up saw RDY = 0 (or failed before): a pair
        // dropped on another thread meanwhile waits to learn whether its rings may go.
        let gate = Arc::clone(&self.admin.gate);
        let ending = gate.begin_reset()?;
        if function_reset {
            if let Err(error) = self.backend.function_reset() {
                // Whether the function was reset is unknown, and with it the controller's state:
                // as after a bring-up that failed before it saw the controller stop.
                self.unfinished = Some(BringUpStage::Disable);
                return Err(error.into());
            }
        }
        self.bring_up(Some(ending))
    }

    /// Stops the controller for teardown: a normal shutdown (so a real SSD commits its cache and
    /// records a clean shutdown) unless it is disabled or fatal, waited for within the shutdown
    /// bound ([`Controller::shutdown_timeout`]), then CC.EN = 0 and a wait for CSTS.RDY = 0 within
    /// CAP.TO. CC.EN is cleared while the shutdown still reads in progress only once the shutdown
    /// bound has passed. A controller found in the middle of an enable is first given time to
    /// finish it ([`settle_enable`] within [`Controller::settle_bound`]). `Ok` means the
    /// controller was seen to stop, so it no longer touches any queue memory.
    fn stop(&self) -> Result<(), NvmeError> {
        settle_enable(self.registers.as_ref(), self.settle_bound(), &self.backend.name())?;
        let status = read_status(self.registers.as_ref())?;
        let configuration = ControllerConfiguration(self.registers.read32(registers::CC));
        if configuration.enabled() && status.ready() && !status.fatal() {
            if let Err(error) = self.shutdown() {
                // Not fatal for teardown: the disable below is what decides whether memory may go.
                tracing::warn!(device = %self.backend.name(), %error, "normal shutdown before teardown failed");
            }
        }
        let configuration = ControllerConfiguration(self.registers.read32(registers::CC));
        self.registers.write32(registers::CC, configuration.0 & !1);
        wait_ready(self.registers.as_ref(), false, ReadyBound::disable(self.capabilities))
    }

    /// How long a disable first waits for an enable under way to finish ([`settle_enable`]): the
    /// enable bound, or CAP.TO once this controller's own last enable ran that bound out
    /// (`enable_ran_out`: it has had its bound; CAP.TO is the slack a disable gets anyway).
    fn settle_bound(&self) -> ReadyBound {
        if self.enable_ran_out {
            ReadyBound::disable(self.capabilities)
        } else {
            self.enable_bound
        }
    }

    /// Normal shutdown (§3.6.1): CC.SHN = 01b, wait for CSTS.SHST = complete within the
    /// shutdown bound ([`Controller::shutdown_timeout`]; [`NvmeError::ReadyTimeout`] past it);
    /// `ControllerFatal` as soon as CSTS.CFS shows the shutdown failed.
    ///
    /// A shut-down controller executes no command until it is reset (CC.EN 1 → 0), whatever
    /// this returns: from this call until [`Controller::reset`] succeeds, creating a queue pair
    /// is refused, with [`NvmeError::ControllerShutDown`], or, once a reset failed in its
    /// function-level reset or bring-up (before it saw the controller stop or after), with that
    /// reset's [`NvmeError::ControllerNotReady`], which is checked first. Existing queue pairs
    /// and admin commands are not refused: stop using them before calling this. What the
    /// controller does with a command sent afterwards is undefined; an admin command that times
    /// out holds the admin queue ([`NvmeError::QueueBusy`]) until its late completion or a
    /// reset, and a pair dropped afterwards whose Delete commands time out keeps (leaks) its
    /// rings. Reset the controller to use it again.
    pub fn shutdown(&self) -> Result<(), NvmeError> {
        // Before CC.SHN: from the write on the controller may stop taking commands.
        self.shut_down.store(true, Ordering::Relaxed);
        let configuration = self.registers.read32(registers::CC);
        self.registers.write32(registers::CC, configuration & !(0x3 << 14) | 1 << 14);
        let timeout_ms = self.shutdown_timeout_ms;
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        loop {
            let status = read_status(self.registers.as_ref())?;
            if status.shutdown() == registers::ShutdownStatus::Complete {
                return Ok(());
            }
            // A controller that failed its shutdown (its write-back, say) sets CFS and never
            // reports it complete: say so now rather than after the whole bound.
            if status.fatal() {
                return Err(NvmeError::ControllerFatal { context: "during shutdown: its data may not be durable" });
            }
            if Instant::now() >= deadline {
                return Err(NvmeError::ReadyTimeout {
                    wanted: "CSTS.SHST=complete",
                    timeout_ms,
                    bound: ReadyBoundSource::Shutdown,
                    csts: status.0,
                });
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    /// How long [`Controller::shutdown`] (and teardown's shutdown) waits for CSTS.SHST to read
    /// complete: the controller's RTD3 Entry Latency (Identify RTD3E) capped at 60 s, and at
    /// least CAP.TO and 1 s.
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_millis(self.shutdown_timeout_ms)
    }

    /// The enable bound: how long bring-up and a reset wait for CSTS.RDY to become 1 after
    /// setting CC.EN (and how long they, and teardown, give a controller found in the middle
    /// of an enable to finish it, unless that is an enable of this controller's that already
    /// ran this bound out: then CAP.TO): CAP.TO (at least 500 ms), or, on a controller with
    /// CAP.CRMS.CRWMS set, CRTO.CRWMT when that is larger (NVMe 2.0: CAP.TO may then be a
    /// saturated or lower figure). The driver enables with CC.CRIME = 0, so CRTO.CRIMT does not
    /// apply. Every wait for CSTS.RDY to become 0 after clearing CC.EN is bounded by CAP.TO
    /// ([`Capabilities::ready_timeout_ms`]) instead: CRWMT is defined for the enable only.
    pub fn ready_timeout(&self) -> Duration {
        Duration::from_millis(self.enable_bound.ms)
    }

    /// Current controller status; `DeviceGone` if the registers read as all ones.
    pub fn status(&self) -> Result<ControllerStatus, NvmeError> {
        read_status(self.registers.as_ref())
    }

    /// Enables or disables the volatile write cache (Set Features 06h).
    pub fn set_volatile_write_cache(&self, enabled: bool) -> Result<(), NvmeError> {
        self.admin_command(SubmissionEntry::set_features(FeatureId::VolatileWriteCache, u32::from(enabled))).map(|_| ())
    }

    /// Whether the volatile write cache is enabled (Get Features 06h).
    pub fn volatile_write_cache(&self) -> Result<bool, NvmeError> {
        Ok(self.admin_command(SubmissionEntry::get_features(FeatureId::VolatileWriteCache))?.dw0 & 1 == 1)
    }

    /// Reads the first `bytes` of a log page (at most 4096) into a new buffer. Refused with
    /// [`NvmeError::QueueBusy`] while an admin command that timed out is still outstanding.
    pub fn log_page(&self, log: LogPageId, bytes: usize) -> Result<Vec<u8>, NvmeError> {
        let bytes = bytes.min(IDENTIFY_BYTES);
        // The device transfers whole dwords (NUMD): ask for those that cover `bytes`, so that
        // every byte returned is one it sent (the buffer is zeroed first: a short count would
        // return zeroes as data), then keep only what was asked for.
        let dwords = bytes.div_ceil(4).max(1);
        let mut data = vec![0u8; dwords * 4];
        let entry = SubmissionEntry::get_log_page(log, 0xFFFF_FFFF, dwords as u32, self.scratch.iova().0);
        self.admin.execute_with_buffer(entry, &self.scratch, &mut data)?;
        data.truncate(bytes);
        Ok(data)
    }

    pub fn identify(&self) -> &IdentifyController {
        &self.identify
    }

    /// The namespaces I/O can use.
    pub fn namespaces(&self) -> &[Namespace] {
        &self.namespaces
    }

    /// Active namespaces the driver refuses (metadata, protection information, ...), and why.
    pub fn refused_namespaces(&self) -> &[RefusedNamespace] {
        &self.refused_namespaces
    }

    /// A usable namespace; [`NvmeError::UnsupportedNamespaceFormat`] for a refused one.
    pub fn namespace(&self, id: NamespaceId) -> Result<Namespace, NvmeError> {
        crate::namespace::find(&self.namespaces, &self.refused_namespaces, id)
    }

    /// Queue pairs whose rings were kept (leaked) because the controller might still write
    /// them: a failed Delete I/O SQ/CQ, a failed creation that could not be undone, or a pair
    /// dropped after a reset that never saw the controller stop. Each is logged at error level.
    pub fn leaked_queue_pairs(&self) -> u64 {
        self.admin.leaked().0
    }

    /// Bytes of DMA memory those leaked queue pairs hold.
    pub fn leaked_bytes(&self) -> u64 {
        self.admin.leaked().1
    }

    pub fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    pub fn version(&self) -> Version {
        self.version
    }

    /// I/O queue pairs the controller granted (and we may create).
    pub fn granted_queue_pairs(&self) -> u16 {
        self.granted_queue_pairs
    }

    pub fn data_pointer_mode(&self) -> DataPointerMode {
        self.mode
    }

    /// Largest transfer one command carries (MDTS, and at most one PRP list page).
    pub fn max_transfer_bytes(&self) -> u64 {
        self.max_transfer_bytes
    }

    /// Most bytes one Write Zeroes may cover (WZSL, from the NVM command set's Identify
    /// Controller, CNS 06h), `None` where the controller reports no limit or was not asked
    /// (no Write Zeroes, or older than NVMe 1.2). Queue pairs made here split at it.
    pub fn write_zeroes_max_bytes(&self) -> Option<u64> {
        self.write_zeroes_max_bytes
    }

    pub fn dma(&self) -> &Arc<dyn DmaAllocator> {
        &self.dma
    }

    pub fn backend(&self) -> &Arc<dyn DeviceBackend> {
        &self.backend
    }
}

#[cfg(test)]
impl Controller {
    /// Replaces the doorbell gate (one with a short ringer wait, say); before any queue pair
    /// exists, since pairs share the gate.
    pub(crate) fn replace_gate_for_test(&mut self, gate: crate::gate::DoorbellGate) {
        let admin = Arc::get_mut(&mut self.admin).expect("no queue pair shares the admin state yet");
        *Arc::get_mut(&mut admin.gate).expect("no queue pair shares the gate yet") = gate;
    }

    pub(crate) fn gate_for_test(&self) -> &crate::gate::DoorbellGate {
        &self.admin.gate
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        // Stale first: from here no queue pair of this controller can ring a doorbell or delete
        // itself, so nothing races with the disable below. If a doorbell write on another
        // thread outlasts the gate's bound, stop the controller all the same (nothing enables
        // it again, so the late write lands on a live queue of its own pair or on a disabled
        // controller), but leave the old pairs possibly live: they keep their rings.
        let gate = Arc::clone(&self.admin.gate);
        let ending = gate.begin_reset().ok();
        match self.stop() {
            Ok(()) => {
                if let Some(ending) = ending {
                    ending.mark_quiesced();
                }
            }
            Err(error) => {
                drop(ending);
                // Still enabled as far as we know: it may write its admin CQ and any I/O queue,
                // and an Identify that timed out may still land in the scratch page.
                let shadow = self.doorbell_buffer.iter().flat_map(DoorbellBuffer::regions);
                let kept: usize =
                    self.admin.lock_admin().regions().into_iter().chain([self.scratch.clone()]).chain(shadow).map(DmaRegion::leak).sum();
                tracing::error!(
                    device = %self.backend.name(),
                    %error,
                    bytes = kept,
                    "controller could not be disabled at teardown: its admin queue, scratch and shadow doorbell memory are kept (leaked), and queue pairs \
                     still alive will keep theirs"
                );
            }
        }
    }
}

/// The active namespace list as the driver will use it: NSIDs in 1..=FFFFFFFEh, strictly
/// ascending as the spec requires (§5.17.2.2), at most [`NAMESPACES_MAX`]. A list that breaks
/// the order is read up to the break: the device is not trusted to terminate it properly.
fn valid_namespace_ids(listed: Vec<u32>) -> Vec<u32> {
    let mut previous = 0u32;
    listed
        .into_iter()
        .take_while(|&nsid| {
            let valid = nsid > previous && nsid != u32::MAX;
            previous = nsid;
            valid
        })
        .take(NAMESPACES_MAX)
        .collect()
}
