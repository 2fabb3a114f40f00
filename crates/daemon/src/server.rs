//! The daemon's socket server: one listening Unix socket (mode 0600), one thread per connection
//! up to `clients_max`, every read bounded by a tick, every frame by `frame_timeout`, every
//! session by its lease.
//!
//! Why threads and not an async runtime: a node has a handful of clients (one per GPU worker,
//! one scheduler, a status query now and then; `clients_max` 64 by default), each sending a few
//! control requests per inference request, microseconds of work each. A bounded thread per
//! connection keeps each client's state on its own stack, blocks only that client on a slow
//! peer, and needs no dependency; 64 threads × a 1 MiB body buffer at most is the whole cost.
//!
//! Locking: the pool (the store's control half) behind one mutex, the session table behind
//! another; neither is held across socket I/O. The pool lock is held for an index probe (keys
//! are hashed before it is taken), a reservation, or a commit (flush + header writes with FUA:
//! one commit at a time, and lookups wait for it; docs/tuttid.md gives the figures).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use crate::cluster::{ClusterAgent, ClusterSettings, PreparedStores};
use crate::frame_io::{read_frame, write_frame, write_frame_with_fds, ReadOutcome};
use crate::gpu_memory::{DeviceMemoryImport, DeviceMemoryService};
use crate::keys::KeySpace;
use crate::lock::DeviceLocks;
use crate::metrics::{ClientRelay, Metrics, MetricsEndpoint, RequestLabel, Snapshot};
use crate::pool_open::OpenedPool;
use crate::protocol::{
    encode_frame, ClientStatus, ClusterStatusReply, DeviceStatus, ErrorCode, HelloReply, Kind, PoolShape, Reply, Request, StatusReply,
};
use crate::relay::{DoorbellRelay, PairCounters, RelayConfig};
use crate::session::{Holdings, LeakCounters, SessionLimits, StoreState};
use crate::DaemonError;

mod cluster_requests;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub socket: PathBuf,
    /// A session (or a connection that never attached) that sends no frame for this long is
    /// ended, and everything it held released.
    pub lease: Duration,
    /// A frame must arrive whole within this of its first byte; a reply must be taken by the
    /// peer within it.
    pub frame_timeout: Duration,
    /// Connections served at once; one more is answered `Busy` and closed.
    pub clients_max: usize,
    /// User ids allowed to connect (the socket is 0600 as well; this is checked with
    /// SO_PEERCRED for a socket whose mode an operator widened).
    pub allowed_uids: Vec<u32>,
    /// Granularity of stop and deadline checks.
    pub tick: Duration,
    /// Where `GET /metrics` is served (Prometheus text format); `None`: not served.
    pub metrics: Option<SocketAddr>,
    /// What one session may hold on the store path.
    pub session_limits: SessionLimits,
    /// Which device memory `RegisterDeviceMemory` imports (`crate::gpu_memory`); off by default.
    pub device_memory: DeviceMemoryImport,
    /// Run as a node of a cluster (`crate::cluster`); `None` by default.
    pub cluster: Option<ClusterSettings>,
}

impl ServerConfig {
    /// The ranges [`ServerConfig::validate`] accepts: wide enough for any deployment, narrow
    /// enough that every deadline computed from them (`Instant + Duration`) stays representable
    /// and every socket timeout is one the kernel takes (not zero).
    pub const LEASE_RANGE: std::ops::RangeInclusive<Duration> = Duration::from_millis(100)..=Duration::from_secs(86_400);
    pub const FRAME_TIMEOUT_RANGE: std::ops::RangeInclusive<Duration> = Duration::from_millis(10)..=Duration::from_secs(3_600);
    pub const TICK_RANGE: std::ops::RangeInclusive<Duration> = Duration::from_millis(1)..=Duration::from_secs(1);

    /// Refuses durations and counts the server cannot run with (a lease of `u64::MAX` seconds
    /// used to panic every connection thread computing its deadline; a zero frame timeout
    /// failed every connection's `set_write_timeout`).
    pub fn validate(&self) -> Result<(), DaemonError> {
        let check = |name: &str, value: Duration, range: &std::ops::RangeInclusive<Duration>| {
            if range.contains(&value) {
                Ok(())
            } else {
                Err(DaemonError::Config(format!("{name} {value:?} is outside {:?}..={:?}", range.start(), range.end())))
            }
        };
        check("lease", self.lease, &Self::LEASE_RANGE)?;
        check("frame timeout", self.frame_timeout, &Self::FRAME_TIMEOUT_RANGE)?;
        check("tick", self.tick, &Self::TICK_RANGE)?;
        if self.clients_max == 0 {
            return Err(DaemonError::Config("clients_max 0 would serve no client".into()));
        }
        Ok(())
    }

