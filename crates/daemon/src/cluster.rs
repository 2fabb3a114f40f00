//! tuttid as a node of a cluster (docs/cluster.md, "tuttid in a cluster"): it joins the
//! registry at start (its member record: data address, capacity, the model fingerprints it holds
//! segments of), registers the segments each commit completes, unregisters those an eviction
//! breaks, and leaves on SIGTERM.
//!
//! **The registry never holds local work up.** A commit hands its block keys to a bounded queue
//! (`ClusterAgent::committed`, after the commit is durable) and returns; one thread, the
//! registrar (`registrar.rs`), does everything that talks to etcd. When etcd is slow or away the
//! queue fills and further commits are dropped from registration (counted), segments wait to be
//! registered (retried with a bounded backoff), and clients are served from the local pool as
//! ever.
//!
//! - `held.rs`: the segments this node holds whole, by segment and by block;
//! - `manifest.rs`: that list journalled to a file, so a restarted node registers what survived;
//! - `registrar.rs`: the thread: local bookkeeping under the pool lock, then etcd without it;
//! - `lookup.rs`: `LookupCluster`, the local prefix and then one registry round trip;
//! - `data_plane.rs` (+ `peer.rs`, the wire format, `staging.rs`, the daemon's own data half):
//!   remote reads, a holder serving its segments over TCP and an asker storing them locally;
//! - `heavy_hitters.rs`: a holder's bounded count of reads served per segment; an asker
//!   registers its copy of a segment served more than `replicate_after` times (a second replica);
//! - `fetched.rs`: the copies an asker did not register, which a later commit of a longer prompt
//!   must not register either.
//!
//! These three need the crate's `cluster` feature (etcd's client); without it
//! `ClusterAgent::start` refuses cluster settings with the reason.

#[cfg(feature = "cluster")]
mod data_plane;

/// Store requests a cluster node's data plane may hold at once, beyond its clients' own: one
/// read per peer connection served, and one store per client's `FetchRemote` in progress.
pub(crate) fn data_plane_requests_max(clients_max: usize) -> usize {
    #[cfg(feature = "cluster")]
    {
        data_plane::PEERS_MAX.saturating_add(clients_max)
    }
    #[cfg(not(feature = "cluster"))]
    {
        let _ = clients_max;
        0
    }
}
#[cfg(feature = "cluster")]
mod fetched;
#[cfg(feature = "cluster")]
mod heavy_hitters;
#[cfg(feature = "cluster")]
mod held;
#[cfg(feature = "cluster")]
mod lookup;
#[cfg(feature = "cluster")]
pub(crate) mod manifest;
/// The data plane's wire format. Built with or without the `cluster` feature (it needs no
/// etcd) and public, so its decoders of untrusted peer bytes are property-tested in every
/// `cargo test` and fuzzed (`fuzz/fuzz_targets/data_plane_frames.rs`).
pub mod peer;
#[cfg(feature = "cluster")]
mod registrar;
#[cfg(feature = "cluster")]
mod staging;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use objstore::StoreControl;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tutti_cluster::{ClusterConfig, ModelSpace, NodeId};

use crate::protocol::ClusterStatusReply;
use crate::DaemonError;

#[cfg(feature = "cluster")]
pub(crate) use registrar::Registrar;

/// Without the `cluster` feature there is no registrar (`ClusterAgent::start` refuses), so no
/// value of this type exists.
#[cfg(not(feature = "cluster"))]
pub(crate) enum Registrar {}

#[cfg(not(feature = "cluster"))]
impl Registrar {
    pub(crate) fn run(self, _store: &Mutex<crate::session::StoreState>, _stop: &crate::server::StopHandle, _tick: std::time::Duration) {
        match self {}
    }
}

/// Committed requests the registrar may be behind by; more are dropped from registration.
pub const COMMITS_QUEUED_MAX: usize = 1024;
/// A fetched segment is registered as a second replica once its holder has served it more than
/// this many times (default of `--cluster-replicate-after`).
pub const REPLICATE_AFTER_DEFAULT: u32 = 2;
/// Holders one `FetchRemote` asks at most, over all the runs it reads (a run over several
/// holders is read one holder's run at a time), each passed over only when it could not serve
/// before a block was stored (unreachable, not holding, busy, failing to read it): past a few,
/// the registry is listing dead nodes and the client is better off recomputing than waiting on
/// more connects.
#[cfg(feature = "cluster")]
const FETCH_HOLDERS_MAX: usize = 4;
/// The longest a `LookupCluster` waits for the registry by default.
pub const LOOKUP_TIMEOUT_DEFAULT: std::time::Duration = std::time::Duration::from_secs(1);
/// Most departed block keys kept between two registrar passes (50 ms apart): far more than any
/// pool evicts in that time; past it every held segment is checked instead.
#[cfg(feature = "cluster")]
const DEPARTURES_MAX: usize = 1 << 20;

/// How a daemon takes part in a cluster (`tuttid --cluster-etcd …`).
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    /// etcd endpoints, cluster id, segment size, timeouts, lease.
    pub registry: ClusterConfig,
    pub node: NodeId,
    /// Where this node's data plane listens (TCP), as other nodes reach it (its member record);
    /// port 0 picks a free port, and the record carries the one bound.
    pub data_address: SocketAddr,
    /// The segment manifest (`manifest.rs`): what this node holds, across restarts.
    pub manifest: PathBuf,
    /// Committed requests the registrar may be behind by (default [`COMMITS_QUEUED_MAX`]).
    pub commits_queued_max: usize,
    /// The longest a `LookupCluster` waits for the registry (default
    /// [`LOOKUP_TIMEOUT_DEFAULT`]; a client waits for it, so shorter than the registrar's).
    pub lookup_timeout: std::time::Duration,
    /// Heavy hitters: a segment fetched here whose holder has served it more than this many
    /// times is registered as this node's replica too (default [`REPLICATE_AFTER_DEFAULT`];
    /// 0: never).
    pub replicate_after: u32,
}

impl ClusterSettings {
    pub fn new(registry: ClusterConfig, node: NodeId, data_address: SocketAddr, manifest: PathBuf) -> ClusterSettings {
        ClusterSettings {
            registry,
            node,
            data_address,
            manifest,
            commits_queued_max: COMMITS_QUEUED_MAX,
            lookup_timeout: LOOKUP_TIMEOUT_DEFAULT,
            replicate_after: REPLICATE_AFTER_DEFAULT,
        }
    }
}

