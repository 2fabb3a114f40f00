//! Throughput of the CPU executor on the software controller's no-storage mode, and the CPU time of
//! `issue_io` itself.
//!
//! run: `cargo run --release -p gio-uring --example cpu_executor_bench`
//!      `GIO_BENCH_WORKERS=2 cargo run ...` for `CpuWorkers` with that many worker threads, each
//!      owning one queue pair (one device entry per worker, IOCTXs spread round-robin)
//!
//! What it should show: `issue_io` publishes IOCB ids and nothing else, so its cost per call is
//! flat in the number of IOCTXs (16 vs 2048 must be within noise) — the per-layer cost of a
//! prepared request does not grow with its block count. IOCTXs per second grow with the IOCB size
//! until the controller thread (one core, validating and completing each command) is the limit;
//! on a 2-core machine shared with the emulator's thread that is a few hundred thousand per second.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::abi::Opcode;
use gio_uring::{
    CpuExecutor, CpuWorkers, Dependency, Descriptor, DeviceIndex, DeviceInfo, DeviceTable, Executor, GioQueue, IocbSpec, IoctxSpec, Iova,
    IovaRange, LayerIndex, Lba, QueueConfig, RegisteredMemory, SmBudget,
};
use nvme_driver::hw::DeviceBackend;
use nvme_driver::{Controller, ControllerConfig};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};

const BLOCK_BYTES: u32 = 512;
const BLOCKS_PER_IOCTX: u32 = 8; // one 4 KiB KV block per IOCTX
const LAYERS: u32 = 32;
const NVME_QUEUE_DEPTH: u32 = 1024;
const RUN_TIME: Duration = Duration::from_millis(1500);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let workers: usize = std::env::var("GIO_BENCH_WORKERS").ok().map(|text| text.parse()).transpose()?.unwrap_or(0);
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 1 << 28 })
        .with_namespaces(vec![NamespaceConfig::new(BLOCK_BYTES, Some(1 << 28))])
        .with_no_storage(true);
    let device = EmuDevice::start(config)?;
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Controller::init(backend, ControllerConfig::default())?;
    let namespace = controller.namespaces()[0];
    let device_count = workers.max(1);
    let queue_pairs = (0..device_count).map(|_| controller.create_io_queue_pair(NVME_QUEUE_DEPTH)).collect::<Result<Vec<_>, _>>()?;
    let buffer = controller.dma().allocate(2048 * IOCTX_BYTES as usize)?;
    let info = DeviceInfo {
        nsid: namespace.id.0,
        capacity_blocks: namespace.size_blocks,
        block_bytes: namespace.block_size_bytes,
        sgl_supported: true,
    };
    let devices = DeviceTable::new(vec![info; device_count]);
    let registered = RegisteredMemory::new(vec![IovaRange::new(buffer.iova(), buffer.len() as u64)]).ok_or("registration")?;
    let queue_config = QueueConfig { depth: 4, ioctx_per_iocb_max: 2048 };
    let executor = if workers == 0 { "CpuExecutor (caller-driven)".to_string() } else { format!("CpuWorkers ({workers} threads)") };
    println!(
        "config: software controller (no-storage), {executor}, {device_count} NVMe queue pair(s) of depth {NVME_QUEUE_DEPTH}, SGL, \
         {BLOCKS_PER_IOCTX} x {BLOCK_BYTES} B per IOCTX, {LAYERS} layers, {} ms per size, {} cores",
        RUN_TIME.as_millis(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let run = Run { nsid: namespace.id.0, buffer: buffer.iova(), device_count };
    if workers == 0 {
        let queue = GioQueue::init_queue(queue_config, devices, registered, CpuExecutor::new(queue_pairs, 4))?;
        run.measure(queue)?;
    } else {
        let assignments = queue_pairs.into_iter().enumerate().map(|(device, queue)| vec![(DeviceIndex(device as u16), queue)]).collect();
        let queue = GioQueue::init_queue(queue_config, devices, registered, CpuWorkers::new(device_count, assignments, 4)?)?;
        run.measure(queue)?;
    }
    Ok(())
}

const IOCTX_BYTES: u64 = (BLOCKS_PER_IOCTX * BLOCK_BYTES) as u64;

struct Run {
    nsid: u32,
    buffer: Iova,
    device_count: usize,
}

impl Run {
    /// Takes the queue by value and drops it at the end, which deletes the I/O queue pairs while
    /// the controller is still up.
    fn measure<E: Executor>(&self, mut queue: GioQueue<E>) -> Result<(), Box<dyn std::error::Error>> {
        println!("{:>10} {:>12} {:>14} {:>16} {:>16}", "ioctx/iocb", "issues", "ioctx/s", "issue_io ns/call", "issue+wait us");
        let id = queue.get_iocb(1, Dependency::None)?[0];
        let layer_blocks = 2048 * u64::from(BLOCKS_PER_IOCTX);
        for ioctx_count in [1u32, 16, 64, 512, 2048] {
            let ioctxs = (0..ioctx_count)
                .map(|i| {
                    let data = self.buffer.checked_add(u64::from(i) * IOCTX_BYTES).ok_or("IOCTX address overflows")?;
                    Ok(IoctxSpec {
                        device: DeviceIndex((i as usize % self.device_count) as u16),
                        nsid: self.nsid,
                        start_lba: Lba(u64::from(i * BLOCKS_PER_IOCTX)),
                        block_count: BLOCKS_PER_IOCTX,
                        data,
                        descriptor: Descriptor::SglInline,
                        force_unit_access: false,
                    })
                })
                .collect::<Result<Vec<_>, &str>>()?;
            let spec = IocbSpec {
                opcode: Opcode::Read,
                user_data: 0,
                layer_count: LAYERS,
                lba_stride_blocks: layer_blocks,
                mem_stride_bytes: 0, // every layer lands in the same buffer: no data moves anyway
                desc_stride_bytes: 0,
            };
            queue.fill_iocb(id, &spec, &ioctxs)?;
            let mut issues = 0u64;
            let mut issue_time = Duration::ZERO;
            let started = Instant::now();
            while started.elapsed() < RUN_TIME {
                let layer = LayerIndex((issues % u64::from(LAYERS)) as u32);
                let before = Instant::now();
                queue.issue_io(&[id], layer, SmBudget(1))?;
                issue_time += before.elapsed();
                let completion = queue.wait_cqe(id, Instant::now() + Duration::from_secs(10))?;
                completion.result?;
                issues += 1;
            }
            let elapsed = started.elapsed();
            println!(
                "{:>10} {:>12} {:>14.0} {:>16.0} {:>16.1}",
                ioctx_count,
                issues,
                (issues * u64::from(ioctx_count)) as f64 / elapsed.as_secs_f64(),
                issue_time.as_nanos() as f64 / issues as f64,
                elapsed.as_micros() as f64 / issues as f64
            );
        }
        Ok(())
    }
}
