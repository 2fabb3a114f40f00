//! `Store`: the layer-wise KV store for Python, in-process or attached to tuttid (module stub
//! `_tutti.pyi` is the contract). Every call takes the store's lock with the GIL released;
//! waits hold it in slices (`backend::WAIT_SLICE`) so other threads get their turn.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gio_uring::abi::GIO_RING_DEPTH_MAX;
use objstore::{Direction, FormatParams, ModelGeometry as Geometry, ObjstoreError, StoreConfig, LAYERS_IN_FLIGHT_LIMIT};
use pyo3::prelude::*;
use pyo3::types::PyList;
use tutti_daemon::client::RemoteConfig;
use tutti_daemon::pool_open::{open_pool, PoolOptions};
use tutti_daemon::protocol::Hello;
use tutti_daemon::{Client, DaemonError};
use tutti_devices::{DeviceKind, DeviceSpec};

use crate::backend::{key_seed, Backend, Loan, RequestLimits, StoreState, STALL_RETRY_BACKOFF};
use crate::errors::{ErrorClass, Failure};
use crate::geometry::ModelGeometry;
use crate::memory::{describe, tensor_names, KvBuffer, KvLayout};
use crate::process::OwningProcess;
use crate::request::Request;
use crate::tensor::{check_layout, LayoutKind, UNSUPPORTED_DEVICE};

/// The devices an in-process store opens.
const DEVICE_KINDS: [DeviceKind; 4] = [DeviceKind::EmuFile, DeviceKind::EmuMemory, DeviceKind::EmuNull, DeviceKind::Vfio];
/// One completion-thread pass drives each armed request for at most this long.
const SERVICE_SLICE: Duration = Duration::from_micros(200);
/// The longest the completion thread sleeps when nothing is armed (it also wakes on a signal),
/// and the keep-alive thread between its looks at the store (it also wakes on a stop).
const SERVICE_IDLE_MAX: Duration = Duration::from_millis(500);
/// The longest the completion thread waits, after one of its steps (and a wait after one of
/// its slices), for the callers waiting for the store's lock to take it
/// (`StoreShared::give_way`): a caller still waiting then waits one more step (a slice at
/// most), and a thread that holds the lock longer costs the one giving way no more than this
/// each step.
const GIVE_WAY_MAX: Duration = Duration::from_millis(1);

/// What a `Store` and its requests share.
pub struct StoreShared {
    state: Mutex<StoreState>,
    /// Callers waiting for the store's lock (`lock`). A Mutex goes to whichever thread asks
    /// first once let go, and the completion thread, stepping from one request to the next,
    /// or a wait, from one slice to the next, would always ask first: each gives way to them
    /// between its steps (`give_way`).
    waiting: AtomicUsize,
    /// Wakes the completion thread (a request armed, the store closing).
    wake: Signal,
    /// Wakes the callers waiting for the connection to tuttid the keep-alive ping has
    /// (`StoreState::connection_lent`) once it is back.
    connection_back: Signal,
    stop: AtomicBool,
    /// The completion thread (`run_service`), once started.
    service: Mutex<Option<JoinHandle<()>>>,
    /// The keep-alive thread (`run_keepalive`: attached stores with keep-alive).
    keepalive_service: Mutex<Option<JoinHandle<()>>>,
    pub kind: &'static str,
    pub geometry: Geometry,
    pub timeout: Duration,
    pub session: Option<u64>,
    /// Layers one request may keep in flight (fixed when the store is opened or attached).
    pub layers_in_flight: u32,
    /// Attached stores with keep-alive: ping when no request went to tuttid for this long.
    keepalive: Option<Duration>,
    /// The registered layout's Python object (its tensors).
    kv_layout: Mutex<Option<Py<KvLayout>>>,
    /// The process that opened or attached the store: the only one whose calls reach it (a
    /// forked child shares its socket and queue pairs with the parent; `process`).
    pub owner: OwningProcess,
}

/// What a store is, fixed when it is opened or attached (`StoreShared::new`).
pub struct StoreIdentity {
    pub kind: &'static str,
    pub geometry: Geometry,
    pub timeout: Duration,
    pub session: Option<u64>,
    pub layers_in_flight: u32,
    pub keepalive: Option<Duration>,
}

impl StoreShared {
    /// A store's shared part, no thread started, no layout registered, nobody waiting.
    pub fn new(state: StoreState, identity: StoreIdentity, owner: OwningProcess) -> StoreShared {
        let StoreIdentity { kind, geometry, timeout, session, layers_in_flight, keepalive } = identity;
        StoreShared {
            state: Mutex::new(state),
            waiting: AtomicUsize::new(0),
            wake: Signal::new(),
            connection_back: Signal::new(),
            stop: AtomicBool::new(false),
            service: Mutex::new(None),
            keepalive_service: Mutex::new(None),
            kind,
            geometry,
            timeout,
            session,
            layers_in_flight,
            keepalive,
            kv_layout: Mutex::new(None),
            owner,
        }
    }

