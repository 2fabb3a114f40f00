//! The synchronous facade over etcd's asynchronous client: a private tokio runtime (one worker
//! thread) runs the clients and the lease keep-alive; callers block on one request at a time,
//! each bounded by the request timeout. Callers must not be tokio tasks themselves (tuttid's
//! threads are plain threads).
//!
//! One client per etcd member, and a preferred member that every request goes to: a request
//! that fails for a reason that may pass (connection refused, no leader) or takes longer than a
//! third of the request timeout moves the preference to the next member and is retried there.
//! So a member that died, or one that stalls with its sockets open, costs at most one attempt
//! per call — a balancer that picks at random would go back to the stalled member again.
//!
//! Key-value requests go through [`Connection::call_kv`] (and `_by`, for an operation of several
//! requests sharing one deadline) on clients whose answers are limited to
//! [`RESPONSE_BYTES_MAX`], set here explicitly; lease requests through `call_lease`.

use std::cell::Cell;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, KvClient, LeaseClient, WatchClient};
use tokio::runtime::{Builder, Runtime};

use crate::config::RESPONSE_BYTES_MAX;
use crate::error::{ClusterError, Result};

thread_local! {
    /// Requests sent to etcd by calls made on this thread: what one call of a caller cost, for
    /// a client shared by threads (`requests_sent` counts them all).
    static REQUESTS_SENT_HERE: Cell<u64> = const { Cell::new(0) };
}

/// Requests sent by calls made on this thread so far, on any connection: the difference
/// across a call is that call's cost, whatever other threads sent meanwhile.
pub(crate) fn requests_sent_here() -> u64 {
    REQUESTS_SENT_HERE.with(Cell::get)
}

/// First pause between attempts after a transient error; doubles up to [`RETRY_PAUSE_MAX`].
pub(crate) const RETRY_PAUSE_FIRST: Duration = Duration::from_millis(20);
pub(crate) const RETRY_PAUSE_MAX: Duration = Duration::from_millis(250);
/// How long dropping a connection waits for its runtime's tasks to end.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(1);

/// The longest one attempt may take: a third of the request timeout, so that an attempt stuck
/// on a member that stalls leaves time for two more through the others.
pub(crate) fn attempt_timeout(request_timeout: Duration) -> Duration {
    request_timeout / 3
}

/// The clients of one etcd member: the key-value service (every read and write of records,
/// its answers bounded by [`RESPONSE_BYTES_MAX`]), the lease service, and the watch service
/// (the keep-alive's watch of the node's own member key: events of one small key).
#[derive(Clone)]
pub(crate) struct MemberClient {
    pub(crate) kv: KvClient,
    pub(crate) lease: LeaseClient,
    pub(crate) watch: WatchClient,
}

/// One client per etcd member and the member requests go to now. Shared with the keep-alive.
pub(crate) struct Members {
    clients: Vec<MemberClient>,
    preferred: AtomicUsize,
}

impl Members {
    /// The preferred member's index and clients.
    pub(crate) fn current(&self) -> (usize, MemberClient) {
        let index = self.preferred.load(Ordering::Relaxed) % self.clients.len();
        (index, self.clients[index].clone())
    }

    /// After a failed attempt on member `index`: prefer the next one, unless another caller
    /// already moved on from `index`.
    pub(crate) fn failed(&self, index: usize) {
        let next = (index + 1) % self.clients.len();
        let _ = self.preferred.compare_exchange(index, next, Ordering::Relaxed, Ordering::Relaxed);
    }
}

pub(crate) struct Connection {
    runtime: Option<Runtime>,
    members: Arc<Members>,
    request_timeout: Duration,
    /// Requests sent to etcd (every attempt, retries included): what a caller's operation cost.
    requests_sent: AtomicU64,
}

/// Whether an etcd error may go away by itself (a member down, a leader election, a broken
/// connection), so that the call is retried within its deadline. A retry after an answer that
/// was lost on the way back, or after an attempt that timed out, repeats a request etcd may
/// have applied or may still apply later (a member stalled on its disk holding the first). Reads
/// change nothing; a node's writes are fenced on its member key's mod revision
/// (`ClusterNode::guarded`), so an attempt applied after a later write of the node is refused
/// instead of undoing it (one that arrives before any later write is still applied). Two lease requests are not idempotent: a grant retried grants a second lease, and the first
/// is orphaned (it holds no key and expires after one TTL); a revoke retried gets NotFound, which
/// `ClusterNode` takes as done. The member transaction of a join recognises its own put (the key
/// under its own lease) on a retry.
pub(crate) fn is_transient(error: &etcd_client::Error) -> bool {
    use tonic::Code;
    match error {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(status) => {
            matches!(status.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Aborted | Code::Cancelled)
        }
        _ => false,
    }
}

/// Whether `error` is an answer larger than [`RESPONSE_BYTES_MAX`], refused by the client as
/// it decoded it (tonic's `OutOfRange`). etcd's own `OutOfRange` answers are for reads at a
/// compacted or future revision, which this crate never asks for. Not transient: the same read
/// gets the same answer; readers read less at a time instead (`scan.rs`).
pub(crate) fn is_too_large(error: &ClusterError) -> bool {
    matches!(error, ClusterError::Etcd { source: etcd_client::Error::GRpcStatus(status), .. } if status.code() == tonic::Code::OutOfRange)
}

