//! The client library: one connection to tuttid, one request at a time, every wait bounded.
//!
//! ```no_run
//! # use std::time::Duration;
//! # use tutti_daemon::{Client, protocol::Hello};
//! let mut client = Client::connect("/run/tutti/tuttid.sock".as_ref(), Duration::from_secs(5))?;
//! let attached = client.hello(&Hello { model_fingerprint: [7; 32], tp_rank: 0, tp_world: 1, client_name: "worker-0".into() })?;
//! let tokens: Vec<u32> = (0..1024).collect();
//! let cached_blocks = client.lookup(&tokens)?; // × attached.shape.block_tokens tokens
//! # Ok::<(), tutti_daemon::DaemonError>(())
//! ```
//! [`RemoteKvStore`] is the layer-wise store over such a connection (`objstore::LayerKvStore`).
//!
//! A session idle for its lease (`HelloReply::lease_ms`) is ended by the daemon: an engine
//! that may idle longer calls [`Client::ping`] in between.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::sockopt::{PeerCredentials, SocketError};
use nix::sys::socket::{connect, getsockopt, socket as new_socket, AddressFamily, SockFlag, SockType, UnixAddr};

use crate::fd_passing::FDS_PER_FRAME_MAX;
use crate::frame_io::{deadline_after, read_frame_by, write_frame_with_fds_by, ReadOutcome, Written, WAIT_MAX};
use crate::protocol::{encode_frame, encode_lookup_body, encode_lookup_from_body, Hello, HelloReply, Kind, Reply, Request, StatusReply};
use crate::{DaemonError, ErrorCode};

mod gpu_export;
mod remote_store;

pub use gpu_export::DeviceKvMemory;
pub use remote_store::{wire_first_block, RemoteConfig, RemoteKvStore, WindowKvLayout};

/// The bytes before the tokens of a body `encode_lookup_body` encodes (the token count), and
/// of one `encode_lookup_from_body` encodes (the first block, then the count): each token is 4
/// more (what [`Client::check_tokens_fit`] sizes a body by before encoding it).
const LOOKUP_FIXED_BYTES: usize = 4;
const LOOKUP_FROM_FIXED_BYTES: usize = 8;

/// Granularity of the client's waits (the socket's read timeout).
const TICK: Duration = Duration::from_millis(50);

/// The pauses before a request tuttid answered Busy is asked again (a Hello past the connection
/// cap, an AttachQueues while an ended session's deletion is unconfirmed): 20 ms, doubled after
/// each answer up to 500 ms (a retiring session's deletion is confirmed within a tick once the
/// controller answers, or after its admin timeout), within the caller's deadline.
#[derive(Debug, Clone)]
pub struct BusyPauses {
    next: Duration,
}

impl BusyPauses {
    const FIRST: Duration = Duration::from_millis(20);
    const LONGEST: Duration = Duration::from_millis(500);

    pub fn new() -> BusyPauses {
        BusyPauses { next: Self::FIRST }
    }

    /// Sleeps the next pause and returns true, or returns false at once when asking again after
    /// it would reach `deadline` (the caller gives up with the Busy it got).
    pub fn pause_before(&mut self, deadline: Instant) -> bool {
        if Instant::now() + self.next >= deadline {
            return false;
        }
        std::thread::sleep(self.next);
        self.next = (self.next * 2).min(Self::LONGEST);
        true
    }
}

impl Default for BusyPauses {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether tuttid sends `code` only when it ends the connection (an `Error` under id 0, then
/// it closes): a lease or shutdown goodbye, a frame it refused (its header, or one unfinished
/// past the frame timeout: the stream cannot be resynchronised), a peer it does not serve
/// (`PermissionDenied`). A caller that gets one has lost its connection ([`Client::is_broken`])
/// whatever it asked, and reconnects at once: `RemoteKvStore` reports `Disconnected`, as the
/// Python package does (keeping the code). `Busy` ends a connection past the cap too, but is
/// also a per-request answer (AttachQueues, asked again on the same connection), so it is not
/// one of these; a Hello answered Busy is asked again on a new connection anyway.
pub fn ends_the_connection(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::LeaseExpired
            | ErrorCode::ShuttingDown
            | ErrorCode::FrameTimeout
            | ErrorCode::BadMagic
            | ErrorCode::UnsupportedVersion
            | ErrorCode::FrameTooLarge
            | ErrorCode::UnknownKind
            | ErrorCode::PermissionDenied
    )
}

/// Why a [`Client`]'s connection can no longer be used.
#[derive(Debug)]
enum Broken {
    /// Out of step, for the reason given: a request timed out (its reply may still come), a
    /// frame was cut or refused, a reply did not decode, answered another request or was of a
    /// kind that does not answer the request ([`answer_kind`]), a lookup or fetch answer did not
    /// fit its request, or the connection was never in step ([`Client::detached`]).
    OutOfStep(String),
    /// The daemon ended it with a goodbye (an `Error` whose code [`ends_the_connection`]),
    /// whichever call read it: a keep-alive ping often does, so every later call reports the
    /// same code, and its callers see the daemon's reason (Python's `Disconnected` keeps it).
    Ended { code: ErrorCode, message: String },
}

impl Broken {
    /// The error every call on such a connection returns: out of step, an `Io` error
    /// (`NotConnected`), which callers treat as a lost connection (`RemoteFailure::Disconnected`
    /// in `RemoteKvStore`, `Disconnected` in Python) and reconnect; ended, the goodbye's code
    /// again (`Remote`, which they classify as the same lost connection, keeping the code).
    fn error(&self) -> DaemonError {
        match self {
            Broken::OutOfStep(cause) => DaemonError::Io {
                context: format!("this connection to tuttid can no longer be used: {cause}; reconnect"),
                source: std::io::Error::from(std::io::ErrorKind::NotConnected),
            },
            Broken::Ended { code, message } => DaemonError::Remote {
                code: *code,
                message: format!("tuttid ended this connection earlier; reconnect (said earlier: {message})"),
            },
        }
    }
}

pub struct Client {
    stream: UnixStream,
    frame: Vec<u8>,
    body: Vec<u8>,
    /// Where a reply's descriptors are read into; emptied by every exchange before it returns
    /// ([`Client::exchange_with_fds`]).
    fds: Vec<OwnedFd>,
    next_request_id: u32,
    timeout: Duration,
    /// Requests sent on this connection (what proves the per-layer path sends none).
    requests_sent: u64,
    /// Why the connection can no longer be used (see [`Broken`]): every later call fails at
    /// once with [`Broken::error`] rather than reading an earlier request's reply as its own.
    broken: Option<Broken>,
    /// The session's block size, once [`Client::hello`] has been answered: what lookup and
    /// fetch counts are checked against.
    block_tokens: Option<u32>,
}

impl Client {
    /// Connects within `timeout` ([`DaemonError::Timeout`] if the daemon does not take the
    /// connection by then); every later call waits at most `timeout` in all, its request's
    /// write and its reply's read together, give or take a read tick (50 ms). A timeout
    /// past [`WAIT_MAX`] (a day; `Duration::MAX` for "for ever") is a day: deadlines are
    /// `Instant`s, which a longer wait would overflow.
    pub fn connect(socket: &Path, timeout: Duration) -> Result<Client, DaemonError> {
        let timeout = timeout.min(WAIT_MAX);
        let stream = connect_within(socket, timeout)?;
        let io = |context: &'static str| move |source| DaemonError::Io { context: context.into(), source };
        stream.set_read_timeout(Some(TICK)).map_err(io("setting the read tick"))?;
        Ok(Client {
            stream,
            frame: Vec::new(),
            body: Vec::new(),
            fds: Vec::new(),
            next_request_id: 1,
            timeout,
            requests_sent: 0,
            broken: None,
            block_tokens: None,
        })
    }

    /// A client connected to no daemon and out of step from the start: every call fails at
    /// once with an out-of-step error (`Io`, `NotConnected`: a lost connection to
    /// its callers), `why` its cause, and sends nothing. It stands in for a connection lent
    /// elsewhere for a while (the Python package's keep-alive ping has the store's). Its stream
    /// is one end of a socket pair whose other end is closed at once: no file system, no
    /// environment.
    pub fn detached(why: &str) -> Result<Client, DaemonError> {
        let (stream, peer) = UnixStream::pair().map_err(|source| DaemonError::Io { context: "making a socket pair".into(), source })?;
        drop(peer);
        Ok(Client {
            stream,
            frame: Vec::new(),
            body: Vec::new(),
            fds: Vec::new(),
            next_request_id: 1,
            timeout: Duration::ZERO,
            requests_sent: 0,
            broken: Some(Broken::OutOfStep(why.into())),
            block_tokens: None,
        })
    }

