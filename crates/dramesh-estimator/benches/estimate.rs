//! Estimation, placement and preemption on generated GPU fleets.
//!
//! - `one_cluster_5000x8`: one cluster, 5,000 nodes x 8 GPUs, 0-4 GPUs per node in use;
//!   a workload needing 1 GPU per replica. `cold` builds the caches (fresh estimator),
//!   `warm` repeats the query, `after_one_node_change` applies one claim change on one node
//!   and re-estimates (the change is undone in the next iteration); `warm_with_assumed_dra`
//!   repeats the query with 100 one-GPU replicas in flight (assumed workload with claims),
//!   `warm_with_assumed_no_claims` with the same replicas holding no devices.
//! - `fleet_100x1000x8`: 100 clusters of 1,000 nodes x 8 GPUs, same workload; plus
//!   placement (dynamic weight) and preemption of a workload that fits nowhere.
//!   `estimate_warm_claim_refs` repeats the warm query with the claim as a reference (Karmada's
//!   `resourceClaimRefs`) that every cluster resolves against the template it publishes:
//!   the cost of resolving per cluster on top of `estimate_warm`.
//! - `headroom_1000x8`: one cluster of 1,000 nodes x 8 GPUs, all of one Karpenter NodePool
//!   and instance type, with a NodeClaim each and a GPU limit leaving room for 100 more nodes;
//!   the estimate without headroom (`warm`), with it (`warm_with_headroom`: the pool plan and
//!   the hypothetical node's count cached), and with a fresh estimator without (`cold`) and
//!   with headroom (`headroom_cold`: every node, the pool plan and the hypothetical node).

#[path = "../tests/all/common/fleet.rs"]
mod fleet;

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use dramesh_estimator::{
    AssumedWorkload, ClaimRef, EstimateOptions, Estimator, Policy, View, Workload, place, preempt,
};
use dramesh_model::{ClusterObject, ObjectChange, ObjectKey, ObjectKind};
use dramesh_sim::typed::{self, FleetSpec};
use serde_json::json;

fn gpu_template() -> dramesh_model::k8s::ResourceClaimTemplate {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "gpu", "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": typed::CLASS}}]}}}
    }))
    .expect("template")
}

