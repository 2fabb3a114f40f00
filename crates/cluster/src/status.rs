//! The cluster as `tutti cluster status` shows it: members with their leases, segments per node,
//! replica counts, and what was refused on the way.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use etcd_client::GetOptions;

use crate::client::ClusterClient;
use crate::error::Result;
use crate::layout::{MemberRecord, SegmentRecord, MEMBER_ENTRY_BYTES_MAX};
use crate::names::{KeySecretTag, ModelSpace, NodeId, SegmentKey};
use crate::scan::{page_entries, prefix_end, scan};

/// Most keys of this format version one status scan reads (then `truncated`): 1,000 nodes ×
/// 1,000 segments.
const SCAN_KEYS_MAX: u64 = 1_000_000;
/// Request timeouts one `status` call may take in all (60 s at the default 3 s): its scan
/// (~1,000 pages at the most) and one lease query per member, each request also bounded by
/// one timeout. Past it the call is `Unavailable`.
pub const STATUS_REQUEST_TIMEOUTS: u32 = 20;
/// Holder sets listed one by one (the most segments first); the rest are summed.
pub const HOLDER_SETS_LISTED: usize = 32;

/// Segments held by exactly one set of nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderSet {
    /// The nodes, sorted: `nodes.len()` is these segments' replica count.
    pub nodes: Vec<NodeId>,
    pub segments: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberStatus {
    pub record: MemberRecord,
    pub lease_id: i64,
    /// Seconds the lease has left as etcd reports it; None when etcd no longer knows it.
    pub ttl_left_s: Option<i64>,
    /// Segments this node has registered.
    pub segments: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterStatus {
    pub members: Vec<MemberStatus>,
    /// Holder entries (one per node per segment).
    pub holder_entries: u64,
    /// Distinct segments (model space + segment key) held somewhere.
    pub distinct_segments: u64,
    /// Replica count → how many segments have that many holders.
    pub replicas: BTreeMap<u64, u64>,
    /// Segments per holder set (which nodes hold them), the [`HOLDER_SETS_LISTED`] largest,
    /// most segments first (ties by the nodes); `other_holder_sets` counts the rest.
    pub holder_sets: Vec<HolderSet>,
    pub other_holder_sets: u64,
    /// Holder entries of nodes without a member record (should not last: they share its lease).
    pub holders_without_member: u64,
    /// Entries of this format version refused (malformed key or value, foreign content, too
    /// large to read).
    pub skipped_entries: u64,
    /// Keys of the cluster in another format version, or outside any version (counted, not
    /// read).
    pub other_version_keys: u64,
    /// The scan stopped at its bound before the end of the cluster's keys.
    pub truncated: bool,
}

impl ClusterStatus {
    /// The members grouped by their pools' key secret tags, the largest group first (ties by
    /// tag), each group's nodes sorted. More than one group means some members share nothing
    /// with the others: the same prompt has other block keys on each side.
    pub fn key_secret_groups(&self) -> Vec<(KeySecretTag, Vec<NodeId>)> {
        let mut groups: BTreeMap<KeySecretTag, Vec<NodeId>> = BTreeMap::new();
        for member in &self.members {
            groups.entry(member.record.key_secret_tag).or_default().push(member.record.node.clone());
        }
        let mut groups: Vec<(KeySecretTag, Vec<NodeId>)> = groups.into_iter().collect();
        for (_, nodes) in &mut groups {
            nodes.sort();
        }
        groups.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then_with(|| a.0.cmp(&b.0)));
        groups
    }
}