    /// Sets how long every later call waits (as [`Client::connect`]'s `timeout`): a caller that
    /// connected with what was left of a deadline (a Hello asked again after Busy) gives the
    /// session its own timeout back.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout.min(WAIT_MAX);
    }

    /// Attaches: declares the model and the tensor-parallel rank/world size this session's keys
    /// belong to. Once per connection. A client name over 64 bytes
    /// ([`CLIENT_NAME_BYTES_MAX`](crate::protocol::CLIENT_NAME_BYTES_MAX)) is refused here, not
    /// sent ([`DaemonError::ClientNameTooLong`]).
    pub fn hello(&mut self, hello: &Hello) -> Result<HelloReply, DaemonError> {
        match self.call(&Request::Hello(hello.clone()))? {
            Reply::Hello(reply) => {
                self.block_tokens = Some(reply.shape.block_tokens);
                Ok(reply)
            }
            other => Err(DaemonError::UnexpectedReply { asked: Kind::Hello, got: other.kind() }),
        }
    }

    /// The longest cached prefix of `tokens`, in blocks, in this session's key space.
    pub fn lookup(&mut self, tokens: &[u32]) -> Result<u32, DaemonError> {
        self.lookup_from(tokens, 0)
    }

    /// Where the run of cached blocks of `tokens`' prefix from `first_block` ends, in blocks of
    /// the prefix, in this session's key space (an engine holding blocks 0..first_block itself
    /// needs only the run from there).
    pub fn lookup_from(&mut self, tokens: &[u32], first_block: u32) -> Result<u32, DaemonError> {
        self.check_tokens_fit(Kind::Lookup, LOOKUP_FROM_FIXED_BYTES, tokens)?;
        match self.exchange(Kind::Lookup, |out| encode_lookup_from_body(tokens, first_block, out), &[])? {
            Reply::Lookup { cached_blocks, block_tokens } => {
                self.checked_lookup(Kind::LookupReply, tokens.len(), first_block, cached_blocks, block_tokens)
            }
            other => Err(DaemonError::UnexpectedReply { asked: Kind::Lookup, got: other.kind() }),
        }
    }

    /// The longest prefix of `tokens`, in blocks, cached on every tensor-parallel rank of this
    /// session's model and world size (what an engine's scheduler process asks before planning a
    /// prefill; attach with any rank of that world).
    pub fn lookup_all_ranks(&mut self, tokens: &[u32]) -> Result<u32, DaemonError> {
        self.lookup_all_ranks_from(tokens, 0)
    }

    /// As [`Client::lookup_all_ranks`], for the run of blocks from `first_block`: where it ends.
    pub fn lookup_all_ranks_from(&mut self, tokens: &[u32], first_block: u32) -> Result<u32, DaemonError> {
        self.check_tokens_fit(Kind::LookupAllRanks, LOOKUP_FROM_FIXED_BYTES, tokens)?;
        match self.exchange(Kind::LookupAllRanks, |out| encode_lookup_from_body(tokens, first_block, out), &[])? {
            Reply::Lookup { cached_blocks, block_tokens } => {
                self.checked_lookup(Kind::LookupReply, tokens.len(), first_block, cached_blocks, block_tokens)
            }
            other => Err(DaemonError::UnexpectedReply { asked: Kind::LookupAllRanks, got: other.kind() }),
        }
    }

    /// Devices, pool fill and clients (allowed before `hello`).
    pub fn status(&mut self) -> Result<StatusReply, DaemonError> {
        match self.call(&Request::Status)? {
            Reply::Status(status) => Ok(status),
            other => Err(DaemonError::UnexpectedReply { asked: Kind::Status, got: other.kind() }),
        }
    }

    /// The longest prefix of `tokens` cached on this node (as [`Client::lookup`]) and what other
    /// nodes of the cluster hold past it, by whom. The counts are checked as a lookup's are: a
    /// reply whose local prefix, remote blocks or a holder's blocks pass the prompt's full
    /// blocks is refused as a malformed body, and the connection left out of step.
    pub fn lookup_cluster(&mut self, tokens: &[u32]) -> Result<crate::protocol::ClusterLookupReply, DaemonError> {
        self.check_tokens_fit(Kind::LookupCluster, LOOKUP_FIXED_BYTES, tokens)?;
        match self.exchange(Kind::LookupCluster, |out| encode_lookup_body(tokens, out), &[])? {
            Reply::ClusterLookup(reply) => {
                let cached = self.checked_lookup(Kind::ClusterLookupReply, tokens.len(), 0, reply.cached_blocks, reply.block_tokens)?;
                // What other nodes hold lies past the local prefix and within the prompt's full
                // blocks, in all and per holder (the daemon counts whole segments of the prompt
                // from the one the local prefix ends in).
                let past_local = tokens.len() / reply.block_tokens as usize - cached as usize;
                let too_long = |blocks: u32| blocks as usize > past_local;
                if too_long(reply.remote_blocks) || reply.holders.iter().any(|holder| too_long(holder.blocks)) {
                    let holders: Vec<u32> = reply.holders.iter().map(|holder| holder.blocks).collect();
                    return Err(self.bad_reply(
                        Kind::ClusterLookupReply,
                        format!(
                            "{} remote blocks (holders {holders:?}) past a local prefix of {cached} blocks of a {}-token prompt of \
                             {} full blocks",
                            reply.remote_blocks,
                            tokens.len(),
                            tokens.len() / reply.block_tokens as usize
                        ),
                    ));
                }
                Ok(reply)
            }
            other => Err(DaemonError::UnexpectedReply { asked: Kind::LookupCluster, got: other.kind() }),
        }
    }

    /// Reads what other nodes hold of `tokens` past this node's prefix and stores it here (a
    /// `PrepareRetrieve` then finds it): (the local prefix now, blocks fetched), in blocks. A
    /// failure is `Remote { code: RemoteReadFailed, .. }`: recompute those blocks. The client's
    /// timeout must cover the fetch (a segment's read and local store per segment).
    pub fn fetch_remote(&mut self, tokens: &[u32]) -> Result<(u32, u32), DaemonError> {
        self.check_tokens_fit(Kind::FetchRemote, LOOKUP_FIXED_BYTES, tokens)?;
        match self.exchange(Kind::FetchRemote, |out| encode_lookup_body(tokens, out), &[])? {
            Reply::Fetched { cached_blocks, fetched_blocks } => {
                // The local prefix after the fetch (the fetched blocks included) and the blocks
                // fetched: each within the prompt's full blocks. Without the session's block
                // size (no Hello answered here), blocks of at least one token each.
                let full = tokens.len() / self.block_tokens.unwrap_or(1).max(1) as usize;
                if cached_blocks as usize <= full && fetched_blocks as usize <= full {
                    Ok((cached_blocks, fetched_blocks))
                } else {
                    Err(self.bad_reply(
                        Kind::Fetched,
                        format!(
                            "a local prefix of {cached_blocks} blocks after fetching {fetched_blocks} blocks of a {}-token prompt of \
                             at most {full} full blocks",
                            tokens.len()
                        ),
                    ))
                }
            }
            other => Err(DaemonError::UnexpectedReply { asked: Kind::FetchRemote, got: other.kind() }),
        }
    }

    /// The daemon's part in the cluster (allowed before `hello`; `enabled` false outside one).
    pub fn cluster_status(&mut self) -> Result<crate::protocol::ClusterStatusReply, DaemonError> {
        match self.call(&Request::ClusterStatus)? {
            Reply::ClusterStatus(status) => Ok(status),
            other => Err(DaemonError::UnexpectedReply { asked: Kind::ClusterStatus, got: other.kind() }),
        }
    }

    /// Renews the lease.
    pub fn ping(&mut self) -> Result<(), DaemonError> {
        match self.call(&Request::Ping)? {
            Reply::Pong => Ok(()),
            other => Err(DaemonError::UnexpectedReply { asked: Kind::Ping, got: other.kind() }),
        }
    }

