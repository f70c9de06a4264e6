//! Karmada's general estimator (`pkg/estimator/client/general.go`), for the clusters Karmada
//! knows but no dramesh agent reports: how many replicas (or sets of a multi-component
//! workload) fit, from the Cluster's `status.resourceSummary` and, when the cluster
//! declares resource models (`spec.resourceModels`) and reports how many nodes fall in
//! each grade (`status.resourceSummary.allocatableModelings`), from those models, as
//! Karmada's `CustomizedClusterResourceModeling` path does (a Beta feature gate, on by
//! default).
//!
//! The model path lays out one virtual node per counted node, with the `min` of each range
//! of its grade as what it has left and Karmada's 110 pod slots, and places replicas first
//! fit (Karmada's `SchedulingSimulator`). A cluster whose models cannot be used (none
//! declared, a negative node count) falls back to the summary path, as Karmada does after
//! logging the error.

use std::collections::BTreeMap;

use dramesh_estimator::{Component, ResList, ResName};

use crate::object::{Cluster, ResourceModel, ResourceSummary};

/// Karmada's pod capacity of a virtual node of a resource model (`maxPodsCountPerNode`).
pub const MODEL_NODE_PODS: i64 = 110;

/// At most this many virtual nodes are laid out to place a multi-component set; a cluster
/// claiming more nodes than this is bounded by its summary alone (an error on Karmada's
/// model path falls back the same way).
const MAX_MODEL_NODES: i64 = 1 << 17;

/// Pod slots left in a summary: allocatable − allocated − allocating, never negative.
fn pod_slots(s: &ResourceSummary) -> i64 {
    let mut free = s.allocatable.clone();
    free.sub_all(&s.allocated);
    free.sub_all(&s.allocating);
    free.get(&ResName::Pods).max(0)
}

/// Whether `per` asks for any resource Karmada divides by.
fn requests_any(per: &ResList) -> bool {
    per.iter().any(|(n, v)| v > 0 && n.is_divisible())
}

/// Karmada's general estimator over `status.resourceSummary`: pod slots left
/// (allocatable − allocated − allocating) and, for each requested resource, what is left
/// divided by the request (CPU in millis), the minimum of all; 0 without a summary.
/// `per` is one replica's (or one set's) requests, `pods` its pod count.
pub fn general_estimate(summary: Option<&ResourceSummary>, per: &ResList, pods: i64) -> i64 {
    let Some(s) = summary else { return 0 };
    let slots = pod_slots(s);
    if slots == 0 {
        return 0;
    }
    let mut free = s.allocatable.clone();
    free.sub_all(&s.allocated);
    free.sub_all(&s.allocating);
    let (by_resources, _) = free.max_divided(per);
    by_resources.min(slots / pods.max(1))
}

/// Karmada's `maxAvailableReplicas` for one replica requesting `per`: the pod slots left,
/// bounded by the resource models when the cluster reports node counts per grade and the
/// models can be used (the summary's resources are then not consulted, as in Karmada), else
/// by the summary's resources. A replica requesting nothing is bounded by pod slots only.
pub fn general_replicas(c: &Cluster, per: &ResList) -> i64 {
    let Some(s) = c.summary.as_ref() else {
        return 0;
    };
    let slots = pod_slots(s);
    if slots == 0 {
        return 0;
    }
    if !requests_any(per) {
        return slots;
    }
    if !s.modelings.is_empty()
        && let Ok(n) = model_replicas(&c.models, &s.modelings, per)
    {
        return n.min(slots);
    }
    general_estimate(Some(s), per, 1)
}

/// Karmada's `maxAvailableComponentSets`: sets of `components` bounded by pod slots and the
/// summary's resources, then, when the cluster reports node counts per grade, by placing
/// whole sets first fit on the model's virtual nodes (an unusable model leaves the summary's
/// bound).
pub fn general_sets(c: &Cluster, components: &[Component]) -> i64 {
    let mut per = ResList::new();
    let mut pods = 0i64;
    for comp in components {
        per.add_all(&comp.requests.scaled(comp.replicas));
        pods = pods.saturating_add(comp.replicas.max(0));
    }
    let sets = general_estimate(c.summary.as_ref(), &per, pods);
    let Some(s) = c.summary.as_ref() else {
        return sets;
    };
    if sets <= 0 || s.modelings.is_empty() {
        return sets;
    }
    match model_sets(&c.models, &s.modelings, components, sets) {
        Ok(n) => n.min(sets),
        Err(_) => sets,
    }
}

