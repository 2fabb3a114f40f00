//! Remote reads (docs/cluster.md, "Remote reads"): a node serves the segments it holds to other
//! nodes over TCP at its data address, and fetches segments it lacks from their holders,
//! storing them in its own pool so its client retrieves them locally.
//!
//! **Holder.** One thread accepts; each peer connection (at most [`PEERS_MAX`] at once; one
//! more is answered `Unavailable`, "busy", and closed) has a thread that serves `ReadSegment`s in
//! turn, in order, for at most [`PEER_IDLE`] after the last one it served whole (requests that
//! are refused do not extend it, and a connection refused [`REFUSALS_PER_CONNECTION_MAX`] times
//! is closed): a peer sending bogus requests cannot keep a slot. The blocks are reserved in the
//! index (pinned, so no eviction reuses their slots) until the last byte is sent; the segment
//! header sent at once; the blocks read from the SSDs through the daemon's staging data half
//! (`staging.rs`, its turn awaited up to half the segment's deadline, else a `Failure` where the
//! first block was due); each block's CRC computed (and, when the pool records payload CRCs,
//! checked against the one recorded at commit: a holder never sends bytes its own pool says are
//! damaged); then streamed, a frame per block with its CRC.
//!
//! **Asker.** `FetchRemote` (a client's request): the registry says who holds what lies past the
//! local prefix (`lookup.rs`); the holder's data address comes from its member record; each
//! segment is read in turn (the segment header bounded by [`PEER_STALL`], so a holder that
//! accepted and hangs costs that long, then is passed over like one unreachable; the first
//! block's first byte awaited until the segment's deadline — the holder queues for its staging
//! area then — and every other frame, and every
//! frame once begun, bounded by [`PEER_STALL`]; a block out of order, of another size or whose
//! CRC does not match fails the read; a holder that answers `Unavailable`, instead of the header
//! or of the first block, is asked again, on a new connection, with a growing pause, until the
//! segment's deadline; a connection found closed before a byte of the answer — a holder closes
//! one idle for [`PEER_IDLE`], and this node's wait for its staging area between segments may be
//! longer — is made anew, once a segment), then stored in the local pool as a store of its own
//! (reserve, write through the staging half, flush, headers with FUA): the client then retrieves
//! it through the normal path. Segments stored before a failure stay (each is whole and
//! checked); the failure is the client's typed error for the rest. The copy is a replica in
//! waiting: not registered (nor by a later commit of a longer prompt: `fetched.rs`), unless its
//! holder has served it more than the node's
//! `--cluster-replicate-after` times (the count in each `SegmentHeader`, `heavy_hitters.rs`):
//! then it is handed to the registrar as a second replica (registered under this node's lease,
//! unregistered when evicted, kept in the manifest).
//!
//! The staging area is one segment, behind a gate ([`StagingGate`]): one segment moves at a time
//! per node, in either direction, and a wait for it is bounded by the waiter's deadline (and
//! ends at the daemon's drain). Lock order: staging, then the pool (never the reverse).

use std::cell::Cell;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use objstore::{Direction, MismatchedBlock, ModelGeometry, NoLender, ObjstoreError, Placement, RequestHandle, StoreControl};
use prometheus_client::metrics::counter::Counter;
use tutti_cluster::{ModelSpace, SegmentBlocks, SegmentKey};

use super::heavy_hitters::{ServedCounts, SERVED_COUNTS_MAX};
use super::peer::{self, FailureCode, PeerError, PeerKind, ReadSegment, SegmentHeader};
use super::staging::{Staging, StagingError};
use super::ClusterMetrics;
use crate::server::StopHandle;
use crate::session::StoreState;

/// Peer connections a holder serves at once; one more is answered `Unavailable` and closed.
pub const PEERS_MAX: usize = 8;
/// The longest a peer may leave a frame half sent, or an asker wait for a holder's segment
/// header or between its blocks (not for the first block: the holder's staging wait is then).
pub const PEER_STALL: Duration = Duration::from_secs(2);
/// The longest a holder keeps a peer connection after the last read it served whole (or after
/// accepting it): refused requests do not extend it.
pub const PEER_IDLE: Duration = Duration::from_secs(30);
/// Refused requests (not held, bad request, busy) after which a holder closes the connection:
/// an asker's connection is one fetch, which ends at its first refusal.
pub const REFUSALS_PER_CONNECTION_MAX: u32 = 8;
/// The longest pause between an asker's tries of a busy holder (the first is 50 ms, doubling).
pub const BUSY_PAUSE_MAX: Duration = Duration::from_secs(1);
/// The longest one segment's read (asker) or send (holder) may take in all.
pub const SEGMENT_DEADLINE: Duration = Duration::from_secs(60);
/// The longest one `FetchRemote` may take in all, however many segments it reads.
pub const FETCH_DEADLINE: Duration = Duration::from_secs(120);
/// Connecting to a holder.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// `FetchRemote`s in progress at once on this node; more are refused at once (each buffers up
/// to a whole segment in memory before the staging area takes it).
pub const FETCHES_MAX: usize = 4;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The data plane's time bounds: the constants above, shorter in tests.
#[derive(Debug, Clone, Copy)]
struct PeerBounds {
    stall: Duration,
    idle: Duration,
    segment: Duration,
}

impl Default for PeerBounds {
    fn default() -> PeerBounds {
        PeerBounds { stall: PEER_STALL, idle: PEER_IDLE, segment: SEGMENT_DEADLINE }
    }
}

/// The staging area and who has its turn: a waiter gives up at its deadline or the daemon's
/// drain (a `Mutex` alone would wait unbounded behind up to 8 peer reads and 4 stores).
struct StagingGate {
    area: Mutex<Option<Staging>>,
    busy: Mutex<bool>,
    freed: Condvar,
    /// Set when a turn ends with the area gone (retired: it never comes back), so an asker
    /// learns it before it asks a holder, without waiting for a turn.
    retired: AtomicBool,
}

/// Why no turn of the staging area was had.
enum NoTurn {
    Deadline,
    Stopped,
}

impl StagingGate {
    fn new(staging: Staging) -> StagingGate {
        StagingGate { area: Mutex::new(Some(staging)), busy: Mutex::new(false), freed: Condvar::new(), retired: AtomicBool::new(false) }
    }

    /// Whether the staging area was retired (by a turn that has ended).
    fn retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Waits for the staging area's turn until `deadline`, asking `stopped` every 50 ms.
    fn take(&self, deadline: Instant, stopped: &dyn Fn() -> bool) -> Result<StagingTurn<'_>, NoTurn> {
        let mut busy = lock(&self.busy);
        while *busy {
            if stopped() {
                return Err(NoTurn::Stopped);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(NoTurn::Deadline);
            }
            let wait = (deadline - now).min(Duration::from_millis(50));
            busy = self.freed.wait_timeout(busy, wait).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
        }
        *busy = true;
        drop(busy);
        // Uncontended: only the holder of the turn locks the area, and a turn's drop unlocks it
        // before it passes the turn on.
        Ok(StagingTurn { gate: self, area: Some(lock(&self.area)), kept_reservations: None })
    }
}

/// One turn of the staging area; the next waiter's when dropped.
struct StagingTurn<'a> {
    gate: &'a StagingGate,
    /// Always `Some` until the drop, which unlocks it first.
    area: Option<MutexGuard<'a, Option<Staging>>>,
    /// Where a reservation kept for good by a panic in the turn's work is counted (an asker's
    /// store's: `DataPlane::kept_reservations`, set by `with_staging`).
    kept_reservations: Option<&'a Counter>,
}

