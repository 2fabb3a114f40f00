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

use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::errno::Errno;
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

/// Most descriptors one frame may carry (a memfd per device's register page on a node with a
/// few SSDs, or one KV memfd).
pub const FDS_PER_FRAME_MAX: usize = 8;

/// The most descriptors one `recvmsg` here installs, whatever the peer sends: one past the cap,
/// so that a frame with too many still reads as too many, not as a truncation. The control
/// buffer has room for these alone; the kernel drops the rest of a larger message (closing
/// them on the sender's behalf) and reports it truncated (`MSG_CTRUNC`), which is refused. A
/// buffer for Linux's own cap (`SCM_MAX_FD`, 253) let a peer make the daemon hold 253 of its
/// descriptors per connection until the refusal closed them.
pub const FDS_RECEIVED_MAX: usize = FDS_PER_FRAME_MAX + 1;

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

/// Bytes of control buffer handed to the kernel: one SCM_RIGHTS message of
/// [`FDS_RECEIVED_MAX`] descriptors, exactly (`CMSG_LEN`, not `CMSG_SPACE`, whose padding
/// would fit one more). The kernel installs as many as fit, `(length - header) / 4`, drops the
/// rest and sets MSG_CTRUNC. Another control message ahead of it (the peer's credentials with
/// SO_PASSCRED, its security label with SO_PASSSEC) takes room, and the kernel then truncates
/// the rights message too: [`recv_with_fds`] refuses that and closes what was installed.
// SAFETY: CMSG_LEN is arithmetic on its argument (it reads no memory).
const CONTROL_BYTES: usize = unsafe { nix::libc::CMSG_LEN((FDS_RECEIVED_MAX * size_of::<RawFd>()) as u32) } as usize;

/// The control buffer in `u64`s: `cmsghdr`s are read in place, so the buffer must be aligned
/// for them (the kernel writes each at a `CMSG_ALIGN`ed offset from the start).
const CONTROL_WORDS: usize = CONTROL_BYTES.div_ceil(size_of::<u64>());
// A frame's largest legitimate message fits whole.
// SAFETY: CMSG_LEN is arithmetic on its argument.
const _: () = assert!(unsafe { nix::libc::CMSG_LEN((FDS_PER_FRAME_MAX * size_of::<RawFd>()) as u32) } as usize <= CONTROL_BYTES);
const _: () = assert!(align_of::<u64>() >= align_of::<nix::libc::cmsghdr>());

/// Reads into `buffer` (one `recvmsg`, like `read`), appending descriptors that came with the
/// bytes to `fds`. 0 means the peer closed. More than `FDS_PER_FRAME_MAX` in `fds` in all, a
/// control message other than SCM_RIGHTS, or a truncated control message, is an error
/// (`InvalidData`); every descriptor in `fds` is then closed, those the kernel installed before
/// it truncated included.
pub fn recv_with_fds(stream: &UnixStream, buffer: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut control = [0u64; CONTROL_WORDS];
    let mut data = nix::libc::iovec { iov_base: buffer.as_mut_ptr().cast(), iov_len: buffer.len() };
    // The raw call rather than nix's: nix refuses to walk a control buffer the kernel marked
    // truncated (`cmsgs()` is ENOBUFS), but the descriptors it installed before truncating are
    // in this process's table all the same and must be found and closed.
    let (received, header) = loop {
        // SAFETY: an all-zero `msghdr` is a valid value (null pointers, zero lengths); the
        // fields that matter are set below.
        let mut header: nix::libc::msghdr = unsafe { std::mem::zeroed() };
        header.msg_iov = &mut data;
        header.msg_iovlen = 1;
        header.msg_control = control.as_mut_ptr().cast();
        header.msg_controllen = CONTROL_BYTES as _;
        // SAFETY: `header` points at one iovec over `buffer` (exclusively borrowed, its length)
        // and at `control` (CONTROL_BYTES, within its CONTROL_WORDS words); both outlive the
        // call, and the kernel writes no further than the lengths given.
        let count = unsafe { nix::libc::recvmsg(stream.as_raw_fd(), &mut header, nix::libc::MSG_CMSG_CLOEXEC) };
        match usize::try_from(count) {
            Ok(count) => break (count, header),
            Err(_) => match Errno::last() {
                Errno::EINTR => continue,
                errno => return Err(io::Error::from(errno)),
            },
        }
    };
    let truncated = header.msg_flags & nix::libc::MSG_CTRUNC != 0;
    let other_control = adopt_descriptors(&header, fds);
    if truncated || fds.len() > FDS_PER_FRAME_MAX || other_control {
        let count = fds.len();
        fds.clear();
        let reason = if truncated {
            format!("the control message was truncated ({count} descriptor(s) installed, all closed)")
        } else if other_control {
            "a control message other than SCM_RIGHTS".to_string()
        } else {
            format!("{count} descriptors; at most {FDS_PER_FRAME_MAX} per frame")
        };
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("descriptors refused: {reason}")));
    }
    Ok(received)
}

