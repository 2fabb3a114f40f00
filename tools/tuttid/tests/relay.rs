//! The doorbell relay across processes: tuttid serves a software controller in relay mode
//! (`--emu-doorbell-relay`: no shared register page, so clients' doorbells go through the
//! daemon's relay thread, the path a `vfio:` device takes), and `tuttid-client` processes store
//! and retrieve byte-exact through it, two tensor-parallel ranks apart; then SIGTERM drains the
//! daemon (the relay thread included) to a clean exit. Every wait is bounded.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{wait_bounded, Daemon};

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

#[test]
fn clients_store_and_retrieve_through_the_relay_across_processes() {
    // Goal: with the emulator's register page withheld, the per-layer client path still works
    // end to end (every doorbell relayed by the daemon), byte-exact, per TP rank; the daemon
    // drains to a clean exit.
    let directory = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(directory.path(), "emu:mem:64m", &["--format", "--emu-doorbell-relay"]);
    for rank in 0..2 {
        assert_eq!(client(&daemon, "store", rank, 2), "stored 4 blocks");
    }
    for rank in 0..2 {
        assert_eq!(client(&daemon, "retrieve", rank, 2), "retrieved 4 blocks, 65536 bytes checked");
    }
    let status = daemon.client().status().unwrap();
    assert_eq!((status.clients.len(), status.leaked_queue_pairs), (0, 0), "{status:?}");
    let started = Instant::now();
    let (exit, stderr) = daemon.terminate();
    assert!(exit.success(), "tuttid exited with {exit}: {stderr}");
    assert!(started.elapsed() < Duration::from_secs(30));
}
