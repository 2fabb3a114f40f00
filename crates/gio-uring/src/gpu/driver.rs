//! Thin, checked wrappers of the CUDA driver API calls gio-uring makes through
//! `cudarc::driver::sys` (loaded at run time). With `shared_memory.rs`, the only module of the crate
//! allowed to contain `unsafe` code; every call here is FFI into libcuda.
//!
//! cudarc's dynamically loaded functions panic if libcuda or a symbol is missing. So: nothing here
//! is called before [`driver_present`] returned true, and the green-context entry points
//! ([`GREEN_CONTEXT_ENTRY_POINTS`], the newest from CUDA 12.5) are only called after
//! [`driver_version`] says the driver has them all.

use std::ffi::CStr;

use cudarc::driver::sys;

use crate::error::GioError;

/// Every driver entry point the green-context path calls ([`create_green_context`],
/// [`context_of_green`], [`destroy_green_context`]), with the first CUDA driver version that
/// exports it (as cuDriverGetVersion encodes it; cudarc gates each on the same version). cudarc's
/// loader panics on a missing symbol, so [`GREEN_CONTEXT_MIN_DRIVER_VERSION`] is at least the
/// newest of these.
pub const GREEN_CONTEXT_ENTRY_POINTS: [(&str, i32); 7] = [
    ("cuDeviceGetDevResource", 12040),
    ("cuDevSmResourceSplitByCount", 12040),
    ("cuDevResourceGenerateDesc", 12040),
    ("cuGreenCtxCreate", 12040),
    ("cuCtxFromGreenCtx", 12040),
    ("cuGreenCtxDestroy", 12040),
    ("cuGreenCtxStreamCreate", 12050),
];

/// The first CUDA driver version the runtime takes a green context on: 12.4 introduced green
/// contexts, but `cuGreenCtxStreamCreate` only came with 12.5; a 12.4 driver gets the logged
/// fallback stream.
pub const GREEN_CONTEXT_MIN_DRIVER_VERSION: i32 = 12050;

// The build fails if an entry point is added to the table with a newer version than the minimum.
const _: () = {
    let mut index = 0;
    while index < GREEN_CONTEXT_ENTRY_POINTS.len() {
        assert!(GREEN_CONTEXT_ENTRY_POINTS[index].1 <= GREEN_CONTEXT_MIN_DRIVER_VERSION);
        index += 1;
    }
};

fn check(call: &'static str, result: sys::CUresult) -> Result<(), GioError> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GioError::Cuda { call, result: format!("{result:?}") })
    }
}

/// Whether libcuda can be loaded at all. Never panics.
pub fn driver_present() -> bool {
    // SAFETY: is_culib_present only tries to dlopen the candidate library names and drops the
    // handles; it touches no CUDA state and is the documented probe to call before anything else.
    unsafe { sys::is_culib_present() }
}

/// `cuInit(0)`. Requires [`driver_present`].
pub fn init() -> Result<(), GioError> {
    // SAFETY: libcuda is loadable (caller checked driver_present); cuInit takes a flags word only.
    check("cuInit", unsafe { sys::cuInit(0) })
}

/// The driver's CUDA version, e.g. 12080 for 12.8.
pub fn driver_version() -> Result<i32, GioError> {
    let mut version = 0i32;
    // SAFETY: `version` is a valid out-pointer for the duration of the call.
    check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut version) })?;
    Ok(version)
}

pub fn device_count() -> Result<i32, GioError> {
    let mut count = 0i32;
    // SAFETY: `count` is a valid out-pointer; cuInit succeeded (caller's sequence).
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut count) })?;
    Ok(count)
}

pub fn device(ordinal: i32) -> Result<sys::CUdevice, GioError> {
    let mut device: sys::CUdevice = 0;
    // SAFETY: `device` is a valid out-pointer; an invalid ordinal is reported as an error code.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut device, ordinal) })?;
    Ok(device)
}

pub fn device_attribute(device: sys::CUdevice, attribute: sys::CUdevice_attribute) -> Result<i32, GioError> {
    let mut value = 0i32;
    // SAFETY: `value` is a valid out-pointer; `device` came from cuDeviceGet.
    check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut value, attribute, device) })?;
    Ok(value)
}