impl StagingTurn<'_> {
    /// The staging area (`None` once retired).
    fn area(&mut self) -> &mut Option<Staging> {
        self.area.as_mut().expect("a turn's area is held until its drop")
    }
}

impl Drop for StagingTurn<'_> {
    fn drop(&mut self) {
        // A turn ended by a panic in its work (a bug) may have left a layer in flight, which
        // may still write the area's memory: retired, never passed on (`with_staging`'s path
        // for a layer in flight). If its queue pairs cannot be deleted the memory is leaked
        // (`Staging::retire`); the request's reservation is never released either way, as the
        // unwinding skips its caller's release, so its slots are not reused: an asker's store's
        // counted, as `store_segment` counts the reservations it keeps.
        if std::thread::panicking() {
            if let Some(staging) = self.area.as_mut().and_then(|area| area.take()) {
                if !staging.retire() {
                    tracing::error!("a staging turn ended by a panic: a command may still move its request's slots");
                }
                tracing::error!("a staging turn ended by a panic: its request's slots are kept for good");
                if let Some(kept) = self.kept_reservations {
                    kept.inc();
                }
            }
        }
        if self.area.as_ref().is_some_and(|area| area.is_none()) {
            self.gate.retired.store(true, Ordering::Release);
        }
        drop(self.area.take());
        *lock(&self.gate.busy) = false;
        // Every waiter is woken (at most 8 peer reads and 4 stores): the first to lock the gate
        // takes the turn and the others wait on, so a waiter that gives up (deadline, drain) as
        // it wakes cannot strand the turn with the waiters behind it asleep.
        self.gate.freed.notify_all();
    }
}

/// A remote read that failed: what the client is told (with how much was stored before).
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("reading segment {segment} from node {node} ({address}): {source}")]
    Peer { node: String, address: SocketAddr, segment: u32, source: Box<PeerError> },
    #[error("storing segment {segment} locally: {source}")]
    Store { segment: u32, source: Box<ObjstoreError> },
    #[error("the staging area is unavailable (retired after a device timeout; restart tuttid)")]
    NoStaging,
    #[error("{max} remote fetches are in progress on this node already; retry")]
    Busy { max: usize },
    #[error("node {node} ({address}) stayed busy for {waited:?} reading segment {segment}: {message}; retry")]
    HolderBusy { node: String, address: SocketAddr, segment: u32, waited: Duration, message: String },
    #[error("the staging area stayed busy with other segments until the fetch's deadline")]
    StagingBusy,
    #[error("the daemon is stopping")]
    Stopped,
}

impl FetchError {
    /// Whether another holder of the segment may serve what this one did not: this one could
    /// not be reached (a dead node stays listed until its lease expires) or sent no byte of its
    /// segment header within the stall bound (a stopped process, a store lock held long: the
    /// same asker ranks the same holder first every time), no longer holds it,
    /// stayed busy, or could not read it (`ReadFailed`: its own disks or staging area — retired
    /// until it restarts — or a block its pool found damaged; another replica's are its own).
    /// Not a holder that misbehaved (its bytes or frames), nor this node's own trouble (its
    /// staging area, its store, its fetch slots, its drain), which the next holder would meet
    /// too.
    pub fn another_holder_may_serve(&self) -> bool {
        match self {
            FetchError::Peer { source, .. } => matches!(
                **source,
                PeerError::Io { context: "connecting", .. }
                    | PeerError::Stalled { context: AWAITING_HEADER, .. }
                    | PeerError::Refused { code: FailureCode::NotHeld | FailureCode::ReadFailed, .. }
            ),
            FetchError::HolderBusy { .. } => true,
            FetchError::Store { .. } | FetchError::NoStaging | FetchError::Busy { .. } | FetchError::StagingBusy | FetchError::Stopped => {
                false
            }
        }
    }

    /// Whether the failure is a fault, counted in `remote_read_failures` even where the fetch
    /// ends `Ok` with the runs it read before it (docs/cluster.md, "Remote reads"): a holder's
    /// bytes or frames wrong (a CRC that does not match, a frame that does not decode), its
    /// connection closed or failing once the answer began, its refusal for a reason other than
    /// not holding the segment or being busy (`ReadFailed`: its disks, its staging area), this
    /// node's store or staging area failing. Not a wait that ran out or a limit, which is load
    /// or a holder gone, not a fault: the holder unreachable, stalling (a stopped node), busy,
    /// no longer holding the segment, this node's fetch limit, staging area busy, pool full
    /// (every slot pinned) or request places taken, the drain.
    pub fn is_fault(&self) -> bool {
        match self {
            FetchError::Peer { source, .. } => !matches!(
                **source,
                PeerError::Io { context: "connecting", .. }
                    | PeerError::Stalled { .. }
                    | PeerError::Stopped { .. }
                    | PeerError::Refused { code: FailureCode::NotHeld | FailureCode::Unavailable, .. }
            ),
            // This node's limits (every slot pinned, every request place taken) are load.
            FetchError::Store { source, .. } => !matches!(**source, ObjstoreError::PoolFull { .. } | ObjstoreError::TooManyRequests { .. }),
            FetchError::NoStaging => true,
            FetchError::Busy { .. } | FetchError::HolderBusy { .. } | FetchError::StagingBusy | FetchError::Stopped => false,
        }
    }

    /// Whether the holder could not be reached, sent no byte of its segment header within the
    /// stall bound, or stayed busy: not asked again in a later run
    /// of the same fetch (a dead node listed until its lease expires would cost another connect
    /// timeout, and one of the holders asked in all). Not a holder that answered `NotHeld` or
    /// `ReadFailed`: that answer was about the run's segments (evicted, a damaged block), and
    /// it may be the only sound holder of a later run's.
    pub fn holder_unreachable(&self) -> bool {
        match self {
            FetchError::Peer { source, .. } => {
                matches!(**source, PeerError::Io { context: "connecting", .. } | PeerError::Stalled { context: AWAITING_HEADER, .. })
            }
            FetchError::HolderBusy { .. } => true,
            _ => false,
        }
    }
}

/// The data plane's address, bound at `ClusterAgent::prepare` (before the pool is opened, so
/// that an address a running or starting daemon holds refuses the start before a `--format`) but
/// not listened on until [`DataPlane::bind`]: meanwhile (the pool's open, long after a restart)
/// peers still listing this node are refused at connect and pass it over at once, where a
/// listening socket would take their connections into a backlog nobody accepts from and each
/// fetch would wait out its stall bound.
///
/// `SO_REUSEADDR` (Linux's rules): a restart on a fixed address must bind past the previous
/// process's connections in TIME_WAIT, which needs it; but while two sockets that both have it
/// are bound and neither listens, each binds (two daemons started at once would both pass
/// prepare, and the later to listen be refused only after its pool's open or `--format`). So
/// the address is bound without it, and with it only when that is refused (EADDRINUSE: TIME_WAIT,
/// or a socket that holds it), then it is cleared at once: while prepared this socket conflicts
/// with every other bind of the address, with or without the option; it is set again just
/// before [`BoundAddress::listen`] (the connections it accepts inherit it, so that their
/// TIME_WAIT lets the next start bind, and a listening socket refuses any bind of its address).
/// Left open: a socket of another program that binds the address with the option and never
/// listens still lets this one bind (and listen first).
#[derive(Debug)]
pub(crate) struct BoundAddress {
    socket: std::os::fd::OwnedFd,
}

