//! GPU side of gio_uring (feature `cuda`): finding the CUDA driver without panicking, loading the
//! I/O kernel, carving an I/O domain of SMs out of the GPU with a green context, the DMA mode, and
//! the CUDA executor.
//!
//! STATUS: compiled, and its pure logic unit-tested (`plan`, `retire`); never run — no GPU was
//! available while it was written. What exists: [`probe_driver`], [`GpuRuntime::open`] (I/O
//! domain: green context or an ordinary stream with a warning; the kernel loaded into that
//! domain's context), [`DmaMode`], and [`GpuExecutor`], which drives detached NVMe queue pairs
//! from the kernel (see `executor.rs`). `tests/gpu.rs` runs it against the software controller
//! where a GPU exists; until that has passed on a GPU, nothing here is known to work.
//!
//! Unsafe code is confined to `driver` (FFI into libcuda); the other modules are safe Rust.

#[allow(unsafe_code)]
mod driver;
mod executor;
pub mod plan;
mod retire;

pub use driver::{BarMapping, CallerEvent, DeviceMemory};
pub use executor::{teardowns_leaked, GpuExecutor, GpuExecutorConfig, GpuQueueSpec, StagingBuffer};

use std::ffi::CStr;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use cudarc::driver::sys;

use crate::error::GioError;
use crate::types::SmBudget;

/// The kernel's entry point in the cubin/PTX (`extern "C"` in kernels/gio_io_kernel.cu).
pub const KERNEL_NAME: &CStr = c"gio_io_kernel";

/// The kernel image's `u32` global holding the `GIO_ABI_VERSION` it was compiled with (`extern
/// "C"` in kernels/gio_io_kernel.cu), read back and checked when the module is loaded.
pub const ABI_VERSION_SYMBOL: &CStr = c"gio_abi_version";

/// Where the SSD's DMA lands. Always chosen explicitly by the caller and reported; there is no
/// default and no fallback from one to the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DmaMode {
    /// The SSD writes GPU memory directly. The platform must give GPU memory a device-visible
    /// address the SSD can target (GPUDirect RDMA: nvidia-peermem or dma-buf export of the
    /// allocation) and either map it in the SSD's IOMMU domain or run with the IOMMU in
    /// passthrough; PCIe peer-to-peer must be routable between the two (same root complex or a
    /// switch with ACS configured to allow it).
    P2p,
    /// The SSD writes an IOVA-mapped host buffer; the GPU then copies it into place. Works wherever
    /// VFIO works, at the cost of a copy and host memory bandwidth.
    Staged,
}

impl fmt::Display for DmaMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DmaMode::P2p => "p2p",
            DmaMode::Staged => "staged",
        })
    }
}

impl FromStr for DmaMode {
    type Err = GioError;
    fn from_str(text: &str) -> Result<Self, GioError> {
        match text {
            "p2p" => Ok(DmaMode::P2p),
            "staged" => Ok(DmaMode::Staged),
            other => Err(GioError::InvalidConfig { reason: format!("DMA mode {other:?} is neither \"p2p\" nor \"staged\"") }),
        }
    }
}

/// What the driver probe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverInfo {
    /// e.g. 12080 for CUDA 12.8.
    pub version: i32,
    pub device_count: i32,
}

impl DriverInfo {
    pub fn has_green_contexts(&self) -> bool {
        self.version >= driver::GREEN_CONTEXT_MIN_DRIVER_VERSION
    }
}

/// Finds a usable CUDA driver, or says why there is none ([`GioError::NoCudaDriver`]). Never
/// panics: libcuda's presence is checked before any call into it.
pub fn probe_driver() -> Result<DriverInfo, GioError> {
    if !driver::driver_present() {
        return Err(GioError::NoCudaDriver { reason: "libcuda.so could not be loaded".into() });
    }
    driver::init().map_err(|error| GioError::NoCudaDriver { reason: error.to_string() })?;
    let info = DriverInfo { version: driver::driver_version()?, device_count: driver::device_count()? };
    if info.device_count == 0 {
        return Err(GioError::NoCudaDriver { reason: "the driver reports no CUDA device".into() });
    }
    Ok(info)
}

/// How the runtime is asked to set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuConfig {
    pub device_ordinal: i32,
    /// SMs for the I/O domain (green context). The driver may round up to its SM granularity.
    pub io_sm_budget: SmBudget,
    pub dma_mode: DmaMode,
    /// Directory holding gio_io_kernel.vN.sm_XY.cubin and gio_io_kernel.vN.compute_80.ptx, N the
    /// ABI version (tools/cuda-build.sh writes them to target/kernels; see [`KernelImage`]).
    pub kernel_dir: PathBuf,
}

