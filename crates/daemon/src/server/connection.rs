//! One client connection: its credentials, then request frames until it closes, its lease runs
//! out, it breaks the protocol or the server stops; its session is released on every path out.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read};
use std::net::Shutdown;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::time::Instant;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use crate::cluster::{ClusterAgent, PreparedStores};
use crate::frame_io::{read_frame, write_frame, write_frame_with_fds, ReadOutcome};
use crate::keys::{KeySpace, RankChains};
use crate::metrics::RequestLabel;
use crate::peer::PeerProcess;
use crate::protocol::{encode_frame, ClusterStatusReply, ErrorCode, HelloReply, Kind, Reply, Request};
use crate::session::{Holdings, Released};
use crate::DaemonError;

use super::{lock, mark_kept, status, ServerConfig, SessionRecord, Shared};

/// One connection's life: credentials, then frames until it closes, its lease runs out, it
/// breaks the protocol, or the server stops. Its session is released on every path out, a
/// panic included: a handler's panic (a bug) is caught and ends the connection as a protocol
/// error would, and [`Ended`] releases the session and uncounts the connection even if what
/// follows panics too.
pub(super) fn serve_connection(mut stream: UnixStream, shared: &Shared, status_only: bool) {
    let mut ended = Ended {
        shared,
        connection: Connection {
            status_only,
            session: None,
            peer_pid: 0,
            peer_uid: 0,
            peer: None,
            ending: Ending::Other,
            keys: Vec::new(),
            chains: RankChains::default(),
            holdings: Holdings::default(),
            prepared_stores: PreparedStores::default(),
        },
    };
    let connection = &mut ended.connection;
    // AssertUnwindSafe: after a panic the connection's state is only released (in the safe
    // order, `release_session`), never served from again; the shared state's mutexes are taken
    // through `lock`, which accepts a poisoned one (see there).
    let outcome = match std::panic::catch_unwind(AssertUnwindSafe(|| connection.run(&mut stream, shared))) {
        Ok(outcome) => outcome,
        Err(_) => {
            tracing::error!("the connection of pid {} panicked serving a request; its session is released", connection.peer_pid);
            // The client may be running its data path still: `Ending::Other`.
            connection.ending = Ending::Other;
            Err(DaemonError::Io { context: "serving a request".into(), source: std::io::Error::other("the connection's handler panicked") })
        }
    };
    if outcome.as_ref().is_err_and(closed_by_peer) {
        connection.ending = Ending::PeerClosed;
    }
    if let Some(session) = connection.session {
        if connection.may_still_ring(shared) {
            connection.await_peer_exit(shared, session, &mut stream);
        }
    }
    let peer_pid = connection.peer_pid;
    // The release and the uncounting, here or on a panic's unwinding.
    drop(ended);
    if let Err(error) = outcome {
        tracing::info!("connection of pid {peer_pid} ended: {error}");
    }
}

/// What every way out of a connection does, in its `Drop`: releases the session (relay tickets,
/// then queue pairs, then reservations, then windows: [`Holdings::release`]) and uncounts the
/// connection. A `Drop` so that a panic anywhere after the connection was counted cannot skip
/// them: a session left unreleased would keep its queue ids relayed to whichever client gets
/// them next, its reservations pinned, and its record listed.
struct Ended<'a> {
    shared: &'a Shared,
    connection: Connection,
}

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        // Uncounted after the release, but even if the release panics: a local's drop runs on
        // unwinding too. A release that left the pairs retiring (deletion not confirmed yet)
        // uncounts the connection too: their queue ids stay held, and a new client's attach
        // that finds them filling a controller is answered Busy (retry), not LimitReached.
        struct Uncount<'a>(&'a std::sync::atomic::AtomicU32);
        impl Drop for Uncount<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let _uncount = Uncount(&self.shared.connections);
        let Some(session) = self.connection.session.take() else { return };
        // The reservations it ends with, exact (a handler that panicked did not mirror them):
        // a session that keeps them (retiring, kept for good) is counted by them at a registration.
        if let Some(record) = lock(&self.shared.sessions).get_mut(&session) {
            record.requests_in_flight = self.connection.holdings.requests_in_flight();
        }
        if std::thread::panicking() {
            // A panic after the handler's (caught) one: in the wait for the client's exit, or
            // in deciding whether to wait. Whether the client still rings its queues is not
            // known, so nothing it may write is released (and a panic inside a release here
            // would abort the daemon).
            // Kept listed while it holds reservations, pairs or not: they are never released now,
            // and only a record counts them against the table (`reservations_refusal`).
            let requests = self.connection.holdings.requests_in_flight();
            if self.connection.holdings.leak(&self.shared.store, &self.shared.leaks) > 0 || requests > 0 {
                mark_kept(self.shared, session);
            } else {
                lock(&self.shared.sessions).remove(&session);
            }
        } else {
            release_session(self.shared, session, &mut self.connection.holdings);
        }
    }
}

