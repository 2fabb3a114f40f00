//! The wire protocol between tuttid and its clients: hand-written, length-prefixed frames.
//!
//! Every frame is a 16-byte header and a body of at most [`BODY_BYTES_MAX`] bytes, all integers
//! little-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `b"TUTD"` |
//! | 4 | 2 | protocol version ([`PROTOCOL_VERSION`]) |
//! | 6 | 2 | message kind ([`Kind`]) |
//! | 8 | 4 | request id: chosen by the client, echoed in the reply |
//! | 12 | 4 | body length in bytes |
//!
//! The header is checked before a byte of the body is read: a wrong magic, another version, an
//! unknown kind or a body over the cap is refused without reading (or allocating for) the body.
//! Bodies are decoded field by field with a bounds-checked reader; a body that is short, long,
//! or carries an out-of-range count is [`ProtocolError::MalformedBody`], never a panic.
//! docs/tuttid.md explains why hand-written frames rather than serde + a codec.

use std::fmt;

mod cluster;
mod device_memory;
mod status;
mod store;

pub use cluster::{ClusterLookupReply, ClusterStatusReply, RegistryAnswer, RemoteHolder, REMOTE_HOLDERS_MAX};
pub use device_memory::{DeviceMemoryKind, RegisterDeviceMemory, DEVICE_MEMORY_HANDLE_BYTES, DEVICE_UUID_BYTES};
pub use status::{
    ClientStatus, DeviceStatus, PoolStatus, RelayStatus, StatusReply, CLIENT_STATUS_BYTES_MAX, DEVICE_STATUS_BYTES_MAX, STATUS_CLIENTS_MAX,
    STATUS_DEVICES_RESERVED,
};
pub use store::{
    block_named_twice, AttachQueues, Commit, NamespaceGrant, Prepare, QueueGrant, RegisterMemory, Registered, RetrievePrepared,
    RingOffsets, StorePrepared, DEVICES_MAX, NAMESPACES_MAX, PREPARE_BLOCKS_MAX, RELEASE_CORRUPT_BLOCKS_MAX,
};

/// Frame magic, the bytes `TUTD`.
pub const MAGIC: [u8; 4] = *b"TUTD";
/// The one protocol version this build speaks. A frame of another version is refused with
/// [`ErrorCode::UnsupportedVersion`], naming both.
pub const PROTOCOL_VERSION: u16 = 9;
/// Bytes of a frame header.
pub const HEADER_BYTES: usize = 16;
/// Largest body: 1 MiB, a lookup of 262,142 tokens (vLLM's longest contexts are 128k–1M tokens).
/// A longer prompt is not looked up or cached through tuttid: every key chain starts from the
/// session's seed at the prompt's first token and no request carries a previous key, so its
/// tail cannot be asked for on its own (tokens `N..` would match other prompts that begin with
/// them). `RemoteKvStore::lookup_from` answers it a miss, warning once.
pub const BODY_BYTES_MAX: u32 = 1 << 20;
/// Longest string field (device descriptions, error messages).
pub const STRING_BYTES_MAX: usize = 4096;
/// Longest client name given in `Hello`.
pub const CLIENT_NAME_BYTES_MAX: usize = 64;
/// Largest tensor-parallel world size accepted, and bytes of a model fingerprint (e.g. SHA-256
/// of the model's config and weights' identity, computed by the client; opaque to the daemon):
/// the cluster tier's, which checks a model space for the whole workspace.
pub use tutti_cluster::{FINGERPRINT_BYTES, TP_WORLD_MAX};

/// What a frame carries. Replies have the high bit set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    Hello = 1,
    Lookup = 2,
    Status = 3,
    Ping = 4,
    LookupAllRanks = 5,
    RegisterMemory = 6,
    AttachQueues = 7,
    PoolShape = 8,
    PrepareRetrieve = 9,
    PrepareStore = 10,
    Commit = 11,
    Release = 12,
    RegisterDeviceMemory = 13,
    ClusterStatus = 14,
    LookupCluster = 15,
    FetchRemote = 16,
    HelloReply = 0x8001,
    LookupReply = 0x8002,
    StatusReply = 0x8003,
    Pong = 0x8004,
    Registered = 0x8006,
    Attached = 0x8007,
    PoolShapeReply = 0x8008,
    RetrievePrepared = 0x8009,
    StorePrepared = 0x800A,
    Committed = 0x800B,
    Released = 0x800C,
    ClusterStatusReply = 0x800E,
    ClusterLookupReply = 0x800F,
    Fetched = 0x8010,
    Error = 0x80FF,
}

