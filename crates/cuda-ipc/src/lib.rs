//! GPU memory between processes, for tuttid (docs/tuttid.md, "GPU memory").
//!
//! An engine process keeps its KV cache in GPU memory it allocated; tuttid, another process,
//! must reach it. This crate is both halves of that route, over the CUDA driver API (feature
//! `cuda`: `cudarc` loads libcuda at run time, so it builds without CUDA and fails at run time
//! with [`CudaIpcError::NoDriver`]):
//!
//! - **export** (the engine): [`export_range`] names a range of a CUDA allocation for another
//!   process: the allocation's CUDA IPC handle (`cuIpcGetMemHandle` of its base), the range's
//!   offset and length in it, and, where the driver gives one, a dma-buf file descriptor of the
//!   range (`cuMemGetHandleForAddressRange`), which travels with SCM_RIGHTS;
//! - **import** (tuttid): [`ImportedMemory::open`] opens the handle in the daemon's own context
//!   (`cuIpcOpenMemHandle`), checks the range against the allocation the driver reports, and
//!   implements `nvme_driver::hw::CopiedMemory`: the software controller inside the daemon moves
//!   a command's data with `cuMemcpyDtoH` / `cuMemcpyHtoD` of the imported pointer;
//! - [`DeviceBuffer`] (`cuMemAlloc`), [`Gpu`] (a device's primary context): what a client and
//!   the GPU check (`tuttid-gpu-check`) need around them.
//!
//! Every CUDA call is in `driver.rs`, the crate's only module with unsafe code; each checks its
//! result and names the call that failed.

#![deny(unsafe_code)]

#[cfg(feature = "cuda")]
mod driver;

#[cfg(feature = "cuda")]
pub use driver::{driver_available, export_range, DeviceBuffer, Export, Gpu, ImportedMemory};

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;
/// Bytes of a GPU's UUID (`CUuuid`).
pub const UUID_BYTES: usize = 16;

/// What can go wrong between two processes and a GPU.
#[derive(Debug, thiserror::Error)]
pub enum CudaIpcError {
    #[error("no CUDA driver could be loaded (libcuda.so): GPU memory cannot be exported or imported here")]
    NoDriver,
    #[error("{call} failed: {result}")]
    Cuda { call: &'static str, result: String },
    #[error("no CUDA device {ordinal} (this machine has {count})")]
    NoSuchDevice { ordinal: i32, count: i32 },
    #[error("no CUDA device here has UUID {uuid}")]
    NoDeviceWithUuid { uuid: String },
    #[error("{offset_bytes} + {length_bytes} bytes is outside the allocation of {allocation_bytes} bytes")]
    OutsideAllocation { offset_bytes: u64, length_bytes: u64, allocation_bytes: u64 },
    #[error("a zero-length range")]
    ZeroLength,
    #[error(
        "the allocation cannot be shared through CUDA IPC (cuIpcGetMemHandle): it comes from a stream-ordered memory pool \
         (cuMemAllocAsync) or the virtual memory API (cuMemCreate, e.g. PyTorch's expandable segments); allocate the KV pool \
         with cuMemAlloc / cudaMalloc"
    )]
    NotIpcCapable,
    #[error("the CUDA driver {found} is older than {needed} ({what})")]
    DriverTooOld { what: &'static str, found: i32, needed: i32 },
}

/// A UUID as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (how `nvidia-smi -L` prints it).
pub fn format_uuid(uuid: &[u8; UUID_BYTES]) -> String {
    let hex: String = uuid.iter().map(|byte| format!("{byte:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

#[cfg(test)]
mod tests {
    #[test]
    fn uuids_print_as_nvidia_smi_does() {
        let uuid = [0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef];
        assert_eq!(super::format_uuid(&uuid), "GPU-12345678-9abc-def0-0123-456789abcdef");
    }
}
