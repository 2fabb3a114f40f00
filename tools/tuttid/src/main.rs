//! `tuttid`: the daemon that owns a node's NVMe devices and KV pool (docs/tuttid.md).
//!
//! `tuttid --device SPEC... --socket PATH [--format ...]` opens the devices (one VFIO container,
//! or software controllers running inside the daemon), opens (or formats, then opens) the pool,
//! and serves clients until SIGTERM or SIGINT, then drains and exits 0.
//! `tuttid --status SOCKET` prints a running daemon's devices, pool fill and clients.
//! With `--cluster-etcd URL… --cluster-id ID --node-id ID --data-address IP:PORT
//! --cluster-state FILE` the daemon is a node of a cluster (docs/cluster.md).
//!
//! Exit status (`tutti_cli::exit`): 0 done; 1 failed (a device error, the daemon unreachable);
//! 2 unusable input (a bad flag or device string, a device another daemon holds, a device with no
//! pool or another pool's, a superblock this build cannot read); 141 standard output closed.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use nix::sys::signal::{SigSet, Signal};
use objstore::FormatParams;
use tutti_cli::exit::{self, Unusable};
use tutti_cli::{outln, printable, read_key_secret_file, GeometryArgs};
use tutti_cluster::{ClusterConfig, ClusterId, NodeId, SegmentBlocks};
use tutti_daemon::cluster::ClusterSettings;
use tutti_daemon::gpu_memory::DeviceMemoryImport;
use tutti_daemon::pool_open::{open_pool, PoolOptions};
use tutti_daemon::protocol::{ClusterStatusReply, RegistryAnswer, StatusReply};
use tutti_daemon::session::SessionLimits;
use tutti_daemon::{Client, DaemonError, Server, ServerConfig};
use tutti_devices::{format_size, parse_duration, parse_size, DeviceKind, DeviceSpec};

/// Device kinds a daemon's pool can live on.
const DEVICE_KINDS: [DeviceKind; 3] = [DeviceKind::Vfio, DeviceKind::EmuFile, DeviceKind::EmuMemory];

