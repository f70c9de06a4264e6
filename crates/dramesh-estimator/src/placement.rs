//! Placement from a Karmada PropagationPolicy: cluster affinity, spread constraints by
//! cluster, and the four replica assignment strategies (Duplicated, Divided with static
//! weights, Divided with dynamic weight by available replicas, Divided aggregated).
//!
//! Division uses the Webster (Sainte-Laguë) method as Karmada does: the next replica goes
//! to the cluster with the highest `weight / (2 * assigned + 1)`; ties go to the cluster
//! with fewer replicas, then by name in an order (ascending or descending) chosen by the
//! parity of the FNV-1a hash of the workload identity, so equal-weight clusters do not
//! always favour the same name. Static weights ignore capacity and spread constraints;
//! dynamic strategies fail as unschedulable when the selected clusters' available replicas
//! sum to less than the workload's replicas.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};

use dramesh_model::ClusterInfo;
use serde_json::Value;

use crate::estimate::{EstimateOptions, Estimator};
use crate::view::View;
use crate::workload::Workload;

#[derive(Debug, thiserror::Error)]
#[error("PropagationPolicy {policy}: field {field}: {message}")]
pub struct PolicyError {
    pub policy: String,
    pub field: String,
    pub message: String,
}

/// A label selector requirement (`matchExpressions` item).
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct LabelRequirement {
    pub key: String,
    pub operator: String,
    #[serde(default)]
    pub values: Vec<String>,
}

/// Which clusters a rule selects (Karmada `ClusterAffinity`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ClusterAffinity {
    pub match_labels: BTreeMap<String, String>,
    pub match_expressions: Vec<LabelRequirement>,
    /// `fieldSelector.matchExpressions` on provider / region / zone.
    pub field_expressions: Vec<LabelRequirement>,
    pub cluster_names: Vec<String>,
    pub exclude: Vec<String>,
    pub has_label_selector: bool,
}

impl ClusterAffinity {
    fn from_value(v: &Value, field: &str, policy: &str) -> Result<ClusterAffinity, PolicyError> {
        let err = |f: &str, m: String| PolicyError {
            policy: policy.to_string(),
            field: format!("{field}.{f}"),
            message: m,
        };
        let strings = |key: &str| -> Result<Vec<String>, PolicyError> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(x) => serde_json::from_value(x.clone()).map_err(|e| err(key, e.to_string())),
            }
        };
        let mut a = ClusterAffinity {
            cluster_names: strings("clusterNames")?,
            exclude: strings("exclude")?,
            ..Default::default()
        };
        if let Some(ls) = v.get("labelSelector").filter(|x| !x.is_null()) {
            a.has_label_selector = true;
            if let Some(ml) = ls.get("matchLabels").filter(|x| !x.is_null()) {
                a.match_labels = serde_json::from_value(ml.clone())
                    .map_err(|e| err("labelSelector.matchLabels", e.to_string()))?;
            }
            if let Some(me) = ls.get("matchExpressions").filter(|x| !x.is_null()) {
                a.match_expressions = serde_json::from_value(me.clone())
                    .map_err(|e| err("labelSelector.matchExpressions", e.to_string()))?;
            }
        }
        if let Some(me) = v
            .get("fieldSelector")
            .and_then(|f| f.get("matchExpressions"))
            .filter(|x| !x.is_null())
        {
            a.field_expressions = serde_json::from_value(me.clone())
                .map_err(|e| err("fieldSelector.matchExpressions", e.to_string()))?;
        }
        for r in a.match_expressions.iter().chain(&a.field_expressions) {
            if !matches!(
                r.operator.as_str(),
                "In" | "NotIn" | "Exists" | "DoesNotExist"
            ) {
                return Err(err(
                    "matchExpressions",
                    format!("unknown operator {:?} for key {:?}", r.operator, r.key),
                ));
            }
        }
        Ok(a)
    }

    /// Karmada `ClusterMatches`.
    pub fn matches(&self, name: &str, info: &ClusterInfo) -> bool {
        if self.exclude.iter().any(|e| e == name) {
            return false;
        }
        for (k, v) in &self.match_labels {
            if info.labels.get(k) != Some(v) {
                return false;
            }
        }
        if !self
            .match_expressions
            .iter()
            .all(|r| requirement(r, info.labels.get(&r.key).map(String::as_str)))
        {
            return false;
        }
        for r in &self.field_expressions {
            let v = match r.key.as_str() {
                "provider" => info.provider.as_deref(),
                "region" => info.region.as_deref(),
                "zone" => info.zone.as_deref(),
                _ => None,
            };
            if !requirement(r, v) {
                return false;
            }
        }
        if !self.cluster_names.is_empty() && !self.cluster_names.iter().any(|c| c == name) {
            return false;
        }
        true
    }
}

