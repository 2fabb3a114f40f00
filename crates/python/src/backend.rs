//! What a `Store` holds under its lock: the store itself (in-process `KvStore` or tuttid's
//! `RemoteKvStore`, before and after its KV memory is registered), the live requests' state,
//! and the registered memory with what keeps it alive. Python-free, except for the references
//! it keeps (dropped, or leaked, in the order `close` documents).
//!
//! The requests' calls are here; registering or allocating the KV memory is in
//! `backend/registration.rs`, ending the store (and what is given back or kept) in
//! `backend/close.rs`, a request's own state (its layers in flight and not yet returned) in
//! `backend/request_state.rs`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::{CpuExecutor, GioError, SmBudget};
use nvme_driver::DmaRegion;
use nvme_emu::EmuDevice;
use objstore::{Direction, RequestHandle, StoreConfig, StorePlan};
use objstore::{KvRequest, KvStore, LayerKvStore, ObjstoreError, Pool};
use tutti_daemon::client::{wire_first_block, RemoteConfig, RemoteKvStore};
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
mod request_state;
#[cfg(test)]
pub(crate) mod test_store;

pub use request_state::{Issues, RequestState, Stall};

/// The longest a `wait` holds the store's lock in one go: other threads' calls (and the
/// completion thread) get the lock between slices, the wait giving way to them
/// (`StoreShared::give_way`; `Request` waits it out this way; a store's close holds the lock
/// throughout).
pub const WAIT_SLICE: Duration = Duration::from_millis(2);

/// How long the completion thread leaves a request alone after its wait failed without ending
/// the layer (a queue error) before it tries again: long enough that a queue that keeps
/// failing costs one poll (and one eventfd signal) per 50 ms, short enough that a transient
/// error delays the layer by at most that.
pub const STALL_RETRY_BACKOFF: Duration = Duration::from_millis(50);

/// What one pass of the completion thread (`StoreState::drive_armed`) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ArmedPass {
    /// A request was driven: pass again at once.
    pub driven: bool,
    /// A request waits out its backoff after a failed wait: pass again within
    /// `STALL_RETRY_BACKOFF`, not after the idle sleep.
    pub backing_off: bool,
}

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
    /// Shared with the KvBuffers over `regions`: set when the close keeps them for good.
    pub kept_for_good: crate::memory::KeptForGood,
}

/// Where waiting out a request's layers in flight stands after one step (`settle_step`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settling {
    /// Nothing of the request is in flight (or the request is gone).
    Settled,
    /// A layer may still move bytes and no more can be done: the deadline passed, or a wait
    /// failed without ending its layer.
    Unsettled,
    /// A layer completed or the slice passed: step again.
    Continue,
}

/// What became of a request dropped while prepared (`StoreState::finish_dropped`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// Finished (or already gone): its place, pins and IOCBs are given back.
    Finished,
    /// A layer is still in flight: kept on `StoreState::orphans` until it ends.
    Orphaned,
    /// Nothing in flight, but the keep-alive ping has the store's connection, which a finish
    /// may need: kept on `StoreState::orphans`, finished once the connection is back (the
    /// completion thread's pass, the next prepare).
    Deferred,
}

/// An issue the store's close left in flight with nothing to say it ended
/// (`StoreState::left_in_flight_at_close`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeftInFlight {
    pub request: u64,
    pub layer: u32,
    pub issue: u64,
}