/// The cluster tier's metrics (`/metrics`, prefixed `tuttid_cluster_`), also read by the
/// `ClusterStatus` reply. Each is a shared atomic: the registrar and lookups update, scrapes read.
#[derive(Debug, Clone)]
pub struct ClusterMetrics {
    /// 1 while a member under a live lease.
    pub joined: Gauge,
    /// Joins and rejoins that succeeded (each a new lease).
    pub joins: Counter,
    /// Leases found lost (expired or revoked while the node lived).
    pub lease_losses: Counter,
    /// Segments held whole, and of them registered under the current lease.
    pub segments_held: Gauge,
    pub segments_registered: Gauge,
    /// Segment registrations written, and the etcd transactions that carried them.
    pub registered_segments: Counter,
    pub registration_transactions: Counter,
    /// Segments taken out of the registry (their blocks evicted).
    pub unregistered_segments: Counter,
    /// Failed registry calls (join, register, unregister, record update): retried later.
    pub registry_errors: Counter,
    /// Committed requests not handed to the registrar (its queue was full): their segments
    /// are not registered.
    pub commits_dropped: Counter,
    /// Manifest writes that failed (the manifest is then no longer written until restart).
    pub manifest_errors: Counter,
    /// `LookupCluster`: registry lookups sent, failed, not sent (the registry failed just
    /// before), blocks found held elsewhere past the local prefix, and each lookup's time.
    pub lookups: Counter,
    pub lookup_failures: Counter,
    pub lookups_skipped: Counter,
    pub remote_blocks_found: Counter,
    pub lookup_seconds: Histogram,
    /// Registry entries lookups met and refused, and segments whose holder range was cut
    /// short by them (holders past the limit unseen): either means the registry holds entries
    /// it should not (another segment size, a damaged writer).
    pub lookup_refused_entries: Counter,
    pub lookup_ranges_cut_short: Counter,
    /// `FetchRemote`: fetches that went to a holder, those of them that failed, and blocks
    /// stored here from other nodes. One the registry did not answer is neither (counted in
    /// `lookup_failures` or `lookups_skipped`), so failures never outnumber reads.
    pub remote_reads: Counter,
    pub remote_read_failures: Counter,
    pub fetched_blocks: Counter,
    /// Segments this node sent to others, and reads it refused (not held, a failed read, bad).
    pub served_segments: Counter,
    pub serve_refusals: Counter,
    /// Fetched segments handed to the registrar as second replicas (heavy hitters).
    pub replicated_segments: Counter,
    /// Fetched segments whose store reservation is kept for good (never released, never
    /// reused): the staging area was retired with a layer in flight and a queue pair's
    /// deletion failed, so a command may still move the slots; or the store's staging turn
    /// ended in a panic, which retires the area but cannot release the reservation. The server's `leaked_requests` does not see
    /// them (the data plane does not reach its counters): counted here, on `/metrics` only.
    pub kept_reservations: Counter,
    /// Members whose pools have another key secret than this node's, as compared at the last
    /// join (`Registrar::compare_key_secrets`): they share no segments with it. -1 while the
    /// members could not be listed.
    pub members_other_key_secret: Gauge,
}

impl Default for ClusterMetrics {
    fn default() -> Self {
        ClusterMetrics {
            joined: Gauge::default(),
            joins: Counter::default(),
            lease_losses: Counter::default(),
            segments_held: Gauge::default(),
            segments_registered: Gauge::default(),
            registered_segments: Counter::default(),
            registration_transactions: Counter::default(),
            unregistered_segments: Counter::default(),
            registry_errors: Counter::default(),
            commits_dropped: Counter::default(),
            manifest_errors: Counter::default(),
            lookups: Counter::default(),
            lookup_failures: Counter::default(),
            lookups_skipped: Counter::default(),
            remote_blocks_found: Counter::default(),
            // 16 µs to ~8 s in powers of two: a loopback lookup is ~0.5 ms, a timeout seconds.
            lookup_seconds: Histogram::new(exponential_buckets(16e-6, 2.0, 20)),
            lookup_refused_entries: Counter::default(),
            lookup_ranges_cut_short: Counter::default(),
            remote_reads: Counter::default(),
            remote_read_failures: Counter::default(),
            fetched_blocks: Counter::default(),
            served_segments: Counter::default(),
            serve_refusals: Counter::default(),
            replicated_segments: Counter::default(),
            kept_reservations: Counter::default(),
            members_other_key_secret: Gauge::default(),
        }
    }
}

impl ClusterMetrics {
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register("cluster_joined", "1 while this node is a cluster member under a live lease", self.joined.clone());
        registry.register("cluster_joins", "Joins and rejoins of the cluster (each a new lease)", self.joins.clone());
        registry.register("cluster_lease_losses", "Leases found lost while the node lived", self.lease_losses.clone());
        registry.register("cluster_segments_held", "Segments whose blocks are all in the local pool", self.segments_held.clone());
        registry.register(
            "cluster_segments_registered",
            "Held segments registered under the current lease",
            self.segments_registered.clone(),
        );
        registry.register("cluster_registered_segments", "Segment registrations written to etcd", self.registered_segments.clone());
        registry.register(
            "cluster_registration_transactions",
            "etcd transactions that carried segment registrations",
            self.registration_transactions.clone(),
        );
        registry.register(
            "cluster_unregistered_segments",
            "Segments taken out of etcd after an eviction",
            self.unregistered_segments.clone(),
        );
        registry.register("cluster_registry_errors", "Failed registry calls, retried with a bounded backoff", self.registry_errors.clone());
        registry.register(
            "cluster_commits_dropped",
            "Committed requests whose segments were not registered (the registrar's queue was full)",
            self.commits_dropped.clone(),
        );
        registry.register("cluster_manifest_errors", "Segment manifest writes that failed", self.manifest_errors.clone());
        registry.register("cluster_lookups", "LookupCluster requests that asked the registry", self.lookups.clone());
        registry.register("cluster_lookup_failures", "Registry lookups that failed or timed out", self.lookup_failures.clone());
        registry.register(
            "cluster_lookups_skipped",
            "LookupCluster requests answered without the registry (it failed just before)",
            self.lookups_skipped.clone(),
        );
        registry.register(
            "cluster_remote_blocks_found",
            "Blocks past the local prefix found held by other nodes",
            self.remote_blocks_found.clone(),
        );
        registry.register("cluster_lookup_seconds", "Time of one registry lookup (one etcd round trip)", self.lookup_seconds.clone());
        registry.register(
            "cluster_lookup_refused_entries",
            "Registry entries lookups refused (malformed, foreign, another segment size or position)",
            self.lookup_refused_entries.clone(),
        );
        registry.register(
            "cluster_lookup_ranges_cut_short",
            "Segments whose holder range reached its limit with refused entries in it (holders past it unseen)",
            self.lookup_ranges_cut_short.clone(),
        );
        registry.register("cluster_remote_reads", "FetchRemote requests that went to a holder", self.remote_reads.clone());
        registry.register(
            "cluster_remote_read_failures",
            "Remote reads that failed in whole (a typed error to the client; any cause but this node's drain) or in part (a fault past a run read; a wait or a limit there is not counted)",
            self.remote_read_failures.clone(),
        );
        registry.register("cluster_fetched_blocks", "Blocks fetched from other nodes and stored here", self.fetched_blocks.clone());
        registry.register("cluster_served_segments", "Segments sent to other nodes", self.served_segments.clone());
        registry.register(
            "cluster_serve_refusals",
            "Reads from other nodes refused (not held, failed, malformed)",
            self.serve_refusals.clone(),
        );
        registry.register(
            "cluster_replicated_segments",
            "Fetched segments registered here as second replicas (their holder served them more than --cluster-replicate-after times)",
            self.replicated_segments.clone(),
        );
        registry.register(
            "cluster_kept_reservations",
            "Fetched segments whose reserved slots are kept for good (a staging queue pair that may still move them was not deleted, or the store's staging turn panicked)",
            self.kept_reservations.clone(),
        );
        registry.register(
            "cluster_members_other_key_secret",
            "Cluster members whose pools have another key secret than this node's, at its last join: they share no segments with it (-1: the members could not be listed)",
            self.members_other_key_secret.clone(),
        );
    }
}