    /// Defaults: lease 10 s, frame timeout 2 s, 64 clients, only this process's user, 50 ms tick.
    pub fn new(socket: PathBuf) -> ServerConfig {
        ServerConfig {
            socket,
            lease: Duration::from_secs(10),
            frame_timeout: Duration::from_secs(2),
            clients_max: 64,
            allowed_uids: vec![nix::unistd::geteuid().as_raw()],
            tick: Duration::from_millis(50),
            metrics: None,
            session_limits: SessionLimits::default(),
            device_memory: DeviceMemoryImport::Off,
            cluster: None,
        }
    }
}

/// A later thread failed to start: stops and joins the ones already started, so that none
/// outlives a failed `serve` (the registrar leaves the cluster on its way out).
fn stop_started<const N: usize>(shared: &Shared, threads: [Option<JoinHandle<()>>; N]) {
    shared.stop.stop();
    for thread in threads.into_iter().flatten() {
        if thread.join().is_err() {
            tracing::error!("a daemon thread panicked while stopping after a failed start");
        }
    }
}

/// Asks a running server to stop (drain): no new connections, each connection ends after the
/// request it is serving.
#[derive(Debug, Clone, Default)]
pub struct StopHandle(Arc<AtomicBool>);

impl StopHandle {
    pub fn stop(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub fn is_stopped(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// A session's record in the table `status` reports.
#[derive(Debug, Clone)]
struct SessionRecord {
    pid: u32,
    uid: u32,
    name: String,
    space: KeySpace,
    requests: u64,
    last_active: Instant,
    /// Store-path holdings, counted (the holdings themselves live with the connection).
    registrations: u32,
    queue_pairs: u32,
    requests_in_flight: u32,
    /// The relay's counters of the session's relayed pairs (set when it attaches queues).
    relay: Vec<Arc<PairCounters>>,
}

impl SessionRecord {
    /// Doorbells the relay forwarded and dropped for this session's pairs.
    fn relay_counts(&self) -> (u64, u64) {
        self.relay.iter().fold((0, 0), |(forwarded, dropped), pair| {
            (forwarded + pair.forwarded.load(Ordering::Relaxed), dropped + pair.dropped.load(Ordering::Relaxed))
        })
    }
}

struct Shared {
    config: ServerConfig,
    store: Mutex<StoreState>,
    devices: Vec<DeviceStatus>,
    report: objstore::RecoveryReport,
    locks: Mutex<Option<DeviceLocks>>,
    shape: PoolShape,
    pool_shape: objstore::PoolShape,
    /// Bytes of one engine block (all layers, K and V).
    block_bytes: u64,
    next_registration: AtomicU64,
    device_memory: DeviceMemoryService,
    leaks: LeakCounters,
    sessions: Mutex<BTreeMap<u64, SessionRecord>>,
    connections: AtomicU32,
    next_session: AtomicU64,
    stop: StopHandle,
    started: Instant,
    metrics: Metrics,
    /// The daemon as a cluster node (`ServerConfig::cluster`).
    cluster: Option<ClusterAgent>,
}

/// What `serve` hands back after a drain: the pool, for the caller to close.
pub struct ServeReport {
    pub opened: OpenedPool,
    /// Connections served in total.
    pub connections_served: u64,
}

pub struct Server {
    listener: UnixListener,
    shared: Arc<Shared>,
    metrics_endpoint: Option<MetricsEndpoint>,
}

/// Locks a mutex whose holder may have panicked: the session table is plain records; the
/// store's control half keeps its index consistent between calls (a panic inside one is a bug
/// the poisoned pool would not make safer to stop serving on).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Server {
    /// Binds the socket (owner-only) for `opened`. A socket file left by a dead daemon is
    /// replaced; one a live daemon answers on is [`DaemonError::SocketInUse`]; any other file
    /// there is left alone and refused.
    pub fn bind(config: ServerConfig, opened: OpenedPool) -> Result<Server, DaemonError> {
        config.validate()?;
        let socket = &config.socket;
        let io = |context: String| move |source| DaemonError::Io { context, source };
        match std::fs::symlink_metadata(socket) {
            Ok(metadata) if metadata.file_type().is_socket() => {
                if UnixStream::connect(socket).is_ok() {
                    return Err(DaemonError::SocketInUse { socket: socket.clone() });
                }
                std::fs::remove_file(socket).map_err(io(format!("removing the stale socket {}", socket.display())))?;
            }
            Ok(_) => {
                return Err(DaemonError::Io {
                    context: format!("{} exists and is not a socket", socket.display()),
                    source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
                })
            }
            Err(_) => {}
        }
        let listener = UnixListener::bind(socket).map_err(io(format!("binding {}", socket.display())))?;
        // Owner-only. Between bind and chmod the socket has the umask's mode; the peer
        // credential check below refuses other users in that window too.
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
            .map_err(io(format!("making {} owner-only", socket.display())))?;
        listener.set_nonblocking(true).map_err(io("making the listener non-blocking".into()))?;
        let metrics_endpoint = config.metrics.map(MetricsEndpoint::bind).transpose()?;
        let geometry = *opened.pool.geometry();
        let pool_shape = opened.pool.shape().map_err(|source| DaemonError::Pool { context: "the pool's shape".into(), source })?;
        let block_bytes = 2 * u64::from(geometry.layers) * geometry.object_bytes();
        let shape = PoolShape {
            layers: geometry.layers,
            kv_heads: geometry.kv_heads,
            head_dim: geometry.head_dim,
            dtype_bytes: geometry.dtype_bytes,
            block_tokens: geometry.block_tokens,
            blocks_per_slot: opened.pool.blocks_per_slot(),
        };
        let OpenedPool { pool, devices, report, emulators, locks } = opened;
        // Every session may hold its cap of requests at once; a cluster node's data plane holds
        // its own on top (peers' reads, clients' fetches), so peers never take clients' slots.
        let requests_max = config
            .clients_max
            .saturating_mul(config.session_limits.requests_max)
            .saturating_add(if config.cluster.is_some() { crate::cluster::data_plane_requests_max(config.clients_max) } else { 0 })
            .max(1);
        let mut control = objstore::StoreControl::new(pool, requests_max)
            .map_err(|source| DaemonError::Pool { context: "the store's control half".into(), source })?;
        let mut metrics = Metrics::new();
        let cluster = match config.cluster.clone() {
            Some(settings) => {
                let cluster_metrics = crate::cluster::ClusterMetrics::default();
                metrics.register_cluster(&cluster_metrics);
                Some(ClusterAgent::start(settings, &mut control, block_bytes, requests_max, cluster_metrics)?)
            }
            None => None,
        };
        let relay = DoorbellRelay::start(RelayConfig::default())?;
        let device_memory = DeviceMemoryService::new(config.device_memory).map_err(DaemonError::DeviceMemory)?;
        let shared = Arc::new(Shared {
            config,
            store: Mutex::new(StoreState { control, emulators, relay }),
            devices,
            report,
            locks: Mutex::new(Some(locks)),
            shape,
            pool_shape,
            block_bytes,
            next_registration: AtomicU64::new(1),
            device_memory,
            leaks: LeakCounters::default(),
            sessions: Mutex::new(BTreeMap::new()),
            connections: AtomicU32::new(0),
            next_session: AtomicU64::new(1),
            stop: StopHandle::default(),
            started: Instant::now(),
            metrics,
            cluster,
        });
        Ok(Server { listener, shared, metrics_endpoint })
    }

    /// The address `GET /metrics` is served on (with its port when the configuration said 0).
    pub fn metrics_address(&self) -> Option<SocketAddr> {
        self.metrics_endpoint.as_ref().map(MetricsEndpoint::address)
    }

    pub fn stop_handle(&self) -> StopHandle {
        self.shared.stop.clone()
    }

    /// Serves until stopped, then drains: stops accepting, lets every connection finish the
    /// request it is serving (each tells its client `ShuttingDown`), joins them, removes the
    /// socket and hands the pool back.
    pub fn serve(self) -> Result<ServeReport, DaemonError> {
        let Server { listener, shared, metrics_endpoint } = self;
        let metrics_thread = match metrics_endpoint {
            None => None,
            Some(endpoint) => {
                let metrics_shared = Arc::clone(&shared);
                let spawned = std::thread::Builder::new().name("tuttid-metrics".into()).spawn(move || {
                    let stopped = || metrics_shared.stop.is_stopped();
                    let snapshot = || metrics_snapshot(&metrics_shared);
                    endpoint.serve(&metrics_shared.metrics, metrics_shared.config.tick, &stopped, &snapshot);
                });
                Some(spawned.map_err(|source| DaemonError::Io { context: "starting the metrics thread".into(), source })?)
            }
        };
        let registrar_thread = match shared.cluster.as_ref().and_then(ClusterAgent::take_registrar) {
            None => None,
            Some(registrar) => {
                let registrar_shared = Arc::clone(&shared);
                let spawned = std::thread::Builder::new().name("tuttid-registrar".into()).spawn(move || {
                    registrar.run(&registrar_shared.store, &registrar_shared.stop, registrar_shared.config.tick);
                });
                match spawned {
                    Ok(thread) => Some(thread),
                    Err(source) => {
                        stop_started(&shared, [metrics_thread]);
                        return Err(DaemonError::Io { context: "starting the cluster registrar".into(), source });
                    }
                }
            }
        };
        let data_plane_thread = match &shared.cluster {
            None => None,
            Some(_) => {
                let data_shared = Arc::clone(&shared);
                let spawned = std::thread::Builder::new().name("tuttid-data-plane".into()).spawn(move || {
                    if let Some(cluster) = &data_shared.cluster {
                        cluster.serve_data_plane(&data_shared.store, &data_shared.stop, data_shared.config.tick);
                    }
                });
                match spawned {
                    Ok(thread) => Some(thread),
                    Err(source) => {
                        stop_started(&shared, [metrics_thread, registrar_thread]);
                        return Err(DaemonError::Io { context: "starting the data plane".into(), source });
                    }
                }
            }
        };
        let mut workers: Vec<JoinHandle<()>> = Vec::new();
        let mut connections_served = 0u64;
        let tick_ms = u16::try_from(shared.config.tick.as_millis()).unwrap_or(u16::MAX);
        while !shared.stop.is_stopped() {
            let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::from(tick_ms)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(errno) => return Err(DaemonError::Io { context: "polling the listener".into(), source: std::io::Error::from(errno) }),
            }
            // Accept everything pending (bounded: each accepted connection either gets a
            // thread, up to clients_max, or a Busy answer and is closed).
            loop {
                match listener.accept() {
                    Ok((stream, _)) => {
                        connections_served += 1;
                        workers.retain(|worker| !worker.is_finished());
                        if workers.len() >= shared.config.clients_max {
                            refuse(stream, &shared.config, ErrorCode::Busy, "tuttid serves its maximum number of connections; retry later");
                            continue;
                        }
                        shared.connections.fetch_add(1, Ordering::AcqRel);
                        let connection_shared = Arc::clone(&shared);
                        let spawned = std::thread::Builder::new()
                            .name("tuttid-client".into())
                            .spawn(move || serve_connection(stream, &connection_shared));
                        match spawned {
                            Ok(worker) => workers.push(worker),
                            Err(error) => {
                                shared.connections.fetch_sub(1, Ordering::AcqRel);
                                tracing::error!("cannot start a connection thread: {error}");
                            }
                        }
                    }
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(error) => {
                        // ECONNABORTED, EMFILE...: this connection is lost, the server goes on.
                        tracing::warn!("accept failed: {error}");
                        break;
                    }
                }
            }
        }
        drop(listener);
        // The metrics thread checks the stop flag every tick (a scrape in progress finishes).
        if metrics_thread.is_some_and(|thread| thread.join().is_err()) {
            tracing::error!("the metrics thread panicked");
        }
        // The registrar sees the stop within a tick plus one registry call, then leaves the
        // cluster (bounded by the registry's request timeout).
        if registrar_thread.is_some_and(|thread| thread.join().is_err()) {
            tracing::error!("the cluster registrar panicked");
        }
        // Peer threads check the stop between reads (a send in progress is bounded by the
        // peer stall timeout).
        if data_plane_thread.is_some_and(|thread| thread.join().is_err()) {
            tracing::error!("the data plane panicked");
        }
        for worker in workers {
            // A connection thread ends within a tick plus one request plus a frame timeout.
            if worker.join().is_err() {
                tracing::error!("a connection thread panicked");
            }
        }
        if let Err(error) = std::fs::remove_file(&shared.config.socket) {
            tracing::warn!("removing {}: {error}", shared.config.socket.display());
        }
        let shared = Arc::try_unwrap(shared).map_err(|_| DaemonError::Io {
            context: "draining: a connection still holds the daemon state".into(),
            source: std::io::Error::from(std::io::ErrorKind::ResourceBusy),
        })?;
        let StoreState { control, emulators, relay } = shared.store.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner());
        // Every session ended above (and took its pairs off the relay); the thread ends before
        // the controllers go back to the caller.
        relay.stop();
        let locks = shared.locks.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner());
        let locks = locks.ok_or_else(|| DaemonError::Io {
            context: "draining: the device locks are gone".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })?;
        let opened = OpenedPool { pool: control.into_pool(), devices: shared.devices, report: shared.report, emulators, locks };
        Ok(ServeReport { opened, connections_served })
    }
}

