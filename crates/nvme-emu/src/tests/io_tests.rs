//! NVM commands through real queues: data paths, error statuses, queue mechanics, the write
//! cache and power loss, fault injection, no-storage mode.

use std::time::{Duration, Instant};

use nvme_driver::hw::RegisterIo;
use nvme_driver::spec::command::{DataPointerKind, DatasetRange};
use nvme_driver::spec::data_pointer::{SglDescriptor, SglDescriptorType};
use nvme_driver::spec::registers;
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{NvmOpcode, NvmeStatus, StatusCodeType, SubmissionEntry};
use nvme_driver::{Lba, NamespaceId};

use super::harness::{block_count, status_of, with_prp, with_sgl, HostQueue, TestHost};
use crate::{Backing, EmuConfig, FaultAction, FaultPlan, FaultRule, NamespaceConfig};

const NS_512: NamespaceId = NamespaceId(1);
const NS_4K: NamespaceId = NamespaceId(2);

fn two_namespaces() -> EmuConfig {
    EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 8 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, Some(2 << 20)), NamespaceConfig::new(4096, None)])
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn generic(code: u8) -> Result<(), NvmeStatus> {
    Err(NvmeStatus::generic(code))
}

/// Writes `data` at `lba` through SGL and reads it back through PRP (list included).
fn write_then_read(host: &TestHost, queue: &mut HostQueue, nsid: NamespaceId, block: usize, lba: u64, data: &[u8]) -> Vec<u8> {
    let blocks = (data.len() / block) as u32;
    let source = host.buffer(data.len());
    source.write(0, data).unwrap();
    let write = with_sgl(SubmissionEntry::write(nsid, Lba(lba), block_count(blocks), false), &source, data.len() as u32);
    assert_eq!(status_of(&host.execute_on(queue, write)), Ok(()));
    // Read into a buffer at an offset of 512 bytes into its first page (PRP1 offset).
    let target = host.buffer(data.len() + 4096);
    let list = host.buffer(4096);
    let read = with_prp(SubmissionEntry::read(nsid, Lba(lba), block_count(blocks)), &target, 512, data.len(), &list);
    assert_eq!(status_of(&host.execute_on(queue, read)), Ok(()));
    let mut out = vec![0u8; data.len()];
    target.read(512, &mut out).unwrap();
    out
}

#[test]
fn data_round_trips_through_sgl_and_prp_on_both_lba_sizes() {
    // Goal: bytes written come back identical, for 512 B and 4 KiB LBAs, 1 block to MDTS.
    let mut host = TestHost::start(two_namespaces());
    let mut queue = host.create_io_pair(1, 64);
    for (nsid, block) in [(NS_512, 512usize), (NS_4K, 4096)] {
        for len in [block, 8192, 12288, 128 << 10] {
            let data = pattern(len, len as u8 ^ block as u8);
            let back = write_then_read(&host, &mut queue, nsid, block, 7, &data);
            assert!(back == data, "nsid {} len {len}: data mismatch", nsid.0);
        }
    }
    let stats = host.device.stats();
    assert_eq!(stats.io(NvmOpcode::Write), 8);
    assert_eq!(stats.io(NvmOpcode::Read), 8);
    assert_eq!(stats.bytes_written, stats.bytes_read);
}

