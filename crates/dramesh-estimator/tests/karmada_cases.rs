//! Cases ported from Karmada's own tests (reimplemented; numbers are Karmada's):
//! - estimator server `MaxAvailableReplicas` (pkg/estimator/server/server_test.go),
//! - Webster apportionment (pkg/util/helper/webstermethod_test.go),
//! - dynamic weight and aggregated division (pkg/scheduler/core/division_algorithm_test.go),
//! - cluster spread selection (pkg/scheduler/core/spreadconstraint).

mod common;

use std::collections::BTreeMap;

use common::*;
use dramesh_estimator::{EstimateOptions, estimate};
use dramesh_estimator::{
    Previous, SpreadConstraint, Strategy, TargetCluster, assign, assign_keeping, select_by_cluster,
    webster,
};
use dramesh_model::ClusterObject;
use serde_json::json;

/// Karmada's estimator fixture: three 8-cpu/16Gi nodes and five pods.
/// node 1 left: 2 cpu, 6 mem; node 2 left: 3 cpu, 5 mem; node 3 left: 8 cpu, 16 mem.
fn karmada_fleet(pods: [i64; 3], extras: [serde_json::Value; 3]) -> Vec<ClusterObject> {
    let [e1, e2, e3] = extras;
    vec![
        node("machine1", "8", "16Gi", pods[0], e1),
        node("machine2", "8", "16Gi", pods[1], e2),
        node("machine3", "8", "16Gi", pods[2], e3),
        pod("default", "pod1", "machine1", "1", "3Gi", json!({})),
        pod("default", "pod2", "machine1", "3", "3Gi", json!({})),
        pod("default", "pod3", "machine1", "2", "4Gi", json!({})),
        pod("default", "pod4", "machine2", "4", "8Gi", json!({})),
        pod("default", "pod5", "machine2", "1", "3Gi", json!({})),
    ]
}

fn max_replicas(objs: Vec<ClusterObject>, extra_spec: serde_json::Value) -> i64 {
    let view = view_of("fake", objs);
    let w = workload("1", "2Gi", 1, extra_spec);
    estimate(&view, &w, &EstimateOptions::default()).total
}

#[test]
fn estimator_normal() {
    let objs = karmada_fleet([11, 11, 11], [json!({}), json!({}), json!({})]);
    assert_eq!(max_replicas(objs, json!({})), 12);
}

#[test]
fn estimator_pod_slots_strict() {
    let objs = karmada_fleet([4, 3, 11], [json!({}), json!({}), json!({})]);
    assert_eq!(max_replicas(objs, json!({})), 10);
}

#[test]
fn estimator_node_selector() {
    let objs = karmada_fleet(
        [11, 11, 11],
        [
            json!({"metadata": {"labels": {"a": "1"}}}),
            json!({"metadata": {"labels": {"a": "3", "b": "2"}}}),
            json!({}),
        ],
    );
    assert_eq!(max_replicas(objs, json!({"nodeSelector": {"a": "3"}})), 2);
}

#[test]
fn estimator_node_affinity_gt() {
    let objs = karmada_fleet(
        [11, 11, 11],
        [
            json!({"metadata": {"labels": {"a": "1"}}}),
            json!({"metadata": {"labels": {"a": "3", "b": "2"}}}),
            json!({}),
        ],
    );
    let aff = json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["0"]}]}]}}}});
    assert_eq!(max_replicas(objs, aff), 4);
}

#[test]
fn estimator_tolerations() {
    let objs = karmada_fleet(
        [11, 11, 11],
        [
            json!({"spec": {"taints": [{"key": "key1", "value": "value1", "effect": "NoSchedule"}]}}),
            json!({"spec": {"taints": [{"key": "key2", "value": "value2", "effect": "NoSchedule"}]}}),
            json!({}),
        ],
    );
    let tol = json!({"tolerations": [{"key": "key1", "operator": "Equal", "value": "value1"}]});
    let view = view_of("fake", objs);
    let w = workload("1", "2Gi", 1, tol);
    let est = estimate(&view, &w, &EstimateOptions::default());
    assert_eq!(est.total, 10);
    // The explanation counts the node excluded by the untolerated taint.
    assert_eq!(est.clusters[0].excluded_nodes.get("taints"), Some(&1));
}

fn seats(n: i64, votes: &[(&str, i64)], initial: &[(&str, i64)]) -> BTreeMap<String, i64> {
    let mut parties: Vec<(String, i64, i64)> = votes
        .iter()
        .map(|(n, v)| {
            (
                n.to_string(),
                *v,
                initial
                    .iter()
                    .find(|(m, _)| m == n)
                    .map(|x| x.1)
                    .unwrap_or(0),
            )
        })
        .collect();
    for (name, s) in initial {
        if !votes.iter().any(|(n, _)| n == name) {
            parties.push((name.to_string(), 0, *s));
        }
    }
    webster(n, &parties, true).into_iter().collect()
}