    /// The store's lock; InvalidState in a process other than the one that opened the store
    /// (checked before the lock is taken: a thread of the parent may have held it at the fork).
    pub fn lock(&self) -> Result<MutexGuard<'_, StoreState>, Failure> {
        self.owner.check("the store")?;
        Ok(self.take_lock())
    }

    /// The store's lock, counted among the callers waiting for it while it is asked for (so
    /// that a thread giving way lets this one take it: `give_way`). Every taking of the lock
    /// goes through here: one that is not counted (a Condvar's wait taking it again inside
    /// std) would wait out a wait's slices, each taken back at once.
    fn take_lock(&self) -> MutexGuard<'_, StoreState> {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        state
    }

    /// The completion thread between its steps, and a wait between its slices (`WAIT_SLICE`;
    /// either holds no lock then): lets the callers waiting for the store's lock take it
    /// first, waiting for that at most `GIVE_WAY_MAX`. A thread that let go of the lock and
    /// took it again at once would nearly always get it back (a Mutex is not fair), and a
    /// caller waiting would wait out the whole wait.
    pub fn give_way(&self) {
        let until = Instant::now() + GIVE_WAY_MAX;
        std::thread::yield_now();
        while self.waiting.load(Ordering::Acquire) > 0 && Instant::now() < until {
            std::thread::yield_now();
        }
    }

    /// One step of the completion thread: `step` under the store's lock (unless the store is
    /// stopping or closed: false, the thread ends), then way given to the callers waiting.
    /// The lock only (`locked_data_path`): the keep-alive thread may have the store's
    /// connection to tuttid meanwhile, and a step that needs it checks for it (an orphan's
    /// finish: `run_service`).
    fn service_step(&self, step: impl FnOnce(&mut StoreState)) -> bool {
        if self.stop.load(Ordering::Acquire) {
            return false;
        }
        let stepped = self.locked_data_path(|state| {
            if state.is_closed() {
                return false;
            }
            step(state);
            true
        });
        if stepped != Ok(true) {
            return false;
        }
        self.give_way();
        true
    }

    /// The store's lock with the connection to tuttid in place: while the keep-alive ping has
    /// it (`StoreState::connection_lent`), waits for its return, which the ping's own timeout
    /// (the store's) bounds; Timeout should it not come back within that and a second. It
    /// waits without the lock and takes it again through `lock` (counted: a wait slicing
    /// meanwhile gives way to it).
    fn lock_with_connection(&self) -> Result<MutexGuard<'_, StoreState>, Failure> {
        let mut state = self.lock()?;
        if state.connection_lent.is_none() {
            return Ok(state);
        }
        let bound = self.timeout.min(CONNECTION_WAIT_CAP).saturating_add(CONNECTION_RETURN_MARGIN);
        let until = Instant::now() + bound;
        while state.connection_lent.is_some() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Failure::new(
                    ErrorClass::Timeout,
                    format!(
                        "the keep-alive ping still has the store's connection to tuttid after {} ms (tuttid does not answer)",
                        bound.as_millis()
                    ),
                ));
            }
            // Seen under the lock: a return after this moves it, and the sleep ends at once.
            let seen = self.connection_back.seen();
            drop(state);
            self.connection_back.wait_past(seen, left);
            state = self.lock()?;
        }
        Ok(state)
    }

    /// Runs `call` under the store's lock with the GIL released (`locked`: a call that may talk
    /// to tuttid).
    pub fn with_state<T: Send>(&self, py: Python<'_>, call: impl FnOnce(&mut StoreState) -> Result<T, Failure> + Send) -> PyResult<T> {
        py.detach(|| self.locked(call).and_then(|result| result)).map_err(|failure| failure.to_pyerr(py))
    }

    /// As `with_state`, for a call that never talks to tuttid (the per-layer path:
    /// `locked_data_path`).
    pub fn with_state_data_path<T: Send>(
        &self,
        py: Python<'_>,
        call: impl FnOnce(&mut StoreState) -> Result<T, Failure> + Send,
    ) -> PyResult<T> {
        py.detach(|| self.locked_data_path(call).and_then(|result| result)).map_err(|failure| failure.to_pyerr(py))
    }

    /// Runs `call` under the store's lock (the caller does not hold the GIL, or released it),
    /// then drops what the call released (`StoreState::released`) after the lock is let go: a
    /// DLPack producer's deleter (numpy's) takes the GIL, and a thread holding the GIL may be
    /// waiting for this lock. `call` may talk to tuttid: it runs with the store's connection
    /// in place (`lock_with_connection`).
    /// InvalidState in another process (see `lock`).
    pub fn locked<T>(&self, call: impl FnOnce(&mut StoreState) -> T) -> Result<T, Failure> {
        let guard = self.lock_with_connection()?;
        Ok(self.locked_in(guard, call))
    }

    /// As `locked`, for a call that never talks to tuttid (the per-layer path, the getters):
    /// it does not wait for the connection the keep-alive ping has.
    pub fn locked_data_path<T>(&self, call: impl FnOnce(&mut StoreState) -> T) -> Result<T, Failure> {
        let guard = self.lock()?;
        Ok(self.locked_in(guard, call))
    }

    fn locked_in<T>(&self, mut state: MutexGuard<'_, StoreState>, call: impl FnOnce(&mut StoreState) -> T) -> T {
        let result = call(&mut state);
        let released = std::mem::take(&mut state.released);
        drop(state);
        drop(released);
        result
    }

    /// Reads the state with the GIL released (getters, which never talk to tuttid): never wait
    /// for the store's lock while holding the GIL (see `locked`).
    pub fn read<T: Send>(&self, py: Python<'_>, read: impl FnOnce(&mut StoreState) -> T + Send) -> PyResult<T> {
        py.detach(|| self.locked_data_path(read)).map_err(|failure| failure.to_pyerr(py))
    }

    /// The keep-alive ping (the keep-alive thread), when the store has been idle `interval`:
    /// the store's connection is lent to it (`StoreState::lend_connection`, `placeholder` in
    /// its place) so that its wait for tuttid's answer holds no lock; the calls that talk to
    /// tuttid wait for its return, the per-layer path and the getters do not. Without a
    /// placeholder (none could be made), it pings under the store's lock.
    fn keepalive_ping(&self, interval: Duration, placeholder: &mut Option<Client>) {
        self.keepalive_ping_with(interval, placeholder, |connection| connection.ping().map_err(Failure::from));
    }

    /// `keepalive_ping` with `exchange` as the ping (tests: one that panics).
    fn keepalive_ping_with(
        &self,
        interval: Duration,
        placeholder: &mut Option<Client>,
        exchange: impl FnOnce(&mut Client) -> Result<(), Failure>,
    ) {
        let due = |state: &StoreState| !state.is_closed() && state.is_remote() && state.last_daemon_request.elapsed() >= interval;
        if self.locked_data_path(|state| due(state)) != Ok(true) {
            return;
        }
        if placeholder.is_none() {
            *placeholder = placeholder_client()
                .map_err(|failure| tracing::debug!(message = %failure.message, "tutti: keep-alive pings hold the store's lock"))
                .ok();
        }
        let pinged = match placeholder.take() {
            None => self
                .locked(|state| {
                    if !due(state) {
                        return Ok(());
                    }
                    let pinged = state.connection().map_or(Ok(()), exchange);
                    state.touch_daemon();
                    pinged
                })
                .and_then(|result| result),
            Some(spare) => match self.locked(|state| if due(state) { state.lend_connection(spare) } else { Loan::Declined(spare) }) {
                Err(failure) => Err(failure),
                Ok(Loan::Declined(spare)) => {
                    *placeholder = Some(spare);
                    Ok(())
                }
                Ok(Loan::Lent(connection)) => {
                    let mut lent = LentConnection { shared: self, connection: Some(connection), placeholder };
                    let connection = lent.connection.as_mut().expect("the connection is lent until the guard's drop");
                    exchange(connection)
                }
            },
        };
        if let Err(failure) = pinged {
            tracing::warn!(message = %failure.message, "tutti: keep-alive ping to tuttid failed");
        }
    }

    /// Ends the keep-alive ping's loan of the store's connection to tuttid: puts `connection` back
    /// (the placeholder returned to `placeholder`), or, with none (the ping panicked: it may have
    /// been half way through an exchange), drops the loan with the connection lost, the
    /// placeholder left in its place (out of step: every later call that talks to tuttid fails
    /// at once as Disconnected). Then wakes the calls waiting for it.
    fn end_loan(&self, connection: Option<Client>, placeholder: &mut Option<Client>) {
        // Not `locked`, which would wait for this very return; counted, so that a wait slicing
        // meanwhile gives way to it (else it could take the lock only past the calls' bound on
        // this return, failing them as Timeout).
        let mut state = self.take_lock();
        match connection {
            Some(connection) => *placeholder = state.return_connection(connection),
            None => {
                tracing::error!("tutti: the keep-alive ping panicked with the store's connection to tuttid: the connection is dropped");
                state.lose_lent_connection();
            }
        }
        drop(state);
        self.connection_back.notify();
    }

    /// Closes the store (if it is not closed) with the completion thread stopped; called without
    /// the GIL. InvalidState in another process, before anything is stopped or closed: the
    /// completion thread and the session are the parent's.
    fn close_now(&self, deadline: Instant) -> Result<(), Failure> {
        self.owner.check("the store")?;
        self.stop_service();
        self.locked(|state| {
            if !state.is_closed() {
                state.close(deadline);
            }
        })
    }

    /// Tests: ends a loan of the store's connection (`end_loan`) as the keep-alive ping does,
    /// with `connection` as what it had.
    #[cfg(test)]
    pub fn end_loan_for_tests(&self, connection: Option<Client>) {
        self.end_loan(connection, &mut None);
    }

    /// Tests: counts (`by` 1) or uncounts (-1) a caller waiting for the store's lock that is not
    /// there: one that asked and has not run since (a loaded machine), whom `give_way` waits
    /// for its whole `GIVE_WAY_MAX`.
    #[cfg(test)]
    pub fn pretend_waiting_for_tests(&self, by: isize) {
        if by >= 0 {
            self.waiting.fetch_add(by.unsigned_abs(), Ordering::AcqRel);
        } else {
            self.waiting.fetch_sub(by.unsigned_abs(), Ordering::AcqRel);
        }
    }

    /// Tests: how many callers wait for the store's lock (`lock`), so that a test holding it
    /// knows another thread reached it.
    #[cfg(test)]
    pub fn waiting_for_lock(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Tests: what a `Store` over `state` shares with its requests (no completion thread, no
    /// keep-alive), with the store's `timeout`.
    #[cfg(test)]
    pub fn for_tests(state: StoreState, geometry: Geometry, layers_in_flight: u32, timeout: Duration) -> Arc<StoreShared> {
        StoreShared::for_tests_owned_by(state, geometry, layers_in_flight, timeout, OwningProcess::current())
    }

    /// Tests: as `for_tests`, opened by `owner` (another process: a forked child's view).
    #[cfg(test)]
    pub fn for_tests_owned_by(
        state: StoreState,
        geometry: Geometry,
        layers_in_flight: u32,
        timeout: Duration,
        owner: OwningProcess,
    ) -> Arc<StoreShared> {
        Arc::new(StoreShared::new(
            state,
            StoreIdentity { kind: "in-process", geometry, timeout, session: None, layers_in_flight, keepalive: None },
            owner,
        ))
    }

    /// Starts the completion thread if it is not running (one per store).
    pub fn ensure_service(self: &Arc<Self>) -> Result<(), Failure> {
        let mut service = self.service.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if service.is_none() && !self.stop.load(Ordering::Acquire) {
            let weak = Arc::downgrade(self);
            let handle = std::thread::Builder::new()
                .name("tutti-completion".into())
                .spawn(move || run_service(weak, SERVICE_SLICE))
                .map_err(|error| Failure::new(ErrorClass::Device, format!("starting the store's completion thread: {error}")))?;
            *service = Some(handle);
        }
        Ok(())
    }

    pub fn wake(&self) {
        self.wake.notify();
    }

    /// Starts the keep-alive thread, which pings tuttid when the store has been idle `interval`
    /// (`run_keepalive`; once, when an attached store with keep-alive is made).
    fn start_keepalive(self: &Arc<Self>, interval: Duration) -> Result<(), Failure> {
        let weak = Arc::downgrade(self);
        let handle = std::thread::Builder::new()
            .name("tutti-keepalive".into())
            .spawn(move || run_keepalive(weak, interval))
            .map_err(|error| Failure::new(ErrorClass::Device, format!("starting the store's keep-alive thread: {error}")))?;
        *self.keepalive_service.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(handle);
        Ok(())
    }

    /// Stops the completion thread and the keep-alive thread and waits for them (bounded by one
    /// slice or idle sleep, and a ping under way by the store's timeout).
    fn stop_service(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake.notify();
        let completion = self.service.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        let keepalive = self.keepalive_service.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some(handle) = &keepalive {
            handle.thread().unpark();
        }
        for handle in [completion, keepalive].into_iter().flatten() {
            if handle.thread().id() != std::thread::current().id() {
                let _ = handle.join();
            }
        }
    }
}

/// The completion thread: drives the requests that have an eventfd and a layer in flight. It
/// holds the store only while it works on it (a weak reference otherwise), so a dropped store
/// ends it. It takes the store's lock for one request at a time (one `slice` at most each) and
/// for each orphan apart, giving way between them to the callers waiting for it (`give_way`).
/// It never waits for tuttid: the keep-alive ping has a thread of its own (`run_keepalive`),
/// and an orphan, whose finish talks to tuttid, is left for a later pass while that thread has
/// the store's connection.
fn run_service(weak: Weak<StoreShared>, slice: Duration) {
    loop {
        let Some(shared) = weak.upgrade() else { return };
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(Some((armed, orphans))) =
            shared.locked_data_path(|state| (!state.is_closed()).then(|| (state.armed(Instant::now()).0, state.orphans.clone())))
        else {
            return;
        };
        for &handle in &armed {
            if !shared.service_step(|state| {
                state.drive_armed_one(handle, slice);
            }) {
                return;
            }
        }
        // Requests dropped with a layer in flight: finished once it ended (`Request::drop`).
        for &handle in &orphans {
            if !shared.service_step(|state| {
                if state.connection_lent.is_none() {
                    state.drive_orphan(handle, slice);
                }
            }) {
                return;
            }
        }
        if !armed.is_empty() {
            continue; // a request was driven: pass again at once (way was given after each)
        }
        // Idle: whether to sleep is decided under the hold of the lock the wait lets go of, so
        // that an issue since the pass (it wakes this thread once it let go of the lock) is
        // not slept through.
        let Ok(state) = shared.lock() else { return };
        if state.is_closed() {
            return;
        }
        let (armed, backing_off) = state.armed(Instant::now());
        if !armed.is_empty() {
            continue;
        }
        // A request waiting out its backoff after a failed wait is retried at the end of it.
        let sleep = if backing_off || !state.orphans.is_empty() { STALL_RETRY_BACKOFF } else { SERVICE_IDLE_MAX };
        // Seen under the lock (an issue after this wakes it: the sleep ends at once), slept
        // without it: the next pass takes it through the counted path, so a wait slicing
        // meanwhile gives way to this thread too. A stop after `seen` is seen here, or wakes it.
        let seen = shared.wake.seen();
        drop(state);
        if !shared.stop.load(Ordering::Acquire) {
            shared.wake.wait_past(seen, sleep);
        }
    }
}

/// A wake-up that holds no store lock: a count of signals under a mutex of its own. A thread
/// reads the count under the store's lock while it decides to sleep (`seen`), lets go of the
/// store's lock and sleeps until the count moves (`wait_past`); the signaller moves it after its
/// change to the store (`notify`, after the store's lock is let go). So no signal is slept
/// through, and the sleeper takes the store's lock again through `StoreShared::lock`, counted
/// among the callers waiting for it (a Condvar on the store's own mutex would take it again
/// inside its wait, uncounted, and a wait slicing would keep it from that thread).
struct Signal {
    count: Mutex<u64>,
    moved: Condvar,
}

impl Signal {
    fn new() -> Signal {
        Signal { count: Mutex::new(0), moved: Condvar::new() }
    }

    fn seen(&self) -> u64 {
        *self.count.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn notify(&self) {
        let mut count = self.count.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        *count = count.wrapping_add(1);
        drop(count);
        self.moved.notify_all();
    }

    /// Sleeps until the count is no longer `seen`, `timeout` at most.
    fn wait_past(&self, seen: u64, timeout: Duration) {
        let count = self.count.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        drop(self.moved.wait_timeout_while(count, timeout, |count| *count == seen).unwrap_or_else(|poisoned| poisoned.into_inner()));
    }
}

/// The keep-alive thread of an attached store: pings tuttid when no request went to it for
/// `interval` (`StoreShared::keepalive_ping`: with the store's connection lent to it, so its
/// wait for tuttid holds no lock), else sleeps until then (woken by `stop_service`). Its own
/// thread, so that a ping tuttid leaves unanswered (up to the store's timeout) never holds back
/// the completion thread's driving of armed requests. Like it, it holds the store only while it
/// works on it, and ends when the store is stopped, closed or dropped.
fn run_keepalive(weak: Weak<StoreShared>, interval: Duration) {
    // What stands in for the store's connection while the ping has it.
    let mut placeholder: Option<Client> = None;
    loop {
        let idle = {
            let Some(shared) = weak.upgrade() else { return };
            if shared.stop.load(Ordering::Acquire) {
                return;
            }
            shared.keepalive_ping(interval, &mut placeholder);
            let until_due =
                shared.locked_data_path(|state| (!state.is_closed()).then(|| interval.saturating_sub(state.last_daemon_request.elapsed())));
            let Ok(Some(until_due)) = until_due else { return };
            until_due
        };
        std::thread::park_timeout(idle.clamp(Duration::from_millis(1), SERVICE_IDLE_MAX));
    }
}

/// The shortest interval between keep-alive pings: each ping has the store's connection (one
/// exchange with tuttid), so a lease of 0 or a few ms from tuttid must not make it ping every
/// millisecond and starve every call that talks to tuttid of the connection.
pub const KEEPALIVE_INTERVAL_MIN: Duration = Duration::from_millis(100);

/// How long an attached store may stay idle before the completion thread pings tuttid: a third
/// of the session's `lease` (tuttid's, untrusted), so that two pings may be late before the
/// lease runs out, but never under `KEEPALIVE_INTERVAL_MIN` (a lease under three times that
/// cannot be kept safely at any sane rate: `attach` warns).
pub fn keepalive_interval(lease: Duration) -> Duration {
    (lease / 3).max(KEEPALIVE_INTERVAL_MIN)
}

/// The longest the store's timeout counts for in a wait for the connection the keep-alive ping
/// has (the client caps its own waits at a day too).
const CONNECTION_WAIT_CAP: Duration = Duration::from_secs(86_400);
/// Past the store's timeout, how long a call waits for the connection the keep-alive ping has
/// (the ping's exchange may overrun its timeout by a read tick).
const CONNECTION_RETURN_MARGIN: Duration = Duration::from_secs(1);

/// A `Client` connected to no daemon and out of step (`Client::detached`: every call fails at
/// once as Disconnected), which stands in for the store's connection to tuttid while the
/// keep-alive ping has it (nothing uses it then: `StoreState::connection_lent`), and stays in
/// its place should the ping panic with it (`LentConnection`). A socket pair: no file system,
/// no environment (this runs on the completion thread, beside Python's `os.environ` writes).
fn placeholder_client() -> Result<Client, Failure> {
    Client::detached("the keep-alive ping did not give the store's connection back (it panicked with it)")
        .map_err(|error| Failure::new(ErrorClass::Device, format!("making the keep-alive ping's placeholder connection: {error}")))
}

/// The store's connection to tuttid while the keep-alive ping has it: its drop ends the loan
/// (`StoreShared::end_loan`), on unwind too, so that a panic in the ping never leaves the
/// connection lent for good (every call that talks to tuttid would time out waiting for it).
/// A panic drops the connection first: it may be half way through an exchange.
struct LentConnection<'a> {
    shared: &'a StoreShared,
    connection: Option<Client>,
    placeholder: &'a mut Option<Client>,
}

impl Drop for LentConnection<'_> {
    fn drop(&mut self) {
        let connection = self.connection.take();
        let connection = if std::thread::panicking() {
            drop(connection);
            None
        } else {
            connection
        };
        self.shared.end_loan(connection, self.placeholder);
    }
}

