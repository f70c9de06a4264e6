//! Binding preemption on a full device fleet: c0, c1 and c2 each have 2 nodes of 4 GPUs, all
//! in use by the Deployments train-0 (pod priority 0) and train-1 (priority 100), 4 GPUs each.

use std::collections::BTreeMap;

use dramesh_estimator::{EstimateOptions, Estimator, View};
use dramesh_scheduler::{Binding, BindingKind, Cluster, Demand, Fleet, demand, plan_preemption};
use dramesh_sim::typed::{FleetSpec, cluster_objects};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

fn view() -> View {
    let spec = FleetSpec {
        clusters: 3,
        nodes_per_cluster: 2,
        gpus_per_node: 4,
        owners_per_cluster: 2,
        kubernetes_version: "1.35".into(),
    };
    let mut view = View::new();
    for i in 0..3 {
        let name = format!("c{i}");
        cluster_objects(&spec, i, &|_| 4, |o| {
            view.apply_object(&name, o).expect("apply");
        });
    }
    view
}

fn clusters() -> BTreeMap<String, Cluster> {
    ["c0", "c1", "c2"]
        .into_iter()
        .map(|n| {
            let c = Cluster::from_value(&json!({
                "metadata": {"name": n},
                "spec": {"syncMode": "Push"},
                "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "", "message": "", "lastTransitionTime": "2026-11-25T09:00:00Z"}],
                           "apiEnablements": dramesh_sim::karmada_api_enablements()}
            }))
            .expect("cluster");
            (n.to_string(), c)
        })
        .collect()
}

fn binding(
    name: &str,
    deployment: &str,
    priority: i32,
    policy: &str,
    replicas: i32,
    assigned: Value,
) -> Binding {
    Binding::from_value(
        BindingKind::ResourceBinding,
        &json!({
            "metadata": {"name": name, "namespace": "default", "generation": 1,
                         "labels": {"propagationpolicy.karmada.io/permanent-id": "p"}},
            "spec": {
                "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "default", "name": deployment},
                "replicas": replicas,
                "placement": {"replicaScheduling": {"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Aggregated"}},
                "clusters": assigned,
                "schedulerName": "dramesh-scheduler",
                "schedulePriority": {"priority": priority, "preemptionPolicy": policy}
            }
        }),
    )
    .expect("binding")
}

fn gpu_demand(b: &Binding) -> Demand {
    let t = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "big", "namespace": "default"},
        "spec": {"template": {"spec": {
            "containers": [{"name": "main", "resources": {"requests": {"cpu": "1"}}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}}}});
    let ct = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu", "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}}}});
    demand(b, Some(&t), &[ct], &BTreeMap::new()).expect("demand")
}

fn now() -> Time {
    Time("2026-11-25T12:00:00Z".parse().expect("time"))
}

fn victims(train0: Value) -> Vec<Binding> {
    vec![
        binding("train-0-deployment", "train-0", 0, "", 8, train0),
        binding(
            "train-1-deployment",
            "train-1",
            100,
            "",
            12,
            json!([{"name": "c0", "replicas": 4}, {"name": "c1", "replicas": 4}, {"name": "c2", "replicas": 4}]),
        ),
    ]
}