fn gpu_workload(replicas: i64) -> Workload {
    let mut templates = HashMap::new();
    templates.insert(
        ("default".to_string(), "gpu".to_string()),
        Arc::new(gpu_template()),
    );
    let spec = json!({
        "containers": [{"name": "c", "resources": {"requests": {"cpu": "2", "memory": "16Gi"}}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
    });
    let mut w = Workload::from_pod_spec(
        "Deployment",
        "default",
        "bench",
        replicas,
        serde_json::from_value(spec).expect("spec"),
        &templates,
    )
    .expect("workload");
    w.priority = 10_000;
    w
}

fn fleet(clusters: usize, nodes: usize) -> View {
    let spec = FleetSpec {
        clusters,
        nodes_per_cluster: nodes,
        gpus_per_node: 8,
        owners_per_cluster: 4,
        kubernetes_version: "1.36".into(),
    };
    fleet::fleet(&spec, &|n| n % 5).expect("fleet")
}

fn toggle_claim(view: &mut View, cluster: &str, node: &str, on: bool) {
    let change = if on {
        ObjectChange::upsert(&ClusterObject::ResourceClaim(Arc::new(
            typed::allocated_claim("default", "bench-toggle", node, 7),
        )))
    } else {
        ObjectChange::Delete {
            key: ObjectKey::new(ObjectKind::ResourceClaim, Some("default"), "bench-toggle"),
        }
    };
    view.apply(cluster, &change).expect("apply");
}

fn one_cluster(c: &mut Criterion) {
    let mut view = fleet(1, 5000);
    let w = gpu_workload(1);
    let opts = EstimateOptions::default();
    let mut g = c.benchmark_group("one_cluster_5000x8");
    g.sample_size(10);
    g.bench_function("cold", |b| {
        b.iter(|| black_box(Estimator::new().estimate(&view, &w, &opts).total))
    });
    let mut est = Estimator::new();
    est.estimate(&view, &w, &opts);
    g.bench_function("warm", |b| {
        b.iter(|| black_box(est.estimate(&view, &w, &opts).total))
    });
    // 100 one-GPU replicas in flight (Karmada assumed workload or admitted reservations):
    // first-fit through the engine, then the estimate with those nodes uncached.
    let assumed = EstimateOptions {
        assumed: vec![AssumedWorkload::from_workload("c0", &gpu_workload(1), 100)].into(),
        ..EstimateOptions::default()
    };
    g.bench_function("warm_with_assumed_dra", |b| {
        b.iter(|| black_box(est.estimate(&view, &w, &assumed).total))
    });
    // The same replicas holding requests and pod slots only (no claims), for comparison.
    let mut bare = AssumedWorkload::from_workload("c0", &gpu_workload(1), 100);
    bare.claims = None;
    let no_claims = EstimateOptions {
        assumed: vec![bare].into(),
        ..EstimateOptions::default()
    };
    g.bench_function("warm_with_assumed_no_claims", |b| {
        b.iter(|| black_box(est.estimate(&view, &w, &no_claims).total))
    });
    let mut on = false;
    g.bench_function("after_one_node_change", |b| {
        b.iter(|| {
            on = !on;
            toggle_claim(&mut view, "c0", "c0-n2500", on);
            black_box(est.estimate(&view, &w, &opts).total)
        })
    });
    g.finish();
}

fn hundred_clusters(c: &mut Criterion) {
    let mut view = fleet(100, 1000);
    let w = gpu_workload(1);
    let opts = EstimateOptions::default();
    let mut g = c.benchmark_group("fleet_100x1000x8");
    g.sample_size(10);
    g.bench_function("estimate_cold", |b| {
        b.iter(|| black_box(Estimator::new().estimate(&view, &w, &opts).total))
    });
    let mut est = Estimator::new();
    est.estimate(&view, &w, &opts);
    g.bench_function("estimate_warm", |b| {
        b.iter(|| black_box(est.estimate(&view, &w, &opts).total))
    });
    let tpl = ClusterObject::ResourceClaimTemplate(Arc::new(gpu_template()));
    for i in 0..100 {
        view.apply_object(&format!("c{i}"), tpl.clone())
            .expect("template");
    }
    let mut by_ref = gpu_workload(1);
    by_ref.templates.clear();
    by_ref.claim_refs = vec![ClaimRef::Template {
        pod_claim: "gpu".into(),
        name: "gpu".into(),
    }];
    by_ref.refresh_fingerprint();
    assert_eq!(
        est.estimate(&view, &by_ref, &opts).total,
        est.estimate(&view, &w, &opts).total
    );
    g.bench_function("estimate_warm_claim_refs", |b| {
        b.iter(|| black_box(est.estimate(&view, &by_ref, &opts).total))
    });
    let mut on = false;
    g.bench_function("estimate_after_one_node_change", |b| {
        b.iter(|| {
            on = !on;
            toggle_claim(&mut view, "c42", "c42-n500", on);
            black_box(est.estimate(&view, &w, &opts).total)
        })
    });
    let policy = Policy::from_value(&json!({
        "metadata": {"name": "bench"},
        "spec": {"placement": {
            "clusterAffinity": {"labelSelector": {"matchLabels": {"fleet": "synthetic"}}},
            "replicaScheduling": {"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Weighted",
                                  "weightPreference": {"dynamicWeight": "AvailableReplicas"}}}}
    }))
    .expect("policy");
    let big = gpu_workload(20_000);
    g.bench_function("place_dynamic_weight", |b| {
        b.iter(|| black_box(place(&view, &big, &policy, &mut est, &opts).clusters.len()))
    });
    // 8,000 GPUs per cluster, 6,000 free (0-4 of 8 used per node): 7,000 replicas fit
    // nowhere without preemption.
    let huge = gpu_workload(7_000);
    g.bench_function("preempt", |b| {
        b.iter(|| black_box(preempt(&view, &huge, &mut est, &opts).chosen))
    });
    g.finish();
}

/// The fleet's cluster `c0` with every node in NodePool `gpu` as instance type `g8`, a
/// NodeClaim per node (8 GPUs of capacity each) and a GPU limit 100 nodes above that.
fn autoscaled(nodes: usize) -> View {
    let mut view = fleet(1, nodes);
    let entries: Vec<_> = view.cluster("c0").expect("c0").nodes().cloned().collect();
    let apply = |view: &mut View, v: serde_json::Value, kind: ObjectKind| {
        let o = ClusterObject::from_json(kind, v.to_string().as_bytes()).expect("object");
        view.apply_object("c0", o).expect("apply");
    };
    for n in &entries {
        let mut labels = n.labels.clone();
        labels.insert("karpenter.sh/nodepool".into(), "gpu".into());
        labels.insert("node.kubernetes.io/instance-type".into(), "g8".into());
        let node = json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": &*n.name, "labels": labels},
            "spec": {"taints": n.taints},
            "status": {"allocatable": n.allocatable.to_map()}});
        apply(&mut view, node, ObjectKind::Node);
        let claim = json!({"apiVersion": "karpenter.sh/v1", "kind": "NodeClaim",
            "metadata": {"name": format!("gpu-{}", n.name),
                "labels": {"karpenter.sh/nodepool": "gpu", "node.kubernetes.io/instance-type": "g8"}},
            "status": {"nodeName": &*n.name, "capacity": {"nvidia.com/gpu": "8"}}});
        apply(&mut view, claim, ObjectKind::NodeClaim);
    }
    let pool = json!({"apiVersion": "karpenter.sh/v1", "kind": "NodePool",
        "metadata": {"name": "gpu"},
        "spec": {"limits": {"nvidia.com/gpu": ((nodes + 100) * 8).to_string()}}});
    apply(&mut view, pool, ObjectKind::NodePool);
    view
}

fn headroom(c: &mut Criterion) {
    let view = autoscaled(1000);
    let w = gpu_workload(1);
    let off = EstimateOptions::default();
    let on = EstimateOptions {
        headroom: Some(dramesh_estimator::HeadroomOptions::default()),
        ..EstimateOptions::default()
    };
    let mut g = c.benchmark_group("headroom_1000x8");
    g.sample_size(10);
    let mut est = Estimator::new();
    let got = est.estimate(&view, &w, &on);
    let h = got.clusters[0].headroom.as_ref().expect("headroom");
    assert_eq!(h.replicas, 800, "{h:?}");
    g.bench_function("warm", |b| {
        b.iter(|| black_box(est.estimate(&view, &w, &off).total))
    });
    g.bench_function("warm_with_headroom", |b| {
        b.iter(|| black_box(est.estimate(&view, &w, &on).total))
    });
    g.bench_function("cold", |b| {
        b.iter(|| black_box(Estimator::new().estimate(&view, &w, &off).total))
    });
    g.bench_function("headroom_cold", |b| {
        b.iter(|| black_box(Estimator::new().estimate(&view, &w, &on).total))
    });
    g.finish();
}

criterion_group!(benches, one_cluster, hundred_clusters, headroom);
criterion_main!(benches);
