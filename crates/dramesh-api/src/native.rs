//! Request and response types of the native dramesh API, shared by the `dramesh.v1` gRPC
//! service and the HTTP/JSON endpoints.
//!
//! JSON uses camelCase names; optional fields are omitted when unset. The response types
//! serialise exactly like the estimator crate's result types (`Estimate`,
//! `PlacementResult`, `PreemptionResult`) and are converted from them by `From` impls that
//! name every field, so a field changed on one side only fails to compile. Conversions to and from the protobuf
//! messages are lossless. The conversions from protobuf are `From`, except where a message
//! carries a reservation (`TryFrom`): an unspecified or unknown reservation state has no safe
//! native reading and is refused with [`UnknownReservationState`].

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use crate::proto::native as pb;

/// The workload, as Kubernetes manifests: exactly one Deployment, StatefulSet, Job or Pod,
/// plus the ResourceClaimTemplates it references, its PriorityClass and optionally a
/// (Cluster)PropagationPolicy. Each item is YAML or JSON text and may hold several
/// documents. Over HTTP an item may also be a JSON object, which is kept as JSON text.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Workload {
    /// The manifest texts.
    #[serde(deserialize_with = "manifests_de")]
    pub manifests: Vec<String>,
}

fn manifests_de<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Doc {
        Text(String),
        Object(serde_json::Value),
    }
    let docs = Vec::<Doc>::deserialize(d)?;
    Ok(docs
        .into_iter()
        .map(|d| match d {
            Doc::Text(s) => s,
            Doc::Object(v) => v.to_string(),
        })
        .collect())
}

/// Body of `POST /v1/estimate`: the workload and, optionally, the clusters to estimate for.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EstimateRequest {
    /// The workload to estimate.
    pub workload: Workload,
    /// Restrict to these clusters; all clusters of the view when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clusters: Vec<String>,
}

/// The estimate of one cluster (the estimator's `ClusterEstimate` on the wire).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterEstimate {
    /// Cluster name.
    pub name: String,
    /// How many replicas of the workload fit.
    pub max_replicas: i64,
    /// What limited the answer: a resource name, `pods`, `devices`, `quota:<name>`,
    /// `unknown: allocation budget exhausted on N node(s)` (`maxReplicas` is then a lower
    /// bound, not a proof that no more fit), ...
    #[serde(default)]
    pub limited_by: String,
    /// Excluded node counts by reason (`nodeSelector`, `nodeAffinity`, `taints`, `unschedulable`).
    #[serde(default)]
    pub excluded_nodes: BTreeMap<String, u32>,
    /// Nodes that passed the filters.
    #[serde(default)]
    pub nodes_considered: u32,
    /// How many considered nodes limit on each factor.
    #[serde(default)]
    pub limits: BTreeMap<String, u32>,
    /// The cluster's Kubernetes version, when its agent reported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes_version: Option<String>,
    /// Why the cluster could not be estimated (e.g. a missing DeviceClass).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Replicas of assumed (in-flight) workloads that fit on no node and so were not
    /// deducted from `maxReplicas`; omitted when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub assumed_unplaced: i64,
    /// Considered nodes whose device allocation search ran out of budget: whether one more
    /// replica fits there is unknown; omitted when 0.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub unknown_nodes: u32,
    /// The cluster's data is older than the replica's staleness limit (`--stale-after`).
    #[serde(default)]
    pub stale: bool,
    /// Seconds since the cluster's writers were last heard from on the answering replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_age_seconds: Option<f64>,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

/// Answer to `POST /v1/estimate`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EstimateResponse {
    /// One estimate per cluster.
    pub clusters: Vec<ClusterEstimate>,
    /// Sum of `maxReplicas` over the clusters.
    pub total: i64,
}

/// How current one cluster's data is on the answering replica; what every native answer
/// reports per cluster. The replica decides it (one rule: older than `--stale-after`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Freshness {
    /// Older than the staleness limit.
    pub stale: bool,
    /// Seconds since the cluster's writers were last heard from, when they ever were.
    pub data_age_seconds: Option<f64>,
}

