//! Observability of a running replica: `dramesh demo --serve` exporting spans to an in-process
//! OTLP/gRPC collector (a tonic `TraceService` on loopback), with `/metrics` scraped after real
//! Karmada gRPC and native HTTP requests.
//!
//! Checks that the scrape holds every metric of the dramesh set with the series the requests
//! and the demo's replication must have produced (per API method, per demo cluster, per peer),
//! and that the collector received `api.request`, `alloc.search` and `mesh.sync` spans from the
//! replicas, the allocation search nested in its request's trace.

use crate::common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Demo, WORKLOAD, demo_clusters, http, karmada_client};
use dramesh_api::proto::karmada as kpb;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;

#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<ExportTraceServiceRequest>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Parsed exposition: sample name -> [(labels, value)].
type Samples = BTreeMap<String, Vec<(BTreeMap<String, String>, f64)>>;

/// A small parser for the text format (label values here have no escaped quotes).
fn parse_metrics(text: &str) -> Samples {
    let mut out: Samples = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad sample line {line:?}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|e| panic!("value of {line:?}: {e}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((n, rest)) => {
                let body = rest.strip_suffix('}').expect("closing brace");
                let labels = body
                    .split("\",")
                    .filter(|kv| !kv.is_empty())
                    .map(|kv| {
                        let (k, v) = kv.split_once("=\"").expect("label k=\"v\"");
                        (k.to_string(), v.trim_end_matches('"').to_string())
                    })
                    .collect();
                (n.to_string(), labels)
            }
        };
        out.entry(name).or_default().push((labels, value));
    }
    out
}

fn value(s: &Samples, name: &str, want: &[(&str, &str)]) -> Option<f64> {
    s.get(name)?
        .iter()
        .find(|(l, _)| {
            want.iter()
                .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, v)| *v)
}

fn label_values(s: &Samples, name: &str, label: &str) -> Vec<String> {
    s.get(name)
        .map(|v| {
            v.iter()
                .filter_map(|(l, _)| l.get(label).cloned())
                .collect()
        })
        .unwrap_or_default()
}

