//! Admin command set (§5): Identify, queue management, features, log pages, Abort,
//! Asynchronous Event Request.

use nvme_driver::hw::DmaAllocator;
use nvme_driver::spec::identify::{IdentifyController, IdentifyNamespace, LbaFormat, SglSupport};
use nvme_driver::spec::registers::{self, ControllerConfiguration, Version};
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{AdminOpcode, NvmeStatus, SubmissionEntry, COMPLETION_ENTRY_BYTES, IDENTIFY_BYTES, SUBMISSION_ENTRY_BYTES};
use nvme_driver::Iova;

use crate::controller::{command_specific, generic, CommandResult, ControllerCore, ERROR_LOG_ENTRIES};
use crate::data_pointer;
use crate::queues::{CompletionQueue, SubmissionQueue};
use crate::restriction::HostAccess;

/// PCI vendor id reported in Identify (not a registered vendor: this is an emulator).
const VENDOR_ID: u16 = 0x7475;
/// Feature identifiers (§5.27.1).
const FEATURE_ARBITRATION: u32 = 0x01;
const FEATURE_VOLATILE_WRITE_CACHE: u32 = 0x06;
const FEATURE_NUMBER_OF_QUEUES: u32 = 0x07;
/// Log page identifiers (§5.16.1).
const LOG_ERROR_INFORMATION: u32 = 0x01;
const LOG_SMART_HEALTH: u32 = 0x02;
const SMART_LOG_BYTES: usize = 512;
/// Asynchronous Event Request (§5.2): mandatory, but not named by nvme-driver's `AdminOpcode`
/// (the driver never sends it).
pub(crate) const ASYNC_EVENT_REQUEST: u8 = 0x0C;
/// AERL (Identify Controller byte 259, 0's based): AERL + 1 AERs are held at once.
pub(crate) const ASYNC_EVENT_REQUEST_LIMIT: u8 = 3;
/// Command specific status of an AER past that limit (§5.2.1).
const ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED: u8 = 0x05;

/// Whether `entry`, executed on the admin queue with `result`, is a held Asynchronous Event
/// Request: the caller posts no completion for it.
pub(crate) fn is_held(entry: &SubmissionEntry, result: &CommandResult) -> bool {
    entry.opcode() == ASYNC_EVENT_REQUEST && result.is_ok()
}

impl ControllerCore {
    /// Executes an admin command. `Ok(0)` for an Asynchronous Event Request means it is held,
    /// not completed: the batch posts no completion for it (see [`is_held`]).
    pub(crate) fn execute_admin(&mut self, entry: &SubmissionEntry) -> CommandResult {
        let known = AdminOpcode::from_u8(entry.opcode());
        if known.is_none() && entry.opcode() != ASYNC_EVENT_REQUEST {
            return Err(generic(codes::INVALID_OPCODE));
        }
        // Admin commands on PCIe use PRPs only (§4.1.2: SGLs are for I/O commands).
        if entry.psdt() != 0 {
            return Err(generic(codes::INVALID_FIELD));
        }
        let Some(opcode) = known else {
            return self.hold_async_event_request(entry).map(|()| 0);
        };
        match opcode {
            AdminOpcode::Identify => self.identify(entry),
            AdminOpcode::CreateIoCompletionQueue => self.create_completion_queue(entry),
            AdminOpcode::CreateIoSubmissionQueue => self.create_submission_queue(entry),
            AdminOpcode::DeleteIoSubmissionQueue => self.delete_submission_queue(entry),
            AdminOpcode::DeleteIoCompletionQueue => self.delete_completion_queue(entry),
            AdminOpcode::GetFeatures => self.get_features(entry),
            AdminOpcode::SetFeatures => self.set_features(entry),
            AdminOpcode::GetLogPage => self.get_log_page(entry),
            AdminOpcode::DoorbellBufferConfig => self.doorbell_buffer_config(entry),
            // Abort (§5.1) is best effort, and this one never aborts (dw0 bit 0 = 1: "command
            // not aborted"): other commands are never outstanding long enough, and a held
            // Asynchronous Event Request is not aborted either (a reset takes them back).
            AdminOpcode::Abort => Ok(1),
        }
    }

