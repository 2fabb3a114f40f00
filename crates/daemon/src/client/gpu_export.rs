//! KV memory outside the client's window: the engine's GPU memory (CUDA IPC), or its software
//! stand-in (a sealed memfd the daemon reaches only by copies), registered with the daemon as
//! device memory (`RegisterDeviceMemory`, docs/tuttid.md "GPU memory").
//!
//! The engine keeps its KV blocks where it computes on them; the daemon's software controllers
//! copy each command's data in and out of that memory. The client's window then holds only its
//! queue rings and the mapping table ([`super::RemoteKvStore::connect_with_device_memory`]).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use nvme_driver::hw::SharedMemory;

use crate::protocol::{DeviceMemoryKind, RegisterDeviceMemory, DEVICE_MEMORY_HANDLE_BYTES, DEVICE_UUID_BYTES};

/// A range of memory the engine registers as device memory (its KV blocks, block-major from the
/// range's start); [`RegisterDeviceMemory`] less the KV block count, which the store adds.
#[derive(Debug)]
pub struct DeviceKvMemory {
    pub kind: DeviceMemoryKind,
    /// The allocation's CUDA IPC handle (zero for a memfd).
    pub handle: [u8; DEVICE_MEMORY_HANDLE_BYTES],
    /// The GPU the allocation lives on (zero for a memfd).
    pub device_uuid: [u8; DEVICE_UUID_BYTES],
    pub allocation_bytes: u64,
    pub offset_bytes: u64,
    pub length_bytes: u64,
    /// Sent with the request (SCM_RIGHTS): the memfd, or the range's dma-buf where the driver
    /// gave one.
    pub descriptor: Option<OwnedFd>,
}

impl DeviceKvMemory {
    /// `length_bytes` at `offset_bytes` of a sealed memfd (`SharedMemory::create`): the software
    /// stand-in for GPU memory, which the daemon reaches only by copies.
    pub fn memfd(memory: &Arc<SharedMemory>, offset_bytes: u64, length_bytes: u64) -> std::io::Result<DeviceKvMemory> {
        Ok(DeviceKvMemory {
            kind: DeviceMemoryKind::Memfd,
            handle: [0; DEVICE_MEMORY_HANDLE_BYTES],
            device_uuid: [0; DEVICE_UUID_BYTES],
            allocation_bytes: memory.len() as u64,
            offset_bytes,
            length_bytes,
            descriptor: Some(memory.fd().try_clone_to_owned()?),
        })
    }

    /// GPU memory exported with `tutti_cuda_ipc::export_range` (or `DeviceBuffer::export`).
    #[cfg(feature = "cuda")]
    pub fn cuda(export: tutti_cuda_ipc::Export) -> DeviceKvMemory {
        if let Some(reason) = &export.dma_buf_refusal {
            tracing::info!(reason, "registering GPU memory without a dma-buf");
        }
        DeviceKvMemory {
            kind: DeviceMemoryKind::CudaIpc,
            handle: export.ipc_handle,
            device_uuid: export.device_uuid,
            allocation_bytes: export.allocation_bytes,
            offset_bytes: export.offset_bytes,
            length_bytes: export.length_bytes,
            descriptor: export.dma_buf,
        }
    }

    /// The request registering its first `kv_blocks` blocks.
    pub fn request(&self, kv_blocks: u32) -> RegisterDeviceMemory {
        RegisterDeviceMemory {
            kind: self.kind,
            handle: self.handle,
            device_uuid: self.device_uuid,
            allocation_bytes: self.allocation_bytes,
            offset_bytes: self.offset_bytes,
            length_bytes: self.length_bytes,
            kv_blocks,
        }
    }

    /// The descriptors to send with the request.
    pub fn descriptors(&self) -> Vec<BorrowedFd<'_>> {
        self.descriptor.iter().map(AsFd::as_fd).collect()
    }
}
