//! The crate's one error type. Every variant names what was expected and what was found, because
//! most of them describe untrusted input (an engine's registration, a device's metadata).

use gio_uring::{GioError, IocbFailure};
use nvme_driver::{HwError, NvmeError};

use crate::geometry::ModelGeometry;

/// Which of the two tensors of a layer an object holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvKind {
    Key,
    Value,
}

impl std::fmt::Display for KvKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvKind::Key => "K",
            KvKind::Value => "V",
        })
    }
}

/// A retrieved block whose bytes did not match the payload CRC recorded when it was stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MismatchedBlock {
    /// Position of the block among those the request moves, in prefix order (0 is its first:
    /// block `first_block` of the prefix for a retrieve prepared from there).
    pub position: usize,
    /// The engine block that received it (its bytes there are not to be used).
    pub engine_block: u32,
    pub device: u16,
    pub slot: u32,
    pub expected_crc: u32,
    pub computed_crc: u32,
}

impl std::fmt::Display for MismatchedBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "request block {} (engine block {}, device {} slot {}): CRC {:#010x}, recorded {:#010x}",
            self.position, self.engine_block, self.device, self.slot, self.computed_crc, self.expected_crc
        )
    }
}

/// How a request to the store's control half in another process (tuttid) failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteFailure {
    /// The daemon refused it with this error code (tutti-daemon's `ErrorCode::to_u16`).
    Refused { code: u16 },
    /// The connection is gone (closed by the daemon, a socket error, no daemon at the socket),
    /// or out of step (a reply of a kind that does not answer its request, or one that does not
    /// decode: every later call on it fails).
    /// `code`: the daemon's goodbye when it said one as it ended the connection (tutti-daemon's
    /// `ErrorCode::to_u16`: `ShuttingDown`, `LeaseExpired`, `FrameTimeout`, ...), kept for the
    /// caller's diagnostics; `None` when it closed without one or was never reached.
    Disconnected { code: Option<u16> },
    /// No answer within the client's timeout.
    TimedOut,
}

