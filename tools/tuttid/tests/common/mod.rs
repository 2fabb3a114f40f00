//! What the process tests share: a tuttid process on a socket in a temporary directory (killed
//! if a test ends without stopping it), the test binary re-run as a client process, and bounded
//! waits; `cluster`, what the cluster node tests (`cluster_*.rs`) share.
#![allow(dead_code)] // each test file uses its own part

pub mod cluster;

use std::io::{BufRead, Read};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gio_uring::SmBudget;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use objstore::{KvRequest, LayerKvStore, ObjstoreError};
use tutti_daemon::client::RemoteKvStore;
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

/// Waits for `child` to end, killing it (and failing) past [`WAIT`]: a daemon that should have
/// been refused would otherwise serve forever. Its output, what of it was piped.
fn finish_bounded(mut child: Child) -> std::process::Output {
    let deadline = Instant::now() + WAIT;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let output = child.wait_with_output().unwrap();
            panic!("still running after {WAIT:?} (killed): {}", String::from_utf8_lossy(&output.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Runs `command` to its end ([`finish_bounded`]), its standard output and error piped.
pub fn output_bounded(command: &mut Command) -> std::process::Output {
    finish_bounded(command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap())
}

/// Runs `command` to its end ([`finish_bounded`]), its standard error piped: its exit code and
/// standard error.
pub fn run_bounded(command: &mut Command) -> (Option<i32>, String) {
    let output = finish_bounded(command.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap());
    (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned())
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

/// The tokens of prompt `seed`: `blocks` full blocks of `block_tokens` and a partial one.
pub fn prompt(seed: u32, blocks: usize, block_tokens: u32) -> Vec<u32> {
    (0..(blocks as u32 * block_tokens + 3)).map(|token| token.wrapping_mul(2_654_435_761) ^ seed).collect()
}

/// The byte at `offset` of prompt block `block` as rank `rank` stores it: differs per rank,
/// block, prompt and offset (so per layer and per K/V half too).
pub fn pattern_byte(seed: u32, rank: u32, block: usize, offset: usize) -> u8 {
    let mixed =
        (offset as u32).wrapping_mul(0x9E37_79B1) ^ (block as u32).wrapping_mul(0x85EB_CA6B) ^ rank.wrapping_mul(0xC2B2_AE35) ^ seed;
    (mixed >> 13) as u8 ^ (mixed as u8)
}

/// Stores prompt `seed`'s `blocks` blocks from engine blocks 0..blocks with rank `rank`'s
/// pattern, every layer, and commits; returns the blocks stored.
pub fn store_prompt(store: &mut RemoteKvStore, seed: u32, rank: u32, blocks: usize) -> Result<usize, ObjstoreError> {
    let tokens = prompt(seed, blocks, store.hello_reply().shape.block_tokens);
    let block_bytes = store.block_bytes() as usize;
    for block in 0..blocks {
        let bytes: Vec<u8> = (0..block_bytes).map(|offset| pattern_byte(seed, rank, block, offset)).collect();
        store.write_block(block as u32, 0, &bytes)?;
    }
    let block_ids: Vec<u32> = (0..blocks as u32).collect();
    let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &block_ids })?;
    let deadline = Instant::now() + WAIT;
    for layer in 0..store.hello_reply().shape.layers {
        store.store_layer(plan.handle, layer, SmBudget(1))?;
        store.wait(plan.handle, deadline)?;
    }
    store.commit_store(plan.handle)
}

/// Retrieves the first `blocks` blocks of prompt `seed` into engine blocks blocks..2·blocks
/// (cleared first), every layer, and finishes the request (also after a failed wait, so the
/// daemon hears of it); returns the first error, or how many bytes differ from rank `rank`'s
/// pattern.
pub fn retrieve_prompt(store: &mut RemoteKvStore, seed: u32, rank: u32, blocks: usize) -> Result<usize, ObjstoreError> {
    let tokens = prompt(seed, blocks, store.hello_reply().shape.block_tokens);
    let block_bytes = store.block_bytes() as usize;
    let block_ids: Vec<u32> = (blocks as u32..2 * blocks as u32).collect();
    for &block in &block_ids {
        store.write_block(block, 0, &vec![0u8; block_bytes])?;
    }
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &block_ids })?;
    let deadline = Instant::now() + WAIT;
    let mut failure = None;
    for layer in 0..store.hello_reply().shape.layers {
        if let Err(error) = store.retrieve_layer(handle, layer, SmBudget(1)).and_then(|()| store.wait(handle, deadline)) {
            failure = Some(error);
            break;
        }
    }
    store.finish(handle)?;
    if let Some(error) = failure {
        return Err(error);
    }
    let mut wrong = 0usize;
    let mut bytes = vec![0u8; block_bytes];
    for (prompt_block, &engine_block) in block_ids.iter().enumerate() {
        store.read_block(engine_block, 0, &mut bytes)?;
        wrong += bytes.iter().enumerate().filter(|&(offset, &byte)| byte != pattern_byte(seed, rank, prompt_block, offset)).count();
    }
    Ok(wrong)
}

/// `GET url` with a real HTTP client, bounded.
pub fn scrape(url: &str) -> String {
    let agent: ureq::Agent = ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(10))).build().into();
    agent.get(url).call().unwrap().body_mut().read_to_string().unwrap()
}
