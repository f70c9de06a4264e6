//! Serves `/metrics` over real HTTP on loopback and scrapes it with a plain TCP client.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use dramesh_telemetry::metrics::names;
use dramesh_telemetry::{Direction, Metrics, serve_metrics};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(20);

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

async fn get(addr: std::net::SocketAddr, path: &str) -> Response {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("header/body separator");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let mut parts = status_line.splitn(3, ' ');
    assert_eq!(parts.next(), Some("HTTP/1.1"), "{status_line}");
    let status = parts.next().unwrap().parse().unwrap();
    let headers = lines
        .map(|l| {
            let (k, v) = l.split_once(':').expect("header colon");
            (k.trim().to_owned(), v.trim().to_owned())
        })
        .collect();
    Response {
        status,
        headers,
        body: body.to_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_is_scrapeable() {
    let metrics = Arc::new(Metrics::new());
    metrics.observe_api_request(
        "karmada-estimator",
        "MaxAvailableReplicas",
        "OK",
        Duration::from_millis(3),
    );
    metrics.add_mesh_bytes("replica-b", Direction::Received, 512);
    metrics.set_reservations(3, 0, 1);

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_metrics(
        listener,
        metrics.clone(),
        Default::default(),
        async {
            let _ = stop_rx.await;
        },
    ));

    let resp = timeout(LIMIT, get(addr, "/metrics"))
        .await
        .expect("scrape timed out");
    assert_eq!(resp.status, 200);
    let ct = resp.header("content-type").expect("content-type");
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    let len: usize = resp
        .header("content-length")
        .expect("content-length")
        .parse()
        .unwrap();
    assert_eq!(len, resp.body.len());

    let exp = common::parse(&resp.body).unwrap_or_else(|e| panic!("{e}\n{}", resp.body));
    common::check_histograms(&exp).unwrap();
    assert_eq!(
        exp.value(
            names::API_REQUESTS_TOTAL,
            &[
                ("api", "karmada-estimator"),
                ("method", "MaxAvailableReplicas"),
                ("code", "OK")
            ]
        ),
        Some(1.0)
    );
    assert_eq!(
        exp.value(
            names::MESH_BYTES_TOTAL,
            &[("peer", "replica-b"), ("direction", "received")]
        ),
        Some(512.0)
    );
    assert_eq!(
        exp.value(names::RESERVATIONS, &[("state", "live")]),
        Some(3.0)
    );
    for name in names::ALL.iter().copied() {
        assert!(exp.types.contains_key(name), "{name} missing from scrape");
    }

    // A second scrape sees values recorded after the first: rendering is per request.
    metrics.add_mesh_bytes("replica-b", Direction::Received, 8);
    let resp = timeout(LIMIT, get(addr, "/metrics"))
        .await
        .expect("scrape timed out");
    let exp = common::parse(&resp.body).unwrap();
    assert_eq!(
        exp.value(
            names::MESH_BYTES_TOTAL,
            &[("peer", "replica-b"), ("direction", "received")]
        ),
        Some(520.0)
    );

    let resp = timeout(LIMIT, get(addr, "/nope"))
        .await
        .expect("request timed out");
    assert_eq!(resp.status, 404);

    stop_tx.send(()).unwrap();
    timeout(LIMIT, server)
        .await
        .expect("server did not stop")
        .unwrap()
        .unwrap();
}
