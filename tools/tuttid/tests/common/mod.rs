//! What the process tests share: a tuttid process on a socket in a temporary directory (killed
//! if a test ends without stopping it), the test binary re-run as a client process, and bounded
//! waits.
#![allow(dead_code)] // each test file uses its own part

use std::io::{BufRead, Read};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tutti_daemon::protocol::Hello;
use tutti_daemon::Client;

pub const TUTTID: &str = env!("CARGO_BIN_EXE_tuttid");
pub const WAIT: Duration = Duration::from_secs(30);
pub fn hello(rank: u32, world: u32, name: &str) -> Hello {
    Hello { model_fingerprint: [0x5a; 32], tp_rank: rank, tp_world: world, client_name: name.into() }
}

/// A running tuttid; killed (SIGKILL) if a test ends without stopping it.
pub struct Daemon {
    pub child: Option<Child>,
    pub socket: PathBuf,
}

impl Daemon {
    pub fn start(directory: &Path, device: &str, extra: &[&str]) -> Daemon {
        let socket = directory.join("tuttid.sock");
        let mut command = Command::new(TUTTID);
        command.args(["--device", device, "--socket"]).arg(&socket).args(["--lock-dir"]).arg(directory.join("locks"));
        command.args(["--layers", "2", "--kv-heads", "2", "--head-dim", "64"]).args(extra);
        if !extra.contains(&"--metrics") {
            // Tests run daemons side by side: none takes the default port.
            command.args(["--metrics", "off"]);
        }
        let child = command.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("start tuttid");
        let mut daemon = Daemon { child: Some(child), socket };
        let deadline = Instant::now() + WAIT;
        while UnixStream::connect(&daemon.socket).is_err() {
            if let Some(status) = daemon.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("tuttid exited with {status}: {}", daemon.stderr());
            }
            assert!(Instant::now() < deadline, "tuttid did not listen within {WAIT:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        daemon
    }

    /// The metrics URL the daemon printed at start (started with `--metrics IP:0`).
    pub fn metrics_url(&mut self) -> String {
        let stderr = self.child.as_mut().unwrap().stderr.take().unwrap();
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(url) = line.strip_prefix("tuttid: metrics on ") {
                    let _ = sender.send(url.to_string());
                }
            }
        });
        receiver.recv_timeout(WAIT).expect("tuttid printed no metrics address")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.socket, Duration::from_secs(5)).unwrap()
    }

    pub fn stderr(&mut self) -> String {
        let mut text = String::new();
        if let Some(stderr) = self.child.as_mut().and_then(|child| child.stderr.as_mut()) {
            let _ = stderr.read_to_string(&mut text);
        }
        text
    }

    /// Sends SIGTERM and waits (bounded) for the exit status and standard error.
    pub fn terminate(mut self) -> (std::process::ExitStatus, String) {
        kill(Pid::from_raw(self.pid() as i32), Signal::SIGTERM).unwrap();
        let status = wait_bounded(self.child.as_mut().unwrap());
        let stderr = self.stderr();
        self.child = None;
        (status, stderr)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn wait_bounded(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "process {} did not exit within {WAIT:?}", child.id());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs this test binary again as a client process: only `entry` (a test that is a no-op
/// unless `env` is set) runs, with `role` in `env`; its standard output is piped.
pub fn spawn_child(entry: &str, env: &str, role: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", entry, "--nocapture", "--test-threads", "1"])
        .env(env, role)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}
