//! An allocation search that runs out of budget is "unknown", never "no fit": the estimate
//! says so (`limitedBy`, `unknownNodes`), caches keep it a give-up, and preemption neither
//! evicts on it nor reports "does not fit".

use crate::fleet;

use std::collections::HashMap;
use std::sync::Arc;

use dramesh_estimator::{
    ClusterEstimate, EstimateOptions, Estimator, LIMIT_UNKNOWN, View, Workload, preempt,
};
use dramesh_sim::typed::{self, FleetSpec};
use fleet::fleet;
use serde_json::json;

/// One search step per allocation: any replica asking several devices gives up (a search
/// that places `n` devices takes more than `n` steps, pruned or not).
const STARVED: Option<u64> = Some(1);

/// A workload of `replicas` replicas, each asking `gpus` GPUs, at `priority`.
fn gpu_workload(gpus: i64, replicas: i64, priority: i32) -> Workload {
    let tpl: dramesh_model::k8s::ResourceClaimTemplate = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "gpu", "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": typed::CLASS, "count": gpus}}]}}}
    }))
    .unwrap();
    let mut templates = HashMap::new();
    templates.insert(("default".to_string(), "gpu".to_string()), Arc::new(tpl));
    let spec = json!({
        "containers": [{"name": "c", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
    });
    let mut w = Workload::from_pod_spec(
        "Job",
        "default",
        "probe",
        replicas,
        serde_json::from_value(spec).unwrap(),
        &templates,
    )
    .unwrap();
    w.priority = priority;
    w
}

/// One cluster `c0` of four identical nodes with 8 GPUs each, `used` of them allocated to
/// pods of priority 0 and 100.
fn cluster(used: usize) -> View {
    let spec = FleetSpec {
        clusters: 1,
        nodes_per_cluster: 4,
        gpus_per_node: 8,
        owners_per_cluster: 2,
        kubernetes_version: "1.36".into(),
    };
    fleet(&spec, &|_| used).unwrap()
}

fn starved() -> EstimateOptions {
    EstimateOptions {
        max_allocation_steps: STARVED,
        ..Default::default()
    }
}

fn c0(est: &dramesh_estimator::Estimate) -> &ClusterEstimate {
    est.cluster("c0").unwrap()
}

fn assert_unknown(c: &ClusterEstimate, label: &str) {
    assert_eq!(c.max_replicas, 0, "{label}");
    assert_eq!(c.unknown_nodes, 4, "{label}: {c:?}");
    assert_eq!(
        c.limited_by, "unknown: allocation budget exhausted on 4 node(s)",
        "{label}"
    );
    assert_eq!(c.limits.get(LIMIT_UNKNOWN), Some(&4), "{label}");
    assert!(!c.limits.contains_key("devices"), "{label}: {c:?}");
    assert!(c.is_lower_bound(), "{label}");
    assert!(c.error.is_none(), "{label}");
}

#[test]
fn a_give_up_is_unknown_not_no_fit() {
    let view = cluster(0);
    let w = gpu_workload(4, 1, 0);
    let naive = Estimator::new().estimate(
        &view,
        &w,
        &EstimateOptions {
            disable_cache: true,
            ..starved()
        },
    );
    assert_unknown(c0(&naive), "naive");

    // With the default budget the same question has an exact answer: 2 per node.
    let exact = Estimator::new().estimate(&view, &w, &EstimateOptions::default());
    let e = c0(&exact);
    assert_eq!((e.max_replicas, e.limited_by.as_str()), (8, "devices"));
    assert_eq!(e.unknown_nodes, 0);
    assert!(!e.is_lower_bound());

    // The JSON names it, and omits the count when nothing gave up.
    let json = serde_json::to_value(c0(&naive)).unwrap();
    assert_eq!(json["unknownNodes"], 4);
    assert!(
        serde_json::to_value(e)
            .unwrap()
            .get("unknownNodes")
            .is_none()
    );
}

#[test]
fn a_cached_give_up_stays_a_give_up() {
    let view = cluster(0);
    let w = gpu_workload(4, 1, 0);
    let mut est = Estimator::new();
    // First query fills the same-shape cache from node 1 and the cluster memo; the second
    // is answered from the memo, nodes 2-4 of the first from the shape cache.
    let first = est.estimate(&view, &w, &starved());
    assert_unknown(c0(&first), "first (shape cache)");
    let second = est.estimate(&view, &w, &starved());
    assert_unknown(c0(&second), "second (memo)");
    // Another budget is another question: the cached give-up is not its answer, and its
    // exact answer is not reused for the starved budget either.
    let full = est.estimate(&view, &w, &EstimateOptions::default());
    assert_eq!(c0(&full).max_replicas, 8);
    assert!(!c0(&full).is_lower_bound());
    let third = est.estimate(&view, &w, &starved());
    assert_unknown(c0(&third), "after a full-budget query");
    // All of them are what an estimator with empty caches answers.
    let fresh = Estimator::new().estimate(
        &view,
        &w,
        &EstimateOptions {
            clusters: vec!["c0".into()],
            ..starved()
        },
    );
    assert_eq!(fresh, third);
}

#[test]
fn preemption_does_not_evict_or_say_no_fit_on_an_unknown_answer() {
    // Every GPU is in use by lower-priority pods; evicting would free them.
    let view = cluster(8);
    let w = gpu_workload(4, 2, 1000);
    let mut est = Estimator::new();
    // With the full budget, preemption finds victims (the test means something).
    let full = preempt(&view, &w, &mut est, &EstimateOptions::default());
    assert_eq!(full.chosen.as_deref(), Some("c0"), "{full:?}");
    assert!(!full.clusters[0].victims.is_empty());

    for disable_cache in [false, true] {
        let opts = EstimateOptions {
            disable_cache,
            ..starved()
        };
        let r = preempt(&view, &w, &mut Estimator::new(), &opts);
        assert_eq!(r.chosen, None, "{r:?}");
        assert_eq!(r.fits_without_preemption, None);
        let c = &r.clusters[0];
        assert!(!c.feasible);
        assert!(c.victims.is_empty(), "{c:?}");
        let reason = c.reason.as_deref().unwrap_or_default();
        assert!(
            reason.starts_with("unknown whether preemption lets 2 replicas fit")
                && reason.contains("allocation budget exhausted on 4 node(s)"),
            "{reason}"
        );
        let overall = r.reason.as_deref().unwrap_or_default();
        assert!(
            overall.starts_with("no cluster is known to fit") && overall.contains("c0"),
            "{overall}"
        );
    }
}
