//! Every CUDA driver call of the crate (through `cudarc::driver::sys`, loaded at run time), the
//! only module allowed unsafe code. Each call's result is checked and a failure names the call.
//!
//! cudarc's loaded functions panic when libcuda or a symbol is missing, so nothing here calls
//! the driver before [`ensure_driver`] succeeded: every entry point is [`Gpu::open`] (or takes a
//! [`Gpu`], which only it makes). [`ensure_driver`] refuses a driver older than CUDA 11.0 (the
//! `_v2` calls below need it), and calls newer than CUDA 11.0 check the driver's version first.
//!
//! Contexts: a [`Gpu`] retains its device's primary context; every operation makes it current on
//! the calling thread first (the daemon's controller threads call in from wherever they run). The
//! engine-side entry points ([`Gpu::open`], [`export_range`]) make the caller's current context
//! current again before they return ([`RestoreCurrent`]): in an engine the current context is
//! the framework's current device (PyTorch's `torch.cuda.current_device()`), which registering
//! KV tensors of another GPU must not move. The driver API is thread-safe.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;
use nvme_driver::hw::{CopiedMemory, HwError};

use crate::{check_device_ordinal, check_driver_version, format_uuid, CudaIpcError, IPC_HANDLE_BYTES, UUID_BYTES};

/// The first driver with `CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`, CUDA 11.3.
const IPC_CAPABLE_ATTRIBUTE_MIN_DRIVER_VERSION: i32 = 11030;
/// The first driver with `cuMemGetHandleForAddressRange` (dma-buf export), CUDA 11.7.
const DMA_BUF_MIN_DRIVER_VERSION: i32 = 11070;
/// dma-buf ranges must start and end on host pages; 4 KiB here (x86-64, and Arm kernels with
/// 4 KiB pages; a 64 KiB-page kernel refuses and the export goes without a dma-buf).
const HOST_PAGE_BYTES: u64 = 4096;

fn check(call: &'static str, result: sys::CUresult) -> Result<(), CudaIpcError> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaIpcError::Cuda { call, result: format!("{result:?}") })
    }
}

fn copy_error(error: CudaIpcError) -> HwError {
    HwError::Backend { backend: "cuda", message: error.to_string() }
}

/// Whether libcuda can be loaded at all. Never panics.
pub fn driver_available() -> bool {
    // SAFETY: is_culib_present only tries to dlopen the candidate library names and drops the
    // handles; it touches no CUDA state and is the probe to call before anything else.
    unsafe { sys::is_culib_present() }
}

/// Loads the driver and runs `cuInit`; the driver's version, refused below CUDA 11.0
/// ([`CudaIpcError::DriverTooOld`], see `check_driver_version`). Idempotent (cuInit may be
/// called again).
fn ensure_driver() -> Result<i32, CudaIpcError> {
    if !driver_available() {
        return Err(CudaIpcError::NoDriver);
    }
    // SAFETY: libcuda is loadable (checked above); cuInit takes a flags word only.
    check("cuInit", unsafe { sys::cuInit(0) })?;
    let mut version = 0i32;
    // SAFETY: `version` is a valid out-pointer for the duration of the call.
    check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut version) })?;
    check_driver_version(version)
}

/// The context current on the calling thread when saved (none: null), made current again when
/// dropped.
struct RestoreCurrent(sys::CUcontext);

impl RestoreCurrent {
    /// Only once the driver is loaded ([`ensure_driver`]).
    fn save() -> Result<RestoreCurrent, CudaIpcError> {
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `current` is a valid out-pointer; the driver is loaded and initialized (the
        // caller's contract).
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut current) })?;
        Ok(RestoreCurrent(current))
    }
}

impl Drop for RestoreCurrent {
    fn drop(&mut self) {
        // SAFETY: the handle was current on this thread when saved, or null (unbinds whatever
        // is current); the caller's context outlives this call, which cannot destroy it.
        if let Err(error) = check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.0) }) {
            tracing::warn!(%error, "making the caller's CUDA context current again");
        }
    }
}

/// One GPU and its retained primary context.
#[derive(Debug)]
pub struct Gpu {
    device: sys::CUdevice,
    context: sys::CUcontext,
    ordinal: i32,
    uuid: [u8; UUID_BYTES],
    name: String,
    driver_version: i32,
    dma_buf_supported: bool,
}

