//! The registry against one real etcd member: membership with its lease, registration and
//! lookup of segments, eviction, a dead node's segments vanishing, refused foreign records, and
//! the round-trip count of a lookup.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tutti_cluster::layout::KeyLayout;
use tutti_cluster::{
    ClusterClient, ClusterError, ClusterId, ClusterNode, KeySecretTag, MemberRecord, ModelSpace, SegmentBlocks, SegmentRecord,
    FORMAT_VERSION,
};

const CHILD_ENV: &str = "TUTTI_CLUSTER_CHILD_ENDPOINT";

/// Not a test on its own: the node process `a_dead_nodes_membership_and_segments_vanish` starts
/// (this binary run again) joins, registers, says READY and waits to be killed.
#[test]
fn child_node_entry() {
    let Ok(endpoint) = std::env::var(CHILD_ENV) else { return };
    let mut config =
        tutti_cluster::ClusterConfig::new(vec![endpoint], ClusterId::new("dying").unwrap(), SegmentBlocks::new(SEGMENT_BLOCKS).unwrap());
    config.lease_ttl = LEASE_TTL;
    config.request_timeout = REQUEST_TIMEOUT;
    let node = ClusterNode::join(config, record("doomed")).expect("child joins");
    node.register(&space(), &prompt(1, 4)).expect("child registers");
    println!("READY");
    // Bounded: the parent kills it long before this.
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn membership_appears_and_leaves_with_the_node() {
    // Goal: a joined node is listed with its record; its lease is renewed past the TTL; a
    // second node with the same id is refused; dropping the node removes it at once (revoke).
    let Some(etcd) = start_etcd(1) else { return };
    let node_a = ClusterNode::join(config(&etcd, "members"), record("a")).unwrap();
    let node_b = ClusterNode::join(config(&etcd, "members"), record("b")).unwrap();
    let members = node_a.members().unwrap();
    assert_eq!(members.nodes, vec![record("a"), record("b")]);
    assert_eq!(members.skipped_entries, 0);

    match ClusterNode::join(config(&etcd, "members"), record("a")) {
        Err(ClusterError::NodeIdTaken { node, lease_id, .. }) => {
            assert_eq!(node, "a");
            assert_eq!(lease_id, node_a.health().lease_id);
        }
        other => panic!("a second node 'a' joined: {:?}", other.map(|_| ())),
    }

    // Twice the TTL: only renewals keep it listed.
    std::thread::sleep(LEASE_TTL * 2);
    let health = node_a.health();
    assert!(!health.lost && health.renewals >= 3, "{health:?}");
    assert_eq!(node_b.members().unwrap().nodes.len(), 2);

    drop(node_a);
    assert_eq!(node_b.members().unwrap().nodes, vec![record("b")]);
}

#[test]
fn status_groups_the_members_by_their_pools_key_secret() {
    // Goal: every member record carries its pool's key secret tag as written, and status
    // groups the members by it, the largest group first: members of another secret share
    // nothing with the others, and this is where an operator sees it. One secret: one group.
    let Some(etcd) = start_etcd(1) else { return };
    let other = KeySecretTag::new([0x7e; 4]);
    let _a = ClusterNode::join(config(&etcd, "secrets"), record("a")).unwrap();
    let reader = ClusterClient::connect(config(&etcd, "secrets")).unwrap();
    assert_eq!(reader.status().unwrap().key_secret_groups(), vec![(KEY_SECRET_TAG, vec![node("a")])]);
    let _b = ClusterNode::join(config(&etcd, "secrets"), MemberRecord { key_secret_tag: other, ..record("b") }).unwrap();
    let _c = ClusterNode::join(config(&etcd, "secrets"), record("c")).unwrap();
    let members = reader.members().unwrap();
    let tags: Vec<KeySecretTag> = members.nodes.iter().map(|member| member.key_secret_tag).collect();
    assert_eq!(tags, [KEY_SECRET_TAG, other, KEY_SECRET_TAG]);
    let status = reader.status().unwrap();
    assert_eq!(status.key_secret_groups(), vec![(KEY_SECRET_TAG, vec![node("a"), node("c")]), (other, vec![node("b")])]);
}

#[test]
fn a_dead_nodes_membership_and_segments_vanish_when_its_lease_expires() {
    // Goal: a node process killed with SIGKILL (no revoke) is listed until its lease expires,
    // then its member record and its segments vanish within the TTL plus etcd's expiry tick.
    let Some(etcd) = start_etcd(1) else { return };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_node_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, &etcd.endpoints()[0])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    while !line.contains("READY") {
        line.clear();
        assert!(stdout.read_line(&mut line).unwrap() > 0, "the child node exited before READY");
    }
    let reader = ClusterClient::connect(config(&etcd, "dying")).unwrap();
    assert_eq!(reader.members().unwrap().nodes, vec![record("doomed")]);
    assert_eq!(reader.lookup(&space(), &prompt(1, 4)).unwrap().prefix_segments(), 4);

    child.kill().unwrap();
    let killed = Instant::now();
    child.wait().unwrap();
    let gone = wait_until(LEASE_TTL + Duration::from_secs(4), || {
        reader.members().unwrap().nodes.is_empty() && reader.lookup(&space(), &prompt(1, 4)).unwrap().holders.is_empty()
    });
    let gone = gone.expect("the dead node is still registered");
    eprintln!("dead node gone {:?} after SIGKILL (TTL {LEASE_TTL:?})", killed.elapsed());
    assert!(gone <= LEASE_TTL + Duration::from_secs(4));
}

