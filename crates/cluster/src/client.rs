//! Settings and the read side of the registry: lookups and the member list. A `ClusterClient`
//! holds no lease; `ClusterNode` (node.rs) adds membership and registration.

use std::time::Instant;

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};

use crate::config::ClusterConfig;
use crate::connection::{is_too_large, requests_sent_here, Connection};
use crate::error::{ClusterError, Result};
use crate::layout::{KeyLayout, MemberRecord, SegmentRecord, MEMBER_ENTRY_BYTES_MAX};
use crate::names::{ModelSpace, NodeId};
use crate::scan::{page_entries, prefix_end, scan};
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
    /// segment size, a value that disagrees with its key, an entry too large to read).
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
    /// Adds one segment's read (its sound holders, the entries refused, whether the range had
    /// more than was read); false, adding nothing, when no holder was found (the prefix ends).
    fn add_segment(&mut self, mut holders: Vec<NodeId>, refused: u64, more: bool) -> bool {
        self.skipped_entries += refused;
        if more && refused > 0 {
            self.ranges_cut_short += 1;
        }
        if holders.is_empty() {
            return false;
        }
        holders.sort();
        self.holders.push(holders);
        true
    }

    /// Segments in the longest registered prefix.
    pub fn prefix_segments(&self) -> usize {
        self.holders.len()
    }

    /// For each node met, how many leading segments it holds without a gap, longest first (ties
    /// by node id): where to fetch the most of the prefix from one holder. A reader should not
    /// take ties in this order, which would send every reader to the lowest node id: tuttid
    /// orders them by a hash of the asking node and the segment (`lookup.rs`, `remote_part`).
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
    /// Entries under the members prefix that were refused (too large to read included).
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
    /// Checks the connection's settings (not the lease's: a client holds none,
    /// [`ClusterConfig::validate_connection`]) and prepares the connection (no request is sent
    /// yet).
    pub fn connect(config: ClusterConfig) -> Result<ClusterClient> {
        config.validate_connection()?;
        let connection = Connection::open(&config.endpoints, config.request_timeout)?;
        let layout = KeyLayout::new(config.cluster.clone());
        Ok(ClusterClient { connection, config, layout })
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// Deletes node `node`'s holder entries of `segments` in `space` for a node's successor
    /// after a crash, before it joins: its pool no longer holds segments the dead process's
    /// lease still claims (docs/cluster.md, "A pool wiped while its lease lived"). Only while
    /// no live process holds the id: each transaction deletes only when `node`'s member key is
    /// absent, or still under `lease_id`, the lease the dead process recorded (0: none known,
    /// then only an absent key will do). Otherwise the entries may be a live process's (a
    /// second tuttid started with the same node id) and nothing is deleted:
    /// [`ClusterError::NodeIdTaken`] names the holder's lease. An absent key is trusted: one
    /// an operator deleted by hand under a live process lets this delete that process's
    /// entries (docs/cluster.md, "The guard trusts the member key"). One transaction per
    /// `txn_ops_max` segments; returns the transactions. Not for a live node's eviction:
    /// `ClusterNode::unregister` deletes under its own lease. Deleting an entry that is not
    /// there is not an error.
    pub fn forget(&self, node: &NodeId, lease_id: i64, space: &ModelSpace, segments: &[Segment]) -> Result<usize> {
        let member_key = self.layout.member_key(node);
        let mut transactions = 0;
        for chunk in segments.chunks(self.config.txn_ops_max) {
            let deletes: Vec<TxnOp> =
                chunk.iter().map(|segment| TxnOp::delete(self.layout.segment_key(space, segment.key, node), None)).collect();
            // Absent, else (a nested transaction: etcd ands the comparisons of one) under the
            // recorded lease, else read the holder for the error.
            let absent = Compare::create_revision(member_key.clone(), CompareOp::Equal, 0);
            let mut under_recorded = Txn::new().and_then([TxnOp::get(member_key.clone(), None)]);
            if lease_id != 0 {
                under_recorded = Txn::new()
                    .when([Compare::lease(member_key.clone(), CompareOp::Equal, lease_id)])
                    .and_then(deletes.clone())
                    .or_else([TxnOp::get(member_key.clone(), None)]);
            }
            let answer = self.connection.call_kv("forget segments", |mut client| {
                let transaction = Txn::new().when([absent.clone()]).and_then(deletes.clone()).or_else([TxnOp::txn(under_recorded.clone())]);
                async move { client.txn(transaction).await }
            })?;
            if !answer.succeeded() {
                let nested = answer.op_responses().into_iter().find_map(|response| match response {
                    TxnOpResponse::Txn(nested) => Some(nested),
                    _ => None,
                });
                let Some(nested) = nested else {
                    return Err(ClusterError::MalformedRecord {
                        key: member_key,
                        reason: "etcd answered a forget's guard with another kind of result",
                    });
                };
                if lease_id == 0 || !nested.succeeded() {
                    let holder = nested.op_responses().into_iter().find_map(|response| match response {
                        TxnOpResponse::Get(range) => range.kvs().first().map(|entry| entry.lease()),
                        _ => None,
                    });
                    return Err(ClusterError::NodeIdTaken {
                        cluster: self.layout.cluster().to_string(),
                        node: node.to_string(),
                        lease_id: holder.unwrap_or(0),
                    });
                }
            }
            transactions += 1;
        }
        Ok(transactions)
    }

    /// etcd requests sent so far by this client (attempts, retries included).
    pub fn requests_sent(&self) -> u64 {
        self.connection.requests_sent()
    }

    /// The longest prefix of `segments` (consecutive segments of one prompt in order, from any
    /// position: each `segments[i].index` is its position in the prompt, checked against the
    /// entries) registered by some node, with its holders. One etcd transaction of range reads
    /// per `txn_ops_max` segments, stopping at the first chunk with a miss; each chunk is
    /// bounded by one request timeout. A chunk whose answer would be longer than an answer may
    /// be (foreign entries of up to etcd's 1.5 MiB under its prefixes) is read again segment by
    /// segment, in pages that fit, within the same timeout; entries too large to read are
    /// refused and counted like any other.
    pub fn lookup(&self, space: &ModelSpace, segments: &[Segment]) -> Result<Lookup> {
        let mut lookup = Lookup::default();
        // This thread's count, not the client's: other threads share the client.
        let requests_before = requests_sent_here();
        for chunk in segments.chunks(self.config.txn_ops_max) {
            let deadline = Instant::now() + self.config.request_timeout;
            if !self.lookup_chunk(space, chunk, deadline, &mut lookup)? {
                break;
            }
        }
        lookup.requests = requests_sent_here() - requests_before;
        Ok(lookup)
    }

    /// One chunk of a lookup in one transaction: adds its held prefix to `lookup`; whether
    /// every segment of the chunk is held.
    fn lookup_chunk(&self, space: &ModelSpace, chunk: &[Segment], deadline: Instant, lookup: &mut Lookup) -> Result<bool> {
        let reads: Vec<TxnOp> = chunk
            .iter()
            .map(|segment| {
                let prefix = self.layout.holders_prefix(space, segment.key);
                let options = GetOptions::new().with_prefix().with_limit(self.config.holders_max as i64);
                TxnOp::get(prefix, Some(options))
            })
            .collect();
        let answer = self.connection.call_kv_by("lookup", deadline, |mut client| {
            let transaction = Txn::new().and_then(reads.clone());
            async move { client.txn(transaction).await }
        });
        let answer = match answer {
            Ok(answer) => answer,
            Err(error) if is_too_large(&error) => {
                tracing::warn!(segments = chunk.len(), "a lookup's answer is too long (large foreign entries): reading segment by segment");
                return self.lookup_chunk_by_segment(space, chunk, deadline, lookup);
            }
            Err(error) => return Err(error),
        };
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
            let holders: Vec<NodeId> =
                range.kvs().iter().filter_map(|entry| self.check_holder(space, segment, entry.key(), entry.value())).collect();
            let refused = (range.kvs().len() - holders.len()) as u64;
            if !lookup.add_segment(holders, refused, range.more()) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// [`ClusterClient::lookup_chunk`] when its answer was too long: each segment's holder range
    /// alone, in order until the first miss, each at most `holders_max` entries as before.
    fn lookup_chunk_by_segment(&self, space: &ModelSpace, chunk: &[Segment], deadline: Instant, lookup: &mut Lookup) -> Result<bool> {
        let holders_max = self.config.holders_max as u64;
        for segment in chunk {
            let prefix = self.layout.holders_prefix(space, segment.key);
            let mut holders = Vec::new();
            let mut refused = 0u64;
            let range = (prefix.clone().into_bytes(), prefix_end(&prefix));
            let scanned = scan(&self.connection, "lookup", deadline, range, holders_max, holders_max, |entry| {
                match self.check_holder(space, segment, entry.key(), entry.value()) {
                    Some(node) => holders.push(node),
                    None => refused += 1,
                }
            })?;
            if !lookup.add_segment(holders, refused + scanned.oversized, scanned.more) {
                return Ok(false);
            }
        }
        Ok(true)
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

    /// The live members: one range read per 1,023 entries (what fits an answer), within one
    /// request timeout in all.
    pub fn members(&self) -> Result<Members> {
        let prefix = self.layout.members_prefix();
        let deadline = Instant::now() + self.config.request_timeout;
        let mut members = Members::default();
        let range = (prefix.clone().into_bytes(), prefix_end(&prefix));
        let page = page_entries(MEMBER_ENTRY_BYTES_MAX);
        let scanned = scan(&self.connection, "members", deadline, range, MEMBERS_MAX as u64, page, |entry| {
            let record = self
                .layout
                .parse_member_key(entry.key())
                .and_then(|node| MemberRecord::decode(entry.value(), self.layout.cluster(), &node).ok());
            match record {
                Some(record) => members.nodes.push(record),
                None => members.skipped_entries += 1,
            }
        })?;
        members.skipped_entries += scanned.oversized;
        members.truncated = scanned.more;
        Ok(members)
    }

    /// Node `node`'s member record (one key read): None when it is not a member; an error when
    /// the entry there is refused (malformed, another cluster's, another node's record, too
    /// large to read).
    pub fn member(&self, node: &NodeId) -> Result<Option<MemberRecord>> {
        let key = self.layout.member_key(node);
        let answer = self.connection.call_kv("member", |mut client| {
            let key = key.clone();
            async move { client.get(key, None).await }
        });
        let answer = match answer {
            Ok(answer) => answer,
            Err(error) if is_too_large(&error) => {
                return Err(ClusterError::MalformedRecord { key, reason: "the entry is larger than an answer may be" })
            }
            Err(error) => return Err(error),
        };
        let Some(entry) = answer.kvs().first() else { return Ok(None) };
        if entry.key() != key.as_bytes() {
            return Err(ClusterError::MalformedRecord { key, reason: "etcd answered a key read with another key" });
        }
        MemberRecord::decode(entry.value(), self.layout.cluster(), node)
            .map(Some)
            .map_err(|reason| ClusterError::MalformedRecord { key, reason })
    }
}