/// Body of `POST /v1/place`: the workload with its PropagationPolicy among the manifests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PlaceRequest {
    /// The workload and its policy.
    pub workload: Workload,
    /// Restrict to these clusters; all clusters of the view when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clusters: Vec<String>,
    /// Overrides the workload's replica count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i64>,
}

/// Replicas assigned to one cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TargetCluster {
    /// Cluster name.
    pub name: String,
    /// Replicas assigned.
    pub replicas: i64,
}

/// Answer to `POST /v1/place` (the estimator's `PlacementResult` on the wire).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlaceResponse {
    /// The policy applied.
    pub policy: String,
    /// Its replica scheduling strategy.
    pub strategy: String,
    /// Replicas placed in all.
    pub replicas: i64,
    /// The assignment.
    pub clusters: Vec<TargetCluster>,
    /// Available replicas of each candidate cluster (from the estimate).
    #[serde(default)]
    pub available: BTreeMap<String, i64>,
    /// Clusters the policy's affinity excluded.
    #[serde(default)]
    pub filtered_out: Vec<String>,
    /// Why the replicas could not all be placed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unschedulable: Option<String>,
    /// Clusters left out because their data is stale (placement never chooses them).
    #[serde(default)]
    pub stale: Vec<String>,
    /// Seconds since each cluster's writers were last heard from on the answering replica.
    #[serde(default)]
    pub data_age_seconds: BTreeMap<String, f64>,
}

/// Body of `POST /v1/preempt`: the preemptor workload.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PreemptRequest {
    /// The preemptor and optionally a policy restricting the clusters.
    pub workload: Workload,
    /// Restrict to these clusters; all clusters of the view when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clusters: Vec<String>,
    /// Overrides the workload's replica count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i64>,
}

/// One evicted workload.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Victim {
    /// Its namespace.
    pub namespace: String,
    /// Its kind.
    pub kind: String,
    /// Its name.
    pub name: String,
    /// Its priority.
    pub priority: i32,
    /// Pods evicted.
    pub pods: u32,
    /// Requests given back by its pods.
    #[serde(default)]
    pub freed: BTreeMap<String, String>,
}

/// Preemption outcome on one cluster.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPreemption {
    /// Cluster name.
    pub name: String,
    /// Whether evicting the victims makes the preemptor fit.
    pub feasible: bool,
    /// Replicas of the preemptor that fit before eviction.
    pub replicas_before: i64,
    /// Replicas that fit after evicting the victims.
    pub replicas_after: i64,
    /// The workloads to evict.
    #[serde(default)]
    pub victims: Vec<Victim>,
    /// Requests freed by all victims.
    #[serde(default)]
    pub freed: BTreeMap<String, String>,
    /// Pods evicted in all.
    #[serde(default)]
    pub evicted_pods: u32,
    /// The highest priority among the victims.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highest_victim_priority: Option<i32>,
    /// Why preemption is not feasible here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The cluster's data is older than the replica's staleness limit (`--stale-after`): never chosen.
    #[serde(default)]
    pub stale: bool,
    /// Seconds since the cluster's writers were last heard from on the answering replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_age_seconds: Option<f64>,
}

/// Answer to `POST /v1/preempt` (the estimator's `PreemptionResult` on the wire).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreemptResponse {
    /// The preemptor workload.
    pub preemptor: String,
    /// Its priority.
    pub priority: i32,
    /// Replicas it needs.
    pub replicas: i64,
    /// A cluster that already fits the workload: no preemption is needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fits_without_preemption: Option<String>,
    /// The cluster chosen for preemption.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chosen: Option<String>,
    /// The outcome per candidate cluster.
    #[serde(default)]
    pub clusters: Vec<ClusterPreemption>,
    /// Why no cluster was chosen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Amounts of one resource; quantities as strings (`"64"`, `"250Gi"`, `"3500m"`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceAmount {
    /// Resource name.
    pub name: String,
    /// Allocatable amount.
    pub allocatable: String,
    /// Requested by bound pods.
    pub consumed: String,
    /// Allocatable minus consumed.
    pub free: String,
}

