//! Register file, bring-up, admin commands and their error statuses.

use std::time::Duration;

use nvme_driver::spec::command::{FeatureId, IdentifyCns, LogPageId};
use nvme_driver::spec::identify::{parse_active_namespaces, IdentifyController, IdentifyNamespace};
use nvme_driver::spec::registers::{self, Capabilities, ControllerConfiguration, ShutdownStatus, Version};
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{NvmeStatus, SubmissionEntry};

use super::harness::{status_of, TestHost};
use crate::{Backing, EmuConfig, NamespaceConfig};

fn small_config() -> EmuConfig {
    EmuConfig::default().with_backing(Backing::Memory { bytes: 4 << 20 })
}

fn specific(code: u8) -> Result<(), NvmeStatus> {
    Err(NvmeStatus::command_specific(code))
}

fn generic(code: u8) -> Result<(), NvmeStatus> {
    Err(NvmeStatus::generic(code))
}

#[test]
fn registers_report_configured_capabilities_and_bring_up_works() {
    // Goal: CAP/VS carry the configured values; enable/disable/shutdown move CSTS as the spec says.
    let mut host = TestHost::start(small_config().with_max_queue_entries(1024).with_doorbell_stride_log2(2));
    let cap = Capabilities(host.registers.read64(registers::CAP));
    assert_eq!(cap.max_queue_entries(), 1024);
    assert_eq!(cap.doorbell_stride_log2(), 2);
    assert_eq!(cap.min_page_size_bytes(), 4096);
    assert!(cap.contiguous_queues_required() && cap.nvm_command_set_supported());
    assert_eq!(cap.timeout_500ms_units(), 20);
    assert_eq!(host.registers.read32(registers::VS), Version::V1_4.0);
    assert!(host.csts().ready());
    // Admin commands work with the wide stride.
    let buffer = host.buffer(4096);
    let identify = host.admin(SubmissionEntry::identify(IdentifyCns::Controller, 0, buffer.iova().0));
    assert_eq!(status_of(&identify), Ok(()));
    // Shutdown notification: SHST complete, then disable drops RDY.
    host.registers.write32(registers::CC, ControllerConfiguration::for_enable().0 | 1 << 14);
    let deadline = std::time::Instant::now() + super::harness::DEADLINE;
    while host.csts().shutdown() != ShutdownStatus::Complete {
        assert!(std::time::Instant::now() < deadline, "shutdown did not complete");
        std::thread::sleep(Duration::from_micros(50));
    }
    host.registers.write32(registers::CC, 0);
    host.wait_ready(false);
    assert_eq!(host.stats().enables, 1);
    host.enable();
    assert_eq!(host.csts().shutdown(), ShutdownStatus::Normal);
}

impl TestHost {
    fn stats(&self) -> crate::EmuStats {
        self.device.stats()
    }
}

#[test]
fn identify_data_parses_with_the_driver_parsers() {
    // Goal: Identify data a real host driver accepts, reflecting the configuration.
    let config = small_config()
        .with_namespaces(vec![NamespaceConfig::new(512, Some(1 << 20)), NamespaceConfig::new(4096, None)])
        .with_mdts(3)
        .with_sgl(false)
        .with_volatile_write_cache(false);
    let mut host = TestHost::start(config);
    let buffer = host.buffer(4096);
    let completion = host.admin(SubmissionEntry::identify(IdentifyCns::Controller, 0, buffer.iova().0));
    assert_eq!(status_of(&completion), Ok(()));
    let mut bytes = vec![0u8; 4096];
    buffer.read(0, &mut bytes).unwrap();
    let controller = IdentifyController::parse(&bytes).unwrap();
    assert_eq!(controller.mdts, 3);
    assert_eq!(controller.max_transfer_bytes(4096), Some(32 << 10));
    assert!(!controller.sgl_support.supported());
    assert!(!controller.volatile_write_cache);
    assert_eq!(controller.namespace_count, 2);
    assert!(controller.supports_write_zeroes() && controller.supports_dataset_management());
    assert_eq!(controller.version, Version::V1_4.0);

    for (nsid, block, blocks) in [(1u32, 512u32, 2048u64), (2, 4096, 768)] {
        let completion = host.admin(SubmissionEntry::identify(IdentifyCns::Namespace, nsid, buffer.iova().0));
        assert_eq!(status_of(&completion), Ok(()));
        buffer.read(0, &mut bytes).unwrap();
        let namespace = IdentifyNamespace::parse(&bytes).unwrap();
        assert_eq!((namespace.block_size_bytes(), namespace.size_blocks), (Some(block), blocks), "nsid {nsid}");
    }
    let completion = host.admin(SubmissionEntry::identify(IdentifyCns::ActiveNamespaceList, 0, buffer.iova().0));
    assert_eq!(status_of(&completion), Ok(()));
    buffer.read(0, &mut bytes).unwrap();
    assert_eq!(parse_active_namespaces(&bytes), vec![1, 2]);
    let completion = host.admin(SubmissionEntry::identify(IdentifyCns::ActiveNamespaceList, 1, buffer.iova().0));
    buffer.read(0, &mut bytes).unwrap();
    assert_eq!((status_of(&completion), parse_active_namespaces(&bytes)), (Ok(()), vec![2]));
    // Errors: namespace 3 does not exist; CNS 0x10 is not supported; unmapped destination.
    let missing = host.admin(SubmissionEntry::identify(IdentifyCns::Namespace, 3, buffer.iova().0));
    assert_eq!(status_of(&missing), generic(codes::INVALID_NAMESPACE));
    let mut unknown_cns = SubmissionEntry::identify(IdentifyCns::Controller, 0, buffer.iova().0);
    unknown_cns.cdw10 = 0x10;
    assert_eq!(status_of(&host.admin(unknown_cns)), generic(codes::INVALID_FIELD));
    let unmapped = host.admin(SubmissionEntry::identify(IdentifyCns::Controller, 0, 0x1000));
    assert_eq!(status_of(&unmapped), generic(codes::DATA_TRANSFER_ERROR));
}

