//! The daemon's socket server: one listening Unix socket (mode 0600), one thread per connection
//! up to `clients_max`, every read bounded by a tick, every frame by `frame_timeout`, every
//! session by its lease.
//!
//! Why threads and not an async runtime: a node has a handful of clients (one per GPU worker,
//! one scheduler, a status query now and then; `clients_max` 64 by default), each sending a few
//! control requests per inference request, microseconds of work each. A bounded thread per
//! connection keeps each client's state on its own stack, blocks only that client on a slow
//! peer, and needs no dependency; 64 threads × (a 1 MiB body buffer, a reply, a lookup's keys
//! and a `LookupAllRanks`'s chains: at most 8 MiB allocated, room included, plus the ≤ 2 MiB
//! one being hashed, `keys::RankChains`) is the whole cost.
//!
//! Locking: the pool (the store's control half) behind one mutex, the session table behind another;
//! neither is held across socket I/O. The pool lock is held for an index probe (keys are hashed
//! before it is taken, a `LookupAllRanks`'s too: every rank's chain, SHA-256 keys at ~130 ns a
//! 16-token block hashed alone (docs/objstore.md, "Cost"), which a scheduler may ask for every
//! step; the lock is taken briefly after each rank's hashing, to probe its chain and shrink the
//! prefix the next rank hashes, then once more for the final probes of all the ranks' chains, so
//! that the minimum is over one state of the index), a reservation, or a commit (flush +
//! header writes with FUA: one commit at a time, and lookups wait for it; docs/tuttid.md gives
//! the figures; after a failed metadata command a commit may replace the pool's metadata queue
//! pair, admin commands under the lock), but not across an attach's admin commands: an attach
//! takes it only to copy out the pool's controllers and to add or remove relayed pairs, and
//! holds a lock of its own (`attaching`) across its queue creations, each of which may wait out
//! the admin timeout; ended sessions' deletions take neither.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::cluster::{ClusterAgent, ClusterPrepared, ClusterSettings};
use crate::frame_io::write_frame;
use crate::gpu_memory::{DeviceMemoryImport, DeviceMemoryService};
use crate::keys::KeySpace;
use crate::lock::DeviceLocks;
use crate::metrics::{ClientRelay, Metrics, MetricsEndpoint, Snapshot};
use crate::pool_open::OpenedPool;
use crate::protocol::{encode_frame, ClientStatus, DeviceStatus, ErrorCode, PoolShape, Reply, StatusReply};
use crate::relay::{DoorbellRelay, PairCounters, RelayConfig};
use crate::session::{LeakCounters, Retiring, Retried, SessionLimits, StoreState};
use crate::DaemonError;

mod cluster_requests;
mod connection;

use connection::{serve_connection, Connection};

/// Connections accepted in one pass of the accept loop before it goes back to check the stop
/// flag and poll: local users who keep the accept queue full (each refused at `clients_max`,
/// the answer written there and then) would otherwise keep it accepting for as long as they
/// like, and hold off the drain. 64 refusals take well under a tick.
pub const ACCEPTS_PER_PASS_MAX: usize = 64;

/// How long `Server::bind` waits to tell whether a daemon is serving the socket already.
const SOCKET_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

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
    /// Connections served at once; one more is answered `Busy` and closed. At most
    /// [`ServerConfig::CLIENTS_MAX`], and lowered at start to what the descriptor limit allows
    /// unless `clients_max_explicit` ([`ServerConfig::check_descriptor_limit`]).
    pub clients_max: usize,
    /// Whether `clients_max` was chosen (tuttid's `--clients-max` given): a worst case past the
    /// descriptor limit is then refused rather than served with fewer clients. False by default:
    /// the default of 64 must still start under a hard limit of 1024 (`ulimit -n 1024`,
    /// systemd's or docker's 1024), where its worst case does not fit.
    pub clients_max_explicit: bool,
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
    /// The pool's devices as given to `open_pool` (`PoolOptions::specs`), so that
    /// [`ServerConfig::validate`] can refuse a cluster manifest at one's path; empty by default
    /// (not checked).
    pub pool_devices: Vec<tutti_devices::DeviceSpec>,
}

impl ServerConfig {
    /// The ranges [`ServerConfig::validate`] accepts: wide enough for any deployment, narrow
    /// enough that every deadline computed from them (`Instant + Duration`) stays representable
    /// and every socket timeout is one the kernel takes (not zero).
    pub const LEASE_RANGE: std::ops::RangeInclusive<Duration> = Duration::from_millis(100)..=Duration::from_secs(86_400);
    pub const FRAME_TIMEOUT_RANGE: std::ops::RangeInclusive<Duration> = Duration::from_millis(10)..=Duration::from_secs(3_600);
    pub const TICK_RANGE: std::ops::RangeInclusive<Duration> = Duration::from_millis(1)..=Duration::from_secs(1);
    /// `clients_max` when not chosen ([`ServerConfig::new`]).
    pub const CLIENTS_MAX_DEFAULT: usize = 64;
    /// The most connections `clients_max` may allow: the sessions one status reply can list
    /// (each session is one connection), so that a status reply can list every session when
    /// the daemon is at its busiest (the query itself is let in then on the one status-only
    /// connection kept beyond `clients_max`).
    pub const CLIENTS_MAX: usize = crate::protocol::STATUS_CLIENTS_MAX;
    /// The most requests one session may hold prepared (`SessionLimits::requests_max`): far
    /// past what any connector asks for (32 by default; vLLM's refuses more than 1024 requests
    /// of one layer in flight), and with `clients_max` within [`ServerConfig::REQUESTS_MAX`].
    pub const REQUESTS_PER_SESSION_MAX: usize = 4096;
    /// The most requests all sessions may hold at once (`clients_max` × `requests_max`): the
    /// store's control half allocates a reservation for each at start, about 120 bytes, so
    /// 2^20 is about 128 MiB at start; a count past it (a typo's 20,000,000 per session at 64
    /// clients is 1.3 billion, 150 GB) is refused here, before the pool is opened or formatted,
    /// not an allocation that aborts the daemon once it was.
    ///
    /// That bounds the table, not what requests take. A held request takes up to 36 bytes per
    /// block it named (placement 12, key 8, slot 8, a store's pin on a shared block 8), its
    /// vectors' room rounded up to a power of two blocks: about 2.3 MiB for `PREPARE_BLOCKS_MAX`
    /// (65,532) blocks, which blocks of 1 to 3 tokens name within one 1 MiB body, 0.6 MiB for a
    /// body of 16-token blocks (at most about 15,400). Released, a reservation keeps room for
    /// 256 blocks at most (objstore's `StoreControl`, about 9 KiB). So the memory is the table,
    /// 9 KiB per reservation ever used, and what the requests held at once take: the defaults'
    /// 2,048 (64 clients × 32) all holding a maximal body of 16-token blocks take about
    /// 1.2 GiB, 2^20 of them far more than any node has. Size `clients_max` × `requests_max`
    /// to the node's memory at about 0.6 MiB a request held (2.3 MiB with blocks of under 4
    /// tokens); a cluster node also copies a prepared store's keys (8 bytes a block) until it
    /// commits or is released.
    pub const REQUESTS_MAX: usize = 1 << 20;

