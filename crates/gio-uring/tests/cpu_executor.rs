//! End to end on the software controller: gio_uring IOCBs executed by the CPU executor through
//! nvme-driver's queue pairs against nvme-emu, with the bytes compared.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::abi::Opcode;
use gio_uring::{
    CpuExecutor, CpuWorkers, Dependency, Descriptor, DeviceIndex, DeviceInfo, DeviceTable, Executor, GioError, GioQueue, IocbFailure,
    IocbId, IoctxSpec, IovaRange, LayerIndex, Lba, QueueConfig, RegisteredMemory, SmBudget,
};
use nvme_driver::hw::{DeviceBackend, DmaRegion};
use nvme_driver::spec::{NvmeStatus as DriverStatus, StatusCodeType};
use nvme_driver::{Controller, ControllerConfig, IoQueuePair};
use nvme_emu::{Backing, EmuConfig, EmuDevice, FaultAction, FaultPlan, FaultRule, NamespaceConfig, QueueFilter};

mod common;

use common::{assert_ssd_layout, layered, pattern, BLOCKS_PER_IOCTX, BLOCK_BYTES, IOCTXS, LAYERS, LAYER_BYTES};

/// Fields drop in order: the queue pairs (inside the executor) must be deleted while the
/// controller is still up, or each drop waits out the admin timeout.
struct Rig<E: Executor = CpuExecutor> {
    queue: GioQueue<E>,
    source: DmaRegion,
    target: DmaRegion,
    controller: Controller,
    device: Arc<EmuDevice>,
}

/// Two filled one-IOCTX Read IOCBs (not issued), the first I/O command the device sees next
/// suffering `fault`.
fn two_reads_the_first_faulted<E: Executor>(rig: &mut Rig<E>, fault: FaultAction) -> (IocbId, IocbId) {
    rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, fault)));
    let ids = rig.queue.get_iocb(2, Dependency::None).unwrap();
    let specs = ioctxs(&rig.target, true, 1);
    rig.queue.fill_iocb(ids[0], &layered(Opcode::Read), &specs[..1]).unwrap();
    rig.queue.fill_iocb(ids[1], &layered(Opcode::Read), &specs[1..2]).unwrap();
    (ids[0], ids[1])
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// A software controller with one namespace, `queue_pairs` I/O queue pairs of depth `nvme_depth`
/// (each its own gio device entry, all on namespace 1), and two DMA buffers of all layers' bytes.
fn rig(sgl: bool, queue_pairs: u16, nvme_depth: u32) -> Rig {
    rig_with(sgl, queue_pairs, nvme_depth, |queues| CpuExecutor::new(queues, 16))
}

fn rig_with<E: Executor>(sgl: bool, queue_pairs: u16, nvme_depth: u32, executor: impl FnOnce(Vec<IoQueuePair>) -> E) -> Rig<E> {
    rig_on_devices(sgl, queue_pairs, queue_pairs, nvme_depth, executor)
}

/// As [`rig_with`], with `gio_devices` gio device entries (all namespace 1 of the one
/// controller) instead of one per queue pair.
fn rig_on_devices<E: Executor>(
    sgl: bool,
    gio_devices: u16,
    queue_pairs: u16,
    nvme_depth: u32,
    executor: impl FnOnce(Vec<IoQueuePair>) -> E,
) -> Rig<E> {
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 8 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(BLOCK_BYTES, Some(4 << 20))])
        .with_sgl(sgl);
    let device = EmuDevice::start(config).expect("software controller");
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Controller::init(backend, ControllerConfig::default()).expect("bring-up");
    let namespace = controller.namespaces()[0];
    let queues: Vec<_> = (0..queue_pairs).map(|_| controller.create_io_queue_pair(nvme_depth).expect("I/O queue pair")).collect();
    let dma = controller.dma();
    let bytes = (LAYER_BYTES * u64::from(LAYERS)) as usize;
    let source = dma.allocate(bytes).unwrap();
    let target = dma.allocate(bytes).unwrap();
    let info = DeviceInfo {
        nsid: namespace.id.0,
        capacity_blocks: namespace.size_blocks,
        block_bytes: namespace.block_size_bytes,
        sgl_supported: sgl,
    };
    let devices = DeviceTable::new(vec![info; usize::from(gio_devices)]);
    let registered =
        RegisteredMemory::new([&source, &target].iter().map(|region| IovaRange::new(region.iova(), region.len() as u64)).collect())
            .unwrap();
    let executor = executor(queues);
    let queue = GioQueue::init_queue(QueueConfig { depth: 16, ioctx_per_iocb_max: 2048 }, devices, registered, executor).unwrap();
    Rig { queue, source, target, controller, device }
}

/// IOCTX `i` moves KV block `i` of layer 0 (the layer rule reaches the others); consecutive
/// IOCTXs alternate over the devices, and the LBA order is reversed to show the mapping is free.
fn ioctxs(region: &DmaRegion, sgl: bool, devices: u16) -> Vec<IoctxSpec> {
    let block_bytes = u64::from(BLOCKS_PER_IOCTX * BLOCK_BYTES);
    (0..IOCTXS)
        .map(|i| IoctxSpec {
            device: DeviceIndex((i % u32::from(devices)) as u16),
            nsid: 1,
            start_lba: Lba(u64::from(IOCTXS - 1 - i) * u64::from(BLOCKS_PER_IOCTX)),
            block_count: BLOCKS_PER_IOCTX,
            data: region.iova().checked_add(u64::from(i) * block_bytes).expect("inside the region"),
            descriptor: if sgl { Descriptor::SglInline } else { Descriptor::Prp { prp2: None } },
            force_unit_access: false,
        })
        .collect()
}