impl BoundAddress {
    pub(crate) fn bind(address: SocketAddr) -> std::io::Result<BoundAddress> {
        use nix::sys::socket::{bind, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage};
        use std::os::fd::AsRawFd;
        let family = if address.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
        let socket = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
        let storage = SockaddrStorage::from(address);
        match bind(socket.as_raw_fd(), &storage) {
            Ok(()) => {}
            // Held: by TIME_WAIT (a restart: bound past it), or by a socket bound or listening
            // (refused again, the option notwithstanding; type docs).
            Err(nix::errno::Errno::EADDRINUSE) => {
                setsockopt(&socket, sockopt::ReuseAddr, &true)?;
                bind(socket.as_raw_fd(), &storage)?;
                setsockopt(&socket, sockopt::ReuseAddr, &false)?;
            }
            Err(error) => return Err(error.into()),
        }
        Ok(BoundAddress { socket })
    }

    /// The address bound (the port picked, for port 0); the data plane reads its listener's.
    #[cfg(test)]
    pub(crate) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        // A duplicate descriptor of the socket, read and closed: std reads the address.
        TcpListener::from(self.socket.try_clone()?).local_addr()
    }

    /// Starts listening: connections are taken from here on.
    /// `SO_REUSEADDR` set first (type docs: its accepted connections' TIME_WAIT must not
    /// refuse the next start's bind).
    pub(crate) fn listen(self) -> std::io::Result<TcpListener> {
        nix::sys::socket::setsockopt(&self.socket, nix::sys::socket::sockopt::ReuseAddr, &true)?;
        nix::sys::socket::listen(&self.socket, nix::sys::socket::Backlog::MAXCONN)?;
        Ok(TcpListener::from(self.socket))
    }
}

/// The data plane: the bound listener (taken by the server's thread) and the staging area.
pub struct DataPlane {
    listener: Mutex<Option<TcpListener>>,
    address: SocketAddr,
    staging: StagingGate,
    bounds: PeerBounds,
    segment_blocks: SegmentBlocks,
    block_bytes: usize,
    /// The pool's geometry: sent with every read and answer, and required of the other side's
    /// (equal block sizes do not make equal bytes: `peer.rs`, version 3).
    geometry: ModelGeometry,
    /// Peer connections being served now.
    peers: AtomicUsize,
    /// `FetchRemote`s in progress now.
    fetches: AtomicUsize,
    /// Holder: reads served per segment (the heavy-hitter count sent with each).
    served: Mutex<ServedCounts>,
    /// Asker: stores whose reservation is kept for good (`ClusterMetrics::kept_reservations`,
    /// the agent's counter once bound).
    pub(super) kept_reservations: Counter,
}

impl DataPlane {
    /// Listens on `bound` (the configured address, port 0: a free one, see
    /// [`DataPlane::address`]), then builds the staging area over the pool; served from `serve`.
    /// Listening first, as soon as the pool is open: peers that connect while the staging area is
    /// made wait in the backlog for a moment rather than being refused, so a peer that saw the
    /// daemon's socket answer is not refused here (a refused start closes it again). A pool whose
    /// blocks pass [`peer::BLOCK_BYTES_MAX`] is refused before either.
    pub(crate) fn bind(
        bound: BoundAddress,
        control: &StoreControl,
        segment_blocks: SegmentBlocks,
        requests_max: usize,
    ) -> std::io::Result<DataPlane> {
        // The block size first, from the pool's geometry (the staging area's blocks are its
        // blocks): a pool of blocks too large is refused before segment_blocks of them are
        // allocated (gigabytes of DMA memory, populated) and queue pairs made, only to be freed.
        let geometry = *control.pool().geometry();
        if geometry.block_bytes() > peer::BLOCK_BYTES_MAX {
            return Err(std::io::Error::other(format!(
                "blocks of {} bytes: the data plane moves blocks of at most {} bytes",
                geometry.block_bytes(),
                peer::BLOCK_BYTES_MAX
            )));
        }
        // From here peers' connections are taken (until here refused: `BoundAddress`).
        let listener = bound.listen()?;
        listener.set_nonblocking(true)?;
        let address = listener.local_addr()?;
        let staging = Staging::new(control.pool(), u32::from(segment_blocks.get()), requests_max)
            .map_err(|error| std::io::Error::other(format!("the data plane's staging area: {error}")))?;
        let block_bytes = staging.block_bytes();
        Ok(DataPlane {
            listener: Mutex::new(Some(listener)),
            address,
            staging: StagingGate::new(staging),
            bounds: PeerBounds::default(),
            segment_blocks,
            block_bytes,
            geometry,
            peers: AtomicUsize::new(0),
            fetches: AtomicUsize::new(0),
            served: Mutex::new(ServedCounts::new(SERVED_COUNTS_MAX)),
            kept_reservations: Counter::default(),
        })
    }

    /// The address peers reach this node at (the member record's).
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Serves peers until `stop` (holder side; module docs). Returns once every peer thread
    /// ended; the listener is closed as the stop is seen (within `tick`), before those joins,
    /// and the peer threads meet the drain only once it is closed. Each then ends within the
    /// layer it has in flight (up to the staging area's 10 s per-layer timeout) or the block it
    /// is sending (up to 2 × the stall bound: the write call in progress, then one stall bound
    /// more), then a `Failure` frame (up to 2 × the stall bound), on a healthy device (after a
    /// layer that timed out, the staging area's retirement comes first: admin timeouts);
    /// docs/cluster.md.
    pub fn serve(&self, store: &Mutex<StoreState>, stop: &StopHandle, tick: Duration, metrics: &ClusterMetrics) {
        let Some(listener) = lock(&self.listener).take() else { return };
        // The peer threads' stop: set once the listener is closed, not at `stop`. A peer
        // thread that closed its connection (or answered `Unavailable`) for the drain while
        // the accept loop slept out its tick would send the asker's reconnect into the backlog
        // of a listener about to be dropped, which resets it: after the one reconnect a
        // segment has, a fault no other holder is asked for. Past the close it is refused
        // (ECONNREFUSED), and the asker passes this node over.
        let listener_closed = AtomicBool::new(false);
        let peers_stopped = || listener_closed.load(Ordering::Acquire);
        let peers_stopped: &(dyn Fn() -> bool + Sync) = &peers_stopped;
        std::thread::scope(|scope| {
            // Set on every way out, a panic in this loop too: the scope joins the peer threads
            // before it passes a panic on, and without the drain they would last until idle
            // (an asker that keeps reading, for good). Declared before the listener, so that
            // unwinding too closes the listener first, then sets the drain.
            let _drain = SetOnDrop(&listener_closed);
            // Moved in, to be closed before the scope joins the peer threads.
            let listener = listener;
            while !stop.is_stopped() {
                match listener.accept() {
                    Ok((stream, peer)) => {
                        if self.peers.load(Ordering::Acquire) >= PEERS_MAX {
                            tracing::warn!(%peer, "a data-plane connection over the limit of {PEERS_MAX} is refused");
                            metrics.serve_refusals.inc();
                            refuse_busy(stream);
                            continue;
                        }
                        // Given back when the closure is dropped: the thread's end (a panic
                        // too), or with the closure when no thread could be made.
                        let slot = PeerSlot::take(&self.peers);
                        let spawned = std::thread::Builder::new().name("tuttid-peer".into()).spawn_scoped(scope, move || {
                            let _slot = slot;
                            if let Err(error) = self.serve_peer(stream, store, peers_stopped, tick, metrics) {
                                tracing::info!(%peer, %error, "a data-plane connection ended");
                            }
                        });
                        if let Err(error) = spawned {
                            // The connection and the slot (moved into the closure) are given
                            // back; serve on.
                            tracing::warn!(%peer, %error, "no thread for a data-plane connection: it is closed");
                        }
                    }
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(tick),
                    Err(error) => {
                        tracing::warn!(%error, "accepting a data-plane connection");
                        std::thread::sleep(tick);
                    }
                }
            }
            // Closed now, not after the joins (a peer thread may finish the layer it issued or
            // the block it is sending, then write a `Failure`: seconds, bounded above): meanwhile
            // a connect is refused (ECONNREFUSED: the asker passes this node over at once)
            // rather than accepted by the kernel into a backlog nobody takes from, where the
            // asker would wait out its stall bound for a header.
            drop(listener);
            // `_drain` sets `listener_closed` here, as it goes.
        });
    }