/// tuttid: one process owns the SSDs and the KV pool; engine processes attach to it.
#[derive(Parser, Debug)]
#[command(version, about, after_long_help = tutti_cli::exit::help_text(false))]
struct Cli {
    /// Print a running daemon's devices, pool fill and clients, then exit.
    #[arg(long, value_name = "SOCKET", conflicts_with_all = ["devices", "socket", "format"])]
    status: Option<PathBuf>,
    /// A pool device: vfio:BDF, emu:PATH or emu:mem:SIZE (the software controller runs inside
    /// the daemon, with 4096-byte LBAs: an emu: pool formatted with another LBA size is
    /// refused). Repeat for several; all in one DMA space.
    #[arg(long = "device", value_name = "SPEC", required_unless_present = "status", value_parser = parse_device)]
    devices: Vec<DeviceSpec>,
    /// The Unix socket to serve on (created mode 0600).
    #[arg(long, value_name = "PATH", required_unless_present = "status")]
    socket: Option<PathBuf>,
    /// Format a fresh pool on the devices before serving (needed for emu:mem:); the geometry
    /// options below say for which model.
    #[arg(long)]
    format: bool,
    /// With --format: format a device that holds something other than a tutti pool (a file
    /// system, a partition table, a non-empty file of other bytes; a vfio: SSD or emu: block
    /// device that does not start with a tutti superblock), refused without it, saying what was
    /// found. A tutti pool is reformatted either way.
    #[arg(long, requires = "format")]
    overwrite: bool,
    #[command(flatten)]
    geometry: GeometryArgs,
    /// Engine blocks per slot (k), with --format.
    #[arg(long, default_value_t = 1)]
    blocks_per_slot: u32,
    /// At most this many slots per device, with --format.
    #[arg(long)]
    slots: Option<u64>,
    /// With --format: record a CRC of every block's payload at commit, so that clients
    /// configured to verify retrieves can (a mismatching block is then evicted).
    #[arg(long)]
    payload_crc: bool,
    /// With --format: the pool's key secret, from a file of exactly 64 hex digits (a trailing
    /// newline allowed; mode 0600). Block keys are keyed with it, and every node of a cluster
    /// must be formatted with the same one, or the nodes find none of each other's blocks.
    /// Default: a fresh random secret for this pool.
    #[arg(long, value_name = "PATH", requires = "format")]
    key_secret_file: Option<PathBuf>,
    /// Namespace id on every device.
    #[arg(long, default_value_t = 1)]
    namespace: u32,
    /// Software controllers without a shared register page: clients ring their doorbells
    /// through the daemon's relay, as on vfio: devices (a test of that path without VFIO).
    #[arg(long)]
    emu_doorbell_relay: bool,
    /// With --format: create (or grow) emu: files to this size (e.g. 256m). Ignored without
    /// it: an existing pool's size is fixed by its superblock, so no file is created or grown
    /// (a missing one is refused).
    #[arg(long, value_parser = parse_size)]
    emu_create_bytes: Option<u64>,
    /// A session that sends nothing for this long is ended and its holdings released.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    lease: Duration,
    /// A frame must arrive whole within this of its first byte.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    frame_timeout: Duration,
    /// Connections served at once, 64 when not given, at most 7173 (the sessions one status
    /// reply can list); past it, one more connection is let in for status queries only.
    /// Each software controller is started with this many I/O queue pairs plus two, or plus
    /// three on a cluster node (one per client, one for the pool's metadata, one spare, and on a
    /// cluster node one for the data plane's staging area); a session attaches one pair per
    /// device, however many windows it registers.
    /// Each connection may hold at worst about 11 descriptors, plus one per window
    /// (--windows-per-session) and two per pool device: a start whose worst case passes the
    /// descriptor limit (the soft RLIMIT_NOFILE is raised to the hard one first) is refused
    /// (exit 2) when this is given, and served with the clients that fit (a warning) when not.
    #[arg(long)]
    clients_max: Option<usize>,
    /// Memory windows one session may register (its device memory registrations count too).
    /// Each holds a descriptor (its memfd or dma-buf) for as long as its session, so this
    /// counts in the descriptor limit's worst case (--clients-max).
    #[arg(long, default_value_t = 4)]
    windows_per_session: usize,
    /// Bytes one session's windows may hold together (e.g. 64g).
    #[arg(long, default_value = "64g", value_parser = parse_size)]
    window_bytes_per_session: u64,
    /// Requests one session may hold prepared at once, at most 4096; --clients-max × this at
    /// most 1048576 (2^20): every session's requests are reserved at start (about 120 bytes
    /// each). A count past either is refused before the pool is opened. Memory beyond that
    /// table: about 9 KiB per reservation once used, and up to about 0.6 MiB per request held
    /// (a 1 MiB body of 16-token blocks; 2.3 MiB with blocks of under 4 tokens): the defaults'
    /// 2048 requests held at once take up to about 1.2 GiB.
    #[arg(long, default_value_t = 32)]
    requests_per_session: usize,
    /// Where vfio: devices' lock files live.
    #[arg(long, default_value = tutti_devices::DEFAULT_LOCK_DIR)]
    lock_dir: PathBuf,
    /// KV memory clients may register outside their windows, which the software controllers
    /// reach by copies: `cuda` (GPU memory through CUDA IPC; needs a build with the `cuda`
    /// feature and a CUDA driver), `memfd` (a client's sealed memfd: the software stand-in, for
    /// tests), or `off`. Refused on vfio: devices (docs/tuttid.md, GPU memory).
    #[arg(long, value_enum, default_value = "off")]
    device_memory: DeviceMemoryArg,
    /// Serve Prometheus metrics at http://ADDRESS/metrics (loopback by default; port 0 picks a
    /// free one, printed at start), or `off`.
    #[arg(long, value_name = "ADDRESS|off", default_value = "127.0.0.1:9464", value_parser = parse_metrics_address)]
    metrics: MetricsAddress,
    /// Join a cluster (docs/cluster.md) through these etcd endpoints (http://HOST:PORT, every
    /// member of the etcd cluster; comma-separated or repeated).
    #[arg(
        long = "cluster-etcd",
        value_name = "URL[,URL…]",
        value_delimiter = ',',
        requires_all = ["cluster_id", "node_id", "data_address", "cluster_state"]
    )]
    cluster_etcd: Vec<String>,
    /// The cluster's id (1..=64 of a-z 0-9 - _), the same on every node of the fleet.
    #[arg(long, value_name = "ID", requires = "cluster_etcd")]
    cluster_id: Option<String>,
    /// This node's id in the cluster (1..=64 of a-z 0-9 - _), stable across restarts.
    #[arg(long, value_name = "ID", requires = "cluster_etcd")]
    node_id: Option<String>,
    /// Where other nodes reach this node's data plane, as its member record says (an address
    /// they can route to: an unspecified one such as 0.0.0.0 is refused).
    #[arg(long, value_name = "IP:PORT", requires = "cluster_etcd")]
    data_address: Option<std::net::SocketAddr>,
    /// Blocks per segment (16..=64), the same on every node of the cluster.
    #[arg(long, default_value_t = 32, requires = "cluster_etcd")]
    segment_blocks: u16,
    /// The segment manifest: which segments this node holds, kept across restarts so a
    /// restarted node registers what survived (a file beside the pool's, one per pool; locked
    /// through FILE.lock while the daemon runs: a second daemon on it exits 2).
    #[arg(long, value_name = "FILE", requires = "cluster_etcd")]
    cluster_state: Option<PathBuf>,
    /// The node's etcd lease: a node that dies vanishes from the cluster this long after its
    /// last renewal (whole seconds, 2..=3600).
    #[arg(long, default_value = "10s", value_parser = parse_duration, requires = "cluster_etcd")]
    cluster_lease: Duration,
    /// The longest any registry call waits for etcd, retries included (at most 2/3 of the lease).
    #[arg(long, default_value = "3s", value_parser = parse_duration, requires = "cluster_etcd")]
    cluster_timeout: Duration,
    /// The longest a client's cluster lookup waits for etcd (the local part is answered either
    /// way; after a failure the registry is not asked for a second).
    #[arg(long, default_value = "1s", value_parser = parse_duration, requires = "cluster_etcd")]
    cluster_lookup_timeout: Duration,
    /// Heavy hitters: a segment fetched from another node whose holder has served it more than
    /// N times (to any node, since the holder started) is registered as this node's replica
    /// too; 0: never (fetched copies are served locally but not registered).
    #[arg(long, value_name = "N", default_value_t = tutti_daemon::cluster::REPLICATE_AFTER_DEFAULT, requires = "cluster_etcd")]
    cluster_replicate_after: u32,
}