fn m(v: &[(&str, i64)]) -> BTreeMap<String, i64> {
    v.iter().map(|(k, s)| (k.to_string(), *s)).collect()
}

#[test]
fn webster_classic_rounds() {
    // Sainte-Laguë worked example: 100k / 80k / 30k / 20k votes, seats after each round.
    let votes = [
        ("PartyA", 100000),
        ("PartyB", 80000),
        ("PartyC", 30000),
        ("PartyD", 20000),
    ];
    let expected = [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [2, 1, 0, 0],
        [2, 1, 1, 0],
        [2, 2, 1, 0],
        // Seat 6 is a tie (A 100000/5 = D 20000/1): the party with fewer seats wins.
        [2, 2, 1, 1],
        [3, 2, 1, 1],
        [3, 3, 1, 1],
    ];
    for (round, want) in expected.iter().enumerate() {
        let got = seats(round as i64 + 1, &votes, &[]);
        let want = m(&[
            ("PartyA", want[0]),
            ("PartyB", want[1]),
            ("PartyC", want[2]),
            ("PartyD", want[3]),
        ]);
        assert_eq!(got, want, "round {}", round + 1);
    }
}

#[test]
fn webster_example_alpha_beta_gamma() {
    let got = seats(4, &[("Alpha", 1200), ("Beta", 900), ("Gamma", 400)], &[]);
    assert_eq!(got, m(&[("Alpha", 2), ("Beta", 1), ("Gamma", 1)]));
}

#[test]
fn webster_ties() {
    // More votes wins.
    assert_eq!(
        seats(1, &[("PartyA", 1), ("PartyB", 2)], &[]),
        m(&[("PartyA", 0), ("PartyB", 1)])
    );
    // Equal priority (3/3 = 1/1): fewer seats wins.
    assert_eq!(
        seats(
            1,
            &[("PartyA", 3), ("PartyB", 1)],
            &[("PartyA", 1), ("PartyB", 0)]
        ),
        m(&[("PartyA", 1), ("PartyB", 1)])
    );
    // Equal everything: the name order decides (ascending here).
    assert_eq!(
        seats(1, &[("PartyA", 1), ("PartyB", 1)], &[]),
        m(&[("PartyA", 1), ("PartyB", 0)])
    );
    // Descending name order flips it.
    let desc: BTreeMap<String, i64> = webster(
        1,
        &[("PartyA".into(), 1, 0), ("PartyB".into(), 1, 0)],
        false,
    )
    .into_iter()
    .collect();
    assert_eq!(desc, m(&[("PartyA", 0), ("PartyB", 1)]));
}

#[test]
fn webster_non_initial_allocations() {
    assert_eq!(
        seats(2, &[("NewParty1", 1), ("NewParty2", 1)], &[("OldParty", 0)]),
        m(&[("NewParty1", 1), ("NewParty2", 1), ("OldParty", 0)])
    );
    assert_eq!(
        seats(2, &[("OldParty", 1), ("NewParty", 1)], &[("OldParty", 1)]),
        m(&[("NewParty", 2), ("OldParty", 1)])
    );
    assert_eq!(
        seats(2, &[("PartyA", 100)], &[("PartyB", 3)]),
        m(&[("PartyA", 2), ("PartyB", 3)])
    );
    assert_eq!(
        seats(0, &[("PartyA", 100), ("PartyB", 200)], &[]),
        m(&[("PartyA", 0), ("PartyB", 0)])
    );
    assert!(webster(1, &[], true).is_empty());
}

fn divide(
    strategy: Strategy,
    replicas: i64,
    avail: &[(&str, i64)],
) -> Result<BTreeMap<String, i64>, String> {
    let sel: Vec<(String, i64)> = avail.iter().map(|(n, a)| (n.to_string(), *a)).collect();
    assign(&strategy, replicas, &sel, &BTreeMap::new(), true)
        .map(|v| v.into_iter().map(|t| (t.name, t.replicas)).collect())
}

