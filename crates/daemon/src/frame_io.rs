//! Frames on a stream socket, with deadlines: nothing here waits without a bound, and nothing
//! is allocated beyond one body of at most `BODY_BYTES_MAX` (the caller's buffer, reused).
//!
//! The socket must have a read timeout (the *tick*, e.g. 50 ms): each timed-out read is a chance
//! to check the deadlines and the caller's stop flag.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::fd_passing::{recv_with_fds, send_with_fds};
use crate::protocol::{FrameHeader, HEADER_BYTES};
use crate::DaemonError;

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
                frame_deadline.get_or_insert_with(|| Instant::now() + frame_timeout);
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
    let deadline = frame_deadline.unwrap_or_else(|| Instant::now() + frame_timeout);
    body.clear();
    body.resize(header.body_bytes as usize, 0);
    let mut filled = 0;
    let mut reader = stream;
    while filled < body.len() {
        match reader.read(&mut body[filled..]) {
            Ok(0) => return Err(DaemonError::Truncated { received: HEADER_BYTES + filled, expected: HEADER_BYTES + body.len() }),
            Ok(count) => filled += count,
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

/// Writes a whole encoded frame. The socket's write timeout bounds it: a peer that does not
/// read is a [`DaemonError::Timeout`].
pub fn write_frame(stream: &UnixStream, frame: &[u8]) -> Result<(), DaemonError> {
    write_frame_with_fds(stream, frame, &[])
}

/// Writes a whole encoded frame with `fds` attached to its first byte (at most
/// [`crate::fd_passing::FDS_PER_FRAME_MAX`]).
pub fn write_frame_with_fds(stream: &UnixStream, frame: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), DaemonError> {
    let written = if fds.is_empty() || frame.is_empty() {
        Ok(0)
    } else {
        loop {
            match send_with_fds(stream, frame, fds) {
                Err(error) if error.kind() == ErrorKind::Interrupted => continue,
                other => break other,
            }
        }
    };
    let mut writer = stream;
    match written.and_then(|sent| writer.write_all(&frame[sent..])) {
        Ok(()) => Ok(()),
        Err(error) if is_tick(&error) => Err(DaemonError::Timeout { what: "writing a frame (the peer does not read)".into(), after_ms: 0 }),
        Err(error) if matches!(error.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => Err(DaemonError::Closed),
        Err(source) => Err(DaemonError::Io { context: "writing a frame".into(), source }),
    }
}

fn is_tick(error: &std::io::Error) -> bool {
    matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

fn frame_timed_out(frame_timeout: Duration) -> DaemonError {
    DaemonError::Timeout { what: "the rest of a frame".into(), after_ms: frame_timeout.as_millis() as u64 }
}