/// The cluster settings the command line asks for, checked (exit 2 on a bad one).
fn cluster_settings(cli: &Cli) -> Result<Option<ClusterSettings>> {
    if cli.cluster_etcd.is_empty() {
        return Ok(None);
    }
    let unusable = |error: tutti_cluster::ClusterError| Unusable(error.to_string());
    let required = |value: Option<String>, flag: &str| value.ok_or_else(|| Unusable(format!("{flag} is required with --cluster-etcd")));
    let cluster = ClusterId::new(&required(cli.cluster_id.clone(), "--cluster-id")?).map_err(unusable)?;
    let node = NodeId::new(&required(cli.node_id.clone(), "--node-id")?).map_err(unusable)?;
    let segment_blocks = SegmentBlocks::new(cli.segment_blocks).map_err(unusable)?;
    let mut registry = ClusterConfig::new(cli.cluster_etcd.clone(), cluster, segment_blocks);
    registry.lease_ttl = cli.cluster_lease;
    registry.request_timeout = cli.cluster_timeout;
    registry.validate().map_err(unusable)?;
    let data_address = cli.data_address.ok_or_else(|| Unusable("--data-address is required with --cluster-etcd".into()))?;
    if data_address.ip().is_unspecified() {
        // The address is advertised to other nodes as it is: 0.0.0.0 would send them to
        // their own host.
        return Err(Unusable(format!(
            "--data-address {data_address}: other nodes connect to this address as given; name this host's own IP, not an unspecified one"
        ))
        .into());
    }
    let manifest = cli.cluster_state.clone().ok_or_else(|| Unusable("--cluster-state is required with --cluster-etcd".into()))?;
    let lookups = ClusterConfig { request_timeout: cli.cluster_lookup_timeout, ..registry.clone() };
    // The lookup client holds no lease: its timeout is not bound by the lease TTL.
    lookups.validate_connection().map_err(|error| Unusable(format!("--cluster-lookup-timeout: {error}")))?;
    let mut settings = ClusterSettings::new(registry, node, data_address, manifest);
    settings.lookup_timeout = cli.cluster_lookup_timeout;
    settings.replicate_after = cli.cluster_replicate_after;
    Ok(Some(settings))
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum DeviceMemoryArg {
    Off,
    Memfd,
    Cuda,
}

#[derive(Debug, Clone, Copy)]
struct MetricsAddress(Option<std::net::SocketAddr>);

fn parse_metrics_address(text: &str) -> Result<MetricsAddress, String> {
    if text == "off" {
        return Ok(MetricsAddress(None));
    }
    text.parse().map(|address| MetricsAddress(Some(address))).map_err(|error| format!("{text:?} is not IP:PORT or `off`: {error}"))
}

fn parse_device(text: &str) -> Result<DeviceSpec, String> {
    DeviceSpec::parse(text, &DEVICE_KINDS).map_err(|error| error.to_string())
}

fn main() -> ExitCode {
    tutti_cli::init_stderr_logging();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return ExitCode::from(exit::report_parse_error(&error)),
    };
    let result = match &cli.status {
        Some(socket) => print_status(socket),
        None => serve(&cli),
    }
    .and_then(|()| Ok(tutti_cli::stdout::flush()?));
    exit::status_of("tuttid", result)
}

