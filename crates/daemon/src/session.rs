//! What one session holds on the store path, and the requests that change it: registered
//! memory windows, the queue pairs created in them, and the requests it reserved in the pool.
//! A session may name only its own registrations and handles (another session's, or a stale
//! one, is [`ErrorCode::NotYours`]); every holding is capped per session.
//!
//! A client rings its pairs' doorbells through the software controller's shared register page
//! where there is one, and through the daemon's doorbell relay otherwise (a VFIO device, whose
//! BAR0 stays here; a software controller in relay mode): see [`crate::relay`].
//!
//! `Commit` and `Release` carry the client's report on its request (what its data path moved,
//! the blocks its verification found corrupt): checked against the request's grant
//! (`crate::report`) before it is counted in `/metrics` or blocks are evicted.
//!
//! Ending a session ([`Holdings::release`]) goes in the one safe order: stop relaying its
//! doorbells, delete its queue pairs (only once the controller confirmed the deletion may anything they could write be reused),
//! then release its reservations (uncommitted stores never become visible: the commit rule),
//! then unmap its windows and give back their claims (a window's memfd is claimed like device
//! memory, `crate::gpu_memory`: nobody else's window or device memory while it is registered).
//! A queue pair whose deletion fails is kept for good, and with it the session's windows, their
//! claims and its reservations (leaked, counted, logged); so is everything of a session one of
//! whose queue creations may still execute (its Create I/O SQ timed out: the late queue's
//! restriction allows the window and device memory). A deletion that could not be confirmed
//! for now (the admin queue busy with a late command, or the Delete timed out) is not a failure:
//! the pairs and everything they may write wait in a [`Retiring`], retried every tick by the
//! server until the controller confirms (then all is given back) or a definite error keeps all;
//! one still unconfirmed past the server's bound (eight admin timeouts per pair and a second
//! while serving, the drain's window at a stop: `crate::server`) is kept for good too.

