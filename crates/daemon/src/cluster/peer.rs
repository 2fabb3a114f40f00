//! The data plane's wire format: what one tuttid asks another over TCP, and the segment bytes
//! it streams back. Hand-written length-prefixed frames, like the client protocol (and for
//! the same reasons, docs/tuttid.md): a 12-byte header — magic `TPDP`, version u16, kind u16,
//! body length u32 — checked before a byte of the body is read, and bodies decoded with bounds
//! checks. Everything read from a peer is untrusted: a malformed frame, a body over its kind's
//! cap, a block that is not the one expected or whose CRC does not match is a typed
//! `PeerError`, never a panic and never bytes passed on.
//!
//! A read: the asker sends `ReadSegment` (model space, segment position, its pool's geometry,
//! the segment's block keys); the holder answers `SegmentHeader` (blocks, bytes per block, how
//! many times it has served this segment, this read included: the heavy-hitter count,
//! docs/cluster.md; its pool's geometry) then one
//! `Block` per block in order (its index, its payload CRC, its bytes), or `Failure` (code, text)
//! instead of the header or in place of the first block (the holder sends the header once the
//! blocks are pinned, before it waits for its staging area: a wait that fails ends the answer).
//! Version 2 added the served count (a version-1 peer's frames are refused by version).
//! Version 3 added the pools' geometry (layers, KV heads, head dim, bytes per element, tokens
//! per block) to the request and the header: two pools whose blocks have the same size but
//! another shape (1 layer × dim 64 and 2 layers × dim 32) exchanged bytes that mean something
//! else, and the block size was all either side checked. Each side refuses a geometry not its
//! own (the holder before it pins anything).
//! Version 4 changed no frame: it marks the block key scheme, SHA-256 since pool format 4
//! (`objstore::hash`). A node on the old mix names the same prompt's segments by other keys, so
//! old and new nodes' registry entries never match and no read passes between them; the
//! registry moved to format 2 (`/v2/`) with the keys, so each side's `tutti cluster status`
//! counts the other's keys under `other_version_keys` instead of the mix only missing. A read that does pass (a 64-bit accident: the key of another prefix) is refused by
//! version at its first header instead of serving that prefix's bytes.
//! Version 5 changed no frame either: it marks the keyed block keys of pool format 5 (every
//! block's key hashes a space key derived from the pool's secret), which a version-4 node
//! (unkeyed keys) never shares; the registry moved to format 3 (`/v3/`) with it, so `status`
//! again counts the other build's keys under `other_version_keys`. (Nodes of one build whose
//! pools have different secrets share nothing too; no data-plane version shows that, the
//! member records' key secret tags (registry format 4) do, and an asker reads from no holder
//! whose record names another tag: docs/cluster.md.)
//! Every read has a deadline per frame (`read_frame`): a peer that stalls mid-stream costs
//! that long, then the read fails.

use std::io::{ErrorKind, Read, Write};
use std::time::{Duration, Instant};

use objstore::ModelGeometry;
use tutti_cluster::{ModelSpace, FINGERPRINT_BYTES};

const MAGIC: [u8; 4] = *b"TPDP";
/// 5 since block keys are keyed at every block (pool format 5; 4 marked SHA-256 keys, module
/// comment): an older peer's keys are of another scheme, and a match between the two is
/// another prefix's.
pub const VERSION: u16 = 5;
pub const HEADER_BYTES: usize = 12;
/// Most blocks one segment has (`SegmentBlocks::MAX`).
pub const SEGMENT_BLOCKS_MAX: usize = 64;
/// Longest failure text.
const MESSAGE_BYTES_MAX: usize = 1024;
/// Largest block the data plane moves (a 70B-class model's 16-token block is ~5 MiB).
pub const BLOCK_BYTES_MAX: u64 = 256 << 20;

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerKind {
    ReadSegment = 1,
    SegmentHeader = 0x8001,
    Block = 0x8002,
    Failure = 0x80FF,
}