#[test]
fn queue_management_errors_have_their_statuses() {
    // Goal: every invalid Create/Delete gets the command-specific status, and the queues work.
    let mut host = TestHost::start(small_config().with_max_queue_entries(64).with_io_queue_pairs_max(8));
    let granted = host.admin(SubmissionEntry::set_number_of_queues(2, 2));
    assert_eq!(status_of(&granted), Ok(()));
    assert_eq!(granted.dw0, 1 | 1 << 16, "two SQs and two CQs granted (0's based)");
    let memory = host.buffer(2 * 4096);
    let base = memory.iova().0;
    let cases = [
        (SubmissionEntry::create_io_completion_queue(0, 16, base), specific(codes::INVALID_QUEUE_IDENTIFIER)),
        (SubmissionEntry::create_io_completion_queue(3, 16, base), specific(codes::INVALID_QUEUE_IDENTIFIER)),
        (SubmissionEntry::create_io_completion_queue(1, 65, base), specific(codes::INVALID_QUEUE_SIZE)),
        (SubmissionEntry::create_io_completion_queue(1, 1, base), specific(codes::INVALID_QUEUE_SIZE)),
        (SubmissionEntry::create_io_completion_queue(1, 16, base + 8), generic(codes::INVALID_FIELD)),
        (SubmissionEntry::create_io_completion_queue(1, 16, 0x5000), generic(codes::DATA_TRANSFER_ERROR)),
        (SubmissionEntry::create_io_submission_queue(1, 16, base, 1), specific(codes::COMPLETION_QUEUE_INVALID)),
        (SubmissionEntry::create_io_completion_queue(1, 16, base), Ok(())),
        (SubmissionEntry::create_io_completion_queue(1, 16, base), specific(codes::INVALID_QUEUE_IDENTIFIER)),
        (SubmissionEntry::create_io_submission_queue(1, 16, base + 4096, 0), specific(codes::COMPLETION_QUEUE_INVALID)),
        (SubmissionEntry::create_io_submission_queue(1, 16, base + 4096, 1), Ok(())),
        (SubmissionEntry::set_number_of_queues(4, 4), generic(0x0C)),
        (SubmissionEntry::delete_io_completion_queue(1), specific(codes::INVALID_QUEUE_DELETION)),
        (SubmissionEntry::delete_io_submission_queue(2), specific(codes::INVALID_QUEUE_IDENTIFIER)),
        (SubmissionEntry::delete_io_submission_queue(0), specific(codes::INVALID_QUEUE_IDENTIFIER)),
        (SubmissionEntry::delete_io_submission_queue(1), Ok(())),
        (SubmissionEntry::delete_io_completion_queue(1), Ok(())),
        (SubmissionEntry::delete_io_completion_queue(1), specific(codes::INVALID_QUEUE_IDENTIFIER)),
    ];
    for (index, (entry, expected)) in cases.into_iter().enumerate() {
        let completion = host.admin(entry);
        assert_eq!(status_of(&completion), expected, "case {index}");
    }
    // Not physically contiguous (PC = 0) while CAP.CQR = 1.
    let mut scattered = SubmissionEntry::create_io_completion_queue(1, 16, base);
    scattered.cdw11 = 0;
    assert_eq!(status_of(&host.admin(scattered)), generic(codes::INVALID_FIELD));
    // A pair created after deletion works.
    let mut queue = host.create_io_pair(2, 8);
    let flush = host.execute_on(&mut queue, SubmissionEntry::flush(nvme_driver::NamespaceId(1)));
    assert_eq!(status_of(&flush), Ok(()));
}