/// The devices of one DeviceClass in a cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceClassStatus {
    /// DeviceClass name.
    pub class: String,
    /// Devices matching the class.
    pub devices: u32,
    /// Of those, allocated.
    pub allocated: u32,
    /// Of those, not allocated.
    pub free: u32,
    /// Consumable device capacity summed over the class's devices.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capacity: Vec<ResourceAmount>,
}

/// One cluster of the replica's view.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    /// Cluster name.
    pub name: String,
    /// The Kubernetes version its agent reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes_version: Option<String>,
    /// The view's change counter for the cluster.
    pub generation: u64,
    /// Seconds since the cluster's agent last published, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_age_seconds: Option<f64>,
    /// Older than the replica's staleness limit: Karmada estimates answer 0.
    pub stale: bool,
    /// Nodes in the view.
    pub nodes: u32,
    /// Pods in the view.
    pub pods: u32,
    /// Allocatable, consumed and free amounts per resource.
    #[serde(default)]
    pub resources: Vec<ResourceAmount>,
    /// Devices per DeviceClass.
    #[serde(default)]
    pub devices: Vec<DeviceClassStatus>,
}

/// The replica's view. `ready` is filled in by the server from its ready flag.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusReport {
    /// The answering replica's id.
    pub replica: String,
    /// Whether the replica is ready (see `/readyz`).
    #[serde(default)]
    pub ready: bool,
    /// Every cluster of the view.
    pub clusters: Vec<ClusterStatus>,
    /// Every reservation this replica knows (its own and merged ones), ordered by id.
    #[serde(default)]
    pub reservations: Vec<ReservationStatus>,
    /// Every member cluster retired from the fleet, ordered by name.
    #[serde(default)]
    pub retired: Vec<RetiredCluster>,
}

/// A member cluster retired from the fleet (`DELETE /v1/clusters/{name}`): every replica drops
/// its documents and refuses every generation of them that does not rejoin after
/// `retired_at_ms`, so only an agent started with `dramesh agent --rejoin` brings it back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RetiredCluster {
    /// The cluster.
    pub name: String,
    /// When it was retired: the retiring replica's wall clock, milliseconds since the epoch.
    pub retired_at_ms: u64,
    /// The replica that retired it.
    pub replica: String,
    /// The API identity that asked for it.
    pub by: String,
}

impl From<RetiredCluster> for pb::RetiredCluster {
    fn from(r: RetiredCluster) -> Self {
        pb::RetiredCluster {
            name: r.name,
            retired_at_ms: r.retired_at_ms,
            replica: r.replica,
            by: r.by,
        }
    }
}

impl From<pb::RetiredCluster> for RetiredCluster {
    fn from(r: pb::RetiredCluster) -> Self {
        RetiredCluster {
            name: r.name,
            retired_at_ms: r.retired_at_ms,
            replica: r.replica,
            by: r.by,
        }
    }
}

/// `POST /v1/reservations`: hold capacity for `replicas` replicas of the workload on
/// `cluster` until the member cluster reports them bound, the reservation is released, or
/// `ttlSeconds` pass.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReserveRequest {
    /// The per-replica requirements, as for an estimate.
    pub workload: Workload,
    /// The member cluster to reserve on.
    pub cluster: String,
    /// Defaults to the workload's own replica count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i64>,
    /// Defaults to the workload's priority (its PriorityClass, else 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// Defaults to the replica's reservation TTL (300 s); at most 86,400.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
}

/// The workload a reservation is for (pods it owns end the reservation once bound).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadRef {
    /// Namespace.
    pub namespace: String,
    /// Kind (Deployment, StatefulSet, Job, Pod).
    pub kind: String,
    /// Name.
    pub name: String,
}

