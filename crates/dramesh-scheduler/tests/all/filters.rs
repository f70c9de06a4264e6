//! Differential test of Karmada's default filter and score plugins: generated Clusters
//! (API lists, taints, readiness, provider/region/zones, labels, deletion) and bindings
//! (strategies, affinities, tolerations, spread constraints, previous results, graceful
//! eviction tasks, a built-in kind or a CRD) are decided by [`decide`], and the result is
//! compared with an oracle written here from karmada-scheduler's rules, independently of
//! the code under test:
//!
//! - `findClustersThatFit` skips clusters being deleted and runs the filter plugins in the
//!   registry's order, the first refusal being the cluster's reason: APIEnablement (a
//!   cluster not in `spec.clusters` lists the resource's group/version and kind; the
//!   `CompleteAPIEnablements` condition is not read since PR 6462), TaintToleration (a
//!   cluster not in `spec.clusters` has no untolerated NoSchedule/NoExecute taint; a cluster
//!   that is not ready carries the not-ready/unreachable taints), ClusterAffinity (names, exclusions, labels), SpreadConstraint (provider, region,
//!   zones present when spread by them), ClusterEviction (not in the graceful eviction
//!   tasks). dramesh's one documented difference: a cluster in use is still held to its
//!   NoExecute taints (dramesh evicts by rescheduling where Karmada's taint manager would).
//! - No cluster left: `NoClusterFit`, `0/N clusters are available: ...` with the sorted
//!   histogram of reasons, and the empty result written.
//! - Otherwise only clusters that passed get replicas; Duplicated without spread
//!   constraints goes to every one of them with all the replicas; Divided places exactly
//!   the replicas when capacity is ample; ClusterLocality keeps the clusters in use on a
//!   scale up (Dynamic and Aggregated divisions).

use std::collections::{BTreeMap, BTreeSet};

use dramesh_estimator::{EstimateOptions, Estimator, View};
use dramesh_scheduler::{Binding, BindingKind, Cluster, Fleet, Reason, decide, demand};
use serde_json::{Value, json};

/// splitmix64: a small deterministic generator (no dependency, same cases on every run).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
}

/// The resource kinds bindings propagate: a built-in workload and a CRD.
const KINDS: [(&str, &str); 2] = [("apps/v1", "Deployment"), ("ray.io/v1", "RayJob")];

#[derive(Debug, Clone)]
struct Taint {
    key: String,
    value: String,
    effect: String,
}

#[derive(Debug, Clone)]
struct GenCluster {
    name: String,
    tier: &'static str,
    provider: Option<&'static str>,
    region: Option<&'static str>,
    zones: Vec<&'static str>,
    taints: Vec<Taint>,
    /// `Ready` condition status, if any.
    ready: Option<&'static str>,
    /// `CompleteAPIEnablements` condition status, if any (Karmada's scheduler does not read it).
    complete_apis: Option<&'static str>,
    /// group/version -> kinds; `None`: no `apiEnablements` at all.
    apis: Option<BTreeMap<&'static str, Vec<&'static str>>>,
    deleting: bool,
}

fn gen_cluster(r: &mut Rng, i: usize) -> GenCluster {
    let mut taints = Vec::new();
    if r.chance(25) {
        taints.push(Taint {
            key: "dedicated".into(),
            value: (r.pick(&["ml", "web"])).into(),
            effect: (r.pick(&["NoSchedule", "NoExecute", "PreferNoSchedule"])).into(),
        });
    }
    if r.chance(10) {
        taints.push(Taint {
            key: "maintenance".into(),
            value: String::new(),
            effect: "NoExecute".into(),
        });
    }
    let apis = match r.below(6) {
        0 => None,
        1 => Some(BTreeMap::new()),
        // The kinds under another version: not the resource's API.
        2 => Some(BTreeMap::from([
            ("apps/v1beta2", vec!["Deployment"]),
            ("ray.io/v1alpha1", vec!["RayJob"]),
        ])),
        3 => Some(BTreeMap::from([(
            "apps/v1",
            vec!["Deployment", "StatefulSet"],
        )])),
        4 => Some(BTreeMap::from([(
            "ray.io/v1",
            vec!["RayJob", "RayCluster"],
        )])),
        _ => Some(BTreeMap::from([
            ("apps/v1", vec!["Deployment"]),
            ("ray.io/v1", vec!["RayCluster", "RayJob"]),
            ("v1", vec!["Pod"]),
        ])),
    };
    GenCluster {
        name: format!("m{i}"),
        tier: r.pick(&["gpu", "cpu"]),
        provider: r.chance(75).then(|| r.pick(&["aws", "gcp"])),
        region: r.chance(75).then(|| r.pick(&["east", "west", "north"])),
        zones: if r.chance(70) { vec!["z1"] } else { Vec::new() },
        taints,
        ready: r.pick(&[
            Some("True"),
            Some("True"),
            Some("True"),
            Some("False"),
            Some("Unknown"),
            None,
        ]),
        complete_apis: r.pick(&[Some("True"), Some("False"), None]),
        apis,
        deleting: r.chance(8),
    }
}

