//! Every HTTP listener of a daemon (the replica's API, the agent's and any `/metrics`
//! endpoint), served with bounds, plus the `GET /metrics` route.
//!
//! [`serve_bounded`] guarantees, per listener:
//! * at most [`HttpLimits::max_connections`] open connections past their handshake. When a
//!   connection completes its handshake at the cap, the connection idle the longest (no
//!   request being answered: waiting for its next request or still sending headers; those
//!   without a verified client identity first) is closed to make room, so idle or slow
//!   clients can never lock out `/healthz`; when every connection is answering a request, the
//!   new one is closed at once. Both are counted in `dramesh_http_connections_closed_total`
//!   (the table and its rules: [`crate::conns`]);
//! * at most [`HttpLimits::max_handshakes`] connections in their handshake, apart from the
//!   above: at that cap the oldest handshake is closed (`handshake_evicted`), those that have
//!   sent nothing yet first, so clients that open sockets and send nothing only push each
//!   other out, never a client that is handshaking. A handshake must finish within
//!   [`HttpLimits::handshake_timeout`]; failures are counted by reason in
//!   `dramesh_tls_handshake_failures_total{listener,reason}` and logged once per peer address
//!   per minute;
//! * a request's headers must be complete within [`HttpLimits::header_timeout`] of the accept
//!   or of the end of the previous response, which also closes idle keep-alive connections;
//! * with [`serve_bounded_with`], a handshake (TLS) per connection, off the accept loop, its
//!   result (the peer's identity) in every request's extensions;
//! * TCP_NODELAY on every accepted socket (answers are small writes that Nagle plus the
//!   client's delayed ACK would hold about 40 ms);
//! * at shutdown, accepting stops, idle connections close at once and the others after their
//!   answer.
//!
//! The `/metrics` route renders the registry on every scrape (no caching, so values are never
//! stale) and answers with [`crate::CONTENT_TYPE`].

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::watch;

use crate::conns::{Admitted, ConnTable};
use crate::metrics::Metrics;
use crate::registry::CONTENT_TYPE;
use crate::throttle::{EVERY_MINUTE, Throttle};

/// The scrape path.
pub const METRICS_PATH: &str = "/metrics";

/// Bounds of one HTTP listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Open connections at most (see the module doc for what happens at the cap). Default 512.
    pub max_connections: usize,
    /// Time to complete a request's headers after the handshake or the previous response;
    /// also how long an idle keep-alive connection stays open. Default 10 s.
    pub header_timeout: Duration,
    /// Connections in their handshake at most, apart from `max_connections` (see the module
    /// doc). Default 64.
    pub max_handshakes: usize,
    /// Time from the accept to the end of the handshake. Default 5 s.
    pub handshake_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 512,
            header_timeout: Duration::from_secs(10),
            max_handshakes: 64,
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

/// A router with only `GET /metrics`.
pub fn metrics_router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route(METRICS_PATH, get(scrape))
        .with_state(metrics)
}

async fn scrape(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], metrics.render())
}

/// Serves [`metrics_router`] on `listener` with `limits` until `shutdown` resolves.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_bounded(
        listener,
        metrics_router(metrics.clone()),
        "metrics",
        limits,
        metrics,
        shutdown,
    )
    .await
}

/// Sets TCP_NODELAY on an accepted connection (see the module doc for why).
pub use crate::conns::no_delay;

/// What a listener does with an accepted socket before HTTP starts on it: nothing
/// ([`Plain`]), or a TLS handshake. Whatever it learns about the peer (e.g. the identity in a
/// client certificate) is put into the extensions of every request of the connection.
pub trait Handshake: Clone + Send + Sync + 'static {
    /// The stream HTTP runs over.
    type Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static;
    /// What requests of the connection carry in their extensions.
    type Peer: Clone + Send + Sync + 'static;
    /// Turns an accepted socket into the stream HTTP runs over. [`serve_bounded_with`] bounds
    /// it by [`HttpLimits::handshake_timeout`].
    fn handshake(
        &self,
        stream: tokio::net::TcpStream,
    ) -> impl Future<Output = std::io::Result<(Self::Io, Self::Peer)>> + Send;

    /// The `reason` label of a failed handshake (a small fixed set, e.g. `unknown_ca`).
    fn failure_reason(&self, e: &std::io::Error) -> &'static str {
        let _ = e;
        "io_error"
    }

    /// Whether the handshake starts with the client's bytes (TLS: its ClientHello). The
    /// listener then waits for them before starting it, and a connection that sent them is
    /// pushed out of the handshake table only after silent ones. [`Plain`] has no handshake.
    const CLIENT_SPEAKS_FIRST: bool = true;

    /// Whether the peer proved a verified identity (its connection is evicted last at the cap).
    fn trusted(peer: &Self::Peer) -> bool {
        let _ = peer;
        false
    }
}

/// Failed handshakes of a listener: counted by reason and logged once per peer address per
/// minute (also used by the gRPC listener, which has its own accept loop).
pub struct HandshakeFailures {
    listener: &'static str,
    metrics: Arc<Metrics>,
    log: Throttle<IpAddr>,
}

impl HandshakeFailures {
    /// Failures of listener `listener`, recorded into `metrics`.
    pub fn new(listener: &'static str, metrics: Arc<Metrics>) -> HandshakeFailures {
        HandshakeFailures {
            listener,
            metrics,
            log: Throttle::new(EVERY_MINUTE, 4096),
        }
    }