impl ClusterClient {
    /// Counts the cluster's keys of other format versions (count-only reads: none of their
    /// bytes is read), scans this version's (pages of up to 1,023 entries, which sound entries
    /// always fit; bounded at 1,000,000 keys; an entry too large to read is stepped over and
    /// counted as refused) and asks etcd each member lease's time to live. Every request is
    /// bounded by the request timeout, the whole call by [`STATUS_REQUEST_TIMEOUTS`] of them.
    pub fn status(&self) -> Result<ClusterStatus> {
        let deadline = Instant::now() + self.config.request_timeout * STATUS_REQUEST_TIMEOUTS;
        let mut status = ClusterStatus::default();
        let cluster_prefix = self.layout.cluster_prefix();
        let version_prefix = self.layout.version_prefix().to_owned();
        let members_prefix = self.layout.members_prefix();
        let segments_prefix = self.layout.segments_prefix();
        // The cluster's keys before and after this version's: other versions (and anything
        // else a writer put there).
        let others = [
            (cluster_prefix.clone().into_bytes(), version_prefix.clone().into_bytes()),
            (prefix_end(&version_prefix), prefix_end(&cluster_prefix)),
        ];
        for (start, end) in others {
            let answer = self.connection.call_kv_by("status count", deadline, |mut client| {
                let options = GetOptions::new().with_range(end.clone()).with_count_only();
                let start = start.clone();
                async move { client.get(start, Some(options)).await }
            })?;
            status.other_version_keys += u64::try_from(answer.count()).unwrap_or(0);
        }
        let mut members: Vec<(MemberRecord, i64)> = Vec::new();
        // Each segment's holders, as indexes into `nodes` (interned: a segment costs a few
        // bytes per holder, not a node id each).
        let mut holders: HashMap<(ModelSpace, SegmentKey), Vec<u32>> = HashMap::new();
        let mut nodes: Vec<NodeId> = Vec::new();
        let mut node_index: HashMap<NodeId, u32> = HashMap::new();
        let mut per_node: HashMap<NodeId, u64> = HashMap::new();
        let range = (version_prefix.clone().into_bytes(), prefix_end(&version_prefix));
        let page = page_entries(MEMBER_ENTRY_BYTES_MAX);
        let scanned = scan(&self.connection, "status scan", deadline, range, SCAN_KEYS_MAX, page, |entry| {
            let key = entry.key();
            if key.starts_with(members_prefix.as_bytes()) {
                let record = self
                    .layout
                    .parse_member_key(key)
                    .and_then(|node| MemberRecord::decode(entry.value(), self.layout.cluster(), &node).ok());
                match record {
                    Some(record) => members.push((record, entry.lease())),
                    None => status.skipped_entries += 1,
                }
            } else if key.starts_with(segments_prefix.as_bytes()) {
                let record = self.layout.parse_segment_key(key).and_then(|(space, segment, node)| {
                    SegmentRecord::decode(entry.value(), self.layout.cluster(), &space, segment, &node).ok()
                });
                match record {
                    Some(record) if record.segment_blocks == self.config.segment_blocks => {
                        status.holder_entries += 1;
                        let index = *node_index.entry(record.node.clone()).or_insert_with(|| {
                            nodes.push(record.node.clone());
                            (nodes.len() - 1) as u32
                        });
                        holders.entry((record.space, record.key)).or_default().push(index);
                        *per_node.entry(record.node).or_default() += 1;
                    }
                    _ => status.skipped_entries += 1,
                }
            } else {
                status.skipped_entries += 1;
            }
        })?;
        status.skipped_entries += scanned.oversized;
        status.truncated = scanned.more;
        status.distinct_segments = holders.len() as u64;
        let mut sets: HashMap<Vec<u32>, u64> = HashMap::new();
        for mut set in holders.into_values() {
            *status.replicas.entry(set.len() as u64).or_default() += 1;
            set.sort_unstable();
            *sets.entry(set).or_default() += 1;
        }
        let mut sets: Vec<HolderSet> = sets
            .into_iter()
            .map(|(set, segments)| {
                let mut nodes: Vec<NodeId> = set.iter().map(|&index| nodes[index as usize].clone()).collect();
                nodes.sort();
                HolderSet { nodes, segments }
            })
            .collect();
        sets.sort_by(|a, b| b.segments.cmp(&a.segments).then_with(|| a.nodes.cmp(&b.nodes)));
        status.other_holder_sets = sets.len().saturating_sub(HOLDER_SETS_LISTED) as u64;
        sets.truncate(HOLDER_SETS_LISTED);
        status.holder_sets = sets;
        for (record, lease_id) in members {
            let ttl_left_s = self
                .connection
                .call_lease_by("lease time to live", deadline, |mut lease| async move { lease.time_to_live(lease_id, None).await })?
                .ttl();
            let segments = per_node.remove(&record.node).unwrap_or(0);
            status.members.push(MemberStatus { record, lease_id, ttl_left_s: (ttl_left_s >= 0).then_some(ttl_left_s), segments });
        }
        status.holders_without_member = per_node.values().sum();
        status.members.sort_by(|a, b| a.record.node.cmp(&b.record.node));
        Ok(status)
    }
}