impl PeerKind {
    fn from_u16(value: u16) -> Option<PeerKind> {
        Some(match value {
            1 => PeerKind::ReadSegment,
            0x8001 => PeerKind::SegmentHeader,
            0x8002 => PeerKind::Block,
            0x80FF => PeerKind::Failure,
            _ => return None,
        })
    }
}

/// Why a holder refused a read (the `Failure` frame's code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureCode {
    /// The request did not decode or did not fit this node (another segment size, a bad key).
    BadRequest,
    /// A block of the segment is not (or no longer) held here.
    NotHeld,
    /// Reading the blocks from the holder's SSDs failed (I/O, a timeout, a recorded CRC that the
    /// bytes do not match).
    ReadFailed,
    /// The holder is busy or shutting down.
    Unavailable,
    Unknown(u16),
}

impl FailureCode {
    fn to_u16(self) -> u16 {
        match self {
            FailureCode::BadRequest => 1,
            FailureCode::NotHeld => 2,
            FailureCode::ReadFailed => 3,
            FailureCode::Unavailable => 4,
            FailureCode::Unknown(code) => code,
        }
    }

    fn from_u16(code: u16) -> FailureCode {
        match code {
            1 => FailureCode::BadRequest,
            2 => FailureCode::NotHeld,
            3 => FailureCode::ReadFailed,
            4 => FailureCode::Unavailable,
            other => FailureCode::Unknown(other),
        }
    }
}

/// What can go wrong on the data plane, on either side.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("{context}: {source}")]
    Io { context: &'static str, source: std::io::Error },
    #[error("the peer sent nothing for {waited:?} while {context}")]
    Stalled { context: &'static str, waited: Duration },
    #[error("the peer closed the connection while {context}")]
    Closed { context: &'static str },
    /// This daemon's drain (`stopped`), not the peer: told apart so that it is neither
    /// blamed on the peer nor counted as a fault.
    #[error("this daemon is stopping (while {context})")]
    Stopped { context: &'static str },
    #[error("the peer does not speak the data plane: {0}")]
    Garbage(String),
    #[error("the holder refused the read ({code:?}): {message}")]
    Refused { code: FailureCode, message: String },
    #[error("block {index} of the segment failed its CRC: sent {sent:#010x}, received bytes give {computed:#010x}")]
    Checksum { index: usize, sent: u32, computed: u32 },
}

/// A checked frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerHeader {
    pub kind: PeerKind,
    pub body_bytes: u32,
}

pub fn encode_header(out: &mut Vec<u8>, kind: PeerKind, body_bytes: u32) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(kind as u16).to_le_bytes());
    out.extend_from_slice(&body_bytes.to_le_bytes());
}

