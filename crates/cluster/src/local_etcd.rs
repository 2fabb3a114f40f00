//! A real etcd on loopback for tests and measurements: one or three members started from
//! Debian's `etcd-server` binary on ports picked here, data in a temporary directory, every
//! process killed and reaped on drop. Not for production (no TLS, no auth).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{ClusterError, Result};

/// How long a fresh cluster may take to answer its health check.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Tries of a start whose member found a port it was given taken (`PORT_TAKEN` in its log).
const START_ATTEMPTS: u32 = 3;
/// What etcd logs when it cannot bind a port it was given.
const PORT_TAKEN: &str = "address already in use";
/// The longest `revoke_lease` waits for one member (connection and answer).
pub const REVOKE_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// Most bytes an HTTP answer from a member may have (metrics are ~100 KiB).
const HTTP_ANSWER_BYTES_MAX: u64 = 8 << 20;

fn io_error(context: impl Into<String>, source: std::io::Error) -> ClusterError {
    ClusterError::LocalEtcd { context: context.into(), source }
}

/// The etcd binary to run: `$TUTTI_ETCD`, else `etcd` found in PATH; None when neither exists.
pub fn etcd_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("TUTTI_ETCD") {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|directory| directory.join("etcd")).find(|candidate| candidate.is_file())
}

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// A running local etcd cluster.
pub struct LocalEtcd {
    binary: PathBuf,
    members: Vec<Member>,
    directory: tempfile::TempDir,
    token: String,
    /// More flags for every member, restarts included (`start_with_flags`).
    flags: Vec<String>,
}

/// The lowest port [`free_ports`] hands out.
const PORTS_LOW: u16 = 20_000;
/// Where the ephemeral range starts when /proc does not say (Linux's default).
const EPHEMERAL_LOW_DEFAULT: u16 = 32_768;

/// Where the kernel's ephemeral port range starts (ip_local_port_range), or Linux's default.
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(EPHEMERAL_LOW_DEFAULT)
}

/// Free loopback ports: bound, noted, released, each taken below the kernel's ephemeral range
/// (ip_local_port_range), from a counter that starts at an offset of this process's id, so that
/// neither an outbound connection (an etcd member dialing its peers, a test's client) nor
/// another etcd of this process is given one between its release and etcd binding it; another
/// process could still take one (a start that finds a port taken is tried again,
/// `START_ATTEMPTS`).
fn free_ports(count: usize) -> Result<Vec<u16>> {
    static NEXT: std::sync::OnceLock<std::sync::atomic::AtomicU32> = std::sync::OnceLock::new();
    let ephemeral_low = ephemeral_low();
    if ephemeral_low <= PORTS_LOW + 1024 {
        // No room below the ephemeral range: any free port, as the kernel picks it.
        let listeners = (0..count)
            .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|error| io_error("bind a free port", error)))
            .collect::<Result<Vec<_>>>()?;
        return listeners
            .iter()
            .map(|listener| listener.local_addr().map(|address| address.port()).map_err(|error| io_error("read a bound port", error)))
            .collect();
    }
    let span = u32::from(ephemeral_low - PORTS_LOW);
    let next = NEXT.get_or_init(|| std::sync::atomic::AtomicU32::new(std::process::id().wrapping_mul(97) % span));
    // Held until every port of this call is picked, so that one call never picks a port twice.
    let mut listeners = Vec::with_capacity(count);
    for _ in 0..count {
        let listener = (0..span)
            .find_map(|_| {
                let offset = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % span;
                // In range: offset < span = ephemeral_low - PORTS_LOW.
                let port = PORTS_LOW + u16::try_from(offset).ok()?;
                TcpListener::bind((Ipv4Addr::LOCALHOST, port)).ok().map(|listener| (port, listener))
            })
            .ok_or_else(|| {
                io_error(
                    format!("find a free port in {PORTS_LOW}..{ephemeral_low}"),
                    std::io::Error::new(std::io::ErrorKind::AddrInUse, "every port in the range is taken"),
                )
            })?;
        listeners.push(listener);
    }
    Ok(listeners.into_iter().map(|(port, _)| port).collect())
}

