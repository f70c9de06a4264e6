//! The HTTP/JSON server over the demo table backend, spoken to with raw HTTP/1.1.

use crate::common;

use common::*;
use dramesh_api::ApiConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Sends one request and returns (status, body).
async fn call(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.expect("write head");
    if let Some(b) = body {
        // A server may refuse an oversized body before reading it all; that is fine.
        let _ = s.write_all(b).await;
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test]
async fn health_and_readiness() {
    let srv = start_http(demo_state()).await;
    assert_eq!(
        call(srv.addr, "GET", "/healthz", None).await,
        (200, "ok".into())
    );
    let (code, body) = call(srv.addr, "GET", "/readyz", None).await;
    assert_eq!((code, body.as_str()), (503, "not ready"));
    srv.state.set_ready(true);
    let (code, body) = call(srv.addr, "GET", "/readyz", None).await;
    assert_eq!((code, body.as_str()), (200, "ready"));
    srv.stop().await;
}

#[tokio::test]
async fn estimate_place_preempt_and_status_as_json() {
    let srv = start_http(demo_state()).await;
    let deploy = serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": 10, "template": {"spec": {"containers": [
            {"name": "c", "image": "x", "resources": {"requests": {"cpu": "500m"}}}
        ]}}}
    });
    let body = serde_json::json!({"workload": {"manifests": [deploy]}}).to_string();
    let (code, text) = call(srv.addr, "POST", "/v1/estimate", Some(body.as_bytes())).await;
    assert_eq!(code, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["total"], 8);
    let member2 = v["clusters"]
        .as_array()
        .expect("clusters")
        .iter()
        .find(|c| c["name"] == "member-2")
        .cloned();
    assert_eq!(member2.expect("member-2")["maxReplicas"], 8);

    let (code, text) = call(srv.addr, "POST", "/v1/place", Some(body.as_bytes())).await;
    assert_eq!(code, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(
        v["clusters"],
        serde_json::json!([{"name": "member-2", "replicas": 8}])
    );
    assert_eq!(v["unschedulable"], "2 of 10 replicas do not fit");

    let (code, text) = call(srv.addr, "POST", "/v1/preempt", Some(body.as_bytes())).await;
    assert_eq!(code, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert!(v.get("fitsWithoutPreemption").is_none());
    assert_eq!(v["reason"], "no cluster fits and there is nothing to evict");

    let (code, text) = call(srv.addr, "GET", "/v1/status", None).await;
    assert_eq!(code, 200);
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["replica"], "fake-estimator");
    assert_eq!(v["ready"], false);
    assert_eq!(v["clusters"][0]["devices"][0]["class"], "gpu.example.com");

    let (code, text) = call(srv.addr, "GET", "/metrics", None).await;
    assert_eq!(code, 200);
    assert!(
        text.contains(
            "dramesh_api_requests_total{api=\"http\",method=\"/v1/estimate\",code=\"200\"} 1\n"
        ),
        "{text}"
    );
    srv.stop().await;
}

#[tokio::test]
async fn bad_json_and_backend_errors_are_reported_as_json() {
    let srv = start_http(demo_state()).await;
    let (code, text) = call(srv.addr, "POST", "/v1/estimate", Some(b"{not json")).await;
    assert_eq!(code, 400);
    let v: serde_json::Value = serde_json::from_str(&text).expect("json error body");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("EstimateAll")),
        "{text}"
    );

    let body = serde_json::json!({"workload": {"manifests": []}}).to_string();
    let (code, text) = call(srv.addr, "POST", "/v1/estimate", Some(body.as_bytes())).await;
    assert_eq!(code, 400);
    assert!(
        text.contains("no Deployment, StatefulSet, Job or Pod"),
        "{text}"
    );
    srv.stop().await;
}

