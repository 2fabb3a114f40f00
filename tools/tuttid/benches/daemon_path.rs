//! The figures of the store path through tuttid (docs/tuttid.md, "Figures"), in one run on one
//! machine, over a memory-backed software controller running inside the daemon:
//!
//! - the per-request round trip to the daemon: `lookup` + `prepare_retrieve`, `lookup` +
//!   `prepare_store`, and `commit_store` (flush + header with FUA), p50/p99 over 300 requests;
//! - the per-layer issue cost (`retrieve_layer`, 64 blocks) through a `RemoteKvStore` and
//!   through an in-process `KvStore` (same `StoreData` code: it should match, since the client
//!   sends nothing per layer);
//! - aggregate retrieve bandwidth with 1, 2 and 4 client processes on the one emulated device,
//!   against one in-process store on an emulated device of its own.
//!
//! Geometry: 8 layers, 8 KV heads × 128 dims, bf16, 16-token blocks (32 KiB objects, 512 KiB
//! per block), 64 blocks per request. The software controller copies memory on its one
//! thread, so bandwidth here is the emulator's memcpy rate shared by every queue, not an SSD's.
//!
//! Run: `cargo bench -p tuttid --bench daemon_path`. Client processes are this binary run
//! again with `TUTTID_BENCH_CHILD` set. Without `--bench` (as `cargo test --all-targets` runs
//! it) every part runs briefly, as a smoke test of the bench itself.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gio_uring::{CpuExecutor, SmBudget};
use nvme_driver::hw::DeviceBackend;
use nvme_driver::{Controller, ControllerConfig, DataPointerMode, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};
use objstore::{
    cpu_executor_for, format_pool, FormatParams, KvLayout, KvRegistration, KvRequest, KvStore, LayerKvStore, ModelGeometry, Pool,
    PoolTarget, StoreConfig,
};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::protocol::Hello;

const TUTTID: &str = env!("CARGO_BIN_EXE_tuttid");
const CHILD_ENV: &str = "TUTTID_BENCH_CHILD";
const BLOCKS: u32 = 64;
/// Requests per round-trip figure, issue samples per batch, seconds per bandwidth figure:
/// full (`--bench`) and smoke-test sizes.
const REQUESTS: [usize; 2] = [300, 10];
const ISSUES: [usize; 2] = [200, 10];
const BANDWIDTH_SECONDS: [u64; 2] = [3, 1];
const WAIT: Duration = Duration::from_secs(30);

fn geometry() -> ModelGeometry {
    ModelGeometry { layers: 8, kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_tokens: 16 }
}

fn tokens(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect()
}

fn hello(name: &str) -> Hello {
    Hello { model_fingerprint: [0x42; 32], tp_rank: 0, tp_world: 1, client_name: name.into() }
}

fn connect(socket: &Path, name: &str) -> RemoteKvStore {
    let config = RemoteConfig { kv_blocks: BLOCKS, queue_depth: 256, ..RemoteConfig::default() };
    RemoteKvStore::connect(socket, &hello(name), &config).expect("remote store")
}

/// Stores `tokens`' blocks from engine blocks 0.. through any layer-wise store.
fn store_all(store: &mut dyn LayerKvStore, tokens: &[u32], blocks: u32) {
    let ids: Vec<u32> = (0..blocks).collect();
    let plan = store.prepare_store(&KvRequest { tokens, block_ids: &ids }).unwrap();
    for layer in 0..geometry().layers {
        store.store_layer(plan.handle, layer, SmBudget(1)).unwrap();
        store.wait(plan.handle, Instant::now() + WAIT).unwrap();
    }
    store.commit_store(plan.handle).unwrap();
}

/// Retrieves the cached `tokens` (all layers) `rounds` times or until `until`; returns bytes.
fn retrieve_loop(store: &mut dyn LayerKvStore, tokens: &[u32], until: Instant) -> u64 {
    let ids: Vec<u32> = (0..BLOCKS).collect();
    let handle = store.prepare_retrieve(&KvRequest { tokens, block_ids: &ids }).unwrap();
    let mut bytes = 0u64;
    let per_layer = u64::from(BLOCKS) * 2 * geometry().object_bytes();
    while Instant::now() < until {
        for layer in 0..geometry().layers {
            store.retrieve_layer(handle, layer, SmBudget(1)).unwrap();
            store.wait(handle, Instant::now() + WAIT).unwrap();
            bytes += per_layer;
        }
    }
    store.finish(handle).unwrap();
    bytes
}