/// Checks magic, version, kind, and the body against `body_max` for that kind.
pub fn decode_header(bytes: &[u8; HEADER_BYTES], body_max: impl Fn(PeerKind) -> u64) -> Result<PeerHeader, PeerError> {
    if bytes[..4] != MAGIC {
        return Err(PeerError::Garbage(format!("frame magic {:02x?}", &bytes[..4])));
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != VERSION {
        return Err(PeerError::Garbage(format!("data plane version {version}, this build speaks {VERSION}")));
    }
    let raw = u16::from_le_bytes([bytes[6], bytes[7]]);
    let kind = PeerKind::from_u16(raw).ok_or_else(|| PeerError::Garbage(format!("frame kind {raw:#06x}")))?;
    let body_bytes = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if u64::from(body_bytes) > body_max(kind) {
        return Err(PeerError::Garbage(format!("a {kind:?} body of {body_bytes} bytes is over its cap of {}", body_max(kind))));
    }
    Ok(PeerHeader { kind, body_bytes })
}

/// Reads exactly `out.len()` bytes, each read bounded by `stall` and the whole by `deadline`;
/// `stopped` is asked between reads (the daemon's drain). The stream must have a read timeout
/// set (the caller's tick); each timeout re-checks all three.
pub fn read_exact_bounded(
    stream: &mut impl Read,
    out: &mut [u8],
    stall: Duration,
    deadline: Instant,
    stopped: &dyn Fn() -> bool,
    context: &'static str,
) -> Result<(), PeerError> {
    let mut filled = 0;
    let mut last_progress = Instant::now();
    while filled < out.len() {
        if stopped() {
            return Err(PeerError::Stopped { context });
        }
        match stream.read(&mut out[filled..]) {
            Ok(0) => return Err(PeerError::Closed { context }),
            Ok(count) => {
                filled += count;
                last_progress = Instant::now();
            }
            Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
            Err(source) => return Err(PeerError::Io { context, source }),
        }
        let now = Instant::now();
        if filled < out.len() && (now >= deadline || now.duration_since(last_progress) >= stall) {
            return Err(PeerError::Stalled { context, waited: now.duration_since(last_progress) });
        }
    }
    Ok(())
}

/// Reads one frame (header, then its body into `body`, resized), bounded as
/// [`read_exact_bounded`]: the header's first byte may take up to `idle` (a connection waiting
/// for its next request), every byte after it at most `stall` (a frame left half sent).
#[allow(clippy::too_many_arguments)]
pub fn read_frame(
    stream: &mut impl Read,
    body: &mut Vec<u8>,
    body_max: impl Fn(PeerKind) -> u64,
    idle: Duration,
    stall: Duration,
    deadline: Instant,
    stopped: &dyn Fn() -> bool,
    context: &'static str,
) -> Result<PeerKind, PeerError> {
    let mut first = [0u8; 1];
    read_exact_bounded(stream, &mut first, idle, deadline, stopped, context)?;
    read_frame_begun(stream, first[0], body, body_max, stall, deadline, stopped, context)
}

/// [`read_frame`] once the frame's first byte (`first`) came: the rest of it, every byte
/// bounded by `stall` and the whole by `deadline`. For a caller that tells a connection closed
/// before a byte of the answer from one closed mid-frame.
#[allow(clippy::too_many_arguments)]
pub fn read_frame_begun(
    stream: &mut impl Read,
    first: u8,
    body: &mut Vec<u8>,
    body_max: impl Fn(PeerKind) -> u64,
    stall: Duration,
    deadline: Instant,
    stopped: &dyn Fn() -> bool,
    context: &'static str,
) -> Result<PeerKind, PeerError> {
    let mut header = [0u8; HEADER_BYTES];
    header[0] = first;
    read_exact_bounded(stream, &mut header[1..], stall, deadline, stopped, context)?;
    let header = decode_header(&header, body_max)?;
    body.clear();
    body.resize(header.body_bytes as usize, 0);
    read_exact_bounded(stream, body, stall, deadline, stopped, context)?;
    Ok(header.kind)
}

/// Writes all of `bytes`, the whole bounded by `deadline` and each write by the stream's write
/// timeout (a write that moves nothing for that long is a stall); `stopped` is asked between
/// writes. A peer that reads a byte at a time therefore cannot hold the writer past `deadline`.
pub fn write_all(
    stream: &mut impl Write,
    bytes: &[u8],
    deadline: Instant,
    stopped: &dyn Fn() -> bool,
    context: &'static str,
) -> Result<(), PeerError> {
    let started = Instant::now();
    let mut written = 0;
    while written < bytes.len() {
        if stopped() {
            return Err(PeerError::Stopped { context });
        }
        if Instant::now() >= deadline {
            return Err(PeerError::Stalled { context, waited: started.elapsed() });
        }
        match stream.write(&bytes[written..]) {
            Ok(0) => return Err(PeerError::Closed { context }),
            Ok(count) => written += count,
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(PeerError::Stalled { context, waited: started.elapsed() });
            }
            Err(source) => return Err(PeerError::Io { context, source }),
        }
    }
    Ok(())
}

/// Bytes of a pool's geometry on the wire: layers, KV heads, head dim, bytes per element and
/// tokens per block, each a u32.
pub const GEOMETRY_BYTES: usize = 20;

