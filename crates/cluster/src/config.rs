//! How a node or client talks to the registry: settings only, no etcd (so tuttid checks them at
//! start, and builds that leave etcd out still name them).

use std::time::Duration;

use crate::error::{ClusterError, Result};
use crate::names::ClusterId;
use crate::segments::SegmentBlocks;

/// etcd's default `--max-txn-ops`: the most operations one transaction may carry.
pub const ETCD_TXN_OPS_DEFAULT: usize = 128;

/// How a node or client talks to the registry.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// etcd client URLs (`http://host:port`), every member of the etcd cluster.
    pub endpoints: Vec<String>,
    pub cluster: ClusterId,
    /// Blocks per segment; the same on every node of the cluster.
    pub segment_blocks: SegmentBlocks,
    /// The longest any call waits for etcd, retries included (then `Unavailable`). To ride out
    /// the loss of etcd's leader without an error it must exceed twice etcd's election timeout
    /// (default 1 s: an election takes one to two timeouts).
    pub request_timeout: Duration,
    /// A member's lease: it and its segments vanish this long after its last renewal. Whole
    /// seconds (etcd's unit); renewed every third of it.
    pub lease_ttl: Duration,
    /// Operations per etcd transaction: at most the server's `--max-txn-ops`. A lookup of more
    /// segments than this costs one round trip per this many (stopping at the first miss).
    pub txn_ops_max: usize,
    /// Most holders a lookup returns per segment (the rest exist but are not listed).
    pub holders_max: usize,
}

impl ClusterConfig {
    /// The defaults: 3 s per request (etcd's default election timeout is 1 s), a 10 s lease, 128 operations per transaction, 16 holders.
    pub fn new(endpoints: Vec<String>, cluster: ClusterId, segment_blocks: SegmentBlocks) -> ClusterConfig {
        ClusterConfig {
            endpoints,
            cluster,
            segment_blocks,
            request_timeout: Duration::from_secs(3),
            lease_ttl: Duration::from_secs(10),
            txn_ops_max: ETCD_TXN_OPS_DEFAULT,
            holders_max: 16,
        }
    }

    /// Checks every setting (also done by `ClusterClient::connect`): for a caller that wants
    /// to refuse bad settings at start rather than at its first call.
    pub fn validate(&self) -> Result<()> {
        let bad = |text: String| Err(ClusterError::InvalidSetting(text));
        if !(Duration::from_millis(10)..=Duration::from_secs(60)).contains(&self.request_timeout) {
            return bad(format!("request timeout {:?} is outside 10 ms..=60 s", self.request_timeout));
        }
        let ttl_s = self.lease_ttl.as_secs();
        if self.lease_ttl.subsec_nanos() != 0 || !(2..=3600).contains(&ttl_s) {
            return bad(format!("lease TTL {:?} is not a whole number of seconds in 2..=3600", self.lease_ttl));
        }
        // A renewal is sent every TTL/3 and may take the whole request timeout: it must still
        // land before the lease runs out.
        if self.request_timeout * 3 > self.lease_ttl * 2 {
            return bad(format!(
                "request timeout {:?} leaves no room to renew a {ttl_s} s lease (at most 2/3 of the TTL)",
                self.request_timeout
            ));
        }
        if !(1..=ETCD_TXN_OPS_DEFAULT).contains(&self.txn_ops_max) {
            return bad(format!("{} operations per transaction is outside 1..={ETCD_TXN_OPS_DEFAULT}", self.txn_ops_max));
        }
        if !(1..=1024).contains(&self.holders_max) {
            return bad(format!("{} holders per segment is outside 1..=1024", self.holders_max));
        }
        Ok(())
    }
}
