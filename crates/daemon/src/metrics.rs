//! What operators scrape: tuttid's counters in the Prometheus text format (OpenMetrics), served
//! over HTTP on a loopback address by default.
//!
//! Encoding is `prometheus-client` (the Prometheus project's Rust client); the HTTP side
//! (`endpoint.rs`) is one thread with a bounded number of connections, each with deadlines,
//! that wakes every tick to check the stop flag, so the endpoint ends with the daemon's drain. Request-path counters are updated by the connection threads with
//! atomics (no lock on the request path beyond the family's map, whose label sets are a fixed
//! enum); pool fill, clients, connections, leaks and the doorbell relay are read from the
//! daemon's state at scrape time.
//!
//! Bytes and commands per direction are issued by the clients' own queue pairs (docs/tuttid.md,
//! "Process model"), so they are what each client reported at its request's commit or release,
//! once the daemon checked the report against the request's grant (`crate::report`): a client
//! killed before it reported is not counted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::protocol::{ErrorCode, Kind};

mod endpoint;
pub use endpoint::MetricsEndpoint;

/// A request kind, as a label value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
pub enum RequestLabel {
    Hello,
    Lookup,
    LookupAllRanks,
    Status,
    Ping,
    RegisterMemory,
    AttachQueues,
    PoolShape,
    PrepareRetrieve,
    PrepareStore,
    Commit,
    Release,
    RegisterDeviceMemory,
    ClusterStatus,
    LookupCluster,
    FetchRemote,
    /// A frame whose body did not decode (no kind to name).
    Malformed,
}