/// Appends `geometry` (see [`GEOMETRY_BYTES`]).
fn encode_geometry(out: &mut Vec<u8>, geometry: &ModelGeometry) {
    for field in [geometry.layers, geometry.kv_heads, geometry.head_dim, geometry.dtype_bytes, geometry.block_tokens] {
        out.extend_from_slice(&field.to_le_bytes());
    }
}

/// A geometry as sent: plain numbers, not checked here — the receiver compares it with its
/// own pool's, field for field, and that equality is the only check that matters.
fn decode_geometry(bytes: &[u8; GEOMETRY_BYTES]) -> ModelGeometry {
    let field = |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    ModelGeometry { layers: field(0), kv_heads: field(4), head_dim: field(8), dtype_bytes: field(12), block_tokens: field(16) }
}

/// A read of one segment: its model space, position, the asker's pool geometry (what its
/// blocks' bytes must mean) and block keys (the last is its key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadSegment {
    pub space: ModelSpace,
    pub index: u32,
    pub geometry: ModelGeometry,
    pub keys: Vec<u64>,
}

impl ReadSegment {
    /// Bytes of the body before the keys.
    const FIXED_BYTES: usize = FINGERPRINT_BYTES + 4 + 4 + 4 + GEOMETRY_BYTES + 2;

    pub fn body_max() -> u64 {
        (Self::FIXED_BYTES + 8 * SEGMENT_BLOCKS_MAX) as u64
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.clear();
        let body = Self::FIXED_BYTES + 8 * self.keys.len();
        encode_header(out, PeerKind::ReadSegment, body as u32);
        out.extend_from_slice(self.space.fingerprint());
        out.extend_from_slice(&self.space.tp_rank().to_le_bytes());
        out.extend_from_slice(&self.space.tp_world().to_le_bytes());
        out.extend_from_slice(&self.index.to_le_bytes());
        encode_geometry(out, &self.geometry);
        out.extend_from_slice(&(self.keys.len() as u16).to_le_bytes());
        for key in &self.keys {
            out.extend_from_slice(&key.to_le_bytes());
        }
    }

    pub fn decode(body: &[u8]) -> Result<ReadSegment, String> {
        let fixed = Self::FIXED_BYTES;
        if body.len() < fixed {
            return Err(format!("a ReadSegment body of {} bytes, at least {fixed} expected", body.len()));
        }
        let fingerprint: [u8; FINGERPRINT_BYTES] = body[..FINGERPRINT_BYTES].try_into().map_err(|_| "fingerprint")?;
        let word = |at: usize| u32::from_le_bytes([body[at], body[at + 1], body[at + 2], body[at + 3]]);
        let (rank, world, index) = (word(FINGERPRINT_BYTES), word(FINGERPRINT_BYTES + 4), word(FINGERPRINT_BYTES + 8));
        let at = FINGERPRINT_BYTES + 12;
        let geometry: &[u8; GEOMETRY_BYTES] = body[at..at + GEOMETRY_BYTES].try_into().map_err(|_| "geometry")?;
        let geometry = decode_geometry(geometry);
        let at = at + GEOMETRY_BYTES;
        let count = usize::from(u16::from_le_bytes([body[at], body[at + 1]]));
        if count == 0 || count > SEGMENT_BLOCKS_MAX || body.len() != fixed + 8 * count {
            return Err(format!("{count} keys in a body of {} bytes", body.len()));
        }
        let space = ModelSpace::new(fingerprint, rank, world).map_err(|error| error.to_string())?;
        let keys: Vec<u64> = body[fixed..].chunks_exact(8).map(|chunk| u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8]))).collect();
        if keys.contains(&0) {
            return Err("a block key of 0".into());
        }
        Ok(ReadSegment { space, index, geometry, keys })
    }
}

/// Bytes of a `SegmentHeader` body: blocks u16, bytes per block u64, times served u32, the
/// holder's pool geometry.
const SEGMENT_HEADER_BYTES: usize = 14 + GEOMETRY_BYTES;

