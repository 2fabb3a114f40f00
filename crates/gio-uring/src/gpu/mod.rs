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
    /// Directory holding gio_io_kernel.sm_XY.cubin and gio_io_kernel.compute_80.ptx
    /// (tools/cuda-build.sh writes them to target/kernels).
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelImage {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
}

impl KernelImage {
    /// The cubin built for exactly `major.minor` if there is one, else the PTX (JIT-compiled by the
    /// driver for newer GPUs).
    pub fn locate(dir: &Path, major: i32, minor: i32) -> Result<Self, GioError> {
        let cubin = dir.join(format!("gio_io_kernel.sm_{major}{minor}.cubin"));
        let path = if cubin.is_file() { cubin } else { dir.join("gio_io_kernel.compute_80.ptx") };
        let mut bytes = std::fs::read(&path).map_err(|source| GioError::KernelImage { path: path.clone(), source })?;
        if path.extension().is_some_and(|ext| ext == "ptx") {
            bytes.push(0); // cuModuleLoadData reads PTX as a C string
        }
        Ok(Self { path, bytes })
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
    /// I/O domain: a green context of `io_sm_budget` SMs where the driver has them (CUDA >= 12.4),
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
            match driver::function(module, KERNEL_NAME) {
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
            format!("driver version {} predates green contexts (12.4)", driver_info.version)
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

    /// Makes the runtime's context current on the calling thread (every entry point of the
    /// executor does this first, so it may be driven from any thread).
    pub fn make_current(&self) -> Result<(), GioError> {
        driver::set_current(self.handles.context)
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
        // The module belongs to the I/O context: unload it while that context exists.
        let results = [
            driver::set_current(self.handles.context),
            driver::destroy_stream(self.handles.stream),
            driver::unload_module(self.handles.module),
            self.handles.green.map_or(Ok(()), driver::destroy_green_context),
            driver::release_primary_context(self.handles.device),
        ];
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
    fn probe_never_panics() {
        // Goal: on any machine, the probe returns (here, without a GPU: NoCudaDriver).
        match probe_driver() {
            Ok(info) => assert!(info.device_count > 0),
            Err(GioError::NoCudaDriver { reason }) => assert!(!reason.is_empty()),
            Err(other) => panic!("unexpected error kind: {other}"),
        }
    }

    #[test]
    fn kernel_image_prefers_the_exact_cubin_and_falls_back_to_nul_terminated_ptx() {
        let dir = std::env::temp_dir().join(format!("gio-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("gio_io_kernel.sm_90.cubin"), b"CUBIN").unwrap();
        std::fs::write(dir.join("gio_io_kernel.compute_80.ptx"), b".version").unwrap();
        let cubin = KernelImage::locate(&dir, 9, 0).unwrap();
        assert_eq!(cubin.bytes, b"CUBIN");
        let ptx = KernelImage::locate(&dir, 10, 0).unwrap();
        assert_eq!(ptx.bytes, b".version\0");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(KernelImage::locate(&dir, 9, 0), Err(GioError::KernelImage { .. })));
    }
}
