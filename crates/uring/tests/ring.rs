//! The ring against real files and pipes. Every test checks the kernel first and, where io_uring
//! is unavailable (old kernel, seccomp, container policy), says so and passes without running.
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tutti_uring::{available, AlignedBuffer, Direction, Job, Ring, SetupFlags, Transfer, UringError};

fn skip() -> bool {
    if available() {
        return false;
    }
    eprintln!("io_uring with bounded waits is unavailable here: test skipped");
    true
}

fn patterned(len: usize, seed: u8) -> AlignedBuffer {
    let mut buffer = AlignedBuffer::with_capacity(len).unwrap();
    buffer.slice(len).iter_mut().enumerate().for_each(|(index, byte)| *byte = (index as u8).wrapping_mul(7) ^ seed);
    buffer
}

/// Runs `body` on another thread and fails if it has not returned within `limit`: a wait that
/// ignored its deadline would otherwise hang the test instead of failing it.
fn within<T: Send + 'static>(limit: Duration, body: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(body());
    });
    result.recv_timeout(limit).expect("did not return by its deadline: a wait without a bound")
}

#[test]
fn write_then_read_back_through_the_ring() {
    // Goal: a write and a read round-trip bytes; buffers come back with their tags.
    if skip() {
        return;
    }
    let file = tempfile::tempfile().unwrap();
    let mut ring = Ring::new(4).unwrap();
    let write = Transfer { fd: file.as_raw_fd(), direction: Direction::Write, offset_bytes: 8192, len_bytes: 8192 };
    ring.push(write, patterned(8192, 3), 11).unwrap();
    ring.wait(Instant::now() + Duration::from_secs(10)).unwrap();
    let mut completions = Vec::new();
    ring.reap(|completion| completions.push(completion)).unwrap();
    assert_eq!(completions.len(), 1);
    assert_eq!(completions[0].tag, 11);
    completions[0].check().unwrap();
    let read = Transfer { direction: Direction::Read, ..write };
    ring.push(read, AlignedBuffer::with_capacity(8192).unwrap(), 12).unwrap();
    ring.wait(Instant::now() + Duration::from_secs(10)).unwrap();
    let mut back = None;
    ring.reap(|completion| back = Some(completion)).unwrap();
    let back = back.unwrap();
    back.check().unwrap();
    assert_eq!(back.buffer.bytes(8192), patterned(8192, 3).bytes(8192));
    // Past the end of the file: a short read, reported as such.
    let past = Transfer { offset_bytes: 12288, ..read };
    ring.push(past, back.buffer, 13).unwrap();
    ring.wait(Instant::now() + Duration::from_secs(10)).unwrap();
    ring.reap(|completion| {
        assert!(matches!(completion.check(), Err(UringError::ShortTransfer { done_bytes: 4096, len_bytes: 8192, .. })));
    })
    .unwrap();
    assert_eq!(ring.in_flight(), 0);
}

#[test]
fn push_refuses_what_it_cannot_take_and_hands_the_buffer_back() {
    // Goal: a full ring and a buffer too small are typed refusals that return the buffer.
    if skip() {
        return;
    }
    let (reader, _writer) = std::io::pipe().unwrap();
    let mut ring = Ring::new(2).unwrap();
    let read = Transfer { fd: reader.as_raw_fd(), direction: Direction::Read, offset_bytes: 0, len_bytes: 4096 };
    let small = ring.push(Transfer { len_bytes: 8192, ..read }, AlignedBuffer::with_capacity(4096).unwrap(), 0).unwrap_err();
    assert!(matches!(small.error, UringError::BufferTooSmall { len_bytes: 8192, capacity_bytes: 4096 }));
    assert_eq!(small.buffer.capacity_bytes(), 4096);
    ring.push(read, AlignedBuffer::with_capacity(4096).unwrap(), 1).unwrap();
    ring.push(read, AlignedBuffer::with_capacity(4096).unwrap(), 2).unwrap();
    let full = ring.push(read, AlignedBuffer::with_capacity(4096).unwrap(), 3).unwrap_err();
    assert!(matches!(full.error, UringError::Full { capacity: 2 }));
    ring.abandon(&UringError::Abandoned { cause: "test over".into() });
}

