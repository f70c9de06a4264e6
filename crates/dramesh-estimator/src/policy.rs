//! Karmada (Cluster)PropagationPolicy as dramesh reads it: cluster affinity, spread
//! constraints and the replica assignment strategy. Loading is strict: a field dramesh cannot
//! honour is an error naming the policy and the field.

use std::collections::BTreeMap;

use dramesh_model::k8s::Toleration;
use dramesh_model::{ClusterInfo, nodesel};
use serde_json::Value;

use crate::view::View;

/// A PropagationPolicy field dramesh cannot read.
#[derive(Debug, thiserror::Error)]
#[error("PropagationPolicy {policy}: field {field}: {message}")]
pub struct PolicyError {
    /// Policy name.
    pub policy: String,
    /// Path of the field at fault.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

/// A label selector requirement (`matchExpressions` item).
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct LabelRequirement {
    /// Label (or field) name.
    pub key: String,
    /// `In`, `NotIn`, `Exists` or `DoesNotExist`.
    pub operator: String,
    /// Values for `In` and `NotIn`.
    #[serde(default)]
    pub values: Vec<String>,
}

/// Which clusters a rule selects (Karmada `ClusterAffinity`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ClusterAffinity {
    /// `labelSelector.matchLabels`.
    pub match_labels: BTreeMap<String, String>,
    /// `labelSelector.matchExpressions`.
    pub match_expressions: Vec<LabelRequirement>,
    /// `fieldSelector.matchExpressions` on provider / region / zone.
    pub field_expressions: Vec<LabelRequirement>,
    /// `clusterNames`: when non-empty, only these clusters.
    pub cluster_names: Vec<String>,
    /// `exclude`: clusters never selected.
    pub exclude: Vec<String>,
    /// True when a `labelSelector` was given.
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
        let lists = [
            ("labelSelector.matchExpressions", &a.match_expressions),
            ("fieldSelector.matchExpressions", &a.field_expressions),
        ];
        for (list, reqs) in lists {
            for (i, r) in reqs.iter().enumerate() {
                // Label selectors have no Gt/Lt (`metav1.LabelSelectorAsSelector`); the rest
                // is `labels.NewRequirement`, via the one implementation in nodesel.
                let fault = if matches!(r.operator.as_str(), "Gt" | "Lt") {
                    Some((
                        "operator",
                        format!("{:?} is not a valid label selector operator", r.operator),
                    ))
                } else {
                    nodesel::requirement(&r.key, &r.operator, &r.values, None)
                        .err()
                        .map(|e| (e.field, e.message))
                };
                if let Some((f, m)) = fault {
                    return Err(err(&format!("{list}[{i}].{f}"), m));
                }
            }
        }
        Ok(a)
    }

    /// Names of the view's clusters this affinity matches, in the view's order.
    pub fn matching_clusters(&self, view: &View) -> Vec<String> {
        view.clusters()
            .filter(|c| self.matches(&c.name, &c.info))
            .map(|c| c.name.clone())
            .collect()
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

/// A requirement validated at load; one that is malformed anyway matches nothing.
fn requirement(r: &LabelRequirement, v: Option<&str>) -> bool {
    nodesel::requirement(&r.key, &r.operator, &r.values, v) == Ok(true)
}

/// How replicas are assigned.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum Strategy {
    /// Every selected cluster runs all replicas.
    Duplicated,
    /// Divided over as few clusters as hold them.
    Aggregated,
    /// Divided by fixed weights per cluster affinity.
    StaticWeight(Vec<(ClusterAffinity, i64)>),
    /// Divided in proportion to each cluster's available replicas.
    DynamicWeight,
}

impl Strategy {
    /// The strategy's name as reported.
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
    /// `spreadByField` (`cluster` and `region` select, as in Karmada; `zone` and `provider`
    /// are accepted and select nothing of their own; see `placement::select_spread`).
    pub spread_by_field: Option<String>,
    /// `spreadByLabel`.
    pub spread_by_label: Option<String>,
    /// `maxGroups`, taken as written, as Karmada takes it (0 selects no cluster).
    pub max_groups: usize,
    /// `minGroups`.
    pub min_groups: usize,
}

