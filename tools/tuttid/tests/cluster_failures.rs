//! tuttid nodes through failures, against a real etcd (`LocalEtcd`, loopback): three nodes share
//! a prompt and survive its holder's SIGKILL (a read racing the death fails cleanly, the
//! holder's segments vanish within its lease, the others serve on) and its return on a new data
//! port; the nodes ride out etcd losing its leader member and serve locally, reporting the
//! registry unavailable, while all three members are down, and register what was committed
//! meanwhile once etcd is back; a node whose pool (and then manifest too) was wiped while its
//! lease lived serves no stale bytes.
//! Every wait is bounded. Skipped (with a note) where no etcd is installed, unless
//! TUTTI_REQUIRE_ETCD=1 (the cluster stage of tools/test.sh). The nodes and the registry reader
//! are `common::cluster`'s (16-block segments, 48-slot pools, a 2 s lease unless a test sets one).

use std::time::{Duration, Instant};

use tutti_cluster::local_etcd::LocalEtcd;
use tutti_cluster::{ClusterClient, ClusterConfig, ClusterId, SegmentBlocks};
use tutti_daemon::protocol::RegistryAnswer;
use tutti_daemon::{DaemonError, ErrorCode};

mod common;
use common::cluster::{
    client_of, holders, holders_once_available, members, reader, store, wait_for, Node, BLOCK_TOKENS, CLUSTER, LEASE, PROMPT_BLOCKS,
    SEGMENT_BLOCKS, SOON,
};
use common::hello;

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
    wait_for("a's segments registered", SOON, || holders_once_available(&reader, 13).is_some_and(|holders| holders == [["a"], ["a"]]));
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
    wait_for("a registers what survived", LEASE + SOON, || {
        holders_once_available(&reader, 13).is_some_and(|holders| holders == [["a"], ["a"]])
    });
    assert_ne!(a.status().data_address, old_address, "a serves on a new port");
    assert_eq!(on_c.fetch_remote(&tokens).unwrap(), (32, 32));
    wrong += common::retrieve_prompt(&mut c.connect(), 13, 0, 32).unwrap();
    eprintln!("three-node test: wrong bytes {wrong}");
    assert_eq!(wrong, 0);
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
    wait_for("a's segments registered", SOON, || holders_once_available(&reader, 40).is_some_and(|holders| holders == [["a"], ["a"]]));
    assert_eq!(a.status().registry, RegistryAnswer::Answered);

    let leader = (0..3).find(|&member| etcd.is_leader(member).unwrap_or(false)).expect("an etcd leader");
    etcd.kill(leader).unwrap();
    store(b, 41);
    // The lookup itself may find no leader for longer than its 3 s while the members elect one
    // on a loaded machine: asked again, within the same bound.
    wait_for("b's commit registered with a member down", SOON, || {
        holders_once_available(&reader, 41).is_some_and(|holders| holders == [["b"], ["b"]])
    });
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
    let before = c.status();
    match on_c.fetch_remote(&tokens_42) {
        Err(DaemonError::Remote { code: ErrorCode::RemoteReadFailed, message }) => assert!(message.contains("registry"), "{message}"),
        other => panic!("a remote read with the registry down: {other:?}"),
    }
    // A fetch the registry did not answer went to no holder: counted as the lookup's failure
    // (or skip), not as a remote read's (the failures outnumbered the reads, divided by 0).
    let after = c.status();
    assert_eq!((after.remote_reads, after.remote_read_failures), (before.remote_reads, before.remote_read_failures), "{after:?}");
    assert_eq!(after.lookup_failures + after.lookups_skipped, before.lookup_failures + before.lookups_skipped + 1, "{after:?}");
    assert_eq!(on_c.lookup(&tokens_42).unwrap(), 0);

    etcd.restart_all().unwrap();
    for node in [&*a, &*b, &*c] {
        wait_for(&format!("node {} sees the registry again", node.name), Duration::from_secs(6) + SOON, || {
            let status = node.status();
            status.registry == RegistryAnswer::Answered && status.joined
        });
    }
    wait_for("a's commit made while etcd was down is registered", Duration::from_secs(6) + SOON, || {
        holders_once_available(&reader, 42).is_some_and(|holders| holders == [["a"], ["a"]])
    });
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
    // Goal (issue 11): node a (fixed data address, 12 s lease) holds prompt 50; it is SIGKILLed,
    // its pool replaced by a freshly formatted one, and it restarts on the same address while
    // the dead process's lease still lives. The restart checks the manifest against the pool:
    // prompt 50's segments are gone, so their registrations are deleted at once (not a lease
    // later); b's read finds nothing (a miss, nothing stored). a joins once the old lease is
    // gone, and serves what it stores from then on (b reads it byte-exact). Then the whole node
    // is wiped, manifest too (nothing can name its stale entries): b's read reaches the new a at
    // the old address and gets a typed error (not held), nothing stored; the entries vanish
    // with the old lease. The lease is long because the kill, the restart and the deletion must
    // all happen while it lives: renewed every TTL/3, it has only 2/3 of its TTL left at the
    // kill at worst (5.3 s of an 8 s lease, tight on a loaded 2-core machine).
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let (mut a, mut b) = (Node::new(root.path(), "a"), Node::new(root.path(), "b"));
    (a.lease, a.timeout) = ("12s", "2s");
    let lease = Duration::from_secs(12);
    a.data_address = free_address();
    a.start(&etcd, true);
    b.start(&etcd, true);
    wait_for("both nodes join", SOON, || members(&reader) == ["a", "b"]);
    store(&a, 50);
    wait_for("a's segments registered", SOON, || holders_once_available(&reader, 50).is_some_and(|holders| holders == [["a"], ["a"]]));

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
    let gone = wait_for("the stale registrations are deleted at a's restart", Duration::from_secs(3), || {
        holders_once_available(&reader, 50).is_some_and(|holders| holders.is_empty())
    });
    eprintln!(
        "stale registrations deleted {gone:?} after the restart, {:?} after the kill (lease {lease:?}, at least 2/3 of it left then)",
        killed.elapsed()
    );
    // The dead process's lease still lived then (its member key is listed while the new a has
    // not joined; read in that order): the restart deleted them, not the lease's expiry, which
    // a slow restart would otherwise let pass for it.
    let listed = members(&reader);
    assert!(listed == ["a", "b"] && !a.status().joined, "the old lease ran out first ({listed:?}): the test cannot tell who deleted them");
    let tokens = common::prompt(50, PROMPT_BLOCKS, BLOCK_TOKENS);
    let mut on_b = client_of(&b, "b");
    match on_b.fetch_remote(&tokens) {
        Ok(answer) => assert_eq!(answer, (0, 0), "b fetched from a wiped pool"),
        Err(DaemonError::Remote { code: ErrorCode::RemoteReadFailed, .. }) => {}
        Err(other) => panic!("{other:?}"),
    }
    assert_eq!(on_b.lookup(&tokens).unwrap(), 0, "b stored something of the wiped prompt");
    // The old lease runs out at most a TTL after the kill; a's next join attempt follows within
    // its backoff (at most 5 s).
    wait_for("a joins once the old lease is gone", lease + SOON, || a.status().joined);
    store(&a, 51);
    wait_for("a registers what it stores now", SOON, || {
        holders_once_available(&reader, 51).is_some_and(|holders| holders == [["a"], ["a"]])
    });
    // A new session: the first one's client lease ran out while a waited.
    let mut on_b = client_of(&b, "b-again");
    assert_eq!(on_b.fetch_remote(&common::prompt(51, PROMPT_BLOCKS, BLOCK_TOKENS)).unwrap(), (32, 32));
    let wrong = common::retrieve_prompt(&mut b.connect(), 51, 0, 32).unwrap();

    store(&a, 52);
    wait_for("prompt 52 registered", SOON, || holders_once_available(&reader, 52).is_some_and(|holders| holders == [["a"], ["a"]]));
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
    wait_for("the stale entries vanish with the old lease", lease + Duration::from_secs(4), || {
        holders_once_available(&reader, 52).is_some_and(|holders| holders.is_empty())
    });
    eprintln!("stale entries of a wiped node vanished {:?} after the kill (lease {lease:?}); wrong bytes {wrong}", killed.elapsed());
    assert_eq!(client_of(&a, "a").lookup(&tokens).unwrap(), 0, "the wiped pool holds nothing of prompt 52");
    assert_eq!(wrong, 0);
}