/// Everything under a `Store`'s lock.
pub struct StoreState {
    pub backend: Backend,
    pub requests: HashMap<u64, RequestState>,
    /// Requests whose Python object was dropped with a layer its drop could not wait out
    /// (`Request::drop`), or while the keep-alive ping had the connection its finish may need:
    /// still held (their place, pins and IOCBs, and the engine blocks their commands may still
    /// move) until the layers in flight ended; the completion thread and the next prepare drive
    /// them (`drive_orphans`) and finish each once settled, the store's close otherwise.
    pub orphans: Vec<u64>,
    /// Caller memory mapped for the devices (in-process register_kv).
    pub caller_memory: Vec<CallerMemory<Keep>>,
    /// Device memory registered with tuttid (CUDA tensors, a stand-in): the tensors and what
    /// holds the exported allocation, kept until no command can move their bytes.
    pub device_memory: Option<DeviceHold>,
    /// The tuttid attached to (attached stores): where `close` asks whether the session ended.
    pub daemon: Option<crate::device_memory::AttachedDaemon>,
    /// The tuttid session (attached stores).
    pub daemon_session: Option<u64>,
    /// While the keep-alive ping has the store's connection to tuttid (`lend_connection`): the
    /// requests sent on it when it was lent (the `requests_sent` getter's answer meanwhile).
    /// The backend holds a placeholder then, which nothing may use: the calls that talk to
    /// tuttid wait for the connection's return (`StoreShared::locked`).
    pub connection_lent: Option<u64>,
    /// What keeps released memory alive (DLPack tensors, buffer exports, owners), to be dropped
    /// by `StoreShared::with_state` after the store's lock is released: a DLPack producer's
    /// deleter (numpy's) takes the GIL, which a thread waiting for this lock may hold.
    pub released: Vec<Keep>,
    pub allocation: Option<Allocation>,
    /// The registered layout as checked (set by register_kv or allocate_kv).
    pub registered: Option<CheckedLayout>,
    /// Registered tensors kept for good because a queue pair could not be deleted.
    pub leaked_tensors: usize,
    /// The issues the store's close left in flight without proof that they ended since (queue
    /// pairs not known deleted), oldest first per request: their `LayerIo.done` stays False and
    /// their request still names their layers in flight, for good (a later finish, refused by
    /// the closed store, changes neither). At most `requests_max` x `layers_in_flight` of them,
    /// set once.
    pub left_in_flight_at_close: Vec<LeftInFlight>,
    /// The descriptors the store recorded for forked children to close (`process`): forgotten
    /// when it closes them.
    pub closed_in_forked_children: Vec<std::os::fd::RawFd>,
    /// The model fingerprint and the TP rank and world of the key space (in-process stores; None:
    /// the in-process space 0).
    pub key_space: Option<([u8; 32], u32, u32)>,
    /// When a request last went to tuttid (keep-alive pings go when idle).
    pub last_daemon_request: Instant,
    /// Layers one request may keep in flight (`Store.open`/`attach`'s `layers_in_flight`),
    /// given to the store when it is built (before any request is prepared).
    pub layers_in_flight_max: u32,
    /// The options that bound the store's requests, for the refusals they cause.
    limits: RequestLimits,
    /// Tests: how many of the next store waits `drive` makes fail with a queue error that ends
    /// no layer (an executor that could not poll its queue pairs), before asking the store.
    #[cfg(test)]
    pub queue_errors_injected: u32,
}

/// The options that bound a store's requests (`Store.open`/`attach`'s `layers_in_flight`,
/// `iocbs`, `requests_max`): each prepared request holds `layers_in_flight` sets of its IOCBs
/// until it ends (a set is one IOCB per 2048 commands of a layer, usually one), so
/// `requests_max x layers_in_flight x IOCBs per set` should not exceed `iocbs`. That is not
/// refused at open (the defaults, 64 IOCBs and 32 requests, with 4 layers in flight hold 16
/// requests, often enough); a prepare that finds too few IOCBs says so instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    pub layers_in_flight: u32,
    pub iocbs: u32,
    pub requests_max: usize,
}

impl RequestLimits {
    /// The message of a prepare that found `available` free IOCBs of the queue's `iocbs` and
    /// needed `requested` (`layers_in_flight` sets of the request's IOCBs): what each request
    /// holds, whether the options are to blame, and which to raise.
    pub fn no_free_iocbs(&self, requested: usize, available: usize) -> String {
        let RequestLimits { layers_in_flight, iocbs, requests_max } = *self;
        let sets = layers_in_flight.max(1) as usize;
        let per_set = requested.div_ceil(sets);
        let held = if per_set > 1 {
            format!("here {requested} IOCBs per request: {per_set} per set, one per 2048 commands of a layer")
        } else {
            format!("here {requested} IOCBs per request")
        };
        let mut message = format!(
            "no free IOCBs for this prepare: {available} of iocbs = {iocbs} free, {requested} needed; each prepared request holds \
             layers_in_flight = {layers_in_flight} sets of its IOCBs ({held}) until it is finished or committed"
        );
        let wanted = requests_max.saturating_mul(sets);
        // What requests_max requests the size of this one hold: a set may take more than one
        // IOCB, so the sets alone can understate it. iocbs is a power of two.
        let needed = requests_max.saturating_mul(requested);
        let at_least = if needed > iocbs as usize {
            format!(
                " to at least {} (requests_max x {requested} IOCBs per request = {needed}, for requests the size of this one)",
                needed.checked_next_power_of_two().unwrap_or(needed)
            )
        } else {
            String::new()
        };
        if wanted > iocbs as usize {
            message.push_str(&format!(
                "; requests_max x layers_in_flight = {requests_max} x {layers_in_flight} = {wanted} is more than iocbs = {iocbs}: raise \
                 iocbs (Store.open / Store.attach){at_least}, or lower layers_in_flight, or prepare fewer requests at once"
            ));
        } else {
            message.push_str(&format!(
                "; requests_max x layers_in_flight = {requests_max} x {layers_in_flight} = {wanted} fits in iocbs = {iocbs}, but the \
                 requests prepared need more IOCBs each: raise iocbs (Store.open / Store.attach){at_least}, or prepare fewer requests \
                 at once"
            ));
        }
        message
    }
}

