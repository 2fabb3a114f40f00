//! `tutti cluster status` against a real etcd: what two nodes registered, as a user reads it;
//! exit status 1 when etcd does not answer (within the timeout), 2 for unusable options.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use tutti_cluster::local_etcd::LocalEtcd;
use tutti_cluster::{
    ClusterConfig, ClusterId, ClusterNode, KeySecretTag, MemberRecord, ModelSpace, NodeId, Segment, SegmentBlocks, SegmentKey,
};

fn tutti(arguments: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tutti")).args(arguments).output().expect("the built binary runs")
}

fn start_etcd() -> Option<LocalEtcd> {
    LocalEtcd::start_or_skip(1)
}

fn join(etcd: &LocalEtcd, node: &str) -> ClusterNode {
    join_tagged(etcd, node, KeySecretTag::new([0x5e; 4]))
}

/// [`join`], its member record naming the key secret tag given.
fn join_tagged(etcd: &LocalEtcd, node: &str, key_secret_tag: KeySecretTag) -> ClusterNode {
    let mut config = ClusterConfig::new(etcd.endpoints(), ClusterId::new("fleet").unwrap(), SegmentBlocks::new(16).unwrap());
    config.request_timeout = Duration::from_secs(1);
    config.lease_ttl = Duration::from_secs(5);
    let record = MemberRecord {
        node: NodeId::new(node).unwrap(),
        key_secret_tag,
        address: format!("10.0.0.{}:7070", node.len()),
        capacity_bytes: 1 << 40,
        fingerprints: vec![[3; 32]],
    };
    ClusterNode::join(config, record).unwrap()
}

fn segments(count: u32) -> Vec<Segment> {
    (0..count).map(|index| Segment { index, key: SegmentKey::new(u64::from(index) + 100).unwrap() }).collect()
}

#[test]
fn status_shows_members_leases_segments_and_replicas() {
    // Goal: node a holds 3 segments, node bb holds the first 5: status lists both with their
    // address, a live lease and segment counts, 5 distinct segments, 3 with 2 replicas (held
    // by a and bb), 2 held by bb alone. Each member's key secret tag ends its line; while
    // the members agree on it nothing more is said, and once bb's differs a warning names
    // each secret's members.
    let Some(etcd) = start_etcd() else { return };
    let space = ModelSpace::new([3; 32], 0, 1).unwrap();
    let endpoint = &etcd.endpoints()[0];
    let status = || tutti(&["cluster", "status", "--etcd", endpoint, "--cluster", "fleet", "--segment-blocks", "16"]);
    let node_a = join(&etcd, "a");
    let node_c = join(&etcd, "c");
    let agreeing = status();
    let text = String::from_utf8_lossy(&agreeing.stdout);
    assert!(text.contains("key secret") && !text.contains("WARNING"), "{text}");
    drop(node_c);
    let node_b = join_tagged(&etcd, "bb", KeySecretTag::new([0x7e; 4]));
    node_a.register(&space, &segments(3)).unwrap();
    node_b.register(&space, &segments(5)).unwrap();
    let output = status();
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&output.stderr));
    assert!(text.contains(&format!("cluster fleet (registry format v{}): 2 members", tutti_cluster::FORMAT_VERSION)), "{text}");
    let line_a = text.lines().find(|line| line.trim_start().starts_with("a ")).expect(&text);
    assert!(line_a.contains("10.0.0.1:7070") && line_a.contains(" 3 ") && line_a.contains(" s "), "{line_a}");
    let line_b = text.lines().find(|line| line.trim_start().starts_with("bb ")).expect(&text);
    assert!(line_b.contains(" 5 "), "{line_b}");
    assert!(line_a.ends_with(" 5e5e5e5e") && line_b.ends_with(" 7e7e7e7e"), "{text}");
    assert!(text.contains("WARNING: the members' pools have 2 different key secrets"), "{text}");
    assert!(text.contains("  key secret 5e5e5e5e: a\n  key secret 7e7e7e7e: bb\n"), "{text}");
    assert!(text.contains("segments: 5 distinct, 8 holder entries"), "{text}");
    assert!(text.contains("replicas: 1x: 2, 2x: 3"), "{text}");
    // Per holder set: which nodes hold how many segments, the largest set first.
    let sets: Vec<&str> = text.lines().skip_while(|line| !line.starts_with("segments per holder set")).skip(1).take(2).collect();
    assert_eq!(sets.len(), 2, "{text}");
    assert!(sets[0].contains("3 segment(s), 2 replica(s): a bb"), "{text}");
    assert!(sets[1].contains("2 segment(s), 1 replica(s): bb"), "{text}");
    assert!(text.contains("refused entries: 0"), "{text}");
}

#[test]
fn status_exits_1_when_etcd_does_not_answer_and_2_for_bad_options() {
    // Goal: a port nobody listens on is "unavailable" (exit 1) within the timeout asked; a
    // cluster id that cannot be a key, or a segment size out of range, is unusable input (2).
    let started = Instant::now();
    let output = tutti(&["cluster", "status", "--etcd", "http://127.0.0.1:9", "--timeout-ms", "500"]);
    let text = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains("unavailable"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    for bad in [["--cluster", "Bad/Id"], ["--segment-blocks", "8"]] {
        let mut arguments = vec!["cluster", "status", "--etcd", "http://127.0.0.1:9"];
        arguments.extend_from_slice(&bad);
        let output = tutti(&arguments);
        assert_eq!(output.status.code(), Some(2), "{}", String::from_utf8_lossy(&output.stderr));
    }
}

#[test]
fn status_takes_its_documented_timeout_range() {
    // Goal: status holds no lease, so its timeout is bound only by the stated 10..=60000 ms:
    // 20 s used to be refused with a message about renewing a lease (the default 10 s TTL);
    // the range is in --help, and outside it is unusable input naming it.
    let help = tutti(&["cluster", "status", "--help"]);
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("10..=60000"), "{text}");
    for outside in ["9", "60001"] {
        let output = tutti(&["cluster", "status", "--etcd", "http://127.0.0.1:9", "--timeout-ms", outside]);
        let text = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{outside}: {text}");
        assert!(text.contains("--timeout-ms") && text.contains("10..=60000"), "{outside}: {text}");
    }
    let Some(etcd) = start_etcd() else { return };
    let output = tutti(&["cluster", "status", "--etcd", &etcd.endpoints()[0], "--timeout-ms", "20000"]);
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
}

#[test]
fn an_etcd_url_that_cannot_be_one_is_unusable_input() {
    // Goal: --etcd values no etcd can be reached at were exit 1 (as if etcd were down), and a
    // port past 65535 silently connected to port 80: each is unusable input (2), naming it.
    for bad in ["", "http://", "https://127.0.0.1:2379", "http://127.0.0.1:99999", "http://127.0.0.1", "ftp://127.0.0.1:2379"] {
        let output = tutti(&["cluster", "status", "--etcd", bad, "--timeout-ms", "500"]);
        let text = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{bad:?}: {text}");
        assert!(text.contains("etcd endpoint") && text.contains(&format!("'{bad}'")), "{bad:?}: {text}");
    }
}