/// The layer-wise KV store (module stub: `Store`).
#[pyclass(frozen, module = "tutti")]
pub struct Store {
    shared: Arc<StoreShared>,
}

impl Drop for Store {
    fn drop(&mut self) {
        let shared = &self.shared;
        if !shared.owner.is_current() {
            // Inherited across fork: the session, its queue pairs, its memory and its
            // completion thread are the parent's. Nothing is joined, waited for, finished or
            // closed here, and the state is never dropped in this process (its drop would close
            // it): the child keeps the memory and mappings it inherited, unused, until it exits;
            // only its copies of the socket and device fds are closed (at the fork already,
            // again here should the fork have skipped the handler: `process`).
            std::mem::forget(Arc::clone(shared));
            crate::process::close_inherited();
            return;
        }
        // Garbage-collected without close(): close now, in this (the interpreter's) thread,
        // with the GIL released while the store's lock is taken (see StoreShared::locked).
        // The timeout went through `duration_of` at open; should the clock still not hold the
        // deadline, closing at once beats a panic in a destructor.
        let deadline = deadline_after(shared.timeout).unwrap_or_else(|_| Instant::now());
        Python::attach(|py| py.detach(|| shared.close_now(deadline)))
            .unwrap_or_else(|failure| tracing::warn!(message = %failure.message, "tutti: closing a dropped store"));
    }
}

