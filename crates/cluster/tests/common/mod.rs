//! Shared fixture of the cluster tests: a real etcd, settings with a short lease, prompts.
#![allow(dead_code)]

use std::time::Duration;

use objstore::hash::{block_keys, KeyChain, KeySecret};
use tutti_cluster::local_etcd::LocalEtcd;
use tutti_cluster::{segments_of, ClusterConfig, ClusterId, KeySecretTag, MemberRecord, ModelSpace, NodeId, Segment, SegmentBlocks};

pub const BLOCK_TOKENS: u32 = 16;
pub const SEGMENT_BLOCKS: u16 = 16;
pub const LEASE_TTL: Duration = Duration::from_secs(2);
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(1);
/// The key secret tag every test member record carries unless a test says otherwise.
pub const KEY_SECRET_TAG: KeySecretTag = KeySecretTag::new([0x5e; 4]);

/// A real etcd of `members` members, or None where etcd is not installed (see
/// [`LocalEtcd::start_or_skip`]).
pub fn start_etcd(members: usize) -> Option<LocalEtcd> {
    LocalEtcd::start_or_skip(members)
}

pub fn config(etcd: &LocalEtcd, cluster: &str) -> ClusterConfig {
    let mut config = ClusterConfig::new(etcd.endpoints(), ClusterId::new(cluster).unwrap(), SegmentBlocks::new(SEGMENT_BLOCKS).unwrap());
    config.lease_ttl = LEASE_TTL;
    config.request_timeout = REQUEST_TIMEOUT;
    config
}

pub fn record(node: &str) -> MemberRecord {
    MemberRecord {
        node: NodeId::new(node).unwrap(),
        key_secret_tag: KEY_SECRET_TAG,
        address: format!("127.0.0.1:7{:03}", node.len()),
        capacity_bytes: 1 << 40,
        fingerprints: vec![[7; 32]],
    }
}

pub fn node(name: &str) -> NodeId {
    NodeId::new(name).unwrap()
}

pub fn space() -> ModelSpace {
    ModelSpace::new([7; 32], 0, 1).unwrap()
}

/// `segments` full segments of a prompt whose tokens start with `tokens_seed` then count up
/// (two prompts with the same seed share every segment up to the shorter one's end).
pub fn prompt(tokens_seed: u32, segments: usize) -> Vec<Segment> {
    diverging_prompt(tokens_seed, segments, segments)
}

/// A prompt sharing `shared` leading segments with `prompt(tokens_seed, ..)`, then diverging.
pub fn diverging_prompt(tokens_seed: u32, shared: usize, segments: usize) -> Vec<Segment> {
    let per_segment = u32::from(SEGMENT_BLOCKS) * BLOCK_TOKENS;
    let tokens: Vec<u32> = (0..segments as u32 * per_segment)
        .map(|position| {
            let base = tokens_seed.wrapping_mul(1_000_003).wrapping_add(position);
            if position < shared as u32 * per_segment {
                base
            } else {
                base ^ 0x8000_0000
            }
        })
        .collect();
    let mut keys = Vec::new();
    block_keys(&KeyChain::new(&KeySecret::from_bytes([0x5e; 32]).unwrap(), 0x5eed), &tokens, BLOCK_TOKENS, &mut keys);
    let mut out = Vec::new();
    segments_of(&keys, SegmentBlocks::new(SEGMENT_BLOCKS).unwrap(), &mut out).unwrap();
    out
}

/// Polls `condition` every 50 ms until it holds or `timeout` passes; the time it took.
pub fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> Option<Duration> {
    let started = std::time::Instant::now();
    while started.elapsed() < timeout {
        if condition() {
            return Some(started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}