impl RequestLabel {
    pub fn of(kind: Kind) -> RequestLabel {
        match kind {
            Kind::Hello => RequestLabel::Hello,
            Kind::Lookup => RequestLabel::Lookup,
            Kind::LookupAllRanks => RequestLabel::LookupAllRanks,
            Kind::Status => RequestLabel::Status,
            Kind::Ping => RequestLabel::Ping,
            Kind::RegisterMemory => RequestLabel::RegisterMemory,
            Kind::AttachQueues => RequestLabel::AttachQueues,
            Kind::PoolShape => RequestLabel::PoolShape,
            Kind::PrepareRetrieve => RequestLabel::PrepareRetrieve,
            Kind::PrepareStore => RequestLabel::PrepareStore,
            Kind::Commit => RequestLabel::Commit,
            Kind::Release => RequestLabel::Release,
            Kind::RegisterDeviceMemory => RequestLabel::RegisterDeviceMemory,
            Kind::ClusterStatus => RequestLabel::ClusterStatus,
            Kind::LookupCluster => RequestLabel::LookupCluster,
            Kind::FetchRemote => RequestLabel::FetchRemote,
            _ => RequestLabel::Malformed,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    request: RequestLabel,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ErrorLabels {
    /// The error code's number (a fixed, small set; `Unknown(n)` cannot be produced here).
    code: u16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
enum LookupResult {
    Hit,
    Miss,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct LookupLabels {
    result: LookupResult,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
enum SlotState {
    Free,
    Valid,
    Writing,
    Pinned,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SlotLabels {
    state: SlotState,
}

/// A request's direction, as a label value: retrieves read the devices, stores write them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
enum DirectionLabel {
    Retrieve,
    Store,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DirectionLabels {
    direction: DirectionLabel,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
enum DoorbellResult {
    Forwarded,
    Dropped,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DoorbellLabels {
    result: DoorbellResult,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ClientDoorbellLabels {
    session: u64,
    client: String,
    result: DoorbellResult,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DeviceLabels {
    /// The device as given on the command line (`vfio:BDF`, `emu:PATH`, `emu:mem:SIZE`).
    device: String,
}

/// One attached session's relay counters, as a scrape reads them.
#[derive(Debug, Clone, Default)]
pub struct ClientRelay {
    pub session: u64,
    pub name: String,
    pub forwarded: u64,
    pub dropped: u64,
}

/// The daemon's metrics. Cheap to share (`Arc`); every update is lock-free or a short map probe.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    request_seconds: Family<RequestLabels, Histogram>,
    errors: Family<ErrorLabels, Counter>,
    lookup_blocks: Family<LookupLabels, Counter>,
    slots: Family<SlotLabels, Gauge>,
    cached_blocks: Gauge,
    evictions: Counter,
    /// The index's eviction count at the last scrape (the index counts; the counter follows).
    evictions_seen: AtomicU64,
    clients: Gauge,
    connections: Gauge,
    leases_expired: Counter,
    bytes: Family<DirectionLabels, Counter>,
    commands: Family<DirectionLabels, Counter>,
    leaked_queue_pairs: Gauge,
    leaked_windows: Gauge,
    leaked_window_bytes: Gauge,
    leaked_requests: Gauge,
    sessions_awaiting_exit: Gauge,
    relay_passes: Counter,
    relay_doorbells: Family<DoorbellLabels, Counter>,
    relay_queues: Gauge,
    client_doorbells: Family<ClientDoorbellLabels, Counter>,
    device_metadata_fenced: Family<DeviceLabels, Gauge>,
    /// The relay's counts at the last scrape (the relay counts; the counters follow).
    relay_seen: std::sync::Mutex<crate::relay::RelayCounts>,
}

/// What a scrape reads from the daemon's state.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub pool: objstore::IndexCounts,
    pub clients: u64,
    pub connections: u64,
    /// Queue pairs, windows (and bytes) and requests kept for good since start.
    pub leaked_queue_pairs: u64,
    pub leaked_windows: u64,
    pub leaked_window_bytes: u64,
    pub leaked_requests: u64,
    /// Sessions ended while their client still runs, kept until it exits.
    pub sessions_awaiting_exit: u64,
    pub relay: crate::relay::RelayCounts,
    /// Per attached session with relayed pairs.
    pub client_relay: Vec<ClientRelay>,
    /// Per pool device (its spec): whether the pool fenced its metadata
    /// (`StatusReply::metadata_fenced`).
    pub devices_fenced: Vec<(String, bool)>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("tuttid");
        let requests = Family::<RequestLabels, Counter>::default();
        // 1 µs to ~8 s in powers of two: lookups are µs, a commit (flush + FUA headers) ms.
        let request_seconds =
            Family::<RequestLabels, Histogram>::new_with_constructor(|| Histogram::new(exponential_buckets(1e-6, 2.0, 24)));
        let errors = Family::<ErrorLabels, Counter>::default();
        let lookup_blocks = Family::<LookupLabels, Counter>::default();
        let slots = Family::<SlotLabels, Gauge>::default();
        let (cached_blocks, evictions, clients, connections, leases_expired) =
            (Gauge::default(), Counter::default(), Gauge::default(), Gauge::default(), Counter::default());
        registry.register("requests", "Requests served, by kind", requests.clone());
        registry.register("request_seconds", "Time from a request's decode to its reply, by kind", request_seconds.clone());
        registry.register("errors", "Error replies, by code (protocol.rs ErrorCode numbers)", errors.clone());
        registry.register(
            "lookup_blocks",
            "Full blocks of looked-up prompts, cached (hit) or not (miss); hit rate = hit / (hit + miss)",
            lookup_blocks.clone(),
        );
        registry.register("pool_slots", "Pool slots by state (pinned slots are also valid)", slots.clone());
        registry.register("pool_cached_blocks", "Blocks committed and visible to lookups", cached_blocks.clone());
        registry.register("pool_evictions", "Slots evicted since the pool was opened", evictions.clone());
        registry.register("clients", "Attached sessions", clients.clone());
        registry.register("connections", "Open connections, attached or not", connections.clone());
        registry.register("leases_expired", "Sessions ended because they sent nothing for a lease", leases_expired.clone());
        let (bytes, commands) = (Family::<DirectionLabels, Counter>::default(), Family::<DirectionLabels, Counter>::default());
        registry.register(
            "bytes",
            "Bytes clients' queue pairs moved, by direction (Retrieve: device to engine memory), as reported at commit or release",
            bytes.clone(),
        );
        registry.register("commands", "NVMe commands clients' queue pairs executed, by direction, as reported", commands.clone());
        let (leaked_queue_pairs, leaked_windows, leaked_window_bytes, leaked_requests) =
            (Gauge::default(), Gauge::default(), Gauge::default(), Gauge::default());
        registry.register("leaked_queue_pairs", "Client queue pairs whose deletion failed, kept for good", leaked_queue_pairs.clone());
        registry.register(
            "leaked_windows",
            "Client windows kept mapped for good (a queue that may write them lives)",
            leaked_windows.clone(),
        );
        registry.register("leaked_window_bytes", "Bytes of those windows", leaked_window_bytes.clone());
        registry.register("leaked_requests", "Requests whose reserved slots are kept for good", leaked_requests.clone());
        let sessions_awaiting_exit = Gauge::default();
        registry.register(
            "sessions_awaiting_exit",
            "Sessions the daemon ended while their client process still runs: their queue pairs, windows and reservations are \
             kept until it exits",
            sessions_awaiting_exit.clone(),
        );
        let (relay_passes, relay_doorbells, relay_queues) =
            (Counter::default(), Family::<DoorbellLabels, Counter>::default(), Gauge::default());
        let client_doorbells = Family::<ClientDoorbellLabels, Counter>::default();
        registry.register(
            "relay_passes",
            "Polling passes of the doorbell relay thread (none while nothing is relayed)",
            relay_passes.clone(),
        );
        registry.register(
            "relay_doorbells",
            "Doorbell values the relay forwarded to a BAR, or dropped (outside the queue's depth)",
            relay_doorbells.clone(),
        );
        registry.register("relay_queues", "Client queue pairs relayed now", relay_queues.clone());
        registry.register("client_relay_doorbells", "The relay's doorbells per attached session", client_doorbells.clone());
        let device_metadata_fenced = Family::<DeviceLabels, Gauge>::default();
        registry.register(
            "device_metadata_fenced",
            "1 for a pool device whose metadata the pool fenced (header writes or flushes kept failing, or a metadata command \
             stuck): it takes no stores, its free slots count for nothing, until tuttid restarts and reopens the pool",
            device_metadata_fenced.clone(),
        );
        Metrics {
            registry,
            requests,
            request_seconds,
            errors,
            lookup_blocks,
            slots,
            cached_blocks,
            evictions,
            evictions_seen: AtomicU64::new(0),
            clients,
            connections,
            leases_expired,
            bytes,
            commands,
            leaked_queue_pairs,
            leaked_windows,
            leaked_window_bytes,
            leaked_requests,
            sessions_awaiting_exit,
            relay_passes,
            relay_doorbells,
            relay_queues,
            client_doorbells,
            device_metadata_fenced,
            relay_seen: std::sync::Mutex::new(crate::relay::RelayCounts::default()),
        }
    }

    /// Adds the cluster tier's metrics (a daemon in a cluster: `crate::cluster`).
    pub fn register_cluster(&mut self, cluster: &crate::cluster::ClusterMetrics) {
        cluster.register(&mut self.registry);
    }

    /// A client's accepted report: what its request moved.
    pub fn transferred(&self, direction: objstore::Direction, transferred: objstore::Transferred) {
        let direction = match direction {
            objstore::Direction::Retrieve => DirectionLabel::Retrieve,
            objstore::Direction::Store => DirectionLabel::Store,
        };
        let labels = DirectionLabels { direction };
        self.bytes.get_or_create(&labels).inc_by(transferred.bytes);
        self.commands.get_or_create(&labels).inc_by(transferred.commands);
    }

    /// One request served: its kind, how long it took, and its error code if it failed.
    pub fn request(&self, request: RequestLabel, elapsed: Duration, error: Option<ErrorCode>) {
        let labels = RequestLabels { request };
        self.requests.get_or_create(&labels).inc();
        self.request_seconds.get_or_create(&labels).observe(elapsed.as_secs_f64());
        if let Some(code) = error {
            self.error(code);
        }
    }

    /// An error reply outside a request (a refused frame, a lease, shutdown).
    pub fn error(&self, code: ErrorCode) {
        self.errors.get_or_create(&ErrorLabels { code: code.to_u16() }).inc();
        if code == ErrorCode::LeaseExpired {
            self.leases_expired.inc();
        }
    }

    /// A lookup over `full_blocks` blocks found `cached` of them.
    pub fn lookup(&self, full_blocks: u64, cached: u64) {
        self.lookup_blocks.get_or_create(&LookupLabels { result: LookupResult::Hit }).inc_by(cached);
        self.lookup_blocks.get_or_create(&LookupLabels { result: LookupResult::Miss }).inc_by(full_blocks.saturating_sub(cached));
    }

    /// The text a scrape returns, after refreshing what is read from the daemon's state.
    pub fn encode(&self, snapshot: &Snapshot) -> Result<String, std::fmt::Error> {
        let pool = &snapshot.pool;
        for (state, value) in [
            (SlotState::Free, pool.free_slots),
            (SlotState::Valid, pool.valid_slots),
            (SlotState::Writing, pool.writing_slots),
            (SlotState::Pinned, pool.pinned_slots),
        ] {
            self.slots.get_or_create(&SlotLabels { state }).set(gauge_value(value));
        }
        self.cached_blocks.set(gauge_value(pool.cached_blocks));
        let seen = self.evictions_seen.swap(pool.evictions, Ordering::AcqRel);
        self.evictions.inc_by(pool.evictions.saturating_sub(seen));
        self.clients.set(gauge_value(snapshot.clients));
        self.connections.set(gauge_value(snapshot.connections));
        self.leaked_queue_pairs.set(gauge_value(snapshot.leaked_queue_pairs));
        self.leaked_windows.set(gauge_value(snapshot.leaked_windows));
        self.leaked_window_bytes.set(gauge_value(snapshot.leaked_window_bytes));
        self.leaked_requests.set(gauge_value(snapshot.leaked_requests));
        self.sessions_awaiting_exit.set(gauge_value(snapshot.sessions_awaiting_exit));
        {
            let relay = &snapshot.relay;
            let mut seen = self.relay_seen.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            self.relay_passes.inc_by(relay.passes.saturating_sub(seen.passes));
            let doorbells = |result| self.relay_doorbells.get_or_create(&DoorbellLabels { result });
            doorbells(DoorbellResult::Forwarded).inc_by(relay.forwarded.saturating_sub(seen.forwarded));
            doorbells(DoorbellResult::Dropped).inc_by(relay.dropped.saturating_sub(seen.dropped));
            *seen = *relay;
            self.relay_queues.set(gauge_value(relay.queues));
        }
        // Per session: only the sessions attached now (a session's series goes with it).
        self.client_doorbells.clear();
        for client in &snapshot.client_relay {
            for (result, value) in [(DoorbellResult::Forwarded, client.forwarded), (DoorbellResult::Dropped, client.dropped)] {
                let labels = ClientDoorbellLabels { session: client.session, client: client.name.clone(), result };
                self.client_doorbells.get_or_create(&labels).inc_by(value);
            }
        }
        for (device, fenced) in &snapshot.devices_fenced {
            self.device_metadata_fenced.get_or_create(&DeviceLabels { device: device.clone() }).set(i64::from(*fenced));
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

fn gauge_value(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_state_appear_in_the_text() {
        // Goal: what the connection threads record and what a scrape reads both show, with the
        // names and labels docs/tuttid.md lists.
        let metrics = Metrics::new();
        metrics.request(RequestLabel::Lookup, Duration::from_micros(30), None);
        metrics.request(RequestLabel::Hello, Duration::from_micros(5), Some(ErrorCode::BadRequest));
        metrics.lookup(10, 4);
        metrics.error(ErrorCode::LeaseExpired);
        metrics.transferred(objstore::Direction::Retrieve, objstore::Transferred { bytes: 8192, commands: 2 });
        metrics.transferred(objstore::Direction::Retrieve, objstore::Transferred { bytes: 4096, commands: 1 });
        metrics.transferred(objstore::Direction::Store, objstore::Transferred { bytes: 512, commands: 1 });
        let mut snapshot = Snapshot {
            clients: 2,
            connections: 3,
            leaked_queue_pairs: 1,
            leaked_window_bytes: 4096,
            sessions_awaiting_exit: 1,
            ..Snapshot::default()
        };
        snapshot.pool.free_slots = 7;
        snapshot.pool.evictions = 5;
        snapshot.relay = crate::relay::RelayCounts { passes: 40, forwarded: 12, dropped: 1, queues: 2 };
        snapshot.client_relay = vec![ClientRelay { session: 4, name: "rank-0".into(), forwarded: 12, dropped: 1 }];
        snapshot.devices_fenced = vec![("emu:a".into(), false), ("emu:b".into(), true)];
        let text = metrics.encode(&snapshot).unwrap();
        for line in [
            "tuttid_requests_total{request=\"Lookup\"} 1",
            "tuttid_errors_total{code=\"12\"} 1",
            "tuttid_errors_total{code=\"9\"} 1",
            "tuttid_lookup_blocks_total{result=\"Hit\"} 4",
            "tuttid_lookup_blocks_total{result=\"Miss\"} 6",
            "tuttid_pool_slots{state=\"Free\"} 7",
            "tuttid_pool_evictions_total 5",
            "tuttid_clients 2",
            "tuttid_connections 3",
            "tuttid_leases_expired_total 1",
            "tuttid_request_seconds_count{request=\"Lookup\"} 1",
            "tuttid_bytes_total{direction=\"Retrieve\"} 12288",
            "tuttid_commands_total{direction=\"Retrieve\"} 3",
            "tuttid_bytes_total{direction=\"Store\"} 512",
            "tuttid_commands_total{direction=\"Store\"} 1",
            "tuttid_leaked_queue_pairs 1",
            "tuttid_sessions_awaiting_exit 1",
            "tuttid_leaked_window_bytes 4096",
            "tuttid_leaked_windows 0",
            "tuttid_relay_passes_total 40",
            "tuttid_relay_doorbells_total{result=\"Forwarded\"} 12",
            "tuttid_relay_doorbells_total{result=\"Dropped\"} 1",
            "tuttid_relay_queues 2",
            "tuttid_client_relay_doorbells_total{session=\"4\",client=\"rank-0\",result=\"Forwarded\"} 12",
            "tuttid_device_metadata_fenced{device=\"emu:a\"} 0",
            "tuttid_device_metadata_fenced{device=\"emu:b\"} 1",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        // The eviction and relay counters follow their sources: a later scrape adds only the
        // difference; a session that ended leaves no series.
        snapshot.pool.evictions = 8;
        snapshot.relay.forwarded = 20;
        snapshot.client_relay.clear();
        let text = metrics.encode(&snapshot).unwrap();
        assert!(text.contains("tuttid_pool_evictions_total 8"), "{text}");
        assert!(text.contains("tuttid_relay_doorbells_total{result=\"Forwarded\"} 20"), "{text}");
        assert!(!text.contains("tuttid_client_relay_doorbells_total{"), "{text}");
    }
}