    fn serve_peer(
        &self,
        mut stream: TcpStream,
        store: &Mutex<StoreState>,
        stopped: &dyn Fn() -> bool,
        tick: Duration,
        metrics: &ClusterMetrics,
    ) -> Result<(), PeerError> {
        let io = |context| move |source| PeerError::Io { context, source };
        stream.set_nonblocking(false).map_err(io("configuring a peer connection"))?;
        stream.set_read_timeout(Some(tick)).map_err(io("configuring a peer connection"))?;
        let PeerBounds { stall, idle, .. } = self.bounds;
        stream.set_write_timeout(Some(stall)).map_err(io("configuring a peer connection"))?;
        stream.set_nodelay(true).map_err(io("configuring a peer connection"))?;
        let (mut body, mut frame, mut bytes) = (Vec::new(), Vec::new(), Vec::new());
        // The slot is kept until `idle` after the last read served whole (M1 of the review: a
        // request refused must not keep a bogus peer's slot).
        let mut kept_until = Instant::now() + idle;
        let mut refusals = 0u32;
        loop {
            if refusals >= REFUSALS_PER_CONNECTION_MAX {
                return Err(PeerError::Garbage(format!("{refusals} requests refused on one connection: closed")));
            }
            let kind = match peer::read_frame(
                &mut stream,
                &mut body,
                peer::request_body_max,
                idle,
                stall,
                kept_until,
                stopped,
                "waiting for a request",
            ) {
                Ok(kind) => kind,
                Err(PeerError::Closed { .. } | PeerError::Stopped { .. }) => return Ok(()),
                Err(error @ PeerError::Garbage(_)) => {
                    metrics.serve_refusals.inc();
                    peer::encode_failure(&mut frame, FailureCode::BadRequest, &error.to_string());
                    if peer::write_all(&mut stream, &frame, Instant::now() + stall, stopped, "refusing garbage").is_ok() {
                        // The rest of the frame is unread: closed as it is, the connection
                        // would be reset, which may discard the refusal before it is read.
                        close_after_refusal(&mut stream);
                    }
                    return Err(error);
                }
                Err(error) => return Err(error),
            };
            if kind != PeerKind::ReadSegment {
                metrics.serve_refusals.inc();
                refusals += 1;
                peer::encode_failure(&mut frame, FailureCode::BadRequest, &format!("a {kind:?} frame is not a request"));
                peer::write_all(&mut stream, &frame, Instant::now() + stall, stopped, "refusing a frame")?;
                continue;
            }
            let request = match ReadSegment::decode(&body) {
                Ok(request) => request,
                Err(reason) => {
                    metrics.serve_refusals.inc();
                    refusals += 1;
                    peer::encode_failure(&mut frame, FailureCode::BadRequest, &reason);
                    peer::write_all(&mut stream, &frame, Instant::now() + stall, stopped, "refusing a request")?;
                    continue;
                }
            };
            match self.reserve_segment(&request, store) {
                Ok(reserved) => {
                    // `ReadSegment::decode` refuses empty segments and zero keys.
                    let key = request.keys.last().and_then(|&last| SegmentKey::new(last).ok());
                    let served = key.map_or(0, |key| lock(&self.served).next(&request.space, key));
                    // The blocks stay pinned until the last byte is sent.
                    let answered = self.answer_segment(&mut stream, &mut frame, &mut bytes, store, &reserved, served, stopped);
                    release(store, reserved.handle);
                    match answered? {
                        Answered::Whole => {
                            // Counted once sent whole: a read that failed mid-stream met no demand.
                            if let Some(key) = key {
                                lock(&self.served).served(&request.space, key);
                            }
                            metrics.served_segments.inc();
                            kept_until = Instant::now() + idle;
                        }
                        Answered::Refused => {
                            metrics.serve_refusals.inc();
                            refusals += 1;
                        }
                    }
                }
                Err((code, message)) => {
                    metrics.serve_refusals.inc();
                    refusals += 1;
                    peer::encode_failure(&mut frame, code, &message);
                    peer::write_all(&mut stream, &frame, Instant::now() + stall, stopped, "refusing a read")?;
                }
            }
        }
    }

    /// Holder: pins the segment's blocks (reserved in the index until released, so no eviction
    /// reuses their slots) and notes where they lie and the CRCs recorded at their commit.
    fn reserve_segment(&self, request: &ReadSegment, store: &Mutex<StoreState>) -> Result<Reserved, (FailureCode, String)> {
        let blocks = request.keys.len();
        if blocks != usize::from(self.segment_blocks.get()) {
            return Err((
                FailureCode::BadRequest,
                format!("a segment of {blocks} blocks; this cluster's segments have {}", self.segment_blocks.get()),
            ));
        }
        // Before anything is pinned: bytes of another geometry would be stored as the asker's
        // KV and mean something else there.
        if request.geometry != self.geometry {
            return Err((
                FailureCode::BadRequest,
                format!("blocks of geometry {} asked for; this pool's geometry is {}", request.geometry, self.geometry),
            ));
        }
        let engine_blocks: Vec<u32> = (0..blocks as u32).collect();
        let mut store = lock(store);
        let control = &mut store.control;
        let handle = control.reserve_retrieve(&request.keys, &engine_blocks, 0).map_err(|error| match error {
            // Every request slot is taken: busy, not a sign the blocks are gone.
            ObjstoreError::TooManyRequests { .. } => (FailureCode::Unavailable, error.to_string()),
            // The store's detail (which of the blocks are cached) stays here: a peer learns
            // only that the segment is not held whole.
            _ => {
                tracing::debug!(%error, "a peer's read of a segment not held whole");
                (FailureCode::NotHeld, NOT_HELD.to_owned())
            }
        })?;
        let placements = control.placements(handle).map(<[_]>::to_vec);
        let mut recorded = Vec::new();
        let recorded = if control.records_payload_crcs() {
            control.recorded_payload_crcs(handle, &mut recorded).map(|()| Some(recorded))
        } else {
            Ok(None)
        };
        match (placements, recorded) {
            (Ok(placements), Ok(recorded)) => Ok(Reserved { handle, blocks, placements, recorded }),
            (Err(error), _) | (_, Err(error)) => {
                let _ = control.release(handle);
                Err((FailureCode::ReadFailed, error.to_string()))
            }
        }
    }

