//! File descriptors across the socket (SCM_RIGHTS): a client hands the daemon the memfd of its
//! KV memory, the daemon hands clients the memory their queues live in. The crate's only
//! unsafe code: adopting the descriptors the kernel installed for this process.
//!
//! Descriptors ride on the first byte of a frame (one `sendmsg` carries the header with them),
//! and the receiver gets them with the read that takes that byte. The kernel ends a read after
//! bytes that carried descriptors but may start it with bytes sent before them, so frames are
//! read by exact lengths (the header, then the body): a header read can only take bytes of its
//! own frame, and the descriptors it returns were sent with that frame. At most
//! [`FDS_PER_FRAME_MAX`] per frame; a frame with more, or a control message the kernel had to
//! truncate, is refused, and every descriptor received with it is closed (they are
//! [`OwnedFd`]s from the moment they arrive). Received descriptors are close-on-exec.
#![allow(unsafe_code)]

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::errno::Errno;
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

/// Most descriptors one frame may carry (a memfd per device's register page on a node with a
/// few SSDs, or one KV memfd).
pub const FDS_PER_FRAME_MAX: usize = 8;

/// Sends `bytes` (as much as one `sendmsg` takes without waiting, `MSG_DONTWAIT`; the caller
/// waits for room and sends the rest: `crate::frame_io`) with `fds` attached to its first byte.
/// Returns the bytes sent; `WouldBlock` when the socket has no room (nothing sent, no
/// descriptor passed).
pub fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    if fds.len() > FDS_PER_FRAME_MAX {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} descriptors in one frame; at most {FDS_PER_FRAME_MAX}", fds.len()),
        ));
    }
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let control = [ControlMessage::ScmRights(&raw)];
    let control: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &control };
    loop {
        match sendmsg::<()>(
            stream.as_fd().as_raw_fd(),
            &[IoSlice::new(bytes)],
            control,
            MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
            None,
        ) {
            Ok(sent) => return Ok(sent),
            Err(Errno::EINTR) => continue,
            Err(errno) => return Err(io::Error::from(errno)),
        }
    }
}

/// Reads into `buffer` (one `recvmsg`, like `read`), appending descriptors that came with the
/// bytes to `fds`. 0 means the peer closed. More than `FDS_PER_FRAME_MAX` in `fds` in all, or a
/// truncated control message, is an error (`InvalidData`); the descriptors are then closed.
pub fn recv_with_fds(stream: &UnixStream, buffer: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    // Room for one more than allowed, so that "too many" is seen rather than truncated away.
    let mut control = nix::cmsg_space!([RawFd; FDS_PER_FRAME_MAX + 1]);
    let mut slices = [IoSliceMut::new(buffer)];
    let message = loop {
        match recvmsg::<()>(stream.as_raw_fd(), &mut slices, Some(&mut control), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(message) => break message,
            Err(Errno::EINTR) => continue,
            Err(errno) => return Err(io::Error::from(errno)),
        }
    };
    let received = message.bytes;
    let truncated = message.flags.contains(MsgFlags::MSG_CTRUNC);
    let mut other_control = false;
    for control_message in message.cmsgs().map_err(io::Error::from)? {
        match control_message {
            ControlMessageOwned::ScmRights(raw) => {
                for fd in raw {
                    // SAFETY: the kernel installed `fd` in this process's table for this
                    // recvmsg and returned it to us alone; nothing else knows or closes it, so
                    // adopting it as the one owner is sound (dropping it closes it once).
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
            _ => other_control = true,
        }
    }
    if truncated || fds.len() > FDS_PER_FRAME_MAX || other_control {
        let count = fds.len();
        fds.clear();
        let reason = if truncated {
            "the control message was truncated".to_string()
        } else if other_control {
            "a control message other than SCM_RIGHTS".to_string()
        } else {
            format!("{count} descriptors; at most {FDS_PER_FRAME_MAX} per frame")
        };
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("descriptors refused: {reason}")));
    }
    Ok(received)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    fn memfile(text: &[u8]) -> std::fs::File {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(text).unwrap();
        file
    }

    #[test]
    fn descriptors_arrive_with_the_first_byte_and_stay_usable() {
        // Goal: two files sent with a frame's first bytes arrive as open, close-on-exec
        // descriptors of the same files; a read of exactly the bytes sent before them does not
        // get them (frames are read by exact lengths for this reason).
        let (left, right) = UnixStream::pair().unwrap();
        let (a, b) = (memfile(b"alpha"), memfile(b"beta"));
        assert_eq!(send_with_fds(&left, b"before", &[]).unwrap(), 6);
        assert_eq!(send_with_fds(&left, b"frame", &[a.as_fd(), b.as_fd()]).unwrap(), 5);
        let mut fds = Vec::new();
        let mut buffer = [0u8; 64];
        let first = recv_with_fds(&right, &mut buffer[..6], &mut fds).unwrap();
        assert_eq!(&buffer[..first], b"before");
        assert!(fds.is_empty(), "descriptors came with bytes sent before them");
        let second = recv_with_fds(&right, &mut buffer, &mut fds).unwrap();
        assert_eq!(&buffer[..second], b"frame");
        assert_eq!(fds.len(), 2);
        let mut contents = Vec::new();
        for fd in fds {
            let flags = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_GETFD).unwrap();
            assert_ne!(flags & nix::fcntl::FdFlag::FD_CLOEXEC.bits(), 0, "received descriptors must be close-on-exec");
            let mut file = std::fs::File::from(fd);
            file.rewind().unwrap();
            let mut text = String::new();
            file.read_to_string(&mut text).unwrap();
            contents.push(text);
        }
        assert_eq!(contents, ["alpha", "beta"]);
    }

    #[test]
    fn too_many_descriptors_are_refused_and_closed() {
        // Goal: a peer sending more than the cap (as raw sendmsg would) gets nothing adopted.
        let (left, right) = UnixStream::pair().unwrap();
        let files: Vec<std::fs::File> = (0..FDS_PER_FRAME_MAX + 1).map(|_| memfile(b"x")).collect();
        let raw: Vec<RawFd> = files.iter().map(|file| file.as_raw_fd()).collect();
        sendmsg::<()>(left.as_raw_fd(), &[IoSlice::new(b"many")], &[ControlMessage::ScmRights(&raw)], MsgFlags::empty(), None).unwrap();
        assert!(send_with_fds(&left, b"x", &files.iter().map(|file| file.as_fd()).collect::<Vec<_>>()).is_err(), "the sender caps too");
        let mut fds = Vec::new();
        let error = recv_with_fds(&right, &mut [0u8; 16], &mut fds).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData, "{error}");
        assert!(fds.is_empty());
    }
}
