//! tuttid nodes finding and reading each other's segments, against a real etcd (`LocalEtcd`,
//! loopback): `LookupCluster` finds what other nodes hold past the local prefix in one etcd
//! request (and, with etcd gone, answers the local part within its timeout); `FetchRemote`
//! reads another node's segments over the data plane byte-exact, and they are served locally
//! after; a holder never sends a block its own pool says is damaged; a segment fetched more
//! than `--cluster-replicate-after` times gets a second, registered replica that outlives its
//! first holder.
//! Every wait is bounded. Skipped (with a note) where no etcd is installed, unless
//! TUTTI_REQUIRE_ETCD=1 (the cluster stage of tools/test.sh). The nodes and the registry reader
//! are `common::cluster`'s (16-block segments, 48-slot pools, a 2 s lease unless a test sets one).

use std::path::Path;
use std::time::{Duration, Instant};

use tutti_cluster::layout::KeyLayout;
use tutti_cluster::local_etcd::LocalEtcd;
use tutti_cluster::{ClusterClient, ClusterId, KeySecretTag, NodeId};
use tutti_daemon::protocol::{RegistryAnswer, RemoteHolder};
use tutti_daemon::{Client, DaemonError, ErrorCode};

mod common;
use common::cluster::{
    client_of, holders, holders_once_available, key_secret_tag, key_secret_tag_of, members, reader, store, wait_for, write_key_secret_file,
    Node, BLOCK_TOKENS, CLUSTER, LEASE, PROMPT_BLOCKS, SOON,
};
use common::{hello, store_prompt};

/// Nodes a and b started and joined, a holding prompt `seed`'s two segments, registered.
/// `a_format_extra`: more of a's format options (e.g. `--payload-crc`).
fn two_nodes_a_holding(
    etcd: &LocalEtcd,
    root: &Path,
    reader: &ClusterClient,
    seed: u32,
    a_format_extra: Vec<&'static str>,
) -> (Node, Node) {
    let (mut a, mut b) = (Node::new(root, "a"), Node::new(root, "b"));
    a.format_extra = a_format_extra;
    a.start(etcd, true);
    b.start(etcd, true);
    wait_for("both nodes join", SOON, || members(reader) == ["a", "b"]);
    store(&a, seed);
    wait_for("a's segments registered", SOON, || holders_once_available(reader, seed).is_some_and(|holders| holders == [["a"], ["a"]]));
    (a, b)
}

/// On b, a client named `name` fetches prompt `seed` (all 32 blocks from a), then a store on b
/// retrieves them byte-exact. Returns the prompt's tokens and the client.
fn fetch_onto_b_byte_exact(b: &Node, seed: u32, name: &str) -> (Vec<u32>, Client) {
    let tokens = common::prompt(seed, PROMPT_BLOCKS, BLOCK_TOKENS);
    let mut on_b = b.daemon().client();
    on_b.hello(&hello(0, 1, name)).unwrap();
    assert_eq!(on_b.fetch_remote(&tokens).unwrap(), (32, 32));
    let mut store_b = b.connect();
    assert_eq!(common::retrieve_prompt(&mut store_b, seed, 0, 32).expect("retrieve on b"), 0, "wrong bytes on b");
    (tokens, on_b)
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
    let (a, b) = two_nodes_a_holding(&etcd, root.path(), &reader, 8, Vec::new());
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
    wait_for("b's first segment registered", SOON, || {
        holders_once_available(&reader, 8).is_some_and(|holders| holders == [vec!["a", "b"], vec!["a"]])
    });
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
    let (a, b) = two_nodes_a_holding(&etcd, root.path(), &reader, 9, Vec::new());
    let (tokens, mut on_b) = fetch_onto_b_byte_exact(&b, 9, "fetch-b");
    let answer = on_b.lookup_cluster(&tokens).unwrap();
    assert_eq!((answer.cached_blocks, answer.remote_blocks), (32, 0));
    assert_eq!(on_b.fetch_remote(&tokens).unwrap(), (32, 0), "nothing more to fetch");
    // A holder counts a segment served after its last write (and the pool lock's release),
    // so the asker may have it before the count: waited for, not read once.
    wait_for("a counts two segments served", SOON, || {
        let status_a = a.status();
        (status_a.served_segments, status_a.serve_refusals) == (2, 0)
    });
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
    let (a, b) = two_nodes_a_holding(&etcd, root.path(), &reader, 12, vec!["--payload-crc"]);
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
    // Counted after the refusal is sent: waited for.
    wait_for("a counts its refusal", SOON, || a.status().serve_refusals == 1);
    // The holder evicted the damaged block, so its segment leaves the registry (no one is sent
    // to it again) and a's own prefix stops before it.
    wait_for("a's damaged segment unregistered", SOON, || holders_once_available(&reader, 12).is_some_and(|holders| holders.len() == 1));
    assert_eq!(holders(&reader, 12)[0], ["a"]);
    let mut on_a = a.daemon().client();
    on_a.hello(&hello(0, 1, "check-a")).unwrap();
    assert_eq!(on_a.lookup(&tokens).unwrap(), 20, "a's prefix ends at the damaged block 20");
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
    wait_for("a's segments registered", SOON, || holders_once_available(&reader, 30).is_some_and(|holders| holders == [["a"], ["a"]]));
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
    wait_for("b's copy registered as a second replica", SOON, || {
        holders_once_available(&reader, 30).is_some_and(|holders| holders == [["a", "b"], ["a", "b"]])
    });
    let status = b.status();
    assert_eq!((status.replicated_segments, status.fetched_blocks), (2, 96), "{status:?}");
    // Counted after the last write: waited for.
    wait_for("a counts six segments served", SOON, || a.status().served_segments == 6);

    a.kill();
    wait_for("a's entries vanish with its lease", LEASE + Duration::from_secs(4), || {
        holders_once_available(&reader, 30).is_some_and(|holders| holders == [["b"], ["b"]])
    });
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
    wait_for("b registers its replica again from its manifest", SOON, || {
        holders_once_available(&reader, 30).is_some_and(|holders| holders == [["b"], ["b"]])
    });
}