/// What the registrar publishes besides metrics.
#[derive(Debug)]
struct AgentState {
    lease_id: AtomicI64,
    last_error: Mutex<String>,
    origin: std::time::Instant,
    /// Milliseconds after `origin` when etcd last confirmed the lease (the join or a renewal),
    /// published by the registrar between its calls; [`NEVER_CONFIRMED`] until its first join.
    confirmed_at_ms: AtomicU64,
    /// The registrar's last etcd call failed (cleared by its next call that succeeds, not only
    /// at the end of a pass: a pass may make dozens, each up to a request timeout).
    failing: AtomicBool,
    /// Set by the server's drain once every connection thread has ended: no commit is handed
    /// over after it, so the registrar's last pass takes them all ([`ClusterAgent::connections_ended`]).
    connections_ended: AtomicBool,
}

impl AgentState {
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    fn new() -> AgentState {
        AgentState {
            lease_id: AtomicI64::new(0),
            last_error: Mutex::new(String::new()),
            origin: std::time::Instant::now(),
            confirmed_at_ms: AtomicU64::new(NEVER_CONFIRMED),
            failing: AtomicBool::new(false),
            connections_ended: AtomicBool::new(false),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Milliseconds since etcd last confirmed the lease (since start before the first join).
    fn silent_ms(&self) -> u64 {
        match self.confirmed_at_ms.load(Ordering::Relaxed) {
            NEVER_CONFIRMED => self.now_ms(),
            confirmed_at_ms => self.now_ms().saturating_sub(confirmed_at_ms),
        }
    }

    /// Whether the registry answers this node now, from local state only, `renewal_bound` the
    /// longest a renewed lease goes unconfirmed (a renewal interval plus a request timeout):
    /// unavailable until etcd first confirmed a lease (counted from the start, the first
    /// seconds after it read as answered though nothing was), silent past the bound, or with
    /// the registrar's last call failed.
    fn registry_answer(&self, renewal_bound: std::time::Duration) -> crate::protocol::RegistryAnswer {
        let never = self.confirmed_at_ms.load(Ordering::Relaxed) == NEVER_CONFIRMED;
        let silent = std::time::Duration::from_millis(self.silent_ms());
        if never || self.failing.load(Ordering::Relaxed) || silent > renewal_bound {
            crate::protocol::RegistryAnswer::Unavailable
        } else {
            crate::protocol::RegistryAnswer::Answered
        }
    }
}

/// `AgentState::confirmed_at_ms` before etcd confirmed any lease of this node.
const NEVER_CONFIRMED: u64 = u64::MAX;

/// Segments for the registrar to hold (and register) if their blocks are all committed: a
/// committed store's whole prefix (`first_segment` 0), or one fetched segment that turned out
/// hot (its own keys, `first_segment` its position in the prompt).
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
struct Committed {
    space: ModelSpace,
    /// Block keys of whole segments from `first_segment` on (a partial tail is ignored).
    keys: Vec<u64>,
    first_segment: u32,
}

/// The daemon's side of the cluster: the queue to the registrar, its metrics and state.
pub(crate) struct ClusterAgent {
    settings: ClusterSettings,
    inbox: SyncSender<Committed>,
    /// Taken by the server when it starts serving.
    registrar: Mutex<Option<Registrar>>,
    metrics: ClusterMetrics,
    state: Arc<AgentState>,
    #[cfg(feature = "cluster")]
    lookups: lookup::RemoteLookups,
    #[cfg(feature = "cluster")]
    data_plane: data_plane::DataPlane,
    /// Fetched segments not registered (replicas in waiting), shared with the registrar, which
    /// leaves them out of later commits (`fetched.rs`). Locked after the pool's lock, never
    /// before it.
    #[cfg(feature = "cluster")]
    fetched: Arc<Mutex<fetched::FetchedCopies>>,
    /// The data plane's bound address.
    data_address: SocketAddr,
    /// This node's pool key secret tag, in its member record: a holder whose record names
    /// another is not read from (its blocks, under keys keyed with another secret, are another
    /// prefix's).
    key_secret_tag: tutti_cluster::KeySecretTag,
    /// Held while the agent lives, and so past the registrar's last write of the manifest (the
    /// server joins the registrar's thread before it drops the agent).
    #[cfg(feature = "cluster")]
    _manifest_lock: manifest::ManifestLock,
}

/// What a cluster node's start can refuse without the pool, made by [`ClusterAgent::prepare`]
/// before the pool is opened (or formatted) and used by [`ClusterAgent::start`]: the manifest's
/// lock, the manifest read, the data plane's listener bound, the registry's lookup client.
#[cfg(feature = "cluster")]
pub(crate) struct ClusterPrepared {
    manifest_lock: manifest::ManifestLock,
    loaded: manifest::Loaded,
    /// Bound, not listened on until the pool is open (`DataPlane::bind`'s start; `data_plane::BoundAddress`).
    listener: data_plane::BoundAddress,
    lookups: lookup::RemoteLookups,
}

/// Without the `cluster` feature [`ClusterAgent::prepare`] refuses, so no value of this type
/// exists.
#[cfg(not(feature = "cluster"))]
pub(crate) enum ClusterPrepared {}

/// What a `LookupCluster` found past the local prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RemotePart {
    pub registry: crate::protocol::RegistryAnswer,
    pub remote_blocks: u32,
    pub holders: Vec<crate::protocol::RemoteHolder>,
}

impl RemotePart {
    /// The local part only: this daemon is not a cluster node.
    pub(crate) fn not_clustered() -> RemotePart {
        RemotePart { registry: crate::protocol::RegistryAnswer::NotClustered, remote_blocks: 0, holders: Vec::new() }
    }
}

impl ClusterAgent {
    /// Without the `cluster` feature: refuses, naming it (before the pool is opened).
    #[cfg(not(feature = "cluster"))]
    pub(crate) fn prepare(_settings: &ClusterSettings) -> Result<ClusterPrepared, DaemonError> {
        Err(DaemonError::Cluster("this tuttid was built without the `cluster` feature (etcd's client)".into()))
    }

