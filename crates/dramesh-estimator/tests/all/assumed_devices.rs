//! Assumed (in-flight) workloads that carry DRA claims: their replicas are placed first-fit
//! with a device allocation each, and the estimate counts against the devices they hold.
//! Every estimate is checked on the cached path and on the naive (`disable_cache`) path.

use crate::fleet;

use std::collections::HashMap;
use std::sync::Arc;

use dramesh_estimator::{
    AssumedWorkload, ClusterEstimate, EstimateOptions, Estimator, View, Workload, preempt,
};
use dramesh_model::ClusterObject;
use dramesh_sim::typed::{self, FleetSpec};
use fleet::fleet;
use serde_json::{Value, json};

/// A workload with `templates` (pod claim name -> GPUs per replica, optional CEL selector)
/// and `shared` resourceClaimName claims.
fn workload(
    name: &str,
    cpu: &str,
    templates: &[(&str, i64, Option<&str>)],
    shared: &[&str],
) -> Workload {
    let mut tpls = HashMap::new();
    let mut refs: Vec<Value> = Vec::new();
    for (claim, count, cel) in templates {
        let mut exactly = json!({"deviceClassName": typed::CLASS, "count": count});
        if let Some(cel) = cel {
            exactly["selectors"] = json!([{"cel": {"expression": cel}}]);
        }
        let tpl: dramesh_model::k8s::ResourceClaimTemplate = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": format!("{name}-{claim}"), "namespace": "default"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}
        }))
        .unwrap();
        tpls.insert(
            ("default".to_string(), format!("{name}-{claim}")),
            Arc::new(tpl),
        );
        refs.push(json!({"name": claim, "resourceClaimTemplateName": format!("{name}-{claim}")}));
    }
    for s in shared {
        refs.push(json!({"name": s, "resourceClaimName": s}));
    }
    let spec = json!({
        "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu, "memory": "8Gi"}}}],
        "resourceClaims": refs
    });
    Workload::from_pod_spec(
        "Deployment",
        "default",
        name,
        1,
        serde_json::from_value(spec).unwrap(),
        &tpls,
    )
    .unwrap()
}

fn gpu1(name: &str) -> Workload {
    workload(name, "2", &[("gpu", 1, None)], &[])
}

/// One cluster `c0` of `nodes` nodes with `gpus` free GPUs each.
fn cluster(nodes: usize, gpus: usize) -> View {
    let spec = FleetSpec {
        clusters: 1,
        nodes_per_cluster: nodes,
        gpus_per_node: gpus,
        owners_per_cluster: 1,
        kubernetes_version: "1.36".into(),
    };
    fleet(&spec, &|_| 0).unwrap()
}

fn unallocated_claim(name: &str, gpus: i64) -> ClusterObject {
    ClusterObject::ResourceClaim(Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu",
                "exactly": {"deviceClassName": typed::CLASS, "count": gpus}}]}}
        }))
        .unwrap(),
    ))
}

fn network_slice(devices: usize) -> ClusterObject {
    let devs: Vec<Value> = (0..devices)
        .map(|i| json!({"name": format!("net-gpu-{i}"), "capacity": {"memory": {"value": "80Gi"}}}))
        .collect();
    ClusterObject::ResourceSlice(Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "network-gpus"},
            "spec": {"driver": typed::DRIVER, "allNodes": true,
                     "pool": {"name": "network", "generation": 1, "resourceSliceCount": 1},
                     "devices": devs}
        }))
        .unwrap(),
    ))
}

fn opts(assumed: Vec<AssumedWorkload>) -> EstimateOptions {
    EstimateOptions {
        assumed: assumed.into(),
        ..EstimateOptions::default()
    }
}

/// The estimate of `c0` on the naive path, checked equal to a cached one computed with a
/// cache warmed without the assumed workloads (cold and repeated).
fn estimate(view: &View, w: &Workload, assumed: &[AssumedWorkload]) -> ClusterEstimate {
    let naive = Estimator::new().estimate(
        view,
        w,
        &EstimateOptions {
            assumed: assumed.to_vec().into(),
            disable_cache: true,
            ..EstimateOptions::default()
        },
    );
    let mut est = Estimator::new();
    let plain = est.estimate(view, w, &EstimateOptions::default());
    for round in 0..2 {
        let cached = est.estimate(view, w, &opts(assumed.to_vec()));
        assert_eq!(cached, naive, "cached differs from naive (round {round})");
    }
    // The assumed estimates left nothing behind in the caches.
    assert_eq!(est.estimate(view, w, &EstimateOptions::default()), plain);
    naive.cluster("c0").unwrap().clone()
}

#[test]
fn assumed_dra_replicas_hold_their_gpus() {
    let view = cluster(1, 8);
    let w = gpu1("probe");
    assert_eq!(estimate(&view, &w, &[]).max_replicas, 8);
    let inflight = AssumedWorkload::from_workload("c0", &gpu1("inflight"), 6);
    assert!(inflight.claims.is_some());
    let e = estimate(&view, &w, std::slice::from_ref(&inflight));
    assert_eq!(e.max_replicas, 2);
    assert_eq!(e.limited_by, "devices");
    assert_eq!(e.assumed_unplaced, 0);
    // The same replicas without their claims only hold cpu and memory (plenty left).
    let mut no_claims = inflight.clone();
    no_claims.claims = None;
    assert_eq!(estimate(&view, &w, &[no_claims]).max_replicas, 8);
}

