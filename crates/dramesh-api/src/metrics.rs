//! Per-method request counters of the API servers, cheap to update from any thread.
//!
//! Counters only grow. [`Metrics::render_prometheus`] renders them in the Prometheus text
//! format (also served at `GET /metrics`); [`Metrics::snapshot`] gives them as values.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// The API methods that are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    MaxAvailableReplicas,
    MaxAvailableComponentSets,
    GetUnschedulableReplicas,
    EstimateAll,
    Place,
    Preempt,
    Status,
}

impl Method {
    pub const ALL: [Method; 7] = [
        Method::MaxAvailableReplicas,
        Method::MaxAvailableComponentSets,
        Method::GetUnschedulableReplicas,
        Method::EstimateAll,
        Method::Place,
        Method::Preempt,
        Method::Status,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Method::MaxAvailableReplicas => "MaxAvailableReplicas",
            Method::MaxAvailableComponentSets => "MaxAvailableComponentSets",
            Method::GetUnschedulableReplicas => "GetUnschedulableReplicas",
            Method::EstimateAll => "EstimateAll",
            Method::Place => "Place",
            Method::Preempt => "Preempt",
            Method::Status => "Status",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Why a Karmada question was answered with 0 instead of a computed number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroReason {
    UnknownCluster,
    StaleCluster,
    BackendFailure,
    Timeout,
}

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    errors: AtomicU64,
    zero_unknown_cluster: AtomicU64,
    zero_stale_cluster: AtomicU64,
    zero_backend_failure: AtomicU64,
    zero_timeout: AtomicU64,
}

/// Counter values of one method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MethodCounts {
    pub method: Method,
    pub requests: u64,
    /// Requests answered with an error status (malformed input, native API errors, timeouts
    /// of native calls).
    pub errors: u64,
    pub zero_unknown_cluster: u64,
    pub zero_stale_cluster: u64,
    pub zero_backend_failure: u64,
    pub zero_timeout: u64,
}

/// Request counters of every method.
#[derive(Debug, Default)]
pub struct Metrics {
    counters: [Counters; 7],
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics::default()
    }

    pub fn request(&self, m: Method) {
        self.counters[m.index()]
            .requests
            .fetch_add(1, Ordering::Relaxed);
    }

    pub fn error(&self, m: Method) {
        self.counters[m.index()]
            .errors
            .fetch_add(1, Ordering::Relaxed);
    }

    pub fn zero(&self, m: Method, why: ZeroReason) {
        let c = &self.counters[m.index()];
        let counter = match why {
            ZeroReason::UnknownCluster => &c.zero_unknown_cluster,
            ZeroReason::StaleCluster => &c.zero_stale_cluster,
            ZeroReason::BackendFailure => &c.zero_backend_failure,
            ZeroReason::Timeout => &c.zero_timeout,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, m: Method) -> MethodCounts {
        let c = &self.counters[m.index()];
        MethodCounts {
            method: m,
            requests: c.requests.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            zero_unknown_cluster: c.zero_unknown_cluster.load(Ordering::Relaxed),
            zero_stale_cluster: c.zero_stale_cluster.load(Ordering::Relaxed),
            zero_backend_failure: c.zero_backend_failure.load(Ordering::Relaxed),
            zero_timeout: c.zero_timeout.load(Ordering::Relaxed),
        }
    }

    pub fn snapshot(&self) -> Vec<MethodCounts> {
        Method::ALL.iter().map(|m| self.get(*m)).collect()
    }

    /// Prometheus text exposition format (version 0.0.4).
    pub fn render_prometheus(&self) -> String {
        let snap = self.snapshot();
        let mut out = String::new();
        out.push_str("# HELP dramesh_api_requests_total API requests received, by method.\n");
        out.push_str("# TYPE dramesh_api_requests_total counter\n");
        for s in &snap {
            let _ = writeln!(
                out,
                "dramesh_api_requests_total{{method=\"{}\"}} {}",
                s.method.as_str(),
                s.requests
            );
        }
        out.push_str("# HELP dramesh_api_errors_total API requests answered with an error status, by method.\n");
        out.push_str("# TYPE dramesh_api_errors_total counter\n");
        for s in &snap {
            let _ = writeln!(
                out,
                "dramesh_api_errors_total{{method=\"{}\"}} {}",
                s.method.as_str(),
                s.errors
            );
        }
        out.push_str(
            "# HELP dramesh_api_zero_answers_total Karmada estimator questions answered with 0 instead of a computed number, by method and reason.\n",
        );
        out.push_str("# TYPE dramesh_api_zero_answers_total counter\n");
        for s in &snap[..3] {
            for (reason, v) in [
                ("unknown_cluster", s.zero_unknown_cluster),
                ("stale_cluster", s.zero_stale_cluster),
                ("backend_failure", s.zero_backend_failure),
                ("timeout", s.zero_timeout),
            ] {
                let _ = writeln!(
                    out,
                    "dramesh_api_zero_answers_total{{method=\"{}\",reason=\"{reason}\"}} {v}",
                    s.method.as_str()
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_per_method_and_rendered() {
        let m = Metrics::new();
        m.request(Method::MaxAvailableReplicas);
        m.request(Method::MaxAvailableReplicas);
        m.zero(Method::MaxAvailableReplicas, ZeroReason::UnknownCluster);
        m.error(Method::Place);
        let r = m.get(Method::MaxAvailableReplicas);
        assert_eq!((r.requests, r.zero_unknown_cluster, r.errors), (2, 1, 0));
        assert_eq!(m.get(Method::Place).errors, 1);
        let text = m.render_prometheus();
        assert!(text.contains("dramesh_api_requests_total{method=\"MaxAvailableReplicas\"} 2\n"));
        assert!(text.contains(
            "dramesh_api_zero_answers_total{method=\"MaxAvailableReplicas\",reason=\"unknown_cluster\"} 1\n"
        ));
        assert!(text.contains("dramesh_api_errors_total{method=\"Place\"} 1\n"));
    }
}