#[test]
fn an_idle_node_whose_member_key_was_deleted_is_listed_again_and_read_from() {
    // Goal: node a's member key is deleted behind its back (an operator's `etcdctl del`) while
    // a is idle: its lease lives on and keeps its segment entries listed, so peers choose a
    // and, without its record, find no data address for it. a must notice with no write of
    // its own to make, rejoin (a new lease: the old entries go) and register again, within
    // two leases; b's fetch from a then works. Before, a stayed unlisted until it next wrote.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let (a, b) = two_nodes_a_holding(&etcd, root.path(), &reader, 13, Vec::new());
    let old_lease = a.status().lease_id;
    let layout = KeyLayout::new(ClusterId::new(CLUSTER).unwrap());
    etcd.delete_key(&layout.member_key(&NodeId::new("a").unwrap())).unwrap();
    assert_eq!(members(&reader), ["b"], "the member key was not deleted");
    let back = wait_for("a is listed again with its segments", 2 * LEASE, || {
        members(&reader) == ["a", "b"] && holders_once_available(&reader, 13).is_some_and(|holders| holders == [["a"], ["a"]])
    });
    eprintln!("a was listed again {back:?} after its member key was deleted (lease {LEASE:?})");
    let status = a.status();
    assert_ne!(status.lease_id, old_lease, "{status:?}");
    assert_eq!((status.lease_losses, status.joins), (1, 2), "{status:?}");
    fetch_onto_b_byte_exact(&b, 13, "rejoined-b");
}