#[test]
fn assumed_replicas_go_first_fit_and_the_rest_is_reported() {
    let view = cluster(2, 4);
    let w = gpu1("probe");
    let six = AssumedWorkload::from_workload("c0", &gpu1("inflight"), 6);
    let e = estimate(&view, &w, std::slice::from_ref(&six));
    assert_eq!(e.max_replicas, 2);
    // 4 on c0-n0, 2 on c0-n1: both nodes still consider the probe; n0 holds nothing for it.
    assert_eq!(e.nodes_considered, 2);
    let ten = AssumedWorkload::from_workload("c0", &gpu1("inflight"), 10);
    let e = estimate(&view, &w, &[ten]);
    assert_eq!(e.max_replicas, 0);
    assert_eq!(e.assumed_unplaced, 2);
    // Two assumed workloads: the second one sees the first one's devices.
    let a = AssumedWorkload::from_workload("c0", &gpu1("a"), 5);
    let b = AssumedWorkload::from_workload("c0", &workload("b", "2", &[("gpu", 2, None)], &[]), 2);
    let e = estimate(&view, &w, &[a, b]);
    // a: 4 on n0, 1 on n1; b: one replica of 2 on n1 (3 free), the second fits nowhere.
    assert_eq!(e.max_replicas, 1);
    assert_eq!(e.assumed_unplaced, 1);
}

#[test]
fn assumed_shared_claim_is_counted_once() {
    let mut view = cluster(1, 8);
    view.apply_object("c0", unallocated_claim("shared", 1))
        .unwrap();
    let with_shared = workload("inflight", "2", &[("gpu", 1, None)], &["shared"]);
    let a = AssumedWorkload::from_workload("c0", &with_shared, 3);
    // 3 template GPUs and one for the shared claim: 4 of 8 left.
    let e = estimate(&view, &gpu1("probe"), std::slice::from_ref(&a));
    assert_eq!(e.max_replicas, 4);
    // A workload naming the same shared claim finds it allocated by the assumed replicas
    // and needs only its template GPU per replica.
    let same = workload("same", "2", &[("gpu", 1, None)], &["shared"]);
    assert_eq!(estimate(&view, &same, &[]).max_replicas, 7);
    assert_eq!(
        estimate(&view, &same, std::slice::from_ref(&a)).max_replicas,
        4
    );
}

#[test]
fn assumed_replicas_hold_network_attached_devices() {
    let mut view = cluster(2, 0);
    view.apply_object("c0", network_slice(4)).unwrap();
    let w = gpu1("probe");
    assert_eq!(estimate(&view, &w, &[]).max_replicas, 4);
    let a = AssumedWorkload::from_workload("c0", &gpu1("inflight"), 3);
    let e = estimate(&view, &w, std::slice::from_ref(&a));
    assert_eq!(e.max_replicas, 1);
    assert_eq!(e.assumed_unplaced, 0);
    let five = AssumedWorkload::from_workload("c0", &gpu1("inflight"), 5);
    let e = estimate(&view, &w, &[five]);
    assert_eq!(e.max_replicas, 0);
    assert_eq!(e.assumed_unplaced, 1);
}

#[test]
fn assumed_workload_whose_devices_fit_nowhere_deducts_nothing() {
    let view = cluster(2, 8);
    // 16 cpu per replica: 128 cpu and 8 GPUs per node allow 8 replicas per node.
    let w = workload("probe", "16", &[("gpu", 1, None)], &[]);
    assert_eq!(estimate(&view, &w, &[]).max_replicas, 16);
    // Wants GPUs with more memory than any has: it would take 100 cpu per node if placed.
    let big = workload(
        "big",
        "100",
        &[(
            "gpu",
            1,
            Some("device.capacity[\"gpu.example.com\"].memory.compareTo(quantity(\"100Gi\")) >= 0"),
        )],
        &[],
    );
    let a = AssumedWorkload::from_workload("c0", &big, 2);
    let e = estimate(&view, &w, &[a]);
    assert_eq!(e.max_replicas, 16);
    assert_eq!(e.assumed_unplaced, 2);
    // A shared claim missing from the cluster: nothing placed either.
    let missing = workload("missing", "100", &[], &["nowhere"]);
    let e = estimate(
        &view,
        &w,
        &[AssumedWorkload::from_workload("c0", &missing, 1)],
    );
    assert_eq!(e.max_replicas, 16);
    assert_eq!(e.assumed_unplaced, 1);
}

#[test]
fn preemption_counts_assumed_devices() {
    // One node of 8 GPUs, 4 held by low-priority pods, 4 free; 2 assumed in flight.
    let spec = FleetSpec {
        clusters: 1,
        nodes_per_cluster: 1,
        gpus_per_node: 8,
        owners_per_cluster: 1,
        kubernetes_version: "1.36".into(),
    };
    let view = fleet(&spec, &|_| 4).unwrap();
    let mut w = gpu1("preemptor");
    w.priority = 1000;
    w.replicas = 5;
    let assumed = vec![AssumedWorkload::from_workload("c0", &gpu1("inflight"), 2)];
    let run = |disable_cache: bool| {
        let o = EstimateOptions {
            assumed: assumed.clone().into(),
            disable_cache,
            ..EstimateOptions::default()
        };
        preempt(&view, &w, &mut Estimator::new(), &o)
    };
    let cached = run(false);
    let naive = run(true);
    assert_eq!(cached.clusters, naive.clusters);
    let c = &naive.clusters[0];
    // 2 free after the assumed replicas; evicting the 4 pods gives 6 >= 5.
    assert_eq!(c.replicas_before, 2);
    assert!(c.feasible);
    assert_eq!(c.replicas_after, 6);
    assert_eq!(c.evicted_pods, 4);
}
