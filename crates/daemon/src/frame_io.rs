//! Frames on a stream socket, with deadlines: nothing here waits without a bound, and nothing
//! is allocated beyond one body of at most `BODY_BYTES_MAX` (the caller's buffer, reused).
//!
//! The socket must have a read timeout (the *tick*, e.g. 50 ms): each timed-out read is a chance
//! to check the deadlines and the caller's stop flag; a frame's deadline is checked after every
//! read too, so bytes trickled faster than the tick do not stretch it. Its write timeout is the
//! budget of a whole frame's write. The `_by` functions take one deadline instead, for a
//! caller (the client) that bounds a request's write and its reply's read together.

use std::io::{ErrorKind, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::fd_passing::{recv_with_fds, send_with_fds};
use crate::protocol::{FrameHeader, HEADER_BYTES};
use crate::DaemonError;

/// The longest wait a deadline here (or a client's) is computed for: a day, longer than any
/// caller means, and short enough that `Instant::now()` plus it is representable.
pub const WAIT_MAX: Duration = Duration::from_secs(86_400);

/// `start + wait`, `wait` capped at [`WAIT_MAX`]: a caller's "for ever" (`Duration::MAX`) must
/// not overflow `Instant`, which panics.
pub fn deadline_after(start: Instant, wait: Duration) -> Instant {
    // A day past an instant of a running system is representable; were it not, the wait ends
    // at once (`start`) rather than the process panicking.
    start.checked_add(wait.min(WAIT_MAX)).unwrap_or(start)
}

/// How a read ended when it did not produce a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOutcome {
    Frame(FrameHeader),
    /// The peer closed the connection between frames.
    Closed,
    /// No frame began before `idle_until`.
    Idle,
    /// `stop` said so, between frames (a frame once begun is read to its end or its timeout).
    Stopped,
}

/// Reads one frame: its header into `header` and its body into `body` (cleared, resized to the
/// body), and the descriptors sent with it into `fds` (cleared first; see [`crate::fd_passing`]).
/// A frame must complete within `frame_timeout` of its first byte; a peer that closes
/// mid-frame is [`DaemonError::Truncated`]; a header this protocol refuses is
/// [`DaemonError::Protocol`] (the body is then not read).
pub fn read_frame(
    stream: &UnixStream,
    body: &mut Vec<u8>,
    fds: &mut Vec<OwnedFd>,
    idle_until: Instant,
    frame_timeout: Duration,
    stop: &dyn Fn() -> bool,
) -> Result<ReadOutcome, DaemonError> {
    read_frame_capped(stream, body, fds, idle_until, frame_timeout, None, stop)
}

/// Reads one frame as [`read_frame`] does, all of it by `deadline`: no frame begun by then is
/// [`ReadOutcome::Idle`], and one begun must end by then too, however late its first byte came
/// (what a client's call, bounded as a whole, waits for). `budget` is the wait the deadline
/// stands for, for the timeout's message. Like every wait here, it may overrun `deadline` by
/// up to one read tick (a read that finds nothing waits the tick before the deadline is
/// checked).
pub fn read_frame_by(
    stream: &UnixStream,
    body: &mut Vec<u8>,
    fds: &mut Vec<OwnedFd>,
    deadline: Instant,
    budget: Duration,
) -> Result<ReadOutcome, DaemonError> {
    let never = || false;
    read_frame_capped(stream, body, fds, deadline, budget, Some(deadline), &never)
}

