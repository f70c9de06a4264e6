//! dramesh-api: the APIs a control-plane replica serves, as a library.
//!
//! * [`grpc`]: Karmada's scheduler-estimator gRPC service
//!   (`github.com.karmada_io.karmada.pkg.estimator.service.Estimator`, default port
//!   [`grpc::KARMADA_ESTIMATOR_PORT`]), wire-compatible with Karmada v1.17 (embedded
//!   Kubernetes messages) and v1.18+ (`*Bytes` fields), answering for any cluster of the view;
//!   plus the native `dramesh.v1.Dramesh` service on the same port.
//! * [`http`]: the native API as HTTP/JSON, with `/healthz`, `/readyz` and `/metrics`.
//! * [`admission`]: every request charged its expected memory against one budget before it
//!   is parsed; the gRPC gate (busy connections, authentication, charge).
//! * [`auth`]: who calls (client certificate, bearer token, TokenReview) and whether they may
//!   (read, write, admin), per-identity caps, counted and rate-limited refusal logs.
//! * [`tokenreview`]: bearer tokens reviewed by a Kubernetes API server (TokenReview).
//! * [`tls`]: TLS of both listeners (server certificate, optional client CA, ALPN).
//! * [`backend`]: the [`Backend`] trait the caller implements; this crate does no estimation
//!   (it depends on the estimator only for its result types).
//! * [`query`]: plain Rust forms of the Karmada requests, converted from either wire generation.
//! * [`native`]: request and response types of the native API, converted from the estimator's
//!   results by compile-checked `From` impls.
//! * [`metrics`]: how requests are recorded into the shared [`dramesh_telemetry::Metrics`].
//! * `table` (feature `test-util`): a test double answering from a fixed table, for this
//!   crate's tests, the interop test and `examples/fake_estimator`.
//! * [`proto`]: generated protobuf code (schema in `proto/karmada` and `proto/dramesh/v1`).

pub mod admission;
pub mod auth;
pub mod backend;
pub mod codec;
mod convert;
pub mod deadline;
pub mod grpc;
pub mod http;
pub mod metrics;
pub mod native;
pub mod proto;
pub mod query;
pub mod server;
#[cfg(feature = "test-util")]
pub mod table;
pub mod tls;
pub mod tokenreview;

pub use backend::{ApiError, Backend, ReplicaAnswer};
pub use convert::FreshnessMap;
pub use grpc::{KARMADA_ESTIMATOR_PORT, serve_grpc, serve_grpc_on};
pub use http::{http_router, serve_http, serve_http_on, serve_router, with_auth};
pub use metrics::{Method, MethodCounts, Metrics, ZeroReason};
pub use server::{
    ApiConfig, ApiState, GRPC_LISTENER, GrpcConnInfo, GrpcLimits, HTTP_API_LISTENER, ServeError,
};