    /// Refuses durations and counts the server cannot run with (a lease of `u64::MAX` seconds
    /// used to panic every connection thread computing its deadline; a zero frame timeout
    /// failed every connection's `set_write_timeout`; 20,000,000 requests per session aborted
    /// the daemon allocating their reservations, after `--format` had formatted the pool).
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
        if self.clients_max > Self::CLIENTS_MAX {
            return Err(DaemonError::Config(format!(
                "clients_max {} is over {}, the sessions one status reply can list",
                self.clients_max,
                Self::CLIENTS_MAX
            )));
        }
        let requests = self.session_limits.requests_max;
        if !(1..=Self::REQUESTS_PER_SESSION_MAX).contains(&requests) {
            return Err(DaemonError::Config(format!("requests per session {requests} is outside 1..={}", Self::REQUESTS_PER_SESSION_MAX)));
        }
        // At most 7173 × 4096: no overflow.
        if self.clients_max * requests > Self::REQUESTS_MAX {
            return Err(DaemonError::Config(format!(
                "{} clients × {requests} requests per session is {} requests held at once, over {}: lower either",
                self.clients_max,
                self.clients_max * requests,
                Self::REQUESTS_MAX
            )));
        }
        if let Some(cluster) = &self.cluster {
            self.check_manifest_apart(&cluster.manifest)?;
        }
        Ok(())
    }

    /// The daemon's own descriptors beyond those open when it starts, a pool device's and a
    /// cluster node's aside: the listener and the held socket file, the metrics endpoint's
    /// listener and its connections (16 at most), the relay, a connection being refused `Busy`,
    /// the binary's signal thread and logs, with room to spare.
    pub const DESCRIPTORS_OWN: u64 = 64;

    /// Descriptors a server with this configuration may hold on a pool of `devices`, beyond
    /// those open when it starts, at worst but for the cases below. Per connection (`clients_max`, and the status-only one
    /// counted as another): its socket, a memfd or dma-buf per registration
    /// (`registrations_max`), per device a relay page and its copy in the attach reply, the
    /// descriptors one `recvmsg` installs at most ([`crate::fd_passing::FDS_RECEIVED_MAX`]),
    /// and one more while a registration is checked or the peer's `/proc` entry read. Then the
    /// daemon's own ([`ServerConfig::DESCRIPTORS_OWN`]), four per device (its file or VFIO
    /// group and device, its lock) and, on a cluster node, a connection per data-plane request
    /// and 32 for the registry's client, the manifest and the data plane's listener.
    ///
    /// Not counted, left to the margin in [`ServerConfig::DESCRIPTORS_OWN`]:
    /// - sessions kept for good hold their windows past their connection (each one is logged at
    ///   error level);
    /// - retiring sessions (their queue pairs' deletion not yet confirmed) hold their windows'
    ///   memfds past their connection too, while a new connection takes the slot: during a run
    ///   of slow deletions up to `clients_max` × `registrations_max` more (bounded by the queue
    ///   ids, which their pairs keep until the deletion is confirmed);
    /// - a frame whose header comes in two `recvmsg` calls may install up to 8 descriptors with
    ///   the first and 9 with the second before it is refused, 17 rather than 9.
    pub fn descriptors_needed(&self, devices: usize) -> u64 {
        self.descriptors_needed_for(self.clients_max, devices)
    }

    /// [`ServerConfig::descriptors_needed`] with `clients_max` clients.
    fn descriptors_needed_for(&self, clients_max: usize, devices: usize) -> u64 {
        let devices = devices as u64;
        let registrations = self.session_limits.registrations_max as u64;
        let per_connection =
            (1 + crate::fd_passing::FDS_RECEIVED_MAX as u64 + 1).saturating_add(registrations).saturating_add(devices.saturating_mul(2));
        let connections = (clients_max as u64).saturating_add(1);
        let cluster = if self.cluster.is_some() { crate::cluster::data_plane_requests_max(clients_max) as u64 + 32 } else { 0 };
        connections
            .saturating_mul(per_connection)
            .saturating_add(Self::DESCRIPTORS_OWN)
            .saturating_add(devices.saturating_mul(4))
            .saturating_add(cluster)
    }

    /// Raises this process's soft descriptor limit to its hard one (the soft one is often 1024,
    /// kept low for programs using `select`, which this one does not), then checks the
    /// configuration's worst case ([`ServerConfig::descriptors_needed`] on the pool's devices,
    /// `pool_devices`, one when not given) and the descriptors open now against the limit:
    /// past it, accepts would fail with EMFILE (the connections left waiting in the backlog,
    /// never answered `Busy`) and registrations and attaches at random. Returns the clients to
    /// serve: `clients_max` when it fits; else, unless `clients_max_explicit`, the most that
    /// fit, with a warning (connections past them are answered `Busy`). Refused when even one
    /// client does not fit, or `clients_max` was chosen and does not. The process's limit, not
    /// the configuration: [`Server::prepare`] checks it, not [`ServerConfig::validate`].
    pub fn check_descriptor_limit(&self) -> Result<usize, DaemonError> {
        self.check_descriptor_limit_on(self.pool_devices.len().max(1))
    }

    /// [`ServerConfig::check_descriptor_limit`] on a pool of `devices`.
    fn check_descriptor_limit_on(&self, devices: usize) -> Result<usize, DaemonError> {
        use nix::sys::resource::{getrlimit, setrlimit, Resource, RLIM_INFINITY};
        let io = |context: &str| {
            let context = context.to_string();
            move |errno: nix::errno::Errno| DaemonError::Io { context, source: errno.into() }
        };
        let (mut soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(io("reading the descriptor limit"))?;
        if soft < hard {
            // A hard limit of RLIM_INFINITY is refused (past fs.nr_open): the soft one stays.
            match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                Ok(()) => {
                    tracing::info!(from = soft, to = hard, "raised the soft descriptor limit to the hard one");
                    soft = hard;
                }
                Err(errno) => tracing::warn!(soft, hard, "raising the soft descriptor limit to the hard one: {errno}"),
            }
        }
        if soft == RLIM_INFINITY {
            return Ok(self.clients_max);
        }
        // Counted, not assumed: a library caller's own descriptors count too. /proc unreadable:
        // none counted (the margin in `DESCRIPTORS_OWN` remains).
        let open = std::fs::read_dir("/proc/self/fd").map_or(0, |entries| entries.count() as u64);
        let fits = |clients: usize| open.saturating_add(self.descriptors_needed_for(clients, devices)) <= soft;
        let needed = self.descriptors_needed(devices);
        if fits(self.clients_max) {
            return Ok(self.clients_max);
        }
        // The count grows with the clients: the most that fit, by bisection (0 when none).
        let (mut low, mut high) = (0, self.clients_max);
        while low < high {
            let middle = low + (high - low).div_ceil(2);
            if fits(middle) {
                low = middle;
            } else {
                high = middle - 1;
            }
        }
        let refusal = |what: &str| {
            DaemonError::Config(format!(
                "clients_max {} may need {needed} descriptors at worst on {devices} pool device(s) ({} registrations per \
                 session), and {open} are open already: over this process's limit of {soft} (hard limit {hard}){what}; \
                 lower clients_max or raise the hard limit (ulimit -Hn, systemd's LimitNOFILE=)",
                self.clients_max, self.session_limits.registrations_max
            ))
        };
        if low == 0 {
            return Err(refusal(", and not even one client fits"));
        }
        if self.clients_max_explicit {
            return Err(refusal(&format!(" ({low} clients would fit)")));
        }
        tracing::warn!(
            clients_max = self.clients_max,
            serving = low,
            needed,
            open,
            limit = soft,
            hard,
            "clients_max {} may need {needed} descriptors at worst on {devices} pool device(s), and {open} are open: over \
             this process's limit of {soft}; serving {low} clients at once instead (more are answered Busy); raise the \
             hard limit (ulimit -Hn, systemd's LimitNOFILE=) or lower clients_max",
            self.clients_max
        );
        Ok(low)
    }

    /// Refuses a cluster manifest (or its `.new` or `.lock`) at a pool device's file: the
    /// manifest's rewrite renames a file over it, and the lock file is written, so the pool
    /// would run on an unlinked inode (its data gone at the next start) or be overwritten.
    /// A device image missing or empty at start reads as no manifest, and is refused only here.
    fn check_manifest_apart(&self, manifest: &std::path::Path) -> Result<(), DaemonError> {
        let with = |suffix: &str| {
            let mut path = manifest.as_os_str().to_owned();
            path.push(suffix);
            PathBuf::from(path)
        };
        let manifest_files = [manifest.to_path_buf(), with(".new"), with(".lock")];
        for device in &self.pool_devices {
            let (tutti_devices::DeviceSpec::EmuFile(file) | tutti_devices::DeviceSpec::Uring(file)) = device else { continue };
            if let Some(clash) = manifest_files.iter().find(|path| same_file(path, file)) {
                return Err(DaemonError::Config(format!(
                    "--cluster-state {}: {} (the segment manifest, its temporary or its lock file) is the file of the pool device \
                     {device}, which the manifest's rewrite would replace: give the manifest a path of its own",
                    manifest.display(),
                    clash.display()
                )));
            }
        }
        Ok(())
    }

    /// Defaults: lease 10 s, frame timeout 2 s, 64 clients, only this process's user, 50 ms tick.
    pub fn new(socket: PathBuf) -> ServerConfig {
        ServerConfig {
            socket,
            lease: Duration::from_secs(10),
            frame_timeout: Duration::from_secs(2),
            clients_max: Self::CLIENTS_MAX_DEFAULT,
            clients_max_explicit: false,
            allowed_uids: vec![nix::unistd::geteuid().as_raw()],
            tick: Duration::from_millis(50),
            metrics: None,
            session_limits: SessionLimits::default(),
            device_memory: DeviceMemoryImport::Off,
            cluster: None,
            pool_devices: Vec::new(),
        }
    }
}