    /// Asynchronous Event Request (§5.2): holds it, without a completion, until an event to
    /// report (the controller generates none, so until a reset aborts it; a reset posts
    /// nothing, its admin queue being deleted). At most AERL + 1 are held; one more completes
    /// with Asynchronous Event Request Limit Exceeded. A held AER keeps no completion queue
    /// slot: it will never post into the queue it came from.
    fn hold_async_event_request(&mut self, entry: &SubmissionEntry) -> Result<(), NvmeStatus> {
        if self.async_event_requests.len() > usize::from(ASYNC_EVENT_REQUEST_LIMIT) {
            return Err(command_specific(ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED));
        }
        self.async_event_requests.push(entry.command_id());
        Ok(())
    }

    fn to_host(&self, entry: &SubmissionEntry, data: &[u8]) -> Result<(), nvme_driver::spec::NvmeStatus> {
        data_pointer::resolve(&HostAccess::new(&self.dma, None), entry, data.len() as u64, false, Vec::new())?.scatter(data)
    }

    fn identify(&mut self, entry: &SubmissionEntry) -> CommandResult {
        let data = match entry.cdw10 & 0xFF {
            0x00 => self.identify_namespace(self.namespace_index(entry.nsid)?),
            0x01 => self.identify_controller(),
            0x02 => {
                // Active namespaces with NSID greater than the one given (§5.17.2.2).
                if entry.nsid >= 0xFFFF_FFFE {
                    return Err(generic(codes::INVALID_NAMESPACE));
                }
                let mut bytes = vec![0u8; IDENTIFY_BYTES];
                let listed = (1..=self.namespaces.len() as u32).filter(|&nsid| nsid > entry.nsid);
                for (slot, nsid) in bytes.chunks_exact_mut(4).zip(listed) {
                    slot.copy_from_slice(&nsid.to_le_bytes());
                }
                bytes
            }
            _ => return Err(generic(codes::INVALID_FIELD)),
        };
        self.to_host(entry, &data)?;
        Ok(0)
    }

    fn identify_controller(&self) -> Vec<u8> {
        let present = self.config.volatile_write_cache;
        let controller = IdentifyController {
            vendor_id: VENDOR_ID,
            serial_number: self.config.serial_number.clone(),
            model_number: "tutti nvme-emu".to_string(),
            firmware_revision: env!("CARGO_PKG_VERSION").to_string(),
            mdts: self.config.mdts,
            controller_id: 1,
            version: Version::V1_4.0,
            optional_admin_commands: if self.config.shadow_doorbells { IdentifyController::OACS_DOORBELL_BUFFER_CONFIG } else { 0 },
            sqes: 0x66,
            cqes: 0x44,
            namespace_count: self.namespaces.len() as u32,
            // ONCS: Dataset Management (bit 2) and Write Zeroes (bit 3).
            optional_nvm_commands: 0b1100,
            volatile_write_cache: present,
            sgl_support: SglSupport(u32::from(self.config.sgl_supported)),
        };
        let mut bytes = controller.to_bytes();
        bytes[111] = 1; // CNTRLTYPE: I/O controller.
        bytes[258] = 3; // ACL: 4 concurrent Aborts.
        bytes[259] = ASYNC_EVENT_REQUEST_LIMIT; // AERL.
        bytes[262] = (ERROR_LOG_ENTRIES - 1) as u8; // ELPE, 0's based.
        if present {
            // VWC bits 2:1 = 11b: Flush with NSID FFFFFFFFh flushes every namespace.
            bytes[525] = 0x07;
        }
        let nqn = format!("nqn.2026-11.io.tutti:emu:{}", self.config.serial_number);
        for (slot, byte) in bytes[768..1024].iter_mut().zip(nqn.bytes()) {
            *slot = byte;
        }
        bytes[2048..2050].copy_from_slice(&2500u16.to_le_bytes()); // PSD0 max power 25 W.
        bytes
    }