/// A GET on a member's client port (HTTP/1.0, bounded in time and size): the body.
pub fn http_get(port: u16, path: &str, timeout: Duration) -> std::io::Result<String> {
    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut stream = TcpStream::connect_timeout(&address, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())?;
    let mut answer = String::new();
    stream.take(HTTP_ANSWER_BYTES_MAX).read_to_string(&mut answer)?;
    match answer.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => Ok(body.to_owned()),
        _ => Err(std::io::Error::other(format!("unexpected answer to GET {path}"))),
    }
}

impl LocalEtcd {
    /// For tests: [`LocalEtcd::start`], or `None` (with a `SKIPPED` note on stderr) where no etcd
    /// binary is installed — unless `TUTTI_REQUIRE_ETCD=1` (tools/test.sh's cluster stage), where
    /// that panics. A binary that is there but fails to start panics too.
    pub fn start_or_skip(members: usize) -> Option<LocalEtcd> {
        LocalEtcd::start_or_skip_with_flags(members, &[])
    }

    /// [`LocalEtcd::start_or_skip`] with more flags ([`LocalEtcd::start_with_flags`]).
    pub fn start_or_skip_with_flags(members: usize, flags: &[&str]) -> Option<LocalEtcd> {
        if etcd_binary().is_none() {
            assert!(
                std::env::var_os("TUTTI_REQUIRE_ETCD").is_none_or(|value| value != "1"),
                "TUTTI_REQUIRE_ETCD=1 but no etcd binary (install etcd-server or set TUTTI_ETCD)"
            );
            eprintln!("SKIPPED: no etcd binary (install Debian's etcd-server, or run tools/test.sh cluster)");
            return None;
        }
        Some(LocalEtcd::start_with_flags(members, flags).expect("start a local etcd"))
    }

    /// Starts `members` members (1 or 3 in the tests) and waits until each answers healthy.
    pub fn start(members: usize) -> Result<LocalEtcd> {
        LocalEtcd::start_with_flags(members, &[])
    }

    /// [`LocalEtcd::start`] with more flags for every member (e.g. `--max-request-bytes`, for
    /// values larger than an answer may be).
    pub fn start_with_flags(members: usize, flags: &[&str]) -> Result<LocalEtcd> {
        let binary = etcd_binary().ok_or_else(|| {
            io_error("find the etcd binary", std::io::Error::new(std::io::ErrorKind::NotFound, "install etcd-server or set TUTTI_ETCD"))
        })?;
        // The ports are free when picked but released for etcd to bind, so another process (a
        // parallel test's etcd, or any outbound connection given one as its ephemeral port) may
        // take one first: such a start is tried again on other ports, a few times.
        LocalEtcd::start_picking(&binary, members, flags, &mut free_ports)
    }

    /// [`LocalEtcd::start_with_flags`] with the ports of each try from `pick` (a test gives it
    /// taken ones).
    fn start_picking(binary: &Path, members: usize, flags: &[&str], pick: &mut dyn FnMut(usize) -> Result<Vec<u16>>) -> Result<LocalEtcd> {
        let mut attempt = 1;
        loop {
            match LocalEtcd::start_once(binary, members, flags, pick(2 * members)?) {
                Err(error) if attempt < START_ATTEMPTS && error.to_string().contains(PORT_TAKEN) => attempt += 1,
                outcome => return outcome,
            }
        }
    }

    /// One try of [`LocalEtcd::start_with_flags`], on ports picked now.
    fn start_once(binary: &Path, members: usize, flags: &[&str], ports: Vec<u16>) -> Result<LocalEtcd> {
        let binary = binary.to_path_buf();
        let directory =
            tempfile::Builder::new().prefix("tutti-etcd-").tempdir().map_err(|error| io_error("create the data directory", error))?;
        let members = (0..members)
            .map(|index| Member { name: format!("m{index}"), client_port: ports[2 * index], peer_port: ports[2 * index + 1], child: None })
            .collect();
        let token = format!("tutti-{}-{}", std::process::id(), directory.path().display()).replace('/', "-");
        let flags = flags.iter().map(|flag| flag.to_string()).collect();
        let mut etcd = LocalEtcd { binary, members, directory, token, flags };
        for index in 0..etcd.members.len() {
            etcd.spawn(index)?;
        }
        etcd.wait_healthy(START_TIMEOUT)?;
        Ok(etcd)
    }

