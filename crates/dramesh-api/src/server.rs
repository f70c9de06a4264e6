//! State shared by the gRPC and HTTP servers, and the bounded way both call the backend.
//!
//! Guarantees: every backend call runs on Tokio's blocking pool under a timeout, so a slow
//! estimate never stalls the network runtime; request bodies above
//! [`ApiConfig::max_request_bytes`] are refused before they are decoded.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dramesh_telemetry::spans::fields;

use crate::backend::{ApiError, Backend, ReplicaAnswer};
use crate::metrics::{Method, Metrics, ZeroReason};

/// Limits of the API servers.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Largest accepted request message (gRPC) or body (HTTP). Default 4 MiB.
    pub max_request_bytes: usize,
    /// Time limit of one native API call (EstimateAll, Place, Preempt, Status and the
    /// reservation calls). Default 10 s.
    pub request_timeout: Duration,
    /// Time limit of one Karmada estimator call; when it passes the answer is 0. Default
    /// 2.5 s, below karmada-scheduler's default `--scheduler-estimator-timeout` of 3 s, so a
    /// slow cluster gets 0 instead of failing the whole fan-out.
    pub karmada_timeout: Duration,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            max_request_bytes: 4 * 1024 * 1024,
            request_timeout: Duration::from_secs(10),
            karmada_timeout: Duration::from_millis(2500),
        }
    }
}

/// Everything the servers need. Cheap to clone.
#[derive(Clone)]
pub struct ApiState {
    /// What answers the questions.
    pub backend: Arc<dyn Backend>,
    /// The daemon's metric set, where requests are recorded.
    pub metrics: Arc<Metrics>,
    /// Limits and deadlines.
    pub config: ApiConfig,
    /// `GET /readyz` answers 200 once this is set (by the caller, e.g. after the first sync).
    pub ready: Arc<AtomicBool>,
}