    /// Sends `request` and waits for its reply, which is of the kind that answers it; an `Error`
    /// reply is [`DaemonError::Remote`]. A reply of any other kind is
    /// [`DaemonError::UnexpectedReply`] and leaves the connection out of step
    /// ([`Client::is_broken`]).
    pub fn call(&mut self, request: &Request) -> Result<Reply, DaemonError> {
        Client::check_hello(request)?;
        self.exchange(request.kind(), |out| request.encode_body(out), &[])
    }

    /// Sends `request` with `fds` (SCM_RIGHTS) and waits for its reply; returns the reply and
    /// the descriptors that came with it.
    pub fn call_with_fds(&mut self, request: &Request, fds: &[BorrowedFd<'_>]) -> Result<(Reply, Vec<OwnedFd>), DaemonError> {
        Client::check_hello(request)?;
        self.exchange_with_fds(request.kind(), |out| request.encode_body(out), fds)
    }

    /// The daemon process at the other end of this connection (`SO_PEERCRED`, its pid as this
    /// process's pid namespace sees it, and its start time), or `None` when it cannot be told
    /// apart from a later process (another pid namespace, `/proc` unreadable). A client that
    /// later asks the socket path about its session compares this to tell its own daemon from
    /// another one started at the same path meanwhile.
    pub fn daemon_process(&self) -> Option<crate::peer::PeerProcess> {
        let credentials = getsockopt(&self.stream, PeerCredentials).ok()?;
        crate::peer::PeerProcess::of(u32::try_from(credentials.pid()).ok()?)
    }

    /// Requests sent on this connection so far.
    pub fn requests_sent(&self) -> u64 {
        self.requests_sent
    }

    /// Whether an earlier failure left the connection out of step, or the daemon ended it with
    /// a goodbye (every later call then fails with that goodbye's code again): reconnect.
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    /// Refuses a request whose body is `fixed_bytes` and then 4 bytes per token when that
    /// passes the frame cap, before any of it is encoded: a prompt of millions of tokens would
    /// otherwise be encoded whole (40 MB for 10M tokens) only to be refused
    /// ([`DaemonError::RequestTooLarge`], as `encode_frame` would; nothing sent, in step). A
    /// connection already out of step (or ended by the daemon) fails first as such, as every
    /// call on it does ([`Client::exchange`]): its callers reconnect rather than take the prompt
    /// for too long.
    fn check_tokens_fit(&self, kind: Kind, fixed_bytes: usize, tokens: &[u32]) -> Result<(), DaemonError> {
        use crate::protocol::BODY_BYTES_MAX;
        if let Some(broken) = &self.broken {
            return Err(broken.error());
        }
        let body_bytes = tokens.len().saturating_mul(4).saturating_add(fixed_bytes);
        if body_bytes > BODY_BYTES_MAX as usize {
            return Err(DaemonError::RequestTooLarge {
                kind,
                body_bytes: u32::try_from(body_bytes).unwrap_or(u32::MAX),
                cap_bytes: BODY_BYTES_MAX,
            });
        }
        Ok(())
    }

    /// A lookup's answer, `cached_blocks` blocks of `block_tokens` tokens, checked against the
    /// request before an engine plans loads from it: the daemon answers where the cached run
    /// from `first_block` ends, between `first_block` (or the prompt's end, when that is before
    /// it) and the prompt's full blocks, in the session's block size. Anything else is a
    /// daemon that does not keep the protocol: refused as a malformed `kind` (the reply it came
    /// in), and the connection out of step.
    fn checked_lookup(
        &mut self,
        kind: Kind,
        tokens: usize,
        first_block: u32,
        cached_blocks: u32,
        block_tokens: u32,
    ) -> Result<u32, DaemonError> {
        let problem = if block_tokens == 0 || self.block_tokens.is_some_and(|session| session != block_tokens) {
            Some(format!("blocks of {block_tokens} tokens in a session of {:?}-token blocks", self.block_tokens))
        } else {
            let full = tokens / block_tokens as usize;
            let start = (first_block as usize).min(full);
            (!(start..=full).contains(&(cached_blocks as usize))).then(|| {
                format!(
                    "a cached run from block {first_block} that ends at block {cached_blocks} of a {tokens}-token prompt of \
                     {full} full blocks of {block_tokens} tokens"
                )
            })
        };
        match problem {
            None => Ok(cached_blocks),
            Some(reason) => Err(self.bad_reply(kind, reason)),
        }
    }

    /// A reply that decoded but does not answer the request it came for (`reason`): the
    /// daemon does not keep the protocol, so the connection is marked out of step (the caller
    /// reconnects) and the reply refused as a malformed body.
    fn bad_reply(&mut self, kind: Kind, reason: String) -> DaemonError {
        let error = DaemonError::Protocol(crate::protocol::ProtocolError::MalformedBody { kind, reason });
        self.broken = Some(Broken::OutOfStep(format!("tuttid answered a request with a reply that does not fit it ({error})")));
        error
    }

    /// A `Hello` whose client name passes [`CLIENT_NAME_BYTES_MAX`](crate::protocol::CLIENT_NAME_BYTES_MAX)
    /// (64 bytes), which the daemon would refuse as `MalformedBody`: refused before a byte is
    /// sent, as the caller's argument ([`DaemonError::ClientNameTooLong`], the Python package's
    /// `InvalidArgument`).
    fn check_hello(request: &Request) -> Result<(), DaemonError> {
        use crate::protocol::CLIENT_NAME_BYTES_MAX;
        match request {
            Request::Hello(hello) if hello.client_name.len() > CLIENT_NAME_BYTES_MAX => {
                Err(DaemonError::ClientNameTooLong { name_bytes: hello.client_name.len(), max_bytes: CLIENT_NAME_BYTES_MAX })
            }
            _ => Ok(()),
        }
    }

    /// One request and its reply. A request refused before any byte of it is written (too
    /// large for a frame, too many descriptors) fails alone: nothing was sent, so no reply can
    /// come and the connection stays in step. Any later failure other than the daemon's answer
    /// to this very request leaves the connection out of step (a late reply may still be
    /// queued, a frame may be half written or read), so it is marked broken and refuses every
    /// later call: with the goodbye's code when the daemon ended it, as out of step otherwise.
    /// Descriptors that came with the reply are closed (only [`Client::call_with_fds`]'s
    /// caller takes them).
    fn exchange(&mut self, kind: Kind, encode: impl FnOnce(&mut Vec<u8>), fds: &[BorrowedFd<'_>]) -> Result<Reply, DaemonError> {
        self.exchange_with_fds(kind, encode, fds).map(|(reply, _received)| reply)
    }

    /// [`Client::exchange`], returning the descriptors that came with the reply too.
    fn exchange_with_fds(
        &mut self,
        kind: Kind,
        encode: impl FnOnce(&mut Vec<u8>),
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Reply, Vec<OwnedFd>), DaemonError> {
        if let Some(broken) = &self.broken {
            return Err(broken.error());
        }
        let request_id = self.next_request_id;
        self.next_request_id = self.next_request_id.wrapping_add(1).max(1);
        encode_frame(&mut self.frame, kind, request_id, encode).map_err(|error| match error {
            crate::protocol::ProtocolError::FrameTooLarge { body_bytes } => {
                DaemonError::RequestTooLarge { kind, body_bytes, cap_bytes: crate::protocol::BODY_BYTES_MAX }
            }
            // Not met: `encode_frame` fails only over the cap. Were it to fail otherwise, nothing
            // was sent and the connection stays in step, yet the Python package, which sees the
            // error alone, takes every `Protocol` error for a reply's (the connection out of
            // step): such a failure would need a variant of its own.
            other => DaemonError::Protocol(other),
        })?;
        // Checked here, not only by the send: a send that refuses them has written nothing
        // either, but from there it would read as a failed write (out of step).
        if fds.len() > FDS_PER_FRAME_MAX {
            return Err(DaemonError::Io {
                context: format!("sending a {kind:?} request with {} descriptors (at most {FDS_PER_FRAME_MAX} per frame)", fds.len()),
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            });
        }
        let outcome = self.exchange_in_step(kind, request_id, fds);
        // Taken on every way out: with the reply to the caller, or closed here with an `Error`
        // answer or a failure (up to 8 a frame), not kept open until the next read or the
        // client's drop.
        let received = std::mem::take(&mut self.fds);
        match outcome {
            Ok(Ok(reply)) => Ok((reply, received)),
            // The daemon refused this request: the stream is in step.
            Ok(Err(refusal)) => Err(refusal),
            Err(error) => {
                self.broken = Some(match &error {
                    DaemonError::Remote { code, message } if ends_the_connection(*code) => {
                        Broken::Ended { code: *code, message: message.clone() }
                    }
                    DaemonError::UnexpectedReply { .. } => {
                        Broken::OutOfStep(format!("tuttid answered an earlier {kind:?} request out of step ({error})"))
                    }
                    _ => Broken::OutOfStep(format!("an earlier {kind:?} request failed ({error}), so its reply may still be on the way")),
                });
                Err(error)
            }
        }
    }

    /// The exchange proper, of the request encoded in `self.frame`: `Ok(Err(..))` is the
    /// daemon's `Error` answer to this request (the connection stays usable); `Err(..)` is
    /// everything else that went wrong, a reply under another id or of a kind that does not
    /// answer this request ([`answer_kind`]) included (`UnexpectedReply`).
    fn exchange_in_step(&mut self, kind: Kind, request_id: u32, fds: &[BorrowedFd<'_>]) -> Result<Result<Reply, DaemonError>, DaemonError> {
        // One deadline for the whole call, the write included: the write may take what it
        // needs of it, and the reply must begin and end within what is left.
        let deadline = deadline_after(Instant::now(), self.timeout);
        self.requests_sent += 1;
        let written = match write_frame_with_fds_by(&self.stream, &self.frame, fds, deadline, self.timeout) {
            Ok(written) => written,
            // A daemon that refuses a connection (Busy) answers and closes without reading what
            // the client sent: a request written after that close fails, while the refusal
            // still waits in this socket. Report the refusal, not the close.
            Err(DaemonError::Closed) => return Err(self.queued_refusal().unwrap_or(DaemonError::Closed)),
            Err(other) => return Err(other),
        };
        let header = match read_frame_by(&self.stream, &mut self.body, &mut self.fds, deadline, self.timeout)? {
            ReadOutcome::Frame(header) => header,
            ReadOutcome::Closed => return Err(DaemonError::Closed),
            ReadOutcome::Idle | ReadOutcome::Stopped => {
                return Err(DaemonError::Timeout { what: format!("{kind:?} request"), after_ms: self.timeout.as_millis() as u64 })
            }
        };
        let reply = Reply::decode(header.kind, &self.body)?;
        // The request id first: an `Error` is this request's answer only with its id, or with
        // id 0 (the daemon ended the connection: lease, shutdown, a broken frame). Any other id
        // is a reply to an earlier request (one that timed out), never this one's. A frame that
        // came while the request was still being written (`PeerSpoke`) cannot be its answer
        // either: the daemon answers only a request it has read whole. Its goodbye, which it
        // sends while it drains the rest slowly, is reported at once rather than after the
        // deadline (the rest of the request is not sent: the connection is out of step).
        match reply {
            Reply::Error { code, message } if header.request_id == 0 => Err(DaemonError::Remote { code, message }),
            _ if header.request_id != request_id || written != Written::Whole => {
                Err(DaemonError::UnexpectedReply { asked: kind, got: header.kind })
            }
            Reply::Error { code, message } => Ok(Err(DaemonError::Remote { code, message })),
            // This request's id on a reply of a kind that never answers it: the daemon broke the
            // protocol (a buggy or foreign one), so nothing more it sends here is taken as in
            // step, as for a foreign id. Left usable, a store would go on sending requests (a
            // commit's slot already freed here, nothing released there) to a daemon that
            // answers them with something else.
            _ if answer_kind(kind) != Some(header.kind) => Err(DaemonError::UnexpectedReply { asked: kind, got: header.kind }),
            reply => Ok(Ok(reply)),
        }
    }

    /// An error reply the daemon queued before closing the connection, if one is there (looked
    /// for at most one read tick).
    fn queued_refusal(&mut self) -> Option<DaemonError> {
        let deadline = deadline_after(Instant::now(), TICK.min(self.timeout));
        match read_frame_by(&self.stream, &mut self.body, &mut self.fds, deadline, self.timeout) {
            Ok(ReadOutcome::Frame(header)) => match Reply::decode(header.kind, &self.body) {
                Ok(Reply::Error { code, message }) => Some(DaemonError::Remote { code, message }),
                _ => None,
            },
            _ => None,
        }
    }
}

/// The kind of reply tuttid answers a `request` of this kind with when it does not refuse it
/// (an `Error` answers any request); `None` for a reply kind, which no request is.
fn answer_kind(request: Kind) -> Option<Kind> {
    Some(match request {
        Kind::Hello => Kind::HelloReply,
        Kind::Lookup | Kind::LookupAllRanks => Kind::LookupReply,
        Kind::Status => Kind::StatusReply,
        Kind::Ping => Kind::Pong,
        Kind::RegisterMemory | Kind::RegisterDeviceMemory => Kind::Registered,
        Kind::AttachQueues => Kind::Attached,
        Kind::PoolShape => Kind::PoolShapeReply,
        Kind::PrepareRetrieve => Kind::RetrievePrepared,
        Kind::PrepareStore => Kind::StorePrepared,
        Kind::Commit => Kind::Committed,
        Kind::Release => Kind::Released,
        Kind::ClusterStatus => Kind::ClusterStatusReply,
        Kind::LookupCluster => Kind::ClusterLookupReply,
        Kind::FetchRemote => Kind::Fetched,
        Kind::HelloReply
        | Kind::LookupReply
        | Kind::StatusReply
        | Kind::Pong
        | Kind::Registered
        | Kind::Attached
        | Kind::PoolShapeReply
        | Kind::RetrievePrepared
        | Kind::StorePrepared
        | Kind::Committed
        | Kind::Released
        | Kind::ClusterStatusReply
        | Kind::ClusterLookupReply
        | Kind::Fetched
        | Kind::Error => return None,
    })
}

/// Connects to the Unix socket at `socket` within `timeout`. A blocking connect waits, with no
/// bound, while the listener's backlog is full (a daemon stopped with SIGSTOP, or stuck, whose
/// clients queue on its socket); a non-blocking one is refused at once then (EAGAIN), so it is
/// tried again, at most a tick apart, until the deadline: [`DaemonError::Timeout`]. Any other
/// refusal (no socket, no listener) is [`DaemonError::Io`] at once.
pub(crate) fn connect_within(socket: &Path, timeout: Duration) -> Result<UnixStream, DaemonError> {
    let io = |source: std::io::Error| DaemonError::Io { context: format!("connecting to tuttid at {}", socket.display()), source };
    let address = UnixAddr::new(socket).map_err(|errno| io(errno.into()))?;
    // Capped (at WAIT_MAX) so that the deadline is representable whatever the caller passed.
    let deadline = deadline_after(Instant::now(), timeout);
    let timed_out = || DaemonError::Timeout {
        what: format!("connecting to tuttid at {} (it does not take connections: its backlog is full)", socket.display()),
        after_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
    };
    let mut pause = Duration::from_millis(1);
    let connected = loop {
        let stream = new_socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK, None)
            .map_err(|errno| io(errno.into()))?;
        match connect(stream.as_raw_fd(), &address) {
            Ok(()) => break stream,
            // Not what Linux does for a Unix socket, but what a non-blocking connect may answer:
            // wait for it to complete, to the deadline.
            Err(Errno::EINPROGRESS) => {
                let left = deadline.saturating_duration_since(Instant::now());
                let wait = PollTimeout::try_from(left.as_micros().div_ceil(1000)).unwrap_or(PollTimeout::MAX);
                let mut polled = [PollFd::new(stream.as_fd(), PollFlags::POLLOUT)];
                match poll(&mut polled, wait) {
                    Ok(0) => return Err(timed_out()),
                    Ok(_) => match getsockopt(&stream, SocketError) {
                        Ok(0) => break stream,
                        Ok(errno) => return Err(io(std::io::Error::from_raw_os_error(errno))),
                        Err(errno) => return Err(io(errno.into())),
                    },
                    Err(Errno::EINTR) => {}
                    Err(errno) => return Err(io(errno.into())),
                }
            }
            // The backlog is full: try again shortly (a fresh socket each time).
            Err(Errno::EAGAIN) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(timed_out());
                }
                std::thread::sleep(pause.min(left));
                pause = pause.saturating_mul(2).min(TICK);
            }
            Err(Errno::EINTR) => {}
            Err(errno) => return Err(io(errno.into())),
        }
    };
    let stream = UnixStream::from(connected);
    stream.set_nonblocking(false).map_err(io)?;
    Ok(stream)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;
    use crate::frame_io::{read_frame, write_frame_with_fds};
    use crate::protocol::{ErrorCode, ProtocolError};