#[test]
fn features_logs_and_unknown_opcodes() {
    // Goal: Get/Set Features, Get Log Page and opcode validation answer as specified.
    let mut host = TestHost::start(small_config());
    let queues = host.admin(SubmissionEntry::get_features(FeatureId::NumberOfQueues));
    assert_eq!((status_of(&queues), queues.dw0), (Ok(()), 63 | 63 << 16));
    let cache = host.admin(SubmissionEntry::get_features(FeatureId::VolatileWriteCache));
    assert_eq!((status_of(&cache), cache.dw0), (Ok(()), 1));
    assert_eq!(status_of(&host.admin(SubmissionEntry::set_features(FeatureId::VolatileWriteCache, 0))), Ok(()));
    assert_eq!(host.admin(SubmissionEntry::get_features(FeatureId::VolatileWriteCache)).dw0, 0);
    let mut unknown_feature = SubmissionEntry::get_features(FeatureId::Arbitration);
    unknown_feature.cdw10 = 0x7F;
    assert_eq!(status_of(&host.admin(unknown_feature)), generic(codes::INVALID_FIELD));
    let mut saved = SubmissionEntry::set_features(FeatureId::VolatileWriteCache, 1);
    saved.cdw10 |= 1 << 31;
    assert_eq!(status_of(&host.admin(saved)), specific(0x0D));

    let unknown = SubmissionEntry { cdw0: 0x7E, ..SubmissionEntry::default() };
    assert_eq!(status_of(&host.admin(unknown)), generic(codes::INVALID_OPCODE));
    let abort = SubmissionEntry { cdw0: 0x08, ..SubmissionEntry::default() };
    let aborted = host.admin(abort);
    assert_eq!((status_of(&aborted), aborted.dw0 & 1), (Ok(()), 1), "abort: not aborted");

    let page = host.buffer(4096);
    let error_log = host.admin(SubmissionEntry::get_log_page(LogPageId::ErrorInformation, 0, 16, page.iova().0));
    assert_eq!(status_of(&error_log), Ok(()));
    let mut entry = [0u8; 64];
    page.read(0, &mut entry).unwrap();
    assert!(u64::from_le_bytes(entry[0..8].try_into().unwrap()) >= 3, "error count covers the failures above");
    let status = u16::from_le_bytes([entry[12], entry[13]]) >> 1;
    assert_eq!(NvmeStatus::from_status_field(status), generic(codes::INVALID_OPCODE), "newest error first");
    let smart = host.admin(SubmissionEntry::get_log_page(LogPageId::SmartHealth, 0xFFFF_FFFF, 128, page.iova().0));
    assert_eq!(status_of(&smart), Ok(()));
    let mut smart_bytes = [0u8; 512];
    page.read(0, &mut smart_bytes).unwrap();
    assert_eq!(smart_bytes[3], 100, "available spare");
    let mut bad_log = SubmissionEntry::get_log_page(LogPageId::SmartHealth, 0, 128, page.iova().0);
    bad_log.cdw10 = bad_log.cdw10 & !0xFF | 0x33;
    assert_eq!(status_of(&host.admin(bad_log)), specific(codes::INVALID_LOG_PAGE));
}

#[test]
fn invalid_admin_queue_setup_sets_cfs_and_reset_clears_it() {
    // Goal: an enable the controller cannot honour reports CSTS.CFS; clearing CC.EN recovers.
    let mut host = TestHost::start(small_config());
    host.registers.write32(registers::CC, 0);
    host.wait_ready(false);
    host.registers.write64(registers::ASQ, 0x7000); // unmapped
    host.registers.write32(registers::CC, ControllerConfiguration::for_enable().0);
    let deadline = std::time::Instant::now() + super::harness::DEADLINE;
    while !host.csts().fatal() {
        assert!(std::time::Instant::now() < deadline, "CFS not set");
        std::thread::sleep(Duration::from_micros(50));
    }
    assert!(!host.csts().ready());
    host.enable();
    assert!(!host.csts().fatal());
    let buffer = host.buffer(4096);
    assert_eq!(status_of(&host.admin(SubmissionEntry::identify(IdentifyCns::Controller, 0, buffer.iova().0))), Ok(()));
}

