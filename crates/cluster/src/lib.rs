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
//! The API is synchronous over a private runtime. Every request to etcd, retries included, is
//! bounded by the configured request timeout T and answers [`ClusterError::Unavailable`] past
//! it, so a node never waits on etcd for long and keeps serving its local cache. Most calls
//! take one T in all: `members` (its pages share it), `member`, `update_record`; `register` and
//! `unregister` one T per `txn_ops_max` − 1 segments (each transaction puts the member key
//! too), `forget` and `lookup` one T per `txn_ops_max` segments (a lookup chunk re-read in
//! smaller pieces shares its T). The compound ones are bounded by their requests: `join`
//! ≤ 3 T (4 T when its member transaction failed, other than with an answer too large, and
//! the new lease's revoke failed too: tried once more as it returns), `rejoin` ≤ 6 T (up to
//! three leases revoked, then the grant, the member transaction and the new lease's revoke),
//! `leave` and dropping a node ≤ T + 1 s (the runtime's shutdown; 3 T + 1 s with two leases
//! left unrevoked by rejoins), `status` ≤ [`STATUS_REQUEST_TIMEOUTS`] × T in all.

//!
//! Feature `etcd` (default): everything that talks to etcd. Without it the crate is the names,
//! segments and record formats (what tuttid's key spaces and the client library need), and
//! builds without `protoc`.

// The docs above link items that talk to etcd; without the feature they do not exist.
#![cfg_attr(not(feature = "etcd"), allow(rustdoc::broken_intra_doc_links))]

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
#[cfg(feature = "etcd")]
mod scan;
mod segments;
#[cfg(feature = "etcd")]
mod status;

#[cfg(feature = "etcd")]
pub use client::{ClusterClient, Lookup, Members, MEMBERS_MAX};
pub use config::{ClusterConfig, ETCD_TXN_OPS_DEFAULT, RESPONSE_BYTES_MAX};
pub use error::{ClusterError, Result};
pub use layout::{MemberRecord, SegmentRecord, FORMAT_VERSION};
pub use names::{ClusterId, KeySecretTag, ModelSpace, NodeId, SegmentKey, FINGERPRINT_BYTES, KEY_SECRET_TAG_BYTES, TP_WORLD_MAX};
#[cfg(feature = "etcd")]
pub use node::{ClusterNode, LeaseHealth, Rejoined};
pub use segments::{segments_of, Segment, SegmentBlocks};
#[cfg(feature = "etcd")]
pub use status::{ClusterStatus, HolderSet, MemberStatus, HOLDER_SETS_LISTED, STATUS_REQUEST_TIMEOUTS};
