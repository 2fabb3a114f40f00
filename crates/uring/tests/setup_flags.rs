//! Rings set up as fio sets up its own (`SetupFlags::FIO`: CQSIZE, COOP_TASKRUN, SINGLE_ISSUER,
//! DEFER_TASKRUN). Completions that arrive later than their submission (a read of a pipe that is
//! written afterwards) reach the completion queue, under DEFER_TASKRUN, only through an
//! `io_uring_enter` with GETEVENTS: these tests use such reads so that a path which forgets it
//! sees nothing. Every test skips, saying so, where the kernel lacks the flags.
use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tutti_uring::{leaked_buffers_total, AlignedBuffer, Direction, Job, Ring, SetupFlags, Transfer, UringError};

/// A ring with every flag fio uses, or `None` (said) where the kernel gives fewer. Asks
/// `available()` first, so that with `TUTTI_REQUIRE_URING=1` a machine without io_uring fails
/// these tests instead of passing them as skipped.
fn fio_ring(entries: u32) -> Option<Ring> {
    if !tutti_uring::available() {
        eprintln!("io_uring with bounded waits is unavailable here: test skipped");
        return None;
    }
    let ring = Ring::with_setup(entries, SetupFlags::FIO).expect("available() found io_uring usable; with_setup drops flags it refuses");
    if ring.setup_flags() != SetupFlags::FIO {
        eprintln!("this kernel sets up only {} of {}: test skipped", ring.setup_flags(), SetupFlags::FIO);
        return None;
    }
    Some(ring)
}

/// Runs `body` on another thread and fails if it has not returned within `limit`.
fn within<T: Send + 'static>(limit: Duration, body: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(body());
    });
    result.recv_timeout(limit).expect("did not return by its deadline: a wait without a bound")
}

