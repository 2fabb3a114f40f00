//! `LookupCluster`: the local prefix first, then one registry round trip for what lies beyond.
//!
//! The local index answers as `Lookup` does. Only when the prompt has a full segment past the
//! local prefix is the registry asked — for the segments from the one the local prefix ends in
//! (a segment is fetched whole, so a partly local one counts from its start) — in one etcd
//! transaction: at most `txn_ops_max` segments are asked ([`segments_to_ask`]), since the
//! registry client spends a transaction, each with the whole lookup timeout, per
//! `txn_ops_max`; what lies past them is found by a later lookup, once these are local. This
//! node's own entries are left out: what it registered it holds locally, and an entry of its
//! own past the local prefix is stale. Holders are listed longest run first; among runs of one
//! length the order is this node's own, by a hash of (this node, the first segment asked, the
//! holder) ([`spread_of`]): every asker reading from the lowest node id would make that holder
//! of a replicated segment serve them all.
//!
//! The registry is asked on the connection's thread, bounded by the lookup timeout (shorter
//! than the registrar's: a client waits for it). A failed or late answer is `Unavailable`, and
//! for [`LOOKUP_PAUSE`] afterwards lookups do not ask (answered `Unavailable` at once, counted
//! as skipped), so a registry that is down costs one timeout per pause, not one per lookup.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tutti_cluster::{segments_of, ClusterClient, ClusterConfig, KeySecretTag, Lookup, ModelSpace, NodeId, SegmentBlocks};

use super::{ClusterMetrics, RemotePart};
use crate::protocol::{RegistryAnswer, RemoteHolder, REMOTE_HOLDERS_MAX};

/// After a failed lookup, the registry is not asked again for this long.
pub const LOOKUP_PAUSE: Duration = Duration::from_secs(1);

impl RemotePart {
    fn unavailable() -> RemotePart {
        RemotePart { registry: RegistryAnswer::Unavailable, remote_blocks: 0, holders: Vec::new() }
    }
}

/// The registry client lookups use, and the pause after a failure.
pub struct RemoteLookups {
    client: ClusterClient,
    node: NodeId,
    segment_blocks: SegmentBlocks,
    /// Segments one etcd transaction may read (`ClusterConfig::txn_ops_max`): the most a
    /// lookup asks for.
    txn_ops_max: usize,
    origin: Instant,
    /// Milliseconds since `origin` before which the registry is not asked.
    paused_until_ms: AtomicU64,
}

impl RemoteLookups {
    /// A client of its own (no request is sent yet) with `timeout` per lookup.
    pub fn new(mut config: ClusterConfig, node: NodeId, timeout: Duration) -> tutti_cluster::Result<RemoteLookups> {
        config.request_timeout = timeout;
        let (segment_blocks, txn_ops_max) = (config.segment_blocks, config.txn_ops_max);
        let client = ClusterClient::connect(config)?;
        Ok(RemoteLookups { client, node, segment_blocks, txn_ops_max, origin: Instant::now(), paused_until_ms: AtomicU64::new(0) })
    }

