//! Decisions on Karmada clusters no dramesh agent reports, as Karmada makes them: spread
//! constraints by region and cluster over 3 regions × 2 clusters, static weights keeping a
//! remainder where the last assignment had it, and the general estimator's resource models.
//! Every cluster is a Cluster object as a Karmada API server returns it.

use std::collections::BTreeMap;

use dramesh_estimator::{EstimateOptions, Estimator, TargetCluster, View};
use dramesh_scheduler::{
    Binding, BindingKind, Cluster, Decision, Reason, Retry, decide, demand, general_replicas,
};
use serde_json::{Value, json};

/// A cluster in `region` whose summary leaves `cpus` whole CPUs (and plenty of memory and
/// pod slots): `cpus` replicas of the 1-cpu / 4Gi template fit.
fn cluster(name: &str, region: &str, cpus: i64, extra_spec: Value, extra_summary: Value) -> Value {
    let mut spec = json!({"syncMode": "Push", "apiEndpoint": format!("https://{name}"),
                          "provider": "example", "region": region, "zones": [format!("{region}-a")]});
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra_spec.as_object()) {
        s.extend(e.clone());
    }
    let mut summary = json!({
        "allocatable": {"cpu": format!("{}", cpus + 1), "memory": "256Gi", "pods": "110"},
        "allocated": {"cpu": "1", "memory": "8Gi", "pods": "10"},
        "allocating": {"cpu": "0", "pods": "0"}
    });
    if let (Some(s), Some(e)) = (summary.as_object_mut(), extra_summary.as_object()) {
        s.extend(e.clone());
    }
    json!({
        "apiVersion": "cluster.karmada.io/v1alpha1", "kind": "Cluster",
        "metadata": {"name": name, "generation": 1, "resourceVersion": "7",
                     "labels": {"topology.example.com/region": region}},
        "spec": spec,
        "status": {
            "kubernetesVersion": "v1.35.0",
            "conditions": [{"type": "Ready", "status": "True", "reason": "ClusterReady",
                            "message": "cluster is healthy and ready to accept workloads",
                            "lastTransitionTime": "2026-11-25T09:00:00Z"}],
            "nodeSummary": {"totalNum": 2, "readyNum": 2},
            "resourceSummary": summary,
            "apiEnablements": dramesh_sim::karmada_api_enablements()
        }
    })
}

/// east holds 5 replicas (3 + 2), west 12 (8 + 4), north 9 (6 + 3).
fn fleet() -> BTreeMap<String, Cluster> {
    [
        ("east-1", "east", 3),
        ("east-2", "east", 2),
        ("west-1", "west", 8),
        ("west-2", "west", 4),
        ("north-1", "north", 6),
        ("north-2", "north", 3),
    ]
    .into_iter()
    .map(|(n, r, c)| {
        let c = Cluster::from_value(&cluster(n, r, c, json!({}), json!({}))).expect("cluster");
        (n.to_string(), c)
    })
    .collect()
}

fn binding(placement: Value, replicas: i32, assigned: Value) -> Result<Binding, String> {
    Binding::from_value(
        BindingKind::ResourceBinding,
        &json!({
            "apiVersion": "work.karmada.io/v1alpha2", "kind": "ResourceBinding",
            "metadata": {"name": "web-deployment", "namespace": "default", "generation": 2,
                         "resourceVersion": "100",
                         "labels": {"propagationpolicy.karmada.io/permanent-id": "p"}},
            "spec": {
                "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "default",
                             "name": "web", "uid": "u-1"},
                "replicas": replicas,
                "placement": placement,
                "clusters": assigned,
                "schedulerName": "dramesh-scheduler"
            },
            "status": {"schedulerObservedGeneration": 1, "lastScheduledTime": "2026-11-25T10:00:00Z"}
        }),
    )
    .map_err(|e| e.to_string())
}

fn template() -> Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "web", "namespace": "default", "uid": "u-1"},
           "spec": {"replicas": 1, "selector": {}, "template": {"spec": {"containers": [
               {"name": "main", "image": "x", "resources": {"requests": {"cpu": "1", "memory": "4Gi"}}}]}}}})
}

fn dynamic(spread: Value) -> Value {
    json!({"spreadConstraints": spread,
           "replicaScheduling": {"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Weighted",
                                 "weightPreference": {"dynamicWeight": "AvailableReplicas"}}})
}