// SAFETY: `device` and `context` are opaque handles of the CUDA driver API, which is
// thread-safe; any thread may use the context once it made it current, which every operation
// here does first. The context is released once, by Drop.
unsafe impl Send for Gpu {}
// SAFETY: as above; no operation mutates `Gpu` itself.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Device `ordinal` (as CUDA numbers them in this process), its primary context retained.
    /// The caller's current context is current again when this returns.
    pub fn open(ordinal: i32) -> Result<Arc<Gpu>, CudaIpcError> {
        let driver_version = ensure_driver()?;
        let _restore = RestoreCurrent::save()?;
        let mut count = 0i32;
        // SAFETY: `count` is a valid out-pointer; cuInit succeeded.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut count) })?;
        if ordinal < 0 || ordinal >= count {
            return Err(CudaIpcError::NoSuchDevice { ordinal, count });
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: `device` is a valid out-pointer; the ordinal is in range (checked above).
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut device, ordinal) })?;
        let uuid = device_uuid(device)?;
        let name = device_name(device)?;
        let mut dma_buf = 0i32;
        if driver_version >= DMA_BUF_MIN_DRIVER_VERSION {
            // SAFETY: `dma_buf` is a valid out-pointer; `device` came from cuDeviceGet; the
            // attribute exists in drivers of this version (checked above).
            check("cuDeviceGetAttribute(DMA_BUF_SUPPORTED)", unsafe {
                sys::cuDeviceGetAttribute(&mut dma_buf, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, device)
            })?;
        }
        let mut context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `context` is a valid out-pointer; `device` came from cuDeviceGet.
        check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, device) })?;
        let gpu = Gpu { device, context, ordinal, uuid, name, driver_version, dma_buf_supported: dma_buf == 1 };
        gpu.make_current()?;
        Ok(Arc::new(gpu))
    }

    /// The device whose UUID is `uuid` (a client names its GPU so; ordinals differ between
    /// processes with other `CUDA_VISIBLE_DEVICES`).
    pub fn open_by_uuid(uuid: &[u8; UUID_BYTES]) -> Result<Arc<Gpu>, CudaIpcError> {
        ensure_driver()?;
        let mut count = 0i32;
        // SAFETY: `count` is a valid out-pointer; cuInit succeeded.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut count) })?;
        for ordinal in 0..count {
            let mut device: sys::CUdevice = 0;
            // SAFETY: `device` is a valid out-pointer; the ordinal is below the count.
            check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut device, ordinal) })?;
            if device_uuid(device)? == *uuid {
                return Gpu::open(ordinal);
            }
        }
        Err(CudaIpcError::NoDeviceWithUuid { uuid: format_uuid(uuid) })
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    pub fn uuid(&self) -> [u8; UUID_BYTES] {
        self.uuid
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The driver's CUDA version, e.g. 12080 for 12.8.
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// Whether the device exports dma-bufs (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`; needs the
    /// open kernel modules and a kernel with dma-buf support).
    pub fn dma_buf_supported(&self) -> bool {
        self.dma_buf_supported
    }

    fn make_current(&self) -> Result<(), CudaIpcError> {
        // SAFETY: `context` is the primary context this Gpu retained, alive until its Drop.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.context) })
    }

    /// Waits for every copy of the context (a host-to-device copy from pageable memory may
    /// return before its DMA lands).
    fn synchronize(&self) -> Result<(), CudaIpcError> {
        // SAFETY: no arguments; the context is current (callers made it so).
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// `cuMemGetAddressRange`: the allocation holding `pointer`, (base, bytes).
    fn address_range(&self, pointer: u64) -> Result<(u64, u64), CudaIpcError> {
        let mut base: sys::CUdeviceptr = 0;
        let mut bytes = 0usize;
        // SAFETY: both out-pointers are valid locals; the driver validates `pointer` (an address
        // of no allocation is an error code, not an access).
        check("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut bytes, pointer) })?;
        Ok((base, bytes as u64))
    }

    /// Refuses memory at `pointer` that the driver places on another device than this GPU
    /// (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`, the device it was allocated on, numbered as this
    /// process numbers devices, as `ordinal` is).
    fn check_holds(&self, pointer: u64) -> Result<(), CudaIpcError> {
        let mut found: i32 = -1;
        // SAFETY: the attribute's value is an int and `found` a live i32; the driver validates
        // `pointer` (an address of no allocation is an error code, not an access).
        check("cuPointerGetAttribute(DEVICE_ORDINAL)", unsafe {
            sys::cuPointerGetAttribute(
                (&mut found as *mut i32).cast::<c_void>(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                pointer,
            )
        })?;
        check_device_ordinal(pointer, self.ordinal, &self.uuid, found)
    }

    /// Copies `source` to device memory at `device_pointer` and waits for it to land, without a
    /// deadline (the crate's known limit: a hung GPU blocks the calling thread here).
    ///
    /// # Safety
    /// `device_pointer..device_pointer + source.len()` must lie in one live allocation this
    /// process may write (its own, or an imported one still open), reached from this context.
    unsafe fn copy_to_device(&self, device_pointer: u64, source: &[u8]) -> Result<(), CudaIpcError> {
        self.make_current()?;
        // SAFETY: `source` is a live host slice for the call; the destination range is valid
        // device memory (the caller's contract). From pageable memory the call may return
        // before the DMA lands: synchronized below.
        check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(device_pointer, source.as_ptr().cast::<c_void>(), source.len()) })?;
        self.synchronize()
    }

    /// Copies device memory at `device_pointer` into `destination`.
    ///
    /// # Safety
    /// `device_pointer..device_pointer + destination.len()` must lie in one live allocation
    /// this process may read, reached from this context.
    unsafe fn copy_to_host(&self, device_pointer: u64, destination: &mut [u8]) -> Result<(), CudaIpcError> {
        self.make_current()?;
        // SAFETY: `destination` is a live, exclusively borrowed host slice for the call; the
        // source range is valid device memory (the caller's contract). A device-to-pageable copy
        // returns only once the bytes are in `destination`.
        check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(destination.as_mut_ptr().cast::<c_void>(), device_pointer, destination.len()) })
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: paired with the retain in `open`; every DeviceBuffer and ImportedMemory holds an
        // Arc of this Gpu, so none is left using the context.
        if let Err(error) = check("cuDevicePrimaryCtxRelease", unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) }) {
            tracing::warn!(%error, "releasing a primary context");
        }
    }
}

