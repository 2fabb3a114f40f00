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
//! into another GPU buffer and the bytes are compared; the kernel's anomaly counters of the queue
//! pair must be zero. Then a dropped NVMe completion must end as a kernel timeout, reset the queue
//! pair, and the next issue must succeed: its target layer is poisoned (GPU buffer and staging
//! buffer) first, so a read that moved nothing fails the byte comparison.
//!
//! A second pass drives the paths the first leaves alone: a 16-entry NVMe queue (the kernel waits
//! for slots and publishes under back-pressure), three IOCBs of 100, 64 and 40 IOCTXs in one
//! `issue_io` (partial chunks, several IOCBs per launch), blocks of 32 threads (one warp each, so
//! several blocks poll and submit), SM budget 2; bytes compared and the SSD layout checked.
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
    cuda::several_iocbs_per_launch_on_a_shallow_queue_with_many_blocks_match_bytes();
    cuda::a_device_table_larger_than_the_queue_pairs_is_refused_at_init();
    println!("gpu test: passed");
}

#[cfg(feature = "cuda")]
mod common;

#[cfg(feature = "cuda")]
mod cuda {
    use std::time::{Duration, Instant};

    use gio_uring::abi::Opcode;
    use gio_uring::gpu::GpuExecutor;
    use gio_uring::{
        Dependency, Descriptor, DeviceIndex, DeviceTable, GioQueue, IocbFailure, IocbId, IocbSpec, IoctxSpec, LayerIndex, Lba, QueueConfig,
        SmBudget,
    };
    use nvme_driver::hw::DmaRegion;
    use nvme_driver::DataSegment;
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

    /// The kernel's anomaly counters of gio device 0's queue pair must be zero: every completion
    /// matched a command in flight on its own SQ.
    /// Waits for `id` and asserts it ended `Ok`, printing the queue pair's counters first when
    /// it did not (the reservations, tail and head tell a slot-wait deadlock, a stuck
    /// publication and lost completions apart: a bare timeout would not).
    fn assert_done(queue: &mut GioQueue<GpuExecutor>, id: IocbId, what: &str) {
        let result = queue.wait_cqe(id, deadline()).map(|completion| completion.result);
        if !matches!(result, Ok(Ok(()))) {
            let (executor, _) = queue.executor_and_memory();
            println!("gpu test: {what} ended {result:?}; queue-pair counters: {:?}", executor.queue_pair_counters(0));
        }
        assert!(matches!(result, Ok(Ok(()))), "{what}: {result:?}");
    }

    fn assert_no_anomalies(executor: &GpuExecutor, when: &str) {
        let counters = executor.queue_pair_counters(0).unwrap();
        println!("gpu test: queue-pair counters {when}: {counters:?}");
        assert_eq!(counters.unexpected_completions, 0, "completions matching no command {when}");
        assert_eq!(counters.controller_faults, 0, "completions naming another SQ {when}");
    }