fn run(b: &Binding, clusters: &BTreeMap<String, Cluster>) -> Decision {
    let w = demand(b, Some(&template()), &[], &BTreeMap::new()).expect("demand");
    decide(
        b,
        &w,
        dramesh_scheduler::Fleet {
            clusters,
            view: &View::new(),
        },
        &mut Estimator::new(),
        &mut EstimateOptions::default(),
    )
}

fn result(d: &Decision) -> BTreeMap<String, i64> {
    d.clusters
        .iter()
        .flatten()
        .map(|t| (t.name.clone(), t.replicas))
        .collect()
}

fn m(v: &[(&str, i64)]) -> BTreeMap<String, i64> {
    v.iter().map(|(k, r)| (k.to_string(), *r)).collect()
}

#[test]
fn one_region_is_the_one_that_holds_the_replicas() {
    let fl = fleet();
    let one = json!([{"spreadByField": "region", "minGroups": 1, "maxGroups": 1},
                     {"spreadByField": "cluster", "minGroups": 2, "maxGroups": 2}]);
    // 10 replicas: west (12) holds them; north (9) and east (5) do not. Divided 8:4.
    let d = run(
        &binding(dynamic(one.clone()), 10, json!([])).expect("b"),
        &fl,
    );
    assert_eq!(
        d.condition.reason,
        Reason::Success,
        "{}",
        d.condition.message
    );
    assert_eq!(result(&d), m(&[("west-1", 7), ("west-2", 3)]));

    // The binding runs in east (2 + 1), which holds 8 with what it has there, still short
    // of 10: Karmada's locality score does not keep it there.
    let d = run(
        &binding(
            dynamic(one.clone()),
            10,
            json!([{"name": "east-1", "replicas": 2}, {"name": "east-2", "replicas": 1}]),
        )
        .expect("b"),
        &fl,
    );
    assert_eq!(result(&d).keys().collect::<Vec<_>>(), ["west-1", "west-2"]);

    // 4 replicas fit every region; the one the binding runs in (north) keeps them.
    let d = run(
        &binding(
            dynamic(one.clone()),
            4,
            json!([{"name": "north-1", "replicas": 2}, {"name": "north-2", "replicas": 2}]),
        )
        .expect("b"),
        &fl,
    );
    assert_eq!(result(&d), m(&[("north-1", 2), ("north-2", 2)]));

    // 20 replicas fit no region: west is selected and the assignment fails as Karmada's does.
    let d = run(&binding(dynamic(one), 20, json!([])).expect("b"), &fl);
    assert_eq!(d.condition.reason, Reason::Unschedulable);
    assert_eq!(
        d.condition.message,
        "failed to assign replicas: failed to scale up: Clusters available replicas 12 are not \
         enough to schedule."
    );
    assert_eq!(d.retry, Retry::Unschedulable);
    assert_eq!(d.clusters, None, "the spec is left alone");
}

#[test]
fn two_regions_then_the_best_clusters_of_both() {
    let fl = fleet();
    // A region's share of 10 is 5: every region holds it with its two clusters, so they tie
    // and the first by name wins (east, then north); one cluster of each, then the rest by
    // available replicas, up to 4.
    let two = json!([{"spreadByField": "region", "minGroups": 2, "maxGroups": 2},
                     {"spreadByField": "cluster", "minGroups": 2, "maxGroups": 4}]);
    let d = run(&binding(dynamic(two), 10, json!([])).expect("b"), &fl);
    assert_eq!(
        d.condition.reason,
        Reason::Success,
        "{}",
        d.condition.message
    );
    let got = result(&d);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        ["east-1", "east-2", "north-1", "north-2"]
    );
    assert_eq!(got.values().sum::<i64>(), 10);
    // Two regions, two clusters at most: the best cluster of each.
    let capped = json!([{"spreadByField": "region", "minGroups": 2, "maxGroups": 2},
                        {"spreadByField": "cluster", "minGroups": 2, "maxGroups": 2}]);
    let d = run(&binding(dynamic(capped), 9, json!([])).expect("b"), &fl);
    assert_eq!(result(&d), m(&[("east-1", 3), ("north-1", 6)]));
    // Four regions wanted, three exist.
    let four = json!([{"spreadByField": "region", "minGroups": 4, "maxGroups": 4},
                      {"spreadByField": "cluster", "minGroups": 4, "maxGroups": 8}]);
    let d = run(&binding(dynamic(four), 4, json!([])).expect("b"), &fl);
    assert_eq!(d.condition.reason, Reason::SchedulerError);
    assert_eq!(
        d.condition.message,
        "failed to select clusters: the number of feasible region is less than \
         spreadConstraint.MinGroups"
    );
}