/// Where the I/O kernel will run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoDomain {
    /// A green context with this many SMs, isolated from compute kernels.
    GreenContext { sm_count: u32 },
    /// An ordinary stream sharing all SMs with compute (no isolation), and why.
    SharedStream { reason: String },
}

/// What [`GpuRuntime::open`] set up, for logs and benchmark output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuReport {
    pub driver: DriverInfo,
    pub compute_capability: (i32, i32),
    pub sm_count_total: i32,
    pub io_domain: IoDomain,
    pub dma_mode: DmaMode,
    pub kernel_image: PathBuf,
}

/// A kernel image on disk, chosen for a compute capability.
///
/// Image names carry the ABI version the kernel was built from (`gio_io_kernel.v3.sm_90.cubin`),
/// and only this crate's version is looked for: a kernel directory left from a build of another
/// version (whose kernel reads and writes the shared records differently) is refused by name, with
/// an error that says so, rather than run. tools/cuda-build.sh names them from
/// `GIO_ABI_VERSION` in kernels/gio_abi.h; here the name comes from [`KernelImage::stem`]. The
/// loaded module's own stamp ([`ABI_VERSION_SYMBOL`]) is checked as well.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelImage {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
}

impl KernelImage {
    /// What every image name of this ABI version starts with: `gio_io_kernel.v{ABI_VERSION}`.
    pub fn stem() -> String {
        format!("gio_io_kernel.v{}", crate::abi::ABI_VERSION)
    }

    /// The cubin's file name for compute capability `major.minor`.
    pub fn cubin_file_name(major: i32, minor: i32) -> String {
        format!("{}.sm_{major}{minor}.cubin", Self::stem())
    }

    /// The PTX's file name (compute_80, the lowest architecture supported).
    pub fn ptx_file_name() -> String {
        format!("{}.compute_80.ptx", Self::stem())
    }

    /// The cubin built for exactly `major.minor` if there is one, else the PTX (JIT-compiled by the
    /// driver for newer GPUs); both of this ABI version. Neither there is
    /// [`GioError::KernelImageMissing`], which names images of other versions found instead.
    pub fn locate(dir: &Path, major: i32, minor: i32) -> Result<Self, GioError> {
        let cubin = dir.join(Self::cubin_file_name(major, minor));
        let ptx = dir.join(Self::ptx_file_name());
        let path = if cubin.is_file() {
            cubin
        } else if ptx.is_file() {
            ptx
        } else {
            return Err(GioError::KernelImageMissing {
                dir: dir.to_path_buf(),
                abi_version: crate::abi::ABI_VERSION,
                looked_for: format!("{} or {}", Self::cubin_file_name(major, minor), Self::ptx_file_name()),
                other_versions: Self::other_versions(dir),
            });
        };
        let mut bytes = std::fs::read(&path).map_err(|source| GioError::KernelImage { path: path.clone(), source })?;
        if path.extension().is_some_and(|ext| ext == "ptx") {
            bytes.push(0); // cuModuleLoadData reads PTX as a C string
        }
        Ok(Self { path, bytes })
    }

    /// The names of the kernel images in `dir` that are not of this ABI version (named with
    /// another, or without one: built before version 3), sorted; at most
    /// [`OTHER_VERSIONS_NAMED_MAX`], for an error message. None if `dir` cannot be listed.
    fn other_versions(dir: &Path) -> Vec<String> {
        let own = format!("{}.", Self::stem());
        let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
        let mut names: Vec<String> = entries
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .filter(|name| name.starts_with("gio_io_kernel.") && !name.starts_with(&own))
            .filter(|name| name.ends_with(".cubin") || name.ends_with(".ptx"))
            .take(OTHER_VERSIONS_NAMED_MAX)
            .collect();
        names.sort();
        names
    }
}

/// How many images of other ABI versions [`GioError::KernelImageMissing`] names at most.
const OTHER_VERSIONS_NAMED_MAX: usize = 8;