    pub fn staged_round_trip_matches_bytes_and_a_timeout_resets_the_queue_pair() {
        // Goal: the layered workload's bytes survive a GPU-driven round trip through the
        // software controller, with no completion the kernel could not match; a lost completion
        // ends as a timeout, the queue pair is reset, and the next read really moves bytes.
        // tools/gpu/run-gpu-tests.sh passes the mode it asks for (GIO_DMA_MODE); only staged is written.
        let runtime = gpu_setup::open_runtime(SmBudget(2)).unwrap();
        println!("gpu test: {:?}", runtime.report());
        println!("gpu test: CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED = {:?}", runtime.host_native_atomics());

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
        assert_no_anomalies(queue.executor(), "after the round trip");

        // A lost NVMe completion: the kernel's bounded wait ends as a timeout, the executor resets
        // the queue pair, and the next issue runs on the fresh one.
        device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)));
        queue.issue_io(&[read], LayerIndex(0), SmBudget(2)).unwrap();
        let completion = queue.wait_cqe(read, deadline()).unwrap();
        assert!(matches!(completion.result, Err(IocbFailure::Timeout { .. })), "{:?}", completion.result);
        assert_eq!(queue.executor().resets(), 1, "one queue-pair reset after the timeout");
        device.set_faults(FaultPlan::none());
        // Poison layer 1 where the read lands, in GPU memory and in the staging buffer the staged
        // copy starts from (it still holds the earlier read's bytes): only a read that really
        // went through the SSD restores them.
        let layer_bytes = LAYER_BYTES as usize;
        let poison = vec![0xA5u8; layer_bytes];
        target.gpu.copy_from_host(layer_bytes, &poison).unwrap();
        gpu_setup::settle_copies(&target.gpu).unwrap();
        target_staging.write(layer_bytes, &poison).unwrap();
        queue.issue_io(&[read], LayerIndex(1), SmBudget(2)).unwrap();
        assert_eq!(queue.wait_cqe(read, deadline()).unwrap().result, Ok(()), "issue after the reset");
        let mut layer_back = vec![0u8; layer_bytes];
        target.gpu.copy_to_host(layer_bytes, &mut layer_back).unwrap();
        assert!(layer_back[..] == data[layer_bytes..2 * layer_bytes], "layer 1 read after the reset differs from what was written");
        assert_no_anomalies(queue.executor(), "after the reset and the next read");
        println!("gpu test: lost completion -> timeout -> queue-pair reset -> next read moved layer 1's bytes");
    }

    pub fn several_iocbs_per_launch_on_a_shallow_queue_with_many_blocks_match_bytes() {
        // Goal: the kernel paths the first pass never reaches hold: slot waits and tail
        // publication under back-pressure (16-entry NVMe queue, 204 commands a launch), several
        // IOCBs and partial 32-IOCTX chunks in one launch, several one-warp blocks submitting
        // and polling at once. Bytes compared, SSD layout checked, no anomaly counted.
        const COUNTS: [u32; 3] = [100, 64, 40];
        let total: u32 = COUNTS.iter().sum();
        let ioctx_bytes = (BLOCKS_PER_IOCTX * BLOCK_BYTES) as usize;
        let bytes = total as usize * ioctx_bytes;
        let runtime = gpu_setup::open_runtime(SmBudget(2)).unwrap();
        let emu = EmuConfig::default()
            .with_backing(Backing::Memory { bytes: 8 << 20 })
            .with_namespaces(vec![NamespaceConfig::new(BLOCK_BYTES, Some(4 << 20))]);
        let emulated = EmulatedController::start(emu).unwrap();
        let controller = &emulated.controller;
        let source = Staging::allocate(controller, bytes, "source").unwrap();
        let target = Staging::allocate(controller, bytes, "target").unwrap();
        let data = pattern(bytes);
        source.gpu.copy_from_host(0, &data).unwrap();
        target.gpu.copy_from_host(0, &vec![0x5Au8; bytes]).unwrap();
        gpu_setup::settle_copies(&target.gpu).unwrap();
        // 2 s before the kernel gives up: 204 commands through 15 usable slots take far less.
        let executor = gpu_setup::staged_executor_with_blocks(runtime, &emulated, 16, &[&source, &target], 200_000, 32).unwrap();
        println!("gpu test (pass 2): grid limits {:?}", executor.grid_limits());
        let registered = gpu_setup::registered(&[&source, &target]).unwrap();
        let mut queue = GioQueue::init_queue(
            QueueConfig { depth: 16, ioctx_per_iocb_max: 128 },
            DeviceTable::new(vec![emulated.device_info()]),
            registered,
            executor,
        )
        .unwrap();
        // IOCTX g (counted over the three IOCBs) moves bytes g × 4 KiB.. to LBA (total − 1 − g) × 8.
        let ioctxs = |staging: &DmaRegion, first: u32, count: u32| -> Vec<IoctxSpec> {
            (first..first + count)
                .map(|g| IoctxSpec {
                    device: DeviceIndex(0),
                    nsid: 1,
                    start_lba: Lba(u64::from(total - 1 - g) * u64::from(BLOCKS_PER_IOCTX)),
                    block_count: BLOCKS_PER_IOCTX,
                    data: staging.iova().checked_add(u64::from(g) * ioctx_bytes as u64).expect("inside the staging buffer"),
                    descriptor: Descriptor::Prp { prp2: None },
                    force_unit_access: false,
                })
                .collect()
        };
        let spec = |opcode| IocbSpec::single(opcode, 0);
        let writes = queue.get_iocb(COUNTS.len(), Dependency::None).unwrap();
        let reads = queue.get_iocb(COUNTS.len(), Dependency::None).unwrap();
        let mut first = 0;
        for ((&write, &read), &count) in writes.iter().zip(&reads).zip(&COUNTS) {
            queue.fill_iocb(write, &spec(Opcode::Write), &ioctxs(&source.host, first, count)).unwrap();
            queue.fill_iocb(read, &spec(Opcode::Read), &ioctxs(&target.host, first, count)).unwrap();
            first += count;
        }
        queue.issue_io(&writes, LayerIndex(0), SmBudget(2)).unwrap();
        for (&write, count) in writes.iter().zip(COUNTS) {
            assert_done(&mut queue, write, &format!("write IOCB of {count} IOCTXs"));
        }
        // The SSD holds IOCTX g at its reversed LBA (a self-consistent wrong mapping cannot pass).
        let namespace = controller.namespaces()[0];
        let mut checking = controller.create_io_queue_pair(16).expect("checking queue pair");
        let scratch = controller.dma().allocate(ioctx_bytes).unwrap();
        let mut on_ssd = vec![0u8; ioctx_bytes];
        for g in 0..total {
            let lba = u64::from(total - 1 - g) * u64::from(BLOCKS_PER_IOCTX);
            let segment = DataSegment::new(scratch.iova(), ioctx_bytes as u32);
            checking.read(namespace.id, Lba(lba), &[segment], Duration::from_secs(5)).unwrap();
            scratch.read(0, &mut on_ssd).unwrap();
            let offset = g as usize * ioctx_bytes;
            assert!(on_ssd[..] == data[offset..offset + ioctx_bytes], "IOCTX {g} at LBA {lba}");
        }
        queue.issue_io(&reads, LayerIndex(0), SmBudget(2)).unwrap();
        for (&read, count) in reads.iter().zip(COUNTS) {
            assert_done(&mut queue, read, &format!("read IOCB of {count} IOCTXs"));
        }
        let mut back = vec![0u8; bytes];
        target.gpu.copy_to_host(0, &mut back).unwrap();
        assert!(back == data, "pass 2: bytes read back into GPU memory differ from the bytes written");
        assert_eq!(queue.executor().kernel_cqe_overflows(), 0, "pass 2: the kernel could not post some CQEs");
        assert_no_anomalies(queue.executor(), "after pass 2");
        println!(
            "gpu test (pass 2): 3 IOCBs ({COUNTS:?} IOCTXs) per launch, 16-entry NVMe queue, 32-thread blocks: {bytes} bytes identical"
        );
    }

    pub fn a_device_table_larger_than_the_queue_pairs_is_refused_at_init() {
        // Goal: the CUDA executor serves gio device i with its queue pair i, and the kernel
        // fails every IOCTX of a device without one as INVALID_IOCTX at each issue, blaming the
        // request for a configuration error: a device table naming more devices than the
        // executor has queue pairs is refused by init_queue (InvalidConfig), as for the CPU
        // executors. STATUS: written without a GPU; it has never run on one.
        let runtime = gpu_setup::open_runtime(SmBudget(1)).unwrap();
        let emu = EmuConfig::default()
            .with_backing(Backing::Memory { bytes: 1 << 20 })
            .with_namespaces(vec![NamespaceConfig::new(BLOCK_BYTES, Some(1 << 20))]);
        let emulated = EmulatedController::start(emu).unwrap();
        let staging = Staging::allocate(&emulated.controller, 64 << 10, "staging").unwrap();
        let executor = gpu_setup::staged_executor(runtime, &emulated, 16, &[&staging], 20_000).unwrap();
        let registered = gpu_setup::registered(&[&staging]).unwrap();
        let devices = DeviceTable::new(vec![emulated.device_info(); 2]);
        let refused = GioQueue::init_queue(QueueConfig { depth: 4, ioctx_per_iocb_max: 4 }, devices, registered, executor);
        assert!(matches!(refused, Err(gio_uring::GioError::InvalidConfig { .. })), "{:?}", refused.err());
        println!("gpu test: a 2-device table over 1 queue pair refused at init");
    }
}