    /// Holder: answers a read of a reserved segment, the whole bounded by [`SEGMENT_DEADLINE`]
    /// (its blocks stay pinned meanwhile, so a slow reader must not hold them longer). The
    /// header goes first, at once: the asker bounds it by the stall bound, so a holder that
    /// hangs costs an asker 2 s, not a segment's deadline. Then the wait for the staging area
    /// (the asker awaits the first block up to the segment's deadline) and the read; a wait or
    /// read that fails is a `Failure` frame where the first block was due, and the drain met
    /// before a block one where that block was due (`Unavailable`, written past the drain); a
    /// block begun when the drain comes is given one stall bound more, then cut (`DrainGrace`).
    /// An asker that closed the connection meanwhile ends the wait or the read, unanswered
    /// (`Closed`). The caller releases the reservation.
    #[allow(clippy::too_many_arguments)]
    fn answer_segment(
        &self,
        stream: &mut TcpStream,
        frame: &mut Vec<u8>,
        bytes: &mut Vec<u8>,
        store: &Mutex<StoreState>,
        reserved: &Reserved,
        served: u32,
        stopped: &dyn Fn() -> bool,
    ) -> Result<Answered, PeerError> {
        let deadline = Instant::now() + self.bounds.segment;
        let header =
            SegmentHeader { blocks: reserved.blocks as u16, block_bytes: self.block_bytes as u64, served, geometry: self.geometry };
        peer::encode_segment_header(frame, header);
        peer::write_all(stream, frame, deadline, stopped, "sending a segment header")?;
        // Waiting longer for the staging area than half the asker's wait for the first block
        // would only send it blocks it has given up on.
        let staging_deadline = Instant::now() + self.bounds.segment / 2;
        // An asker that left (one passed over after the stall bound for a header, or gone)
        // is seen by a peek during the staging wait and between layers, like the drain: the
        // read is not done (waited for up to 30 s, then up to 60 s of disk reads) for nobody
        // while the blocks stay pinned and askers queue for the staging area.
        let fd = stream.as_raw_fd();
        let asker_left = move || peer_closed(fd);
        let ended = || stopped() || asker_left();
        let read = self.read_reserved(reserved, store, bytes, staging_deadline, deadline, &ended);
        if asker_left() {
            return Err(PeerError::Closed { context: "awaiting the staging area or reading a segment for it" });
        }
        // The drain met once the read is done (the blocks not sent yet) is answered as the
        // drain met in the wait: `Unavailable`, so that the asker passes this node over.
        let read =
            read.and_then(|crcs| if stopped() { Err((FailureCode::Unavailable, FetchError::Stopped.to_string())) } else { Ok(crcs) });
        let crcs = match read {
            Ok(crcs) => crcs,
            Err((code, message)) => {
                // Written whatever the drain (`stopped` would refuse before a byte): cut here,
                // the connection would close after the header, which the asker takes for a
                // fault and does not pass over to another holder. One small frame, bounded by
                // the stall.
                let never = || false;
                peer::encode_failure(frame, code, &message);
                peer::write_all(stream, frame, Instant::now() + self.bounds.stall, &never, "refusing a read")?;
                return Ok(Answered::Refused);
            }
        };
        // The drain is met between blocks: a block cut at once would end the connection
        // mid-frame, which the asker counts a fault and passes no one over for. At the drain a
        // `Failure(Unavailable)` follows the last block sent, which the asker takes at any
        // block index and passes this node over for. A block begun when the drain comes is
        // given one stall bound more, then cut (`DrainGrace`): at LAN speed a block takes
        // milliseconds, so only a reader slower than about a block per stall bound is cut
        // mid-frame, a fault charged to it; written whole whatever its pace, a block was
        // bounded only by the segment's deadline (a reader that keeps each write call moving
        // never trips the socket's write timeout), and so was the daemon's drain.
        let never = || false;
        let grace = DrainGrace::new(stopped, self.bounds.stall);
        for (index, (block, &crc)) in bytes.chunks_exact(self.block_bytes).zip(&crcs).enumerate() {
            if stopped() {
                if grace.began() {
                    // The grace shortened the socket's write timeout.
                    stream
                        .set_write_timeout(Some(self.bounds.stall))
                        .map_err(|source| PeerError::Io { context: "configuring a peer connection", source })?;
                }
                peer::encode_failure(frame, FailureCode::Unavailable, &FetchError::Stopped.to_string());
                peer::write_all(stream, frame, Instant::now() + self.bounds.stall, &never, "refusing a read")?;
                return Ok(Answered::Refused);
            }
            peer::encode_block_prefix(frame, index as u16, crc, self.block_bytes);
            for part in [&frame[..], block] {
                peer::write_all(&mut grace.writer(stream), part, deadline, &|| grace.cut(), "sending a block")?;
            }
        }
        Ok(Answered::Whole)
    }

    /// Holder: reads a reserved segment's blocks into `bytes` (block after block, each in disk
    /// order) through the staging area, its turn awaited until `staging_deadline` and its
    /// layers issued until `deadline` (the segment's: its blocks stay pinned meanwhile) or the
    /// drain (`stopped`: `Unavailable`, so the asker passes this node over); returns each
    /// block's CRC. A block whose bytes do not match the CRC recorded at its commit is evicted
    /// and the read refused.
    fn read_reserved(
        &self,
        reserved: &Reserved,
        store: &Mutex<StoreState>,
        bytes: &mut Vec<u8>,
        staging_deadline: Instant,
        deadline: Instant,
        stopped: &dyn Fn() -> bool,
    ) -> Result<Vec<u32>, (FailureCode, String)> {
        let Reserved { handle, blocks, ref placements, ref recorded } = *reserved;
        // A holder's read kept by a panic is logged, not counted: the counter is of fetched
        // segments (`ClusterMetrics::kept_reservations`).
        let read = self.with_staging(handle, staging_deadline, stopped, None, |staging| {
            staging.transfer(handle, Direction::Retrieve, placements, deadline, stopped)?;
            bytes.resize(blocks * self.block_bytes, 0);
            for (block, chunk) in bytes.chunks_exact_mut(self.block_bytes).enumerate() {
                staging.read_block(block as u32, chunk).map_err(StagingError::keep)?;
            }
            Ok(())
        });
        if let Err(failed) = read {
            // Reads only: a read still in flight cannot damage a slot, so the pins may go.
            let code = match failed.error {
                FetchError::StagingBusy | FetchError::Stopped => FailureCode::Unavailable,
                _ => FailureCode::ReadFailed,
            };
            return Err((code, failed.error.to_string()));
        }
        let crcs: Vec<u32> = bytes.chunks_exact(self.block_bytes).map(crc32fast::hash).collect();
        if let Some(recorded) = recorded {
            // Engine block i is the segment's block i (prefix order), so placement i holds it.
            let damaged: Vec<MismatchedBlock> = placements
                .iter()
                .enumerate()
                .filter(|&(position, _)| recorded[position] != crcs[position])
                .map(|(position, placement)| MismatchedBlock {
                    position,
                    engine_block: placement.engine_block,
                    device: placement.location.device,
                    slot: placement.location.slot,
                    expected_crc: recorded[position],
                    computed_crc: crcs[position],
                })
                .collect();
            if let Some(first) = damaged.first() {
                // Out of the index (and so out of the registry on the registrar's next pass,
                // through the departure log): a damaged block is not offered again.
                let mut state = lock(store);
                if let Err(error) = state.control.evict_mismatched(handle, &damaged, &mut NoLender) {
                    tracing::warn!(%error, "evicting a segment's damaged blocks");
                }
                return Err((
                    FailureCode::ReadFailed,
                    format!(
                        "block {} of the segment ({} damaged) does not match the CRC its holder recorded at commit: not sent, evicted here",
                        first.position,
                        damaged.len()
                    ),
                ));
            }
        }
        Ok(crcs)
    }

