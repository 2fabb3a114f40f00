//! The cluster messages (added after version 3's kinds: new kinds, no new version):
//! `ClusterStatus` (kind 14) → `ClusterStatusReply` (0x800E): the node's part in the cluster
//! (docs/cluster.md), for `tuttid --status` and tests. Allowed before `Hello`. A daemon outside
//! any cluster answers with `enabled` false and every other field empty.

use super::{put_str, put_u16, put_u64, BodyReader, ProtocolError, STRING_BYTES_MAX};

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
    /// The last registry error, if any.
    pub last_error: String,
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
    ] {
        put_u64(out, value);
    }
    put_str(out, &status.last_error);
}

impl BodyReader<'_> {
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
            last_error: self.string("last_error", STRING_BYTES_MAX)?,
        })
    }
}