/// A connection to tuttid that said Hello: the session's client, the daemon's reply, the
/// pool's geometry from it (checked), and the connection's descriptors recorded for forked
/// children to close (`process`).
pub(crate) struct Hellod {
    pub client: Client,
    pub reply: tutti_daemon::protocol::HelloReply,
    pub geometry: Geometry,
    pub connections: Vec<std::os::fd::RawFd>,
}

/// What [`hello_daemon`] does when tuttid answers Busy.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Busy {
    /// Raised at once (a lookup client: the scheduler asks again at its own pace).
    Refuse,
    /// Asked again on a new connection until `timeout` (an engine's store attaching).
    AskAgain,
}

/// Connects to tuttid at `socket` and says `hello`. `timeout` bounds the connect and is also
/// every later call's wait on the connection. Busy to Hello is transient (every connection
/// taken, docs/tuttid.md): with [`Busy::AskAgain`] it is asked again, on a new connection (a
/// refused Hello's connection holds a place until it closes), until `timeout` has passed. (A
/// restarted engine's old session still retiring is answered Busy on the first memory
/// registration while it holds the request reservations the new session needs, and on
/// AttachQueues while it holds the queue ids: `RemoteKvStore` asks those again itself, on the
/// same connection, within its own `timeout`.) A connection
/// that fails after its descriptors were recorded is forgotten as it closes: its own record
/// only (another thread's connection found with it keeps its own).
pub(crate) fn hello_daemon(socket: &std::path::Path, timeout: Duration, hello: &Hello, busy: Busy) -> Result<Hellod, Failure> {
    let deadline = tutti_daemon::frame_io::deadline_after(Instant::now(), timeout);
    let mut pauses = tutti_daemon::client::BusyPauses::new();
    // The last Busy answer: a try after it that runs out of the deadline says that (tuttid was
    // busy throughout), not that a Hello timed out.
    let mut busy_before: Option<Failure> = None;
    loop {
        let before = crate::process::open_fds();
        // Each try (connect and Hello) within what is left of the one deadline: a daemon slow to
        // answer Busy is asked again only within `timeout`, not for a whole `timeout` more.
        let left = deadline.saturating_duration_since(Instant::now());
        let (mut client, connections) = match connect_recorded(socket, left, &before) {
            Ok(connected) => connected,
            Err(failure) if failure.class == ErrorClass::Timeout => return Err(busy_before.unwrap_or(failure)),
            Err(failure) => return Err(failure),
        };
        // The geometry is checked before anything else uses it (a refusal ends the session, the
        // client dropped here).
        let answered = client.hello(hello).map_err(Failure::from).and_then(|reply| Ok((crate::geometry::of_hello(&reply.shape)?, reply)));
        match answered {
            Ok((geometry, reply)) => {
                // The session's calls each wait the store's whole timeout.
                client.set_timeout(timeout);
                return Ok(Hellod { client, reply, geometry, connections });
            }
            Err(failure) => {
                close_failed_connection(client, &connections);
                if failure.class == ErrorClass::Timeout {
                    return Err(busy_before.unwrap_or(failure));
                }
                let busy_again = busy == Busy::AskAgain && failure.code.as_deref() == Some("Busy");
                if !busy_again || !pauses.pause_before(deadline) {
                    return Err(failure);
                }
                tracing::debug!(message = %failure.message, "tutti: tuttid was busy; attaching again");
                busy_before = Some(failure);
            }
        }
    }
}

/// Connects to tuttid at `socket` and records, for forked children to close (`process`), the
/// connections to it opened since `before`: this one, and any another thread opened meanwhile
/// (recorded by that thread too: one record).
fn connect_recorded(
    socket: &std::path::Path,
    timeout: Duration,
    before: &crate::process::OpenFds,
) -> Result<(Client, Vec<std::os::fd::RawFd>), Failure> {
    let client = Client::connect(socket, timeout)?;
    let connections = crate::process::daemon_connections_since(before, socket);
    crate::process::keep_from_forked_children(&connections);
    Ok((client, connections))
}

/// Closes the connection of a Hello that failed and forgets its record, only its own: the
/// others among `connections` are another thread's (`process::close_and_forget`).
fn close_failed_connection(client: Client, connections: &[std::os::fd::RawFd]) {
    crate::process::close_and_forget(client, connections);
}

pub(crate) fn fingerprint_of(bytes: &[u8]) -> Result<[u8; 32], Failure> {
    <[u8; 32]>::try_from(bytes).map_err(|_| {
        Failure::new(
            ErrorClass::InvalidArgument,
            format!("model_fingerprint is {} bytes, expected 32 (see tutti.fingerprint)", bytes.len()),
        )
    })
}

/// The longest timeout the binding takes, in seconds (10^9 s, about 31 years): a deadline that
/// far ahead is still an `Instant` on every clock, while a longer one (`wait(1e19)`) may not be.
pub const TIMEOUT_MAX_S: f64 = 1e9;

/// A timeout from Python: 0..=`TIMEOUT_MAX_S` seconds, else InvalidArgument (never a deadline
/// past the clock's range, whose `Instant + Duration` would panic).
pub fn duration_of(seconds: f64, what: &str) -> Result<Duration, Failure> {
    let invalid = || {
        Failure::new(
            ErrorClass::InvalidArgument,
            format!("{what} = {seconds}: expected a non-negative number of seconds, at most {TIMEOUT_MAX_S:e}"),
        )
    };
    // NaN is neither below nor above: refused by try_from_secs_f64.
    if seconds > TIMEOUT_MAX_S {
        return Err(invalid());
    }
    Duration::try_from_secs_f64(seconds).map_err(|_| invalid())
}

/// The deadline `timeout` from now, or InvalidArgument when the clock cannot hold it (a
/// timeout past `TIMEOUT_MAX_S` that did not come through `duration_of`).
pub fn deadline_after(timeout: Duration) -> Result<Instant, Failure> {
    Instant::now()
        .checked_add(timeout)
        .ok_or_else(|| Failure::new(ErrorClass::InvalidArgument, format!("a timeout of {} s is past the clock's range", timeout.as_secs())))
}

/// `layers_in_flight` as the store takes it: 1..=objstore's limit (each layer in flight is one
/// more set of every prepared request's IOCBs, so the queue's `iocbs` must hold at least that
/// many for one request). `requests_max x layers_in_flight` past `iocbs` is accepted: a prepare
/// that then finds too few IOCBs is LimitReached saying so (`RequestLimits::no_free_iocbs`).
/// Taken as any int, so that a negative one is InvalidArgument too (not an OverflowError).
fn layers_in_flight_of(layers: i64, iocbs: u32) -> Result<u32, Failure> {
    let layers = u32::try_from(layers).ok().filter(|layers| (1..=LAYERS_IN_FLIGHT_LIMIT).contains(layers)).ok_or_else(|| {
        Failure::new(
            ErrorClass::InvalidArgument,
            format!("layers_in_flight = {layers}: expected 1..={LAYERS_IN_FLIGHT_LIMIT} layers in flight per request"),
        )
    })?;
    if iocbs < layers {
        return Err(Failure::new(
            ErrorClass::InvalidArgument,
            format!("layers_in_flight = {layers} needs at least as many IOCBs per request; iocbs = {iocbs}"),
        ));
    }
    Ok(layers)
}