/// Retains the device's primary context and makes it current on this thread.
pub fn retain_primary_context(device: sys::CUdevice) -> Result<sys::CUcontext, GioError> {
    let mut context: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `context` is a valid out-pointer; `device` came from cuDeviceGet.
    check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, device) })?;
    // SAFETY: `context` was just returned by the driver and is retained.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(context) })?;
    Ok(context)
}

pub fn release_primary_context(device: sys::CUdevice) -> Result<(), GioError> {
    // SAFETY: paired with a successful retain_primary_context on the same device.
    check("cuDevicePrimaryCtxRelease", unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) })
}

/// Loads a cubin or a NUL-terminated PTX image into the current context.
pub fn load_module(image: &[u8]) -> Result<sys::CUmodule, GioError> {
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `image` stays borrowed (alive, unmodified) for the whole call, which copies it; the
    // caller guarantees a PTX image is NUL-terminated (cubins carry their own length).
    check("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr().cast()) })?;
    Ok(module)
}

pub fn unload_module(module: sys::CUmodule) -> Result<(), GioError> {
    // SAFETY: `module` came from load_module and is unloaded once, by its owner's Drop.
    check("cuModuleUnload", unsafe { sys::cuModuleUnload(module) })
}

/// The value of the module's 4-byte global `name` (a `__device__` variable), or `None` if the
/// module has no global of that name. Synchronous: run at load time, before any launch.
pub fn module_global_u32(module: sys::CUmodule, name: &CStr) -> Result<Option<u32>, GioError> {
    let mut address: sys::CUdeviceptr = 0;
    let mut bytes = 0usize;
    // SAFETY: `address` and `bytes` are valid out-pointers, `name` a NUL-terminated string alive
    // for the call, `module` a loaded module of the current context.
    let found = unsafe { sys::cuModuleGetGlobal_v2(&mut address, &mut bytes, module, name.as_ptr()) };
    if found == sys::CUresult::CUDA_ERROR_NOT_FOUND {
        return Ok(None);
    }
    check("cuModuleGetGlobal", found)?;
    if bytes != size_of::<u32>() {
        return Err(GioError::Cuda { call: "cuModuleGetGlobal", result: format!("global {name:?} is {bytes} bytes, not 4") });
    }
    let mut value = 0u32;
    // SAFETY: `value` is 4 writable bytes alive for the call; `address` is a 4-byte global of a
    // module loaded in the current context (checked just above).
    check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2((&raw mut value).cast(), address, size_of::<u32>()) })?;
    Ok(Some(value))
}

pub fn function(module: sys::CUmodule, name: &CStr) -> Result<sys::CUfunction, GioError> {
    let mut function: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: `function` is a valid out-pointer, `name` a NUL-terminated string alive for the call,
    // `module` a loaded module.
    check("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut function, module, name.as_ptr()) })?;
    Ok(function)
}

/// An ordinary non-blocking stream in the current context.
pub fn create_stream() -> Result<sys::CUstream, GioError> {
    let mut stream: sys::CUstream = std::ptr::null_mut();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: `stream` is a valid out-pointer; a context is current (retain_primary_context).
    check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut stream, flags) })?;
    Ok(stream)
}

pub fn destroy_stream(stream: sys::CUstream) -> Result<(), GioError> {
    // SAFETY: `stream` was created by this module and is destroyed once, by its owner's Drop.
    check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(stream) })
}

