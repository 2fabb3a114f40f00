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

//!
//! Feature `etcd` (default): everything that talks to etcd. Without it the crate is the names,
//! segments and record formats (what tuttid's key spaces and the client library need), and
//! builds without `protoc`.

#[cfg(feature = "etcd")]
mod client;
mod config;
#[cfg(feature = "etcd")]
mod connection;
mod error;
pub mod layout;
#[cfg(feature = "etcd")]
pub mod local_etcd;
mod names;
#[cfg(feature = "etcd")]
mod node;
mod segments;
#[cfg(feature = "etcd")]
mod status;

#[cfg(feature = "etcd")]
pub use client::{ClusterClient, Lookup, Members, MEMBERS_MAX};
pub use config::{ClusterConfig, ETCD_TXN_OPS_DEFAULT};
pub use error::{ClusterError, Result};
pub use layout::{MemberRecord, SegmentRecord, FORMAT_VERSION};
pub use names::{ClusterId, ModelSpace, NodeId, SegmentKey, FINGERPRINT_BYTES, TP_WORLD_MAX};
#[cfg(feature = "etcd")]
pub use node::{ClusterNode, LeaseHealth};
pub use segments::{segments_of, Segment, SegmentBlocks};
#[cfg(feature = "etcd")]
pub use status::{ClusterStatus, HolderSet, MemberStatus, HOLDER_SETS_LISTED};