/// Writes every layer from `source`, reads every layer back into `target`, one issue per layer.
fn round_trip<E: Executor>(rig: &mut Rig<E>, sgl: bool, devices: u16) {
    let bytes = rig.source.len();
    let data = pattern(bytes);
    rig.source.write(0, &data).unwrap();
    let ids = rig.queue.get_iocb(2, Dependency::None).unwrap();
    let (write, read) = (ids[0], ids[1]);
    rig.queue.fill_iocb(write, &layered(Opcode::Write), &ioctxs(&rig.source, sgl, devices)).unwrap();
    rig.queue.fill_iocb(read, &layered(Opcode::Read), &ioctxs(&rig.target, sgl, devices)).unwrap();
    for layer in 0..LAYERS {
        rig.queue.issue_io(&[write], LayerIndex(layer), SmBudget(1)).unwrap();
        assert_eq!(rig.queue.wait_cqe(write, deadline()).unwrap().result, Ok(()), "write layer {layer}");
    }
    assert_ssd_layout(&rig.controller, &data);
    for layer in 0..LAYERS {
        rig.queue.issue_io(&[read], LayerIndex(layer), SmBudget(1)).unwrap();
        let completion = rig.queue.wait_cqe(read, deadline()).unwrap();
        assert_eq!((completion.result, completion.layer), (Ok(()), LayerIndex(layer)), "read layer {layer}");
    }
    let mut back = vec![0u8; bytes];
    rig.target.read(0, &mut back).unwrap();
    assert!(back == data, "bytes read back differ from bytes written");
}

#[test]
fn layers_written_and_read_back_byte_identical_with_prp() {
    let mut rig = rig(false, 1, 64);
    round_trip(&mut rig, false, 1);
}

#[test]
fn layers_written_and_read_back_byte_identical_with_sgl_over_two_queue_pairs() {
    // Depth 8 per NVMe queue: 40 IOCTXs per layer exercise the executor's back-pressure path.
    let mut rig = rig(true, 2, 8);
    round_trip(&mut rig, true, 2);
}

#[test]
fn a_device_error_fails_the_iocb_with_its_nvme_status_and_the_queue_recovers() {
    let mut rig = rig(true, 1, 64);
    let media = DriverStatus::new(StatusCodeType::from_u8(2), 0x81);
    // The 5th I/O command fails: IOCTX 4 of the first issue.
    rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(5, FaultAction::Status(media))));
    let id = rig.queue.get_iocb(1, Dependency::None).unwrap()[0];
    rig.queue.fill_iocb(id, &layered(Opcode::Read), &ioctxs(&rig.target, true, 1)).unwrap();
    rig.queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).unwrap();
    let completion = rig.queue.wait_cqe(id, deadline()).unwrap();
    match completion.result {
        Err(IocbFailure::Nvme { ioctx_index: 4, status }) => {
            assert_eq!((status.status_code_type(), status.status_code()), (2, 0x81), "{status}");
        }
        other => panic!("expected IOCTX 4 to fail with a media error, got {other:?}"),
    }
    rig.queue.issue_io(&[id], LayerIndex(1), SmBudget(1)).unwrap();
    assert_eq!(rig.queue.wait_cqe(id, deadline()).unwrap().result, Ok(()));
}