fn str_attr<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| match &v.value {
            Some(AnyValue::StringValue(s)) => Some(s.as_str()),
            _ => None,
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_otlp_spans_of_a_running_replica() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("collector port");
    let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
    let collector = Collector::default();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                async {
                    let _ = stop_rx.await;
                },
            ),
    );

    // The flag is the documented way; the environment variable must not be needed.
    let mut demo = tokio::task::spawn_blocking(move || {
        Demo::start(&["--otlp-endpoint", &endpoint], &[("RUST_LOG", "warn")])
    })
    .await
    .expect("demo start");
    let r1 = demo.replicas[0].clone();

    // A Karmada question over gRPC and a native estimate over HTTP.
    let mut karmada = karmada_client(r1.grpc).await;
    let answer = karmada
        .max_available_replicas(kpb::MaxAvailableReplicasRequest {
            cluster: "no-such-cluster".into(),
            ..Default::default()
        })
        .await
        .expect("unknown clusters are answered, not refused");
    assert_eq!(answer.into_inner().max_replicas, 0);
    let body = serde_json::json!({"workload": {"manifests": [WORKLOAD]}}).to_string();
    let addr = r1.http;
    let (code, est) =
        tokio::task::spawn_blocking(move || http(addr, "POST", "/v1/estimate", Some(&body)))
            .await
            .expect("estimate");
    assert_eq!(code, 200, "{est}");

    let (code, text) = tokio::task::spawn_blocking(move || http(addr, "GET", "/metrics", None))
        .await
        .expect("scrape");
    assert_eq!(code, 200, "{text}");
    let m = parse_metrics(&text);

    // Requests and latency per API and method.
    let karmada_mar = [("api", "karmada"), ("method", "MaxAvailableReplicas")];
    assert_eq!(
        value(
            &m,
            "dramesh_api_requests_total",
            &[karmada_mar[0], karmada_mar[1], ("code", "OK")]
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(
            &m,
            "dramesh_api_request_duration_seconds_count",
            &karmada_mar
        ),
        Some(1.0)
    );
    assert_eq!(
        value(
            &m,
            "dramesh_api_zero_answers_total",
            &[
                ("method", "MaxAvailableReplicas"),
                ("reason", "unknown_cluster")
            ]
        ),
        Some(1.0)
    );
    let http_est = [("api", "http"), ("method", "/v1/estimate")];
    assert_eq!(
        value(
            &m,
            "dramesh_api_requests_total",
            &[http_est[0], http_est[1], ("code", "200")]
        ),
        Some(1.0)
    );
    assert_eq!(
        value(&m, "dramesh_api_request_duration_seconds_count", &http_est),
        Some(1.0)
    );
    assert_eq!(
        value(
            &m,
            "dramesh_api_request_duration_seconds_bucket",
            &[http_est[0], http_est[1], ("le", "+Inf")]
        ),
        Some(1.0)
    );
    assert!(
        value(
            &m,
            "dramesh_alloc_search_duration_seconds_count",
            &[("method", "EstimateAll")]
        ) == Some(1.0),
        "{text}"
    );

    // Replication: per peer and cluster, per cluster, refusals.
    let clusters = demo_clusters();
    let lag_clusters = label_values(&m, "dramesh_mesh_sync_lag_seconds", "cluster");
    let age_clusters = label_values(&m, "dramesh_view_data_age_seconds", "cluster");
    let stored = label_values(&m, "dramesh_store_bytes", "cluster");
    for c in &clusters {
        assert!(lag_clusters.contains(c), "sync lag for {c}:\n{text}");
        assert!(age_clusters.contains(c), "data age for {c}:\n{text}");
        assert!(stored.contains(c), "store size for {c}:\n{text}");
        assert!(
            value(&m, "dramesh_store_bytes", &[("cluster", c)]).is_some_and(|b| b > 0.0),
            "{c} has stored bytes"
        );
        assert!(
            value(&m, "dramesh_store_history_changes", &[("cluster", c)]).is_some_and(|n| n >= 1.0),
            "{c} has history"
        );
    }
    let lag_peers = label_values(&m, "dramesh_mesh_sync_lag_seconds", "peer");
    assert!(
        lag_peers
            .iter()
            .all(|p| p.starts_with("cluster/") || p.starts_with("replica/")),
        "{lag_peers:?}"
    );
    assert!(
        value(&m, "dramesh_store_documents", &[]).is_some_and(|n| n >= clusters.len() as f64),
        "{text}"
    );
    assert_eq!(
        value(&m, "dramesh_mesh_peers", &[("kind", "agent")]),
        Some(clusters.len() as f64),
        "every demo agent is connected to r1"
    );
    assert_eq!(
        value(&m, "dramesh_mesh_peers", &[("kind", "replica")]),
        Some(2.0)
    );
    for peer in label_values(&m, "dramesh_mesh_peer_docs_behind", "peer") {
        assert!(
            value(
                &m,
                "dramesh_mesh_bytes_total",
                &[("peer", &peer), ("direction", "received")]
            )
            .is_some_and(|b| b > 0.0),
            "bytes from {peer}:\n{text}"
        );
    }
    for reason in ["unauthorized", "refused_by_store", "stale_generation"] {
        assert_eq!(
            value(
                &m,
                "dramesh_mesh_rejected_writes_total",
                &[("reason", reason)]
            ),
            Some(0.0),
            "nothing is refused in the demo ({reason})"
        );
    }
    for state in ["live", "expired", "conflicted"] {
        assert!(
            value(&m, "dramesh_reservations", &[("state", state)]).is_some(),
            "reservations {state}:\n{text}"
        );
    }

    // Spans: flushed when the demo exits on SIGTERM.
    let stopped = tokio::task::spawn_blocking(move || demo.stop())
        .await
        .expect("stop");
    assert!(stopped, "the demo exits cleanly on SIGTERM");
    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(20), server)
        .await
        .expect("collector stops")
        .expect("collector task")
        .expect("collector server");
    let reqs = collector
        .0
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let mut spans: Vec<(String, Span)> = Vec::new();
    for r in &reqs {
        for rs in &r.resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|res| res.attributes.iter().find(|kv| kv.key == "service.name"))
                .and_then(|kv| kv.value.as_ref())
                .and_then(|v| match &v.value {
                    Some(AnyValue::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for ss in &rs.scope_spans {
                for s in &ss.spans {
                    spans.push((service.clone(), s.clone()));
                }
            }
        }
    }
    assert!(
        spans.iter().all(|(svc, _)| svc == "dramesh-replica"),
        "service.name of the demo's spans"
    );
    fn named<'a>(spans: &'a [(String, Span)], n: &'a str) -> impl Iterator<Item = &'a Span> {
        spans
            .iter()
            .filter(move |(_, s)| s.name == n)
            .map(|(_, s)| s)
    }
    let karmada_span = named(&spans, "api.request")
        .find(|s| str_attr(s, "api") == Some("karmada"))
        .unwrap_or_else(|| panic!("no Karmada api.request span among {} spans", spans.len()));
    assert_eq!(
        str_attr(karmada_span, "method"),
        Some("MaxAvailableReplicas")
    );
    assert_eq!(str_attr(karmada_span, "cluster"), Some("no-such-cluster"));
    assert_eq!(str_attr(karmada_span, "code"), Some("OK"));
    let http_span = named(&spans, "api.request")
        .find(|s| {
            str_attr(s, "api") == Some("http") && str_attr(s, "method") == Some("/v1/estimate")
        })
        .expect("HTTP api.request span for /v1/estimate");
    assert_eq!(str_attr(http_span, "code"), Some("200"));
    let search = named(&spans, "alloc.search")
        .find(|s| str_attr(s, "method") == Some("EstimateAll"))
        .expect("alloc.search span of the estimate");
    assert_eq!(
        search.trace_id, http_span.trace_id,
        "search in the request's trace"
    );
    assert_eq!(str_attr(search, "outcome"), Some("ok"));
    let sync: Vec<&Span> = named(&spans, "mesh.sync").collect();
    assert!(!sync.is_empty(), "mesh.sync spans of the replicas' feed");
    for c in &clusters {
        assert!(
            sync.iter()
                .any(|s| str_attr(s, "cluster").is_some_and(|v| v.split(',').any(|x| x == c))),
            "a sync round applied {c}"
        );
    }
}