use std::ops::Range;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use nvme_driver::hw::{DmaRegion, SharedMemory};
use nvme_driver::spec::{COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use nvme_driver::{DataPointerMode, DetachedQueuePair, NamespaceId, NvmeError};
use nvme_emu::{EmuDevice, QueueRestriction};
use objstore::{MismatchedBlock, NoLender, ObjstoreError, Placement, PoolShape, PoolTarget, RequestHandle, StoreControl, Transferred};

use crate::gpu_memory::{Claim, DeviceMemoryService};
use crate::keys::KeySpace;
use crate::metrics::Metrics;
use crate::protocol::{
    block_named_twice, AttachQueues, Commit, ErrorCode, NamespaceGrant, Prepare, QueueGrant, RegisterMemory, Registered, Reply,
    RetrievePrepared, StorePrepared, PREPARE_BLOCKS_MAX,
};
use crate::relay::{DoorbellRelay, PairCounters, RelayTicket};
use crate::report::{self, Refusal};

/// Per-session caps (a `ServerConfig` setting).
#[derive(Debug, Clone, Copy)]
pub struct SessionLimits {
    /// Memory windows a session may register.
    pub registrations_max: usize,
    /// Bytes all of a session's windows may hold together.
    pub window_bytes_max: u64,
    /// Requests a session may hold prepared (not yet committed or released).
    pub requests_max: usize,
    /// Deepest client queue pair.
    pub queue_depth_max: u32,
}

impl Default for SessionLimits {
    /// 4 windows, 64 GiB in all, 32 requests, queues of up to 1024 entries.
    fn default() -> Self {
        Self { registrations_max: 4, window_bytes_max: 64 << 30, requests_max: 32, queue_depth_max: 1024 }
    }
}

/// The pool's control half and the devices the clients' queue pairs live on.
pub struct StoreState {
    pub control: StoreControl,
    /// Per pool device: the software controller (its register page, its queue restrictions);
    /// `None` for a VFIO device.
    pub emulators: Vec<Option<Arc<EmuDevice>>>,
    /// Forwards clients' doorbells on devices without a shared register page.
    pub relay: DoorbellRelay,
}

/// Counters of what could not be given back (shown in status and `/metrics`).
#[derive(Debug, Default)]
pub struct LeakCounters {
    pub queue_pairs: AtomicU64,
    /// Windows kept mapped for good (a queue pair that may still write them was not deleted),
    /// and their bytes.
    pub windows: AtomicU64,
    pub window_bytes: AtomicU64,
    /// Requests whose reservations are kept for good (their slots never reused).
    pub requests: AtomicU64,
    /// Not a leak: sessions whose queue pairs hold queue ids on the pool's devices (attached,
    /// being deleted, or kept for good; one id per device each), what an attach is admitted
    /// against ([`Holdings::attach`]).
    pub queue_id_holders: AtomicU64,
    /// Not a leak: of those holders, the ended sessions whose pairs' deletion is not confirmed
    /// yet ([`Retiring`]): ids that come free once the controller confirms. An attach they
    /// alone keep from a controller's last id is answered `Busy` (retry), not `LimitReached`.
    pub queue_id_holders_retiring: AtomicU64,
}

/// One registered window: the daemon's mapping of the client's memfd (every region over it,
/// the queue rings included, holds the mapping), the queue pairs in it, and its claim on the
/// memfd (given back with the registration, after its queue pairs were deleted).
struct Registration {
    id: u64,
    window: DmaRegion,
    kv_blocks: u32,
    queues: Vec<DetachedQueuePair>,
    /// The relay's tickets for those of `queues` whose doorbells it forwards.
    relayed: Vec<RelayTicket>,
    /// Of `queues`, those whose doorbells are in a software controller's shared register page,
    /// which the client writes directly. Counted apart from `relayed`: a failed attach takes its
    /// pairs off the relay but keeps any whose deletion failed, and such a pair on a relayed
    /// device is rung by nobody.
    shared_register_pairs: usize,
    _claim: Claim,
}

/// Everything a session holds beyond its record.
#[derive(Default)]
pub struct Holdings {
    registrations: Vec<Registration>,
    device_memory: Vec<device_memory::DeviceRegistration>,
    handles: Vec<RequestHandle>,
    /// Counted in [`LeakCounters::queue_id_holders`]: set when an attach left queue pairs here,
    /// uncounted once all of them are known deleted (never when they are kept for good).
    holds_queue_ids: bool,
    /// Queue creations that may still execute: their Create I/O SQ was sent and not answered
    /// (the driver kept the rings and the queue id for good), so the queue may appear later,
    /// restricted to the session's window and device memory (the preset kept pending, which
    /// its client can ring through the shared register page). Non-zero, release keeps the
    /// windows, device memory, claims and reservations for good, as for an undeleted pair.
    creations_unsettled: u64,
    /// Scratch: a request's block keys and CRCs.
    keys: Vec<u64>,
    /// Scratch: a request's engine block ids, sorted to find one named twice.
    sorted_blocks: Vec<u32>,
    crcs: Vec<u32>,
}

mod device_memory;

fn refused((code, message): Refusal) -> Reply {
    Reply::error(code, message)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn store_error(context: &str, error: ObjstoreError) -> Reply {
    let code = match error {
        ObjstoreError::BadRequest { .. } | ObjstoreError::BadPlacement { .. } | ObjstoreError::BlockOutOfRange { .. } => {
            ErrorCode::BadRequest
        }
        ObjstoreError::TooManyRequests { .. } | ObjstoreError::PoolFull { .. } => ErrorCode::LimitReached,
        _ => ErrorCode::StoreFailed,
    };
    Reply::error(code, format!("{context}: {error}"))
}

impl Holdings {
    /// Windows and device-memory registrations.
    pub fn registrations(&self) -> u32 {
        (self.registrations.len() + self.device_memory.len()) as u32
    }

    /// Host memory the session's registrations keep mapped in the daemon.
    fn host_bytes_held(&self) -> u64 {
        let windows: u64 = self.registrations.iter().map(|registration| registration.window.len() as u64).sum();
        windows + self.device_memory.iter().map(|device| device.host_bytes).sum::<u64>()
    }

    pub fn queue_pairs(&self) -> u32 {
        self.registrations.iter().map(|registration| registration.queues.len() as u32).sum()
    }

    /// Whether one of the session's queue pairs has its doorbells in a software controller's
    /// shared register page (which the client writes directly) rather than behind the relay.
    pub fn rings_shared_registers(&self) -> bool {
        self.registrations.iter().any(|registration| registration.shared_register_pairs > 0)
    }

    pub fn requests_in_flight(&self) -> u32 {
        self.handles.len() as u32
    }

    /// The relay's counters of every relayed pair of the session (none on devices with a
    /// shared register page).
    pub fn relay_counters(&self) -> Vec<Arc<PairCounters>> {
        self.registrations.iter().flat_map(|registration| registration.relayed.iter().map(|ticket| Arc::clone(ticket.counters()))).collect()
    }

    /// The block keys of the last prepared request (its whole prefix, from block 0).
    pub fn request_keys(&self) -> &[u64] {
        &self.keys
    }

    /// Whether the session holds request `handle` (prepared, not yet committed or released).
    pub fn holds(&self, handle: u64) -> bool {
        self.handles.iter().any(|own| own.to_bits() == handle)
    }

    fn registration(&self, id: u64) -> Result<usize, Refusal> {
        self.registrations
            .iter()
            .position(|registration| registration.id == id)
            .ok_or_else(|| (ErrorCode::NotYours, format!("registration {id} is not one this session made")))
    }

    fn owns(&self, handle: u64) -> Result<usize, Refusal> {
        self.handles
            .iter()
            .position(|own| own.to_bits() == handle)
            .ok_or_else(|| (ErrorCode::NotYours, format!("request handle {handle:#x} is not one this session holds")))
    }

    /// `RegisterMemory`: checks the memfd (sealed, as long as claimed), claims it (`service`'s
    /// overlap check: no other registration of this session's or another's holds it, as a
    /// window or as device memory), maps it into the pool devices' one DMA space.
    #[allow(clippy::too_many_arguments)] // the session's context, as for `register_device_memory`
    pub fn register(
        &mut self,
        request: RegisterMemory,
        fds: &mut Vec<OwnedFd>,
        store: &Mutex<StoreState>,
        limits: &SessionLimits,
        block_bytes: u64,
        next_id: &AtomicU64,
        service: &DeviceMemoryService,
        session: u64,
    ) -> Reply {
        if fds.len() != 1 {
            return Reply::error(ErrorCode::BadRequest, format!("RegisterMemory takes one descriptor (a sealed memfd), got {}", fds.len()));
        }
        if self.registrations() as usize >= limits.registrations_max {
            return Reply::error(ErrorCode::LimitReached, format!("a session registers at most {} windows", limits.registrations_max));
        }
        let held = self.host_bytes_held();
        if request.window_bytes == 0 || !request.window_bytes.is_multiple_of(4096) || usize::try_from(request.window_bytes).is_err() {
            return Reply::error(
                ErrorCode::BadRequest,
                format!("window of {} bytes: expected a positive multiple of 4096", request.window_bytes),
            );
        }
        if held.saturating_add(request.window_bytes) > limits.window_bytes_max {
            return Reply::error(
                ErrorCode::LimitReached,
                format!("{} more bytes over the session's {held}: the cap is {}", request.window_bytes, limits.window_bytes_max),
            );
        }
        // No KV blocks: a window of rings and tables only, for KV memory registered as device
        // memory (`RegisterDeviceMemory`).
        let kv_bytes = u64::from(request.kv_blocks).checked_mul(block_bytes);
        if kv_bytes.is_none_or(|bytes| bytes > request.window_bytes) {
            return Reply::error(
                ErrorCode::BadRequest,
                format!("{} KV blocks of {block_bytes} bytes do not fit a window of {} bytes", request.kv_blocks, request.window_bytes),
            );
        }
        let Some(fd) = fds.pop() else { return Reply::error(ErrorCode::BadRequest, "no descriptor") };
        let memory = match SharedMemory::from_fd(fd, request.window_bytes as usize) {
            Ok(memory) => memory,
            Err(error) => return Reply::error(ErrorCode::BadRequest, format!("the window descriptor: {error}")),
        };
        let dma = {
            let store = lock(store);
            let pool = store.control.pool();
            let dma = Arc::clone(pool.target(0).controller.dma());
            if (1..pool.device_count()).any(|device| pool.target(device).controller.dma().address_space() != dma.address_space()) {
                return Reply::error(
                    ErrorCode::Unsupported,
                    "the pool's devices are in several DMA spaces: a window cannot be mapped for all",
                );
            }
            dma
        };
        // Claimed before it is mapped: a refused window pins nothing.
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        let claim = match service.claim_window(&memory, session, id) {
            Ok(claim) => claim,
            Err(refusal) => return refused(refusal),
        };
        // Mapped outside the pool lock: on VFIO this pins and maps the whole window (up to
        // `window_bytes_max`, seconds for tens of GiB), which must not stall every other
        // session's lookups and commits. Nothing here needs the lock: the allocator places the
        // window at an IOVA range of its own (its own lock keeps ranges apart), and the
        // registration is this session's alone until the reply names it.
        let window = match dma.map_shared(&memory) {
            Ok(window) => window,
            Err(error) => return Reply::error(ErrorCode::StoreFailed, format!("mapping the window for the devices: {error}")),
        };
        let reply = Registered { registration: id, iova_base: window.iova().0, address_space: dma.address_space().0 };
        self.registrations.push(Registration {
            id,
            window,
            kv_blocks: request.kv_blocks,
            queues: Vec::new(),
            relayed: Vec::new(),
            shared_register_pairs: 0,
            _claim: claim,
        });
        Reply::Registered(reply)
    }

    /// `AttachQueues`: one detached pair per pool device on rings in the window, each SQ
    /// restricted to the window's IOVAs and the pool's LBAs (on a software controller); the
    /// doorbell pages' memfds go back with the reply: a software controller's shared register
    /// page, or else a relay page of the pair's own (relayed from here on).
    ///
    /// One attach per session: each software controller is started with one I/O queue pair per
    /// client (`--clients-max`) plus the pool's metadata pair and a spare for a temporary one
    /// (`crate::pool_open`), so a session that attached on a second window would take another
    /// client's pair, and then the pool's spare. A second attach is `LimitReached`, and so is an
    /// attach that would leave a controller fewer than `reserved` free ids (the pool's own and,
    /// on a cluster node, the data plane's: `crate::pool_open::queue_pairs_reserved`): every
    /// session whose pairs hold ids counts (`leaks.queue_id_holders`: attached, being deleted,
    /// kept for good), and so do pairs the driver leaked. A creation that fails for now (the
    /// admin queue busy with a late command, most often an ended session's Delete) is `Busy`,
    /// leaving nothing behind, so the client asks again on the same registration
    /// (`creation_refused`).
    ///
    /// Attaches are one at a time (`attaching`, the server's one lock for them), from their
    /// admission to their count; the pool lock (`store`) is taken only to copy out what the
    /// attach needs of the pool and to add or remove relayed pairs, never across an admin
    /// command: each Create I/O CQ and SQ (and an undo's Deletes) may wait out the admin
    /// timeout, 10 s by default, during which every other session's lookups, prepares, commits
    /// and releases, status and `/metrics` would wait too (clients give up at 5 s).
    ///
    /// Once `stopping` says the daemon stops, no queue is created (`ShuttingDown`): the drain
    /// releases every session at once, freeing the queue ids of clients that may still ring
    /// them, and a queue created then could take such an id (the departed client's doorbell
    /// writes would move its tail). Checked under the attach lock, where an attach read before
    /// the stop may have waited out another's admin commands, and before each device's creation.
    #[allow(clippy::too_many_arguments)] // the session's context, as for `register`
    pub fn attach(
        &mut self,
        request: AttachQueues,
        store: &Mutex<StoreState>,
        attaching: &Mutex<()>,
        stopping: &dyn Fn() -> bool,
        limits: &SessionLimits,
        leaks: &LeakCounters,
        reserved: u16,
    ) -> (Reply, Vec<OwnedFd>) {
        let _attaching = lock(attaching);
        if stopping() {
            return (Reply::error(ErrorCode::ShuttingDown, "tuttid is shutting down: no queue pairs are created"), Vec::new());
        }
        let index = match self.registration(request.registration) {
            Ok(index) => index,
            Err(refusal) => return (refused(refusal), Vec::new()),
        };
        // The pool's devices (their controllers, shared and fixed for the pool's life), its
        // software controllers and its shape: all the attach reads of the pool.
        let (targets, emulators, shape) = {
            let store = lock(store);
            let pool = store.control.pool();
            let targets: Vec<PoolTarget> = (0..pool.device_count()).map(|device| pool.target(device).clone()).collect();
            (targets, store.emulators.clone(), pool.shape())
        };
        let devices = targets.len();
        let refuse = |code, message: String| (Reply::error(code, message), Vec::new());
        if !self.registrations[index].queues.is_empty() {
            return refuse(ErrorCode::BadRequest, format!("registration {} has its queue pairs already", request.registration));
        }
        if let Some(attached) = self.registrations.iter().find(|registration| !registration.queues.is_empty()) {
            return refuse(
                ErrorCode::LimitReached,
                format!(
                    "this session has its queue pairs already (on registration {}): a session gets one pair per pool device, \
                     since each controller has one per client (--clients-max)",
                    attached.id
                ),
            );
        }
        // Admission: each session holding ids holds one per device (at most), so a controller
        // has `holders + its driver's leaks` taken by clients; this attach takes one more and
        // must leave the pool its own (its metadata pair and the spare). Checked and counted
        // under the attach lock, so two attaches cannot both take the last one (only an attach
        // adds a holder; a session's release, not under it, only removes one meanwhile).
        let holders = leaks.queue_id_holders.load(Ordering::Acquire);
        for (device, target) in targets.iter().enumerate() {
            let controller = &target.controller;
            let granted = u64::from(controller.granted_queue_pairs());
            let driver_leaked = controller.leaked_queue_pairs();
            let taken = holders.saturating_add(driver_leaked);
            if taken.saturating_add(1 + u64::from(reserved)) > granted {
                let retiring = leaks.queue_id_holders_retiring.load(Ordering::Acquire);
                if retiring > 0 && taken.saturating_sub(retiring).saturating_add(1 + u64::from(reserved)) <= granted {
                    return refuse(
                        ErrorCode::Busy,
                        format!(
                            "pool device {device}: {retiring} ended session(s) hold I/O queue pairs whose deletion the controller \
                             has not confirmed yet (retried every tick); their queue ids come free once it does (unless it \
                             stays unconfirmed past the daemon's bound: then they are kept for good): retry the attach"
                        ),
                    );
                }
                return refuse(
                    ErrorCode::LimitReached,
                    format!(
                        "pool device {device} grants {granted} I/O queue pairs, {reserved} of them the daemon's \
                         (the pool's metadata pair and a spare, a cluster node's staging pair), and {holders} session(s) hold one (live, being deleted, or kept for good: \
                         {} queue pair(s) kept for good since start) besides {driver_leaked} the driver leaked: none is left for \
                         another client",
                        leaks.queue_pairs.load(Ordering::Relaxed)
                    ),
                );
            }
        }
        if request.rings.len() != devices {
            return refuse(ErrorCode::BadRequest, format!("{} ring pairs for a pool of {devices} devices", request.rings.len()));
        }
        if devices > crate::fd_passing::FDS_PER_FRAME_MAX {
            return refuse(
                ErrorCode::Unsupported,
                format!("{devices} devices: one reply carries {} register pages", crate::fd_passing::FDS_PER_FRAME_MAX),
            );
        }
        let shape = match shape {
            Ok(shape) => shape,
            Err(error) => return (store_error("the pool's shape", error), Vec::new()),
        };
        // Per device, the software controller's shared register page; `None`: relayed.
        let mut registers = Vec::with_capacity(devices);
        for (device, target) in targets.iter().enumerate() {
            let memory =
                emulators.get(device).and_then(|emulator| emulator.as_ref()).and_then(|emulator| emulator.shared_register_memory());
            let controller = &target.controller;
            if request.depth < 2 || request.depth > limits.queue_depth_max.min(controller.max_queue_depth()) {
                return refuse(
                    ErrorCode::BadRequest,
                    format!("queue depth {}: expected 2..={}", request.depth, limits.queue_depth_max.min(controller.max_queue_depth())),
                );
            }
            registers.push(memory);
        }
        // Which devices' pairs the client rings through a shared register page (the others get
        // a relay page below, in `registers` too).
        let shared_page: Vec<bool> = registers.iter().map(Option::is_some).collect();
        // Every queue of the session may reach the session's device memory too.
        let device_ranges: Vec<_> = self.device_memory.iter().map(|device| (device.region.iova(), device.region.len() as u64)).collect();
        let registration = &mut self.registrations[index];
        let window = registration.window.clone();
        let mut grants = Vec::with_capacity(devices);
        let mut created = Vec::with_capacity(devices);
        // Declared after `created`, so dropped before it on a panic's unwinding: the relay stops
        // forwarding for the pairs before their drop deletes them (the release's order).
        let mut relayed = RelayedByAttach { store, tickets: Vec::new() };
        let mut failure = None;
        let mut creations_unsettled = 0;
        for (device, rings) in request.rings.iter().enumerate() {
            if stopping() {
                failure = Some(Reply::error(ErrorCode::ShuttingDown, "tuttid is shutting down: no queue pairs are created"));
                break;
            }
            let ring = |offset: u64, entry_bytes: usize| {
                let bytes = request.depth as usize * entry_bytes;
                usize::try_from(offset).ok().and_then(|offset| window.subregion(offset, bytes).ok()).ok_or_else(|| {
                    (
                        ErrorCode::BadRequest,
                        format!("a ring of {bytes} bytes at offset {offset} is outside the window of {} bytes", window.len()),
                    )
                })
            };
            let rings = match (ring(rings.submission_offset, SUBMISSION_ENTRY_BYTES), ring(rings.completion_offset, COMPLETION_ENTRY_BYTES))
            {
                (Ok(submission), Ok(completion)) => (submission, completion),
                (Err(refusal), _) | (_, Err(refusal)) => {
                    failure = Some(refused(refusal));
                    break;
                }
            };
            let target = &targets[device];
            let controller = &target.controller;
            let device_layout = &shape.devices[device];
            let pool_blocks = device_layout.addressing.slot_blocks.saturating_mul(device_layout.slot_count);
            let restriction = device_ranges
                .iter()
                .fold(QueueRestriction::new().allow_memory(window.iova(), window.len() as u64), |restriction, &(iova, len)| {
                    restriction.allow_memory(iova, len)
                })
                .allow_blocks(target.namespace.0, device_layout.addressing.data_lba, pool_blocks);
            // Preset before Create I/O SQ, so the queue is restricted from the moment it exists:
            // with the shared register page any client can ring its doorbell right away. The
            // preset is dropped (removed if no Create I/O SQ took it) once the creation returned,
            // unless the creation may still execute (kept pending, below).
            let preset = match emulators[device].as_ref().map(|emulator| emulator.preset_restriction(rings.0.iova(), restriction)) {
                None => None,
                Some(Ok(preset)) => Some(preset),
                Some(Err(error)) => {
                    failure =
                        Some(Reply::error(ErrorCode::StoreFailed, format!("restricting the queue pair on pool device {device}: {error}")));
                    break;
                }
            };
            // Rings the driver leaks in a failed creation are those whose queues may exist on
            // the controller (their cleanup failed). Read under the attach lock, which every
            // client pair's creation takes; a leak elsewhere meanwhile (an ended session's
            // deletion, the pool's own pairs under the pool lock) only makes this creation's
            // rings read as leaked: its preset and the session's memory kept, never less.
            let leaked_before = controller.leaked_queue_pairs();
            let pair = match controller.create_detached_queue_pair(request.depth, Some(rings)) {
                Ok(pair) => pair,
                Err(error) => {
                    // A Create I/O SQ that was sent and whose outcome is unknown (it timed out)
                    // may still execute: the preset must be there when it does, or the queue
                    // would run unrestricted on the client's ring. The driver keeps such rings
                    // (and their queue ids) for good, so the kept preset never meets another
                    // queue, and kept presets are bounded by the leaked queue ids. Rings the
                    // driver did not leak (a Create I/O CQ that timed out, its SQ never sent,
                    // cleaned up once its late completion came) have no queue that may appear:
                    // the preset goes. What the restriction allows (the window, the device
                    // memory) is kept for good with it: the late queue may move it, rung by
                    // this client.
                    // A Create I/O SQ that ran but whose completion never came (the preset was
                    // taken: `queue_id` is Some) left a queue that certainly exists and is
                    // never deleted (its id is leaked): its memory is kept for good all the
                    // same, only its preset no longer needs keeping.
                    let rings_leaked = controller.leaked_queue_pairs() > leaked_before;
                    if rings_leaked && creation_may_still_execute(&error) {
                        tracing::warn!(
                            device,
                            %error,
                            "a client queue's creation may have executed or may still execute: its restriction stays with it, and \
                             the session's memory is kept for good"
                        );
                        creations_unsettled += 1;
                        if let Some(preset) = preset.filter(|preset| preset.queue_id().is_none()) {
                            preset.keep_pending();
                        }
                    }
                    failure = Some(creation_refused(device, &error, leaks.queue_id_holders_retiring.load(Ordering::Acquire)));
                    break;
                }
            };
            let layout = pair.layout();
            let applied_to = preset.as_ref().map(|preset| preset.queue_id());
            drop(preset);
            created.push(pair);
            if applied_to.is_some_and(|queue_id| queue_id != Some(layout.id.0)) {
                failure = Some(Reply::error(
                    ErrorCode::StoreFailed,
                    format!("restricting the queue pair on pool device {device}: its Create I/O SQ did not apply the restriction"),
                ));
                break;
            }
            if registers[device].is_none() {
                // Relayed from here on: the client gets its page with the reply, after this.
                match DoorbellRelay::make_page(controller.registers().as_ref(), &layout) {
                    Ok(page) => {
                        relayed.tickets.push(lock(store).relay.add(Arc::clone(&page), Arc::clone(controller.registers()), &layout));
                        // A bug's panic in the loop, for the test that the unwinding takes the
                        // pair off the relay.
                        #[cfg(test)]
                        assert!(
                            !tests::PANICS_AFTER_RELAYING.with(std::cell::Cell::get),
                            "test hook: the attach panics after relaying a pair"
                        );
                        registers[device] = Some(page);
                    }
                    Err(error) => {
                        failure = Some(Reply::error(ErrorCode::StoreFailed, format!("pool device {device}'s relay page: {error}")));
                        break;
                    }
                }
            }
            let register_bytes = registers[device].as_ref().map_or(0, |page| page.len() as u64);
            let namespace = match controller.namespace(NamespaceId(target.namespace.0)) {
                Ok(namespace) => namespace,
                Err(error) => {
                    failure = Some(Reply::error(ErrorCode::StoreFailed, format!("pool device {device}'s namespace: {error}")));
                    break;
                }
            };
            grants.push(QueueGrant {
                queue_id: layout.id.0,
                depth: layout.depth,
                submission_iova: layout.submission_iova.0,
                completion_iova: layout.completion_iova.0,
                submission_doorbell_offset: layout.submission_doorbell_offset as u64,
                completion_doorbell_offset: layout.completion_doorbell_offset as u64,
                namespaces: vec![NamespaceGrant {
                    nsid: namespace.id.0,
                    lba_bytes: namespace.block_size_bytes,
                    size_blocks: namespace.size_blocks,
                }],
                sgl: controller.data_pointer_mode() == DataPointerMode::Sgl,
                sgl_dword_lengths: controller.identify().sgl_support.dword_alignment_required(),
                max_transfer_bytes: controller.max_transfer_bytes(),
                register_fd: device as u8,
                register_bytes,
            });
        }
        // The descriptors the reply carries are duplicated before the pairs are stored, so that
        // a failure (EMFILE) is undone below like any other: after, the session would keep pairs
        // its client has no layout for, and refuse the client's retry.
        let mut fds = Vec::with_capacity(devices);
        if failure.is_none() {
            for memory in registers.iter().flatten() {
                match duplicate_descriptor(memory.fd().as_fd()) {
                    Ok(fd) => fds.push(fd),
                    Err(error) => {
                        failure = Some(Reply::error(ErrorCode::StoreFailed, format!("duplicating a register page descriptor: {error}")));
                        break;
                    }
                }
            }
        }
        // `created` holds device 0's pair first, one per device up to the failure (if any).
        registration.shared_register_pairs = shared_page.iter().take(created.len()).filter(|&&shared| shared).count();
        registration.queues = created;
        registration.relayed = relayed.keep();
        self.creations_unsettled += creations_unsettled;
        if let Some(reply) = failure {
            // The client has no layout yet, so nothing rings these: delete them now (a pair whose
            // deletion fails stays with the registration and is handled at session end), after
            // the relay stopped forwarding for them.
            if !registration.relayed.is_empty() {
                let store = lock(store);
                for ticket in registration.relayed.drain(..) {
                    store.relay.remove(&ticket);
                }
            }
            // `queues` holds device 0's pair first, one per device up to the failure.
            let (mut kept, mut undeleted_pairs) = (Vec::new(), Vec::new());
            registration.shared_register_pairs = 0;
            for (device, pair) in std::mem::take(&mut registration.queues).into_iter().enumerate() {
                if let Err(undeleted) = pair.delete() {
                    tracing::error!(device, error = %undeleted.source, "deleting a half-attached client queue pair");
                    undeleted_pairs.push(format!(
                        "the queue pair on pool device {device} (queue {}) could not be deleted: {}",
                        undeleted.pair.layout().id.0,
                        undeleted.source
                    ));
                    kept.push(*undeleted.pair);
                    registration.shared_register_pairs += usize::from(shared_page[device]);
                }
            }
            registration.queues = kept;
            if registration.queues.is_empty() {
                return (reply, Vec::new());
            }
            let registration_id = registration.id;
            self.count_queue_id_holder(leaks);
            // The registration keeps a pair, so the same attach asked again is refused ("has its
            // queue pairs already"): whatever the first failure was (Busy, which RemoteKvStore
            // answers by asking again, among others), the attach failed for this session.
            let first = match &reply {
                Reply::Error { message, .. } => message.as_str(),
                _ => "the attach failed",
            };
            let message = format!(
                "undoing a failed attach, {}: it stays with registration {registration_id} until the session ends, and the \
                 attach cannot be asked again in this session (what failed first: {first})",
                undeleted_pairs.join("; ")
            );
            return (Reply::error(ErrorCode::StoreFailed, message), Vec::new());
        }
        self.count_queue_id_holder(leaks);
        (Reply::Attached { queues: grants }, fds)
    }

    /// Counts the session among those whose pairs hold queue ids (once).
    fn count_queue_id_holder(&mut self, leaks: &LeakCounters) {
        if !self.holds_queue_ids {
            self.holds_queue_ids = true;
            leaks.queue_id_holders.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Checks a prepare request against the session and computes the keys of its prefix up to
    /// its last block into `self.keys`; returns the range of them that are the request's own
    /// (`first_block..first_block + block_ids.len()`).
    fn check_prepare(
        &mut self,
        prepare: &Prepare,
        space: &KeySpace,
        block_tokens: u32,
        limits: &SessionLimits,
    ) -> Result<Range<usize>, Refusal> {
        let kv_blocks = match self.device_memory.iter().find(|device| device.id == prepare.registration) {
            Some(device) => device.kv_blocks,
            None => self.registrations[self.registration(prepare.registration)?].kv_blocks,
        };
        if self.handles.len() >= limits.requests_max {
            return Err((ErrorCode::LimitReached, format!("a session holds at most {} prepared requests", limits.requests_max)));
        }
        let full = prepare.tokens.len() / block_tokens.max(1) as usize;
        let blocks = prepare.block_ids.len();
        if blocks > PREPARE_BLOCKS_MAX {
            // Refused before anything is reserved: the reply's placements would not fit a frame,
            // and a reservation whose reply cannot be sent could never be released.
            return Err((
                ErrorCode::BadRequest,
                format!("{blocks} block ids in one request; at most {PREPARE_BLOCKS_MAX} (retrieve a longer prefix in pieces, from its first block)"),
            ));
        }
        let first_block = prepare.first_block as usize;
        let end = first_block + blocks;
        if blocks == 0 || end > full {
            return Err((
                ErrorCode::BadRequest,
                format!(
                    "{blocks} block ids from block {first_block} for {} tokens ({full} full blocks of {block_tokens}); expected 1..={}",
                    prepare.tokens.len(),
                    full.saturating_sub(first_block)
                ),
            ));
        }
        if let Some(&block) = prepare.block_ids.iter().find(|&&block| block >= kv_blocks) {
            return Err((
                ErrorCode::BadRequest,
                format!("engine block {block} is outside registration {} of {kv_blocks} blocks", prepare.registration),
            ));
        }
        // Two of the request's blocks in one engine block: only one of them can be there, so
        // the reservation (and the evictions it may take) would be for nothing the client can
        // move; its own checks refuse it only after the daemon reserved. Refused here, first.
        if let Some(block) = block_named_twice(&prepare.block_ids, &mut self.sorted_blocks) {
            return Err((ErrorCode::BadRequest, format!("engine block {block} is named twice in one request")));
        }
        space.keys(&prepare.tokens[..end * block_tokens as usize], block_tokens, &mut self.keys);
        Ok(first_block..end)
    }

    pub fn prepare_retrieve(
        &mut self,
        prepare: Prepare,
        space: &KeySpace,
        block_tokens: u32,
        store: &Mutex<StoreState>,
        limits: &SessionLimits,
    ) -> Reply {
        let own = match self.check_prepare(&prepare, space, block_tokens, limits) {
            Ok(own) => own,
            Err(refusal) => return refused(refusal),
        };
        let mut store = lock(store);
        let control = &mut store.control;
        let handle = match control.reserve_retrieve(&self.keys[own.clone()], &prepare.block_ids, own.start) {
            Ok(handle) => handle,
            Err(error) => return store_error("reserving the retrieve", error),
        };
        let expected_crcs = if control.records_payload_crcs() {
            if let Err(error) = control.recorded_payload_crcs(handle, &mut self.crcs) {
                let _ = control.release(handle);
                return store_error("reading the recorded CRCs", error);
            }
            Some(self.crcs.clone())
        } else {
            None
        };
        let placements = match placements_or_release(control, handle) {
            Ok(placements) => placements,
            Err(error) => return store_error("the retrieve's placements", error),
        };
        self.handles.push(handle);
        Reply::RetrievePrepared(RetrievePrepared { handle: handle.to_bits(), placements, expected_crcs })
    }

    pub fn prepare_store(
        &mut self,
        prepare: Prepare,
        space: &KeySpace,
        block_tokens: u32,
        store: &Mutex<StoreState>,
        limits: &SessionLimits,
    ) -> Reply {
        if prepare.first_block != 0 {
            return refused((
                ErrorCode::BadRequest,
                format!("a store starts at the prefix's first block, not block {}", prepare.first_block),
            ));
        }
        if let Err(refusal) = self.check_prepare(&prepare, space, block_tokens, limits) {
            return refused(refusal);
        }
        let mut store = lock(store);
        let control = &mut store.control;
        let plan = match control.reserve_store(&self.keys, &prepare.block_ids, &mut NoLender) {
            Ok(plan) => plan,
            Err(error) => return store_error("reserving the store", error),
        };
        let placements = match placements_or_release(control, plan.handle) {
            Ok(placements) => placements,
            Err(error) => return store_error("the store's placements", error),
        };
        self.handles.push(plan.handle);
        Reply::StorePrepared(StorePrepared {
            handle: plan.handle.to_bits(),
            new_blocks: plan.new_blocks as u32,
            shared_blocks: plan.shared_blocks as u32,
            evicted_slots: plan.evicted_slots as u32,
            placements,
        })
    }

    /// `Commit`: the client's report of what it moved is checked first (a refusal keeps the
    /// reservation); it is counted once the request ended (committed, or failed while writing),
    /// not when a refusal left it to a later `Release` (which reports it then).
    pub fn commit(&mut self, commit: Commit, store: &Mutex<StoreState>, shape: &PoolShape, metrics: &Metrics) -> Reply {
        let position = match self.owns(commit.handle) {
            Ok(position) => position,
            Err(refusal) => return refused(refusal),
        };
        let handle = self.handles[position];
        let mut store = lock(store);
        let direction = match report::check_transferred(&store.control, shape, handle, commit.transferred, report::Reported::Commit) {
            Ok(direction) => direction,
            Err(refusal) => return refused(refusal),
        };
        let result = store.control.commit_store(handle, commit.payload_crcs.as_deref(), &mut NoLender);
        // A refusal before anything was written keeps the reservation (release it or commit
        // again); a commit or a failed write ends it.
        if store.control.direction(handle).is_err() {
            self.handles.swap_remove(position);
            metrics.transferred(direction, commit.transferred);
        }
        match result {
            Ok(stored) => Reply::Committed { stored: stored as u32 },
            Err(error) => store_error("committing the store", error),
        }
    }

    /// `Release`: the client's report is checked (what it moved; the blocks its verification
    /// found corrupt, evicted here), then the request ends and what it moved is counted. A
    /// refused report changes nothing: the request stays the session's.
    pub fn release_request(
        &mut self,
        handle: u64,
        transferred: Transferred,
        corrupt_blocks: &[MismatchedBlock],
        store: &Mutex<StoreState>,
        shape: &PoolShape,
        metrics: &Metrics,
    ) -> Reply {
        let position = match self.owns(handle) {
            Ok(position) => position,
            Err(refusal) => return refused(refusal),
        };
        let handle = self.handles[position];
        let mut store = lock(store);
        let direction = match report::check_transferred(&store.control, shape, handle, transferred, report::Reported::Release) {
            Ok(direction) => direction,
            Err(refusal) => return refused(refusal),
        };
        if !corrupt_blocks.is_empty() {
            if let Err(refusal) = report::evict_corrupt(&mut store.control, handle, corrupt_blocks) {
                return refused(refusal);
            }
        }
        self.handles.swap_remove(position);
        let released = store.control.release(handle);
        metrics.transferred(direction, transferred);
        match released {
            Ok(()) => Reply::Released,
            Err(error) => store_error("releasing the request", error),
        }
    }

    /// Keeps everything for good: what a way out does when it cannot tell whether the client
    /// still rings its queues (a panic while the daemon waited for the client's exit). The relay
    /// stops forwarding for the session (its pairs are kept, so their queue ids go to nobody
    /// else); the pairs, the windows they may write and the reservations whose slots they may
    /// write are never released, and counted as leaks. Returns the pairs kept.
    pub fn leak(&mut self, store: &Mutex<StoreState>, leaks: &LeakCounters) -> u64 {
        self.stop_relaying(store);
        let pairs: u64 =
            self.registrations.iter().map(|registration| registration.queues.len() as u64).sum::<u64>() + self.creations_unsettled;
        self.keep_for_good(pairs, leaks, "a session ended without knowing whether its client still rings its queues");
        pairs
    }

    /// The relay forwards nothing more for the session's pairs.
    fn stop_relaying(&mut self, store: &Mutex<StoreState>) {
        let store = lock(store);
        for registration in &mut self.registrations {
            for ticket in registration.relayed.drain(..) {
                store.relay.remove(&ticket);
            }
        }
    }

    /// Counts `pairs` queue pairs, the windows and the reservations as leaks, says so with
    /// `why`, and keeps the windows and device memory mapped for good (the pairs themselves are
    /// the caller's to keep); the reservations are never released, so their slots never reused.
    fn keep_for_good(&mut self, pairs: u64, leaks: &LeakCounters, why: &str) {
        let window_bytes: u64 = self.registrations.iter().map(|registration| registration.window.len() as u64).sum();
        leaks.queue_pairs.fetch_add(pairs, Ordering::Relaxed);
        leaks.windows.fetch_add(self.registrations.len() as u64, Ordering::Relaxed);
        leaks.window_bytes.fetch_add(window_bytes, Ordering::Relaxed);
        leaks.requests.fetch_add(self.handles.len() as u64, Ordering::Relaxed);
        tracing::error!(
            queue_pairs = pairs,
            windows = self.registrations.len(),
            window_bytes,
            requests = self.handles.len(),
            "{why}: its queue pairs, windows and reservations are kept, for good"
        );
        std::mem::forget(std::mem::take(&mut self.registrations));
        std::mem::forget(std::mem::take(&mut self.device_memory));
        self.handles.clear();
    }

    /// Ends the session's holdings in the safe order (module docs): [`Released::Done`] when
    /// every queue pair was deleted and everything given back; [`Released::Retiring`] when a
    /// deletion could not be confirmed for now (the admin queue was busy with a late command, or
    /// the Delete timed out): the pairs and everything they may write go with it, to be retried
    /// ([`Retiring::retry`]); [`Released::Kept`] when a deletion failed for good (then nothing
    /// was given back).
    pub fn release(&mut self, store: &Mutex<StoreState>, leaks: &LeakCounters) -> Released {
        // 1. The relay forwards nothing more for the session's pairs: a doorbell forwarded after
        //    a deletion would land on whichever queue gets the id next. (A retiring pair's id
        //    stays reserved in the driver until its deletion is confirmed, so no other queue
        //    gets it meanwhile.)
        self.stop_relaying(store);
        // 2. Queue pairs: the controller must confirm each deletion before anything they could
        //    write (the window, the slots of the session's reservations) is reused.
        let pairs: Vec<DetachedQueuePair> = self
            .registrations
            .iter_mut()
            .flat_map(|registration| {
                registration.shared_register_pairs = 0;
                registration.queues.drain(..)
            })
            .collect();
        let (retry, kept) = delete_pairs(pairs, false);
        let released = self.settle(retry, kept, store, leaks);
        if let Released::Retiring(retiring) = &released {
            leaks.queue_id_holders_retiring.fetch_add(1, Ordering::AcqRel);
            tracing::warn!(
                queue_pairs = retiring.pairs.len(),
                "a session ended with queue pairs whose deletion the controller has not confirmed yet (admin queue busy or timed \
                 out): retried every tick, its windows and reservations kept until then"
            );
        }
        released
    }

    /// After a deletion pass: `kept` (a definite failure) or a creation that may still execute
    /// (`creations_unsettled`) keeps everything for good, `retry` (not confirmed yet) makes the
    /// holdings retiring, and with neither steps 3 and 4 of the safe order give everything back.
    fn settle(
        &mut self,
        retry: Vec<DetachedQueuePair>,
        kept: Vec<DetachedQueuePair>,
        store: &Mutex<StoreState>,
        leaks: &LeakCounters,
    ) -> Released {
        if !kept.is_empty() || self.creations_unsettled > 0 {
            let count = (kept.len() + retry.len()) as u64 + self.creations_unsettled;
            let why = if kept.is_empty() {
                "a session ended with a queue pair whose creation may still execute (its restriction allows the session's memory)"
            } else {
                "a session ended with queue pairs that could not be deleted"
            };
            // Kept for good: the pairs (dropping one would try again and then leak its rings
            // anyway), the windows they may write, and the reservations whose slots they may
            // write (never released, so never reused). A pair still to be retried goes with
            // them: its window is kept anyway.
            std::mem::forget(kept);
            std::mem::forget(retry);
            self.keep_for_good(count, leaks, why);
            return Released::Kept(count);
        }
        if !retry.is_empty() {
            let pairs_when_ended = retry.len();
            return Released::Retiring(Retiring {
                pairs: retry,
                holdings: std::mem::take(self),
                since: std::time::Instant::now(),
                pairs_when_ended,
            });
        }
        // 3. Reservations: an uncommitted store's slots go back free, invisible.
        {
            let mut store = lock(store);
            for handle in self.handles.drain(..) {
                if let Err(error) = store.control.release(handle) {
                    tracing::warn!(%error, "releasing a session's request");
                }
            }
        }
        // 4. Windows: unmapped when their last region (the rings were the other holders) goes,
        //    and their claims given back; device memory: unmapped, closed (cuIpcCloseMemHandle)
        //    and its claim given back.
        self.registrations.clear();
        self.device_memory.clear();
        // Its queue ids are free again (every pair known deleted).
        if std::mem::take(&mut self.holds_queue_ids) {
            let _ = leaks.queue_id_holders.fetch_update(Ordering::AcqRel, Ordering::Acquire, |holders| holders.checked_sub(1));
        }
        Released::Done
    }
}

/// The relay tickets an attach took, until the registration holds them with its pairs
/// ([`RelayedByAttach::keep`]). Dropped before that (a panic in the attach's loop, which the
/// connection catches and serves on from), it takes its pairs off the relay: otherwise the relay
/// would go on forwarding a page nobody holds to queue ids the unwinding frees (the pairs'
/// drop deletes them) for the next attach to get.
struct RelayedByAttach<'a> {
    store: &'a Mutex<StoreState>,
    tickets: Vec<RelayTicket>,
}

impl RelayedByAttach<'_> {
    fn keep(mut self) -> Vec<RelayTicket> {
        std::mem::take(&mut self.tickets)
    }
}

impl Drop for RelayedByAttach<'_> {
    fn drop(&mut self) {
        if self.tickets.is_empty() {
            return;
        }
        // `lock` takes a mutex the panic poisoned (a panic under the pool lock).
        let store = lock(self.store);
        for ticket in self.tickets.drain(..) {
            store.relay.remove(&ticket);
        }
    }
}

/// What ending a session's holdings came to ([`Holdings::release`]).
#[must_use]
pub enum Released {
    /// Every queue pair deleted, everything given back.
    Done,
    /// Deletions to retry (every tick: [`Retiring::retry`]); the rest of the holdings waits.
    Retiring(Retiring),
    /// This many queue pairs could not be deleted: they and everything else are kept for good.
    Kept(u64),
}

impl Released {
    pub fn is_done(&self) -> bool {
        matches!(self, Released::Done)
    }
}

/// An ended session's queue pairs whose deletion the controller has not confirmed yet, and
/// everything they may still write (windows, device memory, reservations), given back once it
/// has. Each retry is at most one Delete I/O SQ and one Delete I/O CQ per pair, each bounded
/// by the admin timeout (a busy admin queue answers at once). Until then the pairs' queue ids
/// stay reserved in the driver, so no other queue gets them.
pub struct Retiring {
    pairs: Vec<DetachedQueuePair>,
    holdings: Holdings,
    /// When the session ended with its deletion unconfirmed (a retry does not move it): what
    /// the retiring thread bounds the retries by.
    since: std::time::Instant,
    /// The pairs unconfirmed then (a retry only removes some): what that bound scales with,
    /// each retry deleting them one after another.
    pairs_when_ended: usize,
}

/// What a retry of a retiring session's deletions came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retried {
    /// Still not confirmed: retry later.
    Pending,
    /// Deleted, everything given back.
    Done,
    /// A deletion failed for good: this many pairs and everything else are kept for good.
    Kept(u64),
}

