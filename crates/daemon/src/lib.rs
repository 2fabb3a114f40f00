//! tuttid's control plane (docs/tuttid.md): one daemon owns the devices, the pool and its index;
//! engine processes attach over a Unix socket.
//!
//! - [`protocol`]: the frames and messages, pure encode/decode with typed errors;
//! - [`frame_io`]: reading and writing frames on a socket with deadlines and bounded buffers;
//! - [`fd_passing`]: descriptors with a frame (SCM_RIGHTS), the crate's only unsafe code;
//! - [`cluster`]: the daemon as a cluster node (docs/cluster.md): joins the registry, registers
//!   what each commit completes, unregisters what eviction breaks, leaves on SIGTERM;
//! - [`gpu_memory`]: KV memory reached only by copies (GPU memory through CUDA IPC, a memfd
//!   stand-in): importing it, the overlap check, why `vfio:` pools refuse it;
//! - [`keys`]: key spaces (model fingerprint + tensor-parallel rank/world size);
//! - [`lock`]: one daemon per pool (advisory locks that name their holder);
//! - [`metrics`]: Prometheus metrics and their HTTP endpoint;
//! - [`peer`]: whether a client process still runs (pid and start time, from `/proc`);
//! - [`pool_open`]: opening the daemon's devices and pool from device strings;
//! - [`relay`]: the doorbell relay (a client's doorbells on a device whose BAR0 the daemon
//!   keeps: VFIO, or a software controller in relay mode);
//! - `report`: a client's report on its own request (what it moved, blocks it found corrupt),
//!   checked against the request's grant before it is counted or acted on;
//! - [`server`]: the socket server (owner-only socket, peer credentials, leases, drain);
//! - [`session`]: what a session holds on the store path (windows, queue pairs, requests) and
//!   the safe order in which a session's end gives it back;
//! - [`client`]: the client library.
#![deny(unsafe_code)]

pub mod client;
pub mod cluster;
pub mod fd_passing;
pub mod frame_io;
pub mod gpu_memory;
pub mod keys;
pub mod lock;
pub mod metrics;
pub mod peer;
pub mod pool_open;
pub mod protocol;
pub mod relay;
mod report;
pub mod server;
pub mod session;
#[cfg(test)]
mod test_tracing;

use std::path::PathBuf;

pub use client::Client;
pub use protocol::{ErrorCode, ProtocolError};
pub use server::{Server, ServerConfig, StopHandle};

/// Everything the daemon library reports.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("the peer closed the connection in the middle of a frame ({received} of {expected} bytes)")]
    Truncated { received: usize, expected: usize },
    #[error("the connection was closed")]
    Closed,
    #[error("{what}: no answer within {after_ms} ms")]
    Timeout { what: String, after_ms: u64 },
    #[error("tuttid refused the request ({code}): {message}")]
    Remote { code: ErrorCode, message: String },
    #[error("tuttid answered {got:?} to a {asked:?} request")]
    UnexpectedReply { asked: protocol::Kind, got: protocol::Kind },
    /// A request refused before a byte of it was sent: its body passes the frame cap (a lookup
    /// of more than 262,142 tokens). The connection stays usable. (A *reply* over the cap is
    /// `Protocol(FrameTooLarge)`, and leaves the connection out of step.)
    #[error("a {kind:?} request of {body_bytes} body bytes is over the {cap_bytes}-byte frame cap (not sent)")]
    RequestTooLarge { kind: protocol::Kind, body_bytes: u32, cap_bytes: u32 },
    /// A `Hello` whose client name is longer than the daemon accepts
    /// ([`protocol::CLIENT_NAME_BYTES_MAX`]), refused before a byte of it was sent, as
    /// [`DaemonError::RequestTooLarge`]: the caller's argument; the connection stays usable.
    #[error("a client name of {name_bytes} bytes is longer than the {max_bytes} bytes tuttid accepts (not sent)")]
    ClientNameTooLong { name_bytes: usize, max_bytes: usize },
    #[error("{spec} is in use by another daemon: {lock} is held by {holder}")]
    DeviceInUse { spec: String, lock: PathBuf, holder: String },
    #[error("{socket} is served by a live daemon already")]
    SocketInUse { socket: PathBuf },
    #[error(transparent)]
    Devices(#[from] tutti_devices::DeviceError),
    #[error("bringing up {spec}: {source}")]
    Controller { spec: String, source: nvme_driver::NvmeError },
    #[error("{context}: {source}")]
    Pool { context: String, source: objstore::ObjstoreError },
    #[error("device memory: {0}")]
    DeviceMemory(String),
    #[error("cluster: {0}")]
    Cluster(String),
    /// The cluster registry's client refused or failed (typed: `ClusterError`).
    #[error("cluster registry: {0}")]
    Registry(#[source] tutti_cluster::ClusterError),
    #[error("server configuration: {0}")]
    Config(String),
}