#[tokio::test]
async fn unknown_body_fields_are_refused_by_name() {
    let srv = start_http(common::open(dramesh_api::ApiState::new(
        std::sync::Arc::new(ReservingBackend::new()),
    )))
    .await;
    let w = serde_json::json!({"manifests": ["kind: Deployment\n"]});
    for (path, body, field) in [
        (
            "/v1/estimate",
            serde_json::json!({"workload": w, "cluster": "a"}),
            "cluster",
        ),
        (
            "/v1/place",
            serde_json::json!({"workload": w, "replica": 2}),
            "replica",
        ),
        (
            "/v1/preempt",
            serde_json::json!({"workload": w, "clustres": []}),
            "clustres",
        ),
        (
            "/v1/reservations",
            serde_json::json!({"workload": w, "cluster": "member-2", "ttl_seconds": 60}),
            "ttl_seconds",
        ),
        (
            "/v1/estimate",
            serde_json::json!({"workload": {"manifests": [], "manifest": "x"}}),
            "manifest",
        ),
    ] {
        let (code, text) = call(srv.addr, "POST", path, Some(body.to_string().as_bytes())).await;
        assert_eq!(code, 400, "{path}: {text}");
        assert!(
            text.contains(&format!("unknown field `{field}`")),
            "{path}: {text}"
        );
    }
    srv.stop().await;
}

#[tokio::test]
async fn oversized_bodies_are_refused() {
    let state = demo_state().with_config(ApiConfig {
        max_request_bytes: 16 * 1024,
        ..ApiConfig::default()
    });
    let srv = start_http(state).await;
    let big = format!(
        "{{\"workload\": {{\"manifests\": [\"{}\"]}}}}",
        "x".repeat(64 * 1024)
    );
    let (code, _) = call(srv.addr, "POST", "/v1/estimate", Some(big.as_bytes())).await;
    assert_eq!(code, 413);
    // Still serving.
    assert_eq!(call(srv.addr, "GET", "/healthz", None).await.0, 200);
    srv.stop().await;
}

#[tokio::test]
async fn reservation_routes_create_list_get_and_release() {
    let srv = start_http(common::open(dramesh_api::ApiState::new(
        std::sync::Arc::new(ReservingBackend::new()),
    )))
    .await;
    let body = serde_json::json!({
        "workload": {"manifests": ["kind: Deployment\n"]},
        "cluster": "member-2", "replicas": 2, "priority": 5, "ttlSeconds": 60,
    })
    .to_string();
    let (code, text) = call(srv.addr, "POST", "/v1/reservations", Some(body.as_bytes())).await;
    assert_eq!(code, 201, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["id"], "fake-estimator-1");
    assert_eq!(v["status"], "live");
    assert_eq!(
        (v["priority"].as_i64(), v["ttlSeconds"].as_u64()),
        (Some(5), Some(60))
    );

    let (code, text) = call(srv.addr, "GET", "/v1/reservations", None).await;
    assert_eq!(code, 200, "{text}");
    let list: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(list["reservations"], serde_json::json!([v]));
    let (code, text) = call(srv.addr, "GET", "/v1/reservations/fake-estimator-1", None).await;
    assert_eq!(
        (code, serde_json::from_str::<serde_json::Value>(&text).ok()),
        (200, Some(v))
    );

    let (code, text) = call(
        srv.addr,
        "DELETE",
        "/v1/reservations/fake-estimator-1",
        None,
    )
    .await;
    assert_eq!(code, 200, "{text}");
    assert!(text.contains("\"status\":\"released\""), "{text}");
    let (code, text) = call(srv.addr, "GET", "/v1/reservations/nope", None).await;
    assert_eq!(code, 404, "{text}");
    let (code, text) = call(srv.addr, "POST", "/v1/reservations", Some(b"{")).await;
    assert_eq!(code, 400);
    assert!(text.contains("Reserve request body"), "{text}");

    let (_, metrics) = call(srv.addr, "GET", "/metrics", None).await;
    assert!(
        metrics.contains(
            "dramesh_api_requests_total{api=\"http\",method=\"/v1/reservations/{id}\",code=\"404\"} 1\n"
        ),
        "{metrics}"
    );
    srv.stop().await;
}

/// A backend whose estimate runs until the call's deadline passes (like a long search that
/// checks it), then reports when it stopped.
struct Slow {
    table: dramesh_api::table::TableBackend,
    stopped: std::sync::mpsc::SyncSender<(Option<std::time::Instant>, std::time::Instant)>,
}