/// [`read_frame`], the frame's deadline (`frame_timeout` from its first byte) brought forward
/// to `latest` where that is sooner.
fn read_frame_capped(
    stream: &UnixStream,
    body: &mut Vec<u8>,
    fds: &mut Vec<OwnedFd>,
    idle_until: Instant,
    frame_timeout: Duration,
    latest: Option<Instant>,
    stop: &dyn Fn() -> bool,
) -> Result<ReadOutcome, DaemonError> {
    let frame_deadline_from = |first_byte: Instant| {
        let deadline = deadline_after(first_byte, frame_timeout);
        latest.map_or(deadline, |latest| deadline.min(latest))
    };
    let mut header = [0u8; HEADER_BYTES];
    let mut filled = 0;
    let mut frame_deadline = None;
    fds.clear();
    while filled < HEADER_BYTES {
        match recv_with_fds(stream, &mut header[filled..], fds) {
            Ok(0) if filled == 0 => return Ok(ReadOutcome::Closed),
            Ok(0) => return Err(DaemonError::Truncated { received: filled, expected: HEADER_BYTES }),
            Ok(count) => {
                filled += count;
                let deadline = *frame_deadline.get_or_insert_with(|| frame_deadline_from(Instant::now()));
                // Checked after every read, not only when one times out: a peer trickling a
                // byte per tick never lets a read time out, and would hold the connection
                // (and a drain that joins it) for as long as it likes.
                if filled < HEADER_BYTES && Instant::now() >= deadline {
                    return Err(frame_timed_out(frame_timeout));
                }
            }
            Err(error) if is_tick(&error) => match frame_deadline {
                None if stop() => return Ok(ReadOutcome::Stopped),
                None if Instant::now() >= idle_until => return Ok(ReadOutcome::Idle),
                None => {}
                Some(deadline) if Instant::now() >= deadline => return Err(frame_timed_out(frame_timeout)),
                Some(_) => {}
            },
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(source) if source.kind() == ErrorKind::InvalidData => {
                // Descriptors refused: the frame's bytes may have been taken; out of step.
                return Err(DaemonError::Io { context: "receiving a frame's descriptors".into(), source });
            }
            Err(source) => return Err(DaemonError::Io { context: "reading a frame header".into(), source }),
        }
    }
    let header = FrameHeader::decode(&header)?;
    let deadline = frame_deadline.unwrap_or_else(|| frame_deadline_from(Instant::now()));
    body.clear();
    body.resize(header.body_bytes as usize, 0);
    let mut filled = 0;
    let mut reader = stream;
    while filled < body.len() {
        match reader.read(&mut body[filled..]) {
            Ok(0) => return Err(DaemonError::Truncated { received: HEADER_BYTES + filled, expected: HEADER_BYTES + body.len() }),
            // The deadline is checked after a read that made progress too (see the header).
            Ok(count) => {
                filled += count;
                if filled < body.len() && Instant::now() >= deadline {
                    return Err(frame_timed_out(frame_timeout));
                }
            }
            Err(error) if is_tick(&error) => {
                if Instant::now() >= deadline {
                    return Err(frame_timed_out(frame_timeout));
                }
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(source) => return Err(DaemonError::Io { context: "reading a frame body".into(), source }),
        }
    }
    Ok(ReadOutcome::Frame(header))
}

/// Writes a whole encoded frame. The socket's write timeout is the budget of the whole frame,
/// not of each `send`: a peer that does not read, or reads so slowly that every `send` makes a
/// little progress, is a [`DaemonError::Timeout`] once it is spent. Each `send` takes what fits
/// without waiting (`MSG_DONTWAIT`; one blocking `send` of a large frame waits a whole timeout
/// per chunk of room, without end for a trickling reader) and the waits for room are `poll`s
/// bounded by what is left of the budget. A socket without a write timeout has no budget.
pub fn write_frame(stream: &UnixStream, frame: &[u8]) -> Result<(), DaemonError> {
    write_frame_with_fds(stream, frame, &[])
}

/// Writes a whole encoded frame with `fds` attached to its first byte (at most
/// [`crate::fd_passing::FDS_PER_FRAME_MAX`]), within the budget [`write_frame`] describes.
pub fn write_frame_with_fds(stream: &UnixStream, frame: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), DaemonError> {
    let budget =
        stream.write_timeout().map_err(|source| DaemonError::Io { context: "reading the socket's write timeout".into(), source })?;
    let deadline = budget.map(|budget| deadline_after(Instant::now(), budget));
    write_frame_until(stream, frame, fds, deadline, budget, false).map(drop)
}

/// How a client's write of a request ended when it did not fail. Must be looked at: a caller
/// that only propagates the error would take a frame cut short ([`Written::PeerSpoke`]) for
/// one sent whole, and read the next frame as the reply to a request the daemon never got.
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// # use std::os::unix::net::UnixStream;
/// # use std::time::{Duration, Instant};
/// # use tutti_daemon::{frame_io::write_frame_with_fds_by, DaemonError};
/// fn send(stream: &UnixStream, frame: &[u8]) -> Result<(), DaemonError> {
///     write_frame_with_fds_by(stream, frame, &[], Instant::now(), Duration::ZERO)?;
///     Ok(())
/// }
/// ```
///
/// ```no_run
/// #![deny(unused_must_use)]
/// # use std::os::unix::net::UnixStream;
/// # use std::time::{Duration, Instant};
/// # use tutti_daemon::{frame_io::{write_frame_with_fds_by, Written}, DaemonError};
/// fn send(stream: &UnixStream, frame: &[u8]) -> Result<bool, DaemonError> {
///     let written = write_frame_with_fds_by(stream, frame, &[], Instant::now(), Duration::ZERO)?;
///     Ok(written == Written::Whole)
/// }
/// ```
#[must_use = "a PeerSpoke write sent only part of the frame: read the peer's goodbye, not a reply"]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// The whole frame was sent.
    Whole,
    /// The peer had something to read (or closed its side) while the frame waited for room,
    /// `sent` bytes of it sent: the rest was not written. A daemon answers a request only once
    /// it has read all of it, so what is there is its goodbye (an `Error` under id 0, then its
    /// write side shut) while it drains what is still sent slowly: read it rather than wait for
    /// room until the deadline.
    PeerSpoke { sent: usize },
}