#[test]
fn a_lost_completion_is_a_bounded_wait_not_a_hang() {
    let mut rig = rig(true, 1, 64);
    rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, FaultAction::DropCompletion)));
    let id = rig.queue.get_iocb(1, Dependency::None).unwrap()[0];
    rig.queue.fill_iocb(id, &layered(Opcode::Read), &ioctxs(&rig.target, true, 1)[..1]).unwrap();
    rig.queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).unwrap();
    let started = Instant::now();
    let result = rig.queue.wait_cqe(id, Instant::now() + Duration::from_millis(200));
    assert!(matches!(result, Err(GioError::WaitTimeout { id: IocbId(_), .. })), "{result:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_lost_completion_is_reclaimed_by_resetting_the_queue_pair_and_the_iocb_reissued() {
    // Goal: after wait_cqe timed out on a completion the device dropped, replacing the queue pair
    // finishes the IOCB as a timeout (one completion), and the IOCB then reads the right bytes.
    let mut rig = rig(true, 1, 64);
    let data = pattern(rig.source.len());
    rig.target.write(0, &data).unwrap();
    let write = rig.queue.get_iocb(1, Dependency::None).unwrap()[0];
    rig.queue.fill_iocb(write, &layered(Opcode::Write), &ioctxs(&rig.target, true, 1)).unwrap();
    rig.queue.issue_io(&[write], LayerIndex(0), SmBudget(1)).unwrap();
    assert_eq!(rig.queue.wait_cqe(write, deadline()).unwrap().result, Ok(()));
    rig.target.fill(0, rig.target.len(), 0).unwrap();
    rig.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(3, FaultAction::DropCompletion)));
    let read = rig.queue.get_iocb(1, Dependency::None).unwrap()[0];
    rig.queue.fill_iocb(read, &layered(Opcode::Read), &ioctxs(&rig.target, true, 1)).unwrap();
    rig.queue.issue_io(&[read], LayerIndex(0), SmBudget(1)).unwrap();
    let result = rig.queue.wait_cqe(read, Instant::now() + Duration::from_millis(200));
    assert!(matches!(result, Err(GioError::WaitTimeout { .. })), "{result:?}");
    // A controller that refuses to delete the old submission queue: its commands may still
    // move data, so nothing is reclaimed and the reset says so.
    let refuse_delete = FaultRule {
        nth: 1,
        queue: QueueFilter::Admin,
        opcode: Some(0x00),
        action: FaultAction::Status(DriverStatus::generic(nvme_driver::spec::status::codes::INTERNAL_ERROR)),
        repeat: false,
    };
    let delete_sq_commands = |device: &EmuDevice| device.stats().admin_commands.get(&0x00).copied().unwrap_or(0);
    let deletes_before = delete_sq_commands(&rig.device);
    // The first two Delete I/O SQ commands fail.
    rig.device.set_faults(FaultPlan::none().with_rule(refuse_delete).with_rule(FaultRule { nth: 2, ..refuse_delete }));
    let fresh = rig.controller.create_io_queue_pair(64).unwrap();
    let (executor, memory) = rig.queue.executor_and_memory();
    let refused = executor.reset(memory, vec![fresh]);
    assert!(matches!(&refused, Err(GioError::Nvme { context, .. }) if context.contains("the controller is reset")), "{refused:?}");
    let still = rig.queue.wait_cqe(read, Instant::now() + Duration::from_millis(50));
    assert!(matches!(still, Err(GioError::WaitTimeout { .. })), "not reclaimed while the old queue may run: {still:?}");
    // The next reset retries the pair the failed one kept; refused again, still nothing is
    // reclaimed (even though the pair the first reset installed deletes fine).
    let fresh = rig.controller.create_io_queue_pair(64).unwrap();
    let (executor, memory) = rig.queue.executor_and_memory();
    assert!(executor.reset(memory, vec![fresh]).is_err(), "the kept pair is still undeleted");
    let still = rig.queue.wait_cqe(read, Instant::now() + Duration::from_millis(50));
    assert!(matches!(still, Err(GioError::WaitTimeout { .. })), "not reclaimed while the old queue may run: {still:?}");
    // The controller answers now: the kept pair is deleted, then the replaced one, and only
    // then is the IOCB reclaimed.
    let fresh = rig.controller.create_io_queue_pair(64).unwrap();
    let (executor, memory) = rig.queue.executor_and_memory();
    assert_eq!(executor.reset(memory, vec![fresh]).unwrap(), 1, "the one IOCB in flight is reclaimed");
    assert_eq!(delete_sq_commands(&rig.device) - deletes_before, 5, "refused twice, then the kept pair and two replaced ones");
    let reclaimed = rig.queue.wait_cqe(read, deadline()).unwrap();
    assert!(matches!(reclaimed.result, Err(IocbFailure::Timeout { .. })), "{:?}", reclaimed.result);
    let (executor, memory) = rig.queue.executor_and_memory();
    assert!(matches!(executor.reset(memory, Vec::new()), Err(GioError::InvalidConfig { .. })), "one fresh pair per device");
    rig.queue.issue_io(&[read], LayerIndex(0), SmBudget(1)).unwrap();
    assert_eq!(rig.queue.wait_cqe(read, deadline()).unwrap().result, Ok(()), "reissued on the fresh queue pair");
    let mut back = vec![0u8; LAYER_BYTES as usize];
    rig.target.read(0, &mut back).unwrap();
    assert!(back[..] == data[..LAYER_BYTES as usize], "layer 0 read back after the reset");
}

#[test]
fn an_event_dependency_the_cpu_executor_cannot_wait_on_is_refused_before_anything_is_issued() {
    let mut rig = rig(true, 1, 64);
    let id = rig.queue.get_iocb(1, Dependency::Event(gio_uring::EventToken(7))).unwrap()[0];
    rig.queue.fill_iocb(id, &layered(Opcode::Read), &ioctxs(&rig.target, true, 1)).unwrap();
    let result = rig.queue.issue_io(&[id], LayerIndex(0), SmBudget(1));
    assert!(matches!(result, Err(GioError::Unsupported { .. })), "{result:?}");
    assert!(rig.device.stats().io_commands.is_empty(), "no command reached the controller");
}

#[test]
fn two_worker_threads_share_iocbs_and_move_the_same_bytes() {
    // Goal: IOCTXs of one IOCB alternate between two devices owned by two worker threads; the
    // shared completion counter lets whichever finishes last post the single CQE.
    let mut rig = rig_with(true, 2, 8, |queues| {
        let workers = queues.into_iter().enumerate().map(|(device, queue)| vec![(DeviceIndex(device as u16), queue)]).collect();
        CpuWorkers::new(2, workers, 16).unwrap()
    });
    round_trip(&mut rig, true, 2);
}

