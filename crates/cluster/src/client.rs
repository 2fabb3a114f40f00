//! Settings and the read side of the registry: lookups and the member list. A `ClusterClient`
//! holds no lease; `ClusterNode` (node.rs) adds membership and registration.

use etcd_client::{GetOptions, Txn, TxnOp, TxnOpResponse};

use crate::config::ClusterConfig;
use crate::connection::Connection;
use crate::error::{ClusterError, Result};
use crate::layout::{KeyLayout, MemberRecord, SegmentRecord};
use crate::names::{ModelSpace, NodeId};
use crate::segments::Segment;

/// Most members one `members()` call returns (a fleet of this many nodes is far past the
/// 1,000 the design is sized for, docs/cluster.md).
pub const MEMBERS_MAX: usize = 4096;

/// A lookup's answer: the longest prefix of the asked segments that some node holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lookup {
    /// One entry per segment of the prefix, in order: the nodes registered as holding it
    /// (sorted, at most `holders_max`). Empty when the first segment is held nowhere.
    pub holders: Vec<Vec<NodeId>>,
    /// Registry entries met and refused (malformed, another cluster's, another version or
    /// segment size, a value that disagrees with its key).
    pub skipped_entries: u64,
    /// etcd requests the lookup sent (1 for up to `txn_ops_max` segments, retries aside).
    pub requests: u64,
    /// Segments whose range read stopped at `holders_max` entries with refused ones among them
    /// while more were left unread: holders past the limit were not seen. A bounded lookup
    /// reads one range per segment and never pages, so such a segment can read as a miss
    /// (never as wrong data); a count here means the registry holds entries it should not
    /// (another segment size, a damaged writer).
    pub ranges_cut_short: u64,
}

impl Lookup {
    /// Segments in the longest registered prefix.
    pub fn prefix_segments(&self) -> usize {
        self.holders.len()
    }

    /// For each node met, how many leading segments it holds without a gap, longest first (ties
    /// by node id): where to fetch the most of the prefix from one holder.
    pub fn holder_prefixes(&self) -> Vec<(NodeId, usize)> {
        let mut prefixes: Vec<(NodeId, usize)> = Vec::new();
        if let Some(first) = self.holders.first() {
            for node in first {
                let run = self.holders.iter().take_while(|holders| holders.contains(node)).count();
                prefixes.push((node.clone(), run));
            }
        }
        prefixes.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        prefixes
    }
}

/// The live members, as registered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Members {
    pub nodes: Vec<MemberRecord>,
    /// Entries under the members prefix that were refused.
    pub skipped_entries: u64,
    /// More than [`MEMBERS_MAX`] entries are registered: `nodes` lists the first by node id.
    pub truncated: bool,
}

/// A connection to the registry without membership: lookups, the member list, status.
pub struct ClusterClient {
    pub(crate) connection: Connection,
    pub(crate) config: ClusterConfig,
    pub(crate) layout: KeyLayout,
}

