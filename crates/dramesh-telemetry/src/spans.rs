//! Span constructors with one spelling of span names and field names across the daemons, so
//! traces from replica and agent can be queried the same way.
//!
//! | span (name)          | fields set at creation       | fields to record later (start `Empty`)                     |
//! |----------------------|------------------------------|------------------------------------------------------------|
//! | [`api_span`] `api.request` | `api`, `method`, `otel.kind = "server"` | `cluster`, `code`, `otel.status_code`      |
//! | [`sync_span`] `mesh.sync`  | `peer`                       | `cluster`, `bytes_sent`, `bytes_received`, `changes_applied`, `rejected`, `otel.status_code` |
//! | [`alloc_span`] `alloc.search` | `method`, `cluster`       | `node`, `steps`, `outcome`, `otel.status_code`             |
//!
//! Record a late field with `span.record(fields::CODE, "OK")`, and counts with [`record_count`]
//! (the OpenTelemetry bridge exports `u64` values as strings, `i64` as integers). All three are
//! `INFO` spans. With OTLP export on, every field becomes a span attribute of the same name;
//! `otel.kind` and `otel.status_code` are consumed by the exporter as span kind and status instead.

use tracing::Span;
use tracing::field::Empty;

/// Span names.
pub mod names {
    /// One API request, any of the three APIs.
    pub const API: &str = "api.request";
    /// One mesh sync exchange with a peer.
    pub const SYNC: &str = "mesh.sync";
    /// One allocation search.
    pub const ALLOC: &str = "alloc.search";
}

/// Field names used by the span helpers.
pub mod fields {
    /// Which API: e.g. `karmada-estimator`, `dramesh.v1`, `http`.
    pub const API: &str = "api";
    /// RPC method or HTTP route.
    pub const METHOD: &str = "method";
    /// gRPC code name or HTTP status of the answer.
    pub const CODE: &str = "code";
    /// Mesh peer identity (its certificate name).
    pub const PEER: &str = "peer";
    /// Member cluster name (`*` for a search over every cluster of the view).
    pub const CLUSTER: &str = "cluster";
    /// Node the allocation search ran against.
    pub const NODE: &str = "node";
    /// Bytes sent to the peer in the exchange.
    pub const BYTES_SENT: &str = "bytes_sent";
    /// Bytes received from the peer in the exchange.
    pub const BYTES_RECEIVED: &str = "bytes_received";
    /// Changes applied to the local store.
    pub const CHANGES_APPLIED: &str = "changes_applied";
    /// Changes refused (unauthorized or stale).
    pub const REJECTED: &str = "rejected";
    /// Allocator search steps taken.
    pub const STEPS: &str = "steps";
    /// `allocated`, `unsatisfiable`, `budget_exhausted`, ...
    pub const OUTCOME: &str = "outcome";
    /// `"ok"` or `"error"`; mapped to the OpenTelemetry span status.
    pub const OTEL_STATUS_CODE: &str = "otel.status_code";
}

/// A span for serving one API request.
pub fn api_span(api: &str, method: &str) -> Span {
    tracing::info_span!(
        "api.request",
        api = api,
        method = method,
        cluster = Empty,
        code = Empty,
        otel.kind = "server",
        otel.status_code = Empty,
    )
}

/// A span for one replication round with a peer.
pub fn sync_span(peer: &str) -> Span {
    tracing::info_span!(
        "mesh.sync",
        peer = peer,
        cluster = Empty,
        bytes_sent = Empty,
        bytes_received = Empty,
        changes_applied = Empty,
        rejected = Empty,
        otel.status_code = Empty,
    )
}

/// A span for one allocation search: an estimation, placement or preemption (`method`) over
/// one cluster, or over every cluster of the view (`cluster = "*"`).
pub fn alloc_span(method: &str, cluster: &str) -> Span {
    tracing::info_span!(
        "alloc.search",
        method = method,
        cluster = cluster,
        node = Empty,
        steps = Empty,
        outcome = Empty,
        otel.status_code = Empty,
    )
}

