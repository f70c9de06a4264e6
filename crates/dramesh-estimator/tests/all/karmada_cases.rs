//! Cases ported from Karmada's own tests (reimplemented; numbers are Karmada's):
//! - estimator server `MaxAvailableReplicas` (pkg/estimator/server/server_test.go),
//! - Webster apportionment (pkg/util/helper/webstermethod_test.go),
//! - dynamic weight and aggregated division (pkg/scheduler/core/division_algorithm_test.go),
//! - spread selection by cluster and region (pkg/scheduler/core/spreadconstraint),
//! - static weights with the last assignment breaking ties (pkg/scheduler/core/division_algorithm.go).

use crate::common;

use std::collections::BTreeMap;

use common::*;
use dramesh_estimator::{EstimateOptions, estimate};
use dramesh_estimator::{
    Previous, SpreadCandidate, SpreadConstraint, SpreadDemand, Strategy, TargetCluster, assign,
    assign_keeping, divide_static_weights, select_spread, webster,
};
use dramesh_model::ClusterInfo;
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

fn spread(field: &str, min: usize, max: usize) -> SpreadConstraint {
    SpreadConstraint {
        spread_by_field: Some(field.into()),
        spread_by_label: None,
        max_groups: max,
        min_groups: min,
    }
}

/// `(name, region, score, available)`.
type Cand<'a> = (&'a str, &'a str, i64, i64);