/// Whether `a` and `b` name one file: by device and inode when both exist (following links, as
/// opening a device does), else by canonical directory and file name (either may not be made
/// yet: `--emu-create-bytes` creates the image, the first rewrite the manifest). A path whose
/// directory cannot be resolved names no file here (its open or lock fails on its own).
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    if let (Ok(a), Ok(b)) = (std::fs::metadata(a), std::fs::metadata(b)) {
        return (a.dev(), a.ino()) == (b.dev(), b.ino());
    }
    let resolved = |path: &std::path::Path| {
        let name = path.file_name()?;
        let directory = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => std::path::Path::new("."),
        };
        Some(std::fs::canonicalize(directory).ok()?.join(name))
    };
    matches!((resolved(a), resolved(b)), (Some(a), Some(b)) if a == b)
}

/// A later thread failed to start: stops and joins the ones already started, so that none
/// outlives a failed `serve` (the registrar leaves the cluster on its way out).
fn stop_started<const N: usize>(shared: &Shared, threads: [Option<JoinHandle<()>>; N]) {
    shared.stop.stop();
    // No connection thread was started: the registrar need not wait for one.
    if let Some(cluster) = &shared.cluster {
        cluster.connections_ended();
    }
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
    /// Requests prepared and not committed or released. Once the session ended (retiring or
    /// kept for good) its count as it ended: reservations it still holds though its connection
    /// no longer counts, which a first registration is admitted against
    /// (`connection::reservations_refusal`).
    requests_in_flight: u32,
    /// The relay's counters of the session's relayed pairs (set when it attaches queues).
    relay: Vec<Arc<PairCounters>>,
    /// The session ended while its client may still ring its queues: its holdings are kept
    /// until the client's process exits (`Connection::await_peer_exit`).
    awaiting_exit: bool,
    /// The session ended and the deletion of its queue pairs is not confirmed yet (retried every
    /// tick: [`retry_retiring`]); listed until it is (`ClientStatus::retiring`). Not awaiting
    /// its client's exit any more: that wait ended before the release.
    retiring: bool,
    /// The session ended with queue pairs that could not be deleted: everything it held is
    /// kept for good, and so is this record (its client must never free what the pairs may
    /// still write). Bounded: the table holds at most `STATUS_CLIENTS_MAX` records (`Hello`).
    kept: bool,
    /// The session was promised its share of the request reservations (`--requests-per-session`)
    /// at its first registration (`connection::reservations_refusal`): only a session with a
    /// registration can prepare, so one that only looks up (an engine's scheduler) holds none.
    promised: bool,
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
    /// The socket file this daemon bound, held: the drain removes the path only while it still
    /// names this file ([`remove_bound_socket`]).
    socket_file: SocketFile,
    store: Mutex<StoreState>,
    /// Held by an attach from its admission to its count (`Holdings::attach`), across its
    /// admin commands, so that the pool lock need not be.
    attaching: Mutex<()>,
    devices: Vec<DeviceStatus>,
    report: objstore::RecoveryReport,
    locks: Mutex<Option<DeviceLocks>>,
    shape: PoolShape,
    pool_shape: objstore::PoolShape,
    /// Bytes of one engine block (all layers, K and V).
    block_bytes: u64,
    /// The pool's key secret (`Pool::key_secret`), copied at start so that a `Hello` keys its
    /// session's space without the pool lock. Never printed (its `Debug` is redacted).
    key_secret: objstore::hash::KeySecret,
    /// The controllers' admin timeout (`OpenedPool::admin_timeout`), handed back with the pool.
    admin_timeout: Duration,
    next_registration: AtomicU64,
    device_memory: DeviceMemoryService,
    leaks: LeakCounters,
    sessions: Mutex<BTreeMap<u64, SessionRecord>>,
    /// Ended sessions whose queue pairs' deletion is to be retried, by session (at most one
    /// entry per session that ever attached; each holds its pairs' queue ids, so attaches,
    /// counted against those, bound how many there can be).
    retiring: Mutex<Vec<(u64, Retiring)>>,
    connections: AtomicU32,
    next_session: AtomicU64,
    stop: StopHandle,
    started: Instant,
    metrics: Metrics,
    /// The daemon as a cluster node (`ServerConfig::cluster`).
    cluster: Option<ClusterAgent>,
}