/// Answers one error frame (best effort, bounded by the frame timeout) and closes.
fn refuse(stream: UnixStream, config: &ServerConfig, code: ErrorCode, message: &str) {
    let _ = stream.set_write_timeout(Some(config.frame_timeout));
    let mut frame = Vec::new();
    let reply = Reply::error(code, message);
    if encode_frame(&mut frame, reply.kind(), 0, |out| reply.encode_body(out)).is_ok() {
        let _ = write_frame(&stream, &frame);
    }
}

/// One connection's life: credentials, then frames until it closes, its lease runs out, it
/// breaks the protocol, or the server stops. Its session is released on every path out.
fn serve_connection(mut stream: UnixStream, shared: &Shared) {
    let mut connection = Connection {
        session: None,
        peer_pid: 0,
        peer_uid: 0,
        keys: Vec::new(),
        holdings: Holdings::default(),
        prepared_stores: PreparedStores::default(),
    };
    let outcome = connection.run(&mut stream, shared);
    if let Some(session) = connection.session.take() {
        release_session(shared, session, &mut connection.holdings);
    }
    shared.connections.fetch_sub(1, Ordering::AcqRel);
    if let Err(error) = outcome {
        tracing::info!("connection of pid {} ended: {error}", connection.peer_pid);
    }
}