fn requirement(r: &LabelRequirement, v: Option<&str>) -> bool {
    match r.operator.as_str() {
        "In" => v.is_some_and(|v| r.values.iter().any(|x| x == v)),
        "NotIn" => v.is_none_or(|v| !r.values.iter().any(|x| x == v)),
        "Exists" => v.is_some(),
        "DoesNotExist" => v.is_none(),
        _ => false,
    }
}

/// How replicas are assigned.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum Strategy {
    Duplicated,
    Aggregated,
    StaticWeight(Vec<(ClusterAffinity, i64)>),
    DynamicWeight,
}

impl Strategy {
    pub fn name(&self) -> &'static str {
        match self {
            Strategy::Duplicated => "Duplicated",
            Strategy::Aggregated => "Aggregated",
            Strategy::StaticWeight(_) => "StaticWeight",
            Strategy::DynamicWeight => "DynamicWeight",
        }
    }
}

/// A spread constraint.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SpreadConstraint {
    pub spread_by_field: Option<String>,
    pub spread_by_label: Option<String>,
    pub max_groups: usize,
    pub min_groups: usize,
}

/// The parts of a (Cluster)PropagationPolicy placement dramesh acts on.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Policy {
    pub name: String,
    pub affinity: Option<ClusterAffinity>,
    pub strategy: Strategy,
    pub spread: Vec<SpreadConstraint>,
}