#[test]
fn lookup_finds_the_longest_prefix_and_its_holders() {
    // Goal: node A holds 2 segments of a prompt, node B 5; a lookup of 8 finds 5, A and B on
    // the first 2, B alone after; a prompt that diverges after segment 3 finds 3; another model
    // space finds nothing; eviction shortens the prefix; unregistering all of A leaves B.
    let Some(etcd) = start_etcd(1) else { return };
    let node_a = ClusterNode::join(config(&etcd, "prefixes"), record("a")).unwrap();
    let node_b = ClusterNode::join(config(&etcd, "prefixes"), record("b")).unwrap();
    let whole = prompt(9, 8);
    assert_eq!(node_a.register(&space(), &whole[..2]).unwrap(), 1);
    assert_eq!(node_b.register(&space(), &whole[..5]).unwrap(), 1);

    let lookup = node_a.lookup(&space(), &whole).unwrap();
    assert_eq!(lookup.prefix_segments(), 5);
    assert_eq!(lookup.holders[0], vec![node("a"), node("b")]);
    assert_eq!(lookup.holders[1], vec![node("a"), node("b")]);
    assert_eq!(lookup.holders[4], vec![node("b")]);
    assert_eq!(lookup.holder_prefixes(), vec![(node("b"), 5), (node("a"), 2)]);
    assert_eq!(lookup.skipped_entries, 0);

    assert_eq!(node_a.lookup(&space(), &diverging_prompt(9, 3, 8)).unwrap().prefix_segments(), 3);
    let other_rank = ModelSpace::new([7; 32], 1, 2).unwrap();
    assert_eq!(node_a.lookup(&other_rank, &whole).unwrap().prefix_segments(), 0);
    let other_model = ModelSpace::new([8; 32], 0, 1).unwrap();
    assert_eq!(node_a.lookup(&other_model, &whole).unwrap().prefix_segments(), 0);

    // B evicts its segments 3 and 4: the prefix is 3 long.
    node_b.unregister(&space(), &whole[3..5]).unwrap();
    assert_eq!(node_a.lookup(&space(), &whole).unwrap().prefix_segments(), 3);
    // A evicts all it had: B alone holds the first segment.
    node_a.unregister(&space(), &whole[..2]).unwrap();
    let lookup = node_a.lookup(&space(), &whole).unwrap();
    assert_eq!(lookup.prefix_segments(), 3);
    assert_eq!(lookup.holders[0], vec![node("b")]);
    // Evicting what was never registered is no error.
    node_a.unregister(&space(), &whole[6..]).unwrap();

    let status = node_a.client().status().unwrap();
    assert_eq!(status.members.len(), 2);
    assert_eq!(status.members.iter().map(|member| member.segments).collect::<Vec<_>>(), vec![0, 3]);
    assert!(status.members.iter().all(|member| member.ttl_left_s.is_some_and(|ttl| ttl <= 2)));
    assert_eq!(status.replicas.get(&1), Some(&3));
}

