//! `--attach` as a user runs it: the kv workload through a daemon, with client processes (the
//! bench run again, one per `--clients`) that attach with tuttid's client library.
//!
//! The daemon is tuttid's own library (`open_pool` + `Server`, what the `tuttid` binary runs)
//! in this test process on a memory-backed software controller: a test of this package cannot
//! name another package's binary. The kill loops in tools/tuttid/tests run the binary itself.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::thread::JoinHandle;

use objstore::{FormatParams, ModelGeometry};
use serde_json::Value;
use tutti_daemon::pool_open::{open_pool, PoolOptions};
use tutti_daemon::{Client, Server, ServerConfig, StopHandle};
use tutti_devices::DeviceSpec;

/// The geometry both sides use: 2 layers x 2 KV heads x 64 dims, bf16, 16-token blocks (4 KiB
/// objects).
const MODEL: [&str; 6] = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64"];
const OBJECT_BYTES: u64 = 16 * 2 * 64 * 2;

/// A daemon serving in a thread of this process; stopped (drained) when dropped.
struct Daemon {
    socket: PathBuf,
    stop: StopHandle,
    serving: Option<JoinHandle<()>>,
}

impl Daemon {
    fn start(directory: &Path) -> Daemon {
        Self::start_with_blocks_per_slot(directory, 1)
    }

    /// A daemon whose pool holds `blocks_per_slot` blocks per slot (`tuttid --format
    /// --blocks-per-slot K`).
    fn start_with_blocks_per_slot(directory: &Path, blocks_per_slot: u32) -> Daemon {
        let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let options = PoolOptions {
            specs: vec![DeviceSpec::parse("emu:mem:64m", &tutti_devices::DeviceKind::ALL).unwrap()],
            namespace: 1,
            emu_lba_bytes: 4096,
            emu_create_bytes: None,
            format: Some(FormatParams { blocks_per_slot, ..FormatParams::new(geometry) }),
            overwrite: false,
            lock_dir: directory.join("locks"),
            client_queue_pairs: 8,
            emu_doorbell_relay: false,
        };
        let opened = open_pool(&options).expect("open the daemon's pool");
        let socket = directory.join("tuttid.sock");
        let mut config = ServerConfig::new(socket.clone());
        config.clients_max = 8;
        let server = Server::bind(config, opened).expect("bind the daemon's socket");
        let stop = server.stop_handle();
        let serving = std::thread::spawn(move || {
            server.serve().expect("the daemon serves until stopped");
        });
        Daemon { socket, stop, serving: Some(serving) }
    }

    fn client(&self) -> Client {
        Client::connect(&self.socket, std::time::Duration::from_secs(5)).unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop.stop();
        if let Some(serving) = self.serving.take() {
            let _ = serving.join();
        }
    }
}

fn bench(socket: &Path, arguments: &[&str]) -> Output {
    bench_model(socket, &MODEL, arguments)
}

fn bench_model(socket: &Path, model: &[&str], arguments: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tutti-bench"))
        .arg("--attach")
        .arg(socket)
        .args(model)
        .args(arguments)
        .output()
        .expect("the built binary runs")
}

fn json_of(output: &Output) -> Value {
    assert_eq!(output.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).expect("standard output is one JSON document")
}

#[test]
fn two_client_processes_run_the_kv_workload_through_the_daemon_byte_exact() {
    // Goal: `--attach SOCKET --clients 2` runs populate, retrieve (verified byte for byte in
    // each client process) and store through the daemon, reports each phase with both clients
    // and aggregate figures under `mode: attach`, and leaves both clients' prompts in the
    // daemon's pool with nothing pinned or held.
    let directory = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(directory.path());
    let out = json_of(&bench(
        &daemon.socket,
        &["--clients", "2", "--prompt-tokens", "256", "--hit-rate", "0.5", "--verify", "--output-format", "json"],
    ));
    assert_eq!((out["mode"].as_str(), out["clients"].as_u64()), (Some("attach"), Some(2)));
    let options = &out["global options"];
    assert_eq!((options["blocks_per_client"].as_u64(), options["cached_blocks_per_client"].as_u64()), (Some(16), Some(8)));
    assert_eq!(options["seeds"], serde_json::json!([1, 2]));
    assert_eq!(options["layers_in_flight"].as_u64(), Some(2), "the clients keep the in-process default of layers in flight");
    let phases = out["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 3, "populate, retrieve, store: {phases:?}");
    for phase in phases {
        assert_eq!(phase["per_client"].as_array().unwrap().len(), 2);
        assert_eq!(phase["blocks"].as_u64(), Some(16), "8 blocks per client in each phase: {phase}");
        // 2 clients x 8 blocks x 2 layers x (K + V) objects.
        assert_eq!(phase["io_bytes"].as_u64(), Some(2 * 8 * 2 * 2 * OBJECT_BYTES));
        assert!(phase["bw_bytes"].as_u64().unwrap() > 0);
    }
    assert_eq!(phases[1]["verified_bytes"].as_u64(), Some(2 * 8 * 2 * 2 * OBJECT_BYTES), "every retrieved byte was compared");
    // Per request the clients talked to the daemon; per layer they did not: the same count for
    // both, and fewer than the layers moved would need.
    let sent: Vec<u64> = options["requests_sent_per_client"].as_array().unwrap().iter().map(|count| count.as_u64().unwrap()).collect();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0], sent[1]);
    let status = daemon.client().status().unwrap();
    assert_eq!(status.pool.cached_blocks, 2 * 16, "both clients' prompts are in the pool");
    assert_eq!((status.pool.pinned_slots, status.pool.writing_slots, status.leaked_queue_pairs), (0, 0, 0));

    // The same prompts again would share every block and move nothing: refused, in words.
    let again = bench(&daemon.socket, &["--clients", "2", "--prompt-tokens", "256"]);
    assert_eq!(again.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds"), "{}", String::from_utf8_lossy(&again.stderr));

    // One client, text output, another seed: the marker and the verified retrieve are printed.
    let text = bench(&daemon.socket, &["--prompt-tokens", "128", "--seed", "9", "--verify", "--layers-in-flight", "1"]);
    assert_eq!(text.status.code(), Some(0), "{}", String::from_utf8_lossy(&text.stderr));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("mode=attach clients=1"), "{text}");
    assert!(text.contains("layers-in-flight=1"), "{text}");
    assert!(text.contains("slots of 1 block(s)"), "the daemon's blocks per slot: {text}");
    assert!(text.contains("compared byte for byte in the client processes, no mismatch"), "{text}");
}