#[test]
fn dynamic_weight_divisions() {
    let dw = || Strategy::DynamicWeight;
    assert_eq!(
        divide(
            dw(),
            12,
            &[("member1", 18), ("member2", 12), ("member3", 6)]
        )
        .unwrap(),
        m(&[("member1", 6), ("member2", 4), ("member3", 2)])
    );
    assert_eq!(
        divide(dw(), 12, &[("member1", 6), ("member2", 12), ("member3", 6)]).unwrap(),
        m(&[("member1", 3), ("member2", 6), ("member3", 3)])
    );
    assert_eq!(
        divide(dw(), 12, &[("member1", 6), ("member2", 8), ("member3", 10)]).unwrap(),
        m(&[("member1", 3), ("member2", 4), ("member3", 5)])
    );
    // The PropagationPolicy API doc example: 6:12:18 available, 12 replicas -> 2:4:6.
    assert_eq!(
        divide(dw(), 12, &[("A", 6), ("B", 12), ("C", 18)]).unwrap(),
        m(&[("A", 2), ("B", 4), ("C", 6)])
    );
    // 3:3:3 cannot hold 12.
    assert!(divide(dw(), 12, &[("member1", 3), ("member2", 3), ("member3", 3)]).is_err());
}

#[test]
fn aggregated_divisions() {
    let ag = || Strategy::Aggregated;
    assert_eq!(
        divide(ag(), 12, &[("member2", 12), ("member1", 6), ("member3", 6)]).unwrap(),
        m(&[("member2", 12)])
    );
    assert_eq!(
        divide(ag(), 12, &[("member1", 6), ("member2", 6), ("member3", 6)]).unwrap(),
        m(&[("member1", 6), ("member2", 6)])
    );
    assert_eq!(
        divide(ag(), 12, &[("member1", 6), ("member2", 8), ("member3", 10)]).unwrap(),
        m(&[("member2", 5), ("member3", 7)])
    );
    assert_eq!(
        divide(
            ag(),
            12,
            &[("member1", 12), ("member2", 8), ("member3", 10)]
        )
        .unwrap(),
        m(&[("member1", 12)])
    );
    assert!(divide(ag(), 12, &[("member1", 3), ("member2", 3), ("member3", 3)]).is_err());
}

#[test]
fn static_weight_divisions() {
    use dramesh_estimator::ClusterAffinity;
    let rule = |names: &[&str], w: i64| {
        (
            ClusterAffinity {
                cluster_names: names.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            },
            w,
        )
    };
    // 1:2 weights, 12 replicas -> 4:8 regardless of capacity.
    let s = Strategy::StaticWeight(vec![rule(&["member1"], 1), rule(&["member2"], 2)]);
    assert_eq!(
        divide(s, 12, &[("member1", 0), ("member2", 0)]).unwrap(),
        m(&[("member1", 4), ("member2", 8)])
    );
    // A cluster no rule matches gets nothing.
    let s = Strategy::StaticWeight(vec![rule(&["member1"], 1), rule(&["member2"], 1)]);
    assert_eq!(
        divide(s, 6, &[("member1", 0), ("member2", 0), ("member3", 0)]).unwrap(),
        m(&[("member1", 3), ("member2", 3)])
    );
    // No matching rule at all: everyone weighs 1.
    let s = Strategy::StaticWeight(vec![rule(&["other"], 5)]);
    assert_eq!(
        divide(s, 3, &[("member1", 0), ("member2", 0), ("member3", 0)]).unwrap(),
        m(&[("member1", 1), ("member2", 1), ("member3", 1)])
    );
}

#[test]
fn spread_by_cluster_selection() {
    let c = |min, max| SpreadConstraint {
        spread_by_field: Some("cluster".into()),
        spread_by_label: None,
        max_groups: max,
        min_groups: min,
    };
    let ranked: Vec<(String, i64)> = [("m1", 10), ("m2", 8), ("m3", 5), ("m4", 3)]
        .iter()
        .map(|(n, a)| (n.to_string(), *a))
        .collect();
    // Top maxGroups clusters when they hold enough.
    let got = select_by_cluster(&ranked, &c(1, 2), Some(15)).unwrap();
    assert_eq!(
        got.iter().map(|x| x.0.as_str()).collect::<Vec<_>>(),
        ["m1", "m2"]
    );
    // Not enough in any two clusters.
    assert!(select_by_cluster(&ranked, &c(1, 2), Some(19)).is_err());
    // Fewer feasible clusters than minGroups.
    assert!(select_by_cluster(&ranked, &c(5, 5), None).is_err());
    // Duplicated ignores capacity.
    assert_eq!(select_by_cluster(&ranked, &c(1, 1), None).unwrap().len(), 1);
    // Swap: ranking by score can put a small cluster first; a bigger one replaces it.
    let by_score: Vec<(String, i64)> = [("m4", 3), ("m1", 10), ("m2", 8)]
        .iter()
        .map(|(n, a)| (n.to_string(), *a))
        .collect();
    let got = select_by_cluster(&by_score, &c(1, 2), Some(15)).unwrap();
    let names: Vec<&str> = got.iter().map(|x| x.0.as_str()).collect();
    assert_eq!(names.len(), 2);
    assert!(names.contains(&"m1") && names.contains(&"m2"), "{names:?}");
}