    /// Before the pool is opened (or formatted), so that none of these refusals costs a
    /// `--format`: takes the manifest's lock (another daemon on it refuses this start before it
    /// reads a byte), reads the manifest (what is not one is refused, left as it is), binds the
    /// data plane's address and makes the registry's lookup client (which connects lazily: no
    /// etcd call here).
    #[cfg(feature = "cluster")]
    pub(crate) fn prepare(settings: &ClusterSettings) -> Result<ClusterPrepared, DaemonError> {
        let manifest_lock = manifest::lock(&settings.manifest)?;
        // What is not a manifest is refused here (exit 2) and left as it is: the rewrite at
        // start would replace it.
        let loaded = manifest::load(&settings.manifest, settings.registry.segment_blocks)?;
        if let Some(reason) = &loaded.discarded {
            tracing::warn!(path = %settings.manifest.display(), reason, "segment manifest discarded");
        }
        if loaded.dropped_bytes > 0 {
            tracing::warn!(bytes = loaded.dropped_bytes, "the segment manifest's tail did not check (a crash mid-write?); ignored");
        }
        let io = |source| DaemonError::Io { context: format!("the data plane on {}", settings.data_address), source };
        // Bound, not listened on: until the pool is open (`DataPlane::bind`), peers are refused at connect.
        let listener = data_plane::BoundAddress::bind(settings.data_address).map_err(io)?;
        let lookups = lookup::RemoteLookups::new(settings.registry.clone(), settings.node.clone(), settings.lookup_timeout)
            .map_err(DaemonError::Registry)?;
        Ok(ClusterPrepared { manifest_lock, loaded, listener, lookups })
    }

    /// Without the `cluster` feature [`ClusterAgent::prepare`] refused already.
    #[cfg(not(feature = "cluster"))]
    pub(crate) fn start(
        _settings: ClusterSettings,
        prepared: ClusterPrepared,
        _control: &mut StoreControl,
        _block_bytes: u64,
        _requests_max: usize,
        _metrics: ClusterMetrics,
    ) -> Result<ClusterAgent, DaemonError> {
        match prepared {}
    }

    /// At bind, before any client, with what [`ClusterAgent::prepare`] made of the same
    /// settings: keeps the manifest's segments whose blocks the recovered index holds whole,
    /// starts recording the index's departures, makes the data plane's staging area, rewrites
    /// the manifest with those segments and the stale ones as dropped records (last: a failed
    /// start leaves it as it was) and prepares the registrar (it joins when the server starts
    /// serving).
    #[cfg(feature = "cluster")]
    pub(crate) fn start(
        settings: ClusterSettings,
        prepared: ClusterPrepared,
        control: &mut StoreControl,
        block_bytes: u64,
        requests_max: usize,
        metrics: ClusterMetrics,
    ) -> Result<ClusterAgent, DaemonError> {
        let segment_blocks = settings.registry.segment_blocks;
        let ClusterPrepared { manifest_lock, loaded, listener, lookups } = prepared;
        let io = |source| DaemonError::Io { context: "the cluster's segment manifest".into(), source };
        // Departures are recorded from here on, before the check below: an eviction after the
        // check is always seen.
        let counts = control.counts();
        let blocks_per_slot = u64::from(control.pool().blocks_per_slot());
        let pool_blocks = counts.slots.saturating_mul(blocks_per_slot);
        control.track_departures(usize::try_from(pool_blocks).unwrap_or(usize::MAX).clamp(1, DEPARTURES_MAX));
        let index = control.pool().index();
        let (held, stale) = recover_segments(&loaded, |key| index.get(key).is_some());
        tracing::info!(held = held.len(), gone = stale.len(), "segments from the manifest checked against the pool");
        let mut data_plane = data_plane::DataPlane::bind(listener, control, segment_blocks, requests_max)
            .map_err(|source| DaemonError::Io { context: format!("the data plane on {}", settings.data_address), source })?;
        data_plane.kept_reservations = metrics.kept_reservations.clone();
        let data_address = data_plane.address();
        // Last, once nothing after it can fail: the file with the stale segments as dropped. A start
        // that failed before this leaves the manifest as it was, so the next start still finds
        // (and deletes the registrations of) the segments this pool lost.
        // The previous process's lease is kept until this one joins: a start that fails before
        // then leaves the next one able to delete those registrations still.
        // Nothing here writes the manifest between prepare and this rewrite: a path changed
        // meanwhile is another file's (the pool's image, created or formatted by open_pool at
        // the same path), which the rename would replace.
        manifest::still_as_loaded(&settings.manifest, &loaded)?;
        // The stale segments are kept as dropped records: a start that dies before the
        // registrar deleted them leaves them for the next (its first join, which follows those
        // deletes, rewrites the file without them).
        let manifest = manifest::Manifest::rewrite_keeping(&settings.manifest, segment_blocks, loaded.lease_id, held.iter(), stale.iter())
            .map_err(io)?;
        let (inbox, receiver) = std::sync::mpsc::sync_channel(settings.commits_queued_max.max(1));
        let state = Arc::new(AgentState::new());
        let key_secret_tag = tutti_cluster::KeySecretTag::new(control.pool().key_secret().tag_bytes());
        let record = tutti_cluster::MemberRecord {
            node: settings.node.clone(),
            key_secret_tag,
            address: data_address.to_string(),
            capacity_bytes: pool_blocks.saturating_mul(block_bytes),
            fingerprints: Vec::new(),
        };
        let recovered = registrar::Recovered { held, manifest, stale, previous_lease: loaded.lease_id };
        let fetched = Arc::new(Mutex::new(fetched::FetchedCopies::new(fetched::FETCHED_MAX)));
        let registrar = Registrar::new(
            settings.registry.clone(),
            record,
            receiver,
            metrics.clone(),
            Arc::clone(&state),
            recovered,
            Arc::clone(&fetched),
        );
        Ok(ClusterAgent {
            settings,
            inbox,
            registrar: Mutex::new(Some(registrar)),
            metrics,
            state,
            lookups,
            data_plane,
            fetched,
            data_address,
            key_secret_tag,
            _manifest_lock: manifest_lock,
        })
    }

