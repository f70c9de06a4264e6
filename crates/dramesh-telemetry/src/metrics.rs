//! The dramesh metric set: one typed handle per metric the replica and agent export.
//!
//! Every metric is registered once in [`Metrics::new`] and rendered by [`Metrics::render`] even
//! before the first value is recorded (labelled families then show only HELP/TYPE; unlabelled ones
//! show 0). Names carry the `dramesh_` namespace; [`names`] lists them for tests and dashboards.
//! Durations are seconds, sizes bytes (Prometheus base units).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::registry::{Counter, CounterVec, Gauge, GaugeVec, HistogramVec, Registry};

/// Exported metric names.
pub mod names {
    /// `dramesh_api_requests_total`.
    pub const API_REQUESTS_TOTAL: &str = "dramesh_api_requests_total";
    /// `dramesh_api_request_duration_seconds`.
    pub const API_REQUEST_DURATION_SECONDS: &str = "dramesh_api_request_duration_seconds";
    /// `dramesh_api_zero_answers_total`.
    pub const API_ZERO_ANSWERS_TOTAL: &str = "dramesh_api_zero_answers_total";
    /// `dramesh_alloc_search_duration_seconds`.
    pub const ALLOC_SEARCH_DURATION_SECONDS: &str = "dramesh_alloc_search_duration_seconds";
    /// `dramesh_mesh_sync_lag_seconds`.
    pub const MESH_SYNC_LAG_SECONDS: &str = "dramesh_mesh_sync_lag_seconds";
    /// `dramesh_mesh_peer_docs_behind`.
    pub const MESH_PEER_DOCS_BEHIND: &str = "dramesh_mesh_peer_docs_behind";
    /// `dramesh_mesh_peers`.
    pub const MESH_PEERS: &str = "dramesh_mesh_peers";
    /// `dramesh_mesh_bytes_total`.
    pub const MESH_BYTES_TOTAL: &str = "dramesh_mesh_bytes_total";
    /// `dramesh_mesh_rejected_writes_total`.
    pub const MESH_REJECTED_WRITES_TOTAL: &str = "dramesh_mesh_rejected_writes_total";
    /// `dramesh_store_bytes`.
    pub const STORE_BYTES: &str = "dramesh_store_bytes";
    /// `dramesh_store_history_changes`.
    pub const STORE_HISTORY_CHANGES: &str = "dramesh_store_history_changes";
    /// `dramesh_store_documents`.
    pub const STORE_DOCUMENTS: &str = "dramesh_store_documents";
    /// `dramesh_reservations`.
    pub const RESERVATIONS: &str = "dramesh_reservations";
    /// `dramesh_reservation_events_total`.
    pub const RESERVATION_EVENTS_TOTAL: &str = "dramesh_reservation_events_total";
    /// `dramesh_view_data_age_seconds`.
    pub const VIEW_DATA_AGE_SECONDS: &str = "dramesh_view_data_age_seconds";
    /// `dramesh_agent_batches_total`.
    pub const AGENT_BATCHES_TOTAL: &str = "dramesh_agent_batches_total";
    /// `dramesh_http_connections`.
    pub const HTTP_CONNECTIONS: &str = "dramesh_http_connections";
    /// `dramesh_http_connections_closed_total`.
    pub const HTTP_CONNECTIONS_CLOSED_TOTAL: &str = "dramesh_http_connections_closed_total";
    /// `dramesh_grpc_connections`.
    pub const GRPC_CONNECTIONS: &str = "dramesh_grpc_connections";
    /// `dramesh_grpc_connections_refused_total`.
    pub const GRPC_CONNECTIONS_REFUSED_TOTAL: &str = "dramesh_grpc_connections_refused_total";
    /// See [`super::Metrics::api_refusals_total`].
    pub const API_REFUSALS_TOTAL: &str = "dramesh_api_refusals_total";
    /// See [`super::Metrics::tls_handshake_failures_total`].
    pub const TLS_HANDSHAKE_FAILURES_TOTAL: &str = "dramesh_tls_handshake_failures_total";
    /// See [`super::Metrics::api_inflight_bytes`].
    pub const API_INFLIGHT_BYTES: &str = "dramesh_api_inflight_bytes";
    /// See [`super::Metrics::api_inflight_budget_bytes`].
    pub const API_INFLIGHT_BUDGET_BYTES: &str = "dramesh_api_inflight_budget_bytes";
    /// See [`super::Metrics::api_admission_refusals_total`].
    pub const API_ADMISSION_REFUSALS_TOTAL: &str = "dramesh_api_admission_refusals_total";

