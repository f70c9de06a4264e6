//! Every HTTP listener of a daemon (the replica's API, the agent's and any `/metrics`
//! endpoint), served with bounds, plus the `GET /metrics` route.
//!
//! [`serve_bounded`] guarantees, per listener:
//! * at most [`HttpLimits::max_connections`] open connections. When a new connection arrives at
//!   the cap, the connection idle the longest (no request being answered: waiting for its next
//!   request or still sending headers) is closed to make room, so idle or slow clients can
//!   never lock out `/healthz`; when every connection is answering a request, the new one is
//!   closed at once. Both are counted in `dramesh_http_connections_closed_total`;
//! * a request's headers must be complete within [`HttpLimits::header_timeout`] of the accept
//!   or of the end of the previous response, which also closes idle keep-alive connections;
//! * with [`serve_bounded_with`], a handshake (TLS) per connection within
//!   [`HttpLimits::header_timeout`] of the accept, off the accept loop, its result (the peer's
//!   identity) in every request's extensions;
//! * TCP_NODELAY on every accepted socket (answers are small writes that Nagle plus the
//!   client's delayed ACK would hold about 40 ms);
//! * at shutdown, accepting stops, idle connections close at once and the others after their
//!   answer.
//!
//! The `/metrics` route renders the registry on every scrape (no caching, so values are never
//! stale) and answers with [`crate::CONTENT_TYPE`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{Notify, watch};

use crate::metrics::Metrics;
use crate::registry::CONTENT_TYPE;

/// The scrape path.
pub const METRICS_PATH: &str = "/metrics";

/// Bounds of one HTTP listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Open connections at most (see the module doc for what happens at the cap). Default 512.
    pub max_connections: usize,
    /// Time to complete a request's headers after the accept or the previous response; also
    /// how long an idle keep-alive connection stays open. Default 10 s.
    pub header_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 512,
            header_timeout: Duration::from_secs(10),
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
pub fn no_delay(stream: &tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY on an accepted connection");
    }
}

/// One open connection as the accept loop sees it.
struct Slot {
    /// Requests being answered on it.
    busy: Arc<AtomicUsize>,
    /// Tells its task to close it.
    close: Arc<Notify>,
    /// When it last started waiting for a request (accept or end of an answer).
    idle_since: Arc<Mutex<Instant>>,
}

/// Counts a request as being answered while alive, and restarts the idle clock when dropped.
struct Busy {
    busy: Arc<AtomicUsize>,
    idle_since: Arc<Mutex<Instant>>,
}