    /// The data address node `node`'s member record gives now (one etcd request: read at each
    /// fetch, so a node that restarted on another port is found there), when its pool's key
    /// secret tag is `key_secret_tag`, this node's: a holder of another secret registered our
    /// key only by a 64-bit accident, and its blocks are another prefix's. The error is (blocks
    /// stored: 0, a sentence).
    pub fn address_of(&self, node: &str, key_secret_tag: KeySecretTag) -> Result<SocketAddr, (usize, String)> {
        let id = NodeId::new(node).map_err(|error| (0, format!("node {node:?}: {error}")))?;
        let record = self.client.member(&id).map_err(|error| (0, format!("reading node {node}'s member record: {error}")))?;
        if let Some(record) = record.as_ref().filter(|record| record.key_secret_tag != key_secret_tag) {
            return Err((
                0,
                format!(
                    "node {node}'s pool has another key secret (tag {}, this node's {key_secret_tag}): its blocks are not this prompt's",
                    record.key_secret_tag
                ),
            ));
        }
        let address = record.map(|record| record.address);
        address
            .as_deref()
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| (0, format!("node {node} has no usable data address in its member record ({address:?})")))
    }

    /// What other nodes hold of `keys` (a prompt's block keys in `space`) past the first
    /// `local_blocks`.
    pub fn beyond(&self, space: &ModelSpace, keys: &[u64], local_blocks: usize, metrics: &ClusterMetrics) -> RemotePart {
        let per_segment = usize::from(self.segment_blocks.get());
        let first = local_blocks / per_segment;
        let mut segments = Vec::new();
        if segments_of(keys, self.segment_blocks, &mut segments).is_err() || first >= segments.len() {
            // No full segment past the local prefix: nothing to ask for.
            return RemotePart { registry: RegistryAnswer::Answered, remote_blocks: 0, holders: Vec::new() };
        }
        let now_ms = self.origin.elapsed().as_millis() as u64;
        if now_ms < self.paused_until_ms.load(Ordering::Relaxed) {
            metrics.lookups_skipped.inc();
            return RemotePart::unavailable();
        }
        metrics.lookups.inc();
        let started = Instant::now();
        let answer = self.client.lookup(space, &segments[segments_to_ask(first, segments.len(), self.txn_ops_max)]);
        metrics.lookup_seconds.observe(started.elapsed().as_secs_f64());
        match answer {
            Ok(lookup) => {
                metrics.lookup_refused_entries.inc_by(lookup.skipped_entries);
                metrics.lookup_ranges_cut_short.inc_by(lookup.ranges_cut_short);
                let spread = spread_of(&self.node, segments[first].key.get());
                let part = remote_part(&lookup, &self.node, first, local_blocks, per_segment, spread);
                metrics.remote_blocks_found.inc_by(u64::from(part.remote_blocks));
                part
            }
            Err(error) => {
                metrics.lookup_failures.inc();
                tracing::info!(%error, "a cluster lookup failed; answering the local prefix only");
                let until = self.origin.elapsed() + LOOKUP_PAUSE;
                self.paused_until_ms.store(until.as_millis() as u64, Ordering::Relaxed);
                RemotePart::unavailable()
            }
        }
    }
}

/// Which of a prompt's `segments` a lookup from segment `first` asks the registry for: at most
/// `txn_ops_max` of them (at least one), so that the lookup is one etcd transaction, bounded
/// by one lookup timeout (`ClusterClient::lookup` sends one transaction per `txn_ops_max`).
pub fn segments_to_ask(first: usize, segments: usize, txn_ops_max: usize) -> std::ops::Range<usize> {
    let first = first.min(segments);
    first..segments.min(first.saturating_add(txn_ops_max.max(1)))
}