impl dramesh_api::Backend for Slow {
    fn max_available_replicas(
        &self,
        q: &dramesh_api::query::ReplicaQuery,
    ) -> dramesh_api::ReplicaAnswer {
        self.table.max_available_replicas(q)
    }
    fn max_available_component_sets(
        &self,
        q: &dramesh_api::query::ComponentSetQuery,
    ) -> dramesh_api::ReplicaAnswer {
        self.table.max_available_component_sets(q)
    }
    fn unschedulable_replicas(
        &self,
        q: &dramesh_api::query::UnschedulableQuery,
    ) -> dramesh_api::ReplicaAnswer {
        self.table.unschedulable_replicas(q)
    }
    fn estimate_all(
        &self,
        _: &dramesh_api::native::EstimateRequest,
    ) -> Result<dramesh_api::native::EstimateResponse, dramesh_api::ApiError> {
        let deadline = dramesh_api::deadline::current();
        let give_up = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while deadline.is_none_or(|d| std::time::Instant::now() < d)
            && std::time::Instant::now() < give_up
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Finishing the unit of work in hand (a node) takes a moment past the deadline.
        std::thread::sleep(std::time::Duration::from_millis(100));
        let _ = self.stopped.send((deadline, std::time::Instant::now()));
        Err(dramesh_api::ApiError::Unavailable("stopped".into()))
    }
    fn place(
        &self,
        r: &dramesh_api::native::PlaceRequest,
    ) -> Result<dramesh_api::native::PlaceResponse, dramesh_api::ApiError> {
        self.table.place(r)
    }
    fn preempt(
        &self,
        r: &dramesh_api::native::PreemptRequest,
    ) -> Result<dramesh_api::native::PreemptResponse, dramesh_api::ApiError> {
        self.table.preempt(r)
    }
    fn status(&self) -> dramesh_api::native::StatusReport {
        self.table.status()
    }
}

#[tokio::test]
async fn a_computation_past_its_deadline_is_told_to_stop() {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let backend = Slow {
        table: dramesh_api::table::demo_table(),
        stopped: tx,
    };
    let timeout = std::time::Duration::from_millis(300);
    let state =
        open(dramesh_api::ApiState::new(std::sync::Arc::new(backend))).with_config(ApiConfig {
            request_timeout: timeout,
            ..ApiConfig::default()
        });
    let srv = start_http(state).await;
    let start = std::time::Instant::now();
    let (code, body) = call(
        srv.addr,
        "POST",
        "/v1/estimate",
        Some(br#"{"workload":{"manifests":["apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c, image: x}]}\n"]}}"#),
    )
    .await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("did not finish"), "{body}");
    let (deadline, stopped) = tokio::task::spawn_blocking(move || {
        rx.recv_timeout(std::time::Duration::from_secs(5))
            .expect("the worker stopped")
    })
    .await
    .expect("join");
    let deadline = deadline.expect("the backend call saw its deadline");
    assert!(deadline <= start + timeout + std::time::Duration::from_millis(50));
    assert!(
        stopped.duration_since(start) < timeout + std::time::Duration::from_secs(1),
        "the worker ran {:?} past a {timeout:?} timeout",
        stopped.duration_since(start)
    );
    srv.stop().await;
}

#[tokio::test]
async fn a_trickled_body_gets_408_at_the_header_timeout_and_a_large_one_413() {
    let state = demo_state().with_config(ApiConfig {
        max_request_bytes: 16 * 1024,
        http: dramesh_telemetry::HttpLimits {
            header_timeout: std::time::Duration::from_millis(300),
            ..Default::default()
        },
        ..ApiConfig::default()
    });
    let srv = start_http(state).await;
    let mut s = tokio::net::TcpStream::connect(srv.addr)
        .await
        .expect("connect");
    s.write_all(
        b"POST /v1/estimate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"workload\"",
    )
    .await
    .expect("write");
    let start = std::time::Instant::now();
    let mut out = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .expect("the server answered and closed");
    assert!(read.is_ok());
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("did not arrive within"), "{text}");
    assert!(start.elapsed() < std::time::Duration::from_secs(2));

    // A body over the limit sent in chunks (no Content-Length to refuse up front) is 413.
    let mut s = tokio::net::TcpStream::connect(srv.addr)
        .await
        .expect("connect");
    s.write_all(b"POST /v1/estimate HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        .await
        .expect("head");
    let chunk = "x".repeat(8 * 1024);
    for _ in 0..3 {
        let _ = s
            .write_all(format!("{:x}\r\n{chunk}\r\n", chunk.len()).as_bytes())
            .await;
    }
    let _ = s.write_all(b"0\r\n\r\n").await;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    srv.stop().await;
}
