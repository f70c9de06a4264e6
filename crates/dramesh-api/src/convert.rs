//! The estimator's results as native API responses. Every conversion destructures the
//! estimator's type completely, so a field added to or renamed in either side is a compile
//! error here rather than a field silently dropped on the wire. The answering replica adds
//! each cluster's [`Freshness`] (data age and the stale flag), which the estimator does not
//! know; apart from those fields the JSON of a converted value is byte for byte the JSON of
//! the estimator's own value (tested in `dramesh-replica`).

use std::collections::BTreeMap;

use dramesh_estimator as est;

use crate::native::{
    ClusterEstimate, ClusterPreemption, EstimateResponse, Freshness, PlaceResponse,
    PreemptResponse, TargetCluster, Victim,
};

/// Each cluster's freshness on the answering replica, by name; a cluster missing from it is
/// reported as never heard from (no age, not stale).
pub type FreshnessMap = BTreeMap<String, Freshness>;

fn freshness_of(map: &FreshnessMap, cluster: &str) -> Freshness {
    map.get(cluster).copied().unwrap_or_default()
}

impl ClusterEstimate {
    /// The estimator's answer for one cluster with that cluster's freshness.
    pub fn from_estimate(c: &est::ClusterEstimate, fresh: Freshness) -> ClusterEstimate {
        let est::ClusterEstimate {
            name,
            max_replicas,
            limited_by,
            excluded_nodes,
            nodes_considered,
            limits,
            kubernetes_version,
            error,
            assumed_unplaced,
            unknown_nodes,
            headroom,
        } = c;
        ClusterEstimate {
            name: name.clone(),
            max_replicas: *max_replicas,
            limited_by: limited_by.clone(),
            excluded_nodes: excluded_nodes.clone(),
            nodes_considered: *nodes_considered,
            limits: limits.clone(),
            kubernetes_version: kubernetes_version.clone(),
            error: error.clone(),
            assumed_unplaced: *assumed_unplaced,
            unknown_nodes: *unknown_nodes,
            headroom_replicas: headroom.as_ref().map(|h| h.replicas),
            stale: fresh.stale,
            data_age_seconds: fresh.data_age_seconds,
        }
    }
}

impl EstimateResponse {
    /// The estimator's estimate with each cluster's freshness.
    pub fn from_estimate(e: &est::Estimate, fresh: &FreshnessMap) -> EstimateResponse {
        let est::Estimate { clusters, total } = e;
        EstimateResponse {
            clusters: clusters
                .iter()
                .map(|c| ClusterEstimate::from_estimate(c, freshness_of(fresh, &c.name)))
                .collect(),
            total: *total,
        }
    }
}

impl From<&est::TargetCluster> for TargetCluster {
    fn from(t: &est::TargetCluster) -> TargetCluster {
        let est::TargetCluster { name, replicas } = t;
        TargetCluster {
            name: name.clone(),
            replicas: *replicas,
        }
    }
}

impl PlaceResponse {
    /// The estimator's placement with the data age of every cluster in `fresh` (the clusters
    /// the request concerned).
    pub fn from_placement(p: &est::PlacementResult, fresh: &FreshnessMap) -> PlaceResponse {
        let est::PlacementResult {
            policy,
            strategy,
            replicas,
            clusters,
            available,
            filtered_out,
            stale,
            unschedulable,
        } = p;
        PlaceResponse {
            policy: policy.clone(),
            strategy: strategy.clone(),
            replicas: *replicas,
            clusters: clusters.iter().map(TargetCluster::from).collect(),
            available: available.clone(),
            filtered_out: filtered_out.clone(),
            unschedulable: unschedulable.clone(),
            stale: stale.clone(),
            data_age_seconds: fresh
                .iter()
                .filter_map(|(name, f)| Some((name.clone(), f.data_age_seconds?)))
                .collect(),
        }
    }
}

impl From<&est::Victim> for Victim {
    fn from(v: &est::Victim) -> Victim {
        let est::Victim {
            namespace,
            kind,
            name,
            priority,
            pods,
            freed,
        } = v;
        Victim {
            namespace: namespace.clone(),
            kind: kind.clone(),
            name: name.clone(),
            priority: *priority,
            pods: *pods,
            freed: freed.clone(),
        }
    }
}

impl ClusterPreemption {
    /// The estimator's preemption outcome on one cluster with that cluster's freshness.
    pub fn from_preemption(c: &est::ClusterPreemption, fresh: Freshness) -> ClusterPreemption {
        let est::ClusterPreemption {
            name,
            feasible,
            replicas_before,
            replicas_after,
            victims,
            freed,
            evicted_pods,
            highest_victim_priority,
            reason,
        } = c;
        ClusterPreemption {
            name: name.clone(),
            feasible: *feasible,
            replicas_before: *replicas_before,
            replicas_after: *replicas_after,
            victims: victims.iter().map(Victim::from).collect(),
            freed: freed.clone(),
            evicted_pods: *evicted_pods,
            highest_victim_priority: *highest_victim_priority,
            reason: reason.clone(),
            stale: fresh.stale,
            data_age_seconds: fresh.data_age_seconds,
        }
    }
}

impl PreemptResponse {
    /// The estimator's preemption decision with each cluster's freshness.
    pub fn from_preemption(p: &est::PreemptionResult, fresh: &FreshnessMap) -> PreemptResponse {
        let est::PreemptionResult {
            preemptor,
            priority,
            replicas,
            fits_without_preemption,
            chosen,
            clusters,
            reason,
        } = p;
        PreemptResponse {
            preemptor: preemptor.clone(),
            priority: *priority,
            replicas: *replicas,
            fits_without_preemption: fits_without_preemption.clone(),
            chosen: chosen.clone(),
            clusters: clusters
                .iter()
                .map(|c| ClusterPreemption::from_preemption(c, freshness_of(fresh, &c.name)))
                .collect(),
            reason: reason.clone(),
        }
    }
}