/// The most NVMe queue entries a store asks for (`queue_depth`).
pub const QUEUE_DEPTH_MAX: u32 = 1024;

/// The most requests a store keeps prepared at once (`requests_max`): the store allocates each
/// one's state at open (a few hundred bytes each, some 20 MB at this bound), and a request that
/// moves bytes holds at least one IOCB, of which there are at most `GIO_RING_DEPTH_MAX`
/// (65536), so more could never be prepared at once anyway.
pub const REQUESTS_MAX_LIMIT: usize = GIO_RING_DEPTH_MAX as usize;

/// `Store.open`/`attach`'s queue options, checked before anything is opened, allocated or
/// connected: `queue_depth` in 2..=`QUEUE_DEPTH_MAX`, `iocbs` a power of two in
/// 2..=`GIO_RING_DEPTH_MAX` (the gio_uring IOCB pool and its rings' depth: past it the store
/// could not be registered, and a huge one aborts the process on allocation), `requests_max` in
/// 1..=`REQUESTS_MAX_LIMIT`; else InvalidArgument naming each bound.
fn check_queue_options(queue_depth: u32, iocbs: u32, requests_max: usize) -> Result<(), Failure> {
    let iocbs_ok = iocbs.is_power_of_two() && (2..=GIO_RING_DEPTH_MAX).contains(&iocbs);
    if iocbs_ok && (2..=QUEUE_DEPTH_MAX).contains(&queue_depth) && (1..=REQUESTS_MAX_LIMIT).contains(&requests_max) {
        return Ok(());
    }
    Err(Failure::new(
        ErrorClass::InvalidArgument,
        format!(
            "iocbs = {iocbs} (a power of two in 2..={GIO_RING_DEPTH_MAX}), queue_depth = {queue_depth} (2..={QUEUE_DEPTH_MAX}), \
             requests_max = {requests_max} (1..={REQUESTS_MAX_LIMIT})"
        ),
    ))
}

fn device_specs(devices: &Bound<'_, PyAny>) -> PyResult<Vec<DeviceSpec>> {
    let texts: Vec<String> = match devices.extract::<String>() {
        Ok(text) => vec![text],
        Err(_) => devices.extract()?,
    };
    if texts.is_empty() {
        return Err(Failure::new(ErrorClass::InvalidArgument, "no devices: give e.g. \"emu:mem:1g\"").into());
    }
    texts
        .iter()
        .map(|text| {
            DeviceSpec::parse(text, &DEVICE_KINDS).map_err(|error| Failure::new(ErrorClass::InvalidArgument, error.to_string()).into())
        })
        .collect()
}

/// Opening the devices: every failure there is the devices' or the pool's, not a daemon's.
fn open_failure(error: DaemonError) -> Failure {
    match error {
        DaemonError::Pool { context, source } => {
            let failure = Failure::from(&source);
            Failure { message: format!("{context}: {}", failure.message), ..failure }
        }
        // The tools' refusal names their flag; here it is a keyword.
        DaemonError::Devices(tutti_devices::DeviceError::ForeignContents { spec, found }) => Failure::new(
            ErrorClass::Pool,
            format!(
                "{spec} holds {found}: it is not a tutti pool, and formatting it destroys what is there; \
                 pass overwrite=True to format it anyway"
            ),
        ),
        other => Failure::new(ErrorClass::Device, other.to_string()),
    }
}

impl Store {
    fn new(shared: StoreShared) -> PyResult<Store> {
        let shared = Arc::new(shared);
        if let Some(interval) = shared.keepalive {
            shared.start_keepalive(interval)?;
        }
        Ok(Store { shared })
    }

    fn prepare(
        &self,
        py: Python<'_>,
        direction: Direction,
        tokens: Vec<u32>,
        block_ids: Vec<u32>,
        first_block: usize,
    ) -> PyResult<Request> {
        let ids = block_ids.clone();
        let (handle, plan, written) = self.shared.with_state(py, move |state| state.prepare(direction, &tokens, &ids, first_block))?;
        Ok(Request::new(Arc::clone(&self.shared), handle.to_bits(), direction, block_ids, written, plan))
    }
}