fn cluster_json(c: &GenCluster) -> Value {
    let mut spec = json!({"syncMode": "Push", "taints": c.taints.iter().map(|t| {
        let mut v = json!({"key": t.key, "effect": t.effect});
        if !t.value.is_empty() { v["value"] = json!(t.value); }
        v
    }).collect::<Vec<_>>()});
    if let Some(p) = c.provider {
        spec["provider"] = json!(p);
    }
    if let Some(reg) = c.region {
        spec["region"] = json!(reg);
    }
    if !c.zones.is_empty() {
        spec["zones"] = json!(c.zones);
    }
    let mut conditions = Vec::new();
    for (t, s) in [
        ("Ready", c.ready),
        ("CompleteAPIEnablements", c.complete_apis),
    ] {
        if let Some(s) = s {
            conditions.push(json!({"type": t, "status": s, "reason": "", "message": "",
                                   "lastTransitionTime": "2026-11-25T09:00:00Z"}));
        }
    }
    let mut status = json!({
        "conditions": conditions,
        "resourceSummary": {"allocatable": {"cpu": "1000", "memory": "4000Gi", "pods": "10000"}}
    });
    if let Some(apis) = &c.apis {
        status["apiEnablements"] = apis
            .iter()
            .map(|(gv, kinds)| {
                json!({"groupVersion": gv, "resources": kinds.iter().map(|k| json!({"name": k.to_lowercase(), "kind": k})).collect::<Vec<_>>()})
            })
            .collect();
    }
    let mut meta = json!({"name": c.name, "labels": {"tier": c.tier}});
    if c.deleting {
        meta["deletionTimestamp"] = json!("2026-11-25T11:00:00Z");
    }
    json!({"apiVersion": "cluster.karmada.io/v1alpha1", "kind": "Cluster",
           "metadata": meta, "spec": spec, "status": status})
}