fn serve(cli: &Cli) -> Result<()> {
    // SIGTERM and SIGINT are taken by one thread with sigwait; they are blocked before any
    // other thread exists (the software controllers start in open_pool) so that every thread
    // inherits the mask and none is killed by them.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGTERM);
    signals.add(Signal::SIGINT);
    signals.thread_block().context("blocking SIGTERM and SIGINT")?;
    let cluster = cluster_settings(cli)?;
    let format = if cli.format {
        let model = cli.geometry.resolve(None).map_err(|error| Unusable(error.to_string()))?;
        let key_secret = cli.key_secret_file.as_deref().map(read_key_secret_file).transpose()?;
        if key_secret.is_none() && cluster.is_some() {
            // A fleet's start scripts from before key secrets format this way: each node would
            // get its own random secret and miss every other node's segments (shown only once
            // the node has joined: its join's comparison of the members' key secret tags, and
            // `tutti cluster status`). Said on stderr, as the secret file's warning is (tracing writes to
            // the same stderr: both would print it twice).
            tutti_cli::errln!(
                "warning: --format with --cluster-etcd and no --key-secret-file: this node's pool gets a random key secret and will share no segments with other nodes; format every node with one --key-secret-file (docs/cluster.md)"
            );
        }
        Some(FormatParams {
            blocks_per_slot: cli.blocks_per_slot,
            slot_count_max: cli.slots,
            payload_crc: cli.payload_crc,
            key_secret,
            ..FormatParams::new(model.geometry)
        })
    } else {
        None
    };
    let clients_max = cli.clients_max.unwrap_or(ServerConfig::CLIENTS_MAX_DEFAULT);
    // Before anything uses it (ServerConfig::validate checks it again).
    if clients_max > ServerConfig::CLIENTS_MAX {
        return Err(Unusable(format!(
            "--clients-max {} is over {}, the sessions one status reply can list",
            clients_max,
            ServerConfig::CLIENTS_MAX
        ))
        .into());
    }
    let options = PoolOptions {
        specs: cli.devices.clone(),
        namespace: cli.namespace,
        emu_lba_bytes: EMU_LBA_BYTES,
        emu_create_bytes: cli.emu_create_bytes,
        format,
        overwrite: cli.overwrite,
        lock_dir: cli.lock_dir.clone(),
        // One queue pair per client on each software controller (each is one pool device), and
        // in a cluster one for the data plane's staging area.
        // Within the u16 NVMe counts: `clients_max` was checked against CLIENTS_MAX above.
        client_queue_pairs: u16::try_from(clients_max + usize::from(cluster.is_some()))
            .map_err(|_| Unusable(format!("--clients-max {}: more queue pairs than a controller has", clients_max)))?,
        emu_doorbell_relay: cli.emu_doorbell_relay,
    };
    let socket = cli.socket.clone().context("--socket is required")?;
    let mut config = ServerConfig::new(socket.clone());
    config.lease = cli.lease;
    config.frame_timeout = cli.frame_timeout;
    config.clients_max = clients_max;
    // Chosen: refused if its worst case passes the descriptor limit; else lowered to fit.
    config.clients_max_explicit = cli.clients_max.is_some();
    config.metrics = cli.metrics.0;
    config.device_memory = match cli.device_memory {
        DeviceMemoryArg::Off => DeviceMemoryImport::Off,
        DeviceMemoryArg::Memfd => DeviceMemoryImport::Memfd,
        DeviceMemoryArg::Cuda => DeviceMemoryImport::Cuda,
    };
    config.cluster = cluster;
    // So that validation refuses a cluster manifest (or its .new / .lock) at a pool file.
    config.pool_devices = options.specs.clone();
    config.session_limits = SessionLimits {
        registrations_max: cli.windows_per_session,
        window_bytes_max: cli.window_bytes_per_session,
        requests_max: cli.requests_per_session.max(1),
        ..SessionLimits::default()
    };
    // Before the pool is opened (or formatted): a bad option, a socket a live daemon serves, a
    // metrics address taken (a second tuttid on the host takes the default port), device
    // memory this host cannot import or a cluster node's manifest or data address refused
    // (locked by another daemon, not a manifest, its directory missing, the address in use)
    // costs nothing, and "nothing was changed" is true.
    let prepared = Server::prepare(&config).map_err(classify)?;
    let opened = open_pool(&options).map_err(|error| classify_open(error, &options.specs))?;
    let report = opened.report;
    let server = Server::bind_prepared(config, prepared, opened).map_err(classify)?;
    if let Some(address) = server.metrics_address() {
        eprintln!("tuttid: metrics on http://{address}/metrics");
    }
    let stop = server.stop_handle();
    std::thread::Builder::new()
        .name("tuttid-signals".into())
        .spawn(move || {
            if let Ok(signal) = signals.wait() {
                eprintln!("tuttid: {signal}, draining");
            }
            stop.stop();
        })
        .context("starting the signal thread")?;
    eprintln!(
        "tuttid: serving {} (pid {}): {} slots, {} valid, {} cached blocks, {} corrupt headers",
        socket.display(),
        std::process::id(),
        report.slots,
        report.valid_slots,
        report.cached_blocks,
        report.corrupt_headers
    );
    let served = server.serve()?;
    let counts = served.opened.pool.index().counts();
    // Dropping the pool deletes its queue pairs and stops the controllers, then the locks go.
    drop(served.opened);
    eprintln!("tuttid: stopped after {} connections; {} cached blocks", served.connections_served, counts.cached_blocks);
    Ok(())
}

/// The LBA size of every `emu:` device's namespace: tuttid has no `--emu-lba-bytes` (nor does
/// the Python package's `Store.open`, or tutti-bench), so it serves only emu: pools formatted
/// with this size (`tutti pool format`'s default).
const EMU_LBA_BYTES: u32 = 4096;