/// The holder's answer before the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    pub blocks: u16,
    pub block_bytes: u64,
    /// Reads of this segment the holder has answered with its data since it started (this one
    /// included; its bounded count, `heavy_hitters.rs`): what the asker compares with its
    /// `--cluster-replicate-after`.
    pub served: u32,
    /// The holder's pool geometry: what its blocks' bytes mean.
    pub geometry: ModelGeometry,
}

pub fn encode_segment_header(out: &mut Vec<u8>, header: SegmentHeader) {
    out.clear();
    encode_header(out, PeerKind::SegmentHeader, SEGMENT_HEADER_BYTES as u32);
    out.extend_from_slice(&header.blocks.to_le_bytes());
    out.extend_from_slice(&header.block_bytes.to_le_bytes());
    out.extend_from_slice(&header.served.to_le_bytes());
    encode_geometry(out, &header.geometry);
}

pub fn decode_segment_header(body: &[u8]) -> Result<SegmentHeader, PeerError> {
    let Ok(body) = <&[u8; SEGMENT_HEADER_BYTES]>::try_from(body) else {
        return Err(PeerError::Garbage(format!("a SegmentHeader body of {} bytes, {SEGMENT_HEADER_BYTES} expected", body.len())));
    };
    let (fixed, geometry) = body.split_at(14);
    let [b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13] = <[u8; 14]>::try_from(fixed).unwrap_or([0; 14]);
    let geometry: &[u8; GEOMETRY_BYTES] =
        geometry.try_into().map_err(|_| PeerError::Garbage("a SegmentHeader's geometry cut short".into()))?;
    Ok(SegmentHeader {
        blocks: u16::from_le_bytes([b0, b1]),
        block_bytes: u64::from_le_bytes([b2, b3, b4, b5, b6, b7, b8, b9]),
        served: u32::from_le_bytes([b10, b11, b12, b13]),
        geometry: decode_geometry(geometry),
    })
}

/// One block's frame header and prefix (index, CRC); its bytes follow as the rest of the body.
pub fn encode_block_prefix(out: &mut Vec<u8>, index: u16, crc: u32, block_bytes: usize) {
    out.clear();
    encode_header(out, PeerKind::Block, (6 + block_bytes) as u32);
    out.extend_from_slice(&index.to_le_bytes());
    out.extend_from_slice(&crc.to_le_bytes());
}

/// A block frame's body: (index, sent CRC, bytes), the bytes checked against the CRC.
pub fn decode_block(body: &[u8], block_bytes: usize) -> Result<(u16, u32, &[u8]), PeerError> {
    if body.len() != 6 + block_bytes {
        return Err(PeerError::Garbage(format!("a Block body of {} bytes, {} expected", body.len(), 6 + block_bytes)));
    }
    let index = u16::from_le_bytes([body[0], body[1]]);
    let sent = u32::from_le_bytes([body[2], body[3], body[4], body[5]]);
    let bytes = &body[6..];
    let computed = crc32fast::hash(bytes);
    if computed != sent {
        return Err(PeerError::Checksum { index: usize::from(index), sent, computed });
    }
    Ok((index, sent, bytes))
}

pub fn encode_failure(out: &mut Vec<u8>, code: FailureCode, message: &str) {
    let mut end = message.len().min(MESSAGE_BYTES_MAX);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    out.clear();
    encode_header(out, PeerKind::Failure, (4 + end) as u32);
    out.extend_from_slice(&code.to_u16().to_le_bytes());
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&message.as_bytes()[..end]);
}

pub fn decode_failure(body: &[u8]) -> PeerError {
    if body.len() < 4 || body.len() != 4 + usize::from(u16::from_le_bytes([body[2], body[3]])) {
        return PeerError::Garbage(format!("a Failure body of {} bytes that does not frame", body.len()));
    }
    PeerError::Refused {
        code: FailureCode::from_u16(u16::from_le_bytes([body[0], body[1]])),
        message: String::from_utf8_lossy(&body[4..]).into_owned(),
    }
}

