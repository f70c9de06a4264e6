//! Decisions on a small device fleet: c0 with 8 free GPUs, c1 with 4, c2 full (all three
//! reported by dramesh agents), and s0, a cluster Karmada knows but no agent reports (only
//! its resourceSummary).

use std::collections::BTreeMap;

use dramesh_estimator::{EstimateOptions, Estimator, TargetCluster, View};
use dramesh_scheduler::decide::STALE_REASON;
use dramesh_scheduler::{
    Binding, BindingKind, Cluster, Demand, Fleet, Reason, Retry, decide, demand,
};
use dramesh_sim::typed::{FleetSpec, cluster_objects};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

/// GPUs in use per node of c0, c1, c2 (2 nodes of 4 GPUs each).
const USED: [usize; 3] = [0, 2, 4];

fn view() -> View {
    let spec = FleetSpec {
        clusters: 3,
        nodes_per_cluster: 2,
        gpus_per_node: 4,
        owners_per_cluster: 2,
        kubernetes_version: "1.35".into(),
    };
    let mut view = View::new();
    for (i, used) in USED.iter().enumerate() {
        let name = format!("c{i}");
        cluster_objects(&spec, i, &|_| *used, |o| {
            view.apply_object(&name, o).expect("apply");
        });
    }
    view
}

fn karmada_cluster(name: &str, ready: &str, taints: Value) -> Cluster {
    Cluster::from_value(&json!({
        "apiVersion": "cluster.karmada.io/v1alpha1", "kind": "Cluster",
        "metadata": {"name": name, "labels": {"name": name}},
        "spec": {"syncMode": "Push", "taints": taints},
        "status": {
            "conditions": [{"type": "Ready", "status": ready, "reason": "", "message": "", "lastTransitionTime": "2026-11-25T09:00:00Z"}],
            "resourceSummary": {"allocatable": {"cpu": "64", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "16"},
                                "allocated": {"cpu": "4", "memory": "16Gi", "pods": "10"}},
            "apiEnablements": dramesh_sim::karmada_api_enablements()
        }
    }))
    .expect("cluster")
}

fn clusters() -> BTreeMap<String, Cluster> {
    ["c0", "c1", "c2", "s0"]
        .into_iter()
        .map(|n| (n.to_string(), karmada_cluster(n, "True", json!([]))))
        .collect()
}

fn binding(placement: Value, replicas: i32, assigned: Value) -> Binding {
    Binding::from_value(
        BindingKind::ResourceBinding,
        &json!({
            "metadata": {"name": "train-deployment", "namespace": "default", "generation": 2,
                         "labels": {"propagationpolicy.karmada.io/permanent-id": "p"}},
            "spec": {
                "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "default", "name": "train", "uid": "u-1"},
                "replicas": replicas,
                "placement": placement,
                "clusters": assigned,
                "schedulerName": "dramesh-scheduler"
            },
            "status": {"schedulerObservedGeneration": 1, "lastScheduledTime": "2026-11-25T10:00:00Z"}
        }),
    )
    .expect("binding")
}

fn dynamic() -> Value {
    json!({"replicaScheduling": {"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Weighted",
                                 "weightPreference": {"dynamicWeight": "AvailableReplicas"}}})
}

fn template(gpus: bool) -> Value {
    let mut pod = json!({"containers": [{"name": "main", "image": "x", "resources": {"requests": {"cpu": "1", "memory": "4Gi"}}}]});
    if gpus {
        pod["resourceClaims"] = json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]);
    }
    json!({"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "train", "namespace": "default", "uid": "u-1"},
           "spec": {"replicas": 1, "selector": {}, "template": {"spec": pod}}})
}

fn claim_template() -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
           "metadata": {"name": "one-gpu", "namespace": "default"},
           "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}}}})
}

fn gpu_demand(b: &Binding) -> Demand {
    demand(
        b,
        Some(&template(true)),
        &[claim_template()],
        &BTreeMap::new(),
    )
    .expect("demand")
}

