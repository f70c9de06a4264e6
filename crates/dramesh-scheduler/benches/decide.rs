//! One binding through the scheduler core on the fleet: 100 Karmada clusters, each
//! reported by dramesh with 1,000 nodes x 8 GPUs (0-4 in use per node), a binding asking
//! for 8 one-GPU replicas divided by available replicas.
//!
//! - `decide/warm`: the decision with an estimator whose caches are built (the steady state
//!   of a replica scheduling bindings of known shapes).
//! - `decide/cold`: the same with a fresh estimator (the first binding of a shape).
//! - `pipeline/warm`: what a replica does per watch event: decode the binding, `plan`,
//!   `demand` from the template, `decide`, and the patch bodies.
//!
//! `DRAMESH_BENCH_FLEET=clusters,nodes` changes the fleet (default `100,1000`).

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use dramesh_estimator::{EstimateOptions, Estimator, View};
use dramesh_scheduler::{Binding, BindingKind, Cluster, Fleet, decide, demand, plan};
use dramesh_sim::typed::{FleetSpec, cluster_objects};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

fn shape() -> (usize, usize) {
    std::env::var("DRAMESH_BENCH_FLEET")
        .ok()
        .and_then(|s| {
            let (c, n) = s.split_once(',')?;
            Some((c.trim().parse().ok()?, n.trim().parse().ok()?))
        })
        .unwrap_or((100, 1000))
}

fn fleet(clusters: usize, nodes: usize) -> (View, BTreeMap<String, Cluster>) {
    let spec = FleetSpec {
        clusters,
        nodes_per_cluster: nodes,
        gpus_per_node: 8,
        owners_per_cluster: 4,
        kubernetes_version: "1.36".into(),
    };
    let mut view = View::new();
    let mut karmada = BTreeMap::new();
    for c in 0..clusters {
        let name = format!("c{c}");
        cluster_objects(&spec, c, &|n| n % 5, |o| {
            view.apply_object(&name, o).expect("apply");
        });
        let cluster = Cluster::from_value(&json!({
            "metadata": {"name": name, "labels": {"fleet": "synthetic"}},
            "spec": {"syncMode": "Push", "region": format!("region-{}", c % 4)},
            "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "ClusterReady",
                       "message": "", "lastTransitionTime": "2026-11-25T09:00:00Z"}],
                       "apiEnablements": dramesh_sim::karmada_api_enablements()}
        }))
        .expect("cluster");
        karmada.insert(name, cluster);
    }
    (view, karmada)
}

fn binding_json() -> Value {
    json!({
        "apiVersion": "work.karmada.io/v1alpha2", "kind": "ResourceBinding",
        "metadata": {"name": "train-deployment", "namespace": "default", "uid": "b", "generation": 1,
                     "resourceVersion": "10", "labels": {"propagationpolicy.karmada.io/permanent-id": "p"}},
        "spec": {
            "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "default", "name": "train", "uid": "t"},
            "replicas": 8,
            "placement": {"clusterAffinity": {"labelSelector": {"matchLabels": {"fleet": "synthetic"}}},
                          "replicaScheduling": {"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Weighted",
                                                "weightPreference": {"dynamicWeight": "AvailableReplicas"}}},
            "schedulerName": "dramesh-scheduler"
        }
    })
}

fn template() -> Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "train", "namespace": "default", "uid": "t"},
           "spec": {"replicas": 8, "selector": {}, "template": {"spec": {
               "containers": [{"name": "main", "resources": {"requests": {"cpu": "2", "memory": "16Gi"}}}],
               "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]}}}})
}

fn claim_template() -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
           "metadata": {"name": "gpu", "namespace": "default"},
           "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": dramesh_sim::typed::CLASS}}]}}}})
}

fn bench(c: &mut Criterion) {
    let (clusters, nodes) = shape();
    let (view, karmada) = fleet(clusters, nodes);
    let fleet = Fleet {
        clusters: &karmada,
        view: &view,
    };
    let mut opts = EstimateOptions::default();
    let b_json = binding_json();
    let t_json = template();
    let claims = [claim_template()];
    let classes = BTreeMap::new();
    let b = Binding::from_value(BindingKind::ResourceBinding, &b_json).expect("binding");
    let d = demand(&b, Some(&t_json), &claims, &classes).expect("demand");
    let now = Time("2026-11-25T12:00:00Z".parse().expect("time"));

    let mut g = c.benchmark_group(format!("decide_{clusters}x{nodes}x8"));
    g.sample_size(10);
    let mut warm = Estimator::new();
    let first = decide(&b, &d, fleet, &mut warm, &mut opts);
    assert!(first.condition.status, "{:?}", first.condition);
    g.bench_function("warm", |bench| {
        bench.iter(|| black_box(decide(&b, &d, fleet, &mut warm, &mut opts)))
    });
    g.bench_function("cold", |bench| {
        bench.iter(|| black_box(decide(&b, &d, fleet, &mut Estimator::new(), &mut opts)))
    });
    g.bench_function("pipeline_warm", |bench| {
        bench.iter(|| {
            let b = Binding::from_value(BindingKind::ResourceBinding, &b_json).expect("binding");
            let _ = black_box(plan(&b, &karmada, "dramesh-scheduler"));
            let d = demand(&b, Some(&t_json), &claims, &classes).expect("demand");
            let decision = decide(&b, &d, fleet, &mut warm, &mut opts);
            black_box(decision.patches(&b, &now))
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
