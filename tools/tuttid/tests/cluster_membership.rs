//! tuttid as a cluster node against a real etcd (`LocalEtcd`, loopback), membership and
//! registration: a node joins at start, registers the segments its commits complete (after the
//! commit: never a store only written, nor one released), unregisters what eviction breaks,
//! leaves on SIGTERM, vanishes within its lease after SIGKILL, and registers again what survived
//! after a restart and after a lost lease; etcd's absence never fails or slows a commit; a
//! commit queued when SIGTERM comes is journalled and registered at the next start; a stopping
//! node leaves at once, a connection still finishing its frame; a SIGKILLed
//! holder, listed until its lease expires, is passed over for another; bad cluster options are
//! refused before the daemon opens anything.
//! Every wait is bounded. Skipped (with a note) where no etcd is installed, unless
//! TUTTI_REQUIRE_ETCD=1 (the cluster stage of tools/test.sh). The nodes and the registry reader
//! are `common::cluster`'s (16-block segments, 48-slot pools, a 2 s lease unless a test sets one).

use std::time::{Duration, Instant};

use gio_uring::SmBudget;
use objstore::{KvRequest, LayerKvStore};
use tutti_cluster::local_etcd::LocalEtcd;
use tutti_daemon::client::RemoteKvStore;

mod common;
use common::cluster::{
    holders, holders_once_available, members, model, reader, store, wait_for, Node, BLOCK_TOKENS, CLUSTER, LEASE, PROMPT_BLOCKS, SOON,
};

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
    wait_for("prompt 1's segments are registered", SOON, || {
        holders_once_available(&reader, 1).is_some_and(|holders| holders == [["a"], ["a"]])
    });
    let status = node.status();
    assert!(status.enabled && status.joined, "{status:?}");
    assert_eq!((status.segments_held, status.segments_registered, status.registered_segments), (2, 2, 2));
    assert_eq!(status.registration_transactions, 1, "one committed request, one transaction");
    wait_for("the record lists the model", SOON, || reader.members().unwrap().nodes[0].fingerprints == [*model().fingerprint()]);

    store(&node, 2);
    wait_for("prompt 2 registered, prompt 1 (evicted) unregistered", SOON, || {
        holders_once_available(&reader, 2).is_some_and(|holders| holders == [["a"], ["a"]])
            && holders_once_available(&reader, 1).is_some_and(|holders| holders.is_empty())
    });
    let status = node.status();
    assert_eq!((status.segments_held, status.unregistered_segments), (2, 2), "{status:?}");

    let (exit, stderr) = node.daemon.take().unwrap().terminate();
    assert!(exit.success(), "{exit}: {stderr}");
    assert!(members(&reader).is_empty(), "a node that left is still listed");
    assert!(holders(&reader, 2).is_empty(), "a node that left still holds segments");

    node.start(&etcd, false);
    wait_for("the restarted node registers what survived", SOON, || {
        holders_once_available(&reader, 2).is_some_and(|holders| holders == [["a"], ["a"]])
    });
    assert!(holders(&reader, 1).is_empty(), "evicted before the restart: never registered again");
    assert_eq!(node.status().segments_held, 2);

    node.kill();
    let vanished = wait_for("a killed node vanishes within its lease", LEASE + Duration::from_secs(4), || {
        members(&reader).is_empty() && holders_once_available(&reader, 2).is_some_and(|holders| holders.is_empty())
    });
    eprintln!("a SIGKILLed node vanished after {vanished:?} (lease {LEASE:?})");

    node.start(&etcd, false);
    wait_for("registered again", SOON, || holders_once_available(&reader, 2).is_some_and(|holders| holders == [["a"], ["a"]]));
    node.kill();
    // At once: the dead process's lease still holds the id.
    node.start(&etcd, false);
    wait_for("registered again after the dead lease expired", LEASE + SOON, || {
        holders_once_available(&reader, 2).is_some_and(|holders| holders == [["a"], ["a"]]) && node.status().joined
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
    wait_for("registered after the commit", SOON, || holders_once_available(&reader, 7).is_some_and(|holders| holders == [["d"], ["d"]]));
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
    wait_for("registered once etcd is back", Duration::from_secs(6) + SOON, || {
        holders_once_available(&reader, 6).is_some_and(|holders| holders == [["b"], ["b"]])
    });
    assert!(holders(&reader, 5).is_empty());
    let status = node.status();
    assert!(status.joined && status.segments_registered == 2, "{status:?}");
}

#[test]
fn a_commit_queued_when_sigterm_comes_is_journalled_and_registered_at_the_next_start() {
    // Goal: a store committed while the registrar waits on a registry call (etcd killed: here
    // 2 s, its request timeout) and followed at once by SIGTERM is journalled in the manifest
    // before the node leaves, so the next start registers it. Before, the registrar saw the
    // stop with the commit still queued and left without it: its segments were never
    // registered for the life of the pool.
    let Some(mut etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut node = Node::new(root.path(), "e");
    (node.lease, node.timeout) = ("3s", "2s");
    node.start(&etcd, true);
    wait_for("node e joins", SOON, || members(&reader) == ["e"]);
    etcd.kill(0).unwrap();
    // Prompt 8's segments send the registrar into a registry call that waits out its timeout.
    store(&node, 8);
    std::thread::sleep(Duration::from_millis(300));
    store(&node, 9);
    let (status, stderr) = node.daemon.take().unwrap().terminate();
    assert!(status.success(), "{stderr}");
    etcd.restart(0).unwrap();
    node.start(&etcd, false);
    wait_for("prompt 9 registered from the manifest", LEASE + 2 * SOON, || {
        common::cluster::holders_once_available(&reader, 9).is_some_and(|holders| holders == [["e"], ["e"]])
    });
}

#[test]
fn a_node_stopping_leaves_the_cluster_at_once_while_a_connection_still_finishes() {
    // Goal: on SIGTERM the node leaves the cluster (its lease revoked: record and segments
    // gone) at once, not after its connection threads end. Its data plane stops serving within
    // a tick, so a peer still listing it would fetch from an address that refuses. A client
    // one byte into a frame holds its connection thread for the frame timeout (10 s here);
    // before, the registrar waited for that thread (journalling its last commits) with the
    // lease kept alive, and the node stayed listed for the whole wait.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut node = Node::new(root.path(), "f");
    node.extra = vec!["--frame-timeout", "10s"];
    node.start(&etcd, true);
    store(&node, 12);
    wait_for("prompt 12 registered", SOON, || holders_once_available(&reader, 12).is_some_and(|holders| holders == [["f"], ["f"]]));
    let mut daemon = node.daemon.take().unwrap();
    let mut stalled = std::os::unix::net::UnixStream::connect(&daemon.socket).unwrap();
    std::io::Write::write_all(&mut stalled, &[0]).unwrap();
    // Accepted, and the byte read (the frame's deadline running), within a few ticks.
    std::thread::sleep(Duration::from_millis(300));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(daemon.pid() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    let left = wait_for("the stopping node leaves the cluster", Duration::from_secs(3), || {
        members(&reader).is_empty() && holders_once_available(&reader, 12).is_some_and(|holders| holders.is_empty())
    });
    eprintln!("the node left {left:?} after SIGTERM, a connection still in a frame");
    let exit = common::wait_bounded(daemon.child.as_mut().unwrap());
    assert!(exit.success(), "{exit}: {}", daemon.stderr());
    drop(stalled);
}

#[test]
fn a_sigkilled_holder_still_listed_is_passed_over_for_another_holder() {
    // Goal: a SIGKILLed node stays listed as a holder until its lease expires. A fetch whose
    // first holder is that node (a, the longest run: both segments of prompt 11) is refused at
    // connect before a block is stored and goes on to the next holder listed (b, the first
    // segment): c stores b's 16 blocks. Before, the fetch read from the first holder only and
    // failed while a replica was listed.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let (mut a, mut b, mut c) = (Node::new(root.path(), "a"), Node::new(root.path(), "b"), Node::new(root.path(), "c"));
    a.lease = "30s";
    for node in [&mut a, &mut b, &mut c] {
        node.start(&etcd, true);
    }
    wait_for("the three nodes join", SOON, || members(&reader) == ["a", "b", "c"]);
    store(&a, 11);
    let mut store_b = b.connect();
    assert_eq!(common::store_prompt(&mut store_b, 11, 0, 20).unwrap(), 20);
    wait_for("a's two segments and b's first registered", SOON, || {
        holders_once_available(&reader, 11).is_some_and(|holders| holders == [vec!["a", "b"], vec!["a"]])
    });
    a.kill();
    let tokens = common::prompt(11, PROMPT_BLOCKS, BLOCK_TOKENS);
    let mut on_c = common::cluster::client_of(&c, "fetch-c");
    assert_eq!(on_c.fetch_remote(&tokens).unwrap(), (16, 16), "the fetch passed a over for b");
    assert_eq!(holders(&reader, 11), [vec!["a", "b"], vec!["a"]], "a was listed all along (its lease lives)");
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
    wait_for("registered", SOON, || holders_once_available(&reader, 4).is_some_and(|holders| holders == [["c"], ["c"]]));
    let old_lease = node.status().lease_id;
    etcd.revoke_lease(old_lease as i64).unwrap();
    assert!(holders(&reader, 4).is_empty(), "revoking the lease removes the node's segments");
    wait_for("rejoined and registered again", LEASE + SOON, || {
        holders_once_available(&reader, 4).is_some_and(|holders| holders == [["c"], ["c"]])
    });
    let status = node.status();
    assert_ne!(status.lease_id, old_lease);
    assert_eq!((status.joins, status.lease_losses, status.segments_registered), (2, 1, 2), "{status:?}");
    assert_eq!(members(&reader), ["c"]);
}

#[test]
fn a_lease_lost_once_is_counted_once_however_many_rejoins_fail() {
    // Goal: one loss etcd reports is one `lease_losses`, however many rejoin attempts fail
    // before one succeeds, and the node reports nothing registered while it has no lease.
    // The member key is put under no lease behind the node's back (an operator's `etcdctl
    // put`): its watch sees the key leave its lease (the loss), and every rejoin is refused
    // (a key under no lease never expires) until the key is deleted 3 s later. Before, each
    // failed attempt counted another loss (a rejoin marks the node lost until it succeeds),
    // and the old lease's 2 segments stayed in `segments_registered`.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut node = Node::new(root.path(), "e");
    node.start(&etcd, true);
    store(&node, 8);
    wait_for("registered", SOON, || holders_once_available(&reader, 8).is_some_and(|holders| holders == [["e"], ["e"]]));
    let member_key = tutti_cluster::layout::KeyLayout::new(tutti_cluster::ClusterId::new(CLUSTER).unwrap())
        .member_key(&tutti_cluster::NodeId::new("e").unwrap());
    etcd.put_key(&member_key, b"planted").unwrap();
    wait_for("the node's rejoins are refused", SOON, || node.status().last_error.contains("no lease"));
    std::thread::sleep(Duration::from_secs(3));
    let status = node.status();
    assert!(!status.joined && status.registry_errors >= 3, "{status:?}");
    assert_eq!((status.lease_losses, status.segments_registered), (1, 0), "{status:?}");
    etcd.delete_key(&member_key).unwrap();
    wait_for("rejoined and registered again", SOON, || {
        holders_once_available(&reader, 8).is_some_and(|holders| holders == [["e"], ["e"]]) && node.status().joined
    });
    let status = node.status();
    assert_eq!((status.joins, status.lease_losses, status.segments_registered), (2, 1, 2), "{status:?}");
}

#[test]
fn a_second_daemon_on_a_live_nodes_manifest_is_refused_and_deletes_nothing() {
    // Goal: two tuttids given one --cluster-state (the docs' `--node-id "$(hostname -s)"` and
    // `--cluster-state /var/lib/tutti/segments` for two daemons of one host, each with its own
    // pool, socket and data address) cannot both run on it. The second finds the first's
    // segments missing from its fresh pool; before, it deleted their registrations under the
    // lease the first had recorded (gone within ~0.2 s) and renamed its manifest over the
    // first's. Now it is refused at start (exit 2), naming the manifest's lock file and, where
    // /proc/locks shows it, the first daemon; the first's segments stay listed.
    let Some(etcd) = LocalEtcd::start_or_skip(1) else { return };
    let root = tempfile::tempdir().unwrap();
    let reader = reader(&etcd);
    let mut first = Node::new(root.path(), "a");
    first.start(&etcd, true);
    store(&first, 1);
    wait_for("the first daemon's segments are registered", SOON, || {
        holders_once_available(&reader, 1).is_some_and(|holders| holders == [["a"], ["a"]])
    });
    let mut second = Node::new(&root.path().join("second"), "a");
    second.manifest = first.manifest.clone();
    let mut daemon = second.spawn(&etcd, true);
    let started = Instant::now();
    let exit = loop {
        assert_eq!(holders(&reader, 1), [["a"], ["a"]], "the first daemon's segments went {:?} after the second start", started.elapsed());
        if let Some(exit) = daemon.child.as_mut().unwrap().try_wait().unwrap() {
            break exit;
        }
        assert!(started.elapsed() < common::WAIT, "the second daemon is still running after {:?}", common::WAIT);
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = daemon.stderr();
    eprintln!("the second daemon: {exit}: {}", stderr.trim());
    let lock = format!("{}.lock", first.manifest.display());
    assert_eq!(exit.code(), Some(2), "{stderr}");
    assert!(stderr.contains("in use") && stderr.contains(&lock), "{stderr}");
    let pid = first.daemon().pid();
    if tutti_devices::lock::lists_flock_exactly(std::path::Path::new(&lock), pid) {
        assert!(stderr.contains(&format!("pid {pid}")), "the holder is not named: {stderr}");
    } else {
        eprintln!("/proc/locks does not list the first daemon's lock on {lock} exactly: its naming is not checked");
    }
    std::thread::sleep(Duration::from_secs(3).saturating_sub(started.elapsed()));
    assert_eq!(holders(&reader, 1), [["a"], ["a"]], "the first daemon's segments went after the second exited");
    let status = first.status();
    assert!(status.joined && status.segments_registered == 2, "{status:?}");
    let (exit, stderr) = first.daemon.take().unwrap().terminate();
    assert!(exit.success(), "{exit}: {stderr}");
    first.start(&etcd, false);
    wait_for("a restart on the manifest finds its segments", SOON, || {
        holders_once_available(&reader, 1).is_some_and(|holders| holders == [["a"], ["a"]])
    });
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