/// A green context holding at least `sm_count` SMs, and a stream on it.
/// Requires a driver of at least [`GREEN_CONTEXT_MIN_DRIVER_VERSION`] (checked by the caller).
pub fn create_green_context(device: sys::CUdevice, sm_count: u32) -> Result<(sys::CUgreenCtx, sys::CUstream, u32), GioError> {
    // SAFETY: CUdevResource is a plain C struct (integers, arrays, a union of integers) for which
    // all-zero bytes are a valid value; the driver fills it in.
    let mut all_sms: sys::CUdevResource = unsafe { std::mem::zeroed() };
    // SAFETY: `all_sms` is a valid out-pointer; `device` came from cuDeviceGet.
    check("cuDeviceGetDevResource", unsafe {
        sys::cuDeviceGetDevResource(device, &mut all_sms, sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM)
    })?;
    // SAFETY: as above, zero is a valid initial value of these out-parameters.
    let mut io_sms: sys::CUdevResource = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut remaining: sys::CUdevResource = unsafe { std::mem::zeroed() };
    let mut groups = 1u32;
    // SAFETY: every pointer refers to a live local of the right type; one group is requested, so
    // the driver writes at most one CUdevResource to `io_sms`.
    check("cuDevSmResourceSplitByCount", unsafe {
        sys::cuDevSmResourceSplitByCount(&mut io_sms, &mut groups, &all_sms, &mut remaining, 0, sm_count)
    })?;
    if groups != 1 {
        return Err(GioError::Cuda { call: "cuDevSmResourceSplitByCount", result: format!("{groups} groups") });
    }
    // SAFETY: reading a field of the union the driver filled for an SM resource.
    let granted = unsafe { io_sms.__bindgen_anon_1.sm.smCount };
    let mut descriptor: sys::CUdevResourceDesc = std::ptr::null_mut();
    // SAFETY: `descriptor` is a valid out-pointer and `io_sms` one valid resource.
    check("cuDevResourceGenerateDesc", unsafe { sys::cuDevResourceGenerateDesc(&mut descriptor, &mut io_sms, 1) })?;
    let mut green: sys::CUgreenCtx = std::ptr::null_mut();
    let flags = sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as u32;
    // SAFETY: `descriptor` came from cuDevResourceGenerateDesc for this device.
    check("cuGreenCtxCreate", unsafe { sys::cuGreenCtxCreate(&mut green, descriptor, device, flags) })?;
    let mut stream: sys::CUstream = std::ptr::null_mut();
    let stream_flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: `green` is a live green context; NON_BLOCKING is the flag the API requires.
    let created = check("cuGreenCtxStreamCreate", unsafe { sys::cuGreenCtxStreamCreate(&mut stream, green, stream_flags, 0) });
    if let Err(error) = created {
        // Best effort: the creation error is the one worth reporting.
        let _ = destroy_green_context(green);
        return Err(error);
    }
    Ok((green, stream, granted))
}

/// The CUcontext form of a green context, for context-scoped calls (module loading, allocation).
pub fn context_of_green(green: sys::CUgreenCtx) -> Result<sys::CUcontext, GioError> {
    let mut context: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `context` is a valid out-pointer; `green` is a live green context.
    check("cuCtxFromGreenCtx", unsafe { sys::cuCtxFromGreenCtx(&mut context, green) })?;
    Ok(context)
}

pub fn destroy_green_context(green: sys::CUgreenCtx) -> Result<(), GioError> {
    // SAFETY: `green` came from create_green_context and is destroyed once, by its owner's Drop.
    check("cuGreenCtxDestroy", unsafe { sys::cuGreenCtxDestroy(green) })
}

/// The driver objects a [`super::GpuRuntime`] owns, grouped so that the one `Send` claim for them
/// sits here, next to the FFI.
#[derive(Debug)]
pub struct Handles {
    pub device: sys::CUdevice,
    /// The I/O context, made current before every use: the green context as a CUcontext, or the
    /// device's primary context (retained either way, released last).
    pub context: sys::CUcontext,
    pub module: sys::CUmodule,
    pub function: sys::CUfunction,
    pub green: Option<sys::CUgreenCtx>,
    pub stream: sys::CUstream,
}

// SAFETY: these are opaque handles of the CUDA driver API, which is thread-safe: any thread may use
// them once it has made the owning context current (the runtime does so before each use). They are
// not tied to the creating thread, and the owner destroys each exactly once.
unsafe impl Send for Handles {}