#[test]
fn a_high_priority_gpu_binding_evicts_the_lowest_binding() {
    let view = view();
    let cl = clusters();
    let big = binding(
        "big-deployment",
        "big",
        1000,
        "PreemptLowerPriority",
        4,
        json!([]),
    );
    let all = victims(json!([{"name": "c0", "replicas": 4}, {"name": "c1", "replicas": 4}]));
    let plan = plan_preemption(
        &big,
        &gpu_demand(&big),
        &all,
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
        &now(),
    )
    .expect("plan");
    assert_eq!(plan.cluster, "c0");
    assert_eq!(plan.evictions.len(), 1);
    let e = &plan.evictions[0];
    assert_eq!(all[e.victim].metadata.name, "train-0-deployment");
    assert_eq!(e.replicas, 4);
    assert!(!e.patch.status);
    assert_eq!(
        e.patch.body,
        concat!(
            r#"{"spec":{"clusters":[{"name":"c1","replicas":4}],"gracefulEvictionTasks":[{"creationTimestamp":"2026-11-25T12:00:00Z","#,
            r#""fromCluster":"c0","gracePeriodSeconds":30,"message":"preempted by ResourceBinding default/big-deployment (priority 1000) to place it on cluster c0","#,
            r#""producer":"Scheduler","purgeMode":"Gracefully","reason":"BindingPreempted","replicas":4}]}}"#
        )
    );
    assert_eq!(e.event.reason, "Preempted");
    assert_eq!(plan.event.reason, "PreemptionInitiated");
}

#[test]
fn clusters_whose_victims_are_not_lower_bindings_are_not_chosen() {
    let view = view();
    let cl = clusters();
    let big = binding(
        "big-deployment",
        "big",
        1000,
        "PreemptLowerPriority",
        4,
        json!([]),
    );
    // train-0 is bound only on c1: its pods on c0 and c2 belong to no binding dramesh may evict.
    let all = victims(json!([{"name": "c1", "replicas": 4}]));
    let plan = plan_preemption(
        &big,
        &gpu_demand(&big),
        &all,
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
        &now(),
    )
    .expect("plan");
    assert_eq!(plan.cluster, "c1");
    // A victim binding of equal priority is never evicted.
    let peer = binding(
        "big-deployment",
        "big",
        0,
        "PreemptLowerPriority",
        4,
        json!([]),
    );
    let e = plan_preemption(
        &peer,
        &gpu_demand(&peer),
        &all,
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
        &now(),
    )
    .expect_err("no lower priority");
    assert!(e.contains("no cluster"), "{e}");
}

#[test]
fn nothing_is_evicted_when_evicting_everything_would_not_make_room() {
    let view = view();
    let cl = clusters();
    // 9 GPUs: no cluster has more than 8 even with every lower-priority workload gone.
    let big = binding(
        "big-deployment",
        "big",
        1000,
        "PreemptLowerPriority",
        9,
        json!([]),
    );
    let all = victims(json!([{"name": "c0", "replicas": 4}, {"name": "c1", "replicas": 4}]));
    let e = plan_preemption(
        &big,
        &gpu_demand(&big),
        &all,
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
        &now(),
    )
    .expect_err("cannot make room");
    assert!(
        e.contains("no cluster can fit the workload even after preemption"),
        "{e}"
    );
}

#[test]
fn preemption_policy_never_is_honoured() {
    let view = view();
    let cl = clusters();
    let big = binding("big-deployment", "big", 1000, "Never", 4, json!([]));
    let all = victims(json!([{"name": "c0", "replicas": 4}]));
    let e = plan_preemption(
        &big,
        &gpu_demand(&big),
        &all,
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
        &now(),
    )
    .expect_err("never");
    assert!(e.contains("Never"), "{e}");
}

#[test]
fn an_existing_eviction_task_for_the_cluster_is_not_duplicated() {
    let mut v = binding(
        "v",
        "train-0",
        0,
        "",
        4,
        json!([{"name": "c0", "replicas": 4}]),
    );
    v.graceful_eviction_tasks
        .push(dramesh_scheduler::object::GracefulEvictionTask {
            from_cluster: "c0".into(),
            reason: "TaintUntolerated".into(),
            producer: "TaintManager".into(),
            ..Default::default()
        });
    let p = dramesh_scheduler::preempt::eviction_patch(&v, "c0", "m", &now()).expect("patch");
    assert_eq!(p.body, r#"{"spec":{"clusters":null}}"#);
    assert_eq!(
        dramesh_scheduler::preempt::eviction_patch(&v, "c9", "m", &now()),
        None
    );
}
