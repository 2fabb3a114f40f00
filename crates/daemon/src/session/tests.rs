use std::os::fd::AsFd;

use std::time::Duration;

use nvme_driver::hw::{AddressSpaceId, CopiedMemory, CopiedRegion, DataRegion, DeviceBackend, DmaAllocator, HwError, RegisterIo};
use nvme_driver::spec::registers;
use nvme_driver::{Controller, ControllerConfig};
use nvme_emu::{Backing, EmuConfig, NamespaceConfig};
use objstore::{format_pool, FormatParams, ModelGeometry, Pool, PoolTarget};

use super::*;
use crate::gpu_memory::DeviceMemoryService;
use crate::protocol::{DeviceMemoryKind, RegisterDeviceMemory, RingOffsets};
use crate::test_tracing::{EventSubscriber, OnEvent};

/// A one-device pool on a software controller started with or without a shared register
/// page, as the daemon's store state.
fn store(shared_registers: bool) -> Mutex<StoreState> {
    store_on(EmuConfig::default().with_shared_registers(shared_registers), |device| device)
}

/// A one-device pool on a software controller started with `config` (its backing and
/// namespace set here), which the driver reaches through `backend(device)`.
fn store_on(config: EmuConfig, backend: impl FnOnce(Arc<EmuDevice>) -> Arc<dyn DeviceBackend>) -> Mutex<StoreState> {
    store_with(config, ControllerConfig::default(), backend)
}

/// As [`store_on`], the driver's controller started with `controller` (its admin timeout).
fn store_with(
    config: EmuConfig,
    controller: ControllerConfig,
    backend: impl FnOnce(Arc<EmuDevice>) -> Arc<dyn DeviceBackend>,
) -> Mutex<StoreState> {
    let device = start_device(config);
    let backend = backend(device.clone());
    store_from(vec![(device, backend)], controller)
}

/// A pool of `devices` software controllers (default configuration, each reached directly) in
/// one DMA space (a window is mapped once for all), the driver's controllers started with
/// `controller`.
fn store_of(devices: usize, controller: ControllerConfig) -> Mutex<StoreState> {
    let first = start_device(EmuConfig::default());
    let mut started = vec![Arc::clone(&first)];
    for _ in 1..devices {
        started.push(start_device_in(EmuConfig::default(), &first.dma_pool()));
    }
    let devices = started
        .into_iter()
        .map(|device| {
            let backend: Arc<dyn DeviceBackend> = device.clone();
            (device, backend)
        })
        .collect();
    store_from(devices, controller)
}

/// A software controller started with `config`, its backing and namespace set here.
fn start_device(config: EmuConfig) -> Arc<EmuDevice> {
    start_device_in(config, &nvme_driver::hw::DmaPool::identity())
}

/// [`start_device`] in the DMA space of `dma`.
fn start_device_in(config: EmuConfig, dma: &nvme_driver::hw::DmaPool) -> Arc<EmuDevice> {
    let config = config.with_backing(Backing::Memory { bytes: 32 << 20 }).with_namespaces(vec![NamespaceConfig::new(4096, None)]);
    EmuDevice::start_in(config, dma).unwrap()
}

/// The daemon's store state over a pool formatted on `devices` (each reached through its
/// backend), the driver's controllers started with `controller`.
fn store_from(devices: Vec<(Arc<EmuDevice>, Arc<dyn DeviceBackend>)>, controller: ControllerConfig) -> Mutex<StoreState> {
    let targets: Vec<_> = devices
        .iter()
        .map(|(_, backend)| PoolTarget {
            controller: Arc::new(Controller::init(Arc::clone(backend), controller.clone()).unwrap()),
            namespace: NamespaceId(1),
        })
        .collect();
    let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
    let params = FormatParams { slot_count_max: Some(64), ..FormatParams::new(geometry) };
    format_pool(&targets, &params).unwrap();
    let (pool, _) = Pool::open(targets, Some(&geometry)).unwrap();
    let control = StoreControl::new(pool, 8).unwrap();
    let relay = DoorbellRelay::start(crate::relay::RelayConfig::default()).unwrap();
    Mutex::new(StoreState { control, emulators: devices.into_iter().map(|(device, _)| Some(device)).collect(), relay })
}

/// A device-memory service of its own (its claim table: a test's windows never meet another's).
fn service() -> DeviceMemoryService {
    DeviceMemoryService::new(crate::gpu_memory::DeviceMemoryImport::Memfd).unwrap()
}

/// The queue pairs of each controller no attach takes (a daemon outside a cluster).
const POOL_RESERVED: u16 = crate::pool_open::POOL_QUEUE_PAIRS_RESERVED;

/// Registration ids, unique across the tests (as the server's are across sessions).
static NEXT_REGISTRATION: AtomicU64 = AtomicU64::new(1);

fn registered(holdings: &mut Holdings, store: &Mutex<StoreState>) -> u64 {
    let memory = SharedMemory::create("session-test", 1 << 20).unwrap();
    let mut fds = vec![memory.fd().try_clone_to_owned().unwrap()];
    let register = RegisterMemory { window_bytes: 1 << 20, kv_blocks: 4 };
    match holdings.register(register, &mut fds, store, &SessionLimits::default(), 16 << 10, &NEXT_REGISTRATION, &service(), 1) {
        Reply::Registered(registered) => registered.registration,
        other => panic!("{other:?}"),
    }
}

fn attach(holdings: &mut Holdings, store: &Mutex<StoreState>, registration: u64) -> (Reply, Vec<OwnedFd>) {
    attach_counted(holdings, store, registration, &LeakCounters::default())
}

/// [`attach`] (one pair of rings) counting leaks in `leaks`.
fn attach_counted(holdings: &mut Holdings, store: &Mutex<StoreState>, registration: u64, leaks: &LeakCounters) -> (Reply, Vec<OwnedFd>) {
    let rings = vec![RingOffsets { submission_offset: 512 << 10, completion_offset: 768 << 10 }];
    holdings.attach(
        AttachQueues { registration, depth: 64, rings },
        store,
        &Mutex::new(()),
        &|| false,
        &SessionLimits::default(),
        leaks,
        POOL_RESERVED,
    )
}