/// Makes `context` current on the calling thread: the executor may be driven from any thread.
/// `context` must be alive: the runtime passes its I/O context only (the retained primary
/// context, or the CUcontext of its green context), and only while it owns it.
pub fn set_current(context: sys::CUcontext) -> Result<(), GioError> {
    // SAFETY: `context` is the runtime's I/O context: either the device's primary context, which
    // the runtime retained and releases last in its Drop, or the CUcontext `cuCtxFromGreenCtx`
    // gave for its green context, which lives until the runtime's Drop destroys the green
    // context (after its last `set_current`). Either is alive for every call.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(context) })
}

/// The context current on the calling thread (null when none is).
pub fn current_context() -> Result<sys::CUcontext, GioError> {
    let mut context: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `context` is a valid out-pointer; the call only reads the thread's context stack.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut context) })?;
    Ok(context)
}

/// Makes no context current on the calling thread: `cuCtxSetCurrent(NULL)`, which pops the top
/// of the thread's context stack (a no-op on an empty one).
pub fn clear_current() -> Result<(), GioError> {
    // SAFETY: NULL is the documented argument for "pop the top of this thread's stack"; no
    // context is dereferenced.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) })
}

/// `context` pushed onto the calling thread's context stack (so current there) until the guard
/// drops, which pops it and so restores what was current before. A green context may be current
/// on one thread at a time (cuGreenCtxCreate: "no internal synchronization"), and a caller's own
/// context (its compute work) must not be replaced behind its back: the executor's entry points
/// hold one of these instead of leaving the I/O context current. Bound to the thread that pushed.
#[must_use = "the context is popped (no longer current) as soon as the guard drops"]
#[derive(Debug)]
pub struct CurrentContext {
    context: sys::CUcontext,
    _thread_bound: std::marker::PhantomData<*const ()>,
}

/// `cuCtxPushCurrent(context)`, popped when the returned guard drops. `context` must be alive
/// until then (the runtime's I/O context, which it owns).
pub fn push_current(context: sys::CUcontext) -> Result<CurrentContext, GioError> {
    // SAFETY: `context` is the runtime's I/O context, alive while the runtime exists (see
    // `set_current`); the guard that pops it borrows nothing but is dropped within the entry
    // point that pushed it, while the runtime is alive.
    check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(context) })?;
    Ok(CurrentContext { context, _thread_bound: std::marker::PhantomData })
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `popped` is a valid out-pointer; this thread pushed `context` (the guard is not
        // Send) and every push made after it was popped by its own guard (guards are scoped).
        match check("cuCtxPopCurrent", unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }) {
            Ok(()) if popped == self.context => {}
            Ok(()) => tracing::warn!("gio-uring: popped another context than the I/O context the executor pushed"),
            Err(error) => tracing::warn!("gio-uring: {error}"),
        }
    }
}

/// What keeps host memory mapped while it is registered with the GPU.
#[derive(Debug)]
pub enum MemoryOwner {
    /// DMA memory of an NVMe controller (rings, staging buffers): page-granular mmaps.
    Dma(nvme_driver::DmaRegion),
    /// A gio queue's shared region (allocated in whole pages).
    Queue(std::sync::Arc<crate::layout::QueueMemory>),
    /// A region of the executor's own (allocated in whole pages).
    Shared(std::sync::Arc<crate::shared_memory::SharedRegion>),
    /// A controller's BAR0.
    Bar(BarMapping),
}

impl MemoryOwner {
    /// The host range the owner keeps mapped, widened to whole pages (every owner maps whole
    /// pages: mmap, page-multiple allocations).
    fn page_span(&self) -> Option<(u64, u64)> {
        let (start, len) = match self {
            MemoryOwner::Dma(region) => (region.host_address() as u64, region.len() as u64),
            MemoryOwner::Queue(memory) => (memory.region.host_address(), memory.region.len_bytes() as u64),
            MemoryOwner::Shared(region) => (region.host_address(), region.len_bytes() as u64),
            MemoryOwner::Bar(bar) => (bar.host_address as u64, bar.len_bytes as u64),
        };
        super::plan::page_span(start, len)
    }
}