/// Refuses a loaded module whose [`ABI_VERSION_SYMBOL`] holds another ABI version. A module in
/// which the driver finds no such global (`found` is `None`) is loaded with a warning, not
/// refused: the symbol is local in a whole-program cubin, and whether `cuModuleGetGlobal` finds
/// a local symbol has not been seen on a GPU yet, while the image's file name (checked by
/// [`KernelImage::locate`]) already carries the version; refusing would stop every GPU run on a
/// driver that does not look local symbols up.
fn check_abi_stamp(path: &Path, found: Option<u32>) -> Result<(), GioError> {
    match found {
        Some(version) if version == crate::abi::ABI_VERSION => Ok(()),
        Some(_) => Err(GioError::KernelAbiMismatch { path: path.to_path_buf(), expected: crate::abi::ABI_VERSION, found }),
        None => {
            tracing::warn!(
                path = %path.display(),
                "the kernel image's {} global was not found by the driver; its version is taken from its file name",
                ABI_VERSION_SYMBOL.to_string_lossy()
            );
            Ok(())
        }
    }
}

/// A CUDA context, the loaded I/O kernel and the stream it launches on.
#[derive(Debug)]
pub struct GpuRuntime {
    handles: driver::Handles,
    report: GpuReport,
    /// Set by [`GpuRuntime::keep_for_good`]: dropping it releases nothing.
    kept: bool,
}

impl GpuRuntime {
    /// Probes the driver, retains the device's primary context, loads the kernel, and creates the
    /// I/O domain: a green context of `io_sm_budget` SMs where the driver has them (CUDA >= 12.5),
    /// otherwise an ordinary stream, with a warning in the log and in the report.
    pub fn open(config: &GpuConfig) -> Result<Self, GioError> {
        let driver_info = probe_driver()?;
        let device = driver::device(config.device_ordinal)?;
        let attribute = |attribute| driver::device_attribute(device, attribute);
        use sys::CUdevice_attribute as A;
        let major = attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sm_count_total = attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        if config.io_sm_budget.0 == 0 {
            return Err(GioError::ZeroSmBudget);
        }
        let primary = driver::retain_primary_context(device)?;
        let (green, stream, io_domain) = match Self::io_domain(device, &driver_info, config.io_sm_budget) {
            Ok(domain) => domain,
            Err(error) => {
                let _ = driver::release_primary_context(device);
                return Err(error);
            }
        };
        // Everything the executor does runs in the I/O domain's context: the green context (as a
        // CUcontext) when there is one, so that the module, the allocations and the stream all
        // belong to the context the kernel runs in; otherwise the primary context.
        let undo_domain = |stream, green: Option<sys::CUgreenCtx>| {
            let _ = driver::destroy_stream(stream);
            let _ = green.map_or(Ok(()), driver::destroy_green_context);
            let _ = driver::release_primary_context(device);
        };
        let context = match green.map_or(Ok(primary), driver::context_of_green) {
            Ok(context) => context,
            Err(error) => {
                undo_domain(stream, green);
                return Err(error);
            }
        };
        let image = KernelImage::locate(&config.kernel_dir, major, minor);
        let loaded = driver::set_current(context).and(image).and_then(|image| {
            let module = driver::load_module(&image.bytes)?;
            let stamped = driver::module_global_u32(module, ABI_VERSION_SYMBOL)
                .and_then(|found| check_abi_stamp(&image.path, found))
                .and_then(|()| driver::function(module, KERNEL_NAME));
            match stamped {
                Ok(function) => Ok((image.path, module, function)),
                Err(error) => {
                    let _ = driver::unload_module(module);
                    Err(error)
                }
            }
        });
        let (kernel_image, module, function) = match loaded {
            Ok(loaded) => loaded,
            Err(error) => {
                undo_domain(stream, green);
                return Err(error);
            }
        };
        let report = GpuReport {
            driver: driver_info,
            compute_capability: (major, minor),
            sm_count_total,
            io_domain,
            dma_mode: config.dma_mode,
            kernel_image,
        };
        tracing::info!(?report, "gio-uring GPU runtime ready (DMA mode {})", config.dma_mode);
        Ok(Self { handles: driver::Handles { device, context, module, function, green, stream }, report, kept: false })
    }

    fn io_domain(
        device: sys::CUdevice,
        driver_info: &DriverInfo,
        budget: SmBudget,
    ) -> Result<(Option<sys::CUgreenCtx>, sys::CUstream, IoDomain), GioError> {
        let reason = if driver_info.has_green_contexts() {
            match driver::create_green_context(device, budget.0) {
                Ok((green, stream, sm_count)) => {
                    return Ok((Some(green), stream, IoDomain::GreenContext { sm_count }));
                }
                Err(error) => format!("green context creation failed: {error}"),
            }
        } else {
            format!("driver version {} predates cuGreenCtxStreamCreate (CUDA 12.5)", driver_info.version)
        };
        tracing::warn!("gio-uring: no I/O green context ({reason}); the I/O kernel shares all SMs with compute");
        let stream = driver::create_stream()?;
        Ok((None, stream, IoDomain::SharedStream { reason }))
    }