impl Kind {
    pub fn from_u16(value: u16) -> Option<Kind> {
        Some(match value {
            1 => Kind::Hello,
            2 => Kind::Lookup,
            3 => Kind::Status,
            4 => Kind::Ping,
            5 => Kind::LookupAllRanks,
            6 => Kind::RegisterMemory,
            7 => Kind::AttachQueues,
            8 => Kind::PoolShape,
            9 => Kind::PrepareRetrieve,
            10 => Kind::PrepareStore,
            11 => Kind::Commit,
            12 => Kind::Release,
            13 => Kind::RegisterDeviceMemory,
            14 => Kind::ClusterStatus,
            15 => Kind::LookupCluster,
            16 => Kind::FetchRemote,
            0x8001 => Kind::HelloReply,
            0x8002 => Kind::LookupReply,
            0x8003 => Kind::StatusReply,
            0x8004 => Kind::Pong,
            0x8006 => Kind::Registered,
            0x8007 => Kind::Attached,
            0x8008 => Kind::PoolShapeReply,
            0x8009 => Kind::RetrievePrepared,
            0x800A => Kind::StorePrepared,
            0x800B => Kind::Committed,
            0x800C => Kind::Released,
            0x800E => Kind::ClusterStatusReply,
            0x800F => Kind::ClusterLookupReply,
            0x8010 => Kind::Fetched,
            0x80FF => Kind::Error,
            _ => return None,
        })
    }

    pub fn is_request(self) -> bool {
        (self as u16) & 0x8000 == 0
    }
}

/// Why the daemon refused a frame or a request (the `Error` reply's code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    BadMagic,
    UnsupportedVersion,
    FrameTooLarge,
    MalformedBody,
    UnknownKind,
    /// A request other than Hello, Status or Ping before Hello.
    NotAttached,
    AlreadyAttached,
    /// A frame started but did not complete within the frame timeout.
    FrameTimeout,
    /// No frame within the lease: the session is ended and everything it held released.
    LeaseExpired,
    /// Retry shortly: the daemon serves its maximum number of connections (to Hello), or an
    /// attach waits for an ended session's queue deletion to be confirmed (to AttachQueues).
    Busy,
    ShuttingDown,
    /// A well-formed request with values the daemon cannot accept.
    BadRequest,
    /// The peer's user id is not allowed.
    PermissionDenied,
    /// A handle or registration this session did not make (another session's, or none).
    NotYours,
    /// A per-session cap (registrations, window bytes, requests in flight) is reached.
    LimitReached,
    /// The devices cannot serve this request (e.g. no shared register page: VFIO today).
    Unsupported,
    /// The store refused or failed the request (pool full, I/O error, ...).
    StoreFailed,
    /// A client's report on its own request (what its data path moved, blocks it found
    /// corrupt) that the request's grant does not cover: refused, nothing counted or evicted.
    BadReport,
    /// A remote read failed (the registry, the holder, the network, a checksum, or storing the
    /// segment here): those blocks are not here; recompute them. Nothing of a segment that
    /// failed its checks is stored.
    RemoteReadFailed,
    /// A code this build does not know (a newer daemon).
    Unknown(u16),
}

impl ErrorCode {
    pub fn to_u16(self) -> u16 {
        match self {
            ErrorCode::BadMagic => 1,
            ErrorCode::UnsupportedVersion => 2,
            ErrorCode::FrameTooLarge => 3,
            ErrorCode::MalformedBody => 4,
            ErrorCode::UnknownKind => 5,
            ErrorCode::NotAttached => 6,
            ErrorCode::AlreadyAttached => 7,
            ErrorCode::FrameTimeout => 8,
            ErrorCode::LeaseExpired => 9,
            ErrorCode::Busy => 10,
            ErrorCode::ShuttingDown => 11,
            ErrorCode::BadRequest => 12,
            ErrorCode::PermissionDenied => 13,
            ErrorCode::NotYours => 14,
            ErrorCode::LimitReached => 15,
            ErrorCode::Unsupported => 16,
            ErrorCode::StoreFailed => 17,
            ErrorCode::BadReport => 18,
            ErrorCode::RemoteReadFailed => 19,
            ErrorCode::Unknown(code) => code,
        }
    }

