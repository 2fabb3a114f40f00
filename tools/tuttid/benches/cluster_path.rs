//! The figures of the cluster tier (docs/cluster.md, "Measured on this machine"): two tuttid
//! processes on loopback, each over its own memory-backed software controller, one etcd member:
//!
//! - **retrieve bandwidth, local against remote**: node a holds the prompts. On a, a client
//!   retrieves a 64-block prompt (every layer). On b, `FetchRemote` reads the same prompt's two
//!   32-block segments from a over the data plane and stores them in b's pool, then the client
//!   retrieves them from b: the remote figure is bytes over (fetch + retrieve), the first
//!   retrieve after a remote read, as an engine sees it (each round a prompt b has never held);
//! - **lookup latency through etcd**: `LookupCluster` on b for a prompt only a holds (the local
//!   probe, one etcd round trip, the answer), against a plain `Lookup`, p50/p99;
//! - **registration cost per committed request**: a request of 64 new blocks (2 segments) —
//!   etcd transactions per request, and the time from the commit's answer until the registry
//!   lists both segments (the registrar's queue, its pass, one transaction), p50/p99; and the
//!   commit's own latency on a cluster node, against the same daemon outside a cluster (the
//!   registration must not be on the commit's path).
//!
//! Geometry: 8 layers, 8 KV heads × 128 dims, bf16, 16-token blocks (512 KiB per block), 32-block
//! segments. The software controllers copy memory on one thread each, and every process shares
//! this machine's CPUs: figures of the code paths, not of SSDs or a network.
//!
//! Run: `cargo bench -p tuttid --bench cluster_path` (etcd in PATH or `TUTTI_ETCD`). Without
//! `--bench` (as `cargo test --all-targets` runs it) every part runs briefly, as a smoke test;
//! with no etcd installed it says SKIPPED.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gio_uring::SmBudget;
use objstore::{KvRequest, LayerKvStore};
use tutti_cluster::local_etcd::LocalEtcd;
use tutti_cluster::{segments_of, ClusterClient, ClusterConfig, ClusterId, SegmentBlocks};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::keys::KeySpace;
use tutti_daemon::protocol::Hello;
use tutti_daemon::Client;

const TUTTID: &str = env!("CARGO_BIN_EXE_tuttid");
const BLOCKS: u32 = 64;
const SEGMENT_BLOCKS: u16 = 32;
const WAIT: Duration = Duration::from_secs(60);
/// Rounds per bandwidth figure, lookups, committed requests: full (`--bench`) and smoke sizes.
const ROUNDS: [u32; 2] = [8, 1];
const LOOKUPS: [usize; 2] = [1000, 20];
const COMMITS: [u32; 2] = [60, 3];

fn hello(name: &str) -> Hello {
    Hello { model_fingerprint: [0x42; 32], tp_rank: 0, tp_world: 1, client_name: name.into() }
}

fn tokens(seed: u32) -> Vec<u32> {
    (0..BLOCKS * 16).map(|i| i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(0x9E37_79B1)).collect()
}

/// The key secret of every node (one for the cluster: nodes find each other's segments by
/// block key), written to `key-secret` in the bench's directory.
const KEY_SECRET_HEX: &str = "be4c4be4c4be4c4be4c4be4c4be4c4be4c4be4c4be4c4be4c4be4c4be4c4be4c";