#[test]
fn sgl_segment_chain_scatters_into_many_buffers() {
    // Goal: a Segment -> Last Segment chain scatters one LBA range into several buffers.
    let mut host = TestHost::start(two_namespaces());
    let mut queue = host.create_io_pair(1, 16);
    let data = pattern(4 * 4096, 3);
    let source = host.buffer(data.len());
    source.write(0, &data).unwrap();
    let write = with_sgl(SubmissionEntry::write(NS_4K, Lba(3), block_count(4), false), &source, data.len() as u32);
    assert_eq!(status_of(&host.execute_on(&mut queue, write)), Ok(()));
    let pieces: Vec<_> = (0..4).map(|_| host.buffer(4096)).collect();
    let segments = host.buffer(4096);
    let put = |offset: usize, descriptor: SglDescriptor| segments.write(offset, &descriptor.to_bytes()).unwrap();
    put(0, SglDescriptor::data_block(pieces[0].iova().0, 4096));
    put(16, SglDescriptor::data_block(pieces[1].iova().0, 4096));
    put(32, SglDescriptor::last_segment(segments.iova().checked_add(1024).unwrap().0, 2));
    put(1024, SglDescriptor::data_block(pieces[2].iova().0, 4096));
    put(1040, SglDescriptor::data_block(pieces[3].iova().0, 4096));
    let mut read = SubmissionEntry::read(NS_4K, Lba(3), block_count(4));
    read.set_data_pointer_kind(DataPointerKind::Sgl);
    read.dptr = SglDescriptor::segment(segments.iova().0, 3).to_dptr();
    assert_eq!(status_of(&host.execute_on(&mut queue, read)), Ok(()));
    for (index, piece) in pieces.iter().enumerate() {
        let mut out = vec![0u8; 4096];
        piece.read(0, &mut out).unwrap();
        assert!(out[..] == data[index * 4096..(index + 1) * 4096], "piece {index}");
    }
}

#[test]
fn malformed_commands_get_their_statuses() {
    // Goal: every bad input named in the issue gets the spec's status, never a hang or panic.
    let mut host = TestHost::start(two_namespaces().with_mdts(2));
    let mut queue = host.create_io_pair(1, 64);
    let buffer = host.buffer(64 << 10);
    let segments = host.buffer(4096);
    let blocks_4k = (6 << 20) / 4096u64;
    let sgl_read = |descriptor: SglDescriptor| {
        let mut entry = SubmissionEntry::read(NS_4K, Lba(0), block_count(1));
        entry.set_data_pointer_kind(DataPointerKind::Sgl);
        entry.dptr = descriptor.to_dptr();
        entry
    };
    segments.write(0, &SglDescriptor::segment(segments.iova().0, 1).to_bytes()).unwrap();
    let mut psdt3 = with_sgl(SubmissionEntry::read(NS_4K, Lba(0), block_count(1)), &buffer, 4096);
    psdt3.cdw0 |= 3 << 14;
    let mut unknown = SubmissionEntry::read(NS_4K, Lba(0), block_count(1));
    unknown.cdw0 = unknown.cdw0 & !0xFF | 0x7C;
    let cases: Vec<(&str, SubmissionEntry, Result<(), NvmeStatus>)> = vec![
        (
            "past the end",
            with_sgl(SubmissionEntry::read(NS_4K, Lba(blocks_4k), block_count(1)), &buffer, 4096),
            generic(codes::LBA_OUT_OF_RANGE),
        ),
        (
            "straddles the end",
            with_sgl(SubmissionEntry::read(NS_4K, Lba(blocks_4k - 1), block_count(2)), &buffer, 8192),
            generic(codes::LBA_OUT_OF_RANGE),
        ),
        (
            "LBA overflow",
            with_sgl(SubmissionEntry::write(NS_4K, Lba(u64::MAX), block_count(2), false), &buffer, 8192),
            generic(codes::LBA_OUT_OF_RANGE),
        ),
        ("above MDTS", with_sgl(SubmissionEntry::read(NS_4K, Lba(0), block_count(5)), &buffer, 5 * 4096), generic(codes::INVALID_FIELD)),
        (
            "namespace 0",
            with_sgl(SubmissionEntry::read(NamespaceId(0), Lba(0), block_count(1)), &buffer, 4096),
            generic(codes::INVALID_NAMESPACE),
        ),
        (
            "namespace 9",
            with_sgl(SubmissionEntry::read(NamespaceId(9), Lba(0), block_count(1)), &buffer, 4096),
            generic(codes::INVALID_NAMESPACE),
        ),
        ("unknown opcode", unknown, generic(codes::INVALID_OPCODE)),
        ("PSDT 3", psdt3, generic(codes::INVALID_FIELD)),
        ("SGL too short", sgl_read(SglDescriptor::data_block(buffer.iova().0, 4095)), generic(codes::DATA_SGL_LENGTH_INVALID)),
        ("SGL too long", sgl_read(SglDescriptor::data_block(buffer.iova().0, 4097)), generic(codes::DATA_SGL_LENGTH_INVALID)),
        ("bit bucket", sgl_read(SglDescriptor::new(SglDescriptorType::BitBucket, 0, 4096)), generic(codes::SGL_DESCRIPTOR_TYPE_INVALID)),
        (
            "keyed",
            sgl_read(SglDescriptor::new(SglDescriptorType::KeyedDataBlock, buffer.iova().0, 4096)),
            generic(codes::SGL_DESCRIPTOR_TYPE_INVALID),
        ),
        ("segment loop", sgl_read(SglDescriptor::segment(segments.iova().0, 1)), generic(codes::INVALID_SGL_SEGMENT_DESCRIPTOR)),
        ("unmapped buffer", sgl_read(SglDescriptor::data_block(0x10_0000, 4096)), generic(codes::DATA_TRANSFER_ERROR)),
        ("unmapped PRP", SubmissionEntry::read(NS_4K, Lba(0), block_count(1)), generic(codes::DATA_TRANSFER_ERROR)),
    ];
    for (name, entry, expected) in cases {
        assert_eq!(status_of(&host.execute_on(&mut queue, entry)), expected, "{name}");
    }
    let mut misaligned_prp = SubmissionEntry::read(NS_4K, Lba(0), block_count(2));
    misaligned_prp.dptr = [buffer.iova().0, buffer.iova().checked_add(4096 + 8).unwrap().0];
    assert_eq!(status_of(&host.execute_on(&mut queue, misaligned_prp)), generic(codes::INVALID_PRP_OFFSET));
    // With SGLs turned off, an SGL command is an invalid field.
    drop(host);
    let mut host = TestHost::start(two_namespaces().with_sgl(false));
    let mut queue = host.create_io_pair(1, 8);
    let sgl = with_sgl(SubmissionEntry::read(NS_4K, Lba(0), block_count(1)), &buffer, 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, sgl)), generic(codes::INVALID_FIELD));
}