/// 2 GiB + 4 KiB: fits io_uring's u32 length but is more than the kernel's `MAX_RW_COUNT`
/// (0x7ffff000 with 4 KiB pages), so the kernel would move only part of it.
const PAST_MAX_RW_COUNT_BYTES: usize = (2 << 30) + 4096;

#[test]
fn a_transfer_longer_than_one_kernel_write_is_refused_before_it_is_queued() {
    // Goal: a 2 GiB + 4 KiB write (under io_uring's 4 GiB length field, over the kernel's
    // MAX_RW_COUNT) is refused at push, through both push paths, rather than queued to complete
    // short as "past the end of the file". The memory is never touched: push refuses on length
    // first (an empty buffer), and the regions are 513 clones of one 4 MiB region.
    if skip() {
        return;
    }
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null").unwrap();
    let write = Transfer { fd: null.as_raw_fd(), direction: Direction::Write, offset_bytes: 0, len_bytes: PAST_MAX_RW_COUNT_BYTES };
    let mut ring = Ring::new(2).unwrap();
    let refused = ring.push(write, AlignedBuffer::default(), 0).unwrap_err();
    assert!(matches!(refused.error, UringError::TransferTooLarge { len_bytes: PAST_MAX_RW_COUNT_BYTES, .. }), "{:?}", refused.error);
    assert!(refused.error.to_string().contains("MAX_RW_COUNT"), "{}", refused.error);

    use nvme_driver::hw::{DmaAllocator, DmaPool};
    let region = DmaPool::identity().allocate(4 << 20).unwrap();
    let regions = vec![region; 513];
    let len_bytes = regions.iter().map(|region| region.len()).sum();
    assert!(len_bytes > PAST_MAX_RW_COUNT_BYTES && u32::try_from(len_bytes).is_ok());
    let refused = ring.push_regions(Transfer { len_bytes, ..write }, regions, 1).unwrap_err();
    assert!(matches!(refused.error, UringError::TransferTooLarge { .. }), "{:?}", refused.error);
    assert_eq!(refused.regions.len(), 513, "the regions come back");
    assert_eq!(ring.in_flight(), 0);
}

