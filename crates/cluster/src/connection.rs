//! The synchronous facade over etcd's asynchronous client: a private tokio runtime (one worker
//! thread) runs the client and the lease keep-alive; callers block on one request at a time,
//! each bounded by the request timeout. Callers must not be tokio tasks themselves (tuttid's
//! threads are plain threads).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions};
use tokio::runtime::{Builder, Runtime};

use crate::error::{ClusterError, Result};

/// First pause between attempts after a transport error; doubles up to [`RETRY_PAUSE_MAX`].
pub(crate) const RETRY_PAUSE_FIRST: Duration = Duration::from_millis(20);
pub(crate) const RETRY_PAUSE_MAX: Duration = Duration::from_millis(250);
/// The longest one attempt may take: a third of the request timeout, so that an attempt stuck
/// on a member that died leaves time for two more through the others.
pub(crate) fn attempt_timeout(request_timeout: Duration) -> Duration {
    request_timeout / 3
}

/// How long dropping a connection waits for its runtime's tasks to end.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(1);

pub(crate) struct Connection {
    runtime: Option<Runtime>,
    client: Client,
    request_timeout: Duration,
    /// Requests sent to etcd (every attempt, retries included): what a caller's operation cost.
    requests_sent: AtomicU64,
}

/// Whether an etcd error may go away by itself (a member down, a leader election, a broken
/// connection), so that the call is retried within its deadline. Every operation of this crate
/// is idempotent (puts of the same record under the same lease, deletes, reads), so a retry after
/// an answer that was lost on the way back changes nothing.
fn is_transient(error: &etcd_client::Error) -> bool {
    use tonic::Code;
    match error {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(status) => {
            matches!(status.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Aborted | Code::Cancelled)
        }
        _ => false,
    }
}

impl Connection {
    /// Builds the runtime and the client. Connecting is lazy (the first request connects), so
    /// this never waits on a member.
    pub(crate) fn open(endpoints: &[String], request_timeout: Duration) -> Result<Connection> {
        if endpoints.is_empty() {
            return Err(ClusterError::InvalidSetting("no etcd endpoint given".into()));
        }
        let runtime = Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tutti-cluster")
            .enable_all()
            .build()
            .map_err(|source| ClusterError::LocalEtcd { context: "start the cluster runtime".into(), source })?;
        // require_leader: a member cut off from the quorum answers at once instead of holding
        // the request; the per-request gRPC timeout keeps each attempt inside the deadline.
        let options = ConnectOptions::new()
            .with_connect_timeout(request_timeout)
            .with_timeout(attempt_timeout(request_timeout))
            .with_keep_alive(Duration::from_secs(1), request_timeout)
            .with_require_leader(true);
        let connect = Client::connect(endpoints, Some(options));
        let client = runtime
            .block_on(async { tokio::time::timeout(request_timeout, connect).await })
            .map_err(|_| ClusterError::Unavailable { operation: "connect", waited: request_timeout, last_error: "timed out".into() })?
            .map_err(|source| ClusterError::Etcd { operation: "connect", source })?;
        Ok(Connection { runtime: Some(runtime), client, request_timeout, requests_sent: AtomicU64::new(0) })
    }

    pub(crate) fn requests_sent(&self) -> u64 {
        self.requests_sent.load(Ordering::Relaxed)
    }

    pub(crate) fn client(&self) -> Client {
        self.client.clone()
    }

    pub(crate) fn runtime(&self) -> &Runtime {
        self.runtime.as_ref().expect("the runtime lives until drop")
    }

    /// Runs `attempt` until it succeeds, fails for good, or the request timeout passes (then
    /// [`ClusterError::Unavailable`]). Each attempt is one etcd request.
    pub(crate) fn call<T, F, Fut>(&self, operation: &'static str, mut attempt: F) -> Result<T>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let started = Instant::now();
        let deadline = started + self.request_timeout;
        let requests_sent = &self.requests_sent;
        let client = &self.client;
        self.runtime().block_on(async move {
            let mut pause = RETRY_PAUSE_FIRST;
            let mut last_error = String::from("no attempt finished");
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ClusterError::Unavailable { operation, waited: started.elapsed(), last_error });
                }
                requests_sent.fetch_add(1, Ordering::Relaxed);
                match tokio::time::timeout(left.min(attempt_timeout(self.request_timeout)), attempt(client.clone())).await {
                    Ok(Ok(answer)) => return Ok(answer),
                    Ok(Err(error)) if is_transient(&error) => last_error = error.to_string(),
                    Ok(Err(source)) => return Err(ClusterError::Etcd { operation, source }),
                    Err(_) => last_error = "the attempt timed out".into(),
                }
                let left = deadline.saturating_duration_since(Instant::now());
                tokio::time::sleep(pause.min(left)).await;
                pause = (pause * 2).min(RETRY_PAUSE_MAX);
            }
        })
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(SHUTDOWN_WAIT);
        }
    }
}