/// The largest body the holder's answers may have, for an asker expecting `block_bytes`.
pub fn answer_body_max(kind: PeerKind, block_bytes: u64) -> u64 {
    match kind {
        PeerKind::SegmentHeader => SEGMENT_HEADER_BYTES as u64,
        PeerKind::Block => 6 + block_bytes,
        PeerKind::Failure => 4 + MESSAGE_BYTES_MAX as u64,
        PeerKind::ReadSegment => 0,
    }
}

/// The largest body a holder accepts from an asker.
pub fn request_body_max(kind: PeerKind) -> u64 {
    match kind {
        PeerKind::ReadSegment => ReadSegment::body_max(),
        _ => 0,
    }
}

#[cfg(test)]
mod proptests;

#[cfg(test)]
mod tests {
    use super::*;

    const GEOMETRY: ModelGeometry = ModelGeometry { layers: 80, kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_tokens: 16 };

    fn request() -> ReadSegment {
        ReadSegment {
            space: ModelSpace::new([9; FINGERPRINT_BYTES], 1, 2).unwrap(),
            index: 3,
            geometry: GEOMETRY,
            keys: (1..=16).collect(),
        }
    }

    fn body(frame: &[u8]) -> &[u8] {
        &frame[HEADER_BYTES..]
    }