fn device_uuid(device: sys::CUdevice) -> Result<[u8; UUID_BYTES], CudaIpcError> {
    let mut uuid = sys::CUuuid { bytes: [0; UUID_BYTES] };
    // SAFETY: `uuid` is a valid out-pointer of the right type; `device` came from cuDeviceGet.
    check("cuDeviceGetUuid", unsafe { sys::cuDeviceGetUuid(&mut uuid, device) })?;
    Ok(uuid.bytes.map(|byte| byte as u8))
}

fn device_name(device: sys::CUdevice) -> Result<String, CudaIpcError> {
    let mut name = [0 as c_char; 256];
    // SAFETY: `name` is a writable buffer of the length passed; the driver NUL-terminates within it.
    check("cuDeviceGetName", unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, device) })?;
    let bytes: Vec<u8> = name.iter().take_while(|&&byte| byte != 0).map(|&byte| byte as u8).collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// GPU memory this process allocated (`cuMemAlloc`), freed on drop. Reached by copies only
/// (no Rust reference into device memory exists).
#[derive(Debug)]
pub struct DeviceBuffer {
    gpu: Arc<Gpu>,
    pointer: u64,
    len: usize,
}

impl DeviceBuffer {
    /// `len` bytes of device memory (contents undefined until written or filled).
    pub fn allocate(gpu: &Arc<Gpu>, len: usize) -> Result<DeviceBuffer, CudaIpcError> {
        if len == 0 {
            return Err(CudaIpcError::ZeroLength);
        }
        gpu.make_current()?;
        let mut pointer: sys::CUdeviceptr = 0;
        // SAFETY: `pointer` is a valid out-pointer; the context is current.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut pointer, len) })?;
        Ok(DeviceBuffer { gpu: Arc::clone(gpu), pointer, len })
    }

