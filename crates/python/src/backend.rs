//! What a `Store` holds under its lock: the store itself (in-process `KvStore` or tuttid's
//! `RemoteKvStore`, before and after its KV memory is registered), the live requests' state,
//! and the registered memory with what keeps it alive. Python-free, except for the references
//! it keeps (dropped, or leaked, in the order `close` documents).
//!
//! The requests' calls are here; registering or allocating the KV memory is in
//! `backend/registration.rs`, ending the store (and what is given back or kept) in
//! `backend/close.rs`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::{CpuExecutor, GioError, SmBudget};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nvme_driver::DmaRegion;
use nvme_emu::EmuDevice;
use objstore::{Direction, RequestHandle, StoreConfig, StorePlan};
use objstore::{KvRequest, KvStore, LayerKvStore, ObjstoreError, Pool};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::lock::DeviceLocks;
use tutti_daemon::protocol::HelloReply;
use tutti_daemon::Client;

use crate::device_memory::DeviceHold;
use crate::errors::{ErrorClass, Failure};
use crate::ffi::CallerMemory;
use crate::memory::Keep;
use crate::tensor::CheckedLayout;

mod close;
mod registration;

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

    /// Where the run of cached blocks from `first_block` ends (from 0: the longest cached
    /// prefix), in blocks; daemon failures are raised (not a silent miss).
    pub fn lookup(&mut self, tokens: &[u32], first_block: usize) -> Result<usize, Failure> {
        match &mut self.backend {
            Backend::Local { store, .. } => Ok(store.lookup_from(tokens, first_block)),
            Backend::Remote { store } => {
                let found = store.client().lookup_from(tokens, wire_first_block(first_block)?);
                self.touch_daemon();
                Ok(found? as usize)
            }
            Backend::RemoteAttached { client, .. } => {
                let found = client.lookup_from(tokens, wire_first_block(first_block)?);
                self.touch_daemon();
                Ok(found? as usize)
            }
            Backend::LocalOpen { .. } => Err(not_registered()),
            Backend::Closed => Err(closed()),
        }
    }

    pub fn lookup_all_ranks(&mut self, tokens: &[u32], first_block: usize) -> Result<usize, Failure> {
        match &mut self.backend {
            Backend::Remote { store } => {
                let found = store.client().lookup_all_ranks_from(tokens, wire_first_block(first_block)?);
                self.touch_daemon();
                Ok(found? as usize)
            }
            Backend::RemoteAttached { client, .. } => {
                let found = client.lookup_all_ranks_from(tokens, wire_first_block(first_block)?);
                self.touch_daemon();
                Ok(found? as usize)
            }
            Backend::Local { store, .. } => {
                let Some((fingerprint, _, world)) = self.key_space else { return Ok(store.lookup_from(tokens, first_block)) };
                // The minimum over the ranks' key spaces of this model and world (each rank's
                // blocks are keyed apart), as tuttid answers it.
                let own = store.key_seed();
                let mut common = usize::MAX;
                for rank in 0..world {
                    let seed = key_seed(&fingerprint, rank, world)?;
                    store.set_key_seed(seed);
                    common = common.min(store.lookup_from(tokens, first_block));
                    if common <= first_block {
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
    /// engine blocks written (stores: the new ones; retrieves: all). `block_ids` are blocks
    /// `first_block..` of the prefix (a retrieve's; a store's start at 0).
    pub fn prepare(
        &mut self,
        direction: Direction,
        tokens: &[u32],
        block_ids: &[u32],
        first_block: usize,
    ) -> Result<(RequestHandle, Option<StorePlan>, Vec<u32>), Failure> {
        let remote = self.is_remote();
        let request = KvRequest { tokens, block_ids };
        let prepared = match direction {
            Direction::Retrieve => self.layer_store()?.prepare_retrieve_from(&request, first_block).map(|handle| (handle, None)),
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
        let issued = match direction {
            Direction::Retrieve => store.retrieve_layer(bits, layer, SmBudget(budget)),
            Direction::Store => store.store_layer(bits, layer, SmBudget(budget)),
        };
        if let Err(error) = issued {
            // An issue can fail after its commands were published (objstore keeps the layer in
            // flight then): the request must say so, so that nobody hands its memory back
            // before a wait or the session's end settles it. When the store cannot tell, in
            // flight is the safe answer.
            let in_flight = store.any_layer_in_flight(bits).unwrap_or(true);
            if in_flight {
                let state = self.request(handle)?;
                state.in_flight = Some(layer);
                state.unreported = None;
            }
            return Err(error.into());
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
}

/// tuttid's key seed of (fingerprint, rank, world), for an in-process store in the same space.
pub fn key_seed(fingerprint: &[u8; 32], rank: u32, world: u32) -> Result<u64, Failure> {
    tutti_daemon::keys::KeySpace::new(fingerprint, rank, world)
        .map(|space| space.seed())
        .map_err(|reason| Failure::new(ErrorClass::InvalidArgument, reason))
}

/// A first block as tuttid's protocol carries it (u32).
fn wire_first_block(first_block: usize) -> Result<u32, Failure> {
    u32::try_from(first_block)
        .map_err(|_| Failure::new(ErrorClass::InvalidArgument, format!("first_block {first_block} is past any prefix tuttid takes")))
}