#[test]
fn write_zeroes_and_deallocate_read_back_as_zeroes() {
    // Goal: Write Zeroes and DSM deallocate clear blocks, cached or not; bad ranges are refused.
    let mut host = TestHost::start(two_namespaces());
    let mut queue = host.create_io_pair(1, 16);
    let data = pattern(8 * 512, 9);
    let back = write_then_read(&host, &mut queue, NS_512, 512, 100, &data);
    assert!(back == data);
    assert_eq!(status_of(&host.execute_on(&mut queue, SubmissionEntry::write_zeroes(NS_512, Lba(100), block_count(2), false))), Ok(()));
    let ranges = host.buffer(4096);
    ranges.write(0, &DatasetRange { context_attributes: 0, blocks: 2, start: Lba(104) }.to_bytes()).unwrap();
    let mut deallocate = SubmissionEntry::deallocate(NS_512, 1);
    deallocate.dptr[0] = ranges.iova().0;
    assert_eq!(status_of(&host.execute_on(&mut queue, deallocate)), Ok(()));
    let target = host.buffer(4096);
    let mut read = SubmissionEntry::read(NS_512, Lba(100), block_count(8));
    read.dptr[0] = target.iova().0;
    assert_eq!(status_of(&host.execute_on(&mut queue, read)), Ok(()));
    let mut out = vec![0u8; 8 * 512];
    target.read(0, &mut out).unwrap();
    assert!(out[..1024].iter().all(|&b| b == 0), "write-zeroed blocks");
    assert!(out[1024..2048] == data[1024..2048], "untouched blocks");
    assert!(out[2048..3072].iter().all(|&b| b == 0), "deallocated blocks");
    assert!(out[3072..] == data[3072..]);
    ranges.write(0, &DatasetRange { context_attributes: 0, blocks: 2, start: Lba(u64::MAX - 1) }.to_bytes()).unwrap();
    let mut bad = SubmissionEntry::deallocate(NS_512, 1);
    bad.dptr[0] = ranges.iova().0;
    assert_eq!(status_of(&host.execute_on(&mut queue, bad)), generic(codes::LBA_OUT_OF_RANGE));
    let past_end = SubmissionEntry::write_zeroes(NS_512, Lba(4096), block_count(1), false);
    assert_eq!(status_of(&host.execute_on(&mut queue, past_end)), generic(codes::LBA_OUT_OF_RANGE));
}