impl Policy {
    /// Reads a PropagationPolicy or ClusterPropagationPolicy as users write it.
    pub fn from_value(v: &Value) -> Result<Policy, PolicyError> {
        let name = v
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let err = |f: &str, m: String| PolicyError {
            policy: name.clone(),
            field: f.to_string(),
            message: m,
        };
        let placement = v.pointer("/spec/placement").cloned().unwrap_or(Value::Null);
        let affinity = match placement.get("clusterAffinity").filter(|x| !x.is_null()) {
            Some(a) => Some(ClusterAffinity::from_value(
                a,
                "spec.placement.clusterAffinity",
                &name,
            )?),
            None => None,
        };
        let rs = placement.get("replicaScheduling").filter(|x| !x.is_null());
        let strategy = match rs {
            None => Strategy::Duplicated,
            Some(rs) => {
                let ty = rs
                    .get("replicaSchedulingType")
                    .and_then(Value::as_str)
                    .unwrap_or("Divided");
                match ty {
                    "Duplicated" => Strategy::Duplicated,
                    "Divided" => {
                        let pref = rs
                            .get("replicaDivisionPreference")
                            .and_then(Value::as_str)
                            .unwrap_or("");
                        let wp = rs.get("weightPreference").filter(|x| !x.is_null());
                        match pref {
                            "Aggregated" => Strategy::Aggregated,
                            "Weighted" | "" => {
                                let dynamic = wp
                                    .and_then(|w| w.get("dynamicWeight"))
                                    .and_then(Value::as_str)
                                    .unwrap_or("");
                                if !dynamic.is_empty() {
                                    if dynamic != "AvailableReplicas" {
                                        return Err(err(
                                            "spec.placement.replicaScheduling.weightPreference.dynamicWeight",
                                            format!(
                                                "unsupported value {dynamic:?} (only AvailableReplicas)"
                                            ),
                                        ));
                                    }
                                    Strategy::DynamicWeight
                                } else {
                                    let mut list = Vec::new();
                                    let items = wp
                                        .and_then(|w| w.get("staticWeightList"))
                                        .and_then(Value::as_array)
                                        .cloned()
                                        .unwrap_or_default();
                                    for (i, item) in items.iter().enumerate() {
                                        let f = format!(
                                            "spec.placement.replicaScheduling.weightPreference.staticWeightList[{i}]"
                                        );
                                        let target = item
                                            .get("targetCluster")
                                            .cloned()
                                            .unwrap_or(Value::Null);
                                        let a = ClusterAffinity::from_value(
                                            &target,
                                            &format!("{f}.targetCluster"),
                                            &name,
                                        )?;
                                        let weight = item
                                            .get("weight")
                                            .and_then(Value::as_i64)
                                            .ok_or_else(|| {
                                                err(
                                                    &format!("{f}.weight"),
                                                    "missing or not an integer".into(),
                                                )
                                            })?;
                                        if weight < 1 {
                                            return Err(err(
                                                &format!("{f}.weight"),
                                                "must be at least 1".into(),
                                            ));
                                        }
                                        list.push((a, weight));
                                    }
                                    Strategy::StaticWeight(list)
                                }
                            }
                            other => {
                                return Err(err(
                                    "spec.placement.replicaScheduling.replicaDivisionPreference",
                                    format!("unknown value {other:?}"),
                                ));
                            }
                        }
                    }
                    other => {
                        return Err(err(
                            "spec.placement.replicaScheduling.replicaSchedulingType",
                            format!("unknown value {other:?}"),
                        ));
                    }
                }
            }
        };
        let mut spread = Vec::new();
        for (i, s) in placement
            .get("spreadConstraints")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            let f = format!("spec.placement.spreadConstraints[{i}]");
            let by_field = s
                .get("spreadByField")
                .and_then(Value::as_str)
                .map(str::to_string);
            let by_label = s
                .get("spreadByLabel")
                .and_then(Value::as_str)
                .map(str::to_string);
            if by_field.is_some() == by_label.is_some() {
                return Err(err(
                    &f,
                    "exactly one of spreadByField and spreadByLabel must be set".into(),
                ));
            }
            let min = s.get("minGroups").and_then(Value::as_u64).unwrap_or(1) as usize;
            let max = s.get("maxGroups").and_then(Value::as_u64).unwrap_or(0) as usize;
            if max != 0 && min > max {
                return Err(err(&f, format!("minGroups {min} exceeds maxGroups {max}")));
            }
            spread.push(SpreadConstraint {
                spread_by_field: by_field,
                spread_by_label: by_label,
                max_groups: max,
                min_groups: min,
            });
        }
        Ok(Policy {
            name,
            affinity,
            strategy,
            spread,
        })
    }
}

/// Replicas assigned to one cluster.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TargetCluster {
    pub name: String,
    pub replicas: i64,
}

/// The result of placing a workload.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PlacementResult {
    pub policy: String,
    pub strategy: String,
    pub replicas: i64,
    pub clusters: Vec<TargetCluster>,
    /// Available replicas of each candidate cluster (from the estimate).
    pub available: BTreeMap<String, i64>,
    /// Clusters that the affinity excluded.
    pub filtered_out: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unschedulable: Option<String>,
}