/// Records a count field so it exports as an integer attribute (saturating at `i64::MAX`).
pub fn record_count(span: &Span, field: &str, n: u64) {
    span.record(field, i64::try_from(n).unwrap_or(i64::MAX));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tracing::Subscriber;
    use tracing::span::{Attributes, Id, Record};
    use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
    use tracing_subscriber::registry::LookupSpan;

    /// Collects span names and every field name/value recorded on them.
    type Fields = Vec<(String, String)>;

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<(String, Fields)>>>);

    struct Visit<'a>(&'a mut Vec<(String, String)>);
    impl tracing::field::Visit for Visit<'_> {
        fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
            self.0.push((f.name().to_owned(), format!("{v:?}")));
        }
        fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
            self.0.push((f.name().to_owned(), v.to_owned()));
        }
    }

    impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
        fn on_new_span(&self, attrs: &Attributes<'_>, _id: &Id, _ctx: Context<'_, S>) {
            let mut fields = Vec::new();
            attrs.record(&mut Visit(&mut fields));
            let declared: Vec<_> = attrs.fields().iter().map(|f| f.name().to_owned()).collect();
            fields.push(("__declared".into(), declared.join(",")));
            self.0
                .lock()
                .unwrap()
                .push((attrs.metadata().name().to_owned(), fields));
        }
        fn on_record(&self, _id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
            let mut g = self.0.lock().unwrap();
            if let Some(last) = g.last_mut() {
                values.record(&mut Visit(&mut last.1));
            }
        }
    }

    fn get<'a>(fields: &'a [(String, String)], k: &str) -> Option<&'a str> {
        fields.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
    }

    #[test]
    fn helpers_use_documented_names_and_fields() {
        let cap = Capture::default();
        let sub = tracing_subscriber::registry().with(cap.clone());
        tracing::subscriber::with_default(sub, || {
            let s = api_span("karmada-estimator", "MaxAvailableReplicas");
            s.record(fields::CODE, "OK");
            let s = sync_span("replica-b");
            record_count(&s, fields::BYTES_SENT, 42);
            let s = alloc_span("MaxAvailableReplicas", "c1");
            s.record(fields::NODE, "node-7");
            record_count(&s, fields::STEPS, u64::MAX);
        });
        let got = cap.0.lock().unwrap().clone();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].0, names::API);
        assert_eq!(get(&got[0].1, fields::API), Some("karmada-estimator"));
        assert_eq!(get(&got[0].1, fields::METHOD), Some("MaxAvailableReplicas"));
        assert_eq!(get(&got[0].1, fields::CODE), Some("OK"));
        assert_eq!(got[1].0, names::SYNC);
        assert_eq!(get(&got[1].1, fields::PEER), Some("replica-b"));
        assert_eq!(get(&got[1].1, fields::BYTES_SENT), Some("42"));
        assert_eq!(got[2].0, names::ALLOC);
        assert_eq!(get(&got[2].1, fields::CLUSTER), Some("c1"));
        assert_eq!(get(&got[2].1, fields::METHOD), Some("MaxAvailableReplicas"));
        assert_eq!(get(&got[2].1, fields::NODE), Some("node-7"));
        assert_eq!(
            get(&got[2].1, fields::STEPS),
            Some(i64::MAX.to_string().as_str())
        );
        let declared = get(&got[1].1, "__declared").unwrap();
        for f in [
            fields::PEER,
            fields::CLUSTER,
            fields::BYTES_SENT,
            fields::BYTES_RECEIVED,
            fields::CHANGES_APPLIED,
            fields::REJECTED,
            fields::OTEL_STATUS_CODE,
        ] {
            assert!(declared.split(',').any(|d| d == f), "{f} in {declared}");
        }
    }
}