    /// Runs `work` on the staging area. After a layer that may still be in flight the area is
    /// retired (its queue pairs deleted, which ends their commands); so it is when `work`
    /// panics (the turn's drop). If a deletion failed, a
    /// command may still move the request's slots: the error says to keep its reservation for
    /// good (never released, so the slots are never reused). A panic keeps it too (the
    /// unwinding skips the caller's release), counted in `kept_reservations` when given (an
    /// asker's store: `DataPlane::kept_reservations` counts fetched segments' reservations).
    /// The wait for the area's turn ends at `deadline` (`StagingBusy`) or when `stopped`.
    fn with_staging(
        &self,
        handle: RequestHandle,
        deadline: Instant,
        stopped: &dyn Fn() -> bool,
        kept_reservations: Option<&Counter>,
        work: impl FnOnce(&mut Staging) -> Result<(), StagingError>,
    ) -> Result<(), Staged> {
        let mut turn = match self.staging.take(deadline, stopped) {
            Ok(turn) => turn,
            Err(NoTurn::Deadline) => return Err(Staged { error: FetchError::StagingBusy, keep_reservation: false }),
            Err(NoTurn::Stopped) => return Err(Staged { error: FetchError::Stopped, keep_reservation: false }),
        };
        turn.kept_reservations = kept_reservations;
        let staging = turn.area();
        let Some(area) = staging.as_mut() else { return Err(Staged { error: FetchError::NoStaging, keep_reservation: false }) };
        match work(area) {
            Ok(()) => Ok(()),
            Err(StagingError { error, retire, stopped: drained }) => {
                let mut keep_reservation = false;
                if retire {
                    let freed = staging.take().is_some_and(Staging::retire);
                    if !freed {
                        tracing::error!(
                            handle = handle.to_bits(),
                            "a data-plane request's slots are kept for good: a command may still move them"
                        );
                        keep_reservation = true;
                    }
                }
                // The drain between layers is this node's stop, not a failure of its store.
                let error = if drained { FetchError::Stopped } else { FetchError::Store { segment: 0, source: Box::new(error) } };
                Err(Staged { error, keep_reservation })
            }
        }
    }

    /// Asker: reads segments `first..first + count` of a prompt (`keys`, its block keys) from
    /// the holder at `address` and stores each locally. Returns the blocks stored (new to this
    /// pool); a failure says which segment and why (those stored before it stay). The whole
    /// fetch is bounded by `deadline` and ends early when `stopped` (the daemon's drain). Each
    /// segment stored is passed to `stored_segment` (its index, its keys, how many times its
    /// holder has served it, and whether this store wrote its last block: false when the block
    /// was in the pool already, committed by another store — a local client's, or a concurrent
    /// fetch's — and shared) right after its commit.
    #[allow(clippy::too_many_arguments)]
    pub fn fetch(
        &self,
        store: &Mutex<StoreState>,
        space: &ModelSpace,
        keys: &[u64],
        segments: std::ops::Range<usize>,
        node: &str,
        address: SocketAddr,
        deadline: Instant,
        stopped: &dyn Fn() -> bool,
        stored_segment: &mut StoredSegment<'_>,
    ) -> Result<usize, (usize, FetchError)> {
        // Nothing fetched could be stored: failed before a holder is asked (and its disks,
        // staging area and link spent on a segment, counted toward a replica).
        if self.staging.retired() {
            return Err((0, FetchError::NoStaging));
        }
        let Some(_slot) = FetchSlot::take(&self.fetches) else {
            return Err((0, FetchError::Busy { max: FETCHES_MAX }));
        };
        let per_segment = usize::from(self.segment_blocks.get());
        // The drain met on the connection is this node's, not the holder's: `Stopped`.
        let peer_error = |segment: usize, source| match source {
            PeerError::Stopped { .. } => FetchError::Stopped,
            source => FetchError::Peer { node: node.to_owned(), address, segment: segment as u32, source: Box::new(source) },
        };
        let stall = self.bounds.stall;
        // Clamped to the time left: a connect begun just before the deadline must not run
        // CONNECT_TIMEOUT past it.
        let connect = |segment: usize, until: Instant| {
            let left = until.saturating_duration_since(Instant::now()).min(CONNECT_TIMEOUT);
            if left.is_zero() {
                let source = std::io::Error::new(std::io::ErrorKind::TimedOut, "the deadline passed before connecting");
                return Err(peer_error(segment, PeerError::Io { context: "connecting", source }));
            }
            let stream = TcpStream::connect_timeout(&address, left)
                .map_err(|source| peer_error(segment, PeerError::Io { context: "connecting", source }))?;
            let configure = |stream: &TcpStream| {
                stream.set_read_timeout(Some(Duration::from_millis(50)))?;
                stream.set_write_timeout(Some(stall))?;
                stream.set_nodelay(true)
            };
            configure(&stream).map_err(|source| peer_error(segment, PeerError::Io { context: "configuring", source }))?;
            Ok(stream)
        };
        let mut stream = connect(segments.start, deadline).map_err(|error| (0, error))?;
        let (mut frame, mut body, mut bytes) = (Vec::new(), Vec::new(), Vec::new());
        let mut stored = 0;
        for segment in segments {
            let segment_keys = &keys[segment * per_segment..(segment + 1) * per_segment];
            let request = ReadSegment { space: *space, index: segment as u32, geometry: self.geometry, keys: segment_keys.to_vec() };
            let started = Instant::now();
            let segment_deadline = deadline.min(started + self.bounds.segment);
            // A busy holder (its connections or request slots all taken, its staging area
            // queued past its wait) is asked again on a new connection after a pause, until
            // the segment's deadline: busy is not broken.
            let mut pause = Duration::from_millis(50);
            // A holder closes a connection idle for PEER_IDLE, and this node's wait for its own
            // staging area between two segments may be longer (up to the fetch's deadline): a
            // connection found closed before a byte of the answer is made anew, once a segment.
            // One closed mid-answer is the holder's failure.
            let mut reconnected = false;
            let served = loop {
                match self.receive_segment(&mut stream, &request, &mut frame, &mut body, &mut bytes, segment_deadline, stopped) {
                    Ok(served) => break served,
                    Err(Unreceived { error: PeerError::Refused { code: FailureCode::Unavailable, message }, .. }) => {
                        // The drain met before or during the pause is this node's, not the
                        // holder staying busy: `Stopped`.
                        if stopped() {
                            return Err((stored, FetchError::Stopped));
                        }
                        if Instant::now() + pause >= segment_deadline {
                            let waited = started.elapsed();
                            let busy = FetchError::HolderBusy { node: node.to_owned(), address, segment: segment as u32, waited, message };
                            return Err((stored, busy));
                        }
                        if !pause_unless_stopped(pause, stopped) {
                            return Err((stored, FetchError::Stopped));
                        }
                        pause = (pause * 2).min(BUSY_PAUSE_MAX);
                        stream = connect(segment, segment_deadline).map_err(|error| (stored, error))?;
                    }
                    // Not asked again for the drain: the fetch stopped, not the holder's close.
                    Err(Unreceived { unanswered: true, .. }) if !reconnected && stopped() => return Err((stored, FetchError::Stopped)),
                    Err(Unreceived { error, unanswered: true }) if !reconnected && Instant::now() < segment_deadline => {
                        tracing::debug!(%address, segment, %error, "the holder closed the connection before answering: connecting again");
                        reconnected = true;
                        stream = connect(segment, segment_deadline).map_err(|error| (stored, error))?;
                    }
                    Err(Unreceived { error, .. }) => return Err((stored, peer_error(segment, error))),
                }
            };
            let (written, last_written) = self.store_segment(store, segment_keys, &bytes, deadline, stopped).map_err(|error| {
                (
                    stored,
                    match error {
                        FetchError::Store { source, .. } => FetchError::Store { segment: segment as u32, source },
                        other => other,
                    },
                )
            })?;
            stored += written;
            stored_segment(segment, segment_keys, served, last_written);
        }
        Ok(stored)
    }

