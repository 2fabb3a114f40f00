//! The server's own tests: configuration checks, and a daemon serving an in-memory software
//! controller in a thread of the test process (so a test can stop it, and reach test-only
//! hooks inside the connection threads). Every wait is bounded.

use std::sync::mpsc;
use std::thread;

use objstore::{FormatParams, KvRequest, LayerKvStore, ModelGeometry};
use tutti_devices::{DeviceKind, DeviceSpec};

use super::*;
use crate::client::{RemoteConfig, RemoteKvStore};
use crate::pool_open::{open_pool, PoolOptions};
use crate::protocol::Hello;
use crate::Client;

/// A client whose Ping makes its connection thread panic (`Connection::handle`, test builds
/// only): what a bug in a handler would do.
pub(super) const PANICS_ON_PING: &str = "panics-on-ping";
/// A client whose Ping panics (ending its connection while it may still ring its queues) and
/// whose wait for its exit then panics too.
pub(super) const PANICS_AWAITING_EXIT: &str = "panics-awaiting-exit";
/// A client whose Ping panics and whose connection's decision whether to wait for its exit
/// (`Connection::may_still_ring`) then panics too.
pub(super) const PANICS_DECIDING_TO_WAIT: &str = "panics-deciding-to-wait";
/// A client name whose session's retried deletion panics (`retry_retiring`).
pub(super) const PANICS_RETRYING: &str = "panics-retrying";
/// A client name whose `AttachQueues`, read and about to wait for the attach lock, is counted
/// in [`ATTACHES_READ`].
pub(super) const ATTACH_COUNTED: &str = "attach-counted";
/// `AttachQueues` read from sessions named [`ATTACH_COUNTED`], past the connection's stop check.
pub(super) static ATTACHES_READ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// A client name whose attach sees the daemon stop between its first device's stop check and
/// that device's creation ([`stop_within_an_attach`]).
pub(super) const STOPS_IN_ATTACH: &str = "stops-in-attach";
/// A client name whose session [`stop_within_an_attach`] watches.
const RELEASED_IN_ATTACH: &str = "released-in-attach";
/// Whether [`RELEASED_IN_ATTACH`]'s session was released (its queue ids freed) while an attach
/// was between its stop check and its creation.
static RELEASED_WITHIN_AN_ATTACH: AtomicBool = AtomicBool::new(false);

/// Stops the daemon from within an attach, past its stop check, and gives the drain a second
/// to release [`RELEASED_IN_ATTACH`]'s session (its connection sees the stop within a tick).
pub(super) fn stop_within_an_attach(shared: &Shared) {
    shared.stop.stop();
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline {
        if !lock(&shared.sessions).values().any(|record| record.name == RELEASED_IN_ATTACH) {
            RELEASED_WITHIN_AN_ATTACH.store(true, Ordering::SeqCst);
            return;
        }
        thread::sleep(Duration::from_millis(5));
    }
}

/// The longest any wait here takes before the test fails.
const WAIT: Duration = Duration::from_secs(10);

/// A daemon serving in a thread: its socket, its stop handle, and a channel that says when
/// `serve` returned (and how).
struct InProcess {
    socket: PathBuf,
    stop: StopHandle,
    served: mpsc::Receiver<Result<ServeReport, String>>,
    thread: Option<JoinHandle<()>>,
    _directory: tempfile::TempDir,
}

impl InProcess {
    /// `relay`: the software controller withholds its register page, so clients' doorbells go
    /// through the daemon's relay (as on a VFIO device).
    fn start(clients_max: usize, relay: bool) -> InProcess {
        let directory = tempfile::tempdir().unwrap();
        let opened = pool(directory.path(), relay);
        let socket = directory.path().join("tuttid.sock");
        let mut config = ServerConfig::new(socket.clone());
        config.clients_max = clients_max;
        let server = Server::bind(config, opened).expect("bind");
        let stop = server.stop_handle();
        let (sender, served) = mpsc::channel();
        let thread = thread::spawn(move || {
            let outcome = server.serve().map_err(|error| error.to_string());
            let _ = sender.send(outcome);
        });
        InProcess { socket, stop, served, thread: Some(thread), _directory: directory }
    }

    /// As [`InProcess::start`] (4 clients, shared register page), the controller's admin
    /// timeout `admin_timeout` (a late admin completion's tests); with its software controller.
    fn start_with_admin_timeout(admin_timeout: Duration) -> (InProcess, Arc<nvme_emu::EmuDevice>) {
        InProcess::start_configured(admin_timeout, |_| {})
    }

    /// [`InProcess::start_with_admin_timeout`], its configuration then changed by `configure`.
    fn start_configured(admin_timeout: Duration, configure: impl FnOnce(&mut ServerConfig)) -> (InProcess, Arc<nvme_emu::EmuDevice>) {
        let (daemon, mut emulators) = InProcess::start_on_devices(1, admin_timeout, configure);
        (daemon, emulators.remove(0))
    }

    /// [`InProcess::start_configured`] on a pool of `devices` software controllers; with them,
    /// in pool order.
    fn start_on_devices(
        devices: usize,
        admin_timeout: Duration,
        configure: impl FnOnce(&mut ServerConfig),
    ) -> (InProcess, Vec<Arc<nvme_emu::EmuDevice>>) {
        InProcess::start_on_pool(devices, None, false, admin_timeout, configure)
    }

    /// [`InProcess::start_on_devices`], the pool formatted with at most `slots` one-block slots
    /// (`relay`: the controllers withhold their register pages, as in [`InProcess::start`]).
    fn start_on_pool(
        devices: usize,
        slots: Option<u64>,
        relay: bool,
        admin_timeout: Duration,
        configure: impl FnOnce(&mut ServerConfig),
    ) -> (InProcess, Vec<Arc<nvme_emu::EmuDevice>>) {
        let directory = tempfile::tempdir().unwrap();
        crate::pool_open::TEST_ADMIN_TIMEOUT.with(|cell| cell.set(Some(admin_timeout)));
        let opened = pool_of(directory.path(), relay, 4, devices, slots);
        crate::pool_open::TEST_ADMIN_TIMEOUT.with(|cell| cell.set(None));
        let emulators = opened.emulators.iter().map(|emulator| emulator.clone().unwrap()).collect();
        let socket = directory.path().join("tuttid.sock");
        let mut config = ServerConfig::new(socket.clone());
        config.clients_max = 4;
        configure(&mut config);
        let server = Server::bind(config, opened).expect("bind");
        let stop = server.stop_handle();
        let (sender, served) = mpsc::channel();
        let thread = thread::spawn(move || {
            let outcome = server.serve().map_err(|error| error.to_string());
            let _ = sender.send(outcome);
        });
        (InProcess { socket, stop, served, thread: Some(thread), _directory: directory }, emulators)
    }

    fn client(&self) -> Client {
        Client::connect(&self.socket, Duration::from_secs(5)).expect("connect")
    }