    fn identify_namespace(&self, index: usize) -> Vec<u8> {
        let Some(namespace) = self.namespaces.get(index) else { return vec![0u8; IDENTIFY_BYTES] };
        let lbads = namespace.block_size_bytes.trailing_zeros() as u8;
        let mut formats = vec![
            LbaFormat { metadata_bytes: 0, lbads: 9, relative_performance: 2 },
            LbaFormat { metadata_bytes: 0, lbads: 12, relative_performance: 0 },
        ];
        let format_index = match formats.iter().position(|format| format.lbads == lbads) {
            Some(position) => position,
            None => {
                formats.push(LbaFormat { metadata_bytes: 0, lbads, relative_performance: 1 });
                formats.len() - 1
            }
        };
        let identify = IdentifyNamespace {
            size_blocks: namespace.blocks,
            capacity_blocks: namespace.blocks,
            utilization_blocks: namespace.blocks,
            format_index: format_index as u8,
            // Data only: no metadata, no end-to-end protection (see the crate's limits).
            extended_lba: false,
            protection_settings: 0,
            formats,
        };
        let mut bytes = identify.to_bytes();
        // DLFEAT: deallocated blocks read as zeroes (001b), Write Zeroes may deallocate (bit 3).
        bytes[33] = 0x09;
        bytes
    }

    fn controller_configuration(&self) -> ControllerConfiguration {
        ControllerConfiguration(self.registers.load32(registers::CC))
    }

    /// Common checks of Create I/O SQ/CQ: returns (queue id, entries) or the status.
    fn queue_geometry(&self, entry: &SubmissionEntry, granted: u16, exists: bool) -> Result<(u16, u32), nvme_driver::spec::NvmeStatus> {
        let queue_id = (entry.cdw10 & 0xFFFF) as u16;
        let entries = (entry.cdw10 >> 16) + 1;
        if queue_id == 0 || queue_id > granted || exists {
            return Err(command_specific(codes::INVALID_QUEUE_IDENTIFIER));
        }
        if entries < 2 || entries > self.config.max_queue_entries {
            return Err(command_specific(codes::INVALID_QUEUE_SIZE));
        }
        // CAP.CQR = 1: queues must be physically contiguous (PC = 1).
        if entry.cdw11 & 1 == 0 {
            return Err(generic(codes::INVALID_FIELD));
        }
        if !entry.dptr[0].is_multiple_of(data_pointer::PAGE_BYTES) {
            return Err(generic(codes::INVALID_FIELD));
        }
        Ok((queue_id, entries))
    }

    fn create_completion_queue(&mut self, entry: &SubmissionEntry) -> CommandResult {
        let queue_id = (entry.cdw10 & 0xFFFF) as u16;
        let exists = self.completion_queues.get(usize::from(queue_id)).is_some_and(Option::is_some);
        let (queue_id, entries) = self.queue_geometry(entry, self.features.completion_queues_granted, exists)?;
        if self.controller_configuration().io_completion_entry_size_log2() != 4 {
            return Err(generic(codes::INVALID_FIELD));
        }
        let memory = self
            .dma
            .translate(Iova(entry.dptr[0]), entries as usize * COMPLETION_ENTRY_BYTES)
            .map_err(|_| generic(codes::DATA_TRANSFER_ERROR))?;
        let slot = self.completion_queues.get_mut(usize::from(queue_id)).ok_or(command_specific(codes::INVALID_QUEUE_IDENTIFIER))?;
        self.registers.reset_doorbell(queue_id, true);
        if let Some(shadow) = &self.shadow_doorbells {
            shadow.initialize(queue_id, true, 0);
        }
        *slot = Some(CompletionQueue::new(memory, entries));
        Ok(0)
    }

