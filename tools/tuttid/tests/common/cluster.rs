//! What the cluster process tests (`cluster_*.rs`) share: a tuttid node (its directory with
//! pool file, socket and segment manifest, and its daemon, started as a member of a
//! `LocalEtcd` cluster), a registry reader, the segments of a test prompt and who the registry
//! says holds them, and bounded polling. Every node uses 16-block segments, a 48-slot pool,
//! unless a test changes them a 2 s lease and the cluster's one key secret ([`KEY_SECRET_HEX`],
//! in a file in the test's root directory: nodes find each other's segments by block key, so
//! they must be formatted with one secret).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tutti_cluster::local_etcd::LocalEtcd;
use tutti_cluster::{segments_of, ClusterClient, ClusterConfig, ClusterId, KeySecretTag, ModelSpace, Segment, SegmentBlocks};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::keys::KeySpace;
use tutti_daemon::protocol::ClusterStatusReply;

use super::{hello, prompt, store_prompt, Daemon};

pub const CLUSTER: &str = "wire";
pub const SEGMENT_BLOCKS: u16 = 16;
pub const BLOCK_TOKENS: u32 = 16;
/// Blocks each prompt stores: two full segments and a partial one (never registered).
pub const PROMPT_BLOCKS: usize = 40;
pub const LEASE: Duration = Duration::from_secs(2);
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(1);
/// Pool slots (one block each): room for one prompt and 8 blocks more, so a second prompt
/// evicts most of the first.
pub const SLOTS: &str = "48";
/// Longest wait for something the registrar does within a pass or a few (a tick is 50 ms; a
/// failed call backs off at most half the lease).
pub const SOON: Duration = Duration::from_secs(10);

/// The key secret every node of a test's cluster is formatted with (`--key-secret-file`), and
/// with which the tests compute the keys the nodes register ([`space`]).
pub const KEY_SECRET_HEX: &str = "c1a55ec7e75ec2e7c1a55ec7e75ec2e7c1a55ec7e75ec2e7c1a55ec7e75ec2e7";