/// Lifecycle state of a reservation as one replica sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ReservationState {
    /// Admitted by overcommit resolution: deducted from estimates.
    #[default]
    Live,
    /// Lost overcommit resolution: holds nothing (see `winner`).
    Conflicted,
    /// Its time to live passed.
    Expired,
    /// The member cluster reports all its replicas bound.
    Satisfied,
    /// Released by its owner.
    Released,
}

/// One reservation and its state on the answering replica.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReservationStatus {
    /// Reservation id (`<owner>-<seq>`).
    pub id: String,
    /// The replica that wrote it (the only one that can release it).
    pub owner: String,
    /// The member cluster it holds capacity on.
    pub cluster: String,
    /// The workload it is for.
    pub workload: WorkloadRef,
    /// Replicas reserved.
    pub replicas: i64,
    /// Replicas still held: `replicas` minus those bound since the reservation was made.
    pub remaining: i64,
    /// Rank in overcommit resolution (higher first).
    pub priority: i32,
    /// Time to live from creation.
    pub ttl_seconds: u64,
    /// Its state on this replica.
    pub status: ReservationState,
    /// For a conflicted reservation: the highest-ranked live reservation of its cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub winner: Option<String>,
    /// Why it is conflicted when no winner explains it (unknown cluster, estimator error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Seconds until this replica considers it expired (live and conflicted only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_seconds: Option<f64>,
}

/// `GET /v1/reservations`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReservationList {
    /// The reservations, ordered by id.
    pub reservations: Vec<ReservationStatus>,
}

// ---------------------------------------------------------------------------------------
// protobuf <-> native

/// `From` both ways between a native type and its protobuf message, field by field; the
/// struct literals name every field, so a field added on one side only fails to compile.
/// `plain` fields move as they are; `each` fields are collections converted element by
/// element (`Vec<A>` to `Vec<B>`, `BTreeMap` to `HashMap`); `required` fields are message
/// fields that protobuf makes optional and the native type always has (absent reads as the
/// default).
macro_rules! mirror {
    ($native:ident <=> $wire:ident {
        plain: [$($plain:ident),* $(,)?]
        $(, each: [$($each:ident),* $(,)?])?
        $(, required: [$($req:ident),* $(,)?])?
        $(,)?
    }) => {
        impl From<pb::$wire> for $native {
            fn from(w: pb::$wire) -> Self {
                $native {
                    $($plain: w.$plain,)*
                    $($($each: w.$each.into_iter().map(Into::into).collect(),)*)?
                    $($($req: w.$req.map(Into::into).unwrap_or_default(),)*)?
                }
            }
        }

        impl From<$native> for pb::$wire {
            fn from(n: $native) -> Self {
                pb::$wire {
                    $($plain: n.$plain,)*
                    $($($each: n.$each.into_iter().map(Into::into).collect(),)*)?
                    $($($req: Some(n.$req.into()),)*)?
                }
            }
        }
    };
}