#[test]
fn zone_constraints_select_as_the_cluster_constraint_alone() {
    let fl = fleet();
    let zoned = json!([{"spreadByField": "zone", "minGroups": 3, "maxGroups": 3},
                       {"spreadByField": "cluster", "minGroups": 1, "maxGroups": 1}]);
    let d = run(&binding(dynamic(zoned), 8, json!([])).expect("b"), &fl);
    assert_eq!(result(&d), m(&[("west-1", 8)]));
}

#[test]
fn hostile_spread_constraints_name_the_field() {
    let fl = fleet();
    let dup = json!([{"spreadByField": "region", "minGroups": 1, "maxGroups": 1},
                     {"spreadByField": "cluster", "minGroups": 1, "maxGroups": 2},
                     {"spreadByField": "region", "minGroups": 2, "maxGroups": 2}]);
    let d = run(&binding(dynamic(dup), 4, json!([])).expect("b"), &fl);
    assert_eq!(d.condition.reason, Reason::SchedulerError);
    assert_eq!(
        d.condition.message,
        "failed to select clusters: spec.placement.spreadConstraints[2]: multiple region \
         spread constraints are not allowed"
    );
    assert_eq!(d.retry, Retry::Error);
    // Absurd minGroups: an ordinary failure.
    let absurd = json!([{"spreadByField": "region", "minGroups": 1, "maxGroups": 1},
                        {"spreadByField": "cluster", "minGroups": 9_000_000_000_000_i64,
                         "maxGroups": 9_000_000_000_000_i64}]);
    let d = run(&binding(dynamic(absurd), 4, json!([])).expect("b"), &fl);
    assert_eq!(
        d.condition.message,
        "failed to select clusters: the number of clusters is less than the cluster \
         spreadConstraint.MinGroups"
    );
    // Negative groups never decode.
    let negative = json!([{"spreadByField": "cluster", "minGroups": -1, "maxGroups": 2}]);
    let e = binding(dynamic(negative), 4, json!([])).expect_err("negative");
    assert!(
        e.contains("spec.placement.spreadConstraints[0].minGroups")
            && e.contains("lower than 0 is not allowed"),
        "{e}"
    );
}

#[test]
fn static_weight_remainders_stay_where_the_last_assignment_put_them() {
    let fl = fleet();
    let placement = json!({"clusterAffinity": {"clusterNames": ["west-1", "west-2"]},
        "replicaScheduling": {"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Weighted",
        "weightPreference": {"staticWeightList": [
            {"targetCluster": {"clusterNames": ["west-1", "west-2"]}, "weight": 1}]}}});
    for last in [
        [("west-1", 1), ("west-2", 2)],
        [("west-1", 2), ("west-2", 1)],
    ] {
        let assigned: Vec<Value> = last
            .iter()
            .map(|(n, r)| json!({"name": n, "replicas": r}))
            .collect();
        let d = run(
            &binding(placement.clone(), 3, Value::Array(assigned)).expect("b"),
            &fl,
        );
        assert_eq!(result(&d), m(&last), "kept as it was");
        // Scaled to 5, the odd one stays with the cluster that had it.
        let assigned: Vec<Value> = last
            .iter()
            .map(|(n, r)| json!({"name": n, "replicas": r}))
            .collect();
        let d = run(
            &binding(placement.clone(), 5, Value::Array(assigned)).expect("b"),
            &fl,
        );
        let more = if last[0].1 > last[1].1 {
            m(&[("west-1", 3), ("west-2", 2)])
        } else {
            m(&[("west-1", 2), ("west-2", 3)])
        };
        assert_eq!(result(&d), more);
    }
}