#[test]
fn a_device_without_a_shared_register_page_attaches_through_the_relay() {
    // Goal: on a device without a shared register page (VFIO, or an emulator in relay mode)
    // the attach gets the pair's own relay page (BAR0's layout, CAP for the client's stride
    // check) and the relay forwards that pair's doorbells; a bad tail is dropped and counted;
    // session end takes the pair off the relay before deleting it. With a shared register
    // page the attach hands out that page and relays nothing.
    let without = store(false);
    let mut holdings = Holdings::default();
    let registration = registered(&mut holdings, &without);
    let (reply, fds) = attach(&mut holdings, &without, registration);
    let Reply::Attached { queues } = reply else { panic!("{reply:?}") };
    assert_eq!((queues.len(), fds.len()), (1, 1));
    let grant = &queues[0];
    let page = SharedMemory::from_fd(fds[0].as_fd().try_clone_to_owned().unwrap(), grant.register_bytes as usize).unwrap();
    let client = nvme_driver::hw::SharedRegisters::new(page);
    let bar_capabilities = lock(&without).control.pool().target(0).controller.registers().read64(registers::CAP);
    assert_eq!(client.read64(registers::CAP), bar_capabilities);
    assert_eq!(grant.register_bytes, 8192, "queue {} fits one page past the doorbell base", grant.queue_id);
    assert_eq!(lock(&without).relay.counts().queues, 1);
    client.write32(grant.submission_doorbell_offset as usize, grant.depth);
    wait_until(|| lock(&without).relay.counts().dropped == 1);

    assert!(holdings.release(&without, &LeakCounters::default()).is_done());
    assert_eq!(lock(&without).relay.counts().queues, 0, "session end leaves the pair relayed");
    client.write32(grant.submission_doorbell_offset as usize, grant.depth + 1);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(lock(&without).relay.counts().dropped, 1, "a released pair's page is still read");

    let with = store(true);
    let mut holdings = Holdings::default();
    let registration = registered(&mut holdings, &with);
    let (reply, fds) = attach(&mut holdings, &with, registration);
    assert!(matches!(&reply, Reply::Attached { queues } if queues.len() == 1), "{reply:?}");
    assert_eq!(fds.len(), 1);
    assert_eq!(lock(&with).relay.counts().queues, 0, "a shared register page needs no relay");
    assert_eq!(holdings.queue_pairs(), 1);
    // A second attach on the same window is refused; release deletes the pair.
    let (again, _) = attach(&mut holdings, &with, registration);
    assert!(matches!(again, Reply::Error { code: ErrorCode::BadRequest, .. }), "{again:?}");
    assert!(holdings.release(&with, &LeakCounters::default()).is_done());
    assert_eq!((holdings.registrations(), holdings.queue_pairs()), (0, 0));
}

thread_local! {
    /// Makes `duplicate_descriptor` fail on this thread (see there).
    pub(super) static DUPLICATES_FAIL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[test]
fn an_attach_whose_register_page_cannot_be_duplicated_leaves_nothing_behind() {
    // Goal: the register page descriptors go out with the reply; when duplicating one fails
    // (EMFILE), the attach is refused and undone: no pair stays with the registration (its
    // client got no layout to drive it with) and the client's retry attaches. The session
    // used to keep the pairs, and refuse the retry as "has its queue pairs already".
    for shared_registers in [true, false] {
        let store = store(shared_registers);
        let mut holdings = Holdings::default();
        let registration = registered(&mut holdings, &store);
        DUPLICATES_FAIL.with(|fail| fail.set(true));
        let (reply, fds) = attach(&mut holdings, &store, registration);
        DUPLICATES_FAIL.with(|fail| fail.set(false));
        assert!(matches!(&reply, Reply::Error { code: ErrorCode::StoreFailed, .. }), "{reply:?}");
        assert!(fds.is_empty());
        assert_eq!(holdings.queue_pairs(), 0, "shared registers {shared_registers}: the failed attach kept its pairs");
        assert_eq!(lock(&store).relay.counts().queues, 0, "shared registers {shared_registers}: still relayed");
        let (retry, fds) = attach(&mut holdings, &store, registration);
        assert!(matches!(&retry, Reply::Attached { queues } if queues.len() == 1), "the retry: {retry:?}");
        assert_eq!((fds.len(), holdings.queue_pairs()), (1, 1));
        assert!(holdings.release(&store, &LeakCounters::default()).is_done());
    }
}

thread_local! {
    /// Makes `Holdings::attach` panic on this thread once it relays a pair (see there).
    pub(super) static PANICS_AFTER_RELAYING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[test]
fn an_attach_that_panics_after_relaying_a_pair_leaves_nothing_relayed() {
    // Goal: a panic in the attach's per-device loop (a bug; the connection's `catch_unwind`
    // catches it and the daemon serves on) after the relay took a pair must take the pair off
    // the relay as the unwinding deletes it: the relay would otherwise go on forwarding a page
    // nobody holds to a queue id the next attach gets. The hook panics right after the relay
    // took the pair; the same registration then attaches.
    let store = store(false);
    let mut holdings = Holdings::default();
    let registration = registered(&mut holdings, &store);
    PANICS_AFTER_RELAYING.with(|panics| panics.set(true));
    let attached = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| attach(&mut holdings, &store, registration)));
    PANICS_AFTER_RELAYING.with(|panics| panics.set(false));
    assert!(attached.is_err(), "the hook did not panic");
    assert_eq!(lock(&store).relay.counts().queues, 0, "the panicked attach left its pair relayed");
    assert_eq!(holdings.queue_pairs(), 0);
    let (retry, fds) = attach(&mut holdings, &store, registration);
    assert!(matches!(&retry, Reply::Attached { queues } if queues.len() == 1), "the retry: {retry:?}");
    assert_eq!((fds.len(), lock(&store).relay.counts().queues), (1, 1));
    assert!(holdings.release(&store, &LeakCounters::default()).is_done());
    assert_eq!(lock(&store).relay.counts().queues, 0);
}