/// [`classify`] for opening the pool. An `emu:` pool formatted with another LBA size (`tutti
/// pool format --emu-lba-bytes 512`) is sound, just not one tuttid can serve: said so, with what
/// reads it and what to format instead, not as a device that holds no pool.
fn classify_open(error: DaemonError, specs: &[DeviceSpec]) -> anyhow::Error {
    if let DaemonError::Pool { source: source @ objstore::ObjstoreError::LbaSizeMismatch { device, recorded, .. }, .. } = &error {
        if let Some(spec) = specs.get(*device).filter(|spec| spec.is_emulated()) {
            return Unusable(format!(
                "{spec}: {source}: tuttid serves only emu: pools of {EMU_LBA_BYTES}-byte LBAs (it has no --emu-lba-bytes; neither \
                 have the Python package's Store.open and tutti-bench), and this one was formatted with {recorded}-byte LBAs \
                 (only `tutti pool inspect|check --emu-lba-bytes {recorded}` read it): format it with `tutti pool format \
                 --emu-lba-bytes {EMU_LBA_BYTES}` (the default) or `tuttid --format`"
            ))
            .into();
        }
    }
    classify(error)
}

/// A device another daemon holds, a device string that cannot be opened, or a device without
/// a pool is unusable input (exit 2); a device that fails is a failure (exit 1).
fn classify(error: DaemonError) -> anyhow::Error {
    match error {
        // A vfio: SSD whose first bytes could not be read (to see what it holds) failed.
        error @ DaemonError::Devices(tutti_devices::DeviceError::NamespaceHead { .. }) => error.into(),
        DaemonError::Pool { ref source, .. } if !pool_input_unusable(source) => error.into(),
        error @ (DaemonError::DeviceInUse { .. }
        | DaemonError::SocketInUse { .. }
        | DaemonError::Devices(_)
        | DaemonError::Pool { .. }
        | DaemonError::DeviceMemory(_)
        | DaemonError::Config(_)) => Unusable(error.to_string()).into(),
        error => error.into(),
    }
}

/// Whether a pool error says what the devices hold, or what was asked of them, is wrong (exit 2:
/// the same command fails the same way until someone changes it). Any other is the device
/// failing (I/O, a timeout, DMA memory, a fence) or this host (memory): exit 1, which a
/// supervisor may retry; it may also have come after `--format` began writing.
fn pool_input_unusable(source: &objstore::ObjstoreError) -> bool {
    use objstore::ObjstoreError as E;
    matches!(
        source,
        E::InvalidGeometry { .. }
            | E::InvalidFormat { .. }
            | E::KeySecret { .. }
            | E::InvalidPoolShape { .. }
            | E::NamespaceTooSmall { .. }
            | E::CorruptSuperblock { .. }
            | E::LbaSizeMismatch { .. }
            | E::NewerFormatVersion { .. }
            | E::OlderFormatVersion { .. }
            | E::GeometryMismatch { .. }
            | E::PoolMembership { .. }
            | E::QueuePairs { .. }
    )
}

fn print_status(socket: &std::path::Path) -> Result<()> {
    let mut client = Client::connect(socket, Duration::from_secs(5))?;
    let status = client.status()?;
    print_report(&status)?;
    print_cluster(&client.cluster_status()?)
}

fn print_cluster(cluster: &ClusterStatusReply) -> Result<()> {
    if !cluster.enabled {
        outln!("cluster: not a cluster node")?;
        return Ok(());
    }
    outln!(
        "cluster {}: node {} (data address {}), {}, lease {:#x}; {} join(s), {} lease(s) lost",
        printable(&cluster.cluster),
        printable(&cluster.node),
        printable(&cluster.data_address),
        if cluster.joined { "joined" } else { "NOT JOINED" },
        cluster.lease_id,
        cluster.joins,
        cluster.lease_losses
    )?;
    outln!("{}", registry_line(cluster))?;
    outln!("{}", key_secret_line(cluster))?;
    outln!(
        "  segments of {} blocks: {} held, {} registered; {} registration(s) in {} transaction(s), {} unregistered",
        cluster.segment_blocks,
        cluster.segments_held,
        cluster.segments_registered,
        cluster.registered_segments,
        cluster.registration_transactions,
        cluster.unregistered_segments
    )?;
    outln!(
        "  {} registry error(s), {} commit(s) not registered (queue full), {} manifest error(s)",
        cluster.registry_errors,
        cluster.commits_dropped,
        cluster.manifest_errors
    )?;
    outln!(
        "  lookups: {} asked the registry ({} failed, {} not asked after a failure); {} block(s) found on other nodes",
        cluster.lookups,
        cluster.lookup_failures,
        cluster.lookups_skipped,
        cluster.remote_blocks_found
    )?;
    outln!(
        "  remote reads: {} ({} failed), {} block(s) fetched and stored here, {} registered as replicas (heavy hitters); {} segment(s) served to other nodes, {} read(s) refused",
        cluster.remote_reads,
        cluster.remote_read_failures,
        cluster.fetched_blocks,
        cluster.replicated_segments,
        cluster.served_segments,
        cluster.serve_refusals
    )?;
    if !cluster.last_error.is_empty() {
        outln!("  last registry error: {}", printable(&cluster.last_error))?;
    }
    Ok(())
}

