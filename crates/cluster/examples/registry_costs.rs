//! Measures the registry's costs against a real local etcd (one member, loopback): the latency
//! of registering one committed request's segments (one transaction of S segments) and of a
//! lookup (one transaction of range reads), p50 and p99, and the bytes one registration puts
//! into etcd. docs/cluster.md quotes its output.
//!
//! `cargo run --release -p tutti-cluster --example registry_costs` (needs the etcd binary:
//! Debian's etcd-server, or TUTTI_ETCD). On loopback a round trip is tens of microseconds, so
//! what this measures is etcd's own cost per request (a write waits for its WAL fsync).

use std::time::{Duration, Instant};

use tutti_cluster::layout::{KeyLayout, SegmentRecord};
use tutti_cluster::local_etcd::LocalEtcd;
use tutti_cluster::{
    ClusterClient, ClusterConfig, ClusterId, ClusterNode, KeySecretTag, MemberRecord, ModelSpace, NodeId, Segment, SegmentBlocks,
    SegmentKey,
};

const REQUESTS: u32 = 300;

fn percentile(samples: &mut [Duration], fraction: f64) -> Duration {
    samples.sort();
    samples[((samples.len() - 1) as f64 * fraction).round() as usize]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let etcd = LocalEtcd::start(1)?;
    let cluster = ClusterId::new("bench")?;
    let segment_blocks = SegmentBlocks::new(32)?;
    let config = ClusterConfig::new(etcd.endpoints(), cluster.clone(), segment_blocks);
    let record = MemberRecord {
        node: NodeId::new("node-00")?,
        key_secret_tag: KeySecretTag::new([0x5e; 4]),
        address: "10.0.0.1:7070".into(),
        capacity_bytes: 4 << 40,
        fingerprints: vec![[5; 32]],
    };
    let node = ClusterNode::join(config.clone(), record)?;
    let reader = ClusterClient::connect(config)?;
    let space = ModelSpace::new([5; 32], 0, 1)?;
    println!("registry_costs: etcd 1 member on loopback, data dir {} ; {REQUESTS} requests per row", etcd.data_directory().display());

    let layout = KeyLayout::new(cluster.clone());
    let sample = SegmentRecord { node: NodeId::new("node-00")?, space, key: SegmentKey::new(u64::MAX)?, index: 0, segment_blocks };
    let key_bytes = layout.segment_key(&space, sample.key, &sample.node).len();
    let value_bytes = sample.encode(&cluster).len();
    println!("one holder entry: key {key_bytes} B + value {value_bytes} B (node id 7 B, cluster id 5 B)");

    let mut next_key = 1u64;
    for segments_per_request in [1usize, 4, 16, 64, 128] {
        let mut register = Vec::with_capacity(REQUESTS as usize);
        let mut lookup = Vec::with_capacity(REQUESTS as usize);
        for _ in 0..REQUESTS {
            let segments: Vec<Segment> = (0..segments_per_request)
                .map(|index| {
                    next_key += 1;
                    Segment { index: index as u32, key: SegmentKey::new(next_key).unwrap() }
                })
                .collect();
            let started = Instant::now();
            node.register(&space, &segments)?;
            register.push(started.elapsed());
            let started = Instant::now();
            let found = reader.lookup(&space, &segments)?;
            lookup.push(started.elapsed());
            assert_eq!(found.prefix_segments(), segments_per_request);
        }
        println!(
            "S = {segments_per_request:>3} segments: register p50 {:>9.3?} p99 {:>9.3?} | lookup (all hit) p50 {:>9.3?} p99 {:>9.3?}",
            percentile(&mut register, 0.5),
            percentile(&mut register, 0.99),
            percentile(&mut lookup, 0.5),
            percentile(&mut lookup, 0.99)
        );
    }
    // A lookup that misses at once (a new prompt): one range read, nothing to decode.
    let mut miss = Vec::with_capacity(REQUESTS as usize);
    for round in 0..REQUESTS {
        let segments: Vec<Segment> =
            (0..16u32).map(|index| Segment { index, key: SegmentKey::new(u64::MAX - u64::from(round * 16 + index)).unwrap() }).collect();
        let started = Instant::now();
        assert_eq!(reader.lookup(&space, &segments)?.prefix_segments(), 0);
        miss.push(started.elapsed());
    }
    println!("lookup of 16 segments, all missing: p50 {:.3?} p99 {:.3?}", percentile(&mut miss, 0.5), percentile(&mut miss, 0.99));
    println!("etcd requests sent by the reader: {}", reader.requests_sent());
    Ok(())
}
