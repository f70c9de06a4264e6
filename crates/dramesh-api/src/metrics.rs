//! How the API servers record into the shared dramesh metric set ([`dramesh_telemetry::Metrics`],
//! re-exported here as [`Metrics`]): the label vocabulary (`api`, `method`, zero-answer reasons),
//! the HTTP tracking middleware, and per-method counts read back from the registry.
//!
//! There is one registry per replica: the daemon creates it, hands it to [`crate::ApiState`]
//! and serves it on `/metrics`, so API counters, mesh and store gauges render together.
//!
//! Recorded per request (gRPC in [`crate::grpc`], HTTP by [`track_http`]):
//! - `dramesh_api_requests_total{api,method,code}` and
//!   `dramesh_api_request_duration_seconds{api,method}`; `api` is [`API_KARMADA`],
//!   [`API_NATIVE_GRPC`] or [`API_HTTP`]; `method` is the RPC name ([`Method::as_str`]) or the
//!   matched HTTP route (`/v1/estimate`); `code` the gRPC code name (`OK`, `InvalidArgument`)
//!   or the HTTP status (`200`);
//! - `dramesh_api_zero_answers_total{method,reason}` for Karmada questions answered 0;
//! - `dramesh_alloc_search_duration_seconds{method}` for calls that search allocations.

use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use dramesh_telemetry::spans::fields;
use tracing::Instrument;

pub use dramesh_telemetry::Metrics;

/// `api` label of Karmada's `Estimator` gRPC service.
pub const API_KARMADA: &str = "karmada";
/// `api` label of the native `dramesh.v1.Dramesh` gRPC service.
pub const API_NATIVE_GRPC: &str = "dramesh.v1";
/// `api` label of the HTTP/JSON server.
pub const API_HTTP: &str = "http";

/// The API methods (gRPC names; the HTTP routes map onto the same calls).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// Karmada `MaxAvailableReplicas`.
    MaxAvailableReplicas,
    /// Karmada `MaxAvailableComponentSets`.
    MaxAvailableComponentSets,
    /// Karmada `GetUnschedulableReplicas`.
    GetUnschedulableReplicas,
    /// Native estimate over all (or the named) clusters.
    EstimateAll,
    /// Native placement.
    Place,
    /// Native preemption.
    Preempt,
    /// Native status report.
    Status,
    /// Native reservation write.
    Reserve,
    /// Native reservation release.
    Release,
    /// Native read of one reservation.
    GetReservation,
    /// Native list of reservations.
    ListReservations,
    /// Retire a member cluster from the fleet.
    RetireCluster,
}

impl Method {
    /// Every method, in declaration order.
    pub const ALL: [Method; 12] = [
        Method::MaxAvailableReplicas,
        Method::MaxAvailableComponentSets,
        Method::GetUnschedulableReplicas,
        Method::EstimateAll,
        Method::Place,
        Method::Preempt,
        Method::Status,
        Method::Reserve,
        Method::Release,
        Method::GetReservation,
        Method::ListReservations,
        Method::RetireCluster,
    ];

    /// The `method` label (the gRPC method name).
    pub fn as_str(self) -> &'static str {
        match self {
            Method::MaxAvailableReplicas => "MaxAvailableReplicas",
            Method::MaxAvailableComponentSets => "MaxAvailableComponentSets",
            Method::GetUnschedulableReplicas => "GetUnschedulableReplicas",
            Method::EstimateAll => "EstimateAll",
            Method::Place => "Place",
            Method::Preempt => "Preempt",
            Method::Status => "Status",
            Method::Reserve => "Reserve",
            Method::Release => "Release",
            Method::GetReservation => "GetReservation",
            Method::ListReservations => "ListReservations",
            Method::RetireCluster => "RetireCluster",
        }
    }

    /// Whether the call runs allocation searches over the view (gets an `alloc.search` span
    /// and a search-duration observation). Reservation calls are table reads and writes;
    /// timing them as searches would skew the search-duration histogram.
    pub fn searches_allocations(self) -> bool {
        matches!(
            self,
            Method::MaxAvailableReplicas
                | Method::MaxAvailableComponentSets
                | Method::EstimateAll
                | Method::Place
                | Method::Preempt
        )
    }
}

/// Why a Karmada question was answered with 0 instead of a computed number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroReason {
    /// The cluster is not in the view.
    UnknownCluster,
    /// The cluster's data is older than the staleness limit.
    StaleCluster,
    /// The computation failed for the cluster.
    BackendFailure,
    /// The answer missed its deadline.
    Timeout,
    /// The device allocation search gave up at its budget before finding a replica: whether
    /// one fits is unknown (not "no fit").
    BudgetExhausted,
}