#[test]
fn a_lookup_is_one_round_trip_and_a_registration_one_transaction() {
    // Goal: registering 100 segments is one etcd Txn; looking up 128 segments (etcd's default
    // --max-txn-ops) is one request — counted by etcd itself (its gRPC metrics) and by the client.
    let Some(etcd) = start_etcd(1) else { return };
    let node_a = ClusterNode::join(config(&etcd, "trips"), record("a")).unwrap();
    let reader = ClusterClient::connect(config(&etcd, "trips")).unwrap();
    let segments = prompt(3, 128);

    let before = started_requests(&etcd);
    assert_eq!(node_a.register(&space(), &segments[..100]).unwrap(), 1);
    let after_register = started_requests(&etcd);
    assert_eq!(after_register.txn - before.txn, 1, "register: {before:?} → {after_register:?}");

    let lookup = reader.lookup(&space(), &segments).unwrap();
    let after_lookup = started_requests(&etcd);
    assert_eq!(lookup.prefix_segments(), 100);
    assert_eq!(lookup.requests, 1);
    assert_eq!(after_lookup.txn - after_register.txn, 1, "lookup: {after_register:?} → {after_lookup:?}");
    assert_eq!(after_lookup.unary - after_register.unary, 1, "lookup sent other requests too");

    // 129 segments need a second transaction — but only if the first 128 all hit.
    let longer = prompt(3, 129);
    assert_eq!(reader.lookup(&space(), &longer).unwrap().requests, 1, "stops at the first chunk with a miss");
    node_a.register(&space(), &longer[100..]).unwrap();
    let lookup = reader.lookup(&space(), &longer).unwrap();
    assert_eq!((lookup.prefix_segments(), lookup.requests), (129, 2));
}

#[derive(Debug, Clone, Copy)]
struct Started {
    txn: u64,
    unary: u64,
}

/// Unary gRPC requests etcd has started, from its Prometheus metrics.
fn started_requests(etcd: &tutti_cluster::local_etcd::LocalEtcd) -> Started {
    let metrics = etcd.metrics(0).unwrap();
    let mut started = Started { txn: 0, unary: 0 };
    for line in metrics.lines().filter(|line| line.starts_with("grpc_server_started_total{")) {
        let count: u64 = line.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64;
        if line.contains("grpc_type=\"unary\"") {
            started.unary += count;
        }
        if line.contains("grpc_method=\"Txn\"") {
            started.txn += count;
        }
    }
    started
}

#[test]
fn foreign_malformed_and_other_version_records_are_refused() {
    // Goal: entries planted under the registry's keys are never trusted: garbage, another
    // cluster's record, a record copied under another segment's key, a record of another chain
    // position or segment size — all skipped and counted; a segment held only through such an
    // entry ends the prefix. Keys of another format version are not read by lookups and are
    // counted by status; a garbage member entry is skipped by members().
    let Some(etcd) = start_etcd(1) else { return };
    let cluster = ClusterId::new("guarded").unwrap();
    let layout = KeyLayout::new(cluster.clone());
    let node_a = ClusterNode::join(config(&etcd, "guarded"), record("a")).unwrap();
    let segments = prompt(5, 4);
    node_a.register(&space(), &segments[..1]).unwrap();

    let good = |index: usize, name: &str| SegmentRecord {
        node: node(name),
        space: space(),
        key: segments[index].key,
        index: segments[index].index,
        segment_blocks: SegmentBlocks::new(SEGMENT_BLOCKS).unwrap(),
    };
    let foreign = good(0, "f").encode(&ClusterId::new("other").unwrap());
    let copied = good(0, "c").encode(&cluster);
    let mut wrong_position = good(1, "p");
    wrong_position.index = 7;
    let mut wrong_size = good(1, "s");
    wrong_size.segment_blocks = SegmentBlocks::new(32).unwrap();
    let mut garbage = good(1, "g").encode(&cluster);
    garbage[10] ^= 1;
    let plants: Vec<(String, Vec<u8>)> = vec![
        (layout.segment_key(&space(), segments[0].key, &node("f")), foreign),
        (layout.segment_key(&space(), segments[1].key, &node("c")), copied),
        (layout.segment_key(&space(), segments[1].key, &node("p")), wrong_position.encode(&cluster)),
        (layout.segment_key(&space(), segments[1].key, &node("s")), wrong_size.encode(&cluster)),
        (layout.segment_key(&space(), segments[1].key, &node("g")), garbage),
        (format!("{}/x", layout.segment_key(&space(), segments[1].key, &node("k"))), good(1, "k").encode(&cluster)),
        (layout.member_key(&node("m")), b"not a member".to_vec()),
        (
            layout.segment_key(&space(), segments[1].key, &node("v")).replace(&this_version(), &version(FORMAT_VERSION - 1)),
            good(1, "v").encode(&cluster),
        ),
        // A newer version's key sorts after this version's prefix, an older one's before it:
        // status counts both ranges.
        (
            layout.segment_key(&space(), segments[1].key, &node("w")).replace(&this_version(), &version(FORMAT_VERSION + 1)),
            good(1, "w").encode(&cluster),
        ),
    ];
    put_raw(&etcd, &plants);

    let lookup = node_a.lookup(&space(), &segments).unwrap();
    assert_eq!(lookup.holders, vec![vec![node("a")]], "only the sound registration counts");
    assert_eq!(lookup.skipped_entries, 1 + 5);

    let members = node_a.members().unwrap();
    assert_eq!((members.nodes, members.skipped_entries), (vec![record("a")], 1));

    let status = node_a.client().status().unwrap();
    assert_eq!(status.other_version_keys, 2, "one older and one newer version's key");
    // Status cannot tell a record's chain position is wrong (it sees no prompt): it counts the
    // wrong-position record as a holder, and the other six as refused.
    assert_eq!(status.skipped_entries, 6);
    assert_eq!(status.holder_entries, 2);
}