/// One of `placement.clusterAffinities`: a named affinity, tried in order.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AffinityTerm {
    /// `affinityName`.
    pub name: String,
    /// The term's cluster affinity.
    pub affinity: ClusterAffinity,
}

/// The parts of a (Cluster)PropagationPolicy placement dramesh acts on.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Policy {
    /// `metadata.name`.
    pub name: String,
    /// `placement.clusterAffinity`.
    pub affinity: Option<ClusterAffinity>,
    /// `placement.clusterAffinities`: Karmada tries them in order and keeps the first that
    /// schedules (never together with `clusterAffinity`).
    pub affinities: Vec<AffinityTerm>,
    /// `placement.clusterTolerations`, matched against cluster taints.
    pub tolerations: Vec<Toleration>,
    /// How replicas are assigned.
    pub strategy: Strategy,
    /// `placement.spreadConstraints`.
    pub spread: Vec<SpreadConstraint>,
}

impl Policy {
    /// Reads a PropagationPolicy or ClusterPropagationPolicy as users write it.
    pub fn from_value(v: &Value) -> Result<Policy, PolicyError> {
        let name = v
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        Policy::from_placement(name, v.pointer("/spec/placement").unwrap_or(&Value::Null))
    }

    /// Reads a `spec.placement` (of a policy, or of a ResourceBinding, which carries the
    /// policy's placement); errors name the field as `spec.placement.…` and `name` as the policy.
    pub fn from_placement(name: &str, placement: &Value) -> Result<Policy, PolicyError> {
        let name = name.to_string();
        let err = |f: &str, m: String| PolicyError {
            policy: name.clone(),
            field: f.to_string(),
            message: m,
        };
        let affinity = match placement.get("clusterAffinity").filter(|x| !x.is_null()) {
            Some(a) => Some(ClusterAffinity::from_value(
                a,
                "spec.placement.clusterAffinity",
                &name,
            )?),
            None => None,
        };
        let mut affinities = Vec::new();
        if let Some(terms) = placement.get("clusterAffinities").filter(|x| !x.is_null()) {
            let terms = terms
                .as_array()
                .ok_or_else(|| err("spec.placement.clusterAffinities", "not a list".into()))?;
            if affinity.is_some() && !terms.is_empty() {
                return Err(err(
                    "spec.placement.clusterAffinities",
                    "clusterAffinities can not co-exist with clusterAffinity".into(),
                ));
            }
            for (i, t) in terms.iter().enumerate() {
                let f = format!("spec.placement.clusterAffinities[{i}]");
                let term_name = t
                    .get("affinityName")
                    .and_then(Value::as_str)
                    .filter(|n| !n.is_empty())
                    .ok_or_else(|| err(&format!("{f}.affinityName"), "required".into()))?;
                if affinities
                    .iter()
                    .any(|a: &AffinityTerm| a.name == term_name)
                {
                    return Err(err(
                        &format!("{f}.affinityName"),
                        format!("duplicate affinityName {term_name:?}"),
                    ));
                }
                affinities.push(AffinityTerm {
                    name: term_name.to_string(),
                    affinity: ClusterAffinity::from_value(t, &f, &name)?,
                });
            }
        }
        let tolerations = match placement.get("clusterTolerations").filter(|x| !x.is_null()) {
            Some(t) => serde_json::from_value(t.clone())
                .map_err(|e| err("spec.placement.clusterTolerations", e.to_string()))?,
            None => Vec::new(),
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
            affinities,
            tolerations,
            strategy,
            spread,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(affinity: Value) -> Result<Policy, PolicyError> {
        Policy::from_value(&serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"placement": {"clusterAffinity": affinity}}
        }))
    }

    fn label_expr(op: &str, values: Option<Vec<&str>>) -> Value {
        let mut r = serde_json::json!({"key": "tier", "operator": op});
        if let Some(v) = values {
            r["values"] = serde_json::json!(v);
        }
        serde_json::json!({"labelSelector": {"matchExpressions": [r]}})
    }

    /// `labels.NewRequirement`: In/NotIn need values, Exists/DoesNotExist take none. Both
    /// malformed forms used to load (`NotIn` with no values then matched every cluster).
    #[test]
    fn malformed_label_requirements_are_rejected_naming_the_field() {
        for (op, values) in [
            ("In", None),
            ("NotIn", None),
            ("NotIn", Some(vec![])),
            ("Exists", Some(vec!["a"])),
            ("DoesNotExist", Some(vec!["a"])),
        ] {
            let e = policy(label_expr(op, values.clone())).expect_err(op);
            assert_eq!(
                e.field, "spec.placement.clusterAffinity.labelSelector.matchExpressions[0].values",
                "{op} {values:?}: {e}"
            );
            assert_eq!(e.policy, "p");
        }
        let e = policy(label_expr("Gt", Some(vec!["1"]))).expect_err("Gt");
        assert!(
            e.field
                .ends_with("labelSelector.matchExpressions[0].operator"),
            "{e}"
        );
        let e = policy(label_expr("Near", Some(vec!["1"]))).expect_err("Near");
        assert!(
            e.field
                .ends_with("labelSelector.matchExpressions[0].operator"),
            "{e}"
        );
        let e = policy(serde_json::json!({"fieldSelector": {"matchExpressions": [
            {"key": "region", "operator": "In", "values": ["eu"]},
            {"key": "zone", "operator": "In"}
        ]}}))
        .expect_err("field selector");
        assert!(
            e.field
                .ends_with("fieldSelector.matchExpressions[1].values"),
            "{e}"
        );
    }

    #[test]
    fn cluster_affinities_and_tolerations_are_read() {
        let p = Policy::from_value(&serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"placement": {
                "clusterAffinities": [
                    {"affinityName": "primary", "clusterNames": ["a"]},
                    {"affinityName": "backup", "labelSelector": {"matchLabels": {"tier": "spare"}}}
                ],
                "clusterTolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
            }}
        }))
        .expect("valid");
        let names: Vec<&str> = p.affinities.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["primary", "backup"]);
        assert_eq!(p.affinities[0].affinity.cluster_names, ["a"]);
        assert_eq!(p.tolerations[0].key.as_deref(), Some("gpu"));
        let bad = |placement: Value| {
            Policy::from_value(
                &serde_json::json!({"metadata": {"name": "p"}, "spec": {"placement": placement}}),
            )
            .expect_err("invalid")
        };
        let e = bad(serde_json::json!({"clusterAffinities": [{"clusterNames": ["a"]}]}));
        assert_eq!(e.field, "spec.placement.clusterAffinities[0].affinityName");
        let e = bad(serde_json::json!({"clusterAffinities": [
            {"affinityName": "x"}, {"affinityName": "x"}]}));
        assert_eq!(e.field, "spec.placement.clusterAffinities[1].affinityName");
        let e = bad(
            serde_json::json!({"clusterAffinity": {}, "clusterAffinities": [{"affinityName": "x"}]}),
        );
        assert_eq!(e.field, "spec.placement.clusterAffinities");
        let e = bad(serde_json::json!({"clusterTolerations": [{"key": 1}]}));
        assert_eq!(e.field, "spec.placement.clusterTolerations");
        let e = bad(serde_json::json!({"clusterAffinities": [
            {"affinityName": "x", "labelSelector": {"matchExpressions": [{"key": "k", "operator": "In"}]}}]}));
        assert_eq!(
            e.field,
            "spec.placement.clusterAffinities[0].labelSelector.matchExpressions[0].values"
        );
    }

    #[test]
    fn well_formed_requirements_match_as_kubernetes() {
        let info = |tier: Option<&str>| ClusterInfo {
            labels: tier
                .map(|t| BTreeMap::from([("tier".to_string(), t.to_string())]))
                .unwrap_or_default(),
            ..ClusterInfo::default()
        };
        let cases = [
            (label_expr("In", Some(vec!["gold"])), [true, false, false]),
            (label_expr("NotIn", Some(vec!["gold"])), [false, true, true]),
            (label_expr("Exists", None), [true, true, false]),
            (
                label_expr("DoesNotExist", Some(vec![])),
                [false, false, true],
            ),
        ];
        for (affinity, want) in cases {
            let p = policy(affinity.clone()).expect("valid");
            let a = p.affinity.as_ref().expect("affinity");
            let got = [Some("gold"), Some("silver"), None].map(|t| a.matches("c", &info(t)));
            assert_eq!(got, want, "{affinity}");
        }
    }
}
