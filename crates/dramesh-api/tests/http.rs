//! The HTTP/JSON server over the demo table backend, spoken to with raw HTTP/1.1.

mod common;

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