#[test]
fn device_memory_is_refused_on_a_pool_with_a_vfio_device() {
    // Goal: a pool device without a software controller (a vfio: device) cannot take memory
    // reached only by copies: the registration is Unsupported, naming what the IOMMU route
    // would need, and nothing is held; the same request on software controllers registers.
    let service = DeviceMemoryService::new(crate::gpu_memory::DeviceMemoryImport::Memfd).unwrap();
    let memory = SharedMemory::create("device-kv", 1 << 20).unwrap();
    let request = RegisterDeviceMemory {
        kind: DeviceMemoryKind::Memfd,
        handle: [0; 64],
        device_uuid: [0; 16],
        allocation_bytes: 1 << 20,
        offset_bytes: 0,
        length_bytes: 1 << 20,
        kv_blocks: 4,
    };
    let register = |holdings: &mut Holdings, store: &Mutex<StoreState>| {
        let mut fds = vec![memory.fd().try_clone_to_owned().unwrap()];
        holdings.register_device_memory(request, &mut fds, store, &SessionLimits::default(), 16 << 10, &AtomicU64::new(1), &service, 1)
    };
    let vfio = store(false);
    lock(&vfio).emulators = vec![None];
    let mut holdings = Holdings::default();
    let reply = register(&mut holdings, &vfio);
    match &reply {
        Reply::Error { code: ErrorCode::Unsupported, message } => {
            assert!(message.contains("vfio") && message.contains("IOMMU_IOAS_MAP_FILE"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(holdings.registrations(), 0);
    let emulated = store(false);
    assert!(matches!(register(&mut holdings, &emulated), Reply::Registered(_)));
    assert_eq!(holdings.registrations(), 1);
    assert!(holdings.release(&emulated, &LeakCounters::default()).is_done());
}

#[test]
fn a_memfd_stand_in_counts_against_the_sessions_window_bytes() {
    // Goal: host memory the daemon maps for a memfd stand-in is capped with the windows: with
    // a 2 MiB cap, a 1 MiB window leaves room for one 1 MiB memfd registration, not two, and
    // a window after them is refused too.
    let service = DeviceMemoryService::new(crate::gpu_memory::DeviceMemoryImport::Memfd).unwrap();
    let limits = SessionLimits { window_bytes_max: 2 << 20, ..SessionLimits::default() };
    let emulated = store(false);
    let mut holdings = Holdings::default();
    registered(&mut holdings, &emulated);
    let next_id = AtomicU64::new(100);
    let register = |holdings: &mut Holdings| {
        let memory = SharedMemory::create("device-kv", 1 << 20).unwrap();
        let request = RegisterDeviceMemory {
            kind: DeviceMemoryKind::Memfd,
            handle: [0; 64],
            device_uuid: [0; 16],
            allocation_bytes: 1 << 20,
            offset_bytes: 0,
            length_bytes: 1 << 20,
            kv_blocks: 4,
        };
        let mut fds = vec![memory.fd().try_clone_to_owned().unwrap()];
        holdings.register_device_memory(request, &mut fds, &emulated, &limits, 16 << 10, &next_id, &service, 1)
    };
    assert!(matches!(register(&mut holdings), Reply::Registered(_)));
    assert!(matches!(register(&mut holdings), Reply::Error { code: ErrorCode::LimitReached, .. }));
    let window = SharedMemory::create("window", 1 << 20).unwrap();
    let mut fds = vec![window.fd().try_clone_to_owned().unwrap()];
    let request = RegisterMemory { window_bytes: 1 << 20, kv_blocks: 4 };
    let reply = holdings.register(request, &mut fds, &emulated, &limits, 16 << 10, &next_id, &service, 1);
    assert!(matches!(reply, Reply::Error { code: ErrorCode::LimitReached, .. }), "{reply:?}");
    assert!(holdings.release(&emulated, &LeakCounters::default()).is_done());
}

#[test]
fn a_session_attaches_one_queue_pair_per_device_and_leaves_the_others_theirs() {
    // Goal: a controller sized for --clients-max 2 (2 + 2 I/O queue pairs: the pool's
    // metadata pair holds one) serves both clients' attaches and keeps a spare for the pool,
    // however many windows the first client registers: its attach on a second and a third
    // window is refused (LimitReached, saying why) instead of taking the other client's
    // pair and the spare.
    let store = store_on(EmuConfig::default().with_io_queue_pairs_max(2 + 2), |device| device);
    let mut first = Holdings::default();
    let windows: Vec<u64> = (0..3).map(|_| registered(&mut first, &store)).collect();
    let (reply, _) = attach(&mut first, &store, windows[0]);
    assert!(matches!(reply, Reply::Attached { .. }), "{reply:?}");
    for &window in &windows[1..] {
        match attach(&mut first, &store, window).0 {
            Reply::Error { code: ErrorCode::LimitReached, message } => {
                assert!(message.contains("one pair per pool device"), "{message}")
            }
            other => panic!("a second attach in one session: {other:?}"),
        }
    }
    assert_eq!(first.queue_pairs(), 1);
    let mut second = Holdings::default();
    let registration = registered(&mut second, &store);
    let (reply, _) = attach(&mut second, &store, registration);
    assert!(matches!(reply, Reply::Attached { .. }), "the second client's attach: {reply:?}");
    // The spare is still there: the controller creates one more pair.
    let controller = Arc::clone(&lock(&store).control.pool().target(0).controller);
    let spare = controller.create_detached_queue_pair(2, None).expect("the pool's spare queue pair");
    spare.delete().map_err(|undeleted| undeleted.source).unwrap();
    assert!(first.release(&store, &LeakCounters::default()).is_done());
    assert!(second.release(&store, &LeakCounters::default()).is_done());
}

#[test]
fn a_windows_claim_is_given_back_with_it_and_kept_with_a_leaked_one() {
    // Goal: a window's memfd is claimed while the window is registered (another session's
    // registration of it is NotYours), given back when its session ends in order, and kept for
    // good when the session is kept for good (`leak`: its queues may still write the window).
    let service = service();
    let store = store(true);
    let window = SharedMemory::create("claimed-window", 1 << 20).unwrap();
    let register = |holdings: &mut Holdings, session: u64| {
        let mut fds = vec![window.fd().try_clone_to_owned().unwrap()];
        let request = RegisterMemory { window_bytes: 1 << 20, kv_blocks: 4 };
        holdings.register(request, &mut fds, &store, &SessionLimits::default(), 16 << 10, &NEXT_REGISTRATION, &service, session)
    };
    let not_yours = |reply: Reply| assert!(matches!(reply, Reply::Error { code: ErrorCode::NotYours, .. }), "{reply:?}");
    let mut first = Holdings::default();
    assert!(matches!(register(&mut first, 1), Reply::Registered(_)));
    let mut second = Holdings::default();
    not_yours(register(&mut second, 2));
    assert!(first.release(&store, &LeakCounters::default()).is_done());
    assert!(matches!(register(&mut second, 2), Reply::Registered(_)), "the released window's memfd is free again");
    assert_eq!(second.leak(&store, &LeakCounters::default()), 0);
    let mut third = Holdings::default();
    not_yours(register(&mut third, 3));
}

/// A DMA allocator whose `map_shared` signals that it began, then takes `delay` (what
/// pinning and mapping a large window through VFIO costs); everything else is `inner`'s.
struct SlowMapping {
    inner: Arc<dyn DmaAllocator>,
    delay: Duration,
    began: Mutex<std::sync::mpsc::Sender<()>>,
}

impl DmaAllocator for SlowMapping {
    fn allocate(&self, len: usize) -> Result<DmaRegion, HwError> {
        self.inner.allocate(len)
    }

    // The trait makes this method `unsafe` to call; implementing it is allowed here because
    // this one performs no unsafe operation: nothing in these tests maps external memory,
    // so it refuses rather than forwards (forwarding would need an unsafe call outside
    // `fd_passing`, the crate's only unsafe module).
    #[allow(unsafe_code)]
    unsafe fn map_external(&self, _host: *mut u8, _len: usize) -> Result<DmaRegion, HwError> {
        Err(HwError::Backend { backend: "slow-mapping test allocator", message: "map_external is not offered".into() })
    }

    fn translate(&self, iova: nvme_driver::Iova, len: usize) -> Result<DmaRegion, HwError> {
        self.inner.translate(iova, len)
    }

    fn address_space(&self) -> AddressSpaceId {
        self.inner.address_space()
    }

    fn map_shared(&self, memory: &Arc<SharedMemory>) -> Result<DmaRegion, HwError> {
        let _ = lock(&self.began).send(());
        std::thread::sleep(self.delay);
        self.inner.map_shared(memory)
    }

    fn map_copied(&self, memory: Arc<dyn CopiedMemory>) -> Result<CopiedRegion, HwError> {
        self.inner.map_copied(memory)
    }

    fn translate_data(&self, iova: nvme_driver::Iova, len: usize) -> Result<DataRegion, HwError> {
        self.inner.translate_data(iova, len)
    }
}

/// The software controller, its DMA through [`SlowMapping`].
struct SlowBackend {
    device: Arc<EmuDevice>,
    dma: Arc<SlowMapping>,
}

impl DeviceBackend for SlowBackend {
    fn name(&self) -> String {
        format!("slow-mapping {}", self.device.name())
    }

    fn registers(&self) -> Arc<dyn RegisterIo> {
        self.device.registers()
    }

    fn dma(&self) -> Arc<dyn DmaAllocator> {
        self.dma.clone()
    }

    fn function_reset(&self) -> Result<(), HwError> {
        self.device.function_reset()
    }
}

#[test]
fn mapping_a_window_does_not_hold_the_pool_lock() {
    // Goal: while one session's window is being mapped for the devices (600 ms here, as
    // pinning tens of GiB through VFIO can take seconds), another session gets the pool
    // lock (its lookups, prepares and commits) at once, not after the mapping; the window
    // then registers as usual.
    let delay = Duration::from_millis(600);
    let (began_sender, began) = std::sync::mpsc::channel();
    let store = store_on(EmuConfig::default(), |device| {
        let dma = Arc::new(SlowMapping { inner: device.dma(), delay, began: Mutex::new(began_sender) });
        Arc::new(SlowBackend { device, dma })
    });
    let mut holdings = Holdings::default();
    let waited = std::thread::scope(|scope| {
        let registering = scope.spawn(|| registered(&mut holdings, &store));
        began.recv_timeout(Duration::from_secs(10)).expect("the mapping began");
        let asked = std::time::Instant::now();
        let cached = lock(&store).control.pool().index().counts().cached_blocks;
        let waited = asked.elapsed();
        assert_eq!(cached, 0);
        registering.join().unwrap();
        waited
    });
    assert!(waited < delay / 2, "the pool lock was held through the mapping: waited {waited:?}");
    assert_eq!(holdings.registrations(), 1);
    assert!(holdings.release(&store, &LeakCounters::default()).is_done());
}

/// Polls `done` for up to 10 s.
fn wait_until(done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "not within 10 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_deletion_the_admin_queue_could_not_confirm_in_time_is_retried_until_it_is() {
    // Goal: a session ends while its Delete I/O SQ completes late (after the admin timeout):
    // the pair is not kept for good but retried until the controller confirms it gone; then
    // its window and reservation are given back, the queue id is free again and nothing is
    // counted as leaked.
    let admin_timeout = Duration::from_millis(50);
    let store = store_with(EmuConfig::default(), ControllerConfig { admin_timeout, ..ControllerConfig::default() }, |device| device);
    let device = lock(&store).emulators[0].clone().unwrap();
    let leaks = LeakCounters::default();
    let mut holdings = Holdings::default();
    let registration = registered(&mut holdings, &store);
    let queue_id = match attach(&mut holdings, &store, registration).0 {
        Reply::Attached { queues } => queues[0].queue_id,
        other => panic!("{other:?}"),
    };
    let late = nvme_emu::FaultAction::Delay(4 * admin_timeout);
    let rule = nvme_emu::FaultRule::on_nth_admin(1, nvme_driver::spec::AdminOpcode::DeleteIoSubmissionQueue, late);
    device.set_faults(nvme_emu::FaultPlan::none().with_rule(rule));
    let Released::Retiring(mut retiring) = holdings.release(&store, &leaks) else { panic!("the late deletion is not retried") };
    assert_eq!(retiring.queue_pairs(), 1);
    // The retries, each tick for as long as the controller does not answer, log below warn
    // level (the session's end said so once).
    let warnings = Arc::new(AtomicU64::new(0));
    let (mut tries, deadline) = (0, std::time::Instant::now() + Duration::from_secs(10));
    // A second dispatcher alive meanwhile: with only one registered, tracing-core 0.1 caches a
    // call site's interest from whichever thread reaches it first (tokio-rs/tracing#3611), so a
    // warning another test's thread met first, with no subscriber, could stay disabled here and
    // the count below pass without counting.
    let _second_dispatch = tracing::Dispatch::new(EventSubscriber(CountingWarnings(Arc::new(AtomicU64::new(0)))));
    tracing::subscriber::with_default(EventSubscriber(CountingWarnings(Arc::clone(&warnings))), || loop {
        tries += 1;
        match retiring.retry(&store, &leaks) {
            Retried::Done => break,
            Retried::Pending => assert!(std::time::Instant::now() < deadline, "the deletion was never confirmed"),
            Retried::Kept(pairs) => panic!("{pairs} pair(s) kept for good"),
        }
        std::thread::sleep(admin_timeout);
    });
    assert!(tries > 1, "no retry found the deletion pending");
    assert_eq!(warnings.load(Ordering::Relaxed), 0, "retries logged at warn level or above ({tries} tries)");
    assert_eq!(device.stats().faults_injected, 1, "the Delete I/O SQ was late");
    assert_eq!(leaks.queue_pairs.load(Ordering::Relaxed), 0);
    assert_eq!(leaks.windows.load(Ordering::Relaxed), 0);
    let controller = Arc::clone(&lock(&store).control.pool().target(0).controller);
    let again = controller.create_detached_queue_pair(2, None).expect("the queue id is free again");
    assert_eq!(again.layout().id.0, queue_id);
    again.delete().map_err(|undeleted| undeleted.source).unwrap();
}

/// Counts the events of this crate at warn level or above (a test's scoped subscriber).
struct CountingWarnings(Arc<AtomicU64>);

impl OnEvent for CountingWarnings {
    fn on_event(&self, event: &tracing::Event<'_>) {
        let metadata = event.metadata();
        if *metadata.level() <= tracing::Level::WARN && metadata.target().starts_with("tutti_daemon") {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The software controller's registers, with one admin submission doorbell write held back
/// (`hold_admin_doorbell_write`): what a controller slow to fetch a command looks like to the
/// host, whose command then times out before the controller executes it.
struct HoldingRegisters {
    inner: Arc<dyn RegisterIo>,
    /// Admin SQ tail writes to let through before holding one (0: hold none).
    countdown: std::sync::atomic::AtomicU32,
    held: Mutex<Option<u32>>,
}

/// A store whose controller's registers are [`HoldingRegisters`] (nothing held until a test sets
/// its countdown), with `admin_timeout` for the daemon's admin commands.
fn store_holding_admin_doorbells(admin_timeout: Duration) -> (Mutex<StoreState>, Arc<HoldingRegisters>) {
    let registers = Arc::new(Mutex::new(None::<Arc<HoldingRegisters>>));
    let store = {
        let registers = Arc::clone(&registers);
        store_with(EmuConfig::default(), ControllerConfig { admin_timeout, ..ControllerConfig::default() }, move |device| {
            let holding = Arc::new(HoldingRegisters {
                inner: device.registers(),
                countdown: std::sync::atomic::AtomicU32::new(0),
                held: Mutex::new(None),
            });
            *lock(&registers) = Some(Arc::clone(&holding));
            Arc::new(HoldingBackend { device, registers: holding })
        })
    };
    let holding = lock(&registers).clone().unwrap();
    (store, holding)
}

/// BAR0 offset of the admin submission queue's tail doorbell.
const ADMIN_SQ_TAIL_DOORBELL: usize = 0x1000;

impl RegisterIo for HoldingRegisters {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn read32(&self, offset: usize) -> u32 {
        self.inner.read32(offset)
    }
    fn write32(&self, offset: usize, value: u32) {
        if offset == ADMIN_SQ_TAIL_DOORBELL {
            let countdown = self.countdown.load(Ordering::Acquire);
            if countdown > 0 {
                self.countdown.store(countdown - 1, Ordering::Release);
                if countdown == 1 {
                    *lock(&self.held) = Some(value);
                    return;
                }
            }
        }
        self.inner.write32(offset, value)
    }
    fn read64(&self, offset: usize) -> u64 {
        self.inner.read64(offset)
    }
    fn write64(&self, offset: usize, value: u64) {
        self.inner.write64(offset, value)
    }
}

struct HoldingBackend {
    device: Arc<EmuDevice>,
    registers: Arc<HoldingRegisters>,
}

impl DeviceBackend for HoldingBackend {
    fn name(&self) -> String {
        format!("doorbell-holding {}", self.device.name())
    }
    fn registers(&self) -> Arc<dyn RegisterIo> {
        self.registers.clone()
    }
    fn dma(&self) -> Arc<dyn DmaAllocator> {
        self.device.dma()
    }
    fn function_reset(&self) -> Result<(), HwError> {
        self.device.function_reset()
    }
}

/// Registers 1 MiB of device memory (a memfd stand-in) for `session` in `holdings`.
fn registered_device_memory(holdings: &mut Holdings, store: &Mutex<StoreState>, service: &DeviceMemoryService, session: u64) -> Registered {
    let memory = SharedMemory::create("device-kv", 1 << 20).unwrap();
    let request = RegisterDeviceMemory {
        kind: DeviceMemoryKind::Memfd,
        handle: [0; 64],
        device_uuid: [0; 16],
        allocation_bytes: 1 << 20,
        offset_bytes: 0,
        length_bytes: 1 << 20,
        kv_blocks: 4,
    };
    let mut fds = vec![memory.fd().try_clone_to_owned().unwrap()];
    match holdings.register_device_memory(
        request,
        &mut fds,
        store,
        &SessionLimits::default(),
        16 << 10,
        &NEXT_REGISTRATION,
        service,
        session,
    ) {
        Reply::Registered(registered) => registered,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_queue_created_after_its_creation_timed_out_is_still_restricted() {
    // Goal: the controller executes a client's Create I/O SQ only after the daemon's wait for
    // it timed out (its doorbell write held back here). The attach fails, but the queue's
    // restriction preset stays pending, so the late creation takes it (the queue is restricted
    // to the client's window, its device memory and the pool's blocks), instead of finding no
    // preset. The late queue, which its client can ring, may move that memory: when the session
    // ends, its window and device memory are kept for good (counted), never given to another
    // registration, and the session is kept.
    let admin_timeout = Duration::from_millis(50);
    let (store, holding) = store_holding_admin_doorbells(admin_timeout);
    let device = lock(&store).emulators[0].clone().unwrap();
    let service = service();
    let mut holdings = Holdings::default();
    let registration = registered(&mut holdings, &store);
    let device_memory = registered_device_memory(&mut holdings, &store, &service, 1);
    let ring = nvme_driver::Iova(holdings.registrations[0].window.iova().0 + (512 << 10));
    // The attach's Create I/O CQ goes through; its Create I/O SQ is held.
    holding.countdown.store(2, Ordering::Release);
    let (reply, _) = attach(&mut holdings, &store, registration);
    // A timed-out creation is the store failing, not a cap reached.
    assert!(matches!(reply, Reply::Error { code: ErrorCode::StoreFailed, .. }), "{reply:?}");
    let held = lock(&holding.held).take().expect("the Create I/O SQ's doorbell write was held");
    assert!(
        matches!(device.preset_restriction(ring, QueueRestriction::new()), Err(nvme_emu::EmuError::RestrictionPending { .. })),
        "the preset of the creation that may still execute was removed"
    );
    // The controller fetches the command now: the late creation takes the preset.
    holding.inner.write32(ADMIN_SQ_TAIL_DOORBELL, held);
    wait_until(|| device.preset_restriction(ring, QueueRestriction::new()).is_ok());
    let leaks = LeakCounters::default();
    match holdings.release(&store, &leaks) {
        Released::Kept(pairs) => assert_eq!(pairs, 1),
        Released::Done => panic!("the session's memory was given back while the late queue may still move it"),
        Released::Retiring(_) => panic!("retiring: no pair was attached"),
    }
    assert_eq!((leaks.queue_pairs.load(Ordering::Relaxed), leaks.windows.load(Ordering::Relaxed)), (1, 1));
    // Another session's device memory gets an IOVA range of its own.
    let mut other = Holdings::default();
    let fresh = registered_device_memory(&mut other, &store, &service, 2);
    let kept = device_memory.iova_base..device_memory.iova_base + (1 << 20);
    let taken = fresh.iova_base..fresh.iova_base + (1 << 20);
    assert!(taken.end <= kept.start || kept.end <= taken.start, "{taken:x?} overlaps the kept {kept:x?}");
    assert!(other.release(&store, &leaks).is_done());
}

#[test]
fn the_pool_lock_is_not_held_while_an_attach_waits_on_the_admin_queue() {
    // Goal: an attach's Create I/O CQ and SQ may each wait out an admin timeout (10 s by
    // default) on a controller slow to answer; the pool lock must not be held meanwhile, or
    // every other session's lookups, prepares, commits and releases, status and /metrics wait
    // with it (clients give up at 5 s). Here the Create I/O SQ's doorbell write is held back,
    // so the attach waits out the admin timeout (1 s): the pool lock is taken at once
    // meanwhile. Before, the attach held it from its first check to its reply.
    let admin_timeout = Duration::from_secs(1);
    let (store, holding) = store_holding_admin_doorbells(admin_timeout);
    let device = lock(&store).emulators[0].clone().unwrap();
    let mut holdings = Holdings::default();
    let registration = registered(&mut holdings, &store);
    let ring = nvme_driver::Iova(holdings.registrations[0].window.iova().0 + (512 << 10));
    // The attach's Create I/O CQ goes through; its Create I/O SQ is held.
    holding.countdown.store(2, Ordering::Release);
    let waited = std::thread::scope(|scope| {
        let attaching = scope.spawn(|| attach(&mut holdings, &store, registration).0);
        wait_until(|| lock(&holding.held).is_some());
        let asked = std::time::Instant::now();
        let cached = lock(&store).control.pool().index().counts().cached_blocks;
        let waited = asked.elapsed();
        assert_eq!(cached, 0);
        let reply = attaching.join().unwrap();
        assert!(matches!(reply, Reply::Error { code: ErrorCode::StoreFailed, .. }), "{reply:?}");
        waited
    });
    assert!(waited < admin_timeout / 4, "the pool lock was held through the attach's admin wait: waited {waited:?}");
    // The controller fetches the command now; the session's memory is kept for good, as for
    // any creation that may still execute.
    let held = lock(&holding.held).take().expect("the Create I/O SQ's doorbell write was held");
    holding.inner.write32(ADMIN_SQ_TAIL_DOORBELL, held);
    wait_until(|| device.preset_restriction(ring, QueueRestriction::new()).is_ok());
    match holdings.release(&store, &LeakCounters::default()) {
        Released::Kept(pairs) => assert_eq!(pairs, 1),
        Released::Done => panic!("the session's memory was given back while the late queue may still move it"),
        Released::Retiring(_) => panic!("retiring: no pair was attached"),
    }
}

#[test]
fn a_queue_created_whose_completion_never_came_keeps_the_sessions_memory() {
    // Goal: the controller executes a client's Create I/O SQ (taking its restriction preset) but
    // its completion never comes (dropped): the driver times out and leaks the rings and the
    // queue id, and the queue exists on the controller for good, ringable by the client. The
    // session's window and device memory are kept for good when it ends, as for a creation that
    // may still execute, never handed to another registration.
    let admin_timeout = Duration::from_millis(50);
    let store = store_with(EmuConfig::default(), ControllerConfig { admin_timeout, ..ControllerConfig::default() }, |device| device);
    let device = lock(&store).emulators[0].clone().unwrap();
    let service = service();
    let mut holdings = Holdings::default();
    let registration = registered(&mut holdings, &store);
    let device_memory = registered_device_memory(&mut holdings, &store, &service, 1);
    let ring = nvme_driver::Iova(holdings.registrations[0].window.iova().0 + (512 << 10));
    let dropped = nvme_emu::FaultAction::DropCompletion;
    let rule = nvme_emu::FaultRule::on_nth_admin(1, nvme_driver::spec::AdminOpcode::CreateIoSubmissionQueue, dropped);
    device.set_faults(nvme_emu::FaultPlan::none().with_rule(rule));
    let (reply, _) = attach(&mut holdings, &store, registration);
    // A timed-out creation is the store failing, not a cap reached.
    assert!(matches!(reply, Reply::Error { code: ErrorCode::StoreFailed, .. }), "{reply:?}");
    // The creation ran: its preset was taken (a new one for the ring is accepted).
    drop(device.preset_restriction(ring, QueueRestriction::new()).expect("the executed creation took its preset"));
    let leaks = LeakCounters::default();
    match holdings.release(&store, &leaks) {
        Released::Kept(pairs) => assert_eq!(pairs, 1),
        Released::Done => panic!("the session's memory was given back while the created queue may still move it"),
        Released::Retiring(_) => panic!("retiring: no pair was attached"),
    }
    let mut other = Holdings::default();
    let fresh = registered_device_memory(&mut other, &store, &service, 2);
    let kept = device_memory.iova_base..device_memory.iova_base + (1 << 20);
    let taken = fresh.iova_base..fresh.iova_base + (1 << 20);
    assert!(taken.end <= kept.start || kept.end <= taken.start, "{taken:x?} overlaps the kept {kept:x?}");
    assert!(other.release(&store, &leaks).is_done());
}

#[test]
fn a_leaked_sessions_queue_pair_counts_against_later_attaches() {
    // Goal: a session kept for good holds its queue id for good, so with it on a controller
    // sized for --clients-max 2 (2 + 2 I/O queue pairs) only one more session attaches; the
    // next is refused (LimitReached, naming the kept pair) and the pool's spare survives.
    let store = store_on(EmuConfig::default().with_io_queue_pairs_max(2 + 2), |device| device);
    let leaks = LeakCounters::default();
    let attach = |holdings: &mut Holdings| {
        let registration = registered(holdings, &store);
        attach_counted(holdings, &store, registration, &leaks).0
    };
    let mut leaked = Holdings::default();
    assert!(matches!(attach(&mut leaked), Reply::Attached { .. }));
    assert_eq!(leaked.leak(&store, &leaks), 1);
    let mut second = Holdings::default();
    assert!(matches!(attach(&mut second), Reply::Attached { .. }), "the second session's attach");
    let mut third = Holdings::default();
    match attach(&mut third) {
        Reply::Error { code: ErrorCode::LimitReached, message } => assert!(message.contains("kept for good"), "{message}"),
        other => panic!("the third session took the pool's spare: {other:?}"),
    }
    let controller = Arc::clone(&lock(&store).control.pool().target(0).controller);
    let spare = controller.create_detached_queue_pair(2, None).expect("the pool's spare queue pair");
    spare.delete().map_err(|undeleted| undeleted.source).unwrap();
    assert!(second.release(&store, &leaks).is_done());
    assert!(third.release(&store, &leaks).is_done());
}

#[test]
fn an_attach_kept_from_the_last_queue_id_by_a_retiring_session_is_told_to_retry() {
    // Goal: a session whose deletion is not confirmed yet (its Delete I/O SQ completes late)
    // holds its queue id until it is; on a controller sized for one client, another session's
    // attach meanwhile is Busy (retry: the id comes free), not LimitReached (none left, which
    // reads as for good); once the deletion is confirmed, that attach goes through.
    let admin_timeout = Duration::from_millis(50);
    let config = EmuConfig::default().with_io_queue_pairs_max(1 + 2);
    let store = store_with(config, ControllerConfig { admin_timeout, ..ControllerConfig::default() }, |device| device);
    let device = lock(&store).emulators[0].clone().unwrap();
    let leaks = LeakCounters::default();
    let attach = |holdings: &mut Holdings| {
        let registration = registered(holdings, &store);
        attach_counted(holdings, &store, registration, &leaks).0
    };
    let mut first = Holdings::default();
    assert!(matches!(attach(&mut first), Reply::Attached { .. }));
    let late = nvme_emu::FaultAction::Delay(4 * admin_timeout);
    let rule = nvme_emu::FaultRule::on_nth_admin(1, nvme_driver::spec::AdminOpcode::DeleteIoSubmissionQueue, late);
    device.set_faults(nvme_emu::FaultPlan::none().with_rule(rule));
    let Released::Retiring(mut retiring) = first.release(&store, &leaks) else { panic!("the late deletion is not retried") };
    let mut next = Holdings::default();
    match attach(&mut next) {
        Reply::Error { code: ErrorCode::Busy, message } => assert!(message.contains("retry"), "{message}"),
        other => panic!("an attach kept out by a retiring session: {other:?}"),
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while retiring.retry(&store, &leaks) == Retried::Pending {
        assert!(std::time::Instant::now() < deadline, "the deletion was never confirmed");
        std::thread::sleep(admin_timeout);
    }
    assert_eq!(leaks.queue_id_holders_retiring.load(Ordering::Relaxed), 0);
    let registration = next.registrations[0].id;
    let reply = attach_counted(&mut next, &store, registration, &leaks).0;
    assert!(matches!(reply, Reply::Attached { .. }), "{reply:?}");
    assert!(next.release(&store, &leaks).is_done());
}

#[test]
fn an_attach_while_a_retiring_sessions_delete_is_outstanding_is_told_to_retry() {
    // Goal: a session ends while its Delete I/O SQ completes late, so the controller's admin
    // queue refuses every command (QueueBusy) until the late completion arrives. Another
    // session's attach meanwhile passes admission (the controller has ids to spare) but cannot
    // create its queues: it is answered Busy (retry: the admin queue comes free by itself),
    // not LimitReached (a cap, which reads as for good and which nothing retries), and leaves
    // nothing behind, so the same registration attaches once the deletion is confirmed.
    let admin_timeout = Duration::from_millis(50);
    let store = store_with(EmuConfig::default(), ControllerConfig { admin_timeout, ..ControllerConfig::default() }, |device| device);
    let device = lock(&store).emulators[0].clone().unwrap();
    let leaks = LeakCounters::default();
    let attach = |holdings: &mut Holdings, registration: u64| attach_counted(holdings, &store, registration, &leaks).0;
    let mut first = Holdings::default();
    let registration = registered(&mut first, &store);
    assert!(matches!(attach(&mut first, registration), Reply::Attached { .. }));
    // Late by 2 s: the attach below runs well inside it, however slow the machine.
    let late = nvme_emu::FaultAction::Delay(40 * admin_timeout);
    let rule = nvme_emu::FaultRule::on_nth_admin(1, nvme_driver::spec::AdminOpcode::DeleteIoSubmissionQueue, late);
    device.set_faults(nvme_emu::FaultPlan::none().with_rule(rule));
    let Released::Retiring(mut retiring) = first.release(&store, &leaks) else { panic!("the late deletion is not retried") };
    let mut next = Holdings::default();
    let registration = registered(&mut next, &store);
    match attach(&mut next, registration) {
        Reply::Error { code: ErrorCode::Busy, message } => assert!(message.contains("retry"), "{message}"),
        other => panic!("an attach meeting the admin queue busy with a late deletion: {other:?}"),
    }
    assert_eq!(next.queue_pairs(), 0, "the refused attach left queue pairs");
    assert!(!next.holds_queue_ids, "the refused attach counts as a queue id holder");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while retiring.retry(&store, &leaks) == Retried::Pending {
        assert!(std::time::Instant::now() < deadline, "the deletion was never confirmed");
        std::thread::sleep(admin_timeout);
    }
    let reply = attach(&mut next, registration);
    assert!(matches!(reply, Reply::Attached { .. }), "the retry: {reply:?}");
    assert!(next.release(&store, &leaks).is_done());
}

#[test]
fn an_attach_whose_half_made_pairs_cannot_be_deleted_is_not_told_to_retry() {
    // Goal: on a pool of two devices, an attach creates device 0's pair, then device 1's
    // creation meets the admin queue busy with a retiring session's late deletion (Busy, as
    // above); undoing the attach, device 0's pair cannot be deleted and stays with the
    // registration (the session holds its queue id). Asking again could only be refused
    // ("has its queue pairs already"), so the reply is StoreFailed naming the pair kept, never
    // Busy (which RemoteKvStore answers by asking again).
    let admin_timeout = Duration::from_millis(50);
    let store = store_of(2, ControllerConfig { admin_timeout, ..ControllerConfig::default() });
    let devices: Vec<_> = lock(&store).emulators.iter().map(|device| device.clone().unwrap()).collect();
    let leaks = LeakCounters::default();
    let attach = |holdings: &mut Holdings, registration: u64| {
        let rings = vec![
            RingOffsets { submission_offset: 512 << 10, completion_offset: 768 << 10 },
            RingOffsets { submission_offset: 576 << 10, completion_offset: 832 << 10 },
        ];
        holdings
            .attach(
                AttachQueues { registration, depth: 64, rings },
                &store,
                &Mutex::new(()),
                &|| false,
                &SessionLimits::default(),
                &leaks,
                POOL_RESERVED,
            )
            .0
    };
    let mut first = Holdings::default();
    let registration = registered(&mut first, &store);
    let reply = attach(&mut first, registration);
    assert!(matches!(reply, Reply::Attached { .. }), "{reply:?}");
    // Device 1's Delete I/O SQ is late by 2 s: its admin queue stays busy through the attach below.
    let late = nvme_emu::FaultAction::Delay(40 * admin_timeout);
    let delete_sq = nvme_driver::spec::AdminOpcode::DeleteIoSubmissionQueue;
    devices[1].set_faults(nvme_emu::FaultPlan::none().with_rule(nvme_emu::FaultRule::on_nth_admin(1, delete_sq, late)));
    let Released::Retiring(mut retiring) = first.release(&store, &leaks) else { panic!("the late deletion is not retried") };
    // Device 0 refuses the next Delete I/O SQ: the half-made attach's pair there stays.
    let refused = nvme_emu::FaultAction::Status(nvme_driver::spec::NvmeStatus::generic(nvme_driver::spec::status::codes::INTERNAL_ERROR));
    devices[0].set_faults(nvme_emu::FaultPlan::none().with_rule(nvme_emu::FaultRule::on_nth_admin(1, delete_sq, refused)));
    let mut next = Holdings::default();
    let registration = registered(&mut next, &store);
    match attach(&mut next, registration) {
        Reply::Error { code: ErrorCode::StoreFailed, message } => {
            assert!(message.contains("pool device 0") && message.contains("could not be deleted"), "{message}")
        }
        other => panic!("an attach whose half-made pair stayed: {other:?}"),
    }
    assert_eq!(next.queue_pairs(), 1, "device 0's undeleted pair stays with the registration");
    assert!(next.holds_queue_ids, "the session holds the undeleted pair's queue id");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while retiring.retry(&store, &leaks) == Retried::Pending {
        assert!(std::time::Instant::now() < deadline, "the deletion was never confirmed");
        std::thread::sleep(admin_timeout);
    }
    assert!(next.release(&store, &leaks).is_done(), "the kept pair was not deleted at session end");
}

#[test]
fn a_prepare_naming_an_engine_block_twice_is_refused_before_anything_is_reserved() {
    // Goal: two of a request's blocks in one engine block would have the daemon reserve (and
    // maybe evict for) slots whose data can only be one of them; the client's checks refuse it
    // only after the daemon reserved. The daemon refuses it up front (`BadRequest`, naming the
    // block), a store and a retrieve alike, holding nothing afterwards.
    let store = store(true);
    let mut holdings = Holdings::default();
    let registration = registered(&mut holdings, &store);
    let space = KeySpace::new(&[0x5c; 32], 0, 1, lock(&store).control.pool().key_secret()).unwrap();
    let tokens: Vec<u32> = (0..48).collect();
    let limits = SessionLimits::default();
    let prepare = || Prepare { registration, tokens: tokens.clone(), block_ids: vec![0, 1, 0], first_block: 0 };
    for (what, reply) in [
        ("store", holdings.prepare_store(prepare(), &space, 16, &store, &limits)),
        ("retrieve", holdings.prepare_retrieve(prepare(), &space, 16, &store, &limits)),
    ] {
        match reply {
            Reply::Error { code: ErrorCode::BadRequest, message } => assert!(message.contains("engine block 0"), "{what}: {message}"),
            other => panic!("a {what} naming engine block 0 twice: {other:?}"),
        }
        assert_eq!(holdings.requests_in_flight(), 0, "{what}: a request is held");
        let counts = lock(&store).control.pool().index().counts();
        assert_eq!((counts.writing_slots, counts.pinned_slots), (0, 0), "{what}: {counts:?}");
    }
}

#[test]
fn a_relayed_pair_kept_by_a_failed_attach_does_not_count_as_ringing_a_shared_register_page() {
    // Goal: an attach undone after its pair was created (the register page could not be
    // duplicated) whose pair's deletion then fails keeps the pair with the registration. On a
    // device without a shared register page that pair was relayed, and the undo took it off the
    // relay: nothing of the client rings it, so the session must not count as ringing a shared
    // register page (the server would otherwise hold the ended session until its client exits).
    // On a device with one, the kept pair does count.
    for shared_registers in [false, true] {
        let store = store(shared_registers);
        let device = lock(&store).emulators[0].clone().unwrap();
        let mut holdings = Holdings::default();
        let registration = registered(&mut holdings, &store);
        let delete_sq = nvme_driver::spec::AdminOpcode::DeleteIoSubmissionQueue;
        let refused =
            nvme_emu::FaultAction::Status(nvme_driver::spec::NvmeStatus::generic(nvme_driver::spec::status::codes::INTERNAL_ERROR));
        device.set_faults(nvme_emu::FaultPlan::none().with_rule(nvme_emu::FaultRule::on_nth_admin(1, delete_sq, refused)));
        DUPLICATES_FAIL.with(|fail| fail.set(true));
        let (reply, _) = attach(&mut holdings, &store, registration);
        DUPLICATES_FAIL.with(|fail| fail.set(false));
        assert!(
            matches!(&reply, Reply::Error { code: ErrorCode::StoreFailed, message } if message.contains("could not be deleted")),
            "{reply:?}"
        );
        assert_eq!(holdings.queue_pairs(), 1, "shared registers {shared_registers}: the undeleted pair stays");
        assert_eq!(lock(&store).relay.counts().queues, 0, "shared registers {shared_registers}: still relayed");
        assert_eq!(holdings.rings_shared_registers(), shared_registers, "shared registers {shared_registers}");
        assert!(holdings.release(&store, &LeakCounters::default()).is_done());
    }
}

#[test]
fn a_stop_between_two_devices_creations_undoes_the_attach() {
    // Goal: once the daemon stops, no queue is created (the drain frees ended clients' queue
    // ids, which a new queue could take while those clients still ring them). A stop that comes
    // after device 0's pair was created ends the attach before device 1's creation: ShuttingDown,
    // device 0's pair deleted again, nothing left with the session.
    let store = store_of(2, ControllerConfig::default());
    let leaks = LeakCounters::default();
    let mut holdings = Holdings::default();
    let registration = registered(&mut holdings, &store);
    let rings = vec![
        RingOffsets { submission_offset: 512 << 10, completion_offset: 768 << 10 },
        RingOffsets { submission_offset: 576 << 10, completion_offset: 832 << 10 },
    ];
    // Asked under the attach lock, then before each device's creation: the stop comes after
    // device 0's.
    let asked = std::cell::Cell::new(0);
    let stopping = || {
        asked.set(asked.get() + 1);
        asked.get() > 2
    };
    let (reply, fds) = holdings.attach(
        AttachQueues { registration, depth: 64, rings },
        &store,
        &Mutex::new(()),
        &stopping,
        &SessionLimits::default(),
        &leaks,
        POOL_RESERVED,
    );
    assert!(matches!(reply, Reply::Error { code: ErrorCode::ShuttingDown, .. }), "{reply:?}");
    assert!(fds.is_empty());
    assert_eq!(asked.get(), 3, "the stop was not asked before each device's creation");
    assert_eq!(holdings.queue_pairs(), 0, "device 0's pair was not deleted");
    assert!(holdings.release(&store, &leaks).is_done());
}