/// Refuses a session's first registration (`RegisterMemory`, `RegisterDeviceMemory`) when it
/// could not be given `--requests-per-session` reservations. The pool's table holds
/// `clients_max` × that many (sized in `Server::bind_prepared`), and a session is promised its
/// whole share from its first registration on: only a registered session can prepare, so a
/// session that only looks up (an engine's scheduler, `LookupClient`) is promised none, and its
/// `Hello` is admitted by the connection cap alone. An ended session that keeps its reservations
/// (retiring: its queue pairs' deletion not confirmed yet, so they may still write the slots; or
/// kept for good) no longer counts as a connection, so without this a session admitted in its
/// place would find the table short and its prepares refused `LimitReached`, for good where a
/// kept session holds them. Counted under the sessions lock, `this` session left out: promised
/// live sessions (awaiting their client's exit included) at their whole share, ended ones at
/// what they hold.
/// `LimitReached` only when the sessions kept for good alone leave no share (nothing but a
/// restart gives theirs back); otherwise `Busy` (retry shortly: `RemoteKvStore` asks again),
/// the retiring sessions' reservations and the live sessions' shares coming back as they end,
/// as an attach is for retiring sessions' queue ids.
fn reservations_refusal(sessions: &BTreeMap<u64, SessionRecord>, this: u64, config: &ServerConfig) -> Option<Reply> {
    let share = config.session_limits.requests_max;
    let table = config.clients_max.saturating_mul(share);
    let (mut promised, mut retiring, mut kept) = (0usize, 0usize, 0usize);
    for (&session, record) in sessions {
        let held = record.requests_in_flight as usize;
        match (record.kept, record.retiring) {
            (true, _) => kept += held,
            (false, true) => retiring += held,
            (false, false) if session != this && record.promised => promised += share,
            // Unregistered (it holds none) or this session itself.
            (false, false) => {}
        }
    }
    if promised.saturating_add(retiring).saturating_add(kept).saturating_add(share) <= table {
        return None;
    }
    let held = format!(
        "{retiring} of the daemon's {table} request reservations are held by ended sessions whose queue pairs' deletion is not \
         confirmed yet and {kept} by sessions kept for good (queue pairs not known deleted); {promised} are promised to live \
         sessions that registered memory, and a new one needs {share} (--requests-per-session)"
    );
    // Permanent only when the kept ones alone leave no share: the retiring ones come back once
    // their deletion is confirmed (or are kept for good, then counted so), the live ones as
    // their sessions end.
    Some(if kept.saturating_add(share) <= table {
        Reply::error(ErrorCode::Busy, format!("{held}: retry shortly (they come back as those sessions end)"))
    } else {
        Reply::error(ErrorCode::LimitReached, format!("{held}: the kept ones are held until the daemon restarts"))
    })
}

/// Promises `session` its share of the reservations at its first registration, or answers the
/// refusal ([`reservations_refusal`]); under the sessions lock, so two sessions' first
/// registrations cannot both take the last share. `Ok(true)`: promised by this call, which
/// [`withdraw_promise`] takes back should the registration be refused for its own reasons.
fn promise_reservations(shared: &Shared, session: u64) -> Result<bool, Box<Reply>> {
    let mut sessions = lock(&shared.sessions);
    if sessions.get(&session).is_none_or(|record| record.promised) {
        return Ok(false);
    }
    if let Some(refusal) = reservations_refusal(&sessions, session, &shared.config) {
        return Err(Box::new(refusal));
    }
    if let Some(record) = sessions.get_mut(&session) {
        record.promised = true;
    }
    Ok(true)
}

