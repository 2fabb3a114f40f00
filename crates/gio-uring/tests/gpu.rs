//! GPU test of gio-uring. Without a CUDA driver (or without the `cuda` feature) it prints exactly
//! one line saying it is skipped and why, and exits 0.
//!
//! With a driver it runs the CUDA executor against the software controller (nvme-emu), whose
//! registers (BAR0) and queue rings are host memory registered with the GPU, on the workload of
//! tests/cpu_executor.rs: 4 layers × 40 IOCTXs of 8 × 512-byte blocks, one IOCB per direction
//! filled once and reissued per layer, LBAs in reverse order. DMA mode is staged: the emulator
//! writes host staging buffers and the executor copies them to and from GPU memory. The pattern
//! goes into GPU memory and is written to the SSD layer by layer; the SSD's blocks are checked
//! through an ordinary CPU queue pair at the LBAs the CPU test uses; then everything is read back
//! into another GPU buffer and the bytes are compared. Then a dropped NVMe completion must end as a kernel
//! timeout, reset the queue pair, and the next issue must succeed.
//!
//! Needs the kernel images from tools/cuda-build.sh (GIO_KERNEL_DIR, default target/kernels).
//! STATUS: written without a GPU; it has never run on one.
//!
//! Runs without libtest's harness (`harness = false`) so the skip really is one line.

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("gpu test skipped: gio-uring was built without the `cuda` feature");
}

#[cfg(feature = "cuda")]
fn main() {
    use gio_uring::gpu::probe_driver;
    use gio_uring::GioError;

    let driver = match probe_driver() {
        Ok(driver) => driver,
        Err(GioError::NoCudaDriver { reason }) => {
            println!("gpu test skipped: no CUDA driver ({reason})");
            return;
        }
        Err(other) => panic!("gpu test: driver probe failed unexpectedly: {other}"),
    };
    println!("gpu test: driver {driver:?}");
    cuda::staged_round_trip_matches_bytes_and_a_timeout_resets_the_queue_pair();
    println!("gpu test: passed");
}

#[cfg(feature = "cuda")]
mod common;

#[cfg(feature = "cuda")]
mod cuda {
    use std::time::{Duration, Instant};

    use gio_uring::abi::Opcode;
    use gio_uring::{
        Dependency, Descriptor, DeviceIndex, DeviceTable, GioQueue, IocbFailure, IoctxSpec, LayerIndex, Lba, QueueConfig, SmBudget,
    };
    use nvme_driver::hw::DmaRegion;
    use nvme_emu::{Backing, EmuConfig, FaultAction, FaultPlan, FaultRule, NamespaceConfig};

    use crate::common::gpu_setup::{self, EmulatedController, Staging};
    use crate::common::{assert_ssd_layout, layered, pattern, BLOCKS_PER_IOCTX, BLOCK_BYTES, IOCTXS, LAYERS, LAYER_BYTES};

    fn deadline() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    /// The CPU test's IOCTXs: IOCTX `i` moves KV block `i` of layer 0, LBAs reversed.
    fn ioctxs(staging: &DmaRegion) -> Vec<IoctxSpec> {
        let block_bytes = u64::from(BLOCKS_PER_IOCTX * BLOCK_BYTES);
        (0..IOCTXS)
            .map(|i| IoctxSpec {
                device: DeviceIndex(0),
                nsid: 1,
                start_lba: Lba(u64::from(IOCTXS - 1 - i) * u64::from(BLOCKS_PER_IOCTX)),
                block_count: BLOCKS_PER_IOCTX,
                data: staging.iova().checked_add(u64::from(i) * block_bytes).expect("inside the staging buffer"),
                descriptor: Descriptor::Prp { prp2: None },
                force_unit_access: false,
            })
            .collect()
    }

