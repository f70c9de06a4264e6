//! State shared by the gRPC and HTTP servers, and the bounded way both call the backend.
//!
//! Guarantees: every backend call runs on Tokio's blocking pool under a timeout, so a slow
//! estimate never stalls the network runtime, and at most [`ApiConfig::max_workers`] of them
//! at once ([`ApiState::run_blocking`]); request bodies above
//! [`ApiConfig::max_request_bytes`] are refused before they are decoded; every request is
//! charged its expected memory against the admission budget before it is parsed
//! ([`crate::admission`]), and the charge is held by the worker until its work ends. A worker
//! stops at its deadline, and as soon as its caller stops waiting (the request was dropped:
//! the client went away, or the answer was sent), see [`crate::deadline`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dramesh_telemetry::conns::{Activity, Admitted, ConnTable, Slot};
use dramesh_telemetry::spans::fields;

use crate::admission::{Budget, BudgetLimits, Charge};

use crate::auth::{Auth, Caller, Credentials, Verb};
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
    /// TLS of both listeners; `None` serves plaintext (the daemon allows that only when asked
    /// explicitly).
    pub tls: Option<crate::tls::ApiTls>,
    /// The admission budget shared by both listeners ([`crate::admission`]).
    pub budget: BudgetLimits,
    /// Blocking-pool threads the API's computations may hold at once, both listeners
    /// together ([`ApiState::run_blocking`]). Default: the CPUs available to the process, at
    /// least 2 (so a status call is not queued behind one long estimate on one CPU).
    pub max_workers: usize,
}

/// The CPUs available to the process (its cgroup's quota included), at least 2.
fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().max(2))
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            max_request_bytes: 4 * 1024 * 1024,
            request_timeout: Duration::from_secs(10),
            karmada_timeout: Duration::from_millis(2500),
            http: dramesh_telemetry::HttpLimits::default(),
            grpc: GrpcLimits::default(),
            tls: None,
            budget: BudgetLimits::default(),
            max_workers: default_workers(),
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
    /// Who may call what.
    pub auth: Arc<Auth>,
    /// The admission budget, built from `config.budget` and `metrics`.
    pub budget: Arc<Budget>,
    /// Places for computations on the blocking pool, `config.max_workers` of them
    /// ([`ApiState::run_blocking`]; rebuilt by [`ApiState::with_config`]).
    pub workers: Arc<tokio::sync::Semaphore>,
}

/// The semaphore behind [`ApiState::run_blocking`].
fn workers(config: &ApiConfig) -> Arc<tokio::sync::Semaphore> {
    Arc::new(tokio::sync::Semaphore::new(config.max_workers.max(1)))
}

impl ApiState {
    /// State with default limits, a fresh metric set and `ready` unset.
    pub fn new(backend: Arc<dyn Backend>) -> ApiState {
        let metrics = Arc::new(Metrics::new());
        let config = ApiConfig::default();
        ApiState {
            backend,
            budget: Budget::new(config.budget, metrics.clone()),
            workers: workers(&config),
            metrics,
            config,
            ready: Arc::new(AtomicBool::new(false)),
            auth: Arc::new(Auth::default()),
        }
    }

    /// The same state with `auth` (the default lets authenticated callers read, nobody write).
    pub fn with_auth(mut self, auth: impl Into<Arc<Auth>>) -> ApiState {
        self.auth = auth.into();
        self
    }

    /// Authenticates and authorizes a call for `verb`, counting and logging a refusal.
    pub(crate) async fn caller(
        &self,
        creds: &Credentials<'_>,
        verb: Verb,
        method: Method,
    ) -> Result<Caller, ApiError> {
        self.auth
            .check(
                &self.metrics,
                creds,
                verb,
                &format!("call {}", method.as_str()),
            )
            .await
    }

    /// Counts and logs a refusal the backend made (ownership, caps).
    pub(crate) fn note_refusal<T>(&self, r: Result<T, ApiError>) -> Result<T, ApiError> {
        match r {
            Err(ApiError::Refused(refusal)) => Err(self.auth.refused(&self.metrics, refusal)),
            other => other,
        }
    }

    /// The same state with `config`.
    pub fn with_config(mut self, config: ApiConfig) -> ApiState {
        self.config = config;
        self.budget = Budget::new(self.config.budget, self.metrics.clone());
        self.workers = workers(&self.config);
        self
    }