    /// Goal: a detached client (a stand-in for a connection lent elsewhere) fails every call
    /// at once as out of step (NotConnected, naming its cause), sends nothing, and needs no
    /// file system.
    #[test]
    fn a_detached_client_fails_every_call_at_once_as_out_of_step() {
        let mut client = Client::detached("lent to the keep-alive ping").unwrap();
        assert!(client.is_broken());
        let started = Instant::now();
        // A prompt too long for a frame included: the lost connection, not RequestTooLarge (a
        // Python LookupClient would raise InvalidArgument, not Disconnected).
        let long = vec![0u32; 300_000];
        for outcome in [
            client.ping(),
            client.status().map(drop),
            client.lookup(&[1, 2, 3]).map(drop),
            client.lookup(&long).map(drop),
            client.lookup_all_ranks(&long).map(drop),
            client.lookup_cluster(&long).map(drop),
            client.fetch_remote(&long).map(drop),
        ] {
            match outcome {
                Err(DaemonError::Io { context, source }) => {
                    assert_eq!(source.kind(), std::io::ErrorKind::NotConnected);
                    assert!(context.contains("lent to the keep-alive ping"), "{context}");
                }
                other => panic!("a detached client's call should fail as out of step, got {other:?}"),
            }
        }
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(client.requests_sent(), 0);
    }

