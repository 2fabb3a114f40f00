//! Transfers in flight across doorbell scans: ordering of overlapping commands, Flush, power
//! loss and completions posted as each transfer completes. The deterministic ones hold writes in
//! flight on a full socket (see `stall_tests`), with a deadline long enough not to fire.

use std::io::{ErrorKind, Read, Write};
use std::time::{Duration, Instant};

use nvme_driver::hw::DmaRegion;
use nvme_driver::spec::{CompletionEntry, SubmissionEntry};
use nvme_driver::{CommandId, Lba, NamespaceId};

use super::harness::{block_count, status_of, with_prp, with_sgl, HostQueue, TestHost, DEADLINE};
use super::stall_tests::{block, Stalled};
use crate::{Backing, EmuConfig};

/// Transfer deadline of the held controllers: far longer than any test holds a write.
const HELD_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a test watches for a completion that must not come yet.
const QUIET: Duration = Duration::from_millis(150);

/// Pushes a write of `data` at `lba` (FUA, so it goes straight to the store) without ringing.
fn push_write(host: &TestHost, queue: &mut HostQueue, lba: u64, data: &[u8]) -> (CommandId, DmaRegion) {
    let source = host.buffer(data.len());
    source.write(0, data).unwrap();
    let blocks = (data.len() / 4096) as u32;
    let write = SubmissionEntry::write(NamespaceId(1), Lba(lba), block_count(blocks), true);
    (TestHost::push(queue, with_sgl(write, &source, data.len() as u32)), source)
}

/// Waits until the controller holds `count` commands in flight.
fn wait_for_in_flight(host: &TestHost, count: usize) {
    let deadline = Instant::now() + DEADLINE;
    while host.device.with_core(|core| core.in_flight_ranges().len()) != count {
        assert!(Instant::now() < deadline, "the controller never had {count} commands in flight");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Two writes (blocks 0 and 1) held in flight by the full socket.
fn hold_two_writes(stalled: &mut Stalled) -> [(CommandId, DmaRegion); 2] {
    let first = push_write(&stalled.host, &mut stalled.queue, 0, &block(1));
    let second = push_write(&stalled.host, &mut stalled.queue, 1, &block(2));
    stalled.host.ring_submission(&stalled.queue);
    wait_for_in_flight(&stalled.host, 2);
    [first, second]
}

fn reap_all(host: &TestHost, queue: &mut HostQueue, count: usize) -> Vec<CompletionEntry> {
    (0..count).map(|_| host.reap(queue)).collect()
}

#[test]
fn a_read_overlapping_a_write_in_flight_waits_for_it() {
    // Goal: a Read fetched in a later scan than a Write still in flight, and overlapping it,
    // starts only once that Write completed (so it cannot miss it). The read's data waits in the
    // socket: a read started at once would complete at once.
    let Some(mut stalled) = Stalled::start_with("in-flight-read", true, HELD_TIMEOUT) else { return };
    let [(first, _), (second, _)] = hold_two_writes(&mut stalled);
    stalled.receiver.write_all(&block(9)).unwrap();
    let target = stalled.host.buffer(4096);
    let read = with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(0), block_count(1)), &target, 4096);
    let read_id = TestHost::push(&mut stalled.queue, read);
    stalled.host.ring_submission(&stalled.queue);
    assert!(stalled.host.reap_within(&mut stalled.queue, QUIET).is_none(), "a command completed while the write it follows was held");
    assert_eq!(stalled.drain(Duration::from_millis(300)), stalled.filler_bytes + 2 * 4096, "both writes landed");
    let completions = reap_all(&stalled.host, &mut stalled.queue, 3);
    assert!(completions.iter().all(|completion| status_of(completion).is_ok()), "{completions:?}");
    let mut writes: Vec<_> = completions[..2].iter().map(CompletionEntry::command_id).collect();
    writes.sort_by_key(|id| id.0);
    assert_eq!(writes, [first, second], "the writes complete first");
    assert_eq!(completions[2].command_id(), read_id, "the read completes after the write it overlaps");
}

