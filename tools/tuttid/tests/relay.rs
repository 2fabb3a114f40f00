//! The doorbell relay across processes: tuttid serves a software controller in relay mode
//! (`--emu-doorbell-relay`: no shared register page, so clients' doorbells go through the
//! daemon's relay thread, the path a `vfio:` device takes), and `tuttid-client` processes store
//! and retrieve byte-exact through it, two tensor-parallel ranks apart, and the relay's counters
//! (per client and in all) show in status, `tuttid --status` and `/metrics`; then SIGTERM drains
//! the daemon (the relay thread included) to a clean exit. Every wait is bounded.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use objstore::{KvRequest, LayerKvStore};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::protocol::StatusReply;

mod common;
use common::{hello, retrieve_prompt, store_prompt, wait_bounded, Daemon, TUTTID, WAIT};

const CLIENT: &str = env!("CARGO_BIN_EXE_tuttid-client");

/// Runs one `tuttid-client` process to its exit (bounded); returns its output line.
fn client(daemon: &Daemon, role: &str, rank: u32, world: u32) -> String {
    let mut child = Command::new(CLIENT)
        .arg(role)
        .arg("--socket")
        .arg(&daemon.socket)
        .args(["--seed", "7", "--blocks", "4", "--rank", &rank.to_string(), "--world", &world.to_string()])
        .args(["--timeout-seconds", "20"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tuttid-client");
    let status = wait_bounded(&mut child);
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).trim().to_string();
    assert!(status.success(), "tuttid-client {role} rank {rank}/{world}: {status}: {stdout} {}", String::from_utf8_lossy(&output.stderr));
    stdout
}

/// Status once the relay forwarded nothing new for three reads in a row (a client's last CQ
/// head may still be on its way right after its wait returned).
fn settled_status(daemon: &Daemon) -> StatusReply {
    let deadline = Instant::now() + WAIT;
    let mut last = daemon.client().status().unwrap();
    let mut same = 0;
    while same < 3 {
        std::thread::sleep(Duration::from_millis(20));
        let status = daemon.client().status().unwrap();
        same = if status.relay.forwarded == last.relay.forwarded { same + 1 } else { 0 };
        last = status;
        assert!(Instant::now() < deadline, "the relay did not settle: {:?}", last.relay);
    }
    last
}

#[test]
fn clients_store_and_retrieve_through_the_relay_across_processes() {
    // Goal: with the emulator's register page withheld, the per-layer client path still works
    // end to end (every doorbell relayed by the daemon), byte-exact, per TP rank; the relay's
    // counters show what it did: in all (passes, doorbells forwarded, none dropped, no pair
    // left relayed once the clients are gone), and per attached client in status, `tuttid
    // --status` and /metrics (the client's own doorbells are all the relay forwarded while it
    // was the only one); the daemon drains to a clean exit.
    let directory = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::start(directory.path(), "emu:mem:64m", &["--format", "--emu-doorbell-relay", "--metrics", "127.0.0.1:0"]);
    let metrics = daemon.metrics_url();
    for rank in 0..2 {
        assert_eq!(client(&daemon, "store", rank, 2), "stored 4 blocks");
    }
    for rank in 0..2 {
        assert_eq!(client(&daemon, "retrieve", rank, 2), "retrieved 4 blocks, 65536 bytes checked");
    }
    let status = settled_status(&daemon);
    assert_eq!((status.clients.len(), status.leaked_queue_pairs), (0, 0), "{status:?}");
    let relay = status.relay;
    // Every layer's commands reach the controller only through a forwarded SQ tail (CQ heads
    // may be coalesced): at least four clients × two layers.
    assert!(relay.forwarded >= 4 * 2 && relay.passes > 0, "{relay:?}");
    assert_eq!((relay.dropped, relay.queues), (0, 0), "{relay:?}");

    // One client attached here: its doorbells are the relay's only ones meanwhile.
    let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
    let mut store = RemoteKvStore::connect(&daemon.socket, &hello(0, 1, "relayed"), &config).unwrap();
    assert_eq!(store_prompt(&mut store, 9, 0, 4).unwrap(), 4);
    assert_eq!(retrieve_prompt(&mut store, 9, 0, 4).unwrap(), 0);
    let attached = settled_status(&daemon);
    let own = attached.clients.iter().find(|client| client.name == "relayed").expect("the attached client");
    assert_eq!(own.doorbells_relayed, attached.relay.forwarded - relay.forwarded, "{attached:?}");
    assert!(own.doorbells_relayed >= 2 * 2, "a store and a retrieve, two layers each: {own:?}");
    assert_eq!((own.doorbells_dropped, attached.relay.queues), (0, 1));
    let text = common::scrape(&metrics);
    for line in [
        format!(
            "tuttid_client_relay_doorbells_total{{session=\"{}\",client=\"relayed\",result=\"Forwarded\"}} {}",
            own.session, own.doorbells_relayed
        ),
        format!("tuttid_relay_doorbells_total{{result=\"Forwarded\"}} {}", attached.relay.forwarded),
        "tuttid_relay_doorbells_total{result=\"Dropped\"} 0".to_string(),
        "tuttid_relay_queues 1".to_string(),
    ] {
        assert!(text.contains(&line), "missing {line:?} in\n{text}");
    }
    let output = Command::new(TUTTID).arg("--status").arg(&daemon.socket).output().unwrap();
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(
        printed.contains("'relayed'") && printed.contains(&format!("{} doorbell(s) relayed, 0 dropped", own.doorbells_relayed)),
        "{printed}"
    );
    assert!(printed.contains("doorbell relay: 1 queue pair(s) relayed"), "{printed}");
    drop(store);
    let started = Instant::now();
    let (exit, stderr) = daemon.terminate();
    assert!(exit.success(), "tuttid exited with {exit}: {stderr}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_relayed_client_silent_past_its_lease_is_released_while_it_runs() {
    // Goal: a session whose queue pairs are relayed ends at its lease even though its process
    // (this one) still runs and holds a prepared store: the relay stops forwarding its
    // doorbells first, so nothing of it can reach the queue ids its release frees, and its
    // pairs, window and reservation go back at once (a client ringing a shared register page
    // is held until it exits instead: store_path.rs).
    let directory = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(directory.path(), "emu:mem:64m", &["--format", "--emu-doorbell-relay", "--lease", "1s"]);
    let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
    let mut store = RemoteKvStore::connect(&daemon.socket, &hello(0, 1, "silent"), &config).expect("attach");
    let tokens = common::prompt(9, 4, store.hello_reply().shape.block_tokens);
    let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &[0, 1, 2, 3] }).expect("prepare_store");
    assert_eq!(plan.new_blocks, 4);
    let held = daemon.client().status().unwrap();
    assert_eq!((held.clients.len(), held.relay.queues), (1, 1), "{held:?}");
    assert!(held.pool.writing_slots > 0, "{:?}", held.pool);
    let deadline = Instant::now() + WAIT;
    let released = loop {
        let status = daemon.client().status().unwrap();
        if status.clients.is_empty() {
            break status;
        }
        assert!(!status.clients[0].awaiting_exit, "a relayed client was held: {status:?}");
        assert!(Instant::now() < deadline, "the silent session was not released: {status:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!((released.relay.queues, released.pool.writing_slots, released.leaked_queue_pairs), (0, 0, 0), "{released:?}");
    drop(store);
}