/// Karmada's documentation example of resource models: grades by CPU and memory ranges.
fn models() -> Value {
    json!({"resourceModels": [
        {"grade": 0, "ranges": [{"name": "cpu", "min": "0", "max": "1"},
                                {"name": "memory", "min": "0", "max": "4Gi"}]},
        {"grade": 1, "ranges": [{"name": "cpu", "min": "1", "max": "2"},
                                {"name": "memory", "min": "4Gi", "max": "16Gi"}]},
        {"grade": 2, "ranges": [{"name": "cpu", "min": "2", "max": "4"},
                                {"name": "memory", "min": "16Gi", "max": "32Gi"}]},
        {"grade": 3, "ranges": [{"name": "cpu", "min": "4", "max": "8"},
                                {"name": "memory", "min": "32Gi", "max": "64Gi"}]}]})
}

fn modelings(counts: &[(u32, i64)]) -> Value {
    json!({"allocatableModelings": counts
        .iter()
        .map(|(g, c)| json!({"grade": g, "count": c}))
        .collect::<Vec<_>>()})
}

#[test]
fn resource_models_bound_a_summary_only_cluster_as_karmada_does() {
    let modeled = |spec: Value, summary: Value| {
        Cluster::from_value(&cluster("south-1", "south", 60, spec, summary)).expect("cluster")
    };
    let per = |c: &Cluster| {
        let b = binding(dynamic(json!([])), 1, json!([])).expect("b");
        match demand(&b, Some(&template()), &[], &BTreeMap::new()).expect("demand") {
            dramesh_scheduler::Demand::Replicas(w) => general_replicas(c, &w.requests),
            _ => unreachable!("a Deployment"),
        }
    };
    let counts = modelings(&[(0, 1), (1, 2), (2, 3), (3, 2)]);
    // 1 cpu / 4Gi a replica: grade 1 nodes take 1, grade 2 nodes 2, grade 3 nodes 4:
    // 2 + 6 + 8 = 16, where the summary alone says 60.
    let c = modeled(models(), counts.clone());
    assert_eq!(c.models.len(), 4);
    assert_eq!(per(&c), 16);
    // Without node counts, or without declared models, or with a negative count: the
    // summary (Karmada falls back the same way).
    assert_eq!(per(&modeled(models(), json!({}))), 60);
    assert_eq!(per(&modeled(json!({}), counts.clone())), 60);
    assert_eq!(per(&modeled(models(), modelings(&[(3, -1)]))), 60);
    // Pod slots still bound the models: 100 slots left, 8 grade-3 nodes × 4 = 32 → 32;
    // with 20 slots, 20.
    let slots = modeled(
        models(),
        json!({"allocatable": {"cpu": "61", "memory": "256Gi", "pods": "30"},
               "allocatableModelings": [{"grade": 3, "count": 8}]}),
    );
    assert_eq!(per(&slots), 20);

    // In a decision: 16 fit, so 20 replicas do not.
    let mut fl = BTreeMap::new();
    fl.insert("south-1".to_string(), c);
    let d = run(&binding(dynamic(json!([])), 20, json!([])).expect("b"), &fl);
    assert_eq!(d.available.get("south-1"), Some(&16));
    assert_eq!(d.condition.reason, Reason::Unschedulable);
    assert!(
        d.condition
            .message
            .ends_with("Clusters available replicas 16 are not enough to schedule."),
        "{}",
        d.condition.message
    );
    let d = run(&binding(dynamic(json!([])), 16, json!([])).expect("b"), &fl);
    assert_eq!(
        d.clusters,
        Some(vec![TargetCluster {
            name: "south-1".into(),
            replicas: 16
        }])
    );
}

#[test]
fn a_bad_resource_model_names_its_field() {
    let bad = cluster(
        "south-1",
        "south",
        4,
        json!({"resourceModels": [{"grade": 1, "ranges": [{"name": "cpu", "min": "lots", "max": "2"}]}]}),
        json!({}),
    );
    let e = Cluster::from_value(&bad).expect_err("quantity");
    assert_eq!(e.object, "Cluster south-1");
    assert_eq!(e.field, "spec.resourceModels[0].ranges[0].min");
    let missing = cluster(
        "south-1",
        "south",
        4,
        json!({"resourceModels": [{"grade": 1, "ranges": [{"name": "cpu", "max": "2"}]}]}),
        json!({}),
    );
    let e = Cluster::from_value(&missing).expect_err("min");
    assert_eq!(e.field, "spec.resourceModels[0].ranges[0].min");
}