impl ZeroReason {
    /// The `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            ZeroReason::UnknownCluster => "unknown_cluster",
            ZeroReason::StaleCluster => "stale_cluster",
            ZeroReason::BackendFailure => "backend_failure",
            ZeroReason::Timeout => "timeout",
            ZeroReason::BudgetExhausted => "budget_exhausted",
        }
    }
}

/// Counts of one method on one API, read back from the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MethodCounts {
    /// The method.
    pub method: Method,
    /// Requests received.
    pub requests: u64,
    /// Requests answered with a code other than `OK` / a 2xx status.
    pub errors: u64,
    /// Karmada answers of 0 for an unknown cluster.
    pub zero_unknown_cluster: u64,
    /// Karmada answers of 0 for a stale cluster.
    pub zero_stale_cluster: u64,
    /// Karmada answers of 0 after a backend failure.
    pub zero_backend_failure: u64,
    /// Karmada answers of 0 after a timeout.
    pub zero_timeout: u64,
    /// Karmada answers of 0 because the allocation search gave up (unknown, not no-fit).
    pub zero_budget_exhausted: u64,
}

impl MethodCounts {
    /// The counts `metrics` holds for `method` served on `api` (zero answers are per method,
    /// whatever the API).
    pub fn of(metrics: &Metrics, api: &str, method: Method) -> MethodCounts {
        let m = method.as_str();
        let z = |r: ZeroReason| metrics.zero_answers(m, r.as_str());
        MethodCounts {
            method,
            requests: metrics.api_requests(api, m, |_| true),
            errors: metrics.api_requests(api, m, |c| !is_success(c)),
            zero_unknown_cluster: z(ZeroReason::UnknownCluster),
            zero_stale_cluster: z(ZeroReason::StaleCluster),
            zero_backend_failure: z(ZeroReason::BackendFailure),
            zero_timeout: z(ZeroReason::Timeout),
            zero_budget_exhausted: z(ZeroReason::BudgetExhausted),
        }
    }
}

/// `OK` or a 2xx/3xx HTTP status.
fn is_success(code: &str) -> bool {
    code == "OK" || code.starts_with('2') || code.starts_with('3')
}

/// Axum middleware (install with `route_layer(axum::middleware::from_fn_with_state(metrics,
/// track_http))`): an `api.request` span and the request metrics per matched route. Only
/// matched routes are recorded, so unknown paths cannot create label values.
pub async fn track_http(
    State(metrics): State<Arc<Metrics>>,
    matched: Option<MatchedPath>,
    req: Request,
    next: Next,
) -> Response {
    let route = matched.as_ref().map_or("unmatched", |m| m.as_str());
    let span = dramesh_telemetry::api_span(API_HTTP, route);
    let timer = metrics.start_api_request(API_HTTP, route);
    let resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status();
    span.record(fields::CODE, status.as_str());
    span.record(
        fields::OTEL_STATUS_CODE,
        if status.is_server_error() {
            "error"
        } else {
            "ok"
        },
    );
    timer.finish(status.as_str());
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn counts_are_read_back_per_api_and_method() {
        let m = Metrics::new();
        let mar = Method::MaxAvailableReplicas;
        let d = Duration::from_millis(1);
        m.observe_api_request(API_KARMADA, mar.as_str(), "OK", d);
        m.observe_api_request(API_KARMADA, mar.as_str(), "OK", d);
        m.observe_api_request(API_KARMADA, mar.as_str(), "InvalidArgument", d);
        m.observe_api_request(API_NATIVE_GRPC, "Place", "Unavailable", d);
        m.zero_answer(mar.as_str(), ZeroReason::UnknownCluster.as_str());
        let c = MethodCounts::of(&m, API_KARMADA, mar);
        assert_eq!(
            (c.requests, c.errors, c.zero_unknown_cluster, c.zero_timeout),
            (3, 1, 1, 0)
        );
        let p = MethodCounts::of(&m, API_NATIVE_GRPC, Method::Place);
        assert_eq!((p.requests, p.errors), (1, 1));
        assert_eq!(MethodCounts::of(&m, API_KARMADA, Method::Place).requests, 0);
        let text = m.render();
        assert!(
            text.contains(
                "dramesh_api_zero_answers_total{method=\"MaxAvailableReplicas\",reason=\"unknown_cluster\"} 1\n"
            ),
            "{text}"
        );
        let names: std::collections::BTreeSet<_> = Method::ALL.iter().map(|m| m.as_str()).collect();
        assert_eq!(names.len(), Method::ALL.len(), "label values are distinct");
        assert!(!Method::Reserve.searches_allocations());
        assert!(is_success("204") && !is_success("404") && !is_success("Internal"));
    }
}