/// Takes back the promise of `session`'s first registration, refused for its own reasons (no
/// or a bad descriptor, its size, unsupported device memory, the per-session cap): the session
/// holds no registration, so it cannot prepare, and kept promised it would count a whole share
/// (another session's registration answered Busy for it) for as long as it lives. Under the
/// sessions lock, as the promise was made.
fn withdraw_promise(shared: &Shared, session: u64) {
    if let Some(record) = lock(&shared.sessions).get_mut(&session) {
        record.promised = false;
    }
}

/// Whether a connection's error is its client closing the socket: an end of file in the middle
/// of a frame, a reset (the client closed with a reply unread), a write to a closed socket.
fn closed_by_peer(error: &DaemonError) -> bool {
    match error {
        DaemonError::Closed | DaemonError::Truncated { .. } => true,
        DaemonError::Io { source, .. } => matches!(source.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe),
        _ => false,
    }
}

/// Ends a session, on every path out (close, EOF after a kill, lease, protocol error, drain):
/// its queue pairs deleted, then its reservations released, then its windows unmapped
/// ([`Holdings::release`]); then its record goes. A session whose deletions are not confirmed
/// yet stays listed until they are (`super::retry_retiring`): its client may not free what the
/// pairs could still write (docs/tuttid.md, device memory) before its session is gone.
fn release_session(shared: &Shared, session: u64, holdings: &mut Holdings) {
    // Once the daemon stops, a release frees queue ids whose client may still ring them
    // (`Ending::DaemonStopping`), and no attach may create a queue that takes one. An attach
    // holds `attaching` from its admission to its count, and checks the stop flag under it
    // before each creation; one that checked before the stop may be between that check and its
    // queue id's reservation. So a release after the stop first waits for any attach under way
    // to end (it creates no further queue once it sees the flag: bounded by one device's
    // creation and its undo, each command by the admin timeout); an attach after that sees the
    // flag. Taken and let go at once: the releases still run side by side, and nothing is held
    // while waiting (the attach takes only `store`, briefly, under `attaching`: no order to
    // invert).
    if shared.stop.is_stopped() {
        drop(lock(&shared.attaching));
    }
    match holdings.release(&shared.store, &shared.leaks) {
        Released::Done => {
            lock(&shared.sessions).remove(&session);
        }
        Released::Kept(leaked) => {
            // Listed for good, marked kept: a client waiting for its session to leave status
            // before freeing its memory must never see it go (the pairs may still write it).
            tracing::error!(session, leaked, "session ended with queue pairs that could not be deleted: their memory is kept");
            mark_kept(shared, session);
        }
        Released::Retiring(retiring) => {
            if let Some(record) = lock(&shared.sessions).get_mut(&session) {
                record.retiring = true;
                // The wait for its client's exit (if any) is over: the release came after it.
                record.awaiting_exit = false;
            }
            lock(&shared.retiring).push((session, retiring));
        }
    }
}

/// How a connection ended, as far as its client's queues are concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    /// The client closed its socket (or was killed: the kernel closed it). The client library
    /// closes only once its data half is gone, so nothing of it rings the queues any more.
    PeerClosed,
    /// The daemon drains: the session is released at once, though its client may still ring
    /// its queues, whose ids are freed while the controllers stay up (the drain's retire window,
    /// then the pool's drop). No client queue is created from the stop on (`Holdings::attach`
    /// refuses, and a release after the stop waits for an attach under way: `release_session`),
    /// so none takes such an id; the pool's own temporary metadata pair still may on a software
    /// controller (docs/tuttid.md, Shutdown).
    DaemonStopping,
    /// The daemon ended it (lease, frame timeout, protocol error, an answer it could not
    /// send): the client may still be running its data path.
    Other,
}