/// A format version's key component, `/vN/`.
fn version(number: u16) -> String {
    format!("/v{number}/")
}

fn this_version() -> String {
    version(FORMAT_VERSION)
}

/// Writes raw key/value pairs into etcd, as a buggy or hostile writer would.
fn put_raw(etcd: &tutti_cluster::local_etcd::LocalEtcd, pairs: &[(String, Vec<u8>)]) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let mut client = etcd_client::Client::connect(etcd.endpoints(), None).await.unwrap();
        for (key, value) in pairs {
            client.put(key.as_str(), value.clone(), None).await.unwrap();
        }
    });
}

#[test]
fn a_lost_lease_is_reported_and_rejoin_restores_the_node() {
    // Goal: when etcd drops the node's lease (here revoked behind its back, as an expiry during
    // a long partition would), the keep-alive notices, registrations answer `LeaseLost` instead
    // of writing keys nobody keeps alive, and `rejoin` gives a new lease under which the node
    // and its re-registered segments are back.
    let Some(etcd) = start_etcd(1) else { return };
    let mut node_a = ClusterNode::join(config(&etcd, "relapse"), record("a")).unwrap();
    let segments = prompt(21, 3);
    node_a.register(&space(), &segments).unwrap();
    let old_lease = node_a.health().lease_id;
    etcd.revoke_lease(old_lease).unwrap();
    assert!(node_a.members().unwrap().nodes.is_empty());
    assert!(wait_until(LEASE_TTL, || node_a.health().lost).is_some(), "{:?}", node_a.health());
    match node_a.register(&space(), &segments) {
        Err(ClusterError::LeaseLost { lease_id }) => assert_eq!(lease_id, old_lease),
        other => panic!("register under a lost lease: {other:?}"),
    }
    node_a.rejoin().unwrap();
    assert_ne!(node_a.health().lease_id, old_lease);
    assert!(!node_a.health().lost);
    node_a.register(&space(), &segments).unwrap();
    assert_eq!(node_a.members().unwrap().nodes, vec![record("a")]);
    assert_eq!(node_a.lookup(&space(), &segments).unwrap().prefix_segments(), 3);
}

#[test]
fn a_member_record_is_updated_only_under_its_own_lease() {
    // Goal: a live node replaces its record (a model it now serves) in place; once its lease
    // is gone (revoked behind its back), the update is refused as `LeaseLost` and writes
    // nothing, so a dead lease's record is never brought back by an update.
    let Some(etcd) = start_etcd(1) else { return };
    let mut node_a = ClusterNode::join(config(&etcd, "update"), record("a")).unwrap();
    let mut updated = record("a");
    updated.fingerprints.push([8; 32]);
    node_a.update_record(updated.clone()).unwrap();
    assert_eq!(node_a.members().unwrap().nodes, vec![updated.clone()]);
    assert_eq!(node_a.record(), &updated);
    let mut other = record("b");
    other.fingerprints.clear();
    assert!(matches!(node_a.update_record(other), Err(ClusterError::InvalidSetting(_))));

    let old_lease = node_a.health().lease_id;
    etcd.revoke_lease(old_lease).unwrap();
    match node_a.update_record(record("a")) {
        Err(ClusterError::LeaseLost { lease_id }) => assert_eq!(lease_id, old_lease),
        other => panic!("update under a revoked lease: {other:?}"),
    }
    assert!(node_a.members().unwrap().nodes.is_empty(), "the update wrote a record without a lease");
    node_a.rejoin().unwrap();
    assert_eq!(node_a.members().unwrap().nodes, vec![updated]);
}