fn tc(v: &[(&str, i64)]) -> Vec<TargetCluster> {
    v.iter()
        .map(|(n, r)| TargetCluster {
            name: n.to_string(),
            replicas: *r,
        })
        .collect()
}

fn sorted(mut v: Vec<TargetCluster>) -> Vec<TargetCluster> {
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

#[test]
fn a_device_workload_lands_only_where_its_devices_fit() {
    let view = view();
    let cl = clusters();
    let b = binding(dynamic(), 6, json!([]));
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(d.condition.reason, Reason::Success, "{:?}", d.condition);
    assert_eq!(d.retry, Retry::No);
    // 8 and 4 free GPUs: 6 divided 4:2; c2 is full; s0 has no agent and is never
    // estimated for device claims.
    assert_eq!(
        sorted(d.clusters.clone().expect("result")),
        tc(&[("c0", 4), ("c1", 2)])
    );
    assert_eq!(d.available.get("c0"), Some(&8));
    assert_eq!(d.available.get("c1"), Some(&4));
    assert_eq!(d.available.get("c2"), Some(&0));
    assert_eq!(d.available.get("s0"), Some(&0));
    assert!(
        d.excluded["s0"].contains("never estimated from its resourceSummary"),
        "{:?}",
        d.excluded
    );
    assert_eq!(d.events.len(), 1);
    assert_eq!(d.events[0].reason, "ScheduleBindingSucceed");
    assert!(
        d.events[0]
            .message
            .starts_with("Binding has been scheduled successfully. Result: {"),
        "{}",
        d.events[0].message
    );
}

#[test]
fn a_cluster_without_an_agent_is_estimated_from_its_resource_summary() {
    let view = view();
    let cl = clusters();
    let b = binding(dynamic(), 6, json!([]));
    let w = demand(&b, Some(&template(false)), &[], &BTreeMap::new()).expect("demand");
    let d = decide(
        &b,
        &w,
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    // (64 - 4) cpu / 1 = 60, (256 - 16) Gi / 4 Gi = 60, 100 pod slots: 60.
    assert_eq!(d.available.get("s0"), Some(&60));
    assert_eq!(d.condition.reason, Reason::Success);
}

#[test]
fn scale_up_keeps_the_previous_clusters() {
    let view = view();
    let cl = clusters();
    // Was 2 on c1; 4 now: the 2 new replicas are divided 8:4 (Webster) and added.
    let b = binding(dynamic(), 4, json!([{"name": "c1", "replicas": 2}]));
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(
        sorted(d.clusters.expect("result")),
        tc(&[("c0", 1), ("c1", 3)])
    );
    // Scale down divides the new count over the clusters in use by what they hold.
    let b = binding(
        dynamic(),
        3,
        json!([{"name": "c0", "replicas": 4}, {"name": "c1", "replicas": 2}]),
    );
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(
        sorted(d.clusters.expect("result")),
        tc(&[("c0", 2), ("c1", 1)])
    );
}

#[test]
fn a_cluster_going_not_ready_loses_its_replicas() {
    let view = view();
    let mut cl = clusters();
    cl.insert("c0".into(), karmada_cluster("c0", "False", json!([])));
    let b = binding(dynamic(), 4, json!([{"name": "c0", "replicas": 4}]));
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(d.clusters.expect("result"), tc(&[("c1", 4)]));
    assert_eq!(
        d.excluded["c0"],
        "cluster(s) had untolerated taint {cluster.karmada.io/not-ready:NoExecute}"
    );
}

#[test]
fn no_fit_clears_the_result_with_karmadas_histogram() {
    let view = view();
    let mut cl = clusters();
    cl.insert(
        "c1".into(),
        karmada_cluster(
            "c1",
            "True",
            json!([{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]),
        ),
    );
    let placement = json!({"clusterAffinity": {"clusterNames": ["c1", "c2"]}, "replicaScheduling": dynamic()["replicaScheduling"]});
    let mut opts = EstimateOptions {
        stale: vec!["c2".into()],
        ..EstimateOptions::default()
    };
    let b = binding(placement, 2, json!([]));
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut opts,
    );
    assert_eq!(d.condition.reason, Reason::NoClusterFit);
    assert!(!d.condition.status);
    assert_eq!(
        d.condition.message,
        "0/4 clusters are available: 1 cluster(s) had stale dramesh data, 1 cluster(s) had untolerated taint {dedicated=ml:NoSchedule}, 2 cluster(s) did not match the placement cluster affinity constraint."
    );
    assert_eq!(
        d.clusters,
        Some(Vec::new()),
        "Karmada writes the empty result"
    );
    assert_eq!(d.retry, Retry::Unschedulable);
    assert_eq!(d.excluded["c2"], STALE_REASON);
}

#[test]
fn too_few_devices_is_unschedulable_and_keeps_the_spec() {
    let view = view();
    let cl = clusters();
    let b = binding(dynamic(), 13, json!([]));
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(d.condition.reason, Reason::Unschedulable);
    assert_eq!(
        d.condition.message,
        "failed to assign replicas: failed to scale up: Clusters available replicas 12 are not enough to schedule."
    );
    assert_eq!(d.clusters, None);
    assert_eq!(d.retry, Retry::Unschedulable);
}

#[test]
fn stale_clusters_get_nothing_and_the_message_says_so() {
    let view = view();
    let cl = clusters();
    let mut opts = EstimateOptions {
        stale: vec!["c0".into()],
        ..EstimateOptions::default()
    };
    let b = binding(dynamic(), 2, json!([]));
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut opts,
    );
    assert_eq!(d.clusters.expect("result"), tc(&[("c1", 2)]));
    assert_eq!(
        d.condition.message,
        "Binding has been scheduled successfully. Not considered, dramesh data stale: c0."
    );
    assert_eq!(opts.stale, ["c0"]);
    assert!(
        opts.clusters.is_empty(),
        "the caller's options are left as they were"
    );
    // A caller's cluster list restricts what dramesh estimates.
    let mut only_c0 = EstimateOptions {
        clusters: vec!["c0".into()],
        ..EstimateOptions::default()
    };
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut only_c0,
    );
    assert_eq!(d.clusters.expect("result"), tc(&[("c0", 2)]));
    assert_eq!(d.excluded["c1"], "not among the clusters asked for");
    assert_eq!(only_c0.clusters, ["c0"]);
}