/// `--status`'s registry line: how the registry answers and when etcd last confirmed the lease.
/// Before the first join `registry_silent_ms` counts from the start: no lease was confirmed.
fn registry_line(cluster: &ClusterStatusReply) -> String {
    let answer = match cluster.registry {
        RegistryAnswer::Answered => "answering",
        RegistryAnswer::Unavailable => "UNAVAILABLE (serving the local cache only)",
        RegistryAnswer::NotClustered => "not clustered",
    };
    let silent_ms = cluster.registry_silent_ms;
    if cluster.joins == 0 {
        format!("  registry: {answer} (no lease confirmed since the start {silent_ms} ms ago)")
    } else {
        format!("  registry: {answer} (lease last confirmed {silent_ms} ms ago)")
    }
}

/// `--status`'s key secret line: the pool's tag, and the members of another secret this node
/// saw after its last join (they share no segments with it; docs/cluster.md, "Running a fleet").
fn key_secret_line(cluster: &ClusterStatusReply) -> String {
    let tag = tutti_cluster::KeySecretTag::new(cluster.key_secret_tag);
    let members = match cluster.members_other_key_secret {
        _ if cluster.joins == 0 => "members not compared yet (not joined)".to_owned(),
        0 => "every member seen at the last join has it".to_owned(),
        count if count < 0 => "members NOT COMPARED: the member list could not be read".to_owned(),
        count => format!(
            "{count} member(s) seen at the last join have ANOTHER key secret and share no segments with this node (tutti cluster status names them)"
        ),
    };
    format!("  key secret {tag}: {members}")
}

fn print_report(status: &StatusReply) -> Result<()> {
    let shape = &status.shape;
    outln!("tuttid pid {}, up {} s", status.daemon_pid, status.uptime_ms / 1000)?;
    outln!(
        "model: {} layers, {} KV heads × {} × {} B, {} tokens per block, {} block(s) per slot",
        shape.layers,
        shape.kv_heads,
        shape.head_dim,
        shape.dtype_bytes,
        shape.block_tokens,
        shape.blocks_per_slot
    )?;
    outln!("devices:")?;
    for (index, device) in status.devices.iter().enumerate() {
        outln!("{}", device_line(device, status.metadata_fenced.get(index).copied().unwrap_or(false)))?;
    }
    let pool = &status.pool;
    // The counts come from the socket: a daemon (or a peer posing as one) may send any values,
    // so the arithmetic on them is checked; what does not compute is printed as unknown.
    let used = pool.slots.saturating_sub(pool.free_slots);
    let percent = if pool.slots == 0 { 0.0 } else { 100.0 * used as f64 / pool.slots as f64 };
    let cached_bytes =
        block_bytes(shape).and_then(|bytes| pool.cached_blocks.checked_mul(bytes)).map_or_else(|| "size unknown".into(), format_size);
    outln!(
        "pool: {used} of {} slots used ({percent:.1}%): {} valid, {} being written, {} pinned; {} cached blocks ({cached_bytes}); {} evictions",
        pool.slots,
        pool.valid_slots,
        pool.writing_slots,
        pool.pinned_slots,
        pool.cached_blocks,
        pool.evictions
    )?;
    outln!("connections: {}; clients: {}", status.connections, status.clients.len())?;
    for client in &status.clients {
        outln!("{}", client_line(client))?;
    }
    let relay = &status.relay;
    outln!(
        "doorbell relay: {} queue pair(s) relayed; {} doorbell(s) forwarded, {} dropped; {} polling passes",
        relay.queues,
        relay.forwarded,
        relay.dropped,
        relay.passes
    )?;
    if let Some(line) = leak_line(status) {
        outln!("{line}")?;
    }
    Ok(())
}

/// The LEAKED line of `--status`; `None` while nothing is kept for good. Any counter counts:
/// a session that ended by a panic without queue pairs keeps its windows and requests with
/// none leaked (`Holdings::leak`).
fn leak_line(status: &StatusReply) -> Option<String> {
    let kept = [status.leaked_queue_pairs, status.leaked_windows, status.leaked_window_bytes, status.leaked_requests];
    kept.iter().any(|&count| count > 0).then(|| {
        format!(
            "LEAKED (kept for good until tuttid restarts): {} client queue pair(s) not known deleted, {} window(s) ({}) still \
             mapped, {} request(s) still reserved",
            status.leaked_queue_pairs,
            status.leaked_windows,
            format_size(status.leaked_window_bytes),
            status.leaked_requests
        )
    })
}

/// One client session's line of `--status`.
fn client_line(client: &tutti_daemon::protocol::ClientStatus) -> String {
    format!(
        "  session {} pid {} uid {} '{}': TP rank {}/{}, {} requests, idle {} ms; {} window(s), {} queue pair(s), {} request(s) in flight; \
         {} doorbell(s) relayed, {} dropped{}",
        client.session,
        client.pid,
        client.uid,
        printable(&client.name),
        client.tp_rank,
        client.tp_world,
        client.requests,
        client.idle_ms,
        client.registrations,
        client.queue_pairs,
        client.requests_in_flight,
        client.doorbells_relayed,
        client.doorbells_dropped,
        if client.kept {
            "; ended, KEPT FOR GOOD: its queue pairs are not known deleted (never free its memory)"
        } else if client.retiring {
            "; ended, its queue pairs' deletion not confirmed yet (retried every tick; memory kept until then)"
        } else if client.awaiting_exit {
            "; ended, held until its process exits"
        } else {
            ""
        }
    )
}