    /// The device address of the first byte (for [`export_range`] or a kernel).
    pub fn device_pointer(&self) -> u64 {
        self.pointer
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: usize, len: usize) -> Result<u64, CudaIpcError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.pointer + offset as u64),
            _ => Err(CudaIpcError::OutsideAllocation {
                offset_bytes: offset as u64,
                length_bytes: len as u64,
                allocation_bytes: self.len as u64,
            }),
        }
    }

    /// Copies `source` into the buffer at `offset`; returns once the bytes landed.
    pub fn write(&self, offset: usize, source: &[u8]) -> Result<(), CudaIpcError> {
        let at = self.check(offset, source.len())?;
        // SAFETY: `at..at + len` lies in this live allocation (bounds checked above).
        unsafe { self.gpu.copy_to_device(at, source) }
    }

    /// Copies the buffer's bytes at `offset` into `destination`.
    pub fn read(&self, offset: usize, destination: &mut [u8]) -> Result<(), CudaIpcError> {
        let at = self.check(offset, destination.len())?;
        // SAFETY: `at..at + len` lies in this live allocation (bounds checked above).
        unsafe { self.gpu.copy_to_host(at, destination) }
    }

    /// Sets every byte to `byte`; returns once done.
    pub fn fill(&self, byte: u8) -> Result<(), CudaIpcError> {
        self.gpu.make_current()?;
        // SAFETY: the whole allocation, which this buffer owns and keeps alive.
        check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(self.pointer, byte, self.len) })?;
        self.gpu.synchronize()
    }

    /// [`export_range`] of `len` bytes at `offset` of this buffer.
    pub fn export(&self, offset: usize, len: usize) -> Result<Export, CudaIpcError> {
        let at = self.check(offset, len)?;
        export_range(&self.gpu, at, len as u64)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let freed = self.gpu.make_current().and_then(|()| {
            // SAFETY: `pointer` came from cuMemAlloc and is freed once, here. A process that
            // imported it must have closed its handle first (the daemon does at session end;
            // CUDA calls freeing it earlier undefined for the importer, not for this process).
            check("cuMemFree", unsafe { sys::cuMemFree_v2(self.pointer) })
        });
        if let Err(error) = freed {
            tracing::warn!(%error, "freeing device memory");
        }
    }
}

/// What another process needs to import a range of this process's GPU memory.
#[derive(Debug)]
pub struct Export {
    /// `cuIpcGetMemHandle` of the allocation's base.
    pub ipc_handle: [u8; IPC_HANDLE_BYTES],
    /// The GPU the allocation lives on.
    pub device_uuid: [u8; UUID_BYTES],
    /// The whole allocation, as `cuMemGetAddressRange` reports it here.
    pub allocation_bytes: u64,
    /// Where the range starts in the allocation, and its length.
    pub offset_bytes: u64,
    pub length_bytes: u64,
    /// A dma-buf of exactly the range, where the driver gives one (sent with SCM_RIGHTS).
    pub dma_buf: Option<OwnedFd>,
    /// Why there is none, for the log.
    pub dma_buf_refusal: Option<String>,
}

/// Exports `length_bytes` of device memory at `device_pointer` (any pointer into an allocation
/// of `gpu`'s context, e.g. an engine's KV tensor) for another process. Marks the allocation
/// `SYNC_MEMOPS` (NVIDIA's rule for memory a third party reads: this process's synchronous
/// copies into it complete before they return). The caller's current context is current again
/// when this returns.
pub fn export_range(gpu: &Gpu, device_pointer: u64, length_bytes: u64) -> Result<Export, CudaIpcError> {
    if length_bytes == 0 {
        return Err(CudaIpcError::ZeroLength);
    }
    let _restore = RestoreCurrent::save()?;
    gpu.make_current()?;
    let (base, allocation_bytes) = gpu.address_range(device_pointer)?;
    let offset_bytes = device_pointer - base;
    if offset_bytes.checked_add(length_bytes).is_none_or(|end| end > allocation_bytes) {
        return Err(CudaIpcError::OutsideAllocation { offset_bytes, length_bytes, allocation_bytes });
    }
    // With unified addressing the calls above (and cuIpcGetMemHandle) accept an allocation of
    // any device: one on another GPU than `gpu` (a caller's wrong ordinal) would be exported
    // under `gpu`'s UUID. Refused before anything is set on it.
    gpu.check_holds(base)?;
    if gpu.driver_version >= IPC_CAPABLE_ATTRIBUTE_MIN_DRIVER_VERSION {
        let mut capable: u32 = 0;
        // SAFETY: the attribute's value is a 32-bit boolean and `capable` a live u32; the driver
        // validates `base`; the attribute exists in drivers of this version (checked above).
        check("cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)", unsafe {
            sys::cuPointerGetAttribute(
                (&mut capable as *mut u32).cast::<c_void>(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                base,
            )
        })?;
        if capable == 0 {
            return Err(CudaIpcError::NotIpcCapable);
        }
    }
    let sync_memops: u32 = 1;
    // SAFETY: `sync_memops` is a live u32, the attribute's documented value type; the driver
    // validates `base` (the allocation's start, from cuMemGetAddressRange).
    check("cuPointerSetAttribute(SYNC_MEMOPS)", unsafe {
        sys::cuPointerSetAttribute(
            (&sync_memops as *const u32).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
            base,
        )
    })?;
    let mut handle = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_BYTES] };
    // SAFETY: `handle` is a valid out-pointer; `base` is the start of an allocation of this
    // context (cuMemGetAddressRange said so).
    check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut handle, base) })?;
    let (dma_buf, dma_buf_refusal) = match dma_buf_of(gpu, device_pointer, length_bytes) {
        Ok(fd) => (Some(fd), None),
        Err(reason) => (None, Some(reason)),
    };
    Ok(Export {
        ipc_handle: handle.reserved.map(|byte| byte as u8),
        device_uuid: gpu.uuid,
        allocation_bytes,
        offset_bytes,
        length_bytes,
        dma_buf,
        dma_buf_refusal,
    })
}