    pub fn from_u16(code: u16) -> ErrorCode {
        match code {
            1 => ErrorCode::BadMagic,
            2 => ErrorCode::UnsupportedVersion,
            3 => ErrorCode::FrameTooLarge,
            4 => ErrorCode::MalformedBody,
            5 => ErrorCode::UnknownKind,
            6 => ErrorCode::NotAttached,
            7 => ErrorCode::AlreadyAttached,
            8 => ErrorCode::FrameTimeout,
            9 => ErrorCode::LeaseExpired,
            10 => ErrorCode::Busy,
            11 => ErrorCode::ShuttingDown,
            12 => ErrorCode::BadRequest,
            13 => ErrorCode::PermissionDenied,
            14 => ErrorCode::NotYours,
            15 => ErrorCode::LimitReached,
            16 => ErrorCode::Unsupported,
            17 => ErrorCode::StoreFailed,
            18 => ErrorCode::BadReport,
            19 => ErrorCode::RemoteReadFailed,
            other => ErrorCode::Unknown(other),
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorCode::Unknown(code) => write!(f, "unknown error code {code}"),
            other => write!(f, "{other:?}"),
        }
    }
}

/// A frame or body that does not follow this protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("bad frame magic {found:02x?} (expected {MAGIC:02x?} 'TUTD'): not a tuttid client or daemon")]
    BadMagic { found: [u8; 4] },
    #[error("protocol version {found}; this build speaks version {PROTOCOL_VERSION} only")]
    UnsupportedVersion { found: u16 },
    #[error("frame body of {body_bytes} bytes is over the cap of {BODY_BYTES_MAX}")]
    FrameTooLarge { body_bytes: u32 },
    #[error("unknown message kind {kind:#06x}")]
    UnknownKind { kind: u16 },
    #[error("malformed {kind:?} body: {reason}")]
    MalformedBody { kind: Kind, reason: String },
}

impl ProtocolError {
    /// The code the daemon answers this with.
    pub fn code(&self) -> ErrorCode {
        match self {
            ProtocolError::BadMagic { .. } => ErrorCode::BadMagic,
            ProtocolError::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
            ProtocolError::FrameTooLarge { .. } => ErrorCode::FrameTooLarge,
            ProtocolError::UnknownKind { .. } => ErrorCode::UnknownKind,
            ProtocolError::MalformedBody { .. } => ErrorCode::MalformedBody,
        }
    }
}

/// A checked frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: Kind,
    pub request_id: u32,
    pub body_bytes: u32,
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        out[8..12].copy_from_slice(&self.request_id.to_le_bytes());
        out[12..16].copy_from_slice(&self.body_bytes.to_le_bytes());
        out
    }

    /// Checks magic, version, kind and the body cap, in that order (so a peer speaking another
    /// version is told that, not that its kind is unknown).
    pub fn decode(bytes: &[u8; HEADER_BYTES]) -> Result<FrameHeader, ProtocolError> {
        let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if magic != MAGIC {
            return Err(ProtocolError::BadMagic { found: magic });
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != PROTOCOL_VERSION {
            return Err(ProtocolError::UnsupportedVersion { found: version });
        }
        let raw_kind = u16::from_le_bytes([bytes[6], bytes[7]]);
        let kind = Kind::from_u16(raw_kind).ok_or(ProtocolError::UnknownKind { kind: raw_kind })?;
        let request_id = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        let body_bytes = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
        if body_bytes > BODY_BYTES_MAX {
            return Err(ProtocolError::FrameTooLarge { body_bytes });
        }
        Ok(FrameHeader { kind, request_id, body_bytes })
    }
}

/// A client's identity and key space, sent once per connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The model's identity (opaque, computed by the client); part of every key.
    pub model_fingerprint: [u8; FINGERPRINT_BYTES],
    /// Tensor-parallel rank (0-based) and world size; part of every key.
    pub tp_rank: u32,
    pub tp_world: u32,
    /// For `status` (e.g. "vllm-worker-3"), at most [`CLIENT_NAME_BYTES_MAX`] bytes.
    pub client_name: String,
}

