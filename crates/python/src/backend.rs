//! What a `Store` holds under its lock: the store itself (in-process `KvStore` or tuttid's
//! `RemoteKvStore`, before and after its KV memory is registered), the live requests' state,
//! and the registered memory with what keeps it alive. Python-free, except for the references
//! it keeps (dropped, or leaked, in the order `close` documents).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::{CpuExecutor, GioError, SmBudget};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nvme_driver::{DataPointerMode, DmaAllocator, DmaRegion, Iova};
use nvme_emu::EmuDevice;
use objstore::{cpu_executor_for, KvLayout as StoreLayout, KvRegistration, KvRequest, KvStore, LayerKvStore, ObjstoreError, Pool};
use objstore::{Direction, RequestHandle, StoreConfig, StorePlan};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore, WindowKvLayout};
use tutti_daemon::lock::DeviceLocks;
use tutti_daemon::protocol::HelloReply;
use tutti_daemon::Client;

use crate::device_memory::{self, DeviceHold};
use crate::errors::{ErrorClass, Failure};
use crate::ffi::{CallerMemory, QueuesGone};
use crate::memory::Keep;
use crate::tensor::{CheckedLayout, Device, LayoutKind};

/// The longest a `wait` holds the store's lock in one go: other threads' calls (and the
/// completion thread) get the lock between slices.
pub const WAIT_SLICE: Duration = Duration::from_millis(2);

/// The store behind a `Store`.
pub enum Backend {
    /// In-process: the pool is open, no KV memory registered yet.
    LocalOpen {
        pool: Pool,
        emulators: Vec<Option<Arc<EmuDevice>>>,
        locks: DeviceLocks,
        config: StoreConfig,
        queue_depth: u32,
    },
    /// In-process and registered. Fields drop in order: the store (its queue pairs, then the
    /// pool's controllers), the software controllers' threads, the locks.
    Local {
        store: Box<KvStore<CpuExecutor>>,
        emulators: Vec<Option<Arc<EmuDevice>>>,
        locks: DeviceLocks,
    },
    /// Attached to tuttid (Hello answered), no memory registered yet.
    RemoteAttached {
        client: Client,
        hello: HelloReply,
        config: RemoteConfig,
    },
    /// Attached with its window registered and its queue pairs attached.
    Remote {
        store: Box<RemoteKvStore>,
    },
    Closed,
}

/// Memory tutti allocated for the store (allocate_kv), and its checked layout.
pub struct Allocation {
    pub regions: Vec<DmaRegion>,
    pub checked: CheckedLayout,
}

/// How long `close` waits at least for tuttid to end a session that registered device memory.
const DEVICE_RELEASE_WAIT: Duration = Duration::from_secs(5);

/// A live request's state, beyond the store's own.
pub struct RequestState {
    pub direction: Direction,
    pub in_flight: Option<u32>,
    /// Layers completed, in order.
    pub completed: Vec<u32>,
    /// A layer whose completion a `wait` has not returned yet (the completion thread, a poll or
    /// a LayerIo's wait saw it).
    pub unreported: Option<u32>,
    /// A failure the completion thread saw: the next wait or poll raises it.
    pub failure: Option<Failure>,
    /// Signalled once per completed layer (and on a failure), created by `fileno()`.
    pub eventfd: Option<Arc<EventFd>>,
    /// The request moves no block (a store whose blocks the pool holds already): the store
    /// puts nothing in flight when a layer is issued, so the layer completes at the issue.
    pub moves_nothing: bool,
}

impl RequestState {
    pub fn new(direction: Direction, moves_nothing: bool) -> RequestState {
        RequestState { direction, in_flight: None, completed: Vec::new(), unreported: None, failure: None, eventfd: None, moves_nothing }
    }

    fn signal(&self) {
        if let Some(eventfd) = &self.eventfd {
            // Saturation (2^64 - 2 unread signals) is the only failure: the fd is readable then.
            let _ = eventfd.write(1);
        }
    }

    /// Records that the layer in flight completed.
    fn complete(&mut self, layer: u32) {
        self.in_flight = None;
        self.completed.push(layer);
        self.unreported = Some(layer);
        self.signal();
    }