/// What `StoreState::lend_connection` did with the placeholder it was given.
pub enum Loan {
    /// The store's connection to tuttid, the placeholder in its place.
    Lent(Client),
    /// The placeholder, given back: no connection to lend.
    Declined(Client),
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
    pub fn new(backend: Backend, key_space: Option<([u8; 32], u32, u32)>, limits: RequestLimits) -> StoreState {
        StoreState {
            backend,
            requests: HashMap::new(),
            orphans: Vec::new(),
            caller_memory: Vec::new(),
            device_memory: None,
            daemon: None,
            daemon_session: None,
            connection_lent: None,
            released: Vec::new(),
            allocation: None,
            registered: None,
            leaked_tensors: 0,
            left_in_flight_at_close: Vec::new(),
            closed_in_forked_children: Vec::new(),
            key_space,
            last_daemon_request: Instant::now(),
            layers_in_flight_max: limits.layers_in_flight,
            limits,
            #[cfg(test)]
            queue_errors_injected: 0,
        }
    }

    pub fn is_closed(&self) -> bool {
        matches!(self.backend, Backend::Closed)
    }

    /// The layers of request `handle` the store's close left in flight, oldest first (none
    /// while the store is open).
    pub fn left_in_flight(&self, handle: u64) -> impl Iterator<Item = u32> + '_ {
        self.left_in_flight_at_close.iter().filter(move |left| left.request == handle).map(|left| left.layer)
    }

    /// Whether the store's close left `issue` of request `handle` in flight.
    pub fn was_left_in_flight(&self, handle: u64, issue: u64) -> bool {
        self.left_in_flight_at_close.iter().any(|left| left.request == handle && left.issue == issue)
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

    pub(crate) fn touch_daemon(&mut self) {
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
                let found = store.client().lookup_from(tokens, wire_first_block(first_block).map_err(Failure::from)?);
                self.touch_daemon();
                Ok(found? as usize)
            }
            Backend::RemoteAttached { client, .. } => {
                let found = client.lookup_from(tokens, wire_first_block(first_block).map_err(Failure::from)?);
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
                let found = store.client().lookup_all_ranks_from(tokens, wire_first_block(first_block).map_err(Failure::from)?);
                self.touch_daemon();
                Ok(found? as usize)
            }
            Backend::RemoteAttached { client, .. } => {
                let found = client.lookup_all_ranks_from(tokens, wire_first_block(first_block).map_err(Failure::from)?);
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

    /// The store's connection to tuttid (attached stores; None in process or closed).
    pub(crate) fn connection(&mut self) -> Option<&mut Client> {
        match &mut self.backend {
            Backend::Remote { store } => Some(store.client()),
            Backend::RemoteAttached { client, .. } => Some(client),
            _ => None,
        }
    }

    /// Requests sent on the store's connection to tuttid so far (0 in process), the one the
    /// keep-alive ping has included (as many as when it was lent).
    pub fn requests_sent(&mut self) -> u64 {
        if let Some(sent) = self.connection_lent {
            return sent;
        }
        self.connection().map_or(0, |client| client.requests_sent())
    }

    /// Lends the store's connection to tuttid to the keep-alive ping, which waits for its answer
    /// without the store's lock: `placeholder` (connected to no daemon) takes its place until
    /// `return_connection`. Declined (the placeholder back) when the store has no connection
    /// (closed, in process) or has lent it already.
    pub fn lend_connection(&mut self, placeholder: Client) -> Loan {
        if self.connection_lent.is_some() {
            return Loan::Declined(placeholder);
        }
        let Some(slot) = self.connection() else { return Loan::Declined(placeholder) };
        let connection = std::mem::replace(slot, placeholder);
        self.connection_lent = Some(connection.requests_sent());
        Loan::Lent(connection)
    }

    /// Puts back the connection lent (its ping answered or failed: a request went to tuttid)
    /// and returns the placeholder. Should the backend have lost its connection meanwhile
    /// (nothing that talks to tuttid runs while it is lent, a close included), the connection
    /// is dropped (the session ends) and None returned.
    pub fn return_connection(&mut self, connection: Client) -> Option<Client> {
        self.connection_lent = None;
        self.touch_daemon();
        self.connection().map(|slot| std::mem::replace(slot, connection))
    }

    /// Ends the loan of the store's connection to tuttid without it (the keep-alive ping panicked
    /// with it, and it was dropped): the placeholder stays in its place, so every later call
    /// that talks to tuttid fails at once as Disconnected instead of waiting for a return that
    /// never comes.
    pub fn lose_lent_connection(&mut self) {
        self.connection_lent = None;
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
        // A dropped request whose layers ended since gives back its place first.
        self.drive_orphans(Duration::ZERO);
        let remote = self.is_remote();
        let request = KvRequest { tokens, block_ids };
        let prepared = match direction {
            Direction::Retrieve => self.layer_store()?.prepare_retrieve_from(&request, first_block).map(|handle| (handle, None)),
            Direction::Store => self.layer_store()?.prepare_store(&request).map(|plan| (plan.handle, Some(plan))),
        };
        if remote {
            self.touch_daemon();
        }
        let (handle, plan) = prepared.map_err(|error| match error {
            // Which option is to blame, and which to raise (objstore's words kept after it).
            ObjstoreError::Gio(GioError::NoFreeIocb { requested, available }) => {
                let failure = Failure::from(&error);
                Failure { message: format!("{} ({})", self.limits.no_free_iocbs(requested, available), failure.message), ..failure }
            }
            other => Failure::from(other),
        })?;
        // The blocks the data path moves (objstore's placements; a store's new blocks only):
        // none, and an issued layer puts nothing in flight (objstore marks it done at once).
        // An error is raised, never taken for "none": that would report layers complete that
        // moved no byte. It can only be UnknownHandle (the store does not know the handle it
        // just returned), so the store holds nothing of the request to hand back.
        let placed: Vec<u32> = match &self.backend {
            Backend::Local { store, .. } => {
                store.placements(handle).map(|placements| placements.iter().map(|placement| placement.engine_block).collect())
            }
            Backend::Remote { store } => {
                store.placements(handle).map(|placements| placements.iter().map(|placement| placement.engine_block).collect())
            }
            _ => Ok(Vec::new()),
        }
        .map_err(Failure::from)?;
        let moves_nothing = placed.is_empty();
        let written = match direction {
            Direction::Retrieve => block_ids.to_vec(),
            Direction::Store => placed,
        };
        self.requests.insert(handle.to_bits(), RequestState::new(direction, moves_nothing, self.layers_in_flight_max));
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

    /// Issues `layer` of request `handle`; returns the issue's number (its LayerIo's).
    pub fn issue(&mut self, handle: u64, layer: u32, budget: u32, direction: Direction) -> Result<u64, Failure> {
        let state = self.request(handle)?;
        if state.direction != direction {
            let (asked, is) = match direction {
                Direction::Retrieve => ("retrieve_layer", "store"),
                Direction::Store => ("store_layer", "retrieve"),
            };
            return Err(Failure::new(ErrorClass::InvalidState, format!("{asked} on a {is} request")));
        }
        // Layers in flight and layers ended whose outcome no wait returned yet count alike.
        if let Some(refusal) = state.issue_refusal(layer) {
            return Err(Failure::new(ErrorClass::InvalidState, refusal));
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
            // before a wait or the session's end settles it. The store's own list says which
            // layers are in flight; when the store cannot tell, in flight is the safe answer.
            let listed = self.store_in_flight(handle);
            let state = self.request(handle)?;
            match listed {
                Some(layers) => {
                    if layers.contains(&layer) && !state.in_flight.contains(&layer) {
                        let _ = state.issued(layer);
                    }
                    state.set_in_flight(layers);
                }
                None if !state.in_flight.contains(&layer) => {
                    let _ = state.issued(layer);
                }
                None => {}
            }
            return Err(error.into());
        }
        let state = self.request(handle)?;
        if state.moves_nothing {
            // Nothing was put in flight (objstore's contract for a request with no blocks to
            // move): the layer is complete now, and is reported as any other (wait, LayerIo,
            // the eventfd).
            return Ok(state.completed_at_issue(layer));
        }
        let issue = state.issued(layer);
        self.start_issued()?;
        Ok(issue)
    }

    /// Puts the IOCBs just issued on the devices: the CPU executor builds an issue's NVMe
    /// commands only when it is polled, on the polling thread, so without this a layer issued
    /// before the engine goes off to compute would reach the device at its next wait (as
    /// crates/runtime's `pump` does after its issues). Consumes no completion. A failure (the
    /// executor's, reported once) is the caller's: the layer stays in flight, and a wait or the
    /// request's end settles it.
    fn start_issued(&mut self) -> Result<(), Failure> {
        let queue = match &mut self.backend {
            Backend::Local { store, .. } => store.queue_mut(),
            Backend::Remote { store } => store.data_mut().queue_mut(),
            _ => return Ok(()),
        };
        queue.peek_cqe().map(drop).map_err(|error| Failure::from(ObjstoreError::from(error)))
    }

    /// The store's own list of the request's layers in flight, oldest first; None when it
    /// cannot tell (the request unknown to it, the store not registered). Off the per-layer
    /// path: only after a failed issue, wait, commit or finish.
    fn store_in_flight(&mut self, handle: u64) -> Option<Vec<u32>> {
        let bits = RequestHandle::from_bits(handle);
        match &mut self.backend {
            Backend::Local { store, .. } => store.layers_in_flight(bits).ok().map(Iterator::collect),
            Backend::Remote { store } => store.layers_in_flight(bits).ok().map(Iterator::collect),
            _ => None,
        }
    }

    /// Drives the request's oldest layer in flight until `deadline`: `Ok(Some(layer))` when it
    /// ended now, completed or failed (its outcome recorded for the waits and its LayerIo),
    /// `Ok(None)` when none was in flight; `Err` when it is still in flight: a timeout, or a
    /// wait that failed without ending it (that failure is the caller's to report).
    pub fn drive(&mut self, handle: u64, deadline: Instant) -> Result<Option<u32>, Failure> {
        let Some(&oldest) = self.request(handle)?.in_flight.front() else {
            return Ok(None);
        };
        #[cfg(test)]
        if self.queue_errors_injected > 0 {
            self.queue_errors_injected -= 1;
            let injected = GioError::Executor { executor: "test", reason: "injected".into() };
            return self.wait_failed(handle, oldest, ObjstoreError::Gio(injected));
        }
        let waited = self.layer_store()?.wait(RequestHandle::from_bits(handle), deadline);
        match waited {
            Ok(Some(layer)) => {
                self.request(handle)?.complete(layer);
                Ok(Some(layer))
            }
            Ok(None) => {
                // The store has nothing of it in flight: nothing is, in both records (the
                // issues too, else a LayerIo would wait for an issue no wait can end). What the
                // mirror still lists is a drift (a layer that moves nothing never enters it),
                // and nothing says its bytes moved: each such layer ends failed, never
                // completed (a retrieve told its KV arrived would compute on stale blocks).
                let state = self.request(handle)?;
                let lost = Failure::new(
                    ErrorClass::InvalidState,
                    "the store has no record of it in flight: its bytes are not known to have moved",
                );
                loop {
                    let Some((layer, _)) = state.issues.in_flight().next() else { break };
                    state.fail(layer, &lost);
                }
                while let Some(&layer) = state.in_flight.front() {
                    state.fail(layer, &lost);
                }
                state.set_in_flight(std::iter::empty());
                Ok(None)
            }
            Err(error) if is_timeout(&error) => Err(Failure::from(&error)),
            Err(error) => self.wait_failed(handle, oldest, error),
        }
    }

    /// A store wait for `oldest`, the request's oldest layer in flight, failed with `error`: see
    /// `drive`.
    fn wait_failed(&mut self, handle: u64, oldest: u32, error: ObjstoreError) -> Result<Option<u32>, Failure> {
        // The store ended the failed layer (a failed command, a CRC mismatch) and keeps
        // the later ones in flight; a wait that failed before that (a queue error)
        // leaves it, and the next wait asks the store again. The store's own list says
        // which; when it cannot tell, the layer the error names (a failed command's) or
        // the oldest (a CRC mismatch's) is taken as ended. The failure is that layer's
        // alone: whoever waits for a later one does not take it.
        let failure = Failure::from(&error);
        let listed = self.store_in_flight(handle);
        let state = self.request(handle)?;
        let ended = match (&listed, &error) {
            (Some(layers), _) => (!layers.contains(&oldest)).then_some(oldest),
            (None, ObjstoreError::LayerIo { layer, .. }) => Some(*layer),
            (None, ObjstoreError::PayloadMismatch { .. }) => Some(oldest),
            (None, _) => None,
        };
        // The layer's failure first, so that it is recorded against its own issue
        // (the store's list no longer holds the layer, nor its issue then).
        if let Some(layer) = ended {
            state.fail(layer, &failure);
        }
        if let Some(layers) = listed {
            state.set_in_flight(layers);
        }
        match ended {
            Some(layer) => Ok(Some(layer)),
            None => {
                state.signal();
                Err(failure)
            }
        }
    }

    /// One step of waiting out every layer of the request in flight (a store's close, a
    /// request's exit): drives the oldest for at most one `WAIT_SLICE`, never past `deadline`.
    /// A failed layer ends like a completed one (its outcome kept for the waits); the later
    /// layers are driven next. Each `Continue` either ended a layer (at most
    /// `layers_in_flight_max` of them) or spent a slice before the deadline, so a caller that
    /// steps until another answer is done by the deadline.
    pub fn settle_step(&mut self, handle: u64, deadline: Instant) -> Settling {
        let before = match self.request(handle) {
            Ok(state) => state.in_flight.len(),
            Err(_) => return Settling::Settled, // gone: the store's close settled it
        };
        if before == 0 {
            return Settling::Settled;
        }
        let now = Instant::now();
        match self.drive(handle, deadline.min(now + WAIT_SLICE)) {
            Ok(_) => Settling::Continue,
            Err(failure) if failure.class == ErrorClass::Timeout && Instant::now() < deadline => Settling::Continue,
            Err(_) => {
                let after = self.request(handle).map_or(0, |state| state.in_flight.len());
                if after < before {
                    Settling::Continue // the store's list says a layer ended; the later ones are next
                } else {
                    Settling::Unsettled
                }
            }
        }
    }

    /// The completion thread's pass over the requests that have an eventfd and a layer in
    /// flight (`armed`): each is driven for at most `slice` (`drive_armed_one`). The thread
    /// itself takes the store's lock for each request apart (`store::run_service`).
    pub fn drive_armed(&mut self, slice: Duration) -> ArmedPass {
        let (armed, mut backing_off) = self.armed(Instant::now());
        for &handle in &armed {
            backing_off |= self.drive_armed_one(handle, slice);
        }
        ArmedPass { driven: !armed.is_empty(), backing_off }
    }

    /// The requests the completion thread drives now: those with an eventfd and a layer in
    /// flight, except those waiting out their backoff after a failed wait; and whether any
    /// does (`ArmedPass::backing_off`).
    pub fn armed(&self, now: Instant) -> (Vec<u64>, bool) {
        let mut backing_off = false;
        let mut armed = Vec::new();
        for (&handle, state) in &self.requests {
            if state.eventfd.is_none() || state.in_flight.is_empty() {
                continue;
            }
            match state.stalled.as_ref().and_then(|stall| stall.backoff_until) {
                Some(until) if now < until => backing_off = true,
                _ => armed.push(handle),
            }
        }
        (armed, backing_off)
    }

    /// Drives armed request `handle` for at most `slice`; returns whether it now waits out a
    /// backoff. A failed layer's outcome is recorded by `drive` (the later layers are driven
    /// on); a wait that failed without ending its layer is kept to report
    /// (`RequestState::stalled`) and tried again once `STALL_RETRY_BACKOFF` passed (the request
    /// is left alone until then, not until someone else waits). A request no longer armed
    /// (ended, its layers taken, or backing off since `armed` listed it) is left alone.
    pub fn drive_armed_one(&mut self, handle: u64, slice: Duration) -> bool {
        let now = Instant::now();
        match self.requests.get(&handle) {
            Some(state) if state.eventfd.is_some() && !state.in_flight.is_empty() => {
                if state.stalled.as_ref().and_then(|stall| stall.backoff_until).is_some_and(|until| now < until) {
                    return true;
                }
            }
            _ => return false,
        }
        let driven = self.drive(handle, now + slice);
        let Some(state) = self.requests.get_mut(&handle) else { return false };
        match driven {
            Err(failure) if failure.class != ErrorClass::Timeout => {
                state.stall(failure, Instant::now() + STALL_RETRY_BACKOFF);
                true
            }
            // The wait no longer fails: a stall still in flight stays to report, but the
            // request is driven at full pace again.
            _ => {
                if let Some(stall) = &mut state.stalled {
                    stall.backoff_until = None;
                }
                false
            }
        }
    }

    pub fn commit(&mut self, handle: u64) -> Result<usize, Failure> {
        let state = self.request(handle)?;
        if state.direction != Direction::Store {
            return Err(Failure::new(ErrorClass::InvalidState, "commit on a retrieve request: finish it"));
        }
        if !state.in_flight.is_empty() {
            return Err(Failure::new(
                ErrorClass::InvalidState,
                format!("{} still in flight: wait for every layer before commit", state.in_flight_text()),
            ));
        }
        let remote = self.is_remote();
        let committed = self.layer_store()?.commit_store(RequestHandle::from_bits(handle));
        if remote {
            self.touch_daemon();
        }
        match committed {
            Ok(stored) => {
                self.requests.remove(&handle);
                Ok(stored)
            }
            Err(error) => {
                self.forget_unless_held(handle);
                Err(Failure::from(error))
            }
        }
    }

    /// After a failed commit or finish: whether the store let go of the request decides, not
    /// the error's kind. A refusal before anything happened (a layer not stored: store it,
    /// then commit again; a layer in flight the mirror did not know of) leaves it held, and so
    /// may a failure part way (a tuttid client whose commit failed before it finished its data
    /// half): the request then stays live, with the store's list of its layers in flight, so
    /// that `finish`, the request's exit or the store's close still ends it and hands back
    /// what it holds (IOCBs, the reservation) only once nothing is in flight. One the store no
    /// longer knows is forgotten here too.
    fn forget_unless_held(&mut self, handle: u64) {
        match self.store_in_flight(handle) {
            Some(layers) => {
                if let Some(state) = self.requests.get_mut(&handle) {
                    state.set_in_flight(layers);
                }
            }
            None => {
                self.requests.remove(&handle);
            }
        }
    }

    /// A request whose Python object was dropped while prepared, after the drop waited out what
    /// it could of its layers in flight (`Request::drop`): finished if nothing of it is in
    /// flight (and the store still holds it); one with a layer still in flight is kept on
    /// `orphans`, held until its layers end (its commands may still move the engine's blocks,
    /// and the CPU executor sends the rest of a layer only when polled: it is never finished
    /// or given back before that). It never talks to tuttid while the keep-alive ping has the
    /// connection (the drop does not wait for it: `StoreShared::locked_data_path`): a request
    /// with nothing in flight is kept on `orphans` then too (`Dropped::Deferred`).
    pub fn finish_dropped(&mut self, handle: u64) -> Result<Dropped, Failure> {
        let dropped = match self.requests.get(&handle) {
            None => return Ok(Dropped::Finished),
            Some(state) if !state.in_flight.is_empty() => Dropped::Orphaned,
            Some(_) if self.connection_lent.is_some() => Dropped::Deferred,
            Some(_) => return self.finish(handle).map(|()| Dropped::Finished),
        };
        if !self.orphans.contains(&handle) {
            self.orphans.push(handle);
        }
        Ok(dropped)
    }

    /// Drives every orphan (`orphans`) for at most `slice` each (zero: only what has ended
    /// already), and finishes each whose layers all ended (`drive_orphan`); returns whether an
    /// orphan still has a layer in flight (one kept only for the connection is not counted).
    pub fn drive_orphans(&mut self, slice: Duration) -> bool {
        if self.orphans.is_empty() {
            return false;
        }
        for handle in self.orphans.clone() {
            self.drive_orphan(handle, slice);
        }
        self.orphans.iter().any(|handle| self.requests.get(handle).is_some_and(|state| !state.in_flight.is_empty()))
    }

    /// Drives orphan `handle` for at most `slice` and finishes it once its layers all ended
    /// (it leaves `orphans` then); nothing if it is no orphan (any more). A finish that fails
    /// leaves the request, nothing of it in flight, for the store's close. While the keep-alive
    /// ping has the store's connection a settled orphan stays kept: its finish may talk to
    /// tuttid (`finish_dropped`).
    pub fn drive_orphan(&mut self, handle: u64, slice: Duration) {
        if !self.orphans.contains(&handle) {
            return;
        }
        let deadline = Instant::now() + slice;
        // Bounded: each Continue ended a layer or spent a slice before the deadline.
        let settling = loop {
            match self.settle_step(handle, deadline) {
                Settling::Continue => continue,
                other => break other,
            }
        };
        if settling != Settling::Settled || (self.connection_lent.is_some() && self.requests.contains_key(&handle)) {
            return; // still in flight, or its finish waits for the connection: kept
        }
        self.orphans.retain(|&orphan| orphan != handle);
        if self.requests.contains_key(&handle) {
            match self.finish(handle) {
                Ok(()) => tracing::info!("tutti: request {handle:#x}, dropped with a layer in flight, is finished"),
                Err(failure) => tracing::warn!(
                    message = %failure.message,
                    "tutti: finishing request {handle:#x}, dropped with a layer in flight (left for the store's close)"
                ),
            }
        }
    }

    pub fn finish(&mut self, handle: u64) -> Result<(), Failure> {
        let state = self.request(handle)?;
        if !state.in_flight.is_empty() {
            return Err(Failure::new(
                ErrorClass::InvalidState,
                format!("{} still in flight: wait for every layer before finish", state.in_flight_text()),
            ));
        }
        let remote = self.is_remote();
        let finished = self.layer_store()?.finish(RequestHandle::from_bits(handle));
        if remote {
            self.touch_daemon();
        }
        match finished {
            Ok(()) => {
                self.requests.remove(&handle);
                Ok(())
            }
            Err(error) => {
                self.forget_unless_held(handle);
                Err(Failure::from(error))
            }
        }
    }
}

/// tuttid's key seed of (fingerprint, rank, world), for an in-process store in the same space
/// (`KvStore::set_key_seed`: the store keys it with its pool's secret, as tuttid does).
pub fn key_seed(fingerprint: &[u8; 32], rank: u32, world: u32) -> Result<u64, Failure> {
    tutti_daemon::keys::KeySpace::seed_of(fingerprint, rank, world).map_err(|reason| Failure::new(ErrorClass::InvalidArgument, reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_out_of_iocbs_says_what_each_request_holds_and_what_to_raise() {
        // Goal: the defaults (64 IOCBs, 32 requests) with 4 layers in flight: the 17th
        // prepare's message names the IOCBs a request holds, the product past iocbs and the
        // option to raise; a request of more than 2048 commands a layer says it needs several
        // per set, and when the product fits, the message does not blame it.
        let limits = RequestLimits { layers_in_flight: 4, iocbs: 64, requests_max: 32 };
        assert_eq!(
            limits.no_free_iocbs(4, 0),
            "no free IOCBs for this prepare: 0 of iocbs = 64 free, 4 needed; each prepared request holds layers_in_flight = 4 \
             sets of its IOCBs (here 4 IOCBs per request) until it is finished or committed; requests_max x layers_in_flight = 32 \
             x 4 = 128 is more than iocbs = 64: raise iocbs (Store.open / Store.attach) to at least 128 (requests_max x 4 IOCBs \
             per request = 128, for requests the size of this one), or lower layers_in_flight, or prepare fewer requests at once"
        );
        // Two IOCBs per set (a layer of more than 2048 commands): the sets alone (128) would
        // understate what 32 such requests hold (256).
        let message = limits.no_free_iocbs(8, 0);
        assert!(message.contains("raise iocbs (Store.open / Store.attach) to at least 256 (requests_max x 8"), "{message}");
        let fits = RequestLimits { layers_in_flight: 2, iocbs: 64, requests_max: 8 };
        let message = fits.no_free_iocbs(8, 6);
        assert!(message.contains("(here 8 IOCBs per request: 4 per set, one per 2048 commands of a layer)"), "{message}");
        assert!(message.contains("= 16 fits in iocbs = 64, but the requests prepared need more IOCBs each: raise iocbs"), "{message}");
        let bigger = fits.no_free_iocbs(16, 0);
        assert!(bigger.contains("need more IOCBs each: raise iocbs (Store.open / Store.attach) to at least 128 ("), "{bigger}");
    }
}