    /// Serves other nodes' reads until `stop` (the server runs this on a thread of its own).
    #[cfg(feature = "cluster")]
    pub(crate) fn serve_data_plane(
        &self,
        store: &Mutex<crate::session::StoreState>,
        stop: &crate::server::StopHandle,
        tick: std::time::Duration,
    ) {
        self.data_plane.serve(store, stop, tick, &self.metrics);
    }

    #[cfg(not(feature = "cluster"))]
    pub(crate) fn serve_data_plane(
        &self,
        _store: &Mutex<crate::session::StoreState>,
        _stop: &crate::server::StopHandle,
        _tick: std::time::Duration,
    ) {
    }

    /// `FetchRemote`: what other nodes hold of a prompt past the `local_blocks` here is read
    /// from a holder with the longest run (among several, the one this node's hash of the
    /// segment picks: `lookup::spread_of`) and stored in this pool. A holder that cannot serve
    /// before a block is stored — unreachable (a dead node listed until its lease expires), no
    /// longer holding it, busy until the segment's deadline, failing to read it (its disks, its
    /// staging area retired, a block its pool found damaged) — is passed over for the next one
    /// listed. When the registry's run goes on past the run read (the rest held by nodes that do
    /// not hold its start, so not listed: each holder is listed with its run from the first
    /// segment asked), the rest is looked up from the prefix now local (read from the pool
    /// again: a run stored and gone already ends the fetch there) and read the same way, and so
    /// on (at most [`FETCH_HOLDERS_MAX`] holders asked in all; one passed over as unreachable
    /// or busy is not asked again in a later run, one that answered `NotHeld` or `ReadFailed`
    /// for an earlier run's segments is). Returns the blocks stored; a failure is a sentence for the client
    /// (segments stored before it stay), except that once a run was read, a later run that
    /// finds nothing, whose holders all pass over or whose read fails ends the fetch with what
    /// it read (and what that read stored; a fault in it, `FetchError::is_fault`, is counted
    /// in `remote_read_failures` all the same). Bounded by [`data_plane::FETCH_DEADLINE`] in all (a
    /// later lookup by the lookup timeout too); ends early when `stopped` (the daemon's drain).
    #[cfg(feature = "cluster")]
    pub(crate) fn fetch(
        &self,
        store: &Mutex<crate::session::StoreState>,
        space: &ModelSpace,
        keys: &[u64],
        local_blocks: usize,
        stopped: &dyn Fn() -> bool,
    ) -> Result<usize, String> {
        let deadline = std::time::Instant::now() + data_plane::FETCH_DEADLINE;
        let mut part = self.beyond(space, keys, local_blocks);
        if part.registry != crate::protocol::RegistryAnswer::Answered {
            // Not a remote read (none went to a holder): the lookup counted it already
            // (`lookup_failures` or `lookups_skipped`). Counted as a read failure too, the
            // failures outnumbered the reads.
            return Err("the cluster registry did not answer: nothing fetched".into());
        }
        if part.holders.is_empty() {
            return Ok(0);
        }
        self.metrics.remote_reads.inc();
        let per_segment = usize::from(self.settings.registry.segment_blocks.get());
        let replicate_after = self.settings.replicate_after;
        let mut stored_segment = |segment: usize, segment_keys: &[u64], served: u32, last_written: bool| {
            let Some(key) = segment_keys.last().and_then(|&last| tutti_cluster::SegmentKey::new(last).ok()) else { return };
            // Under the pool lock (then `fetched`'s, the registrar's order): the entry's stamp
            // is ordered against the registrar's departure batches, and a copy already evicted
            // again is not remembered (its departure may be in a batch already taken).
            let pool = lock_store(store);
            let mut fetched = self.fetched.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if replicate_after > 0 && served > replicate_after {
                // A heavy hitter: the copy just committed here becomes a registered replica.
                fetched.replicated(space, key);
                drop(fetched);
                drop(pool);
                self.metrics.replicated_segments.inc();
                self.hand_over(Committed { space: *space, keys: segment_keys.to_vec(), first_segment: segment as u32 });
            } else if last_written && pool.control.pool().index().get(key.get()).is_some() {
                // A replica in waiting: not registered by a later commit of a longer prompt
                // either (remembered before the client's answer, so before any such commit).
                // Only when this fetch wrote the segment's last block: one shared was committed
                // by another store (a local client's, its hand-over perhaps still queued, or a
                // concurrent fetch's, which remembers it), and a local commit is registered.
                fetched.fetched(space, key);
            }
        };
        // Holders passed over, each with why; the nodes passed over as unreachable (or silent
        // before a byte of their segment header: `FetchError::holder_unreachable`) or busy (not
        // asked again in a later run: a dead one would cost another connect timeout and one of
        // the holders asked; one that answered NotHeld or ReadFailed is, as its answer was about
        // an earlier run's segments); holders asked in all runs together.
        let mut passed_over: Vec<String> = Vec::new();
        let mut unreachable_nodes: Vec<String> = Vec::new();
        let mut asked = 0;
        // The local prefix the run being read starts from, blocks stored so far, whether a run
        // was read whole.
        let (mut local, mut stored_in_all, mut read_a_run) = (local_blocks, 0usize, false);
        let first_segment = local_blocks / per_segment;
        loop {
            // (blocks stored, the run read: blocks past `local`, ending on a segment's end)
            let mut read = None;
            // Whether a holder passed over in this run failed with a fault (a ReadFailed: its
            // disks, a damaged block): counted if the fetch ends short for want of another.
            let mut passed_over_fault = false;
            for holder in &part.holders {
                if unreachable_nodes.contains(&holder.node) {
                    continue;
                }
                if asked >= FETCH_HOLDERS_MAX {
                    break;
                }
                asked += 1;
                let segments = local / per_segment..(local + holder.blocks as usize) / per_segment;
                // (blocks stored, the error, whether another holder may serve what this one did
                // not, whether it is a fault: `FetchError::is_fault`, whether the holder could
                // not be reached: `FetchError::holder_unreachable`; a node without a member
                // record has no address to reach)
                let result = self
                    .lookups
                    .address_of(&holder.node, self.key_secret_tag)
                    .map_err(|(stored, error)| (stored, error, true, false, true))
                    .and_then(|address| {
                        self.data_plane
                            .fetch(store, space, keys, segments.clone(), &holder.node, address, deadline, stopped, &mut stored_segment)
                            .map_err(|(stored, error)| {
                                let (may_serve, fault, unreachable) =
                                    (error.another_holder_may_serve(), error.is_fault(), error.holder_unreachable());
                                (stored, error.to_string(), may_serve, fault, unreachable)
                            })
                    });
                match result {
                    Ok(stored) => {
                        self.metrics.fetched_blocks.inc_by(stored as u64);
                        read = Some((stored, holder.blocks as usize));
                        break;
                    }
                    Err((0, error, true, fault, unreachable)) if !stopped() && std::time::Instant::now() < deadline => {
                        tracing::info!(node = %holder.node, %error, "a holder could not serve a fetch: asking the next one listed");
                        passed_over.push(error);
                        passed_over_fault |= fault;
                        if unreachable {
                            unreachable_nodes.push(holder.node.clone());
                        }
                    }
                    Err((stored, error, _, fault, _)) if read_a_run => {
                        // A later run's failure: the runs read stay (what is held is answered
                        // correctly) and the fetch ends with them and what this one stored, as
                        // when the rest is not found (docs/cluster.md, "Remote reads"). A fault
                        // (a bad CRC or frame, a holder closing mid-answer, this node's store
                        // failing: `FetchError::is_fault`) is still counted and warned of; a
                        // wait or limit (the holder stalling or busy, this node's fetch limit,
                        // the deadline, the drain) is not.
                        self.metrics.fetched_blocks.inc_by(stored as u64);
                        let stored = stored_in_all + stored;
                        if fault && !stopped() {
                            self.metrics.remote_read_failures.inc();
                            tracing::warn!(node = %holder.node, %error, stored, passed_over = ?passed_over, "reading the rest of the prompt's run failed: the fetch ends with what it read");
                        } else {
                            tracing::info!(node = %holder.node, %error, stored, passed_over = ?passed_over, "reading the rest of the prompt's run failed: the fetch ends with what it read");
                        }
                        return Ok(stored);
                    }
                    Err((stored, error, _, _, _)) => {
                        self.metrics.fetched_blocks.inc_by(stored as u64);
                        // The drain (`FetchError::Stopped`, or met while passing a holder over)
                        // is not a failure, as in a later run.
                        if !stopped() {
                            self.metrics.remote_read_failures.inc();
                        }
                        let before =
                            if passed_over.is_empty() { String::new() } else { format!("; before it: {}", passed_over.join("; ")) };
                        let (stored, segments) = (stored_in_all + stored, first_segment..segments.end);
                        return Err(format!("{error} ({stored} block(s) of segments {segments:?} stored before it){before}"));
                    }
                }
            }
            let Some((stored, run)) = read else {
                if !read_a_run {
                    if !stopped() {
                        self.metrics.remote_read_failures.inc();
                    }
                    return Err(format!("no holder listed could serve the fetch, nothing stored: {}", passed_over.join("; ")));
                }
                // The runs read stay; the client computes the rest (or fetches again). A fault
                // among the holders passed over (the only holder of the rest refusing with
                // ReadFailed) is counted and warned of, as a later run's fault is.
                if passed_over_fault && !stopped() {
                    self.metrics.remote_read_failures.inc();
                    tracing::warn!(stored = stored_in_all, passed_over = ?passed_over, "no holder of the rest of the prompt's run could serve it, one for a fault: the fetch ends with what it read");
                } else {
                    tracing::info!(stored = stored_in_all, passed_over = ?passed_over, "no holder of the rest of the prompt's run could serve it: the fetch ends with what it read");
                }
                return Ok(stored_in_all);
            };
            stored_in_all += stored;
            read_a_run = true;
            // The registry's run goes on past this holder's (it lists each holder's run from the
            // first segment asked, so one that holds only the rest is not listed): the rest is
            // asked for from the prefix now local, as a lookup from there would — one registry
            // round trip, its holders each tried in turn, within the same deadline and bound on
            // holders.
            if part.remote_blocks as usize <= run || asked >= FETCH_HOLDERS_MAX || stopped() || std::time::Instant::now() >= deadline {
                return Ok(stored_in_all);
            }
            // From the prefix really local now, not the one counted: a segment stored may be
            // gone already (its last block shared with a store released since, or evicted at
            // once), and a run stored past that hole is no prefix a lookup finds. Short of the
            // count, the fetch ends with what it read; past it (a local store meanwhile), the
            // next run starts there. Only what is gone now: a segment evicted during the next
            // lookup or transfer still leaves a hole, the rest stored past it (no wrong data,
            // a lookup finds no prefix past a hole; writes wasted).
            let now_local = lock_store(store).control.lookup(keys);
            if now_local < local + run {
                tracing::info!(
                    counted = local + run,
                    now_local,
                    "a segment this fetch stored left the pool before the rest was read: the fetch ends with what it read"
                );
                return Ok(stored_in_all);
            }
            local = now_local;
            part = self.beyond(space, keys, local);
            if part.registry != crate::protocol::RegistryAnswer::Answered || part.holders.is_empty() {
                return Ok(stored_in_all);
            }
        }
    }