    pub fn eventfd(&mut self) -> Result<Arc<EventFd>, Failure> {
        if let Some(eventfd) = &self.eventfd {
            return Ok(Arc::clone(eventfd));
        }
        let eventfd = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(|errno| Failure::new(ErrorClass::Device, format!("creating the request's eventfd: {errno}")))?;
        let eventfd = Arc::new(eventfd);
        self.eventfd = Some(Arc::clone(&eventfd));
        // Layers completed before the fd existed are announced at once.
        if self.unreported.is_some() {
            let _ = eventfd.write(1);
        }
        Ok(eventfd)
    }
}

/// Everything under a `Store`'s lock.
pub struct StoreState {
    pub backend: Backend,
    pub requests: HashMap<u64, RequestState>,
    /// Caller memory mapped for the devices (in-process register_kv).
    pub caller_memory: Vec<CallerMemory<Keep>>,
    /// Device memory registered with tuttid (CUDA tensors, a stand-in): the tensors and what
    /// holds the exported allocation, kept until no command can move their bytes.
    pub device_memory: Option<DeviceHold>,
    /// tuttid's socket (attached stores): where `close` asks whether the session ended.
    pub daemon_socket: Option<std::path::PathBuf>,
    /// The tuttid session (attached stores).
    pub daemon_session: Option<u64>,
    /// What keeps released memory alive (DLPack tensors, buffer exports, owners), to be dropped
    /// by `StoreShared::with_state` after the store's lock is released: a DLPack producer's
    /// deleter (numpy's) takes the GIL, which a thread waiting for this lock may hold.
    pub released: Vec<Keep>,
    pub allocation: Option<Allocation>,
    /// The registered layout as checked (set by register_kv or allocate_kv).
    pub registered: Option<CheckedLayout>,
    /// Registered tensors kept for good because a queue pair could not be deleted.
    pub leaked_tensors: usize,
    /// The model fingerprint and the TP rank and world of the key space (in-process stores; None:
    /// the in-process space 0).
    pub key_space: Option<([u8; 32], u32, u32)>,
    /// When a request last went to tuttid (keep-alive pings go when idle).
    pub last_daemon_request: Instant,
}

fn not_registered() -> Failure {
    Failure::new(ErrorClass::NotRegistered, "no KV memory is registered: call register_kv(...) or allocate_kv(...) first")
}

fn closed() -> Failure {
    Failure::new(ErrorClass::StaleRequest, "the store is closed")
}

fn is_timeout(error: &ObjstoreError) -> bool {
    matches!(error, ObjstoreError::Gio(GioError::WaitTimeout { .. }))
}

impl StoreState {
    pub fn new(backend: Backend, key_space: Option<([u8; 32], u32, u32)>) -> StoreState {
        StoreState {
            backend,
            requests: HashMap::new(),
            caller_memory: Vec::new(),
            device_memory: None,
            daemon_socket: None,
            daemon_session: None,
            released: Vec::new(),
            allocation: None,
            registered: None,
            leaked_tensors: 0,
            key_space,
            last_daemon_request: Instant::now(),
        }
    }

    pub fn is_closed(&self) -> bool {
        matches!(self.backend, Backend::Closed)
    }

    /// The registered store, as the layer-wise trait.
    pub fn layer_store(&mut self) -> Result<&mut dyn LayerKvStore, Failure> {
        match &mut self.backend {
            Backend::Local { store, .. } => Ok(store.as_mut()),
            Backend::Remote { store } => Ok(store.as_mut()),
            Backend::Closed => Err(closed()),
            Backend::LocalOpen { .. } | Backend::RemoteAttached { .. } => Err(not_registered()),
        }
    }

    fn touch_daemon(&mut self) {
        self.last_daemon_request = Instant::now();
    }

    pub fn is_remote(&self) -> bool {
        matches!(self.backend, Backend::Remote { .. } | Backend::RemoteAttached { .. })
    }

    /// Longest cached prefix in blocks; daemon failures are raised (not a silent miss).
    pub fn lookup(&mut self, tokens: &[u32]) -> Result<usize, Failure> {
        match &mut self.backend {
            Backend::Local { store, .. } => Ok(store.lookup(tokens)),
            Backend::Remote { store } => {
                let found = store.client().lookup(tokens);
                self.touch_daemon();
                Ok(found? as usize)
            }
            Backend::RemoteAttached { client, .. } => {
                let found = client.lookup(tokens);
                self.touch_daemon();
                Ok(found? as usize)
            }
            Backend::LocalOpen { .. } => Err(not_registered()),
            Backend::Closed => Err(closed()),
        }
    }