#[test]
fn completion_queue_wraps_with_phase_flip_and_reports_sq_head() {
    // Goal: many passes over a 4-entry queue pair; phase flips, SQ head advances modulo size.
    let mut host = TestHost::start(two_namespaces());
    let mut queue = host.create_io_pair(1, 4);
    for round in 0..21u32 {
        let completion = host.execute_on(&mut queue, SubmissionEntry::flush(NS_4K));
        assert_eq!(status_of(&completion), Ok(()));
        assert_eq!(u32::from(completion.sq_head), (round + 1) % 4, "round {round}");
        assert_eq!(completion.sq_id, 1);
        assert_eq!(completion.phase(), (round / 4) % 2 == 0, "phase of round {round}");
    }
}

#[test]
fn full_completion_queue_stops_consumption_until_head_moves() {
    // Goal: with a 4-entry CQ behind an 8-entry SQ, only 3 completions appear until the host
    // frees CQ slots; then the rest follow and nothing is lost or overwritten.
    let mut host = TestHost::start(two_namespaces());
    let mut queue = super::harness::HostQueue { entries: 8, ..host.create_io_pair(2, 8) };
    // Replace the pair by one whose CQ is smaller than its SQ.
    assert_eq!(status_of(&host.admin(SubmissionEntry::delete_io_submission_queue(2))), Ok(()));
    assert_eq!(status_of(&host.admin(SubmissionEntry::delete_io_completion_queue(2))), Ok(()));
    assert_eq!(status_of(&host.admin(SubmissionEntry::create_io_completion_queue(2, 4, queue.completion.iova().0))), Ok(()));
    assert_eq!(status_of(&host.admin(SubmissionEntry::create_io_submission_queue(2, 8, queue.submission.iova().0, 2))), Ok(()));
    queue.completion.fill(0, queue.completion.len(), 0).unwrap();
    (queue.tail, queue.head, queue.phase) = (0, 0, true);
    let mut completion_view = queue.clone();
    completion_view.entries = 4;
    let ids: Vec<_> = (0..6).map(|_| TestHost::push(&mut queue, SubmissionEntry::flush(NS_4K))).collect();
    host.ring_submission(&queue);
    std::thread::sleep(Duration::from_millis(20));
    let mut seen = Vec::new();
    while let Some(completion) = TestHost::try_reap(&mut completion_view) {
        seen.push(completion.command_id());
    }
    assert_eq!(seen, ids[..3], "a full CQ holds entries - 1 completions");
    host.ring_completion(&completion_view);
    let deadline = Instant::now() + super::harness::DEADLINE;
    while seen.len() < 6 {
        assert!(Instant::now() < deadline, "remaining completions did not arrive: {seen:?}");
        if let Some(completion) = host.reap_within(&mut completion_view, Duration::from_millis(10)) {
            seen.push(completion.command_id());
        }
    }
    assert_eq!(seen, ids);
}

#[test]
fn power_loss_discards_unflushed_writes_only() {
    // Goal: flushed and FUA data survive a power loss; cached data does not; the controller
    // needs a fresh bring-up afterwards.
    let mut host = TestHost::start(two_namespaces());
    let mut queue = host.create_io_pair(1, 16);
    let write = |host: &TestHost, queue: &mut HostQueue, lba: u64, seed: u8, fua: bool| {
        let source = host.buffer(4096);
        source.write(0, &pattern(4096, seed)).unwrap();
        let entry = with_sgl(SubmissionEntry::write(NS_4K, Lba(lba), block_count(1), fua), &source, 4096);
        assert_eq!(status_of(&host.execute_on(queue, entry)), Ok(()));
    };
    write(&host, &mut queue, 0, 1, false);
    assert_eq!(status_of(&host.execute_on(&mut queue, SubmissionEntry::flush(NS_4K))), Ok(()));
    write(&host, &mut queue, 1, 2, true);
    write(&host, &mut queue, 2, 3, false);
    write(&host, &mut queue, 0, 4, false); // overwrites flushed data, unflushed
    host.device.power_loss();
    assert!(!host.csts().ready(), "RDY drops at power loss");
    assert_eq!(host.registers.read32(registers::CC), 0, "registers reset");
    host.enable();
    let mut queue = host.create_io_pair(1, 16);
    let target = host.buffer(3 * 4096);
    let read = with_sgl(SubmissionEntry::read(NS_4K, Lba(0), block_count(3)), &target, 3 * 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, read)), Ok(()));
    let mut out = vec![0u8; 3 * 4096];
    target.read(0, &mut out).unwrap();
    assert!(out[..4096] == pattern(4096, 1)[..], "flushed data survives, the later cached overwrite is gone");
    assert!(out[4096..8192] == pattern(4096, 2)[..], "FUA data survives");
    assert!(out[8192..].iter().all(|&b| b == 0), "unflushed data is lost");
    assert_eq!(host.device.stats().power_losses, 1);

    // Without a cache every completed write is durable.
    let mut host = TestHost::start(two_namespaces().with_volatile_write_cache(false));
    let mut queue = host.create_io_pair(1, 16);
    write(&host, &mut queue, 5, 7, false);
    host.device.power_loss();
    host.enable();
    let mut queue = host.create_io_pair(1, 16);
    let target = host.buffer(4096);
    let read = with_sgl(SubmissionEntry::read(NS_4K, Lba(5), block_count(1)), &target, 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, read)), Ok(()));
    let mut out = vec![0u8; 4096];
    target.read(0, &mut out).unwrap();
    assert!(out == pattern(4096, 7));
}

