//! The computation behind the APIs, supplied by the caller (the `dramesh replica` command
//! implements it with the estimator crate over the replicated view).
//!
//! Methods are synchronous and may be CPU-heavy: the servers call them on Tokio's blocking
//! pool, each under the configured timeout, so an implementation needs no async code. They
//! must be safe to call concurrently.

use std::time::Duration;

use crate::auth::Caller;
use crate::native::{
    EstimateRequest, EstimateResponse, PlaceRequest, PlaceResponse, PreemptRequest,
    PreemptResponse, ReservationStatus, ReserveRequest, RetiredCluster, StatusReport,
};
use crate::query::{ComponentSetQuery, ReplicaQuery, UnschedulableQuery};

/// The answer to one Karmada estimator question for one cluster.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplicaAnswer {
    /// The computed number (replicas, sets or unschedulable replicas). Values outside
    /// `0..=i32::MAX` are clamped on the wire.
    Count(i64),
    /// The device allocation search ran out of budget on `nodes` nodes: at least `at_least`
    /// replicas fit, whether more do is unknown. Answered as `at_least` (Karmada has no
    /// "unknown"); a 0 answered this way is logged and counted apart from a proven 0.
    Unknown {
        /// The replicas found before the search gave up (a lower bound).
        at_least: i64,
        /// Nodes where it gave up.
        nodes: u32,
    },
    /// The cluster is not in the view. Answered as 0, logged and counted.
    UnknownCluster,
    /// The cluster's data is older than the staleness limit. Answered as 0, logged and counted.
    Stale {
        /// Time since the cluster's writers were last heard from.
        age: Duration,
    },
    /// The computation failed for this cluster (e.g. a claim template the engine cannot
    /// evaluate). Answered as 0, logged and counted: karmada-scheduler drops every cluster's
    /// accurate answer when one estimator errors, so an error would hurt all clusters.
    Failed(String),
}

/// A native API error; maps to a gRPC status code and an HTTP status.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed (bad manifests, no workload, ...): gRPC InvalidArgument, HTTP 400.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A named object (e.g. a cluster) does not exist: gRPC NotFound, HTTP 404.
    #[error("not found: {0}")]
    NotFound(String),
    /// The replica cannot answer yet (view not loaded): gRPC Unavailable, HTTP 503.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// Refused before it was parsed: the API memory budget or the caller's share of it stayed
    /// full ([`crate::admission`]): gRPC ResourceExhausted, HTTP 503.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// Anything else: gRPC Internal, HTTP 500.
    #[error("internal error: {0}")]
    Internal(String),
    /// Refused for who the caller is: HTTP 401/403/429, gRPC
    /// UNAUTHENTICATED/PERMISSION_DENIED/RESOURCE_EXHAUSTED (see [`crate::auth`]).
    #[error("{0}")]
    Refused(crate::auth::Refusal),
}

/// What a replica computes. See the module docs for the calling convention.
pub trait Backend: Send + Sync + 'static {
    /// Karmada `MaxAvailableReplicas` for `q.cluster`.
    fn max_available_replicas(&self, q: &ReplicaQuery) -> ReplicaAnswer;
    /// Karmada `MaxAvailableComponentSets` for `q.cluster`.
    fn max_available_component_sets(&self, q: &ComponentSetQuery) -> ReplicaAnswer;
    /// Karmada `GetUnschedulableReplicas` for `q.cluster`.
    fn unschedulable_replicas(&self, q: &UnschedulableQuery) -> ReplicaAnswer;
    /// Max available replicas on every cluster (or `req.clusters`).
    fn estimate_all(&self, req: &EstimateRequest) -> Result<EstimateResponse, ApiError>;
    /// Divides the workload's replicas over clusters by its propagation policy.
    fn place(&self, req: &PlaceRequest) -> Result<PlaceResponse, ApiError>;
    /// Chooses victims so that the workload fits on one cluster.
    fn preempt(&self, req: &PreemptRequest) -> Result<PreemptResponse, ApiError>;
    /// The replica's view. The server overwrites `ready` with its ready flag.
    fn status(&self) -> StatusReport;
    /// Writes an in-flight reservation owned by this replica and created by `caller`, within
    /// the caller's caps, and returns its state after overcommit resolution on this replica.
    fn reserve(
        &self,
        caller: &Caller,
        req: &ReserveRequest,
    ) -> Result<ReservationStatus, ApiError> {
        let _ = (caller, req);
        Err(no_reservations())
    }
    /// Releases a reservation this replica owns, if `caller` created it or is an admin.
    fn release(&self, caller: &Caller, id: &str) -> Result<ReservationStatus, ApiError> {
        let _ = (caller, id);
        Err(no_reservations())
    }
    /// One reservation (own or merged from another replica), or a recently ended one.
    fn reservation(&self, id: &str) -> Result<ReservationStatus, ApiError> {
        let _ = id;
        Err(no_reservations())
    }
    /// Every reservation this replica knows, ordered by id.
    fn reservations(&self) -> Result<Vec<ReservationStatus>, ApiError> {
        Err(no_reservations())
    }
    /// Retires member cluster `name` from the fleet on behalf of API identity `by`, through
    /// replicated state (every replica drops it; see [`RetiredCluster`]).
    fn retire_cluster(&self, name: &str, by: &str) -> Result<RetiredCluster, ApiError> {
        let _ = (name, by);
        Err(ApiError::Unavailable(
            "this backend cannot retire clusters".into(),
        ))
    }
}

fn no_reservations() -> ApiError {
    ApiError::Unavailable("this backend keeps no reservations".into())
}