    pub fn lookup_all_ranks(&mut self, tokens: &[u32]) -> Result<usize, Failure> {
        match &mut self.backend {
            Backend::Remote { store } => {
                let found = store.client().lookup_all_ranks(tokens);
                self.touch_daemon();
                Ok(found? as usize)
            }
            Backend::RemoteAttached { client, .. } => {
                let found = client.lookup_all_ranks(tokens);
                self.touch_daemon();
                Ok(found? as usize)
            }
            Backend::Local { store, .. } => {
                let Some((fingerprint, _, world)) = self.key_space else { return Ok(store.lookup(tokens)) };
                // The minimum over the ranks' key spaces of this model and world (each rank's
                // blocks are keyed apart), as tuttid answers it.
                let own = store.key_seed();
                let mut common = usize::MAX;
                for rank in 0..world {
                    let seed = key_seed(&fingerprint, rank, world)?;
                    store.set_key_seed(seed);
                    common = common.min(store.lookup(tokens));
                    if common == 0 {
                        break;
                    }
                }
                store.set_key_seed(own);
                Ok(common)
            }
            Backend::LocalOpen { .. } => Err(not_registered()),
            Backend::Closed => Err(closed()),
        }
    }

    pub fn ping(&mut self) -> Result<(), Failure> {
        let result = match &mut self.backend {
            Backend::Remote { store } => store.client().ping(),
            Backend::RemoteAttached { client, .. } => client.ping(),
            Backend::Closed => return Err(closed()),
            _ => return Ok(()),
        };
        self.touch_daemon();
        Ok(result?)
    }

    /// prepare_retrieve / prepare_store; returns the handle, the store plan (stores) and the
    /// engine blocks written (stores: the new ones; retrieves: all).
    pub fn prepare(
        &mut self,
        direction: Direction,
        tokens: &[u32],
        block_ids: &[u32],
    ) -> Result<(RequestHandle, Option<StorePlan>, Vec<u32>), Failure> {
        let remote = self.is_remote();
        let request = KvRequest { tokens, block_ids };
        let prepared = match direction {
            Direction::Retrieve => self.layer_store()?.prepare_retrieve(&request).map(|handle| (handle, None)),
            Direction::Store => self.layer_store()?.prepare_store(&request).map(|plan| (plan.handle, Some(plan))),
        };
        if remote {
            self.touch_daemon();
        }
        let (handle, plan) = prepared?;
        // The blocks the data path moves (objstore's placements; a store's new blocks only):
        // none, and an issued layer puts nothing in flight (objstore marks it done at once).
        let placed: Vec<u32> = match &self.backend {
            Backend::Local { store, .. } => {
                store.placements(handle).map(|placements| placements.iter().map(|placement| placement.engine_block).collect())
            }
            Backend::Remote { store } => {
                store.placements(handle).map(|placements| placements.iter().map(|placement| placement.engine_block).collect())
            }
            _ => Ok(Vec::new()),
        }
        .unwrap_or_default();
        let moves_nothing = placed.is_empty();
        let written = match direction {
            Direction::Retrieve => block_ids.to_vec(),
            Direction::Store => placed,
        };
        self.requests.insert(handle.to_bits(), RequestState::new(direction, moves_nothing));
        Ok((handle, plan, written))
    }

    pub fn request(&mut self, handle: u64) -> Result<&mut RequestState, Failure> {
        if self.is_closed() {
            return Err(closed());
        }
        self.requests
            .get_mut(&handle)
            .ok_or_else(|| Failure::new(ErrorClass::StaleRequest, format!("request {handle:#x} is finished (committed or finished)")))
    }

    pub fn issue(&mut self, handle: u64, layer: u32, budget: u32, direction: Direction) -> Result<(), Failure> {
        let state = self.request(handle)?;
        if state.direction != direction {
            let (asked, is) = match direction {
                Direction::Retrieve => ("retrieve_layer", "store"),
                Direction::Store => ("store_layer", "retrieve"),
            };
            return Err(Failure::new(ErrorClass::InvalidState, format!("{asked} on a {is} request")));
        }
        if let Some(previous) = state.in_flight {
            return Err(Failure::new(
                ErrorClass::InvalidState,
                format!("layer {previous} is still in flight: wait for it before issuing layer {layer}"),
            ));
        }
        let bits = RequestHandle::from_bits(handle);
        let store = self.layer_store()?;
        match direction {
            Direction::Retrieve => store.retrieve_layer(bits, layer, SmBudget(budget))?,
            Direction::Store => store.store_layer(bits, layer, SmBudget(budget))?,
        }
        let state = self.request(handle)?;
        if state.moves_nothing {
            // Nothing was put in flight (objstore's contract for a request with no blocks to
            // move): the layer is complete now, and is reported as any other (wait, LayerIo,
            // the eventfd).
            state.unreported = None;
            state.complete(layer);
            return Ok(());
        }
        state.in_flight = Some(layer);
        state.unreported = None;
        Ok(())
    }

