//! Controller bring-up (§3.5.1) as a state machine with deadlines from CAP.TO, Identify, queue
//! creation and deletion, features, log pages and reset.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::datapath::{DataPointerMode, PAGE_BYTES, PRP_LIST_ENTRIES_MAX};
use crate::detached::{DetachedQueueLayout, DetachedQueuePair};
use crate::error::NvmeError;
use crate::hw::{DeviceBackend, DmaAllocator, DmaRegion, RegisterIo};
use crate::io::IoQueuePair;
use crate::queue::{Completion, QueuePair};
use crate::spec::command::{FeatureId, IdentifyCns, LogPageId};
use crate::spec::identify::{parse_active_namespaces, IdentifyError};
use crate::spec::registers::{self, Capabilities, ControllerConfiguration, ControllerStatus, Version};
use crate::spec::{IdentifyController, IdentifyNamespace, SubmissionEntry, COMPLETION_ENTRY_BYTES, IDENTIFY_BYTES, SUBMISSION_ENTRY_BYTES};
use crate::types::{NamespaceId, QueueId};

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
}

impl Default for ControllerConfig {
    fn default() -> Self {
        Self {
            admin_queue_depth: 64,
            io_queue_pairs_requested: 16,
            data_pointer: DataPointerPreference::Auto,
            admin_timeout: Duration::from_secs(10),
        }
    }
}

/// One active namespace: what I/O needs to know about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Namespace {
    pub id: NamespaceId,
    pub block_size_bytes: u32,
    pub size_blocks: u64,
}

impl Namespace {
    pub fn size_bytes(&self) -> u64 {
        self.size_blocks * u64::from(self.block_size_bytes)
    }
}

/// The bring-up stages (§3.5.1), in order; each waiting stage has a CAP.TO deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BringUpStage {
    Disable,
    WaitNotReady,
    ConfigureAdminQueues,
    Enable,
    WaitReady,
    Identify,
    NumberOfQueues,
    Ready,
}

/// State shared with I/O queue pairs, so that they can delete themselves on drop and notice a
/// reset.
pub(crate) struct AdminShared {
    pub(crate) admin: Mutex<QueuePair>,
    pub(crate) epoch: AtomicU64,
    pub(crate) queue_ids_in_use: Mutex<Vec<bool>>,
    pub(crate) timeout: Duration,
}

impl AdminShared {
    pub(crate) fn lock_admin(&self) -> MutexGuard<'_, QueuePair> {
        self.admin.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Deletes an I/O SQ and its CQ (bounded by the admin timeout) and frees the queue id. On
    /// failure the id stays reserved: reusing it while the controller still has the queue would
    /// fail.
    /// Deletes an I/O queue pair: the submission queue first (unless `sq_deleted` says an
    /// earlier try already did), which makes the controller abort or finish its commands, so
    /// none of them moves data once that step succeeded; then the completion queue, and the id
    /// is released. On an error the id stays reserved; `sq_deleted` tells a retry where to
    /// resume.
    pub(crate) fn try_delete_io_queue_pair(&self, id: QueueId, sq_deleted: &mut bool) -> Result<(), NvmeError> {
        let mut admin = self.lock_admin();
        if !*sq_deleted {
            admin.execute(SubmissionEntry::delete_io_submission_queue(id.0), self.timeout)?;
            *sq_deleted = true;
        }
        admin.execute(SubmissionEntry::delete_io_completion_queue(id.0), self.timeout)?;
        drop(admin);
        self.release_queue_id(id);
        Ok(())
    }

    /// [`AdminShared::try_delete_io_queue_pair`] for drop paths: a failure is logged.
    pub(crate) fn delete_io_queue_pair(&self, id: QueueId) {
        if let Err(error) = self.try_delete_io_queue_pair(id, &mut false) {
            tracing::warn!(queue = %id, %error, "deleting I/O queue pair failed");
        }
    }

    pub(crate) fn release_queue_id(&self, id: QueueId) {
        let mut ids = self.queue_ids_in_use.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(slot) = ids.get_mut(usize::from(id.0)) {
            *slot = false;
        }
    }
}

