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
    /// Bounds of the HTTP listener (connections, header and idle timeout).
    pub http: dramesh_telemetry::HttpLimits,
    /// Bounds of the gRPC listener (connections, preface timeout, keepalive).
    pub grpc: GrpcLimits,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            max_request_bytes: 4 * 1024 * 1024,
            request_timeout: Duration::from_secs(10),
            karmada_timeout: Duration::from_millis(2500),
            http: dramesh_telemetry::HttpLimits::default(),
            grpc: GrpcLimits::default(),
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
        let deadline = std::time::Instant::now() + self.config.request_timeout;
        let task = tokio::task::spawn_blocking(move || {
            let _parent = span.enter();
            crate::deadline::scoped(deadline, || {
                Self::searched(
                    &metrics,
                    method,
                    "*",
                    || f(backend.as_ref()),
                    |r| if r.is_ok() { "ok" } else { "error" },
                )
            })
        });
        let out = match tokio::time::timeout(self.config.request_timeout, task).await {
            Ok(Ok(r)) => r,
            Ok(Err(join)) => Err(ApiError::Internal(format!(
                "{} computation panicked: {join}",
                method.as_str()
            ))),
            // The computation stops at the deadline by itself ([`crate::deadline`]).
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
        let deadline = std::time::Instant::now() + self.config.karmada_timeout;
        let task = tokio::task::spawn_blocking(move || {
            let _parent = span.enter();
            crate::deadline::scoped(deadline, || {
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
            })
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

/// The HTTP listener's name in connection metrics (`listener` label).
pub const HTTP_API_LISTENER: &str = "api";

pub(crate) async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, ServeError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// Bounds of the gRPC listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcLimits {
    /// Open connections at most; a connection accepted beyond it is closed at once (and
    /// counted in `dramesh_grpc_connections_refused_total`). gRPC clients such as
    /// karmada-scheduler keep one long-lived connection per server, so this is a cap on
    /// clients, not on calls. Default 512.
    pub max_connections: usize,
    /// A new connection must send the HTTP/2 preface within this time, or it is closed.
    /// Default 10 s.
    pub preface_timeout: Duration,
    /// HTTP/2 PING interval on an open connection; a peer that does not answer within
    /// [`GrpcLimits::keepalive_timeout`] is disconnected. Default 30 s.
    pub keepalive_interval: Duration,
    /// See [`GrpcLimits::keepalive_interval`]. Default 10 s.
    pub keepalive_timeout: Duration,
}

impl Default for GrpcLimits {
    fn default() -> Self {
        GrpcLimits {
            max_connections: 512,
            preface_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
        }
    }
}

/// The HTTP/2 client preface every gRPC connection starts with, in bytes.
const H2_PREFACE_LEN: u64 = 24;

/// An accepted gRPC connection: holds its place under the cap while open, and fails reads
/// when the HTTP/2 preface has not arrived within the preface timeout.
pub(crate) struct GrpcConn {
    io: tokio::net::TcpStream,
    _permit: tokio::sync::OwnedSemaphorePermit,
    metrics: Arc<Metrics>,
    preface_left: u64,
    preface_deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl Drop for GrpcConn {
    fn drop(&mut self) {
        self.metrics.grpc_connections.dec();
    }
}

impl tokio::io::AsyncRead for GrpcConn {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let this = &mut *self;
        if this.preface_left > 0 && this.preface_deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no HTTP/2 preface within the preface timeout",
            )));
        }
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &r {
            let n = (buf.filled().len() - before) as u64;
            this.preface_left = this.preface_left.saturating_sub(n);
        }
        r
    }
}

impl tokio::io::AsyncWrite for GrpcConn {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for GrpcConn {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Accepted connections of a listener for tonic's `serve_with_incoming*`: TCP_NODELAY set
/// (tonic's own `tcp_nodelay` applies only to listeners it binds itself), at most
/// `limits.max_connections` open, each bound by the preface timeout. Accept errors are logged
/// and retried after 50 ms, so a persistent one (no descriptors left) neither spins nor stops
/// the server.
pub(crate) struct GrpcIncoming {
    listener: tokio::net::TcpListener,
    limits: GrpcLimits,
    slots: Arc<tokio::sync::Semaphore>,
    metrics: Arc<Metrics>,
    backoff: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl GrpcIncoming {
    pub(crate) fn new(
        listener: tokio::net::TcpListener,
        limits: GrpcLimits,
        metrics: Arc<Metrics>,
    ) -> GrpcIncoming {
        GrpcIncoming {
            listener,
            slots: Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1))),
            limits,
            metrics,
            backoff: None,
        }
    }
}

impl tokio_stream::Stream for GrpcIncoming {
    type Item = std::io::Result<GrpcConn>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            if let Some(b) = &mut this.backoff {
                if b.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.backoff = None;
            }
            let stream = match this.listener.poll_accept(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok((s, _))) => s,
                Poll::Ready(Err(e)) => {
                    tracing::warn!(error = %e, "gRPC accept failed");
                    this.backoff = Some(Box::pin(tokio::time::sleep(Duration::from_millis(50))));
                    continue;
                }
            };
            let Ok(permit) = this.slots.clone().try_acquire_owned() else {
                this.metrics.grpc_connections_refused_total.inc();
                tracing::debug!(
                    max = this.limits.max_connections,
                    "gRPC connection refused: connection cap reached"
                );
                continue;
            };
            dramesh_telemetry::http::no_delay(&stream);
            this.metrics.grpc_connections.inc();
            return Poll::Ready(Some(Ok(GrpcConn {
                io: stream,
                _permit: permit,
                metrics: this.metrics.clone(),
                preface_left: H2_PREFACE_LEN,
                preface_deadline: Box::pin(tokio::time::sleep(this.limits.preface_timeout)),
            })));
        }
    }
}
