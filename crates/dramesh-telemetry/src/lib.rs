//! Observability for the dramesh daemons (replica and agent).
//!
//! - [`init()`] / [`init_for_tests`]: tracing subscriber with env-filtered stderr logs and, when an
//!   endpoint is configured, span export over OTLP/gRPC ([`init`](mod@init) module docs).
//! - [`api_span`], [`sync_span`], [`alloc_span`]: spans with fixed names and field names
//!   ([`spans`] module docs list them).
//! - [`Metrics`]: the dramesh metric set as typed handles over a [`Registry`] that renders the
//!   Prometheus text format 0.0.4; [`metrics_router`] serves it on `GET /metrics`.
//! - [`serve_bounded`]: every HTTP listener of a daemon, with a connection cap, header and idle
//!   timeouts and TCP_NODELAY ([`http`] module docs); [`conns`]: the connection tables with fair
//!   eviction that it and the replica's gRPC listener share.
//! - [`throttle`]: log lines rate-limited per key (once per peer, replica or file per minute).
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use dramesh_telemetry::{Metrics, TelemetryConfig, api_span, serve_metrics};
//!
//! let guard = dramesh_telemetry::init(&TelemetryConfig::replica().with_instance_id("replica-a"))?;
//! let metrics = Arc::new(Metrics::new());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:9090").await?;
//! tokio::spawn(serve_metrics(listener, metrics.clone(), Default::default(), std::future::pending()));
//!
//! let span = api_span("karmada-estimator", "MaxAvailableReplicas");
//! let timer = metrics.start_api_request("karmada-estimator", "MaxAvailableReplicas");
//! let _entered = span.enter();
//! // ... answer the request ...
//! span.record(dramesh_telemetry::spans::fields::CODE, "OK");
//! timer.finish("OK");
//! # drop(_entered);
//! guard.shutdown().await?;
//! # Ok(()) }
//! ```

pub mod conns;
pub mod http;
pub mod init;
pub mod metrics;
pub mod registry;
pub mod spans;
pub mod throttle;

pub use http::{
    Handshake, HandshakeFailures, HttpLimits, METRICS_PATH, Plain, metrics_router, serve_bounded,
    serve_bounded_with, serve_metrics,
};
pub use init::{
    OTLP_ENDPOINT_ENV, SERVICE_AGENT, SERVICE_REPLICA, ScopedTelemetry, TelemetryConfig,
    TelemetryError, TelemetryGuard, init, init_for_tests, subscriber,
};
pub use metrics::{ApiTimer, Direction, Metrics, ReservationLabel};
pub use registry::{
    CONTENT_TYPE, Counter, CounterVec, Family, Gauge, GaugeVec, Histogram, HistogramSnapshot,
    HistogramVec, MetricsError, Registry,
};
pub use spans::{alloc_span, api_span, sync_span};