#[test]
fn overlapping_writes_in_different_scans_are_never_in_flight_together_and_land_in_order() {
    // Goal: a Write fetched while an overlapping Write is in flight waits for it: the two are
    // never in flight at once, and the socket (the "media") receives the older one first. The
    // scans are driven by hand under the controller's lock, so their boundaries are exact.
    let Some(mut stalled) = Stalled::start_with("in-flight-overlap", true, HELD_TIMEOUT) else { return };
    let mut receiver = stalled.receiver.try_clone().unwrap();
    let filler_bytes = stalled.filler_bytes;
    let drainer = std::thread::spawn(move || {
        std::thread::sleep(QUIET);
        receiver.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let mut received = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            match receiver.read(&mut chunk) {
                Ok(0) => break,
                Ok(read) => received.extend_from_slice(&chunk[..read]),
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
                Err(error) => panic!("reading the socket: {error}"),
            }
        }
        received
    });
    let older = [block(1), block(2)].concat();
    let newer = [block(3), block(4)].concat();
    let device = stalled.host.device.clone();
    let ranges_after_second_scan = device.with_core(|core| {
        let _older = push_write(&stalled.host, &mut stalled.queue, 0, &older);
        let _other = push_write(&stalled.host, &mut stalled.queue, 8, &block(5));
        stalled.host.ring_submission(&stalled.queue);
        core.poll(Instant::now());
        assert_eq!(core.in_flight_ranges().len(), 2, "the first scan's writes are held in flight");
        let _newer = push_write(&stalled.host, &mut stalled.queue, 1, &newer);
        stalled.host.ring_submission(&stalled.queue);
        core.poll(Instant::now());
        core.in_flight_ranges()
    });
    for (index, first) in ranges_after_second_scan.iter().enumerate() {
        for second in &ranges_after_second_scan[index + 1..] {
            let overlap = first.0 == second.0 && first.1 < second.1 + second.2 && second.1 < first.1 + first.2;
            assert!(!overlap, "overlapping writes in flight together: {ranges_after_second_scan:?}");
        }
    }
    let received = drainer.join().unwrap();
    assert_eq!(received.len(), filler_bytes + 5 * 4096, "every write landed");
    let seeds: Vec<u8> = received[filler_bytes..]
        .chunks_exact(4096)
        .map(|chunk| (1..=5).find(|&seed| chunk == block(seed).as_slice()).expect("a block the test wrote"))
        .collect();
    let position = |seed: u8| seeds.iter().position(|&landed| landed == seed).unwrap();
    assert!(position(2) < position(3), "the older write of block 1 lands before the newer one: {seeds:?}");
    let completions = reap_all(&stalled.host, &mut stalled.queue, 3);
    assert!(completions.iter().all(|completion| status_of(completion).is_ok()), "{completions:?}");
}

