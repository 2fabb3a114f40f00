//! The cluster messages (added after version 3's kinds: new kinds, no new version):
//! - `ClusterStatus` (kind 14) → `ClusterStatusReply` (0x800E): the node's part in the cluster
//!   (docs/cluster.md), for `tuttid --status` and tests. Allowed before `Hello`. A daemon outside
//!   any cluster answers with `enabled` false and every other field empty.
//! - `LookupCluster {tokens}` (kind 15, the `Lookup` body) → `ClusterLookupReply` (0x800F): the
//!   local prefix exactly as `Lookup` answers it, then what the registry says lies beyond it.

use super::{put_str, put_u16, put_u32, put_u64, BodyReader, ProtocolError, STRING_BYTES_MAX};

/// Most holders one `ClusterLookupReply` lists (the registry's `holders_max` is at most this).
pub const REMOTE_HOLDERS_MAX: usize = 1024;
/// Longest node id (the cluster crate's bound).
const NODE_BYTES_MAX: usize = 64;

/// Where the remote part of a [`ClusterLookupReply`] comes from; in a [`ClusterStatusReply`],
/// whether the registry answers this node now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RegistryAnswer {
    /// The registry answered (`remote_blocks` may be 0: nobody else holds more).
    Answered,
    /// This daemon is not a cluster node: the local part only.
    #[default]
    NotClustered,
    /// The registry did not answer within the lookup timeout, or failed so recently that it
    /// was not asked: the local part only (recompute the rest, or ask again later).
    Unavailable,
}

impl RegistryAnswer {
    fn to_u8(self) -> u8 {
        match self {
            RegistryAnswer::Answered => 0,
            RegistryAnswer::NotClustered => 1,
            RegistryAnswer::Unavailable => 2,
        }
    }
}

/// A node holding blocks past the local prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteHolder {
    pub node: String,
    /// Blocks past the local prefix this node holds without a gap (whole segments: its run ends
    /// at a segment boundary).
    pub blocks: u32,
}

/// The answer to `LookupCluster`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterLookupReply {
    /// The longest prefix cached on this node, in blocks: what `Lookup` answers.
    pub cached_blocks: u32,
    pub block_tokens: u32,
    pub registry: RegistryAnswer,
    /// Blocks past `cached_blocks` that other nodes hold (the longest registered run, which
    /// may take more than one holder: each holder's own run is in `holders`).
    pub remote_blocks: u32,
    /// Other nodes holding blocks past the local prefix, most blocks first.
    pub holders: Vec<RemoteHolder>,
}