#[test]
fn out_of_range_doorbells_are_ignored_and_counted() {
    // Goal: a tail beyond the queue does not make the controller consume garbage.
    let mut host = TestHost::start(small_config());
    let mut queue = host.create_io_pair(1, 8);
    host.registers.write32(registers::doorbell_offset(1, false, 0), 100);
    host.registers.write32(registers::doorbell_offset(1, true, 0), 100);
    std::thread::sleep(Duration::from_millis(5));
    assert!(host.reap_within(&mut queue, Duration::from_millis(20)).is_none());
    assert_eq!(host.device.stats().invalid_doorbell_writes, 2);
    host.registers.write32(registers::doorbell_offset(1, false, 0), 0);
    let flush = host.execute_on(&mut queue, SubmissionEntry::flush(nvme_driver::NamespaceId(1)));
    assert_eq!(status_of(&flush), Ok(()));
}

/// Asynchronous Event Request (§5.2): opcode 0Ch, no fields.
fn async_event_request() -> SubmissionEntry {
    SubmissionEntry { cdw0: 0x0C, ..SubmissionEntry::default() }
}

/// Asynchronous Event Request Limit Exceeded (§5.2.1, Figure 146: command specific 05h).
const ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED: u8 = 0x05;

/// Submits `count` AERs on the admin queue without waiting (none completes).
fn hold_async_event_requests(host: &mut TestHost, count: usize) {
    for _ in 0..count {
        TestHost::push(&mut host.admin, async_event_request());
    }
    host.ring_submission(&host.admin);
}

#[test]
fn asynchronous_event_requests_stay_outstanding_up_to_the_limit_and_a_reset_clears_them() {
    // Goal: AER is mandatory: up to AERL + 1 are accepted and held (no event is ever generated,
    // so none completes) while other admin commands and I/O complete past them, more than the
    // admin CQ's size, so a held AER keeps no CQ slot; the (AERL + 2)th is refused with
    // Asynchronous Event Request Limit Exceeded; a controller reset aborts the held ones
    // without a completion, and the limit counts afresh after it.
    let mut host = TestHost::start(small_config());
    let buffer = host.buffer(4096);
    assert_eq!(status_of(&host.admin(SubmissionEntry::identify(IdentifyCns::Controller, 0, buffer.iova().0))), Ok(()));
    let mut identify = vec![0u8; 4096];
    buffer.read(0, &mut identify).unwrap();
    let limit = usize::from(identify[259]) + 1;
    assert_eq!(limit, 4, "AERL = 3 (0's based)");
    hold_async_event_requests(&mut host, limit);
    // Each admin command's completion is its own (`admin` checks the command id), not an AER's.
    for _ in 0..40 {
        assert_eq!(status_of(&host.admin(SubmissionEntry::get_features(FeatureId::NumberOfQueues))), Ok(()));
    }
    let mut queue = host.create_io_pair(1, 8);
    super::harness::write_block(&host, &mut queue, 3, 0x5A);
    assert!(super::harness::read_block(&host, &mut queue, 3).iter().all(|&byte| byte == 0x5A));
    assert_eq!(status_of(&host.admin(async_event_request())), specific(ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED));
    let mut admin = host.admin.clone();
    assert!(TestHost::try_reap_within(&mut admin, Duration::from_millis(50)).is_none(), "a held AER completed");
    // The reset (enable() clears CC.EN first) aborts the four: after it, four fit again.
    host.enable();
    hold_async_event_requests(&mut host, limit);
    assert_eq!(status_of(&host.admin(SubmissionEntry::get_features(FeatureId::NumberOfQueues))), Ok(()));
    assert_eq!(status_of(&host.admin(async_event_request())), specific(ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED));
    // A power loss and a function reset abort them too.
    host.device.power_loss();
    host.enable();
    hold_async_event_requests(&mut host, limit);
    assert_eq!(status_of(&host.admin(SubmissionEntry::get_features(FeatureId::NumberOfQueues))), Ok(()));
    nvme_driver::hw::DeviceBackend::function_reset(&*host.device).unwrap();
    host.enable();
    hold_async_event_requests(&mut host, limit);
    assert_eq!(status_of(&host.admin(async_event_request())), specific(ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED));
}