/// Ends a session, on every path out (close, EOF after a kill, lease, protocol error, drain):
/// its queue pairs deleted, then its reservations released, then its windows unmapped
/// ([`Holdings::release`]); then its record goes.
fn release_session(shared: &Shared, session: u64, holdings: &mut Holdings) {
    let leaked = holdings.release(&shared.store, &shared.leaks);
    if leaked > 0 {
        tracing::error!(session, leaked, "session ended with queue pairs that could not be deleted: their memory is kept");
    }
    lock(&shared.sessions).remove(&session);
}

struct Connection {
    session: Option<u64>,
    peer_pid: u32,
    peer_uid: u32,
    /// Block keys of the request being served (reused).
    keys: Vec<u64>,
    /// The session's store-path holdings.
    holdings: Holdings,
    /// In a cluster: the block keys of the session's prepared stores, for the registrar.
    prepared_stores: PreparedStores,
}

impl Connection {
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
            let header = match read_frame(stream, &mut body, &mut fds, last_frame + config.lease, config.frame_timeout, &stop) {
                Ok(ReadOutcome::Frame(header)) => header,
                Ok(ReadOutcome::Closed) => return Ok(()),
                Ok(ReadOutcome::Idle) => {
                    let message = format!("no frame for {} ms; the session is ended", config.lease.as_millis());
                    return self.end_with(shared, stream, &mut frame, Reply::error(ErrorCode::LeaseExpired, message));
                }
                Ok(ReadOutcome::Stopped) => {
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
        let reply = match (request, space) {
            (Request::RegisterMemory(register), Some(_)) => {
                self.holdings.register(register, fds, &shared.store, limits, shared.block_bytes, &shared.next_registration)
            }
            (Request::AttachQueues(attach), Some(_)) => {
                let (reply, reply_fds) = self.holdings.attach(attach, &shared.store, limits);
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
                let space = match KeySpace::new(&hello.model_fingerprint, hello.tp_rank, hello.tp_world) {
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
                };
                lock(&shared.sessions).insert(session, record);
                self.session = Some(session);
                let lease_ms = u32::try_from(shared.config.lease.as_millis()).unwrap_or(u32::MAX);
                Reply::Hello(HelloReply { session, lease_ms, shape: shared.shape })
            }
            Request::Lookup { tokens } => self.lookup(shared, &tokens, false),
            Request::LookupAllRanks { tokens } => self.lookup(shared, &tokens, true),
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

    /// `Lookup` (the session's own key space) or `LookupAllRanks` (every rank of its world).
    fn lookup(&mut self, shared: &Shared, tokens: &[u32], all_ranks: bool) -> Reply {
        let Some(space) = self.session.and_then(|session| lock(&shared.sessions).get(&session).map(|record| record.space)) else {
            return Reply::error(ErrorCode::NotAttached, "send Hello (model fingerprint, TP rank and world size) before a lookup");
        };
        let block_tokens = shared.shape.block_tokens;
        let cached = if all_ranks {
            // Keys are hashed under the pool lock here (one chain per rank over the shrinking
            // common prefix): a scheduler's lookup is once per request, and the index must not
            // change between ranks' probes for the minimum to mean anything.
            let store = lock(&shared.store);
            space.cached_prefix_on_all_ranks(store.control.pool().index(), tokens, block_tokens, &mut self.keys)
        } else {
            space.keys(tokens, block_tokens, &mut self.keys);
            lock(&shared.store).control.lookup(&self.keys)
        };
        shared.metrics.lookup((tokens.len() / block_tokens.max(1) as usize) as u64, cached as u64);
        Reply::Lookup { cached_blocks: cached as u32, block_tokens }
    }
}

/// What a scrape reads from the daemon's state.
fn metrics_snapshot(shared: &Shared) -> Snapshot {
    let (pool, relay) = {
        let store = lock(&shared.store);
        (store.control.counts(), store.relay.counts())
    };
    let (clients, client_relay) = {
        let sessions = lock(&shared.sessions);
        let relayed = sessions.iter().filter(|(_, record)| !record.relay.is_empty());
        let client_relay = relayed
            .map(|(&session, record)| {
                let (forwarded, dropped) = record.relay_counts();
                ClientRelay { session, name: record.name.clone(), forwarded, dropped }
            })
            .collect();
        (sessions.len() as u64, client_relay)
    };
    let leaks = &shared.leaks;
    Snapshot {
        pool,
        clients,
        connections: u64::from(shared.connections.load(Ordering::Acquire)),
        leaked_queue_pairs: leaks.queue_pairs.load(Ordering::Relaxed),
        leaked_windows: leaks.windows.load(Ordering::Relaxed),
        leaked_window_bytes: leaks.window_bytes.load(Ordering::Relaxed),
        leaked_requests: leaks.requests.load(Ordering::Relaxed),
        relay,
        client_relay,
    }
}

fn status(shared: &Shared) -> StatusReply {
    // Sessions first, the pool after: `release_session` releases a session's holdings before it
    // removes its record, so a session missing here has released what it held by the time the
    // pool is counted. The other order could report a departed client's slots as still pinned.
    let clients: Vec<ClientStatus> = lock(&shared.sessions)
        .iter()
        .map(|(&session, record)| ClientStatus {
            session,
            pid: record.pid,
            uid: record.uid,
            name: record.name.clone(),
            tp_rank: record.space.tp_rank(),
            tp_world: record.space.tp_world(),
            requests: record.requests,
            idle_ms: record.last_active.elapsed().as_millis() as u64,
            registrations: record.registrations,
            queue_pairs: record.queue_pairs,
            requests_in_flight: record.requests_in_flight,
            doorbells_relayed: record.relay_counts().0,
            doorbells_dropped: record.relay_counts().1,
        })
        .collect();
    let (devices, pool, relay) = {
        let store = lock(&shared.store);
        let mut devices = shared.devices.clone();
        for (device, emulator) in devices.iter_mut().zip(&store.emulators) {
            device.refused_commands = emulator.as_ref().map_or(0, |emulator| emulator.stats().restriction_refusals);
        }
        (devices, store.control.counts(), store.relay.counts())
    };
    let leaks = &shared.leaks;
    StatusReply {
        daemon_pid: std::process::id(),
        uptime_ms: shared.started.elapsed().as_millis() as u64,
        shape: shared.shape,
        devices,
        pool,
        connections: shared.connections.load(Ordering::Acquire),
        clients,
        leaked_queue_pairs: leaks.queue_pairs.load(Ordering::Relaxed),
        leaked_windows: leaks.windows.load(Ordering::Relaxed),
        leaked_window_bytes: leaks.window_bytes.load(Ordering::Relaxed),
        leaked_requests: leaks.requests.load(Ordering::Relaxed),
        relay,
    }
}
