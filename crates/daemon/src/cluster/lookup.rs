//! `LookupCluster`: the local prefix first, then one registry round trip for what lies beyond.
//!
//! The local index answers as `Lookup` does. Only when the prompt has a full segment past the
//! local prefix is the registry asked — for the segments from the one the local prefix ends in
//! (a segment is fetched whole, so a partly local one counts from its start) — in one etcd
//! transaction: at most `txn_ops_max` segments are asked ([`segments_to_ask`]), since the
//! registry client spends a transaction, each with the whole lookup timeout, per
//! `txn_ops_max`; what lies past them is found by a later lookup, once these are local. This
//! node's own entries are left out: what it registered it holds locally, and an entry of its
//! own past the local prefix is stale.
//!
//! The registry is asked on the connection's thread, bounded by the lookup timeout (shorter
//! than the registrar's: a client waits for it). A failed or late answer is `Unavailable`, and
//! for [`LOOKUP_PAUSE`] afterwards lookups do not ask (answered `Unavailable` at once, counted
//! as skipped), so a registry that is down costs one timeout per pause, not one per lookup.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tutti_cluster::{segments_of, ClusterClient, ClusterConfig, Lookup, ModelSpace, NodeId, SegmentBlocks};

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
    /// fetch, so a node that restarted on another port is found there). The error is (blocks
    /// stored: 0, a sentence).
    pub fn address_of(&self, node: &str) -> Result<SocketAddr, (usize, String)> {
        let id = NodeId::new(node).map_err(|error| (0, format!("node {node:?}: {error}")))?;
        let record = self.client.member(&id).map_err(|error| (0, format!("reading node {node}'s member record: {error}")))?;
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
                let part = remote_part(&lookup, &self.node, first, local_blocks, per_segment);
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

/// The remote part of a registry answer whose `holders[i]` hold segment `first + i`: the
/// longest run of segments some other node holds, and each other node's own run, as blocks
/// past `local_blocks`.
pub fn remote_part(lookup: &Lookup, own: &NodeId, first: usize, local_blocks: usize, per_segment: usize) -> RemotePart {
    let others = |holders: &Vec<NodeId>| holders.iter().any(|node| node != own);
    let run = lookup.holders.iter().take_while(|holders| others(holders)).count();
    let past_local = |segments: usize| u32::try_from(((first + segments) * per_segment).saturating_sub(local_blocks)).unwrap_or(u32::MAX);
    let mut holders: Vec<RemoteHolder> = lookup
        .holder_prefixes()
        .into_iter()
        .filter(|(node, _)| node != own)
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
        let part = remote_part(&answer, &node("a"), 1, 20, 16);
        assert_eq!(part.registry, RegistryAnswer::Answered);
        assert_eq!(part.remote_blocks, 28, "segments 1 and 2 end at block 48, 28 past the 20 local");
        assert_eq!(
            part.holders,
            [RemoteHolder { node: "b".into(), blocks: 28 }, RemoteHolder { node: "c".into(), blocks: 12 }],
            "a's own (stale) entry is not a remote holder"
        );
        // Held only by this node: nothing remote.
        let own = remote_part(&lookup(&[&["a"], &["a"]]), &node("a"), 0, 0, 16);
        assert_eq!((own.remote_blocks, own.holders.len()), (0, 0));
        // A run over two holders: b then c.
        let chained = remote_part(&lookup(&[&["b"], &["c"]]), &node("a"), 0, 0, 16);
        assert_eq!(chained.remote_blocks, 32);
        assert_eq!(chained.holders, [RemoteHolder { node: "b".into(), blocks: 16 }]);
    }
}