/// A dma-buf of the range, or why not.
fn dma_buf_of(gpu: &Gpu, device_pointer: u64, length_bytes: u64) -> Result<OwnedFd, String> {
    if gpu.driver_version < DMA_BUF_MIN_DRIVER_VERSION {
        return Err(CudaIpcError::DriverTooOld { what: "dma-buf export", found: gpu.driver_version, needed: DMA_BUF_MIN_DRIVER_VERSION }
            .to_string());
    }
    if !gpu.dma_buf_supported {
        return Err(format!("{} does not export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0)", gpu.name));
    }
    if !device_pointer.is_multiple_of(HOST_PAGE_BYTES) || !length_bytes.is_multiple_of(HOST_PAGE_BYTES) {
        return Err(format!("the range {device_pointer:#x} + {length_bytes} is not aligned to {HOST_PAGE_BYTES}-byte host pages"));
    }
    let size = usize::try_from(length_bytes).map_err(|_| "the range does not fit this address space".to_string())?;
    let mut fd: i32 = -1;
    // SAFETY: for the DMA_BUF_FD type the handle out-parameter is an int, and `fd` is a live one;
    // the range lies in an allocation of the current context (checked by the caller) and is
    // page aligned (checked above); the symbol exists in drivers of this version (checked).
    let result = unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut i32).cast::<c_void>(),
            device_pointer,
            size,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    check("cuMemGetHandleForAddressRange(DMA_BUF_FD)", result).map_err(|error| error.to_string())?;
    if fd < 0 {
        return Err(format!("cuMemGetHandleForAddressRange returned descriptor {fd}"));
    }
    // SAFETY: the driver returned a new descriptor that nothing else owns; it is closed once, by
    // the OwnedFd.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// An allocation another process exported, opened in this process (`cuIpcOpenMemHandle`), and
/// the range of it this process may reach: by copies only ([`CopiedMemory`]). Closed on drop.
#[derive(Debug)]
pub struct ImportedMemory {
    gpu: Arc<Gpu>,
    /// What `cuIpcOpenMemHandle` returned (the imported allocation's base here); closed on drop.
    opened: u64,
    allocation_bytes: u64,
    offset_bytes: u64,
    len: usize,
}