#[derive(Debug, Clone)]
enum Affinity {
    None,
    Names(Vec<String>),
    Exclude(Vec<String>),
    Tier(&'static str),
}

#[derive(Debug, Clone)]
struct Toleration {
    key: &'static str,
    /// `Some(v)`: operator Equal with value v; `None`: Exists.
    value: Option<&'static str>,
    /// Empty: every effect.
    effect: &'static str,
}

#[derive(Debug, Clone)]
struct GenBinding {
    api_version: &'static str,
    kind: &'static str,
    strategy: &'static str,
    replicas: i64,
    affinity: Affinity,
    tolerations: Vec<Toleration>,
    /// `spreadByField` values.
    spread: Vec<&'static str>,
    clusters: Vec<(String, i64)>,
    evicting: Vec<String>,
}

fn gen_binding(r: &mut Rng, fleet: &[GenCluster]) -> GenBinding {
    let (api_version, kind) = r.pick(&KINDS);
    let names: Vec<String> = fleet.iter().map(|c| c.name.clone()).collect();
    let some_names =
        |r: &mut Rng| -> Vec<String> { names.iter().filter(|_| r.chance(50)).cloned().collect() };
    let affinity = match r.below(5) {
        0 | 1 => Affinity::None,
        2 => Affinity::Names(some_names(r)),
        3 => Affinity::Exclude(some_names(r)),
        _ => Affinity::Tier(r.pick(&["gpu", "cpu"])),
    };
    let mut tolerations = Vec::new();
    for t in [
        Toleration {
            key: "dedicated",
            value: Some("ml"),
            effect: "",
        },
        Toleration {
            key: "dedicated",
            value: None,
            effect: "NoSchedule",
        },
        Toleration {
            key: "maintenance",
            value: None,
            effect: "NoExecute",
        },
        Toleration {
            key: "cluster.karmada.io/not-ready",
            value: None,
            effect: "",
        },
        Toleration {
            key: "cluster.karmada.io/unreachable",
            value: None,
            effect: "NoSchedule",
        },
    ] {
        if r.chance(20) {
            tolerations.push(t);
        }
    }
    // Karmada's validation wants a `cluster` constraint beside any other spread field.
    let spread = match r.below(6) {
        0 => vec!["cluster"],
        1 => vec!["region", "cluster"],
        2 => vec!["cluster", "provider"],
        3 => vec!["zone", "cluster"],
        _ => Vec::new(),
    };
    let strategy = r.pick(&["Duplicated", "Aggregated", "Dynamic", "Static"]);
    let replicas = 1 + r.below(12) as i64;
    let mut clusters = Vec::new();
    if r.chance(40) {
        for n in names.iter().filter(|_| r.chance(30)) {
            clusters.push((
                n.clone(),
                if strategy == "Duplicated" {
                    replicas
                } else {
                    1
                },
            ));
        }
    }
    let evicting = if r.chance(20) {
        vec![names[r.below(names.len() as u64) as usize].clone()]
    } else {
        Vec::new()
    };
    GenBinding {
        api_version,
        kind,
        strategy,
        replicas,
        affinity,
        tolerations,
        spread,
        clusters,
        evicting,
    }
}

fn binding_json(b: &GenBinding) -> Value {
    let replica_scheduling = match b.strategy {
        "Duplicated" => json!({"replicaSchedulingType": "Duplicated"}),
        "Aggregated" => {
            json!({"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Aggregated"})
        }
        "Dynamic" => {
            json!({"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Weighted",
                            "weightPreference": {"dynamicWeight": "AvailableReplicas"}})
        }
        _ => json!({"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Weighted"}),
    };
    let mut placement = json!({"replicaScheduling": replica_scheduling});
    match &b.affinity {
        Affinity::None => {}
        Affinity::Names(n) => placement["clusterAffinity"] = json!({"clusterNames": n}),
        Affinity::Exclude(n) => placement["clusterAffinity"] = json!({"exclude": n}),
        Affinity::Tier(t) => {
            placement["clusterAffinity"] = json!({"labelSelector": {"matchLabels": {"tier": t}}})
        }
    }
    if !b.tolerations.is_empty() {
        placement["clusterTolerations"] = b
            .tolerations
            .iter()
            .map(|t| {
                let mut v = json!({"key": t.key});
                match t.value {
                    Some(val) => {
                        v["operator"] = json!("Equal");
                        v["value"] = json!(val);
                    }
                    None => v["operator"] = json!("Exists"),
                }
                if !t.effect.is_empty() {
                    v["effect"] = json!(t.effect);
                }
                v
            })
            .collect();
    }
    if !b.spread.is_empty() {
        placement["spreadConstraints"] = b
            .spread
            .iter()
            .map(|f| json!({"spreadByField": f, "maxGroups": 100, "minGroups": 1}))
            .collect();
    }
    let clusters: Vec<Value> = b
        .clusters
        .iter()
        .map(|(n, r)| json!({"name": n, "replicas": r}))
        .collect();
    let evictions: Vec<Value> = b
        .evicting
        .iter()
        .map(
            |n| json!({"fromCluster": n, "reason": "TaintUntolerated", "producer": "TaintManager"}),
        )
        .collect();
    json!({
        "apiVersion": "work.karmada.io/v1alpha2", "kind": "ResourceBinding",
        "metadata": {"name": "w", "namespace": "default", "uid": "u", "generation": 2,
                     "labels": {"propagationpolicy.karmada.io/permanent-id": "p"}},
        "spec": {
            "resource": {"apiVersion": b.api_version, "kind": b.kind, "namespace": "default", "name": "w"},
            "replicas": b.replicas,
            "replicaRequirements": {"resourceRequest": {"cpu": "100m"}},
            "placement": placement,
            "clusters": clusters,
            "gracefulEvictionTasks": evictions,
            "schedulerName": "dramesh-scheduler"
        },
        "status": {"schedulerObservedGeneration": 1, "lastScheduledTime": "2026-11-25T10:00:00Z"}
    })
}

fn template(b: &GenBinding) -> Value {
    let pod = json!({"spec": {"containers": [{"name": "main", "image": "x",
                     "resources": {"requests": {"cpu": "100m"}}}]}});
    match b.kind {
        "Deployment" => json!({"apiVersion": b.api_version, "kind": b.kind,
                               "metadata": {"name": "w", "namespace": "default"},
                               "spec": {"replicas": b.replicas, "template": pod}}),
        _ => json!({"apiVersion": b.api_version, "kind": b.kind,
                    "metadata": {"name": "w", "namespace": "default"}, "spec": {}}),
    }
}

// ---- The oracle: Karmada's rules, written from its documentation and plugin sources. ----

/// corev1 `Toleration.ToleratesTaint` for the operators generated here.
fn tolerates(t: &Toleration, taint: &Taint) -> bool {
    (t.effect.is_empty() || t.effect == taint.effect)
        && t.key == taint.key
        && t.value.is_none_or(|v| v == taint.value)
}

/// The taints the scheduler sees: `spec.taints` plus, for a cluster that is not ready, the
/// not-ready (Ready=False) or unreachable (Ready=Unknown or absent) taints: NoSchedule, as
/// Karmada's cluster controller adds them, and NoExecute, as taint-based eviction sees the
/// cluster (dramesh adds both when `spec.taints` lacks them).
fn seen_taints(c: &GenCluster) -> Vec<Taint> {
    let mut out = c.taints.clone();
    let key = match c.ready {
        Some("True") => return out,
        Some("False") => "cluster.karmada.io/not-ready",
        _ => "cluster.karmada.io/unreachable",
    };
    for effect in ["NoSchedule", "NoExecute"] {
        out.push(Taint {
            key: key.into(),
            value: String::new(),
            effect: effect.into(),
        });
    }
    out
}

/// `None`: skipped (being deleted). `Some(Ok)`: passes; `Some(Err(reason))`: refused.
fn oracle_filter(b: &GenBinding, c: &GenCluster) -> Option<Result<(), String>> {
    if c.deleting {
        return None;
    }
    let used = b.clusters.iter().any(|(n, _)| *n == c.name);
    // APIEnablement.
    let listed = c
        .apis
        .as_ref()
        .and_then(|a| a.get(b.api_version))
        .is_some_and(|kinds| kinds.contains(&b.kind));
    if !used && !listed {
        return Some(Err("cluster(s) did not have the API resource".into()));
    }
    // TaintToleration (+ dramesh's NoExecute on clusters in use).
    for t in seen_taints(c) {
        let applies = if used {
            t.effect == "NoExecute"
        } else {
            t.effect == "NoSchedule" || t.effect == "NoExecute"
        };
        if applies && !b.tolerations.iter().any(|tol| tolerates(tol, &t)) {
            let shown = if t.value.is_empty() {
                format!("{}:{}", t.key, t.effect)
            } else {
                format!("{}={}:{}", t.key, t.value, t.effect)
            };
            return Some(Err(format!("cluster(s) had untolerated taint {{{shown}}}")));
        }
    }
    // ClusterAffinity.
    let matches = match &b.affinity {
        Affinity::None => true,
        // `util.ClusterMatches`: no names listed matches every cluster.
        Affinity::Names(n) => n.is_empty() || n.contains(&c.name),
        Affinity::Exclude(n) => !n.contains(&c.name),
        Affinity::Tier(t) => c.tier == *t,
    };
    if !matches {
        return Some(Err(
            "cluster(s) did not match the placement cluster affinity constraint".into(),
        ));
    }
    // SpreadConstraint.
    for f in &b.spread {
        let missing = match *f {
            "provider" if c.provider.is_none() => "provider",
            "region" if c.region.is_none() => "region",
            "zone" if c.zones.is_empty() => "zones",
            _ => continue,
        };
        return Some(Err(format!("cluster(s) did not have {missing} property")));
    }
    // ClusterEviction.
    if b.evicting.contains(&c.name) {
        return Some(Err("cluster(s) is in the process of eviction".into()));
    }
    Some(Ok(()))
}

/// Karmada's `FitError` message.
fn oracle_fit_error(total: usize, refused: &[String]) -> String {
    let mut hist: BTreeMap<&str, usize> = BTreeMap::new();
    for r in refused {
        *hist.entry(r).or_default() += 1;
    }
    let mut parts: Vec<String> = hist.iter().map(|(r, n)| format!("{n} {r}")).collect();
    parts.sort();
    format!("0/{total} clusters are available: {}.", parts.join(", "))
}

#[test]
fn filters_and_scores_match_karmadas_rules() {
    let mut r = Rng(0x5EED_0031);
    let view = View::new();
    let (mut no_fit, mut placed, mut api_refused, mut api_kept) = (0, 0, 0, 0);
    for case in 0..600 {
        let n = 3 + r.below(5) as usize;
        let members: Vec<GenCluster> = (0..n).map(|i| gen_cluster(&mut r, i)).collect();
        let b = gen_binding(&mut r, &members);
        let fleet: BTreeMap<String, Cluster> = members
            .iter()
            .map(|c| {
                let k = Cluster::from_value(&cluster_json(c)).expect("cluster");
                (c.name.clone(), k)
            })
            .collect();
        let binding =
            Binding::from_value(BindingKind::ResourceBinding, &binding_json(&b)).expect("binding");
        let d = demand(&binding, Some(&template(&b)), &[], &BTreeMap::new()).expect("demand");
        let decision = decide(
            &binding,
            &d,
            Fleet {
                clusters: &fleet,
                view: &view,
            },
            &mut Estimator::new(),
            &mut EstimateOptions::default(),
        );
        let ctx = format!("case {case}: {b:?}\nclusters: {members:?}\ndecision: {decision:?}");

        let mut feasible: BTreeSet<String> = BTreeSet::new();
        let mut refused = Vec::new();
        for c in &members {
            match oracle_filter(&b, c) {
                None => assert_eq!(
                    decision.excluded.get(&c.name).map(String::as_str),
                    Some("being deleted"),
                    "{ctx}"
                ),
                Some(Ok(())) => {
                    assert!(
                        !decision.excluded.contains_key(&c.name),
                        "{} passes Karmada's filters\n{ctx}",
                        c.name
                    );
                    feasible.insert(c.name.clone());
                }
                Some(Err(reason)) => {
                    assert_eq!(
                        decision.excluded.get(&c.name),
                        Some(&reason),
                        "{} is refused\n{ctx}",
                        c.name
                    );
                    if reason.contains("API resource") {
                        api_refused += 1;
                    }
                    refused.push(reason);
                }
            }
            let used = b.clusters.iter().any(|(n, _)| *n == c.name);
            let listed = c
                .apis
                .as_ref()
                .and_then(|a| a.get(b.api_version))
                .is_some_and(|k| k.contains(&b.kind));
            if used && !listed && feasible.contains(&c.name) {
                api_kept += 1;
            }
        }

        if feasible.is_empty() {
            no_fit += 1;
            assert_eq!(decision.condition.reason, Reason::NoClusterFit, "{ctx}");
            assert_eq!(
                decision.condition.message,
                oracle_fit_error(members.len(), &refused),
                "{ctx}"
            );
            assert_eq!(decision.clusters, Some(Vec::new()), "{ctx}");
            continue;
        }
        assert_eq!(decision.condition.reason, Reason::Success, "{ctx}");
        placed += 1;
        let result = decision.clusters.as_ref().expect("a result");
        for t in result {
            assert!(feasible.contains(&t.name), "{} was refused\n{ctx}", t.name);
        }
        let total: i64 = result.iter().map(|t| t.replicas).sum();
        if b.strategy == "Duplicated" {
            assert!(result.iter().all(|t| t.replicas == b.replicas), "{ctx}");
            if b.spread.is_empty() {
                let got: BTreeSet<String> = result.iter().map(|t| t.name.clone()).collect();
                assert_eq!(got, feasible, "Duplicated goes everywhere it fits\n{ctx}");
            }
        } else {
            assert_eq!(total, b.replicas, "{ctx}");
        }
        // ClusterLocality: on a steady scale up, Dynamic and Aggregated divisions keep what
        // the clusters in use that still pass hold.
        let kept: i64 = b
            .clusters
            .iter()
            .filter(|(n, _)| feasible.contains(n))
            .map(|(_, r)| r)
            .sum();
        if matches!(b.strategy, "Dynamic" | "Aggregated")
            && b.spread.is_empty()
            && kept <= b.replicas
        {
            for (n, was) in b.clusters.iter().filter(|(n, _)| feasible.contains(n)) {
                let now = result
                    .iter()
                    .find(|t| t.name == *n)
                    .map_or(0, |t| t.replicas);
                assert!(now >= *was, "{n} kept its {was} replicas\n{ctx}");
            }
        }
    }
    // The generator reached every branch that matters.
    assert!(no_fit > 50, "no-fit cases: {no_fit}");
    assert!(placed > 150, "placed cases: {placed}");
    assert!(
        api_refused > 100,
        "clusters refused for their API: {api_refused}"
    );
    assert!(
        api_kept > 10,
        "clusters in use kept without the API: {api_kept}"
    );
}