fn select(
    clusters: &[Cand<'_>],
    constraints: &[SpreadConstraint],
    replicas: i64,
    duplicated: bool,
) -> Result<Vec<String>, String> {
    let infos: Vec<ClusterInfo> = clusters
        .iter()
        .map(|(_, region, _, _)| ClusterInfo {
            region: (!region.is_empty()).then(|| region.to_string()),
            ..ClusterInfo::default()
        })
        .collect();
    let candidates: Vec<SpreadCandidate<'_>> = clusters
        .iter()
        .zip(&infos)
        .map(|((name, _, score, available), info)| SpreadCandidate {
            name,
            info,
            score: *score,
            available: *available,
        })
        .collect();
    let demand = SpreadDemand {
        replicas,
        duplicated,
        need: (!duplicated).then_some(replicas),
    };
    select_spread(&candidates, constraints, demand)
        .map(|v| v.into_iter().map(str::to_string).collect())
}

#[test]
fn spread_by_cluster_selection_is_karmadas() {
    // Karmada's TestSelectBestClusters fleet (score, available replicas).
    let fleet: [Cand<'_>; 4] = [
        ("member1", "", 20, 40),
        ("member2", "", 40, 60),
        ("member3", "", 30, 80),
        ("member4", "", 60, 50),
    ];
    let c = [spread("cluster", 1, 2)];
    // The two best by score hold 110 >= 100.
    assert_eq!(
        select(&fleet, &c, 100, false).unwrap(),
        ["member4", "member2"]
    );
    // Duplicated ignores capacity.
    assert_eq!(
        select(&fleet, &c, 120, true).unwrap(),
        ["member4", "member2"]
    );
    // 110 < 120: member2 (the last chosen) is swapped for member3, the rest's biggest.
    assert_eq!(
        select(&fleet, &c, 120, false).unwrap(),
        ["member4", "member3"]
    );
    assert_eq!(
        select(&fleet, &c, 200, false),
        Err("no enough resource when selecting 2 clusters".into())
    );
    assert_eq!(
        select(&fleet, &[spread("cluster", 7, 7)], 30, false),
        Err("the number of feasible clusters is less than spreadConstraint.MinGroups".into())
    );
    // maxGroups is taken as written: 0 selects nothing.
    assert_eq!(
        select(&fleet, &[spread("cluster", 1, 0)], 1, true).unwrap(),
        Vec::<String>::new()
    );
    // zone and provider constraints group clusters in Karmada but do not restrict its
    // selection: with a cluster constraint they select as the cluster constraint alone.
    let zoned = [
        spread("zone", 2, 2),
        spread("provider", 1, 1),
        spread("cluster", 1, 2),
    ];
    assert_eq!(
        select(&fleet, &zoned, 120, false).unwrap(),
        ["member4", "member3"]
    );
}

#[test]
fn spread_by_region_scores_regions_by_the_replicas_they_hold() {
    // 3 regions x 2 clusters. east is where the binding runs (locality 100) but holds only 5
    // replicas; west holds 12, north 9.
    let fleet: [Cand<'_>; 6] = [
        ("e1", "east", 100, 3),
        ("e2", "east", 100, 2),
        ("w1", "west", 0, 8),
        ("w2", "west", 0, 4),
        ("n1", "north", 0, 6),
        ("n2", "north", 0, 3),
    ];
    // One region, two clusters, 10 replicas: a region's share is all 10; west holds them
    // (score 10000) where north (9000) and east (5000 + 100) do not.
    let one = [spread("region", 1, 1), spread("cluster", 2, 2)];
    assert_eq!(select(&fleet, &one, 10, false).unwrap(), ["w1", "w2"]);
    // Two regions: a region's share is 5, which every region but north holds with its two
    // best clusters (east 5000 + 100, west and north 5000); east and north (searched before
    // west by name) win, the best cluster of each first, then the rest by score.
    let two = [spread("region", 2, 2), spread("cluster", 2, 4)];
    assert_eq!(
        select(&fleet, &two, 10, false).unwrap(),
        ["e1", "n1", "e2", "n2"]
    );
    // The cluster constraint's maxGroups caps the rest: one cluster per region only.
    let capped = [spread("region", 2, 2), spread("cluster", 2, 2)];
    assert_eq!(select(&fleet, &capped, 10, false).unwrap(), ["e1", "n1"]);
    // Capacity is not checked when selecting by region (assignment fails later).
    assert_eq!(select(&fleet, &one, 100, false).unwrap().len(), 2);
    // Duplicated: regions score by the clusters that can each run every replica: for 4
    // replicas west (w1, w2) and north (n1) beat east (none).
    assert_eq!(select(&fleet, &one, 4, true).unwrap(), ["w1", "w2"]);
    // Clusters without a region belong to none.
    let mut loose = fleet.to_vec();
    loose.push(("x", "", 1000, 1000));
    assert_eq!(select(&loose, &one, 10, false).unwrap(), ["w1", "w2"]);
    assert_eq!(
        select(
            &fleet,
            &[spread("region", 4, 4), spread("cluster", 1, 8)],
            10,
            false
        ),
        Err("the number of feasible region is less than spreadConstraint.MinGroups".into())
    );
    assert_eq!(
        select(
            &fleet,
            &[spread("region", 1, 1), spread("cluster", 3, 3)],
            10,
            false
        ),
        Err("the number of clusters is less than the cluster spreadConstraint.MinGroups".into())
    );
}

#[test]
fn hostile_spread_constraints_are_named_errors() {
    let fleet: [Cand<'_>; 2] = [("a", "r1", 0, 5), ("b", "r2", 0, 5)];
    let err = |c: &[SpreadConstraint]| select(&fleet, c, 2, false).unwrap_err();
    assert_eq!(
        err(&[spread("cluster", 1, 2), spread("cluster", 1, 1)]),
        "spec.placement.spreadConstraints[1]: multiple cluster spread constraints are not allowed"
    );
    assert_eq!(
        err(&[spread("region", 1, 2)]),
        "spec.placement.spreadConstraints: the cluster spread constraint must be enabled in \
         one of the constraints in case of SpreadByField is enabled"
    );
    assert_eq!(
        err(&[spread("planet", 1, 2), spread("cluster", 1, 2)]),
        "spec.placement.spreadConstraints[0].spreadByField: unsupported value \"planet\" \
         (cluster, region, zone or provider)"
    );
    assert_eq!(
        err(&[spread("cluster", 3, 2)]),
        "spec.placement.spreadConstraints[0]: maxGroups(2) lower than minGroups(3) is not allowed"
    );
    let label = SpreadConstraint {
        spread_by_field: None,
        spread_by_label: Some("topology".into()),
        max_groups: 1,
        min_groups: 1,
    };
    assert_eq!(
        err(std::slice::from_ref(&label)),
        "just support cluster and region spread constraint"
    );
    // An absurd minGroups is an ordinary failure, not a panic or a hang.
    assert_eq!(
        err(&[spread("cluster", usize::MAX, usize::MAX)]),
        "the number of feasible clusters is less than spreadConstraint.MinGroups"
    );
    assert_eq!(
        err(&[
            spread("region", 1, usize::MAX),
            spread("cluster", usize::MAX, usize::MAX)
        ]),
        "the number of clusters is less than the cluster spreadConstraint.MinGroups"
    );
    // minGroups 0 reads as Karmada's default 1; an empty field as `cluster`.
    assert_eq!(
        select(&fleet, &[spread("", 0, 1)], 2, false).unwrap(),
        ["a"]
    );
}

#[test]
fn static_weight_ties_keep_the_last_assignment() {
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
    let sel = |names: &[&str]| -> Vec<(String, i64)> {
        names.iter().map(|n| (n.to_string(), 0)).collect()
    };
    let run = |rules: &[(ClusterAffinity, i64)],
               replicas: i64,
               names: &[&str],
               last: &[(&str, i64)],
               ascending: bool| {
        let last: Vec<TargetCluster> = last
            .iter()
            .map(|(n, r)| TargetCluster {
                name: n.to_string(),
                replicas: *r,
            })
            .collect();
        divide_static_weights(
            rules,
            replicas,
            &sel(names),
            &BTreeMap::new(),
            &last,
            ascending,
        )
        .into_iter()
        .map(|t| (t.name, t.replicas))
        .collect::<BTreeMap<String, i64>>()
    };
    let even = [rule(&["m1", "m2"], 1)];
    // No last assignment: the remainder follows the workload's name order.
    assert_eq!(
        run(&even, 3, &["m1", "m2"], &[], true),
        m(&[("m1", 2), ("m2", 1)])
    );
    assert_eq!(
        run(&even, 3, &["m1", "m2"], &[], false),
        m(&[("m1", 1), ("m2", 2)])
    );
    // With one: the remainder stays where it was, whatever the name order.
    for asc in [true, false] {
        assert_eq!(
            run(&even, 3, &["m1", "m2"], &[("m1", 1), ("m2", 2)], asc),
            m(&[("m1", 1), ("m2", 2)])
        );
        assert_eq!(
            run(&even, 3, &["m1", "m2"], &[("m1", 2), ("m2", 1)], asc),
            m(&[("m1", 2), ("m2", 1)])
        );
    }
    // Karmada's proposal, story 1: 2:1:1:1, 7 replicas. Webster gives 3:1:1:1 and the 7th
    // goes to a weight-1 cluster: to member2, which had it before, whatever the name order.
    // Scaled to 8 (Webster: 3:2:2:1), member2 keeps its second replica and the name order
    // picks between member3 and member4, which had one each.
    let story = [
        rule(&["member1"], 2),
        rule(&["member2", "member3", "member4"], 1),
    ];
    let four = ["member1", "member2", "member3", "member4"];
    let last = [
        ("member1", 3),
        ("member2", 2),
        ("member3", 1),
        ("member4", 1),
    ];
    for asc in [true, false] {
        assert_eq!(
            run(&story, 7, &four, &last, asc),
            m(&[
                ("member1", 3),
                ("member2", 2),
                ("member3", 1),
                ("member4", 1)
            ])
        );
    }
    assert_eq!(
        run(&story, 8, &four, &last, true),
        m(&[
            ("member1", 3),
            ("member2", 2),
            ("member3", 2),
            ("member4", 1)
        ])
    );
    assert_eq!(
        run(&story, 8, &four, &last, false),
        m(&[
            ("member1", 3),
            ("member2", 2),
            ("member3", 1),
            ("member4", 2)
        ])
    );
    // Without the last assignment the 7th follows the name order instead.
    assert_eq!(
        run(&story, 7, &four, &[], false),
        m(&[
            ("member1", 3),
            ("member2", 1),
            ("member3", 1),
            ("member4", 2)
        ])
    );
    // Story 5: 5 over four equal clusters as 2:1:1:1, member4 leaves: its replica goes to
    // one of the others, the two extra staying with member1 and one more.
    let eq = [rule(&["member1", "member2", "member3", "member4"], 1)];
    let got = run(
        &eq,
        5,
        &["member1", "member2", "member3"],
        &[
            ("member1", 2),
            ("member2", 1),
            ("member3", 1),
            ("member4", 1),
        ],
        true,
    );
    assert_eq!(got.get("member1"), Some(&2));
    assert_eq!(got.values().sum::<i64>(), 5);
    // No rules at all: every cluster weighs 1 and the last assignment still breaks ties.
    assert_eq!(
        run(&[], 3, &["m1", "m2"], &[("m2", 2), ("m1", 1)], true),
        m(&[("m1", 1), ("m2", 2)])
    );
    // Rules that match no selected cluster: everyone weighs 1, without the last
    // assignment (Karmada's fallback list carries none): the name order decides.
    assert_eq!(
        run(&[rule(&["other"], 5)], 3, &["m1", "m2"], &[("m2", 2)], true),
        m(&[("m1", 2), ("m2", 1)])
    );
    // assign_keeping passes the binding's spec.clusters as the last assignment.
    assert_eq!(
        keep(
            Strategy::StaticWeight(even.to_vec()),
            3,
            &[("m1", 0), ("m2", 0)],
            &[("m2", 2), ("m1", 1)],
            false
        )
        .unwrap(),
        m(&[("m1", 1), ("m2", 2)])
    );
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