#[test]
fn a_wait_ends_at_its_deadline_and_the_transfer_can_still_complete() {
    // Goal: waiting on a transfer that does not complete (a read of an empty pipe) returns
    // Timeout at the deadline, not never; the transfer stays owned by the ring and completes
    // once data arrives, handing its buffer back with the data.
    if skip() {
        return;
    }
    let (reader, mut writer) = std::io::pipe().unwrap();
    // All on one thread: the kernel cancels the transfers a thread submitted when it exits.
    let data = within(Duration::from_secs(20), move || {
        let mut ring = Ring::new(2).unwrap();
        let read = Transfer { fd: reader.as_raw_fd(), direction: Direction::Read, offset_bytes: 0, len_bytes: 5 };
        ring.push(read, AlignedBuffer::with_capacity(4096).unwrap(), 7).unwrap();
        let started = Instant::now();
        let error = ring.wait(Instant::now() + Duration::from_millis(200)).unwrap_err();
        assert!(matches!(error, UringError::Timeout { in_flight: 1, .. }), "{error}");
        assert!(started.elapsed() >= Duration::from_millis(150) && started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
        writer.write_all(b"hello").unwrap();
        ring.wait(Instant::now() + Duration::from_secs(10)).unwrap();
        let mut data = Vec::new();
        ring.reap(|completion| {
            completion.check().unwrap();
            data.extend_from_slice(completion.buffer.bytes(5));
        })
        .unwrap();
        data
    });
    assert_eq!(data, b"hello");
}

#[test]
fn a_wait_past_its_deadline_still_submits_what_is_queued() {
    // Goal: Ring::wait submits queued entries even when its deadline has already passed (its
    // documented promise): a read of an empty pipe, pushed, then waited on with a deadline in
    // the past, reaches the kernel (exactly Timeout, the read in flight: nothing can complete
    // it yet) and completes once data arrives, so a later reap (with no submit in between)
    // gets it back. Before 0c215f8 such a wait returned Timeout with the read still queued,
    // never submitted. Both with and without DEFER_TASKRUN (whose submit is a GETEVENTS enter).
    if skip() {
        return;
    }
    for flags in [SetupFlags::NONE, SetupFlags::DEFERRED_TASK_RUN] {
        let (reader, mut writer) = std::io::pipe().unwrap();
        let mut ring = Ring::with_setup(2, flags).unwrap();
        let read = Transfer { fd: reader.as_raw_fd(), direction: Direction::Read, offset_bytes: 0, len_bytes: 5 };
        ring.push(read, AlignedBuffer::with_capacity(4096).unwrap(), 21).unwrap();
        let past = Instant::now().checked_sub(Duration::from_millis(1)).unwrap();
        match ring.wait(past) {
            Err(UringError::Timeout { in_flight: 1, .. }) => {}
            other => panic!("{flags:?}: a wait past its deadline on a read with no data: {other:?}"),
        }
        writer.write_all(b"hello").unwrap();
        let mut completions = Vec::new();
        // Bounded: reaped, or the check below fails after 5 s.
        let deadline = Instant::now() + Duration::from_secs(5);
        while completions.is_empty() && Instant::now() < deadline {
            ring.reap(|completion| completions.push(completion)).unwrap();
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(completions.len(), 1, "{flags:?}: the read was never submitted");
        assert_eq!(completions[0].tag, 21);
        completions[0].check().unwrap();
        assert_eq!(completions[0].buffer.bytes(5), b"hello");
    }
}

#[test]
fn a_wait_past_its_deadline_reports_a_completion_its_own_submit_posted() {
    // Goal: a wait whose deadline has passed returns Ok, not Timeout, when the submit it makes
    // completed a transfer: a write into a pipe with room (non-blocking, so the kernel finishes
    // it inside io_uring_enter, never in a worker) is in the completion queue when the wait
    // returns, and the very next reap, which enters the kernel no more (see `events_posted`),
    // hands it back. Until 2026-12-01 (85ec068) the wait returned Timeout without looking at
    // the completion queue after its submit.
    if skip() {
        return;
    }
    for flags in [SetupFlags::NONE, SetupFlags::DEFERRED_TASK_RUN] {
        let (mut reader, writer) = std::io::pipe().unwrap();
        let writer = std::fs::File::from(std::os::fd::OwnedFd::from(writer));
        set_nonblocking(&writer);
        let mut ring = Ring::with_setup(2, flags).unwrap();
        let write = Transfer { fd: writer.as_raw_fd(), direction: Direction::Write, offset_bytes: 0, len_bytes: 4096 };
        ring.push(write, patterned(4096, 5), 22).unwrap();
        let past = Instant::now().checked_sub(Duration::from_millis(1)).unwrap();
        match ring.wait(past) {
            Ok(()) => {}
            other => panic!("{flags:?}: a wait past its deadline whose submit completed a write: {other:?}"),
        }
        let mut completions = Vec::new();
        ring.reap(|completion| completions.push(completion)).unwrap();
        assert_eq!(completions.len(), 1, "{flags:?}: the wait said a completion was ready");
        assert_eq!(completions[0].tag, 22);
        completions[0].check().unwrap();
        let mut landed = vec![0u8; 4096];
        reader.read_exact(&mut landed).unwrap();
        assert_eq!(landed, patterned(4096, 5).bytes(4096));
    }
}

#[test]
fn a_batch_larger_than_the_ring_runs_every_job() {
    // Goal: run_batch keeps at most the ring's capacity in flight and finishes every job.
    if skip() {
        return;
    }
    let file = tempfile::tempfile().unwrap();
    let mut ring = Ring::new(4).unwrap();
    let jobs_count = 19;
    let transfer =
        |index: usize, direction| Transfer { fd: file.as_raw_fd(), direction, offset_bytes: index as u64 * 4096, len_bytes: 4096 };
    let mut writes: Vec<Job> =
        (0..jobs_count).map(|index| Job::new(transfer(index, Direction::Write), patterned(4096, index as u8))).collect();
    ring.run_batch(&mut writes, Instant::now() + Duration::from_secs(20), Duration::from_secs(5)).unwrap();
    assert!(writes.iter().all(|job| job.result.is_ok()));
    let mut reads: Vec<Job> = (0..jobs_count).map(|index| Job::new(transfer(index, Direction::Read), AlignedBuffer::default())).collect();
    // Buffers too small are refused per job, not for the batch.
    ring.run_batch(&mut reads, Instant::now() + Duration::from_secs(20), Duration::from_secs(5)).unwrap();
    assert!(reads.iter().all(|job| matches!(job.result, Err(UringError::BufferTooSmall { .. }))));
    for job in &mut reads {
        job.buffer = AlignedBuffer::with_capacity(4096).unwrap();
    }
    ring.run_batch(&mut reads, Instant::now() + Duration::from_secs(20), Duration::from_secs(5)).unwrap();
    for (index, job) in reads.iter().enumerate() {
        assert!(job.result.is_ok(), "{:?}", job.result);
        assert_eq!(job.buffer.bytes(4096), patterned(4096, index as u8).bytes(4096), "job {index}");
    }
}

#[test]
fn a_stuck_batch_times_out_and_its_cancelled_write_never_lands() {
    // Goal: a batch with transfers that never complete (a write into a full pipe nobody reads,
    // a read of an empty pipe) returns Timeout by its deadline instead of hanging; the finished
    // job keeps its result; the stuck ones are cancelled and given back (buffers and data
    // included, nothing left in flight to leak), so a synchronous retry is safe: once the pipe
    // drains, the abandoned write does not land after all. Without the cancellation it did:
    // the kernel kept the write and completed it whenever the pipe had room.
    if skip() {
        return;
    }
    let file = tempfile::tempfile().unwrap();
    let (empty_reader, _empty_writer) = std::io::pipe().unwrap();
    let (full_reader, full_writer) = std::io::pipe().unwrap();
    let fd = full_writer.as_raw_fd();
    let pipe_bytes = fill_pipe(&full_writer);
    let jobs = within(Duration::from_secs(30), move || {
        let mut ring = Ring::new(4).unwrap();
        let mut jobs = vec![
            Job::new(Transfer { fd: file.as_raw_fd(), direction: Direction::Write, offset_bytes: 0, len_bytes: 4096 }, patterned(4096, 1)),
            Job::new(Transfer { fd, direction: Direction::Write, offset_bytes: 0, len_bytes: 4096 }, patterned(4096, 2)),
            Job::new(
                Transfer { fd: empty_reader.as_raw_fd(), direction: Direction::Read, offset_bytes: 0, len_bytes: 4096 },
                AlignedBuffer::with_capacity(4096).unwrap(),
            ),
        ];
        let started = Instant::now();
        let error = ring.run_batch(&mut jobs, Instant::now() + Duration::from_millis(300), Duration::from_secs(5)).unwrap_err();
        assert!(matches!(error, UringError::Timeout { in_flight: 2, .. }), "{error}");
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(ring.is_abandoned());
        assert_eq!(ring.in_flight(), 0, "every stuck transfer was given back");
        assert!(matches!(ring.wait(Instant::now()), Err(UringError::Abandoned { .. })), "an abandoned ring is never used again");
        // The ring (and this thread) stay alive while the pipe drains: a write the kernel still
        // held would land now.
        let drained = drain(&full_reader);
        std::thread::sleep(Duration::from_millis(200));
        let late = drain(&full_reader);
        drop(ring);
        drop(empty_reader);
        drop(full_writer);
        (jobs, drained, late)
    });
    let (jobs, drained, late) = jobs;
    assert!(jobs[0].result.is_ok(), "{:?}", jobs[0].result);
    let cancelled = |result: &Result<(), UringError>| matches!(result, Err(UringError::Transfer { source, .. }) if source.raw_os_error() == Some(libc::ECANCELED));
    assert!(cancelled(&jobs[1].result), "{:?}", jobs[1].result);
    assert_eq!(jobs[1].buffer.bytes(4096), patterned(4096, 2).bytes(4096), "the cancelled write's buffer is back, for a retry");
    assert!(cancelled(&jobs[2].result), "{:?}", jobs[2].result);
    assert_eq!(drained, pipe_bytes, "the pipe held only what filled it");
    assert_eq!(late, 0, "the abandoned write landed after its batch had returned");
}

/// Writes into the pipe until it is full (non-blocking, so the filling itself cannot block);
/// returns the bytes it holds. The flag is on the shared open file, so the ring's writes see
/// a full pipe too (io_uring waits for room rather than failing with EAGAIN).
fn fill_pipe(writer: &std::io::PipeWriter) -> usize {
    let mut filler = std::fs::File::from(std::os::fd::OwnedFd::from(writer.try_clone().unwrap()));
    set_nonblocking(&filler);
    let chunk = [0u8; 4096];
    let mut total = 0usize;
    while let Ok(written) = filler.write(&chunk) {
        total += written;
    }
    assert!(total > 0);
    total
}

/// Reads whatever the pipe holds now, without blocking; returns the byte count.
fn drain(reader: &std::io::PipeReader) -> usize {
    let mut reader = std::fs::File::from(std::os::fd::OwnedFd::from(reader.try_clone().unwrap()));
    set_nonblocking(&reader);
    let mut chunk = [0u8; 4096];
    let mut total = 0usize;
    while let Ok(read) = reader.read(&mut chunk) {
        if read == 0 {
            break;
        }
        total += read;
    }
    total
}

fn set_nonblocking(file: &std::fs::File) {
    // std has no portable setter; the fcntl wrapper lives in libc, used only here in tests.
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own; no memory is passed.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

#[test]
fn an_offset_past_what_the_kernel_takes_is_refused_at_push() {
    // Goal: an offset is a file position (the kernel's loff_t, signed): u64::MAX reads as -1,
    // "the file's current position", and an offset above i64::MAX, or whose end overflows it,
    // is no position at all. Such a transfer is refused at push, handing the buffer back,
    // instead of moving bytes at the wrong place. The largest valid one is still taken.
    if skip() {
        return;
    }
    let file = tempfile::tempfile().unwrap();
    let mut ring = Ring::new(4).unwrap();
    let read = |offset_bytes| Transfer { fd: file.as_raw_fd(), direction: Direction::Read, offset_bytes, len_bytes: 4096 };
    for offset in [u64::MAX, i64::MAX as u64 + 1, i64::MAX as u64 - 4095] {
        let refused = ring.push(read(offset), AlignedBuffer::with_capacity(4096).unwrap(), 1).expect_err("refused");
        assert!(matches!(refused.error, UringError::BadOffset { .. }), "{offset:#x}: {}", refused.error);
        assert_eq!(refused.buffer.capacity_bytes(), 4096, "the buffer comes back");
    }
    assert_eq!(ring.in_flight(), 0);
    ring.push(read(i64::MAX as u64 - 4096), AlignedBuffer::with_capacity(4096).unwrap(), 2).expect("the last whole position is taken");
    ring.wait(Instant::now() + Duration::from_secs(10)).unwrap();
    ring.reap(|_| {}).unwrap();
}
