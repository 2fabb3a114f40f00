//! A client's session ends while its queue pair cannot be deleted: the software controller
//! refuses the Delete I/O Submission Queue (nvme-emu's fault injection, `FaultRule::on_nth_admin`,
//! a real admin command answered with Internal Error on the real path). The daemon must then
//! keep everything the live queue may still write: the session's window stays mapped in the
//! devices' DMA space (its IOVAs never handed to another window) and its reservation stays
//! held (its slots never reused); all of it is counted (status, `tuttid --status`, `/metrics`)
//! and logged, the session stays listed, marked kept (its client must never free that memory),
//! and the daemon keeps serving other clients.
//!
//! The daemon is tuttid's own library (`open_pool` + `Server`, what the binary runs) serving in
//! this test process, so the test can reach the software controller inside it (to arm the
//! fault and to look at its DMA space); the clients attach over the socket as any engine does.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gio_uring::SmBudget;
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{AdminOpcode, NvmeStatus};
use nvme_driver::DmaAllocator;
use nvme_emu::{EmuDevice, FaultAction, FaultPlan, FaultRule};
use objstore::{FormatParams, KvRequest, LayerKvStore, ModelGeometry};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::pool_open::{open_pool, PoolOptions};
use tutti_daemon::protocol::StatusReply;
use tutti_daemon::{Client, Server, ServerConfig, StopHandle};
use tutti_devices::DeviceSpec;

mod common;
use common::{hello, prompt, retrieve_prompt, store_prompt, TUTTID, WAIT};

/// Blocks each prompt stores.
const BLOCKS: usize = 4;

/// A daemon serving in a thread of this process; drained when dropped.
struct InProcessDaemon {
    socket: PathBuf,
    metrics: String,
    emulator: Arc<EmuDevice>,
    stop: StopHandle,
    serving: Option<JoinHandle<()>>,
}

impl InProcessDaemon {
    /// `clients_max` 3: the controller has 3 + 2 I/O queue pairs (the pool's metadata pair and
    /// a spare), so a leaked pair leaves room for two more clients.
    fn start(directory: &Path) -> InProcessDaemon {
        let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let options = PoolOptions {
            specs: vec![DeviceSpec::parse("emu:mem:64m", &tutti_devices::DeviceKind::ALL).unwrap()],
            namespace: 1,
            emu_lba_bytes: 4096,
            emu_create_bytes: None,
            format: Some(FormatParams::new(geometry)),
            overwrite: false,
            lock_dir: directory.join("locks"),
            client_queue_pairs: 3,
            emu_doorbell_relay: false,
        };
        let opened = open_pool(&options).expect("open the daemon's pool");
        let emulator = opened.emulators[0].clone().expect("a software controller");
        let socket = directory.join("tuttid.sock");
        let mut config = ServerConfig::new(socket.clone());
        config.clients_max = 3;
        config.metrics = Some("127.0.0.1:0".parse().unwrap());
        let server = Server::bind(config, opened).expect("bind the daemon's socket");
        let metrics = format!("http://{}/metrics", server.metrics_address().unwrap());
        let stop = server.stop_handle();
        let serving = std::thread::spawn(move || {
            server.serve().expect("the daemon serves until stopped");
        });
        InProcessDaemon { socket, metrics, emulator, stop, serving: Some(serving) }
    }

    fn status(&self) -> StatusReply {
        Client::connect(&self.socket, Duration::from_secs(5)).unwrap().status().unwrap()
    }

    fn connect(&self, name: &str) -> RemoteKvStore {
        let config = RemoteConfig { kv_blocks: 2 * BLOCKS as u32, ..RemoteConfig::default() };
        RemoteKvStore::connect(&self.socket, &hello(0, 1, name), &config).expect("attach a remote store")
    }
}

impl Drop for InProcessDaemon {
    fn drop(&mut self) {
        self.stop.stop();
        if let Some(serving) = self.serving.take() {
            let _ = serving.join();
        }
    }
}

