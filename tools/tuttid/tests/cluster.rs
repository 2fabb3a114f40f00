//! tuttid as a cluster node against a real etcd (`LocalEtcd`, loopback): a node joins at start,
//! registers the segments its commits complete (after the commit), unregisters what eviction
//! breaks, leaves on SIGTERM, vanishes within its lease after SIGKILL, and registers again what
//! survived after a restart and after a lost lease; etcd's absence never fails or slows a commit.
//! Every wait is bounded. Skipped (with a note) where no etcd is installed, unless
//! TUTTI_REQUIRE_ETCD=1 (the cluster stage of tools/test.sh).

use std::path::{Path, PathBuf};

use gio_uring::SmBudget;
use objstore::{KvRequest, LayerKvStore};
use std::time::{Duration, Instant};

use tutti_cluster::local_etcd::LocalEtcd;
use tutti_cluster::{
    segments_of, ClusterClient, ClusterConfig, ClusterId, ClusterNode, MemberRecord, ModelSpace, NodeId, Segment, SegmentBlocks,
};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::keys::KeySpace;
use tutti_daemon::protocol::{ClusterStatusReply, RegistryAnswer, RemoteHolder};
use tutti_daemon::{DaemonError, ErrorCode};

mod common;
use common::{hello, store_prompt, Daemon};

const CLUSTER: &str = "wire";
const SEGMENT_BLOCKS: u16 = 16;
const BLOCK_TOKENS: u32 = 16;
/// Blocks each prompt stores: two full segments and a partial one (never registered).
const PROMPT_BLOCKS: usize = 40;
const LEASE: Duration = Duration::from_secs(2);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(1);
/// Pool slots (one block each): room for one prompt and 8 blocks more, so a second prompt
/// evicts most of the first.
const SLOTS: &str = "48";
/// Longest wait for something the registrar does within a pass or a few (a tick is 50 ms; a
/// failed call backs off at most half the lease).
const SOON: Duration = Duration::from_secs(10);

/// One node's directory (socket, pool file, segment manifest) and its daemon.
struct Node {
    name: &'static str,
    directory: PathBuf,
    daemon: Option<Daemon>,
    /// `--cluster-lease` and `--cluster-timeout`.
    lease: &'static str,
    timeout: &'static str,
    /// More options for `--format` (e.g. `--payload-crc`).
    format_extra: Vec<&'static str>,
    /// More daemon options, on every start (e.g. a short client `--lease`).
    extra: Vec<&'static str>,
    /// `--data-address` (a free port by default; a fixed one to restart on the same address).
    data_address: String,
}

impl Node {
    fn new(root: &Path, name: &'static str) -> Node {
        let directory = root.join(name);
        std::fs::create_dir_all(&directory).unwrap();
        Node {
            name,
            directory,
            daemon: None,
            lease: "2s",
            timeout: "1s",
            format_extra: Vec::new(),
            extra: Vec::new(),
            data_address: "127.0.0.1:0".into(),
        }
    }

    fn device(&self) -> String {
        format!("emu:{}", self.directory.join("pool").display())
    }

    /// Starts the daemon (formatting a fresh pool when `format`) as node `name` of `etcd`.
    fn start(&mut self, etcd: &LocalEtcd, format: bool) {
        let endpoints = etcd.endpoints().join(",");
        let manifest = self.directory.join("segments").display().to_string();
        let mut args = vec![
            "--cluster-etcd",
            &endpoints,
            "--cluster-id",
            CLUSTER,
            "--node-id",
            self.name,
            "--data-address",
            &self.data_address,
            "--cluster-state",
            &manifest,
            "--segment-blocks",
            "16",
            "--cluster-lease",
            self.lease,
            "--cluster-timeout",
            self.timeout,
        ];
        if format {
            args.extend(["--format", "--emu-create-bytes", "64m", "--slots", SLOTS]);
            args.extend(self.format_extra.iter().copied());
        }
        args.extend(self.extra.iter().copied());
        self.daemon = Some(Daemon::start(&self.directory, &self.device(), &args));
    }

    fn daemon(&self) -> &Daemon {
        self.daemon.as_ref().expect("the node's daemon runs")
    }

    fn status(&self) -> ClusterStatusReply {
        self.daemon().client().cluster_status().expect("cluster status")
    }

    fn connect(&self) -> RemoteKvStore {
        let config = RemoteConfig { kv_blocks: 2 * PROMPT_BLOCKS as u32, ..RemoteConfig::default() };
        RemoteKvStore::connect(&self.daemon().socket, &hello(0, 1, "cluster-test"), &config).expect("attach a remote store")
    }