#[test]
fn the_sm_budget_sets_how_many_worker_threads_take_a_layer() {
    // Goal: four worker threads, each with a queue pair of its own on the one device: a layer
    // issued on SM budget b goes through exactly min(b, 4) of those queue pairs (one per worker
    // thread; the others idle), the bytes are right whichever threads moved them, and a reset
    // replaces every worker's pair.
    const WORKERS: u16 = 4;
    let mut rig = rig_on_devices(true, 1, WORKERS, 64, |queues| {
        let workers = queues.into_iter().map(|queue| vec![(DeviceIndex(0), queue)]).collect();
        CpuWorkers::new(1, workers, 16).unwrap()
    });
    let data = pattern(rig.source.len());
    rig.source.write(0, &data).unwrap();
    let ids = rig.queue.get_iocb(2, Dependency::None).unwrap();
    let (write, read) = (ids[0], ids[1]);
    rig.queue.fill_iocb(write, &layered(Opcode::Write), &ioctxs(&rig.source, true, 1)).unwrap();
    rig.queue.fill_iocb(read, &layered(Opcode::Read), &ioctxs(&rig.target, true, 1)).unwrap();
    // I/O queue ids 1..=WORKERS, one per worker, in creation order.
    let per_queue = |rig: &Rig<CpuWorkers>| (1..=WORKERS).map(|queue| rig.device.stats().commands_on_queue(queue)).collect::<Vec<_>>();
    let issue = |rig: &mut Rig<CpuWorkers>, id: IocbId, layer: u32, budget: u32| {
        let before = per_queue(rig);
        rig.queue.issue_io(&[id], LayerIndex(layer), SmBudget(budget)).unwrap();
        assert_eq!(rig.queue.wait_cqe(id, deadline()).unwrap().result, Ok(()), "layer {layer}, budget {budget}");
        let used: Vec<u64> = per_queue(rig).iter().zip(&before).map(|(after, before)| after - before).collect();
        assert_eq!(used.iter().sum::<u64>(), u64::from(IOCTXS), "every IOCTX is one command: {used:?}");
        used.iter().filter(|&&commands| commands > 0).count() as u32
    };
    for (layer, budget) in [(0, 1), (1, 2), (2, 3), (3, 8)] {
        assert_eq!(issue(&mut rig, write, layer, budget), budget.min(u32::from(WORKERS)), "write layer {layer}, budget {budget}");
    }
    assert_ssd_layout(&rig.controller, &data);
    {
        let served = gio_uring::QueuePairReset::served_queue_depths(rig.queue.executor());
        assert_eq!(served, vec![(0, 64); usize::from(WORKERS)], "one entry per worker's queue pair");
        let fresh = (0..WORKERS).map(|_| rig.controller.create_io_queue_pair(64).unwrap()).collect();
        let (executor, memory) = rig.queue.executor_and_memory();
        assert_eq!(gio_uring::QueuePairReset::reset(executor, memory, fresh).unwrap(), 0, "nothing was in flight");
    }
    let replaced =
        |rig: &Rig<CpuWorkers>| (WORKERS + 1..=2 * WORKERS).map(|queue| rig.device.stats().commands_on_queue(queue)).sum::<u64>();
    for (layer, budget) in [(0, 4), (1, 1), (2, 2), (3, 4)] {
        let before = replaced(&rig);
        rig.queue.issue_io(&[read], LayerIndex(layer), SmBudget(budget)).unwrap();
        assert_eq!(rig.queue.wait_cqe(read, deadline()).unwrap().result, Ok(()), "read layer {layer}, budget {budget}");
        assert_eq!(replaced(&rig) - before, u64::from(IOCTXS), "the reads went through the fresh queue pairs");
    }
    let mut back = vec![0u8; data.len()];
    rig.target.read(0, &mut back).unwrap();
    assert!(back == data, "bytes read back differ from bytes written");
}

#[test]
fn a_worker_with_two_queue_pairs_on_one_device_is_a_configuration_error() {
    let _rig = rig_on_devices(true, 1, 3, 8, |mut queues| {
        let kept = queues.pop().expect("three queue pairs");
        let doubled = vec![queues.into_iter().map(|queue| (DeviceIndex(0), queue)).collect()];
        assert!(matches!(CpuWorkers::new(1, doubled, 16), Err(GioError::InvalidConfig { .. })));
        CpuWorkers::new(1, vec![vec![(DeviceIndex(0), kept)]], 16).unwrap()
    });
}

#[test]
fn a_device_without_a_worker_is_a_configuration_error() {
    assert!(matches!(CpuWorkers::new(2, vec![vec![], vec![]], 16), Err(GioError::InvalidConfig { .. })));
}