/// One device's line of `--status`. A fenced device says so loudly: its stores fail as a full
/// pool while the pool line counts its slots free, and only a restart reopens it.
fn device_line(device: &tutti_daemon::protocol::DeviceStatus, metadata_fenced: bool) -> String {
    format!(
        "  {}: {} ({} commands refused by queue restrictions){}",
        printable(&device.spec),
        printable(&device.description),
        device.refused_commands,
        if metadata_fenced {
            "; METADATA FENCED: its header writes or flushes kept failing (or one stuck), so it takes no stores and its \
             free slots are not used: restart tuttid (after a controller reset if it stopped answering)"
        } else {
            ""
        }
    )
}

/// Bytes of one block of `shape` (K and V), or `None` if that does not fit a u64.
fn block_bytes(shape: &tutti_daemon::protocol::PoolShape) -> Option<u64> {
    [shape.layers, shape.kv_heads, shape.head_dim, shape.dtype_bytes, shape.block_tokens]
        .into_iter()
        .try_fold(2u64, |product, factor| product.checked_mul(u64::from(factor)))
}

#[cfg(test)]
mod tests {
    use tutti_daemon::protocol::PoolShape;

    use super::*;

    #[test]
    fn a_client_name_cannot_forge_or_erase_status_lines() {
        // Goal: a client names itself in Hello (any UTF-8 up to 64 bytes): a newline or an
        // escape sequence in it must not add a forged line to `--status` nor erase the warnings
        // after it ("KEPT FOR GOOD"); control characters are printed escaped, the rest as sent.
        let client = tutti_daemon::protocol::ClientStatus {
            session: 3,
            pid: 10,
            uid: 0,
            name: "x\nsession 9 pid 1: all fine\u{1b}[2K é".into(),
            tp_rank: 0,
            tp_world: 1,
            requests: 0,
            idle_ms: 0,
            registrations: 1,
            queue_pairs: 1,
            requests_in_flight: 0,
            doorbells_relayed: 0,
            doorbells_dropped: 0,
            awaiting_exit: false,
            kept: true,
            retiring: false,
        };
        let line = client_line(&client);
        assert!(!line.contains('\n') && !line.contains('\u{1b}'), "{line:?}");
        assert!(line.contains("'x\\nsession 9 pid 1: all fine\\u{1b}[2K é'"), "{line:?}");
        assert!(line.ends_with("KEPT FOR GOOD: its queue pairs are not known deleted (never free its memory)"), "{line:?}");
        assert_eq!(printable("plain ü"), "plain ü");
    }

    #[test]
    fn the_registry_line_says_no_lease_was_confirmed_before_the_first_join() {
        // Goal: before the first join `registry_silent_ms` counts from the start, not from a
        // lease etcd confirmed: "lease last confirmed N ms ago" claimed a confirmation that
        // never happened. Until a join, the line says none was.
        let mut cluster = ClusterStatusReply {
            enabled: true,
            registry: RegistryAnswer::Unavailable,
            registry_silent_ms: 1500,
            ..ClusterStatusReply::default()
        };
        let line = registry_line(&cluster);
        assert!(line.contains("no lease confirmed since the start 1500 ms ago"), "{line}");
        assert!(!line.contains("last confirmed"), "{line}");
        cluster.joins = 1;
        cluster.registry = RegistryAnswer::Answered;
        cluster.registry_silent_ms = 20;
        assert_eq!(registry_line(&cluster), "  registry: answering (lease last confirmed 20 ms ago)");
    }

    #[test]
    fn the_key_secret_line_names_the_tag_and_says_whether_members_of_another_secret_were_seen() {
        // Goal: a node whose pool has another secret than the others shares nothing with them,
        // and `--status` is where its operator looks first: the tag as `tutti pool inspect`
        // prints it, and what the last join's comparison found (nothing before a join; a
        // failed listing is not "all agree").
        let mut cluster = ClusterStatusReply { enabled: true, key_secret_tag: [0x0a, 0xb0, 0, 0xff], ..ClusterStatusReply::default() };
        assert_eq!(key_secret_line(&cluster), "  key secret 0ab000ff: members not compared yet (not joined)");
        cluster.joins = 1;
        assert!(key_secret_line(&cluster).ends_with(": every member seen at the last join has it"));
        cluster.members_other_key_secret = -1;
        assert!(key_secret_line(&cluster).contains("NOT COMPARED"));
        cluster.members_other_key_secret = 2;
        assert!(key_secret_line(&cluster).contains("2 member(s) seen at the last join have ANOTHER key secret"));
    }