impl Connection {
    /// Builds the runtime and one client per endpoint. Connecting is lazy (the first request
    /// connects), so this never waits on a member.
    pub(crate) fn open(endpoints: &[String], request_timeout: Duration) -> Result<Connection> {
        if endpoints.is_empty() {
            return Err(ClusterError::InvalidSetting("no etcd endpoint given".into()));
        }
        let runtime = Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tutti-cluster")
            .enable_all()
            .build()
            .map_err(ClusterError::Runtime)?;
        // require_leader: a member cut off from the quorum answers at once instead of holding
        // the request. The attempt bound is enforced in `call` (the gRPC timeout would only
        // repeat it).
        let options = ConnectOptions::new()
            .with_connect_timeout(attempt_timeout(request_timeout))
            .with_keep_alive(Duration::from_secs(1), request_timeout)
            .with_require_leader(true);
        let mut clients = Vec::with_capacity(endpoints.len());
        for endpoint in endpoints {
            // As etcd-client matches the scheme (`http://` in lower case; `HTTP://x` would become
            // `http://HTTP://x`): a config whose endpoints were set without `ClusterConfig::new`.
            let endpoint = &crate::config::normalize_endpoint(endpoint.clone());
            let connect = Client::connect([endpoint], Some(options.clone()));
            let client = runtime
                .block_on(async { tokio::time::timeout(request_timeout, connect).await })
                .map_err(|_| ClusterError::Unavailable {
                    operation: "connect",
                    waited: request_timeout,
                    last_error: format!("{endpoint}: timed out"),
                })?
                .map_err(|source| ClusterError::Etcd { operation: "connect", source })?;
            // The decode limit is set here, explicitly, for every key-value answer: the readers
            // size their reads to fit it (`ClusterConfig::validate`, `scan.rs`).
            let kv = client.kv_client().max_decoding_message_size(RESPONSE_BYTES_MAX);
            clients.push(MemberClient { kv, lease: client.lease_client(), watch: client.watch_client() });
        }
        let members = Arc::new(Members { clients, preferred: AtomicUsize::new(0) });
        Ok(Connection { runtime: Some(runtime), members, request_timeout, requests_sent: AtomicU64::new(0) })
    }

    pub(crate) fn requests_sent(&self) -> u64 {
        self.requests_sent.load(Ordering::Relaxed)
    }

    pub(crate) fn members(&self) -> Arc<Members> {
        self.members.clone()
    }

    pub(crate) fn runtime(&self) -> &Runtime {
        self.runtime.as_ref().expect("the runtime lives until drop")
    }

    /// A key-value request (`attempt` is one try of it on a member's client), bounded by the
    /// request timeout. See [`Connection::run`].
    pub(crate) fn call_kv<T, F, Fut>(&self, operation: &'static str, attempt: F) -> Result<T>
    where
        F: FnMut(KvClient) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        self.call_kv_by(operation, Instant::now() + self.request_timeout, attempt)
    }

    /// [`Connection::call_kv`] within `deadline` as well: one request of an operation of
    /// several, which share that deadline.
    pub(crate) fn call_kv_by<T, F, Fut>(&self, operation: &'static str, deadline: Instant, mut attempt: F) -> Result<T>
    where
        F: FnMut(KvClient) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        self.run(operation, deadline, |client| attempt(client.kv))
    }

    /// A lease request, bounded by the request timeout.
    pub(crate) fn call_lease<T, F, Fut>(&self, operation: &'static str, attempt: F) -> Result<T>
    where
        F: FnMut(LeaseClient) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        self.call_lease_by(operation, Instant::now() + self.request_timeout, attempt)
    }

    /// [`Connection::call_lease`] within `deadline` as well.
    pub(crate) fn call_lease_by<T, F, Fut>(&self, operation: &'static str, deadline: Instant, mut attempt: F) -> Result<T>
    where
        F: FnMut(LeaseClient) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        self.run(operation, deadline, |client| attempt(client.lease))
    }

    /// Runs `attempt` until it succeeds, fails for good, or the request timeout or `deadline`
    /// passes, whichever comes first (then [`ClusterError::Unavailable`]). Each attempt is one
    /// etcd request to the preferred member.
    fn run<T, F, Fut>(&self, operation: &'static str, deadline: Instant, mut attempt: F) -> Result<T>
    where
        F: FnMut(MemberClient) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let started = Instant::now();
        let deadline = deadline.min(started + self.request_timeout);
        let requests_sent = &self.requests_sent;
        // Counted here as well as on the connection: block_on runs the attempts on this thread,
        // but the count is added to the thread's own after it, not from inside the future.
        let sent_here = Cell::new(0u64);
        let sent_here_ref = &sent_here;
        let members = &self.members;
        let attempt_bound = attempt_timeout(self.request_timeout);
        let result = self.runtime().block_on(async move {
            let mut pause = RETRY_PAUSE_FIRST;
            let mut last_error = String::from("no attempt finished");
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ClusterError::Unavailable { operation, waited: started.elapsed(), last_error });
                }
                requests_sent.fetch_add(1, Ordering::Relaxed);
                sent_here_ref.set(sent_here_ref.get() + 1);
                let (member, client) = members.current();
                match tokio::time::timeout(left.min(attempt_bound), attempt(client)).await {
                    Ok(Ok(answer)) => return Ok(answer),
                    Ok(Err(error)) if is_transient(&error) => last_error = format!("member {member}: {error}"),
                    Ok(Err(source)) => return Err(ClusterError::Etcd { operation, source }),
                    Err(_) => last_error = format!("member {member}: the attempt timed out"),
                }
                members.failed(member);
                let left = deadline.saturating_duration_since(Instant::now());
                tokio::time::sleep(pause.min(left)).await;
                pause = (pause * 2).min(RETRY_PAUSE_MAX);
            }
        });
        REQUESTS_SENT_HERE.with(|count| count.set(count.get() + sent_here.get()));
        result
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(SHUTDOWN_WAIT);
        }
    }
}