impl Retiring {
    /// Queue pairs not yet known deleted.
    pub fn queue_pairs(&self) -> usize {
        self.pairs.len()
    }

    /// Tries the deletions again (see [`Holdings::release`] for what follows each outcome).
    pub fn retry(&mut self, store: &Mutex<StoreState>, leaks: &LeakCounters) -> Retried {
        let (retry, kept) = delete_pairs(std::mem::take(&mut self.pairs), true);
        match self.holdings.settle(retry, kept, store, leaks) {
            Released::Done => {
                uncount_retiring(leaks);
                Retried::Done
            }
            Released::Kept(pairs) => {
                uncount_retiring(leaks);
                Retried::Kept(pairs)
            }
            Released::Retiring(mut again) => {
                // `again` is left empty: its drop keeps nothing.
                self.pairs = std::mem::take(&mut again.pairs);
                self.holdings = std::mem::take(&mut again.holdings);
                Retried::Pending
            }
        }
    }

    /// How long ago the session ended with its deletion unconfirmed.
    pub fn retiring_for(&self) -> std::time::Duration {
        self.since.elapsed()
    }

    /// The queue pairs whose deletion was unconfirmed when the session ended (at least those
    /// [`Retiring::queue_pairs`] still holds).
    pub fn pairs_when_ended(&self) -> usize {
        self.pairs_when_ended
    }