    /// The daemon's status once `done` holds of it, asked every 20 ms until `WAIT`; past that
    /// the test fails with `what` and the last status.
    fn status_once(&self, what: &str, done: impl Fn(&crate::protocol::StatusReply) -> bool) -> crate::protocol::StatusReply {
        let deadline = Instant::now() + WAIT;
        loop {
            let status = self.client().status().unwrap();
            if done(&status) {
                return status;
            }
            assert!(Instant::now() < deadline, "{what}: {status:?}");
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the daemon; how long `serve` took to return after that (`None`: not within `WAIT`).
    fn stop(&mut self) -> Option<Duration> {
        self.stop_with_report().map(|(took, _)| took)
    }

    /// [`InProcess::stop`], with what `serve` handed back (the pool among it).
    fn stop_with_report(&mut self) -> Option<(Duration, ServeReport)> {
        let stopping = Instant::now();
        self.stop.stop();
        let returned = self.served.recv_timeout(WAIT).ok().map(|outcome| {
            let report = outcome.expect("serve ended with an error");
            (stopping.elapsed(), report)
        });
        if returned.is_some() {
            if let Some(thread) = self.thread.take() {
                thread.join().unwrap();
            }
        }
        returned
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        // A test that failed before stopping: the daemon thread is left to the process's end.
        self.stop.stop();
    }
}

/// A fresh pool on an in-memory software controller (`relay`: its register page withheld).
fn pool(directory: &std::path::Path, relay: bool) -> crate::pool_open::OpenedPool {
    pool_with_clients(directory, relay, 4)
}

/// [`pool`], its controller made for `client_queue_pairs` clients.
fn pool_with_clients(directory: &std::path::Path, relay: bool, client_queue_pairs: u16) -> crate::pool_open::OpenedPool {
    pool_of(directory, relay, client_queue_pairs, 1, None)
}

/// [`pool_with_clients`] on `devices` software controllers, with at most `slot_count_max` slots.
fn pool_of(
    directory: &std::path::Path,
    relay: bool,
    client_queue_pairs: u16,
    devices: usize,
    slot_count_max: Option<u64>,
) -> crate::pool_open::OpenedPool {
    let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
    let options = PoolOptions {
        specs: vec![DeviceSpec::parse("emu:mem:64m", &DeviceKind::ALL).unwrap(); devices],
        namespace: 1,
        emu_lba_bytes: 4096,
        emu_create_bytes: None,
        format: Some(FormatParams { slot_count_max, ..FormatParams::new(geometry) }),
        overwrite: false,
        lock_dir: directory.join("locks"),
        client_queue_pairs,
        emu_doorbell_relay: relay,
    };
    open_pool(&options).expect("open the pool")
}

fn hello(name: &str) -> Hello {
    Hello { model_fingerprint: [0x5a; 32], tp_rank: 0, tp_world: 1, client_name: name.into() }
}

#[test]
fn a_client_pinging_without_pause_does_not_hold_off_stopping() {
    // Goal: docs/tuttid.md "Shutdown": each connection finishes the request it serves and
    // answers ShuttingDown. A client that sends its next request as soon as it has the answer
    // (well within the 50 ms tick, so a read never times out) must not keep its connection
    // served, and `serve` joining it, after the stop: serve returns within about two seconds
    // and the client sees ShuttingDown or the close.
    let mut daemon = InProcess::start(4, false);
    let mut client = daemon.client();
    client.hello(&hello("pinger")).unwrap();
    let pinging = Arc::new(AtomicBool::new(true));
    let pinger = {
        let pinging = Arc::clone(&pinging);
        thread::spawn(move || {
            let mut pings = 0u64;
            // Bounded: the test clears `pinging` whatever happens.
            while pinging.load(Ordering::Acquire) {
                match client.ping() {
                    Ok(()) => pings += 1,
                    Err(error) => return (pings, Some(error)),
                }
            }
            (pings, None)
        })
    };
    thread::sleep(Duration::from_millis(300));
    let took = daemon.stop();
    pinging.store(false, Ordering::Release);
    let (pings, ended) = pinger.join().unwrap();
    // A daemon held off by the pings returns once they end: not what is measured.
    if took.is_none() {
        daemon.stop();
    }
    assert!(pings > 10, "the client pinged only {pings} times");
    let took = took.expect("serve did not return while the client pinged");
    assert!(took < Duration::from_secs(2), "serve returned {took:?} after the stop");
    match ended {
        Some(DaemonError::Remote { code: ErrorCode::ShuttingDown, .. } | DaemonError::Closed | DaemonError::Truncated { .. }) => {}
        Some(DaemonError::Io { .. }) => {}
        other => panic!("the client's pings ended with {other:?}"),
    }
}

#[test]
fn a_flood_of_connections_does_not_hold_off_stopping() {
    // Goal: the accept loop must see the stop flag even while local users keep the socket's
    // accept queue full. With the one client connection and the status-only one taken, every
    // further connection is refused (Busy, written there and then); flooders connect without
    // pause; after the stop, serve returns within a few seconds (it used to accept and refuse
    // until the queue ran dry, which a flood need never let happen).
    let mut daemon = InProcess::start(1, false);
    let _held = daemon.client();
    let _status_only = daemon.client();
    let flooding = Arc::new(AtomicBool::new(true));
    let flooders: Vec<_> = (0..6)
        .map(|_| {
            let flooding = Arc::clone(&flooding);
            let socket = daemon.socket.clone();
            thread::spawn(move || {
                while flooding.load(Ordering::Acquire) {
                    // Bounded: Client::connect waits at most its timeout for the connect.
                    let _ = Client::connect(&socket, Duration::from_millis(200));
                }
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(300));
    let took = daemon.stop();
    flooding.store(false, Ordering::Release);
    for flooder in flooders {
        flooder.join().unwrap();
    }
    if took.is_none() {
        daemon.stop();
    }
    let took = took.expect("serve did not return during the flood");
    assert!(took < Duration::from_secs(3), "serve returned {took:?} after the stop");
}

#[test]
fn a_connection_thread_that_panics_still_releases_its_session() {
    // Goal: a panic inside a request's handling (a bug) must not skip the session's release:
    // the relay stops forwarding the client's doorbells (its queue ids would otherwise reach
    // the next client's queues), its queue pairs are deleted, its reservations and window given
    // back, its record removed and the connection uncounted, as on any other way out. The hook
    // (`PANICS_ON_PING`) panics in `Connection::handle` for this client's Ping.
    let mut daemon = InProcess::start(4, true);
    let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
    let mut store = RemoteKvStore::connect(&daemon.socket, &hello(PANICS_ON_PING), &config).expect("attach");
    let tokens: Vec<u32> = (0..64).collect();
    let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1, 2, 3] }).expect("prepare_store");
    assert_eq!(plan.new_blocks, 4);
    let held = daemon.client().status().unwrap();
    assert_eq!((held.clients.len(), held.relay.queues), (1, 1), "{held:?}");
    assert!(held.pool.writing_slots > 0, "{:?}", held.pool);
    let answered = store.client().ping();
    assert!(answered.is_err(), "the panicking connection answered {answered:?}");
    // The status query's own connection is the one counted.
    let released = daemon.status_once("the panicked session was not released", |status| {
        status.clients.is_empty() && status.relay.queues == 0 && status.connections == 1
    });
    assert_eq!((released.leaked_queue_pairs, released.pool.writing_slots), (0, 0), "{released:?}");
    drop(store);
    // The freed queue pair serves the next client.
    let mut next = RemoteKvStore::connect(&daemon.socket, &hello("next"), &config).expect("attach after the panic");
    next.client().ping().unwrap();
    drop(next);
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn a_panic_while_awaiting_a_clients_exit_keeps_its_session_instead_of_releasing_it() {
    // Goal: a session whose client may still ring its queues (shared register page, the client
    // process alive, the connection ended by a handler's panic) is kept until the client exits;
    // a second panic in that wait must not release it on the unwinding (its queue ids would go
    // to the next client while this one may still write their doorbells): the queue pairs,
    // window and reservations are kept for good and counted as leaks, the record kept too
    // (listed for good, marked kept: its client must never free that memory) and the
    // connection uncounted. The hooks panic on Ping and in `await_peer_exit`.
    let mut daemon = InProcess::start(4, false);
    let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
    let mut store = RemoteKvStore::connect(&daemon.socket, &hello(PANICS_AWAITING_EXIT), &config).expect("attach");
    let tokens: Vec<u32> = (0..64).collect();
    store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1, 2, 3] }).expect("prepare_store");
    assert!(store.client().ping().is_err(), "the panicking connection answered");
    let ended = daemon.status_once("the session did not end", |status| {
        status.clients.len() == 1 && status.clients[0].kept && !status.clients[0].awaiting_exit && status.connections == 1
    });
    assert!(ended.leaked_queue_pairs >= 1, "the session's queue pairs were released, not kept: {ended:?}");
    assert!(ended.pool.writing_slots > 0, "the session's reservation was released, not kept: {:?}", ended.pool);
    // Its memory is the daemon's for good now.
    std::mem::forget(store);
    // The daemon serves on.
    let mut next = RemoteKvStore::connect(&daemon.socket, &hello("next"), &config).expect("attach after the panics");
    next.client().ping().unwrap();
    drop(next);
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn a_panic_on_the_way_out_of_a_session_without_queue_pairs_keeps_its_reservations_counted() {
    // Goal: a panic after the handler's (here in deciding whether to wait for the client's
    // exit) keeps everything the session holds, its reservations included (never released).
    // A session without queue pairs (registered and prepared, never attached) keeps no pair,
    // yet its reservations are held all the same: its record must stay, kept for good with
    // them, or the table would be short of them with nothing counting them (a later session's
    // first registration admitted, then its prepares refused). Raw requests: the library
    // always attaches.
    let mut daemon = InProcess::start(4, false);
    let mut client = daemon.client();
    let session = client.hello(&hello(PANICS_DECIDING_TO_WAIT)).expect("Hello").session;
    let memory = nvme_driver::hw::SharedMemory::create("panic-test", 1 << 20).unwrap();
    let register = crate::protocol::Request::RegisterMemory(crate::protocol::RegisterMemory { window_bytes: 1 << 20, kv_blocks: 4 });
    let registration = match client.call_with_fds(&register, &[memory.fd()]).expect("RegisterMemory") {
        (crate::protocol::Reply::Registered(registered), _) => registered.registration,
        (other, _) => panic!("RegisterMemory: {other:?}"),
    };
    let prepare = crate::protocol::Prepare { registration, tokens: (0..64).collect(), block_ids: vec![0, 1, 2, 3], first_block: 0 };
    match client.call(&crate::protocol::Request::PrepareStore(prepare)).expect("PrepareStore") {
        crate::protocol::Reply::StorePrepared(_) => {}
        other => panic!("PrepareStore: {other:?}"),
    }
    assert!(client.ping().is_err(), "the panicking connection answered");
    let ended = daemon.status_once("the session's connection did not end", |status| status.connections == 1);
    let record = ended.clients.iter().find(|client| client.session == session);
    assert!(
        record.is_some_and(|record| record.kept && record.requests_in_flight == 1),
        "the session holding a reservation was not kept with it: {ended:?}"
    );
    assert!(ended.pool.writing_slots > 0, "the reservation was released: {:?}", ended.pool);
    drop(client);
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn clients_max_is_capped_at_what_a_status_reply_can_list() {
    // Goal: `tuttid --status` must work when the daemon is at its busiest, so
    // `clients_max` is refused past the sessions one status reply's body can hold (it used
    // to take up to 65532, while a reply of ~7,700 sessions is over the body cap).
    let mut config = ServerConfig::new("/nonexistent/tuttid.sock".into());
    config.clients_max = 65_532;
    assert!(matches!(config.validate(), Err(DaemonError::Config(_))), "65532 clients accepted");
    config.clients_max = ServerConfig::CLIENTS_MAX + 1;
    match config.validate() {
        Err(DaemonError::Config(message)) => assert!(message.contains(&ServerConfig::CLIENTS_MAX.to_string()), "{message}"),
        other => panic!("one past the cap: {other:?}"),
    }
    config.clients_max = ServerConfig::CLIENTS_MAX;
    config.validate().expect("the cap itself");
    assert_eq!(ServerConfig::CLIENTS_MAX, 7173, "tuttid --help and docs/tuttid.md give the number");
}

#[test]
fn requests_per_session_is_capped_before_the_pool_is_opened() {
    // Goal: `bind_prepared` allocates every session's requests at once (clients_max ×
    // requests_max reservations); a count past what the daemon can hold is refused by
    // `validate` (before the pool is opened or formatted), not an allocation that aborts the
    // process after a format. 20,000,000 per session used to be accepted.
    let mut config = ServerConfig::new("/nonexistent/tuttid.sock".into());
    config.session_limits.requests_max = 20_000_000;
    match config.validate() {
        Err(DaemonError::Config(message)) => {
            assert!(message.contains(&ServerConfig::REQUESTS_PER_SESSION_MAX.to_string()), "{message}")
        }
        other => panic!("20,000,000 requests per session: {other:?}"),
    }
    config.session_limits.requests_max = ServerConfig::REQUESTS_PER_SESSION_MAX + 1;
    assert!(matches!(config.validate(), Err(DaemonError::Config(_))), "one past the cap accepted");
    config.session_limits.requests_max = 0;
    assert!(matches!(config.validate(), Err(DaemonError::Config(_))), "0 requests per session accepted");
    config.session_limits.requests_max = ServerConfig::REQUESTS_PER_SESSION_MAX;
    config.validate().expect("the cap itself, at 64 clients");
    // The product is capped too: the cap per session at the most clients is refused, the
    // default per session at the most clients is not.
    config.clients_max = ServerConfig::CLIENTS_MAX;
    match config.validate() {
        Err(DaemonError::Config(message)) => assert!(message.contains(&ServerConfig::REQUESTS_MAX.to_string()), "{message}"),
        other => panic!("{} clients × {} requests: {other:?}", ServerConfig::CLIENTS_MAX, ServerConfig::REQUESTS_PER_SESSION_MAX),
    }
    config.session_limits.requests_max = SessionLimits::default().requests_max;
    config.validate().expect("the default per session at the most clients");
    assert_eq!(ServerConfig::REQUESTS_PER_SESSION_MAX, 4096, "tuttid --help and docs/tuttid.md give the number");
    assert_eq!(ServerConfig::REQUESTS_MAX, 1 << 20, "tuttid --help and docs/tuttid.md give the number");
}

/// Set in the process [`in_a_child`] runs a test in.
const CHILD: &str = "TUTTI_SERVER_TEST_CHILD";

/// Runs the test `name` (its path in this binary) again in a child process of this test binary,
/// where it may change what is the whole process's (its descriptor limits), and fails unless the
/// child passes within `WAIT`. Returns whether this is the child (then the test's body runs).
fn in_a_child(name: &str) -> bool {
    if std::env::var_os(CHILD).is_some() {
        return true;
    }
    // One open file for both, so that they share its offset (and interleave, not overwrite).
    let output = tempfile::NamedTempFile::new().unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--test-threads", "1", "--nocapture"])
        .env(CHILD, "1")
        .stdout(output.as_file().try_clone().unwrap())
        .stderr(output.as_file().try_clone().unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(output.path()).unwrap_or_default();
    assert!(status.is_some_and(|status| status.success()) && text.contains("1 passed"), "{name} in a child ({status:?}):\n{text}");
    false
}

/// Descriptors this process has open now.
fn open_descriptors() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

#[test]
fn a_clients_max_past_the_descriptor_limit_is_refused_before_the_pool_is_opened() {
    // Goal: every session holds descriptors (its socket, its windows' memfds, relay pages, a
    // frame's descriptors being read), and past the process's limit accepts fail (EMFILE) and
    // attaches and registrations fail at random. So the start raises the soft limit to the
    // hard one (1024 soft is common) and refuses a `clients_max` whose worst case would not
    // fit, before the pool is opened. In a child process: the limits are the process's.
    if !in_a_child("server::tests::a_clients_max_past_the_descriptor_limit_is_refused_before_the_pool_is_opened") {
        return;
    }
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let base = open_descriptors();
    setrlimit(Resource::RLIMIT_NOFILE, base + 200, base + 400).unwrap();
    let directory = tempfile::tempdir().unwrap();
    let mut config = ServerConfig::new(directory.path().join("tuttid.sock"));
    // Ten clients need more than 200 descriptors at worst, fewer than 400.
    config.clients_max = 10;
    match Server::prepare(&config) {
        // All ten, not lowered to what fits (that would also answer Ok).
        Ok(prepared) => assert_eq!(prepared.clients_max, 10, "10 clients fit under the raised limit"),
        Err(error) => panic!("10 clients, the hard limit {} descriptors over what is open: {error}", 400),
    }
    assert_eq!(getrlimit(Resource::RLIMIT_NOFILE).unwrap(), (base + 400, base + 400), "the soft limit was not raised to the hard one");
    // Chosen (tuttid's --clients-max): refused, not lowered.
    config.clients_max = 100;
    config.clients_max_explicit = true;
    match Server::prepare(&config) {
        Err(DaemonError::Config(message)) => assert!(message.contains("descriptors") && message.contains("100"), "{message}"),
        Err(error) => panic!("100 clients on {} descriptors: {error}", base + 400),
        Ok(_) => panic!("100 clients on a limit of {} descriptors (base {base}) accepted", base + 400),
    }
    // Not even one client fits: refused though not chosen.
    config.clients_max_explicit = false;
    setrlimit(Resource::RLIMIT_NOFILE, base + 40, base + 40).unwrap();
    match Server::prepare(&config) {
        Err(DaemonError::Config(message)) => assert!(message.contains("not even one client"), "{message}"),
        Err(error) => panic!("100 clients on {} descriptors: {error}", base + 40),
        Ok(prepared) => panic!("{} clients on {} descriptors accepted", prepared.clients_max, base + 40),
    }
}

#[test]
fn a_default_clients_max_past_a_1024_descriptor_limit_is_lowered_to_what_fits() {
    // Goal: the default of 64 clients needs 1173 descriptors at worst, more than a hard limit
    // of 1024 (`ulimit -n 1024`, systemd's LimitNOFILE=1024, docker), where the daemon used to
    // start and serve a few engines. Not chosen, it is lowered to what fits (more connections
    // are answered Busy); chosen, it is refused. In a child process: the limits are the
    // process's.
    if !in_a_child("server::tests::a_default_clients_max_past_a_1024_descriptor_limit_is_lowered_to_what_fits") {
        return;
    }
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let limit = getrlimit(Resource::RLIMIT_NOFILE).unwrap().1.min(1024);
    setrlimit(Resource::RLIMIT_NOFILE, limit, limit).unwrap();
    let directory = tempfile::tempdir().unwrap();
    let mut config = ServerConfig::new(directory.path().join("tuttid.sock"));
    assert!(config.descriptors_needed(1) > limit, "the defaults fit in {limit} descriptors: nothing to lower");
    let prepared = match Server::prepare(&config) {
        Ok(prepared) => prepared,
        Err(error) => panic!("the defaults refused on a limit of {limit} descriptors: {error}"),
    };
    let open = open_descriptors();
    let serving = prepared.clients_max;
    assert!((1..config.clients_max).contains(&serving), "serving {serving} clients of {}", config.clients_max);
    // The most that fit (the count read here opens one more than the server's did: a margin of 2).
    assert!(open + config.descriptors_needed_for(serving, 1) <= limit + 1, "{serving} clients do not fit in {limit} ({open} open)");
    assert!(open + config.descriptors_needed_for(serving + 1, 1) > limit + 1, "{} clients fit in {limit} too", serving + 1);
    drop(prepared);
    config.clients_max_explicit = true;
    match Server::prepare(&config) {
        Err(DaemonError::Config(message)) => assert!(message.contains("descriptors") && message.contains("64"), "{message}"),
        Err(error) => panic!("64 clients chosen on {limit} descriptors: {error}"),
        Ok(prepared) => panic!("64 clients chosen on {limit} descriptors accepted ({} served)", prepared.clients_max),
    }
}

#[test]
fn bind_lowers_clients_max_to_what_fits_on_the_pools_devices() {
    // Goal: `Server::bind` (the library's start, `pool_devices` not given) counts the opened
    // pool's devices (a relay page and a reply copy each per connection), not one, and serves
    // only the clients that fit: the rest are answered Busy. In a child process: the limits
    // are the process's.
    if !in_a_child("server::tests::bind_lowers_clients_max_to_what_fits_on_the_pools_devices") {
        return;
    }
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let directory = tempfile::tempdir().unwrap();
    let opened = pool_of(directory.path(), false, 4, 2, None);
    let config = ServerConfig::new(directory.path().join("tuttid.sock"));
    // Room for 10 clients on 2 devices (and a little, less than one more client's): on 1
    // device, 11 would fit.
    let limit = open_descriptors() + config.descriptors_needed_for(10, 2) + 5;
    assert!(config.descriptors_needed_for(11, 1) + 5 <= config.descriptors_needed_for(10, 2) + 5, "the test cannot tell 1 device from 2");
    assert!(limit <= getrlimit(Resource::RLIMIT_NOFILE).unwrap().1, "the hard limit is under {limit}");
    setrlimit(Resource::RLIMIT_NOFILE, limit, limit).unwrap();
    let server = Server::bind(config, opened).expect("bind");
    assert_eq!(server.shared.config.clients_max, 10, "clients served on 2 devices under a limit of {limit}");
}

/// Cluster settings whose manifest is at `manifest` (etcd on port 9, never reached).
fn cluster_at(manifest: PathBuf) -> ClusterSettings {
    let cluster = tutti_cluster::ClusterId::new("refused").unwrap();
    let registry =
        tutti_cluster::ClusterConfig::new(vec!["http://127.0.0.1:9".into()], cluster, tutti_cluster::SegmentBlocks::new(32).unwrap());
    let node = tutti_cluster::NodeId::new("node").unwrap();
    ClusterSettings::new(registry, node, "127.0.0.1:0".parse().unwrap(), manifest)
}

#[test]
fn a_cluster_manifest_at_a_pool_devices_file_is_refused() {
    // Goal: `--cluster-state` naming a pool device's file (the manifest, its PATH.new or its
    // PATH.lock), by any spelling, is refused by the configuration's check, before anything is
    // opened, whether or not the file is there yet: the manifest's rewrite renames a file over
    // its path, so the pool would run on an unlinked inode. A path of its own is accepted.
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("pool.img");
    let refused = |manifest: PathBuf, device: DeviceSpec, what: &str| {
        let mut config = ServerConfig::new("/nonexistent/tuttid.sock".into());
        config.cluster = Some(cluster_at(manifest));
        config.pool_devices = vec![DeviceSpec::EmuMemory(1 << 20), device];
        match config.validate() {
            Err(DaemonError::Config(message)) => assert!(message.contains("--cluster-state"), "{what}: {message}"),
            other => panic!("{what}: {other:?}"),
        }
    };
    // Not made yet: by directory and name.
    refused(image.clone(), DeviceSpec::EmuFile(image.clone()), "the image itself, missing");
    refused(directory.path().join(".").join("pool.img"), DeviceSpec::Uring(image.clone()), "another spelling, missing");
    refused(directory.path().join("pool"), DeviceSpec::EmuFile(directory.path().join("pool.new")), "PATH.new");
    refused(directory.path().join("pool"), DeviceSpec::EmuFile(directory.path().join("pool.lock")), "PATH.lock");
    // There: by device and inode.
    std::fs::write(&image, b"").unwrap();
    let link = directory.path().join("link.img");
    std::os::unix::fs::symlink(&image, &link).unwrap();
    refused(image.clone(), DeviceSpec::EmuFile(link.clone()), "the image through a symbolic link");
    let hard = directory.path().join("hard.img");
    std::fs::hard_link(&image, &hard).unwrap();
    refused(hard, DeviceSpec::EmuFile(image.clone()), "a hard link of the image");
    let mut config = ServerConfig::new("/nonexistent/tuttid.sock".into());
    config.cluster = Some(cluster_at(directory.path().join("segments")));
    config.pool_devices = vec![DeviceSpec::EmuFile(image), DeviceSpec::Uring(link)];
    config.validate().expect("a manifest of its own");
}

#[test]
fn bind_replaces_a_socket_nobody_listens_on() {
    // Goal: a socket file left by a dead daemon (connections refused) is removed and bound again;
    // only a refusal counts as nobody listening (other probe failures leave the file alone).
    let directory = tempfile::tempdir().unwrap();
    let socket = directory.path().join("tuttid.sock");
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(socket.exists(), "the dead listener's file stays");
    let server = Server::bind(ServerConfig::new(socket.clone()), pool(directory.path(), false)).expect("bind over a stale socket");
    std::os::unix::net::UnixStream::connect(&socket).expect("the new listener answers");
    drop(server);
}

#[test]
fn bind_refuses_a_socket_whose_daemon_does_not_accept_without_waiting_on_it() {
    // Goal: `Server::bind` asks whether a daemon serves the socket already; one that is stopped
    // (SIGSTOP) with its backlog full would hold a plain connect for as long as it is stopped.
    // The probe is bounded, and a listener that does not take connections is a live daemon's
    // (SocketInUse), not a stale file to remove.
    let directory = tempfile::tempdir().unwrap();
    let socket = directory.path().join("tuttid.sock");
    let (_listener, _queued) = crate::client::tests::full_listener(&socket);
    let opened = pool(directory.path(), false);
    let (sender, bound) = mpsc::channel();
    let started = Instant::now();
    let config = ServerConfig::new(socket.clone());
    // In a thread: a probe without a bound would otherwise hang the test.
    thread::spawn(move || {
        let _ = sender.send(Server::bind(config, opened).map(|_| ()).map_err(|error| error.to_string()));
    });
    let outcome = bound.recv_timeout(Duration::from_secs(5));
    let took = started.elapsed();
    match outcome {
        Ok(Err(message)) if message.contains("served by a live daemon") => {
            assert!(took < Duration::from_secs(3), "refused after {took:?}")
        }
        other => panic!("bind over a listener that does not accept: {other:?} after {took:?}"),
    }
    assert!(socket.exists(), "the live daemon's socket was removed");
}

#[test]
fn a_session_whose_queue_pair_deletion_completes_late_is_released_once_it_does() {
    // Goal: a client's session ends while the controller answers its Delete I/O SQ only after
    // four admin timeouts (50 ms here). The session is not kept for good: it stays listed,
    // marked retiring, while the retiring thread's tick retries the deletion, and leaves
    // status, everything given back and nothing counted as leaked, once the late completion
    // confirms it.
    let admin_timeout = Duration::from_millis(50);
    let (mut daemon, emulator) = InProcess::start_with_admin_timeout(admin_timeout);
    let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
    let store = RemoteKvStore::connect(&daemon.socket, &hello("late-delete"), &config).expect("attach");
    let session = store.hello_reply().session;
    let late = nvme_emu::FaultAction::Delay(4 * admin_timeout);
    fault_the_next_sq_deletion(&emulator, late);
    let ended = Instant::now();
    drop(store);
    daemon.status_once("the session was not listed retiring", |status| {
        status.clients.iter().any(|client| client.session == session && client.retiring && !client.kept && !client.awaiting_exit)
    });
    let gone = daemon.status_once("the session was not released", |status| status.clients.iter().all(|client| client.session != session));
    assert!(ended.elapsed() >= 2 * admin_timeout, "left status before the late completion: {:?}", ended.elapsed());
    assert_eq!(emulator.stats().faults_injected, 1, "the Delete I/O SQ was answered late");
    let leaks = (gone.leaked_queue_pairs, gone.leaked_windows, gone.leaked_requests);
    assert_eq!(leaks, (0, 0, 0), "{gone:?}");
    // Its queue id is free: four more sessions (clients_max) attach.
    let others: Vec<RemoteKvStore> =
        (0..4).map(|i| RemoteKvStore::connect(&daemon.socket, &hello(&format!("next-{i}")), &config).expect("attach")).collect();
    drop(others);
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn a_retry_that_panics_keeps_its_session_for_good_and_later_sessions_are_still_retried() {
    // Goal: a panic while retrying one ended session's deletion (a hook here) keeps that
    // session for good (listed kept, its pairs counted as leaked) and does not end the retiring
    // thread: a session ending later with a late deletion is still retried and released.
    let admin_timeout = Duration::from_millis(50);
    let (mut daemon, emulator) = InProcess::start_with_admin_timeout(admin_timeout);
    let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
    let late_delete = || {
        let late = nvme_emu::FaultAction::Delay(4 * admin_timeout);
        fault_the_next_sq_deletion(&emulator, late);
    };
    let store = RemoteKvStore::connect(&daemon.socket, &hello(PANICS_RETRYING), &config).expect("attach");
    let panicking = store.hello_reply().session;
    late_delete();
    drop(store);
    let kept = daemon.status_once("the session whose retry panicked was not kept", |status| {
        status.clients.iter().any(|client| client.session == panicking && client.kept && !client.retiring)
    });
    assert_eq!(kept.leaked_queue_pairs, 1, "{kept:?}");
    // The kept session's late Delete I/O SQ may still be outstanding (the admin queue refuses
    // the next creation as busy until its completion comes): attach again until it has.
    let deadline = Instant::now() + WAIT;
    let store = loop {
        match RemoteKvStore::connect(&daemon.socket, &hello("late-after-a-panic"), &config) {
            Ok(store) => break store,
            Err(error) => assert!(Instant::now() < deadline, "attach: {error}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let later = store.hello_reply().session;
    late_delete();
    drop(store);
    daemon.status_once("the later session was not released", |status| status.clients.iter().all(|client| client.session != later));
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn status_answers_while_a_retiring_sessions_deletion_waits_out_an_admin_timeout() {
    // Goal: retrying an ended session's deletions may wait out admin timeouts (a retry's Delete
    // I/O CQ times out here, 600 ms); that wait must not hold off the accept loop: a fresh
    // connection's status query is answered well within an admin timeout throughout. The first
    // Delete I/O SQ completes 4 admin timeouts late (the session retiring), the retry's Delete
    // I/O CQ 2 late. (600 ms, not less: on a loaded 2-core machine one status query took 171 ms
    // against a limit of 150 with 200 ms.)
    let admin_timeout = Duration::from_millis(600);
    let (mut daemon, emulator) = InProcess::start_with_admin_timeout(admin_timeout);
    let store = attach(&daemon, "slow-delete");
    let session = store.hello_reply().session;
    let delete_sq = nvme_driver::spec::AdminOpcode::DeleteIoSubmissionQueue;
    let delete_cq = nvme_driver::spec::AdminOpcode::DeleteIoCompletionQueue;
    let late_sq = nvme_emu::FaultRule::on_nth_admin(1, delete_sq, nvme_emu::FaultAction::Delay(4 * admin_timeout));
    let late_cq = nvme_emu::FaultRule::on_nth_admin(1, delete_cq, nvme_emu::FaultAction::Delay(2 * admin_timeout));
    emulator.set_faults(nvme_emu::FaultPlan::none().with_rule(late_sq).with_rule(late_cq));
    drop(store);
    // Asked without pause (each on a new connection) until the session has left status.
    let deadline = Instant::now() + WAIT;
    let mut slowest = Duration::ZERO;
    loop {
        assert!(Instant::now() < deadline, "the session was not released");
        let asked = Instant::now();
        let answered = Client::connect(&daemon.socket, Duration::from_secs(5)).and_then(|mut client| client.status());
        slowest = slowest.max(asked.elapsed());
        match answered {
            Ok(status) if status.clients.iter().all(|client| client.session != session) => break,
            Ok(_) => {}
            // The earlier queries' connection threads not yet ended (a loaded machine) take the
            // places: the accept loop's refusal is an answer too.
            Err(DaemonError::Remote { code: ErrorCode::Busy, .. }) => {}
            Err(error) => panic!("status: {error}"),
        }
        thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(emulator.stats().faults_injected, 2, "the Delete I/O SQ and the retry's Delete I/O CQ were late");
    assert!(slowest < admin_timeout * 3 / 4, "a status query waited {slowest:?} (the admin timeout is {admin_timeout:?})");
    assert!(daemon.stop().is_some(), "serve did not return");
}

/// One client, two requests each: what the reservation admission tests serve with.
fn one_client_of_two_requests(config: &mut ServerConfig) {
    config.clients_max = 1;
    config.session_limits.requests_max = 2;
}

/// Two clients, two requests each.
fn two_clients_of_two_requests(config: &mut ServerConfig) {
    config.clients_max = 2;
    config.session_limits.requests_max = 2;
}

/// A store attached as `name` on a window of 8 blocks (the default timeout).
fn attach(daemon: &InProcess, name: &str) -> RemoteKvStore {
    let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
    RemoteKvStore::connect(&daemon.socket, &hello(name), &config).expect("attach")
}

/// The controller answers the next Delete I/O SQ with `action` (late, never, or an error).
fn fault_the_next_sq_deletion(emulator: &nvme_emu::EmuDevice, action: nvme_emu::FaultAction) {
    let rule = nvme_emu::FaultRule::on_nth_admin(1, nvme_driver::spec::AdminOpcode::DeleteIoSubmissionQueue, action);
    emulator.set_faults(nvme_emu::FaultPlan::none().with_rule(rule));
}

/// Returns once status lists `session` kept for good.
fn await_kept_for_good(daemon: &InProcess, session: u64) {
    daemon.status_once("the session was not kept for good", |status| {
        status.clients.iter().any(|client| client.session == session && client.kept)
    });
}

/// A session "first" that prepared one store (tokens 5000..5064, returned) and was then kept
/// for good holding that one request ([`end_kept`]).
fn keep_one_request_for_good(daemon: &InProcess, emulator: &nvme_emu::EmuDevice) -> Vec<u32> {
    let mut first = attach(daemon, "first");
    let tokens: Vec<u32> = (5000..5064).collect();
    first.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1, 2, 3] }).expect("prepare_store");
    end_kept(daemon, emulator, first, 1);
    tokens
}

/// An attach as "next" (timeout `timeout`) is refused `LimitReached`, naming the session kept
/// for good that holds the reservations it needs.
#[track_caller]
fn assert_refused_while_a_kept_session_holds_the_reservations(daemon: &InProcess, timeout: Duration) {
    match attach_past_the_place(daemon, "next", timeout) {
        Err(message) => assert!(message.contains("LimitReached") && message.contains("kept for good"), "{message}"),
        Ok(_) => panic!("an attach while a kept session holds the reservations was admitted"),
    }
}

/// Stores prepared by a session holding both its requests (`one_client_of_two_requests`), on a
/// window of 8 blocks.
fn prepare_two_stores(store: &mut RemoteKvStore) {
    for (first_token, block_ids) in [(0u32, [0, 1, 2, 3]), (1000, [4, 5, 6, 7])] {
        let tokens: Vec<u32> = (first_token..first_token + 64).collect();
        store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &block_ids }).expect("prepare_store");
    }
}

/// A client attached as `name` on a connection of its own, asked again while the daemon's
/// normal places are still taken (the status queries' connections, ending).
fn hello_past_the_place(daemon: &InProcess, name: &str) -> Client {
    let deadline = Instant::now() + WAIT;
    loop {
        let mut client = daemon.client();
        match client.hello(&hello(name)) {
            Ok(_) => return client,
            Err(DaemonError::Remote { code: ErrorCode::Busy, message }) if message.contains("maximum number of connections") => {
                assert!(Instant::now() < deadline, "the place stayed taken: {message}");
                thread::sleep(Duration::from_millis(20));
            }
            Err(error) => panic!("Hello as {name}: {error}"),
        }
    }
}

/// A store attached as `name` (timeout `timeout`), asked again while the daemon's normal places
/// are still taken (as [`hello_past_the_place`]): what its attach comes to once it is not that.
fn attach_past_the_place(daemon: &InProcess, name: &str, timeout: Duration) -> Result<RemoteKvStore, String> {
    let config = RemoteConfig { kv_blocks: 8, timeout, ..RemoteConfig::default() };
    let deadline = Instant::now() + WAIT;
    loop {
        match RemoteKvStore::connect(&daemon.socket, &hello(name), &config) {
            Ok(store) => return Ok(store),
            Err(error) if error.to_string().contains("maximum number of connections") => {
                assert!(Instant::now() < deadline, "the place stayed taken: {error}");
                thread::sleep(Duration::from_millis(20));
            }
            Err(error) => return Err(error.to_string()),
        }
    }
}

/// Ends `store`'s session with its Delete I/O SQ refused by the controller, so that it is kept
/// for good with what it holds (`held` requests); returns once status lists it so.
fn end_kept(daemon: &InProcess, emulator: &nvme_emu::EmuDevice, store: RemoteKvStore, held: u32) {
    let session = store.hello_reply().session;
    let status = nvme_driver::spec::NvmeStatus::generic(nvme_driver::spec::status::codes::INTERNAL_ERROR);
    fault_the_next_sq_deletion(emulator, nvme_emu::FaultAction::Status(status));
    drop(store);
    daemon.status_once("the session was not kept with its requests", |status| {
        status.clients.iter().any(|client| client.session == session && client.kept && client.requests_in_flight == held)
    });
}

#[test]
fn a_registration_is_told_to_retry_while_a_retiring_session_holds_the_reservations_it_needs() {
    // Goal: an ended session whose queue pairs' deletion is not confirmed yet keeps its
    // reservations (the pairs may still write their slots) but no longer its connection. With
    // one client of two requests, a session admitted meanwhile could not prepare its second
    // request, and its first would be refused as `LimitReached` (the table of clients × requests
    // full). Its `Hello` is admitted (it may only look up), but its first registration is
    // answered `Busy` until the retiring session gives them back; then the next session gets
    // both its requests. The Delete I/O SQ completes 7 s late (admin timeout 1 s: the session
    // retiring from 1 s on, its refusal checked in the 6 s before the late completion, which
    // comes 3 s before the 9 s after which a retiring session is kept for good).
    let admin_timeout = Duration::from_secs(1);
    let (mut daemon, emulator) = InProcess::start_configured(admin_timeout, one_client_of_two_requests);
    let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
    let mut first = RemoteKvStore::connect(&daemon.socket, &hello("first"), &config).expect("attach");
    prepare_two_stores(&mut first);
    let session = first.hello_reply().session;
    let late = nvme_emu::FaultAction::Delay(7 * admin_timeout);
    fault_the_next_sq_deletion(&emulator, late);
    drop(first);
    daemon.status_once("the session was not listed retiring with its requests", |status| {
        status.clients.iter().any(|client| client.session == session && client.retiring && client.requests_in_flight == 2)
    });
    match attach_past_the_place(&daemon, "next", Duration::from_millis(300)) {
        Err(message) => assert!(message.contains("Busy") && message.contains("not confirmed"), "{message}"),
        Ok(_) => panic!("an attach while the retiring session holds the reservations was admitted"),
    }
    assert!(
        daemon.client().status().unwrap().clients.iter().any(|client| client.session == session),
        "the retiring session left before the refusal was checked (the late Delete came early)"
    );
    // Asked again, it is admitted once the retiring session is released (up to the late
    // completion, 7 s from the end, and a tick), with both requests.
    let deadline = Instant::now() + 2 * WAIT;
    let mut next = loop {
        match RemoteKvStore::connect(&daemon.socket, &hello("next"), &config) {
            Ok(store) => break store,
            Err(error) => assert!(Instant::now() < deadline, "attach: {error}"),
        }
        thread::sleep(Duration::from_millis(20));
    };
    prepare_two_stores(&mut next);
    drop(next);
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn a_registration_is_refused_while_sessions_kept_for_good_hold_the_reservations_it_needs() {
    // Goal: a session kept for good (its Delete I/O SQ refused by the controller) keeps its
    // reservations for the daemon's life. With one client of two requests, both held so, no
    // later session could prepare any request: its first registration is refused up front as
    // `LimitReached`, saying why, instead of being admitted to fail every prepare.
    let (mut daemon, emulator) = InProcess::start_configured(Duration::from_secs(10), one_client_of_two_requests);
    let mut first = attach(&daemon, "first");
    prepare_two_stores(&mut first);
    end_kept(&daemon, &emulator, first, 2);
    assert_refused_while_a_kept_session_holds_the_reservations(&daemon, Duration::from_secs(5));
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn a_session_that_only_looks_up_is_promised_no_reservations() {
    // Goal: only a session with a registration can prepare, so one that only looks up (an
    // engine's scheduler: `LookupClient`) is promised none of the table. Two clients of two
    // requests; one session kept for good holding one: a lookup-only session and then a store
    // are both admitted, and the store prepares both its requests (the table of 4 has 3 free).
    // Counted at a whole share, the lookup session left the store's `Hello` refused.
    let (mut daemon, emulator) = InProcess::start_configured(Duration::from_secs(10), two_clients_of_two_requests);
    let tokens = keep_one_request_for_good(&daemon, &emulator);
    let mut scheduler = hello_past_the_place(&daemon, "scheduler");
    scheduler.lookup(&tokens).expect("lookup");
    let mut worker = attach_past_the_place(&daemon, "worker", Duration::from_secs(5)).expect("the worker's attach");
    prepare_two_stores(&mut worker);
    drop((worker, scheduler));
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn a_refused_registration_leaves_its_session_promised_nothing() {
    // Goal: a session is promised its share of the reservations at its first registration, and
    // the promise is checked and taken before the registration's own checks. A registration
    // refused for its own reasons (here no window descriptor: BadRequest) leaves the session
    // registered nowhere, so it can never prepare; kept promised, it counted a whole share, and
    // another store short for it was answered Busy for as long as the refused session lived.
    // Two clients of two requests, one session kept for good holding one: after a refused
    // registration, a store still gets its share (1 + 2 <= 4).
    let (mut daemon, emulator) = InProcess::start_configured(Duration::from_secs(10), two_clients_of_two_requests);
    keep_one_request_for_good(&daemon, &emulator);
    let mut refused = hello_past_the_place(&daemon, "refused");
    let register = crate::protocol::Request::RegisterMemory(crate::protocol::RegisterMemory { window_bytes: 1 << 20, kv_blocks: 0 });
    match refused.call(&register) {
        Err(DaemonError::Remote { code: ErrorCode::BadRequest, .. }) => {}
        other => panic!("a registration without its window's descriptor: expected BadRequest, got {other:?}"),
    }
    let mut store = attach_past_the_place(&daemon, "store", Duration::from_secs(1)).expect("the store's attach");
    prepare_two_stores(&mut store);
    drop((store, refused));
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn a_registration_short_for_want_of_live_sessions_reservations_is_told_to_retry() {
    // Goal: `LimitReached` says the reservations are held until the daemon restarts; that must
    // be so. Two clients of two requests, one session kept for good holding one, one live
    // store: a second store's registration is short (4 < 1 + 2 + 2), but only for as long as
    // the live one lives: `Busy`, and admitted once it ended.
    let (mut daemon, emulator) = InProcess::start_configured(Duration::from_secs(10), two_clients_of_two_requests);
    keep_one_request_for_good(&daemon, &emulator);
    let live = attach_past_the_place(&daemon, "live", Duration::from_secs(5)).expect("the live store's attach");
    match attach_past_the_place(&daemon, "second", Duration::from_millis(300)) {
        Err(message) => {
            assert!(message.contains("Busy") && !message.contains("until the daemon restarts"), "{message}");
        }
        Ok(_) => panic!("a store short of its share was admitted"),
    }
    let ended = live.hello_reply().session;
    drop(live);
    daemon.status_once("the live store's session did not end", |status| status.clients.iter().all(|client| client.session != ended));
    let mut second = attach_past_the_place(&daemon, "second", WAIT).expect("the attach once the live store ended");
    prepare_two_stores(&mut second);
    drop(second);
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn a_store_whose_hello_is_answered_busy_asks_again_on_a_new_connection() {
    // Goal: a `Hello` past the connection cap is answered Busy (and the connection closed);
    // `RemoteKvStore::connect` asks again on a new connection within its timeout, as the
    // Python package does, instead of failing at once (`tutti-bench --attach` right after a
    // killed run). One client; its place is taken for 300 ms.
    let mut daemon = InProcess::start(1, false);
    let mut holder = daemon.client();
    holder.hello(&hello("holder")).expect("the holder's Hello");
    let released = thread::spawn(move || {
        thread::sleep(Duration::from_millis(300));
        drop(holder);
    });
    let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
    let mut store = RemoteKvStore::connect(&daemon.socket, &hello("next"), &config).expect("the attach once the place is free");
    released.join().unwrap();
    prepare_two_stores(&mut store);
    drop(store);
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn a_retiring_session_whose_deletion_never_completes_is_kept_for_good_within_its_bound() {
    // Goal: a Delete I/O SQ that never completes (the controller drops its completion) leaves
    // the session retiring, every retry answered QueueBusy; kept so for the daemon's life, it
    // would make every session short of its reservations `Busy` for as long as the daemon runs.
    // Past eight admin timeouts per pair (one here) and a second (`serving_retire_bound`) it is
    // kept for good, and a session short of what it holds is told `LimitReached`. Admin
    // timeout 50 ms: 1.4 s.
    let admin_timeout = Duration::from_millis(50);
    let (mut daemon, emulator) = InProcess::start_configured(admin_timeout, one_client_of_two_requests);
    let mut first = attach(&daemon, "first");
    prepare_two_stores(&mut first);
    let session = first.hello_reply().session;
    let never = nvme_emu::FaultAction::DropCompletion;
    fault_the_next_sq_deletion(&emulator, never);
    let ended = Instant::now();
    drop(first);
    let kept = daemon.status_once("the session was not kept for good", |status| {
        status.clients.iter().any(|client| client.session == session && client.kept && client.requests_in_flight == 2)
    });
    // `since` is set after the session's first deletion pass, after `ended`: the bound holds
    // whole from here.
    let bound = serving_retire_bound(admin_timeout, 1);
    assert!(ended.elapsed() >= bound, "kept before its bound ({bound:?}): {:?}", ended.elapsed());
    assert_eq!(kept.leaked_requests, 2, "{kept:?}");
    assert_refused_while_a_kept_session_holds_the_reservations(&daemon, Duration::from_secs(1));
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn a_retiring_sessions_bound_grows_with_its_queue_pairs() {
    // Goal: a session's pairs are deleted one after another, each Delete waiting up to an admin
    // timeout, so on a pool of N devices one retry of a session whose controllers all answer
    // late takes up to N admin timeouts per command; a bound of eight admin timeouts and a
    // second whatever the pairs would keep for good, for the daemon's life, a session whose
    // confirmations were still coming. The bound is eight admin timeouts per pair the session
    // ended with unconfirmed, and a second. Two devices whose Delete I/O SQs never complete,
    // admin timeout 100 ms: kept no earlier than 2.6 s (before: at about 2 s).
    let admin_timeout = Duration::from_millis(100);
    let (mut daemon, emulators) = InProcess::start_on_devices(2, admin_timeout, |_| {});
    let store = attach(&daemon, "two pairs");
    let session = store.hello_reply().session;
    for emulator in &emulators {
        let never = nvme_emu::FaultAction::DropCompletion;
        fault_the_next_sq_deletion(emulator, never);
    }
    let ended = Instant::now();
    drop(store);
    await_kept_for_good(&daemon, session);
    let bound = serving_retire_bound(admin_timeout, 2);
    assert_eq!(bound, admin_timeout * 16 + Duration::from_secs(1));
    assert!(ended.elapsed() >= bound, "kept before its bound ({bound:?}): {:?}", ended.elapsed());
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn an_attach_after_a_session_kept_for_a_delete_that_never_completes_stays_busy() {
    // Goal: pins what docs/tuttid.md says is not solved. Keeping for good a session whose
    // Delete I/O SQ never completes settles the reservations, not the controller: the lost
    // Delete keeps that controller's admin queue (`QueueBusy`) until a reset, which the daemon
    // does only with every client detached, so a later attach (a pair on every device) is
    // answered Busy, saying the admin queue waits for a late completion, until the daemon
    // restarts.
    let admin_timeout = Duration::from_millis(50);
    let (mut daemon, emulator) = InProcess::start_with_admin_timeout(admin_timeout);
    let store = attach(&daemon, "first");
    let session = store.hello_reply().session;
    let never = nvme_emu::FaultAction::DropCompletion;
    fault_the_next_sq_deletion(&emulator, never);
    drop(store);
    await_kept_for_good(&daemon, session);
    match attach_past_the_place(&daemon, "next", Duration::from_millis(500)) {
        Err(message) => assert!(message.contains("Busy") && message.contains("admin queue"), "{message}"),
        Ok(_) => panic!("an attach on a controller whose admin queue holds a lost Delete was admitted"),
    }
    assert!(daemon.stop().is_some(), "serve did not return");
}

/// Stores `tokens` (one block per id of `block_ids`) through every layer and commits it.
fn store_and_commit(store: &mut RemoteKvStore, tokens: &[u32], block_ids: &[u32]) {
    let plan = store.prepare_store(&KvRequest { tokens, block_ids }).expect("prepare_store");
    for layer in 0..2 {
        store.store_layer(plan.handle, layer, gio_uring::SmBudget(1)).expect("store_layer");
        store.wait(plan.handle, Instant::now() + WAIT).expect("wait");
    }
    store.commit_store(plan.handle).expect("commit_store");
}

#[test]
fn a_store_short_of_its_iocbs_is_refused_before_the_daemon_reserves() {
    // Goal: objstore's KvStore refuses a store whose new blocks need more IOCBs than are free
    // before its reservation, which may evict cached blocks (syncing their headers Empty) that
    // releasing it does not bring back. A split store's reservation is the daemon's: before,
    // RemoteKvStore sent the PrepareStore, the daemon reserved (evicting on a full pool), and
    // then the client's data half refused NoFreeIocb, each refused store costing a cached
    // prompt. Four one-block slots, all committed; the client's two IOCBs held by two prepared
    // retrieves: the store is refused without a request sent, nothing evicted.
    let (mut daemon, _) = InProcess::start_on_pool(1, Some(4), false, Duration::from_secs(10), |_| {});
    let store_config = objstore::StoreConfig { iocbs: 2, ..objstore::StoreConfig::default() };
    let config = RemoteConfig { kv_blocks: 16, store: store_config, ..RemoteConfig::default() };
    let mut store = RemoteKvStore::connect(&daemon.socket, &hello("short of iocbs"), &config).expect("attach");
    let prompts: Vec<Vec<u32>> = (0..4u32).map(|p| (p * 1000..p * 1000 + 16).collect()).collect();
    for (p, tokens) in prompts.iter().enumerate() {
        store_and_commit(&mut store, tokens, &[p as u32]);
    }
    let before = daemon.client().status().unwrap().pool;
    assert_eq!(before.free_slots, 0, "{before:?}");
    let reads: Vec<_> = (0..2)
        .map(|p| store.prepare_retrieve(&KvRequest { tokens: &prompts[p], block_ids: &[8 + p as u32] }).expect("prepare_retrieve"))
        .collect();
    let sent = store.requests_sent();
    let tokens: Vec<u32> = (50_000..50_016).collect();
    match store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[10] }) {
        Err(objstore::ObjstoreError::Gio(gio_uring::GioError::NoFreeIocb { .. })) => {}
        other => panic!("expected NoFreeIocb, got {other:?}"),
    }
    assert_eq!(store.requests_sent(), sent, "the refused store reached the daemon");
    let after = daemon.client().status().unwrap().pool;
    assert_eq!(after.evictions, before.evictions, "{after:?}");
    for tokens in &prompts {
        assert_eq!(store.lookup(tokens), 1, "a cached prompt was lost to a refused store");
    }
    // Once an IOCB is back, the same store goes ahead (evicting the LRU tail, prompt 2).
    let mut reads = reads.into_iter();
    store.finish(reads.next().unwrap()).expect("finish a retrieve");
    let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[10] }).expect("prepare_store");
    assert_eq!((plan.new_blocks, plan.evicted_slots), (1, 1));
    store.finish(plan.handle).expect("finish the store");
    store.finish(reads.next().unwrap()).expect("finish a retrieve");
    drop(store);
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn the_socket_stays_after_a_drain_while_a_session_is_kept_for_good() {
    // Goal: a client reads its daemon's socket file gone as its session ended (the Python
    // module then frees its device memory). A session kept for good (its Delete I/O SQ refused
    // by the controller) must never read so: after the drain the socket file is still there.
    let (mut daemon, emulator) = InProcess::start_with_admin_timeout(Duration::from_secs(10));
    let store = attach(&daemon, "kept");
    let session = store.hello_reply().session;
    let status = nvme_driver::spec::NvmeStatus::generic(nvme_driver::spec::status::codes::INTERNAL_ERROR);
    let refuse = nvme_emu::FaultAction::Status(status);
    fault_the_next_sq_deletion(&emulator, refuse);
    drop(store);
    daemon.status_once("the session was not kept", |status| status.clients.iter().any(|client| client.session == session && client.kept));
    assert!(daemon.stop().is_some(), "serve did not return");
    assert!(daemon.socket.exists(), "the socket file was removed while a session is kept for good");
}

#[test]
fn a_drain_hands_back_the_pool_with_a_kept_sessions_slots_still_reserved() {
    // Goal: a session kept for good (its Delete I/O SQ refused) keeps its reservations, since
    // its queue pair may still write their slots. The drain hands the pool back to the caller
    // (`ServeReport::opened`), who may serve it again: those slots must still be Writing there,
    // not freed for the next store to take.
    let (mut daemon, emulator) = InProcess::start_configured(Duration::from_secs(10), one_client_of_two_requests);
    keep_one_request_for_good(&daemon, &emulator);
    let (_, report) = daemon.stop_with_report().expect("serve did not return");
    let counts = report.opened.pool.index().counts();
    assert_eq!(counts.writing_slots, 4, "the kept store's four slots were released by the drain: {counts:?}");
}

#[test]
fn an_attach_read_before_a_stop_but_served_after_it_is_answered_shutting_down() {
    // Goal: a stop releases every session at once, freeing queue ids of clients that may still
    // ring them; a queue created after that could take such an id and be rung by the departed
    // client. So no attach may create queues once the daemon is stopping: "second" asks while
    // "first"'s attach holds the attach lock (its Create I/O CQ completes late), the stop comes
    // once the connection has read "second"'s AttachQueues (past its own stop check, so waiting
    // for the lock), and that attach, served after, is answered ShuttingDown, not Attached.
    let (mut daemon, emulator) = InProcess::start_with_admin_timeout(Duration::from_secs(10));
    let late = nvme_emu::FaultAction::Delay(Duration::from_millis(3000));
    let rule = nvme_emu::FaultRule::on_nth_admin(1, nvme_driver::spec::AdminOpcode::CreateIoCompletionQueue, late);
    emulator.set_faults(nvme_emu::FaultPlan::none().with_rule(rule));
    let socket = daemon.socket.clone();
    let attach_as = move |name: &'static str| {
        let socket = socket.clone();
        thread::spawn(move || {
            let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
            RemoteKvStore::connect(&socket, &hello(name), &config).map(drop).map_err(|error| error.to_string())
        })
    };
    let first = attach_as("first");
    let deadline = Instant::now() + WAIT;
    while emulator.stats().faults_injected == 0 {
        assert!(Instant::now() < deadline, "the first attach's Create I/O CQ was never sent");
        thread::sleep(Duration::from_millis(5));
    }
    let second = attach_as(ATTACH_COUNTED);
    while ATTACHES_READ.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the second attach was never read");
        thread::sleep(Duration::from_millis(1));
    }
    // Else the second attach may have been served already, and this test shows nothing.
    assert!(!first.is_finished(), "the first attach ended before the second was read: its Create I/O CQ was not late enough");
    daemon.stop.stop();
    let first = first.join().unwrap();
    let second = second.join().unwrap();
    assert!(daemon.stop().is_some(), "serve did not return");
    assert!(first.is_ok(), "the first attach, under way before the stop: {first:?}");
    match second {
        Err(message) => assert!(message.contains("ShuttingDown"), "{message}"),
        Ok(()) => panic!("an attach served after the stop created queues"),
    }
}

#[test]
fn no_queue_id_frees_between_an_attachs_stop_check_and_its_creation() {
    // Goal: the drain releases every session at once, freeing queue ids their clients may
    // still ring; an attach that checked the stop flag just before the stop and then created
    // its queue could take such an id. So a release after the stop waits for an attach under
    // way: here the stop comes between the attach's check and its creation, and the other
    // session's release must not happen before that creation.
    let (mut daemon, _emulator) = InProcess::start_with_admin_timeout(Duration::from_secs(10));
    let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
    let released = RemoteKvStore::connect(&daemon.socket, &hello(RELEASED_IN_ATTACH), &config).expect("attach");
    let socket = daemon.socket.clone();
    let attaching = thread::spawn(move || {
        let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
        RemoteKvStore::connect(&socket, &hello(STOPS_IN_ATTACH), &config).map(drop).map_err(|error| error.to_string())
    });
    let _ = attaching.join().unwrap();
    assert!(daemon.stop().is_some(), "serve did not return");
    drop(released);
    assert!(
        !RELEASED_WITHIN_AN_ATTACH.load(Ordering::SeqCst),
        "a session was released (its queue ids freed) while an attach was between its stop check and its creation"
    );
}

/// The text of one `GET /metrics` from `address` (bounded by `WAIT`).
fn scrape(address: SocketAddr) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&address, WAIT).expect("connect to the metrics endpoint");
    stream.set_read_timeout(Some(WAIT)).unwrap();
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: tuttid\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("the scrape's answer");
    text
}

#[test]
fn a_device_fenced_after_failing_flushes_is_reported_by_status_and_metrics() {
    // Goal: a pool device whose commits' flushes keep failing is fenced by the pool (no header
    // writes, no new slots on it until the pool is reopened): its stores then fail as a full
    // pool while its slots count as free. Operators must see why: status says which device is
    // fenced and so does the `tuttid_device_metadata_fenced{device}` gauge (0 while healthy).
    use nvme_driver::spec::{NvmOpcode, NvmeStatus, StatusCodeType};
    use nvme_emu::{FaultAction, FaultPlan, FaultRule};
    let directory = tempfile::tempdir().unwrap();
    let opened = pool(directory.path(), false);
    let emulator = opened.emulators[0].clone().unwrap();
    let spec = opened.devices[0].spec.clone();
    let socket = directory.path().join("tuttid.sock");
    let mut config = ServerConfig::new(socket.clone());
    config.clients_max = 4;
    config.metrics = Some("127.0.0.1:0".parse().unwrap());
    let server = Server::bind(config, opened).expect("bind");
    let metrics = server.metrics_address().expect("metrics served");
    let stop = server.stop_handle();
    let (sender, served) = mpsc::channel();
    let thread = thread::spawn(move || {
        let outcome = server.serve().map_err(|error| error.to_string());
        let _ = sender.send(outcome);
    });
    let mut daemon = InProcess { socket, stop, served, thread: Some(thread), _directory: directory };
    let gauge = |value: u8| format!("tuttid_device_metadata_fenced{{device=\"{spec}\"}} {value}");
    let healthy = scrape(metrics);
    assert!(healthy.contains(&gauge(0)), "missing {:?} in\n{healthy}", gauge(0));
    assert_eq!(daemon.client().status().unwrap().metadata_fenced, vec![false]);

    let mut store = attach(&daemon, "fenced");
    let layers = store.hello_reply().shape.layers;
    let block_tokens = store.hello_reply().shape.block_tokens;
    let flush_fault = FaultAction::Status(NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, 0x80));
    emulator.set_faults(FaultPlan::none().with_rule(FaultRule::every_nth_io(1, flush_fault).with_opcode(NvmOpcode::Flush as u8)));
    // Commits until one is refused before it begins (the fence: 3 failed flushes in a row in
    // objstore), at most 10.
    let mut commits_failed = 0;
    for round in 0..10u32 {
        let tokens: Vec<u32> = (0..4 * block_tokens).map(|token| token + 100_000 * (round + 1)).collect();
        let Ok(plan) = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1, 2, 3] }) else { break };
        let deadline = Instant::now() + WAIT;
        for layer in 0..layers {
            store.store_layer(plan.handle, layer, gio_uring::SmBudget(1)).expect("store_layer");
            assert_eq!(store.wait(plan.handle, deadline).expect("wait"), Some(layer));
        }
        assert!(store.commit_store(plan.handle).is_err(), "round {round}: a commit whose flush failed succeeded");
        commits_failed += 1;
    }
    assert!(commits_failed >= 1, "no commit reached its flush");
    let fenced = scrape(metrics);
    assert!(fenced.contains(&gauge(1)), "missing {:?} after {commits_failed} failed commits in\n{fenced}", gauge(1));
    let status = daemon.client().status().unwrap();
    assert_eq!(status.metadata_fenced, vec![true], "{status:?}");
    assert!(status.pool.free_slots > 0, "the fenced device's slots still count as free: what status must explain");
    drop(store);
    assert!(daemon.stop().is_some(), "serve did not return");
}

#[test]
fn a_drain_leaves_the_socket_another_daemon_bound_meanwhile() {
    // Goal: a draining daemon has closed its listener, so a second daemon started on the same
    // socket path meanwhile finds it refusing, removes it as stale and binds its own. The first
    // daemon's drain must then leave that file alone: it removes the socket only while the path
    // still names the file it bound. The drain is held open by a retiring session (its Delete
    // I/O SQ answered 4 admin timeouts late), long enough for the second bind (1 s: with
    // 200 ms the drain once ended first on a loaded 2-core machine).
    let admin_timeout = Duration::from_secs(1);
    let (daemon, emulator) = InProcess::start_with_admin_timeout(admin_timeout);
    let second_directory = tempfile::tempdir().unwrap();
    let second_pool = pool(second_directory.path(), false);
    let store = attach(&daemon, "late-delete");
    let session = store.hello_reply().session;
    let late = nvme_emu::FaultAction::Delay(4 * admin_timeout);
    fault_the_next_sq_deletion(&emulator, late);
    drop(store);
    daemon.status_once("the session was not listed retiring", |status| {
        status.clients.iter().any(|client| client.session == session && client.retiring)
    });
    daemon.stop.stop();
    // The first daemon's listener closes within a tick of the stop; its file stays meanwhile.
    let deadline = Instant::now() + WAIT;
    loop {
        match UnixStream::connect(&daemon.socket) {
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => break,
            outcome => assert!(Instant::now() < deadline, "the first daemon's listener did not close: {outcome:?}"),
        }
        thread::sleep(Duration::from_millis(5));
    }
    // A start's checks before its pool is opened leave the refusing socket alone: that start
    // may still fail on the devices (the same pool's locks), and the draining daemon's clients
    // read its socket file gone as their sessions ended.
    let prepared = Server::prepare(&ServerConfig::new(daemon.socket.clone())).expect("prepare beside a draining daemon");
    assert!(daemon.socket.exists(), "Server::prepare removed the draining daemon's socket");
    drop(prepared);
    let second = Server::bind(ServerConfig::new(daemon.socket.clone()), second_pool).expect("bind over the draining daemon's socket");
    assert!(
        matches!(daemon.served.try_recv(), Err(mpsc::TryRecvError::Empty)),
        "the first daemon's drain ended before the second bound: the test proves nothing"
    );
    let outcome = daemon.served.recv_timeout(WAIT).expect("the first daemon's serve did not return");
    outcome.expect("the first daemon's serve failed");
    assert!(daemon.socket.exists(), "the draining daemon removed the socket the second daemon bound");
    UnixStream::connect(&daemon.socket).expect("the second daemon's listener answers");
    drop(second);
}

#[cfg(feature = "cluster")]
#[test]
fn a_bind_refused_after_the_socket_was_bound_removes_it_and_leaves_the_manifest() {
    // Goal: a cluster node's start refused after the socket's bind and after its manifest was
    // checked against the pool, before the manifest's rewrite (here the data plane's staging
    // area: no I/O queue pair left on the pool's controller, as on an SSD whose pairs other users
    // hold), leaves no socket file behind (the next start would find a stale file, clients a
    // socket that refuses) and the manifest byte for byte: the segments this fresh pool lacks
    // stay listed for the next start, which deletes their registrations at once.
    use tutti_cluster::{ModelSpace, SegmentBlocks, FINGERPRINT_BYTES};
    let directory = tempfile::tempdir().unwrap();
    let socket = directory.path().join("tuttid.sock");
    let manifest = directory.path().join("segments");
    let space = ModelSpace::new([7; FINGERPRINT_BYTES], 0, 1).unwrap();
    let keys: Vec<u64> = (1..=32).collect();
    let mut written =
        crate::cluster::manifest::Manifest::rewrite(&manifest, SegmentBlocks::new(32).unwrap(), 42, std::iter::empty()).unwrap();
    written.held(&space, 0, &keys).unwrap();
    written.flush().unwrap();
    drop(written);
    let before = std::fs::read(&manifest).unwrap();
    let mut config = ServerConfig::new(socket.clone());
    config.cluster = Some(cluster_at(manifest.clone()));
    let opened = pool_with_clients(directory.path(), false, 0);
    // The controller's I/O queue pairs left after the pool's own, held elsewhere.
    let controller = Arc::clone(&opened.pool.target(0).controller);
    let mut taken = Vec::new();
    loop {
        match controller.create_io_queue_pair(16) {
            Ok(pair) => taken.push(pair),
            Err(nvme_driver::NvmeError::NoQueueAvailable { .. }) => break,
            Err(error) => panic!("taking the controller's queue pairs: {error}"),
        }
        assert!(taken.len() < 64, "the controller grants queue pairs without end");
    }
    let Err(error) = Server::bind(config, opened) else { panic!("bound with no queue pair for the data plane's staging area") };
    assert!(error.to_string().contains("data plane"), "refused before the manifest's check: {error}");
    assert!(!socket.exists(), "the refused bind ({error}) left its socket file");
    assert!(std::fs::read(&manifest).unwrap() == before, "the refused bind ({error}) rewrote the manifest");
    drop(taken);
}

#[test]
fn a_relayed_pair_kept_by_a_failed_attach_does_not_hold_its_session_past_the_lease() {
    // Goal: on a pool of two relayed devices (no shared register page), an attach creates
    // device 0's pair, device 1's creation is refused, and undoing the attach device 0's pair
    // cannot be deleted: it stays with the session, off the relay. The client then goes silent
    // with its process running (this test's). Nothing of it can ring that pair, so the lease
    // ends the session and it leaves status within a few ticks (the kept pair's deletion retried
    // at release). It used to count as ringing a shared register page: the session was held,
    // awaiting its client's exit, for as long as the client ran.
    let (mut daemon, emulators) = InProcess::start_on_pool(2, None, true, Duration::from_secs(10), |config| {
        config.lease = Duration::from_secs(1);
    });
    let mut client = daemon.client();
    let session = client.hello(&hello("relayed")).expect("hello").session;
    let memory = nvme_driver::hw::SharedMemory::create("server-test", 1 << 20).unwrap();
    let register = crate::protocol::Request::RegisterMemory(crate::protocol::RegisterMemory { window_bytes: 1 << 20, kv_blocks: 4 });
    let registration = match client.call_with_fds(&register, &[memory.fd().as_fd()]).expect("register").0 {
        Reply::Registered(registered) => registered.registration,
        other => panic!("{other:?}"),
    };
    let refused = nvme_emu::FaultAction::Status(nvme_driver::spec::NvmeStatus::generic(nvme_driver::spec::status::codes::INTERNAL_ERROR));
    let create_cq = nvme_driver::spec::AdminOpcode::CreateIoCompletionQueue;
    emulators[1].set_faults(nvme_emu::FaultPlan::none().with_rule(nvme_emu::FaultRule::on_nth_admin(1, create_cq, refused)));
    fault_the_next_sq_deletion(&emulators[0], refused);
    let rings = vec![
        crate::protocol::RingOffsets { submission_offset: 512 << 10, completion_offset: 768 << 10 },
        crate::protocol::RingOffsets { submission_offset: 576 << 10, completion_offset: 832 << 10 },
    ];
    let attach = crate::protocol::Request::AttachQueues(crate::protocol::AttachQueues { registration, depth: 64, rings });
    match client.call(&attach) {
        Err(DaemonError::Remote { code: ErrorCode::StoreFailed, message }) => {
            assert!(message.contains("could not be deleted"), "{message}")
        }
        other => panic!("an attach whose half-made pair stayed: {other:?}"),
    }
    let status = daemon.client().status().unwrap();
    assert_eq!(status.relay.queues, 0, "the kept pair is still relayed: {status:?}");
    // Silent from here, its connection open and its process running.
    daemon.status_once("the session was held past its lease", |status| !status.clients.iter().any(|client| client.session == session));
    drop(client);
    assert!(daemon.stop().is_some(), "serve did not return");
}
