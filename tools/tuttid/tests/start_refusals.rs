//! tuttid refusing to start for reasons that have nothing to do with the pool (the metrics
//! address taken, the socket served by a live daemon, a cluster node's data address taken or
//! manifest refused): refused before the pool is opened or formatted, so the pool is as it was,
//! and no socket file is left behind.

use std::path::Path;
use std::process::Command;

use tutti_daemon::client::{RemoteConfig, RemoteKvStore};

mod common;
use common::{hello, run_bounded, store_prompt, Daemon, TUTTID};

/// A pool file holding one committed prompt, its daemon stopped.
fn pool_with_a_prompt(directory: &Path) -> std::path::PathBuf {
    let image = directory.join("pool.img");
    let device = format!("emu:{}", image.display());
    let daemon = Daemon::start(directory, &device, &["--format", "--emu-create-bytes", "64m"]);
    let config = RemoteConfig { kv_blocks: 8, ..RemoteConfig::default() };
    let mut store = RemoteKvStore::connect(&daemon.socket, &hello(0, 1, "writer"), &config).expect("attach");
    assert_eq!(store_prompt(&mut store, 7, 0, 4).expect("store a prompt"), 4);
    drop(store);
    let (status, stderr) = daemon.terminate();
    assert!(status.success(), "{stderr}");
    image
}

fn formatting(directory: &Path, image: &Path, socket: &Path) -> Command {
    let mut command = Command::new(TUTTID);
    command.args(["--device", &format!("emu:{}", image.display()), "--socket"]).arg(socket);
    command.arg("--lock-dir").arg(directory.join("locks"));
    command.args(["--format", "--layers", "2", "--kv-heads", "2", "--head-dim", "64"]);
    command
}

#[test]
fn a_taken_metrics_address_is_refused_before_the_pool_is_formatted() {
    // Goal: `tuttid --format --metrics ADDRESS` with ADDRESS taken (a second tuttid on the host
    // takes the default port) refuses to start before it formats: the pool's committed blocks
    // are still there, byte for byte, and no socket file is left behind. Before, the pool was
    // formatted first and the socket bound, and both stayed after the refusal.
    let directory = tempfile::tempdir().unwrap();
    let image = pool_with_a_prompt(directory.path());
    let before = std::fs::read(&image).unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    let socket = directory.path().join("second.sock");
    let (code, stderr) = run_bounded(formatting(directory.path(), &image, &socket).args(["--metrics", &address]));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("metrics endpoint"), "{stderr}");
    assert!(std::fs::read(&image).unwrap() == before, "the refused daemon formatted the pool: {stderr}");
    assert!(!socket.exists(), "the refused daemon left its socket file: {stderr}");
}

#[test]
fn a_socket_a_live_daemon_serves_is_refused_before_the_pool_is_formatted() {
    // Goal: `tuttid --format` on a socket another daemon serves (here a plain listener that
    // accepts) exits 2, "nothing was changed", and that is true: the pool is not formatted and
    // the other daemon's socket stays.
    let directory = tempfile::tempdir().unwrap();
    let image = pool_with_a_prompt(directory.path());
    let before = std::fs::read(&image).unwrap();
    let socket = directory.path().join("live.sock");
    let live = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let (code, stderr) = run_bounded(formatting(directory.path(), &image, &socket).args(["--metrics", "off"]));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("served by a live daemon"), "{stderr}");
    assert!(std::fs::read(&image).unwrap() == before, "the refused daemon formatted the pool: {stderr}");
    assert!(socket.exists(), "the live daemon's socket was removed");
    drop(live);
}

/// `tuttid` on the pool `image` as a cluster node with its manifest at `state`. Its etcd
/// (port 9, discard) is never reached: every refusal tested here comes before the registry is
/// asked anything.
fn cluster_node(directory: &Path, image: &Path, socket: &Path, state: &Path, data_address: &str) -> Command {
    let mut command = Command::new(TUTTID);
    command.args(["--device", &format!("emu:{}", image.display()), "--socket"]).arg(socket);
    command.arg("--lock-dir").arg(directory.join("locks")).args(["--metrics", "off"]);
    command.args(["--cluster-etcd", "http://127.0.0.1:9", "--cluster-id", "refusals", "--node-id", "node-a"]);
    command.args(["--data-address", data_address, "--segment-blocks", "16", "--cluster-state"]).arg(state);
    command
}

#[test]
fn a_cluster_state_naming_the_pool_itself_is_refused_and_left_as_it_is() {
    // Goal: `--cluster-state` naming a file that is not a segment manifest (here, by a slip, the
    // pool's own image) exits 2 and leaves that file byte for byte (refused by the configuration's
    // check of the manifest's path against the devices', or, without it, by the manifest's check
    // of its magic, TSMF). Before, the start read it as a foreign manifest, discarded it and
    // renamed a 12-byte manifest over it: the pool's data gone without a question.
    let directory = tempfile::tempdir().unwrap();
    let image = pool_with_a_prompt(directory.path());
    let before = std::fs::read(&image).unwrap();
    let socket = directory.path().join("node.sock");
    let (code, stderr) = run_bounded(&mut cluster_node(directory.path(), &image, &socket, &image, "127.0.0.1:0"));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--cluster-state"), "{stderr}");
    assert!(std::fs::read(&image).unwrap() == before, "the refused daemon changed the pool image: {stderr}");
    assert!(!socket.exists(), "the refused daemon left its socket file: {stderr}");
}