#[test]
fn a_lent_queue_pair_is_emptied_first_and_serves_the_borrowers_commands() {
    // Goal: a caller can borrow the CPU executor's queue pair between issues (an object store's
    // metadata on a controller with one I/O queue pair): the executor first reaps its own
    // commands in flight (their CQE is posted as usual), the borrower's synchronous commands
    // run on the idle queue, and the executor's IOCTXs not yet submitted go out on the next
    // poll. A borrower's completion that arrives late is an executor error, never counted
    // for an IOCTX. Executors whose queue pairs live on other threads do not lend.
    let mut rig = rig(true, 1, 8); // depth 8: most of the 40 IOCTXs wait for room
    let data = pattern(rig.source.len());
    rig.source.write(0, &data).unwrap();
    let id = rig.queue.get_iocb(1, Dependency::None).unwrap()[0];
    rig.queue.fill_iocb(id, &layered(Opcode::Write), &ioctxs(&rig.source, true, 1)).unwrap();
    rig.queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).unwrap();
    let namespace = rig.controller.namespaces()[0];
    let scratch = rig.controller.dma().allocate(BLOCK_BYTES as usize).unwrap();
    scratch.fill(0, BLOCK_BYTES as usize, 0xA5).unwrap();
    let far = nvme_driver::Lba(namespace.size_blocks - 1);
    let segment = [nvme_driver::DataSegment::new(scratch.iova(), BLOCK_BYTES)];
    {
        let (executor, memory) = rig.queue.executor_and_memory();
        executor.poll(memory).unwrap(); // the first 7 IOCTXs go to the device
        let queue = executor.lend_queue_pair(memory, 0, deadline()).unwrap().expect("the CPU executor lends");
        assert_eq!(queue.in_flight(), 0, "lent idle");
        queue.submit_write(namespace.id, far, &segment, true, gio_uring::LENT_COMMAND_TAG).unwrap();
        queue.complete_all(Duration::from_secs(10)).unwrap();
        assert!(executor.lend_queue_pair(memory, 1, deadline()).unwrap().is_none(), "no such device");
    }
    assert_eq!(rig.queue.wait_cqe(id, deadline()).unwrap().result, Ok(()), "the executor's IOCB completes");
    let mut back = vec![0u8; BLOCK_BYTES as usize];
    scratch.fill(0, BLOCK_BYTES as usize, 0).unwrap();
    {
        let (executor, memory) = rig.queue.executor_and_memory();
        let queue = executor.lend_queue_pair(memory, 0, deadline()).unwrap().unwrap();
        queue.submit_read(namespace.id, far, &segment, gio_uring::LENT_COMMAND_TAG).unwrap();
        queue.complete_all(Duration::from_secs(10)).unwrap();
        scratch.read(0, &mut back).unwrap();
        assert!(back.iter().all(|&byte| byte == 0xA5), "the borrower's write reached the disk");
        // A borrower that breaks the contract: a command left in flight.
        queue.submit_read(namespace.id, far, &segment, gio_uring::LENT_COMMAND_TAG).unwrap();
        queue.ring_doorbell().unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    rig.queue.issue_io(&[id], LayerIndex(1), SmBudget(1)).unwrap();
    let stray = rig.queue.wait_cqe(id, deadline());
    assert!(matches!(&stray, Err(GioError::Executor { reason, .. }) if reason.contains("borrower's command")), "{stray:?}");

    let mut workers = rig_with(true, 1, 8, |queues| {
        let workers = queues.into_iter().map(|queue| vec![(DeviceIndex(0), queue)]).collect();
        CpuWorkers::new(1, workers, 16).unwrap()
    });
    let (executor, memory) = workers.queue.executor_and_memory();
    assert!(executor.lend_queue_pair(memory, 0, deadline()).unwrap().is_none(), "worker threads own their queue pairs");
}

#[test]
fn cpu_workers_report_a_queue_pair_they_could_not_delete_at_teardown() {
    // Goal: teardown has every worker delete its own queue pairs and answers Some(false) when a
    // controller refuses one (its commands may still move data, so the caller must keep the
    // memory they name; None would let it free that memory), then Some(true) once a later call
    // deleted the pair the worker kept.
    let mut rig = rig_with(true, 2, 8, |queues| {
        let workers = queues.into_iter().enumerate().map(|(device, queue)| vec![(DeviceIndex(device as u16), queue)]).collect();
        CpuWorkers::new(2, workers, 16).unwrap()
    });
    round_trip(&mut rig, true, 2);
    let refuse_delete = FaultRule::on_nth_admin(
        1,
        nvme_driver::spec::AdminOpcode::DeleteIoSubmissionQueue,
        FaultAction::Status(DriverStatus::generic(nvme_driver::spec::status::codes::INTERNAL_ERROR)),
    );
    rig.device.set_faults(FaultPlan::none().with_rule(refuse_delete));
    assert_eq!(rig.queue.executor_mut().retire_queue_pairs(), Some(false), "a refused Delete I/O SQ is reported");
    rig.device.set_faults(FaultPlan::none());
    assert_eq!(rig.queue.executor_mut().retire_queue_pairs(), Some(true), "the kept pair is deleted by the retry");
}

#[test]
fn a_worker_error_from_a_bad_completion_is_reported_once_and_later_io_succeeds() {
    // Goal: a completion with a command id that was never issued is a worker error, reported by
    // one wait like the CPU executor's, not by every later poll: another IOCB then completes
    // normally, and a reset reclaims the IOCB whose real completion never came.
    let mut rig = rig_with(true, 1, 64, |queues| {
        let workers = queues.into_iter().map(|queue| vec![(DeviceIndex(0), queue)]).collect();
        CpuWorkers::new(1, workers, 16).unwrap()
    });
    let (lost, later) = two_reads_the_first_faulted(&mut rig, FaultAction::CorruptCommandId);
    rig.queue.issue_io(&[lost], LayerIndex(0), SmBudget(1)).unwrap();
    let failed = rig.queue.wait_cqe(lost, deadline());
    assert!(matches!(&failed, Err(GioError::Executor { executor: "cpu-workers", .. })), "{failed:?}");
    rig.queue.issue_io(&[later], LayerIndex(0), SmBudget(1)).unwrap();
    assert_eq!(rig.queue.wait_cqe(later, deadline()).unwrap().result, Ok(()), "the error was reported once, not forever");
    let fresh = rig.controller.create_io_queue_pair(64).unwrap();
    let (executor, memory) = rig.queue.executor_and_memory();
    assert_eq!(gio_uring::QueuePairReset::reset(executor, memory, vec![fresh]).unwrap(), 1, "the IOCB whose completion was lost");
    assert!(matches!(rig.queue.wait_cqe(lost, deadline()).unwrap().result, Err(IocbFailure::Timeout { .. })));
    rig.queue.issue_io(&[lost, later], LayerIndex(1), SmBudget(1)).unwrap();
    for id in [lost, later] {
        assert_eq!(rig.queue.wait_cqe(id, deadline()).unwrap().result, Ok(()), "{id} after the reset");
    }
}