#[test]
fn file_backing_persists_across_device_restarts() {
    // Goal: a file-backed device keeps flushed data for the next device on the same file.
    let path = std::env::temp_dir().join(format!("nvme-emu-test-{}-persist", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let config = || EmuConfig::default().with_backing(Backing::File { path: path.clone(), create_bytes: Some(4 << 20) });
    let data = pattern(64 << 10, 5);
    {
        let mut host = TestHost::start(config());
        let mut queue = host.create_io_pair(1, 8);
        let back = write_then_read(&host, &mut queue, NamespaceId(1), 4096, 10, &data);
        assert!(back == data);
        assert_eq!(status_of(&host.execute_on(&mut queue, SubmissionEntry::flush(NamespaceId(0xFFFF_FFFF)))), Ok(()));
    }
    let mut host = TestHost::start(config());
    let mut queue = host.create_io_pair(1, 8);
    let target = host.buffer(data.len());
    let read = with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(10), block_count(16)), &target, data.len() as u32);
    assert_eq!(status_of(&host.execute_on(&mut queue, read)), Ok(()));
    let mut out = vec![0u8; data.len()];
    target.read(0, &mut out).unwrap();
    assert!(out == data);
    drop(host);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn injected_faults_behave_as_planned() {
    // Goal: status, drop, corrupt id, delay and CFS faults each do exactly what they say.
    let mut host = TestHost::start(two_namespaces());
    let mut queue = host.create_io_pair(1, 16);
    let media = NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, codes::WRITE_FAULT);
    host.device.set_faults(
        FaultPlan::none()
            .with_rule(FaultRule::on_nth_io(2, FaultAction::Status(media)))
            .with_rule(FaultRule::on_nth_io(3, FaultAction::DropCompletion))
            .with_rule(FaultRule::on_nth_io(4, FaultAction::CorruptCommandId))
            .with_rule(FaultRule::on_nth_io(5, FaultAction::Delay(Duration::from_millis(30)))),
    );
    let flush = || SubmissionEntry::flush(NS_4K);
    assert_eq!(status_of(&host.execute_on(&mut queue, flush())), Ok(()));
    assert_eq!(status_of(&host.execute_on(&mut queue, flush())), Err(media));
    TestHost::push(&mut queue, flush());
    host.ring_submission(&queue);
    assert!(host.reap_within(&mut queue, Duration::from_millis(30)).is_none(), "dropped completion");
    let id = TestHost::push(&mut queue, flush());
    host.ring_submission(&queue);
    let corrupt = host.reap(&mut queue);
    assert_ne!(corrupt.command_id(), id, "corrupted command id");
    let started = Instant::now();
    let delayed = TestHost::push(&mut queue, flush());
    host.ring_submission(&queue);
    let quick = TestHost::push(&mut queue, flush());
    host.ring_submission(&queue);
    assert_eq!(host.reap(&mut queue).command_id(), quick, "a later command overtakes the delayed one");
    assert_eq!(host.reap(&mut queue).command_id(), delayed);
    assert!(started.elapsed() >= Duration::from_millis(30));
    assert_eq!(host.device.stats().faults_injected, 4);

    host.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::ControllerFatal)));
    TestHost::push(&mut queue, flush());
    host.ring_submission(&queue);
    let deadline = Instant::now() + super::harness::DEADLINE;
    while !host.csts().fatal() {
        assert!(Instant::now() < deadline, "CFS not set");
        std::thread::sleep(Duration::from_micros(50));
    }
    host.enable();
    assert!(!host.csts().fatal() && host.csts().ready(), "reset clears CFS");
}