#[test]
fn refused_entries_that_fill_a_holder_range_are_counted_as_cutting_it_short() {
    // Goal: a lookup reads at most `holders_max` entries per segment and never pages. Entries it
    // must refuse (here another segment size, from nodes whose ids sort before the real holder)
    // can fill that limit and hide the holder: the answer is then a miss, never wrong data, and
    // the lookup says so in `ranges_cut_short` instead of passing it off as an empty registry.
    let Some(etcd) = start_etcd(1) else { return };
    let cluster = ClusterId::new("cutshort").unwrap();
    let layout = KeyLayout::new(cluster.clone());
    let node_a = ClusterNode::join(config(&etcd, "cutshort"), record("a")).unwrap();
    let segments = prompt(9, 2);
    node_a.register(&space(), &segments[..1]).unwrap();
    let other_size = |name: &str| SegmentRecord {
        node: node(name),
        space: space(),
        key: segments[0].key,
        index: segments[0].index,
        segment_blocks: SegmentBlocks::new(32).unwrap(),
    };
    let plants: Vec<(String, Vec<u8>)> = ["0", "1"]
        .iter()
        .map(|name| (layout.segment_key(&space(), segments[0].key, &node(name)), other_size(name).encode(&cluster)))
        .collect();
    put_raw(&etcd, &plants);

    let mut narrow = config(&etcd, "cutshort");
    narrow.holders_max = 2;
    let lookup = ClusterClient::connect(narrow).unwrap().lookup(&space(), &segments).unwrap();
    assert!(lookup.holders.is_empty(), "the two refused entries filled the range: {lookup:?}");
    assert_eq!((lookup.skipped_entries, lookup.ranges_cut_short), (2, 1));

    let mut wide = config(&etcd, "cutshort");
    wide.holders_max = 3;
    let lookup = ClusterClient::connect(wide).unwrap().lookup(&space(), &segments).unwrap();
    assert_eq!(lookup.holders, vec![vec![node("a")]]);
    assert_eq!((lookup.skipped_entries, lookup.ranges_cut_short), (2, 0));
}

#[test]
fn one_member_is_read_by_its_key_and_a_long_member_list_says_it_was_truncated() {
    // Goal: `member(node)` reads one key (a sound record, none, or a refused one as an error),
    // and `members()` past MEMBERS_MAX entries says `truncated` rather than passing a partial
    // list off as the whole fleet.
    let Some(etcd) = start_etcd(1) else { return };
    let layout = KeyLayout::new(ClusterId::new("crowded").unwrap());
    let node_a = ClusterNode::join(config(&etcd, "crowded"), record("a")).unwrap();
    assert_eq!(node_a.member(&node("a")).unwrap(), Some(record("a")));
    assert_eq!(node_a.member(&node("nobody")).unwrap(), None);
    put_raw(&etcd, &[(layout.member_key(&node("broken")), b"not a member".to_vec())]);
    assert!(matches!(node_a.member(&node("broken")), Err(ClusterError::MalformedRecord { .. })));
    let members = node_a.members().unwrap();
    assert!(!members.truncated);
    assert_eq!((members.nodes.len(), members.skipped_entries), (1, 1));

    // MEMBERS_MAX entries sorting before "a" ("0000" …): the two above go unread.
    let crowd: Vec<(String, Vec<u8>)> =
        (0..tutti_cluster::MEMBERS_MAX).map(|index| (layout.member_key(&node(&format!("{index:04}"))), b"x".to_vec())).collect();
    put_raw(&etcd, &crowd);
    let members = node_a.members().unwrap();
    assert!(members.truncated, "{} entries read", members.skipped_entries);
    assert_eq!(members.skipped_entries as usize, tutti_cluster::MEMBERS_MAX);
    assert!(members.nodes.is_empty(), "node a sorts after the first MEMBERS_MAX entries");
}