#[test]
fn cluster_affinities_are_tried_in_order() {
    let view = view();
    let cl = clusters();
    let placement = json!({
        "clusterAffinities": [
            {"affinityName": "full", "clusterNames": ["c2"]},
            {"affinityName": "spare", "clusterNames": ["c0", "c1"]}
        ],
        "replicaScheduling": dynamic()["replicaScheduling"]
    });
    let b = binding(placement, 2, json!([]));
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(d.condition.reason, Reason::Success);
    assert_eq!(d.affinity_name.as_deref(), Some("spare"));
    assert_eq!(d.events.len(), 2);
    assert_eq!(
        d.events[0].message,
        "failed to schedule ResourceBinding(default/train-deployment) with clusterAffiliates index(0): failed to assign replicas: failed to scale up: Clusters available replicas 0 are not enough to schedule."
    );
    let now = Time("2026-11-25T12:00:00Z".parse().expect("time"));
    let patches = d.patches(&b, &now);
    assert_eq!(patches.len(), 3);
    assert!(
        !patches[0].status
            && patches[0]
                .body
                .contains(r#""clusters":[{"name":"c0","replicas":"#)
    );
    assert_eq!(
        patches[1].body,
        r#"{"status":{"schedulerObservingAffinityName":"spare"}}"#
    );
    assert!(
        patches[2]
            .body
            .contains(r#""schedulerObservedGeneration":2"#),
        "{}",
        patches[2].body
    );

    // Every term failing with a capacity error returns the first error, writes no result.
    let placement = json!({
        "clusterAffinities": [{"affinityName": "full", "clusterNames": ["c2"]}],
        "replicaScheduling": dynamic()["replicaScheduling"]
    });
    let b = binding(placement, 2, json!([]));
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(d.condition.reason, Reason::Unschedulable);
    assert_eq!(d.clusters, None);
    assert_eq!(d.events.len(), 1, "only the per-term event");
}

#[test]
fn duplicated_and_static_weights() {
    let view = view();
    let cl = clusters();
    let b = binding(
        json!({"clusterAffinity": {"clusterNames": ["c0", "c1"]}}),
        3,
        json!([]),
    );
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(d.clusters.expect("result"), tc(&[("c0", 3), ("c1", 3)]));

    let placement = json!({"replicaScheduling": {"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Weighted",
        "weightPreference": {"staticWeightList": [
            {"targetCluster": {"clusterNames": ["c0"]}, "weight": 2},
            {"targetCluster": {"clusterNames": ["c1"]}, "weight": 1}]}}});
    let b = binding(placement, 6, json!([]));
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(
        sorted(d.clusters.expect("result")),
        tc(&[("c0", 4), ("c1", 2)])
    );
}

#[test]
fn spread_by_cluster_limits_the_groups() {
    let view = view();
    let cl = clusters();
    let mut placement = dynamic();
    placement["spreadConstraints"] =
        json!([{"spreadByField": "cluster", "maxGroups": 1, "minGroups": 1}]);
    let b = binding(placement.clone(), 4, json!([]));
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(d.clusters.expect("result"), tc(&[("c0", 4)]));
    // 9 replicas cannot fit in one cluster: a selection error.
    let b = binding(placement, 9, json!([]));
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(d.condition.reason, Reason::SchedulerError);
    assert!(
        d.condition
            .message
            .starts_with("failed to select clusters: "),
        "{}",
        d.condition.message
    );
    assert_eq!(d.retry, Retry::Error);
}

#[test]
fn a_past_deadline_is_an_error_to_retry() {
    let view = view();
    let cl = clusters();
    let mut opts = EstimateOptions {
        deadline: Some(std::time::Instant::now()),
        ..EstimateOptions::default()
    };
    let b = binding(dynamic(), 2, json!([]));
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut opts,
    );
    assert_eq!(d.condition.reason, Reason::SchedulerError);
    assert_eq!(d.retry, Retry::Error);
    assert_eq!(d.clusters, None);
}

#[test]
fn cluster_resource_bindings_get_karmadas_event_wording() {
    let view = view();
    let cl = clusters();
    let b = Binding::from_value(
        BindingKind::ClusterResourceBinding,
        &json!({
            "metadata": {"name": "train-crb", "generation": 1,
                         "labels": {"clusterpropagationpolicy.karmada.io/permanent-id": "p"}},
            "spec": {
                "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "default", "name": "train"},
                "replicas": 2,
                "placement": dynamic(),
                "schedulerName": "dramesh-scheduler"
            }
        }),
    )
    .expect("binding");
    assert_eq!(b.id(), "ClusterResourceBinding train-crb");
    let d = decide(
        &b,
        &gpu_demand(&b),
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(
        d.clusters
            .clone()
            .expect("result")
            .iter()
            .map(|c| c.replicas)
            .sum::<i64>(),
        2
    );
    // ClusterResourceBindings: "Result {" without the colon, as karmada-scheduler writes it.
    assert!(
        d.events[0]
            .message
            .starts_with("Binding has been scheduled successfully. Result {c"),
        "{}",
        d.events[0].message
    );
}

/// The member cluster's own `one-gpu`: two GPUs per replica.
fn member_template() -> dramesh_model::ClusterObject {
    let mut t = claim_template();
    t["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = json!(2);
    dramesh_model::ClusterObject::ResourceClaimTemplate(std::sync::Arc::new(
        serde_json::from_value(t).expect("template"),
    ))
}

/// A binding carrying Karmada's `resourceClaimRefs` (DRA estimator design), as an API server
/// whose ResourceBinding CRD has the field returns it. The CRD among the fixtures does not
/// have it yet; decoding accepts it all the same.
fn binding_with_refs(refs: Value) -> Binding {
    let mut v = json!({
        "metadata": {"name": "train-deployment", "namespace": "default", "generation": 2},
        "spec": {
            "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "default", "name": "train", "uid": "u-1"},
            "replicas": 6,
            "replicaRequirements": {"resourceRequest": {"cpu": "1", "memory": "4Gi"}, "namespace": "default",
                                    "resourceClaimRefs": refs},
            "placement": dynamic(),
            "schedulerName": "dramesh-scheduler"
        }
    });
    if v["spec"]["replicaRequirements"]["resourceClaimRefs"].is_null() {
        v["spec"]["replicaRequirements"]
            .as_object_mut()
            .map(|r| r.remove("resourceClaimRefs"));
    }
    Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding")
}

fn available(b: &Binding, d: &Demand, view: &View) -> BTreeMap<String, i64> {
    let cl = clusters();
    decide(
        b,
        d,
        Fleet {
            clusters: &cl,
            view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    )
    .available
}

#[test]
fn claim_references_use_the_member_clusters_templates_and_karmadas_where_none() {
    let mut view = view();
    // c0's agent publishes its own one-gpu (two GPUs); c1's and c2's publish none.
    view.apply_object("c0", member_template()).expect("apply");
    let refs = json!([{"resourceClaimTemplateName": "one-gpu"}]);
    let b = binding_with_refs(refs);
    let r = b.replica_requirements.as_ref().expect("requirements");
    assert_eq!(
        r.resource_claim_refs.len(),
        1,
        "read although the fixture CRD lacks it"
    );
    assert_eq!(
        r.resource_claim_refs[0].resource_claim_template_name,
        "one-gpu"
    );
    let d = demand(
        &b,
        Some(&template(true)),
        &[claim_template()],
        &BTreeMap::new(),
    )
    .expect("demand");
    let Demand::Replicas(w) = &d else {
        panic!("{d:?}")
    };
    assert_eq!(
        w.claim_refs,
        [dramesh_estimator::ClaimRef::Template {
            pod_claim: "ref-0".into(),
            name: "one-gpu".into()
        }],
        "the binding's references"
    );
    let got = available(&b, &d, &view);
    // c0: 8 free GPUs, two per replica (its own template); c1: 4 free, one each (Karmada's
    // template: c1 publishes none); c2 is full.
    assert_eq!(got.get("c0"), Some(&4), "{got:?}");
    assert_eq!(got.get("c1"), Some(&4), "{got:?}");
    assert_eq!(got.get("c2").copied().unwrap_or(0), 0, "{got:?}");

    // Without references on the binding, the pod template's claims are resolved the same way.
    let plain = binding_with_refs(Value::Null);
    let d = demand(
        &plain,
        Some(&template(true)),
        &[claim_template()],
        &BTreeMap::new(),
    )
    .expect("demand");
    assert_eq!(available(&plain, &d, &view), got);

    // Karmada holds no one-gpu: no fallback, so c1 answers 0, naming the template.
    let d = demand(&b, Some(&template(true)), &[], &BTreeMap::new()).expect("demand");
    let cl = clusters();
    let decision = decide(
        &b,
        &d,
        Fleet {
            clusters: &cl,
            view: &view,
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    );
    assert_eq!(decision.available.get("c0"), Some(&4));
    assert_eq!(decision.available.get("c1").copied().unwrap_or(0), 0);
    let why = format!("{:?} {:?}", decision.excluded, decision.condition);
    assert!(
        why.contains("ResourceClaimTemplate default/one-gpu not found in cluster c1"),
        "{why}"
    );

    // A reference naming nothing is an input error naming the field.
    let bad = binding_with_refs(json!([{}]));
    let e = demand(
        &bad,
        Some(&template(true)),
        &[claim_template()],
        &BTreeMap::new(),
    )
    .expect_err("empty reference");
    assert_eq!(e.field, "spec.replicaRequirements.resourceClaimRefs[0]");
}