impl ApiState {
    /// State with default limits, a fresh metric set and `ready` unset.
    pub fn new(backend: Arc<dyn Backend>) -> ApiState {
        ApiState {
            backend,
            metrics: Arc::new(Metrics::new()),
            config: ApiConfig::default(),
            ready: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The same state with `config`.
    pub fn with_config(mut self, config: ApiConfig) -> ApiState {
        self.config = config;
        self
    }

    /// Records into `metrics` (the daemon's one registry) instead of a private one.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> ApiState {
        self.metrics = metrics;
        self
    }

    /// Runs `f` on the calling (blocking-pool) thread inside an `alloc.search` span when the
    /// method searches allocations, recording the search time.
    fn searched<T>(
        metrics: &Metrics,
        method: Method,
        cluster: &str,
        f: impl FnOnce() -> T,
        outcome: impl FnOnce(&T) -> &'static str,
    ) -> T {
        if !method.searches_allocations() {
            return f();
        }
        let span = dramesh_telemetry::alloc_span(method.as_str(), cluster);
        let _entered = span.enter();
        let start = Instant::now();
        let out = f();
        metrics.observe_alloc_search(method.as_str(), start.elapsed());
        let o = outcome(&out);
        span.record(fields::OUTCOME, o);
        span.record(
            fields::OTEL_STATUS_CODE,
            if o == "error" { "error" } else { "ok" },
        );
        out
    }

    /// Whether `GET /readyz` answers 200.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Sets the ready flag.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    /// Runs a native API call on the blocking pool under `request_timeout`.
    pub(crate) async fn call_native<T, F>(&self, method: Method, f: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce(&dyn Backend) -> Result<T, ApiError> + Send + 'static,
    {
        let backend = self.backend.clone();
        let metrics = self.metrics.clone();
        let span = tracing::Span::current();
        let task = tokio::task::spawn_blocking(move || {
            let _parent = span.enter();
            Self::searched(
                &metrics,
                method,
                "*",
                || f(backend.as_ref()),
                |r| if r.is_ok() { "ok" } else { "error" },
            )
        });
        let out = match tokio::time::timeout(self.config.request_timeout, task).await {
            Ok(Ok(r)) => r,
            Ok(Err(join)) => Err(ApiError::Internal(format!(
                "{} computation panicked: {join}",
                method.as_str()
            ))),
            // The blocking task keeps running to completion; its result is dropped.
            Err(_) => Err(ApiError::Unavailable(format!(
                "{} did not finish within {:?}",
                method.as_str(),
                self.config.request_timeout
            ))),
        };
        if let Err(e) = &out {
            tracing::warn!(method = method.as_str(), error = %e, "request failed");
        }
        out
    }

    /// Runs a Karmada estimator call on the blocking pool under `karmada_timeout` and turns
    /// the answer into the number sent on the wire (0 for anything but a computed count).
    pub(crate) async fn call_karmada<F>(&self, method: Method, cluster: &str, f: F) -> i32
    where
        F: FnOnce(&dyn Backend) -> ReplicaAnswer + Send + 'static,
    {
        let backend = self.backend.clone();
        let metrics = self.metrics.clone();
        let span = tracing::Span::current();
        let c = cluster.to_owned();
        let task = tokio::task::spawn_blocking(move || {
            let _parent = span.enter();
            Self::searched(
                &metrics,
                method,
                &c,
                || f(backend.as_ref()),
                |a| match a {
                    ReplicaAnswer::Count(_) => "count",
                    ReplicaAnswer::Unknown { .. } => "unknown",
                    ReplicaAnswer::UnknownCluster => "unknown_cluster",
                    ReplicaAnswer::Stale { .. } => "stale_cluster",
                    ReplicaAnswer::Failed(_) => "error",
                },
            )
        });
        let answer = match tokio::time::timeout(self.config.karmada_timeout, task).await {
            Ok(Ok(a)) => a,
            Ok(Err(join)) => ReplicaAnswer::Failed(format!("computation panicked: {join}")),
            Err(_) => {
                self.zero(method, ZeroReason::Timeout);
                tracing::warn!(
                    method = method.as_str(),
                    cluster,
                    timeout = ?self.config.karmada_timeout,
                    "estimate timed out; answering 0"
                );
                return 0;
            }
        };
        match answer {
            ReplicaAnswer::Count(n) => {
                let n = i32::try_from(n.max(0)).unwrap_or(i32::MAX);
                tracing::debug!(method = method.as_str(), cluster, answer = n, "answered");
                n
            }
            ReplicaAnswer::Unknown { at_least, nodes } => {
                let n = i32::try_from(at_least.max(0)).unwrap_or(i32::MAX);
                if n == 0 {
                    self.zero(method, ZeroReason::BudgetExhausted);
                    tracing::warn!(
                        method = method.as_str(),
                        cluster,
                        nodes,
                        "allocation search gave up at its budget; answering 0 (unknown, not no-fit)"
                    );
                } else {
                    tracing::info!(
                        method = method.as_str(),
                        cluster,
                        nodes,
                        answer = n,
                        "allocation search gave up at its budget; answering the lower bound"
                    );
                }
                n
            }
            ReplicaAnswer::UnknownCluster => {
                self.zero(method, ZeroReason::UnknownCluster);
                tracing::warn!(
                    method = method.as_str(),
                    cluster,
                    "cluster is not in the view; answering 0"
                );
                0
            }
            ReplicaAnswer::Stale { age } => {
                self.zero(method, ZeroReason::StaleCluster);
                tracing::warn!(method = method.as_str(), cluster, age = ?age, "cluster data is stale; answering 0");
                0
            }
            ReplicaAnswer::Failed(why) => {
                self.zero(method, ZeroReason::BackendFailure);
                tracing::warn!(method = method.as_str(), cluster, error = %why, "estimate failed; answering 0");
                0
            }
        }
    }
}

impl ApiState {
    fn zero(&self, method: Method, why: ZeroReason) {
        self.metrics.zero_answer(method.as_str(), why.as_str());
    }
}

/// A server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The bind error.
        #[source]
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("gRPC server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// The HTTP server failed.
    #[error("HTTP server failed: {0}")]
    Http(#[source] std::io::Error),
}

pub(crate) async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, ServeError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// Sets TCP_NODELAY on an accepted API connection. Answers are small writes; with Nagle's
/// algorithm a reply can wait for the client's delayed ACK (about 40 ms) before it is sent.
fn no_delay(stream: &tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY on an accepted connection");
    }
}

/// `listener` for `axum::serve`, setting TCP_NODELAY on every accepted connection.
pub fn nodelay_listener(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = SocketAddr> {
    use axum::serve::ListenerExt;
    listener.tap_io(|s| no_delay(s))
}

/// Accepted connections of `listener` for tonic's `serve_with_incoming*`, with TCP_NODELAY
/// set (tonic's own `tcp_nodelay` applies only to listeners it binds itself).
pub(crate) fn nodelay_incoming(
    listener: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|r| r.inspect(no_delay))
}

#[cfg(test)]
mod accept_tests {
    use super::*;

    async fn pair() -> (tokio::net::TcpListener, SocketAddr) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        (l, a)
    }

    #[tokio::test]
    async fn grpc_accepts_set_nodelay() {
        use tokio_stream::StreamExt;
        let (l, a) = pair().await;
        let mut incoming = Box::pin(nodelay_incoming(l));
        let _client = tokio::net::TcpStream::connect(a).await.unwrap();
        let server = incoming.next().await.unwrap().unwrap();
        assert!(server.nodelay().unwrap());
    }

    #[tokio::test]
    async fn http_accepts_set_nodelay() {
        use axum::serve::Listener;
        let (l, a) = pair().await;
        let mut l = nodelay_listener(l);
        let _client = tokio::net::TcpStream::connect(a).await.unwrap();
        let (server, _) = l.accept().await;
        assert!(server.nodelay().unwrap());
    }
}