    /// Goal: a daemon that answers Busy and closes before the client's request is written: the
    /// client reports Busy, not "the connection was closed" (seen as a flaky Python test).
    #[test]
    fn a_refusal_queued_before_the_close_is_reported_when_the_write_fails() {
        let directory = std::env::temp_dir().join(format!("tutti-client-refusal-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let socket = directory.join("socket");
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).unwrap();
        let daemon = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let reply = Reply::error(ErrorCode::Busy, "busy for the test");
            let mut frame = Vec::new();
            encode_frame(&mut frame, reply.kind(), 0, |out| reply.encode_body(out)).unwrap();
            write_frame_with_fds(&stream, &frame, &[]).unwrap();
        });
        let mut client = Client::connect(&socket, Duration::from_secs(2)).unwrap();
        daemon.join().unwrap();
        let outcome = client.status();
        std::fs::remove_dir_all(&directory).unwrap();
        match outcome {
            Err(DaemonError::Remote { code: ErrorCode::Busy, .. }) => {}
            other => panic!("expected the daemon's Busy, got {other:?}"),
        }
    }

    /// A client whose `Ping` a stand-in daemon answered with an id-0 `Error` of `code`: the ping
    /// was sent, failed with that code, and left the client broken. The directory holds the
    /// socket.
    fn broken_by_a_ping_answered(code: ErrorCode, message: &'static str) -> (tempfile::TempDir, Client) {
        let directory = tempfile::tempdir().unwrap();
        let socket = directory.path().join("socket");
        let listener = UnixListener::bind(&socket).unwrap();
        let daemon = std::thread::spawn(move || {
            let stream = accept_one(&listener);
            let ping = request_id(&stream, Duration::from_secs(5));
            answer(&stream, 0, &Reply::error(code, message));
            ping
        });
        let mut client = Client::connect(&socket, Duration::from_secs(2)).unwrap();
        let pinged = client.ping();
        assert!(daemon.join().unwrap().is_some(), "the ping was not sent");
        assert!(matches!(&pinged, Err(DaemonError::Remote { code: answered, .. }) if *answered == code), "{pinged:?}");
        assert!(client.is_broken());
        (directory, client)
    }

    /// Goal: a connection the daemon ended with a goodbye (an id-0 `Error` whose code ends the
    /// connection: here `ShuttingDown`, read by a keep-alive `Ping`) keeps that code for every
    /// later call on it: a lookup, a status, a prompt too long for a frame, each fails at once
    /// with `Remote { ShuttingDown }` naming what the daemon said, sends nothing, so that
    /// `RemoteKvStore` and Python report `Disconnected` with the daemon's code whichever call
    /// read the goodbye. Before, only the call that read it had the code; later ones were `Io`
    /// (`NotConnected`), and Python's `Disconnected` had code None.
    #[test]
    fn a_goodbye_read_by_a_ping_is_kept_for_every_later_call() {
        let (_directory, mut client) = broken_by_a_ping_answered(ErrorCode::ShuttingDown, "tuttid is stopping for the test");
        let started = Instant::now();
        let long = vec![0u32; 300_000];
        for (what, outcome) in [
            ("lookup", client.lookup(&[1, 2, 3]).map(drop)),
            ("status", client.status().map(drop)),
            ("a lookup too long for a frame", client.lookup(&long).map(drop)),
            ("fetch_remote", client.fetch_remote(&long).map(drop)),
        ] {
            match outcome {
                Err(DaemonError::Remote { code: ErrorCode::ShuttingDown, message }) => {
                    assert!(message.contains("tuttid is stopping for the test") && message.contains("reconnect"), "{what}: {message}")
                }
                other => panic!("{what} on a connection the daemon ended: {other:?}"),
            }
        }
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(client.requests_sent(), 1, "a call on the ended connection sent a request");
    }

    /// Goal: a connection broken by anything but a goodbye (here a Busy under id 0, which is also
    /// a per-request answer, so not one of `ends_the_connection`'s codes) is out of step as
    /// before: later calls fail at once as `Io` (`NotConnected`), with no daemon code.
    #[test]
    fn a_connection_broken_by_no_goodbye_is_out_of_step_without_a_code() {
        let (_directory, mut client) = broken_by_a_ping_answered(ErrorCode::Busy, "busy for the test");
        match client.lookup(&[1, 2, 3]) {
            Err(DaemonError::Io { context, source }) => {
                assert_eq!(source.kind(), std::io::ErrorKind::NotConnected);
                assert!(context.contains("reconnect"), "{context}");
            }
            other => panic!("a lookup on a connection broken by Busy: {other:?}"),
        }
    }

    /// A listener with a one-connection backlog that never accepts, its backlog filled (what a
    /// stopped daemon's socket looks like once clients queue on it); returns it with the
    /// queued connections, which keep the backlog full while held.
    pub(crate) fn full_listener(socket: &std::path::Path) -> (OwnedFd, Vec<OwnedFd>) {
        use nix::sys::socket::{bind, connect, listen, socket as new_socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
        let address = UnixAddr::new(socket).unwrap();
        let listener = new_socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
        bind(listener.as_raw_fd(), &address).unwrap();
        listen(&listener, Backlog::new(1).unwrap()).unwrap();
        let mut queued = Vec::new();
        // Bounded: the kernel refuses (EAGAIN) once backlog + 1 connections wait.
        for _ in 0..64 {
            let stream = new_socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK, None).unwrap();
            match connect(stream.as_raw_fd(), &address) {
                Ok(()) => queued.push(stream),
                Err(nix::errno::Errno::EAGAIN) => return (listener, queued),
                Err(errno) => panic!("filling the backlog: {errno}"),
            }
        }
        panic!("the backlog took 64 connections");
    }

    /// Goal: `Client::connect`'s timeout bounds the connect too: a Unix connect waits while the
    /// listener's backlog is full (a daemon stopped with SIGSTOP, or stuck), so a client must
    /// get an error within about its timeout rather than wait for as long as the daemon is.
    #[test]
    fn a_connect_to_a_full_backlog_fails_within_the_timeout() {
        let directory = tempfile::tempdir().unwrap();
        let socket = directory.path().join("socket");
        let (_listener, _queued) = full_listener(&socket);
        let (sender, outcome) = std::sync::mpsc::channel();
        let started = Instant::now();
        let connecting = socket.clone();
        // In a thread: a connect without a bound would otherwise hang the test.
        std::thread::spawn(move || {
            let _ = sender.send(Client::connect(&connecting, Duration::from_millis(200)).map(|_| ()));
        });
        let outcome = outcome.recv_timeout(Duration::from_secs(3));
        let took = started.elapsed();
        match outcome {
            Ok(Err(DaemonError::Timeout { .. })) => assert!(took < Duration::from_secs(1), "the connect failed after {took:?}"),
            other => panic!("a connect to a full backlog: {other:?} after {took:?}"),
        }
    }

    /// Answers the frame just read on `stream` with `reply` under `request_id`.
    /// The test daemon's one connection, read with the client's tick and written within 2 s.
    fn accept_one(listener: &UnixListener) -> UnixStream {
        let (stream, _) = listener.accept().unwrap();
        stream.set_read_timeout(Some(TICK)).unwrap();
        stream.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
        stream
    }

    fn answer(stream: &UnixStream, request_id: u32, reply: &Reply) {
        let mut frame = Vec::new();
        encode_frame(&mut frame, reply.kind(), request_id, |out| reply.encode_body(out)).unwrap();
        write_frame_with_fds(stream, &frame, &[]).unwrap();
    }

    /// Reads one request from `stream` within `wait`: its request id, or `None` if none came.
    fn request_id(stream: &UnixStream, wait: Duration) -> Option<u32> {
        let (mut body, mut fds) = (Vec::new(), Vec::new());
        let never = || false;
        match read_frame(stream, &mut body, &mut fds, Instant::now() + wait, wait, &never) {
            Ok(ReadOutcome::Frame(header)) => Some(header.request_id),
            _ => None,
        }
    }

    /// Goal: a client connected with the longest timeout a caller can pass (`Duration::MAX`,
    /// "wait for ever") computes its deadlines without overflowing `Instant`: a ping is
    /// answered, and a read that finds the daemon gone is an error, never a panic.
    #[test]
    fn a_huge_timeout_never_overflows_a_deadline() {
        let directory = tempfile::tempdir().unwrap();
        let socket = directory.path().join("socket");
        let listener = UnixListener::bind(&socket).unwrap();
        let daemon = std::thread::spawn(move || {
            let stream = accept_one(&listener);
            let ping = request_id(&stream, Duration::from_secs(5)).expect("the ping");
            answer(&stream, ping, &Reply::Pong);
            // Then the daemon goes: the next request's read meets the close.
        });
        // The daemon thread is joined inside: the closure owns it (AssertUnwindSafe: a panic
        // leaves nothing shared behind that this test reads).
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut client = Client::connect(&socket, Duration::MAX).expect("connect");
            let pong = client.ping();
            daemon.join().unwrap();
            (pong.map_err(|error| error.to_string()), client.ping().map_err(|error| error.to_string()))
        }));
        match outcome {
            Ok((pong, after_close)) => {
                assert_eq!(pong, Ok(()), "the ping");
                assert!(after_close.is_err(), "a ping to a closed daemon: {after_close:?}");
            }
            Err(panic) => {
                let message = panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|text| text.to_string()));
                panic!("a client with a timeout of Duration::MAX panicked: {message:?}");
            }
        }
    }

    /// Goal: a request that timed out, whose reply (an `Error`) comes late, leaves the
    /// connection out of step: the next call on it fails at once with an error callers treat
    /// as a lost connection (an `Io` error, so `Disconnected`), never the earlier request's
    /// error (or reply) as its own; a new connection is served as usual.
    #[test]
    fn a_late_reply_after_a_timeout_is_never_taken_for_the_next_requests() {
        let directory = std::env::temp_dir().join(format!("tutti-client-late-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let socket = directory.join("socket");
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).unwrap();
        let timeout = Duration::from_millis(200);
        let daemon = std::thread::spawn(move || {
            let stream = accept_one(&listener);
            let first = request_id(&stream, Duration::from_secs(5)).expect("the first request");
            std::thread::sleep(timeout * 2);
            answer(&stream, first, &Reply::error(ErrorCode::LimitReached, "the first request's late refusal"));
            // A client that sends a second request on this connection gets it answered (Pong):
            // a client reading replies one behind would then take the refusal above as its own.
            let second = request_id(&stream, Duration::from_secs(2));
            if let Some(second) = second {
                answer(&stream, second, &Reply::Pong);
            }
            let (fresh, _) = listener.accept().unwrap();
            fresh.set_read_timeout(Some(TICK)).unwrap();
            fresh.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
            let ping = request_id(&fresh, Duration::from_secs(5)).expect("the new connection's request");
            answer(&fresh, ping, &Reply::Pong);
            second
        });
        let mut client = Client::connect(&socket, timeout).unwrap();
        let first = client.ping();
        assert!(matches!(first, Err(DaemonError::Timeout { .. })), "{first:?}");
        assert!(client.is_broken());
        // Past the late refusal's arrival: it waits in the socket now.
        std::thread::sleep(timeout * 3);
        let second = client.ping();
        match &second {
            Err(DaemonError::Io { context, source }) => {
                assert_eq!(source.kind(), std::io::ErrorKind::NotConnected);
                assert!(context.contains("reconnect"), "{context}");
            }
            other => panic!("the second call should fail as out of step, got {other:?}"),
        }
        drop(client);
        let mut fresh = Client::connect(&socket, Duration::from_secs(5)).unwrap();
        fresh.ping().expect("a new connection is served");
        let sent_again = daemon.join().unwrap();
        std::fs::remove_dir_all(&directory).unwrap();
        assert_eq!(sent_again, None, "the broken connection sent another request");
    }

    /// Goal: a request refused before any byte of it is written (a Lookup too large for one
    /// frame) fails with that refusal and leaves the connection in step: nothing was sent, so
    /// no late reply can come, and the next call on it is served. Before, any failure marked
    /// the connection broken, and a long prompt's lookup cut the engine's session.
    #[test]
    fn a_request_refused_before_it_is_sent_leaves_the_connection_usable() {
        let directory = tempfile::tempdir().unwrap();
        let socket = directory.path().join("socket");
        let listener = UnixListener::bind(&socket).unwrap();
        let daemon = std::thread::spawn(move || {
            let stream = accept_one(&listener);
            let ping = request_id(&stream, Duration::from_secs(5))?;
            answer(&stream, ping, &Reply::Pong);
            Some(ping)
        });
        let mut client = Client::connect(&socket, Duration::from_secs(5)).unwrap();
        // 8 + 4 x 262,143 body bytes: 4 over the 1 MiB body cap.
        let tokens = vec![0u32; 262_143];
        match client.lookup(&tokens) {
            Err(DaemonError::RequestTooLarge { kind: Kind::Lookup, .. }) => {}
            other => panic!("a lookup over the frame cap: {other:?}"),
        }
        assert!(!client.is_broken(), "a request never sent left the connection out of step");
        // And one with more descriptors than a frame carries.
        let file = tempfile::tempfile().unwrap();
        let fds = vec![file.as_fd(); FDS_PER_FRAME_MAX + 1];
        match client.call_with_fds(&Request::Ping, &fds) {
            Err(DaemonError::Io { source, .. }) if source.kind() == std::io::ErrorKind::InvalidInput => {}
            other => panic!("a request with {} descriptors: {other:?}", fds.len()),
        }
        assert!(!client.is_broken(), "a request never sent left the connection out of step");
        assert_eq!(client.requests_sent(), 0);
        let pong = client.ping();
        drop(client);
        let ping = daemon.join().unwrap();
        pong.expect("the ping after the refused lookup");
        assert!(ping.is_some());
    }

    /// Goal: a client name the daemon would refuse (over CLIENT_NAME_BYTES_MAX, 64 bytes) is
    /// refused here, before a byte is sent, as the caller's argument (ClientNameTooLong: the
    /// Python package's InvalidArgument), not sent and answered MalformedBody; a name of exactly
    /// 64 bytes is sent.
    #[test]
    fn a_client_name_over_the_daemons_cap_is_refused_before_it_is_sent() {
        let directory = tempfile::tempdir().unwrap();
        let socket = directory.path().join("socket");
        let listener = UnixListener::bind(&socket).unwrap();
        let daemon = std::thread::spawn(move || {
            let stream = accept_one(&listener);
            let (mut body, mut fds) = (Vec::new(), Vec::new());
            let wait = Duration::from_secs(5);
            let header = match read_frame(&stream, &mut body, &mut fds, Instant::now() + wait, wait, &|| false) {
                Ok(ReadOutcome::Frame(header)) => header,
                _ => return None,
            };
            let request = Request::decode(header.kind, &body).ok()?;
            answer(&stream, header.request_id, &Reply::Pong);
            Some(request)
        });
        let mut client = Client::connect(&socket, Duration::from_secs(5)).unwrap();
        let hello = |client_name: String| Hello { model_fingerprint: [7; 32], tp_rank: 0, tp_world: 1, client_name };
        match client.hello(&hello("é".repeat(crate::protocol::CLIENT_NAME_BYTES_MAX / 2) + "x")) {
            Err(error @ DaemonError::ClientNameTooLong { name_bytes: 65, max_bytes: 64 }) => {
                assert!(error.to_string().contains("client name of 65 bytes"), "{error}")
            }
            other => panic!("a 65-byte client name: {other:?}"),
        }
        assert!(!client.is_broken());
        assert_eq!(client.requests_sent(), 0);
        let longest = hello("n".repeat(crate::protocol::CLIENT_NAME_BYTES_MAX));
        // The stand-in daemon answers Pong: the hello was sent (and the reply is unexpected).
        assert!(matches!(client.hello(&longest), Err(DaemonError::UnexpectedReply { .. })));
        drop(client);
        assert_eq!(daemon.join().unwrap(), Some(Request::Hello(longest)));
    }

    /// Goal: a call waits at most its timeout (and a read tick) in all, whenever the reply
    /// begins: a reply whose first bytes come just before the timeout and the rest well after
    /// it is a Timeout at about the timeout, not a wait of a second timeout from its first byte.
    #[test]
    fn a_reply_begun_just_before_the_timeout_is_not_waited_for_past_it() {
        let directory = tempfile::tempdir().unwrap();
        let socket = directory.path().join("socket");
        let listener = UnixListener::bind(&socket).unwrap();
        let timeout = Duration::from_millis(500);
        let daemon = std::thread::spawn(move || {
            let stream = accept_one(&listener);
            let received = Instant::now();
            let Some(ping) = request_id(&stream, Duration::from_secs(5)) else { return };
            let mut frame = Vec::new();
            encode_frame(&mut frame, Reply::Pong.kind(), ping, |out| Reply::Pong.encode_body(out)).unwrap();
            std::thread::sleep((timeout - Duration::from_millis(10)).saturating_sub(received.elapsed()));
            let mut writer = &stream;
            // The client may have given up and closed by then: errors end the test daemon.
            if std::io::Write::write_all(&mut writer, &frame[..4]).is_err() {
                return;
            }
            std::thread::sleep(timeout * 3 / 2);
            let _ = std::io::Write::write_all(&mut writer, &frame[4..]);
        });
        let mut client = Client::connect(&socket, timeout).unwrap();
        let started = Instant::now();
        let outcome = client.ping();
        let took = started.elapsed();
        drop(client);
        daemon.join().unwrap();
        assert!(matches!(outcome, Err(DaemonError::Timeout { .. })), "{outcome:?} after {took:?}");
        assert!(took < timeout + Duration::from_millis(250), "the call waited {took:?} with a timeout of {timeout:?}");
    }

    /// Goal: a request larger than the socket's send room, to a daemon that has ended the
    /// session (its goodbye, an id-0 `Error`, queued in this socket; its write side shut) and
    /// now drains what the client still sends slowly (4 KiB a tick, as `await_peer_exit`), fails
    /// at once with that goodbye (`Remote { LeaseExpired }`: the session is gone), not after the
    /// whole timeout as a `Timeout` (which callers treat as a slow daemon and back off from).
    #[test]
    fn a_goodbye_queued_while_a_large_request_is_written_is_reported_at_once() {
        let directory = tempfile::tempdir().unwrap();
        let socket = directory.path().join("socket");
        let listener = UnixListener::bind(&socket).unwrap();
        let (said_goodbye, goodbye_said) = std::sync::mpsc::channel();
        let daemon = std::thread::spawn(move || {
            let stream = accept_one(&listener);
            let goodbye = Reply::error(ErrorCode::LeaseExpired, "no frame for 100 ms; the session is ended");
            answer(&stream, 0, &goodbye);
            stream.shutdown(std::net::Shutdown::Write).unwrap();
            said_goodbye.send(()).unwrap();
            // Drains 4 KiB a tick until the client closes, at most 5 s (bounded).
            let started = Instant::now();
            let mut chunk = [0u8; 4096];
            let mut reader = &stream;
            while started.elapsed() < Duration::from_secs(5) {
                match std::io::Read::read(&mut reader, &mut chunk) {
                    Ok(0) => break,
                    Ok(_) => std::thread::sleep(TICK),
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock || error.kind() == std::io::ErrorKind::TimedOut => {}
                    Err(_) => break,
                }
            }
        });
        let mut client = Client::connect(&socket, Duration::from_secs(2)).unwrap();
        goodbye_said.recv_timeout(Duration::from_secs(5)).expect("the stand-in daemon's goodbye");
        // 1 MiB of body: far more than the socket's send room.
        let tokens = vec![0u32; 262_142];
        let started = Instant::now();
        let outcome = client.lookup(&tokens);
        let took = started.elapsed();
        let broken = client.is_broken();
        drop(client);
        daemon.join().unwrap();
        assert!(matches!(outcome, Err(DaemonError::Remote { code: ErrorCode::LeaseExpired, .. })), "{outcome:?} after {took:?}");
        assert!(took < Duration::from_millis(300), "the goodbye was reported after {took:?}");
        assert!(broken, "a connection the daemon ended is out of step");
    }

    /// Goal: descriptors that come with a reply its caller does not take (a `Pong`, an `Error`
    /// refusal, a reply that breaks the connection) are closed when the call returns, not kept
    /// open until the next reply is read or the client drops: a stand-in daemon sends a pipe's
    /// write end with each, and the read end sees the end of the pipe once the call returns.
    #[test]
    fn descriptors_that_come_with_a_reply_no_caller_takes_are_closed_when_the_call_returns() {
        for (what, reply) in [
            ("a Pong", Reply::Pong),
            ("an Error", Reply::error(ErrorCode::LimitReached, "refused for the test")),
            ("a reply of another kind", Reply::Released),
        ] {
            let directory = tempfile::tempdir().unwrap();
            let socket = directory.path().join("socket");
            let listener = UnixListener::bind(&socket).unwrap();
            let (reader, writer) = std::io::pipe().unwrap();
            let daemon = std::thread::spawn(move || {
                let stream = accept_one(&listener);
                if let Some(ping) = request_id(&stream, Duration::from_secs(5)) {
                    let mut frame = Vec::new();
                    encode_frame(&mut frame, reply.kind(), ping, |out| reply.encode_body(out)).unwrap();
                    write_frame_with_fds(&stream, &frame, &[writer.as_fd()]).unwrap();
                }
                // The daemon's own write end closes here: the client's is the last one.
                drop(writer);
                stream
            });
            let mut client = Client::connect(&socket, Duration::from_secs(2)).unwrap();
            let outcome = client.ping();
            // Held until the check: the connection stays open, and so does anything it holds.
            let _stream = daemon.join().unwrap();
            assert_eq!(outcome.is_ok(), what == "a Pong", "{what}: {outcome:?}");
            let mut polled = [PollFd::new(reader.as_fd(), PollFlags::POLLIN)];
            let ready = poll(&mut polled, PollTimeout::from(200u16)).unwrap();
            let hung_up = ready == 1 && polled[0].revents().is_some_and(|events| events.contains(PollFlags::POLLHUP));
            assert!(hung_up, "{what}: the pipe's write end is still open after the call returned");
            drop(client);
        }
    }

    /// Runs `call` on a client of a stand-in daemon that answers its one request with `reply`:
    /// the outcome, and whether the connection is marked out of step after it.
    fn answered_with<T>(reply: Reply, call: impl FnOnce(&mut Client) -> Result<T, DaemonError>) -> (Result<T, DaemonError>, bool) {
        let directory = tempfile::tempdir().unwrap();
        let socket = directory.path().join("socket");
        let listener = UnixListener::bind(&socket).unwrap();
        let daemon = std::thread::spawn(move || {
            let stream = accept_one(&listener);
            if let Some(request) = request_id(&stream, Duration::from_secs(5)) {
                answer(&stream, request, &reply);
            }
        });
        let mut client = Client::connect(&socket, Duration::from_secs(2)).unwrap();
        let outcome = call(&mut client);
        let broken = client.is_broken();
        drop(client);
        daemon.join().unwrap();
        (outcome, broken)
    }

    /// Goal: lookup counts are socket data, checked before an engine plans loads from them: a
    /// count past the prompt's full blocks, below the run's start, or under a block size of 0
    /// (a buggy or foreign daemon) is a clear error that leaves the connection out of step
    /// (reconnect), not a count past the prompt; so is a fetch that reports more blocks than the
    /// prompt has, and a cluster lookup whose remote blocks (in all or a holder's) pass it. A
    /// count within the prompt is returned.
    #[test]
    fn lookup_counts_past_the_prompt_are_refused() {
        let lookup = |cached_blocks, block_tokens| Reply::Lookup { cached_blocks, block_tokens };
        let tokens = vec![7u32; 32];
        let (within, broken) = answered_with(lookup(2, 16), |client| client.lookup(&tokens));
        assert_eq!(within.unwrap(), 2);
        assert!(!broken);
        for (first_block, reply, what) in [
            (0, lookup(5, 16), "5 blocks of a 2-block prompt"),
            (0, lookup(3, 16), "3 blocks of a 2-block prompt"),
            (2, lookup(1, 16), "a run from block 2 that ends at block 1"),
            (0, lookup(0, 0), "blocks of 0 tokens"),
        ] {
            let (outcome, broken) = answered_with(reply.clone(), |client| client.lookup_from(&tokens, first_block));
            assert!(matches!(outcome, Err(DaemonError::Protocol(ProtocolError::MalformedBody { .. }))), "{what}: {outcome:?}");
            assert!(broken, "{what}: the connection is still taken as in step");
            let (outcome, _) = answered_with(reply, |client| client.lookup_all_ranks_from(&tokens, first_block));
            assert!(matches!(outcome, Err(DaemonError::Protocol(ProtocolError::MalformedBody { .. }))), "{what} (all ranks): {outcome:?}");
        }
        // A fetch answers the local prefix after it (the fetched blocks included) and the blocks
        // it fetched: each at most the prompt's full blocks (here, no Hello answered, blocks of
        // at least a token: 32).
        let fetch = |cached_blocks, fetched_blocks| Reply::Fetched { cached_blocks, fetched_blocks };
        for (cached, fetched) in [(33, 0), (0, 33), (u32::MAX, 2)] {
            let (outcome, broken) = answered_with(fetch(cached, fetched), |client| client.fetch_remote(&tokens));
            assert!(matches!(outcome, Err(DaemonError::Protocol(ProtocolError::MalformedBody { .. }))), "{cached}, {fetched}: {outcome:?}");
            assert!(broken);
        }
        for (cached, fetched) in [(1, 1), (32, 32)] {
            let (outcome, broken) = answered_with(fetch(cached, fetched), |client| client.fetch_remote(&tokens));
            assert_eq!(outcome.unwrap(), (cached, fetched));
            assert!(!broken);
        }
        // A cluster lookup answers the local prefix as Lookup does, then the blocks past it other
        // nodes hold, in all and per holder: each within the prompt's full blocks past the local
        // prefix (2 blocks of 16 tokens here).
        let holder = |blocks| crate::protocol::RemoteHolder { node: "b".into(), blocks };
        let cluster = |cached_blocks, block_tokens, remote_blocks, holders| {
            Reply::ClusterLookup(crate::protocol::ClusterLookupReply {
                cached_blocks,
                block_tokens,
                registry: crate::protocol::RegistryAnswer::Answered,
                remote_blocks,
                holders,
            })
        };
        for (reply, what) in [
            (cluster(3, 16, 0, vec![]), "3 local blocks of a 2-block prompt"),
            (cluster(0, 0, 0, vec![]), "blocks of 0 tokens"),
            (cluster(1, 16, 2, vec![holder(1)]), "1 local and 2 remote blocks of a 2-block prompt"),
            (cluster(1, 16, u32::MAX, vec![holder(1)]), "u32::MAX remote blocks"),
            (cluster(1, 16, 1, vec![holder(1), holder(2)]), "a holder of 2 blocks past 1 local of a 2-block prompt"),
        ] {
            let (outcome, broken) = answered_with(reply, |client| client.lookup_cluster(&tokens));
            assert!(matches!(outcome, Err(DaemonError::Protocol(ProtocolError::MalformedBody { .. }))), "{what}: {outcome:?}");
            assert!(broken, "{what}: the connection is still taken as in step");
        }
        for reply in [cluster(2, 16, 0, vec![]), cluster(0, 16, 2, vec![holder(2), holder(1)]), cluster(1, 16, 1, vec![holder(1)])] {
            let (outcome, broken) = answered_with(reply.clone(), |client| client.lookup_cluster(&tokens));
            assert_eq!(Reply::ClusterLookup(outcome.unwrap()), reply);
            assert!(!broken);
        }
    }

    /// Goal: a request over the frame cap (a lookup of 4M tokens: a 16 MB body) is refused
    /// without the connection keeping a buffer of its size for the rest of its life: the
    /// client's frame buffer stays within one frame's bytes. A lookup or fetch of a prompt too
    /// long for a frame is refused before any of it is encoded (nothing allocated at all).
    #[test]
    fn a_request_over_the_cap_leaves_no_buffer_of_its_size_behind() {
        let directory = tempfile::tempdir().unwrap();
        let socket = directory.path().join("socket");
        // Never accepted: the request is refused before a byte is sent.
        let _listener = UnixListener::bind(&socket).unwrap();
        let mut client = Client::connect(&socket, Duration::from_secs(2)).unwrap();
        let tokens = vec![0u32; 4_000_000];
        let cap = crate::protocol::HEADER_BYTES + crate::protocol::BODY_BYTES_MAX as usize;
        for (what, outcome) in [
            ("lookup", client.lookup(&tokens).map(drop)),
            ("lookup_all_ranks", client.lookup_all_ranks(&tokens).map(drop)),
            ("lookup_cluster", client.lookup_cluster(&tokens).map(drop)),
            ("fetch_remote", client.fetch_remote(&tokens).map(drop)),
        ] {
            assert!(matches!(outcome, Err(DaemonError::RequestTooLarge { .. })), "{what}: {outcome:?}");
        }
        assert_eq!(client.frame.capacity(), 0, "a prompt too long for a frame was encoded");
        let request = Request::Lookup { tokens, first_block: 0 };
        let outcome = client.call(&request);
        assert!(matches!(outcome, Err(DaemonError::RequestTooLarge { .. })), "{outcome:?}");
        assert!(client.frame.capacity() <= cap, "the frame buffer kept {} bytes (a frame is at most {cap})", client.frame.capacity());
        assert!(!client.is_broken());
        // The check before encoding draws the line where encoding does, for both bodies.
        let mut frame = Vec::new();
        for count in [262_141, 262_142, 262_143, 262_144] {
            let tokens = vec![0u32; count];
            let checked = client.check_tokens_fit(Kind::LookupCluster, LOOKUP_FIXED_BYTES, &tokens).is_ok();
            let encoded = encode_frame(&mut frame, Kind::LookupCluster, 1, |out| encode_lookup_body(&tokens, out)).is_ok();
            assert_eq!(checked, encoded, "a lookup body of {count} tokens");
            let checked = client.check_tokens_fit(Kind::Lookup, LOOKUP_FROM_FIXED_BYTES, &tokens).is_ok();
            let encoded = encode_frame(&mut frame, Kind::Lookup, 1, |out| encode_lookup_from_body(&tokens, 3, out)).is_ok();
            assert_eq!(checked, encoded, "a lookup-from body of {count} tokens");
        }
    }
}