impl Busy {
    fn enter(busy: &Arc<AtomicUsize>, idle_since: &Arc<Mutex<Instant>>) -> Busy {
        busy.fetch_add(1, Ordering::AcqRel);
        Busy {
            busy: busy.clone(),
            idle_since: idle_since.clone(),
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Ok(mut t) = self.idle_since.lock() {
            *t = Instant::now();
        }
        self.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Open connections of one listener, by accept number.
#[derive(Default)]
struct Slots(Mutex<BTreeMap<u64, Slot>>);

impl Slots {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Slot>> {
        // A panic while holding this lock leaves a map that is still consistent.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes room for one more connection under `max`: `Ok(None)` when there is room,
    /// `Ok(Some(id))` after telling the longest-idle connection `id` to close, `Err(())` when
    /// every connection is answering a request.
    fn make_room(&self, max: usize) -> Result<Option<u64>, ()> {
        let mut slots = self.lock();
        if slots.len() < max {
            return Ok(None);
        }
        let idle = slots
            .iter()
            .filter(|(_, s)| s.busy.load(Ordering::Acquire) == 0)
            .min_by_key(|(_, s)| {
                s.idle_since
                    .lock()
                    .map(|t| *t)
                    .unwrap_or_else(|_| Instant::now())
            })
            .map(|(id, _)| *id);
        match idle {
            Some(id) => {
                if let Some(s) = slots.remove(&id) {
                    s.close.notify_one();
                }
                Ok(Some(id))
            }
            None => Err(()),
        }
    }
}

/// What a listener does with an accepted socket before HTTP starts on it: nothing
/// ([`Plain`]), or a TLS handshake. Whatever it learns about the peer (e.g. the identity in a
/// client certificate) is put into the extensions of every request of the connection.
pub trait Handshake: Clone + Send + Sync + 'static {
    /// The stream HTTP runs over.
    type Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static;
    /// What requests of the connection carry in their extensions.
    type Peer: Clone + Send + Sync + 'static;
    /// Turns an accepted socket into the stream HTTP runs over. [`serve_bounded_with`] bounds
    /// it by [`HttpLimits::header_timeout`].
    fn handshake(
        &self,
        stream: tokio::net::TcpStream,
    ) -> impl Future<Output = std::io::Result<(Self::Io, Self::Peer)>> + Send;
}

/// Plain TCP: no handshake; requests carry `()`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Plain;

impl Handshake for Plain {
    type Io = tokio::net::TcpStream;
    type Peer = ();
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

/// [`serve_bounded`] with `handshake` run on every accepted socket first (e.g. TLS). The
/// handshake must finish within [`HttpLimits::header_timeout`] of the accept (the connection
/// counts as idle meanwhile, so it is the first evicted at the cap); a failed or late one is
/// counted as `handshake_failed` in `dramesh_http_connections_closed_total`.
pub async fn serve_bounded_with<H: Handshake>(
    listener: tokio::net::TcpListener,
    router: Router,
    handshake: H,
    name: &'static str,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(Slots::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    let mut next_id = 0u64;
    let max = limits.max_connections.max(1);
    let mut shutdown = std::pin::pin!(shutdown);
    let open = metrics.http_connections.with([name]);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
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
        match slots.make_room(max) {
            Ok(None) => {}
            Ok(Some(_)) => metrics.http_connection_closed(name, "evicted_idle"),
            Err(()) => {
                metrics.http_connection_closed(name, "refused_at_cap");
                tracing::debug!(listener = name, %peer, max, "connection refused: every connection is busy");
                drop(stream);
                continue;
            }
        }
        no_delay(&stream);
        let id = next_id;
        next_id += 1;
        let slot = Slot {
            busy: Arc::new(AtomicUsize::new(0)),
            close: Arc::new(Notify::new()),
            idle_since: Arc::new(Mutex::new(Instant::now())),
        };
        let (busy, close, idle_since) = (
            slot.busy.clone(),
            slot.close.clone(),
            slot.idle_since.clone(),
        );
        slots.lock().insert(id, slot);
        open.inc();
        let handshake = handshake.clone();
        let router = router.clone();
        let slots = slots.clone();
        let metrics = metrics.clone();
        let open = open.clone();
        let mut stop = stop_rx.clone();
        conns.spawn(async move {
            let shaken = tokio::select! {
                r = tokio::time::timeout(limits.header_timeout, handshake.handshake(stream)) => match r {
                    Ok(Ok(s)) => Ok(s),
                    Ok(Err(e)) => {
                        tracing::debug!(listener = name, %peer, error = %e, "handshake failed");
                        Err(true)
                    }
                    Err(_) => {
                        tracing::debug!(listener = name, %peer, "handshake timed out");
                        Err(true)
                    }
                },
                // Evicted (already counted) or stopping.
                () = close.notified() => Err(false),
                _ = stop.wait_for(|v| *v) => Err(false),
            };
            let (stream, peer_info) = match shaken {
                Ok(s) => s,
                Err(failed) => {
                    if failed {
                        metrics.http_connection_closed(name, "handshake_failed");
                    }
                    slots.lock().remove(&id);
                    open.dec();
                    return;
                }
            };
            let inner = hyper_util::service::TowerToHyperService::new(router);
            let svc = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(peer_info.clone());
                let guard = Busy::enter(&busy, &idle_since);
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
                () = close.notified() => true,
                _ = stop.wait_for(|v| *v) => true,
            };
            if closing {
                // Idle connections close at once; one answering a request finishes it first.
                conn.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(limits.header_timeout, conn).await;
            }
            slots.lock().remove(&id);
            open.dec();
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
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