/// Host memory registered with the GPU (page-locked and mapped into its address space), holding
/// the owner that keeps the memory mapped. Unregistered on drop, before the owner is released.
#[derive(Debug)]
pub struct HostRegistration {
    host_start: u64,
    len_bytes: u64,
    device_start: u64,
    _owner: MemoryOwner,
}

impl HostRegistration {
    /// `cuMemHostRegister(DEVICEMAP | PORTABLE, + IOMEMORY for a real BAR)` of the page span
    /// `host_start..+len_bytes`, which must lie inside what `owner` keeps mapped, then
    /// `cuMemHostGetDevicePointer`. Requires a current context.
    pub fn register(owner: MemoryOwner, host_start: u64, len_bytes: u64) -> Result<Self, GioError> {
        let (owned_start, owned_len) =
            owner.page_span().ok_or_else(|| GioError::InvalidConfig { reason: "host memory wraps the address space".into() })?;
        let inside = host_start.is_multiple_of(super::plan::PAGE_BYTES)
            && host_start >= owned_start
            && host_start.checked_add(len_bytes).is_some_and(|end| end <= owned_start + owned_len);
        if !inside || len_bytes == 0 {
            return Err(GioError::InvalidConfig {
                reason: format!("span {host_start:#x}+{len_bytes} is not whole pages inside {owned_start:#x}+{owned_len}"),
            });
        }
        let mut flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        if matches!(&owner, MemoryOwner::Bar(bar) if bar.io_memory) {
            flags |= sys::CU_MEMHOSTREGISTER_IOMEMORY;
        }
        let pointer = host_start as usize as *mut core::ffi::c_void;
        // SAFETY: the span is whole pages inside memory `owner` keeps mapped (checked above), and
        // the owner is held by the registration, which unregisters before releasing it.
        check("cuMemHostRegister", unsafe { sys::cuMemHostRegister_v2(pointer, len_bytes as usize, flags) })?;
        let mut registration = Self { host_start, len_bytes, device_start: 0, _owner: owner };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `pointer` was just registered with DEVICEMAP; `device` is a valid out-pointer.
        check("cuMemHostGetDevicePointer", unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, pointer, 0) })?;
        registration.device_start = device;
        Ok(registration)
    }

    pub fn span(&self) -> super::plan::RegisteredSpan {
        super::plan::RegisteredSpan { host_start: self.host_start, len_bytes: self.len_bytes, device_start: self.device_start }
    }

    fn covers(&self, host_address: u64, len_bytes: u64) -> bool {
        host_address >= self.host_start && host_address.checked_add(len_bytes).is_some_and(|end| end <= self.host_start + self.len_bytes)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let pointer = self.host_start as usize as *mut core::ffi::c_void;
        // SAFETY: `pointer` starts a span this value registered and nobody else unregisters; the
        // memory is still mapped (the owner is a field, released after this body).
        if let Err(error) = check("cuMemHostUnregister", unsafe { sys::cuMemHostUnregister(pointer) }) {
            tracing::warn!("gio-uring: {error}");
        }
    }
}

/// Direction of a staged-mode copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDirection {
    /// Staging buffer → GPU memory (after the SSD wrote it: reads).
    ToGpu,
    /// GPU memory → staging buffer (before the SSD reads it: writes).
    ToHost,
}

/// Enqueues one staged-mode copy on `stream`. The host side must lie inside `registration` (so it
/// is page-locked and stays mapped while the registration lives; the executor keeps it until the
/// stream is idle). The GPU side is a caller-given address: a wrong one is a CUDA error reported by
/// the stream, not host memory corruption.
pub fn copy_async(
    direction: CopyDirection,
    registration: &HostRegistration,
    host_address: u64,
    gpu_address: u64,
    len_bytes: u64,
    stream: sys::CUstream,
) -> Result<(), GioError> {
    if !registration.covers(host_address, len_bytes) {
        return Err(GioError::InvalidConfig { reason: format!("staged copy {host_address:#x}+{len_bytes} outside its staging buffer") });
    }
    let host = host_address as usize as *mut core::ffi::c_void;
    let len = len_bytes as usize;
    match direction {
        // SAFETY: the host range is registered, page-locked memory kept mapped by `registration`
        // (checked above) which outlives the copy; no Rust reference into it exists (DMA memory is
        // only accessed by copying or atomic accessors).
        CopyDirection::ToGpu => check("cuMemcpyHtoDAsync", unsafe { sys::cuMemcpyHtoDAsync_v2(gpu_address, host, len, stream) }),
        // SAFETY: as above.
        CopyDirection::ToHost => check("cuMemcpyDtoHAsync", unsafe { sys::cuMemcpyDtoHAsync_v2(host, gpu_address, len, stream) }),
    }
}