    fn kill(&mut self) {
        let mut daemon = self.daemon.take().expect("the node's daemon runs");
        let mut child = daemon.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

fn reader(etcd: &LocalEtcd) -> ClusterClient {
    let mut config = ClusterConfig::new(etcd.endpoints(), ClusterId::new(CLUSTER).unwrap(), SegmentBlocks::new(SEGMENT_BLOCKS).unwrap());
    config.lease_ttl = LEASE;
    config.request_timeout = REQUEST_TIMEOUT;
    ClusterClient::connect(config).unwrap()
}

/// The key space the test clients attach with (`common::hello(0, 1, …)`).
fn space() -> KeySpace {
    KeySpace::new(&hello(0, 1, "").model_fingerprint, 0, 1).unwrap()
}

fn model() -> ModelSpace {
    *space().model()
}

/// The full segments of prompt `seed` (as `common::store_prompt` stores it).
fn segments(seed: u32) -> Vec<Segment> {
    let tokens = common::prompt(seed, PROMPT_BLOCKS, BLOCK_TOKENS);
    let mut keys = Vec::new();
    space().keys(&tokens, BLOCK_TOKENS, &mut keys);
    let mut segments = Vec::new();
    segments_of(&keys, SegmentBlocks::new(SEGMENT_BLOCKS).unwrap(), &mut segments).unwrap();
    assert_eq!(segments.len(), PROMPT_BLOCKS / usize::from(SEGMENT_BLOCKS));
    segments
}

/// The nodes the registry lists for each segment of prompt `seed` (up to the first miss).
fn holders(reader: &ClusterClient, seed: u32) -> Vec<Vec<String>> {
    let lookup = reader.lookup(&model(), &segments(seed)).expect("lookup");
    lookup.holders.iter().map(|nodes| nodes.iter().map(|node| node.to_string()).collect()).collect()
}

fn members(reader: &ClusterClient) -> Vec<String> {
    reader.members().expect("members").nodes.iter().map(|record| record.node.to_string()).collect()
}

/// Polls `condition` every 20 ms for up to `timeout`; the time it took, or a panic naming `what`.
fn wait_for(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !condition() {
        assert!(started.elapsed() < timeout, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    started.elapsed()
}

fn store(node: &Node, seed: u32) {
    let mut store = node.connect();
    assert_eq!(store_prompt(&mut store, seed, 0, PROMPT_BLOCKS).expect("store and commit"), PROMPT_BLOCKS);
}

#[test]
fn a_node_registers_commits_unregisters_evictions_leaves_and_comes_back() {
    // Goal: the whole life of one node in the registry. Joined at start (its record: the data
    // address, the pool's capacity); a commit's two full segments registered (the partial tail
    // not), and the model's fingerprint added to its record; a second prompt that evicts most
    // of the first unregisters the first's segments; SIGTERM removes the node and its segments
    // at once; a restart registers again, from the manifest, the segments whose blocks
    // survived (only the second prompt's); SIGKILL: gone within the lease; a restart right
    // after a SIGKILL waits out the dead lease (the id is taken) and then registers again.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut node = Node::new(root.path(), "a");
    node.start(&etcd, true);
    wait_for("node a joins", SOON, || members(&reader) == ["a"]);
    let record = reader.members().unwrap().nodes.remove(0);
    assert_eq!(record.address, node.status().data_address, "the record carries the bound data address");
    assert!(!record.address.ends_with(":0"), "{record:?}");
    // 48 slots of one block of 2 layers × K and V × 2 heads × 64 dims × 16 tokens × 2 bytes.
    assert_eq!(record.capacity_bytes, 48 * 16 * 1024);
    assert!(record.fingerprints.is_empty(), "no segments held yet: {record:?}");

    store(&node, 1);
    wait_for("prompt 1's segments are registered", SOON, || holders(&reader, 1) == [["a"], ["a"]]);
    let status = node.status();
    assert!(status.enabled && status.joined, "{status:?}");
    assert_eq!((status.segments_held, status.segments_registered, status.registered_segments), (2, 2, 2));
    assert_eq!(status.registration_transactions, 1, "one committed request, one transaction");
    wait_for("the record lists the model", SOON, || reader.members().unwrap().nodes[0].fingerprints == [*model().fingerprint()]);

    store(&node, 2);
    wait_for("prompt 2 registered, prompt 1 (evicted) unregistered", SOON, || {
        holders(&reader, 2) == [["a"], ["a"]] && holders(&reader, 1).is_empty()
    });
    let status = node.status();
    assert_eq!((status.segments_held, status.unregistered_segments), (2, 2), "{status:?}");

    let (exit, stderr) = node.daemon.take().unwrap().terminate();
    assert!(exit.success(), "{exit}: {stderr}");
    assert!(members(&reader).is_empty(), "a node that left is still listed");
    assert!(holders(&reader, 2).is_empty(), "a node that left still holds segments");

    node.start(&etcd, false);
    wait_for("the restarted node registers what survived", SOON, || holders(&reader, 2) == [["a"], ["a"]]);
    assert!(holders(&reader, 1).is_empty(), "evicted before the restart: never registered again");
    assert_eq!(node.status().segments_held, 2);

    node.kill();
    let vanished = wait_for("a killed node vanishes within its lease", LEASE + Duration::from_secs(4), || {
        members(&reader).is_empty() && holders(&reader, 2).is_empty()
    });
    eprintln!("a SIGKILLed node vanished after {vanished:?} (lease {LEASE:?})");

    node.start(&etcd, false);
    wait_for("registered again", SOON, || holders(&reader, 2) == [["a"], ["a"]]);
    node.kill();
    // At once: the dead process's lease still holds the id.
    node.start(&etcd, false);
    wait_for("registered again after the dead lease expired", LEASE + SOON, || {
        holders(&reader, 2) == [["a"], ["a"]] && node.status().joined
    });
    let status = node.status();
    assert!(status.registry_errors >= 1 && status.last_error.contains("already registered"), "{status:?}");
    let (exit, stderr) = node.daemon.take().unwrap().terminate();
    assert!(exit.success(), "{exit}: {stderr}");
}

#[test]
fn a_store_is_registered_only_once_committed() {
    // Goal: a store whose every layer is written but which is not committed is never
    // registered (its blocks are not in the index: nothing to serve), nor one that is
    // released; the same store committed is registered.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut node = Node::new(root.path(), "d");
    node.start(&etcd, true);
    wait_for("node d joins", SOON, || members(&reader) == ["d"]);
    let mut store = node.connect();
    let tokens = common::prompt(7, PROMPT_BLOCKS, BLOCK_TOKENS);
    let block_ids: Vec<u32> = (0..PROMPT_BLOCKS as u32).collect();
    let deadline = Instant::now() + common::WAIT;
    let written = |store: &mut RemoteKvStore| {
        let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &block_ids }).unwrap();
        for layer in 0..2 {
            store.store_layer(plan.handle, layer, SmBudget(1)).unwrap();
            store.wait(plan.handle, deadline).unwrap();
        }
        plan.handle
    };
    let released = written(&mut store);
    store.finish(released).unwrap();
    let handle = written(&mut store);
    // Ten registrar passes.
    std::thread::sleep(Duration::from_millis(500));
    assert!(holders(&reader, 7).is_empty(), "registered before the commit");
    assert_eq!(node.status().segments_held, 0);
    store.commit_store(handle).unwrap();
    wait_for("registered after the commit", SOON, || holders(&reader, 7) == [["d"], ["d"]]);
}

#[test]
fn the_registry_being_away_never_fails_or_slows_a_commit() {
    // Goal: with etcd killed, stores commit as fast as ever, also while the registrar is stuck
    // in a registry call (here 3 s, its request timeout: the second store commits during the
    // first one's registration attempt); their segments are held and wait; the failures are
    // counted and shown in status; once etcd is back (with its data: the node's lease survived,
    // or expired and the node rejoins) they are registered. Prompt 6 evicts most of prompt 5
    // meanwhile: only prompt 6 is registered.
    let Some(mut etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut node = Node::new(root.path(), "b");
    (node.lease, node.timeout) = ("6s", "3s");
    node.start(&etcd, true);
    wait_for("node b joins", SOON, || members(&reader) == ["b"]);
    etcd.kill(0).unwrap();
    for seed in [5, 6] {
        let started = Instant::now();
        store(&node, seed);
        let took = started.elapsed();
        eprintln!("store and commit of prompt {seed} with etcd down: {took:?}");
        assert!(took < Duration::from_secs(1), "a commit waited on the registry: {took:?}");
    }
    wait_for("the failures are counted", SOON, || node.status().registry_errors >= 1);
    let status = node.status();
    assert_eq!((status.segments_held, status.segments_registered), (2, 0), "{status:?}");
    assert!(!status.last_error.is_empty());
    etcd.restart(0).unwrap();
    wait_for("registered once etcd is back", Duration::from_secs(6) + SOON, || holders(&reader, 6) == [["b"], ["b"]]);
    assert!(holders(&reader, 5).is_empty());
    let status = node.status();
    assert!(status.joined && status.segments_registered == 2, "{status:?}");
}

#[test]
fn a_lost_lease_is_rejoined_and_every_held_segment_registered_again() {
    // Goal: when etcd drops the node's lease behind its back (revoked here, as an expiry during
    // a partition would), the node notices, rejoins under a new lease and registers again
    // every segment it holds; status counts the loss and the second join.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut node = Node::new(root.path(), "c");
    node.start(&etcd, true);
    store(&node, 4);
    wait_for("registered", SOON, || holders(&reader, 4) == [["c"], ["c"]]);
    let old_lease = node.status().lease_id;
    etcd.revoke_lease(old_lease as i64).unwrap();
    assert!(holders(&reader, 4).is_empty(), "revoking the lease removes the node's segments");
    wait_for("rejoined and registered again", LEASE + SOON, || holders(&reader, 4) == [["c"], ["c"]]);
    let status = node.status();
    assert_ne!(status.lease_id, old_lease);
    assert_eq!((status.joins, status.lease_losses, status.segments_registered), (2, 1, 2), "{status:?}");
    assert_eq!(members(&reader), ["c"]);
}

#[test]
fn a_cluster_lookup_finds_what_other_nodes_hold_past_the_local_prefix_in_one_round_trip() {
    // Goal: node a holds a prompt's two segments. On node b, `LookupCluster` answers the local
    // prefix exactly as `Lookup` does, and the 32 blocks a holds; once b holds 20 blocks
    // itself, the 12 past them (segment 1, fetched whole); on a, nothing is asked (no full
    // segment past its prefix). Each lookup that asks is one etcd request, counted by etcd.
    // With etcd killed: the local part within the lookup timeout, then the registry is not
    // asked again for a second (answered at once).
    let Some(mut etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let (mut a, mut b) = (Node::new(root.path(), "a"), Node::new(root.path(), "b"));
    a.start(&etcd, true);
    b.start(&etcd, true);
    wait_for("both nodes join", SOON, || members(&reader) == ["a", "b"]);
    store(&a, 8);
    wait_for("a's segments registered", SOON, || holders(&reader, 8) == [["a"], ["a"]]);
    let tokens = common::prompt(8, PROMPT_BLOCKS, BLOCK_TOKENS);
    let mut on_b = b.daemon().client();
    on_b.hello(&hello(0, 1, "lookup-b")).unwrap();
    let answer = on_b.lookup_cluster(&tokens).unwrap();
    assert_eq!((answer.cached_blocks, answer.block_tokens, answer.registry), (0, 16, RegistryAnswer::Answered));
    assert_eq!((answer.remote_blocks, answer.holders.clone()), (32, vec![RemoteHolder { node: "a".into(), blocks: 32 }]));
    assert_eq!(on_b.lookup(&tokens).unwrap(), 0, "Lookup's answer is unchanged");

    let mut on_a = a.daemon().client();
    on_a.hello(&hello(0, 1, "lookup-a")).unwrap();
    let before = etcd.requests_started(0, "").unwrap();
    let answer = on_a.lookup_cluster(&tokens).unwrap();
    assert_eq!((answer.cached_blocks, answer.registry, answer.remote_blocks), (40, RegistryAnswer::Answered, 0));
    assert!(answer.holders.is_empty());
    assert_eq!(etcd.requests_started(0, "").unwrap(), before, "a's lookup asked the registry for nothing");

    let mut store_b = b.connect();
    assert_eq!(store_prompt(&mut store_b, 8, 0, 20).unwrap(), 20);
    wait_for("b's first segment registered", SOON, || holders(&reader, 8) == [vec!["a", "b"], vec!["a"]]);
    let before = etcd.requests_started(0, "").unwrap();
    for _ in 0..10 {
        let answer = on_b.lookup_cluster(&tokens).unwrap();
        assert_eq!((answer.cached_blocks, answer.remote_blocks), (20, 12));
        assert_eq!(answer.holders, [RemoteHolder { node: "a".into(), blocks: 12 }]);
    }
    assert_eq!(etcd.requests_started(0, "").unwrap() - before, 10, "one etcd request per lookup");
    let status = b.status();
    assert!(status.lookups >= 11 && status.remote_blocks_found >= 32 + 120, "{status:?}");

    etcd.kill(0).unwrap();
    let started = Instant::now();
    let answer = on_b.lookup_cluster(&tokens).unwrap();
    let took = started.elapsed();
    assert_eq!((answer.cached_blocks, answer.registry, answer.remote_blocks), (20, RegistryAnswer::Unavailable, 0));
    assert!(took < Duration::from_millis(1500), "the lookup timeout is 1 s: {took:?}");
    let started = Instant::now();
    let answer = on_b.lookup_cluster(&tokens).unwrap();
    assert_eq!((answer.cached_blocks, answer.registry), (20, RegistryAnswer::Unavailable));
    assert!(started.elapsed() < Duration::from_millis(200), "asked the registry again at once: {:?}", started.elapsed());
    let status = b.status();
    assert!(status.lookup_failures >= 1 && status.lookups_skipped >= 1, "{status:?}");
}

#[test]
fn a_node_reads_another_nodes_segments_byte_exact_and_serves_them_locally_after() {
    // Goal: node a holds prompt 9 (two segments). Node b's client asks b to fetch what lies
    // past b's (empty) prefix: b reads both segments from a over the data plane, stores them
    // in its own pool, and the client retrieves the 32 blocks from b byte-exact (a's bytes,
    // a's pattern). b's lookup then finds them locally, a counts two segments served.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let (mut a, mut b) = (Node::new(root.path(), "a"), Node::new(root.path(), "b"));
    a.start(&etcd, true);
    b.start(&etcd, true);
    wait_for("both nodes join", SOON, || members(&reader) == ["a", "b"]);
    store(&a, 9);
    wait_for("a's segments registered", SOON, || holders(&reader, 9) == [["a"], ["a"]]);
    let tokens = common::prompt(9, PROMPT_BLOCKS, BLOCK_TOKENS);
    let mut on_b = b.daemon().client();
    on_b.hello(&hello(0, 1, "fetch-b")).unwrap();
    assert_eq!(on_b.fetch_remote(&tokens).unwrap(), (32, 32));
    let mut store_b = b.connect();
    assert_eq!(common::retrieve_prompt(&mut store_b, 9, 0, 32).expect("retrieve on b"), 0, "wrong bytes on b");
    let answer = on_b.lookup_cluster(&tokens).unwrap();
    assert_eq!((answer.cached_blocks, answer.remote_blocks), (32, 0));
    assert_eq!(on_b.fetch_remote(&tokens).unwrap(), (32, 0), "nothing more to fetch");
    let (status_a, status_b) = (a.status(), b.status());
    assert_eq!((status_a.served_segments, status_a.serve_refusals), (2, 0), "{status_a:?}");
    assert_eq!((status_b.remote_reads, status_b.remote_read_failures, status_b.fetched_blocks), (1, 0, 32), "{status_b:?}");
}

#[test]
fn a_holder_never_sends_a_block_its_own_pool_says_is_damaged() {
    // Goal: a holder that records payload CRCs (`--payload-crc`) reads a block whose bytes
    // were changed on its disk behind its back: it refuses the read of that segment rather
    // than send them (the CRC it would send is computed from the bad bytes, so the asker could
    // not tell). The asker keeps the sound segment before it and gets RemoteReadFailed for the
    // rest; none of the damaged bytes reaches its pool.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let (mut a, mut b) = (Node::new(root.path(), "a"), Node::new(root.path(), "b"));
    a.format_extra = vec!["--payload-crc"];
    a.start(&etcd, true);
    b.start(&etcd, true);
    wait_for("both nodes join", SOON, || members(&reader) == ["a", "b"]);
    store(&a, 12);
    wait_for("a's segments registered", SOON, || holders(&reader, 12) == [["a"], ["a"]]);
    // Block 20 (in segment 1): found on a's pool file by its pattern, its first bytes flipped.
    let image = a.directory.join("pool");
    let pattern: Vec<u8> = (0..64).map(|at| common::pattern_byte(12, 0, 20, at)).collect();
    let contents = std::fs::read(&image).unwrap();
    let offset = contents.windows(pattern.len()).position(|window| window == &pattern[..]).expect("block 20 on a's pool file");
    drop(contents);
    let flipped: Vec<u8> = pattern.iter().map(|byte| byte ^ 0xFF).collect();
    std::os::unix::fs::FileExt::write_all_at(&std::fs::OpenOptions::new().write(true).open(&image).unwrap(), &flipped, offset as u64)
        .unwrap();

    let tokens = common::prompt(12, PROMPT_BLOCKS, BLOCK_TOKENS);
    let mut on_b = b.daemon().client();
    on_b.hello(&hello(0, 1, "fetch-b")).unwrap();
    match on_b.fetch_remote(&tokens) {
        Err(DaemonError::Remote { code: ErrorCode::RemoteReadFailed, message }) => {
            assert!(message.contains("recorded at commit") && message.contains("16 block(s)"), "{message}")
        }
        other => panic!("a damaged block was fetched: {other:?}"),
    }
    assert_eq!(on_b.lookup(&tokens).unwrap(), 16, "the sound segment stays, nothing of the damaged one");
    let mut store_b = b.connect();
    assert_eq!(common::retrieve_prompt(&mut store_b, 12, 0, 16).unwrap(), 0);
    assert_eq!(a.status().serve_refusals, 1);
    // The holder evicted the damaged block, so its segment leaves the registry (no one is sent
    // to it again) and a's own prefix stops before it.
    wait_for("a's damaged segment unregistered", SOON, || holders(&reader, 12).len() == 1);
    assert_eq!(holders(&reader, 12)[0], ["a"]);
    let mut on_a = a.daemon().client();
    on_a.hello(&hello(0, 1, "check-a")).unwrap();
    assert_eq!(on_a.lookup(&tokens).unwrap(), 20, "a's prefix ends at the damaged block 20");
}

#[test]
fn three_nodes_share_a_prompt_survive_a_holders_death_and_its_return() {
    // Goal (issue 11's node-loss test on three tuttid processes): a stores prompt 13; b sees a's
    // segments, fetches them and retrieves byte-exact (a too, locally). a is killed with
    // SIGKILL: a read racing its death (the registry still names a) fails cleanly on c with
    // nothing stored; within the lease a's segments vanish from c's lookups, while b and c
    // serve on (b's fetched copy byte-exact). a restarts on its pool — on a new data port —
    // and registers what survived; c then fetches from it byte-exact. Wrong bytes: 0.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut nodes: Vec<Node> = ["a", "b", "c"].into_iter().map(|name| Node::new(root.path(), name)).collect();
    for node in &mut nodes {
        node.start(&etcd, true);
    }
    wait_for("three nodes join", SOON, || members(&reader) == ["a", "b", "c"]);
    let [a, b, c] = &mut nodes[..] else { unreachable!("three nodes") };
    store(a, 13);
    wait_for("a's segments registered", SOON, || holders(&reader, 13) == [["a"], ["a"]]);
    let tokens = common::prompt(13, PROMPT_BLOCKS, BLOCK_TOKENS);
    let client = |node: &Node, name: &str| {
        let mut client = node.daemon().client();
        client.hello(&hello(0, 1, name)).unwrap();
        client
    };
    let mut on_b = client(b, "b");
    let seen = on_b.lookup_cluster(&tokens).unwrap();
    assert_eq!((seen.cached_blocks, seen.remote_blocks, seen.holders[0].node.as_str()), (0, 32, "a"));
    assert_eq!(on_b.fetch_remote(&tokens).unwrap(), (32, 32));
    let mut wrong = common::retrieve_prompt(&mut b.connect(), 13, 0, 32).unwrap();
    wrong += common::retrieve_prompt(&mut a.connect(), 13, 0, PROMPT_BLOCKS).unwrap();
    let old_address = a.status().data_address;

    a.kill();
    let mut on_c = client(c, "c");
    let started = Instant::now();
    match on_c.fetch_remote(&tokens) {
        Err(DaemonError::Remote { code: ErrorCode::RemoteReadFailed, message }) => assert!(message.contains("node a"), "{message}"),
        other => panic!("a read from a dead holder: {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    assert_eq!(on_c.lookup(&tokens).unwrap(), 0, "c stored something from a dead holder");
    let vanished = wait_for("a's segments vanish from c's lookups", LEASE + Duration::from_secs(4), || {
        on_c.lookup_cluster(&tokens).unwrap().remote_blocks == 0
    });
    eprintln!("a's segments vanished from c's lookups {vanished:?} after the kill's read (lease {LEASE:?})");
    assert_eq!(on_c.fetch_remote(&tokens).unwrap(), (0, 0), "nothing left to fetch");
    wrong += common::retrieve_prompt(&mut b.connect(), 13, 0, 32).unwrap();
    store(c, 14);

    a.start(&etcd, false);
    wait_for("a registers what survived", LEASE + SOON, || holders(&reader, 13) == [["a"], ["a"]]);
    assert_ne!(a.status().data_address, old_address, "a serves on a new port");
    assert_eq!(on_c.fetch_remote(&tokens).unwrap(), (32, 32));
    wrong += common::retrieve_prompt(&mut c.connect(), 13, 0, 32).unwrap();
    eprintln!("three-node test: wrong bytes {wrong}");
    assert_eq!(wrong, 0);
}

/// A node's client, attached (Hello sent) as `name`.
fn client_of(node: &Node, name: &str) -> tutti_daemon::Client {
    let mut client = node.daemon().client();
    client.hello(&hello(0, 1, name)).unwrap();
    client
}

#[test]
fn a_segment_fetched_more_than_n_times_gets_a_second_replica_that_outlives_its_first_holder() {
    // Goal (heavy hitters, `--cluster-replicate-after 2`): a holds prompt 30. b fetches it,
    // loses its copy to eviction, fetches again, and again: a counts each read it serves, and
    // the third (more than 2) makes b register its freshly stored copy — before that b's copy
    // is served locally but not registered. The registry then lists a and b for both segments.
    // a is SIGKILLed: once its lease ends c finds b as the only holder and reads the prompt
    // from b byte-exact. b's replica is in its manifest: restarted, b registers it again.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut nodes: Vec<Node> = ["a", "b", "c"].into_iter().map(|name| Node::new(root.path(), name)).collect();
    for node in &mut nodes {
        node.extra = vec!["--cluster-replicate-after", "2"];
        node.start(&etcd, true);
    }
    wait_for("three nodes join", SOON, || members(&reader) == ["a", "b", "c"]);
    let [a, b, c] = &mut nodes[..] else { unreachable!("three nodes") };
    store(a, 30);
    wait_for("a's segments registered", SOON, || holders(&reader, 30) == [["a"], ["a"]]);
    let tokens = common::prompt(30, PROMPT_BLOCKS, BLOCK_TOKENS);
    let mut on_b = client_of(b, "b");
    for fetch in 1..=3u32 {
        assert_eq!(on_b.fetch_remote(&tokens).unwrap(), (32, 32), "fetch {fetch}");
        assert_eq!(common::retrieve_prompt(&mut b.connect(), 30, 0, 32).unwrap(), 0, "fetch {fetch}: wrong bytes on b");
        if fetch < 3 {
            // Served 1 and 2 times: not more than 2, so b's copy is not registered (ten
            // registrar passes to be sure), then two prompts of b's own evict all of it.
            std::thread::sleep(Duration::from_millis(500));
            assert_eq!(holders(&reader, 30), [["a"], ["a"]], "b registered a copy served only {fetch} time(s)");
            store(b, 30 + 2 * fetch);
            store(b, 31 + 2 * fetch);
            assert_eq!(on_b.lookup(&tokens).unwrap(), 0, "b's copy of prompt 30 is evicted");
        }
    }
    wait_for("b's copy registered as a second replica", SOON, || holders(&reader, 30) == [["a", "b"], ["a", "b"]]);
    let status = b.status();
    assert_eq!((status.replicated_segments, status.fetched_blocks), (2, 96), "{status:?}");
    assert_eq!(a.status().served_segments, 6);

    a.kill();
    wait_for("a's entries vanish with its lease", LEASE + Duration::from_secs(4), || holders(&reader, 30) == [["b"], ["b"]]);
    let mut on_c = client_of(c, "c");
    let seen = on_c.lookup_cluster(&tokens).unwrap();
    assert_eq!((seen.remote_blocks, seen.holders.clone()), (32, vec![RemoteHolder { node: "b".into(), blocks: 32 }]));
    assert_eq!(on_c.fetch_remote(&tokens).unwrap(), (32, 32));
    let wrong = common::retrieve_prompt(&mut c.connect(), 30, 0, 32).unwrap();
    eprintln!("heavy hitter read from its second replica: wrong bytes {wrong}");
    assert_eq!(wrong, 0);

    let (exit, stderr) = b.daemon.take().unwrap().terminate();
    assert!(exit.success(), "{exit}: {stderr}");
    assert!(holders(&reader, 30).is_empty(), "b left: its replica leaves with it (c's copy, served once, is not registered)");
    b.start(&etcd, false);
    wait_for("b registers its replica again from its manifest", SOON, || holders(&reader, 30) == [["b"], ["b"]]);
}

#[test]
fn tuttid_nodes_ride_out_etcd_losing_one_member_and_serve_locally_while_all_are_down() {
    // Goal (issue 11, etcd failure with tuttid nodes): three etcd members, three nodes. The
    // leader member is killed: a commit still registers, a lookup still answers, a remote read
    // still works (byte-exact). All three members killed: each node serves its local cache
    // (store and retrieve byte-exact, commits as fast as ever), `ClusterStatus` answers at once
    // and reports the registry `Unavailable` within a renewal interval plus a request timeout,
    // `LookupCluster` answers `Unavailable` (the local part) within its timeout, a remote read
    // is a typed error. etcd back: the nodes answer again, and what was committed meanwhile is
    // registered.
    let Some(mut etcd) = LocalEtcd::start_or_skip(3) else { return };
    let root = tempfile::tempdir().unwrap();
    // Requests ride out a leader election (the members' election timeout is 500 ms, randomised
    // up to 1 s; 3 s as in crates/cluster/tests/etcd_failures.rs).
    let mut config = ClusterConfig::new(etcd.endpoints(), ClusterId::new(CLUSTER).unwrap(), SegmentBlocks::new(SEGMENT_BLOCKS).unwrap());
    config.lease_ttl = Duration::from_secs(6);
    config.request_timeout = Duration::from_secs(3);
    let reader = ClusterClient::connect(config).unwrap();
    let mut nodes: Vec<Node> = ["a", "b", "c"].into_iter().map(|name| Node::new(root.path(), name)).collect();
    for node in &mut nodes {
        (node.lease, node.timeout) = ("6s", "3s");
        node.extra = vec!["--cluster-lookup-timeout", "3s"];
        node.start(&etcd, true);
    }
    wait_for("three nodes join", SOON, || members(&reader) == ["a", "b", "c"]);
    let [a, b, c] = &mut nodes[..] else { unreachable!("three nodes") };
    store(a, 40);
    wait_for("a's segments registered", SOON, || holders(&reader, 40) == [["a"], ["a"]]);
    assert_eq!(a.status().registry, RegistryAnswer::Answered);

    let leader = (0..3).find(|&member| etcd.is_leader(member).unwrap_or(false)).expect("an etcd leader");
    etcd.kill(leader).unwrap();
    store(b, 41);
    wait_for("b's commit registered with a member down", SOON, || holders(&reader, 41) == [["b"], ["b"]]);
    let mut on_c = client_of(c, "c");
    let tokens = common::prompt(40, PROMPT_BLOCKS, BLOCK_TOKENS);
    let seen = on_c.lookup_cluster(&tokens).unwrap();
    assert_eq!((seen.registry, seen.remote_blocks), (RegistryAnswer::Answered, 32), "a lookup with a member down");
    assert_eq!(on_c.fetch_remote(&tokens).unwrap(), (32, 32), "a remote read with a member down");
    let mut wrong = common::retrieve_prompt(&mut c.connect(), 40, 0, 32).unwrap();
    for node in [&*a, &*b, &*c] {
        assert_eq!(node.status().registry, RegistryAnswer::Answered, "node {}", node.name);
    }
    etcd.restart(leader).unwrap();

    for member in 0..3 {
        etcd.kill(member).unwrap();
    }
    let killed = Instant::now();
    let started = Instant::now();
    store(a, 42);
    assert!(started.elapsed() < Duration::from_secs(2), "a commit waited on the registry: {:?}", started.elapsed());
    wrong += common::retrieve_prompt(&mut a.connect(), 42, 0, PROMPT_BLOCKS).unwrap();
    wrong += common::retrieve_prompt(&mut c.connect(), 40, 0, 32).unwrap();
    // A renewal is due every 2 s and each attempt takes at most 3 s: unavailable within 5 s.
    let bound = Duration::from_secs(2) + Duration::from_secs(3) + Duration::from_secs(2);
    for node in [&*a, &*b, &*c] {
        let mut client = node.daemon().client();
        wait_for(&format!("node {} reports the registry unavailable", node.name), bound.saturating_sub(killed.elapsed()), || {
            // Answered from local state: well under the 3 s a registry call may take (the
            // bound leaves room for a machine loaded by parallel tests).
            let asked = Instant::now();
            let status = client.cluster_status().expect("cluster status");
            assert!(asked.elapsed() < Duration::from_millis(1500), "ClusterStatus waited {:?}", asked.elapsed());
            status.registry == RegistryAnswer::Unavailable
        });
    }
    let status = a.status();
    assert!(status.registry_silent_ms >= 2000, "{status:?}");
    eprintln!("all etcd members down: unavailable reported after {:?}", killed.elapsed());
    let started = Instant::now();
    let tokens_42 = common::prompt(42, PROMPT_BLOCKS, BLOCK_TOKENS);
    let seen = on_c.lookup_cluster(&tokens_42).unwrap();
    assert_eq!((seen.cached_blocks, seen.registry, seen.remote_blocks), (0, RegistryAnswer::Unavailable, 0));
    assert!(started.elapsed() < Duration::from_millis(3500), "the lookup timeout is 3 s: {:?}", started.elapsed());
    match on_c.fetch_remote(&tokens_42) {
        Err(DaemonError::Remote { code: ErrorCode::RemoteReadFailed, message }) => assert!(message.contains("registry"), "{message}"),
        other => panic!("a remote read with the registry down: {other:?}"),
    }
    assert_eq!(on_c.lookup(&tokens_42).unwrap(), 0);

    etcd.restart_all().unwrap();
    for node in [&*a, &*b, &*c] {
        wait_for(&format!("node {} sees the registry again", node.name), Duration::from_secs(6) + SOON, || {
            let status = node.status();
            status.registry == RegistryAnswer::Answered && status.joined
        });
    }
    wait_for("a's commit made while etcd was down is registered", Duration::from_secs(6) + SOON, || holders(&reader, 42) == [["a"], ["a"]]);
    assert_eq!(members(&reader), ["a", "b", "c"]);
    wait_for("lookups answer again", SOON, || on_c.lookup_cluster(&tokens_42).unwrap().remote_blocks == 32);
    eprintln!("etcd failure test: wrong bytes {wrong}");
    assert_eq!(wrong, 0);
}

/// A free loopback port (bound, then released) for a node that must come back on the same
/// data address.
fn free_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

#[test]
fn a_node_whose_pool_was_wiped_while_its_lease_lived_serves_no_stale_bytes() {
    // Goal (issue 11): node a (fixed data address, 8 s lease) holds prompt 50; it is SIGKILLed,
    // its pool replaced by a freshly formatted one, and it restarts on the same address while
    // the dead process's lease still lives. The restart checks the manifest against the pool:
    // prompt 50's segments are gone, so their registrations are deleted at once (not a lease
    // later); b's read finds nothing (a miss, nothing stored). a joins once the old lease is
    // gone, and serves what it stores from then on (b reads it byte-exact). Then the whole node
    // is wiped, manifest too (nothing can name its stale entries): b's read reaches the new a at
    // the old address and gets a typed error (not held), nothing stored; the entries vanish
    // with the old lease.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let (mut a, mut b) = (Node::new(root.path(), "a"), Node::new(root.path(), "b"));
    (a.lease, a.timeout) = ("8s", "2s");
    a.data_address = free_address();
    a.start(&etcd, true);
    b.start(&etcd, true);
    wait_for("both nodes join", SOON, || members(&reader) == ["a", "b"]);
    store(&a, 50);
    wait_for("a's segments registered", SOON, || holders(&reader, 50) == [["a"], ["a"]]);

    let wipe = |node: &Node, manifest_too: bool| {
        std::fs::remove_file(node.directory.join("pool")).unwrap();
        if manifest_too {
            std::fs::remove_file(node.directory.join("segments")).unwrap();
        }
    };
    a.kill();
    let killed = Instant::now();
    wipe(&a, false);
    a.start(&etcd, true);
    let gone = wait_for("the stale registrations are deleted at a's restart", Duration::from_secs(3), || holders(&reader, 50).is_empty());
    eprintln!("stale registrations deleted {gone:?} after the restart, {:?} after the kill (lease 8 s)", killed.elapsed());
    let tokens = common::prompt(50, PROMPT_BLOCKS, BLOCK_TOKENS);
    let mut on_b = client_of(&b, "b");
    match on_b.fetch_remote(&tokens) {
        Ok(answer) => assert_eq!(answer, (0, 0), "b fetched from a wiped pool"),
        Err(DaemonError::Remote { code: ErrorCode::RemoteReadFailed, .. }) => {}
        Err(other) => panic!("{other:?}"),
    }
    assert_eq!(on_b.lookup(&tokens).unwrap(), 0, "b stored something of the wiped prompt");
    wait_for("a joins once the old lease is gone", Duration::from_secs(8) + SOON, || a.status().joined);
    store(&a, 51);
    wait_for("a registers what it stores now", SOON, || holders(&reader, 51) == [["a"], ["a"]]);
    // A new session: the first one's client lease ran out while a waited.
    let mut on_b = client_of(&b, "b-again");
    assert_eq!(on_b.fetch_remote(&common::prompt(51, PROMPT_BLOCKS, BLOCK_TOKENS)).unwrap(), (32, 32));
    let wrong = common::retrieve_prompt(&mut b.connect(), 51, 0, 32).unwrap();

    store(&a, 52);
    wait_for("prompt 52 registered", SOON, || holders(&reader, 52) == [["a"], ["a"]]);
    a.kill();
    let killed = Instant::now();
    wipe(&a, true);
    a.start(&etcd, true);
    assert_eq!(holders(&reader, 52), [["a"], ["a"]], "nothing names the stale entries: they live on with the old lease");
    let tokens = common::prompt(52, PROMPT_BLOCKS, BLOCK_TOKENS);
    match on_b.fetch_remote(&tokens) {
        Err(DaemonError::Remote { code: ErrorCode::RemoteReadFailed, message }) => {
            assert!(message.contains("node a") && message.contains("NotHeld"), "{message}")
        }
        other => panic!("a read of a wiped holder's stale entry: {other:?}"),
    }
    assert_eq!(on_b.lookup(&tokens).unwrap(), 0, "b stored something of the wiped prompt");
    assert!(a.status().serve_refusals >= 1);
    wait_for("the stale entries vanish with the old lease", Duration::from_secs(8) + Duration::from_secs(4), || {
        holders(&reader, 52).is_empty()
    });
    eprintln!("stale entries of a wiped node vanished {:?} after the kill (lease 8 s); wrong bytes {wrong}", killed.elapsed());
    assert_eq!(client_of(&a, "a").lookup(&tokens).unwrap(), 0, "the wiped pool holds nothing of prompt 52");
    assert_eq!(wrong, 0);
}

/// How a fake holder misbehaves.
#[derive(Debug, Clone, Copy)]
enum Misbehaviour {
    /// Answers with bytes that are no frame.
    Garbage,
    /// Sends the segment header and half a block, then nothing.
    Stall,
    /// Sends a segment one of whose blocks' CRC does not match its bytes.
    WrongChecksum,
    /// Sends one good block, then closes the connection (a holder that died mid-stream).
    Dies,
    /// Sends a sound segment slowly (each block inside the stall bound, the whole longer than
    /// the asking client's lease), then closes.
    Slow,
}

/// Bytes of one block of the test geometry (2 layers × K and V × 2 heads × 64 × 16 × 2 bytes).
const BLOCK_BYTES: usize = 2 * 2 * 2 * 64 * 16 * 2;

fn frame(kind: u16, body: &[u8]) -> Vec<u8> {
    let mut out = b"TPDP".to_vec();
    // The data plane's version 2 (the segment header carries the holder's served count).
    out.extend_from_slice(&2u16.to_le_bytes());
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

fn block_frame(index: u16, bytes: &[u8], crc: u32) -> Vec<u8> {
    let mut body = index.to_le_bytes().to_vec();
    body.extend_from_slice(&crc.to_le_bytes());
    body.extend_from_slice(bytes);
    frame(0x8002, &body)
}

/// Joins `etcd` as node `name` at `address` (a fake holder's) and registers prompt `seed`'s
/// segments there: the registry then sends fetches of that prompt to the fake.
fn register_fake_holder(etcd: &LocalEtcd, name: &str, address: std::net::SocketAddr, seed: u32) -> ClusterNode {
    let mut config = ClusterConfig::new(etcd.endpoints(), ClusterId::new(CLUSTER).unwrap(), SegmentBlocks::new(SEGMENT_BLOCKS).unwrap());
    config.lease_ttl = LEASE;
    config.request_timeout = REQUEST_TIMEOUT;
    let record =
        MemberRecord { node: NodeId::new(name).unwrap(), address: address.to_string(), capacity_bytes: 1 << 30, fingerprints: vec![] };
    let node = ClusterNode::join(config, record).unwrap();
    node.register(&model(), &segments(seed)).unwrap();
    node
}

/// A holder that reads one request and misbehaves as told (each connection), until dropped.
fn fake_holder(misbehaviour: Misbehaviour) -> (std::net::SocketAddr, std::thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    let thread = std::thread::spawn(move || {
        // One connection is all a fetch makes; bounded, should none come.
        listener.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut stream = loop {
            match listener.accept() {
                Ok((stream, _)) => break stream,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                Err(_) => return,
            }
        };
        stream.set_nonblocking(false).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut header = [0u8; 12];
        if stream.read_exact(&mut header).is_err() {
            return;
        }
        let mut body = vec![0u8; u32::from_le_bytes(header[8..12].try_into().unwrap()) as usize];
        let _ = stream.read_exact(&mut body);
        let mut segment_header = 16u16.to_le_bytes().to_vec();
        segment_header.extend_from_slice(&(BLOCK_BYTES as u64).to_le_bytes());
        // Served once: never a heavy hitter.
        segment_header.extend_from_slice(&1u32.to_le_bytes());
        let bytes = vec![0x5au8; BLOCK_BYTES];
        let _ = match misbehaviour {
            Misbehaviour::Garbage => stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"),
            Misbehaviour::Stall => {
                let _ = stream.write_all(&frame(0x8001, &segment_header));
                let half = block_frame(0, &bytes, crc32fast::hash(&bytes));
                let _ = stream.write_all(&half[..half.len() / 2]);
                std::thread::sleep(Duration::from_secs(8));
                Ok(())
            }
            Misbehaviour::WrongChecksum => {
                // A whole segment, sound but for block 7's CRC: taken without the check, it
                // would be stored.
                let _ = stream.write_all(&frame(0x8001, &segment_header));
                for index in 0..16u16 {
                    let crc = crc32fast::hash(&bytes) ^ u32::from(index == 7);
                    let _ = stream.write_all(&block_frame(index, &bytes, crc));
                }
                Ok(())
            }
            Misbehaviour::Dies => {
                let _ = stream.write_all(&frame(0x8001, &segment_header));
                stream.write_all(&block_frame(0, &bytes, crc32fast::hash(&bytes)))
            }
            Misbehaviour::Slow => {
                let _ = stream.write_all(&frame(0x8001, &segment_header));
                for index in 0..16u16 {
                    std::thread::sleep(Duration::from_millis(250));
                    let _ = stream.write_all(&block_frame(index, &bytes, crc32fast::hash(&bytes)));
                }
                Ok(())
            }
        };
    });
    (address, thread)
}

#[test]
fn a_holder_that_sends_garbage_stalls_lies_or_dies_is_a_typed_error_and_nothing_is_stored() {
    // Goal: a fake node, registered as the only holder of prompt 10's segments, misbehaves in
    // each way in turn; node b's fetch answers RemoteReadFailed (within the 2 s stall bound
    // plus slack for the stall), b stores nothing of prompt 10, and b serves on.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut b = Node::new(root.path(), "b");
    b.start(&etcd, true);
    wait_for("b joins", SOON, || members(&reader) == ["b"]);
    let mut on_b = b.daemon().client();
    on_b.hello(&hello(0, 1, "fetch-b")).unwrap();
    let tokens = common::prompt(10, PROMPT_BLOCKS, BLOCK_TOKENS);
    for misbehaviour in [Misbehaviour::Garbage, Misbehaviour::Stall, Misbehaviour::WrongChecksum, Misbehaviour::Dies] {
        let (address, thread) = fake_holder(misbehaviour);
        let evil = register_fake_holder(&etcd, "evil", address, 10);
        let started = Instant::now();
        let failure = on_b.fetch_remote(&tokens).expect_err("a fetch from a misbehaving holder");
        let took = started.elapsed();
        match &failure {
            DaemonError::Remote { code: ErrorCode::RemoteReadFailed, message } => {
                eprintln!("{misbehaviour:?}: {message} ({took:?})");
                assert!(message.contains("evil"), "{message}");
            }
            other => panic!("{misbehaviour:?}: {other:?}"),
        }
        assert!(took < Duration::from_secs(5), "{misbehaviour:?} took {took:?}");
        assert_eq!(on_b.lookup(&tokens).unwrap(), 0, "{misbehaviour:?}: b stored something");
        drop(evil);
        thread.join().unwrap();
    }
    let status = b.status();
    assert_eq!((status.remote_reads, status.remote_read_failures, status.fetched_blocks), (4, 4, 0), "{status:?}");
    store(&b, 11);
    assert_eq!(on_b.lookup(&common::prompt(11, PROMPT_BLOCKS, BLOCK_TOKENS)).unwrap(), PROMPT_BLOCKS as u32, "b serves on");
}

#[test]
fn a_fetch_longer_than_the_clients_lease_keeps_its_session() {
    // Goal: the client lease counts from the daemon's answer, not from the request: a slow
    // holder (every block inside the stall bound, the segment longer than b's 1 s client lease)
    // makes a long FetchRemote, and the same client's next request is still served.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut b = Node::new(root.path(), "b");
    b.extra = vec!["--lease", "1s"];
    b.start(&etcd, true);
    wait_for("b joins", SOON, || members(&reader) == ["b"]);
    let mut on_b = b.daemon().client();
    on_b.hello(&hello(0, 1, "fetch-slow")).unwrap();
    let tokens = common::prompt(12, PROMPT_BLOCKS, BLOCK_TOKENS);
    let (address, thread) = fake_holder(Misbehaviour::Slow);
    let slow = register_fake_holder(&etcd, "slow", address, 12);
    let started = Instant::now();
    // The fake serves one segment and closes: the first is stored, the second read fails.
    let failure = on_b.fetch_remote(&tokens).expect_err("the fake holder serves one segment only");
    assert!(started.elapsed() > Duration::from_millis(1500), "the fetch outlasted the lease: {:?}", started.elapsed());
    assert!(matches!(failure, DaemonError::Remote { code: ErrorCode::RemoteReadFailed, .. }), "{failure:?}");
    // The session lives on: the same client, silent for less than its lease since the answer,
    // is answered and sees the segment stored.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(on_b.lookup(&tokens).unwrap(), u32::from(SEGMENT_BLOCKS), "b stored the slow segment and still serves this client");
    drop(slow);
    thread.join().unwrap();
}

#[test]
fn fetches_past_the_nodes_limit_are_refused_at_once() {
    // Goal: each fetch buffers up to a segment in memory, so a node runs at most 4 at once: with
    // 4 in progress (a slow holder), a fifth is refused at once, naming the limit, and a fetch
    // after they end is served again.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut b = Node::new(root.path(), "b");
    b.start(&etcd, true);
    wait_for("b joins", SOON, || members(&reader) == ["b"]);
    let tokens = common::prompt(13, PROMPT_BLOCKS, BLOCK_TOKENS);
    let (address, thread) = fake_holder(Misbehaviour::Slow);
    let slow = register_fake_holder(&etcd, "slow", address, 13);
    // The slow holder serves the first connection; the others wait unanswered (stall, 2 s).
    let fetchers: Vec<_> = (0..4)
        .map(|index| {
            let mut client = b.daemon().client();
            client.hello(&hello(0, 1, &format!("fetch-{index}"))).unwrap();
            let tokens = tokens.clone();
            std::thread::spawn(move || client.fetch_remote(&tokens))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let mut fifth = b.daemon().client();
    fifth.hello(&hello(0, 1, "fetch-5")).unwrap();
    let started = Instant::now();
    match fifth.fetch_remote(&tokens) {
        Err(DaemonError::Remote { code: ErrorCode::RemoteReadFailed, message }) => {
            assert!(message.contains("4 remote fetches are in progress"), "{message}")
        }
        other => panic!("a fifth fetch at once: {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_millis(500), "refused at once, not after {:?}", started.elapsed());
    for fetcher in fetchers {
        let _ = fetcher.join().unwrap();
    }
    thread.join().unwrap();
    drop(slow);
    // The limit is a count, not a latch: with none in progress, a fetch runs (and finds nothing
    // to fetch, the slow node's lease being gone or its segment stored already).
    let again = fifth.fetch_remote(&tokens);
    assert!(!matches!(&again, Err(DaemonError::Remote { message, .. }) if message.contains("in progress")), "{again:?}");
}

#[test]
fn cluster_options_are_checked_at_start() {
    // Goal: a bad node id, a segment size outside 16..=64, a timeout the lease cannot hold and
    // an unspecified data address (other nodes would dial themselves) are refused before the daemon opens anything (exit 2, the reason named); cluster options
    // without --cluster-etcd are refused too.
    let directory = tempfile::tempdir().unwrap();
    let socket = directory.path().join("t.sock");
    let base = ["--device", "emu:mem:64m", "--format", "--metrics", "off", "--layers", "2", "--kv-heads", "2", "--head-dim", "64"];
    let cluster_at = |node: &str, blocks: &str, timeout: &str, data_address: &str| {
        let manifest = directory.path().join("m").display().to_string();
        vec![
            "--cluster-etcd".to_string(),
            "http://127.0.0.1:1".into(),
            "--cluster-id".into(),
            "x".into(),
            "--node-id".into(),
            node.into(),
            "--data-address".into(),
            data_address.into(),
            "--cluster-state".into(),
            manifest,
            "--segment-blocks".into(),
            blocks.into(),
            "--cluster-timeout".into(),
            timeout.into(),
        ]
    };
    let cluster = |node: &str, blocks: &str, timeout: &str| cluster_at(node, blocks, timeout, "127.0.0.1:7000");
    for (arguments, reason) in [
        (cluster("Node/A", "32", "3s"), "node id"),
        (cluster_at("a", "32", "3s", "0.0.0.0:7000"), "not an unspecified one"),
        (cluster("a", "8", "3s"), "segment size 8"),
        (cluster("a", "32", "9s"), "leaves no room to renew"),
        (vec!["--node-id".to_string(), "a".into()], "--cluster-etcd"),
    ] {
        let output = std::process::Command::new(common::TUTTID).args(base).arg("--socket").arg(&socket).args(&arguments).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{arguments:?}: {stderr}");
        assert!(stderr.contains(reason), "{arguments:?}: {stderr}");
        assert!(!socket.exists());
    }
}