/// The virtual nodes of a cluster's resource models: for each grade declared in `models`
/// and counted in `modelings` (grades ascending), the grade's capacity (each range's `min`
/// plus [`MODEL_NODE_PODS`] pod slots) and how many nodes have it. A grade declared twice
/// keeps its last declaration; counts of the same grade add up.
pub fn model_nodes(
    models: &[ResourceModel],
    modelings: &[(u32, i64)],
) -> Result<Vec<(ResList, i64)>, String> {
    if models.is_empty() {
        return Err("no resource models defined".into());
    }
    let mut caps: BTreeMap<u32, ResList> = BTreeMap::new();
    for m in models {
        let mut cap = m.min.clone();
        cap.set(ResName::Pods, MODEL_NODE_PODS);
        caps.insert(m.grade, cap);
    }
    let mut counts: BTreeMap<u32, i64> = BTreeMap::new();
    for (grade, count) in modelings {
        if *count < 0 {
            return Err(format!("negative node count for grade {grade}"));
        }
        let c = counts.entry(*grade).or_default();
        *c = c.saturating_add(*count);
    }
    Ok(caps
        .into_iter()
        .filter_map(|(grade, cap)| {
            let n = counts.get(&grade).copied().unwrap_or(0);
            (n > 0).then_some((cap, n))
        })
        .collect())
}

/// How many replicas requesting `per` one node with `cap` left takes (Karmada
/// `MaxDivided`, bounded by the node's pod slots).
fn per_node(cap: &ResList, per: &ResList) -> i64 {
    cap.max_divided(per).0.min(cap.get(&ResName::Pods)).max(0)
}

/// Replicas of `per` the resource models hold: first fit of identical replicas fills every
/// virtual node in turn, so the count is the sum over grades of nodes × replicas per node,
/// bounded as Karmada's simulation is by `i32::MAX`.
pub fn model_replicas(
    models: &[ResourceModel],
    modelings: &[(u32, i64)],
    per: &ResList,
) -> Result<i64, String> {
    let total = model_nodes(models, modelings)?
        .iter()
        .map(|(cap, n)| n.saturating_mul(per_node(cap, per)))
        .fold(0i64, i64::saturating_add);
    Ok(total.min(i64::from(i32::MAX)))
}