    /// Drives the request's layer in flight until `deadline`: `Ok(Some(layer))` when it
    /// completed now, `Ok(None)` when none was in flight, `Err(timeout)` when still in flight.
    pub fn drive(&mut self, handle: u64, deadline: Instant) -> Result<Option<u32>, Failure> {
        let in_flight = self.request(handle)?.in_flight;
        if in_flight.is_none() {
            return Ok(None);
        }
        let waited = self.layer_store()?.wait(RequestHandle::from_bits(handle), deadline);
        let state = self.request(handle)?;
        match waited {
            Ok(Some(layer)) => {
                state.complete(layer);
                Ok(Some(layer))
            }
            Ok(None) => {
                state.in_flight = None;
                Ok(None)
            }
            Err(error) if is_timeout(&error) => Err(Failure::from(&error)),
            Err(error) => {
                // The store ended the layer (a failed command, a CRC mismatch): nothing of it is in
                // flight any more; a wait that failed before that (a queue error) leaves it, and
                // the next wait asks the store again.
                if matches!(error, ObjstoreError::LayerIo { .. } | ObjstoreError::PayloadMismatch { .. }) {
                    state.in_flight = None;
                }
                state.signal();
                Err(Failure::from(&error))
            }
        }
    }

    /// The completion thread's pass over the requests that have an eventfd and a layer in
    /// flight: each is driven for at most `slice`; a failure is kept for the next wait.
    pub fn drive_armed(&mut self, slice: Duration) -> bool {
        let armed: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, state)| state.eventfd.is_some() && state.in_flight.is_some() && state.failure.is_none())
            .map(|(&handle, _)| handle)
            .collect();
        for &handle in &armed {
            match self.drive(handle, Instant::now() + slice) {
                Ok(_) => {}
                Err(failure) if failure.class == ErrorClass::Timeout => {}
                Err(failure) => {
                    if let Some(state) = self.requests.get_mut(&handle) {
                        state.failure = Some(failure);
                    }
                }
            }
        }
        !armed.is_empty()
    }

    pub fn commit(&mut self, handle: u64) -> Result<usize, Failure> {
        let state = self.request(handle)?;
        if state.direction != Direction::Store {
            return Err(Failure::new(ErrorClass::InvalidState, "commit on a retrieve request: finish it"));
        }
        if let Some(layer) = state.in_flight {
            return Err(Failure::new(ErrorClass::InvalidState, format!("layer {layer} is still in flight: wait for it before commit")));
        }
        let remote = self.is_remote();
        let committed = self.layer_store()?.commit_store(RequestHandle::from_bits(handle));
        if remote {
            self.touch_daemon();
        }
        match committed {
            // A refusal the store reports before anything happened leaves the request live
            // (a layer not stored: store it, then commit again).
            Err(ObjstoreError::HandleState { handle: bits, reason }) => {
                Err(Failure::from(ObjstoreError::HandleState { handle: bits, reason }))
            }
            other => {
                self.requests.remove(&handle);
                Ok(other?)
            }
        }
    }

    pub fn finish(&mut self, handle: u64) -> Result<(), Failure> {
        if let Some(layer) = self.request(handle)?.in_flight {
            return Err(Failure::new(ErrorClass::InvalidState, format!("layer {layer} is in flight: wait for it before finish")));
        }
        let remote = self.is_remote();
        let finished = self.layer_store()?.finish(RequestHandle::from_bits(handle));
        if remote {
            self.touch_daemon();
        }
        self.requests.remove(&handle);
        Ok(finished?)
    }

    /// The pool's DMA allocator and data pointer mode (in-process, before registration).
    fn local_dma(pool: &Pool) -> (Arc<dyn DmaAllocator>, DataPointerMode) {
        let sgl = (0..pool.device_count()).all(|device| pool.target(device).controller.data_pointer_mode() == DataPointerMode::Sgl);
        (pool.target(0).controller.dma().clone(), if sgl { DataPointerMode::Sgl } else { DataPointerMode::Prp })
    }

    /// In-process: builds the `KvStore` over the pool with `layout` (IOVAs) registered.
    fn build_local(&mut self, layout: StoreLayout, num_blocks: u32) -> Result<(), Failure> {
        let Backend::LocalOpen { .. } = &self.backend else {
            return Err(Failure::new(ErrorClass::InvalidState, "KV memory is registered already (once per store)"));
        };
        let Backend::LocalOpen { pool, emulators, locks, config, queue_depth } = std::mem::replace(&mut self.backend, Backend::Closed)
        else {
            unreachable!("matched above")
        };
        let (dma, mode) = Self::local_dma(&pool);
        // The registration and the executor first: their refusals leave the pool open for
        // another try. A failure of `KvStore::new` itself consumes the pool: the store is then
        // closed.
        let prepared = KvRegistration::new(*pool.geometry(), num_blocks, layout, mode)
            .and_then(|registration| Ok((registration, cpu_executor_for(&pool, queue_depth, &config)?)));
        let (registration, executor) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => {
                self.backend = Backend::LocalOpen { pool, emulators, locks, config, queue_depth };
                return Err(Failure::from(error));
            }
        };
        match KvStore::new(pool, registration, dma, executor, config) {
            Ok(mut store) => {
                if let Some((fingerprint, rank, world)) = &self.key_space {
                    store.set_key_seed(key_seed(fingerprint, *rank, *world)?);
                }
                self.backend = Backend::Local { store: Box::new(store), emulators, locks };
                Ok(())
            }
            Err(error) => Err(Failure::from(error)),
        }
    }

    /// `register_kv`: caller memory mapped for the pool's devices (in-process), or device
    /// memory registered with tuttid (CUDA tensors, a stand-in; `device_memory`).
    pub fn register(&mut self, checked: CheckedLayout, keeps: Vec<Keep>, timeout: Duration) -> Result<(), Failure> {
        if let Some(registered) = &self.registered {
            return if *registered == checked {
                Ok(()) // the same memory again (an engine handing back an allocation)
            } else {
                Err(Failure::new(ErrorClass::InvalidState, "KV memory is registered already (once per store), and it is other memory"))
            };
        }
        match &self.backend {
            Backend::LocalOpen { .. } if checked.device != Device::Cpu => Err(Failure::new(
                ErrorClass::UnsupportedMemory,
                format!(
                    "the tensors are on {}: an in-process store reaches only CPU memory; attach to tuttid started with \
                     --device-memory cuda (Store.attach) to register GPU memory",
                    checked.device
                ),
            )),
            Backend::LocalOpen { .. } => self.register_caller_memory(checked, keeps),
            Backend::RemoteAttached { .. } => match device_memory::export(&checked)? {
                Some(range) => self.register_device_memory(checked, keeps, range, timeout),
                None => Err(Failure::new(
                    ErrorClass::UnsupportedMemory,
                    "tuttid cannot map CPU memory this process allocated: allocate the KV cache with store.allocate_kv(num_blocks, kind) \
                     and build the engine's tensors over its buffers, or register CUDA tensors (tuttid started with --device-memory cuda)",
                )),
            },
            Backend::Closed => Err(closed()),
            Backend::Local { .. } | Backend::Remote { .. } => unreachable!("a registered store has `registered` set"),
        }
    }

    /// Device memory (`device_memory::export` made `range` of `checked`'s span) registered with
    /// tuttid, the layout as offsets in it; the session's data path set up over it. A refusal
    /// (tuttid started without --device-memory, a pool with a vfio: device) is raised as
    /// UnsupportedMemory with tuttid's reason; it ends the session (the store is closed then).
    fn register_device_memory(
        &mut self,
        checked: CheckedLayout,
        keeps: Vec<Keep>,
        range: device_memory::DeviceRange,
        timeout: Duration,
    ) -> Result<(), Failure> {
        let Backend::RemoteAttached { client, hello, mut config } = std::mem::replace(&mut self.backend, Backend::Closed) else {
            unreachable!("register matched RemoteAttached")
        };
        config.kv_blocks = checked.num_blocks;
        config.timeout = timeout;
        let session = hello.session;
        let layout = store_layout(&checked, &device_memory::offsets(&checked, range.start));
        let connected = RemoteKvStore::with_client_and_device_memory(client, hello, &config, &range.memory, layout);
        self.touch_daemon();
        match connected {
            Ok(store) => {
                self.backend = Backend::Remote { store: Box::new(store) };
                // No command was issued before the store existed: on failure the keeps go now.
                let socket = self.daemon_socket.clone().unwrap_or_default();
                self.device_memory = Some(DeviceHold { keeps, holder: range.holder, socket, session });
                self.registered = Some(checked);
                Ok(())
            }
            Err(error) => {
                let failure = Failure::from(&error);
                if failure.code.as_deref() == Some("Unsupported") {
                    return Err(Failure {
                        class: ErrorClass::UnsupportedMemory,
                        message: format!("tuttid refused the KV memory as device memory: {}", failure.message),
                        ..failure
                    });
                }
                Err(failure)
            }
        }
    }

    /// `register_kv` with caller memory (in-process): maps each tensor, registers the layout.
    fn register_caller_memory(&mut self, checked: CheckedLayout, keeps: Vec<Keep>) -> Result<(), Failure> {
        let dma = match &self.backend {
            Backend::LocalOpen { pool, .. } => Self::local_dma(pool).0,
            _ => unreachable!("register matched LocalOpen"),
        };
        let mut mapped = Vec::with_capacity(keeps.len());
        for (tensor, keep) in checked.tensors.iter().zip(keeps) {
            match crate::ffi::map_caller_memory(&dma, tensor.address, tensor.extent_bytes, keep) {
                Ok(memory) => mapped.push(memory),
                Err(error) => {
                    for memory in mapped {
                        self.released.extend(CallerMemory::release(memory, &QueuesGone::never_used()));
                    }
                    return Err(Failure::from(error));
                }
            }
        }
        let iovas: Vec<Iova> = mapped.iter().map(CallerMemory::iova).collect();
        let layout = store_layout(&checked, &iovas);
        if let Err(failure) = self.build_local(layout, checked.num_blocks) {
            for memory in mapped {
                self.released.extend(memory.release(&QueuesGone::never_used()));
            }
            return Err(failure);
        }
        self.caller_memory = mapped;
        self.registered = Some(checked);
        Ok(())
    }

    /// `allocate_kv`: allocates `num_blocks` blocks in layout `kind` and registers them; returns
    /// the regions (what the KvBuffers hand out).
    pub fn allocate(&mut self, kind: LayoutKind, num_blocks: u32, timeout: Duration) -> Result<Vec<DmaRegion>, Failure> {
        if self.registered.is_some() {
            return Err(Failure::new(ErrorClass::InvalidState, "KV memory is registered already (once per store)"));
        }
        if num_blocks == 0 {
            return Err(Failure::new(ErrorClass::InvalidArgument, "allocate_kv(0 blocks): expected at least 1"));
        }
        let regions = match &mut self.backend {
            Backend::LocalOpen { pool, .. } => {
                let geometry = *pool.geometry();
                let (dma, _) = Self::local_dma(pool);
                let sizes = region_bytes(kind, &geometry, num_blocks)?;
                let regions = sizes
                    .iter()
                    .map(|&bytes| dma.allocate(bytes as usize).and_then(|region| region.subregion(0, bytes as usize)))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|error| Failure::new(ErrorClass::Device, format!("allocating {num_blocks} KV blocks: {error}")))?;
                let iovas: Vec<Iova> = regions.iter().map(DmaRegion::iova).collect();
                let checked = allocation_layout(kind, &geometry, num_blocks, &regions);
                let layout = store_layout(&checked, &iovas);
                self.build_local(layout, num_blocks)?;
                self.allocation = Some(Allocation { regions: regions.clone(), checked: checked.clone() });
                self.registered = Some(checked);
                regions
            }
            Backend::RemoteAttached { .. } => {
                let Backend::RemoteAttached { client, hello, mut config } = std::mem::replace(&mut self.backend, Backend::Closed) else {
                    unreachable!("matched above")
                };
                config.kv_blocks = num_blocks;
                config.timeout = timeout;
                let geometry = crate::geometry::of_hello(&hello.shape);
                let window = match kind {
                    LayoutKind::Separate => WindowKvLayout::SeparateKv,
                    LayoutKind::Fused => WindowKvLayout::FusedPerLayer,
                    LayoutKind::Paged => WindowKvLayout::PagedPerLayer,
                    LayoutKind::BlockMajor => WindowKvLayout::BlockMajor,
                };
                // A failure here leaves the session gone (the client is consumed): the store is
                // closed and says so.
                let store = RemoteKvStore::with_client(client, hello, &config, window)?;
                self.touch_daemon();
                // The window's regions are page-rounded: hand out exactly the KV bytes.
                let sizes = region_bytes(kind, &geometry, num_blocks)?;
                let regions = store
                    .kv_regions()
                    .iter()
                    .zip(&sizes)
                    .map(|(region, &bytes)| region.subregion(0, bytes as usize))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(Failure::from)?;
                let checked = allocation_layout(kind, &geometry, num_blocks, &regions);
                self.backend = Backend::Remote { store: Box::new(store) };
                self.allocation = Some(Allocation { regions: regions.clone(), checked: checked.clone() });
                self.registered = Some(checked);
                regions
            }
            Backend::Closed => return Err(closed()),
            Backend::Local { .. } | Backend::Remote { .. } => unreachable!("a registered store has `registered` set"),
        };
        Ok(regions)
    }

    /// Ends every request (a layer in flight is waited for until `deadline`), then the store:
    /// queue pairs deleted before the registered memory is let go; kept for good if one could
    /// not be. Returns how many tensors were kept for good. What keeps released memory alive
    /// goes to `released` (dropped once the lock is let go).
    ///
    /// Attached stores: the queue pairs are tuttid's to delete, when the session ends (the
    /// connection closes here). A layer still in flight at the deadline may move bytes until
    /// then, so its memory (tuttid's window for `allocate_kv`, device memory) is only given
    /// back once tuttid no longer lists the session and counted no new leaked queue pair
    /// (tuttid deletes a session's pairs, confirmed by the controller, before it drops the
    /// session; a pair it could not delete is counted in `leaked_queue_pairs`); otherwise it
    /// is kept for good and counted in `leaked_registrations`.
    pub fn close(&mut self, deadline: Instant) -> usize {
        let handles: Vec<u64> = self.requests.keys().copied().collect();
        // Whether every layer in flight completed: device memory's bytes are moved by tuttid's
        // copies, which only a command in flight makes.
        let mut settled = true;
        for handle in handles {
            loop {
                match self.drive(handle, Instant::now() + WAIT_SLICE) {
                    Err(failure) if failure.class == ErrorClass::Timeout && Instant::now() < deadline => continue,
                    Err(failure) if failure.class == ErrorClass::Timeout => {
                        settled = false;
                        break;
                    }
                    _ => break,
                }
            }
            let bits = RequestHandle::from_bits(handle);
            if let Ok(store) = self.layer_store() {
                if let Err(error) = store.finish(bits) {
                    tracing::warn!(%error, "tutti: finishing request {handle:#x} at close");
                }
            }
        }
        self.requests.clear();
        let remote = matches!(self.backend, Backend::Remote { .. });
        let release_wait = deadline.max(Instant::now() + DEVICE_RELEASE_WAIT);
        // Before the connection closes: tuttid's count of leaked queue pairs, to tell a session
        // that ended cleanly from one whose pair could not be deleted.
        let leaks_before = match (&self.daemon_socket, remote && !settled) {
            (Some(socket), true) => device_memory::leaked_queue_pairs(socket, release_wait),
            _ => device_memory::LeakCount::NoAnswer,
        };
        let backend = std::mem::replace(&mut self.backend, Backend::Closed);
        let deleted = match backend {
            Backend::Local { store, emulators, locks } => {
                let deleted = store.close();
                drop(emulators);
                drop(locks);
                deleted
            }
            // The client's pairs are the daemon's to delete (when the session ends, after this
            // drop closes the connection); its window stays mapped by the daemon until then.
            Backend::Remote { store } => {
                drop(store);
                true
            }
            other => {
                drop(other);
                true
            }
        };
        // A layer left in flight through tuttid: nothing may be given back before the session
        // ended cleanly.
        let ended_cleanly = match (&self.daemon_socket, self.daemon_session, leaks_before) {
            (_, _, device_memory::LeakCount::NoDaemon) => true,
            (Some(socket), Some(session), device_memory::LeakCount::Counted(before)) => {
                device_memory::session_ended_cleanly(socket, session, before, release_wait)
            }
            _ => false,
        };
        let memory = std::mem::take(&mut self.caller_memory);
        let mut leaked = 0;
        match QueuesGone::after_close(deleted) {
            Some(proof) => {
                for memory in memory {
                    self.released.extend(memory.release(&proof));
                }
            }
            None => {
                leaked = memory.len();
                drop(memory); // leaks each (CallerMemory's drop)
            }
        }
        let window_reachable = remote && !settled && !ended_cleanly;
        if let Some(allocation) = self.allocation.take() {
            if !deleted || (window_reachable && self.device_memory.is_none()) {
                tracing::error!(
                    regions = allocation.regions.len(),
                    "tutti: the KV memory is kept for good: a layer was still in flight and the devices may still reach it"
                );
                leaked += allocation.regions.len();
                allocation.regions.into_iter().for_each(|region| {
                    region.leak();
                });
            }
        }
        if let Some(hold) = self.device_memory.take() {
            // The connection is closed (the store dropped above): tuttid ends the session.
            let (kept, keeps) = hold.release(settled || ended_cleanly, release_wait);
            leaked += kept;
            self.released.extend(keeps);
        }
        self.leaked_tensors += leaked;
        leaked
    }
}