    #[cfg(not(feature = "cluster"))]
    pub(crate) fn fetch(
        &self,
        _store: &Mutex<crate::session::StoreState>,
        _space: &ModelSpace,
        _keys: &[u64],
        _local_blocks: usize,
        _stopped: &dyn Fn() -> bool,
    ) -> Result<usize, String> {
        Err("this tuttid was built without the `cluster` feature".into())
    }

    /// What other nodes hold of a prompt (its block keys in `space`) past the `local_blocks`
    /// this node holds: one registry round trip, bounded by the lookup timeout.
    #[cfg(feature = "cluster")]
    pub(crate) fn beyond(&self, space: &ModelSpace, keys: &[u64], local_blocks: usize) -> RemotePart {
        self.lookups.beyond(space, keys, local_blocks, &self.metrics)
    }

    #[cfg(not(feature = "cluster"))]
    pub(crate) fn beyond(&self, _space: &ModelSpace, _keys: &[u64], _local_blocks: usize) -> RemotePart {
        RemotePart::not_clustered()
    }

    /// A store committed (durable): its segments are registered soon, off this thread. Never
    /// blocks: with the registrar's queue full the request is dropped from registration and
    /// counted.
    pub(crate) fn committed(&self, space: &ModelSpace, keys: Vec<u64>) {
        self.hand_over(Committed { space: *space, keys, first_segment: 0 });
    }