#[test]
fn no_storage_mode_validates_but_moves_nothing() {
    // Goal: commands complete (and are still validated) without data movement.
    let mut host = TestHost::start(two_namespaces().with_no_storage(true));
    let mut queue = host.create_io_pair(1, 16);
    let source = host.buffer(4096);
    source.write(0, &pattern(4096, 1)).unwrap();
    let write = with_sgl(SubmissionEntry::write(NS_4K, Lba(0), block_count(1), false), &source, 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, write)), Ok(()));
    let target = host.buffer(4096);
    target.fill(0, 4096, 0xEE).unwrap();
    let read = with_sgl(SubmissionEntry::read(NS_4K, Lba(0), block_count(1)), &target, 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, read)), Ok(()));
    let mut out = [0u8; 16];
    target.read(0, &mut out).unwrap();
    assert_eq!(out, [0xEE; 16], "no data moved");
    let past_end = with_sgl(SubmissionEntry::read(NS_4K, Lba(1 << 40), block_count(1)), &target, 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, past_end)), generic(codes::LBA_OUT_OF_RANGE));
}

#[test]
fn several_queues_at_depth_interleave() {
    // Goal: several queue pairs with many outstanding commands each all complete, ids intact.
    let mut host = TestHost::start(two_namespaces());
    let mut queues: Vec<_> = (1..=4).map(|id| host.create_io_pair(id, 32)).collect();
    let mut expected = Vec::new();
    for queue in &mut queues {
        let ids: Vec<_> = (0..31).map(|_| TestHost::push(queue, SubmissionEntry::flush(NS_4K))).collect();
        host.ring_submission(queue);
        expected.push(ids);
    }
    for (queue, ids) in queues.iter_mut().zip(expected) {
        let seen: Vec<_> = (0..31).map(|_| host.reap(queue).command_id()).collect();
        assert_eq!(seen, ids);
    }
    // Doorbell writes are honoured whether they come through RegisterIo or straight into the
    // register memory (as a GPU would write them).
    let queue = &mut queues[0];
    let id = TestHost::push(queue, SubmissionEntry::flush(NS_4K));
    let region = host.device.register_region();
    region.store_u32(registers::doorbell_offset(1, false, 0), queue.tail, std::sync::atomic::Ordering::Release).unwrap();
    assert_eq!(host.reap(queue).command_id(), id);
    let _ = host.registers.len();
}