/// Walks the control messages `header` describes after a successful `recvmsg` (truncated or
/// not) and adopts every descriptor of every SCM_RIGHTS message into `fds`, so that none stays
/// open unowned whatever is decided about them. Returns whether another kind of message came.
// msg_controllen and cmsg_len are size_t with glibc (the casts are no-ops) but socklen_t with musl.
#[allow(clippy::unnecessary_cast)]
fn adopt_descriptors(header: &nix::libc::msghdr, fds: &mut Vec<OwnedFd>) -> bool {
    let start = header.msg_control as usize;
    // The kernel set msg_controllen to the bytes it wrote; never more than the buffer.
    let written = (header.msg_controllen as usize).min(CONTROL_BYTES);
    // SAFETY: CMSG_LEN is arithmetic on its argument.
    let data_offset = unsafe { nix::libc::CMSG_LEN(0) } as usize;
    let mut other_control = false;
    // SAFETY: `header` came back from recvmsg: msg_control points at the caller's live control
    // buffer and msg_controllen at most its length. CMSG_FIRSTHDR reads only `header`.
    let mut message = unsafe { nix::libc::CMSG_FIRSTHDR(header) };
    while !message.is_null() {
        // SAFETY: CMSG_FIRSTHDR and CMSG_NXTHDR return only headers that lie whole within the
        // first msg_controllen bytes of the buffer, at CMSG_ALIGNed offsets of an 8-aligned
        // buffer: aligned, initialized (zeroed, then written by the kernel) and not written by
        // anything while this reads them.
        let (level, kind, length) = unsafe { ((*message).cmsg_level, (*message).cmsg_type, (*message).cmsg_len as usize) };
        if level == nix::libc::SOL_SOCKET && kind == nix::libc::SCM_RIGHTS {
            // The descriptors in it: what cmsg_len claims, but never past what the kernel wrote
            // (cmsg_len comes from the kernel; the bound costs nothing and keeps reads inside).
            let offset = (message as usize).saturating_sub(start);
            let room = written.saturating_sub(offset).saturating_sub(data_offset);
            let count = length.saturating_sub(data_offset).min(room) / size_of::<RawFd>();
            // SAFETY: CMSG_DATA is arithmetic on the header's address (just past it).
            let first = unsafe { nix::libc::CMSG_DATA(message) }.cast::<RawFd>();
            for index in 0..count {
                // SAFETY: `index < count` keeps the read inside the message's data and inside
                // the bytes the kernel wrote (`room` above); read_unaligned because the data
                // need only be int-aligned by the kernel's layout, not by Rust's reading.
                let fd = unsafe { first.add(index).read_unaligned() };
                if fd >= 0 {
                    // SAFETY: the kernel installed `fd` in this process's table for this
                    // recvmsg and returned it to us alone; nothing else knows or closes it, so
                    // adopting it as the one owner is sound (dropping it closes it once).
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        } else {
            other_control = true;
        }
        // SAFETY: `message` is a valid header within the buffer `header` describes (above);
        // CMSG_NXTHDR returns null rather than a header that would not fit in msg_controllen.
        message = unsafe { nix::libc::CMSG_NXTHDR(header, message) };
    }
    other_control
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    /// Linux's cap on descriptors in one message (`SCM_MAX_FD`, include/net/scm.h): the most a
    /// peer can send in one.
    const SCM_MAX_FD: usize = 253;

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

    /// A pipe whose read end does not block: it reads `Ok(0)` once every copy of the write end,
    /// wherever it went, is closed, and `WouldBlock` while one is still open (a leaked copy).
    fn pipe_with_nonblocking_reader() -> (std::io::PipeReader, std::io::PipeWriter) {
        let (reader, writer) = std::io::pipe().unwrap();
        let flags = nix::fcntl::fcntl(&reader, nix::fcntl::FcntlArg::F_GETFL).unwrap();
        let flags = nix::fcntl::OFlag::from_bits_retain(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&reader, nix::fcntl::FcntlArg::F_SETFL(flags)).unwrap();
        (reader, writer)
    }

    /// Sends `count` copies of `fd` with one byte in one raw `sendmsg` (as a peer that ignores
    /// the cap would), then checks that `recv_with_fds` refuses them and that every copy the
    /// kernel installed here was closed: the pipe's read end sees end-of-file.
    fn refused_and_all_closed(count: usize, pass_credentials: bool) {
        let (left, right) = UnixStream::pair().unwrap();
        if pass_credentials {
            nix::sys::socket::setsockopt(&right, nix::sys::socket::sockopt::PassCred, &true).unwrap();
        }
        let (mut reader, writer) = pipe_with_nonblocking_reader();
        let raw: Vec<RawFd> = vec![writer.as_raw_fd(); count];
        sendmsg::<()>(left.as_raw_fd(), &[IoSlice::new(b"m")], &[ControlMessage::ScmRights(&raw)], MsgFlags::empty(), None).unwrap();
        // The copies in flight (in the socket's queue) hold the write end open until received.
        drop(writer);
        let mut fds = Vec::new();
        let error = recv_with_fds(&right, &mut [0u8; 16], &mut fds).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData, "{count} descriptors: {error}");
        assert!(fds.is_empty());
        // Another test of this binary may be spawning a process: between its fork and exec the
        // child holds copies (close-on-exec, not yet closed) of every descriptor here, this
        // write end included. Such a copy goes within microseconds; a leaked one never does.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        loop {
            match reader.read(&mut [0u8; 1]) {
                Ok(0) => return,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock && std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                other => panic!("{count} descriptors: a copy of the write end is still open 1 s after the refusal ({other:?})"),
            }
        }
    }

    #[test]
    fn too_many_descriptors_are_refused_and_closed() {
        // Goal: a peer sending one more than the cap (as raw sendmsg would) gets nothing
        // adopted, every descriptor received is closed, and the sender caps too.
        refused_and_all_closed(FDS_PER_FRAME_MAX + 1, false);
        let files: Vec<std::fs::File> = (0..FDS_PER_FRAME_MAX + 1).map(|_| memfile(b"x")).collect();
        let (left, _right) = UnixStream::pair().unwrap();
        assert!(send_with_fds(&left, b"x", &files.iter().map(|file| file.as_fd()).collect::<Vec<_>>()).is_err(), "the sender caps too");
    }

    #[test]
    fn far_too_many_descriptors_are_refused_and_closed() {
        // Goal: more descriptors than a small control buffer holds (20, and Linux's per-message
        // maximum SCM_MAX_FD) are refused as InvalidData and none stays open: the kernel
        // installs what fits before it reports truncation, and those must be closed too.
        refused_and_all_closed(20, false);
        refused_and_all_closed(SCM_MAX_FD, false);
    }

    #[test]
    fn a_truncated_control_message_is_refused_and_its_descriptors_closed() {
        // Goal: when the kernel must truncate (credentials take room ahead of SCM_MAX_FD
        // descriptors), the refusal is InvalidData and the descriptors it did install are closed.
        refused_and_all_closed(SCM_MAX_FD, true);
    }

    #[test]
    fn a_flood_of_descriptors_installs_at_most_one_past_the_cap() {
        // Goal: each descriptor the kernel installs here holds a slot of the daemon's table
        // until it is closed, so a peer sending 200 with one frame must not get 200 installed
        // (a few peers at once would run the daemon out of descriptors): the control buffer
        // holds one past the cap, the kernel drops the rest and says so (MSG_CTRUNC).
        let (left, right) = UnixStream::pair().unwrap();
        let file = memfile(b"x");
        let raw: Vec<RawFd> = vec![file.as_raw_fd(); 200];
        sendmsg::<()>(left.as_raw_fd(), &[IoSlice::new(b"m")], &[ControlMessage::ScmRights(&raw)], MsgFlags::empty(), None).unwrap();
        let mut fds = Vec::new();
        let error = recv_with_fds(&right, &mut [0u8; 16], &mut fds).unwrap_err();
        let installed = format!("({} descriptor(s) installed", FDS_PER_FRAME_MAX + 1);
        assert!(error.to_string().contains("truncated") && error.to_string().contains(&installed), "{error}");
        assert!(fds.is_empty());
    }
}