#[test]
fn a_restriction_preset_serves_only_the_creation_it_was_set_for() {
    // Goal: a Create I/O SQ with the preset's ring takes the preset even when it fails (no CQ
    // to bind to), so a later queue on that ring starts unrestricted; a successful one applies
    // it to the queue it creates, and a queue on another ring is untouched by a pending preset.
    let mut host = TestHost::start(small_config().with_io_queue_pairs_max(2));
    let queue = super::harness::HostQueue::new(&*host.dma, 1, 16);
    let ring = nvme_driver::Iova(queue.submission.iova().0);
    let preset = host.device.preset_restriction(ring, crate::QueueRestriction::new()).unwrap();
    let failed = host.admin(SubmissionEntry::create_io_submission_queue(1, 16, ring.0, 1));
    assert_eq!(status_of(&failed), specific(codes::COMPLETION_QUEUE_INVALID));
    assert_eq!(preset.queue_id(), None);
    assert_eq!(host.device.with_core(|core| core.pending_restrictions.len()), 0, "the failed creation took the preset");
    let cq = host.admin(SubmissionEntry::create_io_completion_queue(1, 16, queue.completion.iova().0));
    assert_eq!(status_of(&cq), Ok(()));
    let sq = host.admin(SubmissionEntry::create_io_submission_queue(1, 16, ring.0, 1));
    assert_eq!(status_of(&sq), Ok(()));
    let restricted = |host: &TestHost, id: u16| {
        host.device.with_core(|core| core.submission_queues[usize::from(id)].as_ref().map(|queue| queue.restriction.is_some()))
    };
    assert_eq!(restricted(&host, 1), Some(false), "no preset was left for the ring");
    drop(preset);

    let other = super::harness::HostQueue::new(&*host.dma, 2, 16);
    let pending = host.device.preset_restriction(ring, crate::QueueRestriction::new()).unwrap();
    let applied = host.device.preset_restriction(nvme_driver::Iova(other.submission.iova().0), crate::QueueRestriction::new()).unwrap();
    let cq = host.admin(SubmissionEntry::create_io_completion_queue(2, 16, other.completion.iova().0));
    assert_eq!(status_of(&cq), Ok(()));
    let sq = host.admin(SubmissionEntry::create_io_submission_queue(2, 16, other.submission.iova().0, 2));
    assert_eq!(status_of(&sq), Ok(()));
    assert_eq!((applied.queue_id(), pending.queue_id()), (Some(2), None));
    assert_eq!(restricted(&host, 2), Some(true));
    drop(pending);
    assert_eq!(host.device.with_core(|core| core.pending_restrictions.len()), 0, "a dropped handle removes its preset");
}

#[test]
fn a_preset_kept_pending_restricts_a_creation_that_executes_after_its_handle_is_gone() {
    // Goal: a host whose Create I/O SQ timed out (sent, its outcome unknown) keeps the preset
    // pending past its handle (`keep_pending`): when the creation executes late, the queue it
    // creates on the ring is restricted, not left open.
    let mut host = TestHost::start(small_config().with_io_queue_pairs_max(2));
    let queue = super::harness::HostQueue::new(&*host.dma, 1, 16);
    let ring = nvme_driver::Iova(queue.submission.iova().0);
    let preset = host.device.preset_restriction(ring, crate::QueueRestriction::new()).unwrap();
    assert_eq!(preset.queue_id(), None);
    preset.keep_pending();
    assert_eq!(host.device.with_core(|core| core.pending_restrictions.len()), 1, "the kept preset is still pending");
    // The late creation.
    let cq = host.admin(SubmissionEntry::create_io_completion_queue(1, 16, queue.completion.iova().0));
    assert_eq!(status_of(&cq), Ok(()));
    let sq = host.admin(SubmissionEntry::create_io_submission_queue(1, 16, ring.0, 1));
    assert_eq!(status_of(&sq), Ok(()));
    let restricted = host.device.with_core(|core| core.submission_queues[1].as_ref().map(|queue| queue.restriction.is_some()));
    assert_eq!(restricted, Some(true), "the late creation took the kept preset");
    assert_eq!(host.device.with_core(|core| core.pending_restrictions.len()), 0, "taken, it is pending no more");
}