    pub fn report(&self) -> &GpuReport {
        &self.report
    }

    /// Whether the kernel's entry point was resolved (it is, for any runtime that exists).
    pub fn kernel_loaded(&self) -> bool {
        !self.handles.function.is_null()
    }

    /// Makes the runtime's context current on the calling thread and leaves it so, for set-up
    /// on the thread that opened the runtime (allocating [`DeviceMemory`]
    /// and copying into it; `open` did the same). The executor's entry points do not use this:
    /// they push the context for the call and pop it before returning (`GpuRuntime::enter`).
    /// Dropping the runtime on this thread takes the I/O context off it; dropping it on
    /// another leaves this thread with the destroyed context current until it sets another.
    pub fn make_current(&self) -> Result<(), GioError> {
        driver::set_current(self.handles.context)
    }

    /// The runtime's context, current on the calling thread until the guard drops (pushed, then
    /// popped: what was current before is current again). Every entry point of the executor
    /// holds one, so it may be driven from any thread without leaving the I/O context (a green
    /// context may be current on one thread at a time) current there, nor replacing the
    /// caller's own context.
    pub(crate) fn enter(&self) -> Result<driver::CurrentContext, GioError> {
        driver::push_current(self.handles.context)
    }

    /// SMs the I/O kernel may occupy: the green context's, or every SM with the fallback stream.
    pub fn io_sm_count(&self) -> u32 {
        match self.report.io_domain {
            IoDomain::GreenContext { sm_count } => sm_count,
            IoDomain::SharedStream { .. } => self.report.sm_count_total.max(0) as u32,
        }
    }

    /// CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED: whether the GPU's atomics on host
    /// memory are native over the link (NVLink-C2C) rather than done as PCIe read-modify-writes
    /// that are atomic only against the GPU itself. The kernel's locks and counters live in GPU
    /// memory; this is for the test log and for judging host-memory rings.
    pub fn host_native_atomics(&self) -> Result<bool, GioError> {
        let value =
            driver::device_attribute(self.handles.device, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED)?;
        Ok(value != 0)
    }

    pub(crate) fn stream(&self) -> sys::CUstream {
        self.handles.stream
    }

    pub(crate) fn function(&self) -> sys::CUfunction {
        self.handles.function
    }
}

impl GpuRuntime {
    /// Makes dropping it release nothing: the stream, the kernel's module and the contexts
    /// (whose end would free every allocation in them) stay until the process ends. For a
    /// teardown that could not wait for a kernel still using them.
    pub(crate) fn keep_for_good(&mut self) {
        self.kept = true;
    }
}