#[test]
fn the_byte_bound_holds_bounced_transfers_only() {
    // Goal: `in_flight_bytes_max` bounds the bytes bounced through the controller's buffers. A
    // transfer straight from host memory holds none of them, so only the ring's depth bounds
    // it (at 1 MiB the byte bound kept 16 of a QD 32 host's commands at the file, where fio
    // keeps 32). Bound: two blocks; one scan of four one-block writes held by the full socket.
    // Direct, all four are in flight when the scan ends. Bounced, the scan's third write waits
    // for room, so the scan lasts until the drainer starts freeing the socket and ends with at
    // most two in flight. The scan is driven by hand under the controller's lock, so its end is
    // exact.
    for direct in [true, false] {
        let name = if direct { "bound-direct" } else { "bound-bounced" };
        let Some(mut stalled) = Stalled::start_with(name, true, HELD_TIMEOUT) else { return };
        let device = stalled.host.device.clone();
        device.with_core(|core| {
            core.set_in_flight_bytes_max_for_tests(2 * 4096);
            if direct {
                core.allow_direct_on_override();
            }
        });
        let mut receiver = stalled.receiver.try_clone().unwrap();
        let expected_bytes = stalled.filler_bytes + 4 * 4096;
        let mut received = vec![0u8; expected_bytes];
        let drainer = std::thread::spawn(move || {
            std::thread::sleep(QUIET);
            receiver.set_read_timeout(Some(DEADLINE)).unwrap();
            // The socket frees room only from here on: the scan's end is compared with this
            // instant, not with QUIET (the drainer's sleep began before the scan did).
            let draining_from = Instant::now();
            receiver.read_exact(&mut received).map(|()| (draining_from, received))
        });
        let (in_flight_after_scan, scan_ended) = device.with_core(|core| {
            let _sources: Vec<_> = (0..4u8).map(|lba| push_write(&stalled.host, &mut stalled.queue, u64::from(lba), &block(lba))).collect();
            stalled.host.ring_submission(&stalled.queue);
            core.poll(Instant::now());
            (core.in_flight_ranges().len(), Instant::now())
        });
        let (draining_from, received) = drainer.join().unwrap().expect("every write reached the socket");
        if direct {
            assert_eq!(in_flight_after_scan, 4, "direct writes are held to the ring's depth only");
            assert!(scan_ended < draining_from, "the scan of direct writes waited for the socket to drain");
        } else {
            assert!(in_flight_after_scan <= 2, "{in_flight_after_scan} bounced one-block writes in flight with a two-block bound");
            assert!(scan_ended >= draining_from, "the third bounced write did not wait for room: the scan ended before the socket drained");
        }
        let mut landed: Vec<u8> = received[stalled.filler_bytes..]
            .chunks_exact(4096)
            .map(|chunk| (0..4u8).find(|&seed| chunk == block(seed).as_slice()).expect("a block the test wrote"))
            .collect();
        landed.sort_unstable();
        assert_eq!(landed, [0, 1, 2, 3], "each write landed once");
        let completions = reap_all(&stalled.host, &mut stalled.queue, 4);
        assert!(completions.iter().all(|completion| status_of(completion).is_ok()), "{completions:?}");
    }
}

#[test]
fn a_flush_completes_only_after_the_writes_in_flight() {
    // Goal: a Flush fetched while write-through Writes are in flight completes after them.
    let Some(mut stalled) = Stalled::start_with("in-flight-flush", true, HELD_TIMEOUT) else { return };
    let [(first, _), (second, _)] = hold_two_writes(&mut stalled);
    let flush = TestHost::push(&mut stalled.queue, SubmissionEntry::flush(NamespaceId(1)));
    stalled.host.ring_submission(&stalled.queue);
    assert!(stalled.host.reap_within(&mut stalled.queue, QUIET).is_none(), "the Flush completed while writes were held");
    assert_eq!(stalled.drain(Duration::from_millis(300)), stalled.filler_bytes + 2 * 4096);
    let completions = reap_all(&stalled.host, &mut stalled.queue, 3);
    assert!(completions.iter().all(|completion| status_of(completion).is_ok()), "{completions:?}");
    let mut writes: Vec<_> = completions[..2].iter().map(CompletionEntry::command_id).collect();
    writes.sort_by_key(|id| id.0);
    assert_eq!(writes, [first, second]);
    assert_eq!(completions[2].command_id(), flush, "the Flush completes last");
}