    /// Every name above, in registration order.
    pub const ALL: &[&str] = &[
        API_REQUESTS_TOTAL,
        API_REQUEST_DURATION_SECONDS,
        API_ZERO_ANSWERS_TOTAL,
        ALLOC_SEARCH_DURATION_SECONDS,
        MESH_SYNC_LAG_SECONDS,
        MESH_PEER_DOCS_BEHIND,
        MESH_PEERS,
        MESH_BYTES_TOTAL,
        MESH_REJECTED_WRITES_TOTAL,
        STORE_BYTES,
        STORE_HISTORY_CHANGES,
        STORE_DOCUMENTS,
        RESERVATIONS,
        RESERVATION_EVENTS_TOTAL,
        VIEW_DATA_AGE_SECONDS,
        AGENT_BATCHES_TOTAL,
        HTTP_CONNECTIONS,
        HTTP_CONNECTIONS_CLOSED_TOTAL,
        GRPC_CONNECTIONS,
        GRPC_CONNECTIONS_REFUSED_TOTAL,
        API_REFUSALS_TOTAL,
        TLS_HANDSHAKE_FAILURES_TOTAL,
        API_INFLIGHT_BYTES,
        API_INFLIGHT_BUDGET_BYTES,
        API_ADMISSION_REFUSALS_TOTAL,
    ];
}