/// How BAR0 is reached from the host, so that the GPU can write doorbells into it.
#[derive(Debug, Clone)]
pub struct BarMapping {
    host_address: usize,
    len_bytes: usize,
    io_memory: bool,
    /// Keeps an emulated register file's memory alive.
    _owner: Option<nvme_driver::DmaRegion>,
    /// Keeps a VFIO device (and so its BAR0 mmap) alive.
    _device: Option<std::sync::Arc<nvme_driver::hw::vfio::VfioDevice>>,
}

impl BarMapping {
    /// An emulated controller's register file in ordinary host memory (nvme-emu's
    /// `EmuDevice::register_region()`); kept alive by the mapping.
    pub fn host_memory(region: nvme_driver::DmaRegion) -> Self {
        Self { host_address: region.host_address(), len_bytes: region.len(), io_memory: false, _owner: Some(region), _device: None }
    }

    /// A VFIO device's BAR0 mmap, registered with CU_MEMHOSTREGISTER_IOMEMORY; the mapping holds
    /// the device, so the BAR stays mapped while any executor built with it exists.
    pub fn vfio(device: std::sync::Arc<nvme_driver::hw::vfio::VfioDevice>) -> Self {
        let (host_address, len_bytes) = device.bar0_host_range();
        Self { host_address, len_bytes, io_memory: true, _owner: None, _device: Some(device) }
    }

    /// A real BAR0 mmapped through VFIO, registered with CU_MEMHOSTREGISTER_IOMEMORY.
    ///
    /// # Safety
    /// `host_address..+len_bytes` must be an mmap of the controller's BAR0 that stays mapped for
    /// as long as any executor built with this mapping exists.
    pub unsafe fn io_memory(host_address: usize, len_bytes: usize) -> Self {
        Self { host_address, len_bytes, io_memory: true, _owner: None, _device: None }
    }

    pub fn host_address(&self) -> usize {
        self.host_address
    }

    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    pub fn is_io_memory(&self) -> bool {
        self.io_memory
    }
}

/// GPU memory from `cuMemAlloc`, freed on drop.
#[derive(Debug)]
pub struct DeviceMemory {
    address: sys::CUdeviceptr,
    len_bytes: usize,
    /// Set by [`DeviceMemory::keep_for_good`]: never freed.
    kept: bool,
}

impl DeviceMemory {
    /// Requires a current context.
    pub fn allocate(len_bytes: usize) -> Result<Self, GioError> {
        let mut address: sys::CUdeviceptr = 0;
        // SAFETY: `address` is a valid out-pointer; the size is checked by the driver.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut address, len_bytes.max(1)) })?;
        Ok(Self { address, len_bytes, kept: false })
    }

    /// An allocation of nothing, never freed: what [`std::mem::replace`] leaves where a real one
    /// was taken out to be freed early (the executor's teardown, while its context is current).
    pub(crate) fn released() -> Self {
        Self { address: 0, len_bytes: 0, kept: true }
    }

    /// Never frees the allocation (a kernel that could not be waited for may still use it): it
    /// stays allocated until the process ends.
    pub fn keep_for_good(&mut self) {
        self.kept = true;
    }