/// [`assign_keeping`] over `avail` with the binding's previous `spec.clusters`.
fn keep(
    strategy: Strategy,
    replicas: i64,
    avail: &[(&str, i64)],
    previous: &[(&str, i64)],
    fresh: bool,
) -> Result<BTreeMap<String, i64>, String> {
    let sel: Vec<(String, i64)> = avail.iter().map(|(n, a)| (n.to_string(), *a)).collect();
    let prev: Vec<TargetCluster> = previous
        .iter()
        .map(|(n, r)| TargetCluster {
            name: n.to_string(),
            replicas: *r,
        })
        .collect();
    let previous = Previous {
        clusters: &prev,
        fresh,
    };
    assign_keeping(&strategy, replicas, &sel, &BTreeMap::new(), true, previous)
        .map(|v| v.into_iter().map(|t| (t.name, t.replicas)).collect())
}

#[test]
fn dynamic_strategies_keep_previous_assignments_as_karmada_does() {
    let dw = || Strategy::DynamicWeight;
    let avail = [("m1", 8), ("m2", 4), ("m3", 0)];
    // Same replica count: nothing moves, whatever is available now.
    assert_eq!(
        keep(dw(), 6, &avail, &[("m1", 1), ("m3", 5)], false).unwrap(),
        m(&[("m1", 1), ("m3", 5)])
    );
    // Scale up: the 6 new replicas are divided 8:4 and added to what each cluster has.
    assert_eq!(
        keep(dw(), 10, &avail, &[("m1", 2), ("m2", 2)], false).unwrap(),
        m(&[("m1", 6), ("m2", 4)])
    );
    // Scale down: the new count is divided over the clusters in use, by what each has
    // (6:3:3 for 4 replicas; equal priorities go to the cluster with fewer, then by name).
    assert_eq!(
        keep(
            dw(),
            4,
            &[("m1", 0), ("m2", 0), ("m3", 0), ("m4", 100)],
            &[("m1", 6), ("m2", 3), ("m3", 3)],
            false
        )
        .unwrap(),
        m(&[("m1", 2), ("m2", 1), ("m3", 1)])
    );
    // A cluster no longer selected loses its replicas; they are placed again as a scale-up.
    assert_eq!(
        keep(
            dw(),
            6,
            &[("m1", 10), ("m2", 10)],
            &[("m1", 3), ("gone", 3)],
            false
        )
        .unwrap(),
        m(&[("m1", 5), ("m2", 1)])
    );
    // Scaling up needs room for the new replicas only, and fails without it.
    let err = keep(
        dw(),
        9,
        &[("m1", 1), ("m2", 1)],
        &[("m1", 3), ("m2", 3)],
        false,
    )
    .unwrap_err();
    assert!(
        err.contains("Clusters available replicas 2 are not enough to schedule."),
        "{err}"
    );
    // A requested reschedule divides everything again, counting what each cluster holds as
    // available there: 6 over 4:2:6.
    assert_eq!(
        keep(
            dw(),
            6,
            &[("m1", 0), ("m2", 0), ("m3", 6)],
            &[("m1", 4), ("m2", 2)],
            true
        )
        .unwrap(),
        m(&[("m1", 2), ("m2", 1), ("m3", 3)])
    );
    // Without a previous assignment it is the from-scratch division.
    assert_eq!(
        keep(dw(), 12, &[("m1", 18), ("m2", 12), ("m3", 6)], &[], false).unwrap(),
        divide(dw(), 12, &[("m1", 18), ("m2", 12), ("m3", 6)]).unwrap()
    );
}

#[test]
fn aggregated_scale_up_fills_the_clusters_already_in_use_first() {
    let avail = [("m1", 10), ("m2", 4)];
    assert_eq!(
        keep(Strategy::Aggregated, 5, &avail, &[("m2", 2)], false).unwrap(),
        m(&[("m2", 5)])
    );
    // From scratch the cluster with the most room takes everything.
    assert_eq!(
        divide(Strategy::Aggregated, 5, &avail).unwrap(),
        m(&[("m1", 5)])
    );
    // When the cluster in use cannot take all 7 new replicas, the next one by room joins,
    // and the 7 are divided by room (10:4 gives 5:2).
    assert_eq!(
        keep(Strategy::Aggregated, 9, &avail, &[("m2", 2)], false).unwrap(),
        m(&[("m1", 5), ("m2", 4)])
    );
}
