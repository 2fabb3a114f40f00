//! Set-up shared by the GPU test (tests/gpu.rs) and the layer-load example
//! (examples/gpu_layer_load.rs, which includes this file by path): the GPU runtime the
//! environment asks for, the software controller on memory, staging buffers, and the CUDA
//! executor in staged mode over one detached NVMe queue pair of that controller.
//!
//! Errors are strings with their context: the test unwraps them, the example prints them.
#![allow(dead_code)] // Each user takes a different subset.

use std::path::PathBuf;
use std::sync::Arc;

use gio_uring::gpu::{
    BarMapping, DeviceMemory, DmaMode, GpuConfig, GpuExecutor, GpuExecutorConfig, GpuQueueSpec, GpuRuntime, StagingBuffer,
};
use gio_uring::{DeviceInfo, IovaRange, RegisteredMemory, SmBudget};
use nvme_driver::hw::DeviceBackend;
use nvme_driver::{Controller, ControllerConfig, DmaRegion};
use nvme_emu::{EmuConfig, EmuDevice};

/// Where the kernel images are: `GIO_KERNEL_DIR`, else `target/kernels` (tools/cuda-build.sh).
pub fn kernel_dir() -> PathBuf {
    std::env::var_os("GIO_KERNEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/kernels"))
}

/// The DMA mode `GIO_DMA_MODE` asks for (default staged). Only staged mode is written: the
/// software controller cannot DMA into GPU memory, so p2p is refused with the reason.
pub fn staged_mode_from_env() -> Result<DmaMode, String> {
    let text = std::env::var("GIO_DMA_MODE").unwrap_or_else(|_| "staged".into());
    let mode: DmaMode = text.parse().map_err(|error| format!("GIO_DMA_MODE: {error}"))?;
    if mode != DmaMode::Staged {
        return Err(format!("GIO_DMA_MODE={mode}: only staged mode is written for the software controller"));
    }
    Ok(mode)
}

/// Opens the GPU runtime on device 0 with an I/O domain of `io_sms` SMs, in the mode and with
/// the kernels the environment names. Makes the runtime's context current, so GPU memory can be
/// allocated next.
pub fn open_runtime(io_sms: SmBudget) -> Result<GpuRuntime, String> {
    let kernel_dir = kernel_dir();
    let config = GpuConfig { device_ordinal: 0, io_sm_budget: io_sms, dma_mode: staged_mode_from_env()?, kernel_dir: kernel_dir.clone() };
    GpuRuntime::open(&config)
        .map_err(|error| format!("GPU runtime (kernels from {}; tools/cuda-build.sh builds them): {error}", kernel_dir.display()))
}

/// The software controller, brought up by nvme-driver.
pub struct EmulatedController {
    pub device: Arc<EmuDevice>,
    pub controller: Arc<Controller>,
}

impl EmulatedController {
    pub fn start(config: EmuConfig) -> Result<Self, String> {
        let device = EmuDevice::start(config).map_err(|error| format!("software controller: {error}"))?;
        let backend: Arc<dyn DeviceBackend> = device.clone();
        let controller = Controller::init(backend, ControllerConfig::default()).map_err(|error| format!("controller bring-up: {error}"))?;
        Ok(Self { device, controller: Arc::new(controller) })
    }

    /// Namespace 1 as gio-uring's device table describes it.
    pub fn device_info(&self) -> DeviceInfo {
        let namespace = self.controller.namespaces()[0];
        DeviceInfo {
            nsid: namespace.id.0,
            capacity_blocks: namespace.size_blocks,
            block_bytes: namespace.block_size_bytes,
            sgl_supported: self.controller.identify().sgl_support.supported(),
        }
    }

    /// One queue pair of `depth` entries for the executor, its doorbells in the emulated BAR0.
    pub fn gpu_queue(&self, depth: u32) -> GpuQueueSpec {
        GpuQueueSpec { controller: Arc::clone(&self.controller), bar: BarMapping::host_memory(self.device.register_region()), depth }
    }
}

