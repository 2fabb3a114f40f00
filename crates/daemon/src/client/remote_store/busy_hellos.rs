//! `hello_asking_again_while_busy` against a stand-in daemon that answers Busy: what the
//! daemon sees of the store's retries (each refused connection closed before the pause), and
//! what the store reports when its last try runs out of time (the last Busy).

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::thread;

use super::*;
use crate::frame_io::{read_frame, write_frame, ReadOutcome};

/// A fresh directory for a stand-in daemon's socket, and the socket's path in it.
fn socket_in(name: &str) -> (PathBuf, PathBuf) {
    let directory = std::env::temp_dir().join(format!("tutti-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    let socket = directory.join("socket");
    (directory, socket)
}

fn hello() -> Hello {
    Hello { model_fingerprint: [0x5a; 32], tp_rank: 0, tp_world: 1, client_name: "busy".into() }
}

/// Reads one frame on `stream` (a Hello), waiting up to 5 s for it.
fn read_hello(stream: &UnixStream) -> crate::protocol::FrameHeader {
    stream.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
    stream.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let (mut body, mut fds) = (Vec::new(), Vec::new());
    match read_frame(stream, &mut body, &mut fds, Instant::now() + Duration::from_secs(5), Duration::from_secs(5), &|| false) {
        Ok(ReadOutcome::Frame(header)) => {
            assert_eq!(header.kind, Kind::Hello);
            header
        }
        other => panic!("expected a Hello, got {other:?}"),
    }
}

/// Answers the frame `header` names with Busy, as the daemon's status-only connection does.
fn answer_busy(stream: &UnixStream, header: &crate::protocol::FrameHeader) {
    let busy = Reply::error(ErrorCode::Busy, "tuttid serves its maximum number of connections; retry later");
    let mut frame = Vec::new();
    crate::protocol::encode_frame(&mut frame, busy.kind(), header.request_id, |out| busy.encode_body(out)).unwrap();
    write_frame(stream, &frame).unwrap();
}

#[test]
fn a_hello_answered_busy_closes_its_connection_before_the_pause() {
    // Goal: a Hello past the cap is answered Busy on the daemon's one status-only connection,
    // which the daemon keeps open; a store that kept the refused connection through its pause
    // (20 ms doubling to 500 ms) held that place for most of each cycle, so `tuttid --status`
    // (which does not ask again) was refused exactly when the place is there for it. The store
    // closes it as soon as the Busy is read (docs/tuttid.md: "the library closes on a refused
    // Hello"): the stand-in daemon sees each connection's end well within the pause after it
    // (pauses 160, 320, 500 and 500 ms after the 4th to 7th Busy).
    const BUSIES: usize = 7;
    // Judged on the 5th to 7th Busy only, whose pauses (320, 500, 500 ms) a connection kept
    // through them would outlast: 250 ms leaves a loaded machine room to schedule the store.
    const CLOSED_WITHIN: Duration = Duration::from_millis(250);
    const JUDGED_FROM: usize = 4;
    let (directory, socket) = socket_in("busy-hello-closes");
    let listener = UnixListener::bind(&socket).unwrap();
    let daemon = thread::spawn(move || {
        let mut closed_after = Vec::new();
        for _ in 0..BUSIES {
            let (stream, _) = listener.accept().unwrap();
            let header = read_hello(&stream);
            answer_busy(&stream, &header);
            let answered = Instant::now();
            let (mut body, mut fds) = (Vec::new(), Vec::new());
            let outcome = read_frame(&stream, &mut body, &mut fds, answered + Duration::from_secs(2), Duration::from_secs(2), &|| false);
            assert!(matches!(outcome, Ok(ReadOutcome::Closed)), "{outcome:?}");
            closed_after.push(answered.elapsed());
        }
        // The listener goes with this thread: the store's next connect is refused, and it
        // stops asking.
        closed_after
    });
    let failed = hello_asking_again_while_busy(&socket, &hello(), Duration::from_secs(20)).err();
    let closed_after = daemon.join().unwrap();
    std::fs::remove_dir_all(&directory).unwrap();
    assert!(failed.is_some(), "no daemon left to answer");
    for (busy, after) in closed_after.iter().enumerate().skip(JUDGED_FROM) {
        assert!(*after < CLOSED_WITHIN, "the connection refused by Busy {} was closed {after:?} after it: {closed_after:?}", busy + 1);
    }
}

#[test]
fn a_try_that_runs_out_of_time_after_a_busy_reports_the_busy() {
    // Goal: the docs promise the last Busy once the timeout has passed. The try after the last
    // pause may start with only milliseconds left (the pause is taken whenever it ends before
    // the deadline); its Hello then times out, and the store reported TimedOut, a daemon that
    // does not answer, instead of the daemon that is full. Timeout 2.5 s: the first Hello is
    // answered Busy 400 ms before the deadline, the second (asked about 20 ms later) not
    // within the rest. That second connection must have been made: else the store gave up
    // after the Busy itself (its pause past the deadline), not on the try that timed out.
    let timeout = Duration::from_millis(2500);
    let (directory, socket) = socket_in("busy-hello-last");
    let listener = UnixListener::bind(&socket).unwrap();
    let started = Instant::now();
    let daemon = thread::spawn(move || {
        let first = accept_within(&listener, timeout).expect("the store's first connection");
        let header = read_hello(&first);
        thread::sleep((started + timeout - Duration::from_millis(400)).saturating_duration_since(Instant::now()));
        answer_busy(&first, &header);
        let second = accept_within(&listener, timeout);
        if let Some(second) = &second {
            let header = read_hello(second);
            // Answered well after the store's deadline: it has given up by then.
            thread::sleep((started + timeout + Duration::from_millis(600)).saturating_duration_since(Instant::now()));
            let _ = answer_busy_late(second, &header);
        }
        (first, second)
    });
    let failed = hello_asking_again_while_busy(&socket, &hello(), timeout).err();
    let elapsed = started.elapsed();
    let (_first, second) = daemon.join().unwrap();
    std::fs::remove_dir_all(&directory).unwrap();
    assert!(second.is_some(), "the store did not ask again after the Busy: {failed:?}");
    match failed {
        Some(ObjstoreError::RemoteFailed { failure: RemoteFailure::Refused { code }, reason }) => {
            assert_eq!(code, ErrorCode::Busy.to_u16(), "{reason}");
            assert!(reason.contains("Busy 1 time(s)"), "{reason}");
        }
        other => panic!("expected the last Busy, got {other:?}"),
    }
    assert!(elapsed < timeout + Duration::from_millis(500), "{elapsed:?}");
}

/// The next connection on `listener` within `wait`; None if none came.
fn accept_within(listener: &UnixListener, wait: Duration) -> Option<UnixStream> {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + wait;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).unwrap();
                return Some(stream);
            }
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(2))
            }
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => return None,
            Err(error) => panic!("accepting the store's connection: {error}"),
        }
    }
}

/// [`answer_busy`] on a connection the store may have closed already.
fn answer_busy_late(stream: &UnixStream, header: &crate::protocol::FrameHeader) -> Result<(), DaemonError> {
    let busy = Reply::error(ErrorCode::Busy, "late");
    let mut frame = Vec::new();
    crate::protocol::encode_frame(&mut frame, busy.kind(), header.request_id, |out| busy.encode_body(out)).unwrap();
    write_frame(stream, &frame)
}
