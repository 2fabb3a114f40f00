//! tutti's cluster tier, first slice: node membership and the segment location registry on etcd
//! (docs/cluster.md).
//!
//! A tuttid node joins a cluster with [`ClusterNode::join`]: its [`MemberRecord`] goes into etcd
//! under a lease the node keeps alive. After a local commit it [`ClusterNode::register`]s the
//! new segments (runs of [`SegmentBlocks`] consecutive blocks, named by the chained key of their
//! last block) in one transaction attached to that lease; eviction [`ClusterNode::unregister`]s
//! them; a node that dies vanishes with its lease. [`ClusterClient::lookup`] finds the longest
//! registered prefix of a prompt's segments and its holders in one round trip.
//!
//! The API is synchronous over a private runtime; every call is bounded by the configured
//! request timeout and answers [`ClusterError::Unavailable`] past it, so a node never waits on
//! etcd longer than that and keeps serving its local cache.

mod client;
mod connection;
mod error;
pub mod layout;
pub mod local_etcd;
mod names;
mod node;
mod segments;
mod status;

pub use client::{ClusterClient, ClusterConfig, Lookup, Members, ETCD_TXN_OPS_DEFAULT, MEMBERS_MAX};
pub use error::{ClusterError, Result};
pub use layout::{MemberRecord, SegmentRecord, FORMAT_VERSION};
pub use names::{ClusterId, ModelSpace, NodeId, SegmentKey, FINGERPRINT_BYTES, TP_WORLD_MAX};
pub use node::{ClusterNode, LeaseHealth};
pub use segments::{segments_of, Segment, SegmentBlocks};
pub use status::{ClusterStatus, MemberStatus};