#[test]
fn a_node_whose_lease_lapsed_cannot_unregister_its_successors_segments() {
    // Goal: node A's lease ends behind its back (revoked here, as an expiry during a partition
    // would), perhaps before its keep-alive notices; a successor process B joins under the same node id
    // and registers the same segment. A's unregister of it must not delete B's entry: it
    // answers `LeaseLost` (and marks A lost), and the registry still lists the segment held by
    // the node; B's own unregister then removes it.
    let Some(etcd) = start_etcd(1) else { return };
    // A long lease: the keep-alive's first renewal (TTL/3 = 10 s) comes long after this test's
    // calls. The keep-alive's watch of the member key may see the revoke's delete before A's
    // unregister is sent (then A refuses it without asking etcd), or after (then the write's
    // own guard refuses it): either way B's entry must survive.
    let mut settings = config(&etcd, "successor");
    settings.lease_ttl = Duration::from_secs(30);
    let node_a = ClusterNode::join(settings.clone(), record("a")).unwrap();
    let segments = prompt(31, 2);
    node_a.register(&space(), &segments[..1]).unwrap();
    let old_lease = node_a.health().lease_id;
    etcd.revoke_lease(old_lease).unwrap();
    let node_b = ClusterNode::join(settings, record("a")).unwrap();
    node_b.register(&space(), &segments[..1]).unwrap();

    match node_a.unregister(&space(), &segments[..1]) {
        Err(ClusterError::LeaseLost { lease_id }) => assert_eq!(lease_id, old_lease),
        other => panic!("unregister under a lapsed lease: {other:?}"),
    }
    assert!(node_a.health().lost, "a refused guard marks the node lost");
    assert_eq!(node_b.lookup(&space(), &segments).unwrap().holders, vec![vec![node("a")]], "the successor's entry was deleted");
    assert!(matches!(node_a.register(&space(), &segments[1..]), Err(ClusterError::LeaseLost { .. })));
    assert_eq!(node_b.lookup(&space(), &segments).unwrap().prefix_segments(), 1, "a register under a lapsed lease wrote");

    node_b.unregister(&space(), &segments[..1]).unwrap();
    assert!(node_b.lookup(&space(), &segments).unwrap().holders.is_empty());
}

#[test]
fn entries_too_large_for_one_answer_are_skipped_and_counted_not_fatal() {
    // Goal: etcd takes values up to 1.5 MiB; three of 1.4 MiB planted under one segment's
    // holder prefix, three under the members prefix and three under another format version
    // make an answer longer than the client decodes (4 MiB). A lookup still answers — the sound
    // holder found, the three refused and counted — and so do `members()` and `status()`,
    // which never read the other version's values.
    let Some(etcd) = start_etcd(1) else { return };
    let cluster = ClusterId::new("bulky").unwrap();
    let layout = KeyLayout::new(cluster.clone());
    let node_a = ClusterNode::join(config(&etcd, "bulky"), record("a")).unwrap();
    let segments = prompt(41, 3);
    node_a.register(&space(), &segments[..2]).unwrap();
    let bulk = vec![0x5a_u8; 1400 << 10];
    let mut plants = Vec::new();
    for name in ["0", "1", "2"] {
        // Node ids that sort before "a": the range meets them first.
        plants.push((layout.segment_key(&space(), segments[0].key, &node(name)), bulk.clone()));
        plants.push((layout.member_key(&node(name)), bulk.clone()));
        plants.push((layout.member_key(&node(name)).replace(&this_version(), &version(FORMAT_VERSION - 1)), bulk.clone()));
    }
    put_raw(&etcd, &plants);

    let lookup = node_a.lookup(&space(), &segments).unwrap();
    assert_eq!(lookup.holders, vec![vec![node("a")], vec![node("a")]]);
    assert_eq!((lookup.skipped_entries, lookup.ranges_cut_short), (3, 0));

    let members = node_a.members().unwrap();
    assert_eq!((members.nodes, members.skipped_entries, members.truncated), (vec![record("a")], 3, false));

    let status = node_a.client().status().unwrap();
    assert_eq!((status.holder_entries, status.skipped_entries, status.other_version_keys), (2, 6, 3));
    assert_eq!(status.members.len(), 1);
}

