//! `serve_bounded`: connection cap with idle eviction, header and idle timeouts, connection
//! metrics (issue 14 item 4); the separate cap and timeout of connections still in their
//! handshake (issue 32 item 2). TCP_NODELAY is checked by the module's unit test.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use dramesh_telemetry::{Handshake, HttpLimits, Metrics, serve_bounded_with};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

struct Server {
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn router() -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                "slow"
            }),
        )
}

async fn start(limits: HttpLimits) -> Server {
    start_with(limits, dramesh_telemetry::Plain).await
}

async fn start_with<H: Handshake>(limits: HttpLimits, handshake: H) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics = Arc::new(Metrics::new());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_bounded_with(
        listener,
        router(),
        handshake,
        "test",
        limits,
        metrics.clone(),
        async {
            let _ = rx.await;
        },
    ));
    Server {
        addr,
        metrics,
        _stop: tx,
    }
}

/// A handshake that waits for one byte `H` from the client (a stand-in for TLS: a client that
/// sends nothing never completes it).
#[derive(Clone)]
struct ByteFirst;

impl Handshake for ByteFirst {
    type Io = TcpStream;
    type Peer = ();
    async fn handshake(&self, mut stream: TcpStream) -> std::io::Result<(TcpStream, ())> {
        let mut b = [0u8; 1];
        stream.read_exact(&mut b).await?;
        if b[0] != b'H' {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "not H",
            ));
        }
        Ok((stream, ()))
    }
    fn failure_reason(&self, _: &std::io::Error) -> &'static str {
        "not_h"
    }
}

/// One `GET path` on a new connection; the status line's code.
async fn get_status(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    Ok(out.lines().next().unwrap_or_default().to_string())
}

/// Reads until the server closes; how long that took (`None`: still open after `limit`).
async fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match timeout(limit.saturating_sub(start.elapsed()), s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(start.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

fn closed(m: &Metrics, reason: &str) -> u64 {
    m.http_connections_closed_total.with(["test", reason]).get()
}

#[tokio::test]
async fn idle_connections_beyond_the_cap_do_not_lock_out_healthz() {
    let srv = start(HttpLimits {
        max_connections: 8,
        header_timeout: Duration::from_secs(60),
        ..HttpLimits::default()
    })
    .await;
    let mut idle = Vec::new();
    for _ in 0..40 {
        idle.push(TcpStream::connect(srv.addr).await.unwrap());
    }
    // Half-sent requests count as idle too.
    for s in idle.iter_mut().take(10) {
        s.write_all(b"GET /healthz HTTP/1.1\r\nHo").await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let status = timeout(Duration::from_secs(2), get_status(srv.addr, "/healthz"))
        .await
        .expect("/healthz answered within 2 s")
        .unwrap();
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(
        closed(&srv.metrics, "evicted_idle") >= 33,
        "{}",
        srv.metrics.render()
    );
    let open = srv.metrics.http_connections.with(["test"]).get();
    assert!(open <= 8.0, "open connections {open} above the cap");
}

#[tokio::test]
async fn a_new_connection_is_closed_at_once_when_every_connection_is_busy() {
    let srv = start(HttpLimits {
        max_connections: 2,
        header_timeout: Duration::from_secs(60),
        ..HttpLimits::default()
    })
    .await;
    let mut busy = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(srv.addr).await.unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        busy.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut extra = TcpStream::connect(srv.addr).await.unwrap();
    let took = closed_within(&mut extra, Duration::from_secs(1))
        .await
        .expect("the connection over the cap was closed within 1 s");
    assert!(took < Duration::from_secs(1));
    assert_eq!(closed(&srv.metrics, "refused_at_cap"), 1);
}

#[tokio::test]
async fn a_half_sent_request_is_closed_after_the_header_timeout() {
    let srv = start(HttpLimits {
        max_connections: 16,
        header_timeout: Duration::from_millis(400),
        ..HttpLimits::default()
    })
    .await;
    let mut s = TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        .await
        .unwrap();
    let took = closed_within(&mut s, Duration::from_secs(3))
        .await
        .expect("half-sent request still open after 3 s");
    assert!(
        took >= Duration::from_millis(300),
        "closed too early: {took:?}"
    );
    assert_eq!(closed(&srv.metrics, "header_timeout"), 1);
}

#[tokio::test]
async fn idle_keep_alive_connections_are_closed() {
    let srv = start(HttpLimits {
        max_connections: 16,
        header_timeout: Duration::from_millis(400),
        ..HttpLimits::default()
    })
    .await;
    let mut s = TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let n = s.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    closed_within(&mut s, Duration::from_secs(3))
        .await
        .expect("idle keep-alive connection still open after 3 s");
    // And a connection that never sends anything.
    let mut silent = TcpStream::connect(srv.addr).await.unwrap();
    closed_within(&mut silent, Duration::from_secs(3))
        .await
        .expect("silent connection still open after 3 s");
    // The gauge drops when the server's connection tasks end, just after the close is seen.
    let deadline = Instant::now() + Duration::from_secs(5);
    while srv.metrics.http_connections.with(["test"]).get() != 0.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(srv.metrics.http_connections.with(["test"]).get(), 0.0);
}

#[tokio::test]
async fn silent_sockets_in_their_handshake_do_not_lock_out_a_client_that_completes_it() {
    let srv = start_with(
        HttpLimits {
            max_connections: 8,
            max_handshakes: 4,
            ..HttpLimits::default()
        },
        ByteFirst,
    )
    .await;
    let mut silent = Vec::new();
    for _ in 0..40 {
        silent.push(TcpStream::connect(srv.addr).await.unwrap());
    }
    let mut s = TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(b"HGET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    timeout(Duration::from_secs(2), s.read_to_string(&mut out))
        .await
        .expect("answered within 2 s")
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(
        closed(&srv.metrics, "handshake_evicted") >= 36,
        "{}",
        srv.metrics.render()
    );
    assert_eq!(closed(&srv.metrics, "evicted_idle"), 0);
}

#[tokio::test]
async fn handshakes_are_bounded_in_time_and_failures_counted_by_reason() {
    let srv = start_with(
        HttpLimits {
            handshake_timeout: Duration::from_millis(300),
            ..HttpLimits::default()
        },
        ByteFirst,
    )
    .await;
    let mut silent = TcpStream::connect(srv.addr).await.unwrap();
    closed_within(&mut silent, Duration::from_secs(3))
        .await
        .expect("a socket silent in its handshake is closed");
    let mut wrong = TcpStream::connect(srv.addr).await.unwrap();
    wrong.write_all(b"X").await.unwrap();
    closed_within(&mut wrong, Duration::from_secs(3))
        .await
        .expect("a failed handshake closes the connection");
    let failures = |reason: &str| {
        srv.metrics
            .tls_handshake_failures_total
            .with(["test", reason])
            .get()
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!((failures("timeout"), failures("not_h")), (1, 1));
    assert_eq!(closed(&srv.metrics, "handshake_failed"), 2);
}