    /// Queues segments for the registrar; never blocks (a full queue drops them, counted).
    fn hand_over(&self, committed: Committed) {
        match self.inbox.try_send(committed) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.metrics.commits_dropped.inc();
            }
            // The registrar ended: it waits for the connection threads' last commits
            // (`connections_ended`), so only one made past its bound on that wait comes here.
            Err(TrySendError::Disconnected(_)) => {
                self.metrics.commits_dropped.inc();
                tracing::warn!("a commit came after the cluster registrar ended: its segments are not journalled nor registered");
            }
        }
    }

    /// The server's drain, once every connection thread has ended (joined): no commit comes
    /// after this, and the registrar, which journals what is still queued, may leave. Release:
    /// every commit handed over before it is in the queue when the registrar reads it.
    pub(crate) fn connections_ended(&self) {
        self.state.connections_ended.store(true, Ordering::Release);
    }

    /// The registrar, for the server to run on its own thread (once).
    pub(crate) fn take_registrar(&self) -> Option<Registrar> {
        self.registrar.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take()
    }

    pub(crate) fn status(&self) -> ClusterStatusReply {
        let metrics = &self.metrics;
        let gauge = |gauge: &Gauge| u64::try_from(gauge.get()).unwrap_or(0);
        ClusterStatusReply {
            enabled: true,
            cluster: self.settings.registry.cluster.to_string(),
            node: self.settings.node.to_string(),
            data_address: self.data_address.to_string(),
            segment_blocks: self.settings.registry.segment_blocks.get(),
            joined: metrics.joined.get() == 1,
            lease_id: self.state.lease_id.load(Ordering::Relaxed) as u64,
            joins: metrics.joins.get(),
            lease_losses: metrics.lease_losses.get(),
            segments_held: gauge(&metrics.segments_held),
            segments_registered: gauge(&metrics.segments_registered),
            registered_segments: metrics.registered_segments.get(),
            registration_transactions: metrics.registration_transactions.get(),
            unregistered_segments: metrics.unregistered_segments.get(),
            registry_errors: metrics.registry_errors.get(),
            commits_dropped: metrics.commits_dropped.get(),
            manifest_errors: metrics.manifest_errors.get(),
            lookups: metrics.lookups.get(),
            lookup_failures: metrics.lookup_failures.get(),
            lookups_skipped: metrics.lookups_skipped.get(),
            remote_blocks_found: metrics.remote_blocks_found.get(),
            remote_reads: metrics.remote_reads.get(),
            remote_read_failures: metrics.remote_read_failures.get(),
            fetched_blocks: metrics.fetched_blocks.get(),
            served_segments: metrics.served_segments.get(),
            serve_refusals: metrics.serve_refusals.get(),
            last_error: self.state.last_error.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone(),
            registry: self.registry_state(),
            registry_silent_ms: self.state.silent_ms(),
            replicated_segments: metrics.replicated_segments.get(),
            key_secret_tag: self.key_secret_tag.bytes(),
            members_other_key_secret: metrics.members_other_key_secret.get(),
        }
    }

    /// Whether the registry answers this node now, from local state only: the lease is renewed
    /// every third of its TTL, each attempt within the request timeout, so a confirmation older
    /// than both together means at least one renewal failed; a failing registrar call too.
    fn registry_state(&self) -> crate::protocol::RegistryAnswer {
        let registry = &self.settings.registry;
        self.state.registry_answer(registry.lease_ttl / 3 + registry.request_timeout)
    }
}

/// A session's prepared stores' block keys, kept until the store commits (then they go to the
/// registrar) or ends otherwise. At most one entry per request the session holds.
#[derive(Debug, Default)]
pub(crate) struct PreparedStores {
    stores: Vec<(u64, Vec<u64>)>,
}

impl PreparedStores {
    pub(crate) fn prepared(&mut self, handle: u64, keys: &[u64]) {
        self.stores.retain(|(held, _)| *held != handle);
        self.stores.push((handle, keys.to_vec()));
    }

    pub(crate) fn take(&mut self, handle: u64) -> Option<Vec<u64>> {
        let position = self.stores.iter().position(|(held, _)| *held == handle)?;
        Some(self.stores.swap_remove(position).1)
    }

    /// Forgets the stores whose requests ended (`live` answers whether the session still holds
    /// a handle).
    pub(crate) fn retain(&mut self, live: impl Fn(u64) -> bool) {
        self.stores.retain(|(handle, _)| live(*handle));
    }
}

/// At start, the manifest's segments against the recovered pool (`present`: whether a block
/// key is committed in its index): the held ones, whose blocks are all there, and the stale
/// ones, whose registrations the registrar deletes before its first join. Stale: segments the
/// previous process held (and so may have registered: it journals a segment before registering
/// it) whose blocks this pool no longer has — a pool wiped or replaced while the old lease
/// lived — and those it journalled as dropped (`Loaded::departed`), whose unregister may not
/// have gone out before it died. Their entries are deleted before this node joins, not left to
/// claim them until that lease expires (peers sent here would be refused) — only while the
/// member key is absent or under the lease the manifest recorded (`ClusterClient::forget`;
/// deleting an entry that is not there is no error).
#[cfg(feature = "cluster")]
fn recover_segments(
    loaded: &manifest::Loaded,
    present: impl Fn(u64) -> bool,
) -> (held::HeldSegments, Vec<(ModelSpace, tutti_cluster::Segment)>) {
    let mut held = held::HeldSegments::default();
    let mut stale = Vec::new();
    for segment in &loaded.segments {
        if segment.keys.iter().all(|&key| present(key)) {
            held.insert(segment.space, segment.index, &segment.keys);
        } else if let Some(key) = segment.keys.last().and_then(|&last| tutti_cluster::SegmentKey::new(last).ok()) {
            stale.push((segment.space, tutti_cluster::Segment { index: segment.index, key }));
        }
    }
    stale.extend_from_slice(&loaded.departed);
    (held, stale)
}

#[cfg(feature = "cluster")]
fn lock_store(store: &Mutex<crate::session::StoreState>) -> std::sync::MutexGuard<'_, crate::session::StoreState> {
    store.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Receives what a committed store hands the registrar (for `registrar.rs`).
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
type Inbox = Receiver<Committed>;

#[cfg(all(test, feature = "cluster"))]
mod tests {
    use super::*;

    #[test]
    fn the_registry_reads_unavailable_until_etcd_confirmed_a_lease() {
        // Goal: just after the start, before any join, the status said `registry: Answered`
        // (the last confirmation counted from the start, within the bound for its first
        // seconds) though etcd had confirmed nothing. Never confirmed reads Unavailable; a
        // confirmation within the bound reads Answered, unless the last call failed.
        use crate::protocol::RegistryAnswer;
        let state = AgentState::new();
        let bound = std::time::Duration::from_secs(4);
        assert_eq!(state.registry_answer(bound), RegistryAnswer::Unavailable, "nothing confirmed yet");
        assert!(state.silent_ms() < 60_000, "silent since the start: {}", state.silent_ms());
        state.confirmed_at_ms.store(state.now_ms(), Ordering::Relaxed);
        assert_eq!(state.registry_answer(bound), RegistryAnswer::Answered);
        state.failing.store(true, Ordering::Relaxed);
        assert_eq!(state.registry_answer(bound), RegistryAnswer::Unavailable, "the last call failed");
    }

