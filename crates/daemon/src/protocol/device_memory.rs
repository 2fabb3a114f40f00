//! `RegisterDeviceMemory`: an engine's KV memory that lives outside its window, in memory the
//! daemon reaches only by copies (docs/tuttid.md, "GPU memory"). Answered with
//! [`super::Reply::Registered`], like `RegisterMemory`: the registration id, the IOVA the range
//! got in the pool devices' DMA space, and that space's id.
//!
//! Body (109 bytes, little-endian): kind u8, handle [64], device UUID [16], allocation bytes u64,
//! offset bytes u64, length bytes u64, KV blocks u32. Descriptors with the frame: a
//! [`DeviceMemoryKind::CudaIpc`] registration may carry one (the range's dma-buf, where the
//! client's driver gave one); a [`DeviceMemoryKind::Memfd`] one carries exactly one (the memfd).

use super::{BodyReader, Kind, ProtocolError, Request};

/// Bytes of the handle field (a CUDA IPC memory handle's size).
pub const DEVICE_MEMORY_HANDLE_BYTES: usize = 64;
/// Bytes of the device UUID field.
pub const DEVICE_UUID_BYTES: usize = 16;

/// How the daemon reaches the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceMemoryKind {
    /// GPU memory: `handle` is the allocation's CUDA IPC handle (`cuIpcGetMemHandle` of its
    /// base), `device_uuid` its GPU; the daemon opens it with `cuIpcOpenMemHandle` and copies
    /// with `cuMemcpy`.
    CudaIpc,
    /// A sealed memfd (the descriptor with the frame) the daemon reaches only by copies: the
    /// software stand-in for GPU memory, so the route runs where no GPU is. `handle` and
    /// `device_uuid` are zero.
    Memfd,
}

impl DeviceMemoryKind {
    pub fn to_u8(self) -> u8 {
        match self {
            DeviceMemoryKind::CudaIpc => 1,
            DeviceMemoryKind::Memfd => 2,
        }
    }

    pub fn from_u8(value: u8) -> Option<DeviceMemoryKind> {
        match value {
            1 => Some(DeviceMemoryKind::CudaIpc),
            2 => Some(DeviceMemoryKind::Memfd),
            _ => None,
        }
    }
}

/// `RegisterDeviceMemory`: `length_bytes` at `offset_bytes` of an allocation of
/// `allocation_bytes` (the client's view; the daemon checks it against what it imported), of
/// which the engine's KV blocks use the first `kv_blocks` blocks (block ids below it, laid out
/// block-major from the range's start, as in a window).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterDeviceMemory {
    pub kind: DeviceMemoryKind,
    pub handle: [u8; DEVICE_MEMORY_HANDLE_BYTES],
    pub device_uuid: [u8; DEVICE_UUID_BYTES],
    pub allocation_bytes: u64,
    pub offset_bytes: u64,
    pub length_bytes: u64,
    pub kv_blocks: u32,
}

/// Encodes the body; `false` if `request` is not a `RegisterDeviceMemory`.
pub(super) fn encode_request(request: &Request, out: &mut Vec<u8>) -> bool {
    let Request::RegisterDeviceMemory(register) = request else { return false };
    out.push(register.kind.to_u8());
    out.extend_from_slice(&register.handle);
    out.extend_from_slice(&register.device_uuid);
    for value in [register.allocation_bytes, register.offset_bytes, register.length_bytes] {
        out.extend_from_slice(&value.to_le_bytes());
    }
    out.extend_from_slice(&register.kv_blocks.to_le_bytes());
    true
}

/// Decodes a `RegisterDeviceMemory` body (`None`: another kind).
pub(super) fn decode_request(kind: Kind, r: &mut BodyReader<'_>) -> Result<Option<Request>, ProtocolError> {
    if kind != Kind::RegisterDeviceMemory {
        return Ok(None);
    }
    let raw_kind = r.bytes(1, "kind")?[0];
    let memory_kind = DeviceMemoryKind::from_u8(raw_kind)
        .ok_or_else(|| r.malformed(format!("device memory kind {raw_kind}: expected 1 (CUDA IPC) or 2 (memfd)")))?;
    let mut handle = [0u8; DEVICE_MEMORY_HANDLE_BYTES];
    handle.copy_from_slice(r.bytes(DEVICE_MEMORY_HANDLE_BYTES, "handle")?);
    let mut device_uuid = [0u8; DEVICE_UUID_BYTES];
    device_uuid.copy_from_slice(r.bytes(DEVICE_UUID_BYTES, "device_uuid")?);
    Ok(Some(Request::RegisterDeviceMemory(RegisterDeviceMemory {
        kind: memory_kind,
        handle,
        device_uuid,
        allocation_bytes: r.u64("allocation_bytes")?,
        offset_bytes: r.u64("offset_bytes")?,
        length_bytes: r.u64("length_bytes")?,
        kv_blocks: r.u32("kv_blocks")?,
    })))
}

#[cfg(test)]
mod tests {
    use super::super::{encode_frame, Reply, HEADER_BYTES};
    use super::*;

    fn sample() -> RegisterDeviceMemory {
        let mut handle = [0u8; DEVICE_MEMORY_HANDLE_BYTES];
        handle.iter_mut().enumerate().for_each(|(index, byte)| *byte = index as u8 ^ 0xA5);
        RegisterDeviceMemory {
            kind: DeviceMemoryKind::CudaIpc,
            handle,
            device_uuid: [7; DEVICE_UUID_BYTES],
            allocation_bytes: 3 << 30,
            offset_bytes: 2 << 20,
            length_bytes: 1 << 30,
            kv_blocks: 2048,
        }
    }

    #[test]
    fn register_device_memory_round_trips_and_every_truncation_is_malformed() {
        // Goal: the request encodes to its 109-byte body and back, for both kinds; every shorter
        // body, a longer one and an unknown kind are typed errors, never panics.
        for kind in [DeviceMemoryKind::CudaIpc, DeviceMemoryKind::Memfd] {
            let request = Request::RegisterDeviceMemory(RegisterDeviceMemory { kind, ..sample() });
            let mut frame = Vec::new();
            encode_frame(&mut frame, request.kind(), 3, |out| request.encode_body(out)).unwrap();
            let body = &frame[HEADER_BYTES..];
            assert_eq!(body.len(), 109);
            assert_eq!(Request::decode(Kind::RegisterDeviceMemory, body).unwrap(), request);
            for cut in 0..body.len() {
                assert!(matches!(Request::decode(Kind::RegisterDeviceMemory, &body[..cut]), Err(ProtocolError::MalformedBody { .. })));
            }
            let mut long = body.to_vec();
            long.push(0);
            assert!(matches!(Request::decode(Kind::RegisterDeviceMemory, &long), Err(ProtocolError::MalformedBody { .. })));
        }
        let mut body = Vec::new();
        Request::RegisterDeviceMemory(sample()).encode_body(&mut body);
        body[0] = 9;
        let error = Request::decode(Kind::RegisterDeviceMemory, &body).unwrap_err().to_string();
        assert!(error.contains("device memory kind 9"), "{error}");
        assert_eq!(Kind::from_u16(13), Some(Kind::RegisterDeviceMemory));
        assert!(Kind::RegisterDeviceMemory.is_request());
        assert!(matches!(Reply::decode(Kind::RegisterDeviceMemory, &[]), Err(ProtocolError::MalformedBody { .. })));
    }
}