/// Whole sets of `components` the resource models hold, at most `upper`: Karmada's
/// first-fit simulation, one set at a time, each component's replicas going to the first
/// virtual nodes with room (as many on a node as fit).
pub fn model_sets(
    models: &[ResourceModel],
    modelings: &[(u32, i64)],
    components: &[Component],
    upper: i64,
) -> Result<i64, String> {
    let grades = model_nodes(models, modelings)?;
    let total = grades
        .iter()
        .map(|(_, n)| *n)
        .fold(0i64, i64::saturating_add);
    if total > MAX_MODEL_NODES {
        return Err(format!(
            "{total} modeled nodes, more than the {MAX_MODEL_NODES} laid out"
        ));
    }
    let mut nodes: Vec<ResList> = Vec::new();
    for (cap, n) in &grades {
        for _ in 0..*n {
            nodes.push(cap.clone());
        }
    }
    // A node a component's replica no longer fits on never fits one again (nodes only
    // lose room), so each component resumes from the first node that might still take it.
    let mut cursor = vec![0usize; components.len()];
    let mut sets = 0;
    while sets < upper {
        for (ci, comp) in components.iter().enumerate() {
            let mut one = comp.requests.clone();
            one.set(ResName::Pods, 1);
            let mut remaining = comp.replicas.max(0);
            let mut placed = remaining == 0;
            let mut i = cursor[ci];
            while i < nodes.len() {
                let fit = per_node(&nodes[i], &one);
                if fit == 0 {
                    if i == cursor[ci] {
                        cursor[ci] += 1;
                    }
                    i += 1;
                    continue;
                }
                let take = fit.min(remaining);
                nodes[i].sub_all(&one.scaled(take));
                remaining -= take;
                if remaining == 0 {
                    placed = true;
                    break;
                }
                i += 1;
            }
            if !placed {
                return Ok(sets);
            }
        }
        sets += 1;
    }
    Ok(sets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(v: &[(&str, i64)]) -> ResList {
        let mut l = ResList::new();
        for (n, a) in v {
            l.set(ResName::parse(n), *a);
        }
        l
    }

    #[test]
    fn general_estimate_is_karmadas() {
        let s = ResourceSummary {
            allocatable: list(&[("cpu", 10_000), ("memory", 64 << 30), ("pods", 20)]),
            allocated: list(&[("cpu", 3_000), ("memory", 8 << 30), ("pods", 5)]),
            allocating: list(&[("cpu", 1_000), ("pods", 1)]),
            modelings: Vec::new(),
        };
        // cpu (10 - 3 - 1) / 0.5 = 12; memory 56 Gi / 2 Gi = 28; pods 14.
        let per = list(&[("cpu", 500), ("memory", 2 << 30)]);
        assert_eq!(general_estimate(Some(&s), &per, 1), 12);
        // Pod slots bound it: 14 slots, 2 pods per set.
        let small = list(&[("cpu", 10)]);
        assert_eq!(general_estimate(Some(&s), &small, 2), 7);
        // A resource the cluster does not have: 0.
        let gpu = list(&[("nvidia.com/gpu", 1)]);
        assert_eq!(general_estimate(Some(&s), &gpu, 1), 0);
        // No summary, or no pod slots left: 0.
        assert_eq!(general_estimate(None, &per, 1), 0);
        let mut full = s.clone();
        full.allocated.set(ResName::Pods, 19);
        assert_eq!(general_estimate(Some(&full), &per, 1), 0);
    }

    fn model(grade: u32, min: &[(&str, i64)]) -> ResourceModel {
        ResourceModel {
            grade,
            min: list(min),
        }
    }

    #[test]
    fn model_replicas_sum_nodes_times_what_one_node_takes() {
        let models = [
            model(0, &[("cpu", 0), ("memory", 0)]),
            model(1, &[("cpu", 2_000), ("memory", 4 << 30)]),
            model(2, &[("cpu", 4_000), ("memory", 16 << 30)]),
        ];
        // 1 cpu / 2 Gi: a grade-1 node takes 2, a grade-2 node 4; grade 0 nothing.
        let per = list(&[("cpu", 1_000), ("memory", 2 << 30)]);
        assert_eq!(
            model_replicas(&models, &[(0, 9), (1, 3), (2, 2)], &per),
            Ok(3 * 2 + 2 * 4)
        );
        // A grade counted but not declared, or declared but not counted, adds nothing.
        assert_eq!(model_replicas(&models, &[(7, 100), (2, 1)], &per), Ok(4));
        // Counts of one grade add up.
        assert_eq!(model_replicas(&models, &[(2, 1), (2, 1)], &per), Ok(8));
        // A resource the models do not range over: nothing fits.
        let gpu = list(&[("cpu", 1_000), ("nvidia.com/gpu", 1)]);
        assert_eq!(model_replicas(&models, &[(2, 5)], &gpu), Ok(0));
        // The 110 pod slots of a virtual node bound tiny replicas.
        let tiny = list(&[("cpu", 1)]);
        assert_eq!(model_replicas(&models, &[(2, 2)], &tiny), Ok(220));
        // Unusable models are errors (the caller falls back to the summary).
        assert!(model_replicas(&[], &[(1, 1)], &per).is_err());
        assert!(model_replicas(&models, &[(1, -1)], &per).is_err());
        // Absurd counts saturate at Karmada's simulation bound.
        assert_eq!(
            model_replicas(&models, &[(2, i64::MAX)], &per),
            Ok(i64::from(i32::MAX))
        );
    }

    fn component(name: &str, replicas: i64, requests: &[(&str, i64)]) -> Component {
        Component {
            name: name.into(),
            replicas,
            requests: list(requests),
            node_claim: Default::default(),
        }
    }

    #[test]
    fn model_sets_place_whole_sets_first_fit() {
        // Two 4-cpu nodes. A set: a 3-cpu leader and two 1-cpu workers.
        let models = [model(1, &[("cpu", 4_000)])];
        let set = [
            component("leader", 1, &[("cpu", 3_000)]),
            component("worker", 2, &[("cpu", 1_000)]),
        ];
        // Set 1: leader on n0 (1 left), workers: 1 on n0, 1 on n1 (3 left). Set 2: leader on
        // n1 (0 left), workers nowhere: 1 set. The summary alone (8 cpu / 5 cpu) says 1 too.
        assert_eq!(model_sets(&models, &[(1, 2)], &set, 10), Ok(1));
        // Four nodes: set 2 takes n1's 3 cpu for its leader and n2 for its workers, set 3
        // n3 for its leader and n2's last 2 cpu for its workers (16 cpu, 5 a set: 3); the
        // upper bound caps it.
        assert_eq!(model_sets(&models, &[(1, 4)], &set, 10), Ok(3));
        assert_eq!(model_sets(&models, &[(1, 4)], &set, 1), Ok(1));
        // Absurd node counts are not laid out.
        assert!(model_sets(&models, &[(1, i64::MAX)], &set, 10).is_err());
    }
}