#[test]
fn a_fetched_copy_stays_unregistered_when_its_node_stores_the_prompt_extended() {
    // Goal (`--cluster-replicate-after 0`, "never"): b fetches a's prompt 72 (segments 0 and
    // 1), then its client stores the prompt extended by a segment it computed (48 blocks, from
    // block 0, as every store is). b registers the new segment 2 only: the fetched copies stay
    // replicas in waiting, and c's lookup lists a alone for them. Before, the commit registered
    // every whole segment it held, the fetched ones included. c's fetch of the extended prompt
    // then reads segments 0 and 1 from a and 2 from b, in one FetchRemote.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut nodes: Vec<Node> = ["a", "b", "c"].into_iter().map(|name| Node::new(root.path(), name)).collect();
    for node in &mut nodes {
        node.extra = vec!["--cluster-replicate-after", "0"];
        // b's lease outlives its SIGSTOP below: with the default 2 s, it lapses 1.33-2 s after
        // the stop and the lookup lists no holder past a's run, which ends the fetch with
        // a's 32 blocks without asking b (the path this part of the test is not about).
        if node.name == "b" {
            node.lease = "30s";
        }
        node.start(&etcd, true);
    }
    wait_for("three nodes join", SOON, || members(&reader) == ["a", "b", "c"]);
    let [a, b, c] = &mut nodes[..] else { unreachable!("three nodes") };
    store(a, 72);
    wait_for("a's segments registered", SOON, || holders_once_available(&reader, 72).is_some_and(|holders| holders == [["a"], ["a"]]));
    let tokens = common::prompt(72, PROMPT_BLOCKS, BLOCK_TOKENS);
    let mut on_b = client_of(b, "b");
    assert_eq!(on_b.fetch_remote(&tokens).unwrap(), (32, 32));
    let mut store_b = b.connect();
    // The 32 fetched blocks are shared, 16 written.
    assert_eq!(store_prompt(&mut store_b, 72, 0, 48).unwrap(), 16);
    wait_for("b's computed segment registered", SOON, || b.status().segments_registered >= 1);
    // Ten registrar passes more, in case the fetched segments came after.
    std::thread::sleep(Duration::from_millis(500));
    let status = b.status();
    assert_eq!((status.segments_held, status.segments_registered, status.replicated_segments), (1, 1, 0), "{status:?}");
    assert_eq!(holders(&reader, 72), [["a"], ["a"]], "b registered the segments it fetched");
    let mut on_c = client_of(c, "c");
    let seen = on_c.lookup_cluster(&tokens).unwrap();
    assert_eq!((seen.remote_blocks, seen.holders), (32, vec![RemoteHolder { node: "a".into(), blocks: 32 }]));

    // The extended prompt's run goes over two holders (a for segments 0 and 1, b for 2): c's
    // one fetch reads a's run, then, from the prefix it reached, b's. Before, it stopped at
    // a's 32 blocks and c recomputed segment 2.
    let extended = common::prompt(72, 48, BLOCK_TOKENS);
    let seen = on_c.lookup_cluster(&extended).unwrap();
    assert_eq!((seen.remote_blocks, seen.holders), (48, vec![RemoteHolder { node: "a".into(), blocks: 32 }]));
    assert_eq!(on_c.fetch_remote(&extended).unwrap(), (48, 48));
    // (Byte-exactness is the tests' above: `retrieve_prompt` has engine blocks for 40 at most.)
    assert_eq!(on_c.lookup(&extended).unwrap(), 48, "c does not hold the extended prompt whole");
    // Counted after the last write: waited for.
    wait_for("a counts four segments served and b one", SOON, || (a.status().served_segments, b.status().served_segments) == (4, 1));

    // A later run's holder failing once a run was read ends the fetch with what it read: c's
    // copy evicted (two prompts of its own), b stopped (SIGSTOP: its kernel takes the
    // connection, nobody answers), c's fetch reads a's 32 blocks, waits out the stall bound on
    // b's segment header and answers them. Before, the client got RemoteReadFailed with the
    // 32 blocks stored.
    store(c, 73);
    store(c, 74);
    assert_eq!(on_c.lookup(&extended).unwrap(), 0, "c's copy of prompt 72 is evicted");
    let stopped = Stopped::new(b);
    let started = Instant::now();
    let fetched = on_c.fetch_remote(&extended);
    let took = started.elapsed();
    drop(stopped);
    assert_eq!(fetched.unwrap(), (32, 32));
    // b was asked and its segment header waited out (the 2 s stall bound).
    assert!(took >= Duration::from_secs(2), "c's fetch did not wait for b's segment header: {took:?}");
    assert_eq!(on_c.lookup(&extended).unwrap(), 32);
}

/// A node's daemon stopped (SIGSTOP) until this is dropped (SIGCONT), a failed test included.
struct Stopped(u32);

impl Stopped {
    fn new(node: &Node) -> Stopped {
        let pid = node.daemon().child.as_ref().expect("the node's process").id();
        Stopped::signal(nix::sys::signal::Signal::SIGSTOP, pid).expect("SIGSTOP the node");
        Stopped(pid)
    }

    fn signal(signal: nix::sys::signal::Signal, pid: u32) -> nix::Result<()> {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // No panic here: a drop while unwinding (a failed assertion) that panics aborts the
        // test binary. The node's own drop kills it should this fail.
        if let Err(error) = Stopped::signal(nix::sys::signal::Signal::SIGCONT, self.0) {
            eprintln!("SIGCONT {}: {error}", self.0);
        }
    }
}