#[test]
fn a_start_that_fails_leaves_the_manifest_as_it_was() {
    // Goal: node a (fixed data address, a lease that outlives the test) holds prompt 60; it is
    // SIGKILLed and its pool wiped, and its next start (with `--format`) fails: the data address
    // is taken, which is refused before the pool is made. The manifest must be left as it was,
    // so that the start after it still finds the segments the pool lost and deletes their
    // registrations at once — not a lease later. (The manifest was once rewritten without them
    // before the data plane was bound, so the failed start lost them for good; and the data
    // plane was once bound after the pool was formatted.) A start that fails after the pool is
    // open and the manifest checked against it (the data plane's staging area) is the daemon's
    // server::tests::a_bind_refused_after_the_socket_was_bound_removes_it_and_leaves_the_manifest.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut a = Node::new(root.path(), "a");
    (a.lease, a.timeout) = ("30s", "2s");
    a.data_address = free_address();
    a.start(&etcd, true);
    store(&a, 60);
    wait_for("a's segments registered", SOON, || holders_once_available(&reader, 60).is_some_and(|holders| holders == [["a"], ["a"]]));
    a.kill();
    std::fs::remove_file(a.directory.join("pool")).unwrap();
    let manifest = a.directory.join("segments");
    let before = std::fs::read(&manifest).unwrap();

    let taken = std::net::TcpListener::bind(&a.data_address).unwrap();
    let (exit, stderr) = a.start_failing(&etcd, true);
    assert!(!exit.success() && stderr.contains("data plane"), "{exit}: {stderr}");
    let after = std::fs::read(&manifest).unwrap();
    assert!(after == before, "the failed start rewrote the manifest: {} bytes, were {}", after.len(), before.len());
    assert_eq!(holders(&reader, 60), [["a"], ["a"]]);
    assert!(!a.directory.join("pool").exists(), "the refused start made a pool: {stderr}");

    drop(taken);
    a.start(&etcd, true);
    let gone = wait_for("the stale registrations are deleted at the next start", Duration::from_secs(5), || {
        holders_once_available(&reader, 60).is_some_and(|holders| holders.is_empty())
    });
    eprintln!("stale registrations deleted {gone:?} after the start that followed a failed one");
}