#[test]
fn a_queue_pair_failed_by_a_completion_is_reported_once_then_waits_time_out_and_a_reset_recovers() {
    // Goal: a completion naming another SQ fails the NVMe queue pair (nvme-driver: the command it
    // names has an unknown outcome). The executor reports that once; later IOCBs for the device
    // are held back, so their wait times out (the signal every caller recovers on) instead of
    // failing on every poll; a reset deletes the pair, ends both IOCBs as TIMEOUT, and the next
    // issue on the fresh pair succeeds. Before, every later poll failed with QueueFailed and no
    // wait ever timed out.
    let mut rig = rig(true, 1, 64);
    let (garbled, held) = two_reads_the_first_faulted(&mut rig, FaultAction::WrongSubmissionQueueId);
    rig.queue.issue_io(&[garbled], LayerIndex(0), SmBudget(1)).unwrap();
    let failed = rig.queue.wait_cqe(garbled, deadline());
    assert!(matches!(&failed, Err(GioError::Executor { executor: "cpu", .. })), "{failed:?}");
    rig.queue.issue_io(&[held], LayerIndex(0), SmBudget(1)).unwrap();
    let waited = rig.queue.wait_cqe(held, Instant::now() + Duration::from_millis(300));
    assert!(matches!(waited, Err(GioError::WaitTimeout { .. })), "held back until a reset, not failed on every poll: {waited:?}");
    rig.device.set_faults(FaultPlan::none());
    let fresh = rig.controller.create_io_queue_pair(64).unwrap();
    let (executor, memory) = rig.queue.executor_and_memory();
    assert_eq!(
        gio_uring::QueuePairReset::reset(executor, memory, vec![fresh]).unwrap(),
        2,
        "both IOCBs reclaimed once the failed pair is deleted"
    );
    for id in [garbled, held] {
        assert!(matches!(rig.queue.wait_cqe(id, deadline()).unwrap().result, Err(IocbFailure::Timeout { .. })), "{id}");
    }
    rig.queue.issue_io(&[garbled, held], LayerIndex(1), SmBudget(1)).unwrap();
    for id in [garbled, held] {
        assert_eq!(rig.queue.wait_cqe(id, deadline()).unwrap().result, Ok(()), "{id} on the fresh pair");
    }
}

/// Controllers A and B (software, one DMA space, SGL), a buffer of one layer in it, the device
/// entry both serve and the buffer registered: the set-up of the two-device tests below.
struct TwoControllers {
    controller_a: Controller,
    controller_b: Controller,
    buffer: DmaRegion,
    info: DeviceInfo,
    registered: RegisteredMemory,
    /// Kept while the controllers are used.
    _devices: (Arc<EmuDevice>, Arc<EmuDevice>),
}

fn two_controllers() -> TwoControllers {
    let config = || {
        EmuConfig::default()
            .with_backing(Backing::Memory { bytes: 8 << 20 })
            .with_namespaces(vec![NamespaceConfig::new(BLOCK_BYTES, Some(4 << 20))])
            .with_sgl(true)
    };
    let device_a = EmuDevice::start(config()).expect("controller A");
    let device_b = EmuDevice::start_in(config(), &device_a.dma_pool()).expect("controller B, same DMA space");
    let controller_a = Controller::init(device_a.clone() as Arc<dyn DeviceBackend>, ControllerConfig::default()).expect("A up");
    let controller_b = Controller::init(device_b.clone() as Arc<dyn DeviceBackend>, ControllerConfig::default()).expect("B up");
    let buffer = controller_a.dma().allocate(LAYER_BYTES as usize).unwrap();
    let namespace = controller_a.namespaces()[0];
    let info = DeviceInfo { nsid: namespace.id.0, capacity_blocks: namespace.size_blocks, block_bytes: BLOCK_BYTES, sgl_supported: true };
    let registered = RegisteredMemory::new(vec![IovaRange::new(buffer.iova(), buffer.len() as u64)]).unwrap();
    TwoControllers { controller_a, controller_b, buffer, info, registered, _devices: (device_a, device_b) }
}

/// Two single-layer Read IOCBs of 4 IOCTXs into `buffer`: one on device 0 (A), one on device 1 (B).
fn one_read_on_each<E: Executor>(queue: &mut GioQueue<E>, buffer: &DmaRegion) -> (IocbId, IocbId) {
    let ids = queue.get_iocb(2, Dependency::None).unwrap();
    let on_device = |device: u16| -> Vec<IoctxSpec> {
        ioctxs(buffer, true, 1).into_iter().take(4).map(|spec| IoctxSpec { device: DeviceIndex(device), ..spec }).collect()
    };
    let single = gio_uring::IocbSpec::single(Opcode::Read, 0);
    queue.fill_iocb(ids[0], &single, &on_device(0)).unwrap();
    queue.fill_iocb(ids[1], &single, &on_device(1)).unwrap();
    (ids[0], ids[1])
}