    /// Gives up (the daemon drains with deletions still unconfirmed, or they stayed unconfirmed
    /// past the retiring thread's bound; `why` says which): everything is kept for good, as for
    /// a failed deletion. Returns the pairs kept.
    pub fn keep_for_good(mut self, leaks: &LeakCounters, why: &str) -> u64 {
        let pairs = self.pairs.len() as u64;
        std::mem::forget(std::mem::take(&mut self.pairs));
        self.holdings.keep_for_good(pairs, leaks, why);
        uncount_retiring(leaks);
        pairs
    }
}

/// A retiring session settled (its pairs deleted or kept for good): no longer counted in
/// [`LeakCounters::queue_id_holders_retiring`].
fn uncount_retiring(leaks: &LeakCounters) {
    let _ = leaks.queue_id_holders_retiring.fetch_update(Ordering::AcqRel, Ordering::Acquire, |retiring| retiring.checked_sub(1));
}

impl Drop for Retiring {
    /// Never gives back what an unconfirmed pair may write: dropped unfinished (a bug; the
    /// server ends every one with `retry` or `keep_for_good`), it keeps everything for good,
    /// uncounted but logged.
    fn drop(&mut self) {
        if !self.pairs.is_empty() {
            let pairs = self.pairs.len() as u64;
            std::mem::forget(std::mem::take(&mut self.pairs));
            self.holdings.keep_for_good(pairs, &LeakCounters::default(), "a retiring session was dropped unfinished");
        }
    }
}