    #[test]
    fn a_prepared_data_address_refuses_connections_until_the_data_plane_serves() {
        // Goal: between ClusterAgent::prepare and the data plane (the pool's open, which may
        // take long after a restart), the data address is this node's but refuses connections:
        // peers still listing this node get ECONNREFUSED at once and pass it over, instead of
        // a connect that succeeds into a backlog nobody accepts from (each fetch then waited out
        // its stall bound, twice, holding an asker's slot). Once it listens, connects succeed.
        let directory = tempfile::tempdir().unwrap();
        let cluster = tutti_cluster::ClusterId::new("prepared").unwrap();
        let registry = ClusterConfig::new(vec!["http://127.0.0.1:9".into()], cluster, tutti_cluster::SegmentBlocks::new(16).unwrap());
        let node = NodeId::new("node").unwrap();
        let settings = ClusterSettings::new(registry, node, "127.0.0.1:0".parse().unwrap(), directory.path().join("segments"));
        let prepared = ClusterAgent::prepare(&settings).unwrap();
        let address = prepared.listener.local_addr().unwrap();
        assert_ne!(address.port(), 0, "a port was picked at prepare");
        match std::net::TcpStream::connect_timeout(&address, std::time::Duration::from_secs(2)) {
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => {}
            other => panic!("a connect to the prepared data address before the data plane serves: {other:?}"),
        }
        let listening = prepared.listener.listen().unwrap();
        assert_eq!(listening.local_addr().unwrap(), address);
        std::net::TcpStream::connect_timeout(&address, std::time::Duration::from_secs(2)).expect("a connect once it listens");
    }

    #[test]
    fn a_fetch_cut_by_the_drain_in_its_first_run_is_not_a_read_failure() {
        // Goal: SIGTERM while a FetchRemote's first run waits for its holder's first block
        // ends the fetch telling the client the daemon is stopping, and counts no
        // `remote_read_failures` (the drain is not a fault: `FetchError::is_fault`). Before,
        // the first run's failure arm counted every error, the drain's too.
        use std::io::{Read, Write};
        use std::time::Duration;

        use nvme_driver::{Controller, ControllerConfig, NamespaceId};
        use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};
        use objstore::{format_pool, FormatParams, ModelGeometry, Pool, PoolTarget};

        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let config =
            EmuConfig::default().with_backing(Backing::Memory { bytes: 32 << 20 }).with_namespaces(vec![NamespaceConfig::new(4096, None)]);
        let device = EmuDevice::start(config).unwrap();
        let controller = Arc::new(Controller::init(device.clone(), ControllerConfig::default()).unwrap());
        let targets = vec![PoolTarget { controller, namespace: NamespaceId(1) }];
        let geometry = ModelGeometry { layers: 1, kv_heads: 8, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let params = FormatParams { slot_count_max: Some(48), ..FormatParams::new(geometry) };
        format_pool(&targets, &params).unwrap();
        let (pool, _) = Pool::open(targets, Some(&geometry)).unwrap();
        // The holder's pool shares the asker's secret: the asker reads only from such holders.
        let control_tag = pool.key_secret().tag_bytes();
        let mut control = StoreControl::new(pool, 16).unwrap();
        let segment_blocks = tutti_cluster::SegmentBlocks::new(16).unwrap();
        let registry = ClusterConfig::new(etcd.endpoints(), tutti_cluster::ClusterId::new("drain").unwrap(), segment_blocks);
        let settings = ClusterSettings::new(
            registry.clone(),
            NodeId::new("asker").unwrap(),
            "127.0.0.1:0".parse().unwrap(),
            directory.path().join("segments"),
        );
        let prepared = ClusterAgent::prepare(&settings).unwrap();
        let block_bytes = 2 * 8 * 64 * 16 * 2;
        let agent = ClusterAgent::start(settings, prepared, &mut control, block_bytes, 16, ClusterMetrics::default()).unwrap();
        let relay = crate::relay::DoorbellRelay::start(crate::relay::RelayConfig::default()).unwrap();
        let store = Mutex::new(crate::session::StoreState { control, emulators: vec![Some(device)], relay });

        // The only holder listed: it sends the segment header, then waits (reading its disks)
        // while this node drains.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let holder_address = listener.local_addr().unwrap();
        let space = ModelSpace::new([5; tutti_cluster::FINGERPRINT_BYTES], 0, 1).unwrap();
        let keys: Vec<u64> = (1..=16).map(|block| (7 << 32) + block).collect();
        let mut segments = Vec::new();
        tutti_cluster::segments_of(&keys, segment_blocks, &mut segments).unwrap();
        let record = tutti_cluster::MemberRecord {
            node: NodeId::new("holder").unwrap(),
            key_secret_tag: tutti_cluster::KeySecretTag::new(control_tag),
            address: holder_address.to_string(),
            capacity_bytes: 1 << 30,
            fingerprints: vec![],
        };
        let holder = tutti_cluster::ClusterNode::join(registry, record).unwrap();
        holder.register(&space, &segments).unwrap();
        let draining = Arc::new(AtomicBool::new(false));
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let holding = {
            let draining = Arc::clone(&draining);
            std::thread::spawn(move || {
                listener.set_nonblocking(true).unwrap();
                let until = std::time::Instant::now() + Duration::from_secs(20);
                let mut stream = loop {
                    match listener.accept() {
                        Ok((stream, _)) => break stream,
                        Err(_) if std::time::Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
                        Err(_) => return,
                    }
                };
                stream.set_nonblocking(false).unwrap();
                stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut request = [0u8; peer::HEADER_BYTES];
                stream.read_exact(&mut request).unwrap();
                let mut body = vec![0u8; u32::from_le_bytes(request[8..12].try_into().unwrap()) as usize];
                stream.read_exact(&mut body).unwrap();
                let mut header = Vec::new();
                let sent = peer::SegmentHeader { blocks: 16, block_bytes, served: 1, geometry };
                peer::encode_segment_header(&mut header, sent);
                stream.write_all(&header).unwrap();
                std::thread::sleep(Duration::from_millis(50));
                draining.store(true, Ordering::Release);
                let _ = wait.recv_timeout(Duration::from_secs(30));
            })
        };
        let stopped = || draining.load(Ordering::Acquire);
        let fetched = agent.fetch(&store, &space, &keys, 0, &stopped);
        done.send(()).unwrap();
        holding.join().unwrap();
        let message = fetched.expect_err("a fetch cut by the drain");
        assert!(message.contains("stopping"), "{message}");
        assert_eq!((agent.metrics.remote_reads.get(), agent.metrics.remote_read_failures.get()), (1, 0), "{message}");
        drop(holder);
    }
}