/// The model shape the pool was formatted for, so a client can check it against its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype_bytes: u32,
    pub block_tokens: u32,
    pub blocks_per_slot: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloReply {
    pub session: u64,
    /// A session that sends no frame for this long is ended (send `Ping` when idle).
    pub lease_ms: u32,
    pub shape: PoolShape,
}

/// What a client asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Hello(Hello),
    /// Where the run of cached blocks of `tokens`' prefix from `first_block` ends, in the
    /// session's key space (from 0: the longest cached prefix; protocol version 4).
    Lookup {
        tokens: Vec<u32>,
        first_block: u32,
    },
    Status,
    /// Keeps the lease alive.
    Ping,
    /// Where the run of blocks of `tokens`' prefix from `first_block` cached on every rank of
    /// the session's model and world size ends (for an engine's scheduler process; answered
    /// with [`Reply::Lookup`]).
    LookupAllRanks {
        tokens: Vec<u32>,
        first_block: u32,
    },
    /// Registers the client's memory window (its sealed memfd goes with the frame).
    RegisterMemory(RegisterMemory),
    /// Creates the client's queue pairs, one per pool device, with rings in its window.
    AttachQueues(AttachQueues),
    /// The pool's shape (objstore's `PoolShape`), for the client's data half.
    PoolShape,
    PrepareRetrieve(Prepare),
    PrepareStore(Prepare),
    Commit(Commit),
    /// Ends a request without committing (a retrieve's pins, a store's reservation), with the
    /// client's report: what its data path moved, and the blocks its verification found
    /// corrupt (the daemon evicts them; protocol version 3).
    Release {
        handle: u64,
        transferred: objstore::Transferred,
        corrupt_blocks: Vec<objstore::MismatchedBlock>,
    },
    /// Registers KV memory the daemon reaches only by copies (GPU memory through CUDA IPC; a
    /// memfd stand-in); answered with [`Reply::Registered`]. Descriptors: see
    /// [`RegisterDeviceMemory`].
    RegisterDeviceMemory(RegisterDeviceMemory),
    /// The node's part in the cluster (answered with [`Reply::ClusterStatus`]; allowed before
    /// `Hello`).
    ClusterStatus,
    /// The longest prefix of `tokens` cached here, as `Lookup` answers it, and how many further
    /// blocks other nodes of the cluster hold, by whom (answered with [`Reply::ClusterLookup`]).
    LookupCluster {
        tokens: Vec<u32>,
    },
    /// Reads what other nodes hold of `tokens` past the local prefix from a holder and stores
    /// it here, so a `PrepareRetrieve` then finds it (answered with [`Reply::Fetched`], or
    /// `RemoteReadFailed`).
    FetchRemote {
        tokens: Vec<u32>,
    },
}

/// What the daemon answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Hello(HelloReply),
    Lookup {
        cached_blocks: u32,
        block_tokens: u32,
    },
    Status(StatusReply),
    Pong,
    Error {
        code: ErrorCode,
        message: String,
    },
    Registered(Registered),
    /// One grant per pool device; the register pages' memfds go with the frame.
    Attached {
        queues: Vec<QueueGrant>,
    },
    PoolShape(objstore::PoolShape),
    RetrievePrepared(RetrievePrepared),
    StorePrepared(StorePrepared),
    Committed {
        stored: u32,
    },
    Released,
    ClusterStatus(ClusterStatusReply),
    ClusterLookup(ClusterLookupReply),
    /// After a `FetchRemote`: the local prefix now, and the blocks stored from other nodes.
    Fetched {
        cached_blocks: u32,
        fetched_blocks: u32,
    },
}