    /// Records that `peer`'s handshake failed for `reason` (`detail` says more, in the log).
    pub fn record(&self, peer: SocketAddr, reason: &'static str, detail: &dyn std::fmt::Display) {
        self.metrics.tls_handshake_failure(self.listener, reason);
        if self.log.allow(&peer.ip()) {
            tracing::warn!(listener = self.listener, %peer, reason, error = %detail, "TLS handshake failed (logged at most once a minute per peer address)");
        }
    }
}

/// Plain TCP: no handshake; requests carry `()`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Plain;

impl Handshake for Plain {
    type Io = tokio::net::TcpStream;
    type Peer = ();
    const CLIENT_SPEAKS_FIRST: bool = false;
    async fn handshake(
        &self,
        stream: tokio::net::TcpStream,
    ) -> std::io::Result<(tokio::net::TcpStream, ())> {
        Ok((stream, ()))
    }
}

/// Serves `router` over HTTP/1.1 on `listener` with `limits` until `shutdown` resolves;
/// `name` labels this listener's connection metrics in `metrics`. See the module doc.
pub async fn serve_bounded(
    listener: tokio::net::TcpListener,
    router: Router,
    name: &'static str,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_bounded_with(listener, router, Plain, name, limits, metrics, shutdown).await
}

/// [`serve_bounded`] with `handshake` run on every accepted socket first (e.g. TLS), under the
/// handshake bounds of the module doc; a failed or late one is counted as `handshake_failed`
/// in `dramesh_http_connections_closed_total` and by reason in
/// `dramesh_tls_handshake_failures_total`.
pub async fn serve_bounded_with<H: Handshake>(
    listener: tokio::net::TcpListener,
    router: Router,
    handshake: H,
    name: &'static str,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let conns = ConnTable::new(limits.max_connections);
    let handshakes = ConnTable::new(limits.max_handshakes);
    let failures = Arc::new(HandshakeFailures::new(name, metrics.clone()));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let open = metrics.http_connections.with([name]);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            r = listener.accept() => match r {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: keep serving,
                    // without spinning on a condition that persists.
                    tracing::warn!(listener = name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some((stream, shaking)) =
            crate::conns::start_handshake(&handshakes, stream, name, &metrics)
        else {
            continue;
        };
        open.inc();
        let handshake = handshake.clone();
        let router = router.clone();
        let conns = conns.clone();
        let failures = failures.clone();
        let metrics = metrics.clone();
        let open = open.clone();
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            // A connection that has sent something is evicted only after the silent ones.
            let shaking_activity = shaking.activity.clone();
            let shake = async {
                if H::CLIENT_SPEAKS_FIRST {
                    let _ = stream.readable().await;
                    shaking_activity.set_trusted();
                }
                handshake.handshake(stream).await
            };
            let shaken = tokio::select! {
                r = tokio::time::timeout(limits.handshake_timeout, shake) => match r {
                    Ok(Ok(s)) => Some(s),
                    Ok(Err(e)) => {
                        failures.record(peer, handshake.failure_reason(&e), &e);
                        metrics.http_connection_closed(name, "handshake_failed");
                        None
                    }
                    Err(_) => {
                        failures.record(peer, "timeout", &format_args!("no handshake within {:?}", limits.handshake_timeout));
                        metrics.http_connection_closed(name, "handshake_failed");
                        None
                    }
                },
                // Pushed out by newer handshakes (already counted) or stopping.
                () = shaking.activity.closed() => None,
                _ = stop.wait_for(|v| *v) => None,
            };
            drop(shaking);
            let Some((stream, peer_info)) = shaken else {
                open.dec();
                return;
            };
            let slot = match conns.admit() {
                Some((slot, how)) => {
                    if how == Admitted::Evicted {
                        metrics.http_connection_closed(name, "evicted_idle");
                    }
                    slot
                }
                None => {
                    metrics.http_connection_closed(name, "refused_at_cap");
                    tracing::debug!(listener = name, %peer, "connection refused: every connection is busy");
                    open.dec();
                    return;
                }
            };
            if H::trusted(&peer_info) {
                slot.activity.set_trusted();
            }
            let activity = slot.activity.clone();
            let inner = hyper_util::service::TowerToHyperService::new(router);
            let svc = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(peer_info.clone());
                let guard = activity.enter();
                let fut = hyper::service::Service::call(&inner, req);
                async move {
                    let r = fut.await;
                    drop(guard);
                    r
                }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .keep_alive(true);
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            let mut conn = std::pin::pin!(conn);
            let closing = tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        if e.is_timeout() {
                            metrics.http_connection_closed(name, "header_timeout");
                        }
                        tracing::debug!(listener = name, %peer, error = %e, "connection ended");
                    }
                    false
                }
                () = slot.activity.closed() => true,
                _ = stop.wait_for(|v| *v) => true,
            };
            if closing {
                // Idle connections close at once; one answering a request finishes it first.
                conn.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(limits.header_timeout, conn).await;
            }
            drop(slot);
            open.dec();
        });
        // Let the handshakes just spawned see their first bytes before more accepts of a
        // burst push them out.
        tokio::task::yield_now().await;
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn accepted_sockets_get_nodelay() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _client = tokio::net::TcpStream::connect(l.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = l.accept().await.unwrap();
        assert!(!server.nodelay().unwrap());
        no_delay(&server);
        assert!(server.nodelay().unwrap());
    }
}