#[test]
fn power_loss_with_writes_in_flight_keeps_exactly_the_completed_writes() {
    // Goal: at a power loss, a completed write-through write stays on media, a cached write is
    // gone, and writes still in flight get no completion and never land later (the cut cancels
    // them); the controller comes up again and serves I/O.
    let Some(mut stalled) = Stalled::start_with("in-flight-power", true, HELD_TIMEOUT) else { return };
    assert_eq!(stalled.write(2, &block(20)), Ok(()), "a lone write: synchronous, to the file");
    let cached = stalled.host.buffer(4096);
    cached.write(0, &block(30)).unwrap();
    let write = with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(3), block_count(1), false), &cached, 4096);
    assert_eq!(status_of(&stalled.host.execute_on(&mut stalled.queue, write)), Ok(()));
    hold_two_writes(&mut stalled);
    stalled.host.device.power_loss();
    assert_eq!(stalled.host.device.with_core(|core| core.in_flight_ranges().len()), 0);
    assert!(TestHost::try_reap(&mut stalled.queue).is_none(), "a write in flight at the cut was completed");
    assert_eq!(stalled.drain(Duration::from_millis(300)), stalled.filler_bytes, "a write in flight at the cut landed later");
    let media = stalled.media_blocks(4);
    assert_eq!(media[..2 * 4096], vec![0u8; 2 * 4096][..], "the held writes never reached the file");
    assert!(media[2 * 4096..3 * 4096] == block(20)[..], "the completed write is durable");
    assert_eq!(media[3 * 4096..], vec![0u8; 4096][..], "the cached write is gone");
    stalled.enable_again();
    assert_eq!(stalled.read(2), (Ok(()), block(20)));
    assert_eq!(stalled.read(3), (Ok(()), vec![0u8; 4096]));
}