/// A tuttid on `emu:mem:SIZE` in `directory`, a cluster node when `etcd` is given.
fn start(directory: &Path, name: &str, etcd: Option<&LocalEtcd>) -> (Child, std::path::PathBuf) {
    let socket = directory.join(format!("{name}.sock"));
    let secret_file = directory.join("key-secret");
    std::fs::write(&secret_file, KEY_SECRET_HEX).unwrap();
    std::fs::set_permissions(&secret_file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let mut command = Command::new(TUTTID);
    command.args(["--device", "emu:mem:1g", "--format", "--socket"]).arg(&socket).arg("--lock-dir").arg(directory.join(name));
    command.arg("--key-secret-file").arg(&secret_file);
    command.args(["--layers", "8", "--kv-heads", "8", "--head-dim", "128", "--metrics", "off", "--clients-max", "4"]);
    if let Some(etcd) = etcd {
        command.args(["--cluster-etcd", &etcd.endpoints().join(","), "--cluster-id", "bench", "--node-id", name]);
        command.args(["--data-address", "127.0.0.1:0", "--segment-blocks", "32"]);
        command.arg("--cluster-state").arg(directory.join(format!("{name}.segments")));
    }
    let child = command.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("start tuttid");
    let deadline = Instant::now() + WAIT;
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "tuttid {name} did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, socket)
}

fn connect(socket: &Path, name: &str) -> RemoteKvStore {
    let config = RemoteConfig { kv_blocks: BLOCKS, queue_depth: 256, timeout: WAIT, ..RemoteConfig::default() };
    RemoteKvStore::connect(socket, &hello(name), &config).expect("remote store")
}

fn client(socket: &Path, name: &str) -> Client {
    let mut client = Client::connect(socket, WAIT).unwrap();
    client.hello(&hello(name)).unwrap();
    client
}

fn store_all(store: &mut RemoteKvStore, tokens: &[u32]) -> Duration {
    let ids: Vec<u32> = (0..BLOCKS).collect();
    let plan = store.prepare_store(&KvRequest { tokens, block_ids: &ids }).unwrap();
    for layer in 0..8 {
        store.store_layer(plan.handle, layer, SmBudget(1)).unwrap();
        store.wait(plan.handle, Instant::now() + WAIT).unwrap();
    }
    let started = Instant::now();
    store.commit_store(plan.handle).unwrap();
    started.elapsed()
}

/// Retrieves every layer of `tokens`' 64 blocks; the time it took.
fn retrieve_all(store: &mut RemoteKvStore, tokens: &[u32]) -> Duration {
    let ids: Vec<u32> = (0..BLOCKS).collect();
    let started = Instant::now();
    let handle = store.prepare_retrieve(&KvRequest { tokens, block_ids: &ids }).unwrap();
    for layer in 0..8 {
        store.retrieve_layer(handle, layer, SmBudget(1)).unwrap();
        store.wait(handle, Instant::now() + WAIT).unwrap();
    }
    store.finish(handle).unwrap();
    started.elapsed()
}

fn percentile(sorted: &[Duration], fraction: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * fraction).round() as usize]
}

fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "{what:<52} p50 {:>9.1} µs  p99 {:>9.1} µs  ({} samples)",
        percentile(&samples, 0.5).as_secs_f64() * 1e6,
        percentile(&samples, 0.99).as_secs_f64() * 1e6,
        samples.len()
    );
}

fn gib_per_s(bytes: u64, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / f64::from(1 << 30)
}