impl ImportedMemory {
    /// Opens `handle` in `gpu`'s context and checks that `offset_bytes + length_bytes` lies in
    /// the allocation as the driver reports it (a client's word on the size is not trusted).
    /// Opening an allocation this context opened already returns the same base (the driver
    /// counts references; each open is closed once).
    pub fn open(
        gpu: &Arc<Gpu>,
        handle: &[u8; IPC_HANDLE_BYTES],
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<ImportedMemory, CudaIpcError> {
        if length_bytes == 0 {
            return Err(CudaIpcError::ZeroLength);
        }
        let len = usize::try_from(length_bytes).map_err(|_| CudaIpcError::OutsideAllocation {
            offset_bytes,
            length_bytes,
            allocation_bytes: 0,
        })?;
        gpu.make_current()?;
        let raw = sys::CUipcMemHandle { reserved: handle.map(|byte| byte as c_char) };
        let mut opened: sys::CUdeviceptr = 0;
        // No CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: the allocation must be on `gpu` itself (checked
        // below), so peer access is never needed, and enabling it for a handle of another GPU
        // would outlive the refused import (it is a property of the context).
        let flags = 0u32;
        // SAFETY: `opened` is a valid out-pointer; the handle is plain bytes the driver validates
        // (a forged or stale handle is an error code).
        check("cuIpcOpenMemHandle", unsafe { sys::cuIpcOpenMemHandle_v2(&mut opened, raw, flags) })?;
        // Owned from here: a failed check below closes it (Drop).
        let mut imported = ImportedMemory { gpu: Arc::clone(gpu), opened, allocation_bytes: 0, offset_bytes, len };
        // An allocation of another GPU than the one the client named (its UUID) would be reached
        // over a peer mapping, at another base than the same allocation opened on its own GPU,
        // which the daemon's overlap check keys on.
        gpu.check_holds(opened)?;
        let (base, allocation_bytes) = gpu.address_range(opened)?;
        imported.allocation_bytes = allocation_bytes;
        let in_allocation = offset_bytes.checked_add(length_bytes).is_some_and(|end| end <= allocation_bytes);
        if base != opened || !in_allocation {
            return Err(CudaIpcError::OutsideAllocation { offset_bytes, length_bytes, allocation_bytes });
        }
        Ok(imported)
    }

    /// The imported allocation's base in this process: equal for every registration of the same
    /// allocation (the daemon's overlap check keys on it).
    pub fn imported_base(&self) -> u64 {
        self.opened
    }

    /// The allocation's size as the driver reports it.
    pub fn allocation_bytes(&self) -> u64 {
        self.allocation_bytes
    }

    pub fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn at(&self, offset: usize, len: usize) -> Result<u64, HwError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.opened + self.offset_bytes + offset as u64),
            _ => Err(HwError::OutOfRange { offset, access_len: len, region_len: self.len }),
        }
    }
}

impl CopiedMemory for ImportedMemory {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, offset: usize, destination: &mut [u8]) -> Result<(), HwError> {
        let at = self.at(offset, destination.len())?;
        // SAFETY: `at..at + len` lies in the imported range (bounds checked above), which `open`
        // checked lies in the allocation, open until this value drops.
        unsafe { self.gpu.copy_to_host(at, destination) }.map_err(copy_error)
    }

    fn write(&self, offset: usize, source: &[u8]) -> Result<(), HwError> {
        let at = self.at(offset, source.len())?;
        // SAFETY: as in `read`.
        unsafe { self.gpu.copy_to_device(at, source) }.map_err(copy_error)
    }

    fn describe(&self) -> String {
        format!(
            "{} bytes at offset {} of a CUDA IPC allocation of {} bytes on GPU {} ({})",
            self.len,
            self.offset_bytes,
            self.allocation_bytes,
            self.gpu.ordinal,
            format_uuid(&self.gpu.uuid)
        )
    }
}

impl Drop for ImportedMemory {
    fn drop(&mut self) {
        let closed = self.gpu.make_current().and_then(|()| {
            // SAFETY: `opened` came from cuIpcOpenMemHandle and is closed once, here; every copy
            // through it has returned (copies borrow this value).
            check("cuIpcCloseMemHandle", unsafe { sys::cuIpcCloseMemHandle(self.opened) })
        });
        if let Err(error) = closed {
            tracing::warn!(%error, "closing an imported CUDA IPC allocation");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_every_entry_point_says_so() {
        // Goal: on a machine without libcuda (this one) nothing panics: the entry points answer
        // NoDriver. Where a driver is present this checks nothing and says so.
        if driver_available() {
            eprintln!("a CUDA driver is present: the no-driver answer is not checked here");
            return;
        }
        assert!(matches!(Gpu::open(0), Err(CudaIpcError::NoDriver)));
        assert!(matches!(Gpu::open_by_uuid(&[0; UUID_BYTES]), Err(CudaIpcError::NoDriver)));
    }
}