pub(super) fn put_cluster_lookup(out: &mut Vec<u8>, lookup: &ClusterLookupReply) {
    put_u32(out, lookup.cached_blocks);
    put_u32(out, lookup.block_tokens);
    out.push(lookup.registry.to_u8());
    put_u32(out, lookup.remote_blocks);
    let count = lookup.holders.len().min(REMOTE_HOLDERS_MAX);
    put_u16(out, count as u16);
    for holder in &lookup.holders[..count] {
        put_str(out, &holder.node);
        put_u32(out, holder.blocks);
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterStatusReply {
    /// Whether this daemon runs as a cluster node (`tuttid --cluster-etcd`).
    pub enabled: bool,
    pub cluster: String,
    pub node: String,
    /// The data-plane address in the node's member record.
    pub data_address: String,
    pub segment_blocks: u16,
    /// A member now, under a live lease (`lease_id`; 0 before the first join).
    pub joined: bool,
    pub lease_id: u64,
    /// Joins and rejoins (each a new lease); leases found lost while the node lived.
    pub joins: u64,
    pub lease_losses: u64,
    /// Segments whose blocks are all in the local pool; of them, registered under the lease.
    pub segments_held: u64,
    pub segments_registered: u64,
    /// Registrations written, the transactions that carried them, and segments unregistered.
    pub registered_segments: u64,
    pub registration_transactions: u64,
    pub unregistered_segments: u64,
    /// Failed registry calls (retried), committed requests dropped from registration (queue
    /// full), failed manifest writes.
    pub registry_errors: u64,
    pub commits_dropped: u64,
    pub manifest_errors: u64,
    /// `LookupCluster` requests: the registry asked, failed (or timed out), not asked because
    /// it failed just before, and the blocks past the local prefix found held elsewhere.
    pub lookups: u64,
    pub lookup_failures: u64,
    pub lookups_skipped: u64,
    pub remote_blocks_found: u64,
    /// `FetchRemote`: reads sent to a holder, failed, blocks stored here from other nodes;
    /// segments this node sent to others, reads it refused.
    pub remote_reads: u64,
    pub remote_read_failures: u64,
    pub fetched_blocks: u64,
    pub served_segments: u64,
    pub serve_refusals: u64,
    /// The last registry error, if any.
    pub last_error: String,
    /// The registry as this node sees it now, answered from local state (never waits on etcd):
    /// `Answered` while the lease was confirmed within a renewal interval (a third of the lease)
    /// plus one request timeout and the registrar's last call succeeded, `Unavailable`
    /// otherwise; `NotClustered` outside a cluster.
    pub registry: RegistryAnswer,
    /// Milliseconds since etcd last confirmed this node's lease (or since start, never joined).
    pub registry_silent_ms: u64,
    /// Fetched segments registered here as second replicas (heavy hitters).
    pub replicated_segments: u64,
    /// This node's pool key secret tag (what `tutti pool inspect` prints; it names the secret
    /// without revealing it); all zeroes outside a cluster.
    pub key_secret_tag: [u8; tutti_cluster::KEY_SECRET_TAG_BYTES],
    /// Members whose pools have another key secret than this node's, as compared after its
    /// last join (they share no segments with it); -1 while the members could not be listed.
    pub members_other_key_secret: i64,
}

pub(super) fn put_cluster_status(out: &mut Vec<u8>, status: &ClusterStatusReply) {
    out.push(u8::from(status.enabled));
    put_str(out, &status.cluster);
    put_str(out, &status.node);
    put_str(out, &status.data_address);
    put_u16(out, status.segment_blocks);
    out.push(u8::from(status.joined));
    for value in [
        status.lease_id,
        status.joins,
        status.lease_losses,
        status.segments_held,
        status.segments_registered,
        status.registered_segments,
        status.registration_transactions,
        status.unregistered_segments,
        status.registry_errors,
        status.commits_dropped,
        status.manifest_errors,
        status.lookups,
        status.lookup_failures,
        status.lookups_skipped,
        status.remote_blocks_found,
        status.remote_reads,
        status.remote_read_failures,
        status.fetched_blocks,
        status.served_segments,
        status.serve_refusals,
    ] {
        put_u64(out, value);
    }
    put_str(out, &status.last_error);
    out.push(status.registry.to_u8());
    put_u64(out, status.registry_silent_ms);
    put_u64(out, status.replicated_segments);
    out.extend_from_slice(&status.key_secret_tag);
    put_u64(out, status.members_other_key_secret as u64);
}

impl BodyReader<'_> {
    /// A node's key secret tag: its 4 bytes as sent.
    fn key_secret_tag(&mut self) -> Result<[u8; tutti_cluster::KEY_SECRET_TAG_BYTES], ProtocolError> {
        let mut tag = [0; tutti_cluster::KEY_SECRET_TAG_BYTES];
        tag.copy_from_slice(self.bytes(tutti_cluster::KEY_SECRET_TAG_BYTES, "key_secret_tag")?);
        Ok(tag)
    }

    pub(super) fn cluster_status(&mut self) -> Result<ClusterStatusReply, ProtocolError> {
        Ok(ClusterStatusReply {
            enabled: self.flag("enabled")?,
            cluster: self.string("cluster", STRING_BYTES_MAX)?,
            node: self.string("node", STRING_BYTES_MAX)?,
            data_address: self.string("data_address", STRING_BYTES_MAX)?,
            segment_blocks: self.u16("segment_blocks")?,
            joined: self.flag("joined")?,
            lease_id: self.u64("lease_id")?,
            joins: self.u64("joins")?,
            lease_losses: self.u64("lease_losses")?,
            segments_held: self.u64("segments_held")?,
            segments_registered: self.u64("segments_registered")?,
            registered_segments: self.u64("registered_segments")?,
            registration_transactions: self.u64("registration_transactions")?,
            unregistered_segments: self.u64("unregistered_segments")?,
            registry_errors: self.u64("registry_errors")?,
            commits_dropped: self.u64("commits_dropped")?,
            manifest_errors: self.u64("manifest_errors")?,
            lookups: self.u64("lookups")?,
            lookup_failures: self.u64("lookup_failures")?,
            lookups_skipped: self.u64("lookups_skipped")?,
            remote_blocks_found: self.u64("remote_blocks_found")?,
            remote_reads: self.u64("remote_reads")?,
            remote_read_failures: self.u64("remote_read_failures")?,
            fetched_blocks: self.u64("fetched_blocks")?,
            served_segments: self.u64("served_segments")?,
            serve_refusals: self.u64("serve_refusals")?,
            last_error: self.string("last_error", STRING_BYTES_MAX)?,
            registry: self.registry_answer()?,
            registry_silent_ms: self.u64("registry_silent_ms")?,
            replicated_segments: self.u64("replicated_segments")?,
            key_secret_tag: self.key_secret_tag()?,
            members_other_key_secret: self.u64("members_other_key_secret")? as i64,
        })
    }

    fn registry_answer(&mut self) -> Result<RegistryAnswer, ProtocolError> {
        Ok(match self.bytes(1, "registry")?[0] {
            0 => RegistryAnswer::Answered,
            1 => RegistryAnswer::NotClustered,
            2 => RegistryAnswer::Unavailable,
            other => return Err(self.malformed(format!("registry answer {other} is not 0, 1 or 2"))),
        })
    }

    pub(super) fn cluster_lookup(&mut self) -> Result<ClusterLookupReply, ProtocolError> {
        let cached_blocks = self.u32("cached_blocks")?;
        let block_tokens = self.u32("block_tokens")?;
        let registry = self.registry_answer()?;
        let remote_blocks = self.u32("remote_blocks")?;
        let count = usize::from(self.u16("holder_count")?);
        // Each holder takes at least 6 bytes: checked before anything is allocated.
        if count > REMOTE_HOLDERS_MAX || count.saturating_mul(6) > self.remaining() {
            return Err(self.malformed(format!("{count} holders in {} bytes (at most {REMOTE_HOLDERS_MAX})", self.remaining())));
        }
        let mut holders = Vec::with_capacity(count);
        for _ in 0..count {
            holders.push(RemoteHolder { node: self.string("holder node", NODE_BYTES_MAX)?, blocks: self.u32("holder blocks")? });
        }
        Ok(ClusterLookupReply { cached_blocks, block_tokens, registry, remote_blocks, holders })
    }
}