impl ClusterClient {
    /// Checks the settings and prepares the connection (no request is sent yet).
    pub fn connect(config: ClusterConfig) -> Result<ClusterClient> {
        config.validate()?;
        let connection = Connection::open(&config.endpoints, config.request_timeout)?;
        let layout = KeyLayout::new(config.cluster.clone());
        Ok(ClusterClient { connection, config, layout })
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// Deletes node `node`'s holder entries of `segments` in `space`, whatever lease they are
    /// under: one transaction per `txn_ops_max` segments; returns the transactions. Meant for a
    /// node's own entries: its eviction (`ClusterNode::unregister`), and its successor after a
    /// crash, which found that its pool no longer holds segments the dead process's lease still
    /// claims (docs/cluster.md, "A pool wiped while its lease lived"). Deleting an entry that is
    /// not there is not an error.
    pub fn forget(&self, node: &NodeId, space: &ModelSpace, segments: &[Segment]) -> Result<usize> {
        let mut transactions = 0;
        for chunk in segments.chunks(self.config.txn_ops_max) {
            let deletes: Vec<TxnOp> =
                chunk.iter().map(|segment| TxnOp::delete(self.layout.segment_key(space, segment.key, node), None)).collect();
            self.connection.call("unregister segments", |mut client| {
                let transaction = Txn::new().and_then(deletes.clone());
                async move { client.txn(transaction).await }
            })?;
            transactions += 1;
        }
        Ok(transactions)
    }

    /// etcd requests sent so far by this client (attempts, retries included).
    pub fn requests_sent(&self) -> u64 {
        self.connection.requests_sent()
    }

    /// The longest prefix of `segments` (a prompt's segments in order, `segments[i].index == i`)
    /// registered by some node, with its holders. One etcd transaction of range reads per
    /// `txn_ops_max` segments, stopping at the first chunk with a miss.
    pub fn lookup(&self, space: &ModelSpace, segments: &[Segment]) -> Result<Lookup> {
        let mut lookup = Lookup::default();
        let requests_before = self.connection.requests_sent();
        for chunk in segments.chunks(self.config.txn_ops_max) {
            let reads: Vec<TxnOp> = chunk
                .iter()
                .map(|segment| {
                    let prefix = self.layout.holders_prefix(space, segment.key);
                    let options = GetOptions::new().with_prefix().with_limit(self.config.holders_max as i64);
                    TxnOp::get(prefix, Some(options))
                })
                .collect();
            let answer = self.connection.call("lookup", |mut client| {
                let transaction = Txn::new().and_then(reads.clone());
                async move { client.txn(transaction).await }
            })?;
            let responses = answer.op_responses();
            if responses.len() != chunk.len() {
                return Err(ClusterError::MalformedRecord {
                    key: self.layout.segments_prefix(),
                    reason: "etcd answered a lookup with another number of results than asked",
                });
            }
            for (segment, response) in chunk.iter().zip(responses) {
                let TxnOpResponse::Get(range) = response else {
                    return Err(ClusterError::MalformedRecord {
                        key: self.layout.segments_prefix(),
                        reason: "etcd answered a range read with another kind of result",
                    });
                };
                let mut holders = Vec::new();
                for entry in range.kvs() {
                    match self.check_holder(space, segment, entry.key(), entry.value()) {
                        Some(node) => holders.push(node),
                        None => lookup.skipped_entries += 1,
                    }
                }
                if range.more() && holders.len() < range.kvs().len() {
                    lookup.ranges_cut_short += 1;
                }
                if holders.is_empty() {
                    lookup.requests = self.connection.requests_sent() - requests_before;
                    return Ok(lookup);
                }
                holders.sort();
                lookup.holders.push(holders);
            }
        }
        lookup.requests = self.connection.requests_sent() - requests_before;
        Ok(lookup)
    }

    /// The holder a registry entry names, if the entry is sound for `segment` at its position.
    fn check_holder(&self, space: &ModelSpace, segment: &Segment, key: &[u8], value: &[u8]) -> Option<NodeId> {
        let (key_space, key_segment, node) = self.layout.parse_segment_key(key)?;
        if key_space != *space || key_segment != segment.key {
            return None;
        }
        let record = SegmentRecord::decode(value, self.layout.cluster(), space, segment.key, &node).ok()?;
        // Same chain position and segment size: otherwise the key names other blocks.
        if record.index != segment.index || record.segment_blocks != self.config.segment_blocks {
            return None;
        }
        Some(node)
    }

    /// The live members (one range read).
    pub fn members(&self) -> Result<Members> {
        let prefix = self.layout.members_prefix();
        let answer = self.connection.call("members", |mut client| {
            let options = GetOptions::new().with_prefix().with_limit(MEMBERS_MAX as i64);
            let prefix = prefix.clone();
            async move { client.get(prefix, Some(options)).await }
        })?;
        let mut members = Members { truncated: answer.more(), ..Members::default() };
        for entry in answer.kvs() {
            let record = self
                .layout
                .parse_member_key(entry.key())
                .and_then(|node| MemberRecord::decode(entry.value(), self.layout.cluster(), &node).ok());
            match record {
                Some(record) => members.nodes.push(record),
                None => members.skipped_entries += 1,
            }
        }
        Ok(members)
    }

    /// Node `node`'s member record (one key read): None when it is not a member; an error when
    /// the entry there is refused (malformed, another cluster's, another node's record).
    pub fn member(&self, node: &NodeId) -> Result<Option<MemberRecord>> {
        let key = self.layout.member_key(node);
        let answer = self.connection.call("member", |mut client| {
            let key = key.clone();
            async move { client.get(key, None).await }
        })?;
        let Some(entry) = answer.kvs().first() else { return Ok(None) };
        if entry.key() != key.as_bytes() {
            return Err(ClusterError::MalformedRecord { key, reason: "etcd answered a key read with another key" });
        }
        MemberRecord::decode(entry.value(), self.layout.cluster(), node)
            .map(Some)
            .map_err(|reason| ClusterError::MalformedRecord { key, reason })
    }
}