impl Request {
    pub fn kind(&self) -> Kind {
        match self {
            Request::Hello(_) => Kind::Hello,
            Request::Lookup { .. } => Kind::Lookup,
            Request::Status => Kind::Status,
            Request::Ping => Kind::Ping,
            Request::LookupAllRanks { .. } => Kind::LookupAllRanks,
            Request::RegisterMemory(_) => Kind::RegisterMemory,
            Request::AttachQueues(_) => Kind::AttachQueues,
            Request::PoolShape => Kind::PoolShape,
            Request::PrepareRetrieve(_) => Kind::PrepareRetrieve,
            Request::PrepareStore(_) => Kind::PrepareStore,
            Request::Commit(_) => Kind::Commit,
            Request::Release { .. } => Kind::Release,
            Request::RegisterDeviceMemory(_) => Kind::RegisterDeviceMemory,
            Request::ClusterStatus => Kind::ClusterStatus,
            Request::LookupCluster { .. } => Kind::LookupCluster,
            Request::FetchRemote { .. } => Kind::FetchRemote,
        }
    }

    /// Appends the body to `out`.
    pub fn encode_body(&self, out: &mut Vec<u8>) {
        match self {
            Request::Hello(hello) => {
                out.extend_from_slice(&hello.model_fingerprint);
                put_u32(out, hello.tp_rank);
                put_u32(out, hello.tp_world);
                put_str(out, &hello.client_name);
            }
            Request::Lookup { tokens, first_block } | Request::LookupAllRanks { tokens, first_block } => {
                encode_lookup_from_body(tokens, *first_block, out)
            }
            Request::LookupCluster { tokens } | Request::FetchRemote { tokens } => encode_lookup_body(tokens, out),
            Request::Status | Request::Ping | Request::ClusterStatus => {}
            other => {
                if !store::encode_request(other, out) {
                    device_memory::encode_request(other, out);
                }
            }
        }
    }

    pub fn decode(kind: Kind, body: &[u8]) -> Result<Request, ProtocolError> {
        let mut reader = BodyReader { kind, body, at: 0 };
        let request = match kind {
            Kind::Hello => {
                let mut model_fingerprint = [0u8; FINGERPRINT_BYTES];
                model_fingerprint.copy_from_slice(reader.bytes(FINGERPRINT_BYTES, "model_fingerprint")?);
                let tp_rank = reader.u32("tp_rank")?;
                let tp_world = reader.u32("tp_world")?;
                let client_name = reader.string("client_name", CLIENT_NAME_BYTES_MAX)?;
                Request::Hello(Hello { model_fingerprint, tp_rank, tp_world, client_name })
            }
            Kind::Lookup | Kind::LookupAllRanks | Kind::LookupCluster | Kind::FetchRemote => {
                let first_block = if matches!(kind, Kind::Lookup | Kind::LookupAllRanks) { reader.u32("first_block")? } else { 0 };
                let count = reader.u32("token_count")? as usize;
                // The count must match the body exactly: checked before anything is allocated.
                if reader.remaining() != count.saturating_mul(4) {
                    return Err(reader.malformed(format!("token_count {count} but {} bytes of tokens", reader.remaining())));
                }
                let tokens =
                    reader.bytes(count * 4, "tokens")?.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                match kind {
                    Kind::Lookup => Request::Lookup { tokens, first_block },
                    Kind::LookupAllRanks => Request::LookupAllRanks { tokens, first_block },
                    Kind::LookupCluster => Request::LookupCluster { tokens },
                    _ => Request::FetchRemote { tokens },
                }
            }
            Kind::Status => Request::Status,
            Kind::Ping => Request::Ping,
            Kind::ClusterStatus => Request::ClusterStatus,
            other => match store::decode_request(other, &mut reader)? {
                Some(request) => request,
                None => match device_memory::decode_request(other, &mut reader)? {
                    Some(request) => request,
                    None => return Err(ProtocolError::MalformedBody { kind: other, reason: "a reply kind sent as a request".into() }),
                },
            },
        };
        reader.finish()?;
        Ok(request)
    }
}

impl Reply {
    pub fn kind(&self) -> Kind {
        match self {
            Reply::Hello(_) => Kind::HelloReply,
            Reply::Lookup { .. } => Kind::LookupReply,
            Reply::Status(_) => Kind::StatusReply,
            Reply::Pong => Kind::Pong,
            Reply::Error { .. } => Kind::Error,
            Reply::Registered(_) => Kind::Registered,
            Reply::Attached { .. } => Kind::Attached,
            Reply::PoolShape(_) => Kind::PoolShapeReply,
            Reply::RetrievePrepared(_) => Kind::RetrievePrepared,
            Reply::StorePrepared(_) => Kind::StorePrepared,
            Reply::Committed { .. } => Kind::Committed,
            Reply::Released => Kind::Released,
            Reply::ClusterStatus(_) => Kind::ClusterStatusReply,
            Reply::ClusterLookup(_) => Kind::ClusterLookupReply,
            Reply::Fetched { .. } => Kind::Fetched,
        }
    }