impl Drop for GpuRuntime {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        // Errors on teardown cannot be acted on; they are logged, not hidden.
        // The module belongs to the I/O context: unload it while that context exists and is
        // current here (pushed, and popped before the context is destroyed, so that the push
        // leaves nothing behind).
        let current = driver::push_current(self.handles.context);
        let mut results = vec![driver::destroy_stream(self.handles.stream), driver::unload_module(self.handles.module)];
        match current {
            Ok(current) => drop(current),
            Err(error) => results.push(Err(error)),
        }
        // `open` and `make_current` leave the I/O context current on the thread that called
        // them (`cuCtxSetCurrent`): when that is this thread, it is made current nowhere here
        // before it is destroyed or released. Another thread that called them keeps it current
        // (a dangling handle once destroyed) until it sets another: no thread can change what
        // is current on another.
        match driver::current_context() {
            Ok(current) if current == self.handles.context => results.push(driver::clear_current()),
            Ok(_) => {}
            Err(error) => results.push(Err(error)),
        }
        results.push(self.handles.green.map_or(Ok(()), driver::destroy_green_context));
        results.push(driver::release_primary_context(self.handles.device));
        for error in results.into_iter().filter_map(Result::err) {
            tracing::warn!("gio-uring GPU teardown: {error}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dma_mode_is_parsed_strictly_and_printed_back() {
        assert_eq!("p2p".parse::<DmaMode>().unwrap(), DmaMode::P2p);
        assert_eq!("staged".parse::<DmaMode>().unwrap(), DmaMode::Staged);
        assert!("P2P".parse::<DmaMode>().is_err());
        assert!("".parse::<DmaMode>().is_err());
        assert_eq!(DmaMode::Staged.to_string(), "staged");
    }

    #[test]
    fn green_contexts_need_every_entry_point_they_call() {
        // Goal: cudarc's loader panics on a missing symbol, so the runtime may take the green
        // context path only on a driver that exports every entry point of that path.
        // cuGreenCtxStreamCreate first appeared in CUDA 12.5: a 12.4 driver takes the fallback.
        let newest = driver::GREEN_CONTEXT_ENTRY_POINTS.iter().map(|&(_, version)| version).max().unwrap();
        assert!(driver::GREEN_CONTEXT_ENTRY_POINTS.contains(&("cuGreenCtxStreamCreate", 12050)));
        assert!(driver::GREEN_CONTEXT_MIN_DRIVER_VERSION >= newest);
        let on = |version| DriverInfo { version, device_count: 1 }.has_green_contexts();
        assert!(!on(12040));
        assert!(!on(12049));
        assert!(on(12050));
        assert!(on(13020));
    }

    #[test]
    fn probe_never_panics() {
        // Goal: on any machine, the probe returns (here, without a GPU: NoCudaDriver).
        match probe_driver() {
            Ok(info) => assert!(info.device_count > 0),
            Err(GioError::NoCudaDriver { reason }) => assert!(!reason.is_empty()),
            Err(other) => panic!("unexpected error kind: {other}"),
        }
    }

    /// A fresh, empty directory under the system's temporary directory, unique to `name` and
    /// this process.
    fn scratch_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gio-kernels-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn kernel_image_prefers_the_exact_cubin_and_falls_back_to_nul_terminated_ptx() {
        let dir = scratch_dir("choice");
        std::fs::write(dir.join("gio_io_kernel.v3.sm_90.cubin"), b"CUBIN").unwrap();
        std::fs::write(dir.join("gio_io_kernel.v3.compute_80.ptx"), b".version").unwrap();
        let cubin = KernelImage::locate(&dir, 9, 0).unwrap();
        assert_eq!(cubin.bytes, b"CUBIN");
        let ptx = KernelImage::locate(&dir, 10, 0).unwrap();
        assert_eq!(ptx.bytes, b".version\0");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(locate_error(&dir, 9, 0).contains("no I/O kernel image"));
    }

    fn locate_error(dir: &Path, major: i32, minor: i32) -> String {
        match KernelImage::locate(dir, major, minor) {
            Ok(image) => panic!("{} was taken", image.path.display()),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn a_kernel_directory_of_another_abi_version_is_refused_by_name() {
        // Goal: the crates and the kernel share the ABI of gio_abi.h (version 3), and the image
        // names carry it: a directory left from an older build (images named without a version,
        // before version 3, or with another one) is refused, and the error names what was looked
        // for and what was found, instead of an old kernel running silently.
        assert_eq!(crate::abi::ABI_VERSION, 3, "the names below follow the ABI version");
        for old in ["gio_io_kernel.sm_90.cubin", "gio_io_kernel.compute_80.ptx", "gio_io_kernel.v2.sm_90.cubin"] {
            let dir = scratch_dir("old");
            std::fs::write(dir.join(old), b"OLD").unwrap();
            let error = locate_error(&dir, 9, 0);
            for expected in ["ABI version 3", "gio_io_kernel.v3.sm_90.cubin", "gio_io_kernel.v3.compute_80.ptx", old, "another ABI version"]
            {
                assert!(error.contains(expected), "{old}: {expected:?} not in: {error}");
            }
            std::fs::write(dir.join("gio_io_kernel.v3.compute_80.ptx"), b".version").unwrap();
            let image = KernelImage::locate(&dir, 9, 0).expect("this version's image is taken");
            assert_eq!(image.path, dir.join("gio_io_kernel.v3.compute_80.ptx"));
            std::fs::remove_dir_all(&dir).unwrap();
        }
        // Nothing at all: the names looked for, and no mention of another version.
        let dir = scratch_dir("none");
        let error = locate_error(&dir, 8, 0);
        assert!(error.contains("gio_io_kernel.v3.sm_80.cubin") && !error.contains("another ABI version"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_abi_stamp_other_than_this_version_is_refused() {
        // Goal: the version the loaded module carries (its gio_abi_version global) is checked
        // too: another value is an error naming both; none found is loaded (the file name
        // already carried the version; see check_abi_stamp).
        let path = Path::new("/k/gio_io_kernel.v3.sm_90.cubin");
        assert!(check_abi_stamp(path, Some(crate::abi::ABI_VERSION)).is_ok());
        let error = check_abi_stamp(path, Some(2)).unwrap_err().to_string();
        assert!(error.contains("ABI version 2") && error.contains("not 3") && error.contains("/k/gio_io_kernel"), "{error}");
        assert!(check_abi_stamp(path, None).is_ok());
    }
}