/// A controller that completed bring-up.
pub struct Controller {
    backend: Arc<dyn DeviceBackend>,
    registers: Arc<dyn RegisterIo>,
    dma: Arc<dyn DmaAllocator>,
    config: ControllerConfig,
    capabilities: Capabilities,
    version: Version,
    admin: Arc<AdminShared>,
    identify: IdentifyController,
    namespaces: Vec<Namespace>,
    granted_queue_pairs: u16,
    mode: DataPointerMode,
    max_transfer_bytes: u64,
    /// A 4 KiB buffer for Identify and log pages.
    scratch: DmaRegion,
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

/// Waits for CSTS.RDY to equal `ready`, polling every millisecond until `timeout_ms`.
fn wait_ready(registers: &dyn RegisterIo, ready: bool, timeout_ms: u64) -> Result<(), NvmeError> {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms);
    loop {
        let status = read_status(registers)?;
        if ready && status.fatal() {
            return Err(NvmeError::ControllerFatal { context: "during enable" });
        }
        if status.ready() == ready {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(NvmeError::ReadyTimeout { wanted: if ready { "CSTS.RDY=1" } else { "CSTS.RDY=0" }, timeout_ms, csts: status.0 });
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

impl Controller {
    /// Brings the controller up: disable, wait RDY=0, admin queues, enable, wait RDY=1, Identify,
    /// Number of Queues. I/O queue pairs are created afterwards with
    /// [`Controller::create_io_queue_pair`].
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
        let admin_depth = config.admin_queue_depth.clamp(2, max_entries.min(4096));
        let admin_queue =
            QueuePair::allocate(QueueId(0), admin_depth, dma.as_ref(), Arc::clone(&registers), capabilities.doorbell_stride_log2())?;
        let admin = Arc::new(AdminShared {
            admin: Mutex::new(admin_queue),
            epoch: AtomicU64::new(0),
            queue_ids_in_use: Mutex::new(Vec::new()),
            timeout: config.admin_timeout,
        });
        let scratch = dma.allocate(IDENTIFY_BYTES)?;
        let mut controller = Self {
            backend,
            registers,
            dma,
            config,
            capabilities,
            version,
            admin,
            identify: IdentifyController::default(),
            namespaces: Vec::new(),
            granted_queue_pairs: 0,
            mode: DataPointerMode::Prp,
            max_transfer_bytes: PAGE_BYTES,
            scratch,
        };
        controller.bring_up()?;
        Ok(controller)
    }

    /// Runs the bring-up state machine from `Disable` to `Ready`.
    fn bring_up(&mut self) -> Result<(), NvmeError> {
        let timeout_ms = self.capabilities.ready_timeout_ms();
        let mut stage = BringUpStage::Disable;
        loop {
            tracing::debug!(device = %self.backend.name(), ?stage, "bring-up");
            stage = match stage {
                BringUpStage::Disable => {
                    let configuration = ControllerConfiguration(self.registers.read32(registers::CC));
                    if configuration.enabled() {
                        self.registers.write32(registers::CC, configuration.0 & !1);
                    }
                    BringUpStage::WaitNotReady
                }
                BringUpStage::WaitNotReady => {
                    wait_ready(self.registers.as_ref(), false, timeout_ms)?;
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
                    self.registers.write32(registers::CC, ControllerConfiguration::for_enable().0);
                    BringUpStage::WaitReady
                }
                BringUpStage::WaitReady => {
                    wait_ready(self.registers.as_ref(), true, timeout_ms)?;
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
                    let mut ids = self.admin.queue_ids_in_use.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                    *ids = vec![false; usize::from(self.granted_queue_pairs) + 1];
                    ids[0] = true;
                    BringUpStage::Ready
                }
                BringUpStage::Ready => return Ok(()),
            };
        }
    }

    fn identify_all(&mut self) -> Result<(), NvmeError> {
        let bytes = self.identify_raw(IdentifyCns::Controller, 0)?;
        let identify = IdentifyController::parse(&bytes)?;
        self.mode = match (self.config.data_pointer, identify.sgl_support.supported()) {
            (DataPointerPreference::Prp, _) | (DataPointerPreference::Auto, false) => DataPointerMode::Prp,
            (DataPointerPreference::Sgl, true) | (DataPointerPreference::Auto, true) => DataPointerMode::Sgl,
            (DataPointerPreference::Sgl, false) => {
                return Err(NvmeError::Unsupported { reason: "SGL requested but Identify Controller SGLS reports no SGL support".into() });
            }
        };
        // One PRP list page per command bounds a command at 2 MiB; MDTS may bound it further.
        let prp_limit = PRP_LIST_ENTRIES_MAX as u64 * PAGE_BYTES;
        self.max_transfer_bytes = identify.max_transfer_bytes(self.capabilities.min_page_size_bytes()).unwrap_or(prp_limit).min(prp_limit);
        // CNS 02h exists from NVMe 1.1; older controllers: every NSID up to NN.
        let namespace_ids = if self.version.0 >= 0x0001_0100 {
            parse_active_namespaces(&self.identify_raw(IdentifyCns::ActiveNamespaceList, 0)?)
        } else {
            (1..=identify.namespace_count.min(1024)).collect()
        };
        let mut namespaces = Vec::with_capacity(namespace_ids.len());
        for nsid in namespace_ids.into_iter().take(1024) {
            let bytes = self.identify_raw(IdentifyCns::Namespace, nsid)?;
            // An inactive namespace returns zeroes; skip rather than fail the whole controller.
            if bytes.iter().all(|&byte| byte == 0) {
                continue;
            }
            let namespace = IdentifyNamespace::parse(&bytes)?;
            let block_size_bytes = namespace
                .block_size_bytes()
                .ok_or(IdentifyError::FormatIndexOutOfRange { index: namespace.format_index, count: namespace.formats.len() as u8 })?;
            namespaces.push(Namespace { id: NamespaceId(nsid), block_size_bytes, size_blocks: namespace.size_blocks });
        }
        self.identify = identify;
        self.namespaces = namespaces;
        Ok(())
    }

    fn identify_raw(&self, cns: IdentifyCns, nsid: u32) -> Result<Vec<u8>, NvmeError> {
        self.scratch.fill(0, IDENTIFY_BYTES, 0)?;
        self.admin_command(SubmissionEntry::identify(cns, nsid, self.scratch.iova().0))?;
        let mut bytes = vec![0u8; IDENTIFY_BYTES];
        self.scratch.read(0, &mut bytes)?;
        Ok(bytes)
    }

    /// Runs one admin command and waits for it (bounded by the configured admin timeout).
    pub fn admin_command(&self, entry: SubmissionEntry) -> Result<Completion, NvmeError> {
        self.admin.lock_admin().execute(entry, self.admin.timeout)
    }

    /// Creates an I/O completion queue and submission queue with `depth` entries each, at the
    /// lowest free queue id. Depth is bounded by CAP.MQES.
    pub fn create_io_queue_pair(&self, depth: u32) -> Result<IoQueuePair, NvmeError> {
        let max = self.capabilities.max_queue_entries();
        if !(2..=max).contains(&depth) {
            return Err(NvmeError::InvalidQueueDepth { requested: depth, max });
        }
        let id = self.reserve_queue_id()?;
        let result = self.create_queue_with_id(id, depth);
        if result.is_err() {
            self.admin.release_queue_id(id);
        }
        result
    }

    /// Creates an I/O queue pair that another agent (a GPU kernel) drives: the host programs the
    /// controller with `submission`/`completion` (or freshly allocated DMA memory when `None`),
    /// then never touches the rings. The returned layout has the ring addresses and doorbell
    /// offsets that agent needs.
    pub fn create_detached_queue_pair(&self, depth: u32, rings: Option<(DmaRegion, DmaRegion)>) -> Result<DetachedQueuePair, NvmeError> {
        let max = self.capabilities.max_queue_entries();
        if !(2..=max).contains(&depth) {
            return Err(NvmeError::InvalidQueueDepth { requested: depth, max });
        }
        let (submission, completion) = match rings {
            Some(rings) => rings,
            None => {
                (self.dma.allocate(depth as usize * SUBMISSION_ENTRY_BYTES)?, self.dma.allocate(depth as usize * COMPLETION_ENTRY_BYTES)?)
            }
        };
        DetachedQueuePair::validate_rings(depth, &submission, &completion)?;
        completion.fill(0, depth as usize * COMPLETION_ENTRY_BYTES, 0)?;
        let id = self.reserve_queue_id()?;
        let stride = self.capabilities.doorbell_stride_log2();
        let layout = DetachedQueueLayout {
            id,
            depth,
            submission_iova: submission.iova(),
            completion_iova: completion.iova(),
            submission_host_address: submission.host_address(),
            completion_host_address: completion.host_address(),
            submission_doorbell_offset: registers::doorbell_offset(id.0, false, stride),
            completion_doorbell_offset: registers::doorbell_offset(id.0, true, stride),
        };
        let created = self.admin_command(SubmissionEntry::create_io_completion_queue(id.0, depth, completion.iova().0)).and_then(|_| {
            self.admin_command(SubmissionEntry::create_io_submission_queue(id.0, depth, submission.iova().0, id.0)).inspect_err(|_| {
                let _ = self.admin_command(SubmissionEntry::delete_io_completion_queue(id.0));
            })
        });
        if let Err(error) = created {
            self.admin.release_queue_id(id);
            return Err(error);
        }
        let epoch = self.admin.epoch.load(Ordering::Acquire);
        Ok(DetachedQueuePair::new(layout, submission, completion, Arc::clone(&self.admin), epoch))
    }

    fn reserve_queue_id(&self) -> Result<QueueId, NvmeError> {
        let mut ids = self.admin.queue_ids_in_use.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let free = ids.iter().position(|used| !used).ok_or(NvmeError::NoQueueAvailable { granted: self.granted_queue_pairs })?;
        ids[free] = true;
        Ok(QueueId(free as u16))
    }

    /// The controller's register space (for mapping doorbells into another agent).
    pub fn registers(&self) -> &Arc<dyn RegisterIo> {
        &self.registers
    }

    fn create_queue_with_id(&self, id: QueueId, depth: u32) -> Result<IoQueuePair, NvmeError> {
        let queue =
            QueuePair::allocate(id, depth, self.dma.as_ref(), Arc::clone(&self.registers), self.capabilities.doorbell_stride_log2())?;
        self.admin_command(SubmissionEntry::create_io_completion_queue(id.0, depth, queue.completion_iova().0))?;
        if let Err(error) = self.admin_command(SubmissionEntry::create_io_submission_queue(id.0, depth, queue.submission_iova().0, id.0)) {
            let _ = self.admin_command(SubmissionEntry::delete_io_completion_queue(id.0));
            return Err(error);
        }
        let epoch = self.admin.epoch.load(Ordering::Acquire);
        Ok(IoQueuePair::new(queue, Arc::clone(&self.admin), epoch, self.mode, self.max_transfer_bytes, self.namespaces.clone()))
    }

    /// Disables and re-enables the controller (function-level reset first when `function_reset`),
    /// then repeats Identify and Number of Queues. Existing I/O queue pairs become stale: their
    /// operations fail with [`NvmeError::QueueStale`]; create new ones.
    pub fn reset(&mut self, function_reset: bool) -> Result<(), NvmeError> {
        self.admin.epoch.fetch_add(1, Ordering::AcqRel);
        if function_reset {
            self.backend.function_reset()?;
        }
        self.bring_up()
    }

    /// Normal shutdown (§3.6.1): CC.SHN = 01b, wait for CSTS.SHST = complete within CAP.TO.
    pub fn shutdown(&self) -> Result<(), NvmeError> {
        let configuration = self.registers.read32(registers::CC);
        self.registers.write32(registers::CC, configuration & !(0x3 << 14) | 1 << 14);
        let deadline = Instant::now() + Duration::from_millis(self.capabilities.ready_timeout_ms());
        loop {
            let status = read_status(self.registers.as_ref())?;
            if status.shutdown() == registers::ShutdownStatus::Complete {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(NvmeError::ReadyTimeout {
                    wanted: "CSTS.SHST=complete",
                    timeout_ms: self.capabilities.ready_timeout_ms(),
                    csts: status.0,
                });
            }
            std::thread::sleep(Duration::from_micros(500));
        }
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

    /// Reads a log page (at most 4096 bytes) into a new buffer.
    pub fn log_page(&self, log: LogPageId, bytes: usize) -> Result<Vec<u8>, NvmeError> {
        let bytes = bytes.clamp(4, IDENTIFY_BYTES);
        self.scratch.fill(0, IDENTIFY_BYTES, 0)?;
        self.admin_command(SubmissionEntry::get_log_page(log, 0xFFFF_FFFF, (bytes / 4) as u32, self.scratch.iova().0))?;
        let mut data = vec![0u8; bytes];
        self.scratch.read(0, &mut data)?;
        Ok(data)
    }

    pub fn identify(&self) -> &IdentifyController {
        &self.identify
    }

    pub fn namespaces(&self) -> &[Namespace] {
        &self.namespaces
    }

    pub fn namespace(&self, id: NamespaceId) -> Result<Namespace, NvmeError> {
        self.namespaces.iter().copied().find(|namespace| namespace.id == id).ok_or(NvmeError::UnknownNamespace { namespace: id })
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

    pub fn dma(&self) -> &Arc<dyn DmaAllocator> {
        &self.dma
    }

    pub fn backend(&self) -> &Arc<dyn DeviceBackend> {
        &self.backend
    }
}