/// The time one `retrieve_layer` call takes (issue only), over `rounds` layers: sorted samples.
fn issue_samples(store: &mut dyn LayerKvStore, tokens: &[u32], rounds: usize) -> Vec<Duration> {
    let ids: Vec<u32> = (0..BLOCKS).collect();
    let handle = store.prepare_retrieve(&KvRequest { tokens, block_ids: &ids }).unwrap();
    let mut samples = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let layer = round as u32 % geometry().layers;
        let started = Instant::now();
        store.retrieve_layer(handle, layer, SmBudget(1)).unwrap();
        samples.push(started.elapsed());
        store.wait(handle, Instant::now() + WAIT).unwrap();
    }
    store.finish(handle).unwrap();
    samples.sort();
    samples
}

fn percentile(sorted: &[Duration], fraction: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * fraction).round() as usize;
    sorted[index].as_secs_f64() * 1e6
}

fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "{what:<44} p50 {:>8.1} µs  p99 {:>8.1} µs  min {:>8.1} µs  ({} samples)",
        percentile(&samples, 0.5),
        percentile(&samples, 0.99),
        percentile(&samples, 0.0),
        samples.len()
    );
}

/// An in-process `KvStore` on its own memory-backed software controller, same geometry and
/// registration layout as the clients'.
struct InProcess {
    store: KvStore<CpuExecutor>,
    _engine: nvme_driver::DmaRegion,
    _device: Arc<EmuDevice>,
}

fn in_process() -> InProcess {
    let geometry = geometry();
    let slots = 4 * u64::from(BLOCKS) + 8;
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: slots * geometry.block_bytes() + (64 << 20) })
        .with_namespaces(vec![NamespaceConfig::new(4096, None)])
        .with_mdts(8);
    let device = EmuDevice::start(config).unwrap();
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default()).unwrap());
    let targets = vec![PoolTarget { controller: controller.clone(), namespace: NamespaceId(1) }];
    let params = FormatParams { slot_count_max: Some(slots), ..FormatParams::new(geometry) };
    format_pool(&targets, &params).unwrap();
    let (pool, _) = Pool::open(targets, Some(&geometry)).unwrap();
    let block_bytes = 2 * u64::from(geometry.layers) * geometry.object_bytes();
    let engine = controller.dma().allocate((block_bytes * u64::from(BLOCKS)) as usize).unwrap();
    let layout = KvLayout::BlockMajor { base: engine.iova(), block_stride_bytes: block_bytes };
    let registration = KvRegistration::new(geometry, BLOCKS, layout, DataPointerMode::Sgl).unwrap();
    let store_config = StoreConfig::default();
    let executor = cpu_executor_for(&pool, 256, &store_config).unwrap();
    let store = KvStore::new(pool, registration, controller.dma().clone(), executor, store_config).unwrap();
    InProcess { store, _engine: engine, _device: device }
}