    fn spawn(&mut self, index: usize) -> Result<()> {
        let initial_cluster = self
            .members
            .iter()
            .map(|member| format!("{}=http://127.0.0.1:{}", member.name, member.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let member = &self.members[index];
        let log_path = self.directory.path().join(format!("{}.log", member.name));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|error| io_error(format!("open {}", log_path.display()), error))?;
        let client_url = format!("http://127.0.0.1:{}", member.client_port);
        let peer_url = format!("http://127.0.0.1:{}", member.peer_port);
        let data_dir = self.directory.path().join(&member.name);
        // Short heartbeat and election timeouts: a lost leader is replaced within ~1 s, and
        // the minimum lease TTL etcd grants drops to 1 s (1.5 election timeouts).
        let child = Command::new(&self.binary)
            .arg("--name")
            .arg(&member.name)
            .arg("--data-dir")
            .arg(&data_dir)
            .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &initial_cluster, "--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &self.token])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"])
            .args(&self.flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|error| io_error(format!("start {}", self.binary.display()), error))?;
        self.members[index].child = Some(child);
        Ok(())
    }

    fn wait_healthy(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for index in 0..self.members.len() {
            loop {
                let port = self.members[index].client_port;
                match http_get(port, "/health", Duration::from_millis(500)) {
                    Ok(body) if body.contains("\"health\":\"true\"") => break,
                    _ => {}
                }
                // Any member that exited, not only the one waited for: without it the others
                // lack a quorum and would wait out the whole timeout, naming the wrong member.
                let exited =
                    (0..self.members.len()).find_map(|other| match self.members[other].child.as_mut().map(|child| child.try_wait()) {
                        Some(Ok(Some(status))) => Some((other, status.to_string())),
                        _ => None,
                    });
                if exited.is_some() || Instant::now() > deadline {
                    let (named, why) = match exited {
                        Some((other, status)) => (other, format!("exited ({status})")),
                        None => (index, format!("not healthy in {timeout:?}")),
                    };
                    let log = self.log_tail(named);
                    let member = &self.members[named];
                    return Err(io_error(
                        format!("etcd member {} on ports {}/{} {why}; log:\n{log}", member.name, member.client_port, member.peer_port),
                        std::io::Error::other("etcd did not start"),
                    ));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    fn log_tail(&self, index: usize) -> String {
        let path = self.directory.path().join(format!("{}.log", self.members[index].name));
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Client URLs of every member (including stopped ones: a client is given all of them).
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|member| format!("http://127.0.0.1:{}", member.client_port)).collect()
    }

    pub fn client_port(&self, index: usize) -> u16 {
        self.members[index].client_port
    }

    pub fn data_directory(&self) -> &Path {
        self.directory.path()
    }

    /// SIGKILL to member `index` and reaps it (a crash, not a shutdown).
    pub fn kill(&mut self, index: usize) -> Result<()> {
        if let Some(mut child) = self.members[index].child.take() {
            child.kill().map_err(|error| io_error("kill an etcd member", error))?;
            child.wait().map_err(|error| io_error("reap an etcd member", error))?;
        }
        Ok(())
    }

    /// Starts a killed member again on its ports and data, and waits for the cluster's health.
    pub fn restart(&mut self, index: usize) -> Result<()> {
        if self.members[index].child.is_none() {
            self.spawn(index)?;
        }
        self.wait_healthy(START_TIMEOUT)
    }

    /// Starts every killed member again (all at once: one alone has no quorum when the others
    /// are down too) and waits for the cluster's health.
    pub fn restart_all(&mut self) -> Result<()> {
        for index in 0..self.members.len() {
            if self.members[index].child.is_none() {
                self.spawn(index)?;
            }
        }
        self.wait_healthy(START_TIMEOUT)
    }

    /// SIGSTOP (`pause`) or SIGCONT (`resume`) to member `index`: a member that stalls with its
    /// sockets open, accepting connections and answering nothing.
    pub fn pause(&self, index: usize) -> Result<()> {
        self.signal(index, "-STOP")
    }

    pub fn resume(&self, index: usize) -> Result<()> {
        self.signal(index, "-CONT")
    }

    fn signal(&self, index: usize, signal: &str) -> Result<()> {
        let Some(child) = self.members[index].child.as_ref() else {
            return Err(io_error("signal an etcd member", std::io::Error::other("the member is not running")));
        };
        let status =
            Command::new("kill").args([signal, &child.id().to_string()]).status().map_err(|error| io_error("run kill(1)", error))?;
        if !status.success() {
            return Err(io_error(format!("kill {signal}"), std::io::Error::other(status.to_string())));
        }
        Ok(())
    }

    /// Revokes lease `lease_id` behind its holder's back, as an expiry during a partition
    /// would end it: every key under it vanishes at once. Asks each running member in turn
    /// (a killed one is not asked), each within [`REVOKE_ATTEMPT_TIMEOUT`]: a stalled member
    /// (`pause`) costs that bound, never a hang. The first success ends it; `Unavailable` when
    /// no member revoked it (etcd's answer if one refused, e.g. a lease it does not know).
    pub fn revoke_lease(&self, lease_id: i64) -> Result<()> {
        self.on_any_member("revoke a lease", |mut client| async move { client.lease_revoke(lease_id).await.map(|_| ()) })
    }

    /// Deletes `key` behind its writer's back, as an operator's `etcdctl del` would; bounded
    /// as [`LocalEtcd::revoke_lease`] is. Deleting a key that does not exist is not an error.
    pub fn delete_key(&self, key: &str) -> Result<()> {
        let key = key.to_owned();
        self.on_any_member("delete a key", move |mut client| {
            let key = key.clone();
            async move { client.delete(key, None).await.map(|_| ()) }
        })
    }

    /// Puts `value` at `key` under no lease, behind any owner's back (an operator's `etcdctl
    /// put`): a key under a node's lease leaves it, and never expires; bounded as
    /// [`LocalEtcd::revoke_lease`] is.
    pub fn put_key(&self, key: &str, value: &[u8]) -> Result<()> {
        let (key, value) = (key.to_owned(), value.to_vec());
        self.on_any_member("put a key", move |mut client| {
            let (key, value) = (key.clone(), value.clone());
            async move { client.put(key, value, None).await.map(|_| ()) }
        })
    }

    /// Runs `request` on each running member in turn until one answers, each attempt within
    /// [`REVOKE_ATTEMPT_TIMEOUT`] (connection included).
    fn on_any_member<F, Fut>(&self, operation: &'static str, mut request: F) -> Result<()>
    where
        F: FnMut(etcd_client::Client) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<(), etcd_client::Error>>,
    {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| io_error(format!("start a runtime to {operation}"), error))?;
        let started = Instant::now();
        let mut last_error = String::from("no etcd member is running");
        for member in self.members.iter().filter(|member| member.child.is_some()) {
            let endpoint = format!("http://127.0.0.1:{}", member.client_port);
            let options =
                etcd_client::ConnectOptions::new().with_connect_timeout(REVOKE_ATTEMPT_TIMEOUT).with_timeout(REVOKE_ATTEMPT_TIMEOUT);
            let attempt = async {
                let client = etcd_client::Client::connect([endpoint.as_str()], Some(options)).await?;
                request(client).await
            };
            match runtime.block_on(async { tokio::time::timeout(REVOKE_ATTEMPT_TIMEOUT, attempt).await }) {
                Ok(Ok(())) => return Ok(()),
                // etcd refused it for good: another member would answer the same.
                Ok(Err(source)) if !crate::connection::is_transient(&source) => {
                    return Err(ClusterError::Etcd { operation, source });
                }
                Ok(Err(error)) => last_error = format!("{}: {error}", member.name),
                Err(_) => last_error = format!("{}: no answer within {REVOKE_ATTEMPT_TIMEOUT:?}", member.name),
            }
        }
        Err(ClusterError::Unavailable { operation, waited: started.elapsed(), last_error })
    }

    /// Unary gRPC requests member `index` has started for `method` (e.g. "Txn"; "" for every
    /// method), from its metrics: what a client really sent, retries included.
    pub fn requests_started(&self, index: usize, method: &str) -> Result<u64> {
        let metrics = self.metrics(index)?;
        let method = format!("grpc_method=\"{method}\"");
        let count = metrics
            .lines()
            .filter(|line| line.starts_with("grpc_server_started_total{") && line.contains("grpc_type=\"unary\""))
            .filter(|line| method == "grpc_method=\"\"" || line.contains(&method))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
        Ok(count as u64)
    }

    /// Whether member `index` is the raft leader now (its `etcd_server_is_leader` metric).
    pub fn is_leader(&self, index: usize) -> Result<bool> {
        Ok(self.metrics(index)?.lines().any(|line| line.trim() == "etcd_server_is_leader 1"))
    }

    /// The Prometheus metrics of member `index` (one HTTP GET).
    pub fn metrics(&self, index: usize) -> Result<String> {
        http_get(self.members[index].client_port, "/metrics", Duration::from_secs(2))
            .map_err(|error| io_error("read etcd's metrics", error))
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        for member in &mut self.members {
            if let Some(mut child) = member.child.take() {
                // SIGKILL cannot be ignored, not even by a stopped process: the wait below
                // returns at once.
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_below_the_ephemeral_range_and_never_handed_out_twice_in_a_row() {
        // Goal: the ports picked for etcd are not ones the kernel gives outbound connections
        // (ip_local_port_range), and two picks in a row (two tests starting their etcds) get
        // different ones although the first pick's were released.
        let ephemeral_low = ephemeral_low();
        let first = free_ports(6).unwrap();
        let second = free_ports(6).unwrap();
        if ephemeral_low > PORTS_LOW + 1024 {
            assert!(first.iter().chain(&second).all(|port| (PORTS_LOW..ephemeral_low).contains(port)), "{first:?} {second:?}");
        }
        let mut all: Vec<u16> = first.iter().chain(&second).copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 12, "{first:?} {second:?}");
    }

    #[test]
    fn a_start_whose_port_was_taken_meanwhile_is_tried_again_on_other_ports() {
        // Goal: a port picked free but taken before etcd binds it (a parallel test's etcd, an
        // outbound connection's ephemeral port) fails that try, naming the member's log, and
        // the start goes on with other ports; every try failing so is an error saying why.
        let Some(binary) = etcd_binary() else {
            assert!(std::env::var_os("TUTTI_REQUIRE_ETCD").is_none(), "TUTTI_REQUIRE_ETCD is set but no etcd binary was found");
            eprintln!("skipped: no etcd binary (install etcd-server or set TUTTI_ETCD)");
            return;
        };
        let taken = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let taken_port = taken.local_addr().unwrap().port();
        let mut tries = 0;
        let mut first_taken = |count: usize| {
            tries += 1;
            let mut ports = free_ports(count)?;
            if tries == 1 {
                ports[0] = taken_port;
            }
            Ok(ports)
        };
        let etcd = LocalEtcd::start_picking(&binary, 1, &[], &mut first_taken).expect("started on the second try");
        assert_ne!(etcd.client_port(0), taken_port);
        drop(etcd);
        assert_eq!(tries, 2);
        let error = LocalEtcd::start_picking(&binary, 1, &[], &mut |count: usize| {
            let mut ports = free_ports(count)?;
            ports[0] = taken_port;
            Ok(ports)
        })
        .err()
        .expect("every try on a taken port fails");
        assert!(error.to_string().contains(PORT_TAKEN), "{error}");
    }
}