#[test]
fn completions_of_transfers_in_flight_each_carry_their_own_data() {
    // Goal: with many Reads and Writes of different sizes in flight over several doorbells
    // (completions posted as each transfer completes, in any order), every completion's command
    // id matches its own command and every read returns the bytes of its own blocks.
    let path = std::env::temp_dir().join(format!("nvme-emu-test-{}-in-flight-data", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let config = EmuConfig::default()
        .with_backing(Backing::File { path: path.clone(), create_bytes: Some(8 << 20) })
        .with_volatile_write_cache(false);
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 128);
    let blocks = 256u64;
    let expected =
        |lba: u64| -> Vec<u8> { (0..4096).map(|index| (index as u8).wrapping_add(lba as u8).wrapping_mul(7) ^ (lba >> 8) as u8).collect() };
    // Writes of 1..=8 blocks covering 0..256, eight per doorbell.
    let mut commands = std::collections::HashMap::new();
    let mut lba = 0u64;
    let mut sources = Vec::new();
    while lba < blocks {
        let count = (1 + lba % 8).min(blocks - lba);
        let data: Vec<u8> = (lba..lba + count).flat_map(expected).collect();
        let (id, source) = push_write(&host, &mut queue, lba, &data);
        commands.insert(id, (lba, count));
        sources.push(source);
        lba += count;
        if commands.len() % 8 == 0 {
            host.ring_submission(&queue);
        }
    }
    host.ring_submission(&queue);
    for _ in 0..commands.len() {
        let completion = host.reap(&mut queue);
        assert_eq!(status_of(&completion), Ok(()));
        assert!(commands.remove(&completion.command_id()).is_some(), "a completion for no outstanding command");
    }
    // Reads in a scattered order, of 1..=4 blocks each, six per doorbell, into their own buffers.
    let mut reads = std::collections::HashMap::new();
    let mut out_of_order = 0usize;
    for round in 0..4u64 {
        let mut submitted = Vec::new();
        for index in 0..48u64 {
            let start = (index * 37 + round * 11) % (blocks - 4);
            let count = 1 + (index + round) % 4;
            let target = host.buffer(count as usize * 4096);
            let read = with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(start), block_count(count as u32)), &target, count as u32 * 4096);
            let id = TestHost::push(&mut queue, read);
            reads.insert(id, (start, count, target));
            submitted.push(id);
            if index % 6 == 5 {
                host.ring_submission(&queue);
            }
        }
        host.ring_submission(&queue);
        for submitted_id in &submitted {
            let completion = host.reap(&mut queue);
            assert_eq!(status_of(&completion), Ok(()));
            out_of_order += usize::from(*submitted_id != completion.command_id());
            let (start, count, target) = reads.remove(&completion.command_id()).expect("a completion for an outstanding read");
            let mut data = vec![0u8; count as usize * 4096];
            target.read(0, &mut data).unwrap();
            let want: Vec<u8> = (start..start + count).flat_map(expected).collect();
            assert!(data == want, "read of {count} blocks at {start} (command {:?}) returned other bytes", completion.command_id());
        }
    }
    eprintln!("{out_of_order} of 192 read completions were posted out of submission order");
    if tutti_uring::available() {
        let stats = host.device.stats();
        assert!(stats.batched_reads > 0 && stats.batched_writes > 0, "transfers went through io_uring: {stats:?}");
    }
    drop(host);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn direct_and_bounced_transfers_move_identical_bytes() {
    // Goal: a Read or Write whose host memory is 4 KiB aligned moves straight between the file
    // and that memory (no bounce buffer); one whose memory is not (PRP1 with a 512-byte offset)
    // goes through a bounce buffer. Data written either way reads back identical either way,
    // and is on the file. Two commands per doorbell, so that none is the lone synchronous one.
    let path = std::env::temp_dir().join(format!("nvme-emu-test-{}-direct", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let config = EmuConfig::default()
        .with_backing(Backing::File { path: path.clone(), create_bytes: Some(8 << 20) })
        .with_volatile_write_cache(false);
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 64);
    let len = 128 << 10;
    let blocks = block_count((len / 4096) as u32);
    let data: Vec<u8> = (0..len / 4096).flat_map(|seed| block(seed as u8)).collect();
    // (buffer, offset into it): aligned, then misaligned.
    let memory = |offset: usize| {
        let buffer = host.buffer(len + 4096);
        (buffer, offset, host.buffer(4096))
    };
    let (aligned, misaligned) = (memory(0), memory(512));
    aligned.0.write(aligned.1, &data).unwrap();
    misaligned.0.write(misaligned.1, &data).unwrap();
    let command =
        |entry: SubmissionEntry, (buffer, offset, list): &(DmaRegion, usize, DmaRegion)| with_prp(entry, buffer, *offset, len, list);
    TestHost::push(&mut queue, command(SubmissionEntry::write(NamespaceId(1), Lba(0), blocks, false), &aligned));
    TestHost::push(&mut queue, command(SubmissionEntry::write(NamespaceId(1), Lba(64), blocks, false), &misaligned));
    host.ring_submission(&queue);
    for completion in reap_all(&host, &mut queue, 2) {
        assert_eq!(status_of(&completion), Ok(()));
    }
    let direct_writes = host.device.stats().direct_transfers;
    // Each region reads back both blocks ranges, one direct and one bounced per range.
    let targets: Vec<_> = [(0u64, 0usize), (0, 512), (64, 0), (64, 512)].into_iter().map(|(lba, offset)| (lba, memory(offset))).collect();
    for (lba, target) in &targets {
        TestHost::push(&mut queue, command(SubmissionEntry::read(NamespaceId(1), Lba(*lba), blocks), target));
    }
    host.ring_submission(&queue);
    for completion in reap_all(&host, &mut queue, targets.len()) {
        assert_eq!(status_of(&completion), Ok(()));
    }
    for (lba, (buffer, offset, _)) in &targets {
        let mut back = vec![0u8; len];
        buffer.read(*offset, &mut back).unwrap();
        assert!(back == data, "read of LBA {lba} into memory at offset {offset}: other bytes");
    }
    let stats = host.device.stats();
    drop(host);
    let mut media = vec![0u8; 64 * 4096 + len];
    std::fs::File::open(&path).unwrap().read_exact(&mut media).unwrap();
    assert!(media[..len] == data[..] && media[64 * 4096..] == data[..], "both writes are on the file");
    let _ = std::fs::remove_file(&path);
    if tutti_uring::available() {
        assert_eq!(direct_writes, 1, "only the aligned write went direct");
        assert_eq!(stats.direct_transfers, 3, "only the aligned reads went direct: {stats:?}");
        assert_eq!(stats.batched_reads + stats.batched_writes, 6, "every transfer went through io_uring: {stats:?}");
    } else {
        eprintln!("io_uring unavailable here: only the synchronous (bounced) path was checked");
    }
}

#[test]
fn finished_transfers_keep_no_host_memory_alive() {
    // Goal: the region lists the controller keeps for reuse hold no region once their command
    // finished, so host memory freed after its completion is unmapped, as a device that keeps
    // no reference to it would leave it: its IOVA no longer translates. Two reads per doorbell
    // (none is the lone synchronous one), direct where io_uring is there, bounced otherwise.
    use nvme_driver::hw::DmaAllocator;
    let path = std::env::temp_dir().join(format!("nvme-emu-test-{}-recycled", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let config = EmuConfig::default().with_backing(Backing::File { path: path.clone(), create_bytes: Some(1 << 20) });
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 64);
    let mut iovas = Vec::new();
    for round in 0..3u64 {
        let targets = [host.buffer(4096), host.buffer(4096)];
        for (index, target) in targets.iter().enumerate() {
            let read = SubmissionEntry::read(NamespaceId(1), Lba(round * 2 + index as u64), block_count(1));
            TestHost::push(&mut queue, with_sgl(read, target, 4096));
        }
        host.ring_submission(&queue);
        for completion in reap_all(&host, &mut queue, 2) {
            assert_eq!(status_of(&completion), Ok(()));
        }
        iovas.extend(targets.iter().map(DmaRegion::iova));
    }
    let pool = host.device.dma_pool();
    for iova in iovas {
        assert!(pool.translate(iova, 4096).is_err(), "the host freed {iova}, yet the controller keeps it mapped");
    }
    drop(host);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn each_transfer_goes_to_the_kernel_as_it_is_pushed() {
    // Goal: the commands one doorbell brings are each handed to the kernel as they are pushed,
    // not together at the end of the scan (one io_uring_enter per batch made the submissions
    // run back to back while completions waited, and the disk's queue ran short; fio submits
    // each I/O too). Eight reads in one doorbell: eight submissions, all of them through the
    // ring, each read's own bytes.
    let path = std::env::temp_dir().join(format!("nvme-emu-test-{}-submit-each", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let data: Vec<u8> = (0..8u8).flat_map(block).collect();
    std::fs::write(&path, &data).unwrap();
    let config = EmuConfig::default().with_backing(Backing::File { path: path.clone(), create_bytes: None });
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 64);
    let targets: Vec<DmaRegion> = (0..8).map(|_| host.buffer(4096)).collect();
    for (index, target) in targets.iter().enumerate() {
        TestHost::push(&mut queue, with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(index as u64), block_count(1)), target, 4096));
    }
    host.ring_submission(&queue);
    for completion in reap_all(&host, &mut queue, targets.len()) {
        assert_eq!(status_of(&completion), Ok(()));
    }
    for (index, target) in targets.iter().enumerate() {
        let mut back = vec![0u8; 4096];
        target.read(0, &mut back).unwrap();
        assert!(back == block(index as u8), "read {index} came back with other bytes");
    }
    let stats = host.device.stats();
    drop(host);
    let _ = std::fs::remove_file(&path);
    if tutti_uring::available() {
        assert_eq!(stats.batched_reads, 8, "every read went through io_uring: {stats:?}");
        assert_eq!(stats.transfer_submissions, 8, "one submission per transfer, as it was pushed: {stats:?}");
    } else {
        eprintln!("io_uring unavailable here: only the synchronous read path was checked");
    }
}