/// Runs a formatting cluster node on a pool holding a prompt, refused by what the caller set
/// up, and checks that the pool was not formatted (and no socket left): the stderr.
fn refused_before_the_format(directory: &Path, image: &Path, state: &Path, data_address: &str) -> String {
    let before = std::fs::read(image).unwrap();
    let socket = directory.join("node.sock");
    let mut command = cluster_node(directory, image, &socket, state, data_address);
    command.args(["--format", "--layers", "2", "--kv-heads", "2", "--head-dim", "64"]);
    let (code, stderr) = run_bounded(&mut command);
    assert!(code.is_some_and(|code| code != 0), "exit {code:?}: {stderr}");
    assert!(std::fs::read(image).unwrap() == before, "the refused daemon formatted the pool: {stderr}");
    assert!(!socket.exists(), "the refused daemon left its socket file: {stderr}");
    stderr
}

#[test]
fn a_taken_data_address_is_refused_before_the_pool_is_formatted() {
    // Goal: `tuttid --format` as a cluster node whose `--data-address` another process holds
    // refuses to start before it formats: the pool's committed prompt is still there. Before,
    // the data plane was bound after the pool was opened, so the format came first.
    let directory = tempfile::tempdir().unwrap();
    let image = pool_with_a_prompt(directory.path());
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    let stderr = refused_before_the_format(directory.path(), &image, &directory.path().join("segments"), &address);
    assert!(stderr.contains("data plane"), "{stderr}");
    drop(taken);
}

#[test]
fn a_cluster_state_in_a_missing_directory_is_refused_before_the_pool_is_formatted() {
    // Goal: `tuttid --format` as a cluster node whose `--cluster-state` lies in a missing
    // directory (its lock file cannot be made) refuses to start before it formats. Before, the
    // manifest was locked after the pool was opened, so the format came first.
    let directory = tempfile::tempdir().unwrap();
    let image = pool_with_a_prompt(directory.path());
    let state = directory.path().join("missing").join("segments");
    let stderr = refused_before_the_format(directory.path(), &image, &state, "127.0.0.1:0");
    assert!(stderr.contains("segment manifest"), "{stderr}");
}

#[test]
fn a_cluster_state_naming_a_pool_image_not_made_yet_is_refused() {
    // Goal: a first start `--format --emu-create-bytes` whose `--cluster-state` names the pool
    // image itself, missing or empty (both read as no manifest), exits non-zero, and leaves no
    // manifest where the image goes. Before, the manifest loaded as empty, the pool was created
    // and formatted at that path and the manifest's rewrite renamed PATH.new over it: the daemon
    // ran on an unlinked inode (everything lost at its restart) and the path held a manifest.
    for empty_file in [false, true] {
        let directory = tempfile::tempdir().unwrap();
        let image = directory.path().join("pool.img");
        if empty_file {
            std::fs::write(&image, b"").unwrap();
        }
        let socket = directory.path().join("node.sock");
        let mut command = cluster_node(directory.path(), &image, &socket, &image, "127.0.0.1:0");
        command.args(["--format", "--emu-create-bytes", "64m", "--layers", "2", "--kv-heads", "2", "--head-dim", "64"]);
        let (code, stderr) = run_bounded(&mut command);
        assert!(code.is_some_and(|code| code != 0), "empty file {empty_file}: exit {code:?}: {stderr}");
        assert!(stderr.contains("--cluster-state"), "empty file {empty_file}: {stderr}");
        if let Ok(bytes) = std::fs::read(&image) {
            assert!(!bytes.starts_with(b"TSMF"), "empty file {empty_file}: a segment manifest replaced the pool image: {stderr}");
        }
        assert!(!socket.exists(), "empty file {empty_file}: the refused daemon left its socket file: {stderr}");
    }
}

#[test]
fn too_many_requests_per_session_are_refused_before_the_pool_is_formatted() {
    // Goal: `tuttid --format --requests-per-session 20000000` exits 2 before it formats (or
    // creates) the pool: the pool's committed prompt is still there byte for byte, a fresh
    // image is not made, no socket file is left. Before, the option went unchecked: the pool
    // was formatted, then allocating every session's reservations aborted the daemon (SIGABRT).
    let directory = tempfile::tempdir().unwrap();
    let image = pool_with_a_prompt(directory.path());
    let before = std::fs::read(&image).unwrap();
    let socket = directory.path().join("second.sock");
    let mut command = formatting(directory.path(), &image, &socket);
    command.args(["--metrics", "off", "--requests-per-session", "20000000"]);
    let (code, stderr) = run_bounded(&mut command);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("requests per session 20000000 is outside 1..=4096"), "{stderr}");
    assert!(std::fs::read(&image).unwrap() == before, "the refused daemon formatted the pool: {stderr}");
    assert!(!socket.exists(), "the refused daemon left its socket file: {stderr}");
    let fresh = directory.path().join("fresh.img");
    let mut command = formatting(directory.path(), &fresh, &socket);
    command.args(["--metrics", "off", "--emu-create-bytes", "64m", "--requests-per-session", "20000000"]);
    let (code, stderr) = run_bounded(&mut command);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(!fresh.exists(), "the refused daemon created its pool image: {stderr}");
    assert!(!socket.exists(), "the refused daemon left its socket file: {stderr}");
}