    pub fn address(&self) -> u64 {
        self.address
    }

    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), GioError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len_bytes) {
            return Err(GioError::InvalidConfig {
                reason: format!("copy of {len} bytes at {offset} outside a {}-byte GPU allocation", self.len_bytes),
            });
        }
        Ok(())
    }

    /// Synchronous copy of `source` to `offset` (bounds checked).
    pub fn copy_from_host(&self, offset: usize, source: &[u8]) -> Result<(), GioError> {
        self.check_range(offset, source.len())?;
        // SAFETY: the destination range is inside this allocation (checked) and `source` is a
        // live slice for the whole synchronous call.
        check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(self.address + offset as u64, source.as_ptr().cast(), source.len()) })
    }

    /// Copies `source` to `offset` (bounds checked) on `stream` and waits, polling up to
    /// `timeout`, until `stream` is idle; work enqueued on `stream` afterwards (a kernel launch)
    /// is ordered after the copy either way. For state a kernel on `stream` reads: a synchronous
    /// `cuMemcpyHtoD` runs on the legacy default stream, which a non-blocking stream is not
    /// ordered after, and from pageable memory it may return before the bytes land.
    ///
    /// The copy reads a private duplicate of `source`, so the caller may change `source` at once.
    /// When the stream does not go idle in time the duplicate is leaked (the copy may still read
    /// it) and the timeout is returned; the copy stays queued ahead of later work.
    pub(crate) fn copy_from_host_on_stream(
        &self,
        offset: usize,
        source: &[u8],
        stream: sys::CUstream,
        timeout: std::time::Duration,
    ) -> Result<(), GioError> {
        self.check_range(offset, source.len())?;
        let duplicate: Box<[u8]> = source.into();
        // SAFETY: the destination range is inside this allocation (checked); `duplicate` is freed
        // below only once the stream is idle (the copy done), and leaked otherwise; `stream` is a
        // live stream of the current context.
        let queued = check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(self.address + offset as u64, duplicate.as_ptr().cast(), duplicate.len(), stream)
        });
        // A failed enqueue queued nothing: the duplicate is dropped.
        queued?;
        match drain_stream(stream, timeout) {
            Ok(()) => Ok(()),
            Err(error) => {
                Box::leak(duplicate);
                Err(error)
            }
        }
    }

    /// Synchronous copy from `offset` into `destination` (bounds checked).
    pub fn copy_to_host(&self, offset: usize, destination: &mut [u8]) -> Result<(), GioError> {
        self.check_range(offset, destination.len())?;
        // SAFETY: the source range is inside this allocation (checked) and `destination` is a
        // live, exclusively borrowed slice for the whole synchronous call.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(destination.as_mut_ptr().cast(), self.address + offset as u64, destination.len())
        })
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        // SAFETY: `address` came from cuMemAlloc and is freed once, here.
        if let Err(error) = check("cuMemFree", unsafe { sys::cuMemFree_v2(self.address) }) {
            tracing::warn!("gio-uring: {error}");
        }
    }
}

/// A CUDA event without timing, destroyed on drop.
#[derive(Debug)]
pub struct Event {
    event: sys::CUevent,
}

impl Event {
    /// Requires a current context.
    pub fn create() -> Result<Self, GioError> {
        let mut event: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: `event` is a valid out-pointer.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut event, flags) })?;
        Ok(Self { event })
    }

    /// The raw handle, for a caller that records it on its own stream.
    pub fn raw(&self) -> sys::CUevent {
        self.event
    }

    pub fn record(&self, stream: sys::CUstream) -> Result<(), GioError> {
        // SAFETY: both handles are live (owned by this event and by the runtime).
        check("cuEventRecord", unsafe { sys::cuEventRecord(self.event, stream) })
    }

    /// Whether all work captured by the last record has completed. Never blocks.
    pub fn is_complete(&self) -> Result<bool, GioError> {
        // SAFETY: `event` is live.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(GioError::Cuda { call: "cuEventQuery", result: format!("{other:?}") }),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: `event` came from cuEventCreate and is destroyed once, here.
        if let Err(error) = check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(self.event) }) {
            tracing::warn!("gio-uring: {error}");
        }
    }
}

// SAFETY: CUDA events, allocations and registrations are process-wide driver objects usable from
// any thread that has the owning context current (the executor makes it current before use).
unsafe impl Send for Event {}
// SAFETY: as for Event.
unsafe impl Send for DeviceMemory {}