/// What `serve` hands back after a drain: the pool, for the caller to close. The requests of
/// sessions kept for good are still reserved in it (their slots Writing or pinned), since their
/// queue pairs may still write those slots.
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
    /// Binds the socket (owner-only) for `opened`: [`Server::prepare`], then
    /// [`Server::bind_prepared`]. A socket file left by a dead daemon is replaced; one a live
    /// daemon answers on is [`DaemonError::SocketInUse`]; any other file there is left alone and
    /// refused.
    /// The descriptor limit is checked on `opened`'s devices when `pool_devices` is empty.
    pub fn bind(config: ServerConfig, opened: OpenedPool) -> Result<Server, DaemonError> {
        let devices = if config.pool_devices.is_empty() { opened.devices.len() } else { config.pool_devices.len() };
        let prepared = Server::prepare_on(&config, devices.max(1))?;
        Server::bind_prepared(config, prepared, opened)
    }

    /// What can refuse a start without the pool, done before it is opened (or formatted): the
    /// configuration's checks, the descriptor limit (the soft one raised to the hard one first:
    /// [`ServerConfig::check_descriptor_limit`]), the socket path (a live daemon's socket, a file that is not a
    /// socket, a missing directory, a path too long; a stale socket is left for
    /// [`Server::bind_prepared`] to remove once the pool's device locks are held: a socket that
    /// refuses may be a draining daemon's, whose clients read its file gone as their sessions
    /// ended, and a start that then fails on that daemon's device locks must not have removed
    /// it), the metrics
    /// endpoint's address (bound here and kept), the device memory import and a cluster node's
    /// part that needs no pool (`ClusterAgent::prepare`: its manifest locked and read, its
    /// data address bound and kept). A refusal here leaves the devices untouched.
    /// The clients served may be fewer than `clients_max` (see there).
    pub fn prepare(config: &ServerConfig) -> Result<Prepared, DaemonError> {
        Server::prepare_on(config, config.pool_devices.len().max(1))
    }

    /// [`Server::prepare`], the descriptor limit checked on a pool of `devices`.
    fn prepare_on(config: &ServerConfig, devices: usize) -> Result<Prepared, DaemonError> {
        config.validate()?;
        let clients_max = config.check_descriptor_limit_on(devices)?;
        probe_socket(&config.socket, StaleSocket::Keep)?;
        let metrics_endpoint = config.metrics.map(MetricsEndpoint::bind).transpose()?;
        let device_memory = DeviceMemoryService::new(config.device_memory).map_err(DaemonError::DeviceMemory)?;
        let cluster = config.cluster.as_ref().map(ClusterAgent::prepare).transpose()?;
        Ok(Prepared { metrics_endpoint, device_memory, cluster, clients_max })
    }

    /// Binds the socket for `opened` with what [`Server::prepare`] made of the same `config`.
    /// The socket path is probed again (a daemon may have started on it since); a refusal after
    /// the socket is bound (the store's control half, the cluster part's staging area or
    /// manifest rewrite) removes it again.
    pub fn bind_prepared(mut config: ServerConfig, prepared: Prepared, opened: OpenedPool) -> Result<Server, DaemonError> {
        // The clients the descriptor limit allows (`check_descriptor_limit`), fewer only by it.
        config.clients_max = config.clients_max.min(prepared.clients_max);
        config.validate()?;
        let socket = &config.socket;
        let io = |context: String| move |source| DaemonError::Io { context, source };
        probe_socket(socket, StaleSocket::Remove)?;
        let listener = UnixListener::bind(socket).map_err(io(format!("binding {}", socket.display())))?;
        let mut socket_file = match SocketFile::hold(socket) {
            Ok(held) => held,
            Err(source) => {
                // Bound a moment ago and not held: removed by its path.
                drop(listener);
                if let Err(error) = std::fs::remove_file(socket) {
                    tracing::warn!("removing {}: {error}", socket.display());
                }
                return Err(DaemonError::Io { context: format!("holding the bound {}", socket.display()), source });
            }
        };
        // Until the server is built, a refusal drops `socket_file`, which removes the socket.
        socket_file.remove_on_drop = true;
        // Owner-only. Between bind and chmod the socket has the umask's mode; the peer
        // credential check below refuses other users in that window too.
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
            .map_err(io(format!("making {} owner-only", socket.display())))?;
        listener.set_nonblocking(true).map_err(io("making the listener non-blocking".into()))?;
        let Prepared { metrics_endpoint, device_memory, cluster: cluster_prepared, clients_max: _ } = prepared;
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
        let OpenedPool { pool, devices, report, emulators, admin_timeout, locks } = opened;
        let key_secret = *pool.key_secret();
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
        let cluster = match (config.cluster.clone(), cluster_prepared) {
            (Some(settings), Some(cluster_prepared)) => {
                let cluster_metrics = crate::cluster::ClusterMetrics::default();
                metrics.register_cluster(&cluster_metrics);
                Some(ClusterAgent::start(settings, cluster_prepared, &mut control, block_bytes, requests_max, cluster_metrics)?)
            }
            (None, _) => None,
            (Some(_), None) => {
                return Err(DaemonError::Config(
                    "cluster settings that Server::prepare was not given: prepare with the same configuration".into(),
                ))
            }
        };
        let relay = DoorbellRelay::start(RelayConfig::default())?;
        // Built: from here the drain removes the socket (`remove_bound_socket`).
        socket_file.remove_on_drop = false;
        let shared = Arc::new(Shared {
            config,
            socket_file,
            store: Mutex::new(StoreState { control, emulators, relay }),
            attaching: Mutex::new(()),
            devices,
            report,
            locks: Mutex::new(Some(locks)),
            shape,
            pool_shape,
            block_bytes,
            key_secret,
            admin_timeout,
            next_registration: AtomicU64::new(1),
            device_memory,
            leaks: LeakCounters::default(),
            sessions: Mutex::new(BTreeMap::new()),
            retiring: Mutex::new(Vec::new()),
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
    /// socket (left in place when a session is kept for good) and hands the pool back.
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
        // Ended sessions' deletions, retried every tick on a thread of their own: a retry may
        // wait out admin timeouts (up to two per pair, 10 s each, and first for the admin queue
        // another session's attach or release holds), which must hold off neither accepts,
        // status queries nor the stop.
        let retiring_thread = {
            let retiring_shared = Arc::clone(&shared);
            let spawned = std::thread::Builder::new().name("tuttid-retiring".into()).spawn(move || {
                while !retiring_shared.stop.is_stopped() {
                    std::thread::sleep(retiring_shared.config.tick);
                    retry_retiring(&retiring_shared, None);
                }
            });
            match spawned {
                Ok(thread) => thread,
                Err(source) => {
                    stop_started(&shared, [metrics_thread, registrar_thread, data_plane_thread]);
                    return Err(DaemonError::Io { context: "starting the retiring thread".into(), source });
                }
            }
        };
        // Connection threads, each marked whether it is the one status-only connection.
        let mut workers: Vec<(JoinHandle<()>, bool)> = Vec::new();
        let mut connections_served = 0u64;
        let tick_ms = u16::try_from(shared.config.tick.as_millis()).unwrap_or(u16::MAX);
        // A listener that cannot be polled ends serving as a stop does, through the drain
        // below: the registrar leaves the cluster (revoking its lease, so this node's segments
        // vanish now, not a TTL later), every thread is joined, the socket removed; then the
        // error is returned instead of the report.
        let mut failure: Option<DaemonError> = None;
        while !shared.stop.is_stopped() {
            let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::from(tick_ms)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(errno) => {
                    tracing::error!("polling the listener failed: {errno}; stopping");
                    shared.stop.stop();
                    failure = Some(DaemonError::Io { context: "polling the listener".into(), source: std::io::Error::from(errno) });
                    break;
                }
            }
            // Accept what is pending, at most ACCEPTS_PER_PASS_MAX and none once stopping: each
            // accepted connection either gets a thread, up to clients_max plus one status-only
            // connection, or a Busy answer and is closed. The status-only one takes only Status
            // and ClusterStatus, so that `tuttid --status` works while every other connection
            // is taken.
            for _ in 0..ACCEPTS_PER_PASS_MAX {
                if shared.stop.is_stopped() {
                    break;
                }
                match listener.accept() {
                    Ok((stream, _)) => {
                        connections_served += 1;
                        workers.retain(|(worker, _)| !worker.is_finished());
                        let status_only = workers.iter().filter(|(_, status_only)| !status_only).count() >= shared.config.clients_max;
                        if status_only && workers.iter().any(|(_, status_only)| *status_only) {
                            refuse(stream, &shared.config, ErrorCode::Busy, "tuttid serves its maximum number of connections; retry later");
                            continue;
                        }
                        shared.connections.fetch_add(1, Ordering::AcqRel);
                        let connection_shared = Arc::clone(&shared);
                        let spawned = std::thread::Builder::new()
                            .name("tuttid-client".into())
                            .spawn(move || serve_connection(stream, &connection_shared, status_only));
                        match spawned {
                            Ok(worker) => workers.push((worker, status_only)),
                            Err(error) => {
                                shared.connections.fetch_sub(1, Ordering::AcqRel);
                                tracing::error!("cannot start a connection thread: {error}");
                            }
                        }
                    }
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(error) => {
                        // ECONNABORTED (that connection is lost), EMFILE (it stays in the
                        // backlog until a descriptor comes free; `Server::prepare` lowers or
                        // refuses a `clients_max` whose worst case passes the limit, so mostly
                        // what it leaves out, sessions kept for good or retiring, gets here): the
                        // server goes on.
                        // The listener stays readable while descriptors run out, so the next
                        // poll would return at once: wait a tick rather than spin (and log).
                        tracing::warn!("accept failed: {error}");
                        std::thread::sleep(shared.config.tick);
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
        // The data plane closes its listener within a tick of the stop; its peer threads then
        // meet the drain: each ends within the layer it has in flight (up to 10 s) or the
        // block it is sending (up to 2 × the 2 s stall bound), then a `Failure` frame (up to
        // 2 × the stall bound), on a healthy device; after a layer that timed out, the staging
        // area's queue pairs are deleted first (admin timeouts). docs/cluster.md, "Remote reads".
        if data_plane_thread.is_some_and(|thread| thread.join().is_err()) {
            tracing::error!("the data plane panicked");
        }
        for (worker, _) in workers {
            // A connection thread ends within a tick plus one request plus a frame timeout.
            if worker.join().is_err() {
                tracing::error!("a connection thread panicked");
            }
        }
        // After the connection threads: their last commits reach the registrar's queue, which
        // it journals (locally) once told no more come. It saw the stop within a tick plus the
        // registry call in progress (T the request timeout: a join up to 4 T + 1 s, a rejoin up
        // to 6 T) and left the cluster at once (T + 1 s, up to 3 T + 1 s after rejoins whose
        // revokes failed; docs/cluster.md gives each call's bound), before that journalling, so
        // the node is not listed while its data plane no longer serves.
        if let Some(cluster) = &shared.cluster {
            cluster.connections_ended();
        }
        if registrar_thread.is_some_and(|thread| thread.join().is_err()) {
            tracing::error!("the cluster registrar panicked");
        }
        // The retiring thread sees the stop within a tick plus the retry in progress.
        if retiring_thread.join().is_err() {
            tracing::error!("the retiring thread panicked");
        }
        // Every session has ended: deletions still unconfirmed are retried until the deadline
        // (a late completion settles them), then kept for good; nothing they may write is freed.
        let deadline = Instant::now() + drain_retire_window(shared.admin_timeout);
        while !lock(&shared.retiring).is_empty() && Instant::now() < deadline {
            std::thread::sleep(shared.config.tick);
            retry_retiring(&shared, Some(deadline));
        }
        for (session, retiring) in std::mem::take(&mut *lock(&shared.retiring)) {
            let kept =
                retiring.keep_for_good(&shared.leaks, "the daemon stopped before the deletion of a session's queue pairs was confirmed");
            tracing::error!(session, kept, "the daemon stopped before a session's queue pairs were known deleted: kept for good");
            mark_kept(&shared, session);
        }
        // A client reads its daemon's socket gone as its session gone (and may free its memory
        // then: the Python module's device memory). A session kept for good must never read so:
        // its pairs may still write that memory. The file is left then (the next daemon's bind
        // removes it as stale; a connection to it is refused meanwhile, which tells nothing).
        let kept = lock(&shared.sessions).values().filter(|record| record.kept).count();
        if kept > 0 {
            tracing::error!(
                kept,
                socket = %shared.config.socket.display(),
                "sessions are kept for good (queue pairs not known deleted): the socket file is left in place, so that \
                 their clients never read them as ended"
            );
        } else {
            remove_bound_socket(&shared.config.socket, &shared.socket_file);
        }
        if let Some(error) = failure {
            return Err(error);
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
        // Unreleased: every session not kept for good released its reservations as it ended
        // (the data plane's too), so those still live are kept ones', whose queue pairs may
        // still write their slots: released here, a caller serving this pool again would give
        // those slots to new stores.
        let opened = OpenedPool {
            pool: control.into_pool_unreleased(),
            devices: shared.devices,
            report: shared.report,
            emulators,
            admin_timeout: shared.admin_timeout,
            locks,
        };
        Ok(ServeReport { opened, connections_served })
    }
}

/// What [`Server::prepare`] makes before the pool is opened, for [`Server::bind_prepared`].
pub struct Prepared {
    metrics_endpoint: Option<MetricsEndpoint>,
    device_memory: DeviceMemoryService,
    cluster: Option<ClusterPrepared>,
    /// The clients the descriptor limit allows ([`ServerConfig::check_descriptor_limit`]).
    clients_max: usize,
}

/// What [`probe_socket`] does with a socket file nobody listens on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum StaleSocket {
    /// Removed: the caller binds next.
    Remove,
    /// Left in place (the caller binds later, if at all).
    Keep,
}

/// Checks that a daemon can bind `socket`: a socket file nobody listens on (its connections
/// refused) is stale, removed if `stale` says so; a live daemon's is
/// [`DaemonError::SocketInUse`]; any other file, a path too long for a socket address and a
/// missing directory are refused.
fn probe_socket(socket: &std::path::Path, stale: StaleSocket) -> Result<(), DaemonError> {
    let io = |context: String| move |source| DaemonError::Io { context, source };
    match std::fs::symlink_metadata(socket) {
        Ok(metadata) if metadata.file_type().is_socket() => {
            // Bounded: a live daemon that does not accept (stopped with SIGSTOP, its backlog
            // full) would hold a plain connect here for as long as it is stopped. One whose
            // backlog stays full is live, not stale: its socket is left alone.
            // Only a refusal says nobody listens: any other failure (EACCES from another
            // user's daemon, EMFILE here) says nothing about the socket, which is left alone.
            match crate::client::connect_within(socket, SOCKET_PROBE_TIMEOUT) {
                Ok(_) | Err(DaemonError::Timeout { .. }) => return Err(DaemonError::SocketInUse { socket: socket.to_path_buf() }),
                Err(DaemonError::Io { source, .. }) if source.kind() == std::io::ErrorKind::ConnectionRefused => {
                    if stale == StaleSocket::Remove {
                        std::fs::remove_file(socket).map_err(io(format!("removing the stale socket {}", socket.display())))?;
                    }
                }
                // Gone meanwhile: nothing to remove.
                Err(DaemonError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => {
                    return Err(DaemonError::Io {
                        context: format!(
                            "{} exists and cannot be probed for a live daemon ({error}); remove it if no daemon serves it",
                            socket.display()
                        ),
                        source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
                    })
                }
            }
        }
        Ok(_) => {
            return Err(DaemonError::Io {
                context: format!("{} exists and is not a socket", socket.display()),
                source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
            })
        }
        Err(_) => {}
    }
    std::os::unix::net::SocketAddr::from_pathname(socket).map_err(io(format!("{} as a socket address", socket.display())))?;
    let directory = match socket.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => std::path::Path::new("."),
    };
    match std::fs::metadata(directory) {
        Ok(metadata) if metadata.is_dir() => Ok(()),
        Ok(_) => Err(DaemonError::Io {
            context: format!("{}: {} is not a directory", socket.display(), directory.display()),
            source: std::io::Error::from(std::io::ErrorKind::NotADirectory),
        }),
        Err(source) => Err(DaemonError::Io { context: format!("{}: its directory {}", socket.display(), directory.display()), source }),
    }
}

/// The socket file a daemon bound: its device and inode, and an `O_PATH` descriptor of it held
/// for as long as this lives, so that the inode number cannot be given to another file meanwhile
/// (ext4 gives an unlinked socket's number to the next file made in that directory at once,
/// so the number alone would take another daemon's socket for this one's).
#[derive(Debug)]
struct SocketFile {
    path: PathBuf,
    _held: std::fs::File,
    device: u64,
    inode: u64,
    /// Removes the socket when this is dropped: set while a refused bind may still drop it.
    remove_on_drop: bool,
}

impl SocketFile {
    fn hold(path: &std::path::Path) -> std::io::Result<SocketFile> {
        let held = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags((nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_NOFOLLOW).bits())
            .open(path)?;
        let metadata = held.metadata()?;
        Ok(SocketFile { path: path.to_path_buf(), device: metadata.dev(), inode: metadata.ino(), _held: held, remove_on_drop: false })
    }

    /// Whether `path` names this file now.
    fn is_at(&self, path: &std::path::Path) -> std::io::Result<bool> {
        let metadata = std::fs::symlink_metadata(path)?;
        Ok((metadata.dev(), metadata.ino()) == (self.device, self.inode))
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if self.remove_on_drop {
            remove_bound_socket(&self.path, self);
        }
    }
}

/// Removes the socket at `path` if it is still the file this daemon bound (`bound`). Once the
/// listener is closed (the drain), another daemon may find the file refusing, remove it as
/// stale and bind its own there: that one is left alone. (A replacement between the check and
/// the unlink is not ruled out; the window is a system call wide, against a drain that may last
/// seconds.)
fn remove_bound_socket(path: &std::path::Path, bound: &SocketFile) {
    match bound.is_at(path) {
        Ok(true) => {
            if let Err(error) = std::fs::remove_file(path) {
                tracing::warn!("removing {}: {error}", path.display());
            }
        }
        Ok(false) => tracing::warn!(
            "{} is not the socket this daemon bound any more (another daemon bound it meanwhile): left in place",
            path.display()
        ),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => tracing::warn!("{}: {error}; not removed", path.display()),
    }
}

/// How long the drain retries unconfirmed deletions at most: two admin timeouts (a Delete that
/// timed out completes within about one more, or is not coming; its retry may wait out another)
/// and a second: 21 s with the default 10 s timeout. Checked between sessions' retries, so the
/// drain may run past it by the retry in progress: about one admin timeout per pool device (once
/// a Delete times out, its admin queue refuses the next at once while the late one is out).
fn drain_retire_window(admin_timeout: Duration) -> Duration {
    admin_timeout.saturating_mul(2).saturating_add(Duration::from_secs(1))
}

/// How long the retiring thread retries a session's unconfirmed deletions while serving before
/// keeping it for good: eight admin timeouts per pair unconfirmed when it ended (`pairs`, at
/// least one), and a second (81 s with the default 10 s timeout and one pair, 161 s with two).
/// A pair's deletion is two commands (Delete I/O SQ, then CQ); each may time out and complete up
/// to about one more admin timeout late, its retry then answered at once (deleted, or Invalid
/// Queue Identifier): four admin timeouts; doubled, which covers a retry that waits out a
/// timeout of its own (six) and a slow controller. A retry deletes the session's pairs one after
/// another (one per pool device), so with every controller late each of its steps waits once per
/// pair. Past that, a Delete that never completes (the admin queue answering QueueBusy every
/// tick) would otherwise keep the session retiring, and every session short of its
/// reservations `Busy`, for the daemon's life. Longer than the drain's window
/// ([`drain_retire_window`]), which trades waiting for a stop.
fn serving_retire_bound(admin_timeout: Duration, pairs: usize) -> Duration {
    let pairs = u32::try_from(pairs.max(1)).unwrap_or(u32::MAX);
    admin_timeout.saturating_mul(8).saturating_mul(pairs).saturating_add(Duration::from_secs(1))
}

/// Retries the deletions of ended sessions' queue pairs (`Shared::retiring`) once each (on the
/// retiring thread while serving, then on the drain's): a
/// session whose deletion is confirmed gives everything back and leaves the status table; one
/// whose deletion failed for good keeps everything (counted as leaks), and so does, while
/// serving, one whose deletion stayed unconfirmed past [`serving_retire_bound`] since it ended. Bounded: each retry is
/// at most two admin commands per pair, each bounded by the admin timeout, and a busy admin
/// queue refuses at once. The list is taken out while retrying, so a session ending meanwhile
/// does not wait for it. Past `deadline` (the drain's), the sessions not retried yet are left
/// pending untried.
fn retry_retiring(shared: &Shared, deadline: Option<Instant>) {
    let retiring = std::mem::take(&mut *lock(&shared.retiring));
    if retiring.is_empty() {
        return;
    }
    let mut pending = Vec::new();
    for (session, mut entry) in retiring {
        if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            pending.push((session, entry));
            continue;
        }
        // A panic in one retry ends neither the thread (every later session would never be
        // retried) nor the other entries of this pass: its entry is kept for good.
        let retried = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            #[cfg(test)]
            if lock(&shared.sessions).get(&session).is_some_and(|record| record.name == tests::PANICS_RETRYING) {
                panic!("test: a retry that panics");
            }
            entry.retry(&shared.store, &shared.leaks)
        }));
        let Ok(retried) = retried else {
            let leaked = entry.keep_for_good(&shared.leaks, "retrying the deletion of a session's queue pairs panicked");
            tracing::error!(session, leaked, "retrying an ended session's queue-pair deletion panicked: its memory is kept for good");
            mark_kept(shared, session);
            continue;
        };
        match retried {
            // Serving, a deletion unconfirmed past its bound is not coming: kept for good, so that what it holds is counted as held for the daemon's life and a session
            // short of it is told so (`LimitReached`), not `Busy` for as long as the daemon runs.
            Retried::Pending
                if deadline.is_none() && entry.retiring_for() >= serving_retire_bound(shared.admin_timeout, entry.pairs_when_ended()) =>
            {
                let waited = entry.retiring_for();
                let leaked =
                    entry.keep_for_good(&shared.leaks, "the deletion of a session's queue pairs stayed unconfirmed past its bound");
                tracing::error!(
                    session,
                    leaked,
                    waited_ms = waited.as_millis() as u64,
                    "an ended session's queue-pair deletion stayed unconfirmed past eight admin timeouts per pair and a second: its memory is kept for good"
                );
                mark_kept(shared, session);
            }
            Retried::Pending => pending.push((session, entry)),
            Retried::Done => {
                tracing::info!(session, "an ended session's queue pairs are deleted: its windows and reservations are given back");
                lock(&shared.sessions).remove(&session);
            }
            Retried::Kept(leaked) => {
                tracing::error!(session, leaked, "session ended with queue pairs that could not be deleted: their memory is kept");
                mark_kept(shared, session);
            }
        }
    }
    lock(&shared.retiring).extend(pending);
}