/// FNV-1a, 32 bit.
pub fn fnv32a(data: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in data {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

#[derive(Debug, Clone)]
struct Party {
    name: String,
    votes: i64,
    seats: i64,
    /// Names compare ascending when true.
    ascending: bool,
}

impl Party {
    fn cmp_priority(&self, other: &Party) -> Ordering {
        // votes/(2s+1) compared exactly by cross-multiplication.
        let l = i128::from(self.votes) * i128::from(2 * other.seats + 1);
        let r = i128::from(other.votes) * i128::from(2 * self.seats + 1);
        l.cmp(&r)
            .then_with(|| other.seats.cmp(&self.seats))
            .then_with(|| {
                if self.ascending {
                    other.name.cmp(&self.name)
                } else {
                    self.name.cmp(&other.name)
                }
            })
    }
}

impl PartialEq for Party {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Party {}
impl PartialOrd for Party {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Party {
    fn cmp(&self, other: &Self) -> Ordering {
        self.cmp_priority(other)
    }
}

/// Webster (Sainte-Laguë) apportionment of `seats` among `(name, votes, initial seats)`.
/// `ascending` picks the name order used for the last tie break. Returns seats per name in
/// the input order.
pub fn webster(seats: i64, parties: &[(String, i64, i64)], ascending: bool) -> Vec<(String, i64)> {
    let mut heap: BinaryHeap<Party> = parties
        .iter()
        .map(|(n, v, s)| Party {
            name: n.clone(),
            votes: *v,
            seats: *s,
            ascending,
        })
        .collect();
    if heap.is_empty() {
        return Vec::new();
    }
    for _ in 0..seats.max(0) {
        let Some(mut p) = heap.pop() else { break };
        p.seats += 1;
        heap.push(p);
    }
    let got: BTreeMap<String, i64> = heap.into_iter().map(|p| (p.name, p.seats)).collect();
    parties
        .iter()
        .map(|(n, _, _)| (n.clone(), got.get(n).copied().unwrap_or(0)))
        .collect()
}

/// The name order of ties for this workload (see the module docs).
pub fn tie_ascending(w: &Workload) -> bool {
    let id = w
        .uid
        .clone()
        .unwrap_or_else(|| format!("{}/{}", w.namespace, w.name));
    fnv32a(id.as_bytes()).is_multiple_of(2)
}

/// Karmada's cluster-spread selection: keep the best `maxGroups` clusters, swapping in
/// clusters with more available replicas when the kept ones cannot hold `need` replicas.
/// `ranked` must be sorted best first. `need` is `None` for Duplicated placements.
pub fn select_by_cluster(
    ranked: &[(String, i64)],
    c: &SpreadConstraint,
    need: Option<i64>,
) -> Result<Vec<(String, i64)>, String> {
    if ranked.len() < c.min_groups {
        return Err(format!(
            "{} feasible clusters, fewer than minGroups {}",
            ranked.len(),
            c.min_groups
        ));
    }
    let want = if c.max_groups == 0 {
        ranked.len()
    } else {
        c.max_groups.min(ranked.len())
    };
    let mut chosen: Vec<(String, i64)> = ranked[..want].to_vec();
    let Some(need) = need else {
        return Ok(chosen);
    };
    let mut rest: Vec<(String, i64)> = ranked[want..].to_vec();
    let sum = |v: &[(String, i64)]| v.iter().map(|x| x.1).sum::<i64>();
    if sum(&chosen) >= need {
        return Ok(chosen);
    }
    rest.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut i = chosen.len();
    while i > 0 && sum(&chosen) < need {
        i -= 1;
        if let Some(best) = rest.first()
            && best.1 > chosen[i].1
        {
            let out = std::mem::replace(&mut chosen[i], rest.remove(0));
            rest.push(out);
            rest.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        }
    }
    if sum(&chosen) < need {
        return Err(format!(
            "no enough resource when selecting {want} clusters: {} available replicas for {need}",
            sum(&chosen)
        ));
    }
    Ok(chosen)
}

/// Assigns `replicas` over selected clusters `(name, available)` (best first) by strategy.
/// `all_candidates` holds every candidate with its ClusterInfo for static weight matching.
pub fn assign(
    strategy: &Strategy,
    replicas: i64,
    selected: &[(String, i64)],
    infos: &BTreeMap<String, ClusterInfo>,
    ascending: bool,
) -> Result<Vec<TargetCluster>, String> {
    let nonzero = |v: Vec<(String, i64)>| -> Vec<TargetCluster> {
        v.into_iter()
            .filter(|(_, r)| *r > 0)
            .map(|(name, replicas)| TargetCluster { name, replicas })
            .collect()
    };
    match strategy {
        Strategy::Duplicated => Ok(selected
            .iter()
            .map(|(n, _)| TargetCluster {
                name: n.clone(),
                replicas,
            })
            .collect()),
        Strategy::StaticWeight(rules) => {
            let default_info = ClusterInfo::default();
            let mut weights: Vec<(String, i64, i64)> = selected
                .iter()
                .map(|(n, _)| {
                    let info = infos.get(n).unwrap_or(&default_info);
                    let w = rules
                        .iter()
                        .filter(|(a, _)| a.matches(n, info))
                        .map(|(_, w)| *w)
                        .max()
                        .unwrap_or(0);
                    (n.clone(), w, 0)
                })
                .collect();
            if weights.iter().all(|w| w.1 == 0) {
                for w in &mut weights {
                    w.1 = 1;
                }
            }
            weights.retain(|w| w.1 > 0);
            Ok(nonzero(webster(replicas, &weights, ascending)))
        }
        Strategy::DynamicWeight | Strategy::Aggregated => {
            let total: i64 = selected.iter().map(|(_, a)| (*a).max(0)).sum();
            if total < replicas {
                return Err(format!(
                    "clusters available replicas {total} are not enough to schedule {replicas}"
                ));
            }
            let mut sorted: Vec<(String, i64)> = selected.to_vec();
            sorted.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            if *strategy == Strategy::Aggregated {
                let mut acc = 0;
                let mut keep = 0;
                for (_, a) in &sorted {
                    keep += 1;
                    acc += a;
                    if acc >= replicas {
                        break;
                    }
                }
                sorted.truncate(keep);
            }
            let parties: Vec<(String, i64, i64)> = sorted
                .iter()
                .map(|(n, a)| (n.clone(), (*a).max(0), 0))
                .collect();
            Ok(nonzero(webster(replicas, &parties, ascending)))
        }
    }
}

/// Places `w` on the view's clusters according to `policy`, estimating capacity with
/// `estimator`.
pub fn place(
    view: &View,
    w: &Workload,
    policy: &Policy,
    estimator: &mut Estimator,
    opts: &EstimateOptions,
) -> PlacementResult {
    let mut infos = BTreeMap::new();
    let mut candidates = Vec::new();
    let mut filtered_out = Vec::new();
    for c in view.clusters() {
        if !opts.clusters.is_empty() && !opts.clusters.contains(&c.name) {
            continue;
        }
        infos.insert(c.name.clone(), c.info.clone());
        let ok = policy
            .affinity
            .as_ref()
            .is_none_or(|a| a.matches(&c.name, &c.info));
        if ok {
            candidates.push(c.name.clone());
        } else {
            filtered_out.push(c.name.clone());
        }
    }
    let mut result = PlacementResult {
        policy: policy.name.clone(),
        strategy: policy.strategy.name().to_string(),
        replicas: w.replicas,
        clusters: Vec::new(),
        available: BTreeMap::new(),
        filtered_out,
        unschedulable: None,
    };
    if candidates.is_empty() {
        result.unschedulable = Some("no cluster matches the placement's cluster affinity".into());
        return result;
    }
    let needs_estimate = !matches!(
        policy.strategy,
        Strategy::Duplicated | Strategy::StaticWeight(_)
    ) || !policy.spread.is_empty();
    let mut ranked: Vec<(String, i64)> = if needs_estimate {
        let mut o = opts.clone();
        o.clusters = candidates.clone();
        let est = estimator.estimate(view, w, &o);
        est.clusters
            .iter()
            .map(|c| (c.name.clone(), c.max_replicas))
            .collect()
    } else {
        candidates.iter().map(|n| (n.clone(), 0)).collect()
    };
    if needs_estimate {
        for (n, a) in &ranked {
            result.available.insert(n.clone(), *a);
        }
    }
    // Karmada ranks by score (all equal here), then available replicas, then name.
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let selected = if policy.spread.is_empty()
        || matches!(policy.strategy, Strategy::StaticWeight(_))
    {
        ranked
    } else {
        let by_cluster: Vec<&SpreadConstraint> = policy
            .spread
            .iter()
            .filter(|s| s.spread_by_field.as_deref() == Some("cluster"))
            .collect();
        if by_cluster.len() != policy.spread.len() {
            result.unschedulable = Some("only spread constraints by cluster are supported".into());
            return result;
        }
        let need = match policy.strategy {
            Strategy::Duplicated => None,
            _ => Some(w.replicas),
        };
        match select_by_cluster(&ranked, by_cluster[0], need) {
            Ok(s) => s,
            Err(e) => {
                result.unschedulable = Some(e);
                return result;
            }
        }
    };
    match assign(
        &policy.strategy,
        w.replicas,
        &selected,
        &infos,
        tie_ascending(w),
    ) {
        Ok(t) => result.clusters = t,
        Err(e) => result.unschedulable = Some(e),
    }
    result
}