pub(super) struct Connection {
    /// The connection let in past `clients_max`: it takes Status and ClusterStatus only.
    pub(super) status_only: bool,
    pub(super) session: Option<u64>,
    pub(super) peer_pid: u32,
    pub(super) peer_uid: u32,
    /// The client process as it was at accept (pid and start time), when it can be told.
    pub(super) peer: Option<PeerProcess>,
    pub(super) ending: Ending,
    /// Block keys of the request being served (reused).
    pub(super) keys: Vec<u64>,
    /// Every rank's block keys of a `LookupAllRanks` being served (reused).
    pub(super) chains: RankChains,
    /// The session's store-path holdings.
    pub(super) holdings: Holdings,
    /// In a cluster: the block keys of the session's prepared stores, for the registrar.
    pub(super) prepared_stores: PreparedStores,
}

impl Connection {
    /// Whether the client may still ring its queues' doorbells after its session ended: the
    /// daemon ended the session (not the client's close), the client's process still runs (or
    /// cannot be told apart from a later one), and one of its pairs has its doorbells in a
    /// software controller's shared register page, which the client writes directly. (A
    /// relayed pair's doorbells stop with the relay, the first step of every release.)
    fn may_still_ring(&self, shared: &Shared) -> bool {
        // A bug's panic in deciding, for the test that a session without queue pairs keeps its
        // reservations counted on the unwinding.
        #[cfg(test)]
        if let Some(session) = self.session {
            let panics = lock(&shared.sessions).get(&session).is_some_and(|record| record.name == super::tests::PANICS_DECIDING_TO_WAIT);
            assert!(!panics, "test hook: deciding whether to wait for the client's exit panics");
        }
        self.ending == Ending::Other
            && !shared.stop.is_stopped()
            && self.holdings.rings_shared_registers()
            && self.peer.as_ref().is_none_or(|peer| !peer.has_exited())
    }