/// Writes `hex` as a key secret file (mode 0600, as an operator would) at `path`.
pub fn write_key_secret_file(path: &Path, hex: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("{hex}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// One node's directory (socket, pool file, segment manifest) and its daemon.
pub struct Node {
    pub name: &'static str,
    pub directory: PathBuf,
    pub daemon: Option<Daemon>,
    /// `--cluster-lease` and `--cluster-timeout`.
    pub lease: &'static str,
    pub timeout: &'static str,
    /// More options for `--format` (e.g. `--payload-crc`).
    pub format_extra: Vec<&'static str>,
    /// More daemon options, on every start (e.g. a short client `--lease`).
    pub extra: Vec<&'static str>,
    /// `--data-address` (a free port by default; a fixed one to restart on the same address).
    pub data_address: String,
    /// `--cluster-state` (`segments` in the node's directory by default).
    pub manifest: PathBuf,
    /// `--key-secret-file` of `--format`: the cluster's, in the test's root directory, by
    /// default (every node of a test shares it).
    pub key_secret_file: PathBuf,
}

impl Node {
    pub fn new(root: &Path, name: &'static str) -> Node {
        let directory = root.join(name);
        std::fs::create_dir_all(&directory).unwrap();
        let key_secret_file = root.join("key-secret");
        if !key_secret_file.exists() {
            write_key_secret_file(&key_secret_file, KEY_SECRET_HEX);
        }
        Node {
            key_secret_file,
            name,
            daemon: None,
            lease: "2s",
            timeout: "1s",
            format_extra: Vec::new(),
            extra: Vec::new(),
            data_address: "127.0.0.1:0".into(),
            manifest: directory.join("segments"),
            directory,
        }
    }

    pub fn device(&self) -> String {
        format!("emu:{}", self.directory.join("pool").display())
    }

    /// Starts the daemon (formatting a fresh pool when `format`) as node `name` of `etcd`.
    pub fn start(&mut self, etcd: &LocalEtcd, format: bool) {
        let args = self.arguments(etcd, format);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.daemon = Some(Daemon::start(&self.directory, &self.device(), &args));
        // The socket accepts connections as soon as it is bound, before the server is built
        // (the data plane listening among it): one answered request means it was built, so a
        // test that reads from this node at once is not refused at its data address.
        let _ = self.status();
    }

    /// Starts the daemon as [`Node::start`] does, for a start that must fail: its exit status
    /// and standard error (bounded: a daemon that starts after all is killed and reported).
    pub fn start_failing(&self, etcd: &LocalEtcd, format: bool) -> (std::process::ExitStatus, String) {
        let mut daemon = self.spawn(etcd, format);
        let status = super::wait_bounded(daemon.child.as_mut().unwrap());
        let stderr = daemon.stderr();
        (status, stderr)
    }

    /// Starts the daemon as [`Node::start`] does without waiting for it to listen (standard
    /// error piped): for a start that may fail, watched meanwhile.
    pub fn spawn(&self, etcd: &LocalEtcd, format: bool) -> Daemon {
        let child = std::process::Command::new(super::TUTTID)
            .args(["--device", &self.device(), "--socket"])
            .arg(self.directory.join("tuttid.sock"))
            .arg("--lock-dir")
            .arg(self.directory.join("locks"))
            .args(["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--metrics", "off"])
            .args(self.arguments(etcd, format))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start tuttid");
        // A Daemon: killed on drop should it start after all.
        Daemon { child: Some(child), socket: self.directory.join("tuttid.sock") }
    }

    /// The daemon's cluster options (and the format's, when `format`).
    fn arguments(&self, etcd: &LocalEtcd, format: bool) -> Vec<String> {
        let manifest = self.manifest.display().to_string();
        let mut args: Vec<String> = [
            "--cluster-etcd",
            &etcd.endpoints().join(","),
            "--cluster-id",
            CLUSTER,
            "--node-id",
            self.name,
            "--data-address",
            &self.data_address,
            "--cluster-state",
            &manifest,
            "--segment-blocks",
            "16",
            "--cluster-lease",
            self.lease,
            "--cluster-timeout",
            self.timeout,
        ]
        .map(String::from)
        .to_vec();
        if format {
            args.extend(["--format", "--emu-create-bytes", "64m", "--slots", SLOTS].map(String::from));
            args.extend(["--key-secret-file".to_string(), self.key_secret_file.display().to_string()]);
            args.extend(self.format_extra.iter().map(|arg| arg.to_string()));
        }
        args.extend(self.extra.iter().map(|arg| arg.to_string()));
        args
    }

    pub fn daemon(&self) -> &Daemon {
        self.daemon.as_ref().expect("the node's daemon runs")
    }

    pub fn status(&self) -> ClusterStatusReply {
        self.daemon().client().cluster_status().expect("cluster status")
    }

    pub fn connect(&self) -> RemoteKvStore {
        let config = RemoteConfig { kv_blocks: 2 * PROMPT_BLOCKS as u32, ..RemoteConfig::default() };
        RemoteKvStore::connect(&self.daemon().socket, &hello(0, 1, "cluster-test"), &config).expect("attach a remote store")
    }

    pub fn kill(&mut self) {
        let mut daemon = self.daemon.take().expect("the node's daemon runs");
        let mut child = daemon.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

pub fn reader(etcd: &LocalEtcd) -> ClusterClient {
    let mut config = ClusterConfig::new(etcd.endpoints(), ClusterId::new(CLUSTER).unwrap(), SegmentBlocks::new(SEGMENT_BLOCKS).unwrap());
    config.lease_ttl = LEASE;
    config.request_timeout = REQUEST_TIMEOUT;
    ClusterClient::connect(config).unwrap()
}

/// The key space the test clients attach with (`common::hello(0, 1, …)`), in a pool
/// formatted with the cluster's secret ([`KEY_SECRET_HEX`]).
pub fn space() -> KeySpace {
    let secret = objstore::hash::KeySecret::from_hex(KEY_SECRET_HEX.as_bytes()).unwrap();
    KeySpace::new(&hello(0, 1, "").model_fingerprint, 0, 1, &secret).unwrap()
}

/// The tag of the cluster's secret ([`KEY_SECRET_HEX`]), as the nodes' member records carry it.
pub fn key_secret_tag() -> KeySecretTag {
    key_secret_tag_of(KEY_SECRET_HEX)
}

/// The tag of the key secret written as `hex` (a key secret file's text).
pub fn key_secret_tag_of(hex: &str) -> KeySecretTag {
    KeySecretTag::new(objstore::hash::KeySecret::from_hex(hex.as_bytes()).unwrap().tag_bytes())
}

pub fn model() -> ModelSpace {
    *space().model()
}

/// The full segments of prompt `seed` (as `common::store_prompt` stores it).
pub fn segments(seed: u32) -> Vec<Segment> {
    let tokens = prompt(seed, PROMPT_BLOCKS, BLOCK_TOKENS);
    let mut keys = Vec::new();
    space().keys(&tokens, BLOCK_TOKENS, &mut keys);
    let mut segments = Vec::new();
    segments_of(&keys, SegmentBlocks::new(SEGMENT_BLOCKS).unwrap(), &mut segments).unwrap();
    assert_eq!(segments.len(), PROMPT_BLOCKS / usize::from(SEGMENT_BLOCKS));
    segments
}

/// The nodes the registry lists for each segment of prompt `seed` (up to the first miss), for a
/// plain assertion. Not inside a [`wait_for`] condition: its retries can outlast the wait's
/// bound (which is checked only between calls), so a timed wait could pass after it; use
/// [`holders_once_available`] there.
pub fn holders(reader: &ClusterClient, seed: u32) -> Vec<Vec<String>> {
    // The test's own reader asks etcd with a 1 s request timeout; on a loaded machine one
    // attempt can go unanswered (`Unavailable`, seen in 2 of 78 runs of cluster_fetch), which is
    // not what any caller tests: asked again for up to SOON, then the test fails.
    let started = Instant::now();
    loop {
        if let Some(holders) = holders_once_available(reader, seed) {
            return holders;
        }
        assert!(started.elapsed() < SOON, "the registry stayed unavailable to the test's reader for {SOON:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn holder_names(lookup: &tutti_cluster::Lookup) -> Vec<Vec<String>> {
    lookup.holders.iter().map(|nodes| nodes.iter().map(|node| node.to_string()).collect()).collect()
}

/// [`holders`], or `None` while the registry is unavailable (an etcd leader election that
/// outlasts a request timeout on a loaded machine): for polls that ride out a disruption, and
/// for every [`wait_for`] condition (one request timeout a call, so the wait's bound holds).
pub fn holders_once_available(reader: &ClusterClient, seed: u32) -> Option<Vec<Vec<String>>> {
    match reader.lookup(&model(), &segments(seed)) {
        Ok(lookup) => Some(holder_names(&lookup)),
        Err(error @ tutti_cluster::ClusterError::Unavailable { .. }) => {
            eprintln!("registry unavailable, asking again: {error}");
            None
        }
        Err(error) => panic!("lookup: {error}"),
    }
}

/// The members the registry lists. A registry that is briefly unavailable (an etcd member
/// restarting, a slow loaded machine) is asked again for up to [`SOON`], as
/// [`holders_once_available`]'s callers do, rather than failing the test at once.
pub fn members(reader: &ClusterClient) -> Vec<String> {
    let started = Instant::now();
    loop {
        match reader.members() {
            Ok(members) => return members.nodes.iter().map(|record| record.node.to_string()).collect(),
            Err(error @ tutti_cluster::ClusterError::Unavailable { .. }) if started.elapsed() < SOON => {
                eprintln!("registry unavailable, asking again: {error}");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(error) => panic!("members: {error}"),
        }
    }
}

/// Polls `condition` every 20 ms for up to `timeout`; the time it took, or a panic naming `what`.
pub fn wait_for(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !condition() {
        assert!(started.elapsed() < timeout, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    started.elapsed()
}

pub fn store(node: &Node, seed: u32) {
    let mut store = node.connect();
    assert_eq!(store_prompt(&mut store, seed, 0, PROMPT_BLOCKS).expect("store and commit"), PROMPT_BLOCKS);
}

/// A node's client, attached (Hello sent) as `name`.
pub fn client_of(node: &Node, name: &str) -> tutti_daemon::Client {
    let mut client = node.daemon().client();
    client.hello(&hello(0, 1, name)).unwrap();
    client
}