/// A CUDA event the caller created (typically recorded on its compute stream, in its own
/// context), handed to the executor so that I/O can wait on it.
#[derive(Debug, Clone, Copy)]
pub struct CallerEvent {
    event: sys::CUevent,
}

impl CallerEvent {
    /// # Safety
    /// `event` must be a valid CUevent that the caller does not destroy while the executor it is
    /// registered with exists.
    pub unsafe fn from_raw(event: sys::CUevent) -> Self {
        Self { event }
    }

    pub fn raw(&self) -> sys::CUevent {
        self.event
    }
}

// SAFETY: a CUevent handle may be used from any thread (the driver API is thread-safe); its
// validity is the caller's promise made in `from_raw`.
unsafe impl Send for CallerEvent {}

/// Makes later work on `stream` wait until the last record of `event` (the executor's own, or a
/// caller's from any context: cross-context waits are allowed) completes.
pub fn stream_wait_event(stream: sys::CUstream, event: sys::CUevent) -> Result<(), GioError> {
    // SAFETY: `stream` is the runtime's live stream; `event` is an Event this module owns or a
    // CallerEvent whose validity the caller promised; flags 0 is the only defined value.
    check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(stream, event, 0) })
}

/// Whether every operation enqueued on `stream` has completed. Never blocks.
pub fn stream_is_idle(stream: sys::CUstream) -> Result<bool, GioError> {
    // SAFETY: `stream` is a live stream owned by the runtime.
    match unsafe { sys::cuStreamQuery(stream) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(GioError::Cuda { call: "cuStreamQuery", result: format!("{other:?}") }),
    }
}

/// Waits, polling every 50 µs up to `timeout`, until everything enqueued on `stream` has
/// completed. Never blocks inside the driver (a `cuStreamSynchronize` could wait forever).
pub fn drain_stream(stream: sys::CUstream, timeout: std::time::Duration) -> Result<(), GioError> {
    // A timeout past what an Instant holds (centuries) never runs out, rather than panicking.
    // The executor never asks for one: GpuExecutor::new refuses a drain_timeout over
    // plan::DRAIN_TIMEOUT_MAX, and teardown's wait is capped (plan::TEARDOWN_DRAIN_MAX).
    let deadline = std::time::Instant::now().checked_add(timeout);
    while !stream_is_idle(stream)? {
        if deadline.is_some_and(|deadline| std::time::Instant::now() >= deadline) {
            return Err(GioError::Executor { executor: "cuda", reason: format!("I/O stream still busy after {timeout:?}") });
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
    Ok(())
}

/// Blocks of `threads_per_block` threads of `function` resident per SM.
pub fn occupancy_blocks_per_sm(function: sys::CUfunction, threads_per_block: u32) -> Result<u32, GioError> {
    let mut blocks = 0i32;
    // SAFETY: `blocks` is a valid out-pointer; `function` is a loaded kernel; no dynamic shared
    // memory is used by the kernel.
    check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, function, threads_per_block as i32, 0)
    })?;
    Ok(blocks.max(0) as u32)
}

/// Launches the I/O kernel with its one by-value argument.
pub fn launch_io_kernel(
    function: sys::CUfunction,
    stream: sys::CUstream,
    blocks: u32,
    threads_per_block: u32,
    params: &crate::abi::gio_launch_params,
) -> Result<(), GioError> {
    let mut argument = *params;
    let mut arguments = [(&mut argument as *mut crate::abi::gio_launch_params).cast::<core::ffi::c_void>()];
    // The driver copies the argument before returning, so the locals only need to live for the call; the
    // addresses inside `params` are GPU addresses of memory the executor keeps registered or allocated.
    // SAFETY: `arguments` holds one pointer to a gio_launch_params, the kernel's only parameter (same
    // layout, asserted in abi/ and gio_abi.h), valid for the call (see above).
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(function, blocks, 1, 1, threads_per_block, 1, 1, 0, stream, arguments.as_mut_ptr(), std::ptr::null_mut())
    })
}