    #[test]
    fn frames_round_trip_and_every_cut_or_flip_is_refused() {
        // Goal: each frame decodes to what was encoded; a request cut anywhere or with a count
        // that lies is refused in words; a block whose bytes or CRC changed fails its CRC; a
        // header with another magic, version, kind or an oversized body is refused before the body.
        let mut frame = Vec::new();
        request().encode(&mut frame);
        let header = decode_header(frame[..HEADER_BYTES].try_into().unwrap(), request_body_max).unwrap();
        assert_eq!((header.kind, header.body_bytes as usize), (PeerKind::ReadSegment, frame.len() - HEADER_BYTES));
        assert_eq!(ReadSegment::decode(body(&frame)).unwrap(), request());
        for cut in 0..body(&frame).len() {
            assert!(ReadSegment::decode(&body(&frame)[..cut]).is_err(), "cut at {cut}");
        }
        let mut zero_key = frame.clone();
        let at = zero_key.len() - 8;
        zero_key[at..].fill(0);
        assert!(ReadSegment::decode(body(&zero_key)).unwrap_err().contains("key of 0"));

        let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        encode_block_prefix(&mut frame, 5, crc32fast::hash(&bytes), bytes.len());
        frame.extend_from_slice(&bytes);
        let (index, _, received) = decode_block(body(&frame), bytes.len()).unwrap();
        assert_eq!((index, received), (5, &bytes[..]));
        for position in [HEADER_BYTES + 2, HEADER_BYTES + 6, frame.len() - 1] {
            let mut flipped = frame.clone();
            flipped[position] ^= 1;
            assert!(matches!(decode_block(body(&flipped), bytes.len()), Err(PeerError::Checksum { index: 5, .. })), "byte {position}");
        }
        assert!(matches!(decode_block(&body(&frame)[1..], bytes.len()), Err(PeerError::Garbage(_))));

        encode_failure(&mut frame, FailureCode::NotHeld, "block 3 is gone");
        match decode_failure(body(&frame)) {
            PeerError::Refused { code: FailureCode::NotHeld, message } => assert_eq!(message, "block 3 is gone"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(decode_failure(&body(&frame)[..5]), PeerError::Garbage(_)));

        let sent = SegmentHeader { blocks: 16, block_bytes: 4096, served: 3, geometry: GEOMETRY };
        encode_segment_header(&mut frame, sent);
        assert_eq!(decode_segment_header(body(&frame)).unwrap(), sent);
        assert!(matches!(decode_segment_header(&body(&frame)[..10]), Err(PeerError::Garbage(_))), "a version-1 header body");
        assert!(matches!(decode_segment_header(&body(&frame)[..14]), Err(PeerError::Garbage(_))), "a version-2 header body");
        let header: [u8; HEADER_BYTES] = frame[..HEADER_BYTES].try_into().unwrap();
        for (position, value) in [(0, b'X'), (4, 9), (6, 0x77)] {
            let mut bad = header;
            bad[position] = value;
            assert!(matches!(decode_header(&bad, |kind| answer_body_max(kind, 4096)), Err(PeerError::Garbage(_))), "byte {position}");
        }
        let mut big = Vec::new();
        encode_header(&mut big, PeerKind::Block, 4096 + 7);
        assert!(matches!(decode_header(big[..].try_into().unwrap(), |kind| answer_body_max(kind, 4096)), Err(PeerError::Garbage(_))));
    }

    #[test]
    fn a_peer_on_the_weak_key_scheme_is_refused_by_version() {
        // Goal: a peer of an earlier data plane version (block keys of an earlier scheme: pool
        // format 3's fast mix up to version 3, format 4's unkeyed SHA-256 at version 4) is
        // refused at its first header, in words naming the version, rather than being asked for
        // segments whose keys it can never hold.
        for old in 1..VERSION {
            let mut frame = Vec::new();
            request().encode(&mut frame);
            frame[4..6].copy_from_slice(&old.to_le_bytes());
            match decode_header(frame[..HEADER_BYTES].try_into().unwrap(), request_body_max) {
                Err(PeerError::Garbage(message)) => assert!(message.contains(&format!("data plane version {old}")), "{message}"),
                other => panic!("version {old}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_stalled_or_closed_stream_is_a_bounded_typed_error() {
        // Goal: a peer that sends part of a frame and then nothing fails the read after the
        // stall bound (not the whole deadline); one that closes fails at once.
        let (mut near, mut far) = std::os::unix::net::UnixStream::pair().unwrap();
        near.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
        far.write_all(&MAGIC).unwrap();
        let started = Instant::now();
        let mut body = Vec::new();
        let stall = Duration::from_millis(200);
        let never = || false;
        // A long idle wait for the first byte does not stretch the stall bound after it.
        let idle = Duration::from_secs(30);
        let result = read_frame(
            &mut near,
            &mut body,
            request_body_max,
            idle,
            stall,
            started + Duration::from_secs(30),
            &never,
            "reading a test frame",
        );
        assert!(matches!(result, Err(PeerError::Stalled { .. })), "{result:?}");
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        drop(far);
        let result =
            read_frame(&mut near, &mut body, request_body_max, stall, stall, Instant::now() + stall, &never, "reading a test frame");
        assert!(matches!(result, Err(PeerError::Closed { .. })), "{result:?}");
    }

    #[test]
    fn a_peer_reading_a_trickle_cannot_hold_a_writer_past_its_deadline() {
        // Goal: a reader that takes a few bytes at a time keeps every single write moving, so
        // only the whole write's deadline ends it, with a stall error, well before the bytes
        // are all taken.
        // TCP on loopback: a reader's small reads free the sender's window as they go (a Unix
        // socket frees space per whole message, which makes every write stall instead).
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut near = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut far, _) = listener.accept().unwrap();
        near.set_write_timeout(Some(Duration::from_millis(500))).unwrap();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader_done = std::sync::Arc::clone(&done);
        let reader = std::thread::spawn(move || {
            let mut buffer = [0u8; 4096];
            far.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(5) && !reader_done.load(std::sync::atomic::Ordering::Acquire) {
                match far.read(&mut buffer) {
                    Ok(0) => return,
                    Ok(_) | Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        let bytes = vec![7u8; 64 << 20];
        let never = || false;
        let started = Instant::now();
        let result = write_all(&mut near, &bytes, started + Duration::from_millis(400), &never, "writing a test frame");
        assert!(matches!(result, Err(PeerError::Stalled { .. })), "{result:?}");
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        let stopped = || true;
        let result = write_all(&mut near, &bytes, Instant::now() + Duration::from_secs(30), &stopped, "writing a test frame");
        assert!(matches!(result, Err(PeerError::Stopped { .. })), "{result:?}");
        done.store(true, std::sync::atomic::Ordering::Release);
        drop(near);
        reader.join().unwrap();
    }
}