impl Drop for StoreState {
    fn drop(&mut self) {
        if !self.is_closed() {
            self.close(Instant::now() + Duration::from_secs(5));
        }
    }
}

/// tuttid's key seed of (fingerprint, rank, world), for an in-process store in the same space.
pub fn key_seed(fingerprint: &[u8; 32], rank: u32, world: u32) -> Result<u64, Failure> {
    tutti_daemon::keys::KeySpace::new(fingerprint, rank, world)
        .map(|space| space.seed())
        .map_err(|reason| Failure::new(ErrorClass::InvalidArgument, reason))
}

/// Sizes of the regions `allocate_kv` makes for `kind` (as tuttid's window lays them out).
fn region_bytes(kind: LayoutKind, geometry: &objstore::ModelGeometry, num_blocks: u32) -> Result<Vec<u64>, Failure> {
    let unit = kind.unit_bytes(geometry);
    let per_tensor = match kind {
        LayoutKind::Fused => 2 * unit,
        _ => unit,
    };
    let bytes = per_tensor
        .checked_mul(u64::from(num_blocks))
        .filter(|&bytes| usize::try_from(bytes).is_ok())
        .ok_or_else(|| Failure::new(ErrorClass::InvalidArgument, format!("{num_blocks} KV blocks of {geometry} overflow")))?;
    Ok(vec![bytes; kind.tensor_count(geometry.layers)])
}