/// Whether a failed Create I/O queue pair may still execute on the controller: its command was
/// sent and no answer says what became of it (a timeout, a lost or failed controller, a
/// completion that broke the protocol). A refusal before sending (a busy or failed admin
/// queue, no queue id, bad rings) or an error status proves it will not.
fn creation_may_still_execute(error: &NvmeError) -> bool {
    matches!(
        error,
        NvmeError::Timeout { .. }
            | NvmeError::DeviceGone
            | NvmeError::ControllerFatal { .. }
            | NvmeError::Hardware(_)
            | NvmeError::UnexpectedCompletion { .. }
            | NvmeError::WrongSubmissionQueue { .. }
            | NvmeError::InvalidSubmissionQueueHead { .. }
            | NvmeError::CompletionBeforeFetch { .. }
            | NvmeError::CommandOutcomeUnknown { .. }
    )
}

/// The answer to an attach whose queue creation on pool device `device` failed with `error`
/// (`retiring`: ended sessions whose pairs' deletion is not confirmed yet, `Retiring`). What
/// comes free by itself is `Busy`, which clients ask again: the admin queue busy with a command
/// that timed out (most often an ended session's late Delete; nothing was sent, and its late
/// completion frees the queue), or no queue id left while retiring sessions hold some. No id
/// left otherwise is the cap (`LimitReached`), rings the client placed over each other its
/// `BadRequest`; anything else (a timeout, the hardware, a failed admin queue) is the store
/// failing, not a cap: `StoreFailed`, which the Python package raises as `DaemonError` rather
/// than `LimitReached` ("a bounded resource is exhausted").
fn creation_refused(device: usize, error: &NvmeError, retiring: u64) -> Reply {
    let context = format!("creating a queue pair on pool device {device}: {error}");
    match error {
        NvmeError::QueueBusy { .. } => Reply::error(
            ErrorCode::Busy,
            format!(
                "{context} (the controller's admin queue waits for the late completion of a command that timed out, \
                 such as an ended session's queue deletion): retry the attach shortly"
            ),
        ),
        NvmeError::NoQueueAvailable { .. } if retiring > 0 => Reply::error(
            ErrorCode::Busy,
            format!(
                "{context} ({retiring} ended session(s) hold queue ids whose deletion the controller has not confirmed yet; \
                 they come free once it does, unless it stays unconfirmed past the daemon's bound: then they are kept \
                 for good): retry the attach shortly"
            ),
        ),
        NvmeError::NoQueueAvailable { .. } => Reply::error(ErrorCode::LimitReached, context),
        NvmeError::RingsOverlap { .. } | NvmeError::InvalidQueueDepth { .. } => Reply::error(ErrorCode::BadRequest, context),
        _ => Reply::error(ErrorCode::StoreFailed, context),
    }
}