/// Writes a whole encoded frame with `fds` as [`write_frame_with_fds`] does, by `deadline`
/// rather than within the socket's write timeout (a client's call, whose write and reply share
/// one deadline). `budget` is the wait the deadline stands for, for the timeout's message.
/// While it waits for room it also watches for something to read, and stops writing when
/// there is ([`Written::PeerSpoke`]).
pub fn write_frame_with_fds_by(
    stream: &UnixStream,
    frame: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Instant,
    budget: Duration,
) -> Result<Written, DaemonError> {
    write_frame_until(stream, frame, fds, Some(deadline), Some(budget), true)
}

fn write_frame_until(
    stream: &UnixStream,
    frame: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Option<Instant>,
    budget: Option<Duration>,
    until_readable: bool,
) -> Result<Written, DaemonError> {
    let mut sent = 0;
    while sent < frame.len() {
        // The descriptors ride on the first byte only.
        let attached = if sent == 0 { fds } else { &[] };
        match send_with_fds(stream, &frame[sent..], attached) {
            Ok(0) => {
                return Err(DaemonError::Io {
                    context: format!("writing a frame ({sent} of {} bytes sent)", frame.len()),
                    source: std::io::Error::from(ErrorKind::WriteZero),
                })
            }
            Ok(count) => sent += count,
            Err(error) if is_tick(&error) => {
                if wait_for_room(stream, deadline, budget, sent, frame.len(), until_readable)? == Room::Readable {
                    return Ok(Written::PeerSpoke { sent });
                }
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if matches!(error.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => return Err(DaemonError::Closed),
            Err(source) => return Err(DaemonError::Io { context: "writing a frame".into(), source }),
        }
    }
    Ok(Written::Whole)
}

/// What [`wait_for_room`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Room {
    /// Room to send, or the peer closed or failed (the next send says which).
    Writable,
    /// Something to read (only when asked to watch for it).
    Readable,
}

/// Waits until the socket has room to send, at most until `deadline` (`None`: no bound), or,
/// with `until_readable`, until it has something to read.
fn wait_for_room(
    stream: &UnixStream,
    deadline: Option<Instant>,
    budget: Option<Duration>,
    sent: usize,
    frame_bytes: usize,
    until_readable: bool,
) -> Result<Room, DaemonError> {
    let events = if until_readable { PollFlags::POLLOUT | PollFlags::POLLIN } else { PollFlags::POLLOUT };
    loop {
        let timeout = match deadline {
            None => PollTimeout::NONE,
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(DaemonError::Timeout {
                        what: format!("writing a frame ({sent} of {frame_bytes} bytes sent; the peer does not read it in time)"),
                        after_ms: budget.map_or(0, |budget| budget.as_millis() as u64),
                    });
                }
                // Rounded up, so that a wait under a millisecond is not a busy loop of zero waits.
                PollTimeout::try_from(left.as_micros().div_ceil(1000)).unwrap_or(PollTimeout::MAX)
            }
        };
        let mut polled = [PollFd::new(stream.as_fd(), events)];
        match poll(&mut polled, timeout) {
            Ok(ready) if ready > 0 => {
                let readable = polled[0].revents().is_some_and(|revents| revents.contains(PollFlags::POLLIN));
                return Ok(if until_readable && readable { Room::Readable } else { Room::Writable });
            }
            Ok(_) | Err(Errno::EINTR) => {}
            Err(errno) => return Err(DaemonError::Io { context: "waiting to write a frame".into(), source: std::io::Error::from(errno) }),
        }
    }
}