/// A staging buffer of staged mode: DMA memory of the controller and the GPU buffer of the same
/// length it mirrors.
///
/// Dropped after an executor whose teardown could not drain its I/O stream
/// ([`gio_uring::gpu::teardowns_leaked`] above 0: a hung kernel), it keeps both for good: a
/// staged copy still queued on that stream may write either, and `cuMemFree` of memory a hung
/// stream uses may block for ever. The callers declare their queue (which owns the executor)
/// after their stagings, so the executor is dropped, and counts its leak, first.
pub struct Staging {
    pub host: DmaRegion,
    pub gpu: DeviceMemory,
}

impl Staging {
    /// Needs the runtime's context current ([`open_runtime`] leaves it so).
    pub fn allocate(controller: &Controller, bytes: usize, name: &str) -> Result<Self, String> {
        let host = controller.dma().allocate(bytes).map_err(|error| format!("{name} staging: {bytes} bytes of DMA memory: {error}"))?;
        let gpu = DeviceMemory::allocate(bytes).map_err(|error| format!("{name} staging: {bytes} bytes of GPU memory: {error}"))?;
        Ok(Self { host, gpu })
    }

    pub fn buffer(&self) -> StagingBuffer {
        StagingBuffer { host: self.host.clone(), gpu_address: self.gpu.address() }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if gio_uring::gpu::teardowns_leaked() > 0 {
            self.gpu.keep_for_good();
            // The region's memory is shared (reference-counted): a forgotten clone never returns
            // it to the controller's DMA pool, so nothing else is given the bytes a copy may write.
            std::mem::forget(self.host.clone());
        }
    }
}

/// The staging buffers' IOVAs, the only memory IOCTXs may name.
pub fn registered(stagings: &[&Staging]) -> Result<RegisteredMemory, String> {
    RegisteredMemory::new(stagings.iter().map(|staging| IovaRange::new(staging.host.iova(), staging.host.len() as u64)).collect())
        .ok_or_else(|| "staging buffers overlap or overflow the IOVA space".to_string())
}

/// The CUDA executor in staged mode over one queue pair of `depth` entries of `emulated`.
pub fn staged_executor(
    runtime: GpuRuntime,
    emulated: &EmulatedController,
    depth: u32,
    stagings: &[&Staging],
    poll_iterations_max: u32,
) -> Result<GpuExecutor, String> {
    let threads_per_block = GpuExecutorConfig::default().threads_per_block;
    staged_executor_with_blocks(runtime, emulated, depth, stagings, poll_iterations_max, threads_per_block)
}

/// As [`staged_executor`], with blocks of `threads_per_block` threads (a multiple of 32).
pub fn staged_executor_with_blocks(
    runtime: GpuRuntime,
    emulated: &EmulatedController,
    depth: u32,
    stagings: &[&Staging],
    poll_iterations_max: u32,
    threads_per_block: u32,
) -> Result<GpuExecutor, String> {
    let config = GpuExecutorConfig {
        threads_per_block,
        poll_iterations_max,
        staging: stagings.iter().map(|staging| staging.buffer()).collect(),
        ..GpuExecutorConfig::default()
    };
    GpuExecutor::new(runtime, vec![emulated.gpu_queue(depth)], config).map_err(|error| format!("CUDA executor: {error}"))
}

/// Returns once every earlier [`DeviceMemory::copy_from_host`] has reached GPU memory. From
/// pageable memory `cuMemcpyHtoD` may return before its DMA lands, and the executor's I/O
/// stream (non-blocking) is not ordered after the default stream; a synchronous device-to-host
/// copy on the default stream returns only after everything before it there.
pub fn settle_copies(memory: &DeviceMemory) -> Result<(), String> {
    let mut byte = [0u8; 1];
    memory.copy_to_host(0, &mut byte).map_err(|error| format!("waiting for copies into GPU memory: {error}"))
}