/// The checked layout of an allocation (host addresses of `regions`).
fn allocation_layout(kind: LayoutKind, geometry: &objstore::ModelGeometry, num_blocks: u32, regions: &[DmaRegion]) -> CheckedLayout {
    let unit = kind.unit_bytes(geometry);
    let extent = if kind == LayoutKind::Fused { 2 * unit * u64::from(num_blocks) } else { unit * u64::from(num_blocks) };
    CheckedLayout {
        kind,
        num_blocks,
        block_stride_bytes: unit,
        device: crate::tensor::Device::Cpu,
        tensors: regions
            .iter()
            .map(|region| crate::tensor::PlacedTensor { address: region.host_address() as u64, extent_bytes: extent })
            .collect(),
    }
}

/// objstore's layout over the tensors' IOVAs.
fn store_layout(checked: &CheckedLayout, iovas: &[Iova]) -> StoreLayout {
    let stride = checked.block_stride_bytes;
    match checked.kind {
        LayoutKind::Separate => {
            let (keys, values) = iovas.split_at(iovas.len() / 2);
            StoreLayout::SeparateKv { key_bases: keys.to_vec(), value_bases: values.to_vec(), block_stride_bytes: stride }
        }
        LayoutKind::Fused => StoreLayout::FusedPerLayer { layer_bases: iovas.to_vec(), block_stride_bytes: stride },
        LayoutKind::Paged => StoreLayout::PagedPerLayer { layer_bases: iovas.to_vec(), block_stride_bytes: stride },
        LayoutKind::BlockMajor => StoreLayout::BlockMajor { base: iovas[0], block_stride_bytes: stride },
    }
}