mirror!(Workload <=> Workload { plain: [manifests] });
mirror!(EstimateRequest <=> EstimateRequest {
    plain: [clusters],
    required: [workload],
});
mirror!(PlaceRequest <=> PlaceRequest {
    plain: [clusters, replicas],
    required: [workload],
});
mirror!(PreemptRequest <=> PreemptRequest {
    plain: [clusters, replicas],
    required: [workload],
});
mirror!(ReserveRequest <=> ReserveRequest {
    plain: [cluster, replicas, priority, ttl_seconds],
    required: [workload],
});
mirror!(ClusterEstimate <=> ClusterEstimate {
    plain: [name, max_replicas, limited_by, nodes_considered, kubernetes_version, error, assumed_unplaced, unknown_nodes, stale, data_age_seconds],
    each: [excluded_nodes, limits],
});
mirror!(EstimateResponse <=> EstimateResponse {
    plain: [total],
    each: [clusters],
});
mirror!(TargetCluster <=> TargetCluster { plain: [name, replicas] });
mirror!(PlaceResponse <=> PlaceResponse {
    plain: [policy, strategy, replicas, filtered_out, unschedulable, stale],
    each: [clusters, available, data_age_seconds],
});
mirror!(Victim <=> Victim {
    plain: [namespace, kind, name, priority, pods],
    each: [freed],
});
mirror!(ClusterPreemption <=> ClusterPreemption {
    plain: [name, feasible, replicas_before, replicas_after, evicted_pods, highest_victim_priority, reason, stale, data_age_seconds],
    each: [victims, freed],
});
mirror!(PreemptResponse <=> PreemptResponse {
    plain: [preemptor, priority, replicas, fits_without_preemption, chosen, reason],
    each: [clusters],
});
mirror!(ResourceAmount <=> ResourceAmount { plain: [name, allocatable, consumed, free] });
mirror!(DeviceClassStatus <=> DeviceClassStatus {
    plain: [class, devices, allocated, free],
    each: [capacity],
});
mirror!(ClusterStatus <=> ClusterStatus {
    plain: [name, kubernetes_version, generation, data_age_seconds, stale, nodes, pods],
    each: [resources, devices],
});
mirror!(WorkloadRef <=> WorkloadRef { plain: [namespace, kind, name] });

impl From<StatusReport> for pb::StatusResponse {
    fn from(s: StatusReport) -> Self {
        pb::StatusResponse {
            replica: s.replica,
            ready: s.ready,
            clusters: s.clusters.into_iter().map(Into::into).collect(),
            reservations: s.reservations.into_iter().map(Into::into).collect(),
            retired: s.retired.into_iter().map(Into::into).collect(),
        }
    }
}

/// Fails only on a reservation whose state this version does not know.
impl TryFrom<pb::StatusResponse> for StatusReport {
    type Error = UnknownReservationState;

    fn try_from(s: pb::StatusResponse) -> Result<Self, Self::Error> {
        Ok(StatusReport {
            replica: s.replica,
            ready: s.ready,
            clusters: s.clusters.into_iter().map(Into::into).collect(),
            reservations: reservations_from_pb(s.reservations)?,
            retired: s.retired.into_iter().map(Into::into).collect(),
        })
    }
}

impl From<ReservationState> for pb::ReservationState {
    fn from(s: ReservationState) -> Self {
        match s {
            ReservationState::Live => pb::ReservationState::Live,
            ReservationState::Conflicted => pb::ReservationState::Conflicted,
            ReservationState::Expired => pb::ReservationState::Expired,
            ReservationState::Satisfied => pb::ReservationState::Satisfied,
            ReservationState::Released => pb::ReservationState::Released,
        }
    }
}

/// A protobuf reservation whose `status` is unspecified or a value this version does not
/// know (e.g. a state added by a newer replica). There is no safe native reading of it: a
/// live reservation holds capacity and an ended one does not.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reservation {id:?}: field status has unknown value {value}")]
pub struct UnknownReservationState {
    /// The reservation's id.
    pub id: String,
    /// The protobuf enum value found.
    pub value: i32,
}

impl From<ReservationStatus> for pb::Reservation {
    fn from(r: ReservationStatus) -> Self {
        pb::Reservation {
            id: r.id,
            owner: r.owner,
            cluster: r.cluster,
            workload: Some(r.workload.into()),
            replicas: r.replicas,
            remaining: r.remaining,
            priority: r.priority,
            ttl_seconds: r.ttl_seconds,
            status: pb::ReservationState::from(r.status).into(),
            winner: r.winner,
            reason: r.reason,
            expires_in_seconds: r.expires_in_seconds,
        }
    }
}

impl TryFrom<pb::Reservation> for ReservationStatus {
    type Error = UnknownReservationState;