#[test]
fn nodes_formatted_with_different_key_secrets_share_nothing() {
    // Goal: block keys are keyed with the pool's secret, and nodes find each other's segments
    // by key: a node formatted with another secret than the cluster's computes other keys for
    // the same prompt, so its lookups find no holder of what the others hold and a fetch reads
    // nothing (misses: never another prefix's data), while a node of the cluster's secret
    // finds and reads it all. Each node compares the members' key secret tags with its own
    // when it joins and warns of those that differ, naming them; `status` groups the members
    // by tag. The nodes join one by one, so who sees whom is known.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let (mut a, mut b, mut c) = (Node::new(root.path(), "a"), Node::new(root.path(), "b"), Node::new(root.path(), "c"));
    b.key_secret_file = root.path().join("another-secret");
    write_key_secret_file(&b.key_secret_file, &"7e".repeat(32));
    let other_tag = key_secret_tag_of(&"7e".repeat(32));
    let mut joined = Vec::new();
    for node in [&mut a, &mut b, &mut c] {
        node.start(&etcd, true);
        joined.push(node.name);
        wait_for("the node joins", SOON, || members(&reader) == joined);
    }
    let groups = reader.status().unwrap().key_secret_groups();
    let names = |nodes: &[NodeId]| nodes.iter().map(|node| node.to_string()).collect::<Vec<_>>();
    assert_eq!(groups.len(), 2, "{groups:?}");
    assert_eq!((groups[0].0, names(&groups[0].1)), (key_secret_tag(), vec!["a".to_string(), "c".to_string()]));
    assert_eq!((groups[1].0, names(&groups[1].1)), (other_tag, vec!["b".to_string()]));
    store(&a, 12);
    wait_for("a's segments registered", SOON, || holders_once_available(&reader, 12).is_some_and(|holders| holders == [["a"], ["a"]]));
    let tokens = common::prompt(12, PROMPT_BLOCKS, BLOCK_TOKENS);
    let mut on_b = client_of(&b, "other-secret");
    let answer = on_b.lookup_cluster(&tokens).unwrap();
    assert_eq!((answer.cached_blocks, answer.registry, answer.remote_blocks), (0, RegistryAnswer::Answered, 0), "{answer:?}");
    assert!(answer.holders.is_empty(), "{answer:?}");
    assert_eq!(on_b.fetch_remote(&tokens).unwrap(), (0, 0), "a fetch on b reads nothing");
    assert_eq!(on_b.lookup(&tokens).unwrap(), 0, "b holds nothing of the prompt");
    // The same prompt on c, formatted with the cluster's secret: all of a's blocks.
    let mut on_c = client_of(&c, "cluster-secret");
    assert_eq!(on_c.lookup_cluster(&tokens).unwrap().remote_blocks, 32);
    assert_eq!(on_c.fetch_remote(&tokens).unwrap(), (32, 32));
    let mut store_c = c.connect();
    assert_eq!(common::retrieve_prompt(&mut store_c, 12, 0, 32).expect("retrieve on c"), 0, "wrong bytes on c");
    drop(store_c);
    // What each node said at its join: a saw no one; b saw a, of another secret than its own;
    // c saw a (the same secret) and b (another). (A node that lost its 2 s lease under load
    // and rejoined compared again, after all three had joined: a then warns of b.)
    // The same, in each node's status: its pool's tag and the count its join found.
    wait_for("b's and c's comparisons", SOON, || b.status().members_other_key_secret == 1 && c.status().members_other_key_secret == 1);
    let (a_status, b_status) = (a.status(), b.status());
    assert_eq!((a_status.key_secret_tag, b_status.key_secret_tag), (key_secret_tag().bytes(), other_tag.bytes()));
    assert!(a_status.joins > 1 || a_status.members_other_key_secret == 0, "{a_status:?}");
    let a_joins = a_status.joins;
    let warned = |node: &mut Node| node.daemon.take().unwrap().terminate().1;
    let (on_a, on_b, on_c) = (warned(&mut a), warned(&mut b), warned(&mut c));
    const WARNING: &str = "share no segments with it";
    assert!(a_joins > 1 || !on_a.contains(WARNING), "a warned: {on_a}");
    let named = |stderr: &str, node: &str, tag: KeySecretTag| stderr.contains(&format!("{node} ({tag})"));
    assert!(on_b.contains(WARNING) && named(&on_b, "a", key_secret_tag()), "b did not name a: {on_b}");
    assert!(on_c.contains(WARNING) && named(&on_c, "b", other_tag) && !named(&on_c, "a", key_secret_tag()), "c: {on_c}");
}