    pub fn error(code: ErrorCode, message: impl Into<String>) -> Reply {
        let mut message = message.into();
        truncate_to(&mut message, STRING_BYTES_MAX);
        Reply::Error { code, message }
    }

    pub fn encode_body(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Hello(reply) => {
                put_u64(out, reply.session);
                put_u32(out, reply.lease_ms);
                put_shape(out, &reply.shape);
            }
            Reply::Lookup { cached_blocks, block_tokens } => {
                put_u32(out, *cached_blocks);
                put_u32(out, *block_tokens);
            }
            Reply::Fetched { cached_blocks, fetched_blocks } => {
                put_u32(out, *cached_blocks);
                put_u32(out, *fetched_blocks);
            }
            Reply::Status(status) => status::put_status(out, status),
            Reply::ClusterStatus(status) => cluster::put_cluster_status(out, status),
            Reply::ClusterLookup(lookup) => cluster::put_cluster_lookup(out, lookup),
            Reply::Pong => {}
            Reply::Error { code, message } => {
                put_u16(out, code.to_u16());
                put_str(out, message);
            }
            other => {
                store::encode_reply(other, out);
            }
        }
    }

    pub fn decode(kind: Kind, body: &[u8]) -> Result<Reply, ProtocolError> {
        let mut r = BodyReader { kind, body, at: 0 };
        let reply = match kind {
            Kind::HelloReply => Reply::Hello(HelloReply { session: r.u64("session")?, lease_ms: r.u32("lease_ms")?, shape: r.shape()? }),
            Kind::LookupReply => Reply::Lookup { cached_blocks: r.u32("cached_blocks")?, block_tokens: r.u32("block_tokens")? },
            Kind::Fetched => Reply::Fetched { cached_blocks: r.u32("cached_blocks")?, fetched_blocks: r.u32("fetched_blocks")? },
            Kind::StatusReply => Reply::Status(r.status()?),
            Kind::ClusterStatusReply => Reply::ClusterStatus(r.cluster_status()?),
            Kind::ClusterLookupReply => Reply::ClusterLookup(r.cluster_lookup()?),
            Kind::Pong => Reply::Pong,
            Kind::Error => Reply::Error { code: ErrorCode::from_u16(r.u16("code")?), message: r.string("message", STRING_BYTES_MAX)? },
            other => match store::decode_reply(other, &mut r)? {
                Some(reply) => reply,
                None => return Err(ProtocolError::MalformedBody { kind: other, reason: "a request kind sent as a reply".into() }),
            },
        };
        r.finish()?;
        Ok(reply)
    }
}

/// Appends a whole frame (header and body) for `kind` to `out`, whose body `encode` appends.
/// Returns an error instead of a frame the peer would refuse; `out` is then left empty, with
/// at most one frame's capacity (callers reuse it for the life of a connection, and a refused
/// body can be any size: a 10M-token lookup is 40 MB).
pub fn encode_frame(out: &mut Vec<u8>, kind: Kind, request_id: u32, encode: impl FnOnce(&mut Vec<u8>)) -> Result<(), ProtocolError> {
    out.clear();
    out.extend_from_slice(&[0u8; HEADER_BYTES]);
    encode(out);
    let body_bytes = out.len() - HEADER_BYTES;
    if body_bytes > BODY_BYTES_MAX as usize {
        out.clear();
        out.shrink_to(HEADER_BYTES + BODY_BYTES_MAX as usize);
        return Err(ProtocolError::FrameTooLarge { body_bytes: u32::try_from(body_bytes).unwrap_or(u32::MAX) });
    }
    let header = FrameHeader { kind, request_id, body_bytes: body_bytes as u32 };
    out[..HEADER_BYTES].copy_from_slice(&header.encode());
    Ok(())
}