    fn try_from(r: pb::Reservation) -> Result<Self, Self::Error> {
        let status = match pb::ReservationState::try_from(r.status) {
            Ok(pb::ReservationState::Live) => ReservationState::Live,
            Ok(pb::ReservationState::Conflicted) => ReservationState::Conflicted,
            Ok(pb::ReservationState::Expired) => ReservationState::Expired,
            Ok(pb::ReservationState::Satisfied) => ReservationState::Satisfied,
            Ok(pb::ReservationState::Released) => ReservationState::Released,
            Ok(pb::ReservationState::Unspecified) | Err(_) => {
                return Err(UnknownReservationState {
                    id: r.id,
                    value: r.status,
                });
            }
        };
        Ok(ReservationStatus {
            id: r.id,
            owner: r.owner,
            cluster: r.cluster,
            workload: r.workload.map(Into::into).unwrap_or_default(),
            replicas: r.replicas,
            remaining: r.remaining,
            priority: r.priority,
            ttl_seconds: r.ttl_seconds,
            status,
            winner: r.winner,
            reason: r.reason,
            expires_in_seconds: r.expires_in_seconds,
        })
    }
}

/// The one place a list of protobuf reservations becomes native (status and list answers).
fn reservations_from_pb(
    rs: Vec<pb::Reservation>,
) -> Result<Vec<ReservationStatus>, UnknownReservationState> {
    rs.into_iter().map(TryInto::try_into).collect()
}

impl From<ReservationList> for pb::ListReservationsResponse {
    fn from(l: ReservationList) -> Self {
        pb::ListReservationsResponse {
            reservations: l.reservations.into_iter().map(Into::into).collect(),
        }
    }
}

impl TryFrom<pb::ListReservationsResponse> for ReservationList {
    type Error = UnknownReservationState;