    fn create_submission_queue(&mut self, entry: &SubmissionEntry) -> CommandResult {
        // Taken whatever the outcome: a preset serves the one creation it was set for.
        let preset = self.pending_restrictions.take(entry.dptr[0]);
        let queue_id = (entry.cdw10 & 0xFFFF) as u16;
        let exists = self.submission_queues.get(usize::from(queue_id)).is_some_and(Option::is_some);
        let completion_queue_id = (entry.cdw11 >> 16) as u16;
        let (queue_id, entries) = self.queue_geometry(entry, self.features.submission_queues_granted, exists)?;
        let completion_exists = self.completion_queues.get(usize::from(completion_queue_id)).is_some_and(Option::is_some);
        if completion_queue_id == 0 || !completion_exists {
            return Err(command_specific(codes::COMPLETION_QUEUE_INVALID));
        }
        if self.controller_configuration().io_submission_entry_size_log2() != 6 {
            return Err(generic(codes::INVALID_FIELD));
        }
        let memory = self
            .dma
            .translate(Iova(entry.dptr[0]), entries as usize * SUBMISSION_ENTRY_BYTES)
            .map_err(|_| generic(codes::DATA_TRANSFER_ERROR))?;
        let slot = self.submission_queues.get_mut(usize::from(queue_id)).ok_or(command_specific(codes::INVALID_QUEUE_IDENTIFIER))?;
        self.registers.reset_doorbell(queue_id, false);
        if let Some(shadow) = &self.shadow_doorbells {
            shadow.initialize(queue_id, false, 0);
        }
        let mut queue = SubmissionQueue::new(memory, entries, completion_queue_id);
        // In the step that makes the queue live: no doorbell can be served before it holds.
        if let Some(preset) = preset {
            queue.restriction = Some(preset.restriction);
            let _ = preset.applied_to.set(queue_id);
        }
        *slot = Some(queue);
        Ok(0)
    }

    fn delete_submission_queue(&mut self, entry: &SubmissionEntry) -> CommandResult {
        let queue_id = (entry.cdw10 & 0xFFFF) as u16;
        let exists = queue_id != 0 && self.submission_queues.get(usize::from(queue_id)).is_some_and(Option::is_some);
        if !exists {
            return Err(command_specific(codes::INVALID_QUEUE_IDENTIFIER));
        }
        // Its commands whose completions are held back complete first, ahead of this one's
        // (nothing of it is in flight: an admin command waits for every transfer).
        self.complete_held_for(queue_id);
        if let Some(slot) = self.submission_queues.get_mut(usize::from(queue_id)) {
            *slot = None;
        }
        Ok(0)
    }

    fn delete_completion_queue(&mut self, entry: &SubmissionEntry) -> CommandResult {
        let queue_id = (entry.cdw10 & 0xFFFF) as u16;
        let exists = queue_id != 0 && self.completion_queues.get(usize::from(queue_id)).is_some_and(Option::is_some);
        if !exists {
            return Err(command_specific(codes::INVALID_QUEUE_IDENTIFIER));
        }
        // A CQ still bound to an SQ cannot go first (§5.6).
        if self.submission_queues.iter().flatten().any(|queue| queue.completion_queue_id == queue_id) {
            return Err(command_specific(codes::INVALID_QUEUE_DELETION));
        }
        if let Some(slot) = self.completion_queues.get_mut(usize::from(queue_id)) {
            *slot = None;
        }
        Ok(0)
    }

    fn get_features(&mut self, entry: &SubmissionEntry) -> CommandResult {
        let select = entry.cdw10 >> 8 & 0x7;
        // SEL = 3: supported capabilities; none of ours are saveable or namespace specific.
        if select == 3 {
            return Ok(0);
        }
        match entry.cdw10 & 0xFF {
            FEATURE_NUMBER_OF_QUEUES => {
                let features = &self.features;
                Ok(u32::from(features.submission_queues_granted - 1) | u32::from(features.completion_queues_granted - 1) << 16)
            }
            FEATURE_VOLATILE_WRITE_CACHE if self.config.volatile_write_cache => Ok(u32::from(self.features.write_cache_enabled)),
            FEATURE_ARBITRATION => Ok(0),
            _ => Err(generic(codes::INVALID_FIELD)),
        }
    }

