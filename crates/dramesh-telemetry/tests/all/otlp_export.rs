//! Exports spans over OTLP/gRPC to an in-process collector (a tonic TraceService on loopback) and
//! checks what arrives: span names, attributes, parentage, kind and the resource.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dramesh_telemetry::spans::{fields, record_count};
use dramesh_telemetry::{TelemetryConfig, alloc_span, api_span, init_for_tests};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(30);

#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<ExportTraceServiceRequest>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

struct Running {
    endpoint: String,
    collector: Collector,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

async fn start_collector() -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let collector = Collector::default();
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let svc = TraceServiceServer::new(collector.clone());
    let task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                async {
                    let _ = stop_rx.await;
                },
            ),
    );
    Running {
        endpoint: format!("http://{addr}"),
        collector,
        stop,
        task,
    }
}

impl Running {
    async fn stop(self) -> Vec<ExportTraceServiceRequest> {
        let _ = self.stop.send(());
        timeout(LIMIT, self.task)
            .await
            .expect("collector did not stop")
            .unwrap()
            .unwrap();
        std::mem::take(&mut *self.collector.0.lock().unwrap())
    }
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

fn str_attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a str> {
    match attr(attrs, key) {
        Some(Value::StringValue(s)) => Some(s),
        _ => None,
    }
}

/// Every exported span with the `service.name` of the resource it came under.
fn spans(reqs: &[ExportTraceServiceRequest]) -> Vec<(Vec<KeyValue>, Span)> {
    let mut out = Vec::new();
    for r in reqs {
        for rs in &r.resource_spans {
            let res = rs
                .resource
                .as_ref()
                .map(|r| r.attributes.clone())
                .unwrap_or_default();
            for ss in &rs.scope_spans {
                for s in &ss.spans {
                    out.push((res.clone(), s.clone()));
                }
            }
        }
    }
    out
}

fn emit_request() {
    let api = api_span("karmada-estimator", "MaxAvailableReplicas");
    let _g = api.enter();
    {
        let alloc = alloc_span("MaxAvailableReplicas", "c1");
        let _a = alloc.enter();
        alloc.record(fields::NODE, "node-7");
        record_count(&alloc, fields::STEPS, 17);
        alloc.record(fields::OUTCOME, "allocated");
    }
    api.record(fields::CODE, "OK");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_collector_with_attributes_and_resource() {
    let running = start_collector().await;
    let cfg = TelemetryConfig::agent()
        .with_otlp_endpoint(running.endpoint.clone())
        .with_instance_id("agent-c1");
    let scoped = init_for_tests(&cfg).unwrap();
    assert!(scoped.guard.otlp_enabled());
    assert_eq!(
        scoped.guard.otlp_endpoint(),
        Some(running.endpoint.as_str())
    );

    emit_request();
    timeout(LIMIT, scoped.shutdown())
        .await
        .expect("shutdown timed out")
        .expect("flush failed");

    let reqs = running.stop().await;
    let spans = spans(&reqs);
    let (res, api) = spans
        .iter()
        .find(|(_, s)| s.name == "api.request")
        .unwrap_or_else(|| panic!("no api.request span in {spans:?}"));
    assert_eq!(str_attr(res, "service.name"), Some("dramesh-agent"));
    assert_eq!(str_attr(res, "service.instance.id"), Some("agent-c1"));
    assert_eq!(str_attr(&api.attributes, "api"), Some("karmada-estimator"));
    assert_eq!(
        str_attr(&api.attributes, "method"),
        Some("MaxAvailableReplicas")
    );
    assert_eq!(str_attr(&api.attributes, "code"), Some("OK"));
    assert_eq!(api.kind, SpanKind::Server as i32);
    assert!(api.end_time_unix_nano >= api.start_time_unix_nano);

    let (_, alloc) = spans
        .iter()
        .find(|(_, s)| s.name == "alloc.search")
        .unwrap_or_else(|| panic!("no alloc.search span in {spans:?}"));
    assert_eq!(str_attr(&alloc.attributes, "cluster"), Some("c1"));
    assert_eq!(str_attr(&alloc.attributes, "node"), Some("node-7"));
    assert_eq!(
        str_attr(&alloc.attributes, "method"),
        Some("MaxAvailableReplicas")
    );
    assert_eq!(str_attr(&alloc.attributes, "outcome"), Some("allocated"));
    assert!(
        matches!(attr(&alloc.attributes, "steps"), Some(Value::IntValue(17))),
        "steps: {:?}",
        attr(&alloc.attributes, "steps")
    );
    assert_eq!(alloc.trace_id, api.trace_id, "child shares the trace");
    assert_eq!(alloc.parent_span_id, api.span_id, "child of the API span");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_guard_flushes() {
    let running = start_collector().await;
    let cfg = TelemetryConfig::replica().with_otlp_endpoint(running.endpoint.clone());
    let scoped = init_for_tests(&cfg).unwrap();
    emit_request();
    drop(scoped);
    let reqs = running.stop().await;
    let spans = spans(&reqs);
    assert!(
        spans.iter().any(|(res, s)| s.name == "api.request"
            && str_attr(res, "service.name") == Some("dramesh-replica")),
        "{spans:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_collector_does_not_hang_shutdown() {
    // Bind then drop a listener so the port is very likely closed.
    let addr = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let mut cfg = TelemetryConfig::agent().with_otlp_endpoint(format!("http://{addr}"));
    cfg.export_timeout = Duration::from_secs(1);
    cfg.shutdown_timeout = Duration::from_secs(3);
    let scoped = init_for_tests(&cfg).unwrap();
    emit_request();
    let started = Instant::now();
    let result = timeout(LIMIT, scoped.shutdown())
        .await
        .expect("shutdown hung");
    // Whether the SDK reports the failed export or not, shutdown is bounded by its timeouts.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "shutdown took {:?} ({result:?})",
        started.elapsed()
    );
}