    /// Asker: one segment's request and answer; its blocks' bytes into `bytes`, each checked.
    /// Returns how many times the holder has served the segment (its header's count).
    #[allow(clippy::too_many_arguments)]
    fn receive_segment(
        &self,
        stream: &mut TcpStream,
        request: &ReadSegment,
        frame: &mut Vec<u8>,
        body: &mut Vec<u8>,
        bytes: &mut Vec<u8>,
        deadline: Instant,
        stopped: &dyn Fn() -> bool,
    ) -> Result<u32, Unreceived> {
        let before_answer = |error: PeerError| Unreceived { unanswered: closed_or_reset(&error), error };
        let failed = |error: PeerError| Unreceived { error, unanswered: false };
        request.encode(frame);
        peer::write_all(stream, frame, deadline, stopped, "sending a read").map_err(before_answer)?;
        let block_bytes = self.block_bytes as u64;
        let body_max = |kind| peer::answer_body_max(kind, block_bytes);
        let stall = self.bounds.stall;
        // The holder sends the header as soon as the blocks are pinned: `stall` bounds it, so a
        // holder that accepted and hangs costs 2 s, not the segment's deadline, and is passed
        // over for the next holder listed (`AWAITING_HEADER`).
        let mut first = [0u8; 1];
        peer::read_exact_bounded(stream, &mut first, stall, deadline, stopped, AWAITING_HEADER).map_err(before_answer)?;
        let context = "receiving the segment header";
        match peer::read_frame_begun(stream, first[0], body, body_max, stall, deadline, stopped, context).map_err(failed)? {
            PeerKind::SegmentHeader => {}
            PeerKind::Failure => return Err(failed(peer::decode_failure(body))),
            other => return Err(failed(PeerError::Garbage(format!("a {other:?} frame where a segment header was due")))),
        }
        let SegmentHeader { blocks, block_bytes: sent_bytes, served, geometry } = peer::decode_segment_header(body).map_err(failed)?;
        if usize::from(blocks) != request.keys.len() || sent_bytes != block_bytes {
            return Err(failed(PeerError::Garbage(format!(
                "a segment of {blocks} blocks of {sent_bytes} bytes; asked for {} of {block_bytes}",
                request.keys.len()
            ))));
        }
        // The holder checks the request's geometry too; a holder that did not (or lies about
        // its block size) is caught here, before a byte is stored.
        if geometry != self.geometry {
            return Err(failed(PeerError::Garbage(format!(
                "a segment of blocks of geometry {geometry}; this pool's geometry is {}",
                self.geometry
            ))));
        }
        bytes.clear();
        for expected in 0..usize::from(blocks) {
            // The first block's first byte may take until the segment's deadline: the holder
            // waits for its staging area's turn (up to 8 peer reads and 4 stores queue for it)
            // and reads the whole segment before sending it, or sends a `Failure` here instead.
            // Every byte after it: `stall`.
            let wait = if expected == 0 { deadline.saturating_duration_since(Instant::now()) } else { stall };
            match peer::read_frame(stream, body, body_max, wait, stall, deadline, stopped, "receiving a block").map_err(failed)? {
                PeerKind::Block => {}
                PeerKind::Failure => return Err(failed(peer::decode_failure(body))),
                other => return Err(failed(PeerError::Garbage(format!("a {other:?} frame where block {expected} was due")))),
            }
            let (index, _, block) = peer::decode_block(body, self.block_bytes).map_err(failed)?;
            if usize::from(index) != expected {
                return Err(failed(PeerError::Garbage(format!("block {index} where block {expected} was due"))));
            }
            bytes.extend_from_slice(block);
        }
        Ok(served)
    }

    /// Asker: stores a fetched segment (`bytes`: its blocks in order) in the local pool; its
    /// blocks already here are shared, not written. Returns the blocks written, and whether the
    /// segment's last block was among them. The wait for
    /// the staging area counts against the fetch's `deadline` and ends when `stopped`; so does
    /// the write, which issues no layer past either (`Staging::transfer`: `Stopped` for the
    /// drain, the reservation released); a layer issued is finished (bounded by the staging
    /// area's per-layer timeout): abandoning it would leave it in flight and retire the staging
    /// area.
    fn store_segment(
        &self,
        store: &Mutex<StoreState>,
        keys: &[u64],
        bytes: &[u8],
        deadline: Instant,
        stopped: &dyn Fn() -> bool,
    ) -> Result<(usize, bool), FetchError> {
        if stopped() {
            return Err(FetchError::Stopped);
        }
        let engine_blocks: Vec<u32> = (0..keys.len() as u32).collect();
        let store_error = |source| FetchError::Store { segment: 0, source: Box::new(source) };
        let (handle, placements, records_crcs) = {
            let mut store = lock(store);
            let control = &mut store.control;
            let plan = control.reserve_store(keys, &engine_blocks, &mut NoLender).map_err(store_error)?;
            match control.placements(plan.handle).map(<[_]>::to_vec) {
                Ok(placements) => (plan.handle, placements, control.records_payload_crcs()),
                Err(error) => {
                    let _ = control.release(plan.handle);
                    return Err(store_error(error));
                }
            }
        };
        if placements.is_empty() {
            release(store, handle);
            return Ok((0, false));
        }
        // Whether this store writes the segment's last block (its key, the segment's): one
        // shared was committed by another store, whose registration is that store's own.
        let last_written = placements.iter().any(|placement| placement.engine_block as usize + 1 == keys.len());
        let mut crcs = Vec::new();
        let written = self.with_staging(handle, deadline, stopped, Some(&self.kept_reservations), |staging| {
            let keep = StagingError::keep;
            for placement in &placements {
                let block = placement.engine_block as usize;
                staging
                    .write_block(placement.engine_block, &bytes[block * self.block_bytes..(block + 1) * self.block_bytes])
                    .map_err(keep)?;
            }
            staging.transfer(handle, Direction::Store, &placements, deadline, stopped)?;
            staging.finish_store(handle, records_crcs, &mut crcs).map_err(keep)?;
            // The staging lock is held until the commit: lock order staging, then pool.
            let mut store = lock(store);
            store.control.commit_store(handle, records_crcs.then_some(&crcs[..]), &mut NoLender).map_err(keep)?;
            Ok(())
        });
        match written {
            Ok(()) => Ok((placements.len(), last_written)),
            Err(Staged { error, keep_reservation: true }) => {
                // Never released: counted, as an operator could not tell these pinned slots
                // from load otherwise (`with_staging` logged it).
                self.kept_reservations.inc();
                Err(error)
            }
            Err(Staged { error, keep_reservation: false }) => {
                // A refused commit keeps the reservation, a failed one ended it (release is a
                // no-op then); anything else left it reserved: nothing of it becomes visible.
                release(store, handle);
                Err(error)
            }
        }
    }
}

/// Told of each segment an asker stored: its index, its keys, how many times its holder has
/// served it, whether this store wrote its last block ([`DataPlane::fetch`]).
pub type StoredSegment<'a> = dyn FnMut(usize, &[u64], u32, bool) + 'a;

/// Asker: the context of the wait for a segment header's first byte. A stall there (no byte of
/// the answer: a holder that accepted and hangs) passes the holder over like one unreachable
/// ([`FetchError::another_holder_may_serve`], [`FetchError::holder_unreachable`]); a stall once
/// the answer began does not.
const AWAITING_HEADER: &str = "waiting for the segment header";