    fn set_features(&mut self, entry: &SubmissionEntry) -> CommandResult {
        if entry.cdw10 >> 31 == 1 {
            return Err(command_specific(codes::FEATURE_NOT_SAVEABLE));
        }
        match entry.cdw10 & 0xFF {
            FEATURE_NUMBER_OF_QUEUES => {
                let submission_requested = entry.cdw11 & 0xFFFF;
                let completion_requested = entry.cdw11 >> 16;
                if submission_requested == 0xFFFF || completion_requested == 0xFFFF {
                    return Err(generic(codes::INVALID_FIELD));
                }
                if self.io_queues_exist() {
                    return Err(generic(codes::COMMAND_SEQUENCE_ERROR));
                }
                let max = u32::from(self.config.io_queue_pairs_max);
                // Both values are at most io_queue_pairs_max (a u16) here.
                self.features.submission_queues_granted = (submission_requested + 1).min(max) as u16;
                self.features.completion_queues_granted = (completion_requested + 1).min(max) as u16;
                self.get_features(&SubmissionEntry { cdw10: FEATURE_NUMBER_OF_QUEUES, ..*entry })
            }
            FEATURE_VOLATILE_WRITE_CACHE if self.config.volatile_write_cache => {
                let enable = entry.cdw11 & 1 == 1;
                if !enable {
                    // Turning the cache off makes later writes durable on completion; what is
                    // cached now must not stay volatile behind that promise. With
                    // sync_file_on_flush that means the file's media too, as for a Flush (this
                    // also covers what earlier write-backs, of a full cache, left unsynced).
                    self.write_back(None)?;
                    if self.config.sync_file_on_flush {
                        self.sync_store()?;
                    }
                }
                self.features.write_cache_enabled = enable;
                Ok(0)
            }
            FEATURE_ARBITRATION => Ok(0),
            _ => Err(generic(codes::INVALID_FIELD)),
        }
    }

    fn get_log_page(&mut self, entry: &SubmissionEntry) -> CommandResult {
        let log_id = entry.cdw10 & 0xFF;
        let dwords = u64::from(entry.cdw10 >> 16 | (entry.cdw11 & 0xFFFF) << 16) + 1;
        let length_bytes = dwords * 4;
        let offset = u64::from(entry.cdw12) | u64::from(entry.cdw13) << 32;
        if offset % 4 != 0 || length_bytes > self.config.accepted_transfer_bytes() {
            return Err(generic(codes::INVALID_FIELD));
        }
        let log = match log_id {
            LOG_ERROR_INFORMATION => self.error_log_bytes(),
            LOG_SMART_HEALTH => self.smart_log_bytes(),
            _ => return Err(command_specific(codes::INVALID_LOG_PAGE)),
        };
        let start = usize::try_from(offset).ok().filter(|&start| start < log.len()).ok_or(generic(codes::INVALID_FIELD))?;
        let length = usize::try_from(length_bytes).map_err(|_| generic(codes::INVALID_FIELD))?;
        // Bytes past the end of the log read as zero.
        let mut data = vec![0u8; length];
        let available = &log[start..];
        let copied = available.len().min(length);
        data[..copied].copy_from_slice(&available[..copied]);
        self.to_host(entry, &data)?;
        Ok(0)
    }

    /// Error Information (§5.16.1.2): newest entry first, 64 bytes each.
    fn error_log_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(ERROR_LOG_ENTRIES * 64);
        for entry in self.error_log.entries.iter().rev() {
            bytes.extend_from_slice(entry);
        }
        bytes.resize(ERROR_LOG_ENTRIES * 64, 0);
        bytes
    }

    /// SMART / Health Information (§5.16.1.3) with the counters we keep.
    fn smart_log_bytes(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; SMART_LOG_BYTES];
        let totals = &self.counters.totals;
        let mut put = |offset: usize, value: u64| bytes[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
        // Data units are thousands of 512-byte units, rounded up.
        put(32, totals.bytes_read.div_ceil(512_000));
        put(48, totals.bytes_written.div_ceil(512_000));
        put(64, self.counters.host_reads);
        put(80, self.counters.host_writes);
        put(112, self.power_cycles);
        put(144, self.unsafe_shutdowns);
        put(176, self.error_log.count);
        bytes[1..3].copy_from_slice(&313u16.to_le_bytes()); // composite temperature, kelvin
        bytes[3] = 100; // available spare, percent
        bytes[4] = 10; // available spare threshold
        bytes
    }
}