#[pymethods]
impl Store {
    #[staticmethod]
    #[pyo3(signature = (
        devices, geometry, *, format = false, overwrite = false, create_bytes = None, blocks_per_slot = 1, slots_max = None, payload_crcs = true,
        verify_retrieves = false, model_fingerprint = None, tp_rank = 0, tp_world = 1, namespace = 1,
        lock_dir = "/run/tutti".to_string(), queue_depth = 64, iocbs = 64, requests_max = 32, timeout_s = 30.0,
        layers_in_flight = 1
    ))]
    #[allow(clippy::too_many_arguments)]
    fn open(
        py: Python<'_>,
        devices: &Bound<'_, PyAny>,
        geometry: &ModelGeometry,
        format: bool,
        overwrite: bool,
        create_bytes: Option<u64>,
        blocks_per_slot: u32,
        slots_max: Option<u64>,
        payload_crcs: bool,
        verify_retrieves: bool,
        model_fingerprint: Option<Vec<u8>>,
        tp_rank: u32,
        tp_world: u32,
        namespace: u32,
        lock_dir: String,
        queue_depth: u32,
        iocbs: u32,
        requests_max: usize,
        timeout_s: f64,
        layers_in_flight: i64,
    ) -> PyResult<Store> {
        let specs = device_specs(devices)?;
        let geometry = geometry.inner;
        let timeout = duration_of(timeout_s, "timeout_s")?;
        let key_space = match model_fingerprint {
            Some(bytes) => {
                let fingerprint = fingerprint_of(&bytes)?;
                key_seed(&fingerprint, tp_rank, tp_world)?; // checks rank and world now
                Some((fingerprint, tp_rank, tp_world))
            }
            None if tp_rank != 0 || tp_world != 1 => {
                return Err(Failure::new(
                    ErrorClass::InvalidArgument,
                    "tp_rank/tp_world need a model_fingerprint (the key space they select)",
                )
                .into())
            }
            None => None,
        };
        check_queue_options(queue_depth, iocbs, requests_max)?;
        let layers_in_flight = layers_in_flight_of(layers_in_flight, iocbs)?;
        let options = PoolOptions {
            specs,
            namespace,
            emu_lba_bytes: 4096,
            emu_create_bytes: create_bytes,
            format: format.then_some(FormatParams {
                blocks_per_slot,
                slot_count_max: slots_max,
                payload_crc: payload_crcs,
                ..FormatParams::new(geometry)
            }),
            overwrite,
            lock_dir: PathBuf::from(lock_dir),
            // The executor's queue pair on each controller (the pool keeps its own for metadata).
            client_queue_pairs: 1,
            emu_doorbell_relay: false,
        };
        let device_paths: Vec<PathBuf> = options
            .specs
            .iter()
            .filter_map(|spec| match spec {
                DeviceSpec::EmuFile(path) | DeviceSpec::Uring(path) => Some(path.clone()),
                _ => None,
            })
            .collect();
        let (opened, device_fds) = py
            .detach(|| {
                let before = crate::process::open_fds();
                let opened = open_pool(&options).map_err(open_failure)?;
                // A pool of another geometry is refused here, with the GIL released: dropping
                // it tears down its controllers and emulators (bounded, but it may take
                // seconds). And before its fds are recorded for forked children to close: a
                // record would outlive the file it names, and a file opened later under the
                // number (the same image again: the same identity) would be closed in children.
                if *opened.pool.geometry() != geometry {
                    let mismatch = ObjstoreError::GeometryMismatch { on_disk: *opened.pool.geometry(), registered: geometry };
                    drop(opened);
                    return Err(Failure::from(mismatch));
                }
                // A forked child closes its copies of the locks and device fds (`process`).
                let device_fds = crate::process::device_fds_since(&before, &options.lock_dir, &device_paths);
                crate::process::keep_from_forked_children(&device_fds);
                Ok((opened, device_fds))
            })
            .map_err(|failure| failure.to_pyerr(py))?;
        let config = StoreConfig { iocbs, ioctx_per_iocb_max: 2048, requests_max, verify_retrieves };
        let backend = Backend::LocalOpen { pool: opened.pool, emulators: opened.emulators, locks: opened.locks, config, queue_depth };
        let mut state = StoreState::new(backend, key_space, RequestLimits { layers_in_flight, iocbs, requests_max });
        state.closed_in_forked_children = device_fds;
        Store::new(StoreShared::new(
            state,
            StoreIdentity { kind: "in-process", geometry, timeout, session: None, layers_in_flight, keepalive: None },
            OwningProcess::current(),
        ))
    }

    #[staticmethod]
    #[pyo3(signature = (
        socket, *, model_fingerprint, tp_rank = 0, tp_world = 1, client_name = "python".to_string(), timeout_s = 5.0,
        queue_depth = 64, iocbs = 64, requests_max = 32, verify_retrieves = false, keepalive = true, layers_in_flight = 1
    ))]
    #[allow(clippy::too_many_arguments)]
    fn attach(
        py: Python<'_>,
        socket: PathBuf,
        model_fingerprint: Vec<u8>,
        tp_rank: u32,
        tp_world: u32,
        client_name: String,
        timeout_s: f64,
        queue_depth: u32,
        iocbs: u32,
        requests_max: usize,
        verify_retrieves: bool,
        keepalive: bool,
        layers_in_flight: i64,
    ) -> PyResult<Store> {
        let fingerprint = fingerprint_of(&model_fingerprint)?;
        let timeout = duration_of(timeout_s, "timeout_s")?;
        // Checked before connecting: a refusal costs no session.
        check_queue_options(queue_depth, iocbs, requests_max)?;
        let layers_in_flight = layers_in_flight_of(layers_in_flight, iocbs)?;
        let hello = Hello { model_fingerprint: fingerprint, tp_rank, tp_world, client_name };
        let Hellod { client, reply, geometry, connections } =
            py.detach(|| hello_daemon(&socket, timeout, &hello, Busy::AskAgain)).map_err(|failure| failure.to_pyerr(py))?;
        let session = reply.session;
        let lease = Duration::from_millis(u64::from(reply.lease_ms));
        if keepalive && lease < KEEPALIVE_INTERVAL_MIN * 3 {
            tracing::warn!(
                lease_ms = reply.lease_ms,
                "tutti: tuttid's lease is shorter than three keep-alive intervals of {} ms: an idle session may be ended",
                KEEPALIVE_INTERVAL_MIN.as_millis()
            );
        }
        let config = RemoteConfig {
            kv_blocks: 0,
            queue_depth,
            store: StoreConfig { iocbs, ioctx_per_iocb_max: 2048, requests_max, verify_retrieves },
            timeout,
        };
        let daemon_process = client.daemon_process();
        let backend = Backend::RemoteAttached { client, hello: reply, config };
        let mut state = StoreState::new(backend, None, RequestLimits { layers_in_flight, iocbs, requests_max });
        state.daemon = Some(crate::device_memory::AttachedDaemon::new(socket, daemon_process));
        state.daemon_session = Some(session);
        state.closed_in_forked_children = connections;
        Store::new(StoreShared::new(
            state,
            StoreIdentity {
                kind: "tuttid",
                geometry,
                timeout,
                session: Some(session),
                layers_in_flight,
                keepalive: keepalive.then(|| keepalive_interval(lease)),
            },
            OwningProcess::current(),
        ))
    }

    #[getter]
    fn kind(&self) -> &'static str {
        self.shared.kind
    }

    #[getter]
    fn geometry(&self) -> ModelGeometry {
        ModelGeometry::from_inner(self.shared.geometry)
    }

    #[getter]
    fn block_tokens(&self) -> u32 {
        self.shared.geometry.block_tokens
    }

    #[getter]
    fn layers_in_flight(&self) -> u32 {
        self.shared.layers_in_flight
    }

    #[getter]
    fn registered(&self, py: Python<'_>) -> PyResult<bool> {
        self.shared.read(py, |state| state.registered.is_some())
    }

    #[getter]
    fn kv(&self, py: Python<'_>) -> PyResult<Option<Py<KvLayout>>> {
        // Checked before the lock: a thread of the parent may have held it at the fork.
        self.shared.owner.check("the store").map_err(|failure| failure.to_pyerr(py))?;
        Ok(self.shared.kv_layout.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).as_ref().map(|layout| layout.clone_ref(py)))
    }

    #[getter]
    fn closed(&self, py: Python<'_>) -> PyResult<bool> {
        self.shared.read(py, |state| state.is_closed())
    }

    #[getter]
    fn session(&self) -> Option<u64> {
        self.shared.session
    }

    #[getter]
    fn requests_sent(&self, py: Python<'_>) -> PyResult<u64> {
        self.shared.read(py, |state| state.requests_sent())
    }

    #[pyo3(signature = (num_blocks, kind = "paged"))]
    fn allocate_kv(&self, py: Python<'_>, num_blocks: u32, kind: &str) -> PyResult<Py<KvLayout>> {
        let kind = LayoutKind::parse(kind).ok_or_else(|| {
            Failure::new(ErrorClass::InvalidArgument, format!("layout kind {kind:?}: separate, fused, paged or block_major"))
        })?;
        let timeout = self.shared.timeout;
        let (regions, kept_for_good) = self.shared.with_state(py, move |state| state.allocate(kind, num_blocks, timeout))?;
        let buffers = regions
            .into_iter()
            .map(|region| Py::new(py, KvBuffer::new(region, kept_for_good.clone())).map(Py::into_any))
            .collect::<PyResult<Vec<_>>>()?;
        let checked = self.shared.read(py, |state| state.registered.clone())?;
        let layout = Py::new(py, KvLayout::new_checked(kind, buffers, checked))?;
        *self.shared.kv_layout.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(layout.clone_ref(py));
        Ok(layout)
    }

    fn register_kv(&self, py: Python<'_>, layout: Py<KvLayout>) -> PyResult<()> {
        let spec = layout.get();
        let names = tensor_names(spec.kind, spec.tensors.len());
        let mut descriptions = Vec::with_capacity(spec.tensors.len());
        let mut keeps = Vec::with_capacity(spec.tensors.len());
        for (tensor, name) in spec.tensors.iter().zip(&names) {
            let (description, keep) = describe(tensor.bind(py), name)?;
            descriptions.push(description);
            keeps.push(keep);
        }
        let geometry = self.shared.geometry;
        let checked = check_layout(spec.kind, &descriptions, &geometry)
            .map_err(|message| {
                let class = if message.contains(UNSUPPORTED_DEVICE) { ErrorClass::UnsupportedMemory } else { ErrorClass::InvalidArgument };
                Failure::new(class, message)
            })
            .map_err(|failure| failure.to_pyerr(py))?;
        let registered = checked.clone();
        let timeout = self.shared.timeout;
        // The stand-ins' list is looked up here, with the GIL held: never across a fork.
        let stand_in = crate::device_memory::stand_in_of(py, &checked);
        self.shared.with_state(py, move |state| state.register(registered, keeps, stand_in, timeout))?;
        spec.set_checked(checked);
        let mut current = self.shared.kv_layout.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if current.is_none() {
            *current = Some(layout);
        }
        Ok(())
    }

    #[pyo3(signature = (tokens, first_block = 0))]
    fn lookup(&self, py: Python<'_>, tokens: Vec<u32>, first_block: usize) -> PyResult<usize> {
        self.shared.with_state(py, move |state| state.lookup(&tokens, first_block))
    }

    #[pyo3(signature = (tokens, first_block = 0))]
    fn lookup_all_ranks(&self, py: Python<'_>, tokens: Vec<u32>, first_block: usize) -> PyResult<usize> {
        self.shared.with_state(py, move |state| state.lookup_all_ranks(&tokens, first_block))
    }

    #[pyo3(signature = (tokens, block_ids, first_block = 0))]
    fn prepare_retrieve(&self, py: Python<'_>, tokens: Vec<u32>, block_ids: Vec<u32>, first_block: usize) -> PyResult<Request> {
        self.prepare(py, Direction::Retrieve, tokens, block_ids, first_block)
    }

    fn prepare_store(&self, py: Python<'_>, tokens: Vec<u32>, block_ids: Vec<u32>) -> PyResult<Request> {
        self.prepare(py, Direction::Store, tokens, block_ids, 0)
    }

    fn ping(&self, py: Python<'_>) -> PyResult<()> {
        self.shared.with_state(py, |state| state.ping())
    }

    #[pyo3(signature = (timeout_s = None))]
    fn close(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<()> {
        let timeout = match timeout_s {
            Some(seconds) => duration_of(seconds, "timeout_s")?,
            None => self.shared.timeout,
        };
        let deadline = deadline_after(timeout)?;
        let shared = Arc::clone(&self.shared);
        py.detach(move || shared.close_now(deadline)).map_err(|failure| failure.to_pyerr(py))?;
        // The registered layout's Python objects go last, after the memory they describe.
        let layout = self.shared.kv_layout.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        drop(layout);
        Ok(())
    }

    fn leaked_registrations(&self, py: Python<'_>) -> PyResult<usize> {
        self.shared.read(py, |state| state.leaked_tensors)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        if !self.shared.owner.is_current() {
            // Inherited across fork: left as a drop leaves it (the parent's), and nothing is
            // raised, so that the exception leaving the block, if any, is the one seen.
            tracing::debug!("tutti: a store inherited across fork left its with block: not closed (the parent's)");
            crate::process::close_inherited();
            return Ok(());
        }
        self.close(py, None)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let status = self
            .shared
            .read(py, |state| {
                if state.is_closed() {
                    "closed"
                } else if state.registered.is_some() {
                    "registered"
                } else {
                    "no KV memory yet"
                }
            })
            .unwrap_or("inherited across fork");
        format!("Store({}, {}, {status})", self.shared.kind, self.shared.geometry)
    }
}

