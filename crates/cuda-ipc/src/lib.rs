//! GPU memory between processes, for tuttid (docs/tuttid.md, "GPU memory").
//!
//! An engine process keeps its KV cache in GPU memory it allocated; tuttid, another process,
//! must reach it. This crate is both halves of that route, over the CUDA driver API (feature
//! `cuda`: `cudarc` loads libcuda at run time, so it builds without CUDA and fails at run time
//! with [`CudaIpcError::NoDriver`]):
//!
//! - **export** (the engine): `export_range` names a range of a CUDA allocation for another
//!   process: the allocation's CUDA IPC handle (`cuIpcGetMemHandle` of its base), the range's
//!   offset and length in it, and, where the driver gives one, a dma-buf file descriptor of the
//!   range (`cuMemGetHandleForAddressRange`), which travels with SCM_RIGHTS;
//! - **import** (tuttid): `ImportedMemory::open` opens the handle in the daemon's own context
//!   (`cuIpcOpenMemHandle`), checks the range against the allocation the driver reports, and
//!   implements `nvme_driver::hw::CopiedMemory`: the software controller inside the daemon moves
//!   a command's data with `cuMemcpyDtoH` / `cuMemcpyHtoD` of the imported pointer;
//! - `DeviceBuffer` (`cuMemAlloc`), `Gpu` (a device's primary context): what a client and
//!   the GPU check (`tuttid-gpu-check`) need around them.
//!
//! Every CUDA call is in `driver.rs`, the crate's only module with unsafe code; each checks its
//! result and names the call that failed.
//!
//! Known limit: the imported memory's copies are synchronous (`cuMemcpyHtoD` then
//! `cuCtxSynchronize`, `cuMemcpyDtoH`) on the thread that serves the command (tuttid's software
//! controller), with no deadline of their own: a GPU that stops completing copies (a hung or lost
//! device) stalls that controller's commands until the driver gives up, rather than failing each
//! after a bound. Copies on a non-blocking stream polled (`cuEventQuery`) against a deadline would
//! fail the command instead; not done yet (no GPU to test it on where this was written).

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
    /// The allocation lives on another device than the GPU it was named with: exported, it
    /// would carry a wrong UUID; imported, it would be opened as a peer mapping, with another
    /// base than the same allocation opened on its own GPU.
    #[error("the allocation at {pointer:#x} is on CUDA device {found_ordinal}, not on device {ordinal} ({uuid}) it was named with")]
    WrongDevice { pointer: u64, ordinal: i32, uuid: String, found_ordinal: i32 },
}

/// Whether memory at `pointer`, which the driver places on device `found_ordinal`
/// (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`), is on the GPU it is named with (`ordinal`, `uuid`):
/// `export_range` checks the allocation it exports, `ImportedMemory::open` the one it opened.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn check_device_ordinal(pointer: u64, ordinal: i32, uuid: &[u8; UUID_BYTES], found_ordinal: i32) -> Result<(), CudaIpcError> {
    if found_ordinal == ordinal {
        Ok(())
    } else {
        Err(CudaIpcError::WrongDevice { pointer, ordinal, uuid: format_uuid(uuid), found_ordinal })
    }
}

/// The oldest driver the crate runs on, CUDA 11.0: the first with the `_v2` entry points it
/// calls whatever the version (`cuDevicePrimaryCtxRelease_v2`, `cuIpcOpenMemHandle_v2`), and
/// cudarc panics on a call of a symbol the loaded libcuda lacks.
const MIN_DRIVER_VERSION: i32 = 11000;

/// `found` (`cuDriverGetVersion`, e.g. 12080 for 12.8) if the crate runs on it, else
/// [`CudaIpcError::DriverTooOld`]: the driver's first check, before any call it may lack.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn check_driver_version(found: i32) -> Result<i32, CudaIpcError> {
    if found < MIN_DRIVER_VERSION {
        return Err(CudaIpcError::DriverTooOld { what: "GPU memory export and import", found, needed: MIN_DRIVER_VERSION });
    }
    Ok(found)
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

    #[test]
    fn memory_on_another_device_than_its_label_is_refused() {
        // Goal: export and import refuse an allocation the driver places on another device than
        // the GPU it is named with (a wrong ordinal from the engine would otherwise export a
        // wrong UUID, and the daemon open it as a peer mapping): the decision on the driver's
        // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL answer, which is all that runs without a GPU.
        use super::{check_device_ordinal, CudaIpcError};
        let uuid = [0x11; super::UUID_BYTES];
        assert!(check_device_ordinal(0x7f00_0000_0000, 1, &uuid, 1).is_ok());
        for found in [0, 2, -1, i32::MAX] {
            match check_device_ordinal(0x7f00_0000_0000, 1, &uuid, found) {
                Err(CudaIpcError::WrongDevice { pointer, ordinal, uuid: named, found_ordinal }) => {
                    assert_eq!((pointer, ordinal, found_ordinal), (0x7f00_0000_0000, 1, found));
                    assert_eq!(named, super::format_uuid(&uuid));
                }
                other => panic!("device {found} for a GPU labelled 1: {other:?}"),
            }
        }
        let message = check_device_ordinal(0x1000, 0, &uuid, 3).unwrap_err().to_string();
        assert!(message.contains("device 3") && message.contains("device 0") && message.contains("GPU-11111111"), "{message}");
    }

    #[test]
    fn a_driver_older_than_cuda_11_0_is_refused() {
        // Goal: a driver older than CUDA 11.0 lacks the `_v2` entry points the crate calls
        // unconditionally (cuDevicePrimaryCtxRelease_v2, cuIpcOpenMemHandle_v2), on which
        // cudarc panics; it is refused by its version, before any of them, naming both versions.
        use super::{check_driver_version, CudaIpcError};
        for found in [10020, 10000, 9020, 0, -1] {
            match check_driver_version(found) {
                Err(CudaIpcError::DriverTooOld { found: reported, needed: 11000, .. }) => assert_eq!(reported, found),
                other => panic!("driver {found}: {other:?}"),
            }
        }
        for found in [11000, 11070, 12080] {
            assert_eq!(check_driver_version(found).unwrap(), found);
        }
        let message = check_driver_version(10020).unwrap_err().to_string();
        assert!(message.contains("10020") && message.contains("11000"), "{message}");
    }
}