fn main() {
    if std::env::args().any(|arg| arg == "--list") {
        return;
    }
    let size = usize::from(!std::env::args().any(|arg| arg == "--bench"));
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let directory = tempfile::tempdir().unwrap();
    let (mut a, socket_a) = start(directory.path(), "a", Some(&etcd));
    let (mut b, socket_b) = start(directory.path(), "b", Some(&etcd));
    let (mut plain, socket_plain) = start(directory.path(), "plain", None);
    let mut config = ClusterConfig::new(etcd.endpoints(), ClusterId::new("bench").unwrap(), SegmentBlocks::new(SEGMENT_BLOCKS).unwrap());
    config.request_timeout = Duration::from_secs(3);
    let reader = ClusterClient::connect(config).unwrap();
    let secret = objstore::hash::KeySecret::from_hex(KEY_SECRET_HEX.as_bytes()).unwrap();
    let space = KeySpace::new(&hello("").model_fingerprint, 0, 1, &secret).unwrap();
    let segments = |seed: u32| {
        let mut keys = Vec::new();
        space.keys(&tokens(seed), 16, &mut keys);
        let mut segments = Vec::new();
        segments_of(&keys, SegmentBlocks::new(SEGMENT_BLOCKS).unwrap(), &mut segments).unwrap();
        segments
    };
    let registered = |seed: u32| reader.lookup(space.model(), &segments(seed)).is_ok_and(|lookup| lookup.prefix_segments() == 2);
    let block_bytes = 2 * 8 * 8 * 128 * 16 * 2u64;
    println!(
        "tuttid cluster path: 8 layers × 32 KiB objects (512 KiB blocks), {BLOCKS}-block prompts, {SEGMENT_BLOCKS}-block segments, \
         two nodes on loopback, memory-backed software controllers, one etcd member, {} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // Registration cost per committed request (and the commit against a daemon outside a cluster).
    let mut store_a = connect(&socket_a, "writer-a");
    let mut store_plain = connect(&socket_plain, "writer-plain");
    let transactions_before = client(&socket_a, "status").cluster_status().unwrap().registration_transactions;
    let (mut visible, mut commit_cluster, mut commit_plain) = (Vec::new(), Vec::new(), Vec::new());
    for seed in 1000..1000 + COMMITS[size] {
        commit_cluster.push(store_all(&mut store_a, &tokens(seed)));
        let committed = Instant::now();
        while !registered(seed) {
            assert!(committed.elapsed() < WAIT, "prompt {seed} never registered");
        }
        visible.push(committed.elapsed());
        commit_plain.push(store_all(&mut store_plain, &tokens(seed)));
    }
    let transactions = client(&socket_a, "status").cluster_status().unwrap().registration_transactions - transactions_before;
    println!("registration: {} etcd transaction(s) for {} committed requests of 2 new segments", transactions, COMMITS[size]);
    report("commit (flush + FUA headers), cluster node", commit_cluster);
    report("commit, the same daemon outside a cluster", commit_plain);
    report("commit answered → both segments listed by etcd", visible);

    // Lookup latency through etcd: b holds nothing of a's prompts.
    let mut on_b = client(&socket_b, "lookups");
    // The last committed prompt: earlier ones may have been evicted from a's pool.
    let probe = tokens(1000 + COMMITS[size] - 1);
    let (mut cluster, mut local) = (Vec::new(), Vec::new());
    for _ in 0..LOOKUPS[size] {
        let started = Instant::now();
        let answer = on_b.lookup_cluster(&probe).unwrap();
        cluster.push(started.elapsed());
        assert_eq!((answer.cached_blocks, answer.remote_blocks), (0, BLOCKS));
        let started = Instant::now();
        assert_eq!(on_b.lookup(&probe).unwrap(), 0);
        local.push(started.elapsed());
    }
    report("LookupCluster on b (64 blocks held by a: 1 etcd round trip)", cluster);
    report("Lookup on b (local only)", local);

    // Retrieve bandwidth: local on a, remote (fetch + retrieve) on b.
    let mut store_b = connect(&socket_b, "reader-b");
    let bytes = u64::from(BLOCKS) * block_bytes;
    let (mut local_time, mut fetch_time, mut after_time) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let (mut fetches, mut retrieves_after) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS[size] {
        let seed = 5000 + round;
        store_all(&mut store_a, &tokens(seed));
        while !registered(seed) {}
        local_time += retrieve_all(&mut store_a, &tokens(seed));
        let started = Instant::now();
        assert_eq!(on_b.fetch_remote(&tokens(seed)).unwrap(), (BLOCKS, BLOCKS));
        let fetched = started.elapsed();
        let retrieved = retrieve_all(&mut store_b, &tokens(seed));
        fetch_time += fetched;
        after_time += retrieved;
        fetches.push(fetched);
        retrieves_after.push(retrieved);
    }
    let rounds = u64::from(ROUNDS[size]);
    println!("retrieve bandwidth, {} rounds of {} MiB:", rounds, bytes >> 20);
    println!("  local retrieve on a                         {:>7.2} GiB/s", gib_per_s(rounds * bytes, local_time));
    println!(
        "  remote on b: fetch (TCP + store in b's pool) {:>7.2} GiB/s; then b's local retrieve {:>7.2} GiB/s; together {:>7.2} GiB/s",
        gib_per_s(rounds * bytes, fetch_time),
        gib_per_s(rounds * bytes, after_time),
        gib_per_s(rounds * bytes, fetch_time + after_time)
    );
    report("  FetchRemote of 64 blocks (2 segments)", fetches);
    report("  retrieve on b after the fetch", retrieves_after);

    for child in [&mut a, &mut b, &mut plain] {
        let _ = child.kill();
        let _ = child.wait();
    }
}