#[test]
fn a_controller_reset_on_one_device_holds_back_only_that_devices_iocbs() {
    // Goal: after controller A is reset, A's queue pair is stale (every reap says so). That is
    // reported once, and from then on only IOCTXs for A are held back (in place, for the
    // caller's reset): an IOCB on controller B, issued behind one on A, completes. Before, every
    // poll failed at A's reap, B was never reaped, and the IOCB on A held back every later one.
    let TwoControllers { mut controller_a, controller_b, buffer, info, registered, _devices } = two_controllers();
    let executor =
        CpuExecutor::new(vec![controller_a.create_io_queue_pair(64).unwrap(), controller_b.create_io_queue_pair(64).unwrap()], 16);
    let mut queue =
        GioQueue::init_queue(QueueConfig { depth: 16, ioctx_per_iocb_max: 64 }, DeviceTable::new(vec![info; 2]), registered, executor)
            .unwrap();
    let (on_a, on_b) = one_read_on_each(&mut queue, &buffer);
    controller_a.reset(false).expect("controller A reset");
    queue.issue_io(&[on_a], LayerIndex(0), SmBudget(1)).unwrap();
    queue.issue_io(&[on_b], LayerIndex(0), SmBudget(1)).unwrap();
    let reported = queue.wait_cqe(on_b, deadline());
    assert!(matches!(&reported, Err(GioError::Executor { executor: "cpu", reason }) if reason.contains("device 0")), "{reported:?}");
    assert_eq!(queue.wait_cqe(on_b, deadline()).expect("reported once").result, Ok(()), "B's IOCB completes");
    let held = queue.wait_cqe(on_a, Instant::now() + Duration::from_millis(200));
    assert!(matches!(held, Err(GioError::WaitTimeout { .. })), "A's IOCB waits for a reset: {held:?}");
    let fresh = vec![controller_a.create_io_queue_pair(64).unwrap(), controller_b.create_io_queue_pair(64).unwrap()];
    let (executor, memory) = queue.executor_and_memory();
    assert_eq!(executor.reset(memory, fresh).expect("reset"), 1, "A's IOCB is reclaimed");
    assert!(matches!(queue.wait_cqe(on_a, deadline()).unwrap().result, Err(IocbFailure::Timeout { .. })));
    queue.issue_io(&[on_a, on_b], LayerIndex(0), SmBudget(1)).unwrap();
    for id in [on_a, on_b] {
        assert_eq!(queue.wait_cqe(id, deadline()).unwrap().result, Ok(()), "{id} on the fresh pairs");
    }
}

#[test]
fn a_worker_holding_one_stale_devices_work_beside_an_idle_device_waits_instead_of_spinning() {
    // Goal: one worker serves controllers A and B; A is reset, so the IOCB on A is held for the
    // caller's reset. B's pair is usable but has nothing to do: the worker waits for a message
    // (it spun, because IOCTXs were pending while a usable pair existed), and B's later work and
    // the reset still reach it at once.
    let TwoControllers { mut controller_a, controller_b, buffer, info, registered, _devices } = two_controllers();
    let pairs = vec![
        (DeviceIndex(0), controller_a.create_io_queue_pair(64).unwrap()),
        (DeviceIndex(1), controller_b.create_io_queue_pair(64).unwrap()),
    ];
    let executor = CpuWorkers::new(2, vec![pairs], 16).unwrap();
    // The workers start when the queue attaches its executor.
    let (mut queue, workers) = new_workers(|| {
        GioQueue::init_queue(QueueConfig { depth: 16, ioctx_per_iocb_max: 64 }, DeviceTable::new(vec![info; 2]), registered, executor)
            .unwrap()
    });
    let (on_a, on_b) = one_read_on_each(&mut queue, &buffer);
    controller_a.reset(false).expect("controller A reset");
    queue.issue_io(&[on_a], LayerIndex(0), SmBudget(1)).unwrap();
    let held = queue.wait_cqe(on_a, Instant::now() + Duration::from_millis(200));
    assert!(held.is_err(), "A's IOCB waits for a reset (the stale pair reported once): {held:?}");
    let share = least_cpu_share(&workers);
    assert!(share < 0.2, "the held worker used {:.0}% of a core", share * 100.0);
    queue.issue_io(&[on_b], LayerIndex(0), SmBudget(1)).unwrap();
    assert_eq!(queue.wait_cqe(on_b, deadline()).unwrap().result, Ok(()), "B's IOCB completes while A's is held");
    let fresh = vec![controller_a.create_io_queue_pair(64).unwrap(), controller_b.create_io_queue_pair(64).unwrap()];
    let (executor, memory) = queue.executor_and_memory();
    assert_eq!(gio_uring::QueuePairReset::reset(executor, memory, fresh).expect("reset"), 1, "A's IOCB is reclaimed");
    assert!(matches!(queue.wait_cqe(on_a, deadline()).unwrap().result, Err(IocbFailure::Timeout { .. })));
    queue.issue_io(&[on_a], LayerIndex(0), SmBudget(1)).unwrap();
    assert_eq!(queue.wait_cqe(on_a, deadline()).unwrap().result, Ok(()), "the fresh pair serves A");
}