fn is_tick(error: &std::io::Error) -> bool {
    matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

fn frame_timed_out(frame_timeout: Duration) -> DaemonError {
    DaemonError::Timeout { what: "the rest of a frame".into(), after_ms: frame_timeout.as_millis() as u64 }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::thread;

    use super::*;
    use crate::protocol::{encode_frame, encode_lookup_body, Kind};

    #[test]
    fn a_wait_of_duration_max_is_a_day() {
        // Goal: "for ever" (`Duration::MAX`) as a wait gives a deadline a day away instead of
        // the panic of `Instant + Duration` overflowing; shorter waits are kept.
        let now = Instant::now();
        assert_eq!(deadline_after(now, Duration::MAX), now + WAIT_MAX);
        assert_eq!(deadline_after(now, Duration::from_millis(5)), now + Duration::from_millis(5));
    }

    /// A lookup frame of 200 tokens (800 body bytes).
    fn lookup_frame() -> Vec<u8> {
        let tokens: Vec<u32> = (0..200).collect();
        let mut frame = Vec::new();
        encode_frame(&mut frame, Kind::Lookup, 1, |out| encode_lookup_body(&tokens, out)).unwrap();
        frame
    }

    /// Reads one frame from `near` (a 50 ms tick, a 200 ms frame timeout) while a thread sends
    /// `frame[..head]` at once and the rest a byte every 20 ms; returns the outcome and how long
    /// the read took.
    fn read_trickled(frame: Vec<u8>, head: usize) -> (Result<ReadOutcome, DaemonError>, Duration) {
        let (near, far) = UnixStream::pair().unwrap();
        near.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let sender = thread::spawn(move || {
            let mut far = far;
            if far.write_all(&frame[..head]).is_err() {
                return;
            }
            for byte in &frame[head..] {
                thread::sleep(Duration::from_millis(20));
                // The reader gave up and closed: stop.
                if far.write_all(std::slice::from_ref(byte)).is_err() {
                    return;
                }
            }
        });
        let (mut body, mut fds) = (Vec::new(), Vec::new());
        let started = Instant::now();
        let never = || false;
        let outcome = read_frame(&near, &mut body, &mut fds, started + Duration::from_secs(60), Duration::from_millis(200), &never);
        let took = started.elapsed();
        drop(near);
        sender.join().unwrap();
        (outcome, took)
    }

    #[test]
    fn a_frame_trickled_a_byte_per_tick_times_out_within_the_frame_timeout() {
        // Goal: a peer sending one byte every 20 ms (faster than the 50 ms tick, so no read
        // ever times out) still gets the frame timeout (200 ms) — in the header and in the
        // body — instead of holding the connection for the ~16 s the trickle would take.
        let frame = lookup_frame();
        for (head, part) in [(0, "header"), (HEADER_BYTES, "body")] {
            let (outcome, took) = read_trickled(frame.clone(), head);
            assert!(matches!(outcome, Err(DaemonError::Timeout { .. })), "{part}: {outcome:?}");
            assert!(took < Duration::from_secs(1), "{part}: timed out after {took:?}");
        }
    }

    #[test]
    fn a_frame_read_slowly_times_out_within_the_write_timeout() {
        // Goal: a peer that reads a 4 MiB frame 64 KiB every 50 ms (room for a chunk comes well
        // within the 200 ms write timeout; the whole would take ~3 s) gets a Timeout within
        // about the write timeout, not a write that lasts as long as the peer likes.
        let (near, far) = UnixStream::pair().unwrap();
        near.set_write_timeout(Some(Duration::from_millis(200))).unwrap();
        let reader = thread::spawn(move || {
            let mut far = far;
            let mut chunk = vec![0u8; 64 << 10];
            let mut total = 0usize;
            // Bounded: at most the frame's bytes, then end of file once the writer is dropped.
            while total < 4 << 20 {
                thread::sleep(Duration::from_millis(50));
                match far.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(count) => total += count,
                }
            }
        });
        let frame = vec![0u8; 4 << 20];
        let started = Instant::now();
        let outcome = write_frame(&near, &frame);
        let took = started.elapsed();
        drop(near);
        reader.join().unwrap();
        assert!(matches!(outcome, Err(DaemonError::Timeout { .. })), "{outcome:?} after {took:?}");
        assert!(took < Duration::from_millis(1000), "the write took {took:?}");
    }
}