#[test]
fn a_queue_pair_the_controller_will_not_delete_keeps_its_window_and_reservation_for_good() {
    // Goal: a client holding a store (one layer written, its slots reserved) ends its session
    // while the controller refuses to delete its queue pair. The daemon keeps the pair, the
    // window (still mapped: its IOVA range translates, and no later window is placed over it)
    // and the reservation (its slots stay Writing, never reused while others store); status,
    // `tuttid --status` and /metrics count 1 pair, 1 window of its bytes, 1 request; two more
    // clients then store and retrieve byte-exact.
    let directory = tempfile::tempdir().unwrap();
    let daemon = InProcessDaemon::start(directory.path());
    let mut victim = daemon.connect("victim");
    let window = (victim.window().iova_base(), victim.window().memory().len());
    let tokens = prompt(1, BLOCKS, victim.hello_reply().shape.block_tokens);
    let block_ids: Vec<u32> = (0..BLOCKS as u32).collect();
    let plan = victim.prepare_store(&KvRequest { tokens: &tokens, block_ids: &block_ids }).unwrap();
    victim.store_layer(plan.handle, 0, SmBudget(1)).unwrap();
    victim.wait(plan.handle, Instant::now() + WAIT).unwrap();
    let held = daemon.status();
    assert_eq!(held.pool.writing_slots, BLOCKS as u64, "{:?}", held.pool);

    // The controller refuses the next Delete I/O SQ: the victim's, at its session's end.
    let refuse = FaultAction::Status(NvmeStatus::generic(codes::INTERNAL_ERROR));
    daemon.emulator.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_admin(1, AdminOpcode::DeleteIoSubmissionQueue, refuse)));
    let victim_session = victim.hello_reply().session;
    drop(victim);
    let deadline = Instant::now() + WAIT;
    loop {
        let status = daemon.status();
        if status.leaked_queue_pairs > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the victim's session did not end: {:?}", status.clients);
        std::thread::sleep(Duration::from_millis(20));
    }
    // The leak is counted before the session's end is settled: a few ticks more.
    std::thread::sleep(Duration::from_millis(200));
    let leaked = daemon.status();
    // Still listed, marked kept: its client must never free what the undeleted pair may write
    // (a CUDA client waits for its session to leave status before cuMemFree).
    let listed = leaked.clients.iter().find(|client| client.session == victim_session);
    assert!(listed.is_some_and(|client| client.kept && !client.awaiting_exit), "the kept session left status: {:?}", leaked.clients);
    assert_eq!(daemon.emulator.stats().faults_injected, 1, "the refusal came from the controller");
    let counts = (leaked.leaked_queue_pairs, leaked.leaked_windows, leaked.leaked_window_bytes, leaked.leaked_requests);
    assert_eq!(counts, (1, 1, window.1 as u64, 1), "{leaked:?}");
    assert_eq!(leaked.pool.writing_slots, BLOCKS as u64, "the reservation is kept: its slots are not free: {:?}", leaked.pool);
    daemon.emulator.dma_pool().translate(window.0, window.1).expect("the leaked window is still mapped for the devices");

    let text = common::scrape(&daemon.metrics);
    for line in [
        "tuttid_leaked_queue_pairs 1".to_string(),
        "tuttid_leaked_windows 1".to_string(),
        format!("tuttid_leaked_window_bytes {}", window.1),
        "tuttid_leaked_requests 1".to_string(),
    ] {
        assert!(text.contains(&line), "missing {line:?} in\n{text}");
    }
    let output = Command::new(TUTTID).arg("--status").arg(&daemon.socket).output().unwrap();
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success()
            && printed.contains("LEAKED (kept for good until tuttid restarts): 1 client queue pair(s) not known deleted"),
        "{printed}"
    );
    assert!(printed.contains("1 window(s)") && printed.contains("1 request(s) still reserved"), "{printed}");
    assert!(printed.contains("ended, KEPT FOR GOOD"), "{printed}");

    // Others are served: two more clients (the last two pairs), none placed over the window,
    // none given the reserved slots.
    let mut others: Vec<RemoteKvStore> = (0..2).map(|i| daemon.connect(&format!("other-{i}"))).collect();
    for (i, other) in others.iter_mut().enumerate() {
        let (base, len) = (other.window().iova_base().0, other.window().memory().len() as u64);
        assert!(base + len <= window.0 .0 || base >= window.0 .0 + window.1 as u64, "window {i} at {base:#x} overlaps the leaked one");
        let seed = 10 + i as u32;
        assert_eq!(store_prompt(other, seed, 0, BLOCKS).unwrap(), BLOCKS);
        assert_eq!(retrieve_prompt(other, seed, 0, BLOCKS).unwrap(), 0, "other client {i}: wrong bytes");
    }
    let served = daemon.status();
    assert_eq!(served.pool.writing_slots, BLOCKS as u64, "the reserved slots were not reused: {:?}", served.pool);
    assert_eq!(served.pool.cached_blocks, 2 * BLOCKS as u64);
    assert_eq!(served.leaked_queue_pairs, 1);
    daemon.emulator.dma_pool().translate(window.0, window.1).expect("still mapped after others registered and stored");
}