#[test]
fn an_issue_after_the_queue_pairs_were_retired_ends_at_once() {
    // Goal: after teardown deleted the queue pairs, an issue cannot run: it is refused with a
    // typed error and each IOCB ends at once with its one CQE, for both CPU executors, rather
    // than waiting forever for a device no executor serves.
    fn check<E: Executor>(mut rig: Rig<E>) {
        let id = rig.queue.get_iocb(1, Dependency::None).unwrap()[0];
        rig.queue.fill_iocb(id, &layered(Opcode::Read), &ioctxs(&rig.target, true, 1)).unwrap();
        assert_eq!(rig.queue.executor_mut().retire_queue_pairs(), Some(true));
        let issued = rig.queue.issue_io(&[id], LayerIndex(0), SmBudget(1));
        let name = rig.queue.executor().name();
        assert!(
            matches!(&issued, Err(GioError::SubmitFailed { source, .. }) if matches!(**source, GioError::QueuePairsRetired { .. })),
            "{name}: {issued:?}"
        );
        let ended = rig.queue.wait_cqe(id, Instant::now() + Duration::from_secs(1)).expect("ended at once");
        assert!(matches!(ended.result, Err(IocbFailure::Timeout { .. })), "{name}: {:?}", ended.result);
    }
    check(rig(true, 1, 64));
    check(rig_with(true, 1, 64, |queues| {
        let workers = queues.into_iter().map(|queue| vec![(DeviceIndex(0), queue)]).collect();
        CpuWorkers::new(1, workers, 16).unwrap()
    }));
}

/// This process's threads named `name` (their TIDs).
fn threads_named(name: &str) -> Vec<u32> {
    let mut tids = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
        let task = entry.expect("task").path();
        if std::fs::read_to_string(task.join("comm")).is_ok_and(|comm| comm.trim() == name) {
            tids.extend(task.file_name().and_then(|tid| tid.to_str()?.parse::<u32>().ok()));
        }
    }
    tids
}

/// CPU time (user + system, clock ticks) of this process's thread `tid`, while it lives.
fn cpu_ticks_of(tid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// The worker threads named `gio-cpu-0` that `start` creates: those not there before it. Tests
/// of this binary run in parallel and start workers of the same name, so a thread started by
/// another test at the same moment may be among them.
fn new_workers<T>(start: impl FnOnce() -> T) -> (T, Vec<u32>) {
    let before = threads_named("gio-cpu-0");
    let started = start();
    // A thread names itself once it runs: look for a while.
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let workers: Vec<u32> = threads_named("gio-cpu-0").into_iter().filter(|tid| !before.contains(tid)).collect();
        if !workers.is_empty() {
            return (started, workers);
        }
        assert!(Instant::now() < until, "no new gio-cpu-0 thread");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The least share of a core any of `workers` used over half a second (ticks are USER_HZ,
/// which the kernel's ABI fixes at 100 a second). The least: another test's worker among them
/// may be busy, but this test's own worker is one of them.
fn least_cpu_share(workers: &[u32]) -> f64 {
    let before: Vec<Option<u64>> = workers.iter().map(|&tid| cpu_ticks_of(tid)).collect();
    let watched = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    let seconds = watched.elapsed().as_secs_f64();
    workers
        .iter()
        .zip(before)
        .filter_map(|(&tid, before)| Some(cpu_ticks_of(tid)?.saturating_sub(before?) as f64 / 100.0 / seconds))
        .fold(f64::INFINITY, f64::min)
}

#[test]
fn a_worker_whose_only_pair_is_stale_waits_for_the_reset_instead_of_spinning() {
    // Goal: a worker whose queue pair went stale (its controller was reset) holds the IOCB's
    // IOCTXs until the caller's reset; meanwhile it waits for a message rather than spinning
    // (it burnt a core until the reset came), and the reset still reaches it at once.
    let (mut rig, workers) = new_workers(|| {
        rig_with(true, 1, 64, |queues| {
            let workers = queues.into_iter().map(|queue| vec![(DeviceIndex(0), queue)]).collect();
            CpuWorkers::new(1, workers, 16).unwrap()
        })
    });
    let id = rig.queue.get_iocb(1, Dependency::None).unwrap()[0];
    rig.queue.fill_iocb(id, &layered(Opcode::Read), &ioctxs(&rig.target, true, 1)[..1]).unwrap();
    rig.controller.reset(false).expect("controller reset");
    rig.queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).unwrap();
    let held = rig.queue.wait_cqe(id, Instant::now() + Duration::from_millis(200));
    assert!(held.is_err(), "the IOCB waits for a reset (the stale pair reported once): {held:?}");
    let share = least_cpu_share(&workers);
    assert!(share < 0.2, "the held worker used {:.0}% of a core", share * 100.0);
    let fresh = vec![rig.controller.create_io_queue_pair(64).unwrap()];
    let (executor, memory) = rig.queue.executor_and_memory();
    assert_eq!(gio_uring::QueuePairReset::reset(executor, memory, fresh).expect("reset"), 1, "the held IOCB is reclaimed");
    assert!(matches!(rig.queue.wait_cqe(id, deadline()).unwrap().result, Err(IocbFailure::Timeout { .. })));
    rig.queue.issue_io(&[id], LayerIndex(0), SmBudget(1)).unwrap();
    assert_eq!(rig.queue.wait_cqe(id, deadline()).unwrap().result, Ok(()), "the fresh pair serves it");
}