/// Marks `session`'s record kept for good (listed for good, `ClientStatus::kept`).
fn mark_kept(shared: &Shared, session: u64) {
    if let Some(record) = lock(&shared.sessions).get_mut(&session) {
        record.kept = true;
        record.retiring = false;
        record.awaiting_exit = false;
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

/// What a scrape reads from the daemon's state.
fn metrics_snapshot(shared: &Shared) -> Snapshot {
    let (pool, relay, fenced) = {
        let store = lock(&shared.store);
        (store.control.counts(), store.relay.counts(), metadata_fenced(&store))
    };
    let devices_fenced = shared.devices.iter().zip(fenced).map(|(device, fenced)| (device.spec.clone(), fenced)).collect();
    let (clients, client_relay, sessions_awaiting_exit) = {
        let sessions = lock(&shared.sessions);
        let relayed = sessions.iter().filter(|(_, record)| !record.relay.is_empty());
        let client_relay = relayed
            .map(|(&session, record)| {
                let (forwarded, dropped) = record.relay_counts();
                ClientRelay { session, name: record.name.clone(), forwarded, dropped }
            })
            .collect();
        let awaiting_exit = sessions.values().filter(|record| record.awaiting_exit).count() as u64;
        (sessions.len() as u64, client_relay, awaiting_exit)
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
        sessions_awaiting_exit,
        relay,
        client_relay,
        devices_fenced,
    }
}

/// Per pool device, in order: whether the pool fenced its metadata (`Pool::metadata_fenced`;
/// `StatusReply::metadata_fenced`).
fn metadata_fenced(store: &StoreState) -> Vec<bool> {
    let pool = store.control.pool();
    (0..pool.device_count()).map(|device| pool.metadata_fenced(device)).collect()
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
            awaiting_exit: record.awaiting_exit,
            kept: record.kept,
            retiring: record.retiring,
        })
        .collect();
    let (devices, metadata_fenced, pool, relay) = {
        let store = lock(&shared.store);
        let mut devices = shared.devices.clone();
        for (device, emulator) in devices.iter_mut().zip(&store.emulators) {
            // Lock-free: `stats()` would wait, under the store lock, for the controller's poll in
            // progress (a Flush's transfer wait on a stalled store: up to 30 s).
            device.refused_commands = emulator.as_ref().map_or(0, |emulator| emulator.restriction_refusals());
        }
        (devices, metadata_fenced(&store), store.control.counts(), store.relay.counts())
    };
    let leaks = &shared.leaks;
    StatusReply {
        daemon_pid: std::process::id(),
        uptime_ms: shared.started.elapsed().as_millis() as u64,
        shape: shared.shape,
        devices,
        metadata_fenced,
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

#[cfg(test)]
mod tests;