/// The Python list of a request's block ids (for the getters).
pub fn id_list<'py>(py: Python<'py>, ids: &[u32]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_completion_thread_lets_go_of_the_lock_between_requests() {
        // Goal: the completion thread drives each armed request under the store's lock for one
        // slice at most and lets go of it between requests (giving way to a caller waiting for
        // it), so a caller waits about one slice, not one per request. Four armed store
        // requests, each with a layer the controller completes only after 1.5 s, driven in
        // slices of 100 ms: a caller taking the lock over 0.8 s never waits 380 ms (one slice
        // plus room for a loaded machine's scheduling: 250 ms failed once in twelve runs at a
        // load of 4.5 on 2 cores). Before, one pass held the lock across every request (4 x
        // 100 ms each time, 400 ms and more).
        let _alone = crate::backend::test_store::timing_alone();
        let mut state = crate::backend::test_store::local_state(1);
        let handles: Vec<u64> = (1..=4).map(|seed| crate::backend::test_store::prepare_store(&mut state, seed)).collect();
        let late = nvme_emu::FaultRule::every_nth_io(1, nvme_emu::FaultAction::Delay(Duration::from_millis(1500)));
        crate::backend::test_store::emulator(&state).set_faults(nvme_emu::FaultPlan::none().with_rule(late));
        for &handle in &handles {
            state.request(handle).unwrap().eventfd().expect("eventfd: armed for the thread");
            state.issue(handle, 0, 1, Direction::Store).expect("issue");
        }
        let shared = StoreShared::for_tests(state, crate::backend::test_store::geometry(), 1, Duration::from_secs(5));
        let weak = Arc::downgrade(&shared);
        let service = std::thread::spawn(move || run_service(weak, Duration::from_millis(100)));
        *shared.service.lock().unwrap() = Some(service);
        std::thread::sleep(Duration::from_millis(20)); // the thread is in its first pass
        let mut longest = Duration::ZERO;
        let sampled = Instant::now();
        while sampled.elapsed() < Duration::from_millis(800) {
            let asked = Instant::now();
            let state = shared.lock().expect("the store's lock");
            longest = longest.max(asked.elapsed());
            assert!(state.requests.values().all(|request| !request.in_flight.is_empty()), "a layer completed early");
            drop(state);
            std::thread::sleep(Duration::from_millis(1));
        }
        shared.stop_service();
        assert!(longest < Duration::from_millis(380), "a caller waited {longest:?} for the store's lock");
    }

    #[test]
    fn a_failed_hello_leaves_another_threads_connection_recorded() {
        // Goal: among the connections to tuttid found since attach's snapshot may be another
        // thread's (its own attach, recorded by it); a Hello that fails forgets only its own
        // connection's record, so a child forked later still closes its copy of the other
        // (else tuttid never sees that connection end while the child lives). Before, the
        // failure forgot every connection found, the other thread's too: the child kept it.
        use std::os::fd::AsRawFd;
        let directory = std::env::temp_dir().join(format!("tutti-failed-hello-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let socket = directory.join("failed-hello-tuttid.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
        let before = crate::process::open_fds();
        let other = std::os::unix::net::UnixStream::connect(&socket).expect("another thread's connection");
        crate::process::keep_from_forked_children(&[other.as_raw_fd()]);
        let (client, connections) = connect_recorded(&socket, Duration::from_secs(5), &before).expect("connect");
        assert_eq!(connections.len(), 2, "this connection and the other thread's: {connections:?}");
        assert!(connections.contains(&other.as_raw_fd()));
        close_failed_connection(client, &connections);
        let other_fd = other.as_raw_fd();
        let status = crate::ffi::fork_for_tests(|| i32::from(crate::ffi::fd_identity(other_fd).is_some()));
        assert_eq!(status, 0, "in the child: 1 = the other thread's connection stayed open (its record was forgotten)");
        assert!(crate::ffi::fd_identity(other_fd).is_some(), "the parent's connection is open");
        crate::process::forget_from_forked_children(&[other_fd]);
        drop(other);
        std::fs::remove_dir_all(&directory).unwrap();
    }

    /// A store attached to tuttid (no memory registered) whose connection is `client`.
    fn attached_for_tests(client: Client, timeout: Duration) -> Arc<StoreShared> {
        let state = crate::backend::test_store::attached_state(client, timeout);
        StoreShared::for_tests(state, crate::backend::test_store::geometry(), 1, timeout)
    }

    /// Polls (5 s at most) until one caller is counted as waiting for the store's lock.
    fn one_counted_waiting(shared: &StoreShared) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if shared.waiting_for_lock() == 1 {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    #[test]
    fn the_end_of_a_keepalive_loan_is_counted_while_it_waits_for_the_stores_lock() {
        // Goal: the end of the keep-alive ping's loan (`end_loan`) takes the store's lock
        // counted among the callers waiting for it, so a wait slicing meanwhile gives way to it
        // (`give_way`). This test holds the lock while the loan ends on another thread: it is
        // counted within 5 s. Before (358a832), it took the lock raw: never counted (seen
        // failing with `self.state.lock()` in its place).
        let shared = attached_for_tests(Client::detached("the store's own connection").unwrap(), Duration::from_secs(2));
        let mut held = shared.lock().unwrap();
        held.connection_lent = Some(0); // as the ping lends it
        let ender = Arc::clone(&shared);
        let ending = std::thread::spawn(move || ender.end_loan_for_tests(None));
        let counted = one_counted_waiting(&shared);
        drop(held);
        ending.join().expect("the loan's end");
        assert!(counted, "the loan's end waited for the store's lock uncounted");
        assert!(shared.lock().unwrap().connection_lent.is_none(), "the loan ended");
    }

    #[test]
    fn a_call_parked_for_the_lent_connection_is_counted_when_it_takes_the_lock_again() {
        // Goal: a call that talks to tuttid, parked while the keep-alive ping has the store's
        // connection (`lock_with_connection`), takes the store's lock again, once woken by the
        // connection's return, counted among the callers waiting for it. This test parks one
        // (100 ms for it to park), then, holding the lock, ends the loan and wakes it: it is
        // counted within 5 s. Before (358a832), it slept on a Condvar of the store's mutex,
        // which took the lock again inside std, uncounted (seen failing with a raw
        // `self.state.lock()` after the sleep).
        let shared = attached_for_tests(Client::detached("the store's own connection").unwrap(), Duration::from_secs(2));
        shared.lock().unwrap().connection_lent = Some(0); // as the ping lends it
        let caller = Arc::clone(&shared);
        let parked = std::thread::spawn(move || caller.locked(|_| ()));
        std::thread::sleep(Duration::from_millis(100)); // the call parked
        let mut held = shared.lock().unwrap();
        held.connection_lent = None; // as `end_loan` does, which wakes it after
        shared.connection_back.notify();
        let counted = one_counted_waiting(&shared);
        drop(held);
        let called = parked.join().expect("the parked call");
        assert!(counted, "the parked call took the store's lock again uncounted");
        assert_eq!(called, Ok(()));
    }

    #[test]
    fn the_completion_thread_is_counted_when_it_takes_the_lock_after_its_idle_sleep() {
        // Goal: the completion thread, woken from its idle sleep (`run_service`), takes the
        // store's lock again counted among the callers waiting for it, so a wait slicing
        // meanwhile gives way to it. Idle (nothing armed), it sleeps up to 500 ms; this test,
        // holding the lock, wakes it: it is counted within 5 s. Before (358a832), it slept on
        // a Condvar of the store's mutex, which took the lock again inside std, uncounted
        // (seen failing with a raw `state.lock()` after the sleep).
        let shared = attached_for_tests(Client::detached("the store's own connection").unwrap(), Duration::from_secs(2));
        let weak = Arc::downgrade(&shared);
        let service = std::thread::spawn(move || run_service(weak, Duration::from_millis(1)));
        *shared.service.lock().unwrap() = Some(service);
        std::thread::sleep(Duration::from_millis(100)); // in its idle sleep
        let held = shared.lock().unwrap();
        shared.wake();
        let counted = one_counted_waiting(&shared);
        drop(held);
        shared.stop_service();
        assert!(counted, "the completion thread took the store's lock again uncounted");
    }

    #[test]
    fn a_signal_given_after_the_count_was_seen_ends_the_sleep_at_once() {
        // Goal: `Signal::wait_past` sleeps until the count differs from the one the sleeper
        // saw under the store's lock, not from the one at the start of its sleep: a signal
        // given between the two (the store's lock let go, the sleep not begun) ends it at once,
        // not at its bound. Without a signal it sleeps its whole bound; a signal from another
        // thread during the sleep ends it. Seen failing with the count read again in
        // `wait_past` (the first sleep took its 5 s).
        let signal = Signal::new();
        let seen = signal.seen();
        signal.notify();
        let asked = Instant::now();
        signal.wait_past(seen, Duration::from_secs(5));
        assert!(asked.elapsed() < Duration::from_secs(1), "slept {:?} through a signal given before", asked.elapsed());
        let asked = Instant::now();
        signal.wait_past(signal.seen(), Duration::from_millis(200));
        assert!(asked.elapsed() >= Duration::from_millis(200), "woke after {:?} with no signal", asked.elapsed());
        let signal = Arc::new(signal);
        let seen = signal.seen();
        let signaller = Arc::clone(&signal);
        let signalling = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            signaller.notify();
        });
        let asked = Instant::now();
        signal.wait_past(seen, Duration::from_secs(5));
        signalling.join().unwrap();
        assert!(asked.elapsed() < Duration::from_secs(2), "slept {:?} through a signal given during the sleep", asked.elapsed());
    }

    #[test]
    fn a_keepalive_ping_that_panics_with_the_connection_does_not_leave_it_lent() {
        // Goal: the keep-alive ping has the store's connection without the lock; should it
        // panic meanwhile, the loan still ends (a guard's drop, on unwind too): the connection
        // is dropped (it may be half way through an exchange), the placeholder stays, and a
        // later call that talks to tuttid fails at once as Disconnected. Before, the unwind
        // dropped the connection and left it lent for good: every such call waited
        // timeout_s + 1 s and raised TimeoutError, close() too.
        let timeout = Duration::from_secs(2);
        let shared = attached_for_tests(Client::detached("the store's own connection").unwrap(), timeout);
        let pinger = Arc::clone(&shared);
        let panicked = std::thread::spawn(move || {
            let mut placeholder = None;
            pinger.keepalive_ping_with(Duration::ZERO, &mut placeholder, |_| panic!("a panic inside the keep-alive ping's loan"));
        })
        .join();
        assert!(panicked.is_err(), "the ping's exchange panicked");
        let asked = Instant::now();
        let later = shared.locked(|state| state.ping()).and_then(|pinged| pinged);
        assert!(asked.elapsed() < Duration::from_millis(500), "a later call waited {:?} for the connection", asked.elapsed());
        let failure = later.expect_err("the connection is gone");
        assert_eq!(failure.class, ErrorClass::Disconnected, "{}", failure.message);
        assert!(shared.lock().unwrap().connection_lent.is_none());
    }

    #[test]
    fn a_keepalive_ping_gives_the_store_its_own_connection_back() {
        // Goal: after the ping's exchange (answered or failed) the store has its own connection
        // again, not the placeholder, and the ping had the store's connection, not another.
        let shared = attached_for_tests(Client::detached("the store's own connection").unwrap(), Duration::from_secs(2));
        let mut placeholder = None;
        let mut seen = None;
        shared.keepalive_ping_with(Duration::ZERO, &mut placeholder, |connection| {
            seen = Some(connection.ping().map_err(Failure::from).expect_err("detached").message);
            Ok(())
        });
        assert!(seen.expect("the ping ran").contains("the store's own connection"));
        assert!(placeholder.is_some(), "the placeholder came back");
        let failure = shared.locked(|state| state.ping()).and_then(|pinged| pinged).expect_err("detached");
        assert!(failure.message.contains("the store's own connection"), "{}", failure.message);
    }

    #[test]
    fn the_keepalive_placeholder_is_out_of_step_and_made_without_the_file_system() {
        // Goal: what stands in for the store's connection while the keep-alive ping has it is
        // made without the file system or the environment (a socket pair: `Client::detached`),
        // so a TMPDIR that is long or read-only cannot make it fail, and the completion thread
        // never reads the environment while Python may write it; and it is out of step, so a
        // call that reaches it (the ping panicked with the connection) fails at once as
        // Disconnected. Before, it was a connection to a listener bound in a temporary
        // directory (std::env::temp_dir), in step.
        let mut placeholder = placeholder_client().expect("a placeholder");
        assert!(placeholder.is_broken(), "the placeholder is out of step from the start");
        let failure = Failure::from(placeholder.ping().expect_err("connected to no daemon"));
        assert_eq!(failure.class, ErrorClass::Disconnected, "{}", failure.message);
        assert_eq!(placeholder.requests_sent(), 0);
    }

    #[test]
    fn the_keepalive_interval_is_a_third_of_the_lease_and_never_under_its_minimum() {
        // Goal: tuttid's lease is untrusted: 0 or a few ms gives the 100 ms minimum (before,
        // lease / 3: a ping every 1 ms, each holding the store's lock), a long enough lease
        // gives its third, and the longest lease tuttid can send does not overflow.
        assert_eq!(keepalive_interval(Duration::ZERO), KEEPALIVE_INTERVAL_MIN);
        assert_eq!(keepalive_interval(Duration::from_millis(1)), KEEPALIVE_INTERVAL_MIN);
        assert_eq!(keepalive_interval(Duration::from_millis(299)), KEEPALIVE_INTERVAL_MIN);
        assert_eq!(keepalive_interval(Duration::from_millis(300)), Duration::from_millis(100));
        assert_eq!(keepalive_interval(Duration::from_secs(10)), Duration::from_secs(10) / 3);
        let longest = Duration::from_millis(u64::from(u32::MAX));
        assert_eq!(keepalive_interval(longest), longest / 3);
    }

    #[test]
    fn queue_options_outside_their_bounds_are_invalid_arguments() {
        // Goal: iocbs not a power of two in 2..=65536, queue_depth outside 2..=1024 and
        // requests_max outside 1..=65536 are refused before anything is opened; the bounds
        // themselves are accepted. Before, iocbs = 1 or 1 << 17 was accepted (allocate_kv then
        // failed and closed the store) and a huge requests_max aborted the process.
        for (queue_depth, iocbs, requests_max) in
            [(64, 1, 32), (64, 1 << 17, 32), (64, 1 << 28, 32), (64, 48, 32), (1, 64, 32), (1025, 64, 32), (64, 64, 0), (64, 64, 65537)]
        {
            let refused = check_queue_options(queue_depth, iocbs, requests_max).expect_err("refused");
            assert_eq!(refused.class, ErrorClass::InvalidArgument, "{queue_depth} {iocbs} {requests_max}");
        }
        for (queue_depth, iocbs, requests_max) in [(2, 2, 1), (1024, 65536, 65536), (64, 64, 32)] {
            assert_eq!(check_queue_options(queue_depth, iocbs, requests_max), Ok(()));
        }
    }

    #[test]
    fn a_timeout_past_the_clock_is_invalid_not_a_panic() {
        // Goal: a timeout from Python that no Instant can hold (wait(1e19)) is InvalidArgument,
        // as are negative, NaN and infinite ones; the longest accepted one makes a deadline.
        for seconds in [1e19, TIMEOUT_MAX_S * 2.0, -1.0, f64::NAN, f64::INFINITY] {
            let failure = duration_of(seconds, "timeout_s").expect_err("refused");
            assert_eq!(failure.class, ErrorClass::InvalidArgument, "{seconds}");
        }
        assert!(deadline_after(duration_of(TIMEOUT_MAX_S, "timeout_s").unwrap()).is_ok());
        assert_eq!(duration_of(0.5, "timeout_s"), Ok(Duration::from_millis(500)));
        assert_eq!(deadline_after(Duration::MAX).map_err(|failure| failure.class), Err(ErrorClass::InvalidArgument));
    }
}