/// Whether a failed deletion may go through on a retry: the Delete was never sent (the admin
/// queue is busy with a command that timed out earlier: `QueueBusy`), or it timed out (its late
/// completion settles it; a retry's Invalid Queue Identifier then counts as done). Anything
/// else (an error status, `QueueMaybeLive`, a failed queue, a lost controller) is definite.
fn deletion_may_retry(error: &NvmeError) -> bool {
    matches!(error, NvmeError::QueueBusy { .. } | NvmeError::Timeout { .. })
}

/// Deletes `pairs`: returns those to retry and those whose deletion failed for good (the
/// deleted ones are gone). A deletion not confirmed yet is logged at warn level when the
/// session ends, and at debug level on each of its retries (`retrying`): a retry runs every
/// tick for as long as the controller does not answer, the daemon's life at worst; how it ends
/// is logged once (`crate::server`).
fn delete_pairs(pairs: Vec<DetachedQueuePair>, retrying: bool) -> (Vec<DetachedQueuePair>, Vec<DetachedQueuePair>) {
    let (mut retry, mut kept) = (Vec::new(), Vec::new());
    for pair in pairs {
        if let Err(undeleted) = pair.delete() {
            if deletion_may_retry(&undeleted.source) {
                if retrying {
                    tracing::debug!(error = %undeleted.source, "a client queue pair's deletion is still not confirmed: retried");
                } else {
                    tracing::warn!(error = %undeleted.source, "a client queue pair's deletion is not confirmed yet: retried");
                }
                retry.push(*undeleted.pair);
            } else {
                tracing::error!(error = %undeleted.source, "a client queue pair could not be deleted: its window and reservations are kept");
                kept.push(*undeleted.pair);
            }
        }
    }
    (retry, kept)
}

/// A just-reserved request's placements, for its reply. On an error the reservation is not yet
/// the session's: it is given back rather than left pinned.
fn placements_or_release(control: &mut StoreControl, handle: RequestHandle) -> Result<Vec<Placement>, ObjstoreError> {
    let placements = control.placements(handle).map(<[Placement]>::to_vec);
    if placements.is_err() {
        let _ = control.release(handle);
    }
    placements
}

/// Duplicates a register page's descriptor for an attach reply. A test can make it fail
/// (`tests::DUPLICATES_FAIL`, this thread only: EMFILE is otherwise hard to bring about
/// without starving every other test of descriptors) to check what attach does then.
fn duplicate_descriptor(fd: BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    #[cfg(test)]
    if tests::DUPLICATES_FAIL.with(std::cell::Cell::get) {
        return Err(std::io::Error::from(nix::errno::Errno::EMFILE));
    }
    fd.try_clone_to_owned()
}

#[cfg(test)]
mod tests;
