//! Thin, checked wrappers of the CUDA driver API calls gio-uring makes through
//! `cudarc::driver::sys` (loaded at run time). With `shared_memory.rs`, the only module of the crate
//! allowed to contain `unsafe` code; every call here is FFI into libcuda.
//!
//! cudarc's dynamically loaded functions panic if libcuda or a symbol is missing. So: nothing here
//! is called before [`driver_present`] returned true, and the green-context entry points (CUDA
//! 12.4+) are only called after [`driver_version`] says the driver has them.

use std::ffi::CStr;

use cudarc::driver::sys;

use crate::error::GioError;

/// The first CUDA driver version with green contexts (12.4), as cuDriverGetVersion encodes it.
pub const GREEN_CONTEXT_MIN_DRIVER_VERSION: i32 = 12040;

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

pub fn destroy_green_context(green: sys::CUgreenCtx) -> Result<(), GioError> {
    // SAFETY: `green` came from create_green_context and is destroyed once, by its owner's Drop.
    check("cuGreenCtxDestroy", unsafe { sys::cuGreenCtxDestroy(green) })
}

/// The driver objects a [`super::GpuRuntime`] owns, grouped so that the one `Send` claim for them
/// sits here, next to the FFI.
#[derive(Debug)]
pub struct Handles {
    pub device: sys::CUdevice,
    pub module: sys::CUmodule,
    pub function: sys::CUfunction,
    pub green: Option<sys::CUgreenCtx>,
    pub stream: sys::CUstream,
}

// SAFETY: these are opaque handles of the CUDA driver API, which is thread-safe: any thread may use
// them once it has made the owning context current (the runtime does so before each use). They are
// not tied to the creating thread, and the owner destroys each exactly once.
unsafe impl Send for Handles {}