/// Reaps without ever waiting in the kernel until a completion shows up or `limit` passes;
/// returns the bytes it read, or `None` if none showed up.
fn poll_reap(ring: &mut Ring, limit: Duration) -> Option<Vec<u8>> {
    let deadline = Instant::now() + limit;
    // Bounded by the deadline.
    while Instant::now() < deadline {
        let mut data = None;
        ring.reap(|completion| {
            completion.check().unwrap();
            data = Some(completion.buffer.bytes(completion.transfer.len_bytes).to_vec());
        })
        .unwrap();
        if data.is_some() {
            return data;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

#[test]
fn a_deferred_ring_sees_completions_without_waiting() {
    // Goal: under DEFER_TASKRUN a completion that arrives after its submission is seen by a
    // non-waiting submit + reap (the bench's polling loop), through reap alone after one submit,
    // and by a cancellation with a deadline of now (how the software controller asks whether an
    // abandoned write came back: the transfer is given back, read or cancelled, not held). Each would see nothing, forever, if the ring did not enter the
    // kernel with GETEVENTS first.
    let Some(ring) = fio_ring(4) else { return };
    let (reader, mut writer) = std::io::pipe().unwrap();
    let outcome = within(Duration::from_secs(30), move || {
        let mut ring = ring;
        let read = Transfer { fd: reader.as_raw_fd(), direction: Direction::Read, offset_bytes: 0, len_bytes: 5 };
        // Submit + reap, non-waiting, in a loop.
        ring.push(read, AlignedBuffer::with_capacity(4096).unwrap(), 1).unwrap();
        ring.submit().unwrap();
        writer.write_all(b"first").unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut first = None;
        while first.is_none() && Instant::now() < deadline {
            ring.submit().unwrap();
            ring.reap(|completion| first = Some(completion.buffer.bytes(5).to_vec())).unwrap();
        }
        // One submit, then reaps only.
        ring.push(read, AlignedBuffer::with_capacity(4096).unwrap(), 2).unwrap();
        ring.submit().unwrap();
        writer.write_all(b"again").unwrap();
        let second = poll_reap(&mut ring, Duration::from_secs(2));
        // A cancellation with a deadline of now after the transfer completed on its own.
        ring.push(read, AlignedBuffer::with_capacity(4096).unwrap(), 3).unwrap();
        ring.submit().unwrap();
        writer.write_all(b"third").unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let mut third = None;
        // The kernel reads the pipe in the deferred work itself, so the cancel (submitted first
        // in the same enter) may still catch the read: either outcome is a transfer given back.
        let held = ring.cancel_in_flight(Instant::now(), |completion| {
            third = Some(completion.result.as_ref().map(|_| completion.buffer.bytes(5).to_vec()).map_err(|error| error.raw_os_error()))
        });
        (first, second, held, third)
    });
    let (first, second, held, third) = outcome;
    assert_eq!(first.as_deref(), Some(&b"first"[..]), "a non-waiting submit + reap never saw the completion");
    assert_eq!(second.as_deref(), Some(&b"again"[..]), "reaping alone never saw the completion");
    assert_eq!(held, 0, "the cancellation did not see that the transfer had completed");
    assert!(matches!(&third, Some(Ok(data)) if data == b"third") || third == Some(Err(Some(libc::ECANCELED))), "{third:?}");
}

#[test]
fn a_stuck_batch_on_a_deferred_ring_is_cancelled_well_before_the_cancel_deadline() {
    // Goal: under DEFER_TASKRUN the cancellation of a batch that ran past its deadline gets its
    // transfers back at once (the cancel's completions are posted when the ring enters with
    // GETEVENTS), not at the end of the cancel timeout with them still held.
    let Some(ring) = fio_ring(4) else { return };
    let (reader, _writer) = std::io::pipe().unwrap();
    let (jobs, held, elapsed) = within(Duration::from_secs(60), move || {
        let mut ring = ring;
        let mut jobs = vec![Job::new(
            Transfer { fd: reader.as_raw_fd(), direction: Direction::Read, offset_bytes: 0, len_bytes: 4096 },
            AlignedBuffer::with_capacity(4096).unwrap(),
        )];
        let started = Instant::now();
        let error = ring.run_batch(&mut jobs, Instant::now() + Duration::from_millis(200), Duration::from_secs(20)).unwrap_err();
        assert!(matches!(error, UringError::Timeout { in_flight: 1, .. }), "{error}");
        (jobs, ring.in_flight(), started.elapsed())
    });
    assert_eq!(held, 0, "the cancelled read was not given back");
    assert!(elapsed < Duration::from_secs(5), "cancellation took {elapsed:?} of its 20 s");
    assert!(
        matches!(&jobs[0].result, Err(UringError::Transfer { source, .. }) if source.raw_os_error() == Some(libc::ECANCELED)),
        "{:?}",
        jobs[0].result
    );
    assert_eq!(jobs[0].buffer.capacity_bytes(), 4096, "the buffer is back");
}

#[test]
fn a_single_issuer_ring_binds_to_its_first_user_and_refuses_other_threads() {
    // Goal: a single-issuer ring made on one thread is used from another (it binds to the first
    // thread that enters it, as the software controller's ring is made by the caller and driven
    // by its own thread); once bound, a submit, wait, reap or cancel from any other thread is a
    // typed refusal rather than the kernel's EEXIST, and a drop there leaks what it holds
    // (counted) instead of freeing memory the kernel may still write.
    let Some(ring) = fio_ring(4) else { return };
    let (reader, mut writer) = std::io::pipe().unwrap();
    let read = Transfer { fd: reader.as_raw_fd(), direction: Direction::Read, offset_bytes: 0, len_bytes: 5 };
    let ring = within(Duration::from_secs(30), move || {
        let mut ring = ring;
        ring.push(read, AlignedBuffer::with_capacity(4096).unwrap(), 1).unwrap();
        ring.submit().unwrap();
        ring
    });
    let mut ring = ring;
    let wrong = |error: UringError| matches!(error, UringError::WrongThread { .. });
    ring.push(read, AlignedBuffer::with_capacity(4096).unwrap(), 2).unwrap();
    assert!(wrong(ring.submit().unwrap_err()), "a submit from another thread");
    assert!(wrong(ring.wait(Instant::now() + Duration::from_secs(1)).unwrap_err()), "a wait from another thread");
    assert!(wrong(ring.reap(drop).unwrap_err()), "a reap from another thread");
    assert_eq!(ring.cancel_in_flight(Instant::now() + Duration::from_secs(1), drop), 2, "a cancel from another thread does nothing");
    writer.write_all(b"hello").unwrap();
    let leaked_before = leaked_buffers_total();
    drop(ring);
    assert_eq!(leaked_buffers_total(), leaked_before + 2, "dropped on another thread: both buffers leaked");
}

#[test]
fn a_plain_ring_is_used_from_any_thread() {
    // Goal: without SINGLE_ISSUER the ring is not bound (a ring moved between threads under a
    // lock, as the software controller's is, keeps working).
    if !tutti_uring::available() {
        eprintln!("io_uring with bounded waits is unavailable here: test skipped");
        return;
    }
    let file = tempfile::tempfile().unwrap();
    let write = Transfer { fd: file.as_raw_fd(), direction: Direction::Write, offset_bytes: 0, len_bytes: 4096 };
    let mut ring = Ring::new(2).unwrap();
    assert_eq!(ring.setup_flags(), SetupFlags::NONE);
    ring.push(write, AlignedBuffer::with_capacity(4096).unwrap(), 1).unwrap();
    ring.submit().unwrap();
    let mut ring = within(Duration::from_secs(30), move || {
        ring.wait(Instant::now() + Duration::from_secs(10)).unwrap();
        ring.push(write, AlignedBuffer::with_capacity(4096).unwrap(), 2).unwrap();
        ring.submit().unwrap();
        ring
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut done = 0;
    while done < 2 && Instant::now() < deadline {
        ring.wait(deadline).unwrap();
        done += ring.reap(|completion| completion.check().unwrap()).unwrap();
    }
    assert_eq!(done, 2);
}