    pub fn staged_round_trip_matches_bytes_and_a_timeout_resets_the_queue_pair() {
        // tools/gpu/run-gpu-tests.sh passes the mode it asks for (GIO_DMA_MODE); only staged is written.
        let runtime = gpu_setup::open_runtime(SmBudget(2)).unwrap();
        println!("gpu test: {:?}", runtime.report());

        let emu = EmuConfig::default()
            .with_backing(Backing::Memory { bytes: 8 << 20 })
            .with_namespaces(vec![NamespaceConfig::new(BLOCK_BYTES, Some(4 << 20))]);
        let emulated = EmulatedController::start(emu).unwrap();
        let (device, controller) = (&emulated.device, &emulated.controller);
        let bytes = (LAYER_BYTES * u64::from(LAYERS)) as usize;
        let source = Staging::allocate(controller, bytes, "source").unwrap();
        let target = Staging::allocate(controller, bytes, "target").unwrap();
        let data = pattern(bytes);
        source.gpu.copy_from_host(0, &data).unwrap();
        target.gpu.copy_from_host(0, &vec![0u8; bytes]).unwrap();
        gpu_setup::settle_copies(&target.gpu).unwrap();

        // About 0.2 s before the kernel gives up on a lost completion.
        let mut executor = gpu_setup::staged_executor(runtime, &emulated, 64, &[&source, &target], 20_000).unwrap();
        println!("gpu test: grid limits {:?}", executor.grid_limits());
        let token = executor.create_dependency_event().unwrap();
        executor.record_dependency_on_io_stream(token).unwrap();

        let (source_staging, target_staging) = (&source.host, &target.host);
        let registered = gpu_setup::registered(&[&source, &target]).unwrap();
        let mut queue = GioQueue::init_queue(
            QueueConfig { depth: 16, ioctx_per_iocb_max: 2048 },
            DeviceTable::new(vec![emulated.device_info()]),
            registered,
            executor,
        )
        .unwrap();
        let write = queue.get_iocb(1, Dependency::Event(token)).unwrap()[0];
        let read = queue.get_iocb(1, Dependency::None).unwrap()[0];
        queue.fill_iocb(write, &layered(Opcode::Write), &ioctxs(source_staging)).unwrap();
        queue.fill_iocb(read, &layered(Opcode::Read), &ioctxs(target_staging)).unwrap();
        for layer in 0..LAYERS {
            queue.issue_io(&[write], LayerIndex(layer), SmBudget(2)).unwrap();
            assert_eq!(queue.wait_cqe(write, deadline()).unwrap().result, Ok(()), "write layer {layer}");
        }
        // The SSD must hold what the CPU executor's workload puts there.
        assert_ssd_layout(controller, &data);
        for layer in 0..LAYERS {
            queue.issue_io(&[read], LayerIndex(layer), SmBudget(2)).unwrap();
            let completion = queue.wait_cqe(read, deadline()).unwrap();
            assert_eq!((completion.result, completion.layer), (Ok(()), LayerIndex(layer)), "read layer {layer}");
        }
        let mut back = vec![0u8; bytes];
        target.gpu.copy_to_host(0, &mut back).unwrap();
        assert!(back == data, "bytes read back into GPU memory differ from the bytes written from GPU memory");
        println!("gpu test: {bytes} bytes written from and read back into GPU memory, identical");
        // Every CQE the kernel produced found room in its sink (claimed before it was needed).
        assert_eq!(queue.executor().kernel_cqe_overflows(), 0, "the kernel could not post some CQEs");

        // A lost NVMe completion: the kernel's bounded wait ends as a timeout, the executor resets
        // the queue pair, and the next issue runs on the fresh one.
        device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)));
        queue.issue_io(&[read], LayerIndex(0), SmBudget(2)).unwrap();
        let completion = queue.wait_cqe(read, deadline()).unwrap();
        assert!(matches!(completion.result, Err(IocbFailure::Timeout { .. })), "{:?}", completion.result);
        assert_eq!(queue.executor().resets(), 1, "one queue-pair reset after the timeout");
        device.set_faults(FaultPlan::none());
        queue.issue_io(&[read], LayerIndex(1), SmBudget(2)).unwrap();
        assert_eq!(queue.wait_cqe(read, deadline()).unwrap().result, Ok(()), "issue after the reset");
        println!("gpu test: lost completion -> timeout -> queue-pair reset -> next issue succeeded");
    }
}