/// A `Lookup` body for `tokens` (the client encodes from a slice, without building a
/// [`Request`]).
/// The body of `Lookup` and `LookupAllRanks`: `first_block`, then as [`encode_lookup_body`].
pub fn encode_lookup_from_body(tokens: &[u32], first_block: u32, out: &mut Vec<u8>) {
    put_u32(out, first_block);
    encode_lookup_body(tokens, out);
}

pub fn encode_lookup_body(tokens: &[u32], out: &mut Vec<u8>) {
    put_u32(out, tokens.len() as u32);
    for &token in tokens {
        put_u32(out, token);
    }
}

fn put_u16(out: &mut Vec<u8>, value: u16) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_u32(out: &mut Vec<u8>, value: u32) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(&value.to_le_bytes());
}

/// A string as u16 length + UTF-8, cut (on a character boundary) to [`STRING_BYTES_MAX`].
fn put_str(out: &mut Vec<u8>, text: &str) {
    put_str_within(out, text, STRING_BYTES_MAX);
}

/// A string as u16 length + UTF-8, cut (on a character boundary) to `bytes_max` (at most
/// [`STRING_BYTES_MAX`]).
fn put_str_within(out: &mut Vec<u8>, text: &str, bytes_max: usize) {
    let mut end = text.len().min(bytes_max.min(STRING_BYTES_MAX));
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    put_u16(out, end as u16);
    out.extend_from_slice(&text.as_bytes()[..end]);
}

fn put_shape(out: &mut Vec<u8>, shape: &PoolShape) {
    for value in [shape.layers, shape.kv_heads, shape.head_dim, shape.dtype_bytes, shape.block_tokens, shape.blocks_per_slot] {
        put_u32(out, value);
    }
}

fn truncate_to(text: &mut String, bytes: usize) {
    if text.len() > bytes {
        let mut end = bytes;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

/// Bounds-checked reading of one body; every failure names the field.
struct BodyReader<'a> {
    kind: Kind,
    body: &'a [u8],
    at: usize,
}

impl<'a> BodyReader<'a> {
    fn malformed(&self, reason: String) -> ProtocolError {
        ProtocolError::MalformedBody { kind: self.kind, reason }
    }

    fn remaining(&self) -> usize {
        self.body.len() - self.at
    }

    fn bytes(&mut self, count: usize, field: &str) -> Result<&'a [u8], ProtocolError> {
        if self.remaining() < count {
            return Err(self.malformed(format!("{field} needs {count} bytes at offset {}, {} left", self.at, self.remaining())));
        }
        let slice = &self.body[self.at..self.at + count];
        self.at += count;
        Ok(slice)
    }

    fn u16(&mut self, field: &str) -> Result<u16, ProtocolError> {
        let b = self.bytes(2, field)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, field: &str) -> Result<u32, ProtocolError> {
        let b = self.bytes(4, field)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, field: &str) -> Result<u64, ProtocolError> {
        let b = self.bytes(8, field)?;
        let mut word = [0u8; 8];
        word.copy_from_slice(b);
        Ok(u64::from_le_bytes(word))
    }

    fn string(&mut self, field: &str, bytes_max: usize) -> Result<String, ProtocolError> {
        let length = usize::from(self.u16(field)?);
        if length > bytes_max {
            return Err(self.malformed(format!("{field} of {length} bytes is over its cap of {bytes_max}")));
        }
        let raw = self.bytes(length, field)?;
        std::str::from_utf8(raw).map(str::to_string).map_err(|error| self.malformed(format!("{field} is not UTF-8: {error}")))
    }

    fn shape(&mut self) -> Result<PoolShape, ProtocolError> {
        Ok(PoolShape {
            layers: self.u32("layers")?,
            kv_heads: self.u32("kv_heads")?,
            head_dim: self.u32("head_dim")?,
            dtype_bytes: self.u32("dtype_bytes")?,
            block_tokens: self.u32("block_tokens")?,
            blocks_per_slot: self.u32("blocks_per_slot")?,
        })
    }

    fn finish(&self) -> Result<(), ProtocolError> {
        if self.remaining() != 0 {
            return Err(self.malformed(format!("{} trailing bytes after the last field", self.remaining())));
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod proptests;
#[cfg(test)]
mod tests;