/// The seed that orders holders of runs of one length for this node's lookup from the segment
/// `segment_key`: FNV-1a of both, so that one asker reads one segment from one holder (its
/// staging and cache stay warm) while askers, and segments, spread over the replicas.
pub fn spread_of(own: &NodeId, segment_key: u64) -> u64 {
    fnv1a(fnv1a(FNV_OFFSET, own.as_str().as_bytes()), &segment_key.to_le_bytes())
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for &byte in bytes {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// A holder's rank among holders of runs of one length (highest first): the seed and its name
/// hashed, then mixed (splitmix64's finalizer: FNV's last bytes alone barely move the high bits).
fn holder_weight(spread: u64, node: &NodeId) -> u64 {
    let mut weight = fnv1a(spread, node.as_str().as_bytes());
    weight = (weight ^ (weight >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    weight = (weight ^ (weight >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    weight ^ (weight >> 31)
}

/// The remote part of a registry answer whose `holders[i]` hold segment `first + i`: the
/// longest run of segments some other node holds, and each other node's own run, as blocks
/// past `local_blocks`, longest first, runs of one length in the order `spread` gives
/// ([`spread_of`]).
pub fn remote_part(lookup: &Lookup, own: &NodeId, first: usize, local_blocks: usize, per_segment: usize, spread: u64) -> RemotePart {
    let others = |holders: &Vec<NodeId>| holders.iter().any(|node| node != own);
    let run = lookup.holders.iter().take_while(|holders| others(holders)).count();
    let past_local = |segments: usize| u32::try_from(((first + segments) * per_segment).saturating_sub(local_blocks)).unwrap_or(u32::MAX);
    let mut prefixes: Vec<(NodeId, usize)> = lookup.holder_prefixes().into_iter().filter(|(node, _)| node != own).collect();
    prefixes.sort_by_cached_key(|(node, segments)| (std::cmp::Reverse(*segments), std::cmp::Reverse(holder_weight(spread, node))));
    let mut holders: Vec<RemoteHolder> = prefixes
        .into_iter()
        .map(|(node, segments)| RemoteHolder { node: node.to_string(), blocks: past_local(segments) })
        .filter(|holder| holder.blocks > 0)
        .collect();
    holders.truncate(REMOTE_HOLDERS_MAX);
    RemotePart { registry: RegistryAnswer::Answered, remote_blocks: if run == 0 { 0 } else { past_local(run) }, holders }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> NodeId {
        NodeId::new(name).unwrap()
    }

    fn lookup(holders: &[&[&str]]) -> Lookup {
        Lookup { holders: holders.iter().map(|nodes| nodes.iter().map(|name| node(name)).collect()).collect(), ..Lookup::default() }
    }

    #[test]
    fn a_lookup_asks_for_at_most_one_transaction_of_segments() {
        // Goal: however long the prompt, the registry is asked for at most `txn_ops_max`
        // segments from the first past the local prefix (one etcd transaction, one lookup
        // timeout); a shorter remainder is asked whole; nothing past the end.
        assert_eq!(segments_to_ask(0, 1000, 128), 0..128);
        assert_eq!(segments_to_ask(5, 1000, 128), 5..133);
        assert_eq!(segments_to_ask(5, 40, 128), 5..40);
        assert_eq!(segments_to_ask(900, 1000, 128), 900..1000);
        assert_eq!(segments_to_ask(40, 40, 128), 40..40);
        assert_eq!(segments_to_ask(50, 40, 128), 40..40);
        assert_eq!(segments_to_ask(3, 10, 0), 3..4, "a zero cap still asks one");
    }

    #[test]
    fn the_remote_part_counts_past_the_local_prefix_and_leaves_this_node_out() {
        // Goal: with 16-block segments and 20 blocks local, the registry was asked from segment
        // 1; b holds segments 1 and 2, c only 1, this node (a) a stale 3: 28 blocks past the
        // local prefix (b's run), b 28, c 12, a not listed. A run over two holders counts whole;
        // each holder lists its own run from the first segment asked.
        let answer = lookup(&[&["a", "b", "c"], &["b"], &["a"]]);
        let part = remote_part(&answer, &node("a"), 1, 20, 16, 7);
        assert_eq!(part.registry, RegistryAnswer::Answered);
        assert_eq!(part.remote_blocks, 28, "segments 1 and 2 end at block 48, 28 past the 20 local");
        assert_eq!(
            part.holders,
            [RemoteHolder { node: "b".into(), blocks: 28 }, RemoteHolder { node: "c".into(), blocks: 12 }],
            "a's own (stale) entry is not a remote holder"
        );
        // Held only by this node: nothing remote.
        let own = remote_part(&lookup(&[&["a"], &["a"]]), &node("a"), 0, 0, 16, 7);
        assert_eq!((own.remote_blocks, own.holders.len()), (0, 0));
        // A run over two holders: b then c.
        let chained = remote_part(&lookup(&[&["b"], &["c"]]), &node("a"), 0, 0, 16, 7);
        assert_eq!(chained.remote_blocks, 32);
        assert_eq!(chained.holders, [RemoteHolder { node: "b".into(), blocks: 16 }]);
    }

    #[test]
    fn holders_of_one_run_are_spread_over_askers_and_segments_and_the_longest_run_comes_first() {
        // Goal: with b, c and d holding the same two segments, which one an asker reads from
        // first depends on the asker and the segment: over 40 askers and 10 segments each
        // holder comes first for at least a fifth of them (ties went to the lowest node id, so
        // every asker read from b alone). One asker asking for one segment always gets the same
        // order. A longer run comes first whatever the hash, and the rest follow as fallbacks.
        let answer = lookup(&[&["b", "c", "d"], &["b", "c", "d"]]);
        let mut firsts: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        for asker in 0..40 {
            let asker = node(&format!("asker-{asker}"));
            for key in 1..=10u64 {
                let spread = spread_of(&asker, key.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                let part = remote_part(&answer, &asker, 0, 0, 16, spread);
                assert_eq!(part.holders.len(), 3, "every holder listed, as fallbacks");
                assert!(part.holders.iter().all(|holder| holder.blocks == 32));
                assert_eq!(part, remote_part(&answer, &asker, 0, 0, 16, spread), "the same order for the same asker and segment");
                *firsts.entry(part.holders[0].node.clone()).or_default() += 1;
            }
        }
        for holder in ["b", "c", "d"] {
            let first = firsts.get(holder).copied().unwrap_or(0);
            assert!(first >= 400 / 5, "{holder} first for {first} of 400: {firsts:?}");
        }
        let longer = lookup(&[&["b", "c", "d"], &["d"]]);
        for key in 1..=50u64 {
            let part = remote_part(&longer, &node("a"), 0, 0, 16, spread_of(&node("a"), key));
            assert_eq!(part.holders[0], RemoteHolder { node: "d".into(), blocks: 32 }, "the longest run first");
            assert_eq!(part.holders.len(), 3);
        }
    }
}
