//! tuttid under a hard descriptor limit of 1024 (`ulimit -n 1024`, systemd's or docker's
//! LimitNOFILE=1024), which the default of 64 clients does not fit at worst (1173): started
//! with the clients that fit when --clients-max is not given, refused (exit 2) when it is.

use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{run_bounded, Daemon, TUTTID, WAIT};

/// tuttid on a fresh memory pool in `directory` with `extra`, run by a shell whose soft and
/// hard descriptor limits are 1024 (`None`: this process's hard limit is lower, and an
/// unprivileged shell cannot raise it).
fn under_1024(directory: &std::path::Path, extra: &[&str]) -> Option<Command> {
    let probe = Command::new("bash").args(["-c", "ulimit -n 1024"]).stderr(Stdio::null()).status().expect("run bash");
    if !probe.success() {
        eprintln!("skipped: the hard descriptor limit is under 1024");
        return None;
    }
    let mut command = Command::new("bash");
    command.args(["-c", "ulimit -n 1024 && exec \"$0\" \"$@\"", TUTTID, "--device", "emu:mem:64m", "--socket"]);
    command.arg(directory.join("tuttid.sock")).arg("--lock-dir").arg(directory.join("locks"));
    command.args(["--format", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--metrics", "off"]).args(extra);
    Some(command)
}

#[test]
fn the_default_clients_max_is_lowered_to_fit_a_1024_descriptor_limit() {
    // Goal: 85b7de60 refused the defaults under a hard limit of 1024, where the daemon used to
    // start and serve a few engines: now it starts, serving the clients that fit, and says so.
    let directory = tempfile::tempdir().unwrap();
    let Some(mut command) = under_1024(directory.path(), &[]) else { return };
    let child = command.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("start tuttid");
    let socket = directory.path().join("tuttid.sock");
    let mut daemon = Daemon { child: Some(child), socket };
    let deadline = Instant::now() + WAIT;
    while UnixStream::connect(&daemon.socket).is_err() {
        if let Some(status) = daemon.child.as_mut().unwrap().try_wait().unwrap() {
            panic!("tuttid under a limit of 1024 exited with {status}: {}", daemon.stderr());
        }
        assert!(Instant::now() < deadline, "tuttid did not listen within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = daemon.client().status().expect("status");
    assert!(status.daemon_pid > 0);
    let (exit, stderr) = daemon.terminate();
    assert!(exit.success(), "{stderr}");
    assert!(stderr.contains("clients_max 64 may need") && stderr.contains("serving"), "no warning naming the numbers:\n{stderr}");
}

#[test]
fn a_clients_max_given_past_a_1024_descriptor_limit_is_refused() {
    // Goal: a --clients-max the operator chose is served whole or refused, never quietly
    // lowered: exit 2, naming the descriptors, before the pool is opened.
    let directory = tempfile::tempdir().unwrap();
    let Some(mut command) = under_1024(directory.path(), &["--clients-max", "64"]) else { return };
    let (code, stderr) = run_bounded(&mut command);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("descriptors") && stderr.contains("clients_max 64"), "{stderr}");
}