    #[test]
    fn a_pool_that_fails_to_read_or_write_is_a_failure_and_one_that_holds_the_wrong_thing_is_unusable() {
        // Goal: exit 2 says "unusable input; nothing was changed" (a supervisor does not restart
        // on it), so a pool error is 2 only when what the devices hold (or what was asked) is
        // wrong; a device that failed, timed out or ran out of DMA memory reading the superblock
        // or headers, or writing a format, is exit 1, as the module doc says of device errors.
        // Before, every `DaemonError::Pool` was exit 2.
        let pool = |source| DaemonError::Pool { context: "opening the pool".into(), source };
        let unusable = |error: DaemonError| exit::is_unusable(classify(error).as_ref());
        let timeout = nvme_driver::NvmeError::Timeout {
            queue: nvme_driver::QueueId(1),
            command_id: nvme_driver::CommandId(3),
            waited_ms: 10_000,
            outstanding: 1,
        };
        for failed in [
            objstore::ObjstoreError::Nvme(timeout),
            objstore::ObjstoreError::Nvme(nvme_driver::NvmeError::DeviceGone),
            objstore::ObjstoreError::DeadlinePassed { what: "reading headers", done: 3 },
            objstore::ObjstoreError::MetadataFenced { device: 0, reason: "3 header syncs in a row failed".into() },
        ] {
            let message = failed.to_string();
            assert!(!unusable(pool(failed)), "{message} was classified unusable input");
        }
        for wrong in [
            objstore::ObjstoreError::CorruptSuperblock { device: 0, reason: "bad CRC".into() },
            objstore::ObjstoreError::PoolMembership { device: 1, reason: "another pool's device".into() },
            objstore::ObjstoreError::NewerFormatVersion { device: 0, found: 9, supported: 3, sealed: true },
            objstore::ObjstoreError::NamespaceTooSmall { device: 0, needed_bytes: 2 << 20, available_bytes: 1 << 20 },
            objstore::ObjstoreError::InvalidFormat { reason: "blocks_per_slot 0".into() },
        ] {
            let message = wrong.to_string();
            assert!(unusable(pool(wrong)), "{message} was classified a failure");
        }
    }

    #[test]
    fn a_fenced_device_is_printed_as_fenced_with_what_to_do() {
        // Goal: `--status` says which device the pool fenced and that a restart is the way out
        // (its stores fail as a full pool while its slots are counted free); a healthy device's
        // line says nothing of it.
        let device = tutti_daemon::protocol::DeviceStatus {
            spec: "emu:mem:64MiB".into(),
            description: "software NVMe controller".into(),
            refused_commands: 0,
        };
        let fenced = device_line(&device, true);
        assert!(fenced.contains("emu:mem:64MiB") && fenced.contains("METADATA FENCED") && fenced.contains("restart tuttid"), "{fenced}");
        assert!(!device_line(&device, false).contains("FENCED"));
    }

    /// A status reply of a daemon with `shape`, no devices, no connections, nothing leaked.
    fn status_with(shape: PoolShape) -> StatusReply {
        StatusReply {
            daemon_pid: 1,
            uptime_ms: 0,
            shape,
            devices: Vec::new(),
            metadata_fenced: Vec::new(),
            pool: Default::default(),
            connections: 0,
            clients: Vec::new(),
            leaked_queue_pairs: 0,
            leaked_windows: 0,
            leaked_window_bytes: 0,
            leaked_requests: 0,
            relay: Default::default(),
        }
    }

    #[test]
    fn a_status_reply_with_impossible_counts_prints_without_overflow() {
        // Goal: `--status` prints what the socket sent even when it cannot be true (more free
        // slots than slots, a shape whose block size overflows a u64) instead of panicking on
        // the arithmetic; a sound shape's block size is computed as before.
        let shape =
            PoolShape { layers: u32::MAX, kv_heads: u32::MAX, head_dim: u32::MAX, dtype_bytes: 2, block_tokens: 16, blocks_per_slot: 1 };
        assert_eq!(block_bytes(&shape), None);
        let sound = PoolShape { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16, blocks_per_slot: 1 };
        assert_eq!(block_bytes(&sound), Some(2 * 2 * 2 * 64 * 2 * 16));
        let status = StatusReply {
            pool: objstore::IndexCounts { slots: 1, free_slots: 5, cached_blocks: u64::MAX, ..Default::default() },
            connections: 1,
            ..status_with(shape)
        };
        print_report(&status).expect("printed");
    }

    #[test]
    fn the_leaked_line_is_printed_when_only_windows_or_requests_are_kept() {
        // Goal: a session that ended by a panic without queue pairs is kept for good with its
        // windows and requests (`Holdings::leak` with no pairs): `--status` must say so, though no
        // queue pair leaked. Nothing kept: no line.
        let sound = PoolShape { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16, blocks_per_slot: 1 };
        let mut status = status_with(sound);
        assert_eq!(leak_line(&status), None);
        status.leaked_windows = 1;
        status.leaked_window_bytes = 1 << 20;
        status.leaked_requests = 2;
        let line = leak_line(&status).expect("no LEAKED line for a window and two requests kept for good");
        assert_eq!(
            line,
            "LEAKED (kept for good until tuttid restarts): 0 client queue pair(s) not known deleted, 1 window(s) (1MiB) still \
             mapped, 2 request(s) still reserved"
        );
        print_report(&status).expect("printed");
    }
}