#[test]
fn attach_refuses_what_it_cannot_run_with_one_line() {
    // Goal: a socket nobody serves, another model than the daemon's pool, devices of its own:
    // exit status 2 with what to change; nothing stored.
    let directory = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(directory.path());
    let refused = |output: Output, words: &str| {
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(words), "{stderr}");
    };
    refused(bench(&directory.path().join("nobody.sock"), &["--prompt-tokens", "128"]), "no tuttid answers there");
    refused(
        bench_model(&daemon.socket, &["--layers", "4", "--kv-heads", "2", "--head-dim", "64"], &["--prompt-tokens", "128"]),
        "give the model options tuttid was started with",
    );
    refused(bench(&daemon.socket, &["--prompt-tokens", "128", "--device", "emu:mem:16m"]), "owns the devices");
    refused(bench(&daemon.socket, &["--prompt-tokens", "128", "--keep-pool"]), "the pool is the daemon's");
    // The daemon's pool has its own blocks per slot (tuttid --format --blocks-per-slot K) and
    // is never formatted by the bench: both options would be ignored, the figures taken at K.
    refused(bench(&daemon.socket, &["--prompt-tokens", "128", "--blocks-per-slot", "4"]), "'--blocks-per-slot");
    refused(bench(&daemon.socket, &["--prompt-tokens", "128", "--overwrite"]), "'--overwrite'");
    refused(bench(&daemon.socket, &["--workload=serve"]), "drop one of them");
    refused(bench(&daemon.socket, &["--workload=raw"]), "apply to --workload=kv");
    refused(bench(&daemon.socket, &["--prompt-tokens", "1048576"]), "does not fit one request to tuttid");
    refused(bench(&daemon.socket, &["--prompt-tokens", "32768", "--clients", "4"]), "the daemon's pool has");
    assert_eq!(daemon.client().status().unwrap().pool.cached_blocks, 0);
}

#[test]
fn a_pool_of_several_blocks_per_slot_is_sized_in_slots_of_that_many_blocks() {
    // Goal: with `tuttid --format --blocks-per-slot 4` a prompt fills a quarter as many slots
    // as it has blocks (the cached prefix and the rest each rounded up to whole slots): a
    // prompt of more blocks than the pool has slots runs when its slots fit, and one whose
    // slots do not fit is refused naming the slots of 4 blocks.
    let directory = tempfile::tempdir().unwrap();
    let daemon = Daemon::start_with_blocks_per_slot(directory.path(), 4);
    let slots = daemon.client().status().unwrap().pool.slots;
    // More blocks than slots, in fewer slots than the pool has: 16 tokens a block.
    let blocks = slots + 8;
    let tokens = (blocks * 16).to_string();
    let output = bench(&daemon.socket, &["--prompt-tokens", &tokens, "--hit-rate", "0.5", "--output-format", "json"]);
    let out = json_of(&output);
    assert_eq!(out["global options"]["blocks_per_client"].as_u64(), Some(blocks));
    assert_eq!(out["global options"]["blocks_per_slot"].as_u64(), Some(4), "the daemon's K, which the run measured");
    // More slots than the pool has: refused before any client starts.
    let too_many = ((slots * 4 + 64) * 16).to_string();
    let refused = bench(&daemon.socket, &["--prompt-tokens", &too_many, "--seed", "7"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("slots of 4 block(s)") && stderr.contains("the daemon's pool has"), "{stderr}");
}