fn start_daemon(directory: &Path) -> (Child, PathBuf) {
    let socket = directory.join("tuttid.sock");
    let mut command = Command::new(TUTTID);
    command.args(["--device", "emu:mem:1g", "--format", "--metrics", "off", "--socket"]).arg(&socket);
    command.args(["--lock-dir"]).arg(directory.join("locks"));
    command.args(["--layers", "8", "--kv-heads", "8", "--head-dim", "128", "--slots", "600"]);
    let mut child = command.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("start tuttid");
    let deadline = Instant::now() + WAIT;
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(child.try_wait().unwrap().is_none(), "tuttid exited");
        assert!(Instant::now() < deadline, "tuttid did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, socket)
}

fn epoch_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// A client process: waits for the start time, retrieves the cached prompt until the end
/// time, prints the bytes it moved.
fn child(role: &str) {
    let words: Vec<&str> = role.split(' ').collect();
    let socket = Path::new(words[0]);
    let (start_ms, seconds): (u64, u64) = (words[1].parse().unwrap(), words[2].parse().unwrap());
    let mut store = connect(socket, "bench-client");
    let cached = tokens(1, BLOCKS);
    assert_eq!(store.lookup(&cached), BLOCKS as usize);
    while epoch_ms() < start_ms {
        std::thread::sleep(Duration::from_millis(1));
    }
    let started = Instant::now();
    let bytes = retrieve_loop(&mut store, &cached, started + Duration::from_secs(seconds));
    println!("BYTES {bytes} {}", started.elapsed().as_secs_f64());
}

fn main() {
    if let Ok(role) = std::env::var(CHILD_ENV) {
        child(&role);
        return;
    }
    if std::env::args().any(|arg| arg == "--list") {
        return; // `cargo test --benches` lists; nothing to list
    }
    let size = usize::from(!std::env::args().any(|arg| arg == "--bench"));
    let directory = tempfile::tempdir().unwrap();
    let (mut daemon, socket) = start_daemon(directory.path());
    let mut remote = connect(&socket, "bench");
    let mut local = in_process();
    let cached = tokens(1, BLOCKS);
    store_all(&mut remote, &cached, BLOCKS);
    store_all(&mut local.store, &cached, BLOCKS);
    println!(
        "tuttid store path, {} layers × {} KiB objects, {BLOCKS} blocks/request, memory-backed software controller, {} CPUs",
        geometry().layers,
        geometry().object_bytes() >> 10,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // Per-request round trips.
    let ids: Vec<u32> = (0..BLOCKS).collect();
    let (mut retrieve, mut store, mut commit) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..REQUESTS[size] {
        let started = Instant::now();
        assert_eq!(remote.lookup(&cached), BLOCKS as usize);
        let handle = remote.prepare_retrieve(&KvRequest { tokens: &cached, block_ids: &ids }).unwrap();
        retrieve.push(started.elapsed());
        remote.finish(handle).unwrap();
        // A fresh one-block prompt: lookup + prepare_store, its layers, then the commit.
        let fresh = tokens(1000 + round as u32, 1);
        let started = Instant::now();
        assert_eq!(remote.lookup(&fresh), 0);
        let plan = remote.prepare_store(&KvRequest { tokens: &fresh, block_ids: &[0] }).unwrap();
        store.push(started.elapsed());
        for layer in 0..geometry().layers {
            remote.store_layer(plan.handle, layer, SmBudget(1)).unwrap();
            remote.wait(plan.handle, Instant::now() + WAIT).unwrap();
        }
        let started = Instant::now();
        remote.commit_store(plan.handle).unwrap();
        commit.push(started.elapsed());
    }
    report("lookup + prepare_retrieve (64 blocks), client", retrieve);
    report("lookup + prepare_store (1 block), client", store);
    report("commit_store (1 block: flush + FUA header)", commit);

    // Per-layer issue cost, same run, interleaved so that both see the same machine.
    let (mut through_client, mut in_proc) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let sent = remote.requests_sent();
        through_client.extend(issue_samples(&mut remote, &cached, ISSUES[size]));
        // prepare_retrieve + finish are the only requests: two per batch, none per layer.
        assert_eq!(remote.requests_sent() - sent, 2, "requests sent per layer");
        in_proc.extend(issue_samples(&mut local.store, &cached, ISSUES[size]));
    }
    report("retrieve_layer issue (64 blocks), client", through_client);
    report("retrieve_layer issue (64 blocks), in-process", in_proc);
    drop(remote);

    // Aggregate retrieve bandwidth.
    let seconds = BANDWIDTH_SECONDS[size];
    let until = Instant::now() + Duration::from_secs(seconds);
    let bytes = retrieve_loop(&mut local.store, &cached, until);
    println!("retrieve bandwidth, in-process (own device):     {:>8.0} MiB/s", bytes as f64 / seconds as f64 / (1 << 20) as f64);
    for clients in [1usize, 2, 4] {
        let start_ms = epoch_ms() + 1500;
        let mut children: Vec<Child> = (0..clients)
            .map(|_| {
                Command::new(std::env::current_exe().unwrap())
                    .env(CHILD_ENV, format!("{} {start_ms} {seconds}", socket.display()))
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut total = 0u64;
        let mut longest = 0f64;
        for child in &mut children {
            let stdout = child.stdout.take().unwrap();
            for line in BufReader::new(stdout).lines() {
                let line = line.unwrap();
                if let Some(rest) = line.strip_prefix("BYTES ") {
                    let mut parts = rest.split(' ');
                    total += parts.next().unwrap().parse::<u64>().unwrap();
                    longest = longest.max(parts.next().unwrap().parse::<f64>().unwrap());
                }
            }
            assert!(child.wait().unwrap().success());
        }
        println!("retrieve bandwidth, {clients} client process(es), one device: {:>8.0} MiB/s", total as f64 / longest / (1 << 20) as f64);
    }
    let _ = daemon.kill();
    let _ = daemon.wait();
}