#[test]
fn a_client_without_a_lease_is_not_held_to_the_lease_ttl() {
    // Goal: a request timeout of 20 s with a 10 s lease would leave a node no room to renew,
    // so `join` refuses it; a client that holds no lease (a lookup client, `tutti cluster
    // status`) renews nothing and connects, and answers.
    let Some(etcd) = start_etcd(1) else { return };
    let mut settings = config(&etcd, "leaseless");
    settings.request_timeout = Duration::from_secs(20);
    settings.lease_ttl = Duration::from_secs(10);
    let client = ClusterClient::connect(settings.clone()).expect("a client holds no lease");
    assert!(client.members().unwrap().nodes.is_empty());
    match ClusterNode::join(settings, record("a")) {
        Err(ClusterError::InvalidSetting(text)) => assert!(text.contains("no room to renew a 10 s lease"), "{text}"),
        other => panic!("a node joined with a 20 s request timeout and a 10 s lease: {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_member_key_no_live_node_holds_is_named_not_taken_for_a_holder() {
    // Goal: a member key left under no lease (an `etcdctl put` by hand: it never expires) or
    // holding a value that is no member record is not another live node: `join` answers
    // `MemberKeyBlocked` naming the key to delete, not `NodeIdTaken` (which the daemon retries
    // for ever, waiting for a lease that will never expire); once the key is deleted the node
    // joins.
    let Some(etcd) = start_etcd(1) else { return };
    let cluster = ClusterId::new("leftover").unwrap();
    let layout = KeyLayout::new(cluster.clone());
    let key = layout.member_key(&node("a"));
    let sound = record("a").encode(&cluster).unwrap();
    for (value, reason) in [(sound, "under no lease"), (b"not a member".to_vec(), "does not decode")] {
        put_raw(&etcd, &[(key.clone(), value)]);
        match ClusterNode::join(config(&etcd, "leftover"), record("a")) {
            Err(error @ ClusterError::MemberKeyBlocked { .. }) => {
                let text = error.to_string();
                assert!(text.contains(&key) && text.contains("delete"), "{reason}: {text}");
                let ClusterError::MemberKeyBlocked { key: named, .. } = error else { unreachable!() };
                assert_eq!(named, key, "{reason}");
            }
            other => panic!("{reason}: {:?}", other.map(|_| ())),
        }
    }
    delete_raw(&etcd, &key);
    let node_a = ClusterNode::join(config(&etcd, "leftover"), record("a")).unwrap();
    assert_eq!(node_a.members().unwrap().nodes, vec![record("a")]);
}

#[test]
fn a_member_key_too_large_to_read_is_named_not_an_opaque_etcd_error() {
    // Goal: a member key holding a value longer than an answer may be (4 MiB; etcd takes it
    // with a larger --max-request-bytes) is no member record: `join` answers
    // `MemberKeyBlocked` naming the key to delete, as `member()` refuses it, not an opaque
    // `Etcd { OutOfRange }` the operator cannot act on; once it is deleted the node joins.
    let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip_with_flags(1, &["--max-request-bytes", "6291456"]) else {
        return;
    };
    let key = KeyLayout::new(ClusterId::new("bulky-member").unwrap()).member_key(&node("a"));
    put_raw(&etcd, &[(key.clone(), vec![0x5a; 4608 << 10])]);
    match ClusterNode::join(config(&etcd, "bulky-member"), record("a")) {
        Err(error @ ClusterError::MemberKeyBlocked { .. }) => {
            let text = error.to_string();
            assert!(text.contains(&key) && text.contains("larger than an answer"), "{text}");
        }
        other => panic!("a member key too large to read: {:?}", other.map(|_| ())),
    }
    delete_raw(&etcd, &key);
    let node_a = ClusterNode::join(config(&etcd, "bulky-member"), record("a")).unwrap();
    assert_eq!(node_a.members().unwrap().nodes, vec![record("a")]);
}

/// Deletes one key behind the registry's back, as an operator would with `etcdctl del`.
fn delete_raw(etcd: &tutti_cluster::local_etcd::LocalEtcd, key: &str) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let mut client = etcd_client::Client::connect(etcd.endpoints(), None).await.unwrap();
        client.delete(key, None).await.unwrap();
    });
}

#[test]
fn forget_deletes_only_while_no_live_process_holds_the_node_id() {
    // Goal: `forget` is for a crashed node's successor, before it joins. Node A joins and
    // registers S; a second process with A's node id forgets S naming another lease (or none):
    // A is alive under its own lease, so S stays registered and the answer is `NodeIdTaken`
    // naming A's lease. Naming A's lease (the successor of A, its predecessor's lease recorded)
    // deletes S; so does any forget once A's member key is gone.
    let Some(etcd) = start_etcd(1) else { return };
    let node_a = ClusterNode::join(config(&etcd, "forget"), record("a")).unwrap();
    let lease_a = node_a.health().lease_id;
    let segments = prompt(41, 2);
    node_a.register(&space(), &segments).unwrap();
    let other = ClusterClient::connect(config(&etcd, "forget")).unwrap();
    for recorded in [0, lease_a + 1] {
        match other.forget(&node("a"), recorded, &space(), &segments[..1]) {
            Err(ClusterError::NodeIdTaken { lease_id, .. }) => assert_eq!(lease_id, lease_a, "recorded {recorded:#x}"),
            result => panic!("forget with lease {recorded:#x} recorded while A lives: {result:?}"),
        }
        assert_eq!(other.lookup(&space(), &segments).unwrap().prefix_segments(), 2, "A's live entry was deleted");
    }
    assert_eq!(other.forget(&node("a"), lease_a, &space(), &segments[..1]).unwrap(), 1);
    assert!(other.lookup(&space(), &segments).unwrap().holders.is_empty(), "the predecessor's lease recorded: deleted");
    // A's member key gone (its lease revoked): nothing holds the id, so whatever was recorded.
    // An entry under no lease (so it outlives A's) shows whether the forget deleted.
    etcd.revoke_lease(lease_a).unwrap();
    let cluster = ClusterId::new("forget").unwrap();
    let entry = SegmentRecord {
        node: node("a"),
        space: space(),
        key: segments[0].key,
        index: segments[0].index,
        segment_blocks: SegmentBlocks::new(SEGMENT_BLOCKS).unwrap(),
    };
    put_raw(&etcd, &[(KeyLayout::new(cluster.clone()).segment_key(&space(), segments[0].key, &node("a")), entry.encode(&cluster))]);
    assert_eq!(other.lookup(&space(), &segments).unwrap().prefix_segments(), 1);
    assert_eq!(other.forget(&node("a"), 0, &space(), &segments[..1]).unwrap(), 1);
    assert!(other.lookup(&space(), &segments).unwrap().holders.is_empty(), "no member key: deleted");
}