/// The `NotHeld` text a peer gets: the store's own (which blocks are cached) is logged here.
const NOT_HELD: &str = "the segment is not held whole here";

/// Sleeps `pause`, in steps that ask `stopped`; false if stopped.
fn pause_unless_stopped(pause: Duration, stopped: &dyn Fn() -> bool) -> bool {
    let until = Instant::now() + pause;
    loop {
        if stopped() {
            return false;
        }
        let now = Instant::now();
        if now >= until {
            return true;
        }
        std::thread::sleep((until - now).min(Duration::from_millis(20)));
    }
}

/// Holder: answers a connection over [`PEERS_MAX`] `Unavailable` (the asker retries) and closes
/// it, from the accept thread, so every step is short: the frame is small (a new socket's send
/// buffer takes it whole; the write is still bounded), then [`close_after_refusal`].
fn refuse_busy(mut stream: TcpStream) {
    let mut frame = Vec::new();
    peer::encode_failure(
        &mut frame,
        FailureCode::Unavailable,
        &format!("busy: this holder serves {PEERS_MAX} peer connections already; retry"),
    );
    let never = || false;
    let sent = stream
        .set_write_timeout(Some(Duration::from_millis(100)))
        .map_err(|source| PeerError::Io { context: "configuring a refused connection", source })
        .and_then(|()| peer::write_all(&mut stream, &frame, Instant::now() + Duration::from_millis(100), &never, "refusing a connection"));
    if let Err(error) = sent {
        tracing::info!(%error, "refusing a data-plane connection over the limit");
        return;
    }
    close_after_refusal(&mut stream);
}

/// Holder: readies a connection whose refusal was just written for its close: the write half is
/// shut (a FIN after the frame) and what the asker sent already is drained without waiting, at
/// most 64 KiB (a request is under 1 KiB). Closing with unread bytes would reset the connection,
/// which may discard the refusal before the asker reads it (it would see a reset, not why).
fn close_after_refusal(stream: &mut TcpStream) {
    let _ = stream.shutdown(std::net::Shutdown::Write);
    if stream.set_nonblocking(true).is_ok() {
        let mut scratch = [0u8; 4096];
        for _ in 0..16 {
            match std::io::Read::read(stream, &mut scratch) {
                Ok(count) if count > 0 => {}
                _ => break,
            }
        }
    }
}

/// One of the node's [`FETCHES_MAX`] fetch slots, given back when dropped (on every path out).
struct FetchSlot<'a>(&'a AtomicUsize);

impl<'a> FetchSlot<'a> {
    fn take(fetches: &'a AtomicUsize) -> Option<FetchSlot<'a>> {
        fetches.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| (now < FETCHES_MAX).then_some(now + 1)).ok()?;
        Some(FetchSlot(fetches))
    }
}

impl Drop for FetchSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Holder: one of the [`PEERS_MAX`] peer connection slots (the accept loop checks the limit),
/// given back when dropped, so a peer thread that panics does not keep it for good.
struct PeerSlot<'a>(&'a AtomicUsize);

impl<'a> PeerSlot<'a> {
    fn take(peers: &'a AtomicUsize) -> PeerSlot<'a> {
        peers.fetch_add(1, Ordering::AcqRel);
        PeerSlot(peers)
    }
}

impl Drop for PeerSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Sets its flag when dropped (`Release`): on a normal way out and on unwinding alike.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Holder: the drain's grace for a block being sent. Once the drain is seen (asked before each
/// write call), the block's writes may go on for one stall bound more, then [`DrainGrace::cut`]
/// ends them; meanwhile each write call's socket timeout is shortened to what is left of it, so
/// no call outlasts it. A block in flight thus holds the drain at most the write call in
/// progress when the drain came (the socket's stall write timeout) plus one stall bound.
struct DrainGrace<'a> {
    stopped: &'a dyn Fn() -> bool,
    stall: Duration,
    /// Set when the drain is first seen: when the block's writes are cut.
    cut_at: Cell<Option<Instant>>,
}

impl<'a> DrainGrace<'a> {
    fn new(stopped: &'a dyn Fn() -> bool, stall: Duration) -> DrainGrace<'a> {
        DrainGrace { stopped, stall, cut_at: Cell::new(None) }
    }

    /// Whether the drain was seen during a block's writes (the socket's write timeout may be
    /// shortened since).
    fn began(&self) -> bool {
        self.cut_at.get().is_some()
    }

    /// `write_all`'s stop: true once the grace is spent.
    fn cut(&self) -> bool {
        match self.cut_at.get() {
            Some(at) => Instant::now() >= at,
            None => {
                if (self.stopped)() {
                    self.cut_at.set(Some(Instant::now() + self.stall));
                }
                false
            }
        }
    }

    fn writer<'s>(&'s self, stream: &'s TcpStream) -> GraceWriter<'s, 'a> {
        GraceWriter { stream, grace: self }
    }
}

/// Writes to a peer connection whose write calls, once the drain's grace began, end with it.
struct GraceWriter<'s, 'a> {
    stream: &'s TcpStream,
    grace: &'s DrainGrace<'a>,
}

impl Write for GraceWriter<'_, '_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if let Some(at) = self.grace.cut_at.get() {
            // A zero timeout would be refused (and mean none): `cut` ends the writes once due.
            let left = at.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            self.stream.set_write_timeout(Some(left))?;
        }
        self.stream.write(bytes)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

/// Asker: a segment's read that failed, and whether the connection was found closed or reset
/// before a byte of the answer came (sending the request or awaiting the header's first byte).
struct Unreceived {
    error: PeerError,
    unanswered: bool,
}

/// Holder: whether the asker closed its end of the connection (a peek that does not wait reads
/// its FIN: 0 bytes) or reset it. A request pipelined behind the one being answered is data,
/// not a close; nothing yet is not one either.
fn peer_closed(fd: std::os::fd::RawFd) -> bool {
    use nix::errno::Errno;
    use nix::sys::socket::{recv, MsgFlags};
    let mut byte = [0u8; 1];
    match recv(fd, &mut byte, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT) {
        Ok(0) => true,
        Ok(_) | Err(Errno::EAGAIN | Errno::EINTR) => false,
        Err(_) => true,
    }
}

/// A connection the peer closed or reset (not one that stalled, nor the daemon's drain).
fn closed_or_reset(error: &PeerError) -> bool {
    use std::io::ErrorKind;
    match error {
        PeerError::Closed { .. } => true,
        PeerError::Io { source, .. } => {
            matches!(
                source.kind(),
                ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe | ErrorKind::UnexpectedEof
            )
        }
        _ => false,
    }
}

/// A holder's reservation of a segment it was asked for: pinned until released.
struct Reserved {
    handle: RequestHandle,
    blocks: usize,
    placements: Vec<Placement>,
    /// The CRCs recorded at commit, when the pool records them.
    recorded: Option<Vec<u32>>,
}

/// How a holder's answer to a read ended (a failure to send is the connection's end).
enum Answered {
    /// Every block sent.
    Whole,
    /// A `Failure` frame sent where the first block was due.
    Refused,
}

/// A staging failure, and whether the request's reservation must be kept for good.
struct Staged {
    error: FetchError,
    keep_reservation: bool,
}

fn release(store: &Mutex<StoreState>, handle: RequestHandle) {
    // Ended already (committed, or failed while writing) is fine.
    let _ = lock(store).control.release(handle);
}

#[cfg(test)]
mod tests;
