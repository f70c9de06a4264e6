//! The estimator's results as native API responses. Every conversion destructures the
//! estimator's type completely, so a field added to or renamed in either side is a compile
//! error here rather than a field silently dropped on the wire. The JSON of a converted value
//! is byte for byte the JSON of the estimator's own value (tested in `dramesh-replica`).

use dramesh_estimator as est;

use crate::native::{
    ClusterEstimate, ClusterPreemption, EstimateResponse, PlaceResponse, PreemptResponse,
    TargetCluster, Victim,
};

impl From<&est::ClusterEstimate> for ClusterEstimate {
    fn from(c: &est::ClusterEstimate) -> ClusterEstimate {
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
        }
    }
}

impl From<&est::Estimate> for EstimateResponse {
    fn from(e: &est::Estimate) -> EstimateResponse {
        let est::Estimate { clusters, total } = e;
        EstimateResponse {
            clusters: clusters.iter().map(ClusterEstimate::from).collect(),
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

impl From<&est::PlacementResult> for PlaceResponse {
    fn from(p: &est::PlacementResult) -> PlaceResponse {
        let est::PlacementResult {
            policy,
            strategy,
            replicas,
            clusters,
            available,
            filtered_out,
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

impl From<&est::ClusterPreemption> for ClusterPreemption {
    fn from(c: &est::ClusterPreemption) -> ClusterPreemption {
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
        }
    }
}

impl From<&est::PreemptionResult> for PreemptResponse {
    fn from(p: &est::PreemptionResult) -> PreemptResponse {
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
            clusters: clusters.iter().map(ClusterPreemption::from).collect(),
            reason: reason.clone(),
        }
    }
}