    fn try_from(l: pb::ListReservationsResponse) -> Result<Self, Self::Error> {
        Ok(ReservationList {
            reservations: reservations_from_pb(l.reservations)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_accept_text_and_objects() {
        let r: EstimateRequest = serde_json::from_value(serde_json::json!({
            "workload": {"manifests": ["kind: Deployment\n", {"kind": "ResourceClaimTemplate"}]},
        }))
        .expect("request");
        assert_eq!(r.workload.manifests[0], "kind: Deployment\n");
        let obj: serde_json::Value =
            serde_json::from_str(&r.workload.manifests[1]).expect("json text");
        assert_eq!(obj["kind"], "ResourceClaimTemplate");
        assert!(r.clusters.is_empty());
    }

    #[test]
    fn status_roundtrips_through_protobuf() {
        let s = StatusReport {
            replica: "r1".into(),
            ready: true,
            clusters: vec![ClusterStatus {
                name: "c1".into(),
                kubernetes_version: Some("1.36.0".into()),
                generation: 7,
                data_age_seconds: Some(1.5),
                stale: false,
                nodes: 3,
                pods: 10,
                resources: vec![ResourceAmount {
                    name: "cpu".into(),
                    allocatable: "96".into(),
                    consumed: "10500m".into(),
                    free: "85500m".into(),
                }],
                devices: vec![DeviceClassStatus {
                    class: "gpu.example.com".into(),
                    devices: 8,
                    allocated: 2,
                    free: 6,
                    capacity: vec![],
                }],
            }],
            reservations: vec![],
            retired: vec![RetiredCluster {
                name: "c9".into(),
                retired_at_ms: 1_790_000_000_000,
                replica: "r2".into(),
                by: "admin".into(),
            }],
        };
        let back = StatusReport::try_from(pb::StatusResponse::from(s.clone())).expect("known");
        assert_eq!(back, s);
        assert_eq!(
            serde_json::to_value(&s).expect("json")["retired"][0]["retiredAtMs"],
            1_790_000_000_000u64
        );
        let json = serde_json::to_value(&s).expect("json");
        assert_eq!(json["clusters"][0]["dataAgeSeconds"], 1.5);
        assert_eq!(
            json["clusters"][0]["devices"][0]["class"],
            "gpu.example.com"
        );
    }

    #[test]
    fn reservation_json_shape() {
        let r: ReserveRequest = serde_json::from_value(serde_json::json!({
            "workload": {"manifests": ["kind: Deployment\n"]},
            "cluster": "c1", "replicas": 8, "ttlSeconds": 60,
        }))
        .expect("request");
        assert_eq!(
            (r.replicas, r.priority, r.ttl_seconds),
            (Some(8), None, Some(60))
        );
        let s = ReservationStatus {
            id: "r1-1".into(),
            status: ReservationState::Conflicted,
            winner: Some("r2-1".into()),
            ..ReservationStatus::default()
        };
        let v = serde_json::to_value(&s).expect("json");
        assert_eq!(v["status"], "conflicted");
        assert_eq!(v["winner"], "r2-1");
        assert!(v.get("reason").is_none());
        let back: ReservationStatus = serde_json::from_value(v).expect("back");
        assert_eq!(back, s);
    }

    #[test]
    fn reservations_roundtrip_through_protobuf() {
        let states = [
            ReservationState::Live,
            ReservationState::Conflicted,
            ReservationState::Expired,
            ReservationState::Satisfied,
            ReservationState::Released,
        ];
        let list = ReservationList {
            reservations: states
                .iter()
                .enumerate()
                .map(|(i, &status)| ReservationStatus {
                    id: format!("r1-{i}"),
                    owner: "r1".into(),
                    cluster: "c1".into(),
                    workload: WorkloadRef {
                        namespace: "ml".into(),
                        kind: "Deployment".into(),
                        name: "train".into(),
                    },
                    replicas: 4,
                    remaining: 3,
                    priority: -5,
                    ttl_seconds: 120,
                    status,
                    winner: (status == ReservationState::Conflicted).then(|| "r2-1".into()),
                    reason: Some("why".into()),
                    expires_in_seconds: Some(42.5),
                })
                .collect(),
        };
        let wire = pb::ListReservationsResponse::from(list.clone());
        let distinct: std::collections::BTreeSet<i32> =
            wire.reservations.iter().map(|r| r.status).collect();
        assert_eq!(distinct.len(), states.len());
        assert!(!distinct.contains(&(pb::ReservationState::Unspecified as i32)));
        assert_eq!(ReservationList::try_from(wire.clone()), Ok(list));

        let mut unknown = wire;
        unknown.reservations[1].status = 99;
        let e = ReservationList::try_from(unknown).expect_err("unknown state");
        assert_eq!(e.id, "r1-1");
        assert!(e.to_string().contains("field status"), "{e}");
        let unspecified = pb::Reservation {
            id: "x".into(),
            ..Default::default()
        };
        assert!(ReservationStatus::try_from(unspecified).is_err());

        let req = ReserveRequest {
            workload: Workload {
                manifests: vec!["kind: Pod\n".into()],
            },
            cluster: "c1".into(),
            replicas: Some(2),
            priority: None,
            ttl_seconds: Some(30),
        };
        assert_eq!(
            ReserveRequest::from(pb::ReserveRequest::from(req.clone())),
            req
        );
    }

    #[test]
    fn estimate_roundtrips_through_protobuf_and_json() {
        let r = EstimateResponse {
            clusters: vec![
                ClusterEstimate {
                    name: "c1".into(),
                    max_replicas: 5,
                    limited_by: "devices".into(),
                    excluded_nodes: BTreeMap::from([("taints".to_string(), 2)]),
                    nodes_considered: 3,
                    limits: BTreeMap::from([("devices".to_string(), 3)]),
                    kubernetes_version: Some("1.36.0".into()),
                    error: None,
                    assumed_unplaced: 2,
                    unknown_nodes: 1,
                    stale: false,
                    data_age_seconds: Some(1.5),
                },
                ClusterEstimate {
                    name: "c2".into(),
                    max_replicas: 0,
                    limited_by: "error".into(),
                    error: Some("no DeviceClass gpu".into()),
                    stale: true,
                    data_age_seconds: Some(300.25),
                    ..ClusterEstimate::default()
                },
            ],
            total: 5,
        };
        let wire = pb::EstimateResponse::from(r.clone());
        assert_eq!(wire.clusters[0].assumed_unplaced, 2);
        assert_eq!(wire.clusters[0].unknown_nodes, 1);
        assert_eq!(EstimateResponse::from(wire), r);

        let json = serde_json::to_value(&r).expect("json");
        assert_eq!(json["clusters"][0]["assumedUnplaced"], 2);
        assert!(json["clusters"][1].get("assumedUnplaced").is_none());
        assert_eq!(json["clusters"][0]["unknownNodes"], 1);
        assert!(json["clusters"][1].get("unknownNodes").is_none());
        assert_eq!(json["clusters"][0]["stale"], false);
        assert_eq!(json["clusters"][1]["stale"], true);
        assert_eq!(json["clusters"][1]["dataAgeSeconds"], 300.25);
        assert_eq!(
            pb::EstimateResponse::from(r.clone()).clusters[1].data_age_seconds,
            Some(300.25)
        );
        let back: EstimateResponse = serde_json::from_value(json).expect("back");
        assert_eq!(back, r);
    }

    #[test]
    fn placement_and_requests_roundtrip_through_protobuf() {
        let r = PlaceResponse {
            policy: "Divided".into(),
            strategy: "Weighted".into(),
            replicas: 6,
            clusters: vec![TargetCluster {
                name: "c1".into(),
                replicas: 6,
            }],
            available: BTreeMap::from([("c1".to_string(), 9), ("c2".to_string(), 0)]),
            filtered_out: vec!["c3".into()],
            unschedulable: Some("c2: no devices".into()),
            stale: vec!["c4".into()],
            data_age_seconds: BTreeMap::from([("c1".to_string(), 0.5), ("c4".to_string(), 400.0)]),
        };
        let json = serde_json::to_value(&r).expect("json");
        assert_eq!(json["stale"][0], "c4");
        assert_eq!(json["dataAgeSeconds"]["c4"], 400.0);
        assert_eq!(PlaceResponse::from(pb::PlaceResponse::from(r.clone())), r);
        let req = PlaceRequest {
            workload: Workload {
                manifests: vec!["kind: Job\n".into()],
            },
            clusters: vec!["c1".into()],
            replicas: Some(3),
        };
        let wire = pb::PlaceRequest::from(req.clone());
        assert!(wire.workload.is_some());
        assert_eq!(PlaceRequest::from(wire), req);
        let bare = EstimateRequest::from(pb::EstimateRequest::default());
        assert_eq!(
            bare,
            EstimateRequest::default(),
            "absent workload reads as empty"
        );
    }

    #[test]
    fn preemption_roundtrips_through_protobuf() {
        let r = PreemptResponse {
            preemptor: "Deployment ml/train".into(),
            priority: 1000,
            replicas: 4,
            fits_without_preemption: None,
            chosen: Some("c2".into()),
            clusters: vec![ClusterPreemption {
                name: "c2".into(),
                feasible: true,
                replicas_before: 1,
                replicas_after: 4,
                victims: vec![Victim {
                    namespace: "batch".into(),
                    kind: "Job".into(),
                    name: "low".into(),
                    priority: 10,
                    pods: 3,
                    freed: BTreeMap::from([("cpu".to_string(), "6".to_string())]),
                }],
                freed: BTreeMap::from([("cpu".to_string(), "6".to_string())]),
                evicted_pods: 3,
                highest_victim_priority: Some(10),
                reason: None,
                stale: true,
                data_age_seconds: Some(130.0),
            }],
            reason: None,
        };
        let json = serde_json::to_value(&r).expect("json");
        assert_eq!(json["clusters"][0]["stale"], true);
        assert_eq!(json["clusters"][0]["dataAgeSeconds"], 130.0);
        let back: PreemptResponse = pb::PreemptResponse::from(r.clone()).into();
        assert_eq!(back, r);
    }
}