/// Request latency buckets: estimator answers are expected well under a millisecond when served
/// from the local view, so the low end is finer than the Prometheus default.
pub const API_LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Direction of mesh traffic, the `direction` label of `mesh_bytes_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Bytes this process sent to the peer.
    Sent,
    /// Bytes this process received from the peer.
    Received,
}

impl Direction {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Sent => "sent",
            Direction::Received => "received",
        }
    }
}

/// The `state` label of `reservations`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationLabel {
    /// Deducted from estimates.
    Live,
    /// Ended by its TTL.
    Expired,
    /// Lost an overcommit to another reservation.
    Conflicted,
}

impl ReservationLabel {
    /// Every state, in label order.
    pub const ALL: [ReservationLabel; 3] = [Self::Live, Self::Expired, Self::Conflicted];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Expired => "expired",
            Self::Conflicted => "conflicted",
        }
    }
}

/// Typed handles for every dramesh metric, plus the registry they render from.
pub struct Metrics {
    registry: Registry,
    /// `{api,method,code}`: API requests answered; `code` is the gRPC code name or HTTP status.
    pub api_requests_total: Arc<CounterVec<3>>,
    /// `{api,method}`: time from request decoded to response ready.
    pub api_request_duration_seconds: Arc<HistogramVec<2>>,
    /// `{method,reason}`: Karmada questions answered 0 instead of a computed number.
    pub api_zero_answers_total: Arc<CounterVec<2>>,
    /// `{method}`: time one estimation, placement or preemption search took on the view.
    pub alloc_search_duration_seconds: Arc<HistogramVec<1>>,
    /// `{peer,cluster}`: time since the newest change of `cluster` arrived from `peer`.
    pub mesh_sync_lag_seconds: Arc<GaugeVec<2>>,
    /// `{peer}`: documents the peer's last heartbeat reported as differing from ours.
    pub mesh_peer_docs_behind: Arc<GaugeVec<1>>,
    /// `{kind}`: live mesh connections by peer kind (`replica`, `agent`).
    pub mesh_peers: Arc<GaugeVec<1>>,
    /// `{peer,direction}`: mesh frame bytes.
    pub mesh_bytes_total: Arc<CounterVec<2>>,
    /// `{reason}`: replicated writes refused (unauthorized document, refused by the store, ...).
    pub mesh_rejected_writes_total: Arc<CounterVec<1>>,
    /// `{cluster}`: stored size of the cluster's documents.
    pub store_bytes: Arc<GaugeVec<1>>,
    /// `{cluster}`: automerge changes kept in the history of the cluster's documents.
    pub store_history_changes: Arc<GaugeVec<1>>,
    /// Documents held by the store.
    pub store_documents: Arc<Gauge>,
    /// `{state}`: reservations by state (`live`, `expired`, `conflicted`).
    pub reservations: Arc<GaugeVec<1>>,
    /// `{event}`: reservations that expired or lost a conflict (`expired`, `conflicted`).
    pub reservation_events_total: Arc<CounterVec<1>>,
    /// `{cluster}`: age of the cluster's data in the view answers are computed from.
    pub view_data_age_seconds: Arc<GaugeVec<1>>,
    /// `{result}`: agent change batches committed (`ok`) or refused by the store (`error`).
    pub agent_batches_total: Arc<CounterVec<1>>,
    /// `{listener}`: open connections of an HTTP listener.
    pub http_connections: Arc<GaugeVec<1>>,
    /// `{listener,reason}`: HTTP connections the server closed (`evicted_idle` to make room at
    /// the cap, `refused_at_cap`, `header_timeout`, `handshake_failed`).
    pub http_connections_closed_total: Arc<CounterVec<2>>,
    /// Open gRPC connections.
    pub grpc_connections: Arc<Gauge>,
    /// gRPC connections closed on accept because the cap was reached.
    pub grpc_connections_refused_total: Arc<Counter>,
    /// `{identity,reason}`: API requests refused as unauthenticated (401), forbidden (403) or
    /// over a per-identity cap (429).
    pub api_refusals_total: Arc<CounterVec<2>>,
    /// `{listener,reason}`: TLS handshakes that failed on an API or metrics listener
    /// (`timeout`, `closed`, `not_tls`, `unknown_ca`, `bad_certificate`, ...).
    pub tls_handshake_failures_total: Arc<CounterVec<2>>,
    /// Memory charged to API requests being computed (their expected cost, see the API's
    /// admission budget).
    pub api_inflight_bytes: Arc<Gauge>,
    /// The API's admission budget (`--api-max-inflight-bytes`).
    pub api_inflight_budget_bytes: Arc<Gauge>,
    /// `{api,reason}`: API requests refused before parsing because the budget (`budget`) or the
    /// caller's share of it (`identity_share`) stayed full, or their cost alone exceeds the
    /// share (`too_large`).
    pub api_admission_refusals_total: Arc<CounterVec<2>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("registry", &self.registry)
            .finish_non_exhaustive()
    }
}

impl Metrics {
    /// Every family registered, with no series yet.
    pub fn new() -> Self {
        Self::with_registry(Registry::new())
    }

    /// Registers the dramesh set into `registry`, which may already hold other families.
    ///
    /// # Panics
    /// If `registry` already holds one of the [`names`]: that is a programming error, not input.
    pub fn with_registry(registry: Registry) -> Self {
        use names::*;
        const REGISTERED: &str = "dramesh metric names are static, valid and registered once";
        let r = &registry;
        let api_requests_total = r
            .counter_vec(
                API_REQUESTS_TOTAL,
                "API requests answered, by API, method and result code.",
                ["api", "method", "code"],
            )
            .expect(REGISTERED);
        let api_request_duration_seconds = r
            .histogram_vec(
                API_REQUEST_DURATION_SECONDS,
                "Time to answer an API request, in seconds.",
                ["api", "method"],
                API_LATENCY_BUCKETS,
            )
            .expect(REGISTERED);
        let api_zero_answers_total = r
            .counter_vec(
                API_ZERO_ANSWERS_TOTAL,
                "Karmada estimator questions answered 0 instead of a computed number, by method and reason.",
                ["method", "reason"],
            )
            .expect(REGISTERED);
        let alloc_search_duration_seconds = r
            .histogram_vec(
                ALLOC_SEARCH_DURATION_SECONDS,
                "Time one estimation, placement or preemption search took on the view, in seconds.",
                ["method"],
                API_LATENCY_BUCKETS,
            )
            .expect(REGISTERED);
        let mesh_sync_lag_seconds = r
            .gauge_vec(
                MESH_SYNC_LAG_SECONDS,
                "Time since the newest change of a cluster arrived from a peer, in seconds.",
                ["peer", "cluster"],
            )
            .expect(REGISTERED);
        let mesh_peer_docs_behind = r
            .gauge_vec(
                MESH_PEER_DOCS_BEHIND,
                "Documents a peer's last heartbeat reported as differing from ours.",
                ["peer"],
            )
            .expect(REGISTERED);
        let mesh_peers = r
            .gauge_vec(MESH_PEERS, "Live mesh connections by peer kind.", ["kind"])
            .expect(REGISTERED);
        let mesh_bytes_total = r
            .counter_vec(
                MESH_BYTES_TOTAL,
                "Mesh frame bytes exchanged with a peer.",
                ["peer", "direction"],
            )
            .expect(REGISTERED);
        let mesh_rejected_writes_total = r
            .counter_vec(
                MESH_REJECTED_WRITES_TOTAL,
                "Replicated writes refused, by reason.",
                ["reason"],
            )
            .expect(REGISTERED);
        let store_bytes = r
            .gauge_vec(
                STORE_BYTES,
                "Stored size of a cluster's documents, in bytes.",
                ["cluster"],
            )
            .expect(REGISTERED);
        let store_history_changes = r
            .gauge_vec(
                STORE_HISTORY_CHANGES,
                "Changes kept in the history of a cluster's documents.",
                ["cluster"],
            )
            .expect(REGISTERED);
        let store_documents = r
            .gauge(STORE_DOCUMENTS, "Documents held by the store.")
            .expect(REGISTERED);
        let reservations = r
            .gauge_vec(
                RESERVATIONS,
                "Reservations by state (live, expired, conflicted).",
                ["state"],
            )
            .expect(REGISTERED);
        let reservation_events_total = r
            .counter_vec(
                RESERVATION_EVENTS_TOTAL,
                "Reservations that expired or lost a conflict, by event.",
                ["event"],
            )
            .expect(REGISTERED);
        let view_data_age_seconds = r
            .gauge_vec(
                VIEW_DATA_AGE_SECONDS,
                "Age of a cluster's data in the estimation view, in seconds.",
                ["cluster"],
            )
            .expect(REGISTERED);
        let agent_batches_total = r
            .counter_vec(
                AGENT_BATCHES_TOTAL,
                "Agent change batches, committed (ok) or refused by the store (error).",
                ["result"],
            )
            .expect(REGISTERED);
        let http_connections = r
            .gauge_vec(
                HTTP_CONNECTIONS,
                "Open connections of an HTTP listener.",
                ["listener"],
            )
            .expect(REGISTERED);
        let http_connections_closed_total = r
            .counter_vec(
                HTTP_CONNECTIONS_CLOSED_TOTAL,
                "HTTP connections closed by the server: evicted_idle (to make room at the cap), refused_at_cap, header_timeout, handshake_failed.",
                ["listener", "reason"],
            )
            .expect(REGISTERED);
        let grpc_connections = r
            .gauge(GRPC_CONNECTIONS, "Open gRPC connections.")
            .expect(REGISTERED);
        let grpc_connections_refused_total = r
            .counter(
                GRPC_CONNECTIONS_REFUSED_TOTAL,
                "gRPC connections closed on accept because the connection cap was reached.",
            )
            .expect(REGISTERED);
        let api_refusals_total = r
            .counter_vec(
                API_REFUSALS_TOTAL,
                "API requests refused (unauthenticated, forbidden, over a per-identity cap), by identity and reason.",
                ["identity", "reason"],
            )
            .expect(REGISTERED);
        let tls_handshake_failures_total = r
            .counter_vec(
                TLS_HANDSHAKE_FAILURES_TOTAL,
                "TLS handshakes that failed on a listener, by listener and reason.",
                ["listener", "reason"],
            )
            .expect(REGISTERED);
        let api_inflight_bytes = r
            .gauge(
                API_INFLIGHT_BYTES,
                "Memory charged to API requests being computed, in bytes.",
            )
            .expect(REGISTERED);
        let api_inflight_budget_bytes = r
            .gauge(
                API_INFLIGHT_BUDGET_BYTES,
                "The budget of memory API requests in progress may be charged, in bytes.",
            )
            .expect(REGISTERED);
        let api_admission_refusals_total = r
            .counter_vec(
                API_ADMISSION_REFUSALS_TOTAL,
                "API requests refused before parsing: budget full, the caller's share full, or too large alone.",
                ["api", "reason"],
            )
            .expect(REGISTERED);
        // Fixed label values are always present so a dashboard sees 0 rather than no data.
        for s in ReservationLabel::ALL {
            reservations.with([s.as_str()]);
        }
        for e in [ReservationLabel::Expired, ReservationLabel::Conflicted] {
            reservation_events_total.with([e.as_str()]);
        }
        for k in ["replica", "agent"] {
            mesh_peers.with([k]);
        }
        Self {
            registry,
            api_requests_total,
            api_request_duration_seconds,
            api_zero_answers_total,
            alloc_search_duration_seconds,
            mesh_sync_lag_seconds,
            mesh_peer_docs_behind,
            mesh_peers,
            mesh_bytes_total,
            mesh_rejected_writes_total,
            store_bytes,
            store_history_changes,
            store_documents,
            reservations,
            reservation_events_total,
            view_data_age_seconds,
            agent_batches_total,
            http_connections,
            http_connections_closed_total,
            grpc_connections,
            grpc_connections_refused_total,
            api_refusals_total,
            tls_handshake_failures_total,
            api_inflight_bytes,
            api_inflight_budget_bytes,
            api_admission_refusals_total,
        }
    }

    /// Counts a failed TLS handshake of `listener`.
    pub fn tls_handshake_failure(&self, listener: &str, reason: &str) {
        self.tls_handshake_failures_total
            .with([listener, reason])
            .inc();
    }

    /// Counts an HTTP connection of `listener` the server closed, and why.
    pub fn http_connection_closed(&self, listener: &str, reason: &str) {
        self.http_connections_closed_total
            .with([listener, reason])
            .inc();
    }

    /// The registry, for daemons that register extra families next to the dramesh set.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Everything in text exposition format 0.0.4 (serve with [`crate::CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        self.registry.render()
    }

    /// Counts one answered request and records its latency.
    pub fn observe_api_request(&self, api: &str, method: &str, code: &str, elapsed: Duration) {
        self.api_requests_total.with([api, method, code]).inc();
        self.api_request_duration_seconds
            .with([api, method])
            .observe(elapsed.as_secs_f64());
    }

    /// Starts timing a request; finish it with [`ApiTimer::finish`].
    pub fn start_api_request<'a>(&'a self, api: &'a str, method: &'a str) -> ApiTimer<'a> {
        ApiTimer {
            metrics: self,
            api,
            method,
            start: Instant::now(),
        }
    }

    /// Sets `mesh_sync_lag_seconds{peer, cluster}`.
    pub fn set_sync_lag(&self, peer: &str, cluster: &str, lag: Duration) {
        self.mesh_sync_lag_seconds
            .with([peer, cluster])
            .set(lag.as_secs_f64());
    }

    /// Adds to `mesh_bytes_total{peer, direction}`.
    pub fn add_mesh_bytes(&self, peer: &str, direction: Direction, bytes: u64) {
        self.mesh_bytes_total
            .with([peer, direction.as_str()])
            .inc_by(bytes);
    }

    /// Adds `n` to `mesh_rejected_writes_total{reason}`.
    pub fn reject_writes(&self, reason: &str, n: u64) {
        self.mesh_rejected_writes_total.with([reason]).inc_by(n);
    }

    /// Drops every per-peer series of a peer that left the mesh.
    pub fn forget_peer(&self, peer: &str) {
        self.mesh_sync_lag_seconds.retain(|[p, _]| p != peer);
        self.mesh_peer_docs_behind.retain(|[p]| p != peer);
        self.mesh_bytes_total.retain(|[p, _]| p != peer);
    }

    /// Sets the reservation gauges to the numbers currently held in each state.
    pub fn set_reservations(&self, live: u64, expired: u64, conflicted: u64) {
        for (s, n) in ReservationLabel::ALL
            .into_iter()
            .zip([live, expired, conflicted])
        {
            self.reservations.with([s.as_str()]).set(n as f64);
        }
    }

    /// Counts reservations that just expired or lost a conflict (`Live` is not an event and
    /// is ignored).
    pub fn reservation_events(&self, event: ReservationLabel, n: u64) {
        if event != ReservationLabel::Live {
            self.reservation_events_total
                .with([event.as_str()])
                .inc_by(n);
        }
    }

    /// Counts a Karmada question answered 0 instead of a computed number.
    pub fn zero_answer(&self, method: &str, reason: &str) {
        self.api_zero_answers_total.with([method, reason]).inc();
    }

    /// Records how long one estimation/placement/preemption search took.
    pub fn observe_alloc_search(&self, method: &str, elapsed: Duration) {
        self.alloc_search_duration_seconds
            .with([method])
            .observe(elapsed.as_secs_f64());
    }

    /// Sum of `api_requests_total` over `(api, method)` series whose code satisfies `code`.
    pub fn api_requests(&self, api: &str, method: &str, code: impl Fn(&str) -> bool) -> u64 {
        let mut n = 0;
        self.api_requests_total.for_each(|[a, m, c], v| {
            if a == api && m == method && code(c) {
                n += v.get();
            }
        });
        n
    }

    /// `api_zero_answers_total` of one method and reason.
    pub fn zero_answers(&self, method: &str, reason: &str) -> u64 {
        self.api_zero_answers_total
            .get([method, reason])
            .map_or(0, |c| c.get())
    }

    /// Sets `view_data_age_seconds{cluster}`.
    pub fn set_view_data_age(&self, cluster: &str, age: Duration) {
        self.view_data_age_seconds
            .with([cluster])
            .set(age.as_secs_f64());
    }
}

/// Times one API request from [`Metrics::start_api_request`] to [`ApiTimer::finish`].
#[must_use = "call finish(code) to record the request"]
pub struct ApiTimer<'a> {
    metrics: &'a Metrics,
    api: &'a str,
    method: &'a str,
    start: Instant,
}

impl ApiTimer<'_> {
    /// Records the request with its result code; returns the elapsed time.
    pub fn finish(self, code: &str) -> Duration {
        let elapsed = self.start.elapsed();
        self.metrics
            .observe_api_request(self.api, self.method, code, elapsed);
        elapsed
    }
}
