//! The crate's one error type. Every request to etcd is bounded by the configured request
//! timeout (each call by the bound lib.rs lists for it); past it the caller gets
//! [`ClusterError::Unavailable`] and keeps serving from its local cache.

use std::time::Duration;

/// Everything the cluster tier can report.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A setting or an argument is out of range; the text says which and why.
    #[error("invalid cluster setting: {0}")]
    InvalidSetting(String),
    /// etcd did not answer `operation` within the deadline (every member down, partitioned, or
    /// without a leader). Nothing is known to have changed; local caches stay valid.
    #[error("the cluster registry is unavailable: {operation} got no answer from etcd within {waited:?} ({last_error})")]
    Unavailable { operation: &'static str, waited: Duration, last_error: String },
    /// etcd answered `operation` with an error that retrying will not cure.
    #[cfg(feature = "etcd")]
    #[error("etcd refused {operation}: {source}")]
    Etcd {
        operation: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    /// The node's lease is gone (expired while etcd could not be reached, or revoked): its
    /// membership and every segment it registered have vanished. `ClusterNode::rejoin` grants a
    /// new lease; the owner then registers its segments again.
    #[error("the node's etcd lease {lease_id:#x} is lost; rejoin and register the segments again")]
    LeaseLost { lease_id: i64 },
    /// Another live process holds this node id in this cluster.
    #[error("node id {node} is already registered in cluster {cluster} (lease {lease_id:#x}); is another tuttid running with this id?")]
    NodeIdTaken { cluster: String, node: String, lease_id: i64 },
    /// A rejoin found this node id's member key still under one of the node's own old leases,
    /// whose revoke failed (etcd did not answer it in time): not another process. The lease is
    /// unrenewed and expires by itself (within a TTL of its last renewal, unless a new etcd
    /// leader extends it); the node keeps it first among the leases it revokes again, even one
    /// past the two it keeps otherwise, so the next rejoin tries it.
    #[error(
        "node id {node}'s member key is still under this node's own old lease {lease_id:#x}, whose revoke failed; it expires by itself within a TTL, sooner if a later rejoin's revoke of it succeeds"
    )]
    OwnLeaseHolds { node: String, lease_id: i64 },
    /// This node id's member key holds what no live node put there: a value under no lease
    /// (written by hand: it never expires) or one that is no member record of this cluster.
    /// Waiting will not free it (unlike [`ClusterError::NodeIdTaken`]): an operator deletes
    /// `key`, once sure no process with this node id runs.
    #[error(
        "node id {node}'s member key {key} holds {reason} (lease {lease_id:#x}), not a live member's record; delete it (etcdctl del {key}) if no tuttid runs with this node id"
    )]
    MemberKeyBlocked { node: String, key: String, lease_id: i64, reason: &'static str },
    /// A record read from etcd (or about to be written) does not decode; never trusted.
    #[error("malformed cluster record at {key}: {reason}")]
    MalformedRecord { key: String, reason: &'static str },
    /// The private runtime that runs the etcd client could not start.
    #[error("cannot start the cluster client's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The local etcd test server could not be started or stopped (tests, `LocalEtcd`).
    #[error("local etcd: {context}: {source}")]
    LocalEtcd {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, ClusterError>;