    /// Keeps the ended session's holdings (queue pairs, windows, reservations) until its client
    /// process exits, the client closes its socket (the library closes it only once its data
    /// half is gone), or the daemon stops, checking every tick. Deleting the pairs earlier
    /// would free their queue ids for the next client while this one may still write their
    /// doorbells (a client does not see its session end until it next talks to the daemon),
    /// and its doorbells would then reach the next client's queue. Kept, they reach only its
    /// own pairs, restricted to its own memory and the pool's data LBAs (its honest commands
    /// only to the slots it still holds, not reused meanwhile). The wait takes one of the
    /// daemon's `--clients-max` connections, as the client did. The socket is shut
    /// for writing (the client reads the end after the daemon's last answer); what the client
    /// still sends is read and dropped.
    fn await_peer_exit(&self, shared: &Shared, session: u64, stream: &mut UnixStream) {
        // A bug's panic in the wait, for the test that such a session is kept, not released.
        #[cfg(test)]
        {
            let panics = lock(&shared.sessions).get(&session).is_some_and(|record| record.name == super::tests::PANICS_AWAITING_EXIT);
            assert!(!panics, "test hook: the wait for the client's exit panics");
        }
        if let Some(record) = lock(&shared.sessions).get_mut(&session) {
            record.awaiting_exit = true;
        }
        match &self.peer {
            Some(peer) => tracing::warn!(
                session,
                pid = peer.pid(),
                "the session ended with its client still running: its queue pairs, windows and reservations are kept until \
                 that process exits (its doorbells could otherwise reach the next client's queues)"
            ),
            None => tracing::error!(
                session,
                pid = self.peer_pid,
                "the session ended and its client process cannot be watched (pid not visible here): its queue pairs, windows \
                 and reservations are kept until the daemon stops"
            ),
        }
        let _ = stream.shutdown(Shutdown::Write);
        // Reads wait at most a tick (`run` set the read timeout).
        let mut scratch = [0u8; 4096];
        while !shared.stop.is_stopped() && self.peer.as_ref().is_none_or(|peer| !peer.has_exited()) {
            match stream.read(&mut scratch) {
                Ok(0) => break,
                // A client still talking: dropped, at most a read per tick.
                Ok(_) => std::thread::sleep(shared.config.tick),
                Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
                Err(error) if matches!(error.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => break,
                // The socket cannot tell: watch the process alone.
                Err(_) => std::thread::sleep(shared.config.tick),
            }
        }
    }

    fn run(&mut self, stream: &mut UnixStream, shared: &Shared) -> Result<(), DaemonError> {
        let config = &shared.config;
        let io = |context: &'static str| move |source| DaemonError::Io { context: context.into(), source };
        stream.set_nonblocking(false).map_err(io("making the connection blocking"))?;
        stream.set_read_timeout(Some(config.tick)).map_err(io("setting the read tick"))?;
        stream.set_write_timeout(Some(config.frame_timeout)).map_err(io("setting the write timeout"))?;
        let credentials = getsockopt(&*stream, PeerCredentials)
            .map_err(|errno| DaemonError::Io { context: "reading the peer's credentials".into(), source: errno.into() })?;
        self.peer_pid = u32::try_from(credentials.pid()).unwrap_or(0);
        self.peer_uid = credentials.uid();
        self.peer = PeerProcess::of(self.peer_pid);
        let mut body = Vec::new();
        let mut fds = Vec::new();
        let mut frame = Vec::new();
        if !config.allowed_uids.contains(&self.peer_uid) {
            let message = format!("user id {} may not use this daemon", self.peer_uid);
            return self.end_with(shared, stream, &mut frame, Reply::error(ErrorCode::PermissionDenied, message));
        }
        let mut last_frame = Instant::now();
        loop {
            let stop = || shared.stop.is_stopped();
            // Checked before every request, not only when a read times out: a client that sends
            // its next request within a tick of each answer never lets one time out, and would
            // keep its connection served (and the drain joining it waiting) for as long as it likes.
            if stop() {
                self.ending = Ending::DaemonStopping;
                return self.end_with(shared, stream, &mut frame, Reply::error(ErrorCode::ShuttingDown, "tuttid is shutting down"));
            }
            let header = match read_frame(stream, &mut body, &mut fds, last_frame + config.lease, config.frame_timeout, &stop) {
                Ok(ReadOutcome::Frame(header)) => header,
                Ok(ReadOutcome::Closed) => {
                    self.ending = Ending::PeerClosed;
                    return Ok(());
                }
                Ok(ReadOutcome::Idle) => {
                    let message = format!("no frame for {} ms; the session is ended", config.lease.as_millis());
                    return self.end_with(shared, stream, &mut frame, Reply::error(ErrorCode::LeaseExpired, message));
                }
                Ok(ReadOutcome::Stopped) => {
                    self.ending = Ending::DaemonStopping;
                    return self.end_with(shared, stream, &mut frame, Reply::error(ErrorCode::ShuttingDown, "tuttid is shutting down"));
                }
                Err(DaemonError::Protocol(error)) => {
                    // The body was not read: the stream cannot be resynchronised.
                    self.end_with(shared, stream, &mut frame, Reply::error(error.code(), error.to_string()))?;
                    return Err(error.into());
                }
                Err(error @ DaemonError::Timeout { .. }) => {
                    self.end_with(shared, stream, &mut frame, Reply::error(ErrorCode::FrameTimeout, error.to_string()))?;
                    return Err(error);
                }
                Err(error) => return Err(error),
            };
            last_frame = Instant::now();
            let decoded = Request::decode(header.kind, &body);
            let label = if decoded.is_ok() { RequestLabel::of(header.kind) } else { RequestLabel::Malformed };
            let (reply, reply_fds) = match decoded {
                // A malformed body was read whole: the stream is still in step, serve on.
                Err(error) => (Reply::error(error.code(), error.to_string()), Vec::new()),
                // Only the registrations take descriptors: others' are closed, not kept.
                Ok(request) if !fds.is_empty() && !matches!(request.kind(), Kind::RegisterMemory | Kind::RegisterDeviceMemory) => (
                    Reply::error(
                        ErrorCode::BadRequest,
                        format!("{} descriptor(s) sent with a {:?} request, which takes none", fds.len(), request.kind()),
                    ),
                    Vec::new(),
                ),
                Ok(request) => self.handle(request, &mut fds, shared),
            };
            fds.clear();
            let error = match &reply {
                Reply::Error { code, .. } => Some(*code),
                _ => None,
            };
            shared.metrics.request(label, last_frame.elapsed(), error);
            self.answer_with_fds(stream, &mut frame, header.request_id, reply, &reply_fds)?;
            // The lease counts from the answer: a long request (a remote fetch) is not the
            // client's silence.
            last_frame = Instant::now();
        }
    }

    /// Answers an error outside any request (a refused frame, a lease, shutdown), counted.
    fn end_with(&self, shared: &Shared, stream: &mut UnixStream, frame: &mut Vec<u8>, reply: Reply) -> Result<(), DaemonError> {
        if let Reply::Error { code, .. } = &reply {
            shared.metrics.error(*code);
        }
        self.answer(stream, frame, 0, reply)
    }

    fn answer(&self, stream: &mut UnixStream, frame: &mut Vec<u8>, request_id: u32, reply: Reply) -> Result<(), DaemonError> {
        self.answer_with_fds(stream, frame, request_id, reply, &[])
    }

    fn answer_with_fds(
        &self,
        stream: &mut UnixStream,
        frame: &mut Vec<u8>,
        request_id: u32,
        reply: Reply,
        fds: &[OwnedFd],
    ) -> Result<(), DaemonError> {
        if let Err(error) = encode_frame(frame, reply.kind(), request_id, |out| reply.encode_body(out)) {
            // Only a status listing past the body cap could do this; say so instead.
            let fallback = Reply::error(ErrorCode::BadRequest, format!("the reply does not fit a frame: {error}"));
            encode_frame(frame, fallback.kind(), request_id, |out| fallback.encode_body(out))?;
            return write_frame(stream, frame);
        }
        let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
        write_frame_with_fds(stream, frame, &borrowed)
    }

    fn handle(&mut self, request: Request, fds: &mut Vec<OwnedFd>, shared: &Shared) -> (Reply, Vec<OwnedFd>) {
        // A bug's panic, for the test that every way out of a connection releases its session.
        #[cfg(test)]
        if matches!(request, Request::Ping) {
            let panics = self.session.is_some_and(|session| {
                lock(&shared.sessions).get(&session).is_some_and(|record| {
                    [super::tests::PANICS_ON_PING, super::tests::PANICS_AWAITING_EXIT, super::tests::PANICS_DECIDING_TO_WAIT]
                        .contains(&record.name.as_str())
                })
            });
            assert!(!panics, "test hook: a handler panics");
        }
        if self.status_only && !matches!(request, Request::Status | Request::ClusterStatus | Request::Ping) {
            let message = "tuttid serves its maximum number of connections (this one takes status queries only); retry later";
            return (Reply::error(ErrorCode::Busy, message), Vec::new());
        }
        let space = self.session.and_then(|session| {
            lock(&shared.sessions).get_mut(&session).map(|record| {
                record.requests += 1;
                record.last_active = Instant::now();
                record.space
            })
        });
        let limits = &shared.config.session_limits;
        let (kind, commit_handle) = match &request {
            Request::Commit(commit) => (Kind::Commit, Some(commit.handle)),
            other => (other.kind(), None),
        };
        let not_attached = || Reply::error(ErrorCode::NotAttached, "send Hello (model fingerprint, TP rank and world size) first");
        // Checked and taken before the registration's own checks (the registration then runs
        // outside the sessions lock), and taken back below when it is refused.
        let mut promised_here = false;
        if let (Request::RegisterMemory(_) | Request::RegisterDeviceMemory(_), Some(session)) = (&request, self.session) {
            match promise_reservations(shared, session) {
                Ok(promised) => promised_here = promised,
                Err(refusal) => return (*refusal, Vec::new()),
            }
        }
        let reply = match (request, space) {
            (Request::RegisterMemory(register), Some(_)) => {
                let session = self.session.unwrap_or(0);
                self.holdings.register(
                    register,
                    fds,
                    &shared.store,
                    limits,
                    shared.block_bytes,
                    &shared.next_registration,
                    &shared.device_memory,
                    session,
                )
            }
            (Request::AttachQueues(attach), Some(_)) => {
                // Read past the stop check before each request, about to wait for the attach
                // lock: for the test that a stop meanwhile is still answered ShuttingDown.
                #[cfg(test)]
                if let Some(session) = self.session {
                    if lock(&shared.sessions).get(&session).is_some_and(|record| record.name == super::tests::ATTACH_COUNTED) {
                        super::tests::ATTACHES_READ.fetch_add(1, Ordering::SeqCst);
                    }
                }
                // For the test that no queue id frees between an attach's stop check and its
                // creation: a session so named has the stop come right after its first device's
                // check (the second call).
                #[cfg(test)]
                let stops_in_attach = match self.session {
                    Some(session) => {
                        lock(&shared.sessions).get(&session).is_some_and(|record| record.name == super::tests::STOPS_IN_ATTACH)
                    }
                    None => false,
                };
                #[cfg(test)]
                let checks = std::cell::Cell::new(0);
                let stopping = || {
                    #[cfg(test)]
                    if stops_in_attach {
                        checks.set(checks.get() + 1);
                        if checks.get() == 2 {
                            super::tests::stop_within_an_attach(shared);
                            return false;
                        }
                    }
                    shared.stop.is_stopped()
                };
                let (reply, reply_fds) = self.holdings.attach(
                    attach,
                    &shared.store,
                    &shared.attaching,
                    &stopping,
                    limits,
                    &shared.leaks,
                    crate::pool_open::queue_pairs_reserved(shared.cluster.is_some()),
                );
                self.count_holdings(shared);
                // The relayed pairs change only here: their counters go to the record once.
                let relay = self.holdings.relay_counters();
                if let Some(session) = self.session {
                    if let Some(record) = lock(&shared.sessions).get_mut(&session) {
                        record.relay = relay;
                    }
                }
                return (reply, reply_fds);
            }
            (Request::PoolShape, Some(_)) => Reply::PoolShape(shared.pool_shape.clone()),
            (Request::PrepareRetrieve(prepare), Some(space)) => {
                self.holdings.prepare_retrieve(prepare, &space, shared.shape.block_tokens, &shared.store, limits)
            }
            (Request::PrepareStore(prepare), Some(space)) => {
                self.holdings.prepare_store(prepare, &space, shared.shape.block_tokens, &shared.store, limits)
            }
            (Request::Commit(commit), Some(_)) => self.holdings.commit(commit, &shared.store, &shared.pool_shape, &shared.metrics),
            (Request::Release { handle, transferred, corrupt_blocks }, Some(_)) => {
                self.holdings.release_request(handle, transferred, &corrupt_blocks, &shared.store, &shared.pool_shape, &shared.metrics)
            }
            (Request::RegisterDeviceMemory(register), Some(_)) => self.holdings.register_device_memory(
                register,
                fds,
                &shared.store,
                limits,
                shared.block_bytes,
                &shared.next_registration,
                &shared.device_memory,
                self.session.unwrap_or(0),
            ),
            (
                Request::RegisterMemory(_)
                | Request::AttachQueues(_)
                | Request::PoolShape
                | Request::PrepareRetrieve(_)
                | Request::PrepareStore(_)
                | Request::Commit(_)
                | Request::Release { .. }
                | Request::RegisterDeviceMemory(_),
                None,
            ) => not_attached(),
            (request, _) => self.handle_session(request, shared),
        };
        if promised_here && self.holdings.registrations() == 0 {
            if let Some(session) = self.session {
                withdraw_promise(shared, session);
            }
        }
        if let (Some(cluster), Some(space)) = (&shared.cluster, space) {
            self.track_stores(cluster, &space, kind, commit_handle, &reply);
        }
        self.count_holdings(shared);
        (reply, Vec::new())
    }

    /// Mirrors the holdings' counts into the session's record (for status).
    fn count_holdings(&self, shared: &Shared) {
        if let Some(session) = self.session {
            if let Some(record) = lock(&shared.sessions).get_mut(&session) {
                record.registrations = self.holdings.registrations();
                record.queue_pairs = self.holdings.queue_pairs();
                record.requests_in_flight = self.holdings.requests_in_flight();
            }
        }
    }

    /// Attach, lookups, status and ping.
    fn handle_session(&mut self, request: Request, shared: &Shared) -> Reply {
        match request {
            Request::Hello(hello) => {
                if self.session.is_some() {
                    return Reply::error(ErrorCode::AlreadyAttached, "this connection is attached already (one Hello per connection)");
                }
                let space = match KeySpace::new(&hello.model_fingerprint, hello.tp_rank, hello.tp_world, &shared.key_secret) {
                    Ok(space) => space,
                    Err(reason) => return Reply::error(ErrorCode::BadRequest, reason),
                };
                let session = shared.next_session.fetch_add(1, Ordering::Relaxed);
                let record = SessionRecord {
                    pid: self.peer_pid,
                    uid: self.peer_uid,
                    name: hello.client_name,
                    space,
                    requests: 1,
                    last_active: Instant::now(),
                    registrations: 0,
                    queue_pairs: 0,
                    requests_in_flight: 0,
                    relay: Vec::new(),
                    awaiting_exit: false,
                    retiring: false,
                    kept: false,
                    promised: false,
                };
                {
                    // Sessions kept for good stay listed: the table is bounded at what one
                    // status reply can list.
                    let mut sessions = lock(&shared.sessions);
                    if sessions.len() >= crate::protocol::STATUS_CLIENTS_MAX {
                        let kept = sessions.values().filter(|record| record.kept).count();
                        return Reply::error(
                            ErrorCode::LimitReached,
                            format!("{} sessions are listed ({kept} of them kept for good: queue pairs not known deleted)", sessions.len()),
                        );
                    }
                    sessions.insert(session, record);
                }
                self.session = Some(session);
                let lease_ms = u32::try_from(shared.config.lease.as_millis()).unwrap_or(u32::MAX);
                Reply::Hello(HelloReply { session, lease_ms, shape: shared.shape })
            }
            Request::Lookup { tokens, first_block } => self.lookup(shared, &tokens, first_block as usize, false),
            Request::LookupAllRanks { tokens, first_block } => self.lookup(shared, &tokens, first_block as usize, true),
            Request::LookupCluster { tokens } => self.lookup_cluster(shared, &tokens),
            Request::FetchRemote { tokens } => self.fetch_remote(shared, &tokens),
            Request::Status => Reply::Status(status(shared)),
            Request::ClusterStatus => {
                Reply::ClusterStatus(shared.cluster.as_ref().map_or_else(ClusterStatusReply::default, ClusterAgent::status))
            }
            Request::Ping => Reply::Pong,
            other => Reply::error(ErrorCode::BadRequest, format!("{:?} is not a session request", other.kind())),
        }
    }

    /// `Lookup` (the session's own key space) or `LookupAllRanks` (every rank of its world),
    /// from `first_block`: answered with where the cached run from there ends.
    fn lookup(&mut self, shared: &Shared, tokens: &[u32], first_block: usize, all_ranks: bool) -> Reply {
        let Some(space) = self.session.and_then(|session| lock(&shared.sessions).get(&session).map(|record| record.space)) else {
            return Reply::error(ErrorCode::NotAttached, "send Hello (model fingerprint, TP rank and world size) before a lookup");
        };
        let block_tokens = shared.shape.block_tokens;
        let full = tokens.len() / block_tokens.max(1) as usize;
        let first_block = first_block.min(full);
        let cached = if all_ranks {
            // Every rank's chain is hashed without the pool lock (SHA-256 keys: TP 8 over 128K
            // tokens is 8 ms of hashing, which every worker's prepare, commit and lookup would
            // wait out, and a scheduler may ask every step for a waiting request), each over
            // the prefix the ranks before it shared at a brief probe; then one lock for the
            // probes alone, so that the ranks' minimum is over one state of the index. The
            // chains kept for it are capped (8 MiB of keys, `keys::RankChains`) on every
            // connection, whatever the world and block size.
            let settled = space.all_ranks_chains(tokens, first_block, block_tokens, &mut self.chains, |keys, first| {
                lock(&shared.store).control.pool().index().cached_run_end(keys, first)
            });
            let end = settled.unwrap_or_else(|| self.chains.run_end(lock(&shared.store).control.pool().index()));
            self.chains.trim();
            end
        } else {
            space.keys(tokens, block_tokens, &mut self.keys);
            lock(&shared.store).control.lookup_from(&self.keys, first_block)
        };
        shared.metrics.lookup((full - first_block) as u64, (cached - first_block) as u64);
        Reply::Lookup { cached_blocks: cached as u32, block_tokens }
    }
}