#[derive(Debug, thiserror::Error)]
pub enum ObjstoreError {
    #[error("invalid model geometry: {reason}")]
    InvalidGeometry { reason: String },
    #[error("invalid KV registration: {reason}")]
    InvalidRegistration { reason: String },
    #[error("KV registration: {first} and {second} overlap in device address space")]
    OverlappingRegistration { first: String, second: String },
    #[error("KV registration: {what} at {address:#x} is not aligned to {align_bytes} bytes ({mode} needs it)")]
    MisalignedRegistration { what: String, address: u64, align_bytes: u64, mode: &'static str },
    #[error("device address arithmetic overflows: {what}")]
    AddressOverflow { what: String },
    #[error("block id {block} outside the registered pool of {num_blocks} blocks")]
    BlockOutOfRange { block: u32, num_blocks: u32 },
    #[error("layer {layer} past the model's {layers} layers")]
    LayerOutOfRange { layer: u32, layers: u32 },
    #[error("request: {reason}")]
    BadRequest { reason: String },
    #[error("invalid format parameters: {reason}")]
    InvalidFormat { reason: String },
    #[error("device {device}: namespace of {available_bytes} bytes is too small; the format needs {needed_bytes}")]
    NamespaceTooSmall { device: usize, needed_bytes: u64, available_bytes: u64 },
    #[error("device {device}: superblock: {reason}")]
    CorruptSuperblock { device: usize, reason: String },
    /// A sound superblock recording another LBA size than the namespace it was read from has:
    /// the namespace was made with another LBA size than the format's (a software controller
    /// started with another LBA size), not damage.
    #[error("device {device}: the superblock records {recorded}-byte LBAs, the namespace has {namespace}-byte LBAs")]
    LbaSizeMismatch { device: usize, recorded: u32, namespace: u32 },
    /// `sealed`: whether the superblock's CRC checks under this build's layout. When it does, a
    /// newer tutti formatted the pool; when it does not, the version field itself may be the
    /// damage (a newer format may also place its CRC elsewhere, so neither is ruled out).
    #[error("device {device}: superblock format version {found} is newer than this build's {supported}{}", newer_version_hint(.sealed))]
    NewerFormatVersion { device: usize, found: u32, supported: u32, sealed: bool },
    #[error("device {device}: superblock format version {found} is older than this build's {supported}: {reason}")]
    OlderFormatVersion { device: usize, found: u32, supported: u32, reason: &'static str },
    /// A key secret that cannot be used (all zeroes, a malformed secret file). The reason never
    /// holds the secret or the file's text.
    #[error("key secret: {reason}")]
    KeySecret { reason: String },
    /// The source of a key secret could not be read (`/dev/urandom`, a secret file).
    #[error("key secret: reading {path}: {source}")]
    KeySecretSource { path: String, source: std::io::Error },
    #[error("pool geometry mismatch: the pool was formatted for {on_disk}, the registration is {registered}")]
    GeometryMismatch { on_disk: ModelGeometry, registered: ModelGeometry },
    #[error("device {device}: {reason}")]
    PoolMembership { device: usize, reason: String },
    #[error("pool device {device}: its controller granted {granted} I/O queue pair(s), the store needs {needed}: {reason}")]
    QueuePairs { device: usize, granted: u16, needed: usize, reason: String },
    #[error(
        "pool device {device}: metadata fenced until the pool is reopened (after a controller reset if it stopped answering): {reason}"
    )]
    MetadataFenced { device: usize, reason: String },
    /// The pool's header generation count is at its bound ([`GENERATION_MAX`]): no header can
    /// be staged (a wrapped count would make every later header lose to the older ones). The
    /// count starts at the newest header read at open. No pool counts past half the bound from
    /// a formatted pool (2^62 commits, 146 years at one a nanosecond), so when that header
    /// claims more, another tool (buggy or hostile) wrote it, or wrote one that an earlier open
    /// of this pool read and counted on from (after a restart the header read at open is
    /// usually the pool's own): `read_at_open`, and `device`, `slot` and `generation` are that
    /// header and what it claims. Otherwise (the count run up by the pool's own headers this
    /// open) they are the pool's last header and the count. The pool serves what it holds, and
    /// only a reformat lets it commit again.
    ///
    /// [`GENERATION_MAX`]: crate::format::GENERATION_MAX
    #[error("pool device {device} slot {slot}: {}", generation_exhausted_message(.generation, .read_at_open))]
    GenerationExhausted { device: usize, slot: u32, generation: u64, read_at_open: bool },
    #[error("pool full: {needed} slots needed, {evictable} free or evictable (the rest are pinned by in-flight I/O or on fenced devices)")]
    PoolFull { needed: usize, evictable: usize },
    #[error("unknown or finished request handle {handle}")]
    UnknownHandle { handle: u64 },
    #[error("request handle {handle}: {reason}")]
    HandleState { handle: u64, reason: String },
    #[error("too many requests in flight ({max})")]
    TooManyRequests { max: usize },
    /// A structure sized from what the devices record (the index, a header mirror's
    /// bookkeeping) that this host could not allocate: a pool too large for its memory, or a
    /// device reporting absurd sizes. Refused instead of aborting the process.
    #[error("host memory: {what} needs {bytes} bytes, which could not be allocated")]
    HostMemory { what: String, bytes: u64 },
    #[error("{what}: deadline passed after {done} items")]
    DeadlinePassed { what: &'static str, done: u64 },
    #[error("layer {layer} I/O failed on {iocb}: {failure:?}")]
    LayerIo { layer: u32, iocb: String, failure: IocbFailure },
    #[error(
        "request handle {handle}: payload CRC mismatch in {count} block(s), first {first}; their slots are to be evicted by the pool's holder (KvStore as it returns this; a failed eviction is logged), the request's other blocks were delivered",
        count = blocks.len(),
        first = blocks.first().map_or(String::new(), ToString::to_string)
    )]
    PayloadMismatch { handle: u64, blocks: Vec<MismatchedBlock> },
    #[error("pool shape: {reason}")]
    InvalidPoolShape { reason: String },
    #[error("placement {position} of the request: {reason} (outside the pool's shape)")]
    BadPlacement { position: usize, reason: String },
    /// The store's control half runs in another process (tuttid) and refused or failed the
    /// request, or could not be reached.
    #[error("the store's control half (tuttid): {reason}")]
    Remote { reason: String },
    /// As [`ObjstoreError::Remote`], classified, so that callers (the Python package) can
    /// react by kind: the daemon's typed refusal, a closed connection, or no answer in time.
    /// `reason` is the daemon client's message, as in `Remote`.
    #[error("the store's control half (tuttid): {reason}")]
    RemoteFailed { failure: RemoteFailure, reason: String },
    #[error("gio_uring: {0}")]
    Gio(#[from] GioError),
    #[error("NVMe: {0}")]
    Nvme(#[from] NvmeError),
    #[error("DMA memory: {0}")]
    Dma(#[from] HwError),
}

pub type Result<T, E = ObjstoreError> = std::result::Result<T, E>;

/// The end of [`ObjstoreError::NewerFormatVersion`]'s message: what the CRC says about it.
fn newer_version_hint(sealed: &bool) -> &'static str {
    if *sealed {
        " (its CRC checks: a newer tutti formatted this pool; open it with that version)"
    } else {
        " and its CRC does not check under this build's layout: a newer format, or a damaged version field"
    }
}

/// [`ObjstoreError::GenerationExhausted`]'s message after the header's place: another tool is
/// named only for a header read at open, and then as one of two causes: that header may be the
/// pool's own, counted on from another tool's header read at an earlier open.
fn generation_exhausted_message(generation: &u64, read_at_open: &bool) -> String {
    const WAY_OUT: &str = "no commit, eviction or condemnation. The pool still serves what it holds; reformat it to commit again (`tutti pool format`, `tuttid --format`; its cached blocks are lost)";
    let bound = crate::format::GENERATION_MAX;
    if *read_at_open {
        format!(
            "the newest slot header read at open, which the pool's header count started from, claims generation {generation}, more than a pool counts to from its format ({half}): another tool wrote it, or the pool counted on from a header another tool wrote (read at an earlier open). The count has reached the bound ({bound}), so the pool can write no header: {WAY_OUT}",
            half = bound / 2
        )
    } else {
        format!("the pool's newest slot header, which it wrote itself, is at generation {generation}, the bound of its header count, so it can write none: {WAY_OUT}")
    }
}