    /// Runs `f` on Tokio's blocking pool once one of the [`ApiConfig::max_workers`] places
    /// is free; `f` holds its place until it returns, not until its caller stops waiting,
    /// so at most that many computations run whatever the callers do. Callers past them wait
    /// here, in their request's time limit, holding no thread: the blocking pool grows a
    /// thread per computation running at once (up to 512), and each thread keeps what its
    /// allocator heap grew to for as long as it lives, which with work arriving every few
    /// seconds is for ever (64 Karmada calls in flight left a replica at +200-310 MiB;
    /// docs/performance.md, "Replica memory"). Every computation a client can start goes
    /// through here: the backend calls of both listeners and the replica's HTTP routes.
    pub async fn run_blocking<T, F>(&self, f: F) -> Result<T, tokio::task::JoinError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        // The semaphore is never closed: `None` cannot happen, and would only mean no limit.
        let place = self.workers.clone().acquire_owned().await.ok();
        tokio::task::spawn_blocking(move || {
            let _place = place;
            f()
        })
        .await
    }

    /// Records into `metrics` (the daemon's one registry) instead of a private one.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> ApiState {
        self.metrics = metrics;
        self.budget = Budget::new(self.config.budget, self.metrics.clone());
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

    /// Runs a native API call on the blocking pool under `request_timeout`; `charge` (the
    /// request's admission charge) is released when the computation ends.
    pub(crate) async fn call_native<T, F>(
        &self,
        method: Method,
        charge: Option<Charge>,
        f: F,
    ) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce(&dyn Backend) -> Result<T, ApiError> + Send + 'static,
    {
        let backend = self.backend.clone();
        let metrics = self.metrics.clone();
        let span = tracing::Span::current();
        let deadline = std::time::Instant::now() + self.config.request_timeout;
        let (stop, _stop_when_dropped) = crate::deadline::Stop::new();
        // Waiting for a place counts against the time limit.
        let task = self.run_blocking(move || {
            let _parent = span.enter();
            crate::admission::scoped_charge(charge, || {
                crate::deadline::scoped_until(deadline, stop, || {
                    Self::searched(
                        &metrics,
                        method,
                        "*",
                        || f(backend.as_ref()),
                        |r| if r.is_ok() { "ok" } else { "error" },
                    )
                })
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
        // Refusals are logged by `auth::Refusals`, at most once a minute per identity and
        // reason, so a flood of them cannot flood the log.
        if let Err(e) = &out
            && !matches!(e, ApiError::Refused(_))
        {
            tracing::warn!(method = method.as_str(), error = %e, "request failed");
        }
        out
    }

    /// Runs a Karmada estimator call on the blocking pool under `karmada_timeout` and turns
    /// the answer into the number sent on the wire (0 for anything but a computed count);
    /// `charge` is released when the computation ends.
    pub(crate) async fn call_karmada<F>(
        &self,
        method: Method,
        cluster: &str,
        charge: Option<Charge>,
        f: F,
    ) -> i32
    where
        F: FnOnce(&dyn Backend) -> ReplicaAnswer + Send + 'static,
    {
        let backend = self.backend.clone();
        let metrics = self.metrics.clone();
        let span = tracing::Span::current();
        let c = cluster.to_owned();
        let deadline = std::time::Instant::now() + self.config.karmada_timeout;
        let (stop, _stop_when_dropped) = crate::deadline::Stop::new();
        // Waiting for a place counts against the time limit.
        let task = self.run_blocking(move || {
            let _parent = span.enter();
            crate::admission::scoped_charge(charge, || {
                crate::deadline::scoped_until(deadline, stop, || {
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
    /// Open connections past their TLS handshake at most. A connection that completes its
    /// handshake at the cap closes the one idle the longest (no call in flight; connections
    /// without a verified client certificate first); when every connection has a call in
    /// flight it is closed itself. Both are counted in
    /// `dramesh_http_connections_closed_total{listener="grpc"}` (refusals also in
    /// `dramesh_grpc_connections_refused_total`). gRPC clients such as karmada-scheduler keep
    /// one long-lived connection per server, so this is a cap on clients, not on calls.
    /// Default 512.
    pub max_connections: usize,
    /// Connections in their TLS handshake at most, apart from `max_connections`: at this cap
    /// the oldest handshake is closed (`handshake_evicted`), those that have sent nothing yet
    /// first, so clients that open sockets and send nothing only push each other out, never a
    /// client that is handshaking. Default 64.
    pub max_handshakes: usize,
    /// Time from the accept to the end of the TLS handshake. Default 5 s.
    pub handshake_timeout: Duration,
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
            max_handshakes: 64,
            handshake_timeout: Duration::from_secs(5),
            preface_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
        }
    }
}

/// The gRPC listener's name in connection and handshake metrics (`listener` label).
pub const GRPC_LISTENER: &str = "grpc";

/// The HTTP/2 client preface every gRPC connection starts with, in bytes.
const H2_PREFACE_LEN: u64 = 24;

/// The stream of an accepted gRPC connection.
enum GrpcIo {
    Plain(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>),
}

/// What tonic puts into the extensions of every request of a connection
/// (`Request::extensions().get::<GrpcConnInfo>()`).
#[derive(Debug, Clone, Default)]
pub struct GrpcConnInfo {
    /// The peer's address.
    pub remote: Option<SocketAddr>,
    /// The identity of its verified client certificate, if any.
    pub certificate: crate::tls::PeerCert,
    /// Whether a call is in flight on the connection (marked by [`crate::grpc::GrpcGate`]).
    pub(crate) activity: Option<Arc<Activity>>,
}

/// An accepted gRPC connection: holds its place under the cap while open, fails reads and
/// writes once it was evicted to make room, and fails reads when the HTTP/2 preface has not
/// arrived within the preface timeout of the accept.
pub(crate) struct GrpcConn {
    io: GrpcIo,
    info: GrpcConnInfo,
    _slot: Slot,
    evicted: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    metrics: Arc<Metrics>,
    preface_left: u64,
    preface_deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl Drop for GrpcConn {
    fn drop(&mut self) {
        self.metrics.grpc_connections.dec();
    }
}

impl GrpcConn {
    /// An error once the connection was told to close (evicted to make room).
    fn poll_evicted(&mut self, cx: &mut std::task::Context<'_>) -> Option<std::io::Error> {
        self.evicted.as_mut().poll(cx).is_ready().then(|| {
            std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "closed to make room for a new connection at the connection cap",
            )
        })
    }
}

macro_rules! io_call {
    ($self:expr, $io:ident => $e:expr) => {
        match &mut $self.io {
            GrpcIo::Plain($io) => $e,
            GrpcIo::Tls($io) => $e,
        }
    };
}

impl tokio::io::AsyncRead for GrpcConn {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let this = &mut *self;
        if let Some(e) = this.poll_evicted(cx) {
            return Poll::Ready(Err(e));
        }
        if this.preface_left > 0 && this.preface_deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no HTTP/2 preface within the preface timeout",
            )));
        }
        let before = buf.filled().len();
        let r = io_call!(this, io => std::pin::Pin::new(io).poll_read(cx, buf));
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
        if let Some(e) = self.poll_evicted(cx) {
            return std::task::Poll::Ready(Err(e));
        }
        io_call!(self, io => std::pin::Pin::new(io).poll_write(cx, buf))
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        io_call!(self, io => std::pin::Pin::new(io).poll_flush(cx))
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        io_call!(self, io => std::pin::Pin::new(io).poll_shutdown(cx))
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if let Some(e) = self.poll_evicted(cx) {
            return std::task::Poll::Ready(Err(e));
        }
        io_call!(self, io => std::pin::Pin::new(io).poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            GrpcIo::Plain(io) => io.is_write_vectored(),
            GrpcIo::Tls(io) => io.is_write_vectored(),
        }
    }
}

impl tonic::transport::server::Connected for GrpcConn {
    type ConnectInfo = GrpcConnInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

/// Accepted connections of a listener for tonic's `serve_with_incoming*`: TCP_NODELAY set
/// (tonic's own `tcp_nodelay` applies only to listeners it binds itself), the two connection
/// tables of [`dramesh_telemetry::conns`] (handshakes apart, bounded by
/// `limits.max_handshakes` and `limits.handshake_timeout`; then `limits.max_connections` with
/// the longest-idle connection evicted at the cap), each connection bound by the preface
/// timeout from its accept. Handshakes run in their own tasks, so a slow one never delays the
/// accept of others; failed ones are counted by reason and logged once per peer address per
/// minute. Accept errors are logged and retried after 50 ms, so a persistent one (no
/// descriptors left) neither spins nor stops the server. The accept task ends, closing the
/// listener, when tonic drops this stream.
pub(crate) struct GrpcIncoming {
    rx: tokio::sync::mpsc::Receiver<std::io::Result<GrpcConn>>,
}

impl GrpcIncoming {
    pub(crate) fn new(
        listener: tokio::net::TcpListener,
        limits: GrpcLimits,
        metrics: Arc<Metrics>,
        tls: Option<crate::tls::ApiTls>,
    ) -> GrpcIncoming {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(accept_grpc(listener, limits, metrics, tls, tx));
        GrpcIncoming { rx }
    }
}

/// Everything an accepted connection needs to become a [`GrpcConn`].
#[derive(Clone)]
struct Accepting {
    conns: Arc<ConnTable>,
    limits: GrpcLimits,
    metrics: Arc<Metrics>,
}

impl Accepting {
    /// Takes a place in the main table for a connection past its handshake, or `None` (counted)
    /// when every connection has a call in flight.
    fn conn(
        &self,
        io: GrpcIo,
        remote: SocketAddr,
        certificate: crate::tls::PeerCert,
        accepted: tokio::time::Instant,
    ) -> Option<GrpcConn> {
        let closed = |reason| self.metrics.http_connection_closed(GRPC_LISTENER, reason);
        let Some((slot, how)) = self.conns.admit() else {
            closed("refused_at_cap");
            self.metrics.grpc_connections_refused_total.inc();
            tracing::debug!(
                %remote,
                max = self.limits.max_connections,
                "gRPC connection refused: every connection has a call in flight"
            );
            return None;
        };
        if how == Admitted::Evicted {
            closed("evicted_idle");
        }
        if certificate.0.is_some() {
            slot.activity.set_trusted();
        }
        let activity = slot.activity.clone();
        let watched = activity.clone();
        self.metrics.grpc_connections.inc();
        Some(GrpcConn {
            io,
            info: GrpcConnInfo {
                remote: Some(remote),
                certificate,
                activity: Some(activity),
            },
            _slot: slot,
            evicted: Box::pin(async move { watched.closed().await }),
            metrics: self.metrics.clone(),
            preface_left: H2_PREFACE_LEN,
            preface_deadline: Box::pin(tokio::time::sleep_until(
                accepted + self.limits.preface_timeout,
            )),
        })
    }
}

async fn accept_grpc(
    listener: tokio::net::TcpListener,
    limits: GrpcLimits,
    metrics: Arc<Metrics>,
    tls: Option<crate::tls::ApiTls>,
    tx: tokio::sync::mpsc::Sender<std::io::Result<GrpcConn>>,
) {
    let accepting = Accepting {
        conns: ConnTable::new(limits.max_connections),
        limits,
        metrics: metrics.clone(),
    };
    let handshakes = ConnTable::new(limits.max_handshakes);
    let failures = Arc::new(dramesh_telemetry::HandshakeFailures::new(
        GRPC_LISTENER,
        metrics.clone(),
    ));
    let acceptor = tls.as_ref().map(crate::tls::ApiTls::grpc_acceptor);
    loop {
        let (stream, remote) = tokio::select! {
            () = tx.closed() => return,
            r = listener.accept() => match r {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "gRPC accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        dramesh_telemetry::http::no_delay(&stream);
        let accepted = tokio::time::Instant::now();
        let Some(acceptor) = &acceptor else {
            if let Some(conn) =
                accepting.conn(GrpcIo::Plain(stream), remote, Default::default(), accepted)
                && tx.send(Ok(conn)).await.is_err()
            {
                return;
            }
            continue;
        };
        let Some((stream, shaking)) =
            dramesh_telemetry::conns::start_handshake(&handshakes, stream, GRPC_LISTENER, &metrics)
        else {
            continue;
        };
        let acceptor = acceptor.clone();
        let tx = tx.clone();
        let accepting = accepting.clone();
        let failures = failures.clone();
        tokio::spawn(async move {
            let deadline = accepted + limits.handshake_timeout;
            // A connection that has sent something (its ClientHello) is evicted only after
            // the silent ones.
            let shaking_activity = shaking.activity.clone();
            let accept = async move {
                let _ = stream.readable().await;
                shaking_activity.set_trusted();
                acceptor.accept(stream).await
            };
            let shaken = tokio::select! {
                r = tokio::time::timeout_at(deadline, accept) => r,
                // Pushed out by newer handshakes (counted above).
                () = shaking.activity.closed() => return,
            };
            drop(shaking);
            let closed = || {
                accepting
                    .metrics
                    .http_connection_closed(GRPC_LISTENER, "handshake_failed")
            };
            match shaken {
                Ok(Ok(s)) => {
                    let peer = crate::tls::PeerCert::of(s.get_ref().1);
                    if let Some(conn) =
                        accepting.conn(GrpcIo::Tls(Box::new(s)), remote, peer, accepted)
                    {
                        let _ = tx.send(Ok(conn)).await;
                    }
                }
                Ok(Err(e)) => {
                    failures.record(remote, crate::tls::handshake_failure_reason(&e), &e);
                    closed();
                }
                Err(_) => {
                    failures.record(
                        remote,
                        "timeout",
                        &format_args!("no TLS handshake within {:?}", limits.handshake_timeout),
                    );
                    closed();
                }
            }
        });
        // Let the handshakes just spawned see their first bytes before more accepts of a
        // burst push them out.
        tokio::task::yield_now().await;
    }
}

impl tokio_stream::Stream for GrpcIncoming {
    type Item = std::io::Result<GrpcConn>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}