#[test]
fn batched_file_reads_keep_command_order_and_see_the_cache() {
    // Goal: reads issued together through io_uring return the right bytes, never see a write
    // submitted after them, always see one submitted before them, and see unflushed cache data.
    let path = std::env::temp_dir().join(format!("nvme-emu-test-{}-batch", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let mut host = TestHost::start(EmuConfig::default().with_backing(Backing::File { path: path.clone(), create_bytes: Some(4 << 20) }));
    let mut queue = host.create_io_pair(1, 64);
    let blocks = 16usize;
    let data = pattern(blocks * 4096, 11);
    let source = host.buffer(data.len());
    source.write(0, &data).unwrap();
    let write = with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(0), block_count(blocks as u32), false), &source, data.len() as u32);
    assert_eq!(status_of(&host.execute_on(&mut queue, write)), Ok(()));
    assert_eq!(status_of(&host.execute_on(&mut queue, SubmissionEntry::flush(NamespaceId(1)))), Ok(()));
    // Block 3 rewritten but not flushed: reads must see the cached version.
    let cached = pattern(4096, 99);
    let cached_source = host.buffer(4096);
    cached_source.write(0, &cached).unwrap();
    let write = with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(3), block_count(1), false), &cached_source, 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, write)), Ok(()));
    let newer = pattern(4096, 200);
    let newer_source = host.buffer(4096);
    newer_source.write(0, &newer).unwrap();
    // One doorbell: 16 reads, a write of block 5, a read of block 5.
    let targets: Vec<_> = (0..blocks + 1).map(|_| host.buffer(4096)).collect();
    for (block, target) in targets.iter().take(blocks).enumerate() {
        TestHost::push(&mut queue, with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(block as u64), block_count(1)), target, 4096));
    }
    TestHost::push(&mut queue, with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(5), block_count(1), false), &newer_source, 4096));
    TestHost::push(&mut queue, with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(5), block_count(1)), &targets[blocks], 4096));
    host.ring_submission(&queue);
    for _ in 0..blocks + 2 {
        assert_eq!(status_of(&host.reap(&mut queue)), Ok(()));
    }
    let read_back = |target: &nvme_driver::hw::DmaRegion| {
        let mut out = vec![0u8; 4096];
        target.read(0, &mut out).unwrap();
        out
    };
    for (block, target) in targets.iter().take(blocks).enumerate() {
        let expected = if block == 3 { &cached[..] } else { &data[block * 4096..(block + 1) * 4096] };
        assert!(read_back(target) == expected, "block {block}");
    }
    assert!(read_back(&targets[blocks]) == newer, "the read after the write sees it");
    if tutti_uring::available() {
        assert!(host.device.stats().batched_reads >= blocks as u64, "reads went through io_uring");
    } else {
        eprintln!("io_uring unavailable here: only the synchronous read path was checked");
    }
    drop(host);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn batched_file_writes_keep_overlapping_commands_in_order() {
    // Goal: write-through Writes issued together through io_uring land on media, reads before
    // them in the same doorbell see the old bytes, reads after them the new ones, overlapping
    // writes land in submission order, and a FUA write supersedes an older cached copy.
    let path = std::env::temp_dir().join(format!("nvme-emu-test-{}-batch-writes", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let config = EmuConfig::default().with_backing(Backing::File { path: path.clone(), create_bytes: Some(4 << 20) });
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 64);
    let blocks = 8usize;
    let read_back = |target: &nvme_driver::hw::DmaRegion| {
        let mut out = vec![0u8; 4096];
        target.read(0, &mut out).unwrap();
        out
    };
    // Block 40 cached (not flushed) before the doorbell; a FUA write of it follows in the batch.
    let cached_source = host.buffer(4096);
    cached_source.write(0, &pattern(4096, 7)).unwrap();
    let write = with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(40), block_count(1), false), &cached_source, 4096);
    assert_eq!(status_of(&host.execute_on(&mut queue, write)), Ok(()));
    // One doorbell: reads of 0..8, FUA writes of 0..8, reads of 0..8, two FUA writes of block
    // 20 (first A, then B), a read of 20, a FUA write of 40, a read of 40.
    let sources: Vec<_> = (0..blocks).map(|block| (host.buffer(4096), pattern(4096, 30 + block as u8))).collect();
    for (source, data) in &sources {
        source.write(0, data).unwrap();
    }
    let before: Vec<_> = (0..blocks).map(|_| host.buffer(4096)).collect();
    let after: Vec<_> = (0..blocks).map(|_| host.buffer(4096)).collect();
    for (block, target) in before.iter().enumerate() {
        TestHost::push(&mut queue, with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(block as u64), block_count(1)), target, 4096));
    }
    for (block, (source, _)) in sources.iter().enumerate() {
        TestHost::push(&mut queue, with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(block as u64), block_count(1), true), source, 4096));
    }
    for (block, target) in after.iter().enumerate() {
        TestHost::push(&mut queue, with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(block as u64), block_count(1)), target, 4096));
    }
    let (first, second) = (pattern(4096, 101), pattern(4096, 102));
    let (first_source, second_source) = (host.buffer(4096), host.buffer(4096));
    first_source.write(0, &first).unwrap();
    second_source.write(0, &second).unwrap();
    TestHost::push(&mut queue, with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(20), block_count(1), true), &first_source, 4096));
    TestHost::push(&mut queue, with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(20), block_count(1), true), &second_source, 4096));
    let target_20 = host.buffer(4096);
    TestHost::push(&mut queue, with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(20), block_count(1)), &target_20, 4096));
    let fua = pattern(4096, 103);
    let fua_source = host.buffer(4096);
    fua_source.write(0, &fua).unwrap();
    TestHost::push(&mut queue, with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(40), block_count(1), true), &fua_source, 4096));
    let target_40 = host.buffer(4096);
    TestHost::push(&mut queue, with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(40), block_count(1)), &target_40, 4096));
    host.ring_submission(&queue);
    for _ in 0..3 * blocks + 5 {
        assert_eq!(status_of(&host.reap(&mut queue)), Ok(()));
    }
    for block in 0..blocks {
        assert!(read_back(&before[block]) == vec![0u8; 4096], "block {block} read before its write");
        assert!(read_back(&after[block]) == sources[block].1, "block {block} read after its write");
    }
    assert!(read_back(&target_20) == second, "overlapping writes land in order");
    assert!(read_back(&target_40) == fua, "the FUA write supersedes the cached copy");
    if tutti_uring::available() {
        assert!(host.device.stats().batched_writes >= blocks as u64, "writes went through io_uring");
    } else {
        eprintln!("io_uring unavailable here: only the synchronous write path was checked");
    }
    // FUA data is on media: a power loss keeps it, and the cached copy of block 40 never returns.
    host.device.power_loss();
    drop(host);
    let mut media = vec![0u8; 41 * 4096];
    std::io::Read::read_exact(&mut std::fs::File::open(&path).unwrap(), &mut media).unwrap();
    for (block, (_, data)) in sources.iter().enumerate() {
        assert!(&media[block * 4096..(block + 1) * 4096] == data.as_slice(), "block {block} on media");
    }
    assert!(media[20 * 4096..21 * 4096] == second[..]);
    assert!(media[40 * 4096..41 * 4096] == fua[..]);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_tail_rung_before_the_head_that_makes_room_for_it_is_fetched_at_once() {
    // Goal: in a 2-entry queue whose one usable CQ entry is taken, a host that writes the next
    // command's SQ tail and then the CQ head that frees the entry its completion needs (our
    // driver's order) does not leave the command behind for a scan, even when both writes land
    // between the scan's read of the CQ heads and its read of the SQ tails: the controller
    // reads the CQ head again before leaving commands for want of room. The writes are made
    // there by the scan's own hook, so the interleaving is certain, not left to the scheduler.
    let mut host = TestHost::start(two_namespaces());
    let mut queue = host.create_io_pair(1, 2);
    let first = TestHost::push(&mut queue, SubmissionEntry::flush(NS_4K));
    host.ring_submission(&queue);
    let completion = TestHost::try_reap_within(&mut queue, super::harness::DEADLINE).expect("the first flush completes");
    assert_eq!((completion.command_id(), status_of(&completion)), (first, Ok(())));
    // Its CQ entry is reaped but not released (the head doorbell not rung): the CQ is full.
    let second = TestHost::push(&mut queue, SubmissionEntry::flush(NS_4K));
    let waits_before = host.device.stats().completion_room_waits;
    let (submission_tail, completion_head) = (queue.tail, queue.head);
    let (tail_doorbell, head_doorbell) = (host.doorbell(queue.id, false), host.doorbell(queue.id, true));
    host.device.with_core(|core| {
        core.after_completion_heads_read_for_tests = Some(Box::new(move |registers| {
            registers.write32(tail_doorbell, submission_tail);
            registers.write32(head_doorbell, completion_head);
        }))
    });
    // Wake the controller for a scan (a doorbell write with the values it already has).
    host.registers.write32(head_doorbell, 0);
    let completion = TestHost::try_reap_within(&mut queue, super::harness::DEADLINE).expect("the second flush completes");
    assert_eq!((completion.command_id(), status_of(&completion)), (second, Ok(())));
    assert!(host.device.with_core(|core| core.after_completion_heads_read_for_tests.is_none()), "the scan ran the hook");
    let waits = host.device.stats().completion_room_waits - waits_before;
    assert_eq!(waits, 0, "the scan that saw the tail left the command for want of a CQ entry the host had freed");
}