#[test]
fn an_idle_node_whose_member_key_was_deleted_notices_within_its_lease() {
    // Goal: the member key deleted behind a live node's back (an operator's `etcdctl del`, a
    // buggy tool) while the node makes no write: the lease lives on and its renewals succeed,
    // so only the key itself can tell. The keep-alive watches it and marks the node lost
    // within the TTL, so that the owner's rejoin puts the record back; before, the node stayed
    // unlisted and its segments listed (peers chose it and found no data address) until it
    // happened to write.
    let Some(etcd) = start_etcd(1) else { return };
    let settings = config(&etcd, "unkeyed");
    let layout = KeyLayout::new(settings.cluster.clone());
    let mut node_a = ClusterNode::join(settings, record("a")).unwrap();
    let segments = prompt(41, 2);
    node_a.register(&space(), &segments).unwrap();
    delete_raw(&etcd, &layout.member_key(&node("a")));
    assert!(node_a.members().unwrap().nodes.is_empty());
    let noticed = wait_until(LEASE_TTL, || node_a.health().lost);
    assert!(noticed.is_some(), "an idle node never noticed its member key was gone: {:?}", node_a.health());
    assert!(matches!(node_a.register(&space(), &segments), Err(ClusterError::LeaseLost { .. })));
    node_a.rejoin().unwrap();
    node_a.register(&space(), &segments).unwrap();
    assert_eq!(node_a.members().unwrap().nodes, vec![record("a")]);
    assert_eq!(node_a.lookup(&space(), &segments).unwrap().prefix_segments(), 2);
}

#[test]
fn a_lookups_request_count_is_its_own_while_other_threads_look_up_too() {
    // Goal: `Lookup::requests` is what that lookup sent (here 1: one chunk, no retry), also
    // while other threads share the client and look up at the same time (tuttid's connection
    // threads do). It was the difference of the client's counter, shared by every thread, so
    // a lookup counted the others' requests sent meanwhile.
    let Some(etcd) = start_etcd(1) else { return };
    let node_a = ClusterNode::join(config(&etcd, "counted"), record("a")).unwrap();
    let segments = prompt(51, 4);
    node_a.register(&space(), &segments).unwrap();
    let reader = ClusterClient::connect(config(&etcd, "counted")).unwrap();
    let counts: Vec<u64> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| (0..50).map(|_| reader.lookup(&space(), &segments).unwrap().requests).collect::<Vec<u64>>()))
            .collect();
        threads.into_iter().flat_map(|thread| thread.join().unwrap()).collect()
    });
    assert_eq!(counts.len(), 200);
    assert!(counts.iter().all(|&requests| requests == 1), "request counts of single-request lookups: {counts:?}");
}

#[test]
fn endpoints_set_without_new_connect_as_their_normal_form() {
    // Goal: an endpoint set on `ClusterConfig::endpoints` directly (not through `new`, which
    // normalizes) in a form validation accepts, `HTTP://HOST:PORT` or `HOST:PORT`, still
    // reaches etcd: etcd-client matches `http://` in lower case only and would have dialled
    // `http://HTTP://HOST:PORT`.
    let Some(etcd) = start_etcd(1) else { return };
    let endpoint = etcd.endpoints()[0].clone();
    let address = endpoint.strip_prefix("http://").expect("a local etcd's endpoint is http://").to_string();
    for written in [format!("HTTP://{address}"), address.clone()] {
        let mut config = config(&etcd, "spelled");
        config.endpoints = vec![written.clone()];
        let client = ClusterClient::connect(config).unwrap_or_else(|error| panic!("{written}: {error}"));
        client.members().unwrap_or_else(|error| panic!("{written}: {error}"));
    }
}
